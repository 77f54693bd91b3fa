/* Exported weight-context calls: argument checks, versioned params
 * structs, then the core (core/context*.c) under the engine lock. */
#include <stddef.h>
#include <string.h>

#include "abi/api_params.h"
#include "core/seq.h"
#include "core/context.h"

static void context_defaults(kvh_context_params *p)
{
    memset(p, 0, sizeof(*p));
    p->struct_size = sizeof(*p);
    p->kv_policy = KVH_CONTEXT_KV_KEEP;
    p->chunk_bytes = 2ull << 20;
}

kvh_status kvh_context_params_init(kvh_context_params *p, size_t size)
{
    kvh_context_params d;
    context_defaults(&d);
    return kvhi_init_params(p, size, &d, sizeof(d), KVHI_STRUCT_SIZE_MIN, "kvh_context_params");
}

static void region_defaults(kvh_weight_region_params *p)
{
    memset(p, 0, sizeof(*p));
    p->struct_size = sizeof(*p);
}

kvh_status kvh_weight_region_params_init(kvh_weight_region_params *p, size_t size)
{
    kvh_weight_region_params d;
    region_defaults(&d);
    return kvhi_init_params(p, size, &d, sizeof(d), KVHI_STRUCT_SIZE_MIN, "kvh_weight_region_params");
}

static kvh_status enter_context(kvh_engine *e, kvh_context h, kvhi_context **x)
{
    kvh_status st = kvhi_api_enter_contexts(e);
    if (st != KVH_OK)
        return st;
    st = kvhi_context_resolve(e, h, x);
    if (st != KVH_OK)
        kvhi_leave(e);
    return st;
}

kvh_status kvh_context_create(kvh_engine *e, const kvh_context_params *params, kvh_context *ctx)
{
    kvhi_clear_error();
    KVHI_REQUIRE(ctx, "ctx out-parameter is NULL");
    kvh_context_params p;
    context_defaults(&p);
    if (params) {
        kvh_status st = kvhi_read_params(&p, sizeof(p), params, KVHI_STRUCT_SIZE_MIN, "kvh_context_params");
        if (st != KVH_OK)
            return st;
    }
    KVHI_REQUIRE(p.chunk_bytes >= 1 && p.chunk_bytes <= (1ull << 30), "chunk_bytes %llu not in 1..1 GiB",
                 (unsigned long long)p.chunk_bytes);
    KVHI_REQUIRE(p.kv_policy <= KVH_CONTEXT_KV_DEMOTE, "unknown kv_policy %u", p.kv_policy);
    kvh_status st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    kvh_context h;
    st = kvhi_context_create(e, &p, &h);
    kvhi_api_leave(e, st);
    if (st == KVH_OK)
        *ctx = h;
    return st;
}

kvh_status kvh_context_destroy(kvh_engine *e, kvh_context ctx)
{
    if (e && ctx.id == 0) {
        kvhi_clear_error();
        return KVH_OK;
    }
    kvh_status st = kvhi_api_enter_contexts(e);
    if (st != KVH_OK)
        return st;
    kvhi_context *x = NULL;
    st = kvhi_context_detach(e, ctx, &x);
    kvhi_api_leave(e, st);
    /* Device memory is freed without the lock (CUDA frees synchronise). */
    if (x)
        kvhi_context_free_detached(e, x);
    return st;
}

kvh_status kvh_context_add_region(kvh_engine *e, kvh_context ctx, const kvh_weight_region_params *params,
                                  uint32_t *region)
{
    kvhi_clear_error();
    KVHI_REQUIRE(params && region, "params and region must not be NULL");
    kvh_weight_region_params p;
    region_defaults(&p);
    kvh_status st = kvhi_read_params(&p, sizeof(p), params, KVHI_STRUCT_SIZE_MIN, "kvh_weight_region_params");
    if (st != KVH_OK)
        return st;
    KVHI_REQUIRE(p.size > 0, "weight region size is 0");
    KVHI_REQUIRE(!p.bytes != !p.path, "give exactly one source: bytes or path");
    KVHI_REQUIRE(!p.path || p.path[0], "path is empty");
    kvhi_context *x = NULL;
    st = enter_context(e, ctx, &x);
    if (st != KVH_OK)
        return st;
    uint32_t r;
    st = kvhi_context_add_region(e, x, &p, &r);
    kvhi_api_leave(e, st);
    if (st == KVH_OK)
        *region = r;
    return st;
}

kvh_status kvh_context_attach_seq(kvh_engine *e, kvh_context ctx, kvh_seq seq)
{
    kvhi_context *x = NULL;
    kvh_status st = enter_context(e, ctx, &x);
    if (st != KVH_OK)
        return st;
    kvhi_seq *s;
    st = kvhi_seq_get(e, seq, &s);
    if (st == KVH_OK)
        st = kvhi_context_attach(e, x, seq.id);
    return kvhi_api_leave(e, st);
}

kvh_status kvh_context_switch(kvh_engine *e, kvh_context from, kvh_context to, kvh_fence *fence)
{
    kvhi_clear_error();
    KVHI_REQUIRE(from.id != to.id || from.id == 0, "from and to are the same context");
    kvh_status st = kvhi_api_enter_contexts(e);
    if (st != KVH_OK)
        return st;
    kvh_fence f;
    st = kvhi_context_switch(e, from, to, fence ? &f : NULL);
    kvhi_api_leave(e, st);
    if (st == KVH_OK && fence)
        *fence = f;
    return st;
}

kvh_status kvh_context_wait_layer(kvh_engine *e, kvh_context ctx, uint32_t layer, uint64_t timeout_ns)
{
    kvh_status st = kvhi_api_enter_contexts(e);
    if (st != KVH_OK)
        return st;
    st = kvhi_context_wait_layer(e, ctx, layer, timeout_ns);
    return kvhi_api_leave(e, st);
}

kvh_status kvh_context_region_data(kvh_engine *e, kvh_context ctx, uint32_t region, int32_t writable, void **data,
                                   uint64_t *size)
{
    kvhi_clear_error();
    KVHI_REQUIRE(data, "data out-parameter is NULL");
    kvhi_context *x = NULL;
    kvh_status st = enter_context(e, ctx, &x);
    if (st != KVH_OK)
        return st;
    void *d = NULL;
    uint64_t n = 0;
    st = kvhi_context_region_data(e, x, region, writable != 0, &d, &n);
    kvhi_api_leave(e, st);
    if (st == KVH_OK) {
        *data = d;
        if (size)
            *size = n;
    }
    return st;
}

kvh_status kvh_context_region_pin(kvh_engine *e, kvh_context ctx, uint32_t region, int32_t pinned)
{
    kvhi_context *x = NULL;
    kvh_status st = enter_context(e, ctx, &x);
    if (st != KVH_OK)
        return st;
    st = kvhi_context_region_pin(e, x, region, pinned != 0);
    return kvhi_api_leave(e, st);
}

kvh_status kvh_context_verify(kvh_engine *e, kvh_context ctx, uint64_t *chunks_checked)
{
    kvh_status st = kvhi_api_enter_contexts(e);
    if (st != KVH_OK)
        return st;
    uint64_t n = 0;
    st = kvhi_context_verify(e, ctx, &n);
    kvhi_api_leave(e, st);
    if (st == KVH_OK && chunks_checked)
        *chunks_checked = n;
    return st;
}

kvh_status kvh_context_info_get(kvh_engine *e, kvh_context ctx, kvh_context_info *info)
{
    kvhi_clear_error();
    KVHI_REQUIRE(info, "info is NULL");
    uint32_t size;
    kvh_status st = kvhi_info_size(info, KVHI_STRUCT_SIZE_MIN, sizeof(*info), "kvh_context_info", &size);
    if (st != KVH_OK)
        return st;
    kvhi_context *x = NULL;
    st = enter_context(e, ctx, &x);
    if (st != KVH_OK)
        return st;
    kvh_context_info r;
    st = kvhi_context_info(e, x, &r);
    kvhi_api_leave(e, st);
    if (st == KVH_OK)
        kvhi_write_info(info, size, &r);
    return st;
}

kvh_status kvh_weight_stats_get(kvh_engine *e, kvh_weight_stats *stats)
{
    kvhi_clear_error();
    KVHI_REQUIRE(stats, "stats is NULL");
    uint32_t size;
    kvh_status st = kvhi_info_size(stats, KVHI_STRUCT_SIZE_MIN, sizeof(*stats), "kvh_weight_stats", &size);
    if (st != KVH_OK)
        return st;
    st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    kvh_weight_stats s;
    kvhi_weight_stats(e, &s);
    kvhi_api_leave(e, KVH_OK);
    kvhi_write_info(stats, size, &s);
    return KVH_OK;
}
