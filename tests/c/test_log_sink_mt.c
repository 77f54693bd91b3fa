/* A log sink that calls back into the engine that logs (core/status.c).
 * The sink is user code run by kvh: on a thread kvh started it must not
 * be able to wait for that thread, and nowhere may it free the engine kvh
 * returns into. Here a damaged disk block makes the engine log, on a
 * migration worker (an asynchronous migrate) or on the caller's own thread
 * (no workers), and the sink tries to close the engine and to call it. */
#include "disk_test_util.h"

#include <pthread.h>
#include <stdatomic.h>

static const dt_geo G = {2, 1, 32, 16, KVH_DTYPE_F16}; /* block = 4096 bytes */
enum { BLOCKS = 2 };

/* What the sink saw and got, on its first call. */
typedef struct sink_state {
    kvh_engine *engine; /* the engine that logs */
    kvh_engine *other;  /* another engine, which the sink may always call */
    pthread_t caller;
    atomic_int calls;
    atomic_int done; /* the first call has returned */
    bool on_caller;
    kvh_status close_st, stats_st, tier_st, other_st;
} sink_state;

static sink_state S;

static void sink(void *user, int32_t level, const char *message)
{
    (void)user;
    (void)level;
    (void)message;
    if (atomic_fetch_add(&S.calls, 1))
        return;
    S.on_caller = pthread_equal(pthread_self(), S.caller);
    S.close_st = kvh_engine_close(S.engine);
    kvh_stats st = {.struct_size = sizeof(st)};
    S.stats_st = kvh_engine_stats(S.engine, &st);
    kvh_tier_info ti = {.struct_size = sizeof(ti)};
    S.tier_st = kvh_tier_info_get(S.engine, KVH_TIER_HOST, &ti);
    kvh_stats ost = {.struct_size = sizeof(ost)};
    S.other_st = kvh_engine_stats(S.other, &ost);
    atomic_store(&S.done, 1);
}

/* A store in dir holding BLOCKS persisted blocks of c, each with one byte
 * of its data flipped, so that reading any of them back logs. */
static void damaged_store(const char *dir, dt_content c)
{
    kvh_config cfg = dt_cfg(G, dir, 4, 4, 16, 0);
    kvh_engine *e = dt_open_a(&cfg);
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, c, BLOCKS * G.bt, 0, &s));
    dt_assert_ok(kvh_seq_persist(e, s));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
    char slab[PATH_MAX + 32];
    dt_path(slab, sizeof(slab), dir, "slab-0000.kvh");
    for (uint64_t k = 0; k < 16; k++) {
        size_t len = 0;
        free(dt_read_file(slab, &len));
        uint64_t off = k * dt_slot_bytes(G) + 4096 + 100;
        if (off < len)
            assert_int_equal(dt_flip_bit(slab, off, 3), 0);
    }
}

/* Opens the damaged store with the sink and moves its blocks to the host
 * tier, which reads them back (and logs): on a worker when threads > 0. */
static void run_case(const char *name, uint32_t threads)
{
    char dir[PATH_MAX];
    dt_scratch(name, dir, sizeof(dir));
    dt_content c = dt_plain(11);
    damaged_store(dir, c);

    kvh_config oc = dt_cfg(G, NULL, 4, 4, 0, 0);
    memset(&S, 0, sizeof(S));
    S.caller = pthread_self();
    S.close_st = S.stats_st = S.tier_st = S.other_st = (kvh_status)-9999;
    S.other = dt_open_a(&oc);
    kvh_config cfg = dt_cfg(G, dir, 4, 4, 16, threads);
    cfg.log_fn = sink;
    cfg.log_level = KVH_LOG_WARN;
    S.engine = dt_open_a(&cfg);

    int32_t tk[BLOCKS * 16];
    dt_tokens(c, 0, BLOCKS * G.bt, tk);
    kvh_block h[BLOCKS];
    size_t n = 0;
    dt_assert_ok(kvh_prefix_lookup(S.engine, tk, BLOCKS * G.bt, h, BLOCKS, &n));
    assert_int_equal(n, BLOCKS);
    kvh_fence f;
    dt_assert_ok(kvh_migrate(S.engine, h, n, KVH_TIER_HOST, &f));
    dt_assert_kvh(KVH_ERR_CORRUPT, kvh_fence_wait(S.engine, f, 10ull * 1000000000ull));
    dt_assert_ok(kvh_fence_free(S.engine, f));
    for (size_t i = 0; i < n; i++)
        dt_assert_ok(kvh_block_release(S.engine, h[i]));

    /* A worker's sink runs after the fence it logs about is done. */
    for (double t0 = dt_now(); !atomic_load(&S.done);) {
        if (dt_now() - t0 > 10.0)
            fail_msg("the sink did not return within 10 s");
        dt_sleep_ms(1);
    }
    assert_int_equal(S.on_caller, threads == 0);
    /* Never closed from inside its own sink; the other engine always works. */
    dt_assert_kvh(KVH_ERR_BUSY, S.close_st);
    dt_assert_kvh(KVH_OK, S.other_st);
    /* On a worker every call into it is refused; on the caller's thread
     * they work. */
    kvh_status expected = threads ? KVH_ERR_BUSY : KVH_OK;
    dt_assert_kvh(expected, S.stats_st);
    dt_assert_kvh(expected, S.tier_st);

    /* The engine outlived its sink and still works; it closes from here. */
    kvh_stats st = {.struct_size = sizeof(st)};
    dt_assert_ok(kvh_engine_stats(S.engine, &st));
    assert_true(st.corrupt_blocks >= 1);
    dt_assert_ok(dt_close(S.engine));
    dt_assert_ok(dt_close(S.other));
}

static void test_sink_on_a_worker(void **state)
{
    (void)state;
    run_case("sink_worker", 1);
}

static void test_sink_on_the_callers_thread(void **state)
{
    (void)state;
    run_case("sink_caller", 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_sink_on_a_worker, dt_teardown),
        cmocka_unit_test_teardown(test_sink_on_the_callers_thread, dt_teardown),
    };
    return cmocka_run_group_tests_name("log_sink", tests, NULL, NULL);
}
