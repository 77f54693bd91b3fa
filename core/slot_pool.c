#include "core/slot_pool.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int kvhi_slot_pool_init(kvhi_slot_pool *p, uint32_t capacity) { return kvhi_slot_pool_init_range(p, 0, capacity); }

int kvhi_slot_pool_init_range(kvhi_slot_pool *p, uint32_t first, uint32_t capacity)
{
    memset(p, 0, sizeof(*p));
    p->capacity = capacity;
    p->free_count = capacity;
    if (capacity == 0)
        return 0;
    p->free_stack = malloc(sizeof(uint32_t) * capacity);
    if (!p->free_stack)
        return -1;
    for (uint32_t i = 0; i < capacity; i++)
        p->free_stack[i] = first + capacity - 1 - i;
#ifdef KVH_CHECK_SLOTS
    p->n_marks = first + capacity;
    p->is_free = calloc(p->n_marks, sizeof(bool));
    p->owner = malloc(sizeof(uint32_t) * p->n_marks);
    if (!p->is_free || !p->owner) {
        free(p->is_free);
        free(p->owner);
        free(p->free_stack);
        memset(p, 0, sizeof(*p));
        return -1;
    }
    memset(p->owner, 0xff, sizeof(uint32_t) * p->n_marks);
    for (uint32_t i = 0; i < capacity; i++)
        p->is_free[first + i] = true;
#endif
    return 0;
}

int kvhi_slot_pool_join(kvhi_slot_pool *upper, kvhi_slot_pool *lower)
{
#ifdef KVH_CHECK_SLOTS
    if (!lower->is_free || upper->marks_shared)
        return 0;
    /* lower's marks already cover upper's slots (all in use there):
     * upper's state is copied in and both pools keep lower's array. */
    for (uint32_t s = 0; s < upper->n_marks && s < lower->n_marks; s++) {
        lower->is_free[s] = upper->is_free[s];
        lower->owner[s] = upper->owner[s];
    }
    free(upper->is_free);
    free(upper->owner);
    upper->is_free = lower->is_free;
    upper->owner = lower->owner;
    upper->n_marks = lower->n_marks;
    upper->marks_shared = true;
#else
    (void)upper, (void)lower;
#endif
    return 0;
}

void kvhi_slot_pool_take_all(kvhi_slot_pool *p)
{
#ifdef KVH_CHECK_SLOTS
    for (uint32_t i = 0; i < p->free_count; i++)
        p->is_free[p->free_stack[i]] = false;
#endif
    p->free_count = 0;
}

void kvhi_slot_pool_destroy(kvhi_slot_pool *p)
{
    free(p->free_stack);
#ifdef KVH_CHECK_SLOTS
    if (!p->marks_shared) {
        free(p->is_free);
        free(p->owner);
    }
#endif
    memset(p, 0, sizeof(*p));
}

#ifdef KVH_CHECK_SLOTS
void kvhi_slot_check_failed(const char *what, uint32_t slot)
{
    fprintf(stderr, "kvh: slot check: slot %u %s\n", slot, what);
    abort();
}
#endif
