/* Scenario `alloc`: metadata paths of the block manager.
 *
 *  (a) kvh_block_alloc + kvh_block_release pairs per second on an engine
 *      whose device tier holds --blocks small blocks (CPU backend,
 *      migration_threads 0, no host tier), next to the plain thing: a
 *      pthread mutex + a stack of uint32 indices of the same block count
 *      (alloc = lock/pop/unlock, free = lock/push/unlock). Measured with the
 *      pool empty and half full (occupancy), and as "allocate N, then free
 *      N" with N = every block, freeing in allocation order and in random
 *      order.
 *  (b) kvh_seq_fork of a --fork-blocks sequence (µs per fork), and freeing
 *      the child.
 *  (c) kvh_seq_match_prefix of a cached --prompt-tokens prompt on a fresh
 *      sequence (µs per match), the same for --admit-tokens (target < 2 ms),
 *      what hashing alone costs for that prompt (kvh_prefix_hash chained),
 *      freeing a matched sequence, and the cold admission of
 *      --admit-tokens new tokens (kvh_seq_append: allocation + hashing).
 *  (d) LRU-K touch rate: kvh_seq_read_kv of one token at a random position
 *      of a sequence filling the device tier (each call is one access:
 *      lookup counters, LRU-K history; the heap is re-keyed lazily), and
 *      kvh_seq_acquire + kvh_seq_release of one token (hold / unhold: heap
 *      removal and re-insertion, plus a fence).
 *
 * Rates are medians over --reps rounds; ours and the baseline run
 * interleaved (alternating which goes first) and `ratio` is the median of
 * the per-round ratios ours/baseline. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_scenarios.h"

#define SCEN "alloc"

/* ------------------------------------------------------------------ */
/* baseline: a mutex-protected free list of uint32 indices              */
/* ------------------------------------------------------------------ */

typedef struct freelist {
    pthread_mutex_t lock;
    uint32_t *stack;
    uint32_t top;
} freelist;

static void freelist_init(freelist *f, uint32_t n)
{
    pthread_mutex_init(&f->lock, NULL);
    f->stack = bench_xmalloc(sizeof(uint32_t) * n);
    for (uint32_t i = 0; i < n; i++)
        f->stack[i] = n - 1 - i;
    f->top = n;
}

static void freelist_destroy(freelist *f)
{
    free(f->stack);
    pthread_mutex_destroy(&f->lock);
}

__attribute__((noinline)) static int freelist_alloc(freelist *f, uint32_t *out)
{
    pthread_mutex_lock(&f->lock);
    if (f->top == 0) {
        pthread_mutex_unlock(&f->lock);
        return -1;
    }
    *out = f->stack[--f->top];
    pthread_mutex_unlock(&f->lock);
    return 0;
}

__attribute__((noinline)) static void freelist_free(freelist *f, uint32_t idx)
{
    pthread_mutex_lock(&f->lock);
    f->stack[f->top++] = idx;
    pthread_mutex_unlock(&f->lock);
}

/* ------------------------------------------------------------------ */
/* helpers                                                              */
/* ------------------------------------------------------------------ */

typedef struct alloc_opts {
    uint64_t blocks, pairs, fork_blocks, forks, prompt_tokens, admit_tokens, matches, touches, head_dim, block_tokens;
    bench_list touch_blocks;
    const char *parts;
} alloc_opts;

/* Whether `part` is named in the comma-separated list (or the list is "all"). */
static int want_part(const alloc_opts *o, const char *part)
{
    if (!strcmp(o->parts, "all"))
        return 1;
    size_t n = strlen(part);
    for (const char *p = o->parts; (p = strstr(p, part)); p += n)
        if ((p == o->parts || p[-1] == ',') && (p[n] == 0 || p[n] == ','))
            return 1;
    return 0;
}

static kvh_status open_small(const alloc_opts *o, uint64_t blocks, kvh_engine **e)
{
    kvh_config c;
    kvh_status st = kvh_config_init(&c, sizeof(c));
    if (st != KVH_OK)
        return st;
    c.backend = KVH_BACKEND_CPU;
    c.migration_threads = 0;
    c.num_layers = 1;
    c.num_kv_heads = 1;
    c.head_dim = (uint32_t)o->head_dim;
    c.block_tokens = (uint32_t)o->block_tokens;
    c.dtype = KVH_DTYPE_F16;
    uint64_t bb = 2ull * c.block_tokens * c.head_dim * 2;
    c.device_bytes = blocks * bb;
    c.host_bytes = 0;
    return kvh_engine_open(&c, e);
}

/* Token ids of a synthetic prompt: distinct per (stream, position). */
static void fill_tokens(int32_t *t, size_t n, uint32_t stream)
{
    for (size_t i = 0; i < n; i++)
        t[i] = (int32_t)((stream * 2654435761u) ^ (uint32_t)(i * 40503u + 7u)) & 0x7fffffff;
}

static int cmp_rate(double ours, double base) { return ours >= base; }

/* Emits a rate row with a baseline; ratio = median of per-round ratios. */
static void emit_rate(const bench_ctx *ctx, const char *metric, double *ours, double *base, int rounds,
                      const char *unit, void (*params)(bench_row *, const void *), const void *arg, double target)
{
    double *ratio = bench_xmalloc(sizeof(double) * (size_t)rounds);
    for (int r = 0; r < rounds; r++)
        ratio[r] = ours[r] / base[r];
    bench_row *row = bench_row_new(SCEN, metric, bench_median(ours, (size_t)rounds), unit);
    if (params)
        params(row, arg);
    bench_row_baseline(row, bench_median(base, (size_t)rounds), bench_median(ratio, (size_t)rounds));
    if (target > 0)
        bench_row_target(row, 1, 1, target);
    bench_emit(ctx, row);
    free(ratio);
    (void)cmp_rate;
}

/* ------------------------------------------------------------------ */
/* (a) alloc/free                                                       */
/* ------------------------------------------------------------------ */

typedef struct pair_params {
    uint64_t blocks;
    double occupancy;
    const char *order;
} pair_params;

static void pair_params_fn(bench_row *r, const void *arg)
{
    const pair_params *p = arg;
    bench_row_int(r, "blocks", (int64_t)p->blocks);
    if (p->order)
        bench_row_str(r, "order", p->order);
    else
        bench_row_num(r, "occupancy", p->occupancy);
}

/* Pairs per second through the public API. */
static int kvh_pairs(kvh_engine *e, uint64_t n, double *rate)
{
    uint64_t t0 = bench_ns();
    for (uint64_t i = 0; i < n; i++) {
        kvh_block b;
        kvh_status st = kvh_block_alloc(e, 0, &b);
        if (st != KVH_OK)
            return bench_kvh_fail("kvh_block_alloc", st);
        st = kvh_block_release(e, b);
        if (st != KVH_OK)
            return bench_kvh_fail("kvh_block_release", st);
    }
    *rate = (double)n * 1e9 / (double)(bench_ns() - t0);
    return 0;
}

static int base_pairs(freelist *f, uint64_t n, double *rate)
{
    uint64_t t0 = bench_ns(), acc = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint32_t x;
        if (freelist_alloc(f, &x) != 0)
            return 1;
        acc += x;
        freelist_free(f, x);
    }
    *rate = (double)n * 1e9 / (double)(bench_ns() - t0);
    bench_sink(acc);
    return 0;
}

/* Allocate every block, then free them all in `perm` order (indices into
 * the allocation sequence). Rate in alloc+free pairs per second. */
static int kvh_bulk(kvh_engine *e, uint64_t n, const uint32_t *perm, kvh_block *hs, double *rate)
{
    uint64_t t0 = bench_ns();
    for (uint64_t i = 0; i < n; i++) {
        kvh_status st = kvh_block_alloc(e, 0, &hs[i]);
        if (st != KVH_OK)
            return bench_kvh_fail("kvh_block_alloc (bulk)", st);
    }
    for (uint64_t i = 0; i < n; i++) {
        kvh_status st = kvh_block_release(e, hs[perm[i]]);
        if (st != KVH_OK)
            return bench_kvh_fail("kvh_block_release (bulk)", st);
    }
    *rate = (double)n * 1e9 / (double)(bench_ns() - t0);
    return 0;
}

static int base_bulk(freelist *f, uint64_t n, const uint32_t *perm, uint32_t *idx, double *rate)
{
    uint64_t t0 = bench_ns();
    for (uint64_t i = 0; i < n; i++)
        if (freelist_alloc(f, &idx[i]) != 0)
            return 1;
    for (uint64_t i = 0; i < n; i++)
        freelist_free(f, idx[perm[i]]);
    *rate = (double)n * 1e9 / (double)(bench_ns() - t0);
    return 0;
}

static int part_alloc(const alloc_opts *o, const bench_ctx *ctx, int rounds)
{
    kvh_engine *e = NULL;
    BENCH_CHECK(open_small(o, o->blocks, &e));
    kvh_tier_info ti = {.struct_size = sizeof(ti)};
    BENCH_CHECK(kvh_tier_info_get(e, KVH_TIER_DEVICE, &ti));
    uint64_t n = ti.capacity_blocks;
    freelist fl;
    freelist_init(&fl, (uint32_t)n);
    double *ours = bench_xcalloc((size_t)rounds, sizeof(double)), *base = bench_xcalloc((size_t)rounds, sizeof(double));
    kvh_block *held = bench_xcalloc(n, sizeof(kvh_block));
    uint32_t *held_idx = bench_xcalloc(n, sizeof(uint32_t)), *perm = bench_xcalloc(n, sizeof(uint32_t));
    int rc = 0;
    bench_info(ctx, "alloc: %llu-block device tier, %llu pairs per round, %d rounds", (unsigned long long)n,
               (unsigned long long)o->pairs, rounds);

    /* Warm up both (page faults of metadata arrays, branch predictors). */
    if ((rc = kvh_pairs(e, o->pairs / 10 + 1, &ours[0])) || (rc = base_pairs(&fl, o->pairs / 10 + 1, &base[0])))
        goto out;

    /* Pairs, at occupancy 0 and 0.5 (half the blocks held elsewhere). */
    const double occs[2] = {0.0, 0.5};
    for (int oi = 0; oi < 2 && want_part(o, "pairs"); oi++) {
        uint64_t keep = (uint64_t)(occs[oi] * (double)n);
        for (uint64_t i = 0; i < keep; i++) {
            BENCH_CHECK(kvh_block_alloc(e, 0, &held[i]));
            if (freelist_alloc(&fl, &held_idx[i]) != 0) {
                rc = 1;
                goto out;
            }
        }
        for (int r = 0; r < rounds; r++) {
            if (r % 2 == 0) {
                if ((rc = kvh_pairs(e, o->pairs, &ours[r])) || (rc = base_pairs(&fl, o->pairs, &base[r])))
                    goto out;
            } else {
                if ((rc = base_pairs(&fl, o->pairs, &base[r])) || (rc = kvh_pairs(e, o->pairs, &ours[r])))
                    goto out;
            }
        }
        pair_params pp = {.blocks = n, .occupancy = occs[oi]};
        emit_rate(ctx, "alloc_free_pairs", ours, base, rounds, "pairs/s", pair_params_fn, &pp, 0.25);
        for (uint64_t i = 0; i < keep; i++) {
            BENCH_CHECK(kvh_block_release(e, held[i]));
            freelist_free(&fl, held_idx[i]);
        }
    }

    /* Allocate N, then free N (N = every block). */
    bench_rng rng;
    bench_rng_seed(&rng, ctx->seed);
    const char *orders[2] = {"fifo", "random"};
    for (int oi = 0; oi < 2 && want_part(o, "bulk"); oi++) {
        for (uint64_t i = 0; i < n; i++)
            perm[i] = (uint32_t)i;
        if (oi == 1)
            bench_shuffle_u32(&rng, perm, n);
        uint64_t inner = ctx->quick ? 2 : 8; /* bulk cycles per round */
        for (int r = 0; r < rounds; r++) {
            double a = 0, b = 0, x = 0;
            for (uint64_t k = 0; k < inner; k++) {
                if ((rc = kvh_bulk(e, n, perm, held, &x)))
                    goto out;
                a += x;
                if ((rc = base_bulk(&fl, n, perm, held_idx, &x)))
                    goto out;
                b += x;
            }
            ours[r] = a / (double)inner;
            base[r] = b / (double)inner;
        }
        pair_params pp = {.blocks = n, .order = orders[oi]};
        emit_rate(ctx, "alloc_n_then_free_n", ours, base, rounds, "pairs/s", pair_params_fn, &pp, 0.25);
    }
out:
    free(ours);
    free(base);
    free(held);
    free(held_idx);
    free(perm);
    freelist_destroy(&fl);
    kvh_engine_close(e);
    return rc;
}

/* ------------------------------------------------------------------ */
/* (b) fork                                                             */
/* ------------------------------------------------------------------ */

static int part_fork(const alloc_opts *o, const bench_ctx *ctx, int rounds)
{
    kvh_engine *e = NULL;
    BENCH_CHECK(open_small(o, o->fork_blocks + 16, &e));
    size_t nt = (size_t)(o->fork_blocks * o->block_tokens);
    int32_t *tok = bench_xmalloc(sizeof(int32_t) * nt);
    fill_tokens(tok, nt, 1);
    kvh_seq s;
    BENCH_CHECK(kvh_seq_create(e, 0, &s));
    BENCH_CHECK(kvh_seq_append(e, s, tok, nt));
    double *fork_us = bench_xcalloc((size_t)rounds, sizeof(double)),
           *free_us = bench_xcalloc((size_t)rounds, sizeof(double));
    bench_info(ctx, "fork: %llu-block sequence, %llu forks per round", (unsigned long long)o->fork_blocks,
               (unsigned long long)o->forks);
    for (int r = -1; r < rounds; r++) { /* round -1 warms up */
        uint64_t tf = 0, tr = 0;
        for (uint64_t i = 0; i < o->forks; i++) {
            kvh_seq c;
            uint64_t t0 = bench_ns();
            BENCH_CHECK(kvh_seq_fork(e, s, 1, &c));
            uint64_t t1 = bench_ns();
            BENCH_CHECK(kvh_seq_free(e, c));
            uint64_t t2 = bench_ns();
            tf += t1 - t0;
            tr += t2 - t1;
        }
        if (r >= 0) {
            fork_us[r] = (double)tf / 1e3 / (double)o->forks;
            free_us[r] = (double)tr / 1e3 / (double)o->forks;
        }
    }
    bench_row *row = bench_row_new(SCEN, "fork", bench_median(fork_us, (size_t)rounds), "us");
    bench_row_int(row, "seq_blocks", (int64_t)o->fork_blocks);
    bench_emit(ctx, row);
    row = bench_row_new(SCEN, "fork_child_free", bench_median(free_us, (size_t)rounds), "us");
    bench_row_int(row, "seq_blocks", (int64_t)o->fork_blocks);
    bench_emit(ctx, row);
    free(fork_us);
    free(free_us);
    free(tok);
    BENCH_CHECK(kvh_seq_free(e, s));
    kvh_engine_close(e);
    return 0;
}

/* ------------------------------------------------------------------ */
/* (c) prefix match and admission                                       */
/* ------------------------------------------------------------------ */

static int match_times(kvh_engine *e, const int32_t *tok, size_t n, uint64_t iters, double *match_us, double *free_us)
{
    for (uint64_t i = 0; i < iters; i++) {
        kvh_seq s;
        size_t m = 0;
        BENCH_CHECK(kvh_seq_create(e, 2, &s));
        uint64_t t0 = bench_ns();
        BENCH_CHECK(kvh_seq_match_prefix(e, s, tok, n, &m));
        uint64_t t1 = bench_ns();
        BENCH_CHECK(kvh_seq_free(e, s));
        uint64_t t2 = bench_ns();
        if (m != n) {
            fprintf(stderr, "kvh-bench alloc: match_prefix matched %zu of %zu cached tokens\n", m, n);
            return 1;
        }
        match_us[i] = (double)(t1 - t0) / 1e3;
        free_us[i] = (double)(t2 - t1) / 1e3;
    }
    return 0;
}

static int part_prefix(const alloc_opts *o, const bench_ctx *ctx)
{
    uint64_t bt = o->block_tokens;
    uint64_t admit_blocks = o->admit_tokens / bt, prompt_blocks = o->prompt_tokens / bt;
    uint64_t cached_blocks = admit_blocks > prompt_blocks ? admit_blocks : prompt_blocks;
    /* Room for the cached prompt and one cold admission. */
    kvh_engine *e = NULL;
    BENCH_CHECK(open_small(o, 2 * cached_blocks + 64, &e));
    size_t n = (size_t)(cached_blocks * bt);
    int32_t *tok = bench_xmalloc(sizeof(int32_t) * n), *cold = bench_xmalloc(sizeof(int32_t) * n);
    size_t row_elems = (size_t)n * o->head_dim;
    uint16_t *k = bench_xmalloc(row_elems * 2), *v = bench_xmalloc(row_elems * 2);
    fill_tokens(tok, n, 3);
    for (size_t i = 0; i < row_elems; i++) {
        k[i] = (uint16_t)(i * 3);
        v[i] = (uint16_t)(i * 5 + 1);
    }
    /* The cached prompt: appended and every KV cell written, so each full
     * block is published in the prefix index. */
    kvh_seq src;
    BENCH_CHECK(kvh_seq_create(e, 1, &src));
    BENCH_CHECK(kvh_seq_append(e, src, tok, n));
    BENCH_CHECK(kvh_seq_write_kv(e, src, 0, 0, n, k, v));
    kvh_block b0;
    BENCH_CHECK(kvh_seq_blocks(e, src, 0, 1, &b0));
    kvh_block_info bi = {.struct_size = sizeof(bi)};
    BENCH_CHECK(kvh_block_info_get(e, b0, &bi));
    if (!bi.published) {
        fprintf(stderr, "kvh-bench alloc: a fully written block is not published in the prefix index\n");
        return 1;
    }

    const struct {
        uint64_t tokens;
        uint64_t iters;
        double target_us;
    } cases[2] = {{prompt_blocks * bt, o->matches, 0}, {admit_blocks * bt, o->matches / 4 + 1, 2000.0}};
    for (int c = 0; c < 2; c++) {
        uint64_t it = cases[c].iters;
        double *mu = bench_xmalloc(sizeof(double) * it), *fu = bench_xmalloc(sizeof(double) * it);
        if (match_times(e, tok, (size_t)cases[c].tokens, it < 3 ? it : 3, mu, fu) != 0 || /* warm-up */
            match_times(e, tok, (size_t)cases[c].tokens, it, mu, fu) != 0)
            return 1;
        bench_row *row = bench_row_new(SCEN, "prefix_match", bench_median(mu, it), "us");
        bench_row_int(row, "context", (int64_t)cases[c].tokens);
        bench_row_int(row, "block_tokens", (int64_t)bt);
        if (cases[c].target_us > 0)
            bench_row_target(row, 0, 0, cases[c].target_us);
        bench_emit(ctx, row);
        row = bench_row_new(SCEN, "prefix_matched_seq_free", bench_median(fu, it), "us");
        bench_row_int(row, "context", (int64_t)cases[c].tokens);
        bench_row_int(row, "block_tokens", (int64_t)bt);
        bench_emit(ctx, row);
        free(mu);
        free(fu);
    }

    /* What hashing alone costs: the chain of block hashes of the admit
     * prompt through the public kvh_prefix_hash (one call per block). */
    {
        uint64_t it = o->matches / 4 + 1;
        double *hu = bench_xmalloc(sizeof(double) * it);
        for (uint64_t i = 0; i < it; i++) {
            uint64_t t0 = bench_ns(), parent = 0;
            for (uint64_t b = 0; b < admit_blocks; b++)
                BENCH_CHECK(kvh_prefix_hash(e, parent, tok + b * bt, (size_t)bt, &parent));
            hu[i] = (double)(bench_ns() - t0) / 1e3;
            bench_sink(parent);
        }
        bench_row *row = bench_row_new(SCEN, "prefix_hash_chain", bench_median(hu, it), "us");
        bench_row_int(row, "context", (int64_t)(admit_blocks * bt));
        bench_row_int(row, "block_tokens", (int64_t)bt);
        bench_row_note(row, "kvh_prefix_hash per block, chained: the hashing floor of a match");
        bench_emit(ctx, row);
        free(hu);
    }

    /* Cold admission: a new prompt of admit_tokens appended to a fresh
     * sequence (block allocation + hashing; no KV). */
    {
        uint64_t it = ctx->quick ? 5 : 30;
        double *au = bench_xmalloc(sizeof(double) * it), *fu = bench_xmalloc(sizeof(double) * it);
        size_t na = (size_t)(admit_blocks * bt);
        for (uint64_t i = 0; i < it; i++) {
            fill_tokens(cold, na, (uint32_t)(100 + i));
            kvh_seq s;
            size_t m = 0;
            BENCH_CHECK(kvh_seq_create(e, 3, &s));
            uint64_t t0 = bench_ns();
            BENCH_CHECK(kvh_seq_match_prefix(e, s, cold, na, &m)); /* a miss */
            BENCH_CHECK(kvh_seq_append(e, s, cold + m, na - m));
            uint64_t t1 = bench_ns();
            BENCH_CHECK(kvh_seq_free(e, s));
            au[i] = (double)(t1 - t0) / 1e3;
            fu[i] = (double)(bench_ns() - t1) / 1e3;
        }
        bench_row *row = bench_row_new(SCEN, "prefix_admit_cold", bench_median(au, it), "us");
        bench_row_int(row, "context", (int64_t)na);
        bench_row_int(row, "block_tokens", (int64_t)bt);
        bench_row_target(row, 0, 0, 2000.0);
        bench_row_note(row, "match_prefix (miss) + kvh_seq_append of new tokens: allocation + hashing");
        bench_emit(ctx, row);
        row = bench_row_new(SCEN, "prefix_admit_cold_seq_free", bench_median(fu, it), "us");
        bench_row_int(row, "context", (int64_t)na);
        bench_row_int(row, "block_tokens", (int64_t)bt);
        bench_emit(ctx, row);
        free(au);
        free(fu);
    }
    BENCH_CHECK(kvh_seq_free(e, src));
    free(tok);
    free(cold);
    free(k);
    free(v);
    kvh_engine_close(e);
    return 0;
}

/* ------------------------------------------------------------------ */
/* (d) LRU-K touches                                                    */
/* ------------------------------------------------------------------ */

static int part_touch(const alloc_opts *o, const bench_ctx *ctx, int rounds)
{
    for (size_t ti = 0; ti < o->touch_blocks.n; ti++) {
        uint64_t nb = o->touch_blocks.v[ti];
        kvh_engine *e = NULL;
        BENCH_CHECK(open_small(o, nb, &e));
        size_t n = (size_t)(nb * o->block_tokens);
        int32_t *tok = bench_xmalloc(sizeof(int32_t) * n);
        size_t elems = n * o->head_dim;
        uint16_t *k = bench_xcalloc(elems, 2), *v = bench_xcalloc(elems, 2);
        fill_tokens(tok, n, 9);
        kvh_seq s;
        BENCH_CHECK(kvh_seq_create(e, 0, &s));
        BENCH_CHECK(kvh_seq_append(e, s, tok, n));
        BENCH_CHECK(kvh_seq_write_kv(e, s, 0, 0, n, k, v));
        free(k);
        free(v);
        free(tok);

        enum { NPOS = 1 << 16 };
        uint64_t *pos = bench_xmalloc(sizeof(uint64_t) * NPOS);
        bench_rng rng;
        bench_rng_seed(&rng, ctx->seed + nb);
        for (size_t i = 0; i < NPOS; i++)
            pos[i] = bench_rng_below(&rng, n);
        uint16_t kk[1024], vv[1024];
        double *rd = bench_xcalloc((size_t)rounds, sizeof(double)), *aq = bench_xcalloc((size_t)rounds, sizeof(double));
        for (int r = -1; r < rounds; r++) {
            uint64_t t0 = bench_ns();
            for (uint64_t i = 0; i < o->touches; i++)
                BENCH_CHECK(kvh_seq_read_kv(e, s, 0, pos[i & (NPOS - 1)], 1, kk, vv));
            uint64_t t1 = bench_ns();
            uint64_t na = o->touches / 4 + 1;
            for (uint64_t i = 0; i < na; i++) {
                uint64_t p = pos[i & (NPOS - 1)];
                BENCH_CHECK(kvh_seq_acquire(e, s, p, 1, NULL));
                BENCH_CHECK(kvh_seq_release(e, s, p, 1));
            }
            uint64_t t2 = bench_ns();
            if (r >= 0) {
                rd[r] = (double)o->touches * 1e9 / (double)(t1 - t0);
                aq[r] = (double)na * 1e9 / (double)(t2 - t1);
            }
        }
        bench_row *row = bench_row_new(SCEN, "lruk_touch_read_kv", bench_median(rd, (size_t)rounds), "touches/s");
        bench_row_int(row, "blocks", (int64_t)nb);
        bench_row_note(row, "kvh_seq_read_kv of 1 token at a random position: one access = LRU-K update");
        bench_emit(ctx, row);
        row = bench_row_new(SCEN, "lruk_acquire_release", bench_median(aq, (size_t)rounds), "pairs/s");
        bench_row_int(row, "blocks", (int64_t)nb);
        bench_row_note(row, "kvh_seq_acquire(1 token, wait) + kvh_seq_release: hold/unhold + fence");
        bench_emit(ctx, row);
        free(rd);
        free(aq);
        free(pos);
        BENCH_CHECK(kvh_seq_free(e, s));
        kvh_engine_close(e);
    }
    return 0;
}

/* ------------------------------------------------------------------ */

static const char usage_text[] = "Metadata costs of the block manager (CPU backend, migration_threads 0,\n"
                                 "geometry 1 layer x 1 head x --head-dim x --block-tokens, f16):\n"
                                 "  alloc_free_pairs      kvh_block_alloc + kvh_block_release per second vs a\n"
                                 "                        pthread-mutex free list of uint32 indices (target\n"
                                 "                        ratio >= 0.25), at occupancy 0 and 0.5\n"
                                 "  alloc_n_then_free_n   allocate every block, then free all (fifo / random)\n"
                                 "  fork                  kvh_seq_fork of a --fork-blocks sequence, us\n"
                                 "  prefix_match          kvh_seq_match_prefix of a cached prompt on a fresh\n"
                                 "                        sequence, us (target < 2000 us at --admit-tokens)\n"
                                 "  prefix_hash_chain     hashing floor of that prompt (kvh_prefix_hash)\n"
                                 "  prefix_admit_cold     match miss + kvh_seq_append of a new prompt, us\n"
                                 "                        (target < 2000 us at --admit-tokens)\n"
                                 "  lruk_touch_read_kv    kvh_seq_read_kv of 1 random token per second\n"
                                 "  lruk_acquire_release  kvh_seq_acquire + kvh_seq_release of 1 token per second\n";

int bench_alloc(int argc, char **argv, const bench_ctx *ctx)
{
    alloc_opts o = {
        .blocks = 65536,
        .pairs = ctx->quick ? 200000 : 2000000,
        .fork_blocks = 1000,
        .forks = ctx->quick ? 500 : 5000,
        .prompt_tokens = 32768,
        .admit_tokens = 131072,
        .matches = ctx->quick ? 40 : 400,
        .touches = ctx->quick ? 100000 : 1000000,
        .head_dim = 8,
        .block_tokens = 16,
        .touch_blocks = {.n = 2, .v = {4096, 65536}},
        .parts = "all",
    };
    const bench_opt opts[] = {
        {"--blocks", BENCH_OPT_U64, &o.blocks, "device-tier blocks for the alloc part"},
        {"--pairs", BENCH_OPT_U64, &o.pairs, "alloc+free pairs per round"},
        {"--fork-blocks", BENCH_OPT_U64, &o.fork_blocks, "blocks of the forked sequence"},
        {"--forks", BENCH_OPT_U64, &o.forks, "forks per round"},
        {"--prompt-tokens", BENCH_OPT_U64, &o.prompt_tokens, "tokens of the matched prompt"},
        {"--admit-tokens", BENCH_OPT_U64, &o.admit_tokens, "tokens of the admitted prefix (2 ms target)"},
        {"--matches", BENCH_OPT_U64, &o.matches, "prefix matches timed"},
        {"--touches", BENCH_OPT_U64, &o.touches, "read_kv touches per round"},
        {"--touch-blocks", BENCH_OPT_LIST, &o.touch_blocks, "sequence sizes (blocks) for the touch part"},
        {"--head-dim", BENCH_OPT_U64, &o.head_dim, "head_dim of the geometry (1..8 keeps memory out)"},
        {"--block-tokens", BENCH_OPT_U64, &o.block_tokens, "block_tokens of the geometry (a power of two, 1..256)"},
        {"--parts", BENCH_OPT_STR, &o.parts, "comma-separated subset of pairs,bulk,fork,prefix,touch"},
        {NULL, BENCH_OPT_U64, NULL, NULL},
    };
    int prc = bench_parse(argc, argv, opts, SCEN, usage_text);
    if (prc)
        return bench_parse_rc(prc);
    /* Upper bounds: block handles index at most 2^31 blocks, and a count
     * past them would only end in an allocation failure naming bytes. */
    if (bench_check_u64(SCEN, "--blocks", o.blocks, 2, 1ull << 31) ||
        bench_check_u64(SCEN, "--fork-blocks", o.fork_blocks, 1, 1ull << 31) ||
        bench_check_u64(SCEN, "--head-dim", o.head_dim, 1, 512) ||
        bench_check_u64(SCEN, "--block-tokens", o.block_tokens, 1, 256) ||
        bench_check_u64(SCEN, "--pairs", o.pairs, 1, UINT64_MAX) ||
        bench_check_u64(SCEN, "--forks", o.forks, 1, UINT64_MAX) ||
        bench_check_u64(SCEN, "--touches", o.touches, 1, UINT64_MAX))
        return 2;
    if ((o.block_tokens & (o.block_tokens - 1)) != 0) { /* kvh_config.block_tokens: a power of two */
        fprintf(stderr, "kvh-bench alloc: --block-tokens must be a power of two, got %llu\n",
                (unsigned long long)o.block_tokens);
        return 2;
    }
    /* The touch part's sequences take --blocks' bound and the prompts as
     * many tokens: far beyond them, tokens x 4 bytes, blocks x block bytes
     * and --matches x 8 bytes of timings wrap to small allocations. */
    if (bench_check_list(SCEN, "--touch-blocks", &o.touch_blocks, 1, 1ull << 31, 0) ||
        bench_check_u64(SCEN, "--prompt-tokens", o.prompt_tokens, o.block_tokens, 1ull << 31) ||
        bench_check_u64(SCEN, "--admit-tokens", o.admit_tokens, o.block_tokens, 1ull << 31) ||
        bench_check_u64(SCEN, "--matches", o.matches, 1, UINT32_MAX))
        return 2;
    int rounds = ctx->reps ? ctx->reps : (ctx->quick ? 3 : 7);
    static const char *known[] = {"pairs", "bulk", "fork", "prefix", "touch"};
    if (strcmp(o.parts, "all")) {
        char buf[128];
        snprintf(buf, sizeof(buf), "%s", o.parts);
        int named = 0;
        for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save), named++) {
            size_t k = 0;
            while (k < 5 && strcmp(t, known[k]))
                k++;
            if (k == 5) {
                fprintf(stderr, "kvh-bench alloc: unknown part '%s' in --parts (pairs,bulk,fork,prefix,touch)\n", t);
                return 2;
            }
        }
        if (!named) {
            fprintf(stderr, "kvh-bench alloc: --parts names no part (pairs,bulk,fork,prefix,touch)\n");
            return 2;
        }
    }
    int rc = 0;
    if (want_part(&o, "pairs") || want_part(&o, "bulk"))
        rc = part_alloc(&o, ctx, rounds);
    if (!rc && want_part(&o, "fork"))
        rc = part_fork(&o, ctx, rounds);
    if (!rc && want_part(&o, "prefix"))
        rc = part_prefix(&o, ctx);
    if (!rc && want_part(&o, "touch"))
        rc = part_touch(&o, ctx, rounds);
    return rc;
}
