/* Attention plans across threads: kvh_attention_run is @threads any, so
 * runs of a plan may overlap its destroy. Each run either completes or
 * finds the plan gone (KVH_ERR_BAD_HANDLE); the destroy waits for the runs
 * under way, so none reads a freed plan (ASan, TSan). */
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "test_util.h"
#include "mt_util.h"

enum { L = 1, H = 2, D = 64, BT = 16, TOKENS = 40, RUNNERS = 3, ROUNDS = 40 };

static kvh_seq source;
static kvh_attention_plan *_Atomic shared_plan;
/* Rounds whose plan is published / whose runners have all seen it go. */
static atomic_int published, finished;
static atomic_int runs_this_round, runners_done;
static atomic_bool stop;

/* Waits until *counter reaches n; false when the test stops first. */
static bool wait_for(atomic_int *counter, int n)
{
    while (atomic_load(counter) < n)
        if (atomic_load(&stop))
            return false;
        else
            sched_yield();
    return true;
}

/* Runs each round's plan until it is gone. */
static void *runner_main(void *arg)
{
    mt_worker *w = arg;
    float q[H * D] = {0}, out[H * D];
    for (int round = 0; round < ROUNDS; round++) {
        if (!wait_for(&published, round + 1))
            break;
        kvh_attention_plan *pl = atomic_load(&shared_plan);
        for (;;) {
            kvh_status st = kvh_attention_run(w->e, pl, q, out, NULL);
            if (st == KVH_ERR_BAD_HANDLE)
                break;
            if (st != KVH_OK) {
                mt_report(w, "round %d: run: %s: %s", round, kvh_status_name(st), kvh_last_error());
                break;
            }
            atomic_fetch_add(&runs_this_round, 1);
        }
        atomic_fetch_add(&runners_done, 1);
        if (!wait_for(&finished, round + 1))
            break;
    }
    return NULL;
}

/* Makes each round's plan and destroys it while the runners run it. */
static void *destroyer_main(void *arg)
{
    mt_worker *w = arg;
    kvh_attention_params p;
    kvh_attention_params_init(&p, sizeof(p));
    p.threads = 1;
    for (int round = 0; round < ROUNDS && !w->errors; round++) {
        kvh_attention_plan *pl = NULL;
        if (kvh_attention_plan_create(w->e, 0, &source, NULL, 1, &p, &pl) != KVH_OK) {
            mt_report(w, "round %d: create: %s", round, kvh_last_error());
            break;
        }
        atomic_store(&runs_this_round, 0);
        atomic_store(&runners_done, 0);
        atomic_store(&shared_plan, pl);
        atomic_store(&published, round + 1);
        /* A few runs under way first (a runner done already has failed). */
        while (atomic_load(&runs_this_round) < 20 * RUNNERS && atomic_load(&runners_done) == 0)
            sched_yield();
        kvh_status st = kvh_attention_plan_destroy(w->e, pl);
        if (st != KVH_OK)
            mt_report(w, "round %d: destroy: %s: %s", round, kvh_status_name(st), kvh_last_error());
        else if ((st = kvh_attention_plan_destroy(w->e, pl)) != KVH_ERR_BAD_HANDLE)
            mt_report(w, "round %d: a second destroy returned %s", round, kvh_status_name(st));
        while (atomic_load(&runners_done) < RUNNERS)
            sched_yield();
        atomic_store(&finished, round + 1);
    }
    atomic_store(&stop, true);
    return NULL;
}

static void *worker_main(void *arg)
{
    mt_worker *w = arg;
    return w->t == 0 ? destroyer_main(arg) : runner_main(arg);
}

static void test_destroy_while_running(void **state)
{
    (void)state;
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F32, 16, 0, 1);
    source = tu_seq_new(e, 0);
    int32_t tok[TOKENS];
    tu_iota(tok, TOKENS, 1);
    assert_ok(kvh_seq_append(e, source, tok, TOKENS));
    mt_worker w[1 + RUNNERS];
    mt_run(e, 1 + RUNNERS, worker_main, w);
    assert_int_equal(atomic_load(&finished), ROUNDS);
    for (uint64_t b = 0; b < (TOKENS + BT - 1) / BT; b++)
        assert_int_equal(tu_seq_binfo(e, source, b).holds, 0); /* every plan's holds dropped */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_destroy_while_running, tu_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
