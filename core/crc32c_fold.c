/* CRC32C of long inputs by carry-less multiplication (VPCLMULQDQ on
 * 512-bit registers, or on 256-bit ones where the CPU has VPCLMULQDQ
 * without AVX-512, as AMD Zen 3 and Intel's client cores since Ice Lake):
 * accumulators covering KVHI_CRC32C_FOLD_BYTES are folded forward that
 * many bytes at a time, as in Gopal et al., "Fast CRC Computation for
 * Generic Polynomials Using PCLMULQDQ Instruction" (Intel, 2009). What is
 * left is that many bytes congruent, modulo the polynomial, to all the
 * input they stand for; core/crc32c.c finishes them and the tail with the
 * crc32 instruction. Both widths fold the same distance with the same
 * constants and leave the same residue layout (each 16-byte lane at its
 * input offset). Compiled with target attributes and called only where
 * the CPU has the set.
 */
#include "core/crc32c_fold.h"

#if defined(__x86_64__)
#include <stdbool.h>

#include <immintrin.h>

/* A target attribute on each function, not a pragma: clang ignores
 * GCC's target pragma. */
#define FOLD_TARGET __attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.2")))

/* Each 128-bit lane holds 16 input bytes, its low qword the higher powers
 * of x. Its halves times the two constants k (fold_constant in
 * core/crc32c.c), added to the lane KVHI_CRC32C_FOLD_BYTES on, leave the
 * CRC of the whole unchanged. */
static inline __attribute__((always_inline)) FOLD_TARGET __m512i fold(__m512i acc, __m512i k, __m512i next)
{
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(acc, k, 0x00), _mm512_clmulepi64_epi128(acc, k, 0x11),
                                     next, 0x96 /* a ^ b ^ c */);
}

static inline __attribute__((always_inline)) FOLD_TARGET size_t fold_all(uint32_t state, uint8_t *dst,
                                                                         const uint8_t *src, size_t n,
                                                                         const uint64_t k[2],
                                                                         uint8_t residue[KVHI_CRC32C_FOLD_BYTES],
                                                                         bool copy)
{
    __m512i x[KVHI_CRC32C_FOLD_LANES];
    for (int i = 0; i < KVHI_CRC32C_FOLD_LANES; i++) {
        x[i] = _mm512_loadu_si512(src + 64 * i);
        if (copy)
            _mm512_storeu_si512(dst + 64 * i, x[i]);
    }
    /* The running state enters as if added to the first four bytes. */
    x[0] = _mm512_xor_si512(x[0], _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)state)));
    const __m512i kk = _mm512_broadcast_i32x4(_mm_set_epi64x((long long)k[1], (long long)k[0]));
    size_t off = KVHI_CRC32C_FOLD_BYTES;
    for (; off + KVHI_CRC32C_FOLD_BYTES <= n; off += KVHI_CRC32C_FOLD_BYTES)
#pragma GCC unroll 8 /* in registers, not an array on the stack */
        for (int i = 0; i < KVHI_CRC32C_FOLD_LANES; i++) {
            __m512i y = _mm512_loadu_si512(src + off + 64 * i);
            if (copy)
                _mm512_storeu_si512(dst + off + 64 * i, y);
            x[i] = fold(x[i], kk, y);
        }
    for (int i = 0; i < KVHI_CRC32C_FOLD_LANES; i++)
        _mm512_storeu_si512(residue + 64 * i, x[i]);
    return off;
}

FOLD_TARGET size_t kvhi_crc32c_fold(uint32_t state, const void *src, size_t n, const uint64_t k[2],
                                    uint8_t residue[KVHI_CRC32C_FOLD_BYTES])
{
    return fold_all(state, NULL, src, n, k, residue, false);
}

FOLD_TARGET size_t kvhi_crc32c_fold_copy(uint32_t state, void *dst, const void *src, size_t n, const uint64_t k[2],
                                         uint8_t residue[KVHI_CRC32C_FOLD_BYTES])
{
    return fold_all(state, dst, src, n, k, residue, true);
}

int kvhi_crc32c_fold_supported(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("sse4.2");
}

/* The same with eight 32-byte accumulators. */
#define FOLD256_TARGET __attribute__((target("avx2,vpclmulqdq,pclmul,sse4.2")))

static inline __attribute__((always_inline)) FOLD256_TARGET __m256i fold256(__m256i acc, __m256i k, __m256i next)
{
    return _mm256_xor_si256(
        _mm256_xor_si256(_mm256_clmulepi64_epi128(acc, k, 0x00), _mm256_clmulepi64_epi128(acc, k, 0x11)), next);
}

enum { LANES256 = KVHI_CRC32C_FOLD_BYTES / 32 };

static inline __attribute__((always_inline)) FOLD256_TARGET size_t fold_all256(uint32_t state, uint8_t *dst,
                                                                               const uint8_t *src, size_t n,
                                                                               const uint64_t k[2],
                                                                               uint8_t residue[KVHI_CRC32C_FOLD_BYTES],
                                                                               bool copy)
{
    __m256i x[LANES256];
#pragma GCC unroll 8
    for (int i = 0; i < LANES256; i++) {
        x[i] = _mm256_loadu_si256((const __m256i *)(src + 32 * i));
        if (copy)
            _mm256_storeu_si256((__m256i *)(dst + 32 * i), x[i]);
    }
    x[0] = _mm256_xor_si256(x[0], _mm256_zextsi128_si256(_mm_cvtsi32_si128((int)state)));
    const __m256i kk = _mm256_broadcastsi128_si256(_mm_set_epi64x((long long)k[1], (long long)k[0]));
    size_t off = KVHI_CRC32C_FOLD_BYTES;
    for (; off + KVHI_CRC32C_FOLD_BYTES <= n; off += KVHI_CRC32C_FOLD_BYTES)
#pragma GCC unroll 8 /* in registers, not an array on the stack */
        for (int i = 0; i < LANES256; i++) {
            __m256i y = _mm256_loadu_si256((const __m256i *)(src + off + 32 * i));
            if (copy)
                _mm256_storeu_si256((__m256i *)(dst + off + 32 * i), y);
            x[i] = fold256(x[i], kk, y);
        }
#pragma GCC unroll 8
    for (int i = 0; i < LANES256; i++)
        _mm256_storeu_si256((__m256i *)(residue + 32 * i), x[i]);
    return off;
}

FOLD256_TARGET size_t kvhi_crc32c_fold256(uint32_t state, const void *src, size_t n, const uint64_t k[2],
                                          uint8_t residue[KVHI_CRC32C_FOLD_BYTES])
{
    return fold_all256(state, NULL, src, n, k, residue, false);
}

FOLD256_TARGET size_t kvhi_crc32c_fold256_copy(uint32_t state, void *dst, const void *src, size_t n,
                                               const uint64_t k[2], uint8_t residue[KVHI_CRC32C_FOLD_BYTES])
{
    return fold_all256(state, dst, src, n, k, residue, true);
}

int kvhi_crc32c_fold256_supported(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("pclmul") &&
           __builtin_cpu_supports("sse4.2");
}

#else

/* Elsewhere only the checks are called (core/crc32c.c folds on x86-64
 * alone). */
int kvhi_crc32c_fold_supported(void) { return 0; }
int kvhi_crc32c_fold256_supported(void) { return 0; }

#endif
