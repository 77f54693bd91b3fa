/* Generation-checked 64-bit handles.
 * Layout: bits 63..56 type tag (never 0), 55..32 generation (never 0),
 * 31..0 index. A handle whose tag, generation or index does not match a
 * live entry is rejected, so stale and forged values are errors. */
#ifndef KVH_CORE_HANDLES_H
#define KVH_CORE_HANDLES_H

#include <stdbool.h>
#include <stdint.h>

enum kvhi_handle_tag {
    KVHI_TAG_SEQ = 0x5A,
    KVHI_TAG_BLOCK = 0xB1,
    KVHI_TAG_FENCE = 0xF3,
    KVHI_TAG_POOL = 0x9C
};

#define KVHI_GEN_MASK 0xFFFFFFu

static inline uint64_t kvhi_handle_make(uint8_t tag, uint32_t gen, uint32_t idx)
{
    return ((uint64_t)tag << 56) | ((uint64_t)(gen & KVHI_GEN_MASK) << 32) | idx;
}
static inline uint8_t kvhi_handle_tag(uint64_t h) { return (uint8_t)(h >> 56); }
static inline uint32_t kvhi_handle_gen(uint64_t h) { return (uint32_t)(h >> 32) & KVHI_GEN_MASK; }
static inline uint32_t kvhi_handle_index(uint64_t h) { return (uint32_t)h; }
/* Next generation, skipping 0 so no live handle equals a zeroed one. */
static inline uint32_t kvhi_gen_next(uint32_t gen)
{
    gen = (gen + 1) & KVHI_GEN_MASK;
    return gen ? gen : 1;
}

/* A growable table of pointers addressed by handles of one tag. */
typedef struct kvhi_handle_table {
    uint8_t tag;
    uint32_t gen_start; /* first generation of new entries (per engine) */
    uint32_t cap;
    uint32_t used;
    void **ptrs;
    uint32_t *gens;
    uint32_t *free_list;
    uint32_t free_top;
} kvhi_handle_table;

int kvhi_handles_init(kvhi_handle_table *t, uint8_t tag);
void kvhi_handles_destroy(kvhi_handle_table *t);
/* Generations start at `gen` (engines pick it at random, so a handle of a
 * closed engine is rejected by a new one with near certainty). */
void kvhi_handles_set_gen_start(kvhi_handle_table *t, uint32_t gen);
/* Returns 0, or -1 when memory runs out. */
int kvhi_handles_add(kvhi_handle_table *t, void *ptr, uint64_t *handle,
                     uint32_t *index);
/* The live pointer for handle, or NULL. */
void *kvhi_handles_get(const kvhi_handle_table *t, uint64_t handle,
                       uint32_t *index);
void *kvhi_handles_at(const kvhi_handle_table *t, uint32_t index);
uint64_t kvhi_handles_handle_of(const kvhi_handle_table *t, uint32_t index);
void kvhi_handles_remove(kvhi_handle_table *t, uint32_t index);

#endif
