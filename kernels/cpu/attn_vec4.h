/* The 4-lane vector layer of the portable CPU attention kernel
 * (attn_generic.c): GCC vector extensions, so SSE2 on x86-64 and NEON on
 * AArch64, with the f16/bf16 widening and e^x written out in vector
 * integer and float operations. A header so the tests can check the
 * conversions exhaustively. */
#ifndef KVH_KERNELS_CPU_ATTN_VEC4_H
#define KVH_KERNELS_CPU_ATTN_VEC4_H

#include <stdint.h>
#include <string.h>

typedef float vf __attribute__((vector_size(16)));
typedef int32_t vi __attribute__((vector_size(16)));
typedef uint32_t vu __attribute__((vector_size(16)));
#define VW 4
static inline vf vzero(void) { return (vf){0.0f, 0.0f, 0.0f, 0.0f}; }
static inline vf vset1(float x) { return (vf){x, x, x, x}; }
static inline vf vloadf(const float *p)
{
    vf v;
    memcpy(&v, p, sizeof(v));
    return v;
}
static inline void vstoref(float *p, vf v) { memcpy(p, &v, sizeof(v)); }
static inline vf vadd(vf a, vf b) { return a + b; }
static inline vf vsub(vf a, vf b) { return a - b; }
static inline vf vmul(vf a, vf b) { return a * b; }
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
static inline float vhsum(vf v) { return (v[0] + v[1]) + (v[2] + v[3]); }
static inline vf vsel(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); } /* m ? a : b */
/* e^x as in attn_avx2.c (Cephes), rounding with the 1.5 * 2^23 trick;
 * below -87.3 (and -inf) gives 0, NaN stays NaN. */
static inline vf vexp(vf x)
{
    const vf hi = vset1(88.3762626647949f), lo = vset1(-87.3365447504f);
    vi under = x < lo, nan = x != x;
    x = vsel(x > hi, hi, x);
    x = vsel(x < lo, lo, x);
    vf n = (x * vset1(1.44269504088896341f) + vset1(12582912.0f)) - vset1(12582912.0f);
    vf r = x - n * vset1(0.693359375f);
    r = r + n * vset1(2.12194440e-4f);
    vf y = vset1(1.9875691500e-4f);
    y = y * r + vset1(1.3981999507e-3f);
    y = y * r + vset1(8.3334519073e-3f);
    y = y * r + vset1(4.1665795894e-2f);
    y = y * r + vset1(1.6666665459e-1f);
    y = y * r + vset1(5.0000001201e-1f);
    y = y * (r * r) + (r + vset1(1.0f));
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    y = y * (vf)e;
    y = vsel(under, vzero(), y);
    return vsel(nan, x, y);
}
/* f16 -> f32 for 4 values, exact: the exponent/mantissa bits shifted into
 * an f32 and scaled by 2^112 (exact for normals and subnormals), inf/NaN
 * patched. */
static inline vf f16x4(const uint16_t *p)
{
    vu h = {p[0], p[1], p[2], p[3]};
    vu em = h & 0x7fffu, sign = (h & 0x8000u) << 16;
    vu f = (vu)((vf)(em << 13) * vset1(0x1p112f));
    vu inf = (vu)(em >= 0x7c00u);
    f = (f & ~inf) | (inf & (0x7f800000u | ((em & 0x3ffu) << 13)));
    return (vf)(f | sign);
}
static inline vf bf16x4(const uint16_t *p)
{
    vu h = {p[0], p[1], p[2], p[3]};
    return (vf)(h << 16);
}
#endif
