/* The table of core/durable_twin.h: open addressing, linear probing,
 * deletion by backward shift (no tombstones). */
#include "core/durable_twin.h"

#include <stdlib.h>

#include "core/block.h"

static uint32_t slot_of(const kvhi_twin_table *t, uint32_t block) { return (block * 0x9e3779b1u) & (t->cap - 1); }

static int grow(kvhi_twin_table *t)
{
    uint32_t cap = t->cap ? t->cap * 2 : 64;
    uint32_t *keys = calloc(cap, sizeof(uint32_t)), *twins = malloc(sizeof(uint32_t) * cap);
    if (!keys || !twins || cap < t->cap) {
        free(keys);
        free(twins);
        return -1;
    }
    kvhi_twin_table n = {.keys = keys, .twins = twins, .cap = cap, .count = t->count};
    for (uint32_t i = 0; i < t->cap; i++)
        if (t->keys[i]) {
            uint32_t s = slot_of(&n, t->keys[i] - 1);
            while (n.keys[s])
                s = (s + 1) & (cap - 1);
            n.keys[s] = t->keys[i];
            n.twins[s] = t->twins[i];
        }
    kvhi_twin_table_free(t);
    *t = n;
    return 0;
}

int kvhi_twin_keep(kvh_engine *e, uint32_t block, uint32_t twin)
{
    kvhi_twin_table *t = &e->handle_twins;
    if (t->cap) {
        for (uint32_t s = slot_of(t, block); t->keys[s]; s = (s + 1) & (t->cap - 1))
            if (t->keys[s] == block + 1) {
                /* Kept already (persisted twice): one reference is enough. */
                kvhi_block_unref(e, twin);
                return 0;
            }
    }
    if ((uint64_t)(t->count + 1) * 2 > t->cap && grow(t) != 0)
        return -1;
    uint32_t s = slot_of(t, block);
    while (t->keys[s])
        s = (s + 1) & (t->cap - 1);
    t->keys[s] = block + 1;
    t->twins[s] = twin;
    t->count++;
    return 0;
}

void kvhi_twin_drop_slow(kvh_engine *e, uint32_t block)
{
    kvhi_twin_table *t = &e->handle_twins;
    uint32_t s = slot_of(t, block);
    while (t->keys[s] && t->keys[s] != block + 1)
        s = (s + 1) & (t->cap - 1);
    if (!t->keys[s])
        return;
    uint32_t twin = t->twins[s];
    /* Backward shift: later entries of the run move into the hole when
     * their home slot does not lie strictly between the hole and them. */
    uint32_t hole = s;
    for (uint32_t j = (s + 1) & (t->cap - 1); t->keys[j]; j = (j + 1) & (t->cap - 1)) {
        uint32_t home = slot_of(t, t->keys[j] - 1);
        bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
        if (stays)
            continue;
        t->keys[hole] = t->keys[j];
        t->twins[hole] = t->twins[j];
        hole = j;
    }
    t->keys[hole] = 0;
    t->count--;
    kvhi_block_unref(e, twin);
}

void kvhi_twin_table_free(kvhi_twin_table *t)
{
    free(t->keys);
    free(t->twins);
    t->keys = t->twins = NULL;
    t->cap = t->count = 0;
}
