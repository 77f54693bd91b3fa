/* Admission by token budget: two pools (short and long requests) with
 * their own device-tier quotas for KV. A request reserves the blocks of
 * its budget in its pool before its sequence exists, so a request that
 * cannot fit is refused before anything is allocated, and long requests
 * cannot take the room kept for short ones (most requests are short;
 * sizing one pool for the longest wastes most of it).
 *
 * A sequence that grows past its budget reserves the blocks it passes it
 * by, or is refused (kvhi_admission_grow): a budget is an estimate, the
 * pool's quota is not. A reservation ends when its sequence is freed. Rather than hook
 * sequence destruction, the live reservations are swept for dead handles
 * (generation-checked, so never confused with a new sequence) whenever
 * the pools are consulted. */
#include <stdlib.h>

#include "core/context.h"
#include "core/seq.h"

void kvhi_admission_free(kvhi_admission *a)
{
    free(a->live);
    a->live = NULL;
    a->n_live = a->cap_live = 0;
}

void kvhi_admission_reclaim(kvh_engine *e)
{
    kvhi_admission *a = &e->contexts->admission;
    for (uint32_t i = 0; i < a->n_live;) {
        if (kvhi_handles_get(&e->seqs, a->live[i].seq, NULL)) {
            i++;
            continue;
        }
        a->reserved_blocks[a->live[i].pool] -= a->live[i].blocks;
        a->live[i] = a->live[--a->n_live];
    }
}

kvh_status kvhi_admission_reserve(kvh_engine *e, uint64_t token_budget, int *pool_out, uint64_t *blocks_out)
{
    kvhi_admission *a = &e->contexts->admission;
    *pool_out = -1;
    *blocks_out = 0;
    if (!a->enabled || token_budget == 0)
        return KVH_OK;
    kvhi_admission_reclaim(e);
    int pool = token_budget <= a->short_max_tokens ? 0 : 1;
    /* Rounded up without wrapping for budgets near UINT64_MAX (they would
     * reserve nothing). */
    uint64_t bt = e->cfg.block_tokens, blocks = kvhi_div_ceil(token_budget, bt);
    uint64_t reserved = a->reserved_blocks[pool], quota = a->quota_blocks[pool];
    if (reserved > quota || blocks > quota - reserved) {
        a->rejected[pool]++;
        return kvhi_fail(
            KVH_ERR_NOSPACE, "%s-context pool: %llu of %llu blocks reserved, a budget of %llu tokens needs %llu more",
            pool ? "long" : "short", (unsigned long long)a->reserved_blocks[pool],
            (unsigned long long)a->quota_blocks[pool], (unsigned long long)token_budget, (unsigned long long)blocks);
    }
    a->reserved_blocks[pool] += blocks;
    *pool_out = pool;
    *blocks_out = blocks;
    return KVH_OK;
}

void kvhi_admission_cancel(kvh_engine *e, int pool, uint64_t blocks)
{
    if (pool >= 0)
        e->contexts->admission.reserved_blocks[pool] -= blocks;
}

kvh_status kvhi_admission_bind(kvh_engine *e, int pool, uint64_t blocks, kvhi_seq *s, uint64_t seq)
{
    kvhi_admission *a = &e->contexts->admission;
    if (pool < 0)
        return KVH_OK;
    if (a->n_live == a->cap_live) {
        uint32_t cap = a->cap_live ? a->cap_live * 2 : 16;
        struct kvhi_admitted *nl = realloc(a->live, sizeof(*nl) * cap);
        if (!nl)
            return kvhi_fail(KVH_ERR_NOMEM, "out of memory for admission records");
        a->live = nl;
        a->cap_live = cap;
    }
    a->live[a->n_live++] = (struct kvhi_admitted){.seq = seq, .blocks = blocks, .pool = (uint8_t)pool};
    a->admitted[pool]++;
    s->admission_pool = (uint8_t)(pool + 1);
    s->admission_blocks = blocks;
    s->admission_handle = seq;
    return KVH_OK;
}

static struct kvhi_admitted *admitted_record(kvhi_admission *a, uint64_t seq)
{
    for (uint32_t i = 0; i < a->n_live; i++)
        if (a->live[i].seq == seq)
            return &a->live[i];
    return NULL;
}

uint64_t kvhi_admission_room(kvh_engine *e, const kvhi_seq *s)
{
    if (!s->admission_pool || !e->contexts->admission.enabled)
        return UINT64_MAX;
    kvhi_admission *a = &e->contexts->admission;
    kvhi_admission_reclaim(e); /* freed sequences' blocks are room */
    int pool = s->admission_pool - 1;
    uint64_t reserved = a->reserved_blocks[pool], quota = a->quota_blocks[pool];
    return s->admission_blocks + (reserved < quota ? quota - reserved : 0);
}

kvh_status kvhi_admission_grow(kvh_engine *e, kvhi_seq *s, uint64_t blocks, uint64_t *grown)
{
    *grown = 0;
    if (!s->admission_pool || blocks <= s->admission_blocks || !e->contexts->admission.enabled)
        return KVH_OK;
    kvhi_admission *a = &e->contexts->admission;
    int pool = s->admission_pool - 1;
    uint64_t more = blocks - s->admission_blocks;
    /* The room first: it reclaims, which moves records. */
    if (blocks > kvhi_admission_room(e, s))
        return kvhi_fail(KVH_ERR_NOSPACE,
                         "the sequence, past its token budget, would hold %llu blocks, %llu more than its "
                         "%s-context pool reserved for it, and the pool has %llu of %llu blocks reserved",
                         (unsigned long long)blocks, (unsigned long long)more, pool ? "long" : "short",
                         (unsigned long long)a->reserved_blocks[pool], (unsigned long long)a->quota_blocks[pool]);
    struct kvhi_admitted *r = admitted_record(a, s->admission_handle);
    if (!r)
        return KVH_OK; /* not reachable: a live sequence keeps its record */
    a->reserved_blocks[pool] += more;
    r->blocks += more;
    s->admission_blocks = blocks;
    *grown = more;
    return KVH_OK;
}

void kvhi_admission_shrink(kvh_engine *e, kvhi_seq *s, uint64_t grown)
{
    if (!grown || !s->admission_pool)
        return;
    kvhi_admission *a = &e->contexts->admission;
    struct kvhi_admitted *r = admitted_record(a, s->admission_handle);
    if (!r)
        return;
    a->reserved_blocks[r->pool] -= grown;
    r->blocks -= grown;
    s->admission_blocks -= grown;
}
