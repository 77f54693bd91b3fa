/* Exact K/V values for content oracles: each element follows from (tag,
 * layer, token, head, K or V, dim), so a mixup of sequences, layers,
 * tokens or heads reads as a wrong value. Values are k/128 with
 * |k| < 2^15: exact in f32. Header-only (static inline). */
#ifndef KVH_TESTS_KV_CELLS_H
#define KVH_TESTS_KV_CELLS_H

#include <stddef.h>
#include <stdint.h>

static inline uint64_t kv_cells_mix(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline float kv_cell(uint32_t tag, uint32_t l, uint64_t t, uint32_t h, int kv, uint32_t d)
{
    uint64_t z = kv_cells_mix(((uint64_t)tag << 48) ^ ((uint64_t)l << 40) ^ (t << 16) ^ ((uint64_t)h << 10) ^
                              ((uint64_t)kv << 9) ^ d ^ 0x5bd1e995ull);
    return (float)((int32_t)(z & 0x7fff) - 16384) / 128.0f;
}

/* K and V of tokens [pos, pos + n) of layer l, shaped [n][heads][dim]. */
static inline void kv_cells(uint32_t tag, uint32_t l, uint64_t pos, size_t n, uint32_t heads, uint32_t dim, float *k,
                            float *v)
{
    for (size_t t = 0; t < n; t++)
        for (uint32_t h = 0; h < heads; h++)
            for (uint32_t d = 0; d < dim; d++) {
                k[(t * heads + h) * dim + d] = kv_cell(tag, l, pos + t, h, 0, d);
                v[(t * heads + h) * dim + d] = kv_cell(tag, l, pos + t, h, 1, d);
            }
}

#endif
