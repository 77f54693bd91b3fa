/* Indexed 4-ary min-heap of eviction candidates.
 *
 * Each entry carries its key, so comparisons never chase the block table.
 * The key orders victims: unreferenced (cached-only) blocks first, then by
 * the time of the K-th most recent access (blocks with fewer than K
 * accesses have time 0: infinite backward K-distance), then by the most
 * recent access. Each block stores its own heap position, so update and
 * removal are O(log n). Four children per node halve the levels of a
 * binary heap; a level's children share one or two cache lines.
 *
 * Raises may be lazy (kvhi_lruk_upsert_lazy): an access only raises a
 * block's key, so its entry keeps the old key, a lower bound, and
 * kvhi_lruk_top_current() brings stale entries up to date as they reach
 * the top. The victim is still the exact minimum of the current keys,
 * while an access costs O(1) instead of a sift through the heap.
 *
 * Entries that arrive (through upsert_lazy) with a key at or above every
 * key that arrived before them wait in an arrival queue instead of the
 * heap: a FIFO whose keys are sorted by construction. A block allocated
 * now, or released by its last holder, has the newest access time, so it
 * joins the queue in O(1), and leaves it in O(1) when freed unchosen. The
 * victim is the lower of the heap's top and the queue's front; a queued
 * entry whose key was raised meanwhile moves into the heap when it
 * reaches the front, and one whose key falls moves at once. The choice is
 * the same exact minimum as with the heap alone. */
#ifndef KVH_CORE_LRUK_H
#define KVH_CORE_LRUK_H

#include <stddef.h>
#include <stdint.h>

#define KVHI_HEAP_NONE UINT32_MAX
#define KVHI_LRUK_ARITY 4u

typedef struct kvhi_lruk_key {
    uint64_t primary;   /* class bit 63 | K-th access time */
    uint64_t secondary; /* most recent access time */
} kvhi_lruk_key;

typedef struct kvhi_lruk_entry {
    kvhi_lruk_key key;
    uint32_t item;
} kvhi_lruk_entry;

typedef struct kvhi_lruk_heap {
    kvhi_lruk_entry *entries;
    void *mem; /* the allocation entries lie in */
    uint32_t size;
    uint32_t cap;
    /* Where each item keeps its position: base + item * stride + offset. */
    uint8_t *pos_base;
    size_t pos_stride;
    /* Arrival queue: a ring of q_len entries from q_head, keys ascending,
     * both ends live; a removed entry inside is left as a hole (item
     * KVHI_HEAP_NONE) and holes are squeezed out when the ring fills. */
    kvhi_lruk_entry *queue;
    void *q_mem;
    uint32_t q_head;
    uint32_t q_len;
    uint32_t q_cap;
    uint32_t q_live; /* entries of the ring that are not holes */
} kvhi_lruk_heap;

/* A queued item's position: this bit and its ring index. */
#define KVHI_LRUK_QUEUED 0x80000000u

int kvhi_lruk_init(kvhi_lruk_heap *h, uint32_t cap, void *pos_base, size_t pos_stride);
void kvhi_lruk_destroy(kvhi_lruk_heap *h);
/* Inserts, or updates the key of an item already present. */
void kvhi_lruk_upsert(kvhi_lruk_heap *h, uint32_t item, kvhi_lruk_key key);
/* Like upsert, but a key higher than the stored one is not stored: the
 * entry keeps its lower bound until kvhi_lruk_top_current() meets it.
 * Lowering a key is always applied at once. An item not present joins the
 * arrival queue when its key is at or above the queue's last one. */
void kvhi_lruk_upsert_lazy(kvhi_lruk_heap *h, uint32_t item, kvhi_lruk_key key);
void kvhi_lruk_remove(kvhi_lruk_heap *h, uint32_t item);
/* The current key of an item in the heap (what a lazy raise deferred). */
typedef kvhi_lruk_key (*kvhi_lruk_current_fn)(void *ctx, uint32_t item);
/* Lowest item by current keys, or KVHI_HEAP_NONE: stale entries met at the
 * top take their current key and sink. Exact while every key lowering went
 * through upsert or upsert_lazy. */
uint32_t kvhi_lruk_top_current(kvhi_lruk_heap *h, kvhi_lruk_current_fn current, void *ctx);
static inline int kvhi_lruk_less(const kvhi_lruk_key *a, const kvhi_lruk_key *b)
{
    return a->primary != b->primary ? a->primary < b->primary : a->secondary < b->secondary;
}
/* The entry with the lowest stored key (heap top or queue front), or NULL. */
const kvhi_lruk_entry *kvhi_lruk_min_entry(const kvhi_lruk_heap *h);
/* Lowest item by stored keys, or KVHI_HEAP_NONE. */
static inline uint32_t kvhi_lruk_top(const kvhi_lruk_heap *h)
{
    const kvhi_lruk_entry *m = kvhi_lruk_min_entry(h);
    return m ? m->item : KVHI_HEAP_NONE;
}
static inline const kvhi_lruk_key *kvhi_lruk_top_key(const kvhi_lruk_heap *h)
{
    const kvhi_lruk_entry *m = kvhi_lruk_min_entry(h);
    return m ? &m->key : NULL;
}
/* The stored key of a present item (heap or queue). */
const kvhi_lruk_key *kvhi_lruk_stored_key(const kvhi_lruk_heap *h, uint32_t item);
/* Items present, in the heap and the queue together. */
uint32_t kvhi_lruk_count(const kvhi_lruk_heap *h);
/* Gives every present item its current key (the victim order itself has
 * changed) and restores the heap: O(n). Queued entries join the heap. */
void kvhi_lruk_rekey(kvhi_lruk_heap *h, kvhi_lruk_current_fn current, void *ctx);
/* Key of an access history (most recent first, k entries). */
kvhi_lruk_key kvhi_lruk_key_of(const uint64_t *hist, uint32_t k, int referenced);
/* Records an access at time now into hist (k entries). */
void kvhi_lruk_record(uint64_t *hist, uint32_t k, uint64_t now);

#endif
