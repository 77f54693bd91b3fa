/* Argument checks shared by the one-shot attention calls
 * (api_attention.c), persistent plans (api_attention_plan.c) and attention
 * over views (api_vmap_attention.c). */
#ifndef KVH_ABI_API_ATTENTION_H
#define KVH_ABI_API_ATTENTION_H

#include <stdbool.h>

#include "core/engine.h"

/* The defaults of kvh_attention_params_init. */
void kvhi_attn_params_defaults(kvh_attention_params *p);
/* Checks the arguments that need no lock; fills *pr (params with defaults
 * applied) and *total_rows. */
kvh_status kvhi_attn_check_args(kvh_engine *e, uint32_t layer, const kvh_seq *seqs, const uint32_t *q_lens,
                                size_t n_seqs, bool prefill, const void *q, const void *out,
                                const kvh_attention_params *params, kvh_attention_params *pr, uint64_t *total_rows);
#endif
