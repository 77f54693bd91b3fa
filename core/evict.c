/* Making room: slot reservation, victim choice, and what happens to the
 * victim (a demotion through core/move.c, or a drop). Runs with the
 * engine lock held; a demotion drops it while the victim is in flight. */
#include <string.h>

#include "core/block_state.h"
#include "core/engine.h"
#include "core/move.h"
#include "core/block.h"
#include "core/tier.h"
#include "core/context.h"
#include "core/disk_tier.h"
#include "core/remote_tier.h"
#include "core/migrate.h"

static _Thread_local uint32_t victim_ceiling = KVHI_NO_BLOCK;

uint32_t kvhi_victim_ceiling_set(uint32_t b)
{
    uint32_t was = victim_ceiling;
    victim_ceiling = b;
    return was;
}

bool kvhi_victim_ceiling_active(void) { return victim_ceiling != KVHI_NO_BLOCK; }

bool kvhi_ranks_below(kvh_engine *e, uint32_t v, uint32_t b)
{
    return kvhi_block_current_key(e, v).primary < kvhi_block_current_key(e, b).primary;
}

bool kvhi_victim_under_ceiling(kvh_engine *e, uint32_t tier, uint32_t v)
{
    return tier != KVH_TIER_DEVICE || victim_ceiling == KVHI_NO_BLOCK || kvhi_ranks_below(e, v, victim_ceiling);
}

static int tier_below(kvh_engine *e, uint32_t t)
{
    for (uint32_t u = t + 1; u < KVH_TIER_COUNT; u++)
        if (e->tiers[u].present)
            return (int)u;
    return -1;
}

/* Choose what leaves tier t. The last tier can only drop unreferenced
 * blocks, which sort first in the heap (class bit clear). */
static uint32_t pick_victim(kvh_engine *e, uint32_t t, kvhi_agent *quota_agent)
{
    kvhi_lruk_heap *h = quota_agent ? &quota_agent->heap : &e->tiers[t].heap;
    uint32_t v = kvhi_lruk_top_current(h, kvhi_block_current_key, e);
    if (v == KVHI_HEAP_NONE)
        return v;
    if (tier_below(e, t) < 0 && e->blocks[v].refs > 0)
        return KVHI_HEAP_NONE;
    return v;
}

/* Whether victim v of tier t is referenced while an unreferenced block of
 * t (of agent `of`, or any) is busy in a disk copy or an upload only until
 * it ends: that block is the better victim, worth waiting for. */
static bool waits_for_a_copy(kvh_engine *e, uint32_t t, uint32_t v, uint32_t of)
{
    return kvhi_block_referenced(e, &e->blocks[v], v) &&
           ((e->disk_copy_batches && kvhi_disk_copying_unreferenced(e, t, of)) ||
            (e->upload_busy && kvhi_remote_busy_unreferenced(e, t, of)));
}

bool kvhi_promotion_pushes_out_a_third(kvh_engine *e, uint32_t b, uint32_t tier)
{
    const kvhi_block *blk = &e->blocks[b];
    uint32_t from = blk->tier;
    /* With two arenas the slot b leaves stays its clean copy (core/
     * clean_copy.h), worth more than the block pushed out for it, and a
     * swap would cost a third copy; on one arena nothing is copied. */
    if (!e->moves_in_place || from == KVH_TIER_DISK || tier >= from || tier_below(e, tier) != (int)from)
        return false;
    if (e->release_backlog_len)
        kvhi_block_releases_apply(e);
    kvhi_agent *qa = tier == KVH_TIER_DEVICE && e->n_agents ? kvhi_agent_at_quota(e, blk->agent) : NULL;
    if ((!qa && e->tiers[tier].slots.free_count) || e->tiers[from].slots.free_count ||
        (from == KVH_TIER_HOST && e->clean.count))
        return false;
    uint32_t v = pick_victim(e, tier, qa);
    if (v == KVHI_HEAP_NONE || v == b || !kvhi_victim_under_ceiling(e, tier, v))
        return false;
    /* kvhi_reserve_slot waits for such a copy rather than send v down. */
    return !waits_for_a_copy(e, tier, v, qa ? blk->agent : KVHI_NO_BLOCK);
}

/* Whether blk is a live block no thread is moving, copying, pinning or
 * holding: one that may leave its tier now. */
static bool free_to_leave(const kvhi_block *blk)
{
    return (blk->flags & (KVHI_BF_LIVE | KVHI_BF_DEAD)) == KVHI_BF_LIVE && !kvhi_block_busy(blk) && !blk->pins &&
           !blk->holds;
}

/* Moves victim v (of tier `from`) down to tier `to`, handing its slot to
 * *freed. KVH_ERR_NOSPACE when `to` has no room or fails its writes and v
 * may still try elsewhere: *still_here then says whether v is still an
 * idle, unprotected block of `from` (the move may have dropped the lock,
 * and another thread pinned, held, moved or freed it meanwhile). */
static kvh_status leave_to(kvh_engine *e, uint32_t v, uint32_t from, uint32_t to, uint32_t *freed, bool *still_here)
{
    kvhi_block *blk = &e->blocks[v];
    kvh_status st = kvhi_move_handing_over(e, v, to, freed);
    if (st == KVH_OK) {
        e->stats.evictions++;
        return KVH_OK;
    }
    /* A disk that fails writes is treated like a full one; a victim
     * another call started moving is looked at afresh (*still_here). */
    if (st == KVH_ERR_IO || st == KVH_ERR_BUSY)
        st = KVH_ERR_NOSPACE;
    *still_here = free_to_leave(blk) && blk->tier == from;
    return st;
}

/* Frees b's slot in its tier, by demotion or (unreferenced) by dropping;
 * the freed slot is handed to the caller. *changed: failed with
 * KVH_ERR_NOSPACE because v changed while the lock was dropped (another
 * victim may do). */
static kvh_status evict_one(kvh_engine *e, uint32_t v, uint32_t *freed, bool *changed)
{
    kvhi_block *blk = &e->blocks[v];
    uint32_t from = blk->tier;
    int below = tier_below(e, from);
    bool still_here = true;
    kvh_status st = KVH_ERR_NOSPACE;
    if (below >= 0)
        st = leave_to(e, v, from, (uint32_t)below, freed, &still_here);
    /* A victim can still leave past a full tier below (the host tier
     * full of pinned or held blocks) straight to the disk: onto its clean
     * disk copy without I/O, or written there. Dropped instead, it would
     * lose a persisted copy, or KV still referenced, while the disk has
     * room. */
    if (st == KVH_ERR_NOSPACE && still_here && below >= 0 && below != KVH_TIER_DISK && e->disk)
        st = leave_to(e, v, from, KVH_TIER_DISK, freed, &still_here);
    if (st != KVH_ERR_NOSPACE)
        return st;
    *changed = !still_here;
    if (!still_here)
        return kvhi_fail(KVH_ERR_NOSPACE, "no tier below had room for a victim, which another thread then pinned, "
                                          "held, moved or freed");
    if (blk->refs > 0)
        return kvhi_fail(KVH_ERR_NOSPACE, "no tier below can take a referenced block");
    if (blk->flags & KVHI_BF_PREFETCHED)
        e->stats.prefetch_wasted++;
    *freed = kvhi_block_drop(e, v);
    e->stats.drops++;
    return KVH_OK;
}

/* The block of memory tier t that can leave for the disk tier below it
 * without I/O and without a disk slot (its clean disk copy takes it
 * back), when the heap's top cannot leave: with the disk full of
 * referenced blocks, such blocks are the only room t can still make.
 * Evictable only (idle, unpinned, unheld); an agent at its quota (agent
 * not KVHI_NO_BLOCK) gives one of its own. The first in the victim order
 * (hints, class, recency) of them; KVHI_HEAP_NONE if none. */
static uint32_t victim_with_disk_copy(kvh_engine *e, uint32_t t, uint32_t agent)
{
    if (tier_below(e, t) != KVH_TIER_DISK)
        return KVHI_HEAP_NONE;
    uint32_t best = KVHI_HEAP_NONE;
    kvhi_lruk_key best_key = {0, 0};
    for (uint64_t i = 0; i < e->disk_copy_count; i++) {
        uint32_t b = e->disk_copy_list[i];
        const kvhi_block *blk = &e->blocks[b];
        if (blk->tier != t || !free_to_leave(blk) || (agent != KVHI_NO_BLOCK && blk->agent != agent))
            continue;
        kvhi_lruk_key key = kvhi_block_current_key(e, b);
        if (best == KVHI_HEAP_NONE || kvhi_lruk_less(&key, &best_key)) {
            best = b;
            best_key = key;
        }
    }
    return best;
}

/* After an eviction made slot free for for_agent: true when the agent is
 * at its device quota now, the slot then given back. It may be at its
 * quota still (lowered below what it holds), or have reached it while the
 * victim's move had the lock dropped, by another thread's move for it;
 * one of its own blocks leaves instead, rather than a swap that keeps it
 * over the quota for good. */
static bool gave_back_over_quota(kvh_engine *e, uint32_t tier, uint32_t for_agent, uint32_t slot)
{
    if (tier != KVH_TIER_DEVICE || !e->n_agents || !kvhi_agent_at_quota(e, for_agent))
        return false;
    kvhi_slot_pool_free(&e->tiers[tier].slots, slot);
    return true;
}

/* Set while this thread makes room to pay the host tier's spare back. */
static _Thread_local bool repaying_spare;

void kvhi_host_spare_pay_back(kvh_engine *e, uint32_t for_agent)
{
    if (!e->host_spare_lent || repaying_spare)
        return;
    /* The caller's own reason for a failure stays its last error. */
    kvhi_error_kept why;
    kvhi_error_keep(&why);
    uint32_t spare;
    repaying_spare = true;
    if (kvhi_reserve_slot(e, KVH_TIER_HOST, for_agent, &spare) == KVH_OK)
        kvhi_release_slot(e, KVH_TIER_HOST, spare); /* the spare, unless paid back meanwhile */
    repaying_spare = false;
    kvhi_error_put_back(&why);
}

kvh_status kvhi_reserve_slot(kvh_engine *e, uint32_t tier, uint32_t for_agent, uint32_t *slot)
{
    kvhi_assert_locked(e);
    kvhi_tier *t = &e->tiers[tier];
    if (!t->present)
        return kvhi_fail(KVH_ERR_NOSPACE, "tier %u is not configured", tier);
    /* The spare lent to a block that kept its disk copy is paid back by
     * the next room the host tier makes (core/host_spare.h): from its
     * free slots when the caller still finds one (no eviction, so the
     * lock stays held as it would have), else by an eviction beside the
     * caller's own. */
    if (tier == KVH_TIER_HOST && e->host_spare_lent && !repaying_spare) {
        uint32_t spare;
        if (t->slots.free_count >= 2 && kvhi_slot_pool_alloc(&t->slots, &spare) == 0)
            kvhi_release_slot(e, tier, spare);
        else if (t->slots.free_count == 0)
            kvhi_host_spare_pay_back(e, for_agent);
    }
    struct timespec queued_deadline = {0, 0};
    for (int attempt = 0; attempt < 1000000; attempt++) {
        /* Releases that returned while the lock was dropped, not yet
         * applied: their blocks may be the room, or the victim. */
        if (e->release_backlog_len)
            kvhi_block_releases_apply(e);
        kvhi_agent *qa = tier == KVH_TIER_DEVICE && e->n_agents ? kvhi_agent_at_quota(e, for_agent) : NULL;
        if (!qa && kvhi_slot_pool_alloc(&t->slots, slot) == 0)
            return KVH_OK;
        /* Clean host copies of device blocks are spare room: taken back
         * first, with nothing to write (core/clean_copy.h). */
        if (tier == KVH_TIER_HOST && kvhi_clean_reclaim(e, slot))
            return KVH_OK;
        /* Clean model weights kept in host memory go next: they can be
         * read from their file again, where a block would need a write. */
        if (tier == KVH_TIER_HOST && kvhi_drop_clean_host_region(e, false))
            continue;
        uint32_t v = pick_victim(e, tier, qa);
        /* Unreferenced blocks leave before referenced ones (kvh.h). One
         * busy while its disk copy is written, or while an upload copies
         * it, is out of the order only until the copy ends: wait for it
         * rather than send a referenced block down in its place. */
        uint32_t of = qa ? for_agent : KVHI_NO_BLOCK;
        if (v != KVHI_HEAP_NONE && waits_for_a_copy(e, tier, v, of) && !repaying_spare) {
            e->victim_copy_waits++;
            pthread_cond_wait(&e->changed, &e->lock);
            continue;
        }
        /* A full disk has clean copies of blocks in memory: those of
         * unreferenced blocks are room, like unreferenced disk blocks. */
        if (v == KVHI_HEAP_NONE && tier == KVH_TIER_DISK && kvhi_disk_give_back_copy(e))
            continue;
        /* Paying the spare back is done with the room there is now: it
         * never waits for room to appear. */
        if (repaying_spare && v == KVHI_HEAP_NONE)
            return kvhi_fail(KVH_ERR_NOSPACE, "no room now to pay the host tier's spare back");
        /* Moves of its blocks up to memory, queued, free slots when a
         * worker runs them: not yet "no space" either (bounded). */
        if (v == KVHI_HEAP_NONE && tier == KVH_TIER_DISK && e->n_jobs &&
            kvhi_wait_queued_moves_out(e, tier, &queued_deadline))
            continue;
        if (v == KVHI_HEAP_NONE && e->copies_in_progress) {
            /* Blocks of this tier may be busy in a copy: room can appear
             * when it ends, so this is not yet "no space". */
            pthread_cond_wait(&e->changed, &e->lock);
            continue;
        }
        if (v == KVHI_HEAP_NONE) {
            if (qa)
                return kvhi_fail(KVH_ERR_NOSPACE, "agent %u is at its device quota and none of its blocks can leave",
                                 for_agent);
            return kvhi_fail(KVH_ERR_NOSPACE, "%s tier full: every block is pinned, held or in flight%s",
                             tier == KVH_TIER_DEVICE ? "device"
                             : tier == KVH_TIER_HOST ? "host"
                                                     : "disk",
                             tier_below(e, tier) < 0 ? ", or still referenced with no tier below" : "");
        }
        if (!kvhi_victim_under_ceiling(e, tier, v))
            return kvhi_fail(KVH_ERR_NOSPACE, "no device block ranks below the prefetched one");
        bool changed = false;
        kvh_status st = evict_one(e, v, slot, &changed);
        if (st == KVH_OK && gave_back_over_quota(e, tier, for_agent, *slot))
            continue;
        if (st == KVH_OK)
            return KVH_OK;
        if (st != KVH_ERR_NOSPACE)
            return st;
        /* The victim was pinned, held, moved or freed by another thread
         * while its move had the lock dropped: the tier is looked at
         * afresh (bounded by the attempts). */
        if (changed)
            continue;
        /* The lock may have been dropped: the block is looked up afresh. */
        uint32_t c = victim_with_disk_copy(e, tier, of);
        if (c != KVHI_HEAP_NONE && kvhi_victim_under_ceiling(e, tier, c) && evict_one(e, c, slot, &changed) == KVH_OK) {
            if (gave_back_over_quota(e, tier, for_agent, *slot))
                continue;
            return KVH_OK;
        }
        /* The victim could not leave (everything below is referenced and
         * full): nothing else in this tier can either. */
        return kvhi_fail(KVH_ERR_NOSPACE, "no room below the %s tier for its least valuable block%s",
                         tier == KVH_TIER_DEVICE ? "device" : "host",
                         kvhi_disk_tier_full(e) ? " (the disk tier is full, of blocks still referenced: release "
                                                  "blocks, or give it more room)"
                                                : "");
    }
    return kvhi_fail(KVH_ERR_NOSPACE, "could not make room");
}
