/* The transfer of one move, run without the engine lock: a copy between
 * memory tiers (converting through the KV codec where the tiers' forms
 * differ), a write to a disk slot with its self-describing header, or a
 * read from one, checked against the header and the data CRC32C before
 * the block may be served. Batches of neighbouring disk slots go out as
 * few large vectored I/Os (core/disk_io.c). core/move.c begins and
 * commits the moves around these. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "core/crc32c.h"
#include "core/disk_format.h"
#include "core/disk_io.h"
#include "core/engine.h"
#include "core/move.h"
#include "core/block.h"
#include "core/tier.h"
#include "core/codec_tier.h"

void kvhi_xfer_prepare(kvh_engine *e, uint32_t b, uint32_t dst_tier, uint32_t dst_slot, kvhi_xfer *x)
{
    kvhi_assert_locked(e);
    kvhi_block *blk = &e->blocks[b];
    x->block = b;
    x->src_tier = blk->tier;
    x->src_slot = blk->slot;
    x->dst_tier = dst_tier;
    x->dst_slot = dst_slot;
    x->incoming = false;
    /* Writes carry the hash when the block has one; reads expect what the
     * disk copy was written with. */
    bool hashed =
        dst_tier == KVH_TIER_DISK ? (blk->flags & KVHI_BF_HASHED) != 0 : (blk->flags & KVHI_BF_DISK_HASHED) != 0;
    x->hash = hashed ? blk->hash : 0;
    x->parent = hashed ? blk->parent_hash : 0;
    x->n_tokens = blk->n_tokens;
    x->data_crc = blk->data_crc;
    uint16_t sealed = KVHI_BF_PUBLISHED | KVHI_BF_HASHED | KVHI_BF_KV_COMPLETE;
    x->published = (blk->flags & sealed) == sealed;
    memcpy(x->tokens, kvhi_block_tokens(e, b), sizeof(int32_t) * blk->n_tokens);
    x->err = 0;
    x->why = NULL;
    x->in_place = false;
    x->into_spare = false;
}

/* The header of a slot written for x (x->data_crc already set). */
static void encode_slot_header(const kvhi_disk *d, const kvhi_xfer *x, uint8_t *staged)
{
    kvhi_slot_meta m = {.store_id = d->store_id,
                        .slot = x->dst_slot,
                        .offset = kvhi_disk_slot_offset(d, x->dst_slot),
                        .hash = x->hash,
                        .parent = x->parent,
                        .n_tokens = x->n_tokens,
                        .data_crc = x->data_crc,
                        .flags = x->published && x->hash ? KVHI_SLOT_PUBLISHED : 0u,
                        .geo_tag = d->geo_tag,
                        .tokens = x->tokens};
    kvhi_slot_header_encode(staged, &m, d->block_bytes);
}

/* Stages x's block for writing: 0, or -EIO when its bytes could not be
 * copied out of the source tier (the staging slot then holds whatever it
 * held before, which must not be written under this block's name). */
static int stage_write(kvh_engine *e, kvhi_xfer *x, uint8_t *staged)
{
    kvhi_disk *d = e->disk;
    uint8_t *data = staged + KVHI_SLOT_HEADER_BYTES;
    const uint8_t *src = kvhi_slot_addr(e, x->src_tier, x->src_slot);
    bool same_form = e->tiers[x->src_tier].encoded == e->tiers[KVH_TIER_DISK].encoded;
    if (same_form && (x->src_tier == KVH_TIER_HOST || e->device_host_addressable)) {
        x->data_crc = kvhi_crc32c_copy(0, data, src, d->block_bytes);
    } else {
        if (kvhi_block_copy(e, KVH_TIER_DISK, data, x->src_tier, src) != 0) /* encodes if needed */
            return -EIO;
        x->data_crc = kvhi_crc32c(0, data, d->block_bytes);
    }
    encode_slot_header(d, x, staged);
    return 0;
}

/* True when a block read from disk can land in its destination slot as it
 * is: host memory holding blocks in the disk's form. A destination in
 * another form (a raw device tier under a codec) is decoded after the
 * check, like a copy to device memory. */
static bool reads_into_host(const kvh_engine *e, const kvhi_xfer *x)
{
    bool host = x->dst_tier == KVH_TIER_HOST || (x->dst_tier == KVH_TIER_DEVICE && e->device_host_addressable);
    return host && e->tiers[x->dst_tier].encoded == e->tiers[KVH_TIER_DISK].encoded;
}

/* Checks a block read from disk: its header against what x expects and
 * the CRC32C of its data. Sets x->err = 1 (and x->why) on a mismatch. */
static void verify_read(kvh_engine *e, kvhi_xfer *x, const uint8_t *header, uint32_t crc)
{
    kvhi_disk *d = e->disk;
    if (kvhi_slot_verify_crc(header, crc, d->block_bytes, d->store_id, d->geo_tag, x->src_slot,
                             kvhi_disk_slot_offset(d, x->src_slot), x->hash, e->cfg.block_tokens, NULL, &x->why) != 0)
        x->err = 1;
    else if (crc != x->data_crc) {
        /* A whole block of the same prefix, but not the bytes this block
         * wrote: the slot was reused while the record naming it outlived
         * its deletion (a journal append lost to a crash). */
        x->err = 1;
        x->why = "the slot holds other data than its index record names (a stale record)";
    }
}

static void finish_read(kvh_engine *e, kvhi_xfer *x, const uint8_t *staged)
{
    const uint8_t *data = staged + KVHI_SLOT_HEADER_BYTES;
    bool host_dst = reads_into_host(e, x);
    /* Into host memory the copy and the checksum share one pass; the slot
     * is the mover's own until it commits, so a failed check costs nothing. */
    uint32_t crc = host_dst
                       ? kvhi_crc32c_copy(0, kvhi_slot_addr(e, x->dst_tier, x->dst_slot), data, e->disk->block_bytes)
                       : kvhi_crc32c(0, data, e->disk->block_bytes);
    verify_read(e, x, staged, crc);
    if (x->err || host_dst || x->dst_tier == KVHI_NO_TIER)
        return;
    if (kvhi_block_copy(e, x->dst_tier, kvhi_slot_addr(e, x->dst_tier, x->dst_slot), KVH_TIER_DISK, data) != 0)
        x->err = -EIO;
}

/* A single block read into host memory skips the staging copy: the data
 * lands in its destination slot. False when that path does not apply. */
static bool read_one_direct(kvh_engine *e, kvhi_xfer *x)
{
    if (x->src_tier != KVH_TIER_DISK || x->dst_tier == KVHI_NO_TIER || !reads_into_host(e, x))
        return false;
    kvhi_disk_lane *lane = kvhi_disk_lane_get(e->disk);
    if (!lane)
        return false;
    uint32_t crc = 0;
    const uint8_t *header = NULL;
    uint64_t t0 = kvhi_now_ns(); /* the submission's time, not the wait for a lane */
    int rc =
        kvhi_disk_read_into(e->disk, lane, x->src_slot, kvhi_slot_addr(e, x->dst_tier, x->dst_slot), &crc, &header);
    if (rc == 0)
        verify_read(e, x, header, crc);
    else if (rc < 0)
        x->err = rc;
    if (rc != 1)
        kvhi_latency_record_xfers(&e->latency, x, 1, kvhi_now_ns() - t0);
    kvhi_disk_lane_put(e->disk, lane);
    return rc != 1;
}

typedef struct read_batch {
    kvh_engine *e;
    kvhi_xfer *xs;
    kvhi_disk_lane *lane;
    bool finished[64];
} read_batch;

/* Checks and places blocks of a batch that arrived while the rest of it
 * is still being read. */
static void read_arrived(void *ctx, uint32_t first, uint32_t count)
{
    read_batch *rb = ctx;
    for (uint32_t i = first; i < first + count; i++) {
        rb->xs[i].err = 0;
        finish_read(rb->e, &rb->xs[i], kvhi_disk_lane_slot(rb->lane, i));
        rb->finished[i] = true;
    }
}

/* Checks blocks of a batch that were read straight into their slots. */
static void landed_in_place(void *ctx, uint32_t first, uint32_t count)
{
    read_batch *rb = ctx;
    for (uint32_t i = first; i < first + count; i++) {
        kvhi_xfer *x = &rb->xs[i];
        x->err = 0;
        uint32_t crc = kvhi_crc32c(0, kvhi_slot_addr(rb->e, x->dst_tier, x->dst_slot), rb->e->disk->block_bytes);
        verify_read(rb->e, x, kvhi_disk_lane_slot(rb->lane, i), crc);
        rb->finished[i] = true;
    }
}

/* Reads a batch whose blocks all go to host memory in the disk's form
 * straight into their slots: no staging copy, only the checksum pass.
 * False when that path does not apply. */
static bool read_batch_in_place(kvh_engine *e, kvhi_disk_lane *lane, kvhi_xfer *xs, uint32_t k, const uint32_t *slots,
                                int *res)
{
    uint8_t *dsts[64];
    for (uint32_t i = 0; i < k; i++) {
        if (xs[i].src_tier != KVH_TIER_DISK || xs[i].dst_tier == KVHI_NO_TIER || !reads_into_host(e, &xs[i]))
            return false;
        dsts[i] = kvhi_slot_addr(e, xs[i].dst_tier, xs[i].dst_slot);
    }
    read_batch rb = {e, xs, lane, {0}};
    if (kvhi_disk_read_scatter(e->disk, lane, k, slots, dsts, res, landed_in_place, &rb) != 0)
        return false;
    for (uint32_t i = 0; i < k; i++)
        if (!rb.finished[i])
            xs[i].err = res[i] ? res[i] : -EIO;
    return true;
}

typedef struct write_batch {
    kvh_engine *e;
    kvhi_xfer *xs;
    kvhi_disk_lane *lane;
    uint8_t *const *srcs;
} write_batch;

/* The checksums and headers of a run of a batch, just before it is
 * submitted: the runs before it are already on their way. */
static void checksum_run(void *ctx, uint32_t first, uint32_t count)
{
    write_batch *wb = ctx;
    kvhi_disk *d = wb->e->disk;
    for (uint32_t i = first; i < first + count; i++) {
        kvhi_xfer *x = &wb->xs[i];
        x->data_crc = kvhi_crc32c(0, wb->srcs[i], d->block_bytes);
        encode_slot_header(d, x, kvhi_disk_lane_slot(wb->lane, i));
    }
}

/* Writes a batch whose blocks all sit in host memory in the disk's form
 * straight from their slots (stable: in flight or being copied): only
 * the header is staged, the data costs one checksum pass and no copy,
 * each run's while the runs before it are written. False when that path
 * does not apply. */
static bool write_batch_in_place(kvh_engine *e, kvhi_disk_lane *lane, kvhi_xfer *xs, uint32_t k, const uint32_t *slots,
                                 int *res)
{
    kvhi_disk *d = e->disk;
    uint8_t *srcs[64];
    if (!kvhi_disk_lane_vectored(lane))
        return false; /* checked first: the checksums below would be wasted */
    for (uint32_t i = 0; i < k; i++) {
        kvhi_xfer *x = &xs[i];
        bool host = x->src_tier == KVH_TIER_HOST || e->device_host_addressable;
        if (!host || e->tiers[x->src_tier].encoded != e->tiers[KVH_TIER_DISK].encoded ||
            d->block_bytes % KVHI_DISK_ALIGN)
            return false;
        srcs[i] = kvhi_slot_addr(e, x->src_tier, x->src_slot);
        if ((uintptr_t)srcs[i] % KVHI_DISK_ALIGN)
            return false;
    }
    write_batch wb = {e, xs, lane, srcs};
    if (kvhi_disk_write_gather_prepared(d, lane, k, slots, srcs, res, checksum_run, &wb) != 0)
        return false;
    for (uint32_t i = 0; i < k; i++)
        xs[i].err = res[i];
    return true;
}

static void xfer_batch(kvh_engine *e, kvhi_xfer *xs, uint32_t n)
{
    kvhi_disk *d = e->disk;
    if (n == 1 && read_one_direct(e, &xs[0]))
        return;
    /* A slot being rewritten may have been freed by a DEL record that is
     * still in memory: the record goes to the file before the new data. */
    if (n && xs[0].dst_tier == KVH_TIER_DISK) {
        int rc = kvhi_index_flush(d);
        if (rc != 0) {
            for (uint32_t i = 0; i < n; i++)
                xs[i].err = rc;
            return;
        }
    }
    for (uint32_t done = 0; done < n;) {
        kvhi_disk_lane *lane = kvhi_disk_lane_get(d);
        if (!lane) {
            for (; done < n; done++)
                xs[done].err = -ENOMEM;
            return;
        }
        uint32_t k = n - done < d->lane_blocks ? n - done : d->lane_blocks;
        uint32_t slots[64];
        int res[64];
        if (k > 64)
            k = 64;
        bool write = xs[done].dst_tier == KVH_TIER_DISK; /* else a read (or a verify) */
        for (uint32_t i = 0; i < k; i++)
            slots[i] = write ? xs[done + i].dst_slot : xs[done + i].src_slot;
        /* Each block's sample is its own submission's time (kvh.h), not
         * the whole batch's, nor the wait for a lane. */
        uint64_t t0 = kvhi_now_ns();
        if (write ? write_batch_in_place(e, lane, xs + done, k, slots, res)
                  : read_batch_in_place(e, lane, xs + done, k, slots, res)) {
            kvhi_latency_record_xfers(&e->latency, xs + done, k, kvhi_now_ns() - t0);
            kvhi_disk_lane_put(d, lane);
            done += k;
            continue;
        }
        int staged[64] = {0};
        for (uint32_t i = 0; write && i < k; i++)
            staged[i] = stage_write(e, &xs[done + i], kvhi_disk_lane_slot(lane, i));
        t0 = kvhi_now_ns();
        read_batch rb = {e, xs + done, lane, {0}};
        if (write)
            kvhi_disk_write_staged(d, lane, k, slots, res);
        else
            kvhi_disk_read_staged(d, lane, k, slots, res, read_arrived, &rb);
        for (uint32_t i = 0; i < k; i++) {
            if (rb.finished[i])
                continue;
            kvhi_xfer *x = &xs[done + i];
            /* A block that could not be staged failed, whatever the write
             * of its slot did: the move is abandoned and the slot freed. */
            x->err = staged[i] ? staged[i] : res[i];
            if (!write && res[i] == 0)
                finish_read(e, x, kvhi_disk_lane_slot(lane, i));
        }
        kvhi_latency_record_xfers(&e->latency, xs + done, k, kvhi_now_ns() - t0);
        kvhi_disk_lane_put(d, lane);
        done += k;
    }
}

void kvhi_xfer_batch(kvh_engine *e, kvhi_xfer *xs, uint32_t n)
{
    kvhi_assert_unlocked(e);
    xfer_batch(e, xs, n);
    /* A read that met the end of its slab file (cut while the engine ran)
     * is damage, not an I/O error that may pass: handled as a failed
     * check, the block is dropped, rather than kept and failing every
     * read of it until the next open's scan. */
    for (uint32_t i = 0; i < n; i++)
        if (xs[i].err == -ENODATA && xs[i].src_tier == KVH_TIER_DISK) {
            xs[i].err = 1;
            xs[i].why = "its slab file ends before the slot (truncated)";
        }
}

void kvhi_xfer_run(kvh_engine *e, kvhi_xfer *x)
{
    kvhi_assert_unlocked(e);
    if (x->in_place)
        return;
    if (x->src_tier != KVH_TIER_DISK && x->dst_tier != KVH_TIER_DISK) {
        x->err = kvhi_block_copy(e, x->dst_tier, kvhi_slot_addr(e, x->dst_tier, x->dst_slot), x->src_tier,
                                 kvhi_slot_addr(e, x->src_tier, x->src_slot)) == 0
                     ? 0
                     : -EIO;
        return;
    }
    kvhi_xfer_batch(e, x, 1);
}
