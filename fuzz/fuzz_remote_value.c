/* Fuzz target: the remote tier's value parser, kvh_remote_value_check
 * (core/remote_format.c), on values as a hostile or broken store returns
 * them: any length, any bytes.
 *
 * Input: flags (u8), a geometry choice (u8), hash and parent (u64 each),
 * then the value's bytes (its length is what is left of the input).
 *   flags bit 0: put the right data CRC32C and header CRC into the value
 *                (so the fuzzer reaches the fields behind the checksums)
 *         bit 1: put the right magic
 *         bit 2: check it on its own (kvhi_remote_value_check_alone);
 *                otherwise also with kvhi_remote_value_check_copy
 * Properties, beyond memory safety (the value is copied into a buffer of
 * exactly its length, so ASan sees any read past it):
 *   - a value that passes has exactly the length the geometry implies,
 *     and the hash, parent and tokens the reader asked for;
 *   - a value the encoder writes for the input's fields passes, and the
 *     same value with one byte changed (the input picks it) does not.
 */
#include "fuzz_common.h"

#include "core/crc32c.h"
#include "core/remote_format.h"

static const uint64_t block_sizes[] = {0, 64, 256, 4096, 12288};
static const uint32_t block_tokens[] = {1, 16, 256, 0, 300};

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

/* The libFuzzer entry point (no header declares it). */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz_in in = {data, size, 0};
    uint8_t flags = fz_u8(&in), geo = fz_u8(&in);
    uint64_t hash = fz_u64(&in), parent = fz_u64(&in);
    kvhi_remote_id id = {.model_salt = 0x5a17,
                         .geo_tag = 0xfeedf00d,
                         .block_bytes = block_sizes[geo % 5],
                         .block_tokens = block_tokens[(geo / 5) % 5]};
    uint32_t bt = id.block_tokens && id.block_tokens <= 256 ? id.block_tokens : 1;
    int32_t *tokens = malloc(sizeof(int32_t) * bt);
    size_t len = fz_left(&in);
    uint8_t *val = malloc(len ? len : 1);
    if (!tokens || !val) {
        free(tokens), free(val);
        return 0;
    }
    memcpy(val, data + in.at, len);
    for (uint32_t i = 0; i < bt; i++)
        tokens[i] = (int32_t)fz_mix(hash + i);
    if ((flags & 2) && len >= 8)
        memcpy(val, "KVHBLK\0\1", 8);
    if ((flags & 1) && len >= KVHI_SLOT_HEADER_BYTES) {
        put32(val + 64, kvhi_crc32c(0, val + KVHI_SLOT_HEADER_BYTES, len - KVHI_SLOT_HEADER_BYTES));
        put32(val + KVHI_SLOT_HEADER_BYTES - 4, kvhi_crc32c(0, val, KVHI_SLOT_HEADER_BYTES - 4));
    }
    kvhi_remote_expect ex = {.hash = hash, .parent = parent, .tokens = tokens};
    const char *why = NULL;
    int rc;
    if (flags & 4) {
        uint64_t got = 0;
        rc = kvhi_remote_value_check_alone(val, len, &id, &got, &why);
    } else {
        rc = kvhi_remote_value_check(val, len, &id, &ex, &why);
        /* The copying check (the match's path) agrees; its destination is
         * exactly one block of data, so ASan sees any write past it. */
        uint8_t *dst = malloc(id.block_bytes ? id.block_bytes : 1);
        if (dst) {
            const char *why_copy = NULL;
            int rc_copy = kvhi_remote_value_check_copy(val, len, dst, &id, &ex, &why_copy);
            FZ_CHECK(rc_copy == rc, "the copying check said %d, the plain one %d", rc_copy, rc);
            if (rc == 0)
                FZ_CHECK(memcmp(dst, val + KVHI_SLOT_HEADER_BYTES, id.block_bytes) == 0,
                         "the copying check passed a value but copied other data");
            free(dst);
        }
    }
    if (rc == 0)
        FZ_CHECK(len == KVHI_SLOT_HEADER_BYTES + id.block_bytes, "a value of %zu bytes passed (block %llu)", len,
                 (unsigned long long)id.block_bytes);
    else
        FZ_CHECK(why && *why, "a rejected value gave no reason (rc %d)", rc);
    free(val);

    /* round trip, then one changed byte */
    if (id.block_tokens >= 1 && id.block_tokens <= 256) {
        uint64_t vb = kvhi_remote_value_bytes(&id);
        uint8_t *v = calloc(1, vb);
        if (v) {
            for (uint64_t i = KVHI_SLOT_HEADER_BYTES; i < vb; i++)
                v[i] = (uint8_t)fz_mix(i ^ parent);
            kvhi_remote_value_encode(v, &id, hash, parent, tokens, v + KVHI_SLOT_HEADER_BYTES);
            rc = kvhi_remote_value_check(v, vb, &id, &ex, &why);
            FZ_CHECK(rc == 0, "a freshly encoded value does not pass: %s", why);
            uint64_t at = fz_u64(&in) % vb;
            v[at] ^= (uint8_t)(1 + fz_u8(&in) % 255);
            /* Bytes of the header past the tokens and before the flags are
             * padding the CRC still covers: every change is caught. */
            FZ_CHECK(kvhi_remote_value_check(v, vb, &id, &ex, &why) != 0, "changed byte %llu still passes",
                     (unsigned long long)at);
            free(v);
        }
    }
    free(tokens);
    return 0;
}
