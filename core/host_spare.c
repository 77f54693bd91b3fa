/* The host tier's spare slot: see core/host_spare.h. */
#include "core/host_spare.h"

#include "core/block.h"
#include "core/block_state.h"
#include "core/disk_tier.h"
#include "core/lruk.h"
#include "core/move.h"
#include "core/slot_pool.h"
#include "core/tier.h"

void kvhi_host_spare_init(kvh_engine *e)
{
    uint32_t slot;
    if (kvhi_slot_pool_alloc(&e->tiers[KVH_TIER_HOST].slots, &slot) == 0)
        e->host_spare = slot;
}

bool kvhi_host_spare_take(kvh_engine *e, uint32_t b, uint32_t *slot)
{
    const kvhi_block *blk = &e->blocks[b];
    /* A prefetch is advice: it pushes no referenced block down to disk. */
    if (e->host_spare == KVHI_NO_BLOCK || blk->tier != KVH_TIER_DISK || !kvhi_disk_tier_full(e) ||
        kvhi_victim_ceiling_active())
        return false;
    /* Without a block that could leave for the slot b frees, the spare
     * would stay lent: the host tier is full of pinned or held blocks. */
    if (kvhi_lruk_top_current(&e->tiers[KVH_TIER_HOST].heap, kvhi_block_current_key, e) == KVHI_HEAP_NONE)
        return false;
    *slot = e->host_spare;
    e->host_spare = KVHI_NO_BLOCK;
    e->host_spare_lent = true;
    return true;
}

void kvhi_host_spare_repay(kvh_engine *e, uint32_t b)
{
    kvhi_block *blk = &e->blocks[b];
    if (!e->host_spare_lent || kvhi_move_next(kvhi_move_state(blk), KVHI_EV_MOVE_BEGIN) == KVHI_MS_COUNT)
        return;
    /* In flight meanwhile, b is no victim: it came up to be used. */
    kvhi_block_move_event(blk, KVHI_EV_MOVE_BEGIN);
    kvhi_block_update_evictable(e, b);
    kvhi_host_spare_pay_back(e, blk->agent);
    kvhi_block_move_event(blk, KVHI_EV_MOVE_END);
    pthread_cond_broadcast(&e->changed);
}
