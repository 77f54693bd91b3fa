/* Shared helpers for the cmocka tests of kvh. The functions live in
 * test_util.c, compiled once into the test library kvh_test_util
 * (tests/c/CMakeLists.txt) that every test program links; the macros and
 * the one-line random-number and size functions stay inline here.
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
 *
 * The helpers that assert (tu_open, tu_stats, tu_seq_new, ...) are macros
 * over a function taking the caller's __FILE__ and __LINE__, so that a
 * failure names the line of the test, not of test_util.c.
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

#define assert_kvh(expected, expr)                                                                                     \
    do {                                                                                                               \
        kvh_status tu_st_ = (expr);                                                                                    \
        kvh_status tu_ex_ = (expected);                                                                                \
        if (tu_st_ != tu_ex_) {                                                                                        \
            print_error("%s:%d: %s\n    returned %s (%d), expected %s (%d); last error: \"%s\"\n", __FILE__, __LINE__, \
                        #expr, kvh_status_name(tu_st_), (int)tu_st_, kvh_status_name(tu_ex_), (int)tu_ex_,             \
                        kvh_last_error());                                                                             \
            fail();                                                                                                    \
        }                                                                                                              \
    } while (0)

#define assert_ok(expr) assert_kvh(KVH_OK, expr)

/* The same check for a status the helpers below got on behalf of the
 * caller at file:line (what names the call). */
void tu_check_at(const char *file, int line, kvh_status expected, kvh_status got, const char *what);

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

void tu_fill(tu_rng *r, void *buf, size_t n);

/* The seed to use: KVH_TEST_SEED (decimal or 0x hex) when set, else def. */
uint64_t tu_seed(uint64_t def);

/* Monotonic clock, seconds. */
double tu_now(void);

/* ---- resources released by the teardown ---- */

#define TU_MAX_TRACKED 256

kvh_engine *tu_track_engine(kvh_engine *e);

/* Closes a tracked engine now (and forgets it). */
kvh_status tu_close(kvh_engine *e);

/* calloc that the teardown frees. */
#define tu_alloc(n) tu_alloc_at(__FILE__, __LINE__, n)
void *tu_alloc_at(const char *file, int line, size_t n);

void tu_free(void *p);

/* Closes every tracked engine and frees every tu_alloc buffer (a cmocka
 * teardown). */
int tu_teardown(void **state);

/* ---- engines ---- */

static inline uint32_t tu_dtype_size(uint32_t dtype) { return dtype == KVH_DTYPE_F32 ? 4 : 2; }

static inline uint64_t tu_block_bytes_of(uint32_t layers, uint32_t heads, uint32_t dim, uint32_t bt, uint32_t dtype)
{
    return 2ull * layers * heads * dim * bt * tu_dtype_size(dtype);
}

/* A config with tier budgets given in whole blocks, on the CPU backend
 * (KVH_TEST_BACKEND=cuda: the CUDA backend, for running a suite on a GPU
 * with KVH_CUDA_UNIFIED=1, where the CPU addresses device memory). */
#define tu_cfg(...) tu_cfg_at(__FILE__, __LINE__, __VA_ARGS__)
kvh_config tu_cfg_at(const char *file, int line, uint32_t layers, uint32_t heads, uint32_t dim, uint32_t bt,
                     uint32_t dtype, uint64_t device_blocks, uint64_t host_blocks, uint32_t threads);

/* Opens (asserting) and tracks. */
#define tu_open_cfg(c) tu_open_cfg_at(__FILE__, __LINE__, c)
kvh_engine *tu_open_cfg_at(const char *file, int line, const kvh_config *c);
#define tu_open(...) tu_open_at(__FILE__, __LINE__, __VA_ARGS__)
kvh_engine *tu_open_at(const char *file, int line, uint32_t layers, uint32_t heads, uint32_t dim, uint32_t bt,
                       uint32_t dtype, uint64_t device_blocks, uint64_t host_blocks, uint32_t threads);

/* Asserting snapshots: block bytes, the counters, one tier, one block. */
#define tu_block_bytes(e) tu_block_bytes_at(__FILE__, __LINE__, e)
uint64_t tu_block_bytes_at(const char *file, int line, kvh_engine *e);
#define tu_stats(e) tu_stats_at(__FILE__, __LINE__, e)
kvh_stats tu_stats_at(const char *file, int line, kvh_engine *e);
#define tu_tier(e, tier) tu_tier_at(__FILE__, __LINE__, e, tier)
kvh_tier_info tu_tier_at(const char *file, int line, kvh_engine *e, uint32_t tier);
#define tu_binfo(e, b) tu_binfo_at(__FILE__, __LINE__, e, b)
kvh_block_info tu_binfo_at(const char *file, int line, kvh_engine *e, kvh_block b);

/* Handle of logical block i of seq, and its info. */
#define tu_seq_block(e, s, i) tu_seq_block_at(__FILE__, __LINE__, e, s, i)
kvh_block tu_seq_block_at(const char *file, int line, kvh_engine *e, kvh_seq s, uint64_t i);
#define tu_seq_binfo(e, s, i) tu_seq_binfo_at(__FILE__, __LINE__, e, s, i)
kvh_block_info tu_seq_binfo_at(const char *file, int line, kvh_engine *e, kvh_seq s, uint64_t i);

/* Length of seq in tokens; a new sequence of agent. */
#define tu_seq_len(e, s) tu_seq_len_at(__FILE__, __LINE__, e, s)
uint64_t tu_seq_len_at(const char *file, int line, kvh_engine *e, kvh_seq s);
#define tu_seq_new(e, agent) tu_seq_new_at(__FILE__, __LINE__, e, agent)
kvh_seq tu_seq_new_at(const char *file, int line, kvh_engine *e, uint32_t agent);

/* Waits for fence f and frees it, both asserted to succeed. */
#define tu_fence_finish(e, f) tu_fence_finish_at(__FILE__, __LINE__, e, f)
void tu_fence_finish_at(const char *file, int line, kvh_engine *e, kvh_fence f);
/* Migrates tokens [first, first+n) of seq to tier and waits for it. */
#define tu_seq_migrate_wait(e, s, first, n, tier) tu_seq_migrate_wait_at(__FILE__, __LINE__, e, s, first, n, tier)
void tu_seq_migrate_wait_at(const char *file, int line, kvh_engine *e, kvh_seq s, uint64_t first, uint64_t n,
                            uint32_t tier);

/* Tokens base, base+1, ... */
void tu_iota(int32_t *t, size_t n, int32_t base);

/* Deterministic KV pattern: byte j of the value for (tag, layer, pos, kv). */
void tu_pattern(void *dst, size_t bytes, uint64_t tag, uint32_t layer, uint64_t pos, int kv);

/* Writes the tu_pattern KV of tokens [pos, pos+n) for every layer. */
#define tu_write_pattern(...) tu_write_pattern_at(__FILE__, __LINE__, __VA_ARGS__)
void tu_write_pattern_at(const char *file, int line, kvh_engine *e, kvh_seq s, uint32_t layers, size_t tok_bytes,
                         uint64_t tag, uint64_t pos, size_t n);

/* Returns 1 when tokens [pos, pos+n) of every layer read back as the
 * tu_pattern of tag, 0 otherwise (prints the first difference). */
int tu_check_pattern(kvh_engine *e, kvh_seq s, uint32_t layers, size_t tok_bytes, uint64_t tag, uint64_t pos, size_t n);

/* The current view of a vmap (kvh_vmap_get). */
#define tu_vmap_view(e, m) tu_vmap_view_at(__FILE__, __LINE__, e, m)
kvh_vmap_view tu_vmap_view_at(const char *file, int line, kvh_engine *e, kvh_vmap *m);

/* This process's VmSize in kB (/proc/self/status), read without
 * allocating: address space a library keeps shows there even when no
 * page of it is ever touched. */
long tu_vm_size_kb(void);

/* f32 <-> f16 / bf16 bit patterns, rounding to nearest even (NaN stays
 * NaN, quiet). */
uint16_t tu_f32_to_f16(float f);
float tu_f16_to_f32(uint16_t h);
uint16_t tu_f32_to_bf16(float f);
float tu_bf16_to_f32(uint16_t b);

#endif
