/* The carry-less-multiply part of CRC32C (core/crc32c.c calls it;
 * nothing else should). The folds exist on x86-64 only; the checks
 * everywhere. */
#ifndef KVH_CORE_CRC32C_FOLD_H
#define KVH_CORE_CRC32C_FOLD_H

#include <stddef.h>
#include <stdint.h>

/* 64-byte accumulators folded at once, and the bytes they cover. */
#define KVHI_CRC32C_FOLD_LANES 4
#define KVHI_CRC32C_FOLD_BYTES (64 * KVHI_CRC32C_FOLD_LANES)

/* 1 when this CPU and OS run kvhi_crc32c_fold (AVX-512). */
int kvhi_crc32c_fold_supported(void);

/* Folds src (n >= KVHI_CRC32C_FOLD_BYTES; state: the raw crc32 register
 * entering it) into residue, whose CRC from state 0, continued over the
 * bytes after the returned count (a multiple of KVHI_CRC32C_FOLD_BYTES), is
 * the CRC of all n. k: the two
 * fold constants (core/crc32c.c). The _copy form also copies the bytes it
 * consumes to dst. */
size_t kvhi_crc32c_fold(uint32_t state, const void *src, size_t n, const uint64_t k[2],
                        uint8_t residue[KVHI_CRC32C_FOLD_BYTES]);
size_t kvhi_crc32c_fold_copy(uint32_t state, void *dst, const void *src, size_t n, const uint64_t k[2],
                             uint8_t residue[KVHI_CRC32C_FOLD_BYTES]);

/* The same on 256-bit registers (AVX2 and VPCLMULQDQ): the same constants,
 * the same residue. */
int kvhi_crc32c_fold256_supported(void);
size_t kvhi_crc32c_fold256(uint32_t state, const void *src, size_t n, const uint64_t k[2],
                           uint8_t residue[KVHI_CRC32C_FOLD_BYTES]);
size_t kvhi_crc32c_fold256_copy(uint32_t state, void *dst, const void *src, size_t n, const uint64_t k[2],
                                uint8_t residue[KVHI_CRC32C_FOLD_BYTES]);

#endif
