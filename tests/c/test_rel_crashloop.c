/* Reliability battery, item 1: crash loop (black box).
 *
 * Each cycle fork()s a child that opens the store and runs a random mixed
 * workload -- append + write_kv, fork, spill (sync and async migrate to
 * disk, also of half-written blocks), persist, prefetch (with and without
 * fences), acquire / release (sync and async), read back, prefix match,
 * free, and close + reopen -- with 0 to 4 migration workers, O_DIRECT or
 * buffered. The parent SIGKILLs it at a random moment (one cycle in ten
 * while the store is still opening), then reopens the store and checks it
 * against the oracle log the child kept (disk_test_util.h): every reopen
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

static const dt_geo G = {2, 1, 32, 16, KVH_DTYPE_F16}; /* block = 4096 bytes, slot = 8192 */
#define DISK_SLOTS 1024
#define WINDOW_CAP 880 /* blocks the children may create before the store starts over */
#define MAX_LIVE 8

static struct {
    char dir[512], oracle[600], errlog[600];
    dt_oracle o;
    uint32_t next_id, window_first;
    uint64_t window_blocks;
} S;

static kvh_config crash_cfg(uint32_t threads, uint32_t flags)
{
    kvh_config c = dt_cfg(G, S.dir, 8, 16, DISK_SLOTS, threads);
    c.disk_flags = flags;
    return c;
}

/* KVH_ERR_NOSPACE is not what this test is about (tiny memory tiers under
 * workers can report it transiently): retry a while, then skip. */
static dt_crash_workload W = {
    .nospace_tries = 100,
    .nospace_sleep_us = 300,
    .spill_one_in = 5,
    .max_new_blocks = 4,
    .agents = 4,
    .first_stream = 0x20000,
    .max_ids = DT_ORACLE_MAX_SEQS,
};
#define RETRY_NOSPACE(call) DT_RETRY_NOSPACE(&W, call)

/* statuses an operation may legitimately return in this workload */
static bool benign(kvh_status st) { return st == KVH_OK || st == KVH_ERR_NOSPACE; }

typedef struct child_arg {
    uint64_t seed;
    uint32_t threads, flags;
    uint64_t budget;
    uint32_t first_id;
} child_arg;

static int crash_child(void *p, int ready_fd)
{
    child_arg *a = p;
    dt_rng rng = {a->seed};
    kvh_config c = crash_cfg(a->threads, a->flags);
    kvh_engine *e = dt_crash_start(&W, S.oracle, S.errlog, &c, ready_fd);
    kvh_status st;
    dt_live L[MAX_LIVE];
    int nl = 0;
    uint32_t id = a->first_id;
    uint64_t budget = a->budget;
    for (;;) {
        dt_crash_new_seq(&W, e, L, &nl, MAX_LIVE, &id, &budget, &rng);
        if (nl == 0)
            continue;
        dt_live *l = &L[dt_below(&rng, (uint64_t)nl)];
        kvh_fence f = {0};
        uint64_t span = l->len < 4 * G.bt ? l->len : 4 * G.bt; /* acquire at most 4 blocks (device has 8) */
        switch (dt_below(&rng, 12)) {
        case 0:
        case 1:
            dt_crash_persist(&W, e, l);
            break;
        case 2: /* spill, then persist (rewrites blocks spilled without a hash) */
            if (!benign(st = kvh_seq_migrate(e, l->s, 0, l->len, KVH_TIER_DISK, NULL)))
                DT_CHILD_FAIL(17, "migrate: %s", kvh_status_name(st));
            dt_crash_persist(&W, e, l);
            break;
        case 3: /* an async spill left in flight */
            if ((st = kvh_seq_migrate(e, l->s, 0, l->len, KVH_TIER_DISK, &f)) != KVH_OK)
                DT_CHILD_FAIL(18, "async migrate: %s", kvh_status_name(st));
            kvh_fence_free(e, f);
            break;
        case 4: /* grow */
            if (l->len < l->final)
                dt_crash_extend(&W, e, l, l->len + 1 + dt_below(&rng, l->final - l->len), &rng);
            break;
        case 5: /* read it all back */
            dt_crash_read_back(&W, e, l);
            break;
        case 6: /* match its prefix in a new sequence */
            dt_crash_match_back(&W, e, l);
            break;
        case 7: /* prefetch, with a fence waited for, freed unwaited, or none */
            if (span) {
                uint64_t mode = dt_below(&rng, 3);
                st = kvh_prefetch(e, l->s, 0, span, (int32_t)dt_below(&rng, 8), mode ? &f : NULL);
                if (st != KVH_OK)
                    DT_CHILD_FAIL(22, "prefetch: %s", kvh_status_name(st));
                if (mode == 1 && !benign(st = kvh_fence_wait(e, f, UINT64_MAX)))
                    DT_CHILD_FAIL(23, "prefetch fence: %s", kvh_status_name(st));
                if (mode)
                    kvh_fence_free(e, f);
            }
            break;
        case 8: /* acquire (sync or async), read while held, release */
            if (span) {
                bool async = dt_below(&rng, 2);
                st = RETRY_NOSPACE(kvh_seq_acquire(e, l->s, 0, span, async ? &f : NULL));
                if (async && st == KVH_OK) {
                    st = kvh_fence_wait(e, f, UINT64_MAX);
                    kvh_fence_free(e, f);
                    if (st != KVH_OK && st != KVH_ERR_NOSPACE)
                        DT_CHILD_FAIL(24, "acquire fence: %s", kvh_status_name(st));
                    /* with a fence the holds stay even when it failed */
                    if (kvh_seq_release(e, l->s, 0, span) != KVH_OK)
                        DT_CHILD_FAIL(25, "release after async acquire: %s", kvh_status_name(st));
                    break;
                }
                if (!benign(st))
                    DT_CHILD_FAIL(26, "acquire: %s", kvh_status_name(st));
                if (st == KVH_OK) {
                    char msg[256] = "";
                    if (dt_verify(e, l->s, G, l->c, 0, span, msg, sizeof(msg)) != KVH_OK)
                        DT_CHILD_FAIL(27, "read while acquired: %s", msg);
                    if ((st = kvh_seq_release(e, l->s, 0, span)) != KVH_OK)
                        DT_CHILD_FAIL(28, "release: %s", kvh_status_name(st));
                }
            }
            break;
        case 9: /* demote to host */
            if (!benign(st = kvh_seq_migrate(e, l->s, 0, l->len, KVH_TIER_HOST, NULL)) && st != KVH_ERR_BUSY)
                DT_CHILD_FAIL(29, "migrate to host: %s", kvh_status_name(st));
            break;
        case 10: /* let one go (its full blocks stay cached) */
            if (nl > 2) {
                if ((st = kvh_seq_free(e, l->s)) != KVH_OK)
                    DT_CHILD_FAIL(30, "free: %s", kvh_status_name(st));
                *l = L[--nl];
            }
            break;
        case 11:
            if (dt_below(&rng, 3) == 0)
                dt_crash_reopen(&e, &c, L, &nl, 31);
            break;
        }
    }
}

/* ---- the parent ---- */

static int check_child(void *arg)
{
    dt_check *r = arg;
    kvh_config c = crash_cfg(0, 0);
    kvh_engine *e = dt_oracle_check(&c, G, &S.o, S.window_first, r);
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

static void dump_errlog(void) { dt_print_file(S.errlog, "child stderr"); }

static void test_crash_loop(void **state)
{
    (void)state;
    long cycles = dt_env_long("KVH_REL_CRASH_CYCLES", RL_SIZE(200, 5000));
    uint64_t seed = dt_seed(0xc4a5410071ull);
    dt_rng rng = {seed};
    W.g = G; /* G is not a constant expression: W cannot be initialised with it */
    char root[400];
    dt_scratch("crashloop", root, sizeof(root));
    snprintf(S.dir, sizeof(S.dir), "%s/store", root);
    snprintf(S.oracle, sizeof(S.oracle), "%s/oracle", root);
    snprintf(S.errlog, sizeof(S.errlog), "%s/child-stderr", root);
    int stores = 1, early_kills = 0, persist_kills = 0;
    uint64_t checked_acked = 0, checked_matched = 0, acks = 0;
    double t0 = dt_now();
    for (long cycle = 0; cycle < cycles; cycle++) {
        if (S.window_blocks + 64 > WINDOW_CAP || S.next_id + 300 > DT_ORACLE_MAX_SEQS) {
            dt_rmrf(S.dir);
            unlink(S.oracle);
            memset(&S.o, 0, sizeof(S.o));
            if (S.next_id + 300 > DT_ORACLE_MAX_SEQS)
                S.next_id = 0;
            S.window_first = S.next_id;
            S.window_blocks = 0;
            stores++;
        }
        unlink(S.errlog);
        static const uint32_t threads[] = {0, 1, 2, 4};
        child_arg a = {dt_next(&rng), threads[dt_below(&rng, 4)], cycle % 3 == 1 ? KVH_DISK_BUFFERED : 0,
                       WINDOW_CAP - S.window_blocks, S.next_id};
        bool early = dt_below(&rng, 10) == 0;
        uint64_t delay_us = early ? dt_below(&rng, 4000) : dt_below(&rng, 100000);
        int ws;
        dt_kill_result kr = dt_kill_child(crash_child, &a, early, 30000, delay_us, &ws);
        char why[160];
        if (dt_kill_failed(kr, ws, why, sizeof(why))) {
            dump_errlog();
            fail_msg("cycle %ld (seed 0x%" PRIx64 "): %s", cycle, seed, why);
        }
        early_kills += early;

        /* what the child planned and acknowledged */
        memset(&S.o, 0, sizeof(S.o));
        dt_oracle_read(S.oracle, &S.o);
        persist_kills += S.o.last_is_persist;
        S.window_blocks = 0;
        for (uint32_t id = S.window_first; id < S.o.max_id; id++)
            if (S.o.seq[id].used)
                S.window_blocks += dt_crash_cost(&W, S.o.seq[id].n);
        if (S.o.max_id > S.next_id)
            S.next_id = S.o.max_id;
        acks = (uint64_t)S.o.acks;

        dt_check r;
        if (cycle % 2 == 0) {
            kvh_config c = crash_cfg(0, 0);
            kvh_engine *e = dt_track(dt_oracle_check(&c, G, &S.o, S.window_first, &r));
            char msg[256] = "";
            if (!r.errors && rl_counters_add_up(e, true, msg, sizeof(msg)))
                fail_msg("cycle %ld: counters after the reopen: %s", cycle, msg);
            if (r.errors) {
                dump_errlog();
                fail_msg("cycle %ld (killed %s %.1f ms, %u workers, seed 0x%" PRIx64 "): %d problem(s); first: %s",
                         cycle, early ? "during open," : "after", delay_us / 1000.0, a.threads, seed, r.errors, r.msg);
            }
            dt_assert_ok(dt_close(e));
            checked_acked += r.acked_blocks;
            checked_matched += r.matched_blocks;
        } else {
            int rc = dt_in_child(check_child, &r);
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
                  cycles, dt_now() - t0, seed, stores, early_kills, persist_kills, checked_acked, checked_matched,
                  acks);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_crash_loop, rl_teardown),
    };
    return cmocka_run_group_tests_name("rel_crashloop", tests, NULL, NULL);
}
