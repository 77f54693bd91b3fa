/* Virtual contiguity on the CPU: the device tier is one memfd mapped
 * shared, and a view is a reserved address range into which each block's
 * per-head K and V pages for one layer are mapped (mmap MAP_FIXED of the
 * memfd at the block's offset). The view's layout is [K,V][head][token]
 * [head_dim], the same as a contiguous KV array, so the attention kernels
 * read it as a single block of capacity_tokens tokens.
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
#include <sys/mman.h>
#include <unistd.h>

#include "abi/api_common.h"
#include "core/vmap.h"

void *kvhi_vmap_arena_alloc(kvh_engine *e, size_t bytes)
{
    int fd = memfd_create("kvh-device-tier", MFD_CLOEXEC);
    if (fd < 0) {
        kvhi_fail(KVH_ERR_NOMEM, "memfd_create for the device tier failed: %s", strerror(errno));
        return NULL;
    }
    if (ftruncate(fd, (off_t)bytes) != 0) {
        kvhi_fail(KVH_ERR_NOMEM, "cannot size the device tier file to %zu bytes: %s", bytes, strerror(errno));
        close(fd);
        return NULL;
    }
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        kvhi_fail(KVH_ERR_NOMEM, "cannot map the device tier file: %s", strerror(errno));
        close(fd);
        return NULL;
    }
    e->vmap_fd = fd;
    return p;
}

/* Bytes of one head's K (or V) in one block: the unit a view maps. */
static uint64_t chunk_bytes(kvh_engine *e)
{
    return (uint64_t)e->cfg.block_tokens * e->vector_bytes;
}

static void unhold_entry(kvh_engine *e, kvh_vmap *v, uint32_t i)
{
    uint32_t b = v->blk[i];
    if (b == KVHI_NO_BLOCK)
        return;
    kvhi_block *blk = &e->blocks[b];
    if (blk->gen == v->gen[i] && (blk->flags & KVHI_BF_LIVE) && blk->holds > 0)
        kvhi_block_unhold(e, b);
    v->blk[i] = KVHI_NO_BLOCK;
}

/* Maps (slot != KVHI_NO_BLOCK) or unmaps logical block i of the view. */
static int map_entry(kvh_engine *e, kvh_vmap *v, uint32_t i, uint32_t slot)
{
    uint64_t chunk = chunk_bytes(e), H = e->cfg.num_kv_heads;
    for (uint32_t kv = 0; kv < 2; kv++)
        for (uint32_t h = 0; h < H; h++) {
            uint8_t *dst = v->base + (kv * H + h) * v->head_stride + (uint64_t)i * chunk;
            void *r;
            if (slot == KVHI_NO_BLOCK) {
                r = mmap(dst, chunk, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
            } else {
                off_t off = (off_t)((uint64_t)slot * e->block_bytes + (uint64_t)v->layer * e->layer_bytes +
                                    (kv * H + h) * chunk);
                r = mmap(dst, chunk, PROT_READ, MAP_SHARED | MAP_FIXED, e->vmap_fd, off);
            }
            if (r == MAP_FAILED)
                return -errno;
        }
    return 0;
}

/* True when logical block i of s is what the view maps. */
static bool entry_current(kvh_engine *e, const kvh_vmap *v, const kvhi_seq *s, uint32_t i)
{
    uint32_t b = s->blocks[i];
    const kvhi_block *blk = &e->blocks[b];
    return v->blk[i] == b && v->gen[i] == blk->gen && v->slot[i] == blk->slot && blk->tier == KVH_TIER_DEVICE;
}

bool kvhi_vmap_current(kvh_engine *e, const kvh_vmap *v)
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

/* Lock held. */
static kvh_status refresh(kvh_engine *e, kvh_vmap *v, bool *changed)
{
    kvhi_seq *s;
    kvh_status st = kvhi_seq_get(e, v->seq, &s);
    if (st != KVH_OK)
        return kvhi_fail(st, "the view's sequence was freed");
    if (s->n_tokens > v->cap_tokens)
        return kvhi_fail(KVH_ERR_RANGE, "the sequence has %llu tokens; the view holds %llu",
                         (unsigned long long)s->n_tokens, (unsigned long long)v->cap_tokens);
    bool any = false;
    for (uint32_t i = 0; i < s->n_blocks; i++) {
        uint32_t b = s->blocks[i];
        kvhi_block *blk = &e->blocks[b];
        /* Let a copy of it finish (the lock is dropped meanwhile). */
        while (blk->flags & KVHI_BF_IN_FLIGHT)
            kvhi_block_wait_idle(e, b);
        if (i < v->n_mapped && entry_current(e, v, s, i))
            continue;
        if (blk->tier != KVH_TIER_DEVICE) {
            st = kvhi_fail(KVH_ERR_NOT_RESIDENT, "block %u of the sequence is not in the device tier (acquire it)",
                           i);
            break;
        }
        int rc = map_entry(e, v, i, blk->slot);
        if (rc != 0) {
            st = kvhi_fail(KVH_ERR_NOMEM, "mapping block %u into the view: %s", i, strerror(-rc));
            break;
        }
        if (i < v->n_mapped)
            unhold_entry(e, v, i);
        kvhi_block_hold(e, b);
        v->blk[i] = b;
        v->gen[i] = blk->gen;
        v->slot[i] = blk->slot;
        any = true;
        if (i >= v->n_mapped)
            v->n_mapped = i + 1;
    }
    if (st == KVH_OK) {
        for (uint32_t i = s->n_blocks; i < v->n_mapped; i++) {
            unhold_entry(e, v, i);
            map_entry(e, v, i, KVHI_NO_BLOCK);
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

static void vmap_destroy(kvh_engine *e, kvh_vmap *v)
{
    for (uint32_t i = 0; i < v->n_mapped; i++)
        unhold_entry(e, v, i);
    if (v->base)
        munmap(v->base, v->range_bytes);
    if (v->prev)
        v->prev->next = v->next;
    else if (e->vmaps == v)
        e->vmaps = v->next;
    if (v->next)
        v->next->prev = v->prev;
    free(v->blk);
    free(v->gen);
    free(v->slot);
    free(v);
}

void kvhi_vmap_engine_free(kvh_engine *e)
{
    while (e->vmaps)
        vmap_destroy(e, e->vmaps);
    if (e->vmap_fd >= 0)
        close(e->vmap_fd);
    e->vmap_fd = -1;
}

kvh_status kvh_seq_vmap(kvh_engine *e, kvh_seq seq, uint32_t layer, uint64_t capacity_tokens, kvh_vmap **out)
{
    kvhi_clear_error();
    KVHI_REQUIRE(out, "vmap is NULL");
    kvhi_seq *s;
    kvh_status st = kvhi_api_enter_seq(e, seq, &s);
    if (st != KVH_OK)
        return st;
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE), bt = e->cfg.block_tokens;
    kvh_vmap *v = NULL;
    if (e->vmap_fd < 0)
        st = kvhi_fail(KVH_ERR_UNSUPPORTED, "the engine was opened without kvh_config.vmap");
    else if (chunk_bytes(e) % page != 0)
        st = kvhi_fail(KVH_ERR_UNSUPPORTED,
                       "one head's K of a block is %llu bytes, not a multiple of the %llu-byte page: views map "
                       "whole pages (use more block_tokens, a larger head_dim or dtype)",
                       (unsigned long long)chunk_bytes(e), (unsigned long long)page);
    else if (layer >= e->cfg.num_layers)
        st = kvhi_fail(KVH_ERR_RANGE, "layer %u >= num_layers %u", layer, e->cfg.num_layers);
    else if (capacity_tokens > (1ull << 31))
        st = kvhi_fail(KVH_ERR_RANGE, "capacity_tokens %llu > 2^31", (unsigned long long)capacity_tokens);
    if (st != KVH_OK)
        goto done;
    uint64_t cap = bt;
    while (cap < capacity_tokens || cap < s->n_tokens)
        cap <<= 1;
    if (cap > (1ull << 31)) {
        st = kvhi_fail(KVH_ERR_RANGE, "the sequence is too long for a view");
        goto done;
    }
    uint32_t max_blocks = (uint32_t)(cap / bt);
    v = calloc(1, sizeof(*v));
    if (v) {
        v->blk = malloc(sizeof(uint32_t) * max_blocks);
        v->gen = calloc(max_blocks, sizeof(uint32_t));
        v->slot = calloc(max_blocks, sizeof(uint32_t));
    }
    if (!v || !v->blk || !v->gen || !v->slot) {
        st = kvhi_fail(KVH_ERR_NOMEM, "out of memory for a view");
        goto done;
    }
    for (uint32_t i = 0; i < max_blocks; i++)
        v->blk[i] = KVHI_NO_BLOCK;
    v->seq = seq;
    v->layer = layer;
    v->cap_tokens = cap;
    v->head_stride = cap * e->vector_bytes;
    v->range_bytes = 2ull * e->cfg.num_kv_heads * v->head_stride;
    void *base = mmap(NULL, v->range_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) {
        st = kvhi_fail(KVH_ERR_NOMEM, "cannot reserve %llu bytes of address space for a view",
                       (unsigned long long)v->range_bytes);
        goto done;
    }
    v->base = base;
    v->next = e->vmaps;
    if (e->vmaps)
        e->vmaps->prev = v;
    e->vmaps = v;
    st = refresh(e, v, NULL);
    if (st == KVH_OK) {
        *out = v;
        v = NULL;
    }
done:
    if (v) {
        if (v->base)
            vmap_destroy(e, v);
        else {
            free(v->blk);
            free(v->gen);
            free(v->slot);
            free(v);
        }
    }
    kvhi_leave(e);
    return st;
}

kvh_status kvh_vmap_refresh(kvh_engine *e, kvh_vmap *v, int32_t *changed)
{
    kvhi_clear_error();
    KVHI_REQUIRE(v, "vmap is NULL");
    kvh_status st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    bool any = false;
    st = refresh(e, v, &any);
    kvhi_leave(e);
    if (changed && st == KVH_OK)
        *changed = any;
    return st;
}

kvh_status kvh_vmap_get(kvh_engine *e, const kvh_vmap *v, kvh_vmap_view *view)
{
    kvhi_clear_error();
    KVHI_REQUIRE(e && v && view, "engine, vmap and view must not be NULL");
    if (view->struct_size != sizeof(kvh_vmap_view))
        return kvhi_fail(KVH_ERR_STRUCT_SIZE, "kvh_vmap_view struct_size %u, this library knows %zu",
                         view->struct_size, sizeof(kvh_vmap_view));
    kvh_vmap_view r = {.struct_size = sizeof(r),
                       .layer = v->layer,
                       .n_tokens = v->n_tokens == UINT64_MAX ? 0 : v->n_tokens,
                       .capacity_tokens = v->cap_tokens,
                       .head_stride = v->head_stride,
                       .k = v->base,
                       .v = v->base + (uint64_t)e->cfg.num_kv_heads * v->head_stride,
                       .generation = v->generation};
    *view = r;
    return KVH_OK;
}

kvh_status kvh_vmap_release(kvh_engine *e, kvh_vmap *v)
{
    kvhi_clear_error();
    if (!v)
        return KVH_OK;
    kvh_status st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    vmap_destroy(e, v);
    kvhi_leave(e);
    return KVH_OK;
}
