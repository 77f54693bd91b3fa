/* Latency histograms (kvh_latency_histogram_get, core/latency.c): bucket
 * bounds, argument rules, older struct sizes, counts that match the
 * operations done (demotions to disk, reads back, acquires that stalled or
 * did not), samples that time their own submission, and recording from several threads at once (TSan). */
#include <pthread.h>
#include <stddef.h>
#include <string.h>

#include "core/engine.h"
#include "core/latency.h"
#include "disk_test_util.h"

static const dt_geo GEO = {2, 2, 8, 4, KVH_DTYPE_F16};
#define BLOCKS 4u

static kvh_latency_histogram hist(kvh_engine *e, kvh_latency_kind kind)
{
    kvh_latency_histogram h = {.struct_size = sizeof(h)};
    dt_assert_ok(kvh_latency_histogram_get(e, kind, &h));
    assert_int_equal(h.kind, kind);
    uint64_t sum = 0;
    for (uint32_t i = 0; i < KVH_LATENCY_BUCKETS; i++)
        sum += h.counts[i];
    assert_int_equal(sum, h.count);
    return h;
}

static void test_bucket_bounds(void **state)
{
    (void)state;
    assert_int_equal(kvhi_latency_bucket(0), 0);
    assert_int_equal(kvhi_latency_bucket(KVH_LATENCY_BUCKET0_NS), 0);
    assert_int_equal(kvhi_latency_bucket(KVH_LATENCY_BUCKET0_NS + 1), 1);
    assert_int_equal(kvhi_latency_bucket(2 * KVH_LATENCY_BUCKET0_NS), 1);
    assert_int_equal(kvhi_latency_bucket(2 * KVH_LATENCY_BUCKET0_NS + 1), 2);
    for (uint32_t i = 1; i < KVH_LATENCY_BUCKETS - 1; i++) {
        uint64_t bound = (uint64_t)KVH_LATENCY_BUCKET0_NS << i;
        assert_int_equal(kvhi_latency_bucket(bound), i);
        assert_int_equal(kvhi_latency_bucket(bound + 1), i + 1);
    }
    assert_int_equal(kvhi_latency_bucket(UINT64_MAX), KVH_LATENCY_BUCKETS - 1);
}

static void test_bad_arguments_change_nothing(void **state)
{
    (void)state;
    kvh_config c = dt_cfg(GEO, NULL, 8, 8, 0, 1);
    kvh_engine *e = dt_open_a(&c);
    kvh_latency_histogram h;
    memset(&h, 0xab, sizeof(h));
    h.struct_size = sizeof(h);
    assert_int_equal(kvh_latency_histogram_get(e, KVH_LATENCY_KIND_COUNT, &h), KVH_ERR_INVALID_ARG);
    assert_int_equal(kvh_latency_histogram_get(e, (kvh_latency_kind)-1, &h), KVH_ERR_INVALID_ARG);
    assert_non_null(strstr(kvh_last_error(), "latency kind"));
    assert_int_equal(h.count, 0xababababababababull); /* untouched */
    assert_int_equal(kvh_latency_histogram_get(e, KVH_LATENCY_DISK_READ, NULL), KVH_ERR_INVALID_ARG);
    assert_int_equal(kvh_latency_histogram_get(NULL, KVH_LATENCY_DISK_READ, &h), KVH_ERR_INVALID_ARG);
    uint32_t bad_sizes[] = {0, 4, 12, (uint32_t)sizeof(h) + 8, UINT32_MAX};
    for (size_t i = 0; i < sizeof(bad_sizes) / sizeof(bad_sizes[0]); i++) {
        h.struct_size = bad_sizes[i];
        assert_int_equal(kvh_latency_histogram_get(e, KVH_LATENCY_DISK_READ, &h), KVH_ERR_STRUCT_SIZE);
        assert_int_equal(h.count, 0xababababababababull);
    }
    /* An older, shorter struct: filled up to its size, nothing past it. */
    h.struct_size = offsetof(kvh_latency_histogram, counts);
    dt_assert_ok(kvh_latency_histogram_get(e, KVH_LATENCY_ACQUIRE_STALL, &h));
    assert_int_equal(h.struct_size, offsetof(kvh_latency_histogram, counts));
    assert_int_equal(h.count, 0);
    assert_int_equal(h.sum_ns, 0);
    assert_int_equal(h.counts[0], 0xababababababababull);
    dt_assert_ok(dt_close(e));
}

/* Demote a sequence to disk, acquire it back: one write and one read per
 * block, one stalled acquire; a second acquire finds it resident. */
static void test_counts_match_the_operations(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("latency", dir, sizeof(dir));
    kvh_config c = dt_cfg(GEO, dir, 2 * BLOCKS, 2 * BLOCKS, 4 * BLOCKS, 1);
    kvh_engine *e = dt_open_a(&c);
    kvh_seq s;
    dt_assert_ok(dt_build(e, GEO, dt_plain(3), BLOCKS * GEO.bt, 0, &s));
    for (uint32_t k = 0; k < KVH_LATENCY_KIND_COUNT; k++)
        assert_int_equal(hist(e, (kvh_latency_kind)k).count, 0);

    kvh_stats s0 = dt_stats(e);
    dt_assert_ok(kvh_seq_migrate(e, s, 0, BLOCKS * GEO.bt, KVH_TIER_DISK, NULL));
    kvh_stats s1 = dt_stats(e);
    kvh_latency_histogram w = hist(e, KVH_LATENCY_DISK_WRITE);
    assert_int_equal(s1.blocks_host_to_disk - s0.blocks_host_to_disk, BLOCKS);
    assert_int_equal(w.count, (s1.blocks_host_to_disk - s0.blocks_host_to_disk) +
                                  (s1.disk_copies_written - s0.disk_copies_written));
    assert_true(w.sum_ns > 0);
    assert_int_equal(hist(e, KVH_LATENCY_DISK_READ).count, 0);
    assert_int_equal(hist(e, KVH_LATENCY_ACQUIRE_STALL).count, 0);

    dt_assert_ok(kvh_seq_acquire(e, s, 0, BLOCKS * GEO.bt, NULL));
    kvh_stats s2 = dt_stats(e);
    kvh_latency_histogram r = hist(e, KVH_LATENCY_DISK_READ);
    kvh_latency_histogram a = hist(e, KVH_LATENCY_ACQUIRE_STALL);
    assert_int_equal(s2.blocks_disk_to_host - s1.blocks_disk_to_host, BLOCKS);
    assert_int_equal(r.count, BLOCKS);
    assert_int_equal(a.count, 1);
    assert_int_equal(a.sum_ns, s2.acquire_stall_ns - s1.acquire_stall_ns);
    /* The stall covered the reads. */
    assert_true(a.sum_ns >= r.sum_ns / BLOCKS);

    dt_assert_ok(kvh_seq_acquire(e, s, 0, BLOCKS * GEO.bt, NULL)); /* resident: no stall */
    assert_int_equal(hist(e, KVH_LATENCY_ACQUIRE_STALL).count, 1);
    dt_assert_ok(kvh_seq_release(e, s, 0, BLOCKS * GEO.bt));
    dt_assert_ok(kvh_seq_release(e, s, 0, BLOCKS * GEO.bt));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
}

/* A persist of more blocks than one disk submission carries: each
 * block's sample is its own submission's time (kvh.h), so the samples
 * add up to at most the blocks a submission carries times the call's
 * time; as the whole batch's time each, they added up to 64 times it. */
static void test_samples_time_their_own_submission(void **state)
{
    (void)state;
    enum { N = 64, PER_SUBMISSION = 4 };
    char dir[PATH_MAX];
    dt_scratch("latency-persist", dir, sizeof(dir));
    kvh_config c = dt_cfg(GEO, dir, 2 * N, 2 * N, 4 * N, 0);
    c.disk_queue_depth = PER_SUBMISSION; /* a lane carries this many blocks */
    kvh_engine *e = dt_open_a(&c);
    kvh_seq s;
    dt_assert_ok(dt_build(e, GEO, dt_plain(5), N * GEO.bt, 0, &s));
    double t0 = dt_now();
    dt_assert_ok(kvh_seq_persist(e, s));
    uint64_t call_ns = (uint64_t)((dt_now() - t0) * 1e9) + 1;
    kvh_latency_histogram w = hist(e, KVH_LATENCY_DISK_WRITE);
    assert_int_equal(w.count, N);
    if (w.sum_ns > PER_SUBMISSION * call_ns)
        fail_msg("%d samples add up to %llu ns against a %llu ns persist", N, (unsigned long long)w.sum_ns,
                 (unsigned long long)call_ns);
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
}

#define THREADS 4
#define SAMPLES 20000

static void *record_many(void *p)
{
    kvhi_latency *l = p;
    for (uint64_t i = 0; i < SAMPLES; i++)
        kvhi_latency_record(l, KVH_LATENCY_DISK_READ, (i % 7) * KVH_LATENCY_BUCKET0_NS);
    return NULL;
}

/* Samples recorded from several threads at once, with readers alongside,
 * are all counted. */
static void test_concurrent_records_all_count(void **state)
{
    (void)state;
    kvh_config c = dt_cfg(GEO, NULL, 8, 8, 0, 1);
    kvh_engine *e = dt_open_a(&c);
    pthread_t t[THREADS];
    for (int i = 0; i < THREADS; i++)
        assert_int_equal(pthread_create(&t[i], NULL, record_many, &e->latency), 0);
    uint64_t last = 0;
    for (int i = 0; i < 100; i++) {
        kvh_latency_histogram h = hist(e, KVH_LATENCY_DISK_READ);
        assert_true(h.count >= last); /* never goes back */
        last = h.count;
    }
    for (int i = 0; i < THREADS; i++)
        assert_int_equal(pthread_join(t[i], NULL), 0);
    kvh_latency_histogram h = hist(e, KVH_LATENCY_DISK_READ);
    assert_int_equal(h.count, (uint64_t)THREADS * SAMPLES);
    uint64_t per_thread_ns = 0;
    for (uint64_t i = 0; i < SAMPLES; i++)
        per_thread_ns += (i % 7) * KVH_LATENCY_BUCKET0_NS;
    assert_int_equal(h.sum_ns, THREADS * per_thread_ns);
    assert_int_equal(hist(e, KVH_LATENCY_DISK_WRITE).count, 0);
    dt_assert_ok(dt_close(e));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bucket_bounds),
        cmocka_unit_test_teardown(test_bad_arguments_change_nothing, dt_teardown),
        cmocka_unit_test_teardown(test_counts_match_the_operations, dt_teardown),
        cmocka_unit_test_teardown(test_samples_time_their_own_submission, dt_teardown),
        cmocka_unit_test_teardown(test_concurrent_records_all_count, dt_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
