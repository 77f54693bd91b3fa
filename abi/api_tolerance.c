/* Exported compression tolerances (the LCTRU victim order, core/lctru.c). */
#include <math.h>

#include "abi/api_common.h"
#include "core/seq.h"
#include "core/lctru.h"

kvh_status kvh_seq_set_tolerance(kvh_engine *e, kvh_seq seq, uint64_t first, uint64_t n, uint32_t tolerance)
{
    kvhi_clear_error();
    KVHI_REQUIRE(tolerance <= KVH_TOLERANCE_MAX, "tolerance %u > %u", tolerance, KVH_TOLERANCE_MAX);
    kvhi_seq *s;
    kvh_status st = kvhi_api_enter_seq_owner(e, seq, &s);
    if (st != KVH_OK)
        return st;
    st = kvhi_seq_set_tolerance(e, s, first, n, tolerance);
    return kvhi_api_leave_seq_owner(e, s, st);
}

kvh_status kvh_block_set_tolerance(kvh_engine *e, kvh_block block, uint32_t tolerance)
{
    kvhi_clear_error();
    KVHI_REQUIRE(tolerance <= KVH_TOLERANCE_MAX, "tolerance %u > %u", tolerance, KVH_TOLERANCE_MAX);
    kvh_status st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    st = kvhi_block_set_tolerance(e, block, tolerance);
    return kvhi_api_leave(e, st);
}

kvh_status kvh_seq_derive_tolerance(kvh_engine *e, kvh_seq seq, uint64_t first, uint64_t n, float max_rel_error)
{
    kvhi_clear_error();
    KVHI_REQUIRE(isfinite(max_rel_error) && max_rel_error >= 0, "max_rel_error must be finite and >= 0");
    kvhi_seq *s;
    kvh_status st = kvhi_api_enter_seq_owner(e, seq, &s);
    if (st != KVH_OK)
        return st;
    st = kvhi_seq_derive_tolerance(e, s, first, n, max_rel_error);
    return kvhi_api_leave_seq_owner(e, s, st);
}
