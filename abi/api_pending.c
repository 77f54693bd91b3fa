/* Entry points whose implementation is still being built: they answer
 * KVH_ERR_UNSUPPORTED so the ABI links today. Each moves to its own file
 * when its subsystem lands. */
#include "abi/api_common.h"

kvh_status kvh_seq_persist(kvh_engine *e, kvh_seq seq)
{
    kvhi_clear_error();
    return kvhi_fail(KVH_ERR_UNSUPPORTED, "this build has no disk tier yet");
}
