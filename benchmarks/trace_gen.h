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
 * Who takes the next turn (agent_choice): shuffled rounds (every agent
 * once per round), a Zipf draw over the agents (a few busy ones, a long
 * tail), or bursts (the same agent keeps the floor for a geometric run of
 * turns, then the next one is drawn by Zipf). Outside rounds, topics are
 * also drawn by Zipf popularity, and the adversary (if any) takes every
 * (agents + 1)-th turn.
 *
 * Hints, what a scheduler knows of its queue, come in two forms. With
 * queue_len set they follow a causal queue: a turn enters the queue only
 * once the same agent's previous turn has finished (its request cannot be
 * made before the answer it continues exists), and before each turn the
 * first queue_len queued turns, this one included, are hinted in the order
 * they will run. With hint_turns set instead (the oracle), each turn hints
 * the next hint_turns planned turns whether or not they could be queued
 * yet: an upper bound no scheduler reaches. Priorities are the turn's
 * absolute number, the sooner the higher (trace.h).
 *
 * Compression tolerance per block (read by LCTRU only): system prompt 0.1,
 * documents uniform in [0.3, 0.9], history 0.6. */
#ifndef KVH_BENCH_TRACE_GEN_H
#define KVH_BENCH_TRACE_GEN_H

#include "trace.h"

typedef enum trace_agent_choice {
    TRACE_AGENTS_ROUNDS, /* shuffled rounds: every agent once per round */
    TRACE_AGENTS_ZIPF,   /* each turn's agent drawn by Zipf */
    TRACE_AGENTS_BURSTS, /* runs of one agent, the next one by Zipf */
} trace_agent_choice;

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
    uint32_t hint_turns;          /* oracle: before each turn, hint the
                                     context of it and the next
                                     hint_turns - 1 planned turns; 0: none */
    uint32_t queue_len;           /* causal queue of this many turns (wins
                                     over hint_turns); 0: none */
    trace_agent_choice agent_choice;
    double zipf_s;     /* exponent of the Zipf draws (agents, topics) */
    double burst_mean; /* mean run of one agent's turns (bursts) */
    uint64_t seed;
} trace_gen_params;

void trace_gen_defaults(trace_gen_params *p);
/* Fills an empty trace. Returns 0, or -1 when out of memory. */
int trace_generate(trace *t, const trace_gen_params *p);

#endif
