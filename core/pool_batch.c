/* Batched pool transfers and persists (core/pool_batch.h): the queue the
 * migration workers serve before their moves, and the three kinds of
 * work. Each item's block is referenced and held by the work from the
 * call until it ends, so it stays alive and in place while the lock is
 * dropped for the copies; the external pool counts the works on it, so
 * unregistering waits for them. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/block.h"
#include "core/block_state.h"
#include "core/disk_io.h"
#include "core/disk_tier.h"
#include "core/migrate.h"
#include "core/move.h"
#include "core/pool_batch.h"
#include "core/remote_tier.h"

kvhi_pool_work *kvhi_pool_work_new(kvh_engine *e, uint32_t kind, uint32_t n, uint32_t n_fences,
                                   kvh_fence *fence_handles)
{
    kvhi_pool_work *w = calloc(1, sizeof(*w));
    if (w) {
        w->kind = kind;
        w->n = n;
        w->items = calloc(n ? n : 1, sizeof(*w->items));
        w->fences = calloc(n_fences ? n_fences : 1, sizeof(uint32_t));
        if (kind == KVHI_PW_OFFLOAD)
            w->tokens = malloc(sizeof(int32_t) * e->cfg.block_tokens * (n ? n : 1));
    }
    if (!w || !w->items || !w->fences || (kind == KVHI_PW_OFFLOAD && !w->tokens)) {
        if (w) {
            free(w->items);
            free(w->fences);
            free(w->tokens);
            free(w);
        }
        kvhi_fail(KVH_ERR_NOMEM, "out of memory for a batch of %u transfers", n);
        return NULL;
    }
    for (uint32_t i = 0; i < n_fences; i++) {
        if (kvhi_fence_new(e, &w->fences[i], &fence_handles[i]) != KVH_OK) {
            kvhi_pool_work_discard(e, w);
            kvhi_fail(KVH_ERR_NOMEM, "out of memory for the fences of a batch");
            return NULL;
        }
        kvhi_fence_expect(e, w->fences[i], 1);
        w->n_fences = i + 1;
    }
    return w;
}

static void work_free(kvhi_pool_work *w)
{
    free(w->items);
    free(w->fences);
    free(w->tokens);
    free(w);
}

void kvhi_pool_work_discard(kvh_engine *e, kvhi_pool_work *w)
{
    for (uint32_t i = 0; i < w->n_fences; i++) {
        kvhi_fence_done(e, w->fences[i], KVH_OK);
        kvhi_fence_drop(e, w->fences[i]);
    }
    work_free(w);
}

/* Gives back what the work took for item it (references, holds). */
static void item_release(kvh_engine *e, const kvhi_pool_work *w, kvhi_pool_item *it)
{
    kvhi_block *blk = &e->blocks[it->block];
    if (w->kind == KVHI_PW_OFFLOAD && !it->copy)
        return; /* a cached block: its reference is the caller's handle */
    if (w->kind == KVHI_PW_OFFLOAD)
        blk->flags &= (uint16_t)~KVHI_BF_POOL_FILL;
    if (w->kind != KVHI_PW_PERSIST)
        kvhi_block_unhold_reading(e, it->block);
    if (w->kind == KVHI_PW_RESTORE && it->st == KVH_OK)
        kvhi_block_touch(e, it->block);
    kvhi_block_unref(e, it->block);
}

/* Writes the items' statuses (to the caller's memory), gives back the
 * blocks and the pool, completes the fences and frees w. */
static kvh_status work_end(kvh_engine *e, kvhi_pool_work *w, uint32_t first_fence, kvh_status fence_st, const char *msg)
{
    for (uint32_t i = 0; i < w->n; i++) {
        if (w->items[i].status)
            *w->items[i].status = w->items[i].st;
        item_release(e, w, &w->items[i]);
        if (w->pool) {
            kvhi_slot_use u = {
                .write = w->kind == KVHI_PW_RESTORE, .first_layer = w->first_layer, .n_layers = w->n_layers};
            kvhi_pool_slot_leave(w->pool, w->items[i].slot, u);
        }
    }
    if (w->pool && --w->pool->batches == 0)
        pthread_cond_broadcast(&e->changed);
    pthread_cond_broadcast(&e->changed); /* gathers ended: persists wait on them */
    for (uint32_t f = first_fence; f < w->n_fences; f++) {
        if (fence_st != KVH_OK)
            kvhi_fail(fence_st, "%s", msg);
        kvhi_fence_done(e, w->fences[f], fence_st);
    }
    work_free(w);
    return fence_st == KVH_OK ? KVH_OK : kvhi_fail(fence_st, "%s", msg);
}

/* Records an item's failure, keeping the batch's first for its fences. */
static void item_fail(kvhi_pool_item *it, kvh_status st, const char *why, kvh_status *first, char *msg, size_t len)
{
    it->st = st;
    if (*first == KVH_OK) {
        *first = st;
        snprintf(msg, len, "slot %u: %.160s", it->slot, why);
    }
}

/* An item that shares an earlier item's copy (one prefix twice in the
 * batch) ends as that copy did. */
static void shared_outcomes(kvhi_pool_work *w)
{
    for (uint32_t i = 0; i < w->n; i++)
        if (w->items[i].shares)
            w->items[i].st = w->items[w->items[i].shares - 1].st;
}

static kvh_status run_offload(kvh_engine *e, kvhi_pool_work *w)
{
    kvhi_ext_pool *p = w->pool;
    kvh_status first = KVH_OK;
    char msg[192] = "";
    bool any = false;
    for (uint32_t i = 0; i < w->n; i++) {
        kvhi_pool_item *it = &w->items[i];
        if (!it->copy)
            continue;
        if (p->unregistered)
            item_fail(it, KVH_ERR_BAD_HANDLE, "the pool was unregistered before its batch ran", &first, msg,
                      sizeof(msg));
        else if ((it->st = kvhi_pool_span_prepare(e, p, it->block, true, &it->span)) != KVH_OK)
            item_fail(it, it->st, kvhi_last_error(), &first, msg, sizeof(msg));
        else
            any = true;
    }
    if (any) {
        char why[256];
        kvhi_unlock_for_copy(e);
        for (uint32_t i = 0; i < w->n; i++) {
            kvhi_pool_item *it = &w->items[i];
            if (!it->copy || it->st != KVH_OK)
                continue;
            bool ok = kvhi_pool_span_copy(e, p, it->slot, &it->span, true, 0, e->cfg.num_layers, why, sizeof(why)) == 0;
            if (kvhi_pool_span_finish(e, &it->span, true, ok) != 0 && ok) {
                ok = false;
                snprintf(why, sizeof(why), "encoding a gathered block for its tier failed");
            }
            if (!ok)
                item_fail(it, KVH_ERR_IO, why, &first, msg, sizeof(msg));
        }
        kvhi_relock_after_copy(e);
    }
    for (uint32_t i = 0; i < w->n; i++) {
        kvhi_pool_item *it = &w->items[i];
        if (it->copy && it->st == KVH_OK)
            kvhi_pool_seal(e, it->block, it->hash, it->parent, it->tokens);
    }
    shared_outcomes(w);
    return work_end(e, w, 0, first, msg);
}

/* Brings the items' blocks that are on disk into a memory tier as batches
 * of reads (few large I/Os, verified as every read is), the way the
 * workers batch their moves; what this leaves (a block busy elsewhere, a
 * failed read) goes through kvhi_block_ensure_memory one by one. */
static void read_disk_blocks(kvh_engine *e, kvhi_pool_work *w)
{
    if (!e->disk)
        return;
    enum { MAX = 64 };
    uint32_t limit = e->disk->lane_blocks < MAX ? e->disk->lane_blocks : MAX;
    kvhi_xfer *xs = malloc(sizeof(kvhi_xfer) * MAX);
    if (!xs || limit == 0) {
        free(xs);
        return;
    }
    uint32_t to = e->tiers[KVH_TIER_HOST].present ? KVH_TIER_HOST : KVH_TIER_DEVICE;
    for (uint32_t i = 0; i < w->n;) {
        uint32_t k = 0;
        for (; i < w->n && k < limit; i++) {
            kvhi_block *blk = &e->blocks[w->items[i].block];
            if (blk->tier != KVH_TIER_DISK || kvhi_block_busy(blk) || (blk->flags & KVHI_BF_CORRUPT))
                continue;
            if (kvhi_move_begin(e, w->items[i].block, to, &xs[k], false) == 0)
                k++;
        }
        if (k == 0)
            continue;
        kvhi_unlock_for_copy(e);
        kvhi_xfer_batch(e, xs, k);
        kvhi_relock_after_copy(e);
        for (uint32_t j = 0; j < k; j++)
            (void)kvhi_move_end(e, &xs[j], NULL); /* a failure is found again below */
    }
    free(xs);
}

static kvh_status run_restore(kvh_engine *e, kvhi_pool_work *w)
{
    kvhi_ext_pool *p = w->pool;
    kvh_status first = KVH_OK;
    char msg[192] = "";
    /* Blocks on disk come into memory first (reads drop the lock); the
     * spans are taken after all of them, with no drop in between. */
    if (!p->unregistered)
        read_disk_blocks(e, w);
    for (uint32_t i = 0; i < w->n; i++) {
        kvhi_pool_item *it = &w->items[i];
        kvh_status st = p->unregistered ? KVH_ERR_BAD_HANDLE : kvhi_block_ensure_memory(e, it->block);
        if (st != KVH_OK)
            item_fail(it, st, p->unregistered ? "the pool was unregistered before its batch ran" : kvhi_last_error(),
                      &first, msg, sizeof(msg));
    }
    bool *ready = calloc(w->n ? w->n : 1, sizeof(bool));
    for (uint32_t i = 0; i < w->n; i++) {
        kvhi_pool_item *it = &w->items[i];
        if (it->st != KVH_OK)
            continue;
        if (!ready)
            item_fail(it, KVH_ERR_NOMEM, "out of memory for a restore", &first, msg, sizeof(msg));
        else if ((it->st = kvhi_pool_span_prepare(e, p, it->block, false, &it->span)) != KVH_OK)
            item_fail(it, it->st, kvhi_last_error(), &first, msg, sizeof(msg));
        else
            ready[i] = true;
    }
    char why[256];
    for (uint32_t l = 0; l < w->n_layers; l++) {
        kvhi_unlock_for_copy(e);
        for (uint32_t i = 0; i < w->n; i++) {
            kvhi_pool_item *it = &w->items[i];
            if (!ready || !ready[i] || it->st != KVH_OK)
                continue;
            if (l == 0 && kvhi_pool_span_decode(e, &it->span) != 0) {
                item_fail(it, KVH_ERR_IO, "decoding a block for a restore failed", &first, msg, sizeof(msg));
                continue;
            }
            if (kvhi_pool_span_copy(e, p, it->slot, &it->span, false, w->first_layer + l, 1, why, sizeof(why)) != 0)
                item_fail(it, KVH_ERR_IO, why, &first, msg, sizeof(msg));
        }
        kvhi_relock_after_copy(e);
        /* This layer is in place in every item that did not fail: its
         * fence completes now, with the statuses written so far. */
        if (l + 1 < w->n_layers) {
            for (uint32_t i = 0; i < w->n; i++)
                if (w->items[i].status)
                    *w->items[i].status = w->items[i].st;
            if (first != KVH_OK)
                kvhi_fail(first, "%s", msg);
            kvhi_fence_done(e, w->fences[l], first);
        }
    }
    for (uint32_t i = 0; i < w->n; i++)
        if (ready && ready[i])
            kvhi_pool_span_finish(e, &w->items[i].span, false, false);
    free(ready);
    return work_end(e, w, w->n_layers ? w->n_layers - 1 : 0, first, msg);
}

static kvh_status run_persist(kvh_engine *e, kvhi_pool_work *w)
{
    kvh_status first = KVH_OK;
    char msg[192] = "";
    uint32_t *blocks = malloc(sizeof(uint32_t) * (w->n ? w->n : 1)), k = 0;
    uint32_t *twins = malloc(sizeof(uint32_t) * (w->n ? w->n : 1));
    for (uint32_t i = 0; i < w->n; i++) {
        kvhi_pool_item *it = &w->items[i];
        kvhi_block *blk = &e->blocks[it->block];
        while (blk->flags & KVHI_BF_POOL_FILL) /* an offload batch is gathering it */
            pthread_cond_wait(&e->changed, &e->lock);
        if (!(blk->flags & KVHI_BF_KV_COMPLETE))
            item_fail(it, KVH_ERR_INVALID_ARG, "its offload failed: the block holds no KV", &first, msg, sizeof(msg));
        else if (blocks)
            blocks[k++] = it->block;
    }
    kvh_status st = !blocks || !twins ? kvhi_fail(KVH_ERR_NOMEM, "out of memory for a persist")
                    : e->disk         ? kvhi_disk_persist_blocks(e, blocks, k, "of the list", twins)
                                      : KVH_OK; /* with only a remote tier, persisting means uploading */
    /* A twin made durable in a block's place lives as long as the block. */
    for (uint32_t i = 0; e->disk && blocks && twins && i < k; i++)
        if (twins[i] != KVHI_NO_BLOCK && kvhi_block_keep_twin(e, blocks[i], twins[i]) != 0) {
            kvhi_block_unref(e, twins[i]);
            if (st == KVH_OK)
                st = kvhi_fail(KVH_ERR_NOMEM, "out of memory keeping a persisted block's twin");
        }
    if (st == KVH_OK && e->remote)
        kvhi_remote_persist_blocks(e, blocks, k);
    if (st != KVH_OK && first == KVH_OK) {
        first = st;
        snprintf(msg, sizeof(msg), "%s", kvhi_last_error());
    }
    free(blocks);
    free(twins);
    return work_end(e, w, 0, first, msg);
}

static kvh_status work_run(kvh_engine *e, kvhi_pool_work *w)
{
    if (w->kind == KVHI_PW_OFFLOAD)
        return run_offload(e, w);
    if (w->kind == KVHI_PW_RESTORE)
        return run_restore(e, w);
    return run_persist(e, w);
}

kvh_status kvhi_pool_work_run_now(kvh_engine *e, kvhi_pool_work *w)
{
    kvhi_assert_locked(e);
    return work_run(e, w);
}

void kvhi_pool_work_submit(kvh_engine *e, kvhi_pool_work *w)
{
    kvhi_assert_locked(e);
    if (w->pool)
        w->pool->batches++;
    if (e->n_workers == 0 || w->n == 0) { /* nothing to wait for: done now */
        (void)work_run(e, w);
        return;
    }
    w->next = NULL;
    if (e->pool_work_tail)
        e->pool_work_tail->next = w;
    else
        e->pool_work_head = w;
    e->pool_work_tail = w;
    pthread_cond_signal(&e->work_ready);
}

/* The oldest transfer, else the oldest persist: an inference engine waits
 * on transfers within a step, while a persist (writes and a sync) is
 * background work. A persist still follows every offload queued before it
 * (it may wait for their gathers): those are taken first. */
static kvhi_pool_work *work_pop(kvh_engine *e)
{
    kvhi_pool_work *prev = NULL, *w = e->pool_work_head;
    while (w && w->kind == KVHI_PW_PERSIST) {
        prev = w;
        w = w->next;
    }
    if (!w) {
        prev = NULL;
        w = e->pool_work_head;
    }
    if (!w)
        return NULL;
    if (prev)
        prev->next = w->next;
    else
        e->pool_work_head = w->next;
    if (e->pool_work_tail == w)
        e->pool_work_tail = prev;
    return w;
}

void kvhi_pool_work_run_next(kvh_engine *e)
{
    kvhi_pool_work *w = work_pop(e);
    if (w)
        (void)work_run(e, w);
}

void kvhi_pool_work_cancel_all(kvh_engine *e)
{
    kvhi_pool_work *w;
    while ((w = work_pop(e)) != NULL) {
        for (uint32_t i = 0; i < w->n; i++)
            if (!(w->kind == KVHI_PW_OFFLOAD && !w->items[i].copy))
                w->items[i].st = KVH_ERR_CLOSED;
        if (w->kind == KVHI_PW_OFFLOAD)
            shared_outcomes(w);
        (void)work_end(e, w, 0, KVH_ERR_CLOSED, "the engine was closed before the batch ran");
    }
}
