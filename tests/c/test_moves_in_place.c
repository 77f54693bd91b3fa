/* Moves between the device and host tiers on one arena (the CPU backend's
 * default): a block changes tier without its bytes moving (same slot,
 * same address), both tiers keep their capacity, no two live blocks ever
 * share a slot, and everything reads back intact through evictions,
 * swaps, the disk tier and attention. With copy_moves, or where the tiers
 * differ in form (a KV codec), moves copy. */
#include <stdbool.h>

#include "test_util.h"

enum { L = 2, H = 2, D = 8, BT = 4 };
static const size_t TOK = H * D * 4;

static kvh_engine *open_engine(uint64_t dev, uint64_t host, uint32_t threads, bool copies, uint32_t codec)
{
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F32, dev, host, threads);
    c.copy_moves = copies;
    c.kv_codec = codec;
    return tu_open_cfg(&c);
}

static kvh_seq make_seq(kvh_engine *e, uint32_t blocks, uint64_t tag)
{
    kvh_seq s = tu_seq_new(e, 0);
    int32_t t[256];
    tu_iota(t, blocks * BT, (int32_t)(tag * 10000));
    assert_ok(kvh_seq_append(e, s, t, blocks * BT));
    tu_write_pattern(e, s, L, TOK, tag, 0, blocks * BT);
    return s;
}

static void block_keeps_its_bytes_where_they_are(void **state)
{
    (void)state;
    kvh_engine *e = open_engine(4, 8, 0, false, KVH_CODEC_NONE);
    kvh_tier_info dev = tu_tier(e, KVH_TIER_DEVICE), host = tu_tier(e, KVH_TIER_HOST);
    assert_ptr_equal(dev.base, host.base); /* one arena */
    assert_int_equal(dev.capacity_blocks, 4);
    assert_int_equal(host.capacity_blocks, 8);
    kvh_seq s = make_seq(e, 2, 1);
    kvh_block_info before = tu_seq_binfo(e, s, 0);
    assert_int_equal(before.tier, KVH_TIER_DEVICE);
    kvh_stats s0 = tu_stats(e);
    assert_ok(kvh_seq_migrate(e, s, 0, 2 * BT, KVH_TIER_HOST, NULL));
    kvh_block_info after = tu_seq_binfo(e, s, 0);
    assert_int_equal(after.tier, KVH_TIER_HOST);
    assert_int_equal(after.slot, before.slot); /* same bytes, same place */
    kvh_stats s1 = tu_stats(e);
    assert_int_equal(s1.blocks_moved_in_place - s0.blocks_moved_in_place, 2);
    assert_int_equal(s1.bytes_device_to_host, 0);
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, 0);
    assert_int_equal(tu_tier(e, KVH_TIER_HOST).used_blocks, 2);
    assert_true(tu_check_pattern(e, s, L, TOK, 1, 0, 2 * BT));
    assert_ok(kvh_seq_migrate(e, s, 0, 2 * BT, KVH_TIER_DEVICE, NULL));
    assert_int_equal(tu_seq_binfo(e, s, 0).slot, before.slot);
    assert_int_equal(tu_stats(e).bytes_host_to_device, 0);
    assert_true(tu_check_pattern(e, s, L, TOK, 1, 0, 2 * BT));
}

/* Every live block in its own slot, inside the arena. */
static void check_slots(kvh_engine *e, kvh_seq *seqs, const uint32_t *blocks, uint32_t n_seqs, uint64_t total)
{
    uint8_t *seen = calloc(total, 1);
    for (uint32_t i = 0; i < n_seqs; i++)
        for (uint32_t b = 0; b < blocks[i]; b++) {
            kvh_block_info bi = tu_seq_binfo(e, seqs[i], b);
            if (bi.tier == KVH_TIER_DISK)
                continue;
            assert_true(bi.slot < total);
            assert_int_equal(seen[bi.slot], 0);
            seen[bi.slot] = 1;
        }
    free(seen);
    assert_true(tu_tier(e, KVH_TIER_DEVICE).used_blocks <= tu_tier(e, KVH_TIER_DEVICE).capacity_blocks);
    assert_true(tu_tier(e, KVH_TIER_HOST).used_blocks <= tu_tier(e, KVH_TIER_HOST).capacity_blocks);
}

/* Random acquires, releases and migrations over more blocks than memory
 * holds (a disk tier below): slots stay unique and the data intact. */
static void random_moves_keep_data_and_slots(void **state)
{
    uint32_t threads = *(uint32_t *)*state;
    char dir[512];
    const char *base = getenv("KVH_TEST_TMPDIR");
    snprintf(dir, sizeof(dir), "%s/store-%u", base && base[0] ? base : "/tmp", threads);
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F32, 6, 10, threads);
    c.disk_path = dir;
    c.disk_bytes = 64ull * (tu_block_bytes_of(L, H, D, BT, KVH_DTYPE_F32) + 8192);
    c.disk_flags = KVH_DISK_RESET_ON_MISMATCH;
    kvh_engine *e = tu_open_cfg(&c);
    enum { NS = 6 };
    kvh_seq s[NS];
    uint32_t blocks[NS];
    for (uint32_t i = 0; i < NS; i++) {
        blocks[i] = 3 + i % 3;
        s[i] = make_seq(e, blocks[i], 10 + i);
    }
    tu_rng r = {tu_seed(5)};
    for (int step = 0; step < 400; step++) {
        uint32_t i = (uint32_t)tu_below(&r, NS), b = (uint32_t)tu_below(&r, blocks[i]);
        switch (tu_below(&r, 4)) {
        case 0:
            assert_ok(kvh_seq_acquire(e, s[i], (uint64_t)b * BT, BT, NULL));
            assert_int_equal(tu_seq_binfo(e, s[i], b).tier, KVH_TIER_DEVICE);
            assert_ok(kvh_seq_release(e, s[i], (uint64_t)b * BT, BT));
            break;
        case 1:
            assert_ok(kvh_seq_migrate(e, s[i], (uint64_t)b * BT, BT, KVH_TIER_HOST, NULL));
            break;
        case 2:
            assert_ok(kvh_seq_migrate(e, s[i], (uint64_t)b * BT, BT, KVH_TIER_DISK, NULL));
            break;
        default:
            assert_ok(kvh_seq_migrate(e, s[i], 0, (uint64_t)blocks[i] * BT, KVH_TIER_DEVICE, NULL));
            break;
        }
        /* 16 slots of device and host tiers, and the host tier's spare
         * (it has a disk tier below): its slot may hold a block. */
        if (step % 50 == 0)
            check_slots(e, s, blocks, NS, 17);
    }
    check_slots(e, s, blocks, NS, 17);
    for (uint32_t i = 0; i < NS; i++)
        assert_true(tu_check_pattern(e, s[i], L, TOK, 10 + i, 0, blocks[i] * BT));
    kvh_stats st = tu_stats(e);
    assert_true(st.blocks_moved_in_place > 0);
    assert_true(st.blocks_host_to_disk > 0 && st.blocks_disk_to_host > 0);
}

/* Attention reads device blocks by slot from the arena's base: blocks in
 * slots of the arena's host part (given to the device tier in exchange for
 * ones that moved down) read the same as on an engine whose moves copy. */
static void attention_after_moves(void **state)
{
    (void)state;
    float q[H * D], out[2][H * D];
    tu_rng r = {3};
    for (size_t i = 0; i < H * D; i++)
        q[i] = (float)tu_below(&r, 1000) / 500.0f - 1.0f;
    kvh_attention_params p;
    assert_ok(kvh_attention_params_init(&p, sizeof(p)));
    p.scale = 0.5f;
    for (int copies = 0; copies < 2; copies++) {
        kvh_engine *e = open_engine(4, 8, 0, copies, KVH_CODEC_NONE);
        kvh_seq s = make_seq(e, 3, 7);
        kvh_seq other = make_seq(e, 4, 8); /* pushes s down */
        assert_int_equal(tu_seq_binfo(e, s, 0).tier, KVH_TIER_HOST);
        bool high = false;
        for (uint32_t b = 0; b < 4; b++)
            high |= tu_seq_binfo(e, other, b).slot >= 4;
        assert_true(high == !copies); /* in place: slots of the host part */
        assert_ok(kvh_attention_decode(e, 1, &other, 1, q, out[copies], &p));
        assert_ok(tu_close(e));
    }
    assert_memory_equal(out[0], out[1], sizeof(out[0]));
}

/* copy_moves, or tiers of different forms: moves copy. */
static void copies_where_asked_or_needed(void **state)
{
    (void)state;
    for (int variant = 0; variant < 2; variant++) {
        kvh_engine *e =
            variant ? open_engine(4, 8, 0, false, KVH_CODEC_INT8) : open_engine(4, 8, 0, true, KVH_CODEC_NONE);
        assert_ptr_not_equal(tu_tier(e, KVH_TIER_DEVICE).base, tu_tier(e, KVH_TIER_HOST).base);
        kvh_seq s = make_seq(e, 2, 3);
        assert_ok(kvh_seq_migrate(e, s, 0, 2 * BT, KVH_TIER_HOST, NULL));
        kvh_stats st = tu_stats(e);
        assert_int_equal(st.blocks_moved_in_place, 0);
        assert_int_equal(st.blocks_device_to_host, 2);
        if (!variant)
            assert_true(tu_check_pattern(e, s, L, TOK, 3, 0, 2 * BT));
        assert_ok(tu_close(e));
    }
}

static void bad_copy_moves_value(void **state)
{
    (void)state;
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F32, 4, 8, 0);
    c.copy_moves = 2;
    kvh_engine *e = NULL;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(&c, &e));
    assert_null(e);
}

static uint32_t T0 = 0, T2 = 2;

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(block_keeps_its_bytes_where_they_are, tu_teardown),
        cmocka_unit_test_prestate_setup_teardown(random_moves_keep_data_and_slots, NULL, tu_teardown, &T0),
        cmocka_unit_test_prestate_setup_teardown(random_moves_keep_data_and_slots, NULL, tu_teardown, &T2),
        cmocka_unit_test_teardown(attention_after_moves, tu_teardown),
        cmocka_unit_test_teardown(copies_where_asked_or_needed, tu_teardown),
        cmocka_unit_test_teardown(bad_copy_moves_value, tu_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
