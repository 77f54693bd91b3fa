/* Clean host copies (core/clean_copy.c) under threads: each thread owns
 * blocks that keep copies (immutable twins of published blocks, so they
 * are written in place) and promotes them, demotes them (through the
 * migration workers), rewrites them whole and reads them back, while all
 * threads promote, demote and read one shared published prefix (each
 * through a sequence of its own). The device tier
 * is smaller than what they use, so other threads' acquires evict blocks
 * onto their copies and the host tier takes copies back for room. Every
 * read must return the last bytes written, and at the end every kept slot
 * must belong to a block in the device tier. */
#include "disk_test_util.h"
#include "mt_util.h"

#include "core/engine.h"
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_threads_promote_demote_write_and_read, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
