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
 *     opened; the chain's prefix match must stop exactly before the
 *     damaged block (a miss), what is matched must read back
 *     byte-identical, and stats.corrupt_blocks must count every flip -- a
 *     damaged journal record with only damaged records after it looks like
 *     a torn append and is dropped uncounted, as designed;
 *   - live rounds: with the engine open, each chain is matched (attached),
 *     spilled back to its clean disk copy, a bit of a slot is flipped, and
 *     reading the attached sequence must fail with KVH_ERR_CORRUPT (never
 *     wrong bytes); the damaged block is counted and a new match stops
 *     before it;
 *   - header rounds: one bit of the checksummed part of the snapshot header
 *     (open refuses the store with KVH_ERR_CORRUPT; nothing is served) or
 *     of the journal header (its records are replayed past it, the damage
 *     is counted, nothing is lost or served wrong). The rest of a header
 *     page is padding that nothing reads, so it is not a target.
 *
 * 10,000 flips in CI (KVH_REL_FLIPS), 100,000 in test_rel_bitrot_stress.
 * Most rounds run on a tmpfs copy; every 8th on the real disk (O_DIRECT).
 */
#include "rel_util.h"

#include "core/disk_format.h"

#define NC 96
#define NB 2
#define SNAP_CHAINS 48
static const rl_geo G = {1, 1, 64, 16, KVH_DTYPE_F16}; /* block = 4096 bytes, slot = 8192 */
#define DISK_SLOTS 200
#define SLOT_BYTES 8192u
#define HDR_COVERED 84u /* index/journal header bytes under the CRC: [0,80) + the CRC */
#define REAL_EVERY 8

static rl_content chain(int c) { return rl_plain(0x900 + (uint64_t)c); }
static size_t chain_len(void) { return (size_t)NB * G.bt; }

static kvh_config cfg_for(const char *dir) { return rl_cfg(G, dir, 8, 48, DISK_SLOTS, 0); }

typedef struct block_loc {
    uint32_t slot;
    bool in_journal;
    size_t rec_off;
    int journal_index;
} block_loc;

static struct {
    char disk_root[400], fast_root[400];
    char disk_dir[512], fast_dir[512];
    const char *dir; /* where this round runs */
    bool fast;
    rl_saved_store saved;
    block_loc loc[NC][NB];
    size_t rec_bytes, journal_records;
} P;

static char *file_path(const char *name)
{
    static char p[600];
    return rl_path(p, sizeof(p), P.dir, name);
}

/* ---- the pristine store ---- */

static int build_chains(kvh_engine *e, int first, int last)
{
    for (int c = first; c <= last; c++) {
        kvh_seq s;
        if (rl_build(e, G, chain(c), chain_len(), 0, &s) != KVH_OK)
            return 1;
        if (kvh_seq_persist(e, s) != KVH_OK)
            return 2;
        if (kvh_seq_free(e, s) != KVH_OK)
            return 3;
    }
    return 0;
}

static int journal_child(void *arg)
{
    (void)arg;
    kvh_config c = cfg_for(P.disk_dir);
    kvh_engine *e = NULL;
    if (kvh_engine_open(&c, &e) != KVH_OK)
        return 9;
    return build_chains(e, SNAP_CHAINS, NC - 1); /* no close */
}

static bool find_block(int32_t t0, int *pc, int *pk)
{
    for (int c = 0; c < NC; c++)
        for (int k = 0; k < NB; k++)
            if (rl_token(chain(c), (uint64_t)k * G.bt) == t0) {
                *pc = c, *pk = k;
                return true;
            }
    return false;
}

static void build_pristine(void)
{
    assert_int_equal(rl_block_bytes(G), 4096);
    assert_int_equal(rl_slot_bytes(G), SLOT_BYTES);
    rl_scratch("bitrot", P.disk_root, sizeof(P.disk_root));
    snprintf(P.disk_dir, sizeof(P.disk_dir), "%s/store", P.disk_root);
    mkdir(P.disk_dir, 0755);
    P.fast = rl_fast_scratch("bitrot", P.fast_root, sizeof(P.fast_root));
    snprintf(P.fast_dir, sizeof(P.fast_dir), "%s/store", P.fast_root);
    kvh_config c = cfg_for(P.disk_dir);
    kvh_engine *e = rl_open_a(&c);
    assert_int_equal(build_chains(e, 0, SNAP_CHAINS - 1), 0);
    rl_assert_ok(rl_close(e));
    assert_int_equal(rl_in_child(journal_child, NULL), 0);
    assert_int_equal(rl_store_save(P.disk_dir, &P.saved), 0);
    /* every block's slot and record, with the library's record decoder */
    P.rec_bytes = kvhi_index_rec_bytes(G.bt);
    int seen[NC][NB];
    memset(seen, 0, sizeof(seen));
    const char *files[2] = {"index", "journal"};
    for (int f = 0; f < 2; f++) {
        const rl_saved_file *sf = rl_store_file(&P.saved, files[f]);
        assert_non_null(sf);
        size_t nrec = (sf->len - 4096) / P.rec_bytes;
        if (f == 1)
            P.journal_records = nrec;
        for (size_t i = 0; i < nrec; i++) {
            int32_t tk[256];
            kvhi_index_rec r = {.tokens = tk};
            size_t off = 4096 + i * P.rec_bytes;
            assert_int_equal(kvhi_index_rec_decode(sf->data + off, &r, G.bt), 0);
            int cc = -1, k = -1;
            if (!find_block(tk[0], &cc, &k) || r.kind != KVHI_REC_ADD || seen[cc][k]++)
                fail_msg("unexpected pristine layout at %s record %zu", files[f], i);
            P.loc[cc][k] = (block_loc){(uint32_t)r.slot, f == 1, off, (int)i};
        }
    }
    for (int cc = 0; cc < NC; cc++)
        for (int k = 0; k < NB; k++)
            if (!seen[cc][k])
                fail_msg("chain %d block %d has no record", cc, k);
    const rl_saved_file *slab = rl_store_file(&P.saved, "slab-0000.kvh");
    assert_non_null(slab);
    assert_int_equal(slab->len, (size_t)DISK_SLOTS * SLOT_BYTES);
}

/* The store for round `round`: a fresh copy of the pristine files. */
static void restore(long round)
{
    P.dir = (!P.fast || round % REAL_EVERY == 0) ? P.disk_dir : P.fast_dir;
    rl_rmrf(P.dir);
    mkdir(P.dir, 0755);
    assert_int_equal(rl_store_restore(P.dir, &P.saved), 0);
}

static void expect_chain(kvh_engine *e, int c, int want, const char *what)
{
    size_t m = 0;
    char msg[256] = "";
    kvh_status st = rl_match_verify(e, G, chain(c), chain_len(), &m, msg, sizeof(msg));
    if (st != KVH_OK)
        fail_msg("%s: chain %d: %s", what, c, msg);
    if (m != (size_t)want * G.bt)
        fail_msg("%s: chain %d matched %zu blocks, expected %d (the damaged block %s)", what, c, m / G.bt, want,
                 m > (size_t)want * G.bt ? "was served: the flip went undetected" : "");
}

/* ---- flips ---- */

enum target { T_DATA, T_SLOT_HEADER, T_RECORD };
static const char *target_name(enum target t)
{
    return t == T_DATA ? "slot data" : t == T_SLOT_HEADER ? "slot header" : "index record";
}

typedef struct flip {
    int chain, block;
    enum target t;
    const char *file;
    uint64_t off;
    unsigned bit;
} flip;

static void pick_slot_flip(rl_rng *rng, flip *f, bool allow_record)
{
    block_loc *L = &P.loc[f->chain][f->block];
    uint64_t r = rl_below(rng, 100);
    f->t = r < 45 ? T_DATA : (r < 70 || !allow_record) ? T_SLOT_HEADER : T_RECORD;
    f->bit = (unsigned)rl_below(rng, 8);
    if (f->t == T_DATA) {
        f->file = "slab-0000.kvh";
        f->off = (uint64_t)L->slot * SLOT_BYTES + 4096 + rl_below(rng, 4096);
    } else if (f->t == T_SLOT_HEADER) {
        f->file = "slab-0000.kvh";
        f->off = (uint64_t)L->slot * SLOT_BYTES + rl_below(rng, 4096);
    } else {
        f->file = L->in_journal ? "journal" : "index";
        f->off = L->rec_off + rl_below(rng, P.rec_bytes);
    }
}

typedef struct counts {
    long flips, cold, live, header, rounds, real_rounds;
    long by_target[3];
    long uncounted_tail;
} counts;

/* One flip per chain before the open. */
static void cold_round(rl_rng *rng, long want_flips, counts *n)
{
    restore(n->rounds);
    flip fl[NC];
    int nfl = 0;
    bool journal_bad[NC * NB + 8] = {false};
    for (int c = 0; c < NC && n->flips + nfl < want_flips; c++) {
        flip *f = &fl[nfl++];
        f->chain = c;
        f->block = (int)rl_below(rng, NB);
        pick_slot_flip(rng, f, true);
        if (f->t == T_RECORD && P.loc[c][f->block].in_journal)
            journal_bad[P.loc[c][f->block].journal_index] = true;
        assert_int_equal(rl_flip_bit(file_path(f->file), f->off, f->bit), 0);
    }
    /* a bad journal record is counted unless only bad records follow it */
    uint64_t expect = 0;
    for (int i = 0; i < nfl; i++) {
        block_loc *L = &P.loc[fl[i].chain][fl[i].block];
        if (fl[i].t != T_RECORD || !L->in_journal) {
            expect++;
            continue;
        }
        bool counted = false;
        for (size_t j = (size_t)L->journal_index + 1; j < P.journal_records && !counted; j++)
            counted = !journal_bad[j];
        expect += counted;
        n->uncounted_tail += !counted;
    }
    kvh_config cfg = cfg_for(P.dir);
    kvh_engine *e = rl_open_a(&cfg);
    for (int i = 0; i < nfl; i++) {
        char what[192];
        snprintf(what, sizeof(what), "round %ld: %s flip (%s byte %" PRIu64 " bit %u) in block %d", n->rounds,
                 target_name(fl[i].t), fl[i].file, fl[i].off, fl[i].bit, fl[i].block);
        expect_chain(e, fl[i].chain, fl[i].block, what);
        n->by_target[fl[i].t]++;
    }
    uint64_t corrupt = rl_stats(e).corrupt_blocks;
    char msg[256];
    if (rl_counters_add_up(e, true, msg, sizeof(msg)))
        fail_msg("round %ld: %s", n->rounds, msg);
    rl_assert_ok(rl_close(e));
    if (corrupt != expect)
        fail_msg("round %ld: corrupt_blocks %" PRIu64 ", expected %" PRIu64 " (one per detected flip)", n->rounds,
                 corrupt, expect);
    n->flips += nfl;
    n->cold += nfl;
}

/* Attached chains spilled to their disk copies, then damaged under the
 * running engine. */
static void live_round(rl_rng *rng, long want_flips, counts *n)
{
    restore(n->rounds);
    kvh_config cfg = cfg_for(P.dir);
    kvh_engine *e = rl_open_a(&cfg);
    int nfl = 0;
    for (int c = 0; c < NC && n->flips + nfl < want_flips; c++) {
        kvh_seq s;
        size_t m = 0;
        rl_assert_ok(rl_match(e, chain(c), chain_len(), &s, &m));
        assert_int_equal(m, chain_len());
        rl_assert_ok(kvh_seq_migrate(e, s, 0, chain_len(), KVH_TIER_DISK, NULL));
        flip f = {.chain = c, .block = (int)rl_below(rng, NB)};
        pick_slot_flip(rng, &f, false);
        assert_int_equal(rl_flip_bit(file_path(f.file), f.off, f.bit), 0);
        char msg[256] = "";
        kvh_status st = rl_verify(e, s, G, chain(c), 0, chain_len(), msg, sizeof(msg));
        if (st != KVH_ERR_CORRUPT)
            fail_msg("round %ld: %s flip (byte %" PRIu64 " bit %u) in block %d of chain %d under a running engine: "
                     "reading it returned %s, expected KVH_ERR_CORRUPT (%s)",
                     n->rounds, target_name(f.t), f.off, f.bit, f.block, c, kvh_status_name(st), msg);
        rl_assert_ok(kvh_seq_free(e, s));
        char what[160];
        snprintf(what, sizeof(what), "round %ld (live): after a %s flip in block %d", n->rounds, target_name(f.t),
                 f.block);
        expect_chain(e, c, f.block, what);
        n->by_target[f.t]++;
        nfl++;
    }
    uint64_t corrupt = rl_stats(e).corrupt_blocks;
    rl_assert_ok(rl_close(e));
    if (corrupt != (uint64_t)nfl)
        fail_msg("round %ld (live): corrupt_blocks %" PRIu64 ", expected %d", n->rounds, corrupt, nfl);
    n->flips += nfl;
    n->live += nfl;
}

static void header_round(rl_rng *rng, bool journal, counts *n)
{
    restore(n->rounds);
    uint64_t off = rl_below(rng, HDR_COVERED);
    unsigned bit = (unsigned)rl_below(rng, 8);
    assert_int_equal(rl_flip_bit(file_path(journal ? "journal" : "index"), off, bit), 0);
    kvh_config cfg = cfg_for(P.dir);
    if (!journal) {
        kvh_engine *e = NULL;
        kvh_status st = kvh_engine_open(&cfg, &e);
        if (st != KVH_ERR_CORRUPT) {
            kvh_engine_close(e);
            fail_msg("snapshot header byte %" PRIu64 " bit %u flipped: open returned %s, expected KVH_ERR_CORRUPT",
                     off, bit, kvh_status_name(st));
        }
    } else {
        kvh_engine *e = rl_open_a(&cfg);
        for (int c = 0; c < NC; c++) {
            char what[128];
            snprintf(what, sizeof(what), "journal header byte %" PRIu64 " bit %u", off, bit);
            expect_chain(e, c, NB, what);
        }
        uint64_t corrupt = rl_stats(e).corrupt_blocks;
        rl_assert_ok(rl_close(e));
        if (corrupt != 1)
            fail_msg("journal header byte %" PRIu64 " bit %u flipped: corrupt_blocks %" PRIu64 ", expected 1", off,
                     bit, corrupt);
    }
    n->flips++;
    n->header++;
}

static void test_bit_rot(void **state)
{
    (void)state;
    long want = rl_env_long("KVH_REL_FLIPS", RL_SIZE(10000, 100000));
    uint64_t seed = rl_seed(0xb17b17ull);
    rl_rng rng = {seed};
    build_pristine();
    counts n = {0};
    double t0 = rl_now();
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
    print_message("bit rot: %ld single-bit flips in %.1f s, all detected and served as misses (seed 0x%" PRIx64
                  "): %ld before open, %ld under a running engine (KVH_ERR_CORRUPT), %ld in snapshot/journal "
                  "headers; by target: slot data %ld, slot header %ld, index record %ld (%ld journal-tail records "
                  "dropped uncounted as torn appends); %ld rounds, %ld on the real disk\n",
                  n.flips, rl_now() - t0, seed, n.cold, n.live, n.header, n.by_target[T_DATA],
                  n.by_target[T_SLOT_HEADER], n.by_target[T_RECORD], n.uncounted_tail, n.rounds, n.real_rounds);
}

static int group_teardown(void **state)
{
    (void)state;
    rl_store_free(&P.saved);
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
