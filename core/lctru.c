/* LCTRU victim order ("least compression-tolerable and recently used",
 * after LLMS, "LLM as a System Service on Mobile Devices"): the LRU-K key
 * with the block's access times moved back by tolerance / 255 * window,
 * so a tolerant block is chosen as if it had been used that much longer
 * ago. A static shift keeps the heap order valid without re-keying: only
 * the block's own accesses and tolerance changes move it. */
#include "abi/api_common.h"

static uint64_t window(kvh_engine *e)
{
    return e->cfg.lctru_window ? e->cfg.lctru_window : e->tiers[KVH_TIER_DEVICE].slots.capacity;
}

/* t moved back by shift, without reaching 0 (which means "fewer than K
 * accesses" in the primary key) from a real access time. */
static uint64_t age(uint64_t t, uint64_t shift)
{
    if (t == 0)
        return 0;
    return t > shift ? t - shift : 1;
}

kvhi_lruk_key kvhi_evict_key(kvh_engine *e, const kvhi_block *blk, kvhi_lruk_key k)
{
    if (e->cfg.eviction_policy != KVH_EVICT_LCTRU || blk->tolerance == 0)
        return k;
    uint64_t shift = window(e) * blk->tolerance / KVH_TOLERANCE_MAX;
    const uint64_t class_bit = 1ull << 63;
    uint64_t cls = k.primary & class_bit;
    k.primary = cls | age(k.primary & ~class_bit, shift);
    k.secondary = age(k.secondary, shift);
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

kvh_status kvh_seq_set_tolerance(kvh_engine *e, kvh_seq seq, uint64_t first, uint64_t n, uint32_t tolerance)
{
    kvhi_clear_error();
    KVHI_REQUIRE(tolerance <= KVH_TOLERANCE_MAX, "tolerance %u > %u", tolerance, KVH_TOLERANCE_MAX);
    kvhi_seq *s;
    kvh_status st = kvhi_api_enter_seq(e, seq, &s);
    if (st != KVH_OK)
        return st;
    uint32_t b0 = 0, b1 = 0;
    if (n > 0 && (st = kvhi_seq_block_range(e, s, first, n, &b0, &b1)) == KVH_OK)
        for (uint32_t i = b0; i < b1; i++)
            set_tolerance(e, s->blocks[i], tolerance);
    kvhi_leave(e);
    return st;
}

kvh_status kvh_block_set_tolerance(kvh_engine *e, kvh_block block, uint32_t tolerance)
{
    kvhi_clear_error();
    KVHI_REQUIRE(tolerance <= KVH_TOLERANCE_MAX, "tolerance %u > %u", tolerance, KVH_TOLERANCE_MAX);
    kvh_status st = kvhi_api_enter(e);
    if (st != KVH_OK)
        return st;
    uint32_t b;
    if ((st = kvhi_block_resolve(e, block, &b)) == KVH_OK)
        set_tolerance(e, b, tolerance);
    kvhi_leave(e);
    return st;
}
