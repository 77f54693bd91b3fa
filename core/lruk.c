#include "core/lruk.h"

#include <stdbool.h>
#include <stdlib.h>

#include "core/huge_alloc.h"

/* The entries start this many bytes into their allocation (64-byte
 * aligned), which puts every group of siblings (children 4i+1..4i+4, 96
 * bytes) on a 32-byte boundary: two cache lines per level of a sift
 * instead of up to three. */
#define GROUP_SHIFT ((32 - sizeof(kvhi_lruk_entry) % 32) % 32)
_Static_assert(sizeof(kvhi_lruk_entry) * KVHI_LRUK_ARITY % 32 == 0, "sibling groups keep their alignment");

static size_t alloc_bytes(uint32_t cap) { return GROUP_SHIFT + sizeof(kvhi_lruk_entry) * (size_t)cap; }

/* Room for every item plus half as many holes: squeezing the holes out of
 * a full ring then frees at least a third of it, so it costs O(1) per
 * arrival amortised. */
static uint32_t queue_cap(uint32_t cap) { return cap ? cap + cap / 2 + 8 : 0; }
static size_t queue_bytes(uint32_t q_cap) { return sizeof(kvhi_lruk_entry) * (size_t)q_cap; }

static inline uint32_t *pos_of(kvhi_lruk_heap *h, uint32_t item)
{
    return (uint32_t *)(h->pos_base + (size_t)item * h->pos_stride);
}

int kvhi_lruk_init(kvhi_lruk_heap *h, uint32_t cap, void *pos_base, size_t pos_stride)
{
    h->size = 0;
    h->cap = cap;
    h->pos_base = pos_base;
    h->pos_stride = pos_stride;
    h->mem = cap ? kvhi_huge_alloc(alloc_bytes(cap)) : NULL;
    h->entries = h->mem ? (kvhi_lruk_entry *)((uint8_t *)h->mem + GROUP_SHIFT) : NULL;
    h->q_head = h->q_len = h->q_live = 0;
    h->pending = NULL;
    h->p_base = h->p_head = h->p_len = h->p_cap = h->p_live = 0;
    h->q_cap = queue_cap(cap);
    h->q_mem = h->q_cap ? kvhi_huge_alloc(queue_bytes(h->q_cap)) : NULL;
    h->queue = h->q_mem;
    if (cap && (!h->entries || !h->queue)) {
        kvhi_lruk_destroy(h);
        return -1;
    }
    return 0;
}

void kvhi_lruk_destroy(kvhi_lruk_heap *h)
{
    if (h->mem)
        kvhi_huge_free(h->mem, alloc_bytes(h->cap));
    if (h->q_mem)
        kvhi_huge_free(h->q_mem, queue_bytes(h->q_cap));
    if (h->pending)
        kvhi_huge_free(h->pending, sizeof(uint32_t) * (size_t)h->p_cap);
    h->mem = h->q_mem = NULL;
    h->entries = h->queue = NULL;
    h->pending = NULL;
    h->size = h->cap = 0;
    h->q_head = h->q_len = h->q_cap = h->q_live = 0;
    h->p_head = h->p_len = h->p_cap = h->p_live = 0;
}

int kvhi_lruk_enable_pending(kvhi_lruk_heap *h, uint32_t *next_position)
{
    uint32_t p_cap = queue_cap(h->cap);
    if (h->pending || p_cap == 0 || (uint64_t)*next_position + p_cap >= KVHI_LRUK_PENDING ||
        h->q_cap >= KVHI_LRUK_PENDING)
        return 0;
    h->pending = kvhi_huge_alloc(sizeof(uint32_t) * (size_t)p_cap);
    if (!h->pending)
        return -1;
    h->p_cap = p_cap;
    h->p_base = *next_position;
    *next_position += p_cap;
    return 0;
}

/* ---- arrival queue ---- */

static inline uint32_t q_index(const kvhi_lruk_heap *h, uint32_t i)
{
    uint32_t r = h->q_head + i;
    return r >= h->q_cap ? r - h->q_cap : r;
}

static inline kvhi_lruk_entry *q_front(kvhi_lruk_heap *h) { return h->q_len ? &h->queue[h->q_head] : NULL; }

static inline kvhi_lruk_entry *q_back(kvhi_lruk_heap *h)
{
    return h->q_len ? &h->queue[kvhi_lruk_queue_back(h)] : NULL;
}

/* Moves the live entries to the front of the ring, in order. */
static void q_squeeze(kvhi_lruk_heap *h)
{
    uint32_t out = 0;
    for (uint32_t i = 0; i < h->q_len; i++) {
        kvhi_lruk_entry e = h->queue[q_index(h, i)];
        if (e.item == KVHI_HEAP_NONE)
            continue;
        uint32_t at = q_index(h, out++);
        h->queue[at] = e;
        *(uint32_t *)(h->pos_base + (size_t)e.item * h->pos_stride) = KVHI_LRUK_QUEUED | at;
    }
    h->q_len = out;
}

/* Appends when key keeps the queue sorted; false otherwise. */
static bool q_push(kvhi_lruk_heap *h, uint32_t item, kvhi_lruk_key key)
{
    const kvhi_lruk_entry *back = q_back(h);
    if (back && kvhi_lruk_less(&key, &back->key))
        return false;
    if (h->q_len == h->q_cap)
        q_squeeze(h);
    if (h->q_len == h->q_cap)
        return false; /* cannot happen: the ring has room for every item */
    uint32_t at = q_index(h, h->q_len++);
    /* Field by field: a struct copy made a 16-byte load of the two 8-byte
     * stores that built the key, which the CPU cannot forward. */
    kvhi_lruk_entry *slot = &h->queue[at];
    slot->key.primary = key.primary;
    slot->key.secondary = key.secondary;
    slot->item = item;
    h->q_live++;
    *(uint32_t *)(h->pos_base + (size_t)item * h->pos_stride) = KVHI_LRUK_QUEUED | at;
    return true;
}

/* Leaves a hole, and trims holes off both ends so that they stay live. */
static void q_remove_at(kvhi_lruk_heap *h, uint32_t at)
{
    h->queue[at].item = KVHI_HEAP_NONE;
    h->q_live--;
    while (h->q_len && h->queue[h->q_head].item == KVHI_HEAP_NONE) {
        h->q_head = h->q_head + 1 == h->q_cap ? 0 : h->q_head + 1;
        h->q_len--;
    }
    while (h->q_len && h->queue[q_index(h, h->q_len - 1)].item == KVHI_HEAP_NONE)
        h->q_len--;
    if (!h->q_len)
        h->q_head = 0;
}

/* ---- pending ring ---- */

void kvhi_lruk_pending_squeeze(kvhi_lruk_heap *h)
{
    uint32_t out = 0;
    for (uint32_t i = 0; i < h->p_len; i++) {
        uint32_t item = h->pending[kvhi_lruk_pending_index(h, i)];
        if (!kvhi_lruk_pending_live(h, kvhi_lruk_pending_index(h, i), item))
            continue;
        uint32_t at = kvhi_lruk_pending_index(h, out++);
        h->pending[at] = item;
        *pos_of(h, item) = KVHI_LRUK_PENDING | (h->p_base + at);
    }
    h->p_len = out;
}

const kvhi_lruk_entry *kvhi_lruk_min_entry(const kvhi_lruk_heap *h)
{
    const kvhi_lruk_entry *top = h->size ? &h->entries[0] : NULL;
    const kvhi_lruk_entry *front = h->q_len ? &h->queue[h->q_head] : NULL;
    if (!top || (front && kvhi_lruk_less(&front->key, &top->key)))
        return front;
    return top;
}

const kvhi_lruk_key *kvhi_lruk_stored_key(const kvhi_lruk_heap *h, uint32_t item)
{
    uint32_t p = *(const uint32_t *)(h->pos_base + (size_t)item * h->pos_stride);
    if (p == KVHI_HEAP_NONE || kvhi_lruk_pos_pending(h, p))
        return NULL;
    if (p & KVHI_LRUK_QUEUED)
        return &h->queue[p & ~KVHI_LRUK_QUEUED].key;
    return &h->entries[p].key;
}

static void place(kvhi_lruk_heap *h, uint32_t i, kvhi_lruk_entry e)
{
    h->entries[i] = e;
    *pos_of(h, e.item) = i;
}

static void sift_up(kvhi_lruk_heap *h, uint32_t i)
{
    kvhi_lruk_entry e = h->entries[i];
    while (i > 0) {
        uint32_t parent = (i - 1) / KVHI_LRUK_ARITY;
        if (!kvhi_lruk_less(&e.key, &h->entries[parent].key))
            break;
        place(h, i, h->entries[parent]);
        i = parent;
    }
    place(h, i, e);
}

static void sift_down(kvhi_lruk_heap *h, uint32_t i)
{
    kvhi_lruk_entry e = h->entries[i];
    for (;;) {
        uint64_t first = (uint64_t)i * KVHI_LRUK_ARITY + 1;
        if (first >= h->size)
            break;
        uint32_t c = (uint32_t)first;
        uint32_t end = first + KVHI_LRUK_ARITY < h->size ? (uint32_t)first + KVHI_LRUK_ARITY : h->size;
        for (uint32_t j = c + 1; j < end; j++)
            if (kvhi_lruk_less(&h->entries[j].key, &h->entries[c].key))
                c = j;
        if (!kvhi_lruk_less(&h->entries[c].key, &e.key))
            break;
        place(h, i, h->entries[c]);
        i = c;
    }
    place(h, i, e);
}

static void heap_insert(kvhi_lruk_heap *h, uint32_t item, kvhi_lruk_key key)
{
    /* Capacity is sized for every item at construction: never grows. */
    h->entries[h->size] = (kvhi_lruk_entry){key, item};
    sift_up(h, h->size++);
}

void kvhi_lruk_upsert(kvhi_lruk_heap *h, uint32_t item, kvhi_lruk_key key)
{
    uint32_t p = *pos_of(h, item);
    if (kvhi_lruk_pos_pending(h, p)) {
        kvhi_lruk_pending_leave(h); /* stale once heap_insert moves it below */
        p = KVHI_HEAP_NONE;
    } else if (p != KVHI_HEAP_NONE && (p & KVHI_LRUK_QUEUED)) {
        q_remove_at(h, p & ~KVHI_LRUK_QUEUED);
        p = KVHI_HEAP_NONE;
    }
    if (p != KVHI_HEAP_NONE) {
        kvhi_lruk_key old = h->entries[p].key;
        h->entries[p].key = key;
        if (kvhi_lruk_less(&key, &old))
            sift_up(h, p);
        else
            sift_down(h, p);
        return;
    }
    heap_insert(h, item, key);
}

void kvhi_lruk_upsert_lazy(kvhi_lruk_heap *h, uint32_t item, kvhi_lruk_key key)
{
    uint32_t p = *pos_of(h, item);
    if (p == KVHI_HEAP_NONE) {
        if (!q_push(h, item, key))
            heap_insert(h, item, key);
        return;
    }
    if (kvhi_lruk_pos_pending(h, p))
        return; /* keyed when drained, by its key then */
    if (!kvhi_lruk_less(&key, kvhi_lruk_stored_key(h, item)))
        return; /* a raise: the stored key stays a lower bound */
    kvhi_lruk_upsert(h, item, key);
}

void kvhi_lruk_drain(kvhi_lruk_heap *h, kvhi_lruk_current_fn current, void *ctx)
{
    for (uint32_t i = 0; i < h->p_len; i++) {
        uint32_t item = h->pending[kvhi_lruk_pending_index(h, i)];
        if (!kvhi_lruk_pending_live(h, kvhi_lruk_pending_index(h, i), item))
            continue;
        kvhi_lruk_key key = current(ctx, item);
        *pos_of(h, item) = KVHI_HEAP_NONE;
        if (!q_push(h, item, key))
            heap_insert(h, item, key);
    }
    h->p_head = h->p_len = h->p_live = 0;
}

uint32_t kvhi_lruk_top_current(kvhi_lruk_heap *h, kvhi_lruk_current_fn current, void *ctx)
{
    if (h->p_live)
        kvhi_lruk_drain(h, current, ctx);
    for (;;) {
        kvhi_lruk_entry *top = h->size ? &h->entries[0] : NULL;
        kvhi_lruk_entry *front = q_front(h);
        if (!top && !front)
            return KVHI_HEAP_NONE;
        bool from_queue = front && (!top || kvhi_lruk_less(&front->key, &top->key));
        kvhi_lruk_entry *m = from_queue ? front : top;
        kvhi_lruk_key now = current(ctx, m->item);
        if (now.primary == m->key.primary && now.secondary == m->key.secondary)
            return m->item;
        /* Stored keys never exceed current ones: this one can only sink. */
        if (from_queue) {
            uint32_t item = m->item;
            q_remove_at(h, h->q_head);
            heap_insert(h, item, now);
        } else {
            top->key = now;
            sift_down(h, 0);
        }
    }
}

void kvhi_lruk_remove_ordered(kvhi_lruk_heap *h, uint32_t p)
{
    if (p & KVHI_LRUK_QUEUED) {
        q_remove_at(h, p & ~KVHI_LRUK_QUEUED);
        return;
    }
    h->size--;
    if (p == h->size)
        return;
    kvhi_lruk_entry last = h->entries[h->size];
    kvhi_lruk_key removed = h->entries[p].key;
    place(h, p, last);
    if (kvhi_lruk_less(&last.key, &removed))
        sift_up(h, p);
    else
        sift_down(h, p);
}

void kvhi_lruk_rekey(kvhi_lruk_heap *h, kvhi_lruk_current_fn current, void *ctx)
{
    for (uint32_t i = 0; i < h->p_len; i++) {
        uint32_t item = h->pending[kvhi_lruk_pending_index(h, i)];
        if (kvhi_lruk_pending_live(h, kvhi_lruk_pending_index(h, i), item))
            h->entries[h->size++].item = item; /* keyed below with the rest */
    }
    h->p_head = h->p_len = h->p_live = 0;
    for (uint32_t i = 0; i < h->q_len; i++) {
        kvhi_lruk_entry e = h->queue[q_index(h, i)];
        if (e.item != KVHI_HEAP_NONE)
            h->entries[h->size++] = e;
    }
    h->q_head = h->q_len = h->q_live = 0;
    for (uint32_t i = 0; i < h->size; i++) {
        h->entries[i].key = current(ctx, h->entries[i].item);
        *pos_of(h, h->entries[i].item) = i;
    }
    /* Floyd's construction: sift every parent down, last first. */
    for (uint32_t i = h->size / KVHI_LRUK_ARITY + 1; i-- > 0;)
        if (i < h->size)
            sift_down(h, i);
}

void kvhi_lruk_record(uint64_t *hist, uint32_t k, uint64_t now)
{
    for (uint32_t i = k - 1; i > 0; i--)
        hist[i] = hist[i - 1];
    hist[0] = now;
}
