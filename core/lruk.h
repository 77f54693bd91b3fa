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
 * the same exact minimum as with the heap alone.
 *
 * A heap may also take items before their keys (kvhi_lruk_add_pending):
 * they wait, as bare item numbers, in a pending ring that is keyed only
 * when the order is next consulted (kvhi_lruk_top_current, kvhi_lruk_rekey),
 * each with its current key then. Most blocks are freed before any victim
 * is chosen, and those never pay for a key, a queue entry or a sift. One
 * freed while pending does not touch the ring at all (frees come in random
 * order, and a write into the ring there would miss the cache): its ring
 * entry goes stale, told apart because the item's position no longer
 * names it, and is skipped when the ring is read; the ring starts over
 * when no live item is left, and is squeezed when it fills. Until then an
 * upsert_lazy of a pending item has nothing to do: whatever its key
 * becomes is read at the drain. */
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
    /* Pending ring (kvhi_lruk_enable_pending): items in arrival order;
     * an entry is live while its item's position names its index
     * (kvhi_lruk_pending_live), stale otherwise; p_live counts the live. */
    uint32_t *pending;
    uint32_t p_base; /* positions name ring index at as p_base + at */
    uint32_t p_head;
    uint32_t p_len;
    uint32_t p_cap;
    uint32_t p_live;
} kvhi_lruk_heap;

/* A queued item's position: this bit and its ring index. */
#define KVHI_LRUK_QUEUED 0x80000000u
/* A pending item's position: this bit and its pending-ring index (heap and
 * queue positions stay below it where pending is enabled). */
#define KVHI_LRUK_PENDING 0x40000000u

/* The current key of an item in the heap (what a lazy raise deferred). */
typedef kvhi_lruk_key (*kvhi_lruk_current_fn)(void *ctx, uint32_t item);

int kvhi_lruk_init(kvhi_lruk_heap *h, uint32_t cap, void *pos_base, size_t pos_stride);
void kvhi_lruk_destroy(kvhi_lruk_heap *h);
/* Gives h a pending ring; 0, or -1 out of memory. Heaps whose items keep
 * one position field between them (a block's tier heaps) take disjoint
 * ranges of ring positions, from *next_position on (advanced past h's),
 * so that no entry left stale in one ring is named by a position in
 * another. A heap whose range would not fit below KVHI_LRUK_PENDING is
 * left without one (0): kvhi_lruk_add_pending then declines. */
int kvhi_lruk_enable_pending(kvhi_lruk_heap *h, uint32_t *next_position);
/* Whether position p (of an item of h) is in the pending ring. Only a
 * heap with a ring has such positions; in one without, heap and queue
 * positions may reach the bit. */
static inline int kvhi_lruk_pos_pending(const kvhi_lruk_heap *h, uint32_t p)
{
    return h->pending && p != KVHI_HEAP_NONE && (p & (KVHI_LRUK_QUEUED | KVHI_LRUK_PENDING)) == KVHI_LRUK_PENDING;
}
/* Moves the pending ring's live items to its front (it is full). */
void kvhi_lruk_pending_squeeze(kvhi_lruk_heap *h);
static inline uint32_t kvhi_lruk_pending_index(const kvhi_lruk_heap *h, uint32_t i)
{
    uint32_t r = h->p_head + i;
    return r >= h->p_cap ? r - h->p_cap : r;
}
/* Whether the pending ring's entry at index `at`, naming item, is live:
 * the item left (or left and came back elsewhere) when its position no
 * longer names this index. */
static inline int kvhi_lruk_pending_live(const kvhi_lruk_heap *h, uint32_t at, uint32_t item)
{
    return *(const uint32_t *)(h->pos_base + (size_t)item * h->pos_stride) == (KVHI_LRUK_PENDING | (h->p_base + at));
}
/* Files an item not present (position KVHI_HEAP_NONE) without a key: it
 * is keyed through current() at the next top_current or rekey. False
 * (nothing done) when h has no pending ring: use upsert_lazy. Inline, as
 * the pending branch of kvhi_lruk_remove: they are what an allocation
 * and a free of a block cost the victim order. */
static inline int kvhi_lruk_add_pending(kvhi_lruk_heap *h, uint32_t item)
{
    if (!h->pending)
        return 0;
    if (h->p_live == 0)
        h->p_head = h->p_len = 0; /* every entry is stale: start over, unread */
    else if (h->p_len == h->p_cap)
        kvhi_lruk_pending_squeeze(h);
    if (h->p_len == h->p_cap)
        return 0; /* cannot happen: the ring has room for every item */
    uint32_t at = kvhi_lruk_pending_index(h, h->p_len++);
    h->pending[at] = item;
    h->p_live++;
    *(uint32_t *)(h->pos_base + (size_t)item * h->pos_stride) = KVHI_LRUK_PENDING | (h->p_base + at);
    return 1;
}
/* The pending item whose position was p leaves the ring: its entry is
 * stale from the moment the position changes (the caller's next write),
 * so only the count of live entries is kept. */
static inline void kvhi_lruk_pending_leave(kvhi_lruk_heap *h) { h->p_live--; }
/* Keys every pending item with its current key, into the queue or the
 * heap: O(pending). top_current and rekey do it themselves. */
void kvhi_lruk_drain(kvhi_lruk_heap *h, kvhi_lruk_current_fn current, void *ctx);
/* Inserts, or updates the key of an item already present. */
void kvhi_lruk_upsert(kvhi_lruk_heap *h, uint32_t item, kvhi_lruk_key key);
/* Like upsert, but a key higher than the stored one is not stored: the
 * entry keeps its lower bound until kvhi_lruk_top_current() meets it.
 * Lowering a key is always applied at once. An item not present joins the
 * arrival queue when its key is at or above the queue's last one. A
 * pending item stays pending (its key is read when it is drained). */
void kvhi_lruk_upsert_lazy(kvhi_lruk_heap *h, uint32_t item, kvhi_lruk_key key);
static inline int kvhi_lruk_less(const kvhi_lruk_key *a, const kvhi_lruk_key *b)
{
    return a->primary != b->primary ? a->primary < b->primary : a->secondary < b->secondary;
}
/* Ring index of the arrival queue's last entry (the queue not empty). */
static inline uint32_t kvhi_lruk_queue_back(const kvhi_lruk_heap *h)
{
    uint32_t back = h->q_head + h->q_len - 1;
    return back >= h->q_cap ? back - h->q_cap : back;
}
/* upsert_lazy of an item not present (position KVHI_HEAP_NONE). Inline
 * where it joins the arrival queue's back (room, and a key at or above
 * the back's): a shadow's arrivals (core/adaptive.c) mostly do. */
static inline void kvhi_lruk_insert_lazy(kvhi_lruk_heap *h, uint32_t item, kvhi_lruk_key key)
{
    uint32_t len = h->q_len;
    if (len && len < h->q_cap) {
        uint32_t back = kvhi_lruk_queue_back(h);
        if (!kvhi_lruk_less(&key, &h->queue[back].key)) {
            uint32_t at = back + 1 == h->q_cap ? 0 : back + 1;
            h->queue[at].key = key;
            h->queue[at].item = item;
            h->q_len = len + 1;
            h->q_live++;
            *(uint32_t *)(h->pos_base + (size_t)item * h->pos_stride) = KVHI_LRUK_QUEUED | at;
            return;
        }
    }
    kvhi_lruk_upsert_lazy(h, item, key);
}
/* Removes the entry at position p of the heap or the queue. */
void kvhi_lruk_remove_ordered(kvhi_lruk_heap *h, uint32_t p);
static inline void kvhi_lruk_remove(kvhi_lruk_heap *h, uint32_t item)
{
    uint32_t *pos = (uint32_t *)(h->pos_base + (size_t)item * h->pos_stride);
    uint32_t p = *pos;
    if (p == KVHI_HEAP_NONE)
        return;
    *pos = KVHI_HEAP_NONE;
    if (kvhi_lruk_pos_pending(h, p))
        kvhi_lruk_pending_leave(h);
    else
        kvhi_lruk_remove_ordered(h, p);
}
/* kvhi_lruk_remove of a present item of a heap without a pending ring.
 * Inline where the item sits inside the arrival queue, not at either end:
 * it leaves a hole there and nothing to trim (the ends stay live). A
 * shadow's frees (core/adaptive.c) mostly do. */
static inline void kvhi_lruk_remove_present(kvhi_lruk_heap *h, uint32_t item)
{
    uint32_t *pos = (uint32_t *)(h->pos_base + (size_t)item * h->pos_stride);
    uint32_t p = *pos;
    *pos = KVHI_HEAP_NONE;
    if (p & KVHI_LRUK_QUEUED) {
        uint32_t at = p & ~KVHI_LRUK_QUEUED;
        if (at != h->q_head && at != kvhi_lruk_queue_back(h)) {
            h->queue[at].item = KVHI_HEAP_NONE;
            h->q_live--;
            return;
        }
    }
    kvhi_lruk_remove_ordered(h, p);
}
/* Lowest item by current keys, or KVHI_HEAP_NONE: stale entries met at the
 * top take their current key and sink. Exact while every key lowering went
 * through upsert or upsert_lazy. */
uint32_t kvhi_lruk_top_current(kvhi_lruk_heap *h, kvhi_lruk_current_fn current, void *ctx);
/* The entry with the lowest stored key (heap top or queue front), or NULL.
 * Pending items are not seen here, nor by kvhi_lruk_top, kvhi_lruk_top_key
 * and kvhi_lruk_stored_key (NULL for them), until drained. */
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
/* Items present: in the heap, the queue and the pending ring together. */
static inline uint32_t kvhi_lruk_count(const kvhi_lruk_heap *h) { return h->size + h->q_live + h->p_live; }
/* Gives every present item its current key (the victim order itself has
 * changed) and restores the heap: O(n). Queued and pending entries join
 * the heap. */
void kvhi_lruk_rekey(kvhi_lruk_heap *h, kvhi_lruk_current_fn current, void *ctx);
/* Key of an access history (most recent first, k entries). */
static inline kvhi_lruk_key kvhi_lruk_key_of(const uint64_t *hist, uint32_t k, int referenced)
{
    kvhi_lruk_key key;
    key.primary = hist[k - 1] | ((uint64_t)(referenced ? 1 : 0) << 63);
    key.secondary = hist[0];
    return key;
}
/* Records an access at time now into hist (k entries). */
void kvhi_lruk_record(uint64_t *hist, uint32_t k, uint64_t now);

#endif
