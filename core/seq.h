/* Sequences (core/seq.c): block tables, tokens, K/V writes with
 * copy-on-write, prefix attachment, acquire/release, prefetch, migrate.
 * Every function runs with the engine lock held; "drops the lock" means
 * it is released and retaken before the function returns (to make room,
 * copy or wait), so the caller re-reads what another thread may have
 * changed meanwhile, the sequence included. */
#ifndef KVH_CORE_SEQ_H
#define KVH_CORE_SEQ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/engine.h"

typedef struct kvhi_seq {
    uint32_t agent;
    uint32_t n_blocks;
    uint32_t cap_blocks;
    uint32_t *blocks; /* logical block -> block index */
    uint32_t *held;   /* acquire holds this sequence has on each block */
    uint32_t *pins;   /* pins this sequence took on each block: its own,
                         dropped with the block (truncate, free) */
    /* An owner's call (@threads handle) is inside: such calls may drop
     * the lock mid-way, and one overlapping them would see the sequence
     * half changed, so it is refused (abi/api_common.h). */
    bool owner_in_call;
    uint64_t n_tokens;
    kvhi_scope scope; /* what its blocks hash in (kvh_seq_set_scope) */
    /* Per logical block below n_durable: the published block of the same
     * prefix that kvh_seq_persist made durable in place of this
     * sequence's own (KVHI_NO_BLOCK: none), with a reference, so that the
     * persisted prefix stays while the sequence holds the block; dropped
     * with it (truncate, free). NULL until a persist needs it. */
    uint32_t *durable_twin;
    uint32_t n_durable;
    /* Live views of it (core/vmap.c) and an address range covering them
     * all (kept until the last goes): K/V buffers of the caller's inside
     * it may be the sequence's own blocks (core/seq.c). */
    uint32_t n_views;
    uintptr_t view_lo, view_hi;
    /* Admission (core/admission.c): 0, or its pool + 1, the blocks
     * reserved for it there, and its handle (its reservation's key). */
    uint8_t admission_pool;
    uint64_t admission_blocks;
    uint64_t admission_handle;
} kvhi_seq;

/* Keeps twins[i] (a reference each, or KVHI_NO_BLOCK: nothing new) as
 * the durable twin of logical block i of s, for i < n, releasing the one
 * it replaces. */
kvh_status kvhi_seq_keep_durable_twins(kvh_engine *e, kvhi_seq *s, const uint32_t *twins, uint32_t n);

kvh_status kvhi_seq_get(kvh_engine *e, kvh_seq h, kvhi_seq **out);
/* Block range covering tokens [first, first + n). */
kvh_status kvhi_seq_block_range(kvh_engine *e, kvhi_seq *s, uint64_t first, uint64_t n, uint32_t *b0, uint32_t *b1);
void kvhi_seq_destroy(kvh_engine *e, kvhi_seq *s);
/* Frees s->blocks and s->held (engine teardown frees sequences without
 * touching their blocks). */
void kvhi_seq_tables_free(kvhi_seq *s);
kvh_status kvhi_seq_create(kvh_engine *e, uint32_t agent, kvh_seq *out);
/* Keeps the lock. */
kvh_status kvhi_seq_fork(kvh_engine *e, kvhi_seq *s, uint32_t agent, kvh_seq *out);
/* Drops the lock (new blocks make room). */
kvh_status kvhi_seq_append(kvh_engine *e, kvhi_seq *s, const int32_t *tokens, size_t n);
kvh_status kvhi_seq_tokens(kvh_engine *e, kvhi_seq *s, uint64_t first, size_t n, int32_t *out);
/* Drops the lock (copy-on-write, bringing a block into memory). */
kvh_status kvhi_seq_write_kv(kvh_engine *e, kvhi_seq *s, uint32_t layer, uint64_t pos, size_t n, const void *k,
                             const void *v);
/* Drops the lock (blocks on disk are read into memory). */
kvh_status kvhi_seq_read_kv(kvh_engine *e, kvhi_seq *s, uint32_t layer, uint64_t pos, size_t n, void *k, void *v);
/* Drops the lock (a block on disk is brought to memory first). */
kvh_status kvhi_seq_truncate(kvh_engine *e, kvhi_seq *s, uint64_t n_tokens);
/* Drops the lock (blocks found on disk are read and verified). */
kvh_status kvhi_seq_match_prefix(kvh_engine *e, kvhi_seq *s, const int32_t *tokens, size_t n, size_t *matched);
/* Drops the lock unless fence is given (waits for the moves). */
kvh_status kvhi_seq_acquire(kvh_engine *e, kvhi_seq *s, uint64_t first, uint64_t n, kvh_fence *fence);
/* Counts one block attached from the prefix index, found in tier_found. */
void kvhi_count_prefix_hit(kvh_engine *e, uint32_t tier_found);
kvh_status kvhi_seq_pin(kvh_engine *e, kvhi_seq *s, uint64_t first, uint64_t n, bool pin);
kvh_status kvhi_seq_release(kvh_engine *e, kvhi_seq *s, uint64_t first, uint64_t n);
kvh_status kvhi_seq_hint(kvh_engine *e, kvhi_seq *s, uint64_t first, uint64_t n, int32_t priority);
/* Drops the lock (inline moves when no worker runs). */
kvh_status kvhi_prefetch(kvh_engine *e, kvhi_seq *s, uint64_t first, uint64_t n, int32_t priority, kvh_fence *fence);
/* Drops the lock (waits for the moves unless fence is given). */
kvh_status kvhi_migrate_blocks(kvh_engine *e, const uint32_t *blocks, size_t n, uint32_t tier, kvh_fence *fence);

#endif
