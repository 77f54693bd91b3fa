#include "core/handles.h"

#include <stdlib.h>

int kvhi_handles_init(kvhi_handle_table *t, uint8_t tag)
{
    *t = (kvhi_handle_table){.tag = tag, .gen_start = 1};
    return 0;
}

void kvhi_handles_set_gen_start(kvhi_handle_table *t, uint32_t gen) { t->gen_start = gen ? gen : 1; }

void kvhi_handles_destroy(kvhi_handle_table *t)
{
    free(t->ptrs);
    free(t->gens);
    free(t->free_list);
    *t = (kvhi_handle_table){.tag = t->tag, .gen_start = t->gen_start};
}

static int grow(kvhi_handle_table *t)
{
    uint32_t ncap = t->cap ? t->cap * 2 : 64;
    if (ncap > KVHI_TABLE_MAX_SLOTS)
        ncap = KVHI_TABLE_MAX_SLOTS; /* what a handle's index can name */
    if (ncap <= t->cap)
        return -1;
    void **p = realloc(t->ptrs, sizeof(*p) * ncap);
    if (!p)
        return -1;
    t->ptrs = p;
    uint32_t *g = realloc(t->gens, sizeof(*g) * ncap);
    if (!g)
        return -1;
    t->gens = g;
    uint32_t *f = realloc(t->free_list, sizeof(*f) * ncap);
    if (!f)
        return -1;
    t->free_list = f;
    /* Push new indices so the lowest is handed out first. */
    for (uint32_t i = ncap; i > t->cap; i--) {
        t->ptrs[i - 1] = NULL;
        t->gens[i - 1] = t->gen_start;
        t->free_list[t->free_top++] = i - 1;
    }
    t->cap = ncap;
    return 0;
}

int kvhi_handles_add(kvhi_handle_table *t, void *ptr, uint64_t *handle, uint32_t *index)
{
    if (t->free_top == 0 && grow(t) != 0)
        return -1;
    uint32_t i = t->free_list[--t->free_top];
    t->ptrs[i] = ptr;
    t->used++;
    *handle = kvhi_handle_make(t->tag, t->gens[i], i);
    if (index)
        *index = i;
    return 0;
}

void *kvhi_handles_get(const kvhi_handle_table *t, uint64_t handle, uint32_t *index)
{
    if (kvhi_handle_tag(handle) != t->tag)
        return NULL;
    uint32_t i = kvhi_handle_index(handle);
    if (i >= t->cap || !t->ptrs[i] || handle != kvhi_handles_handle_of(t, i))
        return NULL;
    if (index)
        *index = i;
    return t->ptrs[i];
}

void *kvhi_handles_at(const kvhi_handle_table *t, uint32_t index) { return index < t->cap ? t->ptrs[index] : NULL; }

uint64_t kvhi_handles_handle_of(const kvhi_handle_table *t, uint32_t index)
{
    return kvhi_handle_make(t->tag, t->gens[index], index);
}

void kvhi_handles_remove(kvhi_handle_table *t, uint32_t index)
{
    t->ptrs[index] = NULL;
    t->gens[index] = kvhi_gen_next(t->gens[index]);
    t->used--;
    /* Every generation was handed out once (2^32 - 1 of them): a reuse
     * would revive the first handle, so the slot stays out of the free
     * list for good (a few bytes). */
    if (t->gens[index] == t->gen_start) {
        t->retired++;
        return;
    }
    t->free_list[t->free_top++] = index;
}
