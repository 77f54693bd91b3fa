/* Hostile input: NULL pointers, random / stale / forged handles, wrong
 * struct sizes. Every call answers with its documented status and the
 * engine stays usable. */
#include <ftw.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "forged_calls.h"
#include "test_util.h"

enum { L = 2, H = 2, D = 4, BT = 4 };
static const size_t TOK = H * D * 4;

typedef struct fixture {
    kvh_engine *e;
    kvh_seq s, s2;
    kvh_block b;     /* standalone, retained */
    kvh_block sb[3]; /* blocks of s */
    kvh_fence f;     /* completed, not freed */
    kvh_pool pool;
    void *kbase[L], *vbase[L];
    kvh_pool_layout layout;
    int32_t toks[10];
    uint8_t *pool_mem;
} fixture;

static fixture *make_fixture(void)
{
    fixture *x = tu_alloc(sizeof(fixture));
    x->e = tu_open(L, H, D, BT, KVH_DTYPE_F32, 16, 16, 0);
    x->s = tu_seq_new(x->e, 1);
    x->s2 = tu_seq_new(x->e, 2);
    tu_iota(x->toks, 10, 40);
    assert_ok(kvh_seq_append(x->e, x->s, x->toks, 10));
    tu_write_pattern(x->e, x->s, L, TOK, 1, 0, 10);
    assert_ok(kvh_seq_blocks(x->e, x->s, 0, 3, x->sb));
    assert_ok(kvh_block_alloc(x->e, 0, &x->b));
    assert_ok(kvh_seq_migrate(x->e, x->s2, 0, 0, KVH_TIER_HOST, &x->f));
    x->pool_mem = tu_alloc(2 * L * 4 * BT * TOK);
    for (int l = 0; l < L; l++) {
        x->kbase[l] = x->pool_mem + (size_t)(2 * l) * 4 * BT * TOK;
        x->vbase[l] = x->pool_mem + (size_t)(2 * l + 1) * 4 * BT * TOK;
    }
    x->layout = (kvh_pool_layout){.struct_size = sizeof(kvh_pool_layout),
                                  .memory = KVH_MEMORY_HOST,
                                  .num_slots = 4,
                                  .k_base = x->kbase,
                                  .v_base = x->vbase,
                                  .slot_stride = BT * TOK,
                                  .token_stride = TOK,
                                  .head_stride = D * 4};
    assert_ok(kvh_pool_register(x->e, &x->layout, &x->pool));
    return x;
}

/* The fixture's data is exactly as made. */
static void check_fixture(fixture *x)
{
    assert_int_equal(tu_seq_len(x->e, x->s), 10);
    assert_int_equal(tu_seq_len(x->e, x->s2), 0);
    int32_t got[10];
    assert_ok(kvh_seq_tokens(x->e, x->s, 0, 10, got));
    assert_memory_equal(got, x->toks, sizeof(got));
    assert_true(tu_check_pattern(x->e, x->s, L, TOK, 1, 0, 10));
    kvh_block_info bi = tu_binfo(x->e, x->b);
    assert_int_equal(bi.refs, 1);
    assert_int_equal(bi.pins, 0);
    for (int i = 0; i < 3; i++) {
        bi = tu_binfo(x->e, x->sb[i]);
        assert_int_equal(bi.refs, 1);
        assert_int_equal(bi.holds, 0);
        assert_int_equal(bi.pins, 0);
    }
    int32_t done = 0;
    assert_ok(kvh_fence_poll(x->e, x->f, &done));
    assert_int_equal(done, 1);
}

/* A full round trip on a fresh sequence. */
static void round_trip(kvh_engine *e)
{
    kvh_seq s = tu_seq_new(e, 5);
    int32_t t[7];
    tu_iota(t, 7, 9000);
    assert_ok(kvh_seq_append(e, s, t, 7));
    tu_write_pattern(e, s, L, TOK, 99, 0, 7);
    assert_true(tu_check_pattern(e, s, L, TOK, 99, 0, 7));
    kvh_seq c;
    assert_ok(kvh_seq_fork(e, s, 6, &c));
    assert_ok(kvh_seq_acquire(e, c, 0, 7, NULL));
    assert_ok(kvh_seq_release(e, c, 0, 7));
    assert_ok(kvh_seq_free(e, c));
    assert_ok(kvh_seq_free(e, s));
}

#define EXPECT_INVALID(call)                                                                                           \
    do {                                                                                                               \
        assert_kvh(KVH_ERR_INVALID_ARG, call);                                                                         \
        if (kvh_last_error()[0] == '\0') {                                                                             \
            print_error("%s: no detail in kvh_last_error()\n", #call);                                                 \
            fail();                                                                                                    \
        }                                                                                                              \
    } while (0)

static void test_null_pointers(void **state)
{
    (void)state;
    fixture *x = make_fixture();
    kvh_engine *e = x->e;
    kvh_seq s = x->s, out_seq = {0x55};
    kvh_block blk = {0x66};
    kvh_fence fence = {0x77};
    kvh_pool pool = {0x88};
    uint8_t k[10 * 32], v[10 * 32];
    int32_t toks[16] = {0};
    uint64_t u64 = 0x99;
    size_t sz = 0x99;
    int32_t i32 = 0x99;
    kvh_config cfg;
    assert_ok(kvh_config_init(&cfg, sizeof(cfg)));
    cfg.backend = KVH_BACKEND_CPU;
    cfg.device_bytes = 1 << 20;
    cfg.host_bytes = 0;
    kvh_tier_info ti = {.struct_size = sizeof(ti)};
    kvh_stats st = {.struct_size = sizeof(st)};
    kvh_block_info bi = {.struct_size = sizeof(bi)};
    int32_t indptr[2], indices[8], lpl[1];

    /* config and engine */
    EXPECT_INVALID(kvh_config_init(NULL, sizeof(kvh_config)));
    EXPECT_INVALID(kvh_engine_open(NULL, &(kvh_engine *){NULL}));
    EXPECT_INVALID(kvh_engine_open(&cfg, NULL));
    assert_ok(kvh_engine_close(NULL));
    EXPECT_INVALID(kvh_engine_block_bytes(NULL, &u64));
    EXPECT_INVALID(kvh_engine_block_bytes(e, NULL));
    assert_null(kvh_engine_backend(NULL));
    EXPECT_INVALID(kvh_tier_info_get(NULL, 0, &ti));
    EXPECT_INVALID(kvh_tier_info_get(e, 0, NULL));
    EXPECT_INVALID(kvh_engine_stats(NULL, &st));
    EXPECT_INVALID(kvh_engine_stats(e, NULL));
    EXPECT_INVALID(kvh_agent_set_quota(NULL, 1, 100));
    /* sequences */
    EXPECT_INVALID(kvh_seq_create(NULL, 0, &out_seq));
    EXPECT_INVALID(kvh_seq_create(e, 0, NULL));
    EXPECT_INVALID(kvh_seq_free(NULL, s));
    EXPECT_INVALID(kvh_seq_free(NULL, (kvh_seq){0}));
    EXPECT_INVALID(kvh_seq_fork(NULL, s, 0, &out_seq));
    EXPECT_INVALID(kvh_seq_fork(e, s, 0, NULL));
    EXPECT_INVALID(kvh_seq_append(NULL, s, toks, 1));
    EXPECT_INVALID(kvh_seq_append(e, s, NULL, 1));
    EXPECT_INVALID(kvh_seq_length(NULL, s, &u64));
    EXPECT_INVALID(kvh_seq_length(e, s, NULL));
    EXPECT_INVALID(kvh_seq_tokens(NULL, s, 0, 1, toks));
    EXPECT_INVALID(kvh_seq_tokens(e, s, 0, 1, NULL));
    EXPECT_INVALID(kvh_seq_write_kv(NULL, s, 0, 0, 1, k, v));
    EXPECT_INVALID(kvh_seq_write_kv(e, s, 0, 0, 1, NULL, v));
    EXPECT_INVALID(kvh_seq_write_kv(e, s, 0, 0, 1, k, NULL));
    EXPECT_INVALID(kvh_seq_read_kv(NULL, s, 0, 0, 1, k, v));
    EXPECT_INVALID(kvh_seq_truncate(NULL, s, 0));
    EXPECT_INVALID(kvh_seq_match_prefix(NULL, x->s2, toks, 4, &sz));
    EXPECT_INVALID(kvh_seq_match_prefix(e, x->s2, NULL, 4, &sz));
    EXPECT_INVALID(kvh_seq_match_prefix(e, x->s2, toks, 4, NULL));
    EXPECT_INVALID(kvh_seq_acquire(NULL, s, 0, 1, &fence));
    EXPECT_INVALID(kvh_seq_release(NULL, s, 0, 1));
    EXPECT_INVALID(kvh_seq_pin(NULL, s, 0, 1, 1));
    EXPECT_INVALID(kvh_seq_blocks(NULL, s, 0, 1, &blk));
    EXPECT_INVALID(kvh_seq_blocks(e, s, 0, 1, NULL));
    EXPECT_INVALID(kvh_block_table(NULL, &s, 1, indptr, indices, 8, lpl));
    EXPECT_INVALID(kvh_block_table(e, NULL, 1, indptr, indices, 8, lpl));
    EXPECT_INVALID(kvh_block_table(e, &s, 1, NULL, indices, 8, lpl));
    EXPECT_INVALID(kvh_block_table(e, &s, 1, indptr, NULL, 8, lpl));
    EXPECT_INVALID(kvh_block_table(e, &s, 1, indptr, indices, 8, NULL));
    /* blocks */
    EXPECT_INVALID(kvh_block_info_get(NULL, x->b, &bi));
    EXPECT_INVALID(kvh_block_info_get(e, x->b, NULL));
    EXPECT_INVALID(kvh_block_alloc(NULL, 0, &blk));
    EXPECT_INVALID(kvh_block_alloc(e, 0, NULL));
    EXPECT_INVALID(kvh_block_retain(NULL, x->b));
    EXPECT_INVALID(kvh_block_release(NULL, x->b));
    EXPECT_INVALID(kvh_block_release(NULL, (kvh_block){0}));
    EXPECT_INVALID(kvh_block_pin(NULL, x->b, 1));
    /* migration, prefetch, fences */
    EXPECT_INVALID(kvh_migrate(NULL, &x->b, 1, KVH_TIER_HOST, &fence));
    EXPECT_INVALID(kvh_migrate(e, NULL, 1, KVH_TIER_HOST, &fence));
    EXPECT_INVALID(kvh_seq_migrate(NULL, s, 0, 1, KVH_TIER_HOST, &fence));
    EXPECT_INVALID(kvh_prefetch(NULL, s, 0, 1, 0, &fence));
    EXPECT_INVALID(kvh_fence_wait(NULL, x->f, 0));
    EXPECT_INVALID(kvh_fence_poll(NULL, x->f, &i32));
    EXPECT_INVALID(kvh_fence_poll(e, x->f, NULL));
    EXPECT_INVALID(kvh_fence_free(NULL, x->f));
    EXPECT_INVALID(kvh_fence_free(NULL, (kvh_fence){0}));
    /* prefix index and pools */
    EXPECT_INVALID(kvh_prefix_hash(NULL, 0, toks, BT, &u64));
    EXPECT_INVALID(kvh_prefix_hash(e, 0, NULL, BT, &u64));
    EXPECT_INVALID(kvh_prefix_hash(e, 0, toks, BT, NULL));
    EXPECT_INVALID(kvh_prefix_lookup(NULL, toks, 4, &blk, 1, &sz));
    EXPECT_INVALID(kvh_prefix_lookup(e, NULL, 4, &blk, 1, &sz));
    EXPECT_INVALID(kvh_prefix_lookup(e, toks, 4, NULL, 1, &sz));
    EXPECT_INVALID(kvh_prefix_lookup(e, toks, 4, &blk, 1, NULL));
    EXPECT_INVALID(kvh_pool_register(NULL, &x->layout, &pool));
    EXPECT_INVALID(kvh_pool_register(e, NULL, &pool));
    EXPECT_INVALID(kvh_pool_register(e, &x->layout, NULL));
    EXPECT_INVALID(kvh_pool_unregister(NULL, x->pool));
    EXPECT_INVALID(kvh_pool_unregister(NULL, (kvh_pool){0}));
    EXPECT_INVALID(kvh_pool_offload(NULL, x->pool, 0, 0, toks, BT, 0, &blk));
    EXPECT_INVALID(kvh_pool_offload(e, x->pool, 0, 0, NULL, BT, 0, &blk));
    EXPECT_INVALID(kvh_pool_offload(e, x->pool, 0, 0, toks, BT, 0, NULL));
    EXPECT_INVALID(kvh_pool_restore(NULL, x->pool, x->sb[0], 0));

    /* Out-parameters untouched by all of that. */
    assert_int_equal(out_seq.id, 0x55);
    assert_int_equal(blk.id, 0x66);
    assert_int_equal(fence.id, 0x77);
    assert_int_equal(pool.id, 0x88);
    assert_int_equal(u64, 0x99);
    assert_int_equal(sz, 0x99);
    assert_int_equal(i32, 0x99);

    /* NULL where the header allows it. */
    assert_ok(kvh_seq_append(e, x->s2, NULL, 0));
    assert_ok(kvh_seq_tokens(e, s, 0, 0, NULL));
    assert_ok(kvh_seq_write_kv(e, s, 0, 0, 0, NULL, NULL));
    assert_ok(kvh_seq_read_kv(e, s, 0, 0, 3, NULL, NULL)); /* both skipped */
    assert_ok(kvh_seq_read_kv(e, s, 1, 0, 3, k, NULL));
    assert_ok(kvh_seq_read_kv(e, s, 1, 0, 3, NULL, v));
    assert_ok(kvh_seq_match_prefix(e, x->s2, NULL, 0, &sz));
    assert_int_equal(sz, 0);
    assert_ok(kvh_seq_blocks(e, s, 0, 0, NULL));
    assert_ok(kvh_migrate(e, NULL, 0, KVH_TIER_HOST, NULL));
    assert_ok(kvh_seq_migrate(e, s, 0, 10, KVH_TIER_DEVICE, NULL));
    assert_ok(kvh_prefetch(e, s, 0, 10, 0, NULL));
    assert_ok(kvh_seq_acquire(e, s, 0, 10, NULL));
    assert_ok(kvh_seq_release(e, s, 0, 10));
    assert_ok(kvh_prefix_lookup(e, NULL, 0, NULL, 0, &sz));
    assert_int_equal(sz, 0);
    assert_ok(kvh_block_table(e, NULL, 0, indptr, NULL, 0, lpl));
    check_fixture(x);
    round_trip(e);
}

/* Entry points whose subsystems may not be built yet: checked when they
 * answer a valid call. */
static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st, (void)flag, (void)ftw;
    return remove(path);
}

static void test_null_pointers_optional_api(void **state)
{
    (void)state;
    int checked = 0;
    kvh_attention_params ap;
    if (kvh_attention_params_init(&ap, sizeof(ap)) == KVH_OK) {
        checked++;
        fixture *x = make_fixture();
        float q[H * D], out[H * D];
        uint32_t ql = 1;
        EXPECT_INVALID(kvh_attention_params_init(NULL, sizeof(ap)));
        assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_attention_params_init(&ap, sizeof(ap) + 8));
        EXPECT_INVALID(kvh_attention_decode(NULL, 0, &x->s, 1, q, out, NULL));
        EXPECT_INVALID(kvh_attention_decode(x->e, 0, NULL, 1, q, out, NULL));
        EXPECT_INVALID(kvh_attention_decode(x->e, 0, &x->s, 1, NULL, out, NULL));
        EXPECT_INVALID(kvh_attention_decode(x->e, 0, &x->s, 1, q, NULL, NULL));
        EXPECT_INVALID(kvh_attention_prefill(NULL, 0, &x->s, &ql, 1, q, out, NULL));
        EXPECT_INVALID(kvh_attention_prefill(x->e, 0, NULL, &ql, 1, q, out, NULL));
        EXPECT_INVALID(kvh_attention_prefill(x->e, 0, &x->s, NULL, 1, q, out, NULL));
        EXPECT_INVALID(kvh_attention_prefill(x->e, 0, &x->s, &ql, 1, NULL, out, NULL));
        EXPECT_INVALID(kvh_attention_prefill(x->e, 0, &x->s, &ql, 1, q, NULL, NULL));
        ap.struct_size = sizeof(ap) + 8;
        assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_attention_decode(x->e, 0, &x->s, 1, q, out, &ap));
        check_fixture(x);
    }
    /* kvh_seq_persist: only with a disk tier. Its store goes in the
     * test's scratch directory, or, run on its own, in a directory of
     * its own under /tmp that is removed afterwards. */
    const char *dir = getenv("KVH_TEST_TMPDIR");
    char own[64] = "/tmp/kvh-bad-input-XXXXXX", path[512];
    bool made = !(dir && *dir);
    if (made)
        assert_non_null(dir = mkdtemp(own));
    snprintf(path, sizeof(path), "%s/bad_input_disk", dir);
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F32, 4, 4, 0);
    c.disk_path = path;
    c.disk_bytes = 1 << 20;
    kvh_engine *e = NULL;
    if (kvh_engine_open(&c, &e) == KVH_OK) {
        checked++;
        tu_track_engine(e);
        kvh_seq s = tu_seq_new(e, 0);
        EXPECT_INVALID(kvh_seq_persist(NULL, s));
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_persist(e, (kvh_seq){0x5A00000100000000ull | 999}));
        assert_ok(kvh_seq_free(e, s));
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_persist(e, s));
        assert_ok(tu_close(e));
    }
    if (made)
        assert_int_equal(nftw(own, remove_entry, 16, FTW_DEPTH | FTW_PHYS), 0);
    if (!checked)
        skip();
}

/* ---- random, stale and forged handles ---- */

static uint64_t make_handle(tu_rng *r, uint8_t tag, const uint64_t *live, size_t n_live, const uint64_t *other,
                            size_t n_other)
{
    for (;;) {
        uint64_t h;
        switch (tu_below(r, 5)) {
        case 0: /* anything */
            h = tu_next(r);
            break;
        case 1: /* right tag, small index, random generation */
            h = ((uint64_t)tag << 56) | ((tu_next(r) & 0xFFFFFFull) << 32) | tu_below(r, 80);
            break;
        case 2: /* right tag and index of a live handle, other generation */
            h = live[tu_below(r, n_live)] ^ ((1 + tu_below(r, 0xFFFFFE)) << 32);
            break;
        case 3: /* a live handle of another type */
            h = other[tu_below(r, n_other)];
            break;
        default: /* right tag, huge index */
            h = ((uint64_t)tag << 56) | ((tu_next(r) & 0xFFFFFFull) << 32) | (0x80000000u | (uint32_t)tu_next(r));
        }
        if (h == 0)
            continue;
        int clash = 0;
        for (size_t i = 0; i < n_live; i++)
            clash |= h == live[i];
        if (!clash)
            return h;
    }
}

static void test_random_handles(void **state)
{
    (void)state;
    uint64_t seed = tu_seed(0xbad4a17d1e5ull);
    tu_rng r = {seed};
    fixture *x = make_fixture();
    kvh_engine *e = x->e;
    uint64_t seqs[] = {x->s.id, x->s2.id};
    uint64_t blocks[] = {x->b.id, x->sb[0].id, x->sb[1].id, x->sb[2].id};
    uint64_t fences[] = {x->f.id};
    uint64_t pools[] = {x->pool.id};
    uint64_t others[] = {x->s.id, x->s2.id, x->b.id, x->sb[0].id, x->f.id, x->pool.id};
    kvh_stats before = tu_stats(e);
    forged_targets t = {.engine = e,
                        .seq = x->s,
                        .block = x->b,
                        .slot_block = x->sb[0],
                        .pool = x->pool,
                        .heads = H,
                        .head_dim = D,
                        .block_tokens = BT};
    const struct {
        const uint64_t *live;
        size_t n;
    } live_of[] = {[FORGED_SEQ] = {seqs, 2},
                   [FORGED_BLOCK] = {blocks, 4},
                   [FORGED_FENCE] = {fences, 1},
                   [FORGED_POOL] = {pools, 1}};
    for (int i = 0; i < 100000; i++) {
        int fn = i % forged_call_count();
        forged_kind kind = forged_call_kind(fn);
        uint64_t h = make_handle(&r, forged_kind_tag(kind), live_of[kind].live, live_of[kind].n, others, 6);
        kvh_status st = forged_call(&t, fn, h, (uint64_t)i);
        if (st != KVH_ERR_BAD_HANDLE) {
            print_error("iteration %d (function %d, seed 0x%" PRIx64 "): %s, expected KVH_ERR_BAD_HANDLE\n", i, fn,
                        seed, kvh_status_name(st));
            fail();
        }
        if (i % 1000 == 0)
            assert_true(kvh_last_error()[0] != '\0');
    }
    /* Nothing happened to anything. */
    kvh_stats after = tu_stats(e);
    assert_int_equal(after.blocks_allocated, before.blocks_allocated);
    assert_int_equal(after.blocks_freed, before.blocks_freed);
    assert_int_equal(after.lookups, before.lookups);
    check_fixture(x);
    round_trip(e);
}

/* ---- freed handles ---- */

static void test_freed_handles(void **state)
{
    (void)state;
    fixture *x = make_fixture();
    kvh_engine *e = x->e;
    kvh_seq s;
    assert_ok(kvh_seq_fork(e, x->s, 3, &s));
    kvh_block sb0 = tu_seq_block(e, s, 0);
    assert_ok(kvh_seq_free(e, s));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_free(e, s)); /* double free */
    uint8_t k[32], v[32];
    int32_t t[4] = {1, 2, 3, 4};
    uint64_t u64;
    size_t sz;
    kvh_seq child;
    kvh_block blk;
    kvh_fence f;
    int32_t indptr[2], idx[4], lpl[1];
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_fork(e, s, 0, &child));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_append(e, s, t, 1));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_length(e, s, &u64));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_tokens(e, s, 0, 1, t));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_write_kv(e, s, 0, 0, 1, k, v));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_read_kv(e, s, 0, 0, 1, k, v));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_truncate(e, s, 0));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_match_prefix(e, s, t, 4, &sz));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_acquire(e, s, 0, 1, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_release(e, s, 0, 1));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_pin(e, s, 0, 1, 1));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_blocks(e, s, 0, 1, &blk));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_migrate(e, s, 0, 1, KVH_TIER_HOST, &f));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_prefetch(e, s, 0, 1, 0, &f));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_table(e, &s, 1, indptr, idx, 4, lpl));
    /* The forked blocks were shared: still alive through x->s. */
    assert_int_equal(sb0.id, x->sb[0].id);
    /* A new sequence reuses the slot under a new generation. */
    kvh_seq s3 = tu_seq_new(e, 0);
    assert_true(s3.id != s.id);
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_length(e, s, &u64));
    assert_ok(kvh_seq_length(e, s3, &u64));

    /* A freed block. */
    kvh_block b;
    assert_ok(kvh_block_alloc(e, 0, &b));
    assert_ok(kvh_block_release(e, b));
    kvh_block_info bi = {.struct_size = sizeof(bi)};
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_info_get(e, b, &bi));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_release(e, b));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_retain(e, b));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_pin(e, b, 1));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_migrate(e, &b, 1, KVH_TIER_HOST, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_restore(e, x->pool, b, 0));
    /* Releasing below zero: a cached block has no caller reference. */
    kvh_seq p = tu_seq_new(e, 0);
    assert_ok(kvh_seq_append(e, p, t, 4));
    tu_write_pattern(e, p, L, TOK, 3, 0, 4);
    kvh_block pb = tu_seq_block(e, p, 0);
    assert_ok(kvh_seq_free(e, p));
    assert_int_equal(tu_binfo(e, pb).refs, 0);
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_block_release(e, pb));
    assert_ok(kvh_block_retain(e, pb));
    assert_ok(kvh_block_release(e, pb));

    /* A freed fence. */
    assert_ok(kvh_fence_free(e, x->f));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_free(e, x->f));
    int32_t done;
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_poll(e, x->f, &done));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_wait(e, x->f, UINT64_MAX));
    /* An unregistered pool. */
    assert_ok(kvh_pool_unregister(e, x->pool));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_unregister(e, x->pool));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_offload(e, x->pool, 0, 0, t, BT, 0, &blk));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_restore(e, x->pool, x->sb[0], 0));
    /* Handles of one engine are not valid in another. */
    kvh_engine *e2 = tu_open(L, H, D, BT, KVH_DTYPE_F32, 4, 4, 0);
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_length(e2, x->s, &u64));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_info_get(e2, x->sb[0], &bi));
    round_trip(e);
    round_trip(e2);
}

/* ---- struct sizes ---- */

static kvh_status null_seq_free(kvh_engine *e) { return kvh_seq_free(e, (kvh_seq){0}); }
static kvh_status null_block_release(kvh_engine *e) { return kvh_block_release(e, (kvh_block){0}); }
static kvh_status null_fence_free(kvh_engine *e) { return kvh_fence_free(e, (kvh_fence){0}); }
static kvh_status null_pool_unregister(kvh_engine *e) { return kvh_pool_unregister(e, (kvh_pool){0}); }
static kvh_status null_context_destroy(kvh_engine *e) { return kvh_context_destroy(e, (kvh_context){0}); }

/* The null handle is accepted by the free and release calls, and such a
 * call succeeds like any other: the thread's error detail of an earlier
 * failure is cleared (kvh_context_destroy always did). */
static void test_null_handle_success_clears_error(void **state)
{
    (void)state;
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F32, 4, 4, 0);
    kvh_status (*const calls[])(kvh_engine *) = {null_seq_free, null_block_release, null_fence_free,
                                                 null_pool_unregister, null_context_destroy};
    for (size_t i = 0; i < sizeof(calls) / sizeof(calls[0]); i++) {
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_release(e, (kvh_block){0x1234}));
        assert_true(kvh_last_error()[0] != '\0');
        assert_ok(calls[i](e));
        if (kvh_last_error()[0] != '\0')
            fail_msg("null-handle call %zu left the error \"%s\"", i, kvh_last_error());
    }
}

static void test_wrong_struct_sizes(void **state)
{
    (void)state;
    fixture *x = make_fixture();
    kvh_engine *e = x->e;
    kvh_config c;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_config_init(&c, sizeof(c) + 4));
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_config_init(&c, 0));
    assert_ok(kvh_config_init(&c, sizeof(c)));
    c.backend = KVH_BACKEND_CPU;
    c.struct_size = sizeof(c) + 16;
    kvh_engine *ne = NULL;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_engine_open(&c, &ne));
    c.struct_size = 0;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_engine_open(&c, &ne));
    assert_null(ne);

    kvh_tier_info ti;
    memset(&ti, 0x11, sizeof(ti));
    ti.struct_size = sizeof(ti) + 8;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_tier_info_get(e, 0, &ti));
    ti.struct_size = 0;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_tier_info_get(e, 0, &ti));
    assert_int_equal(ti.capacity_blocks, 0x1111111111111111ull);

    kvh_stats st;
    memset(&st, 0x22, sizeof(st));
    st.struct_size = sizeof(st) + 8;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_engine_stats(e, &st));
    st.struct_size = 4;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_engine_stats(e, &st));
    assert_int_equal(st.lookups, 0x2222222222222222ull);

    kvh_block_info bi;
    memset(&bi, 0x33, sizeof(bi));
    bi.struct_size = sizeof(bi) + 8;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_block_info_get(e, x->b, &bi));
    bi.struct_size = 0;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_block_info_get(e, x->b, &bi));
    assert_int_equal(bi.refs, 0x33333333u);

    kvh_pool_layout lay = x->layout;
    kvh_pool p = {0x44};
    lay.struct_size = sizeof(lay) + 8;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_pool_register(e, &lay, &p));
    /* The message names the one size taken, not a range it is in. */
    char want[64];
    snprintf(want, sizeof(want), "takes only %zu", sizeof(lay));
    assert_non_null(strstr(kvh_last_error(), want));
    bi.struct_size = sizeof(bi) + 8;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_block_info_get(e, x->b, &bi));
    assert_non_null(strstr(kvh_last_error(), "up to it"));
    lay.struct_size = 0;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_pool_register(e, &lay, &p));
    assert_int_equal(p.id, 0x44);
    check_fixture(x);
    round_trip(e);
}

/* ---- out-of-range numbers ---- */

static void test_bad_numbers(void **state)
{
    (void)state;
    fixture *x = make_fixture();
    kvh_engine *e = x->e;
    uint8_t k[32], v[32];
    kvh_tier_info ti = {.struct_size = sizeof(ti)};
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_tier_info_get(e, KVH_TIER_COUNT, &ti));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_read_kv(e, x->s, L, 0, 1, k, v));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_write_kv(e, x->s, UINT32_MAX, 0, 1, k, v));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_read_kv(e, x->s, 0, 5, SIZE_MAX, k, v));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_write_kv(e, x->s, 0, 5, SIZE_MAX - 2, k, v));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_acquire(e, x->s, UINT64_MAX, 2, NULL));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_release(e, x->s, 3, UINT64_MAX));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_pin(e, x->s, 9, 2, 1));
    assert_kvh(KVH_ERR_RANGE, kvh_prefetch(e, x->s, 11, 0, 0, NULL));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_migrate(e, x->s, 0, 11, KVH_TIER_HOST, NULL));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_truncate(e, x->s, UINT64_MAX));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_blocks(e, x->s, UINT64_MAX, 1, &(kvh_block){0}));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_migrate(e, x->s, 0, 1, 99, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_migrate(e, &x->b, 1, 99, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_prefix_hash(e, 0, (int32_t[8]){0}, 0, &(uint64_t){0}));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_block_pin(e, x->b, 0));      /* not pinned */
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_release(e, x->s, 0, 1)); /* not acquired */
    check_fixture(x);
    round_trip(e);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_null_pointers, tu_teardown),
        cmocka_unit_test_teardown(test_null_pointers_optional_api, tu_teardown),
        cmocka_unit_test_teardown(test_random_handles, tu_teardown),
        cmocka_unit_test_teardown(test_freed_handles, tu_teardown),
        cmocka_unit_test_teardown(test_null_handle_success_clears_error, tu_teardown),
        cmocka_unit_test_teardown(test_wrong_struct_sizes, tu_teardown),
        cmocka_unit_test_teardown(test_bad_numbers, tu_teardown),
    };
    return cmocka_run_group_tests_name("bad_input", tests, NULL, NULL);
}
