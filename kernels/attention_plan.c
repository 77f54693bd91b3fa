/* Paged attention planning: the work split (see attention_plan.h). Pure
 * computation over lengths; runs under the engine lock, so it is linear in
 * the number of sequences, blocks and units and never blocks. */
#include <stdlib.h>
#include <string.h>

#include "kernels/attention_plan.h"

static uint64_t div_up(uint64_t a, uint64_t b) { return (a + b - 1) / b; }
static uint64_t align64(uint64_t x) { return (x + 63) & ~(uint64_t)63; }

/* The query tile shape: rows per tile and heads per tile. */
static void tile_shape(const kvhi_attn_plan *p, uint32_t max_queries, uint32_t *rows, uint32_t *heads,
                       uint32_t *head_tiles)
{
    uint32_t G = p->num_q_heads / p->num_kv_heads;
    if (max_queries == 0)
        max_queries = 1;
    if (G <= max_queries) {
        *heads = G;
        *rows = max_queries / G;
        *head_tiles = 1;
    } else {
        *heads = max_queries;
        *rows = 1;
        *head_tiles = (uint32_t)div_up(G, max_queries);
    }
}

int kvhi_attn_plan_build(kvhi_attn_plan *p, const kvhi_attn_plan_opts *o, const uint32_t *kv_len, const uint32_t *q_len,
                         uint32_t n_seqs)
{
    const uint32_t bt = p->block_tokens, Hkv = p->num_kv_heads, Hq = p->num_q_heads, G = Hq / Hkv;
    /* Split-K granule: whole blocks unless asked for finer. */
    const uint32_t cq = o->chunk_quantum && o->chunk_quantum < bt ? o->chunk_quantum : bt;
    uint32_t rows_pt, heads_pt, head_tiles;
    tile_shape(p, o->max_queries, &rows_pt, &heads_pt, &head_tiles);

    /* Split-K chunk size: about target_units units over all the work,
     * never below min_chunk_tokens. Work counts granules (blocks) read. */
    uint64_t work = 0, n_slots = 0, total_rows = 0;
    for (uint32_t i = 0; i < n_seqs; i++) {
        n_slots += div_up(kv_len[i], bt);
        total_rows += q_len[i];
        if (q_len[i])
            work += (uint64_t)Hkv * head_tiles * div_up(q_len[i], rows_pt) * div_up(kv_len[i], cq);
    }
    if (n_slots > INT32_MAX || total_rows > UINT32_MAX)
        return -1;
    uint64_t target = o->target_units ? o->target_units : 1;
    uint64_t chunk_blocks = div_up(work ? work : 1, target);
    uint64_t min_blocks = div_up(o->min_chunk_tokens ? o->min_chunk_tokens : 1, cq);
    if (chunk_blocks < min_blocks)
        chunk_blocks = min_blocks;
    if (o->max_chunk_tokens) {
        uint64_t max_blocks = o->max_chunk_tokens / cq ? o->max_chunk_tokens / cq : 1;
        if (chunk_blocks > max_blocks)
            chunk_blocks = max_blocks;
    }

    /* First pass: per-sequence chunking and counts. */
    kvhi_attn_seq *seqs = calloc(n_seqs ? n_seqs : 1, sizeof(*seqs));
    if (!seqs)
        return -1;
    uint64_t n_units = 0, n_merges = 0, partial = 0, blk = 0, row = 0;
    uint32_t max_q = 0;
    for (uint32_t i = 0; i < n_seqs; i++) {
        kvhi_attn_seq *s = &seqs[i];
        uint64_t nblk = div_up(kv_len[i], bt), nq_ = div_up(kv_len[i], cq);
        s->kv_len = kv_len[i];
        s->q_len = q_len[i];
        s->q_row0 = (uint32_t)row;
        s->blk0 = (uint32_t)blk;
        s->partial0 = UINT64_MAX;
        blk += nblk;
        row += q_len[i];
        s->n_chunks = 1;
        s->chunk_tokens = (uint32_t)(nq_ ? nq_ * cq : cq);
        if (!q_len[i])
            continue;
        uint64_t nch = div_up(nq_, chunk_blocks);
        if (nch > 1) {
            /* Even chunks: ceil(granules / nch) granules each. */
            uint64_t cb = div_up(nq_, nch);
            nch = div_up(nq_, cb);
            s->chunk_tokens = (uint32_t)(cb * cq);
        }
        s->n_chunks = (uint32_t)nch;
        for (uint32_t q0 = 0; q0 < q_len[i]; q0 += rows_pt) {
            uint32_t q1 = q_len[i] - q0 < rows_pt ? q_len[i] : q0 + rows_pt;
            uint64_t visible = (uint64_t)kv_len[i] - q_len[i] + q1;
            n_units += (uint64_t)Hkv * head_tiles * div_up(visible, s->chunk_tokens);
            uint32_t nq = (q1 - q0) * (heads_pt < G ? heads_pt : G);
            if (nq > max_q)
                max_q = nq;
        }
        if (nch > 1) {
            s->partial0 = partial;
            partial += nch * q_len[i] * (uint64_t)Hq;
            n_merges += q_len[i];
        }
    }
    if (n_units > UINT32_MAX || n_merges > UINT32_MAX) {
        free(seqs);
        return -1;
    }

    p->off_seqs = 0;
    p->off_slots = align64(p->off_seqs + (uint64_t)n_seqs * sizeof(kvhi_attn_seq));
    p->off_units = align64(p->off_slots + n_slots * sizeof(int32_t));
    p->off_merges = align64(p->off_units + n_units * sizeof(kvhi_attn_unit));
    p->mem_bytes = align64(p->off_merges + n_merges * sizeof(kvhi_attn_merge));
    if (p->mem_bytes == 0)
        p->mem_bytes = 64;
    p->mem = aligned_alloc(64, p->mem_bytes);
    if (!p->mem) {
        free(seqs);
        return -1;
    }
    uint8_t *m = p->mem;
    p->seqs = (kvhi_attn_seq *)(m + p->off_seqs);
    p->slots = (int32_t *)(m + p->off_slots);
    p->units = (kvhi_attn_unit *)(m + p->off_units);
    p->merges = (kvhi_attn_merge *)(m + p->off_merges);
    if (n_seqs)
        memcpy(p->seqs, seqs, n_seqs * sizeof(*seqs));
    free(seqs);
    p->n_seqs = n_seqs;
    p->n_slots = (uint32_t)n_slots;
    p->n_units = (uint32_t)n_units;
    p->n_merges = (uint32_t)n_merges;
    p->total_rows = (uint32_t)total_rows;
    p->max_queries = max_q;
    p->n_partial_rows = partial;

    /* Second pass: the units (per sequence, row tile, head tile, kv head,
     * chunk; chunks innermost so neighbours share a tile's queries) and
     * the merge rows. */
    uint64_t u = 0, mi = 0;
    for (uint32_t i = 0; i < n_seqs; i++) {
        const kvhi_attn_seq *s = &p->seqs[i];
        for (uint32_t q0 = 0; q0 < s->q_len; q0 += rows_pt) {
            uint32_t q1 = s->q_len - q0 < rows_pt ? s->q_len : q0 + rows_pt;
            uint32_t visible = s->kv_len - s->q_len + q1;
            uint32_t nch = (uint32_t)div_up(visible, s->chunk_tokens);
            for (uint32_t ht = 0; ht < head_tiles; ht++) {
                uint32_t g0 = ht * heads_pt, g1 = g0 + heads_pt < G ? g0 + heads_pt : G;
                for (uint32_t h = 0; h < Hkv; h++)
                    for (uint32_t c = 0; c < nch; c++) {
                        kvhi_attn_unit *w = &p->units[u++];
                        uint64_t k0 = (uint64_t)c * s->chunk_tokens, k1 = k0 + s->chunk_tokens;
                        w->seq = i;
                        w->kv_head = h;
                        w->q0 = q0;
                        w->q1 = q1;
                        w->g0 = g0;
                        w->g1 = g1;
                        w->k0 = (uint32_t)k0;
                        w->k1 = (uint32_t)(k1 < visible ? k1 : visible);
                        w->chunk = c;
                        w->reserved0 = 0;
                    }
            }
        }
        if (s->n_chunks > 1)
            for (uint32_t r = 0; r < s->q_len; r++) {
                p->merges[mi].seq = i;
                p->merges[mi].row = r;
                mi++;
            }
    }
    return 0;
}

void kvhi_attn_plan_free(kvhi_attn_plan *p)
{
    free(p->mem);
    p->mem = NULL;
}
