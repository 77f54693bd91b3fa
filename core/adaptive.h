/* The adaptive victim order (KVH_EVICT_ADAPTIVE, core/adaptive.c): plain
 * LRU, LRU-K or the protected-reuse order, whichever a shadow simulation
 * of the device tier finds the best over a decayed count of its accesses. */
#ifndef KVH_CORE_ADAPTIVE_H
#define KVH_CORE_ADAPTIVE_H

#include <stdbool.h>
#include <stdint.h>

#include "core/lruk.h"

struct kvh_engine;

/* The orders the adaptive policy chooses from. */
enum {
    KVHI_ADAPT_LRU,   /* plain LRU: by the last access */
    KVHI_ADAPT_LRU_K, /* LRU-K: by the K-th last access */
    KVHI_ADAPT_REUSE, /* protected reuse: see kvhi_adapt_reuse_key */
    KVHI_ADAPT_ORDERS
};

typedef struct kvhi_adapt {
    bool on;          /* the engine's policy is KVH_EVICT_ADAPTIVE */
    uint8_t order;    /* the order now (KVHI_ADAPT_*) */
    uint8_t best;     /* the order with the most shadow hits */
    uint8_t n_orders; /* orders simulated: REUSE needs K >= 2 */
    /* REUSE: the longest reuse interval that protects a block (accesses). */
    uint64_t reuse_period;
    uint32_t shift;        /* a block is simulated when its hash's top bits
                              below this many are zero: a 2^-shift sample */
    uint32_t cap;          /* shadow capacity: the device tier's, sampled */
    uint64_t sample_below; /* the same: its hash is below 2^(32 - shift) */
    /* Per order: each block's position in its shadow, the shadow, and its
     * hits, decayed. */
    uint32_t *pos[KVHI_ADAPT_ORDERS];
    kvhi_lruk_heap shadow[KVHI_ADAPT_ORDERS];
    int64_t hits[KVHI_ADAPT_ORDERS];
    /* decay_left and quiet_left (where not 0) leave out fast_left: the
     * slow path takes the accesses it grants the inline path off them
     * beforehand, and gives back those not taken. */
    uint64_t decay_left;  /* accesses until the hits next decay */
    uint64_t decay_every; /* accesses between two decays */
    uint64_t quiet_left;  /* accesses before another switch may come */
    /* Accesses the inline path may still take without the slow path:
     * none sampled, no decay, no end of a quiet period, no switch due. */
    uint64_t fast_left;
    uint64_t switches;
} kvhi_adapt;

/* Sets the policy up for engine e (after its tiers and block records);
 * 0, or -1 out of memory. Does nothing unless the policy is adaptive. */
int kvhi_adapt_init(struct kvh_engine *e);
void kvhi_adapt_free(struct kvh_engine *e);
/* Whether block b is in the simulated sample. The offset keeps the first
 * block records, which a lightly loaded engine reuses most (its free list
 * hands them out first), out of it: an alloc+free loop on a sampled record
 * pays the shadows' update on every pair. */
static inline bool kvhi_adapt_sampled(const kvhi_adapt *a, uint32_t b)
{
    return (uint64_t)(b * 0x9e3779b1u + 0x7f4a7c15u) < a->sample_below;
}
/* Shadow hits another order must lead by to take over (see adaptive.c). */
#define KVHI_ADAPT_SWITCH_MARGIN 4
/* The shadows' part of an access, the hits' decay and the switch check. */
void kvhi_adapt_access_slow(struct kvh_engine *e, uint32_t b);
/* Whether the best order leads the one in force by enough to take over. */
static inline bool kvhi_adapt_switch_due(const kvhi_adapt *a)
{
    return a->quiet_left == 0 && a->hits[a->best] - a->hits[a->order] > KVHI_ADAPT_SWITCH_MARGIN;
}
/* Accesses before another switch may come, the inline path's counted. */
static inline uint64_t kvhi_adapt_quiet_left(const kvhi_adapt *a)
{
    return a->quiet_left ? a->quiet_left + a->fast_left : 0;
}
/* Block b was accessed (its history already records it). Inline: most
 * accesses only count down the decay and quiet periods, which the slow
 * path settles (fast_left says how many may come before it must run).
 * Under the REUSE order an access can lower a block's key (a long gap
 * ends its protection), which the heaps must take at once: the slow path
 * does (fast_left is 0 under that order). */
static inline void kvhi_adapt_access(struct kvh_engine *e, kvhi_adapt *a, uint32_t b)
{
    if (!a->on)
        return;
    if (kvhi_adapt_sampled(a, b) || a->fast_left == 0) {
        kvhi_adapt_access_slow(e, b);
        return;
    }
    a->fast_left--;
}
void kvhi_adapt_forget_sampled(struct kvh_engine *e, uint32_t b);
/* Block b is gone. Only sampled blocks enter the shadows: the rest need
 * not touch their position words (two cache misses when frees come at
 * random). */
static inline void kvhi_adapt_forget(struct kvh_engine *e, kvhi_adapt *a, uint32_t b)
{
    if (a->on && kvhi_adapt_sampled(a, b))
        kvhi_adapt_forget_sampled(e, b);
}
/* The K the victim order reads now: 1 for plain LRU. */
static inline uint32_t kvhi_adapt_k(const kvhi_adapt *a, uint32_t lru_k)
{
    return a->on && a->order == KVHI_ADAPT_LRU ? 1 : lru_k;
}
/* Protected reuse, after LIRS's low inter-reference recency set: a block
 * whose last two accesses came within `period` accesses of each other is
 * protected (bit 61, below the hinted bit 62 of core/hints.c), and the
 * unprotected go first; within a class, by the second last access
 * (LRU-2), then the last. A block read once is unprotected. Where many
 * requests share a prefix and each also re-reads its own long context
 * once per turn, LRU-2 can rank a context block read twice far apart
 * (a recent second last access) above a shared block read in a burst a
 * while ago; this ranks the shared block first. Not monotone: an access
 * after a long gap lowers the key (core/adaptive.c). hist holds at least
 * two entries. */
static inline kvhi_lruk_key kvhi_adapt_reuse_key(const uint64_t *hist, uint64_t period, int referenced)
{
    uint64_t protect = hist[1] != 0 && hist[0] - hist[1] <= period;
    kvhi_lruk_key k = {.primary = ((uint64_t)(referenced ? 1 : 0) << 63) | (protect << 61) | hist[1],
                       .secondary = hist[0]};
    return k;
}
/* The victim key of an access history (k entries) under the order in
 * force: kvhi_lruk_key_of's, or the REUSE key. */
static inline kvhi_lruk_key kvhi_adapt_key(const kvhi_adapt *a, const uint64_t *hist, uint32_t lru_k, int referenced)
{
    if (a->on && a->order == KVHI_ADAPT_REUSE)
        return kvhi_adapt_reuse_key(hist, a->reuse_period, referenced);
    return kvhi_lruk_key_of(hist, kvhi_adapt_k(a, lru_k), referenced);
}

#endif
