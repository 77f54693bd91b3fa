#include "bench_util.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------ */
/* memory                                                               */
/* ------------------------------------------------------------------ */

static _Noreturn void out_of_memory(size_t n, size_t size)
{
    if (n == 1)
        fprintf(stderr, "kvh-bench: out of memory for %zu bytes\n", size);
    else
        fprintf(stderr, "kvh-bench: out of memory for %zu x %zu bytes\n", n, size);
    exit(1);
}

void *bench_xmalloc(size_t size)
{
    void *p = malloc(size);
    if (!p && size)
        out_of_memory(1, size);
    return p;
}

void *bench_xcalloc(size_t n, size_t size)
{
    void *p = calloc(n, size);
    if (!p && n && size)
        out_of_memory(n, size);
    return p;
}

/* ------------------------------------------------------------------ */
/* time and statistics                                                 */
/* ------------------------------------------------------------------ */

uint64_t bench_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

double bench_sec(void) { return (double)bench_ns() * 1e-9; }

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

double bench_median(const double *v, size_t n)
{
    if (n == 0)
        return NAN;
    double *c = bench_xmalloc(n * sizeof(double));
    memcpy(c, v, n * sizeof(double));
    qsort(c, n, sizeof(double), cmp_double);
    double m = n % 2 ? c[n / 2] : 0.5 * (c[n / 2 - 1] + c[n / 2]);
    free(c);
    return m;
}

double bench_min(const double *v, size_t n)
{
    double m = INFINITY;
    for (size_t i = 0; i < n; i++)
        if (v[i] < m)
            m = v[i];
    return m;
}

/* ------------------------------------------------------------------ */
/* RNG                                                                  */
/* ------------------------------------------------------------------ */

static uint64_t splitmix(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void bench_rng_seed(bench_rng *r, uint64_t seed)
{
    for (int i = 0; i < 4; i++)
        r->s[i] = splitmix(&seed);
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t bench_rng_next(bench_rng *r)
{
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

uint64_t bench_rng_below(bench_rng *r, uint64_t n)
{
    /* Multiply-shift; the bias is irrelevant at benchmark sizes. */
    return (uint64_t)(((unsigned __int128)bench_rng_next(r) * n) >> 64);
}

void bench_shuffle_u32(bench_rng *r, uint32_t *v, size_t n)
{
    for (size_t i = n; i > 1; i--) {
        size_t j = bench_rng_below(r, i);
        uint32_t t = v[i - 1];
        v[i - 1] = v[j];
        v[j] = t;
    }
}

void bench_shuffle_u64(bench_rng *r, uint64_t *v, size_t n)
{
    for (size_t i = n; i > 1; i--) {
        size_t j = bench_rng_below(r, i);
        uint64_t t = v[i - 1];
        v[i - 1] = v[j];
        v[j] = t;
    }
}

/* ------------------------------------------------------------------ */
/* result rows                                                          */
/* ------------------------------------------------------------------ */

/* Every string of a row is kept whole (a note, a trace's file name): a
 * JSON value cut short would no longer parse. */
typedef struct row_param {
    char *key;
    char *json; /* JSON literal of a number; NULL: text is a string */
    char *text; /* table text */
} row_param;

struct bench_row {
    char *scenario;
    char *metric;
    double value;
    char *unit;
    int n_params, cap_params;
    row_param *params;
    int has_baseline;
    double baseline, ratio;
    int has_target, target_on_ratio, target_higher, met;
    double target;
    char *note;
    struct bench_row *next;
};

static bench_row *table_head, *table_tail;
static int missed_targets;

int bench_missed_targets(void) { return missed_targets; }

static char *xstrdup(const char *s)
{
    size_t n = strlen(s ? s : "") + 1;
    char *d = bench_xmalloc(n);
    memcpy(d, s ? s : "", n);
    return d;
}

static char *xprintf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *xprintf(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    char *s = bench_xmalloc(n > 0 ? (size_t)n + 1 : 1);
    va_start(ap, fmt);
    vsnprintf(s, n > 0 ? (size_t)n + 1 : 1, fmt, ap);
    va_end(ap);
    return s;
}

static void row_free(bench_row *r)
{
    for (int i = 0; i < r->n_params; i++) {
        free(r->params[i].key);
        free(r->params[i].json);
        free(r->params[i].text);
    }
    free(r->params);
    free(r->scenario);
    free(r->metric);
    free(r->unit);
    free(r->note);
    free(r);
}

/* The length of the well-formed UTF-8 sequence at s (RFC 3629: no
 * overlong forms, no surrogates, nothing above U+10FFFF), or 0. */
static size_t utf8_length(const unsigned char *s)
{
    unsigned char c = s[0];
    if (c >= 0xc2 && c <= 0xdf)
        return (s[1] & 0xc0) == 0x80 ? 2 : 0;
    if (c >= 0xe0 && c <= 0xef) {
        unsigned char lo = c == 0xe0 ? 0xa0 : 0x80, hi = c == 0xed ? 0x9f : 0xbf;
        return s[1] >= lo && s[1] <= hi && (s[2] & 0xc0) == 0x80 ? 3 : 0;
    }
    if (c >= 0xf0 && c <= 0xf4) {
        unsigned char lo = c == 0xf0 ? 0x90 : 0x80, hi = c == 0xf4 ? 0x8f : 0xbf;
        return s[1] >= lo && s[1] <= hi && (s[2] & 0xc0) == 0x80 && (s[3] & 0xc0) == 0x80 ? 4 : 0;
    }
    return 0;
}

/* s as a JSON string: quotes, backslashes and control characters escaped;
 * a byte that is not part of well-formed UTF-8 (a file name's Latin-1, say)
 * becomes U+FFFD, so that any JSON parser takes the line. */
static void print_json_string(const char *str)
{
    const unsigned char *s = (const unsigned char *)(str ? str : "");
    putchar('"');
    while (*s) {
        unsigned char c = *s;
        if (c == '"' || c == '\\') {
            putchar('\\');
            putchar(c);
            s++;
        } else if (c == '\n') {
            fputs("\\n", stdout);
            s++;
        } else if (c == '\t') {
            fputs("\\t", stdout);
            s++;
        } else if (c < 0x20 || c == 0x7f) {
            printf("\\u%04x", c);
            s++;
        } else if (c < 0x80) {
            putchar(c);
            s++;
        } else {
            size_t n = utf8_length(s);
            if (n) {
                fwrite(s, 1, n, stdout);
                s += n;
            } else {
                fputs("\\ufffd", stdout);
                s++;
            }
        }
    }
    putchar('"');
}

bench_row *bench_row_new(const char *scenario, const char *metric, double value, const char *unit)
{
    bench_row *r = bench_xcalloc(1, sizeof(*r));
    r->scenario = xstrdup(scenario);
    r->metric = xstrdup(metric);
    r->unit = xstrdup(unit);
    r->value = value;
    return r;
}

/* json NULL: a string parameter, whose text is the value. */
static void add_param(bench_row *r, const char *key, const char *json, const char *text)
{
    if (r->n_params == r->cap_params) {
        int cap = r->cap_params ? 2 * r->cap_params : 8;
        row_param *p = realloc(r->params, (size_t)cap * sizeof(*p));
        if (!p)
            out_of_memory((size_t)cap, sizeof(*p));
        r->params = p;
        r->cap_params = cap;
    }
    r->params[r->n_params++] = (row_param){xstrdup(key), json ? xstrdup(json) : NULL, xstrdup(text)};
}

void bench_row_int(bench_row *r, const char *key, int64_t v)
{
    char b[32];
    snprintf(b, sizeof(b), "%lld", (long long)v);
    add_param(r, key, b, b);
}

static void fmt_num(char *b, size_t cap, double v, int digits)
{
    if (!isfinite(v))
        snprintf(b, cap, "null");
    else if (v == floor(v) && fabs(v) < 9007199254740992.0)
        snprintf(b, cap, "%.0f", v); /* a count, exactly: 1234567, not 1.23457e+06 */
    else
        snprintf(b, cap, "%.*g", digits, v);
}

void bench_row_num(bench_row *r, const char *key, double v)
{
    char j[32], t[32];
    fmt_num(j, sizeof(j), v, 6);
    fmt_num(t, sizeof(t), v, 4);
    add_param(r, key, j, t);
}

void bench_row_str(bench_row *r, const char *key, const char *v) { add_param(r, key, NULL, v ? v : ""); }

void bench_row_baseline(bench_row *r, double baseline, double ratio)
{
    r->has_baseline = 1;
    r->baseline = baseline;
    r->ratio = ratio;
}

void bench_row_target(bench_row *r, int on_ratio, int higher, double bound)
{
    r->has_target = 1;
    r->target_on_ratio = on_ratio;
    r->target_higher = higher;
    r->target = bound;
}

void bench_row_note(bench_row *r, const char *note)
{
    free(r->note);
    r->note = note && *note ? xstrdup(note) : NULL;
}

static void target_text(const bench_row *r, char *b, size_t cap)
{
    snprintf(b, cap, "%s %s %g", r->target_on_ratio ? "ratio" : "value", r->target_higher ? ">=" : "<=", r->target);
}

void bench_emit(const bench_ctx *ctx, bench_row *r)
{
    if (r->has_target) {
        double x = r->target_on_ratio ? r->ratio : r->value;
        r->met = isfinite(x) && (r->target_higher ? x >= r->target : x <= r->target);
        if (!r->met)
            missed_targets++;
    }
    if (!ctx->json) {
        if (table_tail)
            table_tail->next = r;
        else
            table_head = r;
        table_tail = r;
        return;
    }
    char num[32];
    fputs("{\"scenario\": ", stdout);
    print_json_string(r->scenario);
    fputs(", \"metric\": ", stdout);
    print_json_string(r->metric);
    fmt_num(num, sizeof(num), r->value, 6);
    printf(", \"value\": %s, \"unit\": ", num);
    print_json_string(r->unit);
    for (int i = 0; i < r->n_params; i++) {
        fputs(", ", stdout);
        print_json_string(r->params[i].key);
        fputs(": ", stdout);
        if (r->params[i].json)
            fputs(r->params[i].json, stdout);
        else
            print_json_string(r->params[i].text);
    }
    if (r->has_baseline) {
        fmt_num(num, sizeof(num), r->baseline, 6);
        printf(", \"baseline\": %s", num);
        fmt_num(num, sizeof(num), r->ratio, 4);
        printf(", \"ratio\": %s", num);
    }
    if (r->has_target) {
        char t[64];
        target_text(r, t, sizeof(t));
        fputs(", \"target\": ", stdout);
        print_json_string(t);
        printf(", \"met\": %s", r->met ? "true" : "false");
    }
    if (r->note) {
        fputs(", \"note\": ", stdout);
        print_json_string(r->note);
    }
    printf("}\n");
    fflush(stdout);
    row_free(r);
}

void bench_flush_table(const bench_ctx *ctx, const char *title)
{
    if (ctx->json || !table_head)
        return;
    /* Columns: metric | parameters | value unit | baseline | ratio | target */
    enum { NC = 6 };
    const char *hdr[NC] = {"metric", "parameters", "value", "baseline", "ratio", "target"};
    size_t w[NC];
    for (int c = 0; c < NC; c++)
        w[c] = strlen(hdr[c]);
    int n = 0;
    for (bench_row *r = table_head; r; r = r->next)
        n++;
    char *(*cells)[NC] = bench_xcalloc((size_t)n, sizeof(*cells));
    int i = 0;
    for (bench_row *r = table_head; r; r = r->next, i++) {
        cells[i][0] = xstrdup(r->metric);
        cells[i][1] = xstrdup("");
        for (int p = 0; p < r->n_params; p++) {
            char *joined = xprintf("%s%s%s=%s", cells[i][1], p ? " " : "", r->params[p].key, r->params[p].text);
            free(cells[i][1]);
            cells[i][1] = joined;
        }
        char v[32];
        fmt_num(v, sizeof(v), r->value, 4);
        cells[i][2] = xprintf("%s %s", v, r->unit);
        if (r->has_baseline) {
            fmt_num(v, sizeof(v), r->baseline, 4);
            cells[i][3] = xprintf("%s %s", v, r->unit);
            fmt_num(v, sizeof(v), r->ratio, 3);
            cells[i][4] = xstrdup(v);
        }
        if (r->has_target) {
            char t[64];
            target_text(r, t, sizeof(t));
            cells[i][5] = xprintf("%s %s", t, r->met ? "(met)" : "(MISSED)");
        }
        for (int c = 0; c < NC; c++) {
            if (!cells[i][c])
                cells[i][c] = xstrdup("");
            if (strlen(cells[i][c]) > w[c])
                w[c] = strlen(cells[i][c]);
        }
    }
    if (title)
        printf("\n== %s ==\n", title);
    for (int c = 0; c < NC; c++)
        printf("%-*s%s", (int)w[c], hdr[c], c + 1 < NC ? "  " : "\n");
    for (int c = 0; c < NC; c++) {
        for (size_t k = 0; k < w[c]; k++)
            putchar('-');
        printf("%s", c + 1 < NC ? "  " : "\n");
    }
    i = 0;
    for (bench_row *r = table_head; r; i++) {
        for (int c = 0; c < NC; c++) {
            /* Right-align numbers, left-align text. */
            if (c >= 2 && c <= 4)
                printf("%*s%s", (int)w[c], cells[i][c], c + 1 < NC ? "  " : "\n");
            else
                printf("%-*s%s", (int)w[c], cells[i][c], c + 1 < NC ? "  " : "\n");
            free(cells[i][c]);
        }
        if (r->note)
            printf("    note: %s\n", r->note);
        bench_row *next = r->next;
        row_free(r);
        r = next;
    }
    free(cells);
    table_head = table_tail = NULL;
    fflush(stdout);
}

void bench_info(const bench_ctx *ctx, const char *fmt, ...)
{
    if (ctx->json && !ctx->verbose)
        return;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "  ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
}

/* ------------------------------------------------------------------ */
/* options                                                              */
/* ------------------------------------------------------------------ */

static int parse_u64(const char *s, uint64_t *out)
{
    char *end;
    /* Digits first: strtoull would skip blanks and take " -1" as 2^64 - 1.
     * Decimal only: "010" is ten, as a reader expects, not octal eight. */
    if (!isdigit((unsigned char)*s))
        return -1;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s)
        return -1;
    int shift = 0;
    switch (*end) {
    case 'k':
    case 'K':
        shift = 10, end++;
        break;
    case 'm':
    case 'M':
        shift = 20, end++;
        break;
    case 'g':
    case 'G':
        shift = 30, end++;
        break;
    default:
        break;
    }
    if (v > (unsigned long long)UINT64_MAX >> shift) /* the suffix would wrap it */
        return -1;
    v <<= shift;
    if (*end == 'i' || *end == 'B') /* "64KiB", "1MB" */
        end++;
    if (*end == 'B')
        end++;
    if (*end)
        return -1;
    *out = v;
    return 0;
}

/* A comma-separated list, whatever its length: 0, or -1 (a bad or empty
 * item, or more than BENCH_LIST_MAX of them). */
static int parse_list(const char *s, bench_list *l)
{
    l->n = 0;
    for (;;) {
        size_t len = strcspn(s, ",");
        if (l->n == BENCH_LIST_MAX || len == 0)
            return -1;
        char *item = xstrdup(s);
        item[len] = '\0';
        int rc = parse_u64(item, &l->v[l->n]);
        free(item);
        if (rc != 0)
            return -1;
        l->n++;
        if (!s[len])
            return 0;
        s += len + 1;
    }
}

void bench_print_opts(const bench_opt *opts)
{
    for (const bench_opt *o = opts; o && o->name; o++) {
        char lhs[64];
        snprintf(lhs, sizeof(lhs), "%s %s", o->name,
                 o->type == BENCH_OPT_LIST  ? "A,B,.."
                 : o->type == BENCH_OPT_STR ? "S"
                                            : "N");
        printf("  %-24s %s", lhs, o->help);
        if (o->type == BENCH_OPT_STR) {
            const char *def = *(const char **)o->dst;
            if (def) /* NULL: the default is chosen at run time, as the help text says */
                printf(" (default %s)", def);
        } else if (o->type == BENCH_OPT_U64)
            printf(" (default %llu)", (unsigned long long)*(uint64_t *)o->dst);
        else {
            const bench_list *l = o->dst;
            printf(" (default ");
            for (size_t i = 0; i < l->n; i++)
                printf("%s%llu", i ? "," : "", (unsigned long long)l->v[i]);
            printf(")");
        }
        printf("\n");
    }
}

int bench_parse(int argc, char **argv, const bench_opt *opts, const char *scenario, const char *usage)
{
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: kvh-bench %s [--json] [--quick] [--reps N] [--strict] [options]\n\n%s\n", scenario, usage);
            printf("options (defaults shown for this mode; --quick picks smaller ones):\n");
            bench_print_opts(opts);
            return 1;
        }
        const bench_opt *o = opts;
        for (; o && o->name; o++)
            if (!strcmp(argv[i], o->name))
                break;
        if (!o || !o->name) {
            fprintf(stderr, "kvh-bench %s: unknown option '%s' (try --help)\n", scenario, argv[i]);
            return -1;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "kvh-bench %s: %s needs a value\n", scenario, argv[i]);
            return -1;
        }
        const char *val = argv[++i];
        int rc = 0;
        if (o->type == BENCH_OPT_STR && !*val) {
            fprintf(stderr, "kvh-bench %s: %s is empty: it needs a value\n", scenario, o->name);
            return -1;
        }
        if (o->type == BENCH_OPT_STR)
            *(const char **)o->dst = val;
        else
            rc = o->type == BENCH_OPT_U64 ? parse_u64(val, o->dst) : parse_list(val, o->dst);
        if (rc != 0) {
            if (o->type == BENCH_OPT_LIST)
                fprintf(stderr, "kvh-bench %s: bad value '%s' for %s (at most %d comma-separated decimal numbers)\n",
                        scenario, val, o->name, BENCH_LIST_MAX);
            else
                fprintf(stderr, "kvh-bench %s: bad value '%s' for %s (a decimal number)\n", scenario, val, o->name);
            return -1;
        }
    }
    return 0;
}

int bench_check_u64(const char *scenario, const char *flag, uint64_t v, uint64_t lo, uint64_t hi)
{
    if (v >= lo && v <= hi)
        return 0;
    if (hi == UINT64_MAX)
        fprintf(stderr, "kvh-bench %s: %s must be at least %llu, got %llu\n", scenario, flag, (unsigned long long)lo,
                (unsigned long long)v);
    else
        fprintf(stderr, "kvh-bench %s: %s must be in %llu..%llu, got %llu\n", scenario, flag, (unsigned long long)lo,
                (unsigned long long)hi, (unsigned long long)v);
    return -1;
}

int bench_check_list(const char *scenario, const char *flag, const bench_list *l, uint64_t lo, uint64_t hi, int pow2)
{
    for (size_t i = 0; i < l->n; i++) {
        uint64_t v = l->v[i];
        if (v < lo || v > hi || (pow2 && (v & (v - 1)))) {
            fprintf(stderr, "kvh-bench %s: %s values must be %sin %llu..%llu, got %llu\n", scenario, flag,
                    pow2 ? "powers of two " : "", (unsigned long long)lo, (unsigned long long)hi,
                    (unsigned long long)v);
            return -1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ */
/* misc                                                                 */
/* ------------------------------------------------------------------ */

int bench_kvh_fail(const char *what, kvh_status st)
{
    fprintf(stderr, "kvh-bench: %s failed: %s (%s): %s\n", what, kvh_status_name(st), kvh_strerror(st),
            kvh_last_error());
    return 1;
}

const char *bench_fmt_bytes(uint64_t n, char *buf, size_t len)
{
    if (n >= (1ull << 30) && n % (1ull << 30) == 0)
        snprintf(buf, len, "%lluG", (unsigned long long)(n >> 30));
    else if (n >= (1ull << 20) && n % (1ull << 20) == 0)
        snprintf(buf, len, "%lluM", (unsigned long long)(n >> 20));
    else if (n >= 1024 && n % 1024 == 0)
        snprintf(buf, len, "%lluK", (unsigned long long)(n >> 10));
    else
        snprintf(buf, len, "%llu", (unsigned long long)n);
    return buf;
}

static volatile uint64_t sink_value;
void bench_sink(uint64_t v) { sink_value += v; }

/* Raw baseline: n transfers of `bs` bytes at queue depth qd, sequential or
 * in a shuffled order. Returns seconds, or -1. */
double bench_raw_io(const char *path, uint64_t bs, uint32_t n, int write, int random, uint32_t qd, uint64_t seed)
{
    int fd = open(path, O_RDWR | O_CREAT | O_DIRECT, 0644);
    if (fd < 0)
        return -1;
    if (posix_fallocate(fd, 0, (off_t)(bs * n)) != 0) {
        close(fd);
        return -1;
    }
    struct io_uring ring;
    if (io_uring_queue_init(qd, &ring, 0) != 0) {
        close(fd);
        return -1;
    }
    uint8_t *buf;
    if (posix_memalign((void **)&buf, 4096, bs * qd) != 0) {
        io_uring_queue_exit(&ring);
        close(fd);
        return -1;
    }
    memset(buf, 0x5a, bs * qd);
    uint32_t *order = bench_xmalloc(sizeof(uint32_t) * n);
    for (uint32_t i = 0; i < n; i++)
        order[i] = i;
    if (random) {
        bench_rng r;
        bench_rng_seed(&r, seed);
        bench_shuffle_u32(&r, order, n);
    }
    double t0 = bench_sec();
    uint32_t next = 0, done = 0, inflight = 0;
    int err = 0;
    while (done < n && !err) {
        while (inflight < qd && next < n) {
            struct io_uring_sqe *sqe = io_uring_get_sqe(&ring);
            uint8_t *b = buf + (uint64_t)(next % qd) * bs;
            if (write)
                io_uring_prep_write(sqe, fd, b, (unsigned)bs, (uint64_t)order[next] * bs);
            else
                io_uring_prep_read(sqe, fd, b, (unsigned)bs, (uint64_t)order[next] * bs);
            next++;
            inflight++;
        }
        io_uring_submit(&ring);
        struct io_uring_cqe *cqe;
        if (io_uring_wait_cqe(&ring, &cqe) != 0 || cqe->res != (int)bs)
            err = 1;
        io_uring_cqe_seen(&ring, cqe);
        inflight--;
        done++;
    }
    if (write)
        fdatasync(fd);
    double t = bench_sec() - t0;
    free(order);
    free(buf);
    io_uring_queue_exit(&ring);
    close(fd);
    return err ? -1 : t;
}
