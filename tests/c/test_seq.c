/* Sequences: append / write / read round trips, truncate, fork + CoW,
 * prefix matching, block tables, tokens. */
#include "test_util.h"

/* ---- round trips in every dtype ---- */

static void roundtrip_one(uint32_t dtype, uint32_t bt, size_t len, uint64_t seed)
{
    const uint32_t L = 3, H = 2, D = 8;
    kvh_engine *e = tu_open(L, H, D, bt, dtype, 64, 0, 0);
    size_t tok = (size_t)H * D * tu_dtype_size(dtype);
    tu_rng r = {seed};
    kvh_seq s = tu_seq_new(e, 1);
    int32_t *toks = tu_alloc(sizeof(int32_t) * len);
    for (size_t i = 0; i < len; i++)
        toks[i] = (int32_t)tu_next(&r);
    /* Append in random chunks. */
    for (size_t done = 0; done < len;) {
        size_t n = 1 + tu_below(&r, bt + 3);
        if (n > len - done)
            n = len - done;
        assert_ok(kvh_seq_append(e, s, toks + done, n));
        done += n;
        assert_int_equal(tu_seq_len(e, s), done);
    }
    /* Reference KV, written in random chunks per layer, in random order. */
    uint8_t *rk = tu_alloc(L * len * tok), *rv = tu_alloc(L * len * tok);
    tu_fill(&r, rk, L * len * tok);
    tu_fill(&r, rv, L * len * tok);
    for (uint32_t l = 0; l < L; l++) {
        size_t pos = 0;
        while (pos < len) {
            size_t n = 1 + tu_below(&r, 2 * bt + 1);
            if (n > len - pos)
                n = len - pos;
            assert_ok(kvh_seq_write_kv(e, s, l, pos, n, rk + (l * len + pos) * tok, rv + (l * len + pos) * tok));
            pos += n;
        }
    }
    /* Whole range, each layer. */
    uint8_t *k = tu_alloc(len * tok), *v = tu_alloc(len * tok);
    for (uint32_t l = 0; l < L; l++) {
        memset(k, 0, len * tok);
        memset(v, 0, len * tok);
        assert_ok(kvh_seq_read_kv(e, s, l, 0, len, k, v));
        assert_memory_equal(k, rk + l * len * tok, len * tok);
        assert_memory_equal(v, rv + l * len * tok, len * tok);
    }
    /* Random sub-ranges, K only and V only. */
    for (int i = 0; i < 40; i++) {
        uint32_t l = (uint32_t)tu_below(&r, L);
        size_t pos = tu_below(&r, len);
        size_t n = 1 + tu_below(&r, len - pos);
        int which = (int)tu_below(&r, 3);
        memset(k, 0x5A, len * tok);
        memset(v, 0x5A, len * tok);
        assert_ok(kvh_seq_read_kv(e, s, l, pos, n, which == 2 ? NULL : k, which == 1 ? NULL : v));
        if (which != 2)
            assert_memory_equal(k, rk + (l * len + pos) * tok, n * tok);
        else
            assert_int_equal(k[0], 0x5A);
        if (which != 1)
            assert_memory_equal(v, rv + (l * len + pos) * tok, n * tok);
        else
            assert_int_equal(v[0], 0x5A);
    }
    /* Tokens. */
    int32_t *got = tu_alloc(sizeof(int32_t) * len);
    assert_ok(kvh_seq_tokens(e, s, 0, len, got));
    assert_memory_equal(got, toks, sizeof(int32_t) * len);
    assert_ok(kvh_seq_free(e, s));
    assert_ok(tu_close(e));
}

static void test_roundtrip_dtypes(void **state)
{
    (void)state;
    uint32_t dtypes[] = {KVH_DTYPE_F32, KVH_DTYPE_F16, KVH_DTYPE_BF16};
    uint32_t bts[] = {1, 4, 16};
    size_t lens[] = {1, 3, 4, 5, 16, 17, 33, 64};
    uint64_t seed = tu_seed(0x5e9);
    for (size_t d = 0; d < 3; d++)
        for (size_t b = 0; b < 3; b++)
            for (size_t n = 0; n < sizeof(lens) / sizeof(lens[0]); n++)
                roundtrip_one(dtypes[d], bts[b], lens[n], seed + d * 1000 + b * 100 + n);
}

/* ---- never-written KV and range errors ---- */

static void test_read_unwritten_is_range(void **state)
{
    (void)state;
    const uint32_t L = 2, H = 2, D = 4, BT = 4;
    const size_t tok = H * D * 4;
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F32, 16, 0, 0);
    kvh_seq s = tu_seq_new(e, 0);
    int32_t t[10];
    tu_iota(t, 10, 0);
    assert_ok(kvh_seq_append(e, s, t, 10));
    uint8_t k[10 * 32], v[10 * 32];
    memset(k, 0x33, sizeof(k));
    memset(v, 0x33, sizeof(v));
    /* Nothing written at all. */
    assert_kvh(KVH_ERR_RANGE, kvh_seq_read_kv(e, s, 0, 0, 1, k, v));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_read_kv(e, s, 1, 9, 1, k, NULL));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_read_kv(e, s, 0, 0, 10, NULL, NULL));
    /* Layer 0 of tokens 2..6 only. */
    uint8_t wk[5 * 32], wv[5 * 32];
    memset(wk, 1, sizeof(wk));
    memset(wv, 2, sizeof(wv));
    assert_ok(kvh_seq_write_kv(e, s, 0, 2, 5, wk, wv));
    assert_ok(kvh_seq_read_kv(e, s, 0, 2, 5, k, v));
    assert_memory_equal(k, wk, 5 * tok);
    assert_kvh(KVH_ERR_RANGE, kvh_seq_read_kv(e, s, 1, 2, 5, k, v)); /* other layer */
    memset(k, 0x44, sizeof(k));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_read_kv(e, s, 0, 1, 5, k, v)); /* starts unwritten */
    assert_kvh(KVH_ERR_RANGE, kvh_seq_read_kv(e, s, 0, 2, 6, k, v)); /* ends unwritten */
    for (size_t i = 0; i < sizeof(k); i++)
        assert_int_equal(k[i], 0x44); /* no partial output */
    /* Past the end; bad layer. */
    assert_kvh(KVH_ERR_RANGE, kvh_seq_read_kv(e, s, 0, 10, 1, k, v));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_write_kv(e, s, 0, 8, 3, wk, wv));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_write_kv(e, s, 0, 11, 0, wk, wv));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_write_kv(e, s, 0, UINT64_MAX, 2, wk, wv));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_read_kv(e, s, 0, UINT64_MAX, 2, k, v));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_write_kv(e, s, L, 0, 1, wk, wv));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_read_kv(e, s, L, 2, 1, k, v));
    /* n == 0 at the end is fine. */
    assert_ok(kvh_seq_write_kv(e, s, 0, 10, 0, NULL, NULL));
    assert_ok(kvh_seq_read_kv(e, s, 0, 10, 0, NULL, NULL));
    /* Failed writes changed nothing. */
    assert_ok(kvh_seq_read_kv(e, s, 0, 2, 5, k, v));
    assert_memory_equal(k, wk, 5 * tok);
    assert_memory_equal(v, wv, 5 * tok);
    assert_kvh(KVH_ERR_RANGE, kvh_seq_read_kv(e, s, 0, 7, 1, k, v));
}

/* ---- K/V buffers inside the engine's own memory ---- */

/* kvh.h: k and v may lie in the engine's memory (here a block's bytes
 * through kvh_tier_info.base); a read fills them only after every byte
 * is read and a write takes them as they were when it began, so a range
 * shifted by one token over its own block moves whole tokens. */
static void test_kv_buffers_inside_a_block(void **state)
{
    (void)state;
    enum { L = 2, H = 1, D = 4, BT = 8 };
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F32, 8, 0, 0);
    kvh_seq s = tu_seq_new(e, 0);
    int32_t t[BT];
    tu_iota(t, BT, 0);
    assert_ok(kvh_seq_append(e, s, t, BT));
    float k0[BT][D], v0[BT][D], vout[BT][D], kout[BT][D];
    for (int i = 0; i < BT; i++)
        for (int d = 0; d < D; d++) {
            k0[i][d] = (float)(i * 16 + d);
            v0[i][d] = (float)(1000 + i * 16 + d);
        }
    /* Layer 1 stays unwritten: the block is not immutable, so writes land
     * in place rather than in a copy. */
    assert_ok(kvh_seq_write_kv(e, s, 0, 0, BT, k0, v0));
    kvh_block_info bi = tu_seq_binfo(e, s, 0);
    kvh_tier_info ti = {.struct_size = sizeof(ti)};
    assert_ok(kvh_tier_info_get(e, bi.tier, &ti));
    assert_non_null(ti.base);
    float(*kmem)[D] = (float(*)[D])((uint8_t *)ti.base + (size_t)bi.slot * ti.block_bytes);

    /* Read tokens 0..6 into the block's own tokens 1..7. */
    assert_ok(kvh_seq_read_kv(e, s, 0, 0, BT - 1, kmem[1], vout));
    assert_memory_equal(kmem[0], k0[0], sizeof(k0[0]));
    assert_memory_equal(kmem[1], k0[0], (BT - 1) * sizeof(k0[0]));
    assert_memory_equal(vout, v0, (BT - 1) * sizeof(v0[0]));

    /* Write tokens 1..7 from the block's own tokens 0..6. */
    assert_ok(kvh_seq_write_kv(e, s, 0, 0, BT, k0, v0));
    assert_int_equal(tu_seq_binfo(e, s, 0).slot, bi.slot);
    assert_ok(kvh_seq_write_kv(e, s, 0, 1, BT - 1, kmem[0], v0));
    assert_int_equal(tu_seq_binfo(e, s, 0).slot, bi.slot);
    assert_ok(kvh_seq_read_kv(e, s, 0, 0, BT, kout, vout));
    assert_memory_equal(kout[0], k0[0], sizeof(k0[0]));
    assert_memory_equal(kout[1], k0[0], (BT - 1) * sizeof(k0[0]));
    assert_memory_equal(vout[1], v0[0], (BT - 1) * sizeof(v0[0]));
    assert_ok(kvh_seq_free(e, s));
    assert_ok(tu_close(e));
}

/* ---- truncate ---- */

static void test_truncate_and_regrow(void **state)
{
    (void)state;
    const uint32_t L = 2, H = 2, D = 4, BT = 4;
    const size_t tok = H * D * 4;
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F32, 16, 0, 0);
    kvh_seq s = tu_seq_new(e, 0);
    int32_t t[20];
    tu_iota(t, 20, 100);
    assert_ok(kvh_seq_append(e, s, t, 10));
    tu_write_pattern(e, s, L, tok, 1, 0, 10);
    assert_kvh(KVH_ERR_RANGE, kvh_seq_truncate(e, s, 11));
    assert_int_equal(tu_seq_len(e, s), 10);
    assert_ok(kvh_seq_truncate(e, s, 10)); /* no-op */
    assert_true(tu_check_pattern(e, s, L, tok, 1, 0, 10));

    /* Into a partial block (6 = block 1, 2 of 4 tokens). */
    kvh_stats s0 = tu_stats(e);
    assert_ok(kvh_seq_truncate(e, s, 6));
    assert_int_equal(tu_seq_len(e, s), 6);
    kvh_stats s1 = tu_stats(e);
    assert_int_equal(s1.blocks_freed - s0.blocks_freed, 1); /* block 2 released */
    assert_true(tu_check_pattern(e, s, L, tok, 1, 0, 6));
    int32_t got[20];
    assert_kvh(KVH_ERR_RANGE, kvh_seq_tokens(e, s, 0, 7, got));
    assert_ok(kvh_seq_tokens(e, s, 0, 6, got));
    assert_memory_equal(got, t, 6 * sizeof(int32_t));
    uint8_t k[32], v[32];
    assert_kvh(KVH_ERR_RANGE, kvh_seq_read_kv(e, s, 0, 6, 1, k, v));
    kvh_block_info bi = tu_seq_binfo(e, s, 1);
    assert_int_equal(bi.tokens, 2);
    assert_int_equal(bi.hash, 0); /* no longer full */

    /* Re-append different tokens: their KV is unwritten until written. */
    int32_t u[5] = {900, 901, 902, 903, 904};
    assert_ok(kvh_seq_append(e, s, u, 5));
    assert_int_equal(tu_seq_len(e, s), 11);
    assert_ok(kvh_seq_tokens(e, s, 0, 11, got));
    assert_memory_equal(got, t, 6 * sizeof(int32_t));
    assert_memory_equal(got + 6, u, 5 * sizeof(int32_t));
    for (uint64_t p = 6; p < 11; p++)
        for (uint32_t l = 0; l < L; l++)
            assert_kvh(KVH_ERR_RANGE, kvh_seq_read_kv(e, s, l, p, 1, k, v));
    tu_write_pattern(e, s, L, tok, 2, 6, 5);
    assert_true(tu_check_pattern(e, s, L, tok, 1, 0, 6));
    assert_true(tu_check_pattern(e, s, L, tok, 2, 6, 5));
    /* The block is full again with a fresh hash. */
    bi = tu_seq_binfo(e, s, 1);
    assert_int_equal(bi.tokens, 4);
    uint64_t h0 = tu_seq_binfo(e, s, 0).hash, h1;
    int32_t b1[4] = {104, 105, 900, 901};
    assert_ok(kvh_prefix_hash(e, h0, b1, 4, &h1));
    assert_int_equal(bi.hash, h1);

    /* To a block boundary and to zero. */
    assert_ok(kvh_seq_truncate(e, s, 4));
    assert_true(tu_check_pattern(e, s, L, tok, 1, 0, 4));
    assert_ok(kvh_seq_truncate(e, s, 0));
    assert_int_equal(tu_seq_len(e, s), 0);
    assert_ok(kvh_seq_append(e, s, t, 3));
    tu_write_pattern(e, s, L, tok, 3, 0, 3);
    assert_true(tu_check_pattern(e, s, L, tok, 3, 0, 3));
    assert_ok(kvh_seq_free(e, s));
    kvh_stats fin = tu_stats(e);
    assert_int_equal(fin.blocks_allocated, fin.blocks_freed + tu_tier(e, 0).used_blocks);
}

/* A published (full, KV-complete) block truncated into and then refilled
 * and rewritten must become KV-complete again and be published under its
 * new hash, like any block that gets full and fully written. Run with
 * num_layers * block_tokens = 64 (one whole bitmap word) and = 8. */
static void republish_case(uint32_t L)
{
    const uint32_t H = 2, D = 4, BT = 4;
    const size_t tok = H * D * 4;
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F32, 16, 16, 0);
    kvh_seq a = tu_seq_new(e, 0);
    int32_t t[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    assert_ok(kvh_seq_append(e, a, t, 8));
    tu_write_pattern(e, a, L, tok, 10, 0, 8);
    assert_int_equal(tu_seq_binfo(e, a, 1).published, 1);

    assert_ok(kvh_seq_truncate(e, a, 6));
    int32_t u[2] = {70, 80};
    assert_ok(kvh_seq_append(e, a, u, 2));
    tu_write_pattern(e, a, L, tok, 11, 6, 2);
    assert_true(tu_check_pattern(e, a, L, tok, 10, 0, 6));
    assert_true(tu_check_pattern(e, a, L, tok, 11, 6, 2));
    kvh_block_info bi = tu_seq_binfo(e, a, 1);
    assert_int_equal(bi.tokens, 4);
    assert_true(bi.hash != 0);
    if (!bi.published)
        print_error("num_layers=%u block_tokens=%u: block refilled after truncate is full and fully written "
                    "but not published\n",
                    L, BT);
    assert_int_equal(bi.published, 1);

    /* ... so a new sequence with the same tokens finds both blocks. */
    int32_t all[8] = {1, 2, 3, 4, 5, 6, 70, 80};
    kvh_seq b = tu_seq_new(e, 1);
    size_t m = 0;
    assert_ok(kvh_seq_match_prefix(e, b, all, 8, &m));
    assert_int_equal(m, 8);
    assert_true(tu_check_pattern(e, b, L, tok, 11, 6, 2));
    assert_ok(tu_close(e));
}

static void test_truncate_complete_block_republishes(void **state)
{
    (void)state;
    republish_case(16); /* 64 KV cells per block */
    republish_case(2);  /* 8 KV cells per block */
}

/* ---- fork and copy-on-write ---- */

static void test_fork_cow(void **state)
{
    (void)state;
    const uint32_t L = 2, H = 2, D = 4, BT = 4;
    const size_t tok = H * D * 4;
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F32, 32, 0, 0);
    kvh_seq p = tu_seq_new(e, 1);
    int32_t t[10];
    tu_iota(t, 10, 500);
    assert_ok(kvh_seq_append(e, p, t, 10)); /* blocks: 4, 4, 2 */
    tu_write_pattern(e, p, L, tok, 1, 0, 10);
    kvh_seq c;
    assert_ok(kvh_seq_fork(e, p, 2, &c));
    assert_true(c.id != p.id);
    assert_int_equal(tu_seq_len(e, c), 10);
    assert_true(tu_check_pattern(e, c, L, tok, 1, 0, 10));
    for (uint64_t i = 0; i < 3; i++) {
        kvh_block bp = tu_seq_block(e, p, i), bc = tu_seq_block(e, c, i);
        assert_int_equal(bp.id, bc.id); /* shared */
        kvh_block_info bi = tu_binfo(e, bp);
        assert_int_equal(bi.refs, 2);
        assert_int_equal(bi.agent, 1);
    }
    kvh_stats s0 = tu_stats(e);
    kvh_block_info old0 = tu_seq_binfo(e, p, 0);

    /* Write into the child's first block: copied first. */
    uint8_t k[32], v[32];
    memset(k, 0xC1, sizeof(k));
    memset(v, 0xC2, sizeof(v));
    assert_ok(kvh_seq_write_kv(e, c, 1, 1, 1, k, v));
    kvh_stats s1 = tu_stats(e);
    assert_int_equal(s1.cow_copies - s0.cow_copies, 1);
    kvh_block_info cb0 = tu_seq_binfo(e, c, 0), pb0 = tu_seq_binfo(e, p, 0);
    assert_true(tu_seq_block(e, c, 0).id != tu_seq_block(e, p, 0).id);
    assert_int_equal(cb0.refs, 1);
    assert_int_equal(pb0.refs, 1);
    assert_int_equal(pb0.slot, old0.slot); /* the parent keeps its block */
    assert_int_equal(cb0.agent, 2);        /* the copy belongs to the child's agent */
    assert_int_equal(tu_seq_binfo(e, c, 1).refs, 2);
    /* Parent byte-identical, child changed exactly there. */
    assert_true(tu_check_pattern(e, p, L, tok, 1, 0, 10));
    uint8_t rk[32], rv[32];
    assert_ok(kvh_seq_read_kv(e, c, 1, 1, 1, rk, rv));
    assert_memory_equal(rk, k, tok);
    assert_memory_equal(rv, v, tok);
    assert_true(tu_check_pattern(e, c, L, tok, 1, 2, 8));
    uint8_t l0k[10 * 32], l0v[10 * 32];
    assert_ok(kvh_seq_read_kv(e, c, 0, 0, 10, l0k, l0v));
    for (uint64_t pos = 0; pos < 10; pos++) {
        uint8_t want[32];
        tu_pattern(want, tok, 1, 0, pos, 0);
        assert_memory_equal(l0k + pos * tok, want, tok);
    }
    /* A second write into the now-private block copies nothing. */
    assert_ok(kvh_seq_write_kv(e, c, 0, 0, 1, k, v));
    assert_int_equal(tu_stats(e).cow_copies, s1.cow_copies);

    /* Append to the child: the shared partial last block is copied. */
    int32_t more[3] = {7, 8, 9};
    assert_ok(kvh_seq_append(e, c, more, 3));
    kvh_stats s2 = tu_stats(e);
    assert_int_equal(s2.cow_copies - s1.cow_copies, 1);
    assert_int_equal(tu_seq_len(e, p), 10);
    assert_int_equal(tu_seq_len(e, c), 13);
    int32_t got[13];
    assert_ok(kvh_seq_tokens(e, p, 0, 10, got));
    assert_memory_equal(got, t, sizeof(t));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_tokens(e, p, 0, 11, got));
    assert_ok(kvh_seq_tokens(e, c, 0, 13, got));
    assert_memory_equal(got + 10, more, sizeof(more));
    assert_int_equal(tu_seq_binfo(e, p, 2).tokens, 2);
    assert_int_equal(tu_seq_binfo(e, p, 2).refs, 1);
    /* The parent appends in place now (no sharing left in its last block). */
    assert_ok(kvh_seq_append(e, p, more, 1));
    assert_int_equal(tu_stats(e).cow_copies, s2.cow_copies);
    assert_true(tu_check_pattern(e, p, L, tok, 1, 0, 10));

    /* Truncating the child into the shared middle block copies it; the
     * parent is unaffected. */
    assert_int_equal(tu_seq_binfo(e, c, 1).refs, 2);
    assert_ok(kvh_seq_truncate(e, c, 6));
    assert_int_equal(tu_stats(e).cow_copies, s2.cow_copies + 1);
    assert_int_equal(tu_seq_binfo(e, p, 1).tokens, 4);
    assert_int_equal(tu_seq_binfo(e, p, 1).refs, 1);
    assert_true(tu_check_pattern(e, p, L, tok, 1, 0, 10));

    /* Freeing the parent leaves the child intact, and vice versa. */
    kvh_seq g;
    assert_ok(kvh_seq_fork(e, c, 3, &g));
    assert_ok(kvh_seq_free(e, p));
    assert_ok(kvh_seq_free(e, c));
    assert_int_equal(tu_seq_len(e, g), 6);
    assert_true(tu_check_pattern(e, g, L, tok, 1, 2, 4));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_length(e, c, &(uint64_t){0}));
    assert_ok(kvh_seq_free(e, g));
    /* Only cached (published) blocks remain, with no references. */
    kvh_stats fin = tu_stats(e);
    assert_int_equal(fin.blocks_allocated - fin.blocks_freed, tu_tier(e, 0).used_blocks);
}

/* A published block is immutable: writing into it, even when only one
 * sequence uses it, copies it, and the cached version stays as it was. */
/* An append that fails for want of room leaves the sequence as it was,
 * also where its last block is shared and would have been copied: the
 * same block, still shared, and no slot taken. */
static void test_failed_append_keeps_a_shared_last_block(void **state)
{
    (void)state;
    kvh_engine *e = tu_open(1, 1, 2, 4, KVH_DTYPE_F32, 4, 0, 0); /* 4 device blocks, nothing else */
    int32_t tok[16];
    tu_iota(tok, 16, 0);
    kvh_seq a = tu_seq_new(e, 0), b, filler = tu_seq_new(e, 0);
    assert_ok(kvh_seq_append(e, a, tok, 2));
    assert_ok(kvh_seq_fork(e, a, 0, &b)); /* its partial block shared */
    assert_ok(kvh_seq_append(e, filler, tok + 8, 8));
    kvh_block before, after;
    assert_ok(kvh_seq_blocks(e, a, 0, 1, &before));
    uint64_t used = tu_tier(e, KVH_TIER_DEVICE).used_blocks;
    assert_int_equal(used, 3);
    /* Needs a copy of the shared block and one new block: one slot free. */
    assert_kvh(KVH_ERR_NOSPACE, kvh_seq_append(e, a, tok + 2, 6));
    assert_ok(kvh_seq_blocks(e, a, 0, 1, &after));
    assert_int_equal(after.id, before.id);
    assert_int_equal(tu_seq_binfo(e, a, 0).refs, 2);
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, used);
    uint64_t len = 0;
    assert_ok(kvh_seq_length(e, a, &len));
    assert_int_equal(len, 2);
    assert_ok(kvh_seq_append(e, a, tok + 2, 2)); /* what fits still goes */
    assert_int_equal(tu_seq_binfo(e, a, 0).refs, 1);
    assert_ok(kvh_seq_free(e, b));
}

/* kvh_seq_acquire keeps a range in the device tier until its release. A
 * write, append or truncate into an acquired block that is shared makes
 * a private copy; with the device tier full (the block itself held, the
 * other slot pinned), the copy went to the host tier and took the hold
 * there, so the acquired range was no longer resident. A block pinned in
 * the device tier likewise had its pin moved to a copy in the host. */
static void cow_of_held_block(int how, int pin_instead)
{
    kvh_engine *e = tu_open(1, 1, 2, 2, KVH_DTYPE_F32, 2, 4, 0); /* 2 device, 4 host blocks */
    float k[2] = {1, 2}, v[2] = {3, 4}, k2[2] = {5, 6}, got_k[2], got_v[2];
    int32_t tok[3] = {10, 11, 12};
    kvh_seq a = tu_seq_new(e, 0), child, p = tu_seq_new(e, 0);
    assert_ok(kvh_seq_append(e, a, tok, how == 2 ? 2 : 1));
    assert_ok(kvh_seq_write_kv(e, a, 0, 0, how == 2 ? 2 : 1, how == 2 ? (float[]){1, 2, 7, 8} : k,
                               how == 2 ? (float[]){3, 4, 9, 9} : v));
    assert_ok(kvh_seq_fork(e, a, 0, &child));
    if (pin_instead)
        assert_ok(kvh_seq_pin(e, a, 0, how == 2 ? 2 : 1, 1));
    else
        assert_ok(kvh_seq_acquire(e, a, 0, how == 2 ? 2 : 1, NULL));
    assert_ok(kvh_seq_append(e, p, tok, 1));
    assert_ok(kvh_seq_pin(e, p, 0, 1, 1));
    if (how == 0)
        assert_ok(kvh_seq_write_kv(e, a, 0, 0, 1, k2, v));
    else if (how == 1)
        assert_ok(kvh_seq_append(e, a, tok + 1, 1));
    else
        assert_ok(kvh_seq_truncate(e, a, 1));
    kvh_block_info bi = tu_seq_binfo(e, a, 0);
    assert_int_equal(bi.tier, KVH_TIER_DEVICE);
    assert_int_equal(pin_instead ? bi.pins : bi.holds, 1);
    assert_int_equal(bi.refs, 1); /* a private copy */
    int32_t indptr[2], idx[2], lpl[1];
    assert_ok(kvh_block_table(e, &a, 1, indptr, idx, 2, lpl));
    assert_ok(kvh_seq_read_kv(e, a, 0, 0, 1, got_k, got_v));
    assert_memory_equal(got_k, how == 0 ? k2 : k, sizeof(got_k));
    assert_ok(kvh_seq_read_kv(e, child, 0, 0, 1, got_k, got_v)); /* the child's is as it was */
    assert_memory_equal(got_k, k, sizeof(got_k));
    assert_memory_equal(got_v, v, sizeof(got_v));
    if (pin_instead)
        assert_ok(kvh_seq_pin(e, a, 0, 1, 0));
    else
        assert_ok(kvh_seq_release(e, a, 0, 1));
}

static void test_cow_of_a_held_block_stays_in_the_device_tier(void **state)
{
    (void)state;
    for (int how = 0; how < 3; how++) {
        cow_of_held_block(how, 0);
        cow_of_held_block(how, 1);
    }
}

/* With the source also held by another sequence there is no room for
 * the copy in the device tier: the write fails and changes nothing. */
static void test_cow_of_a_held_block_without_room_changes_nothing(void **state)
{
    (void)state;
    kvh_engine *e = tu_open(1, 1, 2, 2, KVH_DTYPE_F32, 2, 4, 0);
    float k[2] = {1, 2}, v[2] = {3, 4}, k2[2] = {5, 6}, got_k[2], got_v[2];
    int32_t tok[2] = {10, 11};
    kvh_seq a = tu_seq_new(e, 0), child, p = tu_seq_new(e, 0);
    assert_ok(kvh_seq_append(e, a, tok, 1));
    assert_ok(kvh_seq_write_kv(e, a, 0, 0, 1, k, v));
    assert_ok(kvh_seq_fork(e, a, 0, &child));
    assert_ok(kvh_seq_acquire(e, a, 0, 1, NULL));
    assert_ok(kvh_seq_acquire(e, child, 0, 1, NULL));
    assert_ok(kvh_seq_append(e, p, tok, 1));
    assert_ok(kvh_seq_pin(e, p, 0, 1, 1));
    kvh_block before, after;
    assert_ok(kvh_seq_blocks(e, a, 0, 1, &before));
    assert_kvh(KVH_ERR_NOSPACE, kvh_seq_write_kv(e, a, 0, 0, 1, k2, v));
    assert_ok(kvh_seq_blocks(e, a, 0, 1, &after));
    assert_int_equal(after.id, before.id);
    kvh_block_info bi = tu_seq_binfo(e, a, 0);
    assert_int_equal(bi.tier, KVH_TIER_DEVICE);
    assert_int_equal(bi.holds, 2);
    assert_int_equal(bi.refs, 2);
    assert_ok(kvh_seq_read_kv(e, a, 0, 0, 1, got_k, got_v));
    assert_memory_equal(got_k, k, sizeof(got_k));
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks + tu_tier(e, KVH_TIER_HOST).used_blocks, 2);
    assert_ok(kvh_seq_release(e, child, 0, 1));
    assert_ok(kvh_seq_write_kv(e, a, 0, 0, 1, k2, v)); /* room once the child lets go */
    assert_int_equal(tu_seq_binfo(e, a, 0).tier, KVH_TIER_DEVICE);
}

/* A prompt longer than the engine has blocks is matched as far as the
 * cache goes, with no error and no table sized for the whole prompt (the
 * match stops at the first miss, so only the tokens it compares are read);
 * one longer than any sequence can be is refused. */
static void test_match_of_a_prompt_longer_than_the_engine(void **state)
{
    (void)state;
    kvh_engine *e = tu_open(1, 1, 2, 4, KVH_DTYPE_F32, 8, 0, 0);
    int32_t tok[16];
    tu_iota(tok, 16, 0);
    kvh_seq a = tu_seq_new(e, 0), b = tu_seq_new(e, 0);
    assert_ok(kvh_seq_append(e, a, tok, 8));
    tu_write_pattern(e, a, 1, 2 * sizeof(float), 1, 0, 8); /* two published blocks */
    size_t matched = 99;
    assert_ok(kvh_seq_match_prefix(e, b, tok, (size_t)1 << 30, &matched));
    assert_int_equal(matched, 8);
    kvh_seq c = tu_seq_new(e, 0);
    int32_t other[16];
    tu_iota(other, 16, 1000);
    assert_ok(kvh_seq_match_prefix(e, c, other, (size_t)1 << 30, &matched));
    assert_int_equal(matched, 0);
    /* More tokens than any sequence can hold: refused, nothing read. */
    assert_kvh(KVH_ERR_RANGE, kvh_seq_match_prefix(e, c, other, SIZE_MAX, &matched));
}

static void test_write_into_published_block_copies(void **state)
{
    (void)state;
    const uint32_t L = 2, H = 2, D = 4, BT = 4;
    const size_t tok = H * D * 4;
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F32, 32, 0, 0);
    kvh_seq a = tu_seq_new(e, 0);
    int32_t t[4] = {11, 12, 13, 14};
    assert_ok(kvh_seq_append(e, a, t, 4));
    tu_write_pattern(e, a, L, tok, 1, 0, 4);
    kvh_block_info bi = tu_seq_binfo(e, a, 0);
    assert_int_equal(bi.published, 1);
    assert_int_equal(bi.refs, 1);
    kvh_block orig = tu_seq_block(e, a, 0);
    uint64_t cow0 = tu_stats(e).cow_copies;
    tu_write_pattern(e, a, L, tok, 2, 0, 4); /* overwrite everything */
    assert_int_equal(tu_stats(e).cow_copies, cow0 + 1);
    assert_true(tu_seq_block(e, a, 0).id != orig.id);
    assert_true(tu_check_pattern(e, a, L, tok, 2, 0, 4));
    kvh_block_info oi = tu_binfo(e, orig);
    assert_int_equal(oi.published, 1);
    assert_int_equal(oi.refs, 0); /* cached only */
    /* The cached block still holds the first KV. */
    kvh_seq b = tu_seq_new(e, 0);
    size_t m = 0;
    assert_ok(kvh_seq_match_prefix(e, b, t, 4, &m));
    assert_int_equal(m, 4);
    assert_int_equal(tu_seq_block(e, b, 0).id, orig.id);
    assert_true(tu_check_pattern(e, b, L, tok, 1, 0, 4));
}

/* ---- prefix matching ---- */

static void test_match_prefix_sharing(void **state)
{
    (void)state;
    const uint32_t L = 2, H = 2, D = 4, BT = 4;
    const size_t tok = H * D * 4;
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F32, 32, 0, 0);
    int32_t sys[12];
    tu_iota(sys, 12, 1000); /* system prompt: 3 full blocks */
    int32_t pa[18], pb[17];
    memcpy(pa, sys, sizeof(sys));
    memcpy(pb, sys, sizeof(sys));
    tu_iota(pa + 12, 6, 2000);
    tu_iota(pb + 12, 5, 3000);

    kvh_seq a = tu_seq_new(e, 1);
    assert_ok(kvh_seq_append(e, a, pa, 18));
    /* Before its KV is written, nothing is published. */
    kvh_seq probe = tu_seq_new(e, 9);
    size_t m = 99;
    assert_ok(kvh_seq_match_prefix(e, probe, sys, 12, &m));
    assert_int_equal(m, 0);
    assert_int_equal(tu_seq_len(e, probe), 0);
    /* One layer is not enough either. */
    uint8_t *kk = tu_alloc(18 * tok), *vv = tu_alloc(18 * tok);
    assert_ok(kvh_seq_write_kv(e, a, 0, 0, 18, kk, vv));
    assert_ok(kvh_seq_match_prefix(e, probe, sys, 12, &m));
    assert_int_equal(m, 0);
    tu_write_pattern(e, a, L, tok, 1, 0, 18);
    for (uint64_t i = 0; i < 4; i++)
        assert_int_equal(tu_seq_binfo(e, a, i).published, 1);
    assert_int_equal(tu_seq_binfo(e, a, 4).published, 0); /* partial */

    kvh_stats s0 = tu_stats(e);
    kvh_seq b = tu_seq_new(e, 2);
    assert_ok(kvh_seq_match_prefix(e, b, pb, 17, &m));
    assert_int_equal(m, 12);
    assert_int_equal(tu_seq_len(e, b), 12);
    kvh_stats s1 = tu_stats(e);
    assert_int_equal(s1.prefix_queries - s0.prefix_queries, 1);
    assert_int_equal(s1.prefix_hit_blocks - s0.prefix_hit_blocks, 3);
    assert_int_equal(s1.prefix_hit_tokens - s0.prefix_hit_tokens, 12);
    assert_int_equal(s1.blocks_allocated, s0.blocks_allocated); /* nothing new */
    for (uint64_t i = 0; i < 3; i++) {
        kvh_block ba = tu_seq_block(e, a, i), bb = tu_seq_block(e, b, i);
        assert_int_equal(ba.id, bb.id); /* the same physical blocks */
        kvh_block_info ia = tu_binfo(e, ba);
        assert_int_equal(ia.refs, 2);
        assert_int_equal(ia.slot, tu_binfo(e, bb).slot);
    }
    int32_t got[17];
    assert_ok(kvh_seq_tokens(e, b, 0, 12, got));
    assert_memory_equal(got, sys, sizeof(sys));
    assert_true(tu_check_pattern(e, b, L, tok, 1, 0, 12));
    /* B continues with its own tokens; A is unaffected. */
    assert_ok(kvh_seq_append(e, b, pb + 12, 5));
    tu_write_pattern(e, b, L, tok, 2, 12, 5);
    assert_true(tu_check_pattern(e, a, L, tok, 1, 0, 18));
    assert_true(tu_check_pattern(e, b, L, tok, 2, 12, 5));

    /* A non-empty sequence is rejected and left alone. */
    kvh_stats s2 = tu_stats(e);
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_match_prefix(e, b, pb, 17, &m));
    assert_int_equal(tu_seq_len(e, b), 17);
    assert_true(tu_check_pattern(e, b, L, tok, 1, 0, 12));

    /* Partial blocks never match: A's 18 tokens match 16 (4 full blocks). */
    kvh_seq c = tu_seq_new(e, 3);
    assert_ok(kvh_seq_match_prefix(e, c, pa, 18, &m));
    assert_int_equal(m, 16);
    /* A prompt shorter than a block matches nothing. */
    kvh_seq d = tu_seq_new(e, 3);
    assert_ok(kvh_seq_match_prefix(e, d, sys, 3, &m));
    assert_int_equal(m, 0);
    /* Empty input. */
    assert_ok(kvh_seq_match_prefix(e, d, NULL, 0, &m));
    assert_int_equal(m, 0);
    /* A divergence inside the second block stops the match at 4. */
    int32_t div[12];
    memcpy(div, sys, sizeof(div));
    div[6] = -1;
    assert_ok(kvh_seq_match_prefix(e, d, div, 12, &m));
    assert_int_equal(m, 4);
    /* Same tokens at a different position (other parent) do not match. */
    kvh_seq f = tu_seq_new(e, 3);
    assert_ok(kvh_seq_match_prefix(e, f, sys + 4, 8, &m));
    assert_int_equal(m, 0);
    (void)s2;

    /* Cached blocks outlive their sequences. */
    assert_ok(kvh_seq_free(e, a));
    assert_ok(kvh_seq_free(e, b));
    assert_ok(kvh_seq_free(e, c));
    assert_ok(kvh_seq_free(e, d));
    kvh_seq g = tu_seq_new(e, 4);
    assert_ok(kvh_seq_match_prefix(e, g, pa, 18, &m));
    assert_int_equal(m, 16);
    assert_true(tu_check_pattern(e, g, L, tok, 1, 0, 16));
    assert_int_equal(tu_seq_binfo(e, g, 0).refs, 1);
}

/* Engines with another model_salt hash differently. */
static void test_prefix_hash_salt(void **state)
{
    (void)state;
    kvh_config c1 = tu_cfg(1, 1, 4, 4, KVH_DTYPE_F32, 4, 0, 0), c2 = c1;
    c1.model_salt = 1;
    c2.model_salt = 2;
    kvh_engine *e1 = tu_open_cfg(&c1), *e2 = tu_open_cfg(&c2);
    int32_t t[4] = {1, 2, 3, 4};
    uint64_t h1, h2, h1b;
    assert_ok(kvh_prefix_hash(e1, 0, t, 4, &h1));
    assert_ok(kvh_prefix_hash(e2, 0, t, 4, &h2));
    assert_ok(kvh_prefix_hash(e1, 0, t, 4, &h1b));
    assert_int_equal(h1, h1b);
    assert_true(h1 != h2);
    assert_true(h1 != 0 && h2 != 0);
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_prefix_hash(e1, 0, t, 3, &h1));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_prefix_hash(e1, 0, t, 5, &h1));
    /* Block hashes as reported by block_info are the chain of prefix_hash. */
    kvh_seq s = tu_seq_new(e1, 0);
    int32_t u[9] = {5, 6, 7, 8, 9, 10, 11, 12, 13};
    assert_ok(kvh_seq_append(e1, s, u, 9));
    uint64_t a, b;
    assert_ok(kvh_prefix_hash(e1, 0, u, 4, &a));
    assert_ok(kvh_prefix_hash(e1, a, u + 4, 4, &b));
    assert_int_equal(tu_seq_binfo(e1, s, 0).hash, a);
    assert_int_equal(tu_seq_binfo(e1, s, 1).hash, b);
    assert_int_equal(tu_seq_binfo(e1, s, 2).hash, 0); /* partial */
}

/* ---- block tables ---- */

static void test_block_table(void **state)
{
    (void)state;
    const uint32_t L = 1, H = 1, D = 4, BT = 4;
    const size_t tok = H * D * 4;
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F32, 16, 16, 0);
    kvh_seq s[3] = {tu_seq_new(e, 0), tu_seq_new(e, 0), tu_seq_new(e, 0)};
    int32_t t[10];
    tu_iota(t, 10, 1);
    assert_ok(kvh_seq_append(e, s[0], t, 10)); /* 3 blocks, last 2 tokens */
    assert_ok(kvh_seq_append(e, s[1], t, 4));  /* 1 block, full */
    /* s[2] is empty */
    tu_write_pattern(e, s[0], L, tok, 1, 0, 10);
    int32_t indptr[4] = {-1, -1, -1, -1}, idx[8], lpl[3] = {-1, -1, -1};
    memset(idx, 0xFF, sizeof(idx));
    assert_ok(kvh_block_table(e, s, 3, indptr, idx, 8, lpl));
    assert_int_equal(indptr[0], 0);
    assert_int_equal(indptr[1], 3);
    assert_int_equal(indptr[2], 4);
    assert_int_equal(indptr[3], 4);
    assert_int_equal(lpl[0], 2);
    assert_int_equal(lpl[1], 4);
    assert_int_equal(lpl[2], 0);
    for (int i = 0; i < 3; i++)
        assert_int_equal(idx[i], (int32_t)tu_seq_binfo(e, s[0], (uint64_t)i).slot);
    assert_int_equal(idx[3], (int32_t)tu_seq_binfo(e, s[1], 0).slot);
    /* Indices are distinct device slots in range. */
    uint64_t cap = tu_tier(e, KVH_TIER_DEVICE).capacity_blocks;
    for (int i = 0; i < 4; i++) {
        assert_true(idx[i] >= 0 && (uint64_t)idx[i] < cap);
        for (int j = 0; j < i; j++)
            assert_true(idx[i] != idx[j]);
    }
    /* Too small an index array. */
    assert_kvh(KVH_ERR_RANGE, kvh_block_table(e, s, 3, indptr, idx, 3, lpl));
    assert_ok(kvh_block_table(e, s, 3, indptr, idx, 4, lpl));
    /* No sequences. */
    assert_ok(kvh_block_table(e, s, 0, indptr, NULL, 0, lpl));
    assert_int_equal(indptr[0], 0);

    /* After moving s[0] to the host tier: not resident. */
    assert_ok(kvh_seq_migrate(e, s[0], 0, 10, KVH_TIER_HOST, NULL));
    for (uint64_t i = 0; i < 3; i++)
        assert_int_equal(tu_seq_binfo(e, s[0], i).tier, KVH_TIER_HOST);
    assert_kvh(KVH_ERR_NOT_RESIDENT, kvh_block_table(e, s, 3, indptr, idx, 8, lpl));
    assert_ok(kvh_block_table(e, s + 1, 2, indptr, idx, 8, lpl)); /* the others are fine */
    /* Only part of it back: still not resident. */
    assert_ok(kvh_seq_acquire(e, s[0], 0, 4, NULL));
    assert_kvh(KVH_ERR_NOT_RESIDENT, kvh_block_table(e, s, 1, indptr, idx, 8, lpl));
    assert_ok(kvh_seq_acquire(e, s[0], 0, 10, NULL));
    assert_ok(kvh_block_table(e, s, 3, indptr, idx, 8, lpl));
    for (int i = 0; i < 3; i++) {
        kvh_block_info bi = tu_seq_binfo(e, s[0], (uint64_t)i);
        assert_int_equal(bi.tier, KVH_TIER_DEVICE);
        assert_int_equal(idx[i], (int32_t)bi.slot);
    }
    assert_true(tu_check_pattern(e, s[0], L, tok, 1, 0, 10));
    assert_ok(kvh_seq_release(e, s[0], 0, 10));
    assert_ok(kvh_seq_release(e, s[0], 0, 4));
    /* A freed sequence in the batch. */
    assert_ok(kvh_seq_free(e, s[1]));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_table(e, s, 3, indptr, idx, 8, lpl));
    /* Refusals write none of the arrays (s[1] freed, a short index array,
     * a block not resident), whichever sequence of the batch fails. */
    int32_t ip[4], ix[8], lp[3];
    const int32_t mark = -5;
    kvh_seq later_freed[] = {s[0], s[2], s[1]};
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < 4; i++)
            ip[i] = mark;
        for (int i = 0; i < 8; i++)
            ix[i] = mark;
        for (int i = 0; i < 3; i++)
            lp[i] = mark;
        if (round == 0)
            assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_table(e, later_freed, 3, ip, ix, 8, lp));
        else if (round == 1)
            assert_kvh(KVH_ERR_RANGE, kvh_block_table(e, s, 1, ip, ix, 2, lp));
        else {
            assert_ok(kvh_seq_append(e, s[2], t, BT));
            assert_ok(kvh_seq_migrate(e, s[2], 0, BT, KVH_TIER_HOST, NULL));
            kvh_seq last_on_host[] = {s[0], s[2]};
            assert_kvh(KVH_ERR_NOT_RESIDENT, kvh_block_table(e, last_on_host, 2, ip, ix, 8, lp));
        }
        for (int i = 0; i < 4; i++)
            assert_int_equal(ip[i], mark);
        for (int i = 0; i < 8; i++)
            assert_int_equal(ix[i], mark);
        for (int i = 0; i < 3; i++)
            assert_int_equal(lp[i], mark);
    }
}

/* ---- tokens and block handles ---- */

static void test_tokens_and_blocks(void **state)
{
    (void)state;
    kvh_engine *e = tu_open(1, 1, 4, 4, KVH_DTYPE_F32, 16, 0, 0);
    kvh_seq s = tu_seq_new(e, 0);
    int32_t t[11] = {INT32_MIN, -1, 0, 1, INT32_MAX, 5, 6, 7, 8, 9, 10};
    assert_ok(kvh_seq_append(e, s, t, 0));
    assert_int_equal(tu_seq_len(e, s), 0);
    assert_ok(kvh_seq_append(e, s, t, 11));
    int32_t got[12];
    for (uint64_t first = 0; first <= 11; first++)
        for (size_t n = 0; first + n <= 11; n++) {
            memset(got, 0, sizeof(got));
            assert_ok(kvh_seq_tokens(e, s, first, n, got));
            assert_memory_equal(got, t + first, n * sizeof(int32_t));
        }
    memset(got, 0x7F, sizeof(got));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_tokens(e, s, 0, 12, got));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_tokens(e, s, 12, 0, got));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_tokens(e, s, 5, SIZE_MAX, got));
    assert_int_equal(got[0], 0x7F7F7F7F);
    assert_ok(kvh_seq_tokens(e, s, 11, 0, NULL));

    kvh_block b[4];
    assert_ok(kvh_seq_blocks(e, s, 0, 3, b));
    for (int i = 0; i < 3; i++) {
        assert_true(b[i].id != 0);
        kvh_block_info bi = tu_binfo(e, b[i]);
        assert_int_equal(bi.tokens, i < 2 ? 4 : 3);
        assert_int_equal(bi.refs, 1); /* handles are not retained */
        assert_int_equal(bi.tier, KVH_TIER_DEVICE);
    }
    assert_kvh(KVH_ERR_RANGE, kvh_seq_blocks(e, s, 0, 4, b));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_blocks(e, s, 4, 0, b));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_blocks(e, s, 2, 2, b));
    assert_ok(kvh_seq_blocks(e, s, 3, 0, NULL));
    kvh_block one;
    assert_ok(kvh_seq_blocks(e, s, 2, 1, &one));
    assert_int_equal(one.id, b[2].id);
    /* A block handle dies with the block. */
    assert_ok(kvh_seq_truncate(e, s, 8));
    kvh_block_info bi = {.struct_size = sizeof(bi)};
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_info_get(e, b[2], &bi));
    /* The null sequence handle is accepted by free only. */
    assert_ok(kvh_seq_free(e, (kvh_seq){0}));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_append(e, (kvh_seq){0}, t, 1));
}

/* Long sequences grow their block tables. */
static void test_long_sequence(void **state)
{
    (void)state;
    const size_t tok = 4 * 2;
    kvh_engine *e = tu_open(1, 1, 4, 1, KVH_DTYPE_F16, 5000, 0, 0);
    kvh_seq s = tu_seq_new(e, 0);
    int32_t t[100];
    for (int r = 0; r < 45; r++) {
        tu_iota(t, 100, r * 100);
        assert_ok(kvh_seq_append(e, s, t, 100));
    }
    assert_int_equal(tu_seq_len(e, s), 4500);
    tu_write_pattern(e, s, 1, tok, 9, 0, 4500);
    assert_true(tu_check_pattern(e, s, 1, tok, 9, 0, 4500));
    int32_t got[4500];
    assert_ok(kvh_seq_tokens(e, s, 0, 4500, got));
    for (int i = 0; i < 4500; i++)
        assert_int_equal(got[i], i);
}

/* A block table past 2 MiB moves to a huge-page mapping as it grows: the
 * entries copied across, and the old and new tables freed the way each
 * was allocated (ASan and the engine's teardown check the latter). */
static void test_block_table_past_2mib(void **state)
{
    (void)state;
    enum { N = 600000, CHUNK = 4096 }; /* 2.4 MB of block indices */
    const size_t tok = 4 * 2;
    kvh_engine *e = tu_open(1, 1, 4, 1, KVH_DTYPE_F16, N + 8, 0, 0);
    kvh_seq s = tu_seq_new(e, 0);
    int32_t *t = tu_alloc(sizeof(int32_t) * CHUNK);
    for (size_t done = 0; done < N; done += CHUNK) {
        size_t k = N - done < CHUNK ? N - done : CHUNK;
        tu_iota(t, k, (int32_t)done);
        assert_ok(kvh_seq_append(e, s, t, k));
    }
    assert_int_equal(tu_seq_len(e, s), N);
    const uint64_t probes[] = {0, 1, 524287, 524288, N - 1};
    for (size_t i = 0; i < sizeof(probes) / sizeof(probes[0]); i++) {
        int32_t got;
        assert_ok(kvh_seq_tokens(e, s, probes[i], 1, &got));
        assert_int_equal(got, (int32_t)probes[i]);
    }
    tu_write_pattern(e, s, 1, tok, 5, N - 100, 100);
    assert_true(tu_check_pattern(e, s, 1, tok, 5, N - 100, 100));
    assert_ok(kvh_seq_free(e, s));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_roundtrip_dtypes, tu_teardown),
        cmocka_unit_test_teardown(test_read_unwritten_is_range, tu_teardown),
        cmocka_unit_test_teardown(test_kv_buffers_inside_a_block, tu_teardown),
        cmocka_unit_test_teardown(test_truncate_and_regrow, tu_teardown),
        cmocka_unit_test_teardown(test_truncate_complete_block_republishes, tu_teardown),
        cmocka_unit_test_teardown(test_fork_cow, tu_teardown),
        cmocka_unit_test_teardown(test_write_into_published_block_copies, tu_teardown),
        cmocka_unit_test_teardown(test_match_prefix_sharing, tu_teardown),
        cmocka_unit_test_teardown(test_prefix_hash_salt, tu_teardown),
        cmocka_unit_test_teardown(test_block_table, tu_teardown),
        cmocka_unit_test_teardown(test_failed_append_keeps_a_shared_last_block, tu_teardown),
        cmocka_unit_test_teardown(test_cow_of_a_held_block_stays_in_the_device_tier, tu_teardown),
        cmocka_unit_test_teardown(test_cow_of_a_held_block_without_room_changes_nothing, tu_teardown),
        cmocka_unit_test_teardown(test_match_of_a_prompt_longer_than_the_engine, tu_teardown),
        cmocka_unit_test_teardown(test_tokens_and_blocks, tu_teardown),
        cmocka_unit_test_teardown(test_long_sequence, tu_teardown),
        cmocka_unit_test_teardown(test_block_table_past_2mib, tu_teardown),
    };
    return cmocka_run_group_tests_name("seq", tests, NULL, NULL);
}
