/* Hints as eviction advice (kvh_seq_hint, core/hints.c): hinted blocks
 * outlive unhinted ones, lower priorities leave first, an access redeems
 * the higher of a block's two priorities, unrenewed hints lapse, and a
 * prefetch never displaces a block hinted as soon or sooner. Each test
 * runs with migration_threads 0 and 2. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#include "test_util.h"

enum { L = 1, H = 1, D = 4, BT = 4, DEV = 4, HOST = 16 };
static const size_t TOK = H * D * 4;

static uint32_t threads_of(void **state) { return (uint32_t)(uintptr_t)*state; }

static kvh_engine *open_engine(void **state)
{
    return tu_open(L, H, D, BT, KVH_DTYPE_F32, DEV, HOST, threads_of(state));
}

/* A one-block sequence of agent's, of its own tokens, written in every
 * one of `layers` layers. */
static kvh_seq block_of(kvh_engine *e, uint32_t agent, uint32_t layers, uint64_t tag)
{
    kvh_seq s = tu_seq_new(e, agent);
    int32_t t[BT];
    tu_iota(t, BT, (int32_t)(tag * 1000));
    assert_ok(kvh_seq_append(e, s, t, BT));
    tu_write_pattern(e, s, layers, TOK, tag, 0, BT);
    return s;
}

static kvh_seq one_block(kvh_engine *e, uint64_t tag) { return block_of(e, 0, L, tag); }

static uint32_t tier_of(kvh_engine *e, kvh_seq s) { return tu_seq_binfo(e, s, 0).tier; }

static void use(kvh_engine *e, kvh_seq s)
{
    assert_ok(kvh_seq_acquire(e, s, 0, BT, NULL));
    assert_ok(kvh_seq_release(e, s, 0, BT));
}

static void hint(kvh_engine *e, kvh_seq s, int32_t priority) { assert_ok(kvh_seq_hint(e, s, 0, BT, priority)); }

/* Device tier full of a, b, c, d (made in that order, none used since). */
static void four(kvh_engine *e, kvh_seq *s)
{
    for (int i = 0; i < 4; i++) {
        s[i] = one_block(e, (uint64_t)i + 1);
        assert_int_equal(tier_of(e, s[i]), KVH_TIER_DEVICE);
    }
}

static void test_hinted_outlives_unhinted(void **state)
{
    for (int hinted = 0; hinted < 2; hinted++) {
        kvh_engine *e = open_engine(state);
        kvh_seq s[4];
        four(e, s);
        if (hinted)
            hint(e, s[0], 0);
        /* Eight newer blocks pass through the device tier. */
        for (int i = 0; i < 8; i++)
            one_block(e, 100 + (uint64_t)i);
        /* The oldest block is the first victim, unless a hint keeps it. */
        assert_int_equal(tier_of(e, s[0]), hinted ? KVH_TIER_DEVICE : KVH_TIER_HOST);
        tu_close(e);
    }
}

static void test_lowest_priority_leaves_first(void **state)
{
    kvh_engine *e = open_engine(state);
    kvh_seq s[4];
    four(e, s);
    hint(e, s[0], 5);
    hint(e, s[1], 1);
    hint(e, s[2], 3);
    hint(e, s[3], INT32_MIN); /* the lowest priority is still a hint */
    /* Each new block is hinted above all, so it stays; the victims come
     * in priority order. */
    const int order[4] = {3, 1, 2, 0};
    for (int k = 0; k < 4; k++) {
        kvh_seq n = one_block(e, 200 + (uint64_t)k);
        hint(e, n, 100);
        for (int i = 0; i < 4; i++) {
            bool gone = false;
            for (int j = 0; j <= k; j++)
                gone |= order[j] == i;
            assert_int_equal(tier_of(e, s[i]), gone ? KVH_TIER_HOST : KVH_TIER_DEVICE);
        }
    }
    tu_close(e);
}

static void test_access_redeems_the_higher(void **state)
{
    for (int accessed = 0; accessed < 2; accessed++) {
        kvh_engine *e = open_engine(state);
        kvh_seq s[4];
        four(e, s);
        hint(e, s[0], 7);
        hint(e, s[0], 1); /* a later need of the same block */
        hint(e, s[0], 7); /* renewing changes nothing */
        hint(e, s[2], 100);
        hint(e, s[3], 100);
        if (accessed)
            use(e, s[0]); /* priority 7 redeemed: 1 remains */
        /* s[1] is unhinted but has a newer history than s[0]: only s[0]'s
         * remaining hint keeps it. */
        use(e, s[1]);
        use(e, s[1]);
        kvh_seq n = one_block(e, 300);
        hint(e, n, 100);
        assert_int_equal(tier_of(e, s[0]), KVH_TIER_DEVICE);
        assert_int_equal(tier_of(e, s[1]), KVH_TIER_HOST);
        if (accessed) {
            /* The second access redeems the last hint: s[0] is the one
             * unhinted block left in the device tier. */
            use(e, s[0]);
            one_block(e, 301);
            assert_int_equal(tier_of(e, s[0]), KVH_TIER_HOST);
        }
        tu_close(e);
    }
}

/* After an access a block ranks by its next hint: below a block hinted
 * sooner than that. */
static void test_redeemed_block_ranks_by_next_hint(void **state)
{
    kvh_engine *e = open_engine(state);
    kvh_seq s[4];
    four(e, s);
    hint(e, s[0], 7);
    hint(e, s[0], 1);
    hint(e, s[1], 4);
    hint(e, s[2], 100);
    hint(e, s[3], 100);
    use(e, s[0]); /* 7 redeemed: now 1, below s[1]'s 4 */
    kvh_seq m = one_block(e, 312);
    hint(e, m, 100);
    assert_int_equal(tier_of(e, s[0]), KVH_TIER_HOST);
    assert_int_equal(tier_of(e, s[1]), KVH_TIER_DEVICE);
    tu_close(e);
}

/* Hints not renewed lapse after one to two epochs of the access clock (an
 * epoch is max(64, device + host blocks) = 64 ticks here); renewed ones
 * stay. */
static void test_unrenewed_hints_lapse(void **state)
{
    const int uses[3] = {60, 130, 400};
    for (int renew = 0; renew < 2; renew++)
        for (int u = 0; u < 3; u++) {
            if (renew && u < 2)
                continue;
            kvh_engine *e = open_engine(state);
            kvh_seq s[4];
            four(e, s);
            hint(e, s[0], 9);
            for (int i = 0; i < uses[u]; i++) {
                use(e, s[1 + i % 3]);
                if (renew && i % 50 == 0)
                    hint(e, s[0], 9);
            }
            /* s[0] has the oldest history: without a hint it is the victim
             * (its making is one more tick: 61 < 64 still protects). */
            one_block(e, 400);
            bool kept = renew || uses[u] < 64;
            assert_int_equal(tier_of(e, s[0]), kept ? KVH_TIER_DEVICE : KVH_TIER_HOST);
            tu_close(e);
        }
}

/* Block allocations count as accesses for a hint's lapse: a hint given
 * before thousands of allocations (a long prefill) is gone after them. */
static void test_hints_lapse_over_allocations(void **state)
{
    kvh_engine *e = open_engine(state);
    kvh_seq s[4];
    four(e, s);
    hint(e, s[0], 9);
    for (int i = 0; i < 3000; i++) {
        kvh_block b;
        assert_ok(kvh_block_alloc(e, 0, &b));
        assert_ok(kvh_block_release(e, b));
    }
    /* The allocations took s[1]'s device slot. With the free slot filled,
     * bringing s[1] back evicts the oldest unhinted block: s[0] once its
     * hint has lapsed, s[2] while it holds. */
    assert_int_equal(tier_of(e, s[1]), KVH_TIER_HOST);
    one_block(e, 400);
    use(e, s[1]);
    assert_int_equal(tier_of(e, s[0]), KVH_TIER_HOST);
    assert_int_equal(tier_of(e, s[2]), KVH_TIER_DEVICE);
    tu_close(e);
}

/* INT32_MIN is the lowest priority, and still a priority: as a second
 * one it is kept. */
static void test_lowest_priority_is_kept_second(void **state)
{
    kvh_engine *e = open_engine(state);
    kvh_seq s[4];
    four(e, s);
    hint(e, s[0], 5);
    hint(e, s[0], INT32_MIN);
    hint(e, s[2], 100);
    hint(e, s[3], 100);
    use(e, s[0]); /* 5 redeemed: INT32_MIN (as INT32_MIN + 1) remains */
    use(e, s[1]); /* unhinted, with a newer history than s[0] */
    use(e, s[1]);
    one_block(e, 500);
    assert_int_equal(tier_of(e, s[0]), KVH_TIER_DEVICE);
    assert_int_equal(tier_of(e, s[1]), KVH_TIER_HOST);
    tu_close(e);
}

/* One use of a block redeems one hint, however many of its layers it
 * reads. */
static void test_one_use_redeems_one_hint(void **state)
{
    kvh_engine *e = tu_open(2, H, D, BT, KVH_DTYPE_F32, DEV, HOST, threads_of(state));
    kvh_seq s[4];
    for (int i = 0; i < 4; i++)
        s[i] = block_of(e, 0, 2, (uint64_t)i + 1);
    assert_ok(kvh_seq_hint(e, s[0], 0, BT, 7));
    assert_ok(kvh_seq_hint(e, s[0], 0, BT, 1));
    assert_ok(kvh_seq_hint(e, s[2], 0, BT, 100));
    assert_ok(kvh_seq_hint(e, s[3], 0, BT, 100));
    float k[BT * D], v[BT * D];
    for (uint32_t l = 0; l < 2; l++) /* a forward pass reads both layers */
        assert_ok(kvh_seq_read_kv(e, s[0], l, 0, BT, k, v));
    use(e, s[1]); /* unhinted, with a newer history than s[0] */
    use(e, s[1]);
    /* 7 is redeemed, 1 remains: s[0] still outranks the unhinted s[1]. */
    block_of(e, 0, 2, 600);
    assert_int_equal(tier_of(e, s[0]), KVH_TIER_DEVICE);
    assert_int_equal(tier_of(e, s[1]), KVH_TIER_HOST);
    tu_close(e);
}

static void prefetch_wait(kvh_engine *e, kvh_seq s, int32_t priority)
{
    kvh_fence f;
    assert_ok(kvh_prefetch(e, s, 0, BT, priority, &f));
    assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
    assert_ok(kvh_fence_free(e, f));
}

static void test_prefetch_displaces_only_a_lower_class(void **state)
{
    kvh_engine *e = open_engine(state);
    kvh_seq low = one_block(e, 1);
    kvh_seq s[4];
    four(e, s); /* pushes `low` to the host tier */
    assert_int_equal(tier_of(e, low), KVH_TIER_HOST);
    for (int i = 0; i < 4; i++)
        hint(e, s[i], 10);
    kvh_stats a = tu_stats(e);
    prefetch_wait(e, low, 10); /* as soon as the device tier's: stays */
    kvh_stats b = tu_stats(e);
    assert_int_equal(tier_of(e, low), KVH_TIER_HOST);
    assert_int_equal(b.prefetch_skipped - a.prefetch_skipped, 1);
    prefetch_wait(e, low, 11); /* sooner: it takes a place */
    assert_int_equal(tier_of(e, low), KVH_TIER_DEVICE);
    int left = 0;
    for (int i = 0; i < 4; i++)
        left += tier_of(e, s[i]) == KVH_TIER_HOST;
    assert_int_equal(left, 1);
    /* Its hint protects it as a prefetched block: an unhinted newcomer
     * cannot push it out. */
    one_block(e, 500);
    assert_int_equal(tier_of(e, low), KVH_TIER_DEVICE);
    tu_close(e);
}

/* A prefetch of a range whose other blocks fill the device tier: its
 * first promotion took the place of a block of the same range, not yet
 * hinted, which the next one then brought back (3 promotions and 3
 * evictions for 1), or which stayed out. The whole range is hinted first:
 * only the unhinted block of another sequence leaves, once. */
static void test_prefetch_does_not_displace_its_own_range(void **state)
{
    for (int other_pinned = 0; other_pinned < 2; other_pinned++) {
        kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F32, 3, HOST, threads_of(state));
        kvh_seq q = tu_seq_new(e, 0);
        int32_t t[3 * BT];
        tu_iota(t, 3 * BT, 7000);
        assert_ok(kvh_seq_append(e, q, t, 3 * BT));
        tu_write_pattern(e, q, L, TOK, 70, 0, 3 * BT);
        assert_ok(kvh_seq_migrate(e, q, 0, BT, KVH_TIER_HOST, NULL));
        kvh_seq other = one_block(e, 71);
        if (other_pinned)
            assert_ok(kvh_seq_pin(e, other, 0, BT, 1));
        assert_int_equal(tu_seq_binfo(e, q, 0).tier, KVH_TIER_HOST);
        kvh_stats a = tu_stats(e);
        kvh_fence f;
        assert_ok(kvh_prefetch(e, q, 0, 3 * BT, 5, &f));
        assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
        assert_ok(kvh_fence_free(e, f));
        kvh_stats b = tu_stats(e);
        for (uint64_t i = 1; i < 3; i++)
            assert_int_equal(tu_seq_binfo(e, q, i).tier, KVH_TIER_DEVICE);
        assert_int_equal(tu_seq_binfo(e, q, 0).tier, other_pinned ? KVH_TIER_HOST : KVH_TIER_DEVICE);
        assert_int_equal(b.prefetch_issued - a.prefetch_issued, other_pinned ? 0 : 1);
        assert_int_equal(b.evictions - a.evictions, other_pinned ? 0 : 1);
        if (other_pinned)
            assert_ok(kvh_seq_pin(e, other, 0, BT, 0));
        tu_close(e);
    }
}

/* An agent at its device quota makes room among its own blocks, so its
 * prefetch may not displace them unless it outranks them, free device
 * slots or not. */
static void test_prefetch_under_quota(void **state)
{
    kvh_engine *e = open_engine(state);
    kvh_seq z = block_of(e, 7, L, 1), x = block_of(e, 7, L, 2), y = block_of(e, 7, L, 3);
    kvh_fence f;
    assert_ok(kvh_seq_migrate(e, z, 0, BT, KVH_TIER_HOST, &f));
    assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
    assert_ok(kvh_fence_free(e, f));
    assert_ok(kvh_agent_set_quota(e, 7, 2 * tu_block_bytes(e)));
    hint(e, x, 100);
    hint(e, y, 100);
    assert_true(tu_tier(e, KVH_TIER_DEVICE).used_blocks < DEV); /* free slots */
    prefetch_wait(e, z, 10);
    assert_int_equal(tier_of(e, z), KVH_TIER_HOST);
    assert_int_equal(tier_of(e, x), KVH_TIER_DEVICE);
    assert_int_equal(tier_of(e, y), KVH_TIER_DEVICE);
    prefetch_wait(e, z, 101);
    assert_int_equal(tier_of(e, z), KVH_TIER_DEVICE);
    assert_int_equal((tier_of(e, x) == KVH_TIER_HOST) + (tier_of(e, y) == KVH_TIER_HOST), 1);
    tu_close(e);
}

/* The same guard on the disk tier's batched reads (workers) and on the
 * inline path. */
static void test_prefetch_from_disk_displaces_only_a_lower_class(void **state)
{
    const char *root = getenv("KVH_TEST_TMPDIR");
    char dir[4096];
    snprintf(dir, sizeof(dir), "%s/hints-XXXXXX", root && *root ? root : "/tmp");
    assert_non_null(mkdtemp(dir));
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F32, DEV, HOST, threads_of(state));
    c.disk_path = dir;
    c.disk_bytes = 64ull * (tu_block_bytes_of(L, H, D, BT, KVH_DTYPE_F32) + 8192);
    c.disk_flags = KVH_DISK_RESET_ON_MISMATCH;
    kvh_engine *e = tu_open_cfg(&c);
    kvh_seq low = one_block(e, 1);
    kvh_fence f;
    assert_ok(kvh_seq_migrate(e, low, 0, BT, KVH_TIER_DISK, &f));
    assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
    assert_ok(kvh_fence_free(e, f));
    assert_int_equal(tier_of(e, low), KVH_TIER_DISK);
    kvh_seq s[4];
    four(e, s);
    for (int i = 0; i < 4; i++)
        hint(e, s[i], 10);
    kvh_stats a = tu_stats(e);
    prefetch_wait(e, low, 10);
    kvh_stats b = tu_stats(e);
    assert_int_equal(tier_of(e, low), KVH_TIER_DISK);
    assert_int_equal(b.prefetch_skipped - a.prefetch_skipped, 1);
    prefetch_wait(e, low, 11);
    assert_int_equal(tier_of(e, low), KVH_TIER_DEVICE);
    tu_close(e);
}

static void test_hint_bad_input(void **state)
{
    kvh_engine *e = open_engine(state);
    kvh_seq s = one_block(e, 1);
    assert_int_equal(kvh_seq_hint(NULL, s, 0, BT, 0), KVH_ERR_INVALID_ARG);
    kvh_seq bogus = {.id = s.id ^ 0x5a5a0000u};
    assert_int_equal(kvh_seq_hint(e, bogus, 0, BT, 0), KVH_ERR_BAD_HANDLE);
    assert_int_equal(kvh_seq_hint(e, s, 0, BT + 1, 0), KVH_ERR_RANGE);
    assert_true(strlen(kvh_last_error()) > 0);
    assert_ok(kvh_seq_hint(e, s, BT, 0, 0)); /* empty range at the end */
    /* A freed sequence's blocks take no hints, and a hinted block freed
     * leaves nothing behind (its record is skipped when it lapses). */
    hint(e, s, 3);
    assert_ok(kvh_seq_free(e, s));
    assert_int_equal(kvh_seq_hint(e, s, 0, BT, 0), KVH_ERR_BAD_HANDLE);
    kvh_seq t = one_block(e, 2);
    for (int i = 0; i < 300; i++)
        use(e, t);
    tu_close(e);
}

#define BOTH(fn)                                                                                                       \
    cmocka_unit_test_prestate_setup_teardown(fn, NULL, tu_teardown, (void *)(uintptr_t)0),                             \
        cmocka_unit_test_prestate_setup_teardown(fn, NULL, tu_teardown, (void *)(uintptr_t)2)

int main(void)
{
    const struct CMUnitTest tests[] = {
        BOTH(test_hinted_outlives_unhinted),
        BOTH(test_lowest_priority_leaves_first),
        BOTH(test_access_redeems_the_higher),
        BOTH(test_redeemed_block_ranks_by_next_hint),
        BOTH(test_unrenewed_hints_lapse),
        BOTH(test_hints_lapse_over_allocations),
        BOTH(test_lowest_priority_is_kept_second),
        BOTH(test_one_use_redeems_one_hint),
        BOTH(test_prefetch_displaces_only_a_lower_class),
        BOTH(test_prefetch_does_not_displace_its_own_range),
        BOTH(test_prefetch_under_quota),
        BOTH(test_prefetch_from_disk_displaces_only_a_lower_class),
        BOTH(test_hint_bad_input),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
