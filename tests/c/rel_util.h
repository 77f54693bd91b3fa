/* Helpers of the reliability battery (tests/c/test_rel_*.c), header only.
 * It builds on disk_test_util.h (deterministic content, configs, engine
 * tracking, build / verify / match, scratch directories and files, child
 * processes, the durability oracle: the dt_ helpers) and adds what only
 * the battery needs.
 *
 * Nothing here asserts unless its name ends in _a: the other helpers
 * return a status or a count so that they also run in fork()ed children
 * (which report through their exit code and must never longjmp into
 * cmocka's state).
 *
 *   Sizes: RL_SIZE(ci, stress) is `ci` in the normal build of a test and
 *   `stress` in its _stress.c twin (which defines REL_STRESS 1 and includes
 *   the test's source); dt_env_long(name, def) lets an environment variable
 *   override either.
 *
 *   Fast scratch: rl_fast_scratch gives a directory on a tmpfs, for tests
 *   that sync thousands of times; rl_teardown removes it.
 *
 *   Allocation failures: a test that defines RL_ALLOC_WRAP before including
 *   this header gets __wrap_malloc / calloc / realloc / free /
 *   posix_memalign / strdup (link it with -Wl,--wrap=...; see
 *   tests/c/CMakeLists.txt). rl_alloc_arm(n, persistent, this_thread_only)
 *   fails the n-th allocation (and, persistent, every later one); a chained
 *   hash of live pointers counts what the run leaked, in every build
 *   (LeakSanitizer checks the ASan build as well). The buffers of
 *   dt_extend, dt_verify, dt_match and dt_read_file come from the real
 *   allocator (dt_tmalloc) and never fail.
 *
 *   Short I/O: RL_IO_WRAP adds __wrap_read / write / pread / pwrite (and
 *   io_uring_queue_init, so that the disk tier falls back to pread/pwrite
 *   while short I/O is armed): rl_shortio_arm(op, n, persistent) makes the
 *   n-th call transfer only part of what was asked.
 */
#ifndef KVH_REL_UTIL_H
#define KVH_REL_UTIL_H

#include "disk_test_util.h"

#include <stdatomic.h>

#ifndef REL_STRESS
#define REL_STRESS 0
#endif
#define RL_SIZE(ci, stress) (REL_STRESS ? (stress) : (ci))

/* A status this library documents (KVH_OK or a KVH_STATUS_LIST code). */
static inline bool rl_status_known(kvh_status st) { return st <= 0 && st >= KVH_ERR_INTERNAL; }

/* ---- counters ---- */

/* Counters that must add up at any quiet moment. Returns 0 or writes the
 * first broken rule into msg. live = blocks_allocated - blocks_freed. */
static inline int rl_counters_add_up(kvh_engine *e, bool has_disk, char *msg, size_t len)
{
    kvh_stats s = dt_stats(e);
    uint64_t bb = 0;
    kvh_engine_block_bytes(e, &bb);
    uint64_t used[KVH_TIER_COUNT];
    for (uint32_t t = 0; t < KVH_TIER_COUNT; t++) {
        kvh_tier_info ti = dt_tier(e, t);
        used[t] = ti.used_blocks;
        if (ti.used_bytes != ti.used_blocks * bb || (ti.capacity_blocks && ti.block_bytes != bb) ||
            ti.used_blocks > ti.capacity_blocks || ti.pinned_blocks > ti.used_blocks) {
            snprintf(msg, len, "tier %u: used_bytes %" PRIu64 " != used_blocks %" PRIu64 " x %" PRIu64
                     " (capacity %" PRIu64 ", pinned %" PRIu64 ")",
                     t, ti.used_bytes, ti.used_blocks, bb, ti.capacity_blocks, ti.pinned_blocks);
            return 1;
        }
    }
    if (s.blocks_freed > s.blocks_allocated) {
        snprintf(msg, len, "blocks_freed %" PRIu64 " > blocks_allocated %" PRIu64, s.blocks_freed,
                 s.blocks_allocated);
        return 1;
    }
    uint64_t live = s.blocks_allocated - s.blocks_freed, mem = used[0] + used[1];
    /* Each live block holds one slot in its tier; with a disk tier a block
     * in memory may also keep a clean copy in a disk slot. */
    if (has_disk ? (live < mem || live > mem + used[2] || used[2] > live) : live != mem + used[2]) {
        snprintf(msg, len,
                 "live blocks (allocated %" PRIu64 " - freed %" PRIu64 " = %" PRIu64 ") do not match the slots in "
                 "use (device %" PRIu64 ", host %" PRIu64 ", disk %" PRIu64 ")",
                 s.blocks_allocated, s.blocks_freed, live, used[0], used[1], used[2]);
        return 1;
    }
    struct {
        const char *name;
        uint64_t blocks, bytes;
    } legs[] = {{"device_to_host", s.blocks_device_to_host, s.bytes_device_to_host},
                {"host_to_device", s.blocks_host_to_device, s.bytes_host_to_device},
                {"host_to_disk", s.blocks_host_to_disk, s.bytes_host_to_disk},
                {"disk_to_host", s.blocks_disk_to_host, s.bytes_disk_to_host}};
    for (size_t i = 0; i < sizeof(legs) / sizeof(legs[0]); i++)
        if (legs[i].bytes != legs[i].blocks * bb) {
            snprintf(msg, len, "bytes_%s %" PRIu64 " != blocks_%s %" PRIu64 " x %" PRIu64, legs[i].name,
                     legs[i].bytes, legs[i].name, legs[i].blocks, bb);
            return 1;
        }
    if (s.hits_device + s.hits_host + s.hits_disk != s.lookups) {
        snprintf(msg, len, "hits (%" PRIu64 " + %" PRIu64 " + %" PRIu64 ") != lookups %" PRIu64, s.hits_device,
                 s.hits_host, s.hits_disk, s.lookups);
        return 1;
    }
    if (s.prefix_hit_tokens < s.prefix_hit_blocks) {
        snprintf(msg, len, "prefix_hit_tokens %" PRIu64 " < prefix_hit_blocks %" PRIu64, s.prefix_hit_tokens,
                 s.prefix_hit_blocks);
        return 1;
    }
    return 0;
}

/* ---- fast scratch directories ---- */

/* Like dt_scratch, but on a tmpfs (/dev/shm, or $KVH_REL_FAST_DIR) when
 * there is one: fsync is free there, which matters for tests that sync
 * thousands of times and whose subject is not the device (kills keep the
 * page cache anyway). O_DIRECT is refused there, so the engine runs
 * buffered. Returns false (and gives an ordinary scratch dir) without one.
 * Remove it with dt_rmrf when done. */
static inline bool rl_fast_scratch(const char *name, char *out, size_t len)
{
    const char *root = getenv("KVH_REL_FAST_DIR");
    if (!root || !*root)
        root = "/dev/shm";
    struct stat st;
    char dir[256];
    snprintf(dir, sizeof(dir), "%s/kvh-rel.%ld", root, (long)getpid());
    if (stat(root, &st) != 0 || !S_ISDIR(st.st_mode) || access(root, W_OK) != 0 ||
        (mkdir(dir, 0755) != 0 && errno != EEXIST)) {
        dt_scratch(name, out, len);
        return false;
    }
    snprintf(out, len, "%s/%s", dir, name);
    dt_rmrf(out);
    mkdir(out, 0755);
    return true;
}

/* Removes what rl_fast_scratch made for process pid. */
static inline void rl_fast_cleanup_pid(long pid)
{
    const char *root = getenv("KVH_REL_FAST_DIR");
    char dir[256];
    snprintf(dir, sizeof(dir), "%s/kvh-rel.%ld", root && *root ? root : "/dev/shm", pid);
    dt_rmrf(dir);
}

/* Removes what rl_fast_scratch made for this process. */
static inline void rl_fast_cleanup(void) { rl_fast_cleanup_pid((long)getpid()); }

/* Closes what a failed test left open and removes its tmpfs scratch. */
static int DT_UNUSED rl_teardown(void **state)
{
    dt_teardown(state);
    rl_fast_cleanup();
    return 0;
}

/* ---- memory use ---- */

/* Resident set size of this process, bytes (0 if unknown). */
static inline uint64_t rl_rss_bytes(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    unsigned long long size = 0, res = 0;
    if (f) {
        if (fscanf(f, "%llu %llu", &size, &res) != 2)
            res = 0;
        fclose(f);
    }
    return (uint64_t)res * (uint64_t)sysconf(_SC_PAGESIZE);
}

/* ================================================================== */
/* Allocation failure injection (define RL_ALLOC_WRAP)                 */
/* ================================================================== */
#ifdef RL_ALLOC_WRAP

void *__real_malloc(size_t n);
void *__real_calloc(size_t n, size_t size);
void *__real_realloc(void *p, size_t n);
void __real_free(void *p);
int __real_posix_memalign(void **p, size_t align, size_t n);
char *__real_strdup(const char *s);

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

static inline uint32_t rl_track_hash(const void *p) { return (uint32_t)(dt_mix((uintptr_t)p) & (RL_TRACK_BUCKETS - 1)); }

static inline void rl_track_add(void *p, size_t n)
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

static inline void rl_track_del(void *p)
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

/* Live allocations made through the wrappers (and not freed). */
static inline long rl_alloc_live(void)
{
    pthread_mutex_lock(&rl_tr.mu);
    long n = rl_tr.overflow ? -1 : rl_tr.live;
    pthread_mutex_unlock(&rl_tr.mu);
    return n;
}

static inline uint64_t rl_alloc_live_bytes(void)
{
    pthread_mutex_lock(&rl_tr.mu);
    uint64_t n = rl_tr.live_bytes;
    pthread_mutex_unlock(&rl_tr.mu);
    return n;
}

/* Fails allocation number n (1-based, counted from now) and, persistent,
 * every later one; n = 0 only counts. Only allocations on the calling
 * thread count when this_thread_only. */
static inline void rl_alloc_arm(long n, bool persistent, bool this_thread_only)
{
    atomic_store(&rl_am.armed, 0);
    atomic_store(&rl_am.count, 0);
    atomic_store(&rl_am.fired, 0);
    rl_am.fail_at = n;
    rl_am.persistent = persistent;
    rl_am.only_thread = this_thread_only ? pthread_self() : (pthread_t)0;
    atomic_store(&rl_am.armed, 1);
}

static inline void rl_alloc_disarm(void) { atomic_store(&rl_am.armed, 0); }
static inline long rl_alloc_count(void) { return atomic_load(&rl_am.count); }
static inline long rl_alloc_fired(void) { return atomic_load(&rl_am.fired); }

/* true: this allocation fails. */
static inline bool rl_alloc_should_fail(void)
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

void *__wrap_malloc(size_t n);
void *__wrap_calloc(size_t n, size_t size);
void *__wrap_realloc(void *p, size_t n);
void __wrap_free(void *p);
int __wrap_posix_memalign(void **p, size_t align, size_t n);
char *__wrap_strdup(const char *s);

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

#endif /* RL_ALLOC_WRAP */

/* ================================================================== */
/* Short reads and writes (define RL_IO_WRAP)                          */
/* ================================================================== */
#ifdef RL_IO_WRAP

struct io_uring;
ssize_t __real_read(int fd, void *buf, size_t n);
ssize_t __real_write(int fd, const void *buf, size_t n);
ssize_t __real_pread(int fd, void *buf, size_t n, off_t off);
ssize_t __real_pwrite(int fd, const void *buf, size_t n, off_t off);
int __real_io_uring_queue_init(unsigned entries, struct io_uring *ring, unsigned flags);

enum { RL_SIO_READ = 0, RL_SIO_WRITE = 1 };
static struct {
    atomic_int no_uring; /* io_uring_queue_init fails: lanes use pread/pwrite */
    atomic_int armed;
    int op; /* RL_SIO_READ (read, pread) or RL_SIO_WRITE (write, pwrite) */
    long nth;
    bool persistent;
    atomic_long count, fired;
} rl_sio;

static inline void rl_shortio_arm(int op, long nth, bool persistent)
{
    atomic_store(&rl_sio.armed, 0);
    rl_sio.op = op;
    rl_sio.nth = nth;
    rl_sio.persistent = persistent;
    atomic_store(&rl_sio.count, 0);
    atomic_store(&rl_sio.fired, 0);
    atomic_store(&rl_sio.armed, 1);
}
static inline void rl_shortio_disarm(void) { atomic_store(&rl_sio.armed, 0); }

/* How many of n bytes this call may move. */
static inline size_t rl_sio_cut(int op, size_t n)
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

ssize_t __wrap_read(int fd, void *buf, size_t n);
ssize_t __wrap_write(int fd, const void *buf, size_t n);
ssize_t __wrap_pread(int fd, void *buf, size_t n, off_t off);
ssize_t __wrap_pwrite(int fd, const void *buf, size_t n, off_t off);
int __wrap_io_uring_queue_init(unsigned entries, struct io_uring *ring, unsigned flags);

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

#endif /* RL_IO_WRAP */

#endif
