/* The floating-point environment the CPU kernels compute in.
 *
 * The KV codecs' bytes and the attention kernels' error bounds are defined
 * in the default environment: round to nearest-even, subnormals kept. A
 * caller may have changed it (a directed rounding mode through
 * fesetround, or flush-to-zero and denormals-are-zero as
 * torch.set_flush_denormal or a -ffast-math binary's startup set), and
 * then the scalar and vector codecs would round differently from each
 * other, a flushed scale would decode a vector of normal values to zeros,
 * and f16 subnormal K/V would read as zeros. Each codec and attention call
 * runs in the default environment and gives the caller's back; the
 * kernels' pool threads keep it. */
#ifndef KVH_KERNELS_CPU_FP_ENV_H
#define KVH_KERNELS_CPU_FP_ENV_H

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>

/* MXCSR: exceptions masked, round to nearest, no FTZ or DAZ. The six
 * exception flags (bits 0-5) are the caller's and are kept. */
#define KVHI_MXCSR_DEFAULT 0x1f80u
#define KVHI_MXCSR_FLAGS 0x3fu

typedef struct kvhi_fp_env {
    unsigned int saved;
} kvhi_fp_env;

static inline kvhi_fp_env kvhi_fp_default_enter(void)
{
    kvhi_fp_env env = {_mm_getcsr()};
    if ((env.saved & ~KVHI_MXCSR_FLAGS) != KVHI_MXCSR_DEFAULT)
        _mm_setcsr(KVHI_MXCSR_DEFAULT | (env.saved & KVHI_MXCSR_FLAGS));
    return env;
}

static inline void kvhi_fp_leave(kvhi_fp_env env)
{
    if ((env.saved & ~KVHI_MXCSR_FLAGS) != KVHI_MXCSR_DEFAULT)
        _mm_setcsr(env.saved | (_mm_getcsr() & KVHI_MXCSR_FLAGS));
}
#else
#include <fenv.h>

/* The rounding mode only: other targets' flush-to-zero controls are not
 * standard C. */
typedef struct kvhi_fp_env {
    int saved;
} kvhi_fp_env;

static inline kvhi_fp_env kvhi_fp_default_enter(void)
{
    kvhi_fp_env env = {fegetround()};
    if (env.saved != FE_TONEAREST)
        fesetround(FE_TONEAREST);
    return env;
}

static inline void kvhi_fp_leave(kvhi_fp_env env)
{
    if (env.saved != FE_TONEAREST)
        fesetround(env.saved);
}
#endif

#endif
