/* Hints, prefetch, queue hints and fences against a hostile caller, from
 * kvh.h's promises alone ("Hints and prefetch", "Queue hints", fences):
 * garbage priorities and ranges at and past the edges get KVH_ERR_RANGE
 * without touching out-parameters; queue hints keep "the sooner request
 * ranks higher" wherever the step count stands, 2^31 - 1 requests and
 * beyond included; fences answer timeouts of 0 and UINT64_MAX, repeated
 * waits, frees while pending and foreign handles; hints on freed and
 * truncated sequences do not follow their blocks' records into new
 * blocks; and a long random mix of all of them with appends, writes,
 * truncates, forks, frees, acquires and migrations never changes a KV
 * byte (checked against a copy the test keeps). */
#include "test_util.h"
#include "disk_test_util.h"

enum { L = 2, H = 1, D = 4, BT = 4 };
static const size_t TOKB = H * D * 4;

static uint32_t threads_of(void **state) { return (uint32_t)(uintptr_t)*state; }

static kvh_engine *open_lru(void **state, uint64_t dev, uint64_t host)
{
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F32, dev, host, threads_of(state));
    c.eviction_policy = KVH_EVICT_LRU_K;
    c.lru_k = 1; /* plain LRU: the victim order reads at a glance */
    return tu_open_cfg(&c);
}

/* A sequence of nb full blocks of its own tokens, KV of tag written. */
static kvh_seq blocks_of(kvh_engine *e, size_t nb, uint64_t tag)
{
    kvh_seq s = tu_seq_new(e, 0);
    int32_t t[8 * BT];
    assert_true(nb <= 8);
    tu_iota(t, nb * BT, (int32_t)(tag * 1000));
    assert_ok(kvh_seq_append(e, s, t, nb * BT));
    tu_write_pattern(e, s, L, TOKB, tag, 0, nb * BT);
    return s;
}

static uint32_t tier0(kvh_engine *e, kvh_seq s) { return tu_seq_binfo(e, s, 0).tier; }

static int32_t garbage_priority_fixed(int k)
{
    static const int32_t p[] = {INT32_MIN, INT32_MAX, -1, 0, 1, INT32_MIN + 1};
    return p[k % 6];
}

/* ---- queue hints across the wrap of the request numbers ---- */

/* Device tier of 4: a and b queue-hinted by position 0 and 1 at step
 * `step`, c and d unhinted; three new pinned blocks then need room. Victims:
 * c, d (unhinted), then b (the later request). Returns whether a, the
 * next request's block, kept its device slot while b lost its own. */
static int sooner_request_kept(void **state, uint64_t step)
{
    kvh_engine *e = open_lru(state, 4, 16);
    kvh_seq a = blocks_of(e, 1, 1), b = blocks_of(e, 1, 2), c = blocks_of(e, 1, 3), d = blocks_of(e, 1, 4);
    uint64_t now = 0;
    assert_ok(kvh_hint_advance(e, step, &now));
    assert_true(now == step);
    assert_ok(kvh_seq_hint_queued(e, a, 0, BT, 0, KVH_HINT_POSITION));
    assert_ok(kvh_seq_hint_queued(e, b, 0, BT, 1, KVH_HINT_POSITION));
    for (uint64_t i = 0; i < 3; i++) /* pinned: not victims themselves */
        assert_ok(kvh_seq_pin(e, blocks_of(e, 1, 10 + i), 0, BT, 1));
    int kept = tier0(e, a) == KVH_TIER_DEVICE && tier0(e, b) != KVH_TIER_DEVICE;
    if (!kept)
        print_message("step %" PRIu64 ": a in tier %u, b in tier %u, c %u, d %u\n", step, tier0(e, a), tier0(e, b),
                      tier0(e, c), tier0(e, d));
    assert_true(tu_check_pattern(e, a, L, TOKB, 1, 0, BT));
    assert_true(tu_check_pattern(e, b, L, TOKB, 2, 0, BT));
    tu_close(e);
    return kept;
}

static void test_sooner_request_ranks_higher_at_every_step(void **state)
{
    const uint64_t m = INT32_MAX; /* 2^31 - 1 */
    const uint64_t steps[] = {0,
                              1000,
                              m - 2,
                              m - 1,
                              m,
                              2 * m - 1,
                              (1ull << 30) - 1,
                              (1ull << 31) - 1,
                              (1ull << 32) - 1,
                              5 * m - 1,
                              UINT64_MAX - 5,
                              UINT64_MAX - 4};
    int bad = 0;
    for (size_t i = 0; i < sizeof(steps) / sizeof(steps[0]); i++)
        bad += !sooner_request_kept(state, steps[i]);
    assert_int_equal(bad, 0);
}

static void use(kvh_engine *e, kvh_seq s)
{
    assert_ok(kvh_seq_acquire(e, s, 0, BT, NULL));
    assert_ok(kvh_seq_release(e, s, 0, BT));
}

/* a is queued for requests step + 3 and step + 5; its first use redeems
 * the sooner. A second use, with the step still before step + 5, redeems
 * nothing: a stays hinted and outlives b, c, d, used after it. Returns
 * whether it did. */
static int later_request_survives_a_second_use(void **state, uint64_t step)
{
    kvh_engine *e = open_lru(state, 4, 16);
    kvh_seq a = blocks_of(e, 1, 1), b = blocks_of(e, 1, 2), c = blocks_of(e, 1, 3), d = blocks_of(e, 1, 4);
    uint64_t now = 0;
    assert_ok(kvh_hint_advance(e, step, &now));
    assert_ok(kvh_seq_hint_queued(e, a, 0, BT, 3, KVH_HINT_POSITION));
    assert_ok(kvh_seq_hint_queued(e, a, 0, BT, 5, KVH_HINT_POSITION));
    use(e, a);
    use(e, a);
    use(e, b);
    use(e, c);
    use(e, d);
    for (uint64_t i = 0; i < 3; i++)
        assert_ok(kvh_seq_pin(e, blocks_of(e, 1, 10 + i), 0, BT, 1));
    int kept = tier0(e, a) == KVH_TIER_DEVICE;
    if (!kept)
        print_message("step %" PRIu64 ": a's hint for request step + 5 went with its second use\n", step);
    assert_true(tu_check_pattern(e, a, L, TOKB, 1, 0, BT));
    tu_close(e);
    return kept;
}

static void test_use_redeems_only_due_requests_at_every_step(void **state)
{
    const uint64_t m = INT32_MAX;
    const uint64_t steps[] = {0, 1000, m - 1, 2 * m - 1, (1ull << 30) - 1, (1ull << 30) - 3, UINT64_MAX - 4 - m};
    int bad = 0;
    for (size_t i = 0; i < sizeof(steps) / sizeof(steps[0]); i++)
        bad += !later_request_survives_a_second_use(state, steps[i]);
    assert_int_equal(bad, 0);
}

/* Requests queued before a step and one queued after it keep their order
 * whatever the count crosses on the way: a (request step + 1), b (step +
 * 2), then one step, then c (step + 3). d unhinted; three pinned new
 * blocks take d's, c's and b's slots, in that order. */
static void test_order_holds_across_an_advance(void **state)
{
    const uint64_t m = INT32_MAX;
    const uint64_t steps[] = {0, (1ull << 30) - 1, (1ull << 30) - 2, m - 1, m - 2, (1ull << 32) - 1, UINT64_MAX - 8};
    int bad = 0;
    for (size_t i = 0; i < sizeof(steps) / sizeof(steps[0]); i++) {
        kvh_engine *e = open_lru(state, 4, 16);
        kvh_seq a = blocks_of(e, 1, 1), b = blocks_of(e, 1, 2), c = blocks_of(e, 1, 3), d = blocks_of(e, 1, 4);
        uint64_t now = 0;
        assert_ok(kvh_hint_advance(e, steps[i], &now));
        assert_ok(kvh_seq_hint_queued(e, a, 0, BT, 1, KVH_HINT_POSITION));
        assert_ok(kvh_seq_hint_queued(e, b, 0, BT, 2, KVH_HINT_POSITION));
        assert_ok(kvh_hint_advance(e, 1, &now));
        assert_ok(kvh_seq_hint_queued(e, c, 0, BT, steps[i] + 3, KVH_HINT_REQUEST));
        for (uint64_t k = 0; k < 3; k++)
            assert_ok(kvh_seq_pin(e, blocks_of(e, 1, 10 + k), 0, BT, 1));
        if (tier0(e, a) != KVH_TIER_DEVICE || tier0(e, b) == KVH_TIER_DEVICE || tier0(e, c) == KVH_TIER_DEVICE ||
            tier0(e, d) == KVH_TIER_DEVICE) {
            print_message("step %" PRIu64 " + 1: a in tier %u, b %u, c %u, d %u\n", steps[i], tier0(e, a), tier0(e, b),
                          tier0(e, c), tier0(e, d));
            bad++;
        }
        tu_close(e);
    }
    assert_int_equal(bad, 0);
}

/* A request the step has passed is dropped wherever the count stands:
 * its block is unhinted again and leaves before a block hinted for a
 * request still to come. */
static void test_passed_request_drops_at_the_wrap(void **state)
{
    const uint64_t m = INT32_MAX;
    const uint64_t starts[] = {m - 2, 2 * m - 2, UINT64_MAX - 8};
    for (size_t i = 0; i < 3; i++) {
        kvh_engine *e = open_lru(state, 4, 16);
        kvh_seq a = blocks_of(e, 1, 1), b = blocks_of(e, 1, 2), c = blocks_of(e, 1, 3), d = blocks_of(e, 1, 4);
        uint64_t now = 0;
        assert_ok(kvh_hint_advance(e, starts[i], &now));
        /* a: the next request, which will never come; b, c, d: later. */
        assert_ok(kvh_seq_hint_queued(e, a, 0, BT, 0, KVH_HINT_POSITION));
        assert_ok(kvh_seq_hint_queued(e, b, 0, BT, 3, KVH_HINT_POSITION));
        assert_ok(kvh_seq_hint_queued(e, c, 0, BT, 3, KVH_HINT_POSITION));
        assert_ok(kvh_seq_hint_queued(e, d, 0, BT, 3, KVH_HINT_POSITION));
        assert_ok(kvh_hint_advance(e, 2, &now)); /* passes a's request */
        assert_true(now == starts[i] + 2);
        blocks_of(e, 1, 20);
        assert_int_equal(tier0(e, a), KVH_TIER_HOST);
        assert_int_equal(tier0(e, b), KVH_TIER_DEVICE);
        assert_int_equal(tier0(e, c), KVH_TIER_DEVICE);
        assert_int_equal(tier0(e, d), KVH_TIER_DEVICE);
        tu_close(e);
    }
}

/* The step count at its end: no wrap to request 0. */
static void test_step_count_at_its_end(void **state)
{
    kvh_engine *e = open_lru(state, 4, 16);
    kvh_seq a = blocks_of(e, 1, 1);
    uint64_t now = 0;
    assert_ok(kvh_hint_advance(e, UINT64_MAX - 1, &now));
    assert_true(now == UINT64_MAX - 1);
    assert_ok(kvh_seq_hint_queued(e, a, 0, BT, 1, KVH_HINT_POSITION)); /* request 2^64 - 1 */
    kvh_status st = kvh_seq_hint_queued(e, a, 0, BT, 2, KVH_HINT_POSITION);
    assert_true(st == KVH_ERR_RANGE); /* request 2^64: no such number */
    assert_kvh(KVH_ERR_RANGE, kvh_seq_hint_queued(e, a, 0, BT, UINT64_MAX, KVH_HINT_POSITION));
    assert_ok(kvh_seq_hint_queued(e, a, 0, BT, 0, KVH_HINT_REQUEST)); /* long taken: ignored */
    assert_ok(kvh_hint_advance(e, 1, &now));
    assert_true(now == UINT64_MAX);
    now = 7;
    assert_kvh(KVH_ERR_RANGE, kvh_hint_advance(e, 1, &now));
    assert_true(now == 7); /* not written on failure */
    assert_ok(kvh_hint_advance(e, 0, &now));
    assert_true(now == UINT64_MAX);
    assert_ok(kvh_seq_hint_queued(e, a, 0, BT, 0, KVH_HINT_POSITION));
    assert_true(tu_check_pattern(e, a, L, TOKB, 1, 0, BT));
}

/* ---- ranges and priorities at the edges ---- */

static void test_edges_of_ranges_and_priorities(void **state)
{
    kvh_engine *e = open_lru(state, 4, 16);
    kvh_seq s = blocks_of(e, 2, 1);
    const uint64_t len = 2 * BT;
    const struct {
        uint64_t first, n;
        int ok;
    } r[] = {
        {0, 0, 1},
        {0, len, 1},
        {len, 0, 1},
        {len - 1, 1, 1},
        {1, len - 1, 1},
        {0, len + 1, 0},
        {len, 1, 0},
        {len + 1, 0, 0},
        {UINT64_MAX, 1, 0},
        {1, UINT64_MAX, 0},
        {UINT64_MAX, 0, 0},
        {UINT64_MAX, UINT64_MAX, 0},
        {len, UINT64_MAX - len + 1, 0},
        {2, UINT64_MAX - 1, 0},
    };
    const int32_t prio[] = {INT32_MIN, INT32_MIN + 1, -1, 0, 1, INT32_MAX};
    for (size_t i = 0; i < sizeof(r) / sizeof(r[0]); i++)
        for (size_t p = 0; p < sizeof(prio) / sizeof(prio[0]); p++) {
            kvh_status want = r[i].ok ? KVH_OK : KVH_ERR_RANGE;
            kvh_status got = kvh_seq_hint(e, s, r[i].first, r[i].n, prio[p]);
            if (got != want)
                fail_msg("hint [%" PRIu64 ", +%" PRIu64 ") at %d: %s", r[i].first, r[i].n, prio[p],
                         kvh_status_name(got));
            assert_kvh(want, kvh_prefetch(e, s, r[i].first, r[i].n, prio[p], NULL));
            kvh_fence f = {0x5e57};
            got = kvh_prefetch(e, s, r[i].first, r[i].n, prio[p], &f);
            if (got != want)
                fail_msg("prefetch [%" PRIu64 ", +%" PRIu64 ") at %d: %s", r[i].first, r[i].n, prio[p],
                         kvh_status_name(got));
            if (want == KVH_OK) {
                assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
                assert_ok(kvh_fence_free(e, f));
            } else {
                assert_true(f.id == 0x5e57); /* out-parameters only on success */
            }
            assert_kvh(want, kvh_seq_hint_queued(e, s, r[i].first, r[i].n, (uint64_t)p, KVH_HINT_POSITION));
        }
    /* Unknown kinds, before and after a range error. */
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_hint_queued(e, s, 0, BT, 0, (kvh_hint_place)2));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_hint_queued(e, s, 0, BT, 0, (kvh_hint_place)-1));
    /* Still the same data and a working engine. */
    assert_true(tu_check_pattern(e, s, L, TOKB, 1, 0, len));
    kvh_seq more[4];
    for (int i = 0; i < 4; i++)
        more[i] = blocks_of(e, 1, 2 + (uint64_t)i);
    for (int i = 0; i < 4; i++)
        assert_true(tu_check_pattern(e, more[i], L, TOKB, 2 + (uint64_t)i, 0, BT));
}

/* ---- fences ---- */

static void test_fence_edges(void **state)
{
    char dir[PATH_MAX];
    dt_scratch("hints_fence", dir, sizeof(dir));
    dt_rmrf(dir);
    const dt_geo g = {L, H, D, BT, KVH_DTYPE_F32};
    kvh_config c = dt_cfg(g, dir, 4, 4, 64, threads_of(state));
    kvh_engine *e = dt_open_a(&c);
    /* 12 blocks for 8 memory slots: the first ones are on disk. */
    kvh_seq s = blocks_of(e, 6, 1), t = blocks_of(e, 6, 2);
    for (int round = 0; round < 8; round++) {
        kvh_seq which = round % 2 ? t : s;
        kvh_fence f;
        assert_ok(kvh_prefetch(e, which, 0, 6 * BT, round, &f));
        kvh_status w0 = kvh_fence_wait(e, f, 0);
        assert_true(w0 == KVH_OK || w0 == KVH_ERR_TIMEOUT);
        kvh_status w1 = kvh_fence_wait(e, f, 1);
        assert_true(w1 == KVH_OK || w1 == KVH_ERR_TIMEOUT);
        if (round % 3 == 2) {
            /* Freed while pending: the work goes on, the handle is gone. */
            assert_ok(kvh_fence_free(e, f));
        } else {
            assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
            assert_ok(kvh_fence_wait(e, f, UINT64_MAX)); /* again: same answer */
            assert_ok(kvh_fence_wait(e, f, 0));
            int32_t done = 0;
            assert_ok(kvh_fence_poll(e, f, &done));
            assert_int_equal(done, 1);
            assert_kvh(KVH_ERR_INVALID_ARG, kvh_fence_poll(e, f, NULL));
            assert_ok(kvh_fence_free(e, f));
        }
        int32_t done = 5;
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_wait(e, f, 0));
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_wait(e, f, UINT64_MAX));
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_poll(e, f, &done));
        assert_int_equal(done, 5);
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_free(e, f));
    }
    /* The null fence, forged ones, a sequence handle as a fence. */
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_wait(e, (kvh_fence){0}, UINT64_MAX));
    assert_ok(kvh_fence_free(e, (kvh_fence){0}));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_wait(e, (kvh_fence){UINT64_MAX}, UINT64_MAX));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_wait(e, (kvh_fence){s.id}, UINT64_MAX));
    /* A fence of another engine. */
    kvh_engine *e2 = tu_open(L, H, D, BT, KVH_DTYPE_F32, 4, 4, threads_of(state));
    kvh_seq x = blocks_of(e2, 1, 9);
    kvh_fence f2;
    assert_ok(kvh_prefetch(e2, x, 0, BT, 0, &f2));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_wait(e, f2, UINT64_MAX));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_free(e, f2));
    assert_ok(kvh_fence_wait(e2, f2, UINT64_MAX));
    assert_ok(kvh_fence_free(e2, f2));
    tu_close(e2);
    /* A prefetch fence whose sequence is freed before the wait. */
    kvh_fence f;
    kvh_seq u = blocks_of(e, 2, 3);
    assert_ok(kvh_prefetch(e, s, 0, 6 * BT, INT32_MAX, &f));
    assert_ok(kvh_seq_free(e, s));
    assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
    assert_ok(kvh_fence_free(e, f));
    assert_true(tu_check_pattern(e, t, L, TOKB, 2, 0, 6 * BT));
    assert_true(tu_check_pattern(e, u, L, TOKB, 3, 0, 2 * BT));
    assert_ok(dt_close(e));
}

/* An acquire whose fence is pending while its sequence gives everything
 * up: release, truncate to 0, free; and block handles migrated while
 * their last reference goes. Nothing else's bytes change. */
static void test_holds_and_moves_given_up_under_a_fence(void **state)
{
    char dir[PATH_MAX];
    dt_scratch("hints_giveup", dir, sizeof(dir));
    dt_rmrf(dir);
    const dt_geo g = {L, H, D, BT, KVH_DTYPE_F32};
    kvh_config c = dt_cfg(g, dir, 4, 4, 64, threads_of(state));
    kvh_engine *e = dt_open_a(&c);
    kvh_seq keep = blocks_of(e, 3, 1);
    for (int round = 0; round < 12; round++) {
        kvh_seq s = blocks_of(e, 4, 10 + (uint64_t)round); /* pushes older blocks to disk */
        kvh_seq old = blocks_of(e, 2, 50 + (uint64_t)round);
        kvh_fence f;
        kvh_status st = kvh_seq_acquire(e, old, 0, 2 * BT, &f);
        assert_ok(st);
        switch (round % 3) {
        case 0:
            assert_ok(kvh_seq_release(e, old, 0, 2 * BT));
            assert_ok(kvh_seq_truncate(e, old, 0));
            break;
        case 1:
            assert_ok(kvh_seq_free(e, old));
            old.id = 0;
            break;
        default:
            assert_ok(kvh_seq_truncate(e, old, BT + 1));
            break;
        }
        st = kvh_fence_wait(e, f, UINT64_MAX);
        assert_true(st == KVH_OK || st == KVH_ERR_NOSPACE);
        assert_ok(kvh_fence_free(e, f));
        if (round % 3 == 2) {
            assert_true(tu_check_pattern(e, old, L, TOKB, 50 + (uint64_t)round, 0, BT + 1));
            kvh_status rs = kvh_seq_release(e, old, 0, BT + 1);
            assert_true(rs == KVH_OK || rs == KVH_ERR_INVALID_ARG);
        }
        /* Block handles: retained, migrated with a fence, released at once. */
        kvh_block b[4];
        assert_ok(kvh_seq_blocks(e, s, 0, 4, b));
        for (int i = 0; i < 4; i++)
            assert_ok(kvh_block_retain(e, b[i]));
        assert_ok(kvh_migrate(e, b, 4, (uint32_t)(round % 3), &f));
        assert_ok(kvh_seq_free(e, s));
        for (int i = 0; i < 4; i++)
            assert_ok(kvh_block_release(e, b[i]));
        st = kvh_fence_wait(e, f, UINT64_MAX);
        assert_true(st == KVH_OK || st == KVH_ERR_NOSPACE || st == KVH_ERR_BAD_HANDLE);
        assert_ok(kvh_fence_free(e, f));
        if (old.id)
            assert_ok(kvh_seq_free(e, old));
        assert_true(tu_check_pattern(e, keep, L, TOKB, 1, 0, 3 * BT));
    }
    assert_ok(dt_close(e));
}

/* kvh_prefetch of tokens [0, n) of s at priority, waited for. */
static void prefetch_waited(kvh_engine *e, kvh_seq s, uint64_t n, int32_t priority)
{
    kvh_fence f;
    assert_ok(kvh_prefetch(e, s, 0, n, priority, &f));
    tu_fence_finish(e, f);
}

/* promote_min_hits at its extremes: prefetch never errs, never moves a
 * byte, and counts what it did. */
static void test_prefetch_threshold_extremes(void **state)
{
    const uint32_t thresholds[] = {0, 1, 2, UINT32_MAX};
    for (size_t i = 0; i < 4; i++) {
        kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F32, 4, 16, threads_of(state));
        c.promote_min_hits = thresholds[i];
        kvh_engine *e;
        kvh_status st = kvh_engine_open(&c, &e);
        if (st == KVH_ERR_INVALID_ARG)
            continue; /* refused at open is fine too */
        assert_ok(st);
        tu_track_engine(e);
        kvh_seq s[6];
        for (int k = 0; k < 6; k++)
            s[k] = blocks_of(e, 1, 1 + (uint64_t)k); /* s[0], s[1] on the host tier */
        for (int k = 0; k < 6; k++) {
            prefetch_waited(e, s[k], BT, garbage_priority_fixed(k));
        }
        kvh_stats stt = tu_stats(e);
        if (thresholds[i] == UINT32_MAX)
            assert_int_equal(stt.prefetch_issued, 0);
        assert_true(stt.prefetch_useful <= stt.prefetch_issued);
        for (int k = 0; k < 6; k++)
            assert_true(tu_check_pattern(e, s[k], L, TOKB, 1 + (uint64_t)k, 0, BT));
        tu_close(e);
    }
}

/* A prefetch that finds no room it may take (both device blocks hinted
 * above it) is skipped, not issued: it starts no promotion. Every issued
 * prefetch ends useful, wasted or late. */
static void test_declined_prefetch_is_skipped_not_issued(void **state)
{
    kvh_engine *e = open_lru(state, 2, 16);
    kvh_seq a = blocks_of(e, 1, 1), b = blocks_of(e, 1, 2), c = blocks_of(e, 1, 3);
    assert_int_equal(tier0(e, a), KVH_TIER_HOST);
    assert_ok(kvh_seq_hint(e, b, 0, BT, 100));
    assert_ok(kvh_seq_hint(e, c, 0, BT, 100));
    prefetch_waited(e, a, BT, 50);
    kvh_stats st = tu_stats(e);
    assert_int_equal(tier0(e, a), KVH_TIER_HOST);
    assert_int_equal(st.prefetch_skipped, 1);
    assert_int_equal(st.prefetch_issued, 0);
    /* Room now (c freed): the same prefetch promotes a, and its use counts. */
    assert_ok(kvh_seq_free(e, c));
    prefetch_waited(e, a, BT, 50);
    assert_int_equal(tier0(e, a), KVH_TIER_DEVICE);
    kvh_seq seqs[2] = {a, b};
    for (int k = 0; k < 2; k++) {
        assert_ok(kvh_seq_acquire(e, seqs[k], 0, BT, NULL));
        assert_ok(kvh_seq_release(e, seqs[k], 0, BT));
    }
    st = tu_stats(e);
    assert_int_equal(st.prefetch_issued, 1);
    assert_int_equal(st.prefetch_useful, 1);
    assert_int_equal(st.prefetch_issued, st.prefetch_useful + st.prefetch_wasted + st.prefetch_late);
    assert_true(tu_check_pattern(e, a, L, TOKB, 1, 0, BT));
}

/* A prefetched block freed before any use was prefetched for nothing:
 * wasted, so that issued still equals useful + wasted + late. */
static void test_prefetched_block_freed_unused_is_wasted(void **state)
{
    kvh_engine *e = open_lru(state, 2, 16);
    /* a: one partial block (a full one stays cached when freed). */
    kvh_seq a = tu_seq_new(e, 0);
    int32_t t[BT];
    tu_iota(t, BT - 1, 1000);
    assert_ok(kvh_seq_append(e, a, t, BT - 1));
    tu_write_pattern(e, a, L, TOKB, 1, 0, BT - 1);
    kvh_seq b = blocks_of(e, 1, 2), c = blocks_of(e, 1, 3);
    assert_int_equal(tier0(e, a), KVH_TIER_HOST);
    assert_ok(kvh_seq_free(e, c)); /* room for the prefetch */
    prefetch_waited(e, a, BT - 1, 50);
    assert_int_equal(tier0(e, a), KVH_TIER_DEVICE);
    assert_ok(kvh_seq_free(e, a));
    kvh_stats st = tu_stats(e);
    assert_int_equal(st.prefetch_issued, 1);
    assert_int_equal(st.prefetch_wasted, 1);
    assert_int_equal(st.prefetch_issued, st.prefetch_useful + st.prefetch_wasted + st.prefetch_late);
    assert_true(tu_check_pattern(e, b, L, TOKB, 2, 0, BT));
}

/* kvh_seq_hint: INT32_MIN counts as INT32_MIN + 1, still a hint: such a
 * block outlives every unhinted one. */
static void test_lowest_priority_is_still_a_hint(void **state)
{
    kvh_engine *e = open_lru(state, 4, 16);
    kvh_seq a = blocks_of(e, 1, 1), b = blocks_of(e, 1, 2), c = blocks_of(e, 1, 3), d = blocks_of(e, 1, 4);
    assert_ok(kvh_seq_hint(e, a, 0, BT, INT32_MIN));
    assert_ok(kvh_seq_hint(e, b, 0, BT, INT32_MIN + 1));
    for (uint64_t k = 0; k < 2; k++)
        assert_ok(kvh_seq_pin(e, blocks_of(e, 1, 10 + k), 0, BT, 1));
    assert_int_equal(tier0(e, a), KVH_TIER_DEVICE);
    assert_int_equal(tier0(e, b), KVH_TIER_DEVICE);
    assert_int_equal(tier0(e, c), KVH_TIER_HOST);
    assert_int_equal(tier0(e, d), KVH_TIER_HOST);
}

/* ---- hints on freed and truncated sequences ---- */

/* x is hinted at INT32_MAX over 4 blocks, then loses 3 (truncate) whose
 * slots new blocks y1..y3 take; x keeps one block hinted at priority 5
 * (re-hinted). The stale hints of the freed blocks must not protect the
 * new ones: the next victim is the oldest new block, not x's. */
static void test_stale_hints_do_not_follow_freed_blocks(void **state)
{
    for (int how = 0; how < 3; how++) {
        kvh_engine *e = open_lru(state, 4, 16);
        kvh_seq x = blocks_of(e, 4, 1);
        if (how == 0)
            assert_ok(kvh_seq_hint(e, x, 0, 4 * BT, INT32_MAX));
        else if (how == 1)
            assert_ok(kvh_prefetch(e, x, 0, 4 * BT, INT32_MAX, NULL));
        else
            assert_ok(kvh_seq_hint_queued(e, x, 0, 4 * BT, 0, KVH_HINT_POSITION));
        assert_ok(kvh_seq_truncate(e, x, BT));
        assert_kvh(KVH_ERR_RANGE, kvh_seq_hint(e, x, BT, BT, 1));
        assert_kvh(KVH_ERR_RANGE, kvh_prefetch(e, x, BT, BT, 1, NULL));
        assert_kvh(KVH_ERR_RANGE, kvh_seq_hint_queued(e, x, BT, BT, 0, KVH_HINT_POSITION));
        kvh_seq y[3];
        for (int i = 0; i < 3; i++)
            y[i] = blocks_of(e, 1, 2 + (uint64_t)i);
        /* x's own block: redeem what it had, then a low hint. */
        assert_ok(kvh_seq_acquire(e, x, 0, BT, NULL));
        assert_ok(kvh_seq_release(e, x, 0, BT));
        assert_ok(kvh_seq_acquire(e, x, 0, BT, NULL));
        assert_ok(kvh_seq_release(e, x, 0, BT));
        uint64_t now;
        assert_ok(kvh_hint_advance(e, 1, &now)); /* passes queue request 0 */
        assert_ok(kvh_seq_hint(e, x, 0, BT, 5));
        blocks_of(e, 1, 9);
        if (tier0(e, x) != KVH_TIER_DEVICE)
            fail_msg("case %d: x's hinted block left first, before unhinted new blocks", how);
        assert_int_equal(tier0(e, y[0]), KVH_TIER_HOST);
        assert_true(tu_check_pattern(e, x, L, TOKB, 1, 0, BT));
        for (int i = 0; i < 3; i++)
            assert_true(tu_check_pattern(e, y[i], L, TOKB, 2 + (uint64_t)i, 0, BT));
        /* Freed: hints are refused, the engine goes on. */
        assert_ok(kvh_seq_free(e, x));
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_hint(e, x, 0, 0, 1));
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_prefetch(e, x, 0, 0, 1, NULL));
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_hint_queued(e, x, 0, 0, 0, KVH_HINT_POSITION));
        tu_close(e);
    }
}

/* ---- a random mix against a copy of the data ---- */

enum { MAXS = 12, MAXT = 6 * BT };

typedef struct model_seq {
    kvh_seq s;
    int live;
    uint64_t len;
    int32_t tokens[MAXT];
    uint64_t tag[MAXT]; /* KV pattern tag of each token */
} model_seq;

typedef struct model {
    kvh_engine *e;
    model_seq q[MAXS];
    kvh_seq dead[64]; /* freed handles, for stale calls */
    int n_dead;
    uint64_t next_tag;
    int32_t next_token;
} model;

static void write_tag(model *m, model_seq *q, uint64_t pos, uint64_t n)
{
    uint64_t tag = m->next_tag++;
    tu_write_pattern(m->e, q->s, L, TOKB, tag, pos, n);
    for (uint64_t i = pos; i < pos + n; i++)
        q->tag[i] = tag;
}

static void verify(model *m, model_seq *q, int op)
{
    for (uint64_t p = 0; p < q->len;) {
        uint64_t end = p;
        while (end < q->len && q->tag[end] == q->tag[p])
            end++;
        if (!tu_check_pattern(m->e, q->s, L, TOKB, q->tag[p], p, end - p))
            fail_msg("op %d: tokens [%" PRIu64 ", %" PRIu64 ") of a sequence lost their KV", op, p, end);
        p = end;
    }
    int32_t t[MAXT];
    assert_ok(kvh_seq_tokens(m->e, q->s, 0, q->len, t));
    assert_memory_equal(t, q->tokens, q->len * sizeof(int32_t));
}

static kvh_seq any_handle(model *m, tu_rng *r)
{
    if (m->n_dead && tu_below(r, 4) == 0)
        return m->dead[tu_below(r, (uint64_t)m->n_dead)];
    model_seq *q = &m->q[tu_below(r, MAXS)];
    return q->s;
}

static int32_t garbage_priority(tu_rng *r)
{
    switch (tu_below(r, 5)) {
    case 0:
        return INT32_MIN;
    case 1:
        return INT32_MAX;
    case 2:
        return (int32_t)tu_next(r);
    default:
        return (int32_t)tu_below(r, 8);
    }
}

static void garbage_range(tu_rng *r, uint64_t *first, uint64_t *n)
{
    switch (tu_below(r, 6)) {
    case 0:
        *first = tu_next(r);
        *n = tu_next(r);
        break;
    case 1:
        *first = tu_below(r, MAXT);
        *n = UINT64_MAX - tu_below(r, 4);
        break;
    default:
        *first = tu_below(r, MAXT);
        *n = tu_below(r, MAXT);
    }
}

/* The status a range call must give: KVH_OK inside the sequence,
 * KVH_ERR_RANGE outside, KVH_ERR_BAD_HANDLE for a freed one. */
static kvh_status expected(model *m, kvh_seq s, uint64_t first, uint64_t n)
{
    for (int i = 0; i < MAXS; i++)
        if (m->q[i].live && m->q[i].s.id == s.id)
            return first <= m->q[i].len && n <= m->q[i].len - first ? KVH_OK : KVH_ERR_RANGE;
    return KVH_ERR_BAD_HANDLE;
}

static void random_mix(void **state, uint64_t seed, int ops, int with_disk)
{
    char dir[PATH_MAX];
    dt_scratch("hints_mix", dir, sizeof(dir));
    dt_rmrf(dir);
    const dt_geo g = {L, H, D, BT, KVH_DTYPE_F32};
    kvh_config c = dt_cfg(g, dir, 4, with_disk ? 6 : 24, with_disk ? 128 : 0, threads_of(state));
    kvh_engine *e = dt_open_a(&c);
    model *m = tu_alloc(sizeof(model));
    m->e = e;
    m->next_tag = 1;
    m->next_token = 1;
    tu_rng r = {seed};
    for (int op = 0; op < ops; op++) {
        model_seq *q = &m->q[tu_below(&r, MAXS)];
        uint64_t first, n;
        kvh_status st;
        switch (tu_below(&r, 14)) {
        case 0: /* create or grow */
        case 1: {
            if (!q->live) {
                q->s = tu_seq_new(e, (uint32_t)tu_below(&r, 3));
                q->live = 1;
                q->len = 0;
            }
            uint64_t add = 1 + tu_below(&r, 2 * BT);
            if (q->len + add > MAXT)
                break;
            for (uint64_t i = 0; i < add; i++)
                q->tokens[q->len + i] = m->next_token++;
            st = kvh_seq_append(e, q->s, q->tokens + q->len, add);
            if (st == KVH_ERR_NOSPACE)
                break;
            assert_ok(st);
            q->len += add;
            write_tag(m, q, q->len - add, add);
            break;
        }
        case 2: /* rewrite a range (copies shared blocks) */
            if (q->live && q->len) {
                first = tu_below(&r, q->len);
                n = 1 + tu_below(&r, q->len - first);
                uint64_t tag = m->next_tag++;
                size_t bytes = n * TOKB;
                void *k = tu_alloc(bytes), *v = tu_alloc(bytes);
                st = KVH_OK;
                uint32_t l = 0;
                for (; l < L; l++) {
                    for (uint64_t i = 0; i < n; i++) {
                        tu_pattern((uint8_t *)k + i * TOKB, TOKB, tag, l, first + i, 0);
                        tu_pattern((uint8_t *)v + i * TOKB, TOKB, tag, l, first + i, 1);
                    }
                    st = kvh_seq_write_kv(e, q->s, l, first, n, k, v);
                    if (st != KVH_OK)
                        break;
                }
                tu_free(k);
                tu_free(v);
                /* No room for the copies: nothing written. A later layer
                 * finds its blocks copied already, so it cannot fail so. */
                if (st == KVH_ERR_NOSPACE && l == 0)
                    break;
                assert_ok(st);
                for (uint64_t i = first; i < first + n; i++)
                    q->tag[i] = tag;
            }
            break;
        case 3: /* truncate */
            if (q->live) {
                uint64_t to = tu_below(&r, q->len + 1);
                st = kvh_seq_truncate(e, q->s, to);
                if (st == KVH_ERR_NOSPACE)
                    break;
                assert_ok(st);
                q->len = to;
            }
            break;
        case 4: /* fork into a free entry */
            if (q->live) {
                model_seq *c2 = &m->q[tu_below(&r, MAXS)];
                if (c2->live)
                    break;
                st = kvh_seq_fork(e, q->s, 0, &c2->s);
                assert_ok(st);
                c2->live = 1;
                c2->len = q->len;
                memcpy(c2->tokens, q->tokens, sizeof(q->tokens));
                memcpy(c2->tag, q->tag, sizeof(q->tag));
            }
            break;
        case 5: /* free */
            if (q->live) {
                verify(m, q, op);
                assert_ok(kvh_seq_free(e, q->s));
                q->live = 0;
                if (m->n_dead < 64)
                    m->dead[m->n_dead++] = q->s;
                else
                    m->dead[tu_below(&r, 64)] = q->s;
            }
            break;
        case 6: /* hint */
        case 7: {
            kvh_seq s = any_handle(m, &r);
            garbage_range(&r, &first, &n);
            if (tu_below(&r, 2) && expected(m, s, 0, 0) == KVH_OK) {
                /* mostly in range */
                for (int i = 0; i < MAXS; i++)
                    if (m->q[i].live && m->q[i].s.id == s.id) {
                        first = tu_below(&r, m->q[i].len + 1);
                        n = tu_below(&r, m->q[i].len - first + 1);
                    }
            }
            kvh_status want = s.id ? expected(m, s, first, n) : KVH_ERR_BAD_HANDLE;
            assert_kvh(want, kvh_seq_hint(e, s, first, n, garbage_priority(&r)));
            break;
        }
        case 8: { /* prefetch, with a fence waited or not, freed or not */
            kvh_seq s = any_handle(m, &r);
            first = 0;
            n = 0;
            for (int i = 0; i < MAXS; i++)
                if (m->q[i].live && m->q[i].s.id == s.id)
                    n = m->q[i].len;
            if (tu_below(&r, 4) == 0)
                garbage_range(&r, &first, &n);
            kvh_status want = s.id ? expected(m, s, first, n) : KVH_ERR_BAD_HANDLE;
            if (tu_below(&r, 2)) {
                assert_kvh(want, kvh_prefetch(e, s, first, n, garbage_priority(&r), NULL));
                break;
            }
            kvh_fence f = {0};
            assert_kvh(want, kvh_prefetch(e, s, first, n, garbage_priority(&r), &f));
            if (want != KVH_OK)
                break;
            static const uint64_t timeouts[] = {0, 1, 1000, UINT64_MAX};
            st = kvh_fence_wait(e, f, timeouts[tu_below(&r, 4)]);
            assert_true(st == KVH_OK || st == KVH_ERR_TIMEOUT);
            assert_ok(kvh_fence_free(e, f));
            break;
        }
        case 9: { /* queue hints and steps */
            kvh_seq s = any_handle(m, &r);
            garbage_range(&r, &first, &n);
            for (int i = 0; i < MAXS && tu_below(&r, 2); i++)
                if (m->q[i].live && m->q[i].s.id == s.id) {
                    first = 0;
                    n = m->q[i].len;
                }
            uint64_t place = tu_below(&r, 8) ? tu_below(&r, 6) : tu_next(&r);
            uint32_t kind = (uint32_t)tu_below(&r, 3); /* 2: unknown */
            st = kvh_seq_hint_queued(e, s, first, n, place, (kvh_hint_place)kind);
            kvh_status want = s.id ? expected(m, s, first, n) : KVH_ERR_BAD_HANDLE;
            if (want == KVH_OK && kind == 2)
                want = KVH_ERR_INVALID_ARG;
            if (want == KVH_ERR_RANGE && kind == 2)
                assert_true(st == KVH_ERR_RANGE || st == KVH_ERR_INVALID_ARG);
            else if (want == KVH_OK)
                assert_true(st == KVH_OK || st == KVH_ERR_RANGE); /* a place 2^24 past the step */
            else if (want == KVH_ERR_BAD_HANDLE)
                assert_true(st == KVH_ERR_BAD_HANDLE || st == KVH_ERR_INVALID_ARG);
            else
                assert_kvh(want, st);
            uint64_t step;
            assert_ok(kvh_hint_advance(e, tu_below(&r, 3), &step));
            break;
        }
        case 10: /* acquire and release */
            if (q->live && q->len) {
                st = kvh_seq_acquire(e, q->s, 0, q->len, NULL);
                if (st == KVH_ERR_NOSPACE || st == KVH_ERR_BUSY)
                    break;
                assert_ok(st);
                verify(m, q, op);
                assert_ok(kvh_seq_release(e, q->s, 0, q->len));
            }
            break;
        case 11: { /* migrate, waited or not */
            if (!q->live || !q->len)
                break;
            uint32_t tier = (uint32_t)tu_below(&r, with_disk ? 3 : 2);
            kvh_fence f;
            st = kvh_seq_migrate(e, q->s, 0, q->len, tier, &f);
            assert_ok(st);
            st = kvh_fence_wait(e, f, tu_below(&r, 2) ? 0 : UINT64_MAX);
            assert_true(st == KVH_OK || st == KVH_ERR_TIMEOUT || st == KVH_ERR_NOSPACE);
            assert_ok(kvh_fence_free(e, f));
            break;
        }
        default: /* read back */
            if (q->live)
                verify(m, q, op);
        }
    }
    for (int i = 0; i < MAXS; i++)
        if (m->q[i].live)
            verify(m, &m->q[i], ops);
    assert_ok(dt_close(e));
}

static void test_random_mix_keeps_every_byte(void **state)
{
    uint64_t seed = tu_seed(0x4d1e5);
    for (uint64_t k = 0; k < 4; k++)
        random_mix(state, seed + k, 600, (int)(k % 2));
}

static int teardown(void **state)
{
    dt_teardown(state);
    return tu_teardown(state);
}

#define BOTH(fn)                                                                                                       \
    cmocka_unit_test_prestate_setup_teardown(fn, NULL, teardown, (void *)(uintptr_t)0),                                \
        cmocka_unit_test_prestate_setup_teardown(fn, NULL, teardown, (void *)(uintptr_t)2)

int main(void)
{
    const struct CMUnitTest tests[] = {
        BOTH(test_sooner_request_ranks_higher_at_every_step),
        BOTH(test_use_redeems_only_due_requests_at_every_step),
        BOTH(test_order_holds_across_an_advance),
        BOTH(test_passed_request_drops_at_the_wrap),
        BOTH(test_step_count_at_its_end),
        BOTH(test_edges_of_ranges_and_priorities),
        BOTH(test_fence_edges),
        BOTH(test_holds_and_moves_given_up_under_a_fence),
        BOTH(test_prefetch_threshold_extremes),
        BOTH(test_declined_prefetch_is_skipped_not_issued),
        BOTH(test_prefetched_block_freed_unused_is_wasted),
        BOTH(test_lowest_priority_is_still_a_hint),
        BOTH(test_stale_hints_do_not_follow_freed_blocks),
        BOTH(test_random_mix_keeps_every_byte),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
