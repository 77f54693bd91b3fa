/* Helpers of the white-box tests (white_box_util.h). */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

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
