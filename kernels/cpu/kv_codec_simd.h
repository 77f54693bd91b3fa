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
#endif

#endif
