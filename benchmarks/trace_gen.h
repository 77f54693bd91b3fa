/* Generated multi-agent block-access traces.
 *
 * Agents take turns. In a turn an agent reads its whole context, one access
 * per block, in order: the system prompt every agent shares, the document
 * of its current topic (topic documents are shared between agents that
 * work on the same topic), and the history of its current session; then it
 * appends new history blocks (written, so accessed too). Between turns an
 * agent may switch topic, or leave its session and later return to an old
 * one (its history comes back). With `adversarial` set, one more agent
 * jumps to a random topic of its own large pool on every turn: a scan of
 * mostly cold blocks, the "agent that jumps between disparate topics".
 *
 * With hint_turns set, each turn is preceded by prefetch hints for the
 * contexts of the turns queued next (trace.h), the sooner the higher.
 *
 * Compression tolerance per block (read by LCTRU only): system prompt 0.1,
 * documents uniform in [0.3, 0.9], history 0.6. */
#ifndef KVH_BENCH_TRACE_GEN_H
#define KVH_BENCH_TRACE_GEN_H

#include "trace.h"

typedef struct trace_gen_params {
    uint32_t agents;         /* cooperating agents */
    uint32_t turns;          /* turns per agent */
    uint32_t system_blocks;  /* shared system prompt */
    uint32_t topics;         /* topic documents the agents share */
    uint32_t doc_blocks_min; /* document length range, blocks */
    uint32_t doc_blocks_max;
    uint32_t new_blocks_per_turn; /* history appended per turn (1..this) */
    uint32_t max_history_blocks;  /* a session this long is left */
    double p_switch_topic;        /* per turn */
    double p_leave_session;       /* per turn: park it, start or resume one */
    double p_resume;              /* when leaving: resume a parked session */
    int adversarial;              /* add the topic-jumping agent */
    uint32_t adversary_topics;    /* its pool of disparate topics */
    uint32_t hint_turns;          /* before each turn, hint the context of
                                     it and the next hint_turns - 1 turns
                                     (what a scheduler's queue knows);
                                     0: no hints */
    uint64_t seed;
} trace_gen_params;

void trace_gen_defaults(trace_gen_params *p);
/* Fills an empty trace. Returns 0, or -1 when out of memory. */
int trace_generate(trace *t, const trace_gen_params *p);

#endif
