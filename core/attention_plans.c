/* Persistent attention plans: a prepared call (core/attention_call.c)
 * kept alive, its holds included, and on a backend with device memory
 * its arrays uploaded once. A run only launches kernels, which is what
 * CUDA graph capture needs. */
#include <stdlib.h>

#include "core/attention_call.h"
#include "core/move.h"

/* What a kvh_attention_plan * names: its value is a handle of
 * e->attn_plans (core/handles.h), never this struct's address. */
typedef struct kvhi_attention_plan {
    kvhi_attn_call call;
    void *uploaded; /* backend handle (CUDA), or NULL: run from call.plan */
    /* Runs between their lookup and their return: destroy waits for them
     * (after taking the plan out of the table, so that no new run finds
     * it), since a run reads the plan with the lock dropped. */
    uint32_t runs;
    bool destroying;
} kvhi_attention_plan;

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

static void run_done(void *arg) { (void)arg; }

kvh_status kvhi_attn_plan_create(kvh_engine *e, uint32_t layer, const kvh_seq *seqs, const uint32_t *q_lens,
                                 size_t n_seqs, const kvh_attention_params *pr, uint64_t rows, uint64_t *id)
{
    kvhi_assert_locked(e);
    kvhi_attention_plan *pl = calloc(1, sizeof(*pl));
    if (!pl)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for an attention plan");
    pl->call.e = e;
    kvh_status st = KVH_OK;
    if (e->cpu_kernels && !kvhi_attn_state(e))
        st = kvhi_fail(KVH_ERR_NOMEM, "out of memory for the attention state");
    if (st == KVH_OK)
        st = kvhi_attn_call_prepare(e, layer, seqs, q_lens, n_seqs, q_lens != NULL, pr, rows, &pl->call);
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
    if (st == KVH_OK && kvhi_handles_add(&e->attn_plans, pl, id, NULL) != 0)
        st = kvhi_fail(KVH_ERR_NOMEM, "out of memory for an attention plan (or 2^24 of them exist)");
    if (st != KVH_OK)
        plan_free(e, pl);
    return st;
}

kvh_status kvhi_attn_plan_run(kvh_engine *e, uint64_t id, const void *q, void *out, void *stream)
{
    kvhi_assert_locked(e);
    kvhi_attention_plan *pl = kvhi_handles_get(&e->attn_plans, id, NULL);
    if (!pl)
        return bad_plan();
    /* The kernels run unlocked: the plan's holds keep its blocks in
     * place, its run count the plan. */
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
    if (rc != 0)
        return kvhi_fail(rc < 0 ? rc : KVH_ERR_INTERNAL, "attention kernels: %s", msg);
    return KVH_OK;
}

kvh_status kvhi_attn_plan_destroy(kvh_engine *e, uint64_t id)
{
    kvhi_assert_locked(e);
    uint32_t index;
    kvhi_attention_plan *pl = kvhi_handles_get(&e->attn_plans, id, &index);
    if (!pl)
        return bad_plan();
    kvhi_handles_remove(&e->attn_plans, index);
    pl->destroying = true;
    while (pl->runs)
        pthread_cond_wait(&e->changed, &e->lock);
    plan_free(e, pl);
    return KVH_OK;
}

void kvhi_attn_plans_free_all(kvh_engine *e)
{
    pthread_mutex_lock(&e->lock);
    for (uint32_t i = 0; i < e->attn_plans.cap; i++) {
        kvhi_attention_plan *pl = kvhi_handles_at(&e->attn_plans, i);
        if (pl) {
            kvhi_handles_remove(&e->attn_plans, i);
            plan_free(e, pl);
        }
    }
    kvhi_handles_destroy(&e->attn_plans);
    pthread_mutex_unlock(&e->lock);
}
