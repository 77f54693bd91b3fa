/* Copies between kvh's blocks and an external pool (KV memory owned by an
 * inference engine, core/ext_pool.h): the gather of an offload and the
 * scatter of a restore, part of the move module (core/move.h). A span is
 * prepared under the lock with the block held (nothing moves it), then
 * copied with or without the lock. */
#include <stdio.h>
#include <stdlib.h>

#include "core/ext_pool.h"
#include "core/move.h"
#include "core/block.h"
#include "core/codec_tier.h"

kvh_status kvhi_pool_span_prepare(kvh_engine *e, const kvhi_ext_pool *p, uint32_t b, bool to_block, kvhi_pool_span *s)
{
    kvhi_block *blk = &e->blocks[b];
    bool pool_dev = p->layout.memory == KVH_MEMORY_CUDA;
    bool blk_dev = blk->tier == KVH_TIER_DEVICE && !e->device_host_addressable;
    s->tier = blk->tier;
    s->tier_data = kvhi_block_data(e, b);
    s->data = s->tier_data;
    s->raw = NULL;
    /* A block in an encoded tier is gathered into (or decoded to) a raw
     * host copy, which the codec converts. */
    if (e->tiers[blk->tier].encoded) {
        if (!(s->raw = malloc(e->block_bytes)))
            return kvhi_fail(KVH_ERR_NOMEM, "out of memory for a pool copy");
        s->data = s->raw;
        blk_dev = false;
    }
    if (pool_dev && blk_dev)
        s->kind = KVHI_COPY_DEVICE_TO_DEVICE;
    else if (pool_dev)
        s->kind = to_block ? KVHI_COPY_DEVICE_TO_HOST : KVHI_COPY_HOST_TO_DEVICE;
    else if (blk_dev)
        s->kind = to_block ? KVHI_COPY_HOST_TO_DEVICE : KVHI_COPY_DEVICE_TO_HOST;
    else
        s->kind = KVHI_COPY_HOST_TO_HOST;
    return KVH_OK;
}

int kvhi_pool_span_decode(kvh_engine *e, kvhi_pool_span *s)
{
    return s->raw ? kvhi_block_copy(e, KVHI_RAW_HOST, s->raw, s->tier, s->tier_data) : 0;
}

int kvhi_pool_span_copy(kvh_engine *e, const kvhi_ext_pool *p, uint32_t slot, const kvhi_pool_span *s, bool to_block,
                        uint32_t first_layer, uint32_t n_layers, char *msg, size_t msg_len)
{
    uint32_t H = e->cfg.num_kv_heads, bt = e->cfg.block_tokens;
    size_t row = (size_t)e->cfg.head_dim * e->elem_bytes;
    /* A head's token rows packed in the pool too (vLLM's CPU layout): one
     * copy of the whole run instead of one per token. */
    size_t width = row, height = bt;
    if (p->layout.token_stride == row) {
        width = row * bt;
        height = 1;
    }
    int failed = 0;
    for (uint32_t l = first_layer; l < first_layer + n_layers; l++)
        for (uint32_t kv = 0; kv < 2; kv++)
            for (uint32_t h = 0; h < H; h++) {
                uint8_t *ext = (uint8_t *)(kv ? p->v_base[l] : p->k_base[l]) + (uint64_t)slot * p->layout.slot_stride +
                               (uint64_t)h * p->layout.head_stride;
                uint8_t *mine = s->data + (uint64_t)l * e->layer_bytes + (size_t)(kv * H + h) * bt * row;
                char why[256];
                int rc = to_block ? e->backend->copy_2d(e->backend_ctx, mine, width, ext, p->layout.token_stride, width,
                                                        height, s->kind, why, sizeof(why))
                                  : e->backend->copy_2d(e->backend_ctx, ext, p->layout.token_stride, mine, width, width,
                                                        height, s->kind, why, sizeof(why));
                if (rc != 0 && !failed++)
                    snprintf(msg, msg_len, "pool copy failed: %s", why);
            }
    return failed ? -1 : 0;
}

int kvhi_pool_span_finish(kvh_engine *e, kvhi_pool_span *s, bool to_block, bool copied)
{
    int rc = 0;
    if (s->raw && to_block && copied)
        rc = kvhi_block_copy(e, s->tier, s->tier_data, KVHI_RAW_HOST, s->raw);
    free(s->raw);
    s->raw = NULL;
    return rc;
}

kvh_status kvhi_pool_copy(kvh_engine *e, kvhi_ext_pool *p, uint32_t slot, uint32_t b, bool to_block)
{
    kvhi_pool_span s;
    kvh_status st = kvhi_pool_span_prepare(e, p, b, to_block, &s);
    if (st != KVH_OK)
        return st;
    char msg[256];
    if (!to_block && kvhi_pool_span_decode(e, &s) != 0)
        st = kvhi_fail(KVH_ERR_IO, "decoding a block for a pool copy failed");
    else if (kvhi_pool_span_copy(e, p, slot, &s, to_block, 0, e->cfg.num_layers, msg, sizeof(msg)) != 0)
        st = kvhi_fail(KVH_ERR_IO, "%s", msg);
    if (kvhi_pool_span_finish(e, &s, to_block, st == KVH_OK) != 0 && st == KVH_OK)
        st = kvhi_fail(KVH_ERR_IO, "encoding a block for its tier failed");
    return st;
}
