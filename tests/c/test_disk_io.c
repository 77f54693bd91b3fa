/* Slab files and block I/O (core/disk_io.c), on a kvhi_disk opened by
 * hand, without an engine. The program is linked with
 * -Wl,--wrap=pread,--wrap=pwrite,--wrap=io_uring_queue_init and the
 * submission and wait calls of liburing (tests/c/CMakeLists.txt): the
 * wrappers below can refuse io_uring, so that both kinds of lane are
 * tested on any machine that has it, cut reads and writes short, and
 * make the ring refuse submissions and interrupt waits.
 *
 *   - geometry: slot size (header + data padded to 4096), slab file size
 *     (preallocated), slot offsets, lane size from the staging limit and
 *     the queue depth, what a reopen finds;
 *   - lanes: at most max_lanes, reused after a put, a get waits for a
 *     put when all are busy; staging slots aligned and a slot apart;
 *     io_uring lanes are vectored, pread lanes are not (with a warning);
 *   - staged writes and reads round-trip whole slots, in any order, on
 *     both lane kinds, O_DIRECT and buffered, at the slots' file offsets;
 *     io_uring lanes hand every run to the early-arrival callback once,
 *     pread lanes none;
 *   - neighbouring slots are merged into runs of at most 1 MiB (one fault
 *     hook call, one request each); a failed run fails exactly its
 *     blocks and leaves the others written;
 *   - short transfers are resumed until the run is complete;
 *   - a truncated slab: what lies past the end reads as -ENODATA on every
 *     path, whole runs failing together, what lies before it intact;
 *   - the vectored paths: gather writes and scatter reads straight from
 *     and into the caller's memory, a single block read in pieces with
 *     its checksum; 1 (use the staged path) for unaligned memory, too
 *     many slots, or a lane without io_uring;
 *   - a fatal store writes nothing; a failed fsync makes it fatal, an
 *     interrupted one (EINTR) is made again and is no failure;
 *   - a ring that takes no request on every other submission and has
 *     every other wait interrupted by a signal: every io_uring path
 *     resubmits and resumes, and moves every byte;
 *   - a ring that sits on requests without starting them: every path
 *     cancels them after the stall time, moves the bytes with pread or
 *     pwrite, and leaves the ring; a ring that took requests and then
 *     refuses every call: the failed batch leaves none in flight.
 * test_disk_roundtrip.c checks O_DIRECT through an engine; test_rel_faults.c
 * short transfers through a whole scenario. */
#include <liburing.h>
#include <stdatomic.h>
#include <sys/ioctl.h>

#include "disk_test_util.h"

#include "core/crc32c.h"
#include "core/disk_format.h"
#include "core/disk_io.h"

/* ---- the wrappers ---- */

struct io_uring;
int __real_io_uring_queue_init(unsigned entries, struct io_uring *ring, unsigned flags);
ssize_t __real_pread(int fd, void *buf, size_t n, off_t off);
ssize_t __real_pwrite(int fd, const void *buf, size_t n, off_t off);
int __wrap_io_uring_queue_init(unsigned entries, struct io_uring *ring, unsigned flags);
ssize_t __wrap_pread(int fd, void *buf, size_t n, off_t off);
ssize_t __wrap_pwrite(int fd, const void *buf, size_t n, off_t off);

static atomic_int no_ring, short_io, cut_calls;

int __wrap_io_uring_queue_init(unsigned entries, struct io_uring *ring, unsigned flags)
{
    return atomic_load(&no_ring) ? -ENOSYS : __real_io_uring_queue_init(entries, ring, flags);
}

/* About half of a transfer, in whole pages (as O_DIRECT needs). */
static size_t cut(size_t n)
{
    if (!atomic_load(&short_io) || n < 2 * 4096)
        return n;
    atomic_fetch_add(&cut_calls, 1);
    return (n / 2) & ~(size_t)4095;
}

ssize_t __wrap_pread(int fd, void *buf, size_t n, off_t off) { return __real_pread(fd, buf, cut(n), off); }
ssize_t __wrap_pwrite(int fd, const void *buf, size_t n, off_t off) { return __real_pwrite(fd, buf, cut(n), off); }

/* Syncs a signal interrupts: while sync_interrupts is set, every other
 * fsync or fdatasync returns EINTR without syncing. */
int __real_fdatasync(int fd);
int __real_fsync(int fd);
int __wrap_fdatasync(int fd);
int __wrap_fsync(int fd);

static atomic_int sync_interrupts, syncs_interrupted;
static atomic_uint sync_calls;

static bool sync_interrupted_now(void)
{
    if (!atomic_load(&sync_interrupts) || (atomic_fetch_add(&sync_calls, 1) & 1))
        return false;
    atomic_fetch_add(&syncs_interrupted, 1);
    errno = EINTR;
    return true;
}

int __wrap_fdatasync(int fd) { return sync_interrupted_now() ? -1 : __real_fdatasync(fd); }
int __wrap_fsync(int fd) { return sync_interrupted_now() ? -1 : __real_fsync(fd); }

/* A ring under pressure: while ring_faults is 1, every other call of
 * each kind fails without doing anything, as the kernel answers when it
 * has no memory for requests (-EAGAIN: nothing submitted, the requests
 * stay queued) or a signal arrives (-EINTR); while it is 2, every
 * submission is refused (-EAGAIN), for good; while it is 3,
 * io_uring_submit takes what is queued and every wait is refused. */
int __real_io_uring_submit(struct io_uring *ring);
int __real_io_uring_submit_and_wait(struct io_uring *ring, unsigned wait_nr);
int __real___io_uring_get_cqe(struct io_uring *ring, struct io_uring_cqe **cqe, unsigned submit, unsigned wait_nr,
                              sigset_t *sigmask);
int __wrap_io_uring_submit(struct io_uring *ring);
int __wrap_io_uring_submit_and_wait(struct io_uring *ring, unsigned wait_nr);
int __wrap___io_uring_get_cqe(struct io_uring *ring, struct io_uring_cqe **cqe, unsigned submit, unsigned wait_nr,
                              sigset_t *sigmask);
int __real_io_uring_submit_and_wait_timeout(struct io_uring *ring, struct io_uring_cqe **cqe, unsigned wait_nr,
                                            struct __kernel_timespec *ts, sigset_t *sigmask);
int __wrap_io_uring_submit_and_wait_timeout(struct io_uring *ring, struct io_uring_cqe **cqe, unsigned wait_nr,
                                            struct __kernel_timespec *ts, sigset_t *sigmask);

static atomic_int ring_faults, refused_submits, interrupted_waits;
static atomic_uint ring_calls;

static bool ring_fails_now(void)
{
    int mode = atomic_load(&ring_faults);
    return mode == 2 || (mode == 1 && (atomic_fetch_add(&ring_calls, 1) & 1) == 0);
}

/* A slow device: while slow_wait_ns is set, io_uring_submit takes
 * nothing (as it may), and the next wait submits, lets every request
 * complete, then sleeps that long and returns as if nothing had come. */
static _Atomic uint64_t slow_wait_ns;

int __wrap_io_uring_submit(struct io_uring *ring)
{
    if (atomic_load(&slow_wait_ns))
        return 0;
    if (!ring_fails_now())
        return __real_io_uring_submit(ring);
    atomic_fetch_add(&refused_submits, 1);
    return -EAGAIN;
}

int __wrap_io_uring_submit_and_wait(struct io_uring *ring, unsigned wait_nr)
{
    if (!ring_fails_now())
        return __real_io_uring_submit_and_wait(ring, wait_nr);
    if (atomic_load(&ring_faults) == 2) {
        atomic_fetch_add(&refused_submits, 1);
        return -EAGAIN;
    }
    atomic_fetch_add(&interrupted_waits, 1);
    return -EINTR;
}

/* A ring that sits on requests: while stall.armed, the slab file's
 * descriptor is a pipe that never takes or gives a byte, so requests on
 * it wait unstarted. The first wait that ends without a completion puts
 * the file back (the requests keep the pipe): what the lane does again
 * itself reaches the file. */
static struct {
    atomic_int armed, restored;
    int target, saved;
} stall;

int __wrap_io_uring_submit_and_wait_timeout(struct io_uring *ring, struct io_uring_cqe **cqe, unsigned wait_nr,
                                            struct __kernel_timespec *ts, sigset_t *sigmask)
{
    uint64_t slow = atomic_exchange(&slow_wait_ns, 0);
    if (slow) {
        /* Every request submitted here completes before the slow wait
         * ends (however loaded the machine): none is left for the lane's
         * cancel to find. */
        unsigned want = io_uring_cq_ready(ring);
        int rc = __real_io_uring_submit(ring);
        want += rc > 0 ? (unsigned)rc : 0;
        struct timespec poll = {0, 1000000};
        for (int i = 0; i < 30000 && io_uring_cq_ready(ring) < want; i++)
            nanosleep(&poll, NULL);
        struct timespec t = {(time_t)(slow / 1000000000ull), (long)(slow % 1000000000ull)};
        nanosleep(&t, NULL);
        *cqe = NULL;
        return rc < 0 ? rc : -ETIME;
    }
    if (atomic_load(&ring_faults) == 3) { /* io_uring_submit takes, every wait is refused */
        atomic_fetch_add(&refused_submits, 1);
        return -EAGAIN;
    }
    if (ring_fails_now()) {
        if (atomic_load(&ring_faults) == 2) {
            atomic_fetch_add(&refused_submits, 1);
            return -EAGAIN;
        }
        atomic_fetch_add(&interrupted_waits, 1);
        return -EINTR;
    }
    *cqe = NULL;
    int rc = __real_io_uring_submit_and_wait_timeout(ring, cqe, wait_nr, ts, sigmask);
    if (!*cqe && atomic_exchange(&stall.armed, 0)) {
        assert_true(dup2(stall.saved, stall.target) == stall.target);
        atomic_fetch_add(&stall.restored, 1);
    }
    return rc;
}

int __wrap___io_uring_get_cqe(struct io_uring *ring, struct io_uring_cqe **cqe, unsigned submit, unsigned wait_nr,
                              sigset_t *sigmask)
{
    if (wait_nr == 0 || !ring_fails_now())
        return __real___io_uring_get_cqe(ring, cqe, submit, wait_nr, sigmask);
    atomic_fetch_add(&interrupted_waits, 1);
    return -EINTR;
}

/* ---- the fault hook: counts calls, may fail the nth of one kind ---- */

static struct {
    atomic_int count[KVHI_OP_COUNT];
    atomic_int fail_op, fail_nth, fail_err;
} H;

static int hook(enum kvhi_disk_op op, void *user)
{
    (void)user;
    int c = atomic_fetch_add(&H.count[op], 1) + 1;
    return (int)op == atomic_load(&H.fail_op) && c == atomic_load(&H.fail_nth) ? atomic_load(&H.fail_err) : 0;
}

static void hook_on(int fail_op, int nth, int err)
{
    for (int i = 0; i < KVHI_OP_COUNT; i++)
        atomic_store(&H.count[i], 0);
    atomic_store(&H.fail_op, fail_op);
    atomic_store(&H.fail_nth, nth);
    atomic_store(&H.fail_err, err);
    kvhi_disk_set_fault_hook(hook, NULL);
}

static int calls(enum kvhi_disk_op op) { return atomic_load(&H.count[op]); }

/* ---- disks opened by hand ---- */

static kvhi_disk *open_disks[8];
static int io_uring_works = -1; /* on this machine; -1: not known yet */

static kvhi_disk *disk_open(const char *dir, uint64_t block_bytes, uint32_t n_slots, uint32_t qd, uint32_t lanes,
                            bool direct)
{
    kvhi_disk *d = calloc(1, sizeof(*d));
    assert_non_null(d);
    d->path = strdup(dir);
    d->dir_fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    assert_true(d->dir_fd >= 0);
    d->lock_fd = d->journal_fd = -1;
    d->block_bytes = block_bytes;
    d->n_slots = n_slots;
    d->queue_depth = qd;
    d->max_lanes = lanes;
    int rc = kvhi_disk_open_slabs(d, direct);
    if (rc != 0)
        fail_msg("kvhi_disk_open_slabs(%s): %s", dir, strerror(-rc));
    rc = kvhi_disk_size_slabs(d); /* as the tier does once the index is its own */
    if (rc != 0)
        fail_msg("kvhi_disk_size_slabs(%s): %s", dir, strerror(-rc));
    for (int i = 0; i < 8; i++)
        if (!open_disks[i]) {
            open_disks[i] = d;
            break;
        }
    return d;
}

static void disk_close(kvhi_disk *d)
{
    for (int i = 0; i < 8; i++)
        if (open_disks[i] == d)
            open_disks[i] = NULL;
    kvhi_disk_close(d);
    close(d->dir_fd);
    free(d->path);
    free(d);
}

static int teardown(void **state)
{
    (void)state;
    kvhi_disk_set_fault_hook(NULL, NULL);
    atomic_store(&no_ring, 0);
    atomic_store(&short_io, 0);
    atomic_store(&ring_faults, 0);
    atomic_store(&sync_interrupts, 0);
    atomic_store(&stall.armed, 0);
    atomic_store(&slow_wait_ns, 0);
    kvhi_disk_set_stall_ns(0);
    for (int i = 0; i < 8; i++)
        if (open_disks[i])
            disk_close(open_disks[i]);
    return 0;
}

/* Whether io_uring lanes can be had here (else only pread lanes are
 * tested). */
static bool have_io_uring(void)
{
    if (io_uring_works < 0) {
        char dir[PATH_MAX];
        dt_scratch("probe", dir, sizeof(dir));
        kvhi_disk *d = disk_open(dir, 4096, 1, 4, 1, false);
        kvhi_disk_lane *l = kvhi_disk_lane_get(d);
        assert_non_null(l);
        io_uring_works = kvhi_disk_lane_vectored(l);
        kvhi_disk_lane_put(d, l);
        disk_close(d);
        if (!io_uring_works)
            print_message("io_uring is not available here: only pread/pwrite lanes are tested\n");
    }
    return io_uring_works;
}

/* Byte j of slot `slot`'s contents in round `round`. */
static uint8_t pat(uint32_t slot, uint64_t j, int round)
{
    return (uint8_t)(dt_mix(((uint64_t)slot << 40) ^ ((uint64_t)round << 32) ^ (j / 8)) >> (8 * (j % 8)));
}

static void fill(uint8_t *p, uint64_t n, uint32_t slot, int round)
{
    for (uint64_t j = 0; j < n; j++)
        p[j] = pat(slot, j, round);
}

/* Index of the first byte of p that is not slot's contents, or -1. */
static int64_t differs(const uint8_t *p, uint64_t n, uint32_t slot, int round)
{
    for (uint64_t j = 0; j < n; j++)
        if (p[j] != pat(slot, j, round))
            return (int64_t)j;
    return -1;
}

static uint8_t *aligned(size_t n)
{
    void *p = NULL;
    assert_int_equal(posix_memalign(&p, 4096, n), 0);
    memset(p, 0, n);
    return p;
}

/* Stages whole-slot contents for slots[0, n) in lane l and writes them. */
static void write_round(kvhi_disk *d, kvhi_disk_lane *l, uint32_t n, const uint32_t *slots, int round, int *res)
{
    for (uint32_t i = 0; i < n; i++)
        fill(kvhi_disk_lane_slot(l, i), d->slot_bytes, slots[i], round);
    kvhi_disk_write_staged(d, l, n, slots, res);
}

/* The early-arrival callback: how often each batch index arrived. */
typedef struct arrivals {
    int seen[64];
    const int *res;
    int bad; /* arrived with a non-zero result */
} arrivals;

static void on_run(void *ctx, uint32_t first, uint32_t count)
{
    arrivals *a = ctx;
    for (uint32_t i = first; i < first + count; i++) {
        a->seen[i]++;
        a->bad += a->res[i] != 0;
    }
}

/* ---- geometry ---- */

static void test_geometry(void **state)
{
    (void)state;
    static const struct {
        uint64_t block;
        uint32_t slots, qd;
        uint64_t slot_bytes;
        uint32_t lane_blocks;
    } cases[] = {
        {3 * 4096 + 100, 8, 32, 4096 + 4 * 4096, 32},                           /* padded; the queue depth limits */
        {4096, 8, 4, 8192, 4},                                                  /* a small queue */
        {3u << 20, 2, 32, 4096 + (3u << 20), (8u << 20) / (4096 + (3u << 20))}, /* staging limits: 2 */
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char dir[PATH_MAX], p[PATH_MAX + 16];
        dt_scratch("geometry", dir, sizeof(dir));
        kvhi_disk *d = disk_open(dir, cases[i].block, cases[i].slots, cases[i].qd, 2, false);
        assert_int_equal(d->slot_bytes, cases[i].slot_bytes);
        assert_int_equal(d->n_slabs, 1);
        assert_int_equal(d->slots_per_slab, cases[i].slots);
        assert_int_equal(d->lane_blocks, cases[i].lane_blocks);
        assert_int_equal(d->slab_bytes_found, 0); /* a new store */
        for (uint32_t s = 0; s < cases[i].slots; s++)
            assert_int_equal(kvhi_disk_slot_offset(d, s), (uint64_t)s * cases[i].slot_bytes);
        struct stat st;
        assert_int_equal(stat(dt_path(p, sizeof(p), dir, "slab-0000.kvh"), &st), 0);
        assert_int_equal((uint64_t)st.st_size, (uint64_t)cases[i].slots * cases[i].slot_bytes);
        disk_close(d);
        d = disk_open(dir, cases[i].block, cases[i].slots, cases[i].qd, 2, false);
        assert_int_equal(d->slab_bytes_found, (uint64_t)cases[i].slots * cases[i].slot_bytes);
        disk_close(d);
    }
}

/* ---- lanes ---- */

typedef struct waiter {
    kvhi_disk *d;
    kvhi_disk_lane *got;
    atomic_int done;
} waiter;

static void *get_lane(void *arg)
{
    waiter *w = arg;
    w->got = kvhi_disk_lane_get(w->d);
    atomic_store(&w->done, 1);
    return NULL;
}

static void test_lanes(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("lanes", dir, sizeof(dir));
    bool ring = have_io_uring();
    kvhi_disk *d = disk_open(dir, 8192 + 512, 8, 8, 3, false);
    kvhi_disk_lane *l[3];
    for (int i = 0; i < 3; i++) {
        l[i] = kvhi_disk_lane_get(d);
        assert_non_null(l[i]);
        for (int j = 0; j < i; j++)
            assert_true(l[i] != l[j]);
        assert_int_equal(kvhi_disk_lane_vectored(l[i]), ring);
        for (uint32_t k = 0; k < d->lane_blocks; k++) {
            assert_int_equal((uintptr_t)kvhi_disk_lane_slot(l[i], k) % 4096, 0);
            assert_int_equal(kvhi_disk_lane_slot(l[i], k) - kvhi_disk_lane_slot(l[i], 0), k * d->slot_bytes);
        }
    }
    assert_int_equal(d->n_lanes, 3);
    kvhi_disk_lane_put(d, l[1]);
    assert_true(kvhi_disk_lane_get(d) == l[1]); /* reused, not a fourth */
    assert_int_equal(d->n_lanes, 3);
    /* All busy: a get waits for a put. */
    waiter w = {.d = d};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, get_lane, &w), 0);
    dt_sleep_ms(50);
    assert_int_equal(atomic_load(&w.done), 0);
    kvhi_disk_lane_put(d, l[2]);
    pthread_join(th, NULL);
    assert_int_equal(atomic_load(&w.done), 1);
    assert_true(w.got == l[2]);
    assert_int_equal(d->n_lanes, 3);
    for (int i = 0; i < 3; i++)
        kvhi_disk_lane_put(d, l[i]);
    assert_int_equal(d->warning[0], '\0');
    disk_close(d);

    /* Without io_uring: pread/pwrite lanes, and a warning says so. */
    atomic_store(&no_ring, 1);
    d = disk_open(dir, 8192 + 512, 8, 8, 3, false);
    kvhi_disk_lane *p = kvhi_disk_lane_get(d);
    assert_non_null(p);
    assert_false(kvhi_disk_lane_vectored(p));
    char why[256];
    assert_non_null(kvhi_disk_ring_probe(d, why, sizeof(why)));
    assert_non_null(strstr(why, "io_uring unavailable"));
    kvhi_disk_lane_put(d, p);
    disk_close(d);
    atomic_store(&no_ring, 0);
}

/* ---- staged round trips ---- */

static void test_staged_round_trip(void **state)
{
    (void)state;
    for (int ring = have_io_uring(); ring >= 0; ring--)
        for (int direct = 1; direct >= 0; direct--) {
            char dir[PATH_MAX], p[PATH_MAX + 16];
            dt_scratch("staged", dir, sizeof(dir));
            atomic_store(&no_ring, !ring);
            kvhi_disk *d = disk_open(dir, 8192 + 512, 16, 32, 2, direct);
            if (direct && !d->direct)
                print_message("O_DIRECT refused under %s: %s\n", dir, d->warning);
            assert_int_equal(dt_slab_direct(dir), d->direct ? 1 : 0);
            kvhi_disk_lane *a = kvhi_disk_lane_get(d), *b = kvhi_disk_lane_get(d);
            assert_int_equal(kvhi_disk_lane_vectored(a), ring);
            const uint32_t wslots[5] = {3, 4, 5, 9, 0}, rslots[5] = {9, 0, 3, 4, 5};
            int res[5] = {1, 1, 1, 1, 1};
            write_round(d, a, 5, wslots, 1, res);
            for (int i = 0; i < 5; i++)
                assert_int_equal(res[i], 0);
            for (uint32_t i = 0; i < 5; i++)
                memset(kvhi_disk_lane_slot(b, i), 0, d->slot_bytes);
            arrivals got = {.res = res};
            for (int i = 0; i < 5; i++)
                res[i] = 1;
            kvhi_disk_read_staged(d, b, 5, rslots, res, on_run, &got);
            for (uint32_t i = 0; i < 5; i++) {
                assert_int_equal(res[i], 0);
                int64_t at = differs(kvhi_disk_lane_slot(b, i), d->slot_bytes, rslots[i], 1);
                if (at >= 0)
                    fail_msg("ring %d direct %d: slot %u differs at byte %" PRId64, ring, direct, rslots[i], at);
                assert_int_equal(got.seen[i], ring ? 1 : 0);
            }
            assert_int_equal(got.bad, 0);
            kvhi_disk_lane_put(d, a);
            kvhi_disk_lane_put(d, b);
            disk_close(d);
            /* The file itself: each slot at slot * slot_bytes. */
            size_t len = 0;
            uint8_t *f = dt_read_file(dt_path(p, sizeof(p), dir, "slab-0000.kvh"), &len);
            assert_non_null(f);
            assert_int_equal(len, 16 * 16384);
            for (int i = 0; i < 5; i++)
                assert_int_equal(differs(f + (size_t)wslots[i] * 16384, 16384, wslots[i], 1), -1);
            free(f);
        }
    atomic_store(&no_ring, 0);
}

/* ---- runs ---- */

static void test_runs(void **state)
{
    (void)state;
    /* 256 KiB blocks: a slot is 260 KiB, so 3 fit in a run of 1 MiB. */
    for (int ring = have_io_uring(); ring >= 0; ring--) {
        char dir[PATH_MAX];
        dt_scratch("runs", dir, sizeof(dir));
        atomic_store(&no_ring, !ring);
        kvhi_disk *d = disk_open(dir, 256 << 10, 12, 32, 2, true);
        assert_int_equal(d->slot_bytes, (256 << 10) + 4096);
        kvhi_disk_lane *l = kvhi_disk_lane_get(d);
        static const struct {
            uint32_t n, slots[6];
            int runs;
        } batches[] = {
            {4, {0, 1, 2, 3}, 2}, {3, {0, 2, 4}, 3}, {6, {5, 6, 7, 8, 9, 10}, 2}, {1, {11}, 1}, {3, {2, 1, 0}, 3}};
        int res[6];
        for (size_t i = 0; i < sizeof(batches) / sizeof(batches[0]); i++) {
            hook_on(-1, 0, 0);
            write_round(d, l, batches[i].n, batches[i].slots, 2, res);
            assert_int_equal(calls(KVHI_OP_WRITE), batches[i].runs);
            kvhi_disk_read_staged(d, l, batches[i].n, batches[i].slots, res, NULL, NULL);
            assert_int_equal(calls(KVHI_OP_READ), batches[i].runs);
            for (uint32_t k = 0; k < batches[i].n; k++) {
                assert_int_equal(res[k], 0);
                assert_int_equal(differs(kvhi_disk_lane_slot(l, k), d->slot_bytes, batches[i].slots[k], 2), -1);
            }
        }
        /* The second run fails: its blocks, and only they, report it. */
        const uint32_t two[5] = {0, 1, 2, 7, 8};
        hook_on(KVHI_OP_WRITE, 2, -EIO);
        write_round(d, l, 5, two, 3, res);
        assert_int_equal(calls(KVHI_OP_WRITE), 2);
        for (int k = 0; k < 5; k++)
            assert_int_equal(res[k], k < 3 ? 0 : -EIO);
        hook_on(-1, 0, 0);
        kvhi_disk_read_staged(d, l, 5, two, res, NULL, NULL);
        for (uint32_t k = 0; k < 5; k++) {
            assert_int_equal(res[k], 0);
            /* run 1 has round 3's contents, run 2 still round 2's */
            assert_int_equal(differs(kvhi_disk_lane_slot(l, k), d->slot_bytes, two[k], k < 3 ? 3 : 2), -1);
        }
        kvhi_disk_lane_put(d, l);
        disk_close(d);
        kvhi_disk_set_fault_hook(NULL, NULL);
    }
    atomic_store(&no_ring, 0);
}

/* ---- short transfers ---- */

static void test_short_transfers(void **state)
{
    (void)state;
    for (int direct = 1; direct >= 0; direct--) {
        char dir[PATH_MAX];
        dt_scratch("short", dir, sizeof(dir));
        atomic_store(&no_ring, 1); /* pread/pwrite, which the wrappers cut */
        kvhi_disk *d = disk_open(dir, 256 << 10, 8, 32, 1, direct);
        kvhi_disk_lane *l = kvhi_disk_lane_get(d);
        const uint32_t slots[4] = {1, 2, 3, 6};
        int res[4];
        atomic_store(&cut_calls, 0);
        atomic_store(&short_io, 1);
        write_round(d, l, 4, slots, 4, res);
        int cuts = atomic_load(&cut_calls);
        for (uint32_t k = 0; k < 4; k++)
            memset(kvhi_disk_lane_slot(l, k), 0, d->slot_bytes);
        kvhi_disk_read_staged(d, l, 4, slots, res, NULL, NULL);
        atomic_store(&short_io, 0);
        assert_true(cuts >= 2);                      /* the writes were cut, */
        assert_true(atomic_load(&cut_calls) > cuts); /* and the reads */
        for (uint32_t k = 0; k < 4; k++) {
            assert_int_equal(res[k], 0);
            assert_int_equal(differs(kvhi_disk_lane_slot(l, k), d->slot_bytes, slots[k], 4), -1);
        }
        kvhi_disk_lane_put(d, l);
        disk_close(d);
    }
    atomic_store(&no_ring, 0);
}

/* ---- a truncated slab ---- */

static void test_truncated_slab(void **state)
{
    (void)state;
    for (int ring = have_io_uring(); ring >= 0; ring--) {
        char dir[PATH_MAX], p[PATH_MAX + 16];
        dt_scratch("truncated", dir, sizeof(dir));
        atomic_store(&no_ring, !ring);
        kvhi_disk *d = disk_open(dir, 8192, 8, 32, 2, false);
        uint64_t sb = d->slot_bytes;
        kvhi_disk_lane *l = kvhi_disk_lane_get(d);
        const uint32_t four[4] = {0, 1, 2, 3};
        int res[4];
        write_round(d, l, 4, four, 5, res);
        for (int k = 0; k < 4; k++)
            assert_int_equal(res[k], 0);
        /* Slot 2 cut in half, slot 3 gone. */
        assert_int_equal(truncate(dt_path(p, sizeof(p), dir, "slab-0000.kvh"), (off_t)(2 * sb + sb / 2)), 0);
        for (uint32_t s = 0; s < 4; s++) {
            kvhi_disk_read_staged(d, l, 1, &s, res, NULL, NULL);
            assert_int_equal(res[0], s < 2 ? 0 : -ENODATA);
            if (s < 2)
                assert_int_equal(differs(kvhi_disk_lane_slot(l, 0), sb, s, 5), -1);
        }
        /* One run over the end: every block of it fails. */
        kvhi_disk_read_staged(d, l, 4, four, res, NULL, NULL);
        for (int k = 0; k < 4; k++)
            assert_int_equal(res[k], -ENODATA);
        if (ring) {
            uint8_t *dst = aligned(d->block_bytes);
            uint8_t *dsts[1] = {dst};
            uint32_t two = 2, crc = 0;
            const uint8_t *hdr = NULL;
            assert_int_equal(kvhi_disk_read_scatter(d, l, 1, &two, dsts, res, NULL, NULL), 0);
            assert_int_equal(res[0], -ENODATA);
            assert_int_equal(kvhi_disk_read_into(d, l, 2, dst, &crc, &hdr), -ENODATA);
            assert_int_equal(kvhi_disk_read_into(d, l, 0, dst, &crc, &hdr), 0);
            assert_int_equal(differs(hdr, 4096, 0, 5), -1);
            /* dst holds the data part of slot 0: bytes [4096, 4096 + block) */
            for (uint64_t j = 0; j < d->block_bytes; j++)
                if (dst[j] != pat(0, 4096 + j, 5))
                    fail_msg("read_into: data byte %" PRIu64 " differs", j);
            assert_int_equal(crc, kvhi_crc32c(0, dst, d->block_bytes));
            free(dst);
        }
        kvhi_disk_lane_put(d, l);
        disk_close(d);
    }
    atomic_store(&no_ring, 0);
}

/* ---- the vectored paths ---- */

static void test_vectored_paths(void **state)
{
    (void)state;
    if (!have_io_uring())
        skip();
    char dir[PATH_MAX];
    /* 64 KiB blocks (one piece a read_into) and 512 KiB ones (eight). */
    static const uint64_t sizes[2] = {64 << 10, 512 << 10};
    for (int z = 0; z < 2; z++) {
        dt_scratch("vectored", dir, sizeof(dir));
        uint64_t bb = sizes[z];
        kvhi_disk *d = disk_open(dir, bb, 6, 32, 2, true);
        kvhi_disk_lane *a = kvhi_disk_lane_get(d), *b = kvhi_disk_lane_get(d);
        const uint32_t slots[3] = {1, 2, 5};
        uint8_t *src[3], *dst[3];
        for (int i = 0; i < 3; i++) {
            src[i] = aligned(bb);
            dst[i] = aligned(bb);
            fill(src[i], bb, slots[i] + 100, 6);
            fill(kvhi_disk_lane_slot(a, (uint32_t)i), 4096, slots[i], 6); /* the header page */
        }
        int res[3] = {1, 1, 1};
        hook_on(-1, 0, 0);
        assert_int_equal(kvhi_disk_write_gather(d, a, 3, slots, src, res), 0);
        /* runs {1, 2} and {5}; with 516 KiB slots only one fits in 1 MiB */
        assert_int_equal(calls(KVHI_OP_WRITE), z == 0 ? 2 : 3);
        for (int i = 0; i < 3; i++)
            assert_int_equal(res[i], 0);
        arrivals got = {.res = res};
        assert_int_equal(kvhi_disk_read_scatter(d, b, 3, slots, dst, res, on_run, &got), 0);
        for (uint32_t i = 0; i < 3; i++) {
            assert_int_equal(res[i], 0);
            assert_int_equal(got.seen[i], 1);
            assert_memory_equal(dst[i], src[i], bb);
            assert_int_equal(differs(kvhi_disk_lane_slot(b, i), 4096, slots[i], 6), -1);
        }
        /* One block into memory, checksummed as it lands. */
        memset(dst[0], 0, bb);
        uint32_t crc = 0;
        const uint8_t *hdr = NULL;
        assert_int_equal(kvhi_disk_read_into(d, b, 5, dst[0], &crc, &hdr), 0);
        assert_true(hdr == kvhi_disk_lane_slot(b, 0));
        assert_int_equal(differs(hdr, 4096, 5, 6), -1);
        assert_memory_equal(dst[0], src[2], bb);
        assert_int_equal(crc, kvhi_crc32c(0, src[2], bb));
        /* Where these paths do not apply: 1, nothing done. */
        hook_on(-1, 0, 0);
        uint8_t *off[1] = {dst[1] + 512};
        crc = 0;
        assert_int_equal(kvhi_disk_read_into(d, b, 5, dst[1] + 512, &crc, &hdr), 1);
        assert_int_equal(kvhi_disk_read_scatter(d, b, 1, slots, off, res, NULL, NULL), 1);
        assert_int_equal(kvhi_disk_write_gather(d, a, 1, slots, off, res), 1);
        uint32_t many[65] = {0};
        uint8_t *many_dst[65];
        for (int i = 0; i < 65; i++)
            many_dst[i] = dst[0];
        int many_res[65];
        assert_int_equal(kvhi_disk_read_scatter(d, b, 65, many, many_dst, many_res, NULL, NULL), 1);
        assert_int_equal(calls(KVHI_OP_READ) + calls(KVHI_OP_WRITE), 0);
        kvhi_disk_lane_put(d, a);
        kvhi_disk_lane_put(d, b);
        disk_close(d);
        for (int i = 0; i < 3; i++) {
            free(src[i]);
            free(dst[i]);
        }
    }
    /* A lane without io_uring takes none of them. */
    dt_scratch("vectored-none", dir, sizeof(dir));
    atomic_store(&no_ring, 1);
    kvhi_disk *d = disk_open(dir, 64 << 10, 2, 32, 1, true);
    kvhi_disk_lane *l = kvhi_disk_lane_get(d);
    uint8_t *buf = aligned(64 << 10), *bufs[1] = {buf};
    uint32_t slot = 0, crc = 0;
    const uint8_t *hdr = NULL;
    int res[1];
    assert_int_equal(kvhi_disk_read_into(d, l, 0, buf, &crc, &hdr), 1);
    assert_int_equal(kvhi_disk_read_scatter(d, l, 1, &slot, bufs, res, NULL, NULL), 1);
    assert_int_equal(kvhi_disk_write_gather(d, l, 1, &slot, bufs, res), 1);
    free(buf);
    kvhi_disk_lane_put(d, l);
    disk_close(d);
    atomic_store(&no_ring, 0);
}

/* A prepared gather: each run's blocks are prepared once, in order, and
 * what the callback staged is what lands on disk. */
typedef struct preparations {
    kvhi_disk_lane *lane;
    const uint32_t *slots;
    uint32_t calls, next;
} preparations;

static void prepare_run(void *ctx, uint32_t first, uint32_t count)
{
    preparations *p = ctx;
    assert_int_equal(first, p->next); /* in order, each block once */
    p->next = first + count;
    p->calls++;
    for (uint32_t i = first; i < first + count; i++)
        fill(kvhi_disk_lane_slot(p->lane, i), 4096, p->slots[i], 7); /* the header page */
}

static void test_prepared_gather(void **state)
{
    (void)state;
    if (!have_io_uring())
        skip();
    char dir[PATH_MAX];
    dt_scratch("prepared", dir, sizeof(dir));
    uint64_t bb = 64 << 10;
    kvhi_disk *d = disk_open(dir, bb, 40, 32, 2, true);
    kvhi_disk_lane *a = kvhi_disk_lane_get(d), *b = kvhi_disk_lane_get(d);
    /* runs of at most 15 neighbouring 68 KiB slots: {0..14} {15..19} {30} */
    uint32_t slots[21];
    uint8_t *src[21], *dst[21];
    for (uint32_t i = 0; i < 21; i++) {
        slots[i] = i < 20 ? i : 30;
        src[i] = aligned(bb);
        dst[i] = aligned(bb);
        fill(src[i], bb, slots[i] + 100, 7);
    }
    int res[21];
    preparations p = {.lane = a, .slots = slots};
    hook_on(-1, 0, 0);
    assert_int_equal(kvhi_disk_write_gather_prepared(d, a, 21, slots, src, res, prepare_run, &p), 0);
    assert_int_equal(p.calls, 3);
    assert_int_equal(p.next, 21);
    assert_int_equal(calls(KVHI_OP_WRITE), 3);
    for (uint32_t i = 0; i < 21; i++)
        assert_int_equal(res[i], 0);
    arrivals got = {.res = res};
    assert_int_equal(kvhi_disk_read_scatter(d, b, 21, slots, dst, res, on_run, &got), 0);
    for (uint32_t i = 0; i < 21; i++) {
        assert_int_equal(res[i], 0);
        assert_memory_equal(dst[i], src[i], bb);
        assert_int_equal(differs(kvhi_disk_lane_slot(b, i), 4096, slots[i], 7), -1);
    }
    /* A failed run is still prepared, and fails alone. */
    p = (preparations){.lane = a, .slots = slots};
    hook_on(KVHI_OP_WRITE, 2, -EIO);
    assert_int_equal(kvhi_disk_write_gather_prepared(d, a, 21, slots, src, res, prepare_run, &p), 0);
    assert_int_equal(p.next, 21);
    assert_int_equal(res[0], 0);
    assert_int_equal(res[15], -EIO);
    assert_int_equal(res[20], 0);
    hook_on(-1, 0, 0);
    for (uint32_t i = 0; i < 21; i++) {
        free(src[i]);
        free(dst[i]);
    }
    kvhi_disk_lane_put(d, a);
    kvhi_disk_lane_put(d, b);
    disk_close(d);
}

/* ---- fatal stores ---- */

/* EINTR from a sync says nothing about the data: the sync is made again
 * and the store stays usable (a failed one, below, is never retried). */
static void test_interrupted_sync(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("interrupted-sync", dir, sizeof(dir));
    kvhi_disk *d = disk_open(dir, 8192, 4, 32, 1, false);
    kvhi_disk_lane *l = kvhi_disk_lane_get(d);
    const uint32_t slots[2] = {0, 3};
    int res[2];
    write_round(d, l, 2, slots, 9, res);
    assert_int_equal(res[0] + res[1], 0);
    atomic_store(&syncs_interrupted, 0);
    atomic_store(&sync_interrupts, 1);
    for (int i = 0; i < 4; i++)
        assert_int_equal(kvhi_disk_sync_slabs(d), 0);
    assert_int_equal(kvhi_disk_sync_fd(d->dir_fd, false), 0);
    atomic_store(&sync_interrupts, 0);
    assert_true(atomic_load(&syncs_interrupted) >= 2);
    assert_false(d->fatal);
    write_round(d, l, 2, slots, 10, res);
    assert_int_equal(res[0] + res[1], 0);
    assert_int_equal(kvhi_disk_sync_slabs(d), 0);
    kvhi_disk_lane_put(d, l);
    disk_close(d);
}

/* A sync made an fdatasync of every slab file, written or not: a
 * persist of one block on a store of 400 GiB made 400 of them (96 ms).
 * Only slabs written since their last sync are synced now. */
static void test_sync_covers_the_slabs_written(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("sync-written", dir, sizeof(dir));
    uint64_t per = kvhi_disk_slab_slots(4096 + 8192);
    kvhi_disk *d = disk_open(dir, 8192, (uint32_t)per + 8, 4, 1, false); /* two slab files */
    assert_int_equal(d->n_slabs, 2);
    kvhi_disk_lane *l = kvhi_disk_lane_get(d);
    int res[1];
    hook_on(-1, 0, 0);
    assert_int_equal(kvhi_disk_sync_slabs(d), 0);
    assert_int_equal(calls(KVHI_OP_FSYNC), 2); /* a new store: both */
    hook_on(-1, 0, 0);
    assert_int_equal(kvhi_disk_sync_slabs(d), 0);
    assert_int_equal(calls(KVHI_OP_FSYNC), 0); /* nothing written since */
    const uint32_t in_second = (uint32_t)per + 3, in_first = 5;
    write_round(d, l, 1, &in_second, 1, res);
    assert_int_equal(res[0], 0);
    hook_on(-1, 0, 0);
    assert_int_equal(kvhi_disk_sync_slabs(d), 0);
    assert_int_equal(calls(KVHI_OP_FSYNC), 1);
    write_round(d, l, 1, &in_first, 2, res);
    write_round(d, l, 1, &in_second, 3, res);
    hook_on(-1, 0, 0);
    assert_int_equal(kvhi_disk_sync_slabs(d), 0);
    assert_int_equal(calls(KVHI_OP_FSYNC), 2);
    /* A failed write may have written part: its slab is synced too. */
    hook_on(KVHI_OP_WRITE, 1, -EIO);
    write_round(d, l, 1, &in_first, 4, res);
    assert_int_equal(res[0], -EIO);
    hook_on(-1, 0, 0);
    assert_int_equal(kvhi_disk_sync_slabs(d), 0);
    assert_int_equal(calls(KVHI_OP_FSYNC), 1);
    kvhi_disk_lane_put(d, l);
    disk_close(d);
}

static void test_fatal_store(void **state)
{
    (void)state;
    for (int ring = have_io_uring(); ring >= 0; ring--) {
        char dir[PATH_MAX];
        dt_scratch("fatal", dir, sizeof(dir));
        atomic_store(&no_ring, !ring);
        kvhi_disk *d = disk_open(dir, 8192, 4, 32, 1, false);
        kvhi_disk_lane *l = kvhi_disk_lane_get(d);
        const uint32_t slots[2] = {0, 1};
        int res[2];
        write_round(d, l, 2, slots, 7, res);
        assert_int_equal(res[0] + res[1], 0);
        assert_int_equal(kvhi_disk_sync_slabs(d), 0);
        /* A failed fsync (of a slab written since): the store is fatal
         * from then on. */
        write_round(d, l, 2, slots, 9, res);
        hook_on(KVHI_OP_FSYNC, 1, -EIO);
        assert_int_equal(kvhi_disk_sync_slabs(d), -EIO);
        assert_true(d->fatal);
        hook_on(-1, 0, 0);
        assert_int_equal(kvhi_disk_sync_slabs(d), -EIO);
        assert_int_equal(calls(KVHI_OP_FSYNC), 0); /* not even tried */
        write_round(d, l, 2, slots, 8, res);
        assert_int_equal(res[0], -EIO);
        assert_int_equal(res[1], -EIO);
        if (ring) {
            uint8_t *buf = aligned(8192), *bufs[2] = {buf, buf};
            res[0] = res[1] = 1;
            assert_int_equal(kvhi_disk_write_gather(d, l, 2, slots, bufs, res), 0);
            assert_int_equal(res[0], -EIO);
            assert_int_equal(res[1], -EIO);
            free(buf);
        }
        assert_int_equal(calls(KVHI_OP_WRITE), 0);
        /* Reads still work, and find what was there before. */
        kvhi_disk_read_staged(d, l, 2, slots, res, NULL, NULL);
        for (uint32_t k = 0; k < 2; k++) {
            assert_int_equal(res[k], 0);
            assert_int_equal(differs(kvhi_disk_lane_slot(l, k), d->slot_bytes, slots[k], 9),
                             -1); /* the last write before the failed sync */
        }
        kvhi_disk_lane_put(d, l);
        disk_close(d);
        kvhi_disk_set_fault_hook(NULL, NULL);
    }
    atomic_store(&no_ring, 0);
}

/* ---- a ring that refuses submissions and has its waits interrupted ---- */

static void on_ring_hang(int sig)
{
    (void)sig;
    static const char msg[] = "test_disk_io: an I/O never completed (a request left unsubmitted, or never started?)\n";
    if (write(2, msg, sizeof(msg) - 1) < 0)
        _exit(2);
    _exit(1);
}

/* The tests of a misbehaving ring: a 60 s alarm turns a hang into a
 * failure, and stall_ns (0: the default) is the lanes' stall time. */
static void ring_watch_begin(uint64_t stall_ns)
{
    signal(SIGALRM, on_ring_hang);
    alarm(60);
    kvhi_disk_set_stall_ns(stall_ns);
}

static void ring_watch_end(void)
{
    kvhi_disk_set_stall_ns(0);
    alarm(0);
    signal(SIGALRM, SIG_DFL);
}

/* Every io_uring path of a lane: staged runs, gather and scatter, one
 * block read in pieces. */
static void ring_paths_round_trip(kvhi_disk *d, int round)
{
    uint64_t bb = d->block_bytes;
    kvhi_disk_lane *a = kvhi_disk_lane_get(d), *b = kvhi_disk_lane_get(d);
    assert_true(kvhi_disk_lane_vectored(a));
    const uint32_t wslots[4] = {5, 0, 1, 2}, rslots[4] = {2, 1, 5, 0};
    int res[4] = {1, 1, 1, 1};
    write_round(d, a, 4, wslots, round, res);
    for (int i = 0; i < 4; i++)
        assert_int_equal(res[i], 0);
    for (int i = 0; i < 4; i++)
        res[i] = 1;
    kvhi_disk_read_staged(d, b, 4, rslots, res, NULL, NULL);
    for (uint32_t i = 0; i < 4; i++) {
        assert_int_equal(res[i], 0);
        assert_int_equal(differs(kvhi_disk_lane_slot(b, i), d->slot_bytes, rslots[i], round), -1);
    }
    const uint32_t slots[3] = {3, 4, 6};
    uint8_t *src[3], *dst[3];
    for (int i = 0; i < 3; i++) {
        src[i] = aligned(bb);
        dst[i] = aligned(bb);
        fill(src[i], bb, slots[i] + 100, round);
        fill(kvhi_disk_lane_slot(a, (uint32_t)i), 4096, slots[i], round);
    }
    assert_int_equal(kvhi_disk_write_gather(d, a, 3, slots, src, res), 0);
    for (int i = 0; i < 3; i++)
        assert_int_equal(res[i], 0);
    assert_int_equal(kvhi_disk_read_scatter(d, b, 3, slots, dst, res, NULL, NULL), 0);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(res[i], 0);
        assert_memory_equal(dst[i], src[i], bb);
    }
    memset(dst[0], 0, bb);
    uint32_t crc = 0;
    const uint8_t *hdr = NULL;
    assert_int_equal(kvhi_disk_read_into(d, b, 6, dst[0], &crc, &hdr), 0);
    assert_memory_equal(dst[0], src[2], bb);
    assert_int_equal(crc, kvhi_crc32c(0, src[2], bb));
    for (int i = 0; i < 3; i++) {
        free(src[i]);
        free(dst[i]);
    }
    kvhi_disk_lane_put(d, a);
    kvhi_disk_lane_put(d, b);
}

static void test_ring_under_pressure(void **state)
{
    (void)state;
    if (!have_io_uring())
        skip();
    ring_watch_begin(0);
    for (int direct = 1; direct >= 0; direct--) {
        char dir[PATH_MAX];
        dt_scratch("pressure", dir, sizeof(dir));
        /* 512 KiB blocks: a read_into goes in eight pieces. */
        kvhi_disk *d = disk_open(dir, 512 << 10, 8, 32, 2, direct);
        atomic_store(&refused_submits, 0);
        atomic_store(&interrupted_waits, 0);
        atomic_store(&ring_faults, 1);
        for (int round = 1; round <= 3; round++)
            ring_paths_round_trip(d, 20 + round);
        atomic_store(&ring_faults, 0);
        print_message("direct %d: %d submissions refused, %d waits interrupted\n", direct,
                      atomic_load(&refused_submits), atomic_load(&interrupted_waits));
        assert_true(atomic_load(&refused_submits) > 0);
        if (d->direct) /* buffered requests tend to complete at submission: nothing to wait for */
            assert_true(atomic_load(&interrupted_waits) > 0);
        disk_close(d);
    }
    ring_watch_end();
}

/* A ring that refuses every submission: the lane gives up on it after
 * about a second and moves that batch and later ones with pwrite and
 * pread (the batch failed); what the ring still held is never submitted,
 * so it cannot land over the later writes. */
static void test_ring_that_never_takes(void **state)
{
    (void)state;
    if (!have_io_uring())
        skip();
    char dir[PATH_MAX], p[PATH_MAX + 16];
    dt_scratch("refused", dir, sizeof(dir));
    kvhi_disk *d = disk_open(dir, 8192, 4, 32, 1, false);
    kvhi_disk_lane *l = kvhi_disk_lane_get(d);
    assert_true(kvhi_disk_lane_vectored(l));
    const uint32_t slots[2] = {1, 2};
    int res[2] = {1, 1};
    atomic_store(&refused_submits, 0);
    atomic_store(&ring_faults, 2);
    write_round(d, l, 2, slots, 31, res);
    atomic_store(&ring_faults, 0);
    assert_int_equal(res[0], 0);
    assert_int_equal(res[1], 0);
    assert_true(atomic_load(&refused_submits) > 1000);
    assert_false(kvhi_disk_lane_vectored(l)); /* it stopped using the ring */
    write_round(d, l, 2, slots, 32, res);
    assert_int_equal(res[0] + res[1], 0);
    kvhi_disk_read_staged(d, l, 2, slots, res, NULL, NULL);
    for (uint32_t k = 0; k < 2; k++) {
        assert_int_equal(res[k], 0);
        assert_int_equal(differs(kvhi_disk_lane_slot(l, k), d->slot_bytes, slots[k], 32), -1);
    }
    uint64_t sb = d->slot_bytes;
    kvhi_disk_lane_put(d, l);
    disk_close(d); /* closes the ring with round 31 still queued in it */
    size_t len = 0;
    uint8_t *f = dt_read_file(dt_path(p, sizeof(p), dir, "slab-0000.kvh"), &len);
    assert_non_null(f);
    for (uint32_t k = 0; k < 2; k++)
        assert_int_equal(differs(f + (size_t)slots[k] * sb, sb, slots[k], 32), -1);
    free(f);
}

/* A ring that takes a batch's reads, which then sit unstarted (on an
 * empty pipe), and refuses every wait after: the lane gives up after a
 * second, but first cancels and waits for what the kernel took, so that
 * nothing of the failed batch lands later in memory the caller reuses;
 * pread then tries the batch again (a pipe cannot be read at an offset). */
static void test_ring_that_gives_up_drains(void **state)
{
    (void)state;
    if (!have_io_uring())
        skip();
    ring_watch_begin(100 * 1000000ull);
    char dir[PATH_MAX];
    dt_scratch("drain", dir, sizeof(dir));
    kvhi_disk *d = disk_open(dir, 8192, 4, 32, 1, false);
    kvhi_disk_lane *l = kvhi_disk_lane_get(d);
    assert_true(kvhi_disk_lane_vectored(l));
    int ends[2];
    assert_int_equal(pipe(ends), 0);
    int slab = d->slab_fds[0], saved = dup(slab);
    assert_true(saved >= 0 && dup2(ends[0], slab) == slab);
    const uint32_t slots[2] = {1, 3}; /* two runs */
    int res[2] = {1, 1};
    atomic_store(&refused_submits, 0);
    atomic_store(&ring_faults, 3);
    kvhi_disk_read_staged(d, l, 2, slots, res, NULL, NULL);
    atomic_store(&ring_faults, 0);
    assert_int_equal(res[0], -ESPIPE);
    assert_int_equal(res[1], -ESPIPE);
    assert_true(atomic_load(&refused_submits) > 1000);
    assert_false(kvhi_disk_lane_vectored(l));
    /* Nothing of the batch still reads from the pipe: bytes put in stay. */
    static const uint8_t page[4096];
    assert_int_equal(write(ends[1], page, sizeof(page)), (ssize_t)sizeof(page));
    struct timespec settle = {0, 50000000};
    nanosleep(&settle, NULL);
    int left = -1;
    assert_int_equal(ioctl(ends[0], FIONREAD, &left), 0);
    assert_int_equal(left, (int)sizeof(page));
    assert_true(dup2(saved, slab) == slab);
    close(saved);
    close(ends[0]);
    close(ends[1]);
    /* The lane goes on with pread and pwrite. */
    write_round(d, l, 2, slots, 51, res);
    assert_int_equal(res[0] | res[1], 0);
    kvhi_disk_read_staged(d, l, 2, slots, res, NULL, NULL);
    for (uint32_t k = 0; k < 2; k++) {
        assert_int_equal(res[k], 0);
        assert_int_equal(differs(kvhi_disk_lane_slot(l, k), d->slot_bytes, slots[k], 51), -1);
    }
    kvhi_disk_lane_put(d, l);
    ring_watch_end();
}

/* A wait that outlasts the stall time on requests already under way (a
 * slow device): the lane's cancel finds nothing to cancel, the requests
 * complete as they are, and the lane keeps its ring. */
static void test_slow_ring_keeps_its_place(void **state)
{
    (void)state;
    if (!have_io_uring())
        skip();
    ring_watch_begin(50 * 1000000ull);
    char dir[PATH_MAX];
    dt_scratch("slow", dir, sizeof(dir));
    kvhi_disk *d = disk_open(dir, 65536, 8, 32, 1, false);
    kvhi_disk_lane *l = kvhi_disk_lane_get(d);
    assert_true(kvhi_disk_lane_vectored(l));
    const uint32_t slots[3] = {4, 5, 1};
    int res[3] = {1, 1, 1};
    for (int read = 0; read < 2; read++) {
        atomic_store(&slow_wait_ns, 80 * 1000000ull);
        if (read)
            kvhi_disk_read_staged(d, l, 3, slots, res, NULL, NULL);
        else
            write_round(d, l, 3, slots, 61, res);
        assert_int_equal(atomic_load(&slow_wait_ns), 0); /* the slow wait came */
        for (uint32_t i = 0; i < 3; i++) {
            assert_int_equal(res[i], 0);
            if (read)
                assert_int_equal(differs(kvhi_disk_lane_slot(l, i), d->slot_bytes, slots[i], 61), -1);
        }
        assert_true(kvhi_disk_lane_vectored(l));
    }
    kvhi_disk_lane_put(d, l);
    ring_watch_end();
}

/* Points the slab file's descriptor at a pipe that neither takes (it is
 * full) nor gives (it is empty, its writer open) a byte; ends[] are kept
 * to close after. */
static void stall_begin(int slab_fd, bool reading, int ends[2])
{
    assert_int_equal(pipe(ends), 0);
    if (!reading) {
        int fl = fcntl(ends[1], F_GETFL);
        assert_int_equal(fcntl(ends[1], F_SETFL, fl | O_NONBLOCK), 0);
        static const uint8_t page[4096];
        while (write(ends[1], page, sizeof(page)) > 0)
            ;
        assert_int_equal(fcntl(ends[1], F_SETFL, fl), 0);
    }
    stall.target = slab_fd;
    stall.saved = dup(slab_fd);
    assert_true(stall.saved >= 0);
    assert_true(dup2(ends[reading ? 0 : 1], slab_fd) == slab_fd);
    atomic_store(&stall.restored, 0);
    atomic_store(&stall.armed, 1);
}

static void stall_end(int ends[2])
{
    assert_int_equal(atomic_load(&stall.armed), 0);
    assert_int_equal(atomic_load(&stall.restored), 1);
    close(stall.saved);
    close(ends[0]);
    close(ends[1]);
}

enum { STALL_STAGED_WRITE, STALL_STAGED_READ, STALL_GATHER, STALL_SCATTER, STALL_READ_INTO, STALL_PATHS };

/* A ring that sits on requests without starting them (the kernel's
 * worker queue stuck, say): after the stall time each path cancels them,
 * moves the bytes itself, returns them correct, and the lane leaves the
 * ring for pread and pwrite. A wait without that would never end. */
static void test_ring_that_sits_on_requests(void **state)
{
    (void)state;
    if (!have_io_uring())
        skip();
    ring_watch_begin(100 * 1000000ull);
    for (int path = 0; path < STALL_PATHS; path++) {
        char dir[PATH_MAX], p[PATH_MAX + 16];
        dt_scratch("stall", dir, sizeof(dir));
        /* 512 KiB blocks: a read_into goes in eight pieces. */
        kvhi_disk *d = disk_open(dir, 512 << 10, 8, 32, 1, false);
        uint64_t bb = d->block_bytes, sb = d->slot_bytes;
        kvhi_disk_lane *l = kvhi_disk_lane_get(d);
        assert_true(kvhi_disk_lane_vectored(l));
        const uint32_t slots[3] = {4, 5, 1};
        int res[3] = {1, 1, 1}, ends[2];
        uint8_t *mem[3];
        for (int i = 0; i < 3; i++) {
            mem[i] = aligned(bb);
            fill(mem[i], bb, slots[i] + 100, 40);
        }
        bool reading = path == STALL_STAGED_READ || path == STALL_SCATTER || path == STALL_READ_INTO;
        if (reading) { /* what the reads must find, written on a ring that works */
            for (int i = 0; i < 3; i++)
                fill(kvhi_disk_lane_slot(l, (uint32_t)i), 4096, slots[i], 40);
            assert_int_equal(kvhi_disk_write_gather(d, l, 3, slots, mem, res), 0);
            assert_int_equal(res[0] | res[1] | res[2], 0);
        }
        double t0 = dt_now();
        stall_begin(d->slab_fds[0], reading, ends);
        arrivals a = {.res = res};
        uint8_t *into[3];
        switch (path) {
        case STALL_STAGED_WRITE:
            write_round(d, l, 3, slots, 41, res);
            break;
        case STALL_STAGED_READ:
            kvhi_disk_read_staged(d, l, 3, slots, res, NULL, NULL);
            for (uint32_t i = 0; i < 3; i++)
                assert_memory_equal(kvhi_disk_lane_slot(l, i) + KVHI_SLOT_HEADER_BYTES, mem[i], bb);
            break;
        case STALL_GATHER:
            for (int i = 0; i < 3; i++) {
                fill(mem[i], bb, slots[i] + 100, 41);
                fill(kvhi_disk_lane_slot(l, (uint32_t)i), 4096, slots[i], 41);
            }
            assert_int_equal(kvhi_disk_write_gather(d, l, 3, slots, mem, res), 0);
            break;
        case STALL_SCATTER:
            for (int i = 0; i < 3; i++)
                into[i] = aligned(bb);
            assert_int_equal(kvhi_disk_read_scatter(d, l, 3, slots, into, res, on_run, &a), 0);
            for (int i = 0; i < 3; i++) {
                assert_memory_equal(into[i], mem[i], bb);
                assert_int_equal(a.seen[i], 1); /* handed over as in, as without a stall */
                free(into[i]);
            }
            break;
        default: {
            uint32_t crc = 0;
            const uint8_t *hdr = NULL;
            into[0] = aligned(bb);
            res[0] = kvhi_disk_read_into(d, l, slots[1], into[0], &crc, &hdr);
            res[1] = res[2] = 0;
            assert_memory_equal(into[0], mem[1], bb);
            assert_int_equal(crc, kvhi_crc32c(0, mem[1], bb));
            free(into[0]);
        }
        }
        unsigned took_ms = (unsigned)((dt_now() - t0) * 1000);
        stall_end(ends);
        for (int i = 0; i < 3; i++)
            assert_int_equal(res[i], 0);
        assert_true(took_ms >= 100);              /* it waited for the stall time, */
        assert_false(kvhi_disk_lane_vectored(l)); /* then left the ring for good */
        if (!reading) {                           /* the file holds what was written */
            size_t len = 0;
            uint8_t *f = dt_read_file(dt_path(p, sizeof(p), dir, "slab-0000.kvh"), &len);
            assert_non_null(f);
            for (int i = 0; i < 3; i++) {
                const uint8_t *at = f + (size_t)slots[i] * sb;
                if (path == STALL_STAGED_WRITE)
                    assert_int_equal(differs(at, sb, slots[i], 41), -1);
                else
                    assert_memory_equal(at + KVHI_SLOT_HEADER_BYTES, mem[i], bb);
            }
            free(f);
        }
        /* The lane goes on without the ring. */
        write_round(d, l, 3, slots, 42, res);
        kvhi_disk_read_staged(d, l, 3, slots, res, NULL, NULL);
        for (uint32_t i = 0; i < 3; i++) {
            assert_int_equal(res[i], 0);
            assert_int_equal(differs(kvhi_disk_lane_slot(l, i), sb, slots[i], 42), -1);
        }
        print_message("path %d: done again without the ring after %u ms\n", path, took_ms);
        for (int i = 0; i < 3; i++)
            free(mem[i]);
        kvhi_disk_lane_put(d, l);
        disk_close(d);
    }
    ring_watch_end();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_geometry, teardown),
        cmocka_unit_test_teardown(test_lanes, teardown),
        cmocka_unit_test_teardown(test_staged_round_trip, teardown),
        cmocka_unit_test_teardown(test_runs, teardown),
        cmocka_unit_test_teardown(test_short_transfers, teardown),
        cmocka_unit_test_teardown(test_truncated_slab, teardown),
        cmocka_unit_test_teardown(test_vectored_paths, teardown),
        cmocka_unit_test_teardown(test_prepared_gather, teardown),
        cmocka_unit_test_teardown(test_interrupted_sync, teardown),
        cmocka_unit_test_teardown(test_sync_covers_the_slabs_written, teardown),
        cmocka_unit_test_teardown(test_fatal_store, teardown),
        cmocka_unit_test_teardown(test_ring_under_pressure, teardown),
        cmocka_unit_test_teardown(test_ring_that_never_takes, teardown),
        cmocka_unit_test_teardown(test_ring_that_sits_on_requests, teardown),
        cmocka_unit_test_teardown(test_ring_that_gives_up_drains, teardown),
        cmocka_unit_test_teardown(test_slow_ring_keeps_its_place, teardown),
    };
    return cmocka_run_group_tests_name("disk_io", tests, NULL, NULL);
}
