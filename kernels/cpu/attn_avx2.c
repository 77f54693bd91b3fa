/* Fast CPU attention kernel, AVX2 + FMA + F16C (8 lanes); head_dim a
 * multiple of 8. Compiled for that target with a pragma and called only
 * when the CPU reports the features (attn_cpu.c), so the library still
 * runs on older CPUs. */
#include "kernels/cpu/attn_cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#define VW 8
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vset1(float x) { return _mm256_set1_ps(x); }
static inline vf vloadf(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstoref(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vhsum(vf v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* e^x, Cephes-style: x = n ln2 + r, e^r by a degree-6 polynomial, 2^n in
 * the exponent bits. About 2 ulp; x below -87.3 (and -inf) gives 0, NaN
 * stays NaN. */
static inline vf vexp(vf x)
{
    const vf hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365447504f);
    vf under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(hi, x);
    x = _mm256_max_ps(lo, x);
    vf n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vf r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    vf y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(under, y);
}
#define ISA_NAME avx2

#define KVT_NAME f32
#define KV_ELEM float
#define vload_kv(p) _mm256_loadu_ps(p)
#include "kernels/cpu/attn_body.inc"
#undef KVT_NAME
#undef KV_ELEM
#undef vload_kv

#define KVT_NAME f16
#define KV_ELEM uint16_t
#define vload_kv(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#include "kernels/cpu/attn_body.inc"
#undef KVT_NAME
#undef KV_ELEM
#undef vload_kv

#define KVT_NAME bf16
#define KV_ELEM uint16_t
#define vload_kv(p)                                                                                                    \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#include "kernels/cpu/attn_body.inc"
#undef KVT_NAME
#undef KV_ELEM
#undef vload_kv

#pragma GCC pop_options

const kvhi_attn_unit_fn kvhi_attn_units_avx2[3] = {unit_avx2_f32, unit_avx2_f16, unit_avx2_bf16};
#else
const kvhi_attn_unit_fn kvhi_attn_units_avx2[3] = {NULL, NULL, NULL};
#endif
