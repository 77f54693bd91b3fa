/* KV codec instruction sets (kernels/cpu/kv_codec*.c): every set this CPU
 * runs (AVX-512, AVX2, scalar) encodes and decodes to exactly the bytes of
 * the scalar codecs, on random and adversarial inputs (NaN, infinities,
 * denormals, all-equal vectors, ranges beyond FLT_MAX, subnormal scales,
 * elements at and near the halfway points between codes, arbitrary bit
 * patterns, lengths with tails) and on arbitrary records, whatever the
 * caller's rounding mode or flush-to-zero setting, and from buffers at any
 * byte offset; the selection hook and KVH_CODEC_ISA choose the set. test_codec.c checks the default
 * set against the format itself. */
#include <fenv.h>
#include <float.h>
#include <math.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif
#include <stdbool.h>
#include <stdlib.h>

#include "test_util.h"
#include "kernels/attention_dtype.h"
#include "kernels/cpu/kv_codec.h"

static const uint32_t codecs[] = {KVH_CODEC_INT8, KVH_CODEC_Q4_G32, KVH_CODEC_Q4_G64};
static const uint32_t dtypes[] = {KVH_DTYPE_F32, KVH_DTYPE_F16, KVH_DTYPE_BF16};
static const int vector_isas[] = {KVHI_CODEC_AVX2, KVHI_CODEC_AVX512};

enum { KINDS = 11, VECTORS = 2 * KINDS };

static uint32_t elem_size(uint32_t dt) { return dt == KVH_DTYPE_F32 ? 4 : 2; }

static float gauss(tu_rng *r)
{
    double u1 = ((double)(tu_next(r) >> 11) + 0.5) / 9007199254740992.0;
    double u2 = ((double)(tu_next(r) >> 11) + 0.5) / 9007199254740992.0;
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

static float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

/* Element i (of d, group g) of an input of the given kind. */
static float element(tu_rng *r, int kind, uint32_t i, uint32_t g, float c)
{
    static const float specials[] = {INFINITY, -INFINITY, NAN, -0.0f, 0.0f, 1e-40f, -1e-45f, 0x1p-126f, FLT_MAX};
    int step = (int)tu_below(r, 15);
    switch (kind) {
    case 0: /* ordinary */
        return gauss(r) * 3.0f;
    case 1: /* specials among ordinary values */
        return tu_below(r, 4) == 0 ? specials[tu_below(r, 9)] : gauss(r);
    case 2: /* all equal */
        return c;
    case 3: /* a range beyond FLT_MAX */
        return (i % 2 ? 3e38f : -3e38f) * (float)tu_below(r, 5) / 4.0f;
    case 4: /* exact halfway points: int8's extreme 127 * c, 4-bit's 0 and 15 */
        if (i % g == 0)
            return 127.0f * c;
        if (i % g == 1)
            return 0.0f;
        return ((float)step + 0.5f) * c;
    case 5: /* within a few ulps of halfway points */
        if (i % g < 2)
            return i % g == 0 ? 127.0f * c : 0.0f;
        return nextafterf(((float)step + 0.5f) * c, tu_below(r, 2) ? INFINITY : -INFINITY);
    case 6: /* largest magnitude subnormal: subnormal scales */
        return gauss(r) * 1e-39f;
    case 7: /* denormal and tiny */
        return gauss(r) * 1e-44f;
    case 8: /* huge */
        return gauss(r) * 1e37f;
    case 9: /* int8 scale a power of two (c): ties of either sign, and
             * products lost below 2^-126 */
        if (i % 16 == 0)
            return (tu_below(r, 2) ? 127.0f : -127.0f) * c;
        if (i % 16 == 1)
            return tu_below(r, 2) ? 1e-45f : -0x1p-126f;
        return ((float)step + (tu_below(r, 4) ? 0.5f : 0.25f)) * (tu_below(r, 2) ? c : -c);
    default: /* any bits (NaN payloads, signalling NaNs) */
        return bits_f32((uint32_t)tu_next(r));
    }
}

/* VECTORS vectors of d elements in dtype dt, two of each kind. */
static void fill(tu_rng *r, uint32_t dt, uint32_t d, uint32_t g, uint8_t *raw)
{
    static const float constants[] = {0.0f, -0.0f, 1.5f, -2.0f, INFINITY, NAN, 1e-41f, 0.75f};
    for (uint32_t v = 0; v < VECTORS; v++) {
        int kind = (int)(v % KINDS);
        float c = constants[tu_below(r, 8)];
        if (kind == 4 || kind == 5) /* a step of the format */
            c = ldexpf(1.0f + (float)tu_below(r, 1u << 20) / (float)(1u << 20), (int)tu_below(r, 40) - 20);
        if (kind == 9)
            c = ldexpf(1.0f, (int)tu_below(r, 40) - 20);
        for (uint32_t i = 0; i < d; i++) {
            float f = element(r, kind, i, g, c);
            size_t at = (size_t)v * d + i;
            if (dt == KVH_DTYPE_F32) {
                memcpy(raw + at * 4, &f, 4);
            } else {
                uint16_t h = dt == KVH_DTYPE_F16 ? kvhi_f32_to_f16(f) : kvhi_f32_to_bf16(f);
                if (kind == KINDS - 1)
                    h = (uint16_t)tu_next(r);
                memcpy(raw + at * 2, &h, 2);
            }
        }
    }
}

/* Random records: any scale and minimum bits (NaN, infinities,
 * denormals), any codes. */
static void fill_records(tu_rng *r, uint8_t *rec, size_t bytes)
{
    for (size_t i = 0; i < bytes; i++)
        rec[i] = (uint8_t)tu_next(r);
}

static void set_isa(int isa) { assert_int_equal(kvhi_codec_set_isa(isa), 0); }

static void expect_same(const char *what, int isa, uint32_t codec, uint32_t dt, uint32_t d, const uint8_t *want,
                        const uint8_t *got, size_t per_vector)
{
    for (size_t v = 0; v < VECTORS; v++)
        if (memcmp(want + v * per_vector, got + v * per_vector, per_vector) != 0) {
            size_t at = 0;
            while (want[v * per_vector + at] == got[v * per_vector + at])
                at++;
            fail_msg(
                "%s on %s differs from scalar: codec %u dtype %u d %u vector %zu (kind %zu) byte %zu: %02x vs %02x",
                what, kvhi_codec_isa_name(isa), codec, dt, d, v, v % KINDS, at, got[v * per_vector + at],
                want[v * per_vector + at]);
        }
}

/* Every supported set against scalar, for one codec, dtype and head_dim. */
static void compare_isas(tu_rng *r, uint32_t codec, uint32_t dt, uint32_t d)
{
    size_t rec = kvhi_codec_vector_bytes(codec, dt, d), raw_bytes = (size_t)d * elem_size(dt);
    uint8_t *raw = tu_alloc(raw_bytes * VECTORS), *enc = tu_alloc(rec * VECTORS), *want = tu_alloc(rec * VECTORS);
    uint8_t *records = tu_alloc(rec * VECTORS), *back = tu_alloc(raw_bytes * VECTORS);
    uint8_t *want_back = tu_alloc(raw_bytes * VECTORS), *want_rand = tu_alloc(raw_bytes * VECTORS);
    fill(r, dt, d, kvhi_codec_group(codec, d), raw);
    fill_records(r, records, rec * VECTORS);
    set_isa(KVHI_CODEC_SCALAR);
    kvhi_codec_encode(codec, dt, d, raw, VECTORS, want);
    kvhi_codec_decode(codec, dt, d, want, VECTORS, want_back);
    kvhi_codec_decode(codec, dt, d, records, VECTORS, want_rand);
    for (size_t k = 0; k < sizeof(vector_isas) / sizeof(vector_isas[0]); k++) {
        int isa = vector_isas[k];
        if (!kvhi_codec_isa_supported(isa))
            continue;
        set_isa(isa);
        memset(enc, 0xa5, rec * VECTORS);
        kvhi_codec_encode(codec, dt, d, raw, VECTORS, enc);
        expect_same("encode", isa, codec, dt, d, want, enc, rec);
        memset(back, 0xa5, raw_bytes * VECTORS);
        kvhi_codec_decode(codec, dt, d, want, VECTORS, back);
        expect_same("decode", isa, codec, dt, d, want_back, back, raw_bytes);
        kvhi_codec_decode(codec, dt, d, records, VECTORS, back);
        expect_same("decode of arbitrary records", isa, codec, dt, d, want_rand, back, raw_bytes);
    }
    set_isa(KVHI_CODEC_AUTO);
    tu_free(raw);
    tu_free(enc);
    tu_free(want);
    tu_free(records);
    tu_free(back);
    tu_free(want_back);
    tu_free(want_rand);
}

static void test_int8_every_isa_matches_scalar(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(91)};
    static const uint32_t dims[] = {1, 7, 15, 16, 17, 31, 32, 33, 64, 100, 128, 130, 256, 300, 520};
    for (int round = 0; round < 4; round++)
        for (size_t di = 0; di < sizeof(dims) / sizeof(dims[0]); di++)
            for (size_t ti = 0; ti < 3; ti++)
                compare_isas(&r, KVH_CODEC_INT8, dtypes[ti], dims[di]);
}

static void test_q4_every_isa_matches_scalar(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(92)};
    static const uint32_t dims[] = {32, 64, 96, 128, 192, 256, 576};
    for (int round = 0; round < 4; round++)
        for (size_t ci = 1; ci < 3; ci++)
            for (size_t di = 0; di < sizeof(dims) / sizeof(dims[0]); di++)
                for (size_t ti = 0; ti < 3; ti++)
                    if (kvhi_codec_vector_bytes(codecs[ci], dtypes[ti], dims[di]))
                        compare_isas(&r, codecs[ci], dtypes[ti], dims[di]);
}

/* Vectors too long for a batch to stay in the cache (KVHI_CODEC_BATCH_BYTES)
 * are encoded one at a time: the same bytes. */
static void test_long_vectors_match_scalar(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(94)};
    static const uint32_t dims[] = {8193, 20000, 40960};
    for (size_t di = 0; di < sizeof(dims) / sizeof(dims[0]); di++)
        for (size_t ti = 0; ti < 3; ti++) {
            compare_isas(&r, KVH_CODEC_INT8, dtypes[ti], dims[di]);
            if (kvhi_codec_vector_bytes(KVH_CODEC_Q4_G64, dtypes[ti], dims[di]))
                compare_isas(&r, KVH_CODEC_Q4_G64, dtypes[ti], dims[di]);
        }
}

/* Many vectors in one call: the AVX-512 codecs work in batches of 16
 * vectors (int8) or groups (4-bit), so counts around those cross every
 * batch boundary; every vector set runs them. */
static void test_batches_match_scalar(void **state)
{
    (void)state;
    if (!kvhi_codec_isa_supported(KVHI_CODEC_AVX2))
        skip();
    tu_rng r = {tu_seed(93)};
    static const size_t counts[] = {1, 3, 15, 16, 17, 33, 100};
    for (size_t ci = 0; ci < 3; ci++)
        for (size_t ti = 0; ti < 3; ti++)
            for (size_t ni = 0; ni < sizeof(counts) / sizeof(counts[0]); ni++) {
                uint32_t codec = codecs[ci], dt = dtypes[ti], d = 128;
                size_t n = counts[ni], rec = kvhi_codec_vector_bytes(codec, dt, d), rb = (size_t)d * elem_size(dt);
                uint8_t *raw = tu_alloc(rb * n), *want = tu_alloc(rec * n), *got = tu_alloc(rec * n);
                for (size_t i = 0; i < rb * n; i += 2) { /* ordinary values, some vectors special */
                    float f = (i / rb) % 5 == 4 ? element(&r, 1, 0, 1, 0) : gauss(&r);
                    if (dt == KVH_DTYPE_F32) {
                        if (i % 4 == 0)
                            memcpy(raw + i, &f, 4);
                    } else {
                        uint16_t h = dt == KVH_DTYPE_F16 ? kvhi_f32_to_f16(f) : kvhi_f32_to_bf16(f);
                        memcpy(raw + i, &h, 2);
                    }
                }
                set_isa(KVHI_CODEC_SCALAR);
                kvhi_codec_encode(codec, dt, d, raw, n, want);
                for (size_t k = 0; k < sizeof(vector_isas) / sizeof(vector_isas[0]); k++) {
                    if (!kvhi_codec_isa_supported(vector_isas[k]))
                        continue;
                    set_isa(vector_isas[k]);
                    kvhi_codec_encode(codec, dt, d, raw, n, got);
                    if (memcmp(want, got, rec * n) != 0)
                        fail_msg("%s, codec %u dtype %u: %zu vectors in one call differ from scalar",
                                 kvhi_codec_isa_name(vector_isas[k]), codec, dt, n);
                }
                tu_free(raw);
                tu_free(want);
                tu_free(got);
            }
    set_isa(KVHI_CODEC_AUTO);
}

/* 4-bit decoding rounds lo + q * scale in double, then to float: records
 * where that differs from one rounding (a float fma) -- a sum just above
 * a float midpoint that rounds onto it in double -- decode as the scalar
 * codec does on every set. */
static void test_q4_decode_rounds_twice(void **state)
{
    (void)state;
    enum { D = 32 };
    uint8_t rec[2 * sizeof(float) + D / 2];
    int found = 0;
    for (uint32_t s_bits = 0x3d800000u; s_bits < 0x3d800000u + (1u << 16) && found < 16; s_bits++) {
        float scale = bits_f32(s_bits), lo = 0x1p-54f;
        for (uint32_t q = 1; q < 16; q++) {
            float once = fmaf((float)q, scale, lo), twice = (float)(lo + (double)q * scale);
            if (once == twice)
                continue;
            found++;
            memcpy(rec, &scale, 4);
            memcpy(rec + 4, &lo, 4);
            memset(rec + 8, (int)(q | q << 4), D / 2);
            for (size_t k = 0; k < sizeof(vector_isas) / sizeof(vector_isas[0]); k++) {
                if (!kvhi_codec_isa_supported(vector_isas[k]))
                    continue;
                set_isa(vector_isas[k]);
                float y[D];
                kvhi_codec_decode(KVH_CODEC_Q4_G32, KVH_DTYPE_F32, D, rec, 1, y);
                for (int i = 0; i < D; i++)
                    if (memcmp(&y[i], &twice, 4) != 0)
                        fail_msg("%s: scale %08x code %u decoded %a, want %a", kvhi_codec_isa_name(vector_isas[k]),
                                 s_bits, q, (double)y[i], (double)twice);
            }
            break;
        }
    }
    set_isa(KVHI_CODEC_AUTO);
    assert_true(found > 0);
}

/* The caller's floating-point environment: a directed rounding mode, or
 * flush-to-zero with denormals-are-zero. */
enum fp_env { FP_UPWARD, FP_DOWNWARD, FP_TOWARDZERO, FP_FTZ_DAZ, FP_ENVS };

static void fp_env_set(enum fp_env env)
{
    switch (env) {
    case FP_UPWARD:
        assert_int_equal(fesetround(FE_UPWARD), 0);
        break;
    case FP_DOWNWARD:
        assert_int_equal(fesetround(FE_DOWNWARD), 0);
        break;
    case FP_TOWARDZERO:
        assert_int_equal(fesetround(FE_TOWARDZERO), 0);
        break;
    default:
#if defined(__x86_64__) || defined(__i386__)
        _mm_setcsr(_mm_getcsr() | 0x8040u); /* FTZ | DAZ */
#endif
        break;
    }
}

static bool fp_env_is(enum fp_env env)
{
    switch (env) {
    case FP_UPWARD:
        return fegetround() == FE_UPWARD;
    case FP_DOWNWARD:
        return fegetround() == FE_DOWNWARD;
    case FP_TOWARDZERO:
        return fegetround() == FE_TOWARDZERO;
    default:
#if defined(__x86_64__) || defined(__i386__)
        return (_mm_getcsr() & 0x8040u) == 0x8040u;
#else
        return true;
#endif
    }
}

static void fp_env_reset(void)
{
    fesetround(FE_TONEAREST);
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr(_mm_getcsr() & ~0x8040u);
#endif
}

/* Inputs for one codec, dtype and head_dim, with the scalar codec's
 * encoding and its decoding as the reference. */
typedef struct ref_case {
    uint32_t codec, dt, d;
    size_t rec, raw_bytes; /* all VECTORS vectors */
    uint8_t *raw, *want, *want_back;
} ref_case;

static const int every_isa[] = {KVHI_CODEC_SCALAR, KVHI_CODEC_AVX2, KVHI_CODEC_AVX512};

/* False (nothing allocated) when the codec does not take that head_dim. */
static bool ref_case_open(tu_rng *r, uint32_t codec, uint32_t dt, uint32_t d, ref_case *c)
{
    size_t rec = kvhi_codec_vector_bytes(codec, dt, d);
    if (!rec || (codec != KVH_CODEC_INT8 && d % kvhi_codec_group(codec, d)))
        return false;
    *c = (ref_case){
        .codec = codec, .dt = dt, .d = d, .rec = rec * VECTORS, .raw_bytes = (size_t)d * elem_size(dt) * VECTORS};
    c->raw = tu_alloc(c->raw_bytes);
    c->want = tu_alloc(c->rec);
    c->want_back = tu_alloc(c->raw_bytes);
    fill(r, dt, d, kvhi_codec_group(codec, d), c->raw);
    set_isa(KVHI_CODEC_SCALAR);
    kvhi_codec_encode(codec, dt, d, c->raw, VECTORS, c->want);
    kvhi_codec_decode(codec, dt, d, c->want, VECTORS, c->want_back);
    return true;
}

static void ref_case_close(ref_case *c)
{
    tu_free(c->raw);
    tu_free(c->want);
    tu_free(c->want_back);
}

/* A codec's bytes do not depend on the caller's floating-point
 * environment, on any set: under every directed rounding mode and under
 * FTZ/DAZ they are the scalar codec's bytes in the default one (which
 * then differed between sets, and flushed a subnormal scale to zero so
 * that normal values decoded to 0). The caller's environment is given
 * back. */
static void test_every_isa_ignores_the_callers_fp_env(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(95)};
    static const uint32_t dims[] = {17, 64, 128};
    for (size_t ci = 0; ci < 3; ci++)
        for (size_t ti = 0; ti < 3; ti++)
            for (size_t di = 0; di < 3; di++) {
                ref_case c;
                if (!ref_case_open(&r, codecs[ci], dtypes[ti], dims[di], &c))
                    continue;
                uint8_t *got = tu_alloc(c.rec), *back = tu_alloc(c.raw_bytes);
                for (size_t k = 0; k < sizeof(every_isa) / sizeof(every_isa[0]); k++) {
                    if (!kvhi_codec_isa_supported(every_isa[k]))
                        continue;
                    set_isa(every_isa[k]);
                    for (int env = 0; env < FP_ENVS; env++) {
                        fp_env_set((enum fp_env)env);
                        kvhi_codec_encode(c.codec, c.dt, c.d, c.raw, VECTORS, got);
                        kvhi_codec_decode(c.codec, c.dt, c.d, c.want, VECTORS, back);
                        bool kept = fp_env_is((enum fp_env)env);
                        fp_env_reset();
                        assert_true(kept);
                        if (memcmp(c.want, got, c.rec) != 0 || memcmp(c.want_back, back, c.raw_bytes) != 0)
                            fail_msg("%s in environment %d: codec %u dtype %u d %u differs from the default",
                                     kvhi_codec_isa_name(every_isa[k]), env, c.codec, c.dt, c.d);
                    }
                }
                tu_free(got);
                tu_free(back);
                ref_case_close(&c);
            }
    set_isa(KVHI_CODEC_AUTO);
}

/* Buffers at any byte offset (kvh.h asks no alignment): the same bytes
 * as aligned ones, on every set, with no misaligned typed access (the
 * sanitizer build stops at one). */
static void test_every_isa_takes_unaligned_buffers(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(96)};
    static const uint32_t dims[] = {17, 64};
    for (size_t ci = 0; ci < 3; ci++)
        for (size_t ti = 0; ti < 3; ti++)
            for (size_t di = 0; di < 2; di++) {
                ref_case c;
                if (!ref_case_open(&r, codecs[ci], dtypes[ti], dims[di], &c))
                    continue;
                uint8_t *raw_at = tu_alloc(c.raw_bytes + 8), *enc_at = tu_alloc(c.rec + 8);
                uint8_t *back_at = tu_alloc(c.raw_bytes + 8);
                for (size_t k = 0; k < sizeof(every_isa) / sizeof(every_isa[0]); k++) {
                    if (!kvhi_codec_isa_supported(every_isa[k]))
                        continue;
                    set_isa(every_isa[k]);
                    for (size_t off = 1; off < 8; off += 2) {
                        memcpy(raw_at + off, c.raw, c.raw_bytes);
                        kvhi_codec_encode(c.codec, c.dt, c.d, raw_at + off, VECTORS, enc_at + off);
                        kvhi_codec_decode(c.codec, c.dt, c.d, enc_at + off, VECTORS, back_at + off);
                        if (memcmp(c.want, enc_at + off, c.rec) != 0 ||
                            memcmp(c.want_back, back_at + off, c.raw_bytes) != 0)
                            fail_msg("%s at offset %zu: codec %u dtype %u d %u differs from aligned",
                                     kvhi_codec_isa_name(every_isa[k]), off, c.codec, c.dt, c.d);
                    }
                }
                tu_free(raw_at);
                tu_free(enc_at);
                tu_free(back_at);
                ref_case_close(&c);
            }
    set_isa(KVHI_CODEC_AUTO);
}

static void test_selection(void **state)
{
    (void)state;
    int best = kvhi_codec_active_isa();
    assert_true(best >= KVHI_CODEC_SCALAR && best <= KVHI_CODEC_AVX512);
    assert_true(kvhi_codec_isa_supported(best));
    assert_int_equal(kvhi_codec_set_isa(99), -1);
    assert_int_equal(kvhi_codec_active_isa(), best);
    set_isa(KVHI_CODEC_SCALAR);
    assert_int_equal(kvhi_codec_active_isa(), KVHI_CODEC_SCALAR);
    /* AUTO reads KVH_CODEC_ISA again */
    setenv("KVH_CODEC_ISA", "scalar", 1);
    set_isa(KVHI_CODEC_AUTO);
    assert_int_equal(kvhi_codec_active_isa(), KVHI_CODEC_SCALAR);
    setenv("KVH_CODEC_ISA", "no-such-set", 1);
    set_isa(KVHI_CODEC_AUTO);
    assert_int_equal(kvhi_codec_active_isa(), best);
    unsetenv("KVH_CODEC_ISA");
    set_isa(KVHI_CODEC_AUTO);
    assert_int_equal(kvhi_codec_active_isa(), best);
    assert_string_equal(kvhi_codec_isa_name(KVHI_CODEC_AVX512), "avx512");
}

int main(void)
{
    /* The comparisons choose the sets themselves. */
    unsetenv("KVH_CODEC_ISA");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_selection, tu_teardown),
        cmocka_unit_test_teardown(test_int8_every_isa_matches_scalar, tu_teardown),
        cmocka_unit_test_teardown(test_q4_every_isa_matches_scalar, tu_teardown),
        cmocka_unit_test_teardown(test_batches_match_scalar, tu_teardown),
        cmocka_unit_test_teardown(test_long_vectors_match_scalar, tu_teardown),
        cmocka_unit_test_teardown(test_q4_decode_rounds_twice, tu_teardown),
        cmocka_unit_test_teardown(test_every_isa_ignores_the_callers_fp_env, tu_teardown),
        cmocka_unit_test_teardown(test_every_isa_takes_unaligned_buffers, tu_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
