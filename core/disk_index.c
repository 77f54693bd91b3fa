#include "core/disk_index.h"
#include "core/disk_access.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

enum { KIND_SNAPSHOT = 1, KIND_JOURNAL = 2 };

static int read_file(const kvhi_disk *d, const char *name, uint8_t **buf, size_t *len)
{
    /* No link, nothing of another user's, nothing but a regular file; and
     * O_NONBLOCK so that a FIFO planted in the store is refused instead of
     * waited on forever (it changes nothing for a regular file). */
    int fd = kvhi_store_openat(d, name, O_RDONLY | O_NONBLOCK);
    if (fd < 0)
        return fd;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = -errno;
        close(fd);
        return e;
    }
    *len = (size_t)st.st_size;
    *buf = malloc(*len ? *len : 1);
    if (!*buf) {
        close(fd);
        return -ENOMEM;
    }
    size_t got = 0;
    while (got < *len) {
        int inj = kvhi_disk_fault(KVHI_OP_READ);
        ssize_t n = inj ? inj : read(fd, *buf + got, *len - got);
        if (n < 0 && !inj && errno == EINTR)
            continue;
        if (n <= 0) {
            int e = n < 0 ? (inj ? inj : -errno) : -EIO;
            free(*buf);
            *buf = NULL; /* callers free it again on their own paths */
            close(fd);
            return e;
        }
        got += (size_t)n;
    }
    close(fd);
    return 0;
}

static int write_all(int fd, const void *p, size_t n)
{
    const uint8_t *b = p;
    while (n) {
        int inj = kvhi_disk_fault(KVHI_OP_WRITE);
        ssize_t w = inj ? inj : write(fd, b, n);
        if (w < 0 && !inj && errno == EINTR)
            continue;
        if (w < 0)
            return inj ? inj : -errno;
        if (w == 0)
            return -ENOSPC;
        b += w;
        n -= (size_t)w;
    }
    return 0;
}

static int sync_fd(int fd)
{
    int inj = kvhi_disk_fault(KVHI_OP_FSYNC);
    if (inj)
        return inj;
    return kvhi_disk_sync_fd(fd, false);
}

static int sync_dir(kvhi_disk *d)
{
    int inj = kvhi_disk_fault(KVHI_OP_DIRSYNC);
    if (inj)
        return inj;
    return kvhi_disk_sync_fd(d->dir_fd, false);
}

/* Atomically replaces `name` with header + body: temp, fsync, rename,
 * fsync of the directory. */
/* *renamed (may be NULL) is set once the new file stands under name. */
static int replace_file(kvhi_disk *d, const char *name, const void *header, const void *body, size_t body_len,
                        bool *renamed)
{
    char tmp[64];
    snprintf(tmp, sizeof(tmp), "%s.tmp", name);
    /* whatever stands there, a link included, or an empty directory */
    if (unlinkat(d->dir_fd, tmp, 0) != 0 && errno == EISDIR)
        unlinkat(d->dir_fd, tmp, AT_REMOVEDIR);
    int fd = kvhi_store_openat(d, tmp, O_WRONLY | O_CREAT | O_EXCL);
    if (fd < 0)
        return fd;
    int rc = write_all(fd, header, KVHI_DISK_ALIGN);
    if (rc == 0 && body_len)
        rc = write_all(fd, body, body_len);
    if (rc == 0)
        rc = sync_fd(fd);
    close(fd);
    if (rc == 0) {
        int inj = kvhi_disk_fault(KVHI_OP_RENAME);
        rc = inj ? inj : (renameat(d->dir_fd, tmp, d->dir_fd, name) == 0 ? 0 : -errno);
        if (rc == 0 && renamed)
            *renamed = true;
    }
    if (rc == 0)
        rc = sync_dir(d);
    if (rc != 0)
        unlinkat(d->dir_fd, tmp, 0);
    return rc;
}

static int open_journal(kvhi_disk *d, bool truncate_to, off_t keep)
{
    d->journal_fd = kvhi_store_openat(d, "journal", O_RDWR);
    if (d->journal_fd < 0)
        return d->journal_fd;
    if (truncate_to && ftruncate(d->journal_fd, keep) != 0)
        return -errno;
    if (lseek(d->journal_fd, 0, SEEK_END) < 0)
        return -errno;
    return 0;
}

static int fresh_journal(kvhi_disk *d)
{
    uint8_t hdr[KVHI_DISK_ALIGN];
    kvhi_index_header h = {.kind = KIND_JOURNAL, .store_id = d->store_id, .seq = d->next_seq, .geo = d->geo};
    kvhi_index_header_encode(hdr, &h);
    if (d->journal_fd >= 0) {
        close(d->journal_fd);
        d->journal_fd = -1;
    }
    int rc = replace_file(d, "journal", hdr, NULL, 0, NULL);
    if (rc == 0)
        rc = open_journal(d, false, 0);
    d->journal_records = 0;
    d->journal_generation++;
    return rc;
}

static const char *geo_diff(const kvhi_disk_geometry *a, const kvhi_disk_geometry *b)
{
    if (a->num_layers != b->num_layers)
        return "num_layers";
    if (a->num_kv_heads != b->num_kv_heads)
        return "num_kv_heads";
    if (a->head_dim != b->head_dim)
        return "head_dim";
    if (a->block_tokens != b->block_tokens)
        return "block_tokens";
    /* The field holds the dtype and, above bit 16, the KV codec
     * (core/disk_tier.c). */
    if ((a->dtype & 0xffffu) != (b->dtype & 0xffffu))
        return "dtype";
    if (a->dtype >> 16 != b->dtype >> 16)
        return "kv_codec";
    if (a->model_salt != b->model_salt)
        return "model_salt";
    if (a->block_bytes != b->block_bytes)
        return "block size";
    return NULL;
}

/* Slot -> index of the live entry in a dense table (UINT32_MAX = none). */
typedef struct live_map {
    uint32_t *at;
    kvhi_index_entry *items;
    int32_t *tokens;
    size_t n;
} live_map;

static void live_put(live_map *m, const kvhi_index_rec *r, uint32_t bt)
{
    uint32_t s = (uint32_t)r->slot;
    if (m->at[s] == UINT32_MAX)
        m->at[s] = (uint32_t)m->n++;
    kvhi_index_entry *e = &m->items[m->at[s]];
    e->slot = s;
    e->hash = r->hash;
    e->parent = r->parent;
    e->n_tokens = r->n_tokens;
    e->data_crc = r->data_crc;
    e->tokens = m->tokens + (size_t)m->at[s] * bt;
    memcpy(e->tokens, r->tokens, sizeof(int32_t) * bt);
}

static void live_del(live_map *m, const kvhi_index_rec *r, uint32_t bt)
{
    uint32_t s = (uint32_t)r->slot, i = m->at[s];
    if (i == UINT32_MAX || m->items[i].hash != r->hash)
        return;
    /* Move the last entry into the hole to keep the table dense; its
     * tokens move into the hole's storage. */
    uint32_t last = (uint32_t)--m->n;
    if (i != last) {
        int32_t *keep = m->tokens + (size_t)i * bt;
        memcpy(keep, m->items[last].tokens, sizeof(int32_t) * bt);
        m->items[i] = m->items[last];
        m->items[i].tokens = keep;
        m->at[m->items[i].slot] = i;
    }
    m->at[s] = UINT32_MAX;
}

static void new_store_id(kvhi_disk *d)
{
    if (getrandom(&d->store_id, sizeof(d->store_id), 0) != sizeof(d->store_id))
        d->store_id = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
}

/* A new (or reset) store: random id, empty snapshot, empty journal. */
static int create_store(kvhi_disk *d, kvhi_index_list *out, char *msg, size_t msg_len)
{
    new_store_id(d);
    d->next_seq = 1;
    uint8_t hdr[KVHI_DISK_ALIGN];
    kvhi_index_header h = {.kind = KIND_SNAPSHOT, .store_id = d->store_id, .seq = 0, .geo = d->geo};
    kvhi_index_header_encode(hdr, &h);
    /* The journal first: a crash between the two leaves a new store's
     * empty journal alone, which reads as a creation cut short, while an
     * index without its journal is always damage (the journal may have
     * held every record of a store never folded into its index). A reset
     * removes the old index before anything: cut short there, the old
     * journal alone is damage (or an empty store's), never the old index
     * served beside a new journal. */
    int rc = unlinkat(d->dir_fd, "index", 0) == 0 || errno == ENOENT ? 0 : -errno;
    if (rc == 0)
        rc = sync_dir(d);
    if (rc == 0)
        rc = fresh_journal(d);
    if (rc == 0)
        rc = replace_file(d, "index", hdr, NULL, 0, NULL);
    if (rc != 0) {
        snprintf(msg, msg_len, "cannot create the index in %s: %s", d->path, strerror(-rc));
        out->io_err = rc;
        return KVHI_INDEX_IO;
    }
    return KVHI_INDEX_OK;
}

/* What a load found wrong with the index files. */
typedef struct damage {
    bool found;     /* rebuild, or refuse when strict */
    bool torn_tail; /* the journal ends in records that fail: rebuild, or cut them when strict */
    char what[96];  /* the first damage found */
} damage;

static void damaged(damage *dm, const char *what)
{
    if (!dm->found && !dm->torn_tail)
        snprintf(dm->what, sizeof(dm->what), "%s", what);
    dm->found = true;
}

/* A record naming a slot in a slab file that was not there at open (an
 * existing slab is opened before the load; missing ones are made after
 * it): its block is gone, which is damage like a record that fails. */
static void missing_slab_damage(const kvhi_disk *d, const live_map *m, damage *dm)
{
    uint32_t first = UINT32_MAX;
    size_t named = 0;
    for (size_t i = 0; i < m->n; i++) {
        uint32_t slab = m->items[i].slot / d->slots_per_slab;
        if (slab < d->n_slabs && d->slab_fds[slab] < 0) {
            named++;
            if (slab < first)
                first = slab;
        }
    }
    if (named) {
        char what[96];
        snprintf(what, sizeof(what), "slab-%04u.kvh is missing (%zu records name slots in missing slabs)", first,
                 named);
        damaged(dm, what);
    }
}

/* A slot that checks out on its own (kvhi_slot_check_alone). */
typedef struct found_slot {
    uint64_t store_id, hash, parent;
    uint32_t slot, n_tokens, data_crc, flags, geo_tag;
} found_slot;

#define SCAN_READ_BYTES (8u << 20) /* slots read at once by a rebuild */

/* pread until len bytes or the end of the file: the byte count, or -errno. */
static ssize_t read_fully(int fd, uint8_t *buf, size_t len, off_t off)
{
    size_t got = 0;
    while (got < len) {
        int inj = kvhi_disk_fault(KVHI_OP_READ);
        ssize_t n = inj ? inj : pread(fd, buf + got, len - got, off + (off_t)got);
        if (n < 0 && !inj && errno == EINTR)
            continue;
        if (n < 0)
            return inj ? inj : -errno;
        if (n == 0)
            break;
        got += (size_t)n;
    }
    return (ssize_t)got;
}

/* Reads every slot of the store and keeps those that check out on their
 * own: *n_found of them in found[], their tokens at tokens + i * bt. 0 or
 * -errno: a read error fails the load rather than rebuild the index from
 * part of the store (the damaged one stays, the open can be retried). */
static int scan_slots(kvhi_disk *d, found_slot *found, int32_t *tokens, size_t *n_found)
{
    uint32_t bt = d->geo.block_tokens;
    uint32_t per_read = (uint32_t)(SCAN_READ_BYTES / d->slot_bytes);
    if (per_read == 0)
        per_read = 1;
    uint8_t *buf;
    if (posix_memalign((void **)&buf, KVHI_DISK_ALIGN, (size_t)per_read * d->slot_bytes) != 0)
        return -ENOMEM;
    *n_found = 0;
    int rc = 0;
    for (uint32_t s = 0; s < d->n_slots && rc == 0;) {
        uint32_t slab = s / d->slots_per_slab;
        uint64_t slab_end = (uint64_t)(slab + 1) * d->slots_per_slab;
        uint32_t k = per_read;
        if (s + (uint64_t)k > slab_end)
            k = (uint32_t)(slab_end - s);
        if (s + (uint64_t)k > d->n_slots)
            k = d->n_slots - s;
        int fd = slab < d->n_slabs ? d->slab_fds[slab] : -1;
        off_t at = (off_t)kvhi_disk_slot_offset(d, s);
        ssize_t got = fd < 0 ? 0 : read_fully(fd, buf, (size_t)k * d->slot_bytes, at);
        if (got < 0) {
            rc = (int)got;
            break;
        }
        /* Slots past the end of a short file are simply not there. */
        uint32_t whole = (uint32_t)((uint64_t)got / d->slot_bytes);
        for (uint32_t i = 0; i < whole; i++) {
            const uint8_t *hdr = buf + (size_t)i * d->slot_bytes;
            uint32_t slot = s + i;
            kvhi_slot_meta m;
            int32_t *tk = tokens + *n_found * bt;
            if (kvhi_slot_check_alone(hdr, hdr + KVHI_SLOT_HEADER_BYTES, d->block_bytes, slot,
                                      kvhi_disk_slot_offset(d, slot), bt, &m, tk, NULL) != 0)
                continue;
            for (uint32_t t = m.n_tokens; t < bt; t++)
                tk[t] = 0;
            found[(*n_found)++] = (found_slot){.store_id = m.store_id,
                                               .hash = m.hash,
                                               .parent = m.parent,
                                               .slot = slot,
                                               .n_tokens = m.n_tokens,
                                               .data_crc = m.data_crc,
                                               .flags = m.flags,
                                               .geo_tag = m.geo_tag};
        }
        s += k;
    }
    free(buf);
    return rc;
}

/* True when a slot that checks out may stand for a cached block: a full,
 * hashed block of this geometry that was published when written, or one
 * an intact record names as it is (headers older than the flags). */
static bool slot_vouched(const kvhi_disk *d, const live_map *m, const found_slot *f)
{
    if (f->hash == 0 || f->n_tokens != d->geo.block_tokens || (f->geo_tag && f->geo_tag != d->geo_tag))
        return false;
    if ((f->flags & KVHI_SLOT_PUBLISHED) && f->geo_tag == d->geo_tag)
        return true;
    uint32_t i = m->at[f->slot];
    return i != UINT32_MAX && m->items[i].hash == f->hash && m->items[i].data_crc == f->data_crc;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* The store id most vouched slots carry (ties: the lowest), or a new one
 * when none does. 0 or -ENOMEM. */
static int vote_store_id(kvhi_disk *d, const live_map *m, const found_slot *found, size_t n)
{
    uint64_t *ids = malloc(sizeof(uint64_t) * (n ? n : 1));
    if (!ids)
        return -ENOMEM;
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (slot_vouched(d, m, &found[i]))
            ids[k++] = found[i].store_id;
    if (k == 0) {
        free(ids);
        new_store_id(d);
        return 0;
    }
    qsort(ids, k, sizeof(uint64_t), cmp_u64);
    size_t best = 0, best_run = 0;
    for (size_t i = 0; i < k;) {
        size_t j = i;
        while (j < k && ids[j] == ids[i])
            j++;
        if (j - i > best_run)
            best = i, best_run = j - i;
        i = j;
    }
    d->store_id = ids[best];
    free(ids);
    return 0;
}

/* Whether the slots that check out are all of another geometry or
 * model_salt (none of this one's): with no index or journal header left
 * to say, they are the only word on whose store this is, and a store of
 * another model is refused, never taken over empty. */
static bool slots_all_foreign(const kvhi_disk *d, const found_slot *found, size_t n, size_t *n_foreign)
{
    size_t ours = 0, foreign = 0;
    for (size_t i = 0; i < n; i++) {
        if (found[i].hash == 0 || !found[i].geo_tag)
            continue; /* an empty slot, or a header older than the tag */
        if (found[i].geo_tag == d->geo_tag)
            ours++;
        else
            foreign++;
    }
    *n_foreign = foreign;
    return ours == 0 && foreign > 0;
}

/* rebuild_from_slots found only another model's slots. */
#define REBUILD_FOREIGN 1

/* Replaces the entries in m by the slots of the store that check out and
 * are vouched for (slot_vouched). Counts in out the entries dropped and
 * the blocks taken back from their headers alone. 0, REBUILD_FOREIGN
 * (*n_foreign slots of another geometry or model_salt and none of this
 * one's, with no header naming the store) or -errno. */
static int rebuild_from_slots(kvhi_disk *d, live_map *m, bool id_known, kvhi_index_list *out, size_t *n_foreign)
{
    uint32_t bt = d->geo.block_tokens;
    size_t cap = d->n_slots ? d->n_slots : 1;
    found_slot *found = malloc(sizeof(found_slot) * cap);
    int32_t *tokens = malloc(sizeof(int32_t) * bt * cap);
    uint32_t *pick = malloc(sizeof(uint32_t) * cap);
    size_t n = 0;
    int rc = found && tokens && pick ? scan_slots(d, found, tokens, &n) : -ENOMEM;
    if (rc == 0 && !id_known && slots_all_foreign(d, found, n, n_foreign))
        rc = REBUILD_FOREIGN;
    if (rc == 0 && !id_known)
        rc = vote_store_id(d, m, found, n);
    if (rc != 0) {
        free(found), free(tokens), free(pick);
        return rc;
    }
    memset(pick, 0xFF, sizeof(uint32_t) * cap);
    for (size_t i = 0; i < n; i++)
        if (found[i].store_id == d->store_id && slot_vouched(d, m, &found[i]))
            pick[found[i].slot] = (uint32_t)i;
    for (size_t i = 0; i < m->n; i++) {
        uint32_t p = pick[m->items[i].slot];
        out->bad_slots += p == UINT32_MAX || found[p].hash != m->items[i].hash;
    }
    for (uint32_t s = 0; s < d->n_slots; s++) {
        uint32_t p = pick[s];
        if (p != UINT32_MAX && (m->at[s] == UINT32_MAX || m->items[m->at[s]].hash != found[p].hash))
            out->rescued++;
    }
    /* Slots that check out but that nothing vouches for (never published,
     * named by no intact record): said in the warning, so that a rebuild
     * keeping none of a store's slots does not read as an empty store. */
    /* With no header left and none vouched for, the store got a new id
     * that no slot carries: every intact slot of this geometry counts. */
    for (size_t i = 0; i < n; i++)
        out->unvouched += pick[found[i].slot] != (uint32_t)i && (!id_known || found[i].store_id == d->store_id) &&
                          found[i].hash != 0 && found[i].n_tokens == bt &&
                          (!found[i].geo_tag || found[i].geo_tag == d->geo_tag);
    m->n = 0;
    memset(m->at, 0xFF, sizeof(uint32_t) * cap);
    for (uint32_t s = 0; s < d->n_slots; s++) {
        uint32_t p = pick[s];
        if (p == UINT32_MAX)
            continue;
        kvhi_index_rec r = {.kind = KVHI_REC_ADD,
                            .slot = s,
                            .hash = found[p].hash,
                            .parent = found[p].parent,
                            .n_tokens = found[p].n_tokens,
                            .data_crc = found[p].data_crc,
                            .tokens = tokens + (size_t)p * bt};
        live_put(m, &r, bt);
    }
    free(found), free(tokens), free(pick);
    return 0;
}

int kvhi_index_load(kvhi_disk *d, bool reset, kvhi_index_list *out, char *msg, size_t msg_len)
{
    uint32_t bt = d->geo.block_tokens;
    d->rec_bytes = (uint32_t)kvhi_index_rec_bytes(bt);
    d->geo_tag = kvhi_disk_geometry_tag(&d->geo);
    d->journal_fd = -1;
    pthread_mutex_init(&d->journal_lock, NULL);
    pthread_mutex_init(&d->pending_lock, NULL);
    d->pending = d->flushing = NULL;
    d->pending_len = d->pending_cap = d->flushing_cap = 0;
    memset(out, 0, sizeof(*out));
    if (reset)
        return create_store(d, out, msg, msg_len);
    uint8_t *snap = NULL, *jr = NULL;
    size_t snap_len = 0, jr_len = 0;
    int rc = read_file(d, "index", &snap, &snap_len);
    if (rc != 0 && rc != -ENOENT) {
        snprintf(msg, msg_len, "cannot read %s/index: %s", d->path, kvhi_store_file_error(rc));
        out->io_err = rc;
        return KVHI_INDEX_IO;
    }
    bool have_index = rc == 0;
    rc = read_file(d, "journal", &jr, &jr_len);
    if (rc != 0 && rc != -ENOENT) {
        /* An unreadable journal may hold acknowledged records: never
         * replace it; the open fails and can be retried. */
        free(snap);
        snprintf(msg, msg_len, "cannot read %s/journal: %s", d->path, kvhi_store_file_error(rc));
        out->io_err = rc;
        return KVHI_INDEX_IO;
    }
    bool have_journal = rc == 0;
    /* A reader (kvh-store) takes a store whose index is missing beside a
     * journal, as an engine does: rebuilt in memory, reported as damage. */
    if (!have_index && !have_journal && d->read_only) {
        snprintf(msg, msg_len, "%s holds no kvh store (no index file)", d->path);
        return KVHI_INDEX_IO;
    }
    /* Neither file and no slab file: a new store. Beside slab files it is
     * a creation a crash cut short (slabs made, index not yet) or a store
     * whose two files were lost: their slots are scanned below, and
     * strict, which scans nothing, refuses rather than start empty over
     * blocks a scan would have kept. */
    if (!have_index && !have_journal && d->slab_bytes_found == 0)
        return create_store(d, out, msg, msg_len);
    if (!have_index && !have_journal && d->strict_index) {
        snprintf(msg, msg_len,
                 "%s: neither index nor journal beside %" PRIu64
                 " bytes of slab files (the two files were lost, or a crash cut the store's creation short; "
                 "disk_strict_index is set; 0 rebuilds the index from the slot headers)",
                 d->path, (uint64_t)d->slab_bytes_found);
        return KVHI_INDEX_CORRUPT;
    }

    kvhi_index_header sh, jh;
    bool snap_ok = have_index && kvhi_index_header_decode(snap, snap_len, &sh) == 0 && sh.kind == KIND_SNAPSHOT;
    bool journal_ok = have_journal && kvhi_index_header_decode(jr, jr_len, &jh) == 0 && jh.kind == KIND_JOURNAL;
    /* A new store's journal alone, no record ever taken (its first seq
     * is 1): made by a creation cut short, before the index. */
    if (!have_index && journal_ok && jh.seq <= 1 && jr_len == KVHI_DISK_ALIGN) {
        free(jr);
        if (d->read_only) {
            snprintf(msg, msg_len, "%s holds no kvh store (no index file, an empty journal)", d->path);
            return KVHI_INDEX_IO;
        }
        return create_store(d, out, msg, msg_len);
    }
    /* The journal header names the same geometry and store when the index
     * header cannot be read. */
    const kvhi_disk_geometry *store_geo = snap_ok ? &sh.geo : journal_ok ? &jh.geo : NULL;
    const char *diff = store_geo ? geo_diff(store_geo, &d->geo) : NULL;
    if (diff) {
        free(snap), free(jr);
        snprintf(msg, msg_len, "store %s was made with a different %s", d->path, diff);
        return KVHI_INDEX_MISMATCH;
    }
    /* create_store writes the journal before the index and compaction
     * keeps the id, so no crash leaves the two headers naming different
     * stores: one of them was put there from another store, and neither
     * can say which blocks are this store's. */
    bool ids_differ = snap_ok && journal_ok && jh.store_id != sh.store_id;
    bool id_known = (snap_ok || journal_ok) && !ids_differ;
    d->store_id = snap_ok ? sh.store_id : journal_ok ? jh.store_id : 0;
    damage dm = {0};
    if (!have_index)
        damaged(&dm, "the index file is missing");
    else if (!snap_ok) {
        out->bad_records++;
        damaged(&dm, "the index header is damaged");
    } else if (ids_differ)
        damaged(&dm, "the index and the journal belong to different stores");

    size_t cap = d->n_slots ? d->n_slots : 1;
    live_map m = {.at = malloc(sizeof(uint32_t) * cap),
                  .items = calloc(cap, sizeof(kvhi_index_entry)),
                  .tokens = malloc(sizeof(int32_t) * bt * cap)};
    int32_t *tk = malloc(sizeof(int32_t) * bt);
    if (!m.at || !m.items || !m.tokens || !tk) {
        free(m.at), free(m.items), free(m.tokens), free(tk), free(snap), free(jr);
        snprintf(msg, msg_len, "out of memory loading the index");
        out->io_err = -ENOMEM;
        return KVHI_INDEX_IO;
    }
    memset(m.at, 0xFF, sizeof(uint32_t) * cap);
    kvhi_index_rec r = {.tokens = tk};
    /* Snapshot records carry its seq, which stands in for a damaged header's. */
    uint64_t snap_seq = snap_ok ? sh.seq : 0;
    size_t body = snap_len > KVHI_DISK_ALIGN ? snap_len - KVHI_DISK_ALIGN : 0;
    if (snap_ok && body / d->rec_bytes < sh.n_records) {
        /* A cut snapshot loses the records past the cut; a count no
         * snapshot can hold (slot numbers are 32-bit) is the header's own
         * damage, one bad header rather than 2^64 lost records. */
        bool impossible = sh.n_records > UINT32_MAX;
        out->bad_records += impossible ? 1 : sh.n_records - body / d->rec_bytes;
        damaged(&dm, impossible ? "the index header names more records than a store can hold"
                                : "the index is shorter than its header says");
    }
    /* Blocks the records keep in slots past the ones disk_bytes now gives
     * (the store opened smaller than it was made): dropped, and said. */
    int64_t past_end = 0;
    for (size_t i = 0; i < body / d->rec_bytes; i++) {
        if (kvhi_index_rec_decode(snap + KVHI_DISK_ALIGN + i * d->rec_bytes, &r, bt) != 0) {
            out->bad_records++;
            damaged(&dm, "a record of the index failed its checksum");
            continue;
        }
        if (!snap_ok && r.seq > snap_seq)
            snap_seq = r.seq;
        if (r.kind == KVHI_REC_ADD && r.slot < d->n_slots)
            live_put(&m, &r, bt);
        else if (r.kind == KVHI_REC_ADD)
            past_end++;
    }
    free(snap);
    d->next_seq = snap_seq + 1;
    if (!snap_ok && journal_ok && jh.seq > d->next_seq)
        d->next_seq = jh.seq;
    /* Journal: replay records newer than the snapshot up to the first bad
     * one (a torn tail), then cut the file there. One of another store
     * than the index is left out: the rebuild below takes the slots. */
    size_t good = KVHI_DISK_ALIGN;
    bool replay = have_journal && !ids_differ;
    if (have_journal && !journal_ok) {
        /* The records carry their own checksums: replay them past it. */
        out->bad_records++;
        damaged(&dm, "the journal header is damaged");
    }
    /* A journal is begun right after the snapshot before it (its seq is
     * that snapshot's plus one), and a crash between the two leaves an
     * older journal, never a newer one: an index older than its journal
     * is a lost snapshot (an older copy put back), whose records since
     * are nowhere else but in the slot headers. */
    if (snap_ok && journal_ok && jh.store_id == sh.store_id && jh.seq > sh.seq + 1)
        damaged(&dm, "the index is older than its journal (a snapshot is missing)");
    if (!have_journal && have_index)
        damaged(&dm, "the journal file is missing");
    else if (have_journal && jr_len < KVHI_DISK_ALIGN)
        damaged(&dm, "the journal is cut inside its header page"); /* it never is shorter */
    if (replay) {
        uint64_t skipped = 0;
        size_t off = KVHI_DISK_ALIGN;
        for (; off + d->rec_bytes <= jr_len; off += d->rec_bytes) {
            if (kvhi_index_rec_decode(jr + off, &r, bt) != 0) {
                skipped++; /* bit rot if good records follow, else a torn tail */
                continue;
            }
            if (skipped)
                damaged(&dm, "a record of the journal failed its checksum");
            out->bad_records += skipped;
            skipped = 0;
            good = off + d->rec_bytes;
            if (r.seq < d->next_seq)
                continue; /* already in the snapshot */
            if (r.slot < d->n_slots) {
                if (r.kind == KVHI_REC_ADD)
                    live_put(&m, &r, bt);
                else
                    live_del(&m, &r, bt);
            } else
                past_end += r.kind == KVHI_REC_ADD ? 1 : -1;
            d->next_seq = r.seq + 1;
            d->journal_records++;
        }
        if (skipped || off < jr_len) {
            if (!dm.found && !dm.torn_tail)
                snprintf(dm.what, sizeof(dm.what), "the journal ends in a torn or damaged record");
            dm.torn_tail = true;
        }
    }
    free(jr);
    free(tk);
    if (!d->read_only) /* inspection (kvh-store verify) names each of their blocks instead */
        missing_slab_damage(d, &m, &dm);
    if (dm.found && d->strict_index) {
        free(m.at), free(m.items), free(m.tokens);
        snprintf(msg, msg_len, "%s: %s (disk_strict_index is set; 0 rebuilds the index from the slot headers)", d->path,
                 dm.what);
        return KVHI_INDEX_CORRUPT;
    }
    if (dm.found)
        snprintf(out->damage, sizeof(out->damage), "%s", dm.what);
    out->torn_tail = dm.torn_tail;
    if (past_end > 0)
        out->past_end = (uint64_t)past_end;
    if (dm.torn_tail && !dm.found && d->strict_index)
        snprintf(out->note, sizeof(out->note),
                 "disk tier: %s: %s: disk_strict_index=1 cuts it there (the records past it are dropped; with 0 "
                 "an open rebuilds the index from the slot headers)",
                 d->path, dm.what);
    if (dm.found || (dm.torn_tail && !d->strict_index)) {
        size_t named = m.n, n_foreign = 0;
        rc = rebuild_from_slots(d, &m, id_known, out, &n_foreign);
        if (rc == REBUILD_FOREIGN) {
            free(m.at), free(m.items), free(m.tokens);
            snprintf(msg, msg_len,
                     "%s: %s, and its %zu intact slots were all written with a different geometry or model_salt",
                     d->path, dm.what, n_foreign);
            return KVHI_INDEX_MISMATCH;
        }
        if (rc != 0) {
            free(m.at), free(m.items), free(m.tokens);
            snprintf(msg, msg_len, "%s: %s, and reading the slots to rebuild it failed: %s", d->path, dm.what,
                     strerror(-rc));
            out->io_err = rc;
            return KVHI_INDEX_IO;
        }
        out->rewrite = !d->read_only;
        snprintf(out->note, sizeof(out->note),
                 "disk tier: %s: %s; rebuilt the index from the slot headers: %zu blocks (%" PRIu64
                 " of them named by no intact record), %" PRIu64 " of the %zu named dropped (their slots failed "
                 "their checks), %" PRIu64 " damaged records or headers, %" PRIu64
                 " intact slots left out (never persisted, or written by a kvh whose slots carry no publish mark)",
                 d->path, dm.what, m.n, out->rescued, out->bad_slots, named, out->bad_records, out->unvouched);
    }
    free(m.at);
    if (d->read_only)
        rc = 0;
    else if (out->rewrite)
        /* The rebuilt index goes to disk before anything else changes:
         * cutting the journal back or creating a fresh one first would, if
         * the process died before the rebuilt snapshot was written, leave
         * a sound-looking index and journal that lack every block the
         * rebuild took back from its slot header, and no damage for the
         * next open to notice. Snapshot first, then a fresh journal, each
         * step atomic (the caller's snapshot of the recovered blocks
         * follows). */
        rc = kvhi_index_compact(d, m.items, m.n);
    else if (replay)
        rc = open_journal(d, true, (off_t)good);
    else
        rc = fresh_journal(d);
    if (rc != 0) {
        free(m.items), free(m.tokens);
        snprintf(msg, msg_len, "cannot %s %s/%s: %s", out->rewrite ? "write the rebuilt index to" : "open", d->path,
                 out->rewrite ? "index" : "journal", strerror(-rc));
        out->io_err = rc;
        return KVHI_INDEX_IO;
    }
    out->items = m.items;
    out->n = m.n;
    out->token_store = m.tokens;
    return KVHI_INDEX_OK;
}

void kvhi_index_list_free(kvhi_index_list *l)
{
    free(l->items);
    free(l->token_store);
    memset(l, 0, sizeof(*l));
}

int kvhi_index_append(kvhi_disk *d, uint32_t kind, uint32_t slot, uint64_t hash, uint64_t parent, uint32_t n_tokens,
                      uint32_t data_crc, const int32_t *tokens)
{
    pthread_mutex_lock(&d->pending_lock);
    int rc = d->fatal ? -EIO : 0;
    if (rc == 0 && d->pending_len + d->rec_bytes > d->pending_cap) {
        size_t cap = d->pending_cap ? 2 * d->pending_cap : 64 * (size_t)d->rec_bytes;
        uint8_t *p = realloc(d->pending, cap);
        if (p) {
            d->pending = p;
            d->pending_cap = cap;
        } else {
            rc = -ENOMEM; /* the record is not taken; the caller sees it */
        }
    }
    if (rc == 0) {
        kvhi_index_rec r = {.kind = kind,
                            .seq = d->next_seq,
                            .slot = slot,
                            .hash = hash,
                            .parent = parent,
                            .n_tokens = n_tokens,
                            .data_crc = data_crc,
                            .tokens = (int32_t *)tokens};
        kvhi_index_rec_encode(d->pending + d->pending_len, &r, d->geo.block_tokens);
        d->pending_len += d->rec_bytes;
        d->next_seq++;
        d->journal_records++;
    }
    pthread_mutex_unlock(&d->pending_lock);
    return rc;
}

/* Puts records that could not be written back in front of the pending
 * ones (appended meanwhile), so they go out first next time. */
static bool requeue(kvhi_disk *d, const uint8_t *buf, size_t len)
{
    pthread_mutex_lock(&d->pending_lock);
    bool ok = true;
    if (d->pending_len + len > d->pending_cap) {
        uint8_t *p = realloc(d->pending, d->pending_len + len);
        if (p) {
            d->pending = p;
            d->pending_cap = d->pending_len + len;
        } else {
            ok = false;
        }
    }
    if (ok) {
        memmove(d->pending + len, d->pending, d->pending_len);
        memcpy(d->pending, buf, len);
        d->pending_len += len;
    }
    pthread_mutex_unlock(&d->pending_lock);
    return ok;
}

/* Writes the pending records; the caller holds journal_lock. A full disk
 * is not fatal: the file is cut back to its last whole record and the
 * records stay pending. Any other failure is (the file's state is
 * unknown). */
static int flush_locked(kvhi_disk *d)
{
    pthread_mutex_lock(&d->pending_lock);
    uint8_t *buf = d->pending;
    size_t len = d->pending_len, cap = d->pending_cap;
    d->pending = d->flushing;
    d->pending_cap = d->flushing_cap;
    d->pending_len = 0;
    d->flushing = buf;
    d->flushing_cap = cap;
    pthread_mutex_unlock(&d->pending_lock);
    if (len == 0)
        return d->fatal ? -EIO : 0;
    if (d->fatal)
        return -EIO;
    off_t end = lseek(d->journal_fd, 0, SEEK_CUR);
    int rc = end < 0 ? -errno : write_all(d->journal_fd, buf, len);
    /* No room (a full disk, a quota, the process's file size limit): the
     * records wait for room, the journal as it was. */
    if ((rc == -ENOSPC || rc == -EDQUOT || rc == -EFBIG) && end >= 0 && ftruncate(d->journal_fd, end) == 0 &&
        lseek(d->journal_fd, end, SEEK_SET) == end && requeue(d, buf, len))
        return rc;
    if (rc != 0)
        d->fatal = true; /* a partial record is a torn tail: replay stops before it */
    return rc;
}

int kvhi_index_flush(kvhi_disk *d)
{
    pthread_mutex_lock(&d->journal_lock);
    int rc = flush_locked(d);
    pthread_mutex_unlock(&d->journal_lock);
    return rc;
}

static bool dir_removed(const kvhi_disk *d)
{
    struct stat ds;
    return d->dir_fd >= 0 && fstat(d->dir_fd, &ds) == 0 && ds.st_nlink == 0;
}

/* fdatasync of the journal through fd, and the check that the journal
 * and the directory still stand. */
static int sync_journal_fd(kvhi_disk *d, int fd)
{
    int inj = kvhi_disk_fault(KVHI_OP_FSYNC);
    int rc = inj ? inj : kvhi_disk_sync_fd(fd, true);
    /* Records synced into a journal (or a directory) someone removed
     * are durable nowhere a later open looks: say so, once and for all. */
    struct stat js;
    if (rc == 0 && ((fstat(fd, &js) == 0 && js.st_nlink == 0) || dir_removed(d)))
        rc = -ENOENT;
    return rc;
}

int kvhi_index_sync(kvhi_disk *d)
{
    pthread_mutex_lock(&d->journal_lock);
    int rc = flush_locked(d);
    if (rc != 0) { /* flush_locked decided what its failure means */
        pthread_mutex_unlock(&d->journal_lock);
        return rc;
    }
    /* The sync runs on a second descriptor of the journal, outside
     * journal_lock: a flush that an eviction needs (a few records
     * written) does not wait for another thread's sync of a slow disk.
     * Without a descriptor to spare it runs under the lock. */
    int fd = fcntl(d->journal_fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) {
        rc = sync_journal_fd(d, d->journal_fd);
    } else {
        uint64_t generation = d->journal_generation;
        pthread_mutex_unlock(&d->journal_lock);
        rc = sync_journal_fd(d, fd);
        close(fd);
        pthread_mutex_lock(&d->journal_lock);
        /* A fold that replaced the journal meanwhile wrote and synced a
         * snapshot holding these records: the old file no longer matters.
         * A directory removed still does. */
        if (rc != 0 && d->journal_generation != generation && !d->fatal && !dir_removed(d))
            rc = 0;
    }
    if (rc != 0)
        d->fatal = true;
    pthread_mutex_unlock(&d->journal_lock);
    return rc;
}

int kvhi_index_compact(kvhi_disk *d, const kvhi_index_entry *entries, size_t n)
{
    uint32_t bt = d->geo.block_tokens;
    pthread_mutex_lock(&d->journal_lock);
    int rc = d->fatal ? -EIO : 0;
    bool replaced = false;
    /* A snapshot with records is at seq 1 or later, so that the journal
     * made beside it starts past 1: a journal starting at 1 alone then
     * only ever means a new store (creation cut short), whose loss of an
     * index loses nothing. */
    pthread_mutex_lock(&d->pending_lock);
    if (n > 0 && d->next_seq < 2)
        d->next_seq = 2;
    pthread_mutex_unlock(&d->pending_lock);
    uint8_t *body = rc == 0 ? malloc(n * d->rec_bytes + 1) : NULL;
    if (rc == 0 && !body)
        rc = -ENOMEM;
    if (rc == 0) {
        for (size_t i = 0; i < n; i++) {
            kvhi_index_rec r = {.kind = KVHI_REC_ADD,
                                .seq = d->next_seq - 1,
                                .slot = entries[i].slot,
                                .hash = entries[i].hash,
                                .parent = entries[i].parent,
                                .n_tokens = entries[i].n_tokens,
                                .data_crc = entries[i].data_crc,
                                .tokens = entries[i].tokens};
            kvhi_index_rec_encode(body + i * d->rec_bytes, &r, bt);
        }
        uint8_t hdr[KVHI_DISK_ALIGN];
        kvhi_index_header h = {
            .kind = KIND_SNAPSHOT, .store_id = d->store_id, .seq = d->next_seq - 1, .n_records = n, .geo = d->geo};
        kvhi_index_header_encode(hdr, &h);
        rc = replace_file(d, "index", hdr, body, n * d->rec_bytes, &replaced);
        /* Records up to seq are in the snapshot now; an old journal left by
         * a crash here is skipped on replay because its seqs are older. */
        if (rc == 0)
            rc = fresh_journal(d);
        /* Until the new index stands, the old index and journal are the
         * store, unchanged: a failure there (a full disk writing the new
         * one) leaves it usable, and the fold is tried again later. */
        if (rc != 0 && replaced)
            d->fatal = true;
    }
    /* The snapshot was taken from the engine's state, which holds the
     * effect of every pending record (the caller holds the engine lock):
     * they are superseded, once it stands. */
    if (rc == 0) {
        pthread_mutex_lock(&d->pending_lock);
        d->pending_len = 0;
        pthread_mutex_unlock(&d->pending_lock);
    }
    free(body);
    pthread_mutex_unlock(&d->journal_lock);
    return rc;
}

void kvhi_index_close(kvhi_disk *d)
{
    if (d->journal_fd >= 0)
        close(d->journal_fd);
    d->journal_fd = -1;
    free(d->pending);
    free(d->flushing);
    d->pending = d->flushing = NULL;
    d->pending_len = d->pending_cap = d->flushing_cap = 0;
    pthread_mutex_destroy(&d->pending_lock);
    pthread_mutex_destroy(&d->journal_lock);
}
