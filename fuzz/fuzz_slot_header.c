/* Fuzz target: the block (slot) header parser, kvhi_slot_verify.
 *
 * Input: flags (u8), store_id, slot, expect_hash (u64 each), max_tokens
 * (u8 + 1), a block size choice (u8), then the header bytes (up to 4096,
 * zero-padded) and the data bytes (zero-padded to the block size).
 *   flags bit 0: put the right CRC32C of the data into the header
 *         bit 1: then put the right header CRC too (so the fuzzer reaches
 *                the fields behind the checksums)
 *         bit 2: put the right magic
 * Properties, beyond memory safety:
 *   - tokens_out (exactly max_tokens entries) is never written past its end
 *     (ASan), and a header that verifies has n_tokens <= max_tokens;
 *   - a header the encoder writes for the input's fields verifies, and the
 *     same header with any single bit flipped (the input picks it) or with
 *     one byte of data changed does not.
 */
#include "fuzz_common.h"

#include "core/crc32c.h"
#include "core/disk_format.h"

static const uint64_t block_sizes[] = {64, 128, 256, 4096, 8192, 12288};

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
    uint8_t flags = fz_u8(&in);
    uint64_t store_id = fz_u64(&in), slot = fz_u64(&in) % 4096, expect_hash = fz_u64(&in);
    uint32_t max_tokens = (uint32_t)fz_u8(&in) + 1;
    uint64_t bb = block_sizes[fz_u8(&in) % (sizeof(block_sizes) / sizeof(block_sizes[0]))];
    uint64_t offset = (slot % 128) * (KVHI_SLOT_HEADER_BYTES + kvhi_round_up(bb, KVHI_DISK_ALIGN));

    uint8_t *hdr = calloc(1, KVHI_SLOT_HEADER_BYTES);
    uint8_t *blk = calloc(1, bb);
    int32_t *tokens = malloc(sizeof(int32_t) * max_tokens);
    if (!hdr || !blk || !tokens) {
        free(hdr), free(blk), free(tokens);
        return 0;
    }
    size_t take = fz_left(&in) < KVHI_SLOT_HEADER_BYTES ? fz_left(&in) : KVHI_SLOT_HEADER_BYTES;
    memcpy(hdr, data + in.at, take);
    in.at += take;
    take = fz_left(&in) < bb ? fz_left(&in) : bb;
    memcpy(blk, data + in.at, take);
    in.at += take;
    if (flags & 4)
        memcpy(hdr, "KVHBLK\0\1", 8);
    if (flags & 1)
        put32(hdr + 64, kvhi_crc32c(0, blk, bb));
    if (flags & 2)
        put32(hdr + KVHI_SLOT_HEADER_BYTES - 4, kvhi_crc32c(0, hdr, KVHI_SLOT_HEADER_BYTES - 4));

    const char *why = NULL;
    int rc = kvhi_slot_verify(hdr, blk, bb, store_id, 0, slot, offset, expect_hash, max_tokens, tokens, &why);
    if (rc == 0) {
        uint32_t n = (uint32_t)hdr[12] | (uint32_t)hdr[13] << 8 | (uint32_t)hdr[14] << 16 | (uint32_t)hdr[15] << 24;
        FZ_CHECK(n <= max_tokens, "a header with %u tokens verified (max %u)", n, max_tokens);
    } else
        FZ_CHECK(why && *why, "a failed verification gave no reason (rc %d)", rc);

    /* round trip: encode the input's fields, verify, then damage it */
    uint32_t n_tokens = (uint32_t)(expect_hash % (max_tokens + 1));
    for (uint32_t i = 0; i < n_tokens; i++)
        tokens[i] = (int32_t)fz_mix(store_id + i);
    kvhi_slot_meta m = {.store_id = store_id,
                        .slot = slot,
                        .offset = offset,
                        .hash = expect_hash,
                        .parent = fz_mix(expect_hash),
                        .n_tokens = n_tokens,
                        .data_crc = kvhi_crc32c(0, blk, bb),
                        .tokens = tokens};
    kvhi_slot_header_encode(hdr, &m, bb);
    int32_t *back = malloc(sizeof(int32_t) * max_tokens);
    if (back) {
        rc = kvhi_slot_verify(hdr, blk, bb, store_id, 0, slot, offset, expect_hash, max_tokens, back, &why);
        FZ_CHECK(rc == 0, "a freshly encoded header does not verify: %s", why);
        FZ_CHECK(!memcmp(back, tokens, sizeof(int32_t) * n_tokens), "tokens do not round-trip");
        free(back);
    }
    uint64_t bit = fz_u64(&in) % ((uint64_t)KVHI_SLOT_HEADER_BYTES * 8);
    hdr[bit / 8] ^= (uint8_t)(1u << (bit % 8));
    rc = kvhi_slot_verify(hdr, blk, bb, store_id, 0, slot, offset, expect_hash, max_tokens, NULL, &why);
    FZ_CHECK(rc != 0, "a header with bit %llu flipped still verifies", (unsigned long long)bit);
    hdr[bit / 8] ^= (uint8_t)(1u << (bit % 8));
    uint64_t at = fz_u64(&in) % bb;
    uint8_t delta = (uint8_t)(1 + fz_u8(&in) % 255);
    blk[at] ^= delta;
    rc = kvhi_slot_verify(hdr, blk, bb, store_id, 0, slot, offset, expect_hash, max_tokens, NULL, &why);
    FZ_CHECK(rc != 0, "changed data (byte %llu) still verifies", (unsigned long long)at);
    blk[at] ^= delta;
    /* the same block read from another slot, store or with another hash */
    FZ_CHECK(kvhi_slot_verify(hdr, blk, bb, store_id, 0, slot + 1, offset, expect_hash, max_tokens, NULL, &why) != 0,
             "misplaced block verifies");
    FZ_CHECK(kvhi_slot_verify(hdr, blk, bb, store_id ^ 1, 0, slot, offset, expect_hash, max_tokens, NULL, &why) != 0,
             "foreign block verifies");
    free(hdr);
    free(blk);
    free(tokens);
    return 0;
}
