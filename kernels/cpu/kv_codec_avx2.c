/* KV codecs on AVX2 + FMA + F16C, 8 elements at a time: the same bytes as
 * the scalar codecs of kv_codec.c (tests/c/test_codec_isa.c compares them
 * on every kind of input). Called only when the CPU has the set: the
 * machines without AVX-512 (AMD before Zen 4, Intel client cores).
 *
 * The method is the AVX-512 codecs' (kv_codec_avx512.c): a code is
 * computed in float and trusted unless it lies within 2^-12 of a
 * half-integer, or the group is outside the conditions that bound the
 * float error (a normal scale, a range within a float); those are
 * computed in double as the format says. 4-bit decoding computes a
 * group's 16 values once, as the format does, and looks each code up:
 * a 16-bit value is two byte lookups (pshufb), an f32 one a permute. */
#include "kernels/cpu/kv_codec.h"
#include "kernels/cpu/kv_codec_simd.h"

#ifdef KVH_CODEC_X86_VECTOR
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdbool.h>
#include <string.h>

#include "kvh/kvh.h"
#include "kernels/attention_dtype.h"

#define AVX2 __attribute__((target("avx2,fma,f16c")))
/* Inlined into the per-dtype loops so the dtype tests fold away. */
#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))

/* Distance from a half-integer below which the float code is not trusted
 * (the float and double values differ by less than 2^-15). */
#define NEAR_HALF (0.5f - 0x1p-12f)
#define ROUND_NEAREST (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* Runs body for each chunk of 8 of n elements, with i its first element
 * and `left` the elements it has (8 but in the tail). */
#define FOR_CHUNKS(n, body)                                                                                            \
    do {                                                                                                               \
        uint32_t i = 0;                                                                                                \
        for (; i + 8 <= (n); i += 8) {                                                                                 \
            const uint32_t left = 8;                                                                                   \
            body                                                                                                       \
        }                                                                                                              \
        if (i < (n)) {                                                                                                 \
            const uint32_t left = (n)-i;                                                                               \
            body                                                                                                       \
        }                                                                                                              \
    } while (0)

AVX2_INLINE uint32_t elem_bytes(uint32_t dtype) { return dtype == KVH_DTYPE_F32 ? 4 : 2; }

/* Eight elements at p as f32 (widening is exact for every dtype). */
AVX2_INLINE __m256 widen8(uint32_t dtype, const void *p)
{
    if (dtype == KVH_DTYPE_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    if (dtype == KVH_DTYPE_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    return _mm256_loadu_ps((const float *)p);
}

/* Elements [i, i + left) of src as f32, the lanes past left zero. */
AVX2_INLINE __m256 load8(uint32_t dtype, const void *src, uint32_t i, uint32_t left)
{
    const uint8_t *p = (const uint8_t *)src + (size_t)i * elem_bytes(dtype);
    if (left == 8)
        return widen8(dtype, p);
    uint8_t tail[32] = {0};
    memcpy(tail, p, (size_t)left * elem_bytes(dtype));
    return widen8(dtype, tail);
}

/* f32 -> bf16 as kvhi_f32_to_bf16 (nearest-even, NaN quieted), eight
 * values into the low half. */
AVX2_INLINE __m128i to_bf16(__m256 y)
{
    __m256i b = _mm256_castps_si256(y);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    __m256i high = _mm256_srli_epi32(b, 16);
    __m256i odd = _mm256_and_si256(high, _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
    r = _mm256_blendv_epi8(r, _mm256_or_si256(high, _mm256_set1_epi32(0x40)), nan);
    /* values below 2^16: the unsigned pack is exact; it interleaves the
     * two 128-bit lanes, which the permute puts back in order */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8));
}

/* Sixteen f32 values, none a NaN, as bf16 (nearest-even): y0's in the
 * low half, y1's in the high one. */
AVX2_INLINE __m256i bf16_16_no_nan(__m256 y0, __m256 y1)
{
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff);
    __m256i b0 = _mm256_castps_si256(y0), b1 = _mm256_castps_si256(y1);
    __m256i r0 = _mm256_add_epi32(b0, _mm256_add_epi32(half, _mm256_and_si256(_mm256_srli_epi32(b0, 16), one)));
    __m256i r1 = _mm256_add_epi32(b1, _mm256_add_epi32(half, _mm256_and_si256(_mm256_srli_epi32(b1, 16), one)));
    __m256i w = _mm256_packus_epi32(_mm256_srli_epi32(r0, 16), _mm256_srli_epi32(r1, 16));
    return _mm256_permute4x64_epi64(w, 0xd8);
}

/* Eight f32 values as dtype at p (f16 by F16C: nearest-even, as the
 * scalar helper). */
AVX2_INLINE void narrow8(uint32_t dtype, void *p, __m256 y)
{
    if (dtype == KVH_DTYPE_F16)
        _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT));
    else if (dtype == KVH_DTYPE_BF16)
        _mm_storeu_si128((__m128i *)p, to_bf16(y));
    else
        _mm256_storeu_ps((float *)p, y);
}

AVX2_INLINE void store8(uint32_t dtype, void *dst, uint32_t i, uint32_t left, __m256 y)
{
    uint8_t *p = (uint8_t *)dst + (size_t)i * elem_bytes(dtype);
    if (left == 8) {
        narrow8(dtype, p, y);
        return;
    }
    uint8_t tail[32];
    narrow8(dtype, tail, y);
    memcpy(p, tail, (size_t)left * elem_bytes(dtype));
}

/* The format's quantise() of 8 elements, in double: NaN -> 0, (x -
 * offset) * inv rounded to nearest-even, saturated to [lo, hi]. */
AVX2_INLINE __m256i quantise_exact(__m256 x, double offset, double inv, double lo, double hi)
{
    const __m256d off = _mm256_set1_pd(offset), vinv = _mm256_set1_pd(inv);
    const __m256d vlo = _mm256_set1_pd(lo), vhi = _mm256_set1_pd(hi);
    __m128i code[2];
    for (int h = 0; h < 2; h++) {
        __m256d xd = _mm256_cvtps_pd(h ? _mm256_extractf128_ps(x, 1) : _mm256_castps256_ps128(x));
        __m256d q = _mm256_mul_pd(_mm256_sub_pd(xd, off), vinv);
        __m256d r = _mm256_min_pd(_mm256_max_pd(_mm256_round_pd(q, ROUND_NEAREST), vlo), vhi);
        r = _mm256_and_pd(r, _mm256_cmp_pd(q, q, _CMP_ORD_Q)); /* NaN -> +0 */
        code[h] = _mm256_cvtpd_epi32(r);
    }
    return _mm256_set_m128i(code[1], code[0]);
}

/* The same from the float product q (see the top of the file), or in
 * double when an element of q is near a half-integer. */
AVX2_INLINE __m256i quantise_fast(__m256 x, __m256 q, double offset, double inv, float lo, float hi)
{
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 r = _mm256_round_ps(q, ROUND_NEAREST);
    __m256 dist = _mm256_and_ps(_mm256_sub_ps(q, r), magnitude);
    if (_mm256_movemask_ps(_mm256_cmp_ps(dist, _mm256_set1_ps(NEAR_HALF), _CMP_GE_OQ)))
        return quantise_exact(x, offset, inv, lo, hi);
    r = _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(lo)), _mm256_set1_ps(hi));
    r = _mm256_and_ps(r, _mm256_cmp_ps(q, q, _CMP_ORD_Q)); /* NaN -> 0 */
    return _mm256_cvtps_epi32(r);
}

/* Eight int8 codes (in 32-bit lanes, within [-127, 127]) to codes + i. */
AVX2_INLINE void store_int8(int8_t *codes, uint32_t i, uint32_t left, __m256i c)
{
    __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    __m128i b = _mm_packs_epi16(w, w); /* exact: every code fits */
    if (left == 8) {
        _mm_storel_epi64((__m128i *)(codes + i), b);
        return;
    }
    uint8_t tail[16];
    _mm_storeu_si128((__m128i *)tail, b);
    memcpy(codes + i, tail, left);
}

/* Sixteen int8 codes (two vectors of 32-bit lanes, within [-127, 127])
 * to out. */
AVX2_INLINE void store_int8_16(int8_t *out, __m256i c0, __m256i c1)
{
    /* per 128-bit lane: c0's four codes, then c1's */
    __m256i w = _mm256_packs_epi32(c0, c1);
    __m256i b = _mm256_packs_epi16(w, w);
    /* dword 0 of a lane: c0's, dword 1: c1's */
    __m128i in_order = _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    _mm_storeu_si128((__m128i *)out, in_order);
}

/* Codes of a vector whose elements are all finite and whose float
 * product is trusted (scale normal): |q| stays within 127.0001 and no
 * NaN occurs. The largest distance from q to its code over 16 elements
 * (over the tail: the whole tail) tells whether any was near a
 * half-integer: those are then done again in double, unless the scale
 * is a power of two. */
AVX2_INLINE void int8_codes_finite(uint32_t dtype, uint32_t d, const void *src, float s, float inv_f, int8_t *codes)
{
    const __m256 vinv = _mm256_set1_ps(inv_f), magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    /* a power-of-two scale: the float product is exact, ties included */
    const __m256 near_half = _mm256_set1_ps(kvhi_codec_scale_is_pow2(s) ? INFINITY : NEAR_HALF);
    double inv = 1.0 / s;
    uint32_t at = 0;
    for (; at + 16 <= d; at += 16) {
        __m256 x0 = load8(dtype, src, at, 8), x1 = load8(dtype, src, at + 8, 8);
        __m256 q0 = _mm256_mul_ps(x0, vinv), q1 = _mm256_mul_ps(x1, vinv);
        __m256 r0 = _mm256_round_ps(q0, ROUND_NEAREST), r1 = _mm256_round_ps(q1, ROUND_NEAREST);
        __m256 dist = _mm256_max_ps(_mm256_and_ps(_mm256_sub_ps(q0, r0), magnitude),
                                    _mm256_and_ps(_mm256_sub_ps(q1, r1), magnitude));
        /* Checked per 16: inputs of few mantissa bits (bf16) meet exact
         * ties often, and only these 16 are then done again. */
        if (_mm256_movemask_ps(_mm256_cmp_ps(dist, near_half, _CMP_GE_OQ)))
            store_int8_16(codes + at, quantise_exact(x0, 0.0, inv, -127.0, 127.0),
                          quantise_exact(x1, 0.0, inv, -127.0, 127.0));
        else
            store_int8_16(codes + at, _mm256_cvtps_epi32(r0), _mm256_cvtps_epi32(r1));
    }
    __m256 worst = _mm256_setzero_ps();
    for (uint32_t i = at; i < d; i += 8) {
        uint32_t left = d - i < 8 ? d - i : 8;
        __m256 q = _mm256_mul_ps(load8(dtype, src, i, left), vinv);
        __m256 r = _mm256_round_ps(q, ROUND_NEAREST);
        worst = _mm256_max_ps(worst, _mm256_and_ps(_mm256_sub_ps(q, r), magnitude));
        store_int8(codes, i, left, _mm256_cvtps_epi32(r));
    }
    if (_mm256_movemask_ps(_mm256_cmp_ps(worst, near_half, _CMP_GE_OQ)))
        for (uint32_t i = at; i < d; i += 8) {
            uint32_t left = d - i < 8 ? d - i : 8;
            store_int8(codes, i, left, quantise_exact(load8(dtype, src, i, left), 0.0, inv, -127.0, 127.0));
        }
}

/* Codes of any int8 vector with scale s, as the format. */
AVX2_INLINE void int8_codes(uint32_t dtype, uint32_t d, const void *src, float s, float inv_f, int8_t *codes)
{
    const __m256 inf = _mm256_set1_ps(INFINITY), ninf = _mm256_set1_ps(-INFINITY), vinv = _mm256_set1_ps(inv_f);
    double inv = s > 0.0f ? 1.0 / s : 0.0;
    FOR_CHUNKS(d, {
        __m256 x = load8(dtype, src, i, left);
        __m256i c;
        if (s >= FLT_MIN) {
            c = quantise_fast(x, _mm256_mul_ps(x, vinv), 0.0, inv, -127.0f, 127.0f);
        } else if (inv > 0.0) { /* subnormal scale: inv overflows a float */
            c = quantise_exact(x, 0.0, inv, -127.0, 127.0);
        } else { /* no finite non-zero element: infinities saturate */
            __m256i pos = _mm256_castps_si256(_mm256_cmp_ps(x, inf, _CMP_EQ_OQ));
            __m256i neg = _mm256_castps_si256(_mm256_cmp_ps(x, ninf, _CMP_EQ_OQ));
            c = _mm256_or_si256(_mm256_and_si256(pos, _mm256_set1_epi32(127)),
                                _mm256_and_si256(neg, _mm256_set1_epi32(-127)));
        }
        store_int8(codes, i, left, c);
    });
}

/* max |x| over the finite elements; *finite false when there are others.
 * The magnitudes' bits order as their values, and infinities and NaNs
 * are above every finite one: one integer maximum finds both. */
AVX2_INLINE float int8_amax(uint32_t dtype, uint32_t d, const void *src, bool *finite)
{
    uint32_t top = 0;
    if (dtype == KVH_DTYPE_F16 || dtype == KVH_DTYPE_BF16) {
        const uint16_t *h = src;
        const __m256i magnitude = _mm256_set1_epi16(0x7fff);
        __m256i m = _mm256_setzero_si256();
        uint32_t i = 0;
        for (; i + 16 <= d; i += 16)
            m = _mm256_max_epu16(m, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(h + i)), magnitude));
        __m128i b = _mm_max_epu16(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
        b = _mm_max_epu16(b, _mm_srli_si128(b, 8));
        b = _mm_max_epu16(b, _mm_srli_si128(b, 4));
        b = _mm_max_epu16(b, _mm_srli_si128(b, 2));
        top = (uint32_t)_mm_extract_epi16(b, 0);
        for (; i < d; i++) {
            uint16_t v;
            memcpy(&v, h + i, sizeof(v));
            top = (v & 0x7fffu) > top ? (v & 0x7fffu) : top;
        }
        *finite = top < (dtype == KVH_DTYPE_F16 ? 0x7c00u : 0x7f80u);
        if (*finite)
            return dtype == KVH_DTYPE_F16 ? kvhi_f16_to_f32((uint16_t)top) : kvhi_bf16_to_f32((uint16_t)top);
    } else {
        const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
        __m256i m = _mm256_setzero_si256();
        FOR_CHUNKS(d, {
            m = _mm256_max_epu32(m, _mm256_and_si256(_mm256_castps_si256(load8(dtype, src, i, left)), magnitude));
        });
        __m128i b = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
        b = _mm_max_epu32(b, _mm_srli_si128(b, 8));
        b = _mm_max_epu32(b, _mm_srli_si128(b, 4));
        top = (uint32_t)_mm_cvtsi128_si32(b);
        *finite = top < 0x7f800000u;
        if (*finite) {
            float amax;
            memcpy(&amax, &top, sizeof(amax));
            return amax;
        }
    }
    const __m256 inf = _mm256_set1_ps(INFINITY), magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 a = _mm256_setzero_ps();
    FOR_CHUNKS(d, {
        __m256 x = _mm256_and_ps(load8(dtype, src, i, left), magnitude);
        a = _mm256_max_ps(a, _mm256_and_ps(x, _mm256_cmp_ps(x, inf, _CMP_LT_OQ))); /* inf, NaN -> 0 */
    });
    float lanes[8], amax = 0.0f;
    _mm256_storeu_ps(lanes, a);
    for (int k = 0; k < 8; k++)
        amax = lanes[k] > amax ? lanes[k] : amax;
    return amax;
}

/* Vectors (int8) or 4-bit groups encoded together: their scales are
 * computed with vector divisions, the format's operations and so the same
 * values, which takes the divisions' latency off each one's path. */
enum { BATCH = 8 };

/* The next batch's input, fetched while this one is coded: the range
 * pass reads a whole batch before any coding, which on its own leaves
 * the loads' latency with nothing to overlap (prefetches do not fault,
 * past the input's end included). Vectors above 4 KiB (head_dim over
 * 1024 in f32) are long enough for the hardware's own prefetch, and
 * fetching all of one would only push the current one out. */
AVX2_INLINE void prefetch_next(const uint8_t *p, size_t bytes)
{
    for (size_t at = 0; at < bytes && at < 4096; at += 64)
        _mm_prefetch((const char *)p + at, _MM_HINT_T0);
}

/* nv <= BATCH vectors of d elements, raw stride `in` bytes, records of
 * `out` bytes. */
AVX2_INLINE void encode_int8_batch(uint32_t dtype, uint32_t d, const uint8_t *src, uint32_t nv, size_t in, uint8_t *rec,
                                   size_t out)
{
    float amax[BATCH] = {0}, scale[BATCH], inv[BATCH];
    bool finite[BATCH];
    for (uint32_t v = 0; v < nv; v++)
        amax[v] = int8_amax(dtype, d, src + v * in, &finite[v]);
    __m256 vs = _mm256_div_ps(_mm256_loadu_ps(amax), _mm256_set1_ps(127.0f));
    _mm256_storeu_ps(scale, vs);
    _mm256_storeu_ps(inv, _mm256_div_ps(_mm256_set1_ps(1.0f), vs)); /* within 2^-24 of 1 / scale */
    KVHI_CODEC_INT8_RECORDS(dtype, d, src, nv, in, rec, out, scale, inv, finite, prefetch_next(x + (size_t)nv * in, in))
}

AVX2_INLINE void decode_int8(uint32_t dtype, uint32_t d, const uint8_t *rec, void *dst)
{
    const __m256 scale = _mm256_set1_ps(kvhi_codec_get_f32(rec));
    const int8_t *codes = (const int8_t *)(rec + sizeof(float));
    uint32_t at = 0;
    /* A finite scale times a code is never a NaN: bf16 needs no NaN
     * test then, and goes 16 at a time. */
    if (dtype == KVH_DTYPE_BF16 && isfinite(kvhi_codec_get_f32(rec)))
        for (; at + 16 <= d; at += 16) {
            __m128i b = _mm_loadu_si128((const __m128i *)(codes + at));
            __m256 y0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), scale);
            __m256 y1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))), scale);
            _mm256_storeu_si256((__m256i *)((uint16_t *)dst + at), bf16_16_no_nan(y0, y1));
        }
    codes += at;
    dst = (uint16_t *)dst + (dtype == KVH_DTYPE_F32 ? 2 * at : at);
    d -= at;
    FOR_CHUNKS(d, {
        __m128i b;
        if (left == 8) {
            b = _mm_loadl_epi64((const __m128i *)(codes + i));
        } else {
            uint8_t tail[16] = {0};
            memcpy(tail, codes + i, left);
            b = _mm_loadu_si128((const __m128i *)tail);
        }
        /* code * scale is exact in double: a float multiply rounds it once */
        store8(dtype, dst, i, left, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), scale));
    });
}

/* ---- 4-bit ---- */

/* The first zero of the group's g elements (a multiple of 8), or +0 when
 * there is none: the sign the scalar loop leaves on a zero extreme. */
AVX2_INLINE float first_zero(uint32_t dtype, const void *src, uint32_t g)
{
    for (uint32_t i = 0; i < g; i += 8) {
        __m256 x = load8(dtype, src, i, 8);
        int z = _mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_EQ_OQ));
        if (z) {
            float lane[8];
            _mm256_storeu_ps(lane, x);
            return lane[__builtin_ctz((unsigned)z)];
        }
    }
    return 0.0f;
}

/* Whether the g elements at src (g a multiple of 16) are all finite: the
 * largest magnitude's bits, below those of infinity. */
AVX2_INLINE bool all_finite(uint32_t dtype, uint32_t g, const void *src)
{
    __m256i m = _mm256_setzero_si256();
    if (dtype == KVH_DTYPE_F32) {
        const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
        for (uint32_t i = 0; i < g; i += 8)
            m = _mm256_max_epu32(
                m, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)((const float *)src + i)), magnitude));
        return !_mm256_movemask_epi8(_mm256_cmpgt_epi32(m, _mm256_set1_epi32(0x7f7fffff)));
    }
    const __m256i magnitude = _mm256_set1_epi16(0x7fff);
    for (uint32_t i = 0; i < g; i += 16)
        m = _mm256_max_epu16(
            m, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)((const uint16_t *)src + i)), magnitude));
    /* below infinity: the saturating add leaves each word's top bit (the
     * top bit of its high byte) clear */
    __m256i room = _mm256_set1_epi16(dtype == KVH_DTYPE_F16 ? 0x7fff - 0x7bff : 0x7fff - 0x7f7f);
    return !((uint32_t)_mm256_movemask_epi8(_mm256_adds_epu16(m, room)) & 0xaaaaaaaau);
}

/* The lane-wise least and greatest finite elements of a group of g (a
 * multiple of 16), +inf and -inf in lanes that meet none; whether every
 * element is finite. */
AVX2_INLINE bool q4_lanes(uint32_t dtype, uint32_t g, const void *src, __m256 *lo_out, __m256 *hi_out)
{
    const __m256 inf = _mm256_set1_ps(INFINITY), ninf = _mm256_set1_ps(-INFINITY);
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 vlo = inf, vhi = ninf;
    bool finite = all_finite(dtype, g, src);
    if (finite) {
        for (uint32_t i = 0; i < g; i += 8) {
            __m256 x = load8(dtype, src, i, 8);
            vlo = _mm256_min_ps(vlo, x);
            vhi = _mm256_max_ps(vhi, x);
        }
    } else {
        for (uint32_t i = 0; i < g; i += 8) {
            __m256 x = load8(dtype, src, i, 8);
            __m256 f = _mm256_cmp_ps(_mm256_and_ps(x, magnitude), inf, _CMP_LT_OQ);
            vlo = _mm256_min_ps(vlo, _mm256_blendv_ps(inf, x, f));
            vhi = _mm256_max_ps(vhi, _mm256_blendv_ps(ninf, x, f));
        }
    }
    *lo_out = vlo;
    *hi_out = vhi;
    return finite;
}

/* The least and greatest finite element of each of BATCH groups (k
 * below ng, at src + k * stride), as the scalar loop finds them (0, 0
 * when a group has none); bit k of the result: group k is all finite.
 * The groups' lane-wise extremes are reduced together, each step
 * halving the lanes of two vectors into one (groups k and k + 4 first,
 * so that the last step leaves group k in lane k): 21 operations for
 * eight groups, against 48 one at a time. */
AVX2_INLINE uint32_t q4_ranges(uint32_t dtype, uint32_t g, const uint8_t *src, size_t stride, uint32_t ng, float *lo,
                               float *hi)
{
    __m256 tlo[4], thi[4];
    uint32_t finite = 0;
#pragma GCC unroll 4
    for (uint32_t k = 0; k < 4; k++) {
        __m256 alo = _mm256_setzero_ps(), ahi = alo, blo = alo, bhi = alo;
        if (k < ng)
            finite |= (uint32_t)q4_lanes(dtype, g, src + k * stride, &alo, &ahi) << k;
        if (k + 4 < ng)
            finite |= (uint32_t)q4_lanes(dtype, g, src + (k + 4) * stride, &blo, &bhi) << (k + 4);
        tlo[k] = _mm256_min_ps(_mm256_permute2f128_ps(alo, blo, 0x20), _mm256_permute2f128_ps(alo, blo, 0x31));
        thi[k] = _mm256_max_ps(_mm256_permute2f128_ps(ahi, bhi, 0x20), _mm256_permute2f128_ps(ahi, bhi, 0x31));
    }
    /* lanes 0-3: groups k's four, 4-7: group k + 4's; then two of each */
    __m256 ulo0 = _mm256_min_ps(_mm256_shuffle_ps(tlo[0], tlo[1], 0x44), _mm256_shuffle_ps(tlo[0], tlo[1], 0xee));
    __m256 ulo1 = _mm256_min_ps(_mm256_shuffle_ps(tlo[2], tlo[3], 0x44), _mm256_shuffle_ps(tlo[2], tlo[3], 0xee));
    __m256 uhi0 = _mm256_max_ps(_mm256_shuffle_ps(thi[0], thi[1], 0x44), _mm256_shuffle_ps(thi[0], thi[1], 0xee));
    __m256 uhi1 = _mm256_max_ps(_mm256_shuffle_ps(thi[2], thi[3], 0x44), _mm256_shuffle_ps(thi[2], thi[3], 0xee));
    __m256 l = _mm256_min_ps(_mm256_shuffle_ps(ulo0, ulo1, 0x88), _mm256_shuffle_ps(ulo0, ulo1, 0xdd));
    __m256 h = _mm256_max_ps(_mm256_shuffle_ps(uhi0, uhi1, 0x88), _mm256_shuffle_ps(uhi0, uhi1, 0xdd));
    __m256 none = _mm256_cmp_ps(l, h, _CMP_GT_OQ); /* no finite element: 0, 0 */
    l = _mm256_andnot_ps(none, l);
    h = _mm256_andnot_ps(none, h);
    _mm256_storeu_ps(lo, l);
    _mm256_storeu_ps(hi, h);
    /* SIMD min and max may return either zero: the scalar loop keeps the
     * first zero met */
    __m256 zero = _mm256_setzero_ps();
    uint32_t zeros = (uint32_t)_mm256_movemask_ps(
        _mm256_andnot_ps(none, _mm256_or_ps(_mm256_cmp_ps(l, zero, _CMP_EQ_OQ), _mm256_cmp_ps(h, zero, _CMP_EQ_OQ))));
    for (zeros &= (1u << ng) - 1; zeros; zeros &= zeros - 1) {
        uint32_t k = (uint32_t)__builtin_ctz(zeros);
        float z = first_zero(dtype, src + k * stride, g);
        lo[k] = lo[k] == 0.0f ? z : lo[k];
        hi[k] = hi[k] == 0.0f ? z : hi[k];
    }
    return finite;
}

/* Eight codes (0..15 in 32-bit lanes) as 4 bytes, low nibble first. */
AVX2_INLINE void pack_nibbles(__m256i c, uint8_t *out)
{
    __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    __m128i b = _mm_packus_epi16(w, w);
    /* 16-bit lane j holds codes 2j and 2j + 1: low nibble, then high */
    __m128i pair = _mm_or_si128(_mm_and_si128(b, _mm_set1_epi16(0x000f)),
                                _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi16(0x00f0)));
    int32_t four = _mm_cvtsi128_si32(_mm_packus_epi16(pair, pair));
    memcpy(out, &four, sizeof(four));
}

/* Thirty-two codes (four vectors of 0..15 in 32-bit lanes) as 16 bytes,
 * low nibble first. */
AVX2_INLINE void pack_nibbles32(__m256i c0, __m256i c1, __m256i c2, __m256i c3, uint8_t *out)
{
    /* per 128-bit lane: four codes of c0, c1, c2 and c3 in turn, as bytes */
    __m256i b = _mm256_packus_epi16(_mm256_packs_epi32(c0, c1), _mm256_packs_epi32(c2, c3));
    /* each pair of codes into one byte: even + 16 x odd */
    __m256i pairs = _mm256_maddubs_epi16(b, _mm256_set1_epi16(0x1001));
    __m256i p = _mm256_packus_epi16(pairs, pairs);
    /* 16-bit word j of a lane: c_j's pairs */
    __m128i in_order = _mm_unpacklo_epi16(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
    _mm_storeu_si128((__m128i *)out, in_order);
}

/* Codes of sixteen finite elements from x0, x1 and their float products
 * q0, q1 (no clamping is needed: q within 0..15.0001, no NaN); done
 * again in double when one was near a half-integer. */
AVX2_INLINE void q4_codes16(__m256 x0, __m256 x1, __m256 q0, __m256 q1, float lo, double inv, __m256i *c0, __m256i *c1)
{
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 r0 = _mm256_round_ps(q0, ROUND_NEAREST), r1 = _mm256_round_ps(q1, ROUND_NEAREST);
    __m256 dist =
        _mm256_max_ps(_mm256_and_ps(_mm256_sub_ps(q0, r0), magnitude), _mm256_and_ps(_mm256_sub_ps(q1, r1), magnitude));
    if (_mm256_movemask_ps(_mm256_cmp_ps(dist, _mm256_set1_ps(NEAR_HALF), _CMP_GE_OQ))) { /* per 16, as int8's */
        *c0 = quantise_exact(x0, lo, inv, 0.0, 15.0);
        *c1 = quantise_exact(x1, lo, inv, 0.0, 15.0);
    } else {
        *c0 = _mm256_cvtps_epi32(r0);
        *c1 = _mm256_cvtps_epi32(r1);
    }
}

/* Codes of a group whose elements are all finite and whose float product
 * is trusted. g is a multiple of 32. */
AVX2_INLINE void q4_codes_finite(uint32_t dtype, uint32_t g, const void *src, float lo, float s, float inv_f,
                                 uint8_t *gc)
{
    const __m256 vmin = _mm256_set1_ps(lo), vinv = _mm256_set1_ps(inv_f);
    double inv = 1.0 / s;
    for (uint32_t i = 0; i < g; i += 32) {
        __m256i c0, c1, c2, c3;
        __m256 x0 = load8(dtype, src, i, 8), x1 = load8(dtype, src, i + 8, 8);
        q4_codes16(x0, x1, _mm256_mul_ps(_mm256_sub_ps(x0, vmin), vinv), _mm256_mul_ps(_mm256_sub_ps(x1, vmin), vinv),
                   lo, inv, &c0, &c1);
        __m256 x2 = load8(dtype, src, i + 16, 8), x3 = load8(dtype, src, i + 24, 8);
        q4_codes16(x2, x3, _mm256_mul_ps(_mm256_sub_ps(x2, vmin), vinv), _mm256_mul_ps(_mm256_sub_ps(x3, vmin), vinv),
                   lo, inv, &c2, &c3);
        pack_nibbles32(c0, c1, c2, c3, gc + i / 2);
    }
}

/* Codes of any group, as the format; in_float: the float product is
 * trusted (scale normal, range within a float). */
AVX2_INLINE void q4_codes(uint32_t dtype, uint32_t g, const void *src, float lo, float s, float inv_f, bool in_float,
                          uint8_t *gc)
{
    const __m256 inf = _mm256_set1_ps(INFINITY), vmin = _mm256_set1_ps(lo), vinv = _mm256_set1_ps(inv_f);
    double inv = s > 0.0f ? 1.0 / s : 0.0;
    for (uint32_t i = 0; i < g; i += 8) {
        __m256 x = load8(dtype, src, i, 8);
        __m256i c;
        if (in_float)
            c = quantise_fast(x, _mm256_mul_ps(_mm256_sub_ps(x, vmin), vinv), lo, inv, 0.0f, 15.0f);
        else if (inv > 0.0)
            c = quantise_exact(x, lo, inv, 0.0, 15.0);
        else /* a constant group: +inf takes the top code */
            c = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(x, inf, _CMP_EQ_OQ)), _mm256_set1_epi32(15));
        pack_nibbles(c, gc + i / 2);
    }
}

/* ---- 4-bit encoding, BATCH groups at a time (see BATCH) ---- */

AVX2_INLINE void encode_q4_batch(uint32_t dtype, uint32_t d, uint32_t g, const uint8_t *src, size_t first, uint32_t ng,
                                 uint8_t *dst)
{
    uint32_t eb = elem_bytes(dtype), gpv = d / g;
    size_t rec = (size_t)gpv * 2 * sizeof(float) + d / 2;
    float lo[BATCH], hi[BATCH], scale[BATCH], inv[BATCH];
    const uint8_t *x0 = src + first * g * eb;
    uint32_t finite = q4_ranges(dtype, g, x0, (size_t)g * eb, ng, lo, hi);
    __m256 vlo = _mm256_loadu_ps(lo), vhi = _mm256_loadu_ps(hi);
    __m128 part[2];
    uint32_t in_range = 0, fit = 0;
    for (int h = 0; h < 2; h++) { /* (float)(((double)hi - lo) / 15.0), 4 at a time */
        __m256d l = _mm256_cvtps_pd(h ? _mm256_extractf128_ps(vlo, 1) : _mm256_castps256_ps128(vlo));
        __m256d u = _mm256_cvtps_pd(h ? _mm256_extractf128_ps(vhi, 1) : _mm256_castps256_ps128(vhi));
        __m256d range = _mm256_sub_pd(u, l); /* may exceed FLT_MAX; its 15th does not */
        part[h] = _mm256_cvtpd_ps(_mm256_div_pd(range, _mm256_set1_pd(15.0)));
        in_range |= (uint32_t)_mm256_movemask_pd(_mm256_cmp_pd(range, _mm256_set1_pd(FLT_MAX), _CMP_LE_OQ)) << (4 * h);
        /* kvhi_codec_q4_scale_fit's test: lo + 15 * scale (exact) rounds past FLT_MAX */
        __m256d top = _mm256_add_pd(l, _mm256_mul_pd(_mm256_cvtps_pd(part[h]), _mm256_set1_pd(15.0)));
        __m128 topf = _mm_andnot_ps(_mm_set1_ps(-0.0f), _mm256_cvtpd_ps(top));
        fit |= (uint32_t)_mm_movemask_ps(_mm_cmpeq_ps(topf, _mm_set1_ps(INFINITY))) << (4 * h);
    }
    __m256 vs = _mm256_set_m128(part[1], part[0]);
    _mm256_storeu_ps(scale, vs);
    _mm256_storeu_ps(inv, _mm256_div_ps(_mm256_set1_ps(1.0f), vs)); /* within 2^-24 of 1 / scale */
    uint32_t normal = (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(vs, _mm256_set1_ps(FLT_MIN), _CMP_GE_OQ));
    for (fit &= (1u << ng) - 1; fit; fit &= fit - 1) { /* groups within an ulp or so of FLT_MAX */
        uint32_t k = (uint32_t)__builtin_ctz(fit);
        scale[k] = kvhi_codec_q4_scale_fit(scale[k], lo[k]);
        inv[k] = 1.0f / scale[k];
        normal = scale[k] >= FLT_MIN ? normal | (1u << k) : normal & ~(1u << k);
    }
    uint32_t in_float = in_range & normal;
    size_t v = first / gpv, gi = first % gpv;
    for (uint32_t k = 0; k < ng; k++, gi = gi + 1 == gpv ? (v++, 0) : gi + 1) {
        const uint8_t *x = x0 + (size_t)k * g * eb;
        uint8_t *head = dst + v * rec + gi * 2 * sizeof(float),
                *gc = dst + v * rec + gpv * 2 * sizeof(float) + gi * g / 2;
        kvhi_codec_put_f32(head, scale[k]);
        kvhi_codec_put_f32(head + sizeof(float), lo[k]);
        if ((in_float & finite) >> k & 1)
            q4_codes_finite(dtype, g, x, lo[k], scale[k], inv[k], gc);
        else
            q4_codes(dtype, g, x, lo[k], scale[k], inv[k], (in_float >> k) & 1, gc);
    }
}

/* The 16 values of a group, lo + q * scale for q = 0..15, as the format
 * computes them: the product is exact in double, the sum rounds once in
 * double and once to float. */
AVX2_INLINE void q4_values(float scale, float lo, __m256 *v0, __m256 *v8)
{
    const __m256d s = _mm256_set1_pd(scale), m = _mm256_set1_pd(lo);
    __m128 part[4];
    for (int k = 0; k < 4; k++) {
        __m256d q = _mm256_setr_pd(4 * k, 4 * k + 1, 4 * k + 2, 4 * k + 3);
        part[k] = _mm256_cvtpd_ps(_mm256_add_pd(_mm256_mul_pd(q, s), m));
    }
    *v0 = _mm256_set_m128(part[1], part[0]);
    *v8 = _mm256_set_m128(part[3], part[2]);
}

AVX2_INLINE void lookup_q4_f32(uint32_t g, const uint8_t *gc, __m256 v0, __m256 v8, float *y)
{
    const __m256i shifts = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4), nibble = _mm256_set1_epi32(0xf);
    for (uint32_t i = 0; i < g; i += 8) {
        int32_t four;
        memcpy(&four, gc + i / 2, sizeof(four));
        __m128i b = _mm_cvtsi32_si128(four);
        /* each byte twice, then its low nibble and its high one */
        __m256i q = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(b, b));
        q = _mm256_and_si256(_mm256_srlv_epi32(q, shifts), nibble);
        /* the permutes read the low three bits; bit 3 picks the table */
        __m256 low = _mm256_permutevar8x32_ps(v0, q), high = _mm256_permutevar8x32_ps(v8, q);
        __m256 upper = _mm256_castsi256_ps(_mm256_slli_epi32(q, 28));
        _mm256_storeu_ps(y + i, _mm256_blendv_ps(low, high, upper));
    }
}

/* A group's 16 values as 16-bit (f16 or bf16), 0-7 in *h0 and 8-15 in
 * *h8. Values of a finite scale and minimum are never NaN, and bf16 then
 * rounds them without the NaN test. */
AVX2_INLINE void q4_values16(uint32_t dtype, __m256 v0, __m256 v8, bool finite, __m128i *h0, __m128i *h8)
{
    if (dtype == KVH_DTYPE_F16) {
        *h0 = _mm256_cvtps_ph(v0, _MM_FROUND_TO_NEAREST_INT);
        *h8 = _mm256_cvtps_ph(v8, _MM_FROUND_TO_NEAREST_INT);
    } else if (!finite) {
        *h0 = to_bf16(v0);
        *h8 = to_bf16(v8);
    } else {
        __m256i w = bf16_16_no_nan(v0, v8);
        *h0 = _mm256_castsi256_si128(w);
        *h8 = _mm256_extracti128_si256(w, 1);
    }
}

/* 16-bit values: the low and the high bytes of the group's 16 values
 * (h0, h8) are two 16-entry byte tables, looked up by each code. */
AVX2_INLINE void lookup_q4_16(uint32_t g, const uint8_t *gc, __m128i h0, __m128i h8, uint16_t *y)
{
    const __m128i split = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    __m128i s0 = _mm_shuffle_epi8(h0, split), s8 = _mm_shuffle_epi8(h8, split);
    /* low bytes of values 0..15, then their high bytes, each in both lanes */
    __m128i low_bytes = _mm_unpacklo_epi64(s0, s8), high_bytes = _mm_unpackhi_epi64(s0, s8);
    __m256i tlo = _mm256_broadcastsi128_si256(low_bytes), thi = _mm256_broadcastsi128_si256(high_bytes);
    const __m128i nibble = _mm_set1_epi8(0x0f);
    for (uint32_t i = 0; i < g; i += 32) {
        __m128i b = _mm_loadu_si128((const __m128i *)(gc + i / 2));
        __m128i l = _mm_and_si128(b, nibble), h = _mm_and_si128(_mm_srli_epi16(b, 4), nibble);
        /* codes in element order: byte j's low nibble, then its high one */
        __m256i idx = _mm256_set_m128i(_mm_unpackhi_epi8(l, h), _mm_unpacklo_epi8(l, h));
        __m256i lo8 = _mm256_shuffle_epi8(tlo, idx), hi8 = _mm256_shuffle_epi8(thi, idx);
        __m256i a = _mm256_unpacklo_epi8(lo8, hi8), c = _mm256_unpackhi_epi8(lo8, hi8);
        _mm256_storeu_si256((__m256i *)(y + i), _mm256_permute2x128_si256(a, c, 0x20));
        _mm256_storeu_si256((__m256i *)(y + i + 16), _mm256_permute2x128_si256(a, c, 0x31));
    }
}

AVX2_INLINE void decode_q4(uint32_t dtype, uint32_t d, uint32_t g, const uint8_t *rec, void *dst)
{
    uint32_t groups = d / g;
    const uint8_t *codes = rec + (size_t)groups * 2 * sizeof(float);
    for (uint32_t gi = 0; gi < groups; gi++) {
        const uint8_t *head = rec + (size_t)gi * 2 * sizeof(float), *gc = codes + (size_t)gi * g / 2;
        __m256 v0, v8;
        float scale = kvhi_codec_get_f32(head), lo = kvhi_codec_get_f32(head + sizeof(float));
        q4_values(scale, lo, &v0, &v8);
        if (dtype == KVH_DTYPE_F32)
            lookup_q4_f32(g, gc, v0, v8, (float *)dst + (size_t)gi * g);
        else {
            __m128i h0, h8;
            q4_values16(dtype, v0, v8, isfinite(scale) && isfinite(lo), &h0, &h8);
            lookup_q4_16(g, gc, h0, h8, (uint16_t *)dst + (size_t)gi * g);
        }
    }
}

/* ---- per-dtype loops over n vectors ---- */

KVHI_CODEC_SHARED_LOOPS(AVX2, f32, KVH_DTYPE_F32, 4)
KVHI_CODEC_SHARED_LOOPS(AVX2, f16, KVH_DTYPE_F16, 2)
KVHI_CODEC_SHARED_LOOPS(AVX2, bf16, KVH_DTYPE_BF16, 2)

KVHI_CODEC_ENTRIES(avx2)
#endif
