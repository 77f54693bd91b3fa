/* Admission by token budget: short and long pools with their own device
 * quotas, NOSPACE before anything is allocated, reservations released
 * when sequences are freed, budgets too large to round to blocks, older
 * kvh_seq_params callers, bad input. */
#include "test_util.h"

enum { L = 2, H = 2, D = 4, BT = 4 };

static kvh_admission_info ainfo(kvh_engine *e)
{
    kvh_admission_info i;
    memset(&i, 0, sizeof(i));
    i.struct_size = sizeof(i);
    assert_ok(kvh_admission_info_get(e, &i));
    return i;
}

static kvh_status request(kvh_engine *e, uint64_t budget, kvh_seq *out)
{
    kvh_seq_params p;
    assert_ok(kvh_seq_params_init(&p, sizeof(p)));
    p.token_budget = budget;
    return kvh_seq_create_ex(e, &p, out);
}

/* 64 device blocks: 16 for short requests (<= 32 tokens), 40 for long. */
static kvh_engine *open_pools(void)
{
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F32, 64, 64, 0);
    uint64_t bb = tu_block_bytes(e);
    kvh_admission_params ap;
    assert_ok(kvh_admission_params_init(&ap, sizeof(ap)));
    assert_int_equal(ap.short_max_tokens, 4096);
    ap.short_max_tokens = 32;
    ap.short_device_bytes = 16 * bb;
    ap.long_device_bytes = 40 * bb;
    assert_ok(kvh_admission_configure(e, &ap));
    return e;
}

static void pools_admit_and_refuse(void **state)
{
    (void)state;
    kvh_engine *e = open_pools();
    kvh_seq s[8];
    /* Four short requests of 16 tokens (4 blocks each) fill the pool. */
    for (int i = 0; i < 4; i++)
        assert_ok(request(e, 16, &s[i]));
    kvh_stats before = tu_stats(e);
    kvh_seq refused = {0};
    assert_kvh(KVH_ERR_NOSPACE, request(e, 1, &refused));
    assert_int_equal(refused.id, 0);
    /* Nothing was allocated for the refused request. */
    kvh_stats after = tu_stats(e);
    assert_int_equal(after.blocks_allocated, before.blocks_allocated);
    /* Long requests use their own pool: the full short pool is no bar. */
    assert_ok(request(e, 33 * 4, &s[4]));                  /* 33 blocks */
    assert_kvh(KVH_ERR_NOSPACE, request(e, 9 * 4, &s[5])); /* 33 + 9 > 40 */
    /* 28 tokens is a short request: its pool is full. */
    assert_kvh(KVH_ERR_NOSPACE, request(e, 7 * 4, &s[5]));
    kvh_admission_info ai = ainfo(e);
    assert_int_equal(ai.short_rejected, 2);
    assert_int_equal(ai.long_rejected, 1);
}

static void pools_short_cannot_be_starved(void **state)
{
    (void)state;
    kvh_engine *e = open_pools();
    kvh_seq longs[2], shorts[4];
    assert_ok(request(e, 160, &longs[0])); /* 40 blocks: the long pool */
    assert_kvh(KVH_ERR_NOSPACE, request(e, 33, &longs[1]));
    for (int i = 0; i < 4; i++)
        assert_ok(request(e, 16, &shorts[i]));
    kvh_admission_info ai = ainfo(e);
    assert_int_equal(ai.enabled, 1);
    assert_int_equal(ai.short_quota_blocks, 16);
    assert_int_equal(ai.long_quota_blocks, 40);
    assert_int_equal(ai.short_reserved_blocks, 16);
    assert_int_equal(ai.long_reserved_blocks, 40);
    assert_int_equal(ai.short_admitted, 4);
    assert_int_equal(ai.long_admitted, 1);
    assert_int_equal(ai.long_rejected, 1);
    /* The admitted sequences grow to their budgets in the device tier. */
    int32_t t[160];
    tu_iota(t, 160, 0);
    assert_ok(kvh_seq_append(e, longs[0], t, 160));
    for (int i = 0; i < 4; i++)
        assert_ok(kvh_seq_append(e, shorts[i], t, 16));
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, 56);
    /* Freeing a sequence releases its reservation. */
    assert_ok(kvh_seq_free(e, shorts[0]));
    assert_int_equal(ainfo(e).short_reserved_blocks, 12);
    assert_ok(request(e, 16, &shorts[0]));
    assert_ok(kvh_seq_free(e, longs[0]));
    assert_int_equal(ainfo(e).long_reserved_blocks, 0);
    assert_ok(request(e, 33, &longs[1]));
}

/* A request that outgrows its budget reserves what it passes it by in its
 * pool, or is refused: the long pool full of budgets, a long request
 * appending past its own cannot take the short pool's room. */
static void growth_past_a_budget_is_reserved(void **state)
{
    (void)state;
    kvh_engine *e = open_pools();
    kvh_seq lng, sht;
    assert_ok(request(e, 36 * 4, &lng)); /* 36 of the long pool's 40 */
    assert_ok(request(e, 16, &sht));     /* 4 of the short pool's 16 */
    int32_t t[64 * 4];
    tu_iota(t, 64 * 4, 0);
    /* Up to its budget and then 4 blocks past it: the pool had them. */
    assert_ok(kvh_seq_append(e, lng, t, 40 * 4));
    assert_int_equal(ainfo(e).long_reserved_blocks, 40);
    /* One token more needs a 41st block: refused, the sequence as it was. */
    kvh_stats before = tu_stats(e);
    assert_kvh(KVH_ERR_NOSPACE, kvh_seq_append(e, lng, t, 1));
    assert_non_null(strstr(kvh_last_error(), "token budget"));
    uint64_t len = 0;
    assert_ok(kvh_seq_length(e, lng, &len));
    assert_int_equal(len, 40 * 4);
    assert_int_equal(tu_stats(e).blocks_allocated, before.blocks_allocated);
    assert_int_equal(ainfo(e).long_reserved_blocks, 40);
    /* The short request still grows to its budget, and the short pool
     * still admits what its quota holds. */
    assert_ok(kvh_seq_append(e, sht, t, 16));
    kvh_seq more;
    assert_ok(request(e, 32, &more)); /* 8 blocks */
    assert_int_equal(ainfo(e).short_reserved_blocks, 12);
    /* Freeing gives everything back, the blocks past the budget too. */
    assert_ok(kvh_seq_free(e, lng));
    assert_int_equal(ainfo(e).long_reserved_blocks, 0);
    assert_ok(request(e, 40 * 4, &lng));
}

/* A sequence that grew past its reservation while admission was off, its
 * last block partly filled: an append into that block takes no block, so
 * a full pool does not refuse it (it did, "would hold N blocks, M more
 * than ... reserved"); one that needs a block still is. */
static void an_append_into_the_last_block_takes_no_reservation(void **state)
{
    (void)state;
    kvh_engine *e = open_pools();
    uint64_t bb = tu_block_bytes(e);
    kvh_seq s, filler;
    assert_ok(request(e, 8, &s)); /* 2 blocks of the short pool's 16 */
    kvh_admission_params off;
    assert_ok(kvh_admission_params_init(&off, sizeof(off)));
    assert_ok(kvh_admission_configure(e, &off));
    int32_t t[16];
    tu_iota(t, 16, 0);
    assert_ok(kvh_seq_append(e, s, t, 14)); /* 4 blocks, the last holding 2 tokens */
    kvh_admission_params on;
    assert_ok(kvh_admission_params_init(&on, sizeof(on)));
    on.short_max_tokens = 32;
    on.short_device_bytes = 16 * bb;
    on.long_device_bytes = 40 * bb;
    assert_ok(kvh_admission_configure(e, &on));
    assert_ok(request(e, 8 * BT, &filler)); /* the short pool full: 2 + 8 + 6 of 16 */
    assert_ok(request(e, 6 * BT, &filler));
    assert_int_equal(ainfo(e).short_reserved_blocks, 16);
    assert_ok(kvh_seq_append(e, s, t, 2));                   /* into the last block's room */
    assert_kvh(KVH_ERR_NOSPACE, kvh_seq_append(e, s, t, 1)); /* a fifth block: no room */
    uint64_t len = 0;
    assert_ok(kvh_seq_length(e, s, &len));
    assert_int_equal(len, 16);
    assert_int_equal(ainfo(e).short_reserved_blocks, 16);
}

/* A prefix match into an admitted sequence goes no further than its pool
 * lets it grow, and reserves only the blocks it matched past the budget. */
static void prefix_match_stays_in_the_pool(void **state)
{
    (void)state;
    kvh_engine *e = open_pools();
    int32_t t[30 * 4];
    tu_iota(t, 30 * 4, 5);
    /* 30 published blocks, from a sequence outside admission. */
    kvh_seq src = tu_seq_new(e, 0);
    assert_ok(kvh_seq_append(e, src, t, 30 * 4));
    tu_write_pattern(e, src, L, H * D * sizeof(float), 1, 0, 30 * 4);
    kvh_seq a, b;
    assert_ok(request(e, 16 * 4, &a));    /* 16 blocks; 24 left in the long pool */
    assert_ok(request(e, 8 * 4 + 1, &b)); /* 9 blocks; 15 left */
    size_t matched = 0;
    /* a may grow to 16 + 15 = 31 blocks: the whole 30 match. */
    assert_ok(kvh_seq_match_prefix(e, a, t, 30 * 4, &matched));
    assert_int_equal(matched, 30 * 4);
    assert_int_equal(ainfo(e).long_reserved_blocks, 16 + 9 + 14);
    /* b may grow to 9 + 1 = 10 blocks. */
    assert_ok(kvh_seq_match_prefix(e, b, t, 30 * 4, &matched));
    assert_int_equal(matched, 10 * 4);
    assert_int_equal(ainfo(e).long_reserved_blocks, 40);
    /* A match shorter than the budget reserves nothing more. */
    kvh_seq c;
    assert_ok(kvh_seq_free(e, b));
    assert_ok(request(e, 10 * 4, &c));
    assert_ok(kvh_seq_match_prefix(e, c, t, 4 * 4, &matched));
    assert_int_equal(matched, 4 * 4);
    assert_int_equal(ainfo(e).long_reserved_blocks, 30 + 10);
    /* A freed sequence's blocks are room for the next match at once. */
    kvh_seq x, y;
    assert_ok(kvh_seq_free(e, a));
    assert_ok(kvh_seq_free(e, c));
    assert_ok(request(e, 31 * 4, &x));
    assert_ok(request(e, 9 * 4, &y)); /* the long pool full: 31 + 9 */
    assert_ok(kvh_seq_free(e, x));
    assert_ok(kvh_seq_match_prefix(e, y, t, 30 * 4, &matched));
    assert_int_equal(matched, 30 * 4);
    assert_int_equal(ainfo(e).long_reserved_blocks, 30);
}

static void budget_zero_and_disabled(void **state)
{
    (void)state;
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F32, 8, 8, 0);
    kvh_seq s;
    /* Without pools every request is admitted, whatever its budget. */
    assert_ok(request(e, 1000000, &s));
    assert_int_equal(ainfo(e).enabled, 0);
    e = open_pools();
    /* No estimate: not subject to admission. */
    for (int i = 0; i < 10; i++)
        assert_ok(request(e, 0, &s));
    assert_int_equal(ainfo(e).short_admitted + ainfo(e).long_admitted, 0);
}

/* A caller built against the first kvh_seq_params (struct_size + agent)
 * still works; the fields it lacks take their defaults. */
static void older_seq_params(void **state)
{
    (void)state;
    kvh_engine *e = open_pools();
    struct {
        uint32_t struct_size;
        uint32_t agent;
    } old = {sizeof(old), 7};
    kvh_seq s;
    assert_ok(kvh_seq_create_ex(e, (const kvh_seq_params *)&old, &s));
    int32_t t[4] = {1, 2, 3, 4};
    assert_ok(kvh_seq_append(e, s, t, 4));
    assert_int_equal(tu_seq_binfo(e, s, 0).agent, 7);
    old.struct_size = 4;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_seq_create_ex(e, (const kvh_seq_params *)&old, &s));
}

/* A budget near UINT64_MAX is no estimate any pool can hold. Rounding it
 * up to blocks used to wrap to 0 blocks, so it was admitted reserving
 * nothing (found by fuzz_api). */
static void huge_budgets_are_refused(void **state)
{
    (void)state;
    kvh_engine *e = open_pools();
    for (uint64_t less = 0; less < 4; less++) {
        kvh_seq s = {0};
        assert_kvh(KVH_ERR_NOSPACE, request(e, UINT64_MAX - less, &s));
        assert_int_equal(s.id, 0);
    }
    kvh_admission_info ai = ainfo(e);
    assert_int_equal(ai.long_reserved_blocks, 0);
    assert_int_equal(ai.long_admitted, 0);
    assert_int_equal(ai.long_rejected, 4);
    /* The long pool is still whole. */
    kvh_seq s;
    assert_ok(request(e, 40 * 4, &s));
    assert_int_equal(ainfo(e).long_reserved_blocks, 40);
}

static void bad_input(void **state)
{
    (void)state;
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F32, 8, 8, 0);
    uint64_t bb = tu_block_bytes(e);
    kvh_admission_params ap;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_admission_params_init(&ap, 3));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_admission_params_init(NULL, sizeof(ap)));
    assert_ok(kvh_admission_params_init(&ap, sizeof(ap)));
    ap.short_device_bytes = 6 * bb;
    ap.long_device_bytes = 3 * bb; /* 9 > 8 device blocks */
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_admission_configure(e, &ap));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_admission_configure(e, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_admission_configure(NULL, &ap));
    kvh_seq_params sp;
    assert_ok(kvh_seq_params_init(&sp, sizeof(sp)));
    kvh_seq s;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_create_ex(e, NULL, &s));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_create_ex(e, &sp, NULL));
    sp.context.id = 0xC700000100000001ull; /* forged */
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_create_ex(e, &sp, &s));
    kvh_admission_info ai;
    ai.struct_size = 12; /* not a multiple of 8 */
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_admission_info_get(e, &ai));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(pools_admit_and_refuse, tu_teardown),
        cmocka_unit_test_teardown(pools_short_cannot_be_starved, tu_teardown),
        cmocka_unit_test_teardown(growth_past_a_budget_is_reserved, tu_teardown),
        cmocka_unit_test_teardown(an_append_into_the_last_block_takes_no_reservation, tu_teardown),
        cmocka_unit_test_teardown(prefix_match_stays_in_the_pool, tu_teardown),
        cmocka_unit_test_teardown(budget_zero_and_disabled, tu_teardown),
        cmocka_unit_test_teardown(older_seq_params, tu_teardown),
        cmocka_unit_test_teardown(huge_budgets_are_refused, tu_teardown),
        cmocka_unit_test_teardown(bad_input, tu_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
