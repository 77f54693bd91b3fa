/* Fuzz target: the metadata of a store -- the snapshot `index` and the
 * `journal` (headers and records) -- through the pure decoders and through
 * a real engine open (kvhi_index_load + recovery).
 *
 * Input: flags (u8), the index part's length (u16), the index part, the
 * journal part (the rest). A part is written as a file of the on-disk
 * layout: its first 84 bytes are the header (zero-padded to the 4096-byte
 * header page), the rest are records (68 bytes each for this geometry:
 * 1 layer, 1 head, head_dim 8, 4 tokens a block, f16; 8 disk slots).
 *   flags bit 0: write the right header CRCs   bit 1: ... and record CRCs
 *         bit 2: no journal file               bit 3: open with
 *                                                     KVH_DISK_RESET_ON_MISMATCH
 *         bit 4: a store geometry header (the fuzzer starts from a valid
 *                snapshot header for this engine, then mutates it)
 * Properties, beyond memory safety and documented status codes:
 *   - the decoders never accept a record / header whose CRC is wrong;
 *   - when the engine opens the store, what it recovers is usable (lookup,
 *     match, stats, counters add up) and closing it writes a store that
 *     opens again with no more recovered blocks than before.
 */
#include "fuzz_common.h"

#include "core/crc32c.h"
#include "core/disk_format.h"

enum { BT = 4, SLOTS = 8 };
#define HDR_USED 84u

static kvh_config cfg_for(const char *dir, uint32_t flags)
{
    kvh_config c;
    kvh_config_init(&c, sizeof(c));
    c.num_layers = 1;
    c.num_kv_heads = 1;
    c.head_dim = 8;
    c.block_tokens = BT;
    c.dtype = KVH_DTYPE_F16;
    c.backend = KVH_BACKEND_CPU;
    c.device_bytes = 4 * 128;
    c.host_bytes = 4 * 128;
    c.disk_bytes = SLOTS * 8192;
    c.disk_path = dir;
    c.model_salt = 0xf00d;
    c.migration_threads = 0;
    c.disk_flags = flags;
    return c;
}

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

/* Builds the file of one part: header page + records. */
static uint8_t *make_file(const uint8_t *part, size_t len, uint8_t flags, uint32_t kind, size_t *out_len)
{
    size_t rec = kvhi_index_rec_bytes(BT);
    size_t hdr = len < HDR_USED ? len : HDR_USED, body = len - hdr;
    size_t flen = len < HDR_USED ? len : KVHI_DISK_ALIGN + body;
    uint8_t *f = calloc(1, flen ? flen : 1);
    if (!f)
        return NULL;
    memcpy(f, part, hdr);
    if (len >= HDR_USED) {
        if (flags & 16) {
            /* this engine's geometry, the part's kind, store id, seqs */
            memcpy(f, "KVHIDX\0\1", 8);
            put32(f + 8, 1);
            put32(f + 12, kind);
            put32(f + 40, 1), put32(f + 44, 1), put32(f + 48, 8), put32(f + 52, BT), put32(f + 56, KVH_DTYPE_F16);
            put64(f + 64, 0xf00d), put64(f + 72, 2ull * 8 * BT * 2);
        }
        memcpy(f + KVHI_DISK_ALIGN, part + hdr, body);
        if (flags & 1)
            put32(f + 80, kvhi_crc32c(0, f, 80));
        if (flags & 2)
            for (size_t off = KVHI_DISK_ALIGN; off + rec <= flen; off += rec)
                put32(f + off + rec - 4, kvhi_crc32c(0, f + off, rec - 4));
    }
    *out_len = flen;
    return f;
}

/* The pure decoders on one file image. */
static void decode_all(const uint8_t *f, size_t len)
{
    kvhi_index_header h;
    int rc = kvhi_index_header_decode(f, len, &h);
    if (rc == 0) {
        FZ_CHECK(len >= HDR_USED, "a %zu-byte header decoded", len);
        uint32_t crc = (uint32_t)f[80] | (uint32_t)f[81] << 8 | (uint32_t)f[82] << 16 | (uint32_t)f[83] << 24;
        FZ_CHECK(crc == kvhi_crc32c(0, f, 80), "a header with a bad CRC decoded");
        FZ_CHECK(h.geo.block_tokens >= 1 && h.geo.block_tokens <= 256, "block_tokens %u accepted", h.geo.block_tokens);
        /* A forged header (valid CRC) must not name a geometry that sizes
         * anything wrongly: no zero dimension, no block size that wraps. */
        FZ_CHECK(h.geo.num_layers && h.geo.num_kv_heads && h.geo.head_dim, "a zero dimension accepted");
        FZ_CHECK(h.geo.block_bytes >= 1 && h.geo.block_bytes <= KVHI_DISK_MAX_BLOCK_BYTES, "block size %llu accepted",
                 (unsigned long long)h.geo.block_bytes);
        FZ_CHECK(KVHI_SLOT_HEADER_BYTES + kvhi_round_up(h.geo.block_bytes, KVHI_DISK_ALIGN) > h.geo.block_bytes,
                 "slot size wraps");
    }
    size_t rec = kvhi_index_rec_bytes(BT);
    int32_t tk[BT];
    for (size_t off = KVHI_DISK_ALIGN; off + rec <= len; off += rec) {
        kvhi_index_rec r = {.tokens = tk};
        if (kvhi_index_rec_decode(f + off, &r, BT) == 0) {
            uint32_t crc = (uint32_t)f[off + rec - 4] | (uint32_t)f[off + rec - 3] << 8 |
                           (uint32_t)f[off + rec - 2] << 16 | (uint32_t)f[off + rec - 1] << 24;
            FZ_CHECK(crc == kvhi_crc32c(0, f + off, rec - 4), "a record with a bad CRC decoded");
            FZ_CHECK(r.kind == KVHI_REC_ADD || r.kind == KVHI_REC_DEL, "record kind %u accepted", r.kind);
            FZ_CHECK(r.n_tokens <= BT, "record with %u tokens accepted", r.n_tokens);
            /* encode what was decoded: the same bytes come back */
            uint8_t again[48 + 4 * BT + 4];
            kvhi_index_rec_encode(again, &r, BT);
            kvhi_index_rec r2 = {.tokens = tk};
            FZ_CHECK(kvhi_index_rec_decode(again, &r2, BT) == 0 && r2.slot == r.slot && r2.hash == r.hash &&
                         r2.seq == r.seq && r2.kind == r.kind,
                     "a decoded record does not round-trip");
        }
    }
}

/* Uses whatever the engine recovered; returns the number of cached blocks. */
static uint64_t use_engine(kvh_engine *e, const uint8_t *jf, size_t jlen)
{
    kvh_stats s = {.struct_size = sizeof(s)};
    FZ_CHECK(kvh_engine_stats(e, &s) == KVH_OK, "stats");
    /* look up and match the token runs named by the journal's records */
    size_t rec = kvhi_index_rec_bytes(BT);
    int32_t tk[BT];
    for (size_t off = KVHI_DISK_ALIGN, k = 0; jf && off + rec <= jlen && k < 16; off += rec, k++) {
        kvhi_index_rec r = {.tokens = tk};
        if (kvhi_index_rec_decode(jf + off, &r, BT) != 0)
            continue;
        kvh_block out[1];
        size_t nb = 0;
        kvh_status st = kvh_prefix_lookup(e, tk, BT, out, 1, &nb);
        FZ_KNOWN(st);
        if (st == KVH_OK && nb)
            FZ_CHECK(kvh_block_release(e, out[0]) == KVH_OK, "release of a looked-up block");
        kvh_seq q;
        if (kvh_seq_create(e, 0, &q) == KVH_OK) {
            size_t m = 0;
            st = kvh_seq_match_prefix(e, q, tk, BT, &m);
            FZ_KNOWN(st);
            if (st == KVH_OK && m) {
                /* the data (zeros on this fuzzed store) must not verify */
                uint8_t kbuf[BT * 16], vbuf[BT * 16];
                st = kvh_seq_read_kv(e, q, 0, 0, m, kbuf, vbuf);
                FZ_KNOWN(st);
            }
            kvh_seq_free(e, q);
        }
    }
    s.struct_size = sizeof(s);
    kvh_engine_stats(e, &s);
    kvh_tier_info t = {.struct_size = sizeof(t)};
    kvh_tier_info_get(e, KVH_TIER_DISK, &t);
    FZ_CHECK(t.used_blocks <= SLOTS && t.used_bytes == t.used_blocks * t.block_bytes, "disk tier occupancy");
    FZ_CHECK(s.blocks_allocated >= s.blocks_freed, "blocks freed > allocated");
    return s.blocks_allocated - s.blocks_freed;
}

/* The libFuzzer entry point (no header declares it). */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz_in in = {data, size, 0};
    uint8_t flags = fz_u8(&in);
    size_t ilen = fz_u16(&in);
    if (ilen > fz_left(&in))
        ilen = fz_left(&in);
    const uint8_t *ipart = data + in.at, *jpart = ipart + ilen;
    size_t jlen = fz_left(&in) - ilen;
    size_t flen = 0, jflen = 0;
    uint8_t *ifile = make_file(ipart, ilen, flags, 1, &flen);
    uint8_t *jfile = make_file(jpart, jlen, flags, 2, &jflen);
    if (!ifile || !jfile) {
        free(ifile), free(jfile);
        return 0;
    }
    decode_all(ifile, flen);
    decode_all(jfile, jflen);

    const char *dir = fz_dir("index");
    fz_clear(dir);
    fz_write(dir, "index", ifile, flen);
    if (!(flags & 4))
        fz_write(dir, "journal", jfile, jflen);
    kvh_config c = cfg_for(dir, (flags & 8) ? KVH_DISK_RESET_ON_MISMATCH | KVH_DISK_BUFFERED : KVH_DISK_BUFFERED);
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&c, &e);
    FZ_KNOWN(st);
    if (st == KVH_OK) {
        uint64_t live = use_engine(e, jfile, jflen);
        st = kvh_engine_close(e);
        FZ_KNOWN(st);
        if (st == KVH_OK) {
            /* what close wrote must open again, with no more blocks */
            c.disk_flags = KVH_DISK_BUFFERED;
            e = NULL;
            st = kvh_engine_open(&c, &e);
            FZ_CHECK(st == KVH_OK, "the store a clean close wrote does not reopen: %s: %s", kvh_status_name(st),
                     kvh_last_error());
            uint64_t again = use_engine(e, NULL, 0);
            FZ_CHECK(again <= live, "reopen recovered %llu blocks, the first engine had %llu",
                     (unsigned long long)again, (unsigned long long)live);
            FZ_CHECK(kvh_engine_close(e) == KVH_OK, "second close: %s", kvh_last_error());
        }
    }
    free(ifile);
    free(jfile);
    return 0;
}
