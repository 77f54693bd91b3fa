/* Exported calls on views of virtual contiguity (core/vmap.c). */
#include <stdbool.h>

#include "abi/api_params.h"
#include "core/vmap.h"
#include "core/seq.h"

kvh_status kvh_seq_vmap(kvh_engine *e, kvh_seq seq, uint32_t layer, uint64_t capacity_tokens, kvh_vmap **out)
{
    kvhi_clear_error();
    KVHI_REQUIRE(out, "vmap is NULL");
    kvhi_seq *s;
    kvh_status st = kvhi_api_enter_seq_owner(e, seq, &s);
    if (st != KVH_OK)
        return st;
    st = kvhi_vmap_create(e, s, seq, layer, capacity_tokens, out);
    return kvhi_api_leave_seq_owner(e, s, st);
}

kvh_status kvh_vmap_refresh(kvh_engine *e, kvh_vmap *vmap, int32_t *changed)
{
    kvhi_clear_error();
    KVHI_REQUIRE(vmap, "vmap is NULL");
    kvh_status st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    bool any = false;
    st = kvhi_vmap_refresh(e, vmap, &any);
    kvhi_api_leave(e, st);
    if (changed && st == KVH_OK)
        *changed = any;
    return st;
}

kvh_status kvh_vmap_get(kvh_engine *e, const kvh_vmap *vmap, kvh_vmap_view *view)
{
    kvhi_clear_error();
    KVHI_REQUIRE(e && vmap && view, "engine, vmap and view must not be NULL");
    uint32_t size;
    kvh_status st = kvhi_info_size(view, KVHI_STRUCT_SIZE_MIN, sizeof(*view), "kvh_vmap_view", &size);
    if (st != KVH_OK)
        return st;
    st = kvhi_enter(e);
    if (st != KVH_OK)
        return st;
    kvh_vmap_view r;
    st = kvhi_vmap_view_get(e, vmap, &r);
    kvhi_api_leave(e, st);
    if (st == KVH_OK)
        kvhi_write_info(view, size, &r);
    return st;
}

kvh_status kvh_vmap_release(kvh_engine *e, kvh_vmap *vmap)
{
    kvhi_clear_error();
    if (!vmap)
        return KVH_OK;
    kvh_status st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    st = kvhi_vmap_release(e, vmap);
    return kvhi_api_leave(e, st);
}
