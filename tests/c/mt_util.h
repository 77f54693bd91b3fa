/* Worker threads of the multi-threaded tests (header only).
 *
 *   mt_worker        what a thread gets: the engine, its index, and the
 *                    first error it reports (a thread must not fail the
 *                    test itself: cmocka's longjmp is per thread).
 *   mt_report(w, ...)  records an error (the first message is kept).
 *   mt_run(e, n, fn, w)  starts n threads on fn(&w[i]), joins them all,
 *                    then fails the test with the first thread's error.
 *   mt_run_for(e, n, fn, w, seconds, stop)  the same, with *stop set
 *                    once seconds have passed (the calling thread keeps
 *                    the time); fn returns when it sees it.
 *   mt_closer, mt_close_thread  kvh_engine_close on a thread of its own
 *                    (pthread_create(&t, NULL, mt_close_thread, &closer)):
 *                    its status, and done once it returned.
 */
#ifndef KVH_TEST_MT_UTIL_H
#define KVH_TEST_MT_UTIL_H

#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#include <cmocka.h>

#include "kvh/kvh.h"

typedef struct mt_worker {
    kvh_engine *e;
    int t; /* 0 .. n-1 */
    int errors;
    char msg[256];
} mt_worker;

__attribute__((format(printf, 2, 3))) static inline void mt_report(mt_worker *w, const char *fmt, ...)
{
    if (w->errors++)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->msg, sizeof(w->msg), fmt, ap);
    va_end(ap);
}

#define MT_MAX_THREADS 64

static inline void mt_start(kvh_engine *e, int n, void *(*fn)(void *), mt_worker *w, pthread_t *th)
{
    assert_true(n <= MT_MAX_THREADS);
    for (int t = 0; t < n; t++) {
        w[t] = (mt_worker){.e = e, .t = t};
        assert_int_equal(pthread_create(&th[t], NULL, fn, &w[t]), 0);
    }
}

static inline void mt_join(int n, const pthread_t *th, const mt_worker *w)
{
    for (int t = 0; t < n; t++)
        pthread_join(th[t], NULL);
    for (int t = 0; t < n; t++)
        if (w[t].errors)
            fail_msg("%d error(s) in thread %d; first: %s", w[t].errors, t, w[t].msg);
}

static inline void mt_run(kvh_engine *e, int n, void *(*fn)(void *), mt_worker *w)
{
    pthread_t th[MT_MAX_THREADS];
    mt_start(e, n, fn, w, th);
    mt_join(n, th, w);
}

static inline void mt_run_for(kvh_engine *e, int n, void *(*fn)(void *), mt_worker *w, double seconds, atomic_int *stop)
{
    pthread_t th[MT_MAX_THREADS];
    mt_start(e, n, fn, w, th);
    struct timespec left = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    while (nanosleep(&left, &left) != 0) /* a signal: sleep what is left */
        ;
    atomic_store(stop, 1);
    mt_join(n, th, w);
}

typedef struct mt_closer {
    kvh_engine *e;
    kvh_status st;
    atomic_int done;
} mt_closer;

static inline void *mt_close_thread(void *arg)
{
    mt_closer *c = (mt_closer *)arg;
    c->st = kvh_engine_close(c->e);
    atomic_store(&c->done, 1);
    return NULL;
}

#endif
