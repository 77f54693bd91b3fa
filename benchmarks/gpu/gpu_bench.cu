/* GPU measurements for benchmarks/gpu/run.sh, through kvh's public API
 * (libkvh.so + the CUDA backend it loads) and the CUDA runtime for
 * events, streams and the baselines.
 *
 *   1. decode attention, batch 32 x 8K context (Llama-3-8B layer: 8 KV
 *      heads, 32 query heads, head_dim 128, f16 KV and q/out, 16-token
 *      blocks: 1 GiB of K+V per call), timed with CUDA events:
 *        - "gpu": the calls queued behind a spin kernel, so the events see
 *          GPU time only (host planning overlaps the spin);
 *        - "pipelined": calls queued back to back, host cost included;
 *      reported as GB/s of K+V read, against the device's D2D copy
 *      throughput (cudaMemcpyAsync, counted read + write) measured here.
 *   2. device <-> host migration of all those blocks with kvh_seq_migrate
 *      (fences waited), against cudaMemcpyAsync between device memory and
 *      page-locked host memory of the same total size, as one copy and as
 *      one copy per block.
 *   3. a check that decode after the device -> host -> device round trip
 *      gives bit-identical output.
 *   4. a weight-context switch between two 512 MiB models (device room for
 *      one, host room for the other), against reloading a model from
 *      scratch: open, pread into a pinned buffer in 8 MiB pieces,
 *      cudaMemcpy each into a fresh cudaMalloc (page cache warm); and the
 *      first layer ready against the full switch.
 *
 * Prints a table; with OUT set, also writes $OUT/gpu_bench.jsonl (one
 * JSON object per line, kvh-bench style). Exit status 0, or 1 on a failed
 * call or mismatch. */
#include <cuda_fp16.h>
#include <fcntl.h>
#include <unistd.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvh/kvh.h"

#define CK(call)                                                                                                       \
    do {                                                                                                               \
        cudaError_t e_ = (call);                                                                                       \
        if (e_ != cudaSuccess) {                                                                                       \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));                     \
            exit(1);                                                                                                   \
        }                                                                                                              \
    } while (0)
#define KV(call)                                                                                                       \
    do {                                                                                                               \
        kvh_status s_ = (call);                                                                                        \
        if (s_ != KVH_OK) {                                                                                            \
            fprintf(stderr, "%s:%d: %s: %s: %s\n", __FILE__, __LINE__, #call, kvh_status_name(s_), kvh_last_error());  \
            exit(1);                                                                                                   \
        }                                                                                                              \
    } while (0)

static FILE *jsonl;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void row(const char *metric, double value, const char *unit, const char *extra, double baseline)
{
    if (baseline > 0)
        printf("  %-34s %10.2f %-5s  baseline %10.2f  ratio %.3f  %s\n", metric, value, unit, baseline,
               value / baseline, extra);
    else
        printf("  %-34s %10.2f %-5s  %s\n", metric, value, unit, extra);
    if (jsonl) {
        fprintf(jsonl, "{\"scenario\": \"gpu\", \"metric\": \"%s\", \"value\": %.6g, \"unit\": \"%s\"%s%s", metric,
                value, unit, extra[0] ? ", " : "", extra);
        if (baseline > 0)
            fprintf(jsonl, ", \"baseline\": %.6g, \"ratio\": %.4f", baseline, value / baseline);
        fprintf(jsonl, "}\n");
        fflush(jsonl);
    }
}

__global__ void fill_kernel(__half *p, size_t n, uint64_t seed)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint64_t z = (i + seed) * 0x9e3779b97f4a7c15ull;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z ^= z >> 31;
        p[i] = __float2half_rn((float)((int)(z % 255) - 127) / 128.0f);
    }
}

__global__ void spin_kernel(long long cycles)
{
    long long t0 = clock64();
    while (clock64() - t0 < cycles)
        ;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Reload from scratch, the way a process gets a model onto the GPU. */
static double reload_to_device(const char *path, uint64_t bytes)
{
    const uint64_t piece = 8ull << 20;
    double t0 = now_s();
    int fd = open(path, O_RDONLY);
    void *pinned, *dev;
    CK(cudaMallocHost(&pinned, piece));
    CK(cudaMalloc(&dev, bytes));
    for (uint64_t off = 0; off < bytes; off += piece) {
        uint64_t n = bytes - off < piece ? bytes - off : piece;
        if (pread(fd, pinned, n, (off_t)off) != (ssize_t)n) {
            fprintf(stderr, "reload: short read\n");
            exit(1);
        }
        CK(cudaMemcpy((char *)dev + off, pinned, n, cudaMemcpyHostToDevice));
    }
    close(fd);
    double t = now_s() - t0;
    CK(cudaFreeHost(pinned));
    CK(cudaFree(dev));
    return t;
}

/* Section 4: weight-context switch against a reload. */
static void bench_switch(void)
{
    const uint64_t bytes = 512ull << 20;
    const uint32_t layers = 32, reps = 5;
    char path[] = "/tmp/kvh-gpu-weights-XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) {
        fprintf(stderr, "switch: cannot create a weight file\n");
        exit(1);
    }
    char *buf = (char *)malloc(1 << 20);
    for (uint64_t off = 0; off < bytes; off += 1 << 20) {
        for (int i = 0; i < (1 << 20); i++)
            buf[i] = (char)((off >> 20) * 31 + (uint64_t)i * 7);
        if (write(fd, buf, 1 << 20) != (1 << 20))
            exit(1);
    }
    free(buf);
    close(fd);
    kvh_config c;
    KV(kvh_config_init(&c, sizeof(c)));
    c.backend = KVH_BACKEND_CUDA;
    c.num_layers = 32;
    c.num_kv_heads = 8;
    c.head_dim = 128;
    c.block_tokens = 16;
    c.dtype = KVH_DTYPE_F16;
    const uint64_t bb = 2ull * 32 * 8 * 128 * 16 * 2;
    c.device_bytes = bytes + (layers + 16) * bb; /* one model, never both */
    c.host_bytes = bytes + (layers + 16) * bb;
    kvh_engine *e;
    KV(kvh_engine_open(&c, &e));
    kvh_context m[2], none = {0};
    for (int k = 0; k < 2; k++) {
        kvh_context_params cp;
        KV(kvh_context_params_init(&cp, sizeof(cp)));
        KV(kvh_context_create(e, &cp, &m[k]));
        for (uint32_t l = 0; l < layers; l++) {
            kvh_weight_region_params rp;
            KV(kvh_weight_region_params_init(&rp, sizeof(rp)));
            rp.layer = l;
            rp.path = path;
            rp.file_offset = (uint64_t)l * (bytes / layers);
            rp.size = bytes / layers;
            uint32_t idx;
            KV(kvh_context_add_region(e, m[k], &rp, &idx));
        }
    }
    KV(kvh_context_switch(e, none, m[1], NULL)); /* warm: both loaded once */
    KV(kvh_context_switch(e, m[1], m[0], NULL));
    double full[reps], first[reps], reload[reps];
    for (uint32_t i = 0; i < reps; i++) {
        kvh_fence f;
        double t0 = now_s();
        KV(kvh_context_switch(e, m[i % 2], m[1 - i % 2], &f));
        KV(kvh_context_wait_layer(e, m[1 - i % 2], 0, UINT64_MAX));
        first[i] = now_s() - t0;
        KV(kvh_fence_wait(e, f, UINT64_MAX));
        full[i] = now_s() - t0;
        KV(kvh_fence_free(e, f));
    }
    kvh_weight_stats ws;
    memset(&ws, 0, sizeof(ws));
    ws.struct_size = sizeof(ws);
    KV(kvh_weight_stats_get(e, &ws));
    KV(kvh_context_destroy(e, m[0]));
    KV(kvh_context_destroy(e, m[1]));
    KV(kvh_engine_close(e));
    reload_to_device(path, bytes); /* warm the page cache */
    for (uint32_t i = 0; i < reps; i++)
        reload[i] = reload_to_device(path, bytes);
    unlink(path);
    qsort(full, reps, sizeof(double), cmp_double);
    qsort(first, reps, sizeof(double), cmp_double);
    qsort(reload, reps, sizeof(double), cmp_double);
    printf("\nweight-context switch, 2 x %llu MiB in %u layers (unified memory: %u)\n",
           (unsigned long long)(bytes >> 20), layers, ws.unified_memory);
    char extra[256];
    snprintf(extra, sizeof(extra), "\"read_source_mib\": %llu, \"h2d_mib\": %llu, \"d2h_mib\": %llu",
             (unsigned long long)(ws.bytes_read_source >> 20), (unsigned long long)(ws.bytes_host_to_device >> 20),
             (unsigned long long)(ws.bytes_device_to_host >> 20));
    /* value / baseline: switch over reload; target <= 0.5 */
    row("switch_ms_vs_reload", full[reps / 2] * 1e3, "ms", extra, reload[reps / 2] * 1e3);
    row("first_layer_ms_vs_switch", first[reps / 2] * 1e3, "ms", "", full[reps / 2] * 1e3);
}

int main(int argc, char **argv)
{
    const uint32_t B = 32, T = 8192, Hkv = 8, Hq = 32, D = 128, BT = 16, ITERS = 20;
    const char *out_dir = getenv("OUT");
    if (out_dir && *out_dir) {
        char path[4096];
        snprintf(path, sizeof(path), "%s/gpu_bench.jsonl", out_dir);
        jsonl = fopen(path, "w");
    }
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s, %d SMs, %.1f GiB\n", prop.name, prop.multiProcessorCount,
           (double)prop.totalGlobalMem / (1 << 30));

    const uint64_t block_bytes = 2ull * Hkv * BT * D * 2; /* one layer */
    const uint64_t n_blocks = (uint64_t)B * T / BT;
    const double kv_bytes = (double)n_blocks * block_bytes;
    kvh_config c;
    KV(kvh_config_init(&c, sizeof(c)));
    c.backend = KVH_BACKEND_CUDA;
    c.num_layers = 1;
    c.num_kv_heads = Hkv;
    c.head_dim = D;
    c.block_tokens = BT;
    c.dtype = KVH_DTYPE_F16;
    c.device_bytes = (n_blocks + 64) * block_bytes;
    c.host_bytes = (n_blocks + 64) * block_bytes;
    c.migration_threads = 4;
    kvh_engine *e;
    double t0 = now_s();
    KV(kvh_engine_open(&c, &e));
    printf("engine: backend %s, %.2f GiB device + host tiers, open %.2f s\n", kvh_engine_backend(e),
           (double)c.device_bytes / (1 << 30), now_s() - t0);

    /* Sequences, then random K/V written straight into the device tier
     * (attention reads whatever the slots hold). */
    kvh_seq seqs[32];
    int32_t *tok = (int32_t *)malloc(sizeof(int32_t) * T);
    for (uint32_t b = 0; b < B; b++) {
        for (uint32_t t = 0; t < T; t++)
            tok[t] = (int32_t)(b * T + t);
        KV(kvh_seq_create(e, 0, &seqs[b]));
        KV(kvh_seq_append(e, seqs[b], tok, T));
    }
    free(tok);
    kvh_tier_info ti;
    memset(&ti, 0, sizeof(ti));
    ti.struct_size = sizeof(ti);
    KV(kvh_tier_info_get(e, KVH_TIER_DEVICE, &ti));
    size_t tier_elems = ti.capacity_blocks * ti.block_bytes / 2;
    fill_kernel<<<prop.multiProcessorCount * 8, 256>>>((__half *)ti.base, tier_elems, 42);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());

    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    size_t qn = (size_t)B * Hq * D;
    __half *dq, *dout;
    CK(cudaMalloc(&dq, qn * 2));
    CK(cudaMalloc(&dout, qn * 2));
    fill_kernel<<<64, 256>>>(dq, qn, 7);
    CK(cudaDeviceSynchronize());
    kvh_attention_params pr;
    KV(kvh_attention_params_init(&pr, sizeof(pr)));
    pr.num_q_heads = Hq;
    pr.io_dtype = KVH_DTYPE_F16;
    pr.stream = st;

    /* warm-up: grows the workspace pool to ITERS calls in flight */
    for (uint32_t i = 0; i < ITERS; i++)
        KV(kvh_attention_decode(e, 0, seqs, B, dq, dout, &pr));
    CK(cudaStreamSynchronize(st));

    cudaEvent_t ev0, ev1;
    CK(cudaEventCreate(&ev0));
    CK(cudaEventCreate(&ev1));
    /* GPU time: the calls wait behind a ~50 ms spin while the host queues them */
    int khz = 0;
    CK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
    spin_kernel<<<1, 1, 0, st>>>((long long)khz * 50); /* kHz x 50 ms */
    CK(cudaEventRecord(ev0, st));
    double h0 = now_s();
    for (uint32_t i = 0; i < ITERS; i++)
        KV(kvh_attention_decode(e, 0, seqs, B, dq, dout, &pr));
    double host_per_call = (now_s() - h0) / ITERS;
    CK(cudaEventRecord(ev1, st));
    CK(cudaEventSynchronize(ev1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, ev0, ev1));
    double gpu_s = ms * 1e-3 / ITERS;

    /* pipelined: back to back, host included */
    CK(cudaEventRecord(ev0, st));
    for (uint32_t i = 0; i < ITERS; i++)
        KV(kvh_attention_decode(e, 0, seqs, B, dq, dout, &pr));
    CK(cudaEventRecord(ev1, st));
    CK(cudaEventSynchronize(ev1));
    CK(cudaEventElapsedTime(&ms, ev0, ev1));
    double pipe_s = ms * 1e-3 / ITERS;

    /* baseline: D2D copy of the same bytes */
    void *a, *b2;
    size_t cb = (size_t)kv_bytes;
    CK(cudaMalloc(&a, cb));
    CK(cudaMalloc(&b2, cb));
    CK(cudaMemsetAsync(a, 1, cb, st));
    CK(cudaMemcpyAsync(b2, a, cb, cudaMemcpyDeviceToDevice, st));
    CK(cudaEventRecord(ev0, st));
    for (int i = 0; i < 5; i++)
        CK(cudaMemcpyAsync(b2, a, cb, cudaMemcpyDeviceToDevice, st));
    CK(cudaEventRecord(ev1, st));
    CK(cudaEventSynchronize(ev1));
    CK(cudaEventElapsedTime(&ms, ev0, ev1));
    double copy_gbs = 2.0 * cb / (ms * 1e-3 / 5) * 1e-9; /* read + write */
    CK(cudaFree(a));
    CK(cudaFree(b2));

    char extra[256];
    printf("\ndecode attention, batch %u x context %u, %u/%u heads, head_dim %u, f16, block %u: %.2f GiB K+V per "
           "call\n",
           B, T, Hq, Hkv, D, BT, kv_bytes / (1 << 30));
    snprintf(extra, sizeof(extra), "\"batch\": %u, \"context\": %u, \"block_tokens\": %u, \"dtype\": \"f16\"", B, T,
             BT);
    row("d2d_copy_read_plus_write", copy_gbs, "GB/s", "", 0);
    row("decode_gpu_time", gpu_s * 1e6, "us", extra, 0);
    row("decode_throughput_gpu", kv_bytes / gpu_s * 1e-9, "GB/s", extra, copy_gbs);
    row("decode_throughput_pipelined", kv_bytes / pipe_s * 1e-9, "GB/s", extra, copy_gbs);
    row("decode_host_enqueue_time", host_per_call * 1e6, "us", extra, 0);
    if (host_per_call * ITERS > 0.05)
        printf("  note: queueing %u calls took longer than the 50 ms spin; 'gpu' includes host time\n", ITERS);

    /* reference output for the round-trip check */
    __half *before = (__half *)malloc(qn * 2), *after = (__half *)malloc(qn * 2);
    CK(cudaMemcpyAsync(before, dout, qn * 2, cudaMemcpyDeviceToHost, st));
    CK(cudaStreamSynchronize(st));

    /* migration: every block device -> host -> device */
    double d2h = 0, h2d = 0;
    for (int dir = 0; dir < 2; dir++) {
        kvh_fence f[32];
        double s0 = now_s();
        for (uint32_t b = 0; b < B; b++)
            KV(kvh_seq_migrate(e, seqs[b], 0, T, dir == 0 ? KVH_TIER_HOST : KVH_TIER_DEVICE, &f[b]));
        for (uint32_t b = 0; b < B; b++) {
            KV(kvh_fence_wait(e, f[b], UINT64_MAX));
            KV(kvh_fence_free(e, f[b]));
        }
        (dir == 0 ? d2h : h2d) = kv_bytes / (now_s() - s0) * 1e-9;
    }
    /* baselines: pinned host buffer, one big copy and one copy per block */
    void *hp, *dp;
    CK(cudaMallocHost(&hp, cb));
    CK(cudaMalloc(&dp, cb));
    memset(hp, 1, cb);
    double big[2], per_block[2];
    for (int dir = 0; dir < 2; dir++) {
        cudaMemcpyKind k = dir == 0 ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
        void *dst = dir == 0 ? hp : dp, *src = dir == 0 ? dp : hp;
        CK(cudaMemcpyAsync(dst, src, cb, k, st)); /* warm */
        CK(cudaStreamSynchronize(st));
        double s0 = now_s();
        CK(cudaMemcpyAsync(dst, src, cb, k, st));
        CK(cudaStreamSynchronize(st));
        big[dir] = cb / (now_s() - s0) * 1e-9;
        s0 = now_s();
        for (uint64_t i = 0; i < n_blocks; i++)
            CK(cudaMemcpyAsync((char *)dst + i * block_bytes, (char *)src + i * block_bytes, block_bytes, k, st));
        CK(cudaStreamSynchronize(st));
        per_block[dir] = cb / (now_s() - s0) * 1e-9;
    }
    CK(cudaFreeHost(hp));
    CK(cudaFree(dp));
    printf("\nmigration of %llu blocks of %llu KiB (%.2f GiB), kvh_seq_migrate, 4 migration threads\n",
           (unsigned long long)n_blocks, (unsigned long long)block_bytes >> 10, kv_bytes / (1 << 30));
    snprintf(extra, sizeof(extra), "\"block_bytes\": %llu, \"direction\": \"d2h\"", (unsigned long long)block_bytes);
    row("migrate_d2h_vs_one_copy", d2h, "GB/s", extra, big[0]);
    row("migrate_d2h_vs_block_copies", d2h, "GB/s", extra, per_block[0]);
    snprintf(extra, sizeof(extra), "\"block_bytes\": %llu, \"direction\": \"h2d\"", (unsigned long long)block_bytes);
    row("migrate_h2d_vs_one_copy", h2d, "GB/s", extra, big[1]);
    row("migrate_h2d_vs_block_copies", h2d, "GB/s", extra, per_block[1]);

    /* the blocks came back (to other slots): same output, bit for bit */
    KV(kvh_attention_decode(e, 0, seqs, B, dq, dout, &pr));
    CK(cudaMemcpyAsync(after, dout, qn * 2, cudaMemcpyDeviceToHost, st));
    CK(cudaStreamSynchronize(st));
    int same = memcmp(before, after, qn * 2) == 0;
    printf("\nround trip: decode output after device->host->device %s\n", same ? "identical" : "DIFFERS");

    for (uint32_t b = 0; b < B; b++)
        KV(kvh_seq_free(e, seqs[b]));
    KV(kvh_engine_close(e));
    bench_switch();
    CK(cudaFree(dq));
    CK(cudaFree(dout));
    CK(cudaStreamDestroy(st));
    free(before);
    free(after);
    if (jsonl)
        fclose(jsonl);
    (void)argc, (void)argv;
    return same ? 0 : 1;
}
