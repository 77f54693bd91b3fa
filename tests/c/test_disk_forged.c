/* Disk tier: forged store contents are rejected or a miss, never read out
 * of bounds.
 *
 * A store that someone else wrote can carry valid checksums around hostile
 * values: the files are re-encoded here with the library's own encoders
 * (core/disk_format.h), so every CRC is right. Each case restores a
 * pristine store of one persisted chain of NB blocks, forges one thing,
 * opens the store, matches the chain and checks that nothing but the
 * chain's own blocks is served, then runs kvh-store info and verify on it
 * (exit 0, 1 or 2, never a signal). Under ASan any out-of-bounds read or
 * write fails the test.
 *
 *   - index records (snapshot and journal): hash 0, a slot number past the
 *     store (2^32 - 1, 2^40, n_slots), a token count past block_tokens or
 *     short of it, a duplicate of a cached hash on another slot, a second
 *     record claiming a slot with other tokens, a huge record count in the
 *     header;
 *   - index headers: a hostile geometry (block_tokens 0 or 257, a block
 *     size of 0 or one that wraps the slot size): the open is
 *     KVH_ERR_MISMATCH (or a rebuild), kvh-store refuses the store;
 *   - index headers naming a dtype or KV codec no engine has: damage like
 *     any header that fails its checks (rebuilt from the slot headers, or
 *     KVH_ERR_CORRUPT under disk_strict_index), kvh-store refuses it;
 *   - slot headers: a token count past the header, a slot number, offset
 *     or block size other than the slot's: that block is a miss (counted
 *     corrupt), also when the index is gone and the store is rebuilt from
 *     the slot headers.
 *
 * The remote tier's value format does not exist yet; when it lands, its
 * decoder gets the same cases.
 */
#include "disk_test_util.h"

#include "core/crc32c.h"
#include "core/disk_format.h"

#define NB 4
static const dt_geo G = {1, 1, 64, 16, KVH_DTYPE_F16}; /* block 4096 bytes, slot 8192 */
#define DISK_SLOTS 64
#define SLOT_BYTES 8192u

static struct {
    char dir[512];
    dt_saved_store saved;
    size_t rec_bytes;
    uint64_t slot_of[NB];
    uint64_t hash_of[NB];
    int32_t tokens[NB * 16];
} S;

static dt_content chain(void) { return dt_plain(0xf06e); }

static kvh_config cfg(void) { return dt_cfg(G, S.dir, 8, 32, DISK_SLOTS, 0); }

static char *file(const char *name)
{
    static char buf[600];
    return dt_path(buf, sizeof(buf), S.dir, name);
}

/* The pristine store: one chain persisted, the engine closed (snapshot). */
static int setup(void **state)
{
    (void)state;
    dt_scratch("forged", S.dir, sizeof(S.dir));
    kvh_config c = cfg();
    kvh_engine *e = dt_open_a(&c);
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, chain(), NB * G.bt, 0, &s));
    dt_assert_ok(kvh_seq_persist(e, s));
    for (int i = 0; i < NB; i++) {
        kvh_block_info bi = dt_binfo(e, s, (uint64_t)i);
        S.hash_of[i] = bi.hash;
    }
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
    dt_tokens(chain(), 0, NB * G.bt, S.tokens);
    S.rec_bytes = kvhi_index_rec_bytes(G.bt);
    /* Where each block lives, from the snapshot's records. */
    size_t len = 0;
    uint8_t *ix = dt_read_file(file("index"), &len);
    assert_non_null(ix);
    int32_t tk[16];
    for (size_t off = KVHI_DISK_ALIGN; off + S.rec_bytes <= len; off += S.rec_bytes) {
        kvhi_index_rec r = {.tokens = tk};
        assert_int_equal(kvhi_index_rec_decode(ix + off, &r, G.bt), 0);
        for (int i = 0; i < NB; i++)
            if (r.hash == S.hash_of[i])
                S.slot_of[i] = r.slot;
    }
    free(ix);
    assert_int_equal(dt_store_save(S.dir, &S.saved), 0);
    return 0;
}

static int teardown(void **state)
{
    dt_teardown(state);
    dt_store_free(&S.saved);
    return 0;
}

static void restore(void) { assert_int_equal(dt_store_restore(S.dir, &S.saved), 0); }

/* Appends one record to `name` (index or journal), CRC computed. */
static void add_record(const char *name, const kvhi_index_rec *r)
{
    size_t len = 0;
    uint8_t *f = dt_read_file(file(name), &len);
    assert_non_null(f);
    uint8_t *g = malloc(len + S.rec_bytes);
    assert_non_null(g);
    memcpy(g, f, len);
    kvhi_index_rec_encode(g + len, r, G.bt);
    /* Records past a snapshot's count are still read: keep the count. */
    assert_int_equal(dt_write_file(file(name), g, len + S.rec_bytes), 0);
    free(f);
    free(g);
}

/* A record that kvhi_index_rec_decode would refuse is written by hand:
 * same layout, valid CRC. */
static void add_raw_record(const char *name, uint32_t kind, uint64_t seq, uint64_t slot, uint64_t hash,
                           uint32_t n_tokens)
{
    kvhi_index_rec r = {.kind = kind, .seq = seq, .slot = slot, .hash = hash, .n_tokens = 0, .tokens = NULL};
    size_t len = 0;
    uint8_t *f = dt_read_file(file(name), &len);
    assert_non_null(f);
    uint8_t *g = malloc(len + S.rec_bytes);
    assert_non_null(g);
    memcpy(g, f, len);
    uint8_t *p = g + len;
    kvhi_index_rec_encode(p, &r, G.bt);
    for (int i = 0; i < 4; i++)
        p[40 + i] = (uint8_t)(n_tokens >> (8 * i));
    uint32_t crc = kvhi_crc32c(0, p, S.rec_bytes - 4);
    for (int i = 0; i < 4; i++)
        p[S.rec_bytes - 4 + i] = (uint8_t)(crc >> (8 * i));
    assert_int_equal(dt_write_file(file(name), g, len + S.rec_bytes), 0);
    free(f);
    free(g);
}

/* Rewrites the header of `name` with h (CRC computed). */
static void put_header(const char *name, const kvhi_index_header *h)
{
    size_t len = 0;
    uint8_t *f = dt_read_file(file(name), &len);
    assert_non_null(f);
    assert_true(len >= KVHI_DISK_ALIGN);
    kvhi_index_header_encode(f, h);
    assert_int_equal(dt_write_file(file(name), f, len), 0);
    free(f);
}

static kvhi_index_header get_header(const char *name)
{
    size_t len = 0;
    uint8_t *f = dt_read_file(file(name), &len);
    assert_non_null(f);
    kvhi_index_header h;
    assert_int_equal(kvhi_index_header_decode(f, len, &h), 0);
    free(f);
    return h;
}

/* Sets a 32- or 64-bit field of slot `slot`'s header and recomputes its CRC. */
static void forge_slot(uint64_t slot, uint32_t at, uint64_t value, int bytes)
{
    size_t len = 0;
    uint8_t *f = dt_read_file(file("slab-0000.kvh"), &len);
    assert_non_null(f);
    uint8_t *h = f + slot * SLOT_BYTES;
    assert_true((slot + 1) * SLOT_BYTES <= len);
    for (int i = 0; i < bytes; i++)
        h[at + i] = (uint8_t)(value >> (8 * i));
    uint32_t crc = kvhi_crc32c(0, h, KVHI_SLOT_HEADER_BYTES - 4);
    for (int i = 0; i < 4; i++)
        h[KVHI_SLOT_HEADER_BYTES - 4 + i] = (uint8_t)(crc >> (8 * i));
    assert_int_equal(dt_write_file(file("slab-0000.kvh"), f, len), 0);
    free(f);
}

/* kvh-store info and verify end with a status, never a signal. */
static void tool_survives(const char *what)
{
    char tool[600], out[4096];
    if (!dt_store_tool(tool, sizeof(tool)))
        return;
    const char *cmds[2] = {"info", "verify"};
    for (int i = 0; i < 2; i++) {
        int rc = dt_run_tool(tool, cmds[i], S.dir, NULL, out, sizeof(out));
        if (rc < 0 || rc > 2)
            fail_msg("%s: kvh-store %s ended with %d (a signal is -1): %s", what, cmds[i], rc, out);
    }
}

/* Opens the store (KVH_OK expected) and returns the chain tokens matched;
 * *used gets the disk tier's used blocks right after the open. */
static size_t open_and_match(const char *what, uint64_t *used, uint64_t *corrupt)
{
    kvh_config c = cfg();
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&c, &e);
    if (st != KVH_OK)
        fail_msg("%s: open: %s: %s", what, kvh_status_name(st), kvh_last_error());
    dt_track(e);
    if (used)
        *used = dt_tier(e, KVH_TIER_DISK).used_blocks;
    size_t matched = 0;
    char msg[256] = "";
    st = dt_match_verify(e, G, chain(), NB * G.bt, &matched, msg, sizeof(msg));
    if (st != KVH_OK)
        fail_msg("%s: match: %s (%s)", what, kvh_status_name(st), msg);
    if (corrupt)
        *corrupt = dt_stats(e).corrupt_blocks;
    dt_assert_ok(dt_close(e));
    return matched;
}

static void test_pristine(void **state)
{
    (void)state;
    restore();
    uint64_t used = 0;
    assert_int_equal(open_and_match("pristine", &used, NULL), NB * G.bt);
    assert_int_equal(used, NB);
    tool_survives("pristine");
}

/* Records that must not become blocks; the chain is untouched. */
static void test_forged_records(void **state)
{
    (void)state;
    const char *files[2] = {"index", "journal"};
    for (int fi = 0; fi < 2; fi++) {
        const char *name = files[fi];
        uint64_t seq = get_header("index").seq + 1000; /* newer than anything */
        int32_t other[16];
        for (int i = 0; i < 16; i++)
            other[i] = 7000 + i;
        struct {
            const char *what;
            kvhi_index_rec r;
        } cases[] = {
            {"hash 0", {KVHI_REC_ADD, seq, 40, 0, 0, G.bt, 0, S.tokens}},
            {"slot 2^32-1", {KVHI_REC_ADD, seq, UINT32_MAX, 0x1234, 0, G.bt, 0, other}},
            {"slot 2^40", {KVHI_REC_ADD, seq, 1ull << 40, 0x1234, 0, G.bt, 0, other}},
            {"slot n_slots", {KVHI_REC_ADD, seq, DISK_SLOTS, 0x1234, 0, G.bt, 0, other}},
            {"short block", {KVHI_REC_ADD, seq, 41, 0x1234, 0, G.bt - 1, 0, other}},
            {"duplicate hash", {KVHI_REC_ADD, seq, 42, S.hash_of[1], S.hash_of[0], G.bt, 0, S.tokens + 16}},
            {"DEL of a slot never used", {KVHI_REC_DEL, seq, 43, 0x77, 0, G.bt, 0, other}},
            {"DEL past the store", {KVHI_REC_DEL, seq, UINT64_MAX, S.hash_of[0], 0, G.bt, 0, other}},
        };
        for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
            char what[128];
            snprintf(what, sizeof(what), "%s record in %s", cases[k].what, name);
            restore();
            add_record(name, &cases[k].r);
            uint64_t used = 0;
            assert_int_equal(open_and_match(what, &used, NULL), NB * G.bt);
            if (used != NB)
                fail_msg("%s: %llu blocks on disk after the open, expected %d", what, (unsigned long long)used, NB);
            tool_survives(what);
        }
        /* Token counts decode refuses (CRC valid): damage, rebuilt from the
         * slot headers; the chain is found. */
        const uint32_t counts[] = {G.bt + 1, UINT32_MAX};
        for (size_t k = 0; k < 2; k++) {
            char what[128];
            snprintf(what, sizeof(what), "%u tokens in a record of %s", counts[k], name);
            restore();
            add_raw_record(name, KVHI_REC_ADD, seq, 44, 0x4321, counts[k]);
            assert_int_equal(open_and_match(what, NULL, NULL), NB * G.bt);
            tool_survives(what);
        }
        /* An unknown kind, CRC valid: the same. */
        restore();
        add_raw_record(name, 9, seq, 45, 0x4321, G.bt);
        assert_int_equal(open_and_match("unknown record kind", NULL, NULL), NB * G.bt);
        /* A second record claiming block 1's slot for other tokens: the
         * claim wins (newer), block 1 is a miss, nothing else is served. */
        restore();
        kvhi_index_rec steal = {KVHI_REC_ADD, seq, S.slot_of[1], 0xabcdefull, 0, G.bt, 0, other};
        add_record(name, &steal);
        uint64_t corrupt = 0;
        size_t m = open_and_match("stolen slot", NULL, &corrupt);
        assert_true(m == G.bt || m == NB * G.bt); /* the index's claim, or the slot's word */
        tool_survives("stolen slot");
    }
}

static void test_hostile_header_counts(void **state)
{
    (void)state;
    restore();
    kvhi_index_header h = get_header("index");
    h.n_records = UINT64_MAX;
    put_header("index", &h);
    assert_int_equal(open_and_match("n_records 2^64-1", NULL, NULL), NB * G.bt);
    tool_survives("n_records 2^64-1");
    restore();
    h = get_header("journal");
    h.seq = UINT64_MAX; /* every record older than the journal's start */
    put_header("journal", &h);
    open_and_match("journal seq 2^64-1", NULL, NULL);
    tool_survives("journal seq 2^64-1");
}

/* A geometry other than the engine's: refused (MISMATCH), or a fresh store
 * when asked for; kvh-store refuses or reports, never crashes. */
static void test_hostile_geometry(void **state)
{
    (void)state;
    struct {
        const char *what;
        uint32_t field; /* 0 block_tokens, 1 block_bytes, 2 layers, 3 head_dim */
        uint64_t value;
    } cases[] = {
        {"block_tokens 0", 0, 0},
        {"block_tokens 257", 0, 257},
        {"block_tokens 256", 0, 256},
        {"block size 0", 1, 0},
        {"block size wrapping the slot size", 1, UINT64_MAX - 4095},
        {"block size 2^63", 1, 1ull << 63},
        {"0 layers", 2, 0},
        {"head_dim 2^32-1", 3, UINT32_MAX},
    };
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        restore();
        kvhi_index_header good = get_header("index");
        for (int both = 0; both < 2; both++) {
            const char *name = both ? "journal" : "index";
            kvhi_index_header h = both ? get_header("journal") : good;
            if (cases[k].field == 0)
                h.geo.block_tokens = (uint32_t)cases[k].value;
            else if (cases[k].field == 1)
                h.geo.block_bytes = cases[k].value;
            else if (cases[k].field == 2)
                h.geo.num_layers = (uint32_t)cases[k].value;
            else
                h.geo.head_dim = (uint32_t)cases[k].value;
            put_header(name, &h);
        }
        tool_survives(cases[k].what);
        kvh_config c = cfg();
        kvh_engine *e = NULL;
        kvh_status st = kvh_engine_open(&c, &e);
        if (st == KVH_OK) {
            /* A header that fails its own checks is damage: rebuilt from
             * the slot headers, which carry the true geometry. */
            dt_track(e);
            size_t matched = 0;
            char msg[256] = "";
            dt_assert_ok(dt_match_verify(e, G, chain(), NB * G.bt, &matched, msg, sizeof(msg)));
            dt_assert_ok(dt_close(e));
        } else if (st != KVH_ERR_MISMATCH) {
            fail_msg("%s: open returned %s: %s", cases[k].what, kvh_status_name(st), kvh_last_error());
        }
        c.disk_flags |= KVH_DISK_RESET_ON_MISMATCH;
        e = dt_open_a(&c);
        dt_assert_ok(dt_close(e));
    }
}

/* The geometry's dtype field packs the kvh_dtype (low 16 bits) and the
 * kvh_codec (above): one no engine has is a damaged header, not a store of
 * another geometry that no engine could ever open. */
static void test_unknown_dtype_or_codec(void **state)
{
    (void)state;
    struct {
        const char *what;
        uint32_t dtype; /* as packed in the header */
    } cases[] = {
        {"dtype 7", 7},
        {"dtype 3", KVH_DTYPE_BF16 + 1},
        {"dtype 0xffff", 0xffff},
        {"codec 4", KVH_DTYPE_F16 | (KVH_CODEC_Q4_G64 + 1) << 16},
        {"codec 0xffff", KVH_DTYPE_F16 | 0xffffu << 16},
    };
    char tool[600], out[4096];
    bool have_tool = dt_store_tool(tool, sizeof(tool));
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++)
        for (int both = 0; both < 2; both++) {
            char what[128];
            snprintf(what, sizeof(what), "%s in the index header%s", cases[k].what, both ? " and the journal's" : "");
            restore();
            kvhi_index_header h = get_header("index");
            h.geo.dtype = cases[k].dtype;
            uint8_t page[KVHI_DISK_ALIGN];
            kvhi_index_header_encode(page, &h);
            kvhi_index_header back;
            if (kvhi_index_header_decode(page, sizeof(page), &back) != -1)
                fail_msg("%s: the header decodes", what);
            put_header("index", &h);
            if (both) {
                kvhi_index_header j = get_header("journal");
                j.geo.dtype = cases[k].dtype;
                put_header("journal", &j);
            }
            /* kvh-store takes the geometry from the journal's header when
             * the index's is damaged (verify: exit 1, the damage named),
             * and stops (exit 2) when neither reads. */
            if (have_tool) {
                const char *cmds[2] = {"info", "verify"};
                for (int i = 0; i < 2; i++) {
                    int rc = dt_run_tool(tool, cmds[i], S.dir, NULL, out, sizeof(out));
                    int want = both ? 2 : i;
                    const char *says = both ? "no readable index or journal header"
                                       : i  ? "the index header is damaged"
                                            : "bad records   1";
                    if (rc != want || !strstr(out, says))
                        fail_msg("%s: kvh-store %s ended with %d, expected %d (\"%s\"): %s", what, cmds[i], rc, want,
                                 says, out);
                }
            }
            kvh_config c = cfg();
            c.disk_strict_index = 1;
            kvh_engine *e = NULL;
            kvh_status st = kvh_engine_open(&c, &e);
            if (st != KVH_ERR_CORRUPT || !strstr(kvh_last_error(), "header is damaged")) {
                dt_track(e);
                fail_msg("%s: strict open returned %s (%s), expected KVH_ERR_CORRUPT for a damaged header", what,
                         kvh_status_name(st), kvh_last_error());
            }
            /* Without disk_strict_index: rebuilt from the slot headers,
             * which carry the true geometry; the chain is all there. */
            uint64_t used = 0;
            if (open_and_match(what, &used, NULL) != NB * G.bt || used != NB)
                fail_msg("%s: the rebuilt store lost blocks (%llu on disk)", what, (unsigned long long)used);
            /* The rebuild rewrote the header: the store is whole again. */
            assert_int_equal(get_header("index").geo.dtype, G.dtype);
        }
}

/* Slot headers with valid CRCs but another slot's place, a block size or
 * a token count out of range: that block is a miss, with or without an
 * index to name it. */
static void test_forged_slot_headers(void **state)
{
    (void)state;
    struct {
        const char *what;
        uint32_t at;
        int bytes;
        uint64_t value;
    } cases[] = {
        {"n_tokens 1000", 12, 4, 1000},
        {"n_tokens 2^32-1", 12, 4, UINT32_MAX},
        {"n_tokens 17", 12, 4, 17},
        {"slot of block 0", 24, 8, 0},
        {"slot 2^63", 24, 8, 1ull << 63},
        {"offset 2^62", 32, 8, 1ull << 62},
        {"block size 2^40", 56, 8, 1ull << 40},
        {"block size 0", 56, 8, 0},
    };
    for (int no_index = 0; no_index < 2; no_index++)
        for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
            char what[128];
            snprintf(what, sizeof(what), "slot header %s%s", cases[k].what, no_index ? " (no index)" : "");
            restore();
            uint64_t victim = S.slot_of[2];
            if (cases[k].at == 24 && cases[k].value == 0 && S.slot_of[0] == victim)
                continue;
            forge_slot(victim, cases[k].at, cases[k].value, cases[k].bytes);
            if (no_index) {
                unlink(file("index"));
                unlink(file("journal"));
            }
            uint64_t corrupt = 0;
            size_t m = open_and_match(what, NULL, &corrupt);
            if (m != 2 * G.bt)
                fail_msg("%s: matched %zu tokens, expected %u (the chain up to the forged block)", what, m, 2 * G.bt);
            tool_survives(what);
        }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pristine),
        cmocka_unit_test(test_forged_records),
        cmocka_unit_test(test_hostile_header_counts),
        cmocka_unit_test(test_hostile_geometry),
        cmocka_unit_test(test_unknown_dtype_or_codec),
        cmocka_unit_test(test_forged_slot_headers),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
