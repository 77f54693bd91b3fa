/* CRC32C (Castagnoli), the checksum of everything kvh writes to disk.
 * Uses the SSE4.2 crc32 instruction when the CPU has it, a table
 * otherwise. */
#ifndef KVH_CORE_CRC32C_H
#define KVH_CORE_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* Continues crc over n bytes; start with crc = 0. */
uint32_t kvhi_crc32c(uint32_t crc, const void *data, size_t n);
/* Copies n bytes from src to dst and returns their CRC32C, in one pass
 * (the checksum is what bounds the speed, so the copy comes almost free). */
uint32_t kvhi_crc32c_copy(uint32_t crc, void *dst, const void *src, size_t n);

#endif
