/* Weight contexts: registration of weight regions and the switch that
 * moves one context's weights (and, by policy, its agents' KV) out of the
 * device tier while the next one's arrive, layer by layer.
 *
 * A switch runs on two threads of its own, one per direction, so that the
 * departures (mostly drops: clean weights are never written) and the
 * arrivals overlap; an arrival that finds the device tier full waits for
 * pending departures before it evicts KV. The migration workers are not
 * used for weights because their job queue moves fixed-size blocks; the
 * KV part of a switch does go through them. The switch counts as an
 * active call, so engine close waits for it. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core/context.h"
#include "core/crc32c.h"

bool kvhi_unified_memory(kvh_engine *e)
{
    return e->backend->device_is_host_memory && !(e->contexts && e->contexts->copy_on_unified);
}

static void defer_free(kvh_engine *e, uint8_t *p, uint64_t bytes, uint8_t tier)
{
    kvhi_contexts *c = e->contexts;
    /* The CPU backend's free is a munmap, harmless under the lock: give
     * the memory back now (drops outside a switch would otherwise wait
     * for the next one). */
    if (e->backend == kvhi_backend_cpu()) {
        kvhi_region_mem_free(e, tier, p, bytes);
        return;
    }
    if (c->n_garbage == c->cap_garbage) {
        uint32_t cap = c->cap_garbage ? c->cap_garbage * 2 : 8;
        struct kvhi_garbage *g = realloc(c->garbage, sizeof(*g) * cap);
        if (!g) {
            /* No list to defer it with: free it now. */
            kvhi_region_mem_free(e, tier, p, bytes);
            return;
        }
        c->garbage = g;
        c->cap_garbage = cap;
    }
    c->garbage[c->n_garbage++] = (struct kvhi_garbage){p, bytes, tier};
}

void kvhi_free_garbage(kvh_engine *e)
{
    kvhi_contexts *c = e->contexts;
    while (c && c->n_garbage) {
        struct kvhi_garbage g = c->garbage[--c->n_garbage];
        pthread_mutex_unlock(&e->lock);
        kvhi_region_mem_free(e, g.tier, g.p, g.bytes);
        pthread_mutex_lock(&e->lock);
    }
}

bool kvhi_drop_clean_host_region(kvh_engine *e, bool allow_loading)
{
    kvhi_contexts *c = e->contexts;
    for (uint32_t i = 0; c && i < c->table.cap; i++) {
        kvhi_context *x = kvhi_handles_at(&c->table, i);
        if (!x || (x->loading && !allow_loading))
            continue;
        for (uint32_t j = 0; j < x->n_regions; j++) {
            kvhi_region *r = &x->regions[j];
            if (r->tier != KVH_TIER_HOST || r->dirty || r->fd < 0 || r->busy || r->pinned)
                continue;
            defer_free(e, r->data, r->size, r->alloc_tier);
            kvhi_charge_sub(e, x, KVH_TIER_HOST, r->size);
            r->tier = KVHI_NO_TIER;
            r->data = NULL;
            r->alloc_tier = KVHI_NO_TIER;
            c->stats.bytes_dropped += r->size;
            return true;
        }
    }
    return false;
}

kvhi_contexts *kvhi_contexts_get(kvh_engine *e)
{
    if (e->contexts)
        return e->contexts;
    kvhi_contexts *c = calloc(1, sizeof(*c));
    if (!c)
        return NULL;
    if (kvhi_handles_init(&c->table, KVHI_TAG_CONTEXT) != 0) {
        free(c);
        return NULL;
    }
    kvhi_handles_set_gen_start(&c->table, e->gen_start + 3);
    pthread_cond_init(&c->cv, NULL);
    c->stats.struct_size = sizeof(c->stats);
    c->admission.short_max_tokens = 4096;
    e->contexts = c;
    return c;
}

int kvhi_context_copy_on_unified(kvh_engine *e, bool on)
{
    pthread_mutex_lock(&e->lock);
    kvhi_contexts *c = kvhi_contexts_get(e);
    if (c)
        c->copy_on_unified = on;
    pthread_mutex_unlock(&e->lock);
    return c ? 0 : -1;
}

kvh_status kvhi_context_resolve(kvh_engine *e, kvh_context h, kvhi_context **out)
{
    kvhi_context *x = e->contexts ? kvhi_handles_get(&e->contexts->table, h.id, NULL) : NULL;
    if (!x)
        return kvhi_fail(KVH_ERR_BAD_HANDLE, "context handle 0x%llx is stale, freed or forged",
                         (unsigned long long)h.id);
    *out = x;
    return KVH_OK;
}

/* Takes a region's bytes off its tier (lock held); its memory is left
 * for region_free_memory, outside the lock. */
static void region_unaccount(kvh_engine *e, kvhi_context *x, kvhi_region *r)
{
    if (r->tier != KVHI_NO_TIER)
        kvhi_charge_sub(e, x, r->tier, r->size);
    r->tier = KVHI_NO_TIER;
}

static void region_free_memory(kvh_engine *e, kvhi_region *r)
{
    kvhi_region_mem_free(e, r->alloc_tier, r->data, r->size);
    r->data = NULL;
    if (r->fd >= 0)
        close(r->fd);
    r->fd = -1;
    free(r->chunk_crc);
    r->chunk_crc = NULL;
}

static void context_free(kvh_engine *e, kvhi_context *x)
{
    for (uint32_t i = 0; i < x->n_regions; i++)
        region_free_memory(e, &x->regions[i]);
    free(x->regions);
    free(x->load_order);
    kvhi_charge_free(&x->charge[0]);
    kvhi_charge_free(&x->charge[1]);
    free(x->seqs);
    free(x);
}

void kvhi_contexts_free(kvh_engine *e)
{
    kvhi_contexts *c = e->contexts;
    if (!c)
        return;
    if (c->joinable)
        for (uint32_t i = 0; i < c->n_threads; i++)
            pthread_join(c->threads[i], NULL);
    for (uint32_t i = 0; i < c->table.cap; i++) {
        kvhi_context *x = kvhi_handles_at(&c->table, i);
        if (x)
            context_free(e, x); /* its slots go with the tiers */
    }
    for (uint32_t i = 0; i < c->n_garbage; i++)
        kvhi_region_mem_free(e, c->garbage[i].tier, c->garbage[i].p, c->garbage[i].bytes);
    free(c->garbage);
    kvhi_handles_destroy(&c->table);
    kvhi_admission_free(&c->admission);
    pthread_cond_destroy(&c->cv);
    free(c);
    e->contexts = NULL;
}

/* ---- create, destroy, regions ---- */

kvh_status kvhi_context_create(kvh_engine *e, const kvh_context_params *p, kvh_context *out)
{
    kvhi_contexts *c = kvhi_contexts_get(e);
    kvhi_context *x = c ? calloc(1, sizeof(*x)) : NULL;
    if (!x)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for a context");
    snprintf(x->name, sizeof(x->name), "%s", p->name ? p->name : "");
    x->kv_policy = p->kv_policy;
    x->chunk_bytes = p->chunk_bytes;
    if (kvhi_handles_add(&c->table, x, &out->id, NULL) != 0) {
        free(x);
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for a context");
    }
    return KVH_OK;
}

/* Removes the context from the table and its slots from the tiers (lock
 * held); the caller frees it with kvhi_context_free_detached unlocked. */
kvh_status kvhi_context_detach(kvh_engine *e, kvh_context h, kvhi_context **out)
{
    kvhi_context *x = NULL;
    kvh_status st = kvhi_context_resolve(e, h, &x);
    if (st != KVH_OK)
        return st;
    if (x->switching || x->holds)
        return kvhi_fail(KVH_ERR_BUSY, "context '%s' is being switched or used", x->name);
    for (uint32_t i = 0; i < x->n_regions; i++)
        region_unaccount(e, x, &x->regions[i]);
    kvhi_handles_remove(&e->contexts->table, kvhi_handle_index(h.id));
    *out = x;
    return KVH_OK;
}

void kvhi_context_free_detached(kvh_engine *e, kvhi_context *x) { context_free(e, x); }

static int region_before(const kvhi_context *x, uint32_t a, uint32_t b)
{
    uint32_t la = x->regions[a].layer, lb = x->regions[b].layer;
    return la != lb ? la < lb : a < b;
}

/* Inserts region i into the load order (sorted by layer, then index). */
static void order_insert(kvhi_context *x, uint32_t i)
{
    uint32_t n = x->n_regions - 1; /* entries already ordered */
    uint32_t at = n;
    while (at > 0 && region_before(x, i, x->load_order[at - 1])) {
        x->load_order[at] = x->load_order[at - 1];
        at--;
    }
    x->load_order[at] = i;
}

/* Checks a file source; returns an open descriptor or a failure. */
static kvh_status open_source(const char *path, uint64_t off, uint64_t size, int *fd_out)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return kvhi_fail(KVH_ERR_IO, "cannot open weight file %s: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || (uint64_t)sb.st_size < off || (uint64_t)sb.st_size - off < size) {
        close(fd);
        return kvhi_fail(KVH_ERR_IO, "weight file %s is shorter than offset %llu + size %llu", path,
                         (unsigned long long)off, (unsigned long long)size);
    }
    *fd_out = fd;
    return KVH_OK;
}

/* Places caller bytes in the host tier (device tier without one). Lock
 * held; dropped for the copy. */
static kvh_status region_copy_in(kvh_engine *e, kvhi_context *x, kvhi_region *r, const void *bytes)
{
    uint32_t tier = e->tiers[KVH_TIER_HOST].present ? KVH_TIER_HOST : KVH_TIER_DEVICE;
    kvh_status st = kvhi_charge_add(e, x, tier, r->size, KVHI_CHARGE_EVICT);
    if (st != KVH_OK)
        return st;
    r->busy = true;
    pthread_mutex_unlock(&e->lock);
    uint8_t *mem = kvhi_region_mem_alloc(e, tier, r->size);
    uint32_t bad = 0;
    int rc = mem ? kvhi_region_copy(e, r, x->chunk_bytes, mem, tier, bytes, KVH_TIER_HOST, KVHI_CRC_RECORD, &bad)
                 : -1;
    if (rc != 0 && mem) {
        kvhi_region_mem_free(e, tier, mem, r->size);
        mem = NULL;
    }
    pthread_mutex_lock(&e->lock);
    r->busy = false;
    if (!mem) {
        kvhi_charge_sub(e, x, tier, r->size);
        return kvhi_fail(rc ? KVH_ERR_IO : KVH_ERR_NOMEM, "cannot place weight region '%s' (%llu bytes) in the %s tier",
                         r->name, (unsigned long long)r->size, tier == KVH_TIER_HOST ? "host" : "device");
    }
    r->data = mem;
    r->alloc_tier = (uint8_t)tier;
    r->tier = (uint8_t)tier;
    r->crc_known = true;
    return KVH_OK;
}

kvh_status kvhi_context_add_region(kvh_engine *e, kvhi_context *x, const kvh_weight_region_params *p,
                                   uint32_t *out)
{
    if (x->switching || x->holds)
        return kvhi_fail(KVH_ERR_BUSY, "context '%s' is being switched or used", x->name);
    if (x->n_regions == x->cap_regions) {
        uint32_t cap = x->cap_regions ? x->cap_regions * 2 : 8;
        kvhi_region *nr = realloc(x->regions, sizeof(*nr) * cap);
        if (!nr)
            return kvhi_fail(KVH_ERR_NOMEM, "out of memory for regions");
        x->regions = nr;
        uint32_t *no = realloc(x->load_order, sizeof(*no) * cap);
        if (!no)
            return kvhi_fail(KVH_ERR_NOMEM, "out of memory for regions");
        x->load_order = no;
        x->cap_regions = cap;
    }
    kvhi_region r = {.layer = p->layer, .size = p->size, .fd = -1, .file_offset = p->file_offset,
                     .pinned = p->pinned != 0, .tier = KVHI_NO_TIER, .alloc_tier = KVHI_NO_TIER};
    snprintf(r.name, sizeof(r.name), "%s", p->name ? p->name : "");
    r.n_chunks = (uint32_t)((p->size + x->chunk_bytes - 1) / x->chunk_bytes);
    r.chunk_crc = calloc(r.n_chunks, sizeof(uint32_t));
    if (!r.chunk_crc)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for %u chunk checksums", r.n_chunks);
    kvh_status st = KVH_OK;
    if (p->path) {
        st = open_source(p->path, p->file_offset, p->size, &r.fd);
    } else {
        r.dirty = true; /* no source: the engine holds the only copy */
        uint32_t i = x->n_regions;
        x->regions[i] = r; /* visible (busy) while the lock drops */
        x->n_regions++;
        x->load_order[i] = i; /* placeholder until ordered below */
        x->holds++; /* keeps switch and destroy away meanwhile */
        st = region_copy_in(e, x, &x->regions[i], p->bytes);
        kvhi_free_garbage(e); /* clean regions it displaced */
        x->holds--;
        pthread_cond_broadcast(&e->contexts->cv);
        x->n_regions--;
        if (st == KVH_OK)
            r = x->regions[i];
    }
    if (st != KVH_OK) {
        if (r.fd >= 0)
            close(r.fd);
        free(r.chunk_crc);
        return st;
    }
    uint32_t i = x->n_regions++;
    x->regions[i] = r;
    order_insert(x, i);
    *out = i;
    return KVH_OK;
}

kvh_status kvhi_context_attach(kvh_engine *e, kvhi_context *x, uint64_t seq)
{
    if (x->n_seqs == x->cap_seqs) {
        /* Forget freed sequences before growing. */
        uint32_t k = 0;
        for (uint32_t i = 0; i < x->n_seqs; i++)
            if (kvhi_handles_get(&e->seqs, x->seqs[i], NULL))
                x->seqs[k++] = x->seqs[i];
        x->n_seqs = k;
    }
    if (x->n_seqs == x->cap_seqs) {
        uint32_t cap = x->cap_seqs ? x->cap_seqs * 2 : 8;
        uint64_t *ns = realloc(x->seqs, sizeof(*ns) * cap);
        if (!ns)
            return kvhi_fail(KVH_ERR_NOMEM, "out of memory for attached sequences");
        x->seqs = ns;
        x->cap_seqs = cap;
    }
    for (uint32_t i = 0; i < x->n_seqs; i++)
        if (x->seqs[i] == seq)
            return KVH_OK;
    x->seqs[x->n_seqs++] = seq;
    return KVH_OK;
}

/* ---- the switch ---- */

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
    char msg[192];
};

static void switch_fail(kvhi_switch *sw, kvh_status st)
{
    if (st != KVH_OK && sw->status == KVH_OK) {
        sw->status = st;
        snprintf(sw->msg, sizeof(sw->msg), "%s", kvh_last_error());
    }
}

/* Moves the context's KV blocks to `tier` through the migration workers
 * and waits (lock held, dropped while waiting). Best effort: blocks that
 * cannot move stay where they are. */
static uint64_t move_context_kv(kvh_engine *e, kvhi_context *x, uint32_t tier)
{
    if (!e->tiers[tier].present)
        return 0;
    uint32_t fidx;
    if (kvhi_fence_new(e, &fidx, NULL) != KVH_OK)
        return 0;
    kvhi_fence *f = kvhi_handles_at(&e->fences, fidx);
    f->pending++; /* this function's own count, so the fence cannot end early */
    uint64_t queued = 0;
    for (uint32_t i = 0; i < x->n_seqs; i++) {
        kvhi_seq *s = kvhi_handles_get(&e->seqs, x->seqs[i], NULL);
        for (uint32_t j = 0; s && j < s->n_blocks; j++) {
            kvhi_block *b = &e->blocks[s->blocks[j]];
            bool wanted = tier == KVH_TIER_DEVICE ? b->tier != KVH_TIER_DEVICE
                                                  : b->tier == KVH_TIER_DEVICE && !b->holds;
            if (!wanted || b->pins)
                continue;
            if (kvhi_enqueue(e, s->blocks[j], tier, tier == KVH_TIER_DEVICE ? 1 : 0, false, fidx) == KVH_OK)
                queued++;
            /* An inline move may drop the lock: the sequence may be gone. */
            s = kvhi_handles_get(&e->seqs, x->seqs[i], NULL);
        }
    }
    kvhi_fence_done(e, fidx, KVH_OK);
    kvhi_fence_wait_idx(e, fidx, UINT64_MAX);
    kvhi_fence_drop(e, fidx);
    kvhi_clear_error();
    return queued;
}

/* One departing region (lock held, may drop). */
static kvh_status depart_region(kvh_engine *e, kvhi_context *x, kvhi_region *r)
{
    kvhi_contexts *c = e->contexts;
    bool unified = kvhi_unified_memory(e);
    if (!r->dirty && r->fd >= 0) {
        /* Clean: never written. On unified memory it may stay in RAM as
         * host-tier memory if the host tier has free room (no eviction for
         * it: it can always be read again). */
        while (unified && e->tiers[KVH_TIER_HOST].present) {
            if (kvhi_charge_add(e, x, KVH_TIER_HOST, r->size, KVHI_CHARGE_FREE_ONLY) == KVH_OK) {
                kvhi_charge_sub(e, x, KVH_TIER_DEVICE, r->size);
                r->tier = KVH_TIER_HOST;
                c->stats.bytes_remapped += r->size;
                return KVH_OK;
            }
            /* The host room may be held by the incoming model, which frees
             * it as it arrives: wait for that, unless the arrivals are
             * themselves waiting for this side (then drop). */
            if (!c->arrivals_running || c->arrivals_waiting)
                break;
            pthread_cond_wait(&c->cv, &e->lock);
        }
        kvhi_clear_error();
        uint8_t *mem = r->data;
        uint8_t at = r->alloc_tier;
        region_unaccount(e, x, r);
        r->data = NULL;
        r->alloc_tier = KVHI_NO_TIER;
        c->stats.bytes_dropped += r->size;
        r->busy = true;
        pthread_mutex_unlock(&e->lock);
        kvhi_region_mem_free(e, at, mem, r->size);
        pthread_mutex_lock(&e->lock);
        r->busy = false;
        return KVH_OK;
    }
    /* Modified, or no source: its bytes must be kept, in the host tier. */
    kvh_status st = kvhi_charge_add(e, x, KVH_TIER_HOST, r->size, KVHI_CHARGE_EVICT);
    if (st != KVH_OK) {
        char why[160];
        snprintf(why, sizeof(why), "%s", kvh_last_error());
        return kvhi_fail(st, "weight region '%s' of context '%s' must be written back and the host tier has no room: %s",
                         r->name, x->name, why);
    }
    r->busy = true;
    pthread_mutex_unlock(&e->lock);
    uint8_t *mem = unified ? r->data : kvhi_region_mem_alloc(e, KVH_TIER_HOST, r->size);
    uint32_t bad = 0;
    int rc = -1;
    if (mem && unified) {
        /* Same memory: only the checksums are brought up to date. */
        for (uint32_t i = 0; r->stale_crc && i < r->n_chunks; i++) {
            uint64_t off = (uint64_t)i * x->chunk_bytes;
            uint64_t n = r->size - off < x->chunk_bytes ? r->size - off : x->chunk_bytes;
            r->chunk_crc[i] = kvhi_crc32c(0, mem + off, n);
        }
        rc = 0;
    } else if (mem) {
        rc = kvhi_region_copy(e, r, x->chunk_bytes, mem, KVH_TIER_HOST, r->data, KVH_TIER_DEVICE, KVHI_CRC_RECORD,
                              &bad);
        if (rc != 0)
            kvhi_region_mem_free(e, KVH_TIER_HOST, mem, r->size);
    }
    if (rc == 0 && !unified)
        kvhi_region_mem_free(e, r->alloc_tier, r->data, r->size);
    pthread_mutex_lock(&e->lock);
    r->busy = false;
    if (rc != 0) {
        kvhi_charge_sub(e, x, KVH_TIER_HOST, r->size);
        return kvhi_fail(mem ? KVH_ERR_IO : KVH_ERR_NOMEM, "cannot write weight region '%s' back to the host tier",
                         r->name);
    }
    kvhi_charge_sub(e, x, KVH_TIER_DEVICE, r->size);
    r->tier = KVH_TIER_HOST;
    r->crc_known = true;
    r->stale_crc = false;
    if (unified) {
        c->stats.bytes_remapped += r->size;
    } else {
        r->data = mem;
        r->alloc_tier = KVH_TIER_HOST;
        c->stats.bytes_device_to_host += r->size;
    }
    return KVH_OK;
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
    pthread_cond_broadcast(&c->cv);
    if (x->kv_policy == KVH_CONTEXT_KV_DEMOTE)
        c->stats.kv_blocks_demoted += move_context_kv(e, x, KVH_TIER_HOST);
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
        char why[160];
        snprintf(why, sizeof(why), "%s", kvh_last_error());
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
    uint8_t *mem = kvhi_region_mem_alloc(e, KVH_TIER_DEVICE, r->size);
    uint32_t bad = 0;
    int rc = -ENOMEM;
    if (mem && old_tier == KVH_TIER_HOST)
        rc = kvhi_region_copy(e, r, x->chunk_bytes, mem, KVH_TIER_DEVICE, old, KVH_TIER_HOST,
                              r->crc_known ? KVHI_CRC_VERIFY : KVHI_CRC_NONE, &bad);
    else if (mem)
        rc = kvhi_region_read_source(e, r, x->chunk_bytes, mem, KVH_TIER_DEVICE, &bad);
    if (rc != 0 && mem)
        kvhi_region_mem_free(e, KVH_TIER_DEVICE, mem, r->size);
    if (rc == 0 && old)
        kvhi_region_mem_free(e, old_alloc, old, r->size);
    pthread_mutex_lock(&e->lock);
    r->busy = false;
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
    if (old_tier == KVH_TIER_HOST) {
        kvhi_charge_sub(e, x, KVH_TIER_HOST, r->size);
        c->stats.bytes_host_to_device += r->size;
    } else {
        c->stats.bytes_read_source += r->size;
        r->crc_known = true;
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
            snprintf(x->load_msg, sizeof(x->load_msg), "%s", kvh_last_error());
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
    if (sw->from)
        sw->from->switching = false;
    if (sw->to) {
        sw->to->switching = false;
        sw->to->loading = false;
    }
    c->departures_left = 0;
    c->arrivals_running = false;
    c->switch_active = false;
    c->joinable = true;
    kvhi_fence *f = kvhi_handles_at(&e->fences, sw->fence);
    if (f && sw->status != KVH_OK && f->status == KVH_OK) {
        f->status = sw->status;
        snprintf(f->msg, sizeof(f->msg), "%s", sw->msg);
    }
    kvhi_fence_done(e, sw->fence, KVH_OK);
    pthread_cond_broadcast(&c->cv);
    free(sw);
    kvhi_leave(e); /* the active call the switch held */
    return NULL;
}

/* Lock held (as an entered call). Waits for the previous switch and joins
 * its threads. */
static void wait_previous_switch(kvh_engine *e, kvhi_contexts *c)
{
    while (c->switch_active)
        pthread_cond_wait(&c->cv, &e->lock);
    if (c->joinable) {
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
        pthread_cond_wait(&c->cv, &e->lock);
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
    ((kvhi_fence *)kvhi_handles_at(&e->fences, fidx))->pending = 1;
    *sw = (kvhi_switch){.e = e, .from = from, .to = to, .fence = fidx};
    uint32_t leaving = 0;
    for (uint32_t i = 0; from && i < from->n_regions; i++)
        leaving += from->regions[i].tier == KVH_TIER_DEVICE && !from->regions[i].pinned;
    c->departures_left = leaving;
    if (from)
        from->switching = true;
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

/* ---- queries ---- */

static bool layers_resident(kvhi_context *x, uint32_t layer)
{
    for (uint32_t i = 0; i < x->n_regions; i++)
        if (x->regions[i].layer <= layer && (x->regions[i].tier != KVH_TIER_DEVICE || x->regions[i].busy))
            return false;
    return true;
}

kvh_status kvhi_context_wait_layer(kvh_engine *e, kvh_context h, uint32_t layer, uint64_t timeout_ns)
{
    struct timespec deadline;
    if (timeout_ns != UINT64_MAX) {
        clock_gettime(CLOCK_REALTIME, &deadline);
        uint64_t ns = (uint64_t)deadline.tv_nsec + timeout_ns % 1000000000ull;
        deadline.tv_sec += (time_t)(timeout_ns / 1000000000ull + ns / 1000000000ull);
        deadline.tv_nsec = (long)(ns % 1000000000ull);
    }
    for (;;) {
        /* Re-resolved after each wait: the context may have been destroyed. */
        kvhi_context *x = NULL;
        kvh_status st = kvhi_context_resolve(e, h, &x);
        if (st != KVH_OK)
            return st;
        if (layers_resident(x, layer))
            return KVH_OK;
        if (!x->loading) {
            if (x->load_status != KVH_OK)
                return kvhi_fail(x->load_status, "%s", x->load_msg[0] ? x->load_msg : kvh_strerror(x->load_status));
            return kvhi_fail(KVH_ERR_NOT_RESIDENT, "layer %u of context '%s' is not resident and no switch loads it",
                             layer, x->name);
        }
        if (timeout_ns == UINT64_MAX)
            pthread_cond_wait(&e->contexts->cv, &e->lock);
        else if (pthread_cond_timedwait(&e->contexts->cv, &e->lock, &deadline) == ETIMEDOUT) {
            if (kvhi_context_resolve(e, h, &x) == KVH_OK && layers_resident(x, layer))
                return KVH_OK;
            return kvhi_fail(KVH_ERR_TIMEOUT, "layer %u not resident after %llu ns", layer,
                             (unsigned long long)timeout_ns);
        }
    }
}

kvh_status kvhi_context_region_data(kvh_engine *e, kvhi_context *x, uint32_t region, bool writable, void **data,
                                    uint64_t *size)
{
    if (region >= x->n_regions)
        return kvhi_fail(KVH_ERR_RANGE, "context '%s' has %u regions, not %u", x->name, x->n_regions, region + 1);
    kvhi_region *r = &x->regions[region];
    if (r->tier != KVH_TIER_DEVICE || r->busy)
        return kvhi_fail(KVH_ERR_NOT_RESIDENT, "weight region '%s' is not resident in the device tier", r->name);
    if (writable)
        r->dirty = r->stale_crc = true;
    *data = r->data;
    if (size)
        *size = r->size;
    return KVH_OK;
}

kvh_status kvhi_context_region_pin(kvh_engine *e, kvhi_context *x, uint32_t region, bool pinned)
{
    if (region >= x->n_regions)
        return kvhi_fail(KVH_ERR_RANGE, "context '%s' has %u regions, not %u", x->name, x->n_regions, region + 1);
    x->regions[region].pinned = pinned;
    return KVH_OK;
}

kvh_status kvhi_context_verify(kvh_engine *e, kvh_context h, uint64_t *checked)
{
    kvhi_context *x = NULL;
    kvh_status st = kvhi_context_resolve(e, h, &x);
    if (st != KVH_OK)
        return st;
    if (x->switching || x->holds)
        return kvhi_fail(KVH_ERR_BUSY, "context '%s' is being switched or used", x->name);
    /* Keeps switches and destroy away while the lock is dropped. */
    x->holds++;
    uint64_t n = 0;
    for (uint32_t i = 0; i < x->n_regions && st == KVH_OK; i++) {
        kvhi_region *r = &x->regions[i];
        /* A region handed out writable may differ from its checksums
         * until it is written back. */
        if (r->tier == KVHI_NO_TIER || !r->crc_known || r->stale_crc)
            continue;
        pthread_mutex_unlock(&e->lock);
        int64_t bad = kvhi_region_check(e, r, x->chunk_bytes);
        pthread_mutex_lock(&e->lock);
        if (bad > 0) {
            e->contexts->stats.crc_failures++;
            st = kvhi_fail(KVH_ERR_CORRUPT, "weight region '%s' chunk %lld does not match its checksum", r->name,
                           (long long)(bad - 1));
        } else if (bad < 0)
            st = kvhi_fail(KVH_ERR_IO, "cannot read weight region '%s' back", r->name);
        else
            n += r->n_chunks;
    }
    x->holds--;
    e->contexts->stats.chunks_verified += n;
    pthread_cond_broadcast(&e->contexts->cv);
    if (st == KVH_OK && checked)
        *checked = n;
    return st;
}

kvh_status kvhi_context_info(kvh_engine *e, kvhi_context *x, kvh_context_info *out)
{
    kvh_context_info r = {.struct_size = sizeof(r), .regions = x->n_regions, .loading = x->loading};
    bool prefix = true;
    for (uint32_t k = 0; k < x->n_regions; k++) {
        kvhi_region *g = &x->regions[x->load_order[k]];
        r.weight_bytes += g->size;
        if (g->tier == KVH_TIER_DEVICE)
            r.bytes_device += g->size;
        else if (g->tier == KVH_TIER_HOST)
            r.bytes_host += g->size;
        prefix = prefix && g->tier == KVH_TIER_DEVICE && !g->busy;
        r.layers_ready += prefix;
    }
    for (uint32_t i = 0; i < x->n_seqs; i++)
        r.seqs += kvhi_handles_get(&e->seqs, x->seqs[i], NULL) != NULL;
    *out = r;
    return KVH_OK;
}

void kvhi_weight_stats(kvh_engine *e, kvh_weight_stats *out)
{
    kvh_weight_stats s = {.struct_size = sizeof(s)};
    kvhi_contexts *c = e->contexts;
    if (c) {
        s = c->stats;
        s.bytes_device = s.bytes_host = s.slots_device = s.slots_host = 0;
        for (uint32_t i = 0; i < c->table.cap; i++) {
            kvhi_context *x = kvhi_handles_at(&c->table, i);
            if (!x)
                continue;
            s.bytes_device += x->charge[KVH_TIER_DEVICE].bytes;
            s.slots_device += x->charge[KVH_TIER_DEVICE].n;
            s.bytes_host += x->charge[KVH_TIER_HOST].bytes;
            s.slots_host += x->charge[KVH_TIER_HOST].n;
        }
    }
    s.struct_size = sizeof(s);
    s.unified_memory = kvhi_unified_memory(e);
    *out = s;
}
