/* Exported engine calls: configuration, open and close, tiers, stats and
 * quotas. */
#include <stddef.h>
#include <string.h>

#include "abi/api_common.h"

kvh_status kvh_config_init(kvh_config *config, size_t struct_size)
{
    kvhi_clear_error();
    if (!config)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "config is NULL");
    if (struct_size != sizeof(kvh_config))
        return kvhi_fail(KVH_ERR_STRUCT_SIZE, "kvh_config struct_size %zu, this library knows %zu", struct_size,
                         sizeof(kvh_config));
    kvhi_config_defaults(config);
    return KVH_OK;
}

kvh_status kvh_engine_open(const kvh_config *config, kvh_engine **out)
{
    kvhi_clear_error();
    if (!config || !out)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "config and engine must not be NULL");
    if (config->struct_size != sizeof(kvh_config))
        return kvhi_fail(KVH_ERR_STRUCT_SIZE, "kvh_config struct_size %u, this library knows %zu", config->struct_size,
                         sizeof(kvh_config));
    return kvhi_engine_open(config, out);
}

kvh_status kvh_engine_close(kvh_engine *e)
{
    kvhi_clear_error();
    if (!e)
        return KVH_OK;
    return kvhi_engine_close(e);
}

kvh_status kvh_engine_block_bytes(const kvh_engine *e, uint64_t *bytes)
{
    kvhi_clear_error();
    if (!e || !bytes)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "engine and bytes must not be NULL");
    *bytes = e->block_bytes;
    return KVH_OK;
}

const char *kvh_engine_backend(const kvh_engine *e) { return e ? e->backend->name : NULL; }

kvh_status kvh_tier_info_get(kvh_engine *e, uint32_t tier, kvh_tier_info *info)
{
    kvhi_clear_error();
    if (!e || !info)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "engine and info must not be NULL");
    if (info->struct_size != sizeof(kvh_tier_info))
        return kvhi_fail(KVH_ERR_STRUCT_SIZE, "kvh_tier_info struct_size %u, expected %zu", info->struct_size,
                         sizeof(kvh_tier_info));
    if (tier >= KVH_TIER_COUNT)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "unknown tier %u", tier);
    kvh_status st = kvhi_enter(e);
    if (st != KVH_OK)
        return st;
    kvh_tier_info r;
    kvhi_tier_info(e, tier, &r);
    kvhi_leave(e);
    *info = r;
    return KVH_OK;
}

kvh_status kvh_engine_stats(kvh_engine *e, kvh_stats *stats)
{
    kvhi_clear_error();
    if (!e || !stats)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "engine and stats must not be NULL");
    uint32_t size = stats->struct_size;
    if (size < offsetof(kvh_stats, lookups) || size > sizeof(kvh_stats))
        return kvhi_fail(KVH_ERR_STRUCT_SIZE, "kvh_stats struct_size %u not in %zu..%zu", size,
                         offsetof(kvh_stats, lookups), sizeof(kvh_stats));
    kvh_status st = kvhi_enter(e);
    if (st != KVH_OK)
        return st;
    kvh_stats copy = e->stats;
    kvhi_leave(e);
    copy.struct_size = size;
    memcpy(stats, &copy, size);
    return KVH_OK;
}

kvh_status kvh_agent_set_quota(kvh_engine *e, uint32_t agent, uint64_t device_bytes)
{
    kvh_status st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    st = kvhi_agent_set_quota(e, agent, device_bytes);
    kvhi_leave(e);
    return st;
}
