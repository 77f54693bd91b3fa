/* Generation-checked 64-bit handles.
 * Layout: bits 63..56 type tag (never 0), then the generation, then the
 * index in the low index_bits bits. Tables (sequences, fences, pools,
 * contexts, attention plans, views) use KVHI_TABLE_INDEX_BITS, leaving 32
 * bits of generation; block handles size their index to the engine's
 * block count, leaving 56 - index_bits (core/block.c). A handle whose
 * tag, generation or index does not match a live entry is rejected, so
 * stale and forged values are errors.
 *
 * No value is handed out twice: a slot's generation advances on every
 * removal, and a slot whose generation would come back to its first value
 * is retired (never handed out again) instead of wrapping. */
#ifndef KVH_CORE_HANDLES_H
#define KVH_CORE_HANDLES_H

#include <stdbool.h>
#include <stdint.h>

enum kvhi_handle_tag {
    KVHI_TAG_SEQ = 0x5A,
    KVHI_TAG_BLOCK = 0xB1,
    KVHI_TAG_FENCE = 0xF3,
    KVHI_TAG_POOL = 0x9C,
    KVHI_TAG_PLAN = 0xA7,
    KVHI_TAG_VMAP = 0x6E
};

#define KVHI_HANDLE_TAG_SHIFT 56
#define KVHI_HANDLE_PAYLOAD_MASK ((1ull << KVHI_HANDLE_TAG_SHIFT) - 1)

/* Packs gen above index_bits bits of index; gen bits that do not fit
 * below the tag are dropped. */
static inline uint64_t kvhi_handle_pack(uint8_t tag, uint64_t gen, uint32_t index, unsigned index_bits)
{
    uint64_t payload = (gen << index_bits) | (index & ((1ull << index_bits) - 1));
    return ((uint64_t)tag << KVHI_HANDLE_TAG_SHIFT) | (payload & KVHI_HANDLE_PAYLOAD_MASK);
}
static inline uint8_t kvhi_handle_tag(uint64_t h) { return (uint8_t)(h >> KVHI_HANDLE_TAG_SHIFT); }
static inline uint32_t kvhi_handle_unpack_index(uint64_t h, unsigned index_bits)
{
    return (uint32_t)(h & ((1ull << index_bits) - 1));
}

/* Table handles: 24 bits of index (at most 2^24 slots per table, retired
 * ones included) and the whole 32-bit generation. */
#define KVHI_TABLE_INDEX_BITS 24
#define KVHI_TABLE_MAX_SLOTS (1u << KVHI_TABLE_INDEX_BITS)

static inline uint64_t kvhi_handle_make(uint8_t tag, uint32_t gen, uint32_t idx)
{
    return kvhi_handle_pack(tag, gen, idx, KVHI_TABLE_INDEX_BITS);
}
static inline uint32_t kvhi_handle_gen(uint64_t h)
{
    return (uint32_t)((h & KVHI_HANDLE_PAYLOAD_MASK) >> KVHI_TABLE_INDEX_BITS);
}
static inline uint32_t kvhi_handle_index(uint64_t h) { return kvhi_handle_unpack_index(h, KVHI_TABLE_INDEX_BITS); }
/* Next generation, skipping 0 so no live handle equals a zeroed one. */
static inline uint32_t kvhi_gen_next(uint32_t gen)
{
    gen++;
    return gen ? gen : 1;
}

/* Attention plans and views are pointer types in the ABI: the pointer
 * handed out is the handle itself, never an address, so a stale or forged
 * one is looked up (and refused) instead of dereferenced. Handles are
 * never 0: NULL stays the null value. */
_Static_assert(sizeof(uintptr_t) >= sizeof(uint64_t), "a handle must fit in a pointer");
static inline void *kvhi_handle_to_ptr(uint64_t h) { return (void *)(uintptr_t)h; }
static inline uint64_t kvhi_handle_from_ptr(const void *p) { return (uint64_t)(uintptr_t)p; }

/* A growable table of pointers addressed by handles of one tag. */
typedef struct kvhi_handle_table {
    uint8_t tag;
    uint32_t gen_start; /* first generation of every slot (per engine) */
    uint32_t cap;
    uint32_t used;
    uint32_t retired; /* slots whose generations ran out */
    void **ptrs;
    uint32_t *gens;
    uint32_t *free_list;
    uint32_t free_top;
} kvhi_handle_table;

int kvhi_handles_init(kvhi_handle_table *t, uint8_t tag);
void kvhi_handles_destroy(kvhi_handle_table *t);
/* Generations start at `gen` (engines pick it at random, so a handle of a
 * closed engine is rejected by a new one with near certainty). Call before
 * the first add: a slot retires when its generation comes back to it. */
void kvhi_handles_set_gen_start(kvhi_handle_table *t, uint32_t gen);
/* Returns 0, or -1 when memory or the index space runs out. */
int kvhi_handles_add(kvhi_handle_table *t, void *ptr, uint64_t *handle, uint32_t *index);
/* The live pointer for handle, or NULL. */
void *kvhi_handles_get(const kvhi_handle_table *t, uint64_t handle, uint32_t *index);
void *kvhi_handles_at(const kvhi_handle_table *t, uint32_t index);
uint64_t kvhi_handles_handle_of(const kvhi_handle_table *t, uint32_t index);
/* Frees the slot; it is handed out again under the next generation, or
 * retired when that would repeat one it had. */
void kvhi_handles_remove(kvhi_handle_table *t, uint32_t index);

#endif
