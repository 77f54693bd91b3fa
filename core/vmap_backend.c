/* The forwarding backend of a view arena (see vmap_backend.h). Copies
 * that touch the arena are cut into kvhi_slab_run pieces: a whole block
 * is one strided 2-D copy (its pieces are pitch apart), so a CUDA
 * transfer stays one call. The table says device_is_host_memory = 0
 * even on the CPU, so that the engine copies through it and never
 * dereferences a logical device address itself. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/engine.h"
#include "core/vmap_backend.h"

typedef struct vmap_backend {
    kvhi_backend_ops ops; /* first: e->backend points here */
    const kvhi_backend_ops *real;
    void *real_ctx;
    kvhi_slab_layout slab;
    uint8_t *base;
    uint64_t bytes;
    void *arena;
} vmap_backend;

static bool in_arena(const vmap_backend *w, const void *p)
{
    return (const uint8_t *)p >= w->base && (const uint8_t *)p < w->base + w->bytes;
}

/* Copies n logical bytes; dst_t / src_t say which side is in the arena. */
static int slab_copy(vmap_backend *w, uint8_t *dst, bool dst_t, const uint8_t *src, bool src_t, uint64_t n,
                     enum kvhi_copy_kind kind, char *msg, size_t len)
{
    uint64_t pitch = kvhi_slab_pitch(&w->slab);
    uint64_t doff = dst_t ? (uint64_t)(dst - w->base) : 0, soff = src_t ? (uint64_t)(src - w->base) : 0;
    while (n) {
        uint64_t dphys = 0, drows = 1, dwidth = n, sphys = 0, srows = 1, swidth = n;
        if (dst_t)
            kvhi_slab_run(&w->slab, doff, n, &dphys, &drows, &dwidth);
        if (src_t)
            kvhi_slab_run(&w->slab, soff, n, &sphys, &srows, &swidth);
        uint64_t rows, width;
        if (dst_t && src_t) {
            /* Whole pieces on both sides: strided rows; else one row. */
            bool strided = dwidth == swidth && drows > 1 && srows > 1;
            rows = strided ? (drows < srows ? drows : srows) : 1;
            width = dwidth < swidth ? dwidth : swidth;
        } else if (dst_t) {
            rows = drows, width = dwidth;
        } else {
            rows = srows, width = swidth;
        }
        void *d = dst_t ? w->base + dphys : dst + (doff);
        const void *s = src_t ? w->base + sphys : src + (soff);
        size_t dp = dst_t ? pitch : width, sp = src_t ? pitch : width;
        int rc = w->real->copy_2d(w->real_ctx, d, dp, s, sp, width, rows, kind, msg, len);
        if (rc != 0)
            return rc;
        doff += rows * width, soff += rows * width, n -= rows * width;
    }
    return 0;
}

static bool translated_dst(vmap_backend *w, const void *dst, enum kvhi_copy_kind kind)
{
    return (kind == KVHI_COPY_HOST_TO_DEVICE || kind == KVHI_COPY_DEVICE_TO_DEVICE) && in_arena(w, dst);
}

static bool translated_src(vmap_backend *w, const void *src, enum kvhi_copy_kind kind)
{
    return (kind == KVHI_COPY_DEVICE_TO_HOST || kind == KVHI_COPY_DEVICE_TO_DEVICE) && in_arena(w, src);
}

static int fwd_copy(void *ctx, void *dst, const void *src, size_t n, enum kvhi_copy_kind kind, char *msg, size_t len)
{
    vmap_backend *w = ctx;
    bool dt = translated_dst(w, dst, kind), st = translated_src(w, src, kind);
    if (!dt && !st)
        return w->real->copy(w->real_ctx, dst, src, n, kind, msg, len);
    return slab_copy(w, dst, dt, src, st, n, kind, msg, len);
}

/* One row at a time, unless the arena side lies within one piece (a
 * kvh_seq_write_kv of tokens of one head): then one translated call. */
static int fwd_copy_2d(void *ctx, void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                       enum kvhi_copy_kind kind, char *msg, size_t len)
{
    vmap_backend *w = ctx;
    bool dt = translated_dst(w, dst, kind), st = translated_src(w, src, kind);
    if (!dt && !st)
        return w->real->copy_2d(w->real_ctx, dst, dpitch, src, spitch, width, height, kind, msg, len);
    if (height == 0 || width == 0)
        return 0;
    if (dt != st) {
        const uint8_t *t = dt ? dst : src;
        uint64_t span = (height - 1) * (dt ? dpitch : spitch) + width, phys, rows, run_width;
        kvhi_slab_run(&w->slab, (uint64_t)(t - w->base), span, &phys, &rows, &run_width);
        if (rows == 1 && run_width == span) {
            void *d = dt ? w->base + phys : dst;
            const void *s = st ? w->base + phys : src;
            return w->real->copy_2d(w->real_ctx, d, dpitch, s, spitch, width, height, kind, msg, len);
        }
    }
    for (size_t r = 0; r < height; r++) {
        int rc =
            slab_copy(w, (uint8_t *)dst + r * dpitch, dt, (const uint8_t *)src + r * spitch, st, width, kind, msg, len);
        if (rc != 0)
            return rc;
    }
    return 0;
}

/* ---- everything else forwarded with the backend's own context ---- */
static void *fwd_device_alloc(void *ctx, size_t bytes)
{
    vmap_backend *w = ctx;
    return w->real->device_alloc(w->real_ctx, bytes);
}

/* The arena goes with its backend context, the rest is the backend's. */
static void fwd_device_free(void *ctx, void *ptr, size_t bytes)
{
    vmap_backend *w = ctx;
    if (ptr == w->base) {
        w->real->vmap_arena_destroy(w->real_ctx, w->arena);
        w->arena = NULL;
        w->base = NULL;
    } else
        w->real->device_free(w->real_ctx, ptr, bytes);
}

static void *fwd_host_alloc(void *ctx, size_t bytes)
{
    vmap_backend *w = ctx;
    return w->real->host_alloc(w->real_ctx, bytes);
}

static void fwd_host_free(void *ctx, void *ptr, size_t bytes)
{
    vmap_backend *w = ctx;
    w->real->host_free(w->real_ctx, ptr, bytes);
}

static void fwd_context_destroy(void *ctx)
{
    vmap_backend *w = ctx;
    if (w->arena)
        w->real->vmap_arena_destroy(w->real_ctx, w->arena);
    if (w->real_ctx)
        w->real->context_destroy(w->real_ctx);
    free(w);
}

static void fwd_plan_opts(void *ctx, uint32_t threads, struct kvhi_attn_plan_opts *opts)
{
    vmap_backend *w = ctx;
    w->real->attention_plan_opts(w->real_ctx, threads, opts);
}

static int fwd_run(void *ctx, const struct kvhi_attn_plan *plan, const void *q, void *out, void *stream,
                   void (*done)(void *), void *done_arg, char *msg, size_t len)
{
    vmap_backend *w = ctx;
    return w->real->attention_run(w->real_ctx, plan, q, out, stream, done, done_arg, msg, len);
}

static int fwd_sync(void *ctx, void *stream, char *msg, size_t len)
{
    vmap_backend *w = ctx;
    return w->real->stream_sync(w->real_ctx, stream, msg, len);
}

static int fwd_upload(void *ctx, const struct kvhi_attn_plan *plan, void **handle, char *msg, size_t len)
{
    vmap_backend *w = ctx;
    return w->real->attention_plan_upload(w->real_ctx, plan, handle, msg, len);
}

static int fwd_run_uploaded(void *ctx, void *handle, const void *q, void *out, void *stream, char *msg, size_t len)
{
    vmap_backend *w = ctx;
    return w->real->attention_run_uploaded(w->real_ctx, handle, q, out, stream, msg, len);
}

static void fwd_plan_free(void *ctx, void *handle)
{
    vmap_backend *w = ctx;
    w->real->attention_plan_free(w->real_ctx, handle);
}

static int fwd_reserve(void *ctx, void *arena, uint64_t bytes, void **base, char *msg, size_t len)
{
    vmap_backend *w = ctx;
    return w->real->vmap_reserve(w->real_ctx, arena, bytes, base, msg, len);
}

static void fwd_unreserve(void *ctx, void *arena, void *base, uint64_t bytes)
{
    vmap_backend *w = ctx;
    w->real->vmap_unreserve(w->real_ctx, arena, base, bytes);
}

static int fwd_map(void *ctx, void *arena, void *dst, uint64_t off, uint64_t bytes, char *msg, size_t len)
{
    vmap_backend *w = ctx;
    return w->real->vmap_map(w->real_ctx, arena, dst, off, bytes, msg, len);
}

static int fwd_unmap(void *ctx, void *arena, void *dst, uint64_t bytes, char *msg, size_t len)
{
    vmap_backend *w = ctx;
    return w->real->vmap_unmap(w->real_ctx, arena, dst, bytes, msg, len);
}

void kvhi_vmap_layout(kvh_engine *e, uint64_t max_slots, kvhi_slab_layout *out)
{
    kvhi_slab_layout_init(out, (uint64_t)e->cfg.block_tokens * e->vector_bytes,
                          2u * e->cfg.num_layers * e->cfg.num_kv_heads, 2ull << 20, max_slots);
}

kvh_status kvhi_vmap_arena_alloc(kvh_engine *e, uint64_t slots, uint8_t **base_out)
{
    const kvhi_backend_ops *real = e->backend;
    if (!real->vmap_arena_create)
        return kvhi_fail(KVH_ERR_UNSUPPORTED, "the %s backend has no views (vmap)", real->name);
    vmap_backend *w = calloc(1, sizeof(*w));
    if (!w)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for the vmap backend");
    w->real = real;
    w->real_ctx = e->backend_ctx;
    w->slab = e->slab;
    w->bytes = slots * e->block_bytes;
    char msg[256] = "";
    void *base = NULL;
    int rc = real->vmap_arena_create(e->backend_ctx, &e->slab, w->bytes, NULL, &w->arena, &base, &e->vmap_unit,
                                     &e->vmap_backing, msg, sizeof(msg));
    if (rc != 0) {
        free(w);
        return kvhi_fail(rc < 0 ? rc : KVH_ERR_NOMEM, "%s", msg);
    }
    w->base = base;
    w->ops = *real;
    w->ops.device_is_host_memory = 0;
    w->ops.context_destroy = fwd_context_destroy;
    w->ops.device_alloc = fwd_device_alloc;
    w->ops.device_free = fwd_device_free;
    w->ops.host_alloc = fwd_host_alloc;
    w->ops.host_free = fwd_host_free;
    w->ops.copy = fwd_copy;
    w->ops.copy_2d = fwd_copy_2d;
    w->ops.attention_plan_opts = real->attention_plan_opts ? fwd_plan_opts : NULL;
    w->ops.attention_run = real->attention_run ? fwd_run : NULL;
    w->ops.stream_sync = real->stream_sync ? fwd_sync : NULL;
    w->ops.attention_plan_upload = real->attention_plan_upload ? fwd_upload : NULL;
    w->ops.attention_run_uploaded = real->attention_run_uploaded ? fwd_run_uploaded : NULL;
    w->ops.attention_plan_free = real->attention_plan_free ? fwd_plan_free : NULL;
    w->ops.vmap_reserve = fwd_reserve;
    w->ops.vmap_unreserve = fwd_unreserve;
    w->ops.vmap_map = fwd_map;
    w->ops.vmap_unmap = fwd_unmap;
    w->ops.vmap_arena_create = NULL; /* one arena per engine */
    w->ops.vmap_arena_destroy = NULL;
    w->ops.memory_is_unified = NULL;
    e->vmap_arena = w->arena;
    e->backend = &w->ops;
    e->backend_ctx = w;
    /* Logical device addresses are not where the bytes are: every access
     * goes through the table's copies. */
    e->device_host_addressable = false;
    *base_out = base;
    return KVH_OK;
}
