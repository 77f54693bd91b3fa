/* The remote tier under threads (run under TSan in `make test`): one
 * engine, several threads matching a shared prefix through the store while
 * others persist (upload) prefixes of their own, against one Redis server
 * without cluster support (the client's single-node mode). The client is
 * shared: its lock serialises rounds, never under the engine lock. With
 * write-through, threads fill a small device tier while the uploader
 * holds its blocks, and no upload reference is left over. */
#include "test_util.h"

#include "mt_util.h"
#include "remote_test_util.h"

#include <unistd.h>

#include "core/block.h"
#include "core/engine.h"

#define LAYERS 2
#define HEADS 2
#define DIM 32
#define BT 16
#define TOK_BYTES (HEADS * DIM * 2)
#define N_BLOCKS 12
#define ROUNDS 4

static rt_cluster server;
static bool have_server;
static uint64_t salt;

static int group_setup(void **state)
{
    (void)state;
    if (!rt_available())
        return 0;
    have_server = rt_start_scratch(&server, 1, NULL) == 0;
    salt = 0x3700000000000000ull ^ (uint64_t)time(NULL);
    return have_server ? 0 : -1;
}

static int group_teardown(void **state)
{
    (void)state;
    if (have_server)
        rt_stop(&server);
    return 0;
}

static kvh_config cfg(void)
{
    kvh_config c = tu_cfg(LAYERS, HEADS, DIM, BT, KVH_DTYPE_F16, 32, 256, 1);
    c.model_salt = salt;
    c.remote_addrs = rt_addrs(&server);
    c.remote_timeout_ms = 2000; /* TSan is slow */
    return c;
}

/* Writes and persists N_BLOCKS blocks of tag's pattern at tokens base.. */
static int put_prefix(kvh_engine *e, int32_t base, uint64_t tag)
{
    int32_t tokens[N_BLOCKS * BT];
    tu_iota(tokens, N_BLOCKS * BT, base);
    kvh_seq s;
    if (kvh_seq_create(e, 0, &s) != KVH_OK || kvh_seq_append(e, s, tokens, N_BLOCKS * BT) != KVH_OK)
        return -1;
    uint8_t k[TOK_BYTES * BT], v[TOK_BYTES * BT];
    for (uint32_t l = 0; l < LAYERS; l++)
        for (size_t t0 = 0; t0 < N_BLOCKS * BT; t0 += BT) {
            for (size_t t = 0; t < BT; t++) {
                tu_pattern(k + t * TOK_BYTES, TOK_BYTES, tag, l, t0 + t, 0);
                tu_pattern(v + t * TOK_BYTES, TOK_BYTES, tag, l, t0 + t, 1);
            }
            if (kvh_seq_write_kv(e, s, l, t0, BT, k, v) != KVH_OK)
                return -2;
        }
    kvh_status st = kvh_seq_persist(e, s);
    kvh_seq_free(e, s);
    return st == KVH_OK ? 0 : -3;
}

static void *worker(void *arg)
{
    mt_worker *w = arg;
    for (int r = 0; r < ROUNDS && !w->errors; r++) {
        if (w->t % 2) {
            int rc = put_prefix(w->e, 100000 * (w->t + 1) + 1000 * r, (uint64_t)(w->t * 100 + r));
            if (rc != 0)
                mt_report(w, "persist round %d: %d (%s)", r, rc, kvh_last_error());
            continue;
        }
        int32_t tokens[N_BLOCKS * BT];
        tu_iota(tokens, N_BLOCKS * BT, 7);
        kvh_seq s;
        size_t m = 0;
        if (kvh_seq_create(w->e, 0, &s) != KVH_OK || kvh_seq_match_prefix(w->e, s, tokens, N_BLOCKS * BT, &m))
            mt_report(w, "match: %s", kvh_last_error());
        else if (m != N_BLOCKS * BT)
            mt_report(w, "round %d matched %zu tokens", r, m);
        else if (!tu_check_pattern(w->e, s, LAYERS, TOK_BYTES, 5, 0, m))
            mt_report(w, "round %d read other KV", r);
        kvh_seq_free(w->e, s);
    }
    return NULL;
}

static void test_threads_share_the_client(void **state)
{
    (void)state;
    if (!have_server)
        skip();
    kvh_config c = cfg();
    kvh_engine *writer = tu_open_cfg(&c);
    assert_int_equal(put_prefix(writer, 7, 5), 0);
    /* A second engine with an empty store: every thread's first match
     * reads the store (or shares what another thread just promoted). */
    kvh_engine *e = tu_open_cfg(&c);
    mt_worker w[4];
    mt_run(e, 4, worker, w);
    kvh_stats st = tu_stats(e);
    assert_true(st.remote_hits >= N_BLOCKS);
    assert_int_equal(st.remote_corrupt, 0);
    assert_int_equal(st.remote_uploads_dropped, 0);
    assert_int_equal(st.remote_uploads, 2 * ROUNDS * N_BLOCKS);
}

/* The same with write-through on: the uploader thread (its own client)
 * sends every block as it is published while the threads persist and
 * match; nothing is dropped and a fresh engine finds every prefix. */
static void test_threads_with_the_uploader(void **state)
{
    (void)state;
    if (!have_server)
        skip();
    salt ^= 0x5a5a;
    kvh_config c = cfg();
    kvh_engine *writer = tu_open_cfg(&c);
    assert_int_equal(put_prefix(writer, 7, 5), 0);
    c.remote_upload = KVH_REMOTE_UPLOAD_PERSIST | KVH_REMOTE_UPLOAD_WRITE_THROUGH;
    kvh_engine *e = tu_open_cfg(&c);
    mt_worker w[4];
    mt_run(e, 4, worker, w);
    assert_ok(tu_close(e)); /* sends what is queued */
    kvh_engine *fresh = tu_open_cfg(&c);
    for (uint32_t t = 1; t < 4; t += 2)
        for (int r = 0; r < ROUNDS; r++) {
            int32_t tokens[N_BLOCKS * BT];
            tu_iota(tokens, N_BLOCKS * BT, (int32_t)(100000 * (t + 1) + 1000 * r));
            kvh_seq s = tu_seq_new(fresh, 0);
            size_t m = 0;
            assert_ok(kvh_seq_match_prefix(fresh, s, tokens, N_BLOCKS * BT, &m));
            assert_int_equal(m, N_BLOCKS * BT);
            assert_true(tu_check_pattern(fresh, s, LAYERS, TOK_BYTES, t * 100 + (uint64_t)r, 0, m));
            assert_ok(kvh_seq_free(fresh, s));
        }
    assert_int_equal(tu_stats(fresh).remote_corrupt, 0);
}

/* Write-through while threads fill a device tier of 8 blocks: every block
 * is queued for upload as it is published, and many are evicted while an
 * upload references them or copies them. The uploads' references are
 * counted apart from the callers' (core/remote_upload.c): once the
 * uploads are done and every sequence freed, none is left, and every
 * block read back what was written. */
static void *pressure_worker(void *arg)
{
    mt_worker *w = arg;
    enum { BLOCKS = 3 };
    for (int r = 0; r < 2 * ROUNDS && !w->errors; r++) {
        int32_t tokens[BLOCKS * BT];
        tu_iota(tokens, BLOCKS * BT, 500000 * (int32_t)(w->t + 1) + 1000 * r);
        uint64_t tag = 900 + (uint64_t)(w->t * 100 + r);
        kvh_seq s;
        if (kvh_seq_create(w->e, 0, &s) != KVH_OK || kvh_seq_append(w->e, s, tokens, BLOCKS * BT) != KVH_OK) {
            mt_report(w, "round %d: append: %s", r, kvh_last_error());
            break;
        }
        uint8_t k[TOK_BYTES], v[TOK_BYTES];
        for (uint32_t l = 0; l < LAYERS && !w->errors; l++)
            for (size_t t = 0; t < BLOCKS * BT; t++) {
                tu_pattern(k, TOK_BYTES, tag, l, t, 0);
                tu_pattern(v, TOK_BYTES, tag, l, t, 1);
                if (kvh_seq_write_kv(w->e, s, l, t, 1, k, v) != KVH_OK) {
                    mt_report(w, "round %d: write: %s", r, kvh_last_error());
                    break;
                }
            }
        if (!w->errors && !tu_check_pattern(w->e, s, LAYERS, TOK_BYTES, tag, 0, BLOCKS * BT))
            mt_report(w, "round %d read other KV", r);
        kvh_seq_free(w->e, s);
    }
    return NULL;
}

static void test_uploads_under_eviction_pressure(void **state)
{
    (void)state;
    if (!have_server)
        skip();
    salt ^= 0xa5a5;
    kvh_config c = tu_cfg(LAYERS, HEADS, DIM, BT, KVH_DTYPE_F16, 8, 256, 1);
    c.model_salt = salt;
    c.remote_addrs = rt_addrs(&server);
    c.remote_timeout_ms = 2000;
    c.remote_upload = KVH_REMOTE_UPLOAD_WRITE_THROUGH;
    kvh_engine *e = tu_open_cfg(&c);
    mt_worker w[4];
    mt_run(e, 4, pressure_worker, w);
    uint64_t want = 4 * 2 * ROUNDS * 3;
    for (int i = 0; i < 3000; i++) {
        kvh_stats st = tu_stats(e);
        if (st.remote_uploads + st.remote_uploads_dropped >= want)
            break;
        usleep(10000);
    }
    kvh_stats st = tu_stats(e);
    assert_int_equal(st.remote_uploads + st.remote_uploads_dropped, want);
    assert_true(st.evictions > 0);
    pthread_mutex_lock(&e->lock);
    uint32_t left = 0, referenced = 0;
    for (uint32_t b = 0; b < e->block_cap; b++) {
        left += e->upload_refs[b] != 0;
        referenced += (e->blocks[b].flags & KVHI_BF_LIVE) && e->blocks[b].refs != 0;
    }
    pthread_mutex_unlock(&e->lock);
    assert_int_equal(left, 0);
    assert_int_equal(referenced, 0);
    assert_ok(tu_close(e));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_threads_share_the_client, tu_teardown),
        cmocka_unit_test_teardown(test_threads_with_the_uploader, tu_teardown),
        cmocka_unit_test_teardown(test_uploads_under_eviction_pressure, tu_teardown),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
