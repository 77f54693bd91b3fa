/* External pools for the pool tests (header only): vLLM-style paged KV
 * memory per layer, [slot][token][head][dim], filled with random bytes. */
#ifndef KVH_POOL_TEST_UTIL_H
#define KVH_POOL_TEST_UTIL_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvh/kvh.h"

#define PT_MAX_LAYERS 4

typedef struct pt_pool {
    uint32_t layers, slots;
    size_t slot_bytes; /* one slot of one layer's K (or V) */
    uint8_t *k[PT_MAX_LAYERS], *v[PT_MAX_LAYERS];
    void *kp[PT_MAX_LAYERS], *vp[PT_MAX_LAYERS];
    kvh_pool_layout layout;
} pt_pool;

/* Fills p for layers x slots slots of bt tokens of heads x dim elements of
 * esize bytes, with bytes from seed. */
static inline void pt_pool_init(pt_pool *p, uint32_t layers, uint32_t slots, uint32_t bt, uint32_t heads, uint32_t dim,
                                uint32_t esize, uint64_t seed)
{
    memset(p, 0, sizeof(*p));
    p->layers = layers;
    p->slots = slots;
    size_t row = (size_t)dim * esize;
    p->slot_bytes = (size_t)bt * heads * row;
    for (uint32_t l = 0; l < layers; l++) {
        p->k[l] = malloc(slots * p->slot_bytes);
        p->v[l] = malloc(slots * p->slot_bytes);
        for (size_t i = 0; i < slots * p->slot_bytes; i++) {
            seed = seed * 6364136223846793005ull + 1442695040888963407ull;
            p->k[l][i] = (uint8_t)(seed >> 56);
            p->v[l][i] = (uint8_t)(seed >> 48);
        }
        p->kp[l] = p->k[l];
        p->vp[l] = p->v[l];
    }
    p->layout.struct_size = sizeof(kvh_pool_layout);
    p->layout.memory = KVH_MEMORY_HOST;
    p->layout.num_slots = slots;
    p->layout.k_base = p->kp;
    p->layout.v_base = p->vp;
    p->layout.slot_stride = p->slot_bytes;
    p->layout.token_stride = (uint64_t)heads * row;
    p->layout.head_stride = row;
}

static inline void pt_pool_free(pt_pool *p)
{
    for (uint32_t l = 0; l < p->layers; l++) {
        free(p->k[l]);
        free(p->v[l]);
    }
    memset(p, 0, sizeof(*p));
}

/* Layer l of slot (K and V) equal in a and b at slots sa and sb. */
static inline int pt_layer_equal(const pt_pool *a, uint32_t sa, const pt_pool *b, uint32_t sb, uint32_t l)
{
    size_t n = a->slot_bytes;
    return memcmp(a->k[l] + sa * n, b->k[l] + sb * n, n) == 0 && memcmp(a->v[l] + sa * n, b->v[l] + sb * n, n) == 0;
}

static inline void pt_layer_clear(pt_pool *p, uint32_t slot, uint32_t l)
{
    memset(p->k[l] + slot * p->slot_bytes, 0, p->slot_bytes);
    memset(p->v[l] + slot * p->slot_bytes, 0, p->slot_bytes);
}

/* Tokens of block i of a request: block_tokens ids from tag. */
static inline void pt_tokens(int32_t *out, uint32_t bt, uint32_t tag, uint32_t i)
{
    for (uint32_t t = 0; t < bt; t++)
        out[t] = (int32_t)(tag * 100000u + i * bt + t);
}

#endif
