#include "core/remote_cluster.h"

#include <errno.h>
#include <limits.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <time.h>

#include "core/name_resolve.h"
#include "core/remote_hiredis.h"

#define NO_NODE UINT16_MAX
#define MAX_NODES 1024u
#define MAX_ROUNDS 4 /* a MOVED, then an ASK, then one more, then give up */
/* A node's share of a round is written whenever this much is waiting:
 * hiredis grows its output buffer by 1 MiB steps past 1 MiB, each a
 * realloc that copies it, so a 64 MiB round in one buffer copies it ~32
 * times over (and faults in fresh pages); the server starts on the first
 * commands meanwhile. */
#define FLUSH_BYTES (4u << 20)
/* The most elements an array reply may have: a CLUSTER SLOTS map (an
 * entry per slot range, so at most one per slot) and a SCAN page
 * (COUNT 1000) fit well within it. A larger count comes from a broken or
 * hostile server: hiredis would allocate and walk that many elements on
 * the strength of a few bytes of header. */
#define MAX_ARRAY_ELEMENTS (4 * (int)KVHI_CLUSTER_SLOTS)
/* A batch that starts with less of its timeout left than this (tenths)
 * is short (kvhi_cluster.short_round). */
#define SHORT_ROUND_TENTHS 9u
/* Refreshes of the slot map at most this often while the map is whole. */
#define REFRESH_GAP_NS 100000000ull
/* A node's error replies are logged at most this often. */
#define REFUSALS_QUIET_NS 10000000000ull

/* A node's circuit breaker (kvhi_breakers): `open` is read without the
 * lock on the way to every answer, so it is accessed atomically. */
typedef struct breaker {
    char host[256];
    int port;
    bool open;
    uint64_t left_alone_until; /* while open: no one asks it before then */
} breaker;

struct kvhi_breakers {
    pthread_mutex_t lock;
    breaker **all; /* each allocated apart: nodes keep pointers */
    uint32_t n, cap;
};

typedef struct node {
    char host[256];
    int port;
    redisContext *ctx;
    breaker *breaker; /* shared with the other clients on this address */
    bool in_batch;    /* has commands in the current round */
    size_t unsent;    /* bytes appended since its last write */
    /* Counts its connections: a command written to one that was dropped
     * has no answer on the next (kvhi_cluster_cmd.conn). */
    uint32_t conn;
    /* Error replies (a user without a command's rights, a full server)
     * are logged at most once every REFUSALS_QUIET_NS a node. */
    uint64_t refusals_quiet_until;
    uint32_t refusals_unsaid;
    /* Its connection was dropped in this round after a reply too long:
     * its later commands are sent again in the next round. */
    bool resend;
} node;

/* Where a round's bulk strings go (kvhi_cluster_run_strings). Every
 * connection's reader makes replies with `fns`, hiredis's own functions
 * but for strings, which go to on_string while a round asks for them. */
typedef struct reply_sink {
    redisReplyObjectFunctions fns;
    void *(*make_string)(const redisReadTask *task, char *str, size_t len); /* hiredis's */
    void *(*make_array)(const redisReadTask *task, int elements);           /* hiredis's */
    const redisReplyObjectFunctions *hiredis_fns;
    kvhi_cluster_string_fn on_string;
    void *user;
    size_t index; /* the command whose reply is being read */
} reply_sink;

struct kvhi_cluster {
    bool node_no_memory; /* the last NO_NODE from node_of was out of memory */
    pthread_mutex_t lock;
    reply_sink sink;
    const kvhi_hiredis *h;
    kvhi_cluster_opts opts;
    kvhi_breakers *breakers;
    bool own_breakers; /* opts named none: freed with the client */
    char *user, *password;
    node *nodes;
    uint32_t n_nodes, n_seeds;
    uint16_t slot_node[KVHI_CLUSTER_SLOTS];
    bool standalone; /* cluster support disabled: node 0 holds every slot */
    /* A node's refusal of CLUSTER SLOTS to this user (NOPERM), which
     * leaves the map empty and every command down. */
    char map_refused[256];
    int32_t seed_answered;  /* kvhi_cluster_seed_answered */
    bool refresh_wanted;    /* a MOVED or a failure: the map may be stale */
    uint64_t refresh_after; /* no refresh attempt before then */
    /* The batch running began its I/O with under SHORT_ROUND_SHARE of its
     * timeout left (the rest went waiting for a client): a node that
     * misses its deadline then is not left alone for it. */
    bool short_round;
    /* Breakers this client opened outside a batch (at open, in a scan or
     * a health check), for the next batch's report
     * (kvhi_cluster_take_breaker_opens). */
    uint32_t breaker_opens_unreported;
    char rbuf[64 << 10]; /* what a read takes off a socket (under lock) */
};

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void say(kvhi_cluster *c, int level, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void say(kvhi_cluster *c, int level, const char *fmt, ...)
{
    if (!c->opts.log)
        return;
    char text[320];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    c->opts.log(c->opts.log_user, level, text);
}

static struct timeval tv_of_ns(uint64_t ns)
{
    if (ns < 1000000)
        ns = 1000000; /* a zero timeval would mean "no timeout" */
    return (struct timeval){.tv_sec = (time_t)(ns / 1000000000ull),
                            .tv_usec = (suseconds_t)(ns % 1000000000ull / 1000)};
}

/* A deadline's failure text: how long the wait lasted and what it was for
 * (a caller may print it, so every failure leaves one). */
static void say_timed_out(char *err, size_t err_len, uint64_t started, const char *waiting_for)
{
    snprintf(err, err_len, "timed out after %llu ms %s", (unsigned long long)((now_ns() - started) / 1000000ull),
             waiting_for);
}

kvhi_breakers *kvhi_breakers_new(void)
{
    kvhi_breakers *b = calloc(1, sizeof(*b));
    if (b)
        pthread_mutex_init(&b->lock, NULL);
    return b;
}

void kvhi_breakers_free(kvhi_breakers *b)
{
    if (!b)
        return;
    for (uint32_t i = 0; i < b->n; i++)
        free(b->all[i]);
    free(b->all);
    pthread_mutex_destroy(&b->lock);
    free(b);
}

/* The breaker of host:port (NUL-terminated host), added closed when new;
 * NULL without memory. */
static breaker *breaker_of(kvhi_breakers *b, const char *host, int port)
{
    pthread_mutex_lock(&b->lock);
    breaker *found = NULL;
    for (uint32_t i = 0; i < b->n && !found; i++)
        if (b->all[i]->port == port && !strcmp(b->all[i]->host, host))
            found = b->all[i];
    if (!found && b->n == b->cap) {
        uint32_t cap = b->cap ? 2 * b->cap : 8;
        breaker **more = realloc(b->all, sizeof(*more) * cap);
        if (more) {
            b->all = more;
            b->cap = cap;
        }
    }
    if (!found && b->n < b->cap && (found = calloc(1, sizeof(*found)))) {
        snprintf(found->host, sizeof(found->host), "%s", host);
        found->port = port;
        b->all[b->n++] = found;
    }
    pthread_mutex_unlock(&b->lock);
    return found;
}

/* The node at host:port, added when new; NO_NODE when the table is full
 * (or no memory: node_no_memory says which). */
static uint32_t node_of(kvhi_cluster *c, const char *host, size_t host_len, int port)
{
    c->node_no_memory = false;
    if (host_len >= sizeof(c->nodes[0].host))
        return NO_NODE;
    for (uint32_t i = 0; i < c->n_nodes; i++)
        if (c->nodes[i].port == port && strlen(c->nodes[i].host) == host_len &&
            memcmp(c->nodes[i].host, host, host_len) == 0)
            return i;
    if (c->n_nodes >= MAX_NODES)
        return NO_NODE;
    if ((c->n_nodes & (c->n_nodes - 1)) == 0) { /* grow at powers of two */
        node *more = realloc(c->nodes, sizeof(node) * (c->n_nodes ? 2 * c->n_nodes : 4));
        if (!more) {
            c->node_no_memory = true;
            return NO_NODE;
        }
        c->nodes = more;
    }
    node *nd = &c->nodes[c->n_nodes];
    memset(nd, 0, sizeof(*nd));
    memcpy(nd->host, host, host_len);
    nd->host[host_len] = '\0';
    nd->port = port;
    if (!(nd->breaker = breaker_of(c->breakers, nd->host, port))) {
        c->node_no_memory = true;
        return NO_NODE;
    }
    return c->n_nodes++;
}

/* Whether host (not NUL-terminated) can name a node: a DNS name or IPv4
 * address (letters, digits, '.', '-', '_'), or an IPv6 address. A URL or
 * "host:port:more" would pass the open and never resolve. */
static bool host_is_valid(const char *host, size_t len)
{
    if (len == 0 || len >= 256)
        return false;
    if (memchr(host, ':', len)) {
        char text[INET6_ADDRSTRLEN + 1];
        struct in6_addr a;
        if (len >= sizeof(text))
            return false;
        memcpy(text, host, len);
        text[len] = '\0';
        return inet_pton(AF_INET6, text, &a) == 1;
    }
    for (size_t i = 0; i < len; i++) {
        char ch = host[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '.' ||
              ch == '-' || ch == '_'))
            return false;
    }
    return true;
}

/* Parses "host:port" (the last ':' splits, so bare IPv6 works; so does
 * "[IPv6]:port", its brackets dropped). */
static uint32_t node_of_addr(kvhi_cluster *c, const char *addr, size_t len)
{
    const char *colon = NULL;
    for (size_t i = 0; i < len; i++)
        if (addr[i] == ':')
            colon = addr + i;
    if (!colon || colon == addr)
        return NO_NODE;
    const char *host = addr;
    size_t host_len = (size_t)(colon - addr);
    if (host[0] == '[') {
        if (host_len < 3 || host[host_len - 1] != ']')
            return NO_NODE;
        host++;
        host_len -= 2;
        if (!memchr(host, ':', host_len))
            return NO_NODE; /* brackets are for IPv6 only */
    }
    if (!host_is_valid(host, host_len))
        return NO_NODE;
    char port_text[8];
    size_t plen = len - (size_t)(colon + 1 - addr);
    if (plen == 0 || plen >= sizeof(port_text))
        return NO_NODE;
    memcpy(port_text, colon + 1, plen);
    port_text[plen] = '\0';
    /* Digits only: strtol would also take a sign or leading blanks. */
    if (strspn(port_text, "0123456789") != plen)
        return NO_NODE;
    char *end;
    long port = strtol(port_text, &end, 10);
    if (*end || port <= 0 || port > 65535)
        return NO_NODE;
    return node_of(c, host, host_len, (int)port);
}

static void drop_connection(kvhi_cluster *c, node *nd)
{
    if (nd->ctx)
        c->h->free_ctx(nd->ctx);
    nd->ctx = NULL;
}

/* Whether nd is left alone now. Once its time is up, the first caller to
 * ask probes it: the others leave it alone for another breaker_ms, or
 * until the probe finds it answering (node_answered). */
static bool node_left_alone(kvhi_cluster *c, node *nd, uint64_t now)
{
    breaker *b = nd->breaker;
    if (!__atomic_load_n(&b->open, __ATOMIC_ACQUIRE))
        return false;
    pthread_mutex_lock(&c->breakers->lock);
    bool alone = __atomic_load_n(&b->open, __ATOMIC_RELAXED) && now < b->left_alone_until;
    if (!alone)
        b->left_alone_until = now + (uint64_t)c->opts.breaker_ms * 1000000ull; /* this caller probes */
    pthread_mutex_unlock(&c->breakers->lock);
    return alone;
}

/* The node failed: its connection is dropped and it is left alone for
 * breaker_ms by every client sharing its breaker (counted and logged by
 * the one that opened it). */
static void node_failed(kvhi_cluster *c, node *nd, const char *what, kvhi_cluster_report *rep)
{
    char text[200]; /* `what` may be the context's own error text, freed with it */
    snprintf(text, sizeof(text), "%s", what);
    drop_connection(c, nd);
    c->refresh_wanted = true; /* a failover may have moved its slots */
    breaker *b = nd->breaker;
    pthread_mutex_lock(&c->breakers->lock);
    b->left_alone_until = now_ns() + (uint64_t)c->opts.breaker_ms * 1000000ull;
    bool opened = !__atomic_load_n(&b->open, __ATOMIC_RELAXED);
    __atomic_store_n(&b->open, true, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&c->breakers->lock);
    if (opened) {
        if (rep)
            rep->breaker_opens++;
        else
            c->breaker_opens_unreported++;
        say(c, 1, "remote tier: %s:%d %s; not asked again for %u ms", nd->host, nd->port, text, c->opts.breaker_ms);
    }
}

/* nd missed the batch's deadline (connect, write or read): left alone as
 * failed, unless the batch was short; its connection is dropped either
 * way, since the rest of its answers may still come. */
static void node_timed_out(kvhi_cluster *c, node *nd, const char *what, kvhi_cluster_report *rep)
{
    if (c->short_round)
        drop_connection(c, nd);
    else
        node_failed(c, nd, what, rep);
}

static void node_answered(kvhi_cluster *c, node *nd)
{
    breaker *b = nd->breaker;
    if (!__atomic_load_n(&b->open, __ATOMIC_ACQUIRE))
        return;
    pthread_mutex_lock(&c->breakers->lock);
    bool closed = __atomic_load_n(&b->open, __ATOMIC_RELAXED);
    __atomic_store_n(&b->open, false, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&c->breakers->lock);
    if (closed)
        say(c, 2, "remote tier: %s:%d answers again", nd->host, nd->port);
}

static bool timed_out(const redisContext *ctx)
{
    return ctx->err == REDIS_ERR_IO && (errno == EAGAIN || errno == EWOULDBLOCK || errno == ETIMEDOUT ||
                                        strstr(ctx->errstr, "temporarily unavailable") != NULL);
}

static void *sink_string(const redisReadTask *task, char *str, size_t len)
{
    reply_sink *sk = task->privdata;
    if (task->type == REDIS_REPLY_STRING && !task->parent && sk->on_string) {
        sk->on_string(sk->user, sk->index, str, len);
        len = 0; /* its bytes were taken where they lay */
    }
    return sk->make_string(task, str, len);
}

static void *sink_array(const redisReadTask *task, int elements)
{
    reply_sink *sk = task->privdata;
    if (elements > MAX_ARRAY_ELEMENTS)
        return NULL; /* hiredis reports it as out of memory: the node fails */
    return sk->make_array(task, elements);
}

/* Makes ctx's replies through the client's sink. A reader whose functions
 * are not the ones the sink wraps keeps its own (strings are then copied
 * into replies as usual). */
static void sink_attach(kvhi_cluster *c, redisContext *ctx)
{
    redisReader *rd = ctx->reader;
    if (!rd || !rd->fn)
        return;
    if (!c->sink.hiredis_fns) {
        c->sink.hiredis_fns = rd->fn;
        c->sink.make_string = rd->fn->createString;
        c->sink.make_array = rd->fn->createArray;
        c->sink.fns = *rd->fn;
        c->sink.fns.createString = sink_string;
        c->sink.fns.createArray = sink_array;
    }
    if (rd->fn != c->sink.hiredis_fns || !c->sink.make_string || !c->sink.make_array)
        return;
    rd->fn = &c->sink.fns;
    rd->privdata = &c->sink;
}

/* hiredis writes with write(): on a connection the server has closed,
 * that raises SIGPIPE, whose default action ends the host process. While
 * kvh writes, the signal is blocked on the writing thread, and one the
 * writes raised is taken back before it is unblocked (EPIPE reports the
 * failure). */
typedef struct pipe_guard {
    sigset_t pipe, old;
    bool was_pending;
} pipe_guard;

static void pipe_guard_enter(pipe_guard *g)
{
    sigemptyset(&g->pipe);
    sigaddset(&g->pipe, SIGPIPE);
    sigset_t pending;
    g->was_pending = sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &g->pipe, &g->old);
}

static void pipe_guard_leave(pipe_guard *g)
{
    sigset_t pending;
    if (!g->was_pending && sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE)) {
        struct timespec none = {0, 0};
        while (sigtimedwait(&g->pipe, NULL, &none) < 0 && errno == EINTR)
            ;
    }
    pthread_sigmask(SIG_SETMASK, &g->old, NULL);
}

/* Writes what ctx has waiting, each write bounded by the time left
 * (SO_SNDTIMEO bounds one write() only). 0, -1 or -3 (the deadline passed
 * first); err says why either way. */
static int write_all(kvhi_cluster *c, redisContext *ctx, uint64_t deadline, char *err, size_t err_len)
{
    pipe_guard guard;
    pipe_guard_enter(&guard);
    int rc = 0;
    uint64_t now = now_ns(), started = now;
    for (;;) {
        int done = 0;
        c->h->set_timeout(ctx, tv_of_ns(now < deadline ? deadline - now : 0));
        if (c->h->buffer_write(ctx, &done) != REDIS_OK) {
            if (timed_out(ctx)) {
                say_timed_out(err, err_len, started, "writing to the server");
                rc = -3;
            } else {
                snprintf(err, err_len, "%s", ctx->errstr);
                rc = -1;
            }
            break;
        }
        if (done)
            break;
        now = now_ns();
        if (now >= deadline) {
            say_timed_out(err, err_len, started, "writing to the server");
            rc = -3;
            break;
        }
    }
    pipe_guard_leave(&guard);
    return rc;
}

/* Reads ctx's next reply by deadline. hiredis's own blocking read would
 * bound each read() only, so a reply that trickles in or never ends would
 * hold the client past any deadline: this waits on the socket itself.
 * What already arrived when the deadline passes is still taken. 0 with
 * the reply in *out; -1 (a broken connection or a reply that is not RESP),
 * -3 (no whole reply in time) or -4 (a reply longer than max_bytes, not
 * read to its end), err saying which. After -1, -3 or -4 the connection
 * must be dropped: the rest of a reply may still come. */
static int read_reply(kvhi_cluster *c, redisContext *ctx, uint64_t deadline, size_t max_bytes, void **out, char *err,
                      size_t err_len)
{
    uint64_t started = now_ns();
    bool late = false;
    size_t late_bytes = 0; /* past the deadline: what had arrived by then */
    /* Fed while no reply is whole: all of it belongs to the reply being
     * read (the bytes of the next come after its end), so more than
     * max_bytes is a reply longer than that, found without the reader's
     * internals and before hiredis holds a value as long as it claims. */
    size_t fed = 0;
    *out = NULL;
    for (;;) {
        if (c->h->reader_get_reply(ctx->reader, out) != REDIS_OK) {
            snprintf(err, err_len, "%s", ctx->reader->errstr);
            *out = NULL;
            return -1;
        }
        if (*out)
            return 0;
        if (max_bytes && fed > max_bytes) {
            snprintf(err, err_len, "a reply longer than %zu bytes", max_bytes);
            return -4;
        }
        uint64_t now = now_ns();
        int wait_ms = 0;
        if (now < deadline) {
            uint64_t ms = (deadline - now + 999999) / 1000000;
            wait_ms = ms > INT_MAX ? INT_MAX : (int)ms;
        } else if (!late) {
            /* Whatever had arrived by the deadline is still taken, however
             * large (a value is MiB), and nothing that comes later. */
            int avail = 0;
            late = true;
            late_bytes = ioctl(ctx->fd, FIONREAD, &avail) == 0 && avail > 0 ? (size_t)avail : 0;
        }
        if (late && late_bytes == 0) {
            say_timed_out(err, err_len, started, "waiting for a reply");
            return -3;
        }
        struct pollfd pf = {.fd = ctx->fd, .events = POLLIN};
        int pr = poll(&pf, 1, wait_ms);
        if (pr < 0 && errno != EINTR) {
            snprintf(err, err_len, "poll: %s", strerror(errno));
            return -1;
        }
        if (pr <= 0) {
            if (late && pr == 0) {
                say_timed_out(err, err_len, started, "waiting for a reply");
                return -3;
            }
            continue;
        }
        size_t want = late && late_bytes < sizeof(c->rbuf) ? late_bytes : sizeof(c->rbuf);
        ssize_t got = recv(ctx->fd, c->rbuf, want, MSG_DONTWAIT);
        if (got == 0) {
            snprintf(err, err_len, "closed the connection");
            return -1;
        }
        if (got < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
                if (late && errno != EINTR) {
                    say_timed_out(err, err_len, started, "waiting for a reply");
                    return -3;
                }
                continue;
            }
            snprintf(err, err_len, "read: %s", strerror(errno));
            return -1;
        }
        if (late)
            late_bytes -= (size_t)got < late_bytes ? (size_t)got : late_bytes;
        fed += (size_t)got;
        if (c->h->reader_feed(ctx->reader, c->rbuf, (size_t)got) != REDIS_OK) {
            snprintf(err, err_len, "out of memory");
            return -1;
        }
    }
}

/* read_reply for a reply that is no round command's value (ASKING's, or
 * a single command's such as AUTH on a connection a round opens): the
 * round's on_string is not handed its strings, whatever they are. */
static int read_reply_no_value(kvhi_cluster *c, redisContext *ctx, uint64_t deadline, void **out, char *err,
                               size_t err_len)
{
    kvhi_cluster_string_fn on_string = c->sink.on_string;
    c->sink.on_string = NULL;
    int rc = read_reply(c, ctx, deadline, KVHI_CLUSTER_MAX_OTHER_REPLY, out, err, err_len);
    c->sink.on_string = on_string;
    return rc;
}

/* One command on ctx, answered by deadline: its reply, or NULL with *rc
 * -1, -3 (no answer in time) or -4 (a reply too long) and err saying why;
 * the connection must then be dropped. */
static redisReply *ctx_command(kvhi_cluster *c, redisContext *ctx, int argc, const char **argv, const size_t *lens,
                               uint64_t deadline, char *err, size_t err_len, int *rc)
{
    void *r = NULL;
    int st = -1;
    /* Its reply is no round command's value (an AUTH on a connection a
     * round opens). */
    if (c->h->append_argv(ctx, argc, argv, lens) != REDIS_OK)
        snprintf(err, err_len, "out of memory");
    else if ((st = write_all(c, ctx, deadline, err, err_len)) == 0)
        st = read_reply_no_value(c, ctx, deadline, &r, err, err_len);
    if (rc)
        *rc = st;
    return st == 0 ? r : NULL;
}

/* AUTH on a fresh connection: 0, -2 (refused: the server's answer in
 * err), -1 or -3 (no answer in time), err saying why. */
static int authenticate(kvhi_cluster *c, redisContext *ctx, uint64_t deadline, char *err, size_t err_len)
{
    if (!c->password)
        return 0;
    const char *argv[3] = {"AUTH", c->user ? c->user : c->password, c->password};
    size_t lens[3] = {4, strlen(argv[1]), strlen(c->password)};
    int rc = 0;
    redisReply *r = ctx_command(c, ctx, c->user ? 3 : 2, argv, lens, deadline, err, err_len, &rc);
    if (!r)
        return rc;
    if (r->type == REDIS_REPLY_ERROR) {
        snprintf(err, err_len, "%s", r->str);
        rc = -2;
    }
    c->h->free_reply(r);
    return rc;
}

/* Connects nd when it has no connection. 0, -1 (unreachable), -2 (AUTH
 * refused) or -3 (no answer in time), err saying why. */
static int ensure_connected(kvhi_cluster *c, node *nd, uint64_t budget_ns, char *err, size_t err_len)
{
    if (nd->ctx)
        return 0;
    /* The name first, within the budget: hiredis would resolve it with
     * getaddrinfo, which has no timeout, and the client lock is held. */
    uint64_t deadline = now_ns() + budget_ns;
    kvhi_resolved addrs;
    int rc = kvhi_resolve_numeric(nd->host, budget_ns, &addrs, err, err_len);
    if (rc != 0)
        return rc;
    redisContext *ctx = NULL;
    snprintf(err, err_len, "%.100s has no address to connect to", nd->host);
    for (uint32_t i = 0; i < addrs.n && !ctx; i++) {
        uint64_t now = now_ns();
        if (now >= deadline) {
            snprintf(err, err_len, "no connection to %.100s:%d within the timeout", nd->host, nd->port);
            return -3;
        }
        ctx = c->h->connect_timeout(addrs.addr[i], nd->port, tv_of_ns(deadline - now));
        if (!ctx || ctx->err) {
            snprintf(err, err_len, "%s", ctx ? ctx->errstr : "out of memory");
            if (ctx)
                c->h->free_ctx(ctx);
            ctx = NULL;
        }
    }
    if (!ctx)
        return -1;
    c->h->set_timeout(ctx, tv_of_ns(budget_ns));
    sink_attach(c, ctx);
    rc = authenticate(c, ctx, deadline, err, err_len); /* the connect's budget covers its AUTH too */
    if (rc != 0) {
        c->h->free_ctx(ctx);
        return rc;
    }
    nd->ctx = ctx;
    nd->conn++;
    return 0;
}

/* How long the map is not asked for again after a refresh that left it
 * missing or incomplete: long enough that a cluster which does not answer
 * costs a lookup the refresh's wait only now and then. */
static uint64_t refresh_retry_ns(const kvhi_cluster *c)
{
    uint64_t t = (uint64_t)c->opts.timeout_ms * 1000000ull;
    return t > REFRESH_GAP_NS ? t : REFRESH_GAP_NS;
}

/* The map was not loaded, or has slots without a node: it is asked for
 * again, after a pause (a cluster still loading, or one that did not
 * answer, is not left without a map for good). */
static void refresh_later(kvhi_cluster *c)
{
    c->refresh_wanted = true;
    c->refresh_after = now_ns() + refresh_retry_ns(c);
}

/* A node that failed (-1, -2, -4) or ran out of time (-3) as a client
 * outside a batch's commands asked it something (rep: NULL outside a
 * batch). */
static void node_missed(kvhi_cluster *c, node *nd, int rc, const char *why, kvhi_cluster_report *rep)
{
    if (rc == -3)
        node_timed_out(c, nd, why, rep);
    else
        node_failed(c, nd, why, rep);
}

/* Loads the slot map from the first node that answers CLUSTER SLOTS,
 * within budget_ns in all. A node that fails to answer, or answers with
 * bytes that are not RESP, is left alone as in a batch (and counted in
 * rep, or for the next batch's). */
static void refresh_map(kvhi_cluster *c, uint64_t budget_ns, kvhi_cluster_report *rep)
{
    uint64_t now = now_ns();
    if (now < c->refresh_after)
        return;
    c->refresh_after = now + REFRESH_GAP_NS; /* at most ten a second */
    uint64_t deadline = now + budget_ns;
    bool loaded = false;
    for (uint32_t i = 0; i < c->n_nodes && !loaded; i++) {
        node *nd = &c->nodes[i];
        char err[160];
        now = now_ns();
        if (now >= deadline)
            break;
        if (node_left_alone(c, nd, now))
            continue;
        int rc = ensure_connected(c, nd, deadline - now, err, sizeof(err));
        if (rc != 0) {
            node_missed(c, nd, rc, err, rep);
            continue;
        }
        const char *argv[2] = {"CLUSTER", "SLOTS"};
        size_t lens[2] = {7, 5};
        redisReply *r = ctx_command(c, nd->ctx, 2, argv, lens, deadline, err, sizeof(err), &rc);
        if (!r) {
            node_missed(c, nd, rc, err, rep);
            continue;
        }
        node_answered(c, nd); /* whatever it said: a probe that found it back */
        if (r->type == REDIS_REPLY_ERROR && strstr(r->str, "cluster support disabled")) {
            c->standalone = true;
            for (uint32_t s = 0; s < KVHI_CLUSTER_SLOTS; s++)
                c->slot_node[s] = (uint16_t)i;
            c->h->free_reply(r);
            loaded = true;
            break;
        }
        if (r->type != REDIS_REPLY_ARRAY) {
            /* A lasting refusal (not a passing one such as LOADING). */
            if (r->type == REDIS_REPLY_ERROR && !strncmp(r->str, "NOPERM", 6))
                snprintf(c->map_refused, sizeof(c->map_refused), "%.60s:%d answered CLUSTER SLOTS with %.120s",
                         nd->host, nd->port, r->str);
            c->h->free_reply(r);
            continue;
        }
        /* [[start, end, [host, port, id, ...], replicas...], ...] */
        for (size_t k = 0; k < r->elements; k++) {
            redisReply *e = r->element[k];
            if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 || e->element[0]->type != REDIS_REPLY_INTEGER ||
                e->element[1]->type != REDIS_REPLY_INTEGER || e->element[2]->type != REDIS_REPLY_ARRAY ||
                e->element[2]->elements < 2 || e->element[2]->element[0]->type != REDIS_REPLY_STRING ||
                e->element[2]->element[1]->type != REDIS_REPLY_INTEGER)
                continue;
            long long lo = e->element[0]->integer, hi = e->element[1]->integer;
            redisReply *host = e->element[2]->element[0];
            long long port = e->element[2]->element[1]->integer;
            if (lo < 0 || hi >= KVHI_CLUSTER_SLOTS || lo > hi || port <= 0 || port > 65535)
                continue;
            /* An empty host means "the address you asked". */
            uint32_t m = host->len ? node_of(c, host->str, host->len, (int)port)
                                   : node_of(c, nd->host, strlen(nd->host), (int)port);
            nd = &c->nodes[i]; /* node_of may have moved the table */
            if (m == NO_NODE)
                continue;
            for (long long s = lo; s <= hi; s++)
                c->slot_node[s] = (uint16_t)m;
        }
        c->h->free_reply(r);
        c->standalone = false;
        loaded = true;
    }
    bool whole = loaded;
    for (uint32_t s = 0; s < KVHI_CLUSTER_SLOTS && whole; s++)
        whole = c->slot_node[s] != NO_NODE;
    if (whole)
        c->refresh_wanted = false;
    else
        refresh_later(c);
}

int kvhi_cluster_open(const kvhi_cluster_opts *opts, kvhi_cluster **out, char *err, size_t err_len)
{
    const char *why = NULL;
    const kvhi_hiredis *h = kvhi_hiredis_get(&why);
    if (!h) {
        snprintf(err, err_len, "%s", why);
        return KVHI_CLUSTER_NO_CLIENT;
    }
    kvhi_cluster *c = calloc(1, sizeof(*c));
    if (!c) {
        snprintf(err, err_len, "out of memory for the remote tier");
        return KVHI_CLUSTER_NO_MEMORY;
    }
    pthread_mutex_init(&c->lock, NULL);
    c->h = h;
    c->opts = *opts;
    c->opts.addrs = NULL;
    c->breakers = opts->breakers;
    if (!c->breakers) {
        c->own_breakers = true;
        if (!(c->breakers = kvhi_breakers_new())) {
            snprintf(err, err_len, "out of memory for the remote tier");
            kvhi_cluster_close(c);
            return KVHI_CLUSTER_NO_MEMORY;
        }
    }
    c->user = opts->user ? strdup(opts->user) : NULL;
    c->password = opts->password ? strdup(opts->password) : NULL;
    if ((opts->user && !c->user) || (opts->password && !c->password)) {
        snprintf(err, err_len, "out of memory for the remote tier");
        kvhi_cluster_close(c);
        return KVHI_CLUSTER_NO_MEMORY;
    }
    memset(c->slot_node, 0xff, sizeof(c->slot_node));
    /* Entries split at commas, blanks around each ignored: one quoted in an
     * error is the whole entry the user wrote ("host: 7000", "a:1 b:2"). */
    for (const char *p = opts->addrs; *p;) {
        p += strspn(p, " \t");
        size_t len = strcspn(p, ",");
        while (len && (p[len - 1] == ' ' || p[len - 1] == '\t'))
            len--;
        c->node_no_memory = false;
        if (len && node_of_addr(c, p, len) == NO_NODE) {
            bool no_memory = c->node_no_memory;
            if (no_memory)
                snprintf(err, err_len, "out of memory for the remote tier's node table");
            else if (c->n_nodes >= MAX_NODES)
                snprintf(err, err_len, "more than %u remote addresses", (unsigned)MAX_NODES);
            else
                snprintf(err, err_len, "remote address '%.*s' is not host:port", (int)(len > 200 ? 200 : len), p);
            kvhi_cluster_close(c);
            return no_memory ? KVHI_CLUSTER_NO_MEMORY : KVHI_CLUSTER_BAD_ADDR;
        }
        p += len;
        p += strspn(p, " \t,");
    }
    if (c->n_nodes == 0) {
        snprintf(err, err_len, "no remote address given (remote_addrs is empty)");
        kvhi_cluster_close(c);
        return KVHI_CLUSTER_BAD_ADDR;
    }
    c->n_seeds = c->n_nodes;
    /* A refused password is a configuration error, found now; a node that
     * does not answer is a miss until it does. */
    uint64_t budget = (uint64_t)c->opts.timeout_ms * 1000000ull;
    bool reached = false;
    c->seed_answered = -1;
    uint32_t tries = opts->first_seed == KVHI_CLUSTER_SEEDS_LATER ? 0 : c->n_seeds;
    uint32_t first = opts->first_seed > 0 ? (uint32_t)opts->first_seed % c->n_seeds : 0;
    for (uint32_t k = 0; k < tries && !reached; k++) {
        uint32_t i = (first + k) % c->n_seeds;
        char why_text[200];
        int rc = ensure_connected(c, &c->nodes[i], budget, why_text, sizeof(why_text));
        if (rc == -2) {
            snprintf(err, err_len, "remote tier: AUTH refused by %s:%d: %s", c->nodes[i].host, c->nodes[i].port,
                     why_text);
            kvhi_cluster_close(c);
            return KVHI_CLUSTER_AUTH_REFUSED;
        }
        if (rc == 0)
            reached = true;
        else
            node_failed(c, &c->nodes[i], why_text, NULL);
    }
    if (reached) {
        /* Without a password, a server that wants one says so now. */
        node *nd = NULL;
        for (uint32_t i = 0; i < c->n_seeds && !nd; i++)
            if (c->nodes[i].ctx)
                nd = &c->nodes[i];
        const char *argv[1] = {"PING"};
        size_t lens[1] = {4};
        char why_text[160];
        int ping_rc = 0;
        redisReply *r = ctx_command(c, nd->ctx, 1, argv, lens, now_ns() + budget, why_text, sizeof(why_text), &ping_rc);
        bool refused = r && r->type == REDIS_REPLY_ERROR && strncmp(r->str, "NOAUTH", 6) == 0;
        if (r)
            c->h->free_reply(r);
        if (refused) {
            snprintf(err, err_len, "remote tier: %s:%d wants AUTH (NOAUTH): set remote_password", nd->host, nd->port);
            kvhi_cluster_close(c);
            return KVHI_CLUSTER_AUTH_REFUSED;
        }
        if (r) {
            c->seed_answered = (int32_t)(nd - c->nodes);
            refresh_map(c, budget, NULL);
            bool any = false;
            for (uint32_t sl = 0; sl < KVHI_CLUSTER_SLOTS && !any; sl++)
                any = c->slot_node[sl] != NO_NODE;
            if (!any && c->map_refused[0]) {
                /* A user the server will not tell where slots live can
                 * reach none: a configuration error, as a refused AUTH. */
                snprintf(err, err_len, "remote tier: %s (the user needs +cluster|slots, or +@slow)", c->map_refused);
                kvhi_cluster_close(c);
                return KVHI_CLUSTER_AUTH_REFUSED;
            }
        } else {
            /* No answer, or one that is not RESP: left alone as a node
             * that fails in a batch (its late answer must not be taken
             * for a later command's); the map is asked for once the
             * node answers. */
            node_missed(c, nd, ping_rc, why_text, NULL);
            refresh_later(c);
        }
    } else
        c->refresh_wanted = true;
    *out = c;
    return 0;
}

int32_t kvhi_cluster_seed_answered(const kvhi_cluster *c) { return c->seed_answered; }

uint32_t kvhi_cluster_take_breaker_opens(kvhi_cluster *c)
{
    pthread_mutex_lock(&c->lock);
    uint32_t n = c->breaker_opens_unreported;
    c->breaker_opens_unreported = 0;
    pthread_mutex_unlock(&c->lock);
    return n;
}

void kvhi_cluster_close(kvhi_cluster *c)
{
    if (!c)
        return;
    for (uint32_t i = 0; i < c->n_nodes; i++)
        drop_connection(c, &c->nodes[i]);
    free(c->nodes);
    free(c->user);
    free(c->password);
    if (c->own_breakers)
        kvhi_breakers_free(c->breakers);
    pthread_mutex_destroy(&c->lock);
    free(c);
}

int kvhi_cluster_reply(const kvhi_cluster_cmd *cmd, const char **str, size_t *len, long long *integer)
{
    const redisReply *r = cmd->reply;
    if (cmd->result != KVHI_CMD_OK || !r)
        return KVHI_REPLY_NONE;
    if (str) {
        *str = r->str;
        *len = r->len;
    }
    if (integer)
        *integer = r->integer;
    switch (r->type) {
    case REDIS_REPLY_STRING:
        return KVHI_REPLY_STRING;
    case REDIS_REPLY_INTEGER:
        return KVHI_REPLY_INTEGER;
    case REDIS_REPLY_STATUS:
        return KVHI_REPLY_STATUS;
    case REDIS_REPLY_NIL:
        return KVHI_REPLY_NIL;
    case REDIS_REPLY_ERROR:
        return KVHI_REPLY_ERROR;
    default:
        return KVHI_REPLY_OTHER;
    }
}

void kvhi_cluster_cmds_clear(kvhi_cluster *c, kvhi_cluster_cmd *cmds, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (cmds[i].reply)
            c->h->free_reply(cmds[i].reply);
        cmds[i].reply = NULL;
        cmds[i].result = KVHI_CMD_PENDING;
    }
}

/* Follows "MOVED <slot> <host:port>" or "ASK ...": the command's node
 * changes, and a MOVED also changes the map. False for another error. */
static bool redirect(kvhi_cluster *c, kvhi_cluster_cmd *cmd, const redisReply *r, kvhi_cluster_report *rep)
{
    bool moved = r->len > 6 && memcmp(r->str, "MOVED ", 6) == 0;
    bool ask = r->len > 4 && memcmp(r->str, "ASK ", 4) == 0;
    if (!moved && !ask)
        return false;
    const char *p = r->str + (moved ? 6 : 4);
    char *end;
    unsigned long slot = strtoul(p, &end, 10);
    if (end == p || *end != ' ' || slot >= KVHI_CLUSTER_SLOTS)
        return false;
    const char *addr = end + 1;
    uint32_t m = node_of_addr(c, addr, strlen(addr));
    if (m == NO_NODE)
        return false;
    cmd->node = m;
    cmd->asking = ask;
    if (moved) {
        c->slot_node[slot] = (uint16_t)m;
        c->refresh_wanted = true;
    }
    rep->redirects++;
    return true;
}

/* An error reply to cmd (NOPERM for a user without its rights, OOM from
 * a full server, ...): the caller treats it as a miss or a dropped
 * upload; the log says why, a line a node every REFUSALS_QUIET_NS at
 * most. */
static void note_refusal(kvhi_cluster *c, node *nd, const kvhi_cluster_cmd *cmd, const redisReply *r)
{
    uint64_t now = now_ns();
    if (now < nd->refusals_quiet_until) {
        nd->refusals_unsaid++;
        return;
    }
    char more[64] = "";
    if (nd->refusals_unsaid)
        snprintf(more, sizeof(more), " (%u more since the last such line)", nd->refusals_unsaid);
    say(c, 1, "remote tier: %s:%d answered %.*s with %.*s%s", nd->host, nd->port,
        (int)(cmd->argvlen[0] < 16 ? cmd->argvlen[0] : 16), cmd->argv[0], (int)(r->len < 120 ? r->len : 120), r->str,
        more);
    nd->refusals_quiet_until = now + REFUSALS_QUIET_NS;
    nd->refusals_unsaid = 0;
}

/* Writes what nd has waiting by deadline; false (the node failed) when it
 * cannot. */
static bool flush_node(kvhi_cluster *c, node *nd, uint64_t deadline, kvhi_cluster_report *rep)
{
    char why[160];
    int rc = write_all(c, nd->ctx, deadline, why, sizeof(why));
    if (rc != 0) {
        if (rc == -3)
            node_timed_out(c, nd, why, rep);
        else
            node_failed(c, nd, why, rep);
        nd->in_batch = false;
        return false;
    }
    nd->unsent = 0;
    return true;
}

/* Sends every pending command of the round to its node, then reads the
 * answers node by node: the nodes work on their shares at the same time. */
static void run_round(kvhi_cluster *c, kvhi_cluster_cmd *cmds, size_t n, uint64_t deadline, kvhi_cluster_report *rep)
{
    for (uint32_t i = 0; i < c->n_nodes; i++)
        c->nodes[i].in_batch = c->nodes[i].resend = false;
    for (size_t k = 0; k < n; k++) {
        kvhi_cluster_cmd *cmd = &cmds[k];
        if (cmd->result != KVHI_CMD_PENDING)
            continue;
        if (cmd->node == NO_NODE || cmd->node >= c->n_nodes) {
            cmd->result = KVHI_CMD_DOWN;
            rep->down++;
            c->refresh_wanted = true; /* the map may know its slot by now */
            continue;
        }
        node *nd = &c->nodes[cmd->node];
        if (!nd->in_batch) {
            char err[160];
            /* Each connect gets the time left, not the round's. */
            uint64_t now = now_ns();
            if (now >= deadline) {
                cmd->result = KVHI_CMD_TIMEOUT;
                rep->timeouts++;
                continue;
            }
            if (node_left_alone(c, nd, now)) {
                cmd->result = KVHI_CMD_DOWN;
                rep->down++;
                continue;
            }
            int crc = ensure_connected(c, nd, deadline - now, err, sizeof(err));
            if (crc != 0) {
                if (crc == -3)
                    node_timed_out(c, nd, err, rep);
                else
                    node_failed(c, nd, err, rep);
                cmd->result = crc == -3 ? KVHI_CMD_TIMEOUT : KVHI_CMD_DOWN;
                if (crc == -3)
                    rep->timeouts++;
                else
                    rep->down++;
                continue;
            }
            nd->in_batch = true;
            nd->unsent = 0;
        }
        if (cmd->asking) {
            const char *argv[1] = {"ASKING"};
            size_t len[1] = {6};
            c->h->append_argv(nd->ctx, 1, argv, len);
        }
        if (c->h->append_argv(nd->ctx, cmd->argc, cmd->argv, cmd->argvlen) != REDIS_OK) {
            cmd->result = KVHI_CMD_FAILED;
            continue;
        }
        cmd->conn = nd->conn;
        for (int a = 0; a < cmd->argc; a++)
            nd->unsent += cmd->argvlen[a];
        if (nd->unsent >= FLUSH_BYTES)
            flush_node(c, nd, deadline, rep); /* a failure: its later commands find it left alone */
    }
    /* Writes: what each node's share still has waiting. */
    for (uint32_t i = 0; i < c->n_nodes; i++)
        if (c->nodes[i].in_batch)
            flush_node(c, &c->nodes[i], deadline, rep);
    /* Reads, in the order each node was sent its commands. */
    for (size_t k = 0; k < n; k++) {
        kvhi_cluster_cmd *cmd = &cmds[k];
        if (cmd->result != KVHI_CMD_PENDING || cmd->node >= c->n_nodes)
            continue;
        node *nd = &c->nodes[cmd->node];
        if (nd->resend)
            continue; /* pending: the next round sends it again */
        if (!nd->in_batch || !nd->ctx || cmd->conn != nd->conn) {
            /* Its node failed in this round: not sent, or no answer (or
             * written to a connection dropped since, whose answers the
             * new one does not carry). */
            cmd->result = KVHI_CMD_DOWN;
            rep->down++;
            continue;
        }
        void *got = NULL;
        char why[160];
        int rc = 0;
        /* A read that starts after the deadline waits for nothing: if its
         * answer is not all there, the round's time went to a slower node
         * read before it, and this node is not left alone for that. */
        bool started_late = now_ns() >= deadline;
        c->sink.index = k;
        if (cmd->asking) {
            rc = read_reply_no_value(c, nd->ctx, deadline, &got, why, sizeof(why));
            if (got)
                c->h->free_reply(got);
            got = NULL;
            if (rc == -4)
                rc = -1; /* ASKING's answer is no value: a node that sends MiB for it is broken */
        }
        /* Each read waits only for the time left in the round. */
        if (rc == 0)
            rc = read_reply(c, nd->ctx, deadline, c->opts.max_reply_bytes, &got, why, sizeof(why));
        redisReply *r = got;
        if (rc == -4) {
            /* The node answers; its value is not one this client wrote.
             * The rest of the reply is not read: its connection goes, and
             * its later commands of the round are sent again. */
            drop_connection(c, nd);
            nd->in_batch = false;
            nd->resend = true;
            cmd->result = KVHI_CMD_TOO_LARGE;
            continue;
        }
        if (rc != 0) {
            bool slow = rc == -3;
            if (slow && started_late)
                drop_connection(c, nd); /* the rest of its answers may still come */
            else if (slow)
                node_timed_out(c, nd, why, rep);
            else
                node_failed(c, nd, why, rep);
            nd->in_batch = false;
            cmd->result = slow ? KVHI_CMD_TIMEOUT : KVHI_CMD_DOWN;
            if (slow)
                rep->timeouts++;
            else
                rep->down++;
            continue;
        }
        node_answered(c, nd);
        cmd->asking = false;
        if (r->type == REDIS_REPLY_ERROR && redirect(c, cmd, r, rep)) {
            c->h->free_reply(r); /* pending again, for the next round */
            continue;
        }
        if (r->type == REDIS_REPLY_ERROR)
            note_refusal(c, nd, cmd, r);
        if (c->opts.max_reply_bytes && r->type == REDIS_REPLY_STRING && r->len > c->opts.max_reply_bytes) {
            /* Whole, as it came in one read with the reply before it. */
            c->h->free_reply(r);
            cmd->result = KVHI_CMD_TOO_LARGE;
            continue;
        }
        cmd->result = KVHI_CMD_OK;
        cmd->reply = r;
    }
}

uint64_t kvhi_cluster_deadline(const kvhi_cluster *c) { return now_ns() + (uint64_t)c->opts.timeout_ms * 1000000ull; }

void kvhi_cluster_run(kvhi_cluster *c, kvhi_cluster_cmd *cmds, size_t n, kvhi_cluster_report *rep)
{
    kvhi_cluster_run_strings(c, cmds, n, rep, NULL, NULL, kvhi_cluster_deadline(c));
}

void kvhi_cluster_time_out(kvhi_cluster_cmd *cmds, size_t n, kvhi_cluster_report *rep)
{
    memset(rep, 0, sizeof(*rep));
    for (size_t k = 0; k < n; k++) {
        cmds[k].result = KVHI_CMD_TIMEOUT;
        cmds[k].reply = NULL;
    }
    rep->timeouts = (uint32_t)n;
}

void kvhi_cluster_run_strings(kvhi_cluster *c, kvhi_cluster_cmd *cmds, size_t n, kvhi_cluster_report *rep,
                              kvhi_cluster_string_fn on_string, void *user, uint64_t deadline)
{
    memset(rep, 0, sizeof(*rep));
    pthread_mutex_lock(&c->lock);
    rep->breaker_opens = c->breaker_opens_unreported;
    c->breaker_opens_unreported = 0;
    uint64_t now = now_ns(), timeout = (uint64_t)c->opts.timeout_ms * 1000000ull;
    c->short_round = now >= deadline || (deadline - now) * 10 < timeout * SHORT_ROUND_TENTHS;
    if (c->refresh_wanted && now < deadline) /* half the round at most, and never past its deadline */
        refresh_map(c, deadline - now < timeout / 2 ? deadline - now : timeout / 2, rep);
    for (size_t k = 0; k < n; k++) {
        cmds[k].result = KVHI_CMD_PENDING;
        cmds[k].reply = NULL;
        cmds[k].asking = false;
        cmds[k].node = c->slot_node[kvhi_cluster_key_slot(cmds[k].argv[1], cmds[k].argvlen[1])];
    }
    c->sink.on_string = on_string;
    c->sink.user = user;
    for (int round = 0; round < MAX_ROUNDS; round++) {
        run_round(c, cmds, n, deadline, rep);
        bool pending = false;
        for (size_t k = 0; k < n; k++)
            pending |= cmds[k].result == KVHI_CMD_PENDING;
        if (!pending)
            break;
    }
    c->sink.on_string = NULL;
    c->sink.user = NULL;
    c->short_round = false;
    for (size_t k = 0; k < n; k++)
        if (cmds[k].result == KVHI_CMD_PENDING)
            cmds[k].result = KVHI_CMD_FAILED;
    pthread_mutex_unlock(&c->lock);
}

int kvhi_cluster_scan(kvhi_cluster *c, const char *prefix, kvhi_cluster_key_fn fn, void *user, char *err,
                      size_t err_len)
{
    pthread_mutex_lock(&c->lock);
    uint64_t budget = (uint64_t)c->opts.timeout_ms * 1000000ull;
    refresh_map(c, budget, NULL);
    char pattern[300];
    snprintf(pattern, sizeof(pattern), "%s*", prefix);
    int rc = 0;
    bool stop = false;
    /* Every node that owns a slot is a master to scan. */
    bool *owner = calloc(c->n_nodes ? c->n_nodes : 1, sizeof(bool));
    if (!owner) {
        pthread_mutex_unlock(&c->lock);
        snprintf(err, err_len, "out of memory");
        return -1;
    }
    for (uint32_t s = 0; s < KVHI_CLUSTER_SLOTS; s++)
        if (c->slot_node[s] != NO_NODE && c->slot_node[s] < c->n_nodes)
            owner[c->slot_node[s]] = true;
    for (uint32_t i = 0; i < c->n_nodes && !stop; i++) {
        if (!owner[i])
            continue;
        node *nd = &c->nodes[i];
        char why[160];
        if (ensure_connected(c, nd, budget, why, sizeof(why)) != 0) {
            snprintf(err, err_len, "%s:%d: %s", nd->host, nd->port, why);
            rc = -1;
            continue;
        }
        char cursor[32] = "0";
        do {
            const char *argv[6] = {"SCAN", cursor, "MATCH", pattern, "COUNT", "1000"};
            size_t lens[6] = {4, strlen(cursor), 5, strlen(pattern), 5, 4};
            /* Each page within its own deadline (a scan is not on a hot
             * path, so 20 rounds' worth), however its bytes arrive. */
            redisReply *r = ctx_command(c, nd->ctx, 6, argv, lens, now_ns() + budget * 20, why, sizeof(why), NULL);
            const char *bad = NULL;
            if (!r)
                bad = why;
            else if (r->type == REDIS_REPLY_ERROR)
                bad = r->str;
            else if (r->type != REDIS_REPLY_ARRAY || r->elements != 2 || r->element[0]->type != REDIS_REPLY_STRING ||
                     r->element[1]->type != REDIS_REPLY_ARRAY || r->element[0]->len >= sizeof(cursor))
                bad = "a reply that is not a SCAN page";
            /* A cursor handed back unchanged would be asked for forever. */
            else if (r->element[0]->len == strlen(cursor) && !memcmp(r->element[0]->str, cursor, strlen(cursor)) &&
                     strcmp(cursor, "0") != 0)
                bad = "a SCAN cursor that does not advance";
            if (bad) {
                snprintf(err, err_len, "%s:%d: SCAN failed: %s", nd->host, nd->port, bad);
                if (r)
                    c->h->free_reply(r);
                drop_connection(c, nd); /* what it sends next cannot be trusted */
                rc = -1;
                break;
            }
            snprintf(cursor, sizeof(cursor), "%.*s", (int)r->element[0]->len, r->element[0]->str);
            redisReply *keys = r->element[1];
            for (size_t k = 0; k < keys->elements && !stop; k++)
                if (keys->element[k]->type == REDIS_REPLY_STRING)
                    stop = fn(user, keys->element[k]->str, keys->element[k]->len) != 0;
            c->h->free_reply(r);
        } while (!stop && strcmp(cursor, "0") != 0);
    }
    free(owner);
    pthread_mutex_unlock(&c->lock);
    return rc;
}

void kvhi_cluster_health(kvhi_cluster *c, uint32_t *answering, uint32_t *known)
{
    pthread_mutex_lock(&c->lock);
    uint64_t budget = (uint64_t)c->opts.timeout_ms * 1000000ull;
    refresh_map(c, budget, NULL);
    *answering = *known = 0;
    /* The nodes that own slots; with no map (nothing answered yet), the
     * seeds the caller named, so that none answering reads "0 of N". */
    bool mapped = false;
    for (uint32_t s = 0; s < KVHI_CLUSTER_SLOTS && !mapped; s++)
        mapped = c->slot_node[s] != NO_NODE;
    for (uint32_t i = 0; i < c->n_nodes; i++) {
        bool owns = !mapped && i < c->n_seeds;
        for (uint32_t s = 0; s < KVHI_CLUSTER_SLOTS && mapped && !owns; s++)
            owns = c->slot_node[s] == i;
        if (!owns)
            continue;
        (*known)++;
        node *nd = &c->nodes[i];
        char why[160];
        if (ensure_connected(c, nd, budget, why, sizeof(why)) != 0)
            continue;
        const char *argv[1] = {"PING"};
        size_t lens[1] = {4};
        redisReply *r = ctx_command(c, nd->ctx, 1, argv, lens, now_ns() + budget, why, sizeof(why), NULL);
        if (r && r->type == REDIS_REPLY_STATUS)
            (*answering)++;
        else if (!r)
            drop_connection(c, nd);
        if (r)
            c->h->free_reply(r);
    }
    pthread_mutex_unlock(&c->lock);
}
