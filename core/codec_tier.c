/* Quantised host and disk tiers: with kv_codec set, every block below the
 * device tier is stored encoded (kernels/cpu/kv_codec.h), so those tiers
 * hold more blocks for the same budget. The device tier stays raw because
 * attention reads it. Blocks are encoded when they leave the device tier
 * and decoded when they come back; a block created in the host tier is
 * encoded cell by cell as its KV is written. */
#include <stdlib.h>
#include <string.h>

#include "core/engine.h"
#include "core/move.h"
#include "kernels/cpu/kv_codec.h"
#include "core/block.h"
#include "core/codec_tier.h"

kvh_status kvhi_codec_tiers_init(kvh_engine *e)
{
    uint32_t codec = e->cfg.kv_codec;
    e->vector_bytes = (uint64_t)e->cfg.head_dim * e->elem_bytes;
    size_t enc = kvhi_codec_vector_bytes(codec, e->cfg.dtype, e->cfg.head_dim);
    if (enc == 0)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "kv_codec %u is unknown or does not fit head_dim %u", codec,
                         e->cfg.head_dim);
    e->enc_vector_bytes = enc;
    uint64_t cells = 2ull * e->cfg.num_layers * e->cfg.num_kv_heads * e->cfg.block_tokens;
    for (uint32_t t = 0; t < KVH_TIER_COUNT; t++) {
        kvhi_tier *tier = &e->tiers[t];
        tier->encoded = codec != KVH_CODEC_NONE && t != KVH_TIER_DEVICE;
        tier->slot_bytes = tier->encoded ? cells * enc : e->block_bytes;
    }
    return KVH_OK;
}

uint64_t kvhi_cell_offset(kvh_engine *e, uint32_t tier, uint32_t layer, uint32_t kv, uint32_t head, uint32_t token)
{
    uint64_t cell = (((uint64_t)layer * 2 + kv) * e->cfg.num_kv_heads + head) * e->cfg.block_tokens + token;
    return cell * kvhi_cell_bytes(e, tier);
}

/* Device memory the CPU cannot address (CUDA): goes through a host buffer. */
static bool remote(kvh_engine *e, uint32_t tier) { return tier == KVH_TIER_DEVICE && !e->device_host_addressable; }

static bool encoded(kvh_engine *e, uint32_t tier) { return tier < KVH_TIER_COUNT && e->tiers[tier].encoded; }

int kvhi_block_copy(kvh_engine *e, uint32_t dst_tier, void *dst, uint32_t src_tier, const void *src)
{
    bool dst_enc = encoded(e, dst_tier), src_enc = encoded(e, src_tier);
    if (dst_enc == src_enc)
        return kvhi_copy_bytes(e, dst_tier, dst, src_tier, src,
                               dst_enc ? e->tiers[KVH_TIER_HOST].slot_bytes : e->block_bytes);
    uint64_t cells = e->block_bytes / e->vector_bytes;
    uint8_t *staging = NULL;
    int rc = 0;
    if (dst_enc) {
        /* raw -> encoded; encoded tiers are always host memory */
        const void *raw = src;
        if (remote(e, src_tier)) {
            if (!(staging = malloc(e->block_bytes)))
                return -1;
            rc = kvhi_copy_bytes(e, KVH_TIER_HOST, staging, src_tier, src, e->block_bytes);
            raw = staging;
        }
        if (rc == 0)
            kvhi_codec_encode(e->cfg.kv_codec, e->cfg.dtype, e->cfg.head_dim, raw, cells, dst);
    } else {
        /* encoded -> raw */
        void *raw = dst;
        if (remote(e, dst_tier)) {
            if (!(staging = malloc(e->block_bytes)))
                return -1;
            raw = staging;
        }
        kvhi_codec_decode(e->cfg.kv_codec, e->cfg.dtype, e->cfg.head_dim, src, cells, raw);
        if (staging)
            rc = kvhi_copy_bytes(e, dst_tier, dst, KVH_TIER_HOST, staging, e->block_bytes);
    }
    free(staging);
    return rc == 0 ? 0 : -1;
}

int kvhi_codec_kv_copy(kvh_engine *e, uint32_t b, uint32_t layer, uint32_t off, uint32_t cnt, void *uk, void *uv,
                       bool to_block)
{
    kvhi_block *blk = &e->blocks[b];
    uint32_t H = e->cfg.num_kv_heads;
    uint8_t *data = kvhi_block_data(e, b);
    for (uint32_t kv = 0; kv < 2; kv++) {
        uint8_t *user = kv ? uv : uk;
        if (!user)
            continue;
        for (uint32_t h = 0; h < H; h++) {
            /* One head's tokens are neighbouring records in the block. */
            uint8_t *cells = data + kvhi_cell_offset(e, blk->tier, layer, kv, h, off);
            for (uint32_t t = 0; t < cnt; t++) {
                uint8_t *vec = user + ((uint64_t)t * H + h) * e->vector_bytes;
                uint8_t *cell = cells + (uint64_t)t * e->enc_vector_bytes;
                if (to_block)
                    kvhi_codec_encode(e->cfg.kv_codec, e->cfg.dtype, e->cfg.head_dim, vec, 1, cell);
                else
                    kvhi_codec_decode(e->cfg.kv_codec, e->cfg.dtype, e->cfg.head_dim, cell, 1, vec);
            }
        }
    }
    return 0;
}
