/* Reliability battery, item 2: kill points (white box).
 *
 * The disk tier calls a test-only hook (kvhi_disk_set_fault_hook) before
 * every write, read, fsync, rename and directory fsync. A kill point is one
 * place in the code where such a call is made: the hook identifies it by
 * its operation and the five return addresses above the hook (so the
 * write of the snapshot header, of the snapshot body, of a journal record
 * and of slab data are different points, as are the fsync of a temporary
 * file, of the journal and of the slabs). Reads are not kill points: a
 * process that dies before a read changes nothing on disk.
 *
 * 1. Discovery: a scenario runs in child processes with a tracing hook:
 *    fresh store, sequences built, forked, persisted (oracle lines as in
 *    the crash loop), spilled (sync and async), close (snapshot +
 *    compaction), reopen (recovery), more persists, a prefetch and a
 *    prefix match of recovered blocks, close; with 0 and 2 migration
 *    workers and several seeds. Every point hit is listed with how often
 *    each seed hits it.
 * 2. Kills: every point is killed at least KILLS times (20 in CI, 100 in
 *    test_rel_killpoints_stress; KVH_REL_KILLS overrides): a child runs the
 *    scenario of a seed that reaches the point and SIGKILLs itself inside
 *    the hook at a random occurrence of it, before the system call. The
 *    parent then reopens the store and checks it against the child's
 *    oracle: the reopen succeeds, every acknowledged-durable block is found
 *    with every byte right, stats.corrupt_blocks is 0 and the counters add
 *    up.
 *
 * The points are printed with their function names when addr2line is
 * available (tests/RELIABILITY.md lists them).
 */
#include "rel_util.h"

#include <dlfcn.h>

#include "core/disk_io.h"

static const dt_geo G = {2, 1, 32, 16, KVH_DTYPE_F16}; /* block = 4096 bytes */
#define DISK_SLOTS 128
#define DEPTH 5
#define MAX_SITES 128
#define N_SEEDS 8

static struct {
    char root[400], dir[512], oracle[600], trace[600], errlog[600];
    char disk_dir[512], fast_dir[512]; /* store on the real disk / on a tmpfs */
} P;

/* ---- the hook ---- */

typedef struct site {
    int op;
    void *pc[DEPTH];
} site;

static bool site_eq(const site *a, const site *b) { return a->op == b->op && !memcmp(a->pc, b->pc, sizeof(a->pc)); }

static struct {
    int mode; /* 0 off, 1 trace, 2 kill */
    int trace_fd;
    site target;
    long kill_at;
    atomic_long seen;
} H;

static void site_here(site *s, int op)
{
    void *frames[DEPTH + 2];
    int n = backtrace(frames, DEPTH + 2);
    memset(s, 0, sizeof(*s));
    s->op = op;
    for (int i = 0; i < DEPTH && i + 1 < n; i++)
        s->pc[i] = frames[i + 1];
}

static int kp_hook(enum kvhi_disk_op op, void *user)
{
    (void)user;
    if (H.mode == 0 || op == KVHI_OP_READ)
        return 0;
    site s;
    site_here(&s, (int)op);
    if (H.mode == 1) {
        char line[200];
        int n = snprintf(line, sizeof(line), "%d", s.op);
        for (int i = 0; i < DEPTH; i++)
            n += snprintf(line + n, sizeof(line) - (size_t)n, " %p", s.pc[i]);
        n += snprintf(line + n, sizeof(line) - (size_t)n, "\n");
        if (write(H.trace_fd, line, (size_t)n) != n)
            _exit(71);
    } else if (site_eq(&s, &H.target) && atomic_fetch_add(&H.seen, 1) + 1 == H.kill_at) {
        kill(getpid(), SIGKILL);
        for (;;)
            pause();
    }
    return 0;
}

/* ---- the scenario (in a child) ---- */

#define SC_FAIL(code, ...)                                                                                             \
    do {                                                                                                               \
        fprintf(stderr, "scenario: " __VA_ARGS__);                                                                     \
        fprintf(stderr, " (%s)\n", kvh_last_error());                                                                  \
        _exit(code);                                                                                                   \
    } while (0)

typedef struct scen {
    uint64_t seed;
    uint32_t threads;
} scen;

static uint32_t next_id;
static dt_content plan_c[64]; /* what the scenario planned, by id */
static size_t plan_n[64];

/* A new sequence (plain or forked from `from`), planned in the oracle. */
static kvh_seq sc_new(kvh_engine *e, int ofd, dt_rng *r, const kvh_seq *from, dt_content from_c, size_t from_len,
                      dt_content *c, size_t *len)
{
    uint32_t id = next_id++;
    size_t extra = (1 + dt_below(r, 3)) * G.bt + dt_below(r, G.bt);
    kvh_seq s;
    kvh_status st;
    if (from) {
        *c = (dt_content){from_c.own, from_len, 0x30000ull + id};
        *len = from_len + extra;
        plan_c[id % 64] = *c, plan_n[id % 64] = *len;
        dt_oracle_write(ofd, "P %u %llu %llu %llu %zu\n", id, (unsigned long long)c->base, (unsigned long long)c->split,
                        (unsigned long long)c->own, *len);
        if ((st = kvh_seq_fork(e, *from, 1, &s)) != KVH_OK)
            SC_FAIL(20, "fork: %s", kvh_status_name(st));
        if ((st = dt_extend(e, s, G, *c, from_len, extra)) != KVH_OK)
            SC_FAIL(21, "extend fork: %s", kvh_status_name(st));
    } else {
        *c = dt_plain(0x30000ull + id);
        *len = extra;
        plan_c[id % 64] = *c, plan_n[id % 64] = *len;
        dt_oracle_write(ofd, "P %u %llu %llu %llu %zu\n", id, (unsigned long long)c->base, (unsigned long long)c->split,
                        (unsigned long long)c->own, *len);
        if ((st = dt_build(e, G, *c, *len, 0, &s)) != KVH_OK)
            SC_FAIL(22, "build: %s", kvh_status_name(st));
    }
    return s;
}

static int scenario(scen *sc)
{
    dt_rng r = {sc->seed};
    int ofd = open(P.oracle, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    int efd = open(P.errlog, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (ofd < 0 || efd < 0)
        return 60;
    dup2(efd, 2);
    kvh_config c = dt_cfg(G, P.dir, 4, 8, DISK_SLOTS, sc->threads);
    c.disk_flags = dt_below(&r, 3) == 0 ? KVH_DISK_BUFFERED : 0;
    next_id = 0;
    for (int round = 0; round < 3; round++) {
        kvh_engine *e = NULL;
        kvh_status st = kvh_engine_open(&c, &e);
        if (st != KVH_OK)
            SC_FAIL(10, "open (round %d): %s", round, kvh_status_name(st));
        if (round > 0) {
            /* recovered blocks: match (reads + verification), prefetch */
            for (uint32_t id = round - 1; id < next_id && id < 64; id += 2) {
                size_t m = 0;
                char msg[256];
                if ((st = dt_match_verify(e, G, plan_c[id], plan_n[id], &m, msg, sizeof(msg))) != KVH_OK)
                    SC_FAIL(11, "match after reopen: %s", msg);
            }
        }
        kvh_seq s[4];
        dt_content ct[4];
        size_t len[4];
        int ns = 2 + (int)dt_below(&r, 3);
        for (int i = 0; i < ns; i++) {
            uint32_t id = next_id;
            bool fork = i > 0 && dt_below(&r, 2);
            s[i] = sc_new(e, ofd, &r, fork ? &s[0] : NULL, ct[0], fork ? len[0] : 0, &ct[i], &len[i]);
            switch (dt_below(&r, 4)) {
            case 0: /* spill first, then persist */
                if ((st = kvh_seq_migrate(e, s[i], 0, len[i], KVH_TIER_DISK, NULL)) != KVH_OK && st != KVH_ERR_NOSPACE)
                    SC_FAIL(12, "spill: %s", kvh_status_name(st));
                /* fall through */
            case 1:
            case 2:
                if ((st = kvh_seq_persist(e, s[i])) != KVH_OK)
                    SC_FAIL(13, "persist: %s", kvh_status_name(st));
                dt_oracle_write(ofd, "A %u %zu\n", id, len[i] / G.bt);
                break;
            default: { /* async spill left in flight, not acknowledged */
                kvh_fence f;
                if ((st = kvh_seq_migrate(e, s[i], 0, len[i], KVH_TIER_DISK, &f)) != KVH_OK)
                    SC_FAIL(14, "async spill: %s", kvh_status_name(st));
                kvh_fence_free(e, f);
            }
            }
            if (dt_below(&r, 2)) {
                kvh_fence f;
                if ((st = kvh_prefetch(e, s[i], 0, len[i] < 2 * G.bt ? len[i] : 2 * G.bt, 1, &f)) != KVH_OK)
                    SC_FAIL(15, "prefetch: %s", kvh_status_name(st));
                kvh_fence_wait(e, f, UINT64_MAX);
                kvh_fence_free(e, f);
            }
        }
        for (int i = 0; i < ns; i++)
            kvh_seq_free(e, s[i]);
        if (round == 2 && dt_below(&r, 2))
            return 0; /* ends without a close: the store is left unclean */
        if ((st = kvh_engine_close(e)) != KVH_OK)
            SC_FAIL(16, "close (round %d): %s", round, kvh_status_name(st));
    }
    return 0;
}

/* Runs the scenario in a child with the hook in `mode`; returns the child's
 * wait status. */
static int run_child(scen sc, int mode, const site *target, long kill_at)
{
    dt_rmrf(P.dir);
    unlink(P.oracle);
    unlink(P.errlog);
    pid_t pid = dt_fork_child();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        H.mode = mode;
        if (mode == 1) {
            H.trace_fd = open(P.trace, O_WRONLY | O_APPEND | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
            if (H.trace_fd < 0)
                _exit(62);
        }
        if (target)
            H.target = *target;
        H.kill_at = kill_at;
        atomic_store(&H.seen, 0);
        kvhi_disk_set_fault_hook(kp_hook, NULL);
        _exit(scenario(&sc));
    }
    return dt_reap(pid);
}

static void dump_errlog(void) { dt_print_file(P.errlog, "child stderr"); }

/* ---- naming points (report only) ---- */

static const char *op_name(int op)
{
    static const char *n[] = {"write", "read", "fsync", "rename", "dir-fsync"};
    return op >= 0 && op < KVHI_OP_COUNT ? n[op] : "?";
}

/* "f1 < f2 < f3" for the return addresses of s, via addr2line. */
static void site_name(const site *s, char *out, size_t len)
{
    out[0] = '\0';
    Dl_info info;
    if (!dladdr(s->pc[0], &info) || !info.dli_fname) {
        snprintf(out, len, "%p", s->pc[0]);
        return;
    }
    char cmd[1024];
    int n = snprintf(cmd, sizeof(cmd), "addr2line -f -e /proc/%ld/exe", (long)getpid());
    for (int i = 0; i < DEPTH; i++)
        n += snprintf(cmd + n, sizeof(cmd) - (size_t)n, " %#lx",
                      (unsigned long)((uintptr_t)s->pc[i] - (uintptr_t)info.dli_fbase - 1));
    snprintf(cmd + n, sizeof(cmd) - (size_t)n, " 2>/dev/null");
    FILE *p = popen(cmd, "r");
    size_t used = 0;
    char fn[256], loc[512];
    for (int i = 0; p && i < DEPTH && fgets(fn, sizeof(fn), p) && fgets(loc, sizeof(loc), p); i++) {
        fn[strcspn(fn, "\n")] = '\0';
        loc[strcspn(loc, "\n")] = '\0';
        const char *file = strrchr(loc, '/');
        used += (size_t)snprintf(out + used, len - used, "%s%s(%s)", i ? " < " : "", fn, file ? file + 1 : loc);
        if (used >= len)
            break;
    }
    if (p)
        pclose(p);
    if (!out[0])
        snprintf(out, len, "%p", s->pc[0]);
}

/* ---- the test ---- */

typedef struct site_info {
    site s;
    long count[N_SEEDS]; /* hits per discovery scenario */
    int kills;
} site_info;

static site_info sites[MAX_SITES];
static int n_sites;

static int find_site(const site *s)
{
    for (int i = 0; i < n_sites; i++)
        if (site_eq(&sites[i].s, s))
            return i;
    if (n_sites == MAX_SITES)
        return -1;
    sites[n_sites].s = *s;
    memset(sites[n_sites].count, 0, sizeof(sites[n_sites].count));
    sites[n_sites].kills = 0;
    return n_sites++;
}

static void test_kill_points(void **state)
{
    (void)state;
    int kills_per_point = (int)dt_env_long("KVH_REL_KILLS", RL_SIZE(20, 100));
    uint64_t seed = dt_seed(0x6b111901ull);
    dt_rng rng = {seed};
    dt_scratch("killpoints", P.root, sizeof(P.root));
    snprintf(P.disk_dir, sizeof(P.disk_dir), "%s/store", P.root);
    /* Most kills run on a tmpfs (fsync is free there; a kill keeps the
     * page cache either way); every REAL_EVERY-th on the real disk, with
     * O_DIRECT. */
    const int REAL_EVERY = 8;
    bool fast = rl_fast_scratch("killpoints", P.fast_dir, sizeof(P.fast_dir));
    snprintf(P.dir, sizeof(P.dir), "%s", P.fast_dir);
    snprintf(P.oracle, sizeof(P.oracle), "%s/oracle", P.root);
    snprintf(P.trace, sizeof(P.trace), "%s/trace", P.root);
    snprintf(P.errlog, sizeof(P.errlog), "%s/child-stderr", P.root);
    {
        void *warm[4];
        backtrace(warm, 4); /* loads the unwinder before fork()ing */
    }
    double t0 = dt_now();

    /* 1. discovery */
    scen seeds[N_SEEDS];
    for (int i = 0; i < N_SEEDS; i++) {
        seeds[i] = (scen){dt_next(&rng), i % 2 ? 2u : 0u};
        int ws = run_child(seeds[i], 1, NULL, 0);
        if (!(WIFEXITED(ws) && WEXITSTATUS(ws) == 0)) {
            dump_errlog();
            fail_msg("discovery scenario %d (seed 0x%" PRIx64 ") failed: status 0x%x", i, seeds[i].seed, ws);
        }
        size_t len = 0;
        uint8_t *buf = dt_read_file(P.trace, &len);
        assert_non_null(buf);
        buf[len] = '\0';
        for (char *line = (char *)buf, *next; line && *line; line = next) {
            next = strchr(line, '\n');
            if (next)
                *next++ = '\0';
            site s;
            memset(&s, 0, sizeof(s));
            char *cur = line, *end;
            s.op = (int)strtol(cur, &end, 10);
            bool okl = end != cur;
            for (int d = 0; okl && d < DEPTH; d++) {
                cur = end;
                s.pc[d] = (void *)(uintptr_t)strtoull(cur, &end, 16);
                okl = end != cur;
            }
            if (!okl)
                continue;
            int k = find_site(&s);
            assert_true(k >= 0);
            sites[k].count[i]++;
        }
        free(buf);
    }
    assert_true(n_sites > 0);
    double t_disc = dt_now() - t0;

    /* 2. kills */
    long cycles = 0, not_reached = 0, real_kills = 0;
    uint64_t acked = 0;
    int worker_only = 0;
    for (int k = 0; k < n_sites; k++) {
        int attempts = 0;
        /* a point no single-threaded scenario reaches shows up only with
         * some interleavings of the workers: killed as often as it can be
         * reached in a bounded number of tries */
        bool deterministic = false;
        for (int j = 0; j < N_SEEDS; j++)
            deterministic |= seeds[j].threads == 0 && sites[k].count[j] > 0;
        worker_only += !deterministic;
        while (sites[k].kills < kills_per_point) {
            if (++attempts > kills_per_point * 20) {
                if (!deterministic)
                    break;
                fail_msg("point %d (%s) could not be reached %d times", k, op_name(sites[k].s.op), kills_per_point);
            }
            /* a scenario that reaches the point, round robin */
            int si = -1;
            for (int j = 0; j < N_SEEDS && si < 0; j++) {
                int c = (attempts + j) % N_SEEDS;
                if (sites[k].count[c])
                    si = c;
            }
            assert_true(si >= 0);
            long at = 1 + (long)dt_below(&rng, (uint64_t)sites[k].count[si]);
            bool real = !fast || cycles % REAL_EVERY == 0;
            snprintf(P.dir, sizeof(P.dir), "%s", real ? P.disk_dir : P.fast_dir);
            real_kills += real;
            int ws = run_child(seeds[si], 2, &sites[k].s, at);
            cycles++;
            if (WIFEXITED(ws) && WEXITSTATUS(ws) == 0) {
                not_reached++; /* workers made this run take another path */
                continue;
            }
            if (!(WIFSIGNALED(ws) && WTERMSIG(ws) == SIGKILL)) {
                dump_errlog();
                fail_msg("point %d (%s #%ld, seed 0x%" PRIx64 "): the scenario failed (status 0x%x) instead of "
                         "being killed",
                         k, op_name(sites[k].s.op), at, seeds[si].seed, ws);
            }
            static dt_oracle o;
            memset(&o, 0, sizeof(o));
            dt_oracle_read(P.oracle, &o);
            dt_check r;
            kvh_config c = dt_cfg(G, P.dir, 4, 8, DISK_SLOTS, 0);
            kvh_engine *e = dt_track(dt_oracle_check(&c, G, &o, 0, &r));
            char msg[256] = "";
            if (!r.errors && rl_counters_add_up(e, true, msg, sizeof(msg)))
                fail_msg("point %d: counters after the reopen: %s", k, msg);
            if (r.errors) {
                char name[1024];
                site_name(&sites[k].s, name, sizeof(name));
                dump_errlog();
                fail_msg("killed at %s #%ld of point %d [%s] (seed 0x%" PRIx64 ", %u workers): %s",
                         op_name(sites[k].s.op), at, k, name, seeds[si].seed, seeds[si].threads, r.msg);
            }
            dt_assert_ok(dt_close(e));
            acked += r.acked_blocks;
            sites[k].kills++;
        }
    }
    int per_op[KVHI_OP_COUNT] = {0};
    for (int k = 0; k < n_sites; k++)
        per_op[sites[k].s.op]++;
    int min_kills = INT32_MAX;
    for (int k = 0; k < n_sites; k++)
        if (sites[k].kills < min_kills)
            min_kills = sites[k].kills;
    print_message("kill points: %d points (write %d, fsync %d, rename %d, dir-fsync %d; %d reached only with some "
                  "worker interleavings), each single-threaded one killed %d times (fewest kills of any point: %d): "
                  "%ld kills in %.1f s (discovery %.1f s; %ld runs took another path); %" PRIu64
                  " acknowledged blocks checked; %ld runs on the real disk; 0 failures\n",
                  n_sites, per_op[KVHI_OP_WRITE], per_op[KVHI_OP_FSYNC], per_op[KVHI_OP_RENAME],
                  per_op[KVHI_OP_DIRSYNC], worker_only, kills_per_point, min_kills, cycles - not_reached, dt_now() - t0,
                  t_disc, not_reached, acked, real_kills);
    if (getenv("KVH_REL_KILLPOINTS_LIST") || REL_STRESS)
        for (int k = 0; k < n_sites; k++) {
            char name[1024];
            site_name(&sites[k].s, name, sizeof(name));
            print_message("  point %2d: %-9s x%d  %s\n", k, op_name(sites[k].s.op), sites[k].kills, name);
        }
    rl_fast_cleanup();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_kill_points, rl_teardown),
    };
    return cmocka_run_group_tests_name("rel_killpoints", tests, NULL, NULL);
}
