#include "core/remote_format.h"

#include <stdio.h>
#include <string.h>

#include "core/crc32c.h"
#include "core/prefix_index.h"

void kvhi_remote_model_prefix(char *out, const kvhi_remote_id *id)
{
    snprintf(out, KVHI_REMOTE_MODEL_PREFIX_LEN + 1, "kvh:v2:%016llx-%08x:", (unsigned long long)id->model_salt,
             id->geo_tag);
}

/* Starts of the key's second chain: any constants other than the hash's
 * own start (core/prefix_index.c) will do; these are fixed by the key
 * format. */
#define KEY_CHAIN_PARENT 0x2545f4914f6cdd1dull
#define KEY_CHAIN_SALT 0xd6e8feb86659fd93ull

void kvhi_remote_key(char *key, const kvhi_remote_id *id, uint64_t hash, uint64_t parent, const int32_t *tokens)
{
    uint64_t second = kvhi_prefix_hash(parent ^ KEY_CHAIN_PARENT, tokens, id->block_tokens, hash ^ KEY_CHAIN_SALT);
    kvhi_remote_model_prefix(key, id);
    snprintf(key + KVHI_REMOTE_MODEL_PREFIX_LEN, KVHI_REMOTE_KEY_BYTES - KVHI_REMOTE_MODEL_PREFIX_LEN,
             "%016llx-%016llx", (unsigned long long)hash, (unsigned long long)second);
}

void kvhi_remote_value_encode(void *buf, const kvhi_remote_id *id, uint64_t hash, uint64_t parent,
                              const int32_t *tokens, const void *data)
{
    kvhi_remote_value_encode_crc(buf, id, hash, parent, tokens, kvhi_crc32c(0, data, id->block_bytes));
}

void kvhi_remote_value_encode_crc(void *buf, const kvhi_remote_id *id, uint64_t hash, uint64_t parent,
                                  const int32_t *tokens, uint32_t data_crc)
{
    kvhi_slot_meta m = {.store_id = id->model_salt,
                        .hash = hash,
                        .parent = parent,
                        .n_tokens = id->block_tokens,
                        .data_crc = data_crc,
                        .flags = KVHI_SLOT_PUBLISHED,
                        .geo_tag = id->geo_tag,
                        .tokens = tokens};
    kvhi_slot_header_encode(buf, &m, id->block_bytes);
}

#define FAIL(code, text)                                                                                               \
    do {                                                                                                               \
        if (why)                                                                                                       \
            *why = text;                                                                                               \
        return code;                                                                                                   \
    } while (0)

/* The checks that need no expectation; the header's tokens go to tokens
 * (block_tokens entries). With dst set, the data is copied there and its
 * checksum taken in the same pass. */
static int check_value(const uint8_t *v, size_t len, const kvhi_remote_id *id, void *dst, kvhi_slot_meta *m,
                       int32_t *tokens, const char **why)
{
    if (id->block_tokens == 0 || id->block_tokens > 256)
        FAIL(-20, "reader geometry has no valid block size");
    if (len < KVHI_SLOT_HEADER_BYTES || len - KVHI_SLOT_HEADER_BYTES != id->block_bytes)
        FAIL(-21, "value length does not match the block size");
    const uint8_t *data = v + KVHI_SLOT_HEADER_BYTES;
    int rc = dst ? kvhi_slot_check_alone_crc(v, kvhi_crc32c_copy(0, dst, data, id->block_bytes), id->block_bytes, 0, 0,
                                             id->block_tokens, m, tokens, why)
                 : kvhi_slot_check_alone(v, data, id->block_bytes, 0, 0, id->block_tokens, m, tokens, why);
    if (rc != 0)
        return rc;
    if (m->geo_tag != id->geo_tag || m->store_id != id->model_salt)
        FAIL(-22, "value was written for another model or geometry");
    if (!(m->flags & KVHI_SLOT_PUBLISHED))
        FAIL(-23, "value is not a published block");
    if (m->n_tokens != id->block_tokens)
        FAIL(-24, "value holds a partial block");
    return 0;
}

int kvhi_remote_value_check(const void *val, size_t len, const kvhi_remote_id *id, const kvhi_remote_expect *ex,
                            const char **why)
{
    return kvhi_remote_value_check_copy(val, len, NULL, id, ex, why);
}

int kvhi_remote_value_check_copy(const void *val, size_t len, void *dst, const kvhi_remote_id *id,
                                 const kvhi_remote_expect *ex, const char **why)
{
    int32_t tokens[256];
    kvhi_slot_meta m;
    int rc = check_value(val, len, id, dst, &m, tokens, why);
    if (rc != 0)
        return rc;
    if (m.hash != ex->hash)
        FAIL(-25, "value holds another prefix hash");
    if (m.parent != ex->parent)
        FAIL(-26, "value holds another parent hash");
    if (memcmp(tokens, ex->tokens, sizeof(int32_t) * id->block_tokens) != 0)
        FAIL(-27, "value holds other tokens");
    return 0;
}

int kvhi_remote_value_check_alone(const void *val, size_t len, const kvhi_remote_id *id, uint64_t *hash_out,
                                  const char **why)
{
    int32_t tokens[256];
    kvhi_slot_meta m;
    int rc = check_value(val, len, id, NULL, &m, tokens, why);
    if (rc == 0 && hash_out)
        *hash_out = m.hash;
    return rc;
}
