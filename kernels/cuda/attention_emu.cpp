/* Runs the CUDA attention kernels (attention_kernels.cuh) on CPU threads,
 * the CUDA threads of a CTA as coroutines, with shims for the CUDA
 * built-ins (__syncthreads = a barrier of the CTA's 128 threads, warp
 * shuffles = exchange through memory between barriers of the warp's 32
 * threads,
 * cp.async = an immediate copy, the fp16/bf16 conversions = kvh's own
 * round-to-nearest-even ones). It checks the kernels' indexing, tiling,
 * masking, online softmax and split-K merge against the scalar reference
 * (kvhi_attn_reference) on plans made by the real planner, over a sweep
 * of shapes, where no GPU is. Timing, memory ordering of cp.async and
 * real-hardware numerics are what it does not check: test_cuda_attention
 * does that on a GPU.
 *
 *   kvh_attention_emu [cases]     exit 0 when every case matches */
#include <math.h>
#include <ucontext.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/attention_dtype.h"
#include "kernels/attention_plan.h"

/* ---- CUDA shims ---- */
#define KVH_CUDA_EMU 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __align__(x)
#define __shared__

struct dim3_ {
    unsigned x, y, z;
};
static dim3_ threadIdx, blockIdx;

struct float2 {
    float x, y;
};
struct float4 {
    float x, y, z, w;
};
struct uint4 {
    uint32_t x, y, z, w;
};
struct __half {
    uint16_t v;
};
struct __nv_bfloat16 {
    uint16_t v;
};
static inline float __half2float(__half h) { return kvhi_f16_to_f32(h.v); }
static inline __half __float2half_rn(float f) { return __half{kvhi_f32_to_f16(f)}; }
static inline float __bfloat162float(__nv_bfloat16 h) { return kvhi_bf16_to_f32(h.v); }
static inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16{kvhi_f32_to_bf16(f)}; }
static inline __half __ushort_as_half(unsigned short v) { return __half{v}; }
static inline float __uint_as_float(uint32_t v) { return kvhi_bits_f32(v); }

/* The CTA's 128 threads are coroutines (ucontext) of one OS thread,
 * switched only at barriers: deterministic, and cheap enough to run
 * thousands of CTAs. A barrier some threads never reach is reported as a
 * deadlock instead of hanging. */
enum { NTHREADS = 128, STACK = 256 * 1024 };
static ucontext_t sched_ctx, co_ctx[NTHREADS];
static int co_wait[NTHREADS];     /* barrier waited on, or -1 */
static unsigned co_gen[NTHREADS]; /* its generation when it waited */
static bool co_done[NTHREADS];
static unsigned bar_gen[1 + NTHREADS / 32], bar_arrived[1 + NTHREADS / 32];
static float shfl_buf[NTHREADS / 32][32];

static void emu_barrier(int id, unsigned count)
{
    unsigned me = threadIdx.x;
    if (++bar_arrived[id] == count) {
        bar_arrived[id] = 0;
        bar_gen[id]++;
        return;
    }
    co_wait[me] = id;
    co_gen[me] = bar_gen[id];
    /* Other coroutines write shared memory meanwhile: nothing may stay
     * cached in registers across the switch. */
    __asm__ __volatile__("" ::: "memory");
    swapcontext(&co_ctx[me], &sched_ctx);
    __asm__ __volatile__("" ::: "memory");
}

static inline void __syncthreads() { emu_barrier(0, NTHREADS); }
static inline float __shfl_xor_sync(unsigned mask, float v, int o)
{
    (void)mask;
    unsigned w = threadIdx.x / 32, l = threadIdx.x % 32;
    shfl_buf[w][l] = v;
    emu_barrier(1 + (int)w, 32);
    float r = shfl_buf[w][l ^ (unsigned)o];
    emu_barrier(1 + (int)w, 32);
    return r;
}
static inline void kvhc_emu_copy(void *dst, const void *src, int n, bool valid)
{
    if (valid)
        memcpy(dst, src, (size_t)n);
    else
        memset(dst, 0, (size_t)n);
}

namespace kvhc
{
alignas(16) static uint8_t sm[256 * 1024];
}

#include "kernels/cuda/attention_kernels.cuh"

using namespace kvhc;

/* ---- a grid runner: CTAs one after the other ---- */

template <typename KT, typename IT> static void call_attn(const attn_args &a) { attn_kernel<KT, IT>(a); }
template <typename IT> static void call_merge(const attn_args &a) { merge_kernel<IT>(a); }

static void (*cur_fn)(const attn_args &);
static const attn_args *cur_args;
static char *stacks;

static void co_entry(void)
{
    cur_fn(*cur_args);
    co_done[threadIdx.x] = true;
}

static int launch(void (*fn)(const attn_args &), const attn_args &a, unsigned gx, unsigned gy)
{
    if (!stacks && !(stacks = (char *)malloc((size_t)NTHREADS * STACK)))
        return 1;
    cur_fn = fn;
    cur_args = &a;
    for (unsigned y = 0; y < gy; y++)
        for (unsigned x = 0; x < gx; x++) {
            blockIdx = dim3_{x, y, 0};
            memset(bar_arrived, 0, sizeof(bar_arrived));
            for (unsigned t = 0; t < NTHREADS; t++) {
                getcontext(&co_ctx[t]);
                co_ctx[t].uc_stack.ss_sp = stacks + (size_t)t * STACK;
                co_ctx[t].uc_stack.ss_size = STACK;
                co_ctx[t].uc_link = &sched_ctx;
                makecontext(&co_ctx[t], co_entry, 0);
                co_wait[t] = -1;
                co_done[t] = false;
            }
            for (unsigned left = NTHREADS;;) {
                bool progress = false;
                left = 0;
                for (unsigned t = 0; t < NTHREADS; t++) {
                    if (co_done[t])
                        continue;
                    left++;
                    if (co_wait[t] >= 0 && bar_gen[co_wait[t]] == co_gen[t])
                        continue;
                    co_wait[t] = -1;
                    threadIdx = dim3_{t, 0, 0};
                    __asm__ __volatile__("" ::: "memory");
                    swapcontext(&sched_ctx, &co_ctx[t]);
                    __asm__ __volatile__("" ::: "memory");
                    progress = true;
                }
                if (!left)
                    break;
                if (!progress) {
                    fprintf(stderr, "CTA (%u, %u): barrier deadlock\n", x, y);
                    return 1;
                }
            }
        }
    return 0;
}

template <typename KT> static void (*pick_attn(uint32_t io))(const attn_args &)
{
    return io == 1 ? call_attn<KT, __half> : io == 2 ? call_attn<KT, __nv_bfloat16> : call_attn<KT, float>;
}

/* ---- cases ---- */

static uint64_t rng_state = 0x1234567;
static uint64_t rnd()
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static float rnd_val() { return (float)((int)(rnd() % 255) - 127) / 64.0f; }

static int run_case(int c, uint32_t D, uint32_t bt, uint32_t kvt, uint32_t io, uint32_t Hkv, uint32_t G, uint32_t n,
                    const uint32_t *kv_len, const uint32_t *q_len, uint32_t target_units)
{
    const uint32_t Hq = Hkv * G, layers = 2, layer = 1, eb = kvt == 0 ? 4 : 2;
    const uint64_t layer_bytes = 2ull * Hkv * bt * D * eb, block_bytes = layer_bytes * layers;
    uint32_t nblk = 0;
    for (uint32_t i = 0; i < n; i++)
        nblk += (kv_len[i] + bt - 1) / bt;
    /* a tier with spare slots; blocks in shuffled slots */
    uint32_t cap = nblk * 2 + 3;
    uint8_t *tier = (uint8_t *)aligned_alloc(256, (size_t)cap * block_bytes);
    for (size_t x = 0; x < (size_t)cap * block_bytes / eb; x++)
        kvhi_store_from_f32(kvt, tier, x, rnd_val());
    uint32_t *perm = (uint32_t *)malloc(sizeof(uint32_t) * cap);
    for (uint32_t i = 0; i < cap; i++)
        perm[i] = i;
    for (uint32_t i = cap - 1; i > 0; i--) {
        uint32_t j = (uint32_t)(rnd() % (i + 1)), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    kvhi_attn_plan p;
    memset(&p, 0, sizeof(p));
    p.num_q_heads = Hq;
    p.num_kv_heads = Hkv;
    p.head_dim = D;
    p.block_tokens = bt;
    while ((1u << p.block_shift) < bt)
        p.block_shift++;
    p.kv_dtype = kvt;
    p.io_dtype = io;
    p.scale = 1.0f / sqrtf((float)D);
    p.block_bytes = block_bytes;
    p.layer_offset = layer * layer_bytes;
    p.kv_base = tier;
    kvhi_attn_plan_opts o = {16, target_units, 32, 0, 0};
    if (kvhi_attn_plan_build(&p, &o, kv_len, q_len, n) != 0) {
        fprintf(stderr, "case %d: plan failed\n", c);
        return 1;
    }
    for (uint32_t k = 0; k < p.n_slots; k++)
        p.slots[k] = (int32_t)perm[k];
    size_t elems = (size_t)p.total_rows * Hq * D, iob = io == 0 ? 4 : 2;
    uint8_t *q = (uint8_t *)malloc(elems * iob), *ref = (uint8_t *)malloc(elems * iob),
            *out = (uint8_t *)malloc(elems * iob);
    for (size_t x = 0; x < elems; x++)
        kvhi_store_from_f32(io, q, x, rnd_val());
    memset(ref, 0xff, elems * iob);
    memset(out, 0xff, elems * iob);
    kvhi_attn_reference(&p, q, ref);

    attn_args a;
    size_t smem = 0;
    geometry(&p, &a, &smem);
    if (smem > sizeof(kvhc::sm)) {
        fprintf(stderr, "case %d: %zu bytes of shared memory\n", c, smem);
        return 1;
    }
    size_t np = p.n_partial_rows ? p.n_partial_rows : 1;
    float *po = (float *)malloc(np * D * sizeof(float)), *pml = (float *)malloc(np * 2 * sizeof(float));
    memset(po, 0xff, np * D * sizeof(float));
    memset(pml, 0xff, np * 2 * sizeof(float));
    a.kv = (const uint8_t *)p.kv_base + p.layer_offset;
    a.block_bytes = p.block_bytes;
    a.seqs = p.seqs;
    a.slots = p.slots;
    a.units = p.units;
    a.merges = p.merges;
    a.q = q;
    a.out = out;
    a.po = po;
    a.pml = pml;
    void (*fn)(const attn_args &) = kvt == 1   ? pick_attn<__half>(io)
                                    : kvt == 2 ? pick_attn<__nv_bfloat16>(io)
                                               : pick_attn<float>(io);
    if (launch(fn, a, p.n_units, 1) || (p.n_merges && launch(io == 1   ? call_merge<__half>
                                                             : io == 2 ? call_merge<__nv_bfloat16>
                                                                       : call_merge<float>,
                                                             a, p.n_merges, Hq)))
        return 1;

    double rtol = io == 0 ? 1e-5 : io == 1 ? 0x1p-10 : 0x1p-7, atol = 1e-5 * 2;
    int bad = 0;
    double worst = 0;
    for (size_t x = 0; x < elems && bad < 5; x++) {
        double g = kvhi_load_as_f32(io, out, x), w = kvhi_load_as_f32(io, ref, x);
        double e = fabs(g - w) / (rtol * fabs(w) + atol);
        if (!(e <= 1.0)) {
            fprintf(stderr, "case %d: element %zu (row %zu head %zu dim %zu): %.8g vs reference %.8g\n", c, x,
                    x / (Hq * D), x / D % Hq, x % D, g, w);
            bad++;
        } else if (e > worst)
            worst = e;
    }
    printf("case %2d: D %3u bt %2u kv %u io %u Hkv %u G %2u seqs %u units %4u merges %3u TK %2u unit %2u: %s "
           "(worst %.2f of bound)\n",
           c, D, bt, kvt, io, Hkv, G, n, p.n_units, p.n_merges, a.TK, a.unit, bad ? "FAIL" : "ok", worst);
    kvhi_attn_plan_free(&p);
    free(tier);
    free(perm);
    free(q);
    free(ref);
    free(out);
    free(po);
    free(pml);
    return bad != 0;
}

int main(int argc, char **argv)
{
    int cases = argc > 1 ? atoi(argv[1]) : 24;
    static const uint32_t dims[] = {64, 128, 80, 96, 256, 8, 24, 5, 40};
    static const uint32_t bts[] = {16, 32, 1, 4, 64};
    static const uint32_t gqa[] = {1, 4, 8, 2, 3, 16, 20};
    static const uint32_t lens[] = {1, 15, 16, 17, 33, 100, 300, 700};
    int failed = 0;
    for (int c = 0; c < cases; c++) {
        uint32_t D = dims[c < 9 ? c : rnd() % 9], bt = bts[c % 5 == 4 ? rnd() % 5 : rnd() % 2];
        uint32_t kvt = (uint32_t)(c % 3), io = (uint32_t)(rnd() % 3), Hkv = 1 + (uint32_t)(rnd() % 2);
        uint32_t G = gqa[rnd() % 7];
        uint32_t n = 1 + (uint32_t)(rnd() % 3), kvl[4], ql[4];
        for (uint32_t i = 0; i < n; i++) {
            kvl[i] = lens[rnd() % 8];
            ql[i] = c % 2 ? 1 : 1 + (uint32_t)(rnd() % (kvl[i] < 40 ? kvl[i] : 40));
        }
        /* odd cases plan for many units: split-K with small chunks */
        failed |= run_case(c, D, bt, kvt, io, Hkv, G, n, kvl, ql, c % 4 < 2 ? 4 : 400);
    }
    free(stacks);
    printf("%s\n", failed ? "FAIL" : "OK");
    return failed;
}
