/* Clean host copies of promoted blocks (core/clean_copy.c), through the
 * public API and checked white-box where the kept slot is the subject:
 *
 *   - a published block promoted from the host tier keeps its host slot;
 *     demoting it again copies nothing (blocks_device_to_host unchanged,
 *     clean_copy_demotions counted), round after round, and every byte
 *     reads back right; kvh_tier_info counts the kept slot as free;
 *   - a write to a block that kept a copy (an immutable block private to
 *     its sequence, written in place) drops the copy at once: the next
 *     demotion copies the written bytes, never the stale ones; a write to a
 *     published block copies it on write and the new block goes down by
 *     a copy too;
 *   - a host tier full of kept copies still takes new blocks: the copies
 *     are taken back (clean_copies_reclaimed), nothing spills to disk;
 *   - a block freed while its copy is kept gives the slot back; truncating
 *     it drops the copy too, and so does a move straight to disk;
 *   - nothing is kept for a block that is not immutable (a partial one),
 *     nor while a holder still reads the slot the block left, nor on one
 *     arena (moves there copy nothing anyway).
 * test_clean_copy_mt.c runs promotions, demotions, writes and reads in
 * threads. */
#include "disk_test_util.h"

#include "core/engine.h"
#include "white_box_util.h"
#include "core/block.h"
#include "core/move.h"

static const dt_geo G = {2, 1, 32, 16, KVH_DTYPE_F16}; /* block = 4096 bytes */
#define TOKEN_ELEMS (1 * 32)                           /* heads * dim */

static void verify_a(kvh_engine *e, kvh_seq s, dt_content c, size_t n)
{
    char msg[256] = "";
    if (dt_verify(e, s, G, c, 0, n, msg, sizeof(msg)) != KVH_OK)
        fail_msg("%s", msg);
}

static uint32_t host_slots_taken(kvh_engine *e)
{
    wb_lock(e);
    uint32_t n = kvhi_slot_pool_used(&e->tiers[KVH_TIER_HOST].slots);
    wb_unlock(e);
    return n;
}

static uint32_t kept_slot(kvh_engine *e, kvh_seq s, uint64_t i)
{
    uint32_t b = wb_seq_block_index(e, s, i);
    wb_lock(e);
    uint32_t slot = e->clean.slot_of ? e->clean.slot_of[b] : KVHI_NO_BLOCK;
    wb_unlock(e);
    return slot;
}

/* Writes value v into every K and V element of tokens [pos, pos + n). */
static void write_value(kvh_engine *e, kvh_seq s, uint64_t pos, size_t n, uint16_t v)
{
    uint16_t buf[16 * TOKEN_ELEMS];
    assert_true(n <= 16);
    for (size_t i = 0; i < n * TOKEN_ELEMS; i++)
        buf[i] = v;
    for (uint32_t l = 0; l < G.layers; l++)
        dt_assert_ok(kvh_seq_write_kv(e, s, l, pos, n, buf, buf));
}

/* True when every K and V element of tokens [pos, pos + n) is v. */
static bool reads_value(kvh_engine *e, kvh_seq s, uint64_t pos, size_t n, uint16_t v)
{
    uint16_t k[16 * TOKEN_ELEMS], vv[16 * TOKEN_ELEMS];
    assert_true(n <= 16);
    for (uint32_t l = 0; l < G.layers; l++) {
        dt_assert_ok(kvh_seq_read_kv(e, s, l, pos, n, k, vv));
        for (size_t i = 0; i < n * TOKEN_ELEMS; i++)
            if (k[i] != v || vv[i] != v)
                return false;
    }
    return true;
}

static void promote(kvh_engine *e, kvh_seq s, uint64_t first, uint64_t n)
{
    dt_assert_ok(kvh_seq_acquire(e, s, first, n, NULL));
    dt_assert_ok(kvh_seq_release(e, s, first, n));
}

/* A failed assertion under wb_lock leaves the lock held: let it go, so
 * that the engine can be closed instead of the test hanging. */
static int teardown(void **state)
{
    wb_release_held_lock();
    return dt_teardown(state);
}

/* ---- the round trip ---- */

static void test_round_trip_without_write_copies_nothing(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("round-trip", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 4, 4, 16, 0);
    c.copy_moves = 1; /* two arenas, as a discrete GPU */
    kvh_engine *e = dt_open_a(&c);
    kvh_seq s;
    dt_content ct = dt_plain(5);
    dt_assert_ok(dt_build(e, G, ct, 2 * G.bt, 0, &s));
    dt_assert_ok(kvh_seq_migrate(e, s, 0, 2 * G.bt, KVH_TIER_HOST, NULL));
    for (int round = 0; round < 3; round++) {
        kvh_stats a = dt_stats(e);
        promote(e, s, 0, 2 * G.bt);
        kvh_stats u = dt_stats(e);
        assert_int_equal(u.blocks_host_to_device - a.blocks_host_to_device, 2);
        assert_int_equal(u.clean_copies_kept - a.clean_copies_kept, 2);
        assert_int_equal(dt_tier(e, KVH_TIER_HOST).clean_copies, 2);
        assert_int_not_equal(kept_slot(e, s, 0), KVHI_NO_BLOCK);
        /* The kept slots are taken in the pool but free to a caller. */
        assert_int_equal(host_slots_taken(e), 2);
        assert_int_equal(dt_tier(e, KVH_TIER_HOST).used_blocks, 0);
        assert_int_equal(dt_tier(e, KVH_TIER_DEVICE).used_blocks, 2);
        verify_a(e, s, ct, 2 * G.bt);

        dt_assert_ok(kvh_seq_migrate(e, s, 0, 2 * G.bt, KVH_TIER_HOST, NULL));
        kvh_stats d = dt_stats(e);
        assert_int_equal(d.blocks_device_to_host, u.blocks_device_to_host); /* not one copy */
        assert_int_equal(d.clean_copy_demotions - u.clean_copy_demotions, 2);
        assert_int_equal(dt_tier(e, KVH_TIER_HOST).clean_copies, 0);
        assert_int_equal(dt_binfo(e, s, 0).tier, KVH_TIER_HOST);
        assert_int_equal(dt_tier(e, KVH_TIER_DEVICE).used_blocks, 0);
        assert_int_equal(dt_tier(e, KVH_TIER_HOST).used_blocks, 2);
        assert_int_equal(host_slots_taken(e), 2);
        verify_a(e, s, ct, 2 * G.bt);
    }
    /* Eviction goes the same way: with the rest of the device tier pinned,
     * new blocks make room by sending the promoted ones to their copies. */
    promote(e, s, 0, 2 * G.bt);
    kvh_seq s2, s3[2];
    dt_content c2 = dt_plain(6), c3 = dt_plain(16);
    dt_assert_ok(dt_build(e, G, c2, 2 * G.bt, 0, &s2));
    dt_assert_ok(kvh_seq_pin(e, s2, 0, 2 * G.bt, 1));
    kvh_stats a = dt_stats(e);
    for (int i = 0; i < 2; i++) { /* pinned one by one: only s can leave */
        dt_assert_ok(dt_build(e, G, c3, G.bt, 0, &s3[i]));
        dt_assert_ok(kvh_seq_pin(e, s3[i], 0, G.bt, 1));
    }
    kvh_stats b = dt_stats(e);
    assert_int_equal(b.blocks_device_to_host, a.blocks_device_to_host);
    assert_int_equal(b.clean_copy_demotions - a.clean_copy_demotions, 2);
    assert_int_equal(b.evictions - a.evictions, 2);
    assert_int_equal(dt_binfo(e, s, 0).tier, KVH_TIER_HOST);
    assert_int_equal(dt_binfo(e, s, 1).tier, KVH_TIER_HOST);
    verify_a(e, s, ct, 2 * G.bt);
    verify_a(e, s2, c2, 2 * G.bt);
    for (int i = 0; i < 2; i++) {
        verify_a(e, s3[i], c3, G.bt);
        dt_assert_ok(kvh_seq_free(e, s3[i]));
    }
    dt_assert_ok(kvh_seq_free(e, s2));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
}

/* Straight down to disk, the copy is not used and not left behind: b
 * would hold a host slot while it lives on disk. */
static void test_demotion_past_the_host_drops_the_copy(void **state)
{
    (void)state;
    /* Written to disk by the move, or onto a clean disk copy (persisted). */
    for (int persisted = 0; persisted < 2; persisted++) {
        char dir[PATH_MAX];
        dt_scratch(persisted ? "past-host-persisted" : "past-host", dir, sizeof(dir));
        kvh_config c = dt_cfg(G, dir, 4, 4, 16, 0);
        c.copy_moves = 1;
        kvh_engine *e = dt_open_a(&c);
        kvh_seq s;
        dt_content ct = dt_plain(17);
        dt_assert_ok(dt_build(e, G, ct, G.bt, 0, &s));
        if (persisted)
            dt_assert_ok(kvh_seq_persist(e, s));
        dt_assert_ok(kvh_seq_migrate(e, s, 0, G.bt, KVH_TIER_HOST, NULL));
        promote(e, s, 0, G.bt);
        assert_int_equal(host_slots_taken(e), 1);
        kvh_stats a = dt_stats(e);
        dt_assert_ok(kvh_seq_migrate(e, s, 0, G.bt, KVH_TIER_DISK, NULL));
        kvh_stats d = dt_stats(e);
        assert_int_equal(dt_binfo(e, s, 0).tier, KVH_TIER_DISK);
        assert_int_equal(d.blocks_host_to_disk - a.blocks_host_to_disk, persisted ? 0 : 1);
        assert_int_equal(dt_tier(e, KVH_TIER_HOST).clean_copies, 0);
        assert_int_equal(d.clean_copy_demotions, a.clean_copy_demotions);
        assert_int_equal(host_slots_taken(e), 0);
        assert_int_equal(kept_slot(e, s, 0), KVHI_NO_BLOCK);
        verify_a(e, s, ct, G.bt);
        dt_assert_ok(kvh_seq_free(e, s));
        dt_assert_ok(dt_close(e));
    }
}

/* A partial block may still be written: nothing is kept for it. */
static void test_partial_block_keeps_nothing(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("partial", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 4, 4, 0, 0);
    c.copy_moves = 1; /* two arenas, as a discrete GPU */
    kvh_engine *e = dt_open_a(&c);
    kvh_seq s;
    dt_content ct = dt_plain(7);
    dt_assert_ok(dt_build(e, G, ct, G.bt / 2, 0, &s));
    dt_assert_ok(kvh_seq_migrate(e, s, 0, G.bt / 2, KVH_TIER_HOST, NULL));
    promote(e, s, 0, G.bt / 2);
    assert_int_equal(dt_tier(e, KVH_TIER_HOST).clean_copies, 0);
    assert_int_equal(host_slots_taken(e), 0);
    kvh_stats a = dt_stats(e);
    dt_assert_ok(kvh_seq_migrate(e, s, 0, G.bt / 2, KVH_TIER_HOST, NULL));
    assert_int_equal(dt_stats(e).blocks_device_to_host - a.blocks_device_to_host, 1);
    verify_a(e, s, ct, G.bt / 2);
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
}

/* One arena: device <-> host moves are re-accounted already. */
static void test_one_arena_keeps_nothing(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("one-arena", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 4, 4, 0, 0);
    c.copy_moves = 0;
    kvh_engine *e = dt_open_a(&c);
    if (!e->moves_in_place) {
        dt_assert_ok(dt_close(e));
        skip();
    }
    kvh_seq s;
    dt_content ct = dt_plain(8);
    dt_assert_ok(dt_build(e, G, ct, G.bt, 0, &s));
    dt_assert_ok(kvh_seq_migrate(e, s, 0, G.bt, KVH_TIER_HOST, NULL));
    promote(e, s, 0, G.bt);
    assert_int_equal(dt_tier(e, KVH_TIER_HOST).clean_copies, 0);
    dt_assert_ok(kvh_seq_migrate(e, s, 0, G.bt, KVH_TIER_HOST, NULL));
    assert_int_equal(dt_stats(e).clean_copy_demotions, 0);
    verify_a(e, s, ct, G.bt);
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
}

/* ---- writes ---- */

/* Two sequences of the same tokens: the second's block is immutable
 * (hashed, every cell written) but not published (the first one is), so
 * it is private and written in place. */
static void test_write_in_place_drops_the_copy(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("write-in-place", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 4, 4, 16, 0);
    c.copy_moves = 1; /* two arenas, as a discrete GPU */
    kvh_engine *e = dt_open_a(&c);
    kvh_seq first, s;
    dt_content ct = dt_plain(9);
    dt_assert_ok(dt_build(e, G, ct, G.bt, 0, &first));
    dt_assert_ok(dt_build(e, G, ct, G.bt, 0, &s));
    assert_int_equal(dt_binfo(e, s, 0).published, 0);
    uint32_t b = wb_seq_block_index(e, s, 0);
    dt_assert_ok(kvh_seq_migrate(e, s, 0, G.bt, KVH_TIER_HOST, NULL));
    promote(e, s, 0, G.bt);
    assert_int_not_equal(kept_slot(e, s, 0), KVHI_NO_BLOCK);

    write_value(e, s, 3, 2, 0x4000);                  /* 2.0 */
    assert_int_equal(wb_seq_block_index(e, s, 0), b); /* in place, no copy on write */
    assert_int_equal(kept_slot(e, s, 0), KVHI_NO_BLOCK);
    assert_int_equal(dt_tier(e, KVH_TIER_HOST).clean_copies, 0);
    assert_int_equal(host_slots_taken(e), 0);

    kvh_stats a = dt_stats(e);
    dt_assert_ok(kvh_seq_migrate(e, s, 0, G.bt, KVH_TIER_HOST, NULL));
    kvh_stats d = dt_stats(e);
    assert_int_equal(d.blocks_device_to_host - a.blocks_device_to_host, 1);
    assert_int_equal(d.clean_copy_demotions, a.clean_copy_demotions);
    assert_true(reads_value(e, s, 3, 2, 0x4000));
    verify_a(e, s, ct, 3);        /* the cells around the write keep theirs */
    verify_a(e, first, ct, G.bt); /* and the published twin all of its own */
    promote(e, s, 0, G.bt);       /* up again: the written bytes come up */
    assert_true(reads_value(e, s, 3, 2, 0x4000));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(kvh_seq_free(e, first));
    dt_assert_ok(dt_close(e));
}

/* A published block is copied on write: the copy is a new block, which
 * goes down by a copy; the original keeps its bytes (and its kept slot). */
static void test_write_to_published_block_copies_it(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("write-published", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 4, 4, 16, 0);
    c.copy_moves = 1; /* two arenas, as a discrete GPU */
    kvh_engine *e = dt_open_a(&c);
    kvh_seq s, twin;
    dt_content ct = dt_plain(10);
    dt_assert_ok(dt_build(e, G, ct, G.bt, 0, &s));
    assert_int_equal(dt_binfo(e, s, 0).published, 1);
    dt_assert_ok(kvh_seq_migrate(e, s, 0, G.bt, KVH_TIER_HOST, NULL));
    promote(e, s, 0, G.bt);
    assert_int_equal(dt_tier(e, KVH_TIER_HOST).clean_copies, 1);
    size_t matched = 0;
    dt_assert_ok(dt_match(e, ct, G.bt, &twin, &matched)); /* shares the published block */
    assert_int_equal(matched, G.bt);

    write_value(e, s, 0, G.bt, 0x3800); /* 0.5 */
    kvh_stats a = dt_stats(e);
    assert_int_equal(a.cow_copies, 1);
    dt_assert_ok(kvh_seq_migrate(e, s, 0, G.bt, KVH_TIER_HOST, NULL));
    assert_int_equal(dt_stats(e).blocks_device_to_host - a.blocks_device_to_host, 1);
    assert_true(reads_value(e, s, 0, G.bt, 0x3800));
    /* The shared block never changed: it still goes down for free. */
    a = dt_stats(e);
    dt_assert_ok(kvh_seq_migrate(e, twin, 0, G.bt, KVH_TIER_HOST, NULL));
    assert_int_equal(dt_stats(e).blocks_device_to_host, a.blocks_device_to_host);
    verify_a(e, twin, ct, G.bt);
    dt_assert_ok(kvh_seq_free(e, twin));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
}

/* ---- room ---- */

static void test_host_full_of_copies_admits_new_blocks(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("full-of-copies", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 4, 4, 16, 0);
    c.copy_moves = 1; /* two arenas, as a discrete GPU */
    kvh_engine *e = dt_open_a(&c);
    kvh_seq s;
    dt_content ct = dt_plain(11);
    dt_assert_ok(dt_build(e, G, ct, 4 * G.bt, 0, &s));
    dt_assert_ok(kvh_seq_migrate(e, s, 0, 4 * G.bt, KVH_TIER_HOST, NULL));
    promote(e, s, 0, 4 * G.bt);
    assert_int_equal(dt_tier(e, KVH_TIER_HOST).clean_copies, 4);
    assert_int_equal(host_slots_taken(e), 4);
    assert_int_equal(dt_tier(e, KVH_TIER_HOST).used_blocks, 0);
    /* The device blocks stay where they are: new blocks must go to the
     * host tier, whose every slot is a kept copy. */
    dt_assert_ok(kvh_seq_pin(e, s, 0, 4 * G.bt, 1));
    kvh_stats a = dt_stats(e);
    kvh_seq s2;
    dt_content c2 = dt_plain(12);
    dt_assert_ok(dt_build(e, G, c2, 4 * G.bt, 0, &s2));
    kvh_stats b = dt_stats(e);
    assert_int_equal(b.clean_copies_reclaimed - a.clean_copies_reclaimed, 4);
    assert_int_equal(dt_tier(e, KVH_TIER_HOST).clean_copies, 0);
    assert_int_equal(b.blocks_host_to_disk, a.blocks_host_to_disk); /* nothing spilled */
    assert_int_equal(b.blocks_device_to_host, a.blocks_device_to_host);
    assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, 0);
    assert_int_equal(dt_tier(e, KVH_TIER_HOST).used_blocks, 4);
    for (uint64_t i = 0; i < 4; i++)
        assert_int_equal(dt_binfo(e, s2, i).tier, KVH_TIER_HOST);
    /* Their copies gone, the first blocks go down by copies, pushing the
     * second ones to disk. */
    dt_assert_ok(kvh_seq_pin(e, s, 0, 4 * G.bt, 0));
    a = dt_stats(e);
    dt_assert_ok(kvh_seq_migrate(e, s, 0, 4 * G.bt, KVH_TIER_HOST, NULL));
    b = dt_stats(e);
    assert_int_equal(b.blocks_device_to_host - a.blocks_device_to_host, 4);
    assert_int_equal(b.clean_copy_demotions, a.clean_copy_demotions);
    verify_a(e, s, ct, 4 * G.bt);
    verify_a(e, s2, c2, 4 * G.bt);
    dt_assert_ok(kvh_seq_free(e, s2));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
}

/* ---- readers ---- */

/* A block read without the lock where it lies (a pool transfer, an
 * upload) and promoted meanwhile: the slot it left is still read, so it is
 * not kept (taking a kept copy back would hand it to another block under
 * the read); it is freed when the read ends, as before. */
static void test_slot_still_read_is_not_kept(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("still-read", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 4, 4, 0, 0);
    c.copy_moves = 1; /* two arenas, as a discrete GPU */
    kvh_engine *e = dt_open_a(&c);
    kvh_seq s;
    dt_content ct = dt_plain(18);
    dt_assert_ok(dt_build(e, G, ct, G.bt, 0, &s));
    dt_assert_ok(kvh_seq_migrate(e, s, 0, G.bt, KVH_TIER_HOST, NULL));
    uint32_t b = wb_seq_block_index(e, s, 0);
    wb_lock(e);
    kvhi_block_hold_reading(e, b);
    dt_assert_ok(kvhi_move_block(e, b, KVH_TIER_DEVICE, 0)); /* another thread's promotion */
    assert_int_equal(kvhi_blk(e, b)->tier, KVH_TIER_DEVICE);
    assert_int_equal(e->clean.count, 0);
    assert_int_equal(e->clean.slot_of[b], KVHI_NO_BLOCK);
    assert_int_equal(kvhi_slot_pool_used(&e->tiers[KVH_TIER_HOST].slots), 1); /* the read's */
    kvhi_block_unhold_reading(e, b);
    assert_int_equal(kvhi_slot_pool_used(&e->tiers[KVH_TIER_HOST].slots), 0);
    wb_unlock(e);
    /* Unread, the next promotion keeps its copy. */
    dt_assert_ok(kvh_seq_migrate(e, s, 0, G.bt, KVH_TIER_HOST, NULL));
    promote(e, s, 0, G.bt);
    assert_int_equal(dt_tier(e, KVH_TIER_HOST).clean_copies, 1);
    verify_a(e, s, ct, G.bt);
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
}

/* ---- lifetime ---- */

static void test_free_while_kept_gives_the_slot_back(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("free-while-kept", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 4, 4, 0, 0);
    c.copy_moves = 1; /* two arenas, as a discrete GPU */
    kvh_engine *e = dt_open_a(&c);
    kvh_seq first, s;
    dt_content ct = dt_plain(13);
    dt_assert_ok(dt_build(e, G, ct, G.bt, 0, &first));
    /* Two unpublished twins (freed when their sequence is). */
    for (int round = 0; round < 2; round++) {
        dt_assert_ok(dt_build(e, G, ct, G.bt, 0, &s));
        dt_assert_ok(kvh_seq_migrate(e, s, 0, G.bt, KVH_TIER_HOST, NULL));
        promote(e, s, 0, G.bt);
        assert_int_equal(dt_tier(e, KVH_TIER_HOST).clean_copies, 1);
        assert_int_equal(host_slots_taken(e), 1);
        if (round == 0) {
            dt_assert_ok(kvh_seq_free(e, s));
        } else {
            /* Truncating makes the block private first: its copy goes. */
            dt_assert_ok(kvh_seq_truncate(e, s, G.bt / 2));
            assert_int_equal(dt_tier(e, KVH_TIER_HOST).clean_copies, 0);
            assert_int_equal(host_slots_taken(e), 0);
            verify_a(e, s, ct, G.bt / 2);
            dt_assert_ok(kvh_seq_free(e, s));
        }
        assert_int_equal(dt_tier(e, KVH_TIER_HOST).clean_copies, 0);
        assert_int_equal(host_slots_taken(e), 0);
    }
    verify_a(e, first, ct, G.bt);
    dt_assert_ok(kvh_seq_free(e, first));
    dt_assert_ok(dt_close(e));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_round_trip_without_write_copies_nothing, teardown),
        cmocka_unit_test_teardown(test_demotion_past_the_host_drops_the_copy, teardown),
        cmocka_unit_test_teardown(test_partial_block_keeps_nothing, teardown),
        cmocka_unit_test_teardown(test_one_arena_keeps_nothing, teardown),
        cmocka_unit_test_teardown(test_write_in_place_drops_the_copy, teardown),
        cmocka_unit_test_teardown(test_write_to_published_block_copies_it, teardown),
        cmocka_unit_test_teardown(test_host_full_of_copies_admits_new_blocks, teardown),
        cmocka_unit_test_teardown(test_slot_still_read_is_not_kept, teardown),
        cmocka_unit_test_teardown(test_free_while_kept_gives_the_slot_back, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
