/* core/prefix_index.h: chained block hashes and the open-addressing index
 * (linear probing, backward-shift deletion). */
#include "test_util.h"

#include "core/prefix_index.h"

/* ---- the index against a reference ---- */

/* A multimap: one key may hold several values (blocks of different
 * prefixes with equal hashes); each (key, value) pair is stored once. */
typedef struct ref_map {
    uint64_t keys[1024];
    uint32_t vals[1024];
    uint32_t n;
} ref_map;

static int ref_find(const ref_map *m, uint64_t k, uint32_t v)
{
    for (uint32_t i = 0; i < m->n; i++)
        if (m->keys[i] == k && m->vals[i] == v)
            return (int)i;
    return -1;
}

static uint32_t ref_count(const ref_map *m, uint64_t k)
{
    uint32_t c = 0;
    for (uint32_t i = 0; i < m->n; i++)
        c += m->keys[i] == k;
    return c;
}

/* Linear-probing invariant: every key sits at its home or after it with no
 * empty slot in between; the table holds exactly the reference; and
 * kvhi_prefix_next gives each key's values, each once. */
static void check_table(const kvhi_prefix_index *ix, const ref_map *m)
{
    uint64_t cap = ix->mask + 1, stored = 0;
    for (uint64_t i = 0; i < cap; i++) {
        uint64_t k = ix->keys[i];
        if (!k)
            continue;
        stored++;
        assert_true(ref_find(m, k, ix->values[i]) >= 0);
        for (uint64_t j = k & ix->mask; j != i; j = (j + 1) & ix->mask)
            assert_true(ix->keys[j] != 0);
    }
    assert_int_equal(stored, m->n);
    assert_int_equal(ix->count, m->n);
    for (uint32_t i = 0; i < m->n; i++) {
        uint64_t pos = 0;
        uint32_t seen = 0, v, mine = 0;
        while ((v = kvhi_prefix_next(ix, m->keys[i], &pos)) != KVHI_PREFIX_MISS) {
            assert_true(ref_find(m, m->keys[i], v) >= 0);
            mine += v == m->vals[i];
            seen++;
        }
        assert_int_equal(mine, 1);
        assert_int_equal(seen, ref_count(m, m->keys[i]));
    }
}

/* Keys whose low bits (the home slot) fall in a few neighbouring values,
 * including the last slots so clusters wrap around the end. */
static uint64_t colliding_key(tu_rng *r, uint64_t mask)
{
    static const uint64_t homes[] = {0, 1, 2, 5};
    uint64_t home = tu_below(r, 2) ? (mask - tu_below(r, 3)) : homes[tu_below(r, 4)];
    uint64_t k;
    do
        k = (tu_next(r) & ~mask) | home;
    while (k == 0);
    return k;
}

static void run_random(uint64_t seed, uint64_t max_entries, int ops, int colliding)
{
    tu_rng r = {seed};
    kvhi_prefix_index ix;
    assert_int_equal(kvhi_prefix_init(&ix, max_entries), 0);
    assert_true(ix.mask + 1 >= 2 * max_entries);
    ref_map *m = tu_alloc(sizeof(ref_map));
    assert_true(max_entries <= 1024);
    uint32_t next_value = 0;
    for (int op = 0; op < ops; op++) {
        uint32_t what = (uint32_t)tu_below(&r, 10);
        if (what < 6 && m->n < max_entries) {
            /* A new key, or (one time in three) a present one: equal
             * hashes of different prefixes sit side by side. */
            uint64_t k = m->n && what < 2 ? m->keys[tu_below(&r, m->n)]
                         : colliding      ? colliding_key(&r, ix.mask)
                                          : (tu_next(&r) | 1);
            uint32_t v = next_value++;
            assert_int_equal(kvhi_prefix_insert(&ix, k, v), 0);
            m->keys[m->n] = k;
            m->vals[m->n++] = v;
        } else if (what < 9 && m->n) {
            uint32_t i = (uint32_t)tu_below(&r, m->n);
            /* Another value of the same key is not this pair: nothing goes. */
            kvhi_prefix_erase(&ix, m->keys[i], next_value + 7);
            check_table(&ix, m);
            kvhi_prefix_erase(&ix, m->keys[i], m->vals[i]);
            m->keys[i] = m->keys[m->n - 1];
            m->vals[i] = m->vals[m->n - 1];
            m->n--;
        } else {
            /* Erase / find of an absent key with a popular home slot. */
            uint64_t k = colliding ? colliding_key(&r, ix.mask) : (tu_next(&r) | 1);
            if (ref_count(m, k) == 0) {
                assert_int_equal(kvhi_prefix_find(&ix, k), KVHI_PREFIX_MISS);
                kvhi_prefix_erase(&ix, k, 0);
            }
        }
        check_table(&ix, m);
    }
    assert_int_equal(kvhi_prefix_insert(&ix, 0, 1), -1);
    assert_int_equal(kvhi_prefix_find(&ix, 0), KVHI_PREFIX_MISS);
    kvhi_prefix_destroy(&ix);
    assert_null(ix.keys);
}

static void test_random_heavy_collisions(void **state)
{
    (void)state;
    uint64_t seed = tu_seed(0xc011);
    run_random(seed, 32, 30000, 1);
    run_random(seed + 1, 8, 10000, 1); /* minimum table (16 slots) */
    run_random(seed + 2, 100, 20000, 1);
}

static void test_random_spread_keys(void **state)
{
    (void)state;
    run_random(tu_seed(0x5eed), 500, 20000, 0);
}

/* A hand-made case: a cluster wrapping around the end, erase from its
 * middle must pull the wrapped members back. */
static void test_backward_shift_wraparound(void **state)
{
    (void)state;
    kvhi_prefix_index ix;
    assert_int_equal(kvhi_prefix_init(&ix, 8), 0); /* 16 slots */
    assert_int_equal(ix.mask, 15);
    uint64_t a = (1ull << 8) | 14, b = (2ull << 8) | 14, c = (3ull << 8) | 15, d = (4ull << 8) | 14,
             e = (5ull << 8) | 0, f = (6ull << 8) | 1;
    uint64_t keys[] = {a, b, c, d, e, f};
    for (uint32_t i = 0; i < 6; i++)
        assert_int_equal(kvhi_prefix_insert(&ix, keys[i], i + 10), 0);
    /* Layout: 14:a 15:b 0:c 1:d 2:e 3:f */
    assert_int_equal(ix.keys[14], a);
    assert_int_equal(ix.keys[15], b);
    assert_int_equal(ix.keys[0], c);
    assert_int_equal(ix.keys[1], d);
    assert_int_equal(ix.keys[2], e);
    assert_int_equal(ix.keys[3], f);
    kvhi_prefix_erase(&ix, b, 11);
    /* c (home 15) moves to 15, d (home 14) to 0, e (home 0) to 1, f (home 1) to 2. */
    assert_int_equal(ix.keys[15], c);
    assert_int_equal(ix.keys[0], d);
    assert_int_equal(ix.keys[1], e);
    assert_int_equal(ix.keys[2], f);
    assert_int_equal(ix.keys[3], 0);
    assert_int_equal(kvhi_prefix_find(&ix, b), KVHI_PREFIX_MISS);
    for (uint32_t i = 0; i < 6; i++)
        if (keys[i] != b)
            assert_int_equal(kvhi_prefix_find(&ix, keys[i]), i + 10);
    kvhi_prefix_erase(&ix, a, 10);
    /* d (home 14) moves back into 14; c stays at its home; e, f shift. */
    assert_int_equal(ix.keys[14], d);
    assert_int_equal(ix.keys[15], c);
    assert_int_equal(ix.keys[0], e);
    assert_int_equal(ix.keys[1], f);
    assert_int_equal(ix.keys[2], 0);
    for (uint32_t i = 0; i < 6; i++)
        if (keys[i] != b && keys[i] != a)
            assert_int_equal(kvhi_prefix_find(&ix, keys[i]), i + 10);
    assert_int_equal(ix.count, 4);
    kvhi_prefix_destroy(&ix);
}

/* ---- the chained hash ---- */

static void test_hash_properties(void **state)
{
    (void)state;
    int32_t t[16], u[16];
    tu_iota(t, 16, 100);
    memcpy(u, t, sizeof(t));
    uint64_t h = kvhi_prefix_hash(0, t, 16, 7);
    /* Deterministic. */
    assert_int_equal(kvhi_prefix_hash(0, t, 16, 7), h);
    assert_int_equal(kvhi_prefix_hash(0, u, 16, 7), h);
    /* Salt, parent, every token, the count, token order all matter. */
    assert_true(kvhi_prefix_hash(0, t, 16, 8) != h);
    assert_true(kvhi_prefix_hash(1, t, 16, 7) != h);
    assert_true(kvhi_prefix_hash(h, t, 16, 7) != h);
    assert_true(kvhi_prefix_hash(0, t, 15, 7) != h);
    for (int i = 0; i < 16; i++) {
        memcpy(u, t, sizeof(t));
        u[i] ^= 1;
        assert_true(kvhi_prefix_hash(0, u, 16, 7) != h);
        u[i] = t[i] ^ (int32_t)0x80000000;
        assert_true(kvhi_prefix_hash(0, u, 16, 7) != h);
    }
    memcpy(u, t, sizeof(t));
    u[3] = t[4];
    u[4] = t[3];
    assert_true(kvhi_prefix_hash(0, u, 16, 7) != h);
    /* Odd counts: the last token counts. */
    int32_t o1[3] = {1, 2, 3}, o2[3] = {1, 2, 4};
    assert_true(kvhi_prefix_hash(0, o1, 3, 0) != kvhi_prefix_hash(0, o2, 3, 0));
    /* A trailing zero token is not the same as no token. */
    int32_t z[4] = {1, 2, 0, 0};
    assert_true(kvhi_prefix_hash(0, z, 2, 0) != kvhi_prefix_hash(0, z, 3, 0));
    assert_true(kvhi_prefix_hash(0, z, 3, 0) != kvhi_prefix_hash(0, z, 4, 0));
}

static void test_hash_never_zero_and_spread(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(0xa5a5)};
    enum { N = 200000 };
    uint64_t *hs = tu_alloc(sizeof(uint64_t) * N);
    int32_t t[32];
    /* Zero inputs, too. */
    memset(t, 0, sizeof(t));
    assert_true(kvhi_prefix_hash(0, t, 32, 0) != 0);
    assert_true(kvhi_prefix_hash(0, t, 0, 0) != 0);
    assert_true(kvhi_prefix_hash(0, NULL, 0, 0) != 0);
    uint64_t parent = 0;
    for (int i = 0; i < N; i++) {
        size_t n = 1 + tu_below(&r, 32);
        for (size_t j = 0; j < n; j++)
            t[j] = (int32_t)tu_below(&r, 8); /* small vocabulary */
        uint64_t salt = tu_below(&r, 4);
        uint64_t h = kvhi_prefix_hash(i % 3 ? parent : 0, t, n, salt);
        assert_true(h != 0);
        hs[i] = h;
        parent = h;
    }
    /* The low bits (the home slots) are spread: each of 256 buckets gets
     * a fair share. */
    uint32_t buckets[256] = {0};
    for (int i = 0; i < N; i++)
        buckets[hs[i] & 255]++;
    for (int b = 0; b < 256; b++)
        assert_true(buckets[b] > N / 256 / 2 && buckets[b] < N / 256 * 2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_random_heavy_collisions, tu_teardown),
        cmocka_unit_test_teardown(test_random_spread_keys, tu_teardown),
        cmocka_unit_test_teardown(test_backward_shift_wraparound, tu_teardown),
        cmocka_unit_test_teardown(test_hash_properties, tu_teardown),
        cmocka_unit_test_teardown(test_hash_never_zero_and_spread, tu_teardown),
    };
    return cmocka_run_group_tests_name("prefix_index", tests, NULL, NULL);
}
