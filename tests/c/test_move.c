/* Moves between tiers (core/move.c, core/move_xfer.c), white-box where
 * the two halves of a move are the subject: kvhi_move_begin / the
 * transfer / kvhi_move_end are called directly, under the engine lock
 * and without it as the mover does, on engines without migration workers.
 *
 *   - a begin / end pair: begin reserves the destination and puts the
 *     block in flight (out of the heaps, its source untouched), end
 *     places it, frees the source slot and counts the move; a failed
 *     transfer is undone (destination released, block where it was,
 *     KVH_ERR_IO or KVH_ERR_NOSPACE); a move to the tier a block is in is
 *     nothing; a handing-over move gives the source slot to the caller;
 *   - a second move of a block in flight is refused (KVH_ERR_BUSY) and
 *     changes nothing;
 *   - each leg's counters: device <-> host, host <-> disk, and device <->
 *     disk, which counts both legs through the host, on two arenas and on
 *     one (where device <-> host moves are counted in place);
 *   - a demotion to an existing clean disk copy writes nothing (no write
 *     reaches the disk, no move or copy counter changes) and the promotion
 *     back keeps that copy, so the next demotion is free again;
 *   - the swap when both memory tiers are full: the lower block trades
 *     places with the upper tier's least valuable block (their slots on
 *     two arenas, their tiers only on one), and NOSPACE, naming why, when
 *     every upper block is held, or when the lower one is being read on
 *     two arenas (trading contents would overwrite it under its reader);
 *   - a block read without the lock and promoted by a copy meanwhile:
 *     the slot it left keeps its bytes and is given to nothing else until
 *     the last read ends (a plain hold keeps nothing);
 *   - a failed disk read: the transfer reports a verification failure,
 *     end marks the block corrupt (unpublished, its record deleted,
 *     stats.corrupt_blocks, a warning), it is never moved or served
 *     again and is gone after a reopen; a read that fails with an I/O
 *     error instead costs the block nothing.
 * test_tiers.c, test_moves_in_place.c and test_disk_*.c cover the same
 * moves through the public API. */
#include <stdatomic.h>

#include "disk_test_util.h"

#include "core/block_state.h"
#include "core/disk_io.h"
#include "core/engine.h"
#include "white_box_util.h"
#include "core/move.h"
#include "core/block.h"
#include "core/backend.h"

static const dt_geo G = {2, 1, 32, 16, KVH_DTYPE_F16}; /* block = 4096 bytes */

/* Slots taken in tier's pool, less the host tier's spare held back. */
static uint32_t used(kvh_engine *e, uint32_t tier)
{
    return kvhi_slot_pool_used(&e->tiers[tier].slots) - (tier == KVH_TIER_HOST ? kvhi_host_spare_held(e) : 0);
}

static void verify_a(kvh_engine *e, kvh_seq s, dt_content c, size_t n)
{
    char msg[256] = "";
    if (dt_verify(e, s, G, c, 0, n, msg, sizeof(msg)) != KVH_OK)
        fail_msg("%s", msg);
}

/* Runs a prepared transfer as the mover does: without the lock, counted
 * in copies_in_progress. Lock held on entry and exit. */
static void run_xfer(kvh_engine *e, kvhi_xfer *x)
{
    kvhi_unlock_for_copy(e);
    kvhi_xfer_run(e, x);
    kvhi_relock_after_copy(e);
}

/* ---- disk operations seen by the fault hook; one kind may fail ---- */

static struct {
    atomic_int count[KVHI_OP_COUNT];
    atomic_int fail_op, fail_err, fail_left;
} H;

static int hook(enum kvhi_disk_op op, void *user)
{
    (void)user;
    atomic_fetch_add(&H.count[op], 1);
    if ((int)op == atomic_load(&H.fail_op) && atomic_load(&H.fail_left) > 0) {
        atomic_fetch_sub(&H.fail_left, 1);
        return atomic_load(&H.fail_err);
    }
    return 0;
}

static void hook_reset(void)
{
    for (int i = 0; i < KVHI_OP_COUNT; i++)
        atomic_store(&H.count[i], 0);
    atomic_store(&H.fail_op, -1);
    atomic_store(&H.fail_left, 0);
}

static int teardown(void **state)
{
    wb_release_held_lock();
    kvhi_disk_set_fault_hook(NULL, NULL);
    return dt_teardown(state);
}

/* ---- a begin / end pair ---- */

/* Two arenas (copy_moves), 4 device and 4 host slots, and one sequence of
 * one block of content ct in the device tier: its record in *b. */
static kvh_engine *one_block_engine(dt_content ct, kvh_seq *s, uint32_t *b)
{
    kvh_config c = dt_cfg(G, NULL, 4, 4, 0, 0);
    c.copy_moves = 1;
    kvh_engine *e = dt_open_a(&c);
    dt_assert_ok(dt_build(e, G, ct, G.bt, 0, s));
    *b = wb_seq_block_index(e, *s, 0);
    return e;
}

static void test_begin_end(void **state)
{
    (void)state;
    kvh_seq s;
    uint32_t b;
    dt_content ct = dt_plain(1);
    kvh_engine *e = one_block_engine(ct, &s, &b);
    kvhi_block *blk = kvhi_blk(e, b);
    kvh_stats s0 = dt_stats(e);

    wb_lock(e);
    uint32_t slot0 = blk->slot, dev0 = used(e, KVH_TIER_DEVICE), host0 = used(e, KVH_TIER_HOST);
    kvhi_xfer x;
    assert_int_equal(kvhi_move_begin(e, b, KVH_TIER_HOST, &x, false), 0);
    assert_int_equal(kvhi_move_state(blk), KVHI_MS_MOVING);
    assert_int_equal(blk->heap_pos, KVHI_HEAP_NONE);
    assert_int_equal(x.block, b);
    assert_int_equal(x.src_tier, KVH_TIER_DEVICE);
    assert_int_equal(x.src_slot, slot0);
    assert_int_equal(x.dst_tier, KVH_TIER_HOST);
    assert_false(x.in_place);
    assert_int_equal(blk->tier, KVH_TIER_DEVICE); /* not placed before the end */
    assert_int_equal(used(e, KVH_TIER_HOST), host0 + 1);
    assert_int_equal(used(e, KVH_TIER_DEVICE), dev0);
    wb_unlock(e);
    kvh_block_info bi = dt_binfo(e, s, 0);
    assert_int_equal(bi.in_flight, 1);
    assert_int_equal(bi.tier, KVH_TIER_DEVICE);
    wb_lock(e);
    run_xfer(e, &x);
    assert_int_equal(x.err, 0);
    dt_assert_ok(kvhi_move_end(e, &x, NULL));
    assert_int_equal(blk->tier, KVH_TIER_HOST);
    assert_int_equal(blk->slot, x.dst_slot);
    assert_int_equal(kvhi_move_state(blk), KVHI_MS_IDLE);
    assert_true(blk->heap_pos != KVHI_HEAP_NONE);
    assert_int_equal(used(e, KVH_TIER_DEVICE), dev0 - 1);
    assert_int_equal(used(e, KVH_TIER_HOST), host0 + 1);
    wb_unlock(e);
    kvh_stats s1 = dt_stats(e);
    assert_int_equal(s1.blocks_device_to_host - s0.blocks_device_to_host, 1);
    assert_int_equal(s1.bytes_device_to_host - s0.bytes_device_to_host, dt_block_bytes(G));
    assert_int_equal(s1.blocks_host_to_device, s0.blocks_host_to_device);
    assert_int_equal(s1.blocks_moved_in_place, s0.blocks_moved_in_place);
    assert_int_equal(s1.evictions, s0.evictions); /* a move, not an eviction */
    verify_a(e, s, ct, G.bt);

    /* A failed transfer is undone: the block stays, the destination is
     * given back, nothing is counted. */
    static const struct {
        int err;
        kvh_status want;
    } fails[] = {{-EIO, KVH_ERR_IO}, {-ENOSPC, KVH_ERR_NOSPACE}, {-EDQUOT, KVH_ERR_NOSPACE}};
    for (size_t i = 0; i < sizeof(fails) / sizeof(fails[0]); i++) {
        wb_lock(e);
        uint32_t slot = blk->slot;
        dev0 = used(e, KVH_TIER_DEVICE), host0 = used(e, KVH_TIER_HOST);
        assert_int_equal(kvhi_move_begin(e, b, KVH_TIER_DEVICE, &x, false), 0);
        assert_int_equal(used(e, KVH_TIER_DEVICE), dev0 + 1);
        x.err = fails[i].err; /* as a transfer that failed would leave it */
        kvh_status st = kvhi_move_end(e, &x, NULL);
        assert_int_equal(st, fails[i].want);
        assert_non_null(strstr(kvh_last_error(), "moving a block between tiers"));
        assert_int_equal(blk->tier, KVH_TIER_HOST);
        assert_int_equal(blk->slot, slot);
        assert_int_equal(kvhi_move_state(blk), KVHI_MS_IDLE);
        assert_true(blk->heap_pos != KVHI_HEAP_NONE);
        assert_false(blk->flags & KVHI_BF_CORRUPT);
        assert_int_equal(used(e, KVH_TIER_DEVICE), dev0);
        assert_int_equal(used(e, KVH_TIER_HOST), host0);
        wb_unlock(e);
    }
    kvh_stats s2 = dt_stats(e);
    assert_int_equal(s2.blocks_host_to_device, s1.blocks_host_to_device);
    verify_a(e, s, ct, G.bt);

    /* To the tier it is in: nothing to transfer. */
    wb_lock(e);
    assert_int_equal(kvhi_move_begin(e, b, KVH_TIER_HOST, &x, false), 1);
    assert_int_equal(kvhi_move_state(blk), KVHI_MS_IDLE);
    /* Handing over: the source slot goes to the caller, still taken. */
    uint32_t src = blk->slot, handed = UINT32_MAX;
    host0 = used(e, KVH_TIER_HOST);
    dt_assert_ok(kvhi_move_handing_over(e, b, KVH_TIER_DEVICE, &handed));
    assert_int_equal(handed, src);
    assert_int_equal(blk->tier, KVH_TIER_DEVICE);
    assert_int_equal(used(e, KVH_TIER_HOST), host0);
    kvhi_release_slot(e, KVH_TIER_HOST, handed);
    assert_int_equal(used(e, KVH_TIER_HOST), host0 - 1);
    wb_unlock(e);
    verify_a(e, s, ct, G.bt);
    dt_assert_ok(kvh_seq_free(e, s));
}

/* A block in flight belongs to its move until the move ends: a second
 * move begun meanwhile (by another call while the first copies without
 * the lock) would release or hand over the same source slot twice, and
 * two blocks would then share a slot. It is refused and changes
 * nothing; the first move ends as usual. */
static void test_a_second_move_of_a_block_in_flight_is_refused(void **state)
{
    (void)state;
    kvh_seq s;
    uint32_t b;
    dt_content ct = dt_plain(3);
    kvh_engine *e = one_block_engine(ct, &s, &b);
    kvhi_block *blk = kvhi_blk(e, b);
    wb_lock(e);
    uint32_t slot0 = blk->slot, dev0 = used(e, KVH_TIER_DEVICE), host0 = used(e, KVH_TIER_HOST);
    kvhi_xfer x, y;
    assert_int_equal(kvhi_move_begin(e, b, KVH_TIER_HOST, &x, false), 0);
    assert_int_equal(used(e, KVH_TIER_HOST), host0 + 1);
    assert_int_equal(kvhi_move_begin(e, b, KVH_TIER_HOST, &y, false), KVH_ERR_BUSY);
    assert_string_equal(kvh_last_error(), "the block is being moved by another call");
    assert_int_equal(kvhi_move_block(e, b, KVH_TIER_HOST, 0), KVH_ERR_BUSY);
    uint32_t handed = UINT32_MAX;
    assert_int_equal(kvhi_move_handing_over(e, b, KVH_TIER_HOST, &handed), KVH_ERR_BUSY);
    assert_int_equal(handed, UINT32_MAX);
    assert_int_equal(kvhi_move_state(blk), KVHI_MS_MOVING);
    assert_int_equal(blk->tier, KVH_TIER_DEVICE);
    assert_int_equal(blk->slot, slot0);
    assert_int_equal(used(e, KVH_TIER_DEVICE), dev0);
    assert_int_equal(used(e, KVH_TIER_HOST), host0 + 1);
    run_xfer(e, &x);
    dt_assert_ok(kvhi_move_end(e, &x, NULL));
    assert_int_equal(blk->tier, KVH_TIER_HOST);
    assert_int_equal(kvhi_move_state(blk), KVHI_MS_IDLE);
    assert_int_equal(used(e, KVH_TIER_DEVICE), dev0 - 1);
    assert_int_equal(used(e, KVH_TIER_HOST), host0 + 1);
    wb_unlock(e);
    verify_a(e, s, ct, G.bt);
    dt_assert_ok(kvh_seq_free(e, s));
}

/* ---- counters of each leg ---- */

typedef struct legs {
    uint64_t d2h, h2d, h2k, k2h, in_place;
} legs;

static legs legs_of(const kvh_stats *a, const kvh_stats *b)
{
    uint64_t bb = dt_block_bytes(G);
    /* bytes are blocks times the block size, for every leg */
    assert_int_equal(b->bytes_device_to_host - a->bytes_device_to_host,
                     (b->blocks_device_to_host - a->blocks_device_to_host) * bb);
    assert_int_equal(b->bytes_host_to_device - a->bytes_host_to_device,
                     (b->blocks_host_to_device - a->blocks_host_to_device) * bb);
    assert_int_equal(b->bytes_host_to_disk - a->bytes_host_to_disk,
                     (b->blocks_host_to_disk - a->blocks_host_to_disk) * bb);
    assert_int_equal(b->bytes_disk_to_host - a->bytes_disk_to_host,
                     (b->blocks_disk_to_host - a->blocks_disk_to_host) * bb);
    return (legs){b->blocks_device_to_host - a->blocks_device_to_host,
                  b->blocks_host_to_device - a->blocks_host_to_device, b->blocks_host_to_disk - a->blocks_host_to_disk,
                  b->blocks_disk_to_host - a->blocks_disk_to_host, b->blocks_moved_in_place - a->blocks_moved_in_place};
}

static void test_counters_of_each_leg(void **state)
{
    (void)state;
    for (int copies = 1; copies >= 0; copies--) {
        char dir[PATH_MAX];
        dt_scratch(copies ? "legs-copy" : "legs-in-place", dir, sizeof(dir));
        kvh_config c = dt_cfg(G, dir, 4, 4, 16, 0);
        c.copy_moves = (uint32_t)copies;
        kvh_engine *e = dt_open_a(&c);
        /* A partial block: never published, so every demotion to disk
         * writes (no clean copy is kept). */
        kvh_seq s;
        dt_content ct = dt_plain(2);
        dt_assert_ok(dt_build(e, G, ct, G.bt / 2, 0, &s));
        kvh_block h;
        dt_assert_ok(kvh_seq_blocks(e, s, 0, 1, &h));
        static const struct {
            uint32_t to;
            legs copy, in_place;
        } steps[] = {
            {KVH_TIER_HOST, {1, 0, 0, 0, 0}, {0, 0, 0, 0, 1}},   /* device -> host */
            {KVH_TIER_DISK, {0, 0, 1, 0, 0}, {0, 0, 1, 0, 0}},   /* host -> disk */
            {KVH_TIER_HOST, {0, 0, 0, 1, 0}, {0, 0, 0, 1, 0}},   /* disk -> host */
            {KVH_TIER_DEVICE, {0, 1, 0, 0, 0}, {0, 0, 0, 0, 1}}, /* host -> device */
            {KVH_TIER_DISK, {1, 0, 1, 0, 0}, {1, 0, 1, 0, 0}},   /* device -> disk: through the host */
            {KVH_TIER_DEVICE, {0, 1, 0, 1, 0}, {0, 1, 0, 1, 0}}, /* disk -> device: through the host */
        };
        for (size_t i = 0; i < sizeof(steps) / sizeof(steps[0]); i++) {
            kvh_stats a = dt_stats(e);
            dt_assert_ok(kvh_migrate(e, &h, 1, steps[i].to, NULL));
            kvh_stats b = dt_stats(e);
            assert_int_equal(dt_binfo(e, s, 0).tier, steps[i].to);
            legs got = legs_of(&a, &b), want = copies ? steps[i].copy : steps[i].in_place;
            if (memcmp(&got, &want, sizeof(got)) != 0)
                fail_msg("%s, step %zu (to tier %u): d2h %" PRIu64 " h2d %" PRIu64 " h2disk %" PRIu64 " disk2h %" PRIu64
                         " in place %" PRIu64 ", expected %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64,
                         copies ? "two arenas" : "one arena", i, steps[i].to, got.d2h, got.h2d, got.h2k, got.k2h,
                         got.in_place, want.d2h, want.h2d, want.h2k, want.k2h, want.in_place);
            assert_int_equal(b.evictions, a.evictions);
            assert_int_equal(b.disk_copies_written, a.disk_copies_written);
        }
        verify_a(e, s, ct, G.bt / 2);
        dt_assert_ok(kvh_seq_free(e, s));
        dt_assert_ok(dt_close(e));
    }
}

/* ---- demotion to a clean copy ---- */

static void test_demotion_to_clean_copy(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("clean-copy", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 4, 4, 16, 0);
    kvh_engine *e = dt_open_a(&c);
    kvh_seq s;
    dt_content ct = dt_plain(3);
    dt_assert_ok(dt_build(e, G, ct, 2 * G.bt, 0, &s));
    dt_assert_ok(kvh_seq_persist(e, s)); /* clean copies of both blocks */
    uint32_t b[2] = {wb_seq_block_index(e, s, 0), wb_seq_block_index(e, s, 1)}, copy[2];
    wb_lock(e);
    for (int i = 0; i < 2; i++) {
        uint16_t f = kvhi_blk(e, b[i])->flags;
        assert_true((f & (KVHI_BF_DISK_COPY | KVHI_BF_JOURNALED)) == (KVHI_BF_DISK_COPY | KVHI_BF_JOURNALED));
        assert_int_equal(kvhi_blk(e, b[i])->tier, KVH_TIER_DEVICE);
        copy[i] = kvhi_blk(e, b[i])->disk_copy;
    }
    wb_unlock(e);
    assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, 2);
    hook_reset();
    kvhi_disk_set_fault_hook(hook, NULL);

    for (int round = 0; round < 2; round++) {
        /* Down to disk: onto the copy, no I/O at all. */
        kvh_stats a = dt_stats(e);
        uint64_t dev = dt_tier(e, KVH_TIER_DEVICE).used_blocks;
        hook_reset();
        dt_assert_ok(kvh_seq_migrate(e, s, 0, 2 * G.bt, KVH_TIER_DISK, NULL));
        kvh_stats d = dt_stats(e);
        assert_int_equal(atomic_load(&H.count[KVHI_OP_WRITE]), 0);
        assert_int_equal(atomic_load(&H.count[KVHI_OP_READ]), 0);
        legs l = legs_of(&a, &d);
        assert_int_equal(l.d2h + l.h2d + l.h2k + l.k2h + l.in_place, 0);
        assert_int_equal(d.disk_copies_written, a.disk_copies_written);
        assert_int_equal(d.bytes_disk_copies_written, a.bytes_disk_copies_written);
        assert_int_equal(dt_tier(e, KVH_TIER_DEVICE).used_blocks, dev - 2);
        assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, 2);
        wb_lock(e);
        for (int i = 0; i < 2; i++) {
            kvhi_block *blk = kvhi_blk(e, b[i]);
            assert_int_equal(blk->tier, KVH_TIER_DISK);
            assert_int_equal(blk->slot, copy[i]);
            assert_false(blk->flags & KVHI_BF_DISK_COPY);
            assert_true(blk->flags & KVHI_BF_JOURNALED);
        }
        wb_unlock(e);
        /* Up again: read (and verified) once, the disk slot kept as the
         * clean copy. */
        hook_reset();
        dt_assert_ok(kvh_seq_acquire(e, s, 0, 2 * G.bt, NULL));
        dt_assert_ok(kvh_seq_release(e, s, 0, 2 * G.bt));
        kvh_stats u = dt_stats(e);
        assert_true(atomic_load(&H.count[KVHI_OP_READ]) >= 1);
        assert_int_equal(atomic_load(&H.count[KVHI_OP_WRITE]), 0);
        l = legs_of(&d, &u);
        assert_int_equal(l.k2h, 2);
        assert_int_equal(l.h2k, 0);
        assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, 2);
        wb_lock(e);
        for (int i = 0; i < 2; i++) {
            kvhi_block *blk = kvhi_blk(e, b[i]);
            assert_int_equal(blk->tier, KVH_TIER_DEVICE);
            assert_true(blk->flags & KVHI_BF_DISK_COPY);
            assert_int_equal(blk->disk_copy, copy[i]);
        }
        wb_unlock(e);
        verify_a(e, s, ct, 2 * G.bt);
    }

    /* Control: a published block with no copy is written when it goes. */
    dt_assert_ok(dt_extend(e, s, G, ct, 2 * G.bt, G.bt));
    kvh_stats a = dt_stats(e);
    hook_reset();
    dt_assert_ok(kvh_seq_migrate(e, s, 2 * G.bt, G.bt, KVH_TIER_DISK, NULL));
    kvh_stats d = dt_stats(e);
    assert_true(atomic_load(&H.count[KVHI_OP_WRITE]) >= 1);
    legs l = legs_of(&a, &d);
    assert_int_equal(l.h2k, 1);
    assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, 3);
    verify_a(e, s, ct, 3 * G.bt);
    kvhi_disk_set_fault_hook(NULL, NULL);
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
}

/* ---- both memory tiers full ---- */

/* On two arenas, b's promotion into the full device tier is refused
 * rather than trading b's slot (lock held): b stays where it is. */
static void expect_no_swap(kvh_engine *e, uint32_t b, uint32_t slot)
{
    kvhi_xfer x;
    assert_int_equal(kvhi_move_begin(e, b, KVH_TIER_DEVICE, &x, false), KVH_ERR_NOSPACE);
    assert_non_null(strstr(kvh_last_error(), "being read or copied"));
    assert_int_equal(kvhi_blk(e, b)->tier, KVH_TIER_HOST);
    assert_int_equal(kvhi_blk(e, b)->slot, slot);
}

static void test_swap_when_both_full(void **state)
{
    (void)state;
    for (int copies = 1; copies >= 0; copies--) {
        kvh_config c = dt_cfg(G, NULL, 2, 2, 0, 0);
        c.copy_moves = (uint32_t)copies;
        kvh_engine *e = dt_open_a(&c);
        kvh_seq s;
        dt_content ct = dt_plain(4);
        dt_assert_ok(dt_build(e, G, ct, 4 * G.bt, 0, &s)); /* every slot referenced */
        uint32_t dev[2], host[2], nd = 0, nh = 0;
        for (uint64_t i = 0; i < 4; i++) {
            uint32_t b = wb_seq_block_index(e, s, i);
            if (kvhi_blk(e, b)->tier == KVH_TIER_DEVICE)
                dev[nd++] = b;
            else
                host[nh++] = b;
        }
        assert_int_equal(nd, 2);
        assert_int_equal(nh, 2);
        wb_lock(e);
        /* dev[0] is used twice now: dev[1] is the least valuable. */
        kvhi_block_touch(e, dev[0]);
        kvhi_block_touch(e, dev[0]);
        uint32_t keep_slot = kvhi_blk(e, dev[0])->slot, v_slot = kvhi_blk(e, dev[1])->slot,
                 b_slot = kvhi_blk(e, host[0])->slot;
        wb_unlock(e);
        kvh_stats a = dt_stats(e);
        wb_lock(e);
        kvhi_xfer x;
        assert_int_equal(kvhi_move_begin(e, host[0], KVH_TIER_DEVICE, &x, false), 1); /* done by a swap */
        kvhi_block *up = kvhi_blk(e, host[0]), *down = kvhi_blk(e, dev[1]), *kept = kvhi_blk(e, dev[0]);
        assert_int_equal(up->tier, KVH_TIER_DEVICE);
        assert_int_equal(down->tier, KVH_TIER_HOST);
        assert_int_equal(kept->tier, KVH_TIER_DEVICE);
        assert_int_equal(kept->slot, keep_slot);
        assert_int_equal(kvhi_blk(e, host[1])->tier, KVH_TIER_HOST);
        /* Two arenas: the blocks trade slots; one arena: each keeps its own. */
        assert_int_equal(up->slot, copies ? v_slot : b_slot);
        assert_int_equal(down->slot, copies ? b_slot : v_slot);
        assert_int_equal(kvhi_move_state(up), KVHI_MS_IDLE);
        assert_int_equal(kvhi_move_state(down), KVHI_MS_IDLE);
        assert_true(down->heap_pos != KVHI_HEAP_NONE);
        wb_unlock(e);
        kvh_stats b = dt_stats(e);
        legs l = legs_of(&a, &b);
        assert_int_equal(b.evictions - a.evictions, 1);
        if (copies) {
            assert_int_equal(l.d2h, 1);
            assert_int_equal(l.h2d, 1);
            assert_int_equal(l.in_place, 0);
        } else {
            assert_int_equal(l.d2h + l.h2d, 0);
            assert_int_equal(l.in_place, 2);
        }
        verify_a(e, s, ct, 4 * G.bt);

        /* Every device block held: nothing can trade places. */
        wb_lock(e);
        kvhi_block_hold(e, host[0]);
        kvhi_block_hold(e, dev[0]);
        uint32_t slot = kvhi_blk(e, host[1])->slot;
        int rc = kvhi_move_begin(e, host[1], KVH_TIER_DEVICE, &x, false);
        assert_int_equal(rc, KVH_ERR_NOSPACE);
        assert_non_null(strstr(kvh_last_error(), "no block in the target tier can make room"));
        assert_int_equal(kvhi_blk(e, host[1])->tier, KVH_TIER_HOST);
        assert_int_equal(kvhi_blk(e, host[1])->slot, slot);
        assert_int_equal(kvhi_move_state(kvhi_blk(e, host[1])), KVHI_MS_IDLE);
        assert_true(kvhi_blk(e, host[1])->heap_pos != KVHI_HEAP_NONE);
        kvhi_block_unhold(e, host[0]);
        kvhi_block_unhold(e, dev[0]);
        wb_unlock(e);
        assert_int_equal(dt_stats(e).evictions, b.evictions);
        verify_a(e, s, ct, 4 * G.bt);

        /* The lower block read without the lock: two arenas would
         * overwrite its slot under its reader, so no swap; one arena
         * trades tiers only. */
        wb_lock(e);
        kvhi_block_hold_reading(e, host[1]);
        if (copies) {
            expect_no_swap(e, host[1], slot);
        } else {
            assert_int_equal(kvhi_move_begin(e, host[1], KVH_TIER_DEVICE, &x, false), 1);
            assert_int_equal(kvhi_blk(e, host[1])->tier, KVH_TIER_DEVICE);
            assert_int_equal(kvhi_blk(e, host[1])->slot, slot);
        }
        kvhi_block_unhold_reading(e, host[1]);
        /* A clean disk copy being written from the lower block's slot
         * (a persist, the cleaner): no swap either, or the copy would take
         * the other block's bytes under this one's name. */
        kvhi_block_move_event(kvhi_blk(e, host[1]), KVHI_EV_COPY_BEGIN);
        if (copies)
            expect_no_swap(e, host[1], slot);
        else /* already in the device tier (above) */
            assert_int_equal(kvhi_move_begin(e, host[1], KVH_TIER_DEVICE, &x, false), 1);
        kvhi_block_move_event(kvhi_blk(e, host[1]), KVHI_EV_COPY_END);
        wb_unlock(e);
        verify_a(e, s, ct, 4 * G.bt);
        dt_assert_ok(kvh_seq_free(e, s));
        dt_assert_ok(dt_close(e));
    }
}

/* A promotion out of a full host tier into a full device tier. On one
 * arena it trades places with the device tier's victim: the host slot
 * the promotion frees is the victim's room, so no third block is pushed
 * out of the host tier (to disk, or dropped) to make it. On two arenas
 * the slot the promoted block leaves stays its clean copy, and the third
 * block goes down to make the victim's room. */
static void test_promotion_between_full_tiers_pushes_out_no_third_block(void **state)
{
    (void)state;
    for (int copies = 1; copies >= 0; copies--) {
        for (int with_disk = 1; with_disk >= 0; with_disk--) {
            char dir[PATH_MAX];
            dt_scratch(copies ? "swap-copy" : "swap-in-place", dir, sizeof(dir));
            kvh_config c = dt_cfg(G, with_disk ? dir : NULL, 2, 2, with_disk ? 8 : 0, 0);
            c.copy_moves = (uint32_t)copies;
            kvh_engine *e = dt_open_a(&c);
            kvh_seq s;
            dt_content ct = dt_plain(5);
            dt_assert_ok(dt_build(e, G, ct, 4 * G.bt, 0, &s)); /* both tiers full */
            uint64_t up = 4, stays = 4, dev[2], nd = 0;
            for (uint64_t i = 0; i < 4; i++) {
                if (dt_binfo(e, s, i).tier == KVH_TIER_DEVICE)
                    dev[nd++] = i;
                else if (up == 4)
                    up = i;
                else
                    stays = i;
            }
            assert_int_equal(nd, 2);
            assert_true(up < 4 && stays < 4);
            kvh_stats a = dt_stats(e);
            kvh_block hb;
            dt_assert_ok(kvh_seq_blocks(e, s, up * G.bt, 1, &hb));
            dt_assert_ok(kvh_migrate(e, &hb, 1, KVH_TIER_DEVICE, NULL));
            kvh_stats b = dt_stats(e);
            assert_int_equal(dt_binfo(e, s, up).tier, KVH_TIER_DEVICE);
            assert_int_equal(
                (dt_binfo(e, s, dev[0]).tier == KVH_TIER_HOST) + (dt_binfo(e, s, dev[1]).tier == KVH_TIER_HOST), 1);
            legs l = legs_of(&a, &b);
            assert_int_equal(used(e, KVH_TIER_HOST), 2);
            assert_int_equal(used(e, KVH_TIER_DEVICE), 2);
            if (copies) {
                /* Without a disk the referenced third block has nowhere
                 * to go, and the two trade places through a bounce buffer. */
                assert_int_equal(dt_binfo(e, s, stays).tier, with_disk ? KVH_TIER_DISK : KVH_TIER_HOST);
                assert_int_equal(dt_tier(e, KVH_TIER_HOST).clean_copies, with_disk ? 1 : 0);
                assert_int_equal(l.d2h + l.h2d, 2);
                assert_int_equal(l.h2k, with_disk ? 1 : 0);
            } else {
                assert_int_equal(dt_binfo(e, s, stays).tier, KVH_TIER_HOST);
                assert_int_equal(l.in_place, 2);
                assert_int_equal(l.h2k + l.d2h + l.h2d, 0);
                assert_int_equal(b.drops, a.drops);
                assert_int_equal(b.evictions - a.evictions, 1);
            }
            verify_a(e, s, ct, 4 * G.bt);
            dt_assert_ok(kvh_seq_free(e, s));
            dt_assert_ok(dt_close(e));
        }
    }
}

/* ---- device copies that fail (a CUDA error) ---- */

/* The backend's copies of one kind fail `fail` times after `skip` good
 * ones, on a device that is no longer host-addressable (as on CUDA, so
 * moves go through the backend). The first failure may free a sequence
 * first, with the lock dropped as the copy runs. */
static const kvhi_backend_ops *real_ops;
static kvhi_backend_ops failing_ops;
static struct {
    int kind, skip, fail;
    kvh_engine *e;
    kvh_seq free_on_fail;
} F = {.kind = -1};

static int failing_copy(void *ctx, void *dst, const void *src, size_t n, enum kvhi_copy_kind kind, char *msg,
                        size_t msg_len)
{
    if ((int)kind == F.kind && F.skip-- <= 0 && F.fail > 0) {
        F.fail--;
        if (F.free_on_fail.id) {
            kvh_seq gone = F.free_on_fail;
            F.free_on_fail.id = 0;
            kvh_seq_free(F.e, gone);
        }
        snprintf(msg, msg_len, "simulated device copy failure");
        return -1;
    }
    return real_ops->copy(ctx, dst, src, n, kind, msg, msg_len);
}

static void fail_device_copies(kvh_engine *e, enum kvhi_copy_kind kind, int skip, int fail)
{
    F.kind = (int)kind;
    F.skip = skip;
    F.fail = fail;
    F.e = e;
    real_ops = e->backend;
    failing_ops = *real_ops;
    failing_ops.copy = failing_copy;
    e->backend = &failing_ops;
    e->device_host_addressable = false;
}

static void restore_device(kvh_engine *e)
{
    e->backend = real_ops;
    e->device_host_addressable = true;
    F.kind = -1;
    F.free_on_fail.id = 0;
}

/* A device block written to disk is first staged in host memory; when
 * that copy fails nothing may be written under the block's name (the
 * staging buffer holds an earlier block's bytes, and a CRC of them would
 * vouch for them). */
static void test_a_failed_staging_copy_writes_nothing(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("stage-copy-fault", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 2, 2, 8, 0);
    c.copy_moves = 1;
    kvh_engine *e = dt_open_a(&c);
    kvh_seq s;
    dt_content ct = dt_plain(5);
    dt_assert_ok(dt_build(e, G, ct, G.bt, 0, &s));
    kvh_block b;
    dt_assert_ok(kvh_seq_blocks(e, s, 0, 1, &b));
    fail_device_copies(e, KVHI_COPY_DEVICE_TO_HOST, 0, 1);
    kvh_status st = kvh_migrate(e, &b, 1, KVH_TIER_DISK, NULL);
    restore_device(e);
    assert_int_equal(st, KVH_ERR_IO);
    kvh_block_info info = {.struct_size = sizeof(info)};
    dt_assert_ok(kvh_block_info_get(e, b, &info));
    assert_int_equal(info.tier, KVH_TIER_DEVICE);
    verify_a(e, s, ct, G.bt);
    dt_assert_ok(kvh_migrate(e, &b, 1, KVH_TIER_DISK, NULL)); /* and it can still go */
    verify_a(e, s, ct, G.bt);
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
}

/* A tier swap whose copies fail is undone: both blocks keep their bytes;
 * and a block freed while the swap's copies ran is reaped, its slot free
 * again. */
static void test_a_failed_swap_is_undone_and_reaps_a_freed_victim(void **state)
{
    (void)state;
    for (int step = 0; step < 3; step++) {
        kvh_config c = dt_cfg(G, NULL, 1, 1, 0, 0);
        c.copy_moves = 1;
        kvh_engine *e = dt_open_a(&c);
        /* `down` is made first and pushed to the host tier by `up`, which
         * takes the device slot; at step 2 `up` is a partial block (never
         * published: freeing its sequence frees it). */
        kvh_seq up, down;
        dt_content cu = dt_plain(6), cd = dt_plain(7);
        size_t up_tokens = step == 2 ? G.bt / 2 : G.bt;
        dt_assert_ok(dt_build(e, G, cd, G.bt, 0, &down));
        dt_assert_ok(dt_build(e, G, cu, up_tokens, 0, &up));
        kvh_block hb;
        dt_assert_ok(kvh_seq_blocks(e, down, 0, 1, &hb));
        kvh_block_info info = {.struct_size = sizeof(info)};
        dt_assert_ok(kvh_block_info_get(e, hb, &info));
        assert_int_equal(info.tier, KVH_TIER_HOST);
        /* Bringing `down` up swaps it with `up`: the upper block is copied
         * to a bounce buffer (device to host), the lower one up (host to
         * device), then the bounce down (host to host). Step 0: the first
         * copy fails; 1: the second (undone from the bounce buffer); 2:
         * the first, with `up` freed while it runs. */
        if (step == 1)
            fail_device_copies(e, KVHI_COPY_HOST_TO_DEVICE, 0, 1);
        else
            fail_device_copies(e, KVHI_COPY_DEVICE_TO_HOST, 0, 1);
        if (step == 2)
            F.free_on_fail = up;
        kvh_status st = kvh_migrate(e, &hb, 1, KVH_TIER_DEVICE, NULL);
        restore_device(e);
        assert_int_equal(st, KVH_ERR_IO);
        verify_a(e, down, cd, G.bt);
        if (step < 2) {
            verify_a(e, up, cu, up_tokens);
            dt_assert_ok(kvh_seq_free(e, up));
        }
        dt_assert_ok(kvh_seq_free(e, down));
        /* Both slots can be taken again (a freed block's slot was lost). */
        kvh_block a1, a2;
        dt_assert_ok(kvh_block_alloc(e, 0, &a1));
        dt_assert_ok(kvh_block_alloc(e, 0, &a2));
        dt_assert_ok(kvh_block_release(e, a1));
        dt_assert_ok(kvh_block_release(e, a2));
        dt_assert_ok(dt_close(e));
    }
}

/* ---- a block read without the lock, moved up by a copy ---- */

/* A pool transfer, a streamed chunk or an upload reads a block's bytes
 * without the lock, from the slot it found the block in. When another
 * thread promotes the block meanwhile, that slot must not be given to
 * anything else before the last such read ends. A plain hold (an
 * acquire's) does not keep the slot. */
static void test_read_block_keeps_its_source(void **state)
{
    (void)state;
    kvh_config c = dt_cfg(G, NULL, 4, 4, 0, 0);
    c.copy_moves = 1;
    kvh_engine *e = dt_open_a(&c);
    kvh_seq s, t;
    dt_content ct = dt_plain(1), other = dt_plain(2);
    dt_assert_ok(dt_build(e, G, ct, G.bt, 0, &s));
    uint32_t b = wb_seq_block_index(e, s, 0);
    kvhi_block *blk = kvhi_blk(e, b);
    size_t bytes = dt_block_bytes(G);
    uint8_t *before = malloc(bytes);
    assert_non_null(before);

    wb_lock(e);
    dt_assert_ok(kvhi_move_block(e, b, KVH_TIER_HOST, 0));
    assert_int_equal(blk->tier, KVH_TIER_HOST);
    uint32_t src = blk->slot, host0 = used(e, KVH_TIER_HOST);
    const uint8_t *read_by_holder = kvhi_block_data(e, b);
    memcpy(before, read_by_holder, bytes);
    kvhi_block_hold_reading(e, b);
    kvhi_block_hold_reading(e, b);                           /* reads nest: the source waits for the last */
    dt_assert_ok(kvhi_move_block(e, b, KVH_TIER_DEVICE, 0)); /* another thread's promotion */
    assert_int_equal(blk->tier, KVH_TIER_DEVICE);
    assert_int_equal(used(e, KVH_TIER_HOST), host0); /* the source is still taken */
    wb_unlock(e);

    /* New blocks fill the host tier: none gets the held source. */
    dt_assert_ok(dt_build(e, G, other, 3 * G.bt, 0, &t));
    uint32_t others[3];
    for (uint64_t i = 0; i < 3; i++)
        others[i] = wb_seq_block_index(e, t, i);
    wb_lock(e);
    for (uint64_t i = 0; i < 3; i++) {
        uint32_t o = others[i];
        if (kvhi_blk(e, o)->tier == KVH_TIER_DEVICE)
            dt_assert_ok(kvhi_move_block(e, o, KVH_TIER_HOST, 0));
        assert_int_equal(kvhi_blk(e, o)->tier, KVH_TIER_HOST);
        assert_int_not_equal(kvhi_blk(e, o)->slot, src);
    }
    assert_int_equal(used(e, KVH_TIER_HOST), 4);
    assert_memory_equal(read_by_holder, before, bytes);
    kvhi_block_unhold_reading(e, b);
    assert_int_equal(used(e, KVH_TIER_HOST), 4);
    kvhi_block_unhold_reading(e, b); /* the last read: the source is free */
    assert_int_equal(used(e, KVH_TIER_HOST), 3);
    assert_int_equal(e->n_read_slots, 0);
    wb_unlock(e);
    verify_a(e, s, ct, G.bt);

    /* Held as an acquire holds, or not at all: the source is freed with
     * the move. */
    for (int hold = 1; hold >= 0; hold--) {
        wb_lock(e);
        dt_assert_ok(kvhi_move_block(e, b, KVH_TIER_HOST, 0));
        uint32_t host1 = used(e, KVH_TIER_HOST);
        if (hold)
            kvhi_block_hold(e, b);
        dt_assert_ok(kvhi_move_block(e, b, KVH_TIER_DEVICE, 0));
        /* Free to the next block that needs it, or kept as b's clean copy
         * until one does (core/clean_copy.h). */
        assert_int_equal(used(e, KVH_TIER_HOST) - e->clean.count, host1 - 1);
        if (hold)
            kvhi_block_unhold(e, b);
        wb_unlock(e);
    }
    free(before);
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(kvh_seq_free(e, t));
    dt_assert_ok(dt_close(e));
}

/* ---- a failed disk read ---- */

static uint32_t live_on_disk(kvh_engine *e)
{
    uint32_t n = 0;
    wb_lock(e);
    for (uint32_t b = 0; b < e->block_cap; b++)
        n += (e->blocks[b].flags & KVHI_BF_LIVE) && e->blocks[b].tier == KVH_TIER_DISK;
    wb_unlock(e);
    return n;
}

static void test_failed_read_marks_corrupt(void **state)
{
    (void)state;
    char dir[PATH_MAX], slab[PATH_MAX + 32];
    dt_scratch("corrupt", dir, sizeof(dir));
    dt_log log;
    dt_log_init(&log);
    kvh_config c = dt_cfg(G, dir, 4, 4, 16, 0);
    dt_log_attach(&c, &log);
    dt_content ct = dt_plain(5);
    int32_t tk[2 * 16];
    dt_tokens(ct, 0, 2 * G.bt, tk);

    kvh_engine *e = dt_open_a(&c);
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, ct, 2 * G.bt, 0, &s));
    dt_assert_ok(kvh_seq_persist(e, s));
    uint32_t b0 = wb_seq_block_index(e, s, 0);
    wb_lock(e);
    uint32_t slot0 = kvhi_blk(e, b0)->disk_copy;
    wb_unlock(e);
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
    /* One bit of block 0's data. */
    assert_int_equal(dt_flip_bit(dt_path(slab, sizeof(slab), dir, "slab-0000.kvh"),
                                 (uint64_t)slot0 * dt_slot_bytes(G) + 4096 + 1000, 5),
                     0);

    e = dt_open_a(&c);
    assert_int_equal(live_on_disk(e), 2);
    kvh_block h[2];
    size_t n = 0;
    dt_assert_ok(kvh_prefix_lookup(e, tk, 2 * G.bt, h, 2, &n)); /* references, no I/O */
    assert_int_equal(n, 2);
    uint32_t b = KVHI_NO_BLOCK;
    kvh_stats a = dt_stats(e);
    wb_lock(e);
    dt_assert_ok(kvhi_block_resolve(e, h[0], &b));
    kvhi_block *blk = kvhi_blk(e, b);
    uint64_t hash = blk->hash;
    assert_int_equal(blk->tier, KVH_TIER_DISK);
    assert_int_equal(blk->slot, slot0);
    assert_true(blk->flags & KVHI_BF_PUBLISHED);
    assert_true(blk->flags & KVHI_BF_JOURNALED);
    uint32_t host0 = used(e, KVH_TIER_HOST);
    kvhi_xfer x;
    assert_int_equal(kvhi_move_begin(e, b, KVH_TIER_HOST, &x, false), 0);
    run_xfer(e, &x);
    assert_int_equal(x.err, 1); /* read, but failed verification */
    assert_non_null(x.why);
    assert_int_equal(kvhi_move_end(e, &x, NULL), KVH_ERR_CORRUPT);
    assert_true(blk->flags & KVHI_BF_CORRUPT);
    assert_false(blk->flags & (KVHI_BF_PUBLISHED | KVHI_BF_JOURNALED));
    assert_int_equal(kvhi_prefix_find(&e->prefix, hash), KVHI_PREFIX_MISS);
    assert_int_equal(blk->tier, KVH_TIER_DISK);
    assert_int_equal(blk->slot, slot0);
    assert_int_equal(used(e, KVH_TIER_HOST), host0);
    assert_int_equal(e->stats.corrupt_blocks - a.corrupt_blocks, 1);
    assert_int_equal(e->stats.blocks_disk_to_host, a.blocks_disk_to_host);
    /* Never moved or served again. */
    assert_int_equal(kvhi_move_begin(e, b, KVH_TIER_HOST, &x, false), KVH_ERR_CORRUPT);
    assert_int_equal(kvhi_move_state(blk), KVHI_MS_IDLE);
    assert_int_equal(kvhi_block_ensure_memory(e, b), KVH_ERR_CORRUPT);
    assert_int_equal(blk->tier, KVH_TIER_DISK);
    wb_unlock(e);
    kvh_seq m;
    size_t matched = 99;
    dt_assert_ok(dt_match(e, ct, 2 * G.bt, &m, &matched));
    assert_int_equal(matched, 0);
    dt_assert_ok(kvh_seq_free(e, m));
    assert_int_equal(dt_log_count(&log, KVH_LOG_WARN, "dropped block", NULL), 1);
    /* The last reference frees it and its slot. */
    uint64_t freed = dt_stats(e).blocks_freed;
    dt_assert_ok(kvh_block_release(e, h[0]));
    assert_int_equal(dt_stats(e).blocks_freed - freed, 1);
    assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, 1);

    /* Block 1 and a read that fails with an I/O error: the move fails, the
     * block keeps everything. */
    hook_reset();
    atomic_store(&H.fail_err, -EIO);
    atomic_store(&H.fail_left, 1);
    atomic_store(&H.fail_op, KVHI_OP_READ);
    kvhi_disk_set_fault_hook(hook, NULL);
    wb_lock(e);
    dt_assert_ok(kvhi_block_resolve(e, h[1], &b));
    blk = kvhi_blk(e, b);
    assert_int_equal(kvhi_move_begin(e, b, KVH_TIER_HOST, &x, false), 0);
    run_xfer(e, &x);
    assert_int_equal(x.err, -EIO);
    assert_int_equal(kvhi_move_end(e, &x, NULL), KVH_ERR_IO);
    assert_false(blk->flags & KVHI_BF_CORRUPT);
    assert_true(blk->flags & KVHI_BF_PUBLISHED);
    assert_true(blk->flags & KVHI_BF_JOURNALED);
    assert_int_equal(blk->tier, KVH_TIER_DISK);
    assert_int_equal(e->stats.corrupt_blocks - a.corrupt_blocks, 1);
    /* The error is gone: the same move succeeds. */
    assert_int_equal(kvhi_move_begin(e, b, KVH_TIER_HOST, &x, false), 0);
    run_xfer(e, &x);
    assert_int_equal(x.err, 0);
    dt_assert_ok(kvhi_move_end(e, &x, NULL));
    assert_int_equal(blk->tier, KVH_TIER_HOST);
    wb_unlock(e);
    kvhi_disk_set_fault_hook(NULL, NULL);
    dt_assert_ok(kvh_block_release(e, h[1]));
    dt_assert_ok(dt_close(e));

    /* Its record was deleted: a new engine finds only block 1. */
    e = dt_open_a(&c);
    assert_int_equal(live_on_disk(e), 1);
    assert_int_equal(dt_stats(e).corrupt_blocks, 0);
    dt_assert_ok(dt_close(e));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_begin_end, teardown),
        cmocka_unit_test_teardown(test_a_second_move_of_a_block_in_flight_is_refused, teardown),
        cmocka_unit_test_teardown(test_counters_of_each_leg, teardown),
        cmocka_unit_test_teardown(test_demotion_to_clean_copy, teardown),
        cmocka_unit_test_teardown(test_swap_when_both_full, teardown),
        cmocka_unit_test_teardown(test_promotion_between_full_tiers_pushes_out_no_third_block, teardown),
        cmocka_unit_test_teardown(test_a_failed_staging_copy_writes_nothing, teardown),
        cmocka_unit_test_teardown(test_a_failed_swap_is_undone_and_reaps_a_freed_victim, teardown),
        cmocka_unit_test_teardown(test_read_block_keeps_its_source, teardown),
        cmocka_unit_test_teardown(test_failed_read_marks_corrupt, teardown),
    };
    return cmocka_run_group_tests_name("move", tests, NULL, NULL);
}
