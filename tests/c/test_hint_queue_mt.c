/* Queue hints from several threads at once (@threads any): threads hint
 * by position and by request, one advances the step, one reads and frees
 * sequences; every call returns a listed status, the step only grows, and
 * no block keeps a priority of a request the step has passed. */
#include <pthread.h>
#include <stdatomic.h>

#include "test_util.h"

#include "core/engine.h"
#include "core/block.h"

enum { BT = 4, SEQS = 8, BLOCKS = 4, ROUNDS = 3000 };

typedef struct shared {
    kvh_engine *e;
    kvh_seq s[SEQS];
    atomic_int stop;
} shared;

static void *hinter(void *arg)
{
    shared *sh = arg;
    uint64_t x = (uint64_t)(uintptr_t)&sh->stop ^ 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < ROUNDS; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        kvh_seq s = sh->s[(x >> 33) % SEQS];
        uint64_t place = (x >> 40) % 6;
        kvh_hint_place kind = (x >> 50) & 1 ? KVH_HINT_REQUEST : KVH_HINT_POSITION;
        uint64_t step = 0;
        if (kind == KVH_HINT_REQUEST) {
            assert_ok(kvh_hint_advance(sh->e, 0, &step));
            place += step > 2 ? step - 2 : 0; /* some already taken */
        }
        kvh_status st = kvh_seq_hint_queued(sh->e, s, 0, BT * BLOCKS, place, kind);
        assert_true(st == KVH_OK || st == KVH_ERR_BAD_HANDLE);
    }
    return NULL;
}

static void *advancer(void *arg)
{
    shared *sh = arg;
    uint64_t last = 0;
    for (int i = 0; i < ROUNDS; i++) {
        uint64_t step = 0;
        assert_ok(kvh_hint_advance(sh->e, i % 3 == 0 ? 1 : 0, &step));
        assert_true(step >= last);
        last = step;
    }
    return NULL;
}

static void *reader(void *arg)
{
    shared *sh = arg;
    for (int i = 0; i < ROUNDS; i++) {
        kvh_seq s = sh->s[i % SEQS];
        kvh_status st = kvh_seq_acquire(sh->e, s, 0, BT * BLOCKS, NULL);
        assert_true(st == KVH_OK || st == KVH_ERR_BAD_HANDLE);
        if (st == KVH_OK)
            assert_ok(kvh_seq_release(sh->e, s, 0, BT * BLOCKS));
        if (i == ROUNDS / 2)
            assert_ok(kvh_seq_free(sh->e, sh->s[SEQS - 1])); /* a freed one, still hinted at */
    }
    return NULL;
}

static void test_threads(void **state)
{
    (void)state;
    shared sh = {.e = tu_open(1, 1, 4, BT, KVH_DTYPE_F32, 16, 64, 0)};
    int32_t tokens[BT * BLOCKS];
    for (int i = 0; i < SEQS; i++) {
        for (int t = 0; t < BT * BLOCKS; t++)
            tokens[t] = i * 1000 + t;
        assert_ok(kvh_seq_create(sh.e, 0, &sh.s[i]));
        assert_ok(kvh_seq_append(sh.e, sh.s[i], tokens, BT * BLOCKS));
    }
    pthread_t th[4];
    void *(*fn[4])(void *) = {hinter, hinter, advancer, reader};
    for (int i = 0; i < 4; i++)
        assert_int_equal(pthread_create(&th[i], NULL, fn[i], &sh), 0);
    for (int i = 0; i < 4; i++)
        assert_int_equal(pthread_join(th[i], NULL), 0);
    /* Past every request hinted so far: no queue priority may be left. */
    uint64_t step = 0;
    assert_ok(kvh_hint_advance(sh.e, 1u << 25, &step));
    pthread_mutex_lock(&sh.e->lock);
    assert_int_equal(sh.e->qhint_count, 0);
    for (uint64_t b = 0; b < sh.e->block_cap; b++) {
        const kvhi_block *blk = &sh.e->blocks[b];
        if (blk->flags & KVHI_BF_LIVE)
            assert_false(blk->flags & KVHI_BF_HINTED);
    }
    pthread_mutex_unlock(&sh.e->lock);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_threads, tu_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
