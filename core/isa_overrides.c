/* The instruction-set overrides (KVH_ATTN_ISA, KVH_CODEC_ISA,
 * KVH_CRC32C_IMPL) are read where they act and pass over what they cannot
 * use; an engine says so when it opens, so that a run meant to measure one
 * implementation with a misspelt name does not quietly measure another. */
#include "core/isa_overrides.h"

#include <stdlib.h>

#include "core/crc32c.h"
#include "kernels/cpu/attn_cpu.h"
#include "kernels/cpu/kv_codec.h"

static const struct override {
    const char *var, *names;
    int (*by_name)(const char *name);
    int (*supported)(int impl);
} overrides[] = {
    {"KVH_ATTN_ISA", "reference, generic, avx2, avx512", kvhi_attn_isa_by_name, kvhi_attn_cpu_supported},
    {"KVH_CODEC_ISA", "scalar, avx2, avx512", kvhi_codec_isa_by_name, kvhi_codec_isa_supported},
    {"KVH_CRC32C_IMPL", "table, sse42, avx2, avx512", kvhi_crc32c_impl_by_name, kvhi_crc32c_supported},
};

void kvhi_warn_isa_overrides(kvh_engine *e)
{
    for (size_t i = 0; i < sizeof(overrides) / sizeof(overrides[0]); i++) {
        const struct override *o = &overrides[i];
        const char *value = secure_getenv(o->var);
        if (!value)
            continue;
        int impl = o->by_name(value);
        if (impl < 0)
            kvhi_log(e, KVH_LOG_WARN, "%s=%s is none of %s: ignored", o->var, value, o->names);
        else if (!o->supported(impl))
            kvhi_log(e, KVH_LOG_WARN, "%s=%s: this CPU does not run it: ignored", o->var, value);
    }
}
