/* The weight-context switch: one context's weights (and, by policy, its
 * agents' KV) leave the device tier while the next one's arrive, layer by
 * layer.
 *
 * A switch runs on two threads of its own, one per direction, so that the
 * departures (mostly drops: clean weights are never written) and the
 * arrivals overlap; an arrival that finds the device tier full waits for
 * pending departures before it evicts KV, and the departures' thread then
 * helps load. The migration workers are not used for weights because their
 * job queue moves fixed-size blocks; the KV part of a switch does go
 * through them. The switch counts as an active call, so engine close
 * waits for it. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/context.h"
#include "core/crc32c.h"
#include "core/block.h"
#include "core/migrate.h"
#include "core/seq.h"

enum { ROLE_DEPART = 1, ROLE_ARRIVE = 2, ROLE_HELP_ARRIVE = 4 };

typedef struct kvhi_switch kvhi_switch;
typedef struct kvhi_switch_arg {
    kvhi_switch *sw;
    int roles; /* ROLE_* bits this thread runs, departures first */
} kvhi_switch_arg;

struct kvhi_switch {
    kvh_engine *e;
    kvhi_context *from, *to; /* kept alive by their `switching` flag */
    uint32_t fence;
    uint32_t running; /* threads not finished */
    kvhi_switch_arg args[2];
    uint32_t arrival_next;    /* cursor into to->load_order */
    uint32_t arrival_workers; /* threads taking regions from it */
    bool arrivals_failed;
    kvh_status status;
    char msg[KVHI_CONTEXT_MSG_BYTES];
};

static void switch_fail(kvhi_switch *sw, kvh_status st)
{
    if (st != KVH_OK && sw->status == KVH_OK) {
        sw->status = st;
        snprintf(sw->msg, sizeof(sw->msg), "%s", kvhi_failure_text(st));
    }
}

/* A block a switch moves, and the generation it had when picked. */
typedef struct kv_pick {
    uint32_t block, gen;
} kv_pick;

static int pick_cmp(const void *a, const void *b)
{
    uint32_t x = ((const kv_pick *)a)->block, y = ((const kv_pick *)b)->block;
    return (x > y) - (x < y);
}

static bool kv_wanted(const kvhi_block *b, uint32_t tier)
{
    bool wanted = tier == KVH_TIER_DEVICE ? b->tier != KVH_TIER_DEVICE : b->tier == KVH_TIER_DEVICE && !b->holds;
    return wanted && !b->pins && (b->flags & (KVHI_BF_LIVE | KVHI_BF_DEAD)) == KVHI_BF_LIVE;
}

/* Moves the context's KV blocks to `tier` through the migration workers
 * and waits (lock held, dropped while waiting). Best effort: blocks that
 * cannot move stay where they are. Returns how many blocks it moved: a
 * block that attached sequences share is moved and counted once, and one
 * whose move failed is not counted. */
static uint64_t move_context_kv(kvh_engine *e, kvhi_context *x, uint32_t tier)
{
    if (!e->tiers[tier].present)
        return 0;
    /* Picked before any move: an inline move drops the lock. */
    uint64_t cap = 0;
    for (uint32_t i = 0; i < x->n_seqs; i++) {
        kvhi_seq *s = kvhi_handles_get(&e->seqs, x->seqs[i], NULL);
        cap += s ? s->n_blocks : 0;
    }
    kv_pick *picks = cap ? malloc(sizeof(*picks) * cap) : NULL;
    if (!picks) {
        kvhi_clear_error();
        return 0;
    }
    uint64_t n = 0;
    for (uint32_t i = 0; i < x->n_seqs; i++) {
        kvhi_seq *s = kvhi_handles_get(&e->seqs, x->seqs[i], NULL);
        for (uint32_t j = 0; s && j < s->n_blocks; j++)
            if (kv_wanted(&e->blocks[s->blocks[j]], tier))
                picks[n++] = (kv_pick){s->blocks[j], e->blocks[s->blocks[j]].gen};
    }
    qsort(picks, (size_t)n, sizeof(*picks), pick_cmp);
    uint64_t distinct = 0;
    for (uint64_t i = 0; i < n; i++)
        if (distinct == 0 || picks[distinct - 1].block != picks[i].block)
            picks[distinct++] = picks[i];
    uint32_t fidx;
    if (kvhi_fence_new(e, &fidx, NULL) != KVH_OK) {
        free(picks);
        kvhi_clear_error();
        return 0;
    }
    kvhi_fence_expect(e, fidx, 1); /* this function's own count, so the fence cannot end early */
    for (uint64_t i = 0; i < distinct; i++) {
        const kvhi_block *b = &e->blocks[picks[i].block];
        if (b->gen != picks[i].gen || !kv_wanted(b, tier) ||
            kvhi_enqueue(e, picks[i].block, tier, tier == KVH_TIER_DEVICE ? 1 : 0, KVHI_JOB_MOVE, fidx) != KVH_OK)
            picks[i].gen = 0; /* not moved by this call (gen is never 0) */
    }
    kvhi_fence_done(e, fidx, KVH_OK);
    kvhi_fence_wait_idx(e, fidx, UINT64_MAX);
    kvhi_fence_drop(e, fidx);
    kvhi_clear_error();
    uint64_t moved = 0;
    for (uint64_t i = 0; i < distinct; i++) {
        const kvhi_block *b = &e->blocks[picks[i].block];
        if (picks[i].gen && b->gen == picks[i].gen && (b->flags & KVHI_BF_LIVE) &&
            (tier == KVH_TIER_DEVICE) == (b->tier == KVH_TIER_DEVICE))
            moved++;
    }
    free(picks);
    return moved;
}

static int u32_cmp(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* KVH_CONTEXT_KV_DEMOTE's departure: the KV goes to the host tier, and
 * what the host tier cannot take (absent, or full of weights) to the disk
 * tier. What still stays (no room below, held, pinned) is logged: the
 * switch itself succeeds. Lock held, dropped while moving. */
static void demote_context_kv(kvh_engine *e, kvhi_context *x)
{
    kvhi_contexts *c = e->contexts;
    uint64_t moved = move_context_kv(e, x, KVH_TIER_HOST);
    moved += move_context_kv(e, x, KVH_TIER_DISK);
    c->stats.kv_blocks_demoted += moved;
    /* Blocks the attached sequences share count once. */
    uint64_t cap = 0, stayed = 0, n = 0;
    for (uint32_t i = 0; i < x->n_seqs; i++) {
        kvhi_seq *s = kvhi_handles_get(&e->seqs, x->seqs[i], NULL);
        cap += s ? s->n_blocks : 0;
    }
    uint32_t *left = cap ? malloc(sizeof(*left) * cap) : NULL;
    for (uint32_t i = 0; left && i < x->n_seqs; i++) {
        kvhi_seq *s = kvhi_handles_get(&e->seqs, x->seqs[i], NULL);
        for (uint32_t j = 0; s && j < s->n_blocks; j++) {
            const kvhi_block *b = &e->blocks[s->blocks[j]];
            if ((b->flags & (KVHI_BF_LIVE | KVHI_BF_DEAD)) == KVHI_BF_LIVE && b->tier == KVH_TIER_DEVICE)
                left[n++] = s->blocks[j];
        }
    }
    if (n)
        qsort(left, (size_t)n, sizeof(*left), u32_cmp);
    for (uint64_t i = 0; i < n; i++)
        stayed += i == 0 || left[i] != left[i - 1];
    if (!left && cap) /* no memory to tell shared blocks apart: all are counted */
        for (uint32_t i = 0; i < x->n_seqs; i++) {
            kvhi_seq *s = kvhi_handles_get(&e->seqs, x->seqs[i], NULL);
            for (uint32_t j = 0; s && j < s->n_blocks; j++) {
                const kvhi_block *b = &e->blocks[s->blocks[j]];
                stayed += (b->flags & (KVHI_BF_LIVE | KVHI_BF_DEAD)) == KVHI_BF_LIVE && b->tier == KVH_TIER_DEVICE;
            }
        }
    free(left);
    if (stayed)
        kvhi_log(e, KVH_LOG_WARN,
                 "context '%s': %llu KV blocks stay in the device tier after the switch away (held, pinned, or no "
                 "room in the host or disk tier)",
                 x->name, (unsigned long long)stayed);
}

#define HOST_ROOM_RECHECK_NS (10 * 1000 * 1000)

/* Takes room for r in the host tier from what is free now, waiting for
 * the incoming context to give back the host room it is leaving, unless
 * the arrivals are themselves stuck waiting for this side. Lock held. */
static bool take_free_host_room(kvh_engine *e, kvhi_context *x, kvhi_region *r)
{
    kvhi_contexts *c = e->contexts;
    while (e->tiers[KVH_TIER_HOST].present) {
        if (kvhi_charge_add(e, x, KVH_TIER_HOST, r->size, KVHI_CHARGE_FREE_ONLY) == KVH_OK)
            return true;
        /* Arrivals waiting for device room while device slots are free
         * will give host room back once they take them: they were woken by
         * this side's last departure, or (a slot freed outside the switch,
         * which signals nothing) are woken here. Only arrivals with no
         * device room to take are stuck on this side. */
        bool arrivals_stuck = c->arrivals_waiting && e->tiers[KVH_TIER_DEVICE].slots.free_count == 0;
        if (!c->arrivals_running || arrivals_stuck)
            break;
        if (c->arrivals_waiting)
            pthread_cond_broadcast(&c->cv);
        /* Timed: device room can appear with no signal to this side. */
        struct timespec ts = kvhi_realtime_in_ns(HOST_ROOM_RECHECK_NS);
        pthread_cond_timedwait(&c->cv, &e->lock, &ts);
    }
    kvhi_clear_error();
    return false;
}

/* Moves r from the device tier to the host tier, whose room is already
 * charged: re-accounting on unified memory, a copy otherwise (crc_mode as
 * for kvhi_region_copy). Lock held, dropped for the copy. On failure the
 * host charge is given back and r stays where it was. */
static kvh_status region_to_host(kvh_engine *e, kvhi_context *x, kvhi_region *r, int crc_mode)
{
    kvhi_contexts *c = e->contexts;
    bool unified = kvhi_unified_memory(e);
    bool recompute = crc_mode == KVHI_CRC_RECORD && (r->stale_crc || !r->crc_known);
    uint8_t *mem = NULL;
    uint32_t bad = 0;
    int rc = 0;
    r->busy = true;
    pthread_mutex_unlock(&e->lock);
    if (unified) {
        /* Same memory: only the checksums are brought up to date. */
        for (uint32_t i = 0; recompute && i < r->n_chunks; i++) {
            uint64_t off = (uint64_t)i * x->chunk_bytes;
            uint64_t n = r->size - off < x->chunk_bytes ? r->size - off : x->chunk_bytes;
            r->chunk_crc[i] = kvhi_crc32c(0, r->data + off, n);
        }
    } else if ((mem = kvhi_region_mem_take(e, KVH_TIER_HOST, r->size)) != NULL) {
        rc = kvhi_region_copy(e, r, x->chunk_bytes, mem, KVH_TIER_HOST, r->data, KVH_TIER_DEVICE, crc_mode, &bad);
        if (rc != 0)
            kvhi_region_mem_give(e, KVH_TIER_HOST, mem, r->size);
        else
            kvhi_region_mem_give(e, r->alloc_tier, r->data, r->size);
    }
    pthread_mutex_lock(&e->lock);
    r->busy = false;
    if (!unified && (!mem || rc != 0)) {
        kvhi_charge_sub(e, x, KVH_TIER_HOST, r->size);
        return kvhi_fail(mem ? KVH_ERR_IO : KVH_ERR_NOMEM, "cannot move weight region '%s' to the host tier", r->name);
    }
    kvhi_charge_sub(e, x, KVH_TIER_DEVICE, r->size);
    r->tier = KVH_TIER_HOST;
    if (crc_mode == KVHI_CRC_RECORD) {
        r->crc_known = true;
        r->stale_crc = false;
    }
    if (unified) {
        c->stats.bytes_remapped += r->size;
    } else {
        r->data = mem;
        r->alloc_tier = KVH_TIER_HOST;
        c->stats.bytes_device_to_host += r->size;
    }
    return KVH_OK;
}

/* Frees a clean region's memory: its source has the same bytes. */
static void drop_region(kvh_engine *e, kvhi_context *x, kvhi_region *r)
{
    e->contexts->stats.bytes_dropped += r->size;
    kvhi_region_release(e, x, r, true);
}

/* One departing region (lock held, may drop). */
static kvh_status depart_region(kvh_engine *e, kvhi_context *x, kvhi_region *r)
{
    if (!r->dirty && r->fd >= 0) {
        /* Clean: never written anywhere. It stays in RAM as host-tier
         * memory when the host tier has free room (a remap on unified
         * memory; a copy otherwise, cheaper than reading the file again
         * on the way back), else it is dropped: no eviction for it, it can
         * always be read again. */
        if (take_free_host_room(e, x, r) && region_to_host(e, x, r, KVHI_CRC_NONE) == KVH_OK)
            return KVH_OK;
        kvhi_clear_error();
        drop_region(e, x, r);
        return KVH_OK;
    }
    /* Modified, or no source: its bytes must be kept: in the host tier
     * (room the incoming context gives back as it arrives first, else
     * evicting KV by policy), else in the disk tier. Two contexts of
     * memory only trade places that way, neither tier holding both. */
    if (take_free_host_room(e, x, r))
        return region_to_host(e, x, r, KVHI_CRC_RECORD);
    kvh_status st = kvhi_charge_add(e, x, KVH_TIER_HOST, r->size, KVHI_CHARGE_EVICT);
    if (st == KVH_OK)
        return region_to_host(e, x, r, KVHI_CRC_RECORD);
    char why[KVHI_CONTEXT_WHY_BYTES];
    snprintf(why, sizeof(why), "%s", kvhi_last_error());
    if (st == KVH_ERR_NOSPACE && e->disk) {
        /* The checksums are recomputed from what is written. */
        st = kvhi_region_spill(e, x, r, r->data, r->alloc_tier);
        if (st == KVH_OK)
            return KVH_OK;
        snprintf(why, sizeof(why), "%s", kvhi_last_error());
    }
    return kvhi_fail(st, "weight region '%s' of context '%s' must be written back and there is no room for it: %s",
                     r->name, x->name, why);
}

static void run_departures(kvhi_switch *sw)
{
    kvh_engine *e = sw->e;
    kvhi_contexts *c = e->contexts;
    kvhi_context *x = sw->from;
    /* Regions that must be kept go first, while the host tier has the
     * most room; clean ones may then use what is left (unified memory) or
     * are dropped. Later layers leave first: they are needed last. */
    for (int pass = 0; pass < 2; pass++)
        for (uint32_t k = x->n_regions; k-- > 0;) {
            kvhi_region *r = &x->regions[x->load_order[k]];
            bool keep = r->dirty || r->fd < 0;
            if (r->tier != KVH_TIER_DEVICE || r->pinned || keep != (pass == 0))
                continue;
            switch_fail(sw, depart_region(e, x, r));
            c->departures_left--;
            pthread_cond_broadcast(&c->cv);
        }
    c->departures_left = 0;
    x->departing = false;
    pthread_cond_broadcast(&c->cv);
    if (x->kv_policy == KVH_CONTEXT_KV_DEMOTE)
        demote_context_kv(e, x);
}

/* One arriving region (lock held, may drop). */
static kvh_status arrive_region(kvh_engine *e, kvhi_context *x, kvhi_region *r)
{
    kvhi_contexts *c = e->contexts;
    bool unified = kvhi_unified_memory(e);
    r->busy = true;
    kvh_status st = kvhi_charge_add(e, x, KVH_TIER_DEVICE, r->size, KVHI_CHARGE_EVICT);
    if (st != KVH_OK) {
        r->busy = false;
        char why[KVHI_CONTEXT_WHY_BYTES];
        snprintf(why, sizeof(why), "%s", kvhi_last_error());
        return kvhi_fail(st, "no room in the device tier for weight region '%s' of context '%s': %s", r->name, x->name,
                         why);
    }
    if (r->tier == KVH_TIER_HOST && unified) {
        kvhi_charge_sub(e, x, KVH_TIER_HOST, r->size);
        r->tier = KVH_TIER_DEVICE;
        r->busy = false;
        c->stats.bytes_remapped += r->size;
        return KVH_OK;
    }
    uint8_t *old = r->data;
    uint8_t old_alloc = r->alloc_tier, old_tier = r->tier;
    pthread_mutex_unlock(&e->lock);
    uint8_t *mem = kvhi_region_mem_take(e, KVH_TIER_DEVICE, r->size);
    uint32_t bad = 0;
    int rc = -ENOMEM;
    bool from_source = false, healed = false;
    if (mem && old_tier == KVH_TIER_HOST)
        rc = kvhi_region_copy(e, r, x->chunk_bytes, mem, KVH_TIER_DEVICE, old, KVH_TIER_HOST,
                              r->crc_known ? KVHI_CRC_VERIFY : KVHI_CRC_NONE, &bad);
    else if (mem && old_tier == KVH_TIER_DISK)
        rc = kvhi_region_read_disk(e, r, x->chunk_bytes, mem, KVH_TIER_DEVICE, &bad);
    else if (mem)
        rc = kvhi_region_read_source(e, r, x->chunk_bytes, mem, KVH_TIER_DEVICE, &bad), from_source = true;
    if (rc == 1 && !from_source && !r->dirty && r->fd >= 0) {
        /* A clean copy went bad in memory: its file still has the bytes. */
        healed = true;
        kvhi_log(e, KVH_LOG_WARN,
                 "weight region '%s' chunk %u failed its checksum in the host tier; reading it again from its file",
                 r->name, bad);
        rc = kvhi_region_read_source(e, r, x->chunk_bytes, mem, KVH_TIER_DEVICE, &bad), from_source = true;
    }
    if (rc != 0 && mem)
        kvhi_region_mem_give(e, KVH_TIER_DEVICE, mem, r->size);
    if (rc == 0 && old)
        kvhi_region_mem_give(e, old_alloc, old, r->size);
    pthread_mutex_lock(&e->lock);
    r->busy = false;
    if (healed)
        c->stats.crc_failures++;
    if (rc != 0) {
        kvhi_charge_sub(e, x, KVH_TIER_DEVICE, r->size);
        if (rc == 1) {
            c->stats.crc_failures++;
            return kvhi_fail(KVH_ERR_CORRUPT, "weight region '%s' chunk %u no longer matches its checksum", r->name,
                             bad);
        }
        return kvhi_fail(rc == -ENOMEM ? KVH_ERR_NOMEM : KVH_ERR_IO, "cannot load weight region '%s': %s", r->name,
                         rc == -1 ? "copy failed" : strerror(-rc));
    }
    if (old_tier == KVH_TIER_HOST)
        kvhi_charge_sub(e, x, KVH_TIER_HOST, r->size);
    else if (old_tier == KVH_TIER_DISK)
        kvhi_region_disk_release(e, r);
    if (from_source) {
        c->stats.bytes_read_source += r->size;
        r->crc_known = true;
    } else if (old_tier == KVH_TIER_HOST) {
        c->stats.bytes_host_to_device += r->size;
    } else {
        c->stats.bytes_disk_to_host += r->size;
        c->stats.bytes_host_to_device += r->size;
    }
    r->data = mem;
    r->alloc_tier = KVH_TIER_DEVICE;
    r->tier = KVH_TIER_DEVICE;
    return KVH_OK;
}

/* Brings regions of the incoming context in, taking them in load order
 * from a shared cursor: the thread of the departures joins in once they
 * are done, so file reads and copies run on two threads. The primary
 * (arrivals) thread waits for its helper, then brings the KV back. */
static void run_arrivals(kvhi_switch *sw, bool primary)
{
    kvh_engine *e = sw->e;
    kvhi_contexts *c = e->contexts;
    kvhi_context *x = sw->to;
    sw->arrival_workers++;
    while (!sw->arrivals_failed && sw->arrival_next < x->n_regions) {
        kvhi_region *r = &x->regions[x->load_order[sw->arrival_next++]];
        kvh_status st = r->tier == KVH_TIER_DEVICE ? KVH_OK : arrive_region(e, x, r);
        pthread_cond_broadcast(&c->cv); /* a layer may be ready */
        if (st != KVH_OK && !sw->arrivals_failed) {
            sw->arrivals_failed = true;
            x->load_status = st;
            snprintf(x->load_msg, sizeof(x->load_msg), "%s", kvhi_last_error());
            switch_fail(sw, st);
        }
    }
    sw->arrival_workers--;
    pthread_cond_broadcast(&c->cv);
    if (!primary)
        return;
    while (sw->arrival_workers)
        pthread_cond_wait(&c->cv, &e->lock);
    c->arrivals_running = false;
    pthread_cond_broadcast(&c->cv);
    if (!sw->arrivals_failed && x->kv_policy == KVH_CONTEXT_KV_DEMOTE)
        c->stats.kv_blocks_promoted += move_context_kv(e, x, KVH_TIER_DEVICE);
}

static void *switch_thread(void *argp)
{
    kvhi_switch_arg *arg = argp;
    kvhi_switch *sw = arg->sw;
    kvh_engine *e = sw->e;
    kvhi_contexts *c = e->contexts;
    kvhi_thread_started_for(e);
    pthread_mutex_lock(&e->lock);
    if (arg->roles & ROLE_DEPART)
        run_departures(sw);
    if (arg->roles & ROLE_ARRIVE)
        run_arrivals(sw, true);
    else if (arg->roles & ROLE_HELP_ARRIVE)
        run_arrivals(sw, false);
    if (--sw->running > 0) {
        pthread_mutex_unlock(&e->lock);
        return NULL;
    }
    /* Last thread out: finish the switch. */
    kvhi_free_garbage(e);
    pthread_mutex_unlock(&e->lock);
    kvhi_region_spares_free(e);
    pthread_mutex_lock(&e->lock);
    if (sw->from)
        sw->from->switching = sw->from->departing = false;
    if (sw->to) {
        sw->to->switching = false;
        sw->to->loading = false;
    }
    c->departures_left = 0;
    c->arrivals_running = false;
    c->switch_active = false;
    c->joinable = true;
    kvhi_fence_record_failure(e, sw->fence, sw->status, sw->msg);
    kvhi_fence_done(e, sw->fence, KVH_OK);
    pthread_cond_broadcast(&c->cv);
    free(sw);
    kvhi_leave(e); /* the active call the switch held */
    return NULL;
}

/* Lock held (as an entered call). Waits for the previous switch and joins
 * its threads; returns with no switch running and none left to join. The
 * join drops the lock, and another caller may start and end a switch
 * meanwhile: its threads are joined too, before c->threads is reused. */
static void wait_previous_switch(kvh_engine *e, kvhi_contexts *c)
{
    for (;;) {
        while (c->switch_active)
            pthread_cond_wait(&c->cv, &e->lock);
        if (!c->joinable)
            return;
        pthread_t t[2] = {c->threads[0], c->threads[1]};
        uint32_t n = c->n_threads;
        c->joinable = false;
        c->n_threads = 0;
        pthread_mutex_unlock(&e->lock);
        for (uint32_t i = 0; i < n; i++)
            pthread_join(t[i], NULL);
        pthread_mutex_lock(&e->lock);
    }
}

kvh_status kvhi_context_switch(kvh_engine *e, kvh_context from_h, kvh_context to_h, kvh_fence *fence)
{
    kvhi_contexts *c = kvhi_contexts_get(e);
    if (!c)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for context state");
    kvhi_context *from, *to;
    kvh_status st;
    for (;;) {
        /* Every wait drops the lock: look everything up again after it. */
        wait_previous_switch(e, c);
        if (c->switch_active) /* another caller started one meanwhile */
            continue;
        from = to = NULL;
        if (from_h.id && (st = kvhi_context_resolve(e, from_h, &from)) != KVH_OK)
            return st;
        if (to_h.id && (st = kvhi_context_resolve(e, to_h, &to)) != KVH_OK)
            return st;
        if (!(from && from->holds) && !(to && to->holds))
            break;
        if (from)
            from->switches_waiting++;
        if (to)
            to->switches_waiting++;
        pthread_cond_wait(&c->cv, &e->lock);
        /* Only what still resolves is the context marked (a destroyed
         * one's handle resolves no more). */
        kvhi_context *x = NULL;
        if (from_h.id && kvhi_context_resolve(e, from_h, &x) == KVH_OK)
            x->switches_waiting--;
        if (to_h.id && kvhi_context_resolve(e, to_h, &x) == KVH_OK)
            x->switches_waiting--;
        kvhi_clear_error();
    }
    /* A context that cannot fit the device tier as a whole is refused
     * before anything moves: its regions one by one would each evict KV
     * and then fail with part of it loaded. */
    if (to) {
        uint64_t need = kvhi_context_device_slots(e, to), have = e->tiers[KVH_TIER_DEVICE].slots.capacity;
        if (need > have)
            return kvhi_fail(KVH_ERR_NOSPACE,
                             "context '%s' needs %llu bytes of the device tier for its weights (its %u regions, each "
                             "in whole pages), more than the whole device tier (%llu bytes)",
                             to->name, (unsigned long long)(need * e->tiers[KVH_TIER_DEVICE].slot_bytes), to->n_regions,
                             (unsigned long long)(have * e->tiers[KVH_TIER_DEVICE].slot_bytes));
    }
    if (!from && !to) {
        /* Nothing to move: no switch starts, and the fence is complete. */
        if (!fence)
            return KVH_OK;
        uint32_t idx;
        return kvhi_fence_new(e, &idx, fence);
    }
    kvhi_switch *sw = calloc(1, sizeof(*sw));
    if (!sw)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for a switch");
    uint32_t fidx;
    kvh_fence fh;
    if ((st = kvhi_fence_new(e, &fidx, &fh)) != KVH_OK) {
        free(sw);
        return st;
    }
    kvhi_fence_expect(e, fidx, 1); /* the switch's own: done when it ends */
    *sw = (kvhi_switch){.e = e, .from = from, .to = to, .fence = fidx};
    uint32_t leaving = 0;
    for (uint32_t i = 0; from && i < from->n_regions; i++)
        leaving += from->regions[i].tier == KVH_TIER_DEVICE && !from->regions[i].pinned;
    c->departures_left = leaving;
    if (from) {
        from->switching = from->departing = true;
        /* The error of a load into it that failed earlier is over: its
         * layers are now simply not loading (kvh_context_wait_layer). */
        from->load_status = KVH_OK;
        from->load_msg[0] = 0;
    }
    if (to) {
        to->switching = true;
        to->loading = true;
        to->load_status = KVH_OK;
        to->load_msg[0] = 0;
    }
    c->stats.switches++;
    c->switch_active = true;
    e->active_calls++; /* engine close waits for the switch */
    /* One thread per direction; if the second cannot start, the first
     * runs both, departures first. */
    sw->args[0] = (kvhi_switch_arg){sw, (from ? ROLE_DEPART : 0) | (to && !from ? ROLE_ARRIVE : 0) |
                                            (to && from ? ROLE_HELP_ARRIVE : 0)};
    sw->args[1] = (kvhi_switch_arg){sw, ROLE_ARRIVE};
    uint32_t want = from && to ? 2 : 1;
    sw->running = want;
    c->arrivals_running = want == 2;
    c->n_threads = 0;
    for (uint32_t i = 0; i < want; i++) {
        if (pthread_create(&c->threads[i], NULL, switch_thread, &sw->args[i]) == 0) {
            c->n_threads++;
            continue;
        }
        if (i == 0) {
            /* No thread at all: run here (the lock stays held throughout
             * apart from the copies). */
            sw->args[0].roles = (from ? ROLE_DEPART : 0) | (to ? ROLE_ARRIVE : 0);
            sw->running = 1;
            c->arrivals_running = false;
            pthread_mutex_unlock(&e->lock);
            switch_thread(&sw->args[0]);
            pthread_mutex_lock(&e->lock);
            break;
        }
        sw->args[0].roles |= ROLE_ARRIVE; /* picked up once departures end */
        sw->running = 1;
        c->arrivals_running = false;
        break;
    }
    if (fence) {
        *fence = fh;
        return KVH_OK;
    }
    st = kvhi_fence_wait_idx(e, fidx, UINT64_MAX);
    kvhi_fence_drop(e, fidx);
    return st;
}
