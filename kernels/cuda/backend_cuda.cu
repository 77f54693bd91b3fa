/* The CUDA backend of kvh (kvhi_backend_ops, core/backend.h): device-tier
 * memory, page-locked host-tier memory and synchronous copies between them.
 *
 * Built as libkvh_cuda.so and loaded by libkvh with dlopen, so libkvh never
 * links CUDA. cudart is linked statically and the only exported symbol is
 * kvh_backend_cuda_entry (visibility preset + kvh_cuda.map).
 *
 * Errors: a failing CUDA call gives -1 and "<call>: <cudaGetErrorString>
 * (<cudaGetErrorName>)" in msg, and the thread's last-error state is
 * cleared so it does not surface in the application's cudaGetLastError().
 *
 * Current device: the calling thread may be an application thread working
 * on another GPU, so every entry point selects the context's device for the
 * call and puts the caller's device back afterwards (device_scope).
 *
 * Views (kvh_seq_vmap) use the driver's virtual memory management API:
 * vmap_cuda.cu.
 *
 * Global state: none. Streams are pooled per context (struct cuda_ctx), not
 * cached per thread, so nothing has to be cleaned up when a thread exits
 * and nothing outlives context_destroy. */
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "core/backend.h"
}
#include "kvh/kvh.h"
#include "kernels/cuda/attention_cuda.h"
#include "kernels/cuda/unified_memory.h"
#include "kernels/cuda/vmap_cuda.h"

namespace
{

/* One stream of a context's pool. */
struct stream_node {
    cudaStream_t stream;
    stream_node *next;
};

struct cuda_ctx {
    int device;
    /* Streams not used by a copy right now. A copy pops one (creating it if
     * the pool is empty) and pushes it back when done, so concurrent copies
     * always run on distinct streams: one thread's cudaStreamSynchronize
     * never waits for another thread's copy, and H2D and D2H copies overlap
     * on the two copy engines. The pool grows to the number of threads that
     * ever copied at once. */
    pthread_mutex_t lock; /* guards idle */
    stream_node *idle;
    kvhc_attn *attn; /* paged attention: workspaces (attention.cu) */
    /* 1 or 2: device tier in managed memory the CPU addresses directly;
     * 2: the host's own RAM (unified_memory.h). */
    int unified;
};

int fail(char *msg, size_t len, const char *what, cudaError_t err)
{
    if (msg && len)
        snprintf(msg, len, "%s: %s (%s)", what, cudaGetErrorString(err), cudaGetErrorName(err));
    (void)cudaGetLastError(); /* reset the non-sticky error state */
    return -1;
}

int fail_text(char *msg, size_t len, const char *text)
{
    if (msg && len)
        snprintf(msg, len, "%s", text);
    return -1;
}

/* Makes `device` current for the scope and restores the caller's device at
 * exit. Cost: two cheap thread-local calls when the devices differ. */
class device_scope
{
  public:
    explicit device_scope(int device) : device_(device), prev_(device)
    {
        err_ = cudaGetDevice(&prev_);
        if (err_ != cudaSuccess)
            prev_ = device_; /* nothing to restore */
        else if (prev_ != device_)
            err_ = cudaSetDevice(device_);
    }
    ~device_scope()
    {
        if (prev_ != device_)
            (void)cudaSetDevice(prev_);
    }
    cudaError_t error() const { return err_; }

  private:
    device_scope(const device_scope &);
    device_scope &operator=(const device_scope &);
    int device_;
    int prev_;
    cudaError_t err_;
};

/* Never launched: probe asks for its attributes, which loads this module
 * on the device and fails with "no kernel image is available" when the GPU
 * can run neither the SASS nor the PTX built here (e.g. sm_75), so such a
 * GPU is reported as unusable at probe time, not at the first kernel. */
__global__ void probe_kernel() {}

int cuda_probe(int device, char *msg, size_t len)
{
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess)
        return fail(msg, len, "cudaGetDeviceCount", err);
    if (device < 0 || device >= count) {
        if (msg && len)
            snprintf(msg, len, "CUDA device %d does not exist (%d visible)", device, count);
        return -1;
    }
    device_scope scope(device);
    if (scope.error() != cudaSuccess)
        return fail(msg, len, "cudaSetDevice", scope.error());
    cudaDeviceProp prop;
    err = cudaGetDeviceProperties(&prop, device);
    if (err != cudaSuccess)
        return fail(msg, len, "cudaGetDeviceProperties", err);
    cudaFuncAttributes attr;
    err = cudaFuncGetAttributes(&attr, probe_kernel);
    if (err != cudaSuccess) {
        if (msg && len)
            snprintf(msg, len, "CUDA device %d (%s, sm_%d%d): %s (%s)", device, prop.name, prop.major, prop.minor,
                     cudaGetErrorString(err), cudaGetErrorName(err));
        (void)cudaGetLastError();
        return -1;
    }
    return 0;
}

void *cuda_context_create(int device, char *msg, size_t len)
{
    /* cudaSetDevice initializes the device's primary context (CUDA >= 12),
     * so a device that cannot be used fails here rather than later. */
    device_scope scope(device);
    if (scope.error() != cudaSuccess) {
        fail(msg, len, "cudaSetDevice", scope.error());
        return NULL;
    }
    cuda_ctx *ctx = (cuda_ctx *)calloc(1, sizeof(*ctx));
    if (!ctx) {
        fail_text(msg, len, "out of host memory");
        return NULL;
    }
    ctx->device = device;
    int integrated = 0, host_tables = 0;
    (void)cudaDeviceGetAttribute(&integrated, cudaDevAttrIntegrated, device);
    (void)cudaDeviceGetAttribute(&host_tables, cudaDevAttrPageableMemoryAccessUsesHostPageTables, device);
    (void)cudaGetLastError();
    ctx->unified = kvhc_memory_is_unified(integrated, host_tables, secure_getenv("KVH_CUDA_UNIFIED"));
    ctx->attn = kvhc_attn_create(device, msg, len);
    if (!ctx->attn) {
        free(ctx);
        return NULL;
    }
    pthread_mutex_init(&ctx->lock, NULL);
    return ctx;
}

/* Called when no copy is in flight (engine close), so every stream is idle. */
void cuda_context_destroy(void *vctx)
{
    cuda_ctx *ctx = (cuda_ctx *)vctx;
    if (!ctx)
        return;
    device_scope scope(ctx->device);
    kvhc_attn_destroy(ctx->attn);
    for (stream_node *s = ctx->idle, *next; s; s = next) {
        next = s->next;
        (void)cudaStreamDestroy(s->stream);
        free(s);
    }
    (void)cudaGetLastError();
    pthread_mutex_destroy(&ctx->lock);
    free(ctx);
}

/* The allocators have no msg parameter; a failure is a NULL result. */
void *cuda_device_alloc(void *vctx, size_t bytes)
{
    cuda_ctx *ctx = (cuda_ctx *)vctx;
    if (!ctx || bytes == 0)
        return NULL;
    device_scope scope(ctx->device);
    void *p = NULL;
    if (scope.error() != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    if (ctx->unified) {
        /* One memory for CPU and GPU: managed, kept on the device's side
         * where it has one, and mapped for the CPU so the engine reads and
         * writes it in place. */
        if (cudaMallocManaged(&p, bytes, cudaMemAttachGlobal) != cudaSuccess) {
            (void)cudaGetLastError();
            return NULL;
        }
#if CUDART_VERSION >= 13000
        cudaMemLocation on_device{}, on_host{};
        on_device.type = cudaMemLocationTypeDevice;
        on_device.id = ctx->device;
        on_host.type = cudaMemLocationTypeHost;
        (void)cudaMemAdvise(p, bytes, cudaMemAdviseSetPreferredLocation, on_device);
        (void)cudaMemAdvise(p, bytes, cudaMemAdviseSetAccessedBy, on_host);
#else
        (void)cudaMemAdvise(p, bytes, cudaMemAdviseSetPreferredLocation, ctx->device);
        (void)cudaMemAdvise(p, bytes, cudaMemAdviseSetAccessedBy, cudaCpuDeviceId);
#endif
        (void)cudaGetLastError(); /* advice is optional (integrated GPUs) */
        return p;
    }
    /* Discrete: plain device memory, never managed memory: the tiers move
     * data explicitly and must not be paged behind their back. */
    if (cudaMalloc(&p, bytes) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return p;
}

int cuda_memory_is_unified(void *vctx)
{
    cuda_ctx *ctx = (cuda_ctx *)vctx;
    return ctx ? ctx->unified : 0;
}

void cuda_device_free(void *vctx, void *ptr, size_t bytes)
{
    cuda_ctx *ctx = (cuda_ctx *)vctx;
    if (!ctx || !ptr)
        return;
    device_scope scope(ctx->device);
    (void)cudaFree(ptr);
    (void)cudaGetLastError();
}

void *cuda_host_alloc(void *vctx, size_t bytes)
{
    cuda_ctx *ctx = (cuda_ctx *)vctx;
    if (!ctx || bytes == 0)
        return NULL;
    device_scope scope(ctx->device);
    void *p = NULL;
    /* Page-locked so copies are true DMA and truly asynchronous; portable
     * so it counts as pinned for every CUDA context in the process. */
    if (scope.error() != cudaSuccess || cudaHostAlloc(&p, bytes, cudaHostAllocPortable) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return p;
}

void cuda_host_free(void *vctx, void *ptr, size_t bytes)
{
    cuda_ctx *ctx = (cuda_ctx *)vctx;
    if (!ctx || !ptr)
        return;
    device_scope scope(ctx->device);
    (void)cudaFreeHost(ptr);
    (void)cudaGetLastError();
}

/* Takes an idle stream from the pool or creates one; the context's device
 * must be current. Non-blocking: copies must not serialize with work the
 * application queues on the legacy default stream. */
stream_node *stream_get(cuda_ctx *ctx, cudaError_t *err)
{
    pthread_mutex_lock(&ctx->lock);
    stream_node *s = ctx->idle;
    if (s)
        ctx->idle = s->next;
    pthread_mutex_unlock(&ctx->lock);
    if (s)
        return s;
    s = (stream_node *)malloc(sizeof(*s));
    if (!s) {
        *err = cudaErrorMemoryAllocation;
        return NULL;
    }
    *err = cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking);
    if (*err != cudaSuccess) {
        free(s);
        return NULL;
    }
    return s;
}

void stream_put(cuda_ctx *ctx, stream_node *s)
{
    pthread_mutex_lock(&ctx->lock);
    s->next = ctx->idle;
    ctx->idle = s;
    pthread_mutex_unlock(&ctx->lock);
}

bool to_cuda_kind(enum kvhi_copy_kind kind, cudaMemcpyKind *out)
{
    switch (kind) {
    case KVHI_COPY_HOST_TO_DEVICE:
        *out = cudaMemcpyHostToDevice;
        return true;
    case KVHI_COPY_DEVICE_TO_HOST:
        *out = cudaMemcpyDeviceToHost;
        return true;
    case KVHI_COPY_DEVICE_TO_DEVICE:
        *out = cudaMemcpyDeviceToDevice;
        return true;
    default:
        return false;
    }
}

/* Shared by copy and copy_2d: height == 0 means a 1-D copy of width bytes.
 * The copy is queued on a stream of this caller's own and waited for, which
 * makes the call synchronous without blocking other threads' copies. */
int do_copy(cuda_ctx *ctx, void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
            enum kvhi_copy_kind kind, char *msg, size_t len)
{
    cudaMemcpyKind ckind;
    if (!to_cuda_kind(kind, &ckind))
        return fail_text(msg, len, "CUDA backend: unknown copy kind");
    if (!ctx)
        return fail_text(msg, len, "CUDA backend: copy without a context");
    device_scope scope(ctx->device);
    if (scope.error() != cudaSuccess)
        return fail(msg, len, "cudaSetDevice", scope.error());
    cudaError_t err;
    stream_node *s = stream_get(ctx, &err);
    if (!s)
        return fail(msg, len, "cudaStreamCreateWithFlags", err);
    const char *what;
    if (height == 0) {
        what = "cudaMemcpyAsync";
        err = cudaMemcpyAsync(dst, src, width, ckind, s->stream);
    } else {
        what = "cudaMemcpy2DAsync";
        err = cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, ckind, s->stream);
    }
    if (err == cudaSuccess) {
        what = "cudaStreamSynchronize";
        err = cudaStreamSynchronize(s->stream);
    }
    /* Back to the pool even after an error: a failed call queued nothing,
     * and after a sticky error the whole context is unusable anyway. */
    stream_put(ctx, s);
    return err == cudaSuccess ? 0 : fail(msg, len, what, err);
}

int cuda_copy(void *vctx, void *dst, const void *src, size_t n, enum kvhi_copy_kind kind, char *msg, size_t len)
{
    if (n == 0)
        return 0;
    if (kind == KVHI_COPY_HOST_TO_HOST) {
        memcpy(dst, src, n);
        return 0;
    }
    return do_copy((cuda_ctx *)vctx, dst, 0, src, 0, n, 0, kind, msg, len);
}

int cuda_copy_2d(void *vctx, void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                 enum kvhi_copy_kind kind, char *msg, size_t len)
{
    if (width == 0 || height == 0)
        return 0;
    if (kind == KVHI_COPY_HOST_TO_HOST) {
        for (size_t r = 0; r < height; r++)
            memcpy((char *)dst + r * dpitch, (const char *)src + r * spitch, width);
        return 0;
    }
    return do_copy((cuda_ctx *)vctx, dst, dpitch, src, spitch, width, height, kind, msg, len);
}

/* Paged attention (attention.cu): the work split wanted, and the run on
 * the caller's stream. Holds are released by a host callback queued after
 * the kernels (see core/backend.h), so nothing here waits for the GPU. */
void cuda_attention_plan_opts(void *vctx, uint32_t threads, kvhi_attn_plan_opts *opts)
{
    kvhc_attn_plan_opts(((cuda_ctx *)vctx)->attn, threads, opts);
}

int cuda_attention_run(void *vctx, const kvhi_attn_plan *plan, const void *q, void *out, void *stream,
                       void (*done)(void *), void *done_arg, char *msg, size_t len)
{
    cuda_ctx *ctx = (cuda_ctx *)vctx;
    if (!ctx) {
        fail_text(msg, len, "CUDA backend: attention without a context");
        return KVH_ERR_INTERNAL;
    }
    device_scope scope(ctx->device);
    if (scope.error() != cudaSuccess) {
        fail(msg, len, "cudaSetDevice", scope.error());
        return KVH_ERR_INTERNAL;
    }
    return kvhc_attn_run(ctx->attn, plan, q, out, stream, done, done_arg, msg, len);
}

/* Persistent plans: upload once (may synchronise), launch only. */
int cuda_attention_plan_upload(void *vctx, const kvhi_attn_plan *plan, void **handle, char *msg, size_t len)
{
    cuda_ctx *ctx = (cuda_ctx *)vctx;
    device_scope scope(ctx->device);
    if (scope.error() != cudaSuccess) {
        fail(msg, len, "cudaSetDevice", scope.error());
        return KVH_ERR_INTERNAL;
    }
    return kvhc_attn_plan_upload(ctx->attn, plan, handle, msg, len);
}

int cuda_attention_run_uploaded(void *vctx, void *handle, const void *q, void *out, void *stream, char *msg, size_t len)
{
    cuda_ctx *ctx = (cuda_ctx *)vctx;
    device_scope scope(ctx->device);
    if (scope.error() != cudaSuccess) {
        fail(msg, len, "cudaSetDevice", scope.error());
        return KVH_ERR_INTERNAL;
    }
    return kvhc_attn_run_uploaded(ctx->attn, handle, q, out, stream, msg, len);
}

void cuda_attention_plan_free(void *vctx, void *handle)
{
    cuda_ctx *ctx = (cuda_ctx *)vctx;
    device_scope scope(ctx->device);
    kvhc_attn_plan_free(ctx->attn, handle);
}

int cuda_stream_sync(void *vctx, void *stream, char *msg, size_t len)
{
    cuda_ctx *ctx = (cuda_ctx *)vctx;
    if (!ctx)
        return fail_text(msg, len, "CUDA backend: stream_sync without a context");
    device_scope scope(ctx->device);
    if (scope.error() != cudaSuccess)
        return fail(msg, len, "cudaSetDevice", scope.error());
    cudaError_t err = cudaStreamSynchronize((cudaStream_t)stream);
    return err == cudaSuccess ? 0 : fail(msg, len, "cudaStreamSynchronize", err);
}

/* Views (vmap_cuda.cu): the arena's calls with the context's device
 * current. */
int vmap_scope_error(const device_scope &scope, char *msg, size_t len)
{
    if (scope.error() == cudaSuccess)
        return 0;
    fail(msg, len, "cudaSetDevice", scope.error());
    return KVH_ERR_INTERNAL;
}

int cuda_vmap_arena_create(void *vctx, const kvhi_slab_layout *layout, uint64_t bytes, const char *backing,
                           void **arena, void **base, uint64_t *map_unit, const char **backing_used, char *msg,
                           size_t len)
{
    cuda_ctx *ctx = (cuda_ctx *)vctx;
    device_scope scope(ctx->device);
    int rc = vmap_scope_error(scope, msg, len);
    kvhc_vmm_arena *a = NULL;
    if (rc == 0)
        rc = kvhc_vmm_arena_create(ctx->device, layout, bytes, backing, &a, base, map_unit, backing_used, msg, len);
    if (rc == 0)
        *arena = a;
    return rc;
}

void cuda_vmap_arena_destroy(void *vctx, void *arena)
{
    device_scope scope(((cuda_ctx *)vctx)->device);
    kvhc_vmm_arena_destroy((kvhc_vmm_arena *)arena);
}

int cuda_vmap_reserve(void *vctx, void *arena, uint64_t bytes, void **base, char *msg, size_t len)
{
    device_scope scope(((cuda_ctx *)vctx)->device);
    int rc = vmap_scope_error(scope, msg, len);
    return rc ? rc : kvhc_vmm_reserve((kvhc_vmm_arena *)arena, bytes, base, msg, len);
}

void cuda_vmap_unreserve(void *vctx, void *arena, void *base, uint64_t bytes)
{
    device_scope scope(((cuda_ctx *)vctx)->device);
    kvhc_vmm_unreserve((kvhc_vmm_arena *)arena, base, bytes);
}

int cuda_vmap_map(void *vctx, void *arena, void *dst, uint64_t arena_off, uint64_t bytes, char *msg, size_t len)
{
    device_scope scope(((cuda_ctx *)vctx)->device);
    int rc = vmap_scope_error(scope, msg, len);
    return rc ? rc : kvhc_vmm_map((kvhc_vmm_arena *)arena, dst, arena_off, bytes, msg, len);
}

int cuda_vmap_unmap(void *vctx, void *arena, void *dst, uint64_t bytes, char *msg, size_t len)
{
    device_scope scope(((cuda_ctx *)vctx)->device);
    int rc = vmap_scope_error(scope, msg, len);
    return rc ? rc : kvhc_vmm_unmap((kvhc_vmm_arena *)arena, dst, bytes, msg, len);
}

/* Positional, in the order of kvhi_backend_ops (C++17 has no designated
 * initializers); that order is part of the backend ABI anyway. */
const kvhi_backend_ops cuda_ops = {
    KVHI_BACKEND_ABI,            /* abi_version */
    "cuda",                      /* name */
    0,                           /* device_is_host_memory */
    cuda_probe,                  /* probe */
    cuda_context_create,         /* context_create */
    cuda_context_destroy,        /* context_destroy */
    cuda_device_alloc,           /* device_alloc */
    cuda_device_free,            /* device_free */
    cuda_host_alloc,             /* host_alloc */
    cuda_host_free,              /* host_free */
    cuda_copy,                   /* copy */
    cuda_copy_2d,                /* copy_2d */
    cuda_attention_plan_opts,    /* attention_plan_opts */
    cuda_attention_run,          /* attention_run */
    cuda_stream_sync,            /* stream_sync */
    cuda_attention_plan_upload,  /* attention_plan_upload */
    cuda_attention_run_uploaded, /* attention_run_uploaded */
    cuda_attention_plan_free,    /* attention_plan_free */
    cuda_memory_is_unified,      /* memory_is_unified */
    cuda_vmap_arena_create,      /* vmap_arena_create */
    cuda_vmap_arena_destroy,     /* vmap_arena_destroy */
    cuda_vmap_reserve,           /* vmap_reserve */
    cuda_vmap_unreserve,         /* vmap_unreserve */
    cuda_vmap_map,               /* vmap_map */
    cuda_vmap_unmap,             /* vmap_unmap */
};

} // namespace

/* The one exported symbol (KVHI_BACKEND_ENTRY), looked up with dlsym. */
extern "C" __attribute__((visibility("default"))) const kvhi_backend_ops *kvh_backend_cuda_entry(void)
{
    return &cuda_ops;
}
