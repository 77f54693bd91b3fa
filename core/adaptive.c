/* Adaptive victim order: plain LRU, LRU-K or protected reuse, chosen by
 * a shadow simulation.
 *
 * No order wins everywhere. LRU-K keeps what is used often against a
 * scan of cold blocks, but it evicts every block read once first, and in
 * a workload where each request re-reads its whole context once (agents'
 * turns), the block a request just appended is the one its next turn
 * needs: there plain LRU keeps more (0.97 vs 0.89 of MIN at 30 % on the
 * generated agents trace). Where the tier is smaller than the requests'
 * contexts, LRU-2 gives up blocks many requests share, read in a burst a
 * while ago, for context blocks read twice far apart; the protected-reuse
 * order (adaptive.h, kvhi_adapt_reuse_key: blocks reused within
 * REUSE_PERIOD_TIERS x the device tier's blocks of accesses go last,
 * after LIRS's low inter-reference set) keeps them, and leads both there
 * (0.62-0.64 vs 0.60-0.61 of MIN at 5-10 % on agents). So the engine
 * simulates the three on the device
 * tier's accesses, each with the tier's capacity, and orders victims by
 * the one with the most hits: each shadow's hits (halved every
 * DECAY_WINDOWS x the memory tiers' blocks of accesses) are compared on
 * every access, and the best order takes over once it leads the one in
 * force by SWITCH_MARGIN hits. It starts as LRU-K. On large tiers only a
 * hashed sample of the blocks is simulated, with the capacity scaled
 * alike (spatial sampling keeps hit ratios), so that the shadows cost
 * O(log n) on one access in 2^shift. A switch re-keys every eviction heap
 * (O(n) for the n entries it re-keys); the next switch waits at least n
 * accesses, so that is O(1) amortised per access.
 *
 * The reuse key is not monotone: an access after a long gap ends a
 * block's protection and lowers its key, which the heaps' lazy raises
 * (core/lruk.h) would miss. Under that order such an access re-keys the
 * block at once (O(log n)), and its shadow stores such a hit's key at
 * once; every other access only raises keys, lazily as in the others.
 *
 * Following whichever order leads cannot promise the hits of the best one
 * in hindsight: a lead that builds late, or turns back and forth, costs
 * the accesses before the switch (benchmarks/RESULTS.md). */
#include "core/adaptive.h"

#include <stdlib.h>

#include "core/engine.h"
#include "core/host_spare.h"
#include "core/block.h"
#include "core/tier.h"

/* Shadows simulate at most about this many blocks each. */
#define SHADOW_BLOCKS 2048u
/* The hits halve every this many times the memory tiers' blocks of
 * accesses: long enough that a lead built over many turns is not undone
 * by one noisy turn, short enough to follow a change of workload. */
#define DECAY_WINDOWS 32u
/* Shadow hits the best order must lead by to take over. Small: a switch
 * is checked on every access, and the quiet period after one (as many
 * accesses as it re-keyed entries) is what bounds flapping and keeps the
 * re-keying O(1) amortised. With LRU and LRU-2 alone, on the generated
 * traces (seed 1, causal 4-queue, no hints) margins of 4, 16, 64 and 1/4
 * of the shadow capacity left the engine below max(LRU, LRU-2) by a
 * summed 0.029, 0.040, 0.068 and 0.066 of MIN over the 20 rows; 4 is the
 * best of them, and stays so with the reuse order added (4 and 8, in a
 * simulation of this chooser over seeds 1-3: 0.056 and 0.066 summed). */
#define SWITCH_MARGIN KVHI_ADAPT_SWITCH_MARGIN
/* The reuse order protects blocks reused within this many times the
 * device tier's blocks of accesses. In a simulation of this chooser over
 * seeds 1-3 of the generated traces, 1.5, 2, 2.5, 3 and 4 left it below
 * max(LRU, LRU-2) by a summed 0.084, 0.070, 0.064, 0.056 and 0.064 of
 * MIN. */
#define REUSE_PERIOD_TIERS 3u

static kvhi_lruk_key shadow_key(kvh_engine *e, uint32_t which, uint32_t b)
{
    const kvhi_block *blk = &e->blocks[b];
    if (which == KVHI_ADAPT_REUSE)
        return kvhi_adapt_reuse_key(blk->hist, e->adapt.reuse_period, 0);
    return kvhi_lruk_key_of(blk->hist, which == KVHI_ADAPT_LRU ? 1 : e->cfg.lru_k, 0);
}

/* Whether b's last access came after a gap longer than the reuse period:
 * the one case where an access lowers its reuse key. */
static bool reuse_gap(const kvh_engine *e, uint32_t b)
{
    const uint64_t *hist = e->blocks[b].hist;
    return hist[1] != 0 && hist[0] - hist[1] > e->adapt.reuse_period;
}

static kvhi_lruk_key lru_current(void *engine, uint32_t b) { return shadow_key(engine, KVHI_ADAPT_LRU, b); }
static kvhi_lruk_key lru_k_current(void *engine, uint32_t b) { return shadow_key(engine, KVHI_ADAPT_LRU_K, b); }
static kvhi_lruk_key reuse_current(void *engine, uint32_t b) { return shadow_key(engine, KVHI_ADAPT_REUSE, b); }

/* How many accesses the inline path may take alone from here: those that
 * would only count down the decay and quiet periods, that is until either
 * reaches 1 (the slow path's turn), and none while a switch is due or
 * under the REUSE order. They are taken off both periods now (neither
 * reaches 0). */
static inline void grant_fast(kvhi_adapt *a)
{
    uint64_t n = 0;
    if (a->order != KVHI_ADAPT_REUSE && !kvhi_adapt_switch_due(a)) {
        n = a->decay_left - 1;
        if (a->quiet_left && a->quiet_left - 1 < n)
            n = a->quiet_left - 1;
    }
    a->decay_left -= n;
    if (a->quiet_left)
        a->quiet_left -= n;
    a->fast_left = n;
}

/* Gives the periods back the granted accesses the inline path did not
 * take. */
static inline void settle_fast(kvhi_adapt *a)
{
    a->decay_left += a->fast_left;
    if (a->quiet_left)
        a->quiet_left += a->fast_left;
    a->fast_left = 0;
}

int kvhi_adapt_init(kvh_engine *e)
{
    kvhi_adapt *a = &e->adapt;
    a->on = e->cfg.eviction_policy == KVH_EVICT_ADAPTIVE;
    if (!a->on)
        return 0;
    uint64_t dev = e->tiers[KVH_TIER_DEVICE].present ? kvhi_tier_slots(e, KVH_TIER_DEVICE) : 0;
    uint64_t mem = 0;
    for (uint32_t t = 0; t < KVH_TIER_DISK; t++)
        if (e->tiers[t].present)
            mem += kvhi_tier_slots(e, t);
    a->shift = 0;
    while (a->shift < 16 && (dev >> a->shift) > SHADOW_BLOCKS)
        a->shift++;
    a->sample_below = 1ull << (32 - a->shift);
    a->cap = (uint32_t)(dev >> a->shift) ? (uint32_t)(dev >> a->shift) : 1;
    a->decay_every = (mem > a->cap ? mem : a->cap) * DECAY_WINDOWS;
    a->decay_left = a->decay_every;
    a->quiet_left = 0;
    a->order = a->best = KVHI_ADAPT_LRU_K;
    /* The reuse key reads the last two accesses: a history of one has no
     * reuse interval. */
    a->n_orders = e->cfg.lru_k >= 2 ? KVHI_ADAPT_ORDERS : KVHI_ADAPT_REUSE;
    a->reuse_period = (dev ? dev : 1) * REUSE_PERIOD_TIERS;
    for (uint32_t s = 0; s < a->n_orders; s++) {
        a->hits[s] = 0;
        a->pos[s] = malloc(sizeof(uint32_t) * (e->block_cap ? e->block_cap : 1));
        if (!a->pos[s])
            return -1;
        for (uint64_t b = 0; b < e->block_cap; b++)
            a->pos[s][b] = KVHI_HEAP_NONE;
        /* One more than the capacity: an arrival is taken in, then the
         * shadow's victim leaves. */
        if (kvhi_lruk_init(&a->shadow[s], a->cap + 1, a->pos[s], sizeof(uint32_t)) != 0)
            return -1;
    }
    grant_fast(a);
    return 0;
}

void kvhi_adapt_free(kvh_engine *e)
{
    kvhi_adapt *a = &e->adapt;
    for (uint32_t s = 0; s < KVHI_ADAPT_ORDERS; s++) {
        kvhi_lruk_destroy(&a->shadow[s]);
        free(a->pos[s]);
        a->pos[s] = NULL;
    }
    a->on = false;
}

/* Every eviction heap takes the keys of the order now in force; returns
 * how many entries that re-keyed. */
static uint64_t rekey_all(kvh_engine *e)
{
    uint64_t n = 0;
    for (uint32_t t = 0; t < KVH_TIER_COUNT; t++)
        if (e->tiers[t].present) {
            n += kvhi_lruk_count(&e->tiers[t].heap);
            kvhi_lruk_rekey(&e->tiers[t].heap, kvhi_block_current_key, e);
        }
    for (uint32_t i = 0; i < e->n_agents; i++) {
        n += kvhi_lruk_count(&e->agents[i].heap);
        kvhi_lruk_rekey(&e->agents[i].heap, kvhi_block_current_key, e);
    }
    return n;
}

static void decide(kvh_engine *e)
{
    kvhi_adapt *a = &e->adapt;
    if (a->quiet_left) {
        a->quiet_left--;
        return;
    }
    if (a->hits[a->best] - a->hits[a->order] <= SWITCH_MARGIN)
        return;
    a->order = a->best;
    a->switches++;
    a->quiet_left = rekey_all(e);
}

/* The order with the most hits; the one in force wins ties. */
static void find_best(kvhi_adapt *a)
{
    uint8_t best = a->order;
    for (uint8_t s = 0; s < a->n_orders; s++)
        if (a->hits[s] > a->hits[best])
            best = s;
    a->best = best;
}

static void shadows_access(kvh_engine *e, uint32_t b)
{
    kvhi_adapt *a = &e->adapt;
    static const kvhi_lruk_current_fn current[KVHI_ADAPT_ORDERS] = {lru_current, lru_k_current, reuse_current};
    bool hit = false;
    for (uint32_t s = 0; s < a->n_orders; s++) {
        kvhi_lruk_heap *h = &a->shadow[s];
        if (a->pos[s][b] != KVHI_HEAP_NONE) {
            a->hits[s]++;
            hit = true;
            /* A raise: the stored key stays a lower bound. Only the reuse
             * key can fall, when a long gap ends the block's protection:
             * that is stored at once. */
            if (s == KVHI_ADAPT_REUSE && reuse_gap(e, b))
                kvhi_lruk_upsert_lazy(h, b, shadow_key(e, s, b));
            continue;
        }
        kvhi_lruk_key key = shadow_key(e, s, b);
        uint32_t count = kvhi_lruk_count(h);
        if (count >= a->cap) {
            /* Below every stored key, so below every current one: it
             * would be its own victim (a block read once, under LRU-K
             * and reuse). Skipping it is the same, and O(1). */
            const kvhi_lruk_entry *min = kvhi_lruk_min_entry(h);
            if (min && kvhi_lruk_less(&key, &min->key))
                continue;
        }
        kvhi_lruk_insert_lazy(h, b, key); /* one more present */
        if (count + 1 > a->cap)
            kvhi_lruk_remove(h, kvhi_lruk_top_current(h, current[s], e));
    }
    /* Unchanged hits leave the best order as it was. */
    if (hit)
        find_best(a);
}

void kvhi_adapt_access_slow(kvh_engine *e, uint32_t b)
{
    kvhi_adapt *a = &e->adapt;
    settle_fast(a);
    if (kvhi_adapt_sampled(a, b))
        shadows_access(e, b);
    if (--a->decay_left == 0) {
        a->decay_left = a->decay_every;
        for (uint32_t s = 0; s < a->n_orders; s++)
            a->hits[s] -= a->hits[s] / 2;
        find_best(a);
    }
    if (a->order == KVHI_ADAPT_REUSE) {
        /* An access after a gap longer than the period ends the block's
         * protection: a lower key, which its heap entries take now. */
        const kvhi_block *blk = &e->blocks[b];
        if (reuse_gap(e, b) && (blk->heap_pos != KVHI_HEAP_NONE || blk->quota_heap_pos != KVHI_HEAP_NONE))
            kvhi_block_update_evictable(e, b);
    }
    decide(e);
    grant_fast(a);
}

void kvhi_adapt_forget_sampled(kvh_engine *e, uint32_t b)
{
    kvhi_adapt *a = &e->adapt;
    /* The shadows have no pending ring (core/lruk.h). */
    for (uint32_t s = 0; s < a->n_orders; s++)
        if (a->pos[s][b] != KVHI_HEAP_NONE)
            kvhi_lruk_remove_present(&a->shadow[s], b);
}
