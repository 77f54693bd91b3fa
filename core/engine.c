/* Engine lifetime: configuration, tier memory, open and close. */
#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>
#ifdef KVH_HAVE_NUMA
#include <numa.h>
#endif

#include "core/attention_call.h"
#include "core/engine.h"
#include "core/host_spare.h"
#include "core/isa_overrides.h"
#include "core/process_fork.h"
#include "core/hint_queue.h"
#include "core/huge_alloc.h"
#include "core/vmap_backend.h"
#include "core/block.h"
#include "core/tier.h"
#include "core/migrate.h"
#include "core/numa_place.h"
#include "core/seq.h"
#include "core/disk_tier.h"
#include "core/codec_tier.h"
#include "core/vmap.h"
#include "core/ext_pool.h"
#include "core/context.h"
#include "core/remote_tier.h"

uint64_t kvhi_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

struct timespec kvhi_realtime_in_ns(uint64_t ns)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t nsec = (uint64_t)ts.tv_nsec + ns % 1000000000ull;
    ts.tv_sec += (time_t)(ns / 1000000000ull + nsec / 1000000000ull);
    ts.tv_nsec = (long)(nsec % 1000000000ull);
    return ts;
}

#ifndef NDEBUG
/* glibc records the owner's thread id in the mutex; elsewhere the check
 * passes (it only ever asserts in debug builds). */
int kvhi_lock_held_by_caller(kvh_engine *e)
{
#if defined(__GLIBC__)
    return e->lock.__data.__owner == gettid();
#else
    (void)e;
    return -1;
#endif
}
#endif

/* Copies queued log lines out (lock held), unlocks, then emits them. */
void kvhi_unlock_and_log(kvh_engine *e)
{
    uint32_t n = e->n_pending_log;
    char lines[4][256];
    int levels[4];
    for (uint32_t i = 0; i < n; i++) {
        memcpy(lines[i], e->pending_log[i], sizeof(lines[i]));
        levels[i] = e->pending_log_level[i];
    }
    e->n_pending_log = 0;
    pthread_mutex_unlock(&e->lock);
    for (uint32_t i = 0; i < n; i++)
        kvhi_sink_call(e, levels[i], lines[i]);
}

void kvhi_config_defaults(kvh_config *c)
{
    memset(c, 0, sizeof(*c));
    c->struct_size = sizeof(*c);
    c->num_layers = 1;
    c->num_kv_heads = 1;
    c->head_dim = 64;
    c->block_tokens = 16;
    c->dtype = KVH_DTYPE_F16;
    c->backend = KVH_BACKEND_AUTO;
    c->device_bytes = 256ull << 20;
    c->host_bytes = 1ull << 30;
    c->numa_node = -1;
    c->migration_threads = 2;
    c->lru_k = 2;
    c->eviction_policy = KVH_EVICT_ADAPTIVE;
    c->promote_min_hits = 1;
    c->log_level = KVH_LOG_WARN;
    c->disk_queue_depth = 32;
    c->remote_timeout_ms = 50;
    c->remote_ttl_s = 86400;
    c->remote_upload = KVH_REMOTE_UPLOAD_PERSIST;
    c->remote_breaker_ms = 2000;
}

uint32_t kvhi_dtype_bytes(uint32_t dtype)
{
    switch (dtype) {
    case KVH_DTYPE_F32:
        return 4;
    case KVH_DTYPE_F16:
    case KVH_DTYPE_BF16:
        return 2;
    default:
        return 0;
    }
}

kvh_status kvhi_config_check_geometry(const kvh_config *c, const char **field)
{
#define GEO(name, cond, ...)                                                                                           \
    do {                                                                                                               \
        if (!(cond)) {                                                                                                 \
            if (field)                                                                                                 \
                *field = name;                                                                                         \
            return kvhi_fail(KVH_ERR_INVALID_ARG, __VA_ARGS__);                                                        \
        }                                                                                                              \
    } while (0)
    GEO("num_layers", c->num_layers >= 1 && c->num_layers <= 4096, "num_layers %u not in 1..4096", c->num_layers);
    GEO("num_kv_heads", c->num_kv_heads >= 1 && c->num_kv_heads <= 1024, "num_kv_heads %u not in 1..1024",
        c->num_kv_heads);
    GEO("head_dim", c->head_dim >= 1 && c->head_dim <= 1024, "head_dim %u not in 1..1024", c->head_dim);
    GEO("block_tokens",
        c->block_tokens >= 1 && c->block_tokens <= 256 && (c->block_tokens & (c->block_tokens - 1)) == 0,
        "block_tokens %u is not a power of two in 1..256", c->block_tokens);
    GEO("dtype", kvhi_dtype_bytes(c->dtype) != 0, "unknown dtype %u", c->dtype);
#undef GEO
    return KVH_OK;
}

static kvh_status validate(const kvh_config *c)
{
#define CHECK(cond, ...)                                                                                               \
    do {                                                                                                               \
        if (!(cond))                                                                                                   \
            return kvhi_fail(KVH_ERR_INVALID_ARG, __VA_ARGS__);                                                        \
    } while (0)
    kvh_status st = kvhi_config_check_geometry(c, NULL);
    if (st != KVH_OK)
        return st;
    CHECK(c->backend <= KVH_BACKEND_CUDA, "unknown backend %u", c->backend);
    CHECK(c->cuda_device >= 0, "cuda_device %d is negative", (int)c->cuda_device);
    CHECK(c->lru_k >= 1 && c->lru_k <= KVHI_MAX_K, "lru_k %u not in 1..%d", c->lru_k, KVHI_MAX_K);
    CHECK(c->migration_threads <= 64, "migration_threads %u > 64", c->migration_threads);
    CHECK(c->numa_node >= -1, "numa_node %d invalid", c->numa_node);
    CHECK(c->log_level <= KVH_LOG_DEBUG, "log_level %u invalid", c->log_level);
    CHECK(c->disk_queue_depth >= 1 && c->disk_queue_depth <= 4096, "disk_queue_depth %u not in 1..4096",
          c->disk_queue_depth);
    CHECK((c->disk_flags & ~(uint32_t)(KVH_DISK_RESET_ON_MISMATCH | KVH_DISK_BUFFERED | KVH_DISK_SHARE_GROUP)) == 0,
          "unknown disk_flags 0x%x", c->disk_flags);
    CHECK(!c->disk_bytes || (c->disk_path && c->disk_path[0]), "disk_bytes is set but disk_path is empty");
    /* A path without a budget used to open without a disk tier, found
     * only when persist failed later. */
    CHECK(!(c->disk_path && c->disk_path[0]) || c->disk_bytes, "disk_path is set but disk_bytes is 0");
    CHECK(c->vmap <= 1, "vmap %u is not 0 or 1", c->vmap);
    CHECK(c->copy_moves <= 1, "copy_moves %u is not 0 or 1", c->copy_moves);
    CHECK(c->prefault_memory <= 1, "prefault_memory %u is not 0 or 1", c->prefault_memory);
    CHECK(c->disk_strict_index <= 1, "disk_strict_index %u is not 0 or 1", c->disk_strict_index);
    CHECK(c->eviction_policy <= KVH_EVICT_ADAPTIVE, "unknown eviction_policy %u", c->eviction_policy);
#undef CHECK
    return kvhi_remote_validate(c);
}

static void bind_to_node(kvh_engine *e, void *p, size_t bytes)
{
#ifdef KVH_HAVE_NUMA
    if (e->cfg.numa_node >= 0 && numa_available() >= 0 && numa_max_node() > 0 && e->cfg.numa_node <= numa_max_node())
        kvhi_numa_bind(p, bytes, e->cfg.numa_node);
#else
    (void)e, (void)p, (void)bytes;
#endif
}

/* The bookkeeping each block of a tier costs besides its slot, allocated
 * at open (a lower bound): its record, free-list entry, reader count and
 * release key, its tokens, its prefix-index entry (the table is at least
 * twice the blocks), its entries in the tier's victim order (heap, arrival
 * queue, pending ring), its free-slot entry and its clean-copy links. */
static uint64_t block_metadata_bytes(const kvh_engine *e)
{
    return sizeof(kvhi_block) + sizeof(uint32_t) * 2 + sizeof(uint64_t) +
           (uint64_t)e->cfg.block_tokens * sizeof(int32_t) + 2 * (sizeof(uint64_t) + sizeof(uint32_t)) +
           2 * sizeof(kvhi_lruk_entry) + sizeof(uint32_t) + sizeof(uint32_t) + sizeof(uint32_t) +
           sizeof(kvhi_clean_link);
}

kvh_status kvhi_check_record_memory(const kvh_engine *e, uint64_t more_blocks, const char *advice)
{
    /* From the budgets, before the tiers' memory is taken (mapping and
     * touching it first took a minute for a refusal). */
    uint64_t blocks = more_blocks;
    const uint64_t budget[2] = {e->cfg.device_bytes, e->cfg.host_bytes};
    bool capped = false;
    for (uint32_t t = KVH_TIER_DEVICE; t <= KVH_TIER_HOST; t++) {
        uint64_t slots = e->tiers[t].slot_bytes ? budget[t] / e->tiers[t].slot_bytes : 0;
        capped |= slots > UINT32_MAX - 1;
        blocks += slots > UINT32_MAX - 1 ? UINT32_MAX - 1 : slots;
    }
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages <= 0 || page <= 0)
        return KVH_OK;
    uint64_t memory = (uint64_t)pages * (uint64_t)page, per = block_metadata_bytes(e);
    if (blocks <= memory / per)
        return KVH_OK;
    /* More than the machine has would end in the OOM killer, or in a
     * refusal only after minutes of work (and, for a disk tier, thousands
     * of slab files made). */
    return kvhi_fail(KVH_ERR_NOMEM,
                     "the records of %llu blocks%s (about %llu bytes each: the record, its tokens, its places in the "
                     "eviction orders) would take %llu MiB, more than this machine's %llu MiB of memory: %s",
                     (unsigned long long)blocks,
                     capped ? " (a tier's budget cut to the most blocks a tier holds, 4294967294)" : "",
                     (unsigned long long)per,
                     (unsigned long long)(blocks > UINT64_MAX / per ? UINT64_MAX >> 20 : blocks * per >> 20),
                     (unsigned long long)(memory >> 20), advice);
}

static kvh_status tier_init(kvh_engine *e, uint32_t t, uint64_t budget)
{
    kvhi_tier *tier = &e->tiers[t];
    uint64_t slots = budget / tier->slot_bytes;
    if (t == KVH_TIER_HOST && slots && e->host_spare_wanted)
        slots++; /* the spare, beyond the budget (core/host_spare.h) */
    const bool capped = slots > UINT32_MAX - 1;
    if (capped)
        slots = UINT32_MAX - 1;
    if (slots == 0)
        return KVH_OK;
    tier->bytes_mapped = slots * tier->slot_bytes;
    if (t == KVH_TIER_DEVICE && e->cfg.vmap) {
        /* Whole slabs (kernels/slab_layout.h): the slots of a last,
         * partial slab are never used, so their pages are never touched. */
        kvhi_vmap_layout(e, slots, &e->slab);
        uint64_t g = e->slab.slab_blocks;
        kvh_status st = kvhi_vmap_arena_alloc(e, (slots + g - 1) / g * g, &tier->base);
        if (st != KVH_OK)
            return st;
    } else if (t == KVH_TIER_HOST && e->moves_in_place) {
        /* Made with the device tier, after its slots. */
        kvhi_tier *dev = &e->tiers[KVH_TIER_DEVICE];
        tier->base = dev->base;
        tier->bytes_mapped = 0;
        tier->shares_arena = true;
        if (kvhi_slot_pool_init_range(&tier->slots, dev->slots.capacity, (uint32_t)slots) != 0 ||
            kvhi_slot_pool_join(&dev->slots, &tier->slots) != 0)
            return kvhi_fail(KVH_ERR_NOMEM, "out of memory for slot lists");
        tier->present = true;
        return KVH_OK;
    } else {
        if (t == KVH_TIER_DEVICE && e->moves_in_place) {
            uint64_t host = e->cfg.host_bytes / e->tiers[KVH_TIER_HOST].slot_bytes;
            host += host && e->host_spare_wanted;          /* and its spare */
            tier->bytes_mapped += host * tier->slot_bytes; /* the host tier's slots follow */
        }
        tier->base = t == KVH_TIER_DEVICE ? e->backend->device_alloc(e->backend_ctx, tier->bytes_mapped)
                                          : e->backend->host_alloc(e->backend_ctx, tier->bytes_mapped);
    }
    if (!tier->base) {
        /* Moves in place: one arena holds both tiers, and host_bytes may
         * be the part that did not fit. */
        bool both =
            t == KVH_TIER_DEVICE && e->moves_in_place && e->cfg.host_bytes >= e->tiers[KVH_TIER_HOST].slot_bytes;
        return kvhi_fail(KVH_ERR_NOMEM, "cannot allocate %llu bytes for the %s%s",
                         (unsigned long long)tier->bytes_mapped,
                         both                   ? "device and host tiers (one arena: device_bytes + host_bytes)"
                         : t == KVH_TIER_DEVICE ? "device tier"
                                                : "host tier",
                         capped ? " (its budget cut to the most blocks a tier holds, 4294967294)" : "");
    }
    if (t == KVH_TIER_HOST)
        bind_to_node(e, tier->base, tier->bytes_mapped);
    /* After the binding, so that the pages come from its node. The CPU
     * backend in use (cpu_kernels), named or found by AUTO: other
     * backends' host memory is pinned, so backed already. */
    if (e->cfg.prefault_memory && e->cpu_kernels && !(t == KVH_TIER_DEVICE && e->cfg.vmap)) {
        const char *name = t == KVH_TIER_DEVICE ? "device" : "host";
        /* More than the system has free would not fail a fault: it would
         * wake the OOM killer, which may pick this process. */
        uint64_t available = kvhi_mem_available();
        /* The records of the blocks it holds are allocated too: with small
         * blocks they are a good part of the total. */
        uint64_t records = tier->bytes_mapped / tier->slot_bytes * block_metadata_bytes(e);
        if (tier->bytes_mapped > available || records > available - tier->bytes_mapped)
            return kvhi_fail(KVH_ERR_NOMEM,
                             "prefault_memory: the %s tier's %llu bytes and the %llu bytes of its block records "
                             "are more than the %llu bytes the system has available (MemAvailable, or the memory "
                             "cgroup's limit less its usage)",
                             name, (unsigned long long)tier->bytes_mapped, (unsigned long long)records,
                             (unsigned long long)available);
        if (kvhi_populate(tier->base, tier->bytes_mapped) != 0)
            return kvhi_fail(KVH_ERR_NOMEM, "cannot back the %llu bytes of the %s tier (prefault_memory): %s",
                             (unsigned long long)tier->bytes_mapped, name, strerror(errno));
    }
    if (kvhi_slot_pool_init(&tier->slots, (uint32_t)slots) != 0)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for slot lists");
    tier->present = true;
    return KVH_OK;
}

/* Device and host tiers can be one arena when they are the same memory
 * in the same form: the CPU backend or an integrated GPU, no view arena,
 * no codec, no NUMA placement of the host tier, and not turned off by
 * copy_moves. */
static bool can_move_in_place(const kvh_engine *e)
{
    const kvhi_tier *d = &e->tiers[KVH_TIER_DEVICE], *h = &e->tiers[KVH_TIER_HOST];
    return e->device_is_host_ram && e->device_host_addressable && !e->cfg.vmap && !e->cfg.copy_moves && !d->encoded &&
           !h->encoded && d->slot_bytes == h->slot_bytes && e->cfg.numa_node < 0 &&
           e->cfg.host_bytes / h->slot_bytes > 0 &&
           e->cfg.device_bytes / d->slot_bytes + e->cfg.host_bytes / h->slot_bytes < UINT32_MAX - 1;
}

static kvh_status select_backend(kvh_engine *e)
{
    char msg[768] = ""; /* the loader lists every path it tried */
    e->cpu_kernels = true;
    if (e->cfg.backend == KVH_BACKEND_CPU) {
        e->backend = kvhi_backend_cpu();
        return KVH_OK;
    }
    e->backend = kvhi_backend_cuda_load(e->cfg.cuda_device, msg, sizeof(msg), &e->backend_dl);
    if (e->backend) {
        e->backend_ctx = e->backend->context_create(e->cfg.cuda_device, msg, sizeof(msg));
        if (e->backend_ctx) {
            e->cpu_kernels = false;
            return KVH_OK;
        }
        kvhi_backend_cuda_unload(e->backend_dl);
        e->backend_dl = NULL;
    }
    if (e->cfg.backend == KVH_BACKEND_CUDA)
        return kvhi_fail(KVH_ERR_UNSUPPORTED, "CUDA backend unavailable: %s", msg);
    kvhi_log(e, KVH_LOG_INFO, "using the CPU backend: %s", msg);
    e->backend = kvhi_backend_cpu();
    e->backend_ctx = NULL;
    return KVH_OK;
}

/* A numa_node this machine lacks binds nothing (memory nor workers): the
 * setting is taken, as it may come from another machine's configuration,
 * and said. */
static void warn_absent_numa_node(kvh_engine *e)
{
    cpu_set_t cpus;
    if (e->cfg.numa_node >= 0 && !kvhi_numa_node_cpus(e->cfg.numa_node, &cpus))
        kvhi_log(e, KVH_LOG_WARN,
                 "numa_node %d: this machine has no such node (no /sys/devices/system/node/node%d): neither the "
                 "host tier nor the migration workers are bound",
                 e->cfg.numa_node, e->cfg.numa_node);
}

/* What the CPU may do with the chosen backend's device-tier memory
 * (engine.h: device_host_addressable, device_is_host_ram). */
static void note_memory_model(kvh_engine *e)
{
    int unified = e->backend->memory_is_unified ? e->backend->memory_is_unified(e->backend_ctx) : 0;
    e->device_host_addressable = e->backend->device_is_host_memory || unified >= 1;
    e->device_is_host_ram = e->backend->device_is_host_memory || unified == 2;
    if (unified)
        kvhi_log(e, KVH_LOG_INFO, "%s backend on unified memory: the CPU addresses device-tier memory%s",
                 e->backend->name, unified == 2 ? ", which is host RAM" : "");
}

/* Frees everything of e but the struct itself, its lock and its
 * condition variables. */
static void engine_free_state(kvh_engine *e)
{
    kvhi_remote_uploader_stop(e); /* a failed open may have started it */
    kvhi_contexts_free(e);        /* weight memory goes back to the backend */
    if (e->seqs.ptrs)
        for (uint32_t i = 0; i < e->seqs.cap; i++) {
            kvhi_seq *s = e->seqs.ptrs[i];
            if (s) {
                kvhi_seq_tables_free(s);
                free(s);
            }
        }
    kvhi_handles_destroy(&e->seqs);
    if (e->fences.ptrs)
        for (uint32_t i = 0; i < e->fences.cap; i++)
            free(e->fences.ptrs[i]);
    kvhi_handles_destroy(&e->fences);
    kvhi_pools_destroy(e);
    kvhi_hints_free(e);
    kvhi_hint_queue_free(e);
    kvhi_block_map_free(&e->handle_twins);
    kvhi_block_map_free(&e->handle_pins);
    kvhi_adapt_free(e);
    kvhi_handles_destroy(&e->pools);
    kvhi_vmap_engine_free(e);
    kvhi_attn_plans_free_all(e);
    for (uint32_t i = 0; i < e->n_agents; i++)
        kvhi_lruk_destroy(&e->agents[i].heap);
    free(e->agents);
    free(e->agent_index);
    for (uint32_t t = 0; t < KVH_TIER_COUNT; t++) {
        kvhi_tier *tier = &e->tiers[t];
        if (tier->base && !tier->shares_arena)
            (t == KVH_TIER_DEVICE ? e->backend->device_free : e->backend->host_free)(e->backend_ctx, tier->base,
                                                                                     tier->bytes_mapped);
        kvhi_slot_pool_destroy(&tier->slots);
        kvhi_lruk_destroy(&tier->heap);
    }
    if (e->blocks)
        for (uint32_t i = 0; i < e->block_cap; i++)
            free(e->blocks[i].written);
    kvhi_huge_free(e->blocks, (size_t)e->block_cap * sizeof(kvhi_block));
    free(e->block_free);
    free(e->read_slots);
    free(e->block_readers);
    free(e->block_release_keys);
    kvhi_clean_destroy(e);
    free(e->tokens);
    kvhi_prefix_destroy(&e->prefix);
    if (e->attn_state)
        kvhi_attn_cpu_destroy(e->attn_state);
    kvhi_disk_tier_close(e, false);
    kvhi_remote_tier_close(e);
    if (e->backend && e->backend_ctx)
        e->backend->context_destroy(e->backend_ctx);
    kvhi_backend_cuda_unload(e->backend_dl);
}

static void engine_free_struct(kvh_engine *e)
{
    pthread_cond_destroy(&e->changed);
    pthread_cond_destroy(&e->fence_cv);
    pthread_mutex_destroy(&e->lock);
    free(e);
}

static void engine_free(kvh_engine *e)
{
    engine_free_state(e);
    engine_free_struct(e);
}

/* The structs of the engines closed last, kept with their lock and
 * `closing` set: a call that entered as close was ending, before its
 * lock (where it would have seen `closing`), or that saw `closing` and is
 * still letting go of the lock, reads and locks memory that is still
 * there, and returns KVH_ERR_CLOSED. Close cannot wait for such calls,
 * which are not counted in active_calls; a call has to be held off the
 * processor through this many closes to miss the struct. */
enum { CLOSED_ENGINES_KEPT = 16 };
static pthread_mutex_t closed_engines_lock = PTHREAD_MUTEX_INITIALIZER;
static kvh_engine *closed_engines[CLOSED_ENGINES_KEPT];
static uint32_t closed_engines_next;

void kvhi_engine_forget_closed(void)
{
    pthread_mutex_lock(&closed_engines_lock);
    kvh_engine *kept[CLOSED_ENGINES_KEPT];
    memcpy(kept, closed_engines, sizeof(kept));
    memset(closed_engines, 0, sizeof(closed_engines));
    pthread_mutex_unlock(&closed_engines_lock);
    for (uint32_t i = 0; i < CLOSED_ENGINES_KEPT; i++)
        if (kept[i])
            engine_free_struct(kept[i]);
}

/* A fork while another thread holds the list's lock would leave it held
 * for good in the child, whose first close of its own engine would then
 * wait forever: fork takes it first and both sides let go. */
static void closed_list_lock(void) { pthread_mutex_lock(&closed_engines_lock); }
static void closed_list_unlock(void) { pthread_mutex_unlock(&closed_engines_lock); }
static pthread_once_t closed_list_fork_once = PTHREAD_ONCE_INIT;
static void closed_list_survives_fork(void)
{
    (void)pthread_atfork(closed_list_lock, closed_list_unlock, closed_list_unlock);
}

void kvhi_engine_closed_list_hold(bool hold)
{
    if (hold)
        closed_list_lock();
    else
        closed_list_unlock();
}

static void keep_closed_engine(kvh_engine *e)
{
    pthread_mutex_lock(&closed_engines_lock);
    kvh_engine *oldest = closed_engines[closed_engines_next];
    closed_engines[closed_engines_next] = e;
    closed_engines_next = (closed_engines_next + 1) % CLOSED_ENGINES_KEPT;
    pthread_mutex_unlock(&closed_engines_lock);
    if (oldest)
        engine_free_struct(oldest);
}

kvh_status kvhi_engine_open(const kvh_config *config, kvh_engine **out)
{
    kvh_status st = validate(config);
    if (st != KVH_OK)
        return st;
    kvh_engine *e = calloc(1, sizeof(*e));
    if (!e)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for the engine");
    kvhi_fork_watch();
    (void)pthread_once(&closed_list_fork_once, closed_list_survives_fork);
    e->fork_generation = kvhi_fork_generation();
    e->cfg = *config;
    e->cfg.disk_path = NULL; /* borrowed: never kept */
    e->host_spare = KVHI_NO_BLOCK;
    e->host_spare_wanted = kvhi_host_spare_wanted(config);
    e->cfg.remote_addrs = e->cfg.remote_user = e->cfg.remote_password = e->cfg.remote_tls_ca = NULL;
    pthread_mutex_init(&e->lock, NULL);
    pthread_cond_init(&e->changed, NULL);
    pthread_cond_init(&e->fence_cv, NULL);
    kvhi_handles_init(&e->seqs, KVHI_TAG_SEQ);
    kvhi_handles_init(&e->fences, KVHI_TAG_FENCE);
    kvhi_handles_init(&e->pools, KVHI_TAG_POOL);
    kvhi_handles_init(&e->attn_plans, KVHI_TAG_PLAN);
    kvhi_handles_init(&e->vmaps, KVHI_TAG_VMAP);
    /* Each engine starts its generations at a random point. */
    uint32_t gen0 = 0;
    if (getrandom(&gen0, sizeof(gen0), 0) != sizeof(gen0))
        gen0 = (uint32_t)kvhi_now_ns() ^ (uint32_t)(uintptr_t)e;
    gen0 = gen0 ? gen0 : 1;
    kvhi_handles_set_gen_start(&e->seqs, gen0);
    kvhi_handles_set_gen_start(&e->fences, gen0 + 1);
    kvhi_handles_set_gen_start(&e->pools, gen0 + 2);
    /* gen0 + 3: contexts (core/context.c) */
    kvhi_handles_set_gen_start(&e->attn_plans, gen0 + 4);
    kvhi_handles_set_gen_start(&e->vmaps, gen0 + 5);
    e->gen_start = gen0;
    e->elem_bytes = kvhi_dtype_bytes(e->cfg.dtype);
    e->layer_bytes = 2ull * e->cfg.num_kv_heads * e->cfg.block_tokens * e->cfg.head_dim * e->elem_bytes;
    e->block_bytes = e->layer_bytes * e->cfg.num_layers;

    st = kvhi_codec_tiers_init(e);
    if (st == KVH_OK)
        st = select_backend(e);
    if (st == KVH_OK) {
        kvhi_warn_isa_overrides(e);
        warn_absent_numa_node(e);
        note_memory_model(e);
        e->moves_in_place = can_move_in_place(e);
        st = kvhi_check_record_memory(e, 0, "give smaller device_bytes or host_bytes, or a larger block_tokens");
    }
    if (st == KVH_OK)
        st = tier_init(e, KVH_TIER_DEVICE, e->cfg.device_bytes);
    if (st == KVH_OK && !e->tiers[KVH_TIER_DEVICE].present)
        st = kvhi_fail(KVH_ERR_INVALID_ARG, "device_bytes %llu holds no block of %llu bytes",
                       (unsigned long long)e->cfg.device_bytes, (unsigned long long)e->block_bytes);
    if (st == KVH_OK)
        st = tier_init(e, KVH_TIER_HOST, e->cfg.host_bytes);
    if (st == KVH_OK && e->host_spare_wanted && e->tiers[KVH_TIER_HOST].present)
        kvhi_host_spare_init(e);
    if (st == KVH_OK && config->disk_path && config->disk_bytes)
        st = kvhi_disk_tier_open(e, &e->cfg, config->disk_path);
    if (st != KVH_OK) {
        engine_free(e);
        return st;
    }
    uint64_t cap = 0;
    for (uint32_t t = 0; t < KVH_TIER_COUNT; t++)
        cap += e->tiers[t].slots.capacity;
    if (cap > UINT32_MAX - 1) {
        engine_free(e);
        return kvhi_fail(KVH_ERR_INVALID_ARG, "tier budgets hold more than 2^32 blocks");
    }
    e->block_cap = (uint32_t)cap;
    /* Block handles give the generation every bit the index leaves. */
    while ((1ull << e->block_index_bits) < cap)
        e->block_index_bits++;
    e->blocks = kvhi_huge_alloc(cap * sizeof(kvhi_block));
    e->block_free = malloc(cap * sizeof(uint32_t));
    e->block_readers = calloc(cap, sizeof(uint32_t));
    e->block_release_keys = calloc(cap, sizeof(uint32_t));
    e->tokens = malloc(cap * e->cfg.block_tokens * sizeof(int32_t));
    if (!e->blocks || !e->block_free || !e->block_readers || !e->block_release_keys || !e->tokens ||
        kvhi_prefix_init(&e->prefix, cap) != 0) {
        engine_free(e);
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for %llu block records", (unsigned long long)cap);
    }
    for (uint32_t i = 0; i < cap; i++) {
        e->blocks[i].gen = e->gen_start;
        e->blocks[i].disk_copy = KVHI_NO_BLOCK;
        e->blocks[i].deferred_slot = KVHI_NO_BLOCK;
        e->blocks[i].heap_pos = KVHI_HEAP_NONE;
        e->blocks[i].quota_heap_pos = KVHI_HEAP_NONE;
        e->blocks[i].tier = KVHI_NO_TIER;
        e->block_free[i] = (uint32_t)(cap - 1 - i);
    }
    e->block_free_top = (uint32_t)cap;
    uint32_t ring_position = 0; /* the tier heaps share the records' heap_pos */
    for (uint32_t t = 0; t < KVH_TIER_COUNT; t++)
        if (e->tiers[t].present && (kvhi_lruk_init(&e->tiers[t].heap, e->tiers[t].slots.capacity,
                                                   &e->blocks[0].heap_pos, sizeof(kvhi_block)) != 0 ||
                                    kvhi_lruk_enable_pending(&e->tiers[t].heap, &ring_position) != 0)) {
            engine_free(e);
            return kvhi_fail(KVH_ERR_NOMEM, "out of memory for eviction heaps");
        }
    if (kvhi_clean_init(e) != 0) {
        engine_free(e);
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for clean host copies");
    }
    if (kvhi_adapt_init(e) != 0) {
        engine_free(e);
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for the adaptive policy's shadows");
    }
    if (e->disk && (st = kvhi_disk_tier_recover(e)) != KVH_OK) {
        engine_free(e);
        return st;
    }
    if ((st = kvhi_remote_tier_open(e, config)) != KVH_OK) {
        engine_free(e);
        return st;
    }
    st = kvhi_workers_start(e);
    if (st != KVH_OK) {
        engine_free(e);
        return st;
    }
    *out = e;
    return KVH_OK;
}

kvh_status kvhi_engine_close(kvh_engine *e)
{
    /* A copy in a child process: its locks may be held by threads that
     * exist only in the parent, and its workers are not here to stop.
     * Nothing is freed: the copy goes with the process. */
    if (e->fork_generation != kvhi_fork_generation())
        return KVH_OK;
    /* The sink returns into kvh, which then uses e: it must outlive it. */
    if (kvhi_in_sink_of(e))
        return kvhi_fail(KVH_ERR_BUSY, "an engine cannot be closed from inside its own log sink: close it after "
                                       "the sink returns");
    pthread_mutex_lock(&e->lock);
    if (e->closing) {
        pthread_mutex_unlock(&e->lock);
        return kvhi_fail(KVH_ERR_CLOSED, "engine is already closing");
    }
    e->closing = true;
    if (e->release_backlog_len)
        kvhi_block_releases_apply(e); /* calls that returned are done */
    pthread_cond_broadcast(&e->changed);
    while (e->active_calls)
        pthread_cond_wait(&e->changed, &e->lock);
    pthread_mutex_unlock(&e->lock);
    kvhi_remote_uploader_stop(e); /* its uploads may wait on the workers' moves */
    kvhi_workers_stop(e);
    kvh_status st = kvhi_disk_tier_close(e, true);
    engine_free_state(e);
    keep_closed_engine(e);
    return st;
}

void kvhi_tier_info(kvh_engine *e, uint32_t tier, kvh_tier_info *info)
{
    kvhi_tier *t = &e->tiers[tier];
    /* Under a KV codec the host and disk tiers hold encoded blocks. */
    kvh_tier_info r = {.struct_size = sizeof(r), .tier = tier, .block_bytes = t->slot_bytes};
    if (t->present) {
        /* The host tier's spare held back is no block's room. */
        r.capacity_blocks = kvhi_tier_slots(e, tier);
        r.used_blocks = kvhi_slot_pool_used(&t->slots) - (t->slots.capacity - r.capacity_blocks);
        /* Kept clean copies give their slots to the first block that
         * needs one: free, as far as a caller can tell. */
        if (tier == KVH_TIER_HOST) {
            r.used_blocks -= e->clean.count;
            r.clean_copies = e->clean.count;
        } else if (tier == KVH_TIER_DISK) {
            /* in used_blocks: most cannot be given back. Those being
             * written hold their slots too. */
            r.clean_copies = e->disk_copy_count + e->disk_copies_writing;
        }
        r.used_bytes = r.used_blocks * t->slot_bytes;
        r.pinned_blocks = t->pinned;
        /* With vmap the device tier is laid out by head (kernels/slab_layout.h):
         * no slot's block lies at base + slot * block_bytes. */
        r.base = tier == KVH_TIER_DEVICE && e->cfg.vmap ? NULL : t->base;
    }
    *info = r;
}

kvh_status kvhi_agent_set_quota(kvh_engine *e, uint32_t agent, uint64_t device_bytes)
{
    /* No quota is every agent's default: an agent never given one needs
     * no record for it. */
    bool counted = kvhi_agent_get(e, agent, false) != NULL;
    if (device_bytes == 0 && !counted)
        return KVH_OK;
    kvhi_agent *a = kvhi_agent_get(e, agent, true);
    if (!a)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for agent %u", agent);
    uint64_t before = a->quota_blocks;
    if (device_bytes && !a->heap.cap &&
        kvhi_lruk_init(&a->heap, e->tiers[KVH_TIER_DEVICE].slots.capacity, &e->blocks[0].quota_heap_pos,
                       sizeof(kvhi_block)) != 0)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for agent %u's quota", agent);
    a->quota_blocks = device_bytes / e->block_bytes;
    if (device_bytes && a->quota_blocks == 0)
        a->quota_blocks = 1;
    /* Every move counts an agent's device blocks once it has a record,
     * and its heap holds them while it has a quota: a quota changed, not
     * set or lifted, needs no walk of the records. */
    if (counted && (before != 0) == (a->quota_blocks != 0))
        return KVH_OK;
    /* Recount and re-index its device blocks: the heap tracks only
     * agents with a quota. */
    a->device_blocks = 0;
    for (uint32_t b = 0; b < e->block_cap; b++) {
        kvhi_block *blk = &e->blocks[b];
        if (!(blk->flags & KVHI_BF_LIVE) || blk->agent != agent)
            continue;
        if (!a->quota_blocks && blk->quota_heap_pos != KVHI_HEAP_NONE)
            kvhi_lruk_remove(&a->heap, b);
        if (blk->tier == KVH_TIER_DEVICE) {
            a->device_blocks++;
            if (a->quota_blocks)
                kvhi_block_update_evictable(e, b);
        }
    }
    /* A quota lifted gives its eviction order's memory back (a server
     * that gives each request or tenant a quota would otherwise keep
     * one per agent it ever saw); the next quota makes it again. */
    if (!a->quota_blocks && kvhi_lruk_count(&a->heap) == 0)
        kvhi_lruk_destroy(&a->heap);
    return KVH_OK;
}
