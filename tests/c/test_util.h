/* Shared helpers for the cmocka tests of kvh (header only).
 *
 *   assert_ok(expr), assert_kvh(expected, expr)
 *       check a kvh_status and, on mismatch, print both names and
 *       kvh_last_error() before failing the test.
 *   tu_rng / tu_seed()
 *       splitmix64; tu_seed(default) honours KVH_TEST_SEED.
 *   tu_cfg() / tu_open()
 *       small CPU-backend engines sized in whole blocks per tier.
 *   tu_track_engine() / tu_alloc() + tu_teardown
 *       engines and buffers released by the teardown even when a test fails
 *       half way (keeps the ASan leak checker quiet about failed tests).
 */
#ifndef KVH_TEST_UTIL_H
#define KVH_TEST_UTIL_H

#include <inttypes.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "kvh/kvh.h"

#if defined(__GNUC__)
#define TU_UNUSED __attribute__((unused))
#else
#define TU_UNUSED
#endif

/* ---- status assertions ---- */

#define assert_kvh(expected, expr)                                                                          \
    do {                                                                                                    \
        kvh_status tu_st_ = (expr);                                                                         \
        kvh_status tu_ex_ = (expected);                                                                     \
        if (tu_st_ != tu_ex_) {                                                                             \
            print_error("%s:%d: %s\n    returned %s (%d), expected %s (%d); last error: \"%s\"\n",          \
                        __FILE__, __LINE__, #expr, kvh_status_name(tu_st_), (int)tu_st_,                    \
                        kvh_status_name(tu_ex_), (int)tu_ex_, kvh_last_error());                            \
            fail();                                                                                         \
        }                                                                                                   \
    } while (0)

#define assert_ok(expr) assert_kvh(KVH_OK, expr)

/* ---- random numbers ---- */

typedef struct tu_rng {
    uint64_t s;
} tu_rng;

static inline uint64_t tu_next(tu_rng *r)
{
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in [0, n) (n > 0; the tiny modulo bias does not matter here). */
static inline uint64_t tu_below(tu_rng *r, uint64_t n) { return n ? tu_next(r) % n : 0; }

static inline void tu_fill(tu_rng *r, void *buf, size_t n)
{
    uint8_t *p = buf;
    while (n >= 8) {
        uint64_t v = tu_next(r);
        memcpy(p, &v, 8);
        p += 8;
        n -= 8;
    }
    if (n) {
        uint64_t v = tu_next(r);
        memcpy(p, &v, n);
    }
}

/* The seed to use: KVH_TEST_SEED (decimal or 0x hex) when set, else def. */
static inline uint64_t tu_seed(uint64_t def)
{
    const char *s = getenv("KVH_TEST_SEED");
    if (s && *s)
        return strtoull(s, NULL, 0);
    return def;
}

static inline double tu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- resources released by the teardown ---- */

#define TU_MAX_TRACKED 256
static kvh_engine *tu_engines[TU_MAX_TRACKED] TU_UNUSED;
static void *tu_buffers[TU_MAX_TRACKED * 4] TU_UNUSED;

static inline kvh_engine *tu_track_engine(kvh_engine *e)
{
    for (int i = 0; i < TU_MAX_TRACKED; i++)
        if (!tu_engines[i]) {
            tu_engines[i] = e;
            return e;
        }
    return e;
}

/* Closes a tracked engine now (and forgets it). */
static inline kvh_status tu_close(kvh_engine *e)
{
    for (int i = 0; i < TU_MAX_TRACKED; i++)
        if (tu_engines[i] == e)
            tu_engines[i] = NULL;
    return kvh_engine_close(e);
}

/* calloc that the teardown frees. */
static inline void *tu_alloc(size_t n)
{
    void *p = calloc(1, n ? n : 1);
    assert_non_null(p);
    for (int i = 0; i < TU_MAX_TRACKED * 4; i++)
        if (!tu_buffers[i]) {
            tu_buffers[i] = p;
            return p;
        }
    fail_msg("tu_alloc: too many buffers");
    return p;
}

static inline void tu_free(void *p)
{
    for (int i = 0; i < TU_MAX_TRACKED * 4; i++)
        if (tu_buffers[i] == p)
            tu_buffers[i] = NULL;
    free(p);
}

static TU_UNUSED int tu_teardown(void **state)
{
    (void)state;
    for (int i = 0; i < TU_MAX_TRACKED; i++)
        if (tu_engines[i]) {
            kvh_engine_close(tu_engines[i]);
            tu_engines[i] = NULL;
        }
    for (int i = 0; i < TU_MAX_TRACKED * 4; i++)
        if (tu_buffers[i]) {
            free(tu_buffers[i]);
            tu_buffers[i] = NULL;
        }
    return 0;
}

/* ---- engines ---- */

static inline uint32_t tu_dtype_size(uint32_t dtype) { return dtype == KVH_DTYPE_F32 ? 4 : 2; }

static inline uint64_t tu_block_bytes_of(uint32_t layers, uint32_t heads, uint32_t dim, uint32_t bt,
                                         uint32_t dtype)
{
    return 2ull * layers * heads * dim * bt * tu_dtype_size(dtype);
}

/* A config with tier budgets given in whole blocks, on the CPU backend
 * (KVH_TEST_BACKEND=cuda: the CUDA backend, for running a suite on a GPU
 * with KVH_CUDA_UNIFIED=1, where the CPU addresses device memory). */
static inline kvh_config tu_cfg(uint32_t layers, uint32_t heads, uint32_t dim, uint32_t bt, uint32_t dtype,
                                uint64_t device_blocks, uint64_t host_blocks, uint32_t threads)
{
    kvh_config c;
    assert_ok(kvh_config_init(&c, sizeof(c)));
    c.num_layers = layers;
    c.num_kv_heads = heads;
    c.head_dim = dim;
    c.block_tokens = bt;
    c.dtype = dtype;
    const char *backend = getenv("KVH_TEST_BACKEND");
    c.backend = backend && !strcmp(backend, "cuda") ? KVH_BACKEND_CUDA : KVH_BACKEND_CPU;
    uint64_t bb = tu_block_bytes_of(layers, heads, dim, bt, dtype);
    c.device_bytes = device_blocks * bb;
    c.host_bytes = host_blocks * bb;
    c.migration_threads = threads;
    return c;
}

static inline kvh_engine *tu_open_cfg(const kvh_config *c)
{
    kvh_engine *e = NULL;
    assert_ok(kvh_engine_open(c, &e));
    assert_non_null(e);
    return tu_track_engine(e);
}

static inline kvh_engine *tu_open(uint32_t layers, uint32_t heads, uint32_t dim, uint32_t bt, uint32_t dtype,
                                  uint64_t device_blocks, uint64_t host_blocks, uint32_t threads)
{
    kvh_config c = tu_cfg(layers, heads, dim, bt, dtype, device_blocks, host_blocks, threads);
    return tu_open_cfg(&c);
}

static inline uint64_t tu_block_bytes(kvh_engine *e)
{
    uint64_t b = 0;
    assert_ok(kvh_engine_block_bytes(e, &b));
    return b;
}

static inline kvh_stats tu_stats(kvh_engine *e)
{
    kvh_stats s;
    memset(&s, 0, sizeof(s));
    s.struct_size = sizeof(s);
    assert_ok(kvh_engine_stats(e, &s));
    return s;
}

static inline kvh_tier_info tu_tier(kvh_engine *e, uint32_t tier)
{
    kvh_tier_info t;
    memset(&t, 0, sizeof(t));
    t.struct_size = sizeof(t);
    assert_ok(kvh_tier_info_get(e, tier, &t));
    return t;
}

static inline kvh_block_info tu_binfo(kvh_engine *e, kvh_block b)
{
    kvh_block_info i;
    memset(&i, 0, sizeof(i));
    i.struct_size = sizeof(i);
    assert_ok(kvh_block_info_get(e, b, &i));
    return i;
}

/* Handle of logical block i of seq. */
static inline kvh_block tu_seq_block(kvh_engine *e, kvh_seq s, uint64_t i)
{
    kvh_block b = {0};
    assert_ok(kvh_seq_blocks(e, s, i, 1, &b));
    return b;
}

static inline kvh_block_info tu_seq_binfo(kvh_engine *e, kvh_seq s, uint64_t i)
{
    return tu_binfo(e, tu_seq_block(e, s, i));
}

static inline uint64_t tu_seq_len(kvh_engine *e, kvh_seq s)
{
    uint64_t n = ~0ull;
    assert_ok(kvh_seq_length(e, s, &n));
    return n;
}

static inline kvh_seq tu_seq_new(kvh_engine *e, uint32_t agent)
{
    kvh_seq s = {0};
    assert_ok(kvh_seq_create(e, agent, &s));
    assert_true(s.id != 0);
    return s;
}

/* Tokens base, base+1, ... */
static inline void tu_iota(int32_t *t, size_t n, int32_t base)
{
    for (size_t i = 0; i < n; i++)
        t[i] = base + (int32_t)i;
}

/* Deterministic KV pattern: byte j of the value for (tag, layer, pos, kv). */
static inline void tu_pattern(void *dst, size_t bytes, uint64_t tag, uint32_t layer, uint64_t pos, int kv)
{
    tu_rng r = {tag * 0x100000001b3ull ^ ((uint64_t)layer << 48) ^ (pos << 8) ^ (uint64_t)kv};
    tu_fill(&r, dst, bytes);
}

/* Writes the tu_pattern KV of tokens [pos, pos+n) for every layer. */
static inline void tu_write_pattern(kvh_engine *e, kvh_seq s, uint32_t layers, size_t tok_bytes, uint64_t tag,
                                    uint64_t pos, size_t n)
{
    uint8_t *k = malloc(tok_bytes * (n ? n : 1)), *v = malloc(tok_bytes * (n ? n : 1));
    assert_non_null(k);
    assert_non_null(v);
    for (uint32_t l = 0; l < layers; l++) {
        for (size_t t = 0; t < n; t++) {
            tu_pattern(k + t * tok_bytes, tok_bytes, tag, l, pos + t, 0);
            tu_pattern(v + t * tok_bytes, tok_bytes, tag, l, pos + t, 1);
        }
        kvh_status st = kvh_seq_write_kv(e, s, l, pos, n, k, v);
        if (st != KVH_OK) {
            free(k);
            free(v);
        }
        assert_ok(st);
    }
    free(k);
    free(v);
}

/* Returns 1 when tokens [pos, pos+n) of every layer read back as the
 * tu_pattern of tag, 0 otherwise (prints the first difference). */
static inline int tu_check_pattern(kvh_engine *e, kvh_seq s, uint32_t layers, size_t tok_bytes, uint64_t tag,
                                   uint64_t pos, size_t n)
{
    uint8_t *k = malloc(tok_bytes * (n ? n : 1)), *v = malloc(tok_bytes * (n ? n : 1));
    uint8_t *want = malloc(tok_bytes);
    int ok = k && v && want;
    for (uint32_t l = 0; ok && l < layers; l++) {
        kvh_status st = kvh_seq_read_kv(e, s, l, pos, n, k, v);
        if (st != KVH_OK) {
            print_error("read_kv(layer %u, pos %" PRIu64 ", n %zu): %s: %s\n", l, pos, n, kvh_status_name(st),
                        kvh_last_error());
            ok = 0;
            break;
        }
        for (size_t t = 0; ok && t < n; t++)
            for (int kv = 0; kv < 2 && ok; kv++) {
                tu_pattern(want, tok_bytes, tag, l, pos + t, kv);
                if (memcmp((kv ? v : k) + t * tok_bytes, want, tok_bytes) != 0) {
                    print_error("KV mismatch: layer %u token %" PRIu64 " %s (tag %" PRIu64 ")\n", l, pos + t,
                                kv ? "V" : "K", tag);
                    ok = 0;
                }
            }
    }
    free(k);
    free(v);
    free(want);
    return ok;
}

/* The current view of a vmap (kvh_vmap_get). */
static inline kvh_vmap_view tu_vmap_view(kvh_engine *e, kvh_vmap *m)
{
    kvh_vmap_view v;
    memset(&v, 0, sizeof(v));
    v.struct_size = sizeof(v);
    assert_ok(kvh_vmap_get(e, m, &v));
    return v;
}

#endif
