/* Weight contexts: the engine's context table, registration of weight
 * regions (from a file range or copied-in bytes), attached sequences, and
 * dropping clean weights for room. The switch is in context_switch.c, the
 * queries (layer readiness, region data, verification, stats) in
 * context_query.c. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/context.h"
#include "core/host_spare.h"

bool kvhi_unified_memory(kvh_engine *e)
{
    return e->device_host_addressable && !(e->contexts && e->contexts->copy_on_unified);
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
        /* A holder may be reading its regions without the lock (a verify,
         * a region being added): their memory stays until it lets go. */
        if (!x || (x->loading && !allow_loading) || x->holds)
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
    pthread_mutex_init(&c->spare_lock, NULL);
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
void kvhi_region_unaccount(kvh_engine *e, kvhi_context *x, kvhi_region *r)
{
    if (r->tier == KVH_TIER_DISK)
        kvhi_region_disk_release(e, r);
    else if (r->tier != KVHI_NO_TIER)
        kvhi_charge_sub(e, x, r->tier, r->size);
    r->tier = KVHI_NO_TIER;
}

void kvhi_region_release(kvh_engine *e, kvhi_context *x, kvhi_region *r, bool recycle)
{
    uint8_t *mem = r->data;
    uint8_t at = r->alloc_tier;
    kvhi_region_unaccount(e, x, r);
    r->data = NULL;
    r->alloc_tier = KVHI_NO_TIER;
    r->busy = true;
    pthread_mutex_unlock(&e->lock);
    if (recycle)
        kvhi_region_mem_give(e, at, mem, r->size);
    else
        kvhi_region_mem_free(e, at, mem, r->size);
    pthread_mutex_lock(&e->lock);
    r->busy = false;
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
    free(r->disk_slots); /* the slots themselves went with unaccount or the tiers */
    r->disk_slots = NULL;
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
    kvhi_region_spares_free(e);
    pthread_mutex_destroy(&c->spare_lock);
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
    if (!x->name[0]) /* unnamed: messages name it by its handle */
        snprintf(x->name, sizeof(x->name), "0x%llx", (unsigned long long)out->id);
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
    /* A switch waiting to start counts as one running: it names the
     * context, and would fail on a handle destroyed under it. */
    if (x->switching || x->switches_waiting || x->holds)
        return kvhi_fail(KVH_ERR_BUSY, "context '%s' is being switched or used", x->name);
    for (uint32_t i = 0; i < x->n_regions; i++)
        kvhi_region_unaccount(e, x, &x->regions[i]);
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
    /* O_NONBLOCK: a FIFO must be refused, not waited on */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return kvhi_fail(KVH_ERR_IO, "cannot open weight file %s: %s", path, strerror(errno));
    struct stat sb;
    bool stated = fstat(fd, &sb) == 0;
    if (stated && !S_ISREG(sb.st_mode)) {
        close(fd);
        return kvhi_fail(KVH_ERR_IO, "weight file %s is not a regular file", path);
    }
    if (!stated || (uint64_t)sb.st_size < off || (uint64_t)sb.st_size - off < size) {
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
    if (st == KVH_ERR_NOSPACE && e->disk) {
        /* No room in memory: the bytes wait in the disk tier. */
        kvhi_clear_error();
        return kvhi_region_spill(e, x, r, bytes, KVH_TIER_HOST);
    }
    if (st != KVH_OK)
        return st;
    r->busy = true;
    pthread_mutex_unlock(&e->lock);
    uint8_t *mem = kvhi_region_mem_alloc(e, tier, r->size);
    uint32_t bad = 0;
    int rc = mem ? kvhi_region_copy(e, r, x->chunk_bytes, mem, tier, bytes, KVH_TIER_HOST, KVHI_CRC_RECORD, &bad) : -1;
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

kvh_status kvhi_context_add_region(kvh_engine *e, kvhi_context *x, const kvh_weight_region_params *p, uint32_t *out)
{
    if (x->switching || x->holds)
        return kvhi_fail(KVH_ERR_BUSY, "context '%s' is being switched or used", x->name);
    /* A file source is checked first (a range past its end is KVH_ERR_IO
     * whatever its size). Then, before anything is read, charged or
     * allocated: a region no tier can hold is never placed, and near 2^64
     * its slot and chunk counts would wrap. */
    int fd = -1;
    kvh_status st = p->path ? open_source(p->path, p->file_offset, p->size, &fd) : KVH_OK;
    uint64_t most = kvhi_weight_bytes_max(e), n_chunks = kvhi_div_ceil(p->size, x->chunk_bytes);
    const kvhi_tier *host = &e->tiers[KVH_TIER_HOST];
    /* Bytes wait in the host tier (or on disk) until a switch: without a
     * disk tier, the host tier is all they can have. */
    uint64_t host_bytes = kvhi_tier_slots(e, KVH_TIER_HOST) * host->slot_bytes;
    if (st == KVH_OK && p->size > most)
        st = kvhi_fail(KVH_ERR_NOSPACE, "weight region of %llu bytes is larger than any tier (the largest holds %llu)",
                       (unsigned long long)p->size, (unsigned long long)most);
    else if (st == KVH_OK && !p->path && host->present && !e->disk && p->size > host_bytes)
        st = kvhi_fail(KVH_ERR_NOSPACE,
                       "weight region of %llu bytes from memory is larger than the host tier (%llu bytes), where "
                       "regions from memory wait for a switch when there is no disk tier; register it from a file, "
                       "or give the engine a disk tier",
                       (unsigned long long)p->size, (unsigned long long)host_bytes);
    else if (st == KVH_OK && n_chunks > UINT32_MAX)
        st = kvhi_fail(KVH_ERR_INVALID_ARG,
                       "weight region of %llu bytes has more than 2^32 - 1 chunks of %llu bytes (the context's "
                       "chunk_bytes)",
                       (unsigned long long)p->size, (unsigned long long)x->chunk_bytes);
    if (st == KVH_OK && x->n_regions == x->cap_regions) {
        uint32_t cap = x->cap_regions ? x->cap_regions * 2 : 8;
        kvhi_region *nr = realloc(x->regions, sizeof(*nr) * cap);
        uint32_t *no = nr ? realloc(x->load_order, sizeof(*no) * cap) : NULL;
        if (nr)
            x->regions = nr;
        if (no) {
            x->load_order = no;
            x->cap_regions = cap;
        } else
            st = kvhi_fail(KVH_ERR_NOMEM, "out of memory for regions");
    }
    if (st != KVH_OK) {
        if (fd >= 0)
            close(fd);
        return st;
    }
    kvhi_region r = {.layer = p->layer,
                     .size = p->size,
                     .fd = fd,
                     .file_offset = p->file_offset,
                     .pinned = p->pinned != 0,
                     .tier = KVHI_NO_TIER,
                     .alloc_tier = KVHI_NO_TIER};
    /* Unnamed: messages name it by the index it gets. */
    if (p->name && p->name[0])
        snprintf(r.name, sizeof(r.name), "%s", p->name);
    else
        snprintf(r.name, sizeof(r.name), "#%u", x->n_regions);
    r.n_chunks = (uint32_t)n_chunks;
    r.chunk_crc = calloc(r.n_chunks, sizeof(uint32_t));
    if (!r.chunk_crc) {
        if (fd >= 0)
            close(fd);
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for %u chunk checksums", r.n_chunks);
    }
    if (!p->path) {
        r.dirty = true; /* no source: the engine holds the only copy */
        uint32_t i = x->n_regions;
        x->regions[i] = r; /* visible (busy) while the lock drops */
        x->n_regions++;
        x->load_order[i] = i; /* placeholder until ordered below */
        x->holds++;           /* keeps switch and destroy away meanwhile */
        x->adding = true;
        st = region_copy_in(e, x, &x->regions[i], p->bytes);
        kvhi_free_garbage(e); /* clean regions it displaced */
        x->adding = false;
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
