/* Reliability battery, item 6 (concurrency part): kvh_engine_close racing
 * calls in flight on other threads. Runs under TSan too (label
 * concurrency).
 *
 * Each round opens an engine with a disk tier and 2 migration workers and
 * starts THREADS threads that call the API in a loop -- create, append +
 * write_kv, fork, read back, async acquire + fence_wait, migrate,
 * prefetch, persist, match_prefix, stats, tier info, free -- until a call
 * returns KVH_ERR_CLOSED. After a random 0-20 ms the main thread calls
 * kvh_engine_close. Checks:
 *
 *   - every status is a documented one, and one the call may return here
 *     (KVH_OK, KVH_ERR_NOSPACE, KVH_ERR_BUSY, KVH_ERR_CLOSED, and
 *     KVH_ERR_TIMEOUT for bounded fence waits); no data read back is wrong;
 *   - calls already inside the engine when close starts complete (close
 *     waits for them); calls that start later get KVH_ERR_CLOSED;
 *   - close returns KVH_OK within CLOSE_BOUND seconds;
 *   - the store reopens, every sequence whose persist returned KVH_OK and
 *     that was still alive at close is found byte for byte (one freed
 *     before close may have lost blocks to a full disk, never bytes), and
 *     the counters add up.
 *
 * The engine pointer is freed by close, so a thread must not make another
 * call after close returns (documented: like FILE *). To make the race
 * real yet defined, close is held at its first fsync (reached only after
 * it stopped accepting calls and waited for those in flight) until every
 * thread has seen KVH_ERR_CLOSED and left: the threads race the start of
 * close, never the free.
 *
 * 30 rounds in CI, 300 in test_rel_close_race_mt_stress
 * (KVH_REL_CLOSE_ROUNDS overrides).
 */
#include "rel_util.h"

#include "core/disk_io.h"

static const dt_geo G = {2, 1, 32, 16, KVH_DTYPE_F16};
#define THREADS 8
#define CLOSE_BOUND 10.0
#define MAX_ACKS 4096

static struct {
    pthread_t closer;
    atomic_int closing; /* the main thread is inside kvh_engine_close */
    atomic_int left;    /* threads that saw KVH_ERR_CLOSED and left */
    atomic_int gate_waits;
    pthread_mutex_t mu;
    dt_content acked[MAX_ACKS];
    size_t acked_len[MAX_ACKS];
    bool acked_freed[MAX_ACKS]; /* its sequence was freed before close */
    int n_acked;
    long freed_acks_short; /* freed, then partly dropped for room */
    atomic_long calls, closed_calls, completed_while_closing;
    char error[512];
} R = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* Holds close at its first fsync until every thread has left. */
static int gate_hook(enum kvhi_disk_op op, void *user)
{
    (void)user;
    if (op == KVHI_OP_FSYNC && atomic_load(&R.closing) && pthread_equal(pthread_self(), R.closer)) {
        double t0 = dt_now();
        atomic_fetch_add(&R.gate_waits, 1);
        while (atomic_load(&R.left) < THREADS && dt_now() - t0 < 30)
            dt_sleep_ms(0.2);
    }
    return 0;
}

static void log_fn(void *user, int32_t level, const char *message)
{
    (void)user;
    if (level <= KVH_LOG_WARN && getenv("KVH_REL_VERBOSE"))
        fprintf(stderr, "[kvh log %d] %s\n", level, message);
}

static void set_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void set_error(const char *fmt, ...)
{
    pthread_mutex_lock(&R.mu);
    if (!R.error[0]) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(R.error, sizeof(R.error), fmt, ap);
        va_end(ap);
    }
    pthread_mutex_unlock(&R.mu);
}

typedef struct worker {
    kvh_engine *e;
    int id;
    uint64_t seed, round;
} worker;

/* true: stop (the engine is closing, or something went wrong). */
static bool check(kvh_status st, const char *what, bool timeout_ok)
{
    atomic_fetch_add(&R.calls, 1);
    if (atomic_load(&R.closing) && st != KVH_ERR_CLOSED)
        atomic_fetch_add(&R.completed_while_closing, 1);
    if (st == KVH_ERR_CLOSED) {
        atomic_fetch_add(&R.closed_calls, 1);
        return true;
    }
    if (st == KVH_OK || st == KVH_ERR_NOSPACE || st == KVH_ERR_BUSY || (timeout_ok && st == KVH_ERR_TIMEOUT))
        return false;
    set_error("%s returned %s (%d): %s", what, kvh_status_name(st), (int)st,
              kvh_last_error()[0] ? kvh_last_error() : dt_err);
    return true;
}

#define CALL(what, expr)                                                                                               \
    do {                                                                                                               \
        if (check((expr), what, false))                                                                                \
            goto out;                                                                                                  \
    } while (0)

static void *worker_main(void *arg)
{
    worker *w = arg;
    kvh_engine *e = w->e;
    dt_rng r = {w->seed};
    kvh_seq mine[4];
    dt_content c[4];
    size_t len[4];
    int n = 0;
    uint64_t stream = (w->round << 20) | ((uint64_t)w->id << 12);
    for (;;) {
        kvh_status st;
        kvh_fence f = {0};
        uint64_t op = dt_below(&r, 12);
        if (n == 0 || (n < 4 && op == 0)) {
            c[n] = dt_plain(stream++);
            len[n] = (1 + dt_below(&r, 3)) * G.bt + dt_below(&r, G.bt);
            if (check(st = dt_build(e, G, c[n], len[n], (uint32_t)w->id, &mine[n]), "build", false))
                goto out;
            if (st == KVH_OK)
                n++;
            continue;
        }
        int i = (int)dt_below(&r, (uint64_t)n);
        switch (op) {
        case 1: {
            char msg[256] = "";
            st = dt_verify(e, mine[i], G, c[i], 0, len[i], msg, sizeof(msg));
            if (st == KVH_ERR_INTERNAL) {
                set_error("thread %d: wrong data: %s", w->id, msg);
                goto out;
            }
            CALL("read back", st);
            break;
        }
        case 2:
            CALL("acquire", st = kvh_seq_acquire(e, mine[i], 0, len[i] < 2 * G.bt ? len[i] : 2 * G.bt, &f));
            if (st != KVH_OK)
                break;
            st = kvh_fence_wait(e, f, dt_below(&r, 2) ? UINT64_MAX : 1000000);
            if (check(st, "fence_wait", true))
                goto out; /* the fence dies with the engine */
            CALL("fence_free", kvh_fence_free(e, f));
            CALL("release", kvh_seq_release(e, mine[i], 0, len[i] < 2 * G.bt ? len[i] : 2 * G.bt));
            break;
        case 3:
            CALL("migrate", kvh_seq_migrate(e, mine[i], 0, len[i], dt_below(&r, 2) ? KVH_TIER_DISK : KVH_TIER_HOST,
                                            dt_below(&r, 2) ? &f : NULL));
            if (f.id)
                CALL("fence_free", kvh_fence_free(e, f));
            break;
        case 4:
            CALL("prefetch", kvh_prefetch(e, mine[i], 0, len[i], 1, NULL));
            break;
        case 5:
            st = kvh_seq_persist(e, mine[i]);
            if (st == KVH_OK) {
                pthread_mutex_lock(&R.mu);
                if (R.n_acked < MAX_ACKS) {
                    R.acked[R.n_acked] = c[i];
                    R.acked_freed[R.n_acked] = false;
                    R.acked_len[R.n_acked++] = len[i] / G.bt * G.bt;
                }
                pthread_mutex_unlock(&R.mu);
            }
            CALL("persist", st);
            break;
        case 6: {
            size_t m = 0;
            char msg[256] = "";
            st = dt_match_verify(e, G, c[i], len[i], &m, msg, sizeof(msg));
            if (st == KVH_ERR_INTERNAL) {
                set_error("thread %d: match served wrong data: %s", w->id, msg);
                goto out;
            }
            CALL("match", st);
            break;
        }
        case 7: {
            kvh_stats s = {.struct_size = sizeof(s)};
            CALL("stats", kvh_engine_stats(e, &s));
            kvh_tier_info t = {.struct_size = sizeof(t)};
            CALL("tier_info", kvh_tier_info_get(e, (uint32_t)dt_below(&r, 3), &t));
            break;
        }
        case 8: /* fork a plain sequence (the content model has one split) */
            if (n < 4 && c[i].split == 0) {
                c[n] = (dt_content){c[i].own, len[i], stream++};
                len[n] = len[i] + G.bt;
                CALL("fork", st = kvh_seq_fork(e, mine[i], (uint32_t)w->id, &mine[n]));
                if (st != KVH_OK)
                    break;
                n++;
                CALL("extend fork", st = dt_extend(e, mine[n - 1], G, c[n - 1], len[i], G.bt));
                if (st != KVH_OK) { /* keep only what was written */
                    kvh_seq_free(e, mine[--n]);
                }
            }
            break;
        case 9:
            CALL("free", kvh_seq_free(e, mine[i]));
            pthread_mutex_lock(&R.mu);
            for (int a = 0; a < R.n_acked; a++)
                if (!memcmp(&R.acked[a], &c[i], sizeof(c[i])))
                    R.acked_freed[a] = true;
            pthread_mutex_unlock(&R.mu);
            mine[i] = mine[n - 1], c[i] = c[n - 1], len[i] = len[n - 1];
            n--;
            break;
        default: {
            kvh_block b = {0};
            CALL("seq_blocks", kvh_seq_blocks(e, mine[i], 0, 1, &b));
            kvh_block_info bi = {.struct_size = sizeof(bi)};
            CALL("block_info", kvh_block_info_get(e, b, &bi));
        }
        }
    }
out:
    atomic_fetch_add(&R.left, 1);
    return NULL;
}

static void test_close_races_calls(void **state)
{
    (void)state;
    long rounds = dt_env_long("KVH_REL_CLOSE_ROUNDS", RL_SIZE(30, 300));
    uint64_t seed = dt_seed(0xc105e5ull);
    dt_rng rng = {seed};
    char dir[512];
    bool fast = rl_fast_scratch("close-race", dir, sizeof(dir));
    kvhi_disk_set_fault_hook(gate_hook, NULL);
    double worst_close = 0, t_all = dt_now();
    long checked_acks = 0, waited_calls = 0;
    for (long round = 0; round < rounds; round++) {
        dt_rmrf(dir);
        mkdir(dir, 0755);
        kvh_config c = dt_cfg(G, dir, 8, 16, 256, 2);
        c.log_fn = log_fn;
        kvh_engine *e = dt_open_a(&c);
        atomic_store(&R.closing, 0);
        atomic_store(&R.left, 0);
        R.n_acked = 0;
        R.closer = pthread_self();
        pthread_t th[THREADS];
        worker w[THREADS];
        for (int i = 0; i < THREADS; i++) {
            w[i] = (worker){e, i, dt_next(&rng), (uint64_t)round};
            assert_int_equal(pthread_create(&th[i], NULL, worker_main, &w[i]), 0);
        }
        dt_sleep_ms((double)dt_below(&rng, 20000) / 1000.0);
        long before = atomic_load(&R.completed_while_closing);
        atomic_store(&R.closing, 1);
        double t0 = dt_now();
        kvh_status st = kvh_engine_close(dt_untrack(e));
        double took = dt_now() - t0;
        atomic_store(&R.closing, 0);
        for (int i = 0; i < THREADS; i++)
            pthread_join(th[i], NULL);
        waited_calls += atomic_load(&R.completed_while_closing) - before;
        if (R.error[0])
            fail_msg("round %ld (seed 0x%" PRIx64 "): %s", round, seed, R.error);
        dt_assert_ok(st);
        if (atomic_load(&R.left) != THREADS)
            fail_msg("round %ld: %d of %d threads left", round, atomic_load(&R.left), THREADS);
        if (took > CLOSE_BOUND)
            fail_msg("round %ld: kvh_engine_close took %.2f s with calls in flight", round, took);
        if (took > worst_close)
            worst_close = took;
        /* the store reopens with everything that was persisted */
        c.migration_threads = 0;
        e = dt_open_a(&c);
        for (int i = 0; i < R.n_acked; i++) {
            size_t m = 0;
            char msg[256] = "";
            if (dt_match_verify(e, G, R.acked[i], R.acked_len[i], &m, msg, sizeof(msg)) != KVH_OK)
                fail_msg("round %ld: after the reopen: %s", round, msg);
            /* The disk tier is a bounded cache: once no sequence refers to a
             * persisted block, a full disk may drop it (stats.drops). A
             * sequence still alive at close keeps every persisted block. */
            if (m != R.acked_len[i] && R.acked_freed[i]) {
                R.freed_acks_short++;
                continue;
            }
            if (m != R.acked_len[i])
                fail_msg("round %ld: a persisted sequence has %zu of %zu tokens after close + reopen", round, m,
                         R.acked_len[i]);
        }
        char msg[256];
        if (rl_counters_add_up(e, true, msg, sizeof(msg)))
            fail_msg("round %ld: after the reopen: %s", round, msg);
        checked_acks += R.n_acked;
        dt_assert_ok(dt_close(e));
    }
    kvhi_disk_set_fault_hook(NULL, NULL);
    rl_fast_cleanup();
    print_message("close race: %ld rounds x %d threads in %.1f s (%s): %ld calls, %ld answered KVH_ERR_CLOSED, %ld "
                  "completed after close had begun; slowest close %.3f s (bound %.0f s); %ld persisted sequences "
                  "checked after reopening (%ld of them freed before close and partly dropped for room)\n",
                  rounds, THREADS, dt_now() - t_all, fast ? "tmpfs" : "disk", atomic_load(&R.calls),
                  atomic_load(&R.closed_calls), waited_calls, worst_close, CLOSE_BOUND, checked_acks,
                  R.freed_acks_short);
}

/* A second close of an engine whose first close is still waiting gets
 * KVH_ERR_CLOSED and frees nothing: the first then finishes normally. The
 * first close is held at its first fsync until the second has returned. */
static struct {
    pthread_t first;
    kvh_engine *e;
    kvh_status first_status;
    atomic_int first_inside, second_done;
} C2;

static int second_close_hook(enum kvhi_disk_op op, void *user)
{
    (void)user;
    if (op == KVHI_OP_FSYNC && pthread_equal(pthread_self(), C2.first)) {
        atomic_store(&C2.first_inside, 1);
        double t0 = dt_now();
        while (!atomic_load(&C2.second_done) && dt_now() - t0 < 30)
            dt_sleep_ms(0.2);
    }
    return 0;
}

static void *first_close_main(void *arg)
{
    (void)arg;
    C2.first_status = kvh_engine_close(C2.e);
    return NULL;
}

static void test_second_close_while_first_waits(void **state)
{
    (void)state;
    char dir[512];
    rl_fast_scratch("second-close", dir, sizeof(dir));
    dt_rmrf(dir);
    mkdir(dir, 0755);
    kvh_config c = dt_cfg(G, dir, 8, 16, 256, 2);
    C2.e = dt_open_a(&c);
    C2.first_status = KVH_ERR_INTERNAL;
    atomic_store(&C2.first_inside, 0);
    atomic_store(&C2.second_done, 0);
    kvhi_disk_set_fault_hook(second_close_hook, NULL);
    dt_untrack(C2.e); /* closed here, not by the teardown */
    assert_int_equal(pthread_create(&C2.first, NULL, first_close_main, NULL), 0);
    double t0 = dt_now();
    while (!atomic_load(&C2.first_inside) && dt_now() - t0 < 30)
        dt_sleep_ms(0.2);
    assert_true(atomic_load(&C2.first_inside));
    assert_int_equal(kvh_engine_close(C2.e), KVH_ERR_CLOSED);
    atomic_store(&C2.second_done, 1);
    pthread_join(C2.first, NULL);
    kvhi_disk_set_fault_hook(NULL, NULL);
    assert_int_equal(C2.first_status, KVH_OK);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_close_races_calls, rl_teardown),
        cmocka_unit_test_teardown(test_second_close_while_first_waits, rl_teardown),
    };
    return cmocka_run_group_tests_name("rel_close_race", tests, NULL, NULL);
}
