/* Persistent attention plans (kvh_attention_plan_create / _run /
 * _destroy): argument checks, then core/attention_plans.c. */
#include <stdlib.h>

#include "abi/api_attention.h"
#include "abi/api_common.h"
#include "core/attention_call.h"

kvh_status kvh_attention_plan_create(kvh_engine *e, uint32_t layer, const kvh_seq *seqs, const uint32_t *q_lens,
                                     size_t n_seqs, const kvh_attention_params *params, kvh_attention_plan **out)
{
    kvhi_clear_error();
    KVHI_REQUIRE(out, "plan is NULL");
    kvh_attention_params pr;
    uint64_t rows = 0;
    bool prefill = q_lens != NULL;
    /* No q/out yet: any non-NULL pointers satisfy the check. */
    static const char placeholder[1];
    kvh_status st =
        kvhi_attn_check_args(e, layer, seqs, q_lens, n_seqs, prefill, placeholder, placeholder, params, &pr, &rows);
    if (st != KVH_OK)
        return st;
    KVHI_REQUIRE(rows > 0, "the batch has no query rows");
    if (pr.stream_chunk_blocks)
        return kvhi_fail(KVH_ERR_UNSUPPORTED,
                         "a plan holds its blocks in the device tier: streamed attention runs through the decode "
                         "and prefill calls, not plans");
    if (!e->backend->attention_run || !e->backend->attention_plan_opts)
        return kvhi_fail(KVH_ERR_UNSUPPORTED, "the %s backend has no attention kernels", e->backend->name);
    if ((st = kvhi_enter(e)) != KVH_OK)
        return st;
    uint64_t id = 0;
    st = kvhi_attn_plan_create(e, layer, seqs, q_lens, n_seqs, &pr, rows, &id);
    kvhi_api_leave(e, st);
    if (st == KVH_OK)
        *out = kvhi_handle_to_ptr(id);
    return st;
}

kvh_status kvh_attention_run(kvh_engine *e, const kvh_attention_plan *plan, const void *q, void *out, void *stream)
{
    kvhi_clear_error();
    KVHI_REQUIRE(e && plan, "engine and plan must not be NULL");
    KVHI_REQUIRE(q && out, "q and out must not be NULL");
    /* Registered as a call: close waits for the run. */
    kvh_status st = kvhi_enter(e);
    if (st != KVH_OK)
        return st;
    st = kvhi_attn_plan_run(e, kvhi_handle_from_ptr(plan), q, out, stream);
    return kvhi_api_leave(e, st);
}

kvh_status kvh_attention_plan_destroy(kvh_engine *e, kvh_attention_plan *plan)
{
    kvhi_clear_error();
    if (!plan)
        return KVH_OK;
    kvh_status st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    st = kvhi_attn_plan_destroy(e, kvhi_handle_from_ptr(plan));
    return kvhi_api_leave(e, st);
}
