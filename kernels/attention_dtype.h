/* Scalar conversions between f32 and the 16-bit storage types, written out
 * by hand (no _Float16, no F16C): the library must build with any C11
 * compiler and run on any CPU. Narrowing rounds to nearest, ties to even;
 * NaN stays NaN (quiet), overflow gives infinity, f16 subnormals are
 * produced and read exactly. */
#ifndef KVH_KERNELS_ATTENTION_DTYPE_H
#define KVH_KERNELS_ATTENTION_DTYPE_H

#include <stdint.h>
#include <string.h>

static inline uint32_t kvhi_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

static inline float kvhi_bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

static inline float kvhi_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        /* zero or subnormal: m * 2^-24, exact in f32 */
        float r = (float)m * 0x1p-24f;
        return sign ? -r : r;
    }
    if (e == 31)
        return kvhi_bits_f32(sign | 0x7f800000u | (m << 13));
    return kvhi_bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

static inline uint16_t kvhi_f32_to_f16(float f)
{
    uint32_t x = kvhi_f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x >= 0x7f800000u) /* inf, or NaN kept quiet with its top payload */
        return (uint16_t)(sign | (x > 0x7f800000u ? 0x7e00u | ((x >> 13) & 0x3ffu) : 0x7c00u));
    if (x >= 0x477ff000u) /* >= 65520 rounds to infinity */
        return (uint16_t)(sign | 0x7c00u);
    if (x < 0x38800000u) { /* below 2^-14: an f16 subnormal or zero */
        uint32_t e = x >> 23;
        if (e < 102) /* below 2^-25: rounds to zero */
            return sign;
        uint32_t m = (x & 0x7fffffu) | 0x800000u, s = 126 - e; /* 14..24 */
        uint32_t q = m >> s, rem = m & ((1u << s) - 1), half = 1u << (s - 1);
        if (rem > half || (rem == half && (q & 1u)))
            q++;
        return (uint16_t)(sign | q);
    }
    uint32_t r = ((x >> 23) - 112u) << 10 | ((x >> 13) & 0x3ffu);
    uint32_t rem = x & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u)))
        r++; /* a carry into the exponent is the right result */
    return (uint16_t)(sign | r);
}

static inline float kvhi_bf16_to_f32(uint16_t b) { return kvhi_bits_f32((uint32_t)b << 16); }

static inline uint16_t kvhi_f32_to_bf16(float f)
{
    uint32_t x = kvhi_f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((x >> 16) | 0x40u); /* quiet NaN */
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

/* Element i of an array of dtype (kvh_dtype) as f32. */
static inline float kvhi_load_as_f32(uint32_t dtype, const void *p, uint64_t i)
{
    switch (dtype) {
    case 1:
        return kvhi_f16_to_f32(((const uint16_t *)p)[i]);
    case 2:
        return kvhi_bf16_to_f32(((const uint16_t *)p)[i]);
    default:
        return ((const float *)p)[i];
    }
}

static inline void kvhi_store_from_f32(uint32_t dtype, void *p, uint64_t i, float v)
{
    switch (dtype) {
    case 1:
        ((uint16_t *)p)[i] = kvhi_f32_to_f16(v);
        break;
    case 2:
        ((uint16_t *)p)[i] = kvhi_f32_to_bf16(v);
        break;
    default:
        ((float *)p)[i] = v;
        break;
    }
}

#endif
