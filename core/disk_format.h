/* On-disk formats of the disk tier. Pure encode/verify functions: no I/O,
 * so they can be tested and fuzzed on byte buffers.
 *
 * Slot: [4096-byte header][block data, padded to 4096]. The header's CRC32C
 * covers the store id, the slot number and its file offset, the block's
 * prefix hash, parent hash, tokens and the CRC32C of the data, so torn,
 * flipped, truncated, misplaced (swapped) or foreign blocks all fail. It
 * also says whether the block was published and which geometry wrote it,
 * so a slot can be taken back from its header alone when the index that
 * named it is damaged.
 *
 * Index: a snapshot file `index` (replaced atomically: temp, fsync, rename,
 * fsync dir) plus an append-only `journal` of fixed-size records, each
 * with its own CRC; replay stops at the first bad record (a torn tail). */
#ifndef KVH_CORE_DISK_FORMAT_H
#define KVH_CORE_DISK_FORMAT_H

#include <stddef.h>
#include <stdbool.h>
#include <stdint.h>

#define KVHI_DISK_ALIGN 4096u
#define KVHI_SLOT_HEADER_BYTES 4096u
#define KVHI_DISK_VERSION 1u
/* The largest block an index header may name (1 TiB, far above any
 * engine's): a slot's size then never wraps. */
#define KVHI_DISK_MAX_BLOCK_BYTES (1ull << 40)

/* Geometry and identity that a store must match to be reused. */
typedef struct kvhi_disk_geometry {
    uint32_t num_layers, num_kv_heads, head_dim, block_tokens, dtype;
    uint64_t model_salt;
    uint64_t block_bytes;
} kvhi_disk_geometry;

/* Slot header flags. */
enum {
    /* The block was published when written: full, every KV cell written,
     * immutable from then on. Only such a slot is taken back from its
     * header alone; an unpublished one may hold KV that was never finished. */
    KVHI_SLOT_PUBLISHED = 1u
};

/* What a slot header says about its block. */
typedef struct kvhi_slot_meta {
    uint64_t store_id;
    uint64_t slot;
    uint64_t offset;
    uint64_t hash;   /* 0 for a block without a prefix hash */
    uint64_t parent; /* parent prefix hash */
    uint32_t n_tokens;
    uint32_t data_crc;
    uint32_t flags;        /* KVHI_SLOT_*; 0 in headers written before flags existed */
    uint32_t geo_tag;      /* kvhi_disk_geometry_tag of the writer; 0 in such older headers */
    const int32_t *tokens; /* n_tokens entries (encode only) */
} kvhi_slot_meta;

/* A non-zero 32-bit digest of a geometry, kept in every slot header so a
 * rebuild without a readable index header still refuses blocks of another
 * model, layout or codec that happen to have the same size. */
uint32_t kvhi_disk_geometry_tag(const kvhi_disk_geometry *g);

static inline uint64_t kvhi_round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

/* Writes a header into buf (KVHI_SLOT_HEADER_BYTES, zero-filled first). */
void kvhi_slot_header_encode(void *buf, const kvhi_slot_meta *m, uint64_t block_bytes);

/* Checks a header read from `slot` at `offset` of store `store_id` against
 * what the index expects (hash) and the data that followed it; geo_tag
 * (kvhi_disk_geometry_tag of the store's geometry; 0: not checked) must
 * be the header's, where it carries one. Returns 0 when everything
 * matches, or a negative reason code (see .c) and a short reason text.
 * tokens_out (block_tokens entries) receives the tokens. */
int kvhi_slot_verify(const void *header, const void *data, uint64_t block_bytes, uint64_t store_id, uint32_t geo_tag,
                     uint64_t slot, uint64_t offset, uint64_t expect_hash, uint32_t max_tokens, int32_t *tokens_out,
                     const char **why);

/* The same, with the CRC32C of the data already computed (e.g. while it
 * was copied out of the staging buffer). */
int kvhi_slot_verify_crc(const void *header, uint32_t data_crc, uint64_t block_bytes, uint64_t store_id,
                         uint32_t geo_tag, uint64_t slot, uint64_t offset, uint64_t expect_hash, uint32_t max_tokens,
                         int32_t *tokens_out, const char **why);

/* Checks a slot on its own, with no index entry to compare against: what
 * kvhi_slot_verify checks except the store id and the hash, which it
 * returns in *m instead (with the other fields; m->tokens is not set, the
 * tokens go to tokens_out). The data's checksum is computed only for a
 * header that passes. 0 or the same reason codes. */
int kvhi_slot_check_alone(const void *header, const void *data, uint64_t block_bytes, uint64_t slot, uint64_t offset,
                          uint32_t max_tokens, kvhi_slot_meta *m, int32_t *tokens_out, const char **why);
/* The same, with the CRC32C of the data already computed. */
int kvhi_slot_check_alone_crc(const void *header, uint32_t data_crc, uint64_t block_bytes, uint64_t slot,
                              uint64_t offset, uint32_t max_tokens, kvhi_slot_meta *m, int32_t *tokens_out,
                              const char **why);

/* ---- index records ---- */
enum { KVHI_REC_ADD = 1, KVHI_REC_DEL = 2 };

typedef struct kvhi_index_rec {
    uint32_t kind;
    uint64_t seq;
    uint64_t slot;
    uint64_t hash;
    uint64_t parent;
    uint32_t n_tokens;
    uint32_t data_crc;
    int32_t *tokens; /* block_tokens entries */
} kvhi_index_rec;

/* Fixed size of one record for a store with block_tokens tokens a block. */
size_t kvhi_index_rec_bytes(uint32_t block_tokens);
void kvhi_index_rec_encode(void *buf, const kvhi_index_rec *r, uint32_t block_tokens);
/* 0 when the record's magic and CRC are good; rec->tokens must point at
 * block_tokens entries. */
int kvhi_index_rec_decode(const void *buf, kvhi_index_rec *r, uint32_t block_tokens);

/* Snapshot / journal file header (one 4096-byte page). */
typedef struct kvhi_index_header {
    uint32_t kind; /* 1 = snapshot, 2 = journal */
    uint64_t store_id;
    uint64_t seq; /* snapshot: last record seq it includes; journal: first seq */
    uint64_t n_records;
    kvhi_disk_geometry geo;
} kvhi_index_header;

void kvhi_index_header_encode(void *buf, const kvhi_index_header *h);
/* 0, -2 for another version, -1 for a bad magic or CRC or a geometry no
 * engine writes (block_tokens outside 1..256, a zero dimension, a block
 * size of 0 or above KVHI_DISK_MAX_BLOCK_BYTES, an unknown kvh_dtype or
 * kvh_codec in geo.dtype). */
int kvhi_index_header_decode(const void *buf, size_t len, kvhi_index_header *h);
/* Names of the kvh_dtype (low 16 bits) and kvh_codec (the bits above) that
 * a geometry's dtype field packs (core/disk_tier.c); NULL for one no engine
 * has, which kvhi_index_header_decode refuses. */
const char *kvhi_disk_dtype_name(uint32_t packed);
const char *kvhi_disk_codec_name(uint32_t packed);
/* Whether the first 8 bytes of an index or journal file are kvh's magic
 * (a damaged header may still be kvh's; another program's file is not). */
bool kvhi_index_magic_is_kvh(const void *first8);

#endif
