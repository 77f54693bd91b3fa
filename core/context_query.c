/* Weight contexts, read side: layer readiness, region data, pinning,
 * checksum verification, residency and engine-wide weight stats. */
#include <errno.h>
#include <stdio.h>
#include <time.h>

#include "core/context.h"

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
        deadline = kvhi_realtime_in_ns(timeout_ns);
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
                return kvhi_fail(x->load_status, "%s", x->load_msg[0] ? x->load_msg : kvhi_status_text(x->load_status));
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
        return kvhi_fail(KVH_ERR_RANGE, "context '%s' has %u regions: no region %u", x->name, x->n_regions, region);
    kvhi_region *r = &x->regions[region];
    if (r->tier != KVH_TIER_DEVICE || r->busy)
        return kvhi_fail(KVH_ERR_NOT_RESIDENT, "weight region '%s' is not resident in the device tier", r->name);
    /* Its memory may be dropped or handed to the arriving context at any
     * moment: an address now would not last the caller's first read. */
    if (x->departing && !r->pinned)
        return kvhi_fail(KVH_ERR_BUSY,
                         "weight region '%s' of context '%s' is leaving the device tier (a switch away runs)", r->name,
                         x->name);
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
        return kvhi_fail(KVH_ERR_RANGE, "context '%s' has %u regions: no region %u", x->name, x->n_regions, region);
    x->regions[region].pinned = pinned;
    return KVH_OK;
}

kvh_status kvhi_context_verify(kvh_engine *e, kvh_context h, uint64_t *checked)
{
    kvhi_context *x = NULL;
    kvh_status st = kvhi_context_resolve(e, h, &x);
    if (st != KVH_OK)
        return st;
    /* Other verifies may run beside this one: they only read. */
    if (x->switching || x->switches_waiting || x->adding)
        return kvhi_fail(KVH_ERR_BUSY, "context '%s' is being switched or a region is being added to it", x->name);
    /* Keeps switches, destroy and new regions away while the lock is dropped. */
    x->holds++;
    uint64_t n = 0;
    for (uint32_t i = 0; i < x->n_regions && st == KVH_OK; i++) {
        kvhi_region *r = &x->regions[i];
        /* A region handed out writable may differ from its checksums
         * until it is written back. */
        if (r->tier == KVHI_NO_TIER || r->tier == KVH_TIER_DISK || !r->crc_known || r->stale_crc)
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
        else if (g->tier == KVH_TIER_DISK)
            r.bytes_disk += g->size;
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
        s.bytes_device = s.bytes_host = s.slots_device = s.slots_host = s.bytes_disk = s.slots_disk = 0;
        for (uint32_t i = 0; i < c->table.cap; i++) {
            kvhi_context *x = kvhi_handles_at(&c->table, i);
            if (!x)
                continue;
            /* The charges hold whole slots for their regions' pages; the
             * bytes are the regions' own sizes. */
            s.slots_device += x->charge[KVH_TIER_DEVICE].n;
            s.slots_host += x->charge[KVH_TIER_HOST].n;
            for (uint32_t j = 0; j < x->n_regions; j++) {
                const kvhi_region *r = &x->regions[j];
                if (r->tier == KVH_TIER_DEVICE)
                    s.bytes_device += r->size;
                else if (r->tier == KVH_TIER_HOST)
                    s.bytes_host += r->size;
                else if (r->tier == KVH_TIER_DISK) {
                    s.bytes_disk += r->size;
                    s.slots_disk += r->n_disk_slots;
                }
            }
        }
    }
    s.struct_size = sizeof(s);
    s.unified_memory = kvhi_unified_memory(e);
    *out = s;
}
