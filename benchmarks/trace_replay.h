/* Replays a block-access trace through the real engine (public API, CPU
 * backend, tiny geometry) so that hit rates of "kvh's policy" come from the
 * library, not from a model of it.
 *
 * Each trace sequence becomes a kvh sequence; the first access of a block
 * appends its tokens (and writes its K/V), every later access is
 * kvh_seq_acquire + kvh_seq_release of the block's tokens. The engine has a
 * device tier of D blocks, a host tier of H blocks and a disk tier under
 * dir large enough for every block (the backing store). Hits are read from
 * kvh_engine_stats around each access; first accesses count as misses, as
 * in the simulator. When hints prefetch, hits are counted by fetches
 * instead (policy_sim.h): device hits = accesses - first accesses - blocks
 * moved host to device, memory hits likewise with blocks read from disk. */
#ifndef KVH_BENCH_TRACE_REPLAY_H
#define KVH_BENCH_TRACE_REPLAY_H

#include <stdbool.h>
#include <stdint.h>

#include "policy_sim.h"
#include "trace.h"

typedef struct replay_config {
    uint32_t device_blocks;
    uint32_t host_blocks;
    uint32_t lru_k;       /* 0: the engine's default */
    const char *disk_dir; /* existing directory; a store is made inside */
    int skip_kv_write;    /* 1: a first access only appends (no K/V write),
                             to see what the write's own access costs the
                             policy */
    int lru_k_order;      /* 1: eviction_policy KVH_EVICT_LRU_K (the
                             default before the adaptive one) */
    int hints;            /* 1: the trace's hints become kvh_seq_hint
                             calls (advice), 2: kvh_prefetch calls (which
                             also promote), 3-5: kvh_seq_hint_queued calls
                             (REPLAY_QUEUE_*); blocks not made yet are left
                             out */
    /* With hints 2: 0, every hint is a kvh_prefetch; N > 0, hints are
     * advice (kvh_seq_hint) and before each access the block that the
     * access N later reads is kvh_prefetch-ed when a hint has named it
     * since its last access: the window a caller prefetches, within what
     * its queue names (the simulator's prefetch_ahead). */
    uint32_t prefetch_ahead;
} replay_config;

/* Queue hints (kvh_seq_hint_queued) in the three ways a scheduler can
 * give them: the generated traces' priorities are INT32_MAX - turn, and
 * each batch of hints (one before every turn) starts a new step
 * (kvh_hint_advance). By position: the place of the turn in the queue
 * now; by request: the turn's number; on entry: each turn's hints only
 * the first time the queue shows it. */
enum { REPLAY_QUEUE_POSITION = 3, REPLAY_QUEUE_REQUEST = 4, REPLAY_QUEUE_ON_ENTRY = 5 };

typedef struct replay_result {
    sim_result sim; /* hits and block transfers as the engine counted */
    uint64_t block_bytes;
    double seconds;
    /* Accesses of blocks made before (not first accesses) whose acquire
     * found the block outside the device tier and waited for its move,
     * and the time acquires spent waiting (kvh_stats.acquire_stall_ns;
     * with the replay's synchronous moves, the copies themselves). With
     * prefetch, the accesses a prefetch served no longer wait: the stall
     * it saves is advice's waits minus these. */
    uint64_t waits;
    uint64_t stall_ns;
} replay_result;

/* Returns 0, or 1 after printing why on stderr. */
int trace_replay(const trace *t, const replay_config *c, replay_result *out);

/* Blocks the replay appends: each sequence up to its highest index read,
 * since a sequence is contiguous (UINT64_MAX without memory). */
uint64_t trace_replay_blocks(const trace *t);
/* Of those, the blocks appended before the trace first reads them (read
 * out of index order, or never): they take tier space in the engine
 * replay that the simulators never give them, so kvh-engine rows replay
 * a different workload (0 for every generated and recorded trace;
 * UINT64_MAX without memory). */
uint64_t trace_replay_padded(const trace *t);
/* Whether that many are a sane replay of t: block indices far past what
 * the trace reads ("0 4000000000") would append billions of blocks no
 * access names, for hours. */
bool trace_replay_fits(const trace *t, uint64_t blocks);

#endif
