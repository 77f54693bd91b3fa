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
 * the one with more hits lately (scores halve every window of accesses,
 * and the other must lead by 2 % to take over). It starts as LRU-K. On large tiers only a
 * hashed sample of the blocks is simulated, with the capacity scaled
 * alike (spatial sampling keeps hit ratios), so that the shadows cost
 * O(log n) on one access in 2^shift. A switch re-keys every eviction heap
 * (O(n)); decisions come at most once per window of as many accesses as
 * the memory tiers hold blocks (2048 at least), so that is O(1) amortised
 * per access. */
#include "core/adaptive.h"

#include <stdlib.h>

#include "core/engine.h"
#include "core/block.h"
#include "core/tier.h"

/* Shadows simulate at most about this many blocks each. */
#define SHADOW_BLOCKS 2048u
/* Accesses between decisions, at least: a shorter window sees too few
 * hits on a small tier to tell the orders apart, and flaps (agents trace
 * at 5 %: 0.57 of MIN with 70-access windows, 0.605 = LRU-2's with 2048). */
#define MIN_WINDOW 2048u

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
    a->window = mem > MIN_WINDOW ? mem : MIN_WINDOW;
    a->window_left = a->window;
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

/* Every eviction heap takes the keys of the order now in force. */
static void rekey_all(kvh_engine *e)
{
    for (uint32_t t = 0; t < KVH_TIER_COUNT; t++)
        if (e->tiers[t].present)
            kvhi_lruk_rekey(&e->tiers[t].heap, kvhi_block_current_key, e);
    for (uint32_t i = 0; i < e->n_agents; i++)
        kvhi_lruk_rekey(&e->agents[i].heap, kvhi_block_current_key, e);
}

static void decide(kvh_engine *e)
{
    kvhi_adapt *a = &e->adapt;
    for (uint32_t s = 0; s < 2; s++) {
        a->score[s] = a->score[s] / 2 + (double)a->hits[s];
        a->hits[s] = 0;
    }
    a->window_left = a->window;
    double now = a->score[a->recency ? SHADOW_LRU : SHADOW_LRU_K];
    double other = a->score[a->recency ? SHADOW_LRU_K : SHADOW_LRU];
    if (other > now * 1.02 + 1) {
        a->recency = !a->recency;
        a->switches++;
        rekey_all(e);
    }
}

void kvhi_adapt_access_slow(kvh_engine *e, uint32_t b)
{
    kvhi_adapt *a = &e->adapt;
    if (kvhi_adapt_sampled(a, b)) {
        static const kvhi_lruk_current_fn current[2] = {lru_current, lru_k_current};
        for (uint32_t s = 0; s < 2; s++) {
            kvhi_lruk_heap *h = &a->shadow[s];
            if (a->pos[s][b] != KVHI_HEAP_NONE) {
                a->hits[s]++;
                continue; /* a raise: the stored key stays a lower bound */
            }
            kvhi_lruk_upsert_lazy(h, b, shadow_key(e, s, b));
            if (kvhi_lruk_count(h) > a->cap)
                kvhi_lruk_remove(h, kvhi_lruk_top_current(h, current[s], e));
        }
    }
    if (--a->window_left == 0)
        decide(e);
}

void kvhi_adapt_forget_sampled(kvh_engine *e, uint32_t b)
{
    kvhi_adapt *a = &e->adapt;
    for (uint32_t s = 0; s < 2; s++)
        if (a->pos[s][b] != KVHI_HEAP_NONE)
            kvhi_lruk_remove(&a->shadow[s], b);
}
