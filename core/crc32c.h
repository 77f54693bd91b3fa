/* CRC32C (Castagnoli), the checksum of everything kvh writes to disk.
 * Long inputs are folded with 512-bit carry-less multiplies where the CPU
 * has AVX-512 and VPCLMULQDQ, 256-bit ones where it has AVX2 and
 * VPCLMULQDQ (core/crc32c_fold.c); the rest uses the SSE4.2 crc32
 * instruction when the CPU has it, a table otherwise. */
#ifndef KVH_CORE_CRC32C_H
#define KVH_CORE_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* Continues crc over n bytes; start with crc = 0. */
uint32_t kvhi_crc32c(uint32_t crc, const void *data, size_t n);
/* Copies n bytes from src to dst and returns their CRC32C, in one pass
 * (the checksum is what bounds the speed, so the copy comes almost free). */
uint32_t kvhi_crc32c_copy(uint32_t crc, void *dst, const void *src, size_t n);

/* How the checksum is computed; every one gives the same value. */
enum kvhi_crc32c_impl {
    KVHI_CRC32C_AUTO = 0, /* the fastest this CPU runs */
    KVHI_CRC32C_TABLE,    /* slicing-by-8 tables */
    KVHI_CRC32C_SSE42,    /* the crc32 instruction, three chains */
    KVHI_CRC32C_FOLD256,  /* 256-bit carry-less fold, then SSE4.2 */
    KVHI_CRC32C_FOLD,     /* 512-bit carry-less fold, then SSE4.2 */
};
/* 1 when this CPU runs impl. */
int kvhi_crc32c_supported(int impl);
/* Makes every later call of this process use impl (tests, benchmarks);
 * -1 when this CPU does not run it. */
int kvhi_crc32c_set_impl(int impl);
/* The one in use. */
int kvhi_crc32c_impl(void);
const char *kvhi_crc32c_impl_name(int impl);
/* The implementation KVH_CRC32C_IMPL names (table, sse42, avx2, avx512),
 * or -1. */
int kvhi_crc32c_impl_by_name(const char *name);

#endif
