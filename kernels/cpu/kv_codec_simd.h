/* The vector forms of the KV codecs (kv_codec.c dispatches to them by
 * kvhi_codec_active_isa). Each gives the bytes of the scalar form. */
#ifndef KVH_KERNELS_CPU_KV_CODEC_SIMD_H
#define KVH_KERNELS_CPU_KV_CODEC_SIMD_H

#include <stddef.h>
#include <stdint.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVH_CODEC_X86_VECTOR 1

/* n vectors of head_dim d, codec INT8 or Q4 (group g), dtype F32, F16 or
 * BF16; the CPU must have AVX-512 F/BW/VL/DQ (kv_codec_avx512.c). */
void kvhi_codec_encode_avx512(uint32_t codec, uint32_t dtype, uint32_t d, uint32_t g, const void *src, size_t n,
                              void *dst);
void kvhi_codec_decode_avx512(uint32_t codec, uint32_t dtype, uint32_t d, uint32_t g, const void *src, size_t n,
                              void *dst);
/* The same on AVX2 + FMA + F16C (kv_codec_avx2.c). */
void kvhi_codec_encode_avx2(uint32_t codec, uint32_t dtype, uint32_t d, uint32_t g, const void *src, size_t n,
                            void *dst);
void kvhi_codec_decode_avx2(uint32_t codec, uint32_t dtype, uint32_t d, uint32_t g, const void *src, size_t n,
                            void *dst);

/* The records of an int8 batch once its scales and reciprocals are
 * computed (scale, inv and finite: arrays of nv): each scale fitted
 * (kvhi_codec_int8_scale_fit), stored, and the codes written by the set's
 * int8_codes_finite or int8_codes. each_vector runs first for every
 * vector, with x its input. */
#define KVHI_CODEC_INT8_RECORDS(dtype, d, src, nv, in, rec, out, scale, inv, finite, each_vector)                      \
    for (uint32_t v = 0; v < (nv); v++) {                                                                              \
        const uint8_t *x = (src) + v * (in);                                                                           \
        uint8_t *r = (rec) + v * (out);                                                                                \
        int8_t *codes = (int8_t *)(r + sizeof(float));                                                                 \
        each_vector;                                                                                                   \
        float fitted = kvhi_codec_int8_scale_fit((scale)[v]);                                                          \
        if (fitted != (scale)[v]) {                                                                                    \
            (scale)[v] = fitted;                                                                                       \
            (inv)[v] = 1.0f / fitted;                                                                                  \
        }                                                                                                              \
        kvhi_codec_put_f32(r, (scale)[v]);                                                                             \
        if ((finite)[v] && (scale)[v] >= FLT_MIN)                                                                      \
            int8_codes_finite(dtype, d, x, (scale)[v], (inv)[v], codes);                                               \
        else                                                                                                           \
            int8_codes(dtype, d, x, (scale)[v], (inv)[v], codes);                                                      \
    }

/* The most input bytes an int8 batch reads before coding them: its
 * vectors' range pass is read again by the code pass, from the cache only
 * while the batch fits in it (larger vectors go one at a time). */
#define KVHI_CODEC_BATCH_BYTES (256u * 1024u)

/* A set's per-dtype loops, the same on every set, with its target
 * attribute: over n records for decoding, BATCH vectors at a time for
 * int8 encoding, over the flat sequence of 4-bit groups, BATCH at a
 * time, for 4-bit encoding. The set defines encode_int8_batch,
 * decode_int8, encode_q4_batch, decode_q4 and BATCH. */
#define KVHI_CODEC_SHARED_LOOPS(attr, suffix, dtype, eb)                                                               \
    static attr void encode_int8_##suffix(uint32_t d, const uint8_t *s, size_t n, uint8_t *o)                          \
    {                                                                                                                  \
        size_t in = (size_t)d * (eb), out = sizeof(float) + d;                                                         \
        size_t step = in * BATCH <= KVHI_CODEC_BATCH_BYTES ? BATCH : 1;                                                \
        for (size_t v = 0; v < n; v += step)                                                                           \
            encode_int8_batch(dtype, d, s + v * in, n - v < step ? (uint32_t)(n - v) : (uint32_t)step, in,             \
                              o + v * out, out);                                                                       \
    }                                                                                                                  \
    static attr void decode_int8_##suffix(uint32_t d, const uint8_t *s, size_t n, uint8_t *o)                          \
    {                                                                                                                  \
        for (size_t v = 0; v < n; v++)                                                                                 \
            decode_int8(dtype, d, s + v * (sizeof(float) + d), o + v * d * (eb));                                      \
    }                                                                                                                  \
    static attr void encode_q4_##suffix(uint32_t d, uint32_t g, const uint8_t *s, size_t n, uint8_t *o)                \
    {                                                                                                                  \
        size_t groups = n * (d / g);                                                                                   \
        for (size_t k = 0; k < groups; k += BATCH)                                                                     \
            encode_q4_batch(dtype, d, g, s, k, groups - k < BATCH ? (uint32_t)(groups - k) : BATCH, o);                \
    }                                                                                                                  \
    static attr void decode_q4_##suffix(uint32_t d, uint32_t g, const uint8_t *s, size_t n, uint8_t *o)                \
    {                                                                                                                  \
        size_t rec = (size_t)(d / g) * 2 * sizeof(float) + d / 2;                                                      \
        for (size_t v = 0; v < n; v++)                                                                                 \
            decode_q4(dtype, d, g, s + v * rec, o + v * d * (eb));                                                     \
    }

/* Defines kvhi_codec_encode_<isa> and kvhi_codec_decode_<isa> over a
 * set's per-dtype functions, named {encode,decode}_{int8,q4}_{f32,f16,bf16}
 * and taking (d, [g,] src, n, dst). */
#define KVHI_CODEC_BY_DTYPE(op)                                                                                        \
    bool int8 = codec == KVH_CODEC_INT8;                                                                               \
    switch (dtype) {                                                                                                   \
    case KVH_DTYPE_F16:                                                                                                \
        int8 ? op##_int8_f16(d, src, n, dst) : op##_q4_f16(d, g, src, n, dst);                                         \
        break;                                                                                                         \
    case KVH_DTYPE_BF16:                                                                                               \
        int8 ? op##_int8_bf16(d, src, n, dst) : op##_q4_bf16(d, g, src, n, dst);                                       \
        break;                                                                                                         \
    default:                                                                                                           \
        int8 ? op##_int8_f32(d, src, n, dst) : op##_q4_f32(d, g, src, n, dst);                                         \
        break;                                                                                                         \
    }
#define KVHI_CODEC_ENTRIES(isa)                                                                                        \
    void kvhi_codec_encode_##isa(uint32_t codec, uint32_t dtype, uint32_t d, uint32_t g, const void *src, size_t n,    \
                                 void *dst)                                                                            \
    {                                                                                                                  \
        KVHI_CODEC_BY_DTYPE(encode)                                                                                    \
    }                                                                                                                  \
    void kvhi_codec_decode_##isa(uint32_t codec, uint32_t dtype, uint32_t d, uint32_t g, const void *src, size_t n,    \
                                 void *dst)                                                                            \
    {                                                                                                                  \
        KVHI_CODEC_BY_DTYPE(decode)                                                                                    \
    }
#endif

#endif
