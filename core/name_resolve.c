#include "core/name_resolve.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

kvhi_getaddrinfo_fn kvhi_resolver_getaddrinfo = getaddrinfo;

/* One lookup, shared by the caller and its thread: whichever lets go of
 * it last frees it, so a caller that stopped waiting leaves nothing
 * behind and the thread never writes into a caller's memory. */
typedef struct lookup {
    pthread_mutex_t lock;
    pthread_cond_t done_cv; /* CLOCK_MONOTONIC */
    int refs;
    bool done;
    int gai;       /* getaddrinfo's result */
    int gai_errno; /* errno with EAI_SYSTEM */
    kvhi_resolved found;
    struct lookup *next_running; /* in `running` until its answer came */
    char host[];
} lookup;

/* Lookups still waiting for the name service, by host: a caller that
 * gave up leaves its thread behind until the resolver's own timeout, and
 * engines opened and closed in a loop against a name that never answers
 * would pile up a thread each. Callers of a name being looked up wait on
 * that lookup instead. Lock order: running_lock, then a lookup's lock. */
static pthread_mutex_t running_lock = PTHREAD_MUTEX_INITIALIZER;
static lookup *running;

/* A fork takes running_lock first, so that the child does not inherit it
 * held by a thread it does not have. The child has none of the lookup
 * threads either: their lookups, never to be answered there, are
 * forgotten (left allocated), and the child asks afresh. */
static void running_lock_take(void) { pthread_mutex_lock(&running_lock); }
static void running_lock_let_go(void) { pthread_mutex_unlock(&running_lock); }
static void running_forget_in_child(void)
{
    running = NULL;
    pthread_mutex_unlock(&running_lock);
}
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;
static void running_survives_fork(void)
{
    (void)pthread_atfork(running_lock_take, running_lock_let_go, running_forget_in_child);
}

static void running_remove(lookup *l)
{
    pthread_mutex_lock(&running_lock);
    for (lookup **at = &running; *at; at = &(*at)->next_running)
        if (*at == l) {
            *at = l->next_running;
            break;
        }
    pthread_mutex_unlock(&running_lock);
}

/* Lock held; releases it. */
static void lookup_let_go(lookup *l)
{
    bool last = --l->refs == 0;
    pthread_mutex_unlock(&l->lock);
    if (last) {
        pthread_cond_destroy(&l->done_cv);
        pthread_mutex_destroy(&l->lock);
        free(l);
    }
}

static bool numeric_of(const struct sockaddr *sa, char out[KVHI_RESOLVE_ADDR_LEN])
{
    if (sa->sa_family == AF_INET)
        return inet_ntop(AF_INET, &((const struct sockaddr_in *)(const void *)sa)->sin_addr, out,
                         KVHI_RESOLVE_ADDR_LEN) != NULL;
    if (sa->sa_family == AF_INET6)
        return inet_ntop(AF_INET6, &((const struct sockaddr_in6 *)(const void *)sa)->sin6_addr, out,
                         KVHI_RESOLVE_ADDR_LEN) != NULL;
    return false;
}

static void *lookup_run(void *arg)
{
    lookup *l = arg;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    kvhi_resolved found = {0};
    int gai = kvhi_resolver_getaddrinfo(l->host, NULL, &hints, &res);
    int gai_errno = errno;
    running_remove(l); /* later callers ask again */
    if (gai == 0) {
        for (const struct addrinfo *p = res; p && found.n < KVHI_RESOLVE_MAX; p = p->ai_next)
            if (p->ai_addr && numeric_of(p->ai_addr, found.addr[found.n]))
                found.n++;
        freeaddrinfo(res);
    }
    pthread_mutex_lock(&l->lock);
    l->gai = gai;
    l->gai_errno = gai_errno;
    l->found = found;
    l->done = true;
    pthread_cond_broadcast(&l->done_cv);
    lookup_let_go(l);
    return NULL;
}

/* A numeric address needs no lookup. One with an IPv6 zone ("fe80::1%eth0")
 * is kept as written: the zone would not survive a round trip. */
static bool is_numeric(const char *host)
{
    unsigned char buf[sizeof(struct in6_addr)];
    if (inet_pton(AF_INET, host, buf) == 1 || inet_pton(AF_INET6, host, buf) == 1)
        return true;
    const char *zone = strchr(host, '%');
    if (!zone || zone == host || (size_t)(zone - host) >= KVHI_RESOLVE_ADDR_LEN)
        return false;
    char addr[KVHI_RESOLVE_ADDR_LEN];
    memcpy(addr, host, (size_t)(zone - host));
    addr[zone - host] = '\0';
    return inet_pton(AF_INET6, addr, buf) == 1;
}

static struct timespec monotonic_in(uint64_t ns)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t t = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    t = t + ns < t ? UINT64_MAX : t + ns;
    return (struct timespec){.tv_sec = (time_t)(t / 1000000000ull), .tv_nsec = (long)(t % 1000000000ull)};
}

static lookup *lookup_new(const char *host)
{
    size_t len = strlen(host);
    lookup *l = calloc(1, sizeof(*l) + len + 1);
    if (!l)
        return NULL;
    memcpy(l->host, host, len + 1);
    l->refs = 2;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&l->done_cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&l->lock, NULL);
    return l;
}

/* Starts l's thread, detached, with every signal blocked (a signal meant
 * for the caller's threads must not land in it). 0 or an errno. */
static int lookup_start(lookup *l)
{
    pthread_attr_t attr;
    if (pthread_attr_init(&attr) != 0)
        return ENOMEM;
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_t t;
    int rc = pthread_create(&t, &attr, lookup_run, l);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    return rc;
}

int kvhi_resolve_numeric(const char *host, uint64_t budget_ns, kvhi_resolved *out, char *err, size_t err_len)
{
    memset(out, 0, sizeof(*out));
    if (is_numeric(host)) {
        if (strlen(host) >= KVHI_RESOLVE_ADDR_LEN) {
            snprintf(err, err_len, "address %s is too long", host);
            return -1;
        }
        strcpy(out->addr[0], host);
        out->n = 1;
        return 0;
    }
    (void)pthread_once(&fork_once, running_survives_fork);
    pthread_mutex_lock(&running_lock);
    lookup *l = running;
    while (l && strcmp(l->host, host) != 0)
        l = l->next_running;
    if (l) { /* asked already and not answered yet: wait for that answer */
        pthread_mutex_lock(&l->lock);
        l->refs++;
        pthread_mutex_unlock(&l->lock);
        pthread_mutex_unlock(&running_lock);
    } else {
        l = lookup_new(host);
        if (!l) {
            pthread_mutex_unlock(&running_lock);
            snprintf(err, err_len, "out of memory looking up %s", host);
            return -1;
        }
        int rc = lookup_start(l);
        if (rc != 0) {
            pthread_mutex_unlock(&running_lock);
            l->refs = 1;
            pthread_mutex_lock(&l->lock);
            lookup_let_go(l);
            snprintf(err, err_len, "cannot start a thread to look up %s: %s", host, strerror(rc));
            return -1;
        }
        l->next_running = running;
        running = l;
        pthread_mutex_unlock(&running_lock);
    }
    struct timespec deadline = monotonic_in(budget_ns);
    pthread_mutex_lock(&l->lock);
    while (!l->done)
        if (pthread_cond_timedwait(&l->done_cv, &l->lock, &deadline) == ETIMEDOUT)
            break;
    int result;
    if (!l->done) {
        snprintf(err, err_len, "no answer from the name service for %s within %llu ms", host,
                 (unsigned long long)(budget_ns / 1000000ull));
        result = -3;
    } else if (l->gai != 0) {
        snprintf(err, err_len, "cannot resolve %s: %s", host,
                 l->gai == EAI_SYSTEM ? strerror(l->gai_errno) : gai_strerror(l->gai));
        result = -1;
    } else if (l->found.n == 0) {
        snprintf(err, err_len, "%s has no IPv4 or IPv6 address", host);
        result = -1;
    } else {
        *out = l->found;
        result = 0;
    }
    lookup_let_go(l);
    return result;
}
