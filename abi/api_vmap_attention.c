/* Decode and prefill attention over virtually contiguous views (core/vmap.c). Each
 * view is one sequence's layer laid out like a contiguous KV array, which
 * the kernels read as a single block of capacity_tokens tokens: the block
 * table has one entry. Every sequence gets a plan of its own (views do not
 * share a base address), built with the options and tile size the paged
 * call would use, so the result is the paged result bit for bit.
 *
 * The views' holds keep their blocks in place; nothing is held here. What
 * a run needs instead is that its view is not remapped while its kernels
 * read it: each run counts in its view's `pending` and in the engine's
 * active calls until the backend's completion callback (on CUDA a host
 * callback queued on the caller's stream after the kernels, so the call
 * returns before they finish), and refresh, release and close wait. */
#include <stdlib.h>

#include "abi/api_attention.h"
#include "abi/api_common.h"
#include "core/attention_call.h"
#include "core/vmap.h"
#include "kernels/attention_plan.h"
#include "kernels/cpu/attn_cpu.h"

static kvh_status attention_vmap(kvh_engine *e, kvh_vmap *const *views, const uint32_t *q_lens, size_t n_views,
                                 const void *q, void *out, const kvh_attention_params *params)
{
    kvhi_clear_error();
    /* The engine and params are checked by the paged calls' own checks, so
     * that the views refuse exactly what kvh_attention_decode refuses
     * (given no sequences, that is all they check). */
    kvh_attention_params pr;
    uint64_t no_rows = 0;
    kvh_status st = kvhi_attn_check_args(e, 0, NULL, NULL, 0, false, NULL, NULL, params, &pr, &no_rows);
    if (st != KVH_OK)
        return st;
    const kvh_config *c = &e->cfg;
    KVHI_REQUIRE(views || n_views == 0, "views is NULL");
    /* As the paged calls: q and out may be NULL where there are no rows. */
    uint64_t rows = q_lens ? 0 : n_views;
    for (size_t i = 0; q_lens && i < n_views; i++)
        rows += q_lens[i];
    KVHI_REQUIRE(rows == 0 || (q && out), "q and out must not be NULL");
    for (size_t i = 0; i < n_views; i++)
        KVHI_REQUIRE(views[i], "views[%zu] is NULL", i);

    if (!e->backend->attention_run || !e->backend->attention_plan_opts)
        return kvhi_fail(KVH_ERR_UNSUPPORTED, "the %s backend has no attention kernels", e->backend->name);

    /* The views the handles name, looked up under the lock and read
     * without it. */
    kvhi_vmap *few[8], **vs = n_views <= 8 ? few : malloc(sizeof(*vs) * n_views);
    if (!vs)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for %zu views", n_views);
    st = kvhi_enter(e);
    if (st != KVH_OK) {
        if (vs != few)
            free(vs);
        return st;
    }
    if (e->cpu_kernels)
        kvhi_attn_state(e);
    for (size_t i = 0; i < n_views && st == KVH_OK; i++) {
        kvhi_vmap *v = vs[i] = kvhi_vmap_resolve(e, views[i]);
        if (!v)
            st = kvhi_fail(KVH_ERR_BAD_HANDLE, "view %zu is released, forged or of another engine", i);
        else if (!kvhi_vmap_current(e, v))
            st = kvhi_fail(KVH_ERR_BAD_HANDLE, "view %zu is stale: the sequence changed (kvh_vmap_refresh it)", i);
        else if ((v->n_tokens == 0 && (!q_lens || q_lens[i])) || v->n_tokens >= (1ull << 31))
            st = kvhi_fail(KVH_ERR_RANGE, "view %zu maps %llu tokens", i, (unsigned long long)v->n_tokens);
        else if (q_lens && q_lens[i] > v->n_tokens)
            st = kvhi_fail(KVH_ERR_RANGE, "view %zu: %u query tokens but only %llu tokens", i, q_lens[i],
                           (unsigned long long)v->n_tokens);
    }
    if (st == KVH_OK && e->cpu_kernels && !e->attn_state)
        st = kvhi_fail(KVH_ERR_NOMEM, "out of memory for the attention state");
    if (st != KVH_OK) {
        kvhi_api_leave(e, st);
        if (vs != few)
            free(vs);
        return st;
    }
    kvhi_attn_plan_opts opts = {0};
    e->backend->attention_plan_opts(e->backend_ctx, pr.threads, &opts);
    /* Split-K granules of the paged call: whole engine blocks. */
    opts.chunk_quantum = c->block_tokens;
    /* Every run to come is pending on its view and registered with the
     * engine until its completion callback (or until it fails to start). */
    for (size_t i = 0; i < n_views; i++)
        if (!q_lens || q_lens[i]) {
            vs[i]->pending++;
            e->active_calls++;
        }
    /* The views cannot change while the call runs (@threads handle), and
     * their holds keep the blocks in place: the lock is not needed. */
    pthread_mutex_unlock(&e->lock);

    uint64_t row_bytes = (uint64_t)pr.num_q_heads * c->head_dim * kvhi_dtype_bytes(pr.io_dtype), row = 0;
    /* Out over q, whole or in part: a view's rows written would be queries
     * of the views after it, so every run reads a copy (CPU runs end
     * before the call returns; on CUDA they must not overlap). */
    bool no_copy = false;
    void *q_kept = e->cpu_kernels ? kvhi_attn_q_kept(q, out, rows * row_bytes, &no_copy) : NULL;
    if (no_copy)
        st = kvhi_fail(KVH_ERR_NOMEM, "out of memory for a copy of q (out overlaps it)");
    if (q_kept)
        q = q_kept;
    size_t i = 0;
    for (; i < n_views && st == KVH_OK; i++) {
        kvhi_vmap *v = vs[i];
        kvhi_attn_plan p = {0};
        p.num_q_heads = pr.num_q_heads;
        p.num_kv_heads = c->num_kv_heads;
        p.head_dim = c->head_dim;
        p.block_tokens = (uint32_t)v->cap_tokens;
        for (p.block_shift = 0; (1ull << p.block_shift) < v->cap_tokens; p.block_shift++)
            ;
        p.kv_dtype = c->dtype;
        p.io_dtype = pr.io_dtype;
        p.scale = pr.scale;
        p.block_bytes = 0; /* one block: slot 0 */
        p.layer_offset = 0;
        p.kv_base = v->base;
        p.cpu_state = e->cpu_kernels ? e->attn_state : NULL;
        p.threads = pr.threads;
        p.tile_tokens = c->block_tokens < KVHI_ATTN_TILE ? c->block_tokens : KVHI_ATTN_TILE;
        uint32_t kv_len = (uint32_t)v->n_tokens, q_len = q_lens ? q_lens[i] : 1;
        if (q_len == 0)
            continue;
        if (kvhi_attn_plan_build(&p, &opts, &kv_len, &q_len, 1) != 0) {
            st = kvhi_fail(KVH_ERR_NOMEM, "out of memory for an attention plan");
            break; /* view i did not start */
        }
        p.slots[0] = 0;
        char msg[256] = "";
        int rc = e->backend->attention_run(e->backend_ctx, &p, (const uint8_t *)q + row * row_bytes,
                                           (uint8_t *)out + row * row_bytes, pr.stream, kvhi_vmap_attention_done, v,
                                           msg, sizeof(msg));
        row += q_len;
        kvhi_attn_plan_free(&p);
        if (rc != 0) {
            st = kvhi_fail(rc < 0 ? rc : KVH_ERR_INTERNAL, "attention kernels: %s", msg);
            break; /* view i did not start */
        }
    }
    free(q_kept);
    pthread_mutex_lock(&e->lock);
    /* Runs that never started: no callback will end them. */
    for (; i < n_views; i++)
        if (!q_lens || q_lens[i]) {
            vs[i]->pending--;
            e->active_calls--;
        }
    pthread_cond_broadcast(&e->changed);
    kvhi_api_leave(e, st);
    if (vs != few)
        free(vs);
    return st;
}

kvh_status kvh_attention_decode_vmap(kvh_engine *e, kvh_vmap *const *views, size_t n_views, const void *q, void *out,
                                     const kvh_attention_params *params)
{
    return attention_vmap(e, views, NULL, n_views, q, out, params);
}

kvh_status kvh_attention_prefill_vmap(kvh_engine *e, kvh_vmap *const *views, const uint32_t *q_lens, size_t n_views,
                                      const void *q, void *out, const kvh_attention_params *params)
{
    kvhi_clear_error();
    KVHI_REQUIRE(q_lens || n_views == 0, "q_lens is NULL");
    return attention_vmap(e, views, q_lens, n_views, q, out, params);
}
