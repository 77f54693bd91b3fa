/* Generated traces for the policy simulator's and the engine replay's
 * tests (benchmarks/trace_gen.h). */
#ifndef KVH_TEST_TRACE_TEST_UTIL_H
#define KVH_TEST_TRACE_TEST_UTIL_H

#include "test_util.h"

#include "benchmarks/trace.h"
#include "benchmarks/trace_gen.h"

/* The generator's default trace (agents and turns given when non-zero)
 * with hints from a causal queue of queue_len requests. */
static inline void tt_queue_trace(trace *t, uint32_t agents, uint32_t turns, uint32_t queue_len)
{
    trace_gen_params p;
    trace_gen_defaults(&p);
    if (agents)
        p.agents = agents;
    if (turns)
        p.turns = turns;
    p.queue_len = queue_len;
    trace_init(t);
    assert_int_equal(trace_generate(t, &p), 0);
}

#endif
