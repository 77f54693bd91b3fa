/* Copies between kvh's blocks and an external pool (KV memory owned by an
 * inference engine, core/ext_pool.h): the gather of an offload and the
 * scatter of a restore, part of the move module (core/move.h). They run
 * with the lock held and the block held: nothing moves it meanwhile. */
#include <stdlib.h>

#include "core/ext_pool.h"
#include "core/move.h"
#include "core/block.h"
#include "core/codec_tier.h"

kvh_status kvhi_pool_copy(kvh_engine *e, kvhi_ext_pool *p, uint32_t slot, uint32_t b, bool to_block)
{
    kvhi_block *blk = &e->blocks[b];
    uint32_t H = e->cfg.num_kv_heads, bt = e->cfg.block_tokens;
    size_t row = (size_t)e->cfg.head_dim * e->elem_bytes;
    bool pool_dev = p->layout.memory == KVH_MEMORY_CUDA;
    bool blk_dev = blk->tier == KVH_TIER_DEVICE && !e->device_host_addressable;
    enum kvhi_copy_kind kind;
    if (pool_dev && blk_dev)
        kind = KVHI_COPY_DEVICE_TO_DEVICE;
    else if (pool_dev)
        kind = to_block ? KVHI_COPY_DEVICE_TO_HOST : KVHI_COPY_HOST_TO_DEVICE;
    else if (blk_dev)
        kind = to_block ? KVHI_COPY_HOST_TO_DEVICE : KVHI_COPY_DEVICE_TO_HOST;
    else
        kind = KVHI_COPY_HOST_TO_HOST;
    uint8_t *data = kvhi_block_data(e, b);
    /* A block in an encoded tier is gathered into (or decoded to) a raw
     * host copy, which the codec converts. */
    uint8_t *raw = NULL;
    bool encoded = e->tiers[blk->tier].encoded;
    if (encoded) {
        if (!(raw = malloc(e->block_bytes)))
            return kvhi_fail(KVH_ERR_NOMEM, "out of memory for a pool copy");
        if (!to_block)
            kvhi_block_copy(e, KVHI_RAW_HOST, raw, blk->tier, data);
        data = raw;
        blk_dev = false;
        kind = pool_dev ? (to_block ? KVHI_COPY_DEVICE_TO_HOST : KVHI_COPY_HOST_TO_DEVICE) : KVHI_COPY_HOST_TO_HOST;
    }
    kvh_status st = KVH_OK;
    for (uint32_t l = 0; l < e->cfg.num_layers; l++)
        for (uint32_t kv = 0; kv < 2; kv++)
            for (uint32_t h = 0; h < H; h++) {
                uint8_t *ext = (uint8_t *)(kv ? p->v_base[l] : p->k_base[l]) + (uint64_t)slot * p->layout.slot_stride +
                               (uint64_t)h * p->layout.head_stride;
                uint8_t *mine = data + (uint64_t)l * e->layer_bytes + (size_t)(kv * H + h) * bt * row;
                char msg[256];
                int rc = to_block ? e->backend->copy_2d(e->backend_ctx, mine, row, ext, p->layout.token_stride, row, bt,
                                                        kind, msg, sizeof(msg))
                                  : e->backend->copy_2d(e->backend_ctx, ext, p->layout.token_stride, mine, row, row, bt,
                                                        kind, msg, sizeof(msg));
                if (rc != 0 && st == KVH_OK)
                    st = kvhi_fail(KVH_ERR_IO, "pool copy failed: %s", msg);
            }
    if (encoded && to_block && st == KVH_OK)
        kvhi_block_copy(e, blk->tier, kvhi_block_data(e, b), KVHI_RAW_HOST, raw);
    free(raw);
    return st;
}
