/* core/block_map.c, white-box: a block -> value map against a plain
 * array, through random puts, finds and takes (deletions by backward
 * shift in any order, growth), and the length of its probe runs for keys
 * a power of two apart (a multiplicative hash's low bits would pile them
 * into one run). */
#include <stdlib.h>

#include "test_util.h"

#include "core/block_map.h"

enum { KEYS = 1 << 14 };

static void test_against_an_array(void **state)
{
    (void)state;
    static uint32_t want[KEYS]; /* value + 1; 0: absent */
    memset(want, 0, sizeof(want));
    kvhi_block_map m = {0};
    tu_rng r = {tu_seed(0xb10c)};
    uint32_t count = 0;
    for (int op = 0; op < 400000; op++) {
        /* Phases: grow, mixed, shrink, so that deletions meet long runs. */
        uint32_t phase = (uint32_t)(op / 100000), k = (uint32_t)tu_below(&r, KEYS) & ~(phase == 1 ? 0u : 63u);
        uint64_t what = tu_below(&r, 10);
        uint32_t *v = kvhi_block_map_find(&m, k);
        assert_int_equal(v != NULL, want[k] != 0);
        if (v)
            assert_int_equal(*v, want[k] - 1);
        if ((phase < 3 && what < 5) || (phase == 3 && what < 1)) {
            uint32_t val = (uint32_t)tu_next(&r) & 0x7fffffffu;
            assert_int_equal(kvhi_block_map_put(&m, k, val), 0);
            count += want[k] == 0;
            want[k] = val + 1;
        } else {
            uint32_t got = 0;
            bool had = kvhi_block_map_take(&m, k, &got);
            assert_int_equal(had, want[k] != 0);
            if (had) {
                assert_int_equal(got, want[k] - 1);
                want[k] = 0;
                count--;
            }
        }
        assert_int_equal(m.count, count);
    }
    for (uint32_t k = 0; k < KEYS; k++) {
        uint32_t *v = kvhi_block_map_find(&m, k);
        assert_int_equal(v != NULL, want[k] != 0);
    }
    kvhi_block_map_free(&m);
    assert_null(kvhi_block_map_find(&m, 1));
}

static void test_power_of_two_keys_spread(void **state)
{
    (void)state;
    kvhi_block_map m = {0};
    for (uint32_t i = 0; i < 1024; i++)
        assert_int_equal(kvhi_block_map_put(&m, i << 14, i), 0);
    /* The longest run of occupied slots: short for a spread hash (a few
     * dozen at load 1/2), 1024 when every key lands in one slot. */
    uint32_t longest = 0, run = 0;
    for (uint32_t pass = 0; pass < 2; pass++)
        for (uint32_t s = 0; s < m.cap; s++) {
            run = m.keys[s] ? run + 1 : 0;
            longest = run > longest ? run : longest;
        }
    if (longest > 64)
        fail_msg("a run of %u occupied slots among %u for 1024 keys", longest, m.cap);
    for (uint32_t i = 0; i < 1024; i++)
        assert_int_equal(*kvhi_block_map_find(&m, i << 14), i);
    kvhi_block_map_free(&m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_against_an_array),
        cmocka_unit_test(test_power_of_two_keys_spread),
    };
    return cmocka_run_group_tests_name("block_map", tests, NULL, NULL);
}
