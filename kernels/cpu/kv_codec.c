/* KV codecs (see kv_codec.h for the formats and error bounds), run on
 * every copy between a raw and an encoded tier. The scalar form here is
 * the format's definition: values are converted through the dtype helpers
 * shared with the attention kernels, a slice at a time. On x86, AVX2 +
 * FMA + F16C and AVX-512 have whole codecs of their own
 * (kv_codec_avx2.c, kv_codec_avx512.c); all give the same bytes
 * (tests/c/test_codec.c checks them against the format,
 * tests/c/test_codec_isa.c against each other). */
#include "kernels/cpu/kv_codec.h"

#include <math.h>
#include <string.h>

#include "kvh/kvh.h"
#include "kernels/attention_dtype.h"
#include "kernels/cpu/kv_codec_simd.h"
#include "kernels/cpu/fp_env.h"

/* Caller buffers carry no alignment (kvh.h): their elements are read and
 * written through these one-byte-aligned types, the same loads and stores
 * on x86. */
typedef uint16_t u16_any __attribute__((aligned(1), may_alias));
typedef float f32_any __attribute__((aligned(1), may_alias));

static uint32_t elem_bytes(uint32_t dtype)
{
    return dtype == KVH_DTYPE_F32 ? 4 : (dtype == KVH_DTYPE_F16 || dtype == KVH_DTYPE_BF16) ? 2 : 0;
}

uint32_t kvhi_codec_group(uint32_t codec, uint32_t head_dim)
{
    switch (codec) {
    case KVH_CODEC_INT8:
        return head_dim;
    case KVH_CODEC_Q4_G32:
        return 32;
    case KVH_CODEC_Q4_G64:
        return 64;
    default:
        return 0;
    }
}

size_t kvhi_codec_vector_bytes(uint32_t codec, uint32_t dtype, uint32_t head_dim)
{
    uint32_t eb = elem_bytes(dtype);
    if (eb == 0 || head_dim == 0 || head_dim > KVHI_CODEC_MAX_HEAD_DIM)
        return 0;
    switch (codec) {
    case KVH_CODEC_NONE:
        return (size_t)head_dim * eb;
    case KVH_CODEC_INT8:
        return sizeof(float) + head_dim;
    case KVH_CODEC_Q4_G32:
    case KVH_CODEC_Q4_G64: {
        uint32_t g = kvhi_codec_group(codec, head_dim);
        if (head_dim % g != 0)
            return 0;
        return (size_t)(head_dim / g) * 2 * sizeof(float) + head_dim / 2;
    }
    default:
        return 0;
    }
}

/* Vectors are converted to and from f32 a slice at a time, with the dtype
 * chosen once per slice rather than per element, so the loops stay tight;
 * head_dim has no upper bound here (the public kvh_codec_* calls). */
enum { SLICE = 256 };

static inline int quantise(float x, double offset, double inv, int lo, int hi, int nan_code);

/* The largest finite |x[i]|, from amax up (int8's scale). */
static float amax_finite_scalar(const float *x, uint32_t n, float amax)
{
    for (uint32_t i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        if (isfinite(a) && a > amax)
            amax = a;
    }
    return amax;
}

/* The least and greatest finite x[i], from *lo and *hi on (q4's range; a
 * zero extreme keeps the first zero met). */
static void minmax_finite_scalar(const float *x, uint32_t n, float *lo, float *hi)
{
    for (uint32_t i = 0; i < n; i++)
        if (isfinite(x[i])) {
            *lo = x[i] < *lo ? x[i] : *lo;
            *hi = x[i] > *hi ? x[i] : *hi;
        }
}

static void load_slice(uint32_t dtype, const void *src, uint32_t from, uint32_t n, float *x)
{
    if (dtype == KVH_DTYPE_F16) {
        const u16_any *h = (const u16_any *)src + from;
        for (uint32_t i = 0; i < n; i++)
            x[i] = kvhi_f16_to_f32(h[i]);
    } else if (dtype == KVH_DTYPE_BF16) {
        const u16_any *h = (const u16_any *)src + from;
        for (uint32_t i = 0; i < n; i++)
            x[i] = kvhi_bf16_to_f32(h[i]);
    } else {
        memcpy(x, (const float *)src + from, sizeof(float) * n);
    }
}

static void store_slice(uint32_t dtype, void *dst, uint32_t from, uint32_t n, const float *x)
{
    if (dtype == KVH_DTYPE_F16) {
        u16_any *h = (u16_any *)dst + from;
        for (uint32_t i = 0; i < n; i++)
            h[i] = kvhi_f32_to_f16(x[i]);
    } else if (dtype == KVH_DTYPE_BF16) {
        u16_any *h = (u16_any *)dst + from;
        for (uint32_t i = 0; i < n; i++)
            h[i] = kvhi_f32_to_bf16(x[i]);
    } else {
        memcpy((float *)dst + from, x, sizeof(float) * n);
    }
}

/* lrint of a double well inside +-2^51 in the current rounding mode,
 * without the library call: adding and removing 1.5 * 2^52 leaves exactly
 * the rounded integer (the default mode rounds half to even, as lrint). */
static inline double round_in_mode(double q)
{
    const double shift = 6755399441055744.0;
    return (q + shift) - shift; /* never folded: not value-preserving */
}

/* Rounds (x - offset) * inv to the nearest code in [lo, hi]; NaN gives
 * `nan_code`. In double: x - offset can exceed FLT_MAX, and inv (the
 * reciprocal of the stored f32 scale) overflows a float when the scale is
 * subnormal -- a zero element then became 0 * inf = NaN, the top code. */
static inline int quantise(float x, double offset, double inv, int lo, int hi, int nan_code)
{
    if (isnan(x))
        return nan_code;
    double q = ((double)x - offset) * inv;
    if (!(q < hi)) /* also +inf */
        return hi;
    if (!(q > lo))
        return lo;
    return (int)round_in_mode(q);
}

static float amax_finite(const float *x, uint32_t n) { return amax_finite_scalar(x, n, 0.0f); }

static void encode_int8(uint32_t dtype, uint32_t d, const void *src, uint8_t *rec)
{
    float x[SLICE];
    float amax = 0.0f;
    for (uint32_t at = 0; at < d; at += SLICE) {
        uint32_t n = d - at < SLICE ? d - at : SLICE;
        load_slice(dtype, src, at, n, x);
        float a = amax_finite(x, n);
        amax = a > amax ? a : amax;
    }
    float scale = kvhi_codec_int8_scale_fit(amax / 127.0f);
    double inv = scale > 0.0f ? 1.0 / scale : 0.0; /* of the scale as stored */
    kvhi_codec_put_f32(rec, scale);
    int8_t *codes = (int8_t *)(rec + sizeof(float));
    for (uint32_t at = 0; at < d; at += SLICE) {
        uint32_t n = d - at < SLICE ? d - at : SLICE;
        if (d > SLICE) /* one slice is still loaded from the first pass */
            load_slice(dtype, src, at, n, x);
        for (uint32_t i = 0; i < n; i++)
            /* A zero vector (inv 0) still saturates infinities to +-127. */
            codes[at + i] = (int8_t)(inv > 0.0 ? quantise(x[i], 0.0, inv, -127, 127, 0)
                                               : (isinf(x[i]) ? (x[i] > 0 ? 127 : -127) : 0));
    }
}

static void decode_int8(uint32_t dtype, uint32_t d, const uint8_t *rec, void *dst)
{
    float scale = kvhi_codec_get_f32(rec), x[SLICE];
    const int8_t *codes = (const int8_t *)(rec + sizeof(float));
    for (uint32_t at = 0; at < d; at += SLICE) {
        uint32_t n = d - at < SLICE ? d - at : SLICE;
        /* f32 is written in place; other dtypes go through the slice. */
        f32_any *y = dtype == KVH_DTYPE_F32 ? (f32_any *)dst + at : x;
        /* code * scale is exact in double, so rounding it once to float is
         * what a float multiply gives: the same value, vectorisable. */
        for (uint32_t i = 0; i < n; i++)
            y[i] = (float)codes[at + i] * scale;
        if (y == x)
            store_slice(dtype, dst, at, n, x);
    }
}

static void encode_q4(uint32_t dtype, uint32_t d, uint32_t g, const void *src, uint8_t *rec)
{
    uint32_t groups = d / g;
    uint8_t *codes = rec + (size_t)groups * 2 * sizeof(float);
    float x[64]; /* one group */
    memset(codes, 0, d / 2);
    for (uint32_t gi = 0; gi < groups; gi++) {
        load_slice(dtype, src, gi * g, g, x);
        float lo = INFINITY, hi = -INFINITY;
        minmax_finite_scalar(x, g, &lo, &hi);
        if (lo > hi) /* no finite element */
            lo = hi = 0.0f;
        /* hi - lo may exceed FLT_MAX; the scale (a 15th of it) does not */
        float scale = kvhi_codec_q4_scale_fit((float)(((double)hi - lo) / 15.0), lo);
        double inv = scale > 0.0f ? 1.0 / scale : 0.0;
        kvhi_codec_put_f32(rec + (size_t)gi * 2 * sizeof(float), scale);
        kvhi_codec_put_f32(rec + (size_t)gi * 2 * sizeof(float) + sizeof(float), lo);
        uint8_t *gc = codes + (size_t)gi * g / 2;
        for (uint32_t i = 0; i < g; i++) {
            int q = inv > 0.0 ? quantise(x[i], lo, inv, 0, 15, 0) : (x[i] == INFINITY ? 15 : 0);
            gc[i / 2] |= (uint8_t)(q << ((i & 1u) * 4));
        }
    }
}

static void decode_q4(uint32_t dtype, uint32_t d, uint32_t g, const uint8_t *rec, void *dst)
{
    uint32_t groups = d / g;
    const uint8_t *codes = rec + (size_t)groups * 2 * sizeof(float);
    float x[64];
    for (uint32_t gi = 0; gi < groups; gi++) {
        float scale = kvhi_codec_get_f32(rec + (size_t)gi * 2 * sizeof(float));
        float lo = kvhi_codec_get_f32(rec + (size_t)gi * 2 * sizeof(float) + sizeof(float));
        const uint8_t *gc = codes + (size_t)gi * g / 2;
        f32_any *y = dtype == KVH_DTYPE_F32 ? (f32_any *)dst + gi * g : x;
        for (uint32_t i = 0; i < g; i++) {
            uint32_t q = (gc[i / 2] >> ((i & 1u) * 4)) & 0xfu;
            y[i] = (float)(lo + (double)q * scale);
        }
        if (y == x)
            store_slice(dtype, dst, gi * g, g, x);
    }
}

static void encode_vectors(uint32_t codec, uint32_t dtype, uint32_t d, const void *src, size_t n, void *dst)
{
#ifdef KVH_CODEC_X86_VECTOR
    int isa = codec != KVH_CODEC_NONE ? kvhi_codec_active_isa() : KVHI_CODEC_SCALAR;
    if (isa == KVHI_CODEC_AVX512) {
        kvhi_codec_encode_avx512(codec, dtype, d, kvhi_codec_group(codec, d), src, n, dst);
        return;
    }
    if (isa == KVHI_CODEC_AVX2) {
        kvhi_codec_encode_avx2(codec, dtype, d, kvhi_codec_group(codec, d), src, n, dst);
        return;
    }
#endif
    size_t in = (size_t)d * elem_bytes(dtype), out = kvhi_codec_vector_bytes(codec, dtype, d);
    const uint8_t *s = src;
    uint8_t *o = dst;
    for (size_t v = 0; v < n; v++, s += in, o += out) {
        switch (codec) {
        case KVH_CODEC_INT8:
            encode_int8(dtype, d, s, o);
            break;
        case KVH_CODEC_Q4_G32:
        case KVH_CODEC_Q4_G64:
            encode_q4(dtype, d, kvhi_codec_group(codec, d), s, o);
            break;
        default:
            memcpy(o, s, in);
            break;
        }
    }
}

static void decode_vectors(uint32_t codec, uint32_t dtype, uint32_t d, const void *src, size_t n, void *dst)
{
#ifdef KVH_CODEC_X86_VECTOR
    int isa = codec != KVH_CODEC_NONE ? kvhi_codec_active_isa() : KVHI_CODEC_SCALAR;
    if (isa == KVHI_CODEC_AVX512) {
        kvhi_codec_decode_avx512(codec, dtype, d, kvhi_codec_group(codec, d), src, n, dst);
        return;
    }
    if (isa == KVHI_CODEC_AVX2) {
        kvhi_codec_decode_avx2(codec, dtype, d, kvhi_codec_group(codec, d), src, n, dst);
        return;
    }
#endif
    size_t out = (size_t)d * elem_bytes(dtype), in = kvhi_codec_vector_bytes(codec, dtype, d);
    const uint8_t *s = src;
    uint8_t *o = dst;
    for (size_t v = 0; v < n; v++, s += in, o += out) {
        switch (codec) {
        case KVH_CODEC_INT8:
            decode_int8(dtype, d, s, o);
            break;
        case KVH_CODEC_Q4_G32:
        case KVH_CODEC_Q4_G64:
            decode_q4(dtype, d, kvhi_codec_group(codec, d), s, o);
            break;
        default:
            memcpy(o, s, in);
            break;
        }
    }
}

void kvhi_codec_encode(uint32_t codec, uint32_t dtype, uint32_t d, const void *src, size_t n, void *dst)
{
    kvhi_fp_env env = kvhi_fp_default_enter();
    encode_vectors(codec, dtype, d, src, n, dst);
    kvhi_fp_leave(env);
}

void kvhi_codec_decode(uint32_t codec, uint32_t dtype, uint32_t d, const void *src, size_t n, void *dst)
{
    kvhi_fp_env env = kvhi_fp_default_enter();
    decode_vectors(codec, dtype, d, src, n, dst);
    kvhi_fp_leave(env);
}
