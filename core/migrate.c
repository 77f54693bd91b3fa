/* Asynchronous migration: a priority queue of block moves served by worker
 * threads (or run in the caller when there are none), and fences that
 * count the moves a request is waiting for. */
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/block_state.h"
#include "core/engine.h"
#include "core/move.h"
#include "core/block.h"
#include "core/tier.h"
#include "core/numa_place.h"
#include "core/migrate.h"
#include "core/disk_tier.h"
#include "core/pool_batch.h"

/* ---- fences ---- */

kvh_status kvhi_fence_new(kvh_engine *e, uint32_t *idx, kvh_fence *handle)
{
    kvhi_fence *f = calloc(1, sizeof(*f));
    if (!f)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for a fence");
    uint64_t h;
    if (kvhi_handles_add(&e->fences, f, &h, idx) != 0) {
        free(f);
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for a fence");
    }
    if (handle)
        handle->id = h;
    return KVH_OK;
}

void kvhi_fence_drop(kvh_engine *e, uint32_t idx)
{
    kvhi_fence *f = kvhi_handles_at(&e->fences, idx);
    if (!f)
        return;
    if (f->pending || f->waiters) {
        f->user_freed = true; /* reaped by the last kvhi_fence_done */
        return;
    }
    free(f);
    kvhi_handles_remove(&e->fences, idx);
}

/* The first failure's status and text; an acquire larger than the device
 * tier says so instead of what the eviction found. */
static void fence_set_failure(kvhi_fence *f, kvh_status st, const char *msg)
{
    f->status = st;
    if (st == KVH_ERR_NOSPACE && f->range_blocks)
        snprintf(f->msg, sizeof(f->msg),
                 "the range's %u blocks are more than the device tier holds (%llu slots): acquire at most that "
                 "many at once, or stream the attention over it (stream_window_blocks)",
                 f->range_blocks, (unsigned long long)f->device_slots);
    else
        snprintf(f->msg, sizeof(f->msg), "%s", msg);
}

void kvhi_fence_done(kvh_engine *e, uint32_t idx, kvh_status st)
{
    if (idx == KVHI_NO_BLOCK)
        return;
    kvhi_fence *f = kvhi_handles_at(&e->fences, idx);
    if (!f)
        return;
    if (st != KVH_OK && f->status == KVH_OK)
        fence_set_failure(f, st, kvhi_failure_text(st));
    if (--f->pending == 0) {
        if (f->user_freed && !f->waiters) {
            free(f);
            kvhi_handles_remove(&e->fences, idx);
        }
        pthread_cond_broadcast(&e->fence_cv);
    }
}

void kvhi_fence_expect(kvh_engine *e, uint32_t idx, uint32_t n)
{
    kvhi_fence *f = kvhi_handles_at(&e->fences, idx);
    if (f)
        f->pending += n;
}

void kvhi_fence_record_failure(kvh_engine *e, uint32_t idx, kvh_status st, const char *msg)
{
    kvhi_fence *f = kvhi_handles_at(&e->fences, idx);
    if (f && st != KVH_OK && f->status == KVH_OK)
        fence_set_failure(f, st, msg && msg[0] ? msg : kvhi_status_text(st));
}

kvh_status kvhi_fence_poll_idx(kvh_engine *e, uint32_t idx, int32_t *done)
{
    kvhi_fence *f = kvhi_handles_at(&e->fences, idx);
    *done = f->pending == 0;
    if (f->pending == 0 && f->status != KVH_OK)
        return kvhi_fail(f->status, "%s", f->msg[0] ? f->msg : kvhi_status_text(f->status));
    return KVH_OK;
}

kvh_status kvhi_fence_wait_idx(kvh_engine *e, uint32_t idx, uint64_t timeout_ns)
{
    kvhi_fence *f = kvhi_handles_at(&e->fences, idx);
    struct timespec deadline;
    if (timeout_ns != UINT64_MAX) {
        deadline = kvhi_realtime_in_ns(timeout_ns);
    }
    kvh_status st = KVH_OK;
    f->waiters++;
    while (f->pending) {
        if (timeout_ns == UINT64_MAX) {
            pthread_cond_wait(&e->fence_cv, &e->lock);
        } else if (pthread_cond_timedwait(&e->fence_cv, &e->lock, &deadline) == ETIMEDOUT && f->pending) {
            st = kvhi_fail(KVH_ERR_TIMEOUT, "fence not complete after %llu ns", (unsigned long long)timeout_ns);
            break;
        }
    }
    if (st == KVH_OK && f->status != KVH_OK)
        st = kvhi_fail(f->status, "%s", f->msg[0] ? f->msg : kvhi_status_text(f->status));
    /* The last waiter of a fence freed meanwhile reaps it. */
    if (--f->waiters == 0 && f->user_freed && f->pending == 0) {
        free(f);
        kvhi_handles_remove(&e->fences, idx);
    }
    return st;
}

/* ---- job queue: a binary heap, highest priority first, FIFO within ---- */

static bool job_before(const kvhi_job *a, const kvhi_job *b)
{
    return a->priority != b->priority ? a->priority > b->priority : a->order < b->order;
}

static kvh_status job_push(kvh_engine *e, kvhi_job j)
{
    if (e->n_jobs == e->cap_jobs) {
        uint32_t ncap = e->cap_jobs ? e->cap_jobs * 2 : 256;
        kvhi_job *n = realloc(e->jobs, sizeof(*n) * ncap);
        if (!n)
            return kvhi_fail(KVH_ERR_NOMEM, "out of memory for the migration queue");
        e->jobs = n;
        e->cap_jobs = ncap;
    }
    j.order = e->job_order++;
    if (j.kind != KVHI_JOB_PREFETCH && j.target_tier < KVH_TIER_COUNT)
        e->jobs_to_tier[j.target_tier]++;
    uint32_t i = e->n_jobs++;
    while (i > 0) {
        uint32_t p = (i - 1) / 2;
        if (!job_before(&j, &e->jobs[p]))
            break;
        e->jobs[i] = e->jobs[p];
        i = p;
    }
    e->jobs[i] = j;
    return KVH_OK;
}

/* Takes the job at heap index i out of the queue. */
static kvhi_job job_take(kvh_engine *e, uint32_t i)
{
    kvhi_job taken = e->jobs[i];
    if (taken.kind != KVHI_JOB_PREFETCH && taken.target_tier < KVH_TIER_COUNT)
        e->jobs_to_tier[taken.target_tier]--;
    kvhi_job last = e->jobs[--e->n_jobs];
    if (i == e->n_jobs)
        return taken;
    /* last goes where i was: up if it comes before i's parent, else down. */
    while (i > 0) {
        uint32_t p = (i - 1) / 2;
        if (!job_before(&last, &e->jobs[p]))
            break;
        e->jobs[i] = e->jobs[p];
        i = p;
    }
    for (;;) {
        uint32_t l = 2 * i + 1;
        if (l >= e->n_jobs)
            break;
        uint32_t c = (l + 1 < e->n_jobs && job_before(&e->jobs[l + 1], &e->jobs[l])) ? l + 1 : l;
        if (!job_before(&e->jobs[c], &last))
            break;
        e->jobs[i] = e->jobs[c];
        i = c;
    }
    e->jobs[i] = last;
    return taken;
}

static kvhi_job job_pop(kvh_engine *e) { return job_take(e, 0); }

/* A block a hint brought up; its hint keeps it from being the next victim
 * (core/hints.c) until it is used. */
/* A queued prefetch (PREFETCHING) that starts its promotion is counted
 * as issued then, and carries PREFETCHED from then on: an acquire that
 * meets it still in flight counts it late, one that meets it arrived
 * counts it useful, and a move out of the device tier before either
 * counts it wasted. An acquire that meets it still queued takes the block
 * over (clears PREFETCHING), and the job then does nothing. */
static void prefetch_start(kvh_engine *e, uint32_t b)
{
    kvhi_block *blk = &e->blocks[b];
    e->stats.prefetch_issued++;
    blk->flags = (uint16_t)((blk->flags & ~KVHI_BF_PREFETCHING) | KVHI_BF_PREFETCHED);
}

/* The promotion a prefetch started did not land (an I/O error, no room
 * after all): issued, and of no use. */
static void prefetch_failed(kvh_engine *e, uint32_t b)
{
    kvhi_block *blk = &e->blocks[b];
    if (!(blk->flags & KVHI_BF_PREFETCHED) || blk->tier == KVH_TIER_DEVICE)
        return; /* claimed late by an acquire, or up after all */
    blk->flags &= (uint16_t)~KVHI_BF_PREFETCHED;
    e->stats.prefetch_wasted++;
}

/* A prefetch is worth its move only if the device tier has a free slot or
 * a victim of a lower class than the hinted block (unhinted, or hinted for
 * later): evicting a block hinted as soon or sooner would trade one
 * predicted use for another, at the price of two copies. */
static bool prefetch_has_room(kvh_engine *e, uint32_t b)
{
    kvhi_tier *dev = &e->tiers[KVH_TIER_DEVICE];
    kvhi_lruk_heap *heap = &dev->heap;
    /* An agent at its device quota makes room among its own blocks
     * (kvhi_reserve_slot), free slots or not. */
    kvhi_agent *a = kvhi_agent_at_quota(e, e->blocks[b].agent);
    if (a)
        heap = &a->heap;
    else if (dev->slots.free_count > 0)
        return true;
    uint32_t v = kvhi_lruk_top_current(heap, kvhi_block_current_key, e);
    if (v == KVHI_HEAP_NONE)
        return false;
    return kvhi_ranks_below(e, v, b);
}

/* A prefetch to the device tier that would find no room it may take: it
 * is skipped (and counted). */
static bool prefetch_declined(kvh_engine *e, const kvhi_job *j)
{
    if (j->kind != KVHI_JOB_PREFETCH || j->target_tier != KVH_TIER_DEVICE || prefetch_has_room(e, j->block))
        return false;
    e->stats.prefetch_skipped++;
    return true;
}

bool kvhi_block_wait_movable(kvh_engine *e, uint32_t b, uint32_t gen, uint32_t tier)
{
    kvhi_block *blk = &e->blocks[b];
    for (;;) {
        if (!(blk->flags & KVHI_BF_LIVE) || (blk->flags & KVHI_BF_DEAD) || blk->gen != gen)
            return false;
        /* A promotion need not wait for a disk copy being written from the
         * block's slot (the slot stays valid until that copy ends). */
        bool writing_only = kvhi_move_state(blk) == KVHI_MS_COPYING;
        if (!kvhi_block_busy(blk) || (writing_only && tier < blk->tier && blk->deferred_slot == KVHI_NO_BLOCK)) {
            /* An offload batch still gathers into its slot without the
             * lock: a copy made now would leave those bytes behind. */
            if (!(blk->flags & KVHI_BF_POOL_FILL))
                return true;
            pthread_cond_wait(&e->changed, &e->lock); /* work_end wakes it */
            continue;
        }
        kvhi_block_wait_idle(e, b); /* counts a worker as waiting for room */
    }
}

/* Runs one move with the lock held (dropped during the copy). */
static kvh_status run_job(kvh_engine *e, const kvhi_job *j)
{
    kvhi_block *blk = &e->blocks[j->block];
    kvh_status st = KVH_OK;
    if (!kvhi_block_wait_movable(e, j->block, j->block_gen, j->target_tier))
        return KVH_OK; /* freed meanwhile: nothing left to move */
    bool prefetch = j->kind == KVHI_JOB_PREFETCH, started = false, moved = false;
    if (blk->tier != j->target_tier) {
        if (blk->holds && j->target_tier > blk->tier)
            st = KVH_OK; /* held blocks never move down */
        else if (prefetch && !(blk->flags & KVHI_BF_PREFETCHING))
            st = KVH_OK; /* an acquire took the block over while this waited */
        else if (blk->pins) {
            st = j->kind == KVHI_JOB_NEED ? kvhi_fail(KVH_ERR_BUSY, "block is pinned in another tier") : KVH_OK;
            e->stats.prefetch_skipped += prefetch; /* pinned since it was queued: skipped, as at queueing */
        } else if (!prefetch_declined(e, j)) {
            if (prefetch)
                prefetch_start(e, j->block);
            started = prefetch;
            uint32_t outer = kvhi_victim_ceiling_set(prefetch ? j->block : KVHI_NO_BLOCK);
            st = kvhi_move_block(e, j->block, j->target_tier, blk->agent);
            kvhi_victim_ceiling_set(outer);
            moved = st == KVH_OK && blk->gen == j->block_gen && (blk->flags & KVHI_BF_LIVE);
        }
    }
    if (prefetch) {
        if (blk->gen == j->block_gen) {
            if (started && !moved)
                prefetch_failed(e, j->block);
            blk->flags &= (uint16_t)~KVHI_BF_PREFETCHING;
        }
        st = KVH_OK; /* a hint that cannot be honoured is not an error */
    }
    return st;
}

/* A job that moves data to or from the disk tier right now, and so can
 * share a batch of neighbouring writes or reads with others like it. */
static bool batchable(kvh_engine *e, const kvhi_job *j)
{
    kvhi_block *blk = &e->blocks[j->block];
    if (!e->disk || !(blk->flags & KVHI_BF_LIVE) || blk->gen != j->block_gen || kvhi_block_busy(blk) ||
        (blk->flags & (KVHI_BF_DEAD | KVHI_BF_CORRUPT)) || blk->tier == j->target_tier || blk->pins ||
        (blk->holds && j->target_tier > blk->tier))
        return false;
    if (j->target_tier == KVH_TIER_DISK)
        return !(blk->flags & KVHI_BF_DISK_COPY);
    return blk->tier == KVH_TIER_DISK;
}

/* A job that will not run: its fence learns why (KVH_ERR_CLOSED at
 * close), but for a prefetch that could not be queued or batched, which
 * is skipped (kvh.h: not an error). A prefetch's block may be prefetched
 * again. */
static void job_abandon(kvh_engine *e, const kvhi_job *j, kvh_status st)
{
    kvhi_block *blk = &e->blocks[j->block];
    if (j->kind == KVHI_JOB_PREFETCH) {
        if (blk->gen == j->block_gen && (blk->flags & KVHI_BF_LIVE))
            blk->flags &= (uint16_t)~KVHI_BF_PREFETCHING;
        if (st != KVH_ERR_CLOSED) {
            e->stats.prefetch_skipped++;
            st = KVH_OK;
        }
    }
    kvhi_fence_done(e, j->fence, st);
}

/* Runs `first` and the compatible jobs queued behind it as one batch:
 * slots are reserved and marked under the lock, the I/O runs without it
 * as a few large transfers, then each move is committed. */
static void run_batch(kvh_engine *e, kvhi_job first)
{
    enum { MAX = 64 };
    kvhi_job jobs[MAX];
    kvhi_xfer *xs = malloc(sizeof(kvhi_xfer) * MAX);
    uint32_t n = 0, limit = e->disk->lane_blocks < MAX ? e->disk->lane_blocks : MAX;
    bool to_disk = first.target_tier == KVH_TIER_DISK;
    jobs[n++] = first;
    while (xs && n < limit && e->n_jobs && e->jobs[0].target_tier == first.target_tier && batchable(e, &e->jobs[0]) &&
           ((e->jobs[0].target_tier == KVH_TIER_DISK) == to_disk)) {
        bool dup = false;
        for (uint32_t i = 0; i < n; i++)
            dup |= jobs[i].block == e->jobs[0].block;
        if (dup)
            break;
        jobs[n++] = job_pop(e);
    }
    if (!xs) {
        for (uint32_t i = 0; i < n; i++)
            job_abandon(e, &jobs[i], kvhi_fail(KVH_ERR_NOMEM, "out of memory for a batch"));
        return;
    }
    uint32_t k = 0, idx[MAX], n_alone = 0, alone[MAX];
    for (uint32_t i = 0; i < n; i++) {
        /* Earlier moves of this batch may have dropped the lock: a job no
         * longer batchable (its block started moving elsewhere) goes back. */
        if (i > 0 && !batchable(e, &jobs[i])) {
            if (job_push(e, jobs[i]) != KVH_OK)
                job_abandon(e, &jobs[i], KVH_ERR_NOMEM);
            continue;
        }
        bool prefetch = jobs[i].kind == KVHI_JOB_PREFETCH;
        if (prefetch && (!(e->blocks[jobs[i].block].flags & KVHI_BF_PREFETCHING) || prefetch_declined(e, &jobs[i]))) {
            /* taken over by an acquire meanwhile, or no room */
            e->blocks[jobs[i].block].flags &= (uint16_t)~KVHI_BF_PREFETCHING;
            kvhi_fence_done(e, jobs[i].fence, KVH_OK);
            continue;
        }
        uint32_t outer = kvhi_victim_ceiling_set(prefetch ? jobs[i].block : KVHI_NO_BLOCK);
        int rc = kvhi_move_begin(e, jobs[i].block, jobs[i].target_tier, &xs[k], false);
        kvhi_victim_ceiling_set(outer);
        if (rc == 0) {
            if (prefetch)
                prefetch_start(e, jobs[i].block);
            idx[k++] = i;
            continue;
        }
        /* With every tier full, one block of a batch at a time comes up
         * through the host tier's spare: the others go alone once the
         * batch has ended and given it back (core/host_spare.h). A write
         * to a full disk would only fail, or wait, again. */
        if (rc == KVH_ERR_NOSPACE && !to_disk && !prefetch && e->host_spare_wanted) {
            alone[n_alone++] = i;
            continue;
        }
        if (jobs[i].kind == KVHI_JOB_PREFETCH)
            e->blocks[jobs[i].block].flags &= (uint16_t)~KVHI_BF_PREFETCHING;
        kvhi_fence_done(e, jobs[i].fence, rc == 1 || jobs[i].kind == KVHI_JOB_PREFETCH ? KVH_OK : rc);
    }
    e->jobs_running += k;
    kvhi_unlock_for_copy(e);
    kvhi_xfer_batch(e, xs, k);
    kvhi_relock_after_copy(e);
    e->jobs_running -= k;
    for (uint32_t i = 0; i < k; i++) {
        kvhi_job *j = &jobs[idx[i]];
        kvh_status st = kvhi_move_end(e, &xs[i], NULL);
        if (j->kind == KVHI_JOB_PREFETCH) {
            kvhi_block *blk = &e->blocks[j->block];
            if (blk->gen == j->block_gen && (st != KVH_OK || !(blk->flags & KVHI_BF_LIVE)))
                prefetch_failed(e, j->block);
            st = KVH_OK;
        }
        kvhi_fence_done(e, j->fence, st);
    }
    free(xs);
    for (uint32_t i = 0; i < n_alone; i++) {
        e->jobs_running++;
        kvh_status st = run_job(e, &jobs[alone[i]]);
        e->jobs_running--;
        kvhi_fence_done(e, jobs[alone[i]].fence, st);
    }
}

/* Set while this thread runs a queued move in kvhi_wait_queued_moves_out:
 * room that move needs is not made by running another one inside it. */
static _Thread_local bool running_move_out;

bool kvhi_is_worker(const kvh_engine *e)
{
    for (uint32_t i = 0; i < e->n_workers; i++)
        if (pthread_equal(e->workers[i], pthread_self()))
            return true;
    return false;
}

/* A worker other than this thread, and not itself waiting for room. */
static bool other_free_worker(const kvh_engine *e)
{
    uint32_t free_workers = e->n_workers - e->workers_waiting_room - (kvhi_is_worker(e) ? 1 : 0);
    return free_workers && free_workers <= e->n_workers;
}

/* The queued move of a block of tier up to memory that frees a slot of
 * tier when it runs, at heap index *at. idle_only: only one whose block
 * is idle, which this thread can run without waiting on a move it began
 * itself. */
static bool find_move_out(const kvh_engine *e, uint32_t tier, bool idle_only, uint32_t *at)
{
    uint32_t up = 0;
    for (uint32_t t = 0; t < tier && t < KVH_TIER_COUNT; t++)
        up += e->jobs_to_tier[t];
    if (up == 0)
        return false; /* a full disk's queue of demotions is not walked on every reservation */
    for (uint32_t i = 0; i < e->n_jobs; i++) {
        const kvhi_job *j = &e->jobs[i];
        const kvhi_block *blk = &e->blocks[j->block];
        if (j->kind != KVHI_JOB_PREFETCH && j->target_tier < tier && blk->tier == tier && blk->gen == j->block_gen &&
            (blk->flags & (KVHI_BF_LIVE | KVHI_BF_DEAD)) == KVHI_BF_LIVE && !blk->pins &&
            (!idle_only || (!kvhi_block_busy(blk) && !(blk->flags & KVHI_BF_POOL_FILL)))) {
            *at = i;
            return true;
        }
    }
    return false;
}

bool kvhi_wait_queued_moves_out(kvh_engine *e, uint32_t tier, struct timespec *deadline)
{
    uint32_t at;
    if (!other_free_worker(e)) {
        /* Nobody else will run it: a lone worker, or a thread whose
         * workers all wait for room, runs the move itself, as a worker
         * would, and the caller retries with the slot it freed. */
        if (running_move_out || !find_move_out(e, tier, true, &at))
            return false;
        kvhi_job j = job_take(e, at);
        running_move_out = true;
        e->jobs_running++;
        kvh_status st = run_job(e, &j);
        e->jobs_running--;
        running_move_out = false;
        kvhi_fence_done(e, j.fence, st);
        e->queued_moves_run_here++;
        return true;
    }
    if (!find_move_out(e, tier, false, &at))
        return false;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    if (deadline->tv_sec == 0) {
        *deadline = now;
        deadline->tv_sec += KVHI_QUEUED_MOVES_WAIT_S;
    } else if (now.tv_sec > deadline->tv_sec || (now.tv_sec == deadline->tv_sec && now.tv_nsec >= deadline->tv_nsec)) {
        return false;
    }
    bool worker = kvhi_is_worker(e);
    e->workers_waiting_room += worker;
    e->queued_move_waits++;
    pthread_cond_timedwait(&e->changed, &e->lock, deadline);
    e->workers_waiting_room -= worker;
    return true;
}

kvh_status kvhi_enqueue(kvh_engine *e, uint32_t b, uint32_t tier, int32_t priority, kvhi_job_kind kind,
                        uint32_t fence_idx)
{
    kvhi_assert_locked(e);
    kvhi_job j = {.block = b,
                  .block_gen = e->blocks[b].gen,
                  .fence = fence_idx,
                  .target_tier = (uint8_t)tier,
                  .kind = (uint8_t)kind,
                  .priority = priority};
    if (fence_idx != KVHI_NO_BLOCK)
        ((kvhi_fence *)kvhi_handles_at(&e->fences, fence_idx))->pending++;
    if (e->n_workers == 0) {
        kvhi_fence_done(e, fence_idx, run_job(e, &j));
        return KVH_OK;
    }
    kvh_status st = job_push(e, j);
    if (st != KVH_OK) {
        /* A prefetch not queued is skipped: its fence is not failed. */
        kvhi_fence_done(e, fence_idx, kind == KVHI_JOB_PREFETCH ? KVH_OK : st);
        e->stats.prefetch_skipped += kind == KVHI_JOB_PREFETCH;
        return st;
    }
    pthread_cond_signal(&e->work_ready);
    return KVH_OK;
}

/* ---- workers ---- */

/* Waits on work_ready until kvhi_now_ns() reaches deadline_ns. */
static void wait_until_ns(kvh_engine *e, uint64_t deadline_ns)
{
    uint64_t now = kvhi_now_ns();
    if (deadline_ns <= now)
        return;
    struct timespec ts = kvhi_realtime_in_ns(deadline_ns - now);
    pthread_cond_timedwait(&e->work_ready, &e->lock, &ts);
}

static void *worker_main(void *arg)
{
    kvh_engine *e = arg;
    kvhi_thread_started_for(e);
    if (e->numa_cpus_known)
        pthread_setaffinity_np(pthread_self(), sizeof(e->numa_cpus), &e->numa_cpus);
    if (e->cfg.migration_cpu_mask) {
        cpu_set_t set;
        CPU_ZERO(&set);
        for (int c = 0; c < 64; c++)
            if (e->cfg.migration_cpu_mask >> c & 1)
                CPU_SET(c, &set);
        pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
    }
    pthread_mutex_lock(&e->lock);
    while (!e->stop_workers) {
        /* Releases that returned to their callers are done before any
         * work here counts references (core/block.h: no caller may have
         * entered since). */
        if (e->release_backlog_len)
            kvhi_block_releases_apply(e);
        if (e->pool_work_head) {
            kvhi_pool_work_run_next(e);
            continue;
        }
        if (e->n_jobs == 0) {
            if (e->disk && kvhi_disk_clean_step(e))
                continue;
            uint64_t resume = e->disk ? kvhi_disk_clean_resumes_ns(e) : 0;
            if (resume)
                wait_until_ns(e, resume);
            else
                pthread_cond_wait(&e->work_ready, &e->lock);
            continue;
        }
        kvhi_job j = job_pop(e);
        if (batchable(e, &j)) {
            run_batch(e, j);
        } else {
            e->jobs_running++;
            kvh_status st = run_job(e, &j);
            e->jobs_running--;
            kvhi_fence_done(e, j.fence, st);
        }
        if (e->n_pending_log) {
            kvhi_unlock_and_log(e);
            pthread_mutex_lock(&e->lock);
        }
    }
    pthread_mutex_unlock(&e->lock);
    return NULL;
}

static int first_cpu(const cpu_set_t *set)
{
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, set))
            return c;
    return -1;
}

/* A migration_cpu_mask none of whose CPUs this process may run on (CPUs
 * the machine lacks) binds nothing: the workers' affinity call fails and
 * they run anywhere. Said, as the mask came from a user. */
static void warn_unusable_cpu_mask(kvh_engine *e)
{
    cpu_set_t allowed;
    if (!e->cfg.migration_cpu_mask || sched_getaffinity(0, sizeof(allowed), &allowed) != 0)
        return;
    for (int c = 0; c < 64; c++)
        if ((e->cfg.migration_cpu_mask >> c & 1) && CPU_ISSET(c, &allowed))
            return;
    kvhi_log(e, KVH_LOG_WARN,
             "migration_cpu_mask 0x%llx names no CPU this process may run on (it may use %d CPUs, from CPU %d): "
             "the migration workers are not bound",
             (unsigned long long)e->cfg.migration_cpu_mask, CPU_COUNT(&allowed), first_cpu(&allowed));
}

kvh_status kvhi_workers_start(kvh_engine *e)
{
    if (pthread_cond_init(&e->work_ready, NULL) != 0)
        return kvhi_fail(KVH_ERR_NOMEM, "cannot create a condition variable");
    e->n_workers = 0;
    if (e->cfg.migration_threads == 0)
        return KVH_OK;
    e->numa_cpus_known = e->cfg.numa_node >= 0 && kvhi_numa_node_cpus(e->cfg.numa_node, &e->numa_cpus);
    warn_unusable_cpu_mask(e);
    e->workers = calloc(e->cfg.migration_threads, sizeof(pthread_t));
    if (!e->workers)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for workers");
    for (uint32_t i = 0; i < e->cfg.migration_threads; i++) {
        int rc = pthread_create(&e->workers[i], NULL, worker_main, e);
        if (rc != 0) {
            kvhi_workers_stop(e);
            return kvhi_fail(KVH_ERR_NOMEM, "cannot start migration worker %u: %s%s", i, strerror(rc),
                             rc == EAGAIN ? " (the process's thread limit, RLIMIT_NPROC, or memory: fewer "
                                            "migration_threads, or 0, need fewer)"
                                          : "");
        }
        e->n_workers++;
    }
    return KVH_OK;
}

/* Called without the lock. Pending jobs are cancelled with KVH_ERR_CLOSED. */
void kvhi_workers_stop(kvh_engine *e)
{
    pthread_mutex_lock(&e->lock);
    e->stop_workers = true;
    kvhi_pool_work_cancel_all(e);
    while (e->n_jobs) {
        kvhi_job j = job_pop(e);
        job_abandon(e, &j, KVH_ERR_CLOSED);
    }
    pthread_cond_broadcast(&e->work_ready);
    /* A worker waiting for a queued move to make room (its wait is timed,
     * seconds) finds the queue empty now, instead of at its deadline. */
    pthread_cond_broadcast(&e->changed);
    pthread_mutex_unlock(&e->lock);
    for (uint32_t i = 0; i < e->n_workers; i++)
        pthread_join(e->workers[i], NULL);
    free(e->workers);
    e->workers = NULL;
    e->n_workers = 0;
    free(e->jobs);
    e->jobs = NULL;
    e->n_jobs = e->cap_jobs = 0;
    pthread_cond_destroy(&e->work_ready);
}
