/* Prefix index: chained 64-bit block hashes -> block index.
 *
 * The hash of a full block is H(parent hash, its token ids, model salt),
 * so equal hashes mean equal prefixes up to and including that block. The
 * table is open addressing with linear probing and backward-shift deletion
 * (no tombstones), sized at creation for every block the engine can hold. */
#ifndef KVH_CORE_PREFIX_INDEX_H
#define KVH_CORE_PREFIX_INDEX_H

#include <stddef.h>
#include <stdint.h>

#define KVHI_PREFIX_MISS UINT32_MAX

typedef struct kvhi_prefix_index {
    uint64_t *keys; /* 0 = empty slot */
    uint32_t *values;
    uint64_t mask;
    uint64_t count;
} kvhi_prefix_index;

/* Never returns 0 (the empty key). */
uint64_t kvhi_prefix_hash(uint64_t parent, const int32_t *tokens, size_t n, uint64_t salt);

int kvhi_prefix_init(kvhi_prefix_index *ix, uint64_t max_entries);
void kvhi_prefix_destroy(kvhi_prefix_index *ix);
uint32_t kvhi_prefix_find(const kvhi_prefix_index *ix, uint64_t hash);
/* Returns 0, or -1 if the hash is present already. */
int kvhi_prefix_insert(kvhi_prefix_index *ix, uint64_t hash, uint32_t value);
void kvhi_prefix_erase(kvhi_prefix_index *ix, uint64_t hash);

#endif
