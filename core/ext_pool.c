/* External pools: KV memory owned by an inference engine, which kvh reads
 * from (offload) and writes into (restore) by slot index. */
#include <stdlib.h>
#include <string.h>

#include "core/engine.h"
#include "core/ext_pool.h"
#include "core/move.h"
#include "core/block.h"

void kvhi_pools_destroy(kvh_engine *e)
{
    for (uint32_t i = 0; i < e->pools.cap; i++) {
        kvhi_ext_pool *p = e->pools.ptrs ? e->pools.ptrs[i] : NULL;
        if (p) {
            free(p->k_base);
            free(p->v_base);
            free(p->slot_readers);
            free(p->slot_writing);
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
    p->num_layers = L;
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

void kvhi_pool_unregister(kvh_engine *e, kvhi_ext_pool *p, uint32_t index)
{
    /* The handle goes first, so no new batch or call finds the pool; queued
     * batches see it unregistered and fail, while a running batch or a
     * call already inside (kvh_pool_offload*, kvh_pool_restore) finishes
     * its copies: the caller's memory stays valid until this returns. */
    kvhi_handles_remove(&e->pools, index);
    p->unregistered = true;
    while (p->batches || p->calls)
        pthread_cond_wait(&e->changed, &e->lock);
    free(p->k_base);
    free(p->v_base);
    free(p->slot_readers);
    free(p->slot_writing);
    free(p);
}

/* The bits of layers [first, first + n) in a slot's write mask: one per
 * layer up to 64 layers, else per group of adjacent layers (two writes
 * of one group are refused, as of one layer). */
static uint64_t layer_bits(const kvhi_ext_pool *p, uint32_t first, uint32_t n)
{
    uint32_t lo = (uint32_t)((uint64_t)first * 64 / p->num_layers);
    uint32_t hi = (uint32_t)((uint64_t)(first + n - 1) * 64 / p->num_layers);
    uint64_t upto_hi = hi >= 63 ? ~0ull : (2ull << hi) - 1;
    return upto_hi & ~((1ull << lo) - 1);
}

kvh_status kvhi_pool_slot_check(kvhi_ext_pool *p, uint32_t slot, kvhi_slot_use u, size_t item)
{
    if (!p->slot_readers) {
        p->slot_readers = calloc(p->layout.num_slots, sizeof(uint32_t));
        p->slot_writing = calloc(p->layout.num_slots, sizeof(uint64_t));
        if (!p->slot_readers || !p->slot_writing) {
            free(p->slot_readers);
            free(p->slot_writing);
            p->slot_readers = NULL;
            p->slot_writing = NULL;
            return kvhi_fail(KVH_ERR_NOMEM, "out of memory for a pool's slot table (%u slots)", p->layout.num_slots);
        }
    }
    uint64_t writing = p->slot_writing[slot];
    if (!u.write && writing)
        return kvhi_fail(KVH_ERR_BUSY,
                         "item %zu: slot %u is being written by a restore that has not completed (wait for its "
                         "last fence)",
                         item, slot);
    if (u.write && p->slot_readers[slot])
        return kvhi_fail(KVH_ERR_BUSY,
                         "item %zu: slot %u is being read by an offload that has not completed (wait for its fence)",
                         item, slot);
    if (u.write && (writing & layer_bits(p, u.first_layer, u.n_layers)))
        return kvhi_fail(KVH_ERR_BUSY,
                         "item %zu: layers %u..%u of slot %u are being written by a restore that has not completed "
                         "(wait for its last fence)",
                         item, u.first_layer, u.first_layer + u.n_layers - 1, slot);
    if (!u.write && p->slot_readers[slot] == UINT32_MAX)
        return kvhi_fail(KVH_ERR_BUSY, "item %zu: slot %u has too many offloads running", item, slot);
    return KVH_OK;
}

void kvhi_pool_slot_enter(kvhi_ext_pool *p, uint32_t slot, kvhi_slot_use u)
{
    if (u.write)
        p->slot_writing[slot] |= layer_bits(p, u.first_layer, u.n_layers);
    else
        p->slot_readers[slot]++;
}

void kvhi_pool_slot_leave(kvhi_ext_pool *p, uint32_t slot, kvhi_slot_use u)
{
    if (u.write)
        p->slot_writing[slot] &= ~layer_bits(p, u.first_layer, u.n_layers);
    else
        p->slot_readers[slot]--;
}

kvh_status kvhi_pool_restore(kvh_engine *e, kvhi_ext_pool *p, uint32_t b, uint32_t slot)
{
    if (!kvhi_block_kv_complete(e, b))
        return kvhi_fail(KVH_ERR_INVALID_ARG, "block KV is not fully written");
    kvhi_block_ref(e, b); /* keep it while a disk read drops the lock */
    kvhi_block_hold(e, b);
    kvh_status st = kvhi_block_ensure_memory(e, b);
    if (st == KVH_OK)
        st = kvhi_pool_copy(e, p, slot, b, false);
    kvhi_block_unhold(e, b);
    kvhi_block_unref(e, b);
    if (st == KVH_OK)
        kvhi_block_touch(e, b);
    return st;
}

uint32_t kvhi_pool_find_cached(kvh_engine *e, uint64_t salt, uint64_t parent, const int32_t *tokens, uint64_t *hash)
{
    uint32_t bt = e->cfg.block_tokens;
    uint64_t h = kvhi_prefix_hash(parent, tokens, bt, salt);
    *hash = h;
    uint32_t b = kvhi_block_find_published(e, h, parent, tokens);
    if (b != KVHI_PREFIX_MISS) {
        kvhi_block_ref(e, b);
        kvhi_block_touch(e, b);
        return b;
    }
    return KVHI_PREFIX_MISS;
}

void kvhi_pool_seal(kvh_engine *e, uint32_t b, uint64_t hash, uint64_t parent, const int32_t *tokens)
{
    uint32_t bt = e->cfg.block_tokens;
    kvhi_block *blk = &e->blocks[b];
    memcpy(kvhi_block_tokens(e, b), tokens, bt * sizeof(int32_t));
    blk->n_tokens = (uint16_t)bt;
    blk->parent_hash = parent;
    blk->hash = hash;
    blk->flags |= KVHI_BF_HASHED | KVHI_BF_KV_COMPLETE;
    kvhi_block_try_publish(e, b);
}

kvh_status kvhi_pool_offload(kvh_engine *e, kvhi_ext_pool *p, uint32_t slot, uint64_t salt, uint64_t parent,
                             const int32_t *tokens, uint32_t agent, uint32_t *out)
{
    uint64_t h;
    uint32_t b = kvhi_pool_find_cached(e, salt, parent, tokens, &h);
    if (b != KVHI_PREFIX_MISS) {
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
    kvhi_pool_seal(e, b, h, parent, tokens);
    *out = b;
    return KVH_OK;
}
