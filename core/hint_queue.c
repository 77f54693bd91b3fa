/* Queue hints: what a scheduler's queue says about the next reads.
 *
 * The engine counts steps: the requests the caller has taken from its
 * queue (kvh_hint_advance). A queue hint names the request that will read
 * a range, by its place in the queue (0: the next one, request number
 * `step`) or by its number; either way it is stored as that request's
 * number, so a caller that re-hints its queue by place before every
 * step, one that hints by number, and one that hints a request once when
 * it enters the queue all give each block the same priority. The
 * priority is kvh_seq_hint's, with the sooner request the higher
 * (INT32_MAX - (request - base), base the step rounded down to a
 * multiple of 2^30), so the victim order and the two priorities a block
 * keeps are those of core/hints.c; a queue priority is marked as such
 * there, and only an access once the step has reached its request
 * redeems it (an access by an earlier request, a prefix match, leaves
 * it in place, as re-hinting would put it back). Every filed request
 * lies in [step, step + 2^24), so its offset from base stays below
 * 2^30 + 2^24 and the ranks never wrap; when
 * the step enters the next 2^30 the filed pairs are re-ranked against the
 * new base (all of them, once every 2^30 steps).
 *
 * What makes a priority stale is its request passing, not time: queue
 * hints leave no lapse record; instead each new (block, request) pair is
 * filed in a min-heap by request number, and when the step passes a
 * request the pairs filed for it are dropped from their blocks (a block
 * its request read has already redeemed that priority). So a request
 * the caller dropped or moved later cannot keep outranking the requests
 * queued behind it for longer than the step takes to pass its number.
 * Each (block, request) pair is filed once while the block holds it, so
 * re-hinting the queue before every step files nothing new. A block that
 * gave a priority up (redeemed by a read once due) and is hinted for the
 * same request again is filed again; so before the heap grows, the pairs
 * no block holds any more and the repeats are swept out: what stays is at
 * most the two priorities each block keeps, and the heap's size follows
 * that, not the number of hints.
 * Cost: O(log n) per new pair amortised, each popped once. */
#include "core/hint_queue.h"

#include <stdlib.h>

#include "core/block.h"

typedef struct kvhi_queue_hint {
    uint64_t request;
    uint32_t block, gen;
} kvhi_queue_hint;

#define RANK_WINDOW (1ull << 30)

static uint64_t rank_base(uint64_t step) { return step & ~(RANK_WINDOW - 1); }

/* request >= base and request - base < 2^30 + 2^24: a positive priority,
 * falling as the request comes later. */
static int32_t priority_at(uint64_t base, uint64_t request) { return (int32_t)(INT32_MAX - (int64_t)(request - base)); }

static int32_t request_priority(const kvh_engine *e, uint64_t request)
{
    return priority_at(rank_base(e->qhint_step), request);
}

static void heap_swap(kvhi_queue_hint *h, uint32_t i, uint32_t j)
{
    kvhi_queue_hint t = h[i];
    h[i] = h[j];
    h[j] = t;
}

static void sift_down(kvhi_queue_hint *h, uint32_t n, uint32_t i)
{
    for (;;) {
        uint32_t l = 2 * i + 1, m = i;
        if (l < n && h[l].request < h[m].request)
            m = l;
        if (l + 1 < n && h[l + 1].request < h[m].request)
            m = l + 1;
        if (m == i)
            return;
        heap_swap(h, i, m);
        i = m;
    }
}

static int pair_cmp(const void *a, const void *b)
{
    const kvhi_queue_hint *x = a, *y = b;
    if (x->block != y->block)
        return x->block < y->block ? -1 : 1;
    if (x->gen != y->gen)
        return x->gen < y->gen ? -1 : 1;
    return (x->request > y->request) - (x->request < y->request);
}

/* Drops the pairs whose block no longer holds their priority (redeemed,
 * pushed out, freed) and all but one of each repeated pair, then rebuilds
 * the heap. */
static void sweep(kvh_engine *e)
{
    kvhi_queue_hint *h = e->qhint_heap;
    uint64_t base = rank_base(e->qhint_step);
    uint32_t k = 0;
    for (uint32_t i = 0; i < e->qhint_count; i++) {
        const kvhi_block *blk = &e->blocks[h[i].block];
        if (blk->gen == h[i].gen && (blk->flags & KVHI_BF_LIVE) &&
            kvhi_hint_holds_queued(e, h[i].block, priority_at(base, h[i].request)))
            h[k++] = h[i];
    }
    qsort(h, k, sizeof(*h), pair_cmp);
    uint32_t n = 0;
    for (uint32_t i = 0; i < k; i++)
        if (n == 0 || pair_cmp(&h[n - 1], &h[i]) != 0)
            h[n++] = h[i];
    for (uint32_t i = n / 2; i-- > 0;)
        sift_down(h, n, i);
    e->qhint_count = n;
}

static bool file_pair(kvh_engine *e, kvhi_queue_hint r)
{
    if (e->qhint_count == e->qhint_cap) {
        /* Full: sweep first, and grow only while over half is still held. */
        if (e->qhint_cap)
            sweep(e);
        if (e->qhint_cap == 0 || e->qhint_count > e->qhint_cap / 2) {
            if (e->qhint_cap > UINT32_MAX / 2)
                return false; /* as out of memory: advice, dropped */
            uint32_t cap = e->qhint_cap ? e->qhint_cap * 2 : 256;
            kvhi_queue_hint *h = realloc(e->qhint_heap, (size_t)cap * sizeof(*h));
            if (!h)
                return false;
            e->qhint_heap = h;
            e->qhint_cap = cap;
        }
    }
    kvhi_queue_hint *h = e->qhint_heap;
    uint32_t i = e->qhint_count++;
    h[i] = r;
    while (i > 0 && h[(i - 1) / 2].request > h[i].request) {
        heap_swap(h, i, (i - 1) / 2);
        i = (i - 1) / 2;
    }
    return true;
}

static kvhi_queue_hint pop_pair(kvh_engine *e)
{
    kvhi_queue_hint *h = e->qhint_heap;
    kvhi_queue_hint top = h[0];
    h[0] = h[--e->qhint_count];
    sift_down(h, e->qhint_count, 0);
    return top;
}

/* The step entered a new window: every pair still filed (its request not
 * passed, so at or after new_base) is ranked against new_base instead.
 * Each priority only rises, by the same amount for every pair, so their
 * order among themselves is kept and heaps take the higher keys as they
 * are (core/lruk.h). */
static void rerank(kvh_engine *e, uint64_t old_base, uint64_t new_base)
{
    for (uint32_t i = 0; i < e->qhint_count; i++) {
        const kvhi_queue_hint *r = &e->qhint_heap[i];
        kvhi_block *blk = &e->blocks[r->block];
        if (blk->gen != r->gen || !(blk->flags & KVHI_BF_LIVE) || !(blk->flags & KVHI_BF_HINTED))
            continue;
        kvhi_hint_rerank(e, r->block, priority_at(old_base, r->request), priority_at(new_base, r->request));
    }
}

kvh_status kvhi_hint_queue(kvh_engine *e, kvhi_seq *s, uint64_t first, uint64_t n, uint64_t request)
{
    uint32_t b0 = 0, b1 = 0;
    kvh_status st = kvhi_seq_block_range(e, s, first, n, &b0, &b1);
    if (st != KVH_OK)
        return st;
    if (request < e->qhint_step)
        return KVH_OK; /* that request has been taken: nothing left to say */
    int32_t priority = request_priority(e, request);
    for (uint32_t i = b0; i < b1; i++) {
        uint32_t b = s->blocks[i];
        if (!kvhi_hint_set_unlapsing(e, b, priority))
            continue; /* held for this request already (filed), or two sooner ones kept */
        if (!file_pair(e, (kvhi_queue_hint){.request = request, .block = b, .gen = e->blocks[b].gen}))
            kvhi_hint_drop(e, b, priority); /* out of memory: advice, dropped */
    }
    return KVH_OK;
}

kvh_status kvhi_hint_advance(kvh_engine *e, uint64_t steps, uint64_t *step)
{
    if (steps > UINT64_MAX - e->qhint_step)
        return kvhi_fail(KVH_ERR_RANGE, "the hint step would pass 2^64");
    uint64_t old_base = rank_base(e->qhint_step), to = e->qhint_step + steps;
    while (e->qhint_count && e->qhint_heap[0].request < to) {
        kvhi_queue_hint r = pop_pair(e);
        kvhi_block *blk = &e->blocks[r.block];
        if (blk->gen == r.gen && (blk->flags & KVHI_BF_LIVE))
            kvhi_hint_drop(e, r.block, priority_at(old_base, r.request));
    }
    e->qhint_step = to;
    /* Memory follows the pairs filed, down as well as up. */
    if (e->qhint_cap > 256 && e->qhint_count < e->qhint_cap / 4) {
        kvhi_queue_hint *h = realloc(e->qhint_heap, (size_t)(e->qhint_cap / 2) * sizeof(*h));
        if (h) {
            e->qhint_heap = h;
            e->qhint_cap /= 2;
        }
    }
    if (rank_base(to) != old_base)
        rerank(e, old_base, rank_base(to));
    *step = e->qhint_step;
    return KVH_OK;
}

bool kvhi_hint_queue_due(const kvh_engine *e, int32_t priority)
{
    return e->qhint_count && priority != KVHI_HINT_NONE && priority >= request_priority(e, e->qhint_step);
}

void kvhi_hint_queue_free(kvh_engine *e)
{
    free(e->qhint_heap);
    e->qhint_heap = NULL;
    e->qhint_count = e->qhint_cap = 0;
}
