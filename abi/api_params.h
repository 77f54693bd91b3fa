/* The struct_size policy of every params and info struct, for the
 * exported calls that take one from a caller built against an older (or
 * the same) kvh.h, and entering an engine with its context state. */
#ifndef KVH_ABI_API_PARAMS_H
#define KVH_ABI_API_PARAMS_H

#include <stddef.h>
#include <string.h>

#include "abi/api_common.h"
#include "core/context.h"

/* The smallest struct_size of a params or info struct: struct_size and
 * the 4-byte field beside it. */
#define KVHI_STRUCT_SIZE_MIN 8u

/* kvh.h, "Params and info structs": a caller's struct_size is this
 * library's, or a multiple of 8 from min_size up to it. A multiple of 8
 * never ends inside a field (each is naturally aligned and at most 8
 * bytes), so the caller's struct is a prefix of ours. */
static inline kvh_status kvhi_struct_size_check(size_t size, size_t min_size, size_t ours, const char *what)
{
    if (size == ours || (size % 8 == 0 && size >= min_size && size < ours))
        return KVH_OK;
    if (min_size >= ours)
        return kvhi_fail(KVH_ERR_STRUCT_SIZE, "%s struct_size %zu, this library takes only %zu", what, size, ours);
    return kvhi_fail(KVH_ERR_STRUCT_SIZE,
                     "%s struct_size %zu, this library knows %zu, or a multiple of 8 from %zu up to it", what, size,
                     ours, min_size);
}

/* *_init(): p gets the first size bytes of the defaults (a struct of
 * ours bytes), with struct_size = size. */
static inline kvh_status kvhi_init_params(void *p, size_t size, const void *defaults, size_t ours, size_t min_size,
                                          const char *what)
{
    kvhi_clear_error();
    if (!p)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "%s is NULL", what);
    kvh_status st = kvhi_struct_size_check(size, min_size, ours, what);
    if (st != KVH_OK)
        return st;
    memcpy(p, defaults, size);
    *(uint32_t *)p = (uint32_t)size;
    return KVH_OK;
}

/* Input structs: the caller's bytes over the defaults already in dst (a
 * struct of ours bytes), so the fields past its size keep them. */
static inline kvh_status kvhi_read_params(void *dst, size_t ours, const void *src, size_t min_size, const char *what)
{
    uint32_t size = *(const uint32_t *)src;
    kvh_status st = kvhi_struct_size_check(size, min_size, ours, what);
    if (st != KVH_OK)
        return st;
    memcpy(dst, src, size);
    *(uint32_t *)dst = (uint32_t)ours;
    return KVH_OK;
}

/* Output structs: checks the caller's size before the call does
 * anything; *size is what kvhi_write_info later fills. */
static inline kvh_status kvhi_info_size(const void *info, size_t min_size, size_t ours, const char *what,
                                        uint32_t *size)
{
    *size = *(const uint32_t *)info;
    return kvhi_struct_size_check(*size, min_size, ours, what);
}

/* Output structs: the first size bytes of r (ours, filled) into info,
 * struct_size = size; nothing past them is written. */
static inline void kvhi_write_info(void *info, uint32_t size, void *r)
{
    *(uint32_t *)r = size;
    memcpy(info, r, size);
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
