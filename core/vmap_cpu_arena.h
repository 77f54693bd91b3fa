/* The CPU backend's view entries (kvhi_backend_ops.vmap_*), in
 * vmap_cpu_arena.c. */
#ifndef KVH_CORE_VMAP_CPU_ARENA_H
#define KVH_CORE_VMAP_CPU_ARENA_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/slab_layout.h"

/* 1 when `name` ("hugetlb", "thp", "4k") can back a tier of `bytes` in
 * `layout` on this machine now. */
int kvhi_vmap_cpu_backing_available(const char *name, const kvhi_slab_layout *layout, uint64_t bytes);

int kvhi_vmap_cpu_arena_create(void *ctx, const kvhi_slab_layout *layout, uint64_t bytes, const char *backing,
                               void **arena, void **base, uint64_t *map_unit, const char **backing_used, char *msg,
                               size_t len);
void kvhi_vmap_cpu_arena_destroy(void *ctx, void *arena);
int kvhi_vmap_cpu_reserve(void *ctx, void *arena, uint64_t bytes, void **base, char *msg, size_t len);
void kvhi_vmap_cpu_unreserve(void *ctx, void *arena, void *base, uint64_t bytes);
int kvhi_vmap_cpu_map(void *ctx, void *arena, void *dst, uint64_t off, uint64_t bytes, char *msg, size_t len);
int kvhi_vmap_cpu_unmap(void *ctx, void *arena, void *dst, uint64_t bytes, char *msg, size_t len);

#endif
