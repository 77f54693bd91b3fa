/* The engine's internal state: struct kvh_engine, the tiers it embeds,
 * its lifetime, lock and call accounting. What each module owns is in
 * its own header: block records (core/block.h, their move state
 * core/block_state.h), tiers and eviction (core/tier.h), moves
 * (core/move.h), fences and workers (core/migrate.h), sequences
 * (core/seq.h), the disk tier (core/disk_tier.h), codec tiers
 * (core/codec_tier.h), LCTRU (core/lctru.h).
 *
 * Concurrency: one engine mutex guards all metadata (blocks, sequences,
 * tiers, prefix index, fences). Bulk copies of migrations run with the
 * mutex released while the block is marked in flight; anything that would
 * modify or free such a block waits on `changed` until the copy is done. */
#ifndef KVH_CORE_ENGINE_H
#define KVH_CORE_ENGINE_H

#include <assert.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <errno.h>
#include <stdint.h>
#include <time.h>

#include "kvh/kvh.h"
#include "core/backend.h"
#include "core/disk_index.h"
#include "core/handles.h"
#include "core/latency.h"
#include "core/lruk.h"
#include "core/adaptive.h"
#include "core/clean_copy.h"
#include "core/block_map.h"
#include "core/prefix_index.h"
#include "core/slot_pool.h"
#include "core/process_fork.h"

#define KVHI_MAX_K 4
#define KVHI_NO_BLOCK UINT32_MAX
#define KVHI_NO_TIER 0xFFu
/* Block releases checked but not yet applied to their records, at most
 * (core/block.c): enough calls for a record's prefetch to arrive. A
 * random read of memory takes 170-290 ns on this kind of VM (kvh-bench
 * scale's memory_read row), a release about 25: 8 left the last of it
 * exposed; 32 gave random frees 0.245 of the free list against 0.201. */
#define KVHI_RELEASE_BACKLOG 32u
/* Leads the background cleaner keeps (core/disk_tier.h). */
#define KVHI_CLEAN_LEADS 256u

/* Defined in the module headers that own them (core/block.h,
 * core/tier.h, core/migrate.h, core/seq.h). */
typedef struct kvhi_block kvhi_block;
typedef struct kvhi_agent kvhi_agent;
typedef struct kvhi_job kvhi_job;

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
    /* The host tier's spare slot (core/host_spare.h): KVHI_NO_BLOCK when
     * there is none or it is lent (host_spare_lent). */
    bool host_spare_wanted;
    bool host_spare_lent;
    uint32_t host_spare;
    void *backend_dl;

    /* The engine lock guards all metadata and is the outermost lock:
     * nothing else is held when it is taken. Below it (docs/ARCHITECTURE.md
     * section 5): lock -> journal_lock -> pending_lock, lock ->
     * pending_lock, lock -> run_lock -> the CPU pool's lock; lane_lock,
     * spare_lock and the CUDA locks are leaves. Debug
     * builds check who holds it (kvhi_assert_locked). */
    pthread_mutex_t lock;
    pthread_cond_t changed;  /* in-flight flags cleared, room appeared */
    pthread_cond_t fence_cv; /* a fence completed (waiters sleep here, so
                                per-block wake-ups do not reach them) */
    bool closing;
    uint32_t active_calls;
    /* kvhi_fork_generation() at open: another value means this is a copy
     * in a child process (core/process_fork.h). */
    uint32_t fork_generation;

    kvhi_block *blocks;
    uint32_t block_cap;
    uint32_t *block_free; /* stack of free meta indices */
    uint32_t block_free_top;
    uint32_t blocks_retired; /* records whose generations ran out */
    /* Per record: threads reading its data without the lock where they
     * found it (kvhi_block_hold_reading); and the slots such blocks moved out
     * of meanwhile, freed when the last of those reads ends. */
    uint32_t *block_readers;
    struct kvhi_read_slot *read_slots;
    uint32_t n_read_slots, cap_read_slots;
    uint8_t block_index_bits; /* low bits of a block handle naming its record */
    int32_t *tokens;          /* block_cap * block_tokens token ids */
    /* kvh_block_release's own state (core/block.c): per record, what a
     * release may take on trust without reading the record, and the
     * releases so checked whose work on the records is still to do. */
    uint32_t *block_release_keys;
    uint64_t release_backlog[KVHI_RELEASE_BACKLOG]; /* the handles released */
    uint32_t release_backlog_head;
    uint32_t release_backlog_len;
    uint32_t block_newest; /* the record kvhi_block_new handed out last */
    /* What blocks named by handles carry beyond their records
     * (core/block.c): the durable twin each keeps (a published block of
     * its prefix that kvh_blocks_persist made durable in its place, one
     * reference per entry), and the pins taken through handles (a
     * sequence's pins are its own, kvhi_seq.pins). */
    kvhi_block_map handle_twins;
    kvhi_block_map handle_pins;

    kvhi_tier tiers[KVH_TIER_COUNT];
    kvhi_prefix_index prefix;

    kvhi_handle_table seqs;   /* -> kvhi_seq * */
    kvhi_handle_table fences; /* -> kvhi_fence * */
    kvhi_handle_table pools;  /* -> kvhi_ext_pool * */

    kvhi_agent *agents;
    uint32_t n_agents, cap_agents;
    /* agents by id: open addressing, 1 + the index into agents, 0 empty;
     * at most half full (kvhi_agent_get) */
    uint32_t *agent_index;
    uint32_t agent_index_cap;

    /* migration workers */
    pthread_t *workers;
    uint32_t n_workers;
    cpu_set_t numa_cpus; /* kvh_config.numa_node's CPUs, for the workers */
    bool numa_cpus_known;
    pthread_cond_t work_ready;
    kvhi_job *jobs; /* binary heap by (priority desc, order asc) */
    uint32_t n_jobs, cap_jobs;
    /* Queued jobs that are no prefetch, by target tier: a search for a
     * queued move out of a tier (core/migrate.c) ends at once when no job
     * targets a tier above it. */
    uint32_t jobs_to_tier[KVH_TIER_COUNT];
    uint64_t job_order;
    uint32_t jobs_running;
    /* Copies running with the lock dropped; a tier that finds no victim
     * while some are under way waits for them instead of failing. */
    uint32_t copies_in_progress;
    bool stop_workers;
    /* Batched pool transfers and persists (core/pool_batch.c), FIFO, run
     * by the workers before queued moves. */
    struct kvhi_pool_work *pool_work_head, *pool_work_tail;

    kvh_stats stats;
    kvhi_latency latency; /* core/latency.h: recorded without the lock */

    /* Prefetch hints (core/hints.c): a record per hint, oldest first;
     * hints older than two epochs of hint_horizon accesses lapse. */
    struct kvhi_hint_record *hint_ring;
    uint32_t hint_head, hint_count, hint_cap;
    uint32_t hint_epoch;
    uint64_t hint_epoch_end; /* clock value that starts the next epoch */
    /* Queue hints (core/hint_queue.c): the step count, and a min-heap by
     * request of the (block, request) pairs still to retire. */
    uint64_t qhint_step;
    struct kvhi_queue_hint *qhint_heap;
    uint32_t qhint_count, qhint_cap;

    kvhi_adapt adapt; /* KVH_EVICT_ADAPTIVE's shadows (core/adaptive.c) */

    struct kvhi_disk *disk;       /* NULL without a disk tier */
    struct kvhi_remote *remote;   /* NULL without a remote tier (core/remote_tier.h) */
    uint32_t clean_hand;          /* background cleaner's clock hand */
    uint32_t copy_give_back_hand; /* kvhi_disk_give_back_copy's clock hand */
    uint64_t disk_copy_count;     /* blocks with KVHI_BF_DISK_COPY (kvh_tier_info) */
    /* Those blocks, densely ([disk_copy_count]), and per disk slot its
     * copy's place in that list: the searches for a copy to give back or
     * a victim that can leave onto its copy walk the copies, not every
     * block record (core/disk_tier.c). */
    uint32_t *disk_copy_list;
    uint32_t *disk_copy_at;
    uint64_t disk_copies_writing;   /* disk slots of copies being written, counted with them there */
    uint32_t workers_waiting_room;  /* in kvhi_wait_queued_moves_out or waiting for a busy block */
    uint64_t queued_move_waits;     /* its waits */
    uint64_t queued_moves_run_here; /* moves it ran itself, no other worker being free */
    /* The background cleaner's leads (core/disk_tier.h): host blocks that
     * may have become cleanable since it last looked (a ring, the oldest
     * overwritten when full), and the records its clock hand may still
     * scan for those that became so unseen. Both grow with each lead, so
     * a sweep costs in proportion to what happened, not to the table. */
    uint32_t clean_leads[KVHI_CLEAN_LEADS];
    uint32_t clean_leads_head, clean_leads_len;
    uint32_t clean_scan_credit;
    /* Promotions from disk paid into the credit since a worker was last
     * woken for it (core/move.c): one wake per KVHI_CLEAN_PAYS_PER_WAKE. */
    uint32_t clean_pays_unwoken;
    /* The filesystem under the disk tier refused a slab write (ENOSPC):
     * background cleaning rests until disk_full_until (kvhi_now_ns), the
     * rest doubling with each refusal (core/disk_tier.c). 0: no refusal
     * since the last write that worked. */
    uint64_t disk_full_until;
    uint32_t disk_full_rest_ms;
    kvhi_index_list disk_recovery; /* index entries found at open */
    /* The journal has grown past its bound: the next call to leave folds
     * it into a new snapshot (kvhi_disk_fold_journal). */
    bool disk_fold_due;
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
    /* Host slots kept as clean copies of promoted blocks (core/clean_copy.h). */
    kvhi_clean_copies clean;
    /* Disk-copy batches being written with the lock dropped (core/disk_tier.c),
     * so that the victim choice can tell an unreferenced block that is only
     * busy for a while from none at all. */
    struct kvhi_disk_copy_batch *disk_copy_batches;
    uint64_t victim_copy_waits; /* times a victim choice waited for one such copy */
    /* With a remote tier that uploads: per record, the part of refs held by
     * uploads (core/remote_upload.c). A caller holds none of them, so the
     * victim order of a memory tier does not count them; in tiers from
     * upload_refs_tier_end on (the last, where a block with any reference
     * cannot leave at all) they count. The blocks an upload holds busy
     * meanwhile are listed in upload_busy, like disk_copy_batches. */
    uint32_t *upload_refs;
    uint32_t upload_refs_tier_end;
    struct kvhi_upload_busy *upload_busy;
};

/* ---- errors and logging (status.c) ---- */
kvh_status kvhi_fail(kvh_status status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* This thread's detail of its last failure (kvhi_last_error). */
extern _Thread_local char kvhi_error_detail[1024] __attribute__((visibility("hidden")));
/* Inline: every call clears it on entry, and a shared library reaches a
 * thread-local through a call to the C library each time. */
static inline void kvhi_clear_error(void) { kvhi_error_detail[0] = '\0'; }
/* This thread's error detail, kept across an inner attempt whose own
 * reason is not the caller's to report: a clean-up after a failure, or a
 * first try that a second way then makes good. */
typedef struct {
    char text[sizeof(kvhi_error_detail)];
} kvhi_error_kept;
void kvhi_error_keep(kvhi_error_kept *k);
void kvhi_error_put_back(const kvhi_error_kept *k);
/* A log sink's calls back into its engine: the sink runs user code, which
 * may call kvh. Marks the calling thread as one kvh started for e (a
 * migration worker, a context switch's, the uploader). */
void kvhi_thread_started_for(kvh_engine *e);
/* Calls e's sink with the thread marked as inside it. */
void kvhi_sink_call(kvh_engine *e, int level, const char *message);
/* Whether this thread is inside e's sink. */
bool kvhi_in_sink_of(const kvh_engine *e);
/* Whether this thread is one kvh started for e (kvhi_thread_started_for). */
bool kvhi_thread_is_engines(const kvh_engine *e);
/* Why kvhi_enter_allowed refuses e: a copy in a child process
 * (KVH_ERR_UNSUPPORTED), or e's sink, on a thread kvh started for e,
 * calling into e (KVH_ERR_BUSY: the call could wait for that thread);
 * KVH_OK when neither. */
kvh_status kvhi_enter_refused(kvh_engine *e);
/* Clears the last error and refuses what kvhi_enter_refused says. Inline,
 * and the sink's thread-locals are read only for an engine with a sink:
 * this runs on every call, the cheapest of which (an alloc, a release)
 * cost little more than the lock. */
static inline kvh_status kvhi_enter_allowed(kvh_engine *e)
{
    kvhi_clear_error();
    if (__builtin_expect(e->fork_generation != kvhi_fork_generation() || e->cfg.log_fn, 0))
        return kvhi_enter_refused(e);
    return KVH_OK;
}
/* This thread's detail of its last failure ("" after a success). */
const char *kvhi_last_error(void);
/* The text and the name of a status (KVH_STATUS_LIST). */
const char *kvhi_status_text(kvh_status status);
const char *kvhi_status_name(kvh_status status);
/* Why st failed, for work that reports it later (a fence, a context
 * switch): this thread's detail, or st's text where the step set none. */
static inline const char *kvhi_failure_text(kvh_status st)
{
    const char *why = kvhi_last_error();
    return why[0] ? why : kvhi_status_text(st);
}
void kvhi_log(kvh_engine *e, int level, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Queues a log line while the lock is held (emitted after unlocking). */
void kvhi_log_later(kvh_engine *e, int level, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* ---- engine lifetime, lock and call accounting (engine.c) ---- */
uint32_t kvhi_dtype_bytes(uint32_t dtype);
/* x / d rounded up (d > 0), for any x: (x + d - 1) / d wraps near 2^64. */
static inline uint64_t kvhi_div_ceil(uint64_t x, uint64_t d) { return x / d + (x % d != 0); }
/* Whether an I/O failed with -err for want of room: the file system is
 * full, the user's disk quota is (EDQUOT), or a slab would pass the
 * process's file size limit (EFBIG, RLIMIT_FSIZE), which a caller meets
 * the same way (free space, or wait). */
static inline bool kvhi_err_disk_full(int err) { return err == -ENOSPC || err == -EDQUOT || err == -EFBIG; }
/* The status of an I/O that failed with -err: a full disk and a lack of
 * memory (buffers, rings) are said as such, the rest is KVH_ERR_IO. */
static inline kvh_status kvhi_io_status(int err)
{
    return kvhi_err_disk_full(err) ? KVH_ERR_NOSPACE : err == -ENOMEM ? KVH_ERR_NOMEM : KVH_ERR_IO;
}
/* Fills c with every default (struct_size = sizeof(kvh_config)). */
void kvhi_config_defaults(kvh_config *c);
/* The checks an engine open makes of the geometry (num_layers,
 * num_kv_heads, head_dim, block_tokens, dtype), for tools that use one
 * without an engine: KVH_OK, or KVH_ERR_INVALID_ARG with kvh_last_error()
 * saying why and *field (when field is not NULL) naming the field. */
kvh_status kvhi_config_check_geometry(const kvh_config *c, const char **field);
/* kvh_config_from_env on a config of the current size whose first size
 * bytes are the caller's: sets the fields that lie within size from the
 * KVH_* variables of envp (NULL: the process environment). On failure c
 * may be partly changed (config_env.c). */
kvh_status kvhi_config_from_env(kvh_config *c, size_t size, const char *const *envp);
/* Validates config (of the current size) and opens an engine on it. */
kvh_status kvhi_engine_open(const kvh_config *config, kvh_engine **out);
/* KVH_ERR_NOMEM (with advice in the message) when the records of the
 * device and host tiers' blocks and more_blocks others would take more
 * than the machine's memory; checked before anything is made. */
kvh_status kvhi_check_record_memory(const kvh_engine *e, uint64_t more_blocks, const char *advice);
/* Waits for the calls inside e to leave, stops the workers, closes the
 * disk tier and frees e (lock not held). */
kvh_status kvhi_engine_close(kvh_engine *e);
/* Frees the structs close keeps of the engines closed last (for a check
 * that counts allocations; no call may still be racing a close). */
void kvhi_engine_forget_closed(void);
/* Takes (hold) or lets go of the lock of those kept structs: a test's
 * stand-in for a thread caught in a close when another forks. */
void kvhi_engine_closed_list_hold(bool hold);
/* Tier `tier` (< KVH_TIER_COUNT) as the caller sees it (lock held). */
void kvhi_tier_info(kvh_engine *e, uint32_t tier, kvh_tier_info *info);
/* Sets the device quota of agent and re-indexes its blocks (lock held). */
kvh_status kvhi_agent_set_quota(kvh_engine *e, uint32_t agent, uint64_t device_bytes);

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
/* The CLOCK_REALTIME time ns from now, as pthread_cond_timedwait takes
 * it (the engine's condition variables keep that clock). */
struct timespec kvhi_realtime_in_ns(uint64_t ns);

/* Does the record work of the block releases still in the backlog
 * (core/block.c). Lock held. */
void kvhi_block_releases_apply(kvh_engine *e);

/* b's bytes are about to change (or it leaves for good): its kept clean
 * host copy, if any, is freed (core/clean_copy.h). Lock held. */
static inline void kvhi_clean_drop(kvh_engine *e, uint32_t b)
{
    if (e->clean.slot_of && e->clean.slot_of[b] != KVHI_NO_BLOCK)
        kvhi_clean_drop_slow(e, b);
}

/* kvhi_enter without applying the release backlog: for kvh_block_release
 * alone, which applies it itself. */
static inline kvh_status kvhi_enter_keep_backlog(kvh_engine *e)
{
    kvh_status st = kvhi_enter_allowed(e);
    if (st != KVH_OK)
        return st;
    pthread_mutex_lock(&e->lock);
    if (e->closing) {
        pthread_mutex_unlock(&e->lock);
        return kvhi_fail(KVH_ERR_CLOSED, "engine is closing");
    }
    e->active_calls++;
    return KVH_OK;
}

/* Takes the lock and registers an in-flight API call; fails with
 * KVH_ERR_CLOSED when the engine is closing. Every call then sees the
 * releases that returned before it applied. Inline, as kvhi_leave: every
 * exported call passes both, and the cheapest ones (an alloc, a release)
 * cost little more than the lock. */
static inline kvh_status kvhi_enter(kvh_engine *e)
{
    kvh_status st = kvhi_enter_keep_backlog(e);
    if (st == KVH_OK && e->release_backlog_len)
        kvhi_block_releases_apply(e);
    return st;
}

void kvhi_disk_fold_journal(kvh_engine *e);

static inline void kvhi_leave(kvh_engine *e)
{
    if (e->disk_fold_due)
        kvhi_disk_fold_journal(e);
    if (--e->active_calls == 0 && e->closing)
        pthread_cond_broadcast(&e->changed);
    if (e->n_pending_log)
        kvhi_unlock_and_log(e);
    else
        pthread_mutex_unlock(&e->lock);
}

#endif
