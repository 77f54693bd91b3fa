/* Attention calls: under the engine lock, the plan (CSR block table of
 * device-tier slots and the work split, kernels/attention_plan.c) and a
 * hold on every block read, so nothing migrates or is evicted while the
 * kernels run. The lock is then released and the backend runs the plan
 * (kernels/cpu/ or libkvh_cuda.so); its completion callback retakes the
 * lock and drops the holds.
 *
 * Holds and the call's registration (active_calls) last until the kernels
 * have finished: on the CPU that is before the call returns; on CUDA the
 * call returns once the work is queued, and a host callback queued on the
 * caller's stream after the kernels (cudaLaunchHostFunc) releases them, so
 * kvh_engine_close waits for queued attention to finish. No stream
 * synchronisation happens in the launch path.
 *
 * The holds keep blocks in place, but do not keep them alive: freeing or
 * truncating a sequence while attention over it is running is the
 * caller's error (its output is then undefined, nothing else breaks: the
 * release skips blocks whose generation changed). Blocks are not
 * referenced either, so a write_kv racing with queued kernels does not
 * force a copy-on-write of the last block. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "core/attention_call.h"
#include "core/block_state.h"
#include "core/tier.h"
#include "kernels/cpu/attn_cpu.h"
#include "core/block.h"
#include "core/seq.h"
#include "core/move.h"

void kvhi_attn_call_free(kvhi_attn_call *c)
{
    if (!c)
        return;
    kvhi_attn_plan_free(&c->plan);
    free(c->held);
    free(c->held_gen);
    free(c->stage);
    free(c->xs);
    free(c->window);
    free(c);
}

void kvhi_attn_call_release_holds(kvh_engine *e, kvhi_attn_call *c)
{
    for (uint32_t i = 0; i < c->n_held; i++) {
        uint32_t b = c->held[i];
        kvhi_block *blk = &e->blocks[b];
        if (blk->gen == c->held_gen[i] && (blk->flags & KVHI_BF_LIVE) && blk->holds > 0) {
            if (c->stream_chunk_blocks)
                kvhi_block_unhold_reading(e, b);
            else
                kvhi_block_unhold(e, b);
        }
    }
    c->n_held = 0;
}

/* Completion (the backend's done callback): the kernels have finished. On
 * CUDA this runs on a CUDA host-callback thread: no CUDA calls here. */
static void attn_done(void *arg)
{
    kvhi_attn_call *c = arg;
    kvh_engine *e = c->e;
    pthread_mutex_lock(&e->lock);
    kvhi_attn_call_release_holds(e, c);
    kvhi_attn_call_free(c);
    kvhi_leave(e); /* ends the call's registration; close may proceed */
}

/* The CPU backend's state (thread pool, scratch), made on first use; lock
 * held. */
kvhi_attn_cpu *kvhi_attn_state(kvh_engine *e)
{
    if (!e->attn_state)
        e->attn_state = kvhi_attn_cpu_create();
    return e->attn_state;
}

kvh_status kvhi_attention_set_impl(kvh_engine *e, int impl)
{
    kvhi_clear_error();
    if (!e)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "engine is NULL");
    kvh_status st = kvhi_enter(e);
    if (st != KVH_OK)
        return st;
    if (!e->cpu_kernels)
        st = kvhi_fail(KVH_ERR_UNSUPPORTED, "only the CPU backend has kernel variants");
    else if (impl < KVHI_ATTN_AUTO || impl > KVHI_ATTN_AVX512 || !kvhi_attn_cpu_supported(impl))
        st = kvhi_fail(KVH_ERR_UNSUPPORTED, "attention implementation %d is not available on this CPU", impl);
    else if (!kvhi_attn_state(e))
        st = kvhi_fail(KVH_ERR_NOMEM, "out of memory for the attention state");
    else {
        kvhi_attn_cpu *cs = e->attn_state;
        pthread_mutex_lock(&cs->run_lock);
        cs->impl = impl;
        pthread_mutex_unlock(&cs->run_lock);
    }
    kvhi_leave(e);
    return st;
}

void kvhi_attn_call_release_window(kvh_engine *e, kvhi_attn_call *c)
{
    for (uint32_t i = 0; i < c->n_window; i++)
        kvhi_release_slot(e, KVH_TIER_DEVICE, c->window[i]);
    c->n_window = 0;
    if (c->window)
        pthread_cond_broadcast(&e->changed); /* room appeared */
}

kvh_status kvhi_attn_call_run(kvh_engine *e, kvhi_attn_call *c, const void *q, void *out, void *stream)
{
    kvhi_assert_locked(e);
    if (c->stream_chunk_blocks)
        return kvhi_attn_stream_run(e, c, q, out);
    /* Run with the lock released; the call stays registered (active_calls)
     * until attn_done. */
    pthread_mutex_unlock(&e->lock);
    char msg[256] = "";
    int rc = e->backend->attention_run(e->backend_ctx, &c->plan, q, out, stream, attn_done, c, msg, sizeof(msg));
    if (rc == 0)
        return KVH_OK; /* c now belongs to attn_done */
    pthread_mutex_lock(&e->lock);
    kvhi_attn_call_release_holds(e, c);
    kvhi_attn_call_free(c);
    kvhi_leave(e);
    return kvhi_fail(rc < 0 ? rc : KVH_ERR_INTERNAL, "attention kernels: %s", msg);
}

/* A block outside the device tier that the kernels can read where it
 * lies: the host tier in the device tier's own arena, raw and in the
 * plain layout. */
static bool attend_in_place(const kvh_engine *e, const kvhi_block *blk)
{
    const kvhi_tier *h = &e->tiers[KVH_TIER_HOST];
    return blk->tier == KVH_TIER_HOST && h->shares_arena && !h->encoded && !(e->vmap_arena && e->slab.slab_shift);
}

static kvh_status prepare_once(kvh_engine *e, uint32_t layer, const kvh_seq *seqs, const uint32_t *q_lens,
                               size_t n_seqs, bool prefill, const kvh_attention_params *params, uint64_t total_rows,
                               kvhi_attn_call *c, bool *need_window)
{
    kvh_attention_params pr = *params;
    kvh_status st = KVH_OK;
    uint32_t *kv_len = malloc(sizeof(uint32_t) * (n_seqs ? n_seqs : 1));
    uint32_t *q_len = malloc(sizeof(uint32_t) * (n_seqs ? n_seqs : 1));
    if (!kv_len || !q_len) {
        free(kv_len);
        free(q_len);
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for an attention call");
    }

    /* Resolve the sequences and their lengths. */
    uint64_t n_blocks = 0;
    for (size_t i = 0; i < n_seqs && st == KVH_OK; i++) {
        kvhi_seq *s;
        if ((st = kvhi_seq_get(e, seqs[i], &s)) != KVH_OK)
            break;
        uint32_t ql = prefill ? q_lens[i] : 1;
        if (s->n_tokens >= (1ull << 31))
            st = kvhi_fail(KVH_ERR_RANGE, "sequence %zu has %llu tokens; attention takes fewer than 2^31", i,
                           (unsigned long long)s->n_tokens);
        else if (ql > s->n_tokens)
            st = kvhi_fail(KVH_ERR_RANGE, "sequence %zu: %u query tokens but only %llu tokens", i, ql,
                           (unsigned long long)s->n_tokens);
        else if (s->n_blocks != (s->n_tokens + e->cfg.block_tokens - 1) / e->cfg.block_tokens)
            st = kvhi_fail(KVH_ERR_INTERNAL, "sequence %zu: %u blocks for %llu tokens", i, s->n_blocks,
                           (unsigned long long)s->n_tokens);
        kv_len[i] = (uint32_t)s->n_tokens;
        q_len[i] = ql;
        n_blocks += s->n_blocks;
    }
    if (st == KVH_OK && total_rows > UINT32_MAX)
        st = kvhi_fail(KVH_ERR_INVALID_ARG, "%llu query rows are too many (at most 2^32 - 1)",
                       (unsigned long long)total_rows);
    if (st != KVH_OK || total_rows == 0)
        goto fail;
    if (e->cpu_kernels && !kvhi_attn_state(e)) {
        st = kvhi_fail(KVH_ERR_NOMEM, "out of memory for the attention state");
        goto fail;
    }

    /* The plan. */
    kvhi_attn_plan *p = &c->plan;
    p->num_q_heads = pr.num_q_heads;
    p->num_kv_heads = e->cfg.num_kv_heads;
    p->head_dim = e->cfg.head_dim;
    p->block_tokens = e->cfg.block_tokens;
    for (p->block_shift = 0; (1u << p->block_shift) < p->block_tokens; p->block_shift++)
        ;
    p->kv_dtype = e->cfg.dtype;
    p->io_dtype = pr.io_dtype;
    p->scale = pr.scale;
    p->block_bytes = e->block_bytes;
    p->layer_offset = (uint64_t)layer * e->layer_bytes;
    p->slab_shift = 0, p->slab_bytes = 0, p->piece_pitch = 0;
    if (e->vmap_arena && e->slab.slab_shift) {
        /* The device tier is in slab layout (kernels/slab_layout.h). */
        p->slab_shift = e->slab.slab_shift;
        p->slab_bytes = e->block_bytes << e->slab.slab_shift;
        p->piece_pitch = kvhi_slab_pitch(&e->slab);
        p->layer_offset = (uint64_t)layer * 2 * e->cfg.num_kv_heads * p->piece_pitch;
    }
    p->kv_base = e->tiers[KVH_TIER_DEVICE].base;
    p->cpu_state = e->attn_state;
    p->threads = pr.threads;
    kvhi_attn_plan_opts opts = {0};
    e->backend->attention_plan_opts(e->backend_ctx, pr.threads, &opts);
    if (c->stream_chunk_blocks)
        opts.max_chunk_tokens = c->stream_chunk_blocks * e->cfg.block_tokens;
    if (c->stream_chunk_blocks && (!(c->stage = malloc(sizeof(uint32_t) * (n_blocks ? n_blocks : 1))) ||
                                   !(c->xs = malloc(sizeof(kvhi_xfer) * (n_blocks ? n_blocks : 1))))) {
        st = kvhi_fail(KVH_ERR_NOMEM, "out of memory for a streamed attention call");
        goto fail;
    }
    c->held = malloc(sizeof(uint32_t) * (n_blocks ? n_blocks : 1));
    c->held_gen = malloc(sizeof(uint32_t) * (n_blocks ? n_blocks : 1));
    if (!c->held || !c->held_gen || kvhi_attn_plan_build(p, &opts, kv_len, q_len, (uint32_t)n_seqs) != 0) {
        st =
            kvhi_fail(KVH_ERR_NOMEM, "out of memory for an attention plan (%llu blocks)", (unsigned long long)n_blocks);
        goto fail;
    }

    /* Hold every block the kernels read (each block once, but a block
     * shared by forks may be held once per use: holds nest). */
    for (size_t i = 0; i < n_seqs; i++) {
        kvhi_seq *s;
        kvhi_seq_get(e, seqs[i], &s); /* resolved above, lock held since */
        for (uint32_t j = 0; j < s->n_blocks; j++) {
            uint32_t b = s->blocks[j];
            if (c->stream_chunk_blocks)
                kvhi_block_hold_reading(e, b); /* the stager reads it where it lies */
            else
                kvhi_block_hold(e, b);
            c->held[c->n_held] = b;
            c->held_gen[c->n_held++] = e->blocks[b].gen;
        }
    }
    /* A block being moved finishes its move first (the lock is dropped
     * meanwhile; the holds keep anything new from starting). */
    for (uint32_t k = 0; k < c->n_held; k++) {
        uint32_t b = c->held[k];
        if (!kvhi_block_in_flight(&e->blocks[b]) || kvhi_block_in_device(e, b))
            continue; /* settled, or recalled: its device data stays put */
        kvhi_block_wait_idle(e, b);
        k = UINT32_MAX; /* rescan from the start: others may have moved */
    }
    for (uint32_t k = 0; k < c->n_held; k++) {
        kvhi_block *blk = &e->blocks[c->held[k]];
        if (blk->gen != c->held_gen[k] || !(blk->flags & KVHI_BF_LIVE)) {
            st = kvhi_fail(KVH_ERR_BAD_HANDLE, "a block of the batch was freed during the call");
            goto fail;
        }
        if (blk->tier != KVH_TIER_DEVICE && c->stream_chunk_blocks) {
            if (attend_in_place(e, blk)) {
                p->slots[k] = (int32_t)blk->slot;
            } else if (!c->n_window) {
                *need_window = true;
                st = KVH_ERR_NOSPACE;
                goto fail;
            } else {
                if (blk->flags & KVHI_BF_CORRUPT) {
                    st = kvhi_fail(KVH_ERR_CORRUPT, "a block of the batch failed its checksum on disk");
                    goto fail;
                }
                kvhi_xfer_prepare(e, c->held[k], KVH_TIER_DEVICE, 0, &c->xs[c->n_stage]);
                c->stage[c->n_stage++] = k;
                p->slots[k] = -1; /* set when staged */
            }
            continue;
        }
        if (blk->tier != KVH_TIER_DEVICE) {
            uint32_t i = 0;
            while (i + 1 < n_seqs && p->seqs[i + 1].blk0 <= k)
                i++;
            st = kvhi_fail(KVH_ERR_NOT_RESIDENT,
                           "sequence %u block %u is in the %s tier, not the device tier (kvh_seq_acquire first)", i,
                           k - p->seqs[i].blk0, blk->tier == KVH_TIER_HOST ? "host" : "disk");
            goto fail;
        }
        p->slots[k] = (int32_t)blk->slot;
    }
    free(kv_len);
    free(q_len);
    return KVH_OK;

fail:
    kvhi_attn_call_release_holds(e, c);
    free(kv_len);
    free(q_len);
    return st;
}

/* Device-tier slots a window could take now (lock held), as a lower
 * bound, so that a window this allows can always be made:
 * - the free ones, and each block in the tier's victim order that no
 *   sequence references (it is moved down or dropped);
 * - referenced ones, as far as the tiers below have room: their free
 *   slots, their unreferenced blocks (moved down or dropped) and, in the
 *   host tier, kept clean copies and referenced blocks that go back onto
 *   a clean disk copy. A referenced block moved down a tier frees a slot
 *   there only by taking one below: no room. A referenced device block
 *   with a clean disk copy can go onto it once the room below is gone,
 *   but it may take that room first: so max(room below, such blocks).
 * The counts come from a pass over the block records (a streamed call
 * reads more than that), skipped when the free slots are enough. */
typedef struct room_counts {
    uint64_t unref[KVH_TIER_COUNT], ref[KVH_TIER_COUNT], ref_copied[KVH_TIER_COUNT];
} room_counts;

/* The room the counts so far give: it only grows as blocks are counted,
 * so once it reaches what a window wants the rest need not be. */
static uint64_t room_of(const kvh_engine *e, const room_counts *n)
{
    uint64_t below = 0;
    for (int t = KVH_TIER_COUNT - 1; t > KVH_TIER_DEVICE; t--) {
        if (!e->tiers[t].present)
            continue;
        uint64_t tier_room = e->tiers[t].slots.free_count + n->unref[t];
        if (t == KVH_TIER_HOST) {
            tier_room += e->clean.count + (e->disk ? n->ref_copied[t] : 0);
            /* A lent spare takes the first host slot that frees up (its
             * block going back onto its disk copy only pays it back). */
            if (e->host_spare_lent)
                tier_room = tier_room ? tier_room - 1 : 0;
        }
        below += tier_room;
    }
    uint64_t copied = e->disk ? n->ref_copied[KVH_TIER_DEVICE] : 0;
    uint64_t referenced = n->ref[KVH_TIER_DEVICE] + n->ref_copied[KVH_TIER_DEVICE];
    uint64_t can_leave = below > copied ? below : copied;
    return e->tiers[KVH_TIER_DEVICE].slots.free_count + n->unref[KVH_TIER_DEVICE] +
           (referenced < can_leave ? referenced : can_leave);
}

/* The room as above, counted until it reaches want: a full device tier
 * of blocks that may leave (a cache's steady state) is not walked whole
 * on every streamed call (15.6 ms at 10^6 blocks). */
static uint64_t window_room(kvh_engine *e, uint64_t want)
{
    const kvhi_tier *dev = &e->tiers[KVH_TIER_DEVICE];
    if (dev->slots.free_count >= want)
        return dev->slots.free_count;
    room_counts n = {0};
    for (uint32_t b = 0; b < e->block_cap; b++) {
        const kvhi_block *blk = &e->blocks[b];
        if ((b & 255) == 255 && room_of(e, &n) >= want)
            break;
        if (blk->tier >= KVH_TIER_COUNT || blk->heap_pos == KVHI_HEAP_NONE || !(blk->flags & KVHI_BF_LIVE))
            continue;
        if (!kvhi_block_referenced(e, blk, b))
            n.unref[blk->tier]++;
        else if (blk->flags & KVHI_BF_DISK_COPY)
            n.ref_copied[blk->tier]++;
        else
            n.ref[blk->tier]++;
    }
    return room_of(e, &n);
}

/* Takes the streaming window: stream_window_blocks device-tier slots
 * (may evict, dropping the lock). */
static kvh_status take_window(kvh_engine *e, kvhi_attn_call *c, uint32_t want, bool wait_for_copies)
{
    free(c->window);
    c->window = NULL;
    c->n_window = 0;
    /* A window the tier could never hold is refused before any block is
     * evicted for it (or its table allocated). */
    const kvhi_tier *t = &e->tiers[KVH_TIER_DEVICE];
    uint64_t room = t->slots.capacity > t->pinned ? t->slots.capacity - t->pinned : 0;
    if (want > room)
        return kvhi_fail(KVH_ERR_NOSPACE,
                         "no room for a streaming window of %u blocks: the device tier has %llu slots, %llu pinned",
                         want, (unsigned long long)t->slots.capacity, (unsigned long long)t->pinned);
    /* Nor one that the free slots and the blocks that may leave cannot
     * make. A copy under way may be a block leaving (busy meanwhile): the
     * count is taken again when one ends, for a short while only, since
     * most copies (host to disk, uploads) free no device slot. */
    struct timespec until = kvhi_realtime_in_ns(200 * 1000000ull); /* far longer than a block's copy */
    uint64_t could;
    while ((could = window_room(e, want)) < want) {
        if (!wait_for_copies || !e->copies_in_progress ||
            pthread_cond_timedwait(&e->changed, &e->lock, &until) == ETIMEDOUT)
            return kvhi_fail(KVH_ERR_NOSPACE,
                             "no room for a streaming window of %u blocks: the device tier can make %llu (free slots, "
                             "and blocks that may leave: not pinned, held or in use, and with room below when "
                             "referenced)",
                             want, (unsigned long long)could);
        if (e->closing)
            return kvhi_fail(KVH_ERR_CLOSED, "the engine is closing");
    }
    c->window = malloc(sizeof(uint32_t) * want);
    if (!c->window)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for a streaming window");
    while (c->n_window < want) {
        uint32_t slot;
        kvh_status st = kvhi_reserve_slot(e, KVH_TIER_DEVICE, UINT32_MAX, &slot);
        if (st != KVH_OK) {
            char why[192];
            snprintf(why, sizeof(why), "%s", kvhi_last_error());
            uint32_t taken = c->n_window;
            kvhi_attn_call_release_window(e, c);
            return kvhi_fail(st, "no room for a streaming window of %u blocks in the device tier (%u taken): %s", want,
                             taken, why);
        }
        c->window[c->n_window++] = slot;
    }
    return KVH_OK;
}

/* Whether any block of the batch lies outside the device tier where the
 * kernels cannot read it (lock held; a sequence that does not resolve is
 * reported by prepare_once). */
static bool batch_needs_staging(kvh_engine *e, const kvh_seq *seqs, size_t n_seqs)
{
    for (size_t i = 0; i < n_seqs; i++) {
        kvhi_seq *s;
        if (kvhi_seq_get(e, seqs[i], &s) != KVH_OK)
            return false;
        for (uint32_t j = 0; j < s->n_blocks; j++) {
            const kvhi_block *blk = &e->blocks[s->blocks[j]];
            if (blk->tier != KVH_TIER_DEVICE && !attend_in_place(e, blk))
                return true;
        }
    }
    return false;
}

/* Back to a call with nothing prepared (its window kept). */
static void unprepare(kvhi_attn_call *c)
{
    kvhi_attn_plan_free(&c->plan);
    free(c->held);
    free(c->held_gen);
    free(c->stage);
    free(c->xs);
    c->held = c->held_gen = c->stage = NULL;
    c->xs = NULL;
    c->n_held = c->n_stage = 0;
}

/* Takes the window sparing the batch's own blocks in the device tier:
 * held meanwhile, they are no victims, for a block evicted to make the
 * window would only come back through it (re-encoded on the way where
 * the tier below is encoded). Only when the window cannot be made
 * otherwise may they leave for it. */
static kvh_status take_window_sparing_batch(kvh_engine *e, kvhi_attn_call *c, const kvh_seq *seqs, size_t n_seqs,
                                            uint32_t want)
{
    uint64_t n_blocks = 0;
    for (size_t i = 0; i < n_seqs; i++) {
        kvhi_seq *s;
        if (kvhi_seq_get(e, seqs[i], &s) == KVH_OK)
            n_blocks += s->n_blocks;
    }
    uint32_t *spared = malloc(sizeof(uint32_t) * (n_blocks ? n_blocks : 1)), n_spared = 0;
    for (size_t i = 0; spared && i < n_seqs; i++) {
        kvhi_seq *s;
        if (kvhi_seq_get(e, seqs[i], &s) != KVH_OK)
            continue;
        for (uint32_t j = 0; j < s->n_blocks; j++)
            if (e->blocks[s->blocks[j]].tier == KVH_TIER_DEVICE) {
                kvhi_block_hold(e, s->blocks[j]);
                spared[n_spared++] = s->blocks[j];
            }
    }
    /* Without waiting for copies: where the window needs the spared
     * blocks, the attempt below without them waits if it must. */
    kvh_status st = take_window(e, c, want, n_spared == 0);
    /* Holds keep a freed block's record until this unhold reaps it. */
    for (uint32_t k = 0; k < n_spared; k++)
        kvhi_block_unhold(e, spared[k]);
    free(spared);
    if (st == KVH_ERR_NOSPACE && n_spared)
        st = take_window(e, c, want, true);
    return st;
}

kvh_status kvhi_attn_call_prepare(kvh_engine *e, uint32_t layer, const kvh_seq *seqs, const uint32_t *q_lens,
                                  size_t n_seqs, bool prefill, const kvh_attention_params *params, uint64_t total_rows,
                                  kvhi_attn_call *c)
{
    c->stream_chunk_blocks = params->stream_chunk_blocks;
    /* The window is taken before the batch is held for the call, so
     * that, where nothing else can leave, making room for it may move
     * this batch's own blocks out of the device tier. */
    if (c->stream_chunk_blocks && batch_needs_staging(e, seqs, n_seqs)) {
        kvh_status st = take_window_sparing_batch(e, c, seqs, n_seqs, params->stream_window_blocks);
        if (st != KVH_OK)
            return st;
    }
    for (int attempt = 0;; attempt++) {
        bool need_window = false;
        kvh_status st = prepare_once(e, layer, seqs, q_lens, n_seqs, prefill, params, total_rows, c, &need_window);
        if (!need_window || attempt == 2) {
            if (need_window)
                st = kvhi_fail(KVH_ERR_BUSY, "blocks of the batch kept leaving the device tier while it was prepared");
            if (st != KVH_OK)
                kvhi_attn_call_release_window(e, c);
            return st;
        }
        /* A block left the device tier since the check: take the window. */
        unprepare(c);
        if ((st = take_window_sparing_batch(e, c, seqs, n_seqs, params->stream_window_blocks)) != KVH_OK)
            return st;
    }
}
