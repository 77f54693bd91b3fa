/* KV quantisation codecs: each vector of head_dim elements (the K or V of
 * one token in one KV head) becomes one fixed-size record, so a block's
 * cell order [layer][K,V][kv_head][token] is kept and any token range can
 * be encoded or decoded on its own (no neighbour is ever re-quantised).
 *
 *   KVH_CODEC_INT8     [f32 scale][head_dim x int8]; x ~ q * scale,
 *                      scale = max|x| / 127 (symmetric, per token and head;
 *                      one ulp lower where 127 x scale overflows a float)
 *   KVH_CODEC_Q4_G32/64 [groups x (f32 scale, f32 min)][head_dim / 2 bytes,
 *                      low nibble first]; x ~ min + q * scale, q in 0..15,
 *                      scale = (max - min) / 15 over each group of 32/64
 *                      elements (asymmetric: the minimum is the zero point;
 *                      one ulp lower where min + 15 x scale overflows)
 *
 * Error bound per element (before the decoded value is rounded to the
 * storage dtype): INT8 |x - x'| <= max|x| / 254 of its vector; Q4 |x - x'|
 * <= (max - min) / 30 of its group; plus 2^-143 when the f32 scale is
 * subnormal (magnitudes below about 2^-119). Non-finite inputs are not preserved:
 * +-inf saturate to the largest/smallest code, NaN becomes the zero code;
 * the scale is computed over the finite elements only. */
#ifndef KVH_KERNELS_CPU_KV_CODEC_H
#define KVH_KERNELS_CPU_KV_CODEC_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Bytes of one encoded vector; 0 when the codec is unknown or head_dim does
 * not fit it (Q4 needs head_dim to be a multiple of its group). NONE gives
 * the raw size head_dim * sizeof(dtype). */
/* The longest vector a codec takes: the kernels count elements in 32-bit
 * indices that step by up to a slice past the current one, which must not
 * wrap. */
#define KVHI_CODEC_MAX_HEAD_DIM (1u << 24)
size_t kvhi_codec_vector_bytes(uint32_t codec, uint32_t dtype, uint32_t head_dim);

/* Encodes n vectors of raw elements (dtype, packed one after another) into
 * n records. src and dst must not overlap. */
void kvhi_codec_encode(uint32_t codec, uint32_t dtype, uint32_t head_dim, const void *src, size_t n, void *dst);

/* Decodes n records into n raw vectors of dtype. */
void kvhi_codec_decode(uint32_t codec, uint32_t dtype, uint32_t head_dim, const void *src, size_t n, void *dst);

/* The scales as stored, fitted so that no code of a finite vector decodes
 * to infinity: where the largest code's value (127 * scale as a float
 * product, or lo + 15 * scale in double, as decoding computes them) would
 * round past FLT_MAX, which only a vector or group holding values within
 * an ulp or so of +-FLT_MAX can reach, the scale is one ulp lower. That
 * value then decodes just below its input, well inside the error bound;
 * every other scale is unchanged. */
static inline float kvhi_codec_int8_scale_fit(float scale)
{
    return __builtin_isinf(scale * 127.0f) ? __builtin_nextafterf(scale, 0.0f) : scale;
}
static inline float kvhi_codec_q4_scale_fit(float scale, float lo)
{
    return __builtin_isinf((float)(lo + 15.0 * (double)scale)) ? __builtin_nextafterf(scale, 0.0f) : scale;
}

/* Whether an int8 scale (normal, as the finite-vector path requires) is
 * a power of two. Its reciprocal is then exact in float, and so is every
 * product x / scale of an input that is not lost below 2^-126 (where the
 * code is 0 either way): the float product is the format's double one,
 * ties included, which it otherwise is not trusted near. Such scales are
 * common: a largest magnitude of 127 * 2^k (254/64 in bf16) gives one. */
static inline int kvhi_codec_scale_is_pow2(float scale)
{
    uint32_t bits;
    memcpy(&bits, &scale, sizeof(bits));
    return (bits & 0x007fffffu) == 0 && scale >= 0x1p-126f;
}

/* A record's f32 fields (scales, minima) sit at any alignment. */
static inline void kvhi_codec_put_f32(uint8_t *p, float v) { memcpy(p, &v, sizeof(v)); }
static inline float kvhi_codec_get_f32(const uint8_t *p)
{
    float v;
    memcpy(&v, p, sizeof(v));
    return v;
}

/* Elements per quantisation group (head_dim for INT8, 0 for NONE). */
uint32_t kvhi_codec_group(uint32_t codec, uint32_t head_dim);

/* Instruction sets the codecs run on; every one gives the same bytes as
 * SCALAR. AUTO is the best this CPU runs, or the one KVH_CODEC_ISA names
 * (`scalar`, `avx2`, `avx512`; ignored where the CPU lacks it). */
enum kvhi_codec_isa {
    KVHI_CODEC_AUTO = 0,
    KVHI_CODEC_SCALAR = 1,
    KVHI_CODEC_AVX2 = 2,  /* AVX2 + FMA + F16C */
    KVHI_CODEC_AVX512 = 3 /* AVX-512 F/BW/VL/DQ, with the AVX2 set */
};

/* 1 when this CPU runs isa. (kv_codec_isa.c) */
int kvhi_codec_isa_supported(int isa);
/* Makes every later call of this process run isa (tests, benchmarks);
 * -1 and nothing changed when the CPU lacks it. Not for use while other
 * threads encode: they may run either set for a while. */
int kvhi_codec_set_isa(int isa);
/* The instruction set calls run on now (never AUTO). */
int kvhi_codec_active_isa(void);
/* "scalar", "avx2" or "avx512". */
const char *kvhi_codec_isa_name(int isa);
/* The set KVH_CODEC_ISA names (scalar, avx2, avx512), or -1. */
int kvhi_codec_isa_by_name(const char *name);

#endif
