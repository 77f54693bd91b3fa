/* The remote tier inside the engine (core/remote_tier.h). */
#include "core/remote_tier.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/block.h"
#include "core/codec_tier.h"
#include "core/move.h"
#include "core/prefix_index.h"
#include "core/remote_cluster.h"
#include "core/scope.h"

/* Blocks asked about (EXISTS) in one round of a match; a 32k-token prefix
 * of 16-token blocks is 2048. */
#define LOOKUP_MAX 4096u
/* Value bytes fetched or sent in one round: bounds the memory a round
 * holds, not the round trips of a short prefix. */
#define ROUND_BYTES (64ull << 20)

static const char *const upload_names = "KVH_REMOTE_UPLOAD_PERSIST";

kvh_status kvhi_remote_validate(const kvh_config *c)
{
    if (!c->remote_addrs || !c->remote_addrs[0])
        return KVH_OK;
    if (c->remote_timeout_ms < 1 || c->remote_timeout_ms > 60000)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "remote_timeout_ms %u not in 1..60000", c->remote_timeout_ms);
    if (c->remote_ttl_s < 1 || c->remote_ttl_s > INT32_MAX)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "remote_ttl_s %u not in 1..2147483647", c->remote_ttl_s);
    if (c->remote_breaker_ms < 1 || c->remote_breaker_ms > 3600000)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "remote_breaker_ms %u not in 1..3600000", c->remote_breaker_ms);
    if (c->remote_upload &
        ~(uint32_t)(KVH_REMOTE_UPLOAD_PERSIST | KVH_REMOTE_UPLOAD_DEMOTE | KVH_REMOTE_UPLOAD_WRITE_THROUGH))
        return kvhi_fail(KVH_ERR_INVALID_ARG, "unknown remote_upload bits 0x%x", c->remote_upload);
    if (c->remote_upload & (KVH_REMOTE_UPLOAD_DEMOTE | KVH_REMOTE_UPLOAD_WRITE_THROUGH))
        return kvhi_fail(KVH_ERR_UNSUPPORTED,
                         "remote_upload 0x%x: uploads on demotion and write-through are not implemented yet (use %s)",
                         c->remote_upload, upload_names);
    if (c->remote_tls)
        return kvhi_fail(KVH_ERR_UNSUPPORTED,
                         "remote_tls: this build's Redis client (hiredis 0.14, Debian 12) has no TLS; reach the "
                         "cluster over a trusted network or a TLS tunnel (stunnel, spiped) on loopback");
    return KVH_OK;
}

static void cluster_log(void *user, int level, const char *text) { kvhi_log(user, level, "%s", text); }

static kvh_status open_remote(const kvh_config *cfg, kvh_engine *log_to, const kvhi_remote_id *id, kvhi_remote **out)
{
    kvh_status st = kvhi_remote_validate(cfg);
    if (st != KVH_OK)
        return st;
    if (!cfg->remote_addrs || !cfg->remote_addrs[0])
        return kvhi_fail(KVH_ERR_INVALID_ARG, "no remote address given (remote_addrs)");
    kvhi_remote *r = calloc(1, sizeof(*r));
    if (!r)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for the remote tier");
    r->id = *id;
    pthread_mutex_init(&r->spare_lock, NULL);
    r->upload = cfg->remote_upload;
    r->engine = log_to;
    snprintf(r->ttl_text, sizeof(r->ttl_text), "%u", cfg->remote_ttl_s);
    kvhi_cluster_opts o = {.addrs = cfg->remote_addrs,
                           .user = cfg->remote_user,
                           .password = cfg->remote_password,
                           .timeout_ms = cfg->remote_timeout_ms,
                           .breaker_ms = cfg->remote_breaker_ms,
                           .log = log_to ? cluster_log : NULL,
                           .log_user = log_to};
    char err[320];
    if (kvhi_cluster_open(&o, &r->cluster, err, sizeof(err)) != 0) {
        pthread_mutex_destroy(&r->spare_lock);
        free(r);
        kvh_status code = strstr(err, "AUTH")      ? KVH_ERR_IO
                          : strstr(err, "hiredis") ? KVH_ERR_UNSUPPORTED
                          : strstr(err, "memory")  ? KVH_ERR_NOMEM
                                                   : KVH_ERR_INVALID_ARG;
        return kvhi_fail(code, "%s", err);
    }
    *out = r;
    return KVH_OK;
}

/* The identity of cfg's blocks in the store: the disk tier's geometry
 * (codec included), so a store shared by engines of other models, layouts
 * or codecs never mixes their blocks. */
static kvhi_remote_id id_of(const kvh_config *cfg, uint64_t data_bytes)
{
    kvhi_disk_geometry g = {
        cfg->num_layers, cfg->num_kv_heads, cfg->head_dim, cfg->block_tokens, cfg->dtype | cfg->kv_codec << 16,
        cfg->model_salt, data_bytes};
    return (kvhi_remote_id){.model_salt = cfg->model_salt,
                            .geo_tag = kvhi_disk_geometry_tag(&g),
                            .block_bytes = data_bytes,
                            .block_tokens = cfg->block_tokens};
}

kvh_status kvhi_remote_tier_open(kvh_engine *e, const kvh_config *cfg)
{
    if (!cfg->remote_addrs || !cfg->remote_addrs[0])
        return KVH_OK;
    kvhi_remote_id id = id_of(cfg, e->tiers[KVH_TIER_DISK].slot_bytes);
    return open_remote(cfg, e, &id, &e->remote);
}

void kvhi_remote_tier_close(kvh_engine *e)
{
    kvhi_remote_close_client(e->remote);
    e->remote = NULL;
}

kvh_status kvhi_remote_open_client(const kvh_config *cfg, kvhi_remote **out)
{
    /* The disk form's size, as an engine of cfg would compute it. */
    kvh_engine probe;
    memset(&probe, 0, sizeof(probe));
    probe.cfg = *cfg;
    probe.elem_bytes = kvhi_dtype_bytes(cfg->dtype);
    if (!probe.elem_bytes)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "unknown dtype %u", cfg->dtype);
    probe.block_bytes =
        2ull * cfg->num_kv_heads * cfg->block_tokens * cfg->head_dim * probe.elem_bytes * cfg->num_layers;
    kvh_status st = kvhi_codec_tiers_init(&probe);
    if (st != KVH_OK)
        return st;
    kvhi_remote_id id = id_of(cfg, probe.tiers[KVH_TIER_DISK].slot_bytes);
    return open_remote(cfg, NULL, &id, out);
}

void kvhi_remote_close_client(kvhi_remote *r)
{
    if (!r)
        return;
    kvhi_cluster_close(r->cluster);
    for (size_t i = 0; i < r->n_spare; i++)
        free(r->spare[i]);
    free(r->spare);
    pthread_mutex_destroy(&r->spare_lock);
    free(r);
}

/* The spare buffers, at most cap of them, for one upload (the rest of
 * vals NULL); given back by put_spares. Lock not needed. */
static void take_spares(kvhi_remote *r, uint8_t **vals, size_t cap)
{
    pthread_mutex_lock(&r->spare_lock);
    size_t n = r->n_spare < cap ? r->n_spare : cap;
    r->n_spare -= n;
    if (n)
        memcpy(vals, r->spare + r->n_spare, n * sizeof(uint8_t *));
    pthread_mutex_unlock(&r->spare_lock);
}

/* Keeps up to ROUND_BYTES of vals' buffers for the next upload. */
static void put_spares(kvhi_remote *r, uint8_t **vals, size_t n)
{
    size_t keep = (size_t)(ROUND_BYTES / kvhi_remote_value_bytes(&r->id));
    keep = keep ? keep : 1;
    pthread_mutex_lock(&r->spare_lock);
    if (!r->spare)
        r->spare = calloc(keep, sizeof(uint8_t *));
    for (size_t i = 0; i < n; i++) {
        if (vals[i] && r->spare && r->n_spare < keep)
            r->spare[r->n_spare++] = vals[i];
        else
            free(vals[i]);
        vals[i] = NULL;
    }
    pthread_mutex_unlock(&r->spare_lock);
}

/* ---- rounds ---- */

static void cmd_key(kvhi_cluster_cmd *c, const char *verb, const char *key)
{
    memset(c, 0, sizeof(*c));
    c->argc = 2;
    c->argv[0] = verb;
    c->argvlen[0] = strlen(verb);
    c->argv[1] = key;
    c->argvlen[1] = KVHI_REMOTE_KEY_LEN;
}

static bool reply_is(const kvhi_cluster_cmd *c, int kind) { return kvhi_cluster_reply(c, NULL, NULL, NULL) == kind; }

/* Counters of one call, added to the engine's under the lock. */
typedef struct tally {
    uint64_t hits, misses, corrupt, uploads, dropped, timeouts, breaker_opens;
} tally;

static void tally_report(tally *t, const kvhi_cluster_report *rep)
{
    t->timeouts += rep->timeouts;
    t->breaker_opens += rep->breaker_opens;
}

static void tally_add(kvh_engine *e, const tally *t)
{
    e->stats.remote_hits += t->hits;
    e->stats.remote_misses += t->misses;
    e->stats.remote_corrupt += t->corrupt;
    e->stats.remote_uploads += t->uploads;
    e->stats.remote_uploads_dropped += t->dropped;
    e->stats.remote_timeouts += t->timeouts;
    e->stats.remote_breaker_opens += t->breaker_opens;
}

/* How many of keys[0..n) exist, leading ones only when `leading` (a
 * prefix stops at its first gap); present[i] says which. Lock not held. */
static size_t exists_round(kvhi_remote *r, char (*keys)[KVHI_REMOTE_KEY_BYTES], size_t n, bool *present,
                           kvhi_cluster_cmd *cmds, tally *t)
{
    for (size_t i = 0; i < n; i++)
        cmd_key(&cmds[i], "EXISTS", keys[i]);
    kvhi_cluster_report rep;
    kvhi_cluster_run(r->cluster, cmds, n, &rep);
    tally_report(t, &rep);
    size_t yes = 0;
    for (size_t i = 0; i < n; i++) {
        long long v = 0;
        present[i] = kvhi_cluster_reply(&cmds[i], NULL, NULL, &v) == KVHI_REPLY_INTEGER && v == 1;
        yes += present[i];
    }
    kvhi_cluster_cmds_clear(r->cluster, cmds, n);
    return yes;
}

/* ---- the prefix match ---- */

/* Attaches block i of s from a verified value (lock held; may drop it
 * to make room). False when no memory tier can take it. */
static bool attach(kvh_engine *e, kvhi_seq *s, size_t i, const uint8_t *data, uint64_t hash, uint64_t parent,
                   const int32_t *tk)
{
    uint32_t bt = e->cfg.block_tokens;
    uint32_t b = kvhi_prefix_find(&e->prefix, hash);
    if (b != KVHI_PREFIX_MISS && e->blocks[b].parent_hash == parent &&
        memcmp(kvhi_block_tokens(e, b), tk, sizeof(int32_t) * bt) == 0) {
        /* Published here while the lock was dropped: share that one. */
        e->blocks[b].refs++;
        kvhi_block_touch(e, b);
    } else {
        uint32_t to = e->tiers[KVH_TIER_HOST].present ? KVH_TIER_HOST : KVH_TIER_DEVICE;
        if (kvhi_block_new(e, s->agent, to, &b) != KVH_OK) {
            kvhi_clear_error();
            return false;
        }
        kvhi_block *blk = &e->blocks[b];
        if (kvhi_block_copy(e, blk->tier, kvhi_block_data(e, b), KVH_TIER_DISK, data) != 0) {
            kvhi_block_unref(e, b);
            return false;
        }
        memcpy(kvhi_block_tokens(e, b), tk, sizeof(int32_t) * bt);
        blk->n_tokens = (uint16_t)bt;
        blk->hash = hash;
        blk->parent_hash = parent;
        blk->flags |= KVHI_BF_HASHED | KVHI_BF_KV_COMPLETE;
        kvhi_block_try_publish(e, b);
    }
    s->blocks[i] = b;
    s->held[i] = 0;
    s->pins[i] = 0;
    s->n_blocks = (uint32_t)i + 1;
    s->n_tokens = (uint64_t)(i + 1) * bt;
    e->stats.prefix_hit_blocks++;
    e->stats.prefix_hit_tokens += bt;
    return true;
}

/* What the checks of one GETEX round need; verdict[k] is 0 for a value
 * that verified, 1 for none (nil, node down), else its reason code. */
typedef struct fetch {
    const kvhi_remote *r;
    const uint64_t *hashes; /* hashes[k] parent of block k of the round */
    const int32_t *tokens;  /* block 0's tokens */
    uint32_t bt;
    int *verdict;
    const char **why;
} fetch;

/* Checks each value as its reply arrives, while later ones are still on
 * the wire (no engine lock here). */
static void check_reply(void *user, size_t k, const kvhi_cluster_cmd *cmd)
{
    fetch *f = user;
    const char *val;
    size_t len;
    if (kvhi_cluster_reply(cmd, &val, &len, NULL) != KVHI_REPLY_STRING) {
        f->verdict[k] = 1;
        return;
    }
    kvhi_remote_expect ex = {.hash = f->hashes[k + 1], .parent = f->hashes[k], .tokens = f->tokens + k * f->bt};
    int rc = kvhi_remote_value_check(val, len, &f->r->id, &ex, &f->why[k]);
    f->verdict[k] = rc < 0 ? rc : rc ? -100 : 0;
}

/* Attaches to s the blocks [matched, n_blocks) that the store holds, in
 * scope sc (NULL: the default), the first with parent hash `parent`. */
static size_t continue_match(kvh_engine *e, kvhi_seq *s, const kvhi_scope *sc, const int32_t *tokens, size_t n_blocks,
                             size_t matched, uint64_t parent)
{
    kvhi_remote *r = e->remote;
    uint32_t bt = e->cfg.block_tokens;
    size_t want = n_blocks - matched;
    if (want > LOOKUP_MAX)
        want = LOOKUP_MAX;
    if (!r || want == 0)
        return matched;
    uint64_t vbytes = kvhi_remote_value_bytes(&r->id);
    size_t per = ROUND_BYTES / vbytes ? (size_t)(ROUND_BYTES / vbytes) : 1;
    uint64_t *hashes = malloc(sizeof(uint64_t) * (want + 1));
    char(*keys)[KVHI_REMOTE_KEY_BYTES] = malloc(KVHI_REMOTE_KEY_BYTES * want);
    bool *present = malloc(want);
    kvhi_cluster_cmd *cmds = malloc(sizeof(kvhi_cluster_cmd) * want);
    const char **why = calloc(want, sizeof(*why));
    int *verdict = malloc(sizeof(int) * want);
    if (!hashes || !keys || !present || !cmds || !why || !verdict) {
        free(hashes), free(keys), free(present), free(cmds), free(why), free(verdict);
        return matched;
    }
    /* hashes[k] is the parent of block matched + k. */
    hashes[0] = parent;
    kvhi_scope scope = sc ? *sc : (kvhi_scope){0};
    uint64_t salt = e->cfg.model_salt;
    tally t = {0};
    pthread_mutex_unlock(&e->lock);

    for (size_t k = 0; k < want; k++) {
        size_t i = matched + k;
        hashes[k + 1] =
            kvhi_prefix_hash(hashes[k], tokens + i * bt, bt, kvhi_scope_block_salt(salt, sc ? &scope : NULL, i, bt));
        kvhi_remote_key(keys[k], &r->id, hashes[k + 1]);
    }
    exists_round(r, keys, want, present, cmds, &t);
    size_t run = 0;
    while (run < want && present[run])
        run++;
    if (run < want)
        t.misses++; /* where the prefix stops */

    size_t done = 0; /* blocks attached */
    bool stop = run == 0;
    for (size_t w0 = 0; w0 < run && !stop; w0 += per) {
        size_t n = run - w0 < per ? run - w0 : per;
        for (size_t k = 0; k < n; k++) {
            cmd_key(&cmds[k], "GETEX", keys[w0 + k]);
            /* A hit renews the block's lifetime in the same round. */
            cmds[k].argc = 4;
            cmds[k].argv[2] = "EX";
            cmds[k].argvlen[2] = 2;
            cmds[k].argv[3] = r->ttl_text;
            cmds[k].argvlen[3] = strlen(r->ttl_text);
        }
        kvhi_cluster_report rep;
        for (size_t k = 0; k < n; k++)
            verdict[k] = 1; /* no reply yet */
        fetch f = {.r = r,
                   .hashes = hashes + w0,
                   .tokens = tokens + (matched + w0) * bt,
                   .bt = bt,
                   .verdict = verdict,
                   .why = why + w0};
        kvhi_cluster_run_each(r->cluster, cmds, n, &rep, check_reply, &f);
        tally_report(&t, &rep);
        /* The leading values that verify; the first that does not ends
         * the match (evicted since the EXISTS: nil; damaged: deleted). */
        size_t good = 0;
        for (; good < n; good++) {
            size_t k = w0 + good;
            if (verdict[good] == 1) {
                t.misses++;
                break;
            }
            if (verdict[good] != 0) {
                t.misses++;
                t.corrupt++;
                kvhi_cluster_cmd del;
                cmd_key(&del, "DEL", keys[k]);
                kvhi_cluster_report drep;
                kvhi_cluster_run(r->cluster, &del, 1, &drep);
                tally_report(&t, &drep);
                kvhi_cluster_cmds_clear(r->cluster, &del, 1);
                kvhi_log(e, KVH_LOG_WARN, "remote tier: %s failed verification (%s): deleted, a miss", keys[k], why[k]);
                break;
            }
        }
        pthread_mutex_lock(&e->lock);
        size_t placed = 0;
        while (placed < good) {
            size_t k = w0 + placed;
            const char *val;
            size_t len;
            kvhi_cluster_reply(&cmds[placed], &val, &len, NULL);
            if (!attach(e, s, matched + k, (const uint8_t *)val + KVHI_SLOT_HEADER_BYTES, hashes[k + 1], hashes[k],
                        tokens + (matched + k) * bt))
                break;
            placed++;
        }
        done += placed;
        t.hits += placed;
        stop = placed < n;
        pthread_mutex_unlock(&e->lock);
        kvhi_cluster_cmds_clear(r->cluster, cmds, n);
    }
    pthread_mutex_lock(&e->lock);
    tally_add(e, &t);
    free(hashes), free(keys), free(present), free(cmds), free(why), free(verdict);
    return matched + done;
}

size_t kvhi_remote_match(kvh_engine *e, kvhi_seq *s, const int32_t *tokens, size_t n_blocks, size_t matched)
{
    uint64_t parent = matched ? e->blocks[s->blocks[matched - 1]].hash : 0;
    return continue_match(e, s, &s->scope, tokens, n_blocks, matched, parent);
}

size_t kvhi_remote_lookup(kvh_engine *e, const kvhi_scope *sc, const int32_t *tokens, size_t n_blocks, size_t found,
                          uint64_t parent, kvh_block *out)
{
    /* The blocks go into a sequence of no one's, then out as handles. */
    kvhi_seq tmp;
    memset(&tmp, 0, sizeof(tmp));
    tmp.blocks = calloc(n_blocks, sizeof(uint32_t));
    tmp.held = calloc(n_blocks, sizeof(uint32_t));
    tmp.pins = calloc(n_blocks, sizeof(uint32_t));
    size_t got = found;
    if (tmp.blocks && tmp.held && tmp.pins)
        got = continue_match(e, &tmp, sc, tokens, n_blocks, found, parent);
    for (size_t i = found; i < got; i++) {
        uint32_t b = tmp.blocks[i];
        kvhi_block_ref_handle(e, b); /* before the sequence's reference goes */
        kvhi_block_unref(e, b);
        out[i].id = kvhi_block_handle(e, b);
    }
    free(tmp.blocks), free(tmp.held), free(tmp.pins);
    return got;
}

/* ---- uploads ---- */

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
    size_t per = ROUND_BYTES / vbytes ? (size_t)(ROUND_BYTES / vbytes) : 1;
    if (per > LOOKUP_MAX)
        per = LOOKUP_MAX;
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
    tally t = {0};
    if (!keys || !hashes || !parents || !tk || !present || !blocks || !cmds || !vals) {
        e->stats.remote_uploads_dropped += n_full;
        goto out;
    }
    take_spares(r, vals, cap);
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
        exists_round(r, keys, n, present, cmds, &t);
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
            cmd_key(&cmds[k], "SET", keys[k]);
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
            tally_report(&t, &rep);
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
    tally_add(e, &t);
    if (vals)
        put_spares(r, vals, cap);
    free(keys), free(hashes), free(parents), free(tk), free(present), free(blocks), free(cmds), free(vals);
}
