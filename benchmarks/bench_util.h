/* kvh-bench helpers: timing, statistics, result rows (JSON lines or a
 * table), option parsing and a small deterministic RNG.
 *
 * Every scenario is a function `int run(int argc, char **argv,
 * const bench_ctx *ctx)` that reports rows with bench_row_*() and returns
 * 0, or 1 on an error (a failed kvh call, a data mismatch). A missed
 * target is not an error unless --strict is given. */
#ifndef KVH_BENCH_UTIL_H
#define KVH_BENCH_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "kvh/kvh.h"

/* ---- common options, parsed by main before the scenario runs ---- */
typedef struct bench_ctx {
    int json;   /* --json: one JSON object per line on stdout */
    int quick;  /* --quick: smaller sizes, for CI smoke runs */
    int strict; /* --strict: exit 3 when a target is missed */
    int reps;   /* --reps N: rounds per measurement (0 = scenario default) */
    int verbose;
    uint64_t seed;
} bench_ctx;

/* ---- memory ---- */
/* malloc and calloc that do not return NULL: out of memory, they say so on
 * stderr and end the program with status 1. */
void *bench_xmalloc(size_t size);
void *bench_xcalloc(size_t n, size_t size);

/* ---- time ---- */
uint64_t bench_ns(void); /* CLOCK_MONOTONIC, nanoseconds */
double bench_sec(void);  /* the same, seconds */

/* ---- statistics ---- */
double bench_median(const double *v, size_t n); /* n >= 1; v unchanged */
double bench_min(const double *v, size_t n);

/* ---- RNG (xoshiro256**), deterministic for a seed ---- */
typedef struct bench_rng {
    uint64_t s[4];
} bench_rng;
void bench_rng_seed(bench_rng *r, uint64_t seed);
uint64_t bench_rng_next(bench_rng *r);
uint64_t bench_rng_below(bench_rng *r, uint64_t n); /* [0, n) */
void bench_shuffle_u32(bench_rng *r, uint32_t *v, size_t n);
void bench_shuffle_u64(bench_rng *r, uint64_t *v, size_t n);

/* Raw O_DIRECT baseline through io_uring: n transfers of bs bytes at queue
 * depth qd on path (created and allocated), sequential or shuffled.
 * Seconds, or -1. */
double bench_raw_io(const char *path, uint64_t bs, uint32_t n, int write, int random, uint32_t qd, uint64_t seed);

/* ---- results ---- */
typedef struct bench_row bench_row;

/* A new row; it is printed (JSON) or kept for the table by bench_emit. */
bench_row *bench_row_new(const char *scenario, const char *metric, double value, const char *unit);
void bench_row_int(bench_row *r, const char *key, int64_t v);
void bench_row_num(bench_row *r, const char *key, double v);
void bench_row_str(bench_row *r, const char *key, const char *v);
/* Baseline measured in the same run; ratio is ours/baseline oriented so
 * that higher is better (the caller computes it). */
void bench_row_baseline(bench_row *r, double baseline, double ratio);
/* A target: "ratio >= 0.25" style; `on_ratio` selects ratio or value,
 * `higher` the direction. Records target + met. */
void bench_row_target(bench_row *r, int on_ratio, int higher, double bound);
/* Free-form note shown in the table and as "note" in JSON. */
void bench_row_note(bench_row *r, const char *note);
void bench_emit(const bench_ctx *ctx, bench_row *r);
/* Prints the table of rows emitted so far (non-JSON mode) and clears it. */
void bench_flush_table(const bench_ctx *ctx, const char *title);
/* Number of emitted rows whose target was missed. */
int bench_missed_targets(void);

/* Progress/diagnostic line on stderr (kept off stdout so --json output
 * stays one object per line). */
void bench_info(const bench_ctx *ctx, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- scenario options ---- */
enum bench_opt_type {
    BENCH_OPT_U64,  /* uint64_t; accepts K/M/G suffixes (powers of two) */
    BENCH_OPT_LIST, /* bench_list; comma-separated, same suffixes */
    BENCH_OPT_STR   /* const char *; the argument as given */
};

#define BENCH_LIST_MAX 16
typedef struct bench_list {
    size_t n;
    uint64_t v[BENCH_LIST_MAX];
} bench_list;

typedef struct bench_opt {
    const char *name; /* "--pool-mb" */
    enum bench_opt_type type;
    void *dst;
    const char *help;
} bench_opt;

/* Parses argv[0..argc) against opts (terminated by a {NULL} entry).
 * Returns 0, 1 when --help was asked (help printed), -1 on an error
 * (message printed). */
int bench_parse(int argc, char **argv, const bench_opt *opts, const char *scenario, const char *usage);
void bench_print_opts(const bench_opt *opts);
/* Range checks after bench_parse: 0 when every value is in [lo, hi] (and a
 * power of two with pow2), else -1 with a message naming the flag. */
int bench_check_u64(const char *scenario, const char *flag, uint64_t v, uint64_t lo, uint64_t hi);
int bench_check_list(const char *scenario, const char *flag, const bench_list *l, uint64_t lo, uint64_t hi, int pow2);

/* ---- kvh helpers ---- */
/* Reports a failed kvh call on stderr and returns 1 (so `return
 * bench_kvh_fail(...)` ends a scenario). */
int bench_kvh_fail(const char *what, kvh_status st);
#define BENCH_CHECK(call)                                                                                              \
    do {                                                                                                               \
        kvh_status bench_st_ = (call);                                                                                 \
        if (bench_st_ != KVH_OK)                                                                                       \
            return bench_kvh_fail(#call, bench_st_);                                                                   \
    } while (0)

/* Formats n bytes as "64K", "1M", "1G". */
const char *bench_fmt_bytes(uint64_t n, char *buf, size_t len);

/* Keeps the compiler from optimising a value away. */
void bench_sink(uint64_t v);

#endif
