/* The backend of an engine whose device tier views can map
 * (kvh_config.vmap): the device tier is a slab-layout arena made by the
 * backend's vmap_arena_create, and the engine talks to the backend through
 * a forwarding table whose copies translate the engine's logical device
 * addresses (slot * block_bytes, as in the plain layout) into the arena's
 * physical slab layout (kernels/slab_layout.h). Everything else is
 * forwarded unchanged. */
#ifndef KVH_CORE_VMAP_BACKEND_H
#define KVH_CORE_VMAP_BACKEND_H

#include "core/engine.h"

/* Makes the device tier's arena of `slots` slots (a multiple of
 * e->slab's slab_blocks) as a view arena and installs the forwarding backend:
 * fills e->vmap_arena, e->vmap_unit, e->vmap_backing and [out] *base.
 * Returns KVH_ERR_UNSUPPORTED (no views on this backend, or a backing
 * forced with KVH_VMAP_BACKING is not available), KVH_ERR_NOMEM. */
kvh_status kvhi_vmap_arena_alloc(kvh_engine *e, uint64_t slots, uint8_t **base);

/* The slab layout for a device tier of at most max_slots slots. */
void kvhi_vmap_layout(kvh_engine *e, uint64_t max_slots, kvhi_slab_layout *out);

#endif
