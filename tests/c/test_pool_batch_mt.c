/* Batched pool transfers under concurrency (label `concurrency`, run under
 * TSan): one thread offloads and restores batches of large blocks while
 * others look prefixes up. The copies run on the migration workers
 * without the engine lock, so lookups complete while a batch is still
 * copying (counted: a lookup that began and ended between two polls that
 * saw the batch unfinished), and every restored slot equals its source;
 * restores stay exact while another thread moves their blocks between
 * two arenas. */
#include <stdatomic.h>
#include <stdbool.h>

#include "test_util.h"
#include "mt_util.h"
#include "pool_test_util.h"

#include "core/engine.h"

/* 4 layers x 2 heads x 128 dims x 64 tokens, f16: 256 KiB a block. */
enum { L = 4, H = 2, D = 128, BT = 64, SLOTS = 32, N = 12, ROUNDS = 6 };

static pt_pool pool_mem;
static kvh_pool pool;
static atomic_int copying;     /* a batch is submitted and its fence not yet seen complete */
static atomic_int finished;    /* the batch thread is done */
static atomic_long overlapped; /* lookups that ran wholly while a batch copied */

static void tokens_of(int32_t *t, uint32_t round, uint32_t i) { pt_tokens(t, BT, 1000 + round, i); }

/* An offload of slots 0..N-1 as one chain of blocks whose tokens are
 * pt_tokens(tag, i). */
static kvh_status offload_items(kvh_engine *e, uint32_t tag, kvh_pool_xfer *x, int32_t (*tok)[BT])
{
    uint64_t parent = 0;
    for (uint32_t i = 0; i < N; i++) {
        pt_tokens(tok[i], BT, tag, i);
        x[i] =
            (kvh_pool_xfer){.struct_size = sizeof(kvh_pool_xfer), .slot = i, .parent_hash = parent, .tokens = tok[i]};
        kvh_status st = kvh_prefix_hash(e, parent, tok[i], BT, &parent);
        if (st != KVH_OK)
            return st;
    }
    return KVH_OK;
}

/* Restores blocks[i] into slot N + i and checks each layer against slot i
 * as soon as its fence completes, then clears the copies. False when the
 * batch could not be queued. */
static bool restore_and_check(mt_worker *w, const kvh_block *blocks, uint32_t round)
{
    kvh_engine *e = w->e;
    kvh_pool_xfer r[N];
    for (uint32_t i = 0; i < N; i++)
        r[i] = (kvh_pool_xfer){.struct_size = sizeof(kvh_pool_xfer), .slot = N + i, .block = blocks[i]};
    kvh_fence lf[L];
    if (kvh_pool_restore_batch(e, pool, r, N, 0, L, lf) != KVH_OK) {
        mt_report(w, "restore: %s", kvh_last_error());
        return false;
    }
    for (uint32_t l = 0; l < L; l++) {
        if (kvh_fence_wait(e, lf[l], UINT64_MAX) != KVH_OK)
            mt_report(w, "layer fence %u: %s", l, kvh_last_error());
        kvh_fence_free(e, lf[l]);
        for (uint32_t i = 0; i < N; i++)
            if (!pt_layer_equal(&pool_mem, i, &pool_mem, N + i, l))
                mt_report(w, "round %u: slot %u layer %u differs after its fence", round, N + i, l);
    }
    for (uint32_t i = 0; i < N; i++) {
        if (r[i].status != KVH_OK)
            mt_report(w, "round %u: restore item %u: %s", round, i, kvh_status_name(r[i].status));
        for (uint32_t l = 0; l < L; l++)
            pt_layer_clear(&pool_mem, N + i, l);
    }
    return true;
}

static void *batch_thread(void *arg)
{
    mt_worker *w = arg;
    kvh_engine *e = w->e;
    for (uint32_t round = 0; round < ROUNDS && !w->errors; round++) {
        kvh_pool_xfer x[N];
        int32_t tok[N][BT];
        if (offload_items(e, 1000 + round, x, tok) != KVH_OK)
            mt_report(w, "hash: %s", kvh_last_error());
        kvh_fence f;
        atomic_store(&copying, 1);
        if (kvh_pool_offload_batch(e, pool, x, N, 0, &f) != KVH_OK) {
            mt_report(w, "offload: %s", kvh_last_error());
            break;
        }
        if (kvh_fence_wait(e, f, UINT64_MAX) != KVH_OK)
            mt_report(w, "offload fence: %s", kvh_last_error());
        atomic_store(&copying, 0);
        kvh_fence_free(e, f);
        kvh_block blocks[N];
        for (uint32_t i = 0; i < N; i++) {
            if (x[i].status != KVH_OK)
                mt_report(w, "offload item %u: %s", i, kvh_status_name(x[i].status));
            blocks[i] = x[i].block;
        }
        atomic_store(&copying, 1);
        bool queued = restore_and_check(w, blocks, round);
        atomic_store(&copying, 0);
        for (uint32_t i = 0; i < N; i++)
            kvh_block_release(e, blocks[i]);
        if (!queued)
            break;
    }
    atomic_store(&finished, 1);
    return NULL;
}

static void *lookup_thread(void *arg)
{
    mt_worker *w = arg;
    kvh_engine *e = w->e;
    int32_t tok[2 * BT];
    tokens_of(tok, 0, 0);
    tokens_of(tok + BT, 0, 1);
    while (!atomic_load(&finished) && !w->errors) {
        int before = atomic_load(&copying);
        kvh_block out[2];
        size_t n = 0;
        if (kvh_prefix_lookup(e, tok, 2 * BT, out, 2, &n) != KVH_OK)
            mt_report(w, "lookup: %s", kvh_last_error());
        for (size_t i = 0; i < n; i++)
            kvh_block_release(e, out[i]);
        if (before && atomic_load(&copying))
            atomic_fetch_add(&overlapped, 1);
    }
    return NULL;
}

static void *run_one(void *arg)
{
    mt_worker *w = arg;
    return w->t == 0 ? batch_thread(arg) : lookup_thread(arg);
}

static void test_lookups_proceed_while_batches_copy(void **state)
{
    (void)state;
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F16, 4, 2 * N + 8, 2);
    pt_pool_init(&pool_mem, L, SLOTS, BT, H, D, 2, tu_seed(0xba7c));
    assert_ok(kvh_pool_register(e, &pool_mem.layout, &pool));
    mt_worker w[3];
    mt_run(e, 3, run_one, w);
    print_message("lookups that completed while a batch was copying: %ld\n", (long)atomic_load(&overlapped));
    assert_true(atomic_load(&overlapped) > 0);
    assert_ok(kvh_pool_unregister(e, pool));
    assert_ok(tu_close(e));
    pt_pool_free(&pool_mem);
}

/* ---- restores of blocks another thread moves meanwhile ---- */

/* Two arenas (copy_moves), memory tiers exactly as large as the blocks:
 * one thread restores the same N blocks round after round and checks
 * every layer after its fence, while another promotes them and moves N
 * other blocks down into whatever host slots that frees, and back. A
 * restore reads its blocks where it found them, so a slot a promotion
 * leaves must not take another block's bytes before the restore ends. */
enum { MOVE_ROUNDS = 40 };
static kvh_block restored[N], churned[N];
static atomic_int restoring_done;

static void migrate_wait(mt_worker *w, const kvh_block *blocks, uint32_t tier)
{
    kvh_fence f;
    if (kvh_migrate(w->e, blocks, N, tier, &f) != KVH_OK) {
        mt_report(w, "migrate: %s", kvh_last_error());
        return;
    }
    /* Room may be short while the other thread's blocks are held. */
    kvh_status st = kvh_fence_wait(w->e, f, UINT64_MAX);
    if (st != KVH_OK && st != KVH_ERR_NOSPACE && st != KVH_ERR_BUSY)
        mt_report(w, "migrate fence: %s", kvh_last_error());
    kvh_fence_free(w->e, f);
}

static void *restore_rounds(mt_worker *w)
{
    for (uint32_t round = 0; round < MOVE_ROUNDS && !w->errors; round++) {
        migrate_wait(w, restored, KVH_TIER_HOST); /* each restore starts from the host tier */
        if (!restore_and_check(w, restored, round))
            break;
    }
    atomic_store(&restoring_done, 1);
    return NULL;
}

static void *move_rounds(mt_worker *w)
{
    while (!atomic_load(&restoring_done) && !w->errors) {
        migrate_wait(w, restored, KVH_TIER_DEVICE); /* frees host slots... */
        migrate_wait(w, churned, KVH_TIER_HOST);    /* ...which these take */
        migrate_wait(w, churned, KVH_TIER_DEVICE);
    }
    return NULL;
}

static void *run_moving(void *arg)
{
    mt_worker *w = arg;
    return w->t == 0 ? restore_rounds(w) : move_rounds(w);
}

/* N blocks with the content of slots 0..N-1, offloaded under tag. */
static void offload_set(kvh_engine *e, uint32_t tag, kvh_block *out)
{
    kvh_pool_xfer x[N];
    int32_t tok[N][BT];
    assert_ok(offload_items(e, tag, x, tok));
    kvh_fence f;
    assert_ok(kvh_pool_offload_batch(e, pool, x, N, 0, &f));
    assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
    assert_ok(kvh_fence_free(e, f));
    for (uint32_t i = 0; i < N; i++) {
        assert_ok(x[i].status);
        out[i] = x[i].block;
    }
}

static void test_restores_while_blocks_move(void **state)
{
    (void)state;
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F16, 2 * N, N, 2);
    c.copy_moves = 1;
    kvh_engine *e = tu_open_cfg(&c);
    pt_pool_init(&pool_mem, L, SLOTS, BT, H, D, 2, tu_seed(0x5107));
    assert_ok(kvh_pool_register(e, &pool_mem.layout, &pool));
    offload_set(e, 7, restored);
    offload_set(e, 8, churned); /* same slots: only the restored set is checked */
    atomic_store(&restoring_done, 0);
    mt_worker w[2];
    mt_run(e, 2, run_moving, w);
    for (uint32_t i = 0; i < N; i++) {
        assert_ok(kvh_block_release(e, restored[i]));
        assert_ok(kvh_block_release(e, churned[i]));
    }
    assert_ok(kvh_pool_unregister(e, pool));
    assert_ok(tu_close(e));
    pt_pool_free(&pool_mem);
}

/* ---- promotions of blocks an offload is still gathering ---- */

/* The caller has each block's handle as soon as kvh_pool_offload_batch
 * returns, and may migrate it while a worker still gathers into its host
 * slot. With two arenas (copy_moves) a promotion copies the block: it
 * must wait for the gather, or the device copy keeps the slot's bytes of
 * before the gather and the block is published with them. Every restored
 * layer must equal its source slot. */
enum { GATHER_ROUNDS = 96 };

static void test_offload_gather_survives_promotion(void **state)
{
    (void)state;
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F16, 2 * N, 2 * N, 2);
    c.copy_moves = 1;
    kvh_engine *e = tu_open_cfg(&c);
    pt_pool_init(&pool_mem, L, SLOTS, BT, H, D, 2, tu_seed(0x6a7e));
    assert_ok(kvh_pool_register(e, &pool_mem.layout, &pool));
    int bad = 0;
    for (uint32_t round = 0; round < GATHER_ROUNDS; round++) {
        kvh_pool_xfer x[N];
        int32_t tok[N][BT];
        assert_ok(offload_items(e, 3000 + round, x, tok));
        kvh_fence gathered, moved;
        assert_ok(kvh_pool_offload_batch(e, pool, x, N, 0, &gathered));
        kvh_block blocks[N];
        for (uint32_t i = 0; i < N; i++)
            blocks[i] = x[i].block;
        /* Until a worker copies without the lock: the gather has taken its
         * slots (or, rarely, is done already). */
        for (int32_t done = 0;;) {
            pthread_mutex_lock(&e->lock);
            uint32_t copying_now = e->copies_in_progress;
            pthread_mutex_unlock(&e->lock);
            if (copying_now)
                break;
            assert_ok(kvh_fence_poll(e, gathered, &done));
            if (done)
                break;
        }
        /* Last first: the gather reaches those last. Even rounds queue
         * the moves for the workers, odd ones move each block in this
         * thread (one block, no fence). */
        kvh_block reversed[N];
        for (uint32_t i = 0; i < N; i++)
            reversed[i] = blocks[N - 1 - i];
        if (round % 2 == 0) {
            assert_ok(kvh_migrate(e, reversed, N, KVH_TIER_DEVICE, &moved));
            assert_ok(kvh_fence_wait(e, moved, UINT64_MAX));
            assert_ok(kvh_fence_free(e, moved));
        } else {
            for (uint32_t i = 0; i < N; i++)
                assert_ok(kvh_migrate(e, &reversed[i], 1, KVH_TIER_DEVICE, NULL));
        }
        assert_ok(kvh_fence_wait(e, gathered, UINT64_MAX));
        assert_ok(kvh_fence_free(e, gathered));
        for (uint32_t i = 0; i < N; i++)
            assert_int_equal(tu_binfo(e, blocks[i]).tier, KVH_TIER_DEVICE);
        kvh_pool_xfer r[N];
        for (uint32_t i = 0; i < N; i++) {
            assert_ok(x[i].status);
            r[i] = (kvh_pool_xfer){.struct_size = sizeof(kvh_pool_xfer), .slot = N + i, .block = blocks[i]};
        }
        kvh_fence lf[L];
        assert_ok(kvh_pool_restore_batch(e, pool, r, N, 0, L, lf));
        for (uint32_t l = 0; l < L; l++) {
            assert_ok(kvh_fence_wait(e, lf[l], UINT64_MAX));
            assert_ok(kvh_fence_free(e, lf[l]));
        }
        for (uint32_t i = 0; i < N; i++) {
            assert_ok(r[i].status);
            for (uint32_t l = 0; l < L; l++) {
                if (!pt_layer_equal(&pool_mem, i, &pool_mem, N + i, l) && bad++ == 0)
                    print_error("round %u: block %u layer %u restored other bytes than were offloaded\n", round, i, l);
                pt_layer_clear(&pool_mem, N + i, l);
            }
            assert_ok(kvh_block_release(e, blocks[i]));
        }
    }
    assert_int_equal(bad, 0);
    assert_ok(kvh_pool_unregister(e, pool));
    assert_ok(tu_close(e));
    pt_pool_free(&pool_mem);
}

/* Handles released before their gather ends (the work keeps its own
 * reference): the blocks are still sealed and published, found by a
 * lookup and restored exact, and nothing stays referenced after. */
static void test_offload_handles_released_before_the_gather(void **state)
{
    (void)state;
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F16, N, 2 * N, 2);
    pt_pool_init(&pool_mem, L, SLOTS, BT, H, D, 2, tu_seed(0x7e1e));
    assert_ok(kvh_pool_register(e, &pool_mem.layout, &pool));
    kvh_pool_xfer x[N];
    int32_t tok[N][BT];
    assert_ok(offload_items(e, 4000, x, tok));
    kvh_fence gathered;
    assert_ok(kvh_pool_offload_batch(e, pool, x, N, 0, &gathered));
    for (uint32_t i = 0; i < N; i++)
        assert_ok(kvh_block_release(e, x[i].block));
    assert_ok(kvh_fence_wait(e, gathered, UINT64_MAX));
    assert_ok(kvh_fence_free(e, gathered));
    int32_t all[N * BT];
    for (uint32_t i = 0; i < N; i++) {
        assert_ok(x[i].status);
        memcpy(all + i * BT, tok[i], sizeof(tok[i]));
    }
    kvh_block found[N];
    size_t n = 0;
    assert_ok(kvh_prefix_lookup(e, all, N * BT, found, N, &n));
    assert_int_equal(n, N);
    kvh_pool_xfer r[N];
    for (uint32_t i = 0; i < N; i++)
        r[i] = (kvh_pool_xfer){.struct_size = sizeof(kvh_pool_xfer), .slot = N + i, .block = found[i]};
    kvh_fence lf[L];
    assert_ok(kvh_pool_restore_batch(e, pool, r, N, 0, L, lf));
    for (uint32_t l = 0; l < L; l++) {
        assert_ok(kvh_fence_wait(e, lf[l], UINT64_MAX));
        assert_ok(kvh_fence_free(e, lf[l]));
    }
    for (uint32_t i = 0; i < N; i++) {
        assert_ok(r[i].status);
        for (uint32_t l = 0; l < L; l++)
            assert_true(pt_layer_equal(&pool_mem, i, &pool_mem, N + i, l));
        assert_ok(kvh_block_release(e, found[i]));
        kvh_block_info bi = tu_binfo(e, found[i]);
        assert_int_equal(bi.refs, 0);
        assert_int_equal(bi.holds, 0);
    }
    assert_ok(kvh_pool_unregister(e, pool));
    assert_ok(tu_close(e));
    pt_pool_free(&pool_mem);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_lookups_proceed_while_batches_copy, tu_teardown),
        cmocka_unit_test_teardown(test_restores_while_blocks_move, tu_teardown),
        cmocka_unit_test_teardown(test_offload_gather_survives_promotion, tu_teardown),
        cmocka_unit_test_teardown(test_offload_handles_released_before_the_gather, tu_teardown),
    };
    return cmocka_run_group_tests_name("pool_batch_mt", tests, NULL, NULL);
}
