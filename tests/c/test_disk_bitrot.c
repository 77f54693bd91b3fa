/* Disk store: damage beyond single bit flips, and files of other times or
 * other stores.
 *
 * test_rel_bitrot.c flips one bit per chain and test_disk_index_damage.c
 * every bit of the index headers; here the damage is what a failing disk,
 * a bad copy or a careless operator leaves:
 *
 *   - bursts: random byte ranges zeroed or overwritten with random bytes,
 *     several bits flipped within one page, a page copied over another,
 *     files cut to any length (not a multiple of anything) or extended with
 *     garbage, in the slab file, the snapshot `index`, the `journal` and
 *     the LOCK file, one to four of them at a time;
 *   - rollbacks: the index and journal of an earlier state of the store
 *     beside slab files whose slots have since been reused by other blocks
 *     (every mix of old and new index, journal and slabs);
 *   - transplants: one store's slab file, index or journal in another store
 *     of the same geometry.
 *
 * After each, an engine opens the store (with and without
 * disk_strict_index) and every chain is matched and read back. Pass: the
 * open succeeds or fails with a documented status and a message; nothing
 * is ever served wrong (a block is exact or missing); without
 * disk_strict_index, every chain none of whose slots was touched is found
 * whole (damage costs the damaged blocks only); the engine closes and
 * the store opens again after that close with nothing lost that the first
 * open found. Under ASan (build-asan) the same rounds also check that no
 * damage makes the library read or write out of bounds.
 *
 * KVH_DISK_BITROT_ROUNDS sets the number of burst rounds (default 200),
 * KVH_DISK_REBUILD_KILLS the kill rounds (default 30);
 * KVH_TEST_SEED the seed.
 */
#include "disk_test_util.h"
#include "rel_util.h"

#include "core/disk_io.h"

static const dt_geo G = {1, 1, 64, 16, KVH_DTYPE_F16}; /* block = 4096 bytes, slot = 8192 */
#define SLOT_BYTES 8192u
#define DISK_SLOTS 96
#define NC 24 /* chains */
#define NB 3  /* blocks a chain */
#define SNAP 12

static dt_content chain(int c) { return dt_plain(0xb17707 + (uint64_t)c); }
static dt_chains chains(void) { return (dt_chains){G, chain, NC, NB, SNAP}; }

static kvh_config cfg_for(const char *dir, bool strict)
{
    kvh_config c = dt_cfg(G, dir, 8, 16, DISK_SLOTS, 0);
    c.disk_strict_index = strict;
    return c;
}

/* Most rounds run on a tmpfs (rl_fast_scratch: each open and close syncs,
 * and the subject here is the format, not the device); every REAL_EVERY-th
 * on the real disk, where the slab files are O_DIRECT. */
#define REAL_EVERY 8

static struct {
    char dir[512]; /* the store of the current round: disk_dir or fast_dir */
    char disk_dir[512], fast_dir[512];
    bool fast;
    dt_saved_store saved;
    dt_block_loc loc[NC][NB];
    size_t journal_records;
} P;

static void restore_in(long round)
{
    snprintf(P.dir, sizeof(P.dir), "%s", (!P.fast || round % REAL_EVERY == 0) ? P.disk_dir : P.fast_dir);
    dt_rmrf(P.dir);
    mkdir(P.dir, 0700);
    assert_int_equal(dt_store_restore(P.dir, &P.saved), 0);
}

static int group_setup(void **state)
{
    (void)state;
    dt_scratch("bitrot-burst", P.disk_dir, sizeof(P.disk_dir));
    P.fast = rl_fast_scratch("bitrot-burst", P.fast_dir, sizeof(P.fast_dir));
    snprintf(P.dir, sizeof(P.dir), "%s", P.disk_dir);
    kvh_config c = cfg_for(P.dir, false);
    dt_chains ch = chains();
    dt_chains_build_a(&c, &ch, &P.saved, &P.loc[0][0], &P.journal_records);
    return 0;
}

static int group_teardown(void **state)
{
    dt_teardown(state);
    dt_store_free(&P.saved);
    dt_rmrf(P.disk_dir);
    if (P.fast)
        rl_fast_cleanup(); /* the process's directory on the tmpfs, not only this scratch */
    return 0;
}

/* ---- what an engine serves from a store ---- */

typedef struct served {
    kvh_status open;
    char error[256];
    size_t matched[NC]; /* tokens, all verified byte for byte */
    uint64_t corrupt;
} served;

/* Opens the store, matches and verifies every chain, closes. Fails the
 * test on wrong bytes, an undocumented status, or a refusal without a
 * message. */
static served serve(const kvh_config *c, const char *what)
{
    served s;
    memset(&s, 0, sizeof(s));
    kvh_engine *e = NULL;
    s.open = kvh_engine_open(c, &e);
    snprintf(s.error, sizeof(s.error), "%s", kvh_last_error());
    if (s.open != KVH_OK) {
        /* documented refusals of a damaged store */
        if (s.open != KVH_ERR_CORRUPT && s.open != KVH_ERR_IO && s.open != KVH_ERR_MISMATCH)
            fail_msg("%s: open returned %s (%s)", what, kvh_status_name(s.open), s.error);
        if (!s.error[0])
            fail_msg("%s: open refused the store (%s) without saying why", what, kvh_status_name(s.open));
        assert_null(e);
        return s;
    }
    dt_track(e);
    for (int i = 0; i < NC; i++) {
        char msg[256] = "";
        kvh_status st = dt_match_verify(e, G, chain(i), (size_t)NB * G.bt, &s.matched[i], msg, sizeof(msg));
        if (st != KVH_OK)
            fail_msg("%s: chain %d: %s", what, i, msg);
    }
    s.corrupt = dt_stats(e).corrupt_blocks;
    dt_assert_ok(dt_close(dt_untrack(e)));
    return s;
}

/* ---- bursts ---- */

enum burst_kind { B_ZERO, B_RANDOM, B_BITS, B_PAGE_COPY, B_TRUNCATE, B_EXTEND, B_KINDS };
static const char *const burst_names[B_KINDS] = {
    "zeroed range", "random range", "bits in a page", "page copied over another", "cut", "extended"};

typedef struct burst {
    enum burst_kind k;
    const char *file;
    uint64_t off, len;
} burst;

static void apply_burst(dt_rng *r, burst *b, bool *touched)
{
    static const char *const files[] = {"slab-0000.kvh", "index", "journal", "LOCK"};
    /* the slab file is most of the store: half the bursts go there */
    uint64_t fi = dt_below(r, 8);
    b->file = files[fi < 4 ? 0 : fi - 3 < 4 ? fi - 3 : 0];
    char p[PATH_MAX];
    dt_path(p, sizeof(p), P.dir, b->file);
    size_t len = 0;
    uint8_t *d = dt_read_file(p, &len);
    if (!d) { /* a file an earlier burst of the round cut to nothing is still there */
        b->k = B_EXTEND;
        d = calloc(1, 1);
        len = 0;
    } else
        b->k = (enum burst_kind)dt_below(r, B_KINDS);
    if (len == 0 && b->k != B_EXTEND)
        b->k = B_EXTEND;
    bool slab = strcmp(b->file, "slab-0000.kvh") == 0;
    uint64_t end = len;
    switch (b->k) {
    case B_ZERO:
    case B_RANDOM:
        b->off = dt_below(r, len);
        b->len = 1 + dt_below(r, dt_below(r, 4) == 0 ? 16384 : 64);
        if (b->off + b->len > len)
            b->len = len - b->off;
        for (uint64_t i = 0; i < b->len; i++)
            d[b->off + i] = b->k == B_ZERO ? 0 : (uint8_t)dt_next(r);
        break;
    case B_BITS: {
        uint64_t page = dt_below(r, (len + 4095) / 4096) * 4096;
        uint64_t plen = len - page < 4096 ? len - page : 4096;
        int n = 2 + (int)dt_below(r, 7);
        b->off = page;
        b->len = plen;
        for (int i = 0; i < n; i++)
            d[page + dt_below(r, plen)] ^= (uint8_t)(1u << dt_below(r, 8));
        break;
    }
    case B_PAGE_COPY: {
        uint64_t pages = len / 4096;
        if (pages < 2) {
            b->off = 0;
            b->len = 0;
            break;
        }
        uint64_t from = dt_below(r, pages), to = dt_below(r, pages);
        memcpy(d + to * 4096, d + from * 4096, 4096);
        b->off = to * 4096;
        b->len = from == to ? 0 : 4096;
        break;
    }
    case B_TRUNCATE:
        end = dt_below(r, len);
        b->off = end;
        b->len = len - end;
        break;
    case B_EXTEND: {
        uint64_t extra = 1 + dt_below(r, 3 * 4096);
        uint8_t *nd = realloc(d, len + extra);
        assert_non_null(nd);
        d = nd;
        for (uint64_t i = 0; i < extra; i++)
            d[len + i] = (uint8_t)dt_next(r);
        end = len + extra;
        b->off = len;
        b->len = 0; /* nothing of the store's own bytes changed */
        break;
    }
    default:
        break;
    }
    assert_int_equal(dt_write_file(p, d, end), 0);
    free(d);
    if (slab && b->len)
        for (uint64_t s = b->off / SLOT_BYTES; s <= (b->off + b->len - 1) / SLOT_BYTES && s < DISK_SLOTS; s++)
            touched[s] = true;
}

static void test_bursts_never_serve_wrong_bytes(void **state)
{
    (void)state;
    long rounds = dt_env_long("KVH_DISK_BITROT_ROUNDS", 200);
    uint64_t seed = dt_seed(0xb0257u);
    dt_rng r = {seed};
    long refused = 0, strict_refused = 0, lost_blocks = 0, bursts_by_kind[B_KINDS] = {0};
    for (long round = 0; round < rounds; round++) {
        restore_in(round);
        bool touched[DISK_SLOTS] = {false};
        burst b[4];
        int nb = 1 + (int)dt_below(&r, 4);
        char what[512];
        int w = snprintf(what, sizeof(what), "round %ld (seed 0x%" PRIx64 "):", round, seed);
        for (int i = 0; i < nb; i++) {
            apply_burst(&r, &b[i], touched);
            bursts_by_kind[b[i].k]++;
            if (w < (int)sizeof(what))
                w += snprintf(what + w, sizeof(what) - (size_t)w, " %s of %s at %" PRIu64 " +%" PRIu64 ";",
                              burst_names[b[i].k], b[i].file, b[i].off, b[i].len);
        }
        dt_saved_store damaged;
        assert_int_equal(dt_store_save(P.dir, &damaged), 0);

        /* strict: refuse or serve exact bytes (checked inside serve) */
        kvh_config strict = cfg_for(P.dir, true);
        served st = serve(&strict, what);
        strict_refused += st.open != KVH_OK;

        /* lenient, from the same damaged files */
        dt_rmrf(P.dir);
        mkdir(P.dir, 0700);
        assert_int_equal(dt_store_restore(P.dir, &damaged), 0);
        dt_store_free(&damaged);
        kvh_config lenient = cfg_for(P.dir, false);
        served s = serve(&lenient, what);
        if (s.open != KVH_OK) {
            refused++;
            fail_msg("%s lenient open refused the store: %s (%s)", what, kvh_status_name(s.open), s.error);
        }
        for (int c = 0; c < NC; c++) {
            bool hit = false;
            for (int k = 0; k < NB; k++)
                hit |= touched[P.loc[c][k].slot];
            if (!hit && s.matched[c] != (size_t)NB * G.bt)
                fail_msg("%s chain %d: none of its slots was touched, yet %zu of %u tokens matched", what, c,
                         s.matched[c], NB * G.bt);
            lost_blocks += NB - (long)(s.matched[c] / G.bt);
        }
        /* what the first open kept (and rewrote) survives a second open */
        served again = serve(&lenient, what);
        assert_int_equal(again.open, KVH_OK);
        for (int c = 0; c < NC; c++)
            if (again.matched[c] < s.matched[c])
                fail_msg("%s chain %d: %zu tokens after the first open, %zu after the second", what, c, s.matched[c],
                         again.matched[c]);
        if (again.corrupt != 0)
            fail_msg("%s the store the first open rebuilt still reports %" PRIu64 " corrupt blocks", what,
                     again.corrupt);
    }
    printf("bursts: %ld rounds (seed 0x%" PRIx64 "): zeroed %ld, random %ld, bits %ld, page copies %ld, cuts %ld, "
           "extensions %ld; %ld strict refusals, %ld lenient refusals, %ld blocks lost in all\n",
           rounds, seed, bursts_by_kind[B_ZERO], bursts_by_kind[B_RANDOM], bursts_by_kind[B_BITS],
           bursts_by_kind[B_PAGE_COPY], bursts_by_kind[B_TRUNCATE], bursts_by_kind[B_EXTEND], strict_refused, refused,
           lost_blocks);
}

/* ---- rollbacks: files of two moments of one store ---- */

/* Builds and persists chains of stream base + [first, last]. */
static void persist_streams(kvh_engine *e, uint64_t base, int first, int last)
{
    for (int i = first; i <= last; i++) {
        kvh_seq s;
        dt_assert_ok(dt_build(e, G, dt_plain(base + (uint64_t)i), (size_t)NB * G.bt, 0, &s));
        dt_assert_ok(kvh_seq_persist(e, s));
        dt_assert_ok(kvh_seq_free(e, s));
    }
}

static void check_streams(const kvh_config *c, uint64_t base, int n, const char *what, size_t *matched_total)
{
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(c, &e);
    if (st != KVH_OK) {
        if (st != KVH_ERR_CORRUPT && st != KVH_ERR_IO)
            fail_msg("%s: open returned %s (%s)", what, kvh_status_name(st), kvh_last_error());
        return;
    }
    dt_track(e);
    for (int i = 0; i < n; i++) {
        size_t m = 0;
        char msg[256] = "";
        if (dt_match_verify(e, G, dt_plain(base + (uint64_t)i), (size_t)NB * G.bt, &m, msg, sizeof(msg)) != KVH_OK)
            fail_msg("%s: stream %d: %s", what, i, msg);
        *matched_total += m;
    }
    dt_assert_ok(dt_close(dt_untrack(e)));
}

static void test_rollback_mixes_never_serve_wrong_bytes(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("bitrot-rollback", dir, sizeof(dir));
    /* 10 slots: state A holds 3 chains (9 blocks); state B persists 3 new
     * chains, so the disk has to drop blocks of A and reuse their slots. */
    kvh_config c = dt_cfg(G, dir, 2, 2, 10, 0);
    const uint64_t A = 0xa0000, B = 0xb0000;
    kvh_engine *e = dt_open_a(&c);
    persist_streams(e, A, 0, 2);
    dt_assert_ok(dt_close(dt_untrack(e)));
    dt_saved_store old;
    assert_int_equal(dt_store_save(dir, &old), 0);
    e = dt_open_a(&c);
    persist_streams(e, B, 0, 2);
    kvh_stats st = dt_stats(e);
    dt_assert_ok(dt_close(dt_untrack(e)));
    assert_true(st.drops > 0); /* slots of A were reused */
    dt_saved_store cur;
    assert_int_equal(dt_store_save(dir, &cur), 0);

    static const char *const names[] = {"index", "journal", "slab-0000.kvh"};
    int mixes = 0;
    for (int mask = 1; mask < 8; mask++) { /* bit i: file i from the old state */
        for (int strict = 0; strict < 2; strict++) {
            dt_rmrf(dir);
            mkdir(dir, 0700);
            assert_int_equal(dt_store_restore(dir, &cur), 0);
            char what[128];
            snprintf(what, sizeof(what), "old:%s%s%s new: the rest, strict %d", mask & 1 ? " index" : "",
                     mask & 2 ? " journal" : "", mask & 4 ? " slabs" : "", strict);
            for (int i = 0; i < 3; i++) {
                if (!(mask & (1 << i)))
                    continue;
                const dt_saved_file *f = dt_store_file(&old, names[i]);
                assert_non_null(f);
                char p[PATH_MAX];
                assert_int_equal(dt_write_file(dt_path(p, sizeof(p), dir, names[i]), f->data, f->len), 0);
            }
            kvh_config cc = c;
            cc.disk_strict_index = (uint32_t)strict;
            size_t ma = 0, mb = 0;
            check_streams(&cc, A, 3, what, &ma);
            check_streams(&cc, B, 3, what, &mb);
            mixes++;
        }
    }
    printf("rollbacks: %d mixes of old and new index, journal and slabs, nothing served wrong\n", mixes);
    dt_store_free(&old);
    dt_store_free(&cur);
    dt_rmrf(dir);
}

/* ---- transplants: files of another store of the same geometry ---- */

static void test_transplants_never_serve_wrong_bytes(void **state)
{
    (void)state;
    char dx[512], dy[512];
    dt_scratch("bitrot-x", dx, sizeof(dx));
    dt_scratch("bitrot-y", dy, sizeof(dy));
    kvh_config cx = dt_cfg(G, dx, 2, 2, 16, 0), cy = dt_cfg(G, dy, 2, 2, 16, 0);
    const uint64_t X = 0x10000, Y = 0x20000;
    kvh_engine *e = dt_open_a(&cx);
    persist_streams(e, X, 0, 3);
    dt_assert_ok(dt_close(dt_untrack(e)));
    e = dt_open_a(&cy);
    persist_streams(e, Y, 0, 3);
    dt_assert_ok(dt_close(dt_untrack(e)));
    dt_saved_store sx, sy;
    assert_int_equal(dt_store_save(dx, &sx), 0);
    assert_int_equal(dt_store_save(dy, &sy), 0);

    static const char *const names[] = {"index", "journal", "slab-0000.kvh"};
    int cases = 0;
    for (int mask = 1; mask < 8; mask++) { /* bit i: file i from store Y */
        for (int strict = 0; strict < 2; strict++) {
            dt_rmrf(dx);
            mkdir(dx, 0700);
            assert_int_equal(dt_store_restore(dx, &sx), 0);
            for (int i = 0; i < 3; i++)
                if (mask & (1 << i)) {
                    const dt_saved_file *f = dt_store_file(&sy, names[i]);
                    char p[PATH_MAX];
                    assert_int_equal(dt_write_file(dt_path(p, sizeof(p), dx, names[i]), f->data, f->len), 0);
                }
            char what[128];
            snprintf(what, sizeof(what), "from Y:%s%s%s, strict %d", mask & 1 ? " index" : "",
                     mask & 2 ? " journal" : "", mask & 4 ? " slabs" : "", strict);
            kvh_config cc = cx;
            cc.disk_strict_index = (uint32_t)strict;
            size_t mx = 0, my = 0;
            check_streams(&cc, X, 4, what, &mx);
            check_streams(&cc, Y, 4, what, &my);
            cases++;
        }
    }
    printf("transplants: %d cases, nothing served wrong\n", cases);
    dt_store_free(&sx);
    dt_store_free(&sy);
    dt_rmrf(dx);
    dt_rmrf(dy);
}

/* ---- a kill while the open rebuilds a damaged index ---- */

typedef struct rebuild_arg {
    const char *dir;
} rebuild_arg;

/* Opens (rebuilding, and writing the new snapshot), closes, then waits to
 * be killed: every kill lands somewhere in the open or the close. */
static int rebuild_child(void *p, int ready_fd)
{
    (void)ready_fd;
    rebuild_arg *a = p;
    kvh_config c = cfg_for(a->dir, false);
    kvh_engine *e = NULL;
    if (kvh_engine_open(&c, &e) != KVH_OK)
        return 10;
    if (kvh_engine_close(e) != KVH_OK)
        return 11;
    for (;;)
        pause();
}

static void damage_index(int kind)
{
    char p[PATH_MAX];
    switch (kind) {
    case 0: /* a bit of the snapshot header */
        assert_int_equal(dt_flip_bit(dt_path(p, sizeof(p), P.dir, "index"), 20, 3), 0);
        break;
    case 1:
        assert_int_equal(unlink(dt_path(p, sizeof(p), P.dir, "index")), 0);
        break;
    case 2:
        assert_int_equal(unlink(dt_path(p, sizeof(p), P.dir, "journal")), 0);
        break;
    case 3: { /* both headers zeroed */
        uint8_t zero[4096] = {0};
        for (int i = 0; i < 2; i++) {
            const char *name = i ? "journal" : "index";
            int fd = open(dt_path(p, sizeof(p), P.dir, name), O_WRONLY);
            assert_true(fd >= 0);
            assert_int_equal(pwrite(fd, zero, sizeof(zero), 0), (ssize_t)sizeof(zero));
            close(fd);
        }
        break;
    }
    case 4: /* a record in the middle of the snapshot */
        assert_int_equal(dt_flip_bit(dt_path(p, sizeof(p), P.dir, "index"),
                                     KVHI_DISK_ALIGN + kvhi_index_rec_bytes(G.bt) * 3 + 30, 1),
                         0);
        break;
    }
}

static void test_kill_while_rebuilding(void **state)
{
    (void)state;
    uint64_t seed = dt_seed(0x4eb1d);
    dt_rng r = {seed};
    int rounds = (int)dt_env_long("KVH_DISK_REBUILD_KILLS", 30), kills = 0;
    /* How long an open that rebuilds, and its close, take here: the kills
     * are spread over 1.5 times that (plus 2 ms for the fork). */
    double took[2] = {0, 0};
    for (int where = 0; where < 2; where++) {
        restore_in(where ? 1 : 0);
        damage_index(0);
        kvh_config c = cfg_for(P.dir, false);
        double t = dt_now();
        kvh_engine *e = dt_open_a(&c);
        dt_assert_ok(dt_close(dt_untrack(e)));
        took[where] = dt_now() - t;
    }
    for (int round = 0; round < rounds; round++) {
        int kind = round % 5;
        /* damage, then up to three kills in a row before the check; half
         * the rounds on the real disk, where the rebuild's syncs take time */
        restore_in(round % 2);
        double window_us = 1.5e6 * took[strcmp(P.dir, P.disk_dir) != 0] + 2000;
        damage_index(kind);
        int n_kills = 1 + (int)dt_below(&r, 3);
        for (int k = 0; k < n_kills; k++) {
            rebuild_arg a = {P.dir};
            int ws = 0;
            dt_kill_result kr = dt_kill_child(rebuild_child, &a, true, 0, dt_below(&r, (uint64_t)window_us + 1), &ws);
            char msg[256];
            if (dt_kill_failed(kr, ws, msg, sizeof(msg)))
                fail_msg("round %d (damage %d, seed 0x%" PRIx64 "): %s", round, kind, seed, msg);
            kills++;
        }
        char what[96];
        snprintf(what, sizeof(what), "round %d (damage %d, %d kills, seed 0x%" PRIx64 ")", round, kind, n_kills, seed);
        kvh_config c = cfg_for(P.dir, false);
        served s = serve(&c, what);
        assert_int_equal(s.open, KVH_OK);
        for (int ch = 0; ch < NC; ch++)
            if (s.matched[ch] != (size_t)NB * G.bt)
                fail_msg("%s: chain %d: %zu of %u tokens (no slot was damaged)", what, ch, s.matched[ch], NB * G.bt);
        served again = serve(&c, what);
        if (again.corrupt != 0)
            fail_msg("%s: the rebuilt store reports %" PRIu64 " corrupt blocks at the next open", what, again.corrupt);
        DIR *d = opendir(P.dir);
        assert_non_null(d);
        struct dirent *de;
        while ((de = readdir(d)) != NULL)
            if (strstr(de->d_name, ".tmp"))
                fail_msg("%s: %s left in the store after a clean open and close", what, de->d_name);
        closedir(d);
    }
    printf("rebuilds: %d rounds, %d kills within 1.5 x the %.1f ms (real disk) / %.1f ms (tmpfs) a rebuilding open "
           "and close take; every block found again\n",
           rounds, kills, took[0] * 1e3, took[1] * 1e3);
}

/* ---- the same, at every step that changes a file ---- */

/* Kills its process right before the target-th write, fsync, rename or
 * directory fsync of the disk tier. */
static long step_target, step_count;
static int kill_at_step(enum kvhi_disk_op op, void *user)
{
    (void)user;
    if (op != KVHI_OP_READ && ++step_count == step_target)
        raise(SIGKILL);
    return 0;
}

static int step_child(void *p)
{
    const char *dir = p;
    kvhi_disk_set_fault_hook(kill_at_step, NULL);
    kvh_config c = cfg_for(dir, false);
    kvh_engine *e = NULL;
    if (kvh_engine_open(&c, &e) != KVH_OK)
        return 10;
    if (kvh_engine_close(e) != KVH_OK)
        return 11;
    return 0;
}

static void test_kill_at_every_step_of_a_rebuild(void **state)
{
    (void)state;
    long kills = 0;
    for (int kind = 0; kind < 5; kind++) {
        for (step_target = 1;; step_target++) {
            restore_in(1); /* tmpfs when there is one: the order of the steps is the same */
            damage_index(kind);
            step_count = 0;
            int rc = dt_in_child(step_child, P.dir);
            if (rc == 0)
                break; /* the open and close ended before this step */
            if (rc != 128 + SIGKILL)
                fail_msg("damage %d, killed at step %ld: the child ended with %d", kind, step_target, rc);
            kills++;
            char what[96];
            snprintf(what, sizeof(what), "damage %d, killed before write/sync/rename %ld", kind, step_target);
            kvh_config c = cfg_for(P.dir, false);
            served s = serve(&c, what);
            assert_int_equal(s.open, KVH_OK);
            for (int ch = 0; ch < NC; ch++)
                if (s.matched[ch] != (size_t)NB * G.bt)
                    fail_msg("%s: chain %d: %zu of %u tokens (no slot was damaged)", what, ch, s.matched[ch],
                             NB * G.bt);
        }
    }
    printf("rebuild steps: %ld kills, one before each write, fsync and rename of a rebuilding open and its close\n",
           kills);
}

/* ---- special files planted in place of store files ---- */

typedef struct special_arg {
    const char *dir;
} special_arg;

/* Opens the store under a watchdog: 0 when the open returned KVH_ERR_IO
 * with a message, 2 for any other status; the alarm (SIGALRM) ends an open
 * that waits forever. */
static int special_child(void *p)
{
    special_arg *a = p;
    alarm(10);
    kvh_config c = cfg_for(a->dir, false);
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&c, &e);
    if (st == KVH_ERR_IO && kvh_last_error()[0])
        return 0;
    fprintf(stderr, "open returned %s (%s)\n", kvh_status_name(st), kvh_last_error());
    kvh_engine_close(e);
    return 2;
}

static void test_special_files_are_refused_not_waited_on(void **state)
{
    (void)state;
    static const char *const names[] = {"index", "journal", "slab-0000.kvh", "LOCK"};
    for (int kind = 0; kind < 2; kind++)
        for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
            restore_in(1);
            char p[PATH_MAX];
            dt_path(p, sizeof(p), P.dir, names[i]);
            assert_int_equal(unlink(p), 0);
            /* a FIFO blocks an open for reading until a writer comes */
            assert_int_equal(kind == 0 ? mkfifo(p, 0600) : mkdir(p, 0700), 0);
            special_arg a = {P.dir};
            int rc = dt_in_child(special_child, &a);
            if (rc != 0)
                fail_msg("a %s planted as %s: the open %s (child status %d)", kind == 0 ? "FIFO" : "directory",
                         names[i],
                         rc == 128 + SIGALRM ? "waited for 10 s (killed by the watchdog)" : "did not fail cleanly", rc);
            if (kind == 0)
                unlink(p);
            else
                rmdir(p);
        }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_bursts_never_serve_wrong_bytes, dt_teardown),
        cmocka_unit_test_teardown(test_rollback_mixes_never_serve_wrong_bytes, dt_teardown),
        cmocka_unit_test_teardown(test_transplants_never_serve_wrong_bytes, dt_teardown),
        cmocka_unit_test_teardown(test_kill_while_rebuilding, dt_teardown),
        cmocka_unit_test_teardown(test_kill_at_every_step_of_a_rebuild, dt_teardown),
        cmocka_unit_test_teardown(test_special_files_are_refused_not_waited_on, dt_teardown),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
