#include "trace.h"

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

void trace_init(trace *t) { memset(t, 0, sizeof(*t)); }

void trace_free(trace *t)
{
    free(t->acc);
    free(t->hints);
    free(t->tolerance);
    free(t->blocks.keys);
    free(t->blocks.vals);
    free(t->seqs.keys);
    free(t->seqs.vals);
    trace_init(t);
}

static uint64_t block_key(uint32_t seq, uint32_t index) { return ((uint64_t)seq << 32) | index; }

static size_t map_slot(uint64_t key, size_t cap)
{
    uint64_t h = key * 0x9e3779b97f4a7c15ull;
    return (size_t)(h >> 17) & (cap - 1);
}

static int map_grow(trace_map *m)
{
    size_t cap = m->cap ? m->cap * 2 : 1024;
    uint64_t *keys = malloc(cap * sizeof(*keys));
    uint32_t *vals = malloc(cap * sizeof(*vals));
    if (!keys || !vals) {
        free(keys);
        free(vals);
        return -1;
    }
    memset(vals, 0xff, cap * sizeof(*vals)); /* TRACE_MAP_EMPTY */
    for (size_t i = 0; i < m->cap; i++) {
        if (m->vals[i] == TRACE_MAP_EMPTY)
            continue;
        size_t s = map_slot(m->keys[i], cap);
        while (vals[s] != TRACE_MAP_EMPTY)
            s = (s + 1) & (cap - 1);
        keys[s] = m->keys[i];
        vals[s] = m->vals[i];
    }
    free(m->keys);
    free(m->vals);
    m->keys = keys;
    m->vals = vals;
    m->cap = cap;
    return 0;
}

/* The slot of key, or of the empty slot where it would go. */
static size_t map_find(const trace_map *m, uint64_t key)
{
    size_t s = map_slot(key, m->cap);
    while (m->vals[s] != TRACE_MAP_EMPTY && m->keys[s] != key)
        s = (s + 1) & (m->cap - 1);
    return s;
}

/* The id of key, or -1 if the map does not have it. */
static int64_t map_lookup(const trace_map *m, uint64_t key)
{
    if (!m->cap)
        return -1;
    uint32_t v = m->vals[map_find(m, key)];
    return v == TRACE_MAP_EMPTY ? -1 : (int64_t)v;
}

/* The id of key, which becomes *next (then incremented) if the key is new
 * (*added set); -1 when out of memory or out of ids. */
static int64_t map_intern(trace_map *m, uint64_t key, uint32_t *next, int *added)
{
    *added = 0;
    if ((m->used + 1) * 2 > m->cap && map_grow(m) != 0)
        return -1;
    size_t s = map_find(m, key);
    if (m->vals[s] != TRACE_MAP_EMPTY)
        return m->vals[s];
    if (*next == TRACE_MAP_EMPTY)
        return -1; /* every id below it is taken */
    m->keys[s] = key;
    m->vals[s] = (*next)++;
    m->used++;
    *added = 1;
    return m->vals[s];
}

/* Dense id of a block key, creating it (with tolerance) if new; -1 on OOM. */
static int64_t block_id(trace *t, uint64_t key, float tolerance)
{
    if (t->n_blocks == t->tol_cap) {
        uint32_t cap = t->tol_cap ? t->tol_cap * 2 : 1024;
        if (cap < t->tol_cap)
            return -1;
        float *tol = realloc(t->tolerance, (size_t)cap * sizeof(*tol));
        if (!tol)
            return -1;
        t->tolerance = tol;
        t->tol_cap = cap;
    }
    uint32_t id = t->n_blocks;
    int added;
    int64_t got = map_intern(&t->blocks, key, &t->n_blocks, &added);
    if (added)
        t->tolerance[id] = tolerance;
    return got;
}

static int push(trace *t, trace_access a)
{
    int added;
    int64_t seq_id = map_intern(&t->seqs, a.seq, &t->n_seqs, &added);
    if (seq_id < 0)
        return -1;
    if (t->n == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 4096;
        trace_access *acc = realloc(t->acc, cap * sizeof(*acc));
        if (!acc)
            return -1;
        t->acc = acc;
        t->cap = cap;
    }
    a.seq_id = (uint32_t)seq_id;
    t->acc[t->n++] = a;
    return 0;
}

int trace_add(trace *t, uint32_t seq, uint32_t index, uint32_t agent, float tolerance)
{
    int64_t id = block_id(t, block_key(seq, index), tolerance);
    if (id < 0)
        return -1;
    return push(t, (trace_access){.block = (uint32_t)id, .seq = seq, .index = index, .agent = agent});
}

int trace_add_hint(trace *t, uint32_t seq, uint32_t first, uint32_t n, int32_t priority)
{
    if (t->n_hints == t->hint_cap) {
        size_t cap = t->hint_cap ? t->hint_cap * 2 : 1024;
        trace_hint *h = realloc(t->hints, cap * sizeof(*h));
        if (!h)
            return -1;
        t->hints = h;
        t->hint_cap = cap;
    }
    t->hints[t->n_hints++] =
        (trace_hint){.at = t->n, .seq = seq, .first = first, .n = n, .priority = priority, .block = UINT32_MAX};
    return 0;
}

int64_t trace_find(const trace *t, uint32_t seq, uint32_t index)
{
    return map_lookup(&t->blocks, block_key(seq, index));
}

int64_t trace_find_seq(const trace *t, uint32_t seq) { return map_lookup(&t->seqs, seq); }

static int cmp_position(const void *a, const void *b)
{
    const trace_position *x = a, *y = b;
    if (x->seq != y->seq)
        return x->seq < y->seq ? -1 : 1;
    return x->index < y->index ? -1 : x->index > y->index;
}

trace_position *trace_blocks_by_position(const trace *t)
{
    trace_position *p = malloc((t->n_blocks ? t->n_blocks : 1) * sizeof(*p));
    if (!p)
        return NULL;
    for (size_t i = 0; i < t->n; i++)
        p[t->acc[i].block] = (trace_position){.seq = t->acc[i].seq, .index = t->acc[i].index, .block = t->acc[i].block};
    qsort(p, t->n_blocks, sizeof(*p), cmp_position);
    return p;
}

size_t trace_position_at(const trace_position *p, size_t n, uint32_t seq, uint64_t index)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (p[mid].seq < seq || (p[mid].seq == seq && p[mid].index < index))
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Dense id of a block named by handle, or -1 if never accessed. */
static int64_t handle_id(const trace *t, uint64_t handle) { return map_lookup(&t->blocks, handle); }

int trace_add_handle(trace *t, uint64_t handle, uint32_t agent, float tolerance)
{
    int64_t id = block_id(t, handle, tolerance);
    if (id < 0)
        return -1;
    return push(t, (trace_access){.block = (uint32_t)id, .seq = (uint32_t)id, .index = 0, .agent = agent});
}

static int is_blank(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }

/* The fields of a plain-form line, blank-separated: at most max of them
 * (a line with more gives max + 1). */
typedef struct field {
    const char *s;
    size_t len;
} field;

static size_t split_fields(const char *p, field *f, size_t max)
{
    size_t n = 0;
    for (;;) {
        while (is_blank(*p))
            p++;
        if (!*p || n > max)
            return n;
        const char *start = p;
        while (*p && !is_blank(*p))
            p++;
        if (n < max)
            f[n] = (field){start, (size_t)(p - start)};
        n++;
    }
}

/* The digits of f, a decimal integer of at most max (digits only: no
 * sign, no blanks). */
static int field_digits(field f, uint64_t max, uint64_t *out)
{
    uint64_t v = 0;
    if (f.len == 0)
        return -1;
    for (size_t i = 0; i < f.len; i++) {
        if (f.s[i] < '0' || f.s[i] > '9')
            return -1;
        v = v * 10 + (uint64_t)(f.s[i] - '0');
        if (v > max)
            return -1;
    }
    *out = v;
    return 0;
}

/* A decimal integer in 0 .. UINT32_MAX. */
static int field_u32(field f, uint32_t *out)
{
    uint64_t v;
    if (field_digits(f, UINT32_MAX, &v) != 0)
        return -1;
    *out = (uint32_t)v;
    return 0;
}

/* A decimal integer in INT32_MIN .. INT32_MAX, with an optional sign. */
static int field_i32(field f, int32_t *out)
{
    int negative = f.len > 0 && f.s[0] == '-';
    if (f.len > 0 && (f.s[0] == '-' || f.s[0] == '+'))
        f.s++, f.len--;
    uint64_t v;
    if (field_digits(f, negative ? (uint64_t)INT32_MAX + 1 : INT32_MAX, &v) != 0)
        return -1;
    *out = negative ? (int32_t)(-(int64_t)v) : (int32_t)v;
    return 0;
}

/* A tolerance: a decimal number in [0, 1] (no nan, inf or hex form). */
static int field_tolerance(field f, float *out)
{
    char buf[64];
    if (f.len == 0 || f.len >= sizeof(buf))
        return -1;
    memcpy(buf, f.s, f.len);
    buf[f.len] = '\0';
    if (strspn(buf, "0123456789.eE+-") != f.len)
        return -1;
    char *end;
    double v = strtod(buf, &end);
    if (*end || !(v >= 0 && v <= 1))
        return -1;
    *out = (float)v;
    return 0;
}

/* The fields of a demo-form line, tab-separated: at most max of them (a
 * line with more gives max + 1); trailing blanks (a CR) end the last. */
static size_t split_tabs(const char *p, field *f, size_t max)
{
    size_t n = 0;
    for (;;) {
        const char *start = p;
        while (*p && *p != '\t')
            p++;
        size_t len = (size_t)(p - start);
        if (!*p)
            while (len > 0 && is_blank(start[len - 1]))
                len--;
        if (n < max)
            f[n] = (field){start, len};
        n++;
        if (!*p || n > max)
            return n;
        p++;
    }
}

/* A 64-bit handle in hex, with or without 0x: at most 16 digits (a wider
 * one would be cut to another block's). */
static int field_hex64(field f, uint64_t *out)
{
    if (f.len > 2 && f.s[0] == '0' && (f.s[1] == 'x' || f.s[1] == 'X'))
        f.s += 2, f.len -= 2;
    while (f.len > 16 && f.s[0] == '0')
        f.s++, f.len--;
    if (f.len == 0 || f.len > 16)
        return -1;
    uint64_t v = 0;
    for (size_t i = 0; i < f.len; i++) {
        char c = f.s[i];
        int d = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                       : -1;
        if (d < 0)
            return -1;
        v = v << 4 | (uint64_t)d;
    }
    *out = v;
    return 0;
}

static int field_is(field f, const char *word) { return f.len == strlen(word) && !memcmp(f.s, word, f.len); }

#define DEMO_FORM "T_S<tab>AGENT<tab>SEQ<tab>BLOCK<tab>HASH<tab>TIER<tab>KIND[<tab>PRIORITY] (handles in hex)"

/* A line of the demo's format: t_s agent seq block_id block_hash tier kind
 * (tab-separated, handles in hex; a hint line has the priority too).
 * Returns 1 when it is one and was added or skipped, 0 when it is not
 * (fewer than 6 tab-separated fields: the plain form), 2 when malformed
 * (*expected: the form), -1 when out of memory. */
static int demo_line(trace *t, const char *p, const char **expected)
{
    field f[8];
    size_t n = split_tabs(p, f, 8);
    if (n < 6)
        return 0;
    *expected = DEMO_FORM;
    uint32_t agent;
    uint64_t seq, handle, hash;
    char ts[64];
    char *end;
    if (n < 7 || n > 8 || f[0].len == 0 || f[0].len >= sizeof(ts) || field_u32(f[1], &agent) ||
        field_hex64(f[2], &seq) || field_hex64(f[3], &handle) || field_hex64(f[4], &hash) || f[5].len == 0)
        return 2;
    memcpy(ts, f[0].s, f[0].len);
    ts[f[0].len] = '\0';
    double when = strtod(ts, &end);
    if (*end || !isfinite(when))
        return 2;
    field kind = f[6];
    if (field_is(kind, "hint")) {
        /* The scheduler's queue (kvh_seq_hint): a hint for the block's own
         * one-block sequence, if it has been made yet. */
        int32_t priority;
        if (n != 8 || field_i32(f[7], &priority)) {
            *expected = DEMO_FORM ", PRIORITY in -2^31 .. 2^31 - 1";
            return 2;
        }
        int64_t b = handle_id(t, handle);
        if (b < 0)
            return 1;
        if (trace_add_hint(t, (uint32_t)b, 0, 1, priority) != 0)
            return -1;
        t->hints[t->n_hints - 1].block = (uint32_t)b;
        return 1;
    }
    if (n != 7 || !(field_is(kind, "match") || field_is(kind, "prefill") || field_is(kind, "decode") ||
                    field_is(kind, "ingest") || field_is(kind, "prefetch"))) {
        *expected = DEMO_FORM ", KIND one of match, prefill, decode, ingest, prefetch, hint";
        return 2;
    }
    /* Prefetches are not demand accesses. */
    if (field_is(kind, "prefetch"))
        return 1;
    return trace_add_handle(t, handle, agent, 0.5f) == 0 ? 1 : -1;
}

/* A line of the plain form: an access or a hint. Returns 0, -1 when out of
 * memory, or 1 when malformed (*expected: the form it should have). */
static int plain_line(trace *t, const char *p, const char **expected)
{
    field f[6];
    size_t n = split_fields(p, f, 5);
    if (n > 0 && f[0].len == 4 && !memcmp(f[0].s, "hint", 4)) {
        uint32_t seq, first, count;
        int32_t prio;
        if (n != 5 || field_u32(f[1], &seq) || field_u32(f[2], &first) || field_u32(f[3], &count) ||
            field_i32(f[4], &prio)) {
            *expected = "hint SEQ FIRST N PRIORITY";
            return 1;
        }
        return trace_add_hint(t, seq, first, count, prio) == 0 ? 0 : -1;
    }
    uint32_t seq, index, agent = 0;
    float tol = 0.5f;
    if (n < 2 || n > 4 || field_u32(f[0], &seq) || field_u32(f[1], &index) || (n > 2 && field_u32(f[2], &agent)) ||
        (n > 3 && field_tolerance(f[3], &tol))) {
        *expected = "SEQ BLOCK [AGENT [TOLERANCE]]";
        return 1;
    }
    return trace_add(t, seq, index, agent, tol) == 0 ? 0 : -1;
}

enum { LINE_READ = 1, LINE_END = 0, LINE_ERROR = -1, LINE_NO_MEMORY = -2, LINE_TOO_LONG = -3, LINE_NUL = -4 };

/* Reads one whole line, its newline dropped, into *buf (grown as needed,
 * up to TRACE_LINE_MAX bytes and a NUL). Returns a LINE_* value; at
 * LINE_TOO_LONG the rest of the line is left unread. */
static int read_line(FILE *f, char **buf, size_t *cap)
{
    size_t n = 0;
    int c;
    while ((c = getc_unlocked(f)) != EOF && c != '\n') {
        if (c == '\0')
            return LINE_NUL;
        if (n == TRACE_LINE_MAX)
            return LINE_TOO_LONG;
        if (n + 1 >= *cap) {
            size_t grown = *cap * 2 > TRACE_LINE_MAX + 1 ? TRACE_LINE_MAX + 1 : *cap * 2;
            char *b = realloc(*buf, grown);
            if (!b)
                return LINE_NO_MEMORY;
            *buf = b;
            *cap = grown;
        }
        (*buf)[n++] = (char)c;
    }
    if (c == EOF && ferror(f))
        return LINE_ERROR;
    if (c == EOF && n == 0)
        return LINE_END;
    (*buf)[n] = '\0';
    return LINE_READ;
}

int trace_load(trace *t, const char *path, char *err, size_t err_len)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(err, err_len, "%s: %s", path, strerror(errno));
        return -1;
    }
    /* A file or a pipe: a directory reads as nothing, a device such as
     * /dev/zero as endless empty lines. */
    struct stat st;
    const char *why = fstat(fileno(f), &st) != 0                      ? strerror(errno)
                      : S_ISDIR(st.st_mode)                           ? "is a directory"
                      : !S_ISREG(st.st_mode) && !S_ISFIFO(st.st_mode) ? "not a regular file or a pipe"
                                                                      : NULL;
    if (why) {
        snprintf(err, err_len, "%s: %s", path, why);
        fclose(f);
        return -1;
    }
    size_t cap = 256;
    char *line = malloc(cap);
    size_t lineno = 0, first_line = 0;
    int first_form = 0; /* 1 plain, 2 the demo's */
    int rc = line ? 0 : -1;
    if (!line)
        snprintf(err, err_len, "out of memory reading %s", path);
    while (rc == 0) {
        int got = read_line(f, &line, &cap);
        if (got == LINE_END)
            break;
        lineno++;
        if (got != LINE_READ) {
            if (got == LINE_NUL)
                snprintf(err, err_len, "%s:%zu: not text (a NUL byte)", path, lineno);
            else if (got == LINE_TOO_LONG)
                snprintf(err, err_len, "%s:%zu: line longer than %u bytes", path, lineno, TRACE_LINE_MAX);
            else if (got == LINE_NO_MEMORY)
                snprintf(err, err_len, "out of memory reading %s", path);
            else
                snprintf(err, err_len, "%s:%zu: %s", path, lineno, strerror(errno));
            rc = -1;
            break;
        }
        char *p = line;
        while (is_blank(*p))
            p++;
        if (*p == '#' || *p == '\0')
            continue;
        const char *expected = NULL;
        int demo = demo_line(t, p, &expected);
        int form = demo ? 2 : 1;
        got = demo == 1 ? 0 : demo == 2 ? 1 : demo < 0 ? -1 : plain_line(t, p, &expected);
        if (got == 0 && first_form && form != first_form) {
            /* The two forms name blocks in one key space: a handle and a
             * (SEQ, BLOCK) pair could be taken for one block. */
            snprintf(err, err_len,
                     "%s:%zu: the %s form, after lines of the %s form at line %zu: a trace holds one form", path,
                     lineno, form == 2 ? "demo's tab-separated" : "plain", form == 2 ? "plain" : "demo's", first_line);
            rc = -1;
        } else if (got != 0) {
            if (got < 0)
                snprintf(err, err_len, "out of memory reading %s", path);
            else
                snprintf(err, err_len, "%s:%zu: expected '%s'", path, lineno, expected);
            rc = -1;
        } else if (!first_form) {
            first_form = form;
            first_line = lineno;
        }
    }
    free(line);
    fclose(f);
    if (rc == 0 && t->n == 0) {
        snprintf(err, err_len, "%s: no accesses", path);
        rc = -1;
    }
    return rc;
}

int trace_save(const trace *t, const char *path)
{
    FILE *f = fopen(path, "w");
    if (!f)
        return -1;
    fprintf(f, "# kvh block-access trace: SEQ BLOCK AGENT TOLERANCE; hint SEQ FIRST N PRIORITY\n");
    size_t h = 0;
    for (size_t i = 0; i < t->n; i++) {
        for (; h < t->n_hints && t->hints[h].at <= i; h++)
            fprintf(f, "hint %u %u %u %d\n", t->hints[h].seq, t->hints[h].first, t->hints[h].n, t->hints[h].priority);
        const trace_access *a = &t->acc[i];
        /* %.9g: a float's every digit, so that a saved trace replays as it was made */
        fprintf(f, "%u %u %u %.9g\n", a->seq, a->index, a->agent, (double)t->tolerance[a->block]);
    }
    return fclose(f) == 0 ? 0 : -1;
}

uint32_t trace_count_seqs(const trace *t) { return t->n_seqs; }
