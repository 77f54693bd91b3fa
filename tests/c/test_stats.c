/* Engine counters (kvh_stats) mean what their names and kvh.h say: what
 * persist wrote, where a matched prefix was found, which accesses are
 * lookups, and that an older, shorter struct is still filled. */
#include <limits.h>
#include <stddef.h>

#include "disk_test_util.h"

static const dt_geo GEO = {2, 2, 8, 4, KVH_DTYPE_F16};

static kvh_engine *open_at(const char *dir, uint64_t dev, uint64_t host)
{
    kvh_config c = dt_cfg(GEO, dir, dev, host, dir ? 32 : 0, 1);
    return dt_open_a(&c);
}

/* Persist writes copies (the blocks stay where they are) and says so;
 * persisting again writes nothing new but still counts what it made
 * durable. */
static void test_persist_counts_what_it_wrote(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("persist", dir, sizeof(dir));
    kvh_engine *e = open_at(dir, 16, 16);
    kvh_seq s;
    dt_assert_ok(dt_build(e, GEO, dt_plain(1), 4 * GEO.bt + 2, 0, &s)); /* 4 full blocks and a partial one */
    kvh_stats a = dt_stats(e);
    dt_assert_ok(kvh_seq_persist(e, s));
    kvh_stats b = dt_stats(e);
    uint64_t slot_data = dt_block_bytes(GEO);
    assert_int_equal(b.blocks_persisted - a.blocks_persisted, 4);
    assert_int_equal(b.disk_copies_written - a.disk_copies_written, 4);
    assert_int_equal(b.bytes_disk_copies_written - a.bytes_disk_copies_written, 4 * slot_data);
    /* Copies, not moves: the blocks stay in the device tier. */
    assert_int_equal(b.blocks_host_to_disk, a.blocks_host_to_disk);
    for (uint64_t i = 0; i < 4; i++)
        assert_int_equal(dt_binfo(e, s, i).tier, KVH_TIER_DEVICE);
    dt_assert_ok(kvh_seq_persist(e, s));
    kvh_stats c = dt_stats(e);
    assert_int_equal(c.blocks_persisted - b.blocks_persisted, 4);
    assert_int_equal(c.disk_copies_written, b.disk_copies_written);
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
}

/* A prefix found on disk by a later engine is counted as found on disk;
 * reading it afterwards is a lookup hit where it then lies. */
static void test_prefix_found_on_disk(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("prefix", dir, sizeof(dir));
    kvh_engine *e = open_at(dir, 16, 16);
    kvh_seq s;
    dt_assert_ok(dt_build(e, GEO, dt_plain(2), 4 * GEO.bt, 0, &s));
    dt_assert_ok(kvh_seq_persist(e, s));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));

    e = open_at(dir, 16, 16);
    kvh_stats a = dt_stats(e);
    size_t m = 0;
    char msg[256] = "";
    if (dt_match_verify(e, GEO, dt_plain(2), 4 * GEO.bt, &m, msg, sizeof(msg)) != KVH_OK)
        fail_msg("%s", msg);
    assert_int_equal(m, 4 * GEO.bt);
    kvh_stats b = dt_stats(e);
    assert_int_equal(b.prefix_queries - a.prefix_queries, 1);
    assert_int_equal(b.prefix_hit_blocks - a.prefix_hit_blocks, 4);
    assert_int_equal(b.prefix_hit_tokens - a.prefix_hit_tokens, 4 * GEO.bt);
    assert_int_equal(b.prefix_hit_blocks_disk - a.prefix_hit_blocks_disk, 4);
    assert_int_equal(b.prefix_hit_blocks_host - a.prefix_hit_blocks_host, 0);
    assert_int_equal(b.blocks_disk_to_host - a.blocks_disk_to_host, 4);
    /* dt_match_verify read every layer of the 4 blocks once matched. */
    assert_int_equal(b.lookups - a.lookups, 4 * GEO.layers);
    assert_int_equal(b.lookups, b.hits_device + b.hits_host + b.hits_disk);

    /* Matched again, now in memory: found in the host tier. */
    kvh_seq t;
    dt_assert_ok(dt_match(e, dt_plain(2), 4 * GEO.bt, &t, &m));
    kvh_stats c = dt_stats(e);
    assert_int_equal(c.prefix_hit_blocks - b.prefix_hit_blocks, 4);
    assert_int_equal(c.prefix_hit_blocks_disk, b.prefix_hit_blocks_disk);
    uint64_t host_or_device = (c.prefix_hit_blocks_host - b.prefix_hit_blocks_host);
    assert_true(host_or_device <= 4);
    dt_assert_ok(kvh_seq_free(e, t));
    dt_assert_ok(dt_close(e));
}

/* Filling cells is making a block; rewriting them, reading and acquiring
 * are uses, each a lookup hit in the block's tier. */
static void test_lookups_count_uses(void **state)
{
    (void)state;
    kvh_engine *e = open_at(NULL, 16, 16);
    kvh_seq s;
    dt_assert_ok(kvh_seq_create(e, 0, &s));
    kvh_stats a = dt_stats(e);
    dt_assert_ok(dt_extend(e, s, GEO, dt_plain(3), 0, 2 * GEO.bt)); /* fills 2 blocks, every layer */
    kvh_stats b = dt_stats(e);
    assert_int_equal(b.lookups, a.lookups);
    /* Rewrite one layer of both blocks: two uses. */
    size_t tb = dt_tok_bytes(GEO);
    uint8_t *k = calloc(2 * GEO.bt, tb), *v = calloc(2 * GEO.bt, tb);
    assert_non_null(k);
    assert_non_null(v);
    dt_assert_ok(kvh_seq_write_kv(e, s, 1, 0, 2 * GEO.bt, k, v));
    kvh_stats c = dt_stats(e);
    assert_int_equal(c.lookups - b.lookups, 2);
    assert_int_equal(c.hits_device - b.hits_device, 2);
    dt_assert_ok(kvh_seq_read_kv(e, s, 0, 0, GEO.bt, k, v)); /* one block */
    dt_assert_ok(kvh_seq_acquire(e, s, 0, 2 * GEO.bt, NULL));
    dt_assert_ok(kvh_seq_release(e, s, 0, 2 * GEO.bt));
    kvh_stats d = dt_stats(e);
    assert_int_equal(d.lookups - c.lookups, 3);
    assert_int_equal(d.lookups, d.hits_device + d.hits_host + d.hits_disk);
    free(k);
    free(v);
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
}

/* A block is counted in the tier it is in when the call asks for it, also
 * when the call then fails: reads and writes counted them after their own
 * moves (a block read back from disk as a host hit, a copy-on-write of a
 * host block as a device hit), and not at all past a failure. */
static void test_lookups_count_the_tier_asked_in_and_failed_calls(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("stats-asked", dir, sizeof(dir));
    kvh_config c = dt_cfg(GEO, dir, 2, 2, 32, 0);
    kvh_engine *e = dt_open_a(&c);
    kvh_seq d, pinned_dev, pinned_host;
    dt_assert_ok(dt_build(e, GEO, dt_plain(11), 2 * GEO.bt, 0, &d));
    dt_assert_ok(kvh_seq_migrate(e, d, 0, 2 * GEO.bt, KVH_TIER_DISK, NULL));
    int32_t tk[2 * 4];
    dt_tokens(dt_plain(12), 0, 2 * GEO.bt, tk);
    dt_assert_ok(kvh_seq_create(e, 0, &pinned_host));
    dt_assert_ok(kvh_seq_append(e, pinned_host, tk, 2 * GEO.bt));
    dt_assert_ok(kvh_seq_migrate(e, pinned_host, 0, 2 * GEO.bt, KVH_TIER_HOST, NULL));
    dt_assert_ok(kvh_seq_pin(e, pinned_host, 0, 2 * GEO.bt, 1));
    dt_tokens(dt_plain(13), 0, 2 * GEO.bt, tk);
    dt_assert_ok(kvh_seq_create(e, 0, &pinned_dev));
    dt_assert_ok(kvh_seq_append(e, pinned_dev, tk, 2 * GEO.bt));
    dt_assert_ok(kvh_seq_pin(e, pinned_dev, 0, 2 * GEO.bt, 1));
    size_t tb = dt_tok_bytes(GEO);
    uint8_t *k = calloc(2 * GEO.bt, tb), *v = calloc(2 * GEO.bt, tb);
    assert_non_null(k);
    assert_non_null(v);
    /* Both memory tiers full of pinned blocks: every call fails, and
     * counts both blocks, on disk. */
    for (int call = 0; call < 3; call++) {
        kvh_stats a = dt_stats(e);
        kvh_status st = call == 0   ? kvh_seq_acquire(e, d, 0, 2 * GEO.bt, NULL)
                        : call == 1 ? kvh_seq_read_kv(e, d, 0, 0, 2 * GEO.bt, k, v)
                                    : kvh_seq_write_kv(e, d, 0, 0, 2 * GEO.bt, k, v);
        assert_int_equal(st, KVH_ERR_NOSPACE);
        kvh_stats b = dt_stats(e);
        assert_int_equal(b.lookups - a.lookups, 2);
        assert_int_equal(b.hits_disk - a.hits_disk, 2);
    }
    /* Room again: a write over the blocks on disk counts them there,
     * before it brings them in (and copies them, published). */
    dt_assert_ok(kvh_seq_pin(e, pinned_dev, 0, 2 * GEO.bt, 0));
    dt_assert_ok(kvh_seq_pin(e, pinned_host, 0, 2 * GEO.bt, 0));
    kvh_stats a = dt_stats(e);
    dt_assert_ok(kvh_seq_write_kv(e, d, 1, 0, 2 * GEO.bt, k, v));
    kvh_stats b = dt_stats(e);
    assert_int_equal(b.lookups - a.lookups, 2);
    assert_int_equal(b.hits_disk - a.hits_disk, 2);
    free(k);
    free(v);
    dt_assert_ok(kvh_seq_free(e, d));
    dt_assert_ok(kvh_seq_free(e, pinned_dev));
    dt_assert_ok(kvh_seq_free(e, pinned_host));
    dt_assert_ok(dt_close(e));
}

/* A caller built against the previous kvh_stats gets its fields filled
 * and nothing written past its size. */
static void test_older_struct_size(void **state)
{
    (void)state;
    kvh_engine *e = open_at(NULL, 4, 4);
    size_t old_size = offsetof(kvh_stats, prefix_hit_blocks_host);
    union {
        kvh_stats s;
        uint8_t bytes[sizeof(kvh_stats)];
    } u;
    memset(&u, 0xEE, sizeof(u));
    u.s.struct_size = (uint32_t)old_size;
    dt_assert_ok(kvh_engine_stats(e, &u.s));
    assert_int_equal(u.s.blocks_allocated, 0);
    for (size_t i = old_size; i < sizeof(u); i++)
        assert_int_equal(u.bytes[i], 0xEE);
    u.s.struct_size = (uint32_t)sizeof(kvh_stats) + 8;
    dt_assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_engine_stats(e, &u.s));
    dt_assert_ok(dt_close(e));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_persist_counts_what_it_wrote, dt_teardown),
        cmocka_unit_test_teardown(test_prefix_found_on_disk, dt_teardown),
        cmocka_unit_test_teardown(test_lookups_count_uses, dt_teardown),
        cmocka_unit_test_teardown(test_lookups_count_the_tier_asked_in_and_failed_calls, dt_teardown),
        cmocka_unit_test_teardown(test_older_struct_size, dt_teardown),
    };
    return cmocka_run_group_tests_name("stats", tests, NULL, NULL);
}
