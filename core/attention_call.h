/* A prepared attention call: a plan built on the CPU plus a hold on
 * every block it reads (core/attention_call.c). The one-shot calls run it
 * once; persistent plans (core/attention_plans.c) keep it. */
#ifndef KVH_CORE_ATTENTION_CALL_H
#define KVH_CORE_ATTENTION_CALL_H

#include <stdbool.h>

#include "core/engine.h"
#include "core/move.h"
#include "kernels/attention_plan.h"
#include "kernels/cpu/attn_cpu.h"

typedef struct kvhi_attn_call {
    kvh_engine *e;
    uint32_t n_held;
    uint32_t *held;     /* block indices held by this call */
    uint32_t *held_gen; /* their generations when held */
    kvhi_attn_plan plan;
    /* Streaming (kvh_attention_params.stream_*; 0 = off): the blocks
     * held[stage[i]] lie outside the device tier and are copied into the
     * window's slots (device-tier slots taken for the call) before their
     * chunk is attended; xs[i] is the transfer, prepared under the lock. */
    uint32_t stream_chunk_blocks;
    uint32_t n_stage;
    uint32_t *stage;
    kvhi_xfer *xs;
    uint32_t n_window;
    uint32_t *window;
} kvhi_attn_call;

/* The CPU kernels' state (thread pool, scratch), made on first use, or
 * NULL when out of memory. Lock held. */
kvhi_attn_cpu *kvhi_attn_state(kvh_engine *e);
/* Lock held (the engine entered): resolves the sequences, builds c->plan
 * and holds every block it reads, which must be in the device tier. May
 * drop the lock (to wait out a block's move). On failure nothing stays
 * held (c->plan may hold memory: kvhi_attn_call_free). */
kvh_status kvhi_attn_call_prepare(kvh_engine *e, uint32_t layer, const kvh_seq *seqs, const uint32_t *q_lens,
                                  size_t n_seqs, bool prefill, const kvh_attention_params *pr, uint64_t total_rows,
                                  kvhi_attn_call *c);
/* Runs a prepared call and consumes it and the call's registration: lock
 * held and the engine entered on entry, neither on return. The holds end
 * when the kernels finish (on CUDA, after the call returns). */
kvh_status kvhi_attn_call_run(kvh_engine *e, kvhi_attn_call *c, const void *q, void *out, void *stream);
/* The same for a streamed call (c->stream_chunk_blocks != 0; CPU
 * backend): chunk by chunk, staging what lies outside the device tier
 * (core/attention_stream.c). A block that fails its checksum fails the
 * call with KVH_ERR_CORRUPT and is marked corrupt. */
kvh_status kvhi_attn_stream_run(kvh_engine *e, kvhi_attn_call *c, const void *q, void *out);
/* Gives back the streaming window's slots (lock held). */
void kvhi_attn_call_release_window(kvh_engine *e, kvhi_attn_call *c);
/* Lock held. */
void kvhi_attn_call_release_holds(kvh_engine *e, kvhi_attn_call *c);
void kvhi_attn_call_free(kvhi_attn_call *c);

/* ---- persistent plans (core/attention_plans.c) ---- */
/* Prepares a call and keeps it as a plan, uploaded to the backend where
 * it has device memory; [out] *id, the plan's handle. Lock held and the
 * engine entered; drops the lock for the upload. */
kvh_status kvhi_attn_plan_create(kvh_engine *e, uint32_t layer, const kvh_seq *seqs, const uint32_t *q_lens,
                                 size_t n_seqs, const kvh_attention_params *pr, uint64_t rows, uint64_t *id);
/* Runs plan id: lock held and the engine entered; drops the lock for the
 * kernels. KVH_ERR_BAD_HANDLE for a plan that is not live. */
kvh_status kvhi_attn_plan_run(kvh_engine *e, uint64_t id, const void *q, void *out, void *stream);
/* Destroys plan id once its runs end. Lock held; drops it. */
kvh_status kvhi_attn_plan_destroy(kvh_engine *e, uint64_t id);
/* Destroys the plans still open (engine_free: no call active, lock not
 * held). */
void kvhi_attn_plans_free_all(kvh_engine *e);

#endif
