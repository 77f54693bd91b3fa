/* Adaptive victim order: plain LRU or LRU-K, chosen by a shadow
 * simulation.
 *
 * Neither order wins everywhere. LRU-K keeps what is used often against a
 * scan of cold blocks, but it evicts every block read once first, and in
 * a workload where each request re-reads its whole context once (agents'
 * turns), the block a request just appended is the one its next turn
 * needs: there plain LRU keeps more (0.97 vs 0.93 of MIN at 30 % on the
 * generated agents trace). So the engine simulates both on the device
 * tier's accesses, each with the tier's capacity, and orders victims by
 * the one with more hits: the difference of the shadows' hits (halved
 * every DECAY_WINDOWS x the memory tiers' blocks of accesses) is checked
 * on every access, and the other order takes over once it leads by
 * SWITCH_MARGIN hits. It starts as LRU-K. On large tiers only a hashed
 * sample of the blocks is simulated, with the capacity scaled alike
 * (spatial sampling keeps hit ratios), so that the shadows cost O(log n)
 * on one access in 2^shift. A switch re-keys every eviction heap (O(n)
 * for the n entries it re-keys); the next switch waits at least n
 * accesses, so that is O(1) amortised per access.
 *
 * Following whichever order leads cannot promise the hits of the better
 * one in hindsight: a lead that builds late, or turns back and forth,
 * costs the accesses before the switch. On the generated traces this
 * leaves the engine within 0.009 of MIN of max(LRU, LRU-2), not above it
 * everywhere (benchmarks/RESULTS.md). */
#include "core/adaptive.h"

#include <stdlib.h>

#include "core/engine.h"
#include "core/block.h"
#include "core/tier.h"

/* Shadows simulate at most about this many blocks each. */
#define SHADOW_BLOCKS 2048u
/* The lead halves every this many times the memory tiers' blocks of
 * accesses: long enough that a lead built over many turns is not undone
 * by one noisy turn, short enough to follow a change of workload. */
#define DECAY_WINDOWS 32u
/* Shadow hits the other order must lead by to take over. Small: a switch
 * is checked on every access, and the quiet period after one (as many
 * accesses as it re-keyed entries) is what bounds flapping and keeps the
 * re-keying O(1) amortised. On the generated traces (seed 1, causal 4-
 * queue, no hints) margins of 4, 16, 64 and 1/4 of the shadow capacity
 * left the engine below max(LRU, LRU-2) by a summed 0.029, 0.040, 0.068
 * and 0.066 of MIN over the 20 rows; 4 is the best of them. */
#define SWITCH_MARGIN KVHI_ADAPT_SWITCH_MARGIN

enum { SHADOW_LRU, SHADOW_LRU_K };

static kvhi_lruk_key shadow_key(kvh_engine *e, uint32_t which, uint32_t b)
{
    const kvhi_block *blk = &e->blocks[b];
    return kvhi_lruk_key_of(blk->hist, which == SHADOW_LRU ? 1 : e->cfg.lru_k, 0);
}

static kvhi_lruk_key lru_current(void *engine, uint32_t b) { return shadow_key(engine, SHADOW_LRU, b); }
static kvhi_lruk_key lru_k_current(void *engine, uint32_t b) { return shadow_key(engine, SHADOW_LRU_K, b); }

int kvhi_adapt_init(kvh_engine *e)
{
    kvhi_adapt *a = &e->adapt;
    a->on = e->cfg.eviction_policy == KVH_EVICT_ADAPTIVE;
    if (!a->on)
        return 0;
    uint64_t dev = e->tiers[KVH_TIER_DEVICE].present ? e->tiers[KVH_TIER_DEVICE].slots.capacity : 0;
    uint64_t mem = 0;
    for (uint32_t t = 0; t < KVH_TIER_DISK; t++)
        if (e->tiers[t].present)
            mem += e->tiers[t].slots.capacity;
    a->shift = 0;
    while (a->shift < 16 && (dev >> a->shift) > SHADOW_BLOCKS)
        a->shift++;
    a->cap = (uint32_t)(dev >> a->shift) ? (uint32_t)(dev >> a->shift) : 1;
    a->decay_every = (mem > a->cap ? mem : a->cap) * DECAY_WINDOWS;
    a->decay_left = a->decay_every;
    a->quiet_left = 0;
    a->lead = 0;
    for (uint32_t s = 0; s < 2; s++) {
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
    return 0;
}

void kvhi_adapt_free(kvh_engine *e)
{
    kvhi_adapt *a = &e->adapt;
    for (uint32_t s = 0; s < 2; s++) {
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
    if (a->recency ? a->lead >= -SWITCH_MARGIN : a->lead <= SWITCH_MARGIN)
        return;
    a->recency = !a->recency;
    a->switches++;
    a->quiet_left = rekey_all(e);
}

void kvhi_adapt_access_slow(kvh_engine *e, uint32_t b)
{
    kvhi_adapt *a = &e->adapt;
    if (kvhi_adapt_sampled(a, b)) {
        static const kvhi_lruk_current_fn current[2] = {lru_current, lru_k_current};
        for (uint32_t s = 0; s < 2; s++) {
            kvhi_lruk_heap *h = &a->shadow[s];
            if (a->pos[s][b] != KVHI_HEAP_NONE) {
                a->lead += s == SHADOW_LRU ? 1 : -1;
                continue; /* a raise: the stored key stays a lower bound */
            }
            kvhi_lruk_upsert_lazy(h, b, shadow_key(e, s, b));
            if (kvhi_lruk_count(h) > a->cap)
                kvhi_lruk_remove(h, kvhi_lruk_top_current(h, current[s], e));
        }
    }
    if (--a->decay_left == 0) {
        a->decay_left = a->decay_every;
        a->lead -= a->lead / 2;
    }
    decide(e);
}

void kvhi_adapt_forget_sampled(kvh_engine *e, uint32_t b)
{
    kvhi_adapt *a = &e->adapt;
    for (uint32_t s = 0; s < 2; s++)
        if (a->pos[s][b] != KVHI_HEAP_NONE)
            kvhi_lruk_remove(&a->shadow[s], b);
}
