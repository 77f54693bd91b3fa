/* Views of virtual contiguity (vmap.c), shared with the attention entry
 * that reads them (abi/api_vmap_attention.c). */
#ifndef KVH_CORE_VMAP_H
#define KVH_CORE_VMAP_H

#include <stdbool.h>
#include <stdint.h>

#include "core/engine.h"
#include "core/seq.h"

/* What a kvh_vmap * names: its value is a handle of e->vmaps
 * (core/handles.h), never this struct's address. */
typedef struct kvhi_vmap {
    kvh_seq seq;
    uint32_t layer;
    uint32_t n_mapped;   /* logical blocks mapped */
    uint64_t n_tokens;   /* the sequence's length at the last refresh
                            (UINT64_MAX after a refresh failed half way) */
    uint64_t cap_tokens; /* a power of two, >= block_tokens */
    uint64_t head_stride;
    uint64_t range_bytes;
    uint64_t generation;
    uint8_t *base;
    kvh_engine *engine;
    /* Attention calls queued over the view and not finished (CUDA runs
     * them after the call returns): refresh and release wait for 0, since
     * unmapping does not wait for kernels still reading (lock held). */
    uint32_t pending;
    /* Per logical block (n_entries of them, grown as the sequence grows,
     * up to cap_tokens / block_tokens): the block mapped there, its
     * generation and slot when mapped. */
    uint32_t *blk, *gen, *slot;
    uint32_t n_entries;
} kvhi_vmap;

/* The live view v names in e, or NULL (lock held). */
kvhi_vmap *kvhi_vmap_resolve(kvh_engine *e, const kvh_vmap *v);
/* The calls on views (lock held; s, of handle seq, claimed by the
 * caller). Create, refresh and release may drop the lock: while the
 * view is in use by attention, its blocks are being copied, or blocks
 * are brought to the device tier. */
kvh_status kvhi_vmap_create(kvh_engine *e, kvhi_seq *s, kvh_seq seq, uint32_t layer, uint64_t capacity_tokens,
                            kvh_vmap **out);
kvh_status kvhi_vmap_refresh(kvh_engine *e, kvh_vmap *vmap, bool *changed);
kvh_status kvhi_vmap_view_get(kvh_engine *e, const kvh_vmap *vmap, kvh_vmap_view *view);
kvh_status kvhi_vmap_release(kvh_engine *e, kvh_vmap *vmap);

/* True when [p, p + bytes) overlaps the address range of a live view
 * (lock held; one view after another: for the rare buffer that may be
 * one). */
bool kvhi_vmap_overlaps(kvh_engine *e, const void *p, size_t bytes);

/* Waits, with the lock dropped meanwhile, until no attention queued over
 * v is running (lock held). */
void kvhi_vmap_wait_unused(kvh_engine *e, kvhi_vmap *v);

/* The completion callback of an attention call over view arg (a
 * kvhi_vmap *): drops its pending count and the call's registration
 * (kvhi_leave). Takes the lock. */
void kvhi_vmap_attention_done(void *arg);

/* True when the view maps exactly the sequence's current blocks (lock
 * held). */
bool kvhi_vmap_current(kvh_engine *e, const kvhi_vmap *v);

/* Releases every view still open (lock not needed: no call is active);
 * the arena goes with the device tier (vmap_backend.c). */
void kvhi_vmap_engine_free(kvh_engine *e);

#endif
