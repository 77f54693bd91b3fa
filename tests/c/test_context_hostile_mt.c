/* Weight contexts from several threads at once, against a hostile caller,
 * from kvh.h's promises alone: kvh_context_switch, _wait_layer,
 * _region_data, _verify and _info_get are "@threads any", so two threads
 * switch between two models (and to nothing) at the same time, with and
 * without fences, a third creates, loads and destroys a third context
 * again and again, and a fourth asks every question about all three
 * (including the one being destroyed). Every status must be one the
 * header lists; afterwards every weight byte of both models is what was
 * registered. */
#include <fcntl.h>
#include <stdatomic.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test_util.h"
#include "disk_test_util.h"
#include "mt_util.h"

enum { L = 2, H = 2, D = 4, BT = 4, REGIONS = 4, RSIZE = 1500, FILE_BYTES = REGIONS * RSIZE };

typedef struct model {
    kvh_context c;
    uint8_t bytes[REGIONS][RSIZE];
} model;

static model *A, *B;
static _Atomic uint64_t churn_ctx; /* the third context's handle (or a stale one) */
static _Atomic int stop;
static _Atomic uint64_t switches, busy_destroys;

static void load(kvh_engine *e, model *m, const char *path, uint64_t seed)
{
    kvh_context_params cp;
    assert_ok(kvh_context_params_init(&cp, sizeof(cp)));
    cp.chunk_bytes = 512;
    assert_ok(kvh_context_create(e, &cp, &m->c));
    uint8_t file[FILE_BYTES];
    tu_rng r = {seed};
    tu_fill(&r, file, sizeof(file));
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, file, sizeof(file)), (ssize_t)sizeof(file));
    close(fd);
    for (uint32_t i = 0; i < REGIONS; i++) {
        kvh_weight_region_params rp;
        assert_ok(kvh_weight_region_params_init(&rp, sizeof(rp)));
        rp.size = RSIZE;
        rp.layer = i;
        if (i % 2) {
            tu_fill(&r, m->bytes[i], RSIZE);
            rp.bytes = m->bytes[i];
        } else {
            memcpy(m->bytes[i], file + i * RSIZE, RSIZE);
            rp.path = path;
            rp.file_offset = (uint64_t)i * RSIZE;
        }
        uint32_t idx;
        assert_ok(kvh_context_add_region(e, m->c, &rp, &idx));
    }
}

static int allowed(kvh_status st, const kvh_status *ok, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (st == ok[i])
            return 1;
    return 0;
}

#define EXPECT(w, st, what, ...)                                                                                       \
    do {                                                                                                               \
        const kvh_status ok_[] = {__VA_ARGS__};                                                                        \
        if (!allowed(st, ok_, sizeof(ok_) / sizeof(ok_[0])))                                                           \
            mt_report(w, "%s: %s (%s)", what, kvh_status_name(st), kvh_last_error());                                  \
    } while (0)

static kvh_context pick(tu_rng *r)
{
    switch (tu_below(r, 4)) {
    case 0:
        return (kvh_context){0};
    case 1:
        return A->c;
    case 2:
        return B->c;
    default:
        return (kvh_context){atomic_load(&churn_ctx)};
    }
}

static void switcher(mt_worker *w)
{
    tu_rng r = {tu_seed(0x5a17) + (uint64_t)w->t};
    while (!atomic_load(&stop) && !w->errors) {
        kvh_context from = pick(&r), to = pick(&r);
        if (from.id == to.id)
            continue;
        kvh_fence f = {0};
        int with_fence = (int)tu_below(&r, 2);
        kvh_status st = kvh_context_switch(w->e, from, to, with_fence ? &f : NULL);
        atomic_fetch_add(&switches, 1);
        /* The churned context may be gone (BAD_HANDLE) or be destroyed
         * under the switch; room may lack while the other switcher loads. */
        EXPECT(w, st, "switch", KVH_OK, KVH_ERR_NOSPACE, KVH_ERR_BAD_HANDLE);
        if (with_fence && st == KVH_OK) {
            st = kvh_fence_wait(w->e, f, tu_below(&r, 2) ? UINT64_MAX : 1000);
            EXPECT(w, st, "switch fence", KVH_OK, KVH_ERR_TIMEOUT, KVH_ERR_NOSPACE, KVH_ERR_BAD_HANDLE);
            st = kvh_fence_free(w->e, f);
            EXPECT(w, st, "fence_free", KVH_OK);
        }
    }
}

static void churner(mt_worker *w)
{
    tu_rng r = {tu_seed(0xc4u) + 99};
    uint8_t bytes[700];
    tu_fill(&r, bytes, sizeof(bytes));
    while (!atomic_load(&stop) && !w->errors) {
        kvh_context c;
        kvh_status st = kvh_context_create(w->e, NULL, &c);
        EXPECT(w, st, "create", KVH_OK);
        if (st != KVH_OK)
            return;
        for (int i = 0; i < 2; i++) {
            kvh_weight_region_params rp;
            kvh_weight_region_params_init(&rp, sizeof(rp));
            rp.bytes = bytes;
            rp.size = sizeof(bytes);
            uint32_t idx;
            st = kvh_context_add_region(w->e, c, &rp, &idx);
            EXPECT(w, st, "add_region", KVH_OK, KVH_ERR_NOSPACE, KVH_ERR_BUSY);
        }
        atomic_store(&churn_ctx, c.id);
        dt_sleep_ms(0.2);
        for (;;) {
            st = kvh_context_destroy(w->e, c);
            if (st != KVH_ERR_BUSY)
                break;
            atomic_fetch_add(&busy_destroys, 1);
            dt_sleep_ms(0.05);
        }
        EXPECT(w, st, "destroy", KVH_OK);
    }
}

static void prober(mt_worker *w)
{
    tu_rng r = {tu_seed(0x9b) + 7};
    while (!atomic_load(&stop) && !w->errors) {
        kvh_context c = pick(&r);
        if (!c.id)
            continue;
        void *d;
        uint64_t size;
        kvh_status st = kvh_context_region_data(w->e, c, (uint32_t)tu_below(&r, REGIONS + 1), 0, &d, &size);
        EXPECT(w, st, "region_data", KVH_OK, KVH_ERR_NOT_RESIDENT, KVH_ERR_BUSY, KVH_ERR_RANGE, KVH_ERR_BAD_HANDLE);
        st = kvh_context_wait_layer(w->e, c, (uint32_t)tu_below(&r, REGIONS), tu_below(&r, 2) ? 0 : 100000);
        EXPECT(w, st, "wait_layer", KVH_OK, KVH_ERR_TIMEOUT, KVH_ERR_NOT_RESIDENT, KVH_ERR_BAD_HANDLE, KVH_ERR_NOSPACE);
        uint64_t checked;
        st = kvh_context_verify(w->e, c, &checked);
        EXPECT(w, st, "verify", KVH_OK, KVH_ERR_BUSY, KVH_ERR_BAD_HANDLE);
        kvh_context_info ci;
        ci.struct_size = sizeof(ci);
        st = kvh_context_info_get(w->e, c, &ci);
        EXPECT(w, st, "info", KVH_OK, KVH_ERR_BAD_HANDLE);
        if (st == KVH_OK && ci.bytes_device + ci.bytes_host + ci.bytes_disk > ci.weight_bytes)
            mt_report(w, "info: %" PRIu64 " bytes resident of %" PRIu64,
                      ci.bytes_device + ci.bytes_host + ci.bytes_disk, ci.weight_bytes);
    }
}

static void *worker(void *arg)
{
    mt_worker *w = arg;
    if (w->t < 2)
        switcher(w);
    else if (w->t == 2)
        churner(w);
    else
        prober(w);
    return NULL;
}

static void check_model(kvh_engine *e, model *m)
{
    assert_ok(kvh_context_switch(e, (kvh_context){0}, m->c, NULL));
    for (uint32_t i = 0; i < REGIONS; i++) {
        void *d;
        uint64_t size;
        assert_ok(kvh_context_region_data(e, m->c, i, 0, &d, &size));
        assert_int_equal(size, RSIZE);
        assert_memory_equal(d, m->bytes[i], RSIZE);
    }
    assert_ok(kvh_context_verify(e, m->c, NULL));
    assert_ok(kvh_context_switch(e, m->c, (kvh_context){0}, NULL));
}

static void test_switches_race_each_other(void **state)
{
    (void)state;
    /* 256-byte slots: a model takes 24; the device tier holds one. */
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F32, 40, 400, 2);
    kvh_engine *e = tu_open_cfg(&c);
    char pa[600], pb[600];
    const char *dir = getenv("KVH_TEST_TMPDIR");
    snprintf(pa, sizeof(pa), "%s/ctx_mt_a.bin", dir && dir[0] ? dir : "/tmp");
    snprintf(pb, sizeof(pb), "%s/ctx_mt_b.bin", dir && dir[0] ? dir : "/tmp");
    A = tu_alloc(sizeof(model));
    B = tu_alloc(sizeof(model));
    load(e, A, pa, 1);
    load(e, B, pb, 2);
    atomic_store(&stop, 0);
    atomic_store(&churn_ctx, 0);
    double seconds = (double)dt_env_long("KVH_CONTEXT_MT_MS", 1500) / 1000.0;
    mt_worker w[4];
    mt_run_for(e, 4, worker, w, seconds, &stop);
    print_message("%" PRIu64 " switches, %" PRIu64 " destroys refused while busy\n", atomic_load(&switches),
                  atomic_load(&busy_destroys));
    assert_true(atomic_load(&switches) > 0);
    /* Unload whatever is loaded, then each model alone: its bytes. */
    kvh_status st = kvh_context_switch(e, A->c, (kvh_context){0}, NULL);
    assert_true(st == KVH_OK);
    assert_ok(kvh_context_switch(e, B->c, (kvh_context){0}, NULL));
    check_model(e, A);
    check_model(e, B);
    assert_ok(kvh_context_destroy(e, A->c));
    assert_ok(kvh_context_destroy(e, B->c));
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, 0);
    assert_int_equal(tu_tier(e, KVH_TIER_HOST).used_blocks, 0);
}

/* Large file regions, a device tier that holds one model and a host tier
 * too small to keep the leaving one: each switch drops the leaving
 * model's regions while the arriving one's two threads charge the device
 * tier (their slot list once overflowed when both grew it). Reads of the
 * leaving model while it leaves are refused (KVH_ERR_BUSY) or exact,
 * never bytes of the arriving one. */
enum { BIG = 1 << 20, BIG_REGIONS = 4 };

static void add_big_regions(kvh_engine *e, kvh_context *ctx, const char *path, const uint8_t *bytes)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, bytes, (size_t)BIG * BIG_REGIONS), (ssize_t)BIG * BIG_REGIONS);
    close(fd);
    kvh_context_params cp;
    assert_ok(kvh_context_params_init(&cp, sizeof(cp)));
    assert_ok(kvh_context_create(e, &cp, ctx));
    for (uint32_t l = 0; l < BIG_REGIONS; l++) {
        kvh_weight_region_params rp;
        assert_ok(kvh_weight_region_params_init(&rp, sizeof(rp)));
        rp.layer = l;
        rp.size = BIG;
        rp.path = path;
        rp.file_offset = (uint64_t)l * BIG;
        uint32_t idx;
        assert_ok(kvh_context_add_region(e, *ctx, &rp, &idx));
    }
}

static void test_reads_race_a_switch_away(void **state)
{
    (void)state;
    kvh_config c = tu_cfg(1, 1, 8, 4, KVH_DTYPE_F32, 0, 0, 1);
    c.device_bytes = (uint64_t)BIG * BIG_REGIONS + (64 << 10);
    c.host_bytes = 16 << 10;
    kvh_engine *e = tu_open_cfg(&c);
    const char *dir = getenv("KVH_TEST_TMPDIR");
    char pa[600], pb[600];
    snprintf(pa, sizeof(pa), "%s/ctx_big_a.bin", dir && dir[0] ? dir : "/tmp");
    snprintf(pb, sizeof(pb), "%s/ctx_big_b.bin", dir && dir[0] ? dir : "/tmp");
    uint8_t *bytes[2] = {tu_alloc((size_t)BIG * BIG_REGIONS), tu_alloc((size_t)BIG * BIG_REGIONS)};
    for (size_t i = 0; i < (size_t)BIG * BIG_REGIONS; i++) {
        bytes[0][i] = (uint8_t)(i % 251);
        bytes[1][i] = (uint8_t)(255 - i % 241);
    }
    kvh_context ctx[2];
    add_big_regions(e, &ctx[0], pa, bytes[0]);
    add_big_regions(e, &ctx[1], pb, bytes[1]);
    assert_ok(kvh_context_switch(e, (kvh_context){0}, ctx[0], NULL));
    long refused = 0, exact = 0;
    for (int round = 0; round < 200; round++) {
        int from = round % 2, to = 1 - from;
        kvh_fence f;
        assert_ok(kvh_context_switch(e, ctx[from], ctx[to], &f));
        for (int i = 0; i < 64; i++) {
            uint32_t region = 3 - (uint32_t)(i % 4);
            void *d;
            uint64_t size;
            kvh_status st = kvh_context_region_data(e, ctx[from], region, 0, &d, &size);
            if (st == KVH_OK) {
                assert_memory_equal(d, bytes[from] + (size_t)region * BIG, BIG);
                exact++;
            } else {
                assert_true(st == KVH_ERR_BUSY || st == KVH_ERR_NOT_RESIDENT);
                refused++;
            }
            int32_t done = 0;
            assert_ok(kvh_fence_poll(e, f, &done));
            if (done)
                break;
        }
        assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
        assert_ok(kvh_fence_free(e, f));
        for (uint32_t region = 0; region < BIG_REGIONS; region++) {
            void *d;
            uint64_t size;
            assert_ok(kvh_context_region_data(e, ctx[to], region, 0, &d, &size));
            assert_memory_equal(d, bytes[to] + (size_t)region * BIG, BIG);
        }
    }
    print_message("reads during a switch away: %ld refused, %ld exact\n", refused, exact);
    assert_true(refused > 0);
    assert_ok(kvh_context_destroy(e, ctx[0]));
    assert_ok(kvh_context_destroy(e, ctx[1]));
    tu_free(bytes[0]);
    tu_free(bytes[1]);
}

/* kvh_context_verify reads a region with the lock dropped; KV taking
 * host room on another thread drops clean host copies of weights, which
 * must not free the one being verified (it did: a read of freed memory,
 * or a false KVH_ERR_CORRUPT). */
enum { VERIFY_REGION = 64 << 10 };
static kvh_engine *verify_engine;
static kvh_context verify_ctx;
static _Atomic long verify_ok;

static void *verify_in_a_loop(void *arg)
{
    (void)arg;
    while (!atomic_load(&stop)) {
        uint64_t chunks = 0;
        kvh_status st = kvh_context_verify(verify_engine, verify_ctx, &chunks);
        if (st == KVH_OK)
            atomic_fetch_add(&verify_ok, 1);
        else if (st != KVH_ERR_BUSY)
            fail_msg("verify of an unchanged region: %s (%s)", kvh_status_name(st), kvh_last_error());
    }
    return NULL;
}

static void test_verify_races_kv_taking_host_room(void **state)
{
    (void)state;
    /* 1 KiB blocks: 8 sequences of 128 tokens want 256 KiB, all of both
     * tiers. */
    kvh_config c = tu_cfg(2, 2, 8, 4, KVH_DTYPE_F32, 0, 0, 1);
    c.device_bytes = 128 << 10;
    c.host_bytes = 128 << 10;
    verify_engine = tu_open_cfg(&c);
    const char *dir = getenv("KVH_TEST_TMPDIR");
    char path[600];
    snprintf(path, sizeof(path), "%s/ctx_verify.bin", dir && dir[0] ? dir : "/tmp");
    uint8_t *bytes = tu_alloc(VERIFY_REGION);
    for (size_t i = 0; i < VERIFY_REGION; i++)
        bytes[i] = (uint8_t)(i * 13);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, bytes, VERIFY_REGION), VERIFY_REGION);
    close(fd);
    kvh_context_params cp;
    assert_ok(kvh_context_params_init(&cp, sizeof(cp)));
    cp.chunk_bytes = 4096;
    assert_ok(kvh_context_create(verify_engine, &cp, &verify_ctx));
    kvh_weight_region_params rp;
    assert_ok(kvh_weight_region_params_init(&rp, sizeof(rp)));
    rp.size = VERIFY_REGION;
    rp.path = path; /* clean and file-backed: dropped for room, never written */
    uint32_t idx;
    assert_ok(kvh_context_add_region(verify_engine, verify_ctx, &rp, &idx));
    atomic_store(&stop, 0);
    atomic_store(&verify_ok, 0);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, verify_in_a_loop, NULL), 0);
    double until = tu_now() + 3.0;
    long rounds = 0;
    while (tu_now() < until || atomic_load(&verify_ok) < 10) {
        /* In and away again: the clean copy stays in the host tier... */
        kvh_status st = kvh_context_switch(verify_engine, (kvh_context){0}, verify_ctx, NULL);
        assert_true(st == KVH_OK || st == KVH_ERR_NOSPACE);
        st = kvh_context_switch(verify_engine, verify_ctx, (kvh_context){0}, NULL);
        assert_true(st == KVH_OK || st == KVH_ERR_NOSPACE);
        /* ...until KV wanting all of memory drops it. */
        kvh_seq s[8];
        for (int i = 0; i < 8; i++) {
            assert_ok(kvh_seq_create(verify_engine, 0, &s[i]));
            int32_t t[128];
            for (int j = 0; j < 128; j++)
                t[j] = (int32_t)(rounds * 100000 + i * 1000 + j);
            st = kvh_seq_append(verify_engine, s[i], t, 128);
            assert_true(st == KVH_OK || st == KVH_ERR_NOSPACE);
        }
        for (int i = 0; i < 8; i++)
            assert_ok(kvh_seq_free(verify_engine, s[i]));
        rounds++;
    }
    atomic_store(&stop, 1);
    assert_int_equal(pthread_join(th, NULL), 0);
    print_message("%ld rounds, %ld verifies passed\n", rounds, atomic_load(&verify_ok));
    assert_ok(kvh_context_destroy(verify_engine, verify_ctx));
    unlink(path);
    tu_free(bytes);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_switches_race_each_other, tu_teardown),
        cmocka_unit_test_teardown(test_reads_race_a_switch_away, tu_teardown),
        cmocka_unit_test_teardown(test_verify_races_kv_taking_host_room, tu_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
