/* The remote tier's keys and values (core/remote_format.c). Pure encode
 * and verify functions on byte buffers, so they can be tested and fuzzed.
 *
 * Key: kvh:v2:<model salt, 16 hex>-<geometry tag, 8 hex>:<prefix hash, 16
 * hex>-<second chain, 16 hex>, one per full block. The prefix hash is the
 * scope-aware chained hash (core/scope.c), so tenant scopes stay apart in
 * the store too; the second chain runs over the same parent and tokens,
 * so blocks of equal hash and different prefixes have different keys.
 *
 * Value: the disk tier's slot header (core/disk_format.h: magic, version,
 * geometry tag, hash, parent hash, tokens, data CRC32C, header CRC) with
 * slot and offset 0 and the store id set to the geometry id, then the
 * block's data in the disk form (encoded by the kv_codec when one is set).
 * A value is trusted only when every field agrees with what the reader
 * asked for. */
#ifndef KVH_CORE_REMOTE_FORMAT_H
#define KVH_CORE_REMOTE_FORMAT_H

#include <stddef.h>
#include <stdint.h>

#include "core/disk_format.h"

/* "kvh:v2:" + 16 + "-" + 8 + ":" + 16 + "-" + 16, and a NUL. */
#define KVHI_REMOTE_KEY_BYTES 67u
#define KVHI_REMOTE_KEY_LEN 66u
/* The key prefix naming one model and geometry ("kvh:v2:<salt>-<tag>:"). */
#define KVHI_REMOTE_MODEL_PREFIX_LEN 33u

/* Identity a value must match to be used. */
typedef struct kvhi_remote_id {
    uint64_t model_salt;
    uint32_t geo_tag;     /* kvhi_disk_geometry_tag of the reader */
    uint64_t block_bytes; /* data bytes after the header (disk form) */
    uint32_t block_tokens;
} kvhi_remote_id;

/* Writes the key of the full block with prefix hash `hash`, parent hash
 * `parent` and tokens (id->block_tokens) into key (KVHI_REMOTE_KEY_BYTES):
 * the hash, then a second 64-bit chain over the same parent and tokens
 * from another start. Blocks of equal hash and different prefixes (a
 * collision, or tokens chosen to forge one) get different keys, so the
 * store keeps them side by side: a forger would have to match both
 * chains at once. */
void kvhi_remote_key(char *key, const kvhi_remote_id *id, uint64_t hash, uint64_t parent, const int32_t *tokens);
/* Writes the key prefix of id's model into out (KVHI_REMOTE_MODEL_PREFIX_LEN
 * + 1 bytes). */
void kvhi_remote_model_prefix(char *out, const kvhi_remote_id *id);

/* Bytes of a value for id: the header and the data. */
static inline uint64_t kvhi_remote_value_bytes(const kvhi_remote_id *id)
{
    return KVHI_SLOT_HEADER_BYTES + id->block_bytes;
}

/* Writes the header of a value into buf (KVHI_SLOT_HEADER_BYTES) for data
 * (block_bytes) already placed behind it. */
void kvhi_remote_value_encode(void *buf, const kvhi_remote_id *id, uint64_t hash, uint64_t parent,
                              const int32_t *tokens, const void *data);
/* The same with the data's CRC32C already computed (taken while it was
 * copied into place). */
void kvhi_remote_value_encode_crc(void *buf, const kvhi_remote_id *id, uint64_t hash, uint64_t parent,
                                  const int32_t *tokens, uint32_t data_crc);

/* What a reader expects of a value. */
typedef struct kvhi_remote_expect {
    uint64_t hash;
    uint64_t parent;
    const int32_t *tokens; /* block_tokens entries */
} kvhi_remote_expect;

/* Checks a value read from the store: length, magic, both CRCs, version,
 * geometry (tag, block size, model), hash, parent, token count and
 * tokens. 0 when all agree, else a negative reason code and a short text
 * in *why. Reads nothing outside [val, val + len). */
int kvhi_remote_value_check(const void *val, size_t len, const kvhi_remote_id *id, const kvhi_remote_expect *ex,
                            const char **why);

/* The same checks, copying the value's data (block_bytes) to dst in the
 * pass that checksums it. dst is written even when the value fails: it
 * must be memory nobody reads before this returns 0. */
int kvhi_remote_value_check_copy(const void *val, size_t len, void *dst, const kvhi_remote_id *id,
                                 const kvhi_remote_expect *ex, const char **why);

/* Checks a value on its own (no expected hash: `kvh store verify`): all of
 * the above but hash, parent and tokens, which it returns in *hash_out. */
int kvhi_remote_value_check_alone(const void *val, size_t len, const kvhi_remote_id *id, uint64_t *hash_out,
                                  const char **why);

#endif
