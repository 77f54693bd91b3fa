/* Persistent attention plans (abi/api_attention_plan.c): a plan's runs
 * equal the one-shot calls bit for bit (decode and prefill, GQA, batches
 * of mixed lengths), see later writes into planned tokens, hold their
 * blocks in the device tier until destroyed, and are validated; plans left
 * open are destroyed by kvh_engine_close. A destroyed, forged or foreign
 * plan is KVH_ERR_BAD_HANDLE, and no plan value is handed out twice. */
#include <stdbool.h>
#include <stdint.h>

#include "test_util.h"
#include "core/handles.h"

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

static kvh_attention_plan *plan_of(kvh_engine *e, kvh_seq s)
{
    kvh_attention_plan *pl = NULL;
    assert_ok(kvh_attention_plan_create(e, 0, &s, NULL, 1, NULL, &pl));
    return pl;
}

static kvh_attention_plan *forged_plan(uint64_t id) { return (kvh_attention_plan *)(uintptr_t)id; }

/* Every call taking the plan refuses it; the caller's memory is untouched. */
static void check_bad_plan(kvh_engine *e, kvh_attention_plan *pl)
{
    float q[H * D] = {0}, out[H * D];
    memset(out, 0x5a, sizeof(out));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_attention_run(e, pl, q, out, NULL));
    for (size_t i = 0; i < sizeof(out); i++)
        assert_int_equal(((const uint8_t *)out)[i], 0x5a);
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_attention_plan_destroy(e, pl));
}

/* A destroyed plan stays bad, also once a new plan may take its memory
 * (and its slot); destroying it again changes nothing. */
static void test_destroyed_plan_is_bad(void **state)
{
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F32, 8, 16, 1);
    kvh_seq s = make_seq(e, 20, 6);
    float q[H * D] = {0}, out[H * D];
    kvh_attention_plan *gone = plan_of(e, s);
    assert_ok(kvh_attention_plan_destroy(e, gone));
    check_bad_plan(e, gone);
    kvh_attention_plan *live = plan_of(e, s);
    assert_ptr_not_equal(live, gone);
    check_bad_plan(e, gone);
    assert_ok(kvh_attention_run(e, live, q, out, NULL));
    assert_int_equal(tu_seq_binfo(e, s, 0).holds, 1); /* the live plan's */
    assert_ok(kvh_attention_plan_destroy(e, live));
    assert_int_equal(tu_seq_binfo(e, s, 0).holds, 0);
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_attention_plan_destroy(e, live));
}

/* Values no create handed out: small integers, an address of plan-sized
 * zeroed memory, and the live plan's value with its generation one off
 * either way or its index out of range. */
static void test_forged_plan_is_bad(void **state)
{
    static uint64_t zeroed[256];
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F32, 8, 16, 1);
    kvh_seq s = make_seq(e, 20, 7);
    kvh_attention_plan *live = plan_of(e, s);
    uint64_t id = (uint64_t)(uintptr_t)live;
    uint8_t tag = kvhi_handle_tag(id);
    uint32_t gen = kvhi_handle_gen(id), idx = kvhi_handle_index(id);
    check_bad_plan(e, forged_plan(0x1234));
    check_bad_plan(e, forged_plan(1));
    check_bad_plan(e, forged_plan(UINT64_MAX));
    check_bad_plan(e, (kvh_attention_plan *)zeroed);
    check_bad_plan(e, forged_plan(kvhi_handle_make(tag, gen + 1, idx)));
    check_bad_plan(e, forged_plan(kvhi_handle_make(tag, gen - 1, idx)));
    check_bad_plan(e, forged_plan(kvhi_handle_make(tag, gen, idx + 1000)));
    float q[H * D] = {0}, out[H * D];
    assert_ok(kvh_attention_run(e, live, q, out, NULL));
    assert_ok(kvh_attention_plan_destroy(e, live));
}

/* A plan names a plan of its own engine only. */
static void test_plan_of_another_engine_is_bad(void **state)
{
    kvh_engine *a = tu_open(L, H, D, BT, KVH_DTYPE_F32, 8, 16, 1);
    kvh_engine *b = tu_open(L, H, D, BT, KVH_DTYPE_F32, 8, 16, 1);
    kvh_seq sa = make_seq(a, 20, 8), sb = make_seq(b, 20, 9);
    kvh_attention_plan *pa = plan_of(a, sa), *pb = plan_of(b, sb);
    check_bad_plan(b, pa);
    check_bad_plan(a, pb);
    float q[H * D] = {0}, out[H * D];
    assert_ok(kvh_attention_run(a, pa, q, out, NULL));
    assert_ok(kvh_attention_run(b, pb, q, out, NULL));
    assert_int_equal(tu_seq_binfo(a, sa, 0).holds, 1);
    assert_int_equal(tu_seq_binfo(b, sb, 0).holds, 1);
    assert_ok(kvh_attention_plan_destroy(a, pa));
    assert_ok(kvh_attention_plan_destroy(b, pb));
}

/* A plan left open is destroyed by close; its value means nothing to the
 * next engine, even one at the same address. */
static void test_plan_after_close_is_bad(void **state)
{
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F32, 8, 16, 1);
    kvh_attention_plan *pl = plan_of(e, make_seq(e, 20, 10));
    assert_ok(tu_close(e));
    kvh_engine *next = tu_open(L, H, D, BT, KVH_DTYPE_F32, 8, 16, 1);
    check_bad_plan(next, pl);
    kvh_attention_plan *fresh = plan_of(next, make_seq(next, 20, 11));
    check_bad_plan(next, pl);
    assert_ok(kvh_attention_plan_destroy(next, fresh));
}

/* Create/destroy cycles reuse the same memory and table slot, yet no
 * value comes back, and every earlier one stays bad. */
static void test_plan_values_never_repeat(void **state)
{
    enum { CYCLES = 2000 };
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F32, 8, 16, 1);
    kvh_seq s = make_seq(e, 20, 12);
    uintptr_t *seen = tu_alloc(sizeof(*seen) * CYCLES);
    for (int i = 0; i < CYCLES; i++) {
        kvh_attention_plan *pl = plan_of(e, s);
        seen[i] = (uintptr_t)pl;
        for (int j = 0; j < i; j++)
            if (seen[j] == seen[i])
                fail_msg("create %d handed out the value of create %d again (%#jx)", i, j, (uintmax_t)seen[i]);
        assert_ok(kvh_attention_plan_destroy(e, pl));
    }
    kvh_attention_plan *live = plan_of(e, s);
    for (int i = 0; i < CYCLES; i += 97)
        check_bad_plan(e, (kvh_attention_plan *)seen[i]);
    float q[H * D] = {0}, out[H * D];
    assert_ok(kvh_attention_run(e, live, q, out, NULL));
    assert_ok(kvh_attention_plan_destroy(e, live));
    assert_int_equal(tu_seq_binfo(e, s, 0).holds, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_runs_equal_one_shot, tu_teardown),
        cmocka_unit_test_teardown(test_plan_arguments, tu_teardown),
        cmocka_unit_test_teardown(test_destroyed_plan_is_bad, tu_teardown),
        cmocka_unit_test_teardown(test_forged_plan_is_bad, tu_teardown),
        cmocka_unit_test_teardown(test_plan_of_another_engine_is_bad, tu_teardown),
        cmocka_unit_test_teardown(test_plan_after_close_is_bad, tu_teardown),
        cmocka_unit_test_teardown(test_plan_values_never_repeat, tu_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
