/* LCTRU victim order ("least compression-tolerable and recently used",
 * after LLMS, "LLM as a System Service on Mobile Devices"): the LRU-K key
 * with the block's access times moved back by tolerance / 255 * window,
 * so a tolerant block is chosen as if it had been used that much longer
 * ago. A static shift keeps the heap order valid without re-keying: only
 * the block's own accesses and tolerance changes move it. */
#include <math.h>
#include <stdlib.h>

#include "core/block_state.h"
#include "core/engine.h"
#include "kernels/attention_dtype.h"
#include "kernels/cpu/kv_codec.h"
#include "core/block.h"
#include "core/seq.h"
#include "core/codec_tier.h"
#include "core/lctru.h"

static uint64_t window(kvh_engine *e)
{
    return e->cfg.lctru_window ? e->cfg.lctru_window : e->tiers[KVH_TIER_DEVICE].slots.capacity;
}

/* t moved back by shift. Every key is raised by the window, the largest
 * shift, first: times earlier than the window (an engine's first
 * accesses) would otherwise all stop at the same floor and tie, losing
 * the tolerance order; 0 ("fewer than K accesses" in the primary key)
 * stays 0. */
static uint64_t age(uint64_t t, uint64_t window, uint64_t shift) { return t == 0 ? 0 : t + window - shift; }

kvhi_lruk_key kvhi_evict_key(kvh_engine *e, const kvhi_block *blk, kvhi_lruk_key k)
{
    if (e->cfg.eviction_policy != KVH_EVICT_LCTRU)
        return k;
    uint64_t w = window(e), shift = w * blk->tolerance / KVH_TOLERANCE_MAX;
    const uint64_t class_bit = 1ull << 63;
    uint64_t cls = k.primary & class_bit;
    k.primary = cls | age(k.primary & ~class_bit, w, shift);
    k.secondary = age(k.secondary, w, shift);
    return k;
}

static void set_tolerance(kvh_engine *e, uint32_t b, uint32_t tolerance)
{
    kvhi_block *blk = &e->blocks[b];
    if (blk->tolerance == tolerance)
        return;
    blk->tolerance = (uint8_t)tolerance;
    if (blk->heap_pos != KVHI_HEAP_NONE || blk->quota_heap_pos != KVHI_HEAP_NONE)
        kvhi_block_update_evictable(e, b);
}

kvh_status kvhi_seq_set_tolerance(kvh_engine *e, kvhi_seq *s, uint64_t first, uint64_t n, uint32_t tolerance)
{
    uint32_t b0 = 0, b1 = 0;
    kvh_status st = KVH_OK;
    /* An empty range past the end is refused too, as every range call does. */
    if ((st = kvhi_seq_block_range(e, s, first, n, &b0, &b1)) == KVH_OK)
        for (uint32_t i = b0; i < b1; i++)
            set_tolerance(e, s->blocks[i], tolerance);
    return st;
}

kvh_status kvhi_block_set_tolerance(kvh_engine *e, kvh_block block, uint32_t tolerance)
{
    uint32_t b;
    kvh_status st = kvhi_block_resolve(e, block, &b);
    if (st == KVH_OK)
        set_tolerance(e, b, tolerance);
    return st;
}

/* Relative RMS error of the codec on b's written cells (lock held; the
 * data is read in place, or staged when the CPU cannot address it).
 * Returns -1 when nothing is written, -2 out of memory. */
static double codec_error(kvh_engine *e, uint32_t b, uint8_t *raw, uint8_t *enc, float *y)
{
    const uint8_t *data = kvhi_block_data(e, b);
    if (!e->device_host_addressable) {
        if (kvhi_block_copy(e, KVHI_RAW_HOST, raw, KVH_TIER_DEVICE, data) != 0)
            return -2;
        data = raw;
    }
    uint32_t H = e->cfg.num_kv_heads, D = e->cfg.head_dim, bt = e->cfg.block_tokens;
    double num = 0, den = 0;
    bool any = false;
    for (uint32_t l = 0; l < e->cfg.num_layers; l++)
        for (uint32_t t = 0; t < bt; t++) {
            if (!kvhi_block_cell_written(e, b, l, t))
                continue;
            any = true;
            for (uint32_t kv = 0; kv < 2; kv++)
                for (uint32_t h = 0; h < H; h++) {
                    const uint8_t *cell = data + kvhi_cell_offset(e, KVH_TIER_DEVICE, l, kv, h, t);
                    kvhi_codec_encode(e->cfg.kv_codec, e->cfg.dtype, D, cell, 1, enc);
                    /* Decoded to the engine's dtype, as a demotion's round
                     * trip rounds it: the error it would really cause. */
                    kvhi_codec_decode(e->cfg.kv_codec, e->cfg.dtype, D, enc, 1, y);
                    for (uint32_t d = 0; d < D; d++) {
                        double xv = kvhi_load_as_f32(e->cfg.dtype, cell, d);
                        double yv = kvhi_load_as_f32(e->cfg.dtype, (const uint8_t *)y, d);
                        if (!isfinite(xv))
                            continue;
                        num += (xv - yv) * (xv - yv);
                        den += xv * xv;
                    }
                }
        }
    if (!any)
        return -1;
    return den > 0 ? sqrt(num / den) : 0;
}

kvh_status kvhi_seq_derive_tolerance(kvh_engine *e, kvhi_seq *s, uint64_t first, uint64_t n, float max_rel_error)
{
    double ref = max_rel_error > 0 ? max_rel_error : 0.25;
    kvh_status st = KVH_OK;
    uint32_t b0 = 0, b1 = 0;
    uint8_t *raw = NULL, *enc = NULL;
    float *y = NULL;
    if (e->cfg.kv_codec == KVH_CODEC_NONE)
        st = kvhi_fail(KVH_ERR_UNSUPPORTED, "the engine has no kv_codec to measure");
    else
        st = kvhi_seq_block_range(e, s, first, n, &b0, &b1);
    if (st == KVH_OK && b1 > b0) {
        raw = malloc(e->block_bytes);
        enc = malloc(e->enc_vector_bytes);
        y = malloc(sizeof(float) * e->cfg.head_dim);
        if (!raw || !enc || !y)
            st = kvhi_fail(KVH_ERR_NOMEM, "out of memory measuring codec error");
    }
    for (uint32_t i = b0; i < b1 && st == KVH_OK; i++) {
        uint32_t b = s->blocks[i];
        kvhi_block *blk = &e->blocks[b];
        /* A block being copied is skipped rather than waited for: its
         * data is in motion, and the caller can ask again. */
        if (blk->tier != KVH_TIER_DEVICE || kvhi_block_in_flight(blk))
            continue;
        double err = codec_error(e, b, raw, enc, y);
        if (err == -2)
            st = kvhi_fail(KVH_ERR_NOMEM, "out of memory staging a block");
        else if (err >= 0) {
            double tol = KVH_TOLERANCE_MAX * (1.0 - err / ref);
            set_tolerance(e, b, tol <= 0 ? 0 : (uint32_t)lround(tol));
        }
    }
    free(raw);
    free(enc);
    free(y);
    return st;
}
