/* The disk tier inside the engine: opening and locking a store, recovery
 * of its index into cached blocks, transfers to and from disk with
 * verification, clean copies and persistence. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/crc32c.h"
#include "core/disk_index.h"
#include "core/engine.h"
#include "core/move.h"

static kvh_status lock_store(kvhi_disk *d)
{
    d->lock_fd = openat(d->dir_fd, "LOCK", O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (d->lock_fd < 0)
        return kvhi_fail(KVH_ERR_IO, "cannot create %s/LOCK: %s", d->path, strerror(errno));
    if (flock(d->lock_fd, LOCK_EX | LOCK_NB) != 0) {
        char pid[32] = "";
        ssize_t n = pread(d->lock_fd, pid, sizeof(pid) - 1, 0);
        pid[n > 0 ? n : 0] = '\0';
        pid[strcspn(pid, "\n")] = '\0';
        close(d->lock_fd);
        d->lock_fd = -1;
        return kvhi_fail(KVH_ERR_BUSY, "store %s is open in process %s", d->path, pid[0] ? pid : "(unknown)");
    }
    char pid[32];
    int len = snprintf(pid, sizeof(pid), "%ld\n", (long)getpid());
    if (ftruncate(d->lock_fd, 0) != 0 || pwrite(d->lock_fd, pid, (size_t)len, 0) != len)
        return kvhi_fail(KVH_ERR_IO, "cannot write %s/LOCK: %s", d->path, strerror(errno));
    return KVH_OK;
}

static void disk_free(kvhi_disk *d)
{
    if (!d)
        return;
    kvhi_disk_close(d);
    if (d->rec_bytes)
        kvhi_index_close(d);
    if (d->lock_fd >= 0)
        close(d->lock_fd); /* releases the flock */
    if (d->dir_fd >= 0)
        close(d->dir_fd);
    free(d->path);
    free(d);
}

kvh_status kvhi_disk_tier_open(kvh_engine *e, const kvh_config *cfg, const char *path)
{
    kvhi_disk *d = calloc(1, sizeof(*d));
    if (!d)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for the disk tier");
    d->dir_fd = d->lock_fd = d->journal_fd = -1;
    d->path = strdup(path);
    e->disk = d;
    if (!d->path)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for the disk tier");
    if (mkdir(path, 0755) != 0 && errno != EEXIST)
        return kvhi_fail(KVH_ERR_IO, "cannot create %s: %s", path, strerror(errno));
    d->dir_fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (d->dir_fd < 0)
        return kvhi_fail(KVH_ERR_IO, "cannot open %s: %s", path, strerror(errno));
    kvh_status st = lock_store(d);
    if (st != KVH_OK)
        return st;
    /* The KV codec is part of the stored form: a store written with another
     * codec is a geometry mismatch. Slots hold the tier's (encoded) form. */
    uint64_t data_bytes = e->tiers[KVH_TIER_DISK].slot_bytes;
    d->geo = (kvhi_disk_geometry){cfg->num_layers, cfg->num_kv_heads, cfg->head_dim, cfg->block_tokens,
                                  cfg->dtype | cfg->kv_codec << 16, cfg->model_salt, data_bytes};
    d->block_bytes = data_bytes;
    d->queue_depth = cfg->disk_queue_depth;
    d->strict_index = cfg->disk_strict_index != 0;
    d->max_lanes = cfg->migration_threads + 4;
    uint64_t slot_bytes = KVHI_SLOT_HEADER_BYTES + kvhi_round_up(data_bytes, KVHI_DISK_ALIGN);
    uint64_t slots = cfg->disk_bytes / slot_bytes;
    if (slots == 0)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "disk_bytes %llu holds no block slot of %llu bytes",
                         (unsigned long long)cfg->disk_bytes, (unsigned long long)slot_bytes);
    if (slots > UINT32_MAX / 2)
        slots = UINT32_MAX / 2;
    d->n_slots = (uint32_t)slots;
    int rc = kvhi_disk_open_slabs(d, !(cfg->disk_flags & KVH_DISK_BUFFERED));
    if (rc != 0)
        return kvhi_fail(rc == -ENOSPC ? KVH_ERR_NOSPACE : KVH_ERR_IO, "cannot open slab files in %s: %s", path,
                         strerror(-rc));
    char msg[256];
    int ir = kvhi_index_load(d, false, &e->disk_recovery, msg, sizeof(msg));
    if (ir == KVHI_INDEX_MISMATCH || ir == KVHI_INDEX_CORRUPT) {
        if (!(cfg->disk_flags & KVH_DISK_RESET_ON_MISMATCH))
            return kvhi_fail(ir == KVHI_INDEX_MISMATCH ? KVH_ERR_MISMATCH : KVH_ERR_CORRUPT,
                             "%s (set KVH_DISK_RESET_ON_MISMATCH to start it empty)", msg);
        kvhi_log(e, KVH_LOG_WARN, "%s: starting an empty store", msg);
        kvhi_index_close(d);
        ir = kvhi_index_load(d, true, &e->disk_recovery, msg, sizeof(msg));
    }
    if (ir != KVHI_INDEX_OK)
        return kvhi_fail(KVH_ERR_IO, "%s", msg);
    if (d->warning[0])
        kvhi_log(e, KVH_LOG_WARN, "%s", d->warning);
    kvhi_tier *t = &e->tiers[KVH_TIER_DISK];
    if (kvhi_slot_pool_init(&t->slots, d->n_slots) != 0)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for disk slot lists");
    t->present = true;
    return KVH_OK;
}

static kvh_status snapshot(kvh_engine *e);

/* Turns the recovered index entries into cached, unreferenced blocks on
 * disk (called once the block table exists). */
kvh_status kvhi_disk_tier_recover(kvh_engine *e)
{
    kvhi_index_list *l = &e->disk_recovery;
    kvhi_tier *t = &e->tiers[KVH_TIER_DISK];
    uint32_t bt = e->cfg.block_tokens;
    uint8_t *used = calloc(t->slots.capacity ? t->slots.capacity : 1, 1);
    if (!used)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory recovering the disk index");
    e->stats.corrupt_blocks += l->bad_records + l->bad_slots;
    for (size_t i = 0; i < l->n; i++) {
        kvhi_index_entry *ent = &l->items[i];
        if (ent->slot >= t->slots.capacity || used[ent->slot] || ent->n_tokens != bt ||
            kvhi_prefix_find(&e->prefix, ent->hash) != KVHI_PREFIX_MISS || e->block_free_top == 0) {
            /* A duplicate or unusable record: forget it. */
            kvhi_index_append(e->disk, KVHI_REC_DEL, ent->slot, ent->hash, ent->parent, ent->n_tokens,
                              ent->data_crc, ent->tokens);
            continue;
        }
        used[ent->slot] = 1;
        uint32_t b = e->block_free[--e->block_free_top];
        kvhi_block *blk = &e->blocks[b];
        uint32_t gen = blk->gen, gen_hi = blk->gen_hi;
        memset(blk, 0, sizeof(*blk));
        blk->gen = gen;
        blk->gen_hi = gen_hi;
        blk->flags = KVHI_BF_LIVE | KVHI_BF_HASHED | KVHI_BF_KV_COMPLETE | KVHI_BF_JOURNALED | KVHI_BF_DISK_HASHED;
        blk->deferred_slot = KVHI_NO_BLOCK;
        blk->ext_refs = 0;
        blk->heap_pos = blk->quota_heap_pos = KVHI_HEAP_NONE;
        blk->tier = KVH_TIER_DISK;
        blk->slot = ent->slot;
        blk->disk_copy = KVHI_NO_BLOCK;
        blk->n_tokens = (uint16_t)bt;
        blk->hash = ent->hash;
        blk->parent_hash = ent->parent;
        blk->data_crc = ent->data_crc;
        memcpy(kvhi_block_tokens(e, b), ent->tokens, sizeof(int32_t) * bt);
        kvhi_block_try_publish(e, b);
        kvhi_block_update_evictable(e, b);
        e->stats.blocks_allocated++;
    }
    /* Rebuild the free list without the recovered slots, lowest first. */
    kvhi_slot_pool *p = &t->slots;
    p->free_count = 0;
    for (uint32_t s = p->capacity; s-- > 0;)
        if (!used[s])
            p->free_stack[p->free_count++] = s;
    free(used);
    bool rewrite = l->rewrite;
    if (rewrite)
        kvhi_log(e, KVH_LOG_WARN, "%s", l->note);
    kvhi_index_list_free(l);
    /* The damaged files are replaced at once, so the next open reads a
     * sound index instead of scanning again. */
    return rewrite ? snapshot(e) : KVH_OK;
}

/* Every block whose index record names a disk slot, for a snapshot. */
static kvh_status snapshot(kvh_engine *e)
{
    uint32_t bt = e->cfg.block_tokens;
    size_t n = 0;
    for (uint32_t b = 0; b < e->block_cap; b++)
        n += (e->blocks[b].flags & (KVHI_BF_LIVE | KVHI_BF_JOURNALED)) == (KVHI_BF_LIVE | KVHI_BF_JOURNALED);
    kvhi_index_entry *ents = calloc(n ? n : 1, sizeof(*ents));
    if (!ents)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory writing the disk index");
    size_t k = 0;
    for (uint32_t b = 0; b < e->block_cap; b++) {
        kvhi_block *blk = &e->blocks[b];
        if ((blk->flags & (KVHI_BF_LIVE | KVHI_BF_JOURNALED)) != (KVHI_BF_LIVE | KVHI_BF_JOURNALED))
            continue;
        ents[k++] = (kvhi_index_entry){.slot = blk->tier == KVH_TIER_DISK ? blk->slot : blk->disk_copy,
                                       .hash = blk->hash,
                                       .parent = blk->parent_hash,
                                       .n_tokens = bt,
                                       .data_crc = blk->data_crc,
                                       .tokens = kvhi_block_tokens(e, b)};
    }
    int rc = kvhi_disk_sync_slabs(e->disk);
    if (rc == 0)
        rc = kvhi_index_compact(e->disk, ents, k);
    free(ents);
    return rc == 0 ? KVH_OK : kvhi_fail(KVH_ERR_IO, "cannot write the disk index: %s", strerror(-rc));
}

kvh_status kvhi_disk_tier_close(kvh_engine *e, bool flush)
{
    if (!e->disk)
        return KVH_OK;
    kvh_status st = KVH_OK;
    if (flush && e->disk->rec_bytes && e->tiers[KVH_TIER_DISK].present && !e->disk->fatal)
        st = snapshot(e);
    else if (e->disk->rec_bytes)
        kvhi_index_flush(e->disk); /* best effort: what was recorded so far */
    kvhi_index_list_free(&e->disk_recovery);
    disk_free(e->disk);
    e->disk = NULL;
    return st;
}

/* ---- transfers ---- */

void kvhi_xfer_prepare(kvh_engine *e, uint32_t b, uint32_t dst_tier, uint32_t dst_slot, kvhi_xfer *x)
{
    kvhi_block *blk = &e->blocks[b];
    x->block = b;
    x->src_tier = blk->tier;
    x->src_slot = blk->slot;
    x->dst_tier = dst_tier;
    x->dst_slot = dst_slot;
    /* Writes carry the hash when the block has one; reads expect what the
     * disk copy was written with. */
    bool hashed = dst_tier == KVH_TIER_DISK ? (blk->flags & KVHI_BF_HASHED) != 0
                                            : (blk->flags & KVHI_BF_DISK_HASHED) != 0;
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
}

/* The header of a slot written for x (x->data_crc already set). */
static void encode_slot_header(const kvhi_disk *d, const kvhi_xfer *x, uint8_t *staged)
{
    kvhi_slot_meta m = {.store_id = d->store_id, .slot = x->dst_slot, .offset = kvhi_disk_slot_offset(d, x->dst_slot),
                        .hash = x->hash, .parent = x->parent, .n_tokens = x->n_tokens, .data_crc = x->data_crc,
                        .flags = x->published && x->hash ? KVHI_SLOT_PUBLISHED : 0u, .geo_tag = d->geo_tag,
                        .tokens = x->tokens};
    kvhi_slot_header_encode(staged, &m, d->block_bytes);
}

static void stage_write(kvh_engine *e, kvhi_xfer *x, uint8_t *staged)
{
    kvhi_disk *d = e->disk;
    uint8_t *data = staged + KVHI_SLOT_HEADER_BYTES;
    const uint8_t *src = kvhi_slot_addr(e, x->src_tier, x->src_slot);
    bool same_form = e->tiers[x->src_tier].encoded == e->tiers[KVH_TIER_DISK].encoded;
    if (same_form && (x->src_tier == KVH_TIER_HOST || e->device_host_addressable)) {
        x->data_crc = kvhi_crc32c_copy(0, data, src, d->block_bytes);
    } else {
        kvhi_block_copy(e, KVH_TIER_DISK, data, x->src_tier, src); /* encodes if needed */
        x->data_crc = kvhi_crc32c(0, data, d->block_bytes);
    }
    encode_slot_header(d, x, staged);
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
    if (kvhi_slot_verify_crc(header, crc, d->block_bytes, d->store_id, x->src_slot,
                             kvhi_disk_slot_offset(d, x->src_slot), x->hash, e->cfg.block_tokens, NULL,
                             &x->why) != 0)
        x->err = 1;
}

static void finish_read(kvh_engine *e, kvhi_xfer *x, const uint8_t *staged)
{
    const uint8_t *data = staged + KVHI_SLOT_HEADER_BYTES;
    bool host_dst = reads_into_host(e, x);
    /* Into host memory the copy and the checksum share one pass; the slot
     * is the mover's own until it commits, so a failed check costs nothing. */
    uint32_t crc = host_dst ? kvhi_crc32c_copy(0, kvhi_slot_addr(e, x->dst_tier, x->dst_slot), data, e->disk->block_bytes)
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
    int rc = kvhi_disk_read_into(e->disk, lane, x->src_slot, kvhi_slot_addr(e, x->dst_tier, x->dst_slot), &crc,
                                 &header);
    if (rc == 0)
        verify_read(e, x, header, crc);
    else if (rc < 0)
        x->err = rc;
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

/* Writes a batch whose blocks all sit in host memory in the disk's form
 * straight from their slots (stable: in flight or being copied): only
 * the header is staged, the data costs one checksum pass and no copy.
 * False when that path does not apply. */
static bool write_batch_in_place(kvh_engine *e, kvhi_disk_lane *lane, kvhi_xfer *xs, uint32_t k,
                                 const uint32_t *slots, int *res)
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
    for (uint32_t i = 0; i < k; i++) {
        kvhi_xfer *x = &xs[i];
        x->data_crc = kvhi_crc32c(0, srcs[i], d->block_bytes);
        encode_slot_header(d, x, kvhi_disk_lane_slot(lane, i));
    }
    if (kvhi_disk_write_gather(d, lane, k, slots, srcs, res) != 0)
        return false;
    for (uint32_t i = 0; i < k; i++)
        xs[i].err = res[i];
    return true;
}

void kvhi_xfer_batch(kvh_engine *e, kvhi_xfer *xs, uint32_t n)
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
        if (write ? write_batch_in_place(e, lane, xs + done, k, slots, res)
                  : read_batch_in_place(e, lane, xs + done, k, slots, res)) {
            kvhi_disk_lane_put(d, lane);
            done += k;
            continue;
        }
        for (uint32_t i = 0; write && i < k; i++)
            stage_write(e, &xs[done + i], kvhi_disk_lane_slot(lane, i));
        read_batch rb = {e, xs + done, lane, {0}};
        if (write)
            kvhi_disk_write_staged(d, lane, k, slots, res);
        else
            kvhi_disk_read_staged(d, lane, k, slots, res, read_arrived, &rb);
        for (uint32_t i = 0; i < k; i++) {
            if (rb.finished[i])
                continue;
            kvhi_xfer *x = &xs[done + i];
            x->err = res[i];
            if (!write && res[i] == 0)
                finish_read(e, x, kvhi_disk_lane_slot(lane, i));
        }
        kvhi_disk_lane_put(d, lane);
        done += k;
    }
}

void kvhi_xfer_run(kvh_engine *e, kvhi_xfer *x)
{
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

static bool immutable(const kvhi_block *blk)
{
    return (blk->flags & (KVHI_BF_HASHED | KVHI_BF_KV_COMPLETE)) == (KVHI_BF_HASHED | KVHI_BF_KV_COMPLETE);
}

/* Records that slot holds b. False when the record could not be taken:
 * then b is not durable, and a persist must say so. */
static bool journal_add(kvh_engine *e, uint32_t b, uint32_t slot)
{
    kvhi_block *blk = &e->blocks[b];
    if (kvhi_index_append(e->disk, KVHI_REC_ADD, slot, blk->hash, blk->parent_hash, blk->n_tokens, blk->data_crc,
                          kvhi_block_tokens(e, b)) != 0)
        return false;
    blk->flags |= KVHI_BF_JOURNALED;
    return true;
}

void kvhi_disk_after_move(kvh_engine *e, uint32_t b, const kvhi_xfer *x, bool *keep_src_slot)
{
    kvhi_block *blk = &e->blocks[b];
    *keep_src_slot = false;
    if (x->dst_tier == KVH_TIER_DISK) {
        blk->data_crc = x->data_crc;
        if (x->hash)
            blk->flags |= KVHI_BF_DISK_HASHED;
        else
            blk->flags &= (uint16_t)~KVHI_BF_DISK_HASHED;
        if (immutable(blk) && (blk->flags & KVHI_BF_PUBLISHED))
            journal_add(e, b, x->dst_slot);
    } else if (x->src_tier == KVH_TIER_DISK) {
        if (immutable(blk) && (blk->flags & KVHI_BF_JOURNALED)) {
            /* The disk data stays valid: keep it as a clean copy so the
             * next demotion costs no write and the record stays true. */
            blk->disk_copy = x->src_slot;
            blk->flags |= KVHI_BF_DISK_COPY;
            *keep_src_slot = true;
        } else if (blk->flags & KVHI_BF_JOURNALED) {
            kvhi_index_append(e->disk, KVHI_REC_DEL, x->src_slot, blk->hash, blk->parent_hash, blk->n_tokens,
                              blk->data_crc, kvhi_block_tokens(e, b));
            blk->flags &= (uint16_t)~KVHI_BF_JOURNALED;
        }
    }
}

void kvhi_disk_keep_as_copy(kvh_engine *e, uint32_t b, const kvhi_xfer *x)
{
    kvhi_block *blk = &e->blocks[b];
    if (!x->hash || !immutable(blk) || (blk->flags & (KVHI_BF_DISK_COPY | KVHI_BF_DEAD))) {
        kvhi_release_slot(e, KVH_TIER_DISK, x->dst_slot);
        return;
    }
    blk->data_crc = x->data_crc;
    blk->disk_copy = x->dst_slot;
    blk->flags |= KVHI_BF_DISK_COPY | KVHI_BF_DISK_HASHED;
    e->stats.disk_copies_written++;
    e->stats.bytes_disk_copies_written += e->disk->block_bytes;
    if (blk->flags & KVHI_BF_PUBLISHED)
        journal_add(e, b, x->dst_slot);
}

void kvhi_disk_forget(kvh_engine *e, uint32_t b)
{
    kvhi_block *blk = &e->blocks[b];
    if (!e->disk)
        return;
    uint32_t slot = blk->tier == KVH_TIER_DISK ? blk->slot : blk->disk_copy;
    if (blk->flags & KVHI_BF_JOURNALED) {
        kvhi_index_append(e->disk, KVHI_REC_DEL, slot, blk->hash, blk->parent_hash, blk->n_tokens, blk->data_crc,
                          kvhi_block_tokens(e, b));
        blk->flags &= (uint16_t)~KVHI_BF_JOURNALED;
    }
    if (blk->flags & KVHI_BF_DISK_COPY) {
        kvhi_release_slot(e, KVH_TIER_DISK, blk->disk_copy);
        blk->flags &= (uint16_t)~KVHI_BF_DISK_COPY;
        blk->disk_copy = KVHI_NO_BLOCK;
    }
}

void kvhi_disk_verify(kvh_engine *e, const uint32_t *blocks, size_t n)
{
    kvhi_xfer *xs = malloc(sizeof(kvhi_xfer) * 64);
    if (!xs)
        return;
    for (size_t i = 0; i < n;) {
        uint32_t k = 0;
        for (; i < n && k < 64; i++) {
            kvhi_block *blk = &e->blocks[blocks[i]];
            if (blk->tier != KVH_TIER_DISK || (blk->flags & (KVHI_BF_BUSY | KVHI_BF_CORRUPT)))
                continue;
            blk->flags |= KVHI_BF_WRITING; /* stable: nothing moves or frees it */
            kvhi_block_update_evictable(e, blocks[i]);
            kvhi_xfer_prepare(e, blocks[i], KVHI_NO_TIER, 0, &xs[k]);
            xs[k].src_tier = KVH_TIER_DISK;
            k++;
        }
        if (!k)
            continue;
        kvhi_unlock_for_copy(e);
        kvhi_xfer_batch(e, xs, k);
        kvhi_relock_after_copy(e);
        for (uint32_t j = 0; j < k; j++) {
            uint32_t b = xs[j].block;
            kvhi_block *blk = &e->blocks[b];
            kvhi_block_writing_done(e, b);
            if (xs[j].err == 1)
                kvhi_mark_corrupt(e, b, xs[j].why);
            else if (xs[j].err != 0)
                blk->flags |= KVHI_BF_CORRUPT; /* unreadable: a miss as well */
            if (blk->flags & KVHI_BF_DEAD)
                kvhi_block_free_now(e, b);
            else
                kvhi_block_update_evictable(e, b);
        }
        pthread_cond_broadcast(&e->changed);
    }
    free(xs);
}

kvh_status kvhi_block_ensure_memory(kvh_engine *e, uint32_t b)
{
    kvhi_block *blk = &e->blocks[b];
    /* A block in flight may be half of a tier swap: its slot is being
     * overwritten, so wait until it settles. */
    kvhi_block_recall(e, b); /* no write-then-read-back of a block still in memory */
    while (blk->flags & KVHI_BF_IN_FLIGHT)
        kvhi_block_wait_idle(e, b);
    while (blk->tier == KVH_TIER_DISK) {
        if (blk->flags & KVHI_BF_CORRUPT)
            return kvhi_fail(KVH_ERR_CORRUPT, "block data on disk failed verification");
        if (blk->flags & KVHI_BF_BUSY) {
            kvhi_block_wait_idle(e, b);
            continue;
        }
        uint32_t to = e->tiers[KVH_TIER_HOST].present ? KVH_TIER_HOST : KVH_TIER_DEVICE;
        kvh_status st = kvhi_move_block(e, b, to, blk->agent);
        if (st == KVH_ERR_NOSPACE && e->copies_in_progress) {
            /* Every candidate is busy in another thread's copy: room comes
             * back when those end, so wait rather than fail. */
            pthread_cond_wait(&e->changed, &e->lock);
            continue;
        }
        if (st != KVH_OK)
            return st;
        while (blk->flags & KVHI_BF_IN_FLIGHT)
            kvhi_block_wait_idle(e, b);
    }
    return KVH_OK;
}

/* ---- clean copies ---- */

/* Writes clean disk copies of idle, immutable blocks that are in memory:
 * marks them WRITING (they stay readable and resident), writes them as one
 * batch without the lock, then records each copy in the journal. With
 * may_evict false only free disk slots are used. */
static kvh_status write_copies(kvh_engine *e, const uint32_t *blocks, uint32_t n, kvhi_xfer *xs, bool may_evict)
{
    kvh_status st = KVH_OK;
    uint32_t k = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t b = blocks[i], slot;
        kvhi_block *blk = &e->blocks[b];
        if ((blk->flags & (KVHI_BF_BUSY | KVHI_BF_DISK_COPY | KVHI_BF_DEAD)) || blk->tier == KVH_TIER_DISK)
            continue;
        if (may_evict) {
            if ((st = kvhi_reserve_slot(e, KVH_TIER_DISK, blk->agent, &slot)) != KVH_OK)
                break;
        } else if (kvhi_slot_pool_alloc(&e->tiers[KVH_TIER_DISK].slots, &slot) != 0) {
            break;
        }
        blk->flags |= KVHI_BF_WRITING;
        kvhi_block_update_evictable(e, b);
        kvhi_xfer_prepare(e, b, KVH_TIER_DISK, slot, &xs[k++]);
    }
    if (k) {
        kvhi_unlock_for_copy(e);
        kvhi_xfer_batch(e, xs, k);
        kvhi_relock_after_copy(e);
    }
    for (uint32_t j = 0; j < k; j++) {
        kvhi_xfer *x = &xs[j];
        kvhi_block *blk = &e->blocks[x->block];
        kvhi_block_writing_done(e, x->block);
        if (x->err != 0) {
            kvhi_release_slot(e, KVH_TIER_DISK, x->dst_slot);
            if (st == KVH_OK)
                st = kvhi_fail(x->err == -ENOSPC ? KVH_ERR_NOSPACE : KVH_ERR_IO, "writing a block to disk: %s",
                               strerror(-x->err));
        } else {
            blk->data_crc = x->data_crc;
            blk->disk_copy = x->dst_slot;
            blk->flags |= KVHI_BF_DISK_COPY | KVHI_BF_DISK_HASHED;
            e->stats.disk_copies_written++;
            e->stats.bytes_disk_copies_written += e->disk->block_bytes;
            if (!journal_add(e, x->block, x->dst_slot) && st == KVH_OK)
                st = kvhi_fail(KVH_ERR_NOMEM, "out of memory recording a block in the disk index");
        }
        if (blk->flags & KVHI_BF_DEAD)
            kvhi_block_free_now(e, x->block);
        else
            kvhi_block_update_evictable(e, x->block);
    }
    if (k)
        pthread_cond_broadcast(&e->changed);
    return st;
}

/* Background cleaning: when the host tier runs low on free slots, the
 * coldest published blocks there get clean disk copies ahead of time, so
 * the eviction that follows costs no write and never makes an acquire wait
 * for one. A clock hand walks the block table; returns true if it wrote. */
bool kvhi_disk_clean_step(kvh_engine *e)
{
    kvhi_tier *host = &e->tiers[KVH_TIER_HOST];
    if (!e->disk || e->disk->fatal || !host->present || e->tiers[KVH_TIER_DISK].slots.free_count == 0)
        return false;
    if (host->slots.free_count * 8 >= host->slots.capacity)
        return false;
    if (e->clean_epoch_seen == e->host_arrivals)
        return false; /* nothing new arrived since the last empty sweep */
    uint32_t want = e->disk->lane_blocks < 64 ? e->disk->lane_blocks : 64, n = 0, cand[64];
    for (uint32_t scanned = 0; scanned < e->block_cap && n < want; scanned++) {
        uint32_t b = e->clean_hand;
        e->clean_hand = (e->clean_hand + 1) % e->block_cap;
        kvhi_block *blk = &e->blocks[b];
        uint16_t need = KVHI_BF_LIVE | KVHI_BF_PUBLISHED | KVHI_BF_HASHED | KVHI_BF_KV_COMPLETE;
        if ((blk->flags & need) == need && blk->tier == KVH_TIER_HOST &&
            !(blk->flags & (KVHI_BF_BUSY | KVHI_BF_DISK_COPY | KVHI_BF_DEAD)) && !blk->pins)
            cand[n++] = b;
    }
    if (n == 0) {
        e->clean_epoch_seen = e->host_arrivals;
        return false;
    }
    kvhi_xfer *xs = malloc(sizeof(kvhi_xfer) * n);
    if (!xs)
        return false;
    write_copies(e, cand, n, xs, false);
    free(xs);
    kvhi_clear_error();
    return true;
}

/* ---- persistence ---- */

kvh_status kvhi_disk_persist(kvh_engine *e, kvhi_seq *s)
{
    if (!e->disk)
        return kvhi_fail(KVH_ERR_UNSUPPORTED, "the engine has no disk tier (set disk_path and disk_bytes)");
    uint32_t bt = e->cfg.block_tokens;
    uint32_t n_full = (uint32_t)(s->n_tokens / bt);
    uint32_t *todo = malloc(sizeof(uint32_t) * (n_full ? n_full : 1));
    kvhi_xfer *xs = malloc(sizeof(kvhi_xfer) * 64);
    if (!todo || !xs) {
        free(todo);
        free(xs);
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for persist");
    }
    kvh_status st = KVH_OK;
    uint32_t n_todo = 0;
    /* Choose, for each full block, the published block of that prefix; a
     * reference keeps it from vanishing. Blocks are not held: holding a
     * long sequence would pin memory other callers need. One may move
     * while others are prepared, so rounds repeat until each is recorded. */
    for (uint32_t i = 0; i < n_full && st == KVH_OK; i++) {
        uint32_t b = s->blocks[i];
        kvhi_block *blk = &e->blocks[b];
        if (!(blk->flags & KVHI_BF_KV_COMPLETE)) {
            st = kvhi_fail(KVH_ERR_INVALID_ARG, "block %u of the sequence has KV that was never written", i);
            break;
        }
        kvhi_block_try_publish(e, b);
        if (!(blk->flags & KVHI_BF_PUBLISHED)) {
            uint32_t twin = kvhi_prefix_find(&e->prefix, blk->hash);
            if (twin != KVHI_PREFIX_MISS)
                b = twin;
        }
        e->blocks[b].refs++;
        todo[n_todo++] = b;
    }
    uint32_t batch[64];
    bool all_recorded = false;
    for (int round = 0; round < 16 && st == KVH_OK && !all_recorded; round++) {
        for (uint32_t i = 0; i < n_todo && st == KVH_OK;) {
            uint32_t n = 0;
            while (i < n_todo && n < 64 && st == KVH_OK) {
                uint32_t b = todo[i++];
                kvhi_block *blk = &e->blocks[b];
                kvhi_block_wait_idle(e, b);
                if (blk->flags & KVHI_BF_JOURNALED)
                    continue;
                bool on_disk = blk->tier == KVH_TIER_DISK || (blk->flags & KVHI_BF_DISK_COPY);
                if (on_disk && (blk->flags & KVHI_BF_DISK_HASHED)) {
                    if (!journal_add(e, b, blk->tier == KVH_TIER_DISK ? blk->slot : blk->disk_copy))
                        st = kvhi_fail(KVH_ERR_NOMEM, "out of memory recording a block in the disk index");
                    continue;
                }
                /* Spilled before it had its hash: rewrite it with one. */
                if ((st = kvhi_block_ensure_memory(e, b)) != KVH_OK)
                    break;
                kvhi_block_wait_idle(e, b);
                batch[n++] = b;
            }
            kvh_status wst = write_copies(e, batch, n, xs, true);
            if (st == KVH_OK)
                st = wst;
        }
        all_recorded = true;
        for (uint32_t i = 0; i < n_todo; i++)
            all_recorded &= (e->blocks[todo[i]].flags & KVHI_BF_JOURNALED) != 0;
    }
    if (st == KVH_OK && !all_recorded)
        st = kvhi_fail(KVH_ERR_BUSY, "blocks of the sequence kept moving; not all of them were made durable");
    if (st == KVH_OK)
        e->stats.blocks_persisted += n_todo;
    if (st == KVH_OK) {
        /* Data first, then the records that point at it. */
        pthread_mutex_unlock(&e->lock);
        int rc = kvhi_disk_sync_slabs(e->disk);
        if (rc == 0)
            rc = kvhi_index_sync(e->disk);
        pthread_mutex_lock(&e->lock);
        if (rc == -ENOSPC && !e->disk->fatal)
            st = kvhi_fail(KVH_ERR_NOSPACE, "the disk is full: the index records of the persisted blocks could "
                                            "not be written (they stay pending)");
        else if (rc != 0)
            st = kvhi_fail(KVH_ERR_IO, "fsync of the disk tier failed (%s); the store accepts no more writes",
                           strerror(-rc));
    }
    /* Keep replay time bounded: fold a long journal into a new snapshot. */
    if (st == KVH_OK && e->disk->journal_records > 4096 &&
        e->disk->journal_records > 2 * (uint64_t)kvhi_slot_pool_used(&e->tiers[KVH_TIER_DISK].slots))
        st = snapshot(e);
    for (uint32_t i = 0; i < n_todo; i++)
        kvhi_block_unref(e, todo[i]);
    free(todo);
    free(xs);
    return st;
}
