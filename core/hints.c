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
 * engine's access clock (accesses and block allocations, which both
 * check for the epoch's end). Each hint leaves a record in a FIFO ring;
 * the records of a closed epoch are retired in order, clearing the hints
 * not renewed since. Cost: O(1) amortised per hint, one compare per
 * access of an unhinted block.
 *
 * Queue hints (core/hint_queue.c) set the same priorities, marked as
 * queue priorities: they leave no record and do not lapse (the step
 * passing their request drops them), and only an access once the step
 * has reached their request redeems them. A block may hold one of each
 * kind; each keeps its own rules. */
#include <stdlib.h>

#include "core/engine.h"
#include "core/host_spare.h"
#include "core/block.h"
#include "core/hint_queue.h"

typedef struct kvhi_hint_record {
    uint32_t block, gen, epoch;
} kvhi_hint_record;

/* kvhi_block.hint_epoch: the low five bits of the epoch of the block's
 * newest lapsing hint (its records are at most two epochs old, see
 * retire_lapsed), which of its two priorities are queue priorities
 * (core/hint_queue.c: they do not lapse, an access redeems one only once
 * the step has reached its request, and the step passing it drops it),
 * and whether a lapsing hint has come since an access last redeemed one.
 * A block hinted both ways keeps each priority under its own rules. */
#define HINT_EPOCH_MASK 0x1fu
#define HINT_QUEUE_FIRST 0x20u
#define HINT_QUEUE_NEXT 0x40u
#define HINT_FRESH 0x80u

/* Accesses per epoch: about the memory tiers' blocks, the span over which
 * a victim rule's own history reaches. */
static uint64_t hint_horizon(const kvh_engine *e)
{
    uint64_t n = 0;
    for (uint32_t t = 0; t < KVH_TIER_DISK; t++)
        if (e->tiers[t].present)
            n += kvhi_tier_slots(e, t);
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

/* A block's two priorities, soonest first, each with whether it is a
 * queue priority (NONE: no such priority). */
typedef struct hint_pair {
    int32_t p[2];
    bool queue[2];
} hint_pair;

static hint_pair pair_of(const kvhi_block *blk)
{
    hint_pair h = {{KVHI_HINT_NONE, KVHI_HINT_NONE}, {false, false}};
    if (!(blk->flags & KVHI_BF_HINTED))
        return h;
    h.p[0] = blk->hint_priority;
    h.queue[0] = blk->hint_epoch & HINT_QUEUE_FIRST;
    h.p[1] = blk->hint_next;
    h.queue[1] = h.p[1] != KVHI_HINT_NONE && (blk->hint_epoch & HINT_QUEUE_NEXT);
    return h;
}

/* Which of the two holds priority p: 0, 1, or -1 for neither. */
static int pair_find(const hint_pair *h, int32_t p)
{
    if (p == KVHI_HINT_NONE)
        return -1;
    return h->p[0] == p ? 0 : h->p[1] == p ? 1 : -1;
}

static bool has_lapsing(const hint_pair *h)
{
    return (h->p[0] != KVHI_HINT_NONE && !h->queue[0]) || (h->p[1] != KVHI_HINT_NONE && !h->queue[1]);
}

static void pair_remove(hint_pair *h, int i)
{
    if (i == 0) {
        h->p[0] = h->p[1];
        h->queue[0] = h->queue[1];
    }
    h->p[1] = KVHI_HINT_NONE;
    h->queue[1] = false;
}

/* Stores h into b. A block left without a priority leaves the hinted
 * class. Either way the key fell or rose: heaps take it at once (a lazy
 * entry would overstate a lower one). */
static void pair_store(kvh_engine *e, uint32_t b, const hint_pair *h)
{
    kvhi_block *blk = kvhi_blk(e, b);
    uint8_t he = blk->hint_epoch & (uint8_t) ~(HINT_QUEUE_FIRST | HINT_QUEUE_NEXT);
    if (h->p[0] == KVHI_HINT_NONE) {
        blk->hint_epoch = he & (uint8_t)~HINT_FRESH;
        blk->flags &= (uint16_t)~KVHI_BF_HINTED;
    } else {
        blk->hint_priority = h->p[0];
        blk->hint_next = h->p[1];
        blk->hint_epoch = he | (h->queue[0] ? HINT_QUEUE_FIRST : 0) | (h->queue[1] ? HINT_QUEUE_NEXT : 0);
        blk->flags |= KVHI_BF_HINTED;
    }
    kvhi_block_update_evictable(e, b);
}

void kvhi_hint_redeem(kvh_engine *e, uint32_t b)
{
    kvhi_block *blk = kvhi_blk(e, b);
    hint_pair h = pair_of(blk);
    bool changed = false;
    /* One use per lapsing hint: the first access after it redeems the
     * sooner lapsing priority, the rest of that use (every layer read, a
     * match then an acquire) does not. */
    if (blk->hint_epoch & HINT_FRESH) {
        blk->hint_epoch &= (uint8_t)~HINT_FRESH;
        int i = !h.queue[0] ? 0 : (h.p[1] != KVHI_HINT_NONE && !h.queue[1]) ? 1 : -1;
        if (i >= 0) {
            pair_remove(&h, i);
            changed = true;
        }
    }
    /* A priority whose request the step has reached: this is its use,
     * whether or not it was hinted again since an earlier one. */
    while (h.p[0] != KVHI_HINT_NONE && kvhi_hint_queue_due(e, h.p[0])) {
        pair_remove(&h, 0);
        changed = true;
    }
    if (changed)
        pair_store(e, b, &h);
}

/* The record's epoch ended with no lapsing hint of its block given since:
 * the block's lapsing priorities go, its queue priorities stay. */
static void lapse(kvh_engine *e, uint32_t b)
{
    hint_pair h = pair_of(kvhi_blk(e, b));
    if (!has_lapsing(&h))
        return;
    for (int i = 1; i >= 0; i--)
        if (h.p[i] != KVHI_HINT_NONE && !h.queue[i])
            pair_remove(&h, i);
    pair_store(e, b, &h);
}

static void retire_lapsed(kvh_engine *e)
{
    while (e->hint_count) {
        kvhi_hint_record *r = &e->hint_ring[e->hint_head];
        if (e->hint_epoch - r->epoch < 2)
            return;
        kvhi_block *blk = kvhi_blk(e, r->block);
        /* Only the block's newest lapsing hint lapses it: a renewal left a
         * later record behind this one. */
        if (blk->gen == r->gen && (blk->flags & KVHI_BF_LIVE) &&
            (blk->hint_epoch & HINT_EPOCH_MASK) == (r->epoch & HINT_EPOCH_MASK))
            lapse(e, r->block);
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
    /* As many epochs as whole horizons have passed (accesses that do not
     * check, such as block allocations, may have run the clock on): a
     * hint lapses after one to two horizons however the clock got there. */
    uint64_t horizon = hint_horizon(e), passed = (e->clock - e->hint_epoch_end) / horizon + 1;
    e->hint_epoch += passed > 2 ? 2 : (uint32_t)passed;
    e->hint_epoch_end = e->clock + horizon;
    retire_lapsed(e);
}

/* Sets priority among b's two, as a lapsing priority or a queue one.
 * Returns whether b's priorities changed: for a queue priority, whether
 * b now holds it as one and did not before (the caller files it,
 * core/hint_queue.c). lapses: a record retires it with its epoch unless
 * renewed. */
static bool hint_apply(kvh_engine *e, uint32_t b, int32_t priority, bool lapses)
{
    kvhi_hints_advance(e);
    if (priority == KVHI_HINT_NONE)
        priority = KVHI_HINT_NONE + 1; /* the lowest rank; INT32_MIN marks "none" */
    kvhi_block *blk = kvhi_blk(e, b);
    hint_pair h = pair_of(blk);
    if (lapses) {
        /* Records of a block's lapsing hints are all of this epoch or the
         * last (older ones were retired as the epoch advanced), so five
         * bits tell them apart. */
        bool renewed = has_lapsing(&h) && (blk->hint_epoch & HINT_EPOCH_MASK) == (e->hint_epoch & HINT_EPOCH_MASK);
        if (!renewed && !ring_push(e, (kvhi_hint_record){.block = b, .gen = blk->gen, .epoch = e->hint_epoch}))
            return false; /* out of memory: a hint is advice, it can be dropped */
    }
    bool changed = true;
    int at = pair_find(&h, priority);
    if (at >= 0) {
        /* The same priority given the other way: a queue priority it is
         * (the step retires it; it no longer lapses). */
        changed = !lapses && !h.queue[at];
        if (changed)
            h.queue[at] = true;
    } else if (h.p[0] == KVHI_HINT_NONE || priority > h.p[0]) {
        h.p[1] = h.p[0];
        h.queue[1] = h.queue[0];
        h.p[0] = priority;
        h.queue[0] = !lapses;
    } else if (priority > h.p[1]) {
        h.p[1] = priority;
        h.queue[1] = !lapses;
    } else {
        changed = false; /* two sooner ones are kept */
    }
    if (lapses)
        blk->hint_epoch =
            (uint8_t)((blk->hint_epoch & ~HINT_EPOCH_MASK) | (e->hint_epoch & HINT_EPOCH_MASK) | HINT_FRESH);
    if (changed)
        pair_store(e, b, &h); /* a higher key, or a lower second: exact either way */
    return changed;
}

void kvhi_hint_set(kvh_engine *e, uint32_t b, int32_t priority) { (void)hint_apply(e, b, priority, true); }

bool kvhi_hint_set_unlapsing(kvh_engine *e, uint32_t b, int32_t priority) { return hint_apply(e, b, priority, false); }

void kvhi_hint_drop(kvh_engine *e, uint32_t b, int32_t priority)
{
    hint_pair h = pair_of(kvhi_blk(e, b));
    int at = pair_find(&h, priority);
    if (at < 0)
        return;
    pair_remove(&h, at);
    pair_store(e, b, &h);
}

bool kvhi_hint_holds_queued(const kvh_engine *e, uint32_t b, int32_t priority)
{
    hint_pair h = pair_of(&e->blocks[b]);
    int at = pair_find(&h, priority);
    return at >= 0 && h.queue[at];
}

void kvhi_hint_rerank(kvh_engine *e, uint32_t b, int32_t was, int32_t now)
{
    hint_pair h = pair_of(kvhi_blk(e, b));
    int at = pair_find(&h, was);
    if (at < 0)
        return; /* redeemed, or pushed out by two higher ones */
    h.p[at] = now;
    if (h.p[1] != KVHI_HINT_NONE && h.p[1] > h.p[0]) {
        hint_pair t = h;
        h.p[0] = t.p[1], h.p[1] = t.p[0];
        h.queue[0] = t.queue[1], h.queue[1] = t.queue[0];
    }
    pair_store(e, b, &h);
}

void kvhi_hints_free(kvh_engine *e)
{
    free(e->hint_ring);
    e->hint_ring = NULL;
    e->hint_count = e->hint_cap = e->hint_head = 0;
}
