/* Every move of a block between tiers: the two halves of a transfer
 * (begin: reserve and mark in flight; commit or undo: kvhi_move_end),
 * the synchronous move built from them, demotion to an existing clean
 * disk copy, the swap of two blocks when both tiers are full, and the
 * move counters. Victim choice is evict.c's; the transfer itself (copy,
 * codec, disk I/O) is kvhi_xfer_run's. Lock held on entry and exit of
 * every function; those that say so drop it for the copy. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "core/block_state.h"
#include "core/engine.h"
#include "core/move.h"
#include "core/block.h"
#include "core/tier.h"
#include "core/disk_tier.h"
#include "core/codec_tier.h"
#include "core/remote_tier.h"

static enum kvhi_copy_kind copy_kind(kvh_engine *e, uint32_t dst_tier, uint32_t src_tier)
{
    bool dst_dev = dst_tier == KVH_TIER_DEVICE && !e->device_host_addressable;
    bool src_dev = src_tier == KVH_TIER_DEVICE && !e->device_host_addressable;
    if (dst_dev && src_dev)
        return KVHI_COPY_DEVICE_TO_DEVICE;
    if (dst_dev)
        return KVHI_COPY_HOST_TO_DEVICE;
    if (src_dev)
        return KVHI_COPY_DEVICE_TO_HOST;
    return KVHI_COPY_HOST_TO_HOST;
}

int kvhi_copy_bytes(kvh_engine *e, uint32_t dst_tier, void *dst, uint32_t src_tier, const void *src, size_t n)
{
    enum kvhi_copy_kind kind = copy_kind(e, dst_tier, src_tier);
    if (kind == KVHI_COPY_HOST_TO_HOST) {
        memcpy(dst, src, n);
        return 0;
    }
    char msg[256];
    return e->backend->copy(e->backend_ctx, dst, src, n, kind, msg, sizeof(msg));
}

static void count_move(kvh_engine *e, uint32_t from, uint32_t to)
{
    /* Device <-> disk passes through host staging: count both legs. */
    if (from == KVH_TIER_DEVICE && to == KVH_TIER_DISK) {
        count_move(e, KVH_TIER_DEVICE, KVH_TIER_HOST);
        from = KVH_TIER_HOST;
    } else if (from == KVH_TIER_DISK && to == KVH_TIER_DEVICE) {
        count_move(e, KVH_TIER_DISK, KVH_TIER_HOST);
        from = KVH_TIER_HOST;
    }
    /* Moves to and from disk count what is written and read there: the
     * stored form (encoded under a kv_codec), as disk copies do. */
    uint64_t bytes = (from == KVH_TIER_DISK || to == KVH_TIER_DISK) && e->disk ? e->disk->block_bytes : e->block_bytes;
    if (from == KVH_TIER_DEVICE && to == KVH_TIER_HOST) {
        e->stats.blocks_device_to_host++;
        e->stats.bytes_device_to_host += bytes;
    } else if (from == KVH_TIER_HOST && to == KVH_TIER_DEVICE) {
        e->stats.blocks_host_to_device++;
        e->stats.bytes_host_to_device += bytes;
    } else if (from == KVH_TIER_HOST && to == KVH_TIER_DISK) {
        e->stats.blocks_host_to_disk++;
        e->stats.bytes_host_to_disk += bytes;
    } else if (from == KVH_TIER_DISK && to == KVH_TIER_HOST) {
        e->stats.blocks_disk_to_host++;
        e->stats.bytes_disk_to_host += bytes;
    }
}

/* Exchanges the bytes of slot hi (tier) and slot lo (lo_tier) through a
 * bounce buffer; lock held, dropped for the copies. */
static kvh_status trade_contents(kvh_engine *e, uint32_t tier, uint32_t hi_slot, uint32_t lo_tier, uint32_t lo_slot)
{
    /* The bounce buffer holds the upper block in the lower tier's form. */
    uint8_t *bounce = malloc(e->tiers[lo_tier].slot_bytes);
    if (!bounce)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for a bounce buffer");
    uint8_t *hi = kvhi_slot_addr(e, tier, hi_slot), *lo = kvhi_slot_addr(e, lo_tier, lo_slot);
    size_t lo_bytes = e->tiers[lo_tier].slot_bytes;
    kvhi_unlock_for_copy(e);
    /* Each step that fails is undone, so that both blocks keep their own
     * bytes in their own slots: the upper block's are in the bounce
     * buffer from the first step on, the lower block's in its slot until
     * the last, then in the upper slot. */
    bool undone = true;
    int rc = kvhi_block_copy(e, lo_tier, bounce, tier, hi);
    if (rc == 0) {
        rc = kvhi_block_copy(e, tier, hi, lo_tier, lo);
        if (rc != 0)
            undone = kvhi_block_copy(e, tier, hi, lo_tier, bounce) == 0;
        else if ((rc = kvhi_copy_bytes(e, lo_tier, lo, lo_tier, bounce, lo_bytes)) != 0)
            undone =
                kvhi_block_copy(e, lo_tier, lo, tier, hi) == 0 && kvhi_block_copy(e, tier, hi, lo_tier, bounce) == 0;
    }
    kvhi_relock_after_copy(e);
    free(bounce);
    if (rc == 0)
        return KVH_OK;
    if (!undone)
        kvhi_log_later(e, KVH_LOG_ERROR,
                       "a tier swap failed and could not be undone: slot %u of tier %u and slot %u "
                       "of tier %u may hold mixed data",
                       hi_slot, tier, lo_slot, lo_tier);
    return kvhi_fail(KVH_ERR_IO, "copy during a tier swap failed%s", undone ? "" : " and could not be undone");
}

/* Promotion when both tiers are full of referenced blocks: b (in a lower
 * memory tier) trades places with the upper tier's least valuable block,
 * in place on one arena, else through a bounce buffer. Without this, a full hierarchy could not bring
 * a block up even though it only needs to exchange two slots. */
static kvh_status swap_up(kvh_engine *e, uint32_t b, uint32_t tier)
{
    kvhi_block *bb = &e->blocks[b];
    kvhi_lruk_heap *heap = &e->tiers[tier].heap;
    /* An agent at its quota trades places with one of its own blocks. */
    kvhi_agent *a = tier == KVH_TIER_DEVICE ? kvhi_agent_at_quota(e, bb->agent) : NULL;
    if (a)
        heap = &a->heap;
    uint32_t v = kvhi_lruk_top_current(heap, kvhi_block_current_key, e);
    if (v == KVHI_HEAP_NONE || v == b || bb->tier == KVH_TIER_DISK || !kvhi_victim_under_ceiling(e, tier, v)) {
        if (a) /* the tier may have free slots: the quota is what is full */
            return kvhi_fail(KVH_ERR_NOSPACE, "agent %u is at its device quota and none of its blocks can leave",
                             bb->agent);
        return kvhi_fail(KVH_ERR_NOSPACE, "no block in the target tier can make room");
    }
    /* Trading contents would overwrite b's slot under its reader, or
     * under the clean disk copy being written from it (the copy would
     * take the other block's bytes, with a CRC that vouches for them). */
    if ((e->block_readers[b] || kvhi_block_copying(bb)) && !e->moves_in_place)
        return kvhi_fail(KVH_ERR_NOSPACE, "no free slot in the target tier for a block being read or copied (a "
                                          "swap would overwrite it meanwhile)");
    kvhi_block *vb = &e->blocks[v];
    kvhi_clean_drop(e, v); /* v takes b's place below: a kept copy would be a second slot */
    uint32_t lo_tier = bb->tier, lo_slot = bb->slot, hi_slot = vb->slot;
    kvhi_block_move_event(vb, KVHI_EV_MOVE_BEGIN);
    kvhi_block_update_evictable(e, v); /* out of the old tier's heaps */
    /* One arena: each block keeps its bytes and slot, nothing is copied
     * and the lock stays held. Otherwise the bytes trade slots, and so do
     * the blocks. */
    uint32_t v_slot = hi_slot, b_slot = lo_slot;
    kvh_status st = KVH_OK;
    if (!e->moves_in_place) {
        st = trade_contents(e, tier, hi_slot, lo_tier, lo_slot);
        v_slot = lo_slot, b_slot = hi_slot;
    }
    kvhi_block_move_event(vb, KVHI_EV_MOVE_END);
    pthread_cond_broadcast(&e->changed);
    if (st != KVH_OK) {
        /* Freed while its bytes were being traded: reaped now, as a move's
         * end would. */
        if (vb->flags & KVHI_BF_DEAD)
            kvhi_block_free_now(e, v);
        else
            kvhi_block_update_evictable(e, v);
        return st;
    }
    if (vb->flags & KVHI_BF_PREFETCHED) {
        e->stats.prefetch_wasted++;
        vb->flags &= (uint16_t)~KVHI_BF_PREFETCHED;
    }
    kvhi_slot_check_vacate(&e->tiers[lo_tier].slots, lo_slot);
    kvhi_slot_check_vacate(&e->tiers[tier].slots, hi_slot);
    kvhi_block_place(e, v, lo_tier, v_slot);
    kvhi_block_place(e, b, tier, b_slot);
    if (e->moves_in_place) {
        e->stats.blocks_moved_in_place += 2;
    } else {
        count_move(e, tier, lo_tier);
        count_move(e, lo_tier, tier);
    }
    e->stats.evictions++;
    if (vb->flags & KVHI_BF_DEAD)
        kvhi_block_free_now(e, v);
    else
        kvhi_block_update_evictable(e, v);
    return KVH_OK;
}

/* A block with a clean disk copy leaves memory without any I/O. */
static kvh_status demote_to_copy(kvh_engine *e, uint32_t b, uint32_t *src_slot_out)
{
    kvhi_block *blk = &e->blocks[b];
    uint32_t src_tier = blk->tier, src_slot = blk->slot;
    kvhi_clean_drop(e, b); /* on disk, b holds no host slot */
    if (blk->flags & KVHI_BF_PREFETCHED) {
        e->stats.prefetch_wasted++;
        blk->flags &= (uint16_t)~KVHI_BF_PREFETCHED;
    }
    kvhi_block_move_event(blk, KVHI_EV_MOVE_BEGIN);
    kvhi_block_update_evictable(e, b); /* out of the old tier's heaps */
    kvhi_block_place(e, b, KVH_TIER_DISK, kvhi_disk_copy_clear(e, b));
    kvhi_block_move_event(blk, KVHI_EV_MOVE_END);
    if (src_slot_out)
        *src_slot_out = src_slot;
    else
        kvhi_release_slot(e, src_tier, src_slot);
    kvhi_block_update_evictable(e, b);
    if (blk->flags & KVHI_BF_PUBLISHED)
        kvhi_remote_queue_upload(e, b, KVH_REMOTE_UPLOAD_DEMOTE);
    return KVH_OK;
}

/* b goes down to the host tier where it kept a clean copy, and may go now
 * (a disk copy being written from its device slot waits for a copy). */
static bool demotes_to_clean_copy(kvh_engine *e, uint32_t b, uint32_t tier)
{
    const kvhi_block *blk = &e->blocks[b];
    return tier == KVH_TIER_HOST && blk->tier == KVH_TIER_DEVICE && e->clean.slot_of &&
           e->clean.slot_of[b] != KVHI_NO_BLOCK && !kvhi_block_busy(blk);
}

/* Records that b's disk data failed verification: it is never served. */
kvh_status kvhi_mark_corrupt(kvh_engine *e, uint32_t b, const char *why)
{
    kvhi_assert_locked(e);
    kvhi_block *blk = &e->blocks[b];
    e->stats.corrupt_blocks++;
    blk->flags |= KVHI_BF_CORRUPT;
    if (blk->flags & KVHI_BF_PUBLISHED) {
        kvhi_prefix_erase(&e->prefix, blk->hash, b);
        blk->flags &= (uint16_t)~KVHI_BF_PUBLISHED;
    }
    if (blk->flags & KVHI_BF_JOURNALED) {
        kvhi_disk_forget(e, b);
    }
    kvhi_log_later(e, KVH_LOG_WARN, "disk tier: dropped block in slot %u: %s", blk->slot, why ? why : "unreadable");
    return kvhi_fail(KVH_ERR_CORRUPT, "block data on disk failed verification: %s", why ? why : "unreadable");
}

/* First half of a move: reserves the destination and marks b in flight.
 * Returns 0 with x prepared (run the transfer without the lock, then call
 * kvhi_move_end), 1 when nothing is left to transfer, or a negative
 * status with b unchanged. */
int kvhi_move_begin(kvh_engine *e, uint32_t b, uint32_t tier, kvhi_xfer *x, bool keep_src_for_caller)
{
    kvhi_assert_locked(e);
    kvhi_block *blk = &e->blocks[b];
    if (blk->tier == tier)
        return 1;
    if (blk->flags & KVHI_BF_CORRUPT)
        return kvhi_fail(KVH_ERR_CORRUPT, "block data on disk failed verification");
    /* Another call's move owns the block (its copy runs with the lock
     * dropped): a second move would release or hand over the same source
     * slot twice, and two blocks would share it. Callers wait first
     * (kvhi_block_wait_movable); this refuses rather than corrupt. */
    if (kvhi_move_next(kvhi_move_state(blk), KVHI_EV_MOVE_BEGIN) == KVHI_MS_COUNT)
        return kvhi_fail(KVH_ERR_BUSY, "the block is being moved by another call");
    if (tier == KVH_TIER_DISK && (blk->flags & KVHI_BF_DISK_COPY)) {
        demote_to_copy(e, b, NULL);
        return 1;
    }
    if (demotes_to_clean_copy(e, b, tier)) {
        kvhi_clean_demote(e, b, NULL);
        return 1;
    }
    /* Going anywhere else, b would hold a second host slot. */
    kvhi_clean_drop(e, b);
    uint32_t src_tier = blk->tier;
    kvhi_block_move_event(blk, KVHI_EV_MOVE_BEGIN);
    kvhi_block_update_evictable(e, b);
    /* Room made by eviction would push a third block out of b's tier,
     * which b's own move then leaves with a free slot: trade places. */
    bool trade = !keep_src_for_caller && kvhi_promotion_pushes_out_a_third(e, b, tier);
    uint32_t dslot;
    /* Only a read into the host tier's spare can follow a failed
     * reservation (core/host_spare.h). */
    bool may_take_spare =
        !trade && tier == KVH_TIER_HOST && src_tier == KVH_TIER_DISK && !keep_src_for_caller && e->host_spare_wanted;
    kvhi_error_kept before;
    if (may_take_spare)
        kvhi_error_keep(&before);
    kvh_status st = trade ? swap_up(e, b, tier) : kvhi_reserve_slot(e, tier, blk->agent, &dslot);
    /* Every tier full: a trade with the disk through the spare. The lock
     * may have been dropped: b is looked at afresh. */
    bool into_spare =
        st == KVH_ERR_NOSPACE && may_take_spare && !(blk->flags & KVHI_BF_DEAD) && kvhi_host_spare_take(e, b, &dslot);
    if (into_spare) {
        st = KVH_OK;
        kvhi_error_put_back(&before); /* reserve_slot's reason no longer holds */
    }
    if (st == KVH_OK && !trade) {
        kvhi_xfer_prepare(e, b, tier, dslot, x);
        x->into_spare = into_spare;
        kvhi_agent *a = tier == KVH_TIER_DEVICE && e->n_agents ? kvhi_agent_get(e, blk->agent, false) : NULL;
        x->incoming = a != NULL;
        x->agent = blk->agent;
        if (a)
            a->device_incoming++;
        if (e->moves_in_place && src_tier != KVH_TIER_DISK && tier != KVH_TIER_DISK) {
            /* One arena: the block keeps its bytes and slot and changes
             * tier; the slot just reserved goes to the source tier in
             * exchange, so both tiers keep their number of slots. */
            x->dst_slot = x->src_slot;
            x->src_slot = dslot;
            x->in_place = true;
        }
        /* A demotion whose source slot nobody else is promised can still
         * be called off by an acquire while its write runs. */
        if (tier == KVH_TIER_DISK && !keep_src_for_caller)
            kvhi_block_move_event(blk, KVHI_EV_RECALLABLE);
        return 0;
    }
    kvhi_block_move_event(blk, KVHI_EV_MOVE_END);
    pthread_cond_broadcast(&e->changed);
    /* A trade with a block on disk would need a bounce buffer for the
     * block whose slot is written first: not made, so reserve_slot's
     * reason stands. */
    if (st == KVH_ERR_NOSPACE && !trade && tier < src_tier && src_tier != KVH_TIER_DISK && !keep_src_for_caller &&
        !(blk->flags & KVHI_BF_DEAD)) {
        kvhi_block_move_event(blk, KVHI_EV_MOVE_BEGIN);
        st = swap_up(e, b, tier);
        kvhi_block_move_event(blk, KVHI_EV_MOVE_END);
        pthread_cond_broadcast(&e->changed);
    }
    if ((blk->flags & KVHI_BF_DEAD) || ((blk->flags & KVHI_BF_CORRUPT) && blk->refs == 0))
        kvhi_block_free_now(e, b);
    else
        kvhi_block_update_evictable(e, b);
    return st == KVH_OK ? 1 : st;
}

/* Second half: commits a finished transfer (or undoes a failed one). */
kvh_status kvhi_move_end(kvh_engine *e, kvhi_xfer *x, uint32_t *src_slot_out)
{
    kvhi_assert_locked(e);
    uint32_t b = x->block;
    kvhi_block *blk = &e->blocks[b];
    uint32_t src_tier = x->src_tier, src_slot = x->src_slot, tier = x->dst_tier;
    bool recalled = kvhi_move_state(blk) == KVHI_MS_RECALLED;
    if (x->incoming) {
        kvhi_agent *a = kvhi_agent_get(e, x->agent, false);
        if (a && a->device_incoming)
            a->device_incoming--;
        x->incoming = false;
    }
    kvhi_block_move_event(blk, KVHI_EV_MOVE_END);
    pthread_cond_broadcast(&e->changed);
    if (recalled && x->err == 0) {
        kvhi_disk_keep_as_copy(e, b, x);
        if (blk->flags & KVHI_BF_DEAD)
            kvhi_block_free_now(e, b);
        else
            kvhi_block_update_evictable(e, b);
        return KVH_OK;
    }
    if (x->err != 0) {
        kvh_status st;
        kvhi_release_slot(e, tier, x->dst_slot);
        if (tier == KVH_TIER_DISK)
            kvhi_disk_note_write(e, x->err);
        if (x->err == 1)
            st = kvhi_mark_corrupt(e, b, x->why);
        else
            st = kvhi_fail(kvhi_io_status(x->err), "moving a block between tiers: %s", strerror(-x->err));
        if ((blk->flags & KVHI_BF_DEAD) || ((blk->flags & KVHI_BF_CORRUPT) && blk->refs == 0))
            kvhi_block_free_now(e, b);
        else
            kvhi_block_update_evictable(e, b);
        return st;
    }
    if (src_tier == KVH_TIER_DEVICE && (blk->flags & KVHI_BF_PREFETCHED)) {
        e->stats.prefetch_wasted++;
        blk->flags &= (uint16_t)~KVHI_BF_PREFETCHED;
    }
    if (tier == KVH_TIER_DISK)
        kvhi_disk_note_write(e, 0);
    /* Read back from disk, a block usually keeps its slot there as a
     * clean copy: nothing for the cleaner, and no worker to wake for it
     * on every restore into a full host tier. */
    bool restored = src_tier == KVH_TIER_DISK && tier == KVH_TIER_HOST;
    if (restored)
        kvhi_block_place_unled(e, b, tier, x->dst_slot);
    else
        kvhi_block_place(e, b, tier, x->dst_slot);
    if (x->in_place)
        e->stats.blocks_moved_in_place++;
    else
        count_move(e, src_tier, tier);
    bool keep_src = false;
    if (e->disk && (tier == KVH_TIER_DISK || src_tier == KVH_TIER_DISK))
        kvhi_disk_after_move(e, b, x, &keep_src);
    if (restored && !keep_src) {
        kvhi_block_host_arrived(e, b);
    } else if (restored) {
        /* Its pay to the hand is spent when a worker looks: one is woken
         * every few promotions, not for each. */
        kvhi_disk_clean_pay(e);
        if (++e->clean_pays_unwoken >= KVHI_CLEAN_PAYS_PER_WAKE && e->n_workers && kvhi_disk_host_runs_low(e)) {
            e->clean_pays_unwoken = 0;
            pthread_cond_signal(&e->work_ready);
        }
    }
    if (keep_src)
        ; /* the old disk slot is now b's clean copy */
    else if (src_slot_out)
        *src_slot_out = src_slot;
    else if (kvhi_block_copying(blk)) {
        /* A disk copy is still being read from the old slot. */
        blk->deferred_slot = src_slot;
        blk->deferred_tier = (uint8_t)src_tier;
    } else if (x->in_place)
        kvhi_release_slot(e, src_tier, src_slot); /* b kept its bytes; the slot traded is empty */
    else if (src_tier == KVH_TIER_HOST && tier == KVH_TIER_DEVICE && kvhi_clean_keep(e, b, src_slot))
        ; /* the old host slot is now b's clean copy */
    else
        kvhi_block_release_source(e, b, src_tier, src_slot); /* a holder may still read it */
    /* Its disk slot is free now: the host tier's victim goes there. */
    if (x->into_spare && !(blk->flags & KVHI_BF_DEAD))
        kvhi_host_spare_repay(e, b);
    if (blk->flags & KVHI_BF_DEAD)
        kvhi_block_free_now(e, b);
    else
        kvhi_block_update_evictable(e, b);
    return KVH_OK;
}

kvh_status kvhi_move_handing_over(kvh_engine *e, uint32_t b, uint32_t tier, uint32_t *src_slot_out)
{
    kvhi_assert_locked(e);
    kvhi_block *blk = &e->blocks[b];
    if (src_slot_out && kvhi_block_busy(blk))
        return kvhi_fail(KVH_ERR_BUSY, "a victim is being moved or copied by another call");
    if (src_slot_out && tier == KVH_TIER_DISK && (blk->flags & KVHI_BF_DISK_COPY))
        return demote_to_copy(e, b, src_slot_out);
    if (src_slot_out && demotes_to_clean_copy(e, b, tier)) {
        kvhi_clean_demote(e, b, src_slot_out);
        return KVH_OK;
    }
    kvhi_xfer x;
    int rc = kvhi_move_begin(e, b, tier, &x, src_slot_out != NULL);
    if (rc != 0)
        return rc == 1 ? KVH_OK : rc;
    kvhi_unlock_for_copy(e);
    kvhi_xfer_run(e, &x);
    kvhi_relock_after_copy(e);
    return kvhi_move_end(e, &x, src_slot_out);
}

/* Whether b is still the live, idle block of generation gen in tier. */
static bool idle_in(const kvhi_block *blk, uint32_t gen, uint32_t tier)
{
    return blk->gen == gen && (blk->flags & (KVHI_BF_LIVE | KVHI_BF_DEAD)) == KVHI_BF_LIVE && blk->tier == tier &&
           !kvhi_block_busy(blk) && !blk->pins;
}

kvh_status kvhi_move_block(kvh_engine *e, uint32_t b, uint32_t tier, uint32_t for_agent)
{
    (void)for_agent; /* b's own agent is charged */
    kvhi_block *blk = &e->blocks[b];
    uint32_t gen = blk->gen;
    /* Only a trade through the spare can follow a failed first try (the
     * spare may be lent now and paid back by the time it fails). */
    bool may_trade = tier == KVH_TIER_DEVICE && e->host_spare_wanted && blk->tier == KVH_TIER_DISK;
    kvhi_error_kept before;
    if (may_trade)
        kvhi_error_keep(&before);
    kvh_status st = kvhi_move_handing_over(e, b, tier, NULL);
    /* Every tier full: a block on disk comes up through the host tier's
     * spare (core/host_spare.h), then trades places with a device block.
     * The lock was dropped: b is looked at afresh. */
    if (!may_trade || st != KVH_ERR_NOSPACE || e->host_spare == KVHI_NO_BLOCK || !idle_in(blk, gen, KVH_TIER_DISK))
        return st;
    kvhi_error_kept why;
    kvhi_error_keep(&why);
    kvh_status up = kvhi_move_handing_over(e, b, KVH_TIER_HOST, NULL);
    if (up != KVH_OK && up != KVH_ERR_NOSPACE)
        return up; /* the read failed: its reason is the one to give */
    if (up == KVH_OK && idle_in(blk, gen, KVH_TIER_HOST)) {
        if ((st = kvhi_move_handing_over(e, b, KVH_TIER_DEVICE, NULL)) == KVH_OK)
            kvhi_error_put_back(&before); /* the first try's reason no longer holds */
        return st;
    }
    kvhi_error_put_back(&why); /* the first try's reason stands */
    return st;
}

/* Brings a block that lives on disk into a memory tier and waits until it
 * is there: the host tier when there is one and it can make room, else
 * the device tier (a free device slot must not go unused while the host
 * tier is full of pinned or held blocks). Drops the lock. */
kvh_status kvhi_block_ensure_memory(kvh_engine *e, uint32_t b)
{
    kvhi_assert_locked(e);
    kvhi_block *blk = &e->blocks[b];
    /* A block in flight may be half of a tier swap: its slot is being
     * overwritten, so wait until it settles. */
    kvhi_block_recall(e, b); /* no write-then-read-back of a block still in memory */
    while (kvhi_block_in_flight(blk))
        kvhi_block_wait_idle(e, b);
    bool host_full = !e->tiers[KVH_TIER_HOST].present;
    while (blk->tier == KVH_TIER_DISK) {
        if (blk->flags & KVHI_BF_CORRUPT)
            return kvhi_fail(KVH_ERR_CORRUPT, "block data on disk failed verification");
        if (kvhi_block_busy(blk)) {
            kvhi_block_wait_idle(e, b);
            continue;
        }
        uint32_t to = host_full ? KVH_TIER_DEVICE : KVH_TIER_HOST;
        kvh_status st = kvhi_move_block(e, b, to, blk->agent);
        if (st == KVH_ERR_NOSPACE && to == KVH_TIER_HOST && e->tiers[KVH_TIER_DEVICE].present) {
            /* The lock was dropped: b is looked at afresh before the
             * device tier is tried. */
            host_full = true;
            continue;
        }
        if (st == KVH_ERR_NOSPACE && e->copies_in_progress) {
            /* Every candidate is busy in another thread's copy: room comes
             * back when those end, so wait rather than fail, and try the
             * host tier first again. */
            host_full = !e->tiers[KVH_TIER_HOST].present;
            pthread_cond_wait(&e->changed, &e->lock);
            continue;
        }
        if (st != KVH_OK)
            return st;
        while (kvhi_block_in_flight(blk))
            kvhi_block_wait_idle(e, b);
    }
    return KVH_OK;
}
