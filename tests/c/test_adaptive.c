/* core/adaptive.c: KVH_EVICT_ADAPTIVE follows whichever of LRU-K, plain
 * LRU and protected reuse its shadows find the best, every way, and its
 * heaps stay exact across a switch and under the reuse order's lowered
 * keys. White-box: blocks are allocated through the API
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
    assert_int_equal(e->adapt.order, KVHI_ADAPT_LRU_K); /* starts as LRU-K */
    assert_int_equal(e->adapt.n_orders, KVHI_ADAPT_ORDERS);

    /* Each new block is read again four steps later, then never: LRU-K
     * evicts the newcomers (one access) first and misses every re-read,
     * plain LRU hits them all. */
    for (int step = 0; step < 6000 && e->adapt.order != KVHI_ADAPT_LRU; step++) {
        push(e, &r);
        if (r.n > 4)
            touch(e, back(&r, 4));
    }
    assert_int_equal(e->adapt.order, KVHI_ADAPT_LRU);
    assert_true(e->adapt.switches >= 1);
    /* The switch re-keyed every heap entry; the next one waits about as
     * many accesses (a step here is at most two), which bounds flapping
     * and the cost of re-keying. */
    uint64_t entries = 0;
    for (uint32_t t = 0; t < KVH_TIER_COUNT; t++)
        if (e->tiers[t].present)
            entries += kvhi_lruk_count(&e->tiers[t].heap);
    assert_true(kvhi_adapt_quiet_left(&e->adapt) > 0);
    assert_true(kvhi_adapt_quiet_left(&e->adapt) + 2 >= entries);
    check_victim(e, 1);

    /* A hot set of six blocks among a scan of two new blocks a step: plain
     * LRU loses the hot set to the scan, LRU-K keeps it (and so does the
     * reuse order: the hot blocks are reused within its period). */
    kvh_block hot[6];
    for (int i = 0; i < 6; i++)
        assert_ok(kvh_block_alloc(e, 0, &hot[i]));
    uint64_t before = e->adapt.switches;
    for (int step = 0; step < 12000 && e->adapt.order == KVHI_ADAPT_LRU; step++) {
        touch(e, hot[step % 6]);
        push(e, &r);
        push(e, &r);
    }
    assert_int_not_equal(e->adapt.order, KVHI_ADAPT_LRU);
    assert_true(e->adapt.switches > before);
    check_victim(e, 0);
    for (int i = 0; i < 6; i++)
        assert_ok(kvh_block_release(e, hot[i]));
}

/* One step of a mix where protected reuse wins (at DEV 16, a period of
 * 48 accesses; a step is 2.5 accesses): twelve hot blocks, each read
 * twice in a row every 48 steps (120 accesses: past the period, but the
 * pair itself is a reuse within it), among new blocks each read again 24
 * steps (60 accesses) later, then never. The dead re-read blocks have a
 * more recent second last access than a hot block near its next pair, so
 * LRU-2 evicts the hot block first and misses the pair's first read;
 * plain LRU loses the hot set to the stream; the reuse order protects it
 * (its pair was a short reuse) and ranks the re-read blocks (a long one)
 * below it. */
enum { HOT = 12 };

static void reuse_step(kvh_engine *e, ring *r, const kvh_block *hot, uint64_t step)
{
    if (step % 4 == 0) {
        touch(e, hot[(step / 4) % HOT]);
        touch(e, hot[(step / 4) % HOT]);
    }
    push(e, r);
    if (r->n > 24)
        touch(e, back(r, 24));
}

/* An adaptive engine driven by reuse_step until the reuse order is in
 * force; *step is the next step. */
static kvh_engine *open_until_reuse_leads(ring *r, kvh_block *hot, uint64_t *step)
{
    kvh_config c = tu_cfg(1, 1, 4, 1, KVH_DTYPE_F32, DEV, HOST, 0);
    c.eviction_policy = KVH_EVICT_ADAPTIVE;
    kvh_engine *e = tu_open_cfg(&c);
    for (int i = 0; i < HOT; i++)
        assert_ok(kvh_block_alloc(e, 0, &hot[i]));
    for (*step = 0; *step < 20000 && e->adapt.order != KVHI_ADAPT_REUSE; (*step)++)
        reuse_step(e, r, hot, *step);
    assert_int_equal(e->adapt.order, KVHI_ADAPT_REUSE);
    return e;
}

static void test_reuse_order_takes_over_and_yields(void **state)
{
    (void)state;
    ring r = {.n = 0};
    kvh_block hot[HOT];
    uint64_t step = 0;
    kvh_engine *e = open_until_reuse_leads(&r, hot, &step);
    check_victim(e, 0);
    /* It stays while the mix lasts: its lead is real, not noise. */
    uint64_t switches = e->adapt.switches;
    for (uint64_t end = step + 4000; step < end; step++)
        reuse_step(e, &r, hot, step);
    assert_int_equal(e->adapt.order, KVHI_ADAPT_REUSE);
    assert_int_equal(e->adapt.switches, switches);
    assert_true(e->adapt.hits[KVHI_ADAPT_REUSE] > e->adapt.hits[KVHI_ADAPT_LRU_K]);
    assert_true(e->adapt.hits[KVHI_ADAPT_REUSE] > e->adapt.hits[KVHI_ADAPT_LRU]);
    check_victim(e, 0);

    /* Back to plain LRU when each new block is read again four steps
     * later: the reuse order, like LRU-K, evicts the newcomers first. */
    for (int i = 0; i < HOT; i++)
        assert_ok(kvh_block_release(e, hot[i]));
    for (int s = 0; s < 20000 && e->adapt.order != KVHI_ADAPT_LRU; s++) {
        push(e, &r);
        touch(e, back(&r, 4));
    }
    assert_int_equal(e->adapt.order, KVHI_ADAPT_LRU);
    check_victim(e, 1);
}

/* Under the reuse order an access after a long gap lowers a block's key:
 * its heap entries must take it at once, or the victim would no longer
 * be the minimum of the current keys. */
static void test_reuse_order_lowered_key_is_taken(void **state)
{
    (void)state;
    ring r = {.n = 0};
    kvh_block hot[HOT];
    uint64_t step = 0;
    kvh_engine *e = open_until_reuse_leads(&r, hot, &step);
    /* A hot block is protected after its pair; read it once more past the
     * period: unprotected, its key falls below the other hot blocks'. */
    uint32_t b0 = index_of(e, hot[0]);
    while ((step / 4) % HOT != 1 || step % 4 != 0)
        reuse_step(e, &r, hot, step++);
    for (uint64_t end = step + 24; step < end; step++) /* 60 accesses */
        reuse_step(e, &r, hot, step);
    /* Every stored key current (as a switch leaves them), hot block 0's
     * protected: lazy raises alone would keep lower bounds. Asserts come
     * after the unlock: a failed one must not leave the lock held. */
    pthread_mutex_lock(&e->lock);
    for (uint32_t t = 0; t < KVH_TIER_COUNT; t++)
        if (e->tiers[t].present)
            kvhi_lruk_rekey(&e->tiers[t].heap, kvhi_block_current_key, e);
    bool was_protected = (kvhi_block_current_key(e, b0).primary & (1ull << 61)) != 0;
    pthread_mutex_unlock(&e->lock);
    assert_true(was_protected);
    touch(e, hot[0]);
    pthread_mutex_lock(&e->lock);
    const kvhi_block *blk = &e->blocks[b0];
    bool long_gap = blk->hist[0] - blk->hist[1] > e->adapt.reuse_period;
    kvhi_lruk_key now = kvhi_block_current_key(e, b0);
    const kvhi_lruk_key *stored = kvhi_lruk_stored_key(&e->tiers[blk->tier].heap, b0);
    kvhi_lruk_key stored_key = stored ? *stored : now;
    pthread_mutex_unlock(&e->lock);
    assert_true(long_gap);
    assert_int_equal(now.primary & (1ull << 61), 0);
    /* In its tier's order (not pending): the lowered key, stored. */
    assert_true(stored != NULL);
    assert_false(kvhi_lruk_less(&now, &stored_key));
    check_victim(e, 0);
    for (int i = 0; i < HOT; i++)
        assert_ok(kvh_block_release(e, hot[i]));
}

/* With K = 1 there is no reuse interval: only LRU and LRU-K (equal) are
 * simulated, and the reuse order is never chosen. */
static void test_reuse_order_needs_two_accesses(void **state)
{
    (void)state;
    kvh_config c = tu_cfg(1, 1, 4, 1, KVH_DTYPE_F32, DEV, HOST, 0);
    c.eviction_policy = KVH_EVICT_ADAPTIVE;
    c.lru_k = 1;
    kvh_engine *e = tu_open_cfg(&c);
    assert_int_equal(e->adapt.n_orders, KVHI_ADAPT_REUSE);
    ring r = {.n = 0};
    kvh_block hot[HOT];
    for (int i = 0; i < HOT; i++)
        assert_ok(kvh_block_alloc(e, 0, &hot[i]));
    for (uint64_t step = 0; step < 6000; step++)
        reuse_step(e, &r, hot, step);
    assert_int_not_equal(e->adapt.order, KVHI_ADAPT_REUSE);
    assert_int_equal(e->adapt.hits[KVHI_ADAPT_REUSE], 0);
    check_victim(e, 0);
    for (int i = 0; i < HOT; i++)
        assert_ok(kvh_block_release(e, hot[i]));
}

/* The default; an explicit LRU-K never runs the shadows (old tables stay
 * reproducible), and an unknown policy value is refused. */
/* Accesses the decay period still counts, the inline path's included. */
static uint64_t decay_left_now(const kvhi_adapt *a) { return a->decay_left + a->fast_left; }

/* On a tier large enough to be sampled, most accesses take the inline
 * path, which counts them in fast_left alone: the decay period still
 * ends on exactly every decay_every-th access, sampled or not, and the
 * hits halve there. */
static void test_inline_accesses_count_into_the_periods(void **state)
{
    (void)state;
    enum { BIG = 4096 };
    kvh_config c = tu_cfg(1, 1, 4, 1, KVH_DTYPE_F32, BIG, 0, 0);
    c.eviction_policy = KVH_EVICT_ADAPTIVE;
    kvh_engine *e = tu_open_cfg(&c);
    kvhi_adapt *a = &e->adapt;
    assert_true(a->on);
    assert_true(a->shift > 0); /* a sample, not every block */
    kvh_block *blocks = tu_alloc(sizeof(kvh_block) * BIG);
    uint64_t accesses = 0, inline_seen = 0, decays = 0;
    for (uint32_t i = 0; i < BIG; i++) {
        assert_ok(kvh_block_alloc(e, 0, &blocks[i]));
        accesses++;
    }
    /* Unsampled blocks, so that the slow path runs where the countdown
     * ends (and for one sampled block now and then). */
    uint32_t n_plain = 0;
    kvh_block one_sampled = {0};
    for (uint32_t i = 0; i < BIG; i++) {
        if (kvhi_adapt_sampled(a, index_of(e, blocks[i])))
            one_sampled = blocks[i];
        else
            blocks[n_plain++] = blocks[i];
    }
    assert_true(n_plain > BIG / 4 && n_plain < BIG);
    tu_rng r = {tu_seed(0xdeca)};
    uint64_t every = a->decay_every;
    int64_t lru_hits = a->hits[KVHI_ADAPT_LRU];
    while (accesses < every + every / 2) {
        uint64_t before = decay_left_now(a);
        uint64_t fast_before = a->fast_left;
        touch(e, tu_below(&r, 97) ? blocks[tu_below(&r, n_plain)] : one_sampled);
        accesses++;
        inline_seen += a->fast_left + 1 == fast_before;
        assert_int_equal(decay_left_now(a), every - accesses % every);
        if (before == 1) {
            decays++;
            /* Halved (the access itself may have added one). */
            assert_true(a->hits[KVHI_ADAPT_LRU] <= lru_hits - lru_hits / 2 + 1);
        }
        lru_hits = a->hits[KVHI_ADAPT_LRU];
    }
    assert_int_equal(decays, 1);
    assert_true(inline_seen > every / 2);
}

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
        cmocka_unit_test_teardown(test_reuse_order_takes_over_and_yields, tu_teardown),
        cmocka_unit_test_teardown(test_reuse_order_lowered_key_is_taken, tu_teardown),
        cmocka_unit_test_teardown(test_reuse_order_needs_two_accesses, tu_teardown),
        cmocka_unit_test_teardown(test_inline_accesses_count_into_the_periods, tu_teardown),
        cmocka_unit_test_teardown(test_default_and_explicit_lru_k, tu_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
