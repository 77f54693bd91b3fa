/* The engine's internal state, shared by the core modules.
 *
 * Concurrency: one engine mutex guards all metadata (blocks, sequences,
 * tiers, prefix index, fences). Bulk copies of migrations run with the
 * mutex released while the block is marked in flight; anything that would
 * modify or free such a block waits on `changed` until the copy is done. */
#ifndef KVH_CORE_ENGINE_H
#define KVH_CORE_ENGINE_H

#include <assert.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvh/kvh.h"
#include "core/backend.h"
#include "core/disk_index.h"
#include "core/handles.h"
#include "core/lruk.h"
#include "core/prefix_index.h"
#include "core/slot_pool.h"

#define KVHI_MAX_K 4
#define KVHI_NO_BLOCK UINT32_MAX
#define KVHI_NO_TIER 0xFFu

/* Block flags: lasting properties of a block, one bit each. What a copy
 * of its data is doing right now is its move state, a field in the top
 * bits of the same word (core/block_state.h), changed only through that
 * header's transitions. Bit 0x400 is free. */
#define KVHI_BF_LIVE 0x01u      /* meta entry in use */
#define KVHI_BF_PUBLISHED 0x02u /* in the prefix index (immutable) */
#define KVHI_BF_HINTED                                                                                                 \
    0x04u                           /* a prefetch hint names it, unused since                                          \
                                       (hint_priority; core/hints.c) */
#define KVHI_BF_PREFETCHED 0x08u    /* promoted by a hint, not yet used */
#define KVHI_BF_DEAD 0x10u          /* freed while busy; reap when it settles */
#define KVHI_BF_HASHED 0x20u        /* tokens full: hash is valid */
#define KVHI_BF_KV_COMPLETE 0x40u   /* every (layer, token) cell written */
#define KVHI_BF_PREFETCHING 0x80u   /* a hint's promotion is queued */
#define KVHI_BF_JOURNALED 0x100u    /* an index record names its disk slot */
#define KVHI_BF_DISK_COPY 0x200u    /* disk_copy holds a clean copy */
#define KVHI_BF_CORRUPT 0x800u      /* its disk data failed verification */
#define KVHI_BF_DISK_HASHED 0x1000u /* its disk header carries its hash */
#define KVHI_BF_MOVE_SHIFT 13       /* bits 13-15: enum kvhi_move_state */
#define KVHI_BF_MOVE_MASK (7u << KVHI_BF_MOVE_SHIFT)

/* Two cache lines, the first holding all that an access (touch, data
 * address) and a victim choice (key, evictability, heap positions) read:
 * at 10^7 blocks the records span over a GB, and each line of one is a
 * DRAM miss. Keep hot fields in the first line. */
typedef struct __attribute__((aligned(64))) kvhi_block {
    /* ---- hot: accesses and eviction ---- */
    uint64_t hist[KVHI_MAX_K]; /* access clock values, most recent first */
    uint32_t refs;
    uint32_t holds;
    uint32_t pins;
    uint32_t slot;
    uint32_t hits;           /* accesses since it last entered its tier */
    uint32_t heap_pos;       /* position in its tier's eviction heap */
    uint32_t quota_heap_pos; /* position in its agent's device heap */
    uint16_t flags;
    uint8_t tier;
    uint8_t tolerance; /* compression tolerance, for LCTRU (lctru.c) */
    /* ---- cold ---- */
    uint32_t gen;
    uint32_t ext_refs; /* the part of refs held through block handles */
    uint32_t agent;
    uint16_t n_tokens;
    uint8_t deferred_tier;
    uint8_t hint_epoch; /* its newest hint's epoch and freshness (hints.c) */
    uint64_t hash;      /* chained hash, valid with KVHI_BF_HASHED */
    uint64_t parent_hash;
    uint32_t disk_copy; /* disk slot of a clean copy (KVHI_BF_DISK_COPY) */
    /* A slot the block left while a disk copy was still being read from
     * it: freed when the copy ends (KVHI_NO_BLOCK: none). */
    uint32_t deferred_slot;
    uint32_t data_crc; /* CRC32C of the data on disk */
    uint32_t gen_hi;   /* generation above gen's 32 bits (kvhi_block_gen) */
    /* Bitmap [layer][token] of written KV cells. NULL means none written,
     * unless KVHI_BF_KV_COMPLETE says all are. */
    uint64_t *written;
    /* With KVHI_BF_HINTED (core/hints.c): the two highest distinct hint
     * priorities, the second KVHI_HINT_NONE when there is none. */
    int32_t hint_priority;
    int32_t hint_next;
} kvhi_block;
#define KVHI_HINT_NONE INT32_MIN
_Static_assert(offsetof(kvhi_block, gen) == 64, "kvhi_block: the hot fields fill exactly its first cache line");
_Static_assert(sizeof(kvhi_block) == 128, "kvhi_block: two cache lines");

/* The record's whole generation, which block handles carry as much of as
 * their index leaves room for. gen alone (never 0) is what internal
 * staleness checks compare. */
static inline uint64_t kvhi_block_gen(const kvhi_block *blk) { return (uint64_t)blk->gen_hi << 32 | blk->gen; }

typedef struct kvhi_tier {
    bool present;
    /* Holds blocks in the engine's kv_codec (host and disk tiers when a
     * codec is configured): slot_bytes is then the encoded size. */
    bool encoded;
    uint64_t slot_bytes;
    uint8_t *base; /* memory tiers */
    uint64_t bytes_mapped;
    /* The host tier lives in the device tier's arena (moves_in_place):
     * base is the arena's, slot numbers run across both, and the memory
     * is freed with the device tier. */
    bool shares_arena;
    kvhi_slot_pool slots;
    kvhi_lruk_heap heap; /* evictable blocks resident here */
    uint64_t pinned;
} kvhi_tier;

typedef struct kvhi_agent {
    uint32_t id;
    uint64_t quota_blocks; /* 0 = unlimited */
    uint64_t device_blocks;
    kvhi_lruk_heap heap; /* its evictable device blocks (quota agents) */
} kvhi_agent;

typedef struct kvhi_seq {
    uint32_t agent;
    uint32_t n_blocks;
    uint32_t cap_blocks;
    uint32_t *blocks; /* logical block -> block index */
    uint32_t *held;   /* acquire holds this sequence has on each block */
    uint32_t *pins;   /* pins this sequence took on each block: its own,
                         dropped with the block (truncate, free) */
    /* An owner's call (@threads handle) is inside: such calls may drop
     * the lock mid-way, and one overlapping them would see the sequence
     * half changed, so it is refused (abi/api_common.h). */
    bool owner_in_call;
    uint64_t n_tokens;
} kvhi_seq;

typedef struct kvhi_fence {
    uint32_t pending;
    uint32_t waiters; /* threads inside kvhi_fence_wait_idx */
    kvh_status status;
    bool user_freed;
    char msg[192]; /* detail of the first failure, from the failing thread */
} kvhi_fence;

/* What a queued move is for, which decides what a block pinned since it
 * was queued means. */
typedef enum kvhi_job_kind {
    KVHI_JOB_NEED,     /* acquire or a read: the block must arrive (pinned
                          elsewhere: KVH_ERR_BUSY) */
    KVHI_JOB_MOVE,     /* kvh_migrate, context switches: pinned is skipped */
    KVHI_JOB_PREFETCH, /* a hint: anything it cannot do is skipped */
} kvhi_job_kind;

typedef struct kvhi_job {
    uint32_t block;
    uint32_t block_gen;
    uint32_t fence; /* fence handle index, or KVHI_NO_BLOCK */
    uint32_t fence_gen;
    uint8_t target_tier;
    uint8_t kind; /* kvhi_job_kind */
    int32_t priority;
    uint64_t order; /* FIFO among equal priorities */
} kvhi_job;

struct kvh_engine {
    kvh_config cfg;
    uint64_t block_bytes;
    uint64_t layer_bytes; /* K+V of one layer in a block */
    uint32_t elem_bytes;
    uint64_t vector_bytes;     /* one raw K or V vector: head_dim elements */
    uint64_t enc_vector_bytes; /* the same vector in kv_codec */
    uint32_t tier_count;       /* tiers present, device first */
    uint64_t clock;            /* logical access clock */
    uint32_t gen_start;        /* random first generation of this engine's handles */

    const kvhi_backend_ops *backend;
    void *backend_ctx;
    /* The CPU reads and writes device-tier memory directly: the CPU
     * backend, or CUDA on unified memory (backend memory_is_unified). Data
     * paths test this; the choice of kernels tests the backend itself. */
    bool device_host_addressable;
    /* ... and it is the host's own physical memory (the CPU backend, an
     * integrated GPU): the tiers may be one arena (moves_in_place). */
    bool device_is_host_ram;
    /* Device and host tiers are one arena of the same memory: a block
     * moving between them keeps its bytes and slot and changes tier, the
     * destination tier giving a free slot back in exchange (evict.c). */
    bool moves_in_place;
    void *backend_dl;

    /* The engine lock guards all metadata and is the outermost lock:
     * nothing else is held when it is taken. Below it (docs/ARCHITECTURE.md
     * section 5): lock -> journal_lock -> pending_lock, lock ->
     * pending_lock, lock -> run_lock -> the CPU pool's lock; lane_lock,
     * spare_lock, numa_cache_lock and the CUDA locks are leaves. Debug
     * builds check who holds it (kvhi_assert_locked). */
    pthread_mutex_t lock;
    pthread_cond_t changed;  /* in-flight flags cleared, room appeared */
    pthread_cond_t fence_cv; /* a fence completed (waiters sleep here, so
                                per-block wake-ups do not reach them) */
    bool closing;
    uint32_t active_calls;

    kvhi_block *blocks;
    uint32_t block_cap;
    uint32_t *block_free; /* stack of free meta indices */
    uint32_t block_free_top;
    uint32_t blocks_retired;  /* records whose generations ran out */
    uint8_t block_index_bits; /* low bits of a block handle naming its record */
    int32_t *tokens;          /* block_cap * block_tokens token ids */

    kvhi_tier tiers[KVH_TIER_COUNT];
    kvhi_prefix_index prefix;

    kvhi_handle_table seqs;   /* -> kvhi_seq * */
    kvhi_handle_table fences; /* -> kvhi_fence * */
    kvhi_handle_table pools;  /* -> kvhi_ext_pool * */

    kvhi_agent *agents;
    uint32_t n_agents, cap_agents;

    /* migration workers */
    pthread_t *workers;
    uint32_t n_workers;
    pthread_cond_t work_ready;
    kvhi_job *jobs; /* binary heap by (priority desc, order asc) */
    uint32_t n_jobs, cap_jobs;
    uint64_t job_order;
    uint32_t jobs_running;
    /* Copies running with the lock dropped; a tier that finds no victim
     * while some are under way waits for them instead of failing. */
    uint32_t copies_in_progress;
    bool stop_workers;

    kvh_stats stats;

    /* Prefetch hints (core/hints.c): a record per hint, oldest first;
     * hints older than two epochs of hint_horizon accesses lapse. */
    struct kvhi_hint_record *hint_ring;
    uint32_t hint_head, hint_count, hint_cap;
    uint32_t hint_epoch;
    uint64_t hint_epoch_end; /* clock value that starts the next epoch */

    struct kvhi_disk *disk;        /* NULL without a disk tier */
    uint32_t clean_hand;           /* background cleaner's clock hand */
    uint64_t host_arrivals;        /* blocks placed in the host tier so far */
    uint64_t clean_epoch_seen;     /* host_arrivals at the last empty sweep */
    kvhi_index_list disk_recovery; /* index entries found at open */
    /* Log lines produced under the lock, emitted by kvhi_leave. */
    char pending_log[4][256];
    int pending_log_level[4];
    uint32_t n_pending_log;

    /* Attention state (kernels/: the CPU thread pool and scratch), made
     * lazily under the lock (kvhi_attn_state), freed by engine_free once
     * no call is active. */
    struct kvhi_attn_cpu *attn_state;

    /* ---- weight contexts and admission (core/context.h) ---- */
    struct kvhi_contexts *contexts; /* made on first use; NULL until then */
    /* The backend runs the CPU kernels (attention state lives here). */
    bool cpu_kernels;
    /* Virtual contiguity (vmap.c, vmap_backend.c): the device tier's
     * arena (NULL without kvh_config.vmap), its slab layout, the unit a
     * view maps, its backing ("hugetlb", "thp", "4k", "cuda-vmm"), and the
     * views not yet released. */
    void *vmap_arena;
    kvhi_slab_layout slab;
    uint64_t vmap_unit;
    const char *vmap_backing;
    kvhi_handle_table vmaps; /* -> kvhi_vmap * */
    /* Attention plans not yet destroyed (core/attention_plans.c). */
    kvhi_handle_table attn_plans; /* -> kvhi_attention_plan * */
};

/* ---- errors and logging (status.c) ---- */
kvh_status kvhi_fail(kvh_status status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void kvhi_clear_error(void);
/* This thread's detail of its last failure ("" after a success). */
const char *kvhi_last_error(void);
/* The text and the name of a status (KVH_STATUS_LIST). */
const char *kvhi_status_text(kvh_status status);
const char *kvhi_status_name(kvh_status status);
void kvhi_log(kvh_engine *e, int level, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Queues a log line while the lock is held (emitted after unlocking). */
void kvhi_log_later(kvh_engine *e, int level, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* ---- engine lifetime, lock and call accounting (engine.c) ---- */
uint32_t kvhi_dtype_bytes(uint32_t dtype);
/* Fills c with every default (struct_size = sizeof(kvh_config)). */
void kvhi_config_defaults(kvh_config *c);
/* Validates config (of the current size) and opens an engine on it. */
kvh_status kvhi_engine_open(const kvh_config *config, kvh_engine **out);
/* Waits for the calls inside e to leave, stops the workers, closes the
 * disk tier and frees e (lock not held). */
kvh_status kvhi_engine_close(kvh_engine *e);
/* Tier `tier` (< KVH_TIER_COUNT) as the caller sees it (lock held). */
void kvhi_tier_info(kvh_engine *e, uint32_t tier, kvh_tier_info *info);
/* Sets the device quota of agent and re-indexes its blocks (lock held). */
kvh_status kvhi_agent_set_quota(kvh_engine *e, uint32_t agent, uint64_t device_bytes);
/* Takes the lock and registers an in-flight API call; fails with
 * KVH_ERR_CLOSED when the engine is closing. */
kvh_status kvhi_enter(kvh_engine *e);
void kvhi_leave(kvh_engine *e);

/* Debug builds check the lock contract of a function: that the calling
 * thread holds the engine lock (kvhi_assert_locked), or does not (a copy
 * that must run without it: kvhi_assert_unlocked). kvhi_lock_held_by_caller
 * answers 1 or 0, or -1 where the C library cannot tell (no check). */
#ifdef NDEBUG
#define kvhi_assert_locked(e) ((void)(e))
#define kvhi_assert_unlocked(e) ((void)(e))
#else
int kvhi_lock_held_by_caller(kvh_engine *e);
#define kvhi_assert_locked(e) assert(kvhi_lock_held_by_caller(e) != 0 && "engine lock must be held")
#define kvhi_assert_unlocked(e) assert(kvhi_lock_held_by_caller(e) != 1 && "engine lock must not be held")
#endif
void kvhi_unlock_and_log(kvh_engine *e);
uint64_t kvhi_now_ns(void);

/* ---- blocks (block.c) ---- */
static inline kvhi_block *kvhi_blk(kvh_engine *e, uint32_t i) { return &e->blocks[i]; }
static inline int32_t *kvhi_block_tokens(kvh_engine *e, uint32_t i)
{
    return e->tokens + (uint64_t)i * e->cfg.block_tokens;
}
uint8_t *kvhi_block_data(kvh_engine *e, uint32_t i);
/* New empty block with refs=1, in the fastest tier at or below min_tier
 * that can make room (may evict; may drop the lock). */
kvh_status kvhi_block_new(kvh_engine *e, uint32_t agent, uint32_t min_tier, uint32_t *out);
void kvhi_block_place(kvh_engine *e, uint32_t b, uint32_t tier, uint32_t slot);
/* Frees now, or marks DEAD for the mover to reap when in flight. */
void kvhi_block_free_now(kvh_engine *e, uint32_t b);
/* Destroys an idle block but hands its slot to the caller. */
uint32_t kvhi_block_drop(kvh_engine *e, uint32_t b);
kvh_status kvhi_block_mark_written(kvh_engine *e, uint32_t b, uint32_t layer, uint32_t t0, uint32_t t1);
bool kvhi_block_cell_written(kvh_engine *e, uint32_t b, uint32_t layer, uint32_t t);
kvh_status kvhi_block_forget_tokens(kvh_engine *e, uint32_t b, uint32_t keep);
/* Ends the block's copy (KVHI_EV_COPY_END) and frees a slot it left
 * meanwhile. */
void kvhi_block_writing_done(kvh_engine *e, uint32_t b);
/* True when b's data in the device tier is usable now: resident and not
 * moving, or moving to disk but recalled (kvhi_block_recall). */
bool kvhi_block_in_device(const kvh_engine *e, uint32_t b);
/* Asks a block whose demotion to disk is in flight to stay where it is:
 * the move then commits as a clean disk copy (or nothing). False when b
 * is not in such a move. */
bool kvhi_block_recall(kvh_engine *e, uint32_t b);
/* Drops one reference; frees or leaves cached. */
void kvhi_block_unref(kvh_engine *e, uint32_t b);
/* Copy-on-write: returns a private copy of b (refs=1) replacing one ref. */
kvh_status kvhi_block_cow(kvh_engine *e, uint32_t b, uint32_t agent, uint32_t *out);
void kvhi_block_touch(kvh_engine *e, uint32_t b);
/* Blocks until b is not in flight (drops and retakes the lock). */
void kvhi_block_wait_idle(kvh_engine *e, uint32_t b);
void kvhi_block_try_publish(kvh_engine *e, uint32_t b);
bool kvhi_block_kv_complete(kvh_engine *e, uint32_t b);
uint64_t kvhi_block_handle(kvh_engine *e, uint32_t b);
kvh_status kvhi_block_resolve(kvh_engine *e, kvh_block h, uint32_t *out);
void kvhi_block_hold(kvh_engine *e, uint32_t b);
void kvhi_block_unhold(kvh_engine *e, uint32_t b);
void kvhi_block_pin(kvh_engine *e, uint32_t b, bool pin);
/* Recompute whether b belongs in an eviction heap. */
void kvhi_block_update_evictable(kvh_engine *e, uint32_t b);
/* b's victim-order key now (a kvhi_lruk_current_fn; engine as ctx). */
kvhi_lruk_key kvhi_block_current_key(void *engine, uint32_t b);

/* Prefetch hints as eviction protection (core/hints.c). */
/* b is predicted to be needed, at priority (higher: sooner). */
void kvhi_hint_set(kvh_engine *e, uint32_t b, int32_t priority);
/* b was used: its soonest hint is redeemed, the next one (if any) takes
 * its place. */
void kvhi_hint_redeem(kvh_engine *e, uint32_t b);
/* The victim-order key of a hinted block (above every unhinted one of its
 * class). */
kvhi_lruk_key kvhi_hint_key(const kvhi_block *blk, kvhi_lruk_key lruk);
void kvhi_hints_free(kvh_engine *e);
/* Starts a new hint epoch once its accesses have passed, retiring lapsed
 * hints (the access path calls it while any hint is recorded). */
void kvhi_hints_advance(kvh_engine *e);
kvhi_agent *kvhi_agent_get(kvh_engine *e, uint32_t id, bool create);
/* The agent, if it has a device quota and is at it (its blocks then make
 * room for its own in the device tier); else NULL. */
kvhi_agent *kvhi_agent_at_quota(kvh_engine *e, uint32_t id);

/* ---- tiers and eviction (evict.c; the moves are core/move.h) ---- */
/* Gets a free slot in tier t, evicting by policy. The lock may be dropped
 * and retaken. `for_agent` applies that agent's device quota. */
kvh_status kvhi_reserve_slot(kvh_engine *e, uint32_t tier, uint32_t for_agent, uint32_t *slot);
uint8_t *kvhi_slot_addr(kvh_engine *e, uint32_t tier, uint32_t slot);

/* ---- migration (migrate.c) ---- */
kvh_status kvhi_workers_start(kvh_engine *e);
void kvhi_workers_stop(kvh_engine *e);
/* Queues b -> tier; fence_idx may be KVHI_NO_BLOCK. */
kvh_status kvhi_enqueue(kvh_engine *e, uint32_t b, uint32_t tier, int32_t priority, kvhi_job_kind kind,
                        uint32_t fence_idx);
kvh_status kvhi_fence_new(kvh_engine *e, uint32_t *idx, kvh_fence *handle);
void kvhi_fence_done(kvh_engine *e, uint32_t fence_idx, kvh_status st);
/* n more completions the fence waits for (kvhi_fence_done each). */
void kvhi_fence_expect(kvh_engine *e, uint32_t idx, uint32_t n);
/* Records st as the fence's status unless one failed first. */
void kvhi_fence_record_failure(kvh_engine *e, uint32_t idx, kvh_status st, const char *msg);
/* [out] *done = 1 when complete; the first failure's status then. */
kvh_status kvhi_fence_poll_idx(kvh_engine *e, uint32_t idx, int32_t *done);
kvh_status kvhi_fence_wait_idx(kvh_engine *e, uint32_t idx, uint64_t timeout_ns);
void kvhi_fence_drop(kvh_engine *e, uint32_t idx);

/* ---- sequences (seq.c) ---- */
kvh_status kvhi_seq_get(kvh_engine *e, kvh_seq h, kvhi_seq **out);
/* Block range covering tokens [first, first + n). */
kvh_status kvhi_seq_block_range(kvh_engine *e, kvhi_seq *s, uint64_t first, uint64_t n, uint32_t *b0, uint32_t *b1);
void kvhi_seq_destroy(kvh_engine *e, kvhi_seq *s);
/* Frees s->blocks and s->held (engine teardown frees sequences without
 * touching their blocks). */
void kvhi_seq_tables_free(kvhi_seq *s);
kvh_status kvhi_seq_create(kvh_engine *e, uint32_t agent, kvh_seq *out);
kvh_status kvhi_seq_fork(kvh_engine *e, kvhi_seq *s, uint32_t agent, kvh_seq *out);
kvh_status kvhi_seq_append(kvh_engine *e, kvhi_seq *s, const int32_t *tokens, size_t n);
kvh_status kvhi_seq_tokens(kvh_engine *e, kvhi_seq *s, uint64_t first, size_t n, int32_t *out);
kvh_status kvhi_seq_write_kv(kvh_engine *e, kvhi_seq *s, uint32_t layer, uint64_t pos, size_t n, const void *k,
                             const void *v);
kvh_status kvhi_seq_read_kv(kvh_engine *e, kvhi_seq *s, uint32_t layer, uint64_t pos, size_t n, void *k, void *v);
kvh_status kvhi_seq_truncate(kvh_engine *e, kvhi_seq *s, uint64_t n_tokens);
kvh_status kvhi_seq_match_prefix(kvh_engine *e, kvhi_seq *s, const int32_t *tokens, size_t n, size_t *matched);
kvh_status kvhi_seq_acquire(kvh_engine *e, kvhi_seq *s, uint64_t first, uint64_t n, kvh_fence *fence);
/* Counts one block attached from the prefix index, found in tier_found. */
void kvhi_count_prefix_hit(kvh_engine *e, uint32_t tier_found);
kvh_status kvhi_seq_pin(kvh_engine *e, kvhi_seq *s, uint64_t first, uint64_t n, bool pin);
kvh_status kvhi_seq_release(kvh_engine *e, kvhi_seq *s, uint64_t first, uint64_t n);
kvh_status kvhi_seq_hint(kvh_engine *e, kvhi_seq *s, uint64_t first, uint64_t n, int32_t priority);
kvh_status kvhi_prefetch(kvh_engine *e, kvhi_seq *s, uint64_t first, uint64_t n, int32_t priority, kvh_fence *fence);
kvh_status kvhi_migrate_blocks(kvh_engine *e, const uint32_t *blocks, size_t n, uint32_t tier, kvh_fence *fence);

/* ---- disk tier (disk_tier.c) ---- */
kvh_status kvhi_disk_tier_open(kvh_engine *e, const kvh_config *cfg, const char *path);
kvh_status kvhi_disk_tier_recover(kvh_engine *e);
/* Writes a snapshot of the index (flush) and closes the store. */
kvh_status kvhi_disk_tier_close(kvh_engine *e, bool flush);
/* Block data transfer between any two tiers, run without the lock; the
 * descriptor is filled under the lock by kvhi_xfer_prepare. */
typedef struct kvhi_xfer {
    uint32_t block;
    uint32_t src_tier, src_slot, dst_tier, dst_slot;
    uint64_t hash, parent;
    uint32_t n_tokens;
    uint32_t data_crc; /* out for writes, expected for reads */
    bool published;    /* writes: immutable, so its slot may outlive a damaged index */
    int32_t tokens[256];
    int err; /* 0, -errno, or 1 for failed verification */
    const char *why;
    /* Device <-> host on one arena: nothing to transfer; src_slot is then
     * the slot the destination tier gave in exchange (moves_in_place). */
    bool in_place;
} kvhi_xfer;
/* Bookkeeping after a block reached or left the disk tier (lock held). */
void kvhi_disk_after_move(kvh_engine *e, uint32_t b, const kvhi_xfer *x, bool *keep_src_slot);
/* Forgets b's disk record (DEL record) and clean copy, if any. */
void kvhi_disk_forget(kvh_engine *e, uint32_t b);
/* A recalled demotion finished writing: b stays in memory and the slot it
 * was written to becomes its clean copy when it may be one (immutable,
 * written with its hash), else the slot is freed. */
void kvhi_disk_keep_as_copy(kvh_engine *e, uint32_t b, const kvhi_xfer *x);
kvh_status kvhi_disk_persist(kvh_engine *e, kvhi_seq *s);
/* One round of background cleaning (lock held, may drop); true if work
 * was done. */
bool kvhi_disk_clean_step(kvh_engine *e);
/* Reads and checks blocks on disk without moving them (lock may drop);
 * failures are marked corrupt. */
void kvhi_disk_verify(kvh_engine *e, const uint32_t *blocks, size_t n);

/* ---- tier representation under a KV codec (codec_tier.c) ---- */
/* Sets slot sizes and which tiers are encoded; validates the codec for
 * the geometry (KVH_ERR_INVALID_ARG). Called before the tiers exist. */
kvh_status kvhi_codec_tiers_init(kvh_engine *e);
/* Copies one block's data between two locations, converting between the
 * raw and encoded forms as the tiers need. A tier names the memory kind
 * and the form: KVH_TIER_DISK stands for a host staging buffer holding the
 * disk form, KVHI_RAW_HOST host memory holding the raw form.
 * Returns 0 or -1 (copy failure, out of memory). */
#define KVHI_RAW_HOST 3u
int kvhi_block_copy(kvh_engine *e, uint32_t dst_tier, void *dst, uint32_t src_tier, const void *src);
/* Offset and size of the cell (layer, kv, head, token) in a slot of tier. */
uint64_t kvhi_cell_offset(kvh_engine *e, uint32_t tier, uint32_t layer, uint32_t kv, uint32_t head, uint32_t token);
/* kv_copy of seq.c for a block in an encoded tier: user arrays shaped
 * [token][kv_head][head_dim] are encoded into (to_block) or decoded from
 * tokens [off, off + cnt) of one layer. Returns 0. */
int kvhi_codec_kv_copy(kvh_engine *e, uint32_t b, uint32_t layer, uint32_t off, uint32_t cnt, void *uk, void *uv,
                       bool to_block);
static inline uint64_t kvhi_cell_bytes(kvh_engine *e, uint32_t tier)
{
    return e->tiers[tier].encoded ? e->enc_vector_bytes : e->vector_bytes;
}

/* ---- LCTRU (lctru.c) ---- */
/* The eviction key of b under the engine's policy, from its LRU-K key. */
kvhi_lruk_key kvhi_evict_key(kvh_engine *e, const kvhi_block *blk, kvhi_lruk_key lruk);
/* Tolerances (lctru.c, lock held; tolerance <= KVH_TOLERANCE_MAX,
 * max_rel_error finite and >= 0). */
kvh_status kvhi_seq_set_tolerance(kvh_engine *e, kvhi_seq *s, uint64_t first, uint64_t n, uint32_t tolerance);
kvh_status kvhi_block_set_tolerance(kvh_engine *e, kvh_block block, uint32_t tolerance);
kvh_status kvhi_seq_derive_tolerance(kvh_engine *e, kvhi_seq *s, uint64_t first, uint64_t n, float max_rel_error);

/* ---- virtual contiguity (vmap.c) ---- */
/* Releases every view still open (lock not needed: no call is active);
 * the arena goes with the device tier (vmap_backend.c). */
void kvhi_vmap_engine_free(kvh_engine *e);

/* ---- external pools (ext_pool.c) ---- */
void kvhi_pools_destroy(kvh_engine *e);

/* ---- weight contexts (context.c) ---- */
/* Frees contexts and their weight memory (engine_free, nothing active). */
void kvhi_contexts_free(kvh_engine *e);
/* Makes host-tier room by dropping one clean weight region kept there
 * (lock held); false when there is none. */
bool kvhi_drop_clean_host_region(kvh_engine *e, bool allow_loading);

#endif
