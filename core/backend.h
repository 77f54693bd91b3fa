/* Backend interface: memory and copies of the device tier.
 *
 * libkvh never links CUDA. The CPU backend is built in; the CUDA backend is
 * libkvh_cuda.so, loaded with dlopen, which exports one symbol,
 * kvh_backend_cuda_entry, returning a table of this shape. The table's
 * abi_version must equal KVHI_BACKEND_ABI or the backend is refused. */
#ifndef KVH_CORE_BACKEND_H
#define KVH_CORE_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/slab_layout.h"

#define KVHI_BACKEND_ABI 3u
#define KVHI_BACKEND_ENTRY "kvh_backend_cuda_entry"

enum kvhi_copy_kind {
    KVHI_COPY_HOST_TO_HOST = 0,
    KVHI_COPY_HOST_TO_DEVICE = 1,
    KVHI_COPY_DEVICE_TO_HOST = 2,
    KVHI_COPY_DEVICE_TO_DEVICE = 3
};

struct kvhi_attn_plan;
struct kvhi_attn_plan_opts;

typedef struct kvhi_backend_ops {
    uint32_t abi_version;
    const char *name; /* "cpu" or "cuda" */
    /* 1 when device memory is addressable by the CPU (no copy needed). */
    int device_is_host_memory;

    /* Probe device `device`; 0 when usable, else fills msg (the driver's
     * words, e.g. "CUDA driver version is insufficient") and returns -1. */
    int (*probe)(int device, char *msg, size_t msg_len);
    /* Per-engine context (a CUDA device selection, streams); may be NULL. */
    void *(*context_create)(int device, char *msg, size_t msg_len);
    void (*context_destroy)(void *ctx);

    /* Device-tier arena; NULL on failure. */
    void *(*device_alloc)(void *ctx, size_t bytes);
    void (*device_free)(void *ctx, void *ptr, size_t bytes);
    /* Host-tier memory, page-locked when the backend can DMA from it. */
    void *(*host_alloc)(void *ctx, size_t bytes);
    void (*host_free)(void *ctx, void *ptr, size_t bytes);

    /* Synchronous copy of n bytes; returns 0 or -1 with msg filled. Safe to
     * call from several threads at once (each uses its own stream). */
    int (*copy)(void *ctx, void *dst, const void *src, size_t n, enum kvhi_copy_kind kind, char *msg, size_t msg_len);
    /* Strided 2-D copy: rows of width bytes, `height` rows. */
    int (*copy_2d)(void *ctx, void *dst, size_t dst_pitch, const void *src, size_t src_pitch, size_t width,
                   size_t height, enum kvhi_copy_kind kind, char *msg, size_t msg_len);

    /* ---- paged attention (kernels/attention_plan.h) ----
     * Appended; a backend without kernels leaves them NULL and the
     * attention calls answer KVH_ERR_UNSUPPORTED.
     *
     * attention_plan_opts: the work split this backend wants (queries per
     * work unit, how many units to aim for, smallest split-K chunk);
     * `threads` is kvh_attention_params.threads. Called under the engine
     * lock: must not block.
     *
     * attention_run: runs a plan built on the CPU (libkvh owns *plan; the
     * backend copies what it needs before returning). q and out are host
     * memory on the CPU backend, device memory on CUDA; stream is the
     * caller's cudaStream_t (NULL = legacy default stream). Returns 0 when
     * the work is done or queued: done(done_arg) is then called exactly
     * once, after every kernel of the call has finished (the CPU backend
     * calls it before returning; CUDA from a host callback queued on the
     * stream after the kernels). Returns a negative kvh_status with msg
     * filled when nothing of the call is pending; done is then never
     * called. Called without the engine lock; done takes it.
     *
     * Consequence for every backend call: never call a device-wide
     * synchronizing CUDA function (cudaFree, cudaFreeHost,
     * cudaDeviceSynchronize, ...) while holding an engine lock, since a
     * pending done callback may be waiting for that lock.
     *
     * stream_sync: waits for everything queued on stream (tests and
     * benchmarks; 0 or -1 with msg). */
    void (*attention_plan_opts)(void *ctx, uint32_t threads, struct kvhi_attn_plan_opts *opts);
    int (*attention_run)(void *ctx, const struct kvhi_attn_plan *plan, const void *q, void *out, void *stream,
                         void (*done)(void *done_arg), void *done_arg, char *msg, size_t msg_len);
    int (*stream_sync)(void *ctx, void *stream, char *msg, size_t msg_len);

    /* ---- persistent plans (kvh_attention_plan) ----
     * Appended in ABI 2. NULL entries: the backend runs a kept plan from
     * host memory with attention_run (the CPU backend).
     *
     * attention_plan_upload: copies a plan's arrays where the kernels read
     * them (device memory on CUDA) and reserves its split-K scratch, once;
     * may allocate and synchronise; called without the engine lock.
     * [out] *handle. Returns 0 or a negative kvh_status with msg filled.
     *
     * attention_run_uploaded: launches the kernels of an uploaded plan on
     * stream, with q and out: no allocation, copy, synchronisation or host
     * callback, so a stream being captured into a CUDA graph records it
     * and the graph replays it. Returns 0 or a negative kvh_status.
     *
     * attention_plan_free: frees an uploaded plan; the caller guarantees no
     * launch or graph using it is still pending. May synchronise; called
     * without the engine lock. */
    int (*attention_plan_upload)(void *ctx, const struct kvhi_attn_plan *plan, void **handle, char *msg,
                                 size_t msg_len);
    int (*attention_run_uploaded)(void *ctx, void *handle, const void *q, void *out, void *stream, char *msg,
                                  size_t msg_len);
    void (*attention_plan_free)(void *ctx, void *handle);

    /* ---- unified memory ----
     * Appended in ABI 3; NULL means 0. 1 when this context's device-tier
     * memory is memory the CPU reads and writes directly (a GPU that uses
     * the host's page tables, as on Grace Hopper): device_alloc then
     * returns such memory, so moves between the device and host tiers are
     * plain CPU copies. 2 when it is moreover the host's own physical
     * memory (an integrated GPU): the two tiers can then be one arena and
     * moves between them no copy at all. Kernels still run on the device. */
    int (*memory_is_unified)(void *ctx);

    /* ---- virtual contiguity (kvh_seq_vmap) ----
     * Appended in ABI 3; NULL: the backend has no views.
     *
     * vmap_arena_create: makes the device tier of `bytes` (a whole number
     * of slabs of `layout`) as memory that views can map again: the CPU
     * a memory file, CUDA physical allocations of the VMM granularity
     * mapped into one reserved range. `backing` asks for "hugetlb", "thp",
     * "4k" or NULL (the best available). [out] *arena (freed by
     * vmap_arena_destroy, which also frees the memory), *base (the
     * tier's memory), *map_unit (bytes: what one mapping of a view must
     * be a multiple of, and aligned to), *backing_used (static text).
     * Returns 0 or a negative kvh_status with msg filled.
     *
     * vmap_reserve / vmap_unreserve: an address range of `bytes` aligned
     * to map_unit, nothing mapped (reads fault on the CPU).
     * vmap_map: maps bytes [arena_off, arena_off + bytes) of the arena at
     * dst, read-only; vmap_unmap: leaves [dst, dst + bytes) unmapped.
     * All multiples of map_unit. 0 or a negative kvh_status with msg. */
    int (*vmap_arena_create)(void *ctx, const kvhi_slab_layout *layout, uint64_t bytes, const char *backing,
                             void **arena, void **base, uint64_t *map_unit, const char **backing_used, char *msg,
                             size_t msg_len);
    void (*vmap_arena_destroy)(void *ctx, void *arena);
    int (*vmap_reserve)(void *ctx, void *arena, uint64_t bytes, void **base, char *msg, size_t msg_len);
    void (*vmap_unreserve)(void *ctx, void *arena, void *base, uint64_t bytes);
    int (*vmap_map)(void *ctx, void *arena, void *dst, uint64_t arena_off, uint64_t bytes, char *msg, size_t msg_len);
    int (*vmap_unmap)(void *ctx, void *arena, void *dst, uint64_t bytes, char *msg, size_t msg_len);
} kvhi_backend_ops;

typedef const kvhi_backend_ops *(*kvhi_backend_entry_fn)(void);

/* The built-in CPU backend. */
const kvhi_backend_ops *kvhi_backend_cpu(void);

/* Loads the CUDA backend (dlopen). Returns NULL with msg filled when it is
 * missing, refuses, or no device answers. */
const kvhi_backend_ops *kvhi_backend_cuda_load(int device, char *msg, size_t msg_len, void **dl);
void kvhi_backend_cuda_unload(void *dl);

#endif
