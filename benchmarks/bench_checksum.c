/* Scenario `checksum`: CRC32C of one block, the check the disk tier runs on
 * every block it writes and every block it reads back (core/crc32c.h).
 *
 * For each block size and each implementation this CPU runs, GB/s over
 * blocks that are in cache ("hot": the same block again) and blocks that
 * are not ("cold": blocks of a region in turn, as a restore finds them
 * after the disk's DMA). The region is four times the last-level cache
 * (at least 512 MiB, at most a quarter of memory); cold rows are left out
 * when --region-mb names less than that. The baseline is Intel ISA-L's crc32_iscsi
 * (the same checksum, its fastest code for this CPU) when kvh-bench was
 * built with it (libisal-dev), else memcpy of the same bytes. In every
 * round each implementation follows a baseline run of its own; the ratio
 * is the median of the rounds' ratios. Every value is checked against the
 * baseline's (ISA-L) or the table's.
 *
 * The crc32c_copy rows time the form that copies as it checksums (a
 * restore from disk into the host tier, a remote value into a block)
 * against memcpy followed by the baseline's checksum of the copy. */
#include <stdbool.h>
#include <stdio.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>

#include "bench_scenarios.h"
#include "../core/crc32c.h"

#ifdef KVH_BENCH_HAVE_ISAL
#include <isa-l/crc.h>
#endif

#define SCEN "checksum"

static const char *baseline_name(void)
{
#ifdef KVH_BENCH_HAVE_ISAL
    return "ISA-L crc32_iscsi";
#else
    return "memcpy of the same bytes (kvh-bench built without libisal-dev)";
#endif
}

/* One pass of the baseline over n bytes at p; its CRC32C, or 0 for memcpy. */
static uint32_t baseline_pass(const uint8_t *p, uint8_t *scratch, size_t n)
{
#ifdef KVH_BENCH_HAVE_ISAL
    (void)scratch;
    /* ISA-L takes and returns the register: inverted in and out. */
    return ~crc32_iscsi((unsigned char *)p, (int)n, ~0u);
#else
    memcpy(scratch, p, n);
    return 0;
#endif
}

static uint32_t baseline_copy_pass(const uint8_t *p, uint8_t *dst, size_t n)
{
    memcpy(dst, p, n);
#ifdef KVH_BENCH_HAVE_ISAL
    return ~crc32_iscsi(dst, (int)n, ~0u);
#else
    return 0;
#endif
}

static double rate(size_t bytes, uint64_t t0, uint64_t t1) { return (double)bytes / (double)(t1 - t0 ? t1 - t0 : 1); }

/* Checksums of blocks `count` blocks of `block` bytes from region, starting at
 * block first (wrapping); the time in ns, the checksums xor'd into *mix. */
static uint64_t timed(bool base, bool copy, const uint8_t *region, uint8_t *scratch, size_t block, size_t blocks,
                      size_t first, size_t count, uint32_t *mix)
{
    uint64_t t0 = bench_ns();
    uint32_t m = 0;
    for (size_t i = 0; i < count; i++) {
        const uint8_t *p = region + ((first + i) % blocks) * block;
        if (copy)
            m ^= base ? baseline_copy_pass(p, scratch, block) : kvhi_crc32c_copy(0, scratch, p, block);
        else
            m ^= base ? baseline_pass(p, scratch, block) : kvhi_crc32c(0, p, block);
    }
    uint64_t t1 = bench_ns();
    *mix ^= m;
    return t1 - t0;
}

static int run_size(const bench_ctx *ctx, size_t block, size_t region_bytes, int reps, const int *impls, int n_impls,
                    bool with_cold)
{
    size_t blocks = region_bytes / block;
    uint8_t *region = bench_xmalloc(region_bytes), *scratch = bench_xmalloc(block);
    bench_rng r;
    bench_rng_seed(&r, ctx->seed);
    for (size_t i = 0; i < region_bytes; i += 8) {
        uint64_t v = bench_rng_next(&r);
        memcpy(region + i, &v, 8);
    }
    /* Each implementation's value against the baseline's or the table's. */
    kvhi_crc32c_set_impl(KVHI_CRC32C_TABLE);
    for (size_t b = 0; b < blocks && b < 8; b++) {
        uint32_t want = kvhi_crc32c(0, region + b * block, block);
#ifdef KVH_BENCH_HAVE_ISAL
        if (baseline_pass(region + b * block, scratch, block) != want) {
            fprintf(stderr, "kvh-bench checksum: ISA-L and kvh disagree on a %zu-byte block\n", block);
            return 1;
        }
#endif
        for (int s = 0; s < n_impls; s++) {
            kvhi_crc32c_set_impl(impls[s]);
            if (kvhi_crc32c(0, region + b * block, block) != want) {
                fprintf(stderr, "kvh-bench checksum: %s gives a wrong CRC32C\n", kvhi_crc32c_impl_name(impls[s]));
                return 1;
            }
        }
    }
    /* Enough blocks a round that a hot round takes about a millisecond. */
    size_t per_round = (1u << 22) / block + 8, cold_at = 0;
    double *v = bench_xmalloc(sizeof(double) * (size_t)reps * (size_t)n_impls * 6);
    uint32_t mix = 0;
    for (int pass = 0; pass < 4; pass++) {
        int cold = pass & 1, copy = pass >> 1;
        if (cold && !with_cold)
            continue;
        double *val = v, *base = v + (size_t)reps * n_impls, *ratio = v + 2 * (size_t)reps * n_impls;
        for (int k = -1; k < reps; k++) /* round -1 warms up */
            for (int j = 0; j < n_impls; j++) {
                int s = k % 2 ? n_impls - 1 - j : j;
                kvhi_crc32c_set_impl(impls[s]);
                /* cold: the baseline and kvh each on blocks not touched since
                 * the region was last walked; hot: block 0 again and again. */
                size_t first_b = cold ? cold_at : 0, first_k = cold ? cold_at + per_round : 0;
                if (cold)
                    cold_at = (cold_at + 2 * per_round) % blocks;
                size_t n = per_round;
                uint64_t tb = timed(true, copy, region, scratch, block, cold ? blocks : 1, first_b, n, &mix);
                uint64_t tk = timed(false, copy, region, scratch, block, cold ? blocks : 1, first_k, n, &mix);
                if (k >= 0) {
                    size_t i = (size_t)s * (size_t)reps + (size_t)k;
                    base[i] = rate(n * block, 0, tb);
                    val[i] = rate(n * block, 0, tk);
                    ratio[i] = val[i] / base[i];
                }
            }
        for (int s = 0; s < n_impls; s++) {
            size_t at = (size_t)s * (size_t)reps;
            bench_row *row =
                bench_row_new(SCEN, copy ? "crc32c_copy" : "crc32c", bench_median(val + at, (size_t)reps), "GB/s");
            bench_row_str(row, "impl", kvhi_crc32c_impl_name(impls[s]));
            bench_row_int(row, "block_bytes", (int64_t)block);
            bench_row_str(row, "cache", cold ? "cold" : "hot");
            bench_row_baseline(row, bench_median(base + at, (size_t)reps), bench_median(ratio + at, (size_t)reps));
            char note[160];
            snprintf(note, sizeof(note), "GB/s checksummed; baseline: %s%s; ratio: median of per-round ratios",
                     copy ? "memcpy, then " : "", baseline_name());
            bench_row_note(row, note);
            bench_emit(ctx, row);
        }
    }
    kvhi_crc32c_set_impl(KVHI_CRC32C_AUTO);
    bench_sink((uint8_t)mix);
    free(v);
    free(region);
    free(scratch);
    return 0;
}

/* Bytes of the largest cache: a region four times it is walked cold. */
static uint64_t last_level_cache(void)
{
    long v = sysconf(_SC_LEVEL3_CACHE_SIZE);
    if (v <= 0)
        v = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return v > 0 ? (uint64_t)v : 32ull << 20;
}

int bench_checksum(int argc, char **argv, const bench_ctx *ctx)
{
    uint64_t cold_min_mb = (4 * last_level_cache() + (1u << 20) - 1) >> 20;
    uint64_t mem_mb = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE) >> 20;
    uint64_t region_mb = ctx->quick ? 64 : cold_min_mb > 512 ? cold_min_mb : 512;
    if (!ctx->quick && mem_mb && region_mb > mem_mb / 4)
        region_mb = mem_mb / 4;
    const bench_opt opts[] = {
        {"--region-mb", BENCH_OPT_U64, &region_mb,
         "MiB walked for the cold rows (4x the last-level cache, at least 512; --quick 64, no cold rows)"},
        {NULL, BENCH_OPT_U64, NULL, NULL},
    };
    int prc = bench_parse(argc, argv, opts, SCEN, "kvh-bench checksum [--region-mb N]");
    if (prc)
        return bench_parse_rc(prc);
    if (region_mb < 4 || region_mb > 65536) {
        fprintf(stderr, "kvh-bench checksum: --region-mb must be in 4..65536\n");
        return 2;
    }
    int impls[KVHI_CRC32C_FOLD], n_impls = 0;
    for (int impl = KVHI_CRC32C_TABLE; impl <= KVHI_CRC32C_FOLD; impl++)
        if (kvhi_crc32c_supported(impl))
            impls[n_impls++] = impl;
    int reps = ctx->reps ? ctx->reps : ctx->quick ? 3 : 11;
    static const size_t sizes[] = {65536, 262144, 1048576};
    /* Cold: the region must outgrow the cache, and hold a round's blocks
     * for the baseline and kvh apart (4 MiB + 8 blocks each). */
    bool cold = region_mb >= cold_min_mb && region_mb >= 4 * (4 + 8);
    if (!cold)
        bench_info(ctx, "checksum: no cold rows: a %llu MiB region is under 4x the last-level cache (%llu MiB)",
                   (unsigned long long)region_mb, (unsigned long long)cold_min_mb);
    for (int i = 0; i < 3; i++) {
        int rc = run_size(ctx, sizes[i], (size_t)region_mb << 20, reps, impls, n_impls, cold);
        if (rc)
            return rc;
    }
    bench_flush_table(ctx, "CRC32C of a block");
    return 0;
}
