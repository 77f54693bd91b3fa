/* Moves of blocks between tiers (core/move.c). Every function here runs
 * with the engine lock held; "drops the lock" means it is released for a
 * copy and retaken before the function returns, so the caller must
 * re-read anything another thread may have changed meanwhile. */
#ifndef KVH_CORE_MOVE_H
#define KVH_CORE_MOVE_H

#include "core/engine.h"
#include "core/host_spare.h"

/* Block data transfer between any two tiers, run without the lock; the
 * descriptor is filled under the lock by kvhi_xfer_prepare. */
typedef struct kvhi_xfer {
    uint32_t block;
    uint32_t src_tier, src_slot, dst_tier, dst_slot;
    uint64_t hash, parent;
    uint32_t n_tokens;
    uint32_t data_crc; /* out for writes, expected for reads */
    bool published;    /* writes: immutable, so its slot may outlive a damaged index */
    int32_t tokens[256];
    int err; /* 0, -errno, or 1 for failed verification */
    const char *why;
    /* Device <-> host on one arena: nothing to transfer; src_slot is then
     * the slot the destination tier gave in exchange (moves_in_place). */
    bool in_place;
    /* Counted in its agent's device_incoming until kvhi_move_end. */
    bool incoming;
    uint32_t agent;
    /* Read into the host tier's spare (core/host_spare.h): repaid at the
     * move's end. */
    bool into_spare;
} kvhi_xfer;

/* The bracket around a copy made without the lock: copies_in_progress
 * tells kvhi_reserve_slot that room may still appear, and the wake-up
 * after it lets waiters re-check the blocks the copy touched. */
static inline void kvhi_unlock_for_copy(kvh_engine *e)
{
    kvhi_assert_locked(e);
    e->copies_in_progress++;
    pthread_mutex_unlock(&e->lock);
}

static inline void kvhi_relock_after_copy(kvh_engine *e)
{
    kvhi_assert_unlocked(e);
    pthread_mutex_lock(&e->lock);
    e->copies_in_progress--;
    pthread_cond_broadcast(&e->changed);
}

/* Moves block b to tier synchronously. Drops the lock. */
kvh_status kvhi_move_block(kvh_engine *e, uint32_t b, uint32_t tier, uint32_t for_agent);
/* The same, but b's old slot is handed to the caller (*src_slot_out)
 * instead of being freed: the eviction that made room for another block.
 * Drops the lock. */
kvh_status kvhi_move_handing_over(kvh_engine *e, uint32_t b, uint32_t tier, uint32_t *src_slot_out);
/* First half of a move: reserves the destination (may evict, dropping
 * the lock) and marks b in flight. Returns 0 with x prepared (run the
 * transfer without the lock, then kvhi_move_end), 1 when nothing is left
 * to transfer, or a negative status with b unchanged. */
int kvhi_move_begin(kvh_engine *e, uint32_t b, uint32_t tier, kvhi_xfer *x, bool keep_src_for_caller);
/* Second half: commits a finished transfer, or undoes a failed one. */
kvh_status kvhi_move_end(kvh_engine *e, kvhi_xfer *x, uint32_t *src_slot_out);
/* Brings a block that lives on disk into a memory tier and waits for it.
 * Drops the lock. */
kvh_status kvhi_block_ensure_memory(kvh_engine *e, uint32_t b);

/* ---- the transfer of a move (core/move_xfer.c), run without the lock ---- */
/* Fills x for moving b to dst_slot of dst_tier (lock held). */
void kvhi_xfer_prepare(kvh_engine *e, uint32_t b, uint32_t dst_tier, uint32_t dst_slot, kvhi_xfer *x);
/* Copies, writes or reads one block as x says; x->err reports failure. */
void kvhi_xfer_run(kvh_engine *e, kvhi_xfer *x);
/* Runs transfers that all go to, or all come from, the disk tier as
 * batches of neighbouring slots, one lane submission at a time; each
 * block's latency sample is the time of its own submission. */
void kvhi_xfer_batch(kvh_engine *e, kvhi_xfer *xs, uint32_t n);

/* ---- external pools (core/move_pool.c) ---- */
struct kvhi_ext_pool;
/* Gathers (to_block) or scatters one block between slot of pool p and
 * block b, which must be in memory and held. Keeps the lock. */
kvh_status kvhi_pool_copy(kvh_engine *e, struct kvhi_ext_pool *p, uint32_t slot, uint32_t b, bool to_block);

/* Records that b's disk data failed verification: never served again. */
kvh_status kvhi_mark_corrupt(kvh_engine *e, uint32_t b, const char *why);
static inline void kvhi_release_slot(kvh_engine *e, uint32_t tier, uint32_t slot)
{
    if (tier == KVH_TIER_HOST && kvhi_host_spare_refill(e, slot))
        return;
    kvhi_slot_pool_free(&e->tiers[tier].slots, slot);
}
/* Copies n bytes between two tiers' memory with the backend's copy kind
 * (a plain memcpy between host-addressable memories). */
int kvhi_copy_bytes(kvh_engine *e, uint32_t dst_tier, void *dst, uint32_t src_tier, const void *src, size_t n);

#endif
