#include "trace_replay.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bench_fs.h"
#include "kvh/kvh.h"

#define BLOCK_TOKENS 16u
#define HEAD_DIM 8u

static int fail(const char *what, kvh_status st)
{
    fprintf(stderr, "trace replay: %s failed: %s: %s\n", what, kvh_status_name(st), kvh_last_error());
    return 1;
}

#define CHECK(call)                                                                                                    \
    do {                                                                                                               \
        kvh_status st_ = (call);                                                                                       \
        if (st_ != KVH_OK) {                                                                                           \
            rc = fail(#call, st_);                                                                                     \
            goto out;                                                                                                  \
        }                                                                                                              \
    } while (0)

static double now_sec(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Token ids unique to (seq, position), so no two trace blocks share a
 * prefix-index entry. */
static int32_t token_of(uint32_t seq, uint64_t pos)
{
    return (int32_t)((((uint64_t)seq * 1000003u) + pos) & 0x3fffffff);
}

/* On entry: whether turn's hints belong to this batch, the first that
 * named the turn (0 in first_batch: none yet; a turn past the table,
 * which generated traces never have, counts as new). */
static int entered_in(uint64_t *first_batch, size_t n, uint64_t turn, uint64_t batch)
{
    if (turn >= n)
        return 1;
    if (!first_batch[turn])
        first_batch[turn] = batch;
    return first_batch[turn] == batch;
}

uint64_t trace_replay_blocks(const trace *t)
{
    uint64_t *len = calloc(t->n_seqs ? t->n_seqs : 1, sizeof(*len)), total = 0;
    if (!len)
        return UINT64_MAX;
    for (size_t i = 0; i < t->n; i++)
        if (len[t->acc[i].seq_id] < (uint64_t)t->acc[i].index + 1)
            len[t->acc[i].seq_id] = (uint64_t)t->acc[i].index + 1;
    for (uint32_t q = 0; q < t->n_seqs; q++)
        total += len[q];
    free(len);
    return total;
}

uint64_t trace_replay_padded(const trace *t)
{
    uint64_t *len = calloc(t->n_seqs ? t->n_seqs : 1, sizeof(*len)), padded = 0;
    if (!len)
        return UINT64_MAX;
    for (size_t i = 0; i < t->n; i++) {
        uint64_t *l = &len[t->acc[i].seq_id], index = t->acc[i].index;
        if (index >= *l) {
            padded += index - *l; /* appended now, not read now */
            *l = index + 1;
        }
    }
    free(len);
    return padded;
}

bool trace_replay_fits(const trace *t, uint64_t blocks) { return blocks <= 16 * (uint64_t)t->n + 65536; }

int trace_replay(const trace *t, const replay_config *c, replay_result *out)
{
    memset(out, 0, sizeof(*out));
    int rc = 1;
    kvh_engine *e = NULL;
    /* Per sequence by dense id (trace_access.seq_id): source ids may be
     * any 32-bit values. */
    uint32_t n_seqs = t->n_seqs;
    kvh_seq *seqs = calloc(n_seqs ? n_seqs : 1, sizeof(*seqs));
    uint8_t *created = calloc(n_seqs ? n_seqs : 1, 1);
    uint8_t *seen = calloc(t->n_blocks ? t->n_blocks : 1, 1);
    uint64_t *first_batch = calloc(t->n_hints + 1, sizeof(*first_batch));
    uint64_t *len = calloc(n_seqs ? n_seqs : 1, sizeof(*len));
    /* Prefetching ahead: named by a hint since its last access, and the
     * highest priority that named it (dense block ids). */
    int window = c->hints == 2 && c->prefetch_ahead > 0;
    uint8_t *named = calloc(t->n_blocks ? t->n_blocks : 1, 1);
    int32_t *named_prio = calloc(t->n_blocks ? t->n_blocks : 1, sizeof(*named_prio));
    trace_position *by_pos = window ? trace_blocks_by_position(t) : NULL;
    uint16_t kv[BLOCK_TOKENS * HEAD_DIM];
    int32_t tokens[BLOCK_TOKENS];
    char store[4096];
    int made_store = 0, scratch_slot = -1;
    if (!seqs || !created || !seen || !len || !first_batch || !named || !named_prio || (window && !by_pos)) {
        fprintf(stderr, "trace replay: out of memory\n");
        goto out;
    }
    for (size_t i = 0; i < BLOCK_TOKENS * HEAD_DIM; i++)
        kv[i] = 0x3c00; /* f16 1.0 */
    /* A fresh store each time: blocks of an earlier replay would take
     * disk space. */
    snprintf(store, sizeof(store), "%s/kvh-replay-XXXXXX", c->disk_dir);
    if (!mkdtemp(store)) {
        perror("trace replay: mkdtemp");
        goto out;
    }
    made_store = 1;
    scratch_slot = bench_scratch_add(store); /* gone too if a signal ends the run */

    kvh_config cfg;
    kvh_config_init(&cfg, sizeof(cfg));
    cfg.backend = KVH_BACKEND_CPU;
    cfg.num_layers = 1;
    cfg.num_kv_heads = 1;
    cfg.head_dim = HEAD_DIM;
    cfg.block_tokens = BLOCK_TOKENS;
    cfg.migration_threads = 0;
    /* Count device <-> host moves per direction, as a discrete GPU's
     * copies (on one arena they would be re-accounted, not copied). */
    cfg.copy_moves = 1;
    if (c->lru_k)
        cfg.lru_k = c->lru_k;
    cfg.eviction_policy = c->lru_k_order ? KVH_EVICT_LRU_K : KVH_EVICT_ADAPTIVE;
    uint64_t block_bytes = 2ull * BLOCK_TOKENS * HEAD_DIM * 2; /* K and V, f16, 1 layer, 1 head */
    cfg.device_bytes = (uint64_t)c->device_blocks * block_bytes;
    cfg.host_bytes = (uint64_t)c->host_blocks * block_bytes;
    /* Room on disk for every block appended, whatever the per-block
     * overhead: a first access appends the blocks of its sequence below it
     * too, so a sequence takes its highest index + 1 blocks, however few
     * of them the trace names. */
    uint64_t appended = 0;
    for (size_t i = 0; i < t->n; i++)
        if (len[t->acc[i].seq_id] < (uint64_t)t->acc[i].index + 1)
            len[t->acc[i].seq_id] = (uint64_t)t->acc[i].index + 1;
    for (uint32_t q = 0; q < n_seqs; q++) {
        appended += len[q];
        len[q] = 0;
    }
    if (appended > UINT64_MAX / (block_bytes + 8192) - 64) {
        fprintf(stderr, "trace replay: the trace's sequences take %llu blocks, too many for a disk tier\n",
                (unsigned long long)appended);
        goto out;
    }
    if (!trace_replay_fits(t, appended)) {
        fprintf(stderr, "trace replay: %llu blocks to append for %zu accesses\n", (unsigned long long)appended, t->n);
        goto out;
    }
    cfg.disk_bytes = (appended + 64) * (block_bytes + 8192);
    cfg.disk_path = store;
    cfg.disk_flags = KVH_DISK_RESET_ON_MISMATCH;
    CHECK(kvh_engine_open(&cfg, &e));
    CHECK(kvh_engine_block_bytes(e, &out->block_bytes));

    kvh_stats before, after;
    before.struct_size = after.struct_size = sizeof(kvh_stats);
    sim_result *r = &out->sim;
    double t0 = now_sec();
    size_t h = 0;
    /* Queue hints: the step, and the batch each turn was first hinted in. */
    uint64_t step = 0, batch = 0;
    for (size_t i = 0; i < t->n; i++) {
        if (c->hints >= REPLAY_QUEUE_POSITION && h < t->n_hints && t->hints[h].at <= i) {
            /* A new batch of hints: the turn before it has run. */
            if (i > 0)
                CHECK(kvh_hint_advance(e, 1, &step));
            batch++;
        }
        for (; h < t->n_hints && t->hints[h].at <= i; h++) {
            const trace_hint *th = &t->hints[h];
            int64_t sid = c->hints ? trace_find_seq(t, th->seq) : -1;
            if (sid < 0 || !created[sid])
                continue;
            /* Only blocks the sequence has (the rest are not made yet). */
            uint64_t have = len[sid] / BLOCK_TOKENS;
            uint64_t end = (uint64_t)th->first + th->n < have ? (uint64_t)th->first + th->n : have;
            if (th->first >= end)
                continue;
            uint64_t tok0 = (uint64_t)th->first * BLOCK_TOKENS, ntok = (end - th->first) * BLOCK_TOKENS;
            /* In 64 bits: INT32_MAX - INT32_MIN overflows an int. */
            uint64_t turn = (uint64_t)((int64_t)INT32_MAX - th->priority);
            if (window)
                for (size_t k = trace_position_at(by_pos, t->n_blocks, th->seq, th->first);
                     k < t->n_blocks && by_pos[k].seq == th->seq && by_pos[k].index < end; k++) {
                    uint32_t b = by_pos[k].block;
                    if (!named[b] || th->priority > named_prio[b])
                        named_prio[b] = th->priority;
                    named[b] = 1;
                }
            if (c->hints == 1 || window)
                CHECK(kvh_seq_hint(e, seqs[sid], tok0, ntok, th->priority));
            else if (c->hints == 2)
                CHECK(kvh_prefetch(e, seqs[sid], tok0, ntok, th->priority, NULL));
            else if (c->hints == REPLAY_QUEUE_POSITION)
                CHECK(kvh_seq_hint_queued(e, seqs[sid], tok0, ntok, turn - step, KVH_HINT_POSITION));
            else if (c->hints == REPLAY_QUEUE_REQUEST || entered_in(first_batch, t->n_hints, turn, batch))
                CHECK(kvh_seq_hint_queued(e, seqs[sid], tok0, ntok, turn, KVH_HINT_REQUEST));
        }
        /* The window's far end: prefetched if the queue names it. */
        if (window && i + c->prefetch_ahead < t->n) {
            const trace_access *far = &t->acc[i + c->prefetch_ahead];
            if (named[far->block] && seen[far->block] && created[far->seq_id])
                CHECK(kvh_prefetch(e, seqs[far->seq_id], (uint64_t)far->index * BLOCK_TOKENS, BLOCK_TOKENS,
                                   named_prio[far->block], NULL));
        }
        const trace_access *a = &t->acc[i];
        named[a->block] = 0;
        if (!created[a->seq_id]) {
            CHECK(kvh_seq_create(e, a->agent, &seqs[a->seq_id]));
            created[a->seq_id] = 1;
        }
        kvh_seq s = seqs[a->seq_id];
        r->accesses++;
        uint64_t first = (uint64_t)a->index * BLOCK_TOKENS;
        if (!seen[a->block]) {
            /* First access: the block is computed. Earlier logical blocks
             * the trace has not named yet are appended too (the engine
             * needs a contiguous sequence); one of them read later is
             * acquired at its first read, which then places it as the
             * simulators place a block they first meet. */
            seen[a->block] = 1;
            r->misses++;
            r->first_accesses++;
            if (len[a->seq_id] > first) {
                CHECK(kvh_seq_acquire(e, s, first, BLOCK_TOKENS, NULL));
                CHECK(kvh_seq_release(e, s, first, BLOCK_TOKENS));
                continue;
            }
            while (len[a->seq_id] <= first) {
                for (uint32_t k = 0; k < BLOCK_TOKENS; k++)
                    tokens[k] = token_of(a->seq, len[a->seq_id] + k);
                CHECK(kvh_seq_append(e, s, tokens, BLOCK_TOKENS));
                if (!c->skip_kv_write)
                    CHECK(kvh_seq_write_kv(e, s, 0, len[a->seq_id], BLOCK_TOKENS, kv, kv));
                len[a->seq_id] += BLOCK_TOKENS;
            }
            continue;
        }
        CHECK(kvh_engine_stats(e, &before));
        CHECK(kvh_seq_acquire(e, s, first, BLOCK_TOKENS, NULL));
        CHECK(kvh_seq_release(e, s, first, BLOCK_TOKENS));
        CHECK(kvh_engine_stats(e, &after));
        if (after.hits_device > before.hits_device) {
            r->hits_device++;
            continue;
        }
        out->waits++; /* not in the device tier: the acquire moved it up */
        if (after.hits_host > before.hits_host)
            r->hits_host++;
        else
            r->misses++;
    }
    out->seconds = now_sec() - t0;
    CHECK(kvh_engine_stats(e, &after));
    out->stall_ns = after.acquire_stall_ns;
    r->up_dh = after.blocks_host_to_device;
    r->down_dh = after.blocks_device_to_host;
    r->up_sh = after.blocks_disk_to_host;
    r->down_sh = after.blocks_host_to_disk;
    if (c->hints == 2)
        sim_hits_by_fetches(r); /* a prefetched block is found where the hint put it */
    rc = 0;
out:
    if (e) {
        for (uint32_t q = 0; q < n_seqs; q++)
            if (created[q])
                kvh_seq_free(e, seqs[q]);
        kvh_engine_close(e);
    }
    if (made_store)
        bench_remove_tree(store);
    bench_scratch_drop(scratch_slot);
    free(seqs);
    free(created);
    free(seen);
    free(first_batch);
    free(len);
    free(named);
    free(named_prio);
    free(by_pos);
    return rc;
}
