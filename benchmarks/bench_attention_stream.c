/* `kvh-bench attention --stream`: decode over one sequence several times
 * the device tier, its blocks in the host tier, on disk, or both, attended
 * through a streaming window (kvh_attention_params.stream_*), against the
 * bound of the hardware measured in the same run:
 *
 *   bound = (blocks read in memory) x (time per block of the same decode
 *           with the whole sequence in the device tier)
 *         + (bytes read from disk) / (raw O_DIRECT read bandwidth at the
 *           same block size and queue depth, io_uring, same directory)
 *
 * The host tier shares the device tier's arena on the CPU backend, so its
 * blocks are attended where they lie, at the kernels' speed; blocks on
 * disk are read into the window while the previous chunk is attended.
 * Target: bound / time >= 0.8. */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench_fs.h"
#include "bench_scenarios.h"

#include "../kernels/attention_dtype.h"
#include "../kernels/attention_plan.h"

#define SCEN "attention"
#define STREAM_MAX_BLOCKS ((1ull << 31) / 16 - 1) /* blocks of 16 tokens under 2^31 tokens */

typedef struct stream_opts {
    bench_list times;
    uint64_t device_blocks, chunk_blocks, window_blocks, kv_heads, q_heads, dim, threads;
    char dir[512];
} stream_opts;

enum where { HOST, DISK, MIXED };
static const char *where_name[] = {"host", "disk", "mixed"};

/* A sequence of n_blocks full blocks of f16 K/V in [-2, 2]. */
static int fill(kvh_engine *e, uint32_t bt, uint64_t n_blocks, size_t per_token, bench_rng *rng, kvh_seq *s)
{
    uint16_t *k = bench_xmalloc(per_token * bt * 2), *v = bench_xmalloc(per_token * bt * 2);
    int32_t *tok = bench_xmalloc(sizeof(int32_t) * bt);
    for (size_t i = 0; i < per_token * bt; i++) {
        k[i] = kvhi_f32_to_f16((float)((int)bench_rng_below(rng, 255) - 127) / 64.0f);
        v[i] = kvhi_f32_to_f16((float)((int)bench_rng_below(rng, 255) - 127) / 64.0f);
    }
    kvh_status st = kvh_seq_create(e, 0, s);
    for (uint64_t b = 0; b < n_blocks && st == KVH_OK; b++) {
        for (uint32_t i = 0; i < bt; i++)
            tok[i] = (int32_t)(bench_rng_next(rng) & 0x7fffffff);
        st = kvh_seq_append(e, *s, tok, bt);
        if (st == KVH_OK)
            st = kvh_seq_write_kv(e, *s, 0, b * bt, bt, k, v);
    }
    free(k);
    free(v);
    free(tok);
    return st == KVH_OK ? 0 : bench_kvh_fail("fill", st);
}

/* Median seconds of reps decode steps, after one untimed warm-up when
 * warm. */
static double time_decode(kvh_engine *e, kvh_seq s, const float *q, float *out, const kvh_attention_params *p, int reps,
                          bool warm)
{
    double t[64];
    if (reps > 64)
        reps = 64;
    if (warm && kvh_attention_decode(e, 0, &s, 1, q, out, p) != KVH_OK)
        return -1;
    for (int r = 0; r < reps; r++) {
        uint64_t t0 = bench_ns();
        if (kvh_attention_decode(e, 0, &s, 1, q, out, p) != KVH_OK)
            return -1;
        t[r] = (double)(bench_ns() - t0) * 1e-9;
    }
    return bench_median(t, (size_t)reps);
}

static uint64_t blocks_in(kvh_engine *e, kvh_seq s, uint64_t n_blocks, uint32_t tier)
{
    uint64_t n = 0;
    for (uint64_t i = 0; i < n_blocks; i++) {
        kvh_block b;
        kvh_block_info info;
        memset(&info, 0, sizeof(info));
        info.struct_size = sizeof(info);
        if (kvh_seq_blocks(e, s, i, 1, &b) == KVH_OK && kvh_block_info_get(e, b, &info) == KVH_OK)
            n += info.tier == tier;
    }
    return n;
}

static int run_size(const stream_opts *o, const bench_ctx *ctx, uint64_t times, int reps)
{
    const uint32_t bt = 16, Hkv = (uint32_t)o->kv_heads, Hq = (uint32_t)o->q_heads, D = (uint32_t)o->dim;
    const size_t per_token = (size_t)Hkv * D;
    const uint64_t bb = 2ull * bt * per_token * 2; /* one layer, f16 */
    const uint64_t n_blocks = times * o->device_blocks;
    bench_rng rng;
    bench_rng_seed(&rng, ctx->seed);
    float *q = bench_xmalloc(sizeof(float) * Hq * D), *out = bench_xmalloc(sizeof(float) * Hq * D);
    for (size_t i = 0; i < (size_t)Hq * D; i++)
        q[i] = (float)((int)bench_rng_below(&rng, 255) - 127) / 64.0f;
    kvh_attention_params sp;
    BENCH_CHECK(kvh_attention_params_init(&sp, sizeof(sp)));
    sp.num_q_heads = Hq;
    sp.threads = (uint32_t)o->threads;
    sp.stream_chunk_blocks = (uint32_t)o->chunk_blocks;
    sp.stream_window_blocks = (uint32_t)o->window_blocks;

    kvh_config c;
    BENCH_CHECK(kvh_config_init(&c, sizeof(c)));
    c.num_layers = 1;
    c.num_kv_heads = Hkv;
    c.head_dim = D;
    c.block_tokens = bt;
    c.dtype = KVH_DTYPE_F16;
    c.backend = KVH_BACKEND_CPU;

    /* The bound's first term: the same call, everything in the device
     * tier (and the same split: the streaming params apply). */
    c.device_bytes = (n_blocks + 8) * bb;
    c.host_bytes = 0;
    kvh_engine *e;
    BENCH_CHECK(kvh_engine_open(&c, &e));
    kvh_seq s;
    if (fill(e, bt, n_blocks, per_token, &rng, &s))
        return 1;
    double t_resident = time_decode(e, s, q, out, &sp, reps, true);
    BENCH_CHECK(kvh_seq_free(e, s));
    BENCH_CHECK(kvh_engine_close(e));
    if (t_resident < 0)
        return bench_kvh_fail("resident decode", KVH_ERR_INTERNAL);
    double t_block = t_resident / (double)n_blocks;

    /* The second: the disk's raw sequential read bandwidth, in reads of a
     * whole chunk of slots at queue depth 32 (larger than kvh's own
     * requests: the strongest baseline this disk gives), measured next to
     * each run that reads from disk (the disk is shared and drifts). */
    char raw[600];
    snprintf(raw, sizeof(raw), "%s/raw-read.bin", o->dir);
    uint64_t slot = 4096 + (bb + 4095) / 4096 * 4096, io = slot * o->chunk_blocks;
    uint32_t n_io = (uint32_t)((n_blocks + o->chunk_blocks - 1) / o->chunk_blocks);
    if (bench_raw_io(raw, io, n_io, 1, 0, 32, ctx->seed) < 0) { /* lay it out */
        fprintf(stderr, "kvh-bench attention --stream: raw O_DIRECT I/O failed in %s\n", o->dir);
        return 1;
    }

    int rc = 0;
    for (int w = HOST; w <= MIXED && !rc; w++) {
        char store[600];
        snprintf(store, sizeof(store), "%s/stream-store", o->dir);
        c.device_bytes = o->device_blocks * bb;
        c.host_bytes = (w == HOST ? n_blocks + 8 : w == MIXED ? n_blocks / 2 : 8) * bb;
        c.disk_path = store;
        c.disk_bytes = (n_blocks + 64) * slot;
        if (bench_remove_tree(store) != 0)
            return 1;
        BENCH_CHECK(kvh_engine_open(&c, &e));
        if (fill(e, bt, n_blocks, per_token, &rng, &s))
            return 1;
        uint32_t to = w == HOST ? KVH_TIER_HOST : KVH_TIER_DISK;
        if (w != MIXED)
            BENCH_CHECK(kvh_seq_migrate(e, s, 0, n_blocks * bt, to, NULL));
        /* Raw reads and streamed steps alternate; each side's median. */
        double ts[16], raws[16];
        int nr = reps < 16 ? reps : 16;
        if (time_decode(e, s, q, out, &sp, 1, false) < 0)
            return bench_kvh_fail("streamed decode", KVH_ERR_INTERNAL);
        for (int r = 0; r < nr; r++) {
            raws[r] = w == HOST ? 1.0 : bench_raw_io(raw, io, n_io, 0, 0, 32, ctx->seed);
            ts[r] = time_decode(e, s, q, out, &sp, 1, false);
            if (ts[r] < 0 || raws[r] < 0)
                return bench_kvh_fail("streamed decode or raw read", KVH_ERR_IO);
        }
        double t = bench_median(ts, (size_t)nr);
        double disk_bw = (double)(io * n_io) / bench_median(raws, (size_t)nr);
        uint64_t on_disk = blocks_in(e, s, n_blocks, KVH_TIER_DISK);
        uint64_t in_memory = n_blocks - on_disk;
        double bound = (double)in_memory * t_block + (double)on_disk * slot / disk_bw;
        bench_row *row = bench_row_new(SCEN, "stream_decode_step", t * 1e3, "ms");
        bench_row_str(row, "where", where_name[w]);
        bench_row_int(row, "times_device_tier", (int64_t)times);
        bench_row_int(row, "blocks", (int64_t)n_blocks);
        bench_row_int(row, "blocks_on_disk", (int64_t)on_disk);
        bench_row_num(row, "disk_mb_per_step", (double)on_disk * bb / 1e6);
        bench_row_num(row, "memory_mb_per_step", (double)in_memory * bb / 1e6);
        bench_row_num(row, "disk_gbs_raw", w == HOST ? 0 : disk_bw * 1e-9); /* not measured for host */
        bench_row_num(row, "bound_ms", bound * 1e3);
        bench_row_baseline(row, bound * 1e3, bound / t);
        bench_row_target(row, 1, 1, 0.8);
        bench_row_note(row, "baseline: bound = blocks in memory x resident time per block + disk bytes / raw "
                            "O_DIRECT read bandwidth, same run");
        bench_emit(ctx, row);
        bench_info(ctx, "attention --stream: %s, %llux the device tier: %.2f ms a step, bound %.2f ms", where_name[w],
                   (unsigned long long)times, t * 1e3, bound * 1e3);
        BENCH_CHECK(kvh_seq_free(e, s));
        BENCH_CHECK(kvh_engine_close(e));
        if (bench_remove_tree(store) != 0)
            rc = 1;
    }
    unlink(raw);
    free(q);
    free(out);
    return rc;
}

static const char usage_text[] = "Streamed decode (kvh_attention_decode with stream_chunk_blocks set) over one\n"
                                 "sequence --times x the device tier, its blocks in the host tier, on disk, or\n"
                                 "half and half, against the hardware's bound measured in this run: blocks in\n"
                                 "memory at the resident speed of the same call, plus disk bytes at the raw\n"
                                 "O_DIRECT read bandwidth (io_uring, queue depth 32, in --dir). Target bound /\n"
                                 "time >= 0.8. f16 KV, block 16, one layer.\n";

int bench_attention_stream(int argc, char **argv, const bench_ctx *ctx)
{
    stream_opts o = {
        .times = {.n = 2, .v = {8, 64}},
        .device_blocks = 64,
        .chunk_blocks = 16,
        .window_blocks = 48,
        .kv_heads = 8,
        .q_heads = 32,
        .dim = 128,
        .threads = 0,
    };
    const char *dir_opt = NULL; /* --dir */
    if (ctx->quick) {
        o.times = (bench_list){.n = 1, .v = {8}};
        o.device_blocks = 32;
        o.chunk_blocks = 8;
        o.window_blocks = 24;
    }
    const bench_opt opts[] = {
        {"--times", BENCH_OPT_LIST, &o.times, "sequence lengths, in device tiers"},
        {"--device-blocks", BENCH_OPT_U64, &o.device_blocks, "device tier, in blocks of 16 tokens"},
        {"--chunk-blocks", BENCH_OPT_U64, &o.chunk_blocks, "stream_chunk_blocks"},
        {"--window-blocks", BENCH_OPT_U64, &o.window_blocks, "stream_window_blocks"},
        {"--kv-heads", BENCH_OPT_U64, &o.kv_heads, "KV heads"},
        {"--q-heads", BENCH_OPT_U64, &o.q_heads, "query heads (a multiple of --kv-heads)"},
        {"--dim", BENCH_OPT_U64, &o.dim, "head_dim"},
        {"--threads", BENCH_OPT_U64, &o.threads, "attention threads (0 = all CPUs)"},
        {"--dir", BENCH_OPT_STR, &dir_opt,
         "directory on the drive to measure, where a scratch directory of its own is made and removed "
         "(default $KVH_BENCH_DIR, else the current directory)"},
        {NULL, BENCH_OPT_U64, NULL, NULL},
    };
    int prc = bench_parse(argc, argv, opts, SCEN " --stream", usage_text);
    if (prc)
        return bench_parse_rc(prc);
    const char *dir = dir_opt ? dir_opt : getenv("KVH_BENCH_DIR") ? getenv("KVH_BENCH_DIR") : ".";
    /* What gave the directory, for the messages about it. */
    const char *dir_name = dir_opt                   ? "--dir"
                           : getenv("KVH_BENCH_DIR") ? "$KVH_BENCH_DIR"
                                                     : "the current directory (neither --dir nor $KVH_BENCH_DIR set)";
    /* Empty, the files would go to the root directory; cut short, to
     * another directory than the one named. */
    if (!*dir || strlen(dir) >= sizeof(o.dir)) {
        fprintf(stderr, "kvh-bench attention --stream: %s is %s\n", dir_name,
                *dir ? "longer than 511 bytes" : "empty (its files would go to the root directory)");
        return 2;
    }
    if (snprintf(o.dir, sizeof(o.dir), "%s/kvh-bench-stream-XXXXXX", dir) >= (int)sizeof(o.dir)) {
        fprintf(stderr, "kvh-bench attention --stream: %s is longer than 480 bytes\n", dir_name);
        return 2;
    }
    /* Heads, threads and the stream's chunk and window become 32-bit
     * values; the sequence, --times x --device-blocks blocks of 16 tokens,
     * must stay under the 2^31 tokens attention takes. */
    if (bench_check_u64(SCEN " --stream", "--kv-heads", o.kv_heads, 1, 1024) ||
        bench_check_u64(SCEN " --stream", "--q-heads", o.q_heads, 1, KVHI_ATTN_MAX_Q_HEADS) ||
        bench_check_u64(SCEN " --stream", "--threads", o.threads, 0, 1024) ||
        bench_check_u64(SCEN " --stream", "--chunk-blocks", o.chunk_blocks, 1, UINT32_MAX) ||
        bench_check_u64(SCEN " --stream", "--window-blocks", o.window_blocks, 1, UINT32_MAX) ||
        bench_check_u64(SCEN " --stream", "--device-blocks", o.device_blocks, 2, STREAM_MAX_BLOCKS) ||
        bench_check_list(SCEN " --stream", "--times", &o.times, 0, STREAM_MAX_BLOCKS, 0))
        return 2;
    for (size_t i = 0; i < o.times.n; i++)
        if ((o.times.v[i] ? o.times.v[i] : 1) * o.device_blocks > STREAM_MAX_BLOCKS) {
            fprintf(stderr,
                    "kvh-bench attention --stream: --times %llu x --device-blocks %llu is more than %llu blocks\n",
                    (unsigned long long)o.times.v[i], (unsigned long long)o.device_blocks, STREAM_MAX_BLOCKS);
            return 2;
        }
    if (bench_check_u64(SCEN " --stream", "--dim", o.dim, 1, 1024))
        return 2;
    if (o.window_blocks < o.chunk_blocks || o.window_blocks >= o.device_blocks) {
        fprintf(stderr,
                "kvh-bench attention --stream: --window-blocks must be at least --chunk-blocks (%llu) and below "
                "--device-blocks (%llu), got %llu\n",
                (unsigned long long)o.chunk_blocks, (unsigned long long)o.device_blocks,
                (unsigned long long)o.window_blocks);
        return 2;
    }
    if (o.q_heads % o.kv_heads) {
        fprintf(stderr, "kvh-bench attention --stream: --q-heads must be a multiple of --kv-heads, got %llu and %llu\n",
                (unsigned long long)o.q_heads, (unsigned long long)o.kv_heads);
        return 2;
    }
    /* A new directory of its own under that directory: the files it
     * writes by fixed names (a store, a raw file) could be the user's. */
    char why[600];
    int scratch = bench_scratch_dir_make(dir, "kvh-bench-stream", o.dir, sizeof(o.dir), why, sizeof(why));
    if (scratch < -1) {
        fprintf(stderr, "kvh-bench attention --stream: %s: %s\n", dir_name, why);
        /* A wrong --dir or $KVH_BENCH_DIR is a usage error; the current
         * directory, which no one named, is not. */
        return scratch == BENCH_DIR_UNFIT && (dir_opt || getenv("KVH_BENCH_DIR")) ? 2 : 1;
    }
    int reps = ctx->reps ? ctx->reps : 5;
    int rc = 0;
    for (size_t i = 0; i < o.times.n && !rc; i++)
        rc = run_size(&o, ctx, o.times.v[i] ? o.times.v[i] : 1, reps);
    if (bench_scratch_dir_remove(o.dir, scratch) != 0)
        fprintf(stderr, "kvh-bench attention --stream: could not remove %s\n", o.dir);
    return rc;
}
