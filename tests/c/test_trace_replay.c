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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_window_matches_the_simulator),
        cmocka_unit_test(test_window_spares_the_acquires_their_waits),
        cmocka_unit_test(test_window_beyond_the_trace_prefetches_nothing),
    };
    return cmocka_run_group_tests_name("trace_replay", tests, NULL, NULL);
}
