/* The remote tier inside the engine: open and close (core/remote_tier.c),
 * uploads (core/remote_upload.c) and the continuation of a prefix match
 * into the store (core/remote_match.c). Network I/O, value checks and
 * copies run with the engine lock dropped; the client is
 * core/remote_cluster.h, the values core/remote_format.h. */
#ifndef KVH_CORE_REMOTE_TIER_H
#define KVH_CORE_REMOTE_TIER_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "core/engine.h"
#include "core/remote_cluster.h"
#include "core/remote_format.h"
#include "core/seq.h"

/* Blocks asked about (EXISTS) in one round of a match; a 32k-token prefix
 * of 16-token blocks is 2048. */
#define KVHI_REMOTE_LOOKUP_MAX 4096u
/* Value bytes fetched or sent in one round: bounds the memory a round
 * holds, not the round trips of a short prefix. */
#define KVHI_REMOTE_ROUND_BYTES (64ull << 20)

/* Clients an engine's matches and persists share: a round takes a free
 * one, so several threads' rounds are in flight at once. */
#define KVHI_REMOTE_CLIENTS 2u

typedef struct kvhi_remote {
    struct kvhi_cluster *cluster; /* clients[0]; a tool's only client */
    struct kvhi_cluster *clients[KVHI_REMOTE_CLIENTS];
    uint32_t n_clients;
    uint32_t clients_free; /* bit i: clients[i] is free */
    pthread_mutex_t client_lock;
    pthread_cond_t client_cv;
    struct kvhi_cluster *upload_cluster; /* the uploader's own; NULL without one */
    kvhi_breakers *breakers;             /* shared by all of the above */
    kvhi_remote_id id;
    uint32_t upload; /* kvh_remote_upload bits */
    char ttl_text[16];
    kvh_engine *engine; /* for log lines */
    /* Value buffers of finished uploads, kept for the next: a fresh large
     * allocation costs a page fault per page (a leaf lock). */
    pthread_mutex_t spare_lock;
    uint8_t **spare;
    size_t n_spare;
    /* Background uploads (core/remote_uploader.c): a ring of blocks, each
     * with a reference, under the engine lock. */
    uint32_t *queue;
    size_t q_cap, q_head, q_len;
    /* Blocks of the round being uploaded, and the most the queue and the
     * round may reference together (see kvhi_remote_uploader_start). */
    size_t in_round, hold_max;
    pthread_cond_t q_cv; /* with the engine lock */
    pthread_t uploader;
    bool uploader_running, uploader_stop;
    bool queue_full; /* logged once per state change */
} kvhi_remote;

/* Checks the remote settings of cfg (KVH_ERR_INVALID_ARG,
 * KVH_ERR_UNSUPPORTED); called by the config validation. */
kvh_status kvhi_remote_validate(const kvh_config *cfg);
/* Opens the remote tier when cfg names addresses (lock not held; the
 * engine's tiers exist). */
kvh_status kvhi_remote_tier_open(kvh_engine *e, const kvh_config *cfg);
void kvhi_remote_tier_close(kvh_engine *e);

/* Uploads the full blocks of s the store lacks (lock held; dropped for
 * the network). Failures are counted, never returned. */
void kvhi_remote_persist(kvh_engine *e, kvhi_seq *s);
/* The same for n full, KV-complete blocks by record index; the caller
 * keeps a reference on each (the lock is dropped in between). */
void kvhi_remote_persist_blocks(kvh_engine *e, const uint32_t *blocks, size_t n);

/* Continues a prefix match of s (which holds `matched` blocks of tokens
 * and room for n_blocks) in the store; returns the blocks s holds after
 * (lock held; dropped for the network). */
size_t kvhi_remote_match(kvh_engine *e, kvhi_seq *s, const int32_t *tokens, size_t n_blocks, size_t matched);

/* Continues kvhi_prefix_lookup (core/scope.h) in the store: out[found..]
 * receive retained handles of the blocks after the `found` local ones
 * (the last of which has hash `parent`), up to n_blocks in all. Returns
 * how many out holds (lock held; dropped for the network). */
size_t kvhi_remote_lookup(kvh_engine *e, const kvhi_scope *sc, const int32_t *tokens, size_t n_blocks, size_t found,
                          uint64_t parent, kvh_block *out);

/* Queues block b (published, KV-complete) for the uploader when reason
 * (a kvh_remote_upload bit) is configured; a full queue drops it, counted
 * (lock held; never waits). */
void kvhi_remote_queue_upload(kvh_engine *e, uint32_t b, uint32_t reason);
/* A reference of an upload to block b (engine.h, upload_refs): keeps it,
 * but counts as no caller's in the victim order (lock held). */
void kvhi_remote_upload_ref(kvh_engine *e, uint32_t b);
void kvhi_remote_upload_unref(kvh_engine *e, uint32_t b);
/* Whether an upload holds busy (copying it without the lock) a block of
 * tier that no caller references, of agent (KVHI_NO_BLOCK: any); it
 * becomes a victim when that copy ends (lock held). */
bool kvhi_remote_busy_unreferenced(kvh_engine *e, uint32_t tier, uint32_t agent);
/* Starts the uploader thread when remote_upload asks for background
 * uploads (lock not held). */
kvh_status kvhi_remote_uploader_start(kvh_engine *e);
/* Uploads what is queued, then ends the thread (lock not held; the
 * engine's workers still run). Does nothing when it is not running. */
void kvhi_remote_uploader_stop(kvh_engine *e);

/* For tools (kvh store, kvh doctor): a client on cfg's remote settings
 * without an engine, and what it can do. */
kvh_status kvhi_remote_open_client(const kvh_config *cfg, kvhi_remote **out);
void kvhi_remote_close_client(kvhi_remote *r);

/* ---- shared by the remote tier's files ---- */

/* Counters of one call, added to the engine's under the lock. */
typedef struct kvhi_remote_tally {
    uint64_t hits, misses, corrupt, uploads, dropped, timeouts, breaker_opens;
} kvhi_remote_tally;
void kvhi_remote_tally_report(kvhi_remote_tally *t, const kvhi_cluster_report *rep);
/* Lock held. */
void kvhi_remote_tally_add(kvh_engine *e, const kvhi_remote_tally *t);

/* A command on one key (KVHI_REMOTE_KEY_LEN long). */
void kvhi_remote_cmd_key(kvhi_cluster_cmd *c, const char *verb, const char *key);
/* How many of keys[0..n) exist; present[i] says which: 1, 0, or -1 when
 * its node gave no answer. Through via as kvhi_remote_run. Lock not held. */
size_t kvhi_remote_exists_round(kvhi_remote *r, kvhi_cluster *via, char (*keys)[KVHI_REMOTE_KEY_BYTES], size_t n,
                                int8_t *present, kvhi_cluster_cmd *cmds, kvhi_remote_tally *t);
/* Uploads the full, KV-complete blocks of list the store lacks through
 * client via (NULL: one taken from the engine's clients) (lock held;
 * dropped for copies, disk reads and the network).
 * Takes its own references. Failures are counted, never returned. */
void kvhi_remote_upload_blocks(kvh_engine *e, kvhi_cluster *via, const uint32_t *list, size_t n);

/* Runs one round (kvhi_cluster_run_strings; on_string may be NULL)
 * through via, or, when via is NULL, through a free client of the engine,
 * taken for this round only and waited for while all are in use. The wait
 * counts against the round's deadline: when no client is free by then,
 * every command is settled as timed out (rep counts them). Engine lock
 * not held: a client is never held while the engine is waited for. */
void kvhi_remote_run(kvhi_remote *r, kvhi_cluster *via, kvhi_cluster_cmd *cmds, size_t n, kvhi_cluster_report *rep,
                     kvhi_cluster_string_fn on_string, void *user);

/* Value buffers for an upload: up to cap spares into vals (the rest NULL),
 * then given back (kept up to a round's bytes, the rest freed). */
void kvhi_remote_take_spares(kvhi_remote *r, uint8_t **vals, size_t cap);
void kvhi_remote_put_spares(kvhi_remote *r, uint8_t **vals, size_t n);

#endif
