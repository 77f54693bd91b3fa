#include "core/disk_index.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

enum { KIND_SNAPSHOT = 1, KIND_JOURNAL = 2 };

static int read_file(int dir_fd, const char *name, uint8_t **buf, size_t *len)
{
    int fd = openat(dir_fd, name, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
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
    return fsync(fd) == 0 ? 0 : -errno;
}

static int sync_dir(kvhi_disk *d)
{
    int inj = kvhi_disk_fault(KVHI_OP_DIRSYNC);
    if (inj)
        return inj;
    return fsync(d->dir_fd) == 0 ? 0 : -errno;
}

/* Atomically replaces `name` with header + body: temp, fsync, rename,
 * fsync of the directory. */
static int replace_file(kvhi_disk *d, const char *name, const void *header, const void *body, size_t body_len)
{
    char tmp[64];
    snprintf(tmp, sizeof(tmp), "%s.tmp", name);
    int fd = openat(d->dir_fd, tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return -errno;
    int rc = write_all(fd, header, KVHI_DISK_ALIGN);
    if (rc == 0 && body_len)
        rc = write_all(fd, body, body_len);
    if (rc == 0)
        rc = sync_fd(fd);
    close(fd);
    if (rc == 0) {
        int inj = kvhi_disk_fault(KVHI_OP_RENAME);
        rc = inj ? inj : (renameat(d->dir_fd, tmp, d->dir_fd, name) == 0 ? 0 : -errno);
    }
    if (rc == 0)
        rc = sync_dir(d);
    if (rc != 0)
        unlinkat(d->dir_fd, tmp, 0);
    return rc;
}

static int open_journal(kvhi_disk *d, bool truncate_to, off_t keep)
{
    d->journal_fd = openat(d->dir_fd, "journal", O_RDWR | O_CLOEXEC);
    if (d->journal_fd < 0)
        return -errno;
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
    int rc = replace_file(d, "journal", hdr, NULL, 0);
    if (rc == 0)
        rc = open_journal(d, false, 0);
    d->journal_records = 0;
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
    if (a->dtype != b->dtype)
        return "dtype";
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
    uint8_t *snap = NULL, *jr = NULL;
    size_t snap_len = 0, jr_len = 0;
    int rc = reset ? -ENOENT : read_file(d->dir_fd, "index", &snap, &snap_len);
    kvhi_index_header sh;
    if (rc == -ENOENT && d->read_only) {
        snprintf(msg, msg_len, "%s holds no kvh store (no index file)", d->path);
        return KVHI_INDEX_IO;
    }
    if (rc == -ENOENT) {
        /* New (or reset) store: random id, empty snapshot, empty journal. */
        if (getrandom(&d->store_id, sizeof(d->store_id), 0) != sizeof(d->store_id))
            d->store_id = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
        d->next_seq = 1;
        uint8_t hdr[KVHI_DISK_ALIGN];
        kvhi_index_header h = {.kind = KIND_SNAPSHOT, .store_id = d->store_id, .seq = 0, .geo = d->geo};
        kvhi_index_header_encode(hdr, &h);
        rc = replace_file(d, "index", hdr, NULL, 0);
        if (rc == 0)
            rc = fresh_journal(d);
        if (rc != 0) {
            snprintf(msg, msg_len, "cannot create the index in %s: %s", d->path, strerror(-rc));
            return KVHI_INDEX_IO;
        }
        out->items = NULL;
        return KVHI_INDEX_OK;
    }
    if (rc != 0) {
        snprintf(msg, msg_len, "cannot read %s/index: %s", d->path, strerror(-rc));
        return KVHI_INDEX_IO;
    }
    if (kvhi_index_header_decode(snap, snap_len, &sh) != 0 || sh.kind != KIND_SNAPSHOT) {
        free(snap);
        snprintf(msg, msg_len, "%s/index has a damaged header", d->path);
        return KVHI_INDEX_CORRUPT;
    }
    const char *diff = geo_diff(&sh.geo, &d->geo);
    if (diff) {
        free(snap);
        snprintf(msg, msg_len, "store %s was made with a different %s", d->path, diff);
        return KVHI_INDEX_MISMATCH;
    }
    d->store_id = sh.store_id;
    live_map m = {.at = malloc(sizeof(uint32_t) * (d->n_slots ? d->n_slots : 1)),
                  .items = calloc(d->n_slots ? d->n_slots : 1, sizeof(kvhi_index_entry)),
                  .tokens = malloc(sizeof(int32_t) * bt * (d->n_slots ? d->n_slots : 1))};
    int32_t *tk = malloc(sizeof(int32_t) * bt);
    if (!m.at || !m.items || !m.tokens || !tk) {
        free(m.at), free(m.items), free(m.tokens), free(tk), free(snap);
        snprintf(msg, msg_len, "out of memory loading the index");
        return KVHI_INDEX_IO;
    }
    memset(m.at, 0xFF, sizeof(uint32_t) * (d->n_slots ? d->n_slots : 1));
    kvhi_index_rec r = {.tokens = tk};
    size_t body = snap_len > KVHI_DISK_ALIGN ? snap_len - KVHI_DISK_ALIGN : 0;
    if (body / d->rec_bytes < sh.n_records)
        out->bad_records += sh.n_records - body / d->rec_bytes; /* a cut snapshot */
    for (size_t i = 0; i < body / d->rec_bytes; i++) {
        if (kvhi_index_rec_decode(snap + KVHI_DISK_ALIGN + i * d->rec_bytes, &r, bt) != 0) {
            out->bad_records++;
            continue;
        }
        if (r.kind == KVHI_REC_ADD && r.slot < d->n_slots)
            live_put(&m, &r, bt);
    }
    free(snap);
    d->next_seq = sh.seq + 1;
    /* Journal: replay records newer than the snapshot up to the first bad
     * one (a torn tail), then cut the file there. */
    rc = read_file(d->dir_fd, "journal", &jr, &jr_len);
    if (rc != 0 && rc != -ENOENT) {
        /* An unreadable journal may hold acknowledged records: never
         * replace it; the open fails and can be retried. */
        free(tk), free(m.at), free(m.items), free(m.tokens);
        snprintf(msg, msg_len, "cannot read %s/journal: %s", d->path, strerror(-rc));
        return KVHI_INDEX_IO;
    }
    kvhi_index_header jh;
    size_t good = KVHI_DISK_ALIGN;
    bool header_ok = rc == 0 && kvhi_index_header_decode(jr, jr_len, &jh) == 0 && jh.kind == KIND_JOURNAL;
    if (rc == 0 && !header_ok && jr_len > KVHI_DISK_ALIGN) {
        /* The records carry their own checksums: replay them past the
         * damaged header, count the damage, and have the caller rewrite
         * the index at once. */
        out->bad_records++;
        out->journal_header_bad = true;
        jh.store_id = d->store_id;
        header_ok = true;
    }
    if (header_ok && jh.store_id == d->store_id) {
        uint64_t skipped = 0;
        for (size_t off = KVHI_DISK_ALIGN; off + d->rec_bytes <= jr_len; off += d->rec_bytes) {
            if (kvhi_index_rec_decode(jr + off, &r, bt) != 0) {
                skipped++; /* bit rot if good records follow, else a torn tail */
                continue;
            }
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
            }
            d->next_seq = r.seq + 1;
            d->journal_records++;
        }
        free(jr);
        rc = d->read_only ? 0 : open_journal(d, true, (off_t)good);
    } else {
        free(jr);
        rc = d->read_only ? 0 : fresh_journal(d);
    }
    free(tk);
    free(m.at);
    if (rc != 0) {
        free(m.items), free(m.tokens);
        snprintf(msg, msg_len, "cannot open %s/journal: %s", d->path, strerror(-rc));
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
        kvhi_index_rec r = {.kind = kind, .seq = d->next_seq, .slot = slot, .hash = hash, .parent = parent,
                            .n_tokens = n_tokens, .data_crc = data_crc, .tokens = (int32_t *)tokens};
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
    if (rc == -ENOSPC && end >= 0 && ftruncate(d->journal_fd, end) == 0 &&
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

int kvhi_index_sync(kvhi_disk *d)
{
    pthread_mutex_lock(&d->journal_lock);
    int rc = flush_locked(d);
    if (rc == 0) {
        int inj = kvhi_disk_fault(KVHI_OP_FSYNC);
        rc = inj ? inj : (fdatasync(d->journal_fd) == 0 ? 0 : -errno);
        if (rc != 0)
            d->fatal = true;
    }
    pthread_mutex_unlock(&d->journal_lock);
    return rc;
}

int kvhi_index_compact(kvhi_disk *d, const kvhi_index_entry *entries, size_t n)
{
    uint32_t bt = d->geo.block_tokens;
    pthread_mutex_lock(&d->journal_lock);
    /* The snapshot is taken from the engine's state, which already holds
     * the effect of every pending record: they are superseded. */
    pthread_mutex_lock(&d->pending_lock);
    d->pending_len = 0;
    pthread_mutex_unlock(&d->pending_lock);
    int rc = d->fatal ? -EIO : 0;
    uint8_t *body = rc == 0 ? malloc(n * d->rec_bytes + 1) : NULL;
    if (rc == 0 && !body)
        rc = -ENOMEM;
    if (rc == 0) {
        for (size_t i = 0; i < n; i++) {
            kvhi_index_rec r = {.kind = KVHI_REC_ADD, .seq = d->next_seq - 1, .slot = entries[i].slot,
                                .hash = entries[i].hash, .parent = entries[i].parent,
                                .n_tokens = entries[i].n_tokens, .data_crc = entries[i].data_crc,
                                .tokens = entries[i].tokens};
            kvhi_index_rec_encode(body + i * d->rec_bytes, &r, bt);
        }
        uint8_t hdr[KVHI_DISK_ALIGN];
        kvhi_index_header h = {.kind = KIND_SNAPSHOT, .store_id = d->store_id, .seq = d->next_seq - 1,
                               .n_records = n, .geo = d->geo};
        kvhi_index_header_encode(hdr, &h);
        rc = replace_file(d, "index", hdr, body, n * d->rec_bytes);
        /* Records up to seq are in the snapshot now; an old journal left by
         * a crash here is skipped on replay because its seqs are older. */
        if (rc == 0)
            rc = fresh_journal(d);
        if (rc != 0)
            d->fatal = true;
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
