/* KV codecs (kernels/cpu/kv_codec.c, core/codec_tier.c): round trips on
 * random data stay inside the documented error bounds for every codec,
 * dtype and head_dim, also at the ends of the f32 range; non-finite input
 * is handled as documented; an engine
 * with a codec holds more blocks in its host tier, keeps KV within the
 * bounds through demotion to host and disk and promotion back, and a disk
 * store remembers its codec. */
#include <math.h>
#include <stdbool.h>

#include "test_util.h"
#include "kernels/attention_dtype.h"

static const uint32_t codecs[] = {KVH_CODEC_INT8, KVH_CODEC_Q4_G32, KVH_CODEC_Q4_G64};
static const uint32_t dtypes[] = {KVH_DTYPE_F32, KVH_DTYPE_F16, KVH_DTYPE_BF16};

static float gauss(tu_rng *r)
{
    double u1 = ((double)(tu_next(r) >> 11) + 0.5) / 9007199254740992.0;
    double u2 = ((double)(tu_next(r) >> 11) + 0.5) / 9007199254740992.0;
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

static uint32_t group_of(uint32_t codec, uint32_t d)
{
    return codec == KVH_CODEC_INT8 ? d : codec == KVH_CODEC_Q4_G32 ? 32 : 64;
}

/* The documented bound for element i of vector x: half the codec's step
 * over its group. */
static double half_step(uint32_t codec, uint32_t d, const float *x, uint32_t i)
{
    uint32_t g = group_of(codec, d), g0 = i / g * g;
    double lo = INFINITY, hi = -INFINITY, amax = 0;
    for (uint32_t j = g0; j < g0 + g; j++) {
        lo = fmin(lo, x[j]);
        hi = fmax(hi, x[j]);
        amax = fmax(amax, fabs(x[j]));
    }
    return codec == KVH_CODEC_INT8 ? amax / 254.0 : (hi - lo) / 30.0;
}

/* Largest error allowed for element i: the bound plus rounding to the
 * dtype. */
static double allowed(uint32_t codec, uint32_t dtype, uint32_t d, const float *x, uint32_t i, double decoded)
{
    double ulp = dtype == KVH_DTYPE_F16 ? 0x1p-11 : dtype == KVH_DTYPE_BF16 ? 0x1p-8 : 0x1p-23;
    return half_step(codec, d, x, i) * (1 + 1e-5) + fabs(decoded) * ulp + 1e-30;
}

static void test_round_trip_bounds(void **state)
{
    tu_rng r = {tu_seed(41)};
    const uint32_t dims[] = {64, 128, 256, 96};
    for (size_t ci = 0; ci < 3; ci++)
        for (size_t di = 0; di < 3; di++)
            for (size_t hi = 0; hi < 4; hi++) {
                uint32_t c = codecs[ci], dt = dtypes[di], d = dims[hi];
                uint64_t rec = 0;
                if (d % group_of(c, d)) {
                    assert_kvh(KVH_ERR_INVALID_ARG, kvh_codec_vector_bytes(c, dt, d, &rec));
                    continue;
                }
                assert_ok(kvh_codec_vector_bytes(c, dt, d, &rec));
                const size_t n = 64;
                uint32_t eb = tu_dtype_size(dt);
                float *x = tu_alloc(sizeof(float) * d * n);
                uint8_t *raw = tu_alloc((size_t)eb * d * n), *back = tu_alloc((size_t)eb * d * n);
                uint8_t *enc = tu_alloc(rec * n);
                for (size_t i = 0; i < d * n; i++) {
                    /* Vectors of varied magnitude, some with an outlier. */
                    float v = gauss(&r) * (float)(1u << (i / d % 8)) * 0.05f;
                    if (tu_below(&r, 97) == 0)
                        v *= 30.0f;
                    kvhi_store_from_f32(dt, raw, i, v);
                    x[i] = kvhi_load_as_f32(dt, raw, i);
                }
                assert_ok(kvh_codec_encode(c, dt, d, raw, n, enc));
                assert_ok(kvh_codec_decode(c, dt, d, enc, n, back));
                for (size_t v = 0; v < n; v++)
                    for (uint32_t i = 0; i < d; i++) {
                        double y = kvhi_load_as_f32(dt, back, v * d + i);
                        double err = fabs(y - x[v * d + i]);
                        if (!(err <= allowed(c, dt, d, x + v * d, i, y)))
                            fail_msg("codec %u dtype %u d %u: vector %zu elem %u: %g vs %g", c, dt, d, v, i, y,
                                     (double)x[v * d + i]);
                    }
                tu_free(x);
                tu_free(raw);
                tu_free(back);
                tu_free(enc);
            }
}

static void test_sizes_and_arguments(void **state)
{
    uint64_t b = 0;
    assert_ok(kvh_codec_vector_bytes(KVH_CODEC_NONE, KVH_DTYPE_F16, 128, &b));
    assert_int_equal(b, 256);
    assert_ok(kvh_codec_vector_bytes(KVH_CODEC_INT8, KVH_DTYPE_F16, 128, &b));
    assert_int_equal(b, 132);
    assert_ok(kvh_codec_vector_bytes(KVH_CODEC_Q4_G32, KVH_DTYPE_F16, 128, &b));
    assert_int_equal(b, 64 + 4 * 8);
    assert_ok(kvh_codec_vector_bytes(KVH_CODEC_Q4_G64, KVH_DTYPE_F16, 128, &b));
    assert_int_equal(b, 64 + 2 * 8);
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_codec_vector_bytes(KVH_CODEC_Q4_G64, KVH_DTYPE_F16, 80, &b));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_codec_vector_bytes(9, KVH_DTYPE_F16, 128, &b));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_codec_vector_bytes(KVH_CODEC_INT8, 7, 128, &b));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_codec_vector_bytes(KVH_CODEC_INT8, KVH_DTYPE_F16, 0, &b));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_codec_vector_bytes(KVH_CODEC_INT8, KVH_DTYPE_F16, 64, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_codec_encode(KVH_CODEC_INT8, KVH_DTYPE_F32, 64, NULL, 1, &b));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_codec_decode(KVH_CODEC_INT8, KVH_DTYPE_F32, 64, &b, 1, NULL));
    assert_ok(kvh_codec_encode(KVH_CODEC_INT8, KVH_DTYPE_F32, 64, NULL, 0, NULL));
}

static void test_non_finite_and_constant(void **state)
{
    for (size_t ci = 0; ci < 3; ci++) {
        uint32_t c = codecs[ci];
        float x[64], y[64];
        uint8_t enc[512];
        for (int i = 0; i < 64; i++)
            x[i] = (float)(i % 7) - 3.0f;
        x[5] = INFINITY;
        x[6] = -INFINITY;
        x[7] = NAN;
        assert_ok(kvh_codec_encode(c, KVH_DTYPE_F32, 64, x, 1, enc));
        assert_ok(kvh_codec_decode(c, KVH_DTYPE_F32, 64, enc, 1, y));
        for (int i = 0; i < 64; i++)
            assert_true(isfinite(y[i]));
        assert_true(y[5] >= 2.9f); /* the largest finite value, about 3 */
        assert_true(y[6] <= -2.9f);
        /* A constant (here all-zero) vector comes back exactly. */
        for (int i = 0; i < 64; i++)
            x[i] = c == KVH_CODEC_INT8 ? 0.0f : 1.5f;
        assert_ok(kvh_codec_encode(c, KVH_DTYPE_F32, 64, x, 1, enc));
        assert_ok(kvh_codec_decode(c, KVH_DTYPE_F32, 64, enc, 1, y));
        for (int i = 0; i < 64; i++)
            assert_true(y[i] == x[i]);
    }
}

/* The ends of the f32 range (found by fuzz_api). A vector whose largest
 * magnitude is subnormal has a scale whose reciprocal overflowed a float:
 * its zeros came back as the largest value. A Q4 group spanning more than
 * FLT_MAX (max - min overflows) decoded to NaN. Both now stay within the
 * bound, plus 2^-143 for the subnormal scale's own rounding. */
static void test_extreme_magnitudes(void **state)
{
    const float tiny[] = {1e-39f, 1e-41f, 1e-44f, 0x1p-126f};
    for (size_t ci = 0; ci < 3; ci++)
        for (size_t ti = 0; ti < 4; ti++) {
            uint32_t c = codecs[ci];
            float x[64], y[64];
            uint8_t enc[512];
            for (int i = 0; i < 64; i++)
                x[i] = i % 4 == 0 ? 0.0f : tiny[ti] * (float)(i % 9 - 4) / 4;
            assert_ok(kvh_codec_encode(c, KVH_DTYPE_F32, 64, x, 1, enc));
            assert_ok(kvh_codec_decode(c, KVH_DTYPE_F32, 64, enc, 1, y));
            for (int i = 0; i < 64; i++) /* no absolute slack here but 2^-143 */
                if (!(fabs((double)y[i] - x[i]) <=
                      half_step(c, 64, x, (uint32_t)i) * (1 + 1e-5) + fabs(y[i]) * 0x1p-23 + 0x1p-143))
                    fail_msg("codec %u, magnitude %g: element %d: %g decoded as %g", c, (double)tiny[ti], i,
                             (double)x[i], (double)y[i]);
        }
    for (size_t ci = 0; ci < 3; ci++) {
        uint32_t c = codecs[ci];
        float x[64], y[64];
        uint8_t enc[512];
        for (int i = 0; i < 64; i++)
            x[i] = (i % 2 ? 3e38f : -3e38f) * ((float)(i % 5) / 4);
        assert_ok(kvh_codec_encode(c, KVH_DTYPE_F32, 64, x, 1, enc));
        assert_ok(kvh_codec_decode(c, KVH_DTYPE_F32, 64, enc, 1, y));
        for (int i = 0; i < 64; i++) {
            assert_true(isfinite(y[i]));
            if (!(fabs((double)y[i] - x[i]) <= allowed(c, KVH_DTYPE_F32, 64, x, (uint32_t)i, y[i])))
                fail_msg("codec %u: element %d: %g decoded as %g", c, i, (double)x[i], (double)y[i]);
        }
    }
}

/* Engine geometry used below: 2 layers, 2 heads, head_dim 64, 16 tokens. */
enum { L = 2, H = 2, D = 64, BT = 16 };

static kvh_config codec_cfg(uint32_t codec, uint64_t dev_blocks, uint64_t host_blocks)
{
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F32, dev_blocks, host_blocks, 1);
    c.kv_codec = codec;
    return c;
}

static void test_engine_host_holds_more(void **state)
{
    uint64_t raw_block = tu_block_bytes_of(L, H, D, BT, KVH_DTYPE_F32);
    for (size_t ci = 0; ci < 3; ci++) {
        kvh_config c = codec_cfg(codecs[ci], 2, 8);
        kvh_engine *e = tu_open_cfg(&c);
        kvh_tier_info dev = tu_tier(e, KVH_TIER_DEVICE), host = tu_tier(e, KVH_TIER_HOST);
        uint64_t rec = 0;
        assert_ok(kvh_codec_vector_bytes(codecs[ci], KVH_DTYPE_F32, D, &rec));
        assert_int_equal(dev.block_bytes, raw_block);
        assert_int_equal(dev.capacity_blocks, 2);
        assert_int_equal(host.block_bytes, rec * 2 * L * H * BT);
        assert_int_equal(host.capacity_blocks, 8 * raw_block / host.block_bytes);
        assert_true(host.capacity_blocks >= 8 * 3);
        assert_ok(tu_close(e));
    }
    kvh_config c = codec_cfg(7, 2, 8);
    kvh_engine *e = NULL;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(&c, &e));
    c = codec_cfg(KVH_CODEC_Q4_G64, 2, 8);
    c.head_dim = 96;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(&c, &e));
}

/* Reads layer l of tokens [0, n) and compares with the written values. */
static double check_close(kvh_engine *e, kvh_seq s, uint32_t codec, const float *k, const float *v, size_t n,
                          bool exact)
{
    double worst = 0;
    size_t per = (size_t)n * H * D;
    float *rk = tu_alloc(sizeof(float) * per), *rv = tu_alloc(sizeof(float) * per);
    for (uint32_t l = 0; l < L; l++) {
        assert_ok(kvh_seq_read_kv(e, s, l, 0, n, rk, rv));
        for (size_t vec = 0; vec < n * H; vec++)
            for (uint32_t i = 0; i < D; i++) {
                for (int kv = 0; kv < 2; kv++) {
                    const float *x = (kv ? v : k) + l * per + vec * D;
                    double got = (kv ? rv : rk)[vec * D + i];
                    double err = fabs(got - x[i]);
                    worst = fmax(worst, err);
                    double lim = exact ? 0 : allowed(codec, KVH_DTYPE_F32, D, x, i, got);
                    if (!(err <= lim))
                        fail_msg("codec %u layer %u vec %zu elem %u: %g vs %g (%s)", codec, l, vec, i, got,
                                 (double)x[i], exact ? "exact" : "bound");
                }
            }
    }
    tu_free(rk);
    tu_free(rv);
    return worst;
}

static void fill_kv(tu_rng *r, float *k, float *v, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        k[i] = gauss(r);
        v[i] = gauss(r) * 0.5f;
    }
}

static void test_engine_demote_promote(void **state)
{
    tu_rng r = {tu_seed(42)};
    const size_t n = 3 * BT + 5, per = n * H * D;
    float *k = tu_alloc(sizeof(float) * per * L), *v = tu_alloc(sizeof(float) * per * L);
    int32_t tokens[3 * BT + 5];
    tu_iota(tokens, n, 100);
    for (size_t ci = 0; ci < 3; ci++) {
        uint32_t codec = codecs[ci];
        fill_kv(&r, k, v, per * L);
        kvh_config c = codec_cfg(codec, 8, 8);
        char dir[512];
        snprintf(dir, sizeof(dir), "%s/codec%u", getenv("KVH_TEST_TMPDIR") ? getenv("KVH_TEST_TMPDIR") : "/tmp",
                 codec);
        c.disk_path = dir;
        c.disk_bytes = 64ull << 20;
        c.disk_flags = KVH_DISK_RESET_ON_MISMATCH;
        kvh_engine *e = tu_open_cfg(&c);
        kvh_seq s = tu_seq_new(e, 0);
        assert_ok(kvh_seq_append(e, s, tokens, n));
        for (uint32_t l = 0; l < L; l++)
            assert_ok(kvh_seq_write_kv(e, s, l, 0, n, k + l * per, v + l * per));
        check_close(e, s, codec, k, v, n, true); /* raw in the device tier */
        assert_ok(kvh_seq_migrate(e, s, 0, n, KVH_TIER_HOST, NULL));
        assert_int_equal(tu_seq_binfo(e, s, 0).tier, KVH_TIER_HOST);
        /* Decoded from host: within the bound, and really quantised. */
        assert_true(check_close(e, s, codec, k, v, n, false) > 0);
        assert_ok(kvh_seq_migrate(e, s, 0, n, KVH_TIER_DISK, NULL));
        assert_int_equal(tu_seq_binfo(e, s, 1).tier, KVH_TIER_DISK);
        assert_ok(kvh_seq_acquire(e, s, 0, n, NULL)); /* disk -> device */
        assert_int_equal(tu_seq_binfo(e, s, 2).tier, KVH_TIER_DEVICE);
        check_close(e, s, codec, k, v, n, false);
        assert_ok(kvh_seq_release(e, s, 0, n));
        /* Attention over the promoted blocks sees the decoded values. */
        float q[H * D], out[H * D];
        for (int i = 0; i < H * D; i++)
            q[i] = gauss(&r);
        kvh_attention_params p;
        assert_ok(kvh_attention_params_init(&p, sizeof(p)));
        p.threads = 1;
        assert_ok(kvh_seq_acquire(e, s, 0, n, NULL));
        assert_ok(kvh_attention_decode(e, 0, &s, 1, q, out, &p));
        assert_ok(kvh_seq_release(e, s, 0, n));
        for (int i = 0; i < H * D; i++)
            assert_true(isfinite(out[i]) && fabsf(out[i]) < 10.0f);
        assert_ok(kvh_seq_free(e, s));
        assert_ok(tu_close(e));
    }
}

/* KV written while the block sits in the (encoded) host tier is encoded
 * token by token; tokens written earlier are not re-quantised. */
static void test_engine_write_into_host(void **state)
{
    tu_rng r = {tu_seed(43)};
    const size_t n = 2 * BT, per = n * H * D;
    float *k = tu_alloc(sizeof(float) * per * L), *v = tu_alloc(sizeof(float) * per * L);
    fill_kv(&r, k, v, per * L);
    int32_t tokens[2 * BT];
    tu_iota(tokens, n, 7);
    kvh_config c = codec_cfg(KVH_CODEC_INT8, 1, 8);
    kvh_engine *e = tu_open_cfg(&c);
    kvh_seq s = tu_seq_new(e, 0);
    assert_ok(kvh_seq_append(e, s, tokens, n));
    assert_ok(kvh_seq_migrate(e, s, 0, n, KVH_TIER_HOST, NULL));
    assert_int_equal(tu_seq_binfo(e, s, 0).tier, KVH_TIER_HOST);
    /* Write in two halves: the second must not disturb the first. */
    for (uint32_t l = 0; l < L; l++) {
        assert_ok(kvh_seq_write_kv(e, s, l, 0, BT / 2, k + l * per, v + l * per));
        assert_ok(kvh_seq_write_kv(e, s, l, BT / 2, n - BT / 2, k + l * per + BT / 2 * H * D,
                                   v + l * per + BT / 2 * H * D));
    }
    assert_int_equal(tu_seq_binfo(e, s, 0).tier, KVH_TIER_HOST);
    check_close(e, s, KVH_CODEC_INT8, k, v, n, false);
    /* Fork + write: the copy-on-write copy keeps the other tokens' values. */
    kvh_seq child;
    assert_ok(kvh_seq_fork(e, s, 0, &child));
    assert_ok(kvh_seq_write_kv(e, child, 0, 0, 1, k, v));
    check_close(e, child, KVH_CODEC_INT8, k, v, n, false);
    assert_ok(kvh_seq_free(e, child));
    assert_ok(kvh_seq_free(e, s));
}

static void test_disk_store_remembers_codec(void **state)
{
    char dir[512];
    snprintf(dir, sizeof(dir), "%s/codec_store", getenv("KVH_TEST_TMPDIR") ? getenv("KVH_TEST_TMPDIR") : "/tmp");
    kvh_config c = codec_cfg(KVH_CODEC_INT8, 4, 4);
    c.disk_path = dir;
    c.disk_bytes = 16ull << 20;
    c.disk_flags = KVH_DISK_RESET_ON_MISMATCH;
    kvh_engine *e = tu_open_cfg(&c);
    assert_ok(tu_close(e));
    c.disk_flags = 0;
    e = tu_open_cfg(&c); /* same codec: accepted */
    assert_ok(tu_close(e));
    c.kv_codec = KVH_CODEC_Q4_G32;
    assert_kvh(KVH_ERR_MISMATCH, kvh_engine_open(&c, &e));
    c.kv_codec = KVH_CODEC_NONE;
    assert_kvh(KVH_ERR_MISMATCH, kvh_engine_open(&c, &e));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_round_trip_bounds, tu_teardown),
        cmocka_unit_test_teardown(test_sizes_and_arguments, tu_teardown),
        cmocka_unit_test_teardown(test_non_finite_and_constant, tu_teardown),
        cmocka_unit_test_teardown(test_extreme_magnitudes, tu_teardown),
        cmocka_unit_test_teardown(test_engine_host_holds_more, tu_teardown),
        cmocka_unit_test_teardown(test_engine_demote_promote, tu_teardown),
        cmocka_unit_test_teardown(test_engine_write_into_host, tu_teardown),
        cmocka_unit_test_teardown(test_disk_store_remembers_codec, tu_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
