/* CUDA paged attention: one kernel for decode and chunked prefill (split-K
 * partials when the plan splits a sequence's KV), and a merge kernel.
 *
 * Work: one CTA (128 threads) per plan unit = (sequence, KV head, up to 16
 * query vectors of that head's group: decode rows x GQA heads or prefill
 * rows x heads, a chunk of KV tokens). The chunk is read in tiles of TK
 * tokens (8..64, sized so one tile of K+V is <= 20 KiB): a two-stage
 * cp.async pipeline copies tile i+1 global -> shared (zero-filling tokens
 * past the chunk) while tile i is used, rows gathered through the block
 * table (any block_tokens, chunks need not start on a block). Per tile:
 * scores q.k for every (query, token) pair (thread = token x query group,
 * K rows padded in shared memory so 16-byte reads are bank-conflict free),
 * an online-softmax update per query (warp per query, exp2 with log2(e)
 * folded into the scale), then out += p.V with thread = output column
 * (all the unit's queries in registers). fp32 throughout; outputs rounded
 * to nearest even. Split sequences write normalised partials + log2-sum-
 * exp, merged by merge_kernel.
 *
 * Launch path (kvhc_attn_run): no allocation once the context's workspace
 * pool has grown to the calls in flight (the pool grows by whole
 * workspaces; a workspace is reused only after its call's completion
 * callback), no synchronisation: plan upload (cudaMemcpyAsync from pinned
 * staging), kernels and the completion callback (cudaLaunchHostFunc) are
 * all queued on the caller's stream. A capturing stream is refused: the
 * plan and the block holds belong to one call, a replayed graph would read
 * stale block tables and release holds twice. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvh/kvh.h"
#include "kernels/cuda/attention_cuda.h"

#include "kernels/cuda/attention_kernels.cuh"

namespace
{

using namespace kvhc;

/* ---- host side ---- */

struct workspace {
    workspace *next;
    kvhc_attn *owner;
    void *host; /* pinned plan staging */
    size_t host_cap;
    uint8_t *dev; /* plan, then partials */
    size_t dev_cap;
    void (*done)(void *);
    void *done_arg;
};

struct retired {
    retired *next;
    void *ptr;
    bool host;
};

int fail(char *msg, size_t len, int status, const char *what, cudaError_t err)
{
    if (msg && len)
        snprintf(msg, len, "%s: %s (%s)", what, cudaGetErrorString(err), cudaGetErrorName(err));
    (void)cudaGetLastError();
    return status;
}

int fail_text(char *msg, size_t len, int status, const char *text)
{
    if (msg && len)
        snprintf(msg, len, "%s", text);
    return status;
}

size_t align256(size_t x) { return (x + 255) & ~(size_t)255; }

template <typename KT, typename IT>
cudaError_t launch_attn(const attn_args &a, uint32_t n_units, size_t smem, cudaStream_t stream)
{
    if (smem > 48 * 1024) {
        cudaError_t err =
            cudaFuncSetAttribute(attn_kernel<KT, IT>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (err != cudaSuccess)
            return err;
    }
    attn_kernel<KT, IT><<<n_units, NT, smem, stream>>>(a);
    return cudaGetLastError();
}

template <typename KT>
cudaError_t launch_attn_io(uint32_t io, const attn_args &a, uint32_t n_units, size_t smem, cudaStream_t stream)
{
    switch (io) {
    case KVH_DTYPE_F16:
        return launch_attn<KT, __half>(a, n_units, smem, stream);
    case KVH_DTYPE_BF16:
        return launch_attn<KT, __nv_bfloat16>(a, n_units, smem, stream);
    default:
        return launch_attn<KT, float>(a, n_units, smem, stream);
    }
}

cudaError_t launch_merge(uint32_t io, const attn_args &a, uint32_t n_merges, cudaStream_t stream)
{
    dim3 grid(n_merges, a.Hq);
    switch (io) {
    case KVH_DTYPE_F16:
        merge_kernel<__half><<<grid, NT, 0, stream>>>(a);
        break;
    case KVH_DTYPE_BF16:
        merge_kernel<__nv_bfloat16><<<grid, NT, 0, stream>>>(a);
        break;
    default:
        merge_kernel<float><<<grid, NT, 0, stream>>>(a);
        break;
    }
    return cudaGetLastError();
}

} // namespace

struct kvhc_attn {
    int device;
    int sm_count;
    size_t smem_optin; /* most dynamic shared memory a block may use */
    pthread_mutex_t lock;
    workspace *idle;
    retired *old;
};

namespace
{

void retire(kvhc_attn *st, void *ptr, bool host)
{
    if (!ptr)
        return;
    retired *r = (retired *)malloc(sizeof(*r));
    if (!r) { /* cannot keep it for later: free now (may synchronise) */
        if (host)
            (void)cudaFreeHost(ptr);
        else
            (void)cudaFree(ptr);
        return;
    }
    r->ptr = ptr;
    r->host = host;
    pthread_mutex_lock(&st->lock);
    r->next = st->old;
    st->old = r;
    pthread_mutex_unlock(&st->lock);
}

void ws_put(kvhc_attn *st, workspace *ws)
{
    pthread_mutex_lock(&st->lock);
    ws->next = st->idle;
    st->idle = ws;
    pthread_mutex_unlock(&st->lock);
}

/* An idle workspace with room for host_bytes of staging and dev_bytes of
 * device memory, grown if needed. Outgrown buffers are kept until the
 * context is destroyed instead of freed now: cudaFree/cudaFreeHost would
 * synchronise the device in the launch path. */
workspace *ws_get(kvhc_attn *st, size_t host_bytes, size_t dev_bytes, cudaError_t *err)
{
    *err = cudaSuccess;
    pthread_mutex_lock(&st->lock);
    workspace *ws = st->idle;
    if (ws)
        st->idle = ws->next;
    pthread_mutex_unlock(&st->lock);
    if (!ws) {
        ws = (workspace *)calloc(1, sizeof(*ws));
        if (!ws) {
            *err = cudaErrorMemoryAllocation;
            return NULL;
        }
        ws->owner = st;
    }
    if (ws->host_cap < host_bytes) {
        size_t cap = ws->host_cap * 2 > host_bytes ? ws->host_cap * 2 : host_bytes;
        cap = cap < 65536 ? 65536 : cap;
        void *p = NULL;
        if ((*err = cudaHostAlloc(&p, cap, cudaHostAllocPortable)) != cudaSuccess) {
            ws_put(st, ws);
            return NULL;
        }
        retire(st, ws->host, true);
        ws->host = p;
        ws->host_cap = cap;
    }
    if (ws->dev_cap < dev_bytes) {
        size_t cap = ws->dev_cap * 2 > dev_bytes ? ws->dev_cap * 2 : dev_bytes;
        cap = cap < (1u << 20) ? (1u << 20) : cap;
        void *p = NULL;
        if ((*err = cudaMalloc(&p, cap)) != cudaSuccess) {
            ws_put(st, ws);
            return NULL;
        }
        retire(st, ws->dev, false);
        ws->dev = (uint8_t *)p;
        ws->dev_cap = cap;
    }
    return ws;
}

/* Host callback queued after the kernels: the workspace is free again and
 * the call's holds may go. No CUDA calls allowed here. */
void CUDART_CB ws_done(void *arg)
{
    workspace *ws = (workspace *)arg;
    void (*done)(void *) = ws->done;
    void *done_arg = ws->done_arg;
    ws_put(ws->owner, ws); /* before done: after it, close may free st */
    done(done_arg);
}

} // namespace

kvhc_attn *kvhc_attn_create(int device, char *msg, size_t len)
{
    kvhc_attn *st = (kvhc_attn *)calloc(1, sizeof(*st));
    if (!st) {
        fail_text(msg, len, KVH_ERR_NOMEM, "out of host memory");
        return NULL;
    }
    st->device = device;
    int v = 0;
    cudaError_t err = cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device);
    st->sm_count = err == cudaSuccess && v > 0 ? v : 1;
    err = cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    st->smem_optin = err == cudaSuccess && v > 0 ? (size_t)v : 48 * 1024;
    (void)cudaGetLastError();
    pthread_mutex_init(&st->lock, NULL);
    return st;
}

void kvhc_attn_destroy(kvhc_attn *st)
{
    if (!st)
        return;
    for (workspace *w = st->idle, *next; w; w = next) {
        next = w->next;
        if (w->host)
            (void)cudaFreeHost(w->host);
        if (w->dev)
            (void)cudaFree(w->dev);
        free(w);
    }
    for (retired *r = st->old, *next; r; r = next) {
        next = r->next;
        if (r->host)
            (void)cudaFreeHost(r->ptr);
        else
            (void)cudaFree(r->ptr);
        free(r);
    }
    (void)cudaGetLastError();
    pthread_mutex_destroy(&st->lock);
    free(st);
}

/* Units: up to 16 query vectors (a CTA's registers), about 4 CTAs per SM
 * of work so split-K fills the GPU at small batches, chunks of at least
 * 128 tokens (4 or more tiles per CTA). */
void kvhc_attn_plan_opts(const kvhc_attn *st, uint32_t threads, kvhi_attn_plan_opts *o)
{
    o->max_queries = QT;
    o->target_units = (uint32_t)st->sm_count * 4;
    o->min_chunk_tokens = 128;
    o->chunk_quantum = 0;
}

int kvhc_attn_run(kvhc_attn *st, const kvhi_attn_plan *p, const void *q, void *out, void *stream_v,
                  void (*done)(void *), void *done_arg, char *msg, size_t len)
{
    cudaStream_t stream = (cudaStream_t)stream_v;
    if (p->head_dim > MAX_D)
        return fail_text(msg, len, KVH_ERR_UNSUPPORTED, "CUDA attention supports head_dim up to 256");
    if (p->max_queries > (uint32_t)QT || p->kv_dtype > KVH_DTYPE_BF16 || p->io_dtype > KVH_DTYPE_BF16)
        return fail_text(msg, len, KVH_ERR_INTERNAL, "CUDA attention: plan not made for this backend");
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    cudaError_t err = cudaStreamIsCapturing(stream, &cs);
    if (err != cudaSuccess)
        return fail(msg, len, KVH_ERR_INVALID_ARG, "cudaStreamIsCapturing", err);
    if (cs != cudaStreamCaptureStatusNone)
        return fail_text(msg, len, KVH_ERR_UNSUPPORTED,
                         "the stream is capturing a CUDA graph: attention plans and block holds are per call and "
                         "cannot be replayed");
    if (p->n_units == 0) {
        done(done_arg);
        return 0;
    }

    attn_args a;
    size_t smem = 0;
    geometry(p, &a, &smem);
    if (smem > st->smem_optin)
        return fail_text(msg, len, KVH_ERR_UNSUPPORTED, "CUDA attention: not enough shared memory per block");

    /* Workspace: plan arrays, then the split-K partials. */
    const size_t plan_bytes = align256((size_t)p->mem_bytes);
    const size_t po_bytes = align256((size_t)p->n_partial_rows * a.D * sizeof(float));
    const size_t ml_bytes = align256((size_t)p->n_partial_rows * 2 * sizeof(float)); /* (m, l) pairs */
    workspace *ws = ws_get(st, plan_bytes, plan_bytes + po_bytes + ml_bytes, &err);
    if (!ws)
        return fail(msg, len, KVH_ERR_NOMEM, "attention workspace", err);
    memcpy(ws->host, p->mem, p->mem_bytes);
    err = cudaMemcpyAsync(ws->dev, ws->host, p->mem_bytes, cudaMemcpyHostToDevice, stream);
    if (err != cudaSuccess) {
        ws_put(st, ws);
        return fail(msg, len, KVH_ERR_INVALID_ARG, "cudaMemcpyAsync (attention plan)", err);
    }
    a.kv = (const uint8_t *)p->kv_base + p->layer_offset;
    a.block_bytes = p->block_bytes;
    a.seqs = (const kvhi_attn_seq *)(ws->dev + p->off_seqs);
    a.slots = (const int32_t *)(ws->dev + p->off_slots);
    a.units = (const kvhi_attn_unit *)(ws->dev + p->off_units);
    a.merges = (const kvhi_attn_merge *)(ws->dev + p->off_merges);
    a.q = q;
    a.out = out;
    a.po = (float *)(ws->dev + plan_bytes);
    a.pml = (float *)(ws->dev + plan_bytes + po_bytes);

    const char *what = "attention kernel launch";
    switch (p->kv_dtype) {
    case KVH_DTYPE_F16:
        err = launch_attn_io<__half>(p->io_dtype, a, p->n_units, smem, stream);
        break;
    case KVH_DTYPE_BF16:
        err = launch_attn_io<__nv_bfloat16>(p->io_dtype, a, p->n_units, smem, stream);
        break;
    default:
        err = launch_attn_io<float>(p->io_dtype, a, p->n_units, smem, stream);
        break;
    }
    if (err == cudaSuccess && p->n_merges) {
        what = "attention merge launch";
        err = launch_merge(p->io_dtype, a, p->n_merges, stream);
    }
    if (err == cudaSuccess) {
        ws->done = done;
        ws->done_arg = done_arg;
        what = "cudaLaunchHostFunc";
        err = cudaLaunchHostFunc(stream, ws_done, ws);
        if (err == cudaSuccess)
            return 0;
    }
    /* Something is queued (at least the plan upload): wait for it before
     * the workspace and the caller's holds can go. */
    int status = fail(msg, len, KVH_ERR_INTERNAL, what, err);
    (void)cudaStreamSynchronize(stream);
    (void)cudaGetLastError();
    ws_put(st, ws);
    return status;
}

/* ---- persistent plans: uploaded once, launched many times ----
 * The plan arrays and the split-K scratch live in one device allocation
 * made at upload, so a launch only queues the kernels: a stream being
 * captured records them, and every replay of the graph reads the same
 * (device-resident) block table. */
namespace
{
struct uploaded_plan {
    uint8_t *dev;
    attn_args args; /* everything but q and out */
    size_t smem;
    uint32_t n_units, n_merges, kv_dtype, io_dtype;
};
} // namespace

int kvhc_attn_plan_upload(kvhc_attn *st, const kvhi_attn_plan *p, void **handle, char *msg, size_t len)
{
    if (p->head_dim > MAX_D)
        return fail_text(msg, len, KVH_ERR_UNSUPPORTED, "CUDA attention supports head_dim up to 256");
    if (p->max_queries > (uint32_t)QT || p->kv_dtype > KVH_DTYPE_BF16 || p->io_dtype > KVH_DTYPE_BF16)
        return fail_text(msg, len, KVH_ERR_INTERNAL, "CUDA attention: plan not made for this backend");
    uploaded_plan *u = (uploaded_plan *)calloc(1, sizeof(*u));
    if (!u)
        return fail_text(msg, len, KVH_ERR_NOMEM, "out of host memory");
    geometry(p, &u->args, &u->smem);
    if (u->smem > st->smem_optin) {
        free(u);
        return fail_text(msg, len, KVH_ERR_UNSUPPORTED, "CUDA attention: not enough shared memory per block");
    }
    const size_t plan_bytes = align256((size_t)p->mem_bytes);
    const size_t po_bytes = align256((size_t)p->n_partial_rows * u->args.D * sizeof(float));
    const size_t ml_bytes = align256((size_t)p->n_partial_rows * 2 * sizeof(float)); /* (m, l) pairs */
    cudaError_t err = cudaMalloc(&u->dev, plan_bytes + po_bytes + ml_bytes);
    if (err == cudaSuccess && p->mem_bytes)
        err = cudaMemcpy(u->dev, p->mem, p->mem_bytes, cudaMemcpyHostToDevice);
    if (err != cudaSuccess) {
        if (u->dev)
            (void)cudaFree(u->dev);
        free(u);
        return fail(msg, len, KVH_ERR_NOMEM, "uploading an attention plan", err);
    }
    attn_args &a = u->args;
    a.kv = (const uint8_t *)p->kv_base + p->layer_offset;
    a.block_bytes = p->block_bytes;
    a.seqs = (const kvhi_attn_seq *)(u->dev + p->off_seqs);
    a.slots = (const int32_t *)(u->dev + p->off_slots);
    a.units = (const kvhi_attn_unit *)(u->dev + p->off_units);
    a.merges = (const kvhi_attn_merge *)(u->dev + p->off_merges);
    a.po = (float *)(u->dev + plan_bytes);
    a.pml = (float *)(u->dev + plan_bytes + po_bytes);
    u->n_units = p->n_units;
    u->n_merges = p->n_merges;
    u->kv_dtype = p->kv_dtype;
    u->io_dtype = p->io_dtype;
    *handle = u;
    return 0;
}

int kvhc_attn_run_uploaded(kvhc_attn *st, void *handle, const void *q, void *out, void *stream_v, char *msg, size_t len)
{
    (void)st;
    uploaded_plan *u = (uploaded_plan *)handle;
    cudaStream_t stream = (cudaStream_t)stream_v;
    if (u->n_units == 0)
        return 0;
    attn_args a = u->args;
    a.q = q;
    a.out = out;
    cudaError_t err;
    switch (u->kv_dtype) {
    case KVH_DTYPE_F16:
        err = launch_attn_io<__half>(u->io_dtype, a, u->n_units, u->smem, stream);
        break;
    case KVH_DTYPE_BF16:
        err = launch_attn_io<__nv_bfloat16>(u->io_dtype, a, u->n_units, u->smem, stream);
        break;
    default:
        err = launch_attn_io<float>(u->io_dtype, a, u->n_units, u->smem, stream);
        break;
    }
    if (err == cudaSuccess && u->n_merges)
        err = launch_merge(u->io_dtype, a, u->n_merges, stream);
    return err == cudaSuccess ? 0 : fail(msg, len, KVH_ERR_INTERNAL, "attention kernel launch", err);
}

void kvhc_attn_plan_free(kvhc_attn *st, void *handle)
{
    (void)st;
    uploaded_plan *u = (uploaded_plan *)handle;
    if (!u)
        return;
    (void)cudaFree(u->dev);
    (void)cudaGetLastError();
    free(u);
}
