/* The durable index of the disk tier: which slot holds which prefix
 * block. A snapshot (`index`) replaced atomically plus an append-only
 * `journal`; see disk_format.h for the record format. */
#ifndef KVH_CORE_DISK_INDEX_H
#define KVH_CORE_DISK_INDEX_H

#include "core/disk_io.h"

/* Live entries found by kvhi_index_load: one per slot. */
typedef struct kvhi_index_entry {
    uint32_t slot;
    uint64_t hash, parent;
    uint32_t n_tokens;
    uint32_t data_crc;
    int32_t *tokens; /* block_tokens entries, owned by the list */
} kvhi_index_entry;

typedef struct kvhi_index_list {
    kvhi_index_entry *items;
    size_t n;
    int32_t *token_store;
    uint64_t bad_records; /* records and headers that failed their checksum */
    uint64_t past_end;    /* blocks named in slots past the store's size now */
    bool torn_tail;       /* the journal ends in a torn or damaged record */
    uint64_t bad_slots;   /* entries dropped by a rebuild: their slot failed its check */
    uint64_t rescued;     /* blocks a rebuild took from their slot headers alone */
    uint64_t unvouched;   /* intact slots a rebuild left out: nothing vouched for them */
    bool rewrite;         /* the index was rebuilt: write a snapshot right away */
    char note[512];       /* what was damaged and rebuilt, for the log */
    char damage[96];      /* the first damage that d->strict_index refuses
                             (KVHI_INDEX_CORRUPT), when not set; "" when none */
    int io_err;           /* with KVHI_INDEX_IO: the -errno behind it (-ENOMEM, a
                             full disk), 0 when there is none */
} kvhi_index_list;

enum kvhi_index_result {
    KVHI_INDEX_OK = 0,
    KVHI_INDEX_MISMATCH = -1, /* geometry or model differs; see msg */
    KVHI_INDEX_CORRUPT = -2,  /* damaged, and d->strict_index is set */
    KVHI_INDEX_IO = -3
};

/* Loads (or, when absent or reset, creates) the index of the store in
 * d->dir_fd for geometry d->geo. Sets d->store_id. On success the caller
 * owns *out (kvhi_index_list_free).
 *
 * Damage -- a header or record failing its checksum, a snapshot shorter
 * than its header says, a journal ending in records that fail (a torn
 * append or rot), a missing index or journal beside slab files -- is
 * rebuilt from the slot headers (every slot read and checked in full,
 * data included): an entry is kept when its slot checks out and holds
 * its block, and a slot no intact record names is taken back when its
 * header says it was published, by a store of this geometry (see
 * disk_format.h). The store id is the index header's when that verifies,
 * else the journal header's, else the one most such slots carry. With
 * d->strict_index, damage fails the load instead (KVHI_INDEX_CORRUPT),
 * except a torn journal tail, which is cut as after any crash. */
int kvhi_index_load(kvhi_disk *d, bool reset, kvhi_index_list *out, char *msg, size_t msg_len);
void kvhi_index_list_free(kvhi_index_list *l);

/* Appends one record to memory (not yet in the file, not durable): cheap,
 * so it may be called under the engine lock. 0 or -errno. */
int kvhi_index_append(kvhi_disk *d, uint32_t kind, uint32_t slot, uint64_t hash, uint64_t parent, uint32_t n_tokens,
                      uint32_t data_crc, const int32_t *tokens);
/* Writes the appended records to the journal file, in order (not yet
 * durable). Call without the engine lock: it does disk I/O. Call before
 * writing block data, so a slot's DEL record reaches the file before the
 * slot's new contents do. 0 or -errno (then fatal). */
int kvhi_index_flush(kvhi_disk *d);
/* Makes every appended record durable. 0 or -errno (then fatal). */
int kvhi_index_sync(kvhi_disk *d);
/* Writes a new snapshot holding exactly `entries` and empties the journal,
 * each step atomic. 0 or -errno. */
int kvhi_index_compact(kvhi_disk *d, const kvhi_index_entry *entries, size_t n);
void kvhi_index_close(kvhi_disk *d);

#endif
