/* kvh_last_error() after a call that succeeds is "" (kvh.h: "Detail of
 * the last failed call on this thread, or "" if none"), even when the
 * call met a failure on the way and went on: a full device tier, then
 * room in the host tier. And a failed call's detail survives until the
 * thread's next call. */
#include "test_util.h"

#include <errno.h>
#include <string.h>

/* f32, 2 heads of 4, 4 tokens a block. */
enum { L = 1, H = 2, D = 4, BT = 4 };

/* An engine whose device tier holds only pinned blocks (n_device of
 * them, returned in pinned[]), with n_host free host blocks. */
static kvh_engine *device_full_of_pinned(uint64_t n_device, uint64_t n_host, kvh_block *pinned)
{
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F32, n_device, n_host, 0);
    for (uint64_t i = 0; i < n_device; i++) {
        assert_ok(kvh_block_alloc(e, 0, &pinned[i]));
        assert_int_equal(tu_binfo(e, pinned[i]).tier, KVH_TIER_DEVICE);
        assert_ok(kvh_block_pin(e, pinned[i], 1));
    }
    return e;
}

static void release_all(kvh_engine *e, kvh_block *blocks, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        assert_ok(kvh_block_pin(e, blocks[i], 0));
        assert_ok(kvh_block_release(e, blocks[i]));
    }
}

static void test_an_allocation_that_falls_back_leaves_no_error(void **state)
{
    (void)state;
    kvh_block pinned[2], b;
    kvh_engine *e = device_full_of_pinned(2, 4, pinned);
    assert_ok(kvh_block_alloc(e, 0, &b));
    assert_string_equal(kvh_last_error(), ""); /* before any other call clears it */
    assert_int_equal(tu_binfo(e, b).tier, KVH_TIER_HOST);
    assert_ok(kvh_block_release(e, b));
    release_all(e, pinned, 2);
    assert_ok(tu_close(e));
}

static void test_an_append_that_falls_back_leaves_no_error(void **state)
{
    (void)state;
    kvh_block pinned[2];
    kvh_engine *e = device_full_of_pinned(2, 8, pinned);
    kvh_seq s = tu_seq_new(e, 0);
    int32_t t[3 * BT];
    tu_iota(t, 3 * BT, 100);
    assert_ok(kvh_seq_append(e, s, t, 3 * BT));
    assert_string_equal(kvh_last_error(), "");
    tu_write_pattern(e, s, L, H * D * sizeof(float), 7, 0, 3 * BT);
    assert_string_equal(kvh_last_error(), "");
    assert_true(tu_check_pattern(e, s, L, H * D * sizeof(float), 7, 0, 3 * BT));
    assert_string_equal(kvh_last_error(), "");
    assert_ok(kvh_seq_free(e, s));
    release_all(e, pinned, 2);
    assert_ok(tu_close(e));
}

static void test_a_failure_keeps_its_detail_until_the_next_call(void **state)
{
    (void)state;
    kvh_block pinned[2], b;
    kvh_engine *e = device_full_of_pinned(2, 0, pinned); /* no host tier: nowhere to fall back */
    assert_int_equal(kvh_block_alloc(e, 0, &b), KVH_ERR_NOSPACE);
    assert_true(kvh_last_error()[0] != '\0');
    assert_true(kvh_last_error()[0] != '\0'); /* reading it is not a call that clears it */
    kvh_tier_info info;
    info.struct_size = sizeof(info);
    assert_ok(kvh_tier_info_get(e, KVH_TIER_DEVICE, &info));
    assert_string_equal(kvh_last_error(), "");
    release_all(e, pinned, 2);
    assert_ok(tu_close(e));
}

/* A detail longer than the buffer kept its start and lost its end: with a
 * disk_path of 3,000 characters, the cause ("No such file or directory")
 * after the path was cut off. Its middle goes now. */
static void test_a_long_detail_keeps_its_cause(void **state)
{
    (void)state;
    char path[3100] = "/nonexistent-kvh-dir/";
    size_t n = strlen(path);
    memset(path + n, 'p', 3000);
    path[n + 3000] = '\0';
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F32, 4, 4, 0);
    c.disk_path = path;
    c.disk_bytes = 1 << 20;
    kvh_engine *e = NULL;
    assert_int_equal(kvh_engine_open(&c, &e), KVH_ERR_IO);
    const char *why = kvh_last_error();
    assert_true(strlen(why) < 1024);
    if (!strstr(why, " ... ") || !strstr(why, strerror(ENOENT)) || strncmp(why, "cannot create /nonexistent-kvh", 30))
        fail_msg("%s", why);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_an_allocation_that_falls_back_leaves_no_error, tu_teardown),
        cmocka_unit_test_teardown(test_an_append_that_falls_back_leaves_no_error, tu_teardown),
        cmocka_unit_test_teardown(test_a_failure_keeps_its_detail_until_the_next_call, tu_teardown),
        cmocka_unit_test_teardown(test_a_long_detail_keeps_its_cause, tu_teardown),
    };
    return cmocka_run_group_tests_name("last_error", tests, NULL, NULL);
}
