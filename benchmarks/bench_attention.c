/* Scenario `attention`: CPU paged decode attention, paged vs contiguous,
 * against the machine's memory read bandwidth.
 *
 * Geometry (defaults, Llama-3-8B-like layer): 8 KV heads, 32 query heads,
 * head_dim 128, f16 KV, f32 q/out, one layer. For each --block size and
 * each --contexts length C, a batch of B = max(1, --total-tokens / C)
 * sequences of C tokens (so every call reads about the same number of
 * bytes, well beyond the caches: --total-tokens 128K is 512 MiB of K+V)
 * is decoded with kvh_attention_decode (the engine's thread pool, all
 * CPUs unless --threads), and timed; GB/s = K+V bytes read / time.
 *
 * Baselines, measured in the same run:
 *   contiguous: the same kernel (same SIMD variant, threads and split-K)
 *     over one contiguous [K,V][head][token][dim] array per sequence, what
 *     attention reads without paging; target paged/contiguous >= 0.9 at
 *     block 16.
 *   read bandwidth: every thread summing its share of a --bw-mb buffer
 *     (64-byte vector loads); the roofline. Target >= 0.6 at 32K context.
 *
 * The contiguous baseline runs the kernels through internal entry points
 * (kernels/), since no public call takes a contiguous array. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_scenarios.h"

/* internal headers, by relative path: the bench's include path has only
 * the public header directory */
#include "../kernels/cpu/attn_cpu.h"

#define SCEN "attention"

int bench_attention(int argc, char **argv, const bench_ctx *ctx);

typedef struct attn_opts {
    bench_list contexts, blocks;
    uint64_t total_tokens, kv_heads, q_heads, dim, threads, bw_mb;
} attn_opts;

/* ---- memory read bandwidth ---- */

typedef uint64_t v8u64 __attribute__((vector_size(64)));

typedef struct bw_arg {
    const uint8_t *p;
    size_t bytes;
    uint64_t sum;
    pthread_barrier_t *bar;
    double sec;
} bw_arg;

static void *bw_main(void *varg)
{
    bw_arg *a = varg;
    pthread_barrier_wait(a->bar);
    uint64_t t0 = bench_ns();
    v8u64 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    const v8u64 *v = (const v8u64 *)a->p;
    for (size_t i = 0; i + 4 <= a->bytes / 64; i += 4) {
        s0 += v[i];
        s1 += v[i + 1];
        s2 += v[i + 2];
        s3 += v[i + 3];
    }
    s0 += s1 + s2 + s3;
    uint64_t s = 0;
    for (int i = 0; i < 8; i++)
        s += s0[i];
    a->sum = s;
    a->sec = (double)(bench_ns() - t0) * 1e-9;
    return NULL;
}

/* GB/s of `threads` threads reading disjoint slices of buf at once. */
static double read_bandwidth(const uint8_t *buf, size_t bytes, uint32_t threads)
{
    pthread_t th[256];
    bw_arg a[256];
    pthread_barrier_t bar;
    if (threads > 256)
        threads = 256;
    pthread_barrier_init(&bar, NULL, threads);
    size_t slice = bytes / threads / 256 * 256;
    for (uint32_t t = 0; t < threads; t++) {
        a[t] = (bw_arg){.p = buf + t * slice, .bytes = slice, .bar = &bar};
        pthread_create(&th[t], NULL, bw_main, &a[t]);
    }
    double worst = 0;
    uint64_t sink = 0;
    for (uint32_t t = 0; t < threads; t++) {
        pthread_join(th[t], NULL);
        worst = a[t].sec > worst ? a[t].sec : worst;
        sink += a[t].sum;
    }
    bench_sink(sink);
    pthread_barrier_destroy(&bar);
    return (double)(slice * threads) / worst * 1e-9;
}

/* ---- the contiguous baseline ---- */

static void done_nop(void *arg) { (void)arg; }

typedef struct contig {
    kvhi_attn_plan plan;
    uint8_t *kv;
    kvhi_attn_cpu *st;
} contig;

static int contig_setup(contig *c, uint32_t B, uint32_t C, uint32_t Hkv, uint32_t Hq, uint32_t D, uint32_t threads,
                        const uint16_t *kbuf, const uint16_t *vbuf, uint32_t chunk)
{
    memset(c, 0, sizeof(*c));
    uint32_t bt = 1, shift = 0;
    while (bt < C)
        bt <<= 1, shift++;
    uint64_t bb = 2ull * Hkv * bt * D * 2;
    c->kv = aligned_alloc(4096, bb * B);
    c->st = kvhi_attn_cpu_create();
    if (!c->kv || !c->st)
        return 1;
    /* [K,V][head][token][dim] per sequence, from the same data as the
     * paged engine (token t uses row t % chunk of the source buffers,
     * which are [token][head][dim]). */
    for (uint32_t b = 0; b < B; b++)
        for (uint32_t kv = 0; kv < 2; kv++)
            for (uint32_t h = 0; h < Hkv; h++) {
                uint16_t *dst = (uint16_t *)(c->kv + b * bb) + ((size_t)(kv * Hkv + h) * bt) * D;
                const uint16_t *src = kv ? vbuf : kbuf;
                for (uint32_t t = 0; t < C; t++)
                    memcpy(dst + (size_t)t * D, src + ((size_t)(t % chunk) * Hkv + h) * D, (size_t)D * 2);
            }
    kvhi_attn_plan *p = &c->plan;
    p->num_q_heads = Hq;
    p->num_kv_heads = Hkv;
    p->head_dim = D;
    p->block_tokens = bt;
    p->block_shift = shift;
    p->kv_dtype = KVH_DTYPE_F16;
    p->io_dtype = KVH_DTYPE_F32;
    p->scale = 0.08838834764f;
    p->block_bytes = bb;
    p->kv_base = c->kv;
    p->cpu_state = c->st;
    p->threads = threads;
    kvhi_attn_plan_opts o = {0};
    kvhi_attn_cpu_plan_opts(NULL, threads, &o);
    o.chunk_quantum = 16; /* split-K as fine as the paged run's */
    uint32_t *kvl = bench_xmalloc(sizeof(uint32_t) * B), *ql = bench_xmalloc(sizeof(uint32_t) * B);
    for (uint32_t b = 0; b < B; b++)
        kvl[b] = C, ql[b] = 1;
    int rc = kvhi_attn_plan_build(p, &o, kvl, ql, B);
    free(kvl);
    free(ql);
    if (rc)
        return 1;
    for (uint32_t b = 0; b < B; b++)
        p->slots[b] = (int32_t)b;
    return 0;
}

static int contig_run(contig *c, const float *q, float *out)
{
    char msg[128];
    /* a fresh plan per call would be fairer to ours; the plan is reused
     * here, so the baseline pays no planning */
    return kvhi_attn_cpu_run(NULL, &c->plan, q, out, NULL, done_nop, NULL, msg, sizeof(msg)) ? 1 : 0;
}

static void contig_free(contig *c)
{
    kvhi_attn_plan_free(&c->plan);
    kvhi_attn_cpu_destroy(c->st);
    free(c->kv);
}

/* ---- one block size ---- */

static int run_block(const attn_opts *o, const bench_ctx *ctx, uint32_t bt, double bw, int reps)
{
    const uint32_t Hkv = (uint32_t)o->kv_heads, Hq = (uint32_t)o->q_heads, D = (uint32_t)o->dim;
    const uint32_t chunk = 1024; /* tokens of source K/V, repeated */
    uint64_t max_tokens = 0;
    for (size_t i = 0; i < o->contexts.n; i++) {
        uint64_t C = o->contexts.v[i], B = o->total_tokens / C ? o->total_tokens / C : 1;
        if (B * C > max_tokens)
            max_tokens = B * C;
    }
    kvh_config c;
    BENCH_CHECK(kvh_config_init(&c, sizeof(c)));
    c.backend = KVH_BACKEND_CPU;
    c.num_layers = 1;
    c.num_kv_heads = Hkv;
    c.head_dim = D;
    c.block_tokens = bt;
    c.dtype = KVH_DTYPE_F16;
    uint64_t bb = 2ull * Hkv * bt * D * 2;
    c.device_bytes = (max_tokens / bt + 64) * bb;
    c.host_bytes = 0;
    c.migration_threads = 0;

    bench_rng rng;
    bench_rng_seed(&rng, ctx->seed);
    size_t src_elems = (size_t)chunk * Hkv * D;
    uint16_t *kbuf = bench_xmalloc(src_elems * 2), *vbuf = bench_xmalloc(src_elems * 2);
    int32_t *tok = bench_xmalloc(sizeof(int32_t) * chunk);
    for (size_t i = 0; i < src_elems; i++) {
        kbuf[i] = kvhi_f32_to_f16((float)((int)bench_rng_below(&rng, 255) - 127) / 64.0f);
        vbuf[i] = kvhi_f32_to_f16((float)((int)bench_rng_below(&rng, 255) - 127) / 64.0f);
    }
    kvh_attention_params pr;
    BENCH_CHECK(kvh_attention_params_init(&pr, sizeof(pr)));
    pr.num_q_heads = Hq;
    pr.threads = (uint32_t)o->threads;

    int rc = 0;
    for (size_t ci = 0; ci < o->contexts.n && !rc; ci++) {
        uint32_t C = (uint32_t)o->contexts.v[ci];
        uint32_t B = o->total_tokens / C ? (uint32_t)(o->total_tokens / C) : 1;
        kvh_seq *seqs = bench_xcalloc(B, sizeof(kvh_seq));
        float *q = bench_xmalloc(sizeof(float) * B * Hq * D), *out = bench_xmalloc(sizeof(float) * B * Hq * D);
        float *out2 = bench_xmalloc(sizeof(float) * B * Hq * D);
        for (size_t i = 0; i < (size_t)B * Hq * D; i++)
            q[i] = (float)((int)bench_rng_below(&rng, 255) - 127) / 64.0f;
        /* An engine per context, so each starts from an empty tier (the
         * previous context's full blocks would stay cached otherwise). */
        kvh_engine *e;
        BENCH_CHECK(kvh_engine_open(&c, &e));
        uint64_t t0 = bench_ns();
        for (uint32_t b = 0; b < B; b++) {
            BENCH_CHECK(kvh_seq_create(e, 0, &seqs[b]));
            for (uint32_t t = 0; t < C; t += chunk) {
                uint32_t n = C - t < chunk ? C - t : chunk;
                for (uint32_t i = 0; i < n; i++)
                    tok[i] = (int32_t)(bench_rng_next(&rng) & 0x7fffffff);
                BENCH_CHECK(kvh_seq_append(e, seqs[b], tok, n));
                BENCH_CHECK(kvh_seq_write_kv(e, seqs[b], 0, t, n, kbuf, vbuf));
            }
        }
        contig cg;
        if (contig_setup(&cg, B, C, Hkv, Hq, D, (uint32_t)o->threads, kbuf, vbuf, chunk)) {
            fprintf(stderr, "kvh-bench attention: out of memory for the contiguous baseline\n");
            return 1;
        }
        bench_info(ctx, "attention: block %u, context %u x batch %u: filled in %.2f s", bt, C, B,
                   (double)(bench_ns() - t0) * 1e-9);
        double bytes = 2.0 * B * C * Hkv * D * 2;
        double *ours = bench_xcalloc((size_t)reps, sizeof(double)), *base = bench_xcalloc((size_t)reps, sizeof(double));
        double *ratio = bench_xcalloc((size_t)reps, sizeof(double));
        /* one warm-up of each, then interleaved rounds */
        BENCH_CHECK(kvh_attention_decode(e, 0, seqs, B, q, out, &pr));
        if (contig_run(&cg, q, out2))
            return 1;
        for (int r = 0; r < reps; r++) {
            for (int k = 0; k < 2; k++) {
                int which = (r + k) & 1;
                uint64_t s = bench_ns();
                if (which == 0)
                    BENCH_CHECK(kvh_attention_decode(e, 0, seqs, B, q, out, &pr));
                else if (contig_run(&cg, q, out2))
                    return 1;
                double gbs = bytes / ((double)(bench_ns() - s) * 1e-9) * 1e-9;
                if (which == 0)
                    ours[r] = gbs;
                else
                    base[r] = gbs;
            }
            ratio[r] = ours[r] / base[r];
        }
        /* both read the same K/V: the outputs must agree */
        for (size_t i = 0; i < (size_t)B * Hq * D; i++)
            if (!(out[i] == out[i]) || !(out2[i] == out2[i]) ||
                __builtin_fabsf(out[i] - out2[i]) > 1e-4f * (1 + __builtin_fabsf(out2[i]))) {
                fprintf(stderr, "kvh-bench attention: paged and contiguous outputs differ at %zu: %g vs %g\n", i,
                        out[i], out2[i]);
                return 1;
            }
        double om = bench_median(ours, (size_t)reps);
        bench_row *row = bench_row_new(SCEN, "decode_throughput", om, "GB/s");
        bench_row_str(row, "layout", "paged");
        bench_row_int(row, "context", C);
        bench_row_int(row, "batch", B);
        bench_row_int(row, "block_tokens", bt);
        bench_row_str(row, "dtype", "f16");
        bench_row_int(row, "threads", (int64_t)(o->threads ? o->threads : 0));
        bench_row_baseline(row, bench_median(base, (size_t)reps), bench_median(ratio, (size_t)reps));
        if (bt == 16)
            bench_row_target(row, 1, 1, 0.9);
        bench_row_note(row, "baseline: same kernel on contiguous K/V");
        bench_emit(ctx, row);

        row = bench_row_new(SCEN, "roofline_fraction", om / bw, "ratio");
        bench_row_str(row, "layout", "paged");
        bench_row_int(row, "context", C);
        bench_row_int(row, "batch", B);
        bench_row_int(row, "block_tokens", bt);
        bench_row_str(row, "dtype", "f16");
        bench_row_baseline(row, bw, om / bw);
        if (C == 32768)
            bench_row_target(row, 1, 1, 0.6);
        bench_row_note(row, "baseline: memory read bandwidth (GB/s), same run");
        bench_emit(ctx, row);

        contig_free(&cg);
        for (uint32_t b = 0; b < B; b++)
            BENCH_CHECK(kvh_seq_free(e, seqs[b]));
        BENCH_CHECK(kvh_engine_close(e));
        free(seqs);
        free(q);
        free(out);
        free(out2);
        free(ours);
        free(base);
        free(ratio);
    }
    free(kbuf);
    free(vbuf);
    free(tok);
    return rc;
}

static const char usage_text[] = "CPU paged decode attention (kvh_attention_decode, f16 KV, f32 q/out) in GB/s of\n"
                                 "K+V read, for each block size and context length; batch = total-tokens /\n"
                                 "context so every call reads the same bytes. Baselines: the same kernel over\n"
                                 "contiguous K/V (target paged/contiguous >= 0.9 at block 16) and the memory\n"
                                 "read bandwidth of all threads, measured in this run (target >= 0.6 of it at\n"
                                 "32K context). Memory: about 2 x total-tokens x 2 x kv-heads x dim x 2 bytes\n"
                                 "plus --bw-mb. With --stream (first): decode over one sequence larger than\n"
                                 "the device tier, streamed from host and disk (kvh-bench attention --stream\n"
                                 "--help).\n";

int bench_attention(int argc, char **argv, const bench_ctx *ctx)
{
    /* --stream: decode over sequences larger than the device tier
     * (bench_attention_stream.c). */
    for (int i = 0; i < argc; i++)
        if (!strcmp(argv[i], "--stream")) {
            for (int j = i; j + 1 < argc; j++)
                argv[j] = argv[j + 1];
            return bench_attention_stream(argc - 1, argv, ctx);
        }
    attn_opts o = {
        .contexts = {.n = 6, .v = {1 << 10, 4 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10}},
        .blocks = {.n = 2, .v = {16, 32}},
        .total_tokens = 128 << 10,
        .kv_heads = 8,
        .q_heads = 32,
        .dim = 128,
        .threads = 0,
        .bw_mb = 1024,
    };
    if (ctx->quick) {
        o.contexts = (bench_list){.n = 3, .v = {1 << 10, 4 << 10, 32 << 10}};
        o.blocks = (bench_list){.n = 1, .v = {16}};
        o.total_tokens = 32 << 10;
        o.bw_mb = 256;
    }
    const bench_opt opts[] = {
        {"--contexts", BENCH_OPT_LIST, &o.contexts, "context lengths in tokens (K suffix)"},
        {"--blocks", BENCH_OPT_LIST, &o.blocks, "block_tokens values"},
        {"--total-tokens", BENCH_OPT_U64, &o.total_tokens, "tokens per call (batch = this / context)"},
        {"--kv-heads", BENCH_OPT_U64, &o.kv_heads, "KV heads"},
        {"--q-heads", BENCH_OPT_U64, &o.q_heads, "query heads (a multiple of --kv-heads)"},
        {"--dim", BENCH_OPT_U64, &o.dim, "head_dim"},
        {"--threads", BENCH_OPT_U64, &o.threads, "attention threads (0 = all CPUs)"},
        {"--bw-mb", BENCH_OPT_U64, &o.bw_mb, "MiB read by the bandwidth baseline"},
        {NULL, BENCH_OPT_U64, NULL, NULL},
    };
    int prc = bench_parse(argc, argv, opts, SCEN, usage_text);
    if (prc)
        return bench_parse_rc(prc);
    /* Heads and the batch (up to --total-tokens, at a context of 1) are
     * 32-bit values; the heads take the engine's and the kernels' limits. */
    if (bench_check_u64(SCEN, "--kv-heads", o.kv_heads, 1, 1024) ||
        bench_check_u64(SCEN, "--q-heads", o.q_heads, 1, KVHI_ATTN_MAX_Q_HEADS) ||
        bench_check_u64(SCEN, "--total-tokens", o.total_tokens, 1, UINT32_MAX))
        return 2;
    /* bw_mb << 20 must fit a size_t; the thread count goes to a uint32_t. */
    if (bench_check_u64(SCEN, "--dim", o.dim, 1, 1024) || bench_check_u64(SCEN, "--bw-mb", o.bw_mb, 16, 1u << 20))
        return 2;
    if (o.q_heads % o.kv_heads) {
        fprintf(stderr, "kvh-bench attention: --q-heads must be a multiple of --kv-heads, got %llu and %llu\n",
                (unsigned long long)o.q_heads, (unsigned long long)o.kv_heads);
        return 2;
    }
    if (o.threads > 1024) {
        fprintf(stderr, "kvh-bench attention: --threads must be in 0..1024\n");
        return 2;
    }
    if (bench_check_list(SCEN, "--blocks", &o.blocks, 1, 256, 1)) /* the engine's block_tokens range */
        return 2;
    for (size_t i = 0; i < o.contexts.n; i++)
        if (!o.contexts.v[i] || o.contexts.v[i] >= (1u << 31)) {
            fprintf(stderr, "kvh-bench attention: contexts must be in 1..2^31\n");
            return 2;
        }
    int reps = ctx->reps ? ctx->reps : 5;
    uint32_t threads = o.threads ? (uint32_t)o.threads : kvhi_cpu_count();
    size_t bwb = (size_t)o.bw_mb << 20;
    uint8_t *bwbuf = aligned_alloc(4096, bwb);
    if (!bwbuf) {
        fprintf(stderr, "kvh-bench attention: out of memory for the %llu MiB of --bw-mb\n",
                (unsigned long long)o.bw_mb);
        return 1;
    }
    memset(bwbuf, 1, bwb);
    double bws[16];
    int nbw = reps < 16 ? reps : 16;
    read_bandwidth(bwbuf, bwb, threads); /* warm-up */
    for (int r = 0; r < nbw; r++)
        bws[r] = read_bandwidth(bwbuf, bwb, threads);
    double bw = bench_median(bws, (size_t)nbw);
    bench_row *row = bench_row_new(SCEN, "read_bandwidth", bw, "GB/s");
    bench_row_int(row, "threads", threads);
    bench_row_int(row, "bytes", (int64_t)bwb);
    bench_emit(ctx, row);
    free(bwbuf);
    bench_info(ctx, "attention: read bandwidth %.1f GB/s with %u threads", bw, threads);
    int rc = 0;
    for (size_t i = 0; i < o.blocks.n && !rc; i++)
        rc = run_block(&o, ctx, (uint32_t)o.blocks.v[i], bw, reps);
    return rc;
}
