/* Tenant scopes (core/scope.h). */
#include "core/scope.h"
#include "core/block.h"
#include "core/remote_tier.h"

#include <string.h>

kvh_status kvhi_seq_set_scope(kvh_engine *e, kvhi_seq *s, const kvhi_scope *sc)
{
    (void)e;
    /* Its blocks were hashed in the old scope: they cannot change now. */
    if (s->n_tokens != 0)
        return kvhi_fail(KVH_ERR_INVALID_ARG,
                         "a scope is set on an empty sequence (this one holds %llu tokens; truncate it to 0 first)",
                         (unsigned long long)s->n_tokens);
    s->scope = *sc;
    return KVH_OK;
}

void kvhi_prefix_lookup(kvh_engine *e, const kvhi_scope *sc, const int32_t *tokens, size_t n, kvh_block *out,
                        size_t cap, size_t *n_blocks)
{
    uint32_t bt = e->cfg.block_tokens;
    uint64_t parent = 0;
    size_t i = 0;
    e->stats.prefix_queries++;
    for (; i < n / bt && i < cap; i++) {
        uint64_t h = kvhi_prefix_hash(parent, tokens + i * bt, bt, kvhi_scope_block_salt(e->cfg.model_salt, sc, i, bt));
        uint32_t b = kvhi_block_find_published(e, h, parent, tokens + i * bt);
        if (b == KVHI_PREFIX_MISS)
            break;
        kvhi_block_ref_handle(e, b);
        kvhi_block_touch(e, b);
        out[i].id = kvhi_block_handle(e, b);
        kvhi_count_prefix_hit(e, e->blocks[b].tier);
        parent = h;
    }
    size_t want = n / bt < cap ? n / bt : cap;
    if (e->remote && i < want)
        i = kvhi_remote_lookup(e, sc, tokens, want, i, parent, out);
    *n_blocks = i;
}
