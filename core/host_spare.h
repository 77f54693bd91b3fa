/* The host tier's spare slot: one slot beyond the host budget, kept for
 * trades with a full disk tier. With every tier full of referenced blocks
 * a block on disk could never come up: making room in the host tier needs
 * a disk slot for the victim, and the only disk slot to be had is the one
 * the block leaves once it is up. The block is read into the spare, its
 * disk slot freed, and the host tier's victim written there; the
 * victim's host slot becomes the spare. While lent (a block durable on
 * disk keeps its slot there), the host tier counts one slot more, and the
 * next host slot released, or the next room it makes, pays the spare
 * back. Lock held in every call. */
#ifndef KVH_CORE_HOST_SPARE_H
#define KVH_CORE_HOST_SPARE_H

#include <stdbool.h>
#include <stdint.h>

#include "core/engine.h"

/* Whether the host tier keeps a spare: it has a disk tier below it. */
static inline bool kvhi_host_spare_wanted(const kvh_config *c)
{
    return c->disk_path && c->disk_path[0] && c->disk_bytes;
}

/* Takes the spare from the host tier's pool, which was made one slot
 * larger for it (engine open). */
void kvhi_host_spare_init(kvh_engine *e);

/* 1 while the spare is held back (taken in the host pool, no block's
 * room), else 0. */
static inline uint32_t kvhi_host_spare_held(const kvh_engine *e) { return e->host_spare != KVHI_NO_BLOCK; }

/* Tier t's slots as its budget counts them: the host tier's spare, while
 * it is held back, is not one of them. */
static inline uint64_t kvhi_tier_slots(const kvh_engine *e, uint32_t t)
{
    return e->tiers[t].slots.capacity - (t == KVH_TIER_HOST ? kvhi_host_spare_held(e) : 0);
}

/* The spare for block b, on disk, coming up to the host tier after room
 * could not be made there: only while the disk tier is full (b's slot,
 * freed, takes the victim), the host tier has a victim, and the move is
 * no prefetch. A block durable on disk (an index record names its slot)
 * keeps that slot, and so the spare, until the host tier next makes room.
 * False, and nothing taken, otherwise. */
bool kvhi_host_spare_take(kvh_engine *e, uint32_t b, uint32_t *slot);

/* After b arrived in the spare: the host tier's victim goes down into the
 * disk slot b left and leaves its own slot as the new spare. b is kept
 * out of the victim order meanwhile. May drop the lock; on failure the
 * spare stays lent. */
void kvhi_host_spare_repay(kvh_engine *e, uint32_t b);

/* Makes room in the host tier for the spare while it is lent, and gives
 * it back (core/evict.c). May drop the lock; a failure leaves it lent and
 * no error behind. */
void kvhi_host_spare_pay_back(kvh_engine *e, uint32_t for_agent);

/* A host slot being released: true when it became the spare instead
 * (the spare was lent). */
static inline bool kvhi_host_spare_refill(kvh_engine *e, uint32_t slot)
{
    if (!e->host_spare_lent)
        return false;
    e->host_spare_lent = false;
    e->host_spare = slot;
    return true;
}

#endif
