/* Tiers held in a KV codec (core/codec_tier.c). */
#ifndef KVH_CORE_CODEC_TIER_H
#define KVH_CORE_CODEC_TIER_H

#include <stdbool.h>
#include <stdint.h>

#include "core/engine.h"

/* Sets slot sizes and which tiers are encoded; validates the codec for
 * the geometry (KVH_ERR_INVALID_ARG). Called before the tiers exist. */
kvh_status kvhi_codec_tiers_init(kvh_engine *e);
/* Copies one block's data between two locations, converting between the
 * raw and encoded forms as the tiers need. A tier names the memory kind
 * and the form: KVH_TIER_DISK stands for a host staging buffer holding the
 * disk form, KVHI_RAW_HOST host memory holding the raw form.
 * Returns 0 or -1 (copy failure, out of memory). */
#define KVHI_RAW_HOST 3u
int kvhi_block_copy(kvh_engine *e, uint32_t dst_tier, void *dst, uint32_t src_tier, const void *src);
/* Offset and size of the cell (layer, kv, head, token) in a slot of tier. */
uint64_t kvhi_cell_offset(kvh_engine *e, uint32_t tier, uint32_t layer, uint32_t kv, uint32_t head, uint32_t token);
/* kv_copy of seq.c for a block in an encoded tier: user arrays shaped
 * [token][kv_head][head_dim] are encoded into (to_block) or decoded from
 * tokens [off, off + cnt) of one layer. Returns 0. */
int kvhi_codec_kv_copy(kvh_engine *e, uint32_t b, uint32_t layer, uint32_t off, uint32_t cnt, void *uk, void *uv,
                       bool to_block);
static inline uint64_t kvhi_cell_bytes(kvh_engine *e, uint32_t tier)
{
    return e->tiers[tier].encoded ? e->enc_vector_bytes : e->vector_bytes;
}

#endif
