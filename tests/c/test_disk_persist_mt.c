/* kvh_blocks_persist (core/disk_tier.c) racing other threads' calls on
 * the blocks it writes.
 *
 * A write of KV makes each block of its range private first, then brings
 * the blocks in one by one, which drops the engine lock while an earlier
 * block is read from disk. A persist in that window publishes a private
 * block that has no cached twin and starts its disk copy: the write must
 * not then change the block in place, or the copy is torn and the block's
 * next demotion reuses it, reading back bytes from before the write.
 *
 * A persist that must wait for a disk slot drops the lock too: the block
 * it chose may meanwhile have gained a disk copy (or be writing one), and
 * must be checked again before it is written, or a disk slot leaks. */
#include <sched.h>
#include <stdatomic.h>

#include "disk_test_util.h"
#include "mt_util.h"

#include "core/engine.h"
#include "white_box_util.h"
#include "core/block.h"
#include "core/block_state.h"

static const dt_geo G = {2, 1, 32, 16, KVH_DTYPE_F16}; /* block = 4096 bytes */
#define TOKEN_ELEMS (1 * 32)
#define BLOCKS 4

static _Atomic uint64_t persist_target; /* a kvh_block handle; 0: none */
static atomic_int persist_go, persist_stop;

static int teardown(void **state)
{
    wb_release_held_lock();
    return dt_teardown(state);
}

/* Every K and V element of block j of s is v. */
static bool block_reads(kvh_engine *e, kvh_seq s, int j, uint16_t v, char *msg, size_t len)
{
    uint16_t k[16 * TOKEN_ELEMS], vv[16 * TOKEN_ELEMS];
    for (uint32_t l = 0; l < G.layers; l++) {
        kvh_status st = kvh_seq_read_kv(e, s, l, (uint64_t)j * G.bt, G.bt, k, vv);
        if (st != KVH_OK) {
            snprintf(msg, len, "read_kv: %s", kvh_status_name(st));
            return false;
        }
        for (size_t i = 0; i < G.bt * TOKEN_ELEMS; i++)
            if (k[i] != v || vv[i] != v) {
                snprintf(msg, len, "block %d layer %u element %zu: %04x %04x, expected %04x", j, l, i, k[i], vv[i], v);
                return false;
            }
    }
    return true;
}

/* Persists the published handle, over and over while go is set. */
static void *persister(void *arg)
{
    mt_worker *w = arg;
    while (!atomic_load(&persist_stop)) {
        if (!atomic_load(&persist_go)) {
            sched_yield();
            continue;
        }
        kvh_block h = {atomic_load(&persist_target)};
        kvh_status st = kvh_blocks_persist(w->e, &h, 1, NULL);
        /* BAD_HANDLE: the write replaced the block by a private copy. */
        if (st != KVH_OK && st != KVH_ERR_BAD_HANDLE && st != KVH_ERR_BUSY && st != KVH_ERR_NOSPACE) {
            mt_report(w, "kvh_blocks_persist: %s (%s)", kvh_status_name(st), kvh_last_error());
            break;
        }
    }
    return NULL;
}

/* Frees the cached twin of each block of s (what the disk tier's eviction
 * of a cold cached block does), so that the block, private after a copy on
 * write, is the one a persist publishes. */
static void free_cached_twins(kvh_engine *e, kvh_seq s)
{
    uint32_t own[BLOCKS];
    for (int i = 0; i < BLOCKS; i++)
        own[i] = wb_seq_block_index(e, s, (uint64_t)i);
    wb_lock(e);
    for (int i = 0; i < BLOCKS; i++) {
        uint32_t twin = kvhi_prefix_find(&e->prefix, e->blocks[own[i]].hash);
        if (twin == KVHI_PREFIX_MISS || twin == own[i])
            continue;
        kvhi_block *t = &e->blocks[twin];
        if (t->refs == 0 && !t->holds && !kvhi_block_busy(t) && e->block_readers[twin] == 0)
            kvhi_block_free_now(e, twin);
    }
    wb_unlock(e);
}

static void test_write_vs_persist_of_a_block_it_made_private(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("persist-write-race", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 8, 8, 64, 1);
    kvh_engine *e = dt_open_a(&c);
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, dt_plain(700), BLOCKS * G.bt, 0, &s));
    mt_worker w = {.e = e};
    pthread_t th;
    atomic_store(&persist_stop, 0);
    atomic_store(&persist_go, 0);
    assert_int_equal(pthread_create(&th, NULL, persister, &w), 0);
    uint16_t buf[BLOCKS * 16 * TOKEN_ELEMS];
    char msg[256] = "";
    int stale = 0, round = 0;
    for (; round < 400 && !stale && !w.errors; round++) {
        uint16_t v = (uint16_t)(0x3c00 + round);
        for (size_t i = 0; i < BLOCKS * G.bt * TOKEN_ELEMS; i++)
            buf[i] = v;
        /* Every layer but the first: the blocks become private copies,
         * unpublished while their cached twins exist. */
        for (uint32_t l = 1; l < G.layers; l++)
            dt_assert_ok(kvh_seq_write_kv(e, s, l, 0, BLOCKS * G.bt, buf, buf));
        free_cached_twins(e, s);
        kvh_block h;
        dt_assert_ok(kvh_seq_blocks(e, s, BLOCKS - 1, 1, &h));
        atomic_store(&persist_target, h.id);
        /* The blocks before the last on disk: bringing them in drops the
         * lock before the write reaches the last one. */
        dt_assert_ok(kvh_seq_migrate(e, s, 0, (BLOCKS - 1) * G.bt, KVH_TIER_DISK, NULL));
        atomic_store(&persist_go, 1);
        dt_assert_ok(kvh_seq_write_kv(e, s, 0, 0, BLOCKS * G.bt, buf, buf));
        atomic_store(&persist_go, 0);
        /* Down again: a disk copy kept by the last block is reused. */
        dt_assert_ok(kvh_seq_migrate(e, s, 0, BLOCKS * G.bt, KVH_TIER_DISK, NULL));
        for (int b = 0; b < BLOCKS && !stale; b++)
            if (!block_reads(e, s, b, v, msg, sizeof(msg)))
                stale = 1;
    }
    atomic_store(&persist_stop, 1);
    pthread_join(th, NULL);
    if (stale)
        print_error("round %d: %s\n", round - 1, msg);
    assert_int_equal(w.errors, 0);
    assert_int_equal(stale, 0);
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
}

#define FULL_DISK 4 /* the disk's slots */

static kvh_block persisted;
static kvh_status persist_status[2];

static void *persist_once(void *arg)
{
    mt_worker *w = arg;
    persist_status[w->t] = kvh_blocks_persist(w->e, &persisted, 1, NULL);
    return NULL;
}

/* Every disk slot taken is a disk block's or one clean disk copy's, and no
 * block has both. */
static void check_disk_slots_accounted(kvh_engine *e)
{
    wb_lock(e);
    uint32_t owned = 0;
    for (uint32_t b = 0; b < e->block_cap; b++) {
        const kvhi_block *blk = &e->blocks[b];
        if (!(blk->flags & KVHI_BF_LIVE))
            continue;
        bool on_disk = blk->tier == KVH_TIER_DISK, copy = (blk->flags & KVHI_BF_DISK_COPY) != 0;
        assert_false(on_disk && copy);
        assert_false(kvhi_block_busy(blk));
        owned += on_disk + copy;
    }
    assert_int_equal(kvhi_slot_pool_used(&e->tiers[KVH_TIER_DISK].slots), owned);
    wb_unlock(e);
}

/* Two persists of one block wait together for a disk slot (the disk full
 * of referenced blocks while a copy runs); two slots then free at once.
 * Each checked the block before its wait: the one that resumes second
 * must see the other's copy (running or done) and give its slot back,
 * not write a second copy over the first and leak that slot. */
static void test_persists_waiting_for_a_disk_slot_recheck_their_block(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("persist-reserve-race", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 8, 8, FULL_DISK, 0);
    kvh_engine *e = dt_open_a(&c);
    kvh_seq full, s;
    dt_assert_ok(dt_build(e, G, dt_plain(900), FULL_DISK * G.bt, 0, &full));
    dt_assert_ok(kvh_seq_migrate(e, full, 0, FULL_DISK * G.bt, KVH_TIER_DISK, NULL));
    dt_assert_ok(dt_build(e, G, dt_plain(901), G.bt, 0, &s));
    dt_assert_ok(kvh_seq_blocks(e, s, 0, 1, &persisted));
    uint32_t b = wb_block_index(e, persisted);
    /* Stands for a copy running in another thread until both persists
     * are done: with no disk block to evict, a reservation waits for room
     * instead of failing. */
    wb_lock(e);
    e->copies_in_progress++;
    wb_unlock(e);
    mt_worker w[2];
    pthread_t th[2];
    for (int t = 0; t < 2; t++) {
        w[t] = (mt_worker){.e = e, .t = t};
        assert_int_equal(pthread_create(&th[t], NULL, persist_once, &w[t]), 0);
    }
    /* Each call takes two references (its own, then the persist's) and
     * keeps the lock from the second to its wait: the sequence's and four
     * more mean both wait. */
    for (bool waiting = false; !waiting;) {
        wb_lock(e);
        waiting = e->blocks[b].refs == 5;
        wb_unlock(e);
        if (!waiting)
            sched_yield();
    }
    /* Two disk blocks become evictable (cached); a move wakes the waits,
     * which end in either order. */
    dt_assert_ok(kvh_seq_truncate(e, full, 2 * G.bt));
    dt_assert_ok(kvh_seq_migrate(e, full, 0, G.bt, KVH_TIER_HOST, NULL));
    for (int t = 0; t < 2; t++)
        pthread_join(th[t], NULL);
    wb_lock(e);
    e->copies_in_progress--;
    wb_unlock(e);
    for (int t = 0; t < 2; t++)
        dt_assert_kvh(KVH_OK, persist_status[t]);
    check_disk_slots_accounted(e);
    dt_assert_ok(dt_verify(e, s, G, dt_plain(901), 0, G.bt, NULL, 0));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(kvh_seq_free(e, full));
    check_disk_slots_accounted(e);
    dt_assert_ok(dt_close(e));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_write_vs_persist_of_a_block_it_made_private, teardown),
        cmocka_unit_test_teardown(test_persists_waiting_for_a_disk_slot_recheck_their_block, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
