/* Clean host copies of promoted blocks: kept, dropped, taken back for
 * room, and used by a demotion that then copies nothing. See
 * core/clean_copy.h for the rules. Lock held throughout. */
#include <stdlib.h>

#include "core/block_state.h"
#include "core/engine.h"
#include "core/block.h"
#include "core/move.h"

int kvhi_clean_init(kvh_engine *e)
{
    kvhi_clean_copies *c = &e->clean;
    c->newest = c->oldest = KVHI_NO_BLOCK;
    c->count = 0;
    kvhi_tier *host = &e->tiers[KVH_TIER_HOST];
    if (!host->present || host->shares_arena || e->moves_in_place || !e->tiers[KVH_TIER_DEVICE].present)
        return 0; /* nothing to keep (one arena: moves copy nothing) */
    c->slot_of = malloc((size_t)e->block_cap * sizeof(uint32_t));
    c->links = malloc((size_t)host->slots.capacity * sizeof(kvhi_clean_link));
    if (!c->slot_of || !c->links) {
        kvhi_clean_destroy(e);
        return -1;
    }
    for (uint32_t b = 0; b < e->block_cap; b++)
        c->slot_of[b] = KVHI_NO_BLOCK;
    return 0;
}

void kvhi_clean_destroy(kvh_engine *e)
{
    free(e->clean.slot_of);
    free(e->clean.links);
    e->clean.slot_of = NULL;
    e->clean.links = NULL;
}

static void unlink_slot(kvhi_clean_copies *c, uint32_t s)
{
    kvhi_clean_link *l = &c->links[s];
    if (l->newer != KVHI_NO_BLOCK)
        c->links[l->newer].older = l->older;
    else
        c->newest = l->older;
    if (l->older != KVHI_NO_BLOCK)
        c->links[l->older].newer = l->newer;
    else
        c->oldest = l->newer;
    c->slot_of[l->block] = KVHI_NO_BLOCK;
    c->count--;
}

bool kvhi_clean_keep(kvh_engine *e, uint32_t b, uint32_t src_slot)
{
    kvhi_clean_copies *c = &e->clean;
    const kvhi_block *blk = &e->blocks[b];
    uint16_t need = KVHI_BF_LIVE | KVHI_BF_HASHED | KVHI_BF_KV_COMPLETE;
    /* Only bytes nothing will rewrite behind the copy's back, in a slot no
     * reader still uses: a holder of b reading the slot it left would see
     * it handed to another block when the copy is taken back. */
    if (!c->slot_of || (blk->flags & need) != need ||
        (blk->flags & (KVHI_BF_DEAD | KVHI_BF_CORRUPT | KVHI_BF_POOL_FILL)) || blk->tier != KVH_TIER_DEVICE ||
        e->block_readers[b] || kvhi_block_copying(blk))
        return false;
    if (c->slot_of[b] != KVHI_NO_BLOCK)
        kvhi_clean_drop_slow(e, b); /* never two: the newer one is kept */
    kvhi_clean_link *l = &c->links[src_slot];
    l->block = b;
    l->newer = KVHI_NO_BLOCK;
    l->older = c->newest;
    if (c->newest != KVHI_NO_BLOCK)
        c->links[c->newest].newer = src_slot;
    else
        c->oldest = src_slot;
    c->newest = src_slot;
    c->slot_of[b] = src_slot;
    c->count++;
    e->stats.clean_copies_kept++;
    return true;
}

void kvhi_clean_drop_slow(kvh_engine *e, uint32_t b)
{
    kvhi_clean_copies *c = &e->clean;
    uint32_t s = c->slot_of[b];
    unlink_slot(c, s);
    kvhi_release_slot(e, KVH_TIER_HOST, s);
}

bool kvhi_clean_reclaim(kvh_engine *e, uint32_t *slot)
{
    kvhi_clean_copies *c = &e->clean;
    if (c->oldest == KVHI_NO_BLOCK)
        return false;
    /* The oldest, in O(1): the newest instead moved the trace benchmark's
     * copies per access by at most 1 %, either way (a full host tier keeps
     * only a few copies at a time). */
    uint32_t s = c->oldest;
    unlink_slot(c, s);
    e->stats.clean_copies_reclaimed++;
    *slot = s;
    return true;
}

void kvhi_clean_demote(kvh_engine *e, uint32_t b, uint32_t *src_slot_out)
{
    kvhi_block *blk = &e->blocks[b];
    uint32_t dev_slot = blk->slot, host_slot = e->clean.slot_of[b];
    unlink_slot(&e->clean, host_slot);
    if (blk->flags & KVHI_BF_PREFETCHED) {
        e->stats.prefetch_wasted++;
        blk->flags &= (uint16_t)~KVHI_BF_PREFETCHED;
    }
    kvhi_block_move_event(blk, KVHI_EV_MOVE_BEGIN);
    kvhi_block_update_evictable(e, b); /* out of the device tier's heaps */
    kvhi_block_place(e, b, KVH_TIER_HOST, host_slot);
    kvhi_block_move_event(blk, KVHI_EV_MOVE_END);
    e->stats.clean_copy_demotions++;
    if (src_slot_out)
        *src_slot_out = dev_slot;
    else
        kvhi_block_release_source(e, b, KVH_TIER_DEVICE, dev_slot); /* a holder may still read it */
    kvhi_block_update_evictable(e, b);
}
