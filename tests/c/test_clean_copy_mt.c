/* Clean host copies (core/clean_copy.c) under threads: each thread owns
 * blocks that keep copies (immutable twins of published blocks, so they
 * are written in place) and promotes them, demotes them (through the
 * migration workers), rewrites them whole and reads them back, while all
 * threads promote, demote and read one shared published prefix (each
 * through a sequence of its own). The device tier
 * is smaller than what they use, so other threads' acquires evict blocks
 * onto their copies and the host tier takes copies back for room. Every
 * read must return the last bytes written, and at the end every kept slot
 * must belong to a block in the device tier.
 *
 * A second run adds a thread of pool batches (offloads promoted, then
 * restored while demotions onto their copies and promotions run, handles
 * released mid-batch, persists) and forks written on copy, over a disk
 * tier: afterwards every device and host slot taken belongs to a live
 * block there or is one kept copy, also once everything is freed. */
#include "disk_test_util.h"
#include "mt_util.h"
#include "pool_test_util.h"

#include "core/engine.h"
#include "core/host_spare.h"
#include "white_box_util.h"
#include "core/block.h"

static const dt_geo G = {2, 1, 32, 16, KVH_DTYPE_F16}; /* block = 4096 bytes */
#define TOKEN_ELEMS (1 * 32)
#define THREADS 3
#define OWN_BLOCKS 2
#define ROUNDS 400

static kvh_seq shared_seq, shared_view[THREADS]; /* the views: one per thread */
static dt_content shared_content;
static kvh_seq own_seq[THREADS];
static dt_content own_content[THREADS];

static uint16_t value_of(int t, int round, int j) { return (uint16_t)(0x3c00 + ((t * 7 + round * 3 + j) & 0x3ff)); }

/* Every K and V element of block j of s is v. Returns false on an error
 * too (reported). */
static bool block_reads(mt_worker *w, kvh_seq s, int j, uint16_t v)
{
    uint16_t k[16 * TOKEN_ELEMS], vv[16 * TOKEN_ELEMS];
    for (uint32_t l = 0; l < G.layers; l++) {
        kvh_status st = kvh_seq_read_kv(w->e, s, l, (uint64_t)j * G.bt, G.bt, k, vv);
        if (st != KVH_OK) {
            mt_report(w, "read_kv: %s", kvh_status_name(st));
            return false;
        }
        for (size_t i = 0; i < G.bt * TOKEN_ELEMS; i++)
            if (k[i] != v || vv[i] != v) {
                mt_report(w, "block %d layer %u element %zu: %04x %04x, expected %04x", j, l, i, k[i], vv[i], v);
                return false;
            }
    }
    return true;
}

static kvh_status acquire_release(kvh_engine *e, kvh_seq s, uint64_t first, uint64_t n)
{
    kvh_status st;
    /* Every device slot may be held by the other threads for a moment. */
    while ((st = kvh_seq_acquire(e, s, first, n, NULL)) == KVH_ERR_NOSPACE)
        sched_yield();
    return st == KVH_OK ? kvh_seq_release(e, s, first, n) : st;
}

static void *worker(void *arg)
{
    mt_worker *w = arg;
    kvh_engine *e = w->e;
    kvh_seq s = own_seq[w->t];
    dt_rng rng = {dt_seed(0xc1ea9) + (uint64_t)w->t};
    uint16_t written[OWN_BLOCKS] = {0}; /* 0: the built content */
    char msg[256];
    for (int round = 0; round < ROUNDS && !w->errors; round++) {
        kvh_status st = KVH_OK;
        int j = (int)dt_below(&rng, OWN_BLOCKS);
        switch (dt_below(&rng, 5)) {
        case 0:
            st = acquire_release(e, s, 0, (uint64_t)OWN_BLOCKS * G.bt);
            break;
        case 1:
            st = kvh_seq_migrate(e, s, 0, (uint64_t)OWN_BLOCKS * G.bt, KVH_TIER_HOST, NULL);
            break;
        case 2: {
            uint16_t v = value_of(w->t, round, j), buf[16 * TOKEN_ELEMS];
            for (size_t i = 0; i < G.bt * TOKEN_ELEMS; i++)
                buf[i] = v;
            for (uint32_t l = 0; l < G.layers && st == KVH_OK; l++)
                st = kvh_seq_write_kv(e, s, l, (uint64_t)j * G.bt, G.bt, buf, buf);
            written[j] = v;
            break;
        }
        case 3:
            st = acquire_release(e, shared_view[w->t], 0, 2 * G.bt);
            if (st == KVH_OK &&
                dt_verify(e, shared_view[w->t], G, shared_content, 0, 2 * G.bt, msg, sizeof(msg)) != KVH_OK)
                mt_report(w, "shared prefix: %s", msg);
            break;
        default:
            /* Down while other threads may hold or promote it. */
            st = kvh_seq_migrate(e, shared_view[w->t], 0, 2 * G.bt, KVH_TIER_HOST, NULL);
            break;
        }
        if (st != KVH_OK) {
            mt_report(w, "round %d: %s: %s", round, kvh_status_name(st), kvh_last_error());
            break;
        }
        for (int b = 0; b < OWN_BLOCKS && !w->errors; b++) {
            if (written[b])
                block_reads(w, s, b, written[b]);
            else if (dt_verify(e, s, G, own_content[w->t], (uint64_t)b * G.bt, G.bt, msg, sizeof(msg)) != KVH_OK)
                mt_report(w, "block %d: %s", b, msg);
        }
    }
    return NULL;
}

/* A failed assertion under wb_lock leaves the lock held: let it go, so
 * that the engine can be closed instead of the test hanging. */
static int teardown(void **state)
{
    wb_release_held_lock();
    return dt_teardown(state);
}

static void test_threads_promote_demote_write_and_read(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("clean-mt", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 6, 6, 64, 2);
    c.copy_moves = 1;
    kvh_engine *e = dt_open_a(&c);
    shared_content = dt_plain(100);
    dt_assert_ok(dt_build(e, G, shared_content, 2 * G.bt, 0, &shared_seq));
    kvh_seq published[THREADS];
    for (int t = 0; t < THREADS; t++) {
        own_content[t] = dt_plain(200 + (uint64_t)t);
        /* The published original, then the twin the thread writes in place. */
        dt_assert_ok(dt_build(e, G, own_content[t], OWN_BLOCKS * G.bt, 0, &published[t]));
        dt_assert_ok(dt_build(e, G, own_content[t], OWN_BLOCKS * G.bt, 0, &own_seq[t]));
        assert_int_equal(dt_binfo(e, own_seq[t], 0).published, 0);
        size_t matched = 0;
        dt_assert_ok(dt_match(e, shared_content, 2 * G.bt, &shared_view[t], &matched));
        assert_int_equal(matched, 2 * G.bt);
    }
    mt_worker w[THREADS];
    mt_run(e, THREADS, worker, w);

    kvh_stats st = dt_stats(e);
    assert_true(st.clean_copy_demotions > 0); /* the path ran */
    /* Every kept slot belongs to a live block in the device tier, and the
     * list and the per-block slots agree. */
    uint64_t kept_now = dt_tier(e, KVH_TIER_HOST).clean_copies;
    wb_lock(e);
    uint32_t kept = 0;
    for (uint32_t b = 0; b < e->block_cap; b++) {
        uint32_t slot = e->clean.slot_of[b];
        if (slot == KVHI_NO_BLOCK)
            continue;
        kept++;
        assert_true(e->blocks[b].flags & KVHI_BF_LIVE);
        assert_int_equal(e->blocks[b].tier, KVH_TIER_DEVICE);
        assert_int_equal(e->clean.links[slot].block, b);
    }
    assert_int_equal(kept, e->clean.count);
    assert_int_equal(kept_now, kept);
    assert_true(st.clean_copies_kept >= st.clean_copy_demotions + st.clean_copies_reclaimed + kept);
    wb_unlock(e);
    for (int t = 0; t < THREADS; t++) {
        dt_assert_ok(kvh_seq_free(e, own_seq[t]));
        dt_assert_ok(kvh_seq_free(e, published[t]));
        dt_assert_ok(kvh_seq_free(e, shared_view[t]));
    }
    dt_assert_ok(kvh_seq_free(e, shared_seq));
    dt_assert_ok(dt_close(e));
}

/* ---- with pool batches, a disk tier and forks ---- */

#define PN 4 /* blocks per pool batch */
#define UNKNOWN 0xffffu
#define PROUNDS 60
static pt_pool pool_mem;
static kvh_pool pool;

/* Waits for a move and tells whether it failed for a reason other than
 * room (the tiers are small and every thread moves blocks). */
static bool move_failed(mt_worker *w, kvh_engine *e, kvh_status st, kvh_fence *f, const char *what)
{
    if (st == KVH_OK && f) {
        st = kvh_fence_wait(e, *f, UINT64_MAX);
        kvh_fence_free(e, *f);
    }
    if (st == KVH_OK || st == KVH_ERR_NOSPACE || st == KVH_ERR_BUSY)
        return false;
    mt_report(w, "%s: %s: %s", what, kvh_status_name(st), kvh_last_error());
    return true;
}

/* Offloads PN pool slots as new blocks, promotes them (copies kept),
 * then restores them into the other half of the pool while a demotion
 * (onto the copies) and a promotion of the same blocks run. */
static void *pool_worker(void *arg)
{
    mt_worker *w = arg;
    kvh_engine *e = w->e;
    for (uint32_t round = 0; round < PROUNDS && !w->errors; round++) {
        kvh_pool_xfer x[PN];
        int32_t tok[PN][16];
        uint64_t parent = 0;
        for (uint32_t i = 0; i < PN; i++) {
            pt_tokens(tok[i], G.bt, 7000 + round, i);
            x[i] = (kvh_pool_xfer){
                .struct_size = sizeof(kvh_pool_xfer), .slot = i, .parent_hash = parent, .tokens = tok[i]};
            dt_assert_ok(kvh_prefix_hash(e, parent, tok[i], G.bt, &parent));
        }
        kvh_fence f;
        if (kvh_pool_offload_batch(e, pool, x, PN, 0, &f) != KVH_OK) {
            mt_report(w, "offload: %s", kvh_last_error());
            break;
        }
        if (kvh_fence_wait(e, f, UINT64_MAX) != KVH_OK)
            mt_report(w, "offload fence: %s", kvh_last_error());
        kvh_fence_free(e, f);
        kvh_block blocks[PN];
        for (uint32_t i = 0; i < PN; i++)
            blocks[i] = x[i].block;
        if (move_failed(w, e, kvh_migrate(e, blocks, PN, KVH_TIER_HOST, &f), &f, "down") ||
            move_failed(w, e, kvh_migrate(e, blocks, PN, KVH_TIER_DEVICE, &f), &f, "up"))
            break;
        if (round % 5 == 0 && move_failed(w, e, kvh_blocks_persist(e, blocks, PN, NULL), NULL, "persist"))
            break;
        kvh_pool_xfer r[PN];
        for (uint32_t i = 0; i < PN; i++)
            r[i] = (kvh_pool_xfer){.struct_size = sizeof(kvh_pool_xfer), .slot = PN + i, .block = blocks[i]};
        kvh_fence lf[2];
        if (kvh_pool_restore_batch(e, pool, r, PN, 0, G.layers, lf) != KVH_OK) {
            mt_report(w, "restore: %s", kvh_last_error());
            break;
        }
        kvh_fence mf[2];
        kvh_status s1 = kvh_migrate(e, blocks, PN, round & 1 ? KVH_TIER_DISK : KVH_TIER_HOST, &mf[0]);
        kvh_status s2 = kvh_migrate(e, blocks, PN / 2, KVH_TIER_DEVICE, &mf[1]);
        if (round & 2) /* allowed while the batch runs */
            for (uint32_t i = 0; i < PN; i++)
                kvh_block_release(e, blocks[i]);
        move_failed(w, e, s1, &mf[0], "down under a restore");
        move_failed(w, e, s2, &mf[1], "up under a restore");
        for (uint32_t l = 0; l < G.layers; l++) {
            kvh_status st = kvh_fence_wait(e, lf[l], UINT64_MAX);
            kvh_fence_free(e, lf[l]);
            if (st != KVH_OK)
                mt_report(w, "restore layer %u: %s", l, kvh_status_name(st));
            for (uint32_t i = 0; i < PN; i++) {
                if (!pt_layer_equal(&pool_mem, i, &pool_mem, PN + i, l))
                    mt_report(w, "round %u: block %u layer %u restored wrong", round, i, l);
                pt_layer_clear(&pool_mem, PN + i, l);
            }
        }
        if (!(round & 2))
            for (uint32_t i = 0; i < PN; i++)
                kvh_block_release(e, blocks[i]);
    }
    return NULL;
}

/* Own blocks (twins written in place) moved anywhere, written, read, and
 * forked: a child's write copies on write and never reaches the parent. */
static void *own_worker(void *arg)
{
    mt_worker *w = arg;
    kvh_engine *e = w->e;
    kvh_seq s = own_seq[w->t];
    dt_rng rng = {dt_seed(0xc1eab) + (uint64_t)w->t};
    uint16_t written[OWN_BLOCKS] = {0};
    char msg[256];
    for (int round = 0; round < ROUNDS && !w->errors; round++) {
        kvh_status st = KVH_OK;
        int j = (int)dt_below(&rng, OWN_BLOCKS);
        kvh_fence f;
        switch (dt_below(&rng, 6)) {
        case 0:
            st = acquire_release(e, s, 0, (uint64_t)OWN_BLOCKS * G.bt);
            break;
        case 1:
        case 2: {
            uint32_t tier = dt_below(&rng, 3) ? KVH_TIER_HOST : KVH_TIER_DISK;
            move_failed(w, e, kvh_seq_migrate(e, s, 0, (uint64_t)OWN_BLOCKS * G.bt, tier, &f), &f, "migrate");
            break;
        }
        case 3: {
            uint16_t v = value_of(w->t, round, j), buf[16 * TOKEN_ELEMS];
            for (size_t i = 0; i < G.bt * TOKEN_ELEMS; i++)
                buf[i] = v;
            for (uint32_t l = 0; l < G.layers && st == KVH_OK; l++)
                st = kvh_seq_write_kv(e, s, l, (uint64_t)j * G.bt, G.bt, buf, buf);
            /* A write refused for room part way leaves the block mixed:
             * unchecked until it is written whole again. */
            written[j] = st == KVH_OK ? v : UNKNOWN;
            break;
        }
        case 4: { /* a fork written in place of nothing of ours */
            kvh_seq child;
            st = kvh_seq_fork(e, s, 0, &child);
            if (st != KVH_OK)
                break;
            uint16_t buf[16 * TOKEN_ELEMS];
            for (size_t i = 0; i < G.bt * TOKEN_ELEMS; i++)
                buf[i] = 0x7bff;
            for (uint32_t l = 0; l < G.layers && st == KVH_OK; l++)
                st = kvh_seq_write_kv(e, child, l, (uint64_t)j * G.bt, G.bt, buf, buf);
            if (st == KVH_OK)
                move_failed(w, e, kvh_seq_migrate(e, child, 0, (uint64_t)OWN_BLOCKS * G.bt, KVH_TIER_HOST, &f), &f,
                            "child down");
            if (st == KVH_OK && !block_reads(w, child, j, 0x7bff))
                mt_report(w, "child block %d", j);
            kvh_status fs = kvh_seq_free(e, child);
            if (st == KVH_OK)
                st = fs;
            break;
        }
        default:
            st = acquire_release(e, shared_view[w->t], 0, 2 * G.bt);
            if (st == KVH_OK &&
                dt_verify(e, shared_view[w->t], G, shared_content, 0, 2 * G.bt, msg, sizeof(msg)) != KVH_OK)
                mt_report(w, "shared prefix: %s", msg);
            break;
        }
        if (st != KVH_OK && st != KVH_ERR_NOSPACE) {
            mt_report(w, "round %d: %s: %s", round, kvh_status_name(st), kvh_last_error());
            break;
        }
        for (int b = 0; b < OWN_BLOCKS && !w->errors; b++) {
            if (written[b] == UNKNOWN)
                continue;
            if (written[b])
                block_reads(w, s, b, written[b]);
            else if (dt_verify(e, s, G, own_content[w->t], (uint64_t)b * G.bt, G.bt, msg, sizeof(msg)) != KVH_OK)
                mt_report(w, "block %d: %s", b, msg);
        }
    }
    return NULL;
}

static void *mixed_worker(void *arg)
{
    mt_worker *w = arg;
    return w->t == 0 ? pool_worker(arg) : own_worker(arg);
}

/* Every host and device slot taken belongs to a live block there or is a
 * kept copy of one in the device tier, and the counts agree: nothing
 * leaked, nothing kept for a block that left. */
static void check_slots_accounted(kvh_engine *e)
{
    kvh_tier_info host = dt_tier(e, KVH_TIER_HOST), dev = dt_tier(e, KVH_TIER_DEVICE);
    wb_lock(e);
    uint32_t in_tier[2] = {0, 0}, kept = 0;
    for (uint32_t b = 0; b < e->block_cap; b++) {
        const kvhi_block *blk = &e->blocks[b];
        if ((blk->flags & KVHI_BF_LIVE) && blk->tier < KVH_TIER_DISK)
            in_tier[blk->tier]++;
        if (e->clean.slot_of[b] != KVHI_NO_BLOCK) {
            kept++;
            assert_true(blk->flags & KVHI_BF_LIVE);
            assert_int_equal(blk->tier, KVH_TIER_DEVICE);
            assert_int_equal(e->clean.links[e->clean.slot_of[b]].block, b);
        }
    }
    assert_int_equal(kept, e->clean.count);
    assert_int_equal(kvhi_slot_pool_used(&e->tiers[KVH_TIER_DEVICE].slots), in_tier[KVH_TIER_DEVICE]);
    /* and the host tier's spare, while it is held back */
    assert_int_equal(kvhi_slot_pool_used(&e->tiers[KVH_TIER_HOST].slots),
                     in_tier[KVH_TIER_HOST] + kept + kvhi_host_spare_held(e));
    wb_unlock(e);
    assert_int_equal(host.clean_copies, kept);
    assert_int_equal(host.used_blocks, in_tier[KVH_TIER_HOST]);
    assert_int_equal(dev.used_blocks, in_tier[KVH_TIER_DEVICE]);
}

static void test_threads_with_pool_batches_disk_and_forks(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("clean-mt-pool", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 8, 8, 256, 2);
    c.copy_moves = 1;
    kvh_engine *e = dt_open_a(&c);
    pt_pool_init(&pool_mem, G.layers, 2 * PN, G.bt, G.heads, G.dim, 2, 0x9001);
    dt_assert_ok(kvh_pool_register(e, &pool_mem.layout, &pool));
    shared_content = dt_plain(300);
    dt_assert_ok(dt_build(e, G, shared_content, 2 * G.bt, 0, &shared_seq));
    kvh_seq published[THREADS];
    for (int t = 0; t < THREADS; t++) {
        own_content[t] = dt_plain(400 + (uint64_t)t);
        dt_assert_ok(dt_build(e, G, own_content[t], OWN_BLOCKS * G.bt, 0, &published[t]));
        dt_assert_ok(dt_build(e, G, own_content[t], OWN_BLOCKS * G.bt, 0, &own_seq[t]));
        size_t matched = 0;
        dt_assert_ok(dt_match(e, shared_content, 2 * G.bt, &shared_view[t], &matched));
        assert_int_equal(matched, 2 * G.bt);
    }
    mt_worker w[THREADS];
    mt_run(e, THREADS, mixed_worker, w);
    assert_true(dt_stats(e).clean_copies_kept > 0);
    check_slots_accounted(e);
    for (int t = 0; t < THREADS; t++) {
        dt_assert_ok(kvh_seq_free(e, own_seq[t]));
        dt_assert_ok(kvh_seq_free(e, published[t]));
        dt_assert_ok(kvh_seq_free(e, shared_view[t]));
    }
    dt_assert_ok(kvh_seq_free(e, shared_seq));
    dt_assert_ok(kvh_pool_unregister(e, pool));
    check_slots_accounted(e);
    dt_assert_ok(dt_close(e));
    pt_pool_free(&pool_mem);
}

/* ---- a write racing a demotion of its own blocks ---- */

/* kvh_seq_write_kv makes every block of its range private, then writes
 * them one by one, bringing each into memory; that may drop the lock
 * (block A read from disk) while a migration worker starts demoting a
 * later block B of the range to disk. The write recalls B's demotion,
 * and a recalled immutable block keeps the disk slot just written as a
 * clean disk copy: the write must drop that copy as it drops a kept host
 * copy, or B's next demotion reuses the disk bytes from before the
 * write. Each round checks the written bytes after B went down again. */
static void test_write_drops_copies_made_while_it_waited(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("write-race", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 6, 6, 64, 1);
    c.copy_moves = 1;
    kvh_engine *e = dt_open_a(&c);
    kvh_seq first, s, other;
    dt_content ct = dt_plain(500), co = dt_plain(501);
    dt_assert_ok(dt_build(e, G, ct, 4 * G.bt, 0, &first));
    dt_assert_ok(dt_build(e, G, ct, 4 * G.bt, 0, &s)); /* the unpublished twin, written in place */
    dt_assert_ok(dt_build(e, G, co, 2 * G.bt, 0, &other));
    uint16_t buf[4 * 16 * TOKEN_ELEMS];
    int stale = 0;
    for (int round = 0; round < 500 && !stale; round++) {
        uint16_t v = (uint16_t)(0x3c00 + round);
        for (size_t i = 0; i < 4 * G.bt * TOKEN_ELEMS; i++)
            buf[i] = v;
        /* Every layer but the last first: a later write makes the blocks
         * private again, which forgets a disk copy anyway. */
        for (uint32_t l = 0; l + 1 < G.layers; l++)
            dt_assert_ok(kvh_seq_write_kv(e, s, l, 0, 4 * G.bt, buf, buf));
        /* A (blocks 0-2) on disk, B (block 3) in the host tier; the worker
         * first moves other's blocks, then B, so B's demotion starts while
         * the write below reads A from disk. */
        dt_assert_ok(kvh_seq_migrate(e, s, 0, 3 * G.bt, KVH_TIER_DISK, NULL));
        dt_assert_ok(kvh_seq_migrate(e, s, 3 * G.bt, G.bt, KVH_TIER_HOST, NULL));
        dt_assert_ok(kvh_seq_migrate(e, other, 0, 2 * G.bt, KVH_TIER_DEVICE, NULL));
        kvh_fence f[2];
        dt_assert_ok(kvh_seq_migrate(e, other, 0, 2 * G.bt, KVH_TIER_DISK, &f[0]));
        dt_assert_ok(kvh_seq_migrate(e, s, 3 * G.bt, G.bt, KVH_TIER_DISK, &f[1]));
        dt_assert_ok(kvh_seq_write_kv(e, s, G.layers - 1, 0, 4 * G.bt, buf, buf));
        for (int k = 0; k < 2; k++) {
            kvh_status st = kvh_fence_wait(e, f[k], UINT64_MAX);
            assert_true(st == KVH_OK || st == KVH_ERR_NOSPACE);
            dt_assert_ok(kvh_fence_free(e, f[k]));
        }
        dt_assert_ok(kvh_seq_migrate(e, s, 0, 4 * G.bt, KVH_TIER_DISK, NULL));
        for (int b = 0; b < 4; b++) {
            mt_worker w = {.e = e};
            if (!block_reads(&w, s, b, v)) {
                print_error("round %d: block %d: %s\n", round, b, w.msg);
                stale = 1;
            }
        }
    }
    assert_int_equal(stale, 0);
    dt_assert_ok(kvh_seq_free(e, other));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(kvh_seq_free(e, first));
    dt_assert_ok(dt_close(e));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_threads_promote_demote_write_and_read, teardown),
        cmocka_unit_test_teardown(test_threads_with_pool_batches_disk_and_forks, teardown),
        cmocka_unit_test_teardown(test_write_drops_copies_made_while_it_waited, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
