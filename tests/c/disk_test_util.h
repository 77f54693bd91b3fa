/* Helpers shared by the disk-tier tests (tests/c/test_disk_*.c), header only.
 *
 * Nothing here asserts unless its name ends in _a: the non-asserting
 * helpers return a status or an error count, so that they can also run in
 * a fork()ed child (which reports through its exit code and must never
 * longjmp into cmocka's state).
 *
 *   Deterministic content: a "stream" describes a token sequence and its
 *   K/V. Tokens and every K/V byte are pure functions of (stream, position)
 *   (and of the layer and K-or-V), so any process can recompute and check
 *   them. A fork of stream `base` at `split` tokens continues with stream
 *   `own`: dt_content {base, split, own}.
 *
 *   Scratch directories: $KVH_TEST_TMPDIR (set by ctest, a real disk inside
 *   the build tree) or /tmp/kvh-disk-tests.<pid>.
 *
 *   kvh-store: the built tool is found through $KVH_STORE_BIN, or next to
 *   the test binary at ../../tools/kvh-store (build/tests/c/test_disk_x ->
 *   build/tools/kvh-store).
 */
#ifndef KVH_DISK_TEST_UTIL_H
#define KVH_DISK_TEST_UTIL_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* strcasestr, O_DIRECT */
#endif

#include <dirent.h>
#include <execinfo.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvh/kvh.h"

#if defined(__GNUC__)
#define DT_UNUSED __attribute__((unused))
#else
#define DT_UNUSED
#endif

/* ---- status assertions (parent process only) ---- */

#define dt_assert_kvh(expected, expr)                                                                        \
    do {                                                                                                     \
        kvh_status dt_st_ = (expr);                                                                          \
        kvh_status dt_ex_ = (expected);                                                                      \
        if (dt_st_ != dt_ex_) {                                                                              \
            print_error("%s:%d: %s\n    returned %s (%d), expected %s (%d); last error: \"%s\"\n", __FILE__, \
                        __LINE__, #expr, kvh_status_name(dt_st_), (int)dt_st_, kvh_status_name(dt_ex_),      \
                        (int)dt_ex_, kvh_last_error()[0] ? kvh_last_error() : dt_err);                       \
            fail();                                                                                          \
        }                                                                                                    \
    } while (0)
#define dt_assert_ok(expr) dt_assert_kvh(KVH_OK, expr)

/* ---- random numbers and deterministic content ---- */

static inline uint64_t dt_mix(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

typedef struct dt_rng {
    uint64_t s;
} dt_rng;

static inline uint64_t dt_next(dt_rng *r) { return dt_mix(r->s += 0x632be59bd9b4e019ull); }
static inline uint64_t dt_below(dt_rng *r, uint64_t n) { return n ? dt_next(r) % n : 0; }

/* KVH_TEST_SEED (decimal or 0x hex) when set, else def. */
static inline uint64_t dt_seed(uint64_t def)
{
    const char *s = getenv("KVH_TEST_SEED");
    return s && *s ? strtoull(s, NULL, 0) : def;
}

static inline double dt_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline int32_t dt_token1(uint64_t stream, uint64_t pos)
{
    return (int32_t)(dt_mix(stream * 0x100000001b3ull ^ dt_mix(pos + 7)) & 0x3fffffff);
}

/* A sequence's content: positions < split come from stream base, the rest
 * from stream own (split = 0: all from own). */
typedef struct dt_content {
    uint64_t base, split, own;
} dt_content;

static inline dt_content dt_plain(uint64_t stream) { return (dt_content){stream, 0, stream}; }
static inline uint64_t dt_stream_at(dt_content c, uint64_t pos) { return pos < c.split ? c.base : c.own; }
static inline int32_t dt_token(dt_content c, uint64_t pos) { return dt_token1(dt_stream_at(c, pos), pos); }

static inline void dt_tokens(dt_content c, uint64_t first, size_t n, int32_t *out)
{
    for (size_t i = 0; i < n; i++)
        out[i] = dt_token(c, first + i);
}

/* K (kv = 0) or V (kv = 1) of one token of one layer: tok_bytes bytes. */
static inline void dt_kv_token(dt_content c, uint32_t layer, uint64_t pos, int kv, uint8_t *out, size_t tok_bytes)
{
    uint64_t s = dt_mix(dt_stream_at(c, pos) * 0x2545f4914f6cdd1dull ^ ((uint64_t)layer << 40) ^ (pos << 1) ^
                        (uint64_t)kv);
    for (size_t i = 0; i < tok_bytes; i += 8) {
        uint64_t v = dt_mix(s + i);
        memcpy(out + i, &v, tok_bytes - i < 8 ? tok_bytes - i : 8);
    }
}

/* ---- engine geometry ---- */

typedef struct dt_geo {
    uint32_t layers, heads, dim, bt, dtype;
} dt_geo;

static inline uint32_t dt_esize(uint32_t dtype) { return dtype == KVH_DTYPE_F32 ? 4 : 2; }
static inline size_t dt_tok_bytes(dt_geo g) { return (size_t)g.heads * g.dim * dt_esize(g.dtype); }
static inline uint64_t dt_block_bytes(dt_geo g) { return 2ull * g.layers * g.bt * dt_tok_bytes(g); }
/* One disk slot: a 4096-byte header, then the data padded to 4096. */
static inline uint64_t dt_slot_bytes(dt_geo g) { return 4096 + (dt_block_bytes(g) + 4095) / 4096 * 4096; }

/* A CPU-backend config with budgets in whole blocks (disk in whole slots;
 * disk_slots = 0: no disk tier). */
static inline kvh_config dt_cfg(dt_geo g, const char *dir, uint64_t dev_blocks, uint64_t host_blocks,
                                uint64_t disk_slots)
{
    kvh_config c;
    kvh_config_init(&c, sizeof(c));
    c.num_layers = g.layers;
    c.num_kv_heads = g.heads;
    c.head_dim = g.dim;
    c.block_tokens = g.bt;
    c.dtype = g.dtype;
    c.backend = KVH_BACKEND_CPU;
    c.device_bytes = dev_blocks * dt_block_bytes(g);
    c.host_bytes = host_blocks * dt_block_bytes(g);
    c.disk_bytes = disk_slots * dt_slot_bytes(g);
    c.disk_path = disk_slots ? dir : NULL;
    c.model_salt = 0x5eed;
    c.migration_threads = 2;
    return c;
}

/* ---- engines closed by the teardown even when a test fails ---- */

#define DT_MAX_ENGINES 16
static kvh_engine *dt_engines[DT_MAX_ENGINES] DT_UNUSED;

static inline kvh_engine *dt_track(kvh_engine *e)
{
    for (int i = 0; e && i < DT_MAX_ENGINES; i++)
        if (!dt_engines[i]) {
            dt_engines[i] = e;
            break;
        }
    return e;
}

static inline kvh_engine *dt_untrack(kvh_engine *e)
{
    for (int i = 0; e && i < DT_MAX_ENGINES; i++)
        if (dt_engines[i] == e)
            dt_engines[i] = NULL;
    return e;
}

/* Opens (asserting) and tracks. */
#define dt_open_a(cfg) dt_open_a_(cfg, __FILE__, __LINE__)
static inline kvh_engine *dt_open_a_(const kvh_config *c, const char *file, int line)
{
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(c, &e);
    if (st != KVH_OK) {
        print_error("%s:%d: kvh_engine_open returned %s: %s\n", file, line, kvh_status_name(st), kvh_last_error());
        fail();
    }
    return dt_track(e);
}

/* Closes a tracked engine; returns close's status. */
static inline kvh_status dt_close(kvh_engine *e) { return kvh_engine_close(dt_untrack(e)); }

static int DT_UNUSED dt_teardown(void **state)
{
    (void)state;
    for (int i = 0; i < DT_MAX_ENGINES; i++)
        if (dt_engines[i]) {
            kvh_engine_close(dt_engines[i]);
            dt_engines[i] = NULL;
        }
    return 0;
}

/* ---- building and checking sequences (non-asserting) ---- */

/* kvh_last_error() of the call that made a dt_ helper fail (cleanup calls
 * would clear it). */
static _Thread_local char dt_err[512] DT_UNUSED;
static inline kvh_status dt_keep(kvh_status st)
{
    if (st != KVH_OK)
        snprintf(dt_err, sizeof(dt_err), "%s", kvh_last_error());
    return st;
}

/* Appends tokens [first, first + n) of c to seq and writes their K/V in
 * every layer. */
static inline kvh_status dt_extend(kvh_engine *e, kvh_seq s, dt_geo g, dt_content c, uint64_t first, size_t n)
{
    size_t tb = dt_tok_bytes(g);
    int32_t *tk = malloc(sizeof(int32_t) * (n ? n : 1));
    uint8_t *k = malloc(tb * (n ? n : 1)), *v = malloc(tb * (n ? n : 1));
    kvh_status st = tk && k && v ? KVH_OK : KVH_ERR_NOMEM;
    if (st == KVH_OK) {
        dt_tokens(c, first, n, tk);
        st = dt_keep(kvh_seq_append(e, s, tk, n));
    }
    for (uint32_t l = 0; st == KVH_OK && l < g.layers; l++) {
        for (size_t t = 0; t < n; t++) {
            dt_kv_token(c, l, first + t, 0, k + t * tb, tb);
            dt_kv_token(c, l, first + t, 1, v + t * tb, tb);
        }
        st = dt_keep(kvh_seq_write_kv(e, s, l, first, n, k, v));
    }
    free(tk);
    free(k);
    free(v);
    return st;
}

/* A new sequence holding tokens [0, n) of c with all K/V written. */
static inline kvh_status dt_build(kvh_engine *e, dt_geo g, dt_content c, size_t n, kvh_seq *out)
{
    kvh_seq s = {0};
    kvh_status st = dt_keep(kvh_seq_create(e, 0, &s));
    if (st != KVH_OK)
        return st;
    if ((st = dt_extend(e, s, g, c, 0, n)) != KVH_OK) {
        kvh_seq_free(e, s);
        return st;
    }
    *out = s;
    return KVH_OK;
}

/* Reads tokens [pos, pos + n) of seq in every layer and compares every
 * byte (and every token id) with c. Returns KVH_OK, the read's error, or
 * KVH_ERR_CORRUPT when a byte differs (msg, if given, says where). */
static inline kvh_status dt_verify(kvh_engine *e, kvh_seq s, dt_geo g, dt_content c, uint64_t pos, size_t n,
                                   char *msg, size_t msg_len)
{
    size_t tb = dt_tok_bytes(g);
    int32_t *tk = malloc(sizeof(int32_t) * (n ? n : 1));
    uint8_t *k = malloc(tb * (n ? n : 1)), *v = malloc(tb * (n ? n : 1)), *want = malloc(tb);
    kvh_status st = tk && k && v && want ? KVH_OK : KVH_ERR_NOMEM;
    if (st == KVH_OK && n && (st = kvh_seq_tokens(e, s, pos, n, tk)) == KVH_OK) {
        for (size_t t = 0; t < n; t++)
            if (tk[t] != dt_token(c, pos + t)) {
                if (msg)
                    snprintf(msg, msg_len, "token id at %" PRIu64 " differs", pos + t);
                st = KVH_ERR_CORRUPT;
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
                dt_kv_token(c, l, pos + t, kv, want, tb);
                if (memcmp((kv ? v : k) + t * tb, want, tb) != 0) {
                    if (msg)
                        snprintf(msg, msg_len, "%s of layer %u token %" PRIu64 " differs (stream %" PRIu64 ")",
                                 kv ? "V" : "K", l, pos + t, dt_stream_at(c, pos + t));
                    st = KVH_ERR_CORRUPT;
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

/* New sequence; match_prefix over tokens [0, n) of c. [out] *seq, *matched. */
static inline kvh_status dt_match(kvh_engine *e, dt_content c, size_t n, kvh_seq *seq, size_t *matched)
{
    int32_t *tk = malloc(sizeof(int32_t) * (n ? n : 1));
    if (!tk)
        return KVH_ERR_NOMEM;
    dt_tokens(c, 0, n, tk);
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

/* Matches c over n tokens and verifies every matched byte. Returns the
 * first failure; *matched gets the matched token count. */
static inline kvh_status dt_match_verify(kvh_engine *e, dt_geo g, dt_content c, size_t n, size_t *matched, char *msg,
                                         size_t msg_len)
{
    kvh_seq s;
    size_t m = 0;
    kvh_status st = dt_match(e, c, n, &s, &m);
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
        st = dt_verify(e, s, g, c, 0, m, msg, msg_len);
    kvh_seq_free(e, s);
    *matched = m;
    return st;
}

static inline kvh_stats dt_stats(kvh_engine *e)
{
    kvh_stats s;
    memset(&s, 0, sizeof(s));
    s.struct_size = sizeof(s);
    kvh_engine_stats(e, &s);
    return s;
}

static inline kvh_block_info dt_binfo(kvh_engine *e, kvh_seq s, uint64_t i)
{
    kvh_block b = {0};
    kvh_block_info info;
    memset(&info, 0, sizeof(info));
    info.struct_size = sizeof(info);
    info.tier = UINT32_MAX;
    if (kvh_seq_blocks(e, s, i, 1, &b) == KVH_OK)
        kvh_block_info_get(e, b, &info);
    return info;
}

/* ---- log capture ---- */

#define DT_LOG_MAX 64
typedef struct dt_log {
    pthread_mutex_t mu;
    int n;
    int level[DT_LOG_MAX];
    char line[DT_LOG_MAX][320];
} dt_log;

static void DT_UNUSED dt_log_fn(void *user, int32_t level, const char *message)
{
    dt_log *l = user;
    pthread_mutex_lock(&l->mu);
    if (l->n < DT_LOG_MAX) {
        l->level[l->n] = level;
        snprintf(l->line[l->n], sizeof(l->line[0]), "%s", message);
        l->n++;
    }
    pthread_mutex_unlock(&l->mu);
}

static inline void dt_log_init(dt_log *l)
{
    memset(l, 0, sizeof(*l));
    pthread_mutex_init(&l->mu, NULL);
}

static inline void dt_log_attach(kvh_config *c, dt_log *l)
{
    c->log_fn = dt_log_fn;
    c->log_user = l;
    c->log_level = KVH_LOG_WARN;
}

/* Lines at level <= max_level containing every one of the (NULL-ended)
 * substrings, case-insensitively. */
static inline int dt_log_count(dt_log *l, int max_level, ...)
{
    int count = 0;
    pthread_mutex_lock(&l->mu);
    for (int i = 0; i < l->n; i++) {
        if (l->level[i] > max_level)
            continue;
        va_list ap;
        va_start(ap, max_level);
        bool all = true;
        for (const char *s; (s = va_arg(ap, const char *)) != NULL;)
            all &= strcasestr(l->line[i], s) != NULL;
        va_end(ap);
        count += all;
    }
    pthread_mutex_unlock(&l->mu);
    return count;
}

/* ---- scratch directories and files ---- */

static inline int dt_rmrf(const char *path)
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
            dt_rmrf(sub);
        else
            unlink(sub);
    }
    closedir(d);
    return rmdir(path) == 0 ? 0 : -errno;
}

/* A fresh, empty directory `name` under the scratch root; path in out. */
static inline void dt_scratch(const char *name, char *out, size_t len)
{
    const char *root = getenv("KVH_TEST_TMPDIR");
    char fallback[128];
    if (!root || !*root) {
        snprintf(fallback, sizeof(fallback), "/tmp/kvh-disk-tests.%ld", (long)getpid());
        mkdir(fallback, 0755);
        root = fallback;
    }
    mkdir(root, 0755);
    snprintf(out, len, "%s/%s", root, name);
    dt_rmrf(out);
    mkdir(out, 0755);
}

/* A fresh, empty directory `name` under the scratch root to mount a test
 * filesystem on: whatever an earlier, interrupted run left mounted there
 * is unmounted first. */
static inline void dt_scratch_mountpoint(const char *name, char *out, size_t len)
{
    dt_scratch(name, out, len);
    for (int i = 0; i < 8 && umount2(out, MNT_DETACH) == 0; i++)
        ;
    dt_rmrf(out);
    mkdir(out, 0755);
}

static inline char *dt_path(char *buf, size_t len, const char *dir, const char *name)
{
    if (snprintf(buf, len, "%s/%s", dir, name) >= (int)len)
        buf[len - 1] = '\0';
    return buf;
}

/* Whole file into a malloc'd buffer (*len bytes); NULL on error. */
static inline uint8_t *dt_read_file(const char *path, size_t *len)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        close(fd);
        return NULL;
    }
    uint8_t *buf = malloc((size_t)st.st_size + 1);
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

static inline int dt_write_file(const char *path, const void *data, size_t len)
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

/* Flips bit `bit` of the byte at `off` in the file. */
static inline int dt_flip_bit(const char *path, uint64_t off, unsigned bit)
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
typedef struct dt_saved_file {
    char name[64];
    uint8_t *data;
    size_t len;
} dt_saved_file;
typedef struct dt_saved_store {
    dt_saved_file f[16];
    int n;
} dt_saved_store;

static inline int dt_store_save(const char *dir, dt_saved_store *s)
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
        dt_saved_file *f = &s->f[s->n];
        if (snprintf(f->name, sizeof(f->name), "%s", de->d_name) >= (int)sizeof(f->name))
            continue;
        f->data = dt_read_file(dt_path(p, sizeof(p), dir, de->d_name), &f->len);
        if (f->data)
            s->n++;
    }
    closedir(d);
    return 0;
}

/* Makes dir hold exactly the saved files again. */
static inline int dt_store_restore(const char *dir, const dt_saved_store *s)
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
            unlink(dt_path(p, sizeof(p), dir, de->d_name));
    }
    closedir(d);
    for (int i = 0; i < s->n; i++) {
        int rc = dt_write_file(dt_path(p, sizeof(p), dir, s->f[i].name), s->f[i].data, s->f[i].len);
        if (rc)
            return rc;
    }
    return 0;
}

static inline const dt_saved_file *dt_store_file(const dt_saved_store *s, const char *name)
{
    for (int i = 0; i < s->n; i++)
        if (!strcmp(s->f[i].name, name))
            return &s->f[i];
    return NULL;
}

static inline void dt_store_free(dt_saved_store *s)
{
    for (int i = 0; i < s->n; i++)
        free(s->f[i].data);
    memset(s, 0, sizeof(*s));
}

static inline uint32_t dt_get32(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }
static inline uint64_t dt_get64(const uint8_t *p) { return (uint64_t)dt_get32(p) | (uint64_t)dt_get32(p + 4) << 32; }

/* Whether this process has the slab file slab-0000.kvh of `dir` open with
 * O_DIRECT: 1 yes, 0 no, -1 not open (read from /proc/self/fdinfo). */
static inline int dt_slab_direct(const char *dir)
{
    char want[PATH_MAX], real[PATH_MAX];
    if (!realpath(dir, real) || snprintf(want, sizeof(want), "%s/slab-0000.kvh", real) >= (int)sizeof(want))
        return -1;
    DIR *d = opendir("/proc/self/fd");
    if (!d)
        return -1;
    int result = -1;
    struct dirent *de;
    while (result < 0 && (de = readdir(d)) != NULL) {
        char link[64], target[PATH_MAX];
        if (de->d_name[0] == '.' || snprintf(link, sizeof(link), "/proc/self/fd/%s", de->d_name) >= (int)sizeof(link))
            continue;
        ssize_t n = readlink(link, target, sizeof(target) - 1);
        if (n <= 0)
            continue;
        target[n] = '\0';
        if (strcmp(target, want) != 0)
            continue;
        char info[64];
        if (snprintf(info, sizeof(info), "/proc/self/fdinfo/%s", de->d_name) >= (int)sizeof(info))
            continue;
        FILE *f = fopen(info, "r");
        char line[128];
        while (f && fgets(line, sizeof(line), f))
            if (!strncmp(line, "flags:", 6)) {
                unsigned long flags = strtoul(line + 6, NULL, 8);
                result = (flags & O_DIRECT) ? 1 : 0;
                break;
            }
        if (f)
            fclose(f);
    }
    closedir(d);
    return result;
}

/* ---- child processes ---- */

/* A fork()ed child inherits cmocka's signal handlers, which would turn a
 * crash into a longjmp back into the test runner (in the child). Children
 * call this first: a crash then prints a backtrace to stderr and kills the
 * child with the signal, so the parent sees it. */
static void dt_crash_handler(int sig)
{
    void *frames[64];
    int n = backtrace(frames, 64);
    char head[96];
    int len = snprintf(head, sizeof(head), "\n*** child %ld: signal %d (%s); backtrace:\n", (long)getpid(), sig,
                       strsignal(sig));
    if (len > 0 && write(2, head, (size_t)len) < 0)
        _exit(128 + sig);
    backtrace_symbols_fd(frames, n, 2);
    signal(sig, SIG_DFL);
    raise(sig);
}

static inline void dt_child_signals(void)
{
    int sigs[] = {SIGSEGV, SIGBUS, SIGABRT, SIGILL, SIGFPE};
    for (size_t i = 0; i < sizeof(sigs) / sizeof(sigs[0]); i++)
        signal(sigs[i], dt_crash_handler);
}

/* Runs fn(arg) in a fork()ed child that _exit()s with its return value.
 * Returns the exit code, 128 + signal for a signal, or -1. */
static inline int dt_in_child(int (*fn)(void *), void *arg)
{
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        dt_child_signals();
        _exit(fn(arg));
    }
    int ws;
    while (waitpid(pid, &ws, 0) < 0)
        if (errno != EINTR)
            return -1;
    return WIFEXITED(ws) ? WEXITSTATUS(ws) : WIFSIGNALED(ws) ? 128 + WTERMSIG(ws) : -1;
}

/* The kvh-store tool: $KVH_STORE_BIN, else ../../tools/kvh-store beside
 * this test binary. Returns false when it is not there. */
static inline bool dt_store_tool(char *out, size_t len)
{
    const char *env = getenv("KVH_STORE_BIN");
    if (env && *env) {
        snprintf(out, len, "%s", env);
        return access(out, X_OK) == 0;
    }
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n <= 0)
        return false;
    self[n] = '\0';
    char *slash = strrchr(self, '/');
    if (!slash)
        return false;
    *slash = '\0';
    if (snprintf(out, len, "%s/../../tools/kvh-store", self) >= (int)len)
        return false;
    return access(out, X_OK) == 0;
}

/* Runs `tool argv1 argv2 [argv3]`, capturing stdout+stderr into out
 * (NUL-terminated, truncated). Returns the exit status (or -1). */
static inline int dt_run_tool(const char *tool, const char *a1, const char *a2, const char *a3, char *out, size_t len)
{
    int p[2];
    if (pipe(p) != 0)
        return -1;
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        dup2(p[1], 1);
        dup2(p[1], 2);
        close(p[0]);
        close(p[1]);
        /* In the ASan build the tool is instrumented too; what it does not
         * free before exiting is not what these tests check, and a leak
         * report would change its exit status. */
        const char *asan = getenv("ASAN_OPTIONS");
        char opts[1024];
        snprintf(opts, sizeof(opts), "%s%sdetect_leaks=0", asan ? asan : "", asan && *asan ? ":" : "");
        setenv("ASAN_OPTIONS", opts, 1);
        execl(tool, tool, a1, a2, a3, (char *)NULL);
        _exit(127);
    }
    close(p[1]);
    size_t got = 0;
    for (;;) {
        char tmp[4096];
        ssize_t n = read(p[0], tmp, sizeof(tmp));
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        size_t take = (size_t)n;
        if (len && got + take > len - 1)
            take = len - 1 - got;
        memcpy(out + got, tmp, take);
        got += take;
    }
    close(p[0]);
    if (len)
        out[got] = '\0';
    int ws;
    while (waitpid(pid, &ws, 0) < 0)
        if (errno != EINTR)
            return -1;
    return WIFEXITED(ws) ? WEXITSTATUS(ws) : -1;
}

#endif
