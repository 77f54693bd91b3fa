/* Weight contexts against a hostile caller, from kvh.h's promises alone
 * ("Weight contexts"): a file range whose end wraps past 2^64 is no range
 * of the file; many tiny regions; a switch ping-pong that pins, unpins
 * and writes regions keeps every weight byte (checked against a copy the
 * test keeps) and every KV byte; a context destroyed while a switch
 * involving it runs gets KVH_ERR_BUSY and nothing else changes; a
 * destroyed context's handle is refused by every call; sequences freed,
 * forged or of another engine attach or are skipped as documented; and
 * waits on layers answer timeouts of 0 and UINT64_MAX. test_context.c's
 * checks (argument checks, write-back, corrupt sources) are not repeated. */
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test_util.h"
#include "context_test_util.h"

enum { L = 2, H = 2, D = 4, BT = 4 };
static const size_t TOK = H * D * 4;
enum { FILE_BYTES = 16384, REGIONS = 6, RSIZE = 1500 };

static uint32_t threads_of(void **state) { return (uint32_t)(uintptr_t)*state; }

static const char *scratch(const char *name, char *buf, size_t len)
{
    const char *d = getenv("KVH_TEST_TMPDIR");
    snprintf(buf, len, "%s/%s", d && d[0] ? d : "/tmp", name);
    return buf;
}

static kvh_context new_ctx(kvh_engine *e, uint32_t policy)
{
    kvh_context_params cp;
    assert_ok(kvh_context_params_init(&cp, sizeof(cp)));
    cp.kv_policy = policy;
    cp.chunk_bytes = 512;
    kvh_context c;
    assert_ok(kvh_context_create(e, &cp, &c));
    return c;
}

static kvh_status add_file_region(kvh_engine *e, kvh_context c, const char *path, uint64_t off, uint64_t size,
                                  uint32_t layer, uint32_t *idx)
{
    kvh_weight_region_params rp;
    assert_ok(kvh_weight_region_params_init(&rp, sizeof(rp)));
    rp.path = path;
    rp.file_offset = off;
    rp.size = size;
    rp.layer = layer;
    return kvh_context_add_region(e, c, &rp, idx);
}

/* ---- a file range that wraps ---- */

static void test_file_range_that_wraps_is_refused(void **state)
{
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F32, 64, 64, threads_of(state));
    char p[600];
    ct_write_weights(scratch("wrap.bin", p, sizeof(p)), 1, FILE_BYTES);
    kvh_context c = new_ctx(e, KVH_CONTEXT_KV_KEEP);
    uint32_t idx = 77;
    /* offset + size wraps to a small number inside the file. */
    const struct {
        uint64_t off, size;
    } bad[] = {
        {UINT64_MAX, 2}, {UINT64_MAX - 99, 200}, {1ull << 63, 1ull << 63}, {UINT64_MAX - 1, 16},
        {FILE_BYTES, 1}, {0, FILE_BYTES + 1},    {FILE_BYTES - 1, 2},      {UINT64_MAX, UINT64_MAX},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        kvh_status st = add_file_region(e, c, p, bad[i].off, bad[i].size, 0, &idx);
        if (st != KVH_ERR_IO)
            fail_msg("range [%" PRIu64 ", +%" PRIu64 ") of a %d-byte file: %s", bad[i].off, bad[i].size, FILE_BYTES,
                     kvh_status_name(st));
        assert_int_equal(idx, 77);
    }
    assert_int_equal(ct_context_info(e, c).regions, 0);
    /* The whole file and its last byte are fine. */
    assert_ok(add_file_region(e, c, p, 0, FILE_BYTES, 0, &idx));
    assert_int_equal(idx, 0);
    assert_ok(add_file_region(e, c, p, FILE_BYTES - 1, 1, 0, &idx));
    assert_int_equal(idx, 1);
    assert_ok(kvh_context_switch(e, (kvh_context){0}, c, NULL));
    assert_ok(kvh_context_verify(e, c, NULL));
}

/* ---- a region larger than any tier ---- */

/* Sizes no tier can hold, up to 2^64 - 1 (with chunks of one byte, whose
 * count would not fit 32 bits): KVH_ERR_NOSPACE before anything is read
 * from the (shorter) buffer, charged or allocated; the context and the
 * tiers are as before, and an honest region still goes in. */
static void test_region_larger_than_any_tier_is_refused(void **state)
{
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F32, 64, 64, threads_of(state));
    uint64_t block_bytes = 2ull * L * BT * TOK, host_bytes = 64 * block_bytes;
    static uint8_t buf[4096];
    const uint64_t sizes[] = {host_bytes + 1, 1ull << 40, UINT64_MAX - 100, UINT64_MAX};
    for (int chunk_one = 0; chunk_one < 2; chunk_one++) {
        kvh_context_params cp;
        assert_ok(kvh_context_params_init(&cp, sizeof(cp)));
        cp.chunk_bytes = chunk_one ? 1 : 4096;
        kvh_context c;
        assert_ok(kvh_context_create(e, &cp, &c));
        for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
            kvh_weight_region_params rp;
            assert_ok(kvh_weight_region_params_init(&rp, sizeof(rp)));
            rp.bytes = buf;
            rp.size = sizes[i];
            uint32_t idx = 77;
            kvh_status st = kvh_context_add_region(e, c, &rp, &idx);
            if (st != KVH_ERR_NOSPACE)
                fail_msg("a %" PRIu64 "-byte region (chunks of %" PRIu64 "): %s", sizes[i], cp.chunk_bytes,
                         kvh_status_name(st));
            assert_true(strlen(kvh_last_error()) > 0);
            assert_int_equal(idx, 77);
            kvh_context_info ci = ct_context_info(e, c);
            assert_int_equal(ci.regions, 0);
            assert_int_equal(ci.weight_bytes, 0);
            assert_int_equal(ci.bytes_host, 0);
            kvh_weight_stats ws = ct_weight_stats(e);
            assert_int_equal(ws.bytes_host, 0);
            assert_int_equal(ws.slots_host, 0);
            assert_int_equal(ws.slots_device, 0);
        }
        kvh_weight_region_params rp;
        assert_ok(kvh_weight_region_params_init(&rp, sizeof(rp)));
        rp.bytes = buf;
        rp.size = sizeof(buf);
        uint32_t idx = 77;
        assert_ok(kvh_context_add_region(e, c, &rp, &idx));
        assert_int_equal(idx, 0);
        kvh_context_info ci = ct_context_info(e, c);
        assert_int_equal(ci.weight_bytes, sizeof(buf));
        assert_int_equal(ci.bytes_host, sizeof(buf));
        assert_ok(kvh_context_switch(e, (kvh_context){0}, c, NULL));
        void *d = NULL;
        uint64_t size = 0;
        assert_ok(kvh_context_region_data(e, c, 0, 0, &d, &size));
        assert_int_equal(size, sizeof(buf));
        assert_memory_equal(d, buf, sizeof(buf));
        assert_ok(kvh_context_switch(e, c, (kvh_context){0}, NULL));
        assert_ok(kvh_context_destroy(e, c));
    }
    assert_int_equal(tu_tier(e, KVH_TIER_HOST).used_blocks, 0);
}

/* ---- switches that keep every byte ---- */

typedef struct weights {
    kvh_context c;
    const uint8_t *file;
    uint8_t mine[REGIONS][RSIZE]; /* what each region must hold */
} weights;

static void load_weights(kvh_engine *e, weights *w, const char *path, uint64_t seed)
{
    w->c = new_ctx(e, KVH_CONTEXT_KV_DEMOTE);
    w->file = ct_write_weights(path, seed, FILE_BYTES);
    for (uint32_t i = 0; i < REGIONS; i++) {
        uint32_t idx;
        if (i % 2) { /* from bytes */
            tu_rng r = {seed * 100 + i};
            tu_fill(&r, w->mine[i], RSIZE);
            kvh_weight_region_params rp;
            assert_ok(kvh_weight_region_params_init(&rp, sizeof(rp)));
            rp.bytes = w->mine[i];
            rp.size = RSIZE;
            rp.layer = REGIONS - i; /* registered against the load order */
            assert_ok(kvh_context_add_region(e, w->c, &rp, &idx));
        } else {
            memcpy(w->mine[i], w->file + i * RSIZE + 7, RSIZE);
            assert_ok(add_file_region(e, w->c, path, (uint64_t)i * RSIZE + 7, RSIZE, REGIONS - i, &idx));
        }
        assert_int_equal(idx, i);
    }
}

static void check_weights(kvh_engine *e, weights *w, int round)
{
    for (uint32_t i = 0; i < REGIONS; i++) {
        void *d = NULL;
        uint64_t size = 0;
        assert_ok(kvh_context_region_data(e, w->c, i, 0, &d, &size));
        assert_int_equal(size, RSIZE);
        if (memcmp(d, w->mine[i], RSIZE) != 0)
            fail_msg("round %d: region %u lost its bytes", round, i);
    }
}

static kvh_seq kv_of(kvh_engine *e, kvh_context c, uint64_t tag)
{
    kvh_seq s = tu_seq_new(e, (uint32_t)tag);
    int32_t t[3 * BT];
    tu_iota(t, 3 * BT, (int32_t)(tag * 1000));
    assert_ok(kvh_seq_append(e, s, t, 3 * BT));
    tu_write_pattern(e, s, L, TOK, tag, 0, 3 * BT);
    assert_ok(kvh_context_attach_seq(e, c, s));
    return s;
}

static void test_ping_pong_keeps_every_byte(void **state)
{
    /* kvh.h: each region is charged its size in whole pages, a context
     * the slots of its regions' pages together: with 4096-byte pages and
     * slots of 512 bytes a region takes 8 and a context 48. A switch away leaves the
     * pinned regions in the device tier, and the test pins at random (all
     * of a context's regions, with some seeds), so the device tier holds
     * the arriving context, every region of the other one and 12 slots of
     * KV; the host tier holds both contexts and all the KV. */
    const uint64_t bb = tu_block_bytes_of(L, H, D, BT, KVH_DTYPE_F32);
    const uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    const uint64_t ctx_slots = (REGIONS * ((RSIZE + page - 1) / page * page) + bb - 1) / bb;
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F32, 2 * ctx_slots + 12, 200, threads_of(state));
    char pa[600], pb[600];
    weights *a = tu_alloc(sizeof(weights)), *b = tu_alloc(sizeof(weights));
    load_weights(e, a, scratch("pp_a.bin", pa, sizeof(pa)), 3);
    load_weights(e, b, scratch("pp_b.bin", pb, sizeof(pb)), 4);
    kvh_seq sa = kv_of(e, a->c, 1), sb = kv_of(e, b->c, 2);
    kvh_context none = {0}, from = none;
    tu_rng r = {tu_seed(0xc0de)};
    for (int round = 0; round < 24; round++) {
        weights *to = round % 2 ? b : a;
        kvh_fence f = {0};
        int with_fence = (int)tu_below(&r, 2);
        assert_ok(kvh_context_switch(e, from, to->c, with_fence ? &f : NULL));
        if (with_fence) {
            kvh_status w0 = kvh_context_wait_layer(e, to->c, 0, 0);
            assert_true(w0 == KVH_OK || w0 == KVH_ERR_TIMEOUT);
            assert_ok(kvh_context_wait_layer(e, to->c, UINT32_MAX, UINT64_MAX));
            assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
            assert_ok(kvh_fence_free(e, f));
        }
        kvh_context_info ci = ct_context_info(e, to->c);
        assert_int_equal(ci.layers_ready, REGIONS);
        assert_int_equal(ci.bytes_device, (uint64_t)REGIONS * RSIZE);
        check_weights(e, to, round);
        /* Write into one region (it must come back as written), pin or
         * unpin another. */
        uint32_t wi = (uint32_t)tu_below(&r, REGIONS);
        uint8_t *d;
        assert_ok(kvh_context_region_data(e, to->c, wi, 1, (void **)&d, NULL));
        for (int k = 0; k < 16; k++) {
            size_t at = (size_t)tu_below(&r, RSIZE);
            d[at] ^= (uint8_t)(1 + tu_below(&r, 255));
            to->mine[wi][at] = d[at];
        }
        assert_ok(kvh_context_region_pin(e, to->c, (uint32_t)tu_below(&r, REGIONS), (int32_t)tu_below(&r, 2)));
        assert_kvh(KVH_ERR_RANGE, kvh_context_region_pin(e, to->c, REGIONS, 1));
        assert_kvh(KVH_ERR_RANGE, kvh_context_region_data(e, to->c, UINT32_MAX, 0, (void **)&d, NULL));
        kvh_status vs = kvh_context_verify(e, to->c, NULL);
        assert_ok(vs);
        /* The other context's weights are not all on the device: its
         * layers cannot be waited for (no switch loads them). */
        weights *other = to == a ? b : a;
        if (ct_context_info(e, other->c).layers_ready < REGIONS)
            assert_kvh(KVH_ERR_NOT_RESIDENT, kvh_context_wait_layer(e, other->c, UINT32_MAX, 0));
        from = to->c;
    }
    assert_true(tu_check_pattern(e, sa, L, TOK, 1, 0, 3 * BT));
    assert_true(tu_check_pattern(e, sb, L, TOK, 2, 0, 3 * BT));
    /* Unload all, then load each again: still their bytes. */
    assert_ok(kvh_context_switch(e, from, none, NULL));
    for (int k = 0; k < 2; k++) {
        weights *w = k ? b : a;
        for (uint32_t i = 0; i < REGIONS; i++)
            assert_ok(kvh_context_region_pin(e, w->c, i, 0));
        assert_ok(kvh_context_switch(e, none, w->c, NULL));
        check_weights(e, w, 100 + k);
        assert_ok(kvh_context_switch(e, w->c, none, NULL));
    }
}

/* ---- destroy under a running switch; stale handles ---- */

static void test_destroy_during_switch_and_after(void **state)
{
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F32, 60, 200, threads_of(state));
    char pa[600];
    weights *a = tu_alloc(sizeof(weights));
    load_weights(e, a, scratch("destroy_a.bin", pa, sizeof(pa)), 5);
    kvh_seq s = kv_of(e, a->c, 3);
    kvh_fence f;
    assert_ok(kvh_context_switch(e, (kvh_context){0}, a->c, &f));
    kvh_status st = kvh_context_destroy(e, a->c);
    /* Either the switch had ended (destroyed) or it runs (BUSY, kept). */
    assert_true(st == KVH_OK || st == KVH_ERR_BUSY);
    assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
    assert_ok(kvh_fence_free(e, f));
    if (st == KVH_ERR_BUSY) {
        check_weights(e, a, 0);
        assert_ok(kvh_context_destroy(e, a->c));
    }
    /* Every call refuses the destroyed handle. */
    kvh_context c = a->c;
    void *d;
    uint32_t idx;
    kvh_weight_region_params rp;
    assert_ok(kvh_weight_region_params_init(&rp, sizeof(rp)));
    uint8_t one = 1;
    rp.bytes = &one;
    rp.size = 1;
    kvh_context_info ci;
    ci.struct_size = sizeof(ci);
    uint64_t checked = 99;
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_add_region(e, c, &rp, &idx));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_attach_seq(e, c, s));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_switch(e, (kvh_context){0}, c, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_switch(e, c, (kvh_context){0}, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_wait_layer(e, c, 0, 0));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_wait_layer(e, c, 0, UINT64_MAX));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_region_data(e, c, 0, 0, &d, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_region_pin(e, c, 0, 1));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_verify(e, c, &checked));
    assert_int_equal(checked, 99);
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_info_get(e, c, &ci));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_destroy(e, c));
    /* Handles of another type, and a context of another engine. */
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_info_get(e, (kvh_context){s.id}, &ci));
    kvh_engine *e2 = tu_open(L, H, D, BT, KVH_DTYPE_F32, 8, 8, 0);
    kvh_context c2 = new_ctx(e2, KVH_CONTEXT_KV_KEEP);
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_info_get(e, c2, &ci));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_switch(e, (kvh_context){0}, c2, NULL));
    kvh_seq foreign = tu_seq_new(e2, 0);
    kvh_context c3 = new_ctx(e, KVH_CONTEXT_KV_DEMOTE);
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_attach_seq(e, c3, foreign));
    tu_close(e2);
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_info_get(e, c2, &ci));
    /* Attached twice, to two contexts, then freed: skipped, not counted. */
    assert_ok(kvh_context_attach_seq(e, c3, s));
    kvh_status twice = kvh_context_attach_seq(e, c3, s);
    assert_true(twice == KVH_OK);
    assert_ok(kvh_seq_free(e, s));
    assert_int_equal(ct_context_info(e, c3).seqs, 0);
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_attach_seq(e, c3, s));
    assert_ok(kvh_context_switch(e, (kvh_context){0}, c3, NULL));
    assert_ok(kvh_context_switch(e, c3, (kvh_context){0}, NULL));
    assert_ok(kvh_context_destroy(e, c3));
}

/* ---- close with a switch in flight ---- */

static void test_close_during_a_switch(void **state)
{
    for (int round = 0; round < 6; round++) {
        kvh_config cfg = tu_cfg(L, H, D, BT, KVH_DTYPE_F32, 60, 200, threads_of(state));
        kvh_engine *e;
        assert_ok(kvh_engine_open(&cfg, &e));
        char pa[600], pb[600];
        weights *a = tu_alloc(sizeof(weights)), *b = tu_alloc(sizeof(weights));
        load_weights(e, a, scratch("close_a.bin", pa, sizeof(pa)), 7);
        load_weights(e, b, scratch("close_b.bin", pb, sizeof(pb)), 8);
        kv_of(e, a->c, 1);
        kvh_fence f;
        assert_ok(kvh_context_switch(e, (kvh_context){0}, a->c, NULL));
        /* Leaves the fence and the switch to the close. */
        assert_ok(kvh_context_switch(e, a->c, b->c, &f));
        if (round % 2)
            (void)kvh_context_wait_layer(e, b->c, 0, 0);
        assert_ok(kvh_engine_close(e));
        tu_free(a);
        tu_free(b);
    }
}

/* ---- many tiny regions ---- */

/* kvh.h: each region is an allocation of its own, charged whole pages of
 * the system's page size, so 1-byte regions take a page each: all of them fit the host
 * tier, and a switch of more regions than the device tier has pages
 * reports NOSPACE before it moves any. */
static void test_many_tiny_regions(void **state)
{
    enum { N = 1500 };
    const uint64_t ps =
        (uint64_t)sysconf(_SC_PAGESIZE) / tu_block_bytes_of(L, H, D, BT, KVH_DTYPE_F32); /* slots a page */
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F32, 64 * ps, (N + 100) * ps, threads_of(state));
    kvh_context c = new_ctx(e, KVH_CONTEXT_KV_KEEP);
    uint8_t *src = tu_alloc(N);
    tu_rng r = {9};
    tu_fill(&r, src, N);
    kvh_weight_region_params rp;
    assert_ok(kvh_weight_region_params_init(&rp, sizeof(rp)));
    rp.size = 1;
    for (uint32_t i = 0; i < N; i++) {
        rp.bytes = src + i;
        rp.layer = (uint32_t)tu_below(&r, 5);
        uint32_t idx;
        assert_ok(kvh_context_add_region(e, c, &rp, &idx));
        assert_int_equal(idx, i);
    }
    kvh_context_info ci = ct_context_info(e, c);
    assert_int_equal(ci.regions, N);
    assert_int_equal(ci.weight_bytes, N);
    assert_int_equal(ct_weight_stats(e).slots_host, N * ps);
    assert_int_equal(tu_tier(e, KVH_TIER_HOST).used_blocks, N * ps);
    /* More regions than the device tier has pages: the switch reports
     * NOSPACE before it moves any; the regions are still the caller's
     * bytes, in the host tier. */
    assert_kvh(KVH_ERR_NOSPACE, kvh_context_switch(e, (kvh_context){0}, c, NULL));
    for (uint32_t i = 0; i < N; i++) {
        void *d;
        assert_kvh(KVH_ERR_NOT_RESIDENT, kvh_context_region_data(e, c, i, 0, &d, NULL));
    }
    kvh_weight_stats ws = ct_weight_stats(e);
    assert_int_equal(ws.slots_device, 0);
    assert_int_equal(ws.slots_host, N * ps);
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, 0);
    assert_int_equal(tu_tier(e, KVH_TIER_HOST).used_blocks, N * ps);
    assert_ok(kvh_context_destroy(e, c));
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, 0);
    assert_int_equal(tu_tier(e, KVH_TIER_HOST).used_blocks, 0);
}

/* Both handles null: nothing to do, and the fence says so at once, every
 * time, before and after real switches. */
static void test_null_switch_fence_is_complete_at_once(void **state)
{
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F32, 64, 2048, threads_of(state));
    kvh_context c = new_ctx(e, KVH_CONTEXT_KV_KEEP);
    for (int round = 0; round < 40; round++) {
        if (round == 20)
            assert_ok(kvh_context_switch(e, (kvh_context){0}, c, NULL));
        kvh_fence f;
        assert_ok(kvh_context_switch(e, (kvh_context){0}, (kvh_context){0}, &f));
        int32_t done = 0;
        assert_ok(kvh_fence_poll(e, f, &done));
        assert_int_equal(done, 1);
        assert_ok(kvh_fence_wait(e, f, 0));
        assert_ok(kvh_fence_free(e, f));
        assert_ok(kvh_context_switch(e, (kvh_context){0}, (kvh_context){0}, NULL));
    }
    assert_ok(kvh_context_destroy(e, c));
}

#define BOTH(fn)                                                                                                       \
    cmocka_unit_test_prestate_setup_teardown(fn, NULL, tu_teardown, (void *)(uintptr_t)0),                             \
        cmocka_unit_test_prestate_setup_teardown(fn, NULL, tu_teardown, (void *)(uintptr_t)2)

int main(void)
{
    const struct CMUnitTest tests[] = {
        BOTH(test_file_range_that_wraps_is_refused),
        BOTH(test_region_larger_than_any_tier_is_refused),
        BOTH(test_ping_pong_keeps_every_byte),
        BOTH(test_destroy_during_switch_and_after),
        BOTH(test_close_during_a_switch),
        BOTH(test_many_tiny_regions),
        BOTH(test_null_switch_fence_is_complete_at_once),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
