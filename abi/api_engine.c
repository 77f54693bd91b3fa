/* Exported engine calls: configuration, open and close, tiers, stats and
 * quotas. */
#include <stddef.h>
#include <string.h>

#include "abi/api_params.h"

kvh_status kvh_config_init(kvh_config *config, size_t struct_size)
{
    kvhi_clear_error();
    if (!config)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "config is NULL");
    kvh_config d;
    kvhi_config_defaults(&d);
    return kvhi_init_params(config, struct_size, &d, sizeof(d), KVHI_STRUCT_SIZE_MIN, "kvh_config");
}

kvh_status kvh_config_from_env(kvh_config *config, size_t struct_size, const char *const *envp)
{
    kvhi_clear_error();
    if (!config)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "config is NULL");
    kvh_status st = kvhi_struct_size_check(struct_size, KVHI_STRUCT_SIZE_MIN, sizeof(kvh_config), "kvh_config");
    if (st != KVH_OK)
        return st;
    /* Parsed into a copy, so that a bad variable leaves *config as it was. */
    kvh_config c;
    kvhi_config_defaults(&c);
    memcpy(&c, config, struct_size);
    st = kvhi_config_from_env(&c, struct_size, envp);
    if (st != KVH_OK)
        return st;
    memcpy(config, &c, struct_size);
    return KVH_OK;
}

kvh_status kvh_engine_open(const kvh_config *config, kvh_engine **out)
{
    kvhi_clear_error();
    if (!config || !out)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "config and engine must not be NULL");
    kvh_config c;
    kvhi_config_defaults(&c);
    kvh_status st = kvhi_read_params(&c, sizeof(c), config, KVHI_STRUCT_SIZE_MIN, "kvh_config");
    if (st != KVH_OK)
        return st;
    return kvhi_engine_open(&c, out);
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

int32_t kvh_engine_owns_thread(const kvh_engine *e) { return kvhi_thread_is_engines(e) ? 1 : 0; }

kvh_status kvh_tier_info_get(kvh_engine *e, uint32_t tier, kvh_tier_info *info)
{
    kvhi_clear_error();
    if (!e || !info)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "engine and info must not be NULL");
    uint32_t size;
    kvh_status st = kvhi_info_size(info, KVHI_STRUCT_SIZE_MIN, sizeof(*info), "kvh_tier_info", &size);
    if (st != KVH_OK)
        return st;
    if (tier >= KVH_TIER_COUNT)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "unknown tier %u", tier);
    st = kvhi_enter(e);
    if (st != KVH_OK)
        return st;
    kvh_tier_info r;
    kvhi_tier_info(e, tier, &r);
    kvhi_api_leave(e, KVH_OK);
    kvhi_write_info(info, size, &r);
    return KVH_OK;
}

kvh_status kvh_engine_stats(kvh_engine *e, kvh_stats *stats)
{
    kvhi_clear_error();
    if (!e || !stats)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "engine and stats must not be NULL");
    uint32_t size;
    kvh_status st = kvhi_info_size(stats, KVHI_STRUCT_SIZE_MIN, sizeof(*stats), "kvh_stats", &size);
    if (st != KVH_OK)
        return st;
    st = kvhi_enter(e);
    if (st != KVH_OK)
        return st;
    kvh_stats copy = e->stats;
    kvhi_api_leave(e, KVH_OK);
    kvhi_write_info(stats, size, &copy);
    return KVH_OK;
}

kvh_status kvh_agent_set_quota(kvh_engine *e, uint32_t agent, uint64_t device_bytes)
{
    kvh_status st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    st = kvhi_agent_set_quota(e, agent, device_bytes);
    return kvhi_api_leave(e, st);
}
