/* core/adaptive.c: KVH_EVICT_ADAPTIVE follows whichever of LRU-K and
 * plain LRU its shadows find the better, both ways, and its heaps stay
 * exact across a switch. White-box: blocks are allocated through the API
 * and accessed with kvhi_block_touch under the engine lock. */
#include <pthread.h>

#include "test_util.h"

#include "core/engine.h"
#include "core/block.h"
#include "core/tier.h"

enum { DEV = 16, HOST = 160, LIVE = 120 };

typedef struct ring {
    kvh_block b[LIVE];
    uint64_t n; /* blocks allocated so far; the last LIVE are live */
} ring;

static uint32_t index_of(kvh_engine *e, kvh_block h)
{
    uint32_t b = 0;
    assert_ok(kvhi_block_resolve(e, h, &b));
    return b;
}

static void touch(kvh_engine *e, kvh_block h)
{
    pthread_mutex_lock(&e->lock);
    kvhi_block_touch(e, index_of(e, h));
    pthread_mutex_unlock(&e->lock);
}

/* A new block (an access); the oldest one goes once LIVE are held. */
static kvh_block push(kvh_engine *e, ring *r)
{
    kvh_block *slot = &r->b[r->n % LIVE];
    if (r->n >= LIVE)
        assert_ok(kvh_block_release(e, *slot));
    assert_ok(kvh_block_alloc(e, 0, slot));
    r->n++;
    return *slot;
}

static kvh_block back(const ring *r, uint64_t k) { return r->b[(r->n - 1 - k) % LIVE]; }

/* The device heap's victim is the exact minimum of the current keys, and
 * under plain LRU that is the least recently used evictable block. */
static void check_victim(kvh_engine *e, int recency)
{
    pthread_mutex_lock(&e->lock);
    uint32_t v = kvhi_lruk_top_current(&e->tiers[KVH_TIER_DEVICE].heap, kvhi_block_current_key, e);
    uint32_t want = KVHI_HEAP_NONE;
    kvhi_lruk_key best = {0, 0};
    uint64_t oldest = UINT64_MAX;
    uint32_t lru = KVHI_HEAP_NONE;
    for (uint32_t b = 0; b < e->block_cap; b++) {
        const kvhi_block *blk = &e->blocks[b];
        if (!(blk->flags & KVHI_BF_LIVE) || blk->tier != KVH_TIER_DEVICE || blk->heap_pos == KVHI_HEAP_NONE)
            continue;
        kvhi_lruk_key k = kvhi_block_current_key(e, b);
        if (want == KVHI_HEAP_NONE || kvhi_lruk_less(&k, &best)) {
            want = b;
            best = k;
        }
        if (blk->hist[0] < oldest) {
            oldest = blk->hist[0];
            lru = b;
        }
    }
    pthread_mutex_unlock(&e->lock);
    assert_int_equal(v, want);
    if (recency)
        assert_int_equal(v, lru);
}

static void test_adapts_both_ways(void **state)
{
    (void)state;
    kvh_config c = tu_cfg(1, 1, 4, 1, KVH_DTYPE_F32, DEV, HOST, 0);
    c.eviction_policy = KVH_EVICT_ADAPTIVE;
    kvh_engine *e = tu_open_cfg(&c);
    ring r = {.n = 0};
    assert_true(e->adapt.on);
    assert_false(e->adapt.recency); /* starts as LRU-K */

    /* Each new block is read again four steps later, then never: LRU-K
     * evicts the newcomers (one access) first and misses every re-read,
     * plain LRU hits them all. */
    for (int step = 0; step < 6000 && !e->adapt.recency; step++) {
        push(e, &r);
        if (r.n > 4)
            touch(e, back(&r, 4));
    }
    assert_true(e->adapt.recency);
    assert_true(e->adapt.switches >= 1);
    /* The switch re-keyed every heap entry; the next one waits about as
     * many accesses (a step here is at most two), which bounds flapping
     * and the cost of re-keying. */
    uint64_t entries = 0;
    for (uint32_t t = 0; t < KVH_TIER_COUNT; t++)
        if (e->tiers[t].present)
            entries += kvhi_lruk_count(&e->tiers[t].heap);
    assert_true(e->adapt.quiet_left > 0);
    assert_true(e->adapt.quiet_left + 2 >= entries);
    check_victim(e, 1);

    /* A hot set of six blocks among a scan of two new blocks a step: plain
     * LRU loses the hot set to the scan, LRU-K keeps it. */
    kvh_block hot[6];
    for (int i = 0; i < 6; i++)
        assert_ok(kvh_block_alloc(e, 0, &hot[i]));
    uint64_t before = e->adapt.switches;
    for (int step = 0; step < 12000 && e->adapt.recency; step++) {
        touch(e, hot[step % 6]);
        push(e, &r);
        push(e, &r);
    }
    assert_false(e->adapt.recency);
    assert_true(e->adapt.switches > before);
    check_victim(e, 0);
    for (int i = 0; i < 6; i++)
        assert_ok(kvh_block_release(e, hot[i]));
}

/* The default; an explicit LRU-K never runs the shadows (old tables stay
 * reproducible), and an unknown policy value is refused. */
static void test_default_and_explicit_lru_k(void **state)
{
    (void)state;
    kvh_config c = tu_cfg(1, 1, 4, 1, KVH_DTYPE_F32, DEV, HOST, 0);
    assert_int_equal(c.eviction_policy, KVH_EVICT_ADAPTIVE);
    c.eviction_policy = KVH_EVICT_LRU_K;
    kvh_engine *e = tu_open_cfg(&c);
    assert_false(e->adapt.on);
    ring r = {.n = 0};
    for (int step = 0; step < 3000; step++) {
        push(e, &r);
        if (r.n > 4)
            touch(e, back(&r, 4));
    }
    assert_int_equal(e->adapt.switches, 0);
    c.eviction_policy = KVH_EVICT_ADAPTIVE + 1;
    kvh_engine *bad = NULL;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(&c, &bad));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_adapts_both_ways, tu_teardown),
        cmocka_unit_test_teardown(test_default_and_explicit_lru_k, tu_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
