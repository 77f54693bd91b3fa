/* core/lruk.h: indexed LRU-K eviction heap. */
#include "test_util.h"

#include "core/lruk.h"

/* Items keep their heap position inside a larger record, as blocks do. */
typedef struct item {
    uint64_t before;
    uint32_t pos;
    uint32_t after;
    uint64_t hist[4];
} item;

static int key_eq(const kvhi_lruk_key *a, const kvhi_lruk_key *b)
{
    return a->primary == b->primary && a->secondary == b->secondary;
}

/* Full structural check against the reference (present[], keys[]). */
static void check_heap(const kvhi_lruk_heap *h, const item *items, const uint8_t *present, const kvhi_lruk_key *keys,
                       uint32_t n_items)
{
    uint32_t count = 0;
    for (uint32_t i = 0; i < n_items; i++) {
        if (present[i]) {
            count++;
            assert_true(items[i].pos < h->size);
            assert_int_equal(h->entries[items[i].pos].item, i);
            assert_true(key_eq(&h->entries[items[i].pos].key, &keys[i]));
        } else {
            assert_int_equal(items[i].pos, KVHI_HEAP_NONE);
        }
        /* Neighbouring fields are never touched. */
        assert_int_equal(items[i].before, 0x1111111111111111ull);
        assert_int_equal(items[i].after, 0x22222222u);
    }
    assert_int_equal(h->size, count);
    for (uint32_t i = 1; i < h->size; i++)
        assert_false(kvhi_lruk_less(&h->entries[i].key, &h->entries[(i - 1) / KVHI_LRUK_ARITY].key));
    /* The top is a minimum of the reference. */
    if (count == 0) {
        assert_int_equal(kvhi_lruk_top(h), KVHI_HEAP_NONE);
        assert_null(kvhi_lruk_top_key(h));
        return;
    }
    const kvhi_lruk_key *min = NULL;
    for (uint32_t i = 0; i < n_items; i++)
        if (present[i] && (!min || kvhi_lruk_less(&keys[i], min)))
            min = &keys[i];
    uint32_t top = kvhi_lruk_top(h);
    assert_true(top < n_items && present[top]);
    assert_true(key_eq(&keys[top], min));
    assert_true(key_eq(kvhi_lruk_top_key(h), min));
}

static void init_items(item *items, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        memset(&items[i], 0, sizeof(items[i]));
        items[i].before = 0x1111111111111111ull;
        items[i].after = 0x22222222u;
        items[i].pos = KVHI_HEAP_NONE;
    }
}

static void test_random_against_brute_force(void **state)
{
    (void)state;
    enum { N = 300 };
    uint64_t seed = tu_seed(0x1c0ffee);
    tu_rng r = {seed};
    item *items = tu_alloc(sizeof(item) * N);
    uint8_t *present = tu_alloc(N);
    kvhi_lruk_key *keys = tu_alloc(sizeof(kvhi_lruk_key) * N);
    init_items(items, N);
    kvhi_lruk_heap h;
    assert_int_equal(kvhi_lruk_init(&h, N, &items[0].pos, sizeof(item)), 0);
    check_heap(&h, items, present, keys, N);
    for (int op = 0; op < 20000; op++) {
        uint32_t it = (uint32_t)tu_below(&r, N);
        uint32_t what = (uint32_t)tu_below(&r, 10);
        if (what < 6) {
            /* Small key ranges make ties (equal primaries / equal keys) common. */
            kvhi_lruk_key k = {tu_below(&r, 40) | (tu_below(&r, 2) << 63), tu_below(&r, 40)};
            kvhi_lruk_upsert(&h, it, k);
            keys[it] = k;
            present[it] = 1;
        } else if (what < 9) {
            kvhi_lruk_remove(&h, it);
            present[it] = 0;
        } else {
            /* Remove the top, as eviction does. */
            uint32_t top = kvhi_lruk_top(&h);
            if (top != KVHI_HEAP_NONE) {
                kvhi_lruk_remove(&h, top);
                present[top] = 0;
            }
        }
        check_heap(&h, items, present, keys, N);
    }
    /* Draining yields keys in non-decreasing order. */
    kvhi_lruk_key prev = {0, 0};
    int first = 1;
    while (kvhi_lruk_top(&h) != KVHI_HEAP_NONE) {
        uint32_t top = kvhi_lruk_top(&h);
        if (!first)
            assert_false(kvhi_lruk_less(&keys[top], &prev));
        prev = keys[top];
        first = 0;
        kvhi_lruk_remove(&h, top);
        present[top] = 0;
    }
    check_heap(&h, items, present, keys, N);
    kvhi_lruk_destroy(&h);
}

/* Upsert of a present item to a larger and to a smaller key (sift down/up). */
static void test_update_moves_both_ways(void **state)
{
    (void)state;
    enum { N = 64 };
    item *items = tu_alloc(sizeof(item) * N);
    uint8_t *present = tu_alloc(N);
    kvhi_lruk_key *keys = tu_alloc(sizeof(kvhi_lruk_key) * N);
    init_items(items, N);
    kvhi_lruk_heap h;
    assert_int_equal(kvhi_lruk_init(&h, N, &items[0].pos, sizeof(item)), 0);
    for (uint32_t i = 0; i < N; i++) {
        keys[i] = (kvhi_lruk_key){100 + i, 0};
        present[i] = 1;
        kvhi_lruk_upsert(&h, i, keys[i]);
    }
    check_heap(&h, items, present, keys, N);
    assert_int_equal(kvhi_lruk_top(&h), 0);
    keys[0] = (kvhi_lruk_key){1000, 0}; /* top becomes the largest */
    kvhi_lruk_upsert(&h, 0, keys[0]);
    check_heap(&h, items, present, keys, N);
    assert_int_equal(kvhi_lruk_top(&h), 1);
    keys[N - 1] = (kvhi_lruk_key){5, 0}; /* a leaf becomes the smallest */
    kvhi_lruk_upsert(&h, N - 1, keys[N - 1]);
    check_heap(&h, items, present, keys, N);
    assert_int_equal(kvhi_lruk_top(&h), N - 1);
    /* Same primary: the secondary decides. */
    keys[7] = (kvhi_lruk_key){5, 0};
    keys[N - 1] = (kvhi_lruk_key){5, 1};
    kvhi_lruk_upsert(&h, 7, keys[7]);
    kvhi_lruk_upsert(&h, N - 1, keys[N - 1]);
    check_heap(&h, items, present, keys, N);
    assert_int_equal(kvhi_lruk_top(&h), 7);
    /* Removing an absent item is a no-op. */
    kvhi_lruk_remove(&h, 7);
    present[7] = 0;
    kvhi_lruk_remove(&h, 7);
    check_heap(&h, items, present, keys, N);
    kvhi_lruk_destroy(&h);
}

#define KVHI_MAX_K_TEST 4

static kvhi_lruk_key key_after(const uint64_t *times, int n, uint32_t k, int referenced)
{
    uint64_t hist[KVHI_MAX_K_TEST] = {0};
    for (int i = 0; i < n; i++)
        kvhi_lruk_record(hist, k, times[i]);
    return kvhi_lruk_key_of(hist, k, referenced);
}
static void test_record_history(void **state)
{
    (void)state;
    uint64_t hist[4] = {0};
    kvhi_lruk_record(hist, 3, 5);
    assert_int_equal(hist[0], 5);
    assert_int_equal(hist[1], 0);
    kvhi_lruk_record(hist, 3, 9);
    kvhi_lruk_record(hist, 3, 12);
    kvhi_lruk_record(hist, 3, 20);
    assert_int_equal(hist[0], 20); /* most recent first */
    assert_int_equal(hist[1], 12);
    assert_int_equal(hist[2], 9);
    assert_int_equal(hist[3], 0); /* beyond k: untouched */
    kvhi_lruk_key key = kvhi_lruk_key_of(hist, 3, 0);
    assert_int_equal(key.primary, 9);    /* K-th most recent */
    assert_int_equal(key.secondary, 20); /* most recent */
    key = kvhi_lruk_key_of(hist, 3, 1);
    assert_int_equal(key.primary, 9 | (1ull << 63));
}

static void test_lru_k_semantics(void **state)
{
    (void)state;
    const uint32_t K = 2;
    /* A: one access, very recent. B: two old accesses. */
    uint64_t ta[] = {100};
    uint64_t tb[] = {1, 2};
    kvhi_lruk_key a = key_after(ta, 1, K, 0), b = key_after(tb, 2, K, 0);
    /* Fewer than K accesses: infinite backward K-distance, evicted first
     * even though it is the most recently used. */
    assert_true(kvhi_lruk_less(&a, &b));
    /* Two blocks with < K accesses: the less recent goes first. */
    uint64_t tc[] = {50};
    kvhi_lruk_key c = key_after(tc, 1, K, 0);
    assert_true(kvhi_lruk_less(&c, &a));
    /* Two blocks with K accesses: ordered by the K-th most recent access,
     * not the last one. D = {10, 200}, E = {20, 30}: D's 2nd most recent is
     * older, so D goes first though it was used last. */
    uint64_t td[] = {10, 200}, te[] = {20, 30};
    kvhi_lruk_key d = key_after(td, 2, K, 0), e = key_after(te, 2, K, 0);
    assert_true(kvhi_lruk_less(&d, &e));
    /* Unreferenced before referenced, whatever the history. */
    kvhi_lruk_key hot_unref = key_after((uint64_t[]){1000, 1001, 1002}, 3, K, 0);
    kvhi_lruk_key cold_ref = key_after((uint64_t[]){1}, 1, K, 1);
    assert_true(kvhi_lruk_less(&hot_unref, &cold_ref));
    kvhi_lruk_key a_ref = key_after(ta, 1, K, 1), b_ref = key_after(tb, 2, K, 1);
    assert_true(kvhi_lruk_less(&a_ref, &b_ref)); /* same rules within the class */
    /* K = 1 is plain LRU. */
    kvhi_lruk_key a1 = key_after(ta, 1, 1, 0), b1 = key_after(tb, 2, 1, 0);
    assert_true(kvhi_lruk_less(&b1, &a1));
    /* K = 4 needs four accesses to leave the "infinite" group. */
    uint64_t t3[] = {1, 2, 3}, t4[] = {10, 11, 12, 13};
    kvhi_lruk_key k3 = key_after(t3, 3, 4, 0), k4 = key_after(t4, 4, 4, 0);
    assert_true(kvhi_lruk_less(&k3, &k4));
}

/* Victim order of a simulated cache: draining the heap gives exactly the
 * brute-force order (class, K-th access, last access). */
static void test_victim_order_simulation(void **state)
{
    (void)state;
    enum { N = 200 };
    const uint32_t K = 2;
    tu_rng r = {tu_seed(77)};
    item *items = tu_alloc(sizeof(item) * N);
    uint8_t *ref = tu_alloc(N);
    init_items(items, N);
    kvhi_lruk_heap h;
    assert_int_equal(kvhi_lruk_init(&h, N, &items[0].pos, sizeof(item)), 0);
    uint64_t clock = 0;
    for (uint32_t i = 0; i < N; i++) {
        kvhi_lruk_record(items[i].hist, K, ++clock);
        kvhi_lruk_upsert(&h, i, kvhi_lruk_key_of(items[i].hist, K, 0));
    }
    for (int a = 0; a < 3000; a++) {
        uint32_t i = (uint32_t)tu_below(&r, N / 2) * (tu_below(&r, 3) ? 1 : 2) % N; /* skewed */
        kvhi_lruk_record(items[i].hist, K, ++clock);
        if (tu_below(&r, 20) == 0)
            ref[i] ^= 1;
        kvhi_lruk_upsert(&h, i, kvhi_lruk_key_of(items[i].hist, K, ref[i]));
    }
    uint8_t *done = tu_alloc(N);
    for (uint32_t n = 0; n < N; n++) {
        /* brute-force victim */
        int best = -1;
        for (uint32_t i = 0; i < N; i++) {
            if (done[i])
                continue;
            if (best < 0) {
                best = (int)i;
                continue;
            }
            const item *x = &items[i], *y = &items[best];
            int cx = ref[i], cy = ref[best];
            if (cx != cy) {
                if (cx < cy)
                    best = (int)i;
                continue;
            }
            if (x->hist[K - 1] != y->hist[K - 1]) {
                if (x->hist[K - 1] < y->hist[K - 1])
                    best = (int)i;
                continue;
            }
            if (x->hist[0] < y->hist[0])
                best = (int)i;
        }
        uint32_t top = kvhi_lruk_top(&h);
        assert_int_equal(top, (uint32_t)best);
        kvhi_lruk_remove(&h, top);
        done[top] = 1;
    }
    assert_int_equal(kvhi_lruk_top(&h), KVHI_HEAP_NONE);
    kvhi_lruk_destroy(&h);
}

/* Current keys for the lazy tests: items[i].hist with K = 2, class bit
 * from ref[] (what the engine derives from a block's record). */
typedef struct lazy_ctx {
    item *items;
    uint8_t *ref;
} lazy_ctx;

static kvhi_lruk_key lazy_current(void *ctx, uint32_t i)
{
    lazy_ctx *c = ctx;
    return kvhi_lruk_key_of(c->items[i].hist, 2, c->ref[i]);
}

/* Index of the least current key among the items not yet removed. */
static uint32_t lazy_brute_min(lazy_ctx *c, const uint8_t *gone, uint32_t n)
{
    uint32_t best = UINT32_MAX;
    kvhi_lruk_key bk = {0, 0};
    for (uint32_t i = 0; i < n; i++) {
        if (gone[i])
            continue;
        kvhi_lruk_key k = lazy_current(c, i);
        if (best == UINT32_MAX || kvhi_lruk_less(&k, &bk)) {
            best = i;
            bk = k;
        }
    }
    return best;
}

static void test_lazy_raise_keeps_exact_victims(void **state)
{
    (void)state;
    enum { N = 300 };
    tu_rng r = {tu_seed(91)};
    item *items = tu_alloc(sizeof(item) * N);
    uint8_t *ref = tu_alloc(N), *gone = tu_alloc(N);
    init_items(items, N);
    lazy_ctx c = {items, ref};
    kvhi_lruk_heap h;
    assert_int_equal(kvhi_lruk_init(&h, N, &items[0].pos, sizeof(item)), 0);
    uint64_t clock = 0;
    for (uint32_t i = 0; i < N; i++) {
        ref[i] = (uint8_t)tu_below(&r, 2);
        kvhi_lruk_record(items[i].hist, 2, ++clock);
        kvhi_lruk_upsert_lazy(&h, i, lazy_current(&c, i));
    }
    uint32_t live = N, stale_seen = 0;
    for (int step = 0; step < 20000 && live > 0; step++) {
        uint32_t i = (uint32_t)tu_below(&r, N);
        uint32_t what = (uint32_t)tu_below(&r, 40);
        if (gone[i]) {
            continue;
        } else if (what == 0) {
            /* Victim: the exact minimum of the current keys. */
            uint32_t want = lazy_brute_min(&c, gone, N);
            uint32_t top = kvhi_lruk_top_current(&h, lazy_current, &c);
            assert_int_equal(top, want);
            kvhi_lruk_key stored = *kvhi_lruk_top_key(&h), now = lazy_current(&c, top);
            assert_true(key_eq(&stored, &now));
            kvhi_lruk_remove(&h, top);
            gone[top] = 1;
            live--;
        } else if (what < 4) {
            /* Unreferenced now: the key drops, below the stored bound
             * when that was current, and the entry must follow at once. */
            kvhi_lruk_key before = lazy_current(&c, i);
            int was_current = key_eq(kvhi_lruk_stored_key(&h, i), &before);
            ref[i] = 0;
            kvhi_lruk_upsert_lazy(&h, i, lazy_current(&c, i));
            kvhi_lruk_key now = lazy_current(&c, i), stored = *kvhi_lruk_stored_key(&h, i);
            assert_false(kvhi_lruk_less(&now, &stored));
            if (was_current)
                assert_true(key_eq(&stored, &now));
        } else {
            /* An access (sometimes a new reference): a raise, deferred. */
            kvhi_lruk_key before = *kvhi_lruk_stored_key(&h, i);
            kvhi_lruk_record(items[i].hist, 2, ++clock);
            if (what < 8)
                ref[i] = 1;
            kvhi_lruk_upsert_lazy(&h, i, lazy_current(&c, i));
            assert_true(key_eq(kvhi_lruk_stored_key(&h, i), &before));
            stale_seen++;
        }
    }
    assert_true(stale_seen > 1000);
    /* Drain: every remaining victim in exact order. */
    while (live > 0) {
        uint32_t want = lazy_brute_min(&c, gone, N);
        uint32_t top = kvhi_lruk_top_current(&h, lazy_current, &c);
        assert_int_equal(top, want);
        kvhi_lruk_remove(&h, top);
        gone[top] = 1;
        live--;
    }
    assert_int_equal(kvhi_lruk_top_current(&h, lazy_current, &c), KVHI_HEAP_NONE);
    kvhi_lruk_destroy(&h);
}

/* Allocation churn through the arrival queue: items arrive with the
 * newest key (most join the queue), are raised, dropped to the
 * unreferenced class, freed in any order and re-admitted, so the ring
 * wraps and squeezes its holes out; every victim is still the exact
 * minimum of the current keys. */
static void test_arrival_queue_churn(void **state)
{
    (void)state;
    enum { N = 200 };
    tu_rng r = {tu_seed(0xa11c)};
    item *items = tu_alloc(sizeof(item) * N);
    uint8_t *ref = tu_alloc(N), *gone = tu_alloc(N);
    init_items(items, N);
    lazy_ctx c = {items, ref};
    kvhi_lruk_heap h;
    assert_int_equal(kvhi_lruk_init(&h, N, &items[0].pos, sizeof(item)), 0);
    uint64_t clock = 0;
    uint32_t queued_seen = 0;
    for (uint32_t i = 0; i < N; i++)
        gone[i] = 1;
    for (int step = 0; step < 60000; step++) {
        uint32_t i = (uint32_t)tu_below(&r, N);
        uint32_t what = (uint32_t)tu_below(&r, 20);
        if (gone[i]) {
            /* A new block: a fresh history, referenced, the newest key. */
            memset(items[i].hist, 0, sizeof(items[i].hist));
            ref[i] = 1;
            kvhi_lruk_record(items[i].hist, 2, ++clock);
            kvhi_lruk_upsert_lazy(&h, i, lazy_current(&c, i));
            gone[i] = 0;
            queued_seen += (items[i].pos & KVHI_LRUK_QUEUED) != 0;
        } else if (what < 6) {
            kvhi_lruk_remove(&h, i);
            assert_int_equal(items[i].pos, KVHI_HEAP_NONE);
            gone[i] = 1;
        } else if (what < 8) {
            ref[i] = 0;
            kvhi_lruk_upsert_lazy(&h, i, lazy_current(&c, i));
            kvhi_lruk_key now = lazy_current(&c, i);
            assert_false(kvhi_lruk_less(&now, kvhi_lruk_stored_key(&h, i)));
        } else if (what < 10) {
            uint32_t want = lazy_brute_min(&c, gone, N);
            uint32_t top = kvhi_lruk_top_current(&h, lazy_current, &c);
            assert_int_equal(top, want);
            if (top != KVHI_HEAP_NONE) {
                assert_int_equal(kvhi_lruk_top(&h), top);
                kvhi_lruk_remove(&h, top);
                gone[top] = 1;
            }
        } else {
            kvhi_lruk_record(items[i].hist, 2, ++clock);
            kvhi_lruk_upsert_lazy(&h, i, lazy_current(&c, i));
        }
        uint32_t live = 0;
        for (uint32_t k = 0; k < N; k++)
            live += !gone[k];
        assert_int_equal(kvhi_lruk_count(&h), live);
    }
    assert_true(queued_seen > 1000);
    for (;;) {
        uint32_t want = lazy_brute_min(&c, gone, N);
        uint32_t top = kvhi_lruk_top_current(&h, lazy_current, &c);
        assert_int_equal(top, want);
        if (top == KVHI_HEAP_NONE)
            break;
        kvhi_lruk_remove(&h, top);
        gone[top] = 1;
    }
    assert_int_equal(kvhi_lruk_count(&h), 0);
    kvhi_lruk_destroy(&h);
}

/* The inline arrival and removal (kvhi_lruk_insert_lazy,
 * kvhi_lruk_remove_present: a shadow's in core/adaptive.c) leave the heap
 * exactly as upsert_lazy and remove do: two heaps driven alike, one each
 * way, match entry for entry, through queue appends, out-of-order
 * arrivals (heap), removals inside the queue, at its ends and from the
 * heap, wraps of the ring and squeezes. */
static void test_inline_arrival_and_removal_match(void **state)
{
    (void)state;
    enum { N = 64 };
    tu_rng r = {tu_seed(0x5ad0)};
    item *ref_items = tu_alloc(sizeof(item) * N), *fast_items = tu_alloc(sizeof(item) * N);
    uint8_t *present = tu_alloc(N);
    init_items(ref_items, N);
    init_items(fast_items, N);
    kvhi_lruk_heap ref, fast;
    assert_int_equal(kvhi_lruk_init(&ref, N, &ref_items[0].pos, sizeof(item)), 0);
    assert_int_equal(kvhi_lruk_init(&fast, N, &fast_items[0].pos, sizeof(item)), 0);
    uint64_t clock = 1000;
    uint32_t inside = 0, queued = 0;
    for (int step = 0; step < 40000; step++) {
        uint32_t i = (uint32_t)tu_below(&r, N);
        if (!present[i]) {
            /* Mostly the newest key, as an allocation's; sometimes an old
             * one, which cannot join the queue's back. */
            uint64_t t = tu_below(&r, 8) ? ++clock : clock - tu_below(&r, 500);
            kvhi_lruk_key key = {.primary = t, .secondary = t};
            kvhi_lruk_upsert_lazy(&ref, i, key);
            kvhi_lruk_insert_lazy(&fast, i, key);
            present[i] = 1;
            queued += (fast_items[i].pos & KVHI_LRUK_QUEUED) != 0;
        } else {
            uint32_t p = fast_items[i].pos;
            inside += (p & KVHI_LRUK_QUEUED) && (p & ~KVHI_LRUK_QUEUED) != fast.q_head;
            kvhi_lruk_remove(&ref, i);
            kvhi_lruk_remove_present(&fast, i);
            present[i] = 0;
        }
        assert_int_equal(fast.size, ref.size);
        assert_int_equal(fast.q_head, ref.q_head);
        assert_int_equal(fast.q_len, ref.q_len);
        assert_int_equal(fast.q_live, ref.q_live);
        for (uint32_t k = 0; k < N; k++)
            assert_int_equal(fast_items[k].pos, ref_items[k].pos);
        for (uint32_t k = 0; k < ref.size; k++) {
            assert_int_equal(fast.entries[k].item, ref.entries[k].item);
            assert_true(key_eq(&fast.entries[k].key, &ref.entries[k].key));
        }
        for (uint32_t k = 0; k < ref.q_len; k++) {
            uint32_t at = (ref.q_head + k) % ref.q_cap;
            assert_int_equal(fast.queue[at].item, ref.queue[at].item);
            if (ref.queue[at].item != KVHI_HEAP_NONE)
                assert_true(key_eq(&fast.queue[at].key, &ref.queue[at].key));
        }
    }
    assert_true(queued > 1000);
    assert_true(inside > 1000);
    kvhi_lruk_destroy(&ref);
    kvhi_lruk_destroy(&fast);
}

/* What the engine does on any change of an item (kvhi_block_update_
 * evictable): an item not present goes pending, a pending one stays so,
 * any other takes its key lazily. */
static void pending_update(kvhi_lruk_heap *h, lazy_ctx *c, uint32_t i)
{
    uint32_t p = c->items[i].pos;
    if (p != KVHI_HEAP_NONE && (p & KVHI_LRUK_PENDING))
        return;
    if (p == KVHI_HEAP_NONE && kvhi_lruk_add_pending(h, i))
        return;
    kvhi_lruk_upsert_lazy(h, i, lazy_current(c, i));
}

/* Items that arrive pending are keyed only when a victim is chosen (or
 * the order re-keyed), with the keys they have then: the victims are
 * still the exact minimum of the current keys, whatever happened to a
 * key while pending (raised, dropped a class), and pending items freed
 * unchosen leave holes that wrap and squeeze out of the ring. */
static void test_pending_arrivals_churn(void **state)
{
    (void)state;
    enum { N = 150 };
    tu_rng r = {tu_seed(0x9e4d)};
    item *items = tu_alloc(sizeof(item) * N);
    uint8_t *ref = tu_alloc(N), *gone = tu_alloc(N);
    init_items(items, N);
    lazy_ctx c = {items, ref};
    kvhi_lruk_heap h;
    assert_int_equal(kvhi_lruk_init(&h, N, &items[0].pos, sizeof(item)), 0);
    assert_int_equal(kvhi_lruk_add_pending(&h, 0), 0); /* no ring yet: declined, untouched */
    assert_int_equal(items[0].pos, KVHI_HEAP_NONE);
    assert_int_equal(kvhi_lruk_enable_pending(&h, &(uint32_t){0}), 0);
    uint64_t clock = 0;
    uint32_t pending_seen = 0, freed_pending = 0, victims = 0;
    for (uint32_t i = 0; i < N; i++)
        gone[i] = 1;
    for (int step = 0; step < 80000; step++) {
        uint32_t i = (uint32_t)tu_below(&r, N);
        uint32_t what = (uint32_t)tu_below(&r, 40);
        if (gone[i]) {
            memset(items[i].hist, 0, sizeof(items[i].hist));
            ref[i] = 1;
            kvhi_lruk_record(items[i].hist, 2, ++clock);
            pending_update(&h, &c, i);
            assert_true(items[i].pos & KVHI_LRUK_PENDING);
            assert_null(kvhi_lruk_stored_key(&h, i));
            gone[i] = 0;
            pending_seen++;
        } else if (what < 14) {
            freed_pending += (items[i].pos & KVHI_LRUK_PENDING) != 0;
            kvhi_lruk_remove(&h, i);
            assert_int_equal(items[i].pos, KVHI_HEAP_NONE);
            gone[i] = 1;
        } else if (what < 18) {
            ref[i] = 0;
            pending_update(&h, &c, i);
        } else if (what < 20) {
            uint32_t want = lazy_brute_min(&c, gone, N);
            uint32_t top = kvhi_lruk_top_current(&h, lazy_current, &c);
            assert_int_equal(top, want);
            assert_int_equal(h.p_live, 0);
            /* Drained: every stored key is a lower bound of its current one. */
            for (uint32_t k = 0; k < N; k++)
                if (!gone[k]) {
                    kvhi_lruk_key now = lazy_current(&c, k);
                    assert_false(kvhi_lruk_less(&now, kvhi_lruk_stored_key(&h, k)));
                }
            if (top != KVHI_HEAP_NONE) {
                kvhi_lruk_key now = lazy_current(&c, top);
                assert_true(key_eq(kvhi_lruk_stored_key(&h, top), &now));
                kvhi_lruk_remove(&h, top);
                gone[top] = 1;
                victims++;
            }
        } else if (what == 20) {
            for (uint32_t k = 0; k < N; k++)
                if (!gone[k] && tu_below(&r, 2))
                    ref[k] = (uint8_t)!ref[k]; /* a new order: either way */
            kvhi_lruk_rekey(&h, lazy_current, &c);
            assert_int_equal(h.p_live, 0);
        } else {
            kvhi_lruk_record(items[i].hist, 2, ++clock);
            pending_update(&h, &c, i);
        }
        uint32_t live = 0;
        for (uint32_t k = 0; k < N; k++)
            live += !gone[k];
        assert_int_equal(kvhi_lruk_count(&h), live);
    }
    assert_true(pending_seen > 5000 && freed_pending > 500 && victims > 1000);
    for (;;) {
        uint32_t want = lazy_brute_min(&c, gone, N);
        uint32_t top = kvhi_lruk_top_current(&h, lazy_current, &c);
        assert_int_equal(top, want);
        if (top == KVHI_HEAP_NONE)
            break;
        kvhi_lruk_remove(&h, top);
        gone[top] = 1;
    }
    assert_int_equal(kvhi_lruk_count(&h), 0);
    kvhi_lruk_destroy(&h);
}

/* The pending-ring tests' set-up: n items, none present, and a heap over
 * them with a ring at ring position 0. */
typedef struct pending_fixture {
    item *items;
    uint8_t *ref, *gone;
    lazy_ctx c;
    kvhi_lruk_heap h;
} pending_fixture;

static void pending_fixture_init(pending_fixture *f, uint32_t n)
{
    f->items = tu_alloc(sizeof(item) * n);
    f->ref = tu_alloc(n);
    f->gone = tu_alloc(n);
    init_items(f->items, n);
    f->c = (lazy_ctx){f->items, f->ref};
    assert_int_equal(kvhi_lruk_init(&f->h, n, &f->items[0].pos, sizeof(item)), 0);
    assert_int_equal(kvhi_lruk_enable_pending(&f->h, &(uint32_t){0}), 0);
}

/* A pending ring that fills with holes is squeezed, keeping the arrival
 * order, and its positions stay exact. */
static void test_pending_ring_squeeze(void **state)
{
    (void)state;
    enum { N = 64 };
    pending_fixture f;
    pending_fixture_init(&f, N);
    item *items = f.items;
    uint8_t *gone = f.gone;
    lazy_ctx c = f.c;
    kvhi_lruk_heap h = f.h;
    uint64_t clock = 0;
    /* Item 0 stays pending throughout; the others come and go behind it,
     * so its hole-free end never lets the ring trim. */
    kvhi_lruk_record(items[0].hist, 2, ++clock);
    assert_true(kvhi_lruk_add_pending(&h, 0));
    for (int round = 0; round < 50; round++)
        for (uint32_t i = 1; i < N; i++) {
            kvhi_lruk_record(items[i].hist, 2, ++clock);
            assert_true(kvhi_lruk_add_pending(&h, i));
            if (i % 2 == 0 || round < 49)
                kvhi_lruk_remove(&h, i);
        }
    assert_true(h.p_len <= h.p_cap);
    for (uint32_t i = 0; i < N; i++) {
        gone[i] = !(i == 0 || i % 2 == 1);
        if (!gone[i])
            assert_int_equal(h.pending[items[i].pos & ~KVHI_LRUK_PENDING], i);
        else
            assert_int_equal(items[i].pos, KVHI_HEAP_NONE);
    }
    for (uint32_t want; (want = lazy_brute_min(&c, gone, N)) != UINT32_MAX; gone[want] = 1) {
        assert_int_equal(kvhi_lruk_top_current(&h, lazy_current, &c), want);
        kvhi_lruk_remove(&h, want);
    }
    assert_int_equal(kvhi_lruk_count(&h), 0);
    kvhi_lruk_destroy(&h);
}

/* Items that leave the pending ring leave their entries there, stale: an
 * item that comes back is drained once, with its new key; a ring whose
 * items all left starts over at its next arrival without reading the
 * stale entries. */
static void test_pending_entries_go_stale(void **state)
{
    (void)state;
    enum { N = 8 };
    pending_fixture f;
    pending_fixture_init(&f, N);
    item *items = f.items;
    uint8_t *gone = f.gone;
    lazy_ctx c = f.c;
    kvhi_lruk_heap h = f.h;
    uint64_t clock = 0;
    for (uint32_t i = 0; i < 3; i++) {
        kvhi_lruk_record(items[i].hist, 2, ++clock);
        assert_true(kvhi_lruk_add_pending(&h, i));
    }
    /* Item 1 leaves and comes back behind item 2: two entries name it. */
    kvhi_lruk_remove(&h, 1);
    assert_int_equal(h.p_live, 2);
    assert_int_equal(h.p_len, 3);
    assert_false(kvhi_lruk_pending_live(&h, 1, 1));
    kvhi_lruk_record(items[1].hist, 2, ++clock);
    assert_true(kvhi_lruk_add_pending(&h, 1));
    assert_int_equal(h.p_len, 4);
    assert_true(kvhi_lruk_pending_live(&h, 3, 1));
    assert_int_equal(kvhi_lruk_count(&h), 3);
    /* Drained: three entries, item 1 once, last (its newest access). */
    for (uint32_t i = 0; i < N; i++)
        gone[i] = i >= 3;
    uint32_t order[3] = {0, 2, 1};
    for (int k = 0; k < 3; k++) {
        assert_int_equal(lazy_brute_min(&c, gone, N), order[k]);
        assert_int_equal(kvhi_lruk_top_current(&h, lazy_current, &c), order[k]);
        kvhi_lruk_remove(&h, order[k]);
        gone[order[k]] = 1;
        assert_int_equal(kvhi_lruk_count(&h), (uint32_t)(2 - k));
    }
    assert_int_equal(kvhi_lruk_top_current(&h, lazy_current, &c), KVHI_HEAP_NONE);

    /* All pending items leave: the next arrival starts the ring over. */
    for (uint32_t i = 0; i < 5; i++)
        assert_true(kvhi_lruk_add_pending(&h, i));
    for (uint32_t i = 0; i < 5; i++)
        kvhi_lruk_remove(&h, i);
    assert_int_equal(h.p_live, 0);
    assert_int_equal(kvhi_lruk_count(&h), 0);
    assert_true(kvhi_lruk_add_pending(&h, 6));
    assert_int_equal(h.p_head, 0);
    assert_int_equal(h.p_len, 1);
    assert_int_equal(items[6].pos, KVHI_LRUK_PENDING | 0);
    kvhi_lruk_rekey(&h, lazy_current, &c);
    assert_int_equal(kvhi_lruk_count(&h), 1);
    assert_int_equal(items[6].pos, 0);
    kvhi_lruk_destroy(&h);
}

/* Two heaps whose items keep one position field between them (a block's
 * tier heaps): an item that leaves one ring and waits in the other is
 * never taken for live by the entry it left stale, wherever the two
 * rings put it. */
static void test_pending_rings_sharing_positions(void **state)
{
    (void)state;
    enum { N = 8 };
    pending_fixture f;
    pending_fixture_init(&f, N);
    item *items = f.items;
    lazy_ctx c = f.c;
    kvhi_lruk_heap a = f.h, b;
    uint32_t next = a.p_cap;
    assert_int_equal(kvhi_lruk_init(&b, N, &items[0].pos, sizeof(item)), 0);
    assert_int_equal(kvhi_lruk_enable_pending(&b, &next), 0);
    assert_int_equal(b.p_base, a.p_cap);
    assert_int_equal(next, a.p_cap + b.p_cap);
    /* Item 3 waits at index 0 of a, moves to index 0 of b. */
    kvhi_lruk_record(items[3].hist, 2, 1);
    assert_true(kvhi_lruk_add_pending(&a, 3));
    kvhi_lruk_remove(&a, 3);
    assert_true(kvhi_lruk_add_pending(&b, 3));
    assert_false(kvhi_lruk_pending_live(&a, 0, 3));
    assert_true(kvhi_lruk_pending_live(&b, 0, 3));
    /* a keeps an item of its own, so its stale entry is read. */
    kvhi_lruk_record(items[5].hist, 2, 2);
    assert_true(kvhi_lruk_add_pending(&a, 5));
    assert_int_equal(kvhi_lruk_count(&a), 1);
    assert_int_equal(kvhi_lruk_top_current(&a, lazy_current, &c), 5);
    assert_int_equal(kvhi_lruk_count(&a), 1);
    kvhi_lruk_rekey(&a, lazy_current, &c);
    assert_int_equal(kvhi_lruk_count(&a), 1);
    assert_int_equal(items[5].pos, 0);
    /* 3 is still b's, pending, and leaves it cleanly. */
    assert_true(kvhi_lruk_pos_pending(&b, items[3].pos));
    assert_int_equal(kvhi_lruk_top_current(&b, lazy_current, &c), 3);
    kvhi_lruk_remove(&b, 3);
    assert_int_equal(kvhi_lruk_count(&b), 0);
    /* A range past the positions' room leaves a heap without a ring. */
    kvhi_lruk_heap big;
    uint32_t late = KVHI_LRUK_PENDING - 4;
    assert_int_equal(kvhi_lruk_init(&big, N, &items[0].pos, sizeof(item)), 0);
    assert_int_equal(kvhi_lruk_enable_pending(&big, &late), 0);
    assert_null(big.pending);
    assert_int_equal(late, KVHI_LRUK_PENDING - 4);
    assert_int_equal(kvhi_lruk_add_pending(&big, 6), 0);
    kvhi_lruk_destroy(&big);
    kvhi_lruk_destroy(&a);
    kvhi_lruk_destroy(&b);
}

/* A changed victim order: rekey gives every entry (heap and queue) its
 * new key and restores the heap, after which victims come in the new
 * order. */
static void test_rekey_to_a_new_order(void **state)
{
    (void)state;
    enum { N = 500 };
    tu_rng r = {tu_seed(0x5e4)};
    item *items = tu_alloc(sizeof(item) * N);
    uint8_t *ref = tu_alloc(N), *gone = tu_alloc(N);
    init_items(items, N);
    lazy_ctx c = {items, ref};
    kvhi_lruk_heap h;
    assert_int_equal(kvhi_lruk_init(&h, N, &items[0].pos, sizeof(item)), 0);
    uint64_t clock = 0;
    for (uint32_t i = 0; i < N; i++) {
        kvhi_lruk_record(items[i].hist, 2, ++clock);
        kvhi_lruk_upsert_lazy(&h, i, lazy_current(&c, i));
    }
    for (int k = 0; k < 2000; k++) {
        uint32_t i = (uint32_t)tu_below(&r, N);
        kvhi_lruk_record(items[i].hist, 2, ++clock);
    }
    /* The new order: ref[] flips the class of a random half (both ways). */
    for (uint32_t i = 0; i < N; i++)
        ref[i] = (uint8_t)tu_below(&r, 2);
    kvhi_lruk_rekey(&h, lazy_current, &c);
    assert_int_equal(kvhi_lruk_count(&h), N);
    assert_int_equal(h.q_len, 0);
    for (uint32_t i = 0; i < N; i++) {
        kvhi_lruk_key now = lazy_current(&c, i);
        assert_true(key_eq(kvhi_lruk_stored_key(&h, i), &now));
    }
    for (uint32_t left = N; left > 0; left--) {
        uint32_t want = lazy_brute_min(&c, gone, N);
        assert_int_equal(kvhi_lruk_top_current(&h, lazy_current, &c), want);
        kvhi_lruk_remove(&h, want);
        gone[want] = 1;
    }
    kvhi_lruk_destroy(&h);
}

/* Past 2 MiB of entries the heap lives in its own huge-page mapping, its
 * entries shifted so that sibling groups start on 32-byte boundaries: the
 * same invariants must hold there. */
static void test_large_heap(void **state)
{
    (void)state;
    enum { N = 150000 }; /* 3.6 MB of entries */
    tu_rng r = {tu_seed(0x1a26e)};
    item *items = tu_alloc(sizeof(item) * N);
    uint8_t *present = tu_alloc(N);
    kvhi_lruk_key *keys = tu_alloc(sizeof(kvhi_lruk_key) * N);
    init_items(items, N);
    kvhi_lruk_heap h;
    assert_int_equal(kvhi_lruk_init(&h, N, &items[0].pos, sizeof(item)), 0);
    assert_int_equal((uintptr_t)&h.entries[1] % 32, 0);
    for (uint32_t i = 0; i < N; i++) {
        keys[i] = (kvhi_lruk_key){tu_below(&r, 1000) | (tu_below(&r, 2) << 63), tu_below(&r, 1000)};
        present[i] = 1;
        kvhi_lruk_upsert(&h, i, keys[i]);
    }
    for (int op = 0; op < 200000; op++) {
        uint32_t it = (uint32_t)tu_below(&r, N);
        if (tu_below(&r, 4)) {
            keys[it] = (kvhi_lruk_key){tu_below(&r, 1000) | (tu_below(&r, 2) << 63), tu_below(&r, 1000)};
            present[it] = 1;
            kvhi_lruk_upsert(&h, it, keys[it]);
        } else {
            kvhi_lruk_remove(&h, it);
            present[it] = 0;
        }
    }
    check_heap(&h, items, present, keys, N);
    uint32_t live = 0, drained = 0;
    for (uint32_t i = 0; i < N; i++)
        live += present[i];
    kvhi_lruk_key prev = {0, 0};
    for (uint32_t top; (top = kvhi_lruk_top(&h)) != KVHI_HEAP_NONE; drained++) {
        assert_true(present[top]);
        assert_false(kvhi_lruk_less(&keys[top], &prev));
        prev = keys[top];
        kvhi_lruk_remove(&h, top);
        present[top] = 0;
    }
    assert_int_equal(drained, live);
    kvhi_lruk_destroy(&h);
}

static void test_empty_heap(void **state)
{
    (void)state;
    kvhi_lruk_heap h;
    uint32_t pos = KVHI_HEAP_NONE;
    assert_int_equal(kvhi_lruk_init(&h, 0, &pos, sizeof(pos)), 0);
    assert_int_equal(kvhi_lruk_top(&h), KVHI_HEAP_NONE);
    assert_null(kvhi_lruk_top_key(&h));
    kvhi_lruk_destroy(&h);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_random_against_brute_force, tu_teardown),
        cmocka_unit_test_teardown(test_update_moves_both_ways, tu_teardown),
        cmocka_unit_test_teardown(test_record_history, tu_teardown),
        cmocka_unit_test_teardown(test_lru_k_semantics, tu_teardown),
        cmocka_unit_test_teardown(test_victim_order_simulation, tu_teardown),
        cmocka_unit_test_teardown(test_lazy_raise_keeps_exact_victims, tu_teardown),
        cmocka_unit_test_teardown(test_arrival_queue_churn, tu_teardown),
        cmocka_unit_test_teardown(test_inline_arrival_and_removal_match, tu_teardown),
        cmocka_unit_test_teardown(test_pending_arrivals_churn, tu_teardown),
        cmocka_unit_test_teardown(test_pending_ring_squeeze, tu_teardown),
        cmocka_unit_test_teardown(test_pending_entries_go_stale, tu_teardown),
        cmocka_unit_test_teardown(test_pending_rings_sharing_positions, tu_teardown),
        cmocka_unit_test_teardown(test_rekey_to_a_new_order, tu_teardown),
        cmocka_unit_test_teardown(test_large_heap, tu_teardown),
        cmocka_unit_test_teardown(test_empty_heap, tu_teardown),
    };
    return cmocka_run_group_tests_name("lruk", tests, NULL, NULL);
}
