/* Helpers shared by the exported wrappers: NULL checks, entering the
 * engine and resolving a sequence handle in one step. */
#ifndef KVH_ABI_API_COMMON_H
#define KVH_ABI_API_COMMON_H

#include "core/engine.h"
#include "core/seq.h"

#define KVHI_REQUIRE(cond, ...)                                                                                        \
    do {                                                                                                               \
        if (!(cond))                                                                                                   \
            return kvhi_fail(KVH_ERR_INVALID_ARG, __VA_ARGS__);                                                        \
    } while (0)

/* Enters e (lock held on success). */
static inline kvh_status kvhi_api_enter(kvh_engine *e)
{
    /* kvhi_enter clears the last error, and kvhi_fail replaces it. */
    if (!e)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "engine is NULL");
    return kvhi_enter(e);
}

/* A call's status as it returns it: one that succeeds leaves
 * kvh_last_error() empty (kvh.h), even where it met a failure on the way
 * and went on (a tier without room, then the next one). */
static inline kvh_status kvhi_api_result(kvh_status st)
{
    if (st == KVH_OK)
        kvhi_clear_error();
    return st;
}

/* Leaves e at the end of a call that returns st (kvhi_api_result). */
static inline kvh_status kvhi_api_leave(kvh_engine *e, kvh_status st)
{
    kvhi_leave(e);
    return kvhi_api_result(st);
}

/* Enters e and resolves seq; on failure the engine is left again. */
static inline kvh_status kvhi_api_enter_seq(kvh_engine *e, kvh_seq h, kvhi_seq **s)
{
    kvh_status st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    st = kvhi_seq_get(e, h, s);
    if (st != KVH_OK)
        kvhi_leave(e);
    return st;
}

/* For the calls whose rule is @threads handle: enters e, resolves seq and
 * claims it for this call. A second such call on the same sequence while
 * the first is inside (it may have dropped the lock half way) is the
 * caller breaking that rule; it gets KVH_ERR_BUSY and changes nothing,
 * rather than a sequence corrupted under the first. */
static inline kvh_status kvhi_api_enter_seq_owner(kvh_engine *e, kvh_seq h, kvhi_seq **s)
{
    kvh_status st = kvhi_api_enter_seq(e, h, s);
    if (st != KVH_OK)
        return st;
    if ((*s)->owner_in_call) {
        kvhi_leave(e);
        return kvhi_fail(KVH_ERR_BUSY,
                         "sequence 0x%llx is in use by another call: calls on one sequence must not overlap",
                         (unsigned long long)h.id);
    }
    (*s)->owner_in_call = true;
    return KVH_OK;
}

/* Ends what kvhi_api_enter_seq_owner began, as kvhi_api_leave. */
static inline kvh_status kvhi_api_leave_seq_owner(kvh_engine *e, kvhi_seq *s, kvh_status st)
{
    s->owner_in_call = false;
    return kvhi_api_leave(e, st);
}

#endif
