/* Exported batched pool transfers and block persists (kvh.h, "Batched,
 * asynchronous pool transfers"): validation and what a batch takes under
 * the lock; core/pool_batch.c runs it. */
#include <stdlib.h>
#include <string.h>

#include "abi/api_common.h"
#include "core/block.h"
#include "core/pool_batch.h"
#include "core/prefix_index.h"

static const kvh_pool_xfer *xfer_at(const kvh_pool_xfer *xfers, size_t stride, size_t i)
{
    return (const kvh_pool_xfer *)((const uint8_t *)xfers + stride * i);
}

/* The stride of xfers[0..n): every entry's struct_size, equal and at
 * least this header's. */
static kvh_status xfers_stride(const kvh_pool_xfer *xfers, size_t n, size_t *stride)
{
    *stride = sizeof(kvh_pool_xfer);
    if (n == 0)
        return KVH_OK;
    size_t s = xfers[0].struct_size;
    if (s < sizeof(kvh_pool_xfer) || s % 8 != 0)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "kvh_pool_xfer struct_size %zu (this kvh needs %zu, a multiple of 8)", s,
                         sizeof(kvh_pool_xfer));
    for (size_t i = 1; i < n; i++)
        if (xfer_at(xfers, s, i)->struct_size != s)
            return kvhi_fail(KVH_ERR_INVALID_ARG, "xfers[%zu].struct_size %u differs from xfers[0]'s %zu", i,
                             xfer_at(xfers, s, i)->struct_size, s);
    *stride = s;
    return KVH_OK;
}

/* Enters e, resolves pool, and copies and checks the slots: in range,
 * none twice, none used by another transfer in a way use conflicts with
 * (and use's layers in range). [out] *slots_out (n entries, the caller
 * frees): the values checked, which the batch uses from then on, the
 * caller's array being the caller's to change meanwhile. */
static kvh_status enter_batch(kvh_engine *e, kvh_pool pool, const kvh_pool_xfer *xfers, size_t n, kvhi_slot_use use,
                              size_t *stride_out, kvhi_ext_pool **out, uint32_t **slots_out)
{
    bool offload = !use.write;
    KVHI_REQUIRE(xfers || n == 0, "xfers is NULL with n = %zu", n);
    kvh_status st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    size_t stride = sizeof(kvh_pool_xfer);
    kvhi_ext_pool *p = kvhi_handles_get(&e->pools, pool.id, NULL);
    uint8_t *seen = NULL;
    uint32_t *slots = NULL;
    uint32_t L = e->cfg.num_layers;
    if (use.write && (use.first_layer >= L || use.n_layers > L - use.first_layer))
        st = kvhi_fail(KVH_ERR_RANGE, "layers [%u, %u + %u) past num_layers %u", use.first_layer, use.first_layer,
                       use.n_layers, L);
    else if (!p)
        st = kvhi_fail(KVH_ERR_BAD_HANDLE, "stale or unknown pool 0x%llx", (unsigned long long)pool.id);
    else if (n > p->layout.num_slots)
        st = kvhi_fail(KVH_ERR_INVALID_ARG, "%zu transfers for a pool of %u slots (each slot at most once)", n,
                       p->layout.num_slots);
    else if ((st = xfers_stride(xfers, n, &stride)) != KVH_OK)
        ;
    else if (!(slots = malloc(sizeof(uint32_t) * (n ? n : 1))) ||
             (n && !(seen = calloc(p->layout.num_slots / 8 + 1, 1))))
        st = kvhi_fail(KVH_ERR_NOMEM, "out of memory checking a batch");
    for (size_t i = 0; offload && i < n && st == KVH_OK; i++)
        if (!xfer_at(xfers, stride, i)->tokens)
            st = kvhi_fail(KVH_ERR_INVALID_ARG, "xfers[%zu].tokens is NULL", i);
    for (size_t i = 0; i < n && st == KVH_OK; i++) {
        uint32_t slot = slots[i] = xfer_at(xfers, stride, i)->slot;
        if (slot >= p->layout.num_slots)
            st = kvhi_fail(KVH_ERR_RANGE, "xfers[%zu]: slot %u >= num_slots %u", i, slot, p->layout.num_slots);
        else if (seen[slot / 8] >> (slot % 8) & 1)
            st = kvhi_fail(KVH_ERR_INVALID_ARG, "xfers[%zu]: slot %u is listed twice in one batch", i, slot);
        else
            seen[slot / 8] |= (uint8_t)(1u << (slot % 8));
    }
    /* Another transfer still on a slot: refused before anything is taken. */
    for (size_t i = 0; i < n && st == KVH_OK; i++)
        st = kvhi_pool_slot_check(p, slots[i], use, i);
    free(seen);
    if (st != KVH_OK) {
        free(slots);
        return kvhi_api_leave(e, st);
    }
    *stride_out = stride;
    *out = p;
    *slots_out = slots;
    return KVH_OK;
}

/* Undoes the first k items of an offload that could not be queued. */
static void offload_undo(kvh_engine *e, kvhi_pool_work *w, uint32_t k)
{
    for (uint32_t i = 0; i < k; i++) {
        kvhi_pool_item *it = &w->items[i];
        if (it->copy) {
            e->blocks[it->block].flags &= (uint16_t)~KVHI_BF_POOL_FILL;
            kvhi_block_unhold_reading(e, it->block);
            kvhi_block_unref(e, it->block); /* the work's */
        }
        kvhi_block_unref(e, it->block); /* the one meant for the handle */
    }
}

/* The items of a batch that copy a block, by prefix hash: an open
 * addressing table of 1 + item index (0: empty), twice the batch or more,
 * so that finding an earlier copy of a prefix costs O(1) (a batch may
 * carry tens of thousands of items, under the engine lock). */
typedef struct copy_table {
    uint32_t *slot;
    uint64_t mask;
} copy_table;

static int copy_table_init(copy_table *t, size_t n)
{
    uint64_t cap = 16;
    while (cap < 2 * (uint64_t)n)
        cap *= 2;
    t->slot = calloc(cap, sizeof(uint32_t));
    t->mask = cap - 1;
    return t->slot ? 0 : -1;
}

/* The block an earlier item of w is gathering for item k's prefix (same
 * hash, parent and tokens), or KVHI_PREFIX_MISS, with *index its item: it
 * is not published until its gather ends, so the prefix index cannot say. */
static uint32_t earlier_copy(kvh_engine *e, const kvhi_pool_work *w, const copy_table *t, uint32_t k, uint32_t *index)
{
    const kvhi_pool_item *it = &w->items[k];
    for (uint64_t at = it->hash & t->mask; t->slot[at]; at = (at + 1) & t->mask) {
        const kvhi_pool_item *o = &w->items[t->slot[at] - 1];
        if (o->hash == it->hash && o->parent == it->parent &&
            memcmp(o->tokens, it->tokens, sizeof(int32_t) * e->cfg.block_tokens) == 0) {
            *index = t->slot[at] - 1;
            return o->block;
        }
    }
    return KVHI_PREFIX_MISS;
}

static void copy_table_add(copy_table *t, const kvhi_pool_work *w, uint32_t k)
{
    uint64_t at = w->items[k].hash & t->mask;
    while (t->slot[at])
        at = (at + 1) & t->mask;
    t->slot[at] = k + 1;
}

kvh_status kvh_pool_offload_batch(kvh_engine *e, kvh_pool pool, kvh_pool_xfer *xfers, size_t n, uint32_t agent,
                                  kvh_fence *fence)
{
    KVHI_REQUIRE(fence, "fence is NULL");
    size_t stride;
    kvhi_ext_pool *p;
    uint32_t *slots;
    const kvhi_slot_use read = {.write = false};
    kvh_status st = enter_batch(e, pool, xfers, n, read, &stride, &p, &slots);
    if (st != KVH_OK)
        return st;
    kvh_fence f;
    copy_table copies;
    kvhi_pool_work *w = kvhi_pool_work_new(e, KVHI_PW_OFFLOAD, (uint32_t)n, 1, &f);
    if (!w || copy_table_init(&copies, n) != 0) {
        if (w)
            kvhi_pool_work_discard(e, w);
        free(slots);
        kvhi_leave(e);
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for an offload batch of %zu items", n);
    }
    w->pool = p;
    p->batches++; /* block allocations may drop the lock: unregister waits */
    uint32_t bt = e->cfg.block_tokens;
    uint32_t min_tier = e->tiers[KVH_TIER_HOST].present ? KVH_TIER_HOST : KVH_TIER_DEVICE;
    uint32_t k = 0;
    for (; k < n && st == KVH_OK; k++) {
        kvh_pool_xfer *x = (kvh_pool_xfer *)xfer_at(xfers, stride, k);
        kvhi_pool_item *it = &w->items[k];
        int32_t *tokens = w->tokens + (size_t)k * bt;
        const int32_t *given = x->tokens; /* read once: checked, then copied */
        if (!given) {
            st = kvhi_fail(KVH_ERR_INVALID_ARG, "xfers[%u].tokens is NULL", k);
            break;
        }
        memcpy(tokens, given, sizeof(int32_t) * bt);
        it->slot = slots[k];
        it->tokens = tokens;
        it->parent = x->parent_hash;
        it->status = &x->status;
        uint64_t salt = kvhi_scope_salt(e->cfg.model_salt, x->scope);
        uint32_t b = kvhi_pool_find_cached(e, salt, x->parent_hash, tokens, &it->hash), first;
        if (b == KVHI_PREFIX_MISS && (b = earlier_copy(e, w, &copies, k, &first)) != KVHI_PREFIX_MISS) {
            kvhi_block_ref(e, b); /* the handle's, as a cached block's */
            it->shares = first + 1;
        }
        if (b != KVHI_PREFIX_MISS) {
            it->block = b;
            continue;
        }
        if ((st = kvhi_block_new(e, agent, min_tier, &b)) != KVH_OK)
            break;
        it->block = b;
        it->copy = true;
        copy_table_add(&copies, w, k);
        kvhi_block_ref(e, b); /* the work's, beside the handle's */
        kvhi_block_hold_reading(e, b);
        e->blocks[b].flags |= KVHI_BF_POOL_FILL;
    }
    p->batches--;
    free(copies.slot);
    if (st == KVH_OK && p->unregistered)
        st = kvhi_fail(KVH_ERR_BAD_HANDLE, "the pool was unregistered during the call");
    /* Making room may have dropped the lock: a restore may have taken a
     * slot since the first check. */
    for (size_t i = 0; i < n && st == KVH_OK; i++)
        st = kvhi_pool_slot_check(p, slots[i], read, i);
    free(slots);
    if (st != KVH_OK) {
        offload_undo(e, w, k);
        kvhi_pool_work_discard(e, w);
        if (p->batches == 0)
            pthread_cond_broadcast(&e->changed);
        return kvhi_api_leave(e, st);
    }
    for (size_t i = 0; i < n; i++) {
        kvh_pool_xfer *x = (kvh_pool_xfer *)xfer_at(xfers, stride, i);
        e->blocks[w->items[i].block].ext_refs++;
        x->block.id = kvhi_block_handle(e, w->items[i].block);
        x->status = KVH_OK;
        kvhi_pool_slot_enter(p, w->items[i].slot, read);
    }
    *fence = f;
    kvhi_pool_work_submit(e, w);
    return kvhi_api_leave(e, KVH_OK);
}

kvh_status kvh_pool_restore_batch(kvh_engine *e, kvh_pool pool, kvh_pool_xfer *xfers, size_t n, uint32_t first_layer,
                                  uint32_t n_layers, kvh_fence *layer_fences)
{
    KVHI_REQUIRE(layer_fences, "layer_fences is NULL");
    KVHI_REQUIRE(n_layers > 0, "n_layers is 0");
    size_t stride;
    kvhi_ext_pool *p;
    uint32_t *slots;
    const kvhi_slot_use write = {.write = true, .first_layer = first_layer, .n_layers = n_layers};
    kvh_status st = enter_batch(e, pool, xfers, n, write, &stride, &p, &slots);
    if (st != KVH_OK)
        return st;
    uint32_t *blocks = malloc(sizeof(uint32_t) * (n ? n : 1));
    if (st == KVH_OK && !blocks)
        st = kvhi_fail(KVH_ERR_NOMEM, "out of memory for a restore");
    for (size_t i = 0; i < n && st == KVH_OK; i++) {
        const kvh_pool_xfer *x = xfer_at(xfers, stride, i);
        if ((st = kvhi_block_resolve(e, x->block, &blocks[i])) != KVH_OK)
            break;
        if (e->blocks[blocks[i]].flags & KVHI_BF_POOL_FILL)
            st = kvhi_fail(KVH_ERR_INVALID_ARG,
                           "xfers[%zu]: the block is still being gathered (wait for its offload's fence)", i);
        else if (!kvhi_block_kv_complete(e, blocks[i]))
            st = kvhi_fail(KVH_ERR_INVALID_ARG, "xfers[%zu]: the block's KV is not fully written", i);
    }
    kvhi_pool_work *w = NULL;
    if (st == KVH_OK && !(w = kvhi_pool_work_new(e, KVHI_PW_RESTORE, (uint32_t)n, n_layers, layer_fences)))
        st = KVH_ERR_NOMEM;
    if (st != KVH_OK) {
        free(blocks);
        free(slots);
        return kvhi_api_leave(e, st);
    }
    w->pool = p;
    w->first_layer = first_layer;
    w->n_layers = n_layers;
    for (size_t i = 0; i < n; i++) {
        kvh_pool_xfer *x = (kvh_pool_xfer *)xfer_at(xfers, stride, i);
        kvhi_pool_item *it = &w->items[i];
        it->slot = slots[i];
        it->block = blocks[i];
        it->status = &x->status;
        x->status = KVH_OK;
        kvhi_block_ref(e, it->block);
        kvhi_block_hold_reading(e, it->block);
        kvhi_pool_slot_enter(p, it->slot, write);
    }
    free(blocks);
    free(slots);
    kvhi_pool_work_submit(e, w);
    return kvhi_api_leave(e, KVH_OK);
}

kvh_status kvh_blocks_persist(kvh_engine *e, const kvh_block *blocks, size_t n, kvh_fence *fence)
{
    KVHI_REQUIRE(blocks || n == 0, "blocks is NULL with n = %zu", n);
    KVHI_REQUIRE(n <= UINT32_MAX, "n = %zu blocks", n);
    kvh_status st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    if (!e->disk && !e->remote)
        st = kvhi_fail(KVH_ERR_UNSUPPORTED, "the engine has no disk or remote tier (set disk_path and disk_bytes, or "
                                            "remote_addrs)");
    uint32_t *idx = st == KVH_OK ? malloc(sizeof(uint32_t) * (n ? n : 1)) : NULL;
    if (st == KVH_OK && !idx)
        st = kvhi_fail(KVH_ERR_NOMEM, "out of memory for a persist");
    uint32_t bt = e->cfg.block_tokens;
    for (size_t i = 0; i < n && st == KVH_OK; i++) {
        if ((st = kvhi_block_resolve(e, blocks[i], &idx[i])) != KVH_OK)
            break;
        kvhi_block *blk = &e->blocks[idx[i]];
        bool filling = (blk->flags & KVHI_BF_POOL_FILL) != 0;
        if (!(blk->flags & KVHI_BF_HASHED) && !filling)
            st = kvhi_fail(KVH_ERR_INVALID_ARG, "blocks[%zu] holds %u of %u tokens (only full blocks persist)", i,
                           blk->n_tokens, bt);
        else if (!filling && !kvhi_block_kv_complete(e, idx[i]))
            st = kvhi_fail(KVH_ERR_INVALID_ARG, "blocks[%zu] has KV that was never written", i);
    }
    kvh_fence f = {0};
    kvhi_pool_work *w = NULL;
    if (st == KVH_OK && !(w = kvhi_pool_work_new(e, KVHI_PW_PERSIST, (uint32_t)n, fence ? 1 : 0, &f)))
        st = KVH_ERR_NOMEM;
    if (st != KVH_OK) {
        free(idx);
        return kvhi_api_leave(e, st);
    }
    for (size_t i = 0; i < n; i++) {
        w->items[i].block = idx[i];
        kvhi_block_ref(e, idx[i]);
    }
    free(idx);
    if (fence) {
        *fence = f;
        kvhi_pool_work_submit(e, w);
        return kvhi_api_leave(e, KVH_OK);
    }
    /* In the call: run it here and report what it found. */
    st = kvhi_pool_work_run_now(e, w);
    return kvhi_api_leave(e, st);
}
