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
kvh_status kvhi_pool_copy(kvh_engine *e, kvhi_ext_pool *p, uint32_t slot, uint32_t b, bool to_block);
kvh_status kvhi_pool_offload(kvh_engine *e, kvhi_ext_pool *p, uint32_t slot, uint64_t parent, const int32_t *tokens,
                             uint32_t agent, uint32_t *out);

#endif
