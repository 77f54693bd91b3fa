/* Weight contexts: a model's weight regions plus the sequences of its
 * agents, moved between tiers as one unit (context.c), the memory of the
 * regions in the tiers (weight_chunks.c), and admission of requests by
 * token budget (admission.c).
 *
 * Everything here is guarded by the engine lock, like the rest of the
 * engine; copies and file reads run with it released while the region
 * they touch is marked busy. */
#ifndef KVH_CORE_CONTEXT_H
#define KVH_CORE_CONTEXT_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "core/engine.h"

/* Handle tag of contexts (beside the tags of core/handles.h). */
#define KVHI_TAG_CONTEXT 0xC7u
#define KVHI_NAME_MAX 64

/* Room for a context error's text: a switch passes the message of what
 * stopped it (which quotes region and context names and the reason a
 * tier had no room) to kvh_last_error whole. */
#define KVHI_CONTEXT_MSG_BYTES 768
#define KVHI_CONTEXT_WHY_BYTES 512

typedef struct kvhi_region {
    char name[KVHI_NAME_MAX];
    uint32_t layer;
    uint64_t size;
    uint32_t n_chunks;
    uint32_t *chunk_crc; /* CRC32C per chunk of the current contents */
    bool crc_known;      /* chunk_crc is valid */
    int fd;              /* source file, or -1 when bytes were copied in */
    uint64_t file_offset;
    /* The engine's copy differs from the source, or there is no source:
     * leaving memory means writing it to the tier below. */
    bool dirty;
    /* Handed out writable since its checksums were last computed. */
    bool stale_crc;
    bool pinned;
    bool busy;          /* a switch is moving it (lock released) */
    uint8_t tier;       /* where it is accounted; KVHI_NO_TIER: only at source */
    uint8_t alloc_tier; /* whose allocator made data (differs from tier
                           after a remap on unified memory) */
    uint8_t *data;
    /* tier == KVH_TIER_DISK: the disk slots holding its bytes, in order,
     * block_bytes of the region each (weight_spill.c). */
    uint32_t *disk_slots;
    uint32_t n_disk_slots;
} kvhi_region;

/* Each region is an allocation of its own: it is charged its size in
 * whole pages of the system's page size (4096 bytes on x86-64, often
 * 16 or 64 KiB on arm64), a power of two (weight_chunks.c). */
uint64_t kvhi_region_page_bytes(void);

/* What a context's weights hold in one memory tier: slots withheld from
 * the tier for `bytes` (its resident regions' sizes, each rounded up to
 * whole pages), ceil(bytes / block_bytes) of them once a change
 * completes. Charging per context rather than per region keeps the
 * rounding under one block per context and tier (a GGUF has hundreds of
 * small tensors; KV blocks can be near a megabyte). */
typedef struct kvhi_charge {
    uint32_t *slots;
    uint32_t n, cap;
    uint64_t bytes;
    /* Bytes of charges still taking slots: the two arrival threads of a
     * switch charge one context at once, and taking a slot may drop the
     * lock. */
    uint64_t pending;
} kvhi_charge;

typedef struct kvhi_context {
    char name[KVHI_NAME_MAX];
    uint32_t kv_policy;
    uint64_t chunk_bytes;
    kvhi_region *regions;
    uint32_t n_regions, cap_regions;
    uint32_t *load_order;  /* region indices by (layer, index) */
    kvhi_charge charge[2]; /* [KVH_TIER_DEVICE], [KVH_TIER_HOST] */
    uint64_t *seqs;        /* attached sequence handles */
    uint32_t n_seqs, cap_seqs;
    bool loading;              /* a switch is bringing it in */
    bool switching;            /* a switch (either direction) involves it */
    bool departing;            /* a switch is moving its unpinned regions out */
    uint32_t holds;            /* other calls using it with the lock dropped
                                  (add_region, verify); a switch waits */
    bool adding;               /* add_region is copying a region in (its
                                  regions are then not for a verify) */
    uint32_t switches_waiting; /* switches waiting for holds to end: new
                                  verifies keep off, or overlapping ones
                                  would hold the switch off for good */
    kvh_status load_status;    /* of the last switch into it */
    char load_msg[KVHI_CONTEXT_MSG_BYTES];
} kvhi_context;

typedef struct kvhi_admission {
    bool enabled;
    uint64_t short_max_tokens;
    uint64_t quota_blocks[2]; /* [0] short pool, [1] long pool */
    uint64_t reserved_blocks[2];
    uint64_t admitted[2], rejected[2];
    /* Admitted sequences and their reservations, reclaimed once the
     * sequence handle is no longer live. */
    struct kvhi_admitted {
        uint64_t seq;
        uint64_t blocks;
        uint8_t pool;
    } * live;
    uint32_t n_live, cap_live;
} kvhi_admission;

typedef struct kvhi_contexts {
    kvhi_handle_table table; /* -> kvhi_context * */
    pthread_cond_t cv;       /* a region arrived or left; a switch ended */
    /* The switch in flight: one thread per direction. */
    pthread_t threads[2];
    uint32_t n_threads;
    bool switch_active;        /* from kvhi_context_switch until its last thread
                                  finishes */
    bool joinable;             /* threads[] have finished and wait for a join */
    uint32_t departures_left;  /* regions the outgoing side has yet to move */
    bool arrivals_running;     /* the incoming side runs on its own thread */
    uint32_t arrivals_waiting; /* arrival threads waiting for device room */
    kvh_weight_stats stats;
    kvhi_admission admission;
    /* Tests and benchmarks: move weights between device and host tiers by
     * copying even where they are the same memory (the path a discrete
     * GPU takes). */
    bool copy_on_unified;
    /* Region memory released under the lock, freed once it is dropped
     * (CUDA frees synchronise the device). */
    struct kvhi_garbage {
        uint8_t *p;
        uint64_t bytes;
        uint8_t tier;
    } * garbage;
    uint32_t n_garbage, cap_garbage;
    /* Region memory freed during a switch, for its next allocation of the
     * same size (weight_chunks.c); own lock: used without the engine's. */
    pthread_mutex_t spare_lock;
    struct kvhi_spare {
        uint8_t *p;
        uint64_t bytes;
        uint8_t tier;
    } spares[256];
    uint32_t n_spares;
} kvhi_contexts;

/* ---- context.c, context_switch.c, context_query.c ---- */
/* The engine's context state, made on first use (NULL when out of
 * memory). Lock held. */
kvhi_contexts *kvhi_contexts_get(kvh_engine *e);
kvh_status kvhi_context_resolve(kvh_engine *e, kvh_context h, kvhi_context **out);
bool kvhi_unified_memory(kvh_engine *e);
/* Sets copy_on_unified (tests and kvh-bench, which declares it itself).
 * Takes the lock. */
int kvhi_context_copy_on_unified(kvh_engine *e, bool on);
/* kvhi_drop_clean_host_region (engine.h): with allow_loading false it
 * spares contexts a switch is bringing in. */
/* Frees the memory of dropped regions (lock held; dropped meanwhile). */
void kvhi_free_garbage(kvh_engine *e);
kvh_status kvhi_context_create(kvh_engine *e, const kvh_context_params *p, kvh_context *out);
/* Takes the context out of the table and its slots out of the tiers (lock
 * held); free it with kvhi_context_free_detached after unlocking. */
kvh_status kvhi_context_detach(kvh_engine *e, kvh_context h, kvhi_context **out);
void kvhi_context_free_detached(kvh_engine *e, kvhi_context *x);
/* Takes a region's bytes off its tier's charge (lock held); its memory
 * stays for the caller to free. */
void kvhi_region_unaccount(kvh_engine *e, kvhi_context *x, kvhi_region *r);
/* Unaccounts r and frees its memory (lock held; dropped for the free, r
 * busy meanwhile). recycle: inside a switch, the memory goes to the
 * switch's spares (kvhi_region_mem_give) for its next allocation. */
void kvhi_region_release(kvh_engine *e, kvhi_context *x, kvhi_region *r, bool recycle);
/* Context calls (lock held). Adding a region, switching (without a
 * fence), waiting for a layer and verifying drop the lock: for the
 * region's copy or spill, the switch, the wait and the checksum pass. */
kvh_status kvhi_context_add_region(kvh_engine *e, kvhi_context *x, const kvh_weight_region_params *p, uint32_t *out);
kvh_status kvhi_context_attach(kvh_engine *e, kvhi_context *x, uint64_t seq);
kvh_status kvhi_context_switch(kvh_engine *e, kvh_context from, kvh_context to, kvh_fence *fence);
kvh_status kvhi_context_wait_layer(kvh_engine *e, kvh_context h, uint32_t layer, uint64_t timeout_ns);
kvh_status kvhi_context_region_data(kvh_engine *e, kvhi_context *x, uint32_t region, bool writable, void **data,
                                    uint64_t *size);
kvh_status kvhi_context_region_pin(kvh_engine *e, kvhi_context *x, uint32_t region, bool pinned);
kvh_status kvhi_context_verify(kvh_engine *e, kvh_context h, uint64_t *checked);
kvh_status kvhi_context_info(kvh_engine *e, kvhi_context *x, kvh_context_info *out);
void kvhi_weight_stats(kvh_engine *e, kvh_weight_stats *out);

/* ---- weight_chunks.c ---- */
enum kvhi_charge_mode {
    KVHI_CHARGE_FREE_ONLY, /* only slots that are free now */
    KVHI_CHARGE_EVICT      /* wait for a switch's departures, then evict
                              by policy (the lock may drop) */
};
/* Charges `bytes` more to x's weights in `tier`, withholding slots as
 * needed. On failure nothing more is charged. Lock held; a mode that
 * evicts may drop it. */
kvh_status kvhi_charge_add(kvh_engine *e, kvhi_context *x, uint32_t tier, uint64_t bytes, enum kvhi_charge_mode mode);
/* Takes `bytes` off and gives back the slots no longer needed. */
void kvhi_charge_sub(kvh_engine *e, kvhi_context *x, uint32_t tier, uint64_t bytes);
void kvhi_charge_free(kvhi_charge *ch);
/* The most bytes one weight region can occupy: the largest tier's
 * (memory tiers by their slots, the disk tier by its blocks). Lock held. */
uint64_t kvhi_weight_bytes_max(const kvh_engine *e);
/* The device slots all of x's regions take together (each charged in
 * whole pages), against the device tier's slots. Lock held. */
uint64_t kvhi_context_device_slots(kvh_engine *e, const kvhi_context *x);
/* Allocates / frees region memory with the allocator of `tier`. Call
 * without the lock (CUDA allocators synchronise the device). */
uint8_t *kvhi_region_mem_alloc(kvh_engine *e, uint32_t tier, uint64_t bytes);
void kvhi_region_mem_free(kvh_engine *e, uint32_t tier, uint8_t *p, uint64_t bytes);
/* The same within a switch: take reuses memory of that size given back
 * by give; kvhi_region_spares_free frees what is left (all without the
 * engine lock). */
uint8_t *kvhi_region_mem_take(kvh_engine *e, uint32_t tier, uint64_t bytes);
void kvhi_region_mem_give(kvh_engine *e, uint32_t tier, uint8_t *p, uint64_t bytes);
void kvhi_region_spares_free(kvh_engine *e);
/* Reads r's source into dst (memory of dst_tier) chunk by chunk, checking
 * each chunk's CRC, or recording it on the first load. Without the lock.
 * Returns 0, -errno, or 1 for a checksum mismatch (chunk in *bad_chunk). */
int kvhi_region_read_source(kvh_engine *e, kvhi_region *r, uint64_t chunk, uint8_t *dst, uint32_t dst_tier,
                            uint32_t *bad_chunk);
/* Copies r's bytes between tiers chunk by chunk. KVHI_CRC_RECORD
 * recomputes the chunk CRCs on the way; KVHI_CRC_VERIFY checks the source
 * against them first (when the CPU can read it). Without the lock.
 * Returns 0, -1 for a failed copy, 1 for a mismatch (*bad_chunk). */
enum { KVHI_CRC_NONE = 0, KVHI_CRC_RECORD = 1, KVHI_CRC_VERIFY = 2 };
int kvhi_region_copy(kvh_engine *e, kvhi_region *r, uint64_t chunk, uint8_t *dst, uint32_t dst_tier, const uint8_t *src,
                     uint32_t src_tier, int crc_mode, uint32_t *bad_chunk);
/* CRC check of resident data against chunk_crc; returns the number of the
 * first bad chunk + 1, 0 when all match, or -1 on a copy failure. */
int64_t kvhi_region_check(kvh_engine *e, kvhi_region *r, uint64_t chunk);

/* ---- weight_spill.c ---- */
/* Writes r's bytes (src, memory of src_tier: r->data, or the caller's for
 * a region being registered) to disk slots and frees r's memory, if any:
 * the region is then accounted in the disk tier. Lock held; dropped for
 * the I/O. KVH_ERR_NOSPACE without a disk tier or room in it. */
kvh_status kvhi_region_spill(kvh_engine *e, kvhi_context *x, kvhi_region *r, const uint8_t *src, uint32_t src_tier);
/* Reads a spilled region into dst (memory of dst_tier), checking every
 * chunk. Without the lock (r busy). 0, -errno, or 1 for a mismatch. */
int kvhi_region_read_disk(kvh_engine *e, kvhi_region *r, uint64_t chunk, uint8_t *dst, uint32_t dst_tier,
                          uint32_t *bad_chunk);
/* Gives a spilled region's disk slots back (lock held). */
void kvhi_region_disk_release(kvh_engine *e, kvhi_region *r);

/* ---- admission.c ---- */
struct kvhi_seq;
void kvhi_admission_free(kvhi_admission *a);
/* Reserves the budget of a request, or fails with KVH_ERR_NOSPACE; no
 * sequence exists yet. *pool_out is the pool charged (-1: none). */
kvh_status kvhi_admission_reserve(kvh_engine *e, uint64_t token_budget, int *pool_out, uint64_t *blocks_out);
/* Ties a reservation to the sequence created for it (s, handle seq). */
kvh_status kvhi_admission_bind(kvh_engine *e, int pool, uint64_t blocks, struct kvhi_seq *s, uint64_t seq);
/* Sequence s is to hold `blocks` blocks: past its reservation (its
 * budget), the blocks it passes it by are reserved in its pool too, or
 * the growth is refused with KVH_ERR_NOSPACE, so that a request that
 * outgrows its estimate cannot take the room reserved for others.
 * *grown: the blocks added, for kvhi_admission_shrink when the growth
 * fails later. Sequences outside admission grow freely. */
kvh_status kvhi_admission_grow(kvh_engine *e, struct kvhi_seq *s, uint64_t blocks, uint64_t *grown);
void kvhi_admission_shrink(kvh_engine *e, struct kvhi_seq *s, uint64_t grown);
/* The most blocks s may hold without a refusal from its pool
 * (UINT64_MAX outside admission). */
uint64_t kvhi_admission_room(kvh_engine *e, const struct kvhi_seq *s);
void kvhi_admission_cancel(kvh_engine *e, int pool, uint64_t blocks);
/* Releases reservations of sequences that were freed. */
void kvhi_admission_reclaim(kvh_engine *e);

/* Frees contexts and their weight memory (engine_free, nothing active). */
void kvhi_contexts_free(kvh_engine *e);
/* Makes host-tier room by dropping one clean weight region kept there
 * (lock held); false when there is none. */
bool kvhi_drop_clean_host_region(kvh_engine *e, bool allow_loading);

#endif
