/* LCTRU victim order (core/lctru.c): with equal or close recency the
 * compression-tolerant block leaves the device tier first (and, with a KV
 * codec, is the one compressed); tolerance 0 or a tiny window give the
 * LRU-K order; tolerances are set per range or block, inherited by
 * copy-on-write copies and validated. */
#include <math.h>
#include <stdbool.h>

#include "test_util.h"

enum { D = 64, BT = 16 };

static kvh_engine *open_policy(uint32_t policy, uint32_t window, uint32_t codec)
{
    kvh_config c = tu_cfg(1, 1, D, BT, KVH_DTYPE_F32, 4, 16, 0);
    c.lru_k = 1;
    c.eviction_policy = policy;
    c.lctru_window = window;
    c.kv_codec = codec;
    return tu_open_cfg(&c);
}

/* One-block sequence with KV written: values i * 0.37 + tag. */
static kvh_seq one_block(kvh_engine *e, float tag)
{
    kvh_seq s = tu_seq_new(e, 0);
    int32_t tok[BT];
    tu_iota(tok, BT, (int32_t)(tag * 1000));
    assert_ok(kvh_seq_append(e, s, tok, BT));
    float kv[BT * D];
    for (int i = 0; i < BT * D; i++)
        kv[i] = (float)i * 0.37f + tag;
    assert_ok(kvh_seq_write_kv(e, s, 0, 0, BT, kv, kv));
    return s;
}

static void touch(kvh_engine *e, kvh_seq s)
{
    float k[BT * D];
    assert_ok(kvh_seq_read_kv(e, s, 0, 0, BT, k, NULL));
}

/* Four device-resident blocks used in order A, B, C, D; then a fifth
 * block is brought into the full device tier. Returns the index (0..3) of
 * the one that left. */
static int victim_seqs(kvh_engine *e, const uint32_t tolerance[4], kvh_seq s[4])
{
    kvh_seq extra = one_block(e, 9);
    assert_ok(kvh_seq_migrate(e, extra, 0, BT, KVH_TIER_HOST, NULL));
    for (int i = 0; i < 4; i++)
        s[i] = one_block(e, (float)i);
    for (int i = 0; i < 4; i++) {
        touch(e, s[i]);
        assert_ok(kvh_seq_set_tolerance(e, s[i], 0, BT, tolerance[i]));
        assert_int_equal(tu_seq_binfo(e, s[i], 0).tolerance, tolerance[i]);
        assert_int_equal(tu_seq_binfo(e, s[i], 0).tier, KVH_TIER_DEVICE);
    }
    assert_ok(kvh_seq_acquire(e, extra, 0, BT, NULL));
    int gone = -1;
    for (int i = 0; i < 4; i++)
        if (tu_seq_binfo(e, s[i], 0).tier != KVH_TIER_DEVICE) {
            assert_int_equal(gone, -1);
            gone = i;
        }
    assert_ok(kvh_seq_release(e, extra, 0, BT));
    return gone;
}

static int victim(kvh_engine *e, const uint32_t tolerance[4])
{
    kvh_seq s[4];
    return victim_seqs(e, tolerance, s);
}

static void test_tolerant_block_leaves_first(void **state)
{
    const uint32_t last_tolerant[4] = {0, 0, 0, 255};
    const uint32_t none[4] = {0, 0, 0, 0};
    /* LRU-K ignores tolerance: the oldest goes. */
    assert_int_equal(victim(open_policy(KVH_EVICT_LRU_K, 0, 0), last_tolerant), 0);
    /* LCTRU: the most recent block, fully tolerant, goes instead. */
    assert_int_equal(victim(open_policy(KVH_EVICT_LCTRU, 1000, 0), last_tolerant), 3);
    /* Tolerance 0 everywhere: exactly LRU-K. */
    assert_int_equal(victim(open_policy(KVH_EVICT_LCTRU, 1000, 0), none), 0);
    /* A window of one access: recency dominates again. */
    assert_int_equal(victim(open_policy(KVH_EVICT_LCTRU, 1, 0), last_tolerant), 0);
    /* Partial tolerance: ordered by how far it moves the block back. */
    const uint32_t graded[4] = {0, 255, 40, 0};
    assert_int_equal(victim(open_policy(KVH_EVICT_LCTRU, 1000, 0), graded), 1);
    /* In an engine's first window of accesses too: both tolerant blocks'
     * shifts reach past its first access, and they tied there, so the
     * less tolerant (and older) one could leave first. */
    const uint32_t early[4] = {0, 100, 255, 0};
    assert_int_equal(victim(open_policy(KVH_EVICT_LCTRU, 1000, 0), early), 2);
}

/* With a codec, leaving the device tier is compression: the tolerant block
 * is the one that comes back quantised, the intolerant ones stay exact. */
static void test_tolerant_block_is_compressed(void **state)
{
    const uint32_t tol[4] = {0, 0, 255, 0};
    kvh_engine *e = open_policy(KVH_EVICT_LCTRU, 1000, KVH_CODEC_INT8);
    kvh_seq s[4];
    assert_int_equal(victim_seqs(e, tol, s), 2);
    for (int i = 0; i < 4; i++) {
        float k[BT * D];
        double worst = 0;
        assert_ok(kvh_seq_read_kv(e, s[i], 0, 0, BT, k, NULL));
        for (int j = 0; j < BT * D; j++)
            worst = fmax(worst, fabs(k[j] - ((float)j * 0.37f + (float)i)));
        if (i == 2)
            assert_true(worst > 0 && worst <= 382.0 / 254); /* int8: <= max|x| / 254 */
        else
            assert_true(worst == 0);
    }
}

static void test_set_tolerance_rules(void **state)
{
    kvh_engine *e = open_policy(KVH_EVICT_LCTRU, 0, 0);
    kvh_seq s = one_block(e, 1);
    assert_int_equal(tu_seq_binfo(e, s, 0).tolerance, KVH_TOLERANCE_DEFAULT);
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_set_tolerance(e, s, 0, BT, 256));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_set_tolerance(e, s, 0, BT + 1, 3));
    assert_ok(kvh_seq_set_tolerance(e, s, 0, 0, 3)); /* empty range */
    kvh_block b = tu_seq_block(e, s, 0);
    assert_ok(kvh_block_set_tolerance(e, b, 77));
    assert_int_equal(tu_binfo(e, b).tolerance, 77);
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_block_set_tolerance(e, b, 1000));
    /* A copy-on-write copy keeps the tolerance. */
    kvh_seq child;
    assert_ok(kvh_seq_fork(e, s, 0, &child));
    float kv[D];
    memset(kv, 0, sizeof(kv));
    assert_ok(kvh_seq_write_kv(e, child, 0, 3, 1, kv, kv));
    assert_true(tu_seq_block(e, child, 0).id != b.id);
    assert_int_equal(tu_seq_binfo(e, child, 0).tolerance, 77);
    kvh_config c = tu_cfg(1, 1, D, BT, KVH_DTYPE_F32, 4, 16, 0);
    c.eviction_policy = 3;
    kvh_engine *bad = NULL;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(&c, &bad));
}

/* Tolerance derived from the codec's error on each block: a block whose
 * vectors are nearly constant (int8 exact) gets the maximum, one with an
 * outlier per vector (large error for the rest) a low one. */
static void test_derived_tolerance(void **state)
{
    kvh_engine *e = open_policy(KVH_EVICT_LCTRU, 0, KVH_CODEC_Q4_G64);
    kvh_seq s = tu_seq_new(e, 0);
    int32_t tok[2 * BT];
    tu_iota(tok, 2 * BT, 1);
    assert_ok(kvh_seq_append(e, s, tok, 2 * BT));
    float kv[2 * BT * D];
    for (int t = 0; t < 2 * BT; t++)
        for (int d = 0; d < D; d++) /* block 0: 16 levels exactly; block 1: an outlier */
            kv[t * D + d] = t < BT ? (float)(d % 16) : (d == 0 ? 1000.0f : (float)d * 0.01f);
    assert_ok(kvh_seq_write_kv(e, s, 0, 0, 2 * BT, kv, kv));
    assert_ok(kvh_seq_derive_tolerance(e, s, 0, 2 * BT, 0));
    assert_int_equal(tu_seq_binfo(e, s, 0).tolerance, KVH_TOLERANCE_MAX);
    uint32_t low = tu_seq_binfo(e, s, 1).tolerance;
    assert_true(low < KVH_TOLERANCE_MAX);
    /* A stricter bound lowers it further; the host tier keeps its value. */
    assert_ok(kvh_seq_derive_tolerance(e, s, BT, BT, 1e-6f));
    assert_int_equal(tu_seq_binfo(e, s, 1).tolerance, 0);
    assert_ok(kvh_seq_migrate(e, s, 0, BT, KVH_TIER_HOST, NULL));
    assert_ok(kvh_seq_set_tolerance(e, s, 0, BT, 9));
    assert_ok(kvh_seq_derive_tolerance(e, s, 0, 2 * BT, 0));
    assert_int_equal(tu_seq_binfo(e, s, 0).tolerance, 9);
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_derive_tolerance(e, s, 0, BT, -1.0f));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_derive_tolerance(e, s, 0, 3 * BT, 0));
    kvh_engine *plain = open_policy(KVH_EVICT_LCTRU, 0, KVH_CODEC_NONE);
    kvh_seq p = one_block(plain, 1);
    assert_kvh(KVH_ERR_UNSUPPORTED, kvh_seq_derive_tolerance(plain, p, 0, BT, 0));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_tolerant_block_leaves_first, tu_teardown),
        cmocka_unit_test_teardown(test_tolerant_block_is_compressed, tu_teardown),
        cmocka_unit_test_teardown(test_set_tolerance_rules, tu_teardown),
        cmocka_unit_test_teardown(test_derived_tolerance, tu_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
