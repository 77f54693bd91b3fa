/* Batched pool transfers under concurrency (label `concurrency`, run under
 * TSan): one thread offloads and restores batches of large blocks while
 * others look prefixes up. The copies run on the migration workers
 * without the engine lock, so lookups complete while a batch is still
 * copying (counted: a lookup that began and ended between two polls that
 * saw the batch unfinished), and every restored slot equals its source. */
#include <stdatomic.h>

#include "test_util.h"
#include "mt_util.h"
#include "pool_test_util.h"

/* 4 layers x 2 heads x 128 dims x 64 tokens, f16: 256 KiB a block. */
enum { L = 4, H = 2, D = 128, BT = 64, SLOTS = 32, N = 12, ROUNDS = 6 };

static pt_pool pool_mem;
static kvh_pool pool;
static atomic_int copying;     /* a batch is submitted and its fence not yet seen complete */
static atomic_int finished;    /* the batch thread is done */
static atomic_long overlapped; /* lookups that ran wholly while a batch copied */

static void tokens_of(int32_t *t, uint32_t round, uint32_t i) { pt_tokens(t, BT, 1000 + round, i); }

static void *batch_thread(void *arg)
{
    mt_worker *w = arg;
    kvh_engine *e = w->e;
    for (uint32_t round = 0; round < ROUNDS && !w->errors; round++) {
        kvh_pool_xfer x[N];
        int32_t tok[N][BT];
        uint64_t parent = 0;
        for (uint32_t i = 0; i < N; i++) {
            tokens_of(tok[i], round, i);
            x[i] = (kvh_pool_xfer){
                .struct_size = sizeof(kvh_pool_xfer), .slot = i, .parent_hash = parent, .tokens = tok[i]};
            if (kvh_prefix_hash(e, parent, tok[i], BT, &parent) != KVH_OK)
                mt_report(w, "hash: %s", kvh_last_error());
        }
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
        kvh_pool_xfer r[N];
        for (uint32_t i = 0; i < N; i++) {
            if (x[i].status != KVH_OK)
                mt_report(w, "offload item %u: %s", i, kvh_status_name(x[i].status));
            r[i] = (kvh_pool_xfer){.struct_size = sizeof(kvh_pool_xfer), .slot = N + i, .block = x[i].block};
        }
        kvh_fence lf[L];
        atomic_store(&copying, 1);
        if (kvh_pool_restore_batch(e, pool, r, N, 0, L, lf) != KVH_OK) {
            mt_report(w, "restore: %s", kvh_last_error());
            break;
        }
        for (uint32_t l = 0; l < L; l++) {
            if (kvh_fence_wait(e, lf[l], UINT64_MAX) != KVH_OK)
                mt_report(w, "layer fence %u: %s", l, kvh_last_error());
            kvh_fence_free(e, lf[l]);
            for (uint32_t i = 0; i < N; i++)
                if (!pt_layer_equal(&pool_mem, i, &pool_mem, N + i, l))
                    mt_report(w, "round %u: slot %u layer %u differs after its fence", round, N + i, l);
        }
        atomic_store(&copying, 0);
        for (uint32_t i = 0; i < N; i++) {
            kvh_block_release(e, x[i].block);
            for (uint32_t l = 0; l < L; l++)
                pt_layer_clear(&pool_mem, N + i, l);
        }
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_lookups_proceed_while_batches_copy, tu_teardown),
    };
    return cmocka_run_group_tests_name("pool_batch_mt", tests, NULL, NULL);
}
