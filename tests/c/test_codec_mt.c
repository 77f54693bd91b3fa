/* KV codecs, views and attention plans under concurrency (labelled
 * `concurrency`: also run under TSan).
 *
 * An engine with an int8 host tier, LCTRU eviction and a memfd device
 * tier, two migration workers and a device tier smaller than the threads'
 * KV: four threads each write a sequence, demote it asynchronously (the
 * workers encode), read it back within the codec's bound, promote it,
 * attend through a kept plan and through a view and compare the two with
 * the one-shot call, bit for bit. */
#include <math.h>
#include <stdbool.h>

#include "test_util.h"
#include "mt_util.h"

enum { L = 2, H = 2, D = 64, BT = 16, THREADS = 4, ROUNDS = 6, TOKENS = 3 * BT + 7 };

#define WCHECK(call)                                                                                                   \
    do {                                                                                                               \
        kvh_status st_ = (call);                                                                                       \
        if (st_ != KVH_OK) {                                                                                           \
            mt_report(w, "%s: %s (%s)", #call, kvh_status_name(st_), kvh_last_error());                                \
            goto out;                                                                                                  \
        }                                                                                                              \
    } while (0)
#define WFAIL(...)                                                                                                     \
    do {                                                                                                               \
        mt_report(w, __VA_ARGS__);                                                                                     \
        goto out;                                                                                                      \
    } while (0)

static void *worker_main(void *arg)
{
    mt_worker *w = arg;
    kvh_engine *e = w->e;
    const size_t per = (size_t)TOKENS * H * D;
    float *k = malloc(sizeof(float) * per), *r = malloc(sizeof(float) * per);
    float q[4 * D], a[4 * D], b[4 * D], c[4 * D];
    kvh_seq s = {0};
    kvh_attention_plan *plan = NULL;
    kvh_vmap *view = NULL;
    if (!k || !r)
        WFAIL("out of memory");
    for (int round = 0; round < ROUNDS; round++) {
        tu_rng g = {(uint64_t)w->t * 1000 + (uint64_t)round};
        for (size_t i = 0; i < per; i++)
            k[i] = (float)((int64_t)(tu_next(&g) % 2001) - 1000) / 400.0f;
        for (int i = 0; i < 4 * D; i++)
            q[i] = (float)((int64_t)(tu_next(&g) % 201) - 100) / 100.0f;
        int32_t tok[TOKENS];
        for (int i = 0; i < TOKENS; i++)
            tok[i] = w->t * 100000 + round * 1000 + i;
        WCHECK(kvh_seq_create(e, (uint32_t)w->t, &s));
        WCHECK(kvh_seq_append(e, s, tok, TOKENS));
        for (uint32_t l = 0; l < L; l++)
            WCHECK(kvh_seq_write_kv(e, s, l, 0, TOKENS, k, k));
        WCHECK(kvh_seq_set_tolerance(e, s, 0, TOKENS, (uint32_t)(w->t * 60)));
        kvh_fence f;
        WCHECK(kvh_seq_migrate(e, s, 0, TOKENS, KVH_TIER_HOST, &f));
        WCHECK(kvh_fence_wait(e, f, UINT64_MAX));
        WCHECK(kvh_fence_free(e, f));
        WCHECK(kvh_seq_read_kv(e, s, 1, 0, TOKENS, r, NULL));
        for (size_t v = 0; v < (size_t)TOKENS * H; v++) {
            double amax = 0;
            for (int i = 0; i < D; i++)
                amax = fmax(amax, fabs(k[v * D + i]));
            for (int i = 0; i < D; i++)
                if (!(fabs(r[v * D + i] - k[v * D + i]) <= amax / 254 * 1.0001))
                    WFAIL("thread %d round %d: value %zu off by more than the int8 bound", w->t, round, v * D + i);
        }
        WCHECK(kvh_seq_acquire(e, s, 0, TOKENS, NULL));
        kvh_attention_params p;
        WCHECK(kvh_attention_params_init(&p, sizeof(p)));
        p.num_q_heads = 4;
        p.threads = 1;
        WCHECK(kvh_attention_plan_create(e, 1, &s, NULL, 1, &p, &plan));
        WCHECK(kvh_seq_vmap(e, s, 1, 0, &view));
        WCHECK(kvh_seq_release(e, s, 0, TOKENS));
        WCHECK(kvh_attention_decode(e, 1, &s, 1, q, a, &p));
        WCHECK(kvh_attention_run(e, plan, q, b, NULL));
        WCHECK(kvh_attention_decode_vmap(e, &view, 1, q, c, &p));
        if (memcmp(a, b, sizeof(a)) || memcmp(a, c, sizeof(a)))
            WFAIL("thread %d round %d: plan or view differs from the one-shot call", w->t, round);
        WCHECK(kvh_vmap_release(e, view));
        view = NULL;
        WCHECK(kvh_attention_plan_destroy(e, plan));
        plan = NULL;
        WCHECK(kvh_seq_free(e, s));
        s.id = 0;
    }
out:
    if (view)
        kvh_vmap_release(e, view);
    if (plan)
        kvh_attention_plan_destroy(e, plan);
    if (s.id)
        kvh_seq_free(e, s);
    free(k);
    free(r);
    return NULL;
}

static void test_codec_views_plans_concurrently(void **state)
{
    /* Device: room for every thread to hold its sequence at once, little more. */
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F32, THREADS * 4 + 2, 64, 2);
    c.kv_codec = KVH_CODEC_INT8;
    c.eviction_policy = KVH_EVICT_LCTRU;
    c.vmap = 1;
    kvh_engine *e = tu_open_cfg(&c);
    mt_worker w[THREADS];
    mt_run(e, THREADS, worker_main, w);
    assert_ok(tu_close(e));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_codec_views_plans_concurrently, tu_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
