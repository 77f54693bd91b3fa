/* Exported sequence calls: argument checks, then the core under the lock. */
#include "abi/api_common.h"
#include "core/block.h"
#include "core/seq.h"
#include "core/hint_queue.h"
#include "core/disk_tier.h"
#include "core/scope.h"
#include "core/remote_tier.h"

kvh_status kvh_seq_create(kvh_engine *e, uint32_t agent, kvh_seq *seq)
{
    kvh_status st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    if (!seq) {
        kvhi_leave(e);
        return kvhi_fail(KVH_ERR_INVALID_ARG, "seq out-parameter is NULL");
    }
    kvh_seq h;
    st = kvhi_seq_create(e, agent, &h);
    kvhi_api_leave(e, st);
    if (st == KVH_OK)
        *seq = h;
    return st;
}

kvh_status kvh_seq_free(kvh_engine *e, kvh_seq seq)
{
    if (seq.id == 0 && e) {
        kvhi_clear_error();
        return KVH_OK;
    }
    kvhi_seq *s;
    kvh_status st = kvhi_api_enter_seq_owner(e, seq, &s); /* not while a call of it is inside */
    if (st != KVH_OK)
        return st;
    kvhi_handles_remove(&e->seqs, kvhi_handle_index(seq.id));
    kvhi_seq_destroy(e, s);
    return kvhi_api_leave(e, KVH_OK);
}

kvh_status kvh_seq_fork(kvh_engine *e, kvh_seq seq, uint32_t agent, kvh_seq *child)
{
    KVHI_REQUIRE(child, "child out-parameter is NULL");
    kvhi_seq *s;
    kvh_status st = kvhi_api_enter_seq_owner(e, seq, &s);
    if (st != KVH_OK)
        return st;
    kvh_seq h;
    st = kvhi_seq_fork(e, s, agent, &h);
    kvhi_api_leave_seq_owner(e, s, st);
    if (st == KVH_OK)
        *child = h;
    return st;
}

kvh_status kvh_seq_append(kvh_engine *e, kvh_seq seq, const int32_t *tokens, size_t n)
{
    KVHI_REQUIRE(tokens || n == 0, "tokens is NULL");
    kvhi_seq *s;
    kvh_status st = kvhi_api_enter_seq_owner(e, seq, &s);
    if (st != KVH_OK)
        return st;
    st = kvhi_seq_append(e, s, tokens, n);
    return kvhi_api_leave_seq_owner(e, s, st);
}

kvh_status kvh_seq_length(kvh_engine *e, kvh_seq seq, uint64_t *n_tokens)
{
    KVHI_REQUIRE(n_tokens, "n_tokens is NULL");
    kvhi_seq *s;
    kvh_status st = kvhi_api_enter_seq(e, seq, &s);
    if (st != KVH_OK)
        return st;
    *n_tokens = s->n_tokens;
    return kvhi_api_leave(e, KVH_OK);
}

kvh_status kvh_seq_tokens(kvh_engine *e, kvh_seq seq, uint64_t first, size_t n, int32_t *out)
{
    KVHI_REQUIRE(out || n == 0, "out is NULL");
    kvhi_seq *s;
    kvh_status st = kvhi_api_enter_seq_owner(e, seq, &s);
    if (st != KVH_OK)
        return st;
    st = kvhi_seq_tokens(e, s, first, n, out);
    return kvhi_api_leave_seq_owner(e, s, st);
}

kvh_status kvh_seq_write_kv(kvh_engine *e, kvh_seq seq, uint32_t layer, uint64_t pos, size_t n, const void *k,
                            const void *v)
{
    KVHI_REQUIRE((k && v) || n == 0, "k and v must not be NULL");
    kvhi_seq *s;
    kvh_status st = kvhi_api_enter_seq_owner(e, seq, &s);
    if (st != KVH_OK)
        return st;
    st = kvhi_seq_write_kv(e, s, layer, pos, n, k, v);
    return kvhi_api_leave_seq_owner(e, s, st);
}

kvh_status kvh_seq_read_kv(kvh_engine *e, kvh_seq seq, uint32_t layer, uint64_t pos, size_t n, void *k, void *v)
{
    kvhi_seq *s;
    kvh_status st = kvhi_api_enter_seq_owner(e, seq, &s);
    if (st != KVH_OK)
        return st;
    st = kvhi_seq_read_kv(e, s, layer, pos, n, k, v);
    return kvhi_api_leave_seq_owner(e, s, st);
}

kvh_status kvh_seq_persist(kvh_engine *e, kvh_seq seq)
{
    kvhi_seq *s;
    kvh_status st = kvhi_api_enter_seq_owner(e, seq, &s);
    if (st != KVH_OK)
        return st;
    /* With only a remote tier, persisting means uploading: of blocks
     * whose K/V is whole, as the disk tier's persist requires. */
    if (!e->disk && e->remote)
        for (uint64_t i = 0; i < s->n_tokens / e->cfg.block_tokens && st == KVH_OK; i++)
            if (!(e->blocks[s->blocks[i]].flags & KVHI_BF_KV_COMPLETE))
                st = kvhi_fail(KVH_ERR_INVALID_ARG, "block %llu of the sequence has KV that was never written",
                               (unsigned long long)i);
    if (st == KVH_OK)
        st = e->disk || !e->remote ? kvhi_disk_persist(e, s) : KVH_OK;
    if (st == KVH_OK && e->remote)
        kvhi_remote_persist(e, s);
    return kvhi_api_leave_seq_owner(e, s, st);
}

kvh_status kvh_seq_truncate(kvh_engine *e, kvh_seq seq, uint64_t n_tokens)
{
    kvhi_seq *s;
    kvh_status st = kvhi_api_enter_seq_owner(e, seq, &s);
    if (st != KVH_OK)
        return st;
    st = kvhi_seq_truncate(e, s, n_tokens);
    return kvhi_api_leave_seq_owner(e, s, st);
}

kvh_status kvh_seq_match_prefix(kvh_engine *e, kvh_seq seq, const int32_t *tokens, size_t n, size_t *matched_tokens)
{
    KVHI_REQUIRE(tokens || n == 0, "tokens is NULL");
    KVHI_REQUIRE(matched_tokens, "matched_tokens is NULL");
    kvhi_seq *s;
    kvh_status st = kvhi_api_enter_seq_owner(e, seq, &s);
    if (st != KVH_OK)
        return st;
    size_t m = 0;
    st = kvhi_seq_match_prefix(e, s, tokens, n, &m);
    kvhi_api_leave_seq_owner(e, s, st);
    if (st == KVH_OK)
        *matched_tokens = m;
    return st;
}

kvh_status kvh_seq_acquire(kvh_engine *e, kvh_seq seq, uint64_t first, uint64_t n, kvh_fence *fence)
{
    kvhi_seq *s;
    kvh_status st = kvhi_api_enter_seq_owner(e, seq, &s);
    if (st != KVH_OK)
        return st;
    kvh_fence f;
    st = kvhi_seq_acquire(e, s, first, n, fence ? &f : NULL);
    kvhi_api_leave_seq_owner(e, s, st);
    if (st == KVH_OK && fence)
        *fence = f;
    return st;
}

kvh_status kvh_seq_release(kvh_engine *e, kvh_seq seq, uint64_t first, uint64_t n)
{
    kvhi_seq *s;
    kvh_status st = kvhi_api_enter_seq_owner(e, seq, &s);
    if (st != KVH_OK)
        return st;
    st = kvhi_seq_release(e, s, first, n);
    return kvhi_api_leave_seq_owner(e, s, st);
}

kvh_status kvh_seq_pin(kvh_engine *e, kvh_seq seq, uint64_t first, uint64_t n, int32_t pinned)
{
    kvhi_seq *s;
    kvh_status st = kvhi_api_enter_seq_owner(e, seq, &s);
    if (st != KVH_OK)
        return st;
    st = kvhi_seq_pin(e, s, first, n, pinned != 0);
    return kvhi_api_leave_seq_owner(e, s, st);
}

kvh_status kvh_seq_blocks(kvh_engine *e, kvh_seq seq, uint64_t first_block, size_t n, kvh_block *out)
{
    KVHI_REQUIRE(out || n == 0, "out is NULL");
    kvhi_seq *s;
    kvh_status st = kvhi_api_enter_seq_owner(e, seq, &s);
    if (st != KVH_OK)
        return st;
    if (first_block > s->n_blocks || n > s->n_blocks - first_block)
        st = kvhi_fail(KVH_ERR_RANGE, "blocks [%llu, +%zu) pass the %u blocks of the sequence",
                       (unsigned long long)first_block, n, s->n_blocks);
    else
        for (size_t i = 0; i < n; i++)
            out[i].id = kvhi_block_handle(e, s->blocks[first_block + i]);
    return kvhi_api_leave_seq_owner(e, s, st);
}

kvh_status kvh_block_table(kvh_engine *e, const kvh_seq *seqs, size_t n_seqs, int32_t *indptr, int32_t *indices,
                           size_t indices_cap, int32_t *last_page_len)
{
    KVHI_REQUIRE(seqs || n_seqs == 0, "seqs is NULL");
    KVHI_REQUIRE(indptr && last_page_len, "indptr and last_page_len must not be NULL");
    KVHI_REQUIRE(indices || indices_cap == 0, "indices is NULL");
    kvh_status st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    /* Everything is checked before anything is written: out-parameters
     * are written only on success (the lock keeps the tables as checked). */
    size_t used = 0;
    for (size_t i = 0; i < n_seqs && st == KVH_OK; i++) {
        kvhi_seq *s;
        if ((st = kvhi_seq_get(e, seqs[i], &s)) != KVH_OK)
            break;
        if (used + s->n_blocks > INT32_MAX) {
            st = kvhi_fail(KVH_ERR_RANGE,
                           "the table holds more than 2^31 - 1 blocks (through sequence %zu): indptr is int32_t; "
                           "ask for fewer sequences at once",
                           i);
            break;
        }
        if (used + s->n_blocks > indices_cap) {
            st = kvhi_fail(KVH_ERR_RANGE, "indices_cap %zu is too small: the table needs at least %zu", indices_cap,
                           used + s->n_blocks);
            break;
        }
        for (uint32_t j = 0; j < s->n_blocks && st == KVH_OK; j++)
            if (!kvhi_block_in_device(e, s->blocks[j]))
                st = kvhi_fail(KVH_ERR_NOT_RESIDENT, "sequence %zu block %u is not in the device tier", i, j);
        used += s->n_blocks;
    }
    if (st == KVH_OK) {
        used = 0;
        indptr[0] = 0;
        for (size_t i = 0; i < n_seqs; i++) {
            kvhi_seq *s;
            (void)kvhi_seq_get(e, seqs[i], &s);
            for (uint32_t j = 0; j < s->n_blocks; j++)
                indices[used++] = (int32_t)e->blocks[s->blocks[j]].slot;
            indptr[i + 1] = (int32_t)used;
            last_page_len[i] = s->n_blocks ? e->blocks[s->blocks[s->n_blocks - 1]].n_tokens : 0;
        }
    }
    return kvhi_api_leave(e, st);
}

kvh_status kvh_seq_migrate(kvh_engine *e, kvh_seq seq, uint64_t first, uint64_t n, uint32_t tier, kvh_fence *fence)
{
    kvhi_seq *s;
    kvh_status st = kvhi_api_enter_seq(e, seq, &s);
    if (st != KVH_OK)
        return st;
    uint32_t b0 = 0, b1 = 0;
    st = kvhi_seq_block_range(e, s, first, n, &b0, &b1);
    if (st == KVH_OK) {
        kvh_fence f;
        /* An empty sequence has no block table yet (NULL + 0 is undefined). */
        st = kvhi_migrate_blocks(e, s->blocks ? s->blocks + b0 : NULL, b1 - b0, tier, fence ? &f : NULL);
        if (st == KVH_OK && fence)
            *fence = f;
    }
    return kvhi_api_leave(e, st);
}

kvh_status kvh_seq_hint(kvh_engine *e, kvh_seq seq, uint64_t first, uint64_t n, int32_t priority)
{
    kvhi_seq *s;
    kvh_status st = kvhi_api_enter_seq(e, seq, &s);
    if (st != KVH_OK)
        return st;
    st = kvhi_seq_hint(e, s, first, n, priority);
    return kvhi_api_leave(e, st);
}

kvh_status kvh_seq_hint_queued(kvh_engine *e, kvh_seq seq, uint64_t first, uint64_t n, uint64_t place, uint32_t kind)
{
    KVHI_REQUIRE(kind == KVH_HINT_POSITION || kind == KVH_HINT_REQUEST, "unknown hint place kind %u", (unsigned)kind);
    kvhi_seq *s;
    kvh_status st = kvhi_api_enter_seq(e, seq, &s);
    if (st != KVH_OK)
        return st;
    uint64_t step = e->qhint_step;
    uint64_t ahead = kind == KVH_HINT_POSITION ? place : place > step ? place - step : 0;
    if (ahead >= KVHI_HINT_QUEUE_REACH)
        st = kvhi_fail(KVH_ERR_RANGE, "request %llu places ahead: queue hints reach %u", (unsigned long long)ahead,
                       KVHI_HINT_QUEUE_REACH);
    else if (kind == KVH_HINT_POSITION && place > UINT64_MAX - step)
        st = kvhi_fail(KVH_ERR_RANGE, "request %llu places ahead of step %llu would be numbered past 2^64",
                       (unsigned long long)place, (unsigned long long)step);
    else
        st = kvhi_hint_queue(e, s, first, n, kind == KVH_HINT_POSITION ? step + place : place);
    return kvhi_api_leave(e, st);
}

kvh_status kvh_hint_advance(kvh_engine *e, uint64_t steps, uint64_t *step)
{
    KVHI_REQUIRE(step != NULL, "step is NULL");
    kvh_status st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    uint64_t now = 0;
    st = kvhi_hint_advance(e, steps, &now);
    kvhi_api_leave(e, st);
    if (st == KVH_OK)
        *step = now;
    return st;
}

kvh_status kvh_prefetch(kvh_engine *e, kvh_seq seq, uint64_t first, uint64_t n, int32_t priority, kvh_fence *fence)
{
    kvhi_seq *s;
    kvh_status st = kvhi_api_enter_seq(e, seq, &s);
    if (st != KVH_OK)
        return st;
    kvh_fence f;
    st = kvhi_prefetch(e, s, first, n, priority, fence ? &f : NULL);
    kvhi_api_leave(e, st);
    if (st == KVH_OK && fence)
        *fence = f;
    return st;
}

kvh_status kvh_seq_set_scope(kvh_engine *e, kvh_seq seq, uint64_t scope, uint64_t shared_scope, uint64_t shared_tokens)
{
    kvhi_seq *s;
    kvh_status st = kvhi_api_enter_seq_owner(e, seq, &s);
    if (st != KVH_OK)
        return st;
    kvhi_scope sc = {.scope = scope, .shared_scope = shared_scope, .shared_tokens = shared_tokens};
    st = kvhi_seq_set_scope(e, s, &sc);
    return kvhi_api_leave_seq_owner(e, s, st);
}

kvh_status kvh_seq_get_scope(kvh_engine *e, kvh_seq seq, uint64_t *scope, uint64_t *shared_scope,
                             uint64_t *shared_tokens)
{
    kvhi_seq *s;
    kvh_status st = kvhi_api_enter_seq(e, seq, &s);
    if (st != KVH_OK)
        return st;
    kvhi_scope sc = s->scope;
    kvhi_api_leave(e, KVH_OK);
    if (scope)
        *scope = sc.scope;
    if (shared_scope)
        *shared_scope = sc.shared_scope;
    if (shared_tokens)
        *shared_tokens = sc.shared_tokens;
    return KVH_OK;
}
