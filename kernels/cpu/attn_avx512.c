/* Fast CPU attention kernel, AVX-512 F/BW/VL/DQ (16 lanes); head_dim a
 * multiple of 16. Compiled for that target with a pragma and called only
 * when the CPU reports the features (attn_cpu.c). */
#include "kernels/cpu/attn_cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include <immintrin.h>

#define VW 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vset1(float x) { return _mm512_set1_ps(x); }
static inline vf vloadf(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstoref(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vhsum(vf v)
{
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* e^x as in attn_avx2.c. */
static inline vf vexp(vf x)
{
    const vf hi = _mm512_set1_ps(88.3762626647949f), lo = _mm512_set1_ps(-87.3365447504f);
    __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_min_ps(hi, x);
    x = _mm512_max_ps(lo, x);
    vf n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vf r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    vf y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    y = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
    return _mm512_maskz_mov_ps((__mmask16)~under, y);
}
#define ISA_NAME avx512

#define KVT_NAME f32
#define KV_ELEM float
#define vload_kv(p) _mm512_loadu_ps(p)
#include "kernels/cpu/attn_body.inc"
#undef KVT_NAME
#undef KV_ELEM
#undef vload_kv

#define KVT_NAME f16
#define KV_ELEM uint16_t
#define vload_kv(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#include "kernels/cpu/attn_body.inc"
#undef KVT_NAME
#undef KV_ELEM
#undef vload_kv

#define KVT_NAME bf16
#define KV_ELEM uint16_t
#define vload_kv(p)                                                                                                    \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#include "kernels/cpu/attn_body.inc"
#undef KVT_NAME
#undef KV_ELEM
#undef vload_kv

#pragma GCC pop_options

const kvhi_attn_unit_fn kvhi_attn_units_avx512[3] = {unit_avx512_f32, unit_avx512_f16, unit_avx512_bf16};
#else
const kvhi_attn_unit_fn kvhi_attn_units_avx512[3] = {NULL, NULL, NULL};
#endif
