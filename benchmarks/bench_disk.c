/* kvh-bench disk: spill (host -> disk) and restore (disk -> host) through
 * kvh's disk tier, next to raw io_uring O_DIRECT I/O of the same bytes and
 * block size on a file in the same directory, in the same run; plus the
 * recovery time of a store holding a long context.
 *
 * The raw baseline is set up as fio sets up its io_uring engine with
 * fixedbufs and registerfiles: registered file and buffers, every
 * completion reaped per wait and the queue refilled in one submission, on
 * a file of fixed size that is preallocated and written once before any
 * timing (kvh's slab files are likewise written once, untimed), with no
 * sync after writes (kvh's spill does not sync either). Where fio is
 * installed its figure for the same file, sizes and depth is reported
 * beside (key fio: the median of runs right after each round's raw
 * passes). Both run at the depth kvh may reach: its two migration
 * threads each drive a ring of --qd. kvh and raw runs alternate, their order swapped every
 * other round; each row gives the medians of --reps rounds (default 5),
 * their ranges (key spread), and the median of the per-round ratios. */
#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_fs.h"
#include "bench_scenarios.h"

/* kvh's migration threads here; each has a disk ring of the queue depth. */
#define KVH_BENCH_DISK_THREADS 2

/* Geometry giving exactly `bytes` per f16 block of 16 tokens x 64 dims. */
static void geometry(uint64_t bytes, kvh_config *c)
{
    uint64_t per_layer_head = 2ull * 16 * 64 * 2; /* K+V, 16 tokens, 64 dims, f16 */
    uint64_t units = bytes / per_layer_head;      /* layers x heads */
    c->num_kv_heads = units >= 8 ? 8 : (uint32_t)units;
    c->num_layers = (uint32_t)(units / c->num_kv_heads);
    c->head_dim = 64;
    c->block_tokens = 16;
    c->dtype = KVH_DTYPE_F16;
}

typedef struct disk_result {
    double spill, restore, random;         /* seconds */
    double latency, raw_latency;           /* per block, ours and raw, medians */
    double scattered_raw_latency;          /* raw, into memory like the host tier's */
    double full_latency, full_raw_latency; /* the same with the host tier full */
} disk_result;

/* The raw depth-1 read the single-block latency is compared with: one
 * O_DIRECT read of one block at a random offset of the raw file, ring and
 * file set up once, into one registered buffer (as fio reads). The
 * scattered form reads into a random block of a region as large as kvh's
 * host tier (at most SCATTER_MAX), backed at open and not registered, as a
 * restore lands: on some machines (VMs) a read into memory the device has
 * not written lately takes longer. */
#define SCATTER_MAX (1ull << 30)
typedef struct raw_reader {
    int fd;
    struct io_uring ring;
    uint8_t *buf;
    uint8_t *region; /* region_n blocks */
    uint64_t region_n;
    uint64_t bs, n;
    bench_rng rng;
} raw_reader;

static int raw_reader_open(raw_reader *r, const char *path, uint64_t bs, uint64_t n, uint64_t seed)
{
    r->fd = open(path, O_RDONLY | O_DIRECT);
    r->buf = NULL;
    r->region = NULL;
    r->bs = bs;
    r->n = n;
    bench_rng_seed(&r->rng, seed);
    if (r->fd < 0)
        return -1;
    if (io_uring_queue_init(1, &r->ring, 0) != 0) {
        close(r->fd);
        return -1;
    }
    struct iovec iov = {0};
    if (posix_memalign((void **)&r->buf, 4096, bs) != 0 ||
        (iov = (struct iovec){r->buf, bs}, io_uring_register_buffers(&r->ring, &iov, 1) != 0) ||
        io_uring_register_files(&r->ring, &r->fd, 1) != 0 ||
        (r->region_n = n * bs > SCATTER_MAX ? SCATTER_MAX / bs : n,
         posix_memalign((void **)&r->region, 1 << 21, bs * r->region_n) != 0)) {
        free(r->buf);
        io_uring_queue_exit(&r->ring);
        close(r->fd);
        return -1;
    }
    memset(r->region, 1, bs * r->region_n);
    return 0;
}

static double raw_reader_once(raw_reader *r, bool scattered)
{
    uint64_t off = bench_rng_below(&r->rng, r->n) * r->bs;
    uint8_t *dst = r->region + bench_rng_below(&r->rng, r->region_n) * r->bs;
    double t0 = bench_sec();
    struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
    if (scattered)
        io_uring_prep_read(sqe, 0, dst, (unsigned)r->bs, off);
    else
        io_uring_prep_read_fixed(sqe, 0, r->buf, (unsigned)r->bs, off, 0);
    sqe->flags |= IOSQE_FIXED_FILE;
    struct io_uring_cqe *cqe;
    io_uring_submit_and_wait(&r->ring, 1);
    io_uring_wait_cqe(&r->ring, &cqe);
    int ok = cqe->res == (int)r->bs;
    io_uring_cqe_seen(&r->ring, cqe);
    return ok ? bench_sec() - t0 : -1;
}

static void raw_reader_close(raw_reader *r)
{
    free(r->buf);
    free(r->region);
    io_uring_queue_exit(&r->ring);
    close(r->fd);
}

/* One timed pass of n O_DIRECT transfers of bs over the raw file (n * bs
 * bytes, prepared by raw_prepare), sequential or shuffled, qd in flight.
 * Seconds, or -1. */
static double raw_pass(const char *path, uint64_t bs, uint32_t n, bool write, bool random, uint32_t qd, uint64_t seed)
{
    int fd = open(path, O_RDWR | O_DIRECT);
    if (fd < 0)
        return -1;
    struct io_uring ring;
    if (io_uring_queue_init(qd, &ring, 0) != 0) {
        close(fd);
        return -1;
    }
    uint8_t *buf = NULL;
    struct iovec *iov = malloc(sizeof(struct iovec) * qd);
    uint32_t *order = malloc(sizeof(uint32_t) * n), *free_slots = malloc(sizeof(uint32_t) * qd);
    double t = -1;
    if (!iov || !order || !free_slots || posix_memalign((void **)&buf, 4096, bs * qd) != 0)
        goto out;
    memset(buf, 0x5a, bs * qd);
    for (uint32_t i = 0; i < qd; i++) {
        iov[i] = (struct iovec){buf + (uint64_t)i * bs, bs};
        free_slots[i] = i;
    }
    if (io_uring_register_buffers(&ring, iov, qd) != 0 || io_uring_register_files(&ring, &fd, 1) != 0)
        goto out;
    for (uint32_t i = 0; i < n; i++)
        order[i] = i;
    if (random) {
        bench_rng r;
        bench_rng_seed(&r, seed);
        bench_shuffle_u32(&r, order, n);
    }
    uint32_t next = 0, done = 0, n_free = qd;
    bool err = false;
    double t0 = bench_sec();
    while (done < n && !err) {
        while (n_free && next < n) { /* refill the queue, one submission */
            uint32_t slot = free_slots[--n_free];
            struct io_uring_sqe *sqe = io_uring_get_sqe(&ring);
            uint64_t off = (uint64_t)order[next++] * bs;
            if (write)
                io_uring_prep_write_fixed(sqe, 0, iov[slot].iov_base, (unsigned)bs, off, (int)slot);
            else
                io_uring_prep_read_fixed(sqe, 0, iov[slot].iov_base, (unsigned)bs, off, (int)slot);
            sqe->flags |= IOSQE_FIXED_FILE;
            io_uring_sqe_set_data64(sqe, slot);
        }
        if (io_uring_submit_and_wait(&ring, 1) < 0)
            break;
        unsigned head, seen = 0;
        struct io_uring_cqe *cqe;
        io_uring_for_each_cqe(&ring, head, cqe)
        { /* every completion that is in */
            err |= cqe->res != (int)bs;
            free_slots[n_free++] = (uint32_t)io_uring_cqe_get_data64(cqe);
            seen++;
        }
        io_uring_cq_advance(&ring, seen);
        done += seen;
    }
    if (done == n && !err)
        t = bench_sec() - t0;
out:
    io_uring_queue_exit(&ring);
    close(fd);
    free(buf);
    free(iov);
    free(order);
    free(free_slots);
    return t;
}

/* The raw file at its fixed size, preallocated and written once, so that
 * timed passes find it in the state kvh's slabs are in when timed. */
static int raw_prepare(const char *path, uint64_t bs, uint32_t n, uint32_t qd)
{
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_DIRECT, 0644);
    if (fd < 0)
        return -1;
    int rc = posix_fallocate(fd, 0, (off_t)(bs * n));
    close(fd);
    if (rc != 0)
        return -1;
    return raw_pass(path, bs, n, true, false, qd, 0) < 0 ? -1 : 0;
}

/* fio on the raw file with the same sizes, depth and engine setup: GB/s
 * (rw = write, read, randread), or the median read latency in seconds
 * (rw = randread at depth 1 with latency true); -1 when fio is missing or
 * fails. */
static double fio_figure(const char *path, uint64_t bs, uint32_t n, const char *rw, uint32_t qd, bool latency)
{
    if (system("command -v fio >/dev/null 2>&1") != 0)
        return -1;
    char filename[4200], size[64], bsz[64], depth[32], mode[32];
    snprintf(filename, sizeof(filename), "--filename=%s", path);
    snprintf(size, sizeof(size), "--size=%llu", (unsigned long long)(bs * n));
    snprintf(bsz, sizeof(bsz), "--bs=%llu", (unsigned long long)bs);
    snprintf(depth, sizeof(depth), "--iodepth=%u", qd);
    snprintf(mode, sizeof(mode), "--rw=%s", rw);
    char *const argv[] = {"fio",
                          "--name=kvh-raw",
                          "--thread",
                          filename,
                          size,
                          bsz,
                          depth,
                          "--ioengine=io_uring",
                          "--direct=1",
                          "--fixedbufs",
                          "--registerfiles",
                          mode,
                          "--output-format=terse",
                          "--terse-version=3",
                          NULL};
    /* Run directly (no shell: the path may hold any character), and known
     * to the signal handler, which stops it before removing its file.
     * --thread: the job runs as a thread of this one process. Forked, the
     * job process starts a session of its own, which neither the group
     * kill nor the death signal below reaches: fio killed while it set the
     * job up left the job waiting for it forever. The I/O (engine, depth,
     * buffers, file) is the same. */
    int out[2];
    if (pipe2(out, O_CLOEXEC) != 0)
        return -1;
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid == 0) {
        setpgid(0, 0); /* the handler stops the whole group */
        /* And goes with kvh-bench if it dies of a signal it cannot catch. */
        if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent)
            _exit(127);
        int null = open("/dev/null", O_WRONLY);
        if (dup2(out[1], STDOUT_FILENO) < 0 || null < 0 || dup2(null, STDERR_FILENO) < 0)
            _exit(127);
        execvp("fio", argv);
        _exit(127);
    }
    close(out[1]);
    if (pid < 0) {
        close(out[0]);
        return -1;
    }
    setpgid(pid, pid); /* also here: the handler may run before the child gets to it */
    int slot = bench_child_add(pid);
    static char line[16384];
    size_t len = 0;
    for (ssize_t got; len < sizeof(line) - 1 && (got = read(out[0], line + len, sizeof(line) - 1 - len)) != 0;)
        if (got > 0)
            len += (size_t)got;
        else if (errno != EINTR)
            break;
    close(out[0]);
    /* Known to the handler until reaped: waited for first without reaping,
     * so that its pid cannot name another process when the handler kills. */
    siginfo_t ended;
    while (waitid(P_PID, (id_t)pid, &ended, WEXITED | WNOWAIT) < 0 && errno == EINTR)
        ;
    bench_child_drop(slot);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    line[len] = '\0';
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        return -1;
    /* terse v3: field 7 read KiB/s, 48 write KiB/s, 18.. read completion
     * latency percentiles "P%=usec" */
    double v = -1;
    int field = 1;
    for (char *save = NULL, *f = strtok_r(line, ";", &save); f; f = strtok_r(NULL, ";", &save), field++) {
        if (latency && strncmp(f, "50.000000%=", 11) == 0)
            return atof(f + 11) * 1e-6;
        if (!latency && field == (strcmp(rw, "write") == 0 ? 48 : 7))
            v = atof(f) * 1024 / 1e9;
    }
    return latency ? -1 : v;
}

/* raw_path: a file of n blocks written by raw_io, read at depth 1
 * alternately with our single-block restores so both see the same disk. */
static int run_kvh(const char *dir, const char *raw_path, uint64_t bs, uint32_t n, uint32_t qd, uint64_t seed,
                   disk_result *out)
{
    kvh_config c;
    BENCH_CHECK(kvh_config_init(&c, sizeof c));
    geometry(bs, &c);
    c.backend = KVH_BACKEND_CPU;
    c.device_bytes = 4 * bs;
    c.host_bytes = (uint64_t)(n + 4) * bs;
    c.disk_path = dir;
    c.disk_bytes = (uint64_t)(n + 8) * (bs + 8192);
    c.disk_queue_depth = qd;
    c.disk_flags = KVH_DISK_RESET_ON_MISMATCH;
    c.migration_threads = KVH_BENCH_DISK_THREADS;
    /* The host tier backed at open, as the raw side's buffers are: its
     * KV is never written here, so the warm-up's spill only read its
     * pages (the huge zero page), and a timed restore into them paid for
     * a fresh zeroed 2 MiB page under each O_DIRECT read. */
    c.prefault_memory = 1;
    kvh_engine *e;
    BENCH_CHECK(kvh_engine_open(&c, &e));
    kvh_seq s;
    BENCH_CHECK(kvh_seq_create(e, 0, &s));
    uint64_t tokens = (uint64_t)n * 16;
    int32_t *t = bench_xmalloc(sizeof(int32_t) * tokens);
    for (uint64_t i = 0; i < tokens; i++)
        t[i] = (int32_t)(i * 7 + seed);
    BENCH_CHECK(kvh_seq_append(e, s, t, tokens));
    free(t);
    BENCH_CHECK(kvh_seq_migrate(e, s, 0, tokens, KVH_TIER_HOST, NULL));
    /* First touch of the slab files and host pages happens here, untimed. */
    BENCH_CHECK(kvh_seq_migrate(e, s, 0, tokens, KVH_TIER_DISK, NULL));
    BENCH_CHECK(kvh_seq_migrate(e, s, 0, tokens, KVH_TIER_HOST, NULL));

    double t0 = bench_sec();
    BENCH_CHECK(kvh_seq_migrate(e, s, 0, tokens, KVH_TIER_DISK, NULL));
    out->spill = bench_sec() - t0;
    t0 = bench_sec();
    BENCH_CHECK(kvh_seq_migrate(e, s, 0, tokens, KVH_TIER_HOST, NULL));
    out->restore = bench_sec() - t0;

    /* Random cold blocks: all on disk again, then restored in shuffled
     * order with one call (the workers keep qd of them in flight). */
    BENCH_CHECK(kvh_seq_migrate(e, s, 0, tokens, KVH_TIER_DISK, NULL));
    kvh_block *blocks = bench_xmalloc(sizeof(kvh_block) * n);
    BENCH_CHECK(kvh_seq_blocks(e, s, 0, n, blocks));
    bench_rng r;
    bench_rng_seed(&r, seed);
    for (uint32_t i = n; i > 1; i--) {
        uint32_t j = (uint32_t)bench_rng_below(&r, i);
        kvh_block tmp = blocks[i - 1];
        blocks[i - 1] = blocks[j];
        blocks[j] = tmp;
    }
    t0 = bench_sec();
    BENCH_CHECK(kvh_migrate(e, blocks, n, KVH_TIER_HOST, NULL));
    out->random = bench_sec() - t0;

    /* One block at a time (queue depth 1), each followed by a raw read of
     * the same size: alternating cancels the drift of a shared disk. */
    BENCH_CHECK(kvh_seq_migrate(e, s, 0, tokens, KVH_TIER_DISK, NULL));
    uint32_t lat_n = n < 64 ? n : 64;
    double *lat = bench_xmalloc(sizeof(double) * lat_n * 3), *raw = lat + lat_n, *scattered = raw + lat_n;
    raw_reader rr;
    if (raw_reader_open(&rr, raw_path, bs, n, seed) != 0) {
        fprintf(stderr, "kvh-bench disk: cannot read %s with O_DIRECT and io_uring\n", raw_path);
        free(lat);
        return 1;
    }
    for (uint32_t i = 0; i < lat_n; i++) {
        t0 = bench_sec();
        BENCH_CHECK(kvh_migrate(e, &blocks[i], 1, KVH_TIER_HOST, NULL));
        lat[i] = bench_sec() - t0;
        if ((raw[i] = raw_reader_once(&rr, false)) < 0 || (scattered[i] = raw_reader_once(&rr, true)) < 0) {
            fprintf(stderr, "kvh-bench disk: a raw read of %s failed\n", raw_path);
            raw_reader_close(&rr);
            free(lat);
            return 1;
        }
    }
    out->latency = bench_median(lat, lat_n);
    out->raw_latency = bench_median(raw, lat_n);
    out->scattered_raw_latency = bench_median(scattered, lat_n);

    /* The same with the host tier full, as a cache runs: each block read
     * displaces the coldest host block, which has a clean disk copy (its
     * KV complete, it is published and recorded on disk), so nothing is
     * written; and each arrival gives the background cleaner a look. */
    BENCH_CHECK(kvh_seq_migrate(e, s, 0, tokens, KVH_TIER_HOST, NULL));
    {
        uint64_t tok_bytes = (uint64_t)c.num_kv_heads * c.head_dim * 2, chunk = 1024;
        uint8_t *kv = bench_xcalloc(chunk, tok_bytes);
        for (uint32_t layer = 0; layer < c.num_layers; layer++)
            for (uint64_t pos = 0; pos < tokens; pos += chunk) {
                uint64_t m = tokens - pos < chunk ? tokens - pos : chunk;
                BENCH_CHECK(kvh_seq_write_kv(e, s, layer, pos, m, kv, kv));
            }
        free(kv);
    }
    BENCH_CHECK(kvh_seq_migrate(e, s, 0, tokens, KVH_TIER_DISK, NULL));
    BENCH_CHECK(kvh_migrate(e, blocks + lat_n, n - lat_n, KVH_TIER_HOST, NULL));
    kvh_tier_info hi = {.struct_size = sizeof hi};
    BENCH_CHECK(kvh_tier_info_get(e, KVH_TIER_HOST, &hi));
    uint64_t n_fill = hi.capacity_blocks - hi.used_blocks;
    kvh_block *fill = bench_xmalloc(sizeof(kvh_block) * (n_fill ? n_fill : 1));
    for (uint64_t i = 0; i < n_fill; i++)
        BENCH_CHECK(kvh_block_alloc(e, 0, &fill[i]));
    BENCH_CHECK(kvh_migrate(e, fill, n_fill, KVH_TIER_HOST, NULL));
    /* Reads come one after another here, as from a loaded engine, in
     * runs of 8 alternating with 8 raw reads: work the last read left
     * behind (the cleaner's) meets the next. */
    for (uint32_t i = 0; i < lat_n; i += 8) {
        uint32_t end = i + 8 < lat_n ? i + 8 : lat_n;
        for (uint32_t j = i; j < end; j++) {
            t0 = bench_sec();
            BENCH_CHECK(kvh_migrate(e, &blocks[j], 1, KVH_TIER_HOST, NULL));
            lat[j] = bench_sec() - t0;
        }
        for (uint32_t j = i; j < end; j++)
            if ((raw[j] = raw_reader_once(&rr, false)) < 0) {
                fprintf(stderr, "kvh-bench disk: a raw read of %s failed\n", raw_path);
                raw_reader_close(&rr);
                free(lat);
                return 1;
            }
    }
    raw_reader_close(&rr);
    out->full_latency = bench_median(lat, lat_n);
    out->full_raw_latency = bench_median(raw, lat_n);
    for (uint64_t i = 0; i < n_fill; i++)
        BENCH_CHECK(kvh_block_release(e, fill[i]));
    free(fill);
    free(lat);
    free(blocks);
    BENCH_CHECK(kvh_seq_free(e, s));
    BENCH_CHECK(kvh_engine_close(e));
    return 0;
}

/* One row from m rounds: ours[k] and base[k] measured next to each other
 * (GB/s, or seconds when is_time); fio's figure when known (>= 0). */
static void emit(const bench_ctx *ctx, const char *metric, const double *ours, const double *base, int m, double fio,
                 uint64_t bs, int is_time, double target, const char *note)
{
    double scale = is_time ? 1e6 : 1, ratio[16];
    for (int k = 0; k < m; k++)
        ratio[k] = is_time ? base[k] / ours[k] : ours[k] / base[k];
    bench_row *r = bench_row_new("disk", metric, bench_median(ours, (size_t)m) * scale, is_time ? "us" : "GB/s");
    bench_row_int(r, "block_bytes", (int64_t)bs);
    bench_row_int(r, "rounds", m);
    char spread[128];
    double lo = ours[0], hi = ours[0], blo = base[0], bhi = base[0];
    for (int k = 1; k < m; k++) {
        lo = ours[k] < lo ? ours[k] : lo;
        hi = ours[k] > hi ? ours[k] : hi;
        blo = base[k] < blo ? base[k] : blo;
        bhi = base[k] > bhi ? base[k] : bhi;
    }
    snprintf(spread, sizeof(spread), "kvh %.4g-%.4g raw %.4g-%.4g", lo * scale, hi * scale, blo * scale, bhi * scale);
    bench_row_str(r, "spread", spread);
    if (fio >= 0)
        bench_row_num(r, "fio", fio * scale);
    bench_row_baseline(r, bench_median(base, (size_t)m) * scale, bench_median(ratio, (size_t)m));
    if (target > 0)
        bench_row_target(r, 1, 1, target);
    bench_row_note(r, note);
    bench_emit(ctx, r);
}

static int recovery(const bench_ctx *ctx, const char *dir, uint64_t context)
{
    kvh_config c;
    BENCH_CHECK(kvh_config_init(&c, sizeof c));
    c.num_layers = 1;
    c.num_kv_heads = 1;
    c.head_dim = 8;
    c.block_tokens = 16;
    c.dtype = KVH_DTYPE_F16;
    c.backend = KVH_BACKEND_CPU;
    c.device_bytes = 64ull << 20;
    c.host_bytes = 64ull << 20;
    c.disk_path = dir;
    c.disk_bytes = (context / 16 + 64) * 8192;
    c.disk_flags = KVH_DISK_RESET_ON_MISMATCH;
    kvh_engine *e;
    BENCH_CHECK(kvh_engine_open(&c, &e));
    kvh_seq s;
    BENCH_CHECK(kvh_seq_create(e, 0, &s));
    uint64_t chunk = 1 << 16;
    int32_t *t = bench_xmalloc(sizeof(int32_t) * chunk);
    uint16_t *kv = bench_xcalloc(chunk * 8, sizeof(uint16_t));
    /* The last chunk is what is left of the context, so that the disk
     * sized for it above holds it. */
    for (uint64_t done = 0; done < context; done += chunk) {
        uint64_t n = context - done < chunk ? context - done : chunk;
        for (uint64_t i = 0; i < n; i++)
            t[i] = (int32_t)(done + i);
        BENCH_CHECK(kvh_seq_append(e, s, t, n));
        BENCH_CHECK(kvh_seq_write_kv(e, s, 0, done, n, kv, kv));
        BENCH_CHECK(kvh_seq_persist(e, s));
        BENCH_CHECK(kvh_seq_migrate(e, s, done, n, KVH_TIER_DISK, NULL));
    }
    free(kv);
    BENCH_CHECK(kvh_seq_free(e, s));
    BENCH_CHECK(kvh_engine_close(e));
    c.disk_flags = 0;
    double t0 = bench_sec();
    BENCH_CHECK(kvh_engine_open(&c, &e));
    double open_s = bench_sec() - t0;
    BENCH_CHECK(kvh_seq_create(e, 0, &s));
    size_t matched = 0;
    uint64_t probe = context < chunk ? context : chunk; /* the prompt matched after the reopen */
    for (uint64_t i = 0; i < probe; i++)
        t[i] = (int32_t)i;
    t0 = bench_sec();
    BENCH_CHECK(kvh_seq_match_prefix(e, s, t, probe, &matched));
    double match_s = bench_sec() - t0;
    free(t);
    BENCH_CHECK(kvh_engine_close(e));
    bench_row *r = bench_row_new("disk", "recovery_open", open_s * 1e3, "ms");
    bench_row_int(r, "context", (int64_t)context);
    bench_row_note(r, "kvh_engine_open of a store holding the whole context (index replay)");
    bench_emit(ctx, r);
    r = bench_row_new("disk", "recovered_prefix_match", match_s * 1e3, "ms");
    bench_row_int(r, "context", (int64_t)probe);
    bench_row_int(r, "matched_tokens", (int64_t)matched);
    bench_row_note(r, "match_prefix right after reopening: reads and verifies the blocks from disk");
    bench_emit(ctx, r);
    return matched == probe / c.block_tokens * c.block_tokens ? 0 : 1; /* whole blocks only */
}

int bench_disk(int argc, char **argv, const bench_ctx *ctx)
{
    const char *dir = NULL;
    uint64_t total_mb = ctx->quick ? 32 : 256, qd = 32, context = ctx->quick ? 131072 : 1048576;
    bench_list sizes = {3, {64 << 10, 256 << 10, 1 << 20}};
    const bench_opt opts[] = {
        {"--dir", BENCH_OPT_STR, &dir,
         "directory on the drive to measure, where a scratch directory of its own is made and removed (default /var/tmp)"},
        {"--total-mb", BENCH_OPT_U64, &total_mb, "bytes moved per measurement, MiB"},
        {"--block-bytes", BENCH_OPT_LIST, &sizes, "block sizes (64K, 256K and 1M)"},
        {"--qd", BENCH_OPT_U64, &qd,
         "queue depth of kvh's disk rings (two migration threads); the raw baseline and fio run at twice it"},
        {"--context", BENCH_OPT_U64, &context, "tokens in the store whose recovery is timed"},
        {NULL}};
    int rc = bench_parse(argc, argv, opts, "disk", "kvh-bench disk [--dir DIR] [--total-mb N] [--block-bytes LIST]");
    if (rc)
        return bench_parse_rc(rc);
    /* Blocks are O_DIRECT transfers (4K-aligned, their length an int in a
     * completion); each of the two raw rings is 2 x qd deep; the recovery
     * store's tokens are int32. */
    if (bench_check_list("disk", "--block-bytes", &sizes, 4096, 256ull << 20, 1) ||
        bench_check_u64("disk", "--total-mb", total_mb, 1, 1ull << 20) ||
        bench_check_u64("disk", "--qd", qd, 1, 2048) || bench_check_u64("disk", "--context", context, 1, 1ull << 30))
        return 2;
    for (size_t i = 0; i < sizes.n; i++)
        if (sizes.v[i] > total_mb << 20) {
            fprintf(stderr, "kvh-bench disk: --total-mb %llu is less than one block of --block-bytes %llu\n",
                    (unsigned long long)total_mb, (unsigned long long)sizes.v[i]);
            return 2;
        }
    if (!dir)
        dir = "/var/tmp"; /* on the drive more often than /tmp (tmpfs), and sticky */
    if (!*dir) {
        fprintf(stderr, "kvh-bench disk: --dir is empty (its files would go to the root directory)\n");
        return 2;
    }
    /* Everything goes to a new directory of its own under dir: files of
     * fixed names there (raw.bin, a store) could be the user's, and two
     * runs in one dir would share them. */
    char base[4096], why[4300];
    int scratch = bench_scratch_dir_make(dir, "kvh-bench-disk", base, sizeof(base), why, sizeof(why));
    if (scratch < -1) {
        fprintf(stderr, "kvh-bench disk: --dir: %s\n", why);
        return scratch == BENCH_DIR_UNFIT ? 2 : 1; /* a wrong --dir is a usage error */
    }
    rc = 0;
    char store[4200], raw[4200], rec[4200];
    snprintf(store, sizeof(store), "%s/store", base);
    snprintf(raw, sizeof(raw), "%s/raw.bin", base);
    snprintf(rec, sizeof(rec), "%s/recovery", base);
    int reps = ctx->reps ? ctx->reps : (ctx->quick ? 1 : 5);
    if (reps > 16)
        reps = 16;
    for (size_t i = 0; i < sizes.n; i++) {
        uint64_t bs = sizes.v[i];
        uint32_t n = (uint32_t)((total_mb << 20) / bs);
        char b[32];
        bench_info(ctx, "disk: %s blocks x %u, queue depth %llu, %s", bench_fmt_bytes(bs, b, sizeof(b)), n,
                   (unsigned long long)qd, dir);
        /* The raw side may keep as many transfers in flight as kvh does:
         * each of its migration threads drives a ring of depth qd. */
        uint32_t raw_qd = (uint32_t)qd * KVH_BENCH_DISK_THREADS;
        if (raw_prepare(raw, bs, n, raw_qd) != 0) {
            fprintf(stderr, "kvh-bench disk: raw O_DIRECT io_uring writes failed in %s (%s)\n", dir, strerror(errno));
            rc = 1;
            goto out;
        }
        double sp[16], re[16], ra[16], la[16], wsp[16], wre[16], wra[16], wla[16], fla[16], wfla[16], wsla[16];
        double fw[16], fr[16], frr[16], fl[16]; /* fio, right after the raw passes */
        int fio_ok = 1;
        double bytes = (double)bs * n;
        for (int k = 0; k < reps; k++) {
            disk_result d = {0};
            double w = 0, r = 0, rr = 0;
            for (int side = 0; side < 2; side++) /* kvh first every other round */
                if ((side == 0) == (k % 2 == 0)) {
                    w = raw_pass(raw, bs, n, true, false, raw_qd, ctx->seed);
                    r = raw_pass(raw, bs, n, false, false, raw_qd, ctx->seed);
                    rr = raw_pass(raw, bs, n, false, true, raw_qd, ctx->seed + (uint64_t)k);
                    if (w < 0 || r < 0 || rr < 0) {
                        fprintf(stderr, "kvh-bench disk: raw O_DIRECT io_uring I/O failed in %s (%s)\n", dir,
                                strerror(errno));
                        rc = 1;
                        goto out;
                    }
                    if (fio_ok) {
                        fw[k] = fio_figure(raw, bs, n, "write", raw_qd, false);
                        fr[k] = fio_figure(raw, bs, n, "read", raw_qd, false);
                        frr[k] = fio_figure(raw, bs, n, "randread", raw_qd, false);
                        fl[k] = fio_figure(raw, bs, n, "randread", 1, true);
                        fio_ok = fw[k] > 0 && fr[k] > 0 && frr[k] > 0 && fl[k] > 0;
                    }
                } else if (run_kvh(store, raw, bs, n, (uint32_t)qd, ctx->seed + (uint64_t)k, &d) != 0) {
                    rc = 1;
                    goto out;
                }
            sp[k] = bytes / d.spill / 1e9;
            re[k] = bytes / d.restore / 1e9;
            ra[k] = bytes / d.random / 1e9;
            la[k] = d.latency;
            wsp[k] = bytes / w / 1e9;
            wre[k] = bytes / r / 1e9;
            wra[k] = bytes / rr / 1e9;
            wla[k] = d.raw_latency;
            wsla[k] = d.scattered_raw_latency;
            fla[k] = d.full_latency;
            wfla[k] = d.full_raw_latency;
        }
#define FIO(v) (fio_ok ? bench_median(v, (size_t)reps) : -1)
        emit(ctx, "spill_throughput", sp, wsp, reps, FIO(fw), bs, 0, 0.9,
             "host->disk via kvh_seq_migrate vs raw sequential O_DIRECT writes");
        emit(ctx, "restore_throughput", re, wre, reps, FIO(fr), bs, 0, 0.9,
             "disk->host via kvh_seq_migrate vs raw sequential O_DIRECT reads");
        emit(ctx, "random_restore_throughput", ra, wra, reps, FIO(frr), bs, 0, 0.9,
             "shuffled cold blocks in one kvh_migrate vs raw random reads at the same depth");
        emit(ctx, "single_restore_latency", la, wla, reps, FIO(fl), bs, 1, 1 / 1.2,
             "one block at depth 1, median of 64 (ratio = raw/ours; 0.833 = within 1.2x; fio: median completion "
             "latency of random reads at depth 1)");
        emit(ctx, "single_restore_latency_full_host", fla, wfla, reps, FIO(fl), bs, 1, 1 / 1.2,
             "as single_restore_latency with the host tier full: each read displaces a host block (ratio = "
             "raw/ours)");
        emit(ctx, "single_restore_latency_vs_scattered_raw", la, wsla, reps, -1, bs, 1, 0,
             "single_restore_latency against a raw read into a random block of a region the host tier's size "
             "(up to 1 GiB, not registered, as kvh's host tier is not) "
             "(ratio = raw/ours; no target: what the destination costs on this machine)");
#undef FIO
        unlink(raw);
    }
    bench_flush_table(ctx, "disk");
    bench_info(ctx, "disk: recovery of a %llu-token store", (unsigned long long)context);
    rc = recovery(ctx, rec, context) != 0;
    if (rc == 0)
        bench_flush_table(ctx, "disk recovery");
out:
    bench_scratch_dir_remove(base, scratch);
    return rc;
}
