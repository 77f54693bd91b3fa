/* Views of virtual contiguity: a view is an address range reserved by
 * the backend into which, for one layer, each kv head's K and V pieces of
 * the sequence's blocks are mapped again from the device tier's arena
 * (mmap MAP_FIXED of the memory file on the CPU, cuMemMap on CUDA). The
 * view's layout is [K,V][head][token][head_dim], the same as a contiguous
 * KV array, so the attention kernels read it as a single block of
 * capacity_tokens tokens.
 *
 * The arena is in slab layout (kernels/slab_layout.h): one head's pieces
 * of neighbouring slots are adjacent, so a run of logical blocks in
 * neighbouring slots of one slab is one mapping per head (not one per
 * block), and where the backend maps only whole units larger than a
 * piece (2 MiB huge pages, the CUDA VMM granularity) a unit of logical
 * blocks placed in slab order is one mapping per head. A unit not in slab
 * order cannot be viewed there (KVH_ERR_UNSUPPORTED).
 *
 * A view holds its blocks (kvhi_block_hold): they cannot leave the device
 * tier, so a mapped slot always holds the block recorded for it while
 * that block lives. What changes under a view is the sequence's block
 * table (append, copy-on-write, truncate, free); the view records block,
 * generation and slot per logical block and remaps only what differs. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/block_state.h"
#include "core/vmap.h"
#include "core/block.h"
#include "core/seq.h"

/* Bytes of one head's K (or V) in one block: a piece. */
static uint64_t chunk_bytes(kvh_engine *e) { return (uint64_t)e->cfg.block_tokens * e->vector_bytes; }

/* Logical blocks per mapping unit (1 when a piece is whole units). */
static uint32_t unit_blocks(kvh_engine *e)
{
    uint64_t c = chunk_bytes(e);
    return e->vmap_unit > c ? (uint32_t)(e->vmap_unit / c) : 1;
}

static void unhold_entry(kvh_engine *e, kvhi_vmap *v, uint32_t i)
{
    uint32_t b = v->blk[i];
    if (b == KVHI_NO_BLOCK)
        return;
    kvhi_block *blk = &e->blocks[b];
    if (blk->gen == v->gen[i] && (blk->flags & KVHI_BF_LIVE) && blk->holds > 0)
        kvhi_block_unhold(e, b);
    v->blk[i] = KVHI_NO_BLOCK;
}

/* Maps n logical blocks from i, whose first sits in `slot` and the rest in
 * the slots after it in one slab (slot == KVHI_NO_BLOCK: unmaps them):
 * one call per kv head and K/V. */
static kvh_status map_run(kvh_engine *e, kvhi_vmap *v, uint32_t i, uint32_t n, uint32_t slot)
{
    uint64_t chunk = chunk_bytes(e), H = e->cfg.num_kv_heads, len = (uint64_t)n * chunk;
    char msg[256] = "";
    for (uint32_t kv = 0; kv < 2; kv++)
        for (uint32_t h = 0; h < H; h++) {
            uint8_t *dst = v->base + (kv * H + h) * v->head_stride + (uint64_t)i * chunk;
            int rc;
            if (slot == KVHI_NO_BLOCK)
                rc = e->backend->vmap_unmap(e->backend_ctx, e->vmap_arena, dst, len, msg, sizeof(msg));
            else {
                uint64_t piece = ((uint64_t)v->layer * 2 + kv) * H + h;
                rc = e->backend->vmap_map(e->backend_ctx, e->vmap_arena, dst,
                                          kvhi_slab_piece_offset(&e->slab, slot, piece), len, msg, sizeof(msg));
            }
            if (rc != 0)
                return kvhi_fail(rc < 0 ? rc : KVH_ERR_NOMEM, "mapping blocks %u..%u into the view: %s", i, i + n - 1,
                                 msg);
        }
    return KVH_OK;
}

/* True when logical block j can follow j - 1 in one mapping. */
static bool slab_next(kvh_engine *e, uint32_t prev_slot, uint32_t slot)
{
    return slot == prev_slot + 1 && (slot >> e->slab.slab_shift) == (prev_slot >> e->slab.slab_shift);
}

/* True when logical block i of s is what the view maps. */
static bool entry_current(kvh_engine *e, const kvhi_vmap *v, const kvhi_seq *s, uint32_t i)
{
    uint32_t b = s->blocks[i];
    const kvhi_block *blk = &e->blocks[b];
    return v->blk[i] == b && v->gen[i] == blk->gen && v->slot[i] == blk->slot && blk->tier == KVH_TIER_DEVICE;
}

bool kvhi_vmap_current(kvh_engine *e, const kvhi_vmap *v)
{
    kvhi_seq *s;
    if (kvhi_seq_get(e, v->seq, &s) != KVH_OK)
        return false;
    if (s->n_blocks != v->n_mapped || s->n_tokens != v->n_tokens)
        return false;
    for (uint32_t i = 0; i < s->n_blocks; i++)
        if (!entry_current(e, v, s, i))
            return false;
    return true;
}

/* Records logical block i as mapped to its block b. */
static void record(kvh_engine *e, kvhi_vmap *v, uint32_t i, uint32_t b)
{
    if (i < v->n_mapped)
        unhold_entry(e, v, i);
    kvhi_block_hold(e, b);
    v->blk[i] = b;
    v->gen[i] = e->blocks[b].gen;
    v->slot[i] = e->blocks[b].slot;
}

/* Maps the changed logical blocks [i, j) of s (every one in the device
 * tier): runs of neighbouring slots, or whole units in slab order. */
static kvh_status map_changed(kvh_engine *e, kvhi_vmap *v, const kvhi_seq *s, uint32_t i, uint32_t j)
{
    uint32_t U = unit_blocks(e);
    if (U == 1) {
        while (i < j) {
            uint32_t n = 1, slot = e->blocks[s->blocks[i]].slot;
            while (i + n < j && slab_next(e, e->blocks[s->blocks[i + n - 1]].slot, e->blocks[s->blocks[i + n]].slot))
                n++;
            kvh_status st = map_run(e, v, i, n, slot);
            if (st != KVH_OK)
                return st;
            for (uint32_t k = i; k < i + n; k++)
                record(e, v, k, s->blocks[k]);
            if (i + n > v->n_mapped)
                v->n_mapped = i + n;
            i += n;
        }
        return KVH_OK;
    }
    /* Whole units: the unit's present blocks must sit in one slab, in
     * order, from a unit-aligned slot. The unit is mapped whole; slots
     * past the sequence's last block show whatever they hold (the view
     * defines only its first n_tokens tokens). */
    for (uint32_t u0 = i / U * U; u0 < j; u0 += U) {
        uint32_t end = u0 + U < s->n_blocks ? u0 + U : s->n_blocks;
        uint32_t first = e->blocks[s->blocks[u0]].slot;
        bool ordered = first % U == 0;
        for (uint32_t k = u0 + 1; k < end && ordered; k++)
            ordered = slab_next(e, e->blocks[s->blocks[k - 1]].slot, e->blocks[s->blocks[k]].slot);
        if (!ordered)
            return kvhi_fail(KVH_ERR_UNSUPPORTED,
                             "blocks %u..%u of the sequence are not in slab order, which a view with %llu-byte "
                             "mappings (%s) needs",
                             u0, end - 1, (unsigned long long)e->vmap_unit, e->vmap_backing);
        kvh_status st = map_run(e, v, u0, U, first);
        if (st != KVH_OK)
            return st;
        for (uint32_t k = u0; k < end; k++)
            record(e, v, k, s->blocks[k]);
        if (end > v->n_mapped)
            v->n_mapped = end;
    }
    return KVH_OK;
}

/* Room for n per-block records. They grow with the sequence instead of
 * being sized for cap_tokens up front: a view of a short sequence with a
 * capacity of 2^31 tokens would otherwise allocate and fill gigabytes. */
static int reserve_entries(kvhi_vmap *v, uint32_t n)
{
    if (n <= v->n_entries)
        return 0;
    uint32_t want = v->n_entries ? v->n_entries : 4;
    while (want < n)
        want *= 2;
    uint32_t *blk = realloc(v->blk, sizeof(uint32_t) * want);
    if (blk)
        v->blk = blk;
    uint32_t *gen = blk ? realloc(v->gen, sizeof(uint32_t) * want) : NULL;
    if (gen)
        v->gen = gen;
    uint32_t *slot = gen ? realloc(v->slot, sizeof(uint32_t) * want) : NULL;
    if (!slot)
        return -1;
    v->slot = slot;
    for (uint32_t i = v->n_entries; i < want; i++) {
        v->blk[i] = KVHI_NO_BLOCK;
        v->gen[i] = v->slot[i] = 0;
    }
    v->n_entries = want;
    return 0;
}

void kvhi_vmap_wait_unused(kvh_engine *e, kvhi_vmap *v)
{
    while (v->pending)
        pthread_cond_wait(&e->changed, &e->lock);
}

void kvhi_vmap_attention_done(void *arg)
{
    kvhi_vmap *v = arg;
    kvh_engine *e = v->engine;
    pthread_mutex_lock(&e->lock);
    v->pending--;
    pthread_cond_broadcast(&e->changed);
    kvhi_leave(e);
}

/* Lock held. */
static kvh_status refresh(kvh_engine *e, kvhi_vmap *v, bool *changed)
{
    kvhi_vmap_wait_unused(e, v);
    kvhi_seq *s;
    kvh_status st = kvhi_seq_get(e, v->seq, &s);
    if (st != KVH_OK)
        return kvhi_fail(st, "the view's sequence was freed");
    /* Let copies of its blocks finish, then find the changed runs. A wait
     * drops the lock, and a block already passed may start a move
     * meanwhile: passes repeat until one finds none in flight, so that
     * with the lock kept from there no block is mapped and held while a
     * move of it runs (a hold stops moves only when they begin). */
    for (bool waited = true; waited;) {
        waited = false;
        for (uint32_t i = 0; i < s->n_blocks; i++)
            while (kvhi_block_in_flight(&e->blocks[s->blocks[i]])) {
                kvhi_block_wait_idle(e, s->blocks[i]);
                waited = true;
            }
        if (waited && (st = kvhi_seq_get(e, v->seq, &s)) != KVH_OK) /* looked up afresh after the lock was out */
            return kvhi_fail(st, "the view's sequence was freed");
    }
    if (s->n_tokens > v->cap_tokens)
        return kvhi_fail(KVH_ERR_RANGE, "the sequence has %llu tokens; the view holds %llu",
                         (unsigned long long)s->n_tokens, (unsigned long long)v->cap_tokens);
    if (reserve_entries(v, s->n_blocks) != 0)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for a view of %u blocks", s->n_blocks);
    bool any = false;
    for (uint32_t i = 0; i < s->n_blocks && st == KVH_OK;) {
        if (i < v->n_mapped && entry_current(e, v, s, i)) {
            i++;
            continue;
        }
        uint32_t j = i;
        while (j < s->n_blocks && !(j < v->n_mapped && entry_current(e, v, s, j))) {
            if (e->blocks[s->blocks[j]].tier != KVH_TIER_DEVICE) {
                st = kvhi_fail(KVH_ERR_NOT_RESIDENT, "block %u of the sequence is not in the device tier (acquire it)",
                               j);
                break;
            }
            j++;
        }
        if (st == KVH_OK && j > i) {
            st = map_changed(e, v, s, i, j);
            any = true;
        }
        i = j;
    }
    if (st == KVH_OK) {
        uint32_t U = unit_blocks(e);
        if (s->n_blocks < v->n_mapped) {
            for (uint32_t i = s->n_blocks; i < v->n_mapped; i++)
                unhold_entry(e, v, i);
            /* Units still partly in use stay mapped. */
            uint32_t from = (s->n_blocks + U - 1) / U * U, to = (v->n_mapped + U - 1) / U * U;
            if (to > from)
                map_run(e, v, from, to - from, KVHI_NO_BLOCK);
            any = true;
        }
        v->n_mapped = s->n_blocks;
        if (v->n_tokens != s->n_tokens)
            any = true;
        v->n_tokens = s->n_tokens;
    } else if (any) {
        /* Partly remapped: stale until a refresh succeeds. */
        v->n_tokens = UINT64_MAX;
    }
    if (any)
        v->generation++;
    if (changed)
        *changed = any;
    return st;
}

kvhi_vmap *kvhi_vmap_resolve(kvh_engine *e, const kvh_vmap *v)
{
    return kvhi_handles_get(&e->vmaps, kvhi_handle_from_ptr(v), NULL);
}

static kvh_status bad_view(void)
{
    return kvhi_fail(KVH_ERR_BAD_HANDLE, "the view is released, forged or of another engine");
}

static void vmap_destroy(kvh_engine *e, kvhi_vmap *v)
{
    for (uint32_t i = 0; i < v->n_mapped; i++)
        unhold_entry(e, v, i);
    if (v->base)
        e->backend->vmap_unreserve(e->backend_ctx, e->vmap_arena, v->base, v->range_bytes);
    free(v->blk);
    free(v->gen);
    free(v->slot);
    free(v);
}

void kvhi_vmap_engine_free(kvh_engine *e)
{
    for (uint32_t i = 0; i < e->vmaps.cap; i++) {
        kvhi_vmap *v = kvhi_handles_at(&e->vmaps, i);
        if (v) {
            kvhi_handles_remove(&e->vmaps, i);
            vmap_destroy(e, v);
        }
    }
    kvhi_handles_destroy(&e->vmaps);
}

bool kvhi_vmap_overlaps(kvh_engine *e, const void *p, size_t bytes)
{
    uintptr_t lo = (uintptr_t)p, hi = lo + bytes;
    for (uint32_t i = 0; i < e->vmaps.cap; i++) {
        const kvhi_vmap *v = kvhi_handles_at(&e->vmaps, i);
        if (v && v->base && lo < (uintptr_t)v->base + v->range_bytes && (uintptr_t)v->base < hi)
            return true;
    }
    return false;
}

kvh_status kvhi_vmap_create(kvh_engine *e, kvhi_seq *s, kvh_seq seq, uint32_t layer, uint64_t capacity_tokens,
                            kvh_vmap **out)
{
    kvh_status st = KVH_OK;
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE), bt = e->cfg.block_tokens, unit = e->vmap_unit;
    kvhi_vmap *v = NULL;
    /* Mapping units of a page: a piece must be whole pages. Larger units
     * (huge pages, CUDA VMM): whole pieces per unit, units per slab. */
    bool pieces_fit = !unit          ? false
                      : unit <= page ? chunk_bytes(e) % unit == 0
                                     : unit % chunk_bytes(e) == 0 && kvhi_slab_pitch(&e->slab) % unit == 0;
    if (!e->vmap_arena)
        st = kvhi_fail(KVH_ERR_UNSUPPORTED, "the engine was opened without kvh_config.vmap");
    else if (!pieces_fit)
        st = kvhi_fail(KVH_ERR_UNSUPPORTED,
                       "one head's K of a block is %llu bytes, which %s mappings of %llu bytes cannot hold "
                       "(views map whole pages: use more block_tokens, a larger head_dim or dtype)",
                       (unsigned long long)chunk_bytes(e), e->vmap_backing, (unsigned long long)unit);
    else if (layer >= e->cfg.num_layers)
        st = kvhi_fail(KVH_ERR_RANGE, "layer %u >= num_layers %u", layer, e->cfg.num_layers);
    else if (capacity_tokens > (1ull << 31))
        st = kvhi_fail(KVH_ERR_RANGE, "capacity_tokens %llu > 2^31", (unsigned long long)capacity_tokens);
    else if (capacity_tokens && capacity_tokens < s->n_tokens)
        st = kvhi_fail(KVH_ERR_RANGE, "the sequence has %llu tokens, more than capacity_tokens %llu",
                       (unsigned long long)s->n_tokens, (unsigned long long)capacity_tokens);
    if (st != KVH_OK)
        goto done;
    uint64_t cap = bt;
    while (cap < capacity_tokens || cap < s->n_tokens || (cap * e->vector_bytes) % unit != 0)
        cap <<= 1;
    if (cap > (1ull << 31)) {
        st = kvhi_fail(KVH_ERR_RANGE, "the sequence is too long for a view");
        goto done;
    }
    v = calloc(1, sizeof(*v));
    if (!v) {
        st = kvhi_fail(KVH_ERR_NOMEM, "out of memory for a view");
        goto done;
    }
    v->seq = seq;
    v->engine = e;
    v->layer = layer;
    v->cap_tokens = cap;
    v->head_stride = cap * e->vector_bytes;
    v->range_bytes = 2ull * e->cfg.num_kv_heads * v->head_stride;
    void *base = NULL;
    char msg[256] = "";
    int rc = e->backend->vmap_reserve(e->backend_ctx, e->vmap_arena, v->range_bytes, &base, msg, sizeof(msg));
    if (rc != 0) {
        st = kvhi_fail(rc < 0 ? rc : KVH_ERR_NOMEM, "cannot reserve %llu bytes of address space for a view: %s",
                       (unsigned long long)v->range_bytes, msg);
        goto done;
    }
    v->base = base;
    st = refresh(e, v, NULL);
    /* Listed only once complete: no call can name a view half made. */
    uint64_t id = 0;
    if (st == KVH_OK && kvhi_handles_add(&e->vmaps, v, &id, NULL) != 0)
        st = kvhi_fail(KVH_ERR_NOMEM, "out of memory for a view (or 2^24 of them exist)");
    if (st == KVH_OK) {
        uintptr_t lo = (uintptr_t)v->base, hi = lo + v->range_bytes;
        if (!s->n_views || lo < s->view_lo)
            s->view_lo = lo;
        if (!s->n_views || hi > s->view_hi)
            s->view_hi = hi;
        s->n_views++;
        *out = kvhi_handle_to_ptr(id);
        v = NULL;
    }
done:
    if (v)
        vmap_destroy(e, v);
    return st;
}

kvh_status kvhi_vmap_refresh(kvh_engine *e, kvh_vmap *vmap, bool *changed)
{
    kvhi_vmap *v = kvhi_vmap_resolve(e, vmap);
    if (!v)
        return bad_view();
    /* A refresh is a call on its sequence too (@threads handle (vmap and
     * seq)) and drops the lock while it walks it: it takes the sequence's
     * owner claim, as the sequence calls do (abi/api_common.h). */
    kvhi_seq *s = NULL;
    if (kvhi_seq_get(e, v->seq, &s) == KVH_OK) {
        if (s->owner_in_call)
            return kvhi_fail(KVH_ERR_BUSY,
                             "sequence 0x%llx is in use by another call: calls on one sequence must not overlap",
                             (unsigned long long)v->seq.id);
        s->owner_in_call = true;
    }
    kvhi_clear_error();
    kvh_status st = refresh(e, v, changed);
    if (s)
        s->owner_in_call = false;
    return st;
}

kvh_status kvhi_vmap_view_get(kvh_engine *e, const kvh_vmap *vmap, kvh_vmap_view *view)
{
    const kvhi_vmap *v = kvhi_vmap_resolve(e, vmap);
    if (!v)
        return bad_view();
    *view = (kvh_vmap_view){.struct_size = sizeof(*view),
                            .layer = v->layer,
                            .n_tokens = v->n_tokens == UINT64_MAX ? 0 : v->n_tokens,
                            .capacity_tokens = v->cap_tokens,
                            .head_stride = v->head_stride,
                            .k = v->base,
                            .v = v->base + (uint64_t)e->cfg.num_kv_heads * v->head_stride,
                            .generation = v->generation,
                            .backing = e->vmap_backing,
                            .map_unit = e->vmap_unit};
    return KVH_OK;
}

kvh_status kvhi_vmap_release(kvh_engine *e, kvh_vmap *vmap)
{
    uint32_t index;
    kvhi_vmap *v = kvhi_handles_get(&e->vmaps, kvhi_handle_from_ptr(vmap), &index);
    if (!v)
        return bad_view();
    /* Out of the table first: no new attention call finds the view. */
    kvhi_handles_remove(&e->vmaps, index);
    kvhi_seq *s = NULL;
    if (kvhi_seq_get(e, v->seq, &s) == KVH_OK && s->n_views && --s->n_views == 0)
        s->view_lo = s->view_hi = 0;
    kvhi_vmap_wait_unused(e, v);
    vmap_destroy(e, v);
    return KVH_OK;
}
