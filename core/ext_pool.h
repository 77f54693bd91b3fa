/* External KV pools registered by an inference engine. */
#ifndef KVH_CORE_EXT_POOL_H
#define KVH_CORE_EXT_POOL_H

#include <stdbool.h>

#include "core/engine.h"

typedef struct kvhi_ext_pool {
    kvh_pool_layout layout; /* k_base/v_base cleared: see below */
    void **k_base;          /* num_layers pointers, owned copies */
    void **v_base;
    /* Batches queued or running on it (core/pool_batch.c): unregistering
     * waits for them, and one that starts after it fails its items. */
    uint32_t batches;
    /* Synchronous calls inside with it (kvh_pool_offload*, kvh_pool_restore),
     * which may drop the lock half way: unregistering waits for them too. */
    uint32_t calls;
    /* Per slot, the transfers running on it: how many read it (offloads,
     * every layer), and which layers restores write (a bit per layer, or
     * per group of adjacent layers past 64); NULL until the first
     * transfer. A transfer that would read a slot being written, or write
     * layers being read or written, is refused: its copy would tear the
     * other's KV, and a torn offload would be published. */
    uint32_t *slot_readers;
    uint64_t *slot_writing;
    uint32_t num_layers;
    bool unregistered;
} kvhi_ext_pool;

/* A transfer on one slot: a read of every layer, or a write of layers
 * [first_layer, first_layer + n_layers). */
typedef struct kvhi_slot_use {
    bool write;
    uint32_t first_layer, n_layers;
} kvhi_slot_use;

/* KVH_OK when transfer u may run on slot of p now; else KVH_ERR_BUSY
 * naming it as item (KVH_ERR_NOMEM: no slot table). */
kvh_status kvhi_pool_slot_check(kvhi_ext_pool *p, uint32_t slot, kvhi_slot_use u, size_t item);
/* Counts transfer u on slot in (checked first) or out. */
void kvhi_pool_slot_enter(kvhi_ext_pool *p, uint32_t slot, kvhi_slot_use u);
void kvhi_pool_slot_leave(kvhi_ext_pool *p, uint32_t slot, kvhi_slot_use u);

kvh_status kvhi_pool_register(kvh_engine *e, const kvh_pool_layout *layout, kvh_pool *out);
/* Frees p, the pool at index of e->pools, once no batch or call uses it
 * (drops the lock while waiting). */
void kvhi_pool_unregister(kvh_engine *e, kvhi_ext_pool *p, uint32_t index);
/* Copies block b (any tier, KV complete) into slot of p. Drops the lock
 * when b is read from disk: the caller counts itself in p->calls. */
kvh_status kvhi_pool_restore(kvh_engine *e, kvhi_ext_pool *p, uint32_t b, uint32_t slot);
/* The block of (parent, tokens) already cached in salt's scope, with one
 * more reference, or KVHI_PREFIX_MISS. */
uint32_t kvhi_pool_find_cached(kvh_engine *e, uint64_t salt, uint64_t parent, const int32_t *tokens, uint64_t *hash);
/* The block of (parent, tokens), found or made from slot of p: [out] *out
 * with one more reference. It is published under kvhi_prefix_hash(parent,
 * tokens, salt), salt the scope's (kvhi_scope_salt), so the dedupe finds
 * only that scope's blocks. May drop the lock (making room for it): the
 * caller counts itself in p->calls. */
kvh_status kvhi_pool_offload(kvh_engine *e, kvhi_ext_pool *p, uint32_t slot, uint64_t salt, uint64_t parent,
                             const int32_t *tokens, uint32_t agent, uint32_t *out);
/* Seals block b after its gather: tokens, hashes, KV complete, published. */
void kvhi_pool_seal(kvh_engine *e, uint32_t b, uint64_t hash, uint64_t parent, const int32_t *tokens);

void kvhi_pools_destroy(kvh_engine *e);

/* ---- one block's copy to or from a pool (core/move_pool.c) ---- */
typedef struct kvhi_pool_span {
    uint8_t *data;      /* the block's bytes in raw form: its slot or raw */
    uint8_t *raw;       /* bounce buffer of a block in an encoded tier */
    uint8_t *tier_data; /* the block's slot in its tier */
    uint32_t tier;
    enum kvhi_copy_kind kind;
} kvhi_pool_span;

/* Lock held, b held: describes the copy (allocates a bounce buffer for an
 * encoded tier). */
kvh_status kvhi_pool_span_prepare(kvh_engine *e, const kvhi_ext_pool *p, uint32_t b, bool to_block, kvhi_pool_span *s);
/* With or without the lock (b held): the encoded block into the bounce
 * buffer, before a restore's copies. 0 or -1. */
int kvhi_pool_span_decode(kvh_engine *e, kvhi_pool_span *s);
/* With or without the lock: layers [first_layer, first_layer + n_layers)
 * between slot of p and the block. 0, or -1 with msg set. */
int kvhi_pool_span_copy(kvh_engine *e, const kvhi_ext_pool *p, uint32_t slot, const kvhi_pool_span *s, bool to_block,
                        uint32_t first_layer, uint32_t n_layers, char *msg, size_t msg_len);
/* Ends a span: encodes a gathered block into its tier (when copied) and
 * frees the bounce buffer. 0 or -1. */
int kvhi_pool_span_finish(kvh_engine *e, kvhi_pool_span *s, bool to_block, bool copied);

#endif
