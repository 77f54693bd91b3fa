#include "core/disk_format.h"

#include <string.h>

#include "core/config_names.h"
#include "core/crc32c.h"

static const char slot_magic[8] = {'K', 'V', 'H', 'B', 'L', 'K', 0, 1};
static const char index_magic[8] = {'K', 'V', 'H', 'I', 'D', 'X', 0, 1};
#define REC_MAGIC 0x524a564bu /* "KVJR" */

/* Little-endian field writers: the format does not depend on the host. */
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
static uint32_t get32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 0; i < 4; i++)
        v |= (uint32_t)p[i] << (8 * i);
    return v;
}
static uint64_t get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* Slot header layout (offsets): 0 magic, 8 version, 12 n_tokens,
 * 16 store_id, 24 slot, 32 offset, 40 hash, 48 parent, 56 block_bytes,
 * 64 data_crc, 68 tokens[n], 4084 flags, 4088 geometry tag, 4092 header
 * crc over [0, 4092). Flags and tag were padding before they existed, so
 * older headers verify as they did and read as 0 there. */
#define SH_TOKENS 68u
#define SH_FLAGS (KVHI_SLOT_HEADER_BYTES - 12u)
#define SH_GEO (KVHI_SLOT_HEADER_BYTES - 8u)
#define SH_CRC (KVHI_SLOT_HEADER_BYTES - 4u)

uint32_t kvhi_disk_geometry_tag(const kvhi_disk_geometry *g)
{
    uint8_t b[36];
    put32(b, g->num_layers);
    put32(b + 4, g->num_kv_heads);
    put32(b + 8, g->head_dim);
    put32(b + 12, g->block_tokens);
    put32(b + 16, g->dtype);
    put64(b + 20, g->model_salt);
    put64(b + 28, g->block_bytes);
    uint32_t tag = kvhi_crc32c(0, b, sizeof(b));
    return tag ? tag : 1; /* 0 means "no tag" */
}

void kvhi_slot_header_encode(void *buf, const kvhi_slot_meta *m, uint64_t block_bytes)
{
    uint8_t *p = buf;
    memset(p, 0, KVHI_SLOT_HEADER_BYTES);
    memcpy(p, slot_magic, 8);
    put32(p + 8, KVHI_DISK_VERSION);
    put32(p + 12, m->n_tokens);
    put64(p + 16, m->store_id);
    put64(p + 24, m->slot);
    put64(p + 32, m->offset);
    put64(p + 40, m->hash);
    put64(p + 48, m->parent);
    put64(p + 56, block_bytes);
    put32(p + 64, m->data_crc);
    for (uint32_t i = 0; i < m->n_tokens; i++)
        put32(p + SH_TOKENS + 4 * i, (uint32_t)m->tokens[i]);
    put32(p + SH_FLAGS, m->flags);
    put32(p + SH_GEO, m->geo_tag);
    put32(p + SH_CRC, kvhi_crc32c(0, p, SH_CRC));
}

/* The checks of a slot header; store_id and expect_hash are skipped when
 * NULL (a slot checked on its own). The data's CRC32C is data_crc, or
 * computed from data when that is set, once the header has passed. */
static int check_slot(const uint8_t *p, const void *data, uint32_t data_crc, uint64_t block_bytes,
                      const uint64_t *store_id, uint32_t geo_tag, uint64_t slot, uint64_t offset,
                      const uint64_t *expect_hash, uint32_t max_tokens, int32_t *tokens_out, const char **why)
{
#define FAIL(code, text)                                                                                               \
    do {                                                                                                               \
        if (why)                                                                                                       \
            *why = text;                                                                                               \
        return code;                                                                                                   \
    } while (0)
    if (memcmp(p, slot_magic, 8) != 0)
        FAIL(-1, "bad slot magic (never written, torn or overwritten)");
    if (get32(p + SH_CRC) != kvhi_crc32c(0, p, SH_CRC))
        FAIL(-2, "slot header checksum mismatch");
    if (get32(p + 8) != KVHI_DISK_VERSION)
        FAIL(-3, "unknown slot format version");
    if (store_id && get64(p + 16) != *store_id)
        FAIL(-4, "block belongs to another store");
    if (get64(p + 24) != slot || get64(p + 32) != offset)
        FAIL(-5, "block is misplaced (slot or offset differ)");
    if (expect_hash && get64(p + 40) != *expect_hash)
        FAIL(-6, "block holds a different prefix hash");
    if (get64(p + 56) != block_bytes)
        FAIL(-7, "block size differs");
    /* Headers older than the tag carry 0 there. */
    if (geo_tag && get32(p + SH_GEO) && get32(p + SH_GEO) != geo_tag)
        FAIL(-10, "block was written with another geometry or model_salt");
    uint32_t n = get32(p + 12);
    if (n > max_tokens || SH_TOKENS + 4ull * n > SH_FLAGS)
        FAIL(-8, "token count out of range");
    if (data)
        data_crc = kvhi_crc32c(0, data, block_bytes);
    if (data_crc != get32(p + 64))
        FAIL(-9, "block data checksum mismatch");
    if (tokens_out)
        for (uint32_t i = 0; i < n; i++)
            tokens_out[i] = (int32_t)get32(p + SH_TOKENS + 4 * i);
#undef FAIL
    return 0;
}

int kvhi_slot_verify_crc(const void *header, uint32_t data_crc, uint64_t block_bytes, uint64_t store_id,
                         uint32_t geo_tag, uint64_t slot, uint64_t offset, uint64_t expect_hash, uint32_t max_tokens,
                         int32_t *tokens_out, const char **why)
{
    return check_slot(header, NULL, data_crc, block_bytes, &store_id, geo_tag, slot, offset, &expect_hash, max_tokens,
                      tokens_out, why);
}

int kvhi_slot_verify(const void *header, const void *data, uint64_t block_bytes, uint64_t store_id, uint32_t geo_tag,
                     uint64_t slot, uint64_t offset, uint64_t expect_hash, uint32_t max_tokens, int32_t *tokens_out,
                     const char **why)
{
    return kvhi_slot_verify_crc(header, kvhi_crc32c(0, data, block_bytes), block_bytes, store_id, geo_tag, slot, offset,
                                expect_hash, max_tokens, tokens_out, why);
}

static int check_alone(const uint8_t *p, const void *data, uint32_t data_crc, uint64_t block_bytes, uint64_t slot,
                       uint64_t offset, uint32_t max_tokens, kvhi_slot_meta *m, int32_t *tokens_out, const char **why)
{
    int rc = check_slot(p, data, data_crc, block_bytes, NULL, 0, slot, offset, NULL, max_tokens, tokens_out, why);
    if (rc != 0)
        return rc;
    *m = (kvhi_slot_meta){.store_id = get64(p + 16),
                          .slot = slot,
                          .offset = offset,
                          .hash = get64(p + 40),
                          .parent = get64(p + 48),
                          .n_tokens = get32(p + 12),
                          .data_crc = get32(p + 64),
                          .flags = get32(p + SH_FLAGS),
                          .geo_tag = get32(p + SH_GEO)};
    return 0;
}

int kvhi_slot_check_alone(const void *header, const void *data, uint64_t block_bytes, uint64_t slot, uint64_t offset,
                          uint32_t max_tokens, kvhi_slot_meta *m, int32_t *tokens_out, const char **why)
{
    return check_alone(header, data, 0, block_bytes, slot, offset, max_tokens, m, tokens_out, why);
}

int kvhi_slot_check_alone_crc(const void *header, uint32_t data_crc, uint64_t block_bytes, uint64_t slot,
                              uint64_t offset, uint32_t max_tokens, kvhi_slot_meta *m, int32_t *tokens_out,
                              const char **why)
{
    return check_alone(header, NULL, data_crc, block_bytes, slot, offset, max_tokens, m, tokens_out, why);
}

/* Record layout: 0 magic, 4 kind, 8 seq, 16 slot, 24 hash, 32 parent,
 * 40 n_tokens, 44 data_crc, 48 tokens[block_tokens], then crc. */
size_t kvhi_index_rec_bytes(uint32_t block_tokens) { return 48u + 4u * block_tokens + 4u; }

void kvhi_index_rec_encode(void *buf, const kvhi_index_rec *r, uint32_t bt)
{
    uint8_t *p = buf;
    size_t n = kvhi_index_rec_bytes(bt);
    memset(p, 0, n);
    put32(p, REC_MAGIC);
    put32(p + 4, r->kind);
    put64(p + 8, r->seq);
    put64(p + 16, r->slot);
    put64(p + 24, r->hash);
    put64(p + 32, r->parent);
    put32(p + 40, r->n_tokens);
    put32(p + 44, r->data_crc);
    for (uint32_t i = 0; i < bt && r->tokens && i < r->n_tokens; i++)
        put32(p + 48 + 4 * i, (uint32_t)r->tokens[i]);
    put32(p + n - 4, kvhi_crc32c(0, p, n - 4));
}

int kvhi_index_rec_decode(const void *buf, kvhi_index_rec *r, uint32_t bt)
{
    const uint8_t *p = buf;
    size_t n = kvhi_index_rec_bytes(bt);
    if (get32(p) != REC_MAGIC || get32(p + n - 4) != kvhi_crc32c(0, p, n - 4))
        return -1;
    r->kind = get32(p + 4);
    r->seq = get64(p + 8);
    r->slot = get64(p + 16);
    r->hash = get64(p + 24);
    r->parent = get64(p + 32);
    r->n_tokens = get32(p + 40);
    r->data_crc = get32(p + 44);
    if ((r->kind != KVHI_REC_ADD && r->kind != KVHI_REC_DEL) || r->n_tokens > bt)
        return -1;
    for (uint32_t i = 0; i < bt; i++)
        r->tokens[i] = (int32_t)get32(p + 48 + 4 * i);
    return 0;
}

/* Index header: 0 magic, 8 version, 12 kind, 16 store_id, 24 seq,
 * 32 n_records, 40 layers, 44 heads, 48 head_dim, 52 block_tokens,
 * 56 dtype, 60 pad, 64 model_salt, 72 block_bytes, 80 crc over [0, 80). */
void kvhi_index_header_encode(void *buf, const kvhi_index_header *h)
{
    uint8_t *p = buf;
    memset(p, 0, KVHI_DISK_ALIGN);
    memcpy(p, index_magic, 8);
    put32(p + 8, KVHI_DISK_VERSION);
    put32(p + 12, h->kind);
    put64(p + 16, h->store_id);
    put64(p + 24, h->seq);
    put64(p + 32, h->n_records);
    put32(p + 40, h->geo.num_layers);
    put32(p + 44, h->geo.num_kv_heads);
    put32(p + 48, h->geo.head_dim);
    put32(p + 52, h->geo.block_tokens);
    put32(p + 56, h->geo.dtype);
    put64(p + 64, h->geo.model_salt);
    put64(p + 72, h->geo.block_bytes);
    put32(p + 80, kvhi_crc32c(0, p, 80));
}

bool kvhi_index_magic_is_kvh(const void *first8) { return memcmp(first8, index_magic, 8) == 0; }

int kvhi_index_header_decode(const void *buf, size_t len, kvhi_index_header *h)
{
    const uint8_t *p = buf;
    if (len < 84 || memcmp(p, index_magic, 8) != 0 || get32(p + 80) != kvhi_crc32c(0, p, 80))
        return -1;
    if (get32(p + 8) != KVHI_DISK_VERSION)
        return -2;
    h->kind = get32(p + 12);
    h->store_id = get64(p + 16);
    h->seq = get64(p + 24);
    h->n_records = get64(p + 32);
    h->geo.num_layers = get32(p + 40);
    h->geo.num_kv_heads = get32(p + 44);
    h->geo.head_dim = get32(p + 48);
    h->geo.block_tokens = get32(p + 52);
    h->geo.dtype = get32(p + 56);
    h->geo.model_salt = get64(p + 64);
    h->geo.block_bytes = get64(p + 72);
    /* A header with valid CRCs can still be forged: a geometry no engine
     * writes is damage, so that no reader sizes anything from it (a block
     * size near 2^64 would wrap the slot size to 0). */
    if (h->geo.block_tokens == 0 || h->geo.block_tokens > 256 || h->geo.num_layers == 0 || h->geo.num_kv_heads == 0 ||
        h->geo.head_dim == 0 || h->geo.block_bytes == 0 || h->geo.block_bytes > KVHI_DISK_MAX_BLOCK_BYTES)
        return -1;
    /* So is a dtype or KV codec no engine has: no engine could ever open
     * such a store, nor a tool name its type. */
    if (!kvhi_disk_dtype_name(h->geo.dtype) || !kvhi_disk_codec_name(h->geo.dtype))
        return -1;
    return 0;
}

const char *kvhi_disk_dtype_name(uint32_t packed) { return kvhi_dtype_name(packed & 0xffffu); }

const char *kvhi_disk_codec_name(uint32_t packed) { return kvhi_codec_name(packed >> 16); }
