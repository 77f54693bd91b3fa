/* Disk tier: damaged stores are detected, never served.
 *
 * A "pristine" store is built once: 32 prefix chains of 4 blocks each, all
 * persisted; chains 0..15 end up in the snapshot `index` (clean close),
 * chains 16..31 only in the `journal` (written by a child process that
 * ends without closing). Each test restores the pristine files, damages
 * them, reopens an engine and checks chain by chain:
 *
 *   - 1,000 single-bit flips at random positions of covered bytes: slot
 *     headers (the header CRC covers the whole 4096-byte page), slot data
 *     (the block here is exactly 4096 bytes, so a slot has no padding that
 *     no checksum covers), snapshot and journal records (each record is
 *     covered by its CRC) and the snapshot / journal headers (CRC over
 *     bytes [0, 80) plus the CRC itself at [80, 84); the rest of the header
 *     page is padding that nothing reads, so it is not a target). Flips go
 *     one per chain per round, so each flip's detection is asserted on its
 *     own: the chain's match stops exactly before a block whose slot is
 *     damaged, a damaged record or snapshot header costs no block (the
 *     index is rebuilt from the slot headers; a strict open refuses the
 *     store), what is matched reads back byte-identical, and
 *     stats.corrupt_blocks counts every flip (a journal record at the very
 *     end of the journal is the exception: it is indistinguishable from a
 *     torn append and is not counted);
 *   - a damaged journal header is reported (corrupt_blocks or a warning),
 *     not a silent loss of every record in the journal;
 *   - two blocks swapped on disk (whole slots, data only, headers only);
 *   - the slab file truncated at many offsets (the engine re-extends it;
 *     whatever was cut is a miss, never partial data), and `kvh-store
 *     verify` on such a store (exit 1: blocks were lost);
 *   - the index and the journal truncated at many offsets: every block is
 *     found unless the cut leaves a journal that looks whole (at a record
 *     boundary); a snapshot cut short is reported (its header says how
 *     many records it holds);
 *   - damage under a running engine: KVH_ERR_CORRUPT, never wrong bytes;
 *   - `kvh-store verify`: 0 on a good store, 1 listing the bad slots and
 *     bad records, 2 (naming the owner's pid) while an engine has it open;
 *     it changes nothing.
 */
#include "disk_test_util.h"

#include "core/disk_format.h"

#define NC 32 /* chains */
#define NB 4  /* blocks a chain */
#define SNAP_CHAINS 16
static const dt_geo G = {1, 1, 64, 16, KVH_DTYPE_F16}; /* block = 4096 bytes, slot = 8192 */
#define DISK_SLOTS 160
#define SLOT_BYTES 8192u
#define HDR_COVERED 84u /* index/journal header bytes checked: [0,80) + CRC */

static dt_content chain(int c) { return dt_plain(100 + (uint64_t)c); }
static size_t chain_len(void) { return (size_t)NB * G.bt; }
static dt_chains chains(void) { return (dt_chains){G, chain, NC, NB, SNAP_CHAINS}; }

static kvh_config cfg_for(const char *dir)
{
    kvh_config c = dt_cfg(G, dir, 8, 32, DISK_SLOTS, 2);
    return c;
}

static struct {
    char dir[512];
    dt_saved_store saved;
    dt_block_loc loc[NC][NB];
    size_t rec_bytes;
    size_t journal_records; /* records in the pristine journal */
    size_t slab_len;
    bool ready;
} P;

/* ---- building the pristine store ---- */

static void build_pristine(void)
{
    if (P.ready)
        return;
    assert_int_equal(dt_slot_bytes(G), SLOT_BYTES);
    assert_int_equal(dt_block_bytes(G), 4096);
    dt_scratch("pristine", P.dir, sizeof(P.dir));
    kvh_config c = cfg_for(P.dir);
    dt_chains ch = chains();
    dt_chains_build_a(&c, &ch, &P.saved, &P.loc[0][0], &P.journal_records);
    P.rec_bytes = kvhi_index_rec_bytes(G.bt);
    const dt_saved_file *slab = dt_store_file(&P.saved, "slab-0000.kvh");
    assert_non_null(slab);
    P.slab_len = slab->len;
    assert_int_equal(P.slab_len, (size_t)DISK_SLOTS * SLOT_BYTES);
    P.ready = true;
}

static int group_setup(void **state)
{
    (void)state;
    return 0;
}

static int group_teardown(void **state)
{
    (void)state;
    dt_store_free(&P.saved);
    return 0;
}

static void restore(void) { assert_int_equal(dt_store_restore(P.dir, &P.saved), 0); }

static char *file_path(const char *name)
{
    static char p[600];
    return dt_path(p, sizeof(p), P.dir, name);
}

/* Matches chain c and checks that exactly `want` blocks are served and
 * that they are byte-identical. */
static void expect_chain(kvh_engine *e, int c, int want, const char *what)
{
    dt_chains ch = chains();
    dt_chains_expect_a(e, &ch, c, want, what);
}

/* ------------------------------------------------------------------ */
/* Bit flips                                                           */
/* ------------------------------------------------------------------ */

/* Opens the store with bit `bit` of journal header byte `off` flipped
 * (already done by the caller) and checks every chain: the snapshot's are
 * whole, nothing is served wrong. Returns the corrupt count and the
 * number of warnings that mention the journal. */
static void journal_header_round(uint64_t off, unsigned bit, uint64_t *corrupt_out, int *warned_out)
{
    dt_log log;
    dt_log_init(&log);
    kvh_config lc = cfg_for(P.dir);
    dt_log_attach(&lc, &log);
    assert_int_equal(dt_flip_bit(file_path("journal"), off, bit), 0);
    kvh_engine *e = dt_open_a(&lc);
    char what[128];
    snprintf(what, sizeof(what), "journal header byte %" PRIu64 " bit %u", off, bit);
    for (int c = 0; c < NC; c++) {
        size_t m = 0;
        char msg[256] = "";
        if (dt_match_verify(e, G, chain(c), chain_len(), &m, msg, sizeof(msg)) != KVH_OK)
            fail_msg("%s: chain %d: %s", what, c, msg);
        if (c < SNAP_CHAINS && m != chain_len())
            fail_msg("%s: snapshot chain %d matched %zu tokens", what, c, m);
    }
    if (corrupt_out)
        *corrupt_out = dt_stats(e).corrupt_blocks;
    if (warned_out)
        *warned_out = dt_log_count(&log, KVH_LOG_WARN, "journal", NULL);
    dt_assert_ok(dt_close(e));
}

static void test_bit_flips_1000(void **state)
{
    (void)state;
    build_pristine();
    dt_rng rng = {dt_seed(0xb17f11b5)};
    kvh_config cfg = cfg_for(P.dir);
    int flips = 0, rounds = 0;
    double t0 = dt_now();

    /* 1. Snapshot header: the index is rebuilt from the slot headers and
     * every block is found; a strict open refuses the store. */
    for (int i = 0; i < 20; i++, flips++) {
        restore();
        uint64_t off = dt_below(&rng, HDR_COVERED);
        unsigned bit = (unsigned)dt_below(&rng, 8);
        assert_int_equal(dt_flip_bit(file_path("index"), off, bit), 0);
        char what[128];
        snprintf(what, sizeof(what), "index header byte %" PRIu64 " bit %u flipped", off, bit);
        kvh_config strict = cfg;
        strict.disk_strict_index = 1;
        kvh_engine *e = NULL;
        kvh_status st = kvh_engine_open(&strict, &e);
        if (st != KVH_ERR_CORRUPT) {
            kvh_engine_close(e);
            fail_msg("%s: strict open returned %s, expected KVH_ERR_CORRUPT", what, kvh_status_name(st));
        }
        if (i < 3) {
            /* ... and RESET_ON_MISMATCH starts it empty. */
            kvh_config r = strict;
            r.disk_flags = KVH_DISK_RESET_ON_MISMATCH;
            e = dt_open_a(&r);
            for (int c = 0; c < NC; c += 7)
                expect_chain(e, c, 0, "strict reset after a damaged index header");
            dt_assert_ok(dt_close(e));
            restore();
            assert_int_equal(dt_flip_bit(file_path("index"), off, bit), 0);
        }
        e = dt_open_a(&cfg);
        for (int c = 0; c < NC; c++)
            expect_chain(e, c, NB, what);
        uint64_t corrupt = dt_stats(e).corrupt_blocks;
        dt_assert_ok(dt_close(e));
        if (corrupt != 1)
            fail_msg("%s: corrupt_blocks %" PRIu64 ", expected 1 (the header)", what, corrupt);
    }

    /* 2. Journal header: the journal cannot be trusted; its records
     * (chains 16..31) may be dropped, the snapshot's chains are untouched,
     * nothing wrong is served. (Whether the loss is reported is checked by
     * test_journal_header_damage_is_reported.) */
    for (int i = 0; i < 20; i++, flips++) {
        restore();
        uint64_t off = dt_below(&rng, HDR_COVERED);
        unsigned bit = (unsigned)dt_below(&rng, 8);
        journal_header_round(off, bit, NULL, NULL);
    }

    /* 3. One flip in each chain per round: slot data, slot header or the
     * chain's index record (snapshot or journal). A damaged record costs
     * nothing: its block is found again from its slot header. */
    while (flips < 1000) {
        restore();
        dt_flip fl[NC];
        int nfl = 0;
        for (int c = 0; c < NC && flips + nfl < 1000; c++) {
            dt_flip *f = &fl[nfl++];
            f->chain = c;
            f->block = (int)dt_below(&rng, NB);
            dt_flip_pick(&rng, f, &P.loc[c][f->block], SLOT_BYTES, P.rec_bytes, true);
            assert_int_equal(dt_flip_bit(file_path(f->file), f->off, f->bit), 0);
        }
        dt_chains ch = chains();
        uint64_t expect_corrupt = dt_flips_counted(fl, nfl, &ch, &P.loc[0][0], P.journal_records, NULL);
        kvh_engine *e = dt_open_a(&cfg);
        for (int i = 0; i < nfl; i++) {
            char what[192];
            snprintf(what, sizeof(what), "round %d: %s flip (%s byte %" PRIu64 " bit %u) in block %d", rounds,
                     dt_flip_target_name(fl[i].t), fl[i].file, fl[i].off, fl[i].bit, fl[i].block);
            expect_chain(e, fl[i].chain, fl[i].t == DT_FLIP_RECORD ? NB : fl[i].block, what);
        }
        uint64_t corrupt = dt_stats(e).corrupt_blocks;
        dt_assert_ok(dt_close(e));
        if (corrupt != expect_corrupt) {
            for (int i = 0; i < nfl; i++)
                print_error("  chain %d block %d: %s %s+%" PRIu64 "\n", fl[i].chain, fl[i].block,
                            dt_flip_target_name(fl[i].t), fl[i].file, fl[i].off);
            fail_msg("round %d: corrupt_blocks %" PRIu64 ", expected %" PRIu64 " (one per detected flip)", rounds,
                     corrupt, expect_corrupt);
        }
        flips += nfl;
        rounds++;
    }
    print_message("%d bit flips (%d rounds of one per chain + 40 header flips) all detected in %.1f s\n", flips, rounds,
                  dt_now() - t0);
}

/* A damaged journal header makes the engine drop every record of the
 * journal: acknowledged-durable blocks vanish. That is safe (a miss), but
 * it must not be silent: it has to show in stats.corrupt_blocks or as a
 * warning through the log callback. */
static void test_journal_header_damage_is_reported(void **state)
{
    (void)state;
    build_pristine();
    dt_rng rng = {dt_seed(0x10a7)};
    int silent = 0;
    char first[128] = "";
    for (int i = 0; i < 20; i++) {
        restore();
        uint64_t off = dt_below(&rng, HDR_COVERED);
        unsigned bit = (unsigned)dt_below(&rng, 8);
        uint64_t corrupt = 0;
        int warned = 0;
        journal_header_round(off, bit, &corrupt, &warned);
        if (corrupt == 0 && warned == 0 && silent++ == 0)
            snprintf(first, sizeof(first), "byte %" PRIu64 " bit %u", off, bit);
    }
    if (silent)
        fail_msg("%d of 20 journal header flips (first: %s) dropped the journal's %zu records silently "
                 "(corrupt_blocks 0, no warning)",
                 silent, first, P.journal_records);
}

/* ------------------------------------------------------------------ */
/* Swapped blocks                                                      */
/* ------------------------------------------------------------------ */

/* Swaps `len` bytes at offset `within` of the slots of two blocks. */
static void swap_slots(int c1, int k1, int c2, int k2, uint64_t within, uint64_t len)
{
    int fd = open(file_path("slab-0000.kvh"), O_RDWR | O_CLOEXEC);
    assert_true(fd >= 0);
    uint8_t *a = malloc(len), *b = malloc(len);
    off_t oa = (off_t)((uint64_t)P.loc[c1][k1].slot * SLOT_BYTES + within);
    off_t ob = (off_t)((uint64_t)P.loc[c2][k2].slot * SLOT_BYTES + within);
    assert_int_equal(pread(fd, a, len, oa), (ssize_t)len);
    assert_int_equal(pread(fd, b, len, ob), (ssize_t)len);
    assert_int_equal(pwrite(fd, b, len, oa), (ssize_t)len);
    assert_int_equal(pwrite(fd, a, len, ob), (ssize_t)len);
    free(a);
    free(b);
    close(fd);
}

static void test_swapped_blocks(void **state)
{
    (void)state;
    build_pristine();
    restore();
    swap_slots(3, 1, 7, 2, 0, SLOT_BYTES);   /* whole slots, two chains */
    swap_slots(9, 0, 9, 1, 0, SLOT_BYTES);   /* whole slots, same chain */
    swap_slots(20, 0, 21, 3, 4096, 4096);    /* data only */
    swap_slots(5, 2, 5, 3, 0, 4096);         /* headers only */
    swap_slots(24, 1, 12, 1, 0, SLOT_BYTES); /* journal chain <-> snapshot chain */
    int want[NC];
    for (int c = 0; c < NC; c++)
        want[c] = NB;
    want[3] = 1, want[7] = 2, want[9] = 0, want[20] = 0, want[21] = 3, want[5] = 2, want[24] = 1, want[12] = 1;
    kvh_config cfg = cfg_for(P.dir);
    kvh_engine *e = dt_open_a(&cfg);
    for (int c = 0; c < NC; c++)
        expect_chain(e, c, want[c], "swapped blocks");
    assert_int_equal(dt_stats(e).corrupt_blocks, 10); /* every damaged slot is read, and caught */
    dt_assert_ok(dt_close(e));

    /* kvh-store verify lists the ten slots. */
    restore();
    swap_slots(3, 1, 7, 2, 0, SLOT_BYTES);
    swap_slots(9, 0, 9, 1, 0, SLOT_BYTES);
    swap_slots(20, 0, 21, 3, 4096, 4096);
    swap_slots(5, 2, 5, 3, 0, 4096);
    swap_slots(24, 1, 12, 1, 0, SLOT_BYTES);
    char tool[PATH_MAX];
    if (!dt_store_tool(tool, sizeof(tool)))
        fail_msg("kvh-store not found (build the tools, or set KVH_STORE_BIN)");
    static char out[65536];
    int rc = dt_run_tool(tool, "verify", P.dir, NULL, out, sizeof(out));
    if (rc != 1)
        fail_msg("kvh-store verify exited %d, expected 1:\n%s", rc, out);
    int pairs[10][2] = {{3, 1}, {7, 2}, {9, 0}, {9, 1}, {20, 0}, {21, 3}, {5, 2}, {5, 3}, {24, 1}, {12, 1}};
    for (int i = 0; i < 10; i++) {
        char line[64];
        snprintf(line, sizeof(line), "BAD slot %u ", P.loc[pairs[i][0]][pairs[i][1]].slot);
        if (!strstr(out, line))
            fail_msg("kvh-store verify does not list \"%s\":\n%s", line, out);
    }
}

/* ------------------------------------------------------------------ */
/* Truncation                                                          */
/* ------------------------------------------------------------------ */

/* Blocks of chain c that lie wholly before `cut`. */
static int intact_prefix(int c, uint64_t cut)
{
    int k = 0;
    while (k < NB && (uint64_t)(P.loc[c][k].slot + 1) * SLOT_BYTES <= cut)
        k++;
    return k;
}

static void test_truncated_slab(void **state)
{
    (void)state;
    build_pristine();
    uint64_t used_end = 0;
    for (int c = 0; c < NC; c++)
        for (int k = 0; k < NB; k++)
            if ((uint64_t)(P.loc[c][k].slot + 1) * SLOT_BYTES > used_end)
                used_end = (uint64_t)(P.loc[c][k].slot + 1) * SLOT_BYTES;
    uint64_t cuts[96];
    int n = 0;
    uint64_t fixed[] = {0, 1, 84, 4095, 4096, 4097, 8191, 8192, 8193, 12288, 3 * 8192 + 100};
    for (size_t i = 0; i < sizeof(fixed) / sizeof(fixed[0]); i++)
        cuts[n++] = fixed[i];
    dt_rng rng = {dt_seed(0x7c07)};
    while (n < 60) /* inside the used slots, aligned or not */
        cuts[n++] = dt_below(&rng, 2) ? dt_below(&rng, used_end) : dt_below(&rng, used_end / 512) * 512;
    cuts[n++] = used_end - 1;
    cuts[n++] = used_end;
    cuts[n++] = P.slab_len - 1;
    kvh_config cfg = cfg_for(P.dir);
    for (int i = 0; i < n; i++) {
        restore();
        assert_int_equal(truncate(file_path("slab-0000.kvh"), (off_t)cuts[i]), 0);
        int damaged = 0;
        for (int c = 0; c < NC; c++)
            damaged += NB - intact_prefix(c, cuts[i]);
        kvh_engine *e = dt_open_a(&cfg);
        char what[96];
        snprintf(what, sizeof(what), "slab cut at %" PRIu64, cuts[i]);
        for (int c = 0; c < NC; c++)
            expect_chain(e, c, intact_prefix(c, cuts[i]), what);
        uint64_t corrupt = dt_stats(e).corrupt_blocks;
        dt_assert_ok(dt_close(e));
        if (corrupt != (uint64_t)damaged)
            fail_msg("%s: corrupt_blocks %" PRIu64 ", expected %d", what, corrupt, damaged);
    }
}

/* kvh-store verify on a store whose slab file was cut short: every block
 * that lost bytes is bad, so the exit status is 1. */
static void test_kvh_store_verify_truncated_slab(void **state)
{
    (void)state;
    build_pristine();
    char tool[PATH_MAX];
    if (!dt_store_tool(tool, sizeof(tool)))
        fail_msg("kvh-store not found (build the tools, or set KVH_STORE_BIN)");
    static char out[65536];
    uint64_t cuts[] = {0, 4096, 3 * 8192 + 100, 40 * 8192, 127 * 8192 + 5000};
    int wrong = 0;
    char first[256] = "";
    for (size_t i = 0; i < sizeof(cuts) / sizeof(cuts[0]); i++) {
        restore();
        assert_int_equal(truncate(file_path("slab-0000.kvh"), (off_t)cuts[i]), 0);
        int damaged = 0;
        for (int c = 0; c < NC; c++)
            damaged += NB - intact_prefix(c, cuts[i]);
        assert_true(damaged > 0);
        int rc = dt_run_tool(tool, "verify", P.dir, NULL, out, sizeof(out));
        if (rc != 1) {
            if (wrong++ == 0) {
                char *nl = strrchr(out, '\n');
                if (nl && nl > out && nl[1] == '\0')
                    *nl = '\0';
                const char *last = strrchr(out, '\n');
                snprintf(first, sizeof(first), "cut at %" PRIu64 " (%d blocks lost): exit %d, \"%.150s\"", cuts[i],
                         damaged, rc, last ? last + 1 : out);
            }
        }
    }
    if (wrong)
        fail_msg("kvh-store verify passed %d of %zu truncated stores; first: %s", wrong, sizeof(cuts) / sizeof(cuts[0]),
                 first);
}

/* The snapshot and the journal cut short: what is gone is a miss, never a
 * crash or wrong data. */
static void test_truncated_index_and_journal(void **state)
{
    (void)state;
    build_pristine();
    kvh_config cfg = cfg_for(P.dir);
    const char *names[2] = {"index", "journal"};
    dt_rng rng = {dt_seed(0x1d3c)};
    for (int f = 0; f < 2; f++) {
        const dt_saved_file *sf = dt_store_file(&P.saved, names[f]);
        for (int i = 0; i < 24; i++) {
            uint64_t cut = i == 0 ? 0 : i == 1 ? 83 : i == 2 ? 84 : i == 3 ? 4096 : dt_below(&rng, sf->len);
            restore();
            assert_int_equal(truncate(file_path(names[f]), (off_t)cut), 0);
            kvh_engine *e = NULL;
            kvh_status st = kvh_engine_open(&cfg, &e);
            if (st != KVH_OK)
                fail_msg("%s cut at %" PRIu64 ": open returned %s (%s)", names[f], cut, kvh_status_name(st),
                         kvh_last_error());
            dt_track(e);
            for (int c = 0; c < NC; c++) {
                size_t m = 0;
                char msg[256] = "";
                if (dt_match_verify(e, G, chain(c), chain_len(), &m, msg, sizeof(msg)) != KVH_OK)
                    fail_msg("%s cut at %" PRIu64 ": chain %d: %s", names[f], cut, c, msg);
                /* The other file's chains are untouched; a cut the open can
                 * see (all but a journal cut at a record boundary, which
                 * looks like a journal that was never longer) is rebuilt
                 * from the slot headers and loses nothing. */
                bool other = f == 0 ? c >= SNAP_CHAINS : c < SNAP_CHAINS;
                bool seen = f == 0 || cut < 4096 || (cut - 4096) % P.rec_bytes != 0;
                if ((other || seen) && m != chain_len())
                    fail_msg("%s cut at %" PRIu64 ": chain %d matched %zu tokens", names[f], cut, c, m);
                /* A record wholly before the cut survives. */
                for (int k = 0; k < NB; k++) {
                    dt_block_loc *L = &P.loc[c][k];
                    if (!other && L->rec_off + P.rec_bytes <= cut && m < (size_t)(k + 1) * G.bt) {
                        bool earlier_cut = false;
                        for (int j = 0; j < k; j++)
                            earlier_cut |= P.loc[c][j].rec_off + P.rec_bytes > cut;
                        if (!earlier_cut)
                            fail_msg("%s cut at %" PRIu64 ": chain %d block %d lost though its record is intact",
                                     names[f], cut, c, k);
                    }
                }
            }
            dt_assert_ok(dt_close(e));
        }
    }
}

/* A snapshot is replaced atomically, so a short one is damage: its
 * header says how many records it holds, and missing ones must be
 * reported (counted in corrupt_blocks, or the open fails), not dropped
 * silently. */
static void test_short_snapshot_is_reported(void **state)
{
    (void)state;
    build_pristine();
    kvh_config cfg = cfg_for(P.dir);
    const dt_saved_file *sf = dt_store_file(&P.saved, "index");
    uint64_t cuts[3] = {4096, 4096 + 5 * P.rec_bytes, sf->len - 1};
    for (int i = 0; i < 3; i++) {
        restore();
        assert_int_equal(truncate(file_path("index"), (off_t)cuts[i]), 0);
        size_t lost = (sf->len - 4096) / P.rec_bytes - (cuts[i] - 4096) / P.rec_bytes;
        kvh_engine *e = NULL;
        kvh_status st = kvh_engine_open(&cfg, &e);
        if (st == KVH_ERR_CORRUPT)
            continue;
        if (st != KVH_OK)
            fail_msg("open returned %s (%s)", kvh_status_name(st), kvh_last_error());
        uint64_t corrupt = dt_stats(e).corrupt_blocks;
        kvh_engine_close(e);
        if (corrupt < lost)
            fail_msg("index cut at %" PRIu64 " loses %zu of its records, but corrupt_blocks is %" PRIu64
                     " and the open succeeded",
                     cuts[i], lost, corrupt);
    }
}

/* Damage under a running engine: a block read back from disk is verified
 * on the way up; a damaged one is an error (KVH_ERR_CORRUPT), never wrong
 * bytes, and it is dropped from the index. */
static void live_damage(uint32_t flags, const char *tag)
{
    char dir[512], slab[600];
    dt_scratch(tag, dir, sizeof(dir));
    dt_path(slab, sizeof(slab), dir, "slab-0000.kvh");
    kvh_config cfg = dt_cfg(G, dir, 4, 4, 64, 2);
    cfg.migration_threads = 0;
    cfg.disk_flags = flags;
    kvh_engine *e = dt_open_a(&cfg);
    dt_content ca = dt_plain(61), cb = dt_plain(62);
    kvh_seq a, b;
    dt_assert_ok(dt_build(e, G, ca, 4 * G.bt, 0, &a));
    dt_assert_ok(kvh_seq_persist(e, a));
    dt_assert_ok(kvh_seq_migrate(e, a, 0, 4 * G.bt, KVH_TIER_DISK, NULL)); /* to its clean copies */
    dt_assert_ok(dt_build(e, G, cb, 3 * G.bt, 0, &b));
    dt_assert_ok(kvh_seq_migrate(e, b, 0, 3 * G.bt, KVH_TIER_DISK, NULL)); /* spilled, not persisted */
    kvh_block_info ia = dt_binfo(e, a, 1), ib = dt_binfo(e, b, 2);
    assert_int_equal(ia.tier, KVH_TIER_DISK);
    assert_int_equal(ib.tier, KVH_TIER_DISK);
    assert_int_equal(dt_flip_bit(slab, (uint64_t)ia.slot * SLOT_BYTES + 4096 + 1234, 5), 0); /* data */
    assert_int_equal(dt_flip_bit(slab, (uint64_t)ib.slot * SLOT_BYTES + 40, 0), 0);          /* header */
    struct {
        kvh_seq s;
        dt_content c;
        int blocks, bad;
    } cases[2] = {{a, ca, 4, 1}, {b, cb, 3, 2}};
    for (int i = 0; i < 2; i++)
        for (int k = 0; k < cases[i].blocks; k++) {
            char msg[256] = "";
            kvh_status st = dt_verify(e, cases[i].s, G, cases[i].c, (uint64_t)k * G.bt, G.bt, msg, sizeof(msg));
            if (k == cases[i].bad) {
                if (st != KVH_ERR_CORRUPT || strstr(msg, "differs"))
                    fail_msg("%s: damaged block %d of sequence %d: %s (%s)", tag, k, i, kvh_status_name(st), msg);
            } else if (st != KVH_OK)
                fail_msg("%s: intact block %d of sequence %d: %s", tag, k, i, msg);
        }
    assert_int_equal(dt_stats(e).corrupt_blocks, 2);
    /* a second read fails the same way */
    char msg[256] = "";
    dt_assert_kvh(KVH_ERR_CORRUPT, dt_verify(e, a, G, ca, G.bt, G.bt, msg, sizeof(msg)));
    /* the damaged blocks are no longer matched */
    size_t m = 0;
    if (dt_match_verify(e, G, ca, 4 * G.bt, &m, msg, sizeof(msg)) != KVH_OK)
        fail_msg("%s: %s", tag, msg);
    assert_int_equal(m, 1 * G.bt);
    dt_assert_ok(kvh_seq_free(e, a));
    dt_assert_ok(kvh_seq_free(e, b));
    dt_assert_ok(dt_close(e));
    /* nor after a restart */
    e = dt_open_a(&cfg);
    if (dt_match_verify(e, G, ca, 4 * G.bt, &m, msg, sizeof(msg)) != KVH_OK)
        fail_msg("%s: %s", tag, msg);
    assert_int_equal(m, 1 * G.bt);
    if (dt_match_verify(e, G, cb, 3 * G.bt, &m, msg, sizeof(msg)) != KVH_OK)
        fail_msg("%s: %s", tag, msg);
    assert_true(m <= 2 * G.bt);
    dt_assert_ok(dt_close(e));
}

static void test_live_damage_is_never_served(void **state)
{
    (void)state;
    live_damage(0, "live-direct");
    live_damage(KVH_DISK_BUFFERED, "live-buffered");
}

/* A slab file cut short under a running engine: a block past the cut is
 * damage, dropped on its first read (it was an I/O error each time, the
 * block kept and matched, until the next open's scan), and the prefix
 * before it is still served. */
static void test_a_slab_cut_while_running_drops_what_it_lost(void **state)
{
    (void)state;
    char dir[512], slab[600];
    dt_scratch("live-cut", dir, sizeof(dir));
    dt_path(slab, sizeof(slab), dir, "slab-0000.kvh");
    kvh_config cfg = dt_cfg(G, dir, 4, 4, 64, 2);
    cfg.migration_threads = 0;
    kvh_engine *e = dt_open_a(&cfg);
    dt_content ca = dt_plain(63);
    kvh_seq a;
    dt_assert_ok(dt_build(e, G, ca, 4 * G.bt, 0, &a));
    dt_assert_ok(kvh_seq_persist(e, a));
    dt_assert_ok(kvh_seq_migrate(e, a, 0, 4 * G.bt, KVH_TIER_DISK, NULL));
    uint32_t cut_slot = dt_binfo(e, a, 2).slot;
    for (int k = 0; k < 4; k++)
        assert_int_equal(dt_binfo(e, a, (uint64_t)k).tier, KVH_TIER_DISK);
    assert_int_equal(truncate(slab, (off_t)cut_slot * SLOT_BYTES + 4096 + 100), 0);
    bool past[4];
    int lost = 0;
    for (int k = 0; k < 4; k++)
        lost += past[k] = dt_binfo(e, a, (uint64_t)k).slot >= cut_slot;
    char msg[256] = "";
    for (int k = 0; k < 4; k++) {
        kvh_status st = dt_verify(e, a, G, ca, (uint64_t)k * G.bt, G.bt, msg, sizeof(msg));
        if (past[k] ? st != KVH_ERR_CORRUPT : st != KVH_OK)
            fail_msg("block %d (%s the cut): %s (%s)", k, past[k] ? "past" : "before", kvh_status_name(st), msg);
    }
    assert_int_equal(dt_stats(e).corrupt_blocks, (uint64_t)lost);
    dt_assert_ok(kvh_seq_free(e, a));
    size_t m = 0;
    if (dt_match_verify(e, G, ca, 4 * G.bt, &m, msg, sizeof(msg)) != KVH_OK)
        fail_msg("match after the cut: %s", msg);
    assert_true(m <= (size_t)(4 - lost) * G.bt);
    dt_assert_ok(dt_close(e));
}

/* ------------------------------------------------------------------ */
/* kvh-store verify                                                    */
/* ------------------------------------------------------------------ */

static void test_kvh_store_verify(void **state)
{
    (void)state;
    build_pristine();
    char tool[PATH_MAX];
    if (!dt_store_tool(tool, sizeof(tool)))
        fail_msg("kvh-store not found (build the tools, or set KVH_STORE_BIN)");
    static char out[65536];

    restore();
    int rc = dt_run_tool(tool, "verify", P.dir, NULL, out, sizeof(out));
    if (rc != 0 || !strstr(out, "128 blocks checked, 0 bad"))
        fail_msg("good store: kvh-store verify exited %d:\n%s", rc, out);
    rc = dt_run_tool(tool, "info", P.dir, "--json", out, sizeof(out));
    if (rc != 0 || !strstr(out, "\"blocks\": 128"))
        fail_msg("good store: kvh-store info exited %d:\n%s", rc, out);

    /* one flipped data bit, one flipped header bit: both listed */
    dt_rng rng = {dt_seed(0x5707e)};
    for (int round = 0; round < 5; round++) {
        restore();
        int c1 = (int)dt_below(&rng, NC), k1 = (int)dt_below(&rng, NB);
        int c2 = (c1 + 1 + (int)dt_below(&rng, NC - 1)) % NC, k2 = (int)dt_below(&rng, NB);
        uint32_t s1 = P.loc[c1][k1].slot, s2 = P.loc[c2][k2].slot;
        assert_int_equal(dt_flip_bit(file_path("slab-0000.kvh"),
                                     (uint64_t)s1 * SLOT_BYTES + 4096 + dt_below(&rng, 4096),
                                     (unsigned)dt_below(&rng, 8)),
                         0);
        assert_int_equal(dt_flip_bit(file_path("slab-0000.kvh"), (uint64_t)s2 * SLOT_BYTES + dt_below(&rng, 4096),
                                     (unsigned)dt_below(&rng, 8)),
                         0);
        rc = dt_run_tool(tool, "verify", P.dir, NULL, out, sizeof(out));
        char l1[64], l2[64];
        snprintf(l1, sizeof(l1), "BAD slot %u ", s1);
        snprintf(l2, sizeof(l2), "BAD slot %u ", s2);
        if (rc != 1 || !strstr(out, l1) || !strstr(out, l2) || !strstr(out, "2 bad"))
            fail_msg("slots %u and %u flipped: kvh-store verify exited %d:\n%s", s1, s2, rc, out);
    }

    /* a flipped index record */
    restore();
    assert_int_equal(dt_flip_bit(file_path("index"), P.loc[2][1].rec_off + 30, 3), 0);
    rc = dt_run_tool(tool, "verify", P.dir, NULL, out, sizeof(out));
    if (rc != 1 || !strstr(out, "index records or headers damaged"))
        fail_msg("index record flipped: kvh-store verify exited %d:\n%s", rc, out);

    /* a store in use is refused (exit 2), naming the owner */
    restore();
    kvh_config cfg = cfg_for(P.dir);
    cfg.migration_threads = 0;
    kvh_engine *e = dt_open_a(&cfg);
    rc = dt_run_tool(tool, "verify", P.dir, NULL, out, sizeof(out));
    char pid[32];
    snprintf(pid, sizeof(pid), "%ld", (long)getpid());
    dt_assert_ok(dt_close(e));
    if (rc != 2 || !strstr(out, pid))
        fail_msg("store in use: kvh-store verify exited %d:\n%s", rc, out);
    /* read-only: verifying changed nothing */
    restore();
    rc = dt_run_tool(tool, "verify", P.dir, NULL, out, sizeof(out));
    assert_int_equal(rc, 0);
    dt_saved_store after;
    assert_int_equal(dt_store_save(P.dir, &after), 0);
    for (int i = 0; i < P.saved.n; i++) {
        const dt_saved_file *a = dt_store_file(&after, P.saved.f[i].name);
        assert_non_null(a);
        if (strcmp(a->name, "LOCK") != 0)
            assert_true(a->len == P.saved.f[i].len && memcmp(a->data, P.saved.f[i].data, a->len) == 0);
    }
    dt_store_free(&after);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_bit_flips_1000, dt_teardown),
        cmocka_unit_test_teardown(test_journal_header_damage_is_reported, dt_teardown),
        cmocka_unit_test_teardown(test_swapped_blocks, dt_teardown),
        cmocka_unit_test_teardown(test_truncated_slab, dt_teardown),
        cmocka_unit_test_teardown(test_kvh_store_verify_truncated_slab, dt_teardown),
        cmocka_unit_test_teardown(test_truncated_index_and_journal, dt_teardown),
        cmocka_unit_test_teardown(test_short_snapshot_is_reported, dt_teardown),
        cmocka_unit_test_teardown(test_live_damage_is_never_served, dt_teardown),
        cmocka_unit_test_teardown(test_a_slab_cut_while_running_drops_what_it_lost, dt_teardown),
        cmocka_unit_test_teardown(test_kvh_store_verify, dt_teardown),
    };
    return cmocka_run_group_tests_name("disk_corruption", tests, group_setup, group_teardown);
}
