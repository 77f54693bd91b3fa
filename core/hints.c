/* Prefetch hints as eviction protection.
 *
 * kvh_prefetch says a block will be needed, and how soon (priority, higher
 * first). Besides promoting it, the hint keeps it: a hinted block sorts
 * above every unhinted block of its class in the victim order, lower
 * priorities first. A block keeps its two highest distinct priorities; the
 * first access after a hint redeems the higher one, and the other takes
 * its place (later accesses before the next hint, such as the other
 * layers of the same forward pass, redeem nothing). A
 * scheduler that hints its queue (each queued request's blocks, at a
 * priority that falls with the request's absolute number: priorities are
 * compared as given, whenever given) thus tells the engine when each
 * block is next read, and the one after: the engine then evicts what
 * nothing waits for first, then what is waited for last, which is
 * Belady's rule within the queue's horizon. On the generated multi-agent
 * traces with a causal 4-request queue this reaches 0.82 to 0.99 of the
 * offline optimum's device hits where LRU-2 alone gets 0.57 to 1.0, and
 * 0.93 to 0.99 with hints that see the whole future schedule
 * (benchmarks/RESULTS.md, policy evaluation): a victim rule that sees
 * only the past evicts, in a loop larger than the tier, what the loop
 * needs next.
 *
 * A hint nobody redeems must not protect a block for ever: unless
 * renewed, hints lapse (both priorities together) once the epoch after
 * their own has ended, one to two epochs of hint_horizon ticks of the
 * engine's access clock (accesses and block allocations). Each hint leaves a record
 * in a FIFO ring; the records of a closed epoch are retired in order,
 * clearing the hints not renewed since. Cost: O(1) amortised per hint,
 * one compare per access of an unhinted block. */
#include <stdlib.h>

#include "core/engine.h"
#include "core/block.h"
#include "core/hint_queue.h"

typedef struct kvhi_hint_record {
    uint32_t block, gen, epoch;
} kvhi_hint_record;

/* kvhi_block.hint_epoch: the low seven bits of the epoch of the block's
 * newest hint (its records are at most two epochs old, see retire_lapsed)
 * and whether an access has redeemed a priority since that hint. */
#define HINT_EPOCH_MASK 0x7fu
#define HINT_FRESH 0x80u

/* Accesses per epoch: about the memory tiers' blocks, the span over which
 * a victim rule's own history reaches. */
static uint64_t hint_horizon(const kvh_engine *e)
{
    uint64_t n = 0;
    for (uint32_t t = 0; t < KVH_TIER_DISK; t++)
        if (e->tiers[t].present)
            n += e->tiers[t].slots.capacity;
    return n < 64 ? 64 : n;
}

kvhi_lruk_key kvhi_hint_key(const kvhi_block *blk, kvhi_lruk_key lruk)
{
    const uint64_t class_bit = 1ull << 63, hinted_bit = 1ull << 62;
    /* Priority as an unsigned rank: INT32_MIN lowest. Access times stay
     * below 2^62, so every hinted key is above every unhinted one. */
    uint64_t rank = (uint32_t)blk->hint_priority ^ 0x80000000u;
    kvhi_lruk_key k = {.primary = (lruk.primary & class_bit) | hinted_bit | rank, .secondary = lruk.secondary};
    return k;
}

static void hint_clear(kvh_engine *e, uint32_t b)
{
    kvhi_block *blk = kvhi_blk(e, b);
    if (!(blk->flags & KVHI_BF_HINTED))
        return;
    blk->flags &= (uint16_t)~KVHI_BF_HINTED;
    /* A lower key: heaps take it at once (a lazy entry would overstate it). */
    kvhi_block_update_evictable(e, b);
}

/* Block b's first priority is used up: the second takes its place, or
 * the hint is gone when there is none. */
static void hint_pop(kvh_engine *e, uint32_t b, kvhi_block *blk)
{
    if (blk->hint_next == KVHI_HINT_NONE) {
        hint_clear(e, b);
        return;
    }
    blk->hint_priority = blk->hint_next;
    blk->hint_next = KVHI_HINT_NONE;
    kvhi_block_update_evictable(e, b); /* lower: applied at once */
}

void kvhi_hint_redeem(kvh_engine *e, uint32_t b)
{
    kvhi_block *blk = kvhi_blk(e, b);
    /* One use per hint: the first access after it redeems, the rest of
     * that use (every layer read, a match then an acquire) does not. */
    if (!(blk->hint_epoch & HINT_FRESH) && !kvhi_hint_queue_due(e, blk->hint_priority))
        return;
    blk->hint_epoch &= (uint8_t)~HINT_FRESH;
    hint_pop(e, b, blk);
}

static void retire_lapsed(kvh_engine *e)
{
    while (e->hint_count) {
        kvhi_hint_record *r = &e->hint_ring[e->hint_head];
        if (e->hint_epoch - r->epoch < 2)
            return;
        kvhi_block *blk = kvhi_blk(e, r->block);
        /* Only the block's newest hint lapses it: a renewal left a later
         * record behind this one. */
        if (blk->gen == r->gen && (blk->flags & KVHI_BF_LIVE) &&
            (blk->hint_epoch & HINT_EPOCH_MASK) == (r->epoch & HINT_EPOCH_MASK))
            hint_clear(e, r->block);
        e->hint_head = (e->hint_head + 1) % e->hint_cap;
        e->hint_count--;
    }
}

static bool ring_push(kvh_engine *e, kvhi_hint_record r)
{
    if (e->hint_count == e->hint_cap) {
        uint32_t cap = e->hint_cap ? e->hint_cap * 2 : 256;
        kvhi_hint_record *ring = malloc((size_t)cap * sizeof(*ring));
        if (!ring)
            return false;
        for (uint32_t i = 0; i < e->hint_count; i++)
            ring[i] = e->hint_ring[(e->hint_head + i) % e->hint_cap];
        free(e->hint_ring);
        e->hint_ring = ring;
        e->hint_head = 0;
        e->hint_cap = cap;
    }
    e->hint_ring[(e->hint_head + e->hint_count) % e->hint_cap] = r;
    e->hint_count++;
    return true;
}

void kvhi_hints_advance(kvh_engine *e)
{
    if (e->clock < e->hint_epoch_end)
        return;
    e->hint_epoch++;
    e->hint_epoch_end = e->clock + hint_horizon(e);
    retire_lapsed(e);
}

/* Sets priority among b's two; true when it is new to them. lapses:
 * leave a record that retires it with its epoch; otherwise the block is
 * marked with an epoch no record carries (it lapses some other way,
 * core/hint_queue.c). */
static bool hint_apply(kvh_engine *e, uint32_t b, int32_t priority, bool lapses)
{
    kvhi_hints_advance(e);
    if (priority == KVHI_HINT_NONE)
        priority = KVHI_HINT_NONE + 1; /* the lowest rank; INT32_MIN marks "none" */
    kvhi_block *blk = kvhi_blk(e, b);
    bool hinted = blk->flags & KVHI_BF_HINTED;
    /* Records of a hinted block are all of this epoch or the last (older
     * ones were retired as the epoch advanced), so seven bits tell them
     * apart. */
    bool renewed = hinted && (blk->hint_epoch & HINT_EPOCH_MASK) == (e->hint_epoch & HINT_EPOCH_MASK);
    if (lapses && !renewed && !ring_push(e, (kvhi_hint_record){.block = b, .gen = blk->gen, .epoch = e->hint_epoch}))
        return false; /* out of memory: a hint is advice, it can be dropped */
    bool added = true;
    if (!hinted) {
        blk->hint_priority = priority;
        blk->hint_next = KVHI_HINT_NONE;
    } else if (priority > blk->hint_priority) {
        blk->hint_next = blk->hint_priority;
        blk->hint_priority = priority;
    } else if (priority < blk->hint_priority && priority > blk->hint_next) {
        blk->hint_next = priority;
    } else {
        added = false;
    }
    /* Half the seven-bit range away from this epoch: no live record (this
     * epoch's or the last's) matches it. */
    uint32_t epoch = lapses ? e->hint_epoch : e->hint_epoch + (HINT_EPOCH_MASK + 1) / 2;
    blk->hint_epoch = (uint8_t)((epoch & HINT_EPOCH_MASK) | HINT_FRESH);
    blk->flags |= KVHI_BF_HINTED;
    /* A higher key: the lazy update is exact (core/lruk.h). */
    kvhi_block_update_evictable(e, b);
    return added;
}

void kvhi_hint_set(kvh_engine *e, uint32_t b, int32_t priority) { (void)hint_apply(e, b, priority, true); }

bool kvhi_hint_set_unlapsing(kvh_engine *e, uint32_t b, int32_t priority) { return hint_apply(e, b, priority, false); }

void kvhi_hint_drop(kvh_engine *e, uint32_t b, int32_t priority)
{
    kvhi_block *blk = kvhi_blk(e, b);
    if (!(blk->flags & KVHI_BF_HINTED))
        return;
    if (blk->hint_next == priority) {
        blk->hint_next = KVHI_HINT_NONE;
        return; /* the key reads only the first: unchanged */
    }
    if (blk->hint_priority != priority)
        return;
    hint_pop(e, b, blk);
}

void kvhi_hints_free(kvh_engine *e)
{
    free(e->hint_ring);
    e->hint_ring = NULL;
    e->hint_count = e->hint_cap = e->hint_head = 0;
}
