#include "core/prefix_index.h"

#include <stdbool.h>
#include <stdlib.h>

static inline uint64_t mix64(uint64_t x)
{
    /* A 64-bit finaliser with full avalanche (splitmix64 constants). */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

uint64_t kvhi_prefix_hash(uint64_t parent, const int32_t *tokens, size_t n, uint64_t salt)
{
    uint64_t h = mix64(parent ^ 0x6b7668u) ^ mix64(salt + 0x9e3779b97f4a7c15ull);
    h = mix64(h + n);
    size_t i = 0;
    for (; i + 1 < n; i += 2) {
        uint64_t w = (uint64_t)(uint32_t)tokens[i] | ((uint64_t)(uint32_t)tokens[i + 1] << 32);
        h = mix64(h ^ w) + 0x9e3779b97f4a7c15ull;
    }
    if (i < n)
        h = mix64(h ^ (uint64_t)(uint32_t)tokens[i]);
    h = mix64(h);
    return h ? h : 1;
}

uint64_t kvhi_scope_salt(uint64_t model_salt, uint64_t scope) { return model_salt ^ mix64(scope); }

uint64_t kvhi_scope_block_salt(uint64_t model_salt, const kvhi_scope *sc, uint64_t i, uint32_t bt)
{
    if (!sc)
        return model_salt;
    bool shared = sc->shared_tokens / bt > i; /* (i + 1) * bt <= shared_tokens, without overflow */
    return kvhi_scope_salt(model_salt, shared ? sc->shared_scope : sc->scope);
}

int kvhi_prefix_init(kvhi_prefix_index *ix, uint64_t max_entries)
{
    uint64_t cap = 16;
    while (cap < max_entries * 2)
        cap *= 2;
    ix->keys = calloc(cap, sizeof(uint64_t));
    ix->values = malloc(cap * sizeof(uint32_t));
    ix->mask = cap - 1;
    ix->count = 0;
    if (!ix->keys || !ix->values) {
        kvhi_prefix_destroy(ix);
        return -1;
    }
    return 0;
}

void kvhi_prefix_destroy(kvhi_prefix_index *ix)
{
    free(ix->keys);
    free(ix->values);
    ix->keys = NULL;
    ix->values = NULL;
    ix->count = 0;
}

int kvhi_prefix_insert(kvhi_prefix_index *ix, uint64_t hash, uint32_t value)
{
    if (hash == 0)
        return -1;
    uint64_t i = hash & ix->mask;
    while (ix->keys[i] != 0)
        i = (i + 1) & ix->mask;
    ix->keys[i] = hash;
    ix->values[i] = value;
    ix->count++;
    return 0;
}

void kvhi_prefix_erase(kvhi_prefix_index *ix, uint64_t hash, uint32_t value)
{
    if (hash == 0)
        return;
    uint64_t i = hash & ix->mask;
    while (ix->keys[i] != hash || ix->values[i] != value) {
        if (ix->keys[i] == 0)
            return;
        i = (i + 1) & ix->mask;
    }
    /* Backward shift: pull later members of the cluster into the hole
     * when their home position does not lie cyclically in (hole, j]. */
    uint64_t hole = i;
    for (uint64_t j = (i + 1) & ix->mask; ix->keys[j] != 0; j = (j + 1) & ix->mask) {
        uint64_t home = ix->keys[j] & ix->mask;
        int in_range = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
        if (!in_range) {
            ix->keys[hole] = ix->keys[j];
            ix->values[hole] = ix->values[j];
            hole = j;
        }
    }
    ix->keys[hole] = 0;
    ix->count--;
}
