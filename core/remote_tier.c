/* The remote tier inside the engine (core/remote_tier.h). */
#include "core/remote_tier.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/block.h"
#include "core/codec_tier.h"
#include "core/move.h"
#include "core/prefix_index.h"
#include "core/remote_cluster.h"
#include "core/scope.h"

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
    /* One breaker a node for all the clients below: a node that fails is
     * counted, logged and probed once for the engine. */
    r->breakers = kvhi_breakers_new();
    if (!r->breakers) {
        pthread_mutex_destroy(&r->spare_lock);
        free(r);
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for the remote tier");
    }
    kvhi_cluster_opts o = {.addrs = cfg->remote_addrs,
                           .user = cfg->remote_user,
                           .password = cfg->remote_password,
                           .timeout_ms = cfg->remote_timeout_ms,
                           .breaker_ms = cfg->remote_breaker_ms,
                           .log = log_to ? cluster_log : NULL,
                           .log_user = log_to,
                           .breakers = r->breakers,
                           /* a value and its RESP framing ($<length>\r\n...\r\n) */
                           .max_reply_bytes = (size_t)kvhi_remote_value_bytes(id) + 64};
    char err[320];
    bool background = cfg->remote_upload & (KVH_REMOTE_UPLOAD_DEMOTE | KVH_REMOTE_UPLOAD_WRITE_THROUGH);
    /* An engine's threads get several clients; background uploads one of
     * their own: their rounds (up to KVHI_REMOTE_ROUND_BYTES) then never
     * hold up a match's. */
    uint32_t want = log_to ? KVHI_REMOTE_CLIENTS : 1;
    int failed = 0;
    for (uint32_t i = 0; i < want && !failed; i++) {
        if ((failed = kvhi_cluster_open(&o, &r->clients[i], err, sizeof(err))) != 0)
            break;
        r->n_clients++;
        /* The others start where the first found an answer, or wait for
         * first use where it found none: seeds that stall cost one
         * deadline each at open, not one per client. */
        if (i == 0) {
            int32_t seed = kvhi_cluster_seed_answered(r->clients[0]);
            o.first_seed = seed >= 0 ? seed : KVHI_CLUSTER_SEEDS_LATER;
        }
    }
    if (!failed && background)
        failed = kvhi_cluster_open(&o, &r->upload_cluster, err, sizeof(err));
    if (failed) {
        for (uint32_t i = 0; i < r->n_clients; i++)
            kvhi_cluster_close(r->clients[i]);
        kvhi_breakers_free(r->breakers);
        pthread_mutex_destroy(&r->spare_lock);
        free(r);
        kvh_status code = failed == KVHI_CLUSTER_AUTH_REFUSED ? KVH_ERR_IO
                          : failed == KVHI_CLUSTER_NO_CLIENT  ? KVH_ERR_UNSUPPORTED
                          : failed == KVHI_CLUSTER_NO_MEMORY  ? KVH_ERR_NOMEM
                                                              : KVH_ERR_INVALID_ARG;
        return kvhi_fail(code, "%s", err);
    }
    /* Seeds that failed at open opened their breakers: counted as any. */
    uint32_t opened = r->upload_cluster ? kvhi_cluster_take_breaker_opens(r->upload_cluster) : 0;
    for (uint32_t i = 0; i < r->n_clients; i++)
        opened += kvhi_cluster_take_breaker_opens(r->clients[i]);
    if (log_to)
        log_to->stats.remote_breaker_opens += opened;
    r->cluster = r->clients[0];
    r->clients_free = (1u << r->n_clients) - 1;
    pthread_mutex_init(&r->client_lock, NULL);
    /* Waits for a client end at a round's deadline, a CLOCK_MONOTONIC
     * time (kvhi_cluster_deadline). */
    pthread_condattr_t monotonic;
    pthread_condattr_init(&monotonic);
    pthread_condattr_setclock(&monotonic, CLOCK_MONOTONIC);
    pthread_cond_init(&r->client_cv, &monotonic);
    pthread_condattr_destroy(&monotonic);
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
    kvh_status st = open_remote(cfg, e, &id, &e->remote);
    if (st == KVH_OK && e->remote->upload) {
        /* Uploads' references (engine.h): not a caller's, except in the
         * last tier. */
        e->upload_refs_tier_end = 0;
        for (uint32_t t = 0; t < KVH_TIER_COUNT; t++)
            if (e->tiers[t].present)
                e->upload_refs_tier_end = t;
        if (!(e->upload_refs = calloc(e->block_cap, sizeof(uint32_t))))
            st = kvhi_fail(KVH_ERR_NOMEM, "out of memory for the remote tier's upload references");
    }
    if (st == KVH_OK)
        st = kvhi_remote_uploader_start(e);
    if (st != KVH_OK && e->remote) {
        kvhi_remote_close_client(e->remote);
        e->remote = NULL;
    }
    return st;
}

void kvhi_remote_tier_close(kvh_engine *e)
{
    kvhi_remote_uploader_stop(e);
    kvhi_remote_close_client(e->remote);
    e->remote = NULL;
    free(e->upload_refs);
    e->upload_refs = NULL;
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
    for (uint32_t i = 0; i < r->n_clients; i++)
        kvhi_cluster_close(r->clients[i]);
    kvhi_cluster_close(r->upload_cluster);
    kvhi_breakers_free(r->breakers); /* after the clients that share it */
    pthread_mutex_destroy(&r->client_lock);
    pthread_cond_destroy(&r->client_cv);
    for (size_t i = 0; i < r->n_spare; i++)
        free(r->spare[i]);
    free(r->spare);
    pthread_mutex_destroy(&r->spare_lock);
    free(r);
}

/* A free client, waited for until deadline; NULL when none was free by
 * then (the round has used up its time in line). */
static kvhi_cluster *client_take(kvhi_remote *r, uint64_t deadline)
{
    struct timespec until = {.tv_sec = (time_t)(deadline / 1000000000ull), .tv_nsec = (long)(deadline % 1000000000ull)};
    pthread_mutex_lock(&r->client_lock);
    int rc = 0;
    while (!r->clients_free && rc != ETIMEDOUT)
        rc = pthread_cond_timedwait(&r->client_cv, &r->client_lock, &until);
    kvhi_cluster *c = NULL;
    if (r->clients_free) {
        uint32_t i = (uint32_t)__builtin_ctz(r->clients_free);
        r->clients_free &= ~(1u << i);
        c = r->clients[i];
    }
    pthread_mutex_unlock(&r->client_lock);
    return c;
}

static void client_give(kvhi_remote *r, kvhi_cluster *c)
{
    pthread_mutex_lock(&r->client_lock);
    for (uint32_t i = 0; i < r->n_clients; i++)
        if (r->clients[i] == c)
            r->clients_free |= 1u << i;
    pthread_cond_signal(&r->client_cv);
    pthread_mutex_unlock(&r->client_lock);
}

void kvhi_remote_run(kvhi_remote *r, kvhi_cluster *via, kvhi_cluster_cmd *cmds, size_t n, kvhi_cluster_report *rep,
                     kvhi_cluster_string_fn on_string, void *user)
{
    /* The round's time starts now: a wait for a client spends it, as
     * kvh.h's remote_timeout_ms promises. */
    uint64_t deadline = kvhi_cluster_deadline(r->cluster);
    kvhi_cluster *c = via ? via : client_take(r, deadline);
    if (!c) {
        kvhi_cluster_time_out(cmds, n, rep);
        return;
    }
    kvhi_cluster_run_strings(c, cmds, n, rep, on_string, user, deadline);
    if (!via)
        client_give(r, c);
}

void kvhi_remote_take_spares(kvhi_remote *r, uint8_t **vals, size_t cap)
{
    pthread_mutex_lock(&r->spare_lock);
    size_t n = r->n_spare < cap ? r->n_spare : cap;
    r->n_spare -= n;
    if (n)
        memcpy(vals, r->spare + r->n_spare, n * sizeof(uint8_t *));
    pthread_mutex_unlock(&r->spare_lock);
}

void kvhi_remote_put_spares(kvhi_remote *r, uint8_t **vals, size_t n)
{
    size_t keep = (size_t)(KVHI_REMOTE_ROUND_BYTES / kvhi_remote_value_bytes(&r->id));
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

void kvhi_remote_cmd_key(kvhi_cluster_cmd *c, const char *verb, const char *key)
{
    memset(c, 0, sizeof(*c));
    c->argc = 2;
    c->argv[0] = verb;
    c->argvlen[0] = strlen(verb);
    c->argv[1] = key;
    c->argvlen[1] = KVHI_REMOTE_KEY_LEN;
}

void kvhi_remote_tally_report(kvhi_remote_tally *t, const kvhi_cluster_report *rep)
{
    t->timeouts += rep->timeouts;
    t->breaker_opens += rep->breaker_opens;
}

void kvhi_remote_tally_add(kvh_engine *e, const kvhi_remote_tally *t)
{
    e->stats.remote_hits += t->hits;
    e->stats.remote_misses += t->misses;
    e->stats.remote_corrupt += t->corrupt;
    e->stats.remote_uploads += t->uploads;
    e->stats.remote_uploads_dropped += t->dropped;
    e->stats.remote_timeouts += t->timeouts;
    e->stats.remote_breaker_opens += t->breaker_opens;
}

size_t kvhi_remote_exists_round(kvhi_remote *r, kvhi_cluster *via, char (*keys)[KVHI_REMOTE_KEY_BYTES], size_t n,
                                int8_t *present, kvhi_cluster_cmd *cmds, kvhi_remote_tally *t)
{
    for (size_t i = 0; i < n; i++)
        kvhi_remote_cmd_key(&cmds[i], "EXISTS", keys[i]);
    kvhi_cluster_report rep;
    kvhi_remote_run(r, via, cmds, n, &rep, NULL, NULL);
    kvhi_remote_tally_report(t, &rep);
    size_t yes = 0;
    for (size_t i = 0; i < n; i++) {
        long long v = 0;
        present[i] = kvhi_cluster_reply(&cmds[i], NULL, NULL, &v) != KVHI_REPLY_INTEGER ? -1 : v == 1;
        yes += present[i] == 1;
    }
    kvhi_cluster_cmds_clear(r->cluster, cmds, n);
    return yes;
}
