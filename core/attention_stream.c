/* Streamed attention: a batch whose blocks are not all in the device tier
 * is attended one KV chunk at a time (the plan splits every sequence into
 * chunks of at most stream_chunk_blocks blocks). A chunk's blocks that lie
 * outside the device tier are copied into the call's window of device-tier
 * slots: from host memory through the codec, from disk by io_uring with
 * the checksum verified. With room for two or more chunks a stager thread
 * fills the next part of the window while the kernels attend the current
 * one. The partial results of a split sequence are merged by log-sum-exp
 * at the end, as the split-K kernels do. Nothing here moves a block: it
 * stays held where it is and is not promoted.
 *
 * Runs without the engine lock: the holds keep every block in place, the
 * window's slots are the call's own, and the plan's slots of a chunk are
 * written before the kernels that read them run. */
#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "core/attention_call.h"
#include "core/block.h"
#include "core/move.h"
#include "kernels/cpu/attn_cpu.h"

/* The units of one (sequence, chunk), and the staged blocks it reads. */
typedef struct stream_wave {
    uint32_t u0, u1;
    uint32_t s0, s1; /* c->stage[s0..s1) */
} stream_wave;

typedef struct stream_run {
    kvh_engine *e;
    kvhi_attn_call *c;
    stream_wave *waves;
    uint32_t n_waves;
    uint32_t parts;       /* chunks the window holds */
    uint32_t part_blocks; /* slots of one part */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint32_t staged;   /* waves with blocks to stage, staged so far */
    uint32_t consumed; /* of those, attended */
    bool stop;
    kvh_status st;      /* first failure */
    uint32_t bad_block; /* a block that failed its checksum, or KVHI_NO_BLOCK */
    const char *why;
} stream_run;

static uint64_t unit_key(const kvhi_attn_unit *u) { return (uint64_t)u->seq << 32 | u->chunk; }

static int by_wave(const void *a, const void *b)
{
    uint64_t x = unit_key(a), y = unit_key(b);
    return x < y ? -1 : x > y;
}

/* Orders the units by (sequence, chunk), stably enough: units of one wave
 * are independent, so their order changes nothing in the result. */
static kvh_status make_waves(kvhi_attn_call *c, stream_wave **out, uint32_t *n_out)
{
    kvhi_attn_plan *p = &c->plan;
    qsort(p->units, p->n_units, sizeof(kvhi_attn_unit), by_wave);
    stream_wave *w = malloc(sizeof(*w) * (p->n_units ? p->n_units : 1));
    if (!w)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for a streamed attention call");
    uint32_t n = 0, si = 0;
    for (uint32_t u = 0; u < p->n_units;) {
        uint32_t v = u;
        while (v < p->n_units && unit_key(&p->units[v]) == unit_key(&p->units[u]))
            v++;
        const kvhi_attn_seq *s = &p->seqs[p->units[u].seq];
        uint32_t cb = s->chunk_tokens / p->block_tokens; /* blocks a chunk spans */
        uint64_t end = s->blk0 + ((uint64_t)s->kv_len + p->block_tokens - 1) / p->block_tokens;
        uint64_t b0 = s->blk0 + (uint64_t)p->units[u].chunk * cb, b1 = b0 + cb < end ? b0 + cb : end;
        while (si < c->n_stage && c->stage[si] < b0)
            si++; /* blocks no row sees (none in practice) */
        uint32_t s0 = si;
        while (si < c->n_stage && c->stage[si] < b1)
            si++;
        w[n++] = (stream_wave){u, v, s0, si};
        u = v;
    }
    *out = w;
    *n_out = n;
    return KVH_OK;
}

/* Records the first failure (r->mu held). */
static void fail_run(stream_run *r, kvh_status st, uint32_t bad, const char *why)
{
    if (r->st == KVH_OK) {
        r->st = st;
        r->bad_block = bad;
        r->why = why;
    }
}

static bool run_failed(stream_run *r)
{
    pthread_mutex_lock(&r->mu);
    bool failed = r->st != KVH_OK;
    pthread_mutex_unlock(&r->mu);
    return failed;
}

/* Copies the staged blocks of wave w into part `part` of the window and
 * points the plan at them. Lock not held. */
static void stage_wave(stream_run *r, const stream_wave *w, uint32_t part)
{
    kvhi_attn_call *c = r->c;
    assert(w->s1 - w->s0 <= r->part_blocks);
    for (uint32_t i = w->s0; i < w->s1; i++)
        c->xs[i].dst_slot = c->window[part * r->part_blocks + (i - w->s0)];
    /* Runs from disk go out as batches, host copies one by one. */
    for (uint32_t i = w->s0; i < w->s1;) {
        uint32_t j = i;
        if (c->xs[i].src_tier == KVH_TIER_DISK) {
            while (j < w->s1 && c->xs[j].src_tier == KVH_TIER_DISK)
                j++;
            kvhi_xfer_batch(r->e, &c->xs[i], j - i);
        } else {
            kvhi_xfer_run(r->e, &c->xs[i]);
            j = i + 1;
        }
        i = j;
    }
    pthread_mutex_lock(&r->mu);
    for (uint32_t i = w->s0; i < w->s1; i++) {
        const kvhi_xfer *x = &c->xs[i];
        if (x->err == 1)
            fail_run(r, KVH_ERR_CORRUPT, x->block, x->why ? x->why : "checksum mismatch");
        else if (x->err)
            fail_run(r, KVH_ERR_IO, KVHI_NO_BLOCK, "a block could not be read for streaming");
        c->plan.slots[c->stage[i]] = (int32_t)x->dst_slot;
    }
    pthread_mutex_unlock(&r->mu);
}

/* The stager: stages the waves that need it, in order, each once its
 * part of the window has been attended. */
static void *stager(void *arg)
{
    stream_run *r = arg;
    uint32_t k = 0;
    for (uint32_t i = 0; i < r->n_waves; i++) {
        const stream_wave *w = &r->waves[i];
        if (w->s0 == w->s1)
            continue;
        pthread_mutex_lock(&r->mu);
        while (!r->stop && k - r->consumed >= r->parts)
            pthread_cond_wait(&r->cv, &r->mu);
        bool stop = r->stop || r->st != KVH_OK;
        pthread_mutex_unlock(&r->mu);
        if (stop)
            break;
        stage_wave(r, w, k % r->parts);
        pthread_mutex_lock(&r->mu);
        r->staged = ++k;
        pthread_cond_broadcast(&r->cv);
        pthread_mutex_unlock(&r->mu);
    }
    return NULL;
}

/* Attends wave by wave; the stager (or this thread, when there is room for
 * one chunk only or the thread cannot start) fills the window ahead. */
static kvh_status run_waves(stream_run *r, const void *q, void *out, float *po, float *pml)
{
    kvhi_attn_call *c = r->c;
    kvhi_attn_plan *p = &c->plan;
    kvhi_attn_cpu *cpu = p->cpu_state;
    uint32_t staging_waves = 0;
    for (uint32_t i = 0; i < r->n_waves; i++)
        staging_waves += r->waves[i].s0 != r->waves[i].s1;
    pthread_t t;
    bool threaded = r->parts > 1 && staging_waves > 1 && pthread_create(&t, NULL, stager, r) == 0;
    char msg[256] = "";
    uint32_t k = 0;
    for (uint32_t i = 0; i < r->n_waves && !run_failed(r); i++) {
        const stream_wave *w = &r->waves[i];
        bool staged = w->s0 != w->s1;
        if (staged && threaded) {
            pthread_mutex_lock(&r->mu);
            while (r->staged <= k && r->st == KVH_OK)
                pthread_cond_wait(&r->cv, &r->mu);
            pthread_mutex_unlock(&r->mu);
        } else if (staged) {
            stage_wave(r, w, 0);
        }
        if (run_failed(r))
            break;
        int rc = kvhi_attn_cpu_run_range(cpu, p, w->u0, w->u1, false, q, out, po, pml, msg, sizeof(msg));
        if (rc != 0) {
            pthread_mutex_lock(&r->mu);
            fail_run(r, rc, KVHI_NO_BLOCK, "attention kernels");
            pthread_mutex_unlock(&r->mu);
            break;
        }
        if (staged) {
            pthread_mutex_lock(&r->mu);
            r->consumed = ++k;
            pthread_cond_broadcast(&r->cv);
            pthread_mutex_unlock(&r->mu);
        }
    }
    if (threaded) {
        pthread_mutex_lock(&r->mu);
        r->stop = true;
        pthread_cond_broadcast(&r->cv);
        pthread_mutex_unlock(&r->mu);
        pthread_join(t, NULL);
    }
    /* The stager has ended: r is this thread's alone. */
    if (r->st == KVH_OK && p->n_merges) {
        int rc = kvhi_attn_cpu_run_range(cpu, p, 0, 0, true, q, out, po, pml, msg, sizeof(msg));
        if (rc != 0)
            fail_run(r, rc, KVHI_NO_BLOCK, "attention merges");
    }
    return r->st;
}

kvh_status kvhi_attn_stream_run(kvh_engine *e, kvhi_attn_call *c, const void *q, void *out)
{
    kvhi_assert_locked(e);
    kvhi_attn_plan *p = &c->plan;
    stream_run r = {.e = e, .c = c, .st = KVH_OK, .bad_block = KVHI_NO_BLOCK};
    r.part_blocks = c->stream_chunk_blocks;
    r.parts = c->n_window / c->stream_chunk_blocks;
    float *po = NULL;
    kvh_status st = make_waves(c, &r.waves, &r.n_waves);
    if (st == KVH_OK && p->n_partial_rows) {
        po = malloc(sizeof(float) * p->n_partial_rows * (p->head_dim + 2)); /* outputs, then (m, l) pairs */
        if (!po)
            st = kvhi_fail(KVH_ERR_NOMEM, "out of memory for the partial results of a streamed call");
    }
    if (st == KVH_OK && c->n_stage && r.parts == 0)
        st = kvhi_fail(KVH_ERR_INTERNAL, "a streamed call without a window");
    /* Out over q, whole or in part: a wave's rows written would be
     * queries of the waves after it. */
    bool no_copy = false;
    void *q_kept = st == KVH_OK ? kvhi_attn_cpu_q_kept(p, q, out, &no_copy) : NULL;
    if (no_copy)
        st = kvhi_fail(KVH_ERR_NOMEM, "out of memory for a copy of q (out overlaps it)");
    if (q_kept)
        q = q_kept;
    if (st == KVH_OK) {
        pthread_mutex_init(&r.mu, NULL);
        pthread_cond_init(&r.cv, NULL);
        pthread_mutex_unlock(&e->lock);
        st = run_waves(&r, q, out, po, po ? po + p->n_partial_rows * p->head_dim : NULL);
        pthread_mutex_lock(&e->lock);
        pthread_mutex_destroy(&r.mu);
        pthread_cond_destroy(&r.cv);
        /* Counted as staged: the stager stops at the first failure. */
        for (uint32_t i = 0; i < c->n_stage; i++)
            if (c->plan.slots[c->stage[i]] >= 0 && c->xs[i].err == 0) {
                if (c->xs[i].src_tier == KVH_TIER_DISK)
                    e->stats.blocks_streamed_disk++;
                else
                    e->stats.blocks_streamed_host++;
            }
        if (st == KVH_ERR_CORRUPT && r.bad_block != KVHI_NO_BLOCK)
            kvhi_mark_corrupt(e, r.bad_block, r.why); /* counted; a miss from now on */
        if (st != KVH_OK)
            st = kvhi_fail(st, "streamed attention: %s", r.why ? r.why : "failed");
    }
    free(q_kept);
    free(po);
    free(r.waves);
    kvhi_attn_call_release_window(e, c);
    kvhi_attn_call_release_holds(e, c);
    kvhi_attn_call_free(c);
    kvhi_leave(e);
    return st;
}
