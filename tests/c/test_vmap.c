/* Virtual contiguity (core/vmap.c, abi/api_vmap_attention.c): a view shows
 * a sequence's layer as contiguous K and V arrays equal to what
 * kvh_seq_read_kv returns; decode attention over views equals the paged
 * call bit for bit; appends, copy-on-write and truncation make a view
 * stale until a refresh remaps what changed; a large capacity costs
 * address space, not memory; migration works around views; unsupported
 * setups are refused; a released, forged or foreign view (or a plan passed
 * as one) is KVH_ERR_BAD_HANDLE, and no view value is handed out twice. */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <unistd.h>

#include "test_util.h"
#include "core/handles.h"
#include "kernels/cpu/attn_cpu.h"

enum { L = 2, H = 2, D = 64, BT = 16 }; /* f32: one head's K of a block = 4 KiB */

static kvh_engine *open_vmap(uint64_t dev_blocks, uint64_t host_blocks)
{
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F32, dev_blocks, host_blocks, 1);
    c.vmap = 1;
    return tu_open_cfg(&c);
}

static float val(uint32_t layer, uint64_t t, uint32_t h, int kv, uint32_t d, uint32_t salt)
{
    tu_rng r = {((uint64_t)layer << 40) ^ (t << 16) ^ ((uint64_t)h << 8) ^ ((uint64_t)kv << 4) ^ d ^
                ((uint64_t)salt << 56)};
    return (float)((int64_t)(tu_next(&r) % 2001) - 1000) / 500.0f;
}

static void write_tokens(kvh_engine *e, kvh_seq s, uint64_t pos, size_t n, uint32_t salt)
{
    float *k = tu_alloc(sizeof(float) * n * H * D), *v = tu_alloc(sizeof(float) * n * H * D);
    for (uint32_t l = 0; l < L; l++) {
        for (size_t t = 0; t < n; t++)
            for (uint32_t h = 0; h < H; h++)
                for (uint32_t d = 0; d < D; d++) {
                    k[(t * H + h) * D + d] = val(l, pos + t, h, 0, d, salt);
                    v[(t * H + h) * D + d] = val(l, pos + t, h, 1, d, salt);
                }
        assert_ok(kvh_seq_write_kv(e, s, l, pos, n, k, v));
    }
    tu_free(k);
    tu_free(v);
}

static kvh_seq new_seq(kvh_engine *e, size_t n)
{
    kvh_seq s = tu_seq_new(e, 0);
    int32_t *tok = tu_alloc(sizeof(int32_t) * n);
    tu_iota(tok, n, 1);
    assert_ok(kvh_seq_append(e, s, tok, n));
    tu_free(tok);
    write_tokens(e, s, 0, n, 0);
    return s;
}

/* The view's contents equal kvh_seq_read_kv of its layer. */
static void check_view(kvh_engine *e, kvh_seq s, kvh_vmap *m)
{
    kvh_vmap_view v = tu_vmap_view(e, m);
    uint64_t n = tu_seq_len(e, s);
    assert_int_equal(v.n_tokens, n);
    float *k = tu_alloc(sizeof(float) * n * H * D), *vv = tu_alloc(sizeof(float) * n * H * D);
    assert_ok(kvh_seq_read_kv(e, s, v.layer, 0, n, k, vv));
    for (uint32_t h = 0; h < H; h++) {
        const float *vk = (const float *)((const uint8_t *)v.k + h * v.head_stride);
        const float *vvv = (const float *)((const uint8_t *)v.v + h * v.head_stride);
        for (uint64_t t = 0; t < n; t++) {
            assert_memory_equal(vk + t * D, k + (t * H + h) * D, sizeof(float) * D);
            assert_memory_equal(vvv + t * D, vv + (t * H + h) * D, sizeof(float) * D);
        }
    }
    tu_free(k);
    tu_free(vv);
}

/* Paged and view decode of one sequence, compared bit for bit. */
static void check_attention(kvh_engine *e, kvh_seq s, kvh_vmap *m, uint32_t layer, uint32_t q_heads, uint32_t threads)
{
    kvh_attention_params p;
    assert_ok(kvh_attention_params_init(&p, sizeof(p)));
    p.num_q_heads = q_heads;
    p.threads = threads;
    float q[8 * D], a[8 * D], b[8 * D];
    for (uint32_t i = 0; i < q_heads * D; i++)
        q[i] = val(9, i, 0, 0, 0, 3);
    memset(a, 0xff, sizeof(a));
    memset(b, 0x7f, sizeof(b));
    assert_ok(kvh_attention_decode(e, layer, &s, 1, q, a, &p));
    assert_ok(kvh_attention_decode_vmap(e, &m, 1, q, b, &p));
    assert_memory_equal(a, b, sizeof(float) * q_heads * D);
    /* prefill of the last 1, 5 and 21 tokens */
    static float pq[21 * 8 * D], pa[21 * 8 * D], pb[21 * 8 * D];
    for (uint32_t i = 0; i < 21 * q_heads * D; i++)
        pq[i] = val(8, i, 1, 0, 0, 3);
    uint64_t len = tu_seq_len(e, s);
    for (uint32_t n = 1; n <= 21 && n <= len; n += n < 5 ? 4 : 16) {
        memset(pb, 0x7f, sizeof(pb));
        assert_ok(kvh_attention_prefill(e, layer, &s, &n, 1, pq, pa, &p));
        assert_ok(kvh_attention_prefill_vmap(e, &m, &n, 1, pq, pb, &p));
        assert_memory_equal(pa, pb, sizeof(float) * n * q_heads * D);
    }
}

static void test_view_equals_paged(void **state)
{
    kvh_engine *e = open_vmap(32, 0);
    kvh_seq s = new_seq(e, 100);
    kvh_vmap *m = NULL;
    assert_ok(kvh_seq_vmap(e, s, 1, 0, &m));
    kvh_vmap_view v = tu_vmap_view(e, m);
    assert_int_equal(v.capacity_tokens, 128);
    assert_int_equal(v.head_stride, 128 * D * sizeof(float));
    assert_true((const uint8_t *)v.v == (const uint8_t *)v.k + H * v.head_stride);
    check_view(e, s, m);
    /* A write into the last (partial, private) block shows through at
     * once: the same pages. */
    int32_t changed = -1;
    write_tokens(e, s, 97, 2, 7);
    check_view(e, s, m);
    assert_ok(kvh_vmap_refresh(e, m, &changed));
    assert_int_equal(changed, 0);
    /* A full block is published (immutable): writing into it copies it,
     * which the view sees after a refresh. */
    write_tokens(e, s, 40, 3, 7);
    assert_ok(kvh_vmap_refresh(e, m, &changed));
    assert_int_equal(changed, 1);
    check_view(e, s, m);
    /* Every kernel this CPU runs, GQA ratios 1..4, one and two threads. */
    for (int impl = KVHI_ATTN_REFERENCE; impl <= KVHI_ATTN_AVX512; impl++) {
        if (!kvhi_attn_cpu_supported(impl))
            continue;
        assert_ok(kvhi_attention_set_impl(e, impl));
        for (uint32_t qh = 2; qh <= 8; qh *= 2)
            for (uint32_t th = 1; th <= 2; th++)
                check_attention(e, s, m, 1, qh, th);
    }
    assert_ok(kvh_vmap_release(e, m));
    assert_ok(kvh_vmap_release(e, NULL));
}

/* The paged calls and the view calls with the same params: the view calls
 * return what kvh_attention_decode / _prefill return and, when refused,
 * write nothing. want: the paged calls' status, or -1 to take theirs. */
static void params_as_paged(kvh_engine *e, kvh_seq s, kvh_vmap *m, const kvh_attention_params *p, int want)
{
    static float q[8 * D], out[8 * D], untouched[8 * D];
    uint32_t one = 1;
    kvh_status paged = kvh_attention_decode(e, 0, &s, 1, q, out, p);
    if (want >= 0)
        assert_int_equal(paged, want);
    assert_kvh(paged, kvh_attention_prefill(e, 0, &s, &one, 1, q, out, p));
    memset(out, 0x5a, sizeof(out));
    memset(untouched, 0x5a, sizeof(untouched));
    assert_kvh(paged, kvh_attention_decode_vmap(e, &m, 1, q, out, p));
    assert_kvh(paged, kvh_attention_prefill_vmap(e, &m, &one, 1, q, out, p));
    if (paged != KVH_OK)
        assert_memory_equal(out, untouched, sizeof(out));
}

/* kvh.h: the view calls take params as kvh_attention_decode does, so they
 * refuse every params value it refuses, with the same status. */
static void test_params_refused_as_paged(void **state)
{
    (void)state;
    kvh_engine *e = open_vmap(32, 0);
    kvh_seq s = new_seq(e, 40);
    kvh_vmap *m = NULL;
    assert_ok(kvh_seq_vmap(e, s, 0, 0, &m));
    kvh_attention_params p;
    assert_ok(kvh_attention_params_init(&p, sizeof(p)));
    params_as_paged(e, s, m, &p, KVH_OK);

    const uint32_t bad_io[] = {3, 4, 0x80000000u, UINT32_MAX};
    for (size_t i = 0; i < sizeof(bad_io) / sizeof(bad_io[0]); i++) {
        assert_ok(kvh_attention_params_init(&p, sizeof(p)));
        p.io_dtype = bad_io[i];
        params_as_paged(e, s, m, &p, KVH_ERR_INVALID_ARG);
    }
    const float bad_scale[] = {NAN, -NAN, INFINITY, -INFINITY};
    for (size_t i = 0; i < sizeof(bad_scale) / sizeof(bad_scale[0]); i++) {
        assert_ok(kvh_attention_params_init(&p, sizeof(p)));
        p.scale = bad_scale[i];
        params_as_paged(e, s, m, &p, KVH_ERR_INVALID_ARG);
    }
    /* not a multiple of num_kv_heads (2), or above the kernels' limit */
    const uint32_t bad_qh[] = {1, 3, 5, 1u << 20, 0x80000000u, UINT32_MAX};
    for (size_t i = 0; i < sizeof(bad_qh) / sizeof(bad_qh[0]); i++) {
        assert_ok(kvh_attention_params_init(&p, sizeof(p)));
        p.num_q_heads = bad_qh[i];
        params_as_paged(e, s, m, &p, KVH_ERR_INVALID_ARG);
    }
    const uint32_t bad_size[] = {0, 4, 12, 20, 41, sizeof(kvh_attention_params) + 8, 1u << 16, UINT32_MAX};
    for (size_t i = 0; i < sizeof(bad_size) / sizeof(bad_size[0]); i++) {
        assert_ok(kvh_attention_params_init(&p, sizeof(p)));
        p.struct_size = bad_size[i];
        params_as_paged(e, s, m, &p, KVH_ERR_STRUCT_SIZE);
    }
    /* A streaming window smaller than one chunk, or one without a chunk. */
    const uint32_t bad_stream[][2] = {{2, 1}, {0, 1}, {5, 4}, {UINT32_MAX, UINT32_MAX - 1}};
    for (size_t i = 0; i < sizeof(bad_stream) / sizeof(bad_stream[0]); i++) {
        assert_ok(kvh_attention_params_init(&p, sizeof(p)));
        p.stream_chunk_blocks = bad_stream[i][0];
        p.stream_window_blocks = bad_stream[i][1];
        params_as_paged(e, s, m, &p, KVH_ERR_INVALID_ARG);
    }
    /* A valid window: whatever the paged call says of it on this backend. */
    assert_ok(kvh_attention_params_init(&p, sizeof(p)));
    p.stream_chunk_blocks = 1;
    p.stream_window_blocks = 2;
    params_as_paged(e, s, m, &p, -1);
    assert_ok(kvh_vmap_release(e, m));
}

static void test_stale_and_refresh(void **state)
{
    kvh_engine *e = open_vmap(32, 0);
    kvh_seq s = new_seq(e, 30);
    kvh_vmap *m = NULL;
    assert_ok(kvh_seq_vmap(e, s, 0, 256, &m));
    uint64_t g0 = tu_vmap_view(e, m).generation;
    int32_t changed = -1;
    assert_ok(kvh_vmap_refresh(e, m, &changed));
    assert_int_equal(changed, 0);
    assert_int_equal(tu_vmap_view(e, m).generation, g0);

    /* Append into a new block: stale until refreshed. */
    int32_t tok[20];
    tu_iota(tok, 20, 500);
    assert_ok(kvh_seq_append(e, s, tok, 20));
    write_tokens(e, s, 30, 20, 1);
    float q[H * D], out[H * D];
    memset(q, 0, sizeof(q));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_attention_decode_vmap(e, &m, 1, q, out, NULL));
    assert_ok(kvh_vmap_refresh(e, m, &changed));
    assert_int_equal(changed, 1);
    assert_true(tu_vmap_view(e, m).generation > g0);
    check_view(e, s, m);
    check_attention(e, s, m, 0, H, 1);

    /* Copy-on-write: a fork shares the blocks; the parent's write into the
     * shared last block gives the parent a new block. */
    kvh_seq child;
    assert_ok(kvh_seq_fork(e, s, 0, &child));
    kvh_vmap *mc = NULL;
    assert_ok(kvh_seq_vmap(e, child, 0, 0, &mc));
    write_tokens(e, s, 49, 1, 5);
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_attention_decode_vmap(e, &m, 1, q, out, NULL));
    check_attention(e, child, mc, 0, H, 1); /* the child's view is still current */
    assert_ok(kvh_vmap_refresh(e, m, &changed));
    assert_int_equal(changed, 1);
    check_view(e, s, m);
    check_view(e, child, mc);
    check_attention(e, s, m, 0, H, 1);

    /* Truncation unmaps the blocks past the end; addresses taken before
     * read zeros there, never a fault (a binding's arrays keep them). */
    kvh_vmap_view before = tu_vmap_view(e, m);
    assert_ok(kvh_seq_truncate(e, s, 17));
    assert_ok(kvh_vmap_refresh(e, m, &changed));
    assert_int_equal(changed, 1);
    assert_int_equal(tu_vmap_view(e, m).n_tokens, 17);
    check_view(e, s, m);
    for (uint32_t h = 0; h < H; h++)
        for (uint64_t t = 2 * BT; t < before.n_tokens; t++) {
            const float *k = (const float *)((const uint8_t *)before.k + h * before.head_stride) + t * D;
            const float *v = (const float *)((const uint8_t *)before.v + h * before.head_stride) + t * D;
            for (uint32_t d = 0; d < D; d++)
                assert_true(k[d] == 0.0f && v[d] == 0.0f);
        }
    check_attention(e, s, m, 0, H, 1);

    /* Past the capacity: refused, the view stays as it was. */
    int32_t many[300];
    tu_iota(many, 300, 1000);
    assert_ok(kvh_seq_append(e, s, many, 300));
    assert_kvh(KVH_ERR_RANGE, kvh_vmap_refresh(e, m, &changed));
    assert_ok(kvh_seq_truncate(e, s, 17));
    assert_ok(kvh_vmap_refresh(e, m, NULL));
    check_view(e, s, m);

    /* A freed sequence: refresh fails, release still works. */
    assert_ok(kvh_vmap_release(e, mc));
    assert_ok(kvh_seq_free(e, child));
    assert_ok(kvh_seq_free(e, s));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_vmap_refresh(e, m, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_attention_decode_vmap(e, &m, 1, q, out, NULL));
    assert_ok(kvh_vmap_release(e, m));
}

static void test_views_and_migration(void **state)
{
    kvh_engine *e = open_vmap(16, 16);
    kvh_seq s = new_seq(e, 64);
    kvh_vmap *m = NULL;
    assert_ok(kvh_seq_vmap(e, s, 1, 0, &m));
    /* A view holds its blocks: a demotion request leaves them in place. */
    assert_ok(kvh_seq_migrate(e, s, 0, 64, KVH_TIER_HOST, NULL));
    assert_int_equal(tu_seq_binfo(e, s, 0).tier, KVH_TIER_DEVICE);
    assert_int_equal(tu_seq_binfo(e, s, 0).holds, 1);
    check_view(e, s, m);
    assert_ok(kvh_vmap_release(e, m));
    assert_int_equal(tu_seq_binfo(e, s, 0).holds, 0);
    /* Without a view they move; a new view needs them back. */
    assert_ok(kvh_seq_migrate(e, s, 0, 64, KVH_TIER_HOST, NULL));
    assert_int_equal(tu_seq_binfo(e, s, 3).tier, KVH_TIER_HOST);
    assert_kvh(KVH_ERR_NOT_RESIDENT, kvh_seq_vmap(e, s, 1, 0, &m));
    /* Fill some device slots so the blocks come back to other slots. */
    kvh_seq other = new_seq(e, 32);
    assert_ok(kvh_seq_acquire(e, s, 0, 64, NULL));
    assert_ok(kvh_seq_vmap(e, s, 1, 0, &m));
    assert_ok(kvh_seq_release(e, s, 0, 64));
    check_view(e, s, m);
    check_attention(e, s, m, 1, 4, 2);
    assert_ok(kvh_seq_free(e, other));
    /* Left open: kvh_engine_close releases it (the teardown closes e). */
}

/* Resident set of this process in bytes. */
static uint64_t rss_bytes(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    unsigned long long pages = 0, resident = 0;
    if (f) {
        if (fscanf(f, "%llu %llu", &pages, &resident) != 2)
            resident = 0;
        fclose(f);
    }
    return resident * (uint64_t)sysconf(_SC_PAGESIZE);
}

/* A view may grow to 2^31 tokens, but its per-block records follow the
 * sequence: a view of 2 blocks used to allocate and fill 512 MiB of them
 * up front (found by fuzz_api). Refreshes then grow them block by block. */
static void test_large_capacity_is_lazy(void **state)
{
    kvh_engine *e = open_vmap(64, 0);
    kvh_seq s = new_seq(e, 2 * BT);
    assert_ok(kvh_seq_acquire(e, s, 0, 2 * BT, NULL));
    uint64_t before = rss_bytes();
    kvh_vmap *m = NULL;
    assert_ok(kvh_seq_vmap(e, s, 1, 1ull << 31, &m));
    assert_true(rss_bytes() - before < (16u << 20));
    assert_int_equal(tu_vmap_view(e, m).capacity_tokens, 1ull << 31);
    check_view(e, s, m);
    int32_t tok[BT];
    tu_iota(tok, BT, 100);
    for (uint64_t b = 2; b < 40; b++) { /* past the first few records */
        assert_ok(kvh_seq_append(e, s, tok, BT));
        write_tokens(e, s, b * BT, BT, 0);
        assert_ok(kvh_vmap_refresh(e, m, NULL));
    }
    check_view(e, s, m);
    check_attention(e, s, m, 1, H, 2);
    assert_ok(kvh_vmap_release(e, m));
}

static void test_refused_setups(void **state)
{
    kvh_vmap *m = NULL;
    kvh_engine *plain = tu_open(L, H, D, BT, KVH_DTYPE_F32, 8, 0, 1);
    kvh_seq s = new_seq(plain, 20);
    assert_kvh(KVH_ERR_UNSUPPORTED, kvh_seq_vmap(plain, s, 0, 0, &m));
    /* f16, head_dim 64, 16 tokens: 2 KiB per head and block, half a page. */
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F16, 8, 0, 1);
    c.vmap = 1;
    kvh_engine *small = tu_open_cfg(&c);
    kvh_seq s2 = tu_seq_new(small, 0);
    int32_t tok[4] = {1, 2, 3, 4};
    assert_ok(kvh_seq_append(small, s2, tok, 4));
    assert_kvh(KVH_ERR_UNSUPPORTED, kvh_seq_vmap(small, s2, 0, 0, &m));
    kvh_engine *e = open_vmap(8, 0);
    kvh_seq s3 = new_seq(e, 20);
    assert_kvh(KVH_ERR_RANGE, kvh_seq_vmap(e, s3, L, 0, &m));
    {
        kvh_vmap *v3 = NULL;
        float q[H * D] = {0}, o[H * D];
        uint32_t too_many = 21;
        assert_ok(kvh_seq_vmap(e, s3, 0, 0, &v3));
        assert_kvh(KVH_ERR_RANGE, kvh_attention_prefill_vmap(e, &v3, &too_many, 1, q, o, NULL));
        assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_prefill_vmap(e, &v3, NULL, 1, q, o, NULL));
        assert_ok(kvh_vmap_release(e, v3));
    }
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_vmap(e, s3, 0, 0, NULL));
    kvh_vmap_view v = {.struct_size = 3};
    assert_ok(kvh_seq_vmap(e, s3, 0, 0, &m));
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_vmap_get(e, m, &v));
    assert_ok(kvh_vmap_release(e, m));
    c.vmap = 2;
    kvh_engine *bad = NULL;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(&c, &bad));
}

static kvh_vmap *view_of(kvh_engine *e, kvh_seq s)
{
    kvh_vmap *m = NULL;
    assert_ok(kvh_seq_vmap(e, s, 0, 0, &m));
    return m;
}

static kvh_vmap *forged_view(uint64_t id) { return (kvh_vmap *)(uintptr_t)id; }

/* Every call taking the view refuses it, alone or next to a good view
 * (live: NULL or one), and writes nothing. */
static void check_bad_view(kvh_engine *e, kvh_vmap *m, kvh_vmap *live)
{
    kvh_vmap_view v = {.struct_size = sizeof(v), .layer = 77};
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_vmap_get(e, m, &v));
    assert_int_equal(v.layer, 77);
    int32_t changed = -1;
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_vmap_refresh(e, m, &changed));
    assert_int_equal(changed, -1);
    float q[2 * H * D] = {0}, out[2 * H * D];
    memset(out, 0x5a, sizeof(out));
    uint32_t q_lens[2] = {1, 1};
    kvh_vmap *both[2] = {live, m};
    size_t n = live ? 2 : 1;
    kvh_vmap *const *views = live ? both : &m;
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_attention_decode_vmap(e, views, n, q, out, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_attention_prefill_vmap(e, views, q_lens, n, q, out, NULL));
    for (size_t i = 0; i < sizeof(out); i++)
        assert_int_equal(((const uint8_t *)out)[i], 0x5a);
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_vmap_release(e, m));
}

static void check_good_view(kvh_engine *e, kvh_seq s, kvh_vmap *m)
{
    check_view(e, s, m);
    assert_ok(kvh_vmap_refresh(e, m, NULL));
    float q[H * D] = {0}, out[H * D];
    assert_ok(kvh_attention_decode_vmap(e, &m, 1, q, out, NULL));
}

/* A released view stays bad, also once a new view may take its memory
 * (and its slot); releasing it again changes nothing. */
static void test_released_view_is_bad(void **state)
{
    kvh_engine *e = open_vmap(32, 0);
    kvh_seq s = new_seq(e, 20);
    kvh_vmap *gone = view_of(e, s);
    assert_ok(kvh_vmap_release(e, gone));
    check_bad_view(e, gone, NULL);
    kvh_vmap *live = view_of(e, s);
    assert_ptr_not_equal(live, gone);
    check_bad_view(e, gone, NULL);
    check_bad_view(e, gone, live);
    check_good_view(e, s, live);
    assert_int_equal(tu_seq_binfo(e, s, 0).holds, 1); /* the live view's */
    assert_ok(kvh_vmap_release(e, live));
    assert_int_equal(tu_seq_binfo(e, s, 0).holds, 0);
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_vmap_release(e, live));
}

/* Values no kvh_seq_vmap handed out: small integers, an address of
 * view-sized zeroed memory, and the live view's value with its generation
 * one off either way or its index out of range. */
static void test_forged_view_is_bad(void **state)
{
    static uint64_t zeroed[256];
    kvh_engine *e = open_vmap(32, 0);
    kvh_seq s = new_seq(e, 20);
    kvh_vmap *live = view_of(e, s);
    uint64_t id = (uint64_t)(uintptr_t)live;
    uint8_t tag = kvhi_handle_tag(id);
    uint32_t gen = kvhi_handle_gen(id), idx = kvhi_handle_index(id);
    check_bad_view(e, forged_view(0x1234), live);
    check_bad_view(e, forged_view(1), NULL);
    check_bad_view(e, forged_view(UINT64_MAX), live);
    check_bad_view(e, (kvh_vmap *)zeroed, live);
    check_bad_view(e, forged_view(kvhi_handle_make(tag, gen + 1, idx)), live);
    check_bad_view(e, forged_view(kvhi_handle_make(tag, gen - 1, idx)), NULL);
    check_bad_view(e, forged_view(kvhi_handle_make(tag, gen, idx + 1000)), live);
    check_good_view(e, s, live);
    assert_ok(kvh_vmap_release(e, live));
}

/* A plan passed as a view and a view passed as a plan: each is refused by
 * the other's calls and keeps working. */
static void test_plan_and_view_are_not_interchangeable(void **state)
{
    kvh_engine *e = open_vmap(32, 0);
    kvh_seq s = new_seq(e, 20);
    kvh_vmap *m = view_of(e, s);
    kvh_attention_plan *pl = NULL;
    assert_ok(kvh_attention_plan_create(e, 0, &s, NULL, 1, NULL, &pl));
    check_bad_view(e, (kvh_vmap *)pl, NULL);
    check_bad_view(e, (kvh_vmap *)pl, m);
    float q[H * D] = {0}, out[H * D];
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_attention_run(e, (kvh_attention_plan *)m, q, out, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_attention_plan_destroy(e, (kvh_attention_plan *)m));
    assert_ok(kvh_attention_run(e, pl, q, out, NULL));
    check_good_view(e, s, m);
    assert_int_equal(tu_seq_binfo(e, s, 0).holds, 2);
    assert_ok(kvh_attention_plan_destroy(e, pl));
    assert_ok(kvh_vmap_release(e, m));
    assert_int_equal(tu_seq_binfo(e, s, 0).holds, 0);
}

/* A view names a view of its own engine only. */
static void test_view_of_another_engine_is_bad(void **state)
{
    kvh_engine *a = open_vmap(32, 0), *b = open_vmap(32, 0);
    kvh_seq sa = new_seq(a, 20), sb = new_seq(b, 20);
    kvh_vmap *ma = view_of(a, sa), *mb = view_of(b, sb);
    check_bad_view(b, ma, NULL);
    check_bad_view(b, ma, mb);
    check_bad_view(a, mb, ma);
    check_good_view(a, sa, ma);
    check_good_view(b, sb, mb);
    assert_ok(kvh_vmap_release(a, ma));
    assert_ok(kvh_vmap_release(b, mb));
}

/* A view left open is released by close; its value means nothing to the
 * next engine, even one at the same address. */
static void test_view_after_close_is_bad(void **state)
{
    kvh_engine *e = open_vmap(32, 0);
    kvh_vmap *m = view_of(e, new_seq(e, 20));
    assert_ok(tu_close(e));
    kvh_engine *next = open_vmap(32, 0);
    check_bad_view(next, m, NULL);
    kvh_seq s = new_seq(next, 20);
    kvh_vmap *fresh = view_of(next, s);
    check_bad_view(next, m, fresh);
    check_good_view(next, s, fresh);
    assert_ok(kvh_vmap_release(next, fresh));
}

/* Map/release cycles reuse the same memory and table slot, yet no value
 * comes back, and every earlier one stays bad. */
static void test_view_values_never_repeat(void **state)
{
    enum { CYCLES = 2000 };
    kvh_engine *e = open_vmap(32, 0);
    kvh_seq s = new_seq(e, 20);
    uintptr_t *seen = tu_alloc(sizeof(*seen) * CYCLES);
    for (int i = 0; i < CYCLES; i++) {
        kvh_vmap *m = view_of(e, s);
        seen[i] = (uintptr_t)m;
        for (int j = 0; j < i; j++)
            if (seen[j] == seen[i])
                fail_msg("view %d has the value of view %d again (%#jx)", i, j, (uintmax_t)seen[i]);
        assert_ok(kvh_vmap_release(e, m));
    }
    kvh_vmap *live = view_of(e, s);
    for (int i = 0; i < CYCLES; i += 97)
        check_bad_view(e, (kvh_vmap *)seen[i], live);
    check_good_view(e, s, live);
    assert_ok(kvh_vmap_release(e, live));
    assert_int_equal(tu_seq_binfo(e, s, 0).holds, 0);
}

/* K/V buffers inside a view of the sequence (kvh.h): a write from one
 * takes the bytes as they were when it began, though it rewrites pages
 * the view shows; a read into one is refused (the pages are read-only)
 * with nothing changed. */
static void test_kv_buffers_inside_a_view(void **state)
{
    (void)state;
    kvh_engine *e = open_vmap(32, 0);
    kvh_seq s = new_seq(e, 40); /* block 2 partial: written in place */
    kvh_vmap *m = NULL;
    assert_ok(kvh_seq_vmap(e, s, 1, 0, &m));
    kvh_vmap_view vw = tu_vmap_view(e, m);
    const float *row32 = (const float *)vw.k + 32 * D; /* head 0, token 32 */
    enum { N = 3 };
    float vin[N * H * D], kout[N * H * D], vout[N * H * D];
    for (size_t i = 0; i < N * H * D; i++)
        vin[i] = (float)i;
    /* Tokens 33..35 from head 0's rows 32..37: token t, head h takes row
     * 32 + t * H + h, while the write rewrites rows 33..35. */
    assert_ok(kvh_seq_write_kv(e, s, 1, 33, N, row32, vin));
    assert_ok(kvh_seq_read_kv(e, s, 1, 33, N, kout, vout));
    for (uint32_t t = 0; t < N; t++)
        for (uint32_t h = 0; h < H; h++)
            for (uint32_t d = 0; d < D; d++)
                if (kout[(t * H + h) * D + d] != val(1, 32 + t * H + h, 0, 0, d, 0))
                    fail_msg("token %u head %u dim %u: %g, expected %g", 33 + t, h, d, kout[(t * H + h) * D + d],
                             val(1, 32 + t * H + h, 0, 0, d, 0));
    assert_memory_equal(vout, vin, sizeof(vin));

    uint8_t before[4 * D * sizeof(float)];
    memcpy(before, vw.k, sizeof(before));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_read_kv(e, s, 1, 0, 1, (void *)(uintptr_t)vw.k, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_read_kv(e, s, 1, 0, 1, kout, (void *)(uintptr_t)vw.v));
    assert_memory_equal(vw.k, before, sizeof(before));
    assert_ok(kvh_vmap_release(e, m));
    /* Once the view is gone, the same address range is no longer one. */
    assert_ok(kvh_seq_read_kv(e, s, 1, 0, 1, kout, vout));
}

/* kvh.h: slot i of a memory tier is at base + i * block_bytes. With vmap
 * the device tier is laid out by head, so it gives no base (a caller
 * reading a block there would read other blocks' heads); the host tier's
 * layout is the usual one. */
static void test_device_tier_gives_no_block_base(void **state)
{
    (void)state;
    kvh_engine *e = open_vmap(8, 4);
    kvh_tier_info ti = {.struct_size = sizeof(ti)};
    assert_ok(kvh_tier_info_get(e, KVH_TIER_DEVICE, &ti));
    assert_true(ti.capacity_blocks > 0);
    assert_null(ti.base);
    kvh_tier_info hi = {.struct_size = sizeof(hi)};
    assert_ok(kvh_tier_info_get(e, KVH_TIER_HOST, &hi));
    assert_non_null(hi.base);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_view_equals_paged, tu_teardown),
        cmocka_unit_test_teardown(test_params_refused_as_paged, tu_teardown),
        cmocka_unit_test_teardown(test_kv_buffers_inside_a_view, tu_teardown),
        cmocka_unit_test_teardown(test_stale_and_refresh, tu_teardown),
        cmocka_unit_test_teardown(test_views_and_migration, tu_teardown),
        cmocka_unit_test_teardown(test_large_capacity_is_lazy, tu_teardown),
        cmocka_unit_test_teardown(test_refused_setups, tu_teardown),
        cmocka_unit_test_teardown(test_released_view_is_bad, tu_teardown),
        cmocka_unit_test_teardown(test_forged_view_is_bad, tu_teardown),
        cmocka_unit_test_teardown(test_plan_and_view_are_not_interchangeable, tu_teardown),
        cmocka_unit_test_teardown(test_view_of_another_engine_is_bad, tu_teardown),
        cmocka_unit_test_teardown(test_view_after_close_is_bad, tu_teardown),
        cmocka_unit_test_teardown(test_view_values_never_repeat, tu_teardown),
        cmocka_unit_test_teardown(test_device_tier_gives_no_block_base, tu_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
