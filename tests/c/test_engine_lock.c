/* The debug check behind kvhi_assert_locked answers who holds the engine
 * lock: the caller, nobody, or another thread. (Release builds compile the
 * asserts out; this test then has nothing to check.) */
#include <pthread.h>

#include "test_util.h"

#include "core/engine.h"

#ifndef NDEBUG
static void *held_elsewhere(void *arg)
{
    kvh_engine *e = arg;
    return (void *)(intptr_t)kvhi_lock_held_by_caller(e);
}
#endif

static void test_lock_owner_is_known(void **state)
{
    (void)state;
#ifdef NDEBUG
    skip();
#else
    kvh_engine *e = tu_open(1, 1, 8, 4, KVH_DTYPE_F32, 4, 4, 0);
    assert_int_equal(kvhi_lock_held_by_caller(e), 0);
    pthread_mutex_lock(&e->lock);
    assert_int_equal(kvhi_lock_held_by_caller(e), 1);
    pthread_t t;
    void *other = NULL;
    assert_int_equal(pthread_create(&t, NULL, held_elsewhere, e), 0);
    assert_int_equal(pthread_join(t, &other), 0);
    assert_int_equal((intptr_t)other, 0); /* held, but not by that thread */
    pthread_mutex_unlock(&e->lock);
    assert_int_equal(kvhi_lock_held_by_caller(e), 0);
    assert_ok(tu_close(e));
#endif
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_lock_owner_is_known, tu_teardown),
    };
    return cmocka_run_group_tests_name("engine_lock", tests, NULL, NULL);
}
