/* State and checks shared by the ops of fuzz_api.c (fuzz/api_ops_*.h).
 *
 * Geometry: L layers, H KV heads, BT-token blocks, f16. The head
 * dimension is 4, or 512 in the views mode (one head's K of a block is
 * then one 4 KiB page, what kvh_seq_vmap maps).
 *
 * K/V content is a pure function of (token id, layer, K or V, byte), so
 * every successful read can be checked. With a kv_codec the host and disk
 * tiers are lossy: the content is then finite f16 values and reads are
 * checked against the codec's documented error bound instead of byte for
 * byte. */
#ifndef KVH_FUZZ_API_HARNESS_H
#define KVH_FUZZ_API_HARNESS_H

#include <math.h>

#include "fuzz_common.h"

enum {
    L = 2,
    H = 2,
    BT = 4,
    MAXN = 24,
    D_SMALL = 4,
    D_VIEWS = 512,
    TOK_MAX = H * D_VIEWS * 2,
    NSEQ = 8,
    NBLK = 16,
    NFEN = 8,
    NPOOL = 2,
    NCTX = 4,
    NREG = 4,
    REG_MAX = 2048,
    NVIEW = 4,
    NPLAN = 4,
    MAX_ROWS = 12,
    MAX_QH = 2 * H,
};

/* What the harness knows a context's regions hold. */
typedef struct ctx_track {
    uint32_t n_regions;
    uint64_t size[NREG];
    uint8_t expect[NREG][REG_MAX];
} ctx_track;

typedef struct view_track {
    kvh_vmap *vmap;
    uint64_t seq;
} view_track;

typedef struct state {
    kvh_engine *e;
    kvh_config cfg;
    bool disk;
    uint32_t d, tok, codec; /* head_dim, bytes of one token's K (all heads), kv_codec */
    uint64_t block_bytes;
    uint64_t seqs[NSEQ], blocks[NBLK], fences[NFEN], pools[NPOOL], ctxs[NCTX];
    uint64_t owned[NBLK];      /* block references the harness holds ... */
    uint32_t owned_refs[NBLK]; /* ... and how many */
    ctx_track ctx[NCTX];
    view_track views[NVIEW];
    kvh_attention_plan *plans[NPLAN];
    uint8_t pool_mem[NPOOL][2 * L][4 * BT * TOK_MAX]; /* [layer*2 + kv][slot][token][head][dim] */
    void *kbase[NPOOL][L], *vbase[NPOOL][L];
    int32_t prompts[4][MAXN];
    char weights_path[600]; /* a file weight regions may name */
    uint8_t weights_file[4096];
    /* scratch, too large for the stack of every op */
    uint8_t k[MAXN * TOK_MAX], v[MAXN * TOK_MAX], wk[MAXN * TOK_MAX], wv[MAXN * TOK_MAX];
    float q[MAX_ROWS * MAX_QH * D_VIEWS], out[MAX_ROWS * MAX_QH * D_VIEWS], out2[MAX_ROWS * MAX_QH * D_VIEWS];
} state;

static const uint64_t SENT = 0x5e5e5e5e5e5e5e5eull;

/* Prints each op and its status when KVH_FUZZ_TRACE is set (for writing
 * seeds by hand). */
static inline void trace(const char *what, kvh_status st)
{
    static int on = -1;
    if (on < 0)
        on = getenv("KVH_FUZZ_TRACE") != NULL;
    if (on)
        fprintf(stderr, "  %-28s %s\n", what, kvh_status_name(st));
}

static uint64_t pick(fz_in *in, const uint64_t *pool, int n)
{
    uint8_t c = fz_u8(in);
    if (c < 200)
        return pool[c % n];
    if (c < 230)
        return fz_u64(in); /* forged */
    return 0;              /* the null handle */
}

static void keep(uint64_t *pool, int n, fz_in *in, uint64_t h) { pool[fz_u8(in) % n] = h; }

/* A struct_size that is usually right: 1 in 16 is the input's byte. */
static uint32_t struct_size(fz_in *in, size_t right) { return fz_u8(in) < 240 ? (uint32_t)right : fz_u8(in); }

/* One token's K (kv 0) or V (kv 1) of one layer, all heads: s->tok bytes.
 * With a codec every f16 is a finite normal number in [1/4, 8). */
static void kv_token(const state *s, int32_t token, uint32_t layer, int kv, uint8_t *out)
{
    uint64_t seed = ((uint64_t)(uint32_t)token << 20) ^ ((uint64_t)layer << 12) ^ ((uint64_t)kv << 10);
    for (uint32_t j = 0; j < s->tok; j += 8) {
        uint64_t w = fz_mix(seed ^ j);
        if (s->codec)
            for (int lane = 0; lane < 4; lane++) {
                uint64_t h = (w >> (16 * lane)) & 0xffff;
                h = (h & 0x83ff) | (uint64_t)(13 + (h >> 10) % 5) << 10;
                w = (w & ~(0xffffull << (16 * lane))) | h << (16 * lane);
            }
        memcpy(out + j, &w, 8);
    }
}

static void fill_kv(const state *s, const int32_t *tokens, size_t n, uint32_t layer, uint8_t *k, uint8_t *v)
{
    for (size_t t = 0; t < n; t++) {
        kv_token(s, tokens[t], layer, 0, k + t * s->tok);
        kv_token(s, tokens[t], layer, 1, v + t * s->tok);
    }
}

static float half_to_float(uint16_t h)
{
    uint32_t sign = h >> 15, exp = (h >> 10) & 31, mant = h & 0x3ff;
    float m = exp == 0    ? ldexpf((float)mant, -24)
              : exp == 31 ? (mant ? NAN : INFINITY)
                          : ldexpf((float)(mant | 0x400), (int)exp - 25);
    return sign ? -m : m;
}

/* The documented bound of codec on one vector of n floats (element i),
 * over the vector (INT8) or the element's group (Q4). */
static float codec_bound(uint32_t codec, const float *x, uint32_t n, uint32_t i)
{
    uint32_t g = codec == KVH_CODEC_Q4_G32 ? 32 : codec == KVH_CODEC_Q4_G64 ? 64 : n;
    uint32_t g0 = i / g * g;
    float amax = 0, lo = INFINITY, hi = -INFINITY;
    for (uint32_t j = g0; j < g0 + g && j < n; j++) {
        if (!isfinite(x[j]))
            continue;
        amax = fmaxf(amax, fabsf(x[j]));
        lo = fminf(lo, x[j]);
        hi = fmaxf(hi, x[j]);
    }
    return codec == KVH_CODEC_INT8 ? amax / 254 : (hi - lo) / 30;
}

/* Read K/V against what the tokens hold: exact without a codec, within
 * the codec's bound (3x, for a re-encoding after a promotion and the
 * rounding to f16) with one. */
static bool kv_matches(const state *s, const uint8_t *got, const uint8_t *want, size_t n_tokens)
{
    if (!s->codec)
        return !memcmp(got, want, n_tokens * s->tok);
    float x[D_VIEWS], y[D_VIEWS];
    for (size_t vec = 0; vec < n_tokens * H; vec++) {
        const uint8_t *a = want + vec * s->d * 2, *b = got + vec * s->d * 2;
        for (uint32_t i = 0; i < s->d; i++) {
            x[i] = half_to_float((uint16_t)(a[2 * i] | a[2 * i + 1] << 8));
            y[i] = half_to_float((uint16_t)(b[2 * i] | b[2 * i + 1] << 8));
        }
        for (uint32_t i = 0; i < s->d; i++)
            if (!(fabsf(x[i] - y[i]) <= 3 * codec_bound(s->codec, x, s->d, i) + fabsf(x[i]) / 512))
                return false;
    }
    return true;
}

/* Reads [pos, pos + n) of seq and checks it against the token ids. */
static void check_read(state *s, kvh_seq q, uint32_t layer, uint64_t pos, size_t n)
{
    int32_t tk[MAXN];
    if (n > MAXN)
        n = MAXN;
    kvh_status st = kvh_seq_read_kv(s->e, q, layer, pos, n, s->k, s->v);
    FZ_KNOWN(st);
    if (st != KVH_OK)
        return;
    FZ_CHECK(kvh_seq_tokens(s->e, q, pos, n, tk) == KVH_OK, "tokens of a range that was just read");
    fill_kv(s, tk, n, layer, s->wk, s->wv);
    FZ_CHECK(kv_matches(s, s->k, s->wk, n) && kv_matches(s, s->v, s->wv, n),
             "wrong K/V served: layer %u tokens [%llu, +%zu)", layer, (unsigned long long)pos, n);
}

#endif
