/* Block records (core/block.c): lasting flags, references, holds, pins,
 * recency and publication; prefetch hints as eviction protection
 * (core/hints.c). A block's move state is core/block_state.h. */
#ifndef KVH_CORE_BLOCK_H
#define KVH_CORE_BLOCK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/engine.h"

/* Block flags: lasting properties of a block, one bit each. What a copy
 * of its data is doing right now is its move state, a field in the top
 * bits of the same word (core/block_state.h), changed only through that
 * header's transitions. */
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
#define KVHI_BF_POOL_FILL 0x400u    /* an offload batch is gathering it */
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

/* Whether b is referenced as the victim order sees it: by a caller, where
 * references taken by remote uploads are not counted (engine.h,
 * upload_refs). */
static inline bool kvhi_block_referenced(const kvh_engine *e, const kvhi_block *blk, uint32_t b)
{
    return blk->refs > (e->upload_refs && blk->tier < e->upload_refs_tier_end ? e->upload_refs[b] : 0);
}
_Static_assert(offsetof(kvhi_block, gen) == 64, "kvhi_block: the hot fields fill exactly its first cache line");
_Static_assert(sizeof(kvhi_block) == 128, "kvhi_block: two cache lines");

/* The record's whole generation, which block handles carry as much of as
 * their index leaves room for. gen alone (never 0) is what internal
 * staleness checks compare. */
static inline uint64_t kvhi_block_gen(const kvhi_block *blk) { return (uint64_t)blk->gen_hi << 32 | blk->gen; }

static inline kvhi_block *kvhi_blk(kvh_engine *e, uint32_t i) { return &e->blocks[i]; }
/* Starts loading both lines of record i for a write. Records are met in
 * whatever order callers free them, and at 10^5 blocks and up that is a
 * cache miss per line, which the lock's atomics would otherwise serialise.
 * Touches no memory and reads only what engine open fixed, so callers may
 * issue it before taking the lock. */
static inline void kvhi_block_prefetch(const kvh_engine *e, uint32_t i)
{
    if (i < e->block_cap) {
        __builtin_prefetch(&e->blocks[i], 1);
        __builtin_prefetch((const uint8_t *)&e->blocks[i] + 64, 1);
    }
}

/* ---- kvh_block_release without reading the record ----
 *
 * A release met in random order misses the cache on its record, and
 * the lock's atomics keep that miss from overlapping the next call's. So
 * a release checks its handle against a dense array of one 4-byte word
 * per record (e->block_release_keys: 256 KiB at 65,536 blocks, which the
 * records streaming through evict from L2 less often than a wider array),
 * and its work on the record (ext_refs, refs, the free) waits in a short
 * backlog, KVHI_RELEASE_BACKLOG calls, while the record's prefetch
 * arrives. Every other call applies the backlog when it enters
 * (kvhi_enter), so it sees each release that returned before it as done;
 * so do the migration workers before each piece of work, and a slot
 * reservation before it waits or gives up for want of a victim (room a
 * release made is never reported missing). Elsewhere a thread of the
 * engine may see a release as not yet made, a state the engine was in a
 * moment earlier.
 *
 * A key is 0, or a count (top 2 bits) of handle references a release may
 * drop on trust over the record's reuse count: how many generations it is
 * past the engine's first (kvhi_block_gen - gen_start). That count names
 * the live handle exactly, for a handle's generation field is gen_start
 * plus it, modulo the field's width (core/handles.h): a handle whose field
 * less gen_start is that count is the live one, any other value is not.
 * A record reused 2^30 times or more gets no key and is checked in full.
 * The count never exceeds the record's ext_refs less its releases in the
 * backlog: a key is set only where ext_refs is known and the backlog
 * empty, the slow path lowers it with ext_refs, and a key is 0 from the
 * moment the record dies. A release the key does not vouch for (a stale,
 * forged or double release, a count used up) applies the backlog and
 * checks the record itself, so every error is exactly the one the record
 * says. */
#define KVHI_RELEASE_COUNT_SHIFT 30
#define KVHI_RELEASE_COUNT_MAX 3u
#define KVHI_RELEASE_REUSE_MASK ((1u << KVHI_RELEASE_COUNT_SHIFT) - 1)

static inline void kvhi_block_release_key_prefetch(const kvh_engine *e, uint32_t i)
{
    if (i < e->block_cap)
        __builtin_prefetch(&e->block_release_keys[i], 1);
}
/* Nothing may be taken on trust for b (it died, or its count is unknown). */
static inline void kvhi_block_release_key_clear(kvh_engine *e, uint32_t b) { e->block_release_keys[b] = 0; }
/* b is live with ext_refs handle references, and no release of it is in
 * the backlog. */
static inline void kvhi_block_release_key_set(kvh_engine *e, uint32_t b, uint32_t ext_refs)
{
    const kvhi_block *blk = &e->blocks[b];
    uint64_t reuses = ((uint64_t)blk->gen_hi << 32 | blk->gen) - e->gen_start;
    uint32_t count = ext_refs < KVHI_RELEASE_COUNT_MAX ? ext_refs : KVHI_RELEASE_COUNT_MAX;
    e->block_release_keys[b] =
        reuses <= KVHI_RELEASE_REUSE_MASK ? count << KVHI_RELEASE_COUNT_SHIFT | (uint32_t)reuses : 0;
}
/* b's ext_refs fell to ext_refs (no release of it in the backlog). */
static inline void kvhi_block_release_key_lower(kvh_engine *e, uint32_t b, uint32_t ext_refs)
{
    uint32_t key = e->block_release_keys[b];
    if (key >> KVHI_RELEASE_COUNT_SHIFT > ext_refs)
        e->block_release_keys[b] = ext_refs << KVHI_RELEASE_COUNT_SHIFT | (key & KVHI_RELEASE_REUSE_MASK);
}
/* Applies the oldest release of the backlog (lock held, backlog not
 * empty). */
void kvhi_block_release_apply_oldest(kvh_engine *e);
/* True when b's key vouches for a release through h (b is h's index): the
 * release is then taken (its count lowered, its record work queued) and
 * will succeed. False: nothing done, the caller checks the record. */
static inline bool kvhi_block_release_trusted(kvh_engine *e, kvh_block h, uint32_t b)
{
    if (kvhi_handle_tag(h.id) != KVHI_TAG_BLOCK || b >= e->block_cap)
        return false;
    uint32_t key = e->block_release_keys[b];
    /* The handle's generation field, less gen_start: the reuse count it
     * was handed out at (the field is as wide as the index leaves). */
    uint64_t reuses =
        ((h.id >> e->block_index_bits) - e->gen_start) & (KVHI_HANDLE_PAYLOAD_MASK >> e->block_index_bits);
    if (key < 1u << KVHI_RELEASE_COUNT_SHIFT || reuses != (key & KVHI_RELEASE_REUSE_MASK))
        return false;
    e->block_release_keys[b] = key - (1u << KVHI_RELEASE_COUNT_SHIFT);
    if (e->release_backlog_len == KVHI_RELEASE_BACKLOG)
        kvhi_block_release_apply_oldest(e);
    uint32_t at = e->release_backlog_head + e->release_backlog_len++;
    e->release_backlog[at % KVHI_RELEASE_BACKLOG] = h.id;
    return true;
}
static inline int32_t *kvhi_block_tokens(kvh_engine *e, uint32_t i)
{
    return e->tokens + (uint64_t)i * e->cfg.block_tokens;
}
uint8_t *kvhi_block_data(kvh_engine *e, uint32_t i);
/* New empty block with refs=1, in the fastest tier at or below min_tier
 * that can make room (may evict; may drop the lock). */
kvh_status kvhi_block_new(kvh_engine *e, uint32_t agent, uint32_t min_tier, uint32_t *out);
/* kvh_block_alloc's work: a new device-first block with one handle
 * reference, its handle in *id (one call, so that kvhi_block_new's body
 * is inlined where the cheapest public call needs it). */
kvh_status kvhi_block_new_handle(kvh_engine *e, uint32_t agent, uint64_t *id);
void kvhi_block_place(kvh_engine *e, uint32_t b, uint32_t tier, uint32_t slot);
/* The same without a host arrival's lead for the cleaner and its wake-up;
 * the caller gives it with kvhi_block_host_arrived if b turns out to want
 * a disk copy (a block read back from disk keeps the one it has). */
void kvhi_block_place_unled(kvh_engine *e, uint32_t b, uint32_t tier, uint32_t slot);
void kvhi_block_host_arrived(kvh_engine *e, uint32_t b);
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
/* Before b is pinned: a demotion to disk in flight is called back, and
 * any other move in flight (an eviction) is waited for, so that the pin
 * holds b in the tier it is in when the pin is taken. May drop the lock:
 * b may have been freed meanwhile (callers holding no reference check). */
void kvhi_block_settle_for_pin(kvh_engine *e, uint32_t b);
/* Takes one reference (the caller has checked refs < UINT32_MAX); a
 * cached block (none before) is re-filed as referenced. */
void kvhi_block_ref(kvh_engine *e, uint32_t b);
/* The same through a block handle (kvh_block_retain, lookups, offloads):
 * counted in ext_refs too. */
void kvhi_block_ref_handle(kvh_engine *e, uint32_t b);
/* Drops one reference; frees or leaves cached. */
void kvhi_block_unref(kvh_engine *e, uint32_t b);
/* Copy-on-write: returns a private copy of b (refs=1) replacing one ref.
 * Drops the lock (room for the copy, bringing b into memory). */
kvh_status kvhi_block_cow(kvh_engine *e, uint32_t b, uint32_t agent, uint32_t *out);
void kvhi_block_touch(kvh_engine *e, uint32_t b);
/* Blocks until b is not in flight (drops and retakes the lock). */
void kvhi_block_wait_idle(kvh_engine *e, uint32_t b);
void kvhi_block_try_publish(kvh_engine *e, uint32_t b);
/* The published block of the prefix (hash, parent, tokens: a full
 * block's), or KVHI_PREFIX_MISS. Blocks of other prefixes with the same
 * hash never answer for it. */
uint32_t kvhi_block_find_published(kvh_engine *e, uint64_t hash, uint64_t parent, const int32_t *tokens);
/* Publishes full block b (hash, parent_hash and tokens set) unless a
 * block of its prefix is published already; true when b is published. */
bool kvhi_block_publish_unique(kvh_engine *e, uint32_t b);
bool kvhi_block_kv_complete(kvh_engine *e, uint32_t b);
static inline uint64_t kvhi_block_handle(kvh_engine *e, uint32_t b)
{
    return kvhi_handle_pack(KVHI_TAG_BLOCK, kvhi_block_gen(&e->blocks[b]), b, e->block_index_bits);
}
/* Says why kvhi_block_resolve refuses h (the last error). */
void kvhi_block_resolve_fail(kvh_engine *e, kvh_block h);
/* The live record a block handle names (inline: every block call starts
 * here, a release or a retain costing little more). */
static inline kvh_status kvhi_block_resolve(kvh_engine *e, kvh_block h, uint32_t *out)
{
    uint32_t i = kvhi_handle_unpack_index(h.id, e->block_index_bits);
    const kvhi_block *blk = kvhi_handle_tag(h.id) == KVHI_TAG_BLOCK && i < e->block_cap ? kvhi_blk(e, i) : NULL;
    if (!blk || !(blk->flags & KVHI_BF_LIVE) || (blk->flags & KVHI_BF_DEAD) || h.id != kvhi_block_handle(e, i)) {
        kvhi_block_resolve_fail(e, h);
        return KVH_ERR_BAD_HANDLE;
    }
    *out = i;
    return KVH_OK;
}
/* A hold keeps b from being evicted or moved down (an acquire holds the
 * blocks it then promotes). */
void kvhi_block_hold(kvh_engine *e, uint32_t b);
void kvhi_block_unhold(kvh_engine *e, uint32_t b);
/* A hold for a reader of b's data without the lock, where it is now (a
 * pool transfer, a streamed chunk, an upload): when another thread
 * promotes b by a copy meanwhile, the slot b left keeps its bytes and is
 * given to nothing else until the last such read ends, and b never
 * trades contents with another block (core/move.c). */
void kvhi_block_hold_reading(kvh_engine *e, uint32_t b);
void kvhi_block_unhold_reading(kvh_engine *e, uint32_t b);
/* Frees slot of tier, which b has just left: now, or after b's reads. */
void kvhi_block_release_source(kvh_engine *e, uint32_t b, uint32_t tier, uint32_t slot);
void kvhi_block_pin(kvh_engine *e, uint32_t b, bool pin);
/* kvh_block_pin's work: pins taken through handles are counted apart
 * (engine.h, handle_pins), so unpinning drops only one of those;
 * KVH_ERR_INVALID_ARG when none is left, KVH_ERR_RANGE at 2^32 - 1 pins. */
kvh_status kvhi_block_pin_handle(kvh_engine *e, uint32_t b, bool pin);
/* b (named by a handle) keeps twin, a published block of its prefix made
 * durable in its place, taking over the caller's reference on it (dropped
 * at once when b keeps that one already; one b kept before instead is let
 * go); the reference goes when b is destroyed. 0, or -1 out of memory
 * (the reference is the caller's). */
int kvhi_block_keep_twin(kvh_engine *e, uint32_t b, uint32_t twin);
/* Recompute whether b belongs in an eviction heap. */
void kvhi_block_update_evictable(kvh_engine *e, uint32_t b);
/* b's victim-order key now (a kvhi_lruk_current_fn; engine as ctx). */
kvhi_lruk_key kvhi_block_current_key(void *engine, uint32_t b);

/* Prefetch hints as eviction protection (core/hints.c). */
/* b is predicted to be needed, at priority (higher: sooner). */
void kvhi_hint_set(kvh_engine *e, uint32_t b, int32_t priority);
/* The same as a queue priority: no lapse record (the caller retires it
 * with kvhi_hint_drop), redeemed only once due (kvhi_hint_queue_due).
 * True when b now holds it as a queue priority and did not before. */
bool kvhi_hint_set_unlapsing(kvh_engine *e, uint32_t b, int32_t priority);
/* Removes priority from b's two, if there (the use it named has passed). */
void kvhi_hint_drop(kvh_engine *e, uint32_t b, int32_t priority);
/* Whether b holds priority as a queue priority now. */
bool kvhi_hint_holds_queued(const kvh_engine *e, uint32_t b, int32_t priority);
/* b's priority `was`, if it holds it, is `now` instead (the queue's ranks
 * moved to a new base). */
void kvhi_hint_rerank(kvh_engine *e, uint32_t b, int32_t was, int32_t now);
/* b was used: its sooner lapsing priority is redeemed if a lapsing hint
 * came since the last such use, and so is a queue priority whose request
 * the step has reached; the other priority takes its place. */
void kvhi_hint_redeem(kvh_engine *e, uint32_t b);
/* The victim-order key of a hinted block (above every unhinted one of its
 * class). */
kvhi_lruk_key kvhi_hint_key(const kvhi_block *blk, kvhi_lruk_key lruk);
void kvhi_hints_free(kvh_engine *e);
/* Starts a new hint epoch once its accesses have passed, retiring lapsed
 * hints (the access path calls it while any hint is recorded). */
void kvhi_hints_advance(kvh_engine *e);

#endif
