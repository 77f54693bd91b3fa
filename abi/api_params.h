/* Helpers of the exported calls whose params structs may come from an
 * older caller (api_context.c, api_admission.c). */
#ifndef KVH_ABI_API_PARAMS_H
#define KVH_ABI_API_PARAMS_H

#include <stddef.h>
#include <string.h>

#include "abi/api_common.h"
#include "core/context.h"

/* Params structs: a caller's struct may be older (shorter) than ours;
 * fields it lacks keep their defaults. Sizes below `min_size` or above
 * ours are refused. */
static inline kvh_status kvhi_read_params(void *dst, size_t ours, const void *src, size_t min_size, const char *what)
{
    uint32_t size = *(const uint32_t *)src;
    if (size < min_size || size > ours)
        return kvhi_fail(KVH_ERR_STRUCT_SIZE, "%s struct_size %u not in %zu..%zu", what, size, min_size, ours);
    memcpy(dst, src, size);
    *(uint32_t *)dst = (uint32_t)ours;
    return KVH_OK;
}

static inline kvh_status kvhi_init_params(void *p, size_t size, size_t ours, const char *what)
{
    kvhi_clear_error();
    if (!p)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "%s is NULL", what);
    if (size != ours)
        return kvhi_fail(KVH_ERR_STRUCT_SIZE, "%s struct_size %zu, this library knows %zu", what, size, ours);
    return KVH_OK;
}

/* Enters e with its context state made. */
static inline kvh_status kvhi_api_enter_contexts(kvh_engine *e)
{
    kvh_status st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    if (!kvhi_contexts_get(e)) {
        kvhi_leave(e);
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for context state");
    }
    return KVH_OK;
}

#endif
