/* Scenario `codec`: throughput of the KV codecs that convert blocks on
 * every copy between a raw tier and an encoded one (kv_codec).
 *
 * For each codec and io dtype: kvh_codec_encode and kvh_codec_decode of
 * --vectors vectors of head_dim 128 (random values in [-4, 4)), GB/s of
 * raw (unencoded) bytes, against memcpy of the same raw bytes in the same
 * run as the baseline (the copy a raw tier would do instead). --isa runs
 * the codecs on each instruction set named (kernels/cpu/kv_codec.h; the
 * same bytes on each). In every round each set's encode and decode follow
 * a memcpy of their own, the sets' order reversed every other round; the
 * ratio is the median over rounds of the codec's rate over that memcpy's
 * (load on a shared machine changes within a run), the value and the
 * baseline the medians of the rates. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_scenarios.h"
#include "../kernels/cpu/kv_codec.h"

#define SCEN "codec"

enum { HEAD_DIM = 128 };

static const char *codec_name(uint32_t c)
{
    return c == KVH_CODEC_INT8 ? "int8" : c == KVH_CODEC_Q4_G32 ? "q4_g32" : "q4_g64";
}

static const char *dtype_name(uint32_t d) { return d == KVH_DTYPE_F32 ? "f32" : d == KVH_DTYPE_F16 ? "f16" : "bf16"; }

/* Random values in [-4, 4) stored in dtype. */
static void fill(uint32_t dtype, void *p, size_t n, bench_rng *r)
{
    for (size_t i = 0; i < n; i++) {
        float f = (float)(bench_rng_below(r, 1u << 20)) / (float)(1u << 17) - 4.0f;
        uint32_t bits;
        memcpy(&bits, &f, 4);
        if (dtype == KVH_DTYPE_F32)
            memcpy((uint8_t *)p + i * 4, &f, 4);
        else if (dtype == KVH_DTYPE_BF16)
            ((uint16_t *)p)[i] = (uint16_t)(bits >> 16);
        else /* f16 of a value in range: rebias the exponent, truncate */
            ((uint16_t *)p)[i] = f == 0.0f
                                     ? 0
                                     : (uint16_t)(((bits >> 16) & 0x8000u) | ((((bits >> 23) & 0xffu) - 112u) << 10) |
                                                  ((bits >> 13) & 0x3ffu));
    }
}

/* What the issue asks of the codecs, as ratios to memcpy. */
static double target_of(uint32_t codec, int decode)
{
    if (codec == KVH_CODEC_INT8)
        return decode ? 0.8 : 0.5;
    return decode ? 0.6 : 0.35;
}

static double rate(size_t bytes, uint64_t t0, uint64_t t1) { return (double)bytes / (double)(t1 - t0 ? t1 - t0 : 1); }

static int run_one(const bench_ctx *ctx, uint32_t codec, uint32_t dtype, uint64_t vectors, int reps, const int *isas,
                   int n_isas)
{
    uint64_t raw_bytes = 0, enc_bytes = 0;
    BENCH_CHECK(kvh_codec_vector_bytes(KVH_CODEC_NONE, dtype, HEAD_DIM, &raw_bytes));
    BENCH_CHECK(kvh_codec_vector_bytes(codec, dtype, HEAD_DIM, &enc_bytes));
    size_t raw = raw_bytes * vectors, enc = enc_bytes * vectors, per = (size_t)reps * (size_t)n_isas;
    uint8_t *src = bench_xmalloc(raw), *out = bench_xmalloc(raw), *code = bench_xmalloc(enc);
    /* per set and round: encode, decode, memcpy rates; ratios */
    double *t = bench_xmalloc(sizeof(double) * per * 5);
    bench_rng r;
    bench_rng_seed(&r, ctx->seed);
    fill(dtype, src, (size_t)vectors * HEAD_DIM, &r);
    memset(out, 1, raw);
    memset(code, 1, enc);
    double *te = t, *td = t + per, *tc = t + 2 * per, *re = t + 3 * per, *rd = t + 4 * per;
    for (int k = -1; k < reps; k++) { /* round -1 warms up */
        for (int j = 0; j < n_isas; j++) {
            int s = k % 2 ? n_isas - 1 - j : j; /* the sets' order alternates */
            if (kvhi_codec_set_isa(isas[s]) != 0)
                return 1;
            uint64_t t0 = bench_ns();
            memcpy(out, src, raw);
            uint64_t t1 = bench_ns();
            BENCH_CHECK(kvh_codec_encode(codec, dtype, HEAD_DIM, src, vectors, code));
            uint64_t t2 = bench_ns();
            BENCH_CHECK(kvh_codec_decode(codec, dtype, HEAD_DIM, code, vectors, out));
            uint64_t t3 = bench_ns();
            bench_sink(out[raw / 2]);
            if (k >= 0) {
                size_t i = (size_t)s * (size_t)reps + (size_t)k;
                tc[i] = rate(raw, t0, t1);
                te[i] = rate(raw, t1, t2);
                td[i] = rate(raw, t2, t3);
                re[i] = te[i] / tc[i];
                rd[i] = td[i] / tc[i];
            }
        }
    }
    kvhi_codec_set_isa(KVHI_CODEC_AUTO);
    for (int s = 0; s < n_isas; s++) {
        size_t at = (size_t)s * (size_t)reps;
        double copy = bench_median(tc + at, (size_t)reps);
        for (int dir = 0; dir < 2; dir++) {
            double v = bench_median((dir ? td : te) + at, (size_t)reps);
            bench_row *row = bench_row_new(SCEN, dir ? "decode" : "encode", v, "GB/s");
            bench_row_str(row, "codec", codec_name(codec));
            bench_row_str(row, "dtype", dtype_name(dtype));
            bench_row_str(row, "isa", kvhi_codec_isa_name(isas[s]));
            bench_row_int(row, "head_dim", HEAD_DIM);
            bench_row_int(row, "raw_bytes", (int64_t)raw);
            bench_row_baseline(row, copy, bench_median((dir ? rd : re) + at, (size_t)reps));
            if (isas[s] == kvhi_codec_active_isa())
                bench_row_target(row, 1, 1, target_of(codec, dir));
            bench_row_note(row, "GB/s of raw bytes; baseline: memcpy of the same raw bytes; ratio: median of "
                                "per-round ratios");
            bench_emit(ctx, row);
        }
    }
    free(src);
    free(out);
    free(code);
    free(t);
    return 0;
}

/* --isa: "auto" (the set chosen at run time), "all" (every set this CPU
 * runs), or names separated by commas. Returns the count, 0 on an error. */
static int parse_isas(const char *arg, int *isas)
{
    if (strcmp(arg, "auto") == 0) {
        isas[0] = kvhi_codec_active_isa();
        return 1;
    }
    int n = 0;
    for (int isa = KVHI_CODEC_SCALAR; isa <= KVHI_CODEC_AVX512; isa++) {
        const char *name = kvhi_codec_isa_name(isa);
        size_t len = strlen(name);
        bool named = false;
        for (const char *p = arg; (p = strstr(p, name)) != NULL; p += len)
            if ((p == arg || p[-1] == ',') && (p[len] == ',' || p[len] == '\0'))
                named = true;
        if (strcmp(arg, "all") == 0 ? kvhi_codec_isa_supported(isa) : named) {
            if (!kvhi_codec_isa_supported(isa)) {
                fprintf(stderr, "kvh-bench codec: this CPU does not run %s\n", name);
                return 0;
            }
            isas[n++] = isa;
        }
    }
    return n;
}

int bench_codec(int argc, char **argv, const bench_ctx *ctx)
{
    uint64_t vectors = ctx->quick ? 4096 : 65536;
    const char *isa_arg = "auto";
    const bench_opt opts[] = {
        {"--vectors", BENCH_OPT_U64, &vectors, "vectors of head_dim 128 per call (--quick 4096)"},
        {"--isa", BENCH_OPT_STR, &isa_arg, "auto, all, or some of scalar,avx2,avx512"},
        {NULL, BENCH_OPT_U64, NULL, NULL},
    };
    int prc = bench_parse(argc, argv, opts, SCEN, "kvh-bench codec [--vectors N] [--isa LIST]");
    if (prc)
        return bench_parse_rc(prc);
    if (vectors < 1 || vectors > (1u << 24)) {
        fprintf(stderr, "kvh-bench codec: --vectors must be in 1..16M\n");
        return 2;
    }
    int isas[3];
    int n_isas = parse_isas(isa_arg, isas);
    if (n_isas == 0) {
        fprintf(stderr, "kvh-bench codec: --isa: auto, all, or some of scalar,avx2,avx512\n");
        return 2;
    }
    int reps = ctx->reps ? ctx->reps : ctx->quick ? 3 : 9;
    static const uint32_t codecs[] = {KVH_CODEC_INT8, KVH_CODEC_Q4_G32, KVH_CODEC_Q4_G64};
    static const uint32_t dtypes[] = {KVH_DTYPE_F16, KVH_DTYPE_BF16, KVH_DTYPE_F32};
    for (int c = 0; c < 3; c++)
        for (int d = 0; d < 3; d++) {
            int rc = run_one(ctx, codecs[c], dtypes[d], vectors, reps, isas, n_isas);
            if (rc)
                return rc;
        }
    bench_flush_table(ctx, "KV codecs");
    return 0;
}
