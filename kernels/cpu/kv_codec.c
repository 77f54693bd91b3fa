/* KV codecs (see kv_codec.h for the formats and error bounds), run on
 * every copy between a raw and an encoded tier. The scalar form here is
 * the format's definition: values are converted through the dtype helpers
 * shared with the attention kernels, a slice at a time. On x86 the AVX2 +
 * F16C set has vector forms of the hot loops here, and AVX-512 has whole
 * codecs of its own (kv_codec_avx512.c); all give the same bytes
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

static void put_f32(uint8_t *p, float v) { memcpy(p, &v, sizeof(v)); }
static float get_f32(const uint8_t *p)
{
    float v;
    memcpy(&v, p, sizeof(v));
    return v;
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

#ifdef KVH_CODEC_X86_VECTOR
#include <immintrin.h>
/* f16 <-> f32 eight at a time with the F16C instructions: both directions
 * are exact or correctly rounded to nearest-even, the same results as the
 * scalar helpers (NaNs quieted with their top payload bits kept). */
__attribute__((target("f16c,avx"))) static void f16_to_f32_f16c(const u16_any *h, uint32_t n, float *x)
{
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(x + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < n; i++)
        x[i] = kvhi_f16_to_f32(h[i]);
}

__attribute__((target("f16c,avx"))) static void f32_to_f16_f16c(const float *x, uint32_t n, u16_any *h)
{
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++)
        h[i] = kvhi_f32_to_f16(x[i]);
}

/* bf16 <-> f32 eight at a time: widening is exact; narrowing rounds to
 * nearest-even and quiets NaNs exactly as kvhi_f32_to_bf16. */
__attribute__((target("avx2"))) static void bf16_to_f32_avx2(const u16_any *h, uint32_t n, float *x)
{
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + i)));
        _mm256_storeu_si256((__m256i *)(x + i), _mm256_slli_epi32(w, 16));
    }
    for (; i < n; i++)
        x[i] = kvhi_bf16_to_f32(h[i]);
}

__attribute__((target("avx2"))) static void f32_to_bf16_avx2(const float *x, uint32_t n, u16_any *h)
{
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff);
    const __m256i magnitude = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    const __m256i quiet = _mm256_set1_epi32(0x40);
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i b = _mm256_loadu_si256((const __m256i *)(x + i));
        __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, magnitude), inf);
        __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), one);
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(half, odd)), 16);
        __m256i q = _mm256_or_si256(_mm256_srli_epi32(b, 16), quiet);
        r = _mm256_blendv_epi8(r, q, nan);
        /* 16-bit values: the unsigned pack is exact; it interleaves the
         * two 128-bit lanes, which the permute puts back in order. */
        __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
        _mm_storeu_si128((__m128i *)(h + i), _mm256_castsi256_si128(p));
    }
    for (; i < n; i++)
        h[i] = kvhi_f32_to_bf16(x[i]);
}

/* The AVX2 forms below run when that set is chosen (kv_codec_isa.c). */
static int have_vector_paths(void) { return kvhi_codec_active_isa() == KVHI_CODEC_AVX2; }

/* quantise() four elements at a time in double, with the same steps:
 * NaN -> 0, at or beyond an end -> that end, else rounded in the current
 * rounding mode (as the scalar shift trick). n a multiple of 4. */
__attribute__((target("avx2"))) static void quantise_avx2(const float *x, uint32_t n, double offset, double inv, int lo,
                                                          int hi, int32_t *out)
{
    const __m256d vinv = _mm256_set1_pd(inv), voff = _mm256_set1_pd(offset);
    const __m256d vhi = _mm256_set1_pd(hi), vlo = _mm256_set1_pd(lo);
    for (uint32_t i = 0; i < n; i += 4) {
        __m256d q = _mm256_mul_pd(_mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + i)), voff), vinv);
        __m256d ordered = _mm256_cmp_pd(q, q, _CMP_ORD_Q);
        __m256d r = _mm256_round_pd(q, _MM_FROUND_CUR_DIRECTION);
        r = _mm256_min_pd(_mm256_max_pd(r, vlo), vhi);
        r = _mm256_and_pd(r, ordered); /* NaN -> +0 */
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvttpd_epi32(r));
    }
}

__attribute__((target("avx2"))) static void quantise_int8_avx2(const float *x, uint32_t n, double inv, int8_t *codes)
{
    int32_t t[SLICE];
    uint32_t m = n & ~7u;
    quantise_avx2(x, m, 0.0, inv, -127, 127, t);
    /* Codes are within [-127, 127]: the saturating packs are exact. */
    for (uint32_t i = 0; i < m; i += 8) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(t + i));
        __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        _mm_storel_epi64((__m128i *)(codes + i), _mm_packs_epi16(w, w));
    }
    for (uint32_t i = m; i < n; i++)
        codes[i] = (int8_t)quantise(x[i], 0.0, inv, -127, 127, 0);
}

/* max |x[i]| over the finite elements (0 when none), eight at a time. */
__attribute__((target("avx2"))) static float amax_finite_avx2(const float *x, uint32_t n)
{
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 inf = _mm256_set1_ps(INFINITY);
    __m256 m = _mm256_setzero_ps();
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + i), magnitude);
        /* below infinity: false for inf and NaN, which then count as 0 */
        m = _mm256_max_ps(m, _mm256_and_ps(a, _mm256_cmp_ps(a, inf, _CMP_LT_OQ)));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    return amax_finite_scalar(x + i, n - i, amax_finite_scalar(lanes, 8, 0.0f));
}

/* The least and greatest finite element (lo > hi when there is none), as
 * the scalar loop finds them: SIMD minimum and maximum, then, when an
 * extreme is a zero, the sign the scalar loop leaves there: the first
 * zero's in element order (a SIMD min or max may return either zero). */
__attribute__((target("avx2"))) static void minmax_finite_avx2(const float *x, uint32_t n, float *lo_out, float *hi_out)
{
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 inf = _mm256_set1_ps(INFINITY), ninf = _mm256_set1_ps(-INFINITY);
    __m256 vlo = inf, vhi = ninf;
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        __m256 finite = _mm256_cmp_ps(_mm256_and_ps(v, magnitude), inf, _CMP_LT_OQ);
        vlo = _mm256_min_ps(vlo, _mm256_blendv_ps(inf, v, finite));
        vhi = _mm256_max_ps(vhi, _mm256_blendv_ps(ninf, v, finite));
    }
    float l[8], h[8], lo = INFINITY, hi = -INFINITY;
    _mm256_storeu_ps(l, vlo);
    _mm256_storeu_ps(h, vhi);
    for (int k = 0; k < 8; k++) {
        lo = l[k] < lo ? l[k] : lo;
        hi = h[k] > hi ? h[k] : hi;
    }
    minmax_finite_scalar(x + i, n - i, &lo, &hi);
    if (lo == 0.0f || hi == 0.0f)
        for (uint32_t j = 0; j < n; j++)
            if (x[j] == 0.0f) {
                lo = lo == 0.0f ? x[j] : lo;
                hi = hi == 0.0f ? x[j] : hi;
                break;
            }
    *lo_out = lo;
    *hi_out = hi;
}

/* lo + q * scale for the g (a multiple of 8) 4-bit codes of one group, as
 * the scalar loop: the product is exact in double, the sum rounds once in
 * double and once to float. */
__attribute__((target("avx2"))) static void dequantise_q4_avx2(const uint8_t *gc, uint32_t g, float scale, float lo,
                                                               f32_any *y)
{
    const __m256d vs = _mm256_set1_pd(scale), vlo = _mm256_set1_pd(lo);
    const __m256i shifts = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4), nibble = _mm256_set1_epi32(0xf);
    for (uint32_t i = 0; i < g; i += 8) {
        int32_t four;
        memcpy(&four, gc + i / 2, sizeof(four));
        __m128i b = _mm_cvtsi32_si128(four);
        /* each byte twice, then its low nibble and its high one */
        __m256i q = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(b, b));
        q = _mm256_and_si256(_mm256_srlv_epi32(q, shifts), nibble);
        __m256d r0 = _mm256_add_pd(_mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(q)), vs), vlo);
        __m256d r1 = _mm256_add_pd(_mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_extracti128_si256(q, 1)), vs), vlo);
        _mm_storeu_ps((float *)(y + i), _mm256_cvtpd_ps(r0));
        _mm_storeu_ps((float *)(y + i + 4), _mm256_cvtpd_ps(r1));
    }
}

/* code * scale for n codes, to f32 or (F16C, nearest-even) f16: a float
 * multiply, as the scalar loop. */
__attribute__((target("avx2,f16c"))) static void dequantise_int8_avx2(const int8_t *codes, uint32_t n, float scale,
                                                                      uint32_t dtype, void *dst)
{
    const __m256 vs = _mm256_set1_ps(scale);
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i c = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(codes + i)));
        __m256 y = _mm256_mul_ps(_mm256_cvtepi32_ps(c), vs);
        if (dtype == KVH_DTYPE_F16)
            _mm_storeu_si128((__m128i *)((uint16_t *)dst + i), _mm256_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT));
        else
            _mm256_storeu_ps((float *)dst + i, y);
    }
    for (; i < n; i++) {
        float y = (float)codes[i] * scale;
        if (dtype == KVH_DTYPE_F16)
            ((u16_any *)dst)[i] = kvhi_f32_to_f16(y);
        else
            ((f32_any *)dst)[i] = y;
    }
}
#endif

static void load_slice(uint32_t dtype, const void *src, uint32_t from, uint32_t n, float *x)
{
#ifdef KVH_CODEC_X86_VECTOR
    if (dtype == KVH_DTYPE_F16 && have_vector_paths()) {
        f16_to_f32_f16c((const u16_any *)src + from, n, x);
        return;
    }
    if (dtype == KVH_DTYPE_BF16 && have_vector_paths()) {
        bf16_to_f32_avx2((const u16_any *)src + from, n, x);
        return;
    }
#endif
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
#ifdef KVH_CODEC_X86_VECTOR
    if (dtype == KVH_DTYPE_F16 && have_vector_paths()) {
        f32_to_f16_f16c(x, n, (u16_any *)dst + from);
        return;
    }
    if (dtype == KVH_DTYPE_BF16 && have_vector_paths()) {
        f32_to_bf16_avx2(x, n, (u16_any *)dst + from);
        return;
    }
#endif
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

static float amax_finite(const float *x, uint32_t n)
{
#ifdef KVH_CODEC_X86_VECTOR
    if (have_vector_paths())
        return amax_finite_avx2(x, n);
#endif
    return amax_finite_scalar(x, n, 0.0f);
}

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
    put_f32(rec, scale);
    int8_t *codes = (int8_t *)(rec + sizeof(float));
    for (uint32_t at = 0; at < d; at += SLICE) {
        uint32_t n = d - at < SLICE ? d - at : SLICE;
        if (d > SLICE) /* one slice is still loaded from the first pass */
            load_slice(dtype, src, at, n, x);
#ifdef KVH_CODEC_X86_VECTOR
        if (inv > 0.0 && have_vector_paths()) {
            quantise_int8_avx2(x, n, inv, codes + at);
            continue;
        }
#endif
        for (uint32_t i = 0; i < n; i++)
            /* A zero vector (inv 0) still saturates infinities to +-127. */
            codes[at + i] = (int8_t)(inv > 0.0 ? quantise(x[i], 0.0, inv, -127, 127, 0)
                                               : (isinf(x[i]) ? (x[i] > 0 ? 127 : -127) : 0));
    }
}

static void decode_int8(uint32_t dtype, uint32_t d, const uint8_t *rec, void *dst)
{
    float scale = get_f32(rec), x[SLICE];
    const int8_t *codes = (const int8_t *)(rec + sizeof(float));
#ifdef KVH_CODEC_X86_VECTOR
    if (dtype != KVH_DTYPE_BF16 && have_vector_paths()) {
        dequantise_int8_avx2(codes, d, scale, dtype, dst);
        return;
    }
#endif
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
#ifdef KVH_CODEC_X86_VECTOR
        if (have_vector_paths())
            minmax_finite_avx2(x, g, &lo, &hi);
        else
#endif
            minmax_finite_scalar(x, g, &lo, &hi);
        if (lo > hi) /* no finite element */
            lo = hi = 0.0f;
        /* hi - lo may exceed FLT_MAX; the scale (a 15th of it) does not */
        float scale = kvhi_codec_q4_scale_fit((float)(((double)hi - lo) / 15.0), lo);
        double inv = scale > 0.0f ? 1.0 / scale : 0.0;
        put_f32(rec + (size_t)gi * 2 * sizeof(float), scale);
        put_f32(rec + (size_t)gi * 2 * sizeof(float) + sizeof(float), lo);
        uint8_t *gc = codes + (size_t)gi * g / 2;
#ifdef KVH_CODEC_X86_VECTOR
        if (inv > 0.0 && have_vector_paths()) {
            int32_t q[64];
            quantise_avx2(x, g, lo, inv, 0, 15, q);
            for (uint32_t i = 0; i < g; i += 2)
                gc[i / 2] = (uint8_t)(q[i] | q[i + 1] << 4);
            continue;
        }
#endif
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
        float scale = get_f32(rec + (size_t)gi * 2 * sizeof(float));
        float lo = get_f32(rec + (size_t)gi * 2 * sizeof(float) + sizeof(float));
        const uint8_t *gc = codes + (size_t)gi * g / 2;
        f32_any *y = dtype == KVH_DTYPE_F32 ? (f32_any *)dst + gi * g : x;
#ifdef KVH_CODEC_X86_VECTOR
        if (g % 8 == 0 && have_vector_paths())
            dequantise_q4_avx2(gc, g, scale, lo, y);
        else
#endif
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
    if (codec != KVH_CODEC_NONE && kvhi_codec_active_isa() == KVHI_CODEC_AVX512) {
        kvhi_codec_encode_avx512(codec, dtype, d, kvhi_codec_group(codec, d), src, n, dst);
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
    if (codec != KVH_CODEC_NONE && kvhi_codec_active_isa() == KVHI_CODEC_AVX512) {
        kvhi_codec_decode_avx512(codec, dtype, d, kvhi_codec_group(codec, d), src, n, dst);
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
