/* Tenant scopes under concurrency, from kvh.h's promises alone: tenants
 * in scopes 0, 1 (two threads sharing it) and 2^64 - 1 send the same
 * prompts at once, each writing its own KV for them, matching, growing,
 * truncating, persisting and freeing, while a prober thread looks the
 * prompts up in other scopes and offloads the same tokens from a pool in
 * a scope of its own. Memory is small and a disk tier takes the rest, so
 * blocks are evicted, demoted and read back while others match them.
 * A tenant must only ever read its own scope's bytes, and no lookup from
 * another scope may find anything. */
#include <stdatomic.h>

#include "test_util.h"
#include "disk_test_util.h"
#include "mt_util.h"

enum { L = 2, H = 1, D = 4, BT = 4, NB = 3, PROMPTS = 6, TENANTS = 4 };
static const size_t TOKB = H * D * 4;
#define N (NB * BT)

static const uint64_t SCOPE_OF[TENANTS] = {0, 1, 1, UINT64_MAX};
static const uint64_t PROBER_SCOPE = 77;

static _Atomic int stop;
static _Atomic uint64_t hits, misses, probes;

static void prompt(int p, int32_t *t)
{
    for (int i = 0; i < N; i++)
        t[i] = p * 1000 + i;
}

/* What each scope writes for prompt p: one tag per (scope, prompt), so
 * every tenant of a scope agrees and the first publisher's copy is right. */
static uint64_t tag_of(uint64_t scope, int p) { return (scope % 1000 + 1) * 100 + (uint64_t)p; }

static void kv(uint64_t tag, uint32_t layer, uint64_t pos, uint64_t n, uint8_t *k, uint8_t *v)
{
    for (uint64_t i = 0; i < n; i++) {
        tu_pattern(k + i * TOKB, TOKB, tag, layer, pos + i, 0);
        tu_pattern(v + i * TOKB, TOKB, tag, layer, pos + i, 1);
    }
}

static int check(mt_worker *w, kvh_seq s, uint64_t tag, uint64_t n, const char *when)
{
    uint8_t k[N * 16], v[N * 16], ek[N * 16], ev[N * 16];
    for (uint32_t l = 0; l < L; l++) {
        kvh_status st = kvh_seq_read_kv(w->e, s, l, 0, n, k, v);
        if (st == KVH_ERR_NOSPACE)
            return 1;
        if (st != KVH_OK) {
            mt_report(w, "%s: read_kv %s (%s)", when, kvh_status_name(st), kvh_last_error());
            return 0;
        }
        kv(tag, l, 0, n, ek, ev);
        if (memcmp(k, ek, n * TOKB) != 0 || memcmp(v, ev, n * TOKB) != 0) {
            mt_report(w, "%s: layer %u is not this scope's KV (tag %" PRIu64 ")", when, l, tag);
            return 0;
        }
    }
    return 1;
}

static void tenant(mt_worker *w)
{
    uint64_t scope = SCOPE_OF[w->t];
    tu_rng r = {tu_seed(0x5c0) * 13 + (uint64_t)w->t};
    uint8_t k[N * 16], v[N * 16];
    while (!atomic_load(&stop) && !w->errors) {
        int p = (int)tu_below(&r, PROMPTS);
        uint64_t tag = tag_of(scope, p);
        int32_t t[N];
        prompt(p, t);
        kvh_seq s;
        if (kvh_seq_create(w->e, (uint32_t)w->t, &s) != KVH_OK) {
            mt_report(w, "create");
            return;
        }
        kvh_status st = kvh_seq_set_scope(w->e, s, scope, scope, 0);
        size_t m = 0;
        if (st == KVH_OK)
            st = kvh_seq_match_prefix(w->e, s, t, N, &m);
        if (st != KVH_OK) {
            mt_report(w, "scope/match: %s", kvh_status_name(st));
            return;
        }
        atomic_fetch_add(m ? &hits : &misses, 1);
        if (m && !check(w, s, tag, m, "matched"))
            return;
        st = kvh_seq_append(w->e, s, t + m, N - m);
        if (st == KVH_OK) {
            for (uint32_t l = 0; l < L && st == KVH_OK; l++) {
                kv(tag, l, m, N - m, k, v);
                st = kvh_seq_write_kv(w->e, s, l, m, N - m, k, v);
            }
            if (st == KVH_OK && !check(w, s, tag, N, "built"))
                return;
            if (st == KVH_OK && tu_below(&r, 8) == 0) {
                st = kvh_seq_persist(w->e, s);
                if (st != KVH_OK && st != KVH_ERR_NOSPACE && st != KVH_ERR_BUSY)
                    mt_report(w, "persist: %s (%s)", kvh_status_name(st), kvh_last_error());
                st = KVH_OK;
            }
            if (st == KVH_OK && tu_below(&r, 4) == 0) {
                /* Cut into the last block and grow it back: the same
                 * bytes again. */
                uint64_t to = N - 1 - tu_below(&r, BT);
                if (kvh_seq_truncate(w->e, s, to) == KVH_OK && kvh_seq_append(w->e, s, t + to, N - to) == KVH_OK) {
                    for (uint32_t l = 0; l < L && st == KVH_OK; l++) {
                        kv(tag, l, to, N - to, k, v);
                        st = kvh_seq_write_kv(w->e, s, l, to, N - to, k, v);
                    }
                    if (st == KVH_OK && !check(w, s, tag, N, "regrown"))
                        return;
                }
            }
        }
        if (st != KVH_OK && st != KVH_ERR_NOSPACE)
            mt_report(w, "build: %s (%s)", kvh_status_name(st), kvh_last_error());
        if (kvh_seq_free(w->e, s) != KVH_OK)
            mt_report(w, "free");
    }
}

/* Looks every prompt up in scopes nobody publishes in (the tenants'
 * scopes with another shared part included), and offloads the prompts
 * from a pool in a scope of its own: never a tenant's block. */
static void prober(mt_worker *w)
{
    tu_rng r = {tu_seed(0x9b0) + 5};
    enum { SLOTS = 2 };
    size_t slot_bytes = (size_t)BT * TOKB;
    uint8_t *kb[L], *vb[L];
    void *kp[L], *vp[L];
    for (uint32_t l = 0; l < L; l++) {
        kp[l] = kb[l] = malloc(SLOTS * slot_bytes);
        vp[l] = vb[l] = malloc(SLOTS * slot_bytes);
        tu_fill(&r, kb[l], SLOTS * slot_bytes);
        tu_fill(&r, vb[l], SLOTS * slot_bytes);
    }
    kvh_pool_layout lay;
    memset(&lay, 0, sizeof(lay));
    lay.struct_size = sizeof(lay);
    lay.memory = KVH_MEMORY_HOST;
    lay.num_slots = SLOTS;
    lay.k_base = kp;
    lay.v_base = vp;
    lay.slot_stride = slot_bytes;
    lay.token_stride = TOKB;
    lay.head_stride = (uint64_t)D * 4;
    kvh_pool pool;
    if (kvh_pool_register(w->e, &lay, &pool) != KVH_OK) {
        mt_report(w, "pool_register");
        goto out;
    }
    const uint64_t strangers[] = {2, 3, UINT64_MAX - 1, 1ull << 63, PROBER_SCOPE + 1};
    while (!atomic_load(&stop) && !w->errors) {
        int p = (int)tu_below(&r, PROMPTS);
        int32_t t[N];
        prompt(p, t);
        uint64_t sc = strangers[tu_below(&r, 5)];
        /* A shared part in scope 0 would be a choice to share with the
         * default scope; here the shared part is another stranger. */
        uint64_t shared = tu_below(&r, 2) ? sc : strangers[tu_below(&r, 5)];
        kvh_block out[NB];
        size_t nb = 99;
        if (atomic_fetch_add(&probes, 1) % 16 == 0)
            dt_sleep_ms(0.1); /* leave the tenants most of the engine */
        kvh_status st = kvh_prefix_lookup_scoped(w->e, sc, shared, tu_below(&r, N + 1), t, N, out, NB, &nb);
        if (st != KVH_OK || nb != 0) {
            mt_report(w, "scope %" PRIu64 " found %zu blocks of prompt %d (%s)", sc, nb, p, kvh_status_name(st));
            for (size_t i = 0; st == KVH_OK && i < nb; i++)
                kvh_block_release(w->e, out[i]);
            break;
        }
        /* Offload the prompt's first block in the prober's own scope:
         * deduped only against that scope; then it is found there. */
        kvh_block b;
        st = kvh_pool_offload_scoped(w->e, pool, (uint32_t)tu_below(&r, SLOTS), PROBER_SCOPE, 0, t, BT, 9, &b);
        if (st == KVH_OK) {
            uint64_t h, mine;
            kvh_block_info bi;
            bi.struct_size = sizeof(bi);
            if (kvh_prefix_hash_scoped(w->e, PROBER_SCOPE, 0, t, BT, &mine) != KVH_OK ||
                kvh_block_info_get(w->e, b, &bi) != KVH_OK || bi.hash != mine)
                mt_report(w, "offloaded block is not of the prober's scope");
            for (int s = 0; s < TENANTS; s++)
                if (kvh_prefix_hash_scoped(w->e, SCOPE_OF[s], 0, t, BT, &h) == KVH_OK && h == bi.hash)
                    mt_report(w, "prober's block has tenant %d's hash", s);
            kvh_block_release(w->e, b);
        } else if (st != KVH_ERR_NOSPACE) {
            mt_report(w, "offload: %s (%s)", kvh_status_name(st), kvh_last_error());
        }
    }
    kvh_pool_unregister(w->e, pool);
out:
    for (uint32_t l = 0; l < L; l++) {
        free(kb[l]);
        free(vb[l]);
    }
}

static void *worker(void *arg)
{
    mt_worker *w = arg;
    if (w->t < TENANTS)
        tenant(w);
    else
        prober(w);
    return NULL;
}

static void test_tenants_race_each_other(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("scope_mt", dir, sizeof(dir));
    dt_rmrf(dir);
    const dt_geo g = {L, H, D, BT, KVH_DTYPE_F32};
    kvh_config c = dt_cfg(g, dir, 6, 6, 256, 2);
    kvh_engine *e = dt_open_a(&c);
    atomic_store(&stop, 0);
    double seconds = (double)dt_env_long("KVH_SCOPE_MT_MS", 1500) / 1000.0;
    mt_worker w[TENANTS + 1];
    mt_run_for(e, TENANTS + 1, worker, w, seconds, &stop);
    print_message("%" PRIu64 " matches with a hit, %" PRIu64 " without, %" PRIu64 " probes\n", atomic_load(&hits),
                  atomic_load(&misses), atomic_load(&probes));
    assert_true(atomic_load(&hits) > 0 && atomic_load(&probes) > 0);
    assert_ok(dt_close(e));
    /* After a restart, each scope's persisted prompts are its own. */
    e = dt_open_a(&c);
    for (int s = 0; s < TENANTS; s++)
        for (int p = 0; p < PROMPTS; p++) {
            int32_t t[N];
            prompt(p, t);
            kvh_seq q = tu_seq_new(e, 0);
            assert_ok(kvh_seq_set_scope(e, q, SCOPE_OF[s], SCOPE_OF[s], 0));
            size_t m = 0;
            assert_ok(kvh_seq_match_prefix(e, q, t, N, &m));
            if (m)
                assert_true(tu_check_pattern(e, q, L, TOKB, tag_of(SCOPE_OF[s], p), 0, m));
            assert_ok(kvh_seq_free(e, q));
        }
    assert_ok(dt_close(e));
}

static int teardown(void **state)
{
    dt_teardown(state);
    return tu_teardown(state);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_tenants_race_each_other, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
