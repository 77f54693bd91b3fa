/* Queue hints (core/hint_queue.c): a scheduler's queue, named by place or
 * by request number on a step count the caller advances. */
#ifndef KVH_CORE_HINT_QUEUE_H
#define KVH_CORE_HINT_QUEUE_H

#include <stdbool.h>
#include <stdint.h>

#include "core/engine.h"
#include "core/seq.h"

/* How far ahead of the step a request may be named. */
#define KVHI_HINT_QUEUE_REACH (1u << 24)

/* The blocks of tokens [first, first + n) of s will be read by request
 * `request` (absolute, on the step count). A request before the step is
 * ignored. */
kvh_status kvhi_hint_queue(kvh_engine *e, kvhi_seq *s, uint64_t first, uint64_t n, uint64_t request);
/* Advances the step by steps and retires the hints of the requests it
 * passed; [out] *step, the step now. */
kvh_status kvhi_hint_advance(kvh_engine *e, uint64_t steps, uint64_t *step);
void kvhi_hint_queue_free(kvh_engine *e);
/* Whether priority is that of a queued request the step has reached
 * (while any queue hint is filed): an access then redeems it even when
 * it was hinted only once, before an earlier use. */
bool kvhi_hint_queue_due(const kvh_engine *e, int32_t priority);

#endif
