/* core/hint_queue.c: queue hints by position, by request number and once
 * per request give every block the same priorities; a priority goes when
 * the step passes its request, not with engine accesses; misuse is
 * refused. White-box: priorities are read from the block records. */
#include <pthread.h>

#include "test_util.h"

#include "core/engine.h"
#include "core/block.h"
#include "core/seq.h"

enum { BT = 4, SEQS = 5, BLOCKS = 2, REQUESTS = 12, QUEUE = 3 };

/* Request r reads sequence order[r] (sessions come back). */
static const int order[REQUESTS] = {0, 1, 0, 2, 1, 3, 0, 4, 2, 0, 1, 0};

typedef enum { BY_POSITION, BY_REQUEST, ON_ENTRY } style;

typedef struct world {
    kvh_engine *e;
    kvh_seq s[SEQS];
} world;

static void open_world(world *w)
{
    w->e = tu_open(1, 1, 4, BT, KVH_DTYPE_F32, 64, 64, 0);
    int32_t tokens[BT * BLOCKS] = {0};
    for (int i = 0; i < SEQS; i++) {
        for (int t = 0; t < BT * BLOCKS; t++)
            tokens[t] = i * 100 + t;
        assert_ok(kvh_seq_create(w->e, 0, &w->s[i]));
        assert_ok(kvh_seq_append(w->e, w->s[i], tokens, BT * BLOCKS));
    }
}

static void hint_before(world *w, style how, uint64_t step)
{
    for (uint64_t r = step; r < step + QUEUE && r < REQUESTS; r++) {
        kvh_seq s = w->s[order[r]];
        if (how == BY_POSITION)
            assert_ok(kvh_seq_hint_queued(w->e, s, 0, BT * BLOCKS, r - step, KVH_HINT_POSITION));
        else if (how == BY_REQUEST)
            assert_ok(kvh_seq_hint_queued(w->e, s, 0, BT * BLOCKS, r, KVH_HINT_REQUEST));
        else if (r == step + QUEUE - 1 || step == 0)
            assert_ok(kvh_seq_hint_queued(w->e, s, 0, BT * BLOCKS, r, KVH_HINT_REQUEST));
    }
}

static void read_request(world *w, uint64_t r)
{
    assert_ok(kvh_seq_acquire(w->e, w->s[order[r]], 0, BT * BLOCKS, NULL));
    assert_ok(kvh_seq_release(w->e, w->s[order[r]], 0, BT * BLOCKS));
}

/* Each block's hint state: (hinted, first priority, second priority). */
static void snapshot(world *w, int64_t out[SEQS * BLOCKS][3])
{
    pthread_mutex_lock(&w->e->lock);
    for (int i = 0; i < SEQS; i++) {
        kvhi_seq *s = NULL;
        assert_ok(kvhi_seq_get(w->e, w->s[i], &s));
        for (int b = 0; b < BLOCKS; b++) {
            const kvhi_block *blk = &w->e->blocks[s->blocks[b]];
            bool hinted = blk->flags & KVHI_BF_HINTED;
            out[i * BLOCKS + b][0] = hinted;
            out[i * BLOCKS + b][1] = hinted ? blk->hint_priority : 0;
            out[i * BLOCKS + b][2] = hinted ? blk->hint_next : 0;
        }
    }
    pthread_mutex_unlock(&w->e->lock);
}

static void test_three_styles_agree(void **state)
{
    (void)state;
    world w[3];
    for (int k = 0; k < 3; k++)
        open_world(&w[k]);
    for (uint64_t r = 0; r < REQUESTS; r++) {
        int64_t snap[3][SEQS * BLOCKS][3];
        for (int k = 0; k < 3; k++) {
            hint_before(&w[k], (style)k, r);
            read_request(&w[k], r);
            uint64_t step = 0;
            assert_ok(kvh_hint_advance(w[k].e, 1, &step));
            assert_int_equal(step, r + 1);
            snapshot(&w[k], snap[k]);
        }
        assert_memory_equal(snap[0], snap[1], sizeof(snap[0]));
        assert_memory_equal(snap[0], snap[2], sizeof(snap[0]));
    }
}

static bool hinted(world *w, int seq, int32_t *priority)
{
    pthread_mutex_lock(&w->e->lock);
    kvhi_seq *s = NULL;
    assert_ok(kvhi_seq_get(w->e, w->s[seq], &s));
    const kvhi_block *blk = &w->e->blocks[s->blocks[0]];
    bool h = blk->flags & KVHI_BF_HINTED;
    if (h && priority)
        *priority = blk->hint_priority;
    pthread_mutex_unlock(&w->e->lock);
    return h;
}

/* A request that never came loses its hold once the step passes it, and
 * a hint for a request already taken changes nothing; neither waits for
 * engine accesses. */
static void test_stale_requests_lose(void **state)
{
    (void)state;
    world w;
    open_world(&w);
    uint64_t step = 0;
    assert_ok(kvh_seq_hint_queued(w.e, w.s[0], 0, BT, 2, KVH_HINT_POSITION)); /* request 2 */
    assert_ok(kvh_seq_hint_queued(w.e, w.s[1], 0, BT, 3, KVH_HINT_REQUEST));
    int32_t p0 = 0, p1 = 0;
    assert_true(hinted(&w, 0, &p0));
    assert_true(hinted(&w, 1, &p1));
    assert_true(p0 > p1); /* request 2 before request 3 */
    /* Hundreds of accesses elsewhere (several hint epochs): still hinted. */
    for (int i = 0; i < 400; i++) {
        assert_ok(kvh_seq_acquire(w.e, w.s[3], 0, BT * BLOCKS, NULL));
        assert_ok(kvh_seq_release(w.e, w.s[3], 0, BT * BLOCKS));
    }
    assert_true(hinted(&w, 0, NULL));
    assert_ok(kvh_hint_advance(w.e, 3, &step)); /* requests 0..2 taken */
    assert_int_equal(step, 3);
    assert_false(hinted(&w, 0, NULL)); /* request 2 never read it */
    assert_true(hinted(&w, 1, &p1));
    /* Stale: request 1 has been taken. */
    assert_ok(kvh_seq_hint_queued(w.e, w.s[2], 0, BT, 1, KVH_HINT_REQUEST));
    assert_false(hinted(&w, 2, NULL));
    assert_ok(kvh_hint_advance(w.e, 0, &step));
    assert_int_equal(step, 3);
    assert_ok(kvh_hint_advance(w.e, 1, &step));
    assert_false(hinted(&w, 1, NULL));
}

/* Hinted once for two requests, a block is redeemed by the read of each,
 * as it would be if re-hinted before every step. */
static void test_hinted_once_redeems_each_use(void **state)
{
    (void)state;
    world w;
    open_world(&w);
    uint64_t step = 0;
    assert_ok(kvh_seq_hint_queued(w.e, w.s[0], 0, BT, 0, KVH_HINT_REQUEST));
    assert_ok(kvh_seq_hint_queued(w.e, w.s[0], 0, BT, 1, KVH_HINT_REQUEST));
    assert_ok(kvh_seq_acquire(w.e, w.s[0], 0, BT, NULL)); /* request 0 */
    assert_ok(kvh_seq_release(w.e, w.s[0], 0, BT));
    int32_t p = 0;
    assert_true(hinted(&w, 0, &p));
    assert_ok(kvh_hint_advance(w.e, 1, &step));
    assert_true(hinted(&w, 0, &p));                       /* request 1 still to come */
    assert_ok(kvh_seq_acquire(w.e, w.s[0], 0, BT, NULL)); /* request 1 */
    assert_ok(kvh_seq_release(w.e, w.s[0], 0, BT));
    assert_false(hinted(&w, 0, NULL)); /* read: nothing left to wait for */
}

/* Block 0 of sequence seq: (hinted, first priority, second priority). */
static void hint_state(world *w, int seq, int64_t out[3])
{
    pthread_mutex_lock(&w->e->lock);
    kvhi_seq *s = NULL;
    assert_ok(kvhi_seq_get(w->e, w->s[seq], &s));
    const kvhi_block *blk = &w->e->blocks[s->blocks[0]];
    out[0] = (blk->flags & KVHI_BF_HINTED) != 0;
    out[1] = out[0] ? blk->hint_priority : 0;
    out[2] = out[0] ? blk->hint_next : 0;
    pthread_mutex_unlock(&w->e->lock);
}

static void churn(world *w, int seq, int n)
{
    for (int i = 0; i < n; i++) {
        assert_ok(kvh_seq_acquire(w->e, w->s[seq], 0, BT * BLOCKS, NULL));
        assert_ok(kvh_seq_release(w->e, w->s[seq], 0, BT * BLOCKS));
    }
}

/* One block hinted both ways keeps each priority under its own rules: the
 * kvh_seq_hint one lapses with engine accesses, the queue one does not
 * (it waits for its request), whichever came first. */
static void test_seq_and_queue_hints_on_one_block_keep_their_own_rules(void **state)
{
    (void)state;
    for (int queue_first = 0; queue_first < 2; queue_first++) {
        world w;
        open_world(&w);
        if (queue_first)
            assert_ok(kvh_seq_hint_queued(w.e, w.s[0], 0, BT, 5, KVH_HINT_REQUEST));
        assert_ok(kvh_seq_hint(w.e, w.s[0], 0, BT, 1000));
        if (!queue_first)
            assert_ok(kvh_seq_hint_queued(w.e, w.s[0], 0, BT, 5, KVH_HINT_REQUEST));
        int64_t st[3];
        hint_state(&w, 0, st);
        assert_int_equal(st[0], 1);
        int64_t queued = st[1]; /* request 5 ranks above priority 1000 */
        assert_true(queued > 1000 && st[2] == 1000);
        churn(&w, 3, 600); /* many hint epochs (a horizon is 128 blocks here) */
        hint_state(&w, 0, st);
        assert_int_equal(st[0], 1);
        assert_int_equal(st[1], queued);
        assert_int_equal(st[2], KVHI_HINT_NONE); /* the lapsing one went */
        uint64_t step = 0;
        assert_ok(kvh_hint_advance(w.e, 6, &step));
        hint_state(&w, 0, st);
        assert_int_equal(st[0], 0); /* request 5 passed */
        tu_close(w.e);
    }
}

/* Only its own request's read redeems a queue priority: a read by an
 * earlier request leaves it, as re-hinting would have put it back, so a
 * caller that hints once on entry keeps it; and re-hinting the same
 * request over and over files it once. */
static void test_an_earlier_read_leaves_a_queue_priority_in_place(void **state)
{
    (void)state;
    world w;
    open_world(&w);
    assert_ok(kvh_seq_hint_queued(w.e, w.s[0], 0, BT * BLOCKS, 2, KVH_HINT_REQUEST));
    int64_t before[3], after[3];
    hint_state(&w, 0, before);
    assert_int_equal(before[0], 1);
    churn(&w, 0, 3); /* requests 0 and 1 read sequence 0 too, unannounced */
    hint_state(&w, 0, after);
    assert_memory_equal(before, after, sizeof(before));
    for (int i = 0; i < 1000; i++) {
        assert_ok(kvh_seq_hint_queued(w.e, w.s[0], 0, BT * BLOCKS, 2, KVH_HINT_REQUEST));
        churn(&w, 0, 1);
    }
    pthread_mutex_lock(&w.e->lock);
    uint32_t filed = w.e->qhint_count;
    pthread_mutex_unlock(&w.e->lock);
    assert_int_equal(filed, BLOCKS); /* one pair per block, not one per hint */
    uint64_t step = 0;
    assert_ok(kvh_hint_advance(w.e, 2, &step));
    churn(&w, 0, 1); /* request 2's read */
    hint_state(&w, 0, after);
    assert_int_equal(after[0], 0);
    tu_close(w.e);
}

/* Misuse: unknown kinds, out-of-range places and ranges, a freed sequence;
 * none changes the step or any hint. */
/* The queue's head re-hinted before every read while the step does not
 * move (it waits): each read redeems the due priority and each hint puts
 * it back. The filed pairs stay bounded by what the blocks hold (two
 * priorities each), whatever the number of rounds, and the heap's memory
 * shrinks again once the step passes. */
static void test_rehinting_a_waiting_head_files_a_bounded_heap(void **state)
{
    (void)state;
    world w;
    open_world(&w);
    float kv[BT * BLOCKS * 4] = {0};
    for (int i = 0; i < SEQS; i++)
        assert_ok(kvh_seq_write_kv(w.e, w.s[i], 0, 0, BT * BLOCKS, kv, kv));
    kvh_seq reader;
    assert_ok(kvh_seq_fork(w.e, w.s[0], 1, &reader)); /* a running request sharing the blocks */
    uint32_t most = 0;
    for (int round = 0; round < 20000; round++) {
        for (int i = 0; i < SEQS; i++)
            assert_ok(kvh_seq_hint_queued(w.e, w.s[i], 0, BT * BLOCKS, (uint64_t)i, KVH_HINT_POSITION));
        assert_ok(kvh_seq_read_kv(w.e, reader, 0, 0, BT * BLOCKS, kv, kv));
        pthread_mutex_lock(&w.e->lock);
        if (w.e->qhint_cap > most)
            most = w.e->qhint_cap;
        pthread_mutex_unlock(&w.e->lock);
    }
    /* SEQS * BLOCKS blocks hold at most two queue priorities each. */
    assert_true(most <= 256);
    int32_t p = 0;
    assert_true(hinted(&w, 1, &p)); /* its request is still to come */
    uint64_t step = 0;
    assert_ok(kvh_hint_advance(w.e, SEQS, &step));
    pthread_mutex_lock(&w.e->lock);
    assert_int_equal(w.e->qhint_count, 0);
    pthread_mutex_unlock(&w.e->lock);
    assert_ok(kvh_seq_free(w.e, reader));
}

static void test_misuse(void **state)
{
    (void)state;
    world w;
    open_world(&w);
    uint64_t step = 0;
    assert_ok(kvh_hint_advance(w.e, 5, &step));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_hint_queued(w.e, w.s[0], 0, BT, 0, (kvh_hint_place)2));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_hint_queued(w.e, w.s[0], 0, BT, 1u << 24, KVH_HINT_POSITION));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_hint_queued(w.e, w.s[0], 0, BT, 5 + (1u << 24), KVH_HINT_REQUEST));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_hint_queued(w.e, w.s[0], 0, BT, UINT64_MAX, KVH_HINT_POSITION));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_hint_queued(w.e, w.s[0], BT * BLOCKS, 1, 0, KVH_HINT_POSITION));
    kvh_seq gone = w.s[4];
    assert_ok(kvh_seq_free(w.e, gone));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_hint_queued(w.e, gone, 0, BT, 0, KVH_HINT_POSITION));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_hint_advance(w.e, 1, NULL));
    assert_kvh(KVH_ERR_RANGE, kvh_hint_advance(w.e, UINT64_MAX, &step));
    assert_ok(kvh_hint_advance(w.e, 0, &step));
    assert_int_equal(step, 5);
    for (int i = 0; i < 4; i++)
        assert_false(hinted(&w, i, NULL));
    /* Near the end of the step count, a place that would number its
     * request past 2^64 says so, not that it lies beyond the reach. */
    assert_ok(kvh_hint_advance(w.e, UINT64_MAX - 2 - step, &step));
    assert_true(step == UINT64_MAX - 2);
    assert_ok(kvh_seq_hint_queued(w.e, w.s[0], 0, BT, 2, KVH_HINT_POSITION));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_hint_queued(w.e, w.s[0], 0, BT, 3, KVH_HINT_POSITION));
    assert_non_null(strstr(kvh_last_error(), "past 2^64"));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_hint_advance(NULL, 0, &step));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_three_styles_agree, tu_teardown),
        cmocka_unit_test_teardown(test_stale_requests_lose, tu_teardown),
        cmocka_unit_test_teardown(test_hinted_once_redeems_each_use, tu_teardown),
        cmocka_unit_test_teardown(test_seq_and_queue_hints_on_one_block_keep_their_own_rules, tu_teardown),
        cmocka_unit_test_teardown(test_an_earlier_read_leaves_a_queue_priority_in_place, tu_teardown),
        cmocka_unit_test_teardown(test_rehinting_a_waiting_head_files_a_bounded_heap, tu_teardown),
        cmocka_unit_test_teardown(test_misuse, tu_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
