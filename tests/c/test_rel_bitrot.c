/* Reliability battery, item 4: bit rot.
 *
 * A pristine store holds NC prefix chains of NB blocks: the first half in
 * the snapshot `index` (closed cleanly), the rest only in the `journal`
 * (written by a process that died without closing). The block is exactly
 * 4096 bytes, so a slot (4096-byte header + data) has no byte that no
 * checksum covers. Each round restores the pristine files and flips single
 * bits, one per chain, so each flip's detection is checked on its own:
 *
 *   - cold rounds: a bit of a block's slot data, its slot header, or its
 *     index record (snapshot or journal) is flipped before the store is
 *     opened; the chain's prefix match must stop exactly before a block
 *     whose slot is damaged (a miss) and find a block whose record is
 *     damaged (the index is rebuilt from the slot headers), what is
 *     matched must read back byte-identical, and stats.corrupt_blocks must
 *     count every flip -- a damaged journal record with only damaged
 *     records after it looks like a torn append and is not counted, as
 *     designed;
 *   - live rounds: with the engine open, each chain is matched (attached),
 *     spilled back to its clean disk copy, a bit of a slot is flipped, and
 *     reading the attached sequence must fail with KVH_ERR_CORRUPT (never
 *     wrong bytes); the damaged block is counted and a new match stops
 *     before it;
 *   - header rounds: one bit of the checksummed part of the snapshot header
 *     or of the journal header: the index is rebuilt from the slot headers,
 *     the damage is counted once, nothing is lost or served wrong (with
 *     disk_strict_index the open refuses the store with KVH_ERR_CORRUPT).
 *     The rest of a header page is padding that nothing reads, so it is
 *     not a target.
 *
 * 10,000 flips in CI (KVH_REL_FLIPS), 100,000 in test_rel_bitrot_stress.
 * Most rounds run on a tmpfs copy; every 8th on the real disk (O_DIRECT).
 */
#include "rel_util.h"

#include "core/disk_format.h"

#define NC 96
#define NB 2
#define SNAP_CHAINS 48
static const dt_geo G = {1, 1, 64, 16, KVH_DTYPE_F16}; /* block = 4096 bytes, slot = 8192 */
#define DISK_SLOTS 200
#define SLOT_BYTES 8192u
#define HDR_COVERED 84u /* index/journal header bytes under the CRC: [0,80) + the CRC */
#define REAL_EVERY 8

static dt_content chain(int c) { return dt_plain(0x900 + (uint64_t)c); }
static size_t chain_len(void) { return (size_t)NB * G.bt; }
static dt_chains chains(void) { return (dt_chains){G, chain, NC, NB, SNAP_CHAINS}; }

static kvh_config cfg_for(const char *dir) { return dt_cfg(G, dir, 8, 48, DISK_SLOTS, 0); }

static struct {
    char disk_root[400], fast_root[400];
    char disk_dir[512], fast_dir[512];
    const char *dir; /* where this round runs */
    bool fast;
    dt_saved_store saved;
    dt_block_loc loc[NC][NB];
    size_t rec_bytes, journal_records;
} P;

static char *file_path(const char *name)
{
    static char p[600];
    return dt_path(p, sizeof(p), P.dir, name);
}

/* ---- the pristine store ---- */

static void build_pristine(void)
{
    assert_int_equal(dt_block_bytes(G), 4096);
    assert_int_equal(dt_slot_bytes(G), SLOT_BYTES);
    dt_scratch("bitrot", P.disk_root, sizeof(P.disk_root));
    snprintf(P.disk_dir, sizeof(P.disk_dir), "%s/store", P.disk_root);
    mkdir(P.disk_dir, 0755);
    P.fast = rl_fast_scratch("bitrot", P.fast_root, sizeof(P.fast_root));
    snprintf(P.fast_dir, sizeof(P.fast_dir), "%s/store", P.fast_root);
    kvh_config c = cfg_for(P.disk_dir);
    dt_chains ch = chains();
    dt_chains_build_a(&c, &ch, &P.saved, &P.loc[0][0], &P.journal_records);
    P.rec_bytes = kvhi_index_rec_bytes(G.bt);
    const dt_saved_file *slab = dt_store_file(&P.saved, "slab-0000.kvh");
    assert_non_null(slab);
    assert_int_equal(slab->len, (size_t)DISK_SLOTS * SLOT_BYTES);
}

/* The store for round `round`: a fresh copy of the pristine files. */
static void restore(long round)
{
    P.dir = (!P.fast || round % REAL_EVERY == 0) ? P.disk_dir : P.fast_dir;
    dt_rmrf(P.dir);
    mkdir(P.dir, 0755);
    assert_int_equal(dt_store_restore(P.dir, &P.saved), 0);
}

static void expect_chain(kvh_engine *e, int c, int want, const char *what)
{
    dt_chains ch = chains();
    dt_chains_expect_a(e, &ch, c, want, what);
}

/* ---- flips ---- */

static void pick_slot_flip(dt_rng *rng, dt_flip *f, bool allow_record)
{
    dt_flip_pick(rng, f, &P.loc[f->chain][f->block], SLOT_BYTES, P.rec_bytes, allow_record);
}

typedef struct counts {
    long flips, cold, live, header, rounds, real_rounds;
    long by_target[3];
    long uncounted_tail;
} counts;

/* One flip per chain before the open. */
static void cold_round(dt_rng *rng, long want_flips, counts *n)
{
    restore(n->rounds);
    dt_flip fl[NC];
    int nfl = 0;
    for (int c = 0; c < NC && n->flips + nfl < want_flips; c++) {
        dt_flip *f = &fl[nfl++];
        f->chain = c;
        f->block = (int)dt_below(rng, NB);
        pick_slot_flip(rng, f, true);
        assert_int_equal(dt_flip_bit(file_path(f->file), f->off, f->bit), 0);
    }
    dt_chains ch = chains();
    uint64_t expect = dt_flips_counted(fl, nfl, &ch, &P.loc[0][0], P.journal_records, &n->uncounted_tail);
    kvh_config cfg = cfg_for(P.dir);
    kvh_engine *e = dt_open_a(&cfg);
    for (int i = 0; i < nfl; i++) {
        char what[192];
        snprintf(what, sizeof(what), "round %ld: %s flip (%s byte %" PRIu64 " bit %u) in block %d", n->rounds,
                 dt_flip_target_name(fl[i].t), fl[i].file, fl[i].off, fl[i].bit, fl[i].block);
        expect_chain(e, fl[i].chain, fl[i].t == DT_FLIP_RECORD ? NB : fl[i].block, what);
        n->by_target[fl[i].t]++;
    }
    uint64_t corrupt = dt_stats(e).corrupt_blocks;
    char msg[256];
    if (rl_counters_add_up(e, true, msg, sizeof(msg)))
        fail_msg("round %ld: %s", n->rounds, msg);
    dt_assert_ok(dt_close(e));
    if (corrupt != expect)
        fail_msg("round %ld: corrupt_blocks %" PRIu64 ", expected %" PRIu64 " (one per detected flip)", n->rounds,
                 corrupt, expect);
    n->flips += nfl;
    n->cold += nfl;
}

/* Attached chains spilled to their disk copies, then damaged under the
 * running engine. */
static void live_round(dt_rng *rng, long want_flips, counts *n)
{
    restore(n->rounds);
    kvh_config cfg = cfg_for(P.dir);
    kvh_engine *e = dt_open_a(&cfg);
    int nfl = 0;
    for (int c = 0; c < NC && n->flips + nfl < want_flips; c++) {
        kvh_seq s;
        size_t m = 0;
        dt_assert_ok(dt_match(e, chain(c), chain_len(), &s, &m));
        assert_int_equal(m, chain_len());
        dt_assert_ok(kvh_seq_migrate(e, s, 0, chain_len(), KVH_TIER_DISK, NULL));
        dt_flip f = {.chain = c, .block = (int)dt_below(rng, NB)};
        pick_slot_flip(rng, &f, false);
        assert_int_equal(dt_flip_bit(file_path(f.file), f.off, f.bit), 0);
        char msg[256] = "";
        kvh_status st = dt_verify(e, s, G, chain(c), 0, chain_len(), msg, sizeof(msg));
        if (st != KVH_ERR_CORRUPT)
            fail_msg("round %ld: %s flip (byte %" PRIu64 " bit %u) in block %d of chain %d under a running engine: "
                     "reading it returned %s, expected KVH_ERR_CORRUPT (%s)",
                     n->rounds, dt_flip_target_name(f.t), f.off, f.bit, f.block, c, kvh_status_name(st), msg);
        dt_assert_ok(kvh_seq_free(e, s));
        char what[160];
        snprintf(what, sizeof(what), "round %ld (live): after a %s flip in block %d", n->rounds,
                 dt_flip_target_name(f.t), f.block);
        expect_chain(e, c, f.block, what);
        n->by_target[f.t]++;
        nfl++;
    }
    uint64_t corrupt = dt_stats(e).corrupt_blocks;
    dt_assert_ok(dt_close(e));
    if (corrupt != (uint64_t)nfl)
        fail_msg("round %ld (live): corrupt_blocks %" PRIu64 ", expected %d", n->rounds, corrupt, nfl);
    n->flips += nfl;
    n->live += nfl;
}

static void header_round(dt_rng *rng, bool journal, counts *n)
{
    restore(n->rounds);
    uint64_t off = dt_below(rng, HDR_COVERED);
    unsigned bit = (unsigned)dt_below(rng, 8);
    assert_int_equal(dt_flip_bit(file_path(journal ? "journal" : "index"), off, bit), 0);
    const char *name = journal ? "journal" : "snapshot";
    kvh_config cfg = cfg_for(P.dir);
    kvh_config strict = cfg;
    strict.disk_strict_index = 1;
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&strict, &e);
    if (st != KVH_ERR_CORRUPT) {
        kvh_engine_close(e);
        fail_msg("%s header byte %" PRIu64 " bit %u flipped: strict open returned %s, expected KVH_ERR_CORRUPT", name,
                 off, bit, kvh_status_name(st));
    }
    e = dt_open_a(&cfg);
    for (int c = 0; c < NC; c++) {
        char what[128];
        snprintf(what, sizeof(what), "%s header byte %" PRIu64 " bit %u", name, off, bit);
        expect_chain(e, c, NB, what);
    }
    uint64_t corrupt = dt_stats(e).corrupt_blocks;
    dt_assert_ok(dt_close(e));
    if (corrupt != 1)
        fail_msg("%s header byte %" PRIu64 " bit %u flipped: corrupt_blocks %" PRIu64 ", expected 1", name, off, bit,
                 corrupt);
    n->flips++;
    n->header++;
}

static void test_bit_rot(void **state)
{
    (void)state;
    long want = dt_env_long("KVH_REL_FLIPS", RL_SIZE(10000, 100000));
    uint64_t seed = dt_seed(0xb17b17ull);
    dt_rng rng = {seed};
    build_pristine();
    counts n = {0};
    double t0 = dt_now();
    /* header flips: 1 % of the budget, at least 20 of each kind */
    long headers = want / 100 > 40 ? want / 100 : 40;
    for (long i = 0; i < headers && n.flips < want; i++, n.rounds++) {
        n.real_rounds += P.dir == P.disk_dir;
        header_round(&rng, i % 2, &n);
    }
    while (n.flips < want) {
        if (n.rounds % 5 == 4)
            live_round(&rng, want, &n);
        else
            cold_round(&rng, want, &n);
        n.real_rounds += P.dir == P.disk_dir;
        n.rounds++;
    }
    print_message("bit rot: %ld single-bit flips in %.1f s, all detected, damaged slots served as misses and "
                  "damaged records rebuilt from the slot headers (seed 0x%" PRIx64 "): %ld before open, %ld under "
                  "a running engine (KVH_ERR_CORRUPT), %ld in snapshot/journal headers; by target: slot data %ld, "
                  "slot header %ld, index record %ld (%ld journal-tail records not counted, as torn appends); %ld "
                  "rounds, %ld on the real disk\n",
                  n.flips, dt_now() - t0, seed, n.cold, n.live, n.header, n.by_target[DT_FLIP_DATA],
                  n.by_target[DT_FLIP_SLOT_HEADER], n.by_target[DT_FLIP_RECORD], n.uncounted_tail, n.rounds,
                  n.real_rounds);
}

static int group_teardown(void **state)
{
    (void)state;
    dt_store_free(&P.saved);
    rl_fast_cleanup();
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_bit_rot, rl_teardown),
    };
    return cmocka_run_group_tests_name("rel_bitrot", tests, NULL, group_teardown);
}
