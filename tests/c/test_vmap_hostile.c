/* Virtual contiguous views, fences, migration and prefetch against a
 * hostile caller, from kvh.h's promises alone ("Virtual contiguity",
 * "Migration between tiers and fences", "Hints and prefetch", "Handles").
 *
 * Oracle: every K/V element is a pure function of (sequence tag, layer,
 * token, head, K or V, dim), exact in f32, so a view or a read that shows
 * another sequence's, layer's or token's bytes is caught bit for bit.
 * Misuse gets the exact status the header lists, out-parameters stay as
 * they were ("written only on success"), and nothing moves or is held.
 * Stale views keep showing their old blocks ("never a fault while the view
 * exists"), also while other sequences take every free slot. */
#include <fcntl.h>
#include <math.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "test_util.h"
#include "kv_cells.h"
#include "uffd_gate.h"
#include "disk_test_util.h"

/* f32, head_dim 64, 16 tokens: one head's K of a block is one 4 KiB page. */
enum { L = 2, H = 2, D = 64, BT = 16, ROW = H * D };
static const dt_geo GEO = {L, H, D, BT, KVH_DTYPE_F32};

#define VM_SENTINEL ((kvh_vmap *)(uintptr_t)0x5e5e)
#define FENCE_SENTINEL ((kvh_fence){0x5e5e5e5eull})

static void write_tag(kvh_engine *e, kvh_seq s, uint32_t tag, uint64_t pos, size_t n)
{
    float *k = tu_alloc(sizeof(float) * n * ROW), *v = tu_alloc(sizeof(float) * n * ROW);
    for (uint32_t l = 0; l < L; l++) {
        kv_cells(tag, l, pos, n, H, D, k, v);
        assert_ok(kvh_seq_write_kv(e, s, l, pos, n, k, v));
    }
    tu_free(k);
    tu_free(v);
}

/* Appends n tokens and writes their K/V (tag's values) in every layer. */
static void grow(kvh_engine *e, kvh_seq s, uint32_t tag, size_t n)
{
    uint64_t pos = tu_seq_len(e, s);
    int32_t *tok = tu_alloc(sizeof(int32_t) * n);
    tu_iota(tok, n, (int32_t)(tag * 1000 + pos + 1));
    assert_ok(kvh_seq_append(e, s, tok, n));
    tu_free(tok);
    write_tag(e, s, tag, pos, n);
}

static kvh_seq mk(kvh_engine *e, uint32_t tag, size_t n)
{
    kvh_seq s = tu_seq_new(e, 0);
    grow(e, s, tag, n);
    return s;
}

/* kvh_seq_read_kv of [pos, pos + n) in every layer equals tag's values. */
static void expect_read(kvh_engine *e, kvh_seq s, uint32_t tag, uint64_t pos, size_t n)
{
    float *k = tu_alloc(sizeof(float) * n * ROW), *v = tu_alloc(sizeof(float) * n * ROW);
    float *ek = tu_alloc(sizeof(float) * n * ROW), *ev = tu_alloc(sizeof(float) * n * ROW);
    for (uint32_t l = 0; l < L; l++) {
        assert_ok(kvh_seq_read_kv(e, s, l, pos, n, k, v));
        kv_cells(tag, l, pos, n, H, D, ek, ev);
        for (size_t i = 0; i < n * ROW; i++)
            if (memcmp(&k[i], &ek[i], 4) || memcmp(&v[i], &ev[i], 4))
                fail_msg("read_kv layer %u token %" PRIu64 " head %zu dim %zu: K %g V %g, expected K %g V %g", l,
                         pos + i / ROW, (i / D) % H, i % D, k[i], v[i], ek[i], ev[i]);
    }
    tu_free(k);
    tu_free(v);
    tu_free(ek);
    tu_free(ev);
}

/* Tokens [pos, pos + n) of the view read directly equal tag's values of
 * the view's layer. */
static void expect_view(kvh_engine *e, kvh_vmap *m, uint32_t tag, uint64_t pos, size_t n)
{
    kvh_vmap_view v = tu_vmap_view(e, m);
    assert_true(pos + n <= v.n_tokens);
    for (uint32_t h = 0; h < H; h++) {
        const float *vk = (const float *)((const uint8_t *)v.k + h * v.head_stride);
        const float *vv = (const float *)((const uint8_t *)v.v + h * v.head_stride);
        for (uint64_t t = pos; t < pos + n; t++)
            for (uint32_t d = 0; d < D; d++) {
                float ek = kv_cell(tag, v.layer, t, h, 0, d), ev = kv_cell(tag, v.layer, t, h, 1, d);
                if (memcmp(&vk[t * D + d], &ek, 4) || memcmp(&vv[t * D + d], &ev, 4))
                    fail_msg("view of layer %u, token %" PRIu64 " head %u dim %u: K %g V %g, expected K %g V %g",
                             v.layer, t, h, d, vk[t * D + d], vv[t * D + d], ek, ev);
            }
    }
}

static kvh_vmap *view(kvh_engine *e, kvh_seq s, uint32_t layer, uint64_t cap)
{
    kvh_vmap *m = NULL;
    assert_ok(kvh_seq_vmap(e, s, layer, cap, &m));
    assert_non_null(m);
    return m;
}

static kvh_engine *open_vmap(uint64_t dev_blocks, uint64_t host_blocks, uint32_t threads)
{
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F32, dev_blocks, host_blocks, threads);
    c.vmap = 1;
    return tu_open_cfg(&c);
}

static uint32_t tier_of(kvh_engine *e, kvh_seq s, uint64_t block) { return tu_seq_binfo(e, s, block).tier; }

static void expect_tiers(kvh_engine *e, kvh_seq s, uint64_t nb, uint32_t tier)
{
    for (uint64_t b = 0; b < nb; b++)
        assert_int_equal(tier_of(e, s, b), tier);
}

static void fill_q(float *q, size_t n, uint32_t salt)
{
    for (size_t i = 0; i < n; i++)
        q[i] = kv_cell(salt, 0, i, 0, 0, 0) / 8.0f;
}

/* ================================================================== */
/* Stale views outliving their blocks' owner                          */
/* ================================================================== */

/* "Reading a stale view directly gives the old blocks' data (never a
 * fault while the view exists): their bytes as they are now": once the
 * sequence is freed, only a fork could change those bytes. With no fork,
 * sequences that take every other device slot and write their own K/V must
 * not show through the view; the view's hold keeps the blocks' slots. Once
 * released, the hold is gone and the slots are free again. */
static void test_view_outlives_its_freed_sequence(void **state)
{
    (void)state;
    kvh_engine *e = open_vmap(12, 0, 1);
    kvh_seq a = mk(e, 1, 40); /* 3 blocks, the last partial */
    kvh_vmap *m = view(e, a, 1, 0);
    kvh_vmap_view before = tu_vmap_view(e, m);
    assert_ok(kvh_seq_free(e, a));
    /* The view itself is not released: get still answers, as before. */
    kvh_vmap_view after = tu_vmap_view(e, m);
    assert_int_equal(after.n_tokens, 40);
    assert_ptr_equal(after.k, before.k);
    assert_int_equal(after.generation, before.generation);
    expect_view(e, m, 1, 0, 40);

    /* Others take every device slot they can get. */
    kvh_seq fill[16];
    int nfill = 0;
    for (; nfill < 16; nfill++) {
        fill[nfill] = tu_seq_new(e, 0);
        int32_t tok[BT];
        tu_iota(tok, BT, 9000 + nfill * BT);
        kvh_status st = kvh_seq_append(e, fill[nfill], tok, BT);
        if (st == KVH_ERR_NOSPACE) {
            assert_ok(kvh_seq_free(e, fill[nfill]));
            break;
        }
        assert_ok(st);
        write_tag(e, fill[nfill], 100 + (uint32_t)nfill, 0, BT);
    }
    /* 12 slots, 3 held by the view. */
    assert_int_equal(nfill, 9);
    expect_view(e, m, 1, 0, 40);
    for (int i = 0; i < nfill; i++)
        expect_read(e, fill[i], 100 + (uint32_t)i, 0, BT);

    float q[H * D], out[H * D];
    fill_q(q, H * D, 3);
    memset(out, 0x5a, sizeof(out));
    int32_t changed = -7;
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_vmap_refresh(e, m, &changed));
    assert_int_equal(changed, -7);
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_attention_decode_vmap(e, &m, 1, q, out, NULL));
    for (size_t i = 0; i < sizeof(out); i++)
        assert_int_equal(((uint8_t *)out)[i], 0x5a);

    assert_ok(kvh_vmap_release(e, m));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_vmap_release(e, m));
    /* The three slots the view held serve new blocks now. */
    kvh_seq late = tu_seq_new(e, 0);
    grow(e, late, 200, 3 * BT);
    expect_read(e, late, 200, 0, 3 * BT);
    for (int i = 0; i < nfill; i++)
        expect_read(e, fill[i], 100 + (uint32_t)i, 0, BT);
}

/* The same for blocks truncated away: the stale view shows them unchanged
 * while the sequence grows again into new blocks and others fill the
 * tier; the refresh then shows the new tokens. */
static void test_view_keeps_truncated_blocks(void **state)
{
    (void)state;
    kvh_engine *e = open_vmap(10, 0, 1);
    kvh_seq a = mk(e, 2, 3 * BT);
    kvh_vmap *m = view(e, a, 0, 8 * BT);
    assert_ok(kvh_seq_truncate(e, a, BT));
    expect_view(e, m, 2, 0, 3 * BT); /* stale: still the old three blocks */
    grow(e, a, 3, BT);               /* tokens 16..31 with another tag */
    expect_view(e, m, 2, 0, 3 * BT);
    kvh_seq other = tu_seq_new(e, 0);
    int32_t tok[BT];
    tu_iota(tok, BT, 777);
    int got = 0;
    for (int i = 0; i < 10; i++, got++) {
        kvh_status st = kvh_seq_append(e, other, tok, BT);
        if (st == KVH_ERR_NOSPACE)
            break;
        assert_ok(st);
        write_tag(e, other, 4, (uint64_t)i * BT, BT);
    }
    /* 10 slots: a's two live blocks and the two the view still holds. */
    assert_int_equal(got, 6);
    expect_view(e, m, 2, 0, 3 * BT);
    int32_t changed = -1;
    assert_ok(kvh_vmap_refresh(e, m, &changed));
    assert_int_equal(changed, 1);
    assert_int_equal(tu_vmap_view(e, m).n_tokens, 2 * BT);
    expect_view(e, m, 2, 0, BT);
    expect_view(e, m, 3, BT, BT);
    expect_read(e, a, 2, 0, BT);
    expect_read(e, a, 3, BT, BT);
    expect_read(e, other, 4, 0, 6 * BT);
    /* The refresh dropped the holds on the truncated blocks: their two
     * slots serve new blocks now. */
    for (int i = 6; i < 8; i++) {
        assert_ok(kvh_seq_append(e, other, tok, BT));
        write_tag(e, other, 4, (uint64_t)i * BT, BT);
    }
    expect_read(e, other, 4, 0, 8 * BT);
    expect_view(e, m, 2, 0, BT);
    expect_view(e, m, 3, BT, BT);
    assert_ok(kvh_vmap_release(e, m));
}

/* ================================================================== */
/* Many views at once                                                 */
/* ================================================================== */

/* Views of three sequences, both layers, two of the same sequence and
 * layer: each shows its own bytes; the holds count the views; a batch
 * naming them (one twice) equals paged decode of each sequence bit for
 * bit; releasing them one by one drops one hold each. */
static void test_many_views_no_mixup(void **state)
{
    (void)state;
    kvh_engine *e = open_vmap(32, 0, 1);
    kvh_seq s[3] = {mk(e, 10, 20), mk(e, 11, 37), mk(e, 12, 64)};
    uint64_t len[3] = {20, 37, 64};
    kvh_vmap *v[7];
    uint32_t vs[7], vl[7];
    int n = 0;
    for (int i = 0; i < 3; i++)
        for (uint32_t l = 0; l < L; l++) {
            vs[n] = (uint32_t)i;
            vl[n] = l;
            v[n++] = view(e, s[i], l, 0);
        }
    vs[n] = 1;
    vl[n] = 0;
    v[n++] = view(e, s[1], 0, 1024); /* a second view of s[1], layer 0 */
    for (int i = 0; i < n; i++) {
        kvh_vmap_view w = tu_vmap_view(e, v[i]);
        assert_int_equal(w.layer, vl[i]);
        assert_int_equal(w.n_tokens, len[vs[i]]);
        expect_view(e, v[i], 10 + vs[i], 0, len[vs[i]]);
        for (int j = 0; j < i; j++)
            assert_ptr_not_equal(v[i], v[j]);
    }
    assert_int_equal(tu_vmap_view(e, v[0]).capacity_tokens, 32);
    assert_int_equal(tu_vmap_view(e, v[2]).capacity_tokens, 64);
    assert_int_equal(tu_vmap_view(e, v[6]).capacity_tokens, 1024);
    assert_int_equal(tu_seq_binfo(e, s[1], 0).holds, 3);
    assert_int_equal(tu_seq_binfo(e, s[0], 0).holds, 2);

    /* One batch: views of layer 0 only, s[1]'s twice. */
    kvh_vmap *batch[4] = {v[0], v[2], v[6], v[4]};
    kvh_seq bseq[4] = {s[0], s[1], s[1], s[2]};
    float q[4 * H * D], a[4 * H * D], b[4 * H * D];
    fill_q(q, 4 * H * D, 5);
    memset(b, 0x7f, sizeof(b));
    assert_ok(kvh_attention_decode(e, 0, bseq, 4, q, a, NULL));
    assert_ok(kvh_attention_decode_vmap(e, batch, 4, q, b, NULL));
    assert_memory_equal(a, b, sizeof(a));
    /* Mixed layers: each row equals paged decode of its own layer. */
    kvh_vmap *mixed[3] = {v[1], v[2], v[5]};
    assert_ok(kvh_attention_decode_vmap(e, mixed, 3, q, b, NULL));
    for (int i = 0; i < 3; i++) {
        uint32_t l = tu_vmap_view(e, mixed[i]).layer;
        kvh_seq one = s[i];
        assert_ok(kvh_attention_decode(e, l, &one, 1, q + i * H * D, a, NULL));
        assert_memory_equal(a, b + i * H * D, sizeof(float) * H * D);
    }
    /* Prefill over the same view twice, chunks of 3 and 16. */
    uint32_t ql[2] = {3, 16};
    kvh_vmap *pv[2] = {v[6], v[2]};
    kvh_seq ps[2] = {s[1], s[1]};
    float pq[19 * H * D], pa[19 * H * D], pb[19 * H * D];
    fill_q(pq, 19 * H * D, 6);
    assert_ok(kvh_attention_prefill(e, 0, ps, ql, 2, pq, pa, NULL));
    assert_ok(kvh_attention_prefill_vmap(e, pv, ql, 2, pq, pb, NULL));
    assert_memory_equal(pa, pb, sizeof(pa));

    assert_ok(kvh_vmap_release(e, v[6]));
    assert_int_equal(tu_seq_binfo(e, s[1], 0).holds, 2);
    expect_view(e, v[2], 11, 0, 37); /* its twin is untouched */
    for (int i = 0; i < 6; i++)
        assert_ok(kvh_vmap_release(e, v[i]));
    for (int i = 0; i < 3; i++)
        for (uint64_t b0 = 0; b0 < (len[i] + BT - 1) / BT; b0++)
            assert_int_equal(tu_seq_binfo(e, s[i], b0).holds, 0);
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).pinned_blocks, 0);
}

/* Sequences whose blocks lie in scattered slots across the device tier's
 * 2 MiB slabs (interleaved allocation, holes refilled, copy-on-write of
 * blocks on either side of a slab boundary): views show each token's own
 * bytes, refresh remaps only what changed, decode equals paged. Where the
 * backing maps whole 2 MiB units (hugetlb), such views may be refused with
 * KVH_ERR_UNSUPPORTED instead. */
static void test_views_over_scattered_slots(void **state)
{
    (void)state;
    enum { NB = 560 }; /* past one slab: 512 blocks of one head's 4 KiB */
    kvh_engine *e = open_vmap(1200, 0, 1);
    kvh_seq a = tu_seq_new(e, 0), b = tu_seq_new(e, 0);
    for (int i = 0; i < NB; i++) {
        grow(e, a, 170, BT);
        if (i < 300)
            grow(e, b, 171, BT);
    }
    assert_ok(kvh_seq_free(e, b)); /* holes: every other slot of the first 600 */
    kvh_seq c = tu_seq_new(e, 0);
    grow(e, c, 172, 400 * BT + 5);
    kvh_vmap *ma = VM_SENTINEL, *mc = VM_SENTINEL;
    kvh_status st = kvh_seq_vmap(e, a, 1, 0, &ma);
    if (st == KVH_ERR_UNSUPPORTED) {
        assert_ptr_equal(ma, VM_SENTINEL);
        skip();
    }
    assert_ok(st);
    mc = view(e, c, 0, 0);
    print_message("backing %s, map unit %" PRIu64 "\n", tu_vmap_view(e, ma).backing, tu_vmap_view(e, ma).map_unit);
    expect_view(e, ma, 170, 0, NB * BT);
    expect_view(e, mc, 172, 0, 400 * BT + 5);
    float q[H * D], x[H * D], y[H * D];
    fill_q(q, H * D, 12);
    assert_ok(kvh_attention_decode(e, 1, &a, 1, q, x, NULL));
    assert_ok(kvh_attention_decode_vmap(e, &ma, 1, q, y, NULL));
    assert_memory_equal(x, y, sizeof(x));

    /* A fork shares every block; a's writes into full blocks around the
     * slab boundary and at the start go to copies. */
    kvh_seq f;
    assert_ok(kvh_seq_fork(e, a, 0, &f));
    const uint64_t hit[] = {0, 511, 512, 513, NB - 1};
    uint32_t *tags = tu_alloc(sizeof(uint32_t) * NB * BT);
    for (int i = 0; i < NB * BT; i++)
        tags[i] = 170;
    for (size_t i = 0; i < sizeof(hit) / sizeof(hit[0]); i++) {
        write_tag(e, a, 173, hit[i] * BT + 3, 2);
        tags[hit[i] * BT + 3] = tags[hit[i] * BT + 4] = 173;
    }
    int32_t changed = -1;
    st = kvh_vmap_refresh(e, ma, &changed);
    if (st == KVH_ERR_UNSUPPORTED)
        skip();
    assert_ok(st);
    assert_int_equal(changed, 1);
    kvh_vmap_view w = tu_vmap_view(e, ma);
    for (uint64_t t = 0; t < NB * BT; t++)
        for (uint32_t h = 0; h < H; h++) {
            const float *vk = (const float *)((const uint8_t *)w.k + h * w.head_stride) + t * D;
            const float *vv = (const float *)((const uint8_t *)w.v + h * w.head_stride) + t * D;
            for (uint32_t d = 0; d < D; d++) {
                float ek = kv_cell(tags[t], 1, t, h, 0, d), ev = kv_cell(tags[t], 1, t, h, 1, d);
                if (memcmp(&vk[d], &ek, 4) || memcmp(&vv[d], &ev, 4))
                    fail_msg("token %" PRIu64 " head %u dim %u after copy-on-write: K %g V %g, expected %g %g", t, h, d,
                             vk[d], vv[d], ek, ev);
            }
        }
    assert_ok(kvh_attention_decode(e, 1, &a, 1, q, x, NULL));
    assert_ok(kvh_attention_decode_vmap(e, &ma, 1, q, y, NULL));
    assert_memory_equal(x, y, sizeof(x));
    /* The refresh moved the holds from the originals to the copies. */
    for (size_t i = 0; i < sizeof(hit) / sizeof(hit[0]); i++) {
        assert_int_equal(tu_seq_binfo(e, f, hit[i]).holds, 0);
        assert_int_equal(tu_seq_binfo(e, a, hit[i]).holds, 1);
    }
    assert_int_equal(tu_seq_binfo(e, f, 1).holds, 1); /* shared, still mapped */
    expect_read(e, f, 170, 0, NB * BT);               /* the fork keeps the originals */
    kvh_vmap *mf = view(e, f, 1, 0);
    expect_view(e, mf, 170, 0, NB * BT);
    assert_ok(kvh_vmap_release(e, mf));
    assert_ok(kvh_vmap_release(e, ma));
    assert_ok(kvh_vmap_release(e, mc));
}

/* With an int8 host tier, blocks that went down and came back hold
 * decoded (lossy) values: a view shows exactly what kvh_seq_read_kv
 * returns, within the codec's bound of the written values, and decode
 * over it equals paged decode; a write into a block in the host tier
 * shows in the view made after it comes back. */
static void test_views_over_a_codec_host_tier(void **state)
{
    (void)state;
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F32, 8, 16, 1);
    c.vmap = 1;
    c.kv_codec = KVH_CODEC_INT8;
    kvh_engine *e = tu_open_cfg(&c);
    kvh_seq s = mk(e, 180, 40);
    assert_ok(kvh_seq_migrate(e, s, 0, 40, KVH_TIER_HOST, NULL));
    expect_tiers(e, s, 3, KVH_TIER_HOST);
    write_tag(e, s, 181, 36, 2); /* tokens 36, 37 written while encoded */
    assert_ok(kvh_seq_acquire(e, s, 0, 40, NULL));
    kvh_vmap *m = view(e, s, 1, 0);
    assert_ok(kvh_seq_release(e, s, 0, 40));
    kvh_vmap_view w = tu_vmap_view(e, m);
    float *k = tu_alloc(sizeof(float) * 40 * ROW), *v = tu_alloc(sizeof(float) * 40 * ROW);
    assert_ok(kvh_seq_read_kv(e, s, 1, 0, 40, k, v));
    for (uint64_t t = 0; t < 40; t++)
        for (uint32_t h = 0; h < H; h++) {
            const float *vk = (const float *)((const uint8_t *)w.k + h * w.head_stride) + t * D;
            const float *vv = (const float *)((const uint8_t *)w.v + h * w.head_stride) + t * D;
            assert_memory_equal(vk, &k[(t * H + h) * D], sizeof(float) * D);
            assert_memory_equal(vv, &v[(t * H + h) * D], sizeof(float) * D);
            uint32_t tag = (t == 36 || t == 37) ? 181 : 180;
            float maxk = 0, maxv = 0;
            for (uint32_t d = 0; d < D; d++) {
                maxk = fmaxf(maxk, fabsf(kv_cell(tag, 1, t, h, 0, d)));
                maxv = fmaxf(maxv, fabsf(kv_cell(tag, 1, t, h, 1, d)));
            }
            for (uint32_t d = 0; d < D; d++) {
                /* |x - x'| <= max|x| / 254, plus rounding slack */
                if (fabsf(vk[d] - kv_cell(tag, 1, t, h, 0, d)) > maxk / 254 * 1.001f + 1e-6f ||
                    fabsf(vv[d] - kv_cell(tag, 1, t, h, 1, d)) > maxv / 254 * 1.001f + 1e-6f)
                    fail_msg("token %" PRIu64 " head %u dim %u: view K %g V %g, written K %g V %g", t, h, d, vk[d],
                             vv[d], kv_cell(tag, 1, t, h, 0, d), kv_cell(tag, 1, t, h, 1, d));
            }
        }
    float q[H * D], a[H * D], b[H * D];
    fill_q(q, H * D, 13);
    assert_ok(kvh_attention_decode(e, 1, &s, 1, q, a, NULL));
    assert_ok(kvh_attention_decode_vmap(e, &m, 1, q, b, NULL));
    assert_memory_equal(a, b, sizeof(a));
    assert_ok(kvh_vmap_release(e, m));
}

/* ================================================================== */
/* Refresh that cannot map                                            */
/* ================================================================== */

/* A block appended outside the device tier: refresh is
 * KVH_ERR_NOT_RESIDENT, `changed` untouched, and the view stays usable
 * and stale (its old tokens readable, decode refused) until the block is
 * acquired; then the refresh maps it. */
static void test_refresh_not_resident_keeps_the_view(void **state)
{
    (void)state;
    kvh_engine *e = open_vmap(4, 8, 1);
    kvh_seq a = mk(e, 20, 2 * BT);
    kvh_vmap *m = view(e, a, 1, 4 * BT);
    kvh_seq b = mk(e, 21, 2 * BT);
    assert_ok(kvh_seq_acquire(e, b, 0, 2 * BT, NULL)); /* the device tier is all held now */
    uint64_t gen = tu_vmap_view(e, m).generation;
    grow(e, a, 20, BT); /* block 2 lands in the host tier */
    assert_int_equal(tier_of(e, a, 2), KVH_TIER_HOST);
    int32_t changed = -3;
    assert_kvh(KVH_ERR_NOT_RESIDENT, kvh_vmap_refresh(e, m, &changed));
    assert_int_equal(changed, -3);
    kvh_vmap_view w = tu_vmap_view(e, m);
    assert_int_equal(w.n_tokens, 2 * BT);
    assert_int_equal(w.generation, gen);
    expect_view(e, m, 20, 0, 2 * BT);
    float q[H * D], out[H * D], ref[H * D];
    fill_q(q, H * D, 7);
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_attention_decode_vmap(e, &m, 1, q, out, NULL));

    assert_ok(kvh_seq_release(e, b, 0, 2 * BT));
    assert_ok(kvh_seq_acquire(e, a, 2 * BT, BT, NULL));
    assert_ok(kvh_vmap_refresh(e, m, &changed));
    assert_int_equal(changed, 1);
    assert_true(tu_vmap_view(e, m).generation != gen);
    assert_int_equal(tu_vmap_view(e, m).n_tokens, 3 * BT);
    expect_view(e, m, 20, 0, 3 * BT);
    assert_ok(kvh_seq_release(e, a, 2 * BT, BT)); /* the view's hold stays */
    assert_ok(kvh_attention_decode(e, 1, &a, 1, q, ref, NULL));
    assert_ok(kvh_attention_decode_vmap(e, &m, 1, q, out, NULL));
    assert_memory_equal(out, ref, sizeof(out));
    expect_read(e, b, 21, 0, 2 * BT);
    assert_ok(kvh_vmap_release(e, m));
}

/* ================================================================== */
/* Empty views, capacities                                            */
/* ================================================================== */

/* A view of an empty sequence exists ("KVH_ERR_RANGE (a view of no
 * tokens)"); capacities round up to a power of two; the view grows to
 * its capacity and no further, and truncation to zero empties it. */
static void test_empty_views_and_capacity(void **state)
{
    (void)state;
    kvh_engine *e = open_vmap(16, 0, 1);
    kvh_seq s = tu_seq_new(e, 0);
    kvh_vmap *m = view(e, s, 1, 33);
    kvh_vmap_view w = tu_vmap_view(e, m);
    assert_int_equal(w.n_tokens, 0);
    assert_int_equal(w.capacity_tokens, 64);
    assert_int_equal(w.layer, 1);
    float q[H * D], out[H * D], ref[H * D];
    fill_q(q, H * D, 8);
    memset(out, 0x5a, sizeof(out));
    uint32_t one = 1;
    assert_kvh(KVH_ERR_RANGE, kvh_attention_decode_vmap(e, &m, 1, q, out, NULL));
    assert_kvh(KVH_ERR_RANGE, kvh_attention_prefill_vmap(e, &m, &one, 1, q, out, NULL));
    for (size_t i = 0; i < sizeof(out); i++)
        assert_int_equal(((uint8_t *)out)[i], 0x5a);

    grow(e, s, 30, 20);
    int32_t changed = -1;
    assert_ok(kvh_vmap_refresh(e, m, &changed));
    assert_int_equal(changed, 1);
    assert_int_equal(tu_vmap_view(e, m).n_tokens, 20);
    expect_view(e, m, 30, 0, 20);
    assert_ok(kvh_attention_decode(e, 1, &s, 1, q, ref, NULL));
    assert_ok(kvh_attention_decode_vmap(e, &m, 1, q, out, NULL));
    assert_memory_equal(out, ref, sizeof(out));

    assert_ok(kvh_seq_truncate(e, s, 0));
    assert_ok(kvh_vmap_refresh(e, m, &changed));
    assert_int_equal(changed, 1);
    assert_int_equal(tu_vmap_view(e, m).n_tokens, 0);
    assert_kvh(KVH_ERR_RANGE, kvh_attention_decode_vmap(e, &m, 1, q, out, NULL));

    /* Exactly the capacity fits; one more token does not, and the failed
     * refresh leaves the view as it was. */
    grow(e, s, 31, 64);
    assert_ok(kvh_vmap_refresh(e, m, &changed));
    assert_int_equal(tu_vmap_view(e, m).n_tokens, 64);
    uint64_t gen = tu_vmap_view(e, m).generation;
    grow(e, s, 31, 1);
    changed = -1;
    assert_kvh(KVH_ERR_RANGE, kvh_vmap_refresh(e, m, &changed));
    assert_int_equal(changed, -1);
    assert_int_equal(tu_vmap_view(e, m).n_tokens, 64);
    assert_int_equal(tu_vmap_view(e, m).generation, gen);
    expect_view(e, m, 31, 0, 64);
    assert_ok(kvh_seq_truncate(e, s, 64));
    assert_ok(kvh_vmap_refresh(e, m, NULL));
    assert_ok(kvh_attention_decode(e, 1, &s, 1, q, ref, NULL));
    assert_ok(kvh_attention_decode_vmap(e, &m, 1, q, out, NULL));
    assert_memory_equal(out, ref, sizeof(out));

    /* capacity 0 is the current length, rounded up. */
    kvh_seq t = mk(e, 32, 20);
    kvh_vmap *m2 = view(e, t, 0, 0);
    assert_int_equal(tu_vmap_view(e, m2).capacity_tokens, 32);
    assert_ok(kvh_vmap_release(e, m2));
    assert_ok(kvh_vmap_release(e, m));
}

/* ================================================================== */
/* Writes from another sequence's view                                */
/* ================================================================== */

/* K/V buffers may lie in the engine's own memory: a write into b whose k
 * and v are a's view takes a's bytes (view layout [head][token][dim]), and
 * a's view is unchanged by it. */
static void test_write_from_another_sequences_view(void **state)
{
    (void)state;
    kvh_engine *e = open_vmap(16, 0, 1);
    kvh_seq a = mk(e, 40, 40);
    kvh_vmap *m = view(e, a, 0, 0);
    kvh_vmap_view w = tu_vmap_view(e, m);
    kvh_seq b = tu_seq_new(e, 0);
    int32_t tok[4] = {1, 2, 3, 4};
    assert_ok(kvh_seq_append(e, b, tok, 4));
    /* b's tokens 0..3, head h, take rows 8 + 2t + h of a's head 0. */
    assert_ok(kvh_seq_write_kv(e, b, 1, 0, 4, (const float *)w.k + 8 * D, (const float *)w.v + 8 * D));
    float k[4 * ROW], v[4 * ROW];
    assert_ok(kvh_seq_read_kv(e, b, 1, 0, 4, k, v));
    for (uint32_t t = 0; t < 4; t++)
        for (uint32_t h = 0; h < H; h++)
            for (uint32_t d = 0; d < D; d++) {
                float ek = kv_cell(40, 0, 8 + 2 * t + h, 0, 0, d), ev = kv_cell(40, 0, 8 + 2 * t + h, 0, 1, d);
                assert_memory_equal(&k[(t * H + h) * D + d], &ek, 4);
                assert_memory_equal(&v[(t * H + h) * D + d], &ev, 4);
            }
    expect_view(e, m, 40, 0, 40);
    expect_read(e, a, 40, 0, 40);
    assert_ok(kvh_vmap_release(e, m));
}

/* "a block the sequence gave up (truncate, free) that a fork still holds
 * shows that fork's later writes into it": the parent truncates its
 * partial last block away, the fork (its only owner now) writes into it
 * in place, and the parent's stale view shows the fork's bytes there and
 * the parent's own everywhere else. */
static void test_stale_view_shows_a_forks_later_writes(void **state)
{
    (void)state;
    kvh_engine *e = open_vmap(16, 0, 1);
    kvh_seq p = mk(e, 120, 40); /* block 2: tokens 32..39, partial */
    kvh_vmap *m = view(e, p, 1, 0);
    kvh_seq c;
    assert_ok(kvh_seq_fork(e, p, 0, &c));
    assert_ok(kvh_seq_truncate(e, p, 32));
    write_tag(e, c, 121, 34, 3); /* tokens 34..36 of the fork */
    expect_read(e, c, 121, 34, 3);
    expect_read(e, c, 120, 0, 34);
    expect_read(e, p, 120, 0, 32);
    kvh_vmap_view w = tu_vmap_view(e, m);
    assert_int_equal(w.n_tokens, 40);
    expect_view(e, m, 120, 0, 34);
    expect_view(e, m, 121, 34, 3);
    expect_view(e, m, 120, 37, 3);
    /* Refreshed, the view drops the block; the fork keeps its data. */
    int32_t changed = -1;
    assert_ok(kvh_vmap_refresh(e, m, &changed));
    assert_int_equal(changed, 1);
    assert_int_equal(tu_vmap_view(e, m).n_tokens, 32);
    expect_view(e, m, 120, 0, 32);
    assert_ok(kvh_vmap_release(e, m));
    expect_read(e, c, 121, 34, 3);
}

/* With every device slot held by a view, nothing can be promoted: a
 * prefetch skips ("not an error", its fence too), a migration to the
 * device tier reports KVH_ERR_NOSPACE through its fence and by itself, and
 * the view's blocks stay where they are with their bytes. */
static void test_no_room_under_a_view(void **state)
{
    (void)state;
    kvh_engine *e = open_vmap(4, 8, 1);
    kvh_seq b = mk(e, 130, 2 * BT);
    assert_ok(kvh_seq_migrate(e, b, 0, 2 * BT, KVH_TIER_HOST, NULL));
    kvh_seq a = mk(e, 131, 4 * BT);
    kvh_vmap *m = view(e, a, 0, 0);
    uint32_t slot[4];
    for (uint64_t i = 0; i < 4; i++)
        slot[i] = tu_seq_binfo(e, a, i).slot;
    kvh_fence f;
    assert_ok(kvh_prefetch(e, b, 0, 2 * BT, INT32_MAX, &f));
    assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
    assert_ok(kvh_fence_free(e, f));
    expect_tiers(e, b, 2, KVH_TIER_HOST);
    assert_ok(kvh_seq_migrate(e, b, 0, 2 * BT, KVH_TIER_DEVICE, &f));
    assert_kvh(KVH_ERR_NOSPACE, kvh_fence_wait(e, f, UINT64_MAX));
    assert_ok(kvh_fence_free(e, f));
    assert_kvh(KVH_ERR_NOSPACE, kvh_seq_migrate(e, b, 0, 2 * BT, KVH_TIER_DEVICE, NULL));
    assert_kvh(KVH_ERR_NOSPACE, kvh_seq_acquire(e, b, 0, 2 * BT, NULL));
    expect_tiers(e, b, 2, KVH_TIER_HOST);
    assert_int_equal(tu_seq_binfo(e, b, 0).holds, 0); /* the failed acquire holds nothing */
    for (uint64_t i = 0; i < 4; i++) {
        assert_int_equal(tu_seq_binfo(e, a, i).tier, KVH_TIER_DEVICE);
        assert_int_equal(tu_seq_binfo(e, a, i).slot, slot[i]);
    }
    expect_view(e, m, 131, 0, 4 * BT);
    expect_read(e, b, 130, 0, 2 * BT);
    assert_ok(kvh_vmap_release(e, m));
    assert_ok(kvh_seq_migrate(e, b, 0, 2 * BT, KVH_TIER_DEVICE, NULL));
    expect_tiers(e, b, 2, KVH_TIER_DEVICE);
    expect_read(e, b, 130, 0, 2 * BT);
    expect_read(e, a, 131, 0, 4 * BT);
}

/* A NULL engine is KVH_ERR_INVALID_ARG for every view call, which then
 * changes nothing. */
static void test_null_engine_view_calls(void **state)
{
    (void)state;
    kvh_engine *e = open_vmap(16, 0, 1);
    kvh_seq s = mk(e, 140, 20);
    kvh_vmap *m = view(e, s, 0, 0);
    kvh_vmap *x = VM_SENTINEL;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_vmap(NULL, s, 0, 0, &x));
    assert_ptr_equal(x, VM_SENTINEL);
    int32_t changed = -4;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_vmap_refresh(NULL, m, &changed));
    assert_int_equal(changed, -4);
    kvh_vmap_view w = {.struct_size = sizeof(w), .layer = 66};
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_vmap_get(NULL, m, &w));
    assert_int_equal(w.layer, 66);
    float q[H * D] = {0}, out[H * D];
    memset(out, 0x44, sizeof(out));
    uint32_t one = 1;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_decode_vmap(NULL, &m, 1, q, out, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_prefill_vmap(NULL, &m, &one, 1, q, out, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_decode_vmap(e, NULL, 1, q, out, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_decode_vmap(e, &m, 1, NULL, out, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_decode_vmap(e, &m, 1, q, NULL, NULL));
    for (size_t i = 0; i < sizeof(out); i++)
        assert_int_equal(((uint8_t *)out)[i], 0x44);
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_vmap_release(NULL, m));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_vmap_refresh(e, NULL, &changed));
    assert_int_equal(changed, -4);
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_vmap_get(e, NULL, &w));
    assert_int_equal(w.layer, 66);
    assert_int_equal(tu_seq_binfo(e, s, 0).holds, 1); /* still the view's */
    expect_view(e, m, 140, 0, 20);
    assert_ok(kvh_vmap_release(e, m));
    assert_int_equal(tu_seq_binfo(e, s, 0).holds, 0);
}

/* Views of the largest capacity (2^31 tokens: terabytes of address space
 * each) until the address space runs out: every refusal is
 * KVH_ERR_NOMEM with nothing written, every view made shows the right
 * bytes, and once they are released views work as before. */
static void test_huge_views_until_refused(void **state)
{
    (void)state;
    enum { MAXV = 160 };
    kvh_engine *e = open_vmap(16, 0, 1);
    kvh_seq s = mk(e, 150, 20);
    kvh_vmap **v = tu_alloc(sizeof(*v) * MAXV);
    int n = 0, refused = 0;
    for (int i = 0; i < MAXV && refused < 2; i++) {
        kvh_vmap *m = VM_SENTINEL;
        kvh_status st = kvh_seq_vmap(e, s, (uint32_t)i & 1, 1ull << 31, &m);
        if (st == KVH_ERR_NOMEM) {
            assert_ptr_equal(m, VM_SENTINEL);
            refused++;
            continue;
        }
        assert_ok(st);
        v[n++] = m;
        assert_int_equal(tu_vmap_view(e, m).capacity_tokens, 1ull << 31);
    }
    print_message("%d views of 2^31 tokens made, %d refused\n", n, refused);
    for (int i = 0; i < n; i += 7)
        expect_view(e, v[i], 150, 0, 20);
    assert_int_equal(tu_seq_binfo(e, s, 0).holds, (uint32_t)n);
    for (int i = 0; i < n; i++)
        assert_ok(kvh_vmap_release(e, v[i]));
    assert_int_equal(tu_seq_binfo(e, s, 0).holds, 0);
    kvh_vmap *m = view(e, s, 1, 1ull << 31);
    expect_view(e, m, 150, 0, 20);
    assert_ok(kvh_vmap_release(e, m));
}

/* ================================================================== */
/* Fences                                                             */
/* ================================================================== */

/* NULL, zero, forged, freed and foreign fences, and handles of other
 * types passed as fences: each call gets its listed status and writes
 * nothing; the good fence keeps working through it all. */
static void test_fence_misuse(void **state)
{
    (void)state;
    kvh_engine *e = open_vmap(16, 16, 1);
    kvh_engine *other = open_vmap(16, 16, 1);
    kvh_seq s = mk(e, 50, 40);
    kvh_seq os = mk(other, 51, 20);
    kvh_fence f = FENCE_SENTINEL, of = FENCE_SENTINEL;
    assert_ok(kvh_seq_migrate(e, s, 0, 40, KVH_TIER_HOST, &f));
    assert_true(f.id != FENCE_SENTINEL.id && f.id != 0);
    assert_ok(kvh_seq_migrate(other, os, 0, 20, KVH_TIER_HOST, &of));
    assert_ok(kvh_fence_wait(e, f, UINT64_MAX));

    int32_t done = 77;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_fence_poll(e, f, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_fence_poll(NULL, f, &done));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_fence_wait(NULL, f, 0));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_fence_free(NULL, f));
    assert_int_equal(done, 77);

    kvh_vmap *m = NULL;
    assert_ok(kvh_seq_acquire(e, s, 0, 40, NULL));
    m = view(e, s, 0, 0);
    assert_ok(kvh_seq_release(e, s, 0, 40));
    kvh_block blk = tu_seq_block(e, s, 0);
    const kvh_fence bad[] = {
        {0},
        {1},
        {UINT64_MAX},
        {f.id ^ 1},
        {f.id + (1ull << 32)},
        {f.id ^ (1ull << 40)},
        {s.id},
        {blk.id},
        {(uint64_t)(uintptr_t)m},
        {of.id},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        done = 77;
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_poll(e, bad[i], &done));
        assert_int_equal(done, 77);
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_wait(e, bad[i], 0));
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_wait(e, bad[i], UINT64_MAX));
        if (bad[i].id != 0)
            assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_free(e, bad[i]));
    }
    assert_ok(kvh_fence_free(e, (kvh_fence){0})); /* the null handle */
    /* Fences passed as other handles. */
    uint64_t len = 0;
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_length(e, (kvh_seq){f.id}, &len));
    kvh_block_info bi = {.struct_size = sizeof(bi)};
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_info_get(e, (kvh_block){f.id}, &bi));
    kvh_vmap_view vw = {.struct_size = sizeof(vw), .layer = 99};
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_vmap_get(e, (kvh_vmap *)(uintptr_t)f.id, &vw));
    assert_int_equal(vw.layer, 99);
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_vmap_release(e, (kvh_vmap *)(uintptr_t)f.id));

    /* The good fences still answer, each in its own engine. */
    done = 0;
    assert_ok(kvh_fence_poll(e, f, &done));
    assert_int_equal(done, 1);
    assert_ok(kvh_fence_wait(e, f, 0));
    assert_ok(kvh_fence_wait(other, of, UINT64_MAX));
    assert_ok(kvh_fence_free(other, of));
    /* Freed: every call refuses it, again and again. */
    assert_ok(kvh_fence_free(e, f));
    for (int i = 0; i < 2; i++) {
        done = 77;
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_free(e, f));
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_poll(e, f, &done));
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_wait(e, f, UINT64_MAX));
        assert_int_equal(done, 77);
    }
    /* A new fence does not revive the old value. */
    kvh_fence g;
    assert_ok(kvh_seq_migrate(e, s, 0, 40, KVH_TIER_DEVICE, &g));
    assert_true(g.id != f.id);
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_wait(e, f, UINT64_MAX));
    assert_ok(kvh_fence_wait(e, g, UINT64_MAX));
    assert_ok(kvh_fence_free(e, g));
    expect_view(e, m, 50, 0, 40);
    expect_read(e, s, 50, 0, 40);
    expect_read(other, os, 51, 0, 20);
    assert_ok(kvh_vmap_release(e, m));
}

/* A fence reports the first error of its work (NOSPACE: the host tier
 * holds 2 of the 6 blocks), on every wait and poll, with done = 1; the
 * same moves without a fence return it. The data is intact wherever the
 * blocks ended up. */
static void test_fence_reports_the_first_error(void **state)
{
    (void)state;
    kvh_engine *e = open_vmap(16, 2, 1);
    kvh_seq s = mk(e, 60, 6 * BT);
    kvh_fence f = FENCE_SENTINEL;
    assert_ok(kvh_seq_migrate(e, s, 0, 6 * BT, KVH_TIER_HOST, &f));
    assert_kvh(KVH_ERR_NOSPACE, kvh_fence_wait(e, f, UINT64_MAX));
    assert_kvh(KVH_ERR_NOSPACE, kvh_fence_wait(e, f, 0));
    int32_t done = 0;
    assert_kvh(KVH_ERR_NOSPACE, kvh_fence_poll(e, f, &done));
    assert_int_equal(done, 1);
    assert_ok(kvh_fence_free(e, f));
    assert_true(tu_tier(e, KVH_TIER_HOST).used_blocks <= 2);
    expect_read(e, s, 60, 0, 6 * BT);
    assert_kvh(KVH_ERR_NOSPACE, kvh_seq_migrate(e, s, 0, 6 * BT, KVH_TIER_HOST, NULL));
    expect_read(e, s, 60, 0, 6 * BT);
    /* Back up: no error; a fence for moves to where blocks already are
     * completes without one. */
    assert_ok(kvh_seq_migrate(e, s, 0, 6 * BT, KVH_TIER_DEVICE, &f));
    assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
    assert_ok(kvh_fence_free(e, f));
    for (uint64_t b = 0; b < 6; b++)
        assert_int_equal(tier_of(e, s, b), KVH_TIER_DEVICE);
    assert_ok(kvh_seq_migrate(e, s, 0, 6 * BT, KVH_TIER_DEVICE, &f));
    assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
    assert_ok(kvh_fence_free(e, f));
    /* A fence freed with its work pending: the work still completes. */
    assert_ok(kvh_seq_migrate(e, s, 0, 2 * BT, KVH_TIER_HOST, &f));
    assert_ok(kvh_fence_free(e, f));
    assert_ok(kvh_seq_migrate(e, s, 0, 2 * BT, KVH_TIER_HOST, NULL));
    assert_int_equal(tier_of(e, s, 0), KVH_TIER_HOST);
    assert_int_equal(tier_of(e, s, 1), KVH_TIER_HOST);
    expect_read(e, s, 60, 0, 6 * BT);
}

/* A fence whose work cannot finish: wait with a deadline is
 * KVH_ERR_TIMEOUT, poll is KVH_OK with done = 0, repeatedly; views of
 * resident blocks are made and used meanwhile; a fence freed while its
 * work waits in the queue leaves the work to complete. */
static void test_pending_fences_time_out(void **state)
{
    (void)state;
    kvh_engine *e = open_vmap(16, 16, 1);
    kvh_seq s = mk(e, 160, 40);
    kvh_seq t = mk(e, 161, 40);
    uffd_gate g;
    if (!uffd_gate_arm(e, &g, (uffd_gate_geometry){L, BT, H, D}, 990000))
        skip();
    for (int i = 0; i < 3; i++) {
        assert_kvh(KVH_ERR_TIMEOUT, kvh_fence_wait(e, g.fence, 0));
        assert_kvh(KVH_ERR_TIMEOUT, kvh_fence_wait(e, g.fence, 2 * 1000 * 1000));
        int32_t done = 9;
        assert_ok(kvh_fence_poll(e, g.fence, &done));
        assert_int_equal(done, 0);
    }
    kvh_vmap *m = view(e, s, 0, 0);
    expect_view(e, m, 160, 0, 40);
    float q[H * D], a[H * D], b[H * D];
    fill_q(q, H * D, 11);
    assert_ok(kvh_attention_decode(e, 0, &s, 1, q, a, NULL));
    assert_ok(kvh_attention_decode_vmap(e, &m, 1, q, b, NULL));
    assert_memory_equal(a, b, sizeof(a));
    /* Queued behind the gathering worker (or done at once: both are fine). */
    kvh_fence f;
    assert_ok(kvh_seq_migrate(e, t, 0, 40, KVH_TIER_HOST, &f));
    int32_t done = 9;
    assert_ok(kvh_fence_poll(e, f, &done));
    assert_true(done == 0 || done == 1);
    if (done == 0)
        assert_kvh(KVH_ERR_TIMEOUT, kvh_fence_wait(e, f, 1000 * 1000));
    assert_ok(kvh_fence_free(e, f));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_poll(e, f, &done));
    uffd_gate_open(&g);
    assert_ok(kvh_fence_wait(e, g.fence, UINT64_MAX));
    done = 0;
    assert_ok(kvh_fence_poll(e, g.fence, &done));
    assert_int_equal(done, 1);
    assert_ok(kvh_fence_free(e, g.fence));
    assert_ok(g.x.status);
    assert_ok(kvh_block_release(e, g.x.block));
    assert_ok(kvh_pool_unregister(e, g.pool));
    close(g.fd);
    munmap(g.mem, g.len);
    /* The freed fence's migration completed (a synchronous one to the same
     * tier finds nothing left to move). */
    assert_ok(kvh_seq_migrate(e, t, 0, 40, KVH_TIER_HOST, NULL));
    expect_tiers(e, t, 3, KVH_TIER_HOST);
    expect_read(e, t, 161, 0, 40);
    expect_view(e, m, 160, 0, 40);
    assert_ok(kvh_vmap_release(e, m));
}

static void *open_gate_later(void *arg)
{
    dt_sleep_ms(60);
    uffd_gate *g = arg;
    struct uffdio_zeropage z = {.range = {(uintptr_t)g->mem, g->len}};
    if (ioctl(g->fd, UFFDIO_ZEROPAGE, &z) != 0)
        fprintf(stderr, "UFFDIO_ZEROPAGE failed\n");
    return NULL;
}

/* Deadlines far in the future ("UINT64_MAX: no limit"; anything below it
 * is centuries) wait for the work, as UINT64_MAX does: a deadline that
 * overflowed would time out at once. */
static void test_far_deadlines_wait_for_the_work(void **state)
{
    (void)state;
    const uint64_t far[] = {UINT64_MAX - 1, (uint64_t)INT64_MAX + 1, (uint64_t)INT64_MAX, UINT64_MAX / 1000 * 999};
    for (size_t i = 0; i < sizeof(far) / sizeof(far[0]); i++) {
        kvh_engine *e = open_vmap(16, 16, 1);
        uffd_gate g;
        if (!uffd_gate_arm(e, &g, (uffd_gate_geometry){L, BT, H, D}, 990000))
            skip();
        pthread_t th;
        assert_int_equal(pthread_create(&th, NULL, open_gate_later, &g), 0);
        kvh_status st = kvh_fence_wait(e, g.fence, far[i]);
        int32_t done = 0;
        kvh_status ps = kvh_fence_poll(e, g.fence, &done);
        pthread_join(th, NULL);
        if (st != KVH_OK)
            fail_msg("kvh_fence_wait(timeout %" PRIu64 " ns) returned %s with the work pending (poll: %s, done %d)",
                     far[i], kvh_status_name(st), kvh_status_name(ps), done);
        assert_ok(ps);
        assert_int_equal(done, 1);
        assert_ok(kvh_fence_free(e, g.fence));
        assert_ok(kvh_block_release(e, g.x.block));
        assert_ok(tu_close(e));
        close(g.fd);
        munmap(g.mem, g.len);
    }
}

/* ================================================================== */
/* Migration and prefetch misuse                                      */
/* ================================================================== */

static void test_migrate_misuse_moves_nothing(void **state)
{
    (void)state;
    kvh_engine *e = open_vmap(16, 16, 1);
    kvh_seq s = mk(e, 70, 40); /* 3 blocks */
    kvh_block blk[3];
    assert_ok(kvh_seq_blocks(e, s, 0, 3, blk));
    kvh_block gone;
    assert_ok(kvh_block_alloc(e, 0, &gone));
    assert_ok(kvh_block_release(e, gone));
    kvh_seq freed = mk(e, 71, 4);
    assert_ok(kvh_seq_free(e, freed));
    kvh_fence f = FENCE_SENTINEL;

#define REFUSED(expected, expr)                                                                                        \
    do {                                                                                                               \
        f = FENCE_SENTINEL;                                                                                            \
        assert_kvh(expected, expr);                                                                                    \
        assert_int_equal(f.id, FENCE_SENTINEL.id);                                                                     \
        expect_tiers(e, s, 3, KVH_TIER_DEVICE);                                                                        \
    } while (0)

    REFUSED(KVH_ERR_INVALID_ARG, kvh_migrate(e, NULL, 2, KVH_TIER_HOST, &f));
    REFUSED(KVH_ERR_INVALID_ARG, kvh_migrate(NULL, blk, 3, KVH_TIER_HOST, &f));
    REFUSED(KVH_ERR_INVALID_ARG, kvh_migrate(e, blk, 3, KVH_TIER_DISK, &f)); /* no disk tier */
    REFUSED(KVH_ERR_INVALID_ARG, kvh_migrate(e, blk, 3, KVH_TIER_COUNT, &f));
    REFUSED(KVH_ERR_INVALID_ARG, kvh_migrate(e, blk, 3, UINT32_MAX, &f));
    kvh_block mixed[4][3] = {
        {blk[0], gone, blk[2]},
        {blk[0], blk[1], {0}},
        {{~blk[1].id}, blk[0], blk[2]},
        {blk[0], {s.id}, blk[2]},
    };
    for (int i = 0; i < 4; i++) {
        REFUSED(KVH_ERR_BAD_HANDLE, kvh_migrate(e, mixed[i], 3, KVH_TIER_HOST, &f));
        REFUSED(KVH_ERR_BAD_HANDLE, kvh_migrate(e, mixed[i], 3, KVH_TIER_HOST, NULL));
    }
    REFUSED(KVH_ERR_RANGE, kvh_seq_migrate(e, s, 40, 1, KVH_TIER_HOST, &f));
    REFUSED(KVH_ERR_RANGE, kvh_seq_migrate(e, s, 0, 41, KVH_TIER_HOST, &f));
    REFUSED(KVH_ERR_RANGE, kvh_seq_migrate(e, s, UINT64_MAX, 2, KVH_TIER_HOST, &f));
    REFUSED(KVH_ERR_RANGE, kvh_seq_migrate(e, s, 1, UINT64_MAX, KVH_TIER_HOST, &f));
    REFUSED(KVH_ERR_RANGE, kvh_seq_migrate(e, s, 1ull << 63, 1ull << 63, KVH_TIER_HOST, NULL));
    REFUSED(KVH_ERR_BAD_HANDLE, kvh_seq_migrate(e, freed, 0, 1, KVH_TIER_HOST, &f));
    REFUSED(KVH_ERR_BAD_HANDLE, kvh_seq_migrate(e, (kvh_seq){0}, 0, 1, KVH_TIER_HOST, &f));
    REFUSED(KVH_ERR_BAD_HANDLE, kvh_seq_migrate(e, (kvh_seq){blk[0].id}, 0, 1, KVH_TIER_HOST, &f));
    REFUSED(KVH_ERR_INVALID_ARG, kvh_seq_migrate(e, s, 0, 40, KVH_TIER_DISK, &f));
    REFUSED(KVH_ERR_INVALID_ARG, kvh_seq_migrate(e, s, 0, 40, 7, NULL));
#undef REFUSED

    /* No blocks: nothing to do, and the fence completes. */
    assert_ok(kvh_migrate(e, NULL, 0, KVH_TIER_HOST, NULL));
    assert_ok(kvh_migrate(e, blk, 0, KVH_TIER_HOST, &f));
    assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
    assert_ok(kvh_fence_free(e, f));
    expect_tiers(e, s, 3, KVH_TIER_DEVICE);
    /* The same block named three times moves once, and comes back. */
    kvh_block thrice[3] = {blk[1], blk[1], blk[1]};
    assert_ok(kvh_migrate(e, thrice, 3, KVH_TIER_HOST, &f));
    assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
    assert_ok(kvh_fence_free(e, f));
    assert_int_equal(tier_of(e, s, 1), KVH_TIER_HOST);
    assert_int_equal(tier_of(e, s, 0), KVH_TIER_DEVICE);
    expect_read(e, s, 70, 0, 40);
    assert_ok(kvh_migrate(e, blk, 3, KVH_TIER_HOST, NULL));
    expect_tiers(e, s, 3, KVH_TIER_HOST);
    expect_read(e, s, 70, 0, 40);
    assert_ok(kvh_seq_migrate(e, s, 17, 1, KVH_TIER_DEVICE, NULL)); /* block 1 only */
    assert_int_equal(tier_of(e, s, 1), KVH_TIER_DEVICE);
    assert_int_equal(tier_of(e, s, 0), KVH_TIER_HOST);
    expect_read(e, s, 70, 0, 40);
}

/* kvh_prefetch: its listed statuses with nothing written, and a prefetch
 * that promotes "never holds anything". */
static void test_prefetch_misuse_and_no_holds(void **state)
{
    (void)state;
    kvh_engine *e = open_vmap(16, 16, 1);
    kvh_seq s = mk(e, 80, 40);
    kvh_seq freed = mk(e, 81, 4);
    assert_ok(kvh_seq_free(e, freed));
    assert_ok(kvh_seq_migrate(e, s, 0, 40, KVH_TIER_HOST, NULL));
    expect_tiers(e, s, 3, KVH_TIER_HOST);
    kvh_fence f = FENCE_SENTINEL;
    assert_kvh(KVH_ERR_RANGE, kvh_prefetch(e, s, 40, 1, 0, &f));
    assert_kvh(KVH_ERR_RANGE, kvh_prefetch(e, s, 0, 41, 0, &f));
    assert_kvh(KVH_ERR_RANGE, kvh_prefetch(e, s, UINT64_MAX, 2, 0, &f));
    assert_kvh(KVH_ERR_RANGE, kvh_prefetch(e, s, 2, UINT64_MAX, 0, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_prefetch(e, freed, 0, 1, 0, &f));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_prefetch(e, (kvh_seq){0}, 0, 1, 0, &f));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_prefetch(e, (kvh_seq){~s.id}, 0, 1, 0, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_prefetch(NULL, s, 0, 1, 0, &f));
    assert_int_equal(f.id, FENCE_SENTINEL.id);
    expect_tiers(e, s, 3, KVH_TIER_HOST);

    assert_ok(kvh_prefetch(e, s, 0, 40, INT32_MIN, &f));
    assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
    assert_ok(kvh_fence_free(e, f));
    for (uint64_t b = 0; b < 3; b++) {
        kvh_block_info bi = tu_seq_binfo(e, s, b);
        assert_int_equal(bi.tier, KVH_TIER_DEVICE); /* free device slots: promoted */
        assert_int_equal(bi.holds, 0);
        assert_int_equal(bi.pins, 0);
    }
    expect_read(e, s, 80, 0, 40);
    /* Nothing held: the blocks demote again, and a view needs them back. */
    assert_ok(kvh_seq_migrate(e, s, 0, 40, KVH_TIER_HOST, NULL));
    expect_tiers(e, s, 3, KVH_TIER_HOST);
    kvh_vmap *m = VM_SENTINEL;
    assert_kvh(KVH_ERR_NOT_RESIDENT, kvh_seq_vmap(e, s, 0, 0, &m));
    assert_ptr_equal(m, VM_SENTINEL);
    assert_ok(kvh_prefetch(e, s, 0, 40, INT32_MAX, NULL));
    /* Without a fence the promotion may still be under way: wait for it
     * through a synchronous migration to the same tier. */
    assert_ok(kvh_seq_migrate(e, s, 0, 40, KVH_TIER_DEVICE, NULL));
    m = view(e, s, 0, 0);
    expect_view(e, m, 80, 0, 40);
    assert_ok(kvh_vmap_release(e, m));
}

/* ================================================================== */
/* Views and a disk tier                                              */
/* ================================================================== */

/* Blocks on disk cannot be mapped (KVH_ERR_NOT_RESIDENT, nothing
 * written); acquired, they can, and the view's hold keeps them in the
 * device tier against demotions to host and disk with and without a
 * fence; released, they go to disk and read back exact. */
static void test_views_with_a_disk_tier(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("vmap_hostile_disk", dir, sizeof(dir));
    kvh_config c = dt_cfg(GEO, dir, 8, 4, 64, 1);
    c.vmap = 1;
    kvh_engine *e = dt_open_a(&c);
    kvh_seq s = mk(e, 90, 3 * BT);
    assert_ok(kvh_seq_migrate(e, s, 0, 3 * BT, KVH_TIER_DISK, NULL));
    expect_tiers(e, s, 3, KVH_TIER_DISK);
    kvh_vmap *m = VM_SENTINEL;
    assert_kvh(KVH_ERR_NOT_RESIDENT, kvh_seq_vmap(e, s, 1, 0, &m));
    assert_ptr_equal(m, VM_SENTINEL);
    assert_ok(kvh_seq_acquire(e, s, 0, 3 * BT, NULL));
    m = view(e, s, 1, 0);
    assert_ok(kvh_seq_release(e, s, 0, 3 * BT));
    expect_view(e, m, 90, 0, 3 * BT);
    uint32_t slot[3];
    for (uint64_t b = 0; b < 3; b++)
        slot[b] = tu_seq_binfo(e, s, b).slot;
    kvh_fence f;
    assert_ok(kvh_seq_migrate(e, s, 0, 3 * BT, KVH_TIER_DISK, &f));
    kvh_status st = kvh_fence_wait(e, f, UINT64_MAX);
    assert_true(st == KVH_OK || st == KVH_ERR_BUSY);
    assert_ok(kvh_fence_free(e, f));
    st = kvh_seq_migrate(e, s, 0, 3 * BT, KVH_TIER_HOST, NULL);
    assert_true(st == KVH_OK || st == KVH_ERR_BUSY);
    kvh_block blk[3];
    assert_ok(kvh_seq_blocks(e, s, 0, 3, blk));
    st = kvh_migrate(e, blk, 3, KVH_TIER_DISK, NULL);
    assert_true(st == KVH_OK || st == KVH_ERR_BUSY);
    for (uint64_t b = 0; b < 3; b++) {
        kvh_block_info bi = tu_seq_binfo(e, s, b);
        assert_int_equal(bi.tier, KVH_TIER_DEVICE);
        assert_int_equal(bi.slot, slot[b]);
    }
    expect_view(e, m, 90, 0, 3 * BT);
    float q[H * D], a[H * D], b[H * D];
    fill_q(q, H * D, 9);
    assert_ok(kvh_attention_decode(e, 1, &s, 1, q, a, NULL));
    assert_ok(kvh_attention_decode_vmap(e, &m, 1, q, b, NULL));
    assert_memory_equal(a, b, sizeof(a));
    assert_ok(kvh_vmap_release(e, m));
    assert_ok(kvh_seq_migrate(e, s, 0, 3 * BT, KVH_TIER_DISK, NULL));
    expect_tiers(e, s, 3, KVH_TIER_DISK);
    expect_read(e, s, 90, 0, 3 * BT);
}

/* ================================================================== */
/* Handles of other types, engines and closed engines                 */
/* ================================================================== */

static void expect_bad_view(kvh_engine *e, kvh_vmap *m)
{
    kvh_vmap_view vw = {.struct_size = sizeof(vw), .layer = 55};
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_vmap_get(e, m, &vw));
    assert_int_equal(vw.layer, 55);
    int32_t changed = -9;
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_vmap_refresh(e, m, &changed));
    assert_int_equal(changed, -9);
    float q[H * D] = {0}, out[H * D];
    memset(out, 0x33, sizeof(out));
    uint32_t one = 1;
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_attention_decode_vmap(e, &m, 1, q, out, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_attention_prefill_vmap(e, &m, &one, 1, q, out, NULL));
    for (size_t i = 0; i < sizeof(out); i++)
        assert_int_equal(((uint8_t *)out)[i], 0x33);
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_vmap_release(e, m));
}

/* Sequence, block and fence values passed as views (and views passed as
 * sequences and blocks) are refused; the view and the handles keep
 * working. */
static void test_other_handle_types_as_views(void **state)
{
    (void)state;
    kvh_engine *e = open_vmap(16, 16, 1);
    kvh_seq s = mk(e, 100, 30);
    kvh_vmap *m = view(e, s, 0, 0);
    kvh_fence f;
    kvh_seq s2 = mk(e, 101, 20);
    assert_ok(kvh_seq_migrate(e, s2, 0, 20, KVH_TIER_HOST, &f));
    kvh_block blk = tu_seq_block(e, s, 0);
    expect_bad_view(e, (kvh_vmap *)(uintptr_t)s.id);
    expect_bad_view(e, (kvh_vmap *)(uintptr_t)blk.id);
    expect_bad_view(e, (kvh_vmap *)(uintptr_t)f.id);
    uint64_t id = (uint64_t)(uintptr_t)m;
    uint64_t len = 0;
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_length(e, (kvh_seq){id}, &len));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_free(e, (kvh_seq){id}));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_migrate(e, (kvh_seq){id}, 0, 1, KVH_TIER_HOST, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_prefetch(e, (kvh_seq){id}, 0, 1, 0, NULL));
    kvh_block as_block = {id};
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_migrate(e, &as_block, 1, KVH_TIER_HOST, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_release(e, as_block));
    kvh_vmap *as_view = VM_SENTINEL;
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_vmap(e, (kvh_seq){id}, 0, 0, &as_view));
    assert_ptr_equal(as_view, VM_SENTINEL);
    assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
    assert_ok(kvh_fence_free(e, f));
    expect_view(e, m, 100, 0, 30);
    int32_t changed = -1;
    assert_ok(kvh_vmap_refresh(e, m, &changed));
    assert_int_equal(changed, 0);
    assert_int_equal(tu_seq_len(e, s), 30);
    assert_ok(kvh_vmap_release(e, m));
    expect_read(e, s2, 101, 0, 20);
}

/* Views, fences and sequences left alive at close: close releases them
 * (nothing leaks, under ASan), and their values mean nothing to the next
 * engine, whose own handles work. */
static void test_handles_of_a_closed_engine(void **state)
{
    (void)state;
    kvh_engine *a = open_vmap(16, 16, 2);
    kvh_seq s = mk(a, 110, 40);
    kvh_vmap *m0 = view(a, s, 0, 0);
    kvh_vmap *m1 = view(a, s, 1, 4096);
    kvh_seq t = mk(a, 111, 40);
    kvh_fence f, pending;
    assert_ok(kvh_seq_migrate(a, t, 0, 40, KVH_TIER_HOST, &f));
    assert_ok(kvh_fence_wait(a, f, UINT64_MAX));
    assert_ok(kvh_seq_migrate(a, t, 0, 40, KVH_TIER_DEVICE, &pending)); /* maybe still queued at close */
    kvh_block kept = tu_seq_block(a, s, 0);
    assert_ok(kvh_block_retain(a, kept));
    kvh_seq orphan = mk(a, 113, 20);
    kvh_vmap *om = view(a, orphan, 1, 0);
    assert_ok(kvh_seq_free(a, orphan)); /* its view stays open at close */
    assert_ok(tu_close(a));

    kvh_engine *b = open_vmap(16, 16, 2);
    kvh_seq bs = mk(b, 112, 40);
    kvh_vmap *bm = view(b, bs, 0, 0);
    expect_bad_view(b, m0);
    expect_bad_view(b, m1);
    expect_bad_view(b, om);
    int32_t done = 5;
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_poll(b, f, &done));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_wait(b, pending, UINT64_MAX));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_free(b, pending));
    assert_int_equal(done, 5);
    kvh_vmap *x = VM_SENTINEL;
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_vmap(b, s, 0, 0, &x));
    assert_ptr_equal(x, VM_SENTINEL);
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_migrate(b, t, 0, 1, KVH_TIER_HOST, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_prefetch(b, t, 0, 1, 0, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_migrate(b, &kept, 1, KVH_TIER_HOST, NULL));
    expect_view(b, bm, 112, 0, 40);
    expect_read(b, bs, 112, 0, 40);
    assert_ok(kvh_vmap_release(b, bm));
}

static int teardown(void **state)
{
    dt_teardown(state);
    return tu_teardown(state);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_view_outlives_its_freed_sequence, tu_teardown),
        cmocka_unit_test_teardown(test_view_keeps_truncated_blocks, tu_teardown),
        cmocka_unit_test_teardown(test_many_views_no_mixup, tu_teardown),
        cmocka_unit_test_teardown(test_views_over_scattered_slots, tu_teardown),
        cmocka_unit_test_teardown(test_views_over_a_codec_host_tier, tu_teardown),
        cmocka_unit_test_teardown(test_refresh_not_resident_keeps_the_view, tu_teardown),
        cmocka_unit_test_teardown(test_empty_views_and_capacity, tu_teardown),
        cmocka_unit_test_teardown(test_write_from_another_sequences_view, tu_teardown),
        cmocka_unit_test_teardown(test_stale_view_shows_a_forks_later_writes, tu_teardown),
        cmocka_unit_test_teardown(test_no_room_under_a_view, tu_teardown),
        cmocka_unit_test_teardown(test_null_engine_view_calls, tu_teardown),
        cmocka_unit_test_teardown(test_huge_views_until_refused, tu_teardown),
        cmocka_unit_test_teardown(test_fence_misuse, tu_teardown),
        cmocka_unit_test_teardown(test_fence_reports_the_first_error, tu_teardown),
        cmocka_unit_test_teardown(test_pending_fences_time_out, tu_teardown),
        cmocka_unit_test_teardown(test_far_deadlines_wait_for_the_work, tu_teardown),
        cmocka_unit_test_teardown(test_migrate_misuse_moves_nothing, tu_teardown),
        cmocka_unit_test_teardown(test_prefetch_misuse_and_no_holds, tu_teardown),
        cmocka_unit_test_teardown(test_views_with_a_disk_tier, teardown),
        cmocka_unit_test_teardown(test_other_handle_types_as_views, tu_teardown),
        cmocka_unit_test_teardown(test_handles_of_a_closed_engine, tu_teardown),
    };
    return cmocka_run_group_tests_name("vmap_hostile", tests, NULL, NULL);
}
