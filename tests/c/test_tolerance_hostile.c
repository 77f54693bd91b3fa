/* LCTRU tolerance against a hostile caller, from kvh.h alone ("LCTRU
 * tolerance", enum kvh_eviction): NULL engines, null, stale, forged,
 * foreign and mistyped handles, tolerances past KVH_TOLERANCE_MAX, token
 * ranges whose end wraps around 2^64, and max_rel_error NaN, infinite or
 * negative get their documented status with a message and change no
 * block's tolerance, tier or counter; K/V holding NaN, infinities or zeros
 * still derive a tolerance in 0..255; and what the calls do is seen in the
 * victim order: under KVH_EVICT_LCTRU a tolerant block leaves first, a
 * refused call leaves the order as it was, LRU-K and hints ignore
 * tolerance. */
#include <float.h>
#include <math.h>
#include <unistd.h>

#include "test_util.h"

enum { D = 64, BT = 16 };

#define assert_fails(expected, expr)                                                                                   \
    do {                                                                                                               \
        assert_kvh(expected, expr);                                                                                    \
        const char *le_ = kvh_last_error();                                                                            \
        if (le_ == NULL || le_[0] == '\0')                                                                             \
            fail_msg("%s: %s with an empty kvh_last_error()", #expr, kvh_status_name(expected));                       \
    } while (0)

static kvh_engine *open_engine(uint32_t policy, uint32_t window, uint32_t codec, uint64_t device_blocks)
{
    kvh_config c = tu_cfg(1, 1, D, BT, KVH_DTYPE_F32, device_blocks, 16, 0);
    c.lru_k = 1;
    c.eviction_policy = policy;
    c.lctru_window = window;
    c.kv_codec = codec;
    return tu_open_cfg(&c);
}

static kvh_engine *open_policy(uint32_t policy, uint32_t window, uint32_t codec)
{
    return open_engine(policy, window, codec, 4);
}

/* A sequence of n tokens (ids from tag), K = V = f(token, d) written. */
static kvh_seq seq_with(kvh_engine *e, uint32_t tag, uint64_t n, float (*f)(uint64_t t, uint32_t d))
{
    kvh_seq s = tu_seq_new(e, 0);
    int32_t *tok = tu_alloc(sizeof(int32_t) * n);
    float *kv = tu_alloc(sizeof(float) * n * D);
    tu_iota(tok, n, (int32_t)(tag * 10000));
    assert_ok(kvh_seq_append(e, s, tok, n));
    for (uint64_t t = 0; t < n; t++)
        for (uint32_t d = 0; d < D; d++)
            kv[t * D + d] = f(t, d);
    assert_ok(kvh_seq_write_kv(e, s, 0, 0, n, kv, kv));
    return s;
}

static float smooth(uint64_t t, uint32_t d) { return (float)(t * D + d) * 0.37f; }

static uint32_t tol_of(kvh_engine *e, kvh_seq s, uint64_t i) { return tu_seq_binfo(e, s, i).tolerance; }

/* ---- everything a caller can see of some blocks ---- */

#define MAX_WATCH 16

typedef struct observed {
    kvh_stats stats;
    kvh_tier_info tier[2];
    uint32_t n;
    kvh_block_info blk[MAX_WATCH];
} observed;

static observed observe(kvh_engine *e, const kvh_block *b, uint32_t n)
{
    observed o;
    memset(&o, 0, sizeof(o));
    assert_true(n <= MAX_WATCH);
    o.stats = tu_stats(e);
    o.tier[0] = tu_tier(e, KVH_TIER_DEVICE);
    o.tier[1] = tu_tier(e, KVH_TIER_HOST);
    o.n = n;
    for (uint32_t i = 0; i < n; i++)
        o.blk[i] = tu_binfo(e, b[i]);
    return o;
}

static void assert_unchanged(kvh_engine *e, const kvh_block *b, const observed *before)
{
    observed now = observe(e, b, before->n);
    assert_memory_equal(&now.stats, &before->stats, sizeof(now.stats));
    assert_memory_equal(&now.tier, &before->tier, sizeof(now.tier));
    for (uint32_t i = 0; i < now.n; i++)
        if (memcmp(&now.blk[i], &before->blk[i], sizeof(now.blk[i])) != 0)
            fail_msg("block %u changed: tolerance %u -> %u, tier %u -> %u", i, before->blk[i].tolerance,
                     now.blk[i].tolerance, before->blk[i].tier, now.blk[i].tier);
}

static uint32_t seq_blocks(kvh_engine *e, kvh_seq s, kvh_block *out)
{
    uint64_t n = (tu_seq_len(e, s) + BT - 1) / BT;
    assert_true(n <= MAX_WATCH);
    assert_ok(kvh_seq_blocks(e, s, 0, n, out));
    return (uint32_t)n;
}

/* ---- kvh_block_set_tolerance ---- */

static void test_block_set_tolerance_misuse(void **state)
{
    (void)state;
    kvh_engine *e = open_policy(KVH_EVICT_LCTRU, 0, 0);
    kvh_engine *other = open_policy(KVH_EVICT_LCTRU, 0, 0);
    kvh_seq s = seq_with(e, 1, 2 * BT, smooth);
    kvh_block b[MAX_WATCH];
    uint32_t n = seq_blocks(e, s, b);
    assert_ok(kvh_block_set_tolerance(e, b[0], 9));
    assert_ok(kvh_block_set_tolerance(e, b[1], 200));
    /* Stale: a released standalone block; a freed sequence's partial one. */
    kvh_block gone;
    assert_ok(kvh_block_alloc(e, 0, &gone));
    assert_ok(kvh_block_release(e, gone));
    kvh_seq tmp = tu_seq_new(e, 0);
    int32_t t3[3] = {1, 2, 3};
    assert_ok(kvh_seq_append(e, tmp, t3, 3));
    kvh_block partial = tu_seq_block(e, tmp, 0);
    assert_ok(kvh_seq_free(e, tmp));
    /* Foreign: a block of another engine, open and then closed. */
    kvh_seq os = seq_with(other, 2, BT, smooth);
    kvh_block foreign = tu_seq_block(other, os, 0);
    kvh_engine *closed = open_policy(KVH_EVICT_LCTRU, 0, 0);
    kvh_seq cs = seq_with(closed, 3, BT, smooth);
    kvh_block dead = tu_seq_block(closed, cs, 0);
    assert_ok(tu_close(closed));
    assert_int_equal(tu_binfo(other, foreign).tolerance, KVH_TOLERANCE_DEFAULT);

    observed before = observe(e, b, n);
    assert_fails(KVH_ERR_INVALID_ARG, kvh_block_set_tolerance(NULL, b[0], 1));
    assert_fails(KVH_ERR_BAD_HANDLE, kvh_block_set_tolerance(e, (kvh_block){0}, 1));
    assert_fails(KVH_ERR_BAD_HANDLE, kvh_block_set_tolerance(e, gone, 1));
    assert_fails(KVH_ERR_BAD_HANDLE, kvh_block_set_tolerance(e, partial, 1));
    assert_fails(KVH_ERR_BAD_HANDLE, kvh_block_set_tolerance(e, foreign, 1));
    assert_fails(KVH_ERR_BAD_HANDLE, kvh_block_set_tolerance(e, dead, 1));
    assert_fails(KVH_ERR_BAD_HANDLE, kvh_block_set_tolerance(e, (kvh_block){s.id}, 1)); /* a sequence's handle */
    tu_rng r = {tu_seed(0x70ce)};
    for (int i = 0; i < 256; i++) {
        kvh_block forged = {tu_next(&r)};
        if (forged.id == b[0].id || forged.id == b[1].id)
            continue;
        assert_fails(KVH_ERR_BAD_HANDLE, kvh_block_set_tolerance(e, forged, (uint32_t)tu_below(&r, 256)));
    }
    /* Neighbours of a live handle: other generations, other slots. */
    for (uint64_t bit = 0; bit < 64; bit++) {
        kvh_block near = {b[0].id ^ (1ull << bit)};
        if (near.id == b[1].id)
            continue;
        assert_fails(KVH_ERR_BAD_HANDLE, kvh_block_set_tolerance(e, near, 77));
    }
    const uint32_t too_big[] = {KVH_TOLERANCE_MAX + 1, 256, 1000, 0x80000000u, UINT32_MAX};
    for (size_t i = 0; i < sizeof(too_big) / sizeof(too_big[0]); i++)
        assert_fails(KVH_ERR_INVALID_ARG, kvh_block_set_tolerance(e, b[0], too_big[i]));
    assert_unchanged(e, b, &before);
    assert_int_equal(tu_binfo(other, foreign).tolerance, KVH_TOLERANCE_DEFAULT);

    /* The bounds themselves are accepted. */
    assert_ok(kvh_block_set_tolerance(e, b[0], 0));
    assert_int_equal(tol_of(e, s, 0), 0);
    assert_ok(kvh_block_set_tolerance(e, b[0], KVH_TOLERANCE_MAX));
    assert_int_equal(tol_of(e, s, 0), KVH_TOLERANCE_MAX);
    assert_int_equal(tol_of(e, s, 1), 200);
    /* A cached block (no reference left, still in the prefix index) can
     * be set too. */
    assert_ok(kvh_block_retain(e, b[1]));
    assert_ok(kvh_seq_free(e, s));
    assert_ok(kvh_block_set_tolerance(e, b[1], 3));
    assert_int_equal(tu_binfo(e, b[1]).tolerance, 3);
    assert_ok(kvh_block_release(e, b[1]));
}

/* ---- kvh_seq_set_tolerance ---- */

static void test_seq_set_tolerance_misuse(void **state)
{
    (void)state;
    kvh_engine *e = open_policy(KVH_EVICT_LCTRU, 0, 0);
    const uint64_t len = 2 * BT + 5; /* three blocks, the last partial */
    kvh_seq s = seq_with(e, 1, len, smooth);
    kvh_block b[MAX_WATCH];
    uint32_t n = seq_blocks(e, s, b);
    assert_int_equal(n, 3);
    assert_ok(kvh_seq_set_tolerance(e, s, 0, len, 40));
    kvh_seq freed = seq_with(e, 2, BT, smooth);
    assert_ok(kvh_seq_free(e, freed));

    observed before = observe(e, b, n);
    assert_fails(KVH_ERR_INVALID_ARG, kvh_seq_set_tolerance(NULL, s, 0, len, 1));
    const uint32_t too_big[] = {KVH_TOLERANCE_MAX + 1, 4096, 0x80000000u, UINT32_MAX};
    for (size_t i = 0; i < sizeof(too_big) / sizeof(too_big[0]); i++)
        assert_fails(KVH_ERR_INVALID_ARG, kvh_seq_set_tolerance(e, s, 0, len, too_big[i]));
    /* Ranges past the end, including ones whose end wraps around 2^64
     * into the sequence. */
    const struct {
        uint64_t first, n;
    } out[] = {
        {0, len + 1},
        {len, 1},
        {len - 1, 2},
        {BT, len},
        {UINT64_MAX, 1},
        {1, UINT64_MAX},
        {UINT64_MAX, UINT64_MAX},
        {len - 1, UINT64_MAX - len + 2}, /* first + n wraps to 1 */
        {BT, UINT64_MAX - BT + 1},       /* first + n wraps to 0 */
        {UINT64_MAX - 2, 4},             /* wraps to 1 */
        {(uint64_t)BT << 40, BT},
        {len + 1, 0}, /* empty, but past the end: refused as every range call does */
        {UINT64_MAX, 0},
    };
    for (size_t i = 0; i < sizeof(out) / sizeof(out[0]); i++) {
        kvh_status st = kvh_seq_set_tolerance(e, s, out[i].first, out[i].n, 200);
        if (st != KVH_ERR_RANGE)
            fail_msg("[%" PRIu64 ", +%" PRIu64 ") of %" PRIu64 " tokens: %s, expected KVH_ERR_RANGE", out[i].first,
                     out[i].n, len, kvh_status_name(st));
        assert_true(kvh_last_error()[0] != '\0');
        assert_unchanged(e, b, &before);
    }
    /* Handles: null, freed, forged, a block's. */
    assert_fails(KVH_ERR_BAD_HANDLE, kvh_seq_set_tolerance(e, (kvh_seq){0}, 0, 1, 1));
    assert_fails(KVH_ERR_BAD_HANDLE, kvh_seq_set_tolerance(e, freed, 0, 1, 1));
    assert_fails(KVH_ERR_BAD_HANDLE, kvh_seq_set_tolerance(e, (kvh_seq){b[0].id}, 0, 1, 1));
    tu_rng r = {tu_seed(0x5e9)};
    for (int i = 0; i < 256; i++) {
        kvh_seq forged = {tu_next(&r)};
        if (forged.id == s.id)
            continue;
        assert_fails(KVH_ERR_BAD_HANDLE, kvh_seq_set_tolerance(e, forged, 0, 1, 1));
    }
    for (uint64_t bit = 0; bit < 64; bit++)
        assert_fails(KVH_ERR_BAD_HANDLE, kvh_seq_set_tolerance(e, (kvh_seq){s.id ^ (1ull << bit)}, 0, 1, 1));
    assert_unchanged(e, b, &before);
    for (uint32_t i = 0; i < n; i++)
        assert_int_equal(tol_of(e, s, i), 40);
}

/* Exactly the blocks holding the range change; a shared block changes for
 * every sequence using it; appended blocks start at the default; a
 * copy-on-write copy keeps its source's tolerance. */
static void test_seq_set_tolerance_covers_exactly_the_range(void **state)
{
    (void)state;
    kvh_engine *e = open_policy(KVH_EVICT_LCTRU, 0, 0);
    kvh_seq s = seq_with(e, 1, 4 * BT, smooth);
    assert_ok(kvh_seq_set_tolerance(e, s, 0, 4 * BT, 0));
    /* The last token of block 0 and the first of block 1. */
    assert_ok(kvh_seq_set_tolerance(e, s, BT - 1, 2, 11));
    assert_int_equal(tol_of(e, s, 0), 11);
    assert_int_equal(tol_of(e, s, 1), 11);
    assert_int_equal(tol_of(e, s, 2), 0);
    assert_int_equal(tol_of(e, s, 3), 0);
    /* One token in the middle of block 2; an empty range anywhere inside. */
    assert_ok(kvh_seq_set_tolerance(e, s, 2 * BT + 7, 1, 22));
    assert_ok(kvh_seq_set_tolerance(e, s, 3 * BT, 0, 99));
    assert_ok(kvh_seq_set_tolerance(e, s, 0, 0, 99));
    assert_int_equal(tol_of(e, s, 1), 11);
    assert_int_equal(tol_of(e, s, 2), 22);
    assert_int_equal(tol_of(e, s, 3), 0);
    /* The last token only. */
    assert_ok(kvh_seq_set_tolerance(e, s, 4 * BT - 1, 1, KVH_TOLERANCE_MAX));
    assert_int_equal(tol_of(e, s, 3), KVH_TOLERANCE_MAX);

    /* Shared blocks: set through the child, seen through the parent. */
    kvh_seq child;
    assert_ok(kvh_seq_fork(e, s, 0, &child));
    assert_ok(kvh_seq_set_tolerance(e, child, BT, BT, 33));
    assert_int_equal(tol_of(e, s, 1), 33);
    assert_int_equal(tol_of(e, child, 1), 33);
    /* A write into the shared block copies it with its tolerance; the two
     * are separate from then on. */
    float row[D] = {0};
    assert_ok(kvh_seq_write_kv(e, child, 0, BT + 3, 1, row, row));
    assert_true(tu_seq_block(e, child, 1).id != tu_seq_block(e, s, 1).id);
    assert_int_equal(tol_of(e, child, 1), 33);
    assert_ok(kvh_seq_set_tolerance(e, child, BT, 1, 44));
    assert_int_equal(tol_of(e, child, 1), 44);
    assert_int_equal(tol_of(e, s, 1), 33);
    /* Appended blocks start at the default. */
    int32_t more[BT + 1];
    tu_iota(more, BT + 1, 5000);
    assert_ok(kvh_seq_append(e, s, more, BT + 1));
    assert_int_equal(tol_of(e, s, 4), KVH_TOLERANCE_DEFAULT);
    assert_int_equal(tol_of(e, s, 5), KVH_TOLERANCE_DEFAULT);
    assert_int_equal(tol_of(e, s, 3), KVH_TOLERANCE_MAX);
}

/* ---- kvh_seq_derive_tolerance ---- */

static float bits_to_float(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

static void test_derive_tolerance_refuses_bad_bounds(void **state)
{
    (void)state;
    kvh_engine *e = open_policy(KVH_EVICT_LCTRU, 0, KVH_CODEC_INT8);
    kvh_seq s = seq_with(e, 1, 2 * BT, smooth);
    kvh_block b[MAX_WATCH];
    uint32_t n = seq_blocks(e, s, b);
    assert_ok(kvh_seq_set_tolerance(e, s, 0, 2 * BT, 7));
    kvh_seq freed = seq_with(e, 2, BT, smooth);
    assert_ok(kvh_seq_free(e, freed));
    observed before = observe(e, b, n);
    const float bad[] = {
        NAN,
        -NAN,
        bits_to_float(0x7f800001u), /* signalling NaN */
        bits_to_float(0xffffffffu),
        INFINITY,
        -INFINITY,
        -1.0f,
        -FLT_MIN,
        -FLT_MAX,
        bits_to_float(0x80000001u), /* the smallest negative subnormal */
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        kvh_status st = kvh_seq_derive_tolerance(e, s, 0, 2 * BT, bad[i]);
        if (st != KVH_ERR_INVALID_ARG)
            fail_msg("max_rel_error %g (#%zu): %s, expected KVH_ERR_INVALID_ARG", (double)bad[i], i,
                     kvh_status_name(st));
        assert_true(kvh_last_error()[0] != '\0');
        assert_unchanged(e, b, &before);
    }
    assert_fails(KVH_ERR_INVALID_ARG, kvh_seq_derive_tolerance(NULL, s, 0, 2 * BT, 0));
    assert_fails(KVH_ERR_RANGE, kvh_seq_derive_tolerance(e, s, 0, 2 * BT + 1, 0));
    assert_fails(KVH_ERR_RANGE, kvh_seq_derive_tolerance(e, s, 2 * BT - 1, UINT64_MAX - 2 * BT + 3, 0));
    assert_fails(KVH_ERR_RANGE, kvh_seq_derive_tolerance(e, s, UINT64_MAX, 1, 0));
    assert_fails(KVH_ERR_RANGE, kvh_seq_derive_tolerance(e, s, 2 * BT + 1, 0, 0));
    assert_ok(kvh_seq_derive_tolerance(e, s, 2 * BT, 0, 0)); /* empty, at the end */
    assert_fails(KVH_ERR_BAD_HANDLE, kvh_seq_derive_tolerance(e, freed, 0, 1, 0));
    assert_fails(KVH_ERR_BAD_HANDLE, kvh_seq_derive_tolerance(e, (kvh_seq){0}, 0, 1, 0));
    assert_fails(KVH_ERR_BAD_HANDLE, kvh_seq_derive_tolerance(e, (kvh_seq){b[0].id}, 0, 1, 0));
    assert_unchanged(e, b, &before);
    for (uint32_t i = 0; i < n; i++)
        assert_int_equal(tol_of(e, s, i), 7);

    /* No codec: nothing to measure, whatever the range. */
    kvh_engine *plain = open_policy(KVH_EVICT_LCTRU, 0, KVH_CODEC_NONE);
    kvh_seq p = seq_with(plain, 3, BT, smooth);
    assert_fails(KVH_ERR_UNSUPPORTED, kvh_seq_derive_tolerance(plain, p, 0, BT, 0));
    assert_fails(KVH_ERR_UNSUPPORTED, kvh_seq_derive_tolerance(plain, p, 0, BT, 0.5f));
    assert_int_equal(tol_of(plain, p, 0), KVH_TOLERANCE_DEFAULT);
}

/* Integers in [-127, 127] with 127 in every vector: int8 holds them
 * exactly (scale 1). */
static float exact_int8(uint64_t t, uint32_t d)
{
    return d == 0 ? 127.0f : (float)((int)((t * 31 + d * 7) % 255) - 127);
}

static float lossy(uint64_t t, uint32_t d)
{
    tu_rng r = {t * 1000003u + d};
    return (float)((double)(tu_next(&r) >> 11) / (double)(1ull << 53)) * 2.0f - 1.0f + (d == 5 ? 50.0f : 0.0f);
}

static float zeros(uint64_t t, uint32_t d)
{
    (void)t;
    (void)d;
    return 0.0f;
}

static float non_finite(uint64_t t, uint32_t d)
{
    switch ((t + d) % 4) {
    case 0:
        return NAN;
    case 1:
        return INFINITY;
    case 2:
        return -INFINITY;
    default:
        return (float)d;
    }
}

static float all_nan(uint64_t t, uint32_t d)
{
    (void)t;
    (void)d;
    return NAN;
}

static float huge_values(uint64_t t, uint32_t d) { return (t + d) % 2 ? FLT_MAX : -FLT_MAX / 3; }

static float subnormals(uint64_t t, uint32_t d) { return bits_to_float(1u + (uint32_t)((t * D + d) % 97)); }

/* Finite bounds at the extremes and hostile K/V: every derived tolerance
 * is within 0..255, blocks the codec keeps exactly get the maximum, a
 * lossy block gets 0 under a subnormal bound and the maximum under
 * FLT_MAX; unwritten blocks and blocks outside the device tier keep
 * theirs. */
static void test_derive_tolerance_hostile_data(void **state)
{
    (void)state;
    kvh_engine *e = open_engine(KVH_EVICT_LCTRU, 0, KVH_CODEC_INT8, 16);
    float (*const kinds[])(uint64_t, uint32_t) = {exact_int8, lossy,       zeros,     non_finite,
                                                  all_nan,    huge_values, subnormals};
    const char *const names[] = {"exact", "lossy", "zeros", "non-finite", "all NaN", "huge", "subnormal"};
    enum { NK = sizeof(kinds) / sizeof(kinds[0]) };
    kvh_seq s[NK];
    for (uint32_t k = 0; k < NK; k++) {
        s[k] = seq_with(e, 10 + k, BT, kinds[k]);
        assert_int_equal(tu_seq_binfo(e, s[k], 0).tier, KVH_TIER_DEVICE);
    }
    const float bounds[] = {0.0f, 0.25f, 1e-3f, bits_to_float(1u), FLT_MIN, 1.0f, 1e30f, FLT_MAX};
    for (size_t j = 0; j < sizeof(bounds) / sizeof(bounds[0]); j++)
        for (uint32_t k = 0; k < NK; k++) {
            assert_ok(kvh_seq_set_tolerance(e, s[k], 0, BT, 1));
            assert_ok(kvh_seq_derive_tolerance(e, s[k], 0, BT, bounds[j]));
            uint32_t t = tol_of(e, s[k], 0);
            if (t > KVH_TOLERANCE_MAX)
                fail_msg("%s K/V, max_rel_error %g: tolerance %u", names[k], (double)bounds[j], t);
            if (k == 0 && t != KVH_TOLERANCE_MAX)
                fail_msg("exactly coded K/V, max_rel_error %g: tolerance %u, expected %u", (double)bounds[j], t,
                         KVH_TOLERANCE_MAX);
        }
    assert_ok(kvh_seq_derive_tolerance(e, s[1], 0, BT, 0));
    uint32_t mid = tol_of(e, s[1], 0);
    assert_true(mid > 0 && mid < KVH_TOLERANCE_MAX);
    assert_ok(kvh_seq_derive_tolerance(e, s[1], 0, BT, bits_to_float(1u)));
    assert_int_equal(tol_of(e, s[1], 0), 0);
    assert_ok(kvh_seq_derive_tolerance(e, s[1], 0, BT, FLT_MAX));
    assert_int_equal(tol_of(e, s[1], 0), KVH_TOLERANCE_MAX);
    /* A stricter bound never gives a higher tolerance. */
    uint32_t last = KVH_TOLERANCE_MAX;
    const float stricter[] = {10.0f, 1.0f, 0.25f, 0.1f, 0.05f, 0.02f, 0.01f, 1e-3f, 1e-6f};
    for (size_t j = 0; j < sizeof(stricter) / sizeof(stricter[0]); j++) {
        assert_ok(kvh_seq_derive_tolerance(e, s[1], 0, BT, stricter[j]));
        uint32_t t = tol_of(e, s[1], 0);
        assert_true(t <= last);
        last = t;
    }
    assert_int_equal(last, 0);

    /* Nothing written: kept. Partly written: derived from what is. */
    kvh_seq bare = tu_seq_new(e, 0);
    int32_t tok[2 * BT];
    tu_iota(tok, 2 * BT, 900);
    assert_ok(kvh_seq_append(e, bare, tok, 2 * BT));
    float row[3 * D];
    for (int i = 0; i < 3 * D; i++)
        row[i] = exact_int8(0, (uint32_t)(i % D));
    assert_ok(kvh_seq_write_kv(e, bare, 0, BT, 3, row, row));
    assert_ok(kvh_seq_set_tolerance(e, bare, 0, 2 * BT, 17));
    assert_ok(kvh_seq_derive_tolerance(e, bare, 0, 2 * BT, 1e-6f));
    assert_int_equal(tol_of(e, bare, 0), 17);
    assert_int_equal(tol_of(e, bare, 1), KVH_TOLERANCE_MAX);
    /* In the host tier (already encoded): kept. */
    assert_ok(kvh_seq_migrate(e, s[1], 0, BT, KVH_TIER_HOST, NULL));
    assert_int_equal(tu_seq_binfo(e, s[1], 0).tier, KVH_TIER_HOST);
    assert_ok(kvh_seq_set_tolerance(e, s[1], 0, BT, 9));
    assert_ok(kvh_seq_derive_tolerance(e, s[1], 0, BT, 1e-6f));
    assert_int_equal(tol_of(e, s[1], 0), 9);
}

/* ---- what tolerance does to the victim order ---- */

static float tagged(uint64_t t, uint32_t d) { return (float)(t * D + d) * 0.37f; }

static void touch(kvh_engine *e, kvh_seq s)
{
    float k[BT * D];
    assert_ok(kvh_seq_read_kv(e, s, 0, 0, BT, k, NULL));
}

typedef void (*before_victim_fn)(kvh_engine *e, kvh_seq s[4]);

/* Four one-block sequences fill the device tier, used in order 0..3; fn
 * then acts on them, and a fifth block is brought into the device tier.
 * Returns which of the four left. */
static int victim_after(kvh_engine *e, before_victim_fn fn, float (*data)(uint64_t, uint32_t))
{
    kvh_seq extra = seq_with(e, 9, BT, tagged);
    assert_ok(kvh_seq_migrate(e, extra, 0, BT, KVH_TIER_HOST, NULL));
    kvh_seq s[4];
    for (int i = 0; i < 4; i++) {
        s[i] = seq_with(e, (uint32_t)i, BT, data ? data : tagged);
        assert_ok(kvh_seq_set_tolerance(e, s[i], 0, BT, 0));
    }
    for (int i = 0; i < 4; i++) {
        touch(e, s[i]);
        assert_int_equal(tu_seq_binfo(e, s[i], 0).tier, KVH_TIER_DEVICE);
    }
    fn(e, s);
    assert_ok(kvh_seq_acquire(e, extra, 0, BT, NULL));
    int gone = -1;
    for (int i = 0; i < 4; i++)
        if (tu_seq_binfo(e, s[i], 0).tier != KVH_TIER_DEVICE) {
            assert_int_equal(gone, -1);
            gone = i;
        }
    assert_ok(kvh_seq_release(e, extra, 0, BT));
    return gone;
}

static void nothing(kvh_engine *e, kvh_seq s[4])
{
    (void)e;
    (void)s;
}

static void newest_tolerant_by_block(kvh_engine *e, kvh_seq s[4])
{
    assert_ok(kvh_block_set_tolerance(e, tu_seq_block(e, s[3], 0), KVH_TOLERANCE_MAX));
}

static void newest_tolerant_by_range(kvh_engine *e, kvh_seq s[4])
{
    assert_ok(kvh_seq_set_tolerance(e, s[3], BT - 1, 1, KVH_TOLERANCE_MAX));
}

/* Every refused way of making the newest block tolerant. */
static void newest_tolerant_refused(kvh_engine *e, kvh_seq s[4])
{
    kvh_block b = tu_seq_block(e, s[3], 0);
    assert_fails(KVH_ERR_INVALID_ARG, kvh_block_set_tolerance(e, b, KVH_TOLERANCE_MAX + 1));
    assert_fails(KVH_ERR_INVALID_ARG, kvh_block_set_tolerance(e, b, UINT32_MAX));
    assert_fails(KVH_ERR_INVALID_ARG, kvh_seq_set_tolerance(e, s[3], 0, BT, KVH_TOLERANCE_MAX + 1));
    assert_fails(KVH_ERR_RANGE, kvh_seq_set_tolerance(e, s[3], 0, BT + 1, KVH_TOLERANCE_MAX));
    assert_fails(KVH_ERR_RANGE, kvh_seq_set_tolerance(e, s[3], BT - 1, UINT64_MAX, KVH_TOLERANCE_MAX));
    assert_fails(KVH_ERR_BAD_HANDLE, kvh_block_set_tolerance(e, (kvh_block){b.id ^ (1ull << 40)}, KVH_TOLERANCE_MAX));
    assert_fails(KVH_ERR_INVALID_ARG, kvh_seq_derive_tolerance(e, s[3], 0, BT, NAN));
    assert_fails(KVH_ERR_INVALID_ARG, kvh_seq_derive_tolerance(e, s[3], 0, BT, -INFINITY));
    assert_int_equal(tol_of(e, s[3], 0), 0);
}

/* Through a fork that shares the block. */
static void newest_tolerant_through_a_fork(kvh_engine *e, kvh_seq s[4])
{
    kvh_seq child;
    assert_ok(kvh_seq_fork(e, s[3], 0, &child));
    assert_ok(kvh_seq_set_tolerance(e, child, 0, BT, KVH_TOLERANCE_MAX));
    assert_int_equal(tol_of(e, s[3], 0), KVH_TOLERANCE_MAX);
}

/* Hinted blocks: ordered by their hints, tolerance left out. Block 1 has
 * the lowest priority; block 2 is the tolerant one. */
static void hinted_with_a_tolerant_block(kvh_engine *e, kvh_seq s[4])
{
    for (int i = 0; i < 4; i++)
        assert_ok(kvh_seq_hint(e, s[i], 0, BT, i == 1 ? 1 : 1000));
    assert_ok(kvh_seq_set_tolerance(e, s[2], 0, BT, KVH_TOLERANCE_MAX));
}

static void derive_with_a_strict_bound(kvh_engine *e, kvh_seq s[4])
{
    for (int i = 0; i < 4; i++)
        assert_ok(kvh_seq_derive_tolerance(e, s[i], 0, BT, 1e-6f));
    for (int i = 0; i < 3; i++)
        assert_int_equal(tol_of(e, s[i], 0), 0);
    assert_int_equal(tol_of(e, s[3], 0), KVH_TOLERANCE_MAX);
}

static void test_tolerance_changes_the_victim_order(void **state)
{
    (void)state;
    /* Equal tolerances: the least recent block goes. */
    assert_int_equal(victim_after(open_policy(KVH_EVICT_LCTRU, 1000, 0), nothing, NULL), 0);
    /* The newest block made fully tolerant, by handle or by range: it
     * goes instead. */
    assert_int_equal(victim_after(open_policy(KVH_EVICT_LCTRU, 1000, 0), newest_tolerant_by_block, NULL), 3);
    assert_int_equal(victim_after(open_policy(KVH_EVICT_LCTRU, 1000, 0), newest_tolerant_by_range, NULL), 3);
    assert_int_equal(victim_after(open_policy(KVH_EVICT_LCTRU, 1000, 0), newest_tolerant_through_a_fork, NULL), 3);
    /* Refused calls change nothing of the order. */
    assert_int_equal(victim_after(open_policy(KVH_EVICT_LCTRU, 1000, 0), newest_tolerant_refused, NULL), 0);
    /* LRU-K (and LCTRU with a window of one access) ignore it. */
    assert_int_equal(victim_after(open_policy(KVH_EVICT_LRU_K, 1000, 0), newest_tolerant_by_block, NULL), 0);
    assert_int_equal(victim_after(open_policy(KVH_EVICT_LCTRU, 1, 0), newest_tolerant_by_block, NULL), 0);
    /* Hints rank hinted blocks, whatever their tolerance. */
    assert_int_equal(victim_after(open_policy(KVH_EVICT_LCTRU, 1000, 0), hinted_with_a_tolerant_block, NULL), 1);
}

/* Derived tolerance orders victims too: the one block the codec keeps
 * exactly leaves first under a strict bound. */
static void test_derived_tolerance_changes_the_victim_order(void **state)
{
    (void)state;
    kvh_engine *e = open_policy(KVH_EVICT_LCTRU, 1000, KVH_CODEC_INT8);
    kvh_seq extra = seq_with(e, 9, BT, tagged);
    assert_ok(kvh_seq_migrate(e, extra, 0, BT, KVH_TIER_HOST, NULL));
    kvh_seq s[4];
    for (int i = 0; i < 4; i++)
        s[i] = seq_with(e, (uint32_t)i, BT, i == 3 ? exact_int8 : lossy);
    for (int i = 0; i < 4; i++)
        touch(e, s[i]);
    derive_with_a_strict_bound(e, s);
    assert_ok(kvh_seq_acquire(e, extra, 0, BT, NULL));
    assert_int_equal(tu_seq_binfo(e, s[3], 0).tier, KVH_TIER_HOST);
    for (int i = 0; i < 3; i++)
        assert_int_equal(tu_seq_binfo(e, s[i], 0).tier, KVH_TIER_DEVICE);
    /* It went through the codec and came back exact. */
    float k[BT * D];
    assert_ok(kvh_seq_read_kv(e, s[3], 0, 0, BT, k, NULL));
    for (uint32_t t = 0; t < BT; t++)
        for (uint32_t d = 0; d < D; d++)
            assert_true(k[t * D + d] == exact_int8(t, d));
}

static uint32_t first_block_tolerance(kvh_engine *e, kvh_seq s)
{
    kvh_block b;
    assert_ok(kvh_seq_blocks(e, s, 0, 1, &b));
    kvh_block_info bi = {.struct_size = sizeof(bi)};
    assert_ok(kvh_block_info_get(e, b, &bi));
    return bi.tolerance;
}

/* kvh.h: a store does not keep tolerance; blocks found again in a
 * reopened disk tier start at KVH_TOLERANCE_DEFAULT (they started at 0,
 * the most intolerant, and so did their copy-on-write copies). */
static void test_blocks_of_a_reopened_store_start_at_the_default(void **state)
{
    (void)state;
    const char *tmp = getenv("KVH_TEST_TMPDIR");
    char dir[600];
    snprintf(dir, sizeof(dir), "%s/tolerance-store-%d", tmp && *tmp ? tmp : "/tmp", (int)getpid());
    kvh_config c = tu_cfg(1, 1, D, BT, KVH_DTYPE_F32, 16, 16, 0);
    c.eviction_policy = KVH_EVICT_LCTRU;
    c.disk_path = dir;
    c.disk_bytes = 64 * 8192;
    c.disk_flags = KVH_DISK_RESET_ON_MISMATCH;
    kvh_engine *e = tu_open_cfg(&c);
    kvh_seq s = tu_seq_new(e, 0);
    int32_t tok[BT];
    for (uint32_t i = 0; i < BT; i++)
        tok[i] = (int32_t)(7000 + i);
    float kv[BT * D];
    for (uint32_t i = 0; i < BT * D; i++)
        kv[i] = (float)i;
    assert_ok(kvh_seq_append(e, s, tok, BT));
    assert_ok(kvh_seq_write_kv(e, s, 0, 0, BT, kv, kv));
    assert_ok(kvh_seq_set_tolerance(e, s, 0, BT, 7));
    assert_ok(kvh_seq_persist(e, s));
    assert_ok(tu_close(e));
    e = tu_open_cfg(&c);
    s = tu_seq_new(e, 0);
    size_t matched = 0;
    assert_ok(kvh_seq_match_prefix(e, s, tok, BT, &matched));
    assert_int_equal(matched, BT);
    assert_int_equal(first_block_tolerance(e, s), KVH_TOLERANCE_DEFAULT);
    assert_ok(kvh_seq_write_kv(e, s, 0, 0, 1, kv, kv)); /* copy on write */
    assert_int_equal(first_block_tolerance(e, s), KVH_TOLERANCE_DEFAULT);
}

/* kvh.h: e is the error of an encode and decode on the side, which a
 * demotion's round trip rounds to the engine's dtype. A bf16 block that
 * went to the host tier and back lies on the codec's grid: a second
 * round trip changes no value, so e = 0 and the tolerance is 255 at any
 * max_rel_error (it was measured against the unrounded decode: 32 at
 * 0.002). */
static void test_derived_tolerance_of_a_block_the_codec_keeps_exactly(void **state)
{
    (void)state;
    enum { DB = 64, TB = 2 };
    kvh_config c = tu_cfg(1, 1, DB, TB, KVH_DTYPE_BF16, 4, 64, 0);
    c.kv_codec = KVH_CODEC_Q4_G64;
    kvh_engine *e = tu_open_cfg(&c);
    kvh_seq s = tu_seq_new(e, 0);
    int32_t tok[TB] = {1, 2};
    assert_ok(kvh_seq_append(e, s, tok, TB));
    uint16_t k[TB * DB], v[TB * DB], k1[TB * DB], v1[TB * DB], k2[TB * DB], v2[TB * DB];
    tu_rng r = {11};
    for (int i = 0; i < TB * DB; i++) {
        float kf = (float)((int)(tu_next(&r) % 2000) - 1000) / 137.0f;
        float vf = (float)((int)(tu_next(&r) % 2000) - 1000) / 91.0f;
        uint32_t ku, vu;
        memcpy(&ku, &kf, 4);
        memcpy(&vu, &vf, 4);
        k[i] = (uint16_t)(ku >> 16);
        v[i] = (uint16_t)(vu >> 16);
    }
    assert_ok(kvh_seq_write_kv(e, s, 0, 0, TB, k, v));
    tu_seq_migrate_wait(e, s, 0, TB, KVH_TIER_HOST);
    tu_seq_migrate_wait(e, s, 0, TB, KVH_TIER_DEVICE);
    assert_ok(kvh_seq_read_kv(e, s, 0, 0, TB, k1, v1));
    tu_seq_migrate_wait(e, s, 0, TB, KVH_TIER_HOST);
    tu_seq_migrate_wait(e, s, 0, TB, KVH_TIER_DEVICE);
    assert_ok(kvh_seq_read_kv(e, s, 0, 0, TB, k2, v2));
    assert_memory_equal(k1, k2, sizeof(k1));
    assert_memory_equal(v1, v2, sizeof(v1));
    const float bounds[] = {0.0f, 0.01f, 0.002f};
    for (size_t i = 0; i < sizeof(bounds) / sizeof(bounds[0]); i++) {
        assert_ok(kvh_seq_derive_tolerance(e, s, 0, TB, bounds[i]));
        assert_int_equal(first_block_tolerance(e, s), KVH_TOLERANCE_MAX);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_block_set_tolerance_misuse, tu_teardown),
        cmocka_unit_test_teardown(test_seq_set_tolerance_misuse, tu_teardown),
        cmocka_unit_test_teardown(test_seq_set_tolerance_covers_exactly_the_range, tu_teardown),
        cmocka_unit_test_teardown(test_derive_tolerance_refuses_bad_bounds, tu_teardown),
        cmocka_unit_test_teardown(test_derive_tolerance_hostile_data, tu_teardown),
        cmocka_unit_test_teardown(test_tolerance_changes_the_victim_order, tu_teardown),
        cmocka_unit_test_teardown(test_derived_tolerance_changes_the_victim_order, tu_teardown),
        cmocka_unit_test_teardown(test_blocks_of_a_reopened_store_start_at_the_default, tu_teardown),
        cmocka_unit_test_teardown(test_derived_tolerance_of_a_block_the_codec_keeps_exactly, tu_teardown),
    };
    return cmocka_run_group_tests_name("tolerance_hostile", tests, NULL, NULL);
}
