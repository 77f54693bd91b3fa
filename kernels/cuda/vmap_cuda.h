/* The CUDA backend's view entries (kvhi_backend_ops.vmap_*, core/backend.h)
 * on the driver's virtual memory management API, in vmap_cuda.cu.
 *
 * The caller (backend_cuda.cu) makes the arena's device current around
 * every call. Returns are 0 or a negative kvh_status with msg filled. */
#ifndef KVH_KERNELS_CUDA_VMAP_CUDA_H
#define KVH_KERNELS_CUDA_VMAP_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/slab_layout.h"

typedef struct kvhc_vmm_arena kvhc_vmm_arena;

/* The backing name views on CUDA report (kvh_vmap_view.backing). */
#define KVHC_VMM_BACKING "cuda-vmm"

int kvhc_vmm_arena_create(int device, const kvhi_slab_layout *layout, uint64_t bytes, const char *backing,
                          kvhc_vmm_arena **arena, void **base, uint64_t *map_unit, const char **backing_used, char *msg,
                          size_t len);
void kvhc_vmm_arena_destroy(kvhc_vmm_arena *arena);
int kvhc_vmm_reserve(kvhc_vmm_arena *arena, uint64_t bytes, void **base, char *msg, size_t len);
void kvhc_vmm_unreserve(kvhc_vmm_arena *arena, void *base, uint64_t bytes);
int kvhc_vmm_map(kvhc_vmm_arena *arena, void *dst, uint64_t arena_off, uint64_t bytes, char *msg, size_t len);
int kvhc_vmm_unmap(kvhc_vmm_arena *arena, void *dst, uint64_t bytes, char *msg, size_t len);

#endif
