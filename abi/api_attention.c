/* Paged attention entry points (kernels in kernels/). */
#include "abi/api_common.h"

kvh_status kvh_attention_params_init(kvh_attention_params *p, size_t struct_size)
{
    kvhi_clear_error();
    return kvhi_fail(KVH_ERR_UNSUPPORTED, "attention kernels are not built yet");
}

kvh_status kvh_attention_decode(kvh_engine *e, uint32_t layer, const kvh_seq *seqs, size_t n_seqs, const void *q,
                                void *out, const kvh_attention_params *params)
{
    kvhi_clear_error();
    return kvhi_fail(KVH_ERR_UNSUPPORTED, "attention kernels are not built yet");
}

kvh_status kvh_attention_prefill(kvh_engine *e, uint32_t layer, const kvh_seq *seqs, const uint32_t *q_lens,
                                 size_t n_seqs, const void *q, void *out, const kvh_attention_params *params)
{
    kvhi_clear_error();
    return kvhi_fail(KVH_ERR_UNSUPPORTED, "attention kernels are not built yet");
}
