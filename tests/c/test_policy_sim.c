/* benchmarks/policy_sim.h, trace.h, trace_gen.h: the eviction-policy
 * simulator behind `kvh-bench trace`. MIN is checked against an exhaustive
 * search over every replacement schedule on tiny traces, and against every
 * policy on larger random ones. */
#include "test_util.h"

#include <unistd.h>

#include "benchmarks/policy_sim.h"
#include "benchmarks/trace.h"
#include "benchmarks/trace_gen.h"
#include "trace_test_util.h"

static void build(trace *t, const uint32_t *blocks, size_t n)
{
    trace_init(t);
    for (size_t i = 0; i < n; i++)
        assert_int_equal(trace_add(t, 0, blocks[i], 0, 0.5f), 0);
}

static void random_trace(trace *t, tu_rng *r, size_t n, uint32_t distinct)
{
    trace_init(t);
    for (size_t i = 0; i < n; i++) {
        /* Skewed: half the accesses go to a fifth of the blocks. */
        uint32_t b = tu_below(r, 2) ? (uint32_t)tu_below(r, distinct / 5 + 1) : (uint32_t)tu_below(r, distinct);
        assert_int_equal(trace_add(t, b % 3, b, 0, (float)tu_below(r, 100) / 100.0f), 0);
    }
}

/* The most hits any schedule can get: after each access the cache may
 * become any subset of (cache + the accessed block) of at most cap blocks.
 * Dynamic programming over cache contents (blocks < 8). */
static uint64_t brute_force_opt(const trace *t, uint32_t cap)
{
    uint32_t states = 1u << t->n_blocks;
    int64_t *best = malloc(states * sizeof(*best)), *next = malloc(states * sizeof(*next));
    assert_non_null(best);
    assert_non_null(next);
    for (uint32_t m = 0; m < states; m++)
        best[m] = -1;
    best[0] = 0;
    for (size_t i = 0; i < t->n; i++) {
        uint32_t x = 1u << t->acc[i].block;
        for (uint32_t m = 0; m < states; m++)
            next[m] = -1;
        for (uint32_t m = 0; m < states; m++) {
            if (best[m] < 0)
                continue;
            int64_t v = best[m] + ((m & x) ? 1 : 0);
            uint32_t avail = m | x;
            /* every subset s of avail with |s| <= cap */
            for (uint32_t s = avail;; s = (s - 1) & avail) {
                if ((uint32_t)__builtin_popcount(s) <= cap && v > next[s])
                    next[s] = v;
                if (s == 0)
                    break;
            }
        }
        int64_t *tmp = best;
        best = next;
        next = tmp;
    }
    int64_t top = 0;
    for (uint32_t m = 0; m < states; m++)
        if (best[m] > top)
            top = best[m];
    free(best);
    free(next);
    return (uint64_t)top;
}

static void test_min_is_exact_on_tiny_traces(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(11)};
    for (int round = 0; round < 400; round++) {
        trace t;
        trace_init(&t);
        uint32_t distinct = 2 + (uint32_t)tu_below(&r, 5); /* 2..6 */
        size_t n = 1 + tu_below(&r, 14);
        for (size_t i = 0; i < n; i++)
            assert_int_equal(trace_add(&t, 0, (uint32_t)tu_below(&r, distinct), 0, 0.5f), 0);
        for (uint32_t cap = 1; cap <= t.n_blocks; cap++)
            assert_int_equal(sim_min_hits(&t, cap), brute_force_opt(&t, cap));
        trace_free(&t);
    }
}

static void test_min_bounds_every_policy(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(12)};
    for (int round = 0; round < 30; round++) {
        trace t;
        random_trace(&t, &r, 3000, 50 + (uint32_t)tu_below(&r, 400));
        uint32_t dev = 1 + (uint32_t)tu_below(&r, 60), host = (uint32_t)tu_below(&r, 120);
        sim_config c;
        sim_config_defaults(&c, dev, host);
        sim_result opt;
        assert_int_equal(sim_min(&t, &c, &opt), 0);
        assert_int_equal(opt.hits_device + opt.hits_host + opt.misses, t.n);
        for (int p = 0; p < SIM_POLICY_COUNT; p++) {
            sim_result res;
            assert_int_equal(sim_run(&t, (sim_policy)p, &c, &res), 0);
            assert_int_equal(res.accesses, t.n);
            assert_int_equal(res.hits_device + res.hits_host + res.misses, t.n);
            assert_int_equal(res.first_accesses, t.n_blocks);
            assert_true(res.hits_device <= opt.hits_device);
            assert_true(res.hits_device + res.hits_host <= opt.hits_device + opt.hits_host);
            /* The inbound lower bound holds for every policy. */
            assert_true(res.up_dh + res.up_sh >= opt.up_dh + opt.up_sh);
            /* Exclusive tiers: whatever went down and did not come back
             * is still below. */
            assert_true(res.down_dh <= res.up_dh + t.n_blocks);
        }
        trace_free(&t);
    }
}

static void test_min_is_monotone_in_capacity(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(13)};
    trace t;
    random_trace(&t, &r, 5000, 300);
    uint64_t prev = 0;
    for (uint32_t cap = 1; cap <= 320; cap += 7) {
        uint64_t h = sim_min_hits(&t, cap);
        assert_true(h >= prev);
        prev = h;
    }
    /* Room for everything: only first accesses miss. */
    assert_int_equal(sim_min_hits(&t, t.n_blocks), t.n - t.n_blocks);
    trace_free(&t);
}

static void test_loop_defeats_lru_not_min(void **state)
{
    (void)state;
    /* 0 1 2 repeated, device of 2, no host: LRU always evicts the block
     * needed next; MIN keeps two of the three. */
    uint32_t seq[30];
    for (int i = 0; i < 30; i++)
        seq[i] = (uint32_t)(i % 3);
    trace t;
    build(&t, seq, 30);
    sim_config c;
    sim_config_defaults(&c, 2, 0);
    sim_result res;
    assert_int_equal(sim_run(&t, SIM_LRU, &c, &res), 0);
    assert_int_equal(res.hits_device, 0);
    assert_int_equal(res.misses, 30);
    assert_int_equal(sim_min_hits(&t, 2), brute_force_opt(&t, 2));
    assert_true(sim_min_hits(&t, 2) >= 13);
    trace_free(&t);
}

static void test_lru_k_resists_a_scan(void **state)
{
    (void)state;
    /* Hot blocks 0..3 twice, a scan of 20 one-off blocks, hot blocks again.
     * Device of 5: LRU loses the hot set to the scan, LRU-2 keeps it
     * (one-off blocks have an infinite backward 2-distance). */
    uint32_t seq[64];
    size_t n = 0;
    for (int rep = 0; rep < 2; rep++)
        for (uint32_t b = 0; b < 4; b++)
            seq[n++] = b;
    for (uint32_t b = 100; b < 120; b++)
        seq[n++] = b;
    for (uint32_t b = 0; b < 4; b++)
        seq[n++] = b;
    trace t;
    build(&t, seq, n);
    sim_config c;
    sim_config_defaults(&c, 5, 0);
    sim_result lru, lruk;
    assert_int_equal(sim_run(&t, SIM_LRU, &c, &lru), 0);
    assert_int_equal(sim_run(&t, SIM_LRU_K, &c, &lruk), 0);
    assert_int_equal(lru.hits_device, 4);
    assert_int_equal(lruk.hits_device, 8);
    trace_free(&t);
}

/* The mix where protected reuse wins (tests/c/test_adaptive.c has its
 * engine twin): twelve shared blocks, each read twice in a row every 48
 * steps, among new blocks each read again 24 steps later, then never. A
 * step is 2.5 accesses, so at D = 16 the pairs are reuses within the
 * period (3 x D) and the re-reads are not. */
static void reuse_mix(trace *t, uint32_t steps)
{
    trace_init(t);
    for (uint32_t step = 0; step < steps; step++) {
        if (step % 4 == 0) {
            assert_int_equal(trace_add(t, 0, (step / 4) % 12, 0, 0.5f), 0);
            assert_int_equal(trace_add(t, 0, (step / 4) % 12, 0, 0.5f), 0);
        }
        assert_int_equal(trace_add(t, 1, step, 0, 0.5f), 0);
        if (step >= 24)
            assert_int_equal(trace_add(t, 1, step - 24, 0, 0.5f), 0);
    }
}

/* Each new block read again four steps later, then never: plain LRU hits
 * every re-read, LRU-2 and the reuse order evict the newcomers first. */
static void recency_mix(trace *t, uint32_t steps)
{
    trace_init(t);
    for (uint32_t step = 0; step < steps; step++) {
        assert_int_equal(trace_add(t, 2, step, 0, 0.5f), 0);
        if (step >= 4)
            assert_int_equal(trace_add(t, 2, step - 4, 0, 0.5f), 0);
    }
}

static void test_reuse_protects_shared_pairs(void **state)
{
    (void)state;
    trace t;
    reuse_mix(&t, 4000);
    sim_config c;
    sim_config_defaults(&c, 16, 0);
    sim_result lru, lruk, reuse;
    assert_int_equal(sim_run(&t, SIM_LRU, &c, &lru), 0);
    assert_int_equal(sim_run(&t, SIM_LRU_K, &c, &lruk), 0);
    assert_int_equal(sim_run(&t, SIM_REUSE, &c, &reuse), 0);
    /* Every pair's second read hits under all three; the reuse order
     * also keeps the shared blocks between pairs (the first read). */
    assert_true(reuse.hits_device > lruk.hits_device + 500);
    assert_true(reuse.hits_device > lru.hits_device + 500);
    assert_true(reuse.hits_device <= sim_min_hits(&t, 16));
    trace_free(&t);
}

/* The adaptive twin takes the best order of each mix, and back: within
 * the cost of noticing (a few hundred accesses here) of it on each, and
 * ahead of the worst. With K = 1 it has no reuse order to take. */
static void test_adaptive_follows_the_best_order(void **state)
{
    (void)state;
    sim_config c;
    sim_config_defaults(&c, 16, 0);
    trace t;
    sim_result lru, lruk, reuse, adaptive;
    reuse_mix(&t, 4000);
    assert_int_equal(sim_run(&t, SIM_REUSE, &c, &reuse), 0);
    assert_int_equal(sim_run(&t, SIM_LRU_K, &c, &lruk), 0);
    assert_int_equal(sim_run(&t, SIM_ADAPTIVE, &c, &adaptive), 0);
    assert_true(adaptive.hits_device + 100 >= reuse.hits_device);
    assert_true(adaptive.hits_device > lruk.hits_device + 400);
    sim_config k1 = c;
    k1.lru_k = 1;
    assert_int_equal(sim_run(&t, SIM_ADAPTIVE, &k1, &adaptive), 0);
    assert_int_equal(sim_run(&t, SIM_LRU, &c, &lru), 0);
    assert_int_equal(adaptive.hits_device, lru.hits_device); /* LRU-1 is LRU */
    trace_free(&t);

    recency_mix(&t, 4000);
    assert_int_equal(sim_run(&t, SIM_LRU, &c, &lru), 0);
    assert_int_equal(sim_run(&t, SIM_LRU_K, &c, &lruk), 0);
    assert_int_equal(sim_run(&t, SIM_REUSE, &c, &reuse), 0);
    assert_int_equal(sim_run(&t, SIM_ADAPTIVE, &c, &adaptive), 0);
    assert_true(lru.hits_device > lruk.hits_device + 3000);
    assert_true(adaptive.hits_device + 100 >= lru.hits_device);

    /* One mix after the other: it follows both ways. */
    trace both;
    trace_init(&both);
    for (size_t i = 0; i < t.n; i++)
        assert_int_equal(trace_add(&both, t.acc[i].seq, t.acc[i].index, 0, 0.5f), 0);
    trace_free(&t);
    reuse_mix(&t, 4000);
    for (size_t i = 0; i < t.n; i++)
        assert_int_equal(trace_add(&both, t.acc[i].seq + 10, t.acc[i].index, 0, 0.5f), 0);
    trace_free(&t);
    sim_result parts[2];
    recency_mix(&t, 4000);
    assert_int_equal(sim_run(&t, SIM_LRU, &c, &parts[0]), 0);
    trace_free(&t);
    reuse_mix(&t, 4000);
    assert_int_equal(sim_run(&t, SIM_REUSE, &c, &parts[1]), 0);
    trace_free(&t);
    assert_int_equal(sim_run(&both, SIM_ADAPTIVE, &c, &adaptive), 0);
    assert_true(adaptive.hits_device + 400 >= parts[0].hits_device + parts[1].hits_device);
    assert_int_equal(sim_run(&both, SIM_LRU_K, &c, &lruk), 0);
    assert_int_equal(sim_run(&both, SIM_LRU, &c, &lru), 0);
    assert_true(adaptive.hits_device > lruk.hits_device && adaptive.hits_device > lru.hits_device);
    trace_free(&both);
}

static void test_host_tier_catches_device_victims(void **state)
{
    (void)state;
    /* 0 1 2 0 1 2 with a device of 1 and a host of 2: every re-access is a
     * host hit under LRU, and each one moves a block up and one down. */
    uint32_t seq[] = {0, 1, 2, 0, 1, 2};
    trace t;
    build(&t, seq, 6);
    sim_config c;
    sim_config_defaults(&c, 1, 2);
    sim_result res;
    assert_int_equal(sim_run(&t, SIM_LRU, &c, &res), 0);
    assert_int_equal(res.hits_device, 0);
    assert_int_equal(res.hits_host, 3);
    assert_int_equal(res.misses, 3);
    assert_int_equal(res.up_dh, 3);
    assert_int_equal(res.down_dh, 5);
    assert_int_equal(res.up_sh + res.down_sh, 0);
    trace_free(&t);
}

static void test_hysteresis_serves_cold_blocks_in_place(void **state)
{
    (void)state;
    /* Device of 2 holding hot 0 and 1; block 9 comes back from the host
     * once, long after its first use: with hysteresis it is read in place
     * and the device keeps the hot pair. */
    uint32_t seq[40];
    size_t n = 0;
    seq[n++] = 9;
    for (int i = 0; i < 15; i++) {
        seq[n++] = 0;
        seq[n++] = 1;
    }
    seq[n++] = 9;
    seq[n++] = 0;
    seq[n++] = 1;
    trace t;
    build(&t, seq, n);
    sim_config c;
    sim_config_defaults(&c, 2, 4);
    c.hyst_window = 8;
    sim_result plain, hyst;
    assert_int_equal(sim_run(&t, SIM_LRU_K, &c, &plain), 0);
    assert_int_equal(sim_run(&t, SIM_LRU_K_HYST, &c, &hyst), 0);
    assert_int_equal(hyst.hits_host, 1);
    assert_int_equal(hyst.hits_device, plain.hits_device + 1);
    assert_true(hyst.down_dh < plain.down_dh);
    trace_free(&t);
}

static void test_lctru_prefers_tolerant_blocks(void **state)
{
    (void)state;
    /* Device of 2: 0 (tolerance 0.9) and 1 (0.1) then 2: LRU evicts 0 (least
     * recent), LCTRU evicts 1 (least tolerable) when both are in its
     * window; the next access to 0 tells them apart. */
    trace t;
    trace_init(&t);
    assert_int_equal(trace_add(&t, 0, 0, 0, 0.9f), 0);
    assert_int_equal(trace_add(&t, 0, 1, 0, 0.1f), 0);
    assert_int_equal(trace_add(&t, 0, 2, 0, 0.5f), 0);
    assert_int_equal(trace_add(&t, 0, 0, 0, 0.9f), 0);
    sim_config c;
    sim_config_defaults(&c, 2, 0);
    sim_result lru, lctru;
    assert_int_equal(sim_run(&t, SIM_LRU, &c, &lru), 0);
    assert_int_equal(sim_run(&t, SIM_LCTRU, &c, &lctru), 0);
    assert_int_equal(lru.hits_device, 0);
    assert_int_equal(lctru.hits_device, 1);
    trace_free(&t);
}

/* Random hints (what a scheduler might say, right or wrong) never let the
 * hinted policy beat MIN, with or without promotion (hits then counted by
 * fetches). */
static void test_min_bounds_hinted_policies(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(14)};
    for (int round = 0; round < 30; round++) {
        trace t;
        trace_init(&t);
        uint32_t distinct = 50 + (uint32_t)tu_below(&r, 300);
        for (size_t i = 0; i < 3000; i++) {
            if (tu_below(&r, 8) == 0) {
                uint32_t first = (uint32_t)tu_below(&r, distinct);
                assert_int_equal(
                    trace_add_hint(&t, first % 3, first, 1 + (uint32_t)tu_below(&r, 6), (int32_t)tu_below(&r, 20) - 10),
                    0);
            }
            uint32_t b = tu_below(&r, 2) ? (uint32_t)tu_below(&r, distinct / 5 + 1) : (uint32_t)tu_below(&r, distinct);
            assert_int_equal(trace_add(&t, b % 3, b, 0, 0.5f), 0);
        }
        uint32_t dev = 1 + (uint32_t)tu_below(&r, 60), host = (uint32_t)tu_below(&r, 120);
        sim_config c;
        sim_config_defaults(&c, dev, host);
        sim_result opt;
        assert_int_equal(sim_min(&t, &c, &opt), 0);
        /* Advice, a prefetch at every hint, a window of prefetches. */
        for (int promote = 0; promote < 3; promote++) {
            c.hint_promote = promote > 0;
            c.prefetch_ahead = promote == 2 ? 1 + (uint32_t)tu_below(&r, 8) : 0;
            sim_result res;
            assert_int_equal(sim_run(&t, SIM_LRU_K_HINTS, &c, &res), 0);
            assert_int_equal(res.hits_device + res.hits_host + res.misses, t.n);
            assert_true(res.hits_device <= opt.hits_device);
            assert_true(res.hits_device + res.hits_host <= opt.hits_device + opt.hits_host);
            assert_true(res.up_dh + res.up_sh >= opt.up_dh + opt.up_sh);
        }
        trace_free(&t);
    }
}

/* A loop of 10 blocks through 5 device slots: LRU never hits, MIN keeps 4
 * blocks and hits on them every pass. A scheduler that hints each pass
 * (earlier blocks sooner) gets MIN's hits with the engine's rule: a block
 * just read is unhinted until the next pass, so it leaves first. */
static void test_hints_turn_a_loop_into_min(void **state)
{
    (void)state;
    trace t;
    trace_init(&t);
    for (int pass = 0; pass < 20; pass++) {
        for (uint32_t i = 0; i < 10; i++)
            assert_int_equal(trace_add_hint(&t, 0, i, 1, 100 - (int32_t)i), 0);
        for (uint32_t i = 0; i < 10; i++)
            assert_int_equal(trace_add(&t, 0, i, 0, 0.5f), 0);
    }
    sim_config c;
    sim_config_defaults(&c, 5, 0);
    sim_result lru, lruk, hinted, opt;
    assert_int_equal(sim_run(&t, SIM_LRU, &c, &lru), 0);
    assert_int_equal(sim_run(&t, SIM_LRU_K, &c, &lruk), 0);
    assert_int_equal(sim_run(&t, SIM_LRU_K_HINTS, &c, &hinted), 0);
    assert_int_equal(sim_min(&t, &c, &opt), 0);
    assert_int_equal(lru.hits_device, 0);
    assert_true(lruk.hits_device < opt.hits_device / 2);
    /* MIN with bypass keeps 4 of the 10 plus one that rotates: within one
     * hit per pass of it. */
    assert_true(hinted.hits_device + 20 >= opt.hits_device);
    assert_true(hinted.hits_device >= 4 * 19);
    trace_free(&t);
}

/* Without hints a window of prefetches names nothing: every count equals
 * the run that only advises. */
static void test_prefetch_window_moves_nothing_unnamed(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(15)};
    trace t;
    random_trace(&t, &r, 4000, 200);
    sim_config c;
    sim_config_defaults(&c, 20, 40);
    sim_result advice, window;
    assert_int_equal(sim_run(&t, SIM_LRU_K_HINTS, &c, &advice), 0);
    c.hint_promote = 1;
    c.prefetch_ahead = 3;
    assert_int_equal(sim_run(&t, SIM_LRU_K_HINTS, &c, &window), 0);
    assert_memory_equal(&advice, &window, sizeof(advice));
    trace_free(&t);
}

/* One device slot holds b, hinted sooner than a: the window reaches a
 * (named, later) before b's access, and must not trade b for it. */
static void test_prefetch_window_spares_a_block_hinted_sooner(void **state)
{
    (void)state;
    trace t;
    trace_init(&t);
    assert_int_equal(trace_add(&t, 0, 0, 0, 0.5f), 0); /* a */
    assert_int_equal(trace_add(&t, 0, 1, 0, 0.5f), 0); /* b: a goes to the host tier */
    assert_int_equal(trace_add_hint(&t, 0, 1, 1, 10), 0);
    assert_int_equal(trace_add_hint(&t, 0, 0, 1, 5), 0);
    assert_int_equal(trace_add(&t, 0, 1, 0, 0.5f), 0);
    assert_int_equal(trace_add(&t, 0, 0, 0, 0.5f), 0);
    sim_config c;
    sim_config_defaults(&c, 1, 2);
    sim_result advice, window;
    assert_int_equal(sim_run(&t, SIM_LRU_K_HINTS, &c, &advice), 0);
    c.hint_promote = 1;
    c.prefetch_ahead = 1;
    assert_int_equal(sim_run(&t, SIM_LRU_K_HINTS, &c, &window), 0);
    assert_int_equal(advice.hits_device, 1);
    assert_int_equal(window.hits_device, 1);
    assert_int_equal(window.up_dh, advice.up_dh);
    trace_free(&t);
}

/* A hint's range is what exists of it: one of 2^32 - 1 blocks costs no
 * more than the blocks of its sequence (it took minutes a hint), and
 * advises, prefetches and fills the window as a hint of just them does. */
static void test_a_hint_of_any_length_costs_only_its_blocks(void **state)
{
    (void)state;
    trace huge, exact;
    trace_init(&huge);
    trace_init(&exact);
    for (int round = 0; round < 50; round++)
        for (uint32_t i = 0; i < 4; i++) {
            assert_int_equal(trace_add_hint(&huge, 0, 0, UINT32_MAX, 100 - (int32_t)i), 0);
            assert_int_equal(trace_add_hint(&exact, 0, 0, 4, 100 - (int32_t)i), 0);
            assert_int_equal(trace_add(&huge, 0, 3 - i, 0, 0.5f), 0);
            assert_int_equal(trace_add(&exact, 0, 3 - i, 0, 0.5f), 0);
        }
    sim_config c;
    sim_config_defaults(&c, 1, 1);
    alarm(60); /* the whole test takes milliseconds; without the bound, hours */
    for (int promote = 0; promote < 3; promote++) {
        c.hint_promote = promote > 0;
        c.prefetch_ahead = promote == 2 ? 1 : 0;
        sim_result a, b;
        assert_int_equal(sim_run(&huge, SIM_LRU_K_HINTS, &c, &a), 0);
        assert_int_equal(sim_run(&exact, SIM_LRU_K_HINTS, &c, &b), 0);
        assert_memory_equal(&a, &b, sizeof(a));
    }
    alarm(0);
    trace_free(&huge);
    trace_free(&exact);
}

/* A range that reaches index 2^32 - 1 ends there: it does not wrap to
 * name index 0. b = (0, 2^32 - 1) is hinted, a = (0, 0) is not, so a
 * new block takes a's device slot and b is hit. */
static void test_a_hint_range_does_not_wrap(void **state)
{
    (void)state;
    for (uint32_t n = 1; n <= 2; n++) {
        trace t;
        trace_init(&t);
        assert_int_equal(trace_add(&t, 0, UINT32_MAX, 0, 0.5f), 0); /* b */
        assert_int_equal(trace_add(&t, 0, 0, 0, 0.5f), 0);          /* a */
        assert_int_equal(trace_add_hint(&t, 0, UINT32_MAX, n, 10), 0);
        assert_int_equal(trace_add(&t, 1, 0, 0, 0.5f), 0);
        assert_int_equal(trace_add(&t, 0, UINT32_MAX, 0, 0.5f), 0);
        sim_config c;
        sim_config_defaults(&c, 2, 0);
        sim_result r;
        assert_int_equal(sim_run(&t, SIM_LRU_K_HINTS, &c, &r), 0);
        assert_int_equal(r.hits_device, 1);
        trace_free(&t);
    }
}

/* On a causal-queue trace at small device budgets, prefetching every
 * hinted block at once (four requests ahead) displaces what demand
 * fetching keeps; a window of two reads keeps advice's hits. */
static void test_prefetch_window_keeps_advice_hits(void **state)
{
    (void)state;
    trace t;
    tt_queue_trace(&t, 0, 0, 4);
    for (uint32_t pct = 5; pct <= 10; pct += 5) {
        sim_config c;
        sim_config_defaults(&c, t.n_blocks * pct / 100, 2 * (t.n_blocks * pct / 100));
        sim_result advice, at_hint, window;
        assert_int_equal(sim_run(&t, SIM_LRU_K_HINTS, &c, &advice), 0);
        c.hint_promote = 1;
        assert_int_equal(sim_run(&t, SIM_LRU_K_HINTS, &c, &at_hint), 0);
        c.prefetch_ahead = 2;
        assert_int_equal(sim_run(&t, SIM_LRU_K_HINTS, &c, &window), 0);
        assert_true(window.hits_device >= advice.hits_device);
        assert_true((double)at_hint.hits_device < 0.8 * (double)advice.hits_device);
    }
    trace_free(&t);
}

static void test_trace_ids_and_file_round_trip(void **state)
{
    (void)state;
    trace t;
    trace_init(&t);
    assert_int_equal(trace_add(&t, 7, 0, 1, 0.25f), 0);
    assert_int_equal(trace_add(&t, 7, 1, 1, 0.75f), 0);
    assert_int_equal(trace_add(&t, 3, 0, 2, 0.5f), 0);
    assert_int_equal(trace_add_hint(&t, 7, 0, 2, -5), 0); /* before access 3 */
    assert_int_equal(trace_add(&t, 7, 0, 2, 0.9f), 0);    /* tolerance kept from first use */
    assert_int_equal(trace_find(&t, 7, 1), 1);
    assert_int_equal(trace_find(&t, 7, 2), -1);
    assert_int_equal(t.n_blocks, 3);
    assert_int_equal(t.acc[3].block, 0);
    assert_true(t.tolerance[0] == 0.25f);
    assert_int_equal(trace_count_seqs(&t), 2);

    const char *dir = getenv("KVH_TEST_TMPDIR");
    char path[4096];
    snprintf(path, sizeof(path), "%s/round.trace", dir && *dir ? dir : "/tmp");
    assert_int_equal(trace_save(&t, path), 0);
    trace back;
    trace_init(&back);
    char err[256];
    assert_int_equal(trace_load(&back, path, err, sizeof(err)), 0);
    assert_int_equal(back.n, t.n);
    assert_int_equal(back.n_blocks, t.n_blocks);
    for (size_t i = 0; i < t.n; i++) {
        assert_int_equal(back.acc[i].block, t.acc[i].block);
        assert_int_equal(back.acc[i].agent, t.acc[i].agent);
    }
    assert_int_equal(back.n_hints, 1);
    assert_int_equal(back.hints[0].at, 3);
    assert_int_equal(back.hints[0].seq, 7);
    assert_int_equal(back.hints[0].first, 0);
    assert_int_equal(back.hints[0].n, 2);
    assert_int_equal(back.hints[0].priority, -5);
    trace_free(&back);

    /* Malformed lines are refused with their line number. */
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs("# ok\n1 2\n1 x\n", f);
    fclose(f);
    trace_init(&back);
    assert_int_equal(trace_load(&back, path, err, sizeof(err)), -1);
    assert_non_null(strstr(err, ":3:"));
    trace_free(&back);
    f = fopen(path, "w");
    assert_non_null(f);
    fputs("1 2\nhint 1 2 3\n", f);
    fclose(f);
    trace_init(&back);
    assert_int_equal(trace_load(&back, path, err, sizeof(err)), -1);
    assert_non_null(strstr(err, ":2: expected 'hint"));
    trace_free(&back);
    trace_free(&t);
}

static void test_demo_trace_format(void **state)
{
    (void)state;
    /* `kvh demo --record-trace` lines: the block handle names the block,
     * prefetches are not accesses, hints name blocks already seen. */
    const char *dir = getenv("KVH_TEST_TMPDIR");
    char path[4096];
    snprintf(path, sizeof(path), "%s/demo.trace", dir && *dir ? dir : "/tmp");
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs("# kvh block-access trace v1 (kvh demo)\n"
          "# t_s\tagent\tseq\tblock_id\tblock_hash\ttier\tkind\n"
          "0.1\t0\t0x5a00000001\t0xb100000000\t579274910657938b\tdevice\tmatch\n"
          "0.2\t1\t0x5a00000002\t0xb100000000\t579274910657938b\tdevice\tmatch\n"
          "0.3\t1\t0x5a00000002\t0xc200000007\t0\thost\tprefetch\n"
          "0.31\t1\t0x5a00000002\t0xc200000007\t0\t-\thint\t-4\n" /* not accessed yet: skipped */
          "0.32\t1\t0x5a00000002\t0xb100000000\t0\t-\thint\t-5\n"
          "0.4\t2\t0x5a00000003\t0xc200000007\t0\thost\tdecode\n",
          f);
    fclose(f);
    trace t;
    trace_init(&t);
    char err[256];
    assert_int_equal(trace_load(&t, path, err, sizeof(err)), 0);
    assert_int_equal(t.n, 3);
    assert_int_equal(t.n_blocks, 2);
    assert_int_equal(t.acc[0].block, t.acc[1].block); /* shared through the prefix index */
    assert_int_equal(t.acc[2].agent, 2);
    assert_int_equal(t.acc[2].seq, t.acc[2].block);
    assert_int_equal(t.acc[2].index, 0);
    assert_int_equal(t.n_hints, 1);
    assert_int_equal(t.hints[0].seq, t.acc[0].block);
    assert_int_equal(t.hints[0].n, 1);
    assert_int_equal(t.hints[0].priority, -5);
    assert_int_equal(t.hints[0].at, 2);
    assert_int_equal(t.hints[0].block, t.acc[0].block);
    trace_free(&t);
}

/* Hint groups (the hints before one access, three per turn: system
 * prompt, document, session) in which a session is hinted twice; checks
 * that no group holds more than max_turns turns. */
static size_t count_repeated_sessions(const trace *t, size_t max_turns)
{
    size_t repeated = 0;
    for (size_t g = 0; g < t->n_hints;) {
        size_t end = g;
        while (end < t->n_hints && t->hints[end].at == t->hints[g].at)
            end++;
        assert_int_equal((end - g) % 3, 0);
        assert_true((end - g) / 3 <= max_turns);
        int dup = 0;
        for (size_t i = g + 2; i < end; i += 3)
            for (size_t k = i + 3; k < end; k += 3)
                dup |= t->hints[i].seq == t->hints[k].seq;
        repeated += (size_t)dup;
        g = end;
    }
    return repeated;
}

/* Causal queues hint only turns a scheduler can hold: never more than
 * queue_len turns (three hints each), never the same agent's next turn
 * before its current one has run (which the oracle does); the
 * accesses are those of the unhinted trace. Zipf and burst choices are
 * deterministic and skewed. */
static void test_causal_queue_hints(void **state)
{
    (void)state;
    trace_gen_params p;
    trace_gen_defaults(&p);
    p.turns = 12;
    trace plain, causal, oracle;
    trace_init(&plain);
    trace_init(&causal);
    trace_init(&oracle);
    assert_int_equal(trace_generate(&plain, &p), 0);
    p.queue_len = 8;
    assert_int_equal(trace_generate(&causal, &p), 0);
    p.queue_len = 0;
    p.hint_turns = 8;
    assert_int_equal(trace_generate(&oracle, &p), 0);
    assert_int_equal(causal.n, plain.n);
    assert_memory_equal(causal.acc, plain.acc, plain.n * sizeof(*plain.acc));
    /* Before each turn: at most queue_len turns, and no agent twice (its
     * later turn waits for the earlier one), which the oracle breaks. */
    assert_true(count_repeated_sessions(&causal, 8) == 0);
    assert_true(count_repeated_sessions(&oracle, 8) > 0);
    trace_free(&plain);
    trace_free(&causal);
    trace_free(&oracle);
    for (int choice = TRACE_AGENTS_ZIPF; choice <= TRACE_AGENTS_BURSTS; choice++) {
        trace a, b;
        trace_init(&a);
        trace_init(&b);
        trace_gen_defaults(&p);
        p.turns = 20;
        p.agent_choice = (trace_agent_choice)choice;
        p.queue_len = 4;
        assert_int_equal(trace_generate(&a, &p), 0);
        assert_int_equal(trace_generate(&b, &p), 0);
        assert_int_equal(a.n, b.n);
        assert_memory_equal(a.acc, b.acc, a.n * sizeof(*a.acc));
        /* Agent 0 is the most popular: more turns than the last one. */
        size_t first = 0, last = 0;
        for (size_t i = 0; i < a.n; i++) {
            first += a.acc[i].agent == 0;
            last += a.acc[i].agent == p.agents - 1;
        }
        assert_true(first > 2 * last);
        trace_free(&a);
        trace_free(&b);
    }
}

static void test_generator_is_deterministic(void **state)
{
    (void)state;
    trace_gen_params p;
    trace_gen_defaults(&p);
    p.turns = 10;
    trace a, b, adv;
    trace_init(&a);
    trace_init(&b);
    trace_init(&adv);
    assert_int_equal(trace_generate(&a, &p), 0);
    assert_int_equal(trace_generate(&b, &p), 0);
    assert_int_equal(a.n, b.n);
    assert_memory_equal(a.acc, b.acc, a.n * sizeof(*a.acc));
    /* Every agent reads the shared system prompt (sequence 0) each turn. */
    size_t system_reads = 0;
    for (size_t i = 0; i < a.n; i++)
        system_reads += a.acc[i].seq == 0;
    assert_int_equal(system_reads, (size_t)p.agents * p.turns * p.system_blocks);
    p.adversarial = 1;
    assert_int_equal(trace_generate(&adv, &p), 0);
    uint32_t max_agent = 0;
    for (size_t i = 0; i < adv.n; i++)
        if (adv.acc[i].agent > max_agent)
            max_agent = adv.acc[i].agent;
    assert_int_equal(max_agent, p.agents); /* one more agent */
    assert_true(adv.n_blocks > a.n_blocks);
    /* Hints leave the accesses as they were: before each turn, three
     * hints (system prompt, document, history) per queued turn. */
    trace hinted;
    trace_init(&hinted);
    p.adversarial = 0;
    p.hint_turns = 3;
    assert_int_equal(trace_generate(&hinted, &p), 0);
    assert_int_equal(hinted.n, a.n);
    assert_memory_equal(hinted.acc, a.acc, a.n * sizeof(*a.acc));
    size_t turns = (size_t)p.agents * p.turns;
    assert_int_equal(hinted.n_hints, 3 * (3 * turns - 3)); /* the last two turns see fewer queued */
    assert_int_equal(hinted.hints[0].at, 0);
    assert_int_equal(hinted.hints[0].seq, 0);
    assert_int_equal(hinted.hints[0].n, p.system_blocks);
    assert_true(hinted.hints[0].priority > hinted.hints[3].priority); /* sooner turn ranks higher */
    /* On it, the hinted rule is near MIN where LRU-2 is far from it. */
    sim_config c;
    sim_config_defaults(&c, hinted.n_blocks / 10, hinted.n_blocks / 5);
    sim_result lruk, hints, opt;
    assert_int_equal(sim_run(&hinted, SIM_LRU_K, &c, &lruk), 0);
    assert_int_equal(sim_run(&hinted, SIM_LRU_K_HINTS, &c, &hints), 0);
    assert_int_equal(sim_min(&hinted, &c, &opt), 0);
    assert_true(hints.hits_device > lruk.hits_device);
    assert_true((double)hints.hits_device >= 0.85 * (double)opt.hits_device);
    trace_free(&hinted);
    trace_free(&a);
    trace_free(&b);
    trace_free(&adv);
}

/* The adaptive twin against the better of LRU and LRU-2 on the four
 * generated families of `kvh-bench trace` (seed 1, every budget), as
 * device hits over MIN's. A follower cannot reach the better order on
 * every row (it pays the accesses before a lead shows and a switch's
 * turnover: benchmarks/RESULTS.md), so the bounds are what the chooser
 * reaches, with room for one more switch: no row far below, a small sum,
 * and the protected-reuse order's lead at 5 %. A default that never
 * switches misses by 0.08 (agents 30 %); one without the reuse order
 * loses the lead at 5 %. */
static void test_adaptive_near_the_better_order_on_generated_traces(void **state)
{
    (void)state;
    static const struct {
        trace_agent_choice choice;
        int adversarial;
    } families[] = {
        {TRACE_AGENTS_ROUNDS, 0}, {TRACE_AGENTS_ROUNDS, 1}, {TRACE_AGENTS_ZIPF, 0}, {TRACE_AGENTS_BURSTS, 1}};
    static const uint32_t pcts[] = {5, 10, 20, 30, 50};
    double summed = 0;
    for (size_t f = 0; f < sizeof(families) / sizeof(families[0]); f++) {
        trace_gen_params p;
        trace_gen_defaults(&p);
        p.agents = 8;
        p.turns = 60;
        p.queue_len = 4;
        p.seed = 1;
        p.agent_choice = families[f].choice;
        p.adversarial = families[f].adversarial;
        trace t;
        trace_init(&t);
        assert_int_equal(trace_generate(&t, &p), 0);
        for (size_t i = 0; i < sizeof(pcts) / sizeof(pcts[0]); i++) {
            uint32_t dev = (uint32_t)((uint64_t)t.n_blocks * pcts[i] / 100);
            sim_config c;
            sim_config_defaults(&c, dev, 2 * dev);
            sim_result lru, lruk, adaptive;
            assert_int_equal(sim_run(&t, SIM_LRU, &c, &lru), 0);
            assert_int_equal(sim_run(&t, SIM_LRU_K, &c, &lruk), 0);
            assert_int_equal(sim_run(&t, SIM_ADAPTIVE, &c, &adaptive), 0);
            uint64_t opt = sim_min_hits(&t, dev);
            assert_true(opt > 0 && opt != UINT64_MAX);
            double better =
                (double)(lru.hits_device > lruk.hits_device ? lru.hits_device : lruk.hits_device) / (double)opt;
            double ours = (double)adaptive.hits_device / (double)opt;
            assert_true(ours > better - 0.012);
            summed += better > ours ? better - ours : 0;
            /* Where the tier is small, protected reuse leads both (the
             * bursts family, LRU leads at 5 %). */
            if (pcts[i] == 5 && f < 3)
                assert_true(ours > better + 0.02);
        }
        trace_free(&t);
    }
    assert_true(summed < 0.035);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_min_is_exact_on_tiny_traces),
        cmocka_unit_test(test_min_bounds_every_policy),
        cmocka_unit_test(test_min_is_monotone_in_capacity),
        cmocka_unit_test(test_loop_defeats_lru_not_min),
        cmocka_unit_test(test_lru_k_resists_a_scan),
        cmocka_unit_test(test_reuse_protects_shared_pairs),
        cmocka_unit_test(test_adaptive_follows_the_best_order),
        cmocka_unit_test(test_adaptive_near_the_better_order_on_generated_traces),
        cmocka_unit_test(test_host_tier_catches_device_victims),
        cmocka_unit_test(test_hysteresis_serves_cold_blocks_in_place),
        cmocka_unit_test(test_lctru_prefers_tolerant_blocks),
        cmocka_unit_test(test_min_bounds_hinted_policies),
        cmocka_unit_test(test_hints_turn_a_loop_into_min),
        cmocka_unit_test(test_prefetch_window_moves_nothing_unnamed),
        cmocka_unit_test(test_prefetch_window_spares_a_block_hinted_sooner),
        cmocka_unit_test(test_prefetch_window_keeps_advice_hits),
        cmocka_unit_test(test_a_hint_of_any_length_costs_only_its_blocks),
        cmocka_unit_test(test_a_hint_range_does_not_wrap),
        cmocka_unit_test(test_trace_ids_and_file_round_trip),
        cmocka_unit_test(test_demo_trace_format),
        cmocka_unit_test(test_generator_is_deterministic),
        cmocka_unit_test(test_causal_queue_hints),
    };
    return cmocka_run_group_tests_name("policy_sim", tests, NULL, NULL);
}
