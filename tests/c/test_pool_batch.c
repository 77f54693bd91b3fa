/* Batched, asynchronous pool transfers (kvh_pool_offload_batch,
 * kvh_pool_restore_batch) and kvh_blocks_persist: round trips through
 * memory and disk, per-layer fences, dedupe, misuse from the header's
 * status lists (nothing taken on a refused call), a pool unregistered and
 * an engine closed with batches queued. Run with no worker (the batch
 * runs in the call) and with workers. */
#include <stdatomic.h>

#include "test_util.h"
#include "disk_test_util.h"
#include "pool_test_util.h"
#include "uffd_gate.h"
#include "core/disk_io.h"

static const dt_geo G = {2, 2, 64, 16, KVH_DTYPE_F16};
#define BT 16u
#define SLOTS 16u

static kvh_engine *open_engine(const char *name, uint64_t host_blocks, uint64_t disk_slots, uint32_t threads)
{
    char dir[PATH_MAX];
    dt_scratch(name, dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 4, host_blocks, disk_slots, threads);
    return dt_open_a(&c);
}

static void pool_of(pt_pool *p, uint64_t seed) { pt_pool_init(p, G.layers, SLOTS, BT, G.heads, G.dim, 2, seed); }

/* An engine as open_engine makes, with pool p (seeded) registered. */
static kvh_engine *open_with_pool(const char *name, uint64_t host_blocks, uint64_t disk_slots, uint32_t threads,
                                  uint64_t seed, pt_pool *p, kvh_pool *pool)
{
    kvh_engine *e = open_engine(name, host_blocks, disk_slots, threads);
    pool_of(p, seed);
    assert_ok(kvh_pool_register(e, &p->layout, pool));
    return e;
}

/* Items for blocks [0, n) of request tag in slots[0, n), chained in scope. */
static void chain_xfers(kvh_engine *e, kvh_pool_xfer *x, int32_t (*tok)[BT], uint32_t n, const uint32_t *slots,
                        uint32_t tag, uint64_t scope)
{
    uint64_t parent = 0;
    for (uint32_t i = 0; i < n; i++) {
        pt_tokens(tok[i], BT, tag, i);
        memset(&x[i], 0, sizeof(x[i]));
        x[i].struct_size = sizeof(kvh_pool_xfer);
        x[i].slot = slots[i];
        x[i].scope = scope;
        x[i].parent_hash = parent;
        x[i].tokens = tok[i];
        x[i].status = KVH_ERR_INTERNAL;
        assert_ok(kvh_prefix_hash_scoped(e, scope, parent, tok[i], BT, &parent));
    }
}

static void wait_free(kvh_engine *e, kvh_fence f, kvh_status expect)
{
    assert_kvh(expect, kvh_fence_wait(e, f, UINT64_MAX));
    assert_ok(kvh_fence_free(e, f));
}

static void release_all(kvh_engine *e, kvh_pool_xfer *x, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        assert_ok(kvh_block_release(e, x[i].block));
}

static void round_trip(uint32_t threads)
{
    kvh_engine *e = open_engine("pb-rt", 32, 0, threads);
    pt_pool p;
    pool_of(&p, 0x5eed + threads);
    kvh_pool pool;
    assert_ok(kvh_pool_register(e, &p.layout, &pool));
    enum { N = 6 };
    uint32_t src[N] = {0, 3, 4, 7, 9, 12}, dst[N] = {1, 2, 5, 6, 8, 10};
    kvh_pool_xfer x[N];
    int32_t tok[N][BT];
    chain_xfers(e, x, tok, N, src, 7, 0);
    kvh_stats s0 = tu_stats(e);
    kvh_fence f = {0};
    assert_ok(kvh_pool_offload_batch(e, pool, x, N, 2, &f));
    wait_free(e, f, KVH_OK);
    assert_int_equal(tu_stats(e).blocks_allocated - s0.blocks_allocated, N);
    for (uint32_t i = 0; i < N; i++) {
        assert_ok(x[i].status);
        kvh_block_info bi = tu_binfo(e, x[i].block);
        assert_int_equal(bi.published, 1);
        assert_int_equal(bi.tokens, BT);
        assert_int_equal(bi.agent, 2);
        assert_int_equal(bi.holds, 0);
        assert_int_equal(bi.refs, 1);
    }
    /* Found by tokens, in order. */
    int32_t all[N * BT];
    memcpy(all, tok, sizeof(all));
    kvh_block found[N];
    size_t nf = 0;
    assert_ok(kvh_prefix_lookup(e, all, N * BT, found, N, &nf));
    assert_int_equal(nf, N);
    for (uint32_t i = 0; i < N; i++) {
        assert_int_equal(found[i].id, x[i].block.id);
        assert_ok(kvh_block_release(e, found[i]));
    }
    /* The same blocks again: cached, nothing copied or allocated. */
    kvh_pool_xfer again[N];
    chain_xfers(e, again, tok, N, src, 7, 0);
    assert_ok(kvh_pool_offload_batch(e, pool, again, N, 2, &f));
    wait_free(e, f, KVH_OK);
    assert_int_equal(tu_stats(e).blocks_allocated - s0.blocks_allocated, N);
    for (uint32_t i = 0; i < N; i++) {
        assert_int_equal(again[i].block.id, x[i].block.id);
        assert_ok(again[i].status);
    }
    release_all(e, again, N);

    /* Restore into other slots, one fence per layer. */
    for (uint32_t i = 0; i < N; i++)
        for (uint32_t l = 0; l < G.layers; l++)
            pt_layer_clear(&p, dst[i], l);
    kvh_pool_xfer r[N];
    memset(r, 0, sizeof(r));
    for (uint32_t i = 0; i < N; i++) {
        r[i].struct_size = sizeof(kvh_pool_xfer);
        r[i].slot = dst[i];
        r[i].block = x[i].block;
    }
    kvh_fence lf[2];
    assert_ok(kvh_pool_restore_batch(e, pool, r, N, 0, G.layers, lf));
    for (uint32_t l = 0; l < G.layers; l++) {
        wait_free(e, lf[l], KVH_OK);
        for (uint32_t i = 0; i < N; i++)
            assert_true(pt_layer_equal(&p, src[i], &p, dst[i], l));
    }
    for (uint32_t i = 0; i < N; i++)
        assert_ok(r[i].status);
    /* Only the layers asked for are written. */
    for (uint32_t i = 0; i < N; i++)
        for (uint32_t l = 0; l < G.layers; l++)
            pt_layer_clear(&p, dst[i], l);
    assert_ok(kvh_pool_restore_batch(e, pool, r, N, 1, 1, lf));
    wait_free(e, lf[0], KVH_OK);
    for (uint32_t i = 0; i < N; i++) {
        assert_true(pt_layer_equal(&p, src[i], &p, dst[i], 1));
        assert_false(pt_layer_equal(&p, src[i], &p, dst[i], 0));
    }
    /* Handles released while the restore is queued: the batch keeps them. */
    assert_ok(kvh_pool_restore_batch(e, pool, r, N, 0, G.layers, lf));
    release_all(e, x, N);
    for (uint32_t l = 0; l < G.layers; l++)
        wait_free(e, lf[l], KVH_OK);
    assert_ok(kvh_pool_unregister(e, pool));
    assert_ok(dt_close(e));
    pt_pool_free(&p);
}

/* One prefix in two slots of one batch: one copy, both handles naming
 * it, published once its gather ends; a lookup finds that block. */
static void one_prefix_twice(uint32_t threads)
{
    pt_pool p;
    kvh_pool pool;
    kvh_engine *e = open_with_pool("pb-twice", 32, 0, threads, 0x7a1ce + threads, &p, &pool);
    kvh_pool_xfer x[3];
    int32_t tok[3][BT];
    uint32_t slots[3] = {2, 5, 9};
    chain_xfers(e, x, tok, 1, &slots[0], 11, 0);
    chain_xfers(e, &x[1], &tok[1], 1, &slots[1], 11, 0); /* the same first block */
    chain_xfers(e, &x[2], &tok[2], 1, &slots[2], 12, 0); /* another */
    kvh_stats s0 = tu_stats(e);
    kvh_fence f = {0};
    assert_ok(kvh_pool_offload_batch(e, pool, x, 3, 0, &f));
    wait_free(e, f, KVH_OK);
    assert_int_equal(tu_stats(e).blocks_allocated - s0.blocks_allocated, 2);
    assert_int_equal(x[0].block.id, x[1].block.id);
    assert_true(x[2].block.id != x[0].block.id);
    for (int i = 0; i < 3; i++) {
        assert_ok(x[i].status);
        assert_int_equal(tu_binfo(e, x[i].block).published, 1);
    }
    assert_int_equal(tu_binfo(e, x[0].block).refs, 2); /* the two handles */
    kvh_block found;
    size_t nf = 0;
    assert_ok(kvh_prefix_lookup(e, tok[0], BT, &found, 1, &nf));
    assert_int_equal(nf, 1);
    assert_int_equal(found.id, x[0].block.id);
    assert_ok(kvh_block_release(e, found));
    release_all(e, x, 3);
    assert_ok(kvh_pool_unregister(e, pool));
    assert_ok(dt_close(e));
    pt_pool_free(&p);
}

static void test_one_prefix_twice_in_a_batch(void **state)
{
    (void)state;
    one_prefix_twice(0);
    one_prefix_twice(2);
}

/* Eight prefixes, each in two slots of one batch: eight copies. */
static void test_many_prefixes_twice_in_a_batch(void **state)
{
    (void)state;
    pt_pool p;
    kvh_pool pool;
    kvh_engine *e = open_with_pool("pb-twice8", 32, 0, 0, 0x8888, &p, &pool);
    enum { N = 16 };
    kvh_pool_xfer x[N];
    int32_t tok[N][BT];
    for (uint32_t i = 0; i < N; i++) {
        uint32_t slot = i;
        chain_xfers(e, &x[i], &tok[i], 1, &slot, 30 + i % 8, 0);
    }
    kvh_stats s0 = tu_stats(e);
    kvh_fence f = {0};
    assert_ok(kvh_pool_offload_batch(e, pool, x, N, 0, &f));
    wait_free(e, f, KVH_OK);
    assert_int_equal(tu_stats(e).blocks_allocated - s0.blocks_allocated, 8);
    for (uint32_t i = 0; i < N; i++) {
        assert_ok(x[i].status);
        assert_int_equal(x[i].block.id, x[i % 8].block.id);
        assert_int_equal(tu_binfo(e, x[i].block).published, 1);
    }
    release_all(e, x, N);
    assert_ok(kvh_pool_unregister(e, pool));
    assert_ok(dt_close(e));
    pt_pool_free(&p);
}

static atomic_int writes_held, write_waiting;

static int holding_writes(enum kvhi_disk_op op, void *user)
{
    (void)user;
    if (op == KVHI_OP_WRITE) {
        atomic_store(&write_waiting, 1);
        while (atomic_load(&writes_held))
            usleep(1000);
    }
    return 0;
}

static void *release_writes_soon(void *arg)
{
    (void)arg;
    usleep(200000);
    atomic_store(&writes_held, 0);
    return NULL;
}

/* Closed with the batch still queued (its only worker held in a disk
 * write): the item sharing a copy ends as the copy does, closed. */
static void test_close_ends_a_shared_item_as_its_copy(void **state)
{
    (void)state;
    pt_pool p;
    kvh_pool pool;
    kvh_engine *e = open_with_pool("pb-close-shared", 32, 64, 1, 0xc105e, &p, &pool);
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, dt_plain(3), BT, 0, &s));
    atomic_store(&writes_held, 1);
    atomic_store(&write_waiting, 0);
    kvhi_disk_set_fault_hook(holding_writes, NULL);
    kvh_fence mf;
    assert_ok(kvh_seq_migrate(e, s, 0, BT, KVH_TIER_DISK, &mf));
    while (!atomic_load(&write_waiting))
        usleep(1000);
    kvh_pool_xfer x[2];
    int32_t tok[2][BT];
    uint32_t slots[2] = {3, 4};
    chain_xfers(e, x, tok, 1, &slots[0], 50, 0);
    chain_xfers(e, &x[1], &tok[1], 1, &slots[1], 50, 0);
    kvh_fence f;
    assert_ok(kvh_pool_offload_batch(e, pool, x, 2, 0, &f));
    assert_int_equal(x[0].block.id, x[1].block.id);
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, release_writes_soon, NULL), 0);
    assert_ok(dt_close(e));
    assert_int_equal(pthread_join(t, NULL), 0);
    kvhi_disk_set_fault_hook(NULL, NULL);
    assert_kvh(KVH_ERR_CLOSED, x[0].status);
    assert_kvh(KVH_ERR_CLOSED, x[1].status);
    pt_pool_free(&p);
}

static void test_round_trip_inline(void **state)
{
    (void)state;
    round_trip(0);
}

static void test_round_trip_workers(void **state)
{
    (void)state;
    round_trip(2);
}

static void test_misuse(void **state)
{
    (void)state;
    kvh_engine *e = open_engine("pb-misuse", 8, 0, 1);
    pt_pool p;
    pool_of(&p, 11);
    kvh_pool pool;
    assert_ok(kvh_pool_register(e, &p.layout, &pool));
    uint32_t slots[3] = {0, 1, 2};
    kvh_pool_xfer x[3];
    int32_t tok[3][BT];
    chain_xfers(e, x, tok, 3, slots, 1, 0);
    kvh_fence f = {0};
    kvh_stats s0 = tu_stats(e);
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload_batch(NULL, pool, x, 3, 0, &f));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload_batch(e, pool, x, 3, 0, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload_batch(e, pool, NULL, 3, 0, &f));
    x[0].struct_size = 8;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload_batch(e, pool, x, 3, 0, &f));
    x[0].struct_size = sizeof(kvh_pool_xfer);
    x[2].struct_size = sizeof(kvh_pool_xfer) + 8;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload_batch(e, pool, x, 3, 0, &f));
    x[2].struct_size = sizeof(kvh_pool_xfer);
    x[1].tokens = NULL;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload_batch(e, pool, x, 3, 0, &f));
    x[1].tokens = tok[1];
    x[2].slot = 0; /* listed twice */
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload_batch(e, pool, x, 3, 0, &f));
    x[2].slot = SLOTS;
    assert_kvh(KVH_ERR_RANGE, kvh_pool_offload_batch(e, pool, x, 3, 0, &f));
    x[2].slot = 2;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload_batch(e, pool, x, (size_t)SLOTS + 1, 0, &f));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload_batch(e, pool, x, SIZE_MAX, 0, &f));
    kvh_pool stale = {pool.id ^ 0x5a5a0000u};
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_offload_batch(e, stale, x, 3, 0, &f));
    /* Nothing was taken by any refused call. */
    assert_int_equal(tu_stats(e).blocks_allocated, s0.blocks_allocated);
    assert_int_equal(f.id, 0);
    /* No room: the host tier holds 8 blocks, the device tier 4, a batch of
     * 13 new ones fails whole and gives back what it took. */
    enum { BIG = 13 };
    uint32_t bs[BIG];
    kvh_pool_xfer bx[BIG];
    int32_t bt[BIG][BT];
    for (uint32_t i = 0; i < BIG; i++)
        bs[i] = i;
    chain_xfers(e, bx, bt, BIG, bs, 9, 0);
    assert_kvh(KVH_ERR_NOSPACE, kvh_pool_offload_batch(e, pool, bx, BIG, 0, &f));
    kvh_tier_info host = tu_tier(e, KVH_TIER_HOST), dev = tu_tier(e, KVH_TIER_DEVICE);
    assert_int_equal(host.used_blocks + dev.used_blocks, 0);
    /* n = 0: a fence that is already complete. */
    assert_ok(kvh_pool_offload_batch(e, pool, NULL, 0, 0, &f));
    int32_t done = 0;
    assert_ok(kvh_fence_poll(e, f, &done));
    assert_int_equal(done, 1);
    assert_ok(kvh_fence_free(e, f));

    /* Restores. */
    assert_ok(kvh_pool_offload_batch(e, pool, x, 3, 0, &f));
    wait_free(e, f, KVH_OK);
    kvh_fence lf[2];
    kvh_pool_xfer r[2];
    memset(r, 0, sizeof(r));
    for (int i = 0; i < 2; i++) {
        r[i].struct_size = sizeof(kvh_pool_xfer);
        r[i].slot = 5 + (uint32_t)i;
        r[i].block = x[i].block;
    }
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_restore_batch(e, pool, r, 2, 0, 2, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_restore_batch(e, pool, r, 2, 0, 0, lf));
    assert_kvh(KVH_ERR_RANGE, kvh_pool_restore_batch(e, pool, r, 2, 1, 2, lf));
    assert_kvh(KVH_ERR_RANGE, kvh_pool_restore_batch(e, pool, r, 2, UINT32_MAX, 2, lf));
    r[1].slot = 5;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_restore_batch(e, pool, r, 2, 0, 2, lf));
    r[1].slot = 6;
    kvh_block keep = r[1].block;
    r[1].block.id ^= 0x10000u;
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_restore_batch(e, pool, r, 2, 0, 2, lf));
    kvh_block fresh;
    assert_ok(kvh_block_alloc(e, 0, &fresh)); /* no KV written */
    r[1].block = fresh;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_restore_batch(e, pool, r, 2, 0, 2, lf));
    r[1].block = keep;
    kvh_block_info bi = tu_binfo(e, r[0].block);
    assert_int_equal(bi.holds, 0);
    assert_int_equal(bi.refs, 1);
    assert_ok(kvh_block_release(e, fresh));

    /* Persist without a disk tier; bad lists. */
    assert_kvh(KVH_ERR_UNSUPPORTED, kvh_blocks_persist(e, &x[0].block, 1, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_blocks_persist(e, NULL, 1, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_blocks_persist(NULL, &x[0].block, 1, NULL));
    release_all(e, x, 3);
    assert_ok(kvh_pool_unregister(e, pool));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_offload_batch(e, pool, x, 3, 0, &f));
    assert_ok(dt_close(e));
    pt_pool_free(&p);
}

/* Offload, persist at once (the persist waits for the gathers), reopen,
 * and restore from disk, verified. */
static void test_persist_and_restore_from_disk(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("pb-disk", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 4, 16, 32, 2);
    kvh_engine *e = dt_open_a(&c);
    pt_pool p;
    pool_of(&p, 99);
    kvh_pool pool;
    assert_ok(kvh_pool_register(e, &p.layout, &pool));
    enum { N = 5 };
    uint32_t src[N] = {0, 1, 2, 3, 4}, dst[N] = {10, 11, 12, 13, 14};
    kvh_pool_xfer x[N];
    int32_t tok[N][BT];
    chain_xfers(e, x, tok, N, src, 3, 77);
    kvh_fence f, pf;
    assert_ok(kvh_pool_offload_batch(e, pool, x, N, 0, &f));
    kvh_block blocks[N];
    for (uint32_t i = 0; i < N; i++)
        blocks[i] = x[i].block;
    assert_ok(kvh_blocks_persist(e, blocks, N, &pf));
    wait_free(e, pf, KVH_OK);
    wait_free(e, f, KVH_OK);
    assert_int_equal(tu_stats(e).blocks_persisted, N);
    /* In the call, again: already durable. */
    assert_ok(kvh_blocks_persist(e, blocks, N, NULL));
    release_all(e, x, N);
    assert_ok(kvh_pool_unregister(e, pool));
    assert_ok(dt_close(e));

    e = dt_open_a(&c);
    assert_ok(kvh_pool_register(e, &p.layout, &pool));
    int32_t all[N * BT];
    memcpy(all, tok, sizeof(all));
    kvh_block found[N];
    size_t nf = 0;
    assert_ok(kvh_prefix_lookup_scoped(e, 77, 0, 0, all, N * BT, found, N, &nf));
    assert_int_equal(nf, N);
    kvh_pool_xfer r[N];
    memset(r, 0, sizeof(r));
    for (uint32_t i = 0; i < N; i++) {
        assert_int_equal(tu_binfo(e, found[i]).tier, KVH_TIER_DISK);
        r[i].struct_size = sizeof(kvh_pool_xfer);
        r[i].slot = dst[i];
        r[i].block = found[i];
    }
    kvh_fence lf[2];
    assert_ok(kvh_pool_restore_batch(e, pool, r, N, 0, 2, lf));
    wait_free(e, lf[0], KVH_OK);
    wait_free(e, lf[1], KVH_OK);
    for (uint32_t i = 0; i < N; i++) {
        assert_ok(r[i].status);
        for (uint32_t l = 0; l < G.layers; l++)
            assert_true(pt_layer_equal(&p, src[i], &p, dst[i], l));
        assert_ok(kvh_block_release(e, found[i]));
    }
    assert_ok(kvh_pool_unregister(e, pool));
    assert_ok(dt_close(e));
    pt_pool_free(&p);
}

/* Unregistering a pool and closing the engine with batches queued: every
 * item ends with a status, nothing is touched after, nothing leaks. */
static void test_unregister_and_close_with_batches_queued(void **state)
{
    (void)state;
    kvh_engine *e = open_engine("pb-queued", 64, 0, 1);
    pt_pool p;
    pool_of(&p, 5);
    kvh_pool pool;
    assert_ok(kvh_pool_register(e, &p.layout, &pool));
    enum { N = SLOTS, ROUNDS = 3 };
    uint32_t slots[N];
    for (uint32_t i = 0; i < N; i++)
        slots[i] = i;
    kvh_pool_xfer x[ROUNDS][N];
    int32_t tok[N][BT];
    kvh_fence f[ROUNDS];
    for (uint32_t k = 0; k < ROUNDS; k++) {
        chain_xfers(e, x[k], tok, N, slots, 20 + k, 0);
        assert_ok(kvh_pool_offload_batch(e, pool, x[k], N, 0, &f[k]));
    }
    assert_ok(kvh_pool_unregister(e, pool)); /* waits for them */
    pt_pool_free(&p);                        /* the memory may go now */
    for (uint32_t k = 0; k < ROUNDS; k++) {
        kvh_status st = kvh_fence_wait(e, f[k], UINT64_MAX);
        assert_true(st == KVH_OK || st == KVH_ERR_BAD_HANDLE);
        for (uint32_t i = 0; i < N; i++)
            assert_true(x[k][i].status == KVH_OK || x[k][i].status == KVH_ERR_BAD_HANDLE);
        assert_ok(kvh_fence_free(e, f[k]));
        release_all(e, x[k], N);
    }
    /* Close with batches queued on another pool. */
    pool_of(&p, 6);
    assert_ok(kvh_pool_register(e, &p.layout, &pool));
    for (uint32_t k = 0; k < ROUNDS; k++) {
        chain_xfers(e, x[k], tok, N, slots, 40 + k, 0);
        assert_ok(kvh_pool_offload_batch(e, pool, x[k], N, 0, &f[k]));
    }
    assert_ok(dt_close(e));
    for (uint32_t k = 0; k < ROUNDS; k++)
        for (uint32_t i = 0; i < N; i++)
            assert_true(x[k][i].status == KVH_OK || x[k][i].status == KVH_ERR_CLOSED);
    pt_pool_free(&p);
}

static kvh_pool_xfer restore_item(uint32_t slot, kvh_block b)
{
    kvh_pool_xfer x = {.struct_size = sizeof(kvh_pool_xfer), .slot = slot, .block = b};
    return x;
}

/* A transfer on a slot that a running batch reads or writes would tear
 * one of the two copies: it is refused with KVH_ERR_BUSY, taking nothing,
 * and accepted once that batch is done. The one worker is held in a
 * gather (uffd_gate), so that a batch queued behind it stays running; the
 * statuses are checked once the gate is open (a failed check with the
 * worker held would leave the engine unable to close). */
static void test_slot_in_use_refused(void **state)
{
    (void)state;
    enum { GL = 2, GH = 2, GD = 64 };
    kvh_config c = tu_cfg(GL, GH, GD, BT, KVH_DTYPE_F32, 16, 16, 1);
    kvh_engine *e = tu_open_cfg(&c);
    pt_pool p;
    pt_pool_init(&p, GL, SLOTS, BT, GH, GD, 4, 91);
    kvh_pool pool;
    assert_ok(kvh_pool_register(e, &p.layout, &pool));
    int32_t tok[BT], other[BT];
    pt_tokens(tok, BT, 3, 0);
    pt_tokens(other, BT, 4, 0);
    kvh_block src;
    assert_ok(kvh_pool_offload(e, pool, 1, 0, tok, BT, 0, &src));
    uffd_gate g;
    if (!uffd_gate_arm(e, &g, (uffd_gate_geometry){GL, BT, GH, GD}, 500000)) {
        assert_ok(kvh_block_release(e, src));
        pt_pool_free(&p);
        skip();
    }
    /* Queued behind the held worker: it writes slot 3 until it has run. */
    kvh_pool_xfer r = restore_item(3, src), r4 = restore_item(4, src), again = restore_item(3, src);
    kvh_pool_xfer gr = restore_item(0, src);
    kvh_pool_xfer o = {.struct_size = sizeof(kvh_pool_xfer), .slot = 3, .tokens = other};
    kvh_pool_xfer go = {.struct_size = sizeof(kvh_pool_xfer), .slot = 0, .tokens = other};
    kvh_fence rf[GL], rf4[GL], none[GL], of, gof;
    kvh_status queued = kvh_pool_restore_batch(e, pool, &r, 1, 0, GL, rf);
    kvh_stats s0 = tu_stats(e);
    uint32_t refs0 = tu_binfo(e, src).refs;
    enum { OFFLOAD_BATCH, OFFLOAD, RESTORE, RESTORE_BATCH, GATED_RESTORE_BATCH, REFUSALS };
    kvh_status refused[REFUSALS];
    char first_error[256];
    refused[OFFLOAD_BATCH] = kvh_pool_offload_batch(e, pool, &o, 1, 0, &of);
    snprintf(first_error, sizeof(first_error), "%s", kvh_last_error());
    kvh_block b = {0};
    refused[OFFLOAD] = kvh_pool_offload(e, pool, 3, 0, other, BT, 0, &b);
    refused[RESTORE] = kvh_pool_restore(e, pool, src, 3);
    refused[RESTORE_BATCH] = kvh_pool_restore_batch(e, pool, &again, 1, 0, GL, none);
    /* The gathered slot may be read again, not written (a restore in the
     * call would fault on the held page itself: only the batch is tried). */
    refused[GATED_RESTORE_BATCH] = kvh_pool_restore_batch(e, g.pool, &gr, 1, 0, GL, none);
    kvh_stats s1 = tu_stats(e);
    uint32_t refs1 = tu_binfo(e, src).refs;
    kvh_status other_slot = kvh_pool_restore_batch(e, pool, &r4, 1, 0, GL, rf4);
    /* Restores of other layers of one slot may run together; the same
     * layer twice may not. */
    kvh_pool_xfer l0 = restore_item(5, src), l1 = restore_item(5, src), l01 = restore_item(5, src);
    kvh_fence f0[1], f1[1];
    kvh_status first_layer = kvh_pool_restore_batch(e, pool, &l0, 1, 0, 1, f0);
    kvh_status second_layer = kvh_pool_restore_batch(e, pool, &l1, 1, 1, 1, f1);
    kvh_status both_layers = kvh_pool_restore_batch(e, pool, &l01, 1, 0, GL, none);
    kvh_status second_reader = kvh_pool_offload_batch(e, g.pool, &go, 1, 0, &gof);
    uffd_gate_open(&g);

    assert_ok(queued);
    for (int i = 0; i < REFUSALS; i++)
        if (refused[i] != KVH_ERR_BUSY)
            fail_msg("transfer %d on a slot in use returned %s, expected KVH_ERR_BUSY", i, kvh_status_name(refused[i]));
    assert_non_null(strstr(first_error, "slot 3"));
    assert_int_equal(s1.blocks_allocated, s0.blocks_allocated);
    assert_int_equal(refs1, refs0);
    assert_ok(other_slot);
    assert_ok(second_reader);
    assert_ok(first_layer);
    assert_ok(second_layer);
    assert_int_equal(both_layers, KVH_ERR_BUSY);
    wait_free(e, f0[0], KVH_OK);
    wait_free(e, f1[0], KVH_OK);
    assert_ok(l0.status);
    assert_ok(l1.status);
    wait_free(e, g.fence, KVH_OK);
    wait_free(e, gof, KVH_OK);
    for (uint32_t l = 0; l < GL; l++) {
        wait_free(e, rf[l], KVH_OK);
        wait_free(e, rf4[l], KVH_OK);
    }
    assert_ok(r.status);
    assert_ok(r4.status);
    for (uint32_t l = 0; l < GL; l++) {
        assert_true(pt_layer_equal(&p, 1, &p, 3, l));
        assert_true(pt_layer_equal(&p, 1, &p, 4, l));
        assert_true(pt_layer_equal(&p, 1, &p, 5, l));
    }
    /* Done: the slots take any transfer again. */
    assert_ok(kvh_pool_restore(e, g.pool, src, 0));
    assert_ok(kvh_pool_offload(e, pool, 3, 0, other, BT, 0, &b));
    assert_ok(kvh_pool_restore_batch(e, pool, &again, 1, 0, GL, rf));
    for (uint32_t l = 0; l < GL; l++)
        wait_free(e, rf[l], KVH_OK);
    assert_ok(kvh_block_release(e, b));
    assert_ok(kvh_block_release(e, go.block));
    assert_ok(kvh_block_release(e, g.x.block));
    assert_ok(kvh_block_release(e, src));
    assert_ok(kvh_pool_unregister(e, g.pool));
    assert_ok(kvh_pool_unregister(e, pool));
    assert_ok(tu_close(e));
    uffd_gate_free(&g);
    pt_pool_free(&p);
}

static int teardown(void **state)
{
    dt_teardown(state);
    return tu_teardown(state);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_one_prefix_twice_in_a_batch, teardown),
        cmocka_unit_test_teardown(test_many_prefixes_twice_in_a_batch, teardown),
        cmocka_unit_test_teardown(test_close_ends_a_shared_item_as_its_copy, teardown),
        cmocka_unit_test_teardown(test_round_trip_inline, teardown),
        cmocka_unit_test_teardown(test_round_trip_workers, teardown),
        cmocka_unit_test_teardown(test_misuse, teardown),
        cmocka_unit_test_teardown(test_persist_and_restore_from_disk, teardown),
        cmocka_unit_test_teardown(test_unregister_and_close_with_batches_queued, teardown),
        cmocka_unit_test_teardown(test_slot_in_use_refused, teardown),
    };
    return cmocka_run_group_tests_name("pool_batch", tests, NULL, NULL);
}
