/* Exported admission calls (token-budget pools) and kvh_seq_create_ex:
 * argument checks, versioned params structs, then core/admission.c under
 * the engine lock. */
#include <stdbool.h>

#include "abi/api_params.h"
#include "core/seq.h"
#include "core/context.h"

static void admission_defaults(kvh_admission_params *p)
{
    memset(p, 0, sizeof(*p));
    p->struct_size = sizeof(*p);
    p->short_max_tokens = 4096;
}

kvh_status kvh_admission_params_init(kvh_admission_params *p, size_t size)
{
    kvh_admission_params d;
    admission_defaults(&d);
    return kvhi_init_params(p, size, &d, sizeof(d), KVHI_STRUCT_SIZE_MIN, "kvh_admission_params");
}

static void seq_defaults(kvh_seq_params *p)
{
    memset(p, 0, sizeof(*p));
    p->struct_size = sizeof(*p);
}

kvh_status kvh_seq_params_init(kvh_seq_params *p, size_t size)
{
    kvh_seq_params d;
    seq_defaults(&d);
    return kvhi_init_params(p, size, &d, sizeof(d), KVHI_STRUCT_SIZE_MIN, "kvh_seq_params");
}

kvh_status kvh_admission_configure(kvh_engine *e, const kvh_admission_params *params)
{
    kvhi_clear_error();
    KVHI_REQUIRE(params, "params is NULL");
    kvh_admission_params p;
    admission_defaults(&p);
    kvh_status st = kvhi_read_params(&p, sizeof(p), params, KVHI_STRUCT_SIZE_MIN, "kvh_admission_params");
    if (st != KVH_OK)
        return st;
    st = kvhi_api_enter_contexts(e);
    if (st != KVH_OK)
        return st;
    uint64_t cap = e->tiers[KVH_TIER_DEVICE].slots.capacity;
    uint64_t qs = p.short_device_bytes / e->block_bytes, ql = p.long_device_bytes / e->block_bytes;
    if (qs > cap || ql > cap - qs) {
        kvhi_leave(e);
        return kvhi_fail(KVH_ERR_INVALID_ARG, "pool quotas of %llu + %llu blocks exceed the device tier's %llu",
                         (unsigned long long)qs, (unsigned long long)ql, (unsigned long long)cap);
    }
    kvhi_admission *a = &e->contexts->admission;
    a->enabled = p.short_device_bytes || p.long_device_bytes;
    a->short_max_tokens = p.short_max_tokens;
    a->quota_blocks[0] = qs;
    a->quota_blocks[1] = ql;
    return kvhi_api_leave(e, KVH_OK);
}

kvh_status kvh_admission_info_get(kvh_engine *e, kvh_admission_info *info)
{
    kvhi_clear_error();
    KVHI_REQUIRE(info, "info is NULL");
    uint32_t size;
    kvh_status st = kvhi_info_size(info, KVHI_STRUCT_SIZE_MIN, sizeof(*info), "kvh_admission_info", &size);
    if (st != KVH_OK)
        return st;
    st = kvhi_api_enter_contexts(e);
    if (st != KVH_OK)
        return st;
    kvhi_admission_reclaim(e);
    kvhi_admission *a = &e->contexts->admission;
    kvh_admission_info r = {
        .struct_size = sizeof(r),
        .enabled = a->enabled,
        .short_max_tokens = a->short_max_tokens,
        .short_quota_blocks = a->quota_blocks[0],
        .long_quota_blocks = a->quota_blocks[1],
        .short_reserved_blocks = a->reserved_blocks[0],
        .long_reserved_blocks = a->reserved_blocks[1],
        .short_admitted = a->admitted[0],
        .long_admitted = a->admitted[1],
        .short_rejected = a->rejected[0],
        .long_rejected = a->rejected[1],
    };
    kvhi_api_leave(e, KVH_OK);
    kvhi_write_info(info, size, &r);
    return KVH_OK;
}

kvh_status kvh_seq_create_ex(kvh_engine *e, const kvh_seq_params *params, kvh_seq *seq)
{
    kvhi_clear_error();
    KVHI_REQUIRE(params && seq, "params and seq must not be NULL");
    kvh_seq_params p;
    seq_defaults(&p);
    kvh_status st = kvhi_read_params(&p, sizeof(p), params, KVHI_STRUCT_SIZE_MIN, "kvh_seq_params");
    if (st != KVH_OK)
        return st;
    st = kvhi_api_enter_contexts(e);
    if (st != KVH_OK)
        return st;
    kvhi_context *x = NULL;
    if (p.context.id && (st = kvhi_context_resolve(e, p.context, &x)) != KVH_OK) {
        return kvhi_api_leave(e, st);
    }
    int pool;
    uint64_t blocks;
    st = kvhi_admission_reserve(e, p.token_budget, &pool, &blocks);
    kvh_seq h = {0};
    bool bound = false;
    if (st == KVH_OK)
        st = kvhi_seq_create(e, p.agent, &h);
    /* Bound: an admission record was filed (only a request in a pool). */
    if (st == KVH_OK &&
        (st = kvhi_admission_bind(e, pool, blocks, kvhi_handles_get(&e->seqs, h.id, NULL), h.id)) == KVH_OK)
        bound = pool >= 0;
    if (st == KVH_OK && x)
        st = kvhi_context_attach(e, x, h.id);
    if (st != KVH_OK) {
        if (h.id) {
            kvhi_seq *s = kvhi_handles_get(&e->seqs, h.id, NULL);
            kvhi_handles_remove(&e->seqs, kvhi_handle_index(h.id));
            kvhi_seq_destroy(e, s);
        }
        if (bound) {
            /* Not admitted after all: the counter says what callers got. */
            e->contexts->admission.admitted[pool]--;
            kvhi_admission_reclaim(e); /* sweeps the dead handle */
        } else
            kvhi_admission_cancel(e, pool, blocks);
    }
    kvhi_api_leave(e, st);
    if (st == KVH_OK)
        *seq = h;
    return st;
}
