/* KV codecs on AVX-512 F/BW/VL/DQ, 16 elements at a time: the same bytes
 * as the scalar codecs of kv_codec.c (tests/c/test_codec_isa.c compares
 * them on every kind of input). Called only when the CPU has the set.
 *
 * Encoding rounds x * inv (int8) or (x - min) * inv (4-bit) to a code;
 * the format computes that in double. Here it is computed in float, which
 * is within 2^-15 of the double value whenever the stored scale is a
 * normal float and the group's range fits a float (relative error at most
 * 3 x 2^-24 on a value below 128), so both round to the same code unless
 * the float value lies within 2^-12 of a half-integer: those 16 elements,
 * and groups outside the conditions, are computed in double exactly as
 * the format says.
 *
 * Decoding int8 is a float multiply, as the format. A 4-bit group has 16
 * possible values: they are computed once per group as the format does
 * (in double, rounded once to float, then to the dtype) and each code
 * looks its value up with a permute. */
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

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
/* Inlined into the per-dtype loops so the dtype tests fold away. */
#define AVX512_INLINE                                                                                                  \
    static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

/* Distance from a half-integer below which the float code is not trusted
 * (the float and double values differ by less than 2^-15). */
#define NEAR_HALF (0.5f - 0x1p-12f)
#define ROUND_NEAREST (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* Lanes of a chunk starting `left` elements before the end. */
static inline __mmask16 lanes(uint32_t left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1); }

/* Runs body for each chunk of 16 of n elements, with i its first element
 * and k its lanes: whole chunks with a constant mask (plain loads and
 * stores), then the tail. */
#define FOR_CHUNKS(n, body)                                                                                            \
    do {                                                                                                               \
        uint32_t i = 0;                                                                                                \
        for (; i + 16 <= (n); i += 16) {                                                                               \
            const __mmask16 k = 0xffff;                                                                                \
            body                                                                                                       \
        }                                                                                                              \
        if (i < (n)) {                                                                                                 \
            const __mmask16 k = lanes((n)-i);                                                                          \
            body                                                                                                       \
        }                                                                                                              \
    } while (0)

/* Elements [i, i + 16) of src as f32, lanes outside m zero. Widening is
 * exact for every dtype. */
AVX512_INLINE __m512 load16(uint32_t dtype, const void *src, uint32_t i, __mmask16 m)
{
    if (dtype == KVH_DTYPE_F16)
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)src + i));
    if (dtype == KVH_DTYPE_BF16) {
        __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)src + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    }
    return _mm512_maskz_loadu_ps(m, (const float *)src + i);
}

/* f32 -> bf16 as kvhi_f32_to_bf16: nearest-even, NaN quieted. */
AVX512_INLINE __m256i to_bf16(__m512 y)
{
    __m512i b = _mm512_castps_si512(y);
    __mmask16 nan =
        _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    __m512i high = _mm512_srli_epi32(b, 16);
    __m512i odd = _mm512_and_si512(high, _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    r = _mm512_mask_or_epi32(r, nan, high, _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

/* f32 -> f16 (F16C rounds to nearest-even, as kvhi_f32_to_f16). */
AVX512_INLINE __m256i to_f16(__m512 y) { return _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT); }

AVX512_INLINE void store16(uint32_t dtype, void *dst, uint32_t i, __mmask16 m, __m512 y)
{
    if (dtype == KVH_DTYPE_F16)
        _mm256_mask_storeu_epi16((uint16_t *)dst + i, m, to_f16(y));
    else if (dtype == KVH_DTYPE_BF16)
        _mm256_mask_storeu_epi16((uint16_t *)dst + i, m, to_bf16(y));
    else
        _mm512_mask_storeu_ps((float *)dst + i, m, y);
}

/* The format's quantise() of 16 elements, in double: NaN -> 0, (x -
 * offset) * inv rounded to nearest-even, saturated to [lo, hi]. */
AVX512_INLINE __m512i quantise_exact(__m512 x, double offset, double inv, double lo, double hi)
{
    const __m512d off = _mm512_set1_pd(offset), vinv = _mm512_set1_pd(inv);
    const __m512d vlo = _mm512_set1_pd(lo), vhi = _mm512_set1_pd(hi);
    __m512d half[2] = {_mm512_cvtps_pd(_mm512_castps512_ps256(x)), _mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1))};
    __m256i code[2];
    for (int h = 0; h < 2; h++) {
        __m512d q = _mm512_mul_pd(_mm512_sub_pd(half[h], off), vinv);
        __m512d r = _mm512_min_pd(_mm512_max_pd(_mm512_roundscale_pd(q, ROUND_NEAREST), vlo), vhi);
        code[h] = _mm512_maskz_cvtpd_epi32(_mm512_cmp_pd_mask(q, q, _CMP_ORD_Q), r);
    }
    return _mm512_inserti64x4(_mm512_castsi256_si512(code[0]), code[1], 1);
}

/* quantise_exact for finite x whose codes are known to lie within the
 * range (no clamping, no NaN): rounded to nearest-even by the conversion. */
AVX512_INLINE __m512i quantise_exact_finite(__m512 x, double offset, double inv)
{
    const __m512d off = _mm512_set1_pd(offset), vinv = _mm512_set1_pd(inv);
    __m512d q0 = _mm512_mul_pd(_mm512_sub_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(x)), off), vinv);
    __m512d q1 = _mm512_mul_pd(_mm512_sub_pd(_mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1)), off), vinv);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvt_roundpd_epi32(q0, ROUND_NEAREST)),
                              _mm512_cvt_roundpd_epi32(q1, ROUND_NEAREST), 1);
}

/* The same from the float product q (see the top of the file), or in
 * double when an element of q is near a half-integer. */
AVX512_INLINE __m512i quantise_fast(__m512 x, __m512 q, double offset, double inv, float lo, float hi)
{
    __m512 r = _mm512_roundscale_ps(q, ROUND_NEAREST);
    if (_mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(q, r)), _mm512_set1_ps(NEAR_HALF), _CMP_GE_OQ))
        return quantise_exact(x, offset, inv, lo, hi);
    r = _mm512_min_ps(_mm512_max_ps(r, _mm512_set1_ps(lo)), _mm512_set1_ps(hi));
    return _mm512_maskz_cvtps_epi32(_mm512_cmp_ps_mask(q, q, _CMP_ORD_Q), r); /* NaN -> 0 */
}

/* ---- encoding, BATCH groups at a time ----
 * A group (an int8 vector, or a 4-bit group) is read twice: for its range,
 * then for its codes. The scales of BATCH groups are computed together
 * with vector divisions (the format's operations, so the same values),
 * which takes the divisions' latency off each group's path. */
enum { BATCH = 16 };

/* Codes of a group whose elements are all finite and whose float product
 * is trusted (scale normal, range within a float): no clamping is needed
 * (|q| stays within 127.0001, or within 0..15.0001) and no NaN occurs.
 * The largest distance from q to its code over the group tells whether
 * any element was near a half-integer: the group is then done again in
 * double (such groups tend to have many: a largest magnitude whose
 * mantissa is a multiple of 127 makes every other step a tie). */
#define ENCODE_FINITE_CHUNKS(n, q_of_x, offset, inv, near, store)                                                      \
    __m512 worst = _mm512_setzero_ps();                                                                                \
    FOR_CHUNKS(n, {                                                                                                    \
        __m512 x = load16(dtype, src, i, k);                                                                           \
        __m512 q = q_of_x;                                                                                             \
        /* larger magnitude, sign cleared */                                                                           \
        worst = _mm512_range_ps(worst, _mm512_reduce_ps(q, ROUND_NEAREST), 0x0b);                                      \
        __m512i c = _mm512_cvt_roundps_epi32(q, ROUND_NEAREST);                                                        \
        store;                                                                                                         \
    });                                                                                                                \
    if (_mm512_cmp_ps_mask(worst, _mm512_set1_ps(near), _CMP_GE_OQ)) {                                                 \
        FOR_CHUNKS(n, {                                                                                                \
            __m512i c = quantise_exact_finite(load16(dtype, src, i, k), offset, inv);                                  \
            store;                                                                                                     \
        });                                                                                                            \
    }

AVX512_INLINE void int8_codes_finite(uint32_t dtype, uint32_t d, const void *src, float s, float inv_f, int8_t *codes)
{
    const __m512 vinv = _mm512_set1_ps(inv_f);
    /* a power-of-two scale: the float product is exact, ties included */
    ENCODE_FINITE_CHUNKS(d, _mm512_mul_ps(x, vinv), 0.0, 1.0 / s, kvhi_codec_scale_is_pow2(s) ? INFINITY : NEAR_HALF,
                         _mm_mask_storeu_epi8(codes + i, k, _mm512_cvtepi32_epi8(c)));
}

/* Codes of any int8 vector with scale s, as the format. */
AVX512_INLINE void int8_codes(uint32_t dtype, uint32_t d, const void *src, float s, float inv_f, int8_t *codes)
{
    const __m512 inf = _mm512_set1_ps(INFINITY), vinv = _mm512_set1_ps(inv_f);
    double inv = s > 0.0f ? 1.0 / s : 0.0;
    FOR_CHUNKS(d, {
        __m512 x = load16(dtype, src, i, k);
        __m512i c;
        if (s >= FLT_MIN) {
            c = quantise_fast(x, _mm512_mul_ps(x, vinv), 0.0, inv, -127.0f, 127.0f);
        } else if (inv > 0.0) { /* subnormal scale: inv overflows a float */
            c = quantise_exact(x, 0.0, inv, -127.0, 127.0);
        } else { /* no finite non-zero element: infinities saturate */
            __mmask16 pos = _mm512_cmp_ps_mask(x, inf, _CMP_EQ_OQ);
            __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
            c = _mm512_mask_mov_epi32(_mm512_maskz_mov_epi32(pos, _mm512_set1_epi32(127)), neg,
                                      _mm512_set1_epi32(-127));
        }
        _mm_mask_storeu_epi8(codes + i, k, _mm512_cvtepi32_epi8(c));
    });
}

/* The largest magnitude's bits of d 16-bit elements (f16 or bf16): the
 * magnitudes' bits order as their values, 32 at a time. */
AVX512_INLINE uint32_t max_magnitude16(uint32_t d, const uint16_t *h)
{
    const __m512i magnitude = _mm512_set1_epi16(0x7fff);
    __m512i m = _mm512_setzero_si512();
    uint32_t i = 0;
    for (; i + 32 <= d; i += 32)
        m = _mm512_max_epu16(m, _mm512_and_si512(_mm512_loadu_si512(h + i), magnitude));
    if (i < d)
        m = _mm512_max_epu16(
            m, _mm512_and_si512(_mm512_maskz_loadu_epi16((__mmask32)((1ull << (d - i)) - 1), h + i), magnitude));
    __m256i a = _mm256_max_epu16(_mm512_castsi512_si256(m), _mm512_extracti64x4_epi64(m, 1));
    __m128i b = _mm_max_epu16(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    b = _mm_max_epu16(b, _mm_srli_si128(b, 8));
    b = _mm_max_epu16(b, _mm_srli_si128(b, 4));
    b = _mm_max_epu16(b, _mm_srli_si128(b, 2));
    return (uint32_t)_mm_extract_epi16(b, 0);
}

/* max |x| over the finite elements; *finite false when there are others.
 * The magnitudes' bits order as their values, and infinities and NaNs
 * are above every finite one: one unmasked integer maximum finds both. */
AVX512_INLINE float int8_amax(uint32_t dtype, uint32_t d, const void *src, bool *finite)
{
    if (dtype == KVH_DTYPE_F16 || dtype == KVH_DTYPE_BF16) {
        uint32_t top = max_magnitude16(d, src);
        *finite = top < (dtype == KVH_DTYPE_F16 ? 0x7c00u : 0x7f80u);
        if (*finite)
            return dtype == KVH_DTYPE_F16 ? kvhi_f16_to_f32((uint16_t)top) : kvhi_bf16_to_f32((uint16_t)top);
    } else {
        const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
        __m512i m = _mm512_setzero_si512();
        FOR_CHUNKS(d, {
            m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_castps_si512(load16(dtype, src, i, k)), magnitude));
        });
        uint32_t top = _mm512_reduce_max_epu32(m);
        *finite = top < 0x7f800000u;
        if (*finite) {
            float amax;
            memcpy(&amax, &top, sizeof(amax));
            return amax;
        }
    }
    const __m512 inf = _mm512_set1_ps(INFINITY);
    __m512 a = _mm512_setzero_ps();
    FOR_CHUNKS(d, {
        __m512 x = _mm512_abs_ps(load16(dtype, src, i, k));
        a = _mm512_mask_max_ps(a, _mm512_cmp_ps_mask(x, inf, _CMP_LT_OQ), a, x);
    });
    return _mm512_reduce_max_ps(a);
}

/* nv <= BATCH vectors of d elements, raw stride `in` bytes, records of
 * `out` bytes. */
AVX512_INLINE void encode_int8_batch(uint32_t dtype, uint32_t d, const uint8_t *src, uint32_t nv, size_t in,
                                     uint8_t *rec, size_t out)
{
    float amax[BATCH], scale[BATCH], inv[BATCH];
    bool finite[BATCH];
    for (uint32_t v = 0; v < nv; v++)
        amax[v] = int8_amax(dtype, d, src + v * in, &finite[v]);
    __m512 vs = _mm512_div_ps(_mm512_maskz_loadu_ps(lanes(nv), amax), _mm512_set1_ps(127.0f));
    _mm512_storeu_ps(scale, vs);
    _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), vs)); /* within 2^-24 of 1 / scale */
    KVHI_CODEC_INT8_RECORDS(dtype, d, src, nv, in, rec, out, scale, inv, finite, (void)x)
}

AVX512_INLINE void decode_int8(uint32_t dtype, uint32_t d, const uint8_t *rec, void *dst)
{
    const __m512 scale = _mm512_set1_ps(kvhi_codec_get_f32(rec));
    const int8_t *codes = (const int8_t *)(rec + sizeof(float));
    FOR_CHUNKS(d, {
        __m512i c = _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(k, codes + i));
        store16(dtype, dst, i, k, _mm512_mul_ps(_mm512_cvtepi32_ps(c), scale));
    });
}

/* ---- 4-bit ---- */

/* The first zero of the group's g elements, or +0 when there is none:
 * the sign the scalar loop leaves on a zero extreme. */
AVX512_INLINE float first_zero(uint32_t dtype, const void *src, uint32_t g)
{
    for (uint32_t i = 0; i < g; i += 16) {
        __m512 x = load16(dtype, src, i, 0xffff);
        __mmask16 z = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_EQ_OQ);
        if (z) {
            float lane[16];
            _mm512_storeu_ps(lane, x);
            return lane[__builtin_ctz(z)];
        }
    }
    return 0.0f;
}

/* Sixteen codes (0..15 in 32-bit lanes) as 8 bytes, low nibble first. */
AVX512_INLINE void pack_nibbles(__m512i c, uint8_t *out)
{
    __m512i pairs = _mm512_or_si512(c, _mm512_srli_epi64(c, 28)); /* odd lane's code into bits 4..7 */
    _mm_storel_epi64((__m128i *)out, _mm512_cvtepi64_epi8(pairs));
}

/* Lane k of the result is the least (want_max false) or greatest lane of
 * v[k], for 16 vectors: halves of pairs are combined level by level, 46
 * operations instead of 16 separate reductions' 128. */
AVX512_INLINE __m512 reduce16(__m512 *v, bool want_max)
{
#define COMBINE(a, b) (want_max ? _mm512_max_ps(a, b) : _mm512_min_ps(a, b))
    for (int j = 0; j < 8; j++) /* 128-bit blocks [g:0 g:1 g':0 g':1] */
        v[j] = COMBINE(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int j = 0; j < 4; j++) /* block b: four partials of group 4j + b */
        v[j] = COMBINE(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int j = 0; j < 2; j++) /* block b: two partials of 8j + b, two of 8j + 4 + b */
        v[j] = COMBINE(_mm512_shuffle_ps(v[2 * j], v[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_ps(v[2 * j], v[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 r = COMBINE(_mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
#undef COMBINE
    /* lane 4b + l holds group 4l + b */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

/* The least and greatest finite element of each of ng <= BATCH groups (g
 * a multiple of 16) at src, stride `stride` bytes, as the scalar loop
 * finds them (0, 0 when none); bit k of the result set when group k has
 * only finite elements. */
AVX512_INLINE __mmask16 q4_ranges(uint32_t dtype, uint32_t g, const uint8_t *src, size_t stride, uint32_t ng,
                                  float *lo_out, float *hi_out)
{
    const __m512 inf = _mm512_set1_ps(INFINITY);
    __m512 vlo[BATCH], vhi[BATCH];
    __mmask16 finite = 0;
    for (uint32_t k = 0; k < BATCH; k++) {
        vlo[k] = inf;
        vhi[k] = _mm512_set1_ps(-INFINITY);
        if (k >= ng)
            continue;
        __mmask16 all = 0xffff;
        for (uint32_t i = 0; i < g; i += 16) {
            __m512 x = load16(dtype, src + k * stride, i, 0xffff);
            __mmask16 f = _mm512_cmp_ps_mask(_mm512_abs_ps(x), inf, _CMP_LT_OQ);
            all = _kand_mask16(all, f);
            vlo[k] = _mm512_mask_min_ps(vlo[k], f, vlo[k], x);
            vhi[k] = _mm512_mask_max_ps(vhi[k], f, vhi[k], x);
        }
        finite |= (__mmask16)((all == 0xffff) << k);
    }
    __m512 lo = reduce16(vlo, false), hi = reduce16(vhi, true);
    /* SIMD min and max may return either zero: the scalar loop keeps the
     * first zero met */
    __mmask16 zero = _kor_mask16(_mm512_cmp_ps_mask(lo, _mm512_setzero_ps(), _CMP_EQ_OQ),
                                 _mm512_cmp_ps_mask(hi, _mm512_setzero_ps(), _CMP_EQ_OQ));
    /* no finite element: 0, 0 */
    __mmask16 none = _mm512_cmp_ps_mask(lo, hi, _CMP_GT_OQ);
    lo = _mm512_mask_mov_ps(lo, none, _mm512_setzero_ps());
    hi = _mm512_mask_mov_ps(hi, none, _mm512_setzero_ps());
    _mm512_storeu_ps(lo_out, lo);
    _mm512_storeu_ps(hi_out, hi);
    zero = _kandn_mask16(none, zero);
    for (; zero; zero &= (__mmask16)(zero - 1)) {
        uint32_t k = (uint32_t)__builtin_ctz(zero);
        float z = first_zero(dtype, src + k * stride, g);
        lo_out[k] = lo_out[k] == 0.0f ? z : lo_out[k];
        hi_out[k] = hi_out[k] == 0.0f ? z : hi_out[k];
    }
    return finite;
}

AVX512_INLINE void q4_codes_finite(uint32_t dtype, uint32_t g, const void *src, float lo, float s, float inv_f,
                                   uint8_t *gc)
{
    const __m512 vmin = _mm512_set1_ps(lo), vinv = _mm512_set1_ps(inv_f);
    ENCODE_FINITE_CHUNKS(g, _mm512_mul_ps(_mm512_sub_ps(x, vmin), vinv), lo, 1.0 / s, NEAR_HALF,
                         pack_nibbles(c, gc + i / 2));
}

/* Codes of any group, as the format; in_float: the float product is
 * trusted (scale normal, range within a float). */
AVX512_INLINE void q4_codes(uint32_t dtype, uint32_t g, const void *src, float lo, float s, float inv_f, bool in_float,
                            uint8_t *gc)
{
    const __m512 inf = _mm512_set1_ps(INFINITY), vmin = _mm512_set1_ps(lo), vinv = _mm512_set1_ps(inv_f);
    double inv = s > 0.0f ? 1.0 / s : 0.0;
    for (uint32_t i = 0; i < g; i += 16) {
        __m512 x = load16(dtype, src, i, 0xffff);
        __m512i c;
        if (in_float)
            c = quantise_fast(x, _mm512_mul_ps(_mm512_sub_ps(x, vmin), vinv), lo, inv, 0.0f, 15.0f);
        else if (inv > 0.0)
            c = quantise_exact(x, lo, inv, 0.0, 15.0);
        else /* a constant group: +inf takes the top code */
            c = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(x, inf, _CMP_EQ_OQ), _mm512_set1_epi32(15));
        pack_nibbles(c, gc + i / 2);
    }
}

/* Groups [first, first + ng) (ng <= BATCH) of the flat sequence of groups
 * in src (gpv per vector of d elements) into their records in dst. */
AVX512_INLINE void encode_q4_batch(uint32_t dtype, uint32_t d, uint32_t g, const uint8_t *src, size_t first,
                                   uint32_t ng, uint8_t *dst)
{
    uint32_t eb = dtype == KVH_DTYPE_F32 ? 4 : 2, gpv = d / g;
    size_t rec = (size_t)gpv * 2 * sizeof(float) + d / 2;
    float lo[BATCH], hi[BATCH], scale[BATCH], inv[BATCH];
    __mmask16 finite = q4_ranges(dtype, g, src + first * g * eb, (size_t)g * eb, ng, lo, hi);
    __mmask16 valid = lanes(ng), in_float = 0;
    __m512 vlo = _mm512_maskz_loadu_ps(valid, lo), vhi = _mm512_maskz_loadu_ps(valid, hi);
    __m256 part[2];
    for (int h = 0; h < 2; h++) { /* (float)(((double)hi - lo) / 15.0), 8 at a time */
        __m512d l = _mm512_cvtps_pd(h ? _mm512_extractf32x8_ps(vlo, 1) : _mm512_castps512_ps256(vlo));
        __m512d u = _mm512_cvtps_pd(h ? _mm512_extractf32x8_ps(vhi, 1) : _mm512_castps512_ps256(vhi));
        __m512d range = _mm512_sub_pd(u, l);
        part[h] = _mm512_cvtpd_ps(_mm512_div_pd(range, _mm512_set1_pd(15.0)));
        in_float |= (__mmask16)(_mm512_cmp_pd_mask(range, _mm512_set1_pd(FLT_MAX), _CMP_LE_OQ) << (8 * h));
    }
    __m512 vs = _mm512_insertf32x8(_mm512_castps256_ps512(part[0]), part[1], 1);
    in_float &= _mm512_cmp_ps_mask(vs, _mm512_set1_ps(FLT_MIN), _CMP_GE_OQ);
    _mm512_storeu_ps(scale, vs);
    _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), vs));
    size_t v = first / gpv, gi = first % gpv;
    for (uint32_t k = 0; k < ng; k++, gi = gi + 1 == gpv ? (v++, 0) : gi + 1) {
        const uint8_t *x = src + (first + k) * g * eb;
        uint8_t *head = dst + v * rec + gi * 2 * sizeof(float),
                *gc = dst + v * rec + gpv * 2 * sizeof(float) + gi * g / 2;
        float fitted = kvhi_codec_q4_scale_fit(scale[k], lo[k]);
        if (fitted != scale[k]) {
            scale[k] = fitted;
            inv[k] = 1.0f / fitted;
        }
        kvhi_codec_put_f32(head, scale[k]);
        kvhi_codec_put_f32(head + sizeof(float), lo[k]);
        bool fast = (in_float >> k) & 1;
        if (fast && ((finite >> k) & 1))
            q4_codes_finite(dtype, g, x, lo[k], scale[k], inv[k], gc);
        else
            q4_codes(dtype, g, x, lo[k], scale[k], inv[k], fast, gc);
    }
}

/* The 16 values of a group, min + q * scale for q = 0..15, as the format
 * computes them: the product is exact in double, the sum rounds once in
 * double and once to float. */
AVX512_INLINE __m512 q4_values(float scale, float lo)
{
    const __m512d q0 = _mm512_setr_pd(0, 1, 2, 3, 4, 5, 6, 7), q8 = _mm512_setr_pd(8, 9, 10, 11, 12, 13, 14, 15);
    const __m512d s = _mm512_set1_pd(scale), m = _mm512_set1_pd(lo);
    __m256 v0 = _mm512_cvtpd_ps(_mm512_add_pd(_mm512_mul_pd(q0, s), m));
    __m256 v8 = _mm512_cvtpd_ps(_mm512_add_pd(_mm512_mul_pd(q8, s), m));
    return _mm512_insertf32x8(_mm512_castps256_ps512(v0), v8, 1);
}

AVX512_INLINE void decode_q4(uint32_t dtype, uint32_t d, uint32_t g, const uint8_t *rec, void *dst)
{
    uint32_t groups = d / g;
    const uint8_t *codes = rec + (size_t)groups * 2 * sizeof(float);
    for (uint32_t gi = 0; gi < groups; gi++) {
        const uint8_t *head = rec + (size_t)gi * 2 * sizeof(float), *gc = codes + (size_t)gi * g / 2;
        __m512 values = q4_values(kvhi_codec_get_f32(head), kvhi_codec_get_f32(head + sizeof(float)));
        uint32_t at = gi * g;
        if (dtype == KVH_DTYPE_F32) {
            for (uint32_t i = 0; i < g; i += 16) {
                __m128i b = _mm_loadl_epi64((const __m128i *)(gc + i / 2));
                /* byte j's low nibble, then its high one (the permute
                 * reads the low four bits of each index) */
                __m128i idx = _mm_unpacklo_epi8(b, _mm_srli_epi16(b, 4));
                _mm512_storeu_ps((float *)dst + at + i, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(idx), values));
            }
            continue;
        }
        /* 16-bit values in both halves: the word permute reads five bits
         * of each index, and the fifth comes from the neighbouring nibble */
        __m256i half = dtype == KVH_DTYPE_F16 ? to_f16(values) : to_bf16(values);
        __m512i table = _mm512_broadcast_i64x4(half);
        for (uint32_t i = 0; i < g; i += 32) {
            __m128i b = _mm_loadu_si128((const __m128i *)(gc + i / 2)), h = _mm_srli_epi16(b, 4);
            __m256i idx = _mm256_set_m128i(_mm_unpackhi_epi8(b, h), _mm_unpacklo_epi8(b, h));
            _mm512_storeu_si512((uint16_t *)dst + at + i, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(idx), table));
        }
    }
}

/* ---- per-dtype loops over n vectors ---- */

KVHI_CODEC_SHARED_LOOPS(AVX512, f32, KVH_DTYPE_F32, 4)
KVHI_CODEC_SHARED_LOOPS(AVX512, f16, KVH_DTYPE_F16, 2)
KVHI_CODEC_SHARED_LOOPS(AVX512, bf16, KVH_DTYPE_BF16, 2)

KVHI_CODEC_ENTRIES(avx512)
#endif
