/* Eviction-policy simulator for a two-tier memory hierarchy (device tier of
 * D blocks above a host tier of H blocks) over a backing store that holds
 * every block (the disk tier, or recomputation).
 *
 * The hierarchy is exclusive: a block is in the device tier, the host tier
 * or the backing store. An access finds the block in one of them (a device
 * hit, a host hit, or a miss; the first access of a block is a miss, it is
 * computed in the device tier). Promotion moves the block to the device
 * tier; the device victim goes down to the host tier, whose victim goes
 * down to the backing store. Each policy chooses victims in both tiers
 * with the same rule:
 *
 *   lru         least recently used
 *   lru-k       largest backward K-distance (time of the K-th most recent
 *               access; blocks with fewer than K accesses first), ties by
 *               least recent use: the engine's rule (core/lruk.c)
 *   lru-k-hyst  lru-k, and a block below the device tier is promoted only
 *               when it has hyst_hits accesses within the last hyst_window
 *               accesses; otherwise it is read where it is (a host hit,
 *               moving nothing but the read), or brought from the backing
 *               store into the host tier only
 *   lru-k+hints lru-k with the trace's prefetch hints, as the engine
 *               takes them (core/hints.c): a hinted block ranks above
 *               every unhinted one, lower priorities first; it keeps its
 *               two highest distinct priorities, the first access after a
 *               hint redeems the higher (kvh_seq_hint). With hint_promote, a hint also
 *               promotes the block when the device victim is of a lower
 *               priority class (kvh_prefetch); with prefetch_ahead, only
 *               the named blocks of a window of the next reads are
 *               promoted
 *   lctru       least compression-tolerable and recently used: among the
 *               lctru_window least recently used blocks, the one with the
 *               lowest compression tolerance (ties: least recent)
 *   reuse       protected reuse (core/adaptive.h, kvhi_adapt_reuse_key): a
 *               block whose last two accesses came within 3 x D accesses
 *               of each other goes after every other, then by the second
 *               last access, then the last (needs lru_k >= 2)
 *   adaptive    the engine's default (core/adaptive.c): shadows of lru,
 *               lru-k and reuse on a device tier of D blocks count their
 *               hits (halved every 32 x (D + H) accesses); the order in
 *               force (first lru-k) gives way to the one with the most
 *               once it leads by more than 4, and no other switch comes
 *               for as many accesses as there are blocks then (what the
 *               engine re-keys). Exact for D <= 2048 (the engine samples
 *               larger tiers)
 *
 * Optimum (min): for each tier boundary separately, Belady's MIN with
 * bypass (on a miss, of the cached blocks and the requested one, the one
 * whose next use is farthest is not kept). It is the exact maximum of hits
 * for a cache of that size over all policies, including ones that prefetch
 * or bypass. Device hits of MIN = MIN(D) hits; memory hits (device or host)
 * = MIN(D + H) hits; its host hits are the difference. Every policy above
 * has device hits <= MIN(D) and memory hits <= MIN(D + H).
 *
 * A prefetch brings a block up before its access, which then finds it in
 * the device tier; so that such a move is not free, lru-k+hints with
 * hint_promote counts hits by fetches: hits_device = accesses - first
 * accesses - up_dh (floored at 0), memory hits likewise with up_sh. For a
 * policy that moves only on demand these equal its hits; for one that
 * prefetches, MIN still bounds them (it minimises fetches).
 *
 * Traffic is counted in block transfers across each boundary: up_dh (host
 * to device, including reads served in place from the host tier), down_dh,
 * up_sh (store to host), down_sh. For MIN only the inbound lower bound is
 * given: every access that is neither a device hit nor a first access
 * (computed in the device tier) crosses the device/host boundary once,
 * every miss that is not a first access is read from the store once. */
#ifndef KVH_BENCH_POLICY_SIM_H
#define KVH_BENCH_POLICY_SIM_H

#include <stdint.h>

#include "trace.h"

typedef enum sim_policy {
    SIM_LRU,
    SIM_LRU_K,
    SIM_LRU_K_HYST,
    SIM_LCTRU,
    SIM_LRU_K_HINTS,
    SIM_REUSE,
    SIM_ADAPTIVE,
    SIM_POLICY_COUNT
} sim_policy;

const char *sim_policy_name(sim_policy p);

typedef struct sim_config {
    uint32_t device_blocks; /* >= 1 */
    uint32_t host_blocks;   /* may be 0 */
    uint32_t lru_k;         /* 1..4; default 2 (the engine's default) */
    uint32_t hyst_hits;     /* default 2 */
    uint32_t hyst_window;   /* accesses; 0: 4 x device_blocks */
    uint32_t lctru_window;  /* default 8 */
    int hint_promote;       /* lru-k+hints: hints promote; default 0 */
    /* With hint_promote: 0, every hint promotes (kvh_prefetch given each
     * hint as it comes); N > 0, hints are advice and, before each access,
     * the block that the access N later reads is prefetched (hinted again
     * and promoted by the same rule) when a hint has named it since its
     * last access: a caller that prefetches a window of N reads ahead,
     * within what its queue names (trace_replay.h). Default 0. */
    uint32_t prefetch_ahead;
} sim_config;

void sim_config_defaults(sim_config *c, uint32_t device_blocks, uint32_t host_blocks);

typedef struct sim_result {
    uint64_t accesses;
    uint64_t first_accesses; /* compulsory misses */
    uint64_t hits_device;
    uint64_t hits_host;
    uint64_t misses; /* includes first accesses */
    uint64_t up_dh, down_dh, up_sh, down_sh;
} sim_result;

/* Recounts r's hits by fetches (see above; floored at 0): hits_device =
 * accesses - first accesses - up_dh, memory hits likewise with up_sh. */
void sim_hits_by_fetches(sim_result *r);

/* Replays t through policy p. Returns 0, or -1 when out of memory. */
int sim_run(const trace *t, sim_policy p, const sim_config *c, sim_result *out);

/* Hits of Belady's MIN with bypass for a cache of `capacity` blocks.
 * Returns the hit count, or UINT64_MAX when out of memory. */
uint64_t sim_min_hits(const trace *t, uint32_t capacity);

/* MIN for the hierarchy, as defined above (hits per tier, inbound lower
 * bound of traffic in up_dh / up_sh; down_* are 0). */
int sim_min(const trace *t, const sim_config *c, sim_result *out);

#endif
