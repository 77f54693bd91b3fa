/* Block metadata: lifetime, references, recency, publication. All
 * functions here run with the engine lock held. */
#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "core/block_state.h"
#include "core/engine.h"
#include "core/move.h"
#include "core/block.h"
#include "core/migrate.h"
#include "core/tier.h"
#include "core/disk_tier.h"
#include "core/codec_tier.h"
#include "core/lctru.h"
#include "core/remote_tier.h"

uint8_t *kvhi_slot_addr(kvh_engine *e, uint32_t tier, uint32_t slot)
{
    return e->tiers[tier].base + (uint64_t)slot * e->tiers[tier].slot_bytes;
}

uint8_t *kvhi_block_data(kvh_engine *e, uint32_t b)
{
    kvhi_block *blk = kvhi_blk(e, b);
    return kvhi_slot_addr(e, blk->tier, blk->slot);
}

void kvhi_block_resolve_fail(kvh_engine *e, kvh_block h)
{
    uint32_t i = kvhi_handle_unpack_index(h.id, e->block_index_bits);
    if (kvhi_handle_tag(h.id) != KVHI_TAG_BLOCK || i >= e->block_cap)
        kvhi_fail(KVH_ERR_BAD_HANDLE, "not a block handle: 0x%llx", (unsigned long long)h.id);
    else
        kvhi_fail(KVH_ERR_BAD_HANDLE, "stale block handle: 0x%llx", (unsigned long long)h.id);
}

static uint32_t agent_hash(uint32_t id, uint32_t mask) { return (id * 0x9E3779B1u >> 7) & mask; }

/* The index entry of agent id: its own, or the empty one it would take. */
static uint32_t *agent_slot(const kvh_engine *e, uint32_t id)
{
    uint32_t mask = e->agent_index_cap - 1;
    for (uint32_t h = agent_hash(id, mask);; h = (h + 1) & mask) {
        uint32_t *slot = &e->agent_index[h];
        if (*slot == 0 || e->agents[*slot - 1].id == id)
            return slot;
    }
}

/* Room in the index for one more agent (at most half full). */
static bool agent_index_reserve(kvh_engine *e)
{
    if (2 * (e->n_agents + 1) <= e->agent_index_cap)
        return true;
    uint32_t cap = e->agent_index_cap ? 2 * e->agent_index_cap : 16;
    uint32_t *index = calloc(cap, sizeof(uint32_t));
    if (!index)
        return false;
    free(e->agent_index);
    e->agent_index = index;
    e->agent_index_cap = cap;
    for (uint32_t i = 0; i < e->n_agents; i++)
        *agent_slot(e, e->agents[i].id) = i + 1;
    return true;
}

/* By id through the index: every device-tier move asks, and an engine
 * may know tens of thousands of agents. */
kvhi_agent *kvhi_agent_get(kvh_engine *e, uint32_t id, bool create)
{
    if (e->n_agents) {
        uint32_t at = *agent_slot(e, id);
        if (at)
            return &e->agents[at - 1];
    }
    if (!create || !agent_index_reserve(e))
        return NULL;
    if (e->n_agents == e->cap_agents) {
        /* Agents hold heaps whose entries point into e->blocks, not into
         * this array, so moving the array is safe. */
        uint32_t ncap = e->cap_agents ? e->cap_agents * 2 : 8;
        kvhi_agent *a = realloc(e->agents, sizeof(*a) * ncap);
        if (!a)
            return NULL;
        e->agents = a;
        e->cap_agents = ncap;
    }
    kvhi_agent *a = &e->agents[e->n_agents];
    memset(a, 0, sizeof(*a)); /* no heap until it gets a quota */
    a->id = id;
    e->n_agents++;
    *agent_slot(e, id) = e->n_agents;
    return a;
}

static _Thread_local bool quota_exempt;

bool kvhi_quota_exempt_set(bool exempt)
{
    bool was = quota_exempt;
    quota_exempt = exempt;
    return was;
}

kvhi_agent *kvhi_agent_at_quota(kvh_engine *e, uint32_t id)
{
    kvhi_agent *a = e->n_agents && !quota_exempt ? kvhi_agent_get(e, id, false) : NULL;
    return a && a->quota_blocks && a->device_blocks + a->device_incoming >= a->quota_blocks ? a : NULL;
}

static inline void heaps_remove(kvh_engine *e, uint32_t b)
{
    kvhi_block *blk = kvhi_blk(e, b);
    if (blk->heap_pos != KVHI_HEAP_NONE)
        kvhi_lruk_remove(&e->tiers[blk->tier].heap, b);
    if (blk->quota_heap_pos != KVHI_HEAP_NONE) {
        kvhi_agent *a = kvhi_agent_get(e, blk->agent, false);
        if (a)
            kvhi_lruk_remove(&a->heap, b);
    }
}

kvhi_lruk_key kvhi_block_current_key(void *engine, uint32_t b)
{
    kvh_engine *e = engine;
    const kvhi_block *blk = kvhi_blk(e, b);
    kvhi_lruk_key k = kvhi_adapt_key(&e->adapt, blk->hist, e->cfg.lru_k, kvhi_block_referenced(e, blk, b));
    if (blk->flags & KVHI_BF_HINTED)
        return kvhi_hint_key(blk, k);
    return kvhi_evict_key(e, blk, k);
}

/* Inline bodies of the calls an allocation and a release make, with
 * their exported names below: the calls themselves (saved registers, a
 * frame each) cost as much as the work on an alloc+free pair. */
static inline void block_update_evictable(kvh_engine *e, uint32_t b)
{
    kvhi_block *blk = kvhi_blk(e, b);
    bool evictable = (blk->flags & KVHI_BF_LIVE) && !kvhi_block_busy(blk) && !(blk->flags & KVHI_BF_DEAD) &&
                     blk->pins == 0 && blk->holds == 0;
    if (!evictable) {
        heaps_remove(e, b);
        return;
    }
    kvhi_agent *quota = NULL;
    if (blk->tier == KVH_TIER_DEVICE && e->n_agents) {
        kvhi_agent *a = kvhi_agent_get(e, blk->agent, false);
        if (a && a->quota_blocks)
            quota = a;
    }
    /* Not in its tier's order yet, or still pending there: it is keyed
     * when a victim is next chosen (most blocks are freed before that). */
    kvhi_lruk_heap *tier_heap = &e->tiers[blk->tier].heap;
    bool pending = kvhi_lruk_pos_pending(tier_heap, blk->heap_pos) ||
                   (blk->heap_pos == KVHI_HEAP_NONE && kvhi_lruk_add_pending(tier_heap, b));
    if (pending && !quota)
        return;
    /* Lazy: an access only raises the key, and the victim choice catches
     * up with raised entries when they reach the top (core/lruk.h). */
    kvhi_lruk_key key = kvhi_block_current_key(e, b);
    if (!pending)
        kvhi_lruk_upsert_lazy(tier_heap, b, key);
    if (quota)
        kvhi_lruk_upsert_lazy(&quota->heap, b, key);
}

void kvhi_block_update_evictable(kvh_engine *e, uint32_t b) { block_update_evictable(e, b); }

void kvhi_block_ref(kvh_engine *e, uint32_t b)
{
    if (e->blocks[b].refs++ == 0)
        kvhi_block_update_evictable(e, b);
}

void kvhi_block_ref_handle(kvh_engine *e, uint32_t b)
{
    kvhi_block *blk = kvhi_blk(e, b);
    blk->ext_refs++;
    kvhi_block_ref(e, b);
    /* Callers entered through kvhi_enter, which emptied the backlog; if
     * the lock was dropped since, releases (of b too) may wait there, and
     * then the count is not known. */
    if ((blk->flags & (KVHI_BF_LIVE | KVHI_BF_DEAD)) == KVHI_BF_LIVE && !e->release_backlog_len)
        kvhi_block_release_key_set(e, b, blk->ext_refs);
    else
        kvhi_block_release_key_clear(e, b);
}

void kvhi_block_settle_for_pin(kvh_engine *e, uint32_t b)
{
    while (!kvhi_block_recall(e, b) && kvhi_block_in_flight(&e->blocks[b]))
        kvhi_block_wait_idle(e, b);
}

__attribute__((always_inline)) static inline void block_unref(kvh_engine *e, uint32_t b);

/* The record work of a release that kvhi_block_release_trusted took: the
 * key vouched for a live record with a handle reference left, and nothing
 * but releases (queued after this one) lowers that, nor frees a block
 * that is still referenced. */
__attribute__((always_inline)) static inline void release_apply(kvh_engine *e, uint64_t h)
{
    uint32_t b = kvhi_handle_unpack_index(h, e->block_index_bits);
    kvhi_block *blk = kvhi_blk(e, b);
    /* The key named this very record, which the reference still counted
     * in ext_refs kept alive since: the handle is checked in debug builds
     * only, the reference always. */
    assert(kvhi_block_handle(e, b) == h && "a release in the backlog names its record's live handle");
    bool vouched = (blk->flags & (KVHI_BF_LIVE | KVHI_BF_DEAD)) == KVHI_BF_LIVE && blk->ext_refs > 0;
    assert(vouched && "a release in the backlog names a live record");
    if (!vouched)
        return; /* never drop a reference the record does not have */
    blk->ext_refs--;
    block_unref(e, b);
}

void kvhi_block_release_apply_oldest(kvh_engine *e)
{
    uint64_t h = e->release_backlog[e->release_backlog_head];
    e->release_backlog_head = (e->release_backlog_head + 1) % KVHI_RELEASE_BACKLOG;
    e->release_backlog_len--;
    release_apply(e, h);
}

void kvhi_block_releases_apply(kvh_engine *e)
{
    kvhi_assert_locked(e);
    while (e->release_backlog_len)
        kvhi_block_release_apply_oldest(e);
    e->release_backlog_head = 0;
}

void kvhi_block_touch(kvh_engine *e, uint32_t b)
{
    kvhi_block *blk = kvhi_blk(e, b);
    kvhi_lruk_record(blk->hist, e->cfg.lru_k, ++e->clock);
    blk->hits++;
    kvhi_adapt_access(e, &e->adapt, b);
    if (blk->flags & KVHI_BF_HINTED)
        kvhi_hint_redeem(e, b); /* the use it predicted came */
    if (e->hint_count && e->clock >= e->hint_epoch_end)
        kvhi_hints_advance(e); /* hints lapse even when none come */
    /* Apart from a redeemed hint (re-keyed at once), an access only raises
     * the block's key (newer history, same class), so its heap entries
     * stay valid lower bounds: nothing to re-key (core/lruk.h, lazy
     * raises). */
}

void kvhi_block_wait_idle(kvh_engine *e, uint32_t b)
{
    if (!kvhi_block_busy(&e->blocks[b]))
        return;
    /* A worker waiting here runs no queued move meanwhile, and the block's
     * move may itself wait for one to make room (a full tier below): the
     * worker counts as waiting for room, so that the thread moving the
     * block runs the queued move itself (kvhi_wait_queued_moves_out)
     * instead of waiting seconds for a worker that cannot come. */
    bool worker = kvhi_is_worker(e);
    e->workers_waiting_room += worker;
    if (worker)
        pthread_cond_broadcast(&e->changed);
    while (kvhi_block_busy(&e->blocks[b]))
        pthread_cond_wait(&e->changed, &e->lock);
    e->workers_waiting_room -= worker;
}

static void agent_count(kvh_engine *e, uint32_t agent, int delta)
{
    if (!e->n_agents)
        return;
    kvhi_agent *a = kvhi_agent_get(e, agent, false);
    if (a)
        a->device_blocks += (uint64_t)(int64_t)delta;
}

/* b has arrived in the host tier: a lead for the cleaner, and a worker
 * woken to clean ahead when the host tier runs low. */
static inline void host_arrival(kvh_engine *e, uint32_t b)
{
    kvhi_disk_clean_lead(e, b);
    if (e->disk && e->n_workers && kvhi_disk_host_runs_low(e))
        pthread_cond_signal(&e->work_ready);
}

/* KVH_CHECK_SLOTS (core/slot_pool.h): the slot b is given is in use, and
 * no other live block's record names it in the same arena. */
static inline void check_slot_given(kvh_engine *e, uint32_t b, uint32_t tier, uint32_t slot)
{
#ifdef KVH_CHECK_SLOTS
    kvhi_slot_pool *p = &e->tiers[tier].slots;
    kvhi_slot_check_in_use(p, slot);
    uint32_t o = p->owner[slot];
    if (o != KVHI_NO_BLOCK && o != b && o < e->block_cap) {
        const kvhi_block *ob = &e->blocks[o];
        bool one_arena = e->tiers[KVH_TIER_HOST].shares_arena && ob->tier <= KVH_TIER_HOST && tier <= KVH_TIER_HOST;
        if ((ob->flags & (KVHI_BF_LIVE | KVHI_BF_DEAD)) == KVHI_BF_LIVE && ob->slot == slot &&
            (ob->tier == tier || one_arena))
            kvhi_slot_check_failed("given to a second block", slot);
    }
    p->owner[slot] = b;
#else
    (void)e, (void)b, (void)tier, (void)slot;
#endif
}

/* Records that b now occupies (tier, slot); lead: whether a host arrival
 * is a lead for the cleaner (not for a block read back from disk, which
 * keeps its disk copy: the caller decides once it knows). */
static inline void block_place_led(kvh_engine *e, uint32_t b, uint32_t tier, uint32_t slot, bool lead)
{
    kvhi_block *blk = kvhi_blk(e, b);
    if (blk->tier == KVH_TIER_DEVICE)
        agent_count(e, blk->agent, -1);
    if (blk->pins && blk->tier < KVH_TIER_COUNT) {
        /* A pinned block that a call must read or change in memory is
         * brought up (kvh.h, kvh_seq_pin): the pin follows. */
        e->tiers[blk->tier].pinned--;
        e->tiers[tier].pinned++;
    }
    if (tier < KVH_TIER_COUNT)
        check_slot_given(e, b, tier, slot);
    blk->tier = (uint8_t)tier;
    blk->slot = slot;
    blk->hits = 0;
    if (tier == KVH_TIER_DEVICE)
        agent_count(e, blk->agent, +1);
    else if (tier == KVH_TIER_HOST && lead)
        host_arrival(e, b);
}

static inline void block_place(kvh_engine *e, uint32_t b, uint32_t tier, uint32_t slot)
{
    block_place_led(e, b, tier, slot, true);
}

void kvhi_block_place(kvh_engine *e, uint32_t b, uint32_t tier, uint32_t slot) { block_place(e, b, tier, slot); }

/* A new record's first place (block_place with no tier to leave and no
 * pins to carry), inline on the allocation path. */
static inline void block_place_new(kvh_engine *e, uint32_t b, uint32_t tier, uint32_t slot)
{
    kvhi_block *blk = kvhi_blk(e, b);
    check_slot_given(e, b, tier, slot);
    blk->tier = (uint8_t)tier;
    blk->slot = slot;
    if (tier == KVH_TIER_DEVICE)
        agent_count(e, blk->agent, +1);
    else if (tier == KVH_TIER_HOST)
        host_arrival(e, b);
}

void kvhi_block_place_unled(kvh_engine *e, uint32_t b, uint32_t tier, uint32_t slot)
{
    block_place_led(e, b, tier, slot, false);
}

void kvhi_block_host_arrived(kvh_engine *e, uint32_t b)
{
    if (e->blocks[b].tier == KVH_TIER_HOST)
        host_arrival(e, b);
}

/* How many allocations ahead a record is prefetched: a miss to memory
 * lasts several calls (scale's memory_read row, 170-290 ns here, against
 * about 25 ns an allocation). */
#define BLOCK_PREFETCH_AHEAD 16u

__attribute__((always_inline)) static inline kvh_status block_new(kvh_engine *e, uint32_t agent, uint32_t min_tier,
                                                                  uint32_t *out)
{
    uint32_t slot = 0, tier = KVH_TIER_COUNT;
    kvh_status st = KVH_ERR_NOSPACE;
    /* The preferred tier first, then the other memory tiers fastest first.
     * Block records are never short before a slot is: every live record
     * holds at least one slot, and there are as many records as slots. */
    uint32_t order[KVH_TIER_DISK + 1], n_order = 0;
    /* Most often the preferred tier has a free slot and no agent quota to
     * check: kvhi_reserve_slot's first step, taken here without the call. */
    kvhi_tier *pref = min_tier < KVH_TIER_DISK ? &e->tiers[min_tier] : NULL;
    if (pref && pref->present && !(min_tier == KVH_TIER_DEVICE && e->n_agents) &&
        kvhi_slot_pool_alloc(&pref->slots, &slot) == 0) {
        tier = min_tier;
        st = KVH_OK;
    } else {
        order[n_order++] = min_tier;
        for (uint32_t t = 0; t < KVH_TIER_DISK; t++)
            if (t != min_tier)
                order[n_order++] = t;
    }
    /* A tier without room, then one with: the first one's reason is not
     * the caller's (its call may succeed, or fail for its own reason). */
    kvhi_error_kept before;
    if (n_order)
        kvhi_error_keep(&before);
    for (uint32_t i = 0; i < n_order; i++) {
        uint32_t t = order[i];
        if (t >= KVH_TIER_DISK || !e->tiers[t].present)
            continue;
        st = kvhi_reserve_slot(e, t, agent, &slot);
        if (st == KVH_OK) {
            tier = t;
            kvhi_error_put_back(&before);
            break;
        }
        if (st != KVH_ERR_NOSPACE)
            return st;
    }
    if (st != KVH_OK) {
        /* Referenced blocks leave memory only for the disk tier: say so
         * when it is the full one. */
        /* A full file system shows only as refused writes (the slabs
         * grow on demand): the last one refused, none written since. */
        return kvhi_fail(KVH_ERR_NOSPACE,
                         "no memory tier can make room for a new block (all pinned, held or referenced%s)",
                         kvhi_disk_tier_full(e) ? ", and the disk tier is full"
                         : e->disk_full_rest_ms ? ", and the disk tier's file system is full (its last write was "
                                                  "refused for space)"
                                                : "");
    }
    if (e->block_free_top == 0) { /* taken while the lock was dropped */
        kvhi_release_slot(e, tier, slot);
        return kvhi_fail(KVH_ERR_NOSPACE, "no free block metadata");
    }
    uint32_t b = e->block_free[--e->block_free_top];
    kvhi_block *blk = kvhi_blk(e, b);
    /* A later allocation's record, loading meanwhile: after frees in
     * random order the free list is in random order too. */
    if (e->block_free_top >= BLOCK_PREFETCH_AHEAD) {
        uint32_t ahead = e->block_free[e->block_free_top - BLOCK_PREFETCH_AHEAD];
        kvhi_block_prefetch(e, ahead);
        kvhi_block_release_key_prefetch(e, ahead); /* kvh_block_alloc sets it */
    }
    /* Field by field: a memset of the whole record is measurably slower on
     * the allocation path. gen survives; the rest is set here. */
    blk->refs = 1;
    blk->ext_refs = 0;
    blk->holds = 0;
    blk->pins = 0;
    blk->n_tokens = 0;
    blk->hits = 0;
    blk->hash = 0;
    blk->parent_hash = 0;
    blk->data_crc = 0;
    blk->written = NULL;
    blk->deferred_slot = KVHI_NO_BLOCK;
    /* Its first access, recorded into an empty history. */
    blk->hist[0] = ++e->clock;
    for (uint32_t i = 1; i < KVHI_MAX_K; i++)
        blk->hist[i] = 0;
    blk->agent = agent;
    blk->tolerance = KVH_TOLERANCE_DEFAULT;
    blk->flags = KVHI_BF_LIVE;
    blk->heap_pos = KVHI_HEAP_NONE;
    blk->quota_heap_pos = KVHI_HEAP_NONE;
    blk->disk_copy = KVHI_NO_BLOCK;
    block_place_new(e, b, tier, slot);
    kvhi_adapt_access(e, &e->adapt, b);
    /* Live, idle and unheld, in no order yet: it joins its tier's pending
     * (block_update_evictable's first step), unless an agent's quota or a
     * heap without a ring needs the rest of that path. */
    if (e->n_agents || !kvhi_lruk_add_pending(&e->tiers[tier].heap, b))
        block_update_evictable(e, b);
    if (e->hint_count && e->clock >= e->hint_epoch_end)
        kvhi_hints_advance(e); /* allocations count as accesses for hints' lapse */
    e->stats.blocks_allocated++;
    e->block_newest = b;
    *out = b;
    return KVH_OK;
}

kvh_status kvhi_block_new(kvh_engine *e, uint32_t agent, uint32_t min_tier, uint32_t *out)
{
    return block_new(e, agent, min_tier, out);
}

kvh_status kvhi_block_new_handle(kvh_engine *e, uint32_t agent, uint64_t *id)
{
    uint32_t b = 0;
    kvh_status st = block_new(e, agent, KVH_TIER_DEVICE, &b);
    if (st == KVH_OK) {
        e->blocks[b].ext_refs = 1;
        *id = kvhi_block_handle(e, b);
        kvhi_block_release_key_set(e, b, 1);
    }
    return st;
}

/* Frees b's metadata, and its slot unless keep_slot. Not in flight. */
/* Moves the record to its next generation, keeping the low 32 bits
 * (internal staleness checks) non-zero. False when a handle's generation
 * bits would repeat a value the record already had: the record is then
 * retired, never handed out again. */
static bool block_gen_advance(kvh_engine *e, kvhi_block *blk)
{
    uint64_t gen = kvhi_block_gen(blk) + 1;
    if ((uint32_t)gen == 0)
        gen++;
    blk->gen = (uint32_t)gen;
    blk->gen_hi = (uint32_t)(gen >> 32);
    unsigned handle_gen_bits = KVHI_HANDLE_TAG_SHIFT - e->block_index_bits;
    return (gen - e->gen_start) >> handle_gen_bits == 0;
}

/* b is being destroyed: its kept twin's reference goes, and its handle
 * pins with it (its record's pins count is dropped with the record). */
static void forget_handle_extras(kvh_engine *e, uint32_t b)
{
    uint32_t v;
    (void)kvhi_block_map_take(&e->handle_pins, b, &v);
    if (kvhi_block_map_take(&e->handle_twins, b, &v))
        kvhi_block_unref(e, v);
}

int kvhi_block_keep_twin(kvh_engine *e, uint32_t b, uint32_t twin)
{
    uint32_t *kept = kvhi_block_map_find(&e->handle_twins, b);
    if (kept && *kept == twin) {
        kvhi_block_unref(e, twin); /* kept already (persisted twice): one reference is enough */
        return 0;
    }
    if (kept) {
        /* Another twin stood in this time (the first left the prefix
         * index): the one just made durable is what must stay. */
        uint32_t old = *kept;
        *kept = twin;
        kvhi_block_unref(e, old);
        return 0;
    }
    return kvhi_block_map_put(&e->handle_twins, b, twin);
}

kvh_status kvhi_block_pin_handle(kvh_engine *e, uint32_t b, bool pin)
{
    uint32_t *mine = kvhi_block_map_find(&e->handle_pins, b);
    if (!pin) {
        if (!mine || *mine == 0)
            return kvhi_fail(KVH_ERR_INVALID_ARG, "no pin taken through a block handle is left to drop "
                                                  "(a sequence's pins are its own)");
        if (--*mine == 0) {
            uint32_t v;
            (void)kvhi_block_map_take(&e->handle_pins, b, &v);
        }
    } else {
        if (e->blocks[b].pins == UINT32_MAX)
            return kvhi_fail(KVH_ERR_RANGE, "the block is pinned %u times already", UINT32_MAX);
        if (mine)
            ++*mine;
        else if (kvhi_block_map_put(&e->handle_pins, b, 1) != 0)
            return kvhi_fail(KVH_ERR_NOMEM, "out of memory for a block's pins");
    }
    kvhi_block_pin(e, b, pin);
    return KVH_OK;
}

__attribute__((always_inline)) static inline void block_destroy(kvh_engine *e, uint32_t b, bool keep_slot)
{
    kvhi_block *blk = kvhi_blk(e, b);
    assert(e->block_readers[b] == 0);                 /* a read holds it, so it cannot be destroyed */
    if (e->handle_twins.count | e->handle_pins.count) /* most engines never keep one */
        forget_handle_extras(e, b);
    heaps_remove(e, b);
    kvhi_adapt_forget(e, &e->adapt, b);
    if (blk->flags & KVHI_BF_PUBLISHED)
        kvhi_prefix_erase(&e->prefix, blk->hash, b);
    if (e->disk)
        kvhi_disk_forget(e, b);
    kvhi_clean_drop(e, b);
    if (blk->pins)
        e->tiers[blk->tier].pinned--;
    if (blk->tier == KVH_TIER_DEVICE)
        agent_count(e, blk->agent, -1);
    if (!keep_slot)
        kvhi_release_slot(e, blk->tier, blk->slot);
    if (blk->written) { /* most blocks are freed without one */
        free(blk->written);
        blk->written = NULL;
    }
    blk->flags = 0;
    blk->tier = KVHI_NO_TIER;
    kvhi_block_release_key_clear(e, b);
    if (block_gen_advance(e, blk))
        e->block_free[e->block_free_top++] = b;
    else
        e->blocks_retired++;
    e->stats.blocks_freed++;
}

__attribute__((always_inline)) static inline void block_free_now(kvh_engine *e, uint32_t b)
{
    kvhi_block *blk = kvhi_blk(e, b);
    /* Busy (a copy runs) or held (e.g. attention kernels still queued on a
     * stream): its slot must outlive that use, so it is reaped later. */
    if (kvhi_block_busy(blk) || blk->holds) {
        /* The mover owns it until its copy ends; it reaps DEAD blocks. */
        blk->flags |= KVHI_BF_DEAD;
        kvhi_block_release_key_clear(e, b);
        heaps_remove(e, b);
        if (blk->flags & KVHI_BF_PUBLISHED) {
            kvhi_prefix_erase(&e->prefix, blk->hash, b);
            blk->flags &= (uint16_t)~KVHI_BF_PUBLISHED;
        }
        return;
    }
    if (blk->flags & KVHI_BF_PREFETCHED) /* freed before its first use */
        e->stats.prefetch_wasted++;
    block_destroy(e, b, false);
}

void kvhi_block_free_now(kvh_engine *e, uint32_t b) { block_free_now(e, b); }

uint32_t kvhi_block_drop(kvh_engine *e, uint32_t b)
{
    uint32_t slot = e->blocks[b].slot;
    block_destroy(e, b, true);
    return slot;
}

bool kvhi_block_in_device(const kvh_engine *e, uint32_t b)
{
    const kvhi_block *blk = &e->blocks[b];
    return blk->tier == KVH_TIER_DEVICE && (!kvhi_block_in_flight(blk) || kvhi_move_state(blk) == KVHI_MS_RECALLED);
}

bool kvhi_block_recall(kvh_engine *e, uint32_t b)
{
    kvhi_block *blk = kvhi_blk(e, b);
    enum kvhi_move_state st = kvhi_move_state(blk);
    if (st == KVHI_MS_DEMOTING)
        kvhi_block_move_event(blk, KVHI_EV_RECALL);
    return st == KVHI_MS_DEMOTING || st == KVHI_MS_RECALLED;
}

__attribute__((always_inline)) static inline void block_unref(kvh_engine *e, uint32_t b)
{
    kvhi_assert_locked(e);
    kvhi_block *blk = kvhi_blk(e, b);
    if (--blk->refs > 0) {
        /* Its last caller reference went; uploads' remain (engine.h). */
        if (e->upload_refs && blk->refs == e->upload_refs[b])
            block_update_evictable(e, b);
        return;
    }
    if (blk->flags & KVHI_BF_PUBLISHED)
        block_update_evictable(e, b); /* stays cached, now cheaper to drop */
    else
        block_free_now(e, b);
}

void kvhi_block_unref(kvh_engine *e, uint32_t b) { block_unref(e, b); }

void kvhi_block_writing_done(kvh_engine *e, uint32_t b)
{
    kvhi_block *blk = kvhi_blk(e, b);
    kvhi_block_move_event(blk, KVHI_EV_COPY_END);
    if (blk->deferred_slot != KVHI_NO_BLOCK) {
        kvhi_block_release_source(e, b, blk->deferred_tier, blk->deferred_slot);
        blk->deferred_slot = KVHI_NO_BLOCK;
    }
}

typedef struct kvhi_read_slot {
    uint32_t block, slot, tier;
} kvhi_read_slot;

void kvhi_block_release_source(kvh_engine *e, uint32_t b, uint32_t tier, uint32_t slot)
{
    if (e->block_readers[b] == 0) {
        kvhi_release_slot(e, tier, slot);
        return;
    }
    if (e->n_read_slots == e->cap_read_slots) {
        uint32_t cap = e->cap_read_slots ? e->cap_read_slots * 2 : 16;
        kvhi_read_slot *grown = realloc(e->read_slots, cap * sizeof(*grown));
        if (!grown) {
            /* A slot lost until close is better than one overwritten
             * while it is read. */
            kvhi_log_later(e, KVH_LOG_WARN, "out of memory: a slot of tier %u stays taken until close", tier);
            return;
        }
        e->read_slots = grown;
        e->cap_read_slots = cap;
    }
    e->read_slots[e->n_read_slots++] = (kvhi_read_slot){b, slot, tier};
}

static void release_read_slots(kvh_engine *e, uint32_t b)
{
    bool freed = false;
    for (uint32_t i = 0; i < e->n_read_slots;) {
        kvhi_read_slot *h = &e->read_slots[i];
        if (h->block != b) {
            i++;
            continue;
        }
        kvhi_release_slot(e, h->tier, h->slot);
        *h = e->read_slots[--e->n_read_slots];
        freed = true;
    }
    if (freed)
        pthread_cond_broadcast(&e->changed); /* room appeared */
}

void kvhi_block_hold(kvh_engine *e, uint32_t b)
{
    if (e->blocks[b].holds++ == 0)
        kvhi_block_update_evictable(e, b);
}

void kvhi_block_unhold(kvh_engine *e, uint32_t b)
{
    kvhi_block *blk = kvhi_blk(e, b);
    if (--blk->holds)
        return;
    if ((blk->flags & KVHI_BF_DEAD) && !kvhi_block_busy(blk))
        block_destroy(e, b, false);
    else
        kvhi_block_update_evictable(e, b);
}

void kvhi_block_hold_reading(kvh_engine *e, uint32_t b)
{
    e->block_readers[b]++;
    kvhi_block_hold(e, b);
}

void kvhi_block_unhold_reading(kvh_engine *e, uint32_t b)
{
    if (--e->block_readers[b] == 0 && e->n_read_slots)
        release_read_slots(e, b);
    kvhi_block_unhold(e, b);
}

void kvhi_block_pin(kvh_engine *e, uint32_t b, bool pin)
{
    kvhi_assert_locked(e);
    kvhi_block *blk = kvhi_blk(e, b);
    if (pin) {
        if (blk->pins++ == 0) {
            e->tiers[blk->tier].pinned++;
            kvhi_block_update_evictable(e, b);
        }
    } else if (blk->pins > 0 && --blk->pins == 0) {
        e->tiers[blk->tier].pinned--;
        kvhi_block_update_evictable(e, b);
        kvhi_disk_clean_lead(e, b);
    }
}

static uint64_t bitmap_words(kvh_engine *e) { return ((uint64_t)e->cfg.num_layers * e->cfg.block_tokens + 63) / 64; }

bool kvhi_block_kv_complete(kvh_engine *e, uint32_t b) { return (e->blocks[b].flags & KVHI_BF_KV_COMPLETE) != 0; }

/* Marks cells [t0, t1) of layer written; sets KV_COMPLETE when all are. */
kvh_status kvhi_block_mark_written(kvh_engine *e, uint32_t b, uint32_t layer, uint32_t t0, uint32_t t1)
{
    kvhi_block *blk = kvhi_blk(e, b);
    if (blk->flags & KVHI_BF_KV_COMPLETE)
        return KVH_OK;
    uint64_t words = bitmap_words(e);
    if (!blk->written) {
        blk->written = calloc(words, sizeof(uint64_t));
        if (!blk->written)
            return kvhi_fail(KVH_ERR_NOMEM, "out of memory for a block bitmap");
    }
    uint64_t base = (uint64_t)layer * e->cfg.block_tokens;
    for (uint32_t t = t0; t < t1; t++)
        blk->written[(base + t) / 64] |= 1ull << ((base + t) % 64);
    uint64_t cells = (uint64_t)e->cfg.num_layers * e->cfg.block_tokens;
    for (uint64_t w = 0; w < words; w++) {
        uint64_t want = (w + 1) * 64 <= cells ? ~0ull : ((1ull << (cells % 64)) - 1);
        if (blk->written[w] != want)
            return KVH_OK;
    }
    free(blk->written);
    blk->written = NULL;
    blk->flags |= KVHI_BF_KV_COMPLETE;
    kvhi_block_try_publish(e, b);
    return KVH_OK;
}

bool kvhi_block_cell_written(kvh_engine *e, uint32_t b, uint32_t layer, uint32_t t)
{
    kvhi_block *blk = kvhi_blk(e, b);
    if (blk->flags & KVHI_BF_KV_COMPLETE)
        return true;
    if (!blk->written)
        return false;
    uint64_t bit = (uint64_t)layer * e->cfg.block_tokens + t;
    return (blk->written[bit / 64] >> (bit % 64)) & 1;
}

/* Forgets cells of tokens >= keep (all layers); used by truncate. */
kvh_status kvhi_block_forget_tokens(kvh_engine *e, uint32_t b, uint32_t keep)
{
    kvhi_block *blk = kvhi_blk(e, b);
    /* Its disk data, if any, describes the old tokens (hash and count in
     * the slot header): the caller brings it to memory first. */
    assert(blk->tier != KVH_TIER_DISK && !kvhi_block_busy(blk) && !(blk->flags & KVHI_BF_PUBLISHED));
    if (blk->flags & KVHI_BF_DISK_COPY)
        kvhi_disk_forget(e, b);
    uint64_t words = bitmap_words(e);
    if (blk->flags & KVHI_BF_KV_COMPLETE) {
        /* Every cell was written: mark exactly the kept ones (no bits past
         * the last cell, so completeness checks stay exact). */
        blk->written = calloc(words, sizeof(uint64_t));
        if (!blk->written)
            return kvhi_fail(KVH_ERR_NOMEM, "out of memory for a block bitmap");
        for (uint32_t l = 0; l < e->cfg.num_layers; l++)
            for (uint32_t t = 0; t < keep; t++) {
                uint64_t bit = (uint64_t)l * e->cfg.block_tokens + t;
                blk->written[bit / 64] |= 1ull << (bit % 64);
            }
        blk->flags &= (uint16_t)~KVHI_BF_KV_COMPLETE;
    } else if (blk->written) {
        for (uint32_t l = 0; l < e->cfg.num_layers; l++)
            for (uint32_t t = keep; t < e->cfg.block_tokens; t++) {
                uint64_t bit = (uint64_t)l * e->cfg.block_tokens + t;
                blk->written[bit / 64] &= ~(1ull << (bit % 64));
            }
    }
    blk->n_tokens = (uint16_t)keep;
    blk->flags &= (uint16_t) ~(KVHI_BF_HASHED | KVHI_BF_DISK_HASHED);
    blk->hash = 0;
    return KVH_OK;
}

void kvhi_block_try_publish(kvh_engine *e, uint32_t b)
{
    kvhi_block *blk = kvhi_blk(e, b);
    uint8_t need = KVHI_BF_HASHED | KVHI_BF_KV_COMPLETE;
    if ((blk->flags & need) != need || (blk->flags & (KVHI_BF_PUBLISHED | KVHI_BF_DEAD)))
        return;
    /* A block with the same prefix may be cached already: keep that one. */
    if (kvhi_block_publish_unique(e, b))
        kvhi_remote_queue_upload(e, b, KVH_REMOTE_UPLOAD_WRITE_THROUGH);
}

uint32_t kvhi_block_find_published(kvh_engine *e, uint64_t hash, uint64_t parent, const int32_t *tokens)
{
    size_t bytes = e->cfg.block_tokens * sizeof(int32_t);
    uint64_t pos = 0;
    for (uint32_t b; (b = kvhi_prefix_next(&e->prefix, hash, &pos)) != KVHI_PREFIX_MISS;)
        if (e->blocks[b].parent_hash == parent && memcmp(kvhi_block_tokens(e, b), tokens, bytes) == 0)
            return b;
    return KVHI_PREFIX_MISS;
}

bool kvhi_block_publish_unique(kvh_engine *e, uint32_t b)
{
    kvhi_block *blk = kvhi_blk(e, b);
    /* One whose tokens were chosen to give another prefix's hash (or a
     * true collision) is published beside it, so neither keeps the other
     * out of the cache (kvh.h "Tenant scopes"). */
    if (kvhi_block_find_published(e, blk->hash, blk->parent_hash, kvhi_block_tokens(e, b)) != KVHI_PREFIX_MISS ||
        kvhi_prefix_insert(&e->prefix, blk->hash, b) != 0)
        return false;
    blk->flags |= KVHI_BF_PUBLISHED;
    kvhi_disk_clean_lead(e, b); /* cleanable where it lies */
    return true;
}

kvh_status kvhi_block_cow(kvh_engine *e, uint32_t b, uint32_t agent, uint32_t *out)
{
    uint32_t nb;
    kvh_status st = kvhi_block_new(e, agent, KVH_TIER_DEVICE, &nb);
    if (st != KVH_OK)
        return st;
    /* The lock may have been dropped: let b settle (a block in flight can
     * be half of a tier swap), keeping the new block in memory meanwhile,
     * then read both locations afresh. */
    kvhi_block *src = kvhi_blk(e, b), *dst = kvhi_blk(e, nb);
    kvhi_block_hold(e, nb);
    st = kvhi_block_ensure_memory(e, b);
    if (st == KVH_OK)
        st = kvhi_block_ensure_memory(e, nb);
    kvhi_block_unhold(e, nb);
    if (st != KVH_OK) {
        kvhi_block_unref(e, nb);
        return st;
    }
    if (kvhi_block_copy(e, dst->tier, kvhi_block_data(e, nb), src->tier, kvhi_block_data(e, b)) != 0) {
        kvhi_block_unref(e, nb);
        return kvhi_fail(KVH_ERR_IO, "copy-on-write copy failed");
    }
    memcpy(kvhi_block_tokens(e, nb), kvhi_block_tokens(e, b), sizeof(int32_t) * e->cfg.block_tokens);
    dst->n_tokens = src->n_tokens;
    dst->tolerance = src->tolerance;
    dst->hash = src->hash;
    dst->parent_hash = src->parent_hash;
    dst->flags |= src->flags & (KVHI_BF_HASHED | KVHI_BF_KV_COMPLETE);
    if (src->written) {
        size_t bytes = bitmap_words(e) * sizeof(uint64_t);
        dst->written = malloc(bytes);
        if (!dst->written) {
            kvhi_block_unref(e, nb);
            return kvhi_fail(KVH_ERR_NOMEM, "out of memory for a block bitmap");
        }
        memcpy(dst->written, src->written, bytes);
    }
    kvhi_block_unref(e, b);
    e->stats.cow_copies++;
    *out = nb;
    return KVH_OK;
}
