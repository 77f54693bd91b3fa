/* KV codecs (kernels/cpu/kv_codec.c, core/codec_tier.c): round trips on
 * random data stay inside the documented error bounds for every codec,
 * dtype and head_dim, also at the ends of the f32 range; non-finite input
 * is handled as documented; an engine
 * with a codec holds more blocks in its host tier, keeps KV within the
 * bounds through demotion to host and disk and promotion back, and a disk
 * store remembers its codec. */
#include <float.h>
#include <math.h>
#include <stdbool.h>

#include "test_util.h"
#include "kernels/attention_dtype.h"
#include "kernels/cpu/kv_codec.h"

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

/* Half an ulp of dtype at y, at most: relative for normal values, the
 * subnormals' fixed spacing below them (bf16 keeps f32's exponent range
 * with 7 fraction bits; f16 goes down to 2^-24). */
static double half_ulp(uint32_t dtype, double y)
{
    double rel = dtype == KVH_DTYPE_F16 ? 0x1p-11 : dtype == KVH_DTYPE_BF16 ? 0x1p-8 : 0x1p-24;
    double floor = dtype == KVH_DTYPE_F16 ? 0x1p-25 : dtype == KVH_DTYPE_BF16 ? 0x1p-134 : 0x1p-150;
    return fmax(fabs(y) * rel, floor);
}

/* Largest error allowed for element i: the bound plus rounding to the
 * dtype. */
static double allowed(uint32_t codec, uint32_t dtype, uint32_t d, const float *x, uint32_t i, double decoded)
{
    return half_step(codec, d, x, i) * (1 + 0x1p-23) + half_ulp(dtype, decoded) + 1e-30;
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
    /* Past 2^24 elements the kernels' 32-bit element counts could wrap
     * (head_dim near 2^32 encoded for ever): refused before any read. */
    assert_ok(kvh_codec_vector_bytes(KVH_CODEC_INT8, KVH_DTYPE_F16, 1u << 24, &b));
    assert_int_equal(b, 4 + (1u << 24));
    uint8_t small[64] = {0};
    for (uint32_t c = KVH_CODEC_NONE; c <= KVH_CODEC_Q4_G64; c++) {
        assert_kvh(KVH_ERR_INVALID_ARG, kvh_codec_vector_bytes(c, KVH_DTYPE_F16, (1u << 24) + 64, &b));
        assert_kvh(KVH_ERR_INVALID_ARG, kvh_codec_vector_bytes(c, KVH_DTYPE_F16, UINT32_MAX, &b));
        assert_kvh(KVH_ERR_INVALID_ARG, kvh_codec_encode(c, KVH_DTYPE_F16, UINT32_MAX, small, 1, small + 32));
        assert_kvh(KVH_ERR_INVALID_ARG, kvh_codec_decode(c, KVH_DTYPE_F16, 0xFFFFFF00u, small, 1, small + 32));
    }
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_codec_encode(KVH_CODEC_INT8, KVH_DTYPE_F32, 64, NULL, 1, &b));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_codec_decode(KVH_CODEC_INT8, KVH_DTYPE_F32, 64, &b, 1, NULL));
    assert_ok(kvh_codec_encode(KVH_CODEC_INT8, KVH_DTYPE_F32, 64, NULL, 0, NULL));
    /* A count no buffer can hold is refused before anything is touched
     * (it read and wrote far past small before). */
    const size_t huge[] = {SIZE_MAX, SIZE_MAX / 2, (size_t)PTRDIFF_MAX / 64 + 1};
    for (size_t i = 0; i < sizeof(huge) / sizeof(huge[0]); i++) {
        assert_kvh(KVH_ERR_INVALID_ARG, kvh_codec_encode(KVH_CODEC_INT8, KVH_DTYPE_F16, 64, small, huge[i], small));
        assert_kvh(KVH_ERR_INVALID_ARG, kvh_codec_decode(KVH_CODEC_Q4_G64, KVH_DTYPE_F32, 64, small, huge[i], small));
    }
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
                      half_step(c, 64, x, (uint32_t)i) * (1 + 0x1p-23) + fabs(y[i]) * 0x1p-23 + 0x1p-143))
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

/* Vectors and groups reaching +-FLT_MAX: the top code's value (127 x
 * scale, or min + 15 x scale) rounded past FLT_MAX, so a finite input
 * decoded to infinity. Now every element decodes finite and within the
 * bound, on every instruction set this CPU runs. */
static void test_values_at_flt_max(void **state)
{
    (void)state;
    static const float lows[] = {0.0f, -0x1.e3c676p+127f, -0x1.c697c8p+126f, 0x1.0ed056p+124f, 1e38f, -FLT_MAX};
    static const int isas[] = {KVHI_CODEC_SCALAR, KVHI_CODEC_AVX2, KVHI_CODEC_AVX512};
    for (size_t ii = 0; ii < 3; ii++) {
        if (kvhi_codec_set_isa(isas[ii]) != 0)
            continue;
        for (size_t ci = 0; ci < 3; ci++)
            for (size_t li = 0; li < sizeof(lows) / sizeof(lows[0]); li++)
                for (int top = 0; top < 2; top++) {
                    uint32_t c = codecs[ci];
                    float x[64], y[64];
                    uint8_t enc[512];
                    for (int i = 0; i < 64; i++)
                        x[i] = i % 7 == 3 ? (top ? FLT_MAX : nextafterf(FLT_MAX, 0.0f)) : lows[li];
                    x[60] = -x[3]; /* int8's largest magnitude both ways */
                    if (c != KVH_CODEC_INT8)
                        x[60] = lows[li];
                    assert_ok(kvh_codec_encode(c, KVH_DTYPE_F32, 64, x, 1, enc));
                    assert_ok(kvh_codec_decode(c, KVH_DTYPE_F32, 64, enc, 1, y));
                    for (int i = 0; i < 64; i++)
                        if (!isfinite(y[i]) ||
                            !(fabs((double)y[i] - x[i]) <= allowed(c, KVH_DTYPE_F32, 64, x, (uint32_t)i, y[i])))
                            fail_msg("%s codec %u, min %a: element %d: %a decoded as %a", kvhi_codec_isa_name(isas[ii]),
                                     c, (double)lows[li], i, (double)x[i], (double)y[i]);
                }
    }
    kvhi_codec_set_isa(KVHI_CODEC_AUTO);
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
        snprintf(dir, sizeof(dir), "%s/codec%u", getenv("KVH_TEST_TMPDIR") ? getenv("KVH_TEST_TMPDIR") : "/tmp", codec);
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
        assert_ok(
            kvh_seq_write_kv(e, s, l, BT / 2, n - BT / 2, k + l * per + BT / 2 * H * D, v + l * per + BT / 2 * H * D));
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

/* ---- int8 against a reference written from the format alone ---- */

/* The documented int8 record of x (d floats): scale = max finite |x| / 127
 * as f32 (one ulp lower where 127 x scale overflows a float); code =
 * x / scale rounded to nearest-even in double, saturated at +-127, NaN 0;
 * a zero scale gives +-127 for infinities, else 0. */
static void int8_reference(const float *x, uint32_t d, uint8_t *rec)
{
    float amax = 0.0f;
    for (uint32_t i = 0; i < d; i++)
        if (isfinite(x[i]) && fabsf(x[i]) > amax)
            amax = fabsf(x[i]);
    float scale = amax / 127.0f;
    if (isinf(scale * 127.0f)) /* the top code would decode to infinity */
        scale = nextafterf(scale, 0.0f);
    memcpy(rec, &scale, sizeof(scale));
    double inv = scale > 0.0f ? 1.0 / (double)scale : 0.0;
    for (uint32_t i = 0; i < d; i++) {
        int q;
        if (isnan(x[i]))
            q = 0;
        else if (inv == 0.0)
            q = isinf(x[i]) ? (x[i] > 0 ? 127 : -127) : 0;
        else {
            double v = (double)x[i] * inv;
            q = v >= 127.0 ? 127 : v <= -127.0 ? -127 : (int)nearbyint(v);
        }
        rec[sizeof(float) + i] = (uint8_t)(int8_t)q;
    }
}

/* An element of every kind: ordinary, tiny, huge, subnormal, zero of
 * either sign, infinite, NaN, and exact halves between codes. */
static float special_or_gauss(tu_rng *r, float amp)
{
    switch (tu_below(r, 24)) {
    case 0:
        return INFINITY;
    case 1:
        return -INFINITY;
    case 2:
        return NAN;
    case 3:
        return -0.0f;
    case 4:
        return 0.0f;
    case 5:
        return 1e-40f;
    case 6:
        return amp * (float)((int)tu_below(r, 255) - 127) / 127.0f * 0.5f;
    default:
        return gauss(r) * amp;
    }
}

/* n vectors of d elements in dtype dt (raw) and as f32 (x): ordinary,
 * tiny and huge magnitudes, every other vector with special values. */
static void fill_vectors(tu_rng *r, uint32_t dt, uint32_t d, size_t n, uint8_t *raw, float *x)
{
    for (size_t v = 0; v < n; v++) {
        float amp = v % 8 == 7 ? 1e-38f : v % 8 == 6 ? 1e30f : 3.0f;
        bool specials = v % 2 == 1;
        for (uint32_t i = 0; i < d; i++) {
            float f = specials ? special_or_gauss(r, amp) : gauss(r) * amp;
            /* what the encoder sees: the value in its dtype */
            if (dt == KVH_DTYPE_F16) {
                uint16_t h = kvhi_f32_to_f16(f);
                memcpy(raw + ((size_t)v * d + i) * 2, &h, 2);
                f = kvhi_f16_to_f32(h);
            } else if (dt == KVH_DTYPE_BF16) {
                uint16_t h = kvhi_f32_to_bf16(f);
                memcpy(raw + ((size_t)v * d + i) * 2, &h, 2);
                f = kvhi_bf16_to_f32(h);
            } else {
                memcpy(raw + ((size_t)v * d + i) * 4, &f, 4);
            }
            x[v * d + i] = f;
        }
    }
}

/* f32 y in dtype dt, as the codecs store decoded values. */
static void store_as(uint32_t dt, float y, uint8_t *out)
{
    if (dt == KVH_DTYPE_F16) {
        uint16_t h = kvhi_f32_to_f16(y);
        memcpy(out, &h, 2);
    } else if (dt == KVH_DTYPE_BF16) {
        uint16_t h = kvhi_f32_to_bf16(y);
        memcpy(out, &h, 2);
    } else {
        memcpy(out, &y, 4);
    }
}

/* Every path (scalar, and the vector ones where the CPU has them) gives
 * the reference's bytes, and decodes them to (float)code * scale rounded
 * once to the dtype. */
static void test_int8_matches_the_format(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(77)};
    static const uint32_t dims[] = {1, 7, 8, 64, 100, 128, 256, 300, 520};
    for (size_t di = 0; di < sizeof(dims) / sizeof(dims[0]); di++)
        for (size_t ti = 0; ti < 3; ti++) {
            uint32_t d = dims[di], dt = dtypes[ti], eb = dt == KVH_DTYPE_F32 ? 4 : 2;
            size_t n = 64, rb = sizeof(float) + d;
            float *x = tu_alloc(sizeof(float) * d * n);
            uint8_t *raw = tu_alloc((size_t)eb * d * n), *enc = tu_alloc(rb * n), *want = tu_alloc(rb);
            uint8_t *back = tu_alloc((size_t)eb * d * n);
            fill_vectors(&r, dt, d, n, raw, x);
            assert_ok(kvh_codec_encode(KVH_CODEC_INT8, dt, d, raw, n, enc));
            assert_ok(kvh_codec_decode(KVH_CODEC_INT8, dt, d, enc, n, back));
            for (size_t v = 0; v < n; v++) {
                int8_reference(x + v * d, d, want);
                if (memcmp(enc + v * rb, want, rb) != 0)
                    fail_msg("int8 encode differs from the format: d %u dtype %u vector %zu", d, dt, v);
                float scale;
                memcpy(&scale, want, sizeof(scale));
                for (uint32_t i = 0; i < d; i++) {
                    uint8_t expect[4];
                    store_as(dt, (float)(int8_t)want[sizeof(float) + i] * scale, expect);
                    if (memcmp(back + ((size_t)v * d + i) * eb, expect, eb) != 0)
                        fail_msg("int8 decode differs: d %u dtype %u vector %zu element %u", d, dt, v, i);
                }
            }
        }
}

/* The documented q4 record of x (d floats, groups of g): per group
 * [scale, min] over its finite elements (0, 0 when none), scale = (max -
 * min) / 15 computed in double and stored as f32 (one ulp lower where
 * min + 15 x scale would round past FLT_MAX); code = (x - min) /
 * scale rounded to nearest-even in double, saturated to 0..15, NaN 0; a
 * zero scale gives 15 for +inf, else 0; low nibble first. */
static void q4_reference(const float *x, uint32_t d, uint32_t g, uint8_t *rec)
{
    uint32_t groups = d / g;
    uint8_t *codes = rec + (size_t)groups * 2 * sizeof(float);
    memset(codes, 0, d / 2);
    for (uint32_t gi = 0; gi < groups; gi++) {
        const float *xg = x + gi * g;
        float lo = INFINITY, hi = -INFINITY;
        for (uint32_t i = 0; i < g; i++)
            if (isfinite(xg[i])) {
                lo = xg[i] < lo ? xg[i] : lo;
                hi = xg[i] > hi ? xg[i] : hi;
            }
        if (lo > hi)
            lo = hi = 0.0f;
        float scale = (float)(((double)hi - lo) / 15.0);
        if (isinf((float)(lo + 15.0 * (double)scale))) /* code 15 would decode to infinity */
            scale = nextafterf(scale, 0.0f);
        memcpy(rec + (size_t)gi * 8, &scale, 4);
        memcpy(rec + (size_t)gi * 8 + 4, &lo, 4);
        double inv = scale > 0.0f ? 1.0 / (double)scale : 0.0;
        for (uint32_t i = 0; i < g; i++) {
            int q;
            if (isnan(xg[i]))
                q = 0;
            else if (inv == 0.0)
                q = xg[i] == INFINITY ? 15 : 0;
            else {
                double v = ((double)xg[i] - lo) * inv;
                q = v >= 15.0 ? 15 : v <= 0.0 ? 0 : (int)nearbyint(v);
            }
            codes[(gi * g + i) / 2] |= (uint8_t)(q << (((gi * g + i) & 1u) * 4));
        }
    }
}

static void test_q4_matches_the_format(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(78)};
    static const uint32_t dims[] = {64, 128, 192, 256};
    for (size_t ci = 1; ci < 3; ci++)
        for (size_t di = 0; di < sizeof(dims) / sizeof(dims[0]); di++)
            for (size_t ti = 0; ti < 3; ti++) {
                uint32_t codec = codecs[ci], d = dims[di], dt = dtypes[ti], eb = dt == KVH_DTYPE_F32 ? 4 : 2;
                uint32_t g = group_of(codec, d);
                size_t n = 64, rb = (size_t)(d / g) * 8 + d / 2;
                float *x = tu_alloc(sizeof(float) * d * n);
                uint8_t *raw = tu_alloc((size_t)eb * d * n), *enc = tu_alloc(rb * n), *want = tu_alloc(rb);
                uint8_t *back = tu_alloc((size_t)eb * d * n);
                fill_vectors(&r, dt, d, n, raw, x);
                assert_ok(kvh_codec_encode(codec, dt, d, raw, n, enc));
                assert_ok(kvh_codec_decode(codec, dt, d, enc, n, back));
                for (size_t v = 0; v < n; v++) {
                    q4_reference(x + v * d, d, g, want);
                    if (memcmp(enc + v * rb, want, rb) != 0)
                        fail_msg("q4 encode differs from the format: codec %u d %u dtype %u vector %zu", codec, d, dt,
                                 v);
                    for (uint32_t i = 0; i < d; i++) {
                        float scale, lo;
                        memcpy(&scale, want + (size_t)(i / g) * 8, 4);
                        memcpy(&lo, want + (size_t)(i / g) * 8 + 4, 4);
                        uint32_t q = (want[(size_t)(d / g) * 8 + i / 2] >> ((i & 1u) * 4)) & 0xfu;
                        uint8_t expect[4];
                        store_as(dt, (float)(lo + (double)q * scale), expect);
                        if (memcmp(back + ((size_t)v * d + i) * eb, expect, eb) != 0)
                            fail_msg("q4 decode differs: codec %u d %u dtype %u vector %zu element %u", codec, d, dt, v,
                                     i);
                    }
                }
            }
}

/* A group whose least (or greatest) element is a zero of either sign,
 * in either order: the stored minimum keeps the first zero's sign, as the
 * format's reference. */
static void test_q4_zero_extremes(void **state)
{
    (void)state;
    enum { DIM = 64 };
    for (int k = 0; k < 4; k++) {
        float x[DIM];
        for (int i = 0; i < DIM; i++)
            x[i] = k < 2 ? 0.25f * (float)(i + 1) : -0.25f * (float)(i + 1); /* all above or all below zero */
        x[5] = k % 2 ? 0.0f : -0.0f;
        x[9] = k % 2 ? -0.0f : 0.0f;
        x[40] = k % 2 ? -0.0f : 0.0f; /* the second group too */
        x[41] = k % 2 ? 0.0f : -0.0f;
        for (size_t ci = 1; ci < 3; ci++) {
            uint32_t g = group_of(codecs[ci], DIM);
            size_t rb = (size_t)(DIM / g) * 8 + DIM / 2;
            uint8_t enc[(DIM / 32) * 8 + DIM / 2], want[(DIM / 32) * 8 + DIM / 2];
            assert_ok(kvh_codec_encode(codecs[ci], KVH_DTYPE_F32, DIM, x, 1, enc));
            q4_reference(x, DIM, g, want);
            if (memcmp(enc, want, rb) != 0)
                fail_msg("q4 record with zero extremes differs: case %d codec %u", k, codecs[ci]);
        }
    }
}

/* Decoded values exactly halfway between two bf16 (or f16) values round
 * to even, on every path: records built so that code * scale is such a
 * tie, with an even and an odd neighbour below. */
static void test_int8_decode_rounds_ties_to_even(void **state)
{
    (void)state;
    enum { DIM = 16 };
    static const uint32_t scale_bits[] = {0x3f808000u, 0x3f818000u, 0x3f801000u, 0x3f803000u};
    for (size_t si = 0; si < sizeof(scale_bits) / sizeof(scale_bits[0]); si++) {
        uint8_t rec[sizeof(float) + DIM];
        float scale;
        memcpy(&scale, &scale_bits[si], sizeof(scale));
        memcpy(rec, &scale, sizeof(scale));
        for (int i = 0; i < DIM; i++)
            rec[sizeof(float) + i] = (uint8_t)(int8_t)(i % 2 ? -(i + 1) / 2 : i / 2 + 1);
        for (size_t ti = 1; ti < 3; ti++) {
            uint16_t out[DIM];
            assert_ok(kvh_codec_decode(KVH_CODEC_INT8, dtypes[ti], DIM, rec, 1, out));
            for (int i = 0; i < DIM; i++) {
                float y = (float)(int8_t)rec[sizeof(float) + i] * scale;
                uint16_t want = dtypes[ti] == KVH_DTYPE_F16 ? kvhi_f32_to_f16(y) : kvhi_f32_to_bf16(y);
                if (out[i] != want)
                    fail_msg("dtype %u scale %08x code %d: %04x, want %04x", dtypes[ti], scale_bits[si],
                             (int8_t)rec[sizeof(float) + i], out[i], want);
            }
        }
    }
}

/* A group whose values are subnormal in the returned dtype (found by
 * fuzz_api in bf16): the decoded value is rounded once to the dtype,
 * whose spacing there is absolute, so the error may exceed the codec's
 * bound by half that spacing, and by no more. */
static void test_subnormal_results_round_once(void **state)
{
    (void)state;
    enum { G = 64 };
    static const float found[G] = {
        0x1.2p-130f,  -0x1.cp-131f, 0x1.9p-129f,  -0x1p-133f,   0x1.cp-130f,  0x1.9p-129f,  0x1.ap-130f,  -0x1p-131f,
        0x1.cp-131f,  0x1.dp-129f,  -0x1p-129f,   -0x1.7p-129f, -0x1.4p-130f, 0x1.ap-129f,  0x1.5p-129f,  0x1p-130f,
        -0x1.cp-130f, -0x1.cp-130f, -0x1.2p-129f, -0x1.ap-130f, -0x1.8p-130f, -0x1.8p-129f, 0x1.dp-129f,  0x1.4p-131f,
        0x1.8p-130f,  0x1.ep-130f,  -0x1p-129f,   -0x1p-131f,   0x1.2p-130f,  -0x1.8p-130f, 0x1.ap-130f,  -0x1.4p-131f,
        0x1.3p-129f,  -0x1p-131f,   0x1.9p-129f,  0x1.4p-131f,  0x1p-129f,    -0x1p-132f,   -0x1.cp-131f, -0x1.5p-129f,
        0x1p-129f,    -0x1.4p-131f, -0x1.3p-129f, -0x1.8p-131f, 0x1.5p-129f,  0x1.ep-130f,  0x1.6p-129f,  -0x1.5p-129f,
        0x1p-130f,    -0x1.ep-129f, -0x1.3p-129f, -0x1.6p-130f, -0x1.8p-130f, -0x1.4p-131f, 0x1.1p-129f,  0x1.7p-129f,
        -0x1.cp-130f, 0x1.9p-129f,  -0x1.4p-130f, 0x1p-129f,    0x1.ep-130f,  0x1.cp-131f,  0x1.4p-129f,  -0x1p-133f};
    for (size_t ti = 1; ti < 3; ti++)
        for (size_t ci = 0; ci < 3; ci++) {
            uint32_t c = codecs[ci], dt = dtypes[ti];
            float x[G], wide[G];
            uint16_t src[G], out[G];
            uint8_t enc[512];
            for (int i = 0; i < G; i++) { /* f16's subnormals start 2^112 higher */
                float v = dt == KVH_DTYPE_F16 ? found[i] * 0x1p106f : found[i];
                src[i] = dt == KVH_DTYPE_F16 ? kvhi_f32_to_f16(v) : kvhi_f32_to_bf16(v);
                x[i] = dt == KVH_DTYPE_F16 ? kvhi_f16_to_f32(src[i]) : kvhi_bf16_to_f32(src[i]);
            }
            assert_ok(kvh_codec_encode(c, dt, G, src, 1, enc));
            assert_ok(kvh_codec_decode(c, dt, G, enc, 1, out));
            assert_ok(kvh_codec_decode(c, KVH_DTYPE_F32, G, enc, 1, wide));
            bool beyond_bound = false;
            for (int i = 0; i < G; i++) {
                uint16_t want = dt == KVH_DTYPE_F16 ? kvhi_f32_to_f16(wide[i]) : kvhi_f32_to_bf16(wide[i]);
                if (out[i] != want)
                    fail_msg("codec %u dtype %u element %d: %04x, the f32 decode %a rounds to %04x", c, dt, i, out[i],
                             (double)wide[i], want);
                double y = dt == KVH_DTYPE_F16 ? kvhi_f16_to_f32(out[i]) : kvhi_bf16_to_f32(out[i]);
                double err = fabs(y - x[i]), bound = half_step(c, G, x, (uint32_t)i) * (1 + 0x1p-23);
                if (!(err <= allowed(c, dt, G, x, (uint32_t)i, y)))
                    fail_msg("codec %u dtype %u element %d: %a decoded as %a", c, dt, i, (double)x[i], y);
                beyond_bound |= err > bound + fabs(y) * (dt == KVH_DTYPE_F16 ? 0x1p-11 : 0x1p-8);
            }
            if (c == KVH_CODEC_Q4_G64 && dt == KVH_DTYPE_BF16) /* the case fuzz_api found */
                assert_true(beyond_bound);
        }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_round_trip_bounds, tu_teardown),
        cmocka_unit_test_teardown(test_sizes_and_arguments, tu_teardown),
        cmocka_unit_test_teardown(test_non_finite_and_constant, tu_teardown),
        cmocka_unit_test_teardown(test_extreme_magnitudes, tu_teardown),
        cmocka_unit_test_teardown(test_values_at_flt_max, tu_teardown),
        cmocka_unit_test_teardown(test_int8_matches_the_format, tu_teardown),
        cmocka_unit_test_teardown(test_int8_decode_rounds_ties_to_even, tu_teardown),
        cmocka_unit_test_teardown(test_q4_matches_the_format, tu_teardown),
        cmocka_unit_test_teardown(test_q4_zero_extremes, tu_teardown),
        cmocka_unit_test_teardown(test_subnormal_results_round_once, tu_teardown),
        cmocka_unit_test_teardown(test_engine_host_holds_more, tu_teardown),
        cmocka_unit_test_teardown(test_engine_demote_promote, tu_teardown),
        cmocka_unit_test_teardown(test_engine_write_into_host, tu_teardown),
        cmocka_unit_test_teardown(test_disk_store_remembers_codec, tu_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
