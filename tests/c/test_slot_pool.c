/* core/slot_pool.h: O(1) slot allocator of one tier. */
#include "test_util.h"

#include "core/slot_pool.h"

static void test_ascending_then_exhausted(void **state)
{
    (void)state;
    kvhi_slot_pool p;
    assert_int_equal(kvhi_slot_pool_init(&p, 100), 0);
    assert_int_equal(p.capacity, 100);
    assert_int_equal(kvhi_slot_pool_used(&p), 0);
    for (uint32_t i = 0; i < 100; i++) {
        uint32_t s = 12345;
        assert_int_equal(kvhi_slot_pool_alloc(&p, &s), 0);
        assert_int_equal(s, i); /* neighbouring blocks land in neighbouring slots */
        assert_int_equal(kvhi_slot_pool_used(&p), i + 1);
    }
    uint32_t s = 777;
    assert_int_equal(kvhi_slot_pool_alloc(&p, &s), -1);
    assert_int_equal(s, 777); /* untouched on failure */
    assert_int_equal(kvhi_slot_pool_used(&p), 100);
    kvhi_slot_pool_destroy(&p);
    assert_int_equal(p.capacity, 0);
    assert_null(p.free_stack);
}

static void test_free_reuses_last_freed(void **state)
{
    (void)state;
    kvhi_slot_pool p;
    assert_int_equal(kvhi_slot_pool_init(&p, 8), 0);
    uint32_t s = 0;
    for (int i = 0; i < 8; i++)
        assert_int_equal(kvhi_slot_pool_alloc(&p, &s), 0);
    kvhi_slot_pool_free(&p, 3);
    kvhi_slot_pool_free(&p, 6);
    assert_int_equal(kvhi_slot_pool_used(&p), 6);
    assert_int_equal(kvhi_slot_pool_alloc(&p, &s), 0);
    assert_int_equal(s, 6); /* LIFO: the most recently freed (still warm) first */
    assert_int_equal(kvhi_slot_pool_alloc(&p, &s), 0);
    assert_int_equal(s, 3);
    assert_int_equal(kvhi_slot_pool_alloc(&p, &s), -1);
    kvhi_slot_pool_destroy(&p);
}

static void test_zero_capacity(void **state)
{
    (void)state;
    kvhi_slot_pool p;
    assert_int_equal(kvhi_slot_pool_init(&p, 0), 0);
    uint32_t s = 5;
    assert_int_equal(kvhi_slot_pool_alloc(&p, &s), -1);
    assert_int_equal(s, 5);
    assert_int_equal(kvhi_slot_pool_used(&p), 0);
    kvhi_slot_pool_destroy(&p);
}

static void test_one_slot(void **state)
{
    (void)state;
    kvhi_slot_pool p;
    assert_int_equal(kvhi_slot_pool_init(&p, 1), 0);
    uint32_t s = 9;
    for (int round = 0; round < 10; round++) {
        assert_int_equal(kvhi_slot_pool_alloc(&p, &s), 0);
        assert_int_equal(s, 0);
        assert_int_equal(kvhi_slot_pool_alloc(&p, &s), -1);
        kvhi_slot_pool_free(&p, 0);
        assert_int_equal(kvhi_slot_pool_used(&p), 0);
    }
    kvhi_slot_pool_destroy(&p);
}

/* Random alloc/free against a bitmap: never hands out a slot twice, every
 * slot stays in range, and the used count is exact. */
static void test_random_no_double_allocation(void **state)
{
    (void)state;
    enum { CAP = 513 };
    tu_rng r = {tu_seed(0x5107)};
    kvhi_slot_pool p;
    assert_int_equal(kvhi_slot_pool_init(&p, CAP), 0);
    uint8_t *taken = tu_alloc(CAP);
    uint32_t *held = tu_alloc(sizeof(uint32_t) * CAP);
    uint32_t n = 0;
    for (int op = 0; op < 200000; op++) {
        if (n < CAP && (n == 0 || tu_below(&r, 2))) {
            uint32_t s = 0;
            assert_int_equal(kvhi_slot_pool_alloc(&p, &s), 0);
            assert_true(s < CAP);
            assert_false(taken[s]);
            taken[s] = 1;
            held[n++] = s;
        } else if (n == CAP && tu_below(&r, 4) == 0) {
            uint32_t s = 0;
            assert_int_equal(kvhi_slot_pool_alloc(&p, &s), -1);
        } else {
            uint32_t k = (uint32_t)tu_below(&r, n);
            uint32_t s = held[k];
            held[k] = held[--n];
            taken[s] = 0;
            kvhi_slot_pool_free(&p, s);
        }
        assert_int_equal(kvhi_slot_pool_used(&p), n);
    }
    kvhi_slot_pool_destroy(&p);
}

/* O(1): a million alloc/free pairs on a large pool take well under a
 * second (a linear scan over 1M slots per call would take minutes). */
static void test_constant_time(void **state)
{
    (void)state;
    enum { CAP = 1 << 20 };
    kvhi_slot_pool p;
    assert_int_equal(kvhi_slot_pool_init(&p, CAP), 0);
    uint32_t s = 0;
    double t0 = tu_now();
    for (uint32_t i = 0; i < CAP - 1; i++)
        assert_int_equal(kvhi_slot_pool_alloc(&p, &s), 0);
    for (int i = 0; i < 1000000; i++) {
        assert_int_equal(kvhi_slot_pool_alloc(&p, &s), 0);
        kvhi_slot_pool_free(&p, s);
    }
    double dt = tu_now() - t0;
    assert_true(dt < 5.0);
    assert_int_equal(kvhi_slot_pool_used(&p), CAP - 1);
    kvhi_slot_pool_destroy(&p);
}

#ifdef KVH_CHECK_SLOTS
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

/* Runs misuse(p) on a pool of 4 slots (all handed out) in a child and
 * asserts that the slot checks abort it. */
static void assert_check_aborts(void (*misuse)(kvhi_slot_pool *p))
{
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        kvhi_slot_pool p;
        uint32_t s;
        if (kvhi_slot_pool_init(&p, 4) != 0)
            _exit(3);
        for (int i = 0; i < 4; i++)
            (void)kvhi_slot_pool_alloc(&p, &s);
        misuse(&p);
        _exit(0);
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFSIGNALED(status));
    assert_int_equal(WTERMSIG(status), SIGABRT);
}

static void free_twice(kvhi_slot_pool *p)
{
    kvhi_slot_pool_free(p, 2);
    kvhi_slot_pool_free(p, 2);
}

static void place_in_free_slot(kvhi_slot_pool *p)
{
    kvhi_slot_pool_free(p, 1);
    kvhi_slot_check_in_use(p, 1);
}

static void free_outside_arena(kvhi_slot_pool *p) { kvhi_slot_pool_free(p, 4); }

static void test_checks_abort_on_misuse(void **state)
{
    (void)state;
    assert_check_aborts(free_twice);
    assert_check_aborts(place_in_free_slot);
    assert_check_aborts(free_outside_arena);
}

/* Two tiers on one arena: a slot freed into one pool and then into the
 * other is a double release too. */
static void free_into_both_pools(kvhi_slot_pool *upper)
{
    kvhi_slot_pool lower;
    uint32_t s;
    if (kvhi_slot_pool_init_range(&lower, 4, 4) != 0 || kvhi_slot_pool_join(upper, &lower) != 0)
        _exit(3);
    kvhi_slot_check_in_use(upper, 3); /* upper's marks survive the join */
    if (kvhi_slot_pool_alloc(&lower, &s) != 0 || s != 4)
        _exit(4);
    kvhi_slot_pool_free(upper, 4); /* a trade: legal */
    kvhi_slot_pool_free(&lower, 4);
}

static void test_joined_pools_share_marks(void **state)
{
    (void)state;
    assert_check_aborts(free_into_both_pools);
}

/* take_all then freeing the known free slots (a reopened disk tier). */
static void test_take_all_then_free(void **state)
{
    (void)state;
    kvhi_slot_pool p;
    uint32_t s;
    assert_int_equal(kvhi_slot_pool_init(&p, 6), 0);
    kvhi_slot_pool_take_all(&p);
    assert_int_equal(kvhi_slot_pool_used(&p), 6);
    kvhi_slot_check_in_use(&p, 5);
    kvhi_slot_pool_free(&p, 5);
    kvhi_slot_pool_free(&p, 0);
    assert_int_equal(kvhi_slot_pool_alloc(&p, &s), 0);
    assert_int_equal(s, 0);
    kvhi_slot_check_in_use(&p, 0);
    kvhi_slot_pool_destroy(&p);
}
#endif

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_ascending_then_exhausted, tu_teardown),
        cmocka_unit_test_teardown(test_free_reuses_last_freed, tu_teardown),
        cmocka_unit_test_teardown(test_zero_capacity, tu_teardown),
        cmocka_unit_test_teardown(test_one_slot, tu_teardown),
        cmocka_unit_test_teardown(test_random_no_double_allocation, tu_teardown),
        cmocka_unit_test_teardown(test_constant_time, tu_teardown),
#ifdef KVH_CHECK_SLOTS
        cmocka_unit_test_teardown(test_checks_abort_on_misuse, tu_teardown),
        cmocka_unit_test_teardown(test_joined_pools_share_marks, tu_teardown),
        cmocka_unit_test_teardown(test_take_all_then_free, tu_teardown),
#endif
    };
    return cmocka_run_group_tests_name("slot_pool", tests, NULL, NULL);
}
