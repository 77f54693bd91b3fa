#include "core/slot_pool.h"

#include <stdlib.h>

int kvhi_slot_pool_init(kvhi_slot_pool *p, uint32_t capacity) { return kvhi_slot_pool_init_range(p, 0, capacity); }

int kvhi_slot_pool_init_range(kvhi_slot_pool *p, uint32_t first, uint32_t capacity)
{
    p->capacity = capacity;
    p->free_count = capacity;
    p->free_stack = NULL;
    if (capacity == 0)
        return 0;
    p->free_stack = malloc(sizeof(uint32_t) * capacity);
    if (!p->free_stack)
        return -1;
    for (uint32_t i = 0; i < capacity; i++)
        p->free_stack[i] = first + capacity - 1 - i;
    return 0;
}

void kvhi_slot_pool_destroy(kvhi_slot_pool *p)
{
    free(p->free_stack);
    p->free_stack = NULL;
    p->capacity = p->free_count = 0;
}
