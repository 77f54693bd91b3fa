/* O(1) allocator of fixed-size slots in one tier: a stack of free slot
 * indices, initialised so that slots are handed out in ascending order
 * (neighbouring blocks of a sequence land in neighbouring memory).
 *
 * Built with KVH_CHECK_SLOTS (on in sanitizer builds), each arena keeps
 * a mark per slot saying whether it is free, and a slot freed twice,
 * handed out while in use, or given to a block while free aborts at once
 * with the slot's number; so does a block given a slot that another live
 * block's record still names (core/block.c). A move path that releases
 * one slot twice makes two blocks share it, which otherwise shows only as
 * wrong bytes later. */
#ifndef KVH_CORE_SLOT_POOL_H
#define KVH_CORE_SLOT_POOL_H

#include <stdbool.h>
#include <stdint.h>

typedef struct kvhi_slot_pool {
    uint32_t capacity;
    uint32_t free_count;
    uint32_t *free_stack;
#ifdef KVH_CHECK_SLOTS
    bool *is_free;     /* by slot index over the whole arena */
    uint32_t *owner;   /* the block last given each slot (UINT32_MAX: none) */
    uint32_t n_marks;  /* slots is_free and owner cover */
    bool marks_shared; /* is_free belongs to the pool it was joined to */
#endif
} kvhi_slot_pool;

int kvhi_slot_pool_init(kvhi_slot_pool *p, uint32_t capacity);
/* Slots first .. first + capacity - 1. A pool holds `capacity` slots at
 * any time, but which ones may change: two tiers sharing one arena trade
 * slots when a block moves between them in place (evict.c). */
int kvhi_slot_pool_init_range(kvhi_slot_pool *p, uint32_t first, uint32_t capacity);
/* Makes `upper` (slots 0 .. first - 1) and `lower` (made with
 * init_range from `first`) one arena for the checks; 0, or -1 when out of
 * memory. Nothing to do in other builds. */
int kvhi_slot_pool_join(kvhi_slot_pool *upper, kvhi_slot_pool *lower);
void kvhi_slot_pool_destroy(kvhi_slot_pool *p);
/* Empties the free list (every slot in use), for a caller that then
 * frees the slots it knows to be free. */
void kvhi_slot_pool_take_all(kvhi_slot_pool *p);

#ifdef KVH_CHECK_SLOTS
void kvhi_slot_check_failed(const char *what, uint32_t slot) __attribute__((noreturn));
static inline void kvhi_slot_mark(kvhi_slot_pool *p, uint32_t slot, bool now_free)
{
    if (slot >= p->n_marks)
        kvhi_slot_check_failed("outside its arena", slot);
    if (p->is_free[slot] == now_free)
        kvhi_slot_check_failed(now_free ? "freed twice" : "handed out while in use", slot);
    p->is_free[slot] = now_free;
}
#endif

/* Returns 0 and a slot, or -1 when none is free. */
static inline int kvhi_slot_pool_alloc(kvhi_slot_pool *p, uint32_t *slot)
{
    if (p->free_count == 0)
        return -1;
    *slot = p->free_stack[--p->free_count];
#ifdef KVH_CHECK_SLOTS
    kvhi_slot_mark(p, *slot, false);
#endif
    return 0;
}
static inline void kvhi_slot_pool_free(kvhi_slot_pool *p, uint32_t slot)
{
#ifdef KVH_CHECK_SLOTS
    kvhi_slot_mark(p, slot, true);
    p->owner[slot] = UINT32_MAX;
#endif
    p->free_stack[p->free_count++] = slot;
}
static inline uint32_t kvhi_slot_pool_used(const kvhi_slot_pool *p) { return p->capacity - p->free_count; }
/* A block is given slot: it must not be free (a no-op in other builds). */
static inline void kvhi_slot_check_in_use(const kvhi_slot_pool *p, uint32_t slot)
{
#ifdef KVH_CHECK_SLOTS
    if (slot >= p->n_marks || p->is_free[slot])
        kvhi_slot_check_failed("given to a block while free", slot);
#else
    (void)p, (void)slot;
#endif
}

/* Two blocks about to trade slots: neither is a second owner (a no-op in
 * other builds). */
static inline void kvhi_slot_check_vacate(kvhi_slot_pool *p, uint32_t slot)
{
#ifdef KVH_CHECK_SLOTS
    if (slot < p->n_marks)
        p->owner[slot] = UINT32_MAX;
#else
    (void)p, (void)slot;
#endif
}

#endif
