/* Helpers shared by the reliability battery (tests/c/test_rel_*.c), header
 * only. Self-contained on purpose: it does not depend on the other test
 * helpers, so the battery keeps building while they change.
 *
 * Nothing here asserts unless its name ends in _a: the other helpers
 * return a status or a count so that they also run in fork()ed children
 * (which report through their exit code and must never longjmp into
 * cmocka's state).
 *
 *   Sizes: RL_SIZE(ci, stress) is `ci` in the normal build of a test and
 *   `stress` in its _stress.c twin (which defines REL_STRESS 1 and includes
 *   the test's source); rl_env_long(name, def) lets an environment variable
 *   override either.
 *
 *   Content: tokens and every K/V byte are pure functions of (stream,
 *   position, layer, K-or-V); a fork of stream `base` at `split` tokens
 *   continues with stream `own` (rl_content). Any process can recompute and
 *   check them, so an oracle only needs (base, split, own, length).
 *
 *   Scratch: $KVH_TEST_TMPDIR (set by ctest: a real disk inside the build
 *   tree, where O_DIRECT works) or /tmp/kvh-rel-tests.<pid>.
 *
 *   Allocation failures: a test that defines RL_ALLOC_WRAP before including
 *   this header gets __wrap_malloc / calloc / realloc / free /
 *   posix_memalign / strdup (link it with -Wl,--wrap=...; see
 *   tests/c/CMakeLists.txt). rl_alloc_arm(n, persistent) fails the n-th
 *   allocation (and, persistent, every later one); a chained hash of live
 *   pointers counts what the run leaked, in every build (LeakSanitizer
 *   checks the ASan build as well).
 *
 *   Short I/O: RL_IO_WRAP adds __wrap_read / write / pread / pwrite (and
 *   io_uring_queue_init, so that the disk tier falls back to pread/pwrite
 *   while short I/O is armed): rl_shortio_arm(op, n, persistent) makes the
 *   n-th call transfer only part of what was asked.
 */
#ifndef KVH_REL_UTIL_H
#define KVH_REL_UTIL_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <dirent.h>
#include <errno.h>
#include <execinfo.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvh/kvh.h"

#if defined(__GNUC__)
#define RL_UNUSED __attribute__((unused))
#else
#define RL_UNUSED
#endif

#ifndef REL_STRESS
#define REL_STRESS 0
#endif
#define RL_SIZE(ci, stress) (REL_STRESS ? (stress) : (ci))

static inline long rl_env_long(const char *name, long def)
{
    const char *s = getenv(name);
    return s && *s ? strtol(s, NULL, 0) : def;
}

/* ---- status checks ---- */

#define rl_assert_kvh(expected, expr)                                                                        \
    do {                                                                                                     \
        kvh_status rl_st_ = (expr);                                                                          \
        kvh_status rl_ex_ = (expected);                                                                      \
        if (rl_st_ != rl_ex_) {                                                                              \
            print_error("%s:%d: %s\n    returned %s (%d), expected %s (%d); last error: \"%s\"\n", __FILE__, \
                        __LINE__, #expr, kvh_status_name(rl_st_), (int)rl_st_, kvh_status_name(rl_ex_),      \
                        (int)rl_ex_, kvh_last_error());                                                      \
            fail();                                                                                          \
        }                                                                                                    \
    } while (0)
#define rl_assert_ok(expr) rl_assert_kvh(KVH_OK, expr)

/* A status this library documents (KVH_OK or a KVH_STATUS_LIST code). */
static inline bool rl_status_known(kvh_status st) { return st <= 0 && st >= KVH_ERR_INTERNAL; }

/* ---- random numbers ---- */

static inline uint64_t rl_mix(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

typedef struct rl_rng {
    uint64_t s;
} rl_rng;

static inline uint64_t rl_next(rl_rng *r) { return rl_mix(r->s += 0x632be59bd9b4e019ull); }
static inline uint64_t rl_below(rl_rng *r, uint64_t n) { return n ? rl_next(r) % n : 0; }

/* KVH_TEST_SEED (decimal or 0x hex) when set, else def. */
static inline uint64_t rl_seed(uint64_t def)
{
    const char *s = getenv("KVH_TEST_SEED");
    return s && *s ? strtoull(s, NULL, 0) : def;
}

static inline double rl_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline void rl_sleep_ms(double ms)
{
    if (ms <= 0)
        return;
    struct timespec ts = {(time_t)(ms / 1000), (long)((ms - (double)(time_t)(ms / 1000) * 1000) * 1e6)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* ---- deterministic content ---- */

typedef struct rl_content {
    uint64_t base, split, own;
} rl_content;

static inline rl_content rl_plain(uint64_t stream) { return (rl_content){stream, 0, stream}; }
static inline uint64_t rl_stream_at(rl_content c, uint64_t pos) { return pos < c.split ? c.base : c.own; }
static inline int32_t rl_token(rl_content c, uint64_t pos)
{
    return (int32_t)(rl_mix(rl_stream_at(c, pos) * 0x100000001b3ull ^ rl_mix(pos + 11)) & 0x3fffffff);
}

static inline void rl_tokens(rl_content c, uint64_t first, size_t n, int32_t *out)
{
    for (size_t i = 0; i < n; i++)
        out[i] = rl_token(c, first + i);
}

/* K (kv = 0) or V (kv = 1) of one token of one layer: tok_bytes bytes. */
static inline void rl_kv_token(rl_content c, uint32_t layer, uint64_t pos, int kv, uint8_t *out, size_t tok_bytes)
{
    uint64_t s = rl_mix(rl_stream_at(c, pos) * 0x2545f4914f6cdd1dull ^ ((uint64_t)layer << 40) ^ (pos << 1) ^
                        (uint64_t)kv);
    for (size_t i = 0; i < tok_bytes; i += 8) {
        uint64_t v = rl_mix(s + i);
        memcpy(out + i, &v, tok_bytes - i < 8 ? tok_bytes - i : 8);
    }
}

/* ---- geometry and configs ---- */

typedef struct rl_geo {
    uint32_t layers, heads, dim, bt, dtype;
} rl_geo;

static inline uint32_t rl_esize(uint32_t dtype) { return dtype == KVH_DTYPE_F32 ? 4 : 2; }
static inline size_t rl_tok_bytes(rl_geo g) { return (size_t)g.heads * g.dim * rl_esize(g.dtype); }
static inline uint64_t rl_block_bytes(rl_geo g) { return 2ull * g.layers * g.bt * rl_tok_bytes(g); }
/* One disk slot: a 4096-byte header, then the data padded to 4096. */
static inline uint64_t rl_slot_bytes(rl_geo g) { return 4096 + (rl_block_bytes(g) + 4095) / 4096 * 4096; }

/* A CPU-backend config, budgets in whole blocks (disk: whole slots; 0 = no
 * disk tier). */
static inline kvh_config rl_cfg(rl_geo g, const char *dir, uint64_t dev_blocks, uint64_t host_blocks,
                                uint64_t disk_slots, uint32_t threads)
{
    kvh_config c;
    kvh_config_init(&c, sizeof(c));
    c.num_layers = g.layers;
    c.num_kv_heads = g.heads;
    c.head_dim = g.dim;
    c.block_tokens = g.bt;
    c.dtype = g.dtype;
    c.backend = KVH_BACKEND_CPU;
    c.device_bytes = dev_blocks * rl_block_bytes(g);
    c.host_bytes = host_blocks * rl_block_bytes(g);
    c.disk_bytes = disk_slots * rl_slot_bytes(g);
    c.disk_path = disk_slots ? dir : NULL;
    c.model_salt = 0x7e1ab1e;
    c.migration_threads = threads;
    return c;
}

/* ---- engines closed by a teardown even when a test fails ---- */

#define RL_MAX_ENGINES 32
static kvh_engine *rl_engines[RL_MAX_ENGINES] RL_UNUSED;

static inline kvh_engine *rl_track(kvh_engine *e)
{
    for (int i = 0; e && i < RL_MAX_ENGINES; i++)
        if (!rl_engines[i]) {
            rl_engines[i] = e;
            break;
        }
    return e;
}

static inline kvh_engine *rl_untrack(kvh_engine *e)
{
    for (int i = 0; e && i < RL_MAX_ENGINES; i++)
        if (rl_engines[i] == e)
            rl_engines[i] = NULL;
    return e;
}

#define rl_open_a(cfg) rl_open_a_(cfg, __FILE__, __LINE__)
static inline kvh_engine *rl_open_a_(const kvh_config *c, const char *file, int line)
{
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(c, &e);
    if (st != KVH_OK) {
        print_error("%s:%d: kvh_engine_open returned %s: %s\n", file, line, kvh_status_name(st), kvh_last_error());
        fail();
    }
    return rl_track(e);
}

static inline kvh_status rl_close(kvh_engine *e) { return kvh_engine_close(rl_untrack(e)); }

static inline void rl_fast_cleanup(void);

/* Closes what a failed test left open and removes its tmpfs scratch. */
static int RL_UNUSED rl_teardown(void **state)
{
    (void)state;
    for (int i = 0; i < RL_MAX_ENGINES; i++)
        if (rl_engines[i]) {
            kvh_engine_close(rl_engines[i]);
            rl_engines[i] = NULL;
        }
    rl_fast_cleanup();
    return 0;
}

/* ---- building and checking sequences (non-asserting) ---- */

/* Buffers of the test itself: never failed by the allocation wrappers
 * (free() them as usual). */
#ifdef RL_ALLOC_WRAP
void *__real_malloc(size_t n);
#define rl_tmalloc(n) __real_malloc(n)
#else
#define rl_tmalloc(n) malloc(n)
#endif

/* kvh_last_error() of the call that made an rl_ helper fail. */
static _Thread_local char rl_err[512] RL_UNUSED;
static inline kvh_status rl_keep(kvh_status st)
{
    if (st != KVH_OK)
        snprintf(rl_err, sizeof(rl_err), "%s", kvh_last_error());
    return st;
}

/* Appends tokens [first, first + n) of c to s and writes their K/V. */
static inline kvh_status rl_extend(kvh_engine *e, kvh_seq s, rl_geo g, rl_content c, uint64_t first, size_t n)
{
    size_t tb = rl_tok_bytes(g);
    int32_t *tk = rl_tmalloc(sizeof(int32_t) * (n ? n : 1));
    uint8_t *k = rl_tmalloc(tb * (n ? n : 1)), *v = rl_tmalloc(tb * (n ? n : 1));
    kvh_status st = tk && k && v ? KVH_OK : KVH_ERR_NOMEM;
    if (st == KVH_OK) {
        rl_tokens(c, first, n, tk);
        st = rl_keep(kvh_seq_append(e, s, tk, n));
    }
    for (uint32_t l = 0; st == KVH_OK && l < g.layers; l++) {
        for (size_t t = 0; t < n; t++) {
            rl_kv_token(c, l, first + t, 0, k + t * tb, tb);
            rl_kv_token(c, l, first + t, 1, v + t * tb, tb);
        }
        st = rl_keep(kvh_seq_write_kv(e, s, l, first, n, k, v));
    }
    free(tk);
    free(k);
    free(v);
    return st;
}

/* A new sequence holding tokens [0, n) of c, all K/V written. */
static inline kvh_status rl_build(kvh_engine *e, rl_geo g, rl_content c, size_t n, uint32_t agent, kvh_seq *out)
{
    kvh_seq s = {0};
    kvh_status st = rl_keep(kvh_seq_create(e, agent, &s));
    if (st != KVH_OK)
        return st;
    if ((st = rl_extend(e, s, g, c, 0, n)) != KVH_OK) {
        kvh_seq_free(e, s);
        return st;
    }
    *out = s;
    return KVH_OK;
}

/* Reads tokens [pos, pos + n) of s (ids and every K/V byte) and compares
 * them with c. KVH_OK, the read's error, or KVH_ERR_INTERNAL when a byte
 * differs (msg says where) -- wrong data is never an ordinary status. */
static inline kvh_status rl_verify(kvh_engine *e, kvh_seq s, rl_geo g, rl_content c, uint64_t pos, size_t n,
                                   char *msg, size_t msg_len)
{
    size_t tb = rl_tok_bytes(g);
    int32_t *tk = rl_tmalloc(sizeof(int32_t) * (n ? n : 1));
    uint8_t *k = rl_tmalloc(tb * (n ? n : 1)), *v = rl_tmalloc(tb * (n ? n : 1)), *want = rl_tmalloc(tb);
    kvh_status st = tk && k && v && want ? KVH_OK : KVH_ERR_NOMEM;
    if (st == KVH_OK && n && (st = kvh_seq_tokens(e, s, pos, n, tk)) == KVH_OK) {
        for (size_t t = 0; t < n; t++)
            if (tk[t] != rl_token(c, pos + t)) {
                if (msg)
                    snprintf(msg, msg_len, "token id at %" PRIu64 " differs", pos + t);
                st = KVH_ERR_INTERNAL;
                break;
            }
    } else if (st != KVH_OK && msg)
        snprintf(msg, msg_len, "kvh_seq_tokens: %s: %s", kvh_status_name(st), kvh_last_error());
    for (uint32_t l = 0; st == KVH_OK && n && l < g.layers; l++) {
        memset(k, 0xA5, tb * n);
        memset(v, 0x5A, tb * n);
        st = kvh_seq_read_kv(e, s, l, pos, n, k, v);
        if (st != KVH_OK) {
            if (msg)
                snprintf(msg, msg_len, "read_kv(layer %u, pos %" PRIu64 ", n %zu): %s: %s", l, pos, n,
                         kvh_status_name(st), kvh_last_error());
            break;
        }
        for (size_t t = 0; t < n && st == KVH_OK; t++)
            for (int kv = 0; kv < 2; kv++) {
                rl_kv_token(c, l, pos + t, kv, want, tb);
                if (memcmp((kv ? v : k) + t * tb, want, tb) != 0) {
                    if (msg)
                        snprintf(msg, msg_len, "%s of layer %u token %" PRIu64 " differs (stream %" PRIu64 ")",
                                 kv ? "V" : "K", l, pos + t, rl_stream_at(c, pos + t));
                    st = KVH_ERR_INTERNAL;
                    break;
                }
            }
    }
    free(tk);
    free(k);
    free(v);
    free(want);
    return st;
}

/* New sequence + match_prefix over tokens [0, n) of c. */
static inline kvh_status rl_match(kvh_engine *e, rl_content c, size_t n, kvh_seq *seq, size_t *matched)
{
    int32_t *tk = rl_tmalloc(sizeof(int32_t) * (n ? n : 1));
    if (!tk)
        return KVH_ERR_NOMEM;
    rl_tokens(c, 0, n, tk);
    kvh_seq s = {0};
    kvh_status st = kvh_seq_create(e, 0, &s);
    if (st == KVH_OK) {
        st = kvh_seq_match_prefix(e, s, tk, n, matched);
        if (st != KVH_OK)
            kvh_seq_free(e, s);
        else
            *seq = s;
    }
    free(tk);
    return st;
}

/* Matches c over n tokens and checks every matched byte. KVH_ERR_INTERNAL
 * when wrong data was served; *matched gets the matched token count. */
static inline kvh_status rl_match_verify(kvh_engine *e, rl_geo g, rl_content c, size_t n, size_t *matched, char *msg,
                                         size_t msg_len)
{
    kvh_seq s;
    size_t m = 0;
    *matched = 0;
    kvh_status st = rl_match(e, c, n, &s, &m);
    if (st != KVH_OK) {
        if (msg)
            snprintf(msg, msg_len, "match_prefix: %s: %s", kvh_status_name(st), kvh_last_error());
        return st;
    }
    if (m % g.bt != 0 || m > n) {
        if (msg)
            snprintf(msg, msg_len, "match_prefix matched %zu of %zu tokens (block_tokens %u)", m, n, g.bt);
        st = KVH_ERR_INTERNAL;
    } else
        st = rl_verify(e, s, g, c, 0, m, msg, msg_len);
    kvh_seq_free(e, s);
    *matched = m;
    return st;
}

static inline kvh_stats rl_stats(kvh_engine *e)
{
    kvh_stats s;
    memset(&s, 0, sizeof(s));
    s.struct_size = sizeof(s);
    kvh_engine_stats(e, &s);
    return s;
}

static inline kvh_tier_info rl_tier(kvh_engine *e, uint32_t tier)
{
    kvh_tier_info t;
    memset(&t, 0, sizeof(t));
    t.struct_size = sizeof(t);
    kvh_tier_info_get(e, tier, &t);
    return t;
}

/* Counters that must add up at any quiet moment. Returns 0 or writes the
 * first broken rule into msg. live = blocks_allocated - blocks_freed. */
static inline int rl_counters_add_up(kvh_engine *e, bool has_disk, char *msg, size_t len)
{
    kvh_stats s = rl_stats(e);
    uint64_t bb = 0;
    kvh_engine_block_bytes(e, &bb);
    uint64_t used[KVH_TIER_COUNT];
    for (uint32_t t = 0; t < KVH_TIER_COUNT; t++) {
        kvh_tier_info ti = rl_tier(e, t);
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

/* ---- scratch directories and files ---- */

static inline int rl_rmrf(const char *path)
{
    DIR *d = opendir(path);
    if (!d)
        return errno == ENOENT ? 0 : (unlink(path) == 0 ? 0 : -errno);
    struct dirent *de;
    char sub[PATH_MAX];
    while ((de = readdir(d)) != NULL) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
            continue;
        if (snprintf(sub, sizeof(sub), "%s/%s", path, de->d_name) >= (int)sizeof(sub))
            continue;
        struct stat st;
        if (lstat(sub, &st) == 0 && S_ISDIR(st.st_mode))
            rl_rmrf(sub);
        else
            unlink(sub);
    }
    closedir(d);
    return rmdir(path) == 0 ? 0 : -errno;
}

/* A fresh, empty directory `name` under the scratch root; path in out. */
static inline void rl_scratch(const char *name, char *out, size_t len)
{
    const char *root = getenv("KVH_TEST_TMPDIR");
    char fallback[128];
    if (!root || !*root) {
        snprintf(fallback, sizeof(fallback), "/tmp/kvh-rel-tests.%ld", (long)getpid());
        mkdir(fallback, 0755);
        root = fallback;
    }
    mkdir(root, 0755);
    snprintf(out, len, "%s/%s", root, name);
    rl_rmrf(out);
    mkdir(out, 0755);
}

/* Like rl_scratch, but on a tmpfs (/dev/shm, or $KVH_REL_FAST_DIR) when
 * there is one: fsync is free there, which matters for tests that sync
 * thousands of times and whose subject is not the device (kills keep the
 * page cache anyway). O_DIRECT is refused there, so the engine runs
 * buffered. Returns false (and gives an ordinary scratch dir) without one.
 * Remove it with rl_rmrf when done. */
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
        rl_scratch(name, out, len);
        return false;
    }
    snprintf(out, len, "%s/%s", dir, name);
    rl_rmrf(out);
    mkdir(out, 0755);
    return true;
}

/* Removes what rl_fast_scratch made for process pid. */
static inline void rl_fast_cleanup_pid(long pid)
{
    const char *root = getenv("KVH_REL_FAST_DIR");
    char dir[256];
    snprintf(dir, sizeof(dir), "%s/kvh-rel.%ld", root && *root ? root : "/dev/shm", pid);
    rl_rmrf(dir);
}

/* Removes what rl_fast_scratch made for this process. */
static inline void rl_fast_cleanup(void) { rl_fast_cleanup_pid((long)getpid()); }

static inline char *rl_path(char *buf, size_t len, const char *dir, const char *name)
{
    if (snprintf(buf, len, "%s/%s", dir, name) >= (int)len)
        buf[len - 1] = '\0';
    return buf;
}

/* Whole file into a malloc'd buffer (*len bytes, one spare byte); NULL on
 * error. */
static inline uint8_t *rl_read_file(const char *path, size_t *len)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        close(fd);
        return NULL;
    }
    uint8_t *buf = rl_tmalloc((size_t)st.st_size + 1);
    size_t got = 0;
    while (buf && got < (size_t)st.st_size) {
        ssize_t n = pread(fd, buf + got, (size_t)st.st_size - got, (off_t)got);
        if (n <= 0) {
            free(buf);
            buf = NULL;
            break;
        }
        got += (size_t)n;
    }
    close(fd);
    if (buf)
        *len = got;
    return buf;
}

static inline int rl_write_file(const char *path, const void *data, size_t len)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return -errno;
    size_t done = 0;
    while (done < len) {
        ssize_t n = pwrite(fd, (const uint8_t *)data + done, len - done, (off_t)done);
        if (n <= 0) {
            close(fd);
            return -EIO;
        }
        done += (size_t)n;
    }
    close(fd);
    return 0;
}

static inline int rl_flip_bit(const char *path, uint64_t off, unsigned bit)
{
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    uint8_t b;
    int rc = pread(fd, &b, 1, (off_t)off) == 1 ? 0 : -EIO;
    b ^= (uint8_t)(1u << (bit & 7));
    if (rc == 0 && pwrite(fd, &b, 1, (off_t)off) != 1)
        rc = -EIO;
    close(fd);
    return rc;
}

/* A saved copy of every regular file of a store directory. */
typedef struct rl_saved_file {
    char name[64];
    uint8_t *data;
    size_t len;
} rl_saved_file;
typedef struct rl_saved_store {
    rl_saved_file f[16];
    int n;
} rl_saved_store;

static inline int rl_store_save(const char *dir, rl_saved_store *s)
{
    memset(s, 0, sizeof(*s));
    DIR *d = opendir(dir);
    if (!d)
        return -errno;
    struct dirent *de;
    char p[PATH_MAX];
    while ((de = readdir(d)) != NULL && s->n < 16) {
        if (de->d_name[0] == '.')
            continue;
        rl_saved_file *f = &s->f[s->n];
        if (snprintf(f->name, sizeof(f->name), "%s", de->d_name) >= (int)sizeof(f->name))
            continue;
        f->data = rl_read_file(rl_path(p, sizeof(p), dir, de->d_name), &f->len);
        if (f->data)
            s->n++;
    }
    closedir(d);
    return 0;
}

/* Makes dir hold exactly the saved files again. */
static inline int rl_store_restore(const char *dir, const rl_saved_store *s)
{
    DIR *d = opendir(dir);
    if (!d)
        return -errno;
    struct dirent *de;
    char p[PATH_MAX];
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.')
            continue;
        bool keep = false;
        for (int i = 0; i < s->n; i++)
            keep |= !strcmp(s->f[i].name, de->d_name);
        if (!keep)
            unlink(rl_path(p, sizeof(p), dir, de->d_name));
    }
    closedir(d);
    for (int i = 0; i < s->n; i++) {
        int rc = rl_write_file(rl_path(p, sizeof(p), dir, s->f[i].name), s->f[i].data, s->f[i].len);
        if (rc)
            return rc;
    }
    return 0;
}

static inline const rl_saved_file *rl_store_file(const rl_saved_store *s, const char *name)
{
    for (int i = 0; i < s->n; i++)
        if (!strcmp(s->f[i].name, name))
            return &s->f[i];
    return NULL;
}

static inline void rl_store_free(rl_saved_store *s)
{
    for (int i = 0; i < s->n; i++)
        free(s->f[i].data);
    memset(s, 0, sizeof(*s));
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

/* ---- child processes ---- */

/* A fork()ed child inherits cmocka's signal handlers, which would turn a
 * crash into a longjmp into the test runner inside the child. Children
 * call this first: a crash prints a backtrace and kills the child with the
 * signal, so the parent sees it. */
static void rl_crash_handler(int sig)
{
    void *frames[64];
    int n = backtrace(frames, 64);
    char head[96];
    int len = snprintf(head, sizeof(head), "\n*** child %ld: signal %d; backtrace:\n", (long)getpid(), sig);
    if (len > 0 && write(2, head, (size_t)len) < 0)
        _exit(128 + sig);
    backtrace_symbols_fd(frames, n, 2);
    signal(sig, SIG_DFL);
    raise(sig);
}

static inline void rl_child_signals(void)
{
    int sigs[] = {SIGSEGV, SIGBUS, SIGABRT, SIGILL, SIGFPE};
    for (size_t i = 0; i < sizeof(sigs) / sizeof(sigs[0]); i++)
        signal(sigs[i], rl_crash_handler);
}

/* Runs fn(arg) in a fork()ed child that _exit()s with its return value.
 * Returns the exit code, 128 + signal for a signal, or -1. */
static inline int rl_in_child(int (*fn)(void *), void *arg)
{
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        rl_child_signals();
        _exit(fn(arg));
    }
    int ws;
    while (waitpid(pid, &ws, 0) < 0)
        if (errno != EINTR)
            return -1;
    return WIFEXITED(ws) ? WEXITSTATUS(ws) : WIFSIGNALED(ws) ? 128 + WTERMSIG(ws) : -1;
}

/* Appends a formatted line to an O_APPEND file descriptor (one write: a
 * SIGKILL leaves whole lines; the page cache keeps them without fsync). */
static inline void rl_oracle_write(int fd, const char *fmt, ...)
{
    char line[192];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    if (n > 0 && write(fd, line, (size_t)n) != n)
        _exit(70);
}

/* ---- the durability oracle ----
 *
 * Lines (one write each):
 *   P id base split own n    a sequence planned: content and final length
 *   A id nfull               kvh_seq_persist returned KVH_OK: its first
 *                            nfull blocks are acknowledged durable
 * The checker reopens the store and, for each planned sequence, matches
 * its prefix: every acknowledged block must be found, every byte served
 * must be the content (a longer match is fine: spilled and cleaned blocks
 * are journaled too). */

#define RL_MAX_SEQS 8192
typedef struct rl_planned {
    bool used;
    rl_content c;
    size_t n;
    size_t acked; /* full blocks acknowledged durable */
} rl_planned;

typedef struct rl_oracle {
    rl_planned seq[RL_MAX_SEQS];
    uint32_t max_id; /* one past the highest id seen */
    int acks;
} rl_oracle;

/* Reads (adds to) o from the oracle file. Returns the number of lines. */
static inline int rl_oracle_read(const char *path, rl_oracle *o)
{
    size_t len = 0;
    uint8_t *buf = rl_read_file(path, &len);
    if (!buf)
        return 0;
    int lines = 0;
    size_t start = 0;
    for (size_t i = 0; i < len; i++) {
        if (buf[i] != '\n')
            continue;
        buf[i] = '\0';
        const char *l = (const char *)buf + start;
        start = i + 1;
        unsigned id;
        unsigned long long base, split, own, n, nfull;
        lines++;
        if (sscanf(l, "P %u %llu %llu %llu %llu", &id, &base, &split, &own, &n) == 5 && id < RL_MAX_SEQS) {
            o->seq[id].used = true;
            o->seq[id].c = (rl_content){base, split, own};
            o->seq[id].n = (size_t)n;
            if (id + 1 > o->max_id)
                o->max_id = id + 1;
        } else if (sscanf(l, "A %u %llu", &id, &nfull) == 2 && id < RL_MAX_SEQS) {
            if (nfull > o->seq[id].acked)
                o->seq[id].acked = (size_t)nfull;
            o->acks++;
        }
    }
    free(buf);
    return lines;
}

typedef struct rl_check {
    int errors;
    uint64_t corrupt;
    uint64_t seqs, acked_blocks, matched_blocks;
    char msg[512];
} rl_check;

/* Opens the store in dir with cfg and checks every planned sequence with
 * id in [first_id, o->max_id). Returns the engine (NULL when open failed;
 * the failure is in r). */
static inline kvh_engine *rl_oracle_check(const kvh_config *cfg, rl_geo g, const rl_oracle *o, uint32_t first_id,
                                          rl_check *r)
{
    memset(r, 0, sizeof(*r));
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(cfg, &e);
    if (st != KVH_OK) {
        r->errors++;
        snprintf(r->msg, sizeof(r->msg), "reopen: %s: %s", kvh_status_name(st), kvh_last_error());
        return NULL;
    }
    for (uint32_t id = first_id; id < o->max_id && id < RL_MAX_SEQS; id++) {
        const rl_planned *p = &o->seq[id];
        if (!p->used)
            continue;
        size_t m = 0;
        char msg[256] = "";
        r->seqs++;
        r->acked_blocks += p->acked;
        st = rl_match_verify(e, g, p->c, p->n, &m, msg, sizeof(msg));
        r->matched_blocks += m / g.bt;
        if (st != KVH_OK) {
            if (!r->errors++)
                snprintf(r->msg, sizeof(r->msg), "seq %u (acked %zu blocks): %s", id, p->acked, msg);
        } else if (m < p->acked * g.bt) {
            if (!r->errors++)
                snprintf(r->msg, sizeof(r->msg),
                         "seq %u: %zu blocks were acknowledged durable, only %zu found after the crash", id, p->acked,
                         m / g.bt);
        }
    }
    r->corrupt = rl_stats(e).corrupt_blocks;
    if (r->corrupt && !r->errors++)
        snprintf(r->msg, sizeof(r->msg), "%" PRIu64 " blocks failed verification after a kill (nothing was "
                 "damaged on disk: a kill loses no written data)", r->corrupt);
    return e;
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

static inline uint32_t rl_track_hash(const void *p) { return (uint32_t)(rl_mix((uintptr_t)p) & (RL_TRACK_BUCKETS - 1)); }

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
