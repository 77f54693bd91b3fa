/* The remote tier against a hostile or broken server: a small RESP2 server
 * in a thread of this test (no redis-server needed) that stores what the
 * engine uploads and answers its commands with garbage on request: wrong
 * reply types, bulk lengths that lie, values truncated, flipped, of
 * another block or another geometry, redirects to nowhere and in loops,
 * malformed CLUSTER SLOTS maps, silence, a close mid-reply, an endless or
 * trickling reply, AUTH refusals and unsolicited data. Whatever it does,
 * the engine must not crash, must not wait past its deadlines, and must
 * never hand out K/V other than what was written: lookups become misses,
 * uploads are dropped and counted, opens fail with the documented status. */
#include "test_util.h"

#include "disk_test_util.h"

#include "core/remote_cluster.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define LAYERS 2
#define HEADS 2
#define DIM 64
#define BT 16
#define TOK_BYTES (HEADS * DIM * 2)
#define NB 8
#define TAG 7
#define SALT 0x5eedull
#define TIMEOUT_MS 200
#define BREAKER_MS 100
/* A lookup is an EXISTS round, a GETEX round and maybe a DEL round, each
 * within remote_timeout_ms, and a map refresh of half that: anything past
 * this bound (slack for a loaded machine) is a wait the header rules out. */
#define LOOKUP_BOUND_S (4.0 * TIMEOUT_MS / 1000.0 + 0.6)

/* ---- the fake server ---- */

enum twist {
    TW_NONE,
    TW_RAW,        /* the reply is srv.raw, verbatim */
    TW_TRUNC,      /* the stored value less its last byte */
    TW_PADDED,     /* the stored value and one byte more */
    TW_FLIP_DATA,  /* one data byte flipped */
    TW_FLIP_HDR,   /* one header byte flipped */
    TW_NEXT,       /* the value of the block stored after this one */
    TW_FOREIGN,    /* a value stored under another model's key prefix */
    TW_ARRAY,      /* the right value, inside an array */
    TW_LONGER,     /* a bulk length 100 more than the bytes that follow */
    TW_SHORTER,    /* a bulk length of 10, then the whole value */
    TW_CLOSE_MID,  /* half the value, then the connection closes */
    TW_TRICKLE,    /* the right value, a byte at a time, slowly */
    TW_ENDLESS,    /* a bulk of a gigabyte, streamed until the peer goes */
    TW_SLOW,       /* the right value, after three deadlines */
    TW_EXTRA,      /* the right value, twice */
    TW_MOVED_SELF, /* MOVED to this listener */
    TW_ASK_SELF,   /* ASK to this listener */
    TW_PINGPONG,   /* MOVED to the other listener, which sends it back */
    TW_SILENT,     /* no answer */
    TW_CLOSE_AFTER /* the right answer, then the connection closes */
};

#define MAX_LISTEN 2
#define MAX_CONNS 32
#define MAX_ITEMS 256

typedef struct item {
    char key[128];
    size_t klen;
    uint8_t *val;
    size_t vlen;
} item;

typedef struct conn {
    int fd, li;
    char *in;
    size_t len, cap;
    bool authed;
} conn;

static struct {
    pthread_t thread;
    pthread_mutex_t mu;
    bool quit; /* atomic: read by the server thread without mu */
    int lfd[MAX_LISTEN];
    int port[MAX_LISTEN];
    conn conns[MAX_CONNS];
    item items[MAX_ITEMS];
    int n_items;
    /* twists, set by the test between phases (under mu) */
    int tw_get, tw_exists, tw_set, tw_scan;
    char raw[512];
    char slots_raw[4096]; /* CLUSTER SLOTS reply; empty: cluster support disabled */
    int slots_fail_left;  /* CLUSTER SLOTS answered -LOADING this many more times */
    const char *password;
    bool auth_bulk;       /* a good AUTH is answered with a bulk string */
    int slow_listener;    /* TW_SLOW on this listener only (-1: every one) */
    const char *greeting; /* sent on every new connection */
    bool silent;          /* read commands, answer none */
    int closed_port;      /* a port nobody listens on */
    /* counters */
    int n_del, n_getex, n_set, n_slots, n_conns;
    char addrs[64];
} srv;

typedef struct obuf {
    char *p;
    size_t len, cap;
} obuf;

static void ob_put(obuf *b, const void *p, size_t n)
{
    if (b->len + n > b->cap) {
        b->cap = (b->len + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        assert_non_null(b->p);
    }
    memcpy(b->p + b->len, p, n);
    b->len += n;
}

static void ob_str(obuf *b, const char *s) { ob_put(b, s, strlen(s)); }

static void ob_bulk(obuf *b, const void *p, size_t n)
{
    char hdr[32];
    snprintf(hdr, sizeof(hdr), "$%zu\r\n", n);
    ob_str(b, hdr);
    ob_put(b, p, n);
    ob_str(b, "\r\n");
}

static int send_all(int fd, const void *p, size_t n)
{
    const char *c = p;
    while (n) {
        ssize_t w = send(fd, c, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        c += w;
        n -= (size_t)w;
    }
    return 0;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static int listen_on(int backlog, int *port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    assert_int_equal(listen(fd, backlog), 0);
    socklen_t al = sizeof(a);
    assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &al), 0);
    *port = ntohs(a.sin_port);
    return fd;
}

static item *find_item(const char *key, size_t klen, int *idx)
{
    for (int i = 0; i < srv.n_items; i++)
        if (srv.items[i].klen == klen && memcmp(srv.items[i].key, key, klen) == 0) {
            if (idx)
                *idx = i;
            return &srv.items[i];
        }
    return NULL;
}

/* Parses one command (an array of bulk strings); bytes used, 0 when
 * incomplete, -1 when it is not RESP. */
static long parse_cmd(const char *b, size_t n, int *argc, const char **argv, size_t *lens)
{
    const char *end = b + n, *p = b;
    if (p >= end)
        return 0;
    if (*p != '*')
        return -1;
    char *e;
    const char *nl = memchr(p, '\n', (size_t)(end - p));
    if (!nl)
        return 0;
    long cnt = strtol(p + 1, &e, 10);
    if (cnt < 1 || cnt > 8)
        return -1;
    p = nl + 1;
    for (long i = 0; i < cnt; i++) {
        if (p >= end)
            return 0;
        if (*p != '$')
            return -1;
        nl = memchr(p, '\n', (size_t)(end - p));
        if (!nl)
            return 0;
        long len = strtol(p + 1, &e, 10);
        if (len < 0)
            return -1;
        p = nl + 1;
        if ((size_t)(end - p) < (size_t)len + 2)
            return 0;
        argv[i] = p;
        lens[i] = (size_t)len;
        p += len + 2;
    }
    *argc = (int)cnt;
    return p - b;
}

static bool is_cmd(const char *a, size_t n, const char *name) { return n == strlen(name) && !strncasecmp(a, name, n); }

/* Streams a reply slowly or endlessly until the peer goes or the time is
 * up; then the connection is closed. */
static void stream_reply(int fd, const item *it, int twist)
{
    double t0 = tu_now();
    if (twist == TW_TRICKLE) {
        char hdr[32];
        snprintf(hdr, sizeof(hdr), "$%zu\r\n", it->vlen);
        if (send_all(fd, hdr, strlen(hdr)) != 0)
            return;
        for (size_t i = 0; i < it->vlen && tu_now() - t0 < 4.0; i++) {
            if (send_all(fd, it->val + i, 1) != 0)
                return;
            sleep_ms(TIMEOUT_MS / 5);
        }
        return;
    }
    static char chunk[64 << 10];
    memset(chunk, 'x', sizeof(chunk));
    if (send_all(fd, "$1000000000\r\n", 13) != 0)
        return;
    while (tu_now() - t0 < 3.0) {
        if (send_all(fd, chunk, sizeof(chunk)) != 0)
            return;
        sleep_ms(10);
    }
}

/* One SCAN page holding every stored key, with cursor 0 (the last). */
static void scan_page(obuf *o)
{
    char line[32];
    ob_str(o, "*2\r\n$1\r\n0\r\n");
    snprintf(line, sizeof(line), "*%d\r\n", srv.n_items);
    ob_str(o, line);
    for (int i = 0; i < srv.n_items; i++)
        ob_bulk(o, srv.items[i].key, srv.items[i].klen);
}

/* Sends p a byte at a time, slowly, until the peer goes or 8 s pass. */
static void trickle(int fd, const void *p, size_t n)
{
    double t0 = tu_now();
    for (size_t i = 0; tu_now() - t0 < 8.0; i = (i + 1) % n) {
        if (send_all(fd, (const char *)p + i, 1) != 0)
            return;
        sleep_ms(TIMEOUT_MS / 5);
    }
}

/* Handles one command; false when the connection is to close. */
static bool handle(conn *c, int argc, const char **argv, const size_t *lens)
{
    obuf o = {0};
    bool keep = true;
    int twist = TW_NONE;
    if (srv.silent)
        return true;
    if (is_cmd(argv[0], lens[0], "AUTH")) {
        const char *pw = argv[argc - 1];
        size_t pl = lens[argc - 1];
        bool user_ok = argc == 2 || (lens[1] == 7 && !memcmp(argv[1], "default", 7));
        if (!srv.password)
            ob_str(&o, "-ERR Client sent AUTH, but no password is set\r\n");
        else if (user_ok && pl == strlen(srv.password) && !memcmp(pw, srv.password, pl)) {
            c->authed = true;
            ob_str(&o, srv.auth_bulk ? "$2\r\nOK\r\n" : "+OK\r\n");
        } else
            ob_str(&o, "-WRONGPASS invalid username-password pair or user is disabled.\r\n");
        goto out;
    }
    if (srv.password && !c->authed) {
        ob_str(&o, "-NOAUTH Authentication required.\r\n");
        goto out;
    }
    if (is_cmd(argv[0], lens[0], "PING"))
        ob_str(&o, "+PONG\r\n");
    else if (is_cmd(argv[0], lens[0], "ASKING"))
        ob_str(&o, "+OK\r\n");
    else if (is_cmd(argv[0], lens[0], "CLUSTER")) {
        srv.n_slots++;
        if (srv.slots_fail_left > 0) {
            srv.slots_fail_left--;
            ob_str(&o, "-LOADING Redis is loading the dataset in memory\r\n");
        } else if (srv.slots_raw[0])
            ob_str(&o, srv.slots_raw);
        else
            ob_str(&o, "-ERR This instance has cluster support disabled\r\n");
    } else if (argc >= 2 && is_cmd(argv[0], lens[0], "SCAN")) {
        if (srv.tw_scan == TW_SILENT)
            goto out;
        if (srv.tw_scan == TW_RAW)
            ob_str(&o, srv.raw);
        else if (srv.tw_scan == TW_TRICKLE) {
            obuf page = {0};
            scan_page(&page);
            trickle(c->fd, page.p, page.len);
            free(page.p);
            keep = false;
        } else
            scan_page(&o);
    } else if (argc >= 2 && is_cmd(argv[0], lens[0], "EXISTS")) {
        if (srv.tw_exists == TW_SILENT)
            goto out;
        if (srv.tw_exists == TW_RAW)
            ob_str(&o, srv.raw);
        else
            ob_str(&o, find_item(argv[1], lens[1], NULL) ? ":1\r\n" : ":0\r\n");
        keep = srv.tw_exists != TW_CLOSE_AFTER;
    } else if (argc >= 2 && is_cmd(argv[0], lens[0], "DEL")) {
        srv.n_del++;
        int idx;
        item *it = find_item(argv[1], lens[1], &idx);
        if (it) {
            free(it->val);
            it->val = NULL;
            it->klen = 0;
        }
        ob_str(&o, it ? ":1\r\n" : ":0\r\n");
    } else if (argc >= 3 && is_cmd(argv[0], lens[0], "SET")) {
        srv.n_set++;
        if (srv.tw_set == TW_SILENT)
            goto out;
        if (srv.tw_set == TW_CLOSE_MID) {
            keep = false;
            goto out;
        }
        if (srv.tw_set == TW_RAW) {
            ob_str(&o, srv.raw);
            goto out;
        }
        if (find_item(argv[1], lens[1], NULL)) {
            ob_str(&o, "$-1\r\n");
        } else if (srv.n_items < MAX_ITEMS && lens[1] < sizeof(srv.items[0].key)) {
            item *it = &srv.items[srv.n_items++];
            memcpy(it->key, argv[1], lens[1]);
            it->klen = lens[1];
            it->val = malloc(lens[2]);
            assert_non_null(it->val);
            memcpy(it->val, argv[2], lens[2]);
            it->vlen = lens[2];
            ob_str(&o, "+OK\r\n");
        } else
            ob_str(&o, "-OOM command not allowed when used memory > 'maxmemory'.\r\n");
    } else if (argc >= 2 && is_cmd(argv[0], lens[0], "GETEX")) {
        srv.n_getex++;
        int idx = -1;
        item *it = find_item(argv[1], lens[1], &idx);
        twist = it ? srv.tw_get : TW_NONE;
        uint8_t *tmp = NULL;
        char line[160];
        switch (twist) {
        case TW_NONE:
        case TW_EXTRA:
        case TW_SLOW:
            if (twist == TW_SLOW && (srv.slow_listener < 0 || srv.slow_listener == c->li))
                sleep_ms(3 * TIMEOUT_MS);
            if (it)
                ob_bulk(&o, it->val, it->vlen);
            else
                ob_str(&o, "$-1\r\n");
            if (twist == TW_EXTRA)
                ob_bulk(&o, it->val, it->vlen);
            break;
        case TW_RAW:
            ob_str(&o, srv.raw);
            break;
        case TW_TRUNC:
            ob_bulk(&o, it->val, it->vlen - 1);
            break;
        case TW_PADDED:
            tmp = calloc(1, it->vlen + 1);
            memcpy(tmp, it->val, it->vlen);
            ob_bulk(&o, tmp, it->vlen + 1);
            break;
        case TW_FLIP_DATA:
        case TW_FLIP_HDR:
            tmp = malloc(it->vlen);
            memcpy(tmp, it->val, it->vlen);
            tmp[twist == TW_FLIP_HDR ? 9 : it->vlen - 1 - (size_t)srv.n_getex % 100] ^= 0x10;
            ob_bulk(&o, tmp, it->vlen);
            break;
        case TW_NEXT: {
            const item *nx = &srv.items[(idx + 1) % srv.n_items];
            ob_bulk(&o, nx->val, nx->vlen);
            break;
        }
        case TW_FOREIGN: {
            /* The foreign blocks were stored first, in the same order. */
            const item *f = idx >= NB ? &srv.items[idx - NB] : NULL;
            if (f && f->klen && memcmp(f->key, it->key, 33) != 0)
                ob_bulk(&o, f->val, f->vlen);
            else
                ob_str(&o, "$-1\r\n");
            break;
        }
        case TW_ARRAY:
            ob_str(&o, "*2\r\n:1\r\n");
            ob_bulk(&o, it->val, it->vlen);
            break;
        case TW_LONGER:
            snprintf(line, sizeof(line), "$%zu\r\n", it->vlen + 100);
            ob_str(&o, line);
            ob_put(&o, it->val, it->vlen);
            ob_str(&o, "\r\n");
            break;
        case TW_SHORTER:
            ob_str(&o, "$10\r\n");
            ob_put(&o, it->val, it->vlen);
            ob_str(&o, "\r\n");
            break;
        case TW_CLOSE_MID:
            snprintf(line, sizeof(line), "$%zu\r\n", it->vlen);
            ob_str(&o, line);
            ob_put(&o, it->val, it->vlen / 2);
            keep = false;
            break;
        case TW_TRICKLE:
        case TW_ENDLESS:
            stream_reply(c->fd, it, twist);
            keep = false;
            break;
        case TW_MOVED_SELF:
        case TW_ASK_SELF:
        case TW_PINGPONG:
            snprintf(line, sizeof(line), "-%s 1 127.0.0.1:%d\r\n", twist == TW_ASK_SELF ? "ASK" : "MOVED",
                     srv.port[twist == TW_PINGPONG ? 1 - c->li : c->li]);
            ob_str(&o, line);
            break;
        case TW_SILENT:
            break;
        }
        free(tmp);
    } else
        ob_str(&o, "-ERR unknown command\r\n");
out:
    if (o.len && send_all(c->fd, o.p, o.len) != 0)
        keep = false;
    free(o.p);
    return keep;
}

static void conn_close(conn *c)
{
    close(c->fd);
    free(c->in);
    memset(c, 0, sizeof(*c));
    c->fd = -1;
}

static void *server_main(void *arg)
{
    (void)arg;
    while (!__atomic_load_n(&srv.quit, __ATOMIC_ACQUIRE)) {
        struct pollfd pf[MAX_LISTEN + MAX_CONNS];
        int map[MAX_LISTEN + MAX_CONNS], n = 0;
        for (int i = 0; i < MAX_LISTEN; i++) {
            pf[n] = (struct pollfd){.fd = srv.lfd[i], .events = POLLIN};
            map[n++] = -1 - i;
        }
        for (int i = 0; i < MAX_CONNS; i++)
            if (srv.conns[i].fd >= 0) {
                pf[n] = (struct pollfd){.fd = srv.conns[i].fd, .events = POLLIN};
                map[n++] = i;
            }
        if (poll(pf, (nfds_t)n, 20) <= 0)
            continue;
        pthread_mutex_lock(&srv.mu);
        for (int k = 0; k < n; k++) {
            if (!(pf[k].revents & (POLLIN | POLLHUP | POLLERR)))
                continue;
            if (map[k] < 0) {
                int fd = accept(pf[k].fd, NULL, NULL);
                if (fd < 0)
                    continue;
                int slot = -1;
                for (int i = 0; i < MAX_CONNS && slot < 0; i++)
                    if (srv.conns[i].fd < 0)
                        slot = i;
                if (slot < 0) {
                    close(fd);
                    continue;
                }
                int one = 1;
                setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
                srv.conns[slot] = (conn){.fd = fd, .li = -1 - map[k]};
                srv.n_conns++;
                if (srv.greeting)
                    send_all(fd, srv.greeting, strlen(srv.greeting));
                continue;
            }
            conn *c = &srv.conns[map[k]];
            if (c->cap - c->len < 65536) {
                c->cap = c->cap * 2 + 65536;
                c->in = realloc(c->in, c->cap);
                assert_non_null(c->in);
            }
            ssize_t r = recv(c->fd, c->in + c->len, c->cap - c->len, 0);
            if (r <= 0) {
                conn_close(c);
                continue;
            }
            c->len += (size_t)r;
            for (;;) {
                int argc;
                const char *argv[8];
                size_t lens[8];
                long used = parse_cmd(c->in, c->len, &argc, argv, lens);
                if (used < 0) {
                    conn_close(c);
                    break;
                }
                if (used == 0)
                    break;
                bool keep = handle(c, argc, argv, lens);
                memmove(c->in, c->in + used, c->len - (size_t)used);
                c->len -= (size_t)used;
                if (!keep) {
                    conn_close(c);
                    break;
                }
            }
        }
        pthread_mutex_unlock(&srv.mu);
    }
    return NULL;
}

static void srv_reset_twists(void)
{
    pthread_mutex_lock(&srv.mu);
    srv.tw_get = srv.tw_exists = srv.tw_set = srv.tw_scan = TW_NONE;
    srv.raw[0] = srv.slots_raw[0] = '\0';
    srv.slots_fail_left = 0;
    srv.password = NULL;
    srv.auth_bulk = false;
    srv.slow_listener = -1;
    srv.greeting = NULL;
    srv.silent = false;
    for (int i = 0; i < srv.n_items; i++)
        free(srv.items[i].val);
    memset(srv.items, 0, sizeof(srv.items));
    srv.n_items = 0;
    srv.n_del = srv.n_getex = srv.n_set = srv.n_slots = 0;
    pthread_mutex_unlock(&srv.mu);
}

#define SRV_SET(stmt)                                                                                                  \
    do {                                                                                                               \
        pthread_mutex_lock(&srv.mu);                                                                                   \
        stmt;                                                                                                          \
        pthread_mutex_unlock(&srv.mu);                                                                                 \
    } while (0)

static int group_setup(void **state)
{
    (void)state;
    pthread_mutex_init(&srv.mu, NULL);
    for (int i = 0; i < MAX_CONNS; i++)
        srv.conns[i].fd = -1;
    for (int i = 0; i < MAX_LISTEN; i++)
        srv.lfd[i] = listen_on(64, &srv.port[i]);
    int fd = listen_on(1, &srv.closed_port);
    close(fd);
    snprintf(srv.addrs, sizeof(srv.addrs), "127.0.0.1:%d", srv.port[0]);
    return pthread_create(&srv.thread, NULL, server_main, NULL) == 0 ? 0 : -1;
}

static int group_teardown(void **state)
{
    (void)state;
    __atomic_store_n(&srv.quit, true, __ATOMIC_RELEASE);
    pthread_join(srv.thread, NULL);
    srv_reset_twists();
    for (int i = 0; i < MAX_CONNS; i++)
        if (srv.conns[i].fd >= 0)
            conn_close(&srv.conns[i]);
    for (int i = 0; i < MAX_LISTEN; i++)
        close(srv.lfd[i]);
    return 0;
}

static int test_setup(void **state)
{
    (void)state;
    srv_reset_twists();
    return 0;
}

/* ---- engines ---- */

static kvh_config cfg_for(const char *addrs, uint32_t heads, uint32_t dim, uint64_t salt)
{
    kvh_config c = tu_cfg(LAYERS, heads, dim, BT, KVH_DTYPE_F16, 64, 256, 1);
    c.model_salt = salt;
    c.remote_addrs = addrs;
    c.remote_timeout_ms = TIMEOUT_MS;
    c.remote_breaker_ms = BREAKER_MS;
    return c;
}

/* Opens an engine on the fake server; NULL (and the test skipped) where
 * this build has no remote tier. */
static kvh_engine *open_remote(const kvh_config *c)
{
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(c, &e);
    if (st == KVH_ERR_UNSUPPORTED)
        skip();
    assert_ok(st);
    return tu_track_engine(e);
}

/* Writes NB blocks of tag's pattern at tokens base.. and persists them
 * through a well-behaved server; returns the engine's counters. */
static kvh_stats write_blocks(uint32_t heads, uint32_t dim, uint64_t salt, uint64_t tag, int32_t base)
{
    kvh_config c = cfg_for(srv.addrs, heads, dim, salt);
    kvh_engine *e = open_remote(&c);
    kvh_seq s = tu_seq_new(e, 0);
    int32_t tokens[NB * BT];
    tu_iota(tokens, NB * BT, base);
    assert_ok(kvh_seq_append(e, s, tokens, NB * BT));
    tu_write_pattern(e, s, LAYERS, (size_t)heads * dim * 2, tag, 0, NB * BT);
    assert_ok(kvh_seq_persist(e, s));
    kvh_stats st = tu_stats(e);
    assert_ok(tu_close(e));
    return st;
}

/* The usual store: NB blocks of TAG, all uploaded. */
static void write_usual(void)
{
    kvh_stats st = write_blocks(HEADS, DIM, SALT, TAG, 1000);
    assert_int_equal(st.remote_uploads, NB);
    assert_int_equal(st.remote_uploads_dropped, 0);
}

static kvh_engine *open_reader(void)
{
    kvh_config c = cfg_for(srv.addrs, HEADS, DIM, SALT);
    return open_remote(&c);
}

/* Matches the usual prefix in e; every block matched must read back as
 * TAG's pattern. Returns the blocks matched, the time in *secs. */
static size_t match_usual(kvh_engine *e, double *secs)
{
    kvh_seq s = tu_seq_new(e, 0);
    int32_t tokens[NB * BT];
    tu_iota(tokens, NB * BT, 1000);
    size_t m = 0;
    double t0 = tu_now();
    assert_ok(kvh_seq_match_prefix(e, s, tokens, NB * BT, &m));
    *secs = tu_now() - t0;
    assert_int_equal(m % BT, 0);
    if (m)
        assert_true(tu_check_pattern(e, s, LAYERS, TOK_BYTES, TAG, 0, m));
    assert_ok(kvh_seq_free(e, s));
    return m / BT;
}

/* One lookup under the GETEX twist tw: a miss from the first block on,
 * within the deadline; corrupt says whether it must count as a value that
 * failed verification (deleted from the store; -1: either). Then, twist gone and the
 * breaker over, the same engine reads the (rewritten) prefix back intact. */
static void lookup_under(int tw, const char *raw, int corrupt)
{
    srv_reset_twists();
    write_usual();
    SRV_SET(srv.tw_get = tw; if (raw) snprintf(srv.raw, sizeof(srv.raw), "%s", raw));
    kvh_engine *e = open_reader();
    double secs;
    size_t got = match_usual(e, &secs);
    assert_int_equal(got, 0);
    if (secs >= LOOKUP_BOUND_S)
        print_message("twist %d '%s': lookup took %.2f s (bound %.2f s)\n", tw, raw ? raw : "", secs, LOOKUP_BOUND_S);
    assert_true(secs < LOOKUP_BOUND_S);
    kvh_stats st = tu_stats(e);
    assert_int_equal(st.remote_hits, 0);
    assert_true(st.remote_misses >= 1);
    if (corrupt == 1) {
        assert_int_equal(st.remote_corrupt, 1);
        assert_int_equal(srv.n_del, 1);
    } else if (corrupt == 0) {
        assert_int_equal(st.remote_corrupt, 0);
    }
    /* The server behaves again: the store is refilled, the engine finds
     * it once the breaker lets the node be asked. */
    assert_ok(tu_close(e));
    srv_reset_twists();
    write_usual();
    e = open_reader();
    sleep_ms(BREAKER_MS + 50);
    assert_int_equal(match_usual(e, &secs), NB);
    assert_ok(tu_close(e));
}

/* ---- lookups against garbage replies ---- */

/* Once the server behaves, e finds every block again within a few
 * breaker periods; then it is closed. */
static void finds_all_again(kvh_engine *e)
{
    double secs;
    size_t got = 0;
    for (int i = 0; i < 5 && got < NB; i++) {
        sleep_ms(BREAKER_MS + 50);
        got = match_usual(e, &secs);
    }
    assert_int_equal(got, NB);
    assert_ok(tu_close(e));
}

static void test_sanity_roundtrip(void **state)
{
    (void)state;
    write_usual();
    kvh_engine *e = open_reader();
    double secs;
    assert_int_equal(match_usual(e, &secs), NB);
    kvh_stats st = tu_stats(e);
    assert_int_equal(st.remote_hits, NB);
    assert_int_equal(st.remote_corrupt, 0);
    assert_ok(tu_close(e));
}

static void test_getex_wrong_types(void **state)
{
    (void)state;
    lookup_under(TW_RAW, ":42\r\n", false);
    lookup_under(TW_RAW, "$-1\r\n", false);
    lookup_under(TW_RAW, "*-1\r\n", false);
    lookup_under(TW_RAW, "+OK\r\n", false);
    lookup_under(TW_RAW, "-ERR no such thing\r\n", false);
    lookup_under(TW_RAW, "*3\r\n:1\r\n$-1\r\n*0\r\n", false);
    lookup_under(TW_ARRAY, NULL, false);
}

static void test_getex_lying_lengths(void **state)
{
    (void)state;
    lookup_under(TW_RAW, "$-7\r\n", false);                /* negative, not -1 */
    lookup_under(TW_RAW, "$99999999999\r\nabcdef", -1);    /* far more than will come */
    lookup_under(TW_RAW, "$9223372036854775807\r\nx", -1); /* the largest length */
    lookup_under(TW_RAW, "$18446744073709551615\r\n", -1); /* wraps to -1 in a naive parser */
    lookup_under(TW_RAW, "!garbage\r\n", false);           /* not RESP at all */
    lookup_under(TW_LONGER, NULL, -1);                     /* the next reply completes it: a wrong length */
    lookup_under(TW_SHORTER, NULL, -1);                    /* 10 bytes of value, then bytes that are not RESP */
}

/* A 16-byte reply claiming an array of 30 million elements, once per
 * command (so nested): the client must not spend seconds and hundreds of
 * megabytes on it. */
static void test_getex_huge_array_count(void **state)
{
    (void)state;
    lookup_under(TW_RAW, "*30000000\r\n:1\r\n", false);
}

static void test_getex_damaged_values(void **state)
{
    (void)state;
    lookup_under(TW_TRUNC, NULL, true);
    lookup_under(TW_PADDED, NULL, true);
    lookup_under(TW_FLIP_DATA, NULL, true);
    lookup_under(TW_FLIP_HDR, NULL, true);
    lookup_under(TW_NEXT, NULL, true);
}

/* Values that are whole and checksummed but were written for another
 * model (salt) or another geometry of the same byte size. */
static void test_getex_foreign_values(void **state)
{
    (void)state;
    for (int variant = 0; variant < 2; variant++) {
        srv_reset_twists();
        kvh_stats st =
            variant ? write_blocks(HEADS * 2, DIM / 2, SALT, TAG, 1000) : write_blocks(HEADS, DIM, SALT + 1, TAG, 1000);
        assert_int_equal(st.remote_uploads, NB);
        write_usual();
        SRV_SET(srv.tw_get = TW_FOREIGN);
        kvh_engine *e = open_reader();
        double secs;
        assert_int_equal(match_usual(e, &secs), 0);
        assert_true(secs < LOOKUP_BOUND_S);
        assert_int_equal(tu_stats(e).remote_corrupt, 1);
        assert_ok(tu_close(e));
    }
}

static void test_exists_garbage(void **state)
{
    (void)state;
    static const char *const replies[] = {"$1\r\n1\r\n", "*1\r\n:1\r\n",  "$-1\r\n", ":2\r\n",
                                          ":-1\r\n",     "-ERR nope\r\n", "+1\r\n"};
    for (size_t i = 0; i < sizeof(replies) / sizeof(replies[0]); i++) {
        srv_reset_twists();
        write_usual();
        SRV_SET(srv.tw_exists = TW_RAW; snprintf(srv.raw, sizeof(srv.raw), "%s", replies[i]));
        kvh_engine *e = open_reader();
        double secs;
        assert_int_equal(match_usual(e, &secs), 0);
        assert_true(secs < LOOKUP_BOUND_S);
        assert_int_equal(tu_stats(e).remote_hits, 0);
        assert_ok(tu_close(e));
    }
}

/* ---- connections that misbehave ---- */

static void test_close_mid_reply(void **state)
{
    (void)state;
    lookup_under(TW_CLOSE_MID, NULL, false);
}

static void test_slow_reply_is_a_timeout(void **state)
{
    (void)state;
    write_usual();
    SRV_SET(srv.tw_get = TW_SLOW);
    kvh_engine *e = open_reader();
    double secs;
    assert_int_equal(match_usual(e, &secs), 0);
    assert_true(secs < LOOKUP_BOUND_S);
    assert_true(tu_stats(e).remote_timeouts >= 1);
    /* The late answer must not be taken for a later command's. */
    SRV_SET(srv.tw_get = TW_NONE);
    sleep_ms(3 * TIMEOUT_MS + BREAKER_MS);
    assert_int_equal(match_usual(e, &secs), NB);
    assert_ok(tu_close(e));
}

/* A reply sent a byte at a time, each byte well within the deadline: the
 * round's deadline still holds. */
static void test_trickling_reply_respects_deadline(void **state)
{
    (void)state;
    lookup_under(TW_TRICKLE, NULL, -1);
}

/* A bulk that never ends, streamed fast: the deadline holds and the
 * memory held stays bounded by what arrived in it. */
static void test_endless_reply_respects_deadline(void **state)
{
    (void)state;
    lookup_under(TW_ENDLESS, NULL, -1);
}

static void test_silent_server(void **state)
{
    (void)state;
    write_usual();
    SRV_SET(srv.silent = true);
    kvh_config c = cfg_for(srv.addrs, HEADS, DIM, SALT);
    double t0 = tu_now();
    kvh_engine *e = open_remote(&c);
    /* The first client waits a deadline for its PING; the others wait
     * for first use. */
    assert_true(tu_now() - t0 < TIMEOUT_MS / 1000.0 + 0.6);
    double secs;
    assert_int_equal(match_usual(e, &secs), 0);
    assert_true(secs < LOOKUP_BOUND_S);
    assert_ok(tu_close(e));
}

/* Seeds that accept connections and never answer, before one that does:
 * the open waits one deadline (the first client's), not one per client;
 * the others start where it found an answer, or on first use. */
static void test_stalled_seeds_cost_one_deadline_at_open(void **state)
{
    (void)state;
    enum { STALLED = 2, SLOW_MS = 1000 };
    int fds[STALLED], ports[STALLED];
    for (int i = 0; i < STALLED; i++)
        fds[i] = listen_on(64, &ports[i]);
    char addrs[256];
    snprintf(addrs, sizeof(addrs), "127.0.0.1:%d,127.0.0.1:%d,%s", ports[0], ports[1], srv.addrs);
    kvh_config c = cfg_for(addrs, HEADS, DIM, SALT);
    c.remote_timeout_ms = SLOW_MS;
    double t0 = tu_now();
    kvh_engine *e = open_remote(&c);
    double secs = tu_now() - t0;
    assert_ok(tu_close(e));
    for (int i = 0; i < STALLED; i++)
        close(fds[i]);
    print_message("open with %d stalled seeds first: %.2f s (deadline %.1f s)\n", STALLED, secs, SLOW_MS / 1000.0);
    assert_true(secs < SLOW_MS / 1000.0 + 0.6);
}

/* A server that stalls while the engine opens, then answers: its blocks
 * are misses "until it does", not for the engine's lifetime. */
static void test_stall_at_open_then_recovers(void **state)
{
    (void)state;
    write_usual();
    SRV_SET(srv.silent = true);
    kvh_engine *e = open_reader();
    SRV_SET(srv.silent = false);
    finds_all_again(e);
}

/* CLUSTER SLOTS refused once (a server still loading): the map is asked
 * for again later. */
static void test_slot_map_refused_once_then_recovers(void **state)
{
    (void)state;
    write_usual();
    SRV_SET(srv.slots_fail_left = 2); /* one per client of the engine */
    kvh_engine *e = open_reader();
    finds_all_again(e);
}

static void test_unsolicited_data(void **state)
{
    (void)state;
    /* Every GETEX answered twice: the pipeline is off by one from then on. */
    write_usual();
    SRV_SET(srv.tw_get = TW_EXTRA);
    kvh_engine *e = open_reader();
    double secs;
    for (int i = 0; i < 3; i++) {
        match_usual(e, &secs); /* checks every block it returns */
        assert_true(secs < LOOKUP_BOUND_S);
        sleep_ms(BREAKER_MS + 20);
        /* blocks that verified stay local: a fresh engine asks again */
    }
    assert_ok(tu_close(e));
    /* A greeting on every connection, before any command. */
    srv_reset_twists();
    write_usual();
    SRV_SET(srv.greeting = "+HELLO\r\n");
    e = open_reader();
    match_usual(e, &secs);
    assert_true(secs < LOOKUP_BOUND_S);
    assert_ok(tu_close(e));
    /* Bytes that are not RESP at all. */
    srv_reset_twists();
    write_usual();
    SRV_SET(srv.greeting = "\x01\x02garbage\r\n");
    e = open_reader();
    match_usual(e, &secs);
    assert_true(secs < LOOKUP_BOUND_S);
    assert_ok(tu_close(e));
}

/* ---- redirects ---- */

static void test_redirects_to_nowhere_and_loops(void **state)
{
    (void)state;
    char line[160];
    snprintf(line, sizeof(line), "-MOVED 1 127.0.0.1:%d\r\n", srv.closed_port);
    lookup_under(TW_RAW, line, false);
    snprintf(line, sizeof(line), "-ASK 1 127.0.0.1:%d\r\n", srv.closed_port);
    lookup_under(TW_RAW, line, false);
    lookup_under(TW_MOVED_SELF, NULL, false);
    lookup_under(TW_ASK_SELF, NULL, false);
    lookup_under(TW_PINGPONG, NULL, false);
    static const char *const bad[] = {"-MOVED\r\n",
                                      "-MOVED \r\n",
                                      "-MOVED x 127.0.0.1:1\r\n",
                                      "-MOVED 99999 127.0.0.1:1\r\n",
                                      "-MOVED 1 127.0.0.1\r\n",
                                      "-MOVED 1 :80\r\n",
                                      "-MOVED 1 127.0.0.1:0\r\n",
                                      "-MOVED 1 127.0.0.1:99999999\r\n",
                                      "-MOVED 1 127.0.0.1:-5\r\n",
                                      "-ASK 18446744073709551617 127.0.0.1:1\r\n"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        lookup_under(TW_RAW, bad[i], false);
    /* A host name longer than any node's. */
    char lng[400];
    int n = snprintf(lng, sizeof(lng), "-MOVED 1 ");
    memset(lng + n, 'h', 300);
    snprintf(lng + n + 300, sizeof(lng) - (size_t)n - 300, ":%d\r\n", srv.port[0]);
    lookup_under(TW_RAW, lng, false);
}

/* ---- slot maps ---- */

/* One lookup with CLUSTER SLOTS answered by map: no crash, no wrong
 * bytes, within the deadline; `hits` when the map is usable. */
static void lookup_with_map(const char *map, bool hits)
{
    srv_reset_twists();
    write_usual();
    SRV_SET(snprintf(srv.slots_raw, sizeof(srv.slots_raw), "%s", map));
    kvh_engine *e = open_reader();
    double secs;
    size_t got = match_usual(e, &secs);
    assert_true(secs < LOOKUP_BOUND_S);
    if (hits)
        assert_int_equal(got, NB);
    assert_ok(tu_close(e));
}

static void test_malformed_slot_maps(void **state)
{
    (void)state;
    char m[4096];
#define ENTRY(lo, hi, host, port) "*3\r\n:" lo "\r\n:" hi "\r\n*2\r\n" host ":" port "\r\n"
    lookup_with_map("*0\r\n", false);
    lookup_with_map("*1\r\n" ENTRY("0", "16383", "$9\r\n127.0.0.1\r\n", "0"), false);
    lookup_with_map("*1\r\n" ENTRY("0", "16383", "$9\r\n127.0.0.1\r\n", "70000"), false);
    lookup_with_map("*1\r\n" ENTRY("0", "16384", "$9\r\n127.0.0.1\r\n", "1"), false);
    lookup_with_map("*1\r\n" ENTRY("-1", "5", "$9\r\n127.0.0.1\r\n", "1"), false);
    lookup_with_map("*1\r\n" ENTRY("9", "5", "$9\r\n127.0.0.1\r\n", "1"), false);
    lookup_with_map("*1\r\n" ENTRY("0", "16383", ":5\r\n", "1"), false);
    lookup_with_map("*1\r\n*3\r\n:0\r\n:16383\r\n:7\r\n", false);
    lookup_with_map("*1\r\n*2\r\n:0\r\n:16383\r\n", false);
    lookup_with_map("*2\r\n*-1\r\n$-1\r\n", false);
    lookup_with_map("*1\r\n*3\r\n$1\r\n0\r\n$5\r\n16383\r\n*0\r\n", false);
    lookup_with_map("*1\r\n*3\r\n:0\r\n:16383\r\n*1\r\n$9\r\n127.0.0.1\r\n", false);
    lookup_with_map(":1\r\n", false);
    lookup_with_map("$5\r\nslots\r\n", false);
    /* A host of 300 characters. */
    char host[310];
    memset(host, 'h', 300);
    host[300] = '\0';
    snprintf(m, sizeof(m), "*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$300\r\n%s\r\n:%d\r\n", host, srv.port[0]);
    lookup_with_map(m, false);
    /* Every slot on a port nobody listens on. */
    snprintf(m, sizeof(m), "*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n", srv.closed_port);
    lookup_with_map(m, false);
    /* An empty host is the address asked: usable. */
    snprintf(m, sizeof(m), "*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$0\r\n\r\n:%d\r\n", srv.port[0]);
    lookup_with_map(m, true);
    /* Half the slots nowhere, half here. */
    snprintf(m, sizeof(m),
             "*2\r\n*3\r\n:0\r\n:8191\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n*3\r\n:8192\r\n:16383\r\n*2\r\n$9\r\n"
             "127.0.0.1\r\n:%d\r\n",
             srv.closed_port, srv.port[0]);
    lookup_with_map(m, false);
#undef ENTRY
}

/* Every master of the map accepts connections and never answers: one
 * lookup still waits about one deadline, not one per node. */
static void test_all_masters_stall(void **state)
{
    (void)state;
    enum { K = 10 };
    int fds[K], ports[K];
    for (int i = 0; i < K; i++)
        fds[i] = listen_on(64, &ports[i]); /* never accepted: the kernel completes the handshakes */
    char m[4096];
    int n = snprintf(m, sizeof(m), "*%d\r\n", K);
    for (int i = 0; i < K; i++) {
        int lo = i * (16384 / K), hi = i == K - 1 ? 16383 : (i + 1) * (16384 / K) - 1;
        n += snprintf(m + n, sizeof(m) - (size_t)n, "*3\r\n:%d\r\n:%d\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n", lo, hi,
                      ports[i]);
    }
    write_usual();
    SRV_SET(snprintf(srv.slots_raw, sizeof(srv.slots_raw), "%s", m));
    kvh_engine *e = open_reader();
    kvh_seq s = tu_seq_new(e, 0);
    enum { MANY = 64 }; /* keys on every node */
    static int32_t tokens[MANY * BT];
    tu_iota(tokens, MANY * BT, 5000);
    size_t got = 0;
    double t0 = tu_now();
    assert_ok(kvh_seq_match_prefix(e, s, tokens, MANY * BT, &got));
    double secs = tu_now() - t0;
    assert_int_equal(got, 0);
    assert_ok(tu_close(e));
    for (int i = 0; i < K; i++)
        close(fds[i]);
    print_message("all masters stalled: lookup took %.2f s (bound %.2f s)\n", secs, LOOKUP_BOUND_S);
    assert_true(secs < LOOKUP_BOUND_S);
}

/* ---- uploads ---- */

/* An upload under the SET (or EXISTS) twist: every block dropped and
 * counted, none counted as uploaded, within the deadline. */
static void upload_under(int tw_set, int tw_exists, const char *raw)
{
    srv_reset_twists();
    SRV_SET(srv.tw_set = tw_set; srv.tw_exists = tw_exists; if (raw) snprintf(srv.raw, sizeof(srv.raw), "%s", raw));
    double t0 = tu_now();
    kvh_stats st = write_blocks(HEADS, DIM, SALT, TAG, 1000);
    assert_true(tu_now() - t0 < LOOKUP_BOUND_S + 1.0);
    assert_int_equal(st.remote_uploads, 0);
    assert_int_equal(st.remote_uploads_dropped, NB);
}

static void test_uploads_dropped_and_counted(void **state)
{
    (void)state;
    upload_under(TW_RAW, TW_NONE, "-OOM command not allowed\r\n");
    upload_under(TW_RAW, TW_NONE, ":1\r\n");
    upload_under(TW_RAW, TW_NONE, "*1\r\n+OK\r\n");
    upload_under(TW_RAW, TW_NONE, "$2\r\nOK\r\n");
    upload_under(TW_RAW, TW_NONE, "$99999\r\nOK\r\n");
    upload_under(TW_SILENT, TW_NONE, NULL);
    upload_under(TW_CLOSE_MID, TW_NONE, NULL);
    upload_under(TW_NONE, TW_SILENT, NULL);
    upload_under(TW_NONE, TW_RAW, "$1\r\n0\r\n");
}

/* ---- AUTH ---- */

static void test_auth_refusals(void **state)
{
    (void)state;
    SRV_SET(srv.password = "right");
    kvh_config c = cfg_for(srv.addrs, HEADS, DIM, SALT);
    kvh_engine *e = NULL;
    c.remote_password = "wrong";
    kvh_status st = kvh_engine_open(&c, &e);
    if (st == KVH_ERR_UNSUPPORTED)
        skip();
    assert_int_equal(st, KVH_ERR_IO);
    assert_null(e);
    c.remote_password = NULL; /* NOAUTH on the first command */
    assert_int_equal(kvh_engine_open(&c, &e), KVH_ERR_IO);
    c.remote_password = "right";
    c.remote_user = "nobody";
    assert_int_equal(kvh_engine_open(&c, &e), KVH_ERR_IO);
    c.remote_user = NULL;
    assert_ok(kvh_engine_open(&c, &e));
    assert_ok(kvh_engine_close(e));
    /* An AUTH that gets no answer is a node not answering: the open goes
     * on, within the deadline. */
    SRV_SET(srv.silent = true);
    double t0 = tu_now();
    assert_ok(kvh_engine_open(&c, &e));
    assert_true(tu_now() - t0 < 4 * TIMEOUT_MS / 1000.0 + 0.6);
    assert_ok(kvh_engine_close(e));
}

/* kvh-store's remote count scans every master (SCAN MATCH). */
static int count_key(void *user, const char *key, size_t len)
{
    (void)key;
    (void)len;
    ++*(int *)user;
    return 0;
}

/* Scans under a twist: the status and how long it took. */
static int scan_under(int twist, const char *raw, int *keys, double *secs)
{
    SRV_SET(srv.tw_scan = twist; snprintf(srv.raw, sizeof(srv.raw), "%s", raw ? raw : ""));
    kvhi_cluster_opts o = {.addrs = srv.addrs, .timeout_ms = TIMEOUT_MS, .breaker_ms = BREAKER_MS};
    kvhi_cluster *cl = NULL;
    char err[256] = "";
    if (kvhi_cluster_open(&o, &cl, err, sizeof(err)) != 0)
        fail_msg("cluster open: %s", err);
    *keys = 0;
    double t0 = tu_now();
    int rc = kvhi_cluster_scan(cl, "", count_key, keys, err, sizeof(err));
    *secs = tu_now() - t0;
    kvhi_cluster_close(cl);
    return rc;
}

/* A page that trickles in, one that never comes, one whose cursor never
 * advances and one that is not a page: each scan ends in its page's
 * deadline (20 rounds) with an error, never waits on or loops forever. */
static void test_scan_of_a_hostile_node_ends(void **state)
{
    (void)state;
    write_usual(); /* skips where the build has no remote tier */
    int keys, stored;
    SRV_SET(stored = srv.n_items);
    assert_true(stored >= NB);
    double secs, bound = 20.0 * TIMEOUT_MS / 1000.0 + 1.5;
    assert_int_equal(scan_under(TW_NONE, NULL, &keys, &secs), 0);
    assert_int_equal(keys, stored);
    assert_int_equal(scan_under(TW_TRICKLE, NULL, &keys, &secs), -1);
    assert_true(secs < bound);
    assert_int_equal(scan_under(TW_SILENT, NULL, &keys, &secs), -1);
    assert_true(secs < bound);
    assert_int_equal(scan_under(TW_RAW, "*2\r\n$1\r\n7\r\n*0\r\n", &keys, &secs), -1);
    assert_true(secs < bound);
    assert_int_equal(scan_under(TW_RAW, ":12\r\n", &keys, &secs), -1);
    assert_int_equal(
        scan_under(TW_RAW, "*2\r\n$40\r\n0123456789012345678901234567890123456789\r\n*0\r\n", &keys, &secs), -1);
    /* The server answers again: so does the scan. */
    assert_int_equal(scan_under(TW_NONE, NULL, &keys, &secs), 0);
    assert_int_equal(keys, stored);
}

/* kvh-store remote count whose scan fails part way (a page that never
 * comes): it says why, calls its tally partial and exits non-zero, in
 * text and in JSON. */
static void test_store_tool_calls_a_failed_scan_partial(void **state)
{
    (void)state;
    write_usual(); /* skips where the build has no remote tier */
    char tool[4096], out[8192];
    if (!dt_store_tool(tool, sizeof(tool)))
        skip();
    SRV_SET(srv.tw_scan = TW_SILENT);
    char salt[32];
    snprintf(salt, sizeof(salt), "%llu", (unsigned long long)SALT);
    setenv("KVH_REMOTE_ADDRS", srv.addrs, 1);
    setenv("KVH_REMOTE_TIMEOUT_MS", "100", 1);
    setenv("KVH_MODEL_SALT", salt, 1);
    int rc = dt_run_tool(tool, "remote", "count", NULL, out, sizeof(out));
    int json_rc = 0;
    char json[8192];
    if (rc != 0 && rc != -1)
        json_rc = dt_run_tool(tool, "remote", "count", "--json", json, sizeof(json));
    unsetenv("KVH_REMOTE_ADDRS");
    unsetenv("KVH_REMOTE_TIMEOUT_MS");
    unsetenv("KVH_MODEL_SALT");
    assert_int_not_equal(rc, 0);
    assert_non_null(strstr(out, "SCAN failed: timed out after"));
    assert_non_null(strstr(out, "partial"));
    assert_int_not_equal(json_rc, 0);
    assert_non_null(strstr(json, "\"partial\": true"));
}

/* ---- the cluster client alone ---- */

/* A client of the fake server with opts o (skipped without a client). */
static kvhi_cluster *cluster_open_with(kvhi_cluster_opts o)
{
    kvhi_cluster *cl = NULL;
    char err[256] = "";
    int rc = kvhi_cluster_open(&o, &cl, err, sizeof(err));
    if (rc == KVHI_CLUSTER_NO_CLIENT)
        skip();
    if (rc != 0)
        fail_msg("cluster open: %s", err);
    return cl;
}

static kvhi_cluster *cluster_open(const char *password)
{
    return cluster_open_with((kvhi_cluster_opts){
        .addrs = srv.addrs, .password = password, .timeout_ms = TIMEOUT_MS, .breaker_ms = BREAKER_MS});
}

static kvhi_cluster_cmd command(const char *verb, const char *key, const void *value, size_t value_len)
{
    kvhi_cluster_cmd cmd = {.argc = value ? 3 : 2, .argv = {verb, key, value}, .argvlen = {strlen(verb), strlen(key)}};
    cmd.argvlen[2] = value_len;
    return cmd;
}

/* Runs one command; its result. */
static int run_one(kvhi_cluster *cl, kvhi_cluster_cmd cmd, kvhi_cluster_report *rep)
{
    kvhi_cluster_run(cl, &cmd, 1, rep);
    int result = cmd.result;
    kvhi_cluster_cmds_clear(cl, &cmd, 1);
    return result;
}

typedef struct strings_seen {
    int values, others;
    size_t value_len;
} strings_seen;

static void note_string(void *user, size_t i, const char *str, size_t len)
{
    (void)i, (void)str;
    strings_seen *seen = user;
    if (len == seen->value_len)
        seen->values++;
    else
        seen->others++;
}

/* Serves slots 0-8191 from listener 0 and the rest from listener 1, and
 * names a key of each. */
static void two_masters(char key_a[16], char key_b[16])
{
    char map[512];
    snprintf(map, sizeof(map),
             "*2\r\n*3\r\n:0\r\n:8191\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n"
             "*3\r\n:8192\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n",
             srv.port[0], srv.port[1]);
    SRV_SET(snprintf(srv.slots_raw, sizeof(srv.slots_raw), "%s", map));
    key_a[0] = key_b[0] = '\0';
    for (int i = 0; !key_a[0] || !key_b[0]; i++) {
        char k[16];
        snprintf(k, sizeof(k), "key%d", i);
        char *dst = kvhi_cluster_key_slot(k, strlen(k)) < 8192 ? key_a : key_b;
        if (!dst[0])
            snprintf(dst, 16, "%s", k);
    }
}

/* A connection opened inside a round of value reads (the second master's
 * first) authenticates first: the answer to that AUTH, a bulk string
 * here, is no command's value (it was handed over as one, with the index
 * of an earlier round, and written through as a block). */
static void test_auth_answer_is_no_value(void **state)
{
    (void)state;
    char key_a[16], key_b[16];
    two_masters(key_a, key_b);
    SRV_SET(srv.password = "pw"; srv.auth_bulk = true);
    kvhi_cluster *cl = cluster_open("pw");
    static char value[4096];
    memset(value, 0x5a, sizeof(value));
    kvhi_cluster_report rep;
    kvhi_cluster_cmd cmds[2] = {command("GETEX", key_a, NULL, 0), command("GETEX", key_b, NULL, 0)};
    strings_seen seen = {.value_len = sizeof(value)};
    kvhi_cluster_run_strings(cl, cmds, 2, &rep, note_string, &seen, kvhi_cluster_deadline(cl));
    assert_int_equal(cmds[0].result, KVHI_CMD_OK);
    assert_int_equal(cmds[1].result, KVHI_CMD_OK);
    kvhi_cluster_cmds_clear(cl, cmds, 2);
    assert_int_equal(seen.values, 0); /* neither key is stored */
    assert_int_equal(seen.others, 0);
    kvhi_cluster_close(cl);
}

/* A server that closed the connection while a round had megabytes to
 * write: the writes fail with EPIPE, and SIGPIPE, whose default action
 * ends the process, is neither delivered nor left pending. */
static void test_writes_to_a_closed_connection_raise_no_sigpipe(void **state)
{
    (void)state;
    void (*was)(int) = signal(SIGPIPE, SIG_DFL);
    sigset_t mask_before, mask_after, pending;
    pthread_sigmask(SIG_SETMASK, NULL, &mask_before);
    SRV_SET(srv.tw_exists = TW_CLOSE_AFTER);
    kvhi_cluster *cl = cluster_open(NULL);
    kvhi_cluster_report rep;
    assert_int_equal(run_one(cl, command("EXISTS", "k0", NULL, 0), &rep), KVHI_CMD_OK);
    enum { N = 6, BYTES = 3 << 20 };
    char *value = malloc(BYTES);
    assert_non_null(value);
    memset(value, 0x33, BYTES);
    kvhi_cluster_cmd cmds[N];
    char keys[N][16];
    for (int i = 0; i < N; i++) {
        snprintf(keys[i], sizeof(keys[i]), "big%d", i);
        cmds[i] = command("SET", keys[i], value, BYTES);
    }
    kvhi_cluster_run(cl, cmds, N, &rep);
    int ok = 0;
    for (int i = 0; i < N; i++)
        ok += cmds[i].result == KVHI_CMD_OK;
    kvhi_cluster_cmds_clear(cl, cmds, N);
    assert_true(ok < N); /* the first ones went to the closed connection */
    sigpending(&pending);
    assert_false(sigismember(&pending, SIGPIPE));
    pthread_sigmask(SIG_SETMASK, NULL, &mask_after);
    assert_int_equal(sigismember(&mask_after, SIGPIPE), sigismember(&mask_before, SIGPIPE));
    kvhi_cluster_close(cl);
    free(value);
    signal(SIGPIPE, was);
}

/* Two masters, one slow: the round's time runs out on the slow one, and
 * the other, read after the deadline, is not left alone for that. */
static void test_one_slow_master_leaves_only_itself_alone(void **state)
{
    (void)state;
    char key_a[16], key_b[16];
    two_masters(key_a, key_b);
    kvhi_cluster *cl = cluster_open(NULL);
    static char value[1024];
    memset(value, 0x42, sizeof(value));
    kvhi_cluster_report rep;
    assert_int_equal(run_one(cl, command("SET", key_a, value, sizeof(value)), &rep), KVHI_CMD_OK);
    assert_int_equal(run_one(cl, command("SET", key_b, value, sizeof(value)), &rep), KVHI_CMD_OK);
    SRV_SET(srv.tw_get = TW_SLOW; srv.slow_listener = 0);
    kvhi_cluster_cmd cmds[2] = {command("GETEX", key_a, NULL, 0), command("GETEX", key_b, NULL, 0)};
    kvhi_cluster_run(cl, cmds, 2, &rep);
    assert_int_equal(cmds[0].result, KVHI_CMD_TIMEOUT);
    kvhi_cluster_cmds_clear(cl, cmds, 2);
    assert_int_equal(rep.breaker_opens, 1);
    sleep_ms(3 * TIMEOUT_MS); /* the server thread is done sleeping */
    kvhi_cluster_close(cl);
}

/* An address without a port is KVH_ERR_INVALID_ARG whatever words it
 * holds (the status was once read off the message, which quotes it). */
static void test_bad_addresses_are_invalid_whatever_they_say(void **state)
{
    (void)state;
    kvh_engine *e = open_reader(); /* skips without a remote tier */
    assert_ok(tu_close(e));
    static const char *const addrs[] = {"redis-0", "memorystore-0", "hiredis-proxy", "AUTHPROXY", "out of memory"};
    for (size_t i = 0; i < sizeof(addrs) / sizeof(addrs[0]); i++) {
        kvh_config c = cfg_for(addrs[i], HEADS, DIM, SALT);
        e = NULL;
        assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(&c, &e));
        assert_null(e);
    }
}

/* A reply longer than max_reply_bytes fails its command alone: the
 * connection it came on is dropped, and the commands of the round behind
 * it on that node are sent again on a new one, not reported down. */
static void test_a_reply_too_long_fails_only_its_command(void **state)
{
    (void)state;
    kvhi_cluster *cl = cluster_open_with((kvhi_cluster_opts){
        .addrs = srv.addrs, .timeout_ms = TIMEOUT_MS, .breaker_ms = BREAKER_MS, .max_reply_bytes = 100});
    static char big[200 << 10], small[10]; /* big: longer than one read */
    memset(big, 0x41, sizeof(big));
    memset(small, 0x42, sizeof(small));
    kvhi_cluster_report rep;
    assert_int_equal(run_one(cl, command("SET", "big", big, sizeof(big)), &rep), KVHI_CMD_OK);
    assert_int_equal(run_one(cl, command("SET", "small1", small, sizeof(small)), &rep), KVHI_CMD_OK);
    assert_int_equal(run_one(cl, command("SET", "small2", small, sizeof(small)), &rep), KVHI_CMD_OK);
    kvhi_cluster_cmd cmds[3] = {command("GETEX", "small1", NULL, 0), command("GETEX", "big", NULL, 0),
                                command("GETEX", "small2", NULL, 0)};
    kvhi_cluster_run(cl, cmds, 3, &rep);
    assert_int_equal(cmds[0].result, KVHI_CMD_OK);
    assert_int_equal(cmds[1].result, KVHI_CMD_TOO_LARGE);
    assert_int_equal(cmds[2].result, KVHI_CMD_OK);
    const char *str = NULL;
    size_t len = 0;
    assert_int_equal(kvhi_cluster_reply(&cmds[2], &str, &len, NULL), KVHI_REPLY_STRING);
    assert_int_equal(len, sizeof(small));
    assert_memory_equal(str, small, sizeof(small));
    assert_int_equal(rep.breaker_opens, 0);
    assert_int_equal(rep.down, 0);
    kvhi_cluster_cmds_clear(cl, cmds, 3);
    /* One that came whole with the reply before it is too long as well. */
    static char medium[1000];
    memset(medium, 0x43, sizeof(medium));
    assert_int_equal(run_one(cl, command("SET", "medium", medium, sizeof(medium)), &rep), KVHI_CMD_OK);
    kvhi_cluster_cmd two[2] = {command("GETEX", "small1", NULL, 0), command("GETEX", "medium", NULL, 0)};
    kvhi_cluster_run(cl, two, 2, &rep);
    assert_int_equal(two[0].result, KVHI_CMD_OK);
    assert_int_equal(two[1].result, KVHI_CMD_TOO_LARGE);
    kvhi_cluster_cmds_clear(cl, two, 2);
    kvhi_cluster_close(cl);
}

/* ---- what the log and the counters say ---- */

/* The engine's log lines, for the tests that check what it says. */
static struct {
    pthread_mutex_t mu;
    char text[8192];
} seen_log = {PTHREAD_MUTEX_INITIALIZER, ""};

static void capture_log(void *user, int32_t level, const char *message)
{
    (void)user, (void)level;
    pthread_mutex_lock(&seen_log.mu);
    size_t n = strlen(seen_log.text);
    snprintf(seen_log.text + n, sizeof(seen_log.text) - n, "%s\n", message);
    pthread_mutex_unlock(&seen_log.mu);
}

static bool log_says(const char *what)
{
    pthread_mutex_lock(&seen_log.mu);
    bool found = strstr(seen_log.text, what) != NULL;
    pthread_mutex_unlock(&seen_log.mu);
    return found;
}

static kvh_engine *open_reader_logged(uint32_t timeout_ms)
{
    SRV_SET(seen_log.text[0] = '\0');
    kvh_config c = cfg_for(srv.addrs, HEADS, DIM, SALT);
    c.remote_timeout_ms = timeout_ms;
    c.log_fn = capture_log;
    return open_remote(&c);
}

/* A stored value far longer than a block's (a bulk that claims a
 * gigabyte and streams): not held whole until the deadline ends it (which
 * left the node alone and the value in place for the next match), but
 * found too long once a block's worth has come, counted as a value that
 * failed verification and deleted; the node stays in use. */
static void test_an_oversized_value_is_corrupt_and_deleted(void **state)
{
    (void)state;
    write_usual();
    SRV_SET(srv.tw_get = TW_ENDLESS);
    kvh_engine *e = open_reader_logged(5000);
    double secs;
    assert_int_equal(match_usual(e, &secs), 0);
    kvh_stats st = tu_stats(e);
    print_message("oversized value: a miss in %.3f s; %llu corrupt, %llu timeouts, %llu breaker opens\n", secs,
                  (unsigned long long)st.remote_corrupt, (unsigned long long)st.remote_timeouts,
                  (unsigned long long)st.remote_breaker_opens);
    assert_true(secs < 2.0);
    assert_int_equal(st.remote_corrupt, 1);
    assert_int_equal(st.remote_timeouts, 0);
    assert_int_equal(st.remote_breaker_opens, 0);
    int deleted;
    SRV_SET(deleted = srv.n_del);
    assert_int_equal(deleted, 1);
    assert_true(log_says("a value longer than a block's"));
    /* The same engine, no breaker to wait for, reads a good store back. */
    srv_reset_twists();
    write_usual();
    assert_int_equal(match_usual(e, &secs), NB);
    assert_ok(tu_close(e));
}

/* A seed that accepts connections and never answers, or answers bytes
 * that are not RESP, is a node that failed: logged, counted in
 * remote_breaker_opens (the open's own included) and left alone, so the
 * calls after it do not each wait on it again. */
static void test_a_seed_that_fails_at_open_is_counted_and_logged(void **state)
{
    (void)state;
    for (int garbage = 0; garbage < 2; garbage++) {
        srv_reset_twists();
        write_usual();
        if (garbage)
            SRV_SET(srv.greeting = "\x01\x02not RESP\r\n");
        else
            SRV_SET(srv.silent = true);
        kvh_engine *e = open_reader_logged(TIMEOUT_MS);
        assert_int_equal(tu_stats(e).remote_breaker_opens, 1);
        assert_true(log_says("not asked again"));
        double secs;
        assert_int_equal(match_usual(e, &secs), 0);
        double left_alone = secs;
        assert_int_equal(match_usual(e, &secs), 0);
        left_alone = secs > left_alone ? secs : left_alone;
        print_message("%s seed: matches while it is left alone took at most %.1f ms\n", garbage ? "garbage" : "silent",
                      left_alone * 1e3);
        assert_true(left_alone < TIMEOUT_MS / 2000.0);
        assert_ok(tu_close(e));
    }
}

/* A user without a command's rights gets error replies: misses and
 * dropped uploads, as before, and now a log line that says why. */
static void test_refusals_are_logged(void **state)
{
    (void)state;
    SRV_SET(srv.tw_set = TW_RAW;
            snprintf(srv.raw, sizeof(srv.raw), "-NOPERM this user has no permissions to run the 'set' command\r\n"));
    SRV_SET(seen_log.text[0] = '\0');
    kvh_config c = cfg_for(srv.addrs, HEADS, DIM, SALT);
    c.log_fn = capture_log;
    kvh_engine *e = open_remote(&c);
    kvh_seq s = tu_seq_new(e, 0);
    int32_t tokens[NB * BT];
    tu_iota(tokens, NB * BT, 1000);
    assert_ok(kvh_seq_append(e, s, tokens, NB * BT));
    tu_write_pattern(e, s, LAYERS, TOK_BYTES, TAG, 0, NB * BT);
    assert_ok(kvh_seq_persist(e, s));
    kvh_stats st = tu_stats(e);
    assert_ok(tu_close(e));
    assert_int_equal(st.remote_uploads_dropped, NB);
    assert_true(log_says("answered SET with NOPERM"));
}

/* "[IPv6]:port" names the address inside the brackets (it was taken as
 * a host name with its brackets and never resolved); URLs, ports with
 * more after them and brackets around what is not IPv6 are refused at
 * open instead of failing every call after it. */
static void test_addresses_with_brackets_and_extras(void **state)
{
    (void)state;
    kvh_engine *e = open_reader(); /* skips without a remote tier */
    assert_ok(tu_close(e));
    int fd = socket(AF_INET6, SOCK_STREAM, 0);
    struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_addr = in6addr_loopback};
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof(a)) != 0 || listen(fd, 8) != 0) {
        if (fd >= 0)
            close(fd);
        skip(); /* no IPv6 loopback here */
    }
    socklen_t al = sizeof(a);
    assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &al), 0);
    char addr[64];
    snprintf(addr, sizeof(addr), "[::1]:%d", ntohs(a.sin6_port));
    /* A listener that never accepts: a node reached that does not answer
     * (not one whose name does not resolve). */
    SRV_SET(seen_log.text[0] = '\0');
    kvh_config c = cfg_for(addr, HEADS, DIM, SALT);
    c.log_fn = capture_log;
    assert_ok(kvh_engine_open(&c, &e));
    assert_ok(kvh_engine_close(e));
    close(fd);
    if (!log_says("waiting for a reply"))
        fail_msg("[::1] was not reached; the log said:\n%s", seen_log.text);
    static const char *const bad[] = {"127.0.0.1:6379:7000", "redis://127.0.0.1:6379",
                                      "[127.0.0.1]:6379",    "[::1:6379",
                                      "::1]:6379",           "[]:6379",
                                      "host name:6379",      "h\x01st:6379"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        c = cfg_for(bad[i], HEADS, DIM, SALT);
        e = NULL;
        if (kvh_engine_open(&c, &e) != KVH_ERR_INVALID_ARG)
            fail_msg("'%s' was not refused", bad[i]);
        assert_null(e);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_sanity_roundtrip, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_getex_wrong_types, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_getex_lying_lengths, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_getex_huge_array_count, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_getex_damaged_values, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_getex_foreign_values, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_exists_garbage, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_close_mid_reply, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_slow_reply_is_a_timeout, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_trickling_reply_respects_deadline, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_endless_reply_respects_deadline, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_silent_server, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_stall_at_open_then_recovers, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_stalled_seeds_cost_one_deadline_at_open, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_slot_map_refused_once_then_recovers, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_unsolicited_data, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_redirects_to_nowhere_and_loops, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_malformed_slot_maps, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_all_masters_stall, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_uploads_dropped_and_counted, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_auth_refusals, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_scan_of_a_hostile_node_ends, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_store_tool_calls_a_failed_scan_partial, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_auth_answer_is_no_value, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_writes_to_a_closed_connection_raise_no_sigpipe, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_one_slow_master_leaves_only_itself_alone, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_bad_addresses_are_invalid_whatever_they_say, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_a_reply_too_long_fails_only_its_command, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_an_oversized_value_is_corrupt_and_deleted, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_a_seed_that_fails_at_open_is_counted_and_logged, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_refusals_are_logged, test_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(test_addresses_with_brackets_and_extras, test_setup, tu_teardown),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
