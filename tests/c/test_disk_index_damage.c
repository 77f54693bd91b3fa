/* Disk tier: a damaged index or journal costs no block whose slot is intact.
 *
 * A pristine store holds NC prefix chains of NB blocks: chains [0, SNAP)
 * in the snapshot `index` (closed cleanly), the others only in the
 * `journal` (written by a process that ended without closing). Each case
 * restores the pristine files, damages the index files only, opens the
 * store and checks every chain: matched in full and byte-identical.
 *
 *   - every bit of the checksummed index header (bytes [0, 84)) and of a
 *     journal record that good records follow, one at a time: the open
 *     rebuilds the index from the slot headers, every block is found,
 *     corrupt_blocks is 1 (the damaged header or record), a warning says
 *     so, and the store reopens without one (the index was rewritten);
 *     with disk_strict_index the open returns KVH_ERR_CORRUPT and leaves
 *     the files as they were;
 *   - every bit of the journal's last record, which is indistinguishable
 *     from a torn append: the default open finds its block from the slot,
 *     a strict one cuts it like a torn tail (that block is a miss);
 *   - bits of the header pages' padding, which nothing reads: no effect;
 *   - the index truncated at many offsets, zeroed or missing, the journal
 *     zeroed or missing, and both zeroed or missing (the store id then
 *     comes from the slot headers): every block is found; a strict open
 *     refuses each, except both files missing, which is what a crash
 *     while creating a store leaves (it starts empty);
 *   - with both headers gone, the slots of another store (a minority) are
 *     not taken; a damaged slot named by an intact record is dropped and
 *     counted;
 *   - a block that went to disk before its KV was complete (so never
 *     published) is not taken back from its slot header;
 *   - the index of an earlier close put back (older than its journal),
 *     or another store's index put in place: damage, every chain found
 *     from the slot headers;
 *   - a store whose index was never folded (every record in its journal)
 *     and whose journal is missing: damage, not a new store; a new
 *     store's empty journal alone (a crash while it was made) starts empty.
 *
 * On a tmpfs when there is one (fsync is free there); every bit in about
 * 2,500 opens, every byte (one bit of each) on a real disk.
 */
#include "rel_util.h"

#include "core/disk_format.h"

#define NC 8
#define NB 4
#define SNAP 4
static const dt_geo G = {1, 1, 64, 16, KVH_DTYPE_F16}; /* block = 4096 bytes, slot = 8192 */
#define DISK_SLOTS 64
#define SLOT_BYTES 8192u
#define HDR_COVERED 84u /* index/journal header bytes under the CRC: [0,80) + the CRC */

static dt_content chain(int c) { return dt_plain(0x1d0 + (uint64_t)c); }
static dt_chains chains(void) { return (dt_chains){G, chain, NC, NB, SNAP}; }

static kvh_config cfg_for(const char *dir)
{
    kvh_config c = dt_cfg(G, dir, 8, 32, DISK_SLOTS, 0);
    return c;
}

static struct {
    char dir[512];
    bool fast;
    dt_saved_store saved;
    dt_block_loc loc[NC][NB];
    size_t rec_bytes, journal_records;
    bool ready;
} P;

static char *file_path(const char *name)
{
    static char p[600];
    return dt_path(p, sizeof(p), P.dir, name);
}

static void build_pristine(void)
{
    if (P.ready)
        return;
    P.fast = rl_fast_scratch("index-damage", P.dir, sizeof(P.dir));
    kvh_config c = cfg_for(P.dir);
    dt_chains ch = chains();
    dt_chains_build_a(&c, &ch, &P.saved, &P.loc[0][0], &P.journal_records);
    P.rec_bytes = kvhi_index_rec_bytes(G.bt);
    assert_true(P.journal_records >= 2);
    P.ready = true;
}

static void restore(void)
{
    dt_rmrf(P.dir);
    mkdir(P.dir, 0755);
    assert_int_equal(dt_store_restore(P.dir, &P.saved), 0);
}

static const dt_block_loc *journal_record(int index, int *chain_out, int *block_out)
{
    for (int c = 0; c < NC; c++)
        for (int k = 0; k < NB; k++)
            if (P.loc[c][k].in_journal && P.loc[c][k].journal_index == index) {
                *chain_out = c, *block_out = k;
                return &P.loc[c][k];
            }
    fail_msg("no block has journal record %d", index);
    return NULL;
}

/* Opens the store as it is now and checks that chain c matches want[c]
 * blocks (all NB when want is NULL), byte-identical, and that
 * corrupt_blocks is `corrupt`. Returns the number of warnings that
 * mention a rebuild. */
static int expect_store_saying(const kvh_config *base, const int *want, uint64_t corrupt, const char *what,
                               const char *says)
{
    dt_log log;
    dt_log_init(&log);
    kvh_config c = *base;
    dt_log_attach(&c, &log);
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&c, &e);
    if (st != KVH_OK)
        fail_msg("%s: open returned %s (%s)", what, kvh_status_name(st), kvh_last_error());
    dt_track(e);
    dt_chains ch = chains();
    for (int i = 0; i < NC; i++)
        dt_chains_expect_a(e, &ch, i, want ? want[i] : NB, what);
    uint64_t got = dt_stats(e).corrupt_blocks;
    char msg[256];
    if (rl_counters_add_up(e, true, msg, sizeof(msg)))
        fail_msg("%s: %s", what, msg);
    dt_assert_ok(dt_close(e));
    if (got != corrupt)
        fail_msg("%s: corrupt_blocks %" PRIu64 ", expected %" PRIu64, what, got, corrupt);
    int said = dt_log_count(&log, KVH_LOG_WARN, says, NULL);
    pthread_mutex_destroy(&log.mu);
    return said;
}

/* expect_store_saying: how many warnings say the index was rebuilt. */
static int expect_store(const kvh_config *base, const int *want, uint64_t corrupt, const char *what)
{
    return expect_store_saying(base, want, corrupt, what, "rebuilt the index");
}

/* A strict open of the store as it is now: KVH_ERR_CORRUPT, and the index
 * files are left as they were. */
static void expect_strict_refusal(const char *what)
{
    size_t ilen = 0, jlen = 0;
    uint8_t *index = dt_read_file(file_path("index"), &ilen), *journal = dt_read_file(file_path("journal"), &jlen);
    kvh_config c = cfg_for(P.dir);
    c.disk_strict_index = 1;
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&c, &e);
    if (st != KVH_ERR_CORRUPT) {
        kvh_engine_close(e);
        fail_msg("%s: strict open returned %s, expected KVH_ERR_CORRUPT", what, kvh_status_name(st));
    }
    size_t ilen2 = 0, jlen2 = 0;
    uint8_t *index2 = dt_read_file(file_path("index"), &ilen2), *journal2 = dt_read_file(file_path("journal"), &jlen2);
    bool same = (!index) == (!index2) && (!journal) == (!journal2) && ilen == ilen2 && jlen == jlen2 &&
                (!index || memcmp(index, index2, ilen) == 0) && (!journal || memcmp(journal, journal2, jlen) == 0);
    free(index), free(journal), free(index2), free(journal2);
    if (!same)
        fail_msg("%s: the refused strict open changed the index files", what);
}

/* Flips bit `bit` of byte `off` of `file`, then checks the default open
 * (every block found; corrupt_blocks `corrupt`; a rebuild warning) and,
 * when `refuse`, the strict one. */
static void flip_case(const char *file, uint64_t off, unsigned bit, uint64_t corrupt, bool refuse, bool reopen)
{
    char what[160];
    snprintf(what, sizeof(what), "%s byte %" PRIu64 " bit %u flipped", file, off, bit);
    restore();
    assert_int_equal(dt_flip_bit(file_path(file), off, bit), 0);
    if (refuse)
        expect_strict_refusal(what);
    kvh_config c = cfg_for(P.dir);
    if (expect_store(&c, NULL, corrupt, what) == 0)
        fail_msg("%s: no warning says the index was rebuilt", what);
    if (reopen) {
        char again[200];
        snprintf(again, sizeof(again), "%s, reopened", what);
        if (expect_store(&c, NULL, 0, again) != 0)
            fail_msg("%s: rebuilt again: the damaged index was not rewritten", again);
    }
}

/* The bits of bytes [first, end) of `file` that a run flips: all of them on
 * a tmpfs, one a byte (a different one each byte) on a real disk. */
static int flip_range(const char *file, uint64_t first, uint64_t end, uint64_t corrupt)
{
    int n = 0;
    for (uint64_t off = first; off < end; off++)
        for (unsigned bit = 0; bit < 8; bit++) {
            if (!P.fast && bit != off % 8)
                continue;
            flip_case(file, off, bit, corrupt, true, n % 64 == 0);
            n++;
        }
    return n;
}

static void test_every_header_and_record_bit(void **state)
{
    (void)state;
    build_pristine();
    double t0 = dt_now();
    int flips = flip_range("index", 0, HDR_COVERED, 1);
    flips += flip_range("journal", 0, HDR_COVERED, 1);
    int c, k;
    const dt_block_loc *mid = journal_record((int)P.journal_records / 2, &c, &k);
    flips += flip_range("journal", mid->rec_off, mid->rec_off + P.rec_bytes, 1);
    /* The index's own records: a few, one bit each. */
    for (int i = 0; i < 8; i++, flips++) {
        const dt_block_loc *L = &P.loc[i % SNAP][i % NB];
        flip_case("index", L->rec_off + (uint64_t)(i * 13) % P.rec_bytes, (unsigned)i, 1, true, false);
    }
    print_message("%d single-bit flips of index/journal headers and records: every block found, strict refused "
                  "each (%s, %.1f s)\n",
                  flips, P.fast ? "tmpfs, every bit" : "real disk, one bit a byte", dt_now() - t0);
}

static void test_last_journal_record(void **state)
{
    (void)state;
    build_pristine();
    int c, k;
    const dt_block_loc *last = journal_record((int)P.journal_records - 1, &c, &k);
    kvh_config cfg = cfg_for(P.dir), strict = cfg;
    strict.disk_strict_index = 1;
    int want[NC];
    for (int i = 0; i < NC; i++)
        want[i] = i == c ? k : NB;
    for (uint64_t off = last->rec_off; off < last->rec_off + P.rec_bytes; off++)
        for (unsigned bit = 0; bit < 8; bit++) {
            if (!P.fast && bit != off % 8)
                continue;
            char what[160];
            snprintf(what, sizeof(what), "last journal record byte %" PRIu64 " bit %u", off, bit);
            restore();
            assert_int_equal(dt_flip_bit(file_path("journal"), off, bit), 0);
            expect_store(&strict, want, 0, what); /* a torn tail: cut, not counted */
            restore();
            assert_int_equal(dt_flip_bit(file_path("journal"), off, bit), 0);
            expect_store(&cfg, NULL, 0, what);
        }
    /* A record cut in half at the end is the same. */
    restore();
    assert_int_equal(truncate(file_path("journal"), (off_t)(last->rec_off + P.rec_bytes / 2)), 0);
    if (expect_store_saying(&strict, want, 0, "journal cut inside its last record (strict)", "cuts it there") != 1)
        fail_msg("a strict open cut the journal without a warning");
    restore();
    assert_int_equal(truncate(file_path("journal"), (off_t)(last->rec_off + P.rec_bytes / 2)), 0);
    expect_store(&cfg, NULL, 0, "journal cut inside its last record");
}

static void test_header_padding_is_not_read(void **state)
{
    (void)state;
    build_pristine();
    kvh_config strict = cfg_for(P.dir);
    strict.disk_strict_index = 1;
    dt_rng rng = {dt_seed(0x9ad)};
    const char *files[2] = {"index", "journal"};
    for (int i = 0; i < 32; i++) {
        uint64_t off = HDR_COVERED + dt_below(&rng, 4096 - HDR_COVERED);
        unsigned bit = (unsigned)dt_below(&rng, 8);
        char what[160];
        snprintf(what, sizeof(what), "%s header padding byte %" PRIu64 " bit %u", files[i % 2], off, bit);
        restore();
        assert_int_equal(dt_flip_bit(file_path(files[i % 2]), off, bit), 0);
        if (expect_store(&strict, NULL, 0, what) != 0)
            fail_msg("%s: the index was rebuilt", what);
    }
}

static void zero_file(const char *name)
{
    size_t len = 0;
    uint8_t *data = dt_read_file(file_path(name), &len);
    assert_non_null(data);
    memset(data, 0, len);
    assert_int_equal(dt_write_file(file_path(name), data, len), 0);
    free(data);
}

static void test_truncated_zeroed_missing(void **state)
{
    (void)state;
    build_pristine();
    kvh_config cfg = cfg_for(P.dir);
    const dt_saved_file *ix = dt_store_file(&P.saved, "index");
    assert_non_null(ix);
    uint64_t cuts[] = {0,
                       1,
                       40,
                       83,
                       84,
                       85,
                       4095,
                       4096,
                       4096 + P.rec_bytes,
                       4096 + 3 * P.rec_bytes + 7,
                       ix->len - P.rec_bytes,
                       ix->len - 1};
    for (size_t i = 0; i < sizeof(cuts) / sizeof(cuts[0]); i++) {
        char what[96];
        snprintf(what, sizeof(what), "index cut at %" PRIu64, cuts[i]);
        restore();
        assert_int_equal(truncate(file_path("index"), (off_t)cuts[i]), 0);
        expect_strict_refusal(what);
        /* Counted: the header when it was cut, else the records it says
         * the file holds and the cut took. */
        uint64_t kept = cuts[i] > 4096 ? (cuts[i] - 4096) / P.rec_bytes : 0;
        uint64_t counted = cuts[i] < HDR_COVERED ? 1 : (ix->len - 4096) / P.rec_bytes - kept;
        if (expect_store(&cfg, NULL, counted, what) == 0)
            fail_msg("%s: no warning says the index was rebuilt", what);
    }
    /* Strict refuses every case, both files missing beside slab files
     * too: starting empty there lost every block a scan would have kept. */
    struct {
        const char *what;
        bool zero_index, zero_journal, rm_index, rm_journal;
    } cases[] = {
        {"index zeroed", true, false, false, false},
        {"index missing", false, false, true, false},
        {"journal zeroed", false, true, false, false},
        {"journal missing", false, false, false, true},
        {"index and journal zeroed", true, true, false, false},
        {"index and journal missing", false, false, true, true},
        {"index missing, journal zeroed", false, true, true, false},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        restore();
        if (cases[i].zero_index)
            zero_file("index");
        if (cases[i].zero_journal)
            zero_file("journal");
        if (cases[i].rm_index)
            assert_int_equal(unlink(file_path("index")), 0);
        if (cases[i].rm_journal)
            assert_int_equal(unlink(file_path("journal")), 0);
        expect_strict_refusal(cases[i].what);
        /* Zeroed: its header and every record count; missing: nothing does. */
        uint64_t corrupt = 0;
        if (cases[i].zero_index)
            corrupt += 1 + (ix->len - 4096) / P.rec_bytes;
        if (cases[i].zero_journal)
            corrupt += 1; /* the header; zeroed records after it are a torn tail */
        if (expect_store(&cfg, NULL, corrupt, cases[i].what) == 0)
            fail_msg("%s: no warning says the index was rebuilt", cases[i].what);
        char again[128];
        snprintf(again, sizeof(again), "%s, reopened", cases[i].what);
        if (expect_store(&cfg, NULL, 0, again) != 0)
            fail_msg("%s: rebuilt again", again);
    }
}

/* A slab file lost at rest: the index names blocks in it that no open
 * can find. A strict open refused nothing and a default one said nothing,
 * recreating the slab empty. */
static void test_a_missing_slab_is_damage(void **state)
{
    (void)state;
    build_pristine();
    kvh_config cfg = cfg_for(P.dir);
    restore();
    assert_int_equal(unlink(file_path("slab-0000.kvh")), 0);
    expect_strict_refusal("slab-0000.kvh missing");
    int none[NC] = {0};
    /* every record names a lost block: each is counted once */
    if (expect_store_saying(&cfg, none, NC * NB, "slab-0000.kvh missing", "slab-0000.kvh is missing") == 0)
        fail_msg("no warning names the missing slab");
    if (expect_store(&cfg, none, 0, "slab-0000.kvh missing, reopened") != 0)
        fail_msg("the reopened store was rebuilt again");
}

/* A new store that a process persisted into and left without closing:
 * its index is still the header creation wrote, every record is in the
 * journal. */
static int persist_and_leave(void *dir)
{
    kvh_config c = cfg_for(dir);
    kvh_engine *e = NULL;
    kvh_seq s;
    if (kvh_engine_open(&c, &e) != KVH_OK || dt_build(e, G, chain(0), NB * G.bt, 0, &s) != KVH_OK ||
        kvh_seq_persist(e, s) != KVH_OK)
        return 1;
    return 0; /* no close: as a process killed here */
}

/* Opens dir; returns how many tokens of chain 0 it matches (verified),
 * or fails the test when the open returns something other than want. */
static size_t open_and_match(const kvh_config *c, kvh_status want, const char *what)
{
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(c, &e);
    dt_track(e);
    if (st != want)
        fail_msg("%s: open returned %s (%s), expected %s", what, kvh_status_name(st), kvh_last_error(),
                 kvh_status_name(want));
    if (st != KVH_OK)
        return 0;
    size_t m = 0;
    char msg[256] = "";
    if (dt_match_verify(e, G, chain(0), NB * G.bt, &m, msg, sizeof(msg)) != KVH_OK)
        fail_msg("%s: %s", what, msg);
    dt_assert_ok(dt_close(e));
    return m;
}

/* An index never folded says nothing of the journal it goes with: the
 * journal missing beside it is damage (every record was there), not a
 * new store. A new store's empty journal alone is what a crash while the
 * store was made leaves (the journal is made first): it starts empty,
 * strict or not. */
static void test_journal_of_a_store_never_folded(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("never-folded", dir, sizeof(dir));
    assert_int_equal(dt_in_child(persist_and_leave, dir), 0);
    char path[600];
    assert_int_equal(unlink(dt_path(path, sizeof(path), dir, "journal")), 0);
    kvh_config strict = cfg_for(dir);
    strict.disk_strict_index = 1;
    open_and_match(&strict, KVH_ERR_CORRUPT, "journal missing beside a new index, strict");
    kvh_config c = cfg_for(dir);
    size_t m = open_and_match(&c, KVH_OK, "journal missing beside a new index");
    if (m != NB * G.bt)
        fail_msg("journal missing beside a new index: %zu of %u tokens found", m, NB * G.bt);

    /* That rebuild wrote an index of the found blocks and a journal with
     * no record yet: the index missing next is damage again, not a
     * creation cut short. */
    assert_int_equal(unlink(dt_path(path, sizeof(path), dir, "index")), 0);
    open_and_match(&strict, KVH_ERR_CORRUPT, "index missing after a rebuild, strict");
    m = open_and_match(&c, KVH_OK, "index missing after a rebuild");
    if (m != NB * G.bt)
        fail_msg("index missing after a rebuild: %zu of %u tokens found", m, NB * G.bt);

    dt_scratch("creation-cut", dir, sizeof(dir));
    dt_rmrf(dir); /* the store makes it */
    c = cfg_for(dir);
    kvh_engine *e = dt_open_a(&c);
    dt_assert_ok(dt_close(e));
    assert_int_equal(unlink(dt_path(path, sizeof(path), dir, "index")), 0);
    strict = cfg_for(dir);
    strict.disk_strict_index = 1;
    assert_int_equal(open_and_match(&strict, KVH_OK, "a new store's journal alone, strict"), 0);
}

/* Rewrites the slot header of block k of chain c with its store id plus
 * id_delta and the given flags (a valid header still). */
static void rewrite_slot(int c, int k, uint64_t id_delta, uint32_t flags)
{
    int fd = open(file_path("slab-0000.kvh"), O_RDWR | O_CLOEXEC);
    assert_true(fd >= 0);
    uint8_t hdr[4096];
    off_t at = (off_t)P.loc[c][k].slot * SLOT_BYTES;
    assert_int_equal(pread(fd, hdr, sizeof(hdr), at), (ssize_t)sizeof(hdr));
    int32_t tk[16];
    for (int i = 0; i < 16; i++)
        tk[i] = (int32_t)dt_get32(hdr + 68 + 4 * i);
    /* header fields (disk_format.c): 12 n_tokens, 16 store_id, 24 slot,
     * 32 offset, 40 hash, 48 parent, 64 data_crc, 4084 flags, 4088 tag */
    kvhi_slot_meta m = {.store_id = dt_get64(hdr + 16) + id_delta,
                        .slot = dt_get64(hdr + 24),
                        .offset = dt_get64(hdr + 32),
                        .hash = dt_get64(hdr + 40),
                        .parent = dt_get64(hdr + 48),
                        .n_tokens = dt_get32(hdr + 12),
                        .data_crc = dt_get32(hdr + 64),
                        .flags = dt_get32(hdr + 4084),
                        .geo_tag = dt_get32(hdr + 4088),
                        .tokens = tk};
    assert_int_equal(m.flags, KVHI_SLOT_PUBLISHED);
    m.flags = flags;
    kvhi_slot_header_encode(hdr, &m, 4096);
    assert_int_equal(pwrite(fd, hdr, sizeof(hdr), at), (ssize_t)sizeof(hdr));
    close(fd);
}

/* Another store's block: a valid, published header. */
static void make_foreign(int c, int k) { rewrite_slot(c, k, 1, KVHI_SLOT_PUBLISHED); }

/* A slot that checks out but carries no publish mark (as slots written
 * before the mark existed, or never persisted): with index and journal
 * gone, nothing vouches for it and the rebuild leaves it out. The warning
 * said "0 blocks" and nothing of the slots it passed over. */
static void test_unvouched_slots_are_counted(void **state)
{
    (void)state;
    build_pristine();
    kvh_config cfg = cfg_for(P.dir);
    restore();
    rewrite_slot(1, 2, 0, 0);
    assert_int_equal(unlink(file_path("index")), 0);
    assert_int_equal(unlink(file_path("journal")), 0);
    int want[NC];
    for (int i = 0; i < NC; i++)
        want[i] = i == 1 ? 2 : NB;
    if (expect_store_saying(&cfg, want, 0, "one slot without its publish mark", "1 intact slots left out") != 1)
        fail_msg("no warning counts the slot left out");
    /* Every slot unmarked (a store of before the mark): none is kept, the
     * store gets a new id, and the warning still counts them all. */
    restore();
    for (int c = 0; c < NC; c++)
        for (int k = 0; k < NB; k++)
            rewrite_slot(c, k, 0, 0);
    assert_int_equal(unlink(file_path("index")), 0);
    assert_int_equal(unlink(file_path("journal")), 0);
    for (int i = 0; i < NC; i++)
        want[i] = 0;
    char all[64];
    snprintf(all, sizeof(all), "%d intact slots left out", NC * NB);
    if (expect_store_saying(&cfg, want, 0, "no slot with its publish mark", all) != 1)
        fail_msg("no warning counts the %d slots left out", NC * NB);
}

static void test_store_id_and_dropped_slots(void **state)
{
    (void)state;
    build_pristine();
    kvh_config cfg = cfg_for(P.dir);
    /* Both headers gone: the id most slots carry wins; chain 2's slots,
     * carrying another, are not taken. */
    restore();
    zero_file("index");
    zero_file("journal");
    for (int k = 0; k < NB; k++)
        make_foreign(2, k);
    int want[NC];
    for (int i = 0; i < NC; i++)
        want[i] = i == 2 ? 0 : NB;
    const dt_saved_file *ix = dt_store_file(&P.saved, "index");
    expect_store(&cfg, want, 2 + (ix->len - 4096) / P.rec_bytes, "both headers zeroed, chain 2 foreign");
    /* One foreign block with the index header intact: its record names a
     * slot of another store, so it is dropped when the journal's damage
     * makes the open rebuild; the chain stops there. */
    restore();
    make_foreign(1, 2);
    int c, k;
    const dt_block_loc *mid = journal_record((int)P.journal_records / 2, &c, &k);
    assert_int_equal(dt_flip_bit(file_path("journal"), mid->rec_off + 9, 1), 0);
    for (int i = 0; i < NC; i++)
        want[i] = i == 1 ? 2 : NB;
    expect_store(&cfg, want, 2, "foreign slot of chain 1, damaged journal record");
    /* A damaged slot (data) that an intact record names: dropped by the
     * rebuild and counted with the damaged header. */
    restore();
    assert_int_equal(dt_flip_bit(file_path("slab-0000.kvh"), (uint64_t)P.loc[5][1].slot * SLOT_BYTES + 5000, 4), 0);
    assert_int_equal(dt_flip_bit(file_path("index"), 20, 6), 0);
    for (int i = 0; i < NC; i++)
        want[i] = i == 5 ? 1 : NB;
    expect_store(&cfg, want, 2, "damaged slot of chain 5, damaged index header");
}

static void test_unpublished_slot_is_not_taken(void **state)
{
    (void)state;
    char dir[512];
    bool fast = rl_fast_scratch("index-damage-unpublished", dir, sizeof(dir));
    (void)fast;
    kvh_config cfg = cfg_for(dir);
    kvh_engine *e = dt_open_a(&cfg);
    /* A persisted chain, then a block whose tokens are all there but only
     * half of its KV: it has its prefix hash, is never published, and
     * goes to disk as it is. */
    dt_content done = dt_plain(0x51), half = dt_plain(0x52);
    kvh_seq a, b;
    dt_assert_ok(dt_build(e, G, done, 2 * G.bt, 0, &a));
    dt_assert_ok(kvh_seq_persist(e, a));
    dt_assert_ok(kvh_seq_free(e, a));
    dt_assert_ok(kvh_seq_create(e, 0, &b));
    int32_t tk[16];
    dt_tokens(half, 0, G.bt, tk);
    dt_assert_ok(kvh_seq_append(e, b, tk, G.bt));
    size_t tb = dt_tok_bytes(G);
    uint8_t kbuf[8 * 128], vbuf[8 * 128];
    assert_true(tb * 8 <= sizeof(kbuf));
    for (int t = 0; t < 8; t++) {
        dt_kv_token(half, 0, (uint64_t)t, 0, kbuf + t * tb, tb);
        dt_kv_token(half, 0, (uint64_t)t, 1, vbuf + t * tb, tb);
    }
    dt_assert_ok(kvh_seq_write_kv(e, b, 0, 0, 8, kbuf, vbuf));
    dt_assert_ok(kvh_seq_migrate(e, b, 0, G.bt, KVH_TIER_DISK, NULL));
    kvh_block_info bi = dt_binfo(e, b, 0);
    assert_int_equal(bi.tier, KVH_TIER_DISK);
    dt_assert_ok(dt_close(e));
    /* Its slot header is valid and carries its hash, but not the flag. */
    char slab[600], index[600];
    size_t len = 0;
    uint8_t *s = dt_read_file(dt_path(slab, sizeof(slab), dir, "slab-0000.kvh"), &len);
    assert_non_null(s);
    const uint8_t *h = s + (size_t)bi.slot * SLOT_BYTES;
    assert_memory_equal(h, "KVHBLK\0\1", 8);
    assert_true(dt_get64(h + 40) != 0);
    assert_int_equal(dt_get32(h + 4084), 0);
    free(s);
    /* The index gone: the persisted chain is found, the half block not. */
    assert_int_equal(unlink(dt_path(index, sizeof(index), dir, "index")), 0);
    dt_log log;
    dt_log_init(&log);
    dt_log_attach(&cfg, &log);
    e = dt_open_a(&cfg);
    size_t m = 0;
    char msg[256] = "";
    if (dt_match_verify(e, G, done, 2 * G.bt, &m, msg, sizeof(msg)) != KVH_OK)
        fail_msg("%s", msg);
    assert_int_equal(m, 2 * G.bt);
    if (dt_match_verify(e, G, half, G.bt, &m, msg, sizeof(msg)) != KVH_OK)
        fail_msg("%s", msg);
    if (m != 0)
        fail_msg("a block whose KV was never complete was taken back from its slot header (%zu tokens)", m);
    dt_assert_ok(dt_close(e));
    assert_int_equal(dt_log_count(&log, KVH_LOG_WARN, "index file is missing", "rebuilt", NULL), 1);
    pthread_mutex_destroy(&log.mu);
    dt_rmrf(dir);
}

/* The index of an earlier close put back beside the journal of a later
 * one (an older copy restored): a well-formed index whose seq is short of
 * its journal's, so the records folded in between are in neither file.
 * The open returned KVH_OK with those chains gone and no warning. The
 * default open now rebuilds from the slot headers (every chain found);
 * a strict one refuses. */
static void test_an_older_index_put_back(void **state)
{
    (void)state;
    build_pristine();
    restore();
    kvh_config cfg = cfg_for(P.dir);
    size_t old_len = 0;
    uint8_t *old_index = dt_read_file(file_path("index"), &old_len);
    assert_non_null(old_index);
    /* A clean close folds the journal's chains into a newer snapshot. */
    expect_store(&cfg, NULL, 0, "before the index is put back");
    size_t ilen = 0, jlen = 0;
    uint8_t *index = dt_read_file(file_path("index"), &ilen), *journal = dt_read_file(file_path("journal"), &jlen);
    kvhi_index_header old_h, new_h, journal_h;
    assert_int_equal(kvhi_index_header_decode(old_index, old_len, &old_h), 0);
    assert_int_equal(kvhi_index_header_decode(index, ilen, &new_h), 0);
    assert_int_equal(kvhi_index_header_decode(journal, jlen, &journal_h), 0);
    free(index), free(journal);
    assert_true(new_h.seq > old_h.seq);
    assert_int_equal(journal_h.seq, new_h.seq + 1);

    assert_int_equal(dt_write_file(file_path("index"), old_index, old_len), 0);
    free(old_index);
    expect_strict_refusal("an older index put back");
    if (expect_store(&cfg, NULL, 0, "an older index put back") == 0)
        fail_msg("an older index put back: no warning says the index was rebuilt");
    if (expect_store(&cfg, NULL, 0, "an older index put back, reopened") != 0)
        fail_msg("an older index put back: rebuilt again");
}

static dt_content other_chain(int c) { return dt_plain(0x2e0 + (uint64_t)c); }

/* The index of another store (same geometry and model_salt) put in place
 * of this one's: the two headers name different stores, which no crash
 * leaves. Taken as it is, it named none of this store's blocks, its
 * journal was left out as another store's, and every chain was lost
 * without a word (and their slots reused). It is damage: the store id
 * most slots carry wins, every chain is found, and the other store's
 * records, whose slots are not theirs, are counted. */
static void test_another_stores_index_put_in_place(void **state)
{
    (void)state;
    build_pristine();
    char other_dir[600];
    snprintf(other_dir, sizeof(other_dir), "%s.other", P.dir);
    dt_rmrf(other_dir);
    kvh_config oc = cfg_for(other_dir);
    dt_chains other = {G, other_chain, 2, NB, 2};
    kvh_engine *e = dt_open_a(&oc);
    assert_int_equal(dt_chains_persist(e, &other, 0, other.n - 1), 0);
    dt_assert_ok(dt_close(e));
    char other_index[700];
    size_t len = 0;
    uint8_t *index = dt_read_file(dt_path(other_index, sizeof(other_index), other_dir, "index"), &len);
    assert_non_null(index);
    dt_rmrf(other_dir);

    restore();
    assert_int_equal(dt_write_file(file_path("index"), index, len), 0);
    free(index);
    const char *what = "another store's index";
    expect_strict_refusal(what);
    kvh_config cfg = cfg_for(P.dir);
    if (expect_store_saying(&cfg, NULL, (uint64_t)other.n * NB, what, "different stores") == 0)
        fail_msg("%s: no warning says the index and journal are of different stores", what);
    if (expect_store(&cfg, NULL, 0, "another store's index, reopened") != 0)
        fail_msg("%s: rebuilt again", what);
}

/* With both index files gone, the slots are the only word on whose store
 * this is: an open under another model_salt is refused as a mismatch
 * (it took the store over, empty, and the rightful model then found
 * nothing), the reset flag still starts it empty, and the model that
 * wrote it finds every block. Zeroed headers say no more than missing
 * files. */
static void test_another_models_slots_are_refused_not_taken(void **state)
{
    (void)state;
    build_pristine();
    kvh_config cfg = cfg_for(P.dir), other = cfg;
    other.model_salt = cfg.model_salt ^ 0x5a17u;
    for (int zeroed = 0; zeroed < 2; zeroed++) {
        restore();
        if (zeroed) {
            zero_file("index");
            zero_file("journal");
        } else {
            assert_int_equal(unlink(file_path("index")), 0);
            assert_int_equal(unlink(file_path("journal")), 0);
        }
        const char *what = zeroed ? "both headers zeroed, another salt" : "both files missing, another salt";
        open_and_match(&other, KVH_ERR_MISMATCH, what);
        assert_non_null(strstr(kvh_last_error(), "model_salt"));
        /* Zeroed: each header and every index record count (as above). */
        const dt_saved_file *ix = dt_store_file(&P.saved, "index");
        uint64_t corrupt = zeroed ? 2 + (ix->len - 4096) / P.rec_bytes : 0;
        if (expect_store(&cfg, NULL, corrupt, what) == 0)
            fail_msg("%s: no warning says the index was rebuilt", what);
        kvh_config reset = other;
        reset.disk_flags |= KVH_DISK_RESET_ON_MISMATCH;
        restore();
        assert_int_equal(unlink(file_path("index")), 0);
        assert_int_equal(unlink(file_path("journal")), 0);
        assert_int_equal(open_and_match(&reset, KVH_OK, "reset under another salt"), 0);
    }
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
        cmocka_unit_test_teardown(test_every_header_and_record_bit, dt_teardown),
        cmocka_unit_test_teardown(test_last_journal_record, dt_teardown),
        cmocka_unit_test_teardown(test_header_padding_is_not_read, dt_teardown),
        cmocka_unit_test_teardown(test_truncated_zeroed_missing, dt_teardown),
        cmocka_unit_test_teardown(test_store_id_and_dropped_slots, dt_teardown),
        cmocka_unit_test_teardown(test_unpublished_slot_is_not_taken, dt_teardown),
        cmocka_unit_test_teardown(test_journal_of_a_store_never_folded, dt_teardown),
        cmocka_unit_test_teardown(test_an_older_index_put_back, dt_teardown),
        cmocka_unit_test_teardown(test_another_stores_index_put_in_place, dt_teardown),
        cmocka_unit_test_teardown(test_another_models_slots_are_refused_not_taken, dt_teardown),
        cmocka_unit_test_teardown(test_unvouched_slots_are_counted, dt_teardown),
        cmocka_unit_test_teardown(test_a_missing_slab_is_damage, dt_teardown),
    };
    return cmocka_run_group_tests_name("disk_index_damage", tests, NULL, group_teardown);
}
