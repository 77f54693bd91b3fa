/* Memory of weight regions in the tiers: slots withheld from a tier's
 * budget, allocation with the tier's allocator, chunked reads from the
 * source file and chunked copies, each chunk covered by a CRC32C.
 *
 * Why withheld slots: the tiers' budgets are counted in KV slots, and the
 * eviction policy frees slots. Charging a region as whole slots taken out
 * of the pool keeps one exact budget per tier for KV and weights together,
 * and lets KV be evicted by the usual policy to make room for weights.
 * The region's bytes themselves live in one contiguous allocation (kernels
 * want a tensor in one piece, and KV slots are neither contiguous nor
 * chunk-sized). On the CPU backend the pages of withheld slots are handed
 * back to the kernel, so resident memory stays within the budget. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core/context.h"
#include "core/host_spare.h"
#include "core/move.h"
#include "core/crc32c.h"
#include "core/disk_io.h"
#include "core/tier.h"

/* Slots of `tier` that hold `bytes` (a tier under a KV codec has smaller
 * slots than a raw one). */
static uint64_t slots_for(kvh_engine *e, uint32_t tier, uint64_t bytes)
{
    uint64_t sb = e->tiers[tier].slot_bytes;
    return kvhi_div_ceil(bytes, sb);
}

uint64_t kvhi_weight_bytes_max(const kvh_engine *e)
{
    uint64_t most = 0;
    for (uint32_t t = 0; t < KVH_TIER_COUNT; t++) {
        const kvhi_tier *tier = &e->tiers[t];
        if (!tier->present)
            continue;
        uint64_t per_slot = t == KVH_TIER_DISK ? (e->disk ? kvhi_disk_slot_data_bytes(e->disk) : 0) : tier->slot_bytes;
        uint64_t cap = kvhi_tier_slots(e, t);
        uint64_t bytes = per_slot && cap > UINT64_MAX / per_slot ? UINT64_MAX : cap * per_slot;
        if (bytes > most)
            most = bytes;
    }
    return most;
}

/* Withheld slots hold no data: on the CPU backend their whole pages go
 * back to the kernel (they read as zeros when KV reuses them). */
static void forget_slot_pages(kvh_engine *e, uint32_t tier, uint32_t slot)
{
    if (e->backend != kvhi_backend_cpu())
        return;
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t lo = (uintptr_t)kvhi_slot_addr(e, tier, slot);
    uintptr_t hi = lo + e->tiers[tier].slot_bytes;
    lo = (lo + page - 1) & ~(page - 1);
    hi &= ~(page - 1);
    if (hi > lo)
        madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

uint64_t kvhi_region_page_bytes(void)
{
    /* Read once; threads racing here store the same value. */
    static uint64_t cached;
    uint64_t page = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (page)
        return page;
    long sys = sysconf(_SC_PAGESIZE);
    page = sys > 0 && ((uint64_t)sys & ((uint64_t)sys - 1)) == 0 ? (uint64_t)sys : 4096u;
    __atomic_store_n(&cached, page, __ATOMIC_RELAXED);
    return page;
}

/* A region's memory: its size in whole pages, as each region is an
 * allocation of its own (kvhi_region_mem_alloc). It is what the region is
 * charged (the context's charge, the sum, is then rounded up to slots
 * once: a GGUF has hundreds of small tensors, and a slot each would
 * nearly double a small model's charge; adding and taking off a region's
 * charge both go through here, so what is given back equals what was
 * taken), and the size by which freed region memory is recycled. */
static uint64_t region_pages(uint64_t bytes)
{
    uint64_t page = kvhi_region_page_bytes();
    return (bytes + page - 1) & ~(page - 1);
}

uint64_t kvhi_context_device_slots(kvh_engine *e, const kvhi_context *x)
{
    uint64_t bytes = 0;
    for (uint32_t i = 0; i < x->n_regions; i++) {
        uint64_t pages = region_pages(x->regions[i].size);
        bytes = bytes > UINT64_MAX - pages ? UINT64_MAX : bytes + pages;
    }
    return slots_for(e, KVH_TIER_DEVICE, bytes);
}

/* Gives back slots beyond what ch->bytes needs. */
static void trim(kvh_engine *e, kvhi_charge *ch, uint32_t tier)
{
    uint64_t keep = slots_for(e, tier, ch->bytes + ch->pending);
    bool freed = false;
    while (ch->n > keep) {
        kvhi_release_slot(e, tier, ch->slots[--ch->n]);
        freed = true;
    }
    if (freed)
        pthread_cond_broadcast(&e->changed); /* room appeared */
}

/* One more slot of `tier` (lock held; may drop it in KVHI_CHARGE_EVICT). */
static kvh_status take_slot(kvh_engine *e, uint32_t tier, enum kvhi_charge_mode mode, uint32_t *slot)
{
    kvhi_tier *t = &e->tiers[tier];
    kvhi_contexts *c = e->contexts;
    for (;;) {
        if (kvhi_slot_pool_alloc(&t->slots, slot) == 0)
            return KVH_OK;
        /* A kept clean copy of a device block is as good as free. */
        if (tier == KVH_TIER_HOST && kvhi_clean_reclaim(e, slot))
            return KVH_OK;
        if (mode == KVHI_CHARGE_FREE_ONLY)
            return KVH_ERR_NOSPACE; /* quietly: the caller has a plan B */
        /* The other side of a switch is about to free room: wait for it
         * rather than evict KV that would then fit. */
        if (tier == KVH_TIER_DEVICE && c->departures_left) {
            c->arrivals_waiting++;
            pthread_cond_broadcast(&c->cv); /* a departure may wait on us */
            pthread_cond_wait(&c->cv, &e->lock);
            c->arrivals_waiting--;
            continue;
        }
        /* Clean weights kept in host memory are a cache: they go before
         * KV, which would need a disk write. */
        if (tier == KVH_TIER_HOST && kvhi_drop_clean_host_region(e, false))
            continue;
        kvh_status st = kvhi_reserve_slot(e, tier, UINT32_MAX, slot);
        if (st == KVH_ERR_NOSPACE && tier == KVH_TIER_HOST && kvhi_drop_clean_host_region(e, true))
            continue;
        return st;
    }
}

/* bytes: the size of one region, charged in whole pages (region_pages);
 * kvhi_charge_sub takes the same size off. */
kvh_status kvhi_charge_add(kvh_engine *e, kvhi_context *x, uint32_t tier, uint64_t bytes, enum kvhi_charge_mode mode)
{
    kvhi_tier *t = &e->tiers[tier];
    kvhi_charge *ch = &x->charge[tier];
    const char *name = tier == KVH_TIER_DEVICE ? "device" : "host";
    if (!t->present)
        return kvhi_fail(KVH_ERR_NOSPACE, "the %s tier is not configured", name);
    /* Raw bytes first: a size near 2^64 would wrap when rounded. */
    if (slots_for(e, tier, bytes) > kvhi_tier_slots(e, tier) ||
        slots_for(e, tier, region_pages(bytes)) > kvhi_tier_slots(e, tier))
        return kvhi_fail(KVH_ERR_NOSPACE, "%llu bytes of weights are more than the whole %s tier",
                         (unsigned long long)bytes, name);
    uint64_t charge = region_pages(bytes);
    /* ch->bytes and ch->n can change while the lock is dropped (a clean
     * region of this context dropped for room, the other arrival thread
     * charging it too): re-read them on every round, and grow the list
     * only once a slot is taken, with the lock held. */
    ch->pending += charge;
    kvh_status st = KVH_OK;
    while (ch->n < slots_for(e, tier, ch->bytes + ch->pending)) {
        uint32_t slot;
        if ((st = take_slot(e, tier, mode, &slot)) != KVH_OK)
            break;
        if (ch->n == ch->cap) {
            uint32_t cap = ch->cap ? ch->cap * 2 : 64;
            uint32_t *ns = realloc(ch->slots, sizeof(uint32_t) * cap);
            if (!ns) {
                kvhi_release_slot(e, tier, slot);
                st = kvhi_fail(KVH_ERR_NOMEM, "out of memory for a slot list");
                break;
            }
            ch->slots = ns;
            ch->cap = cap;
        }
        forget_slot_pages(e, tier, slot);
        ch->slots[ch->n++] = slot;
    }
    ch->pending -= charge;
    if (st == KVH_OK)
        ch->bytes += charge;
    /* Gives back what a failure leaves, or a slot the other thread took
     * for these bytes while take_slot had dropped the lock. */
    trim(e, ch, tier);
    if (st == KVH_ERR_NOSPACE && mode == KVHI_CHARGE_EVICT) {
        /* The victim search speaks of blocks; a tier full of weights
         * needs saying so, or the message blames KV that is not there. */
        kvh_weight_stats ws;
        kvhi_weight_stats(e, &ws);
        uint64_t weight_slots = tier == KVH_TIER_DEVICE ? ws.slots_device : ws.slots_host;
        if (weight_slots) {
            char why[KVHI_CONTEXT_WHY_BYTES];
            snprintf(why, sizeof(why), "%s", kvhi_last_error());
            st = kvhi_fail(st, "%s (%llu of the %s tier's %llu slots hold weights of contexts)", why,
                           (unsigned long long)weight_slots, name, (unsigned long long)kvhi_tier_slots(e, tier));
        }
    }
    return st;
}

void kvhi_charge_sub(kvh_engine *e, kvhi_context *x, uint32_t tier, uint64_t bytes)
{
    kvhi_charge *ch = &x->charge[tier];
    ch->bytes -= region_pages(bytes);
    trim(e, ch, tier);
}

void kvhi_charge_free(kvhi_charge *ch)
{
    free(ch->slots);
    *ch = (kvhi_charge){0};
}

uint8_t *kvhi_region_mem_alloc(kvh_engine *e, uint32_t tier, uint64_t bytes)
{
    return tier == KVH_TIER_DEVICE ? e->backend->device_alloc(e->backend_ctx, bytes)
                                   : e->backend->host_alloc(e->backend_ctx, bytes);
}

void kvhi_region_mem_free(kvh_engine *e, uint32_t tier, uint8_t *p, uint64_t bytes)
{
    if (!p)
        return;
    if (tier == KVH_TIER_DEVICE)
        e->backend->device_free(e->backend_ctx, p, bytes);
    else
        e->backend->host_free(e->backend_ctx, p, bytes);
}

/* ---- memory recycled within a switch ----
 * The departures of a switch free region memory while its arrivals
 * allocate as much again, in both tiers. Handing the freed memory straight
 * to the next allocation of the same size skips the kernel zeroing fresh
 * pages (on the CPU the largest cost of a copying switch; on CUDA a
 * cudaFree, which synchronises the device). What is left over is freed
 * when the switch ends. */

enum { SPARES_MAX = 256 };

uint8_t *kvhi_region_mem_take(kvh_engine *e, uint32_t tier, uint64_t bytes)
{
    kvhi_contexts *c = e->contexts;
    uint8_t *p = NULL;
    pthread_mutex_lock(&c->spare_lock);
    for (uint32_t i = c->n_spares; i-- > 0;) {
        if (c->spares[i].tier != tier || region_pages(c->spares[i].bytes) != region_pages(bytes))
            continue;
        p = c->spares[i].p;
        c->spares[i] = c->spares[--c->n_spares];
        break;
    }
    pthread_mutex_unlock(&c->spare_lock);
    return p ? p : kvhi_region_mem_alloc(e, tier, bytes);
}

void kvhi_region_mem_give(kvh_engine *e, uint32_t tier, uint8_t *p, uint64_t bytes)
{
    kvhi_contexts *c = e->contexts;
    if (!p)
        return;
    pthread_mutex_lock(&c->spare_lock);
    bool kept = c->n_spares < SPARES_MAX;
    if (kept)
        c->spares[c->n_spares++] = (struct kvhi_spare){p, bytes, (uint8_t)tier};
    pthread_mutex_unlock(&c->spare_lock);
    if (!kept)
        kvhi_region_mem_free(e, tier, p, bytes);
}

void kvhi_region_spares_free(kvh_engine *e)
{
    kvhi_contexts *c = e->contexts;
    for (;;) {
        pthread_mutex_lock(&c->spare_lock);
        struct kvhi_spare s = {0};
        if (c->n_spares)
            s = c->spares[--c->n_spares];
        pthread_mutex_unlock(&c->spare_lock);
        if (!s.p)
            return;
        kvhi_region_mem_free(e, s.tier, s.p, s.bytes);
    }
}

/* Memory of this tier can be read by the CPU directly. */
static bool host_readable(kvh_engine *e, uint32_t tier)
{
    return tier != KVH_TIER_DEVICE || e->device_host_addressable;
}

static int pread_full(int fd, uint8_t *buf, uint64_t n, uint64_t off)
{
    while (n) {
        ssize_t got = pread(fd, buf, n, (off_t)off);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (got == 0)
            return -EIO; /* the file shrank since it was registered */
        buf += got, off += (uint64_t)got, n -= (uint64_t)got;
    }
    return 0;
}

int kvhi_region_read_source(kvh_engine *e, kvhi_region *r, uint64_t chunk, uint8_t *dst, uint32_t dst_tier,
                            uint32_t *bad_chunk)
{
    bool direct = host_readable(e, dst_tier);
    uint8_t *stage = NULL;
    if (!direct && !(stage = malloc(chunk)))
        return -ENOMEM;
    int rc = 0;
    for (uint32_t c = 0; c < r->n_chunks && rc == 0; c++) {
        uint64_t off = (uint64_t)c * chunk;
        uint64_t n = r->size - off < chunk ? r->size - off : chunk;
        uint8_t *buf = direct ? dst + off : stage;
        rc = pread_full(r->fd, buf, n, r->file_offset + off);
        if (rc != 0)
            break;
        uint32_t crc = kvhi_crc32c(0, buf, n);
        if (!r->crc_known)
            r->chunk_crc[c] = crc;
        else if (r->chunk_crc[c] != crc) {
            *bad_chunk = c;
            rc = 1;
            break;
        }
        if (!direct) {
            char msg[256];
            if (e->backend->copy(e->backend_ctx, dst + off, stage, n, KVHI_COPY_HOST_TO_DEVICE, msg, sizeof(msg)))
                rc = -EIO;
        }
    }
    free(stage);
    return rc;
}

int kvhi_region_copy(kvh_engine *e, kvhi_region *r, uint64_t chunk, uint8_t *dst, uint32_t dst_tier, const uint8_t *src,
                     uint32_t src_tier, int crc_mode, uint32_t *bad_chunk)
{
    /* Both sides in CPU memory: checksum while copying, in one pass. */
    bool fused = crc_mode != KVHI_CRC_NONE && host_readable(e, dst_tier) && host_readable(e, src_tier);
    for (uint32_t c = 0; c < r->n_chunks; c++) {
        uint64_t off = (uint64_t)c * chunk;
        uint64_t n = r->size - off < chunk ? r->size - off : chunk;
        if (fused) {
            uint32_t crc = kvhi_crc32c_copy(0, dst + off, src + off, n);
            if (crc_mode == KVHI_CRC_RECORD)
                r->chunk_crc[c] = crc;
            else if (crc != r->chunk_crc[c]) {
                *bad_chunk = c;
                return 1;
            }
            continue;
        }
        /* Checksum the side the CPU can read: the source on the way up,
         * the destination on the way down. */
        if (crc_mode == KVHI_CRC_VERIFY && host_readable(e, src_tier) &&
            kvhi_crc32c(0, src + off, n) != r->chunk_crc[c]) {
            *bad_chunk = c;
            return 1;
        }
        if (kvhi_copy_bytes(e, dst_tier, dst + off, src_tier, src + off, n) != 0)
            return -1;
        if (crc_mode == KVHI_CRC_RECORD) {
            const uint8_t *readable = host_readable(e, dst_tier)   ? dst + off
                                      : host_readable(e, src_tier) ? src + off
                                                                   : NULL;
            if (!readable)
                return -1;
            r->chunk_crc[c] = kvhi_crc32c(0, readable, n);
        }
    }
    return 0;
}

int64_t kvhi_region_check(kvh_engine *e, kvhi_region *r, uint64_t chunk)
{
    bool direct = host_readable(e, r->alloc_tier);
    uint8_t *stage = NULL;
    if (!direct && !(stage = malloc(chunk)))
        return -1;
    int64_t bad = 0;
    for (uint32_t c = 0; c < r->n_chunks; c++) {
        uint64_t off = (uint64_t)c * chunk;
        uint64_t n = r->size - off < chunk ? r->size - off : chunk;
        const uint8_t *buf = r->data + off;
        if (!direct) {
            if (kvhi_copy_bytes(e, KVH_TIER_HOST, stage, r->alloc_tier, r->data + off, n) != 0) {
                bad = -1;
                break;
            }
            buf = stage;
        }
        if (kvhi_crc32c(0, buf, n) != r->chunk_crc[c]) {
            bad = (int64_t)c + 1;
            break;
        }
    }
    free(stage);
    return bad;
}
