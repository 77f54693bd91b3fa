/* Views (kvh_seq_vmap) on the CUDA backend: a device tier of CUDA VMM
 * allocations mapped again into each view (kernels/cuda/vmap_cuda.cu).
 *
 * Exits 77 (skipped) when no CUDA backend or device is usable. Otherwise:
 * - a view's contents, copied back from its device addresses, equal
 *   kvh_seq_read_kv, and decode and prefill over views equal the paged
 *   calls of the same engine bit for bit (outputs poisoned with NaN
 *   first), over dtypes, head dims, block sizes, GQA ratios and a batch of
 *   two views;
 * - a view stays correct after the refresh that follows an append (into
 *   its last unit and into a new one), a migration down and back up of
 *   blocks appended since, and a copy-on-write after a fork; a
 *   copy-on-write in the middle of a unit is refused (KVH_ERR_UNSUPPORTED);
 * - releasing a view with attention over it still queued waits for it;
 * - map and unmap of one 2 MiB unit are timed (printed, not checked).
 *
 * Views on CUDA map whole units (2 MiB): a unit's blocks must sit in one
 * slab, in order, from a unit-aligned slot. Slots are handed out in
 * ascending order; the scenarios place blocks accordingly and check the
 * placement they rely on (units_in_order).
 *
 * libkvh_cuda.so is looked up through KVH_CUDA_BACKEND, which this test
 * points at <build>/libkvh_cuda.so when it is not set. */
#include <math.h>
#include <stdbool.h>

#include "test_util.h"

#include "core/engine.h"
#include "kernels/attention_dtype.h"
#include "cuda_test_util.h"

typedef struct geo {
    uint32_t L, H, D, bt, dtype;
} geo;

static size_t eb(const geo *g) { return tu_dtype_size(g->dtype); }
static uint64_t piece_bytes(const geo *g) { return (uint64_t)g->bt * g->D * eb(g); }

static kvh_engine *open_cuda_vmap(const geo *g, uint64_t dev_blocks, uint64_t host_blocks)
{
    kvh_config c = tu_cfg(g->L, g->H, g->D, g->bt, g->dtype, dev_blocks, host_blocks, 1);
    c.backend = KVH_BACKEND_CUDA;
    c.vmap = 1;
    kvh_engine *e = tu_open_cfg(&c);
    assert_string_equal(kvh_engine_backend(e), "cuda");
    return e;
}

/* Logical blocks per mapping unit. */
static uint32_t unit_blocks(kvh_engine *e, const geo *g) { return (uint32_t)(e->vmap_unit / piece_bytes(g)); }

static float val(uint32_t layer, uint64_t t, uint32_t h, int kv, uint32_t d, uint32_t salt)
{
    tu_rng r = {((uint64_t)layer << 40) ^ (t << 16) ^ ((uint64_t)h << 8) ^ ((uint64_t)kv << 4) ^ d ^
                ((uint64_t)salt << 56)};
    return (float)((int64_t)(tu_next(&r) % 2001) - 1000) / 500.0f;
}

static void write_tokens(kvh_engine *e, const geo *g, kvh_seq s, uint64_t pos, size_t n, uint32_t salt)
{
    size_t cnt = n * g->H * g->D;
    uint8_t *k = tu_alloc(cnt * eb(g)), *v = tu_alloc(cnt * eb(g));
    for (uint32_t l = 0; l < g->L; l++) {
        for (size_t t = 0; t < n; t++)
            for (uint32_t h = 0; h < g->H; h++)
                for (uint32_t d = 0; d < g->D; d++) {
                    size_t x = (t * g->H + h) * g->D + d;
                    kvhi_store_from_f32(g->dtype, k, x, val(l, pos + t, h, 0, d, salt));
                    kvhi_store_from_f32(g->dtype, v, x, val(l, pos + t, h, 1, d, salt));
                }
        assert_ok(kvh_seq_write_kv(e, s, l, pos, n, k, v));
    }
    tu_free(k);
    tu_free(v);
}

static void append(kvh_engine *e, const geo *g, kvh_seq s, size_t n, uint32_t salt)
{
    uint64_t pos = tu_seq_len(e, s);
    int32_t *tok = tu_alloc(sizeof(int32_t) * n);
    tu_iota(tok, n, (int32_t)pos + 1);
    assert_ok(kvh_seq_append(e, s, tok, n));
    tu_free(tok);
    write_tokens(e, g, s, pos, n, salt);
}

static kvh_seq new_seq(kvh_engine *e, const geo *g, size_t n, uint32_t salt)
{
    kvh_seq s = tu_seq_new(e, 0);
    append(e, g, s, n, salt);
    return s;
}

/* True when each unit of s's blocks starts on a unit-aligned slot and
 * continues in the slots after it: what a CUDA view can map. */
static bool units_in_order(kvh_engine *e, kvh_seq s, uint32_t U)
{
    uint64_t nb = (tu_seq_len(e, s) + e->cfg.block_tokens - 1) / e->cfg.block_tokens;
    uint32_t prev = 0;
    for (uint64_t i = 0; i < nb; i++) {
        kvh_block_info b = tu_seq_binfo(e, s, i);
        if (b.tier != KVH_TIER_DEVICE || (i % U == 0 ? b.slot % U != 0 : b.slot != prev + 1))
            return false;
        prev = b.slot;
    }
    return true;
}

/* The view, copied back from the device, equals kvh_seq_read_kv. */
static void check_view(kvh_engine *e, const geo *g, kvh_seq s, kvh_vmap *m)
{
    kvh_vmap_view v = tu_vmap_view(e, m);
    assert_string_equal(v.backing, "cuda-vmm");
    assert_int_equal(v.map_unit, e->vmap_unit);
    uint64_t n = tu_seq_len(e, s);
    assert_int_equal(v.n_tokens, n);
    size_t row = g->D * eb(g), cnt = n * g->H * g->D;
    uint8_t *k = tu_alloc(cnt * eb(g)), *vv = tu_alloc(cnt * eb(g)), *got = tu_alloc(n * row);
    assert_ok(kvh_seq_read_kv(e, s, v.layer, 0, n, k, vv));
    for (uint32_t h = 0; h < g->H; h++)
        for (int kv = 0; kv < 2; kv++) {
            const uint8_t *src = (const uint8_t *)(kv ? v.v : v.k) + h * v.head_stride;
            d2h(e, got, src, n * row);
            const uint8_t *want = kv ? vv : k;
            for (uint64_t t = 0; t < n; t++)
                if (memcmp(got + t * row, want + (t * g->H + h) * row, row) != 0)
                    fail_msg("view %s of head %u differs at token %llu of %llu", kv ? "V" : "K", h,
                             (unsigned long long)t, (unsigned long long)n);
        }
    tu_free(k);
    tu_free(vv);
    tu_free(got);
}

/* Decode (q_lens NULL) or prefill of n sequences over their views in one
 * call, against the paged call of each sequence alone (the contract: the
 * work split is per sequence), on the legacy default stream: equal bit
 * for bit, no NaN. */
static void compare_run(kvh_engine *e, const geo *g, kvh_seq *seqs, kvh_vmap **views, size_t n, uint32_t layer,
                        uint32_t Hq, const uint32_t *q_lens, const char *label)
{
    size_t rows = 0;
    for (size_t i = 0; i < n; i++)
        rows += q_lens ? q_lens[i] : 1;
    size_t elems = rows * Hq * g->D, bytes = elems * sizeof(float);
    float *q = tu_alloc(bytes), *a = tu_alloc(bytes), *b = tu_alloc(bytes);
    for (size_t x = 0; x < elems; x++)
        q[x] = val(9, x, 0, 0, 0, 3);
    void *dq = dev_alloc(e, bytes), *da = dev_alloc(e, bytes), *db = dev_alloc(e, bytes);
    h2d(e, dq, q, bytes);
    memset(a, 0xff, bytes); /* NaN */
    h2d(e, da, a, bytes);
    h2d(e, db, a, bytes);
    kvh_attention_params p;
    assert_ok(kvh_attention_params_init(&p, sizeof(p)));
    p.num_q_heads = Hq;
    size_t row_bytes = (size_t)Hq * g->D * sizeof(float), row = 0;
    for (size_t i = 0; i < n; i++) {
        const uint8_t *qi = (const uint8_t *)dq + row * row_bytes;
        uint8_t *ai = (uint8_t *)da + row * row_bytes;
        if (q_lens)
            assert_ok(kvh_attention_prefill(e, layer, &seqs[i], &q_lens[i], 1, qi, ai, &p));
        else
            assert_ok(kvh_attention_decode(e, layer, &seqs[i], 1, qi, ai, &p));
        row += q_lens ? q_lens[i] : 1;
    }
    if (q_lens)
        assert_ok(kvh_attention_prefill_vmap(e, views, q_lens, n, dq, db, &p));
    else
        assert_ok(kvh_attention_decode_vmap(e, views, n, dq, db, &p));
    sync_default_stream(e);
    d2h(e, a, da, bytes);
    d2h(e, b, db, bytes);
    for (size_t x = 0; x < elems; x++)
        if (isnan(a[x]))
            fail_msg("%s: paged output %zu is NaN", label, x);
    if (memcmp(a, b, bytes) != 0) {
        size_t x = 0;
        while (a[x] == b[x])
            x++;
        fail_msg("%s: view output %zu is %.9g, paged %.9g", label, x, b[x], a[x]);
    }
    e->backend->device_free(e->backend_ctx, dq, bytes);
    e->backend->device_free(e->backend_ctx, da, bytes);
    e->backend->device_free(e->backend_ctx, db, bytes);
    tu_free(q);
    tu_free(a);
    tu_free(b);
}

/* Decode, and prefill of the last 1, 17 and 300 tokens (where there are
 * that many). */
static void compare(kvh_engine *e, const geo *g, kvh_seq *seqs, kvh_vmap **views, size_t n, uint32_t Hq,
                    const char *label)
{
    uint32_t layer = tu_vmap_view(e, views[0]).layer;
    compare_run(e, g, seqs, views, n, layer, Hq, NULL, label);
    static const uint32_t chunk[] = {1, 17, 300};
    for (size_t c = 0; c < 3; c++) {
        uint32_t ql[8];
        assert_true(n <= 8);
        for (size_t i = 0; i < n; i++) {
            uint64_t len = tu_seq_len(e, seqs[i]);
            ql[i] = chunk[c] < len ? chunk[c] : (uint32_t)len;
        }
        compare_run(e, g, seqs, views, n, layer, Hq, ql, label);
    }
}

static void test_equals_paged(void **state)
{
    (void)state;
    static const struct {
        geo g;
        uint32_t G;
    } cases[] = {
        {{2, 2, 128, 16, KVH_DTYPE_F16}, 4},
        {{1, 2, 128, 32, KVH_DTYPE_BF16}, 2},
        {{2, 1, 64, 16, KVH_DTYPE_F32}, 8},
        {{1, 1, 256, 64, KVH_DTYPE_F16}, 4},
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        const geo *g = &cases[c].g;
        uint32_t U = (uint32_t)((2u << 20) / piece_bytes(g));
        kvh_engine *e = open_cuda_vmap(g, 3ull * U + 8, 0);
        U = unit_blocks(e, g);
        /* s0 fills unit 0 exactly, so s1 starts on unit 1 */
        kvh_seq s[2];
        s[0] = new_seq(e, g, (size_t)U * g->bt, 1);
        s[1] = new_seq(e, g, (size_t)U * g->bt * 3 / 2 - 5, 2);
        assert_true(units_in_order(e, s[0], U) && units_in_order(e, s[1], U));
        kvh_vmap *m[2];
        assert_ok(kvh_seq_vmap(e, s[0], g->L - 1, 0, &m[0]));
        assert_ok(kvh_seq_vmap(e, s[1], g->L - 1, (uint64_t)U * g->bt * 4, &m[1]));
        check_view(e, g, s[0], m[0]);
        check_view(e, g, s[1], m[1]);
        char label[96];
        snprintf(label, sizeof(label), "case %zu (D %u bt %u dtype %u G %u)", c, g->D, g->bt, g->dtype, cases[c].G);
        compare(e, g, s, m, 2, g->H * cases[c].G, label);
        compare(e, g, &s[1], &m[1], 1, g->H * cases[c].G, label);
        print_message("%s: views equal paged attention, unit %llu bytes = %u blocks\n", label,
                      (unsigned long long)e->vmap_unit, U);
        assert_ok(kvh_vmap_release(e, m[0]));
        assert_ok(kvh_vmap_release(e, m[1]));
        assert_ok(tu_close(e));
    }
    /* f16, head_dim 80, 16 tokens: 2560 bytes per head and block, which a
     * 2 MiB unit does not hold a whole number of times. */
    geo odd = {1, 1, 80, 16, KVH_DTYPE_F16};
    kvh_engine *e = open_cuda_vmap(&odd, 1024, 0);
    kvh_seq s = new_seq(e, &odd, 40, 1);
    kvh_vmap *m = NULL;
    assert_kvh(KVH_ERR_UNSUPPORTED, kvh_seq_vmap(e, s, 0, 0, &m));
}

static const geo G_MAIN = {2, 2, 128, 16, KVH_DTYPE_F16};

static void test_refresh_after_append_and_migration(void **state)
{
    (void)state;
    const geo *g = &G_MAIN;
    kvh_engine *e = open_cuda_vmap(g, 3 * 512 + 8, 64);
    uint32_t U = unit_blocks(e, g), bt = g->bt;
    kvh_seq s = new_seq(e, g, (size_t)U * bt - 20, 1);
    kvh_vmap *m = NULL;
    assert_ok(kvh_seq_vmap(e, s, 1, (uint64_t)U * bt * 4, &m));
    check_view(e, g, s, m);
    compare(e, g, &s, &m, 1, 8, "first unit");

    /* into the last block (12 of 16 tokens): stale, nothing to remap */
    append(e, g, s, 3, 2);
    int32_t changed = -1;
    assert_ok(kvh_vmap_refresh(e, m, &changed));
    assert_int_equal(changed, 1);
    check_view(e, g, s, m);
    /* into unit 1 (a new mapping), then again (a remap of that unit) */
    append(e, g, s, 40, 3);
    assert_true(units_in_order(e, s, U));
    assert_ok(kvh_vmap_refresh(e, m, &changed));
    assert_int_equal(changed, 1);
    check_view(e, g, s, m);
    compare(e, g, &s, &m, 1, 8, "after an append into a new unit");
    append(e, g, s, 3 * bt, 4);
    assert_ok(kvh_vmap_refresh(e, m, &changed));
    check_view(e, g, s, m);
    compare(e, g, &s, &m, 1, 8, "after an append into a mapped unit");

    /* The view holds what it maps: a demotion leaves those blocks. */
    assert_ok(kvh_seq_migrate(e, s, 0, 4 * bt, KVH_TIER_HOST, NULL));
    assert_int_equal(tu_seq_binfo(e, s, 0).tier, KVH_TIER_DEVICE);
    assert_true(tu_seq_binfo(e, s, 0).holds >= 1);

    /* A block appended since (not held) goes down and comes back. */
    uint64_t len = tu_seq_len(e, s);
    append(e, g, s, (bt - len % bt) % bt + bt / 2, 5);
    uint64_t nb = (tu_seq_len(e, s) + bt - 1) / bt, first = (nb - 1) * bt;
    uint32_t slot_before = tu_seq_binfo(e, s, nb - 1).slot;
    assert_ok(kvh_seq_migrate(e, s, first, bt / 2, KVH_TIER_HOST, NULL));
    assert_int_equal(tu_seq_binfo(e, s, nb - 1).tier, KVH_TIER_HOST);
    assert_int_equal(tu_seq_binfo(e, s, nb - 2).tier, KVH_TIER_DEVICE);
    assert_ok(kvh_seq_acquire(e, s, first, bt / 2, NULL));
    assert_int_equal(tu_seq_binfo(e, s, nb - 1).tier, KVH_TIER_DEVICE);
    print_message("migrated block: slot %u before, %u after\n", slot_before, tu_seq_binfo(e, s, nb - 1).slot);
    if (units_in_order(e, s, U)) {
        assert_ok(kvh_vmap_refresh(e, m, &changed));
        assert_int_equal(changed, 1);
        check_view(e, g, s, m);
        compare(e, g, &s, &m, 1, 8, "after a migration down and up");
    } else {
        assert_kvh(KVH_ERR_UNSUPPORTED, kvh_vmap_refresh(e, m, &changed));
    }
    assert_ok(kvh_seq_release(e, s, first, bt / 2));
    assert_ok(kvh_vmap_release(e, m));
    assert_int_equal(tu_seq_binfo(e, s, 0).holds, 0);
}

static void test_refresh_after_fork(void **state)
{
    (void)state;
    /* f32, head_dim 256, 64 tokens: 64 KiB per head and block, 32 blocks
     * per unit */
    const geo gg = {1, 2, 256, 64, KVH_DTYPE_F32}, *g = &gg;
    kvh_engine *e = open_cuda_vmap(g, 4 * 32 + 8, 0);
    uint32_t U = unit_blocks(e, g), bt = g->bt;
    /* parent: unit 0 and a partial first block of unit 1 (slots 0..U);
     * a filler takes slots U+1..2U-1, so the next free slot is 2U */
    kvh_seq parent = new_seq(e, g, (size_t)U * bt + bt / 2, 1);
    kvh_seq filler = new_seq(e, g, (size_t)(U - 1) * bt, 2);
    assert_int_equal(tu_seq_binfo(e, filler, U - 2).slot, 2 * U - 1);
    kvh_vmap *mp = NULL, *mc = NULL;
    assert_ok(kvh_seq_vmap(e, parent, 0, (uint64_t)U * bt * 4, &mp));
    kvh_seq child;
    assert_ok(kvh_seq_fork(e, parent, 0, &child));
    assert_ok(kvh_seq_vmap(e, child, 0, (uint64_t)U * bt * 4, &mc));
    check_view(e, g, child, mc);
    compare(e, g, &child, &mc, 1, 4, "fork sharing the parent's blocks");

    /* The child's write into the shared last block copies it, to slot 2U:
     * the child's unit 1 starts there. */
    write_tokens(e, g, child, (uint64_t)U * bt + bt / 2 - 1, 1, 7);
    assert_int_equal(tu_seq_binfo(e, child, U).slot, 2 * U);
    int32_t changed = -1;
    assert_ok(kvh_vmap_refresh(e, mp, &changed));
    assert_int_equal(changed, 0); /* the parent's blocks did not change */
    assert_ok(kvh_vmap_refresh(e, mc, &changed));
    assert_int_equal(changed, 1);
    check_view(e, g, parent, mp);
    check_view(e, g, child, mc);
    kvh_seq both[2] = {parent, child};
    kvh_vmap *views[2] = {mp, mc};
    compare(e, g, both, views, 2, 4, "after copy-on-write");
    append(e, g, child, bt, 8);
    assert_true(units_in_order(e, child, U));
    assert_ok(kvh_vmap_refresh(e, mc, &changed));
    check_view(e, g, child, mc);
    compare(e, g, &child, &mc, 1, 4, "child grown after copy-on-write");

    /* A copy-on-write in the middle of the parent's unit 0 puts that
     * block out of slab order: whole-unit views refuse it. */
    write_tokens(e, g, parent, 3 * bt, 1, 9);
    assert_false(units_in_order(e, parent, U));
    assert_kvh(KVH_ERR_UNSUPPORTED, kvh_vmap_refresh(e, mp, &changed));
    assert_ok(kvh_vmap_release(e, mp));
    assert_ok(kvh_vmap_release(e, mc));
}

/* Release, and close, with attention over a view still queued wait for
 * it. The buffers belong to another engine ("keeper"), whose backend
 * context outlives the closed one. */
static void test_release_waits_for_queued_attention(void **state)
{
    (void)state;
    const geo *g = &G_MAIN;
    kvh_config kc = tu_cfg(1, 1, 64, 16, KVH_DTYPE_F16, 16, 0, 1);
    kc.backend = KVH_BACKEND_CUDA;
    kvh_engine *keeper = tu_open_cfg(&kc);
    kvh_engine *e = open_cuda_vmap(g, 3 * 512 + 8, 0);
    uint32_t U = unit_blocks(e, g);
    kvh_seq s = new_seq(e, g, (size_t)U * g->bt * 2, 1);
    kvh_vmap *m = NULL;
    assert_ok(kvh_seq_vmap(e, s, 0, 0, &m));
    const uint32_t Hq = 8;
    size_t bytes = Hq * g->D * sizeof(float);
    float *host = tu_alloc(bytes);
    for (size_t x = 0; x < bytes / sizeof(float); x++)
        host[x] = val(1, x, 0, 0, 0, 1);
    void *dq = dev_alloc(keeper, bytes), *dout = dev_alloc(keeper, bytes);
    h2d(keeper, dq, host, bytes);
    kvh_attention_params p;
    assert_ok(kvh_attention_params_init(&p, sizeof(p)));
    p.num_q_heads = Hq;
    for (int round = 0; round < 2; round++) {
        memset(host, 0xff, bytes);
        h2d(keeper, dout, host, bytes);
        if (round == 1)
            assert_ok(kvh_seq_vmap(e, s, 1, 0, &m));
        for (int i = 0; i < 16; i++)
            assert_ok(kvh_attention_decode_vmap(e, &m, 1, dq, dout, &p));
        /* no sync before either: release (round 0) and close (round 1)
         * wait for the kernels */
        if (round == 0) {
            assert_ok(kvh_vmap_release(e, m));
            assert_int_equal(tu_seq_binfo(e, s, 0).holds, 0);
        } else
            assert_ok(tu_close(e));
        d2h(keeper, host, dout, bytes);
        for (size_t x = 0; x < bytes / sizeof(float); x++)
            assert_false(isnan(host[x]));
    }
    keeper->backend->device_free(keeper->backend_ctx, dq, bytes);
    keeper->backend->device_free(keeper->backend_ctx, dout, bytes);
}

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Map, remap (over a mapped unit) and unmap of one unit, through the
 * engine's backend table as core/vmap.c calls it. */
static void test_map_unmap_timing(void **state)
{
    (void)state;
    const geo *g = &G_MAIN;
    kvh_engine *e = open_cuda_vmap(g, 4 * 512, 0);
    uint64_t unit = e->vmap_unit;
    enum { N = 200 };
    void *r = NULL;
    char msg[256] = "";
    if (e->backend->vmap_reserve(e->backend_ctx, e->vmap_arena, unit, &r, msg, sizeof(msg)) != 0)
        fail_msg("reserve: %s", msg);
    static double map_t[N], remap_t[N], unmap_t[N];
    for (int i = 0; i < N; i++) {
        uint64_t off = (uint64_t)(i % 3) * unit;
        double t0 = now_us();
        if (e->backend->vmap_map(e->backend_ctx, e->vmap_arena, r, off, unit, msg, sizeof(msg)) != 0)
            fail_msg("map: %s", msg);
        double t1 = now_us();
        if (e->backend->vmap_map(e->backend_ctx, e->vmap_arena, r, unit, unit, msg, sizeof(msg)) != 0)
            fail_msg("remap: %s", msg);
        double t2 = now_us();
        if (e->backend->vmap_unmap(e->backend_ctx, e->vmap_arena, r, unit, msg, sizeof(msg)) != 0)
            fail_msg("unmap: %s", msg);
        double t3 = now_us();
        map_t[i] = t1 - t0, remap_t[i] = t2 - t1, unmap_t[i] = t3 - t2;
    }
    e->backend->vmap_unreserve(e->backend_ctx, e->vmap_arena, r, unit);
    qsort(map_t, N, sizeof(double), cmp_double);
    qsort(remap_t, N, sizeof(double), cmp_double);
    qsort(unmap_t, N, sizeof(double), cmp_double);
    print_message("vmap timing: one %llu-byte unit, median (p90) of %d: map %.1f (%.1f) us, remap %.1f (%.1f) us, "
                  "unmap %.1f (%.1f) us\n",
                  (unsigned long long)unit, N, map_t[N / 2], map_t[N * 9 / 10], remap_t[N / 2], remap_t[N * 9 / 10],
                  unmap_t[N / 2], unmap_t[N * 9 / 10]);
}

int main(void)
{
    set_backend_path();
    kvh_config c = tu_cfg(1, 1, 64, 16, KVH_DTYPE_F16, 16, 0, 1);
    if (cuda_usable_or_skip(&c))
        return 77;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_equals_paged, tu_teardown),
        cmocka_unit_test_teardown(test_refresh_after_append_and_migration, tu_teardown),
        cmocka_unit_test_teardown(test_refresh_after_fork, tu_teardown),
        cmocka_unit_test_teardown(test_release_waits_for_queued_attention, tu_teardown),
        cmocka_unit_test_teardown(test_map_unmap_timing, tu_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
