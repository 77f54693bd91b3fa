/* core/block_map.h. */
#include "core/block_map.h"

#include <stdlib.h>

/* The product's high bits: its low ones repeat for records a power of two
 * apart (a sequence's blocks often are), which would pile them into runs. */
static uint32_t home(const kvhi_block_map *m, uint32_t b)
{
    return (uint32_t)(((uint64_t)b * 0x9e3779b97f4a7c15ull) >> (64 - m->shift));
}

static int grow(kvhi_block_map *m)
{
    if (m->cap > UINT32_MAX / 2)
        return -1;
    uint32_t cap = m->cap ? m->cap * 2 : 64;
    uint32_t *keys = calloc(cap, sizeof(uint32_t)), *vals = malloc(sizeof(uint32_t) * cap);
    if (!keys || !vals) {
        free(keys);
        free(vals);
        return -1;
    }
    kvhi_block_map n = {
        .keys = keys, .vals = vals, .cap = cap, .shift = m->shift ? m->shift + 1 : 6, .count = m->count};
    for (uint32_t i = 0; i < m->cap; i++)
        if (m->keys[i]) {
            uint32_t s = home(&n, m->keys[i] - 1);
            while (n.keys[s])
                s = (s + 1) & (cap - 1);
            n.keys[s] = m->keys[i];
            n.vals[s] = m->vals[i];
        }
    kvhi_block_map_free(m);
    *m = n;
    return 0;
}

uint32_t *kvhi_block_map_find(kvhi_block_map *m, uint32_t b)
{
    if (!m->count)
        return NULL;
    for (uint32_t s = home(m, b); m->keys[s]; s = (s + 1) & (m->cap - 1))
        if (m->keys[s] == b + 1)
            return &m->vals[s];
    return NULL;
}

int kvhi_block_map_put(kvhi_block_map *m, uint32_t b, uint32_t value)
{
    uint32_t *v = kvhi_block_map_find(m, b);
    if (v) {
        *v = value;
        return 0;
    }
    if ((uint64_t)(m->count + 1) * 2 > m->cap && grow(m) != 0)
        return -1;
    uint32_t s = home(m, b);
    while (m->keys[s])
        s = (s + 1) & (m->cap - 1);
    m->keys[s] = b + 1;
    m->vals[s] = value;
    m->count++;
    return 0;
}

bool kvhi_block_map_take(kvhi_block_map *m, uint32_t b, uint32_t *value)
{
    if (!m->count)
        return false;
    uint32_t s = home(m, b);
    while (m->keys[s] && m->keys[s] != b + 1)
        s = (s + 1) & (m->cap - 1);
    if (!m->keys[s])
        return false;
    *value = m->vals[s];
    /* Backward shift: a later entry of the run moves into the hole unless
     * its home lies cyclically in (hole, its slot]. */
    uint32_t hole = s;
    for (uint32_t j = (s + 1) & (m->cap - 1); m->keys[j]; j = (j + 1) & (m->cap - 1)) {
        uint32_t h = home(m, m->keys[j] - 1);
        bool stays = hole <= j ? (hole < h && h <= j) : (hole < h || h <= j);
        if (stays)
            continue;
        m->keys[hole] = m->keys[j];
        m->vals[hole] = m->vals[j];
        hole = j;
    }
    m->keys[hole] = 0;
    m->count--;
    return true;
}

void kvhi_block_map_free(kvhi_block_map *m)
{
    free(m->keys);
    free(m->vals);
    m->keys = m->vals = NULL;
    m->cap = m->shift = m->count = 0;
}
