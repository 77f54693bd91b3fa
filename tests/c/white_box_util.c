/* Helpers of the white-box tests (white_box_util.h). */
#include <inttypes.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmocka.h>

#include "core/engine.h"
#include "core/block.h"
#include "white_box_util.h"

static kvh_engine *held;

void wb_lock(kvh_engine *e)
{
    pthread_mutex_lock(&e->lock);
    held = e;
    /* Show the engine as the next call sees it: releases that returned
     * are applied (core/block.h). */
    if (e->release_backlog_len)
        kvhi_block_releases_apply(e);
}

void wb_lock_as_is(kvh_engine *e)
{
    pthread_mutex_lock(&e->lock);
    held = e;
}

void wb_settle(kvh_engine *e)
{
    wb_lock(e);
    wb_unlock(e);
}

void wb_unlock(kvh_engine *e)
{
    held = NULL;
    pthread_mutex_unlock(&e->lock);
}

void wb_release_held_lock(void)
{
    if (held)
        wb_unlock(held);
}

void wb_check_disk_copies(kvh_engine *e)
{
    wb_lock(e);
    uint64_t n = 0;
    for (uint32_t b = 0; b < e->block_cap; b++) {
        const kvhi_block *blk = &e->blocks[b];
        if (!(blk->flags & KVHI_BF_DISK_COPY))
            continue;
        n++;
        uint32_t at = e->disk_copy_at[blk->disk_copy];
        if (at >= e->disk_copy_count || e->disk_copy_list[at] != b) {
            wb_unlock(e);
            fail_msg("block %u has a disk copy in slot %u that the list does not name", b, blk->disk_copy);
        }
    }
    uint64_t listed = e->disk_copy_count;
    wb_unlock(e);
    assert_int_equal(n, listed);
}

uint32_t wb_block_index(kvh_engine *e, kvh_block h)
{
    uint32_t b = KVHI_NO_BLOCK;
    wb_lock(e);
    kvh_status st = kvhi_block_resolve(e, h, &b);
    wb_unlock(e);
    assert_int_equal(st, KVH_OK);
    return b;
}

uint32_t wb_seq_block_index(kvh_engine *e, kvh_seq s, uint64_t i)
{
    kvh_block h = {0};
    assert_int_equal(kvh_seq_blocks(e, s, i, 1, &h), KVH_OK);
    return wb_block_index(e, h);
}

pid_t wb_thread_id(void) { return (pid_t)syscall(SYS_gettid); }

/* Whether tid is in futex(2) on an address inside [obj, obj + size). The
 * file gives the syscall number and its arguments while a thread is
 * blocked in one, "running" otherwise. */
static int blocked_on(pid_t tid, const void *obj, size_t size)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/self/task/%d/syscall", (int)tid);
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    long nr = -1;
    uintptr_t addr = 0;
    int got = fgets(line, sizeof(line), f) && sscanf(line, "%ld %" SCNxPTR, &nr, &addr) == 2;
    fclose(f);
    uintptr_t lo = (uintptr_t)obj;
    return got && nr == SYS_futex && addr >= lo && addr < lo + size;
}

void wb_wait_blocked_on(pid_t tid, const void *obj, size_t size)
{
    for (int i = 0; i < 10000; i++) {
        if (blocked_on(tid, obj, size))
            return;
        usleep(1000);
    }
    char path[64], line[256] = "(unreadable)";
    snprintf(path, sizeof(path), "/proc/self/task/%d/syscall", (int)tid);
    FILE *f = fopen(path, "r");
    if (f) {
        if (!fgets(line, sizeof(line), f))
            snprintf(line, sizeof(line), "(empty)");
        fclose(f);
    }
    fail_msg("thread %d did not block on %p in 10 s; its system call: %s", (int)tid, obj, line);
}
