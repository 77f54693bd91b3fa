/* The scalar reference of paged attention: the oracle the fast kernels are
 * tested against. Deliberately plain: each output row on its own, scores
 * over every visible token in double, two passes (max, then exp/sum and
 * the weighted sum of V), one rounding to the output dtype at the end. It
 * reads the plan's block table only (seqs and slots), not its units. */
#include <math.h>
#include <stdlib.h>

#include "kernels/attention_dtype.h"
#include "kernels/attention_plan.h"

int kvhi_attn_reference(const kvhi_attn_plan *p, const void *q, void *out)
{
    const uint32_t D = p->head_dim, bt = p->block_tokens, Hq = p->num_q_heads, Hkv = p->num_kv_heads;
    const uint32_t G = Hq / Hkv;
    const uint32_t eb = p->kv_dtype == 0 ? 4 : 2;
    const uint64_t piece = (uint64_t)bt * D * eb, pitch = p->piece_pitch ? p->piece_pitch : piece;
    uint32_t max_kv = 1;
    for (uint32_t i = 0; i < p->n_seqs; i++)
        if (p->seqs[i].kv_len > max_kv)
            max_kv = p->seqs[i].kv_len;
    double *w = malloc(sizeof(double) * max_kv);
    double *o = malloc(sizeof(double) * D);
    if (!w || !o) {
        free(w);
        free(o);
        return -1;
    }
    for (uint32_t i = 0; i < p->n_seqs; i++) {
        const kvhi_attn_seq *s = &p->seqs[i];
        for (uint32_t r = 0; r < s->q_len; r++) {
            uint32_t visible = s->kv_len - s->q_len + r + 1;
            for (uint32_t qh = 0; qh < Hq; qh++) {
                uint32_t h = qh / G;
                uint64_t qrow = ((uint64_t)(s->q_row0 + r) * Hq + qh) * D;
                /* pass 1: scores and their max */
                double mx = -INFINITY;
                for (uint32_t t = 0; t < visible; t++) {
                    const uint8_t *blk = (const uint8_t *)p->kv_base +
                                         kvhi_attn_slot_offset(p, (uint32_t)p->slots[s->blk0 + t / bt], piece) +
                                         p->layer_offset;
                    const uint8_t *k = blk + (uint64_t)h * pitch + (uint64_t)(t % bt) * D * eb;
                    double dot = 0;
                    for (uint32_t d = 0; d < D; d++)
                        dot += (double)kvhi_load_as_f32(p->io_dtype, q, qrow + d) *
                               (double)kvhi_load_as_f32(p->kv_dtype, k, d);
                    w[t] = dot * (double)p->scale;
                    if (w[t] > mx)
                        mx = w[t];
                }
                /* pass 2: weights, normaliser, weighted sum of V */
                double sum = 0;
                for (uint32_t d = 0; d < D; d++)
                    o[d] = 0;
                for (uint32_t t = 0; t < visible; t++) {
                    const uint8_t *blk = (const uint8_t *)p->kv_base +
                                         kvhi_attn_slot_offset(p, (uint32_t)p->slots[s->blk0 + t / bt], piece) +
                                         p->layer_offset;
                    const uint8_t *v = blk + (uint64_t)(Hkv + h) * pitch + (uint64_t)(t % bt) * D * eb;
                    double e = exp(w[t] - mx);
                    sum += e;
                    for (uint32_t d = 0; d < D; d++)
                        o[d] += e * (double)kvhi_load_as_f32(p->kv_dtype, v, d);
                }
                for (uint32_t d = 0; d < D; d++)
                    kvhi_store_from_f32(p->io_dtype, out, qrow + d, (float)(o[d] / sum));
            }
        }
    }
    free(w);
    free(o);
    return 0;
}
