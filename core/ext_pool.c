/* External pools: KV memory owned by an inference engine, which kvh reads
 * from (offload) and writes into (restore) by slot index. */
#include <stdlib.h>
#include <string.h>

#include "core/engine.h"
#include "core/ext_pool.h"

void kvhi_pools_destroy(kvh_engine *e)
{
    for (uint32_t i = 0; i < e->pools.cap; i++) {
        kvhi_ext_pool *p = e->pools.ptrs ? e->pools.ptrs[i] : NULL;
        if (p) {
            free(p->k_base);
            free(p->v_base);
            free(p);
        }
    }
}

kvh_status kvhi_pool_register(kvh_engine *e, const kvh_pool_layout *layout, kvh_pool *out)
{
    uint32_t L = e->cfg.num_layers;
    kvhi_ext_pool *p = calloc(1, sizeof(*p));
    if (!p)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for a pool");
    p->layout = *layout;
    p->k_base = malloc(sizeof(void *) * L);
    p->v_base = malloc(sizeof(void *) * L);
    if (!p->k_base || !p->v_base) {
        free(p->k_base);
        free(p->v_base);
        free(p);
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for a pool");
    }
    memcpy(p->k_base, layout->k_base, sizeof(void *) * L);
    memcpy(p->v_base, layout->v_base, sizeof(void *) * L);
    p->layout.k_base = NULL;
    p->layout.v_base = NULL;
    if (kvhi_handles_add(&e->pools, p, &out->id, NULL) != 0) {
        free(p->k_base);
        free(p->v_base);
        free(p);
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for a pool");
    }
    return KVH_OK;
}

/* Gathers (to_block) or scatters one block between pool slot and block b. */
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

kvh_status kvhi_pool_offload(kvh_engine *e, kvhi_ext_pool *p, uint32_t slot, uint64_t parent, const int32_t *tokens,
                             uint32_t agent, uint32_t *out)
{
    uint32_t bt = e->cfg.block_tokens;
    uint64_t h = kvhi_prefix_hash(parent, tokens, bt, e->cfg.model_salt);
    uint32_t b = kvhi_prefix_find(&e->prefix, h);
    if (b != KVHI_PREFIX_MISS && e->blocks[b].parent_hash == parent &&
        memcmp(kvhi_block_tokens(e, b), tokens, bt * sizeof(int32_t)) == 0) {
        if (e->blocks[b].refs++ == 0)
            kvhi_block_update_evictable(e, b);
        kvhi_block_touch(e, b);
        *out = b;
        return KVH_OK;
    }
    /* The inference engine's memory is the hot copy: ours starts below it. */
    uint32_t min_tier = e->tiers[KVH_TIER_HOST].present ? KVH_TIER_HOST : KVH_TIER_DEVICE;
    kvh_status st = kvhi_block_new(e, agent, min_tier, &b);
    if (st != KVH_OK)
        return st;
    kvhi_block_hold(e, b); /* nothing may move it during the gather */
    st = kvhi_pool_copy(e, p, slot, b, true);
    kvhi_block_unhold(e, b);
    if (st != KVH_OK) {
        kvhi_block_unref(e, b);
        return st;
    }
    kvhi_block *blk = &e->blocks[b];
    memcpy(kvhi_block_tokens(e, b), tokens, bt * sizeof(int32_t));
    blk->n_tokens = (uint16_t)bt;
    blk->parent_hash = parent;
    blk->hash = h;
    blk->flags |= KVHI_BF_HASHED | KVHI_BF_KV_COMPLETE;
    kvhi_block_try_publish(e, b);
    *out = b;
    return KVH_OK;
}
