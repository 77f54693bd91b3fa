/* kvh_block_release from several threads, through the public API alone,
 * while other threads call everything that can observe the blocks and the
 * migration workers move them across a device, a host and a disk tier
 * (core/block.h: releases taken on trust wait in a backlog that any
 * other call applies first). Checked: no reference is lost or dropped
 * twice (a block shared by every thread is freed by the last release and
 * by no other), a release never returns an error it does not owe, each
 * thread's block data stays its own while other blocks come and go, and
 * every tier's used count returns to zero. Run under TSan (label
 * concurrency) and ASan. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <string.h>

#include "test_util.h"
#include "mt_util.h"
#include "disk_test_util.h"

enum { L = 2, H = 1, D = 8, BT = 4 };
static const size_t TOK = H * D * 4;

/* ---- one block, references from every thread ---- */

enum { SHARE_THREADS = 4, SHARE_EACH = 400 };

typedef struct {
    mt_worker *w;
    kvh_block shared;
    atomic_int *releasers_left;
} share_arg;

static share_arg share_args[SHARE_THREADS + 2];
static atomic_int share_done;

static void *share_release_thread(void *p)
{
    mt_worker *w = p;
    share_arg *a = &share_args[w->t];
    kvh_block mine[8];
    int n_mine = 0;
    for (int i = 0; i < SHARE_EACH; i++) {
        kvh_status st = kvh_block_release(w->e, a->shared);
        if (st != KVH_OK)
            mt_report(w, "release %d of the shared block: %s (%s)", i, kvh_status_name(st), kvh_last_error());
        /* Blocks of its own come and go, so that the shared block is
         * seldom the newest and most releases go on trust. */
        if (n_mine < 8 && kvh_block_alloc(w->e, 0, &mine[n_mine]) == KVH_OK)
            n_mine++;
        if (i % 3 == 0 && n_mine > 0 && kvh_block_release(w->e, mine[--n_mine]) != KVH_OK)
            mt_report(w, "release of an own block failed: %s", kvh_last_error());
    }
    while (n_mine > 0)
        if (kvh_block_release(w->e, mine[--n_mine]) != KVH_OK)
            mt_report(w, "release of an own block failed: %s", kvh_last_error());
    atomic_fetch_add(&share_done, 1);
    return NULL;
}

/* Reads the shared block until the releasers finish: its references only
 * fall, and it stays live (the main thread keeps one). */
static void *share_observe_thread(void *p)
{
    mt_worker *w = p;
    share_arg *a = &share_args[w->t];
    uint32_t last = UINT32_MAX;
    while (atomic_load(&share_done) < SHARE_THREADS) {
        kvh_block_info bi = {.struct_size = sizeof(bi)};
        kvh_status st = kvh_block_info_get(w->e, a->shared, &bi);
        if (st != KVH_OK) {
            mt_report(w, "info of the shared block: %s (%s)", kvh_status_name(st), kvh_last_error());
            break;
        }
        if (bi.refs > last)
            mt_report(w, "references rose from %u to %u with only releases running", last, bi.refs);
        last = bi.refs;
        kvh_stats s = {.struct_size = sizeof(s)};
        kvh_tier_info ti = {.struct_size = sizeof(ti)};
        if (kvh_engine_stats(w->e, &s) != KVH_OK || kvh_tier_info_get(w->e, KVH_TIER_DEVICE, &ti) != KVH_OK)
            mt_report(w, "stats or tier info failed: %s", kvh_last_error());
        if (s.blocks_freed > s.blocks_allocated)
            mt_report(w, "%llu blocks freed of %llu allocated", (unsigned long long)s.blocks_freed,
                      (unsigned long long)s.blocks_allocated);
    }
    return NULL;
}

static void *share_dispatch(void *p)
{
    mt_worker *w = p;
    return w->t < SHARE_THREADS ? share_release_thread(p) : share_observe_thread(p);
}

static void test_shared_block_released_by_every_thread(void **state)
{
    (void)state;
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F32, 64, 0, 0);
    kvh_block shared;
    assert_ok(kvh_block_alloc(e, 0, &shared));
    for (int i = 0; i < SHARE_THREADS * SHARE_EACH; i++)
        assert_ok(kvh_block_retain(e, shared));
    for (int t = 0; t < SHARE_THREADS + 2; t++)
        share_args[t] = (share_arg){.shared = shared};
    atomic_store(&share_done, 0);
    mt_worker w[SHARE_THREADS + 2];
    mt_run(e, SHARE_THREADS + 2, share_dispatch, w);
    assert_int_equal(tu_binfo(e, shared).refs, 1); /* the first, still held */
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, 1);
    assert_ok(kvh_block_release(e, shared));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_release(e, shared));
    kvh_stats s = tu_stats(e);
    assert_int_equal(s.blocks_allocated, s.blocks_freed);
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, 0);
}

/* ---- own blocks with data, moved by the workers, read and released ---- */

enum { OWN_THREADS = 3, OWN_SEQS = 4, OWN_ROUNDS = 25, MOVER = OWN_THREADS };

static kvh_block live_blocks[OWN_THREADS][OWN_SEQS]; /* what the mover may name */
static pthread_mutex_t live_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_int own_done;

/* Each round: sequences of its own tag (full blocks, published), their
 * blocks retained and released on trust while the mover sends them
 * anywhere; the data read back must be the tag's, then all is freed. */
static void *own_thread(void *p)
{
    mt_worker *w = p;
    kvh_engine *e = w->e;
    for (int r = 0; r < OWN_ROUNDS && !w->errors; r++) {
        kvh_seq s[OWN_SEQS];
        kvh_block h[OWN_SEQS];
        uint64_t tag = (uint64_t)w->t * 1000 + (uint64_t)r;
        for (int i = 0; i < OWN_SEQS; i++) {
            int32_t tok[BT];
            tu_iota(tok, BT, (int32_t)(tag * 16 + (uint64_t)i) * BT);
            if (kvh_seq_create(e, 0, &s[i]) != KVH_OK || kvh_seq_append(e, s[i], tok, BT) != KVH_OK) {
                mt_report(w, "sequence: %s", kvh_last_error());
                return NULL;
            }
            uint8_t kv[BT * TOK];
            for (uint32_t l = 0; l < L; l++) {
                tu_pattern(kv, sizeof(kv), tag + (uint64_t)i, l, 0, 0);
                if (kvh_seq_write_kv(e, s[i], l, 0, BT, kv, kv) != KVH_OK) {
                    mt_report(w, "write_kv: %s", kvh_last_error());
                    return NULL;
                }
            }
            if (kvh_seq_blocks(e, s[i], 0, 1, &h[i]) != KVH_OK || kvh_block_retain(e, h[i]) != KVH_OK ||
                kvh_block_retain(e, h[i]) != KVH_OK) {
                mt_report(w, "retain: %s", kvh_last_error());
                return NULL;
            }
        }
        pthread_mutex_lock(&live_lock);
        memcpy(live_blocks[w->t], h, sizeof(h));
        pthread_mutex_unlock(&live_lock);
        for (int i = 0; i < OWN_SEQS; i++) {
            if (kvh_block_release(e, h[i]) != KVH_OK)
                mt_report(w, "first release: %s", kvh_last_error());
            uint8_t got[BT * TOK], want[BT * TOK];
            for (uint32_t l = 0; l < L; l++) {
                kvh_status st = kvh_seq_read_kv(e, s[i], l, 0, BT, got, NULL);
                tu_pattern(want, sizeof(want), tag + (uint64_t)i, l, 0, 0);
                if (st != KVH_OK)
                    mt_report(w, "read_kv: %s (%s)", kvh_status_name(st), kvh_last_error());
                else if (memcmp(got, want, sizeof(got)) != 0)
                    mt_report(w, "round %d seq %d layer %u: another block's bytes", r, i, l);
            }
        }
        pthread_mutex_lock(&live_lock);
        memset(live_blocks[w->t], 0, sizeof(live_blocks[w->t]));
        pthread_mutex_unlock(&live_lock);
        for (int i = 0; i < OWN_SEQS; i++) {
            if (kvh_block_release(e, h[i]) != KVH_OK)
                mt_report(w, "second release: %s", kvh_last_error());
            if (kvh_block_release(e, h[i]) != KVH_ERR_INVALID_ARG) /* the sequence's is left */
                mt_report(w, "a third release was not refused: %s", kvh_last_error());
            if (kvh_seq_free(e, s[i]) != KVH_OK)
                mt_report(w, "seq_free: %s", kvh_last_error());
        }
    }
    atomic_fetch_add(&own_done, 1);
    return NULL;
}

/* Sends the others' live blocks to random tiers; a block released since
 * it was named is a stale handle, which is the only error allowed. */
static void *mover_thread(void *p)
{
    mt_worker *w = p;
    tu_rng r = {tu_seed(77)};
    while (atomic_load(&own_done) < OWN_THREADS) {
        kvh_block b;
        pthread_mutex_lock(&live_lock);
        b = live_blocks[tu_below(&r, OWN_THREADS)][tu_below(&r, OWN_SEQS)];
        pthread_mutex_unlock(&live_lock);
        if (b.id == 0)
            continue;
        kvh_fence f;
        uint32_t tier = (uint32_t)tu_below(&r, 3);
        kvh_status st = kvh_migrate(w->e, &b, 1, tier, &f);
        if (st == KVH_OK) {
            st = kvh_fence_wait(w->e, f, UINT64_MAX);
            kvh_fence_free(w->e, f);
        }
        if (st != KVH_OK && st != KVH_ERR_BAD_HANDLE && st != KVH_ERR_NOSPACE)
            mt_report(w, "migrate to %u: %s (%s)", tier, kvh_status_name(st), kvh_last_error());
        kvh_tier_info ti = {.struct_size = sizeof(ti)};
        for (uint32_t t = 0; t < KVH_TIER_COUNT; t++)
            if (kvh_tier_info_get(w->e, t, &ti) != KVH_OK || ti.used_blocks > ti.capacity_blocks)
                mt_report(w, "tier %u: %llu used of %llu", t, (unsigned long long)ti.used_blocks,
                          (unsigned long long)ti.capacity_blocks);
    }
    return NULL;
}

static void *own_dispatch(void *p)
{
    mt_worker *w = p;
    return w->t == MOVER ? mover_thread(p) : own_thread(p);
}

static void test_releases_while_workers_move_blocks(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("release_mt_move", dir, sizeof(dir));
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F32, 8, 8, 2);
    c.copy_moves = 1;
    c.disk_path = dir;
    c.disk_bytes = 8u << 20;
    kvh_engine *e = tu_open_cfg(&c);
    memset(live_blocks, 0, sizeof(live_blocks));
    atomic_store(&own_done, 0);
    mt_worker w[OWN_THREADS + 1];
    mt_run(e, OWN_THREADS + 1, own_dispatch, w);
    /* Published blocks stay cached, unreferenced. */
    kvh_stats s = tu_stats(e);
    assert_true(s.blocks_freed <= s.blocks_allocated);
    for (uint32_t t = 0; t < KVH_TIER_COUNT; t++) {
        kvh_tier_info ti = tu_tier(e, t);
        assert_int_equal(ti.pinned_blocks, 0);
        assert_true(ti.used_blocks <= ti.capacity_blocks);
    }
    /* Nothing referenced is left: the memory tiers can be filled with new
     * blocks, every cached one giving way. */
    uint64_t cap = tu_tier(e, KVH_TIER_DEVICE).capacity_blocks + tu_tier(e, KVH_TIER_HOST).capacity_blocks;
    kvh_block *fill = tu_alloc(sizeof(kvh_block) * cap);
    for (uint64_t i = 0; i < cap; i++)
        assert_ok(kvh_block_alloc(e, 0, &fill[i]));
    for (uint64_t i = 0; i < cap; i++)
        assert_ok(kvh_block_release(e, fill[i]));
    /* New blocks take the device tier first, before any cached block (a
     * cached block the cleaner was copying to disk meanwhile may still be
     * in the host tier). */
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, 0);
    kvh_stats end = tu_stats(e);
    assert_int_equal(end.blocks_allocated - s.blocks_allocated, cap);
    assert_int_equal(end.blocks_freed - s.blocks_freed - (end.drops - s.drops), cap);
    assert_ok(tu_close(e));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_shared_block_released_by_every_thread, tu_teardown),
        cmocka_unit_test_teardown(test_releases_while_workers_move_blocks, tu_teardown),
    };
    return cmocka_run_group_tests_name("release_misuse_mt", tests, NULL, NULL);
}
