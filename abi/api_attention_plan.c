/* Persistent attention plans (kvh_attention_plan_create / _run /
 * _destroy): the prepared call of api_attention.c kept alive, its holds
 * included, and on a backend with device memory its arrays uploaded once.
 * A run only launches kernels, which is what CUDA graph capture needs. */
#include <stdlib.h>

#include "abi/api_attention.h"
#include "abi/api_common.h"
#include "kernels/cpu/attn_cpu.h"

/* What a kvh_attention_plan * names: its value is a handle of
 * e->attn_plans (core/handles.h), never this struct's address. */
typedef struct kvhi_attention_plan {
    attn_call call;
    kvh_attention_params params;
    void *uploaded; /* backend handle (CUDA), or NULL: run from call.plan */
    /* Runs between their lookup and their return: destroy waits for them
     * (after taking the plan out of the table, so that no new run finds
     * it), since a run reads the plan with the lock dropped. */
    uint32_t runs;
    bool destroying;
} kvhi_attention_plan;

/* The live plan pl names in e, or NULL (lock held). */
static kvhi_attention_plan *plan_get(kvh_engine *e, const kvh_attention_plan *pl, uint32_t *index)
{
    return kvhi_handles_get(&e->attn_plans, kvhi_handle_from_ptr(pl), index);
}

static kvh_status bad_plan(void)
{
    return kvhi_fail(KVH_ERR_BAD_HANDLE, "the attention plan is destroyed, forged or of another engine");
}

/* Lock held for the holds; the backend free runs without it. */
static void plan_free(kvh_engine *e, kvhi_attention_plan *pl)
{
    kvhi_attn_call_release_holds(e, &pl->call);
    void *up = pl->uploaded;
    pthread_mutex_unlock(&e->lock);
    if (up)
        e->backend->attention_plan_free(e->backend_ctx, up);
    kvhi_attn_plan_free(&pl->call.plan);
    free(pl->call.held);
    free(pl->call.held_gen);
    free(pl);
    pthread_mutex_lock(&e->lock);
}

/* e->attn_plan_free: engine_free's way to free a plan left open. */
static void plan_free_left_open(kvh_engine *e, void *pl) { plan_free(e, pl); }

static void run_done(void *arg) { (void)arg; }

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
    if (!e->backend->attention_run || !e->backend->attention_plan_opts)
        return kvhi_fail(KVH_ERR_UNSUPPORTED, "the %s backend has no attention kernels", e->backend->name);
    kvhi_attention_plan *pl = calloc(1, sizeof(*pl));
    if (!pl)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for an attention plan");
    pl->call.e = e;
    pl->params = pr;
    if ((st = kvhi_enter(e)) != KVH_OK) {
        free(pl);
        return st;
    }
    if (e->cpu_kernels && !e->attn_state) {
        e->attn_state = kvhi_attn_cpu_create();
        if (e->attn_state)
            e->attn_state_free = kvhi_attn_cpu_destroy;
        else
            st = kvhi_fail(KVH_ERR_NOMEM, "out of memory for the attention state");
    }
    if (st == KVH_OK)
        st = kvhi_attn_call_prepare(e, layer, seqs, q_lens, n_seqs, prefill, &pr, rows, &pl->call);
    if (st == KVH_OK && e->backend->attention_plan_upload) {
        char msg[256] = "";
        void *up = NULL;
        pthread_mutex_unlock(&e->lock);
        int rc = e->backend->attention_plan_upload(e->backend_ctx, &pl->call.plan, &up, msg, sizeof(msg));
        pthread_mutex_lock(&e->lock);
        if (rc == 0)
            pl->uploaded = up;
        else
            st = kvhi_fail(rc < 0 ? rc : KVH_ERR_INTERNAL, "uploading the attention plan: %s", msg);
    }
    /* Listed only once complete: no call can name a plan half made (close
     * waits for this call). */
    uint64_t id = 0;
    if (st == KVH_OK && kvhi_handles_add(&e->attn_plans, pl, &id, NULL) != 0)
        st = kvhi_fail(KVH_ERR_NOMEM, "out of memory for an attention plan (or 2^24 of them exist)");
    if (st == KVH_OK)
        e->attn_plan_free = plan_free_left_open;
    if (st != KVH_OK) {
        plan_free(e, pl);
        kvhi_leave(e);
        return st;
    }
    kvhi_leave(e);
    *out = kvhi_handle_to_ptr(id);
    return KVH_OK;
}

kvh_status kvh_attention_run(kvh_engine *e, const kvh_attention_plan *plan, const void *q, void *out, void *stream)
{
    kvhi_clear_error();
    KVHI_REQUIRE(e && plan, "engine and plan must not be NULL");
    KVHI_REQUIRE(q && out, "q and out must not be NULL");
    /* Registered as a call (close waits), but the kernels run unlocked:
     * the plan's holds keep its blocks in place, its run count the plan. */
    kvh_status st = kvhi_enter(e);
    if (st != KVH_OK)
        return st;
    kvhi_attention_plan *pl = plan_get(e, plan, NULL);
    if (!pl) {
        kvhi_leave(e);
        return bad_plan();
    }
    pl->runs++;
    pthread_mutex_unlock(&e->lock);
    char msg[256] = "";
    int rc;
    if (pl->uploaded)
        rc = e->backend->attention_run_uploaded(e->backend_ctx, pl->uploaded, q, out, stream, msg, sizeof(msg));
    else
        rc =
            e->backend->attention_run(e->backend_ctx, &pl->call.plan, q, out, stream, run_done, NULL, msg, sizeof(msg));
    pthread_mutex_lock(&e->lock);
    if (--pl->runs == 0 && pl->destroying)
        pthread_cond_broadcast(&e->changed);
    kvhi_leave(e);
    if (rc != 0)
        return kvhi_fail(rc < 0 ? rc : KVH_ERR_INTERNAL, "attention kernels: %s", msg);
    return KVH_OK;
}

kvh_status kvh_attention_plan_destroy(kvh_engine *e, kvh_attention_plan *plan)
{
    kvhi_clear_error();
    if (!plan)
        return KVH_OK;
    kvh_status st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    uint32_t index;
    kvhi_attention_plan *pl = plan_get(e, plan, &index);
    if (!pl) {
        kvhi_leave(e);
        return bad_plan();
    }
    kvhi_handles_remove(&e->attn_plans, index);
    pl->destroying = true;
    while (pl->runs)
        pthread_cond_wait(&e->changed, &e->lock);
    plan_free(e, pl);
    kvhi_leave(e);
    return KVH_OK;
}
