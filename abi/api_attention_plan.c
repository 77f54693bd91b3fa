/* Persistent attention plans (kvh_attention_plan_create / _run /
 * _destroy): the prepared call of api_attention.c kept alive, its holds
 * included, and on a backend with device memory its arrays uploaded once.
 * A run only launches kernels, which is what CUDA graph capture needs. */
#include <stdlib.h>

#include "abi/api_attention.h"
#include "abi/api_common.h"
#include "kernels/cpu/attn_cpu.h"

struct kvh_attention_plan {
    attn_call call;
    kvh_attention_params params;
    void *uploaded; /* backend handle (CUDA), or NULL: run from call.plan */
    struct kvh_attention_plan *next, *prev;
};

static void unlink_plan(kvh_engine *e, kvh_attention_plan *pl)
{
    if (pl->prev)
        pl->prev->next = pl->next;
    else if (e->attn_plans == pl)
        e->attn_plans = pl->next;
    if (pl->next)
        pl->next->prev = pl->prev;
    pl->next = pl->prev = NULL;
}

/* Lock held for the holds; the backend free runs without it. */
static void plan_free(kvh_engine *e, kvh_attention_plan *pl)
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

void kvhi_attention_plans_free(kvh_engine *e)
{
    /* engine_free runs without the lock and with no call active. */
    pthread_mutex_lock(&e->lock);
    while (e->attn_plans) {
        kvh_attention_plan *pl = e->attn_plans;
        unlink_plan(e, pl);
        plan_free(e, pl);
    }
    pthread_mutex_unlock(&e->lock);
}

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
    kvh_status st = kvhi_attn_check_args(e, layer, seqs, q_lens, n_seqs, prefill, placeholder, placeholder,
                                         params, &pr, &rows);
    if (st != KVH_OK)
        return st;
    KVHI_REQUIRE(rows > 0, "the batch has no query rows");
    if (!e->backend->attention_run || !e->backend->attention_plan_opts)
        return kvhi_fail(KVH_ERR_UNSUPPORTED, "the %s backend has no attention kernels", e->backend->name);
    kvh_attention_plan *pl = calloc(1, sizeof(*pl));
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
    if (st == KVH_OK) {
        /* Listed before the upload so that close finds it either way. */
        pl->next = e->attn_plans;
        if (e->attn_plans)
            e->attn_plans->prev = pl;
        e->attn_plans = pl;
        if (e->backend->attention_plan_upload) {
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
        if (st != KVH_OK)
            unlink_plan(e, pl);
    }
    if (st != KVH_OK) {
        plan_free(e, pl);
        kvhi_leave(e);
        return st;
    }
    kvhi_leave(e);
    *out = pl;
    return KVH_OK;
}

kvh_status kvh_attention_run(kvh_engine *e, const kvh_attention_plan *pl, const void *q, void *out, void *stream)
{
    kvhi_clear_error();
    KVHI_REQUIRE(e && pl, "engine and plan must not be NULL");
    KVHI_REQUIRE(q && out, "q and out must not be NULL");
    /* Registered as a call (close waits), but the kernels run unlocked:
     * the plan's holds keep its blocks in place. */
    kvh_status st = kvhi_enter(e);
    if (st != KVH_OK)
        return st;
    pthread_mutex_unlock(&e->lock);
    char msg[256] = "";
    int rc;
    if (pl->uploaded)
        rc = e->backend->attention_run_uploaded(e->backend_ctx, pl->uploaded, q, out, stream, msg, sizeof(msg));
    else
        rc = e->backend->attention_run(e->backend_ctx, &pl->call.plan, q, out, stream, run_done, NULL, msg,
                                       sizeof(msg));
    pthread_mutex_lock(&e->lock);
    kvhi_leave(e);
    if (rc != 0)
        return kvhi_fail(rc < 0 ? rc : KVH_ERR_INTERNAL, "attention kernels: %s", msg);
    return KVH_OK;
}

kvh_status kvh_attention_plan_destroy(kvh_engine *e, kvh_attention_plan *pl)
{
    kvhi_clear_error();
    if (!pl)
        return KVH_OK;
    kvh_status st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    unlink_plan(e, pl);
    plan_free(e, pl);
    kvhi_leave(e);
    return KVH_OK;
}
