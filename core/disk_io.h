/* Disk tier files and block I/O.
 *
 * Slots live in preallocated slab files (slab-NNNN.kvh) under one
 * directory. I/O goes through "lanes": each lane owns an io_uring ring and
 * a staging arena registered with it as a fixed buffer, so a batch of
 * neighbouring slots becomes one large O_DIRECT write or read. Where
 * io_uring is refused the lane uses pread/pwrite, and where the filesystem
 * refuses O_DIRECT the files are opened buffered (with a warning). */
#ifndef KVH_CORE_DISK_IO_H
#define KVH_CORE_DISK_IO_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "core/disk_format.h"
#include "core/store_locks.h"

typedef struct kvhi_disk_lane kvhi_disk_lane;

/* Test-only fault hooks (see tests): called before each kind of system
 * call; a non-zero return is used as a negative errno instead of calling. */
enum kvhi_disk_op { KVHI_OP_WRITE, KVHI_OP_READ, KVHI_OP_FSYNC, KVHI_OP_RENAME, KVHI_OP_DIRSYNC, KVHI_OP_COUNT };
typedef int (*kvhi_disk_fault_fn)(enum kvhi_disk_op op, void *user);

typedef struct kvhi_disk {
    char *path;
    int dir_fd;
    int lock_fd;
    kvhi_store_lock held; /* dir_fd and lock_fd, while they hold the store's lock */
    bool pid_in_lock;     /* LOCK names this process: emptied at close */
    uint64_t store_id;
    kvhi_disk_geometry geo;
    uint32_t geo_tag; /* kvhi_disk_geometry_tag(&geo), for slot headers */
    uint64_t block_bytes;
    uint64_t slot_bytes; /* header + data padded to the alignment */
    uint32_t n_slots;
    uint32_t slots_per_slab;
    uint32_t n_slabs;
    int *slab_fds;
    /* Per slab: writes done (counted once each is in) and the count a
     * finished fdatasync covered. A persist syncs only slabs written past
     * their last sync: its cost follows what was written, not the
     * store's size. Every slab starts with one write to sync. */
    struct kvhi_slab_sync {
        _Atomic uint64_t written, synced;
    } * slab_sync;
    bool direct;
    /* An fsync or journal write failed: nothing written since is trusted.
     * Atomic: set by writers outside the engine lock, read under it. */
    _Atomic bool fatal;
    /* A slab fsync failed: what its slots hold since is not known to be on
     * disk, and no index may name them (close then writes none). */
    _Atomic bool slabs_untrusted;
    bool read_only;      /* inspection: never create, truncate or write */
    uint32_t disk_flags; /* kvh_disk_flags of the config (modes: core/disk_access.h) */
    /* A damaged index or journal fails the open (kvh_config
     * disk_strict_index) instead of being rebuilt from the slot headers. */
    bool strict_index;
    /* Bytes the slab files held before this open: 0 for a new store, where
     * a missing index is no loss and needs no scan. */
    uint64_t slab_bytes_found;
    /* The store was made larger than disk_bytes gives now (its slab files
     * hold whole slots more): a clean close trims it. A cut last slot, or a
     * stray slab file past the store, is not that. */
    bool made_larger;
    uint32_t failed_slab; /* the slab whose open or sizing failed, for the message */
    uint32_t queue_depth;
    uint32_t lane_blocks; /* blocks one lane can stage at once */

    pthread_mutex_t lane_lock;
    pthread_cond_t lane_free;
    kvhi_disk_lane **lanes;
    uint32_t n_lanes, max_lanes;

    char warning[256]; /* set at open when O_DIRECT or io_uring is missing */
    /* Set when the slab files were left sparse: the file system had too
     * little room to preallocate them (kvhi_disk_size_slabs). */
    char space_warning[256];

    /* index: snapshot + journal (disk_index.c) */
    /* Records are appended to `pending` under the engine lock (a memcpy)
     * and written to the journal file by kvhi_index_flush without it, so
     * a slow disk never stalls callers holding the engine lock. Flushes
     * are serialised by journal_lock, so records reach the file in order. */
    pthread_mutex_t journal_lock;
    pthread_mutex_t pending_lock;
    uint8_t *pending, *flushing;
    size_t pending_len, pending_cap, flushing_cap;
    int journal_fd;
    uint64_t next_seq;
    uint64_t journal_records;
    uint64_t journal_generation; /* advanced each time a fold replaces the journal */
    uint64_t fold_retry_at;      /* journal records before a failed fold is tried again */
    uint32_t rec_bytes;
} kvhi_disk;

/* Bytes a slot holds after its header: the block's stored form rounded
 * up to whole pages. */
static inline uint64_t kvhi_disk_slot_data_bytes(const kvhi_disk *d) { return d->slot_bytes - KVHI_SLOT_HEADER_BYTES; }
/* The most slots of slot_bytes one slab file holds: 1 GiB of them, or one
 * where a slot is larger. */
static inline uint64_t kvhi_disk_slab_slots(uint64_t slot_bytes)
{
    uint64_t per = (1ull << 30) / slot_bytes;
    return per ? per : 1;
}

/* Why the disk lanes would run without io_uring (its setup refused, as a
 * seccomp filter or kernel.io_uring_disabled does, or its buffers not
 * registrable), written into why; NULL when a ring works. Lanes are made
 * on first use, so this is asked at open, where it can be logged; the
 * answer is the process's first (kvhi_disk_ring_probe asks anew). */
const char *kvhi_disk_ring_unavailable(char *why, size_t len);
const char *kvhi_disk_ring_probe(const kvhi_disk *d, char *why, size_t len);
/* Opens (creating) the slab files of a store with n_slots slots under an
 * already locked directory, as they are. Returns 0 or -errno. */
int kvhi_disk_open_slabs(kvhi_disk *d, bool allow_direct);
/* Grows each slab file to its slots, once the store's index is this
 * engine's: preallocated where the file system can hold them all and
 * keep some room free (a twentieth of its size, up to 1 GiB), else sparse
 * (space_warning says so). Returns 0 or -errno. */
int kvhi_disk_size_slabs(kvhi_disk *d);
void kvhi_disk_close(kvhi_disk *d);

/* Takes a lane for exclusive use (waits when all are busy). */
kvhi_disk_lane *kvhi_disk_lane_get(kvhi_disk *d);
void kvhi_disk_lane_put(kvhi_disk *d, kvhi_disk_lane *lane);
/* True when the lane can move data straight to and from the caller's
 * memory (read_scatter, write_gather, read_into): it has io_uring. */
bool kvhi_disk_lane_vectored(const kvhi_disk_lane *lane);
/* Staging memory for block i of a batch: header then data. */
uint8_t *kvhi_disk_lane_slot(kvhi_disk_lane *lane, uint32_t i);

/* Writes the n staged slots (lane_slot(lane, i) already holds header and
 * data) to slots[i]. results[i] = 0 or -errno. */
void kvhi_disk_write_staged(kvhi_disk *d, kvhi_disk_lane *lane, uint32_t n, const uint32_t *slots, int *results);
/* Called with the batch indexes [first, first + count) of slots that have
 * arrived in the staging, while other reads of the batch are still on
 * their way (io_uring only), so their processing overlaps that I/O. */
typedef void (*kvhi_disk_run_done_fn)(void *ctx, uint32_t first, uint32_t count);
/* Reads slots[i] into the lane's staging; results[i] = 0 or -errno. When
 * on_run is set it sees every slot that arrives early (results[i] is 0
 * for those by then); the caller handles the rest after the return. */
void kvhi_disk_read_staged(kvhi_disk *d, kvhi_disk_lane *lane, uint32_t n, const uint32_t *slots, int *results,
                           kvhi_disk_run_done_fn on_run, void *ctx);

/* Reads slots[i] with each block's data straight into dsts[i] (page
 * aligned) and its header into the lane's staging (kvhi_disk_lane_slot),
 * neighbouring slots as one request; on_run as for read_staged. 1 when
 * this path does not apply (no io_uring, unaligned, more than 64 slots):
 * use read_staged. 0 otherwise, with results[i] = 0 or -errno. */
int kvhi_disk_read_scatter(kvhi_disk *d, kvhi_disk_lane *lane, uint32_t n, const uint32_t *slots, uint8_t *const *dsts,
                           int *results, kvhi_disk_run_done_fn on_run, void *ctx);

/* Writes slots[i] with each block's data straight from srcs[i] (page
 * aligned; stable until the call returns) and its header from the lane's
 * staging (already encoded there); neighbouring slots as one request. 1
 * when this path does not apply: stage and use write_staged. */
int kvhi_disk_write_gather(kvhi_disk *d, kvhi_disk_lane *lane, uint32_t n, const uint32_t *slots, uint8_t *const *srcs,
                           int *results);
/* The same, with each run's headers (and anything else its blocks need)
 * prepared by prepare(ctx, first, count) just before that run is
 * submitted: the device writes the first runs while the later ones are
 * prepared. */
int kvhi_disk_write_gather_prepared(kvhi_disk *d, kvhi_disk_lane *lane, uint32_t n, const uint32_t *slots,
                                    uint8_t *const *srcs, int *results, kvhi_disk_run_done_fn prepare, void *ctx);

/* Reads one slot: its header into the lane's staging (*header_out) and
 * its data straight into dst, in pieces submitted together, returning the
 * data's CRC32C (computed while later pieces are still arriving). dst is
 * the caller's until it trusts the checksum. 1 when this path does not
 * apply (no io_uring, unaligned dst or block size): use read_staged. 0 or
 * -errno otherwise. */
int kvhi_disk_read_into(kvhi_disk *d, kvhi_disk_lane *lane, uint32_t slot, uint8_t *dst, uint32_t *crc_out,
                        const uint8_t **header_out);

uint64_t kvhi_disk_slot_offset(const kvhi_disk *d, uint32_t slot);
/* Gives back what a store made larger (made_larger) holds past disk_bytes
 * now: the last slab cut to its slots, slab files past it removed. Only
 * once an index naming no slot past them stands (a clean close). 0 or
 * -errno. */
int kvhi_disk_trim_slabs(kvhi_disk *d);
/* fdatasync every slab file written since its last sync, after checking
 * each slab is still in place; -errno on failure (the store turns fatal). */
int kvhi_disk_sync_slabs(kvhi_disk *d);
/* fsync of fd (data_only: fdatasync), again while a signal interrupts
 * it: EINTR says nothing about the data (it consumes no write error),
 * unlike a failed sync, which is never retried. 0 or -errno. */
int kvhi_disk_sync_fd(int fd, bool data_only);

/* Fault injection for tests; NULL disables. Process-wide. */
void kvhi_disk_set_fault_hook(kvhi_disk_fault_fn fn, void *user);
int kvhi_disk_fault(enum kvhi_disk_op op);

/* How long a lane waits on a ring that completes nothing before it
 * cancels the requests the kernel has not started and does them with
 * pread or pwrite (0: the default, 2 s). For tests. Process-wide. */
void kvhi_disk_set_stall_ns(uint64_t ns);

#endif
