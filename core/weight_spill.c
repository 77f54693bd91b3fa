/* Weight regions in the disk tier: a region whose bytes exist nowhere
 * else (modified since it was loaded, or registered from caller memory)
 * goes to disk when memory has no room for it, rather than failing the
 * switch that pushes it out.
 *
 * It takes ordinary disk slots, each filled with as much of the region as
 * the slot's data area holds (more than a block's stored form under a KV
 * codec, which rounds up to whole pages), so the
 * disk budget and its eviction (dropping the least valuable clean KV
 * copies) cover weights and KV alike. The slots are scratch: never
 * journaled (a context does not outlive its engine), written with a zeroed
 * header so nothing can take them for a KV block, and covered by the
 * region's own chunk checksums, which are recomputed on the way out and
 * checked on the way back. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/context.h"
#include "core/move.h"
#include "core/crc32c.h"
#include "core/disk_format.h"
#include "core/disk_index.h"
#include "core/disk_io.h"
#include "core/tier.h"

/* The chunk checksums of a region computed over its bytes as they stream
 * through in pieces that need not line up with the chunks. */
typedef struct chunk_stream {
    kvhi_region *r;
    uint64_t chunk;  /* bytes per chunk */
    uint32_t index;  /* current chunk */
    uint64_t filled; /* its bytes seen so far */
    uint32_t crc;
    bool record; /* record the checksums, else compare */
    int64_t bad; /* first mismatching chunk, or -1 */
} chunk_stream;

static void stream_feed(chunk_stream *s, const uint8_t *p, uint64_t n)
{
    while (n && s->index < s->r->n_chunks) {
        uint64_t start = (uint64_t)s->index * s->chunk;
        uint64_t len = s->r->size - start < s->chunk ? s->r->size - start : s->chunk;
        uint64_t take = len - s->filled < n ? len - s->filled : n;
        s->crc = kvhi_crc32c(s->crc, p, take);
        s->filled += take, p += take, n -= take;
        if (s->filled < len)
            continue;
        if (s->record)
            s->r->chunk_crc[s->index] = s->crc;
        else if (s->r->chunk_crc[s->index] != s->crc && s->bad < 0)
            s->bad = s->index;
        s->index++;
        s->filled = 0;
        s->crc = 0;
    }
}

static uint32_t slots_needed(const kvhi_disk *d, uint64_t bytes)
{
    /* Regions are at most the largest tier (kvhi_weight_bytes_max), so
     * the count fits. */
    uint64_t n = kvhi_div_ceil(bytes, kvhi_disk_slot_data_bytes(d));
    return n > UINT32_MAX ? UINT32_MAX : (uint32_t)n;
}

/* The part of r that disk slot number i of its run holds: *off and the
 * length (a slot's data area, less in the last slot). */
static uint64_t slot_piece(const kvhi_disk *d, const kvhi_region *r, uint32_t i, uint64_t *off)
{
    uint64_t piece = kvhi_disk_slot_data_bytes(d);
    *off = (uint64_t)i * piece;
    return r->size - *off < piece ? r->size - *off : piece;
}

void kvhi_region_disk_release(kvh_engine *e, kvhi_region *r)
{
    for (uint32_t i = 0; i < r->n_disk_slots; i++)
        kvhi_release_slot(e, KVH_TIER_DISK, r->disk_slots[i]);
    free(r->disk_slots);
    r->disk_slots = NULL;
    r->n_disk_slots = 0;
    pthread_cond_broadcast(&e->changed); /* room appeared */
}

/* Writes src (memory of src_tier, r->size bytes) into the slots, block
 * by block through the lane's staging; records the chunk checksums.
 * Without the lock. 0 or -errno. */
static int write_slots(kvh_engine *e, kvhi_region *r, uint64_t chunk, const uint32_t *slots, uint32_t n,
                       const uint8_t *src, uint32_t src_tier)
{
    kvhi_disk *d = e->disk;
    /* A reused slot's deletion record must be on file before its new
     * contents, as for KV. */
    int rc = kvhi_index_flush(d);
    if (rc != 0)
        return rc < 0 ? rc : -EIO;
    int *results = malloc(sizeof(int) * d->lane_blocks);
    if (!results)
        return -ENOMEM;
    chunk_stream s = {.r = r, .chunk = chunk, .record = true, .bad = -1};
    kvhi_disk_lane *lane = kvhi_disk_lane_get(d);
    if (!lane) { /* none free and none could be made */
        free(results);
        return -ENOMEM;
    }
    for (uint32_t i = 0; i < n && rc == 0;) {
        uint32_t k = n - i < d->lane_blocks ? n - i : d->lane_blocks;
        for (uint32_t j = 0; j < k && rc == 0; j++) {
            uint8_t *staged = kvhi_disk_lane_slot(lane, j);
            uint8_t *data = staged + KVHI_SLOT_HEADER_BYTES;
            uint64_t off, len = slot_piece(d, r, i + j, &off);
            memset(staged, 0, KVHI_SLOT_HEADER_BYTES);
            if (kvhi_copy_bytes(e, KVH_TIER_HOST, data, src_tier, src + off, len) != 0)
                rc = -EIO;
            memset(data + len, 0, kvhi_disk_slot_data_bytes(d) - len);
            stream_feed(&s, data, len);
        }
        if (rc == 0) {
            kvhi_disk_write_staged(d, lane, k, slots + i, results);
            for (uint32_t j = 0; j < k && rc == 0; j++)
                rc = results[j];
        }
        i += k;
    }
    kvhi_disk_lane_put(d, lane);
    free(results);
    return rc;
}

kvh_status kvhi_region_spill(kvh_engine *e, kvhi_context *x, kvhi_region *r, const uint8_t *src, uint32_t src_tier)
{
    kvhi_disk *d = e->disk;
    if (!d || !e->tiers[KVH_TIER_DISK].present)
        return kvhi_fail(KVH_ERR_NOSPACE, "weight region '%s' has no room in memory and there is no disk tier",
                         r->name);
    if (d->fatal || d->read_only)
        return kvhi_fail(KVH_ERR_IO, "weight region '%s' cannot go to disk: the store is %s", r->name,
                         d->read_only ? "read-only" : "failed");
    uint32_t n = slots_needed(d, r->size);
    uint32_t *slots = malloc(sizeof(uint32_t) * n);
    if (!slots)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for a slot list");
    /* Busy from here: taking slots may drop the lock. */
    r->busy = true;
    kvh_status st = KVH_OK;
    uint32_t got = 0;
    for (; got < n && st == KVH_OK; got++)
        if ((st = kvhi_reserve_slot(e, KVH_TIER_DISK, UINT32_MAX, &slots[got])) != KVH_OK)
            break;
    if (st != KVH_OK) {
        char why[KVHI_CONTEXT_WHY_BYTES];
        snprintf(why, sizeof(why), "%s", kvhi_last_error());
        while (got)
            kvhi_release_slot(e, KVH_TIER_DISK, slots[--got]);
        free(slots);
        r->busy = false;
        return kvhi_fail(st, "no room in the disk tier for weight region '%s' (%llu bytes): %s", r->name,
                         (unsigned long long)r->size, why);
    }
    pthread_mutex_unlock(&e->lock);
    int rc = write_slots(e, r, x->chunk_bytes, slots, n, src, src_tier);
    pthread_mutex_lock(&e->lock);
    r->busy = false;
    if (rc != 0) {
        for (uint32_t i = 0; i < n; i++)
            kvhi_release_slot(e, KVH_TIER_DISK, slots[i]);
        free(slots);
        return kvhi_fail(rc == -ENOMEM ? KVH_ERR_NOMEM : KVH_ERR_IO, "cannot write weight region '%s' to disk: %s",
                         r->name, strerror(-rc));
    }
    /* Its bytes are on disk now: memory, if it had any, goes. */
    if (r->data)
        kvhi_region_release(e, x, r, false);
    r->tier = KVH_TIER_DISK;
    r->disk_slots = slots;
    r->n_disk_slots = n;
    r->crc_known = true;
    r->stale_crc = false;
    e->contexts->stats.bytes_host_to_disk += r->size;
    return KVH_OK;
}

int kvhi_region_read_disk(kvh_engine *e, kvhi_region *r, uint64_t chunk, uint8_t *dst, uint32_t dst_tier,
                          uint32_t *bad_chunk)
{
    kvhi_disk *d = e->disk;
    int *results = malloc(sizeof(int) * d->lane_blocks);
    if (!results)
        return -ENOMEM;
    chunk_stream s = {.r = r, .chunk = chunk, .record = false, .bad = -1};
    kvhi_disk_lane *lane = kvhi_disk_lane_get(d);
    if (!lane) { /* none free and none could be made */
        free(results);
        return -ENOMEM;
    }
    int rc = 0;
    for (uint32_t i = 0; i < r->n_disk_slots && rc == 0;) {
        uint32_t k = r->n_disk_slots - i < d->lane_blocks ? r->n_disk_slots - i : d->lane_blocks;
        kvhi_disk_read_staged(d, lane, k, r->disk_slots + i, results, NULL, NULL);
        for (uint32_t j = 0; j < k && rc == 0; j++) {
            if ((rc = results[j]) != 0)
                break;
            const uint8_t *data = kvhi_disk_lane_slot(lane, j) + KVHI_SLOT_HEADER_BYTES;
            uint64_t off, len = slot_piece(d, r, i + j, &off);
            stream_feed(&s, data, len);
            if (kvhi_copy_bytes(e, dst_tier, dst + off, KVH_TIER_HOST, data, len) != 0)
                rc = -EIO;
        }
        i += k;
    }
    kvhi_disk_lane_put(d, lane);
    free(results);
    if (rc == 0 && s.bad >= 0) {
        *bad_chunk = (uint32_t)s.bad;
        return 1;
    }
    return rc;
}
