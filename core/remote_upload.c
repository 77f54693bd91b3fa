/* Uploads to the remote store (core/remote_tier.h). */
#include <stdlib.h>
#include <string.h>

#include "core/block.h"
#include "core/codec_tier.h"
#include "core/move.h"
#include "core/remote_cluster.h"
#include "core/remote_tier.h"

static bool reply_is(const kvhi_cluster_cmd *c, int kind) { return kvhi_cluster_reply(c, NULL, NULL, NULL) == kind; }

/* Copies block b's data, in the disk form, to dst (lock held; may drop
 * it to bring the block from disk). False when it cannot. */
static bool copy_out(kvh_engine *e, uint32_t b, uint8_t *dst)
{
    kvhi_block *blk = &e->blocks[b];
    kvhi_block_wait_idle(e, b);
    if (blk->tier == KVH_TIER_DISK) {
        if (kvhi_block_ensure_memory(e, b) != KVH_OK) {
            kvhi_clear_error();
            return false;
        }
        kvhi_block_wait_idle(e, b);
    }
    if (blk->tier == KVH_TIER_DISK || blk->tier >= KVH_TIER_COUNT)
        return false;
    return kvhi_block_copy(e, KVH_TIER_DISK, dst, blk->tier, kvhi_block_data(e, b)) == 0;
}

void kvhi_remote_persist(kvh_engine *e, kvhi_seq *s)
{
    kvhi_remote_persist_blocks(e, s->blocks, (size_t)(s->n_tokens / e->cfg.block_tokens));
}

void kvhi_remote_persist_blocks(kvh_engine *e, const uint32_t *list, size_t n_full)
{
    kvhi_remote *r = e->remote;
    if (!r || !(r->upload & KVH_REMOTE_UPLOAD_PERSIST))
        return;
    uint32_t bt = e->cfg.block_tokens;
    uint64_t vbytes = kvhi_remote_value_bytes(&r->id);
    size_t per = KVHI_REMOTE_ROUND_BYTES / vbytes ? (size_t)(KVHI_REMOTE_ROUND_BYTES / vbytes) : 1;
    if (per > KVHI_REMOTE_LOOKUP_MAX)
        per = KVHI_REMOTE_LOOKUP_MAX;
    size_t cap = n_full < per ? n_full : per;
    if (cap == 0)
        return;
    char(*keys)[KVHI_REMOTE_KEY_BYTES] = malloc(KVHI_REMOTE_KEY_BYTES * cap);
    uint64_t *hashes = malloc(sizeof(uint64_t) * cap), *parents = malloc(sizeof(uint64_t) * cap);
    int32_t *tk = malloc(sizeof(int32_t) * bt * cap);
    bool *present = malloc(cap);
    uint32_t *blocks = malloc(sizeof(uint32_t) * cap);
    kvhi_cluster_cmd *cmds = malloc(sizeof(kvhi_cluster_cmd) * cap);
    uint8_t **vals = calloc(cap, sizeof(uint8_t *));
    kvhi_remote_tally t = {0};
    if (!keys || !hashes || !parents || !tk || !present || !blocks || !cmds || !vals) {
        e->stats.remote_uploads_dropped += n_full;
        goto out;
    }
    kvhi_remote_take_spares(r, vals, cap);
    for (size_t i0 = 0; i0 < n_full; i0 += cap) {
        size_t n = n_full - i0 < cap ? n_full - i0 : cap;
        for (size_t k = 0; k < n; k++) {
            uint32_t b = list[i0 + k];
            kvhi_block *blk = &e->blocks[b];
            blocks[k] = b;
            hashes[k] = blk->hash;
            parents[k] = blk->parent_hash;
            memcpy(tk + k * bt, kvhi_block_tokens(e, b), sizeof(int32_t) * bt);
            kvhi_remote_key(keys[k], &r->id, blk->hash);
            blk->refs++; /* stays while the lock is dropped */
        }
        pthread_mutex_unlock(&e->lock);
        kvhi_remote_exists_round(r, keys, n, present, cmds, &t);
        pthread_mutex_lock(&e->lock);
        size_t m = 0; /* values to send, packed at the front */
        for (size_t k = 0; k < n; k++) {
            kvhi_block *blk = &e->blocks[blocks[k]];
            uint16_t need = KVHI_BF_HASHED | KVHI_BF_KV_COMPLETE;
            if (present[k] || (blk->flags & need) != need)
                continue;
            if (!vals[m] && !(vals[m] = malloc(vbytes))) {
                t.dropped++;
                continue;
            }
            if (!copy_out(e, blocks[k], vals[m] + KVHI_SLOT_HEADER_BYTES)) {
                t.dropped++;
                continue;
            }
            /* The header is encoded without the lock (a CRC of the data). */
            hashes[m] = hashes[k];
            parents[m] = parents[k];
            if (m != k) {
                memmove(tk + m * bt, tk + k * bt, sizeof(int32_t) * bt);
                memcpy(keys[m], keys[k], KVHI_REMOTE_KEY_BYTES);
            }
            m++;
        }
        pthread_mutex_unlock(&e->lock);
        for (size_t k = 0; k < m; k++) {
            kvhi_remote_value_encode(vals[k], &r->id, hashes[k], parents[k], tk + k * bt,
                                     vals[k] + KVHI_SLOT_HEADER_BYTES);
            kvhi_remote_cmd_key(&cmds[k], "SET", keys[k]);
            /* Blocks are immutable: the first writer wins (NX). */
            const char *rest[5] = {(const char *)vals[k], "NX", "EX", r->ttl_text};
            size_t lens[4] = {vbytes, 2, 2, strlen(r->ttl_text)};
            for (int a = 0; a < 4; a++) {
                cmds[k].argv[2 + a] = rest[a];
                cmds[k].argvlen[2 + a] = lens[a];
            }
            cmds[k].argc = 6;
        }
        if (m) {
            kvhi_cluster_report rep;
            kvhi_cluster_run(r->cluster, cmds, m, &rep);
            kvhi_remote_tally_report(&t, &rep);
            for (size_t k = 0; k < m; k++) {
                /* OK, or nil: another engine stored it first. */
                if (reply_is(&cmds[k], KVHI_REPLY_STATUS) || reply_is(&cmds[k], KVHI_REPLY_NIL))
                    t.uploads++;
                else
                    t.dropped++;
            }
            kvhi_cluster_cmds_clear(r->cluster, cmds, m);
        }
        pthread_mutex_lock(&e->lock);
        for (size_t k = 0; k < n; k++)
            kvhi_block_unref(e, blocks[k]);
    }
out:
    kvhi_remote_tally_add(e, &t);
    if (vals)
        kvhi_remote_put_spares(r, vals, cap);
    free(keys), free(hashes), free(parents), free(tk), free(present), free(blocks), free(cmds), free(vals);
}
