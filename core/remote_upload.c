/* Uploads of blocks to the remote store (core/remote_tier.h). Per round
 * of at most KVHI_REMOTE_ROUND_BYTES: one EXISTS round skips what the
 * store has (and gives up on blocks whose node does not answer); each
 * other block's data is copied into a value buffer in the disk form, with
 * its CRC32C taken in the same pass, without the engine lock (a block in
 * memory is held meanwhile; one on disk is read from its slot and checked,
 * never brought back into memory); then SET NX EX, all in one round. */
#include <stdlib.h>
#include <string.h>

#include "core/block.h"
#include "core/block_state.h"
#include "core/codec_tier.h"
#include "core/crc32c.h"
#include "core/disk_io.h"
#include "core/move.h"
#include "core/remote_cluster.h"
#include "core/remote_tier.h"

static bool reply_is(const kvhi_cluster_cmd *c, int kind) { return kvhi_cluster_reply(c, NULL, NULL, NULL) == kind; }

void kvhi_remote_upload_ref(kvh_engine *e, uint32_t b)
{
    e->upload_refs[b]++;
    kvhi_block_ref(e, b);
}

void kvhi_remote_upload_unref(kvh_engine *e, uint32_t b)
{
    e->upload_refs[b]--;
    kvhi_block_unref(e, b);
}

/* Blocks an upload holds busy while it copies them without the lock,
 * listed in e->upload_busy for the victim choice (core/evict.c). */
struct kvhi_upload_busy {
    const uint32_t *blocks;
    size_t n;
    struct kvhi_upload_busy *next;
};

static void busy_list(kvh_engine *e, struct kvhi_upload_busy *l, const uint32_t *blocks, size_t n)
{
    *l = (struct kvhi_upload_busy){blocks, n, e->upload_busy};
    e->upload_busy = l;
}

/* Unlisted after the lock is taken again, with the waiters told. */
static void busy_unlist(kvh_engine *e, struct kvhi_upload_busy *l)
{
    struct kvhi_upload_busy **at = &e->upload_busy;
    while (*at != l)
        at = &(*at)->next;
    *at = l->next;
    pthread_cond_broadcast(&e->changed);
}

bool kvhi_remote_busy_unreferenced(kvh_engine *e, uint32_t tier, uint32_t agent)
{
    for (const struct kvhi_upload_busy *l = e->upload_busy; l; l = l->next)
        for (size_t j = 0; j < l->n; j++) {
            const kvhi_block *blk = &e->blocks[l->blocks[j]];
            if (blk->tier == tier && !kvhi_block_referenced(e, blk, l->blocks[j]) &&
                (agent == KVHI_NO_BLOCK || blk->agent == agent) && !(blk->flags & KVHI_BF_DEAD))
                return true;
        }
    return false;
}

/* Reads block b's data from its disk slot into dst (the disk form), checked
 * against the slot's header; its CRC32C into *crc. Lock held; dropped for
 * the read. The block stays on disk. */
static bool read_from_disk(kvh_engine *e, uint32_t b, uint8_t *dst, uint32_t *crc)
{
    kvhi_block *blk = &e->blocks[b];
    kvhi_disk *d = e->disk;
    if (!d || blk->tier != KVH_TIER_DISK || kvhi_block_busy(blk) || (blk->flags & (KVHI_BF_CORRUPT | KVHI_BF_DEAD)))
        return false;
    kvhi_block_move_event(blk, KVHI_EV_COPY_BEGIN); /* stable: nothing moves or frees it */
    kvhi_block_update_evictable(e, b);
    uint32_t slot = blk->slot;
    uint64_t hash = blk->hash;
    struct kvhi_upload_busy busy;
    busy_list(e, &busy, &b, 1);
    kvhi_unlock_for_copy(e);
    kvhi_disk_lane *lane = kvhi_disk_lane_get(d);
    int res = -1;
    kvhi_disk_read_staged(d, lane, 1, &slot, &res, NULL, NULL);
    bool ok = false;
    if (res == 0) {
        const uint8_t *p = kvhi_disk_lane_slot(lane, 0);
        *crc = kvhi_crc32c_copy(0, dst, p + KVHI_SLOT_HEADER_BYTES, d->block_bytes);
        ok = kvhi_slot_verify_crc(p, *crc, d->block_bytes, d->store_id, d->geo_tag, slot,
                                  kvhi_disk_slot_offset(d, slot), hash, e->cfg.block_tokens, NULL, NULL) == 0;
    }
    kvhi_disk_lane_put(d, lane);
    kvhi_relock_after_copy(e);
    busy_unlist(e, &busy);
    kvhi_block_writing_done(e, b);
    if (blk->flags & KVHI_BF_DEAD)
        kvhi_block_free_now(e, b);
    else
        kvhi_block_update_evictable(e, b);
    pthread_cond_broadcast(&e->changed);
    return ok;
}

/* The buffers of one upload. */
typedef struct upload_bufs {
    char (*keys)[KVHI_REMOTE_KEY_BYTES];
    uint64_t *hashes, *parents;
    int32_t *tokens;
    int8_t *present;
    uint32_t *blocks;
    uint32_t *copy_from; /* blocks to copy from memory (held) */
    kvhi_cluster_cmd *cmds;
    uint8_t **vals;
    uint32_t *crcs;
} upload_bufs;

static bool bufs_alloc(upload_bufs *u, size_t cap, uint32_t bt)
{
    u->keys = malloc(KVHI_REMOTE_KEY_BYTES * cap);
    u->hashes = malloc(sizeof(uint64_t) * cap);
    u->parents = malloc(sizeof(uint64_t) * cap);
    u->tokens = malloc(sizeof(int32_t) * bt * cap);
    u->present = malloc(cap);
    u->blocks = malloc(sizeof(uint32_t) * cap);
    u->copy_from = malloc(sizeof(uint32_t) * cap);
    u->cmds = malloc(sizeof(kvhi_cluster_cmd) * cap);
    u->vals = calloc(cap, sizeof(uint8_t *));
    u->crcs = malloc(sizeof(uint32_t) * cap);
    return u->keys && u->hashes && u->parents && u->tokens && u->present && u->blocks && u->copy_from && u->cmds &&
           u->vals && u->crcs;
}

static void bufs_free(upload_bufs *u)
{
    free(u->keys), free(u->hashes), free(u->parents), free(u->tokens), free(u->present), free(u->blocks),
        free(u->copy_from), free(u->cmds), free(u->vals), free(u->crcs);
}

/* Copies the data of the held blocks copy_from[k] (in memory) into
 * vals[k] in the disk form with its CRC32C (no lock). */
static void copy_values(kvh_engine *e, const uint32_t *tiers, uint8_t *const *srcs, uint8_t **vals, uint32_t *crcs,
                        size_t n, uint64_t data_bytes, bool *ok)
{
    for (size_t k = 0; k < n; k++) {
        uint32_t t = tiers[k];
        uint8_t *dst = vals[k] + KVHI_SLOT_HEADER_BYTES;
        bool same_form = e->tiers[t].encoded == e->tiers[KVH_TIER_DISK].encoded;
        if (same_form && (t == KVH_TIER_HOST || e->device_host_addressable)) {
            crcs[k] = kvhi_crc32c_copy(0, dst, srcs[k], data_bytes);
            ok[k] = true;
        } else {
            ok[k] = kvhi_block_copy(e, KVH_TIER_DISK, dst, t, srcs[k]) == 0;
            crcs[k] = ok[k] ? kvhi_crc32c(0, dst, data_bytes) : 0;
        }
    }
}

/* Uploads n blocks (at most cap) of list: fills u->vals[0..m) and the
 * SET commands, returns m. Lock held; dropped for the network and copies. */
static size_t prepare_values(kvh_engine *e, upload_bufs *u, size_t n, kvhi_remote_tally *t)
{
    kvhi_remote *r = e->remote;
    uint32_t bt = e->cfg.block_tokens;
    uint64_t vbytes = kvhi_remote_value_bytes(&r->id), data_bytes = r->id.block_bytes;
    size_t m = 0, n_mem = 0; /* values to send, packed at the front; of them in memory */
    uint32_t *mem_at = malloc(sizeof(uint32_t) * n), *tiers = malloc(sizeof(uint32_t) * n);
    uint8_t **srcs = malloc(sizeof(uint8_t *) * n);
    bool *ok = malloc(n ? n : 1);
    if (!mem_at || !tiers || !srcs || !ok) {
        free(mem_at), free(tiers), free(srcs), free(ok);
        t->dropped += n;
        return 0;
    }
    for (size_t k = 0; k < n; k++) {
        uint32_t b = u->blocks[k];
        kvhi_block *blk = &e->blocks[b];
        uint16_t need = KVHI_BF_HASHED | KVHI_BF_KV_COMPLETE;
        if (u->present[k] == 1 || (blk->flags & need) != need)
            continue;
        if (u->present[k] < 0) { /* its node did not answer: not sent either */
            t->dropped++;
            continue;
        }
        if (!u->vals[m] && !(u->vals[m] = malloc(vbytes))) {
            t->dropped++;
            continue;
        }
        kvhi_block_wait_idle(e, b);
        if (blk->tier == KVH_TIER_DISK) {
            if (!read_from_disk(e, b, u->vals[m] + KVHI_SLOT_HEADER_BYTES, &u->crcs[m])) {
                t->dropped++;
                continue;
            }
        } else if (blk->tier < KVH_TIER_COUNT) {
            kvhi_block_hold_reading(e, b); /* its bytes stay where they are while copied */
            u->copy_from[n_mem] = b;
            mem_at[n_mem] = (uint32_t)m;
            tiers[n_mem] = blk->tier;
            srcs[n_mem++] = kvhi_block_data(e, b);
        } else {
            t->dropped++;
            continue;
        }
        u->hashes[m] = u->hashes[k];
        u->parents[m] = u->parents[k];
        if (m != k) {
            memmove(u->tokens + m * bt, u->tokens + k * bt, sizeof(int32_t) * bt);
            memcpy(u->keys[m], u->keys[k], KVHI_REMOTE_KEY_BYTES);
        }
        m++;
    }
    if (n_mem) {
        uint8_t **vals = malloc(sizeof(uint8_t *) * n_mem);
        uint32_t *crcs = malloc(sizeof(uint32_t) * n_mem);
        struct kvhi_upload_busy busy;
        busy_list(e, &busy, u->copy_from, n_mem);
        kvhi_unlock_for_copy(e);
        if (vals && crcs) {
            for (size_t j = 0; j < n_mem; j++)
                vals[j] = u->vals[mem_at[j]];
            copy_values(e, tiers, srcs, vals, crcs, n_mem, data_bytes, ok);
            for (size_t j = 0; j < n_mem; j++)
                u->crcs[mem_at[j]] = crcs[j];
        } else {
            memset(ok, 0, n_mem);
        }
        kvhi_relock_after_copy(e);
        free(vals), free(crcs);
        for (size_t j = 0; j < n_mem; j++)
            kvhi_block_unhold_reading(e, u->copy_from[j]);
        busy_unlist(e, &busy);
        /* A copy that failed leaves a hole: close it. */
        size_t w = 0, j = 0;
        for (size_t k = 0; k < m; k++) {
            bool good = true;
            if (j < n_mem && mem_at[j] == k)
                good = ok[j++];
            if (!good) {
                t->dropped++;
                continue;
            }
            if (w != k) {
                uint8_t *spare = u->vals[w];
                u->vals[w] = u->vals[k];
                u->vals[k] = spare;
                u->crcs[w] = u->crcs[k];
                u->hashes[w] = u->hashes[k];
                u->parents[w] = u->parents[k];
                memmove(u->tokens + w * bt, u->tokens + k * bt, sizeof(int32_t) * bt);
                memcpy(u->keys[w], u->keys[k], KVHI_REMOTE_KEY_BYTES);
            }
            w++;
        }
        m = w;
    }
    free(mem_at), free(tiers), free(srcs), free(ok);
    return m;
}

static void set_cmd(kvhi_cluster_cmd *c, const char *key, const uint8_t *val, uint64_t vbytes, const char *ttl_text)
{
    kvhi_remote_cmd_key(c, "SET", key);
    /* Blocks are immutable: the first writer wins (NX). */
    const char *rest[4] = {(const char *)val, "NX", "EX", ttl_text};
    size_t lens[4] = {vbytes, 2, 2, strlen(ttl_text)};
    for (int a = 0; a < 4; a++) {
        c->argv[2 + a] = rest[a];
        c->argvlen[2 + a] = lens[a];
    }
    c->argc = 6;
}

void kvhi_remote_upload_blocks(kvh_engine *e, kvhi_cluster *via, const uint32_t *list, size_t n_full)
{
    kvhi_remote *r = e->remote;
    if (!r || n_full == 0)
        return;
    uint32_t bt = e->cfg.block_tokens;
    uint64_t vbytes = kvhi_remote_value_bytes(&r->id);
    size_t per = KVHI_REMOTE_ROUND_BYTES / vbytes ? (size_t)(KVHI_REMOTE_ROUND_BYTES / vbytes) : 1;
    if (per > KVHI_REMOTE_LOOKUP_MAX)
        per = KVHI_REMOTE_LOOKUP_MAX;
    size_t cap = n_full < per ? n_full : per;
    upload_bufs u = {0};
    kvhi_remote_tally t = {0};
    if (!bufs_alloc(&u, cap, bt)) {
        t.dropped += n_full;
        goto out;
    }
    kvhi_remote_take_spares(r, u.vals, cap);
    for (size_t i0 = 0; i0 < n_full; i0 += cap) {
        size_t n = n_full - i0 < cap ? n_full - i0 : cap;
        for (size_t k = 0; k < n; k++) {
            uint32_t b = list[i0 + k];
            kvhi_block *blk = &e->blocks[b];
            u.blocks[k] = b;
            u.hashes[k] = blk->hash;
            u.parents[k] = blk->parent_hash;
            memcpy(u.tokens + k * bt, kvhi_block_tokens(e, b), sizeof(int32_t) * bt);
            kvhi_remote_key(u.keys[k], &r->id, blk->hash, blk->parent_hash, u.tokens + k * bt);
            kvhi_remote_upload_ref(e, b); /* stays while the lock is dropped */
        }
        pthread_mutex_unlock(&e->lock);
        kvhi_remote_exists_round(r, via, u.keys, n, u.present, u.cmds, &t);
        pthread_mutex_lock(&e->lock);
        size_t m = prepare_values(e, &u, n, &t);
        pthread_mutex_unlock(&e->lock);
        for (size_t k = 0; k < m; k++) {
            kvhi_remote_value_encode_crc(u.vals[k], &r->id, u.hashes[k], u.parents[k], u.tokens + k * bt, u.crcs[k]);
            set_cmd(&u.cmds[k], u.keys[k], u.vals[k], vbytes, r->ttl_text);
        }
        if (m) {
            kvhi_cluster_report rep;
            kvhi_remote_run(r, via, u.cmds, m, &rep, NULL, NULL);
            kvhi_remote_tally_report(&t, &rep);
            for (size_t k = 0; k < m; k++) {
                /* OK, or nil: another engine stored it first. */
                if (reply_is(&u.cmds[k], KVHI_REPLY_STATUS) || reply_is(&u.cmds[k], KVHI_REPLY_NIL))
                    t.uploads++;
                else
                    t.dropped++;
            }
            kvhi_cluster_cmds_clear(r->cluster, u.cmds, m);
        }
        pthread_mutex_lock(&e->lock);
        for (size_t k = 0; k < n; k++)
            kvhi_remote_upload_unref(e, u.blocks[k]);
    }
out:
    kvhi_remote_tally_add(e, &t);
    if (u.vals)
        kvhi_remote_put_spares(r, u.vals, cap);
    bufs_free(&u);
}

void kvhi_remote_persist(kvh_engine *e, kvhi_seq *s)
{
    kvhi_remote_persist_blocks(e, s->blocks, (size_t)(s->n_tokens / e->cfg.block_tokens));
}

void kvhi_remote_persist_blocks(kvh_engine *e, const uint32_t *list, size_t n_full)
{
    kvhi_remote *r = e->remote;
    if (r && (r->upload & KVH_REMOTE_UPLOAD_PERSIST))
        kvhi_remote_upload_blocks(e, NULL, list, n_full);
}
