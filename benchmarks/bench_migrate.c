/* Scenario `migrate`: device <-> host block copy throughput (with
 * kvh_config.copy_moves, so the CPU backend copies as a discrete GPU must;
 * without it the two tiers share one arena and moves copy nothing).
 *
 * For each block size (--sizes; geometry chosen so that block_bytes is
 * exactly that size with f16) and each worker count (--threads), an engine
 * with the CPU backend and --pool-mb of device and of host tier (default
 * 512 MiB each, which keeps the default run under a minute here even when
 * the VM's first touch of fresh memory runs at ~0.3 GB/s; RESULTS.md uses
 * --pool-mb 1024) is filled
 * with standalone blocks (kvh_block_alloc), and all of them move
 *   d2h: device -> host, then h2d: host -> device
 * with kvh_migrate (every handle in one call, or --batch per call; the
 * fences are waited on), then the same with kvh_seq_migrate of a sequence
 * that spans the whole tier. Handles are shuffled before every pass, so
 * both the source and the destination slots are in random order (the
 * destination slots come from free lists that earlier shuffled passes
 * filled in random order).
 *
 * Baseline: plain memcpy of the same bytes between the same (source slot,
 * destination slot) pairs, in the same order, between two plain malloc'd
 * buffers of the pool size, right after each of our passes. Everything is
 * pre-faulted first (tier memory through kvh_tier_info.base, the baseline
 * buffers with memset, then one shuffled round trip of every block), since
 * first-touch page faults in this VM run at ~0.3-2 GB/s.
 *
 * After the passes the first 8 bytes of every block are checked against a
 * tag written at the start, so a wrong copy fails the run (exit 1). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_scenarios.h"

#define SCEN "migrate"

typedef struct migrate_opts {
    bench_list sizes, threads;
    uint64_t pool_mb, batch;
} migrate_opts;

typedef struct geometry {
    uint32_t layers, heads, tokens, dim;
} geometry;

/* block_bytes = 2 (K,V) * layers * heads * tokens * dim * 2 (f16). */
static int pick_geometry(uint64_t bytes, geometry *g)
{
    static const struct {
        uint64_t bytes;
        geometry g;
    } table[] = {
        {64 << 10, {4, 4, 16, 64}},   /* 64 KiB  */
        {256 << 10, {16, 4, 16, 64}}, /* 256 KiB */
        {1 << 20, {32, 8, 16, 64}},   /* 1 MiB: 32 layers, 8 KV heads */
    };
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++)
        if (table[i].bytes == bytes) {
            *g = table[i].g;
            return 0;
        }
    /* Otherwise 16 tokens x 64 dims x 1 head and as many layers as needed. */
    if (bytes % 4096 || bytes / 4096 < 1 || bytes / 4096 > 4096)
        return -1;
    *g = (geometry){(uint32_t)(bytes / 4096), 1, 16, 64};
    return 0;
}

typedef struct mctx {
    kvh_engine *e;
    uint64_t bb;      /* block bytes */
    uint64_t n;       /* blocks moved per pass */
    uint8_t *base[2]; /* device, host tier memory */
    uint8_t *buf[2];  /* baseline buffers standing in for device, host */
    kvh_block *h;
    uint32_t *src, *dst; /* slots of the last pass */
    uint64_t batch;
    kvh_fence *fences;
} mctx;

static int slots_of(mctx *m, uint32_t *out, uint32_t want_tier)
{
    for (uint64_t i = 0; i < m->n; i++) {
        kvh_block_info bi = {.struct_size = sizeof(bi)};
        BENCH_CHECK(kvh_block_info_get(m->e, m->h[i], &bi));
        if (bi.tier != want_tier) {
            fprintf(stderr, "kvh-bench migrate: block %llu is in tier %u, expected %u\n", (unsigned long long)i,
                    bi.tier, want_tier);
            return 1;
        }
        out[i] = bi.slot;
    }
    return 0;
}

/* One kvh_migrate pass of every handle to `tier`; seconds. */
static int pass_migrate(mctx *m, uint32_t tier, double *sec)
{
    uint64_t batch = m->batch ? m->batch : m->n;
    uint64_t nf = 0;
    uint64_t t0 = bench_ns();
    for (uint64_t i = 0; i < m->n; i += batch) {
        uint64_t k = m->n - i < batch ? m->n - i : batch;
        BENCH_CHECK(kvh_migrate(m->e, m->h + i, (size_t)k, tier, &m->fences[nf++]));
    }
    for (uint64_t f = 0; f < nf; f++) {
        BENCH_CHECK(kvh_fence_wait(m->e, m->fences[f], UINT64_MAX));
        BENCH_CHECK(kvh_fence_free(m->e, m->fences[f]));
    }
    *sec = (double)(bench_ns() - t0) * 1e-9;
    return 0;
}

static int pass_seq_migrate(mctx *m, kvh_seq s, uint64_t tokens, uint32_t tier, double *sec)
{
    kvh_fence f;
    uint64_t t0 = bench_ns();
    BENCH_CHECK(kvh_seq_migrate(m->e, s, 0, tokens, tier, &f));
    BENCH_CHECK(kvh_fence_wait(m->e, f, UINT64_MAX));
    *sec = (double)(bench_ns() - t0) * 1e-9;
    BENCH_CHECK(kvh_fence_free(m->e, f));
    return 0;
}

/* memcpy of the same slot pairs between the plain buffers; seconds. */
static double pass_baseline(mctx *m, uint32_t from_tier)
{
    const uint8_t *src = m->buf[from_tier];
    uint8_t *dst = m->buf[!from_tier];
    uint64_t bb = m->bb, t0 = bench_ns();
    for (uint64_t i = 0; i < m->n; i++)
        memcpy(dst + (uint64_t)m->dst[i] * bb, src + (uint64_t)m->src[i] * bb, bb);
    return (double)(bench_ns() - t0) * 1e-9;
}

static void write_tags(mctx *m, const uint32_t *slots, uint32_t tier, uint64_t salt)
{
    for (uint64_t i = 0; i < m->n; i++) {
        uint64_t tag = salt ^ (i * 0x9e3779b97f4a7c15ull);
        memcpy(m->base[tier] + (uint64_t)slots[i] * m->bb, &tag, sizeof(tag));
    }
}

static int check_tags(mctx *m, const uint32_t *slots, uint32_t tier, uint64_t salt)
{
    for (uint64_t i = 0; i < m->n; i++) {
        uint64_t tag = salt ^ (i * 0x9e3779b97f4a7c15ull), got;
        memcpy(&got, m->base[tier] + (uint64_t)slots[i] * m->bb, sizeof(got));
        if (got != tag) {
            fprintf(stderr, "kvh-bench migrate: block %llu lost its data after migration\n", (unsigned long long)i);
            return 1;
        }
    }
    return 0;
}

static void emit(const bench_ctx *ctx, const char *api, const char *dir, uint64_t bb, uint64_t threads,
                 uint64_t per_call, double *ours, double *base, int reps)
{
    double ratio[64];
    for (int r = 0; r < reps; r++)
        ratio[r] = ours[r] / base[r];
    bench_row *row = bench_row_new(SCEN, "throughput", bench_median(ours, (size_t)reps), "GB/s");
    bench_row_str(row, "api", api);
    bench_row_str(row, "direction", dir);
    bench_row_int(row, "block_bytes", (int64_t)bb);
    bench_row_int(row, "threads", (int64_t)threads);
    bench_row_int(row, "blocks_per_call", (int64_t)per_call);
    bench_row_baseline(row, bench_median(base, (size_t)reps), bench_median(ratio, (size_t)reps));
    bench_row_target(row, 1, 1, 0.9);
    bench_emit(ctx, row);
}

static int run_one(const migrate_opts *o, const bench_ctx *ctx, uint64_t bb, uint32_t threads, uint8_t **bufs,
                   uint64_t pool, int reps, uint64_t seed)
{
    geometry g;
    pick_geometry(bb, &g); /* bench_migrate checked every size */
    kvh_config c;
    BENCH_CHECK(kvh_config_init(&c, sizeof(c)));
    c.backend = KVH_BACKEND_CPU;
    c.num_layers = g.layers;
    c.num_kv_heads = g.heads;
    c.block_tokens = g.tokens;
    c.head_dim = g.dim;
    c.dtype = KVH_DTYPE_F16;
    c.device_bytes = pool;
    c.host_bytes = pool;
    c.migration_threads = threads;
    /* Measure the copy path (a discrete GPU's): by default the CPU
     * backend's tiers are one arena and these moves copy nothing. */
    c.copy_moves = 1;
    mctx m = {.bb = bb, .buf = {bufs[0], bufs[1]}, .batch = o->batch};
    BENCH_CHECK(kvh_engine_open(&c, &m.e));
    uint64_t got_bb = 0;
    BENCH_CHECK(kvh_engine_block_bytes(m.e, &got_bb));
    if (got_bb != bb) {
        fprintf(stderr, "kvh-bench migrate: geometry gives %llu bytes, wanted %llu\n", (unsigned long long)got_bb,
                (unsigned long long)bb);
        return 1;
    }
    kvh_tier_info ti[2] = {{.struct_size = sizeof(kvh_tier_info)}, {.struct_size = sizeof(kvh_tier_info)}};
    BENCH_CHECK(kvh_tier_info_get(m.e, KVH_TIER_DEVICE, &ti[0]));
    BENCH_CHECK(kvh_tier_info_get(m.e, KVH_TIER_HOST, &ti[1]));
    m.n = ti[0].capacity_blocks < ti[1].capacity_blocks ? ti[0].capacity_blocks : ti[1].capacity_blocks;
    if (m.n < 2) {
        fprintf(stderr, "kvh-bench migrate: --pool-mb too small for %llu-byte blocks\n", (unsigned long long)bb);
        return 2;
    }
    /* Pre-fault both tiers (CPU backend: tier memory is ordinary memory). */
    uint64_t t0 = bench_ns();
    for (int t = 0; t < 2; t++) {
        m.base[t] = ti[t].base;
        memset(m.base[t], 0x5a + t, ti[t].capacity_blocks * bb);
    }
    bench_info(ctx,
               "migrate: %llu-byte blocks (%u layers x %u heads x %u tokens x %u dims), %llu blocks per tier, "
               "%u worker(s); pre-fault %.2f s",
               (unsigned long long)bb, g.layers, g.heads, g.tokens, g.dim, (unsigned long long)m.n, threads,
               (double)(bench_ns() - t0) * 1e-9);

    m.h = bench_xcalloc(m.n, sizeof(kvh_block));
    m.src = bench_xcalloc(m.n, sizeof(uint32_t));
    m.dst = bench_xcalloc(m.n, sizeof(uint32_t));
    uint64_t batch = o->batch ? o->batch : m.n;
    m.fences = bench_xcalloc(m.n / batch + 2, sizeof(kvh_fence));
    double *ours = bench_xcalloc((size_t)reps * 2, sizeof(double)),
           *base = bench_xcalloc((size_t)reps * 2, sizeof(double));
    bench_rng rng;
    bench_rng_seed(&rng, seed);
    int rc = 0;

    /* ---- kvh_migrate of standalone blocks ---- */
    for (uint64_t i = 0; i < m.n; i++)
        BENCH_CHECK(kvh_block_alloc(m.e, 0, &m.h[i]));
    if ((rc = slots_of(&m, m.src, KVH_TIER_DEVICE)))
        return rc;
    write_tags(&m, m.src, KVH_TIER_DEVICE, seed);
    /* Tags follow the handle, so keep a permutation instead of shuffling
     * the handles themselves. */
    uint64_t *perm = bench_xmalloc(sizeof(uint64_t) * m.n);
    kvh_block *orig = bench_xmalloc(sizeof(kvh_block) * m.n);
    memcpy(orig, m.h, sizeof(kvh_block) * m.n);
    for (uint64_t i = 0; i < m.n; i++)
        perm[i] = i;
    /* Warm-up: a shuffled round trip, which also randomises free lists. */
    for (int r = -1; r < reps; r++)
        for (uint32_t dir = 0; dir < 2; dir++) { /* 0: d2h, 1: h2d */
            uint32_t from = dir, to = !dir;
            bench_shuffle_u64(&rng, perm, m.n);
            for (uint64_t i = 0; i < m.n; i++)
                m.h[i] = orig[perm[i]];
            if ((rc = slots_of(&m, m.src, from)))
                return rc;
            double s = 0;
            if ((rc = pass_migrate(&m, to, &s)))
                return rc;
            if ((rc = slots_of(&m, m.dst, to)))
                return rc;
            if (r >= 0) { /* the warm-up round (r == -1) needs no baseline */
                double sb = pass_baseline(&m, from);
                ours[dir * reps + r] = (double)(m.n * bb) / s * 1e-9;
                base[dir * reps + r] = (double)(m.n * bb) / sb * 1e-9;
            }
        }
    emit(ctx, "kvh_migrate", "d2h", bb, threads, batch, ours, base, reps);
    emit(ctx, "kvh_migrate", "h2d", bb, threads, batch, ours + reps, base + reps, reps);
    /* Verify: every block (in handle order) carries its tag. */
    memcpy(m.h, orig, sizeof(kvh_block) * m.n);
    if ((rc = slots_of(&m, m.src, KVH_TIER_DEVICE)) || (rc = check_tags(&m, m.src, KVH_TIER_DEVICE, seed)))
        return rc;
    /* Release in random order: the device free list becomes random. */
    bench_shuffle_u64(&rng, perm, m.n);
    for (uint64_t i = 0; i < m.n; i++)
        BENCH_CHECK(kvh_block_release(m.e, orig[perm[i]]));

    /* ---- kvh_seq_migrate of a sequence spanning the tier ---- */
    uint64_t ntok = m.n * g.tokens;
    int32_t *tok = bench_xmalloc(sizeof(int32_t) * ntok);
    for (uint64_t i = 0; i < ntok; i++)
        tok[i] = (int32_t)(i & 0x7fffffff);
    kvh_seq s;
    BENCH_CHECK(kvh_seq_create(m.e, 0, &s));
    BENCH_CHECK(kvh_seq_append(m.e, s, tok, ntok));
    free(tok);
    BENCH_CHECK(kvh_seq_blocks(m.e, s, 0, m.n, m.h));
    if ((rc = slots_of(&m, m.src, KVH_TIER_DEVICE)))
        return rc;
    write_tags(&m, m.src, KVH_TIER_DEVICE, seed + 1);
    /* No warm-up round here: the memory is warm and the sequence's slots
     * came from the shuffled free lists of the passes above. */
    for (int r = 0; r < reps; r++)
        for (uint32_t dir = 0; dir < 2; dir++) {
            uint32_t from = dir, to = !dir;
            if ((rc = slots_of(&m, m.src, from)))
                return rc;
            double sec = 0;
            if ((rc = pass_seq_migrate(&m, s, ntok, to, &sec)))
                return rc;
            if ((rc = slots_of(&m, m.dst, to)))
                return rc;
            double sb = pass_baseline(&m, from);
            ours[dir * reps + r] = (double)(m.n * bb) / sec * 1e-9;
            base[dir * reps + r] = (double)(m.n * bb) / sb * 1e-9;
        }
    emit(ctx, "kvh_seq_migrate", "d2h", bb, threads, m.n, ours, base, reps);
    emit(ctx, "kvh_seq_migrate", "h2d", bb, threads, m.n, ours + reps, base + reps, reps);
    if ((rc = slots_of(&m, m.src, KVH_TIER_DEVICE)) || (rc = check_tags(&m, m.src, KVH_TIER_DEVICE, seed + 1)))
        return rc;
    BENCH_CHECK(kvh_seq_free(m.e, s));
    BENCH_CHECK(kvh_engine_close(m.e));
    free(perm);
    free(orig);
    free(m.h);
    free(m.src);
    free(m.dst);
    free(m.fences);
    free(ours);
    free(base);
    return 0;
}

static const char usage_text[] = "Device<->host block copy throughput of the CPU backend, in GB/s (1e9 B/s),\n"
                                 "for kvh_migrate (all handles in one call unless --batch) and kvh_seq_migrate,\n"
                                 "both directions, per block size and migration_threads; baseline = plain\n"
                                 "memcpy of the same random slot pairs between two plain buffers, run right\n"
                                 "after each pass (target ratio >= 0.9). Sizes must be multiples of 4096\n"
                                 "(64K, 256K and 1M use 4x4x16x64, 16x4x16x64 and 32x8x16x64 layers x heads\n"
                                 "x tokens x dims). Memory: about 4x --pool-mb.\n";

int bench_migrate(int argc, char **argv, const bench_ctx *ctx)
{
    migrate_opts o = {
        .sizes = {.n = 3, .v = {64 << 10, 256 << 10, 1 << 20}},
        .threads = {.n = 2, .v = {1, 2}},
        .pool_mb = ctx->quick ? 64 : 512,
        .batch = 0,
    };
    const bench_opt opts[] = {
        {"--sizes", BENCH_OPT_LIST, &o.sizes, "block sizes in bytes (K/M suffixes)"},
        {"--threads", BENCH_OPT_LIST, &o.threads, "migration_threads values (0 = copies in the caller)"},
        {"--pool-mb", BENCH_OPT_U64, &o.pool_mb, "MiB of device tier and of host tier"},
        {"--batch", BENCH_OPT_U64, &o.batch, "handles per kvh_migrate call (0 = all in one call)"},
        {NULL, BENCH_OPT_U64, NULL, NULL},
    };
    int prc = bench_parse(argc, argv, opts, SCEN, usage_text);
    if (prc)
        return bench_parse_rc(prc);
    /* The bound keeps pool_mb << 20 within 64 bits (16 TiB is beyond any machine). */
    if (o.pool_mb < 1 || o.pool_mb > (1u << 24)) {
        fprintf(stderr, "kvh-bench migrate: --pool-mb must be in 1..%u\n", 1u << 24);
        return 2;
    }
    for (size_t i = 0; i < o.threads.n; i++)
        if (o.threads.v[i] > 64) {
            fprintf(stderr, "kvh-bench migrate: --threads values must be <= 64\n");
            return 2;
        }
    int reps = ctx->reps ? ctx->reps : 3;
    if (reps > 64)
        reps = 64;
    uint64_t pool = o.pool_mb << 20;
    /* Every size before the first run: a bad one must not come after rows. */
    for (size_t i = 0; i < o.sizes.n; i++) {
        geometry g;
        if (pick_geometry(o.sizes.v[i], &g) != 0) {
            fprintf(stderr, "kvh-bench migrate: --sizes values must be multiples of 4096 in 4096..16777216, got %llu\n",
                    (unsigned long long)o.sizes.v[i]);
            return 2;
        }
        if (pool / o.sizes.v[i] < 2) {
            fprintf(stderr, "kvh-bench migrate: --pool-mb %llu holds fewer than two blocks of --sizes %llu\n",
                    (unsigned long long)o.pool_mb, (unsigned long long)o.sizes.v[i]);
            return 2;
        }
    }
    /* Baseline buffers: plain malloc, pre-faulted once. */
    uint8_t *bufs[2] = {malloc(pool), malloc(pool)};
    if (!bufs[0] || !bufs[1]) {
        fprintf(stderr, "kvh-bench migrate: out of memory for two %llu MiB buffers\n", (unsigned long long)o.pool_mb);
        return 1;
    }
    uint64_t t0 = bench_ns();
    memset(bufs[0], 1, pool);
    memset(bufs[1], 2, pool);
    bench_info(ctx, "migrate: baseline buffers 2 x %llu MiB pre-faulted in %.2f s", (unsigned long long)o.pool_mb,
               (double)(bench_ns() - t0) * 1e-9);
    int rc = 0;
    for (size_t si = 0; si < o.sizes.n && !rc; si++)
        for (size_t ti = 0; ti < o.threads.n && !rc; ti++)
            rc = run_one(&o, ctx, o.sizes.v[si], (uint32_t)o.threads.v[ti], bufs, pool, reps,
                         ctx->seed * 1000 + si * 10 + ti);
    free(bufs[0]);
    free(bufs[1]);
    return rc;
}
