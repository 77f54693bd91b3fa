/* The adaptive victim order (KVH_EVICT_ADAPTIVE, core/adaptive.c): plain
 * LRU or LRU-K, whichever a shadow simulation of the device tier finds
 * the better over a decayed count of its accesses. */
#ifndef KVH_CORE_ADAPTIVE_H
#define KVH_CORE_ADAPTIVE_H

#include <stdbool.h>
#include <stdint.h>

#include "core/lruk.h"

struct kvh_engine;

typedef struct kvhi_adapt {
    bool on;                  /* the engine's policy is KVH_EVICT_ADAPTIVE */
    bool recency;             /* the order now: plain LRU (else LRU-K) */
    uint32_t shift;           /* a block is simulated when its hash's top bits
                                 below this many are zero: a 2^-shift sample */
    uint32_t cap;             /* shadow capacity: the device tier's, sampled */
    uint32_t *pos[2];         /* per block: position in each shadow */
    kvhi_lruk_heap shadow[2]; /* [0] LRU, [1] LRU-K */
    int64_t lead;             /* LRU's shadow hits minus LRU-K's, decayed */
    uint64_t decay_left;      /* accesses until the lead next decays */
    uint64_t decay_every;     /* accesses between two decays */
    uint64_t quiet_left;      /* accesses before another switch may come */
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
    return a->shift == 0 || ((b * 0x9e3779b1u + 0x7f4a7c15u) >> (32 - a->shift)) == 0;
}
/* Shadow hits the other order must lead by to take over (see adaptive.c). */
#define KVHI_ADAPT_SWITCH_MARGIN 4
/* The shadows' part of an access, the lead's decay and the switch check. */
void kvhi_adapt_access_slow(struct kvh_engine *e, uint32_t b);
/* Whether the other order leads by enough to take over now. */
static inline bool kvhi_adapt_switch_due(const kvhi_adapt *a)
{
    return a->quiet_left == 0 &&
           (a->recency ? a->lead < -KVHI_ADAPT_SWITCH_MARGIN : a->lead > KVHI_ADAPT_SWITCH_MARGIN);
}
/* Block b was accessed (its history already records it). Inline: most
 * accesses only count down the decay and quiet periods; the slow path
 * does exactly the same for them otherwise. */
static inline void kvhi_adapt_access(struct kvh_engine *e, kvhi_adapt *a, uint32_t b)
{
    if (!a->on)
        return;
    if (kvhi_adapt_sampled(a, b) || a->decay_left == 1 || a->quiet_left == 1 || kvhi_adapt_switch_due(a)) {
        kvhi_adapt_access_slow(e, b);
        return;
    }
    a->decay_left--;
    if (a->quiet_left)
        a->quiet_left--;
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
static inline uint32_t kvhi_adapt_k(const kvhi_adapt *a, uint32_t lru_k) { return a->on && a->recency ? 1 : lru_k; }

#endif
