/* Paged attention entry points: argument checks, then the call prepared
 * and run by core/attention_call.c (a plan over device-tier slots and a
 * hold on every block read, released when the kernels finish). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "abi/api_attention.h"
#include "abi/api_params.h"
#include "core/attention_call.h"
#include "kernels/cpu/fp_env.h"

void kvhi_attn_params_defaults(kvh_attention_params *p)
{
    memset(p, 0, sizeof(*p));
    p->struct_size = sizeof(*p);
    p->io_dtype = KVH_DTYPE_F32;
}

kvh_status kvh_attention_params_init(kvh_attention_params *p, size_t struct_size)
{
    kvhi_clear_error();
    if (!p)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "params is NULL");
    kvh_attention_params d;
    kvhi_attn_params_defaults(&d);
    return kvhi_init_params(p, struct_size, &d, sizeof(d), KVHI_STRUCT_SIZE_MIN, "kvh_attention_params");
}

/* Checks the arguments that need no lock; fills *pr and *total_rows. */
kvh_status kvhi_attn_check_args(kvh_engine *e, uint32_t layer, const kvh_seq *seqs, const uint32_t *q_lens,
                                size_t n_seqs, bool prefill, const void *q, const void *out,
                                const kvh_attention_params *params, kvh_attention_params *pr, uint64_t *total_rows)
{
    KVHI_REQUIRE(e, "engine is NULL");
    kvhi_attn_params_defaults(pr);
    if (params) {
        kvh_status st = kvhi_read_params(pr, sizeof(*pr), params, KVHI_STRUCT_SIZE_MIN, "kvh_attention_params");
        if (st != KVH_OK)
            return st;
    }
    const kvh_config *c = &e->cfg;
    KVHI_REQUIRE(pr->io_dtype <= KVH_DTYPE_BF16, "unknown io_dtype %u", pr->io_dtype);
    if (pr->num_q_heads == 0)
        pr->num_q_heads = c->num_kv_heads;
    KVHI_REQUIRE(pr->num_q_heads % c->num_kv_heads == 0, "num_q_heads %u is not a multiple of num_kv_heads %u",
                 pr->num_q_heads, c->num_kv_heads);
    KVHI_REQUIRE(pr->num_q_heads <= KVHI_ATTN_MAX_Q_HEADS, "num_q_heads %u > %u", pr->num_q_heads,
                 KVHI_ATTN_MAX_Q_HEADS);
    KVHI_REQUIRE(isfinite(pr->scale), "scale is not finite");
    if (pr->scale == 0.0f) {
        /* Rounded as in the default floating-point environment, whatever
         * the caller's (kvh.h). The volatiles keep the arithmetic between
         * the two switches. */
        kvhi_fp_env env = kvhi_fp_default_enter();
        volatile float dim = (float)c->head_dim;
        volatile float scale = 1.0f / sqrtf(dim);
        kvhi_fp_leave(env);
        pr->scale = scale;
    }
    if (pr->stream_chunk_blocks || pr->stream_window_blocks) {
        KVHI_REQUIRE(pr->stream_chunk_blocks, "stream_window_blocks is set but stream_chunk_blocks is 0");
        KVHI_REQUIRE(pr->stream_window_blocks >= pr->stream_chunk_blocks,
                     "the streaming window (%u blocks) is smaller than one chunk (%u blocks)", pr->stream_window_blocks,
                     pr->stream_chunk_blocks);
        if (!e->cpu_kernels)
            return kvhi_fail(KVH_ERR_UNSUPPORTED, "streamed attention runs on the CPU backend (this engine uses %s)",
                             e->backend->name);
    }
    KVHI_REQUIRE(seqs || n_seqs == 0, "seqs is NULL");
    KVHI_REQUIRE(!prefill || q_lens || n_seqs == 0, "q_lens is NULL");
    KVHI_REQUIRE(n_seqs <= UINT32_MAX, "too many sequences");
    if (layer >= c->num_layers)
        return kvhi_fail(KVH_ERR_RANGE, "layer %u >= num_layers %u", layer, c->num_layers);
    uint64_t rows = prefill ? 0 : n_seqs;
    if (prefill)
        for (size_t i = 0; i < n_seqs; i++) {
            /* Attention takes sequences of fewer than 2^31 tokens: such a
             * q_len exceeds its sequence's length whatever it is. */
            if (q_lens[i] >= (1u << 31))
                return kvhi_fail(KVH_ERR_RANGE, "q_lens[%zu] = %u is more than any sequence attention takes", i,
                                 q_lens[i]);
            rows += q_lens[i];
        }
    /* More than 2^32 - 1 rows is refused once the sequences are known
     * (kvhi_attn_call_prepare): a q_len past its sequence is KVH_ERR_RANGE
     * first, whatever the total. */
    KVHI_REQUIRE(rows == 0 || (q && out), "q and out must not be NULL");
    *total_rows = rows;
    return KVH_OK;
}

static kvh_status attention(kvh_engine *e, uint32_t layer, const kvh_seq *seqs, const uint32_t *q_lens, size_t n_seqs,
                            bool prefill, const void *q, void *out, const kvh_attention_params *params)
{
    kvhi_clear_error();
    kvh_attention_params pr;
    uint64_t total_rows = 0;
    kvh_status st = kvhi_attn_check_args(e, layer, seqs, q_lens, n_seqs, prefill, q, out, params, &pr, &total_rows);
    if (st != KVH_OK)
        return st;
    if (!e->backend->attention_run || !e->backend->attention_plan_opts)
        return kvhi_fail(KVH_ERR_UNSUPPORTED, "the %s backend has no attention kernels", e->backend->name);

    kvhi_attn_call *c = calloc(1, sizeof(*c));
    if (!c)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for an attention call");
    c->e = e;
    if ((st = kvhi_enter(e)) != KVH_OK) {
        free(c);
        return st;
    }
    st = kvhi_attn_call_prepare(e, layer, seqs, q_lens, n_seqs, prefill, &pr, total_rows, c);
    if (st != KVH_OK || total_rows == 0) {
        kvhi_attn_call_free(c);
        return kvhi_api_leave(e, st);
    }
    /* The call leaves the engine itself (its runs end on workers); a
     * streamed window may have met a full tier, then found room. */
    return kvhi_api_result(kvhi_attn_call_run(e, c, q, out, pr.stream));
}

kvh_status kvh_attention_decode(kvh_engine *e, uint32_t layer, const kvh_seq *seqs, size_t n_seqs, const void *q,
                                void *out, const kvh_attention_params *params)
{
    return attention(e, layer, seqs, NULL, n_seqs, false, q, out, params);
}

kvh_status kvh_attention_prefill(kvh_engine *e, uint32_t layer, const kvh_seq *seqs, const uint32_t *q_lens,
                                 size_t n_seqs, const void *q, void *out, const kvh_attention_params *params)
{
    return attention(e, layer, seqs, q_lens, n_seqs, true, q, out, params);
}
