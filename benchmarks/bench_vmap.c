/* Scenario `vmap`: virtual contiguity on the CPU (kvh_seq_vmap).
 *
 * For each context length C (one sequence, one layer, 8 KV heads, head_dim
 * 128, f16, 16-token blocks: one head's K of a block is one 4 KiB page),
 * once with mappings populated when made and once faulted on first read
 * (KVH_VMAP_POPULATE=0), on the backing the engine picks (hugetlb, thp or
 * 4k; KVH_VMAP_BACKING forces one), reported as `backing` and `populate`:
 *   map_us       kvh_seq_vmap of the whole sequence (the slab layout makes
 *                a run of neighbouring blocks one mmap per head)
 *   remap_2mib_us  kvh_seq_vmap plus a first read of every page of the
 *                view (the faults a lazily mapped view pays), per 2 MiB
 *   refresh_us   kvh_vmap_refresh after appending one block
 *   release_us   kvh_vmap_release
 *   decode       kvh_attention_decode_vmap GB/s of K+V read (layout
 *                virtual) against kvh_attention_decode over the same
 *                sequence (layout paged) as the baseline, 32 query heads.
 * Medians of --reps rounds. The <= 16 us per 2 MiB target of the issue is
 * for huge-page backing (one 2 MiB mapping, no per-page faults). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_scenarios.h"

#define SCEN "vmap"

int bench_vmap(int argc, char **argv, const bench_ctx *ctx);

enum { HKV = 8, HQ = 32, D = 128, BT = 16 };

/* Reads one byte of every page of the view's K and V. */
static uint64_t touch_view(const kvh_vmap_view *v, uint64_t bytes_per_head)
{
    uint64_t sum = 0;
    for (int kv = 0; kv < 2; kv++)
        for (int h = 0; h < HKV; h++) {
            const volatile uint8_t *p = (const volatile uint8_t *)(kv ? v->v : v->k) + (uint64_t)h * v->head_stride;
            for (uint64_t o = 0; o < bytes_per_head; o += 4096)
                sum += p[o];
        }
    return sum;
}

static int run_context(const bench_ctx *ctx, uint32_t C, int reps, uint64_t threads, int populate)
{
    setenv("KVH_VMAP_POPULATE", populate ? "1" : "0", 1);
    uint64_t block = 2ull * HKV * BT * D * 2;
    kvh_config c;
    BENCH_CHECK(kvh_config_init(&c, sizeof(c)));
    c.num_layers = 1;
    c.num_kv_heads = HKV;
    c.head_dim = D;
    c.block_tokens = BT;
    c.dtype = KVH_DTYPE_F16;
    c.backend = KVH_BACKEND_CPU;
    c.device_bytes = ((uint64_t)C / BT + 8) * block;
    c.host_bytes = 0;
    c.vmap = 1;
    kvh_engine *e;
    BENCH_CHECK(kvh_engine_open(&c, &e));
    kvh_seq s;
    BENCH_CHECK(kvh_seq_create(e, 0, &s));
    uint32_t chunk = 1024;
    int32_t *tok = bench_xmalloc(sizeof(int32_t) * chunk);
    uint16_t *kv = bench_xmalloc((size_t)chunk * HKV * D * 2);
    float *q = bench_xmalloc(sizeof(float) * HQ * D), *out = bench_xmalloc(sizeof(float) * HQ * D);
    bench_rng r;
    bench_rng_seed(&r, ctx->seed);
    for (size_t i = 0; i < (size_t)chunk * HKV * D; i++)
        kv[i] = (uint16_t)(0x3000 + bench_rng_below(&r, 0x800)); /* small positive f16 values */
    for (int i = 0; i < HQ * D; i++)
        q[i] = (float)bench_rng_below(&r, 1000) / 1000.0f;
    for (uint32_t t = 0; t < C; t += chunk) {
        uint32_t n = C - t < chunk ? C - t : chunk;
        for (uint32_t i = 0; i < n; i++)
            tok[i] = (int32_t)(t + i);
        BENCH_CHECK(kvh_seq_append(e, s, tok, n));
        BENCH_CHECK(kvh_seq_write_kv(e, s, 0, t, n, kv, kv));
    }
    double *map = bench_xcalloc((size_t)reps, sizeof(double)), *refresh = bench_xcalloc((size_t)reps, sizeof(double));
    double *rel = bench_xcalloc((size_t)reps, sizeof(double)), *virt = bench_xcalloc((size_t)reps, sizeof(double));
    double *paged = bench_xcalloc((size_t)reps, sizeof(double)), *ratio = bench_xcalloc((size_t)reps, sizeof(double));
    double *touched = bench_xcalloc((size_t)reps, sizeof(double));
    char backing[16] = "";
    uint64_t sink = 0;
    kvh_attention_params p;
    BENCH_CHECK(kvh_attention_params_init(&p, sizeof(p)));
    p.num_q_heads = HQ;
    p.threads = (uint32_t)threads;
    double bytes = 2.0 * HKV * D * 2 * C;
    for (int rep = 0; rep < reps; rep++) {
        kvh_vmap *m;
        uint64_t t0 = bench_ns();
        BENCH_CHECK(kvh_seq_vmap(e, s, 0, (uint64_t)C + BT, &m));
        map[rep] = (double)(bench_ns() - t0) * 1e-3;
        kvh_vmap_view view = {.struct_size = sizeof(view)};
        BENCH_CHECK(kvh_vmap_get(e, m, &view));
        sink += touch_view(&view, (uint64_t)C * D * 2);
        touched[rep] = (double)(bench_ns() - t0) * 1e-3;
        snprintf(backing, sizeof(backing), "%s", view.backing);
        /* a fresh view of the same blocks for the rest: mapped again */
        BENCH_CHECK(kvh_vmap_release(e, m));
        BENCH_CHECK(kvh_seq_vmap(e, s, 0, (uint64_t)C + BT, &m));
        /* decode: warm once, then time each layout */
        BENCH_CHECK(kvh_attention_decode_vmap(e, &m, 1, q, out, &p));
        t0 = bench_ns();
        BENCH_CHECK(kvh_attention_decode_vmap(e, &m, 1, q, out, &p));
        virt[rep] = bytes / (double)(bench_ns() - t0);
        BENCH_CHECK(kvh_attention_decode(e, 0, &s, 1, q, out, &p));
        t0 = bench_ns();
        BENCH_CHECK(kvh_attention_decode(e, 0, &s, 1, q, out, &p));
        paged[rep] = bytes / (double)(bench_ns() - t0);
        ratio[rep] = virt[rep] / paged[rep];
        /* one more block, then refresh */
        for (uint32_t i = 0; i < BT; i++)
            tok[i] = (int32_t)(C + i);
        BENCH_CHECK(kvh_seq_append(e, s, tok, BT));
        t0 = bench_ns();
        int32_t changed = 0;
        BENCH_CHECK(kvh_vmap_refresh(e, m, &changed));
        refresh[rep] = (double)(bench_ns() - t0) * 1e-3;
        BENCH_CHECK(kvh_seq_truncate(e, s, C));
        t0 = bench_ns();
        BENCH_CHECK(kvh_vmap_release(e, m));
        rel[rep] = (double)(bench_ns() - t0) * 1e-3;
    }
    double mapped_mib = bytes / (1 << 20);
    struct {
        const char *metric;
        double value;
        const char *unit;
    } rows[] = {
        {"map_us", bench_median(map, (size_t)reps), "us"},
        {"remap_2mib_us", bench_median(touched, (size_t)reps) / (mapped_mib / 2), "us"},
        {"refresh_one_block_us", bench_median(refresh, (size_t)reps), "us"},
        {"release_us", bench_median(rel, (size_t)reps), "us"},
    };
    for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
        bench_row *row = bench_row_new(SCEN, rows[i].metric, rows[i].value, rows[i].unit);
        bench_row_int(row, "context", C);
        bench_row_int(row, "block_tokens", BT);
        bench_row_str(row, "dtype", "f16");
        bench_row_str(row, "backing", backing);
        bench_row_int(row, "populate", populate);
        bench_emit(ctx, row);
    }
    bench_row *row = bench_row_new(SCEN, "decode_throughput", bench_median(virt, (size_t)reps), "GB/s");
    bench_row_str(row, "layout", "virtual");
    bench_row_int(row, "context", C);
    bench_row_int(row, "block_tokens", BT);
    bench_row_str(row, "dtype", "f16");
    bench_row_int(row, "threads", (int64_t)threads);
    bench_row_str(row, "backing", backing);
    bench_row_int(row, "populate", populate);
    bench_row_baseline(row, bench_median(paged, (size_t)reps), bench_median(ratio, (size_t)reps));
    bench_row_note(row, "baseline: kvh_attention_decode (paged) on the same sequence");
    bench_emit(ctx, row);
    free(map);
    free(refresh);
    free(rel);
    free(virt);
    free(paged);
    free(ratio);
    free(touched);
    if (sink == 42)
        fputc(' ', stderr); /* keeps the reads */
    free(tok);
    free(kv);
    free(q);
    free(out);
    BENCH_CHECK(kvh_seq_free(e, s));
    BENCH_CHECK(kvh_engine_close(e));
    return 0;
}

static const char usage_text[] = "Virtual contiguity on the CPU: cost of mapping a sequence's layer into a\n"
                                 "view (kvh_seq_vmap), refreshing it after an append, releasing it, and decode\n"
                                 "attention over the view against paged decode of the same sequence.\n";

int bench_vmap(int argc, char **argv, const bench_ctx *ctx)
{
    bench_list contexts = {.n = 3, .v = {1 << 10, 8 << 10, 32 << 10}};
    uint64_t threads = 0;
    if (ctx->quick)
        contexts = (bench_list){.n = 2, .v = {1 << 10, 4 << 10}};
    const bench_opt opts[] = {
        {"--contexts", BENCH_OPT_LIST, &contexts, "context lengths in tokens (K suffix)"},
        {"--threads", BENCH_OPT_U64, &threads, "attention threads (0 = all CPUs)"},
        {NULL, BENCH_OPT_U64, NULL, NULL},
    };
    int prc = bench_parse(argc, argv, opts, SCEN, usage_text);
    if (prc)
        return bench_parse_rc(prc);
    if (threads > 1024) { /* the plan takes a uint32_t */
        fprintf(stderr, "kvh-bench vmap: --threads must be in 0..1024\n");
        return 2;
    }
    /* Every context before the first: a bad one must not come after rows. */
    if (bench_check_list(SCEN, "--contexts", &contexts, 1, 1u << 24, 0))
        return 2;
    int reps = ctx->reps ? ctx->reps : 5;
    for (size_t i = 0; i < contexts.n; i++) {
        for (int populate = 1; populate >= 0; populate--) {
            int rc = run_context(ctx, (uint32_t)contexts.v[i], reps, threads, populate);
            if (rc)
                return rc;
        }
    }
    unsetenv("KVH_VMAP_POPULATE");
    bench_flush_table(ctx, "virtual contiguity (CPU)");
    return 0;
}
