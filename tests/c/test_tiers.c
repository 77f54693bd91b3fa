/* Tiers, eviction, acquire/release, pinning, swaps, NOSPACE, quotas,
 * explicit migration with fences, prefetch, stats. Every test runs with
 * migration_threads = 0 (inline) and = 2 (workers), and with device and
 * host tiers as one arena (moves in place, the CPU backend's default) and
 * as two (copy_moves: moves copy, the path of a discrete GPU). */
#include <pthread.h>
#include <stdbool.h>
#include <unistd.h>

#include "test_util.h"

typedef struct mode {
    uint32_t threads;
    bool copies;
} mode;
static mode M_PLACE0 = {0, false}, M_PLACE2 = {2, false}, M_COPY0 = {0, true}, M_COPY2 = {2, true};
#define THREADS(state) ((*(mode **)(state))->threads)
#define COPIES(state) ((*(mode **)(state))->copies)
static mode *current; /* the running test's, for the helpers below */

enum { L = 2, H = 2, D = 4, BT = 4 };
static const size_t TOK = H * D * 4;

static kvh_config small_cfg(uint32_t layers, uint32_t heads, uint32_t dim, uint32_t bt, uint64_t dev, uint64_t host,
                            uint32_t threads)
{
    kvh_config c = tu_cfg(layers, heads, dim, bt, KVH_DTYPE_F32, dev, host, threads);
    c.copy_moves = current->copies;
    return c;
}

static kvh_engine *open_small(uint32_t threads, uint64_t dev, uint64_t host)
{
    kvh_config c = small_cfg(L, H, D, BT, dev, host, threads);
    return tu_open_cfg(&c);
}

static int set_mode(void **state)
{
    current = *(mode **)state;
    return 0;
}

/* Blocks moved between the device and host tiers from a to b: per
 * direction when moves copy; on one arena only their sum is counted, and
 * no bytes are copied. */
static void assert_moves(const kvh_stats *a, const kvh_stats *b, uint64_t down, uint64_t up)
{
    if (current->copies) {
        assert_int_equal(b->blocks_device_to_host - a->blocks_device_to_host, down);
        assert_int_equal(b->blocks_host_to_device - a->blocks_host_to_device, up);
        assert_int_equal(b->blocks_moved_in_place, 0);
    } else {
        assert_int_equal(b->blocks_moved_in_place - a->blocks_moved_in_place, down + up);
        assert_int_equal(b->bytes_device_to_host + b->bytes_host_to_device, 0);
    }
}

static uint64_t moved_down(const kvh_stats *s)
{
    return current->copies ? s->blocks_device_to_host : s->blocks_moved_in_place;
}

/* A sequence of n_blocks full blocks of distinct tokens, KV written with
 * tu_pattern(tag). */
static kvh_seq make_seq(kvh_engine *e, uint32_t agent, uint32_t n_blocks, uint64_t tag)
{
    kvh_seq s = tu_seq_new(e, agent);
    int32_t *t = tu_alloc(sizeof(int32_t) * n_blocks * BT);
    tu_iota(t, n_blocks * BT, (int32_t)(tag * 100000));
    assert_ok(kvh_seq_append(e, s, t, n_blocks * BT));
    tu_write_pattern(e, s, L, TOK, tag, 0, n_blocks * BT);
    tu_free(t);
    return s;
}

static uint32_t tier_of(kvh_engine *e, kvh_seq s, uint64_t i) { return tu_seq_binfo(e, s, i).tier; }

static uint64_t count_in(kvh_engine *e, kvh_seq s, uint32_t n_blocks, uint32_t tier)
{
    uint64_t c = 0;
    for (uint32_t i = 0; i < n_blocks; i++)
        c += tier_of(e, s, i) == tier;
    return c;
}

/* Stats add up: live blocks, and bytes = blocks * block_bytes per direction. */
static void check_stats(kvh_engine *e)
{
    kvh_stats s = tu_stats(e);
    uint64_t bb = tu_block_bytes(e);
    uint64_t live = tu_tier(e, KVH_TIER_DEVICE).used_blocks + tu_tier(e, KVH_TIER_HOST).used_blocks;
    assert_int_equal(s.blocks_allocated - s.blocks_freed, live);
    assert_int_equal(s.bytes_device_to_host, s.blocks_device_to_host * bb);
    assert_int_equal(s.bytes_host_to_device, s.blocks_host_to_device * bb);
    assert_int_equal(s.bytes_host_to_disk, s.blocks_host_to_disk * bb);
    assert_int_equal(s.bytes_disk_to_host, s.blocks_disk_to_host * bb);
    assert_int_equal(s.lookups, s.hits_device + s.hits_host + s.hits_disk);
    for (uint32_t t = 0; t < 2; t++) {
        kvh_tier_info ti = tu_tier(e, t);
        assert_int_equal(ti.used_bytes, ti.used_blocks * bb);
        assert_true(ti.used_blocks <= ti.capacity_blocks);
    }
}

/* Waits until no migration is running (workers) by migrating nothing with
 * a fence: jobs run in priority order, so poll block states instead. */
static void wait_idle_block(kvh_engine *e, kvh_block b)
{
    for (int i = 0; i < 20000; i++) {
        if (!tu_binfo(e, b).in_flight)
            return;
        usleep(100);
    }
    fail_msg("block stayed in flight");
}

/* ---- eviction, acquire, release ---- */

static void test_evict_and_acquire(void **state)
{
    kvh_engine *e = open_small(THREADS(state), 4, 16);
    kvh_seq a = make_seq(e, 0, 8, 1);
    /* Device holds 4; the 4 least valuable went to the host, intact. */
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, 4);
    assert_int_equal(tu_tier(e, KVH_TIER_HOST).used_blocks, 4);
    assert_int_equal(count_in(e, a, 8, KVH_TIER_HOST), 4);
    kvh_stats s0 = tu_stats(e);
    assert_true(s0.evictions >= 4);
    assert_true(moved_down(&s0) >= 4);
    assert_true(tu_check_pattern(e, a, L, TOK, 1, 0, 32));
    check_stats(e);

    /* Acquire two host blocks: they come up and are held. */
    uint64_t first_host = 0;
    while (tier_of(e, a, first_host) != KVH_TIER_HOST)
        first_host++;
    kvh_stats s1 = tu_stats(e);
    assert_ok(kvh_seq_acquire(e, a, first_host * BT, BT, NULL));
    kvh_block_info bi = tu_seq_binfo(e, a, first_host);
    assert_int_equal(bi.tier, KVH_TIER_DEVICE);
    assert_int_equal(bi.holds, 1);
    kvh_stats s2 = tu_stats(e);
    assert_moves(&s1, &s2, 1, 1);             /* one up, and one down to make room */
    assert_true(s2.hits_host > s1.hits_host); /* found in the host tier */

    /* Acquire everything in the device tier (4 blocks, some already there). */
    assert_ok(kvh_seq_acquire(e, a, 0, 4 * BT, NULL));
    for (uint64_t i = 0; i < 4; i++)
        assert_int_equal(tier_of(e, a, i), KVH_TIER_DEVICE);
    /* Held blocks are never evicted: new blocks must go to the host. */
    kvh_seq b = make_seq(e, 1, 6, 2);
    for (uint64_t i = 0; i < 4; i++)
        assert_int_equal(tier_of(e, a, i), KVH_TIER_DEVICE);
    assert_int_equal(count_in(e, b, 6, KVH_TIER_HOST), 6);
    /* Acquiring more than fits while everything is held: NOSPACE, nothing held. */
    assert_kvh(KVH_ERR_NOSPACE, kvh_seq_acquire(e, b, 0, BT, NULL));
    assert_int_equal(tu_seq_binfo(e, b, 0).holds, 0);
    assert_true(tu_check_pattern(e, b, L, TOK, 2, 0, 24));

    /* Release: a hold that was not taken is an error; holds nest. */
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_release(e, a, 4 * BT, BT));
    if (first_host < 4) {
        assert_int_equal(tu_seq_binfo(e, a, first_host).holds, 2);
    }
    assert_ok(kvh_seq_release(e, a, 0, 4 * BT));
    assert_ok(kvh_seq_release(e, a, first_host * BT, BT));
    for (uint64_t i = 0; i < 8; i++)
        assert_int_equal(tu_seq_binfo(e, a, i).holds, 0);
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_release(e, a, 0, BT));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_acquire(e, a, 30, 3, NULL));
    /* Now b's blocks can come up. */
    assert_ok(kvh_seq_acquire(e, b, 0, 2 * BT, NULL));
    assert_int_equal(tier_of(e, b, 0), KVH_TIER_DEVICE);
    assert_int_equal(tier_of(e, b, 1), KVH_TIER_DEVICE);
    assert_ok(kvh_seq_release(e, b, 0, 2 * BT));
    assert_true(tu_check_pattern(e, a, L, TOK, 1, 0, 32));
    assert_true(tu_check_pattern(e, b, L, TOK, 2, 0, 24));
    check_stats(e);
}

static void test_acquire_with_fence(void **state)
{
    kvh_engine *e = open_small(THREADS(state), 4, 16);
    kvh_seq a = make_seq(e, 0, 8, 3);
    kvh_fence f = {0};
    kvh_stats s0 = tu_stats(e);
    assert_ok(kvh_seq_acquire(e, a, 0, 3 * BT, &f));
    assert_true(f.id != 0);
    assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
    int32_t done = 0;
    assert_ok(kvh_fence_poll(e, f, &done));
    assert_int_equal(done, 1);
    assert_ok(kvh_fence_free(e, f));
    for (uint64_t i = 0; i < 3; i++) {
        kvh_block_info bi = tu_seq_binfo(e, a, i);
        assert_int_equal(bi.tier, KVH_TIER_DEVICE);
        assert_int_equal(bi.holds, 1);
        assert_int_equal(bi.in_flight, 0);
    }
    kvh_stats s1 = tu_stats(e);
    assert_int_equal(s1.lookups - s0.lookups, 3);
    assert_ok(kvh_seq_release(e, a, 0, 3 * BT));
    /* Acquire of blocks already resident completes at once. */
    assert_ok(kvh_seq_acquire(e, a, 0, BT, &f));
    assert_ok(kvh_fence_poll(e, f, &done));
    assert_int_equal(done, 1);
    assert_ok(kvh_fence_wait(e, f, 0));
    assert_ok(kvh_fence_free(e, f));
    assert_ok(kvh_seq_release(e, a, 0, BT));
    assert_true(tu_check_pattern(e, a, L, TOK, 3, 0, 32));
    check_stats(e);
}

/* ---- LRU-K victim choice inside the engine ---- */

static void test_lru_k_victims(void **state)
{
    for (uint32_t k = 1; k <= 2; k++) {
        kvh_config c = small_cfg(L, H, D, BT, 4, 16, THREADS(state));
        c.lru_k = k;
        kvh_engine *e = tu_open_cfg(&c);
        int32_t t[16];
        tu_iota(t, 16, 1);
        kvh_seq x = tu_seq_new(e, 0);
        assert_ok(kvh_seq_append(e, x, t, 12));        /* blocks 0..2, one access each */
        assert_ok(kvh_seq_acquire(e, x, 0, 12, NULL)); /* second access */
        assert_ok(kvh_seq_release(e, x, 0, 12));
        assert_ok(kvh_seq_append(e, x, t + 12, 4)); /* block 3: one access, the newest */
        kvh_seq y = tu_seq_new(e, 0);
        assert_ok(kvh_seq_append(e, y, t, 4)); /* needs one device slot */
        if (k == 2) {
            /* LRU-2: block 3 has < 2 accesses: infinite K-distance, goes first. */
            assert_int_equal(tier_of(e, x, 3), KVH_TIER_HOST);
            assert_int_equal(tier_of(e, x, 0), KVH_TIER_DEVICE);
        } else {
            /* LRU: block 0 was used least recently. */
            assert_int_equal(tier_of(e, x, 0), KVH_TIER_HOST);
            assert_int_equal(tier_of(e, x, 3), KVH_TIER_DEVICE);
        }
        assert_int_equal(tier_of(e, y, 0), KVH_TIER_DEVICE);
        assert_ok(tu_close(e));
    }
}

/* Unreferenced (cached-only) blocks leave before referenced ones, even
 * when they were used more recently. */
static void test_unreferenced_evicted_first(void **state)
{
    kvh_engine *e = open_small(THREADS(state), 4, 16);
    kvh_seq b = make_seq(e, 0, 2, 5); /* referenced, older */
    kvh_seq a = make_seq(e, 0, 2, 6); /* newer, will be cached only */
    kvh_block ab[2] = {tu_seq_block(e, a, 0), tu_seq_block(e, a, 1)};
    assert_int_equal(tu_binfo(e, ab[0]).published, 1);
    assert_ok(kvh_seq_free(e, a));
    assert_int_equal(tu_binfo(e, ab[0]).refs, 0);
    kvh_seq c = make_seq(e, 0, 2, 7);
    assert_int_equal(tier_of(e, b, 0), KVH_TIER_DEVICE);
    assert_int_equal(tier_of(e, b, 1), KVH_TIER_DEVICE);
    assert_int_equal(tier_of(e, c, 0), KVH_TIER_DEVICE);
    assert_int_equal(tier_of(e, c, 1), KVH_TIER_DEVICE);
    assert_int_equal(tu_binfo(e, ab[0]).tier, KVH_TIER_HOST);
    assert_int_equal(tu_binfo(e, ab[1]).tier, KVH_TIER_HOST);
    check_stats(e);
}

/* Without a tier below, unreferenced cached blocks are dropped to make
 * room; referenced blocks never are. */
static void test_drop_without_lower_tier(void **state)
{
    kvh_engine *e = open_small(THREADS(state), 4, 0);
    kvh_seq a = make_seq(e, 0, 4, 8);
    int32_t t[16];
    tu_iota(t, 16, 8 * 100000);
    assert_ok(kvh_seq_free(e, a));
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, 4); /* all cached */
    kvh_stats s0 = tu_stats(e);
    kvh_seq b = make_seq(e, 0, 2, 9);
    kvh_stats s1 = tu_stats(e);
    assert_int_equal(s1.drops - s0.drops, 2);
    assert_int_equal(s1.blocks_freed - s0.blocks_freed, 2);
    kvh_seq c = tu_seq_new(e, 0);
    size_t m = 0;
    assert_ok(kvh_seq_match_prefix(e, c, t, 16, &m));
    assert_true(m < 16);
    assert_ok(kvh_seq_free(e, c));
    /* Two more referenced blocks take the last cached ones' place ... */
    kvh_seq d = make_seq(e, 0, 2, 10);
    assert_int_equal(tu_stats(e).drops - s0.drops, 4);
    /* ... and then nothing can be dropped. */
    kvh_seq f = tu_seq_new(e, 0);
    assert_kvh(KVH_ERR_NOSPACE, kvh_seq_append(e, f, t, 1));
    assert_true(tu_check_pattern(e, b, L, TOK, 9, 0, 8));
    assert_true(tu_check_pattern(e, d, L, TOK, 10, 0, 8));
    check_stats(e);
}

/* Both tiers full of cached (unreferenced, published) blocks: a new block
 * must still be allocated, by dropping the least valuable cached block. */
static void test_cached_blocks_make_room(void **state)
{
    kvh_engine *e = open_small(THREADS(state), 4, 4);
    kvh_seq a = make_seq(e, 0, 8, 27);
    assert_ok(kvh_seq_free(e, a));
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks + tu_tier(e, KVH_TIER_HOST).used_blocks, 8);
    kvh_stats s0 = tu_stats(e);
    kvh_seq b = tu_seq_new(e, 1);
    int32_t t[4] = {1, 2, 3, 4};
    kvh_status st = kvh_seq_append(e, b, t, 4);
    if (st != KVH_OK)
        print_error("append with every slot holding an unreferenced cached block: %s (%s)\n", kvh_status_name(st),
                    kvh_last_error());
    assert_ok(st);
    assert_int_equal(tu_stats(e).drops - s0.drops, 1);
    assert_int_equal(tu_seq_binfo(e, b, 0).tier, KVH_TIER_DEVICE);
    tu_write_pattern(e, b, L, TOK, 28, 0, 4);
    assert_true(tu_check_pattern(e, b, L, TOK, 28, 0, 4));
    check_stats(e);
}

/* ---- pinning ---- */

static void test_pinning(void **state)
{
    kvh_engine *e = open_small(THREADS(state), 4, 16);
    kvh_seq p = make_seq(e, 0, 2, 11);
    assert_ok(kvh_seq_pin(e, p, 0, 2 * BT, 1));
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).pinned_blocks, 2);
    assert_int_equal(tu_seq_binfo(e, p, 0).pins, 1);
    kvh_seq q = make_seq(e, 0, 10, 12);
    /* Pinned blocks stayed; q's blocks share the remaining 2 device slots. */
    assert_int_equal(tier_of(e, p, 0), KVH_TIER_DEVICE);
    assert_int_equal(tier_of(e, p, 1), KVH_TIER_DEVICE);
    assert_int_equal(count_in(e, q, 10, KVH_TIER_DEVICE), 2);
    /* Explicit migration skips pinned blocks. */
    assert_ok(kvh_seq_migrate(e, p, 0, 2 * BT, KVH_TIER_HOST, NULL));
    assert_int_equal(tier_of(e, p, 0), KVH_TIER_DEVICE);
    assert_int_equal(tier_of(e, p, 1), KVH_TIER_DEVICE);
    /* Pins nest. */
    assert_ok(kvh_seq_pin(e, p, 0, BT, 1));
    assert_int_equal(tu_seq_binfo(e, p, 0).pins, 2);
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).pinned_blocks, 2);
    assert_ok(kvh_seq_pin(e, p, 0, 2 * BT, 0));
    assert_int_equal(tu_seq_binfo(e, p, 0).pins, 1);
    assert_int_equal(tu_seq_binfo(e, p, 1).pins, 0);
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).pinned_blocks, 1);
    /* Unpinning an unpinned range fails and changes nothing. */
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_pin(e, p, 0, 2 * BT, 0));
    assert_int_equal(tu_seq_binfo(e, p, 0).pins, 1);
    /* The sequence's pin is its own: a handle cannot drop it, and a
     * handle's pin is the handle's. */
    kvh_block b0 = tu_seq_block(e, p, 0);
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_block_pin(e, b0, 0));
    assert_int_equal(tu_seq_binfo(e, p, 0).pins, 1);
    assert_ok(kvh_block_pin(e, b0, 1));
    assert_int_equal(tu_seq_binfo(e, p, 0).pins, 2);
    assert_ok(kvh_seq_pin(e, p, 0, BT, 0));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_pin(e, p, 0, BT, 0));
    assert_int_equal(tu_seq_binfo(e, p, 0).pins, 1);
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).pinned_blocks, 1);
    assert_ok(kvh_block_pin(e, b0, 0));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_block_pin(e, b0, 0));
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).pinned_blocks, 0);

    /* A block pinned in the host tier stays there: prefetch skips it and
     * acquire fails without holding anything. */
    uint64_t hi = 0;
    while (tier_of(e, q, hi) != KVH_TIER_HOST)
        hi++;
    kvh_block hb = tu_seq_block(e, q, hi);
    assert_ok(kvh_block_pin(e, hb, 1));
    assert_int_equal(tu_tier(e, KVH_TIER_HOST).pinned_blocks, 1);
    kvh_fence f = {0};
    assert_ok(kvh_prefetch(e, q, hi * BT, BT, 0, &f));
    assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
    assert_ok(kvh_fence_free(e, f));
    assert_int_equal(tu_binfo(e, hb).tier, KVH_TIER_HOST);
    kvh_status st = kvh_seq_acquire(e, q, hi * BT, BT, NULL);
    assert_true(st != KVH_OK);
    assert_int_equal(tu_binfo(e, hb).tier, KVH_TIER_HOST);
    assert_int_equal(tu_binfo(e, hb).holds, 0);
    assert_ok(kvh_block_pin(e, hb, 0));
    assert_ok(kvh_seq_acquire(e, q, hi * BT, BT, NULL));
    assert_int_equal(tu_binfo(e, hb).tier, KVH_TIER_DEVICE);
    assert_ok(kvh_seq_release(e, q, hi * BT, BT));
    assert_int_equal(tu_tier(e, KVH_TIER_HOST).pinned_blocks, 0);
    /* Freeing a sequence drops the pins it took: its published blocks stay
     * cached, unpinned. */
    assert_ok(kvh_seq_pin(e, p, 0, 2 * BT, 1));
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).pinned_blocks + tu_tier(e, KVH_TIER_HOST).pinned_blocks, 2);
    assert_ok(kvh_seq_free(e, p));
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).pinned_blocks + tu_tier(e, KVH_TIER_HOST).pinned_blocks, 0);
    assert_true(tu_check_pattern(e, q, L, TOK, 12, 0, 40));
    check_stats(e);
}

/* Pins taken through a sequence are the sequence's: freeing or truncating
 * it drops them, so no block stays pinned with nobody to unpin it. */
static void test_seq_pins_end_with_the_sequence(void **state)
{
    kvh_engine *e = open_small(THREADS(state), 16, 16);
    for (int round = 0; round < 8; round++) {
        kvh_seq s = make_seq(e, 0, 2, 100 + (uint64_t)round);
        assert_ok(kvh_seq_acquire(e, s, 0, 2 * BT, NULL));
        assert_ok(kvh_seq_pin(e, s, 0, 2 * BT, 1));
        assert_ok(kvh_seq_free(e, s));
        assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).pinned_blocks, 0);
    }
    /* All 16 device slots can still be acquired. */
    kvh_seq big = make_seq(e, 0, 16, 200);
    assert_ok(kvh_seq_acquire(e, big, 0, 16 * BT, NULL));
    assert_ok(kvh_seq_release(e, big, 0, 16 * BT));
    /* Truncate drops the pins of the blocks cut off, keeps the others. */
    assert_ok(kvh_seq_pin(e, big, 0, 16 * BT, 1));
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).pinned_blocks, 16);
    assert_ok(kvh_seq_truncate(e, big, 4 * BT));
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).pinned_blocks, 4);
    /* A fork shares the blocks but not the pins: it cannot unpin them. */
    kvh_seq child;
    assert_ok(kvh_seq_fork(e, big, 0, &child));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_pin(e, child, 0, BT, 0));
    assert_int_equal(tu_seq_binfo(e, big, 0).pins, 1);
    /* A copy on write carries the writer's pins to its copy. */
    kvh_seq partial = make_seq(e, 0, 1, 300);
    int32_t tok = 7;
    assert_ok(kvh_seq_truncate(e, partial, BT - 1));
    kvh_seq twin;
    assert_ok(kvh_seq_fork(e, partial, 0, &twin));
    assert_ok(kvh_seq_pin(e, partial, 0, BT - 1, 1));
    assert_int_equal(tu_seq_binfo(e, partial, 0).pins, 1);
    assert_ok(kvh_seq_append(e, partial, &tok, 1)); /* shared partial block: copied first */
    assert_int_equal(tu_seq_binfo(e, partial, 0).pins, 1);
    assert_int_equal(tu_seq_binfo(e, twin, 0).pins, 0);
    assert_ok(kvh_seq_free(e, twin));
    assert_ok(kvh_seq_free(e, partial));
    assert_ok(kvh_seq_free(e, child));
    assert_ok(kvh_seq_free(e, big));
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).pinned_blocks, 0);
    assert_int_equal(tu_tier(e, KVH_TIER_HOST).pinned_blocks, 0);
    check_stats(e);
}

/* A block pinned while its move waits in the queue is skipped, as one
 * pinned before the call is: the fence reports success. */
static void test_pin_after_queueing_is_skipped(void **state)
{
    kvh_engine *e = open_small(THREADS(state), 32, 32);
    kvh_seq s = make_seq(e, 0, 24, 400);
    for (int round = 0; round < 20; round++) {
        uint32_t target = round % 2 ? KVH_TIER_DEVICE : KVH_TIER_HOST;
        kvh_fence f;
        assert_ok(kvh_seq_migrate(e, s, 0, 24 * BT, target, &f));
        assert_ok(kvh_seq_pin(e, s, 0, 24 * BT, 1));
        assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
        assert_ok(kvh_fence_free(e, f));
        assert_ok(kvh_seq_pin(e, s, 0, 24 * BT, 0));
    }
    assert_true(tu_check_pattern(e, s, L, TOK, 400, 0, 24 * BT));
    check_stats(e);
}

/* kvh.h, kvh_migrate: a move down of a block kvh_seq_acquire holds is
 * skipped (the caller reads it where it is), its fence still OK; once
 * released the same move runs. */
static void test_held_blocks_are_not_moved_down(void **state)
{
    kvh_engine *e = open_small(THREADS(state), 16, 16);
    kvh_seq s = make_seq(e, 0, 4, 410);
    assert_ok(kvh_seq_acquire(e, s, 0, 4 * BT, NULL));
    for (int round = 0; round < 2; round++) {
        kvh_fence f;
        assert_ok(kvh_seq_migrate(e, s, 0, 4 * BT, KVH_TIER_HOST, &f));
        assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
        assert_ok(kvh_fence_free(e, f));
        assert_int_equal(count_in(e, s, 4, KVH_TIER_DEVICE), round == 0 ? 4 : 0);
        if (round == 0)
            assert_ok(kvh_seq_release(e, s, 0, 4 * BT));
    }
    assert_true(tu_check_pattern(e, s, L, TOK, 410, 0, 4 * BT));
    check_stats(e);
}

/* ---- both tiers full ---- */

static void test_swap_when_both_full(void **state)
{
    kvh_engine *e = open_small(THREADS(state), 4, 4);
    kvh_seq a = make_seq(e, 0, 8, 13);
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, 4);
    assert_int_equal(tu_tier(e, KVH_TIER_HOST).used_blocks, 4);
    uint64_t hi = 0;
    while (tier_of(e, a, hi) != KVH_TIER_HOST)
        hi++;
    kvh_stats s0 = tu_stats(e);
    assert_ok(kvh_seq_acquire(e, a, hi * BT, BT, NULL));
    assert_int_equal(tier_of(e, a, hi), KVH_TIER_DEVICE);
    kvh_stats s1 = tu_stats(e);
    assert_moves(&s0, &s1, 1, 1);
    assert_int_equal(s1.evictions - s0.evictions, 1);
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, 4);
    assert_int_equal(tu_tier(e, KVH_TIER_HOST).used_blocks, 4);
    assert_int_equal(count_in(e, a, 8, KVH_TIER_HOST), 4);
    assert_true(tu_check_pattern(e, a, L, TOK, 13, 0, 32));
    /* More than the device holds: NOSPACE, and nothing stays held. The
     * message names the range's size, not blocks held elsewhere. */
    assert_kvh(KVH_ERR_NOSPACE, kvh_seq_acquire(e, a, 0, 32, NULL));
    assert_non_null(strstr(kvh_last_error(), "the range's 8 blocks are more than the device tier holds (4 slots)"));
    for (uint64_t i = 0; i < 8; i++)
        assert_int_equal(tu_seq_binfo(e, a, i).holds, i == hi ? 1 : 0);
    /* With a fence the wait reports the same, and the holds stay until
     * the release. */
    kvh_fence f;
    assert_ok(kvh_seq_acquire(e, a, 0, 32, &f));
    assert_kvh(KVH_ERR_NOSPACE, kvh_fence_wait(e, f, UINT64_MAX));
    assert_non_null(strstr(kvh_last_error(), "the range's 8 blocks are more than the device tier holds (4 slots)"));
    assert_ok(kvh_fence_free(e, f));
    for (uint64_t i = 0; i < 8; i++)
        assert_int_equal(tu_seq_binfo(e, a, i).holds, i == hi ? 2 : 1);
    assert_ok(kvh_seq_release(e, a, 0, 32));
    assert_ok(kvh_seq_release(e, a, hi * BT, BT));
    /* Each host block in turn. */
    for (uint64_t i = 0; i < 8; i++) {
        assert_ok(kvh_seq_acquire(e, a, i * BT, BT, NULL));
        assert_int_equal(tier_of(e, a, i), KVH_TIER_DEVICE);
        assert_ok(kvh_seq_release(e, a, i * BT, BT));
    }
    assert_true(tu_check_pattern(e, a, L, TOK, 13, 0, 32));
    check_stats(e);
}

/* ---- NOSPACE leaves everything as it was ---- */

static void test_nospace_changes_nothing(void **state)
{
    kvh_engine *e = open_small(THREADS(state), 4, 4);
    kvh_seq a = make_seq(e, 0, 7, 14);
    int32_t t[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    assert_ok(kvh_seq_append(e, a, t, 2)); /* block 7, 2 of 4 tokens */
    uint8_t k[32], v[32];
    memset(k, 1, sizeof(k));
    memset(v, 2, sizeof(v));
    for (uint32_t l = 0; l < L; l++)
        assert_ok(kvh_seq_write_kv(e, a, l, 28, 1, k, v));
    kvh_stats s0 = tu_stats(e);
    kvh_tier_info d0 = tu_tier(e, KVH_TIER_DEVICE), h0 = tu_tier(e, KVH_TIER_HOST);

    /* A new sequence cannot get a block. */
    kvh_seq b = tu_seq_new(e, 1);
    assert_kvh(KVH_ERR_NOSPACE, kvh_seq_append(e, b, t, 1));
    assert_true(kvh_last_error()[0] != '\0');
    assert_int_equal(tu_seq_len(e, b), 0);
    /* a: fits in its last block (2 tokens) but not 3. */
    assert_kvh(KVH_ERR_NOSPACE, kvh_seq_append(e, a, t, 3));
    assert_kvh(KVH_ERR_NOSPACE, kvh_seq_append(e, a, t, 9));
    assert_int_equal(tu_seq_len(e, a), 30);
    int32_t got[30];
    assert_ok(kvh_seq_tokens(e, a, 28, 2, got));
    assert_int_equal(got[0], 1);
    assert_int_equal(got[1], 2);
    /* Forked child: writing needs a copy, which cannot be made. */
    kvh_seq c;
    assert_ok(kvh_seq_fork(e, a, 2, &c));
    uint8_t kk[32], vv[32];
    memset(kk, 9, sizeof(kk));
    memset(vv, 9, sizeof(vv));
    assert_kvh(KVH_ERR_NOSPACE, kvh_seq_write_kv(e, c, 0, 0, 1, kk, vv));
    assert_kvh(KVH_ERR_NOSPACE, kvh_seq_append(e, c, t, 1)); /* shared partial block */
    assert_kvh(KVH_ERR_NOSPACE, kvh_seq_truncate(e, c, 5));  /* shared partial copy */
    assert_int_equal(tu_seq_len(e, c), 30);
    assert_true(tu_check_pattern(e, c, L, TOK, 14, 0, 28));
    assert_true(tu_check_pattern(e, a, L, TOK, 14, 0, 28));
    uint8_t rk[32], rv[32];
    assert_ok(kvh_seq_read_kv(e, c, 1, 28, 1, rk, rv));
    assert_memory_equal(rk, k, TOK);
    assert_ok(kvh_seq_free(e, c));
    /* Acquire of more than the device: NOSPACE. */
    assert_kvh(KVH_ERR_NOSPACE, kvh_seq_acquire(e, a, 0, 30, NULL));
    for (uint64_t i = 0; i < 8; i++)
        assert_int_equal(tu_seq_binfo(e, a, i).holds, 0);
    kvh_block nb;
    assert_kvh(KVH_ERR_NOSPACE, kvh_block_alloc(e, 0, &nb));

    /* Nothing changed: no block allocated or freed, occupancy the same. */
    kvh_stats s1 = tu_stats(e);
    assert_int_equal(s1.blocks_allocated, s0.blocks_allocated);
    assert_int_equal(s1.blocks_freed, s0.blocks_freed);
    assert_int_equal(s1.drops, s0.drops);
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, d0.used_blocks);
    assert_int_equal(tu_tier(e, KVH_TIER_HOST).used_blocks, h0.used_blocks);
    check_stats(e);

    /* The engine is still usable: freeing a's unpublished partial block
     * makes room for one block. */
    assert_ok(kvh_seq_truncate(e, a, 28));
    assert_ok(kvh_block_alloc(e, 0, &nb));
    assert_ok(kvh_block_release(e, nb));
    assert_ok(kvh_seq_append(e, b, t, 4));
    tu_write_pattern(e, b, L, TOK, 15, 0, 4);
    assert_true(tu_check_pattern(e, b, L, TOK, 15, 0, 4));
    assert_true(tu_check_pattern(e, a, L, TOK, 14, 0, 28));
    check_stats(e);
}

static void test_nospace_all_pinned(void **state)
{
    kvh_engine *e = open_small(THREADS(state), 2, 2);
    kvh_block x;
    assert_ok(kvh_block_alloc(e, 0, &x)); /* one referenced standalone block */
    kvh_seq a = make_seq(e, 0, 3, 16);
    /* Pinned through block handles: those pins outlive the sequence. */
    kvh_block ab[3];
    assert_ok(kvh_seq_blocks(e, a, 0, 3, ab));
    for (int i = 0; i < 3; i++)
        assert_ok(kvh_block_pin(e, ab[i], 1));
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).pinned_blocks + tu_tier(e, KVH_TIER_HOST).pinned_blocks, 3);
    assert_ok(kvh_seq_free(e, a)); /* cached, unreferenced, but pinned */
    kvh_seq b = tu_seq_new(e, 0);
    int32_t t[4] = {1, 2, 3, 4};
    kvh_stats s0 = tu_stats(e);
    assert_kvh(KVH_ERR_NOSPACE, kvh_seq_append(e, b, t, 4));
    assert_int_equal(tu_seq_len(e, b), 0);
    kvh_stats s1 = tu_stats(e);
    assert_int_equal(s1.drops, s0.drops);
    assert_int_equal(s1.blocks_allocated, s0.blocks_allocated);
    /* The pinned cached blocks are all still there. */
    int32_t pt[12];
    tu_iota(pt, 12, 16 * 100000);
    kvh_seq c = tu_seq_new(e, 0);
    size_t m = 0;
    assert_ok(kvh_seq_match_prefix(e, c, pt, 12, &m));
    assert_int_equal(m, 12);
    assert_true(tu_check_pattern(e, c, L, TOK, 16, 0, 12));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_pin(e, c, 0, 12, 0)); /* not c's pins */
    for (int i = 0; i < 3; i++)
        assert_ok(kvh_block_pin(e, ab[i], 0));
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).pinned_blocks + tu_tier(e, KVH_TIER_HOST).pinned_blocks, 0);
    /* Releasing the standalone block frees its slot: usable again. */
    assert_ok(kvh_block_release(e, x));
    assert_ok(kvh_seq_append(e, b, t, 4));
    check_stats(e);
}

/* A write spanning two shared blocks when there is room for only one copy:
 * NOSPACE, and the sequence unchanged (not half written). */
static void test_write_kv_nospace_leaves_seq_unchanged(void **state)
{
    kvh_engine *e = open_small(THREADS(state), 2, 2);
    kvh_seq a = make_seq(e, 0, 2, 31);
    kvh_seq c;
    assert_ok(kvh_seq_fork(e, a, 0, &c)); /* both blocks shared */
    kvh_block x;
    assert_ok(kvh_block_alloc(e, 0, &x)); /* 3 of 4 slots referenced */
    uint8_t k[4 * 32], v[4 * 32];
    memset(k, 0xAB, sizeof(k));
    memset(v, 0xCD, sizeof(v));
    kvh_status st = kvh_seq_write_kv(e, c, 0, 2, 4, k, v); /* tokens 2..5: blocks 0 and 1 */
    assert_int_equal(st, KVH_ERR_NOSPACE);
    int unchanged = tu_check_pattern(e, c, L, TOK, 31, 0, 8);
    if (!unchanged)
        print_error("write_kv returned NOSPACE but had already written the first block\n");
    assert_true(unchanged);
    assert_true(tu_check_pattern(e, a, L, TOK, 31, 0, 8));
    /* With room, the same write succeeds. */
    assert_ok(kvh_block_release(e, x));
    assert_ok(kvh_seq_write_kv(e, c, 0, 2, 4, k, v));
    uint8_t rk[4 * 32];
    assert_ok(kvh_seq_read_kv(e, c, 0, 2, 4, rk, NULL));
    assert_memory_equal(rk, k, sizeof(rk));
    assert_true(tu_check_pattern(e, a, L, TOK, 31, 0, 8));
}

/* A fence wait with a short timeout on a copy still running. */
static void test_fence_timeout(void **state)
{
    if (THREADS(state) == 0)
        skip();                                                     /* inline: work is done before the call returns */
    kvh_config c = small_cfg(4, 8, 256, 256, 1, 1, THREADS(state)); /* 16 MiB blocks */
    kvh_engine *e = tu_open_cfg(&c);
    kvh_seq s = tu_seq_new(e, 0);
    int32_t *t = tu_alloc(256 * sizeof(int32_t));
    assert_ok(kvh_seq_append(e, s, t, 256));
    int timed_out = 0;
    for (int i = 0; i < 20 && !timed_out; i++) {
        kvh_fence f;
        assert_ok(kvh_seq_migrate(e, s, 0, 256, i % 2 ? KVH_TIER_DEVICE : KVH_TIER_HOST, &f));
        kvh_status st = kvh_fence_wait(e, f, 1000); /* 1 us */
        assert_true(st == KVH_OK || st == KVH_ERR_TIMEOUT);
        if (st == KVH_ERR_TIMEOUT) {
            timed_out = 1;
            int32_t done = 1;
            st = kvh_fence_poll(e, f, &done);
            assert_true(st == KVH_OK);
        }
        assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
        int32_t done = 0;
        assert_ok(kvh_fence_poll(e, f, &done));
        assert_int_equal(done, 1);
        assert_ok(kvh_fence_free(e, f));
    }
    if (!timed_out)
        skip();
}

/* ---- per-agent quotas ---- */

static void test_quota(void **state)
{
    kvh_engine *e = open_small(THREADS(state), 8, 32);
    uint64_t bb = tu_block_bytes(e);
    kvh_seq b = make_seq(e, 2, 4, 17); /* agent 2: 4 device blocks, no quota */
    assert_ok(kvh_agent_set_quota(e, 1, 2 * bb));
    kvh_seq a = make_seq(e, 1, 8, 18);                       /* agent 1: at most 2 in the device */
    assert_int_equal(count_in(e, b, 4, KVH_TIER_DEVICE), 4); /* not evicted by agent 1 */
    assert_int_equal(count_in(e, a, 8, KVH_TIER_DEVICE), 2);
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, 6); /* 2 slots stay free */
    /* Acquire of agent 1's host block evicts its own. */
    uint64_t hi = 0;
    while (tier_of(e, a, hi) != KVH_TIER_HOST)
        hi++;
    assert_ok(kvh_seq_acquire(e, a, hi * BT, BT, NULL));
    assert_int_equal(tier_of(e, a, hi), KVH_TIER_DEVICE);
    assert_int_equal(count_in(e, a, 8, KVH_TIER_DEVICE), 2);
    assert_int_equal(count_in(e, b, 4, KVH_TIER_DEVICE), 4);
    assert_ok(kvh_seq_release(e, a, hi * BT, BT));
    /* A quota rounds up to one block; 0 lifts it. */
    assert_ok(kvh_agent_set_quota(e, 1, 1));
    kvh_seq a2 = make_seq(e, 1, 2, 19);
    /* Agent 1 was at 2 device blocks: new allocations replace its own
     * blocks and never raise its device count. */
    assert_true(count_in(e, a2, 2, KVH_TIER_DEVICE) + count_in(e, a, 8, KVH_TIER_DEVICE) <= 2);
    assert_int_equal(count_in(e, b, 4, KVH_TIER_DEVICE), 4);
    assert_ok(kvh_agent_set_quota(e, 1, 0));
    kvh_seq a3 = make_seq(e, 1, 3, 20);
    assert_true(count_in(e, a3, 3, KVH_TIER_DEVICE) + count_in(e, a2, 2, KVH_TIER_DEVICE) +
                    count_in(e, a, 8, KVH_TIER_DEVICE) >=
                3); /* no longer capped at 2 */
    assert_true(tu_check_pattern(e, a, L, TOK, 18, 0, 32));
    assert_true(tu_check_pattern(e, b, L, TOK, 17, 0, 16));
    assert_true(tu_check_pattern(e, a2, L, TOK, 19, 0, 8));
    check_stats(e);
}

/* Quotas among many agents: each agent is found by id among thousands
 * (and those given quota 0, the default, need no record at all). */
static void test_quotas_among_many_agents(void **state)
{
    kvh_engine *e = open_small(THREADS(state), 8, 32);
    uint64_t bb = tu_block_bytes(e);
    for (uint32_t agent = 100000; agent < 200000; agent++)
        assert_ok(kvh_agent_set_quota(e, agent, 0));
    for (uint32_t agent = 1000; agent < 4000; agent++)
        assert_ok(kvh_agent_set_quota(e, agent, agent % 2 ? bb : 2 * bb));
    kvh_seq odd = make_seq(e, 3001, 3, 21);  /* quota 1 block */
    kvh_seq even = make_seq(e, 2000, 3, 22); /* quota 2 blocks */
    kvh_seq free_agent = make_seq(e, 5, 3, 23);
    assert_int_equal(count_in(e, odd, 3, KVH_TIER_DEVICE), 1);
    assert_int_equal(count_in(e, even, 3, KVH_TIER_DEVICE), 2);
    assert_int_equal(count_in(e, free_agent, 3, KVH_TIER_DEVICE), 3);
    /* A quota lifted among them is lifted for that agent only. */
    assert_ok(kvh_agent_set_quota(e, 3001, 0));
    kvh_seq more = make_seq(e, 3001, 2, 24);
    assert_true(count_in(e, more, 2, KVH_TIER_DEVICE) + count_in(e, odd, 3, KVH_TIER_DEVICE) >= 2);
    kvh_seq still = make_seq(e, 3003, 2, 25);
    assert_int_equal(count_in(e, still, 2, KVH_TIER_DEVICE), 1);
    /* A quota lowered (not lifted): its next allocation brings it under. */
    assert_ok(kvh_agent_set_quota(e, 2000, bb));
    kvh_seq lowered = make_seq(e, 2000, 1, 26);
    assert_true(count_in(e, lowered, 1, KVH_TIER_DEVICE) + count_in(e, even, 3, KVH_TIER_DEVICE) <= 1);
    assert_true(tu_check_pattern(e, odd, L, TOK, 21, 0, 3 * BT));
    assert_true(tu_check_pattern(e, even, L, TOK, 22, 0, 3 * BT));
    check_stats(e);
}

/* When both tiers are full, an agent at its quota that brings a block up
 * must trade places with one of its own blocks, not another agent's. */
static void test_quota_swap_evicts_own(void **state)
{
    kvh_engine *e = open_small(THREADS(state), 4, 4);
    uint64_t bb = tu_block_bytes(e);
    kvh_seq b = make_seq(e, 2, 2, 21); /* agent 2: 2 device blocks, the oldest */
    assert_ok(kvh_agent_set_quota(e, 1, 2 * bb));
    kvh_seq a = make_seq(e, 1, 6, 22); /* agent 1: 2 device + 4 host */
    assert_int_equal(count_in(e, b, 2, KVH_TIER_DEVICE), 2);
    assert_int_equal(count_in(e, a, 6, KVH_TIER_DEVICE), 2);
    assert_int_equal(tu_tier(e, KVH_TIER_HOST).used_blocks, 4);
    uint64_t hi = 0;
    while (tier_of(e, a, hi) != KVH_TIER_HOST)
        hi++;
    assert_ok(kvh_seq_acquire(e, a, hi * BT, BT, NULL));
    assert_int_equal(tier_of(e, a, hi), KVH_TIER_DEVICE);
    uint64_t a_dev = count_in(e, a, 6, KVH_TIER_DEVICE), b_dev = count_in(e, b, 2, KVH_TIER_DEVICE);
    if (b_dev != 2)
        print_error("agent 1 (quota 2 blocks) brought a block up by swapping out agent 2's block: "
                    "agent 1 now has %" PRIu64 " device blocks, agent 2 has %" PRIu64 "\n",
                    a_dev, b_dev);
    assert_int_equal(b_dev, 2);
    assert_int_equal(a_dev, 2);
    assert_ok(kvh_seq_release(e, a, hi * BT, BT));
    assert_true(tu_check_pattern(e, a, L, TOK, 22, 0, 24));
    assert_true(tu_check_pattern(e, b, L, TOK, 21, 0, 8));
}

/* ---- explicit migration and fences ---- */

static void test_migrate_fences(void **state)
{
    kvh_engine *e = open_small(THREADS(state), 8, 8);
    uint64_t bb = tu_block_bytes(e);
    kvh_seq a = make_seq(e, 0, 3, 23);
    kvh_stats s0 = tu_stats(e);
    kvh_fence f = {0};
    assert_ok(kvh_seq_migrate(e, a, 0, 12, KVH_TIER_HOST, &f));
    assert_true(f.id != 0);
    assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
    int32_t done = 0;
    assert_ok(kvh_fence_poll(e, f, &done));
    assert_int_equal(done, 1);
    assert_ok(kvh_fence_wait(e, f, 0));
    assert_ok(kvh_fence_free(e, f));
    /* Freed: every fence call now says BAD_HANDLE. */
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_free(e, f));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_wait(e, f, 0));
    done = 7;
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_poll(e, f, &done));
    assert_int_equal(done, 7);
    assert_ok(kvh_fence_free(e, (kvh_fence){0}));
    for (uint64_t i = 0; i < 3; i++)
        assert_int_equal(tier_of(e, a, i), KVH_TIER_HOST);
    kvh_stats s1 = tu_stats(e);
    assert_moves(&s0, &s1, 3, 0);
    if (current->copies)
        assert_int_equal(s1.bytes_device_to_host - s0.bytes_device_to_host, 3 * bb);
    assert_true(tu_check_pattern(e, a, L, TOK, 23, 0, 12));

    /* Back up by block handle. */
    kvh_block bl[3];
    assert_ok(kvh_seq_blocks(e, a, 0, 3, bl));
    assert_ok(kvh_migrate(e, bl, 3, KVH_TIER_DEVICE, &f));
    assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
    assert_ok(kvh_fence_free(e, f));
    for (uint64_t i = 0; i < 3; i++)
        assert_int_equal(tier_of(e, a, i), KVH_TIER_DEVICE);
    kvh_stats s2 = tu_stats(e);
    assert_moves(&s1, &s2, 0, 3);
    if (current->copies)
        assert_int_equal(s2.bytes_host_to_device - s1.bytes_host_to_device, 3 * bb);
    /* Synchronous form (no fence); to the tier it is in already: no move. */
    assert_ok(kvh_migrate(e, bl, 1, KVH_TIER_DEVICE, NULL));
    kvh_stats s3 = tu_stats(e);
    assert_moves(&s2, &s3, 0, 0);
    assert_ok(kvh_seq_migrate(e, a, 4, 1, KVH_TIER_HOST, NULL)); /* block 1 only */
    assert_int_equal(tier_of(e, a, 0), KVH_TIER_DEVICE);
    assert_int_equal(tier_of(e, a, 1), KVH_TIER_HOST);
    assert_int_equal(tier_of(e, a, 2), KVH_TIER_DEVICE);
    assert_ok(kvh_migrate(e, bl, 0, KVH_TIER_HOST, NULL));
    /* Tiers that are absent or unknown. */
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_migrate(e, bl, 1, KVH_TIER_DISK, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_migrate(e, bl, 1, 7, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_migrate(e, a, 0, 4, 3, NULL));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_migrate(e, a, 0, 13, KVH_TIER_HOST, NULL));
    /* A held block stays in the device tier. */
    assert_ok(kvh_seq_acquire(e, a, 0, 4, NULL));
    assert_ok(kvh_seq_migrate(e, a, 0, 4, KVH_TIER_HOST, NULL));
    assert_int_equal(tier_of(e, a, 0), KVH_TIER_DEVICE);
    assert_ok(kvh_seq_release(e, a, 0, 4));
    /* A fence freed before its work finishes: the work still happens. */
    assert_ok(kvh_seq_migrate(e, a, 0, 12, KVH_TIER_HOST, &f));
    assert_ok(kvh_fence_free(e, f));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_wait(e, f, 0));
    for (uint64_t i = 0; i < 3; i++) {
        wait_idle_block(e, bl[i]);
        for (int w = 0; w < 10000 && tu_binfo(e, bl[i]).tier != KVH_TIER_HOST; w++)
            usleep(100);
        assert_int_equal(tu_binfo(e, bl[i]).tier, KVH_TIER_HOST);
    }
    assert_true(tu_check_pattern(e, a, L, TOK, 23, 0, 12));
    check_stats(e);
}

/* ---- prefetch ---- */

static void prefetch_wait(kvh_engine *e, kvh_seq s, uint64_t first, uint64_t n)
{
    kvh_fence f = {0};
    assert_ok(kvh_prefetch(e, s, first, n, 5, &f));
    assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
    assert_ok(kvh_fence_free(e, f));
}

static void test_prefetch_hysteresis(void **state)
{
    kvh_config c = small_cfg(L, H, D, BT, 4, 16, THREADS(state));
    c.promote_min_hits = 2;
    kvh_engine *e = tu_open_cfg(&c);
    kvh_seq a = make_seq(e, 0, 3, 24);
    assert_ok(kvh_seq_migrate(e, a, 0, 12, KVH_TIER_HOST, NULL));
    kvh_stats s0 = tu_stats(e);
    /* First hint: below promote_min_hits, skipped. */
    prefetch_wait(e, a, 0, 8);
    kvh_stats s1 = tu_stats(e);
    assert_int_equal(s1.prefetch_skipped - s0.prefetch_skipped, 2);
    assert_int_equal(s1.prefetch_issued - s0.prefetch_issued, 0);
    assert_int_equal(tier_of(e, a, 0), KVH_TIER_HOST);
    assert_int_equal(tier_of(e, a, 1), KVH_TIER_HOST);
    /* Second hint: promoted. */
    prefetch_wait(e, a, 0, 8);
    kvh_stats s2 = tu_stats(e);
    assert_int_equal(s2.prefetch_issued - s1.prefetch_issued, 2);
    assert_int_equal(s2.prefetch_skipped, s1.prefetch_skipped);
    assert_int_equal(tier_of(e, a, 0), KVH_TIER_DEVICE);
    assert_int_equal(tier_of(e, a, 1), KVH_TIER_DEVICE);
    assert_int_equal(tu_seq_binfo(e, a, 0).holds, 0); /* never holds */
    /* Hints for resident blocks do nothing. */
    prefetch_wait(e, a, 0, 8);
    kvh_stats s3 = tu_stats(e);
    assert_int_equal(s3.prefetch_issued, s2.prefetch_issued);
    assert_int_equal(s3.prefetch_skipped, s2.prefetch_skipped);
    /* Block 0 is used: useful. Block 1 is evicted unused: wasted. */
    uint8_t k[32];
    assert_ok(kvh_seq_read_kv(e, a, 0, 0, 1, k, NULL));
    assert_ok(kvh_seq_read_kv(e, a, 1, 1, 1, k, NULL)); /* counted once */
    assert_ok(kvh_seq_migrate(e, a, 4, 4, KVH_TIER_HOST, NULL));
    kvh_stats s4 = tu_stats(e);
    assert_int_equal(s4.prefetch_useful - s3.prefetch_useful, 1);
    assert_int_equal(s4.prefetch_wasted - s3.prefetch_wasted, 1);
    /* An access while in the host tier counts toward the threshold: one
     * read plus one hint promotes block 2. */
    assert_int_equal(tier_of(e, a, 2), KVH_TIER_HOST);
    assert_ok(kvh_seq_read_kv(e, a, 0, 8, 1, k, NULL));
    prefetch_wait(e, a, 8, 4);
    assert_int_equal(tier_of(e, a, 2), KVH_TIER_DEVICE);
    assert_int_equal(tu_stats(e).prefetch_issued, s4.prefetch_issued + 1);
    assert_true(tu_check_pattern(e, a, L, TOK, 24, 0, 12));
    /* Without a fence. */
    assert_ok(kvh_prefetch(e, a, 0, 12, 0, NULL));
    assert_kvh(KVH_ERR_RANGE, kvh_prefetch(e, a, 0, 13, 0, NULL));
    /* The unfenced promotions may still be in flight with workers (their
     * destination slots already count as used): acquiring the range waits
     * for them, so the counters are compared at rest. */
    assert_ok(kvh_seq_acquire(e, a, 0, 12, NULL));
    assert_ok(kvh_seq_release(e, a, 0, 12));
    check_stats(e);
}

static void test_prefetch_default_threshold(void **state)
{
    kvh_engine *e = open_small(THREADS(state), 4, 16);
    kvh_seq a = make_seq(e, 0, 2, 25);
    assert_ok(kvh_seq_migrate(e, a, 0, 8, KVH_TIER_HOST, NULL));
    kvh_stats s0 = tu_stats(e);
    prefetch_wait(e, a, 0, 8); /* promote_min_hits = 1: the hint suffices */
    kvh_stats s1 = tu_stats(e);
    assert_int_equal(s1.prefetch_issued - s0.prefetch_issued, 2);
    assert_int_equal(s1.prefetch_skipped, s0.prefetch_skipped);
    assert_int_equal(tier_of(e, a, 0), KVH_TIER_DEVICE);
    /* Acquire after a completed prefetch: useful, not late. */
    assert_ok(kvh_seq_acquire(e, a, 0, 8, NULL));
    kvh_stats s2 = tu_stats(e);
    assert_int_equal(s2.prefetch_useful - s1.prefetch_useful, 2);
    assert_int_equal(s2.prefetch_late, s1.prefetch_late);
    assert_moves(&s1, &s2, 0, 0);
    assert_ok(kvh_seq_release(e, a, 0, 8));
    /* Prefetched blocks pushed out by new allocations count as wasted. */
    assert_ok(kvh_seq_migrate(e, a, 0, 8, KVH_TIER_HOST, NULL));
    prefetch_wait(e, a, 0, 8);
    kvh_stats s3 = tu_stats(e);
    /* Another sequence takes the whole device (acquired): the prefetched,
     * never used blocks are pushed out. */
    kvh_seq b = make_seq(e, 0, 4, 26);
    assert_ok(kvh_seq_acquire(e, b, 0, 16, NULL));
    assert_int_equal(tier_of(e, a, 0), KVH_TIER_HOST);
    assert_int_equal(tier_of(e, a, 1), KVH_TIER_HOST);
    kvh_stats s4 = tu_stats(e);
    assert_ok(kvh_seq_release(e, b, 0, 16));
    assert_int_equal(s4.prefetch_wasted - s3.prefetch_wasted, 2);
    assert_int_equal(s4.prefetch_useful, s3.prefetch_useful);
    check_stats(e);
}

/* ---- a pin landing while the block is being copied between tiers ---- */

static void test_pin_during_migration(void **state)
{
    if (THREADS(state) == 0)
        skip(); /* needs an asynchronous copy */
    /* Large blocks (16 MiB) so the copy takes a while. */
    kvh_config c = small_cfg(4, 8, 256, 256, 1, 1, THREADS(state));
    kvh_engine *e = tu_open_cfg(&c);
    kvh_seq s = tu_seq_new(e, 0);
    int32_t *t = tu_alloc(256 * sizeof(int32_t));
    tu_iota(t, 256, 0);
    assert_ok(kvh_seq_append(e, s, t, 256));
    int hit = 0;
    for (int attempt = 0; attempt < 50 && !hit; attempt++) {
        uint32_t target = tier_of(e, s, 0) == KVH_TIER_DEVICE ? KVH_TIER_HOST : KVH_TIER_DEVICE;
        kvh_fence f;
        assert_ok(kvh_seq_migrate(e, s, 0, 256, target, &f));
        int32_t done = 0;
        while (!done) {
            kvh_block_info bi = tu_seq_binfo(e, s, 0);
            if (bi.in_flight) {
                assert_ok(kvh_seq_pin(e, s, 0, 256, 1));
                hit = 1;
                break;
            }
            assert_ok(kvh_fence_poll(e, f, &done));
        }
        assert_ok(kvh_fence_wait(e, f, UINT64_MAX)); /* pinned meanwhile: skipped, not an error */
        assert_ok(kvh_fence_free(e, f));
    }
    if (!hit)
        skip();
    kvh_block_info bi = tu_seq_binfo(e, s, 0);
    assert_int_equal(bi.pins, 1);
    uint32_t other = bi.tier == KVH_TIER_DEVICE ? KVH_TIER_HOST : KVH_TIER_DEVICE;
    uint64_t here = tu_tier(e, bi.tier).pinned_blocks, there = tu_tier(e, other).pinned_blocks;
    if (here != 1 || there != 0)
        print_error("block pinned during its migration is in tier %u, but pinned_blocks is %" PRIu64
                    " there and %" PRIu64 " in tier %u\n",
                    bi.tier, here, there, other);
    assert_int_equal(here, 1);
    assert_int_equal(there, 0);
    assert_ok(kvh_seq_pin(e, s, 0, 256, 0));
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).pinned_blocks, 0);
    assert_int_equal(tu_tier(e, KVH_TIER_HOST).pinned_blocks, 0);
}

/* ---- stats over a mixed workload ---- */

static void test_stats_add_up(void **state)
{
    kvh_engine *e = open_small(THREADS(state), 4, 12);
    tu_rng r = {tu_seed(0x57a7)};
    kvh_seq s[4];
    for (int i = 0; i < 4; i++)
        s[i] = make_seq(e, (uint32_t)i, 2, 30 + (uint64_t)i);
    for (int op = 0; op < 400; op++) {
        int i = (int)tu_below(&r, 4);
        uint64_t n = tu_seq_len(e, s[i]);
        switch (tu_below(&r, 5)) {
        case 0:
            (void)kvh_seq_migrate(e, s[i], 0, n, KVH_TIER_HOST, NULL);
            break;
        case 1:
            if (kvh_seq_acquire(e, s[i], 0, n, NULL) == KVH_OK)
                assert_ok(kvh_seq_release(e, s[i], 0, n));
            break;
        case 2:
            assert_ok(kvh_prefetch(e, s[i], 0, n, 1, NULL));
            break;
        case 3:
            assert_true(tu_check_pattern(e, s[i], L, TOK, 30 + (uint64_t)i, 0, n));
            break;
        default: {
            kvh_seq c;
            assert_ok(kvh_seq_fork(e, s[i], 9, &c));
            assert_ok(kvh_seq_free(e, c));
        }
        }
    }
    /* Let queued prefetches finish. */
    for (int i = 0; i < 4; i++)
        for (uint64_t b = 0; b < 2; b++)
            wait_idle_block(e, tu_seq_block(e, s[i], b));
    usleep(1000);
    check_stats(e);
    kvh_stats st = tu_stats(e);
    assert_true(st.prefetch_useful + st.prefetch_wasted <= st.prefetch_issued);
    for (int i = 0; i < 4; i++)
        assert_ok(kvh_seq_free(e, s[i]));
    check_stats(e);
}

#define BOTH(f)                                                                                                        \
    cmocka_unit_test_prestate_setup_teardown(f, set_mode, tu_teardown, &M_PLACE0),                                     \
        cmocka_unit_test_prestate_setup_teardown(f, set_mode, tu_teardown, &M_PLACE2),                                 \
        cmocka_unit_test_prestate_setup_teardown(f, set_mode, tu_teardown, &M_COPY0),                                  \
        cmocka_unit_test_prestate_setup_teardown(f, set_mode, tu_teardown, &M_COPY2)

int main(void)
{
    const struct CMUnitTest tests[] = {
        BOTH(test_evict_and_acquire),
        BOTH(test_acquire_with_fence),
        BOTH(test_lru_k_victims),
        BOTH(test_unreferenced_evicted_first),
        BOTH(test_drop_without_lower_tier),
        BOTH(test_cached_blocks_make_room),
        BOTH(test_pinning),
        BOTH(test_seq_pins_end_with_the_sequence),
        BOTH(test_pin_after_queueing_is_skipped),
        BOTH(test_held_blocks_are_not_moved_down),
        BOTH(test_swap_when_both_full),
        BOTH(test_nospace_changes_nothing),
        BOTH(test_nospace_all_pinned),
        BOTH(test_write_kv_nospace_leaves_seq_unchanged),
        BOTH(test_fence_timeout),
        BOTH(test_quota),
        BOTH(test_quotas_among_many_agents),
        BOTH(test_quota_swap_evicts_own),
        BOTH(test_migrate_fences),
        BOTH(test_prefetch_hysteresis),
        BOTH(test_prefetch_default_threshold),
        BOTH(test_pin_during_migration),
        BOTH(test_stats_add_up),
    };
    return cmocka_run_group_tests_name("tiers", tests, NULL, NULL);
}
