/* Making room (core/evict.c), white-box: kvhi_reserve_slot is called
 * directly, under the engine lock, on engines without migration workers;
 * each reservation keeps the slot it got, so the next one must evict
 * again.
 *
 *   - victims leave in LRU-K order: unreferenced blocks first, then by the
 *     K-th most recent access (fewer than K accesses: first), then by the
 *     most recent one; the same history gives another order under K = 1,
 *     and lazily raised keys (kvhi_block_touch) are honoured;
 *   - pinned, held and busy blocks are never chosen, even when they are
 *     the least valuable; with only those left the reservation fails with
 *     KVH_ERR_NOSPACE and says why, and a block whose copy ended is a
 *     candidate again;
 *   - the last tier (here the disk) only gives up unreferenced blocks,
 *     which are dropped (stats.drops, their index records deleted: gone
 *     after a reopen);
 *   - a full disk gives back the clean copies of unreferenced blocks
 *     that stay in memory (their records deleted) before a write fails,
 *     never those of referenced blocks;
 *   - a full disk whose blocks have moves queued up to memory makes a
 *     persist wait for them (the worker runs them meanwhile), and fails
 *     with NOSPACE at once when nothing queued can free a slot, also when
 *     the only queued move is of a pinned block (it will be skipped);
 *   - a victim that cannot go down, because the tier below is full of
 *     referenced blocks or fails its writes, is dropped when unreferenced,
 *     and the reservation fails when it is referenced;
 *   - a device victim passes a host tier full of pinned blocks straight
 *     to the disk, referenced or cached (not dropped);
 *   - a victim leaving onto its clean disk copy, when the heap's top has
 *     no disk slot to go to, is the first such block in the victim order;
 *   - an agent at its device quota makes room among its own blocks, its
 *     least valuable first, even with free slots; with none of its own
 *     evictable it gets NOSPACE (new blocks then go to the host tier),
 *     while other agents still get the free slots;
 *   - the NOSPACE messages.
 * test_tiers.c covers the same policies through the public API (LRU-K
 * with a single victim, pins, holds, quotas, drops without a lower
 * tier). test_evict_mt.c: a lone worker that needs disk room. */
#include <stdatomic.h>

#include "disk_test_util.h"

#include "core/block_state.h"
#include "core/disk_io.h"
#include "core/disk_tier.h"
#include "core/engine.h"
#include "core/migrate.h"
#include "white_box_util.h"
#include "core/move.h"
#include "core/block.h"
#include "core/tier.h"

static const dt_geo G = {2, 1, 32, 16, KVH_DTYPE_F16};
static kvh_engine *open_mem(uint64_t dev, uint64_t host, uint32_t lru_k)
{
    kvh_config c = dt_cfg(G, NULL, dev, host, 0, 0);
    c.copy_moves = 1;
    c.lru_k = lru_k;
    return dt_open_a(&c);
}

/* A cached block: published, then its sequence freed. */
static uint32_t cached_block(kvh_engine *e, uint64_t stream)
{
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, dt_plain(stream), G.bt, 0, &s));
    uint32_t b = wb_seq_block_index(e, s, 0);
    dt_assert_ok(kvh_seq_free(e, s));
    assert_true(kvhi_blk(e, b)->flags & KVHI_BF_PUBLISHED);
    assert_int_equal(kvhi_blk(e, b)->refs, 0);
    return b;
}

/* Reserves a slot of tier (asserting success) and returns which of the
 * n blocks left that tier for it (-1: none did). Lock held. */
static int reserve_one(kvh_engine *e, uint32_t tier, uint32_t agent, const uint32_t *blocks, int n, uint32_t *slot)
{
    uint8_t before[16];
    for (int i = 0; i < n; i++)
        before[i] = kvhi_blk(e, blocks[i])->tier;
    kvh_status st = kvhi_reserve_slot(e, tier, agent, slot);
    if (st != KVH_OK)
        fail_msg("kvhi_reserve_slot(tier %u): %s: %s", tier, kvh_status_name(st), kvh_last_error());
    int left = -1;
    for (int i = 0; i < n; i++) {
        const kvhi_block *blk = kvhi_blk(e, blocks[i]);
        if (before[i] == tier && (!(blk->flags & KVHI_BF_LIVE) || blk->tier != tier)) {
            assert_int_equal(left, -1); /* one victim a reservation */
            left = i;
        }
    }
    return left;
}

/* ---- victim order ---- */

static void test_lru_k_order(void **state)
{
    (void)state;
    enum { U, A, B, C, D, E, N };
    static const char names[N] = {'U', 'A', 'B', 'C', 'D', 'E'};
    for (uint32_t k = 1; k <= 2; k++) {
        kvh_engine *e = open_mem(N, 8, k);
        uint32_t b[N];
        b[U] = cached_block(e, 10);
        kvh_seq s;
        dt_assert_ok(dt_build(e, G, dt_plain(11), 4 * G.bt, 0, &s));
        for (int i = 0; i < 4; i++)
            b[A + i] = wb_seq_block_index(e, s, (uint64_t)i);
        wb_lock(e);
        /* A B C D, then D C A: A, C and D have two accesses here, B one. */
        int order[] = {A, B, C, D, D, C, A, U, U};
        for (size_t i = 0; i < sizeof(order) / sizeof(order[0]); i++)
            kvhi_block_touch(e, b[order[i]]);
        wb_unlock(e);
        kvh_block eh;
        dt_assert_ok(kvh_block_alloc(e, 0, &eh)); /* E: the newest, one access */
        b[E] = wb_block_index(e, eh);
        assert_int_equal(dt_tier(e, KVH_TIER_DEVICE).used_blocks, N);
        uint64_t ev0 = dt_stats(e).evictions;
        assert_int_equal(ev0, 0);

        /* K = 2: U (unreferenced), E (fewer than 2 accesses), then by the
         * second most recent access: B (its creation), A, C, D.
         * K = 1 (LRU): U, then by the last access: B, D, C, A, E. */
        const char *want = k == 2 ? "UEBACD" : "UBDCAE";
        char got[N + 1] = "";
        uint32_t slots[N];
        wb_lock(e);
        for (int i = 0; i < N; i++) {
            int v = reserve_one(e, KVH_TIER_DEVICE, 0, b, N, &slots[i]);
            got[i] = v < 0 ? '-' : names[v];
        }
        for (int i = 0; i < N; i++)
            kvhi_release_slot(e, KVH_TIER_DEVICE, slots[i]);
        wb_unlock(e);
        if (strcmp(got, want) != 0)
            fail_msg("lru_k %u: victims left in the order %s, expected %s", k, got, want);
        assert_int_equal(dt_stats(e).evictions - ev0, N);
        assert_int_equal(dt_tier(e, KVH_TIER_HOST).used_blocks, N);
        assert_int_equal(dt_stats(e).drops, 0); /* all went down, none dropped */
        char msg[256] = "";
        if (dt_verify(e, s, G, dt_plain(11), 0, 4 * G.bt, msg, sizeof(msg)) != KVH_OK)
            fail_msg("%s", msg);
        dt_assert_ok(kvh_block_release(e, eh));
        dt_assert_ok(kvh_seq_free(e, s));
        dt_assert_ok(dt_close(e));
    }
}

/* ---- protected blocks ---- */

static void test_protected_blocks_stay(void **state)
{
    (void)state;
    enum { P, HL, BZ, R, U, N };
    kvh_engine *e = open_mem(N, 8, 2);
    uint32_t b[N];
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, dt_plain(20), 4 * G.bt, 0, &s)); /* P, HL, BZ, R */
    kvh_block ph;
    dt_assert_ok(kvh_seq_blocks(e, s, 0, 1, &ph));
    for (int i = 0; i < 4; i++)
        b[i] = wb_seq_block_index(e, s, (uint64_t)i);
    b[U] = cached_block(e, 21);
    dt_assert_ok(kvh_block_pin(e, ph, 1));
    dt_assert_ok(kvh_seq_acquire(e, s, 1 * G.bt, G.bt, NULL)); /* holds HL */
    wb_lock(e);
    kvhi_block_move_event(kvhi_blk(e, b[BZ]), KVHI_EV_COPY_BEGIN); /* a clean copy is written from it */
    kvhi_block_update_evictable(e, b[BZ]);
    /* R and U are the most valuable by history: the protected ones would
     * leave first if they could. */
    kvhi_block_touch(e, b[R]);
    kvhi_block_touch(e, b[R]);
    kvhi_block_touch(e, b[U]);
    kvhi_block_touch(e, b[U]);
    uint32_t slot_of[N];
    for (int i = 0; i < N; i++)
        slot_of[i] = kvhi_blk(e, b[i])->slot;
    uint32_t slots[3];
    assert_int_equal(reserve_one(e, KVH_TIER_DEVICE, 0, b, N, &slots[0]), U);
    assert_int_equal(reserve_one(e, KVH_TIER_DEVICE, 0, b, N, &slots[1]), R);
    uint32_t none = 0;
    assert_int_equal(kvhi_reserve_slot(e, KVH_TIER_DEVICE, 0, &none), KVH_ERR_NOSPACE);
    assert_string_equal(kvh_last_error(), "device tier full: every block is pinned, held or in flight");
    for (int i = P; i <= BZ; i++) {
        assert_int_equal(kvhi_blk(e, b[i])->tier, KVH_TIER_DEVICE);
        assert_int_equal(kvhi_blk(e, b[i])->slot, slot_of[i]);
    }
    /* The copy ends: the block may leave again. */
    kvhi_block_writing_done(e, b[BZ]);
    kvhi_block_update_evictable(e, b[BZ]);
    assert_int_equal(reserve_one(e, KVH_TIER_DEVICE, 0, b, N, &slots[2]), BZ);
    for (int i = 0; i < 3; i++)
        kvhi_release_slot(e, KVH_TIER_DEVICE, slots[i]);
    /* A tier that is not there. */
    assert_int_equal(kvhi_reserve_slot(e, KVH_TIER_DISK, 0, &none), KVH_ERR_NOSPACE);
    assert_string_equal(kvh_last_error(), "tier 2 is not configured");
    wb_unlock(e);
    assert_int_equal(dt_stats(e).drops, 0);
    dt_assert_ok(kvh_seq_release(e, s, 1 * G.bt, G.bt));
    dt_assert_ok(kvh_block_pin(e, ph, 0));
    char msg[256] = "";
    if (dt_verify(e, s, G, dt_plain(20), 0, 4 * G.bt, msg, sizeof(msg)) != KVH_OK)
        fail_msg("%s", msg);
    dt_assert_ok(kvh_seq_free(e, s));
}

/* ---- the last tier ---- */

static uint32_t live_on_disk(kvh_engine *e)
{
    uint32_t n = 0;
    wb_lock(e);
    for (uint32_t b = 0; b < e->block_cap; b++)
        n += (e->blocks[b].flags & KVHI_BF_LIVE) && e->blocks[b].tier == KVH_TIER_DISK;
    wb_unlock(e);
    return n;
}

static void test_last_tier_drops_unreferenced(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("last-tier", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 2, 2, 4, 0);
    kvh_engine *e = dt_open_a(&c);
    /* Disk full: two referenced blocks of r, two cached ones of u. */
    kvh_seq r, u;
    dt_content rc = dt_plain(30), uc = dt_plain(31);
    dt_assert_ok(dt_build(e, G, rc, 2 * G.bt, 0, &r));
    dt_assert_ok(kvh_seq_migrate(e, r, 0, 2 * G.bt, KVH_TIER_DISK, NULL));
    dt_assert_ok(dt_build(e, G, uc, 2 * G.bt, 0, &u));
    dt_assert_ok(kvh_seq_persist(e, u));
    dt_assert_ok(kvh_seq_migrate(e, u, 0, 2 * G.bt, KVH_TIER_DISK, NULL));
    uint32_t b[4] = {wb_seq_block_index(e, r, 0), wb_seq_block_index(e, r, 1), wb_seq_block_index(e, u, 0),
                     wb_seq_block_index(e, u, 1)};
    dt_assert_ok(kvh_seq_free(e, u));
    assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, 4);
    assert_int_equal(live_on_disk(e), 4);
    kvh_stats a = dt_stats(e);
    wb_lock(e);
    uint64_t hash2 = kvhi_blk(e, b[2])->hash, hash3 = kvhi_blk(e, b[3])->hash;
    uint32_t slots[2];
    int v0 = reserve_one(e, KVH_TIER_DISK, 0, b, 4, &slots[0]);
    int v1 = reserve_one(e, KVH_TIER_DISK, 0, b, 4, &slots[1]);
    assert_true((v0 == 2 && v1 == 3) || (v0 == 3 && v1 == 2));
    assert_int_equal(kvhi_prefix_find(&e->prefix, hash2), KVHI_PREFIX_MISS);
    assert_int_equal(kvhi_prefix_find(&e->prefix, hash3), KVHI_PREFIX_MISS);
    uint32_t none = 0;
    assert_int_equal(kvhi_reserve_slot(e, KVH_TIER_DISK, 0, &none), KVH_ERR_NOSPACE);
    assert_string_equal(kvh_last_error(), "disk tier full: every block is pinned, held or in flight, or still "
                                          "referenced with no tier below");
    for (int i = 0; i < 2; i++)
        assert_int_equal(kvhi_blk(e, b[i])->tier, KVH_TIER_DISK);
    kvhi_release_slot(e, KVH_TIER_DISK, slots[0]);
    kvhi_release_slot(e, KVH_TIER_DISK, slots[1]);
    wb_unlock(e);
    kvh_stats d = dt_stats(e);
    assert_int_equal(d.drops - a.drops, 2);
    assert_int_equal(d.blocks_freed - a.blocks_freed, 2);
    assert_int_equal(d.evictions, a.evictions); /* a drop is not a demotion */
    char msg[256] = "";
    if (dt_verify(e, r, G, rc, 0, 2 * G.bt, msg, sizeof(msg)) != KVH_OK)
        fail_msg("%s", msg);
    dt_assert_ok(kvh_seq_free(e, r));
    dt_assert_ok(dt_close(e));
    /* The dropped blocks' records went with them. */
    e = dt_open_a(&c);
    size_t m = 99;
    kvh_seq t;
    dt_assert_ok(dt_match(e, uc, 2 * G.bt, &t, &m));
    assert_int_equal(m, 0);
    dt_assert_ok(kvh_seq_free(e, t));
    assert_int_equal(live_on_disk(e), 2);
    dt_assert_ok(dt_close(e));
}

/* A persist leaves clean disk copies of blocks that stay in memory. Once
 * such a block is unreferenced, its copy is room as an unreferenced block
 * of the disk tier would be: given back (the block stays cached in
 * memory, no longer durable: its record goes) before a write to a full
 * disk fails. A referenced block's copy is kept, as the block itself
 * would be on disk. */
static void test_full_disk_takes_back_unreferenced_copies(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("disk-copies", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 8, 8, 4, 0);
    kvh_engine *e = dt_open_a(&c);
    kvh_seq r, u, w;
    dt_content rc = dt_plain(40), uc = dt_plain(41), wc = dt_plain(42);
    dt_assert_ok(dt_build(e, G, rc, 2 * G.bt, 0, &r));
    dt_assert_ok(kvh_seq_migrate(e, r, 0, 2 * G.bt, KVH_TIER_DISK, NULL));
    dt_assert_ok(dt_build(e, G, uc, 2 * G.bt, 0, &u));
    dt_assert_ok(kvh_seq_persist(e, u));
    assert_int_equal(dt_binfo(e, u, 0).tier, KVH_TIER_DEVICE);
    assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, 4);
    dt_assert_ok(dt_build(e, G, wc, 2 * G.bt, 0, &w));
    /* u still referenced: its copies stay, and the disk is full. */
    assert_int_equal(kvh_seq_persist(e, w), KVH_ERR_NOSPACE);
    assert_int_equal(dt_binfo(e, u, 0).tier, KVH_TIER_DEVICE);
    assert_int_equal(dt_stats(e).disk_copies_given_back, 0);
    dt_assert_ok(kvh_seq_free(e, u));
    kvh_stats a = dt_stats(e);
    dt_assert_ok(kvh_seq_persist(e, w));
    kvh_stats b = dt_stats(e);
    assert_int_equal(b.drops, a.drops); /* nothing was lost from the cache */
    assert_int_equal(b.disk_copies_given_back - a.disk_copies_given_back, 2);
    assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, 4);
    wb_check_disk_copies(e);
    /* u's blocks are still cached, intact. */
    size_t m = 0;
    kvh_seq t;
    dt_assert_ok(dt_match(e, uc, 2 * G.bt, &t, &m));
    assert_int_equal(m, 2 * G.bt);
    char msg[256] = "";
    if (dt_verify(e, t, G, uc, 0, 2 * G.bt, msg, sizeof(msg)) != KVH_OK)
        fail_msg("%s", msg);
    dt_assert_ok(kvh_seq_free(e, t));
    dt_assert_ok(kvh_seq_free(e, w));
    dt_assert_ok(kvh_seq_free(e, r));
    dt_assert_ok(dt_close(e));
    /* w is durable; u was not kept on disk. */
    e = dt_open_a(&c);
    dt_assert_ok(dt_match(e, wc, 2 * G.bt, &t, &m));
    assert_int_equal(m, 2 * G.bt);
    if (dt_verify(e, t, G, wc, 0, 2 * G.bt, msg, sizeof(msg)) != KVH_OK)
        fail_msg("%s", msg);
    dt_assert_ok(kvh_seq_free(e, t));
    dt_assert_ok(dt_match(e, uc, 2 * G.bt, &t, &m));
    assert_int_equal(m, 0);
    dt_assert_ok(kvh_seq_free(e, t));
    dt_assert_ok(dt_close(e));
}

/* A full disk whose blocks are all referenced, some with moves queued
 * up to memory (partial blocks: their slots are freed when they leave):
 * a persist waits for those moves rather than fail. The lock is held
 * from the queueing to the persist, so the worker can run the moves only
 * once the persist waits. */
static void test_full_disk_waits_for_queued_moves(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("queued-moves", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 8, 8, 4, 1);
    kvh_engine *e = dt_open_a(&c);
    kvh_seq p[4], w;
    dt_content pc = dt_plain(50), wc = dt_plain(51);
    for (int i = 0; i < 4; i++) {
        dt_assert_ok(dt_build(e, G, pc, G.bt / 2, 0, &p[i]));
        dt_assert_ok(kvh_seq_migrate(e, p[i], 0, G.bt / 2, KVH_TIER_DISK, NULL));
    }
    assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, 4);
    dt_assert_ok(dt_build(e, G, wc, 2 * G.bt, 0, &w));
    uint32_t wb[2] = {wb_seq_block_index(e, w, 0), wb_seq_block_index(e, w, 1)};
    uint32_t pb[2] = {wb_seq_block_index(e, p[0], 0), wb_seq_block_index(e, p[1], 0)};
    wb_lock(e);
    for (int i = 0; i < 2; i++)
        dt_assert_ok(kvhi_enqueue(e, pb[i], KVH_TIER_HOST, 0, KVHI_JOB_MOVE, KVHI_NO_BLOCK));
    kvh_status st = kvhi_disk_persist_blocks(e, wb, 2, "of w", NULL);
    uint64_t waits = e->queued_move_waits;
    wb_unlock(e);
    if (st != KVH_OK)
        fail_msg("persist with moves queued off the full disk: %s: %s", kvh_status_name(st), kvh_last_error());
    assert_true(waits >= 1);
    assert_int_equal(dt_binfo(e, p[0], 0).tier, KVH_TIER_HOST);
    /* With nothing queued it still fails at once. */
    kvh_seq x;
    dt_assert_ok(dt_build(e, G, dt_plain(52), 2 * G.bt, 0, &x));
    assert_int_equal(kvh_seq_persist(e, x), KVH_ERR_NOSPACE);
    char msg[256] = "";
    for (int i = 0; i < 4; i++) {
        if (dt_verify(e, p[i], G, pc, 0, G.bt / 2, msg, sizeof(msg)) != KVH_OK)
            fail_msg("%s", msg);
        dt_assert_ok(kvh_seq_free(e, p[i]));
    }
    dt_assert_ok(kvh_seq_free(e, x));
    dt_assert_ok(kvh_seq_free(e, w));
    dt_assert_ok(dt_close(e));
    e = dt_open_a(&c);
    size_t m = 0;
    kvh_seq t;
    dt_assert_ok(dt_match(e, wc, 2 * G.bt, &t, &m));
    assert_int_equal(m, 2 * G.bt);
    dt_assert_ok(kvh_seq_free(e, t));
    dt_assert_ok(dt_close(e));
}

/* A full disk whose only queued move up is of a pinned block: that move
 * will be skipped and frees nothing, so a persist fails with NOSPACE at
 * once, without waiting KVHI_QUEUED_MOVES_WAIT_S for it. */
static void test_full_disk_pinned_queued_move_frees_nothing(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("pinned-queued-move", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 8, 8, 4, 1);
    kvh_engine *e = dt_open_a(&c);
    kvh_seq p[4], w;
    dt_content pc = dt_plain(70);
    for (int i = 0; i < 4; i++) {
        dt_assert_ok(dt_build(e, G, pc, G.bt / 2, 0, &p[i]));
        dt_assert_ok(kvh_seq_migrate(e, p[i], 0, G.bt / 2, KVH_TIER_DISK, NULL));
    }
    assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, 4);
    dt_assert_ok(kvh_seq_pin(e, p[0], 0, G.bt / 2, 1));
    dt_assert_ok(dt_build(e, G, dt_plain(71), 2 * G.bt, 0, &w));
    uint32_t wb[2] = {wb_seq_block_index(e, w, 0), wb_seq_block_index(e, w, 1)};
    uint32_t p0 = wb_seq_block_index(e, p[0], 0);
    kvh_fence f = {0};
    uint32_t fi = 0;
    wb_lock(e);
    dt_assert_ok(kvhi_fence_new(e, &fi, &f));
    dt_assert_ok(kvhi_enqueue(e, p0, KVH_TIER_HOST, 0, KVHI_JOB_MOVE, fi));
    uint64_t waits = e->queued_move_waits, run_here = e->queued_moves_run_here;
    assert_int_equal(kvhi_disk_persist_blocks(e, wb, 2, "of w", NULL), KVH_ERR_NOSPACE);
    assert_int_equal(e->queued_move_waits, waits);
    assert_int_equal(e->queued_moves_run_here, run_here);
    wb_unlock(e);
    dt_assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
    dt_assert_ok(kvh_fence_free(e, f));
    assert_int_equal(dt_binfo(e, p[0], 0).tier, KVH_TIER_DISK); /* the queued move skipped it */
    dt_assert_ok(kvh_seq_pin(e, p[0], 0, G.bt / 2, 0));
    char msg[256] = "";
    for (int i = 0; i < 4; i++) {
        if (dt_verify(e, p[i], G, pc, 0, G.bt / 2, msg, sizeof(msg)) != KVH_OK)
            fail_msg("p[%d]: %s", i, msg);
        dt_assert_ok(kvh_seq_free(e, p[i]));
    }
    dt_assert_ok(kvh_seq_free(e, w));
    dt_assert_ok(dt_close(e));
}

/* A failure recorded on a fence without a detail (the failing step set
 * none): kvh_fence_wait and kvh_fence_poll said nothing but the status
 * (kvh_last_error empty). They now give the status's text at least. */
static void test_a_fence_failure_without_detail_still_says_why(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("fence-detail", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 8, 8, 4, 0);
    kvh_engine *e = dt_open_a(&c);
    kvh_fence f = {0};
    uint32_t fi = 0;
    wb_lock(e);
    dt_assert_ok(kvhi_fence_new(e, &fi, &f));
    kvhi_fence_expect(e, fi, 1);
    kvhi_clear_error();
    kvhi_fence_done(e, fi, KVH_ERR_NOSPACE);
    wb_unlock(e);
    int32_t done = 0;
    dt_assert_kvh(KVH_ERR_NOSPACE, kvh_fence_poll(e, f, &done));
    assert_int_equal(done, 1);
    assert_string_equal(kvh_last_error(), kvhi_status_text(KVH_ERR_NOSPACE));
    dt_assert_kvh(KVH_ERR_NOSPACE, kvh_fence_wait(e, f, UINT64_MAX));
    assert_string_equal(kvh_last_error(), kvhi_status_text(KVH_ERR_NOSPACE));
    dt_assert_ok(kvh_fence_free(e, f));
    dt_assert_ok(dt_close(e));
}

/* ---- a victim that cannot go down ---- */

static struct {
    atomic_int fail_writes;
} H;

static int hook(enum kvhi_disk_op op, void *user)
{
    (void)user;
    return op == KVHI_OP_WRITE && atomic_load(&H.fail_writes) ? -EIO : 0;
}

static int teardown(void **state)
{
    wb_release_held_lock();
    kvhi_disk_set_fault_hook(NULL, NULL);
    atomic_store(&H.fail_writes, 0);
    return dt_teardown(state);
}

static void test_victim_that_cannot_go_down(void **state)
{
    (void)state;
    /* (a) The tier below is full of referenced blocks. */
    kvh_engine *e = open_mem(2, 2, 2);
    kvh_seq h, r;
    dt_assert_ok(dt_build(e, G, dt_plain(40), 2 * G.bt, 0, &h));
    dt_assert_ok(kvh_seq_migrate(e, h, 0, 2 * G.bt, KVH_TIER_HOST, NULL));
    uint32_t bu = cached_block(e, 41);
    dt_assert_ok(dt_build(e, G, dt_plain(42), G.bt, 0, &r));
    uint32_t b[2] = {bu, wb_seq_block_index(e, r, 0)};
    assert_int_equal(dt_tier(e, KVH_TIER_HOST).used_blocks, 2);
    kvh_stats a = dt_stats(e);
    wb_lock(e);
    uint64_t hash = kvhi_blk(e, bu)->hash;
    uint32_t slot = 0;
    assert_int_equal(reserve_one(e, KVH_TIER_DEVICE, 0, b, 2, &slot), 0);
    assert_false(kvhi_blk(e, bu)->flags & KVHI_BF_LIVE); /* dropped, not moved */
    assert_int_equal(kvhi_prefix_find(&e->prefix, hash), KVHI_PREFIX_MISS);
    uint32_t none = 0;
    assert_int_equal(kvhi_reserve_slot(e, KVH_TIER_DEVICE, 0, &none), KVH_ERR_NOSPACE);
    assert_string_equal(kvh_last_error(), "no room below the device tier for its least valuable block");
    assert_int_equal(kvhi_blk(e, b[1])->tier, KVH_TIER_DEVICE);
    kvhi_release_slot(e, KVH_TIER_DEVICE, slot);
    wb_unlock(e);
    kvh_stats d = dt_stats(e);
    assert_int_equal(d.drops - a.drops, 1);
    assert_int_equal(d.evictions, a.evictions);
    assert_int_equal(d.blocks_device_to_host, a.blocks_device_to_host);
    dt_assert_ok(dt_close(e));

    /* (b) The tier below fails its writes. */
    char dir[PATH_MAX];
    dt_scratch("failing-below", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 2, 2, 16, 0);
    c.copy_moves = 1;
    e = dt_open_a(&c);
    /* The host tier holds U (cached) and R (referenced); the device tier
     * two more referenced blocks. */
    kvh_seq useq, r2;
    dt_assert_ok(dt_build(e, G, dt_plain(44), G.bt, 0, &useq));
    dt_assert_ok(dt_build(e, G, dt_plain(45), G.bt, 0, &r2));
    dt_assert_ok(kvh_seq_migrate(e, useq, 0, G.bt, KVH_TIER_HOST, NULL));
    dt_assert_ok(kvh_seq_migrate(e, r2, 0, G.bt, KVH_TIER_HOST, NULL));
    b[0] = bu = wb_seq_block_index(e, useq, 0);
    b[1] = wb_seq_block_index(e, r2, 0);
    dt_assert_ok(kvh_seq_free(e, useq));
    dt_assert_ok(dt_build(e, G, dt_plain(43), 2 * G.bt, 0, &r));
    assert_int_equal(kvhi_blk(e, b[0])->tier, KVH_TIER_HOST);
    assert_int_equal(kvhi_blk(e, b[1])->tier, KVH_TIER_HOST);
    assert_int_equal(dt_tier(e, KVH_TIER_DEVICE).used_blocks, 2);
    kvhi_disk_set_fault_hook(hook, NULL);
    atomic_store(&H.fail_writes, 1);
    a = dt_stats(e);
    wb_lock(e);
    assert_int_equal(reserve_one(e, KVH_TIER_HOST, 0, b, 2, &slot), 0);
    assert_false(kvhi_blk(e, bu)->flags & KVHI_BF_LIVE);
    assert_int_equal(kvhi_reserve_slot(e, KVH_TIER_HOST, 0, &none), KVH_ERR_NOSPACE);
    assert_string_equal(kvh_last_error(), "no room below the host tier for its least valuable block");
    assert_int_equal(kvhi_blk(e, b[1])->tier, KVH_TIER_HOST);
    wb_unlock(e);
    atomic_store(&H.fail_writes, 0);
    d = dt_stats(e);
    assert_int_equal(d.drops - a.drops, 1);
    assert_int_equal(d.blocks_host_to_disk, a.blocks_host_to_disk);
    assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, 0); /* the failed writes' slots came back */
    /* With the disk working again, the referenced block goes down. */
    wb_lock(e);
    uint32_t slot2 = 0;
    assert_int_equal(reserve_one(e, KVH_TIER_HOST, 0, b, 2, &slot2), 1);
    assert_int_equal(kvhi_blk(e, b[1])->tier, KVH_TIER_DISK);
    kvhi_release_slot(e, KVH_TIER_HOST, slot);
    kvhi_release_slot(e, KVH_TIER_HOST, slot2);
    wb_unlock(e);
    assert_int_equal(dt_stats(e).blocks_host_to_disk - a.blocks_host_to_disk, 1);
    char msg[256] = "";
    if (dt_verify(e, r2, G, dt_plain(45), 0, G.bt, msg, sizeof(msg)) != KVH_OK)
        fail_msg("%s", msg);
    dt_assert_ok(kvh_seq_free(e, r2));
    dt_assert_ok(kvh_seq_free(e, r));
}

/* With the host tier full of pinned blocks, a device victim goes past it
 * straight to the disk: a referenced one with half its KV written (the
 * written cells intact, the others still never written), and an
 * unreferenced cached one (still found by its prefix, not dropped). */
static void test_victim_passes_a_pinned_host_tier(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("pinned-host", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 2, 2, 16, 0);
    c.copy_moves = 1;
    kvh_engine *e = dt_open_a(&c);
    kvh_seq p, a, b, q;
    dt_assert_ok(dt_build(e, G, dt_plain(50), 2 * G.bt, 0, &p));
    dt_assert_ok(kvh_seq_migrate(e, p, 0, 2 * G.bt, KVH_TIER_HOST, NULL));
    dt_assert_ok(kvh_seq_pin(e, p, 0, 2 * G.bt, 1));
    assert_int_equal(dt_tier(e, KVH_TIER_HOST).used_blocks, 2);
    uint32_t cached = cached_block(e, 51);
    /* A: one block with layer 0's KV written, layer 1's never. */
    int32_t toks[16];
    dt_tokens(dt_plain(52), 0, G.bt, toks);
    uint8_t k[16 * 64], v[16 * 64], k2[16 * 64], v2[16 * 64];
    assert_int_equal(sizeof(k), G.bt * dt_tok_bytes(G));
    for (size_t i = 0; i < sizeof(k); i++) {
        k[i] = (uint8_t)(i * 7 + 1);
        v[i] = (uint8_t)(i * 13 + 5);
    }
    dt_assert_ok(kvh_seq_create(e, 0, &a));
    dt_assert_ok(kvh_seq_append(e, a, toks, G.bt));
    dt_assert_ok(kvh_seq_write_kv(e, a, 0, 0, G.bt, k, v));
    kvh_stats before = dt_stats(e);
    /* Two more device blocks: the cached one and A's leave for the disk. */
    dt_assert_ok(dt_build(e, G, dt_plain(53), 2 * G.bt, 0, &b));
    assert_int_equal(kvhi_blk(e, cached)->tier, KVH_TIER_DISK);
    assert_int_equal(dt_binfo(e, a, 0).tier, KVH_TIER_DISK);
    kvh_stats after = dt_stats(e);
    assert_int_equal(after.drops, before.drops);
    assert_int_equal(after.evictions - before.evictions, 2);
    dt_assert_ok(kvh_seq_read_kv(e, a, 0, 0, G.bt, k2, v2));
    assert_memory_equal(k2, k, sizeof(k));
    assert_memory_equal(v2, v, sizeof(v));
    dt_assert_kvh(KVH_ERR_RANGE, kvh_seq_read_kv(e, a, 1, 0, G.bt, k2, v2));
    char msg[256] = "";
    if (dt_verify(e, b, G, dt_plain(53), 0, 2 * G.bt, msg, sizeof(msg)) != KVH_OK)
        fail_msg("B: %s", msg);
    dt_assert_ok(kvh_seq_free(e, b));
    dt_tokens(dt_plain(51), 0, G.bt, toks);
    size_t matched = 0;
    dt_assert_ok(kvh_seq_create(e, 0, &q));
    dt_assert_ok(kvh_seq_match_prefix(e, q, toks, G.bt, &matched));
    assert_int_equal(matched, G.bt);
    if (dt_verify(e, q, G, dt_plain(51), 0, G.bt, msg, sizeof(msg)) != KVH_OK)
        fail_msg("cached: %s", msg);
    if (dt_verify(e, p, G, dt_plain(50), 0, 2 * G.bt, msg, sizeof(msg)) != KVH_OK)
        fail_msg("pinned: %s", msg);
    dt_assert_ok(kvh_seq_free(e, q));
    dt_assert_ok(kvh_seq_free(e, a));
    dt_assert_ok(kvh_seq_pin(e, p, 0, 2 * G.bt, 0));
    dt_assert_ok(kvh_seq_free(e, p));
}

/* ---- agent quotas ---- */

/* When the heap's top cannot leave (no disk slot for it), the block that
 * leaves onto its clean disk copy instead is the first such block in the
 * victim order, not the first in the block table: a hinted block stays,
 * an unhinted one goes. */
static void test_victim_with_a_disk_copy_follows_the_order(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("disk-copy-order", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 3, 0, 6, 0);
    c.eviction_policy = KVH_EVICT_LRU_K;
    kvh_engine *e = dt_open_a(&c);
    kvh_seq fill[4], h, x, u, n;
    for (int i = 0; i < 4; i++) { /* the disk: referenced partial blocks */
        dt_assert_ok(dt_build(e, G, dt_plain(90 + (uint64_t)i), G.bt / 2, 0, &fill[i]));
        dt_assert_ok(kvh_seq_migrate(e, fill[i], 0, G.bt / 2, KVH_TIER_DISK, NULL));
    }
    dt_assert_ok(dt_build(e, G, dt_plain(95), G.bt, 0, &h));     /* first in the block table */
    dt_assert_ok(dt_build(e, G, dt_plain(96), G.bt / 2, 0, &x)); /* the heap's top, no disk copy */
    dt_assert_ok(dt_build(e, G, dt_plain(97), G.bt, 0, &u));
    dt_assert_ok(kvh_seq_persist(e, h));
    dt_assert_ok(kvh_seq_persist(e, u));
    dt_assert_ok(kvh_seq_hint(e, h, 0, G.bt, 100));
    assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, 6);
    dt_assert_ok(dt_build(e, G, dt_plain(98), G.bt / 2, 0, &n));
    assert_int_equal(dt_binfo(e, h, 0).tier, KVH_TIER_DEVICE);
    assert_int_equal(dt_binfo(e, x, 0).tier, KVH_TIER_DEVICE);
    assert_int_equal(dt_binfo(e, u, 0).tier, KVH_TIER_DISK);
    const kvh_seq seqs[3] = {h, u, n};
    const dt_content want[3] = {dt_plain(95), dt_plain(97), dt_plain(98)};
    const size_t len[3] = {G.bt, G.bt, G.bt / 2};
    for (int i = 0; i < 3; i++) {
        char msg[256] = "";
        if (dt_verify(e, seqs[i], G, want[i], 0, len[i], msg, sizeof(msg)) != KVH_OK)
            fail_msg("sequence %d: %s", i, msg);
    }
    dt_assert_ok(dt_close(e));
}

/* A write that needs a copy of a block its sequence acquired (or pinned)
 * in the device tier, by an agent over its quota with every block of its
 * own held. On one arena the copy trades places with the original. On
 * two, the copy cannot go up and the call fails having changed nothing:
 * the original, sent down to make room for the copy, comes back (its
 * agent's quota aside) rather than stay on disk with its holds. */
static void test_a_copy_of_an_acquired_block_under_a_quota(void **state)
{
    (void)state;
    for (int run = 0; run < 4; run++) {
        int pin = run & 1, copies = run >> 1;
        char dir[PATH_MAX];
        dt_scratch(pin ? "quota-cow-pin" : "quota-cow-hold", dir, sizeof(dir));
        kvh_config c = dt_cfg(G, dir, 2, 1, 8, 0);
        c.copy_moves = (uint32_t)copies;
        kvh_engine *e = dt_open_a(&c);
        kvh_seq s;
        dt_assert_ok(dt_build(e, G, dt_plain(60), 2 * G.bt, 7, &s)); /* two published blocks */
        if (pin)
            dt_assert_ok(kvh_seq_pin(e, s, 0, 2 * G.bt, 1));
        else
            dt_assert_ok(kvh_seq_acquire(e, s, 0, 2 * G.bt, NULL));
        dt_assert_ok(kvh_agent_set_quota(e, 7, dt_block_bytes(G)));
        kvh_block before, after;
        dt_assert_ok(kvh_seq_blocks(e, s, 0, 1, &before));
        uint16_t k[32] = {1}, v[32] = {2}; /* one token of one layer: 1 head x 32 f16 */
        assert_int_equal(kvh_seq_write_kv(e, s, 0, 1, 1, k, v), copies ? KVH_ERR_NOSPACE : KVH_OK);
        dt_assert_ok(kvh_seq_blocks(e, s, 0, 1, &after));
        assert_true(copies ? after.id == before.id : after.id != before.id);
        for (uint64_t i = 0; i < 2; i++) {
            kvh_block_info bi = dt_binfo(e, s, i);
            assert_int_equal(bi.tier, KVH_TIER_DEVICE);
            assert_int_equal(pin ? bi.pins : bi.holds, 1);
        }
        int32_t indptr[2], idx[2], lpl[1];
        if (!pin)
            dt_assert_ok(kvh_block_table(e, &s, 1, indptr, idx, 2, lpl));
        char msg[256] = "";
        if (dt_verify(e, s, G, dt_plain(60), copies ? 0 : G.bt, copies ? 2 * G.bt : G.bt, msg, sizeof(msg)) != KVH_OK)
            fail_msg("%s", msg);
        if (pin)
            dt_assert_ok(kvh_seq_pin(e, s, 0, 2 * G.bt, 0));
        else
            dt_assert_ok(kvh_seq_release(e, s, 0, 2 * G.bt));
        dt_assert_ok(kvh_seq_free(e, s));
        dt_assert_ok(dt_close(e));
    }
}

/* An agent given a quota kept its eviction order (about 60 bytes a
 * device slot) until the engine closed, also once the quota was lifted:
 * 15.7 KB for each of 10,000 agents over 256 slots. Lifting it gives
 * the memory back; a quota set again works as the first did. */
static void test_a_lifted_quota_gives_its_order_back(void **state)
{
    (void)state;
    kvh_engine *e = open_mem(8, 8, 2);
    kvh_seq s, t;
    dt_assert_ok(kvh_agent_set_quota(e, 1, 2 * dt_block_bytes(G)));
    dt_assert_ok(dt_build(e, G, dt_plain(60), 2 * G.bt, 1, &s));
    for (uint32_t agent = 2; agent < 200; agent++)
        dt_assert_ok(kvh_agent_set_quota(e, agent, dt_block_bytes(G)));
    for (uint32_t agent = 1; agent < 200; agent++)
        dt_assert_ok(kvh_agent_set_quota(e, agent, 0));
    wb_lock(e);
    for (uint32_t agent = 1; agent < 200; agent++) {
        kvhi_agent *a = kvhi_agent_get(e, agent, false);
        assert_non_null(a);
        if (a->heap.cap != 0)
            fail_msg("agent %u kept an eviction order of %u entries after its quota was lifted", agent, a->heap.cap);
    }
    wb_unlock(e);
    /* The quota again: at it, agent 1's next block takes one of its own
     * slots, not a free one. */
    dt_assert_ok(kvh_agent_set_quota(e, 1, 2 * dt_block_bytes(G)));
    dt_assert_ok(dt_build(e, G, dt_plain(61), G.bt, 1, &t));
    assert_int_equal(dt_binfo(e, t, 0).tier, KVH_TIER_DEVICE);
    int in_device = (dt_binfo(e, s, 0).tier == KVH_TIER_DEVICE) + (dt_binfo(e, s, 1).tier == KVH_TIER_DEVICE);
    assert_int_equal(in_device, 1);
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(kvh_seq_free(e, t));
    dt_assert_ok(dt_close(e));
}

static void test_quota_makes_room_among_own(void **state)
{
    (void)state;
    kvh_engine *e = open_mem(8, 8, 2);
    kvh_seq z, s;
    dt_assert_ok(dt_build(e, G, dt_plain(50), 2 * G.bt, 0, &z)); /* agent 0: the oldest blocks */
    dt_assert_ok(kvh_agent_set_quota(e, 1, 2 * dt_block_bytes(G)));
    dt_assert_ok(dt_build(e, G, dt_plain(51), 2 * G.bt, 1, &s)); /* agent 1: at its quota */
    uint32_t b[4] = {wb_seq_block_index(e, z, 0), wb_seq_block_index(e, z, 1), wb_seq_block_index(e, s, 0),
                     wb_seq_block_index(e, s, 1)};
    wb_lock(e);
    kvhi_block_touch(e, b[2]);
    kvhi_block_touch(e, b[2]); /* b[3] is agent 1's least valuable */
    uint32_t old_slot = kvhi_blk(e, b[3])->slot, free0 = e->tiers[KVH_TIER_DEVICE].slots.free_count;
    assert_true(free0 >= 4);
    uint32_t slot = 0;
    assert_int_equal(reserve_one(e, KVH_TIER_DEVICE, 1, b, 4, &slot), 3);
    assert_int_equal(slot, old_slot); /* its slot, not a free one */
    assert_int_equal(e->tiers[KVH_TIER_DEVICE].slots.free_count, free0);
    assert_int_equal(kvhi_blk(e, b[3])->tier, KVH_TIER_HOST);
    kvhi_release_slot(e, KVH_TIER_DEVICE, slot);
    /* An agent without a quota takes a free slot: nothing leaves. */
    uint64_t ev = e->stats.evictions;
    assert_int_equal(reserve_one(e, KVH_TIER_DEVICE, 0, b, 4, &slot), -1);
    assert_int_equal(e->stats.evictions, ev);
    kvhi_release_slot(e, KVH_TIER_DEVICE, slot);
    wb_unlock(e);

    /* Agent 1 back at its quota with both of its blocks held. */
    dt_assert_ok(kvh_seq_acquire(e, s, 0, 2 * G.bt, NULL));
    assert_int_equal(kvhi_blk(e, b[3])->tier, KVH_TIER_DEVICE);
    wb_lock(e);
    uint32_t none = 0;
    assert_true(e->tiers[KVH_TIER_DEVICE].slots.free_count > 0);
    assert_int_equal(kvhi_reserve_slot(e, KVH_TIER_DEVICE, 1, &none), KVH_ERR_NOSPACE);
    assert_string_equal(kvh_last_error(), "agent 1 is at its device quota and none of its blocks can leave");
    assert_int_equal(reserve_one(e, KVH_TIER_DEVICE, 0, b, 4, &slot), -1); /* agent 0: still room */
    kvhi_release_slot(e, KVH_TIER_DEVICE, slot);
    wb_unlock(e);
    /* A new block of agent 1 goes to the host tier instead. */
    dt_assert_ok(dt_extend(e, s, G, dt_plain(51), 2 * G.bt, G.bt));
    assert_int_equal(dt_binfo(e, s, 2).tier, KVH_TIER_HOST);
    assert_int_equal(dt_binfo(e, z, 0).tier, KVH_TIER_DEVICE);
    assert_int_equal(dt_binfo(e, z, 1).tier, KVH_TIER_DEVICE);
    /* Acquiring it finds agent 1's blocks all held: the refusal names the
     * quota, not a full tier (the device tier has free slots). */
    assert_int_equal(kvh_seq_acquire(e, s, 2 * G.bt, G.bt, NULL), KVH_ERR_NOSPACE);
    assert_string_equal(kvh_last_error(), "agent 1 is at its device quota and none of its blocks can leave");
    dt_assert_ok(kvh_seq_release(e, s, 0, 2 * G.bt));

    /* Nothing anywhere can make room: what the public call says. */
    kvh_engine *f = open_mem(1, 1, 2);
    kvh_block x, y, w;
    dt_assert_ok(kvh_block_alloc(f, 0, &x));
    dt_assert_ok(kvh_block_alloc(f, 0, &y));
    assert_int_equal(kvh_block_alloc(f, 0, &w), KVH_ERR_NOSPACE);
    assert_string_equal(kvh_last_error(),
                        "no memory tier can make room for a new block (all pinned, held or referenced)");
    dt_assert_ok(kvh_block_release(f, x));
    dt_assert_ok(kvh_block_release(f, y));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(kvh_seq_free(e, z));

    /* With a disk tier, referenced blocks go there; once it is full too,
     * the message names it. */
    char dir[PATH_MAX];
    dt_scratch("full-disk-message", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 1, 1, 2, 0);
    kvh_engine *g = dt_open_a(&c);
    kvh_block held[4], more;
    for (int i = 0; i < 4; i++)
        dt_assert_ok(kvh_block_alloc(g, 0, &held[i]));
    assert_int_equal(dt_tier(g, KVH_TIER_DISK).used_blocks, 2);
    assert_int_equal(kvh_block_alloc(g, 0, &more), KVH_ERR_NOSPACE);
    assert_string_equal(kvh_last_error(), "no memory tier can make room for a new block (all pinned, held or "
                                          "referenced, and the disk tier is full)");
    for (int i = 0; i < 4; i++)
        dt_assert_ok(kvh_block_release(g, held[i]));
    dt_assert_ok(dt_close(g));
}

/* Every tier full of referenced blocks: a block on disk still comes up,
 * to either memory tier, trading places with a memory block through the
 * host tier's spare slot. The blocks here are not published (one partial
 * block a sequence), so none is durable on disk and each trade gives the
 * spare back: no tier holds more than it did, and every byte reads back. */
static void test_full_store_trades_a_disk_block_up(void **state)
{
    (void)state;
    enum { SEQS = 8 };
    for (uint32_t config = 0; config < 4; config++) {
        uint32_t threads = config & 1 ? 2 : 0, copy_moves = config >> 1;
        char dir[PATH_MAX], name[64];
        snprintf(name, sizeof name, "full-store-%u", config);
        dt_scratch(name, dir, sizeof(dir));
        kvh_config c = dt_cfg(G, dir, 2, 2, 4, threads);
        c.copy_moves = copy_moves;
        kvh_engine *e = dt_open_a(&c);
        kvh_seq s[SEQS];
        for (uint32_t i = 0; i < SEQS; i++)
            dt_assert_ok(dt_build(e, G, dt_plain(60 + i), G.bt - 1, 0, &s[i]));
        for (uint32_t i = 0; i < 4; i++)
            assert_int_equal(dt_binfo(e, s[i], 0).tier, KVH_TIER_DISK);
        kvh_tier_info before[3];
        for (uint32_t t = 0; t < 3; t++)
            before[t] = dt_tier(e, t);
        assert_int_equal(before[KVH_TIER_HOST].capacity_blocks, 2);
        assert_int_equal(before[KVH_TIER_HOST].used_blocks, 2);
        assert_int_equal(before[KVH_TIER_DISK].used_blocks, 4);
        dt_assert_ok(kvh_seq_migrate(e, s[0], 0, G.bt - 1, KVH_TIER_HOST, NULL));
        assert_string_equal(kvh_last_error(), ""); /* no reason left from the first try */
        assert_int_equal(dt_binfo(e, s[0], 0).tier, KVH_TIER_HOST);
        dt_assert_ok(kvh_seq_migrate(e, s[1], 0, G.bt - 1, KVH_TIER_DEVICE, NULL));
        assert_string_equal(kvh_last_error(), "");
        assert_int_equal(dt_binfo(e, s[1], 0).tier, KVH_TIER_DEVICE);
        /* Two in one call: one batch with workers, each block in turn
         * (the second may push the first out again, as the victim). */
        kvh_block two[2];
        dt_assert_ok(kvh_seq_blocks(e, s[2], 0, 1, &two[0]));
        dt_assert_ok(kvh_seq_blocks(e, s[3], 0, 1, &two[1]));
        uint64_t read_before = dt_stats(e).blocks_disk_to_host;
        dt_assert_ok(kvh_migrate(e, two, 2, KVH_TIER_HOST, NULL));
        assert_true(dt_stats(e).blocks_disk_to_host >= read_before + 2);
        assert_int_equal(dt_binfo(e, s[3], 0).tier, KVH_TIER_HOST);
        for (uint32_t t = 0; t < 3; t++) {
            kvh_tier_info now = dt_tier(e, t);
            assert_int_equal(now.capacity_blocks, before[t].capacity_blocks);
            assert_int_equal(now.used_blocks, before[t].used_blocks);
        }
        for (uint32_t i = 0; i < SEQS; i++)
            dt_assert_verified(e, s[i], G, dt_plain(60 + i), 0, G.bt - 1);
        for (uint32_t i = 0; i < SEQS; i++)
            dt_assert_ok(kvh_seq_free(e, s[i]));
        for (uint32_t t = 0; t < 3; t++)
            assert_int_equal(dt_tier(e, t).used_blocks, 0);
        assert_int_equal(dt_tier(e, KVH_TIER_HOST).capacity_blocks, 2);
        dt_assert_ok(dt_close(e));
    }
}

/* A block durable on disk keeps its disk slot when it comes up, so with
 * every tier full it takes the spare and keeps it: the host tier holds a
 * block more than its budget (counted in capacity_blocks) until a host
 * slot is released. Blocks that came up keep clean disk copies, so a
 * whole sequence still reads back a block at a time. */
static void test_full_store_lends_the_spare_to_a_durable_block(void **state)
{
    (void)state;
    for (uint32_t threads = 0; threads <= 2; threads += 2) {
        char dir[PATH_MAX], name[64];
        snprintf(name, sizeof name, "full-store-durable-%u", threads);
        dt_scratch(name, dir, sizeof(dir));
        kvh_config c = dt_cfg(G, dir, 2, 2, 4, threads);
        kvh_engine *e = dt_open_a(&c);
        kvh_seq s;
        dt_content ct = dt_plain(70 + threads);
        /* The last block is written while it is new, in the device tier:
         * written later, it would have to come up from disk itself. */
        dt_assert_ok(dt_build(e, G, ct, 7 * G.bt, 0, &s));
        dt_assert_ok(dt_extend(e, s, G, ct, 7 * G.bt, G.bt));
        assert_int_equal(dt_binfo(e, s, 0).tier, KVH_TIER_DISK);
        assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, 4);
        assert_int_equal(dt_tier(e, KVH_TIER_HOST).used_blocks, 2);
        dt_assert_ok(kvh_seq_migrate(e, s, 0, G.bt, KVH_TIER_HOST, NULL));
        assert_int_equal(dt_binfo(e, s, 0).tier, KVH_TIER_HOST);
        kvh_tier_info host = dt_tier(e, KVH_TIER_HOST);
        assert_int_equal(host.capacity_blocks, 3);
        assert_int_equal(host.used_blocks, 3);
        assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, 4);
        dt_assert_verified(e, s, G, ct, 0, 8 * G.bt);
        /* Freed, the sequence's blocks stay cached (published), and the
         * next room the host tier makes pays the spare back first. */
        dt_assert_ok(kvh_seq_free(e, s));
        assert_int_equal(dt_tier(e, KVH_TIER_HOST).capacity_blocks, 3);
        kvh_seq s2;
        dt_assert_ok(dt_build(e, G, dt_plain(90 + threads), 2 * G.bt, 0, &s2));
        host = dt_tier(e, KVH_TIER_HOST);
        assert_int_equal(host.capacity_blocks, 2);
        assert_true(host.used_blocks <= 2);
        dt_assert_verified(e, s2, G, dt_plain(90 + threads), 0, 2 * G.bt);
        dt_assert_ok(kvh_seq_free(e, s2));
        dt_assert_ok(dt_close(e));
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_lru_k_order, teardown),
        cmocka_unit_test_teardown(test_protected_blocks_stay, teardown),
        cmocka_unit_test_teardown(test_last_tier_drops_unreferenced, teardown),
        cmocka_unit_test_teardown(test_full_disk_takes_back_unreferenced_copies, teardown),
        cmocka_unit_test_teardown(test_full_disk_waits_for_queued_moves, teardown),
        cmocka_unit_test_teardown(test_full_disk_pinned_queued_move_frees_nothing, teardown),
        cmocka_unit_test_teardown(test_victim_that_cannot_go_down, teardown),
        cmocka_unit_test_teardown(test_victim_passes_a_pinned_host_tier, teardown),
        cmocka_unit_test_teardown(test_victim_with_a_disk_copy_follows_the_order, teardown),
        cmocka_unit_test_teardown(test_quota_makes_room_among_own, teardown),
        cmocka_unit_test_teardown(test_a_lifted_quota_gives_its_order_back, teardown),
        cmocka_unit_test_teardown(test_a_copy_of_an_acquired_block_under_a_quota, teardown),
        cmocka_unit_test_teardown(test_full_store_trades_a_disk_block_up, teardown),
        cmocka_unit_test_teardown(test_full_store_lends_the_spare_to_a_durable_block, teardown),
        cmocka_unit_test_teardown(test_a_fence_failure_without_detail_still_says_why, teardown),
    };
    return cmocka_run_group_tests_name("evict", tests, NULL, NULL);
}
