/* Host names resolved within a time budget (core/name_resolve.c): numeric
 * addresses skip the lookup, a slow name service costs the caller its
 * budget and no more (the lookup's thread cleans up after itself, also
 * when many callers give up at once), a failed lookup says why, and the
 * remote tier reaches a Redis named by host name and opens within its
 * timeout when the name service does not answer. */
#include <netdb.h>
#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

#include "test_util.h"
#include "remote_test_util.h"
#include "core/name_resolve.h"

static atomic_int lookups_started, lookups_ended;
static atomic_int slow_ms;

static int counting_lookup(const char *node, const char *service, const struct addrinfo *hints, struct addrinfo **res)
{
    atomic_fetch_add(&lookups_started, 1);
    int ms = atomic_load(&slow_ms);
    if (ms)
        usleep((useconds_t)ms * 1000u);
    int rc = getaddrinfo(node, service, hints, res);
    atomic_fetch_add(&lookups_ended, 1);
    return rc;
}

static int failing_lookup(const char *node, const char *service, const struct addrinfo *hints, struct addrinfo **res)
{
    (void)node, (void)service, (void)hints, (void)res;
    return EAI_NONAME;
}

static uint64_t ms_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* Waits for every started lookup to end (their threads free their state
 * then: the leak checker sees it). */
static void wait_lookups_ended(void)
{
    for (int i = 0; i < 1000 && atomic_load(&lookups_ended) < atomic_load(&lookups_started); i++)
        usleep(10000);
    assert_int_equal(atomic_load(&lookups_ended), atomic_load(&lookups_started));
    usleep(20000); /* the thread's last step after the lookup: letting go of it */
}

static int setup(void **state)
{
    (void)state;
    atomic_store(&lookups_started, 0);
    atomic_store(&lookups_ended, 0);
    atomic_store(&slow_ms, 0);
    kvhi_resolver_getaddrinfo = counting_lookup;
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    kvhi_resolver_getaddrinfo = getaddrinfo;
    return 0;
}

static void test_numeric_addresses_need_no_lookup(void **state)
{
    (void)state;
    const char *hosts[] = {"127.0.0.1", "::1", "fe80::1%lo", "10.1.2.3"};
    for (size_t i = 0; i < sizeof(hosts) / sizeof(hosts[0]); i++) {
        kvhi_resolved r;
        char err[200] = "";
        assert_int_equal(kvhi_resolve_numeric(hosts[i], 1000000, &r, err, sizeof(err)), 0);
        assert_int_equal(r.n, 1);
        assert_string_equal(r.addr[0], hosts[i]);
    }
    assert_int_equal(atomic_load(&lookups_started), 0);
}

static void test_a_name_gives_its_numeric_addresses(void **state)
{
    (void)state;
    kvhi_resolved r;
    char err[200] = "";
    assert_int_equal(kvhi_resolve_numeric("localhost", 5000000000ull, &r, err, sizeof(err)), 0);
    assert_true(r.n >= 1);
    bool loopback = false;
    for (uint32_t i = 0; i < r.n; i++)
        loopback |= !strcmp(r.addr[i], "127.0.0.1") || !strcmp(r.addr[i], "::1");
    assert_true(loopback);
    assert_int_equal(atomic_load(&lookups_started), 1);
    wait_lookups_ended();
}

static void test_a_slow_name_service_costs_the_budget_only(void **state)
{
    (void)state;
    atomic_store(&slow_ms, 1500);
    kvhi_resolved r;
    char err[200] = "";
    uint64_t t0 = ms_now();
    assert_int_equal(kvhi_resolve_numeric("localhost", 100000000ull, &r, err, sizeof(err)), -3);
    uint64_t took = ms_now() - t0;
    assert_true(took >= 90 && took < 1000);
    assert_int_equal(r.n, 0);
    assert_non_null(strstr(err, "no answer from the name service for localhost within 100 ms"));
    wait_lookups_ended();
}

static void test_a_failed_lookup_says_why(void **state)
{
    (void)state;
    kvhi_resolver_getaddrinfo = failing_lookup;
    kvhi_resolved r;
    char err[200] = "";
    assert_int_equal(kvhi_resolve_numeric("no-such-host.invalid", 1000000000ull, &r, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "cannot resolve no-such-host.invalid"));
    usleep(20000);
}

static void *give_up_often(void *arg)
{
    (void)arg;
    for (int i = 0; i < 4; i++) {
        kvhi_resolved r;
        char err[200];
        if (kvhi_resolve_numeric("localhost", 5000000ull, &r, err, sizeof(err)) != -3)
            return (void *)1;
    }
    return NULL;
}

static void test_many_callers_giving_up_at_once_leave_nothing_behind(void **state)
{
    (void)state;
    atomic_store(&slow_ms, 200);
    pthread_t t[8];
    for (int i = 0; i < 8; i++)
        assert_int_equal(pthread_create(&t[i], NULL, give_up_often, NULL), 0);
    for (int i = 0; i < 8; i++) {
        void *rc;
        assert_int_equal(pthread_join(t[i], &rc), 0);
        assert_null(rc);
    }
    /* The 32 calls come within the first lookup's 200 ms: they share it
     * (a loaded machine may start a second one). */
    assert_true(atomic_load(&lookups_started) >= 1 && atomic_load(&lookups_started) <= 4);
    wait_lookups_ended();
}

static atomic_int held;

static int held_lookup(const char *node, const char *service, const struct addrinfo *hints, struct addrinfo **res)
{
    atomic_fetch_add(&lookups_started, 1);
    while (atomic_load(&held))
        usleep(1000);
    int rc = getaddrinfo(node, service, hints, res);
    atomic_fetch_add(&lookups_ended, 1);
    return rc;
}

/* A name the service has not answered yet is not asked again: callers
 * that gave up (engines opened and closed in a loop) leave one thread
 * behind, not one each; once it answers, the next caller asks afresh. */
static void test_callers_of_an_unanswered_name_share_its_lookup(void **state)
{
    (void)state;
    kvhi_resolver_getaddrinfo = held_lookup;
    atomic_store(&held, 1);
    kvhi_resolved r;
    char err[200];
    for (int i = 0; i < 50; i++)
        assert_int_equal(kvhi_resolve_numeric("localhost", 1000000ull, &r, err, sizeof(err)), -3);
    assert_int_equal(atomic_load(&lookups_started), 1);
    atomic_store(&held, 0);
    wait_lookups_ended();
    assert_int_equal(kvhi_resolve_numeric("localhost", 5000000000ull, &r, err, sizeof(err)), 0);
    assert_true(r.n >= 1);
    assert_int_equal(atomic_load(&lookups_started), 2);
    wait_lookups_ended();
}

static void test_the_remote_tier_opens_within_its_timeout_when_names_do_not_resolve(void **state)
{
    (void)state;
    atomic_store(&slow_ms, 3000);
    kvh_config c = tu_cfg(1, 1, 8, 4, KVH_DTYPE_F16, 8, 8, 0);
    c.remote_addrs = "kvh-redis.example:6379";
    c.remote_timeout_ms = 200;
    kvh_engine *e = NULL;
    uint64_t t0 = ms_now();
    kvh_status st = kvh_engine_open(&c, &e);
    uint64_t took = ms_now() - t0;
    if (st == KVH_ERR_UNSUPPORTED)
        skip(); /* built without the remote tier */
    assert_ok(st);
    assert_true(took < 2000);
    assert_true(atomic_load(&lookups_started) >= 1); /* kvh looked the name up, not hiredis */
    kvh_engine_close(e);
    wait_lookups_ended();
}

static void test_the_remote_tier_reaches_a_server_named_by_host_name(void **state)
{
    (void)state;
    if (!rt_available())
        skip();
    rt_cluster redis;
    if (rt_start_scratch(&redis, 1, NULL) != 0)
        skip();
    char addrs[64];
    snprintf(addrs, sizeof(addrs), "localhost:%d", redis.ports[0]);
    kvh_config c = tu_cfg(1, 1, 8, 4, KVH_DTYPE_F16, 8, 8, 0);
    c.remote_addrs = addrs;
    c.remote_timeout_ms = 2000;
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&c, &e);
    if (st == KVH_ERR_UNSUPPORTED) {
        rt_stop(&redis);
        skip();
    }
    assert_ok(st);
    kvh_seq s = tu_seq_new(e, 0);
    int32_t tokens[8];
    tu_iota(tokens, 8, 500);
    assert_ok(kvh_seq_append(e, s, tokens, 8));
    uint8_t k[16] = {1}, v[16] = {2};
    for (uint64_t t = 0; t < 8; t++)
        assert_ok(kvh_seq_write_kv(e, s, 0, t, 1, k, v));
    assert_ok(kvh_seq_persist(e, s));
    kvh_stats stats = {.struct_size = sizeof(stats)};
    assert_ok(kvh_engine_stats(e, &stats));
    kvh_engine_close(e);
    rt_stop(&redis);
    assert_true(stats.remote_uploads > 0);
    assert_int_equal(stats.remote_uploads_dropped, 0);
    assert_true(atomic_load(&lookups_started) >= 1);
    wait_lookups_ended();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_numeric_addresses_need_no_lookup, setup, teardown),
        cmocka_unit_test_setup_teardown(test_a_name_gives_its_numeric_addresses, setup, teardown),
        cmocka_unit_test_setup_teardown(test_a_slow_name_service_costs_the_budget_only, setup, teardown),
        cmocka_unit_test_setup_teardown(test_a_failed_lookup_says_why, setup, teardown),
        cmocka_unit_test_setup_teardown(test_many_callers_giving_up_at_once_leave_nothing_behind, setup, teardown),
        cmocka_unit_test_setup_teardown(test_callers_of_an_unanswered_name_share_its_lookup, setup, teardown),
        cmocka_unit_test_setup_teardown(test_the_remote_tier_opens_within_its_timeout_when_names_do_not_resolve, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_the_remote_tier_reaches_a_server_named_by_host_name, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
