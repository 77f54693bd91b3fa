/* Disk tier under concurrency (labelled `concurrency`: also run under
 * TSan).
 *
 * Four threads each build sequences of their own and persist them, spill
 * them to disk (synchronously and not), read them back and match prefixes
 * of the others' persisted sequences, while the migration workers and the
 * background cleaner run; tiers are small, so blocks keep moving. Every
 * persist that returned KVH_OK is found afterwards, byte-identical, by
 * this engine, by a new engine after a clean close, and by a new process
 * after one that ended without closing.
 */
#include "disk_test_util.h"
#include "mt_util.h"

#include <stdatomic.h>
#include <unistd.h>

static const dt_geo G = {2, 2, 16, 16, KVH_DTYPE_BF16}; /* block = 4096 bytes */
#define THREADS 4
#define PER_THREAD 24

static char g_dir[512];
static kvh_config g_cfg;
static atomic_int g_acked[THREADS][PER_THREAD]; /* full blocks acknowledged */

static dt_content content(int t, int i) { return dt_plain(30000 + (uint64_t)t * 100 + (uint64_t)i); }
static size_t length(int t, int i) { return (size_t)(1 + (t + i) % 5) * G.bt + (size_t)((i * 7) % G.bt); }

#define WFAIL(...)                                                                                                     \
    do {                                                                                                               \
        mt_report(w, __VA_ARGS__);                                                                                     \
        return NULL;                                                                                                   \
    } while (0)

static void *work(void *arg)
{
    mt_worker *w = arg;
    kvh_engine *e = w->e;
    dt_rng rng = {dt_seed(77) * 31 + (uint64_t)w->t};
    for (int i = 0; i < PER_THREAD; i++) {
        kvh_seq s;
        size_t n = length(w->t, i);
        char msg[256] = "";
        kvh_status st = dt_build(e, G, content(w->t, i), n, 0, &s);
        if (st != KVH_OK)
            WFAIL("thread %d seq %d: build: %s (%.160s)", w->t, i, kvh_status_name(st), dt_err);
        kvh_fence f = {0};
        switch (dt_below(&rng, 3)) {
        case 0:
            st = kvh_seq_migrate(e, s, 0, n, KVH_TIER_DISK, NULL);
            break;
        case 1:
            st = kvh_seq_migrate(e, s, 0, n, KVH_TIER_DISK, &f);
            break;
        default:
            break;
        }
        if (st != KVH_OK)
            WFAIL("thread %d seq %d: migrate: %s (%s)", w->t, i, kvh_status_name(st), kvh_last_error());
        st = kvh_seq_persist(e, s);
        if (st != KVH_OK)
            WFAIL("thread %d seq %d: persist: %s (%s)", w->t, i, kvh_status_name(st), kvh_last_error());
        atomic_store(&g_acked[w->t][i], (int)(n / G.bt));
        if (f.id)
            kvh_fence_free(e, f);
        /* Matches of other threads hold whole chains read from disk (up to
         * 4 x 6 blocks against 18 memory slots): a read may find every slot
         * held for a moment, a NOSPACE that passes when they finish. */
        for (int tries = 0;
             (st = dt_verify(e, s, G, content(w->t, i), 0, n, msg, sizeof(msg))) == KVH_ERR_NOSPACE && tries < 1000;
             tries++)
            usleep(1000);
        if (st != KVH_OK)
            WFAIL("thread %d seq %d: read back: %s", w->t, i, msg);
        kvh_seq_free(e, s);
        /* match something another thread has persisted */
        int ot = (int)dt_below(&rng, THREADS), oi = (int)dt_below(&rng, PER_THREAD);
        int acked = atomic_load(&g_acked[ot][oi]);
        if (acked) {
            size_t m = 0;
            if ((st = dt_match_verify(e, G, content(ot, oi), length(ot, oi), &m, msg, sizeof(msg))) != KVH_OK)
                WFAIL("thread %d: match of %d/%d: %s", w->t, ot, oi, msg);
            if (m < (size_t)acked * G.bt)
                WFAIL("thread %d: %d/%d persisted with %d blocks, matched %zu tokens", w->t, ot, oi, acked, m);
        }
    }
    return NULL;
}

/* 0 when every acknowledged block is found, else a count of failures. */
static int check_all(kvh_engine *e, char *msg, size_t len)
{
    int bad = 0;
    for (int t = 0; t < THREADS; t++)
        for (int i = 0; i < PER_THREAD; i++) {
            size_t m = 0;
            char why[256] = "";
            kvh_status st = dt_match_verify(e, G, content(t, i), length(t, i), &m, why, sizeof(why));
            int acked = atomic_load(&g_acked[t][i]);
            if (st != KVH_OK || m < (size_t)acked * G.bt) {
                if (!bad++)
                    snprintf(msg, len, "%d/%d: acked %d blocks, matched %zu tokens: %s", t, i, acked, m,
                             st == KVH_OK ? "too few" : why);
            }
        }
    return bad;
}

static int check_child(void *arg)
{
    (void)arg;
    kvh_engine *e = NULL;
    if (kvh_engine_open(&g_cfg, &e) != KVH_OK) {
        fprintf(stderr, "child open: %s\n", kvh_last_error());
        return 2;
    }
    char msg[512] = "";
    int bad = check_all(e, msg, sizeof(msg));
    if (bad)
        fprintf(stderr, "child: %d missing or wrong: %s\n", bad, msg);
    return bad ? 1 : 0; /* ends without closing */
}

static void test_concurrent_persist_spill_match(void **state)
{
    (void)state;
    dt_scratch("mt", g_dir, sizeof(g_dir));
    g_cfg = dt_cfg(G, g_dir, 6, 12, 1024, 2);
    g_cfg.migration_threads = 2;
    kvh_engine *e = dt_open_a(&g_cfg);
    mt_worker w[THREADS];
    mt_run(e, THREADS, work, w);
    char msg[512] = "";
    int bad = check_all(e, msg, sizeof(msg));
    if (bad)
        fail_msg("same engine: %d sequences missing or wrong; first: %s", bad, msg);
    kvh_stats st = dt_stats(e);
    assert_int_equal(st.corrupt_blocks, 0);
    int acked = 0;
    for (int t = 0; t < THREADS; t++)
        for (int i = 0; i < PER_THREAD; i++)
            acked += atomic_load(&g_acked[t][i]);
    print_message("%d threads persisted %d blocks; %" PRIu64 " host->disk and %" PRIu64 " disk->host moves meanwhile\n",
                  THREADS, acked, st.blocks_host_to_disk, st.blocks_disk_to_host);
    dt_assert_ok(dt_close(e));

    e = dt_open_a(&g_cfg);
    if ((bad = check_all(e, msg, sizeof(msg))) != 0)
        fail_msg("after a clean close: %d sequences missing or wrong; first: %s", bad, msg);
    dt_assert_ok(dt_close(e));
    /* a process that ends without closing, then this one again */
    assert_int_equal(dt_in_child(check_child, NULL), 0);
    e = dt_open_a(&g_cfg);
    if ((bad = check_all(e, msg, sizeof(msg))) != 0)
        fail_msg("after an unclean end: %d sequences missing or wrong; first: %s", bad, msg);
    dt_assert_ok(dt_close(e));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_concurrent_persist_spill_match, dt_teardown),
    };
    return cmocka_run_group_tests_name("disk_mt", tests, NULL, NULL);
}
