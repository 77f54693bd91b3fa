/* A map from block records to 32-bit values, for what a few blocks carry
 * and the record has no room for (core/block_map.c): open addressing,
 * linear probing, deletion by backward shift. Lock held for all calls. */
#ifndef KVH_CORE_BLOCK_MAP_H
#define KVH_CORE_BLOCK_MAP_H

#include <stdbool.h>
#include <stdint.h>

typedef struct kvhi_block_map {
    uint32_t *keys; /* block index + 1; 0: empty */
    uint32_t *vals;
    uint32_t cap;   /* a power of two, or 0 */
    uint32_t shift; /* log2(cap) */
    uint32_t count;
} kvhi_block_map;

/* b's value, or NULL. */
uint32_t *kvhi_block_map_find(kvhi_block_map *m, uint32_t b);
/* Sets b's value (added when absent). 0, or -1 out of memory. */
int kvhi_block_map_put(kvhi_block_map *m, uint32_t b, uint32_t value);
/* Removes b; true (and *value) when it was there. */
bool kvhi_block_map_take(kvhi_block_map *m, uint32_t b, uint32_t *value);
void kvhi_block_map_free(kvhi_block_map *m);

#endif
