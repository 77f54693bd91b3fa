/* Shared by the one-shot attention calls (api_attention.c) and persistent
 * plans (api_attention_plan.c): a prepared call is a plan built on the CPU
 * plus a hold on every block it reads. */
#ifndef KVH_ABI_API_ATTENTION_H
#define KVH_ABI_API_ATTENTION_H

#include <stdbool.h>

#include "core/engine.h"
#include "kernels/attention_plan.h"

typedef struct attn_call {
    kvh_engine *e;
    uint32_t n_held;
    uint32_t *held;     /* block indices held by this call */
    uint32_t *held_gen; /* their generations when held */
    kvhi_attn_plan plan;
} attn_call;

/* The defaults of kvh_attention_params_init. */
void kvhi_attn_params_defaults(kvh_attention_params *p);
/* Checks the arguments that need no lock; fills *pr (params with defaults
 * applied) and *total_rows. */
kvh_status kvhi_attn_check_args(kvh_engine *e, uint32_t layer, const kvh_seq *seqs, const uint32_t *q_lens,
                                size_t n_seqs, bool prefill, const void *q, const void *out,
                                const kvh_attention_params *params, kvh_attention_params *pr, uint64_t *total_rows);
/* Lock held (the engine entered): resolves the sequences, builds c->plan
 * and holds every block it reads, which must be in the device tier. On
 * failure nothing stays held (c->plan may hold memory: call_free). */
kvh_status kvhi_attn_call_prepare(kvh_engine *e, uint32_t layer, const kvh_seq *seqs, const uint32_t *q_lens,
                                  size_t n_seqs, bool prefill, const kvh_attention_params *pr, uint64_t total_rows,
                                  attn_call *c);
/* Lock held. */
void kvhi_attn_call_release_holds(kvh_engine *e, attn_call *c);
void kvhi_attn_call_free(attn_call *c);

#endif
