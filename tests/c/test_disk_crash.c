/* Disk tier: kill -9 at random moments.
 *
 * Each cycle fork()s a child that opens the store and runs a random
 * workload of append / write_kv / fork / persist / migrate-to-disk (sync
 * and async) / read-back / free / close + reopen on sequences whose tokens
 * and K/V are pure functions of (stream, position) (disk_test_util.h).
 * The child appends a line to an oracle file (O_APPEND; SIGKILL keeps the
 * page cache, no fsync needed) BEFORE it creates a sequence ("P": its
 * content and planned length) and AFTER each kvh_seq_persist returns
 * KVH_OK ("A": how many full blocks are now durable). The parent
 * SIGKILLs the child after a random delay (0..80 ms after the engine is
 * open; one cycle in ten during the open itself), then reopens the store
 * and, for every sequence of the oracle, runs kvh_seq_match_prefix +
 * kvh_seq_read_kv:
 *
 *   - every block acknowledged durable is found (the match may be longer
 *     than acknowledged: spilled and cleaned blocks are journaled too);
 *   - every byte served equals the deterministic content (nothing partial,
 *     nothing stale, nothing corrupt);
 *   - no block fails verification (SIGKILL loses no written data, so a
 *     journaled block can never be torn: corrupt_blocks must stay 0).
 * Every third child uses KVH_DISK_BUFFERED, the others O_DIRECT.
 *
 * The store carries over from cycle to cycle (so acknowledgements of older
 * cycles are re-checked after every later crash) until the blocks the
 * children have created approach the disk's slots; then it starts over.
 * The disk is never allowed to fill, so no durable block may be evicted.
 * Odd cycles check in a separate process that exits without closing (the
 * next child then recovers a store that was never cleanly closed); even
 * cycles check here and close cleanly.
 *
 * KVH_DISK_CRASH_CYCLES sets the number of cycles (default 100);
 * KVH_TEST_SEED the seed.
 */
#include "disk_test_util.h"

#include <poll.h>

static const dt_geo G = {2, 1, 32, 16, KVH_DTYPE_F16}; /* block = 4096 bytes */
#define DISK_SLOTS 1024
#define WINDOW_CAP 880 /* blocks the children may create before the store starts over */
#define MAX_SEQS 4096

static kvh_config crash_cfg(const char *dir) { return dt_cfg(G, dir, 8, 16, DISK_SLOTS); }

/* This test is about durability only: a KVH_ERR_NOSPACE (the disk never
 * fills here, but a small host tier under the background cleaner once
 * gave spurious ones, see test_nospace_is_not_spurious in
 * test_disk_faults.c) is retried for a while, then its operation skipped;
 * a skipped persist is simply not acknowledged. */
#define RETRY_NOSPACE(call)                                                                                  \
    ({                                                                                                       \
        kvh_status rs_;                                                                                      \
        for (int try_ = 0; (rs_ = (call)) == KVH_ERR_NOSPACE && try_ < 200; try_++)                          \
            usleep(500);                                                                                     \
        rs_;                                                                                                 \
    })

/* ---- the oracle ---- */

typedef struct planned {
    bool used;
    dt_content c;
    size_t n;     /* planned final length */
    size_t acked; /* full blocks acknowledged durable */
} planned;

static struct {
    char dir[512], oracle[600], errlog[600];
    planned seq[MAX_SEQS];
    uint32_t next_id; /* ids (and streams) never repeat in a run */
    uint32_t window_first;
    uint64_t window_blocks;
} S;

static uint64_t stream_of(uint32_t id) { return 0x10000ull + id; }

static void oracle_write(int fd, const char *fmt, ...)
{
    char line[160];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    if (n > 0 && write(fd, line, (size_t)n) != n)
        _exit(70);
}

static bool last_line_is_persist; /* the child was killed inside kvh_seq_persist */

/* Reads the oracle file; returns the number of acknowledgement lines. */
static int oracle_read(void)
{
    last_line_is_persist = false;
    size_t len = 0;
    uint8_t *buf = dt_read_file(S.oracle, &len);
    if (!buf)
        return 0;
    int acks = 0;
    size_t start = 0;
    for (size_t i = 0; i < len; i++) {
        if (buf[i] != '\n')
            continue;
        buf[i] = '\0';
        const char *l = (const char *)buf + start;
        start = i + 1;
        unsigned id;
        unsigned long long base, split, own, n, nfull;
        last_line_is_persist = l[0] == 'S';
        if (sscanf(l, "P %u %llu %llu %llu %llu", &id, &base, &split, &own, &n) == 5 && id < MAX_SEQS) {
            S.seq[id].used = true;
            S.seq[id].c = (dt_content){base, split, own};
            S.seq[id].n = (size_t)n;
        } else if (sscanf(l, "A %u %llu", &id, &nfull) == 2 && id < MAX_SEQS) {
            if (nfull > S.seq[id].acked)
                S.seq[id].acked = (size_t)nfull;
            acks++;
        }
    }
    free(buf);
    return acks;
}

/* ---- the child's workload ---- */

typedef struct live {
    kvh_seq s;
    uint32_t id;
    dt_content c;
    size_t len, final;
    bool plain;
} live;

#define CHILD_FAIL(code, ...)                                                                                \
    do {                                                                                                     \
        fprintf(stderr, "child: " __VA_ARGS__);                                                              \
        fprintf(stderr, " (%s)\n", kvh_last_error());                                                        \
        _exit(code);                                                                                         \
    } while (0)

typedef struct child_arg {
    uint64_t seed;
    uint32_t disk_flags;
    uint64_t budget; /* blocks it may still create */
    uint32_t first_id;
    int ready_fd;
} child_arg;

/* Grows l to `to` tokens: append, then K/V layer by layer, sometimes with
 * a spill of the half-written blocks in between. */
static void child_extend(kvh_engine *e, live *l, size_t to, dt_rng *rng)
{
    if (to <= l->len)
        return;
    size_t n = to - l->len, tb = dt_tok_bytes(G);
    int32_t *tk = malloc(sizeof(int32_t) * n);
    uint8_t *k = malloc(tb * n), *v = malloc(tb * n);
    dt_tokens(l->c, l->len, n, tk);
    kvh_status st = RETRY_NOSPACE(kvh_seq_append(e, l->s, tk, n));
    if (st != KVH_OK)
        CHILD_FAIL(11, "append %zu to seq %u: %s", n, l->id, kvh_status_name(st));
    for (uint32_t layer = 0; layer < G.layers; layer++) {
        for (size_t t = 0; t < n; t++) {
            dt_kv_token(l->c, layer, l->len + t, 0, k + t * tb, tb);
            dt_kv_token(l->c, layer, l->len + t, 1, v + t * tb, tb);
        }
        if ((st = RETRY_NOSPACE(kvh_seq_write_kv(e, l->s, layer, l->len, n, k, v))) != KVH_OK)
            CHILD_FAIL(12, "write_kv seq %u: %s", l->id, kvh_status_name(st));
        if (layer == 0 && dt_below(rng, 4) == 0 &&
            (st = kvh_seq_migrate(e, l->s, 0, to, KVH_TIER_DISK, NULL)) != KVH_OK && st != KVH_ERR_NOSPACE)
            CHILD_FAIL(13, "spill of half-written seq %u: %s", l->id, kvh_status_name(st));
    }
    l->len = to;
    free(tk);
    free(k);
    free(v);
}

static void child_persist(kvh_engine *e, live *l, int ofd)
{
    oracle_write(ofd, "S %u\n", l->id); /* only for the statistics: killed during a persist */
    kvh_status st = RETRY_NOSPACE(kvh_seq_persist(e, l->s));
    if (st == KVH_ERR_NOSPACE)
        return; /* not acknowledged */
    if (st != KVH_OK)
        CHILD_FAIL(14, "persist seq %u: %s", l->id, kvh_status_name(st));
    oracle_write(ofd, "A %u %zu\n", l->id, l->len / G.bt);
}

static int crash_child(void *p)
{
    child_arg *a = p;
    dt_rng rng = {a->seed};
    int ofd = open(S.oracle, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    int efd = open(S.errlog, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (ofd < 0 || efd < 0)
        return 60;
    dup2(efd, 2);
    kvh_config c = crash_cfg(S.dir);
    c.disk_flags = a->disk_flags;
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&c, &e);
    if (st != KVH_OK)
        CHILD_FAIL(10, "open: %s", kvh_status_name(st));
    if (write(a->ready_fd, "R", 1) != 1)
        return 61;
    live L[8];
    int nl = 0;
    uint32_t id = a->first_id;
    uint64_t budget = a->budget;
    for (;;) {
        /* a new sequence: plain, or a fork of a plain one */
        size_t want = (1 + dt_below(&rng, 5)) * G.bt + (dt_below(&rng, 2) ? dt_below(&rng, G.bt) : 0);
        int from = -1;
        for (int i = 0; i < nl && from < 0; i++)
            if (L[i].plain && L[i].len > 0 && dt_below(&rng, 2))
                from = i;
        size_t final = (from >= 0 ? L[from].len : 0) + want;
        uint64_t cost = (final + G.bt - 1) / G.bt + 1; /* what the parent charges (an upper bound) */
        if (nl < 8 && dt_below(&rng, 3) == 0 && budget >= cost && id < MAX_SEQS) {
            live *l = &L[nl];
            if (from >= 0) {
                size_t split = L[from].len;
                l->c = (dt_content){L[from].c.own, split, stream_of(id)};
                l->final = split + want;
                l->plain = false;
            } else {
                l->c = dt_plain(stream_of(id));
                l->final = want;
                l->plain = true;
            }
            l->id = id++;
            budget -= cost;
            oracle_write(ofd, "P %u %llu %llu %llu %zu\n", l->id, (unsigned long long)l->c.base,
                         (unsigned long long)l->c.split, (unsigned long long)l->c.own, l->final);
            if (from >= 0) {
                if ((st = kvh_seq_fork(e, L[from].s, 0, &l->s)) != KVH_OK)
                    CHILD_FAIL(15, "fork: %s", kvh_status_name(st));
                l->len = l->c.split;
            } else {
                if ((st = kvh_seq_create(e, 0, &l->s)) != KVH_OK)
                    CHILD_FAIL(16, "create: %s", kvh_status_name(st));
                l->len = 0;
            }
            size_t first = dt_below(&rng, 2) ? l->final : l->len + 1 + dt_below(&rng, l->final - l->len);
            child_extend(e, l, first, &rng);
            nl++;
        }
        if (nl == 0)
            continue;
        live *l = &L[dt_below(&rng, (uint64_t)nl)];
        kvh_fence f;
        switch (dt_below(&rng, 9)) {
        case 0:
        case 1:
            child_persist(e, l, ofd);
            break;
        case 2: /* spill, then persist (rewrites blocks spilled without a hash) */
            if ((st = kvh_seq_migrate(e, l->s, 0, l->len, KVH_TIER_DISK, NULL)) != KVH_OK && st != KVH_ERR_NOSPACE)
                CHILD_FAIL(17, "migrate: %s", kvh_status_name(st));
            child_persist(e, l, ofd);
            break;
        case 3: /* persist, then an async spill still in flight */
            child_persist(e, l, ofd);
            if ((st = kvh_seq_migrate(e, l->s, 0, l->len, KVH_TIER_DISK, &f)) != KVH_OK)
                CHILD_FAIL(18, "migrate: %s", kvh_status_name(st));
            kvh_fence_free(e, f);
            break;
        case 4: /* spill only */
            if ((st = kvh_seq_migrate(e, l->s, 0, l->len, KVH_TIER_DISK, &f)) != KVH_OK)
                CHILD_FAIL(19, "migrate: %s", kvh_status_name(st));
            kvh_fence_free(e, f);
            break;
        case 5: /* grow */
            if (l->len < l->final)
                child_extend(e, l, l->len + 1 + dt_below(&rng, l->final - l->len), &rng);
            break;
        case 6: { /* read it all back */
            char msg[256] = "";
            st = RETRY_NOSPACE(dt_verify(e, l->s, G, l->c, 0, l->len, msg, sizeof(msg)));
            if (st != KVH_OK && st != KVH_ERR_NOSPACE)
                CHILD_FAIL(20, "read back seq %u: %s", l->id, msg);
            break;
        }
        case 7: { /* match its prefix in a new sequence */
            size_t m = 0;
            char msg[256] = "";
            st = RETRY_NOSPACE(dt_match_verify(e, G, l->c, l->len, &m, msg, sizeof(msg)));
            if (st != KVH_OK && st != KVH_ERR_NOSPACE)
                CHILD_FAIL(21, "match seq %u: %s", l->id, msg);
            break;
        }
        case 8: /* let one go (its full blocks stay cached) */
            if (nl > 2) {
                if ((st = kvh_seq_free(e, l->s)) != KVH_OK)
                    CHILD_FAIL(22, "free: %s", kvh_status_name(st));
                *l = L[--nl];
            }
            break;
        }
        if (dt_below(&rng, 40) == 0) {
            /* close (snapshot + fresh journal) and open again, so that
             * some kills land in the middle of a compaction or a recovery */
            for (int i = 0; i < nl; i++)
                kvh_seq_free(e, L[i].s);
            nl = 0;
            if ((st = kvh_engine_close(e)) != KVH_OK)
                CHILD_FAIL(23, "close: %s", kvh_status_name(st));
            e = NULL;
            if ((st = kvh_engine_open(&c, &e)) != KVH_OK)
                CHILD_FAIL(24, "reopen: %s", kvh_status_name(st));
        }
    }
}

/* ---- the parent's check ---- */

typedef struct check_result {
    int errors;
    uint64_t corrupt;
    uint64_t seqs, acked_blocks, matched_blocks;
    char msg[512];
} check_result;

/* Opens the store and checks every planned sequence of the window. */
static kvh_engine *check_store(check_result *r)
{
    memset(r, 0, sizeof(*r));
    kvh_config c = crash_cfg(S.dir);
    c.migration_threads = 0; /* moves run in the caller: no cleaner races */
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&c, &e);
    if (st != KVH_OK) {
        r->errors++;
        snprintf(r->msg, sizeof(r->msg), "reopen: %s: %s", kvh_status_name(st), kvh_last_error());
        return NULL;
    }
    for (uint32_t id = S.window_first; id < S.next_id && id < MAX_SEQS; id++) {
        planned *p = &S.seq[id];
        if (!p->used)
            continue;
        size_t m = 0;
        char msg[256] = "";
        r->seqs++;
        r->acked_blocks += p->acked;
        st = dt_match_verify(e, G, p->c, p->n, &m, msg, sizeof(msg));
        r->matched_blocks += m / G.bt;
        if (st != KVH_OK) {
            if (!r->errors++)
                snprintf(r->msg, sizeof(r->msg), "seq %u (acked %zu blocks): served wrong data: %s", id, p->acked,
                         msg);
        } else if (m < p->acked * G.bt) {
            if (!r->errors++)
                snprintf(r->msg, sizeof(r->msg),
                         "seq %u: %zu blocks were acknowledged durable, only %zu found after the crash", id, p->acked,
                         m / G.bt);
        }
    }
    r->corrupt = dt_stats(e).corrupt_blocks;
    if (r->corrupt && !r->errors++)
        snprintf(r->msg, sizeof(r->msg), "%" PRIu64 " journaled blocks failed verification after a SIGKILL",
                 r->corrupt);
    return e;
}

static int check_child(void *arg)
{
    check_result *r = arg;
    kvh_engine *e = check_store(r);
    if (r->errors) {
        fprintf(stderr, "check: %s\n", r->msg);
        return 1;
    }
    (void)e; /* ends with the engine open: the store is left unclean */
    return 0;
}

static void dump_errlog(void)
{
    size_t len = 0;
    uint8_t *b = dt_read_file(S.errlog, &len);
    if (b && len) {
        b[len] = '\0';
        print_error("child stderr:\n%s\n", (char *)b);
    }
    free(b);
}

static void test_sigkill_during_spill_and_persist(void **state)
{
    (void)state;
    const char *env = getenv("KVH_DISK_CRASH_CYCLES");
    int cycles = env && *env ? atoi(env) : 100;
    dt_rng rng = {dt_seed(0xc0ffee)};
    char root[512];
    dt_scratch("crash", root, sizeof(root));
    if (snprintf(S.dir, sizeof(S.dir), "%s/store", root) >= (int)sizeof(S.dir))
        fail_msg("scratch path too long");
    snprintf(S.oracle, sizeof(S.oracle), "%s/oracle", root);
    snprintf(S.errlog, sizeof(S.errlog), "%s/child-stderr", root);
    unlink(S.errlog);
    int windows = 1, acks_total = 0, before_ready = 0, killed_after_ack = 0, in_persist = 0;
    uint64_t checked_acked = 0, checked_matched = 0;
    double t0 = dt_now();
    for (int cycle = 0; cycle < cycles; cycle++) {
        if (S.window_blocks + 64 > WINDOW_CAP || S.next_id + 200 > MAX_SEQS) {
            /* start over with an empty store */
            dt_rmrf(S.dir);
            unlink(S.oracle);
            memset(S.seq, 0, sizeof(S.seq));
            S.window_first = S.next_id;
            S.window_blocks = 0;
            windows++;
            if (S.next_id + 200 > MAX_SEQS)
                S.next_id = S.window_first = 0;
        }
        int rp[2];
        assert_int_equal(pipe(rp), 0);
        /* every third child uses buffered I/O instead of O_DIRECT */
        child_arg a = {dt_next(&rng), cycle % 3 == 1 ? KVH_DISK_BUFFERED : 0, WINDOW_CAP - S.window_blocks,
                       S.next_id, rp[1]};
        bool early = dt_below(&rng, 10) == 0;
        uint64_t delay_us = early ? dt_below(&rng, 4000) : dt_below(&rng, 80000);
        fflush(stdout);
        fflush(stderr);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            dt_child_signals();
            close(rp[0]);
            _exit(crash_child(&a));
        }
        close(rp[1]);
        bool ready = false;
        if (!early) {
            struct pollfd pf = {rp[0], POLLIN, 0};
            char ch;
            ready = poll(&pf, 1, 20000) == 1 && read(rp[0], &ch, 1) == 1;
            if (!ready) {
                int ws;
                kill(pid, SIGKILL);
                waitpid(pid, &ws, 0);
                dump_errlog();
                fail_msg("cycle %d: the child did not open the store (status 0x%x)", cycle, ws);
            }
        } else
            before_ready++;
        usleep((useconds_t)delay_us);
        kill(pid, SIGKILL);
        int ws;
        while (waitpid(pid, &ws, 0) < 0)
            assert_int_equal(errno, EINTR);
        close(rp[0]);
        if (!(WIFSIGNALED(ws) && WTERMSIG(ws) == SIGKILL)) {
            dump_errlog();
            if (WIFSIGNALED(ws))
                fail_msg("cycle %d: the child died of signal %d (%s) (backtrace in its stderr above)", cycle,
                         WTERMSIG(ws), strsignal(WTERMSIG(ws)));
            fail_msg("cycle %d: the child ended on its own (status 0x%x) instead of being killed", cycle, ws);
        }

        int acks = oracle_read();
        in_persist += last_line_is_persist;
        uint32_t max_id = S.next_id;
        S.window_blocks = 0;
        for (uint32_t id = S.window_first; id < MAX_SEQS; id++)
            if (S.seq[id].used) {
                S.window_blocks += (S.seq[id].n + G.bt - 1) / G.bt + 1;
                if (id + 1 > max_id)
                    max_id = id + 1;
            }
        bool new_ack = false;
        for (uint32_t id = S.next_id; id < max_id; id++)
            new_ack |= S.seq[id].acked > 0;
        killed_after_ack += new_ack;
        acks_total = acks;
        S.next_id = max_id;

        check_result r;
        if (cycle % 2 == 0) {
            kvh_engine *e = dt_track(check_store(&r));
            if (r.errors) {
                dump_errlog();
                fail_msg("cycle %d (killed %s %.1f ms): %d problem(s); first: %s", cycle,
                         early ? "during open," : "after", delay_us / 1000.0, r.errors, r.msg);
            }
            dt_assert_ok(dt_close(e));
            checked_acked += r.acked_blocks;
            checked_matched += r.matched_blocks;
        } else {
            int rc = dt_in_child(check_child, &r);
            if (rc != 0) {
                dump_errlog();
                fail_msg("cycle %d (killed %s %.1f ms): the checking process failed with %d (see its stderr "
                         "above)",
                         cycle, early ? "during open," : "after", delay_us / 1000.0, rc);
            }
        }
    }
    print_message("%d kill -9 cycles in %.1f s (%d stores; kills: %d during open, %d inside a persist, %d after "
                  "new acks); last window: %d acks; checked %" PRIu64 " acknowledged blocks, %" PRIu64
                  " matched\n",
                  cycles, dt_now() - t0, windows, before_ready, in_persist, killed_after_ack, acks_total,
                  checked_acked, checked_matched);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_sigkill_during_spill_and_persist, dt_teardown),
    };
    return cmocka_run_group_tests_name("disk_crash", tests, NULL, NULL);
}
