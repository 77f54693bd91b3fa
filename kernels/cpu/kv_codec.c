/* Scalar KV codecs (see kv_codec.h for the formats and error bounds).
 * Demotion and promotion are memory-bound copies of whole blocks, so a
 * plain loop per element is enough here; the values are read through the
 * dtype helpers shared with the attention kernels. */
#include "kernels/cpu/kv_codec.h"

#include <math.h>
#include <string.h>

#include "kvh/kvh.h"
#include "kernels/attention_dtype.h"

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
    if (eb == 0 || head_dim == 0)
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

static void put_f32(uint8_t *p, float v) { memcpy(p, &v, sizeof(v)); }
static float get_f32(const uint8_t *p)
{
    float v;
    memcpy(&v, p, sizeof(v));
    return v;
}

/* Rounds (x - offset) * inv to the nearest code in [lo, hi]; NaN gives
 * `nan_code`. In double: x - offset can exceed FLT_MAX, and inv (the
 * reciprocal of the stored f32 scale) overflows a float when the scale is
 * subnormal -- a zero element then became 0 * inf = NaN, the top code. */
static int quantise(float x, double offset, double inv, int lo, int hi, int nan_code)
{
    if (isnan(x))
        return nan_code;
    double q = ((double)x - offset) * inv;
    if (!(q < hi)) /* also +inf */
        return hi;
    if (!(q > lo))
        return lo;
    return (int)lrint(q);
}

static void encode_int8(uint32_t dtype, uint32_t d, const void *src, uint8_t *rec)
{
    float amax = 0.0f;
    for (uint32_t i = 0; i < d; i++) {
        float a = fabsf(kvhi_load_as_f32(dtype, src, i));
        if (isfinite(a) && a > amax)
            amax = a;
    }
    float scale = amax / 127.0f;
    double inv = scale > 0.0f ? 1.0 / scale : 0.0; /* of the scale as stored */
    put_f32(rec, scale);
    int8_t *codes = (int8_t *)(rec + sizeof(float));
    for (uint32_t i = 0; i < d; i++) {
        float x = kvhi_load_as_f32(dtype, src, i);
        /* A zero vector (inv 0) still saturates infinities to +-127. */
        codes[i] = (int8_t)(inv > 0.0f ? quantise(x, 0.0f, inv, -127, 127, 0)
                                       : (isinf(x) ? (x > 0 ? 127 : -127) : 0));
    }
}

static void decode_int8(uint32_t dtype, uint32_t d, const uint8_t *rec, void *dst)
{
    float scale = get_f32(rec);
    const int8_t *codes = (const int8_t *)(rec + sizeof(float));
    for (uint32_t i = 0; i < d; i++)
        kvhi_store_from_f32(dtype, dst, i, (float)((double)codes[i] * scale));
}

static void encode_q4(uint32_t dtype, uint32_t d, uint32_t g, const void *src, uint8_t *rec)
{
    uint32_t groups = d / g;
    uint8_t *codes = rec + (size_t)groups * 2 * sizeof(float);
    memset(codes, 0, d / 2);
    for (uint32_t gi = 0; gi < groups; gi++) {
        float lo = INFINITY, hi = -INFINITY;
        for (uint32_t i = gi * g; i < (gi + 1) * g; i++) {
            float x = kvhi_load_as_f32(dtype, src, i);
            if (isfinite(x)) {
                lo = x < lo ? x : lo;
                hi = x > hi ? x : hi;
            }
        }
        if (lo > hi) /* no finite element */
            lo = hi = 0.0f;
        /* hi - lo may exceed FLT_MAX; the scale (a 15th of it) does not */
        float scale = (float)(((double)hi - lo) / 15.0);
        double inv = scale > 0.0f ? 1.0 / scale : 0.0;
        put_f32(rec + (size_t)gi * 2 * sizeof(float), scale);
        put_f32(rec + (size_t)gi * 2 * sizeof(float) + sizeof(float), lo);
        for (uint32_t i = gi * g; i < (gi + 1) * g; i++) {
            float x = kvhi_load_as_f32(dtype, src, i);
            int q = inv > 0.0f ? quantise(x, lo, inv, 0, 15, 0) : (x == INFINITY ? 15 : 0);
            codes[i / 2] |= (uint8_t)(q << ((i & 1u) * 4));
        }
    }
}

static void decode_q4(uint32_t dtype, uint32_t d, uint32_t g, const uint8_t *rec, void *dst)
{
    uint32_t groups = d / g;
    const uint8_t *codes = rec + (size_t)groups * 2 * sizeof(float);
    for (uint32_t gi = 0; gi < groups; gi++) {
        float scale = get_f32(rec + (size_t)gi * 2 * sizeof(float));
        float lo = get_f32(rec + (size_t)gi * 2 * sizeof(float) + sizeof(float));
        for (uint32_t i = gi * g; i < (gi + 1) * g; i++) {
            uint32_t q = (codes[i / 2] >> ((i & 1u) * 4)) & 0xfu;
            kvhi_store_from_f32(dtype, dst, i, (float)(lo + (double)q * scale));
        }
    }
}

void kvhi_codec_encode(uint32_t codec, uint32_t dtype, uint32_t d, const void *src, size_t n, void *dst)
{
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

void kvhi_codec_decode(uint32_t codec, uint32_t dtype, uint32_t d, const void *src, size_t n, void *dst)
{
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
