/* Disk tier: kill -9 at random moments.
 *
 * Each cycle fork()s a child that opens the store and runs a random
 * workload of append / write_kv / fork / persist / migrate-to-disk (sync
 * and async) / read-back / free / close + reopen on sequences whose tokens
 * and K/V are pure functions of (stream, position) (disk_test_util.h).
 * The child appends a line to an oracle file (dt_oracle_write) BEFORE it
 * creates a sequence ("P": its content and planned length) and AFTER each
 * kvh_seq_persist returns KVH_OK ("A": how many full blocks are now
 * durable). The parent
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

static const dt_geo G = {2, 1, 32, 16, KVH_DTYPE_F16}; /* block = 4096 bytes */
#define DISK_SLOTS 1024
#define WINDOW_CAP 880 /* blocks the children may create before the store starts over */
#define MAX_SEQS 4096  /* ids per run (fewer than DT_ORACLE_MAX_SEQS) */

static kvh_config crash_cfg(const char *dir) { return dt_cfg(G, dir, 8, 16, DISK_SLOTS, 2); }

static struct {
    char dir[512], oracle[600], errlog[600];
    dt_oracle o;      /* what the children of the current store planned and acknowledged */
    uint32_t next_id; /* ids (and streams) never repeat in a run */
    uint32_t window_first;
    uint64_t window_blocks;
} S;

/* ---- the child's workload ---- */

/* This test is about durability only: a KVH_ERR_NOSPACE (the disk never
 * fills here, but a small host tier under the background cleaner once
 * gave spurious ones, see test_nospace_is_not_spurious in
 * test_disk_faults.c) is retried for a while, then its operation skipped;
 * a skipped persist is simply not acknowledged. */
static dt_crash_workload W = {
    .nospace_tries = 200,
    .nospace_sleep_us = 500,
    .spill_one_in = 4,
    .max_new_blocks = 5,
    .agents = 1,
    .first_stream = 0x10000,
    .max_ids = MAX_SEQS,
};

typedef struct child_arg {
    uint64_t seed;
    uint32_t disk_flags;
    uint64_t budget; /* blocks it may still create */
    uint32_t first_id;
} child_arg;

static int crash_child(void *p, int ready_fd)
{
    child_arg *a = p;
    dt_rng rng = {a->seed};
    kvh_config c = crash_cfg(S.dir);
    c.disk_flags = a->disk_flags;
    kvh_engine *e = dt_crash_start(&W, S.oracle, S.errlog, &c, ready_fd);
    kvh_status st;
    dt_live L[8];
    int nl = 0;
    uint32_t id = a->first_id;
    uint64_t budget = a->budget; /* charged dt_crash_cost per sequence, as the parent does */
    for (;;) {
        dt_crash_new_seq(&W, e, L, &nl, 8, &id, &budget, &rng);
        if (nl == 0)
            continue;
        dt_live *l = &L[dt_below(&rng, (uint64_t)nl)];
        kvh_fence f;
        switch (dt_below(&rng, 9)) {
        case 0:
        case 1:
            dt_crash_persist(&W, e, l);
            break;
        case 2: /* spill, then persist (rewrites blocks spilled without a hash) */
            if ((st = kvh_seq_migrate(e, l->s, 0, l->len, KVH_TIER_DISK, NULL)) != KVH_OK && st != KVH_ERR_NOSPACE)
                DT_CHILD_FAIL(17, "migrate: %s", kvh_status_name(st));
            dt_crash_persist(&W, e, l);
            break;
        case 3: /* persist, then an async spill still in flight */
            dt_crash_persist(&W, e, l);
            if ((st = kvh_seq_migrate(e, l->s, 0, l->len, KVH_TIER_DISK, &f)) != KVH_OK)
                DT_CHILD_FAIL(18, "migrate: %s", kvh_status_name(st));
            kvh_fence_free(e, f);
            break;
        case 4: /* spill only */
            if ((st = kvh_seq_migrate(e, l->s, 0, l->len, KVH_TIER_DISK, &f)) != KVH_OK)
                DT_CHILD_FAIL(19, "migrate: %s", kvh_status_name(st));
            kvh_fence_free(e, f);
            break;
        case 5: /* grow */
            if (l->len < l->final)
                dt_crash_extend(&W, e, l, l->len + 1 + dt_below(&rng, l->final - l->len), &rng);
            break;
        case 6: /* read it all back */
            dt_crash_read_back(&W, e, l);
            break;
        case 7: /* match its prefix in a new sequence */
            dt_crash_match_back(&W, e, l);
            break;
        case 8: /* let one go (its full blocks stay cached) */
            if (nl > 2) {
                if ((st = kvh_seq_free(e, l->s)) != KVH_OK)
                    DT_CHILD_FAIL(22, "free: %s", kvh_status_name(st));
                *l = L[--nl];
            }
            break;
        }
        if (dt_below(&rng, 40) == 0)
            dt_crash_reopen(&e, &c, L, &nl, 23);
    }
}

/* ---- the parent's check ---- */

/* Opens the store and checks every planned sequence of the window. */
static kvh_engine *check_store(dt_check *r)
{
    kvh_config c = crash_cfg(S.dir);
    c.migration_threads = 0; /* moves run in the caller: no cleaner races */
    return dt_oracle_check(&c, G, &S.o, S.window_first, r);
}

static int check_child(void *arg)
{
    dt_check *r = arg;
    kvh_engine *e = check_store(r);
    if (r->errors) {
        fprintf(stderr, "check: %s\n", r->msg);
        return 1;
    }
    (void)e; /* ends with the engine open: the store is left unclean */
    return 0;
}

static void dump_errlog(void) { dt_print_file(S.errlog, "child stderr"); }

static void test_sigkill_during_spill_and_persist(void **state)
{
    (void)state;
    const char *env = getenv("KVH_DISK_CRASH_CYCLES");
    int cycles = env && *env ? atoi(env) : 100;
    dt_rng rng = {dt_seed(0xc0ffee)};
    W.g = G; /* G is not a constant expression: W cannot be initialised with it */
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
            memset(&S.o, 0, sizeof(S.o));
            S.window_first = S.next_id;
            S.window_blocks = 0;
            windows++;
            if (S.next_id + 200 > MAX_SEQS)
                S.next_id = S.window_first = 0;
        }
        /* every third child uses buffered I/O instead of O_DIRECT */
        child_arg a = {dt_next(&rng), cycle % 3 == 1 ? KVH_DISK_BUFFERED : 0, WINDOW_CAP - S.window_blocks, S.next_id};
        bool early = dt_below(&rng, 10) == 0;
        uint64_t delay_us = early ? dt_below(&rng, 4000) : dt_below(&rng, 80000);
        int ws;
        dt_kill_result kr = dt_kill_child(crash_child, &a, early, 20000, delay_us, &ws);
        char why[160];
        if (dt_kill_failed(kr, ws, why, sizeof(why))) {
            dump_errlog();
            fail_msg("cycle %d: %s", cycle, why);
        }
        before_ready += early;

        /* the oracle file holds every line of the current store's children */
        memset(&S.o, 0, sizeof(S.o));
        dt_oracle_read(S.oracle, &S.o);
        in_persist += S.o.last_is_persist;
        uint32_t max_id = S.o.max_id > S.next_id ? S.o.max_id : S.next_id;
        S.window_blocks = 0;
        for (uint32_t id = S.window_first; id < max_id; id++)
            if (S.o.seq[id].used)
                S.window_blocks += dt_crash_cost(&W, S.o.seq[id].n);
        bool new_ack = false;
        for (uint32_t id = S.next_id; id < max_id; id++)
            new_ack |= S.o.seq[id].acked > 0;
        killed_after_ack += new_ack;
        acks_total = S.o.acks;
        S.next_id = max_id;

        dt_check r;
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
                  "new acks); last window: %d acks; checked %" PRIu64 " acknowledged blocks, %" PRIu64 " matched\n",
                  cycles, dt_now() - t0, windows, before_ready, in_persist, killed_after_ack, acks_total, checked_acked,
                  checked_matched);
}

/* A crash can lose the journal's record of a deletion while the slot it
 * freed is already reused (its data goes out with O_DIRECT, the record
 * with a buffered append): the stale record then names a slot holding
 * another block of the same prefix. The block read from that slot must
 * not be served as the persisted one (a miss, counted as corrupt). */
static const dt_geo STALE_GEO = {2, 1, 64, 16, KVH_DTYPE_F32}; /* one block = one 16 KiB slot */

static void fill_layer(kvh_engine *e, kvh_seq s, uint32_t layer, float value)
{
    float k[16 * 64], v[16 * 64];
    for (size_t i = 0; i < 16 * 64; i++)
        k[i] = v[i] = value;
    dt_assert_ok(kvh_seq_write_kv(e, s, layer, 0, 16, k, v));
}

static void test_stale_record_of_a_reused_slot_is_a_miss(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("stale-record", dir, sizeof(dir));
    dt_rmrf(dir);
    kvh_config c = dt_cfg(STALE_GEO, dir, 1, 1, 1, 0);
    int32_t tokens[16];
    for (int i = 0; i < 16; i++)
        tokens[i] = 100 + i;
    /* X: persisted, all 1.0; the store as it stood then is kept. */
    kvh_engine *e = dt_open_a(&c);
    kvh_seq s;
    dt_assert_ok(kvh_seq_create(e, 0, &s));
    dt_assert_ok(kvh_seq_append(e, s, tokens, 16));
    fill_layer(e, s, 0, 1.0f);
    fill_layer(e, s, 1, 1.0f);
    dt_assert_ok(kvh_seq_persist(e, s));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(kvh_engine_close(dt_untrack(e)));
    dt_saved_store saved;
    assert_int_equal(dt_store_save(dir, &saved), 0);
    /* Y: the same tokens, layer 0 only, spilled to the one slot (X's
     * deletion recorded), then a crash. */
    pid_t pid = dt_fork_child();
    if (pid == 0) {
        kvh_engine *ce;
        kvh_seq cs;
        if (kvh_engine_open(&c, &ce) || kvh_seq_create(ce, 0, &cs) || kvh_seq_append(ce, cs, tokens, 16))
            _exit(2);
        float k[16 * 64], v[16 * 64];
        for (size_t i = 0; i < 16 * 64; i++)
            k[i] = v[i] = 2.0f;
        if (kvh_seq_write_kv(ce, cs, 0, 0, 16, k, v) || kvh_seq_migrate(ce, cs, 0, 16, KVH_TIER_DISK, NULL))
            _exit(3);
        _exit(0);
    }
    int status = dt_reap(pid);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    /* The crash lost the deletion: the index and journal of before. */
    const char *meta[] = {"index", "journal"};
    for (int i = 0; i < 2; i++) {
        const dt_saved_file *f = dt_store_file(&saved, meta[i]);
        assert_non_null(f);
        char path[600];
        snprintf(path, sizeof(path), "%s/%s", dir, meta[i]);
        assert_int_equal(dt_write_file(path, f->data, f->len), 0);
    }
    dt_store_free(&saved);
    e = dt_open_a(&c);
    dt_assert_ok(kvh_seq_create(e, 0, &s));
    size_t matched = 0;
    kvh_status st = kvh_seq_match_prefix(e, s, tokens, 16, &matched);
    if (st == KVH_OK && matched == 16) {
        /* Served only if it is X's bytes, which the slot no longer has. */
        float k[16 * 64], v[16 * 64];
        st = kvh_seq_read_kv(e, s, 0, 0, 16, k, v);
        assert_true(st != KVH_OK || k[0] == 1.0f);
    } else {
        dt_assert_ok(st);
        assert_int_equal(matched, 0);
    }
    assert_int_equal(dt_stats(e).corrupt_blocks, 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_sigkill_during_spill_and_persist, dt_teardown),
        cmocka_unit_test_teardown(test_stale_record_of_a_reused_slot_is_a_miss, dt_teardown),
    };
    return cmocka_run_group_tests_name("disk_crash", tests, NULL, NULL);
}
