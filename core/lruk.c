#include "core/lruk.h"

#include <stdlib.h>

#include "core/huge_alloc.h"

/* The entries start this many bytes into their allocation (64-byte
 * aligned), which puts every group of siblings (children 4i+1..4i+4, 96
 * bytes) on a 32-byte boundary: two cache lines per level of a sift
 * instead of up to three. */
#define GROUP_SHIFT ((32 - sizeof(kvhi_lruk_entry) % 32) % 32)
_Static_assert(sizeof(kvhi_lruk_entry) * KVHI_LRUK_ARITY % 32 == 0, "sibling groups keep their alignment");

static size_t alloc_bytes(uint32_t cap) { return GROUP_SHIFT + sizeof(kvhi_lruk_entry) * (size_t)cap; }

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
    return (cap && !h->entries) ? -1 : 0;
}

void kvhi_lruk_destroy(kvhi_lruk_heap *h)
{
    if (h->mem)
        kvhi_huge_free(h->mem, alloc_bytes(h->cap));
    h->mem = NULL;
    h->entries = NULL;
    h->size = h->cap = 0;
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

void kvhi_lruk_upsert(kvhi_lruk_heap *h, uint32_t item, kvhi_lruk_key key)
{
    uint32_t p = *pos_of(h, item);
    if (p != KVHI_HEAP_NONE) {
        kvhi_lruk_key old = h->entries[p].key;
        h->entries[p].key = key;
        if (kvhi_lruk_less(&key, &old))
            sift_up(h, p);
        else
            sift_down(h, p);
        return;
    }
    /* Capacity is sized for every item at construction: never grows. */
    h->entries[h->size] = (kvhi_lruk_entry){key, item};
    sift_up(h, h->size++);
}

void kvhi_lruk_upsert_lazy(kvhi_lruk_heap *h, uint32_t item, kvhi_lruk_key key)
{
    uint32_t p = *pos_of(h, item);
    if (p != KVHI_HEAP_NONE && !kvhi_lruk_less(&key, &h->entries[p].key))
        return; /* a raise: the stored key stays a lower bound */
    kvhi_lruk_upsert(h, item, key);
}

uint32_t kvhi_lruk_top_current(kvhi_lruk_heap *h, kvhi_lruk_current_fn current, void *ctx)
{
    while (h->size) {
        kvhi_lruk_entry *top = &h->entries[0];
        kvhi_lruk_key now = current(ctx, top->item);
        if (now.primary == top->key.primary && now.secondary == top->key.secondary)
            return top->item;
        /* Stored keys never exceed current ones: this one can only sink. */
        top->key = now;
        sift_down(h, 0);
    }
    return KVHI_HEAP_NONE;
}

void kvhi_lruk_remove(kvhi_lruk_heap *h, uint32_t item)
{
    uint32_t p = *pos_of(h, item);
    if (p == KVHI_HEAP_NONE)
        return;
    *pos_of(h, item) = KVHI_HEAP_NONE;
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

kvhi_lruk_key kvhi_lruk_key_of(const uint64_t *hist, uint32_t k, int referenced)
{
    kvhi_lruk_key key;
    key.primary = hist[k - 1] | ((uint64_t)(referenced ? 1 : 0) << 63);
    key.secondary = hist[0];
    return key;
}

void kvhi_lruk_record(uint64_t *hist, uint32_t k, uint64_t now)
{
    for (uint32_t i = k - 1; i > 0; i--)
        hist[i] = hist[i - 1];
    hist[0] = now;
}
