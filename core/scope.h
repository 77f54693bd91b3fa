/* Tenant scopes: which prefix-hash namespace a sequence or a lookup uses
 * (kvh.h "Tenant scopes"; the salts are in core/prefix_index.c). */
#ifndef KVH_CORE_SCOPE_H
#define KVH_CORE_SCOPE_H

#include "core/seq.h"

/* Sets what s hashes in; s must be empty (KVH_ERR_INVALID_ARG). */
kvh_status kvhi_seq_set_scope(kvh_engine *e, kvhi_seq *s, const kvhi_scope *sc);

/* The longest cached prefix of tokens under sc (NULL: the default scope),
 * at most cap blocks, each retained for the caller (ext_refs) into out;
 * *n_blocks of them. Counts the query and its hits. Cannot fail. */
void kvhi_prefix_lookup(kvh_engine *e, const kvhi_scope *sc, const int32_t *tokens, size_t n, kvh_block *out,
                        size_t cap, size_t *n_blocks);

#endif
