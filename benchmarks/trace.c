#include "trace.h"

#include <errno.h>
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
    free(t->map_keys);
    free(t->map_vals);
    trace_init(t);
}

/* Key 0 marks an empty slot, so keys are stored plus one. */
static uint64_t map_key(uint32_t seq, uint32_t index) { return (((uint64_t)seq << 32) | index) + 1; }

static size_t map_slot(uint64_t key, size_t cap)
{
    uint64_t h = key * 0x9e3779b97f4a7c15ull;
    return (size_t)(h >> 17) & (cap - 1);
}

static int map_grow(trace *t)
{
    size_t cap = t->map_cap ? t->map_cap * 2 : 1024;
    uint64_t *keys = calloc(cap, sizeof(*keys));
    uint32_t *vals = malloc(cap * sizeof(*vals));
    if (!keys || !vals) {
        free(keys);
        free(vals);
        return -1;
    }
    for (size_t i = 0; i < t->map_cap; i++) {
        if (!t->map_keys[i])
            continue;
        size_t s = map_slot(t->map_keys[i], cap);
        while (keys[s])
            s = (s + 1) & (cap - 1);
        keys[s] = t->map_keys[i];
        vals[s] = t->map_vals[i];
    }
    free(t->map_keys);
    free(t->map_vals);
    t->map_keys = keys;
    t->map_vals = vals;
    t->map_cap = cap;
    return 0;
}

/* Dense id of a block key, or -1 if the map does not have it. */
static int64_t map_lookup(const trace *t, uint64_t key)
{
    if (!t->map_cap)
        return -1;
    size_t s = map_slot(key, t->map_cap);
    while (t->map_keys[s]) {
        if (t->map_keys[s] == key)
            return t->map_vals[s];
        s = (s + 1) & (t->map_cap - 1);
    }
    return -1;
}

/* Dense id of a block key, creating it (with tolerance) if new; -1 on OOM. */
static int64_t block_id(trace *t, uint64_t key, float tolerance)
{
    if ((t->map_used + 1) * 2 > t->map_cap && map_grow(t) != 0)
        return -1;
    size_t s = map_slot(key, t->map_cap);
    while (t->map_keys[s]) {
        if (t->map_keys[s] == key)
            return t->map_vals[s];
        s = (s + 1) & (t->map_cap - 1);
    }
    if (t->n_blocks == t->tol_cap) {
        uint32_t cap = t->tol_cap ? t->tol_cap * 2 : 1024;
        float *tol = realloc(t->tolerance, cap * sizeof(*tol));
        if (!tol)
            return -1;
        t->tolerance = tol;
        t->tol_cap = cap;
    }
    t->tolerance[t->n_blocks] = tolerance;
    t->map_keys[s] = key;
    t->map_vals[s] = t->n_blocks;
    t->map_used++;
    return t->n_blocks++;
}

static int push(trace *t, trace_access a)
{
    if (t->n == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 4096;
        trace_access *acc = realloc(t->acc, cap * sizeof(*acc));
        if (!acc)
            return -1;
        t->acc = acc;
        t->cap = cap;
    }
    t->acc[t->n++] = a;
    return 0;
}

int trace_add(trace *t, uint32_t seq, uint32_t index, uint32_t agent, float tolerance)
{
    int64_t id = block_id(t, map_key(seq, index), tolerance);
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

int64_t trace_find(const trace *t, uint32_t seq, uint32_t index) { return map_lookup(t, map_key(seq, index)); }

/* Dense id of a block named by handle, or -1 if never accessed. */
static int64_t handle_id(const trace *t, uint64_t handle) { return map_lookup(t, handle + 1); }

int trace_add_handle(trace *t, uint64_t handle, uint32_t agent, float tolerance)
{
    int64_t id = block_id(t, handle + 1, tolerance);
    if (id < 0)
        return -1;
    return push(t, (trace_access){.block = (uint32_t)id, .seq = (uint32_t)id, .index = 0, .agent = agent});
}

/* A line of the demo's format: t_s agent seq block_id block_hash tier kind
 * (tab-separated, handles in hex). Returns 1 when it is one (and was
 * added or skipped), 0 when it is not, -1 when out of memory. */
static int demo_line(trace *t, const char *p)
{
    double ts;
    unsigned long long agent, seq, handle, hash;
    long long priority = 0;
    char tier[16], kind[16];
    if (!strchr(p, '\t'))
        return 0;
    int got =
        sscanf(p, "%lf %llu %llx %llx %llx %15s %15s %lld", &ts, &agent, &seq, &handle, &hash, tier, kind, &priority);
    if (got < 7)
        return 0;
    /* Prefetches are not demand accesses. */
    if (!strcmp(kind, "prefetch"))
        return 1;
    if (!strcmp(kind, "hint")) {
        /* The scheduler's queue (kvh_seq_hint): a hint for the block's own
         * one-block sequence, if it has been made yet. */
        if (got < 8 || priority < INT32_MIN || priority > INT32_MAX)
            return 0;
        int64_t b = handle_id(t, handle);
        if (b < 0)
            return 1;
        if (trace_add_hint(t, (uint32_t)b, 0, 1, (int32_t)priority) != 0)
            return -1;
        t->hints[t->n_hints - 1].block = (uint32_t)b;
        return 1;
    }
    return trace_add_handle(t, handle, (uint32_t)agent, 0.5f) == 0 ? 1 : -1;
}

/* A line of the plain form: an access or a hint. Returns 0, -1 when out of
 * memory, or 1 when malformed (*expected: the form it should have). */
static int plain_line(trace *t, const char *p, const char **expected)
{
    if (!strncmp(p, "hint", 4)) {
        unsigned long long hs, hf, hn;
        long long prio;
        if (sscanf(p + 4, "%llu %llu %llu %lld", &hs, &hf, &hn, &prio) != 4 || hs > UINT32_MAX || hf > UINT32_MAX ||
            hn > UINT32_MAX || prio < INT32_MIN || prio > INT32_MAX) {
            *expected = "hint SEQ FIRST N PRIORITY";
            return 1;
        }
        return trace_add_hint(t, (uint32_t)hs, (uint32_t)hf, (uint32_t)hn, (int32_t)prio) == 0 ? 0 : -1;
    }
    unsigned long long seq, index, agent = 0;
    double tol = 0.5;
    int got = sscanf(p, "%llu %llu %llu %lf", &seq, &index, &agent, &tol);
    if (got < 2 || seq > UINT32_MAX || index > UINT32_MAX || agent > UINT32_MAX || tol < 0 || tol > 1) {
        *expected = "SEQ BLOCK [AGENT [TOLERANCE]]";
        return 1;
    }
    return trace_add(t, (uint32_t)seq, (uint32_t)index, (uint32_t)agent, (float)tol) == 0 ? 0 : -1;
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
    char line[512];
    size_t lineno = 0;
    int rc = 0;
    while (fgets(line, sizeof(line), f)) {
        lineno++;
        if (line[0] == '\0') { /* fgets stopped after a NUL byte */
            snprintf(err, err_len, "%s:%zu: not text (a NUL byte)", path, lineno);
            rc = -1;
            break;
        }
        char *p = line;
        while (*p == ' ' || *p == '\t')
            p++;
        if (*p == '#' || *p == '\n' || *p == '\0')
            continue;
        const char *expected = NULL;
        int demo = demo_line(t, p);
        int got = demo ? (demo < 0 ? -1 : 0) : plain_line(t, p, &expected);
        if (got != 0) {
            if (got < 0)
                snprintf(err, err_len, "out of memory reading %s", path);
            else
                snprintf(err, err_len, "%s:%zu: expected '%s'", path, lineno, expected);
            rc = -1;
            break;
        }
    }
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
        fprintf(f, "%u %u %u %.3f\n", a->seq, a->index, a->agent, (double)t->tolerance[a->block]);
    }
    return fclose(f) == 0 ? 0 : -1;
}

uint32_t trace_count_seqs(const trace *t)
{
    uint32_t max = 0;
    for (size_t i = 0; i < t->n; i++)
        if (t->acc[i].seq + 1 > max)
            max = t->acc[i].seq + 1;
    uint8_t *seen = calloc(max ? max : 1, 1);
    if (!seen)
        return 0;
    uint32_t n = 0;
    for (size_t i = 0; i < t->n; i++)
        if (!seen[t->acc[i].seq]) {
            seen[t->acc[i].seq] = 1;
            n++;
        }
    free(seen);
    return n;
}
