/* Reliability battery, item 3: fault injection, every N through a scenario.
 *
 * One scenario (single-threaded: migration_threads = 0, so every run takes
 * the same path up to the fault) on a store that already holds P0 (in the
 * snapshot: closed cleanly) and P1 (only in the journal: its writer died
 * without closing):
 *
 *   open, match P0, match P1, build A, persist A, fork B from A and extend
 *   it, persist B, spill B to disk, read B back, prefetch B (fence), acquire
 *   and release A, free, close
 *
 * is run once to count its calls, then again for every N with the N-th
 * call failing, transient (only that call) and persistent (that call and
 * every later one of its kind):
 *
 *   - disk I/O through the fault hook: write (EIO, ENOSPC), read (EIO),
 *     fsync, rename, directory fsync (EIO);
 *   - short transfers (read, write, pread, pwrite move about half of what
 *     was asked; io_uring is turned off for these runs so the slab I/O goes
 *     through pread/pwrite too);
 *   - allocations: the N-th malloc / calloc / realloc / posix_memalign /
 *     strdup made by the library returns NULL (the test binary wraps them
 *     with -Wl,--wrap; the library is linked in statically).
 *
 * Every run must: not crash; return documented status codes only; never
 * serve wrong bytes; report the fault -- the step during which the first
 * injected I/O failure happened returns an error, except where the library
 * absorbs it by design (a read that fails during match_prefix or a
 * prefetch is a miss); an allocation failure either makes its call fail
 * or is absorbed by a best-effort path (the O_DIRECT probe, a verification
 * batch, ...) with everything the call promised still holding -- the
 * summary counts both; leak nothing (the wrappers track every live
 * allocation; LeakSanitizer checks the ASan build too); and leave a
 * consistent store: a new engine without faults opens it, finds P0 and P1
 * and every sequence whose persist returned KVH_OK, byte for byte, with
 * stats.corrupt_blocks 0 and the counters adding up.
 *
 * Most runs use a tmpfs store (fsync is free there); every 8th runs on the
 * real disk with O_DIRECT. Each sweep runs twice in CI, with 0 and 2
 * migration workers, and 8 times in the _stress twin (0, 2, 1, 4 workers,
 * twice); with workers the runs are not deterministic, so "every N" means
 * every N of the dry run.
 */
#define RL_ALLOC_WRAP
#define RL_IO_WRAP
#include "rel_util.h"

#include "core/disk_io.h"
#include "core/engine.h"

static const dt_geo G = {2, 1, 32, 16, KVH_DTYPE_F16}; /* block = 4096 bytes */
#define DISK_SLOTS 64
#define REAL_EVERY 8
/* Sweeps: migration workers of each pass (0 first: deterministic). */
static const uint32_t pass_threads[4] = {0, 2, 1, 4};
#define PASSES RL_SIZE(2, 8)

enum step {
    S_OPEN,
    S_MATCH0,
    S_MATCH1,
    S_BUILD_A,
    S_PERSIST_A,
    S_FORK_B,
    S_PERSIST_B,
    S_SPILL_B,
    S_READ_B,
    S_PREFETCH_B,
    S_ACQUIRE_A,
    S_FREE,
    S_CLOSE,
    S_COUNT
};
static const char *step_name[S_COUNT] = {"open",      "match P0",  "match P1", "build A", "persist A",
                                         "fork B",    "persist B", "spill B",  "read B",  "prefetch B",
                                         "acquire A", "free",      "close"};

static const dt_content P0 = {0x500, 0, 0x500}, P1 = {0x501, 0, 0x501}, A = {0x502, 0, 0x502};
static const dt_content B = {0x502, 56, 0x503};
#define P_LEN (3 * 16)
#define A_LEN 56 /* 3.5 blocks */
#define B_LEN (56 + 40)

static struct {
    char disk_root[400], fast_root[400];
    char disk_dir[512], fast_dir[512];
    dt_saved_store pristine;
    bool fast;
    uint32_t threads;
} F;

/* ---- the I/O fault hook ---- */

static struct {
    atomic_int armed;
    int op, err;
    long nth;
    bool persistent;
    atomic_long count[KVHI_OP_COUNT];
    atomic_long fired;
} H;

static int fault_hook(enum kvhi_disk_op op, void *user)
{
    (void)user;
    if (!atomic_load(&H.armed))
        return 0;
    long c = atomic_fetch_add(&H.count[op], 1) + 1;
    if ((int)op != H.op || H.nth <= 0)
        return 0;
    if (c == H.nth || (H.persistent && c > H.nth)) {
        atomic_fetch_add(&H.fired, 1);
        return H.err;
    }
    return 0;
}

static void io_arm(int op, int err, long nth, bool persistent)
{
    atomic_store(&H.armed, 0);
    H.op = op, H.err = err, H.nth = nth, H.persistent = persistent;
    for (int i = 0; i < KVHI_OP_COUNT; i++)
        atomic_store(&H.count[i], 0);
    atomic_store(&H.fired, 0);
    atomic_store(&H.armed, 1);
}

static void io_disarm(void) { atomic_store(&H.armed, 0); }

/* ---- the scenario ---- */

typedef enum kind { K_IO, K_SHORT, K_ALLOC } kind;

typedef struct run {
    kind k;
    int op, err; /* K_IO: kvhi_disk_op + errno; K_SHORT: RL_SIO_* */
    long nth;
    bool persistent;
    /* results */
    kvh_status st[S_COUNT];
    bool ran[S_COUNT];
    int fired_step; /* step of the first injected failure, -1 none */
    long fired;
    char wrong[256]; /* wrong data served, if any */
} run;

static long fired_now(const run *r)
{
    return r->k == K_IO ? atomic_load(&H.fired) : r->k == K_SHORT ? atomic_load(&rl_sio.fired) : rl_alloc_fired();
}

static kvh_config scen_cfg(const char *dir)
{
    kvh_config c = dt_cfg(G, dir, 16, 32, DISK_SLOTS, F.threads);
    return c;
}

/* The run in progress, for a crash report. */
static const run *cur_run;
static volatile int cur_step = -1;

/* Runs one step: records its status and, if the first fault fired during
 * it, its index. */
#define STEP(r, s, expr)                                                                                               \
    do {                                                                                                               \
        cur_step = (s);                                                                                                \
        long f0_ = fired_now(r);                                                                                       \
        (r)->st[s] = (expr);                                                                                           \
        (r)->ran[s] = true;                                                                                            \
        if ((r)->fired_step < 0 && fired_now(r) > f0_)                                                                 \
            (r)->fired_step = (s);                                                                                     \
    } while (0)

static kvh_status check_match(kvh_engine *e, dt_content c, size_t n, run *r)
{
    size_t m = 0;
    char msg[256] = "";
    kvh_status st = dt_match_verify(e, G, c, n, &m, msg, sizeof(msg));
    if (st == KVH_ERR_INTERNAL && !r->wrong[0])
        snprintf(r->wrong, sizeof(r->wrong), "%s", msg);
    return st;
}

static kvh_status check_seq(kvh_engine *e, kvh_seq s, dt_content c, size_t n, run *r)
{
    char msg[256] = "";
    kvh_status st = dt_verify(e, s, G, c, 0, n, msg, sizeof(msg));
    if (st == KVH_ERR_INTERNAL && !r->wrong[0])
        snprintf(r->wrong, sizeof(r->wrong), "%s", msg);
    return st;
}

static void scenario(const char *dir, run *r)
{
    kvh_config c = scen_cfg(dir);
    kvh_engine *e = NULL;
    kvh_seq a = {0}, b = {0};
    for (int i = 0; i < S_COUNT; i++)
        r->ran[i] = false;
    r->fired_step = -1;
    r->wrong[0] = '\0';
    STEP(r, S_OPEN, kvh_engine_open(&c, &e));
    if (r->st[S_OPEN] != KVH_OK)
        return;
    STEP(r, S_MATCH0, check_match(e, P0, P_LEN, r));
    STEP(r, S_MATCH1, check_match(e, P1, P_LEN, r));
    STEP(r, S_BUILD_A, dt_build(e, G, A, A_LEN, 0, &a));
    if (r->st[S_BUILD_A] == KVH_OK)
        STEP(r, S_PERSIST_A, kvh_seq_persist(e, a));
    if (r->st[S_BUILD_A] == KVH_OK) {
        kvh_status st = kvh_seq_fork(e, a, 1, &b);
        STEP(r, S_FORK_B, st == KVH_OK ? dt_extend(e, b, G, B, A_LEN, B_LEN - A_LEN) : st);
        if (st == KVH_OK && r->st[S_FORK_B] != KVH_OK) {
            kvh_seq_free(e, b);
            b.id = 0;
        } else if (st != KVH_OK)
            b.id = 0;
    }
    if (b.id) {
        STEP(r, S_PERSIST_B, kvh_seq_persist(e, b));
        STEP(r, S_SPILL_B, kvh_seq_migrate(e, b, 0, B_LEN, KVH_TIER_DISK, NULL));
        STEP(r, S_READ_B, check_seq(e, b, B, B_LEN, r));
        kvh_fence f = {0};
        kvh_status st;
        STEP(r, S_PREFETCH_B,
             (st = kvh_prefetch(e, b, 0, B_LEN, 3, &f)) == KVH_OK ? kvh_fence_wait(e, f, UINT64_MAX) : st);
        kvh_fence_free(e, f);
    }
    if (a.id) {
        kvh_status st;
        STEP(r, S_ACQUIRE_A,
             (st = kvh_seq_acquire(e, a, 0, 2 * G.bt, NULL)) == KVH_OK ? kvh_seq_release(e, a, 0, 2 * G.bt) : st);
        if (r->st[S_ACQUIRE_A] == KVH_OK)
            STEP(r, S_ACQUIRE_A, check_seq(e, a, A, A_LEN, r));
    }
    {
        kvh_status s1 = KVH_OK, s2 = KVH_OK;
        STEP(r, S_FREE, ((s1 = kvh_seq_free(e, a)), (s2 = kvh_seq_free(e, b)), s1 != KVH_OK ? s1 : s2));
    }
    STEP(r, S_CLOSE, kvh_engine_close(e));
}

/* ---- the checks ---- */

static const char *kind_name(const run *r)
{
    static char buf[96];
    static const char *ops[] = {"write", "read", "fsync", "rename", "dir-fsync"};
    if (r->k == K_IO)
        snprintf(buf, sizeof(buf), "%s %s", ops[r->op], strerror(-r->err));
    else if (r->k == K_SHORT)
        snprintf(buf, sizeof(buf), "short %s", r->op == RL_SIO_READ ? "read" : "write");
    else
        snprintf(buf, sizeof(buf), "allocation");
    return buf;
}

/* An injected failure this step may absorb and still return KVH_OK. */
static bool may_absorb(const run *r, int step)
{
    if (r->k == K_SHORT)
        return true; /* a short transfer is completed, not an error */
    if (step == S_MATCH0 || step == S_MATCH1 || step == S_PREFETCH_B)
        return true; /* a failed read is a miss; a hint may be dropped */
    /* An allocation may be best effort (the O_DIRECT probe buffer at open,
     * the background cleaner, a verification batch): its failure may
     * leave the call successful as long as everything it promised holds --
     * which the rest of the scenario and the reopen check. Counted per
     * step in the summary. */
    if (r->k == K_ALLOC)
        return true;
    return false;
}

typedef struct tally {
    long runs, fired, errors_reported, absorbed, real_disk;
    long absorbed_by_step[S_COUNT];
} tally;

/* Problems of one run, reported together. */
static char problems[4][320];
static int n_problems;

static void problem(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void problem(const char *fmt, ...)
{
    if (n_problems >= 4)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(problems[n_problems++], sizeof(problems[0]), fmt, ap);
    va_end(ap);
}

static bool in_child; /* the sweep runs in a fork()ed child */

static void report_problems(const run *r)
{
    if (!n_problems)
        return;
    print_error("%s failing at call %ld (%s), %u migration workers:\n", kind_name(r), r->nth,
                r->persistent ? "persistent" : "transient", F.threads);
    for (int s = 0; s < S_COUNT; s++)
        if (r->ran[s])
            print_error("    %-10s %s%s\n", step_name[s], kvh_status_name(r->st[s]),
                        s == r->fired_step ? "   <- first injected failure" : "");
    for (int i = 0; i < n_problems; i++)
        print_error("  problem: %s\n", problems[i]);
    if (in_child) {
        fprintf(stderr, "ERROR: %s\n", problems[0]);
        rl_fast_cleanup();
        exit(1);
    }
    fail_msg("%s", problems[0]);
}

static void check_run(run *r, const char *dir, long live_before, tally *t)
{
    n_problems = 0;
    t->runs++;
    if (r->wrong[0])
        problem("wrong data served: %s", r->wrong);
    for (int s = 0; s < S_COUNT; s++)
        if (r->ran[s] && !rl_status_known(r->st[s]))
            problem("step %s returned an undocumented status %d", step_name[s], r->st[s]);
    if (r->fired_step >= 0) {
        t->fired++;
        if (r->st[r->fired_step] != KVH_OK) {
            t->errors_reported++;
            if (getenv("KVH_REL_VERBOSE"))
                print_message("  %s at call %ld (%s): %s returned %s\n", kind_name(r), r->nth,
                              r->persistent ? "persistent" : "transient", step_name[r->fired_step],
                              kvh_status_name(r->st[r->fired_step]));
        } else if (may_absorb(r, r->fired_step)) {
            t->absorbed++;
            t->absorbed_by_step[r->fired_step]++;
        } else
            problem("the failure during %s was not reported: it returned KVH_OK", step_name[r->fired_step]);
    }
    kvhi_engine_forget_closed(); /* close keeps the last engines' structs */
    long live = rl_alloc_live();
    if (live >= 0 && live != live_before)
        problem("%ld allocation(s) leaked (%ld live before the run, %ld after)", live - live_before, live_before, live);
    /* a new engine, without faults */
    kvh_config c = scen_cfg(dir);
    c.migration_threads = 0;
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&c, &e);
    if (st != KVH_OK) {
        problem("the store does not reopen after the faults: %s: %s", kvh_status_name(st), kvh_last_error());
        report_problems(r);
    }
    dt_track(e);
    struct {
        const char *name;
        dt_content c;
        size_t n;
        bool durable;
    } want[] = {{"P0", P0, P_LEN, true},
                {"P1", P1, P_LEN, true},
                {"A", A, A_LEN / G.bt * G.bt, r->ran[S_PERSIST_A] && r->st[S_PERSIST_A] == KVH_OK},
                {"B", B, B_LEN / G.bt * G.bt, r->ran[S_PERSIST_B] && r->st[S_PERSIST_B] == KVH_OK}};
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
        size_t m = 0;
        char msg[256] = "";
        st = dt_match_verify(e, G, want[i].c, want[i].n, &m, msg, sizeof(msg));
        if (st != KVH_OK)
            problem("after the reopen, %s: %s", want[i].name, msg);
        else if (want[i].durable && m != want[i].n)
            problem("after the reopen, %s (durable) has %zu of %zu tokens: durable data was lost", want[i].name, m,
                    want[i].n);
    }
    uint64_t corrupt = dt_stats(e).corrupt_blocks;
    if (corrupt)
        problem("after the reopen, corrupt_blocks = %" PRIu64 " (no data was damaged on disk)", corrupt);
    char msg[256];
    if (rl_counters_add_up(e, true, msg, sizeof(msg)))
        problem("after the reopen: %s", msg);
    st = dt_close(e);
    if (st != KVH_OK)
        problem("closing the fault-free engine: %s: %s", kvh_status_name(st), kvh_last_error());
    report_problems(r);
}

/* Restores the pristine store into a fresh dir (tmpfs, or the real disk
 * every REAL_EVERY-th run); returns the dir. */
static const char *fresh_store(tally *t)
{
    bool real = !F.fast || t->runs % REAL_EVERY == 0;
    const char *dir = real ? F.disk_dir : F.fast_dir;
    t->real_disk += real;
    dt_rmrf(dir);
    mkdir(dir, 0755);
    assert_int_equal(dt_store_restore(dir, &F.pristine), 0);
    return dir;
}

static const char *kind_name(const run *r);

/* A crash inside a run: say which run, then die of the signal. */
static void crash_report(int sig)
{
    char buf[256];
    int n = cur_run ? snprintf(buf, sizeof(buf),
                               "\n*** signal %d during the run with %s failing at call %ld (%s), step %s\n", sig,
                               kind_name(cur_run), cur_run->nth, cur_run->persistent ? "persistent" : "transient",
                               cur_step >= 0 && cur_step < S_COUNT ? step_name[cur_step] : "(checks)")
                    : 0;
    if (n > 0 && write(2, buf, (size_t)n) < 0)
        _exit(128 + sig);
    signal(sig, SIG_DFL);
    raise(sig);
}

static void catch_crashes(void)
{
    int sigs[] = {SIGSEGV, SIGBUS, SIGABRT, SIGILL, SIGFPE};
    for (size_t i = 0; i < sizeof(sigs) / sizeof(sigs[0]); i++)
        signal(sigs[i], crash_report);
}

static void do_run(run *r, tally *t)
{
    cur_run = r;
    cur_step = -1;
    const char *dir = fresh_store(t);
    kvhi_engine_forget_closed();
    long live_before = rl_alloc_live();
    if (r->k == K_IO)
        io_arm(r->op, r->err, r->nth, r->persistent);
    else if (r->k == K_SHORT) {
        atomic_store(&rl_sio.no_uring, 1);
        rl_shortio_arm(r->op, r->nth, r->persistent);
    } else
        rl_alloc_arm(r->nth, r->persistent, F.threads == 0);
    scenario(dir, r);
    r->fired = fired_now(r);
    io_disarm();
    rl_shortio_disarm();
    atomic_store(&rl_sio.no_uring, 0);
    rl_alloc_disarm();
    cur_step = -1;
    check_run(r, dir, live_before, t);
    cur_run = NULL;
}

/* ---- building the pristine store ---- */

static int journal_child(void *arg)
{
    const char *dir = arg;
    kvh_config c = scen_cfg(dir);
    kvh_engine *e = NULL;
    kvh_seq s;
    if (kvh_engine_open(&c, &e) != KVH_OK || dt_build(e, G, P1, P_LEN, 0, &s) != KVH_OK ||
        kvh_seq_persist(e, s) != KVH_OK)
        return 1;
    return 0; /* no close: P1 stays only in the journal */
}

static void build_pristine(void)
{
    dt_scratch("faults", F.disk_root, sizeof(F.disk_root));
    snprintf(F.disk_dir, sizeof(F.disk_dir), "%s/store", F.disk_root);
    F.fast = rl_fast_scratch("faults", F.fast_root, sizeof(F.fast_root));
    snprintf(F.fast_dir, sizeof(F.fast_dir), "%s/store", F.fast_root);
    char dir[600];
    snprintf(dir, sizeof(dir), "%s/pristine", F.disk_root);
    mkdir(dir, 0755);
    kvh_config c = scen_cfg(dir);
    c.migration_threads = 0;
    kvh_engine *e = dt_open_a(&c);
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, P0, P_LEN, 0, &s));
    dt_assert_ok(kvh_seq_persist(e, s));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
    assert_int_equal(dt_in_child(journal_child, dir), 0);
    dt_assert_ok(dt_store_save(dir, &F.pristine));
    const dt_saved_file *j = dt_store_file(&F.pristine, "journal");
    assert_non_null(j);
    assert_true(j->len > 4096); /* P1's records are in the journal */
}

static int group_setup(void **state)
{
    (void)state;
    kvhi_disk_set_fault_hook(fault_hook, NULL);
    return 0;
}

static int group_teardown(void **state)
{
    (void)state;
    kvhi_disk_set_fault_hook(NULL, NULL);
    dt_store_free(&F.pristine);
    rl_fast_cleanup();
    return 0;
}

static void print_tally(const char *what, const tally *t, double secs)
{
    char absorbed[512] = "";
    size_t used = 0;
    for (int s = 0; s < S_COUNT; s++)
        if (t->absorbed_by_step[s])
            used += (size_t)snprintf(absorbed + used, sizeof(absorbed) - used, "%s%s %ld", used ? ", " : "",
                                     step_name[s], t->absorbed_by_step[s]);
    print_message("%s: %ld runs (%ld on the real disk) in %.1f s; fault hit in %ld: %ld reported as an error, %ld "
                  "absorbed by design%s%s%s; 0 crashes, 0 leaks, 0 wrong bytes, store consistent after every run\n",
                  what, t->runs, t->real_disk, secs, t->fired, t->errors_reported, t->absorbed, used ? " (" : "",
                  absorbed, used ? ")" : "");
}

/* ---- the sweeps ---- */

static void sweep_io_faults(void)
{
    build_pristine();
    tally t = {0};
    double t0 = dt_now();
    /* the dry run: how many calls of each kind */
    run dry = {.k = K_IO, .op = KVHI_OP_WRITE, .nth = 0};
    do_run(&dry, &t);
    long counts[KVHI_OP_COUNT];
    for (int i = 0; i < KVHI_OP_COUNT; i++)
        counts[i] = atomic_load(&H.count[i]);
    for (int s = 0; s < S_COUNT; s++)
        if (dry.st[s] != KVH_OK)
            fail_msg("the fault-free dry run failed at %s: %s", step_name[s], kvh_status_name(dry.st[s]));
    struct {
        int op, err;
    } plan[] = {{KVHI_OP_WRITE, -EIO}, {KVHI_OP_WRITE, -ENOSPC}, {KVHI_OP_READ, -EIO},
                {KVHI_OP_FSYNC, -EIO}, {KVHI_OP_RENAME, -EIO},   {KVHI_OP_DIRSYNC, -EIO}};
    for (int pass = 0; pass < PASSES; pass++) {
        F.threads = pass_threads[pass % 4];
        for (size_t p = 0; p < sizeof(plan) / sizeof(plan[0]); p++)
            for (int persistent = 0; persistent < 2; persistent++)
                for (long n = 1; n <= counts[plan[p].op]; n++) {
                    run r = {.k = K_IO, .op = plan[p].op, .err = plan[p].err, .nth = n, .persistent = persistent};
                    do_run(&r, &t);
                }
    }
    F.threads = 0;
    print_message("dry run: %ld writes, %ld reads, %ld fsyncs, %ld renames, %ld dir-fsyncs\n", counts[0], counts[1],
                  counts[2], counts[3], counts[4]);
    print_tally("I/O errors (EIO, ENOSPC) at every call", &t, dt_now() - t0);
}

static void sweep_short_io(void)
{
    if (!F.pristine.n)
        build_pristine();
    tally t = {0};
    double t0 = dt_now();
    long counts[2];
    for (int op = 0; op < 2; op++) {
        run dry = {.k = K_SHORT, .op = op, .nth = 0};
        do_run(&dry, &t);
        counts[op] = atomic_load(&rl_sio.count);
    }
    for (int pass = 0; pass < PASSES; pass++) {
        F.threads = pass_threads[pass % 4];
        for (int op = 0; op < 2; op++)
            for (int persistent = 0; persistent < 2; persistent++)
                for (long n = 1; n <= counts[op]; n++) {
                    run r = {.k = K_SHORT, .op = op, .nth = n, .persistent = persistent};
                    do_run(&r, &t);
                }
    }
    F.threads = 0;
    print_message("dry run: %ld read/pread calls, %ld write/pwrite calls (io_uring off)\n", counts[0], counts[1]);
    print_tally("short reads and writes at every call", &t, dt_now() - t0);
}

static void sweep_alloc_failures(void)
{
    if (!F.pristine.n)
        build_pristine();
    tally t = {0};
    double t0 = dt_now();
    run dry = {.k = K_ALLOC, .nth = 0};
    do_run(&dry, &t);
    long count = rl_alloc_count();
    for (int s = 0; s < S_COUNT; s++)
        if (dry.st[s] != KVH_OK)
            fail_msg("the dry run failed at %s: %s", step_name[s], kvh_status_name(dry.st[s]));
    assert_true(count > 0);
    for (int pass = 0; pass < PASSES; pass++) {
        F.threads = pass_threads[pass % 4];
        for (int persistent = 0; persistent < 2; persistent++)
            for (long n = 1; n <= count; n++) {
                run r = {.k = K_ALLOC, .nth = n, .persistent = persistent};
                do_run(&r, &t);
            }
    }
    F.threads = 0;
    print_message("dry run: %ld allocations by the library\n", count);
    print_tally("allocation failures at every allocation", &t, dt_now() - t0);
}

/* Each sweep runs in a child process, so that a crash in one (it prints
 * which run crashed) does not hide the results of the others; the child
 * exits through exit() so LeakSanitizer checks it in the ASan build. */
static void run_isolated(void (*sweep)(void), const char *name)
{
    pid_t pid = dt_fork_child();
    assert_true(pid >= 0);
    if (pid == 0) {
        in_child = true;
        catch_crashes();
        sweep();
        dt_store_free(&F.pristine);
        rl_fast_cleanup();
        fflush(stdout);
        exit(0);
    }
    int ws = dt_reap(pid);
    assert_true(ws != -1);
    rl_fast_cleanup_pid((long)pid); /* after a crash */
    if (!(WIFEXITED(ws) && WEXITSTATUS(ws) == 0))
        fail_msg("the %s sweep failed (%s %d; its report is above)", name, WIFSIGNALED(ws) ? "signal" : "exit status",
                 WIFSIGNALED(ws) ? WTERMSIG(ws) : WEXITSTATUS(ws));
}

static void test_io_faults(void **state)
{
    (void)state;
    run_isolated(sweep_io_faults, "I/O error");
}

static void test_short_io(void **state)
{
    (void)state;
    run_isolated(sweep_short_io, "short I/O");
}

static void test_alloc_failures(void **state)
{
    (void)state;
    run_isolated(sweep_alloc_failures, "allocation failure");
}

/* kvh_seq_create_ex failing for want of memory at any allocation:
 * the admission counters and reservations say exactly what was admitted
 * (a request whose context attachment failed is neither counted nor
 * reserved). */
static void test_admission_alloc_failures(void **state)
{
    (void)state;
    kvh_config c;
    assert_int_equal(kvh_config_init(&c, sizeof(c)), KVH_OK);
    c.backend = KVH_BACKEND_CPU;
    c.migration_threads = 0;
    c.num_layers = 1;
    c.num_kv_heads = 1;
    c.head_dim = 8;
    c.block_tokens = 16;
    const uint64_t block_bytes = 2 * 16 * 8 * 2;
    c.device_bytes = 256 * block_bytes;
    c.host_bytes = 0;
    /* Enough live sequences that every table grows on the way. */
    enum { N_SEQS = 40 };
    uint64_t failed_total = 0, admitted_total = 0;
    /* A fresh engine for each n: the n-th allocation of every call
     * fails, so the tables' first growth meets a failure at each of its
     * allocations (the sequence, its handle, the admission record, the
     * context's table). */
    /* A budget in the short pool, and none (no admission record: nothing
     * to count or undo when attaching fails). */
    for (int budgeted = 1; budgeted >= 0; budgeted--)
        for (long n = 1; n <= 8; n++) {
            kvh_engine *e = NULL;
            assert_int_equal(kvh_engine_open(&c, &e), KVH_OK);
            kvh_admission_params ap;
            assert_int_equal(kvh_admission_params_init(&ap, sizeof(ap)), KVH_OK);
            ap.short_device_bytes = 128 * block_bytes;
            ap.long_device_bytes = 64 * block_bytes;
            ap.short_max_tokens = 64;
            assert_int_equal(kvh_admission_configure(e, &ap), KVH_OK);
            kvh_context x;
            assert_int_equal(kvh_context_create(e, NULL, &x), KVH_OK);
            kvh_seq_params sp;
            assert_int_equal(kvh_seq_params_init(&sp, sizeof(sp)), KVH_OK);
            sp.token_budget = budgeted ? 32 : 0;
            sp.context = x;
            kvh_seq held[N_SEQS];
            uint64_t admitted = 0, live = 0;
            for (int i = 0; i < N_SEQS; i++) {
                rl_alloc_arm(n, false, true);
                kvh_status st = kvh_seq_create_ex(e, &sp, &held[i]);
                long fired = rl_alloc_fired();
                rl_alloc_disarm();
                if (st == KVH_OK) {
                    admitted++;
                    live++;
                } else {
                    assert_int_equal(st, KVH_ERR_NOMEM);
                    assert_true(fired > 0);
                    held[i].id = 0;
                    failed_total++;
                }
                kvh_admission_info ai = {.struct_size = sizeof(ai)};
                assert_int_equal(kvh_admission_info_get(e, &ai), KVH_OK);
                assert_int_equal(ai.short_admitted, budgeted ? admitted : 0);
                assert_int_equal(ai.short_reserved_blocks, budgeted ? live * 2 : 0);
                assert_int_equal(ai.long_admitted, 0);
                assert_int_equal(ai.long_reserved_blocks, 0);
            }
            admitted_total += admitted;
            for (int i = 0; i < N_SEQS; i++)
                assert_int_equal(kvh_seq_free(e, held[i]), KVH_OK);
            kvh_admission_info ai = {.struct_size = sizeof(ai)};
            assert_int_equal(kvh_admission_info_get(e, &ai), KVH_OK);
            assert_int_equal(ai.short_reserved_blocks, 0);
            /* The long pool still takes its full quota. */
            sp.token_budget = 64 * 16;
            kvh_seq big;
            assert_int_equal(kvh_seq_create_ex(e, &sp, &big), KVH_OK);
            assert_int_equal(kvh_seq_free(e, big), KVH_OK);
            assert_int_equal(kvh_context_destroy(e, x), KVH_OK);
            kvh_engine_close(e);
        }
    assert_true(failed_total > 0);
    assert_true(admitted_total > 0);
}

/* A prefix match on a reopened store, its n-th allocation failing (this
 * thread, no workers): KVH_ERR_NOMEM, or every persisted token matched
 * with the bytes written, never a silent miss of blocks that had already
 * reached memory (the check of blocks left on disk could not allocate and
 * dropped every block found). */
static void test_match_prefix_alloc_failures(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("match-nomem", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 16, 16, 32, 0);
    const dt_content a = dt_plain(7);
    const size_t len = 4 * G.bt;
    kvh_engine *e = dt_open_a(&c);
    kvh_seq s;
    assert_int_equal(dt_build(e, G, a, len, 0, &s), KVH_OK);
    assert_int_equal(kvh_seq_persist(e, s), KVH_OK);
    assert_int_equal(dt_close(e), KVH_OK);
    long failed = 0;
    for (long n = 1;; n++) {
        e = dt_open_a(&c);
        int32_t tok[4 * 16];
        dt_tokens(a, 0, len, tok);
        kvh_seq m;
        assert_int_equal(kvh_seq_create(e, 0, &m), KVH_OK);
        size_t matched = 0;
        rl_alloc_arm(n, false, true);
        kvh_status st = kvh_seq_match_prefix(e, m, tok, len, &matched);
        long fired = rl_alloc_fired();
        rl_alloc_disarm();
        if (st == KVH_OK) {
            if (matched != len)
                fail_msg("allocation %ld failed: the match found %zu of %zu persisted tokens", n, matched, len);
            char msg[256] = "";
            if (dt_verify(e, m, G, a, 0, len, msg, sizeof(msg)) != KVH_OK)
                fail_msg("allocation %ld failed: %s", n, msg);
        } else {
            assert_int_equal(st, KVH_ERR_NOMEM);
        }
        failed += fired > 0;
        assert_int_equal(dt_close(e), KVH_OK);
        if (!fired)
            break; /* past the call's last allocation */
    }
    assert_true(failed > 0);
}

/* A prefetch of blocks on disk, with a migration worker, every
 * allocation from the n-th on failing in any thread: kvh.h lets the call
 * fail only for its fence, and a promotion that cannot be made (its job
 * not queued, or not batched by the worker) is skipped, not an error:
 * the fence completes with KVH_OK, each skip is counted, and every block
 * keeps its bytes wherever it stays. */
static void test_prefetch_alloc_failures(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("prefetch-nomem", dir, sizeof(dir));
    const dt_content a = dt_plain(9);
    const size_t len = 6 * G.bt;
    long failed = 0, skipped_runs = 0, quiet = 0;
    /* Which allocations the worker reaches varies with scheduling: the
     * sweep ends after four runs in a row in which none failed. */
    for (long n = 1; quiet < 4; n++) {
        kvh_config c = dt_cfg(G, dir, 16, 16, 32, 1);
        kvh_engine *e = dt_open_a(&c);
        kvh_seq s;
        assert_int_equal(dt_build(e, G, a, len, 0, &s), KVH_OK);
        assert_int_equal(kvh_seq_migrate(e, s, 0, len, KVH_TIER_DISK, NULL), KVH_OK);
        kvh_stats before = {.struct_size = sizeof(before)};
        assert_int_equal(kvh_engine_stats(e, &before), KVH_OK);
        kvh_fence f = {0};
        rl_alloc_arm(n, true, false);
        kvh_status st = kvh_prefetch(e, s, 0, len, 10, &f);
        kvh_status fst = st == KVH_OK ? kvh_fence_wait(e, f, UINT64_MAX) : KVH_OK;
        long fired = rl_alloc_fired();
        rl_alloc_disarm();
        if (st != KVH_OK) {
            assert_int_equal(st, KVH_ERR_NOMEM); /* only for the fence */
            assert_int_equal(f.id, 0);
        } else {
            if (fst != KVH_OK)
                fail_msg("allocations from %ld failing: the prefetch fence reported %s (%s)", n, kvh_status_name(fst),
                         kvh_last_error());
            assert_int_equal(kvh_fence_free(e, f), KVH_OK);
        }
        kvh_stats after = {.struct_size = sizeof(after)};
        assert_int_equal(kvh_engine_stats(e, &after), KVH_OK);
        skipped_runs += after.prefetch_skipped > before.prefetch_skipped;
        char msg[256] = "";
        if (dt_verify(e, s, G, a, 0, len, msg, sizeof(msg)) != KVH_OK)
            fail_msg("allocations from %ld failing: %s", n, msg);
        assert_int_equal(kvh_seq_free(e, s), KVH_OK);
        assert_int_equal(dt_close(e), KVH_OK);
        failed += fired > 0;
        quiet = fired ? 0 : quiet + 1;
    }
    print_message("%ld runs with a failed allocation, %ld of them with a skipped promotion\n", failed, skipped_runs);
    assert_true(failed > 0);
    assert_true(skipped_runs > 0);
}

/* Opening a store with the n-th allocation failing, its index loaded or
 * (both index and journal gone) rebuilt from the slot headers: the open
 * fails with KVH_ERR_NOMEM or succeeds (it said KVH_ERR_IO, "cannot read
 * .../index: Cannot allocate memory"), and a later open finds every
 * persisted block. */
static void test_index_load_alloc_failures(void **state)
{
    (void)state;
    char dir[PATH_MAX], path[PATH_MAX + 16];
    dt_scratch("index-nomem", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 16, 16, 32, 0);
    const dt_content a = dt_plain(5);
    const size_t len = 4 * G.bt;
    for (int rebuild = 0; rebuild < 2; rebuild++) {
        long failed = 0;
        for (long n = 1;; n++) {
            dt_rmrf(dir);
            kvh_engine *e = dt_open_a(&c);
            kvh_seq s;
            assert_int_equal(dt_build(e, G, a, len, 0, &s), KVH_OK);
            assert_int_equal(kvh_seq_persist(e, s), KVH_OK);
            assert_int_equal(dt_close(e), KVH_OK);
            for (int f = 0; rebuild && f < 2; f++) {
                snprintf(path, sizeof(path), "%s/%s", dir, f ? "journal" : "index");
                assert_int_equal(unlink(path), 0);
            }
            kvh_engine *opened = NULL;
            rl_alloc_arm(n, false, true);
            kvh_status st = kvh_engine_open(&c, &opened);
            long fired = rl_alloc_fired();
            rl_alloc_disarm();
            if (st == KVH_OK)
                assert_int_equal(dt_close(opened), KVH_OK);
            else if (st != KVH_ERR_NOMEM)
                fail_msg("%s, allocation %ld failing: the open returned %s (%s)", rebuild ? "rebuild" : "load", n,
                         kvh_status_name(st), kvh_last_error());
            failed += fired > 0;
            e = dt_open_a(&c);
            int32_t tok[4 * 16];
            dt_tokens(a, 0, len, tok);
            kvh_seq m;
            size_t matched = 0;
            assert_int_equal(kvh_seq_create(e, 0, &m), KVH_OK);
            assert_int_equal(kvh_seq_match_prefix(e, m, tok, len, &matched), KVH_OK);
            if (matched != len)
                fail_msg("allocation %ld failed in the open: a later one found %zu of %zu tokens", n, matched, len);
            char msg[256] = "";
            if (dt_verify(e, m, G, a, 0, len, msg, sizeof(msg)) != KVH_OK)
                fail_msg("allocation %ld failed in the open: %s", n, msg);
            assert_int_equal(dt_close(e), KVH_OK);
            if (!fired)
                break;
        }
        assert_true(failed > 0);
    }
}

/* An engine open with a remote tier of several addresses (none
 * listening) and the n-th allocation failing: KVH_ERR_NOMEM or KVH_OK,
 * never KVH_ERR_INVALID_ARG "remote address ... is not host:port" for a
 * node table that could not grow. */
static void test_remote_open_alloc_failures(void **state)
{
    (void)state;
    kvh_config c = dt_cfg(G, NULL, 16, 16, 0, 0);
    c.remote_addrs = "127.0.0.1:1, localhost:1, [::1]:1, 127.0.0.2:1, 127.0.0.3:1";
    c.remote_timeout_ms = 20;
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&c, &e);
    if (st == KVH_ERR_UNSUPPORTED)
        skip(); /* built without the remote tier */
    assert_int_equal(st, KVH_OK);
    assert_int_equal(dt_close(e), KVH_OK);
    long failed = 0;
    for (long n = 1;; n++) {
        rl_alloc_arm(n, false, true);
        st = kvh_engine_open(&c, &e);
        long fired = rl_alloc_fired();
        rl_alloc_disarm();
        if (st == KVH_OK)
            assert_int_equal(dt_close(e), KVH_OK);
        else if (st != KVH_ERR_NOMEM)
            fail_msg("allocation %ld failing: the open returned %s (%s)", n, kvh_status_name(st), kvh_last_error());
        failed += fired > 0;
        if (!fired)
            break;
    }
    assert_true(failed > 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_io_faults, rl_teardown),
        cmocka_unit_test_teardown(test_short_io, rl_teardown),
        cmocka_unit_test_teardown(test_alloc_failures, rl_teardown),
        cmocka_unit_test(test_admission_alloc_failures),
        cmocka_unit_test_teardown(test_match_prefix_alloc_failures, rl_teardown),
        cmocka_unit_test_teardown(test_prefetch_alloc_failures, rl_teardown),
        cmocka_unit_test_teardown(test_index_load_alloc_failures, rl_teardown),
        cmocka_unit_test_teardown(test_remote_open_alloc_failures, rl_teardown),
    };
    return cmocka_run_group_tests_name("rel_faults", tests, group_setup, group_teardown);
}
