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
 *   - a range migrated to a full host tier sends its blocks with copies
 *     down onto them first, rather than let the others take those slots;
 *   - a host tier full of kept copies still takes new blocks (built,
 *     allocated or offloaded by a pool batch): the copies are taken back
 *     (clean_copies_reclaimed), nothing spills to disk;
 *   - a block freed while its copy is kept gives the slot back; truncating
 *     it drops the copy too, and so does a move straight to disk;
 *   - nothing is kept for a block that is not immutable (a partial one),
 *     nor while a holder still reads the slot the block left, nor on one
 *     arena (moves there copy nothing anyway);
 *   - weights registered into a host tier full of copies take the copies'
 *     slots (core/weight_chunks.c), evicting nothing, and so do clean
 *     weights leaving the device tier; an agent at its device quota
 *     evicts its own blocks onto their copies with its count exact;
 *   - a fork's write copies on write and leaves the parent's copy; a write
 *     after a trip through disk reaches the disk, never the old bytes;
 *   - under a KV codec a demotion onto the copy reads back exactly what
 *     the device tier read;
 *   - closing with copies kept and moves queued leaks nothing.
 * test_clean_copy_mt.c runs promotions, demotions, writes and reads in
 * threads. */
#include "disk_test_util.h"
#include "pool_test_util.h"

#include "core/engine.h"
#include "white_box_util.h"
#include "core/block.h"
#include "core/move.h"
#include "core/tier.h"

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
    /* The spare held back (core/host_spare.h) is no block's. */
    uint32_t n = kvhi_slot_pool_used(&e->tiers[KVH_TIER_HOST].slots) - kvhi_host_spare_held(e);
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

/* A scratch store and an engine whose device and host tiers are two
 * arenas (copy_moves, as a discrete GPU's): where copies are kept. */
static kvh_engine *open_two_arenas(const char *name, char *dir, size_t dir_size, uint64_t dev_blocks,
                                   uint64_t host_blocks, uint64_t disk_slots, uint32_t threads, kvh_config *c)
{
    dt_scratch(name, dir, dir_size);
    *c = dt_cfg(G, dir, dev_blocks, host_blocks, disk_slots, threads);
    c->copy_moves = 1;
    return dt_open_a(c);
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
    kvh_config c;
    kvh_engine *e = open_two_arenas("round-trip", dir, sizeof(dir), 4, 4, 16, 0, &c);
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
        kvh_config c;
        kvh_engine *e =
            open_two_arenas(persisted ? "past-host-persisted" : "past-host", dir, sizeof(dir), 4, 4, 16, 0, &c);
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
    kvh_config c;
    kvh_engine *e = open_two_arenas("partial", dir, sizeof(dir), 4, 4, 0, 0, &c);
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
    kvh_config c;
    kvh_engine *e = open_two_arenas("write-in-place", dir, sizeof(dir), 4, 4, 16, 0, &c);
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
    kvh_config c;
    kvh_engine *e = open_two_arenas("write-published", dir, sizeof(dir), 4, 4, 16, 0, &c);
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
    kvh_config c;
    kvh_engine *e = open_two_arenas("full-of-copies", dir, sizeof(dir), 4, 4, 16, 0, &c);
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

/* A range sent to a full host tier: the blocks that kept copies go down
 * onto them first, so that the others' slots are not taken from those
 * copies (which would cost one copy each twice over). Run inline and by a
 * worker. */
static void test_range_migration_uses_its_own_copies(void **state)
{
    (void)state;
    for (uint32_t threads = 0; threads <= 1; threads++) {
        char dir[PATH_MAX];
        kvh_config c;
        kvh_engine *e = open_two_arenas("range-copies", dir, sizeof(dir), 16, 12, 32, threads, &c);
        kvh_seq s, s2;
        dt_content ct = dt_plain(21), c2 = dt_plain(22);
        dt_assert_ok(dt_build(e, G, ct, 8 * G.bt, 0, &s));
        /* The second half keeps copies; the first half never left. */
        dt_assert_ok(kvh_seq_migrate(e, s, 4 * G.bt, 4 * G.bt, KVH_TIER_HOST, NULL));
        promote(e, s, 4 * G.bt, 4 * G.bt);
        assert_int_equal(dt_tier(e, KVH_TIER_HOST).clean_copies, 4);
        /* The rest of the host tier taken by cached blocks: the victims. */
        dt_assert_ok(dt_build(e, G, c2, 8 * G.bt, 0, &s2));
        dt_assert_ok(kvh_seq_migrate(e, s2, 0, 8 * G.bt, KVH_TIER_HOST, NULL));
        assert_int_equal(host_slots_taken(e), 12);
        dt_assert_ok(kvh_seq_free(e, s2));
        kvh_stats a = dt_stats(e);
        dt_assert_ok(kvh_seq_migrate(e, s, 0, 8 * G.bt, KVH_TIER_HOST, NULL));
        kvh_stats b = dt_stats(e);
        for (uint64_t i = 0; i < 8; i++)
            assert_int_equal(dt_binfo(e, s, i).tier, KVH_TIER_HOST);
        if (b.clean_copy_demotions - a.clean_copy_demotions != 4 ||
            b.blocks_device_to_host - a.blocks_device_to_host != 4)
            fail_msg("threads %u: %llu demotions onto copies and %llu copies to the host tier, expected 4 and 4",
                     threads, (unsigned long long)(b.clean_copy_demotions - a.clean_copy_demotions),
                     (unsigned long long)(b.blocks_device_to_host - a.blocks_device_to_host));
        verify_a(e, s, ct, 8 * G.bt);
        dt_assert_ok(kvh_seq_free(e, s));
        dt_assert_ok(dt_close(e));
    }
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
    kvh_config c;
    kvh_engine *e = open_two_arenas("still-read", dir, sizeof(dir), 4, 4, 0, 0, &c);
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
    kvh_config c;
    kvh_engine *e = open_two_arenas("free-while-kept", dir, sizeof(dir), 4, 4, 0, 0, &c);
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

/* The other ways in: kvh_block_alloc and a pool offload batch land in a
 * host tier whose every slot is a kept copy (the device tier pinned
 * full): they take copies back, nothing goes to disk, and the offloaded
 * bytes restore exactly. */
static void test_alloc_and_offload_take_copies(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    kvh_config c;
    kvh_engine *e = open_two_arenas("alloc-offload", dir, sizeof(dir), 4, 4, 16, 0, &c);
    kvh_seq s;
    dt_content ct = dt_plain(37);
    dt_assert_ok(dt_build(e, G, ct, 4 * G.bt, 0, &s));
    dt_assert_ok(kvh_seq_migrate(e, s, 0, 4 * G.bt, KVH_TIER_HOST, NULL));
    promote(e, s, 0, 4 * G.bt);
    dt_assert_ok(kvh_seq_pin(e, s, 0, 4 * G.bt, 1));
    assert_int_equal(dt_tier(e, KVH_TIER_HOST).clean_copies, 4);

    kvh_stats a = dt_stats(e);
    kvh_block blk;
    dt_assert_ok(kvh_block_alloc(e, 0, &blk));
    kvh_block_info bi = {.struct_size = sizeof(bi)};
    dt_assert_ok(kvh_block_info_get(e, blk, &bi));
    assert_int_equal(bi.tier, KVH_TIER_HOST);

    pt_pool pm;
    pt_pool_init(&pm, G.layers, 4, G.bt, G.heads, G.dim, 2, 0x5107);
    kvh_pool pool;
    dt_assert_ok(kvh_pool_register(e, &pm.layout, &pool));
    kvh_pool_xfer x[2];
    int32_t tok[2][16];
    uint64_t parent = 0;
    for (uint32_t i = 0; i < 2; i++) {
        pt_tokens(tok[i], G.bt, 77, i);
        x[i] =
            (kvh_pool_xfer){.struct_size = sizeof(kvh_pool_xfer), .slot = i, .parent_hash = parent, .tokens = tok[i]};
        dt_assert_ok(kvh_prefix_hash(e, parent, tok[i], G.bt, &parent));
    }
    kvh_fence f;
    dt_assert_ok(kvh_pool_offload_batch(e, pool, x, 2, 0, &f));
    dt_assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
    dt_assert_ok(kvh_fence_free(e, f));
    kvh_stats b = dt_stats(e);
    assert_int_equal(b.clean_copies_reclaimed - a.clean_copies_reclaimed, 3);
    assert_int_equal(b.blocks_host_to_disk, a.blocks_host_to_disk);
    assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, 0);
    assert_int_equal(dt_tier(e, KVH_TIER_HOST).clean_copies, 1);
    assert_int_equal(dt_tier(e, KVH_TIER_HOST).used_blocks, 3);
    kvh_pool_xfer r[2];
    for (uint32_t i = 0; i < 2; i++)
        r[i] = (kvh_pool_xfer){.struct_size = sizeof(kvh_pool_xfer), .slot = 2 + i, .block = x[i].block};
    kvh_fence lf[2];
    dt_assert_ok(kvh_pool_restore_batch(e, pool, r, 2, 0, G.layers, lf));
    for (uint32_t l = 0; l < G.layers; l++) {
        dt_assert_ok(kvh_fence_wait(e, lf[l], UINT64_MAX));
        dt_assert_ok(kvh_fence_free(e, lf[l]));
        for (uint32_t i = 0; i < 2; i++)
            assert_true(pt_layer_equal(&pm, i, &pm, 2 + i, l));
    }
    verify_a(e, s, ct, 4 * G.bt);
    for (uint32_t i = 0; i < 2; i++)
        dt_assert_ok(kvh_block_release(e, x[i].block));
    dt_assert_ok(kvh_block_release(e, blk));
    dt_assert_ok(kvh_pool_unregister(e, pool));
    pt_pool_free(&pm);
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
}

/* ---- weights ---- */

/* Weights registered while every host slot is a kept copy take the
 * copies' slots (core/weight_chunks.c takes them back first): no KV block
 * is evicted, nothing goes to disk, and the weight bytes and the blocks
 * both read back right. */
static void test_weights_take_room_from_copies(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    kvh_config c;
    kvh_engine *e = open_two_arenas("weights-take-copies", dir, sizeof(dir), 4, 4, 16, 0, &c);
    kvh_seq s;
    dt_content ct = dt_plain(30);
    dt_assert_ok(dt_build(e, G, ct, 4 * G.bt, 0, &s));
    dt_assert_ok(kvh_seq_migrate(e, s, 0, 4 * G.bt, KVH_TIER_HOST, NULL));
    promote(e, s, 0, 4 * G.bt);
    dt_assert_ok(kvh_seq_pin(e, s, 0, 4 * G.bt, 1));
    assert_int_equal(dt_tier(e, KVH_TIER_HOST).clean_copies, 4);
    uint64_t slot_bytes = dt_tier(e, KVH_TIER_HOST).block_bytes;

    kvh_context_params cp;
    dt_assert_ok(kvh_context_params_init(&cp, sizeof(cp)));
    kvh_context ctx;
    dt_assert_ok(kvh_context_create(e, &cp, &ctx));
    size_t n = (size_t)(2 * slot_bytes); /* two slots' worth */
    uint8_t *bytes = malloc(n);
    assert_non_null(bytes);
    for (size_t i = 0; i < n; i++)
        bytes[i] = (uint8_t)(i * 131 + 7);
    kvh_weight_region_params rp;
    dt_assert_ok(kvh_weight_region_params_init(&rp, sizeof(rp)));
    rp.bytes = bytes;
    rp.size = n;
    uint32_t region;
    kvh_stats a = dt_stats(e);
    dt_assert_ok(kvh_context_add_region(e, ctx, &rp, &region));
    kvh_stats b = dt_stats(e);
    assert_int_equal(b.clean_copies_reclaimed - a.clean_copies_reclaimed, 2);
    assert_int_equal(b.evictions, a.evictions);
    assert_int_equal(b.blocks_host_to_disk, a.blocks_host_to_disk);
    assert_int_equal(dt_tier(e, KVH_TIER_HOST).clean_copies, 2);
    assert_int_equal(dt_tier(e, KVH_TIER_HOST).used_blocks, 2); /* the weights */
    assert_int_equal(host_slots_taken(e), 4);
    kvh_weight_stats ws = {.struct_size = sizeof(ws)};
    dt_assert_ok(kvh_weight_stats_get(e, &ws));
    assert_int_equal(ws.slots_host, 2);
    assert_int_equal(ws.bytes_disk, 0);
    /* Every block still reads its own bytes; the two that kept their
     * copies (the newest) go down for free, first. */
    verify_a(e, s, ct, 4 * G.bt);
    dt_assert_ok(kvh_seq_pin(e, s, 0, 4 * G.bt, 0));
    a = dt_stats(e);
    for (uint64_t i = 0; i < 4; i++)
        if (kept_slot(e, s, i) != KVHI_NO_BLOCK)
            dt_assert_ok(kvh_seq_migrate(e, s, i * G.bt, G.bt, KVH_TIER_HOST, NULL));
    b = dt_stats(e);
    assert_int_equal(b.clean_copy_demotions - a.clean_copy_demotions, 2);
    assert_int_equal(b.blocks_device_to_host, a.blocks_device_to_host);
    dt_assert_ok(kvh_seq_migrate(e, s, 0, 4 * G.bt, KVH_TIER_HOST, NULL));
    verify_a(e, s, ct, 4 * G.bt);
    /* The weights reach the device with their bytes. */
    dt_assert_ok(kvh_context_switch(e, (kvh_context){0}, ctx, NULL));
    void *p = NULL;
    uint64_t got = 0;
    dt_assert_ok(kvh_context_region_data(e, ctx, region, 0, &p, &got));
    assert_int_equal(got, n);
    assert_memory_equal(p, bytes, n);
    verify_a(e, s, ct, 4 * G.bt);
    dt_assert_ok(kvh_context_switch(e, ctx, (kvh_context){0}, NULL));
    dt_assert_ok(kvh_context_destroy(e, ctx));
    free(bytes);
    dt_assert_ok(kvh_seq_free(e, s));
    /* What stays are published blocks, cached: no copy, no weight slot. */
    assert_int_equal(dt_tier(e, KVH_TIER_HOST).clean_copies, 0);
    assert_int_equal(host_slots_taken(e), dt_tier(e, KVH_TIER_HOST).used_blocks);
    ws = (kvh_weight_stats){.struct_size = sizeof(ws)};
    dt_assert_ok(kvh_weight_stats_get(e, &ws));
    assert_int_equal(ws.slots_host, 0);
    dt_assert_ok(dt_close(e));
}

/* Clean weights leaving the device tier stay in the host tier only where
 * they find a slot without evicting (core/weight_chunks.c, FREE_ONLY):
 * a kept copy is such a slot, so they take copies instead of being
 * dropped, and come back without a read of their file. */
static void test_departing_clean_weights_take_copies(void **state)
{
    (void)state;
    char dir[PATH_MAX], file[PATH_MAX];
    kvh_config c;
    kvh_engine *e = open_two_arenas("weights-depart", dir, sizeof(dir), 8, 4, 16, 0, &c);
    uint64_t slot_bytes = dt_tier(e, KVH_TIER_HOST).block_bytes;
    size_t n = (size_t)(2 * slot_bytes);
    uint8_t *bytes = malloc(n);
    assert_non_null(bytes);
    for (size_t i = 0; i < n; i++)
        bytes[i] = (uint8_t)(i * 29 + 3);
    dt_path(file, sizeof(file), dir, "weights.bin");
    assert_int_equal(dt_write_file(file, bytes, n), 0);
    kvh_context_params cp;
    dt_assert_ok(kvh_context_params_init(&cp, sizeof(cp)));
    kvh_context ctx;
    dt_assert_ok(kvh_context_create(e, &cp, &ctx));
    kvh_weight_region_params rp;
    dt_assert_ok(kvh_weight_region_params_init(&rp, sizeof(rp)));
    rp.path = file;
    rp.size = n;
    uint32_t region;
    dt_assert_ok(kvh_context_add_region(e, ctx, &rp, &region));
    dt_assert_ok(kvh_context_switch(e, (kvh_context){0}, ctx, NULL));

    /* Every host slot a kept copy. */
    kvh_seq s;
    dt_content ct = dt_plain(34);
    dt_assert_ok(dt_build(e, G, ct, 4 * G.bt, 0, &s));
    dt_assert_ok(kvh_seq_migrate(e, s, 0, 4 * G.bt, KVH_TIER_HOST, NULL));
    promote(e, s, 0, 4 * G.bt);
    assert_int_equal(dt_tier(e, KVH_TIER_HOST).clean_copies, 4);
    assert_int_equal(dt_tier(e, KVH_TIER_HOST).used_blocks, 0);

    kvh_stats a = dt_stats(e);
    kvh_weight_stats wa = {.struct_size = sizeof(wa)};
    dt_assert_ok(kvh_weight_stats_get(e, &wa));
    dt_assert_ok(kvh_context_switch(e, ctx, (kvh_context){0}, NULL));
    kvh_stats b = dt_stats(e);
    kvh_weight_stats wb = {.struct_size = sizeof(wb)};
    dt_assert_ok(kvh_weight_stats_get(e, &wb));
    assert_int_equal(wb.bytes_dropped, wa.bytes_dropped); /* kept, not dropped */
    assert_int_equal(wb.bytes_host, n);
    assert_int_equal(wb.slots_host, 2);
    assert_int_equal(b.clean_copies_reclaimed - a.clean_copies_reclaimed, 2);
    assert_int_equal(b.evictions, a.evictions);
    assert_int_equal(dt_tier(e, KVH_TIER_HOST).clean_copies, 2);
    assert_int_equal(dt_tier(e, KVH_TIER_HOST).used_blocks, 2);
    /* Back up from the host tier, not from the file. */
    dt_assert_ok(kvh_context_switch(e, (kvh_context){0}, ctx, NULL));
    kvh_weight_stats wc = {.struct_size = sizeof(wc)};
    dt_assert_ok(kvh_weight_stats_get(e, &wc));
    assert_int_equal(wc.bytes_read_source, wb.bytes_read_source);
    void *p = NULL;
    dt_assert_ok(kvh_context_region_data(e, ctx, region, 0, &p, NULL));
    assert_memory_equal(p, bytes, n);
    verify_a(e, s, ct, 4 * G.bt);
    dt_assert_ok(kvh_context_switch(e, ctx, (kvh_context){0}, NULL));
    dt_assert_ok(kvh_context_destroy(e, ctx));
    free(bytes);
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
}

/* An agent at its device quota makes room among its own blocks: those
 * with copies go down onto them, and the agent's device count follows
 * (checked white-box against its blocks in the device tier, round after
 * round, so a miscount would show as drift). */
static void test_quota_eviction_onto_copies_keeps_counts(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    kvh_config c;
    kvh_engine *e = open_two_arenas("quota", dir, sizeof(dir), 6, 6, 16, 0, &c);
    dt_assert_ok(kvh_agent_set_quota(e, 1, 2 * dt_block_bytes(G)));
    kvh_seq s;
    dt_content ct = dt_plain(36);
    dt_assert_ok(dt_build(e, G, ct, 4 * G.bt, 1, &s));
    dt_assert_ok(kvh_seq_migrate(e, s, 0, 4 * G.bt, KVH_TIER_HOST, NULL));
    kvh_stats a = dt_stats(e);
    for (int round = 0; round < 6; round++) {
        uint64_t first = (uint64_t)(round % 2) * 2 * G.bt; /* the two halves in turn */
        promote(e, s, first, 2 * G.bt);
        wb_lock(e);
        uint64_t on_device = 0;
        for (uint32_t b = 0; b < e->block_cap; b++)
            if ((e->blocks[b].flags & KVHI_BF_LIVE) && e->blocks[b].tier == KVH_TIER_DEVICE && e->blocks[b].agent == 1)
                on_device++;
        kvhi_agent *ag = kvhi_agent_get(e, 1, false);
        uint64_t counted = ag ? ag->device_blocks : 0;
        wb_unlock(e);
        assert_int_equal(on_device, 2);
        assert_int_equal(counted, on_device);
        verify_a(e, s, ct, 4 * G.bt);
    }
    kvh_stats b = dt_stats(e);
    assert_true(b.clean_copy_demotions - a.clean_copy_demotions >= 4);
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
}

/* ---- other writers ---- */

/* A fork shares the block that kept a copy; the child's write copies it
 * on write, so the parent's block and its kept copy keep the old bytes
 * and the child's new block holds the new ones, in every tier. */
static void test_fork_then_write_keeps_parent_copy(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    kvh_config c;
    kvh_engine *e = open_two_arenas("fork-write", dir, sizeof(dir), 4, 4, 16, 0, &c);
    kvh_seq first, s, child;
    dt_content ct = dt_plain(31);
    dt_assert_ok(dt_build(e, G, ct, G.bt, 0, &first));
    dt_assert_ok(dt_build(e, G, ct, G.bt, 0, &s)); /* unpublished twin */
    dt_assert_ok(kvh_seq_migrate(e, s, 0, G.bt, KVH_TIER_HOST, NULL));
    promote(e, s, 0, G.bt);
    assert_int_not_equal(kept_slot(e, s, 0), KVHI_NO_BLOCK);
    dt_assert_ok(kvh_seq_fork(e, s, 0, &child));
    write_value(e, child, 0, G.bt, 0x4200); /* 3.0 */
    assert_int_not_equal(wb_seq_block_index(e, child, 0), wb_seq_block_index(e, s, 0));
    assert_int_not_equal(kept_slot(e, s, 0), KVHI_NO_BLOCK);
    for (int tier = KVH_TIER_HOST; tier <= KVH_TIER_DISK; tier++) {
        dt_assert_ok(kvh_seq_migrate(e, s, 0, G.bt, (uint32_t)tier, NULL));
        dt_assert_ok(kvh_seq_migrate(e, child, 0, G.bt, (uint32_t)tier, NULL));
        verify_a(e, s, ct, G.bt);
        assert_true(reads_value(e, child, 0, G.bt, 0x4200));
    }
    /* The parent writes in place too now (private again), then goes down. */
    promote(e, s, 0, G.bt);
    dt_assert_ok(kvh_seq_migrate(e, s, 0, G.bt, KVH_TIER_HOST, NULL));
    promote(e, s, 0, G.bt);
    write_value(e, s, 0, G.bt, 0x4400); /* 4.0 */
    assert_int_equal(kept_slot(e, s, 0), KVHI_NO_BLOCK);
    dt_assert_ok(kvh_seq_migrate(e, s, 0, G.bt, KVH_TIER_HOST, NULL));
    assert_true(reads_value(e, s, 0, G.bt, 0x4400));
    dt_assert_ok(kvh_seq_migrate(e, s, 0, G.bt, KVH_TIER_DISK, NULL));
    assert_true(reads_value(e, s, 0, G.bt, 0x4400));
    assert_true(reads_value(e, child, 0, G.bt, 0x4200));
    verify_a(e, first, ct, G.bt);
    dt_assert_ok(kvh_seq_free(e, child));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(kvh_seq_free(e, first));
    assert_int_equal(host_slots_taken(e), 0);
    dt_assert_ok(dt_close(e));
}

/* A block back from disk is promoted, keeps its host copy, is written in
 * place, then goes down to the host tier and on to disk: the disk holds
 * the written bytes (read back through their checksum), never the old
 * ones; the published twin, persisted, reads its own after a reopen. */
static void test_write_after_disk_round_trip_reaches_disk(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    kvh_config c;
    kvh_engine *e = open_two_arenas("persist-write", dir, sizeof(dir), 4, 4, 16, 0, &c);
    kvh_seq first, s;
    dt_content ct = dt_plain(32);
    dt_assert_ok(dt_build(e, G, ct, G.bt, 0, &first));
    dt_assert_ok(dt_build(e, G, ct, G.bt, 0, &s)); /* unpublished twin */
    uint32_t b = wb_seq_block_index(e, s, 0);
    dt_assert_ok(kvh_seq_migrate(e, s, 0, G.bt, KVH_TIER_DISK, NULL));
    dt_assert_ok(kvh_seq_migrate(e, s, 0, G.bt, KVH_TIER_HOST, NULL));
    promote(e, s, 0, G.bt);
    assert_int_not_equal(kept_slot(e, s, 0), KVHI_NO_BLOCK);
    write_value(e, s, 0, G.bt, 0x4500);
    wb_lock(e);
    assert_false(e->blocks[b].flags & KVHI_BF_DISK_COPY);
    wb_unlock(e);
    dt_assert_ok(kvh_seq_migrate(e, s, 0, G.bt, KVH_TIER_HOST, NULL));
    dt_assert_ok(kvh_seq_migrate(e, s, 0, G.bt, KVH_TIER_DISK, NULL));
    assert_true(reads_value(e, s, 0, G.bt, 0x4500));
    dt_assert_ok(kvh_seq_migrate(e, s, 0, G.bt, KVH_TIER_DISK, NULL));
    assert_true(reads_value(e, s, 0, G.bt, 0x4500));
    /* The published original persisted and reopened keeps its bytes. */
    dt_assert_ok(kvh_seq_persist(e, first));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(kvh_seq_free(e, first));
    dt_assert_ok(dt_close(e));
    e = dt_open_a(&c);
    size_t matched = 0;
    char msg[256] = "";
    dt_assert_ok(dt_match_verify(e, G, ct, G.bt, &matched, msg, sizeof(msg)));
    assert_int_equal(matched, G.bt);
    dt_assert_ok(dt_close(e));
}

/* Under a KV codec the host slot holds the encoded block and the device
 * slot its decoding: a demotion onto the kept copy must read back exactly
 * what the device tier read (the copy is the encoding the device bytes
 * came from), round after round, with no drift from encoding again. */
static void test_codec_copy_reads_as_the_device_did(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("codec", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 4, 4, 16, 0);
    c.copy_moves = 1;
    c.kv_codec = KVH_CODEC_INT8;
    kvh_engine *e = dt_open_a(&c);
    kvh_seq s;
    dt_content ct = dt_plain(35);
    dt_assert_ok(dt_build(e, G, ct, 2 * G.bt, 0, &s));
    dt_assert_ok(kvh_seq_migrate(e, s, 0, 2 * G.bt, KVH_TIER_HOST, NULL)); /* encoded */
    size_t n = (size_t)G.bt * TOKEN_ELEMS;
    uint16_t first_k[2][16 * TOKEN_ELEMS], k[16 * TOKEN_ELEMS], v[16 * TOKEN_ELEMS];
    for (int blk = 0; blk < 2; blk++)
        dt_assert_ok(kvh_seq_read_kv(e, s, 1, (uint64_t)blk * G.bt, G.bt, first_k[blk], v));
    for (int round = 0; round < 3; round++) {
        kvh_stats a = dt_stats(e);
        promote(e, s, 0, 2 * G.bt);
        assert_int_equal(dt_tier(e, KVH_TIER_HOST).clean_copies, 2);
        for (int blk = 0; blk < 2; blk++) {
            dt_assert_ok(kvh_seq_read_kv(e, s, 1, (uint64_t)blk * G.bt, G.bt, k, v));
            assert_memory_equal(k, first_k[blk], n * sizeof(uint16_t));
        }
        dt_assert_ok(kvh_seq_migrate(e, s, 0, 2 * G.bt, KVH_TIER_HOST, NULL));
        kvh_stats d = dt_stats(e);
        assert_int_equal(d.clean_copy_demotions - a.clean_copy_demotions, 2);
        assert_int_equal(d.blocks_device_to_host, a.blocks_device_to_host);
        for (int blk = 0; blk < 2; blk++) {
            dt_assert_ok(kvh_seq_read_kv(e, s, 1, (uint64_t)blk * G.bt, G.bt, k, v));
            assert_memory_equal(k, first_k[blk], n * sizeof(uint16_t));
        }
    }
    /* A write in the device tier drops the copy; the new bytes go down
     * encoded and read back within the codec's bound of 2.0 (exactly:
     * a constant vector encodes without error). */
    kvh_seq t;
    dt_assert_ok(dt_build(e, G, ct, 2 * G.bt, 0, &t)); /* unpublished twin */
    dt_assert_ok(kvh_seq_migrate(e, t, 0, G.bt, KVH_TIER_HOST, NULL));
    promote(e, t, 0, G.bt);
    assert_int_not_equal(kept_slot(e, t, 0), KVHI_NO_BLOCK);
    write_value(e, t, 0, G.bt, 0x4000);
    assert_int_equal(kept_slot(e, t, 0), KVHI_NO_BLOCK);
    dt_assert_ok(kvh_seq_migrate(e, t, 0, G.bt, KVH_TIER_HOST, NULL));
    assert_true(reads_value(e, t, 0, G.bt, 0x4000));
    dt_assert_ok(kvh_seq_free(e, t));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
}

/* ---- close ---- */

/* Closed with copies kept and demotions and promotions still queued in
 * the workers: nothing leaks (ASan), nothing crashes, and the persisted
 * prefix reads back after a reopen. */
static void test_close_with_copies_and_moves_in_flight(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("close-in-flight", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 4, 4, 16, 2);
    c.copy_moves = 1;
    dt_content ct = dt_plain(33);
    for (int round = 0; round < 8; round++) {
        kvh_engine *e = dt_open_a(&c);
        kvh_seq s;
        size_t matched = 0;
        dt_assert_ok(dt_match(e, ct, 4 * G.bt, &s, &matched));
        if (matched < 4 * G.bt)
            dt_assert_ok(dt_extend(e, s, G, ct, matched, 4 * G.bt - matched));
        char msg[256] = "";
        if (dt_verify(e, s, G, ct, 0, 4 * G.bt, msg, sizeof(msg)) != KVH_OK)
            fail_msg("round %d: %s", round, msg);
        dt_assert_ok(kvh_seq_persist(e, s));
        dt_assert_ok(kvh_seq_migrate(e, s, 0, 4 * G.bt, KVH_TIER_HOST, NULL));
        kvh_fence f[2];
        dt_assert_ok(kvh_seq_migrate(e, s, 0, 4 * G.bt, KVH_TIER_DEVICE, &f[0]));
        dt_assert_ok(kvh_fence_wait(e, f[0], UINT64_MAX));
        dt_assert_ok(kvh_fence_free(e, f[0]));
        /* Copies kept; now down and up again without waiting. */
        dt_assert_ok(kvh_seq_migrate(e, s, 0, 4 * G.bt, round & 1 ? KVH_TIER_HOST : KVH_TIER_DISK, &f[0]));
        dt_assert_ok(kvh_seq_migrate(e, s, 0, 2 * G.bt, KVH_TIER_DEVICE, &f[1]));
        if (round & 2)
            dt_assert_ok(kvh_seq_free(e, s));
        dt_assert_ok(dt_close(e)); /* the fences go with the engine */
    }
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
        cmocka_unit_test_teardown(test_range_migration_uses_its_own_copies, teardown),
        cmocka_unit_test_teardown(test_slot_still_read_is_not_kept, teardown),
        cmocka_unit_test_teardown(test_free_while_kept_gives_the_slot_back, teardown),
        cmocka_unit_test_teardown(test_alloc_and_offload_take_copies, teardown),
        cmocka_unit_test_teardown(test_weights_take_room_from_copies, teardown),
        cmocka_unit_test_teardown(test_departing_clean_weights_take_copies, teardown),
        cmocka_unit_test_teardown(test_quota_eviction_onto_copies_keeps_counts, teardown),
        cmocka_unit_test_teardown(test_fork_then_write_keeps_parent_copy, teardown),
        cmocka_unit_test_teardown(test_write_after_disk_round_trip_reaches_disk, teardown),
        cmocka_unit_test_teardown(test_codec_copy_reads_as_the_device_did, teardown),
        cmocka_unit_test_teardown(test_close_with_copies_and_moves_in_flight, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
