#include "core/disk_io.h"

#include "core/crc32c.h"
#include "core/disk_access.h"

#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define LANE_ARENA_MAX (8u << 20) /* staging bytes per lane */
#define LANE_REFUSALS_MAX 10000   /* 100 us apart: a second of a ring that takes nothing */

static int vector_io(kvhi_disk *d, kvhi_disk_lane *l, uint32_t n, const uint32_t *slots, uint8_t *const *datas,
                     int *results, kvhi_disk_run_done_fn on_run, void *ctx, bool write);

struct kvhi_disk_lane {
    bool busy;
    uint64_t slot_bytes;
    bool has_ring;  /* its ring takes the lane's I/O */
    bool ring_open; /* its ring exists (to close), even after it failed */
    struct io_uring ring;
    uint8_t *arena;
    uint64_t arena_bytes;
    unsigned sat_on; /* its requests a stall's cancel found unstarted */
};

static kvhi_disk_fault_fn fault_fn;
static void *fault_user;

void kvhi_disk_set_fault_hook(kvhi_disk_fault_fn fn, void *user)
{
    fault_user = user;
    fault_fn = fn;
}

int kvhi_disk_fault(enum kvhi_disk_op op) { return fault_fn ? fault_fn(op, fault_user) : 0; }

/* A request the kernel has held unstarted this long is cancelled and
 * done by the lane itself with pread or pwrite. Requests on their way to
 * a device cannot be cancelled and are waited for however slow. */
#define LANE_STALL_NS_DEFAULT 2000000000ull
/* Tags the lane's cancel requests, whose completions no caller counts. */
#define LANE_CANCEL_TAG UINT64_MAX

static _Atomic uint64_t lane_stall_ns = LANE_STALL_NS_DEFAULT;

void kvhi_disk_set_stall_ns(uint64_t ns) { lane_stall_ns = ns ? ns : LANE_STALL_NS_DEFAULT; }

static uint64_t monotonic_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

/* Asks the kernel to cancel every request of the ring that has not
 * started; each one cancelled completes with -ECANCELED. A ring that sat
 * on a request is not trusted again (see lane_settle); one whose requests
 * were only slow, all under way, keeps its place. */
static void lane_cancel_unstarted(kvhi_disk_lane *l)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(&l->ring);
    if (!sqe)
        return; /* the queue is full: the next wait submits it, then again */
    io_uring_prep_cancel64(sqe, 0, IORING_ASYNC_CANCEL_ANY | IORING_ASYNC_CANCEL_ALL);
    io_uring_sqe_set_data64(sqe, LANE_CANCEL_TAG);
}

/* The ring gave up with `remaining` of the caller's requests not reaped.
 * Those it still queues never reached the kernel: they become tagged
 * no-ops, harmless if ever submitted. Those the kernel took are waited
 * for (cancelled where not started, as in lane_wait_cqe), so that none
 * lands later in memory the caller reuses. Their results are dropped:
 * the batch has failed. */
static void lane_drain(kvhi_disk_lane *l, uint32_t remaining)
{
    struct io_uring_sq *sq = &l->ring.sq;
    for (unsigned at = *sq->khead; at != sq->sqe_tail; at++) {
        struct io_uring_sqe *sqe = &sq->sqes[at & sq->ring_mask];
        if (sqe->user_data != LANE_CANCEL_TAG && remaining)
            remaining--;
        io_uring_prep_nop(sqe);
        io_uring_sqe_set_data64(sqe, LANE_CANCEL_TAG);
    }
    uint64_t stall_ns = lane_stall_ns, since = monotonic_ns();
    while (remaining) {
        struct __kernel_timespec wait = {.tv_sec = (long long)(stall_ns / 1000000000ull),
                                         .tv_nsec = (long long)(stall_ns % 1000000000ull)};
        struct io_uring_cqe *cqe = NULL;
        int rc = io_uring_wait_cqe_timeout(&l->ring, &cqe, &wait);
        if (rc == 0 && cqe) {
            if (io_uring_cqe_get_data64(cqe) != LANE_CANCEL_TAG)
                remaining--;
            io_uring_cqe_seen(&l->ring, cqe);
            since = monotonic_ns();
            continue;
        }
        if (rc == -EBADF || rc == -EFAULT || rc == -EINVAL || rc == -ENXIO || rc == -EOPNOTSUPP)
            return; /* no ring to wait on */
        if (monotonic_ns() - since >= stall_ns) {
            lane_cancel_unstarted(l);
            io_uring_submit(&l->ring); /* may be refused too: tried again next time */
            since = monotonic_ns();
        } else if (rc != -ETIME && rc != -EINTR) {
            struct timespec pause = {0, 100000}; /* refused at once: not a busy loop */
            nanosleep(&pause, NULL);
        }
    }
}

/* The next completion of the lane's ring. io_uring_submit may take fewer
 * requests than were prepared, or none (-EAGAIN, -EBUSY, -EINTR), and a
 * signal can end a wait early (-EINTR): the requests left in the queue are
 * submitted again here, and the wait resumed. Giving up instead would
 * either wait for completions of requests the kernel never saw (a hang)
 * or leave requests in flight on buffers the caller reuses. A negative
 * errno only when the ring itself keeps failing: the lane then stops
 * using it (pread and pwrite from then on), after lane_drain, given the
 * caller's `remaining` requests not yet reaped. A wait
 * with nothing arriving for lane_stall_ns cancels what has not started:
 * those completions carry -ECANCELED, for the caller to redo (io_redo). */
static int lane_wait_cqe(kvhi_disk_lane *l, struct io_uring_cqe **cqe, uint32_t remaining)
{
    uint64_t stall_ns = lane_stall_ns, since = monotonic_ns();
    for (unsigned refused = 0;;) {
        if (io_uring_peek_cqe(&l->ring, cqe) == 0) {
            if (io_uring_cqe_get_data64(*cqe) != LANE_CANCEL_TAG) {
                if ((*cqe)->res == -ECANCELED)
                    l->sat_on++; /* only a stall's cancel ends one so */
                return 0;
            }
            io_uring_cqe_seen(&l->ring, *cqe);
            continue;
        }
        struct __kernel_timespec wait = {.tv_sec = (long long)(stall_ns / 1000000000ull),
                                         .tv_nsec = (long long)(stall_ns % 1000000000ull)};
        struct io_uring_cqe *got = NULL;
        int rc = io_uring_submit_and_wait_timeout(&l->ring, &got, 1, &wait, NULL);
        if (!got && monotonic_ns() - since >= stall_ns) {
            lane_cancel_unstarted(l);
            since = monotonic_ns();
        }
        if (rc >= 0 || rc == -EINTR || rc == -ETIME)
            continue;
        if ((rc != -EAGAIN && rc != -EBUSY) || ++refused > LANE_REFUSALS_MAX) {
            l->has_ring = false;
            lane_drain(l, remaining);
            return rc;
        }
        /* Out of kernel memory for requests, or completions to reap
         * first: let in-flight requests finish. */
        struct timespec pause = {0, 100000};
        nanosleep(&pause, NULL);
    }
}

/* Whether a completion is one to do again without the ring: a request
 * cancelled unstarted, or interrupted, moved nothing. */
static bool io_redo(int res) { return res == -ECANCELED || res == -EINTR; }

/* After a batch, with nothing of it left in flight: a ring that sat on a
 * request is left for pread and pwrite. */
static void lane_settle(kvhi_disk_lane *l)
{
    if (l->sat_on)
        l->has_ring = false;
}

/* The error of a write that ends at byte end and failed with err: a file
 * size limit (RLIMIT_FSIZE) cuts a write short, and its rest then fails
 * with EFBIG, or with EINVAL under O_DIRECT where it resumes unaligned;
 * said as EFBIG, not as a full disk or a bad argument. */
static int write_error(int err, uint64_t end)
{
    struct rlimit rl;
    if ((err == -ENOSPC || err == -EINVAL) && getrlimit(RLIMIT_FSIZE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY &&
        end > (uint64_t)rl.rlim_cur)
        return -EFBIG;
    return err;
}

/* Moves a run's buffers with preadv or pwritev, resuming short
 * transfers; n_iov is at most 3 * 64 (vector_io). */
static int sync_iov(int fd, const struct iovec *iov, uint32_t n_iov, uint64_t off, bool write)
{
    struct iovec left[3 * 64];
    memcpy(left, iov, n_iov * sizeof(*iov));
    struct iovec *v = left;
    while (n_iov) {
        ssize_t n = write ? pwritev(fd, v, (int)n_iov, (off_t)off) : preadv(fd, v, (int)n_iov, (off_t)off);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return -errno;
        if (n == 0)
            return write ? -ENOSPC : -ENODATA;
        off += (uint64_t)n;
        size_t got = (size_t)n;
        for (; n_iov && got >= v->iov_len; v++, n_iov--)
            got -= v->iov_len;
        if (n_iov) { /* what remains of the first buffer not yet whole */
            v->iov_base = (uint8_t *)v->iov_base + got;
            v->iov_len -= got;
        }
    }
    return 0;
}

/* Moves len bytes between buf and fd at off with pread or pwrite. */
static int sync_io(int fd, uint8_t *buf, uint64_t len, uint64_t off, bool write)
{
    for (uint64_t done = 0; done < len;) {
        ssize_t n = write ? pwrite(fd, buf + done, len - done, (off_t)(off + done))
                          : pread(fd, buf + done, len - done, (off_t)(off + done));
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return -errno;
        if (n == 0)
            return write ? -ENOSPC : -ENODATA; /* end of file: truncated slab */
        done += (uint64_t)n;
    }
    return 0;
}

uint64_t kvhi_disk_slot_offset(const kvhi_disk *d, uint32_t slot)
{
    return (uint64_t)(slot % d->slots_per_slab) * d->slot_bytes;
}

static int slab_fd(const kvhi_disk *d, uint32_t slot) { return d->slab_fds[slot / d->slots_per_slab]; }

/* Some filesystems accept O_DIRECT but fail aligned I/O later: a read of
 * the first slab's first page tells (an empty file tells nothing, so this
 * runs again once the slabs are sized). */
static void probe_direct(kvhi_disk *d)
{
    if (!d->direct || d->n_slabs == 0 || d->slab_fds[0] < 0)
        return;
    uint8_t *probe;
    if (posix_memalign((void **)&probe, KVHI_DISK_ALIGN, KVHI_DISK_ALIGN) != 0)
        return;
    ssize_t r = pread(d->slab_fds[0], probe, KVHI_DISK_ALIGN, 0);
    free(probe);
    if (r < 0 && errno == EINVAL) {
        for (uint32_t i = 0; i < d->n_slabs; i++) {
            int fl = fcntl(d->slab_fds[i], F_GETFL);
            fcntl(d->slab_fds[i], F_SETFL, fl & ~O_DIRECT);
        }
        d->direct = false;
        snprintf(d->warning, sizeof(d->warning), "disk tier: O_DIRECT reads fail on %s; using buffered I/O", d->path);
    }
}

/* The name of slab file i in the store's directory. */
static void slab_name(char *buf, size_t len, uint32_t i) { snprintf(buf, len, "slab-%04u.kvh", i); }

/* Opens slab file i, or makes it when create: its descriptor, or -errno
 * (-ENOENT for a missing file not to be made). */
static int open_slab(kvhi_disk *d, uint32_t i, bool create)
{
    char name[64];
    slab_name(name, sizeof(name), i);
    int flags = O_RDWR | (create ? O_CREAT : 0);
    bool tried_direct = d->direct;
    int fd = tried_direct ? kvhi_store_openat(d, name, flags | O_DIRECT) : -ENOENT;
    if (fd == -ELOOP || fd == -EPERM || fd == -EISDIR || (fd == -ENOENT && tried_direct && !create))
        return fd; /* a link, a directory or a file not ours stands in its place, or none is there */
    if (fd < 0 && tried_direct) {
        /* tmpfs and some overlays refuse O_DIRECT: buffered I/O instead. */
        d->direct = false;
        snprintf(d->warning, sizeof(d->warning),
                 "disk tier: the filesystem of %s refuses O_DIRECT (%s); using buffered I/O", d->path, strerror(-fd));
        for (uint32_t k = 0; k < d->n_slabs; k++)
            if (d->slab_fds[k] >= 0)
                fcntl(d->slab_fds[k], F_SETFL, fcntl(d->slab_fds[k], F_GETFL) & ~O_DIRECT);
    }
    if (fd < 0)
        fd = kvhi_store_openat(d, name, flags);
    if (fd < 0)
        return fd;
    if (d->direct) {
        /* A process that used the store buffered may have left its pages
         * cached; an O_DIRECT write that cannot drop them makes the
         * kernel report a write error on the file (EIO at the next
         * fsync). Write them back and drop them before the first. */
        kvhi_disk_sync_fd(fd, true);
        posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    }
    return fd;
}

/* The slab files there are opened; the ones missing are made only once
 * the store is known to be this engine's (kvhi_disk_size_slabs), so an
 * open refused as another store leaves no file behind. */
int kvhi_disk_open_slabs(kvhi_disk *d, bool allow_direct)
{
    d->slot_bytes = KVHI_SLOT_HEADER_BYTES + kvhi_round_up(d->block_bytes, KVHI_DISK_ALIGN);
    uint64_t per = kvhi_disk_slab_slots(d->slot_bytes);
    d->slots_per_slab = (uint32_t)(per > d->n_slots ? d->n_slots : per);
    if (d->slots_per_slab == 0)
        d->slots_per_slab = 1;
    d->n_slabs = (d->n_slots + d->slots_per_slab - 1) / d->slots_per_slab;
    d->slab_fds = calloc(d->n_slabs ? d->n_slabs : 1, sizeof(int));
    if (!d->slab_fds)
        return -ENOMEM;
    for (uint32_t i = 0; i < d->n_slabs; i++)
        d->slab_fds[i] = -1;
    d->slab_sync = calloc(d->n_slabs ? d->n_slabs : 1, sizeof(*d->slab_sync));
    if (!d->slab_sync)
        return -ENOMEM;
    for (uint32_t i = 0; i < d->n_slabs; i++) {
        atomic_init(&d->slab_sync[i].written, 1);
        atomic_init(&d->slab_sync[i].synced, 0);
    }
    d->direct = allow_direct;
    for (uint32_t i = 0; i < d->n_slabs; i++) {
        int fd = open_slab(d, i, false);
        if (fd == -ENOENT)
            continue;
        if (fd < 0) {
            d->failed_slab = i;
            return fd;
        }
        d->slab_fds[i] = fd;
        struct stat st;
        if (fstat(fd, &st) == 0)
            d->slab_bytes_found += (uint64_t)st.st_size;
    }
    /* Slab files past the last are not counted: a stray copy is not the
     * store's, and is left alone. */
    if (d->slab_bytes_found >= ((uint64_t)d->n_slots + 1) * d->slot_bytes) /* whole slots more, not a cut tail */
        d->made_larger = true;
    probe_direct(d);
    uint64_t lb = LANE_ARENA_MAX / d->slot_bytes;
    if (lb < 1)
        lb = 1;
    if (lb > d->queue_depth)
        lb = d->queue_depth;
    d->lane_blocks = (uint32_t)lb;
    pthread_mutex_init(&d->lane_lock, NULL);
    pthread_cond_init(&d->lane_free, NULL);
    d->lanes = calloc(d->max_lanes, sizeof(*d->lanes));
    return d->lanes ? 0 : -ENOMEM;
}

static off_t slab_want(const kvhi_disk *d, uint32_t i)
{
    uint32_t slots = i + 1 < d->n_slabs ? d->slots_per_slab : d->n_slots - i * d->slots_per_slab;
    return (off_t)slots * (off_t)d->slot_bytes;
}

/* Makes slab i sparse again past `was` bytes (what it held before this
 * open) at its full size. */
static int slab_sparse(kvhi_disk *d, uint32_t i, off_t was)
{
    return ftruncate(d->slab_fds[i], was) != 0 || ftruncate(d->slab_fds[i], slab_want(d, i)) != 0 ? -errno : 0;
}

int kvhi_disk_size_slabs(kvhi_disk *d)
{
    for (uint32_t i = 0; i < d->n_slabs; i++) {
        if (d->slab_fds[i] < 0) {
            int fd = open_slab(d, i, true);
            if (fd < 0) {
                d->failed_slab = i;
                return fd;
            }
            d->slab_fds[i] = fd;
        }
    }
    off_t *was = malloc(sizeof(off_t) * d->n_slabs);
    if (!was)
        return -ENOMEM;
    uint64_t need = 0;
    for (uint32_t i = 0; i < d->n_slabs; i++) {
        struct stat st;
        was[i] = fstat(d->slab_fds[i], &st) == 0 ? st.st_size : slab_want(d, i);
        if (was[i] < slab_want(d, i))
            need += (uint64_t)(slab_want(d, i) - was[i]);
    }
    /* Preallocated, a later write does not find the disk full. But slabs
     * that would take the file system's last free bytes (a disk_bytes
     * larger than the disk) leave every other writer on it without room:
     * then they grow on demand instead, and so they do where the file
     * system refuses to preallocate. */
    bool prealloc = need > 0;
    struct statvfs fs;
    if (prealloc && fstatvfs(d->slab_fds[0], &fs) == 0 && fs.f_frsize) {
        uint64_t avail = (uint64_t)fs.f_bavail * fs.f_frsize, size = (uint64_t)fs.f_blocks * fs.f_frsize;
        uint64_t keep = size / 20 < (1ull << 30) ? size / 20 : (1ull << 30);
        if (need > avail || avail - need < keep) {
            prealloc = false;
            snprintf(d->space_warning, sizeof(d->space_warning),
                     "disk tier: %s has %llu MiB free and the store needs %llu MiB more: its slab files are sparse "
                     "and grow as blocks are written (a write that finds the disk full then fails, for want of room)",
                     d->path, (unsigned long long)(avail >> 20), (unsigned long long)(need >> 20));
        }
    }
    int rc = 0;
    for (uint32_t i = 0; i < d->n_slabs && rc == 0; i++) {
        if (was[i] >= slab_want(d, i))
            continue;
        /* fallocate, not posix_fallocate: where the file system cannot
         * preallocate, glibc's stand-in writes every block (or fails on
         * an O_DIRECT descriptor) instead of saying so. */
        if (prealloc && fallocate(d->slab_fds[i], 0, 0, slab_want(d, i)) == 0)
            continue;
        if (prealloc && !d->space_warning[0])
            snprintf(d->space_warning, sizeof(d->space_warning),
                     "disk tier: %s: preallocating the slab files failed (%s): they are sparse and grow as blocks "
                     "are written (a write that finds the disk full then fails, for want of room)",
                     d->path, strerror(errno));
        if (prealloc) {
            /* Out of room midway (others wrote meanwhile): what this open
             * allocated goes back (ext4 keeps a failed call's part too),
             * or the store would hold the whole disk and find no room for
             * its index. */
            prealloc = false;
            for (uint32_t j = 0; j < i && rc == 0; j++)
                if (was[j] < slab_want(d, j))
                    rc = slab_sparse(d, j, was[j]);
        }
        if (rc == 0)
            rc = slab_sparse(d, i, was[i]);
    }
    free(was);
    if (rc != 0)
        return rc;
    probe_direct(d);
    return 0;
}

static void lane_destroy(kvhi_disk_lane *l)
{
    if (!l)
        return;
    if (l->ring_open)
        io_uring_queue_exit(&l->ring);
    free(l->arena);
    free(l);
}

void kvhi_disk_close(kvhi_disk *d)
{
    if (d->lanes) {
        for (uint32_t i = 0; i < d->n_lanes; i++)
            lane_destroy(d->lanes[i]);
        free(d->lanes);
        pthread_mutex_destroy(&d->lane_lock);
        pthread_cond_destroy(&d->lane_free);
    }
    d->lanes = NULL;
    for (uint32_t i = 0; d->slab_fds && i < d->n_slabs; i++)
        if (d->slab_fds[i] >= 0)
            close(d->slab_fds[i]);
    free(d->slab_fds);
    d->slab_fds = NULL;
    free(d->slab_sync);
    d->slab_sync = NULL;
}

static kvhi_disk_lane *lane_create(kvhi_disk *d)
{
    kvhi_disk_lane *l = calloc(1, sizeof(*l));
    if (!l)
        return NULL;
    l->slot_bytes = d->slot_bytes;
    l->arena_bytes = (uint64_t)d->lane_blocks * d->slot_bytes;
    if (posix_memalign((void **)&l->arena, KVHI_DISK_ALIGN, l->arena_bytes) != 0) {
        free(l);
        return NULL;
    }
    memset(l->arena, 0, l->arena_bytes);
    if (io_uring_queue_init(d->queue_depth, &l->ring, 0) == 0) {
        struct iovec iov = {.iov_base = l->arena, .iov_len = l->arena_bytes};
        if (io_uring_register_buffers(&l->ring, &iov, 1) == 0)
            l->has_ring = l->ring_open = true;
        else
            io_uring_queue_exit(&l->ring);
    }
    return l;
}

static const char *ring_probe_depth(uint32_t depth, char *why, size_t len)
{
    struct io_uring ring;
    int rc = io_uring_queue_init(depth, &ring, 0);
    if (rc < 0) {
        snprintf(why, len, "disk tier: io_uring unavailable (io_uring_setup: %s); using pread and pwrite",
                 strerror(-rc));
        return why;
    }
    void *page = NULL;
    if (posix_memalign(&page, KVHI_DISK_ALIGN, KVHI_DISK_ALIGN) == 0) {
        struct iovec iov = {.iov_base = page, .iov_len = KVHI_DISK_ALIGN};
        rc = io_uring_register_buffers(&ring, &iov, 1);
        if (rc < 0)
            snprintf(why, len, "disk tier: io_uring buffers cannot be registered (%s); using pread and pwrite",
                     strerror(-rc));
        else
            io_uring_unregister_buffers(&ring);
        free(page);
    }
    io_uring_queue_exit(&ring);
    return rc < 0 ? why : NULL;
}

const char *kvhi_disk_ring_probe(const kvhi_disk *d, char *why, size_t len)
{
    return ring_probe_depth(d->queue_depth, why, len);
}

/* The open's probe, once per process: a ring made and torn down at every
 * open cost the kernel's deferred ring teardown each time (opens racing
 * forks ran more than 15 times slower), and what the kernel allows a
 * process does not change between its opens. */
static pthread_once_t ring_probe_once = PTHREAD_ONCE_INIT;
static char ring_probe_why[256];

static void ring_probe_at_first_open(void)
{
    if (!ring_probe_depth(4, ring_probe_why, sizeof(ring_probe_why)))
        ring_probe_why[0] = '\0';
}

const char *kvhi_disk_ring_unavailable(char *why, size_t len)
{
    pthread_once(&ring_probe_once, ring_probe_at_first_open);
    if (!ring_probe_why[0])
        return NULL;
    snprintf(why, len, "%s", ring_probe_why);
    return why;
}

kvhi_disk_lane *kvhi_disk_lane_get(kvhi_disk *d)
{
    pthread_mutex_lock(&d->lane_lock);
    for (;;) {
        for (uint32_t i = 0; i < d->n_lanes; i++)
            if (!d->lanes[i]->busy) {
                d->lanes[i]->busy = true;
                pthread_mutex_unlock(&d->lane_lock);
                return d->lanes[i];
            }
        if (d->n_lanes < d->max_lanes) {
            kvhi_disk_lane *l = lane_create(d);
            if (l) {
                l->busy = true;
                d->lanes[d->n_lanes++] = l;
                pthread_mutex_unlock(&d->lane_lock);
                return l;
            }
            if (d->n_lanes == 0) {
                pthread_mutex_unlock(&d->lane_lock);
                return NULL;
            }
        }
        pthread_cond_wait(&d->lane_free, &d->lane_lock);
    }
}

void kvhi_disk_lane_put(kvhi_disk *d, kvhi_disk_lane *lane)
{
    pthread_mutex_lock(&d->lane_lock);
    lane->busy = false;
    pthread_cond_signal(&d->lane_free);
    pthread_mutex_unlock(&d->lane_lock);
}

bool kvhi_disk_lane_vectored(const kvhi_disk_lane *lane) { return lane->has_ring; }

uint8_t *kvhi_disk_lane_slot(kvhi_disk_lane *lane, uint32_t i) { return lane->arena + (uint64_t)i * lane->slot_bytes; }

/* One contiguous run: n_slots neighbouring slots of one slab file, staged
 * at neighbouring arena positions, moved by one system call. */
typedef struct io_run {
    uint32_t first; /* batch index of the run's first block */
    uint32_t count;
    uint32_t slab;
    int fd;
    uint64_t offset;
    uint64_t done; /* bytes transferred so far */
} io_run;

/* The errors of runs [0, nr) of a write, through write_error. */
static void explain_write_errors(const io_run *runs, uint32_t nr, int *run_err, uint64_t slot_bytes)
{
    for (uint32_t r = 0; r < nr; r++)
        if (run_err[r])
            run_err[r] = write_error(run_err[r], runs[r].offset + (uint64_t)runs[r].count * slot_bytes);
}

/* Neighbouring slots are merged into runs of at most this many bytes: large
 * enough to cost one system call per run, small enough that a batch is in
 * flight as several requests, so the device works on them in parallel and
 * the blocks of the first ones are checked while the rest still arrive. */
#define RUN_BYTES_MAX (1u << 20)

static uint32_t make_runs(const kvhi_disk *d, uint32_t n, const uint32_t *slots, io_run *runs)
{
    uint32_t nr = 0;
    uint32_t per_run = (uint32_t)(RUN_BYTES_MAX / d->slot_bytes);
    if (per_run == 0)
        per_run = 1;
    for (uint32_t i = 0; i < n; i++) {
        if (nr && runs[nr - 1].count < per_run && slots[i] == slots[i - 1] + 1 &&
            slots[i] / d->slots_per_slab == slots[i - 1] / d->slots_per_slab) {
            runs[nr - 1].count++;
            continue;
        }
        runs[nr++] = (io_run){.first = i,
                              .count = 1,
                              .slab = slots[i] / d->slots_per_slab,
                              .fd = slab_fd(d, slots[i]),
                              .offset = kvhi_disk_slot_offset(d, slots[i])};
    }
    return nr;
}

/* The slabs of runs [0, nr) of a write are due for a sync: called once
 * the write is done or failed (a failed one may have written part). */
static void note_written(kvhi_disk *d, const io_run *runs, uint32_t nr)
{
    for (uint32_t r = 0; r < nr; r++)
        atomic_fetch_add_explicit(&d->slab_sync[runs[r].slab].written, 1, memory_order_release);
}

typedef struct run_sink {
    kvhi_disk_run_done_fn fn;
    void *ctx;
} run_sink;

/* Moves every run; a run's error lands in results[] of its blocks. Each
 * finished run is also handed to sink (when set) as soon as it is in. */
static void do_runs(kvhi_disk *d, kvhi_disk_lane *l, io_run *runs, uint32_t nr, bool write, int *results,
                    const run_sink *sink)
{
    uint64_t sb = d->slot_bytes;
    int *run_err = calloc(nr ? nr : 1, sizeof(int));
    if (!run_err) {
        for (uint32_t r = 0; r < nr; r++)
            for (uint32_t k = 0; k < runs[r].count; k++)
                results[runs[r].first + k] = -ENOMEM;
        return;
    }
    uint32_t pending = 0;
    for (uint32_t r = 0; r < nr; r++) {
        int inj = kvhi_disk_fault(write ? KVHI_OP_WRITE : KVHI_OP_READ);
        if (inj) {
            run_err[r] = inj < 0 ? inj : -EIO;
            runs[r].done = (uint64_t)runs[r].count * sb;
        }
    }
    if (l->has_ring) {
        /* Submit every unfinished run, reap, resubmit short transfers. */
        for (;;) {
            pending = 0;
            for (uint32_t r = 0; r < nr; r++) {
                uint64_t total = (uint64_t)runs[r].count * sb;
                if (run_err[r] || runs[r].done >= total)
                    continue;
                struct io_uring_sqe *sqe = io_uring_get_sqe(&l->ring);
                if (!sqe) {
                    io_uring_submit(&l->ring);
                    sqe = io_uring_get_sqe(&l->ring);
                    if (!sqe)
                        break;
                }
                uint8_t *buf = kvhi_disk_lane_slot(l, runs[r].first) + runs[r].done;
                unsigned len = (unsigned)(total - runs[r].done);
                if (write)
                    io_uring_prep_write_fixed(sqe, runs[r].fd, buf, len, runs[r].offset + runs[r].done, 0);
                else
                    io_uring_prep_read_fixed(sqe, runs[r].fd, buf, len, runs[r].offset + runs[r].done, 0);
                io_uring_sqe_set_data64(sqe, r);
                pending++;
            }
            if (!pending)
                break;
            io_uring_submit(&l->ring);
            for (uint32_t k = 0; k < pending; k++) {
                struct io_uring_cqe *cqe;
                if (lane_wait_cqe(l, &cqe, pending - k) < 0)
                    break; /* the ring is unusable: pread and pwrite below redo what it left (the same bytes) */
                uint32_t r = (uint32_t)io_uring_cqe_get_data64(cqe);
                if (cqe->res < 0)
                    run_err[r] = cqe->res; /* io_redo ones are done below */
                else if (cqe->res == 0)
                    run_err[r] = write ? -ENOSPC : -ENODATA; /* end of file: truncated slab */
                else
                    runs[r].done += (uint64_t)cqe->res;
                io_uring_cqe_seen(&l->ring, cqe);
                if (sink && !run_err[r] && runs[r].done == (uint64_t)runs[r].count * sb) {
                    for (uint32_t j = 0; j < runs[r].count; j++)
                        results[runs[r].first + j] = 0;
                    sink->fn(sink->ctx, runs[r].first, runs[r].count);
                }
            }
            if (!l->has_ring)
                break;
        }
        for (uint32_t r = 0; r < nr; r++)
            if (io_redo(run_err[r]))
                run_err[r] = 0;
        lane_settle(l);
    }
    /* Without a ring, and whatever the ring left: pread and pwrite. */
    for (uint32_t r = 0; r < nr; r++) {
        uint64_t total = (uint64_t)runs[r].count * sb;
        if (run_err[r] || runs[r].done >= total)
            continue;
        run_err[r] = sync_io(runs[r].fd, kvhi_disk_lane_slot(l, runs[r].first) + runs[r].done, total - runs[r].done,
                             runs[r].offset + runs[r].done, write);
        if (!run_err[r])
            runs[r].done = total;
    }
    if (write) {
        note_written(d, runs, nr);
        explain_write_errors(runs, nr, run_err, sb);
    }
    for (uint32_t r = 0; r < nr; r++)
        for (uint32_t k = 0; k < runs[r].count; k++)
            results[runs[r].first + k] = run_err[r];
    free(run_err);
}

static void transfer(kvhi_disk *d, kvhi_disk_lane *l, uint32_t n, const uint32_t *slots, int *results, bool write,
                     const run_sink *sink)
{
    io_run stack_runs[64];
    io_run *runs = n <= 64 ? stack_runs : malloc(sizeof(io_run) * n);
    if (!runs) {
        for (uint32_t i = 0; i < n; i++)
            results[i] = -ENOMEM;
        return;
    }
    if (write && d->fatal) {
        for (uint32_t i = 0; i < n; i++)
            results[i] = -EIO;
    } else {
        uint32_t nr = make_runs(d, n, slots, runs);
        do_runs(d, l, runs, nr, write, results, sink);
    }
    if (runs != stack_runs)
        free(runs);
}

void kvhi_disk_write_staged(kvhi_disk *d, kvhi_disk_lane *lane, uint32_t n, const uint32_t *slots, int *results)
{
    transfer(d, lane, n, slots, results, true, NULL);
}

void kvhi_disk_read_staged(kvhi_disk *d, kvhi_disk_lane *lane, uint32_t n, const uint32_t *slots, int *results,
                           kvhi_disk_run_done_fn on_run, void *ctx)
{
    run_sink sink = {on_run, ctx};
    transfer(d, lane, n, slots, results, false, on_run ? &sink : NULL);
}

int kvhi_disk_sync_fd(int fd, bool data_only)
{
    for (;;) {
        if ((data_only ? fdatasync(fd) : fsync(fd)) == 0)
            return 0;
        if (errno != EINTR)
            return -errno;
    }
}

/* Whether slab i is still the file its name leads to: one removed or
 * renamed under the engine takes every block synced into it where no
 * later open looks (that open makes an empty slab in its place). */
static bool slab_in_place(const kvhi_disk *d, uint32_t i)
{
    struct stat held, named;
    char name[64];
    slab_name(name, sizeof(name), i);
    if (fstat(d->slab_fds[i], &held) != 0 || held.st_nlink == 0)
        return false;
    if (d->dir_fd < 0)
        return true;
    return fstatat(d->dir_fd, name, &named, AT_SYMLINK_NOFOLLOW) == 0 && named.st_ino == held.st_ino &&
           named.st_dev == held.st_dev;
}

int kvhi_disk_trim_slabs(kvhi_disk *d)
{
    if (!d->made_larger || d->read_only || d->fatal || d->n_slabs == 0)
        return 0;
    /* The last slab to its slots, then the slab files an earlier, larger
     * store left past it (regular files of this user only). */
    uint32_t last = d->n_slabs - 1;
    struct stat st;
    int rc = 0;
    if (d->slab_fds[last] >= 0 && fstat(d->slab_fds[last], &st) == 0 && st.st_size > slab_want(d, last) &&
        ftruncate(d->slab_fds[last], slab_want(d, last)) != 0)
        rc = -errno;
    /* The highest first: a removal cut short leaves the files next to the
     * store, which the next trim still reaches. */
    char name[32];
    uint32_t end = d->n_slabs;
    while (end < UINT32_MAX) {
        slab_name(name, sizeof(name), end);
        if (fstatat(d->dir_fd, name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid())
            break;
        end++;
    }
    while (end-- > d->n_slabs) {
        slab_name(name, sizeof(name), end);
        if (unlinkat(d->dir_fd, name, 0) != 0)
            break;
    }
    return rc;
}

int kvhi_disk_sync_slabs(kvhi_disk *d)
{
    if (d->fatal)
        return -EIO;
    for (uint32_t i = 0; i < d->n_slabs; i++) {
        /* Writes done by now are what this sync must cover; one that
         * another thread's sync covers only once that sync has finished. */
        struct kvhi_slab_sync *ss = &d->slab_sync[i];
        uint64_t written = atomic_load_explicit(&ss->written, memory_order_acquire);
        bool due = atomic_load_explicit(&ss->synced, memory_order_acquire) < written;
        int inj = due ? kvhi_disk_fault(KVHI_OP_FSYNC) : 0;
        int rc = inj ? (inj < 0 ? inj : -EIO) : due ? kvhi_disk_sync_fd(d->slab_fds[i], true) : 0;
        if (due && rc == 0) {
            uint64_t had = atomic_load_explicit(&ss->synced, memory_order_relaxed);
            while (had < written && !atomic_compare_exchange_weak_explicit(&ss->synced, &had, written,
                                                                           memory_order_release, memory_order_relaxed))
                ;
        }
        if (rc != 0) {
            /* After a failed fsync the page cache state is unknown: never
             * retry and trust it. */
            d->slabs_untrusted = true;
            d->fatal = true;
            return rc;
        }
        if (!inj && !slab_in_place(d, i)) {
            d->slabs_untrusted = true; /* an index naming its slots would name nothing */
            d->fatal = true;
            return -ENOENT;
        }
    }
    return 0;
}

/* ---- one block straight into memory ---- */

enum { READ_INTO_MAX_CHUNKS = 8, READ_INTO_MIN_CHUNK = 64u << 10 };

typedef struct read_piece {
    uint8_t *buf;
    uint64_t len, offset, done;
    bool fixed; /* in the lane's registered arena */
} read_piece;

static bool prep_piece(kvhi_disk_lane *l, int fd, read_piece *p, uint32_t id)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(&l->ring);
    if (!sqe)
        return false;
    if (p->fixed)
        io_uring_prep_read_fixed(sqe, fd, p->buf + p->done, (unsigned)(p->len - p->done), p->offset + p->done, 0);
    else
        io_uring_prep_read(sqe, fd, p->buf + p->done, (unsigned)(p->len - p->done), p->offset + p->done);
    io_uring_sqe_set_data64(sqe, id);
    return true;
}

int kvhi_disk_read_into(kvhi_disk *d, kvhi_disk_lane *l, uint32_t slot, uint8_t *dst, uint32_t *crc_out,
                        const uint8_t **header_out)
{
    uint64_t bb = d->block_bytes;
    if (!l->has_ring || bb % KVHI_DISK_ALIGN || (uintptr_t)dst % KVHI_DISK_ALIGN || d->queue_depth < 2)
        return 1;
    uint64_t chunk = kvhi_round_up(bb / READ_INTO_MAX_CHUNKS, KVHI_DISK_ALIGN);
    if (chunk < READ_INTO_MIN_CHUNK)
        chunk = READ_INTO_MIN_CHUNK;
    uint32_t n = (uint32_t)((bb + chunk - 1) / chunk);
    if (n + 1 > d->queue_depth) {
        n = d->queue_depth - 1;
        chunk = kvhi_round_up((bb + n - 1) / n, KVHI_DISK_ALIGN);
        n = (uint32_t)((bb + chunk - 1) / chunk);
    }
    if (n == 1) {
        /* One piece: header and data as one vectored request. */
        int res = 0;
        uint8_t *dst_one = dst;
        if (vector_io(d, l, 1, &slot, &dst_one, &res, NULL, NULL, false) != 0)
            return 1;
        if (res != 0)
            return res;
        *crc_out = kvhi_crc32c(0, dst, bb);
        *header_out = l->arena;
        return 0;
    }
    int inj = kvhi_disk_fault(KVHI_OP_READ);
    if (inj)
        return inj < 0 ? inj : -EIO;
    int fd = slab_fd(d, slot);
    uint64_t base = kvhi_disk_slot_offset(d, slot);
    /* Piece 0 is the header (into the registered arena); 1..n the data. */
    read_piece p[READ_INTO_MAX_CHUNKS + 1];
    p[0] = (read_piece){.buf = l->arena, .len = KVHI_SLOT_HEADER_BYTES, .offset = base, .fixed = true};
    for (uint32_t i = 0; i < n; i++) {
        uint64_t at = (uint64_t)i * chunk, len = bb - at < chunk ? bb - at : chunk;
        p[i + 1] = (read_piece){.buf = dst + at, .len = len, .offset = base + KVHI_SLOT_HEADER_BYTES + at};
    }
    uint32_t outstanding = 0, next = 1;
    for (uint32_t i = 0; i <= n; i++)
        outstanding += prep_piece(l, fd, &p[i], i);
    int err = outstanding == n + 1 ? 0 : -EAGAIN;
    io_uring_submit(&l->ring);
    uint32_t crc = 0;
    /* Checksum each data piece as soon as it and all before it are in:
     * the CPU pass overlaps the pieces still on their way. */
    while (outstanding) {
        struct io_uring_cqe *cqe;
        int rc = lane_wait_cqe(l, &cqe, outstanding);
        if (rc < 0) {
            err = rc; /* the ring is unusable: nothing more will arrive */
            break;
        }
        uint32_t id = (uint32_t)io_uring_cqe_get_data64(cqe);
        int res = cqe->res;
        io_uring_cqe_seen(&l->ring, cqe);
        outstanding--;
        if (io_redo(res) && !err) {
            res = sync_io(fd, p[id].buf + p[id].done, p[id].len - p[id].done, p[id].offset + p[id].done, false);
            if (res == 0)
                res = (int)(p[id].len - p[id].done);
        }
        if (res < 0 || res == 0) {
            if (!err)
                err = res < 0 ? res : -ENODATA; /* end of file: truncated slab */
            continue;
        }
        p[id].done += (uint64_t)res;
        if (p[id].done < p[id].len && !err) {
            if (prep_piece(l, fd, &p[id], id)) {
                io_uring_submit(&l->ring);
                outstanding++;
            } else {
                err = -EAGAIN;
            }
        }
        while (!err && next <= n && p[next].done == p[next].len) {
            crc = kvhi_crc32c(crc, p[next].buf, p[next].len);
            next++;
        }
    }
    lane_settle(l);
    if (err) /* a ring that failed under it leaves the read to the plain path */
        return l->has_ring ? err : 1;
    *crc_out = crc;
    *header_out = l->arena;
    return 0;
}

/* ---- a batch straight into or out of memory ---- */

int kvhi_disk_read_scatter(kvhi_disk *d, kvhi_disk_lane *l, uint32_t n, const uint32_t *slots, uint8_t *const *dsts,
                           int *results, kvhi_disk_run_done_fn on_run, void *ctx)
{
    return vector_io(d, l, n, slots, dsts, results, on_run, ctx, false);
}

int kvhi_disk_write_gather(kvhi_disk *d, kvhi_disk_lane *l, uint32_t n, const uint32_t *slots, uint8_t *const *srcs,
                           int *results)
{
    return kvhi_disk_write_gather_prepared(d, l, n, slots, srcs, results, NULL, NULL);
}

int kvhi_disk_write_gather_prepared(kvhi_disk *d, kvhi_disk_lane *l, uint32_t n, const uint32_t *slots,
                                    uint8_t *const *srcs, int *results, kvhi_disk_run_done_fn prepare, void *ctx)
{
    if (d->fatal) {
        for (uint32_t i = 0; i < n; i++)
            results[i] = -EIO;
        return 0;
    }
    /* for writes, vector_io's callback prepares each run before it goes */
    return vector_io(d, l, n, slots, srcs, results, prepare, ctx, true);
}

/* Both directions of the vectored path: per slot, the header (and any
 * padding) from the lane's staging, the data from or to datas[i]. on_run
 * is called for a read run once it is in; for a write run before it is
 * submitted (each write run is submitted on its own, so the device starts
 * on it while the next is prepared). */
static int vector_io(kvhi_disk *d, kvhi_disk_lane *l, uint32_t n, const uint32_t *slots, uint8_t *const *datas,
                     int *results, kvhi_disk_run_done_fn on_run, void *ctx, bool write)
{
    uint64_t bb = d->block_bytes, sb = d->slot_bytes, pad = sb - KVHI_SLOT_HEADER_BYTES - bb;
    if (!l->has_ring || n == 0 || n > 64 || bb % KVHI_DISK_ALIGN)
        return 1;
    for (uint32_t i = 0; i < n; i++)
        if ((uintptr_t)datas[i] % KVHI_DISK_ALIGN)
            return 1;
    io_run runs[64];
    uint32_t nr = make_runs(d, n, slots, runs);
    /* Per slot: its header (and padding) into the staging, its data into
     * the destination. */
    struct iovec iov[3 * 64];
    int run_err[64] = {0};
    uint32_t first_iov[64], n_iov[64];
    uint32_t at = 0;
    for (uint32_t r = 0; r < nr; r++) {
        first_iov[r] = at;
        for (uint32_t k = 0; k < runs[r].count; k++) {
            uint32_t i = runs[r].first + k;
            uint8_t *staged = kvhi_disk_lane_slot(l, i);
            iov[at++] = (struct iovec){staged, KVHI_SLOT_HEADER_BYTES};
            iov[at++] = (struct iovec){datas[i], bb};
            if (pad)
                iov[at++] = (struct iovec){staged + KVHI_SLOT_HEADER_BYTES + bb, pad};
        }
        n_iov[r] = at - first_iov[r];
        int inj = kvhi_disk_fault(write ? KVHI_OP_WRITE : KVHI_OP_READ);
        if (inj)
            run_err[r] = inj < 0 ? inj : -EIO;
    }
    uint32_t pending = 0;
    for (uint32_t r = 0; r < nr; r++) {
        if (write && on_run) /* even for a failed run: its blocks stay consistent */
            on_run(ctx, runs[r].first, runs[r].count);
        if (run_err[r])
            continue;
        struct io_uring_sqe *sqe = io_uring_get_sqe(&l->ring);
        if (!sqe) {
            io_uring_submit(&l->ring);
            sqe = io_uring_get_sqe(&l->ring);
        }
        if (!sqe) {
            run_err[r] = -EAGAIN;
            continue;
        }
        if (write)
            io_uring_prep_writev(sqe, runs[r].fd, iov + first_iov[r], n_iov[r], runs[r].offset);
        else
            io_uring_prep_readv(sqe, runs[r].fd, iov + first_iov[r], n_iov[r], runs[r].offset);
        io_uring_sqe_set_data64(sqe, r);
        pending++;
        if (write && on_run && r + 1 < nr)
            io_uring_submit(&l->ring);
    }
    /* The first wait submits what is still queued, in the same call. */
    bool reaped[64] = {false};
    while (pending) {
        struct io_uring_cqe *cqe;
        if (lane_wait_cqe(l, &cqe, pending) < 0) {
            /* The ring is unusable (io_uring_enter refused, say): the runs
             * it left are moved by preadv and pwritev (the same bytes). */
            for (uint32_t r = 0; r < nr; r++) {
                if (run_err[r] || reaped[r])
                    continue;
                run_err[r] = sync_iov(runs[r].fd, iov + first_iov[r], n_iov[r], runs[r].offset, write);
                if (!run_err[r] && on_run && !write) {
                    for (uint32_t k = 0; k < runs[r].count; k++)
                        results[runs[r].first + k] = 0;
                    on_run(ctx, runs[r].first, runs[r].count);
                }
            }
            break;
        }
        uint32_t r = (uint32_t)io_uring_cqe_get_data64(cqe);
        int res = cqe->res;
        io_uring_cqe_seen(&l->ring, cqe);
        reaped[r] = true;
        pending--;
        uint64_t want = (uint64_t)runs[r].count * sb, moved = res > 0 ? (uint64_t)res : 0;
        if (io_redo(res)) {
            res = sync_iov(runs[r].fd, iov + first_iov[r], n_iov[r], runs[r].offset, write);
            moved = res == 0 ? want : 0;
        }
        /* A regular file reads short only at its end (a truncated slab);
         * a short write means the disk is full. */
        if (res < 0)
            run_err[r] = res;
        else if (moved < want)
            run_err[r] = write ? -ENOSPC : -ENODATA;
        else if (on_run && !write) {
            for (uint32_t k = 0; k < runs[r].count; k++)
                results[runs[r].first + k] = 0;
            on_run(ctx, runs[r].first, runs[r].count);
        }
    }
    lane_settle(l);
    if (write) {
        note_written(d, runs, nr);
        explain_write_errors(runs, nr, run_err, sb);
    }
    for (uint32_t r = 0; r < nr; r++)
        for (uint32_t k = 0; k < runs[r].count; k++)
            results[runs[r].first + k] = run_err[r];
    return 0;
}
