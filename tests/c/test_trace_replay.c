/* benchmarks/trace_replay.h: the engine replay behind `kvh-bench trace`,
 * here its prefetch window (prefetch_ahead) and the acquires it counts as
 * waiting, against the simulator's twin (policy_sim.h). */
#include "test_util.h"

#include <stdlib.h>

#include "benchmarks/policy_sim.h"
#include "benchmarks/trace.h"
#include "benchmarks/trace_gen.h"
#include "benchmarks/trace_replay.h"
#include "trace_test_util.h"

static const char *scratch(void)
{
    const char *dir = getenv("KVH_TEST_TMPDIR");
    return dir && *dir ? dir : "/tmp";
}

/* A causal-queue trace, small enough to replay in a moment. */
static void queue_trace(trace *t) { tt_queue_trace(t, 4, 12, 4); }

static replay_result replay(const trace *t, uint32_t dev, int hints, uint32_t ahead)
{
    replay_config c = {.device_blocks = dev,
                       .host_blocks = 2 * dev,
                       .disk_dir = scratch(),
                       .lru_k_order = 1,
                       .hints = hints,
                       .prefetch_ahead = ahead};
    replay_result r;
    assert_int_equal(trace_replay(t, &c, &r), 0);
    return r;
}

/* The engine and the simulated lru-k+prefetch take the same window: the
 * same fetches, so the same hits, with and without it. */
static void test_window_matches_the_simulator(void **state)
{
    (void)state;
    trace t;
    queue_trace(&t);
    uint32_t dev = t.n_blocks / 10;
    for (uint32_t ahead = 0; ahead <= 3; ahead += 3) {
        replay_result r = replay(&t, dev, 2, ahead);
        sim_config c;
        sim_config_defaults(&c, dev, 2 * dev);
        c.hint_promote = 1;
        c.prefetch_ahead = ahead;
        sim_result s;
        assert_int_equal(sim_run(&t, SIM_LRU_K_HINTS, &c, &s), 0);
        assert_int_equal(r.sim.up_dh, s.up_dh);
        assert_int_equal(r.sim.hits_device, s.hits_device);
    }
    trace_free(&t);
}

/* Advice makes acquires wait for their moves; a window of two reads
 * serves nearly all of them before the acquire. On the benchmark's agents
 * trace at a 5 % tier it also fetches no more than advice (fewer here);
 * on much smaller tiers it can fetch more (benchmarks/RESULTS.md). */
static void test_window_spares_the_acquires_their_waits(void **state)
{
    (void)state;
    trace t;
    tt_queue_trace(&t, 0, 0, 4);
    uint32_t dev = t.n_blocks * 5 / 100;
    replay_result advice = replay(&t, dev, 1, 0);
    replay_result window = replay(&t, dev, 2, 2);
    assert_true(advice.waits > t.n / 4);
    assert_true(window.waits * 100 < advice.waits);
    assert_true(window.sim.hits_device >= advice.sim.hits_device);
    trace_free(&t);
}

/* A window past the trace's end names nothing: hints stay advice and
 * every count equals the advice replay's. */
static void test_window_beyond_the_trace_prefetches_nothing(void **state)
{
    (void)state;
    trace t;
    queue_trace(&t);
    uint32_t dev = t.n_blocks / 10;
    replay_result advice = replay(&t, dev, 1, 0);
    replay_result none = replay(&t, dev, 2, (uint32_t)t.n + 1);
    assert_int_equal(none.waits, advice.waits);
    assert_int_equal(none.sim.up_dh, advice.sim.up_dh);
    assert_int_equal(none.sim.down_dh, advice.sim.down_dh);
    assert_int_equal(none.sim.up_sh, advice.sim.up_sh);
    trace_free(&t);
}

/* Sequence ids are any 32-bit values, hints to them included: the
 * replay's per-sequence state goes by dense ids, not by the ids' values
 * (2^32 - 1 wrapped its count to 0). */
static void test_any_sequence_id_replays(void **state)
{
    (void)state;
    static const uint32_t seqs[3] = {UINT32_MAX, 4000000000u, 0};
    trace t;
    trace_init(&t);
    for (int round = 0; round < 3; round++)
        for (int s = 0; s < 3; s++) {
            assert_int_equal(trace_add_hint(&t, seqs[(s + 1) % 3], 0, 2, 5 - s), 0);
            assert_int_equal(trace_add(&t, seqs[s], (uint32_t)round % 2, 0, 0.5f), 0);
        }
    for (int hints = 0; hints <= 2; hints++) {
        replay_result r = replay(&t, 4, hints, hints == 2 ? 1 : 0);
        assert_int_equal(r.sim.accesses, t.n);
        assert_int_equal(r.sim.first_accesses, 6);
        assert_int_equal(r.sim.hits_device + r.sim.hits_host + r.sim.misses, t.n);
    }
    trace_free(&t);
}

/* A first access appends the blocks below it that the trace never names:
 * the disk tier has room for all of them, not only for the blocks named
 * (two here, of the 301 appended). */
static void test_a_sparse_index_fits_the_disk_tier(void **state)
{
    (void)state;
    trace t;
    trace_init(&t);
    for (int i = 0; i < 4; i++)
        assert_int_equal(trace_add(&t, 0, i % 2 ? 300 : 0, 0, 0.5f), 0);
    replay_result r = replay(&t, 4, 0, 0);
    assert_int_equal(r.sim.accesses, 4);
    assert_int_equal(r.sim.first_accesses, 2);
    trace_free(&t);
}

/* An index far past what the trace reads ("0 4000000000") would append
 * billions of blocks no access names, for hours: refused up front. */
static void test_an_index_far_past_the_accesses_is_refused(void **state)
{
    (void)state;
    trace t;
    trace_init(&t);
    for (int i = 0; i < 3; i++)
        assert_int_equal(trace_add(&t, 0, i == 1 ? 4000000000u : 0, 0, 0.5f), 0);
    assert_int_equal(trace_replay_blocks(&t), 4000000001ull);
    assert_false(trace_replay_fits(&t, trace_replay_blocks(&t)));
    replay_config c = {.device_blocks = 4, .host_blocks = 8, .disk_dir = scratch()};
    replay_result r;
    assert_int_equal(trace_replay(&t, &c, &r), 1);
    trace_free(&t);
    /* The sparse trace above (301 blocks for 4 accesses) still fits. */
    trace_init(&t);
    for (int i = 0; i < 4; i++)
        assert_int_equal(trace_add(&t, 0, i % 2 ? 300 : 0, 0, 0.5f), 0);
    assert_true(trace_replay_fits(&t, trace_replay_blocks(&t)));
    trace_free(&t);
}

/* Blocks first read out of index order are appended before their reads
 * and take tier room the simulators never give them: counted, so that the
 * bench can say its engine rows replay another workload there (it claimed
 * they equal the simulated ones), and each is acquired at its first read. */
static void test_blocks_read_out_of_index_order(void **state)
{
    (void)state;
    trace t;
    trace_init(&t);
    static const uint32_t order[] = {7, 5, 6, 3, 4, 1, 2, 0};
    for (int round = 0; round < 6; round++)
        for (int s = 0; s < 3; s++)
            for (size_t i = 0; i < sizeof(order) / sizeof(order[0]); i += 1 + (size_t)(round + s) % 2)
                assert_int_equal(trace_add(&t, (uint32_t)s, order[(i + (size_t)round) % 8], 0, 0.5f), 0);
    assert_int_equal(trace_replay_padded(&t), 3 * 7);
    replay_result r = replay(&t, 4, 0, 0);
    assert_int_equal(r.sim.accesses, t.n);
    assert_int_equal(r.sim.first_accesses, t.n_blocks);
    assert_int_equal(r.sim.hits_device + r.sim.hits_host + r.sim.misses, t.n);
    trace_free(&t);
    trace_init(&t);
    for (uint32_t i = 0; i < 5; i++)
        assert_int_equal(trace_add(&t, 9, i, 0, 0.5f), 0);
    assert_int_equal(trace_replay_padded(&t), 0);
    trace_free(&t);
}

/* Hint priorities span int32_t: INT32_MIN's queue turn (INT32_MAX minus
 * the priority, computed for every hint) is 2^32 - 1, without overflow.
 * The modes a recorded trace is replayed in: queue hints are the
 * generated traces' alone (trace_replay.h). */
static void test_the_lowest_hint_priority_replays(void **state)
{
    (void)state;
    trace t;
    trace_init(&t);
    assert_int_equal(trace_add(&t, 1, 0, 0, 0.5f), 0);
    assert_int_equal(trace_add_hint(&t, 1, 0, 1, INT32_MIN), 0);
    assert_int_equal(trace_add_hint(&t, 1, 0, 1, INT32_MAX), 0);
    assert_int_equal(trace_add(&t, 1, 0, 0, 0.5f), 0);
    for (int hints = 0; hints <= 2; hints++) {
        replay_result r = replay(&t, 4, hints, 0);
        assert_int_equal(r.sim.accesses, 2);
    }
    trace_free(&t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_window_matches_the_simulator),
        cmocka_unit_test(test_window_spares_the_acquires_their_waits),
        cmocka_unit_test(test_window_beyond_the_trace_prefetches_nothing),
        cmocka_unit_test(test_any_sequence_id_replays),
        cmocka_unit_test(test_a_sparse_index_fits_the_disk_tier),
        cmocka_unit_test(test_an_index_far_past_the_accesses_is_refused),
        cmocka_unit_test(test_the_lowest_hint_priority_replays),
        cmocka_unit_test(test_blocks_read_out_of_index_order),
    };
    return cmocka_run_group_tests_name("trace_replay", tests, NULL, NULL);
}
