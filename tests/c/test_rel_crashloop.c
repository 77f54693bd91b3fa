/* Reliability battery, item 1: crash loop (black box).
 *
 * Each cycle fork()s a child that opens the store and runs a random mixed
 * workload -- append + write_kv, fork, spill (sync and async migrate to
 * disk, also of half-written blocks), persist, prefetch (with and without
 * fences), acquire / release (sync and async), read back, prefix match,
 * free, and close + reopen -- with 0 to 4 migration workers, O_DIRECT or
 * buffered. The parent SIGKILLs it at a random moment (one cycle in ten
 * while the store is still opening), then reopens the store and checks it
 * against the oracle log the child kept (rel_util.h): every reopen
 * succeeds, every block acknowledged durable (kvh_seq_persist returned
 * KVH_OK) is found, every byte served equals the content (0 corrupt blocks
 * served), stats.corrupt_blocks stays 0 (a kill loses no written data, so
 * nothing can fail verification), and the counters add up.
 *
 * The store carries over from cycle to cycle (older acknowledgements are
 * re-checked after every later kill) until the blocks created approach the
 * disk's slots (the disk never fills, so no durable block may be evicted);
 * then it starts over. Even cycles check in this process and close the
 * engine cleanly; odd cycles check in a child that exits without closing,
 * so the next workload recovers a store that was never closed.
 *
 * Sizes: 200 cycles (CI), 5,000 (test_rel_crashloop_stress);
 * KVH_REL_CRASH_CYCLES overrides, KVH_TEST_SEED sets the seed.
 */
#include "rel_util.h"

#include <poll.h>

static const rl_geo G = {2, 1, 32, 16, KVH_DTYPE_F16}; /* block = 4096 bytes, slot = 8192 */
#define DISK_SLOTS 1024
#define WINDOW_CAP 880 /* blocks the children may create before the store starts over */
#define MAX_LIVE 8

static struct {
    char dir[512], oracle[600], errlog[600];
    rl_oracle o;
    uint32_t next_id, window_first;
    uint64_t window_blocks;
} S;

static kvh_config crash_cfg(uint32_t threads, uint32_t flags)
{
    kvh_config c = rl_cfg(G, S.dir, 8, 16, DISK_SLOTS, threads);
    c.disk_flags = flags;
    return c;
}

static uint64_t stream_of(uint32_t id) { return 0x20000ull + id; }
static uint64_t cost_of(size_t n) { return (n + G.bt - 1) / G.bt + 1; }

/* KVH_ERR_NOSPACE is not what this test is about (tiny memory tiers under
 * workers can report it transiently): retry a while, then skip. */
#define RETRY_NOSPACE(call)                                                                                  \
    ({                                                                                                       \
        kvh_status rs_;                                                                                      \
        for (int try_ = 0; (rs_ = (call)) == KVH_ERR_NOSPACE && try_ < 100; try_++)                          \
            usleep(300);                                                                                     \
        rs_;                                                                                                 \
    })

#define CHILD_FAIL(code, ...)                                                                                \
    do {                                                                                                     \
        fprintf(stderr, "child: " __VA_ARGS__);                                                              \
        fprintf(stderr, " (%s)\n", kvh_last_error());                                                        \
        _exit(code);                                                                                         \
    } while (0)

/* statuses an operation may legitimately return in this workload */
static bool benign(kvh_status st) { return st == KVH_OK || st == KVH_ERR_NOSPACE; }

typedef struct live {
    kvh_seq s;
    uint32_t id;
    rl_content c;
    size_t len, final;
    bool plain;
} live;

typedef struct child_arg {
    uint64_t seed;
    uint32_t threads, flags;
    uint64_t budget;
    uint32_t first_id;
    int ready_fd;
} child_arg;

static void child_extend(kvh_engine *e, live *l, size_t to, rl_rng *rng)
{
    if (to <= l->len)
        return;
    size_t n = to - l->len, tb = rl_tok_bytes(G);
    int32_t *tk = malloc(sizeof(int32_t) * n);
    uint8_t *k = malloc(tb * n), *v = malloc(tb * n);
    rl_tokens(l->c, l->len, n, tk);
    kvh_status st = RETRY_NOSPACE(kvh_seq_append(e, l->s, tk, n));
    if (st != KVH_OK)
        CHILD_FAIL(11, "append %zu to seq %u: %s", n, l->id, kvh_status_name(st));
    for (uint32_t layer = 0; layer < G.layers; layer++) {
        for (size_t t = 0; t < n; t++) {
            rl_kv_token(l->c, layer, l->len + t, 0, k + t * tb, tb);
            rl_kv_token(l->c, layer, l->len + t, 1, v + t * tb, tb);
        }
        if ((st = RETRY_NOSPACE(kvh_seq_write_kv(e, l->s, layer, l->len, n, k, v))) != KVH_OK)
            CHILD_FAIL(12, "write_kv seq %u: %s", l->id, kvh_status_name(st));
        /* a spill of half-written blocks (they come back for the next layer) */
        if (layer == 0 && rl_below(rng, 5) == 0 &&
            !benign(st = kvh_seq_migrate(e, l->s, 0, to, KVH_TIER_DISK, NULL)))
            CHILD_FAIL(13, "spill of half-written seq %u: %s", l->id, kvh_status_name(st));
    }
    l->len = to;
    free(tk);
    free(k);
    free(v);
}

static void child_persist(kvh_engine *e, live *l, int ofd)
{
    rl_oracle_write(ofd, "S %u\n", l->id); /* statistics only: a kill inside persist */
    kvh_status st = RETRY_NOSPACE(kvh_seq_persist(e, l->s));
    if (st == KVH_ERR_NOSPACE)
        return; /* not acknowledged */
    if (st != KVH_OK)
        CHILD_FAIL(14, "persist seq %u: %s", l->id, kvh_status_name(st));
    rl_oracle_write(ofd, "A %u %zu\n", l->id, l->len / G.bt);
}

static int crash_child(child_arg *a)
{
    rl_rng rng = {a->seed};
    int ofd = open(S.oracle, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    int efd = open(S.errlog, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (ofd < 0 || efd < 0)
        return 60;
    dup2(efd, 2);
    kvh_config c = crash_cfg(a->threads, a->flags);
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&c, &e);
    if (st != KVH_OK)
        CHILD_FAIL(10, "open: %s", kvh_status_name(st));
    if (write(a->ready_fd, "R", 1) != 1)
        return 61;
    live L[MAX_LIVE];
    int nl = 0;
    uint32_t id = a->first_id;
    uint64_t budget = a->budget;
    for (;;) {
        /* a new sequence: plain, or a fork of a plain one */
        size_t want = (1 + rl_below(&rng, 4)) * G.bt + (rl_below(&rng, 2) ? rl_below(&rng, G.bt) : 0);
        int from = -1;
        for (int i = 0; i < nl && from < 0; i++)
            if (L[i].plain && L[i].len > 0 && rl_below(&rng, 2))
                from = i;
        size_t final = (from >= 0 ? L[from].len : 0) + want;
        if (nl < MAX_LIVE && rl_below(&rng, 3) == 0 && budget >= cost_of(final) && id < RL_MAX_SEQS) {
            live *l = &L[nl];
            if (from >= 0) {
                l->c = (rl_content){L[from].c.own, L[from].len, stream_of(id)};
                l->final = final;
                l->plain = false;
            } else {
                l->c = rl_plain(stream_of(id));
                l->final = want;
                l->plain = true;
            }
            l->id = id++;
            budget -= cost_of(final);
            rl_oracle_write(ofd, "P %u %llu %llu %llu %zu\n", l->id, (unsigned long long)l->c.base,
                            (unsigned long long)l->c.split, (unsigned long long)l->c.own, l->final);
            if (from >= 0) {
                if ((st = kvh_seq_fork(e, L[from].s, (uint32_t)rl_below(&rng, 4), &l->s)) != KVH_OK)
                    CHILD_FAIL(15, "fork: %s", kvh_status_name(st));
                l->len = l->c.split;
            } else {
                if ((st = kvh_seq_create(e, (uint32_t)rl_below(&rng, 4), &l->s)) != KVH_OK)
                    CHILD_FAIL(16, "create: %s", kvh_status_name(st));
                l->len = 0;
            }
            size_t first = rl_below(&rng, 2) ? l->final : l->len + 1 + rl_below(&rng, l->final - l->len);
            child_extend(e, l, first, &rng);
            nl++;
        }
        if (nl == 0)
            continue;
        live *l = &L[rl_below(&rng, (uint64_t)nl)];
        kvh_fence f = {0};
        uint64_t span = l->len < 4 * G.bt ? l->len : 4 * G.bt; /* acquire at most 4 blocks (device has 8) */
        switch (rl_below(&rng, 12)) {
        case 0:
        case 1:
            child_persist(e, l, ofd);
            break;
        case 2: /* spill, then persist (rewrites blocks spilled without a hash) */
            if (!benign(st = kvh_seq_migrate(e, l->s, 0, l->len, KVH_TIER_DISK, NULL)))
                CHILD_FAIL(17, "migrate: %s", kvh_status_name(st));
            child_persist(e, l, ofd);
            break;
        case 3: /* an async spill left in flight */
            if ((st = kvh_seq_migrate(e, l->s, 0, l->len, KVH_TIER_DISK, &f)) != KVH_OK)
                CHILD_FAIL(18, "async migrate: %s", kvh_status_name(st));
            kvh_fence_free(e, f);
            break;
        case 4: /* grow */
            if (l->len < l->final)
                child_extend(e, l, l->len + 1 + rl_below(&rng, l->final - l->len), &rng);
            break;
        case 5: { /* read it all back */
            char msg[256] = "";
            st = RETRY_NOSPACE(rl_verify(e, l->s, G, l->c, 0, l->len, msg, sizeof(msg)));
            if (!benign(st))
                CHILD_FAIL(20, "read back seq %u: %s", l->id, msg);
            break;
        }
        case 6: { /* match its prefix in a new sequence */
            size_t m = 0;
            char msg[256] = "";
            st = RETRY_NOSPACE(rl_match_verify(e, G, l->c, l->len, &m, msg, sizeof(msg)));
            if (!benign(st))
                CHILD_FAIL(21, "match seq %u: %s", l->id, msg);
            break;
        }
        case 7: /* prefetch, with a fence waited for, freed unwaited, or none */
            if (span) {
                uint64_t mode = rl_below(&rng, 3);
                st = kvh_prefetch(e, l->s, 0, span, (int32_t)rl_below(&rng, 8), mode ? &f : NULL);
                if (st != KVH_OK)
                    CHILD_FAIL(22, "prefetch: %s", kvh_status_name(st));
                if (mode == 1 && !benign(st = kvh_fence_wait(e, f, UINT64_MAX)))
                    CHILD_FAIL(23, "prefetch fence: %s", kvh_status_name(st));
                if (mode)
                    kvh_fence_free(e, f);
            }
            break;
        case 8: /* acquire (sync or async), read while held, release */
            if (span) {
                bool async = rl_below(&rng, 2);
                st = RETRY_NOSPACE(kvh_seq_acquire(e, l->s, 0, span, async ? &f : NULL));
                if (async && st == KVH_OK) {
                    st = kvh_fence_wait(e, f, UINT64_MAX);
                    kvh_fence_free(e, f);
                    if (st != KVH_OK && st != KVH_ERR_NOSPACE)
                        CHILD_FAIL(24, "acquire fence: %s", kvh_status_name(st));
                    /* with a fence the holds stay even when it failed */
                    if (kvh_seq_release(e, l->s, 0, span) != KVH_OK)
                        CHILD_FAIL(25, "release after async acquire: %s", kvh_status_name(st));
                    break;
                }
                if (!benign(st))
                    CHILD_FAIL(26, "acquire: %s", kvh_status_name(st));
                if (st == KVH_OK) {
                    char msg[256] = "";
                    if (rl_verify(e, l->s, G, l->c, 0, span, msg, sizeof(msg)) != KVH_OK)
                        CHILD_FAIL(27, "read while acquired: %s", msg);
                    if ((st = kvh_seq_release(e, l->s, 0, span)) != KVH_OK)
                        CHILD_FAIL(28, "release: %s", kvh_status_name(st));
                }
            }
            break;
        case 9: /* demote to host */
            if (!benign(st = kvh_seq_migrate(e, l->s, 0, l->len, KVH_TIER_HOST, NULL)) && st != KVH_ERR_BUSY)
                CHILD_FAIL(29, "migrate to host: %s", kvh_status_name(st));
            break;
        case 10: /* let one go (its full blocks stay cached) */
            if (nl > 2) {
                if ((st = kvh_seq_free(e, l->s)) != KVH_OK)
                    CHILD_FAIL(30, "free: %s", kvh_status_name(st));
                *l = L[--nl];
            }
            break;
        case 11:
            if (rl_below(&rng, 3) == 0) {
                /* close (snapshot + fresh journal) and open again: kills
                 * land inside compactions and recoveries too */
                for (int i = 0; i < nl; i++)
                    kvh_seq_free(e, L[i].s);
                nl = 0;
                if ((st = kvh_engine_close(e)) != KVH_OK)
                    CHILD_FAIL(31, "close: %s", kvh_status_name(st));
                e = NULL;
                if ((st = kvh_engine_open(&c, &e)) != KVH_OK)
                    CHILD_FAIL(32, "reopen: %s", kvh_status_name(st));
            }
            break;
        }
    }
}

/* ---- the parent ---- */

static int check_child(void *arg)
{
    rl_check *r = arg;
    kvh_config c = crash_cfg(0, 0);
    kvh_engine *e = rl_oracle_check(&c, G, &S.o, S.window_first, r);
    if (!r->errors && e) {
        char msg[256];
        if (rl_counters_add_up(e, true, msg, sizeof(msg))) {
            fprintf(stderr, "check: counters: %s\n", msg);
            return 2;
        }
    }
    if (r->errors) {
        fprintf(stderr, "check: %s\n", r->msg);
        return 1;
    }
    return 0; /* ends with the engine open: the store is left unclean */
}

static void dump_errlog(void)
{
    size_t len = 0;
    uint8_t *b = rl_read_file(S.errlog, &len);
    if (b && len) {
        b[len] = '\0';
        print_error("child stderr:\n%s\n", (char *)b);
    }
    free(b);
}

static void test_crash_loop(void **state)
{
    (void)state;
    long cycles = rl_env_long("KVH_REL_CRASH_CYCLES", RL_SIZE(200, 5000));
    uint64_t seed = rl_seed(0xc4a5410071ull);
    rl_rng rng = {seed};
    char root[400];
    rl_scratch("crashloop", root, sizeof(root));
    snprintf(S.dir, sizeof(S.dir), "%s/store", root);
    snprintf(S.oracle, sizeof(S.oracle), "%s/oracle", root);
    snprintf(S.errlog, sizeof(S.errlog), "%s/child-stderr", root);
    int stores = 1, early_kills = 0, persist_kills = 0;
    uint64_t checked_acked = 0, checked_matched = 0, acks = 0;
    double t0 = rl_now();
    for (long cycle = 0; cycle < cycles; cycle++) {
        if (S.window_blocks + 64 > WINDOW_CAP || S.next_id + 300 > RL_MAX_SEQS) {
            rl_rmrf(S.dir);
            unlink(S.oracle);
            memset(&S.o, 0, sizeof(S.o));
            if (S.next_id + 300 > RL_MAX_SEQS)
                S.next_id = 0;
            S.window_first = S.next_id;
            S.window_blocks = 0;
            stores++;
        }
        unlink(S.errlog);
        int rp[2];
        assert_int_equal(pipe(rp), 0);
        static const uint32_t threads[] = {0, 1, 2, 4};
        child_arg a = {rl_next(&rng), threads[rl_below(&rng, 4)], cycle % 3 == 1 ? KVH_DISK_BUFFERED : 0,
                       WINDOW_CAP - S.window_blocks, S.next_id, rp[1]};
        bool early = rl_below(&rng, 10) == 0;
        uint64_t delay_us = early ? rl_below(&rng, 4000) : rl_below(&rng, 100000);
        fflush(stdout);
        fflush(stderr);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            rl_child_signals();
            close(rp[0]);
            _exit(crash_child(&a));
        }
        close(rp[1]);
        if (!early) {
            struct pollfd pf = {rp[0], POLLIN, 0};
            char ch;
            if (!(poll(&pf, 1, 30000) == 1 && read(rp[0], &ch, 1) == 1)) {
                int ws;
                kill(pid, SIGKILL);
                waitpid(pid, &ws, 0);
                dump_errlog();
                fail_msg("cycle %ld: the child did not open the store (status 0x%x)", cycle, ws);
            }
        } else
            early_kills++;
        usleep((useconds_t)delay_us);
        kill(pid, SIGKILL);
        int ws;
        while (waitpid(pid, &ws, 0) < 0)
            assert_int_equal(errno, EINTR);
        close(rp[0]);
        if (!(WIFSIGNALED(ws) && WTERMSIG(ws) == SIGKILL)) {
            dump_errlog();
            if (WIFSIGNALED(ws))
                fail_msg("cycle %ld: the child died of signal %d (%s)", cycle, WTERMSIG(ws), strsignal(WTERMSIG(ws)));
            fail_msg("cycle %ld: the child ended on its own (exit %d) instead of being killed (seed 0x%" PRIx64 ")",
                     cycle, WIFEXITED(ws) ? WEXITSTATUS(ws) : -1, seed);
        }

        /* what the child planned and acknowledged */
        memset(&S.o, 0, sizeof(S.o));
        rl_oracle_read(S.oracle, &S.o);
        {
            size_t len = 0;
            uint8_t *b = rl_read_file(S.oracle, &len);
            /* was the last line a persist that never returned? */
            if (b && len >= 2) {
                size_t i = len - 1;
                while (i > 0 && b[i - 1] != '\n')
                    i--;
                persist_kills += b[i] == 'S';
            }
            free(b);
        }
        S.window_blocks = 0;
        for (uint32_t id = S.window_first; id < S.o.max_id; id++)
            if (S.o.seq[id].used)
                S.window_blocks += cost_of(S.o.seq[id].n);
        if (S.o.max_id > S.next_id)
            S.next_id = S.o.max_id;
        acks = (uint64_t)S.o.acks;

        rl_check r;
        if (cycle % 2 == 0) {
            kvh_config c = crash_cfg(0, 0);
            kvh_engine *e = rl_track(rl_oracle_check(&c, G, &S.o, S.window_first, &r));
            char msg[256] = "";
            if (!r.errors && rl_counters_add_up(e, true, msg, sizeof(msg)))
                fail_msg("cycle %ld: counters after the reopen: %s", cycle, msg);
            if (r.errors) {
                dump_errlog();
                fail_msg("cycle %ld (killed %s %.1f ms, %u workers, seed 0x%" PRIx64 "): %d problem(s); first: %s",
                         cycle, early ? "during open," : "after", delay_us / 1000.0, a.threads, seed, r.errors, r.msg);
            }
            rl_assert_ok(rl_close(e));
            checked_acked += r.acked_blocks;
            checked_matched += r.matched_blocks;
        } else {
            int rc = rl_in_child(check_child, &r);
            if (rc != 0) {
                dump_errlog();
                fail_msg("cycle %ld (killed %s %.1f ms, %u workers, seed 0x%" PRIx64
                         "): the checking process failed with %d (its stderr is above)",
                         cycle, early ? "during open," : "after", delay_us / 1000.0, a.threads, seed, rc);
            }
        }
    }
    print_message("crash loop: %ld SIGKILL cycles in %.1f s (seed 0x%" PRIx64 "; %d stores; %d kills during open, "
                  "%d inside a persist); in-process checks covered %" PRIu64 " acknowledged blocks (%" PRIu64
                  " matched); last store: %" PRIu64 " acks; 0 reopen failures, 0 corrupt, 0 lost\n",
                  cycles, rl_now() - t0, seed, stores, early_kills, persist_kills, checked_acked, checked_matched,
                  acks);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_crash_loop, rl_teardown),
    };
    return cmocka_run_group_tests_name("rel_crashloop", tests, NULL, NULL);
}
