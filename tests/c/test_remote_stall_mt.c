/* The remote tier's bounds with many threads on one engine (run under TSan
 * in `make test`), against one Redis server without cluster support:
 *   - behind a proxy in this test that holds every chunk a while, so each
 *     round answers well within remote_timeout_ms but the engine's few
 *     clients are always busy: a call still waits at most
 *     remote_timeout_ms a round, its wait for a client included;
 *   - stopped (SIGSTOP) while threads call through all of the engine's
 *     clients: the node's circuit breaker opens once for the engine (one
 *     count, one log line), and once it answers again one line says so.
 */
#include "test_util.h"

#include "mt_util.h"
#include "remote_test_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#define LAYERS 2
#define HEADS 2
#define DIM 32
#define BT 16
#define TOK_BYTES (HEADS * DIM * 2)

static rt_cluster server;
static bool have_server;
static uint64_t salt;

static int group_setup(void **state)
{
    (void)state;
    if (!rt_available())
        return 0;
    have_server = rt_start_scratch(&server, 1, NULL) == 0;
    salt = 0x3800000000000000ull ^ (uint64_t)time(NULL);
    return have_server ? 0 : -1;
}

static int group_teardown(void **state)
{
    (void)state;
    if (have_server)
        rt_stop(&server);
    return 0;
}

/* ---- a proxy that delays every chunk, each way ---- */

#define PROXY_CONNS 256

typedef struct proxy {
    int listen_fd, port, upstream_port, delay_ms;
    int quit; /* __atomic */
    pthread_t acceptor;
    pthread_t pipes[PROXY_CONNS];
    int fds[PROXY_CONNS][2]; /* client, upstream */
    int n_pipes;
} proxy;

typedef struct proxy_pipe {
    proxy *p;
    int i;
} proxy_pipe;

static proxy_pipe pipe_args[PROXY_CONNS];

static bool proxy_quitting(proxy *p) { return __atomic_load_n(&p->quit, __ATOMIC_ACQUIRE); }

static bool send_all(int fd, const char *b, ssize_t n)
{
    while (n > 0) {
        ssize_t w = send(fd, b, (size_t)n, MSG_NOSIGNAL);
        if (w <= 0)
            return false;
        b += w;
        n -= w;
    }
    return true;
}

/* One connection: whatever either side sends reaches the other delay_ms
 * later (a request and its reply: twice that). */
static void *proxy_pipe_main(void *arg)
{
    proxy_pipe *pp = arg;
    proxy *p = pp->p;
    int fd[2] = {p->fds[pp->i][0], p->fds[pp->i][1]};
    char buf[1 << 16];
    while (!proxy_quitting(p)) {
        struct pollfd pf[2] = {{.fd = fd[0], .events = POLLIN}, {.fd = fd[1], .events = POLLIN}};
        if (poll(pf, 2, 50) <= 0)
            continue;
        for (int side = 0; side < 2; side++) {
            if (!(pf[side].revents & (POLLIN | POLLHUP | POLLERR)))
                continue;
            ssize_t n = recv(fd[side], buf, sizeof(buf), 0);
            if (n <= 0)
                goto out;
            usleep((useconds_t)p->delay_ms * 1000);
            if (!send_all(fd[1 - side], buf, n))
                goto out;
        }
    }
out:
    shutdown(fd[0], SHUT_RDWR);
    shutdown(fd[1], SHUT_RDWR);
    return NULL;
}

static int listen_loopback(int *port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof(a);
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof(a)) != 0 || listen(fd, 64) != 0 ||
        getsockname(fd, (struct sockaddr *)&a, &len) != 0)
        return -1;
    *port = ntohs(a.sin_port);
    return fd;
}

static void *proxy_accept_main(void *arg)
{
    proxy *p = arg;
    while (!proxy_quitting(p) && p->n_pipes < PROXY_CONNS) {
        struct pollfd pf = {.fd = p->listen_fd, .events = POLLIN};
        if (poll(&pf, 1, 50) <= 0)
            continue;
        int cfd = accept(p->listen_fd, NULL, NULL);
        if (cfd < 0)
            continue;
        int ufd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = {.sin_family = AF_INET,
                                .sin_port = htons((uint16_t)p->upstream_port),
                                .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        if (ufd < 0 || connect(ufd, (struct sockaddr *)&a, sizeof(a)) != 0) {
            close(cfd);
            if (ufd >= 0)
                close(ufd);
            continue;
        }
        int i = p->n_pipes;
        p->fds[i][0] = cfd;
        p->fds[i][1] = ufd;
        pipe_args[i] = (proxy_pipe){p, i};
        if (pthread_create(&p->pipes[i], NULL, proxy_pipe_main, &pipe_args[i]) != 0) {
            close(cfd);
            close(ufd);
            continue;
        }
        p->n_pipes++;
    }
    return NULL;
}

static int proxy_start(proxy *p, int upstream_port, int delay_ms)
{
    memset(p, 0, sizeof(*p));
    p->upstream_port = upstream_port;
    p->delay_ms = delay_ms;
    if ((p->listen_fd = listen_loopback(&p->port)) < 0)
        return -1;
    return pthread_create(&p->acceptor, NULL, proxy_accept_main, p) == 0 ? 0 : -1;
}

static void proxy_stop(proxy *p)
{
    __atomic_store_n(&p->quit, 1, __ATOMIC_RELEASE);
    pthread_join(p->acceptor, NULL);
    for (int i = 0; i < p->n_pipes; i++) {
        pthread_join(p->pipes[i], NULL);
        close(p->fds[i][0]);
        close(p->fds[i][1]);
    }
    close(p->listen_fd);
}

/* ---- the engine's threads ---- */

typedef struct call_times {
    double match_max, persist_max; /* seconds */
} call_times;

static call_times times[MT_MAX_THREADS];
#define CALLS 4

/* Matches a prefix the store lacks (one EXISTS round), then writes and
 * persists it (an EXISTS round and a SET round), CALLS times. */
static void *timed_worker(void *arg)
{
    mt_worker *w = arg;
    call_times *ct = &times[w->t];
    enum { BLOCKS = 2 };
    for (int r = 0; r < CALLS && !w->errors; r++) {
        int32_t tokens[BLOCKS * BT];
        tu_iota(tokens, BLOCKS * BT, 1000000 * (int32_t)(w->t + 1) + 10000 * r);
        kvh_seq s;
        size_t m = 0;
        if (kvh_seq_create(w->e, 0, &s) != KVH_OK) {
            mt_report(w, "create: %s", kvh_last_error());
            break;
        }
        double t0 = tu_now();
        kvh_status st = kvh_seq_match_prefix(w->e, s, tokens, BLOCKS * BT, &m);
        double took = tu_now() - t0;
        ct->match_max = took > ct->match_max ? took : ct->match_max;
        if (st != KVH_OK || m != 0 || kvh_seq_append(w->e, s, tokens, BLOCKS * BT) != KVH_OK) {
            mt_report(w, "round %d: match or append: %s (matched %zu)", r, kvh_last_error(), m);
            kvh_seq_free(w->e, s);
            break;
        }
        uint8_t k[TOK_BYTES * BT], v[TOK_BYTES * BT];
        for (uint32_t l = 0; l < LAYERS; l++)
            for (size_t t0k = 0; t0k < BLOCKS * BT; t0k += BT) {
                for (size_t t = 0; t < BT; t++) {
                    tu_pattern(k + t * TOK_BYTES, TOK_BYTES, (uint64_t)w->t, l, t0k + t, 0);
                    tu_pattern(v + t * TOK_BYTES, TOK_BYTES, (uint64_t)w->t, l, t0k + t, 1);
                }
                if (kvh_seq_write_kv(w->e, s, l, t0k, BT, k, v) != KVH_OK)
                    mt_report(w, "round %d: write: %s", r, kvh_last_error());
            }
        t0 = tu_now();
        st = kvh_seq_persist(w->e, s);
        took = tu_now() - t0;
        ct->persist_max = took > ct->persist_max ? took : ct->persist_max;
        if (st != KVH_OK)
            mt_report(w, "round %d: persist: %s", r, kvh_last_error());
        kvh_seq_free(w->e, s);
    }
    return NULL;
}

/* 16 threads share the engine's clients through a proxy that adds 50 ms
 * each way: every round answers in about 100 ms, well within the 400 ms
 * deadline, but a call that waited in line for a client behind seven
 * others' rounds would take about a second. The wait counts against the
 * round's deadline: a match (one round) ends within it, a persist (two
 * rounds) within two, plus the engine's own work; a wait that runs out is
 * a miss or a dropped upload, counted as a timeout. */
static void test_wait_for_a_client_counts_against_the_deadline(void **state)
{
    (void)state;
    if (!have_server)
        skip();
    enum { THREADS = 16, TIMEOUT_MS = 400, DELAY_MS = 50 };
    proxy px;
    assert_int_equal(proxy_start(&px, server.ports[0], DELAY_MS), 0);
    char addr[64];
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", px.port);
    kvh_config c = tu_cfg(LAYERS, HEADS, DIM, BT, KVH_DTYPE_F16, 256, 512, 1);
    c.model_salt = salt ^ 0x1111;
    c.remote_addrs = addr;
    c.remote_timeout_ms = TIMEOUT_MS;
    kvh_engine *e = tu_open_cfg(&c);
    memset(times, 0, sizeof(times));
    mt_worker w[THREADS];
    mt_run(e, THREADS, timed_worker, w);
    kvh_stats st = tu_stats(e);
    assert_ok(tu_close(e));
    proxy_stop(&px);
    double match_max = 0, persist_max = 0;
    for (int t = 0; t < THREADS; t++) {
        match_max = times[t].match_max > match_max ? times[t].match_max : match_max;
        persist_max = times[t].persist_max > persist_max ? times[t].persist_max : persist_max;
    }
    print_message("slowest match %.0f ms, persist %.0f ms; %llu uploads, %llu dropped, %llu timeouts, %llu "
                  "breaker opens\n",
                  match_max * 1e3, persist_max * 1e3, (unsigned long long)st.remote_uploads,
                  (unsigned long long)st.remote_uploads_dropped, (unsigned long long)st.remote_timeouts,
                  (unsigned long long)st.remote_breaker_opens);
    /* The slack: the engine's own work, TSan and a loaded machine. */
    double slack = 0.25;
    assert_true(match_max < TIMEOUT_MS / 1e3 + slack);
    assert_true(persist_max < 2 * TIMEOUT_MS / 1e3 + slack);
    assert_int_equal(st.remote_uploads + st.remote_uploads_dropped, THREADS * CALLS * 2);
    /* The server answered every round it was sent in time: the rounds
     * that ran out in line leave it in use. */
    assert_int_equal(st.remote_breaker_opens, 0);
}

/* ---- one breaker a node for the engine's clients ---- */

static pthread_mutex_t lines_lock = PTHREAD_MUTEX_INITIALIZER;
static int lines_left_alone, lines_answers_again;

static void count_breaker_lines(void *user, int32_t level, const char *message)
{
    (void)user;
    (void)level;
    pthread_mutex_lock(&lines_lock);
    lines_left_alone += strstr(message, "not asked again") != NULL;
    lines_answers_again += strstr(message, "answers again") != NULL;
    pthread_mutex_unlock(&lines_lock);
}

static int stop_calling; /* __atomic */

/* Matches prefixes the store lacks (an EXISTS round each) until told to
 * stop. */
static void *calling_worker(void *arg)
{
    mt_worker *w = arg;
    enum { BLOCKS = 2 };
    for (int r = 0; !__atomic_load_n(&stop_calling, __ATOMIC_ACQUIRE) && !w->errors; r++) {
        int32_t tokens[BLOCKS * BT];
        tu_iota(tokens, BLOCKS * BT, 1000000 * (int32_t)(w->t + 1) + 100 * (r % 1000));
        kvh_seq s;
        size_t m = 0;
        if (kvh_seq_create(w->e, 0, &s) != KVH_OK || kvh_seq_match_prefix(w->e, s, tokens, BLOCKS * BT, &m) != KVH_OK)
            mt_report(w, "round %d: match: %s", r, kvh_last_error());
        kvh_seq_free(w->e, s);
        usleep(2000);
    }
    return NULL;
}

static void sleep_s(double s) { usleep((useconds_t)(s * 1e6)); }

/* 8 threads keep both of the engine's clients busy; the server stops for
 * 0.6 s (less than remote_breaker_ms), then answers again. Each client
 * has its rounds time out, but the node is one: one breaker open, one
 * line saying it is left alone, and after remote_breaker_ms one probe
 * finds it back, said once. */
static void test_a_node_opens_one_breaker_for_all_clients(void **state)
{
    (void)state;
    if (!have_server)
        skip();
    enum { THREADS = 8, TIMEOUT_MS = 200, BREAKER_MS = 1000 };
    kvh_config c = tu_cfg(LAYERS, HEADS, DIM, BT, KVH_DTYPE_F16, 256, 512, 1);
    c.model_salt = salt ^ 0x2222;
    c.remote_addrs = rt_addrs(&server);
    c.remote_timeout_ms = TIMEOUT_MS;
    c.remote_breaker_ms = BREAKER_MS;
    c.log_fn = count_breaker_lines;
    c.log_level = KVH_LOG_INFO; /* "answers again" */
    lines_left_alone = lines_answers_again = 0;
    kvh_engine *e = tu_open_cfg(&c);
    __atomic_store_n(&stop_calling, 0, __ATOMIC_RELEASE);
    mt_worker w[THREADS];
    pthread_t th[THREADS];
    mt_start(e, THREADS, calling_worker, w, th);
    sleep_s(0.2);
    kill(server.pids[0], SIGSTOP);
    sleep_s(0.6);
    kill(server.pids[0], SIGCONT);
    /* Past the breaker's time, and some rounds after its probe. */
    sleep_s(BREAKER_MS / 1e3 + 0.5);
    __atomic_store_n(&stop_calling, 1, __ATOMIC_RELEASE);
    mt_join(THREADS, th, w);
    kvh_stats st = tu_stats(e);
    assert_ok(tu_close(e));
    pthread_mutex_lock(&lines_lock);
    int left_alone = lines_left_alone, answers_again = lines_answers_again;
    pthread_mutex_unlock(&lines_lock);
    print_message("%llu timeouts, %llu breaker opens; %d 'not asked again' and %d 'answers again' lines\n",
                  (unsigned long long)st.remote_timeouts, (unsigned long long)st.remote_breaker_opens, left_alone,
                  answers_again);
    assert_true(st.remote_timeouts >= 1);
    assert_int_equal(st.remote_breaker_opens, 1);
    assert_int_equal(left_alone, 1);
    assert_int_equal(answers_again, 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_wait_for_a_client_counts_against_the_deadline, tu_teardown),
        cmocka_unit_test_teardown(test_a_node_opens_one_breaker_for_all_clients, tu_teardown),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
