/* Tiers and eviction (core/evict.c): slot reservation by policy, agents
 * and their device quotas (core/engine.c, core/block.c). The moves
 * themselves are core/move.h. */
#ifndef KVH_CORE_TIER_H
#define KVH_CORE_TIER_H

#include <stdbool.h>
#include <stdint.h>

#include "core/engine.h"

typedef struct kvhi_agent {
    uint32_t id;
    uint64_t quota_blocks; /* 0 = unlimited */
    uint64_t device_blocks;
    /* Device slots reserved for its blocks whose moves there have not
     * ended: counted against the quota, which moves running in parallel
     * would otherwise pass together. */
    uint64_t device_incoming;
    /* Its evictable device blocks, made when it first gets a quota (one
     * the size of the device tier: agents without quotas have none). */
    kvhi_lruk_heap heap;
} kvhi_agent;

kvhi_agent *kvhi_agent_get(kvh_engine *e, uint32_t id, bool create);
/* The agent, if it has a device quota and is at it (its blocks then make
 * room for its own in the device tier); else NULL. NULL for every agent
 * while this thread puts a block back where a failed call found it. */
kvhi_agent *kvhi_agent_at_quota(kvh_engine *e, uint32_t id);
bool kvhi_quota_exempt_set(bool exempt); /* returns the setting it replaces */

/* Gets a free slot in tier t, evicting by policy. The lock may be dropped
 * and retaken. `for_agent` applies that agent's device quota. */
kvh_status kvhi_reserve_slot(kvh_engine *e, uint32_t tier, uint32_t for_agent, uint32_t *slot);
uint8_t *kvhi_slot_addr(kvh_engine *e, uint32_t tier, uint32_t slot);
/* While this thread moves block b up for a prefetch (KVHI_NO_BLOCK: none),
 * a block may leave the device tier for it only if it ranks below b, as
 * kvh_prefetch promises: checked on every victim, also one picked again
 * after the lock was dropped, and on a tier swap. */
uint32_t kvhi_victim_ceiling_set(uint32_t b); /* returns the one it replaces */
/* Whether this thread is moving a block up for a prefetch. */
bool kvhi_victim_ceiling_active(void);
/* Whether v comes before b in the victim order's primary key (class,
 * hint priority or K-th access time), not by recency: two blocks hinted
 * alike do not displace each other (lock held). */
bool kvhi_ranks_below(kvh_engine *e, uint32_t v, uint32_t b);
/* Whether v may leave tier `tier` under this thread's ceiling (lock held). */
bool kvhi_victim_under_ceiling(kvh_engine *e, uint32_t tier, uint32_t v);
/* Whether room for b in `tier`, the memory tier just above its own on one
 * arena, would push a third block out of b's tier: `tier` is full (for
 * b's agent), its victim can go only into b's tier, and that is full with
 * no clean copy to give back. A swap then uses the slot b leaves instead
 * (lock held). */
bool kvhi_promotion_pushes_out_a_third(kvh_engine *e, uint32_t b, uint32_t tier);

#endif
