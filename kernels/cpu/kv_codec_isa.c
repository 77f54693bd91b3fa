/* Which instruction set the KV codecs run on: chosen once from the CPU
 * (or KVH_CODEC_ISA), changeable by tests and benchmarks. */
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/attn_cpu.h"
#include "kernels/cpu/kv_codec.h"

/* The codec sets need what the attention kernels of the same name need. */
int kvhi_codec_isa_supported(int isa)
{
    switch (isa) {
    case KVHI_CODEC_AUTO:
    case KVHI_CODEC_SCALAR:
        return 1;
    case KVHI_CODEC_AVX2:
        return kvhi_attn_cpu_supported(KVHI_ATTN_AVX2);
    case KVHI_CODEC_AVX512:
        return kvhi_attn_cpu_supported(KVHI_ATTN_AVX512);
    default:
        return 0;
    }
}

const char *kvhi_codec_isa_name(int isa)
{
    return isa == KVHI_CODEC_AVX512 ? "avx512" : isa == KVHI_CODEC_AVX2 ? "avx2" : "scalar";
}

int kvhi_codec_isa_by_name(const char *name)
{
    for (int isa = KVHI_CODEC_SCALAR; isa <= KVHI_CODEC_AVX512; isa++)
        if (strcmp(name, kvhi_codec_isa_name(isa)) == 0)
            return isa;
    return -1;
}

static int best_isa(void)
{
    const char *env = secure_getenv("KVH_CODEC_ISA");
    int named = env ? kvhi_codec_isa_by_name(env) : -1;
    if (named > 0 && kvhi_codec_isa_supported(named))
        return named;
    if (kvhi_codec_isa_supported(KVHI_CODEC_AVX512))
        return KVHI_CODEC_AVX512;
    if (kvhi_codec_isa_supported(KVHI_CODEC_AVX2))
        return KVHI_CODEC_AVX2;
    return KVHI_CODEC_SCALAR;
}

/* 0 until the first call resolves it; threads racing on that store the
 * same value. */
static int active_isa;

int kvhi_codec_active_isa(void)
{
    int isa = __atomic_load_n(&active_isa, __ATOMIC_RELAXED);
    if (isa == KVHI_CODEC_AUTO) {
        isa = best_isa();
        __atomic_store_n(&active_isa, isa, __ATOMIC_RELAXED);
    }
    return isa;
}

int kvhi_codec_set_isa(int isa)
{
    if (!kvhi_codec_isa_supported(isa))
        return -1;
    __atomic_store_n(&active_isa, isa == KVHI_CODEC_AUTO ? best_isa() : isa, __ATOMIC_RELAXED);
    return 0;
}
