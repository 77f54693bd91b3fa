/* Reliability battery, item 8: hangs. A slow or stuck disk (the fault hook
 * sleeps, or blocks until released, before each disk read / write / fsync
 * and returns 0) must not make calls with a deadline overrun it, and
 * kvh_engine_close must finish in bounded time with work in flight.
 *
 *   - slow reads: kvh_seq_acquire(.., &fence) of blocks on disk, then
 *     kvh_fence_wait(fence, deadline) -> KVH_ERR_TIMEOUT within 2x the
 *     deadline (5x in sanitizer builds); the same with kvh_prefetch(.., &fence);
 *   - slow writes: kvh_migrate(.., KVH_TIER_DISK, &fence) of blocks in
 *     memory (new blocks, and published ones, whose move also appends to
 *     the journal), then fence_wait with a deadline, while the spill runs;
 *   - a deadline wait on one fence while another fence's slow disk work
 *     runs on the workers;
 *   - a stuck disk: the same waits time out; close, with the disk released
 *     after 0.5 s, returns within 0.5 s + CLOSE_BOUND;
 *   - close with 96 moves queued on a slow disk: the queued ones are
 *     cancelled, close returns within CLOSE_BOUND.
 *
 *   - a deadline wait that starts while a worker appends the journal
 *     records of a spill of published blocks to the slow disk;
 *
 * Each deadline is tried at 50 and 100 ms (the disk takes 250 ms a call);
 * the worst ratio elapsed / deadline is reported. Runs under TSan
 * too (label concurrency).
 */
#include "rel_util.h"

#include "core/disk_io.h"

static const dt_geo G = {2, 1, 32, 16, KVH_DTYPE_F16}; /* block = 4096 bytes */
#define DISK_DELAY_MS 250.0
static double delay_ms = DISK_DELAY_MS;
/* What close may take with work in flight on the slow disk: the running
 * batches' transfers and the closing snapshot are a handful of disk calls
 * each; 16 calls' worth is generous. */
#define CLOSE_CALLS 16
#define CLOSE_BOUND (CLOSE_CALLS * DISK_DELAY_MS / 1000)

static struct {
    atomic_int mode; /* 0 normal, 1 slow, 2 stuck */
    atomic_int ops_mask;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool released;
    atomic_long delayed;
    atomic_int fsyncs_let_through; /* stuck mode: these first fsyncs pass */
} D = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static int slow_hook(enum kvhi_disk_op op, void *user)
{
    (void)user;
    int mode = atomic_load(&D.mode);
    if (!mode || !(atomic_load(&D.ops_mask) & (1 << op)))
        return 0;
    if (mode == 2 && op == KVHI_OP_FSYNC && atomic_fetch_sub(&D.fsyncs_let_through, 1) > 0)
        return 0;
    atomic_fetch_add(&D.delayed, 1);
    if (mode == 1) {
        dt_sleep_ms(delay_ms);
    } else {
        pthread_mutex_lock(&D.mu);
        while (!D.released)
            pthread_cond_wait(&D.cv, &D.mu);
        pthread_mutex_unlock(&D.mu);
    }
    return 0;
}

static void disk_normal(void) { atomic_store(&D.mode, 0); }
static void disk_slow(int ops)
{
    atomic_store(&D.ops_mask, ops);
    atomic_store(&D.mode, 1);
}
static void disk_stuck(int ops)
{
    pthread_mutex_lock(&D.mu);
    D.released = false;
    pthread_mutex_unlock(&D.mu);
    atomic_store(&D.ops_mask, ops);
    atomic_store(&D.mode, 2);
}
static void disk_release(void)
{
    pthread_mutex_lock(&D.mu);
    D.released = true;
    pthread_cond_broadcast(&D.cv);
    pthread_mutex_unlock(&D.mu);
    atomic_store(&D.mode, 0);
}

#define R (1 << KVHI_OP_READ)
#define W ((1 << KVHI_OP_WRITE) | (1 << KVHI_OP_FSYNC))

static double worst_ratio;
static int waits;

/* How far past its deadline a wait may return: a lock held across a disk
 * call would keep it for the whole stall (seconds here), while a loaded
 * machine delays a woken thread by tens of milliseconds, and a sanitizer
 * build (5-15x slower, every lock instrumented) by hundreds. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define DEADLINE_SLACK 5.0
#else
#define DEADLINE_SLACK 2.0
#endif

/* fence_wait(f, deadline) must return within DEADLINE_SLACK x the deadline: with
 * KVH_ERR_TIMEOUT if the slow disk keeps the work busy for longer (always,
 * unless done_ok), or KVH_OK if the work is done by then. */
static void expect_bounded(kvh_engine *e, kvh_fence f, double deadline_ms, const char *what, bool done_ok)
{
    double t0 = dt_now();
    kvh_status st = kvh_fence_wait(e, f, (uint64_t)(deadline_ms * 1e6));
    double took = (dt_now() - t0) * 1000;
    waits++;
    if (took > DEADLINE_SLACK * deadline_ms)
        fail_msg("%s: fence_wait with a %.0f ms deadline returned %s after %.0f ms (more than %.0fx the deadline)",
                 what, deadline_ms, kvh_status_name(st), took, DEADLINE_SLACK);
    if (st != KVH_ERR_TIMEOUT && !(done_ok && st == KVH_OK))
        fail_msg("%s: fence_wait(%.0f ms) returned %s after %.0f ms, expected KVH_ERR_TIMEOUT", what, deadline_ms,
                 kvh_status_name(st), took);
    if (took / deadline_ms > worst_ratio)
        worst_ratio = took / deadline_ms;
}

static void expect_timeout(kvh_engine *e, kvh_fence f, double deadline_ms, const char *what)
{
    expect_bounded(e, f, deadline_ms, what, false);
}

typedef struct store {
    char dir[512];
    kvh_config cfg;
    kvh_engine *e;
    kvh_seq s[8]; /* 4 blocks each */
} store;

/* An engine with 8 sequences of 4 blocks, persisted; odd ones spilled to
 * disk, even ones in memory. */
static void make_store(store *st, const char *name)
{
    rl_fast_scratch(name, st->dir, sizeof(st->dir));
    st->cfg = dt_cfg(G, st->dir, 48, 64, 256, 2);
    st->e = dt_open_a(&st->cfg);
    for (int i = 0; i < 8; i++) {
        dt_assert_ok(dt_build(st->e, G, dt_plain(0x700 + (uint64_t)i), 4 * G.bt, 0, &st->s[i]));
        dt_assert_ok(kvh_seq_persist(st->e, st->s[i]));
        if (i % 2)
            dt_assert_ok(kvh_seq_migrate(st->e, st->s[i], 0, 4 * G.bt, KVH_TIER_DISK, NULL));
    }
}

/* New (unpublished, unjournaled) blocks in memory: n sequences of 4. */
static void fresh_seqs(kvh_engine *e, kvh_seq *out, int n, uint64_t stream)
{
    for (int i = 0; i < n; i++)
        dt_assert_ok(dt_build(e, G, dt_plain(stream + (uint64_t)i), 4 * G.bt - 1, 0, &out[i]));
}

DT_UNUSED static void test_slow_disk_deadlines(void **state)
{
    (void)state;
    kvhi_disk_set_fault_hook(slow_hook, NULL);
    static const double deadlines[] = {50, 100};
    for (size_t d = 0; d < 2; d++) {
        double dl = deadlines[d];
        store S;
        make_store(&S, "hang-slow");
        kvh_engine *e = S.e;
        kvh_fence f;
        /* 1. acquire from a slow disk */
        disk_slow(R);
        dt_assert_ok(kvh_seq_acquire(e, S.s[1], 0, 4 * G.bt, &f));
        expect_timeout(e, f, dl, "acquire of blocks on a slow disk");
        /* the work goes on and completes */
        dt_assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
        dt_assert_ok(kvh_fence_free(e, f));
        dt_assert_ok(kvh_seq_release(e, S.s[1], 0, 4 * G.bt));
        /* 2. prefetch from a slow disk */
        dt_assert_ok(kvh_prefetch(e, S.s[3], 0, 4 * G.bt, 5, &f));
        expect_timeout(e, f, dl, "prefetch of blocks on a slow disk");
        dt_assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
        dt_assert_ok(kvh_fence_free(e, f));
        /* 3. spill new blocks to a slow disk (3 full, published ones, whose
         *    move also appends to the journal, and a partial one) */
        disk_slow(W);
        kvh_seq n[2];
        fresh_seqs(e, n, 2, 0x7100 + (uint64_t)d * 16);
        dt_assert_ok(kvh_seq_migrate(e, n[0], 0, 4 * G.bt - 1, KVH_TIER_DISK, &f));
        expect_timeout(e, f, dl, "spill of new blocks to a slow disk");
        dt_assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
        dt_assert_ok(kvh_fence_free(e, f));
        /* 4. a deadline on one fence while other slow disk work runs on
         *    the workers: a spill of new published blocks, and an acquire
         *    of blocks on disk */
        disk_slow(R | W);
        kvh_fence busy1 = {0}, busy2;
        dt_assert_ok(kvh_seq_migrate(e, n[1], 0, 4 * G.bt - 1, KVH_TIER_DISK, &busy2));
        dt_sleep_ms(10);
        dt_assert_ok(kvh_seq_acquire(e, S.s[5], 0, 4 * G.bt, &f));
        expect_timeout(e, f, dl, "acquire while other slow disk work is in flight");
        dt_assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
        dt_assert_ok(kvh_fence_free(e, f));
        dt_assert_ok(kvh_seq_release(e, S.s[5], 0, 4 * G.bt));
        kvh_fence_wait(e, busy2, UINT64_MAX);
        kvh_fence_free(e, busy1);
        kvh_fence_free(e, busy2);
        /* 5. a deadline wait that starts while a worker is past the slab
         *    write of a spill of published blocks and records them in the
         *    journal: the records are buffered, so the read it waits for is
         *    not held up by them (done or timed out, within 2x) */
        kvh_seq m[1];
        fresh_seqs(e, m, 1, 0x7180 + (uint64_t)d * 16);
        dt_assert_ok(kvh_seq_acquire(e, S.s[7], 0, 4 * G.bt, &f)); /* read: pending for a while */
        dt_assert_ok(kvh_seq_migrate(e, m[0], 0, 4 * G.bt - 1, KVH_TIER_DISK, &busy2));
        dt_sleep_ms(DISK_DELAY_MS + 60);
        expect_bounded(e, f, dl, "acquire, waited for while a spill appends journal records", true);
        dt_assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
        dt_assert_ok(kvh_fence_free(e, f));
        dt_assert_ok(kvh_seq_release(e, S.s[7], 0, 4 * G.bt));
        dt_assert_ok(kvh_fence_wait(e, busy2, UINT64_MAX));
        dt_assert_ok(kvh_fence_free(e, busy2));
        dt_assert_ok(kvh_seq_free(e, m[0]));
        disk_normal();
        for (int i = 0; i < 2; i++)
            dt_assert_ok(kvh_seq_free(e, n[i]));
        char msg[256];
        for (int i = 0; i < 8; i++)
            if (dt_verify(e, S.s[i], G, dt_plain(0x700 + (uint64_t)i), 0, 4 * G.bt, msg, sizeof(msg)) != KVH_OK)
                fail_msg("after the slow disk: sequence %d: %s", i, msg);
        dt_assert_ok(dt_close(e));
    }
    disk_normal();
    kvhi_disk_set_fault_hook(NULL, NULL);
}

static void *release_later(void *arg)
{
    dt_sleep_ms(*(double *)arg);
    disk_release();
    return NULL;
}

static void test_stuck_disk_and_close(void **state)
{
    (void)state;
    kvhi_disk_set_fault_hook(slow_hook, NULL);
    /* 1. a stuck disk: waits with deadlines still time out; close returns
     *    once the disk answers again */
    store S;
    make_store(&S, "hang-stuck");
    kvh_engine *e = S.e;
    disk_stuck(R | W);
    kvh_fence f[3];
    dt_assert_ok(kvh_seq_acquire(e, S.s[1], 0, 4 * G.bt, &f[0]));
    expect_timeout(e, f[0], 100, "acquire from a stuck disk");
    dt_assert_ok(kvh_prefetch(e, S.s[3], 0, 4 * G.bt, 1, &f[1]));
    expect_timeout(e, f[1], 100, "prefetch from a stuck disk");
    kvh_seq fresh[1];
    fresh_seqs(e, fresh, 1, 0x7200);
    dt_assert_ok(kvh_seq_migrate(e, fresh[0], 0, 4 * G.bt - 1, KVH_TIER_DISK, &f[2]));
    expect_timeout(e, f[2], 100, "spill to a stuck disk");
    for (int i = 0; i < 3; i++)
        dt_assert_ok(kvh_fence_free(e, f[i])); /* work continues */
    double release_ms = 500;
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, release_later, &release_ms), 0);
    double t0 = dt_now();
    dt_assert_ok(dt_close(e));
    double took = dt_now() - t0;
    pthread_join(th, NULL);
    if (took > release_ms / 1000 + CLOSE_BOUND)
        fail_msg("close with work stuck on the disk took %.2f s after the disk answered again",
                 took - release_ms / 1000);
    kvhi_disk_set_fault_hook(NULL, NULL);
    rl_fast_cleanup();
    print_message(
        "stuck disk: %d deadline waits so far, all KVH_ERR_TIMEOUT, worst %.2fx the deadline (limit %.0fx); close "
        "with work stuck on the disk returned %.2f s after the disk answered again\n",
        waits, worst_ratio, DEADLINE_SLACK, took - release_ms / 1000);
}

/* Close with many moves queued on a slow disk: the queued ones are
 * cancelled; what runs must finish in a bounded number of disk calls. */
DT_UNUSED static void test_close_with_queued_work(void **state)
{
    (void)state;
    kvhi_disk_set_fault_hook(slow_hook, NULL);
    delay_ms = 100;
    store T;
    make_store(&T, "hang-queue");
    kvh_engine *e = T.e;
    kvh_seq n[24];
    fresh_seqs(e, n, 24, 0x7300);
    atomic_store(&D.delayed, 0);
    disk_slow(R | W);
    kvh_fence q[32];
    int nq = 0;
    for (int i = 0; i < 24; i++)
        dt_assert_ok(kvh_seq_migrate(e, n[i], 0, 4 * G.bt - 1, KVH_TIER_DISK, &q[nq++]));
    for (int i = 1; i < 8; i += 2)
        dt_assert_ok(kvh_prefetch(e, T.s[i], 0, 4 * G.bt, 2, &q[nq++]));
    for (int i = 0; i < nq; i++)
        dt_assert_ok(kvh_fence_free(e, q[i]));
    dt_sleep_ms(20);
    double t0 = dt_now();
    dt_assert_ok(dt_close(e));
    double took = dt_now() - t0;
    disk_normal();
    long calls = atomic_load(&D.delayed);
    delay_ms = DISK_DELAY_MS;
    double bound = CLOSE_CALLS * 100 / 1000.0;
    if (took > bound)
        fail_msg("close with %d moves queued on a slow disk (100 ms a call) took %.2f s (bound: %d calls = %.1f s): it "
                 "waited for the running batches, which made %ld slow disk calls in all",
                 nq, took, CLOSE_CALLS, bound, calls);
    /* the store it left behind reopens with everything persisted */
    T.cfg.migration_threads = 0;
    e = dt_open_a(&T.cfg);
    for (int i = 0; i < 8; i++) {
        size_t m = 0;
        char msg[256] = "";
        if (dt_match_verify(e, G, dt_plain(0x700 + (uint64_t)i), 4 * G.bt, &m, msg, sizeof(msg)) != KVH_OK ||
            m != 4 * G.bt)
            fail_msg("after a close on a slow disk, persisted sequence %d: %zu tokens %s", i, m, msg);
    }
    dt_assert_ok(dt_close(e));
    kvhi_disk_set_fault_hook(NULL, NULL);
    rl_fast_cleanup();
    print_message("close with %d moves queued on a slow disk (100 ms a call): %.2f s, %ld disk calls (bound %d "
                  "calls)\n",
                  nq, took, calls, CLOSE_CALLS);
}

typedef struct build_arg {
    kvh_engine *e;
    atomic_int done;
    kvh_status st;
    double slowest_ms;
} build_arg;

static void *build_thread(void *p)
{
    build_arg *a = p;
    a->st = KVH_OK;
    for (int i = 0; i < 8 && a->st == KVH_OK; i++) {
        double t0 = dt_now();
        kvh_seq s;
        a->st = dt_build(a->e, G, dt_plain(0x7500 + (uint64_t)i), 4 * G.bt - 1, 0, &s);
        double ms = (dt_now() - t0) * 1000;
        if (ms > a->slowest_ms)
            a->slowest_ms = ms;
    }
    atomic_store(&a->done, 1);
    return NULL;
}

/* A persist whose journal fsync hangs must not hold up another thread's
 * appends, which push blocks to disk and write (not sync) their records:
 * the sync runs outside the journal's lock. */
DT_UNUSED static void test_appends_beside_a_stuck_journal_sync(void **state)
{
    (void)state;
    kvhi_disk_set_fault_hook(slow_hook, NULL);
    char dir[512];
    rl_fast_scratch("hang-journal-sync", dir, sizeof(dir));
    kvh_config cfg = dt_cfg(G, dir, 16, 16, 256, 0); /* 256 slots: one slab file */
    kvh_engine *e = dt_open_a(&cfg);
    kvh_seq fill[8];
    fresh_seqs(e, fill, 8, 0x7400); /* memory full of blocks never written to disk */
    dt_persist_call pa = {.e = e};
    dt_assert_ok(dt_build(e, G, dt_plain(0x74ff), 4 * G.bt, 0, &pa.s));
    atomic_store(&D.delayed, 0);
    atomic_store(&D.fsyncs_let_through, 1); /* the slab's sync; the journal's hangs */
    disk_stuck(1 << KVHI_OP_FSYNC);
    pthread_t pt, bt;
    assert_int_equal(pthread_create(&pt, NULL, dt_persist_in_thread, &pa), 0);
    for (int i = 0; i < 2000 && atomic_load(&D.delayed) == 0; i++)
        dt_sleep_ms(5);
    assert_true(atomic_load(&D.delayed) > 0);
    build_arg ba = {.e = e};
    assert_int_equal(pthread_create(&bt, NULL, build_thread, &ba), 0);
    double t0 = dt_now();
    while (!atomic_load(&ba.done) && dt_now() - t0 < 5.0)
        dt_sleep_ms(5);
    bool done_while_stuck = atomic_load(&ba.done);
    disk_release();
    pthread_join(bt, NULL);
    pthread_join(pt, NULL);
    atomic_store(&D.fsyncs_let_through, 0);
    if (!done_while_stuck)
        fail_msg("8 sequences built while another thread's journal fsync hung were not done in 5 s (slowest "
                 "build %.0f ms once the disk went on): they waited for that sync");
    dt_assert_ok(ba.st);
    dt_assert_ok(pa.st);
    dt_assert_ok(dt_close(e));
    /* the persisted sequence is on disk after a reopen */
    e = dt_open_a(&cfg);
    size_t m = 0;
    char msg[256] = "";
    if (dt_match_verify(e, G, dt_plain(0x74ff), 4 * G.bt, &m, msg, sizeof(msg)) != KVH_OK || m != 4 * G.bt)
        fail_msg("the sequence persisted beside the appends: %zu tokens after a reopen %s", m, msg);
    dt_assert_ok(dt_close(e));
    kvhi_disk_set_fault_hook(NULL, NULL);
    rl_fast_cleanup();
    print_message("8 sequences built beside a hung journal sync: slowest %.1f ms\n", ba.slowest_ms);
}

/* A failed test may leave the disk stuck: let it go before closing. */
static int teardown(void **state)
{
    disk_release();
    disk_normal();
    rl_teardown(state);
    kvhi_disk_set_fault_hook(NULL, NULL);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_slow_disk_deadlines, teardown),
        cmocka_unit_test_teardown(test_stuck_disk_and_close, teardown),
        cmocka_unit_test_teardown(test_close_with_queued_work, teardown),
        cmocka_unit_test_teardown(test_appends_beside_a_stuck_journal_sync, teardown),
    };
    return cmocka_run_group_tests_name("rel_hang", tests, NULL, NULL);
}
