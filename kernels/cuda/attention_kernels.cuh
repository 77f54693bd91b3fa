/* Device code of CUDA paged attention (see attention.cu for the design):
 * the attention kernel and the split-K merge kernel. Included by
 * attention.cu, and by attention_emu.cpp, which runs the same code on CPU
 * threads (KVH_CUDA_EMU: shims for the CUDA built-ins) so the kernels'
 * logic is tested where no GPU is. */
#ifndef KVH_KERNELS_CUDA_ATTENTION_KERNELS_CUH
#define KVH_KERNELS_CUDA_ATTENTION_KERNELS_CUH

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels/attention_plan.h"

namespace kvhc
{

constexpr int NT = 128;              /* threads per CTA */
constexpr int QT = 16;               /* query vectors per unit, at most */
constexpr int TKMAX = 64;            /* tokens per tile, at most */
constexpr int QPT = QT * TKMAX / NT; /* score dots per thread, at most */
constexpr uint32_t MAX_D = 256;
constexpr uint32_t TILE_BYTES = 20480; /* K+V of one tile */

struct attn_args {
    const uint8_t *kv; /* device tier base + layer offset */
    uint64_t block_bytes;
    /* slab layout (kernels/slab_layout.h): slab_shift 0 = plain */
    uint64_t slab_bytes, piece_bytes, pitch;
    uint32_t slab_shift;
    const kvhi_attn_seq *seqs;
    const int32_t *slots;
    const kvhi_attn_unit *units;
    const kvhi_attn_merge *merges;
    const void *q;
    void *out;
    float *po;  /* partial outputs, n_partial_rows x D */
    float *pml; /* per partial row: the chunk's score maximum (log2 units) and sum */
    uint32_t Hq, Hkv, G, D, DP, bt, bshift;
    uint32_t row_bytes; /* D * element bytes (global rows) */
    uint32_t srow;      /* shared-memory row stride in bytes */
    uint32_t TK;
    uint32_t unit; /* global->shared copy granule: 16, 4 or 2 bytes */
    float scale_log2;
};

/* ---- element conversions ---- */

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

/* 8 consecutive elements at p (16-byte aligned in shared memory) as f32. */
__device__ __forceinline__ void load8(const float *p, float *f)
{
    float4 a = reinterpret_cast<const float4 *>(p)[0], b = reinterpret_cast<const float4 *>(p)[1];
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}
/* 16-bit elements: one 16-byte load, then bit operations on its words
 * (no type punning of locals, which the compiler's alias analysis may
 * break). */
__device__ __forceinline__ void load8(const __half *p, float *f)
{
    uint4 v = *reinterpret_cast<const uint4 *>(p);
    uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __half2float(__ushort_as_half((unsigned short)(w[i] & 0xffffu)));
        f[2 * i + 1] = __half2float(__ushort_as_half((unsigned short)(w[i] >> 16)));
    }
}
__device__ __forceinline__ void load8(const __nv_bfloat16 *p, float *f)
{
    uint4 v = *reinterpret_cast<const uint4 *>(p);
    uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

/* ---- global -> shared copies (cp.async, sm_80+) ---- */

#ifndef KVH_CUDA_EMU
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool valid)
{
    unsigned s = (unsigned)__cvta_generic_to_shared(dst);
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async4(void *dst, const void *src, bool valid)
{
    unsigned s = (unsigned)__cvta_generic_to_shared(dst);
    int n = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
#else
/* emulation: copies complete at once (the emulator's cp_async_* shims) */
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool valid)
{
    kvhc_emu_copy(dst, src, 16, valid);
}
__device__ __forceinline__ void cp_async4(void *dst, const void *src, bool valid) { kvhc_emu_copy(dst, src, 4, valid); }
__device__ __forceinline__ void cp_async_commit() {}
template <int N> __device__ __forceinline__ void cp_async_wait() {}
#endif

__device__ __forceinline__ void copy_unit(uint8_t *dst, const uint8_t *src, uint32_t unit, bool valid)
{
    if (unit == 16)
        cp_async16(dst, src, valid);
    else if (unit == 4)
        cp_async4(dst, src, valid);
    else
        *reinterpret_cast<uint16_t *>(dst) = valid ? *reinterpret_cast<const uint16_t *>(src) : (uint16_t)0;
}

/* Queues the copy of tokens [t0, t0 + TK) of K (rows 0..TK-1) and V (rows
 * TK..2TK-1) into st; tokens >= kend are zero-filled. */
/* Where a slot starts, past kv (attention_plan.h, kvhi_attn_slot_offset). */
__device__ __forceinline__ size_t slot_offset(const attn_args &a, uint32_t slot)
{
    if (!a.slab_shift)
        return (size_t)slot * a.block_bytes;
    return (size_t)(slot >> a.slab_shift) * a.slab_bytes + (size_t)(slot & ((1u << a.slab_shift) - 1)) * a.piece_bytes;
}

__device__ __forceinline__ void load_tile(const attn_args &a, uint8_t *st, const int32_t *slots, size_t hk, size_t hv,
                                          uint32_t t0, uint32_t kend)
{
    const uint32_t unit = a.unit, upr = a.row_bytes / unit, rows = 2 * a.TK;
    if (upr <= (uint32_t)NT) {
        const uint32_t per_pass = NT / upr, r0 = threadIdx.x / upr, uu = threadIdx.x % upr;
        if (r0 >= per_pass)
            return;
        for (uint32_t r = r0; r < rows; r += per_pass) {
            const bool is_v = r >= a.TK;
            const uint32_t tok = t0 + r - (is_v ? a.TK : 0);
            const bool valid = tok < kend;
            const uint8_t *src = a.kv;
            if (valid)
                src = a.kv + slot_offset(a, (uint32_t)slots[tok >> a.bshift]) + (is_v ? hv : hk) +
                      (size_t)(tok & (a.bt - 1)) * a.row_bytes + uu * unit;
            copy_unit(st + r * a.srow + uu * unit, src, unit, valid);
        }
    } else {
        for (uint32_t i = threadIdx.x; i < rows * upr; i += NT) {
            const uint32_t r = i / upr, uu = i % upr;
            const bool is_v = r >= a.TK;
            const uint32_t tok = t0 + r - (is_v ? a.TK : 0);
            const bool valid = tok < kend;
            const uint8_t *src = a.kv;
            if (valid)
                src = a.kv + slot_offset(a, (uint32_t)slots[tok >> a.bshift]) + (is_v ? hv : hk) +
                      (size_t)(tok & (a.bt - 1)) * a.row_bytes + uu * unit;
            copy_unit(st + r * a.srow + uu * unit, src, unit, valid);
        }
    }
}

__device__ __forceinline__ float warp_max(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

template <typename KT, typename IT> __global__ void __launch_bounds__(NT) attn_kernel(attn_args a)
{
    extern __shared__ __align__(16) uint8_t sm[];
    const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const kvhi_attn_unit u = a.units[blockIdx.x];
    const kvhi_attn_seq s = a.seqs[u.seq];
    const uint32_t ng = u.g1 - u.g0, nq = (u.q1 - u.q0) * ng;
    const uint32_t TK = a.TK, D = a.D, DP = a.DP, srow = a.srow;

    uint8_t *stage0 = sm, *stage1 = sm + 2 * TK * srow;
    float *qs = reinterpret_cast<float *>(sm + 4 * TK * srow); /* QT x DP */
    float *sc = qs + QT * DP;                                  /* QT x TK */
    float *m_s = sc + QT * TK, *l_s = m_s + QT, *al_s = l_s + QT;

    /* Zero the pad columns [D, DP) of every shared row once. */
    if (DP > D)
        for (uint32_t i = tid; i < 4 * TK * (DP - D); i += NT) {
            uint32_t r = i / (DP - D), c = D + i % (DP - D);
            *reinterpret_cast<KT *>(sm + r * srow + c * sizeof(KT)) = from_f<KT>(0.0f);
        }
    /* The unit's queries, scaled by scale * log2(e), zero past D / nq. */
    for (uint32_t i = tid; i < QT * DP; i += NT) {
        uint32_t n = i / DP, d = i % DP;
        float v = 0.0f;
        if (n < nq && d < D) {
            uint32_t r = u.q0 + n / ng, qh = u.kv_head * a.G + u.g0 + n % ng;
            v = to_f(reinterpret_cast<const IT *>(a.q)[((size_t)(s.q_row0 + r) * a.Hq + qh) * D + d]) * a.scale_log2;
        }
        qs[i] = v;
    }
    if (tid < QT) {
        m_s[tid] = -INFINITY;
        l_s[tid] = 0.0f;
        al_s[tid] = 1.0f;
    }
    const uint32_t lim0 = s.kv_len - s.q_len + u.q0 + 1; /* tokens query row q0 sees */
    const uint32_t kend = u.k1;
    const uint32_t ntiles = (kend - u.k0 + TK - 1) / TK;
    const int32_t *slots = a.slots + s.blk0;
    const size_t hk = (size_t)u.kv_head * a.pitch;
    const size_t hv = (size_t)(a.Hkv + u.kv_head) * a.pitch;

    load_tile(a, stage0, slots, hk, hv, u.k0, kend);
    cp_async_commit();

    float acc[2][QT];
#pragma unroll
    for (int ci = 0; ci < 2; ci++)
#pragma unroll
        for (int n = 0; n < QT; n++)
            acc[ci][n] = 0.0f;

    const uint32_t groups = NT / TK, n0 = tid / TK, tt = tid % TK;
    for (uint32_t it = 0; it < ntiles; it++) {
        if (it + 1 < ntiles) {
            load_tile(a, (it & 1) ? stage0 : stage1, slots, hk, hv, u.k0 + (it + 1) * TK, kend);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const uint8_t *Kt = (it & 1) ? stage1 : stage0;
        const KT *Vt = reinterpret_cast<const KT *>(Kt + TK * srow);
        const uint32_t t0 = u.k0 + it * TK;

        /* scores: this thread's token tt against queries n0, n0 + groups, .. */
        {
            float dots[QPT];
#pragma unroll
            for (int j = 0; j < QPT; j++)
                dots[j] = 0.0f;
            const KT *krow = reinterpret_cast<const KT *>(Kt + tt * srow);
            for (uint32_t d = 0; d < DP; d += 8) {
                float kf[8];
                load8(krow + d, kf);
#pragma unroll
                for (int j = 0; j < QPT; j++) {
                    uint32_t n = n0 + j * groups;
                    if (n < nq) {
                        const float4 *qp = reinterpret_cast<const float4 *>(qs + n * DP + d);
                        float4 x = qp[0], y = qp[1];
                        dots[j] += x.x * kf[0] + x.y * kf[1] + x.z * kf[2] + x.w * kf[3] + y.x * kf[4] + y.y * kf[5] +
                                   y.z * kf[6] + y.w * kf[7];
                    }
                }
            }
            const uint32_t tok = t0 + tt;
#pragma unroll
            for (int j = 0; j < QPT; j++) {
                uint32_t n = n0 + j * groups;
                if (n < nq) {
                    uint32_t lim = lim0 + n / ng;
                    sc[n * TK + tt] = (tok < kend && tok < lim) ? dots[j] : -INFINITY;
                }
            }
        }
        __syncthreads();

        /* online softmax, a warp per query */
        for (uint32_t n = warp; n < nq; n += NT / 32) {
            float v0 = lane < TK ? sc[n * TK + lane] : -INFINITY;
            float v1 = lane + 32 < TK ? sc[n * TK + lane + 32] : -INFINITY;
            float mx = warp_max(fmaxf(v0, v1));
            float mold = m_s[n], mnew = fmaxf(mold, mx);
            float p0 = 0.0f, p1 = 0.0f, alpha = 1.0f;
            if (mnew != -INFINITY) {
                p0 = exp2f(v0 - mnew);
                p1 = exp2f(v1 - mnew);
                alpha = exp2f(mold - mnew);
            }
            if (lane < TK)
                sc[n * TK + lane] = p0;
            if (lane + 32 < TK)
                sc[n * TK + lane + 32] = p1;
            float sum = warp_sum(p0 + p1);
            if (lane == 0) {
                m_s[n] = mnew;
                l_s[n] = l_s[n] * alpha + sum;
                al_s[n] = alpha;
            }
        }
        __syncthreads();

        /* out += p . V: this thread's columns tid and tid + 128 */
#pragma unroll
        for (int ci = 0; ci < 2; ci++) {
            const uint32_t c = tid + ci * NT;
            if (c < D) {
#pragma unroll
                for (int n = 0; n < QT; n++)
                    if (n < (int)nq)
                        acc[ci][n] *= al_s[n];
                for (uint32_t t = 0; t < TK; t += 4) {
                    const float v0 = to_f(Vt[(t + 0) * (srow / sizeof(KT)) + c]);
                    const float v1 = to_f(Vt[(t + 1) * (srow / sizeof(KT)) + c]);
                    const float v2 = to_f(Vt[(t + 2) * (srow / sizeof(KT)) + c]);
                    const float v3 = to_f(Vt[(t + 3) * (srow / sizeof(KT)) + c]);
#pragma unroll
                    for (int n = 0; n < QT; n++)
                        if (n < (int)nq) {
                            float4 p = *reinterpret_cast<const float4 *>(sc + n * TK + t);
                            acc[ci][n] += p.x * v0 + p.y * v1 + p.z * v2 + p.w * v3;
                        }
                }
            }
        }
        __syncthreads(); /* the next iteration refills this stage */
    }

    /* write out (or the partials of a split sequence) */
#pragma unroll
    for (int ci = 0; ci < 2; ci++) {
        const uint32_t c = tid + ci * NT;
        if (c < D) {
#pragma unroll
            for (int n = 0; n < QT; n++)
                if (n < (int)nq) {
                    uint32_t r = u.q0 + n / ng, qh = u.kv_head * a.G + u.g0 + n % ng;
                    float l = l_s[n], o = l > 0.0f ? acc[ci][n] / l : 0.0f;
                    if (s.n_chunks == 1) {
                        reinterpret_cast<IT *>(a.out)[((size_t)(s.q_row0 + r) * a.Hq + qh) * D + c] = from_f<IT>(o);
                    } else {
                        size_t idx = s.partial0 + ((size_t)u.chunk * s.q_len + r) * a.Hq + qh;
                        a.po[idx * D + c] = o;
                    }
                }
        }
    }
    if (s.n_chunks > 1 && tid < nq) {
        uint32_t n = tid, r = u.q0 + n / ng, qh = u.kv_head * a.G + u.g0 + n % ng;
        size_t idx = s.partial0 + ((size_t)u.chunk * s.q_len + r) * a.Hq + qh;
        /* Apart, not m + log2(l): at large scores log2(l) falls below a
         * float's step at m, and chunks of different lengths would weigh
         * alike in the merge. */
        a.pml[2 * idx] = l_s[n] > 0.0f ? m_s[n] : -INFINITY;
        a.pml[2 * idx + 1] = l_s[n];
    }
}

/* out[row][head] = sum_c w_c o_c / sum_c w_c, w_c = l_c 2^(m_c - M), over
 * the chunks holding tokens the row sees; grid (merges, heads). */
template <typename IT> __global__ void __launch_bounds__(NT) merge_kernel(attn_args a)
{
    const kvhi_attn_merge mg = a.merges[blockIdx.x];
    const uint32_t qh = blockIdx.y;
    const kvhi_attn_seq s = a.seqs[mg.seq];
    const uint32_t vis = s.kv_len - s.q_len + mg.row + 1;
    const uint32_t nc = (vis + s.chunk_tokens - 1) / s.chunk_tokens;
    const size_t idx0 = s.partial0 + (size_t)mg.row * a.Hq + qh, step = (size_t)s.q_len * a.Hq;
    float mx = -INFINITY;
    for (uint32_t c = 0; c < nc; c++)
        mx = fmaxf(mx, a.pml[2 * (idx0 + c * step)]);
    float wsum = 0.0f;
    for (uint32_t c = 0; c < nc; c++) {
        const float l = a.pml[2 * (idx0 + c * step) + 1];
        if (l > 0.0f)
            wsum += l * exp2f(a.pml[2 * (idx0 + c * step)] - mx);
    }
    const float inv = wsum > 0.0f ? 1.0f / wsum : 0.0f;
    for (uint32_t col = threadIdx.x; col < a.D; col += NT) {
        float o = 0.0f;
        for (uint32_t c = 0; c < nc; c++) {
            const float l = a.pml[2 * (idx0 + c * step) + 1];
            float w = l > 0.0f ? l * exp2f(a.pml[2 * (idx0 + c * step)] - mx) : 0.0f;
            if (w > 0.0f)
                o += w * a.po[(idx0 + c * step) * a.D + col];
        }
        reinterpret_cast<IT *>(a.out)[((size_t)(s.q_row0 + mg.row) * a.Hq + qh) * a.D + col] = from_f<IT>(o * inv);
    }
}

/* Host side: the kernel's shape for a plan (everything but the pointers)
 * and its dynamic shared memory. */
inline void geometry(const kvhi_attn_plan *p, attn_args *a, size_t *smem)
{
    const uint32_t eb = p->kv_dtype == 0 ? 4 : 2;
    memset(a, 0, sizeof(*a));
    a->Hq = p->num_q_heads;
    a->Hkv = p->num_kv_heads;
    a->G = a->Hq / a->Hkv;
    a->D = p->head_dim;
    a->DP = (a->D + 7) & ~7u;
    a->bt = p->block_tokens;
    a->bshift = p->block_shift;
    a->row_bytes = a->D * eb;
    a->piece_bytes = (uint64_t)a->bt * a->row_bytes;
    a->pitch = p->piece_pitch ? p->piece_pitch : a->piece_bytes;
    a->slab_shift = p->slab_shift;
    a->slab_bytes = p->slab_bytes;
    /* rows padded so that the 16-byte row reads of 8 consecutive threads
     * hit 8 different bank groups (stride / 16 odd) */
    uint32_t base = a->DP * eb; /* a multiple of 16 */
    a->srow = base + ((base / 16) % 2 == 0 ? 16 : 0);
    a->TK = TKMAX;
    while (a->TK > 8 && 2 * a->TK * a->srow > TILE_BYTES)
        a->TK /= 2;
    a->unit = a->row_bytes % 16 == 0 ? 16 : a->row_bytes % 4 == 0 ? 4 : 2;
    a->scale_log2 = p->scale * 1.4426950408889634f;
    *smem = 4 * (size_t)a->TK * a->srow + (size_t)QT * a->DP * 4 + (size_t)QT * a->TK * 4 + 3 * QT * 4;
}

} // namespace kvhc

#endif
