/* An engine in a child process made by fork() after it opened (kvh.h,
 * kvh_engine_open): the child's copy has no worker threads and its locks
 * are as the parent's threads held them, so every call there returns
 * KVH_ERR_UNSUPPORTED with a message, kvh_engine_close returns KVH_OK at
 * once without freeing anything, and a new engine opened in the child
 * works. The parent's engine is untouched. */
#include <pthread.h>
#include <semaphore.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test_util.h"
#include "disk_test_util.h"
#include "core/engine.h"

enum { L = 2, H = 2, D = 8, BT = 4 };
static const size_t TOK = H * D * 2;

/* Waits for pid at most secs seconds; kills it and fails if it hangs. */
static int reap_within(pid_t pid, int secs)
{
    for (int i = 0; i < secs * 100; i++) {
        int ws;
        pid_t r = waitpid(pid, &ws, WNOHANG);
        if (r == pid)
            return WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws);
        usleep(10000);
    }
    kill(pid, SIGKILL);
    (void)dt_reap(pid);
    fail_msg("the child hung (killed after %d s)", secs);
    return -1;
}

/* ASan's allocator (GCC 12's libsanitizer) takes no locks around fork():
 * a child forked while one of the parent's workers was inside malloc
 * waits forever on that size class's lock at its first malloc of the
 * same size (seen: the child's new worker threads, at their start).
 * glibc's malloc is safe there, so the new engine is checked without
 * ASan only. */
#if defined(__SANITIZE_ADDRESS__)
#define CHILD_CAN_MALLOC 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CHILD_CAN_MALLOC 0
#endif
#endif
#ifndef CHILD_CAN_MALLOC
#define CHILD_CAN_MALLOC 1
#endif

/* 0 when every check in the child holds, else the number of the first
 * that failed. */
static int child_checks(kvh_engine *e, kvh_seq s)
{
    uint64_t n = 0;
    if (kvh_seq_length(e, s, &n) != KVH_ERR_UNSUPPORTED || !strstr(kvh_last_error(), "fork"))
        return 1;
    kvh_block b;
    if (kvh_block_alloc(e, 0, &b) != KVH_ERR_UNSUPPORTED)
        return 2;
    kvh_fence f;
    if (kvh_seq_migrate(e, s, 0, 4, KVH_TIER_HOST, &f) != KVH_ERR_UNSUPPORTED)
        return 3;
    if (kvh_seq_acquire(e, s, 0, 4, NULL) != KVH_ERR_UNSUPPORTED)
        return 4;
    if (kvh_engine_close(e) != KVH_OK)
        return 5;
    if (!CHILD_CAN_MALLOC)
        return 0;
    /* A new engine of the child's own works. */
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F16, 16, 16, 2);
    kvh_engine *mine = NULL;
    if (kvh_engine_open(&c, &mine) != KVH_OK)
        return 6;
    kvh_seq t;
    int32_t tok[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    if (kvh_seq_create(mine, 0, &t) != KVH_OK || kvh_seq_append(mine, t, tok, 8) != KVH_OK)
        return 7;
    if (kvh_seq_migrate(mine, t, 0, 8, KVH_TIER_HOST, &f) != KVH_OK || kvh_fence_wait(mine, f, UINT64_MAX) != KVH_OK ||
        kvh_fence_free(mine, f) != KVH_OK)
        return 8;
    if (kvh_engine_close(mine) != KVH_OK)
        return 9;
    return 0;
}

static void test_a_forked_child_cannot_use_the_parents_engine(void **state)
{
    (void)state;
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F16, 16, 16, 2);
    kvh_seq s = tu_seq_new(e, 0);
    int32_t tok[12];
    tu_iota(tok, 12, 1);
    assert_ok(kvh_seq_append(e, s, tok, 12));
    tu_write_pattern(e, s, L, TOK, 5, 0, 12);
    /* Workers busy at the fork: moves queued and in flight. */
    kvh_fence f;
    assert_ok(kvh_seq_migrate(e, s, 0, 12, KVH_TIER_HOST, &f));
    pid_t pid = dt_fork_child();
    assert_true(pid >= 0);
    if (pid == 0)
        _exit(child_checks(e, s));
    int rc = reap_within(pid, 20);
    if (rc != 0)
        fail_msg("check %d failed in the child", rc);
    /* The parent's engine is as it was. */
    assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
    assert_ok(kvh_fence_free(e, f));
    assert_true(tu_check_pattern(e, s, L, TOK, 5, 0, 12));
    assert_ok(kvh_seq_free(e, s));
}

/* Another thread holds the list of closed engines' structs (it is in a
 * close) for a while after the fork is called: the fork waits for it, or
 * the child would inherit the lock held and its first close would never
 * return. */
static void *hold_closed_list_briefly(void *started)
{
    kvhi_engine_closed_list_hold(true);
    sem_post(started);
    usleep(200 * 1000);
    kvhi_engine_closed_list_hold(false);
    return NULL;
}

static void test_a_fork_during_another_threads_close(void **state)
{
    (void)state;
    if (!CHILD_CAN_MALLOC)
        skip();
    kvh_engine *first = tu_open(L, H, D, BT, KVH_DTYPE_F16, 16, 16, 2);
    assert_ok(kvh_engine_close(first)); /* the fork handlers are in place from the first open */
    sem_t started;
    sem_init(&started, 0, 0);
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, hold_closed_list_briefly, &started), 0);
    sem_wait(&started);
    pid_t pid = dt_fork_child();
    assert_true(pid >= 0);
    if (pid == 0) {
        kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F16, 16, 16, 2);
        kvh_engine *mine = NULL;
        if (kvh_engine_open(&c, &mine) != KVH_OK)
            _exit(1);
        _exit(kvh_engine_close(mine) == KVH_OK ? 0 : 2);
    }
    pthread_join(t, NULL);
    sem_destroy(&started);
    assert_int_equal(reap_within(pid, 10), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_a_forked_child_cannot_use_the_parents_engine, tu_teardown),
        cmocka_unit_test(test_a_fork_during_another_threads_close),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
