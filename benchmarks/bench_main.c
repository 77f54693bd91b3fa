/* kvh-bench: one program, one scenario per source file.
 *
 *   kvh-bench SCENARIO [--json] [--quick] [--reps N] [--strict] [flags]
 *   kvh-bench all [--json] [--quick]
 *   kvh-bench --help | SCENARIO --help
 */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_fs.h"
#include "bench_scenarios.h"
#include "bench_util.h"

static const struct {
    const char *name;
    const char *summary;
    bench_scenario_fn run;
} scenarios[] = {
    {"alloc", "block alloc/free vs a mutex free list, fork, prefix match, LRU-K touches", bench_alloc},
    {"migrate", "device<->host block copies (kvh_migrate, kvh_seq_migrate) vs memcpy", bench_migrate},
    {"disk", "spill/restore through the disk tier vs raw io_uring O_DIRECT; store recovery time", bench_disk},
    {"attention", "CPU paged decode vs contiguous and vs memory read bandwidth", bench_attention},
    {"trace", "eviction policies (lru, lru-k, hysteresis, lctru, the engine) vs Belady's MIN", bench_trace},
    {"scale", "cost per operation vs block count (10^3..10^7) and throughput vs threads", bench_scale},
    {"switch", "weight-context switch (135M model) vs reloading it from its file; first layer vs full", bench_switch},
    {"vmap", "virtual contiguity: view map/refresh/release cost, decode over views vs paged", bench_vmap},
    {"codec", "KV codecs: encode/decode GB/s of raw bytes vs memcpy of them", bench_codec},
    {"checksum", "CRC32C of a block (disk tier writes and reads) vs ISA-L's crc32_iscsi", bench_checksum},
#ifndef KVH_BENCH_NO_REMOTE /* a libkvh built without hiredis's headers */
    {"remote", "remote tier (loopback Redis): put/get MB/s vs raw pipelined hiredis, 32k-token lookup", bench_remote},
#endif
};
#define N_SCENARIOS (sizeof(scenarios) / sizeof(scenarios[0]))

static void usage(FILE *f)
{
    fprintf(f, "usage: kvh-bench SCENARIO [--json] [--quick] [--reps N] [--strict] [--seed N] [scenario flags]\n"
               "       kvh-bench all [--json] [--quick]     run every scenario with its defaults\n"
               "       kvh-bench SCENARIO --help            the scenario's flags\n"
               "\n"
               "scenarios:\n");
    for (size_t i = 0; i < N_SCENARIOS; i++)
        fprintf(f, "  %-10s %s\n", scenarios[i].name, scenarios[i].summary);
    fprintf(f, "\n"
               "common flags:\n"
               "  --json      one JSON object per line: scenario, metric, value, unit, the\n"
               "              varying parameters, and baseline + ratio (ours/baseline, higher\n"
               "              is better) where a baseline runs in the same process\n"
               "  --quick     smaller sizes (CI smoke): seconds per scenario; trace, whose\n"
               "              engine replays spill to disk, takes up to a minute\n"
               "  --reps N    rounds per measurement (median is reported)\n"
               "  --strict    exit with status 3 when a target is missed\n"
               "  --seed N    RNG seed (default 1)\n"
               "  --verbose   progress on stderr even with --json\n"
               "\n"
               "Without --json a table is printed. Progress goes to stderr.\n"
               "Exit status: 0 ok, 1 a kvh call failed or data did not verify, 2 usage,\n"
               "3 a target was missed (--strict only).\n");
}

static int run_main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(argv[1], "list")) {
        for (size_t i = 0; i < N_SCENARIOS; i++)
            printf("%s\n", scenarios[i].name);
        return 0;
    }
    bench_ctx ctx = {.seed = 1};
    int rc = 0;
    /* Strip the common flags; the rest goes to the scenario. */
    char **rest = bench_xcalloc((size_t)argc, sizeof(char *));
    int nrest = 0;
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--json"))
            ctx.json = 1;
        else if (!strcmp(argv[i], "--quick"))
            ctx.quick = 1;
        else if (!strcmp(argv[i], "--strict"))
            ctx.strict = 1;
        else if (!strcmp(argv[i], "--verbose"))
            ctx.verbose = 1;
        else if (!strcmp(argv[i], "--reps") || !strcmp(argv[i], "--seed")) {
            if (i + 1 >= argc) {
                fprintf(stderr, "kvh-bench: %s needs a value\n", argv[i]);
                rc = 2;
                goto out;
            }
            /* Decimal digits only, as the scenarios' numbers: no sign, no
             * blanks, and "010" is ten. */
            char *end;
            errno = 0;
            unsigned long long v = strtoull(argv[i + 1], &end, 10);
            if (*end || !isdigit((unsigned char)argv[i + 1][0]) || errno ||
                (!strcmp(argv[i], "--reps") && (v < 1 || v > 1000))) {
                fprintf(stderr, "kvh-bench: bad value '%s' for %s\n", argv[i + 1], argv[i]);
                rc = 2;
                goto out;
            }
            if (!strcmp(argv[i], "--reps"))
                ctx.reps = (int)v;
            else
                ctx.seed = v;
            i++;
        } else
            rest[nrest++] = argv[i];
    }

    if (!strcmp(argv[1], "all")) {
        for (int i = 0; i < nrest; i++)
            if (!strcmp(rest[i], "--help") || !strcmp(rest[i], "-h")) {
                usage(stdout);
                rc = BENCH_HELP;
                goto out;
            }
        if (nrest) {
            fprintf(stderr, "kvh-bench all: scenario flags are not accepted with 'all': '%s'\n", rest[0]);
            rc = 2;
            goto out;
        }
        for (size_t i = 0; i < N_SCENARIOS && rc == 0; i++) {
            int r = scenarios[i].run(0, rest, &ctx);
            bench_flush_table(&ctx, scenarios[i].name);
            if (r)
                rc = r;
        }
    } else {
        size_t i = 0;
        while (i < N_SCENARIOS && strcmp(scenarios[i].name, argv[1]))
            i++;
        if (i == N_SCENARIOS) {
            fprintf(stderr, "kvh-bench: unknown scenario '%s'\n\n", argv[1]);
            usage(stderr);
            rc = 2;
            goto out;
        }
        rc = scenarios[i].run(nrest, rest, &ctx);
        bench_flush_table(&ctx, scenarios[i].name);
    }
out:
    free(rest);
    if (rc == BENCH_HELP)
        return 0;
    if (rc)
        return rc;
    if (bench_missed_targets()) {
        fprintf(stderr, "kvh-bench: %d target(s) missed\n", bench_missed_targets());
        if (ctx.strict)
            return 3;
    }
    return 0;
}

int main(int argc, char **argv)
{
    bench_scratch_on_signals();
    int rc = run_main(argc, argv);
    /* Results that never reached stdout (a full disk, a closed pipe read
     * to the end) must not look like a successful run. */
    errno = 0;
    if (fflush(stdout) != 0 || ferror(stdout)) {
        fprintf(stderr, "kvh-bench: write error on standard output%s%s\n", errno ? ": " : "",
                errno ? strerror(errno) : "");
        if (rc == 0)
            rc = 1;
    }
    return rc;
}
