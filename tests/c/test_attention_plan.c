/* Persistent attention plans (abi/api_attention_plan.c): a plan's runs
 * equal the one-shot calls bit for bit (decode and prefill, GQA, batches
 * of mixed lengths), see later writes into planned tokens, hold their
 * blocks in the device tier until destroyed, and are validated; plans left
 * open are destroyed by kvh_engine_close. */
#include <stdbool.h>

#include "test_util.h"

enum { L = 2, H = 2, D = 64, BT = 16 };

static float val(uint64_t a, uint64_t b)
{
    tu_rng r = {a * 1000003u + b};
    return (float)((int64_t)(tu_next(&r) % 2001) - 1000) / 700.0f;
}

static kvh_seq make_seq(kvh_engine *e, size_t n, uint32_t salt)
{
    kvh_seq s = tu_seq_new(e, 0);
    int32_t *tok = tu_alloc(sizeof(int32_t) * n);
    tu_iota(tok, n, (int32_t)(salt * 10000));
    assert_ok(kvh_seq_append(e, s, tok, n));
    float *kv = tu_alloc(sizeof(float) * n * H * D);
    for (uint32_t l = 0; l < L; l++) {
        for (size_t i = 0; i < n * H * D; i++)
            kv[i] = val(salt * 7 + l, i);
        assert_ok(kvh_seq_write_kv(e, s, l, 0, n, kv, kv));
    }
    tu_free(tok);
    tu_free(kv);
    return s;
}

static void test_runs_equal_one_shot(void **state)
{
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F32, 64, 16, 1);
    kvh_seq s[3] = {make_seq(e, 5, 1), make_seq(e, 70, 2), make_seq(e, 33, 3)};
    kvh_attention_params p;
    assert_ok(kvh_attention_params_init(&p, sizeof(p)));
    p.num_q_heads = 4;
    p.threads = 2;
    const size_t row = 4 * D;
    float q[3 * 4 * D], a[3 * 4 * D], b[3 * 4 * D];
    for (size_t i = 0; i < sizeof(q) / sizeof(q[0]); i++)
        q[i] = val(99, i);
    /* decode */
    kvh_attention_plan *pl = NULL;
    assert_ok(kvh_attention_plan_create(e, 1, s, NULL, 3, &p, &pl));
    assert_ok(kvh_attention_decode(e, 1, s, 3, q, a, &p));
    memset(b, 0xff, sizeof(b));
    assert_ok(kvh_attention_run(e, pl, q, b, NULL));
    assert_memory_equal(a, b, sizeof(float) * 3 * row);
    /* The plan holds its blocks in the device tier. */
    assert_int_equal(tu_seq_binfo(e, s[1], 2).holds, 1);
    assert_ok(kvh_seq_migrate(e, s[1], 0, 70, KVH_TIER_HOST, NULL));
    assert_int_equal(tu_seq_binfo(e, s[1], 2).tier, KVH_TIER_DEVICE);
    /* A later write into a planned token is seen by the next run. */
    float kv[H * D];
    for (int i = 0; i < H * D; i++)
        kv[i] = 3.0f;
    assert_ok(kvh_seq_write_kv(e, s[2], 1, 32, 1, kv, kv));
    assert_ok(kvh_attention_decode(e, 1, s, 3, q, a, &p));
    assert_ok(kvh_attention_run(e, pl, q, b, NULL));
    assert_memory_equal(a, b, sizeof(float) * 3 * row);
    assert_ok(kvh_attention_plan_destroy(e, pl));
    assert_int_equal(tu_seq_binfo(e, s[1], 2).holds, 0);
    /* prefill chunks of 3, 10 and 1 rows */
    uint32_t ql[3] = {3, 10, 1};
    float pq[14 * 4 * D], pa[14 * 4 * D], pb[14 * 4 * D];
    for (size_t i = 0; i < sizeof(pq) / sizeof(pq[0]); i++)
        pq[i] = val(98, i);
    assert_ok(kvh_attention_plan_create(e, 0, s, ql, 3, &p, &pl));
    assert_ok(kvh_attention_prefill(e, 0, s, ql, 3, pq, pa, &p));
    assert_ok(kvh_attention_run(e, pl, pq, pb, NULL));
    assert_memory_equal(pa, pb, sizeof(pa));
    /* left open: kvh_engine_close destroys it (teardown) */
}

static void test_plan_arguments(void **state)
{
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F32, 8, 16, 1);
    kvh_seq s = make_seq(e, 20, 4);
    kvh_attention_plan *pl = NULL;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_plan_create(e, 0, &s, NULL, 1, NULL, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_plan_create(e, 0, &s, NULL, 0, NULL, &pl));
    assert_kvh(KVH_ERR_RANGE, kvh_attention_plan_create(e, L, &s, NULL, 1, NULL, &pl));
    uint32_t too_many = 21;
    assert_kvh(KVH_ERR_RANGE, kvh_attention_plan_create(e, 0, &s, &too_many, 1, NULL, &pl));
    kvh_seq gone = make_seq(e, 3, 5);
    assert_ok(kvh_seq_free(e, gone));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_attention_plan_create(e, 0, &gone, NULL, 1, NULL, &pl));
    assert_ok(kvh_seq_migrate(e, s, 0, 20, KVH_TIER_HOST, NULL));
    assert_kvh(KVH_ERR_NOT_RESIDENT, kvh_attention_plan_create(e, 0, &s, NULL, 1, NULL, &pl));
    assert_int_equal(tu_seq_binfo(e, s, 0).holds, 0); /* nothing left held */
    assert_ok(kvh_seq_acquire(e, s, 0, 20, NULL));
    assert_ok(kvh_attention_plan_create(e, 0, &s, NULL, 1, NULL, &pl));
    assert_ok(kvh_seq_release(e, s, 0, 20));
    float q[H * D] = {0}, out[H * D];
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_run(e, NULL, q, out, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_run(e, pl, NULL, out, NULL));
    assert_ok(kvh_attention_run(e, pl, q, out, NULL));
    assert_ok(kvh_attention_plan_destroy(e, pl));
    assert_ok(kvh_attention_plan_destroy(e, NULL));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_runs_equal_one_shot, tu_teardown),
        cmocka_unit_test_teardown(test_plan_arguments, tu_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
