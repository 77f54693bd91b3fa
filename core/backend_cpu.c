/* The built-in CPU backend: the device tier is an ordinary memory arena. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "core/backend.h"
#include "core/huge_alloc.h"
#include "core/vmap_cpu_arena.h"
#include "kernels/cpu/attn_cpu.h"

static int cpu_probe(int device, char *msg, size_t len) { return 0; }
static void *cpu_context_create(int device, char *msg, size_t len) { return NULL; }
static void cpu_context_destroy(void *ctx) {}

/* Anonymous mappings: lazily backed, and eligible for transparent huge
 * pages, which keeps TLB misses down on big arenas and makes first touch
 * one fault per 2 MiB instead of 512 (a weight switch allocates and
 * touches a whole model). */
static void *cpu_alloc(void *ctx, size_t bytes) { return kvhi_map_anon(bytes); }

static void cpu_free(void *ctx, void *p, size_t bytes)
{
    if (p)
        munmap(p, bytes);
}

static int cpu_copy(void *ctx, void *dst, const void *src, size_t n, enum kvhi_copy_kind kind, char *msg, size_t len)
{
    memcpy(dst, src, n);
    return 0;
}

static int cpu_copy_2d(void *ctx, void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                       enum kvhi_copy_kind kind, char *msg, size_t len)
{
    for (size_t r = 0; r < height; r++)
        memcpy((char *)dst + r * dpitch, (const char *)src + r * spitch, width);
    return 0;
}

/* CPU attention runs synchronously: nothing is ever left on a "stream". */
static int cpu_stream_sync(void *ctx, void *stream, char *msg, size_t len) { return 0; }

static const kvhi_backend_ops cpu_ops = {
    .abi_version = KVHI_BACKEND_ABI,
    .name = "cpu",
    .device_is_host_memory = 1,
    .probe = cpu_probe,
    .context_create = cpu_context_create,
    .context_destroy = cpu_context_destroy,
    .device_alloc = cpu_alloc,
    .device_free = cpu_free,
    .host_alloc = cpu_alloc,
    .host_free = cpu_free,
    .copy = cpu_copy,
    .copy_2d = cpu_copy_2d,
    .attention_plan_opts = kvhi_attn_cpu_plan_opts,
    .attention_run = kvhi_attn_cpu_run,
    .stream_sync = cpu_stream_sync,
    .vmap_arena_create = kvhi_vmap_cpu_arena_create,
    .vmap_arena_destroy = kvhi_vmap_cpu_arena_destroy,
    .vmap_reserve = kvhi_vmap_cpu_reserve,
    .vmap_unreserve = kvhi_vmap_cpu_unreserve,
    .vmap_map = kvhi_vmap_cpu_map,
    .vmap_unmap = kvhi_vmap_cpu_unmap,
};

const kvhi_backend_ops *kvhi_backend_cpu(void) { return &cpu_ops; }
