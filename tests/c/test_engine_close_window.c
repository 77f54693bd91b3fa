/* kvh.h, kvh_engine_close: "Calls racing with close on other threads get
 * KVH_ERR_CLOSED", and "a second close that starts while the first is
 * still waiting gets KVH_ERR_CLOSED and frees nothing". Close waits for
 * the calls counted in flight; a call that has entered but not yet taken
 * the engine lock is not counted. Here such a call starts while close is
 * provably running (close is held in its join of a worker thread), and
 * is then held off the processor, as preemption can, at its first lock
 * until close has returned. It must still read KVH_ERR_CLOSED from
 * memory that is there (AddressSanitizer reports a use after free
 * otherwise).
 *
 * pthread_join and pthread_mutex_lock are interposed for that, on the
 * closing and the racing thread only. Not labelled `concurrency`: the
 * thread sanitizer's own interposers of the same calls would clash. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <string.h>
#include <unistd.h>

#include "test_util.h"

static _Thread_local bool closing_thread, racing_thread;
static atomic_bool racer_go, racer_at_lock, close_returned, join_gated;

int pthread_join(pthread_t t, void **ret)
{
    static int (*real)(pthread_t, void **);
    if (!real)
        real = (int (*)(pthread_t, void **))dlsym(RTLD_NEXT, "pthread_join");
    /* Close is past marking the engine closing and waiting for the calls
     * in flight: the racing call starts now. */
    if (closing_thread && !atomic_exchange(&join_gated, true)) {
        atomic_store(&racer_go, true);
        while (!atomic_load(&racer_at_lock))
            usleep(100);
    }
    return real(t, ret);
}

int pthread_mutex_lock(pthread_mutex_t *m)
{
    static int (*real)(pthread_mutex_t *);
    if (!real)
        real = (int (*)(pthread_mutex_t *))dlsym(RTLD_NEXT, "pthread_mutex_lock");
    if (racing_thread && !atomic_exchange(&racer_at_lock, true)) {
        while (!atomic_load(&close_returned))
            usleep(100);
        usleep(1000);
    }
    return real(m);
}

typedef struct race {
    kvh_engine *e;
    bool second_close;
    kvh_status got;
} race;

static void *racer(void *arg)
{
    race *r = arg;
    while (!atomic_load(&racer_go))
        usleep(100);
    racing_thread = true;
    uint64_t n = 0;
    r->got = r->second_close ? kvh_engine_close(r->e) : kvh_seq_length(r->e, (kvh_seq){1}, &n);
    racing_thread = false;
    return NULL;
}

static void close_with_a_call_held_at_its_lock(bool second_close)
{
    atomic_store(&racer_go, false);
    atomic_store(&racer_at_lock, false);
    atomic_store(&close_returned, false);
    atomic_store(&join_gated, false);
    kvh_config c = tu_cfg(2, 2, 8, 4, KVH_DTYPE_F32, 64, 64, 2); /* workers: close joins them */
    kvh_engine *e = tu_open_cfg(&c);
    race r = {.e = e, .second_close = second_close, .got = KVH_OK};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, racer, &r), 0);
    closing_thread = true;
    kvh_status st = kvh_engine_close(e);
    closing_thread = false;
    atomic_store(&close_returned, true);
    assert_int_equal(pthread_join(th, NULL), 0);
    assert_ok(st);
    assert_true(atomic_load(&racer_at_lock)); /* the race was run, not missed */
    assert_int_equal(r.got, KVH_ERR_CLOSED);
}

static void test_a_call_entering_as_close_ends_is_refused(void **state)
{
    (void)state;
    close_with_a_call_held_at_its_lock(false);
}

static void test_a_second_close_entering_as_the_first_ends_frees_nothing(void **state)
{
    (void)state;
    close_with_a_call_held_at_its_lock(true);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_a_call_entering_as_close_ends_is_refused),
        cmocka_unit_test(test_a_second_close_entering_as_the_first_ends_frees_nothing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
