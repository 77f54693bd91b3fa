/* The continuation of a prefix match into the remote store
 * (core/remote_tier.h). One EXISTS round finds how far the store holds
 * the prefix; then, per window of at most KVHI_REMOTE_ROUND_BYTES, the
 * destination blocks are claimed under the engine lock (new, held, not
 * published), the values fetched with GETEX and each checked and copied
 * into its block as it is parsed, from the client's read buffer and
 * without the lock (no reply object holds a copy of it); the
 * leading blocks that verified are published under the lock. A block
 * whose value failed is never seen by anyone: it is given back. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/block.h"
#include "core/codec_tier.h"
#include "core/move.h"
#include "core/prefix_index.h"
#include "core/remote_cluster.h"
#include "core/remote_tier.h"
#include "core/scope.h"

/* What became of the value of one block of a window. */
enum {
    VALUE_OK = 0,      /* verified and in its block */
    VALUE_ABSENT = 1,  /* nil (evicted since the EXISTS), node down, no reply */
    VALUE_UNCOPIED = 2 /* verified, but the copy into its tier failed */
    /* negative: failed verification (kvhi_remote_value_check's code) */
};

typedef struct window {
    kvh_engine *e;
    const kvhi_remote_id *id;
    const uint64_t *hashes; /* hashes[k]: parent of block k; hashes[k + 1]: its hash */
    const int32_t *tokens;  /* block 0's tokens */
    uint32_t bt;
    bool direct[KVH_TIER_COUNT]; /* the tier's form is the value's: copy while checksumming */
    const uint8_t *tier;         /* each claimed block's tier */
    uint8_t **dst;               /* each claimed block's data */
    int *verdict;                /* VALUE_* */
    const char **why;
} window;

/* Checks value k as it is parsed, straight from the client's read
 * buffer, and copies it into its block (no engine lock: the block is held
 * and nobody else knows it). */
static void take_value(void *user, size_t k, const char *val, size_t len)
{
    window *w = user;
    kvhi_remote_expect ex = {.hash = w->hashes[k + 1], .parent = w->hashes[k], .tokens = w->tokens + k * w->bt};
    uint32_t tier = w->tier[k];
    int rc = w->direct[tier] ? kvhi_remote_value_check_copy(val, len, w->dst[k], w->id, &ex, &w->why[k])
                             : kvhi_remote_value_check(val, len, w->id, &ex, &w->why[k]);
    if (rc != 0)
        w->verdict[k] = rc < 0 ? rc : -100; /* every failed check is negative; any other too */
    else if (!w->direct[tier] &&
             kvhi_block_copy(w->e, tier, w->dst[k], KVH_TIER_DISK, val + KVHI_SLOT_HEADER_BYTES) != 0)
        w->verdict[k] = VALUE_UNCOPIED;
    else
        w->verdict[k] = VALUE_OK;
}

/* Claims up to n new blocks for a window (lock held; may drop it to make
 * room): referenced once and held, so nothing evicts them meanwhile.
 * Returns how many it got. */
static size_t claim(kvh_engine *e, uint32_t agent, size_t n, uint32_t *blocks)
{
    uint32_t to = e->tiers[KVH_TIER_HOST].present ? KVH_TIER_HOST : KVH_TIER_DEVICE;
    size_t k = 0;
    for (; k < n; k++) {
        if (kvhi_block_new(e, agent, to, &blocks[k]) != KVH_OK) {
            kvhi_clear_error();
            break;
        }
        kvhi_block_hold(e, blocks[k]);
    }
    return k;
}

/* Gives back a claimed block (lock held). */
static void unclaim(kvh_engine *e, uint32_t b)
{
    kvhi_block_unhold(e, b);
    kvhi_block_unref(e, b);
}

/* Makes claimed block b, verified, block i of s (lock held). When another
 * thread published the same block meanwhile, s shares that one. */
static void attach(kvh_engine *e, kvhi_seq *s, size_t i, uint32_t b, uint64_t hash, uint64_t parent, const int32_t *tk)
{
    uint32_t bt = e->cfg.block_tokens;
    uint32_t have = kvhi_block_find_published(e, hash, parent, tk);
    if (have != KVHI_PREFIX_MISS && e->blocks[have].refs < UINT32_MAX) {
        unclaim(e, b);
        b = have;
        kvhi_block_ref(e, b);
        kvhi_block_touch(e, b);
    } else {
        kvhi_block *blk = &e->blocks[b];
        memcpy(kvhi_block_tokens(e, b), tk, sizeof(int32_t) * bt);
        blk->n_tokens = (uint16_t)bt;
        blk->hash = hash;
        blk->parent_hash = parent;
        blk->flags |= KVHI_BF_HASHED | KVHI_BF_KV_COMPLETE;
        /* Published as kvhi_block_try_publish does, but not queued for
         * upload: the store is where it came from. */
        kvhi_block_publish_unique(e, b);
        kvhi_block_unhold(e, b);
    }
    s->blocks[i] = b;
    s->held[i] = 0;
    s->pins[i] = 0;
    s->n_blocks = (uint32_t)i + 1;
    s->n_tokens = (uint64_t)(i + 1) * bt;
    e->stats.prefix_hit_blocks++;
    e->stats.prefix_hit_tokens += bt;
}

/* Deletes the key of a value that failed verification (no lock). */
/* Deletes key; false when the store refused (an ACL user without DEL,
 * say) or did not answer, with why. */
static bool delete_key(kvhi_remote *r, const char *key, kvhi_remote_tally *t, char *why, size_t why_len)
{
    kvhi_cluster_cmd del;
    kvhi_remote_cmd_key(&del, "DEL", key);
    kvhi_cluster_report rep;
    kvhi_remote_run(r, NULL, &del, 1, &rep, NULL, NULL);
    kvhi_remote_tally_report(t, &rep);
    const char *text = NULL;
    size_t len = 0;
    int kind = kvhi_cluster_reply(&del, &text, &len, NULL);
    bool done = kind == KVHI_REPLY_INTEGER;
    if (!done)
        snprintf(why, why_len, "%.*s", kind == KVHI_REPLY_ERROR && text ? (int)(len < 120 ? len : 120) : 11,
                 kind == KVHI_REPLY_ERROR && text ? text : "no answer");
    kvhi_cluster_cmds_clear(r->cluster, &del, 1);
    return done;
}

static void getex_cmd(kvhi_cluster_cmd *c, const char *key, const char *ttl_text)
{
    kvhi_remote_cmd_key(c, "GETEX", key);
    /* A hit renews the block's lifetime in the same round. */
    c->argc = 4;
    c->argv[2] = "EX";
    c->argvlen[2] = 2;
    c->argv[3] = ttl_text;
    c->argvlen[3] = strlen(ttl_text);
}

/* The buffers of one match. */
typedef struct match_bufs {
    uint64_t *hashes;
    char (*keys)[KVHI_REMOTE_KEY_BYTES];
    int8_t *present;
    kvhi_cluster_cmd *cmds;
    const char **why;
    int *verdict;
    uint32_t *blocks;
    uint8_t **dst;
    uint8_t *tier;
} match_bufs;

static void bufs_free(match_bufs *m)
{
    free(m->hashes), free(m->keys), free(m->present), free(m->cmds), free(m->why), free(m->verdict), free(m->blocks),
        free(m->dst), free(m->tier);
}

static bool bufs_alloc(match_bufs *m, size_t want, size_t per)
{
    m->hashes = malloc(sizeof(uint64_t) * (want + 1));
    m->keys = malloc(KVHI_REMOTE_KEY_BYTES * want);
    m->present = malloc(want);
    m->cmds = malloc(sizeof(kvhi_cluster_cmd) * want);
    m->why = calloc(want, sizeof(*m->why));
    m->verdict = malloc(sizeof(int) * per);
    m->blocks = malloc(sizeof(uint32_t) * per);
    m->dst = malloc(sizeof(uint8_t *) * per);
    m->tier = malloc(per);
    return m->hashes && m->keys && m->present && m->cmds && m->why && m->verdict && m->blocks && m->dst && m->tier;
}

/* Fetches the values of blocks [w0, w0 + n) of the run into claimed
 * blocks and attaches the leading ones that verified to s as blocks
 * matched + w0 + ... (lock held on entry and return; dropped for the
 * network). Returns how many it attached; *ended when the match ends
 * here (no room for one block, or one that failed), not merely fewer
 * blocks claimed than asked: memory tiers that held fewer now make room
 * for the next window by sending the ones attached down to disk. */
static size_t fetch_window(kvh_engine *e, kvhi_seq *s, match_bufs *m, const int32_t *tokens, size_t matched, size_t w0,
                           size_t n, kvhi_remote_tally *t, bool *ended)
{
    kvhi_remote *r = e->remote;
    uint32_t bt = e->cfg.block_tokens;
    n = claim(e, s->agent, n, m->blocks);
    *ended = n == 0;
    if (n == 0)
        return 0;
    window w = {.e = e,
                .id = &r->id,
                .hashes = m->hashes + w0,
                .tokens = tokens + (matched + w0) * bt,
                .bt = bt,
                .tier = m->tier,
                .verdict = m->verdict,
                .why = m->why + w0,
                .dst = m->dst};
    for (uint32_t tr = 0; tr < KVH_TIER_COUNT; tr++)
        w.direct[tr] = e->tiers[tr].encoded == e->tiers[KVH_TIER_DISK].encoded &&
                       (tr == KVH_TIER_HOST || (tr == KVH_TIER_DEVICE && e->device_host_addressable));
    for (size_t k = 0; k < n; k++) {
        m->dst[k] = kvhi_block_data(e, m->blocks[k]);
        m->tier[k] = e->blocks[m->blocks[k]].tier;
        m->verdict[k] = VALUE_ABSENT; /* until its reply says otherwise */
        getex_cmd(&m->cmds[k], m->keys[w0 + k], r->ttl_text);
    }
    kvhi_unlock_for_copy(e);
    kvhi_cluster_report rep;
    kvhi_remote_run(r, NULL, m->cmds, n, &rep, take_value, &w);
    kvhi_remote_tally_report(t, &rep);
    /* A key of another type (a list, say, set by another client) answers
     * GETEX with WRONGTYPE: not a value, and it would stay (no TTL) and
     * stop every match of this prefix there. Deleted and counted as any
     * value that fails verification. */
    for (size_t k = 0; k < n; k++) {
        const char *msg = NULL;
        size_t len = 0;
        if (m->verdict[k] == VALUE_ABSENT && kvhi_cluster_reply(&m->cmds[k], &msg, &len, NULL) == KVHI_REPLY_ERROR &&
            msg && len >= 9 && !strncmp(msg, "WRONGTYPE", 9)) {
            m->verdict[k] = -100;
            m->why[w0 + k] = "the key holds another type than a string";
        }
        /* A value longer than a block's, not read to its end: damaged or
         * another writer's, and it would cost every match of the prefix
         * that much reading. */
        if (m->verdict[k] == VALUE_ABSENT && m->cmds[k].result == KVHI_CMD_TOO_LARGE) {
            m->verdict[k] = -101;
            m->why[w0 + k] = "a value longer than a block's";
        }
    }
    kvhi_cluster_cmds_clear(r->cluster, m->cmds, n);
    size_t good = 0;
    while (good < n && m->verdict[good] == VALUE_OK)
        good++;
    if (good < n) {
        if (m->verdict[good] < 0) {
            t->corrupt++;
            char refused[160];
            if (delete_key(r, m->keys[w0 + good], t, refused, sizeof(refused)))
                kvhi_log(e, KVH_LOG_WARN, "remote tier: %s failed verification (%s): deleted, a miss",
                         m->keys[w0 + good], m->why[w0 + good]);
            else
                kvhi_log(e, KVH_LOG_WARN, "remote tier: %s failed verification (%s): a miss; deleting it failed (%s)",
                         m->keys[w0 + good], m->why[w0 + good], refused);
        }
    }
    kvhi_relock_after_copy(e);
    for (size_t k = 0; k < n; k++) {
        size_t i = matched + w0 + k;
        if (k < good)
            attach(e, s, i, m->blocks[k], m->hashes[w0 + k + 1], m->hashes[w0 + k], tokens + i * bt);
        else
            unclaim(e, m->blocks[k]);
    }
    t->hits += good;
    *ended = good < n;
    return good;
}

/* Attaches to s the blocks [matched, n_blocks) that the store holds, in
 * scope sc (NULL: the default), the first with parent hash `parent`. */
static size_t continue_match(kvh_engine *e, kvhi_seq *s, const kvhi_scope *sc, const int32_t *tokens, size_t n_blocks,
                             size_t matched, uint64_t parent)
{
    kvhi_remote *r = e->remote;
    uint32_t bt = e->cfg.block_tokens;
    size_t want = n_blocks - matched;
    if (want > KVHI_REMOTE_LOOKUP_MAX)
        want = KVHI_REMOTE_LOOKUP_MAX;
    if (!r || want == 0)
        return matched;
    uint64_t vbytes = kvhi_remote_value_bytes(&r->id);
    size_t per = KVHI_REMOTE_ROUND_BYTES / vbytes ? (size_t)(KVHI_REMOTE_ROUND_BYTES / vbytes) : 1;
    if (per > want)
        per = want;
    match_bufs m = {0};
    if (!bufs_alloc(&m, want, per)) {
        bufs_free(&m);
        return matched;
    }
    /* hashes[k] is the parent of block matched + k. */
    m.hashes[0] = parent;
    kvhi_scope scope = sc ? *sc : (kvhi_scope){0};
    uint64_t salt = e->cfg.model_salt;
    kvhi_remote_tally t = {0};
    pthread_mutex_unlock(&e->lock);
    for (size_t k = 0; k < want; k++) {
        size_t i = matched + k;
        m.hashes[k + 1] =
            kvhi_prefix_hash(m.hashes[k], tokens + i * bt, bt, kvhi_scope_block_salt(salt, sc ? &scope : NULL, i, bt));
        kvhi_remote_key(m.keys[k], &r->id, m.hashes[k + 1], m.hashes[k], tokens + i * bt);
    }
    kvhi_remote_exists_round(r, NULL, m.keys, want, m.present, m.cmds, &t);
    size_t run = 0;
    while (run < want && m.present[run] == 1)
        run++;
    pthread_mutex_lock(&e->lock);
    size_t done = 0;
    for (size_t w0 = 0; w0 < run;) {
        size_t n = run - w0 < per ? run - w0 : per;
        bool ended = false;
        size_t got = fetch_window(e, s, &m, tokens, matched, w0, n, &t, &ended);
        done += got;
        w0 += got;
        if (ended)
            break;
    }
    /* Every block sought and not brought: absent, after an absent one,
     * failing verification, late, or without room to land in. */
    t.misses += want - done;
    kvhi_remote_tally_add(e, &t);
    bufs_free(&m);
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
