/* A Redis Cluster client on hiredis (core/remote_cluster.c): the slot map
 * from CLUSTER SLOTS, CRC16 key slots with hash tags, MOVED and ASK
 * redirects, a refresh of the map when the topology changes, pipelined
 * batches (each node gets all of its commands of a batch in one write and
 * answers them in one read), AUTH on every connection, a deadline per
 * batch, and a circuit breaker per node (kvhi_breakers: one for all the
 * clients that share it). A server with cluster support
 * disabled is used as one node holding every slot.
 *
 * A client may be shared by threads: its own mutex serialises batches (a
 * leaf lock: taken without the engine lock held). An engine holds a few
 * (core/remote_tier.h), so its threads' rounds need not wait in line. */
#ifndef KVH_CORE_REMOTE_CLUSTER_H
#define KVH_CORE_REMOTE_CLUSTER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define KVHI_CLUSTER_SLOTS 16384u

typedef struct kvhi_cluster kvhi_cluster;

/* Circuit breakers by node address, shared by the clients opened on them
 * (an engine's few): a node that fails is left alone, counted and logged
 * once for all of them, and probed by one when its time is up. A leaf
 * lock of its own, taken under a client's. NULL from new: no memory. */
typedef struct kvhi_breakers kvhi_breakers;
kvhi_breakers *kvhi_breakers_new(void);
void kvhi_breakers_free(kvhi_breakers *b);

typedef void (*kvhi_cluster_log_fn)(void *user, int level, const char *text);

typedef struct kvhi_cluster_opts {
    const char *addrs;    /* "host:port[,host:port...]" */
    const char *user;     /* AUTH user (Redis 6 ACL); NULL: the default user */
    const char *password; /* NULL: no AUTH */
    uint32_t timeout_ms;  /* deadline of one batch; also of a connect */
    uint32_t breaker_ms;  /* how long a failed node is left alone */
    /* The breakers to share (outliving the client); NULL: its own. */
    kvhi_breakers *breakers;
    kvhi_cluster_log_fn log;
    void *log_user;
    /* The seed an open tries first (the others follow in order), or
     * KVHI_CLUSTER_SEEDS_LATER: none at open, as if none had answered
     * (they are tried on first use). For the clients opened after one
     * that found which seed answers, or that none does. */
    int32_t first_seed;
    /* The largest reply a batch's command may get, in bytes (its value
     * and RESP framing); 0: no bound. Its command gets KVHI_CMD_TOO_LARGE.
     * One still arriving is not read to its end (hiredis would hold it
     * whole, however long it claims to be; at most max_reply_bytes and
     * one read, 64 KiB, are taken): the connection is dropped, the node
     * left in use, and the round's later commands to it sent again. Replies outside batches (CLUSTER SLOTS, SCAN
     * pages, AUTH) are bounded by KVHI_CLUSTER_MAX_OTHER_REPLY. */
    size_t max_reply_bytes;
} kvhi_cluster_opts;

#define KVHI_CLUSTER_MAX_OTHER_REPLY ((size_t)64 << 20)

#define KVHI_CLUSTER_SEEDS_LATER (-1)

/* Result of one command of a batch. */
enum kvhi_cmd_result {
    KVHI_CMD_PENDING = 0,
    KVHI_CMD_OK,       /* reply holds the server's answer (maybe an error reply) */
    KVHI_CMD_DOWN,     /* its node is down, unreachable or left alone */
    KVHI_CMD_TIMEOUT,  /* the deadline passed first */
    KVHI_CMD_FAILED,   /* redirected too often, cluster down, no memory */
    KVHI_CMD_TOO_LARGE /* its reply passed opts.max_reply_bytes */
};

#define KVHI_CMD_MAX_ARGS 8
typedef struct kvhi_cluster_cmd {
    int argc;
    const char *argv[KVHI_CMD_MAX_ARGS]; /* argv[1] is the key */
    size_t argvlen[KVHI_CMD_MAX_ARGS];
    /* out */
    int result;  /* enum kvhi_cmd_result */
    void *reply; /* a redisReply with KVHI_CMD_OK; freed by kvhi_cluster_cmds_clear */
    /* internal */
    uint32_t node;
    uint32_t conn; /* its node's connection it was written to */
    bool asking;
} kvhi_cluster_cmd;

/* What a batch met, for the caller's counters. */
typedef struct kvhi_cluster_report {
    uint32_t timeouts;      /* commands that ran out of time */
    uint32_t down;          /* commands whose node was down or left alone */
    uint32_t breaker_opens; /* nodes newly left alone */
    uint32_t redirects;     /* MOVED and ASK answers followed */
} kvhi_cluster_report;

/* Why kvhi_cluster_open failed (its message in err says more). */
enum kvhi_cluster_open_error {
    KVHI_CLUSTER_BAD_ADDR = -1,     /* an address that does not parse, or none */
    KVHI_CLUSTER_NO_MEMORY = -2,    /* out of memory */
    KVHI_CLUSTER_AUTH_REFUSED = -3, /* AUTH refused, or wanted and not set */
    KVHI_CLUSTER_NO_CLIENT = -4,    /* hiredis cannot be loaded or was not built in */
};

/* Connects to the first reachable node of opts->addrs, authenticates and
 * loads the slot map. Returns 0, or an enum kvhi_cluster_open_error with
 * a message in err. Unreachable nodes are not an error: they are misses
 * until they answer. */
int kvhi_cluster_open(const kvhi_cluster_opts *opts, kvhi_cluster **out, char *err, size_t err_len);
void kvhi_cluster_close(kvhi_cluster *c);

/* The deadline of a batch that starts now: timeout_ms from now, in
 * CLOCK_MONOTONIC nanoseconds. */
uint64_t kvhi_cluster_deadline(const kvhi_cluster *c);

/* Runs cmds (each naming its key in argv[1]) on their nodes within
 * timeout_ms of now. Never fails as a whole: each command has its result. */
void kvhi_cluster_run(kvhi_cluster *c, kvhi_cluster_cmd *cmds, size_t n, kvhi_cluster_report *rep);
/* The same by deadline (kvhi_cluster_deadline, taken before the caller
 * waited for the client, so that the wait counts), handing each
 * bulk-string reply to on_string(user, i, str, len) as it is parsed,
 * straight from the connection's read buffer: no copy of the value is
 * made, and later replies are still arriving while it runs. Command i's
 * reply is then an empty string (on_string saw its bytes); other replies
 * (nil, integers, errors) are kept as usual. Called with the client's
 * lock held: it must not use the client, nor keep str. on_string may be
 * NULL. */
typedef void (*kvhi_cluster_string_fn)(void *user, size_t i, const char *str, size_t len);
void kvhi_cluster_run_strings(kvhi_cluster *c, kvhi_cluster_cmd *cmds, size_t n, kvhi_cluster_report *rep,
                              kvhi_cluster_string_fn on_string, void *user, uint64_t deadline);
/* Settles cmds as timed out without running them (the deadline passed
 * before a client was free), counted in rep. */
void kvhi_cluster_time_out(kvhi_cluster_cmd *cmds, size_t n, kvhi_cluster_report *rep);
/* What a command's reply is (KVHI_REPLY_NONE without one), with its text
 * (string, status, error) or its integer; str and integer may be NULL. */
enum kvhi_reply_kind {
    KVHI_REPLY_NONE,
    KVHI_REPLY_STRING,
    KVHI_REPLY_INTEGER,
    KVHI_REPLY_STATUS,
    KVHI_REPLY_NIL,
    KVHI_REPLY_ERROR,
    KVHI_REPLY_OTHER
};
int kvhi_cluster_reply(const kvhi_cluster_cmd *cmd, const char **str, size_t *len, long long *integer);
/* Frees the replies of cmds. */
void kvhi_cluster_cmds_clear(kvhi_cluster *c, kvhi_cluster_cmd *cmds, size_t n);

/* The key slot of key (CRC16 of the key, or of its {hash tag}). */
uint32_t kvhi_cluster_key_slot(const char *key, size_t len);

/* Calls fn on every key of every master that starts with prefix
 * (SCAN MATCH), stopping early when fn returns non-zero. Returns 0, or -1
 * when a node could not be scanned (err says which). */
typedef int (*kvhi_cluster_key_fn)(void *user, const char *key, size_t len);
int kvhi_cluster_scan(kvhi_cluster *c, const char *prefix, kvhi_cluster_key_fn fn, void *user, char *err,
                      size_t err_len);

/* The seed that answered the open's PING, or -1 (none did, or none was
 * tried). */
int32_t kvhi_cluster_seed_answered(const kvhi_cluster *c);

/* Breakers c opened outside batches since the last batch or call (at
 * open, in a scan or a health check; a batch adds them to its report),
 * now taken: for the caller's counters. */
uint32_t kvhi_cluster_take_breaker_opens(kvhi_cluster *c);

/* Masters that answer / are known (for `kvh doctor`). */
void kvhi_cluster_health(kvhi_cluster *c, uint32_t *answering, uint32_t *known);

#endif
