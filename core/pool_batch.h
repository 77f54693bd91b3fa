/* Batched, asynchronous transfers between kvh's blocks and an external
 * pool, and persists of block lists (core/pool_batch.c). The exported
 * calls (abi/api_pool_batch.c) validate and take what a batch needs under
 * the lock, queue it, and return; a migration worker runs it with the
 * copies outside the lock and completes its fences. */
#ifndef KVH_CORE_POOL_BATCH_H
#define KVH_CORE_POOL_BATCH_H

#include "core/engine.h"
#include "core/ext_pool.h"

enum kvhi_pool_work_kind { KVHI_PW_OFFLOAD, KVHI_PW_RESTORE, KVHI_PW_PERSIST };

typedef struct kvhi_pool_item {
    uint32_t slot;
    uint32_t block;
    bool copy;          /* offload: a new block to gather (else a cached one) */
    uint32_t shares;    /* offload: 1 + the item whose copy it shares (the
                           same prefix earlier in the batch); 0: none */
    kvh_status st;      /* this item's outcome so far */
    kvh_status *status; /* the caller's, written before the fences complete */
    uint64_t hash, parent;
    const int32_t *tokens; /* offload: block_tokens ids in the work's copy */
    kvhi_pool_span span;
} kvhi_pool_item;

typedef struct kvhi_pool_work {
    struct kvhi_pool_work *next;
    uint32_t kind;       /* enum kvhi_pool_work_kind */
    kvhi_ext_pool *pool; /* NULL for a persist */
    uint32_t n;
    kvhi_pool_item *items;
    int32_t *tokens; /* offload: n * block_tokens, copied from the caller */
    uint32_t first_layer, n_layers;
    uint32_t n_fences;
    uint32_t *fences; /* fence indices: one, or one per layer (restore) */
} kvhi_pool_work;

/* A work of n items (and n_fences fences, created here and expecting one
 * completion each; handles written to fence_handles), or NULL (no memory,
 * the error set). */
kvhi_pool_work *kvhi_pool_work_new(kvh_engine *e, uint32_t kind, uint32_t n, uint32_t n_fences,
                                   kvh_fence *fence_handles);
/* Frees a work that was never queued, dropping its fences. */
void kvhi_pool_work_discard(kvh_engine *e, kvhi_pool_work *w);
/* Queues w for a worker, or runs it now when there is none. Lock held. */
void kvhi_pool_work_submit(kvh_engine *e, kvhi_pool_work *w);
/* Runs w in the calling thread; its first failure (the error set). */
kvh_status kvhi_pool_work_run_now(kvh_engine *e, kvhi_pool_work *w);
/* Worker side: runs the oldest queued work (drops the lock for copies). */
void kvhi_pool_work_run_next(kvh_engine *e);
/* Engine close: every queued work ends with KVH_ERR_CLOSED. Lock held. */
void kvhi_pool_work_cancel_all(kvh_engine *e);

#endif
