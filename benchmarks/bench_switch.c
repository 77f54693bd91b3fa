/* kvh-bench switch: a weight-context switch between two models of
 * SmolLM2-135M size (a GGUF file given with --model or $KVH_MODEL, else a
 * synthetic file of the same size), next to the plain alternative measured
 * in the same run: reloading the model from its file from scratch (open,
 * allocate, read it all). Three ways the incoming weights can be found:
 *
 *   unified  the CPU backend's device and host tiers are the same memory:
 *            the outgoing model is re-accounted to the host tier and the
 *            incoming one back, with no copy at all
 *   discrete the tiers treated as separate memory, as on a discrete GPU:
 *            the outgoing model's clean weights are dropped (never
 *            written) and the incoming ones read again from their file,
 *            chunk by chunk with their checksums
 *   file     unified memory, but the host tier has no room to keep the
 *            outgoing model: what does not fit is dropped and read again
 *
 * Also time to first layer ready (kvh_context_wait_layer(0)) against the
 * full switch. Regions are the file cut in --layers equal slices, one per
 * layer, loaded in order. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bench_fs.h"
#include "bench_scenarios.h"

/* Internal (core/context.c, reached through the static library): moves
 * weights between the CPU backend's device and host tiers by copying, as
 * on a discrete GPU, for the `discrete` mode. */
int kvhi_context_copy_on_unified(kvh_engine *e, _Bool on);

#define SMOLLM2_Q4_1_BYTES 98362432ull

/* Fills fd (a new file of its own, from mkstemp) and closes it. */
static int make_synthetic(int fd, uint64_t bytes)
{
    uint8_t *buf = bench_xmalloc(1 << 20);
    bench_rng r;
    bench_rng_seed(&r, 42);
    for (uint64_t off = 0; off < bytes;) {
        uint64_t n = bytes - off < (1 << 20) ? bytes - off : (1 << 20);
        for (uint64_t i = 0; i < n; i += 8) {
            uint64_t v = bench_rng_next(&r);
            memcpy(buf + i, &v, n - i < 8 ? n - i : 8);
        }
        if (write(fd, buf, n) != (ssize_t)n) {
            free(buf);
            close(fd);
            return -1;
        }
        off += n;
    }
    free(buf);
    return close(fd);
}

/* The baseline: what a process does to get the model back without kvh. */
static double reload_once(const char *path, uint64_t bytes)
{
    double t0 = bench_sec();
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        return -1;
    uint8_t *buf = malloc(bytes);
    uint64_t got = 0;
    while (buf && got < bytes) {
        ssize_t n = pread(fd, buf + got, bytes - got, (off_t)got);
        if (n <= 0)
            break;
        got += (uint64_t)n;
    }
    close(fd);
    uint64_t sum = 0;
    for (uint64_t i = 0; buf && i < bytes; i += 4096)
        sum += buf[i];
    bench_sink(sum);
    free(buf);
    double t = bench_sec() - t0;
    return got == bytes ? t : -1;
}

typedef struct switch_times {
    double full, first;              /* seconds, medians */
    uint64_t copied, remapped, read; /* bytes moved per switch, last one */
} switch_times;

static int add_model(kvh_engine *e, kvh_context *ctx, const char *path, uint64_t bytes, uint32_t layers)
{
    kvh_context_params cp;
    BENCH_CHECK(kvh_context_params_init(&cp, sizeof cp));
    BENCH_CHECK(kvh_context_create(e, &cp, ctx));
    uint64_t slice = bytes / layers;
    for (uint32_t l = 0; l < layers; l++) {
        kvh_weight_region_params rp;
        BENCH_CHECK(kvh_weight_region_params_init(&rp, sizeof rp));
        rp.layer = l;
        rp.path = path;
        rp.file_offset = (uint64_t)l * slice;
        rp.size = l + 1 == layers ? bytes - rp.file_offset : slice;
        uint32_t idx;
        BENCH_CHECK(kvh_context_add_region(e, *ctx, &rp, &idx));
    }
    return 0;
}

static int run_mode(const char *mode, const char *path, uint64_t bytes, uint32_t layers, int reps, switch_times *out)
{
    kvh_config c;
    BENCH_CHECK(kvh_config_init(&c, sizeof c));
    /* SmolLM2-135M's KV geometry: 30 layers, 3 KV heads of 64, f16. */
    c.num_layers = 30;
    c.num_kv_heads = 3;
    c.head_dim = 64;
    c.block_tokens = 16;
    c.dtype = KVH_DTYPE_F16;
    c.backend = KVH_BACKEND_CPU;
    uint64_t bb = 2ull * 30 * 3 * 64 * 16 * 2;
    /* Device: one model and 64 blocks of KV, never both models. */
    c.device_bytes = bytes + (layers + 64) * bb;
    c.host_bytes = strcmp(mode, "file") ? bytes + (layers + 64) * bb : 64 * bb;
    c.migration_threads = 2;
    kvh_engine *e;
    BENCH_CHECK(kvh_engine_open(&c, &e));
    if (!strcmp(mode, "discrete") && kvhi_context_copy_on_unified(e, 1) != 0)
        return bench_kvh_fail("kvhi_context_copy_on_unified", KVH_ERR_NOMEM);
    kvh_context m[2], none = {0};
    if (add_model(e, &m[0], path, bytes, layers) || add_model(e, &m[1], path, bytes, layers))
        return 1;
    /* Untimed warm-up: both models loaded once (first touch of memory). */
    BENCH_CHECK(kvh_context_switch(e, none, m[1], NULL));
    BENCH_CHECK(kvh_context_switch(e, m[1], m[0], NULL));
    double *full = bench_xmalloc(sizeof(double) * (size_t)reps), *first = bench_xmalloc(sizeof(double) * (size_t)reps);
    int cur = 0;
    kvh_weight_stats before = {.struct_size = sizeof before}, after = {.struct_size = sizeof after};
    for (int i = 0; i < reps; i++) {
        int next = 1 - cur;
        BENCH_CHECK(kvh_weight_stats_get(e, &before));
        kvh_fence f;
        double t0 = bench_sec();
        BENCH_CHECK(kvh_context_switch(e, m[cur], m[next], &f));
        BENCH_CHECK(kvh_context_wait_layer(e, m[next], 0, UINT64_MAX));
        first[i] = bench_sec() - t0;
        BENCH_CHECK(kvh_fence_wait(e, f, UINT64_MAX));
        full[i] = bench_sec() - t0;
        BENCH_CHECK(kvh_fence_free(e, f));
        BENCH_CHECK(kvh_weight_stats_get(e, &after));
        cur = next;
    }
    out->full = bench_median(full, (size_t)reps);
    out->first = bench_median(first, (size_t)reps);
    out->copied = (after.bytes_host_to_device - before.bytes_host_to_device) +
                  (after.bytes_device_to_host - before.bytes_device_to_host);
    out->remapped = after.bytes_remapped - before.bytes_remapped;
    out->read = after.bytes_read_source - before.bytes_read_source;
    free(full);
    free(first);
    BENCH_CHECK(kvh_context_destroy(e, m[0]));
    BENCH_CHECK(kvh_context_destroy(e, m[1]));
    BENCH_CHECK(kvh_engine_close(e));
    return 0;
}

int bench_switch(int argc, char **argv, const bench_ctx *ctx)
{
    const char *model = getenv("KVH_MODEL");
    const char *dir = "/tmp";
    uint64_t layers = 32;
    const char *only = NULL;
    const bench_opt opts[] = {
        {"--mode", BENCH_OPT_STR, &only, "only this mode: unified, discrete or file (default all three)"},
        {"--model", BENCH_OPT_STR, &model, "GGUF (or any) weight file; default $KVH_MODEL, else synthetic"},
        {"--dir", BENCH_OPT_STR, &dir, "where the synthetic weight file goes"},
        {"--layers", BENCH_OPT_U64, &layers, "regions (layers) the file is cut into"},
        {NULL},
    };
    int prc =
        bench_parse(argc, argv, opts, "switch", "kvh-bench switch [--model PATH] [--dir DIR] [--layers N] [--mode M]");
    if (prc)
        return bench_parse_rc(prc);
    if (only && strcmp(only, "unified") && strcmp(only, "discrete") && strcmp(only, "file")) {
        fprintf(stderr, "kvh-bench switch: --mode must be unified, discrete or file\n");
        return 2;
    }
    if (layers < 1 || layers > 4096) {
        fprintf(stderr, "kvh-bench switch: --layers must be in 1..4096\n");
        return 2;
    }
    char synth[512] = "";
    int scratch = -1;
    if (!*dir) {
        fprintf(stderr, "kvh-bench switch: --dir is empty (its files would go to the root directory)\n");
        return 2;
    }
    uint64_t bytes;
    if (model && model[0]) {
        struct stat sb;
        /* A wrong --model (or $KVH_MODEL, its default) is a usage error, as
         * every wrong argument. */
        const char *model_name = model == getenv("KVH_MODEL") ? "$KVH_MODEL" : "--model";
        if (stat(model, &sb) != 0) {
            fprintf(stderr, "kvh-bench switch: %s %s: %s\n", model_name, model, strerror(errno));
            return 2;
        }
        if (!S_ISREG(sb.st_mode)) { /* a directory would "reload" in no time and fail later */
            fprintf(stderr, "kvh-bench switch: %s %s: not a regular file\n", model_name, model);
            return 2;
        }
        bytes = (uint64_t)sb.st_size;
    } else {
        bytes = ctx->quick ? SMOLLM2_Q4_1_BYTES / 8 : SMOLLM2_Q4_1_BYTES;
        /* Cut short, the path would name another directory than --dir. */
        if (snprintf(synth, sizeof synth, "%s/kvh-bench-switch-XXXXXX", dir) >= (int)sizeof synth) {
            fprintf(stderr, "kvh-bench switch: --dir is too long\n");
            return 2;
        }
        char why[4300];
        if (bench_dir_check(dir, why, sizeof(why)) != 0) {
            fprintf(stderr, "kvh-bench switch: --dir: %s\n", why);
            return 2;
        }
        /* A name of its own (mkstemp: created here, never a link), removed
         * also if a signal ends the run. */
        int fd = mkstemp(synth);
        if (fd < 0) {
            fprintf(stderr, "kvh-bench switch: cannot create a file in %s (%s)\n", dir, strerror(errno));
            return 1;
        }
        scratch = bench_scratch_add(synth);
        if (make_synthetic(fd, bytes) != 0) {
            fprintf(stderr, "kvh-bench switch: cannot write %s\n", synth);
            unlink(synth);
            bench_scratch_drop(scratch);
            return 1;
        }
        model = synth;
    }
    int reps = ctx->reps ? ctx->reps : ctx->quick ? 3 : 9;
    char b[32];
    bench_info(ctx, "switch: %s weights (%s), %d switches per mode", bench_fmt_bytes(bytes, b, sizeof b),
               synth[0] ? "synthetic" : model, reps);
    /* Warm the page cache, then the baseline. */
    reload_once(model, bytes);
    double *rl = bench_xmalloc(sizeof(double) * (size_t)reps);
    for (int i = 0; i < reps; i++)
        rl[i] = reload_once(model, bytes);
    double reload = bench_median(rl, (size_t)reps);
    free(rl);
    int rc = 0;
    if (reload <= 0) {
        fprintf(stderr, "kvh-bench switch: reading %s failed\n", model);
        rc = 1;
    }
    bench_row *row = bench_row_new("switch", "reload_ms", reload * 1e3, "ms");
    bench_row_int(row, "weight_bytes", (int64_t)bytes);
    bench_row_note(row, "open + malloc + pread of the whole file (page cache warm)");
    bench_emit(ctx, row);
    static const char *modes[] = {"unified", "discrete", "file"};
    for (int mi = 0; mi < 3 && rc == 0; mi++) {
        if (only && strcmp(only, modes[mi]))
            continue;
        switch_times t = {0};
        if (run_mode(modes[mi], model, bytes, (uint32_t)layers, reps, &t) != 0) {
            rc = 1;
            break;
        }
        row = bench_row_new("switch", "switch_ms", t.full * 1e3, "ms");
        bench_row_str(row, "mode", modes[mi]);
        bench_row_int(row, "weight_bytes", (int64_t)bytes);
        bench_row_int(row, "layers", (int64_t)layers);
        bench_row_int(row, "bytes_copied", (int64_t)t.copied);
        bench_row_int(row, "bytes_remapped", (int64_t)t.remapped);
        bench_row_int(row, "bytes_read", (int64_t)t.read);
        bench_row_baseline(row, reload * 1e3, reload / t.full);
        bench_row_target(row, 1, 1, 2.0); /* switch <= 0.5x reload */
        bench_emit(ctx, row);
        row = bench_row_new("switch", "first_layer_ms", t.first * 1e3, "ms");
        bench_row_str(row, "mode", modes[mi]);
        bench_row_int(row, "layers", (int64_t)layers);
        bench_row_baseline(row, t.full * 1e3, t.full / t.first);
        bench_row_target(row, 1, 1, 5.0); /* first layer <= 0.2x full switch */
        bench_row_note(row, "baseline: the full switch");
        bench_emit(ctx, row);
    }
    if (synth[0])
        unlink(synth);
    bench_scratch_drop(scratch);
    return rc;
}
