/* O(1) allocator of fixed-size slots in one tier: a stack of free slot
 * indices, initialised so that slots are handed out in ascending order
 * (neighbouring blocks of a sequence land in neighbouring memory). */
#ifndef KVH_CORE_SLOT_POOL_H
#define KVH_CORE_SLOT_POOL_H

#include <stdint.h>

typedef struct kvhi_slot_pool {
    uint32_t capacity;
    uint32_t free_count;
    uint32_t *free_stack;
} kvhi_slot_pool;

int kvhi_slot_pool_init(kvhi_slot_pool *p, uint32_t capacity);
/* Slots first .. first + capacity - 1. A pool holds `capacity` slots at
 * any time, but which ones may change: two tiers sharing one arena trade
 * slots when a block moves between them in place (evict.c). */
int kvhi_slot_pool_init_range(kvhi_slot_pool *p, uint32_t first, uint32_t capacity);
void kvhi_slot_pool_destroy(kvhi_slot_pool *p);
/* Returns 0 and a slot, or -1 when none is free. */
static inline int kvhi_slot_pool_alloc(kvhi_slot_pool *p, uint32_t *slot)
{
    if (p->free_count == 0)
        return -1;
    *slot = p->free_stack[--p->free_count];
    return 0;
}
static inline void kvhi_slot_pool_free(kvhi_slot_pool *p, uint32_t slot) { p->free_stack[p->free_count++] = slot; }
static inline uint32_t kvhi_slot_pool_used(const kvhi_slot_pool *p) { return p->capacity - p->free_count; }

#endif
