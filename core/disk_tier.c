/* The disk tier inside the engine: opening and locking a store, recovery
 * of its index into cached blocks, the journal and clean-copy bookkeeping
 * after a move (hooks core/move.c calls), verification in place, clean
 * copies and persistence. The transfers themselves are core/move_xfer.c. */
#include <errno.h>
#include <signal.h>
#include <fcntl.h>
#include <stdio.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/crc32c.h"
#include "core/disk_access.h"
#include "core/disk_index.h"
#include "core/block_state.h"
#include "core/engine.h"
#include "core/move.h"
#include "core/block.h"
#include "core/tier.h"
#include "core/seq.h"
#include "core/disk_tier.h"
#include "core/remote_tier.h"

/* Another engine or reader holds the store: say which, from its LOCK. */
static kvh_status store_busy(kvhi_disk *d)
{
    char pid[32] = "";
    ssize_t n = pread(d->lock_fd, pid, sizeof(pid) - 1, 0);
    pid[n > 0 ? n : 0] = '\0';
    pid[strcspn(pid, "\n")] = '\0';
    kvhi_store_locks_hold();
    close(d->lock_fd);
    d->lock_fd = -1;
    kvhi_store_locks_let_go();
    /* Readers (kvh-store) share the lock without writing their pid:
     * the one in the file may be a writer long gone. */
    char *end = NULL;
    long owner = strtol(pid, &end, 10);
    if (!pid[0] || *end || owner <= 0 || (kill((pid_t)owner, 0) != 0 && errno == ESRCH))
        return kvhi_fail(KVH_ERR_BUSY,
                         "store %s is open elsewhere: a reader such as kvh-store, or an engine (in this process or "
                         "another) whose LOCK file was replaced",
                         d->path);
    return kvhi_fail(KVH_ERR_BUSY, "store %s is open in process %s", d->path, pid);
}

static kvh_status lock_store(kvhi_disk *d)
{
    kvhi_store_locks_hold();
    d->lock_fd = kvhi_store_openat_as_found(d, "LOCK", O_RDWR | O_CREAT);
    kvhi_store_locks_let_go();
    if (d->lock_fd < 0)
        return kvhi_fail(KVH_ERR_IO, "cannot create %s/LOCK: %s", d->path, kvhi_store_file_error(d->lock_fd));
    /* The directory is locked as well as LOCK: a LOCK file deleted under
     * a running engine (a cleaner of old files) would let the next one
     * create and lock a new file, and two engines would write one store. */
    if (flock(d->dir_fd, LOCK_EX | LOCK_NB) != 0)
        return store_busy(d);
    if (flock(d->lock_fd, LOCK_EX | LOCK_NB) != 0) {
        flock(d->dir_fd, LOCK_UN);
        return store_busy(d);
    }
    char pid[32];
    int len = snprintf(pid, sizeof(pid), "%ld\n", (long)getpid());
    if (ftruncate(d->lock_fd, 0) != 0 || pwrite(d->lock_fd, pid, (size_t)len, 0) != len)
        return kvhi_fail(KVH_ERR_IO, "cannot write %s/LOCK: %s", d->path, strerror(errno));
    d->pid_in_lock = true;
    return KVH_OK;
}

static void disk_free(kvhi_disk *d)
{
    if (!d)
        return;
    kvhi_disk_close(d);
    if (d->rec_bytes)
        kvhi_index_close(d);
    kvhi_store_locks_hold();
    if (d->lock_fd >= 0) {
        /* A pid left in LOCK outlives the hold: while a reader (kvh-store)
         * holds the store later, a refused open would name this process,
         * still running, as the store's holder. */
        if (d->pid_in_lock && ftruncate(d->lock_fd, 0) != 0) {
            /* left as it is: the pid then only misleads a message */
        }
        /* A process forked while the engine was open shares this open file
         * and its flock: unlock it for both, not only close ours. */
        flock(d->lock_fd, LOCK_UN);
        close(d->lock_fd);
        d->lock_fd = -1;
    }
    if (d->dir_fd >= 0) {
        flock(d->dir_fd, LOCK_UN); /* as LOCK's */
        close(d->dir_fd);
        d->dir_fd = -1;
    }
    kvhi_store_locks_let_go();
    kvhi_store_lock_remove(&d->held);
    free(d->path);
    free(d);
}

static bool count_descriptor(const char *name, void *ctx)
{
    *(uint64_t *)ctx += name[0] != '.';
    return false;
}

/* Descriptors the process has open now; 64 when /proc cannot say
 * (listed without allocating: kvhi_dir_find). */
static uint64_t descriptors_open(void)
{
    int fd = open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return 64;
    uint64_t n = 0;
    if (kvhi_dir_find(fd, count_descriptor, &n) < 0)
        n = 64;
    close(fd);
    return n > 0 ? n - 1 : 0; /* less the one just opened */
}

/* Every slab file stays open while the engine is: a disk_bytes that needs
 * more of them than the process may open failed midway ("Too many open
 * files"), leaving thousands of empty slab files behind. Where the hard
 * limit allows, the soft one is raised to what the slabs need; past it,
 * the open is refused before the store's directory is touched. */
static kvh_status check_slab_files(kvh_engine *e, const kvh_config *cfg, uint64_t slots, uint64_t slot_bytes)
{
    uint64_t per = kvhi_disk_slab_slots(slot_bytes);
    uint64_t slabs = (slots + per - 1) / per;
    /* Beside the slabs: the index, journal, lock and directory, a ring per
     * disk lane, what the process holds already, and a margin for the
     * rest (remote connections, files the caller opens meanwhile). */
    uint64_t own = 8 + cfg->migration_threads + 4, in_use = descriptors_open(), margin = 16;
    uint64_t need = slabs + own + in_use + margin;
    struct rlimit lim;
    if (getrlimit(RLIMIT_NOFILE, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY || need <= lim.rlim_cur)
        return KVH_OK;
    if (lim.rlim_max == RLIM_INFINITY || need <= lim.rlim_max) {
        rlim_t was = lim.rlim_cur;
        lim.rlim_cur = (rlim_t)need;
        if (setrlimit(RLIMIT_NOFILE, &lim) == 0) {
            kvhi_log(e, KVH_LOG_INFO,
                     "disk tier: disk_bytes %llu keeps %llu slab files open: the open-file limit (RLIMIT_NOFILE) "
                     "is raised from %llu to %llu",
                     (unsigned long long)cfg->disk_bytes, (unsigned long long)slabs, (unsigned long long)was,
                     (unsigned long long)need);
            return KVH_OK;
        }
    }
    return kvhi_fail(KVH_ERR_INVALID_ARG,
                     "disk_bytes %llu needs %llu slab files (of at most 1 GiB each, all kept open), more than this "
                     "process may open (RLIMIT_NOFILE %llu, hard limit %llu, with %llu descriptors open already, "
                     "%llu more for the disk tier's own files and %llu spare): give a smaller disk_bytes or raise "
                     "the hard limit",
                     (unsigned long long)cfg->disk_bytes, (unsigned long long)slabs, (unsigned long long)lim.rlim_cur,
                     (unsigned long long)lim.rlim_max, (unsigned long long)in_use, (unsigned long long)own,
                     (unsigned long long)margin);
}

kvh_status kvhi_disk_tier_open(kvh_engine *e, const kvh_config *cfg, const char *path)
{
    /* Slots hold the tier's (encoded) form. */
    uint64_t data_bytes = e->tiers[KVH_TIER_DISK].slot_bytes;
    uint64_t slot_bytes = KVHI_SLOT_HEADER_BYTES + kvhi_round_up(data_bytes, KVHI_DISK_ALIGN);
    uint64_t slots = cfg->disk_bytes / slot_bytes;
    if (slots > UINT32_MAX / 2)
        slots = UINT32_MAX / 2;
    kvh_status cst = check_slab_files(e, cfg, slots, slot_bytes);
    if (cst == KVH_OK)
        cst = kvhi_check_record_memory(e, slots, "give a smaller disk_bytes, or a larger block_tokens");
    if (cst != KVH_OK)
        return cst;
    kvhi_disk *d = calloc(1, sizeof(*d));
    if (!d)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for the disk tier");
    d->dir_fd = d->lock_fd = d->journal_fd = -1;
    kvhi_store_lock_add(&d->held, &d->dir_fd, &d->lock_fd);
    d->path = strdup(path);
    e->disk = d;
    if (!d->path)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for the disk tier");
    d->disk_flags = cfg->disk_flags;
    kvh_status st = kvhi_store_open_dir(d, path);
    if (st != KVH_OK)
        return st;
    st = lock_store(d);
    if (st == KVH_OK)
        st = kvhi_store_set_modes(d);
    if (st != KVH_OK)
        return st;
    /* The KV codec is part of the stored form: a store written with another
     * codec is a geometry mismatch. */
    d->geo = (kvhi_disk_geometry){
        cfg->num_layers, cfg->num_kv_heads, cfg->head_dim, cfg->block_tokens, cfg->dtype | cfg->kv_codec << 16,
        cfg->model_salt, data_bytes};
    d->block_bytes = data_bytes;
    d->queue_depth = cfg->disk_queue_depth;
    d->strict_index = cfg->disk_strict_index != 0;
    d->max_lanes = cfg->migration_threads + 4;
    if (slots == 0)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "disk_bytes %llu holds no block slot of %llu bytes",
                         (unsigned long long)cfg->disk_bytes, (unsigned long long)slot_bytes);
    d->n_slots = (uint32_t)slots;
    int rc = kvhi_disk_open_slabs(d, !(cfg->disk_flags & KVH_DISK_BUFFERED));
    if (rc != 0)
        return rc == -ENOMEM ? kvhi_fail(KVH_ERR_NOMEM, "out of memory opening the slab files in %s", path)
                             : kvhi_fail(kvhi_io_status(rc), "cannot open slab file %s/slab-%04u.kvh: %s", path,
                                         d->failed_slab, kvhi_store_file_error(rc));
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
    if (ir != KVHI_INDEX_OK) /* out of memory, a full disk: said as such */
        return kvhi_fail(e->disk_recovery.io_err ? kvhi_io_status(e->disk_recovery.io_err) : KVH_ERR_IO, "%s", msg);
    /* Only once the store is known to be this engine's: an open refused
     * above (another geometry, damage under strict) leaves the slab files
     * it found as they were and makes none. The O_DIRECT probe runs again
     * on the sized files. */
    rc = kvhi_disk_size_slabs(d);
    if (rc != 0)
        return kvhi_fail(kvhi_io_status(rc), "cannot size slab files in %s: %s", path, strerror(-rc));
    if (d->warning[0])
        kvhi_log(e, KVH_LOG_WARN, "%s", d->warning);
    char no_ring[256];
    if (kvhi_disk_ring_unavailable(no_ring, sizeof(no_ring)))
        kvhi_log(e, KVH_LOG_WARN, "%s", no_ring);
    if (d->space_warning[0])
        kvhi_log(e, KVH_LOG_WARN, "%s", d->space_warning);
    kvhi_tier *t = &e->tiers[KVH_TIER_DISK];
    if (kvhi_slot_pool_init(&t->slots, d->n_slots) != 0)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for disk slot lists");
    e->disk_copy_list = malloc(sizeof(uint32_t) * d->n_slots);
    e->disk_copy_at = malloc(sizeof(uint32_t) * d->n_slots);
    if (!e->disk_copy_list || !e->disk_copy_at)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for disk slot lists");
    t->present = true;
    return KVH_OK;
}

static kvh_status snapshot(kvh_engine *e);
static bool journal_long(const kvh_engine *e);
static void fold_journal(kvh_engine *e, const char *when);

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
        /* Records can be forged with valid CRCs: hash 0 names no block. */
        if (ent->slot >= t->slots.capacity || used[ent->slot] || ent->n_tokens != bt || ent->hash == 0 ||
            kvhi_block_find_published(e, ent->hash, ent->parent, ent->tokens) != KVHI_PREFIX_MISS ||
            e->block_free_top == 0) {
            /* A duplicate or unusable record: forget it. */
            kvhi_index_append(e->disk, KVHI_REC_DEL, ent->slot, ent->hash, ent->parent, ent->n_tokens, ent->data_crc,
                              ent->tokens);
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
        blk->tolerance = KVH_TOLERANCE_DEFAULT; /* not stored: as a new block's */
        memcpy(kvhi_block_tokens(e, b), ent->tokens, sizeof(int32_t) * bt);
        kvhi_block_try_publish(e, b);
        kvhi_block_update_evictable(e, b);
        e->stats.blocks_allocated++;
    }
    /* Rebuild the free list without the recovered slots, lowest first. */
    kvhi_slot_pool *p = &t->slots;
    kvhi_slot_pool_take_all(p);
    for (uint32_t s = p->capacity; s-- > 0;)
        if (!used[s])
            kvhi_slot_pool_free(p, s);
    free(used);
    bool rewrite = l->rewrite;
    if (l->note[0]) /* a rebuild, or what a strict open gave up */
        kvhi_log(e, KVH_LOG_WARN, "%s", l->note);
    if (l->past_end)
        kvhi_log(e, KVH_LOG_WARN,
                 "disk tier: %s: %" PRIu64 " blocks lay in slots past the %u that disk_bytes gives now (the store "
                 "was larger): they are dropped (open it with its earlier disk_bytes before this engine closes to keep "
                 "them; a clean close cuts the slab files to disk_bytes)",
                 e->disk->path, l->past_end, t->slots.capacity);
    kvhi_index_list_free(l);
    /* The damaged files are replaced at once, so the next open reads a
     * sound index instead of scanning again. */
    if (rewrite)
        return snapshot(e);
    /* A journal grown long before a crash (blocks passing through the
     * disk tier, no close to fold it) is folded now, not carried on. */
    if (journal_long(e))
        fold_journal(e, "open");
    return KVH_OK;
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
    return rc == 0 ? KVH_OK : kvhi_fail(kvhi_io_status(rc), "cannot write the disk index: %s", strerror(-rc));
}

/* Keeps replay time and the journal's size bounded: a journal past 4096
 * records and twice the blocks on disk is folded into a new snapshot,
 * whether the records came from persists or from blocks passing through
 * the disk tier. A fold that failed is tried again once the journal has
 * grown by as much again. */
static bool journal_long(const kvh_engine *e)
{
    const kvhi_disk *d = e->disk;
    return d && !d->fatal && !d->read_only && d->journal_records > 4096 &&
           d->journal_records > 2 * (uint64_t)kvhi_slot_pool_used(&e->tiers[KVH_TIER_DISK].slots);
}

/* A persist tries again at once (its records are synced, the moment is
 * its own); other calls after the journal has grown by as much again. */
static bool journal_fold_due(const kvh_engine *e)
{
    return journal_long(e) && e->disk->journal_records >= e->disk->fold_retry_at;
}

static void note_journal_growth(kvh_engine *e)
{
    if (journal_fold_due(e))
        e->disk_fold_due = true;
}

/* Folds a journal due for it (the lock held); the caller's own failure
 * detail is kept. The blocks are durable without it: a fold that fails
 * fails nothing. */
static void fold_journal(kvh_engine *e, const char *when)
{
    kvhi_error_kept kept;
    kvhi_error_keep(&kept);
    if (snapshot(e) == KVH_OK) {
        e->disk->fold_retry_at = 0;
    } else {
        e->disk->fold_retry_at = 2 * e->disk->journal_records;
        kvhi_log_later(e, KVH_LOG_WARN, "%s: the journal could not be folded into a new index (%s); kept as it is",
                       when, kvhi_last_error());
    }
    kvhi_error_put_back(&kept);
}

void kvhi_disk_fold_journal(kvh_engine *e)
{
    e->disk_fold_due = false;
    if (e->closing || !journal_fold_due(e))
        return;
    /* The slabs' fdatasyncs, most of a fold's time, run without the lock
     * (this call still counts as active: close waits for it); the
     * snapshot then syncs only what was written meanwhile. Writing the
     * index and the new journal stays under the lock, as a persist's
     * fold does. */
    kvhi_disk *d = e->disk;
    pthread_mutex_unlock(&e->lock);
    int rc = kvhi_disk_sync_slabs(d);
    pthread_mutex_lock(&e->lock);
    if (rc != 0)
        kvhi_log_later(e, KVH_LOG_WARN, "disk tier: syncing the slab files to fold the journal failed (%s)",
                       strerror(-rc));
    else if (!e->closing && journal_fold_due(e))
        fold_journal(e, "disk tier");
}

kvh_status kvhi_disk_tier_close(kvh_engine *e, bool flush)
{
    if (!e->disk)
        return KVH_OK;
    kvh_status st = KVH_OK;
    bool snapshot_due = flush && e->disk->rec_bytes && e->tiers[KVH_TIER_DISK].present;
    if (snapshot_due && e->disk->slabs_untrusted) {
        /* The index stays as it was: a new one would name slots whose
         * data a failed fsync may have lost. */
        kvhi_index_flush(e->disk);
        st = kvhi_fail(KVH_ERR_IO,
                       "the disk index was not rewritten: a slab file failed to sync, or was removed or replaced "
                       "while open");
    } else if (snapshot_due) {
        /* After a fatal journal failure (the journal removed, a write that
         * failed half way) the engine's own state is still whole: a new
         * index written from it keeps every block made durable before, and
         * the journal's damaged tail no longer matters. Where even that
         * cannot be written (the directory gone), close says so. */
        e->disk->fatal = false;
        st = snapshot(e);
        /* The index names no slot past disk_bytes now: a store opened
         * smaller than it was made gives the rest of its files back. */
        if (st == KVH_OK)
            kvhi_disk_trim_slabs(e->disk);
    } else if (e->disk->rec_bytes)
        kvhi_index_flush(e->disk); /* best effort: what was recorded so far */
    kvhi_index_list_free(&e->disk_recovery);
    disk_free(e->disk);
    e->disk = NULL;
    free(e->disk_copy_list);
    free(e->disk_copy_at);
    e->disk_copy_list = e->disk_copy_at = NULL;
    return st;
}

static bool immutable(const kvhi_block *blk)
{
    return (blk->flags & (KVHI_BF_HASHED | KVHI_BF_KV_COMPLETE)) == (KVHI_BF_HASHED | KVHI_BF_KV_COMPLETE);
}

/* Records that slot holds b: 0, or -errno when the record could not be
 * taken (then b is not durable, and a persist must say so). */
static int journal_add(kvh_engine *e, uint32_t b, uint32_t slot)
{
    kvhi_block *blk = &e->blocks[b];
    int rc = kvhi_index_append(e->disk, KVHI_REC_ADD, slot, blk->hash, blk->parent_hash, blk->n_tokens, blk->data_crc,
                               kvhi_block_tokens(e, b));
    if (rc == 0)
        blk->flags |= KVHI_BF_JOURNALED;
    note_journal_growth(e);
    return rc;
}

/* A persist's failure to record a block, as kvh.h names it: no memory for
 * the record, or a store that takes no records any more (KVH_ERR_IO). */
static kvh_status journal_add_failed(int rc)
{
    if (rc == -ENOMEM)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory recording a block in the disk index");
    return kvhi_fail(KVH_ERR_IO,
                     "the disk index takes no more records (an earlier write or sync of the store failed, or its "
                     "journal, directory or a slab file was removed while open): %s",
                     strerror(-rc));
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
        if (immutable(blk) && (blk->flags & KVHI_BF_PUBLISHED)) {
            journal_add(e, b, x->dst_slot);
            kvhi_remote_queue_upload(e, b, KVH_REMOTE_UPLOAD_DEMOTE);
        }
    } else if (x->src_tier == KVH_TIER_DISK) {
        if (immutable(blk) && (blk->flags & KVHI_BF_JOURNALED)) {
            /* The disk data stays valid: keep it as a clean copy so the
             * next demotion costs no write and the record stays true. */
            kvhi_disk_copy_set(e, b, x->src_slot);
            *keep_src_slot = true;
        } else if (blk->flags & KVHI_BF_JOURNALED) {
            kvhi_index_append(e->disk, KVHI_REC_DEL, x->src_slot, blk->hash, blk->parent_hash, blk->n_tokens,
                              blk->data_crc, kvhi_block_tokens(e, b));
            blk->flags &= (uint16_t)~KVHI_BF_JOURNALED;
            note_journal_growth(e);
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
    kvhi_disk_copy_set(e, b, x->dst_slot);
    blk->flags |= KVHI_BF_DISK_HASHED;
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
        note_journal_growth(e);
    }
    if (blk->flags & KVHI_BF_DISK_COPY)
        kvhi_release_slot(e, KVH_TIER_DISK, kvhi_disk_copy_clear(e, b));
}

void kvhi_disk_copy_set(kvh_engine *e, uint32_t b, uint32_t slot)
{
    kvhi_block *blk = &e->blocks[b];
    blk->disk_copy = slot;
    blk->flags |= KVHI_BF_DISK_COPY;
    e->disk_copy_at[slot] = (uint32_t)e->disk_copy_count;
    e->disk_copy_list[e->disk_copy_count++] = b;
}

uint32_t kvhi_disk_copy_clear(kvh_engine *e, uint32_t b)
{
    kvhi_block *blk = &e->blocks[b];
    uint32_t slot = blk->disk_copy;
    blk->disk_copy = KVHI_NO_BLOCK;
    blk->flags &= (uint16_t)~KVHI_BF_DISK_COPY;
    /* The last copy of the list takes its place. */
    uint32_t at = e->disk_copy_at[slot], last = e->disk_copy_list[--e->disk_copy_count];
    e->disk_copy_list[at] = last;
    if (last != b)
        e->disk_copy_at[e->blocks[last].disk_copy] = at;
    return slot;
}

size_t kvhi_disk_verify(kvh_engine *e, const uint32_t *blocks, size_t n)
{
    size_t good = n; /* blocks before the first that failed */
    kvhi_xfer *xs = malloc(sizeof(kvhi_xfer) * 64);
    if (!xs) {
        /* Nothing read: the blocks up to the first still on disk (or
         * corrupt) need no check, the rest are a miss, not damage. */
        size_t in_memory = 0;
        while (in_memory < n && e->blocks[blocks[in_memory]].tier != KVH_TIER_DISK &&
               !(e->blocks[blocks[in_memory]].flags & KVHI_BF_CORRUPT))
            in_memory++;
        return in_memory;
    }
    for (size_t i = 0; i < n;) {
        uint32_t k = 0;
        for (; i < n && k < 64; i++) {
            kvhi_block *blk = &e->blocks[blocks[i]];
            if ((blk->flags & KVHI_BF_CORRUPT) && good > i)
                good = i;
            if (blk->tier != KVH_TIER_DISK || kvhi_block_busy(blk) || (blk->flags & KVHI_BF_CORRUPT))
                continue;
            kvhi_block_move_event(blk, KVHI_EV_COPY_BEGIN); /* stable: nothing moves or frees it */
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
            if (xs[j].err != 0) {
                for (size_t at = 0; at < good; at++)
                    if (blocks[at] == b)
                        good = at;
            }
            /* Damage is recorded; a read that failed (an I/O error, no
             * memory) is a miss this time only: the data may be intact,
             * and a block persisted durable must not vanish for good. */
            if (xs[j].err == 1)
                kvhi_mark_corrupt(e, b, xs[j].why);
            else if (xs[j].err != 0)
                kvhi_log_later(e, KVH_LOG_WARN, "disk tier: reading the block in slot %u failed (%s): a miss this time",
                               xs[j].src_slot, strerror(xs[j].err < 0 ? -xs[j].err : EIO));
            if (blk->flags & KVHI_BF_DEAD)
                kvhi_block_free_now(e, b);
            else
                kvhi_block_update_evictable(e, b);
        }
        pthread_cond_broadcast(&e->changed);
    }
    free(xs);
    return good;
}

/* ---- clean copies ---- */

bool kvhi_disk_give_back_copy(kvh_engine *e)
{
    /* A clock hand over the blocks with copies: a full disk asks again and
     * again, and each call starts where the last one stopped. */
    for (uint64_t k = 0; k < e->disk_copy_count; k++) {
        if (e->copy_give_back_hand >= e->disk_copy_count)
            e->copy_give_back_hand = 0;
        uint32_t b = e->disk_copy_list[e->copy_give_back_hand++];
        const kvhi_block *blk = &e->blocks[b];
        /* Any reference keeps it: a caller's, a persist's or an upload's. */
        if ((blk->flags & (KVHI_BF_LIVE | KVHI_BF_DISK_COPY | KVHI_BF_DEAD)) != (KVHI_BF_LIVE | KVHI_BF_DISK_COPY) ||
            blk->tier == KVH_TIER_DISK || blk->refs || kvhi_block_busy(blk))
            continue;
        kvhi_disk_forget(e, b);
        e->stats.disk_copies_given_back++;
        kvhi_disk_clean_lead(e, b); /* cleanable again once the disk has room */
        return true;
    }
    return false;
}

/* A batch of write_copies in flight, listed in e->disk_copy_batches. */
struct kvhi_disk_copy_batch {
    const kvhi_xfer *xs; /* .block is set before the batch is listed and never written after */
    uint32_t n;
    struct kvhi_disk_copy_batch *next;
};

bool kvhi_disk_copying_unreferenced(kvh_engine *e, uint32_t tier, uint32_t agent)
{
    for (const struct kvhi_disk_copy_batch *c = e->disk_copy_batches; c; c = c->next)
        for (uint32_t j = 0; j < c->n; j++) {
            const kvhi_block *blk = &e->blocks[c->xs[j].block];
            if (!kvhi_block_referenced(e, blk, c->xs[j].block) && blk->tier == tier &&
                (agent == KVHI_NO_BLOCK || blk->agent == agent) && kvhi_move_state(blk) == KVHI_MS_COPYING &&
                !(blk->flags & KVHI_BF_DEAD))
                return true;
        }
    return false;
}

/* Writes clean disk copies of idle, immutable blocks that are in memory:
 * marks them WRITING (they stay readable and resident), writes them as one
 * batch without the lock, then records each copy in the journal. With
 * may_evict false only free disk slots are used. */
static bool wants_copy(const kvhi_block *blk)
{
    return !kvhi_block_busy(blk) && !(blk->flags & (KVHI_BF_DISK_COPY | KVHI_BF_DEAD)) && blk->tier != KVH_TIER_DISK;
}

/* A full filesystem is known only by the writes it refuses: the slab
 * grows on demand, so free slots in the pool do not mean free bytes. */
#define DISK_FULL_REST_MIN_MS 10
#define DISK_FULL_REST_MAX_MS 1000

void kvhi_disk_note_write(kvh_engine *e, int err)
{
    if (err == 0) {
        e->disk_full_until = 0;
        e->disk_full_rest_ms = 0;
    } else if (kvhi_err_disk_full(err)) {
        uint32_t ms = e->disk_full_rest_ms ? 2 * e->disk_full_rest_ms : DISK_FULL_REST_MIN_MS;
        e->disk_full_rest_ms = ms < DISK_FULL_REST_MAX_MS ? ms : DISK_FULL_REST_MAX_MS;
        e->disk_full_until = kvhi_now_ns() + (uint64_t)e->disk_full_rest_ms * 1000000u;
    }
}

/* After a refusal, retrying at once would fail the same way: the workers
 * would spin on it, and a caller that finds no idle victim while copies
 * are in flight waits for them (kvhi_reserve_slot): for ever, when the
 * workers keep restarting copies of the same blocks.
 * Room may come back (the filesystem grows, files elsewhere go, a freed
 * slot is written by an eviction): a later try, or any write that works,
 * ends the rest. */
static bool disk_resting_full(kvh_engine *e) { return e->disk_full_until && kvhi_now_ns() < e->disk_full_until; }

static kvh_status write_copies(kvh_engine *e, const uint32_t *blocks, uint32_t n, kvhi_xfer *xs, bool may_evict)
{
    kvh_status st = KVH_OK;
    uint32_t k = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t b = blocks[i], slot;
        kvhi_block *blk = &e->blocks[b];
        if (!wants_copy(blk))
            continue;
        if (may_evict) {
            if ((st = kvhi_reserve_slot(e, KVH_TIER_DISK, blk->agent, &slot)) != KVH_OK)
                break;
            /* The reservation may have waited without the lock: the block
             * may have started a move or gained a disk copy (another
             * persist) since. Callers hold a reference, so it is still
             * the same block. */
            if (!wants_copy(blk)) {
                kvhi_release_slot(e, KVH_TIER_DISK, slot);
                continue;
            }
        } else if (kvhi_slot_pool_alloc(&e->tiers[KVH_TIER_DISK].slots, &slot) != 0) {
            break;
        }
        kvhi_block_move_event(blk, KVHI_EV_COPY_BEGIN);
        kvhi_block_update_evictable(e, b);
        kvhi_xfer_prepare(e, b, KVH_TIER_DISK, slot, &xs[k++]);
        e->disk_copies_writing++;
    }
    if (k) {
        struct kvhi_disk_copy_batch listed = {xs, k, e->disk_copy_batches};
        e->disk_copy_batches = &listed;
        kvhi_unlock_for_copy(e);
        kvhi_xfer_batch(e, xs, k);
        kvhi_relock_after_copy(e);
        struct kvhi_disk_copy_batch **at = &e->disk_copy_batches;
        while (*at != &listed)
            at = &(*at)->next;
        *at = listed.next;
    }
    bool wrote = false, refused = false;
    for (uint32_t j = 0; j < k; j++) {
        kvhi_xfer *x = &xs[j];
        kvhi_block *blk = &e->blocks[x->block];
        kvhi_block_writing_done(e, x->block);
        e->disk_copies_writing--;
        if (x->err != 0) {
            kvhi_release_slot(e, KVH_TIER_DISK, x->dst_slot);
            refused |= kvhi_err_disk_full(x->err);
            /* Refused for space: tried again after the rest. Not after an
             * I/O error, which would be retried at once, for good. */
            if (kvhi_err_disk_full(x->err))
                kvhi_disk_clean_lead(e, x->block);
            if (st == KVH_OK)
                st = kvhi_fail(kvhi_io_status(x->err), "writing a block to disk: %s", strerror(-x->err));
        } else {
            wrote = true;
            blk->data_crc = x->data_crc;
            kvhi_disk_copy_set(e, x->block, x->dst_slot);
            blk->flags |= KVHI_BF_DISK_HASHED;
            e->stats.disk_copies_written++;
            e->stats.bytes_disk_copies_written += e->disk->block_bytes;
            int rc = journal_add(e, x->block, x->dst_slot);
            if (rc != 0 && st == KVH_OK)
                st = journal_add_failed(rc);
        }
        if (blk->flags & KVHI_BF_DEAD)
            kvhi_block_free_now(e, x->block);
        else
            kvhi_block_update_evictable(e, x->block);
    }
    if (wrote)
        kvhi_disk_note_write(e, 0);
    if (refused)
        kvhi_disk_note_write(e, -ENOSPC);
    if (k)
        pthread_cond_broadcast(&e->changed);
    return st;
}

/* Background cleaning: when the host tier runs low on free slots,
 * published host blocks get clean disk copies ahead of time, so the
 * eviction that follows costs no write and never makes an acquire wait
 * for one. Candidates come from the leads (core/disk_tier.h) and from a
 * clock hand over the block table, paid for by the leads. */
static bool clean_has_leads(const kvh_engine *e) { return e->clean_leads_len || e->clean_scan_credit; }

uint64_t kvhi_disk_clean_resumes_ns(kvh_engine *e)
{
    if (!e->disk || e->disk->fatal || !e->tiers[KVH_TIER_HOST].present || !disk_resting_full(e) ||
        !kvhi_disk_host_runs_low(e) || !clean_has_leads(e))
        return 0;
    return e->disk_full_until;
}

static bool cleanable(const kvh_engine *e, uint32_t b)
{
    const kvhi_block *blk = &e->blocks[b];
    uint16_t need = KVHI_BF_LIVE | KVHI_BF_PUBLISHED | KVHI_BF_HASHED | KVHI_BF_KV_COMPLETE;
    return b < e->block_cap && (blk->flags & need) == need && blk->tier == KVH_TIER_HOST && wants_copy(blk) &&
           !blk->pins;
}

/* Adds b to cand[0..*n) when cleanable and not there yet (a block may be
 * a lead twice, and the hand may meet a lead). */
static void clean_consider(const kvh_engine *e, uint32_t b, uint32_t *cand, uint32_t *n)
{
    if (!cleanable(e, b))
        return;
    for (uint32_t i = 0; i < *n; i++)
        if (cand[i] == b)
            return;
    cand[(*n)++] = b;
}

bool kvhi_disk_clean_step(kvh_engine *e)
{
    kvhi_tier *host = &e->tiers[KVH_TIER_HOST];
    if (!e->disk || e->disk->fatal || !host->present || e->tiers[KVH_TIER_DISK].slots.free_count == 0)
        return false;
    if (!kvhi_disk_host_runs_low(e) || disk_resting_full(e) || !clean_has_leads(e))
        return false;
    /* No more than the disk has free slots for: a candidate taken
     * without one would lose its lead. */
    uint32_t want = e->disk->lane_blocks < 64 ? e->disk->lane_blocks : 64, n = 0, cand[64];
    if (want > e->tiers[KVH_TIER_DISK].slots.free_count)
        want = (uint32_t)e->tiers[KVH_TIER_DISK].slots.free_count;
    while (e->clean_leads_len && n < want) {
        uint32_t b = e->clean_leads[e->clean_leads_head];
        e->clean_leads_head = (e->clean_leads_head + 1) % KVHI_CLEAN_LEADS;
        e->clean_leads_len--;
        clean_consider(e, b, cand, &n);
    }
    for (; e->clean_scan_credit && n < want; e->clean_scan_credit--) {
        uint32_t b = e->clean_hand;
        e->clean_hand = (e->clean_hand + 1) % e->block_cap;
        clean_consider(e, b, cand, &n);
    }
    if (n == 0)
        return false;
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
    uint32_t n_full = (uint32_t)(s->n_tokens / e->cfg.block_tokens);
    uint32_t *twins = malloc(sizeof(uint32_t) * (n_full ? n_full : 1));
    if (!twins)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for persist");
    kvh_status st = kvhi_disk_persist_blocks(e, s->blocks, n_full, "of the sequence", twins);
    /* A twin made durable for this sequence stays while the sequence
     * holds the block: its other holders may let it go, and a cached
     * block nothing references is the first a full tier drops. */
    kvh_status kst = kvhi_seq_keep_durable_twins(e, s, twins, n_full);
    free(twins);
    return st != KVH_OK ? st : kst;
}

kvh_status kvhi_disk_persist_blocks(kvh_engine *e, const uint32_t *blocks, uint32_t n_full, const char *whose,
                                    uint32_t *twins)
{
    if (twins)
        for (uint32_t i = 0; i < n_full; i++)
            twins[i] = KVHI_NO_BLOCK;
    if (!e->disk)
        return kvhi_fail(KVH_ERR_UNSUPPORTED, "the engine has no disk tier (set disk_path and disk_bytes)");
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
        uint32_t b = blocks[i];
        kvhi_block *blk = &e->blocks[b];
        if (!(blk->flags & KVHI_BF_KV_COMPLETE)) {
            st = kvhi_fail(KVH_ERR_INVALID_ARG, "block %u %s has KV that was never written", i, whose);
            break;
        }
        kvhi_block_try_publish(e, b);
        if (!(blk->flags & KVHI_BF_PUBLISHED)) {
            uint32_t twin = kvhi_block_find_published(e, blk->hash, blk->parent_hash, kvhi_block_tokens(e, b));
            if (twin != KVHI_PREFIX_MISS)
                b = twin;
        }
        e->blocks[b].refs++; /* dropped at the end; the victim order keeps its key */
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
                    int rc = journal_add(e, b, blk->tier == KVH_TIER_DISK ? blk->slot : blk->disk_copy);
                    if (rc != 0)
                        st = journal_add_failed(rc);
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
        if (kvhi_err_disk_full(rc) && !e->disk->fatal)
            st = kvhi_fail(KVH_ERR_NOSPACE,
                           "no room for the index records of the persisted blocks (%s): they stay pending",
                           strerror(-rc));
        else if (rc == -ENOENT)
            st = kvhi_fail(
                KVH_ERR_IO,
                "the store's directory, journal or a slab file in %s was removed or replaced while open: nothing "
                "persisted now would be found; the store accepts no more writes",
                e->disk->path);
        else if (rc != 0)
            st = kvhi_fail(KVH_ERR_IO,
                           "writing or syncing the disk tier's files failed (%s); the store accepts no more writes",
                           strerror(-rc));
    }
    if (st == KVH_OK && journal_long(e))
        fold_journal(e, "persist");
    for (uint32_t i = 0; i < n_todo; i++) {
        /* A twin made durable: its reference goes to the caller. */
        if (twins && todo[i] != blocks[i] && (e->blocks[todo[i]].flags & KVHI_BF_JOURNALED)) {
            twins[i] = todo[i];
            continue;
        }
        kvhi_block_unref(e, todo[i]);
    }
    free(todo);
    free(xs);
    return st;
}
