/* Exported block, migration, fence, prefix and pool calls. */
#include <stdlib.h>
#include <string.h>

#include "abi/api_params.h"
#include "core/block_state.h"
#include "core/move.h"
#include "core/ext_pool.h"
#include "core/block.h"
#include "core/migrate.h"
#include "core/seq.h"
#include "core/scope.h"

kvh_status kvh_block_info_get(kvh_engine *e, kvh_block block, kvh_block_info *info)
{
    KVHI_REQUIRE(info, "info is NULL");
    uint32_t size;
    kvh_status st = kvhi_info_size(info, KVHI_STRUCT_SIZE_MIN, sizeof(*info), "kvh_block_info", &size);
    if (st != KVH_OK)
        return st;
    st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    uint32_t b;
    if ((st = kvhi_block_resolve(e, block, &b)) == KVH_OK) {
        kvhi_block *blk = &e->blocks[b];
        kvh_block_info r = {.struct_size = sizeof(kvh_block_info),
                            .tier = blk->tier,
                            .slot = blk->slot,
                            .refs = blk->refs - (e->upload_refs ? e->upload_refs[b] : 0),
                            .pins = blk->pins,
                            .holds = blk->holds,
                            .tokens = blk->n_tokens,
                            .agent = blk->agent,
                            .published = (blk->flags & KVHI_BF_PUBLISHED) != 0,
                            .in_flight = kvhi_block_in_flight(blk),
                            .hash = (blk->flags & KVHI_BF_HASHED) ? blk->hash : 0,
                            .tolerance = blk->tolerance};
        kvhi_write_info(info, size, &r);
    }
    return kvhi_api_leave(e, st);
}

kvh_status kvh_block_alloc(kvh_engine *e, uint32_t agent, kvh_block *block)
{
    KVHI_REQUIRE(block, "block out-parameter is NULL");
    kvh_status st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    st = kvhi_block_new_handle(e, agent, &block->id);
    /* The detail stays as the entry cleared it: a tier without room
     * before one with puts back what it found (core/block.c). Not
     * cleared again on this hot path. */
    kvhi_leave(e);
    return st;
}

kvh_status kvh_block_retain(kvh_engine *e, kvh_block block)
{
    kvh_status st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    uint32_t b;
    if ((st = kvhi_block_resolve(e, block, &b)) == KVH_OK) {
        if (e->blocks[b].refs == UINT32_MAX)
            st = kvhi_fail(KVH_ERR_RANGE, "reference count overflow");
        else {
            kvhi_block_ref_handle(e, b);
        }
    }
    return kvhi_api_leave(e, st);
}

kvh_status kvh_block_release(kvh_engine *e, kvh_block block)
{
    if (!e)
        return kvhi_api_enter(e); /* refuses a NULL engine */
    if (block.id == 0) {
        kvhi_clear_error(); /* a success, like any other */
        return KVH_OK;
    }
    /* A forged index is bounds-checked there and refused below. The
     * record is needed only when the backlog applies this release
     * (core/block.h), by which time it has arrived. */
    uint32_t b = kvhi_handle_unpack_index(block.id, e->block_index_bits);
    kvhi_block_release_key_prefetch(e, b);
    kvhi_block_prefetch(e, b);
    kvh_status st = kvhi_enter_keep_backlog(e);
    if (st != KVH_OK)
        return st;
    /* The newest block's record is still in the cache (an alloc and
     * release in turn): the backlog would only add to its cost. */
    if (b != e->block_newest && kvhi_block_release_trusted(e, block, b)) {
        kvhi_leave(e); /* nothing here can fail: the entry's clear stands */
        return KVH_OK;
    }
    if (e->release_backlog_len)
        kvhi_block_releases_apply(e);
    if ((st = kvhi_block_resolve(e, block, &b)) == KVH_OK) {
        /* Only references taken through handles can be released here; the
         * ones sequences hold are theirs. */
        kvhi_block *blk = &e->blocks[b];
        if (blk->ext_refs == 0)
            st = kvhi_fail(KVH_ERR_INVALID_ARG, "no reference taken through a block handle is left to release");
        else {
            blk->ext_refs--;
            kvhi_block_release_key_lower(e, b, blk->ext_refs);
            kvhi_block_unref(e, b);
        }
    }
    return kvhi_api_leave(e, st);
}

kvh_status kvh_block_pin(kvh_engine *e, kvh_block block, int32_t pinned)
{
    kvh_status st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    uint32_t b;
    if ((st = kvhi_block_resolve(e, block, &b)) == KVH_OK && pinned) {
        kvhi_block_settle_for_pin(e, b);
        st = kvhi_block_resolve(e, block, &b); /* the lock may have been dropped */
    }
    if (st == KVH_OK)
        st = kvhi_block_pin_handle(e, b, pinned != 0);
    return kvhi_api_leave(e, st);
}

kvh_status kvh_migrate(kvh_engine *e, const kvh_block *blocks, size_t n, uint32_t tier, kvh_fence *fence)
{
    KVHI_REQUIRE(blocks || n == 0, "blocks is NULL");
    kvh_status st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    uint32_t *idx = malloc(sizeof(uint32_t) * (n ? n : 1));
    if (!idx) {
        kvhi_leave(e);
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory");
    }
    for (size_t i = 0; i < n && st == KVH_OK; i++)
        st = kvhi_block_resolve(e, blocks[i], &idx[i]);
    kvh_fence f;
    if (st == KVH_OK)
        st = kvhi_migrate_blocks(e, idx, n, tier, fence ? &f : NULL);
    kvhi_api_leave(e, st);
    free(idx);
    if (st == KVH_OK && fence)
        *fence = f;
    return st;
}

static kvh_status fence_resolve(kvh_engine *e, kvh_fence fence, uint32_t *idx)
{
    kvhi_fence *f = kvhi_handles_get(&e->fences, fence.id, idx);
    if (!f || f->user_freed)
        return kvhi_fail(KVH_ERR_BAD_HANDLE, "stale or unknown fence 0x%llx", (unsigned long long)fence.id);
    return KVH_OK;
}

kvh_status kvh_fence_wait(kvh_engine *e, kvh_fence fence, uint64_t timeout_ns)
{
    kvh_status st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    uint32_t idx;
    if ((st = fence_resolve(e, fence, &idx)) == KVH_OK)
        st = kvhi_fence_wait_idx(e, idx, timeout_ns);
    return kvhi_api_leave(e, st);
}

kvh_status kvh_fence_poll(kvh_engine *e, kvh_fence fence, int32_t *done)
{
    KVHI_REQUIRE(done, "done is NULL");
    kvh_status st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    uint32_t idx;
    if ((st = fence_resolve(e, fence, &idx)) == KVH_OK)
        st = kvhi_fence_poll_idx(e, idx, done);
    return kvhi_api_leave(e, st);
}

kvh_status kvh_fence_free(kvh_engine *e, kvh_fence fence)
{
    if (fence.id == 0 && e) {
        kvhi_clear_error();
        return KVH_OK;
    }
    kvh_status st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    uint32_t idx;
    if ((st = fence_resolve(e, fence, &idx)) == KVH_OK)
        kvhi_fence_drop(e, idx);
    return kvhi_api_leave(e, st);
}

static kvh_status prefix_hash(kvh_engine *e, uint64_t salt, uint64_t parent, const int32_t *tokens, size_t n,
                              uint64_t *hash)
{
    kvhi_clear_error();
    KVHI_REQUIRE(e && tokens && hash, "engine, tokens and hash must not be NULL");
    if (n != e->cfg.block_tokens)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "a block hash covers block_tokens=%u tokens, got %zu",
                         e->cfg.block_tokens, n);
    *hash = kvhi_prefix_hash(parent, tokens, n, salt);
    return KVH_OK;
}

kvh_status kvh_prefix_hash(kvh_engine *e, uint64_t parent, const int32_t *tokens, size_t n, uint64_t *hash)
{
    return prefix_hash(e, e ? e->cfg.model_salt : 0, parent, tokens, n, hash);
}

kvh_status kvh_prefix_hash_scoped(kvh_engine *e, uint64_t scope, uint64_t parent, const int32_t *tokens, size_t n,
                                  uint64_t *hash)
{
    return prefix_hash(e, e ? kvhi_scope_salt(e->cfg.model_salt, scope) : 0, parent, tokens, n, hash);
}

static kvh_status prefix_lookup(kvh_engine *e, const kvhi_scope *sc, const int32_t *tokens, size_t n, kvh_block *out,
                                size_t cap, size_t *n_blocks)
{
    KVHI_REQUIRE(tokens || n == 0, "tokens is NULL");
    KVHI_REQUIRE((out || cap == 0) && n_blocks, "out and n_blocks must not be NULL");
    kvh_status st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    size_t found;
    kvhi_prefix_lookup(e, sc, tokens, n, out, cap, &found);
    kvhi_api_leave(e, KVH_OK);
    *n_blocks = found;
    return KVH_OK;
}

kvh_status kvh_prefix_lookup(kvh_engine *e, const int32_t *tokens, size_t n, kvh_block *out, size_t cap,
                             size_t *n_blocks)
{
    return prefix_lookup(e, NULL, tokens, n, out, cap, n_blocks);
}

kvh_status kvh_prefix_lookup_scoped(kvh_engine *e, uint64_t scope, uint64_t shared_scope, uint64_t shared_tokens,
                                    const int32_t *tokens, size_t n, kvh_block *out, size_t cap, size_t *n_blocks)
{
    kvhi_scope sc = {.scope = scope, .shared_scope = shared_scope, .shared_tokens = shared_tokens};
    return prefix_lookup(e, &sc, tokens, n, out, cap, n_blocks);
}

kvh_status kvh_pool_register(kvh_engine *e, const kvh_pool_layout *layout, kvh_pool *pool)
{
    KVHI_REQUIRE(layout && pool, "layout and pool must not be NULL");
    /* Every field of a layout is needed: no shorter one is taken. */
    kvh_status st = kvhi_struct_size_check(layout->struct_size, sizeof(*layout), sizeof(*layout), "kvh_pool_layout");
    if (st != KVH_OK)
        return st;
    KVHI_REQUIRE(layout->k_base && layout->v_base, "k_base and v_base must not be NULL");
    KVHI_REQUIRE(layout->num_slots > 0, "num_slots is 0");
    KVHI_REQUIRE(layout->memory <= KVH_MEMORY_CUDA, "unknown memory kind %u", layout->memory);
    st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    size_t row = (size_t)e->cfg.head_dim * e->elem_bytes;
    if (layout->memory == KVH_MEMORY_CUDA && e->cpu_kernels)
        st = kvhi_fail(KVH_ERR_UNSUPPORTED, "CUDA pool memory needs the CUDA backend (engine uses %s)",
                       e->backend->name);
    else if (layout->token_stride < row || layout->head_stride < row)
        st = kvhi_fail(KVH_ERR_INVALID_ARG, "token_stride and head_stride must be >= head_dim * element size (%zu)",
                       row);
    else {
        /* The farthest byte a copy touches, from a base pointer: where
         * that wraps around the address range, copies would address
         * other memory than the layout describes. */
        uint64_t extent = row, part;
        bool wraps = __builtin_mul_overflow((uint64_t)(layout->num_slots - 1), layout->slot_stride, &part) ||
                     __builtin_add_overflow(extent, part, &extent) ||
                     __builtin_mul_overflow((uint64_t)(e->cfg.block_tokens - 1), layout->token_stride, &part) ||
                     __builtin_add_overflow(extent, part, &extent) ||
                     __builtin_mul_overflow((uint64_t)(e->cfg.num_kv_heads - 1), layout->head_stride, &part) ||
                     __builtin_add_overflow(extent, part, &extent);
        for (uint32_t l = 0; l < e->cfg.num_layers && st == KVH_OK; l++) {
            uintptr_t end;
            if (!layout->k_base[l] || !layout->v_base[l])
                st = kvhi_fail(KVH_ERR_INVALID_ARG, "layer %u has a NULL base pointer", l);
            else if (wraps || __builtin_add_overflow((uintptr_t)layout->k_base[l], (uintptr_t)extent, &end) ||
                     __builtin_add_overflow((uintptr_t)layout->v_base[l], (uintptr_t)extent, &end) ||
                     extent > UINTPTR_MAX)
                st = kvhi_fail(KVH_ERR_INVALID_ARG,
                               "layer %u: num_slots, slot_stride, token_stride and head_stride wrap around the "
                               "address range",
                               l);
        }
    }
    kvh_pool p;
    if (st == KVH_OK && (st = kvhi_pool_register(e, layout, &p)) == KVH_OK)
        *pool = p;
    return kvhi_api_leave(e, st);
}

kvh_status kvh_pool_unregister(kvh_engine *e, kvh_pool pool)
{
    if (pool.id == 0 && e) {
        kvhi_clear_error();
        return KVH_OK;
    }
    kvh_status st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    uint32_t idx;
    kvhi_ext_pool *p = kvhi_handles_get(&e->pools, pool.id, &idx);
    if (!p)
        st = kvhi_fail(KVH_ERR_BAD_HANDLE, "stale or unknown pool 0x%llx", (unsigned long long)pool.id);
    else
        kvhi_pool_unregister(e, p, idx);
    return kvhi_api_leave(e, st);
}

/* A call's use of its slot: every layer, read or written. */
static kvhi_slot_use slot_use_of(const kvh_engine *e, bool write)
{
    kvhi_slot_use u = {.write = write, .first_layer = 0, .n_layers = e->cfg.num_layers};
    return u;
}

/* Enters e for a transfer that reads (write false) or writes slot of pool. */
static kvh_status enter_pool(kvh_engine *e, kvh_pool pool, uint32_t slot, bool write, kvhi_ext_pool **out)
{
    kvh_status st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    kvhi_ext_pool *p = kvhi_handles_get(&e->pools, pool.id, NULL);
    if (!p)
        st = kvhi_fail(KVH_ERR_BAD_HANDLE, "stale or unknown pool 0x%llx", (unsigned long long)pool.id);
    else if (slot >= p->layout.num_slots)
        st = kvhi_fail(KVH_ERR_RANGE, "slot %u >= num_slots %u", slot, p->layout.num_slots);
    else
        st = kvhi_pool_slot_check(p, slot, slot_use_of(e, write), 0);
    if (st != KVH_OK) {
        return kvhi_api_leave(e, st);
    }
    p->calls++; /* the call may drop the lock: unregister waits (leave_pool) */
    kvhi_pool_slot_enter(p, slot, slot_use_of(e, write));
    *out = p;
    return KVH_OK;
}

/* Gives back what enter_pool took and leaves e with the call's status. */
static kvh_status leave_pool(kvh_engine *e, kvhi_ext_pool *p, uint32_t slot, bool write, kvh_status st)
{
    kvhi_pool_slot_leave(p, slot, slot_use_of(e, write));
    if (--p->calls == 0 && p->unregistered)
        pthread_cond_broadcast(&e->changed);
    return kvhi_api_leave(e, st);
}

static kvh_status pool_offload(kvh_engine *e, kvh_pool pool, uint32_t slot, uint64_t scope, uint64_t parent_hash,
                               const int32_t *tokens, size_t n, uint32_t agent, kvh_block *block)
{
    KVHI_REQUIRE(tokens && block, "tokens and block must not be NULL");
    kvhi_ext_pool *p;
    kvh_status st = enter_pool(e, pool, slot, false, &p);
    if (st != KVH_OK)
        return st;
    uint32_t b;
    if (n != e->cfg.block_tokens)
        st = kvhi_fail(KVH_ERR_INVALID_ARG, "offload takes a full block of %u tokens, got %zu", e->cfg.block_tokens, n);
    else if ((st = kvhi_pool_offload(e, p, slot, kvhi_scope_salt(e->cfg.model_salt, scope), parent_hash, tokens, agent,
                                     &b)) == KVH_OK) {
        e->blocks[b].ext_refs++;
        block->id = kvhi_block_handle(e, b);
    }
    return leave_pool(e, p, slot, false, st);
}

kvh_status kvh_pool_offload(kvh_engine *e, kvh_pool pool, uint32_t slot, uint64_t parent_hash, const int32_t *tokens,
                            size_t n, uint32_t agent, kvh_block *block)
{
    return pool_offload(e, pool, slot, 0, parent_hash, tokens, n, agent, block);
}

kvh_status kvh_pool_offload_scoped(kvh_engine *e, kvh_pool pool, uint32_t slot, uint64_t scope, uint64_t parent_hash,
                                   const int32_t *tokens, size_t n, uint32_t agent, kvh_block *block)
{
    return pool_offload(e, pool, slot, scope, parent_hash, tokens, n, agent, block);
}

kvh_status kvh_pool_restore(kvh_engine *e, kvh_pool pool, kvh_block block, uint32_t slot)
{
    kvhi_ext_pool *p;
    kvh_status st = enter_pool(e, pool, slot, true, &p);
    if (st != KVH_OK)
        return st;
    uint32_t b;
    if ((st = kvhi_block_resolve(e, block, &b)) == KVH_OK)
        st = kvhi_pool_restore(e, p, b, slot);
    return leave_pool(e, p, slot, true, st);
}
