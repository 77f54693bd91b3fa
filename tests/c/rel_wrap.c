/* The wrappers of the C library calls for the programs that inject
 * allocation failures and short transfers (test_rel_faults and its
 * _stress twin): compiled into those programs only, which are linked with
 * -Wl,--wrap=malloc,... (tests/c/CMakeLists.txt), so that every call of
 * the library and of the test reaches these. The controls are declared in
 * rel_util.h. */
#define RL_ALLOC_WRAP
#define RL_IO_WRAP
#include "rel_util.h"

/* ================================================================== */
/* Allocation failure injection                                       */
/* ================================================================== */

static struct {
    atomic_int armed;
    atomic_long count; /* allocations seen while armed */
    long fail_at;      /* 1-based */
    bool persistent;
    atomic_long fired;
    pthread_t only_thread; /* 0: any thread */
} rl_am;

/* Live pointers: chained hash over a static node pool (no malloc). */
#define RL_TRACK_BUCKETS (1u << 16)
#define RL_TRACK_NODES (1u << 18)
typedef struct rl_track_node {
    void *p;
    size_t n;
    uint32_t next;
} rl_track_node;
static struct {
    pthread_mutex_t mu;
    uint32_t bucket[RL_TRACK_BUCKETS]; /* node index + 1; 0 = empty */
    rl_track_node node[RL_TRACK_NODES];
    uint32_t free_head; /* node index + 1 */
    uint32_t used_top;
    long live;
    uint64_t live_bytes;
    bool overflow;
} rl_tr = {.mu = PTHREAD_MUTEX_INITIALIZER};

static uint32_t rl_track_hash(const void *p) { return (uint32_t)(dt_mix((uintptr_t)p) & (RL_TRACK_BUCKETS - 1)); }

static void rl_track_add(void *p, size_t n)
{
    if (!p)
        return;
    pthread_mutex_lock(&rl_tr.mu);
    uint32_t i;
    if (rl_tr.free_head) {
        i = rl_tr.free_head - 1;
        rl_tr.free_head = rl_tr.node[i].next;
    } else if (rl_tr.used_top < RL_TRACK_NODES) {
        i = rl_tr.used_top++;
    } else {
        rl_tr.overflow = true;
        pthread_mutex_unlock(&rl_tr.mu);
        return;
    }
    uint32_t h = rl_track_hash(p);
    rl_tr.node[i] = (rl_track_node){p, n, rl_tr.bucket[h]};
    rl_tr.bucket[h] = i + 1;
    rl_tr.live++;
    rl_tr.live_bytes += n;
    pthread_mutex_unlock(&rl_tr.mu);
}

static void rl_track_del(void *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&rl_tr.mu);
    uint32_t h = rl_track_hash(p);
    for (uint32_t *link = &rl_tr.bucket[h]; *link; link = &rl_tr.node[*link - 1].next) {
        rl_track_node *nd = &rl_tr.node[*link - 1];
        if (nd->p == p) {
            uint32_t i = *link - 1;
            *link = nd->next;
            rl_tr.live--;
            rl_tr.live_bytes -= nd->n;
            nd->p = NULL;
            nd->next = rl_tr.free_head;
            rl_tr.free_head = i + 1;
            break;
        }
    }
    pthread_mutex_unlock(&rl_tr.mu);
}

long rl_alloc_live(void)
{
    pthread_mutex_lock(&rl_tr.mu);
    long n = rl_tr.overflow ? -1 : rl_tr.live;
    pthread_mutex_unlock(&rl_tr.mu);
    return n;
}

uint64_t rl_alloc_live_bytes(void)
{
    pthread_mutex_lock(&rl_tr.mu);
    uint64_t n = rl_tr.live_bytes;
    pthread_mutex_unlock(&rl_tr.mu);
    return n;
}

void rl_alloc_arm(long n, bool persistent, bool this_thread_only)
{
    atomic_store(&rl_am.armed, 0);
    atomic_store(&rl_am.count, 0);
    atomic_store(&rl_am.fired, 0);
    rl_am.fail_at = n;
    rl_am.persistent = persistent;
    rl_am.only_thread = this_thread_only ? pthread_self() : (pthread_t)0;
    atomic_store(&rl_am.armed, 1);
}

void rl_alloc_disarm(void) { atomic_store(&rl_am.armed, 0); }
long rl_alloc_count(void) { return atomic_load(&rl_am.count); }
long rl_alloc_fired(void) { return atomic_load(&rl_am.fired); }

/* true: this allocation fails. */
static bool rl_alloc_should_fail(void)
{
    if (!atomic_load(&rl_am.armed))
        return false;
    if (rl_am.only_thread && !pthread_equal(rl_am.only_thread, pthread_self()))
        return false;
    long c = atomic_fetch_add(&rl_am.count, 1) + 1;
    if (rl_am.fail_at > 0 && (c == rl_am.fail_at || (rl_am.persistent && c > rl_am.fail_at))) {
        atomic_fetch_add(&rl_am.fired, 1);
        return true;
    }
    return false;
}

void *__wrap_malloc(size_t n)
{
    if (rl_alloc_should_fail())
        return NULL;
    void *p = __real_malloc(n);
    rl_track_add(p, n);
    return p;
}

void *__wrap_calloc(size_t n, size_t size)
{
    if (rl_alloc_should_fail())
        return NULL;
    void *p = __real_calloc(n, size);
    rl_track_add(p, n * size);
    return p;
}

void *__wrap_realloc(void *p, size_t n)
{
    if (rl_alloc_should_fail())
        return NULL; /* p stays valid */
    void *q = __real_realloc(p, n);
    if (q || n == 0) {
        rl_track_del(p);
        rl_track_add(q, n);
    }
    return q;
}

void __wrap_free(void *p)
{
    rl_track_del(p);
    __real_free(p);
}

int __wrap_posix_memalign(void **p, size_t align, size_t n)
{
    if (rl_alloc_should_fail())
        return ENOMEM;
    int rc = __real_posix_memalign(p, align, n);
    if (rc == 0)
        rl_track_add(*p, n);
    return rc;
}

char *__wrap_strdup(const char *s)
{
    size_t n = strlen(s) + 1;
    char *p = __wrap_malloc(n);
    if (p)
        memcpy(p, s, n);
    return p;
}

/* ================================================================== */
/* Short reads and writes                                             */
/* ================================================================== */

rl_shortio_state rl_sio;

void rl_shortio_arm(int op, long nth, bool persistent)
{
    atomic_store(&rl_sio.armed, 0);
    rl_sio.op = op;
    rl_sio.nth = nth;
    rl_sio.persistent = persistent;
    atomic_store(&rl_sio.count, 0);
    atomic_store(&rl_sio.fired, 0);
    atomic_store(&rl_sio.armed, 1);
}
void rl_shortio_disarm(void) { atomic_store(&rl_sio.armed, 0); }

/* How many of n bytes this call may move. */
static size_t rl_sio_cut(int op, size_t n)
{
    if (!atomic_load(&rl_sio.armed) || op != rl_sio.op || n < 2)
        return n;
    long c = atomic_fetch_add(&rl_sio.count, 1) + 1;
    if (rl_sio.nth > 0 && (c == rl_sio.nth || (rl_sio.persistent && c > rl_sio.nth))) {
        /* A partial transfer: about half. Page-multiple requests (slot I/O,
         * possibly O_DIRECT) stay page multiples, as a real short transfer
         * on such a file would; a single page cannot be cut. */
        size_t cut = n % 4096 == 0 ? (n / 2) & ~(size_t)4095 : n / 2;
        if (cut == 0 || cut >= n)
            return n;
        atomic_fetch_add(&rl_sio.fired, 1);
        return cut;
    }
    return n;
}

ssize_t __wrap_read(int fd, void *buf, size_t n) { return __real_read(fd, buf, rl_sio_cut(RL_SIO_READ, n)); }
ssize_t __wrap_write(int fd, const void *buf, size_t n) { return __real_write(fd, buf, rl_sio_cut(RL_SIO_WRITE, n)); }
ssize_t __wrap_pread(int fd, void *buf, size_t n, off_t off)
{
    return __real_pread(fd, buf, rl_sio_cut(RL_SIO_READ, n), off);
}
ssize_t __wrap_pwrite(int fd, const void *buf, size_t n, off_t off)
{
    return __real_pwrite(fd, buf, rl_sio_cut(RL_SIO_WRITE, n), off);
}
int __wrap_io_uring_queue_init(unsigned entries, struct io_uring *ring, unsigned flags)
{
    if (atomic_load(&rl_sio.no_uring))
        return -ENOSYS;
    return __real_io_uring_queue_init(entries, ring, flags);
}
