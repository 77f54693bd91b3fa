/* CPU paged attention: runs a plan on the engine's thread pool with the
 * best kernel variant this CPU supports, then merges split-K partials.
 *
 * The kernel variant is chosen per run: AVX-512 (head_dim % 16 == 0) or
 * AVX2 (head_dim % 8 == 0) where __builtin_cpu_supports says the CPU and
 * OS run them, else the portable 4-lane one (head_dim % 4 == 0), else the
 * one-lane one. KVH_ATTN_ISA=generic|avx2|avx512|
 * reference (read when the engine's state is made) or
 * kvhi_attention_set_impl() force one, for tests and benchmarks. */
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#include "kvh/kvh.h"
#include "kernels/cpu/attn_cpu.h"
#include "kernels/cpu/fp_env.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#endif

static int x86_has_f16c(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return 0;
    return (c & bit_F16C) != 0;
#else
    return 0;
#endif
}

int kvhi_attn_cpu_supported(int impl)
{
    switch (impl) {
    case KVHI_ATTN_AUTO:
    case KVHI_ATTN_REFERENCE:
    case KVHI_ATTN_GENERIC:
        return 1;
#if defined(__x86_64__) && defined(__GNUC__)
    case KVHI_ATTN_AVX2:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && x86_has_f16c();
    case KVHI_ATTN_AVX512:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && x86_has_f16c();
#endif
    default:
        return 0;
    }
}

int kvhi_attn_cpu_best(void)
{
    if (kvhi_attn_cpu_supported(KVHI_ATTN_AVX512))
        return KVHI_ATTN_AVX512;
    if (kvhi_attn_cpu_supported(KVHI_ATTN_AVX2))
        return KVHI_ATTN_AVX2;
    return KVHI_ATTN_GENERIC;
}

kvhi_attn_cpu *kvhi_attn_cpu_create(void)
{
    kvhi_attn_cpu *st = calloc(1, sizeof(*st));
    if (!st)
        return NULL;
    pthread_mutex_init(&st->run_lock, NULL);
    st->ncpu = kvhi_cpu_count();
    st->impl = KVHI_ATTN_AUTO;
    const char *env = secure_getenv("KVH_ATTN_ISA");
    int impl = env ? kvhi_attn_isa_by_name(env) : -1;
    if (impl > 0 && kvhi_attn_cpu_supported(impl))
        st->impl = impl;
    return st;
}

static const struct {
    const char *name;
    int impl;
} isa_names[] = {{"reference", KVHI_ATTN_REFERENCE},
                 {"generic", KVHI_ATTN_GENERIC},
                 {"avx2", KVHI_ATTN_AVX2},
                 {"avx512", KVHI_ATTN_AVX512}};

int kvhi_attn_isa_by_name(const char *name)
{
    for (size_t i = 0; i < sizeof(isa_names) / sizeof(isa_names[0]); i++)
        if (strcmp(name, isa_names[i].name) == 0)
            return isa_names[i].impl;
    return -1;
}

void kvhi_attn_cpu_destroy(void *state)
{
    kvhi_attn_cpu *st = state;
    if (!st)
        return;
    kvhi_pool_destroy(st->pool);
    free(st->partial);
    free(st->rows_past);
    free(st->scratch);
    pthread_mutex_destroy(&st->run_lock);
    free(st);
}

/* Work split for the CPU: a few units per thread so the atomic counter
 * can balance uneven ones; chunks of at least 256 tokens so a split unit
 * still streams tens of KB per head; up to 32 query vectors per unit (GQA
 * groups and prefill rows share each K/V block while it is in L1). */
void kvhi_attn_cpu_plan_opts(void *ctx, uint32_t threads, kvhi_attn_plan_opts *o)
{
    /* Planned for the threads asked for (the run caps them at the CPUs),
     * so a given `threads` always gives the same split. */
    uint32_t n = threads ? threads : kvhi_cpu_count();
    o->max_queries = 32;
    o->target_units = n > 1 ? 4 * n : 1;
    o->min_chunk_tokens = 256;
    o->chunk_quantum = 0;
}

static size_t scratch_floats(const kvhi_attn_plan *p)
{
    /* q and acc (max_queries x head_dim each), m and l, the scores of a
     * query group (4 x (tile + 32)), the causal limits */
    size_t f = 2 * (size_t)p->max_queries * p->head_dim + 3 * (size_t)p->max_queries + 4 * (KVHI_ATTN_TILE + 32) + 64;
    return (f + 15) & ~(size_t)15; /* 64-byte multiples between participants */
}

typedef struct run_job {
    const kvhi_attn_plan *p;
    const void *q;
    void *out;
    kvhi_attn_unit_fn fn;
    float *po, *pml, *scratch;
    size_t scratch_stride;
    uint32_t end; /* units [next, end) */
    _Atomic uint32_t next;
} run_job;

static void run_units(void *arg, uint32_t who)
{
    run_job *j = arg;
    float *ws = j->scratch + (size_t)who * j->scratch_stride;
    for (;;) {
        uint32_t i = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (i >= j->end)
            break;
        j->fn(j->p, &j->p->units[i], j->q, j->out, j->po, j->pml, ws);
    }
}

/* out row = sum_c w_c o_c / sum_c w_c, w_c = l_c e^(m_c - max m), over the
 * chunks that hold tokens the row sees (m_c, l_c: chunk c's score maximum
 * and sum of e^(score - m_c); o_c its normalised output). A chunk past
 * the float range (NaN) makes the row NaN. */
static void merge_row(const kvhi_attn_plan *p, const kvhi_attn_merge *mg, const float *po, const float *pml, void *out,
                      float *tmp)
{
    const kvhi_attn_seq *s = &p->seqs[mg->seq];
    const uint32_t D = p->head_dim, Hq = p->num_q_heads;
    uint32_t visible = s->kv_len - s->q_len + mg->row + 1;
    uint32_t nc = (visible + s->chunk_tokens - 1) / s->chunk_tokens;
    for (uint32_t qh = 0; qh < Hq; qh++) {
        uint64_t idx0 = s->partial0 + (uint64_t)mg->row * Hq + qh, step = (uint64_t)s->q_len * Hq;
        float mx = -INFINITY;
        for (uint32_t c = 0; c < nc; c++)
            if (pml[2 * (idx0 + c * step)] > mx)
                mx = pml[2 * (idx0 + c * step)];
        for (uint32_t d = 0; d < D; d++)
            tmp[d] = 0;
        float wsum = 0;
        bool chunk_past = false;
        for (uint32_t c = 0; c < nc; c++) {
            float m = pml[2 * (idx0 + c * step)], l = pml[2 * (idx0 + c * step) + 1];
            chunk_past |= l != l; /* its unit marked the row already */
            if (l == 0)           /* no token of the chunk seen */
                continue;
            float w = l * expf(m - mx);
            const float *o = po + (idx0 + c * step) * D;
            wsum += w;
            for (uint32_t d = 0; d < D; d++)
                tmp[d] += w * o[d];
        }
        /* Chunks each in range can pass it together: the weighted sum of
         * their outputs (w up to a chunk's tokens) above FLT_MAX. Such a
         * row is past the float range as a unit's would be: computed again
         * in double, or NaN in a streamed call (kvh.h). */
        bool past = false;
        for (uint32_t d = 0; d < D && !chunk_past && !past; d++)
            past = !(fabsf(tmp[d]) <= FLT_MAX);
        if (past) {
            kvhi_attn_cpu *st = p->cpu_state;
            __atomic_store_n(&st->score_overflow, 1, __ATOMIC_RELAXED);
            if (st->rows_past)
                __atomic_store_n(&st->rows_past[(uint64_t)(s->q_row0 + mg->row) * Hq + qh], 1, __ATOMIC_RELAXED);
        }
        kvhi_attn_store_out(p->io_dtype, out, ((uint64_t)(s->q_row0 + mg->row) * Hq + qh) * D, D, tmp,
                            past       ? NAN
                            : wsum > 0 ? 1.0f / wsum
                                       : 0.0f);
    }
}

static void run_merges(void *arg, uint32_t who)
{
    run_job *j = arg;
    float *tmp = j->scratch + (size_t)who * j->scratch_stride;
    for (;;) {
        uint32_t i = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (i >= j->p->n_merges)
            break;
        merge_row(j->p, &j->p->merges[i], j->po, j->pml, j->out, tmp);
    }
}

static int grow(float **buf, size_t *cap, size_t want)
{
    if (want <= *cap)
        return 0;
    size_t n = *cap ? *cap : 4096;
    while (n < want)
        n *= 2;
    float *b = aligned_alloc(64, n * sizeof(float));
    if (!b)
        return -1;
    free(*buf);
    *buf = b;
    *cap = n;
    return 0;
}

static kvhi_attn_unit_fn pick(const kvhi_attn_cpu *st, const kvhi_attn_plan *p)
{
    int impl = st->impl == KVHI_ATTN_AUTO ? kvhi_attn_cpu_best() : st->impl;
    uint32_t D = p->head_dim, dt = p->kv_dtype;
    if (impl == KVHI_ATTN_AVX512 && D % 16 == 0 && kvhi_attn_units_avx512[dt])
        return kvhi_attn_units_avx512[dt];
    if (impl == KVHI_ATTN_AVX512 && st->impl == KVHI_ATTN_AUTO)
        impl = KVHI_ATTN_AVX2; /* head_dim not a multiple of 16: next best */
    if (impl == KVHI_ATTN_AVX2 && D % 8 == 0 && kvhi_attn_units_avx2[dt])
        return kvhi_attn_units_avx2[dt];
    return D % 4 == 0 ? kvhi_attn_units_generic[dt] : kvhi_attn_units_scalar[dt];
}

/* Runs units [u0, u1) of p, then (merges) its merge rows, with partials
 * po / pml, on up to p->threads participants. run_lock held. */
/* Makes st->rows_past cover p's output rows, zeroed; NULL if it cannot. */
static void rows_past_prepare(kvhi_attn_cpu *st, const kvhi_attn_plan *p)
{
    size_t rows = (size_t)p->total_rows * p->num_q_heads;
    if (st->rows_past && st->rows_past_cap >= rows) {
        if (st->rows_past_dirty)
            memset(st->rows_past, 0, st->rows_past_cap);
    } else {
        free(st->rows_past);
        st->rows_past = calloc(rows ? rows : 1, 1);
        st->rows_past_cap = st->rows_past ? rows : 0;
    }
    st->rows_past_dirty = false;
}

/* The rows marked in st->rows_past (all when it is NULL) computed again in
 * double; the others keep their bits. 0, or KVH_ERR_NOMEM. */
static int redo_rows_past(kvhi_attn_cpu *st, const kvhi_attn_plan *p, const void *q, void *out)
{
    st->rows_past_dirty = true;
    if (!st->rows_past)
        return kvhi_attn_reference(p, q, out);
    size_t rows = (size_t)p->total_rows * p->num_q_heads;
    size_t row_bytes = (size_t)p->head_dim * (p->io_dtype == KVH_DTYPE_F32 ? 4 : 2);
    uint8_t *exact = malloc(rows * row_bytes);
    if (!exact || kvhi_attn_reference(p, q, exact) != 0) {
        free(exact);
        return KVH_ERR_NOMEM;
    }
    for (size_t i = 0; i < rows; i++)
        if (st->rows_past[i])
            memcpy((uint8_t *)out + i * row_bytes, exact + i * row_bytes, row_bytes);
    free(exact);
    return 0;
}

static int run_locked(kvhi_attn_cpu *st, const kvhi_attn_plan *p, uint32_t u0, uint32_t u1, bool merges, const void *q,
                      void *out, float *po, float *pml, char *msg, size_t msg_len)
{
    uint32_t n = u1 - u0, most = merges && p->n_merges > n ? p->n_merges : n;
    uint32_t want = p->threads && p->threads < st->ncpu ? p->threads : st->ncpu;
    if (want > most)
        want = most;
    if (want < 1)
        want = 1;
    if (want > 1 && !st->pool)
        st->pool = kvhi_pool_create(st->ncpu - 1);
    uint32_t parts = want;
    if (parts > kvhi_pool_workers(st->pool) + 1)
        parts = kvhi_pool_workers(st->pool) + 1;
    size_t stride = scratch_floats(p);
    if (stride < p->head_dim + 16)
        stride = p->head_dim + 16;
    if (grow(&st->scratch, &st->scratch_cap, stride * parts) != 0) {
        snprintf(msg, msg_len, "out of memory for attention scratch");
        return KVH_ERR_NOMEM;
    }
    run_job j = {.p = p,
                 .q = q,
                 .out = out,
                 .fn = pick(st, p),
                 .po = po,
                 .pml = pml,
                 .scratch = st->scratch,
                 .scratch_stride = stride,
                 .end = u1};
    atomic_init(&j.next, u0);
    if (n)
        kvhi_pool_run(st->pool, parts < n ? parts : n, run_units, &j);
    if (merges && p->n_merges) {
        uint32_t mparts = parts < p->n_merges ? parts : p->n_merges;
        atomic_store(&j.next, 0);
        kvhi_pool_run(st->pool, mparts, run_merges, &j);
    }
    return 0;
}

void *kvhi_attn_cpu_q_kept(const kvhi_attn_plan *p, const void *q, const void *out, bool *failed)
{
    size_t bytes = (size_t)p->total_rows * p->num_q_heads * p->head_dim * (p->io_dtype == KVH_DTYPE_F32 ? 4 : 2);
    return kvhi_attn_q_kept(q, out, bytes, failed);
}

void *kvhi_attn_q_kept(const void *q, const void *out, size_t bytes, bool *failed)
{
    *failed = false;
    if (!bytes ||
        !((const uint8_t *)q < (const uint8_t *)out + bytes && (const uint8_t *)out < (const uint8_t *)q + bytes))
        return NULL;
    void *kept = malloc(bytes);
    if (kept)
        memcpy(kept, q, bytes);
    *failed = !kept;
    return kept;
}

static int run_call(const kvhi_attn_plan *p, const void *q, void *out, void (*done)(void *), void *done_arg, char *msg,
                    size_t msg_len)
{
    kvhi_attn_cpu *st = p->cpu_state;
    if (!st) {
        snprintf(msg, msg_len, "CPU attention state missing");
        return KVH_ERR_INTERNAL;
    }
    /* Out over q, whole or in part: every pass reads a copy, since a row
     * written may be queries another row has yet to read. */
    bool failed = false;
    void *q_kept = kvhi_attn_cpu_q_kept(p, q, out, &failed);
    if (failed) {
        snprintf(msg, msg_len, "out of memory for a copy of q (out overlaps it)");
        return KVH_ERR_NOMEM;
    }
    if (q_kept)
        q = q_kept;
    pthread_mutex_lock(&st->run_lock);
    if (st->impl == KVHI_ATTN_REFERENCE) {
        int rc = kvhi_attn_reference(p, q, out);
        free(q_kept);
        pthread_mutex_unlock(&st->run_lock);
        if (rc != 0) {
            snprintf(msg, msg_len, "out of memory for the reference kernel");
            return KVH_ERR_NOMEM;
        }
        done(done_arg);
        return 0;
    }
    if (grow(&st->partial, &st->partial_cap, (size_t)p->n_partial_rows * (p->head_dim + 2)) != 0) {
        free(q_kept);
        pthread_mutex_unlock(&st->run_lock);
        snprintf(msg, msg_len, "out of memory for attention scratch");
        return KVH_ERR_NOMEM;
    }
    /* no split-K partials: no buffer (NULL + 0 is undefined) */
    float *pml = st->partial ? st->partial + (size_t)p->n_partial_rows * p->head_dim : NULL;
    __atomic_store_n(&st->score_overflow, 0, __ATOMIC_RELAXED);
    rows_past_prepare(st, p);
    int rc = run_locked(st, p, 0, p->n_units, true, q, out, st->partial, pml, msg, msg_len);
    /* Rows past the float range (|q . k| x scale, q x scale or the sum of
     * weighted values above 3.4e38): from finite inputs they came out
     * inf or NaN where the answer is finite. They are computed again in
     * double, as the reference kernel does. */
    if (rc == 0 && __atomic_load_n(&st->score_overflow, __ATOMIC_RELAXED) && redo_rows_past(st, p, q, out) != 0) {
        snprintf(msg, msg_len, "out of memory for attention scores past the float range");
        rc = KVH_ERR_NOMEM;
    }
    free(q_kept);
    if (rc != 0) {
        pthread_mutex_unlock(&st->run_lock);
        return rc;
    }
    pthread_mutex_unlock(&st->run_lock);
    done(done_arg);
    return 0;
}

int kvhi_attn_cpu_run(void *ctx, const kvhi_attn_plan *p, const void *q, void *out, void *stream, void (*done)(void *),
                      void *done_arg, char *msg, size_t msg_len)
{
    (void)ctx;
    (void)stream;
    kvhi_fp_env env = kvhi_fp_default_enter(); /* the caller's rounding and flush-to-zero set aside */
    int rc = run_call(p, q, out, done, done_arg, msg, msg_len);
    kvhi_fp_leave(env);
    return rc;
}

int kvhi_attn_cpu_run_range(kvhi_attn_cpu *st, const kvhi_attn_plan *p, uint32_t u0, uint32_t u1, bool merges,
                            const void *q, void *out, float *po, float *pml, char *msg, size_t msg_len)
{
    kvhi_fp_env env = kvhi_fp_default_enter();
    pthread_mutex_lock(&st->run_lock);
    /* Not computed again (such rows of a streamed call are NaN): no row
     * marks are kept. */
    uint8_t *marks = st->rows_past;
    st->rows_past = NULL;
    int rc = run_locked(st, p, u0, u1, merges, q, out, po, pml, msg, msg_len);
    st->rows_past = marks;
    pthread_mutex_unlock(&st->run_lock);
    kvhi_fp_leave(env);
    return rc;
}
