/* Fast CPU attention kernels in portable C, for any CPU:
 *   generic: 4 lanes with GCC vector extensions (SSE2 on x86-64, NEON on
 *            AArch64), head_dim a multiple of 4; conversions and exp
 *            written out with vector integer and float operations;
 *   scalar:  one lane, any head_dim. */
#include "kernels/cpu/attn_cpu.h"

/* ---------------- 4 lanes ---------------- */

#include "kernels/cpu/attn_vec4.h"

#define ISA_NAME generic

#define KVT_NAME f32
#define KV_ELEM float
#define vload_kv(p) vloadf(p)
#include "kernels/cpu/attn_body.inc"
#undef KVT_NAME
#undef KV_ELEM
#undef vload_kv

#define KVT_NAME f16
#define KV_ELEM uint16_t
#define vload_kv(p) f16x4(p)
#include "kernels/cpu/attn_body.inc"
#undef KVT_NAME
#undef KV_ELEM
#undef vload_kv

#define KVT_NAME bf16
#define KV_ELEM uint16_t
#define vload_kv(p) bf16x4(p)
#include "kernels/cpu/attn_body.inc"
#undef KVT_NAME
#undef KV_ELEM
#undef vload_kv

#undef ISA_NAME
#undef VW

const kvhi_attn_unit_fn kvhi_attn_units_generic[3] = {unit_generic_f32, unit_generic_f16, unit_generic_bf16};

/* ---------------- 1 lane ---------------- */

#define VW 1
#define vf float
#define vzero() 0.0f
#define vset1(x) (x)
#define vloadf(p) (*(p))
#define vstoref(p, v) (*(p) = (v))
#define vadd(a, b) ((a) + (b))
#define vsub(a, b) ((a) - (b))
#define vmul(a, b) ((a) * (b))
#define vfma(a, b, c) ((a) * (b) + (c))
#define vhsum(v) (v)
#define vexp(x) expf(x)
#define ISA_NAME scalar

#define KVT_NAME f32
#define KV_ELEM float
#define vload_kv(p) (*(p))
#include "kernels/cpu/attn_body.inc"
#undef KVT_NAME
#undef KV_ELEM
#undef vload_kv

#define KVT_NAME f16
#define KV_ELEM uint16_t
#define vload_kv(p) kvhi_f16_to_f32(*(p))
#include "kernels/cpu/attn_body.inc"
#undef KVT_NAME
#undef KV_ELEM
#undef vload_kv

#define KVT_NAME bf16
#define KV_ELEM uint16_t
#define vload_kv(p) kvhi_bf16_to_f32(*(p))
#include "kernels/cpu/attn_body.inc"
#undef KVT_NAME
#undef KV_ELEM
#undef vload_kv

const kvhi_attn_unit_fn kvhi_attn_units_scalar[3] = {unit_scalar_f32, unit_scalar_f16, unit_scalar_bf16};
