/* External KV pools registered by an inference engine. */
#ifndef KVH_CORE_EXT_POOL_H
#define KVH_CORE_EXT_POOL_H

#include <stdbool.h>

#include "core/engine.h"

typedef struct kvhi_ext_pool {
    kvh_pool_layout layout; /* k_base/v_base cleared: see below */
    void **k_base;          /* num_layers pointers, owned copies */
    void **v_base;
} kvhi_ext_pool;

kvh_status kvhi_pool_register(kvh_engine *e, const kvh_pool_layout *layout, kvh_pool *out);
/* Frees p, the pool at index of e->pools. */
void kvhi_pool_unregister(kvh_engine *e, kvhi_ext_pool *p, uint32_t index);
/* Copies block b (any tier, KV complete) into slot of p. Drops the lock
 * when b is read from disk. */
kvh_status kvhi_pool_restore(kvh_engine *e, kvhi_ext_pool *p, uint32_t b, uint32_t slot);
/* The block of (parent, tokens), found or made from slot of p: [out] *out
 * with one more reference. It is published under kvhi_prefix_hash(parent,
 * tokens, salt), salt the scope's (kvhi_scope_salt), so the dedupe finds
 * only that scope's blocks. May drop the lock (making room for it). */
kvh_status kvhi_pool_offload(kvh_engine *e, kvhi_ext_pool *p, uint32_t slot, uint64_t salt, uint64_t parent,
                             const int32_t *tokens, uint32_t agent, uint32_t *out);

void kvhi_pools_destroy(kvh_engine *e);

#endif
