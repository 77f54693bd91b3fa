/* CPU paged attention: the per-engine state (thread pool, scratch), the
 * kernel variants chosen at run time, and the backend entry points. */
#ifndef KVH_KERNELS_CPU_ATTN_CPU_H
#define KVH_KERNELS_CPU_ATTN_CPU_H

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Relative includes: benchmarks/ includes this header with only the public
 * include directory on its path. */
#include "kvh/kvh.h"
#include "../attention_dtype.h"
#include "../attention_plan.h"
#include "thread_pool.h"

/* Implementations, for tests and benchmarks (kvhi_attention_set_impl). */
enum kvhi_attn_impl {
    KVHI_ATTN_AUTO = 0,      /* the best fast kernel this CPU runs */
    KVHI_ATTN_REFERENCE = 1, /* kvhi_attn_reference, single thread */
    KVHI_ATTN_GENERIC = 2,   /* fast kernel, portable C (4-lane vectors; one
                                lane where head_dim % 4 != 0) */
    KVHI_ATTN_AVX2 = 3,      /* fast kernel, AVX2 + FMA + F16C */
    KVHI_ATTN_AVX512 = 4     /* fast kernel, AVX-512 F/BW/VL/DQ */
};

/* Selects the implementation the CPU backend of engine e uses from now on
 * (tests, benchmarks). KVH_ERR_UNSUPPORTED when the CPU lacks it or the
 * engine is not on the CPU backend. (abi/api_attention.c) */
kvh_status kvhi_attention_set_impl(kvh_engine *e, int impl);

/* Tokens per tile of the fast kernels (a power of two), and tiles ahead
 * whose K and V are prefetched. */
#define KVHI_ATTN_TILE 32u
#define KVHI_ATTN_PREFETCH_TILES 2u

/* Runs one unit; scratch holds kvhi_attn_cpu_scratch_floats() floats. */
typedef void (*kvhi_attn_unit_fn)(const kvhi_attn_plan *p, const kvhi_attn_unit *u, const void *q, void *out,
                                  float *partial_o, float *partial_m_l, float *scratch);

/* Per-ISA tables indexed by kv dtype; NULL entries where not built. */
extern const kvhi_attn_unit_fn kvhi_attn_units_generic[3]; /* head_dim % 4 == 0 */
extern const kvhi_attn_unit_fn kvhi_attn_units_scalar[3];  /* any head_dim */
extern const kvhi_attn_unit_fn kvhi_attn_units_avx2[3];
extern const kvhi_attn_unit_fn kvhi_attn_units_avx512[3];

typedef struct kvhi_attn_cpu {
    pthread_mutex_t run_lock; /* one run at a time; guards all below */
    kvhi_pool *pool;          /* made on the first multi-threaded run */
    uint32_t ncpu;
    int impl;           /* enum kvhi_attn_impl */
    float *partial;     /* split-K partials, grow-only */
    size_t partial_cap; /* floats */
    float *scratch;     /* per-participant unit scratch, grow-only */
    size_t scratch_cap; /* floats */
    /* Set (__atomic, by any unit) when a row passed the float range
     * (attn_body.inc): finite inputs whose answer is finite, or
     * non-finite ones. kvhi_attn_cpu_run computes such rows again in
     * double; the other rows keep their bits. */
    int score_overflow;
    /* One byte per output row (q row x query head) of the run, set for
     * the rows above; NULL when it could not be had (the whole call is
     * then computed again). Zero between runs unless rows_past_dirty. */
    uint8_t *rows_past;
    size_t rows_past_cap;
    bool rows_past_dirty;
} kvhi_attn_cpu;

kvhi_attn_cpu *kvhi_attn_cpu_create(void);
/* Runs units [u0, u1) of p, then (merges) its merge rows, with the
 * caller's split-K partials po (n_partial_rows x head_dim floats) and pml
 * (n_partial_rows pairs: each chunk's score maximum and exponential sum):
 * a streamed call runs its chunks one range at a time.
 * Returns 0, or KVH_ERR_NOMEM with msg. */
int kvhi_attn_cpu_run_range(kvhi_attn_cpu *st, const kvhi_attn_plan *p, uint32_t u0, uint32_t u1, bool merges,
                            const void *q, void *out, float *po, float *pml, char *msg, size_t msg_len);
/* A copy of the bytes of q (malloc'd) when out overlaps them, which a
 * run writes while other rows still read q; NULL when they do not overlap
 * (*failed false) or without memory (*failed true). */
void *kvhi_attn_q_kept(const void *q, const void *out, size_t bytes, bool *failed);
/* kvhi_attn_q_kept for the rows of plan p. */
void *kvhi_attn_cpu_q_kept(const kvhi_attn_plan *p, const void *q, const void *out, bool *failed);
void kvhi_attn_cpu_destroy(void *state);
/* 1 when this CPU (and OS) runs the implementation. */
int kvhi_attn_cpu_supported(int impl);
/* The implementation KVH_ATTN_ISA names (reference, generic, avx2,
 * avx512), or -1. */
int kvhi_attn_isa_by_name(const char *name);
/* The implementation an AUTO run uses on this machine. */
int kvhi_attn_cpu_best(void);

/* Backend ops of the CPU backend (core/backend_cpu.c). */
void kvhi_attn_cpu_plan_opts(void *ctx, uint32_t threads, kvhi_attn_plan_opts *opts);
int kvhi_attn_cpu_run(void *ctx, const kvhi_attn_plan *plan, const void *q, void *out, void *stream,
                      void (*done)(void *), void *done_arg, char *msg, size_t msg_len);

/* ---- helpers shared by the kernel variants ---- */

static inline void kvhi_attn_load_q(uint32_t dtype, const void *q, uint64_t off, uint32_t D, float scale, float *dst)
{
    for (uint32_t d = 0; d < D; d++)
        dst[d] = kvhi_load_as_f32(dtype, q, off + d) * scale;
}

static inline void kvhi_attn_store_out(uint32_t dtype, void *out, uint64_t off, uint32_t D, const float *acc, float inv)
{
    for (uint32_t d = 0; d < D; d++)
        kvhi_store_from_f32(dtype, out, off + d, acc[d] * inv);
}

static inline void kvhi_attn_prefetch(const void *p, size_t bytes)
{
    for (size_t o = 0; o < bytes; o += 64)
        __builtin_prefetch((const char *)p + o, 0, 3);
}

#endif
