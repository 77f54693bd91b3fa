/* kvh_block_release misused through the public API alone (abi/kvh.h),
 * whatever the release path does inside (core/block.h: releases taken on
 * trust wait in a short backlog). What a caller sees must be exactly "the
 * release happened when the call returned":
 *
 *   - room: a full hierarchy, one block released, the next alloc lands in
 *     its slot with no eviction and no drop;
 *   - counters: blocks_freed, used_blocks and pinned_blocks move with each
 *     release, at once;
 *   - stale handles across the reuse of a record, forged handles (random
 *     ids, wrong tags, indices past the tiers, another engine's), double
 *     releases: KVH_ERR_BAD_HANDLE with the id in kvh_last_error, nothing
 *     else changed; a release past the handle references with a sequence
 *     holding the block: KVH_ERR_INVALID_ARG; a success clears the error;
 *   - references past what any small counter holds (300 retains),
 *     released with stats, block info, pins, migrations and lookups in
 *     between, the count exact after each;
 *   - close with releases just made, then reopen of a persisted store:
 *     what was released is gone, what was kept is found, nothing leaks
 *     (ASan);
 *   - a random run of 20000 calls checked against a model of each
 *     handle's references (KVH_TEST_SEED picks another run). */
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "test_util.h"
#include "disk_test_util.h"

enum { L = 2, H = 1, D = 8, BT = 4 };

static kvh_engine *open_mem(uint64_t dev, uint64_t host)
{
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F32, dev, host, 0);
    return tu_open_cfg(&c);
}

static uint32_t refs_of(kvh_engine *e, kvh_block b) { return tu_binfo(e, b).refs; }

/* kvh_last_error names the refused id. */
static void assert_error_names(kvh_block b)
{
    char id[32];
    snprintf(id, sizeof(id), "0x%llx", (unsigned long long)b.id);
    if (!strstr(kvh_last_error(), id))
        fail_msg("last error \"%s\" does not name %s", kvh_last_error(), id);
}

/* Every slot of the memory tiers taken by a handle; one released, not the
 * newest (a release of the newest is plain): the next alloc finds its
 * slot, in the device tier with no move, in the host tier with the one
 * demotion that makes room above, and drops nothing. */
static void test_released_slot_is_free_for_the_next_alloc(void **state)
{
    (void)state;
    for (uint32_t host = 0; host <= 4; host += 4) {
        enum { DEV = 6 };
        kvh_engine *e = open_mem(DEV, host);
        uint32_t total = DEV + host;
        kvh_block h[DEV + 4];
        for (uint32_t i = 0; i < total; i++)
            assert_ok(kvh_block_alloc(e, 0, &h[i]));
        kvh_block extra;
        assert_kvh(KVH_ERR_NOSPACE, kvh_block_alloc(e, 0, &extra));
        for (uint32_t round = 0; round < total - 1; round++) {
            uint32_t victim = round; /* never the newest block */
            kvh_block_info was = tu_binfo(e, h[victim]);
            kvh_stats before = tu_stats(e);
            assert_ok(kvh_block_release(e, h[victim]));
            kvh_block fresh;
            assert_ok(kvh_block_alloc(e, 0, &fresh));
            kvh_stats after = tu_stats(e);
            /* A new block goes to the device tier: a slot freed there is
             * taken as is, one freed in the host tier takes a demotion. */
            bool in_device = was.tier == KVH_TIER_DEVICE;
            assert_int_equal(after.evictions, before.evictions + (in_device ? 0 : 1));
            assert_int_equal(after.drops, before.drops);
            assert_int_equal(after.blocks_freed, before.blocks_freed + 1);
            kvh_block_info now = tu_binfo(e, fresh);
            assert_int_equal(now.tier, KVH_TIER_DEVICE);
            if (in_device)
                assert_int_equal(now.slot, was.slot);
            assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, DEV);
            assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_info_get(e, h[victim], &now));
            h[victim] = fresh; /* the newest now; the next victim is not */
        }
        for (uint32_t i = 0; i < total; i++)
            assert_ok(kvh_block_release(e, h[i]));
        assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, 0);
        assert_int_equal(tu_tier(e, KVH_TIER_HOST).used_blocks, 0);
        kvh_stats s = tu_stats(e);
        assert_int_equal(s.blocks_allocated, s.blocks_freed);
        assert_ok(tu_close(e));
    }
}

/* Counters move with each release, seen by the very next call of each
 * kind (stats, tier info, block info). */
static void test_counters_move_at_once(void **state)
{
    (void)state;
    enum { N = 20 };
    kvh_engine *e = open_mem(N + 1, 0);
    kvh_block h[N], newest;
    for (int i = 0; i < N; i++)
        assert_ok(kvh_block_alloc(e, 0, &h[i]));
    assert_ok(kvh_block_alloc(e, 0, &newest));
    assert_ok(kvh_block_pin(e, h[0], 1));
    assert_ok(kvh_block_pin(e, h[1], 1));
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).pinned_blocks, 2);
    for (int i = 0; i < N; i++) {
        assert_ok(kvh_block_release(e, h[i]));
        switch (i % 3) {
        case 0:
            assert_int_equal(tu_stats(e).blocks_freed, (uint64_t)i + 1);
            break;
        case 1:
            assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, (uint64_t)(N - i));
            break;
        default: {
            kvh_block_info bi = {.struct_size = sizeof(bi)};
            assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_info_get(e, h[i], &bi));
            assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, (uint64_t)(N - i));
        }
        }
        if (i == 1) /* both pinned blocks are gone, and their pins */
            assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).pinned_blocks, 0);
    }
    assert_ok(kvh_block_release(e, newest));
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, 0);
}

/* A record reused by a new block: the old handle is stale for every call,
 * its release refused, the new block untouched. */
static void test_stale_handle_after_reuse(void **state)
{
    (void)state;
    kvh_engine *e = open_mem(4, 0);
    kvh_block old, keep, newest;
    assert_ok(kvh_block_alloc(e, 0, &old));
    assert_ok(kvh_block_alloc(e, 0, &keep));
    assert_ok(kvh_block_alloc(e, 0, &newest));
    assert_ok(kvh_block_release(e, old));
    /* Records are reused last freed first: old's goes to a new block at
     * once, and again after a few more cycles. */
    kvh_block fresh = {0};
    for (int i = 0; i < 8; i++) {
        if (fresh.id)
            assert_ok(kvh_block_release(e, fresh));
        assert_ok(kvh_block_alloc(e, 0, &fresh));
    }
    assert_true(fresh.id != 0 && fresh.id != old.id);
    for (int rep = 0; rep < 3; rep++) {
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_release(e, old));
        assert_error_names(old);
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_retain(e, old));
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_pin(e, old, 1));
    }
    assert_int_equal(refs_of(e, fresh), 1);
    assert_int_equal(refs_of(e, keep), 1);
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, 3);
    assert_ok(kvh_block_release(e, fresh));
    assert_string_equal(kvh_last_error(), "");
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_release(e, fresh));
    assert_ok(kvh_block_release(e, keep));
    assert_ok(kvh_block_release(e, newest));
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, 0);
}

/* Forged ids, between releases that wait on trust: every one refused,
 * named in the error, and the live blocks' references unchanged. */
static void test_forged_handles_change_nothing(void **state)
{
    (void)state;
    enum { N = 12 };
    kvh_engine *e = open_mem(N + 4, 4);
    kvh_engine *other = open_mem(4, 0);
    kvh_block h[N], theirs;
    for (int i = 0; i < N; i++) {
        assert_ok(kvh_block_alloc(e, 0, &h[i]));
        assert_ok(kvh_block_retain(e, h[i])); /* two references each */
    }
    assert_ok(kvh_block_alloc(other, 0, &theirs));
    tu_rng r = {tu_seed(0x5eed)};
    uint64_t tag_mask = 0xFFull << 56;
    for (int i = 0; i < 2000; i++) {
        kvh_block f;
        switch (i % 6) {
        case 0:
            f.id = tu_next(&r);
            break;
        case 1: /* a live handle under every other tag */
            f.id = (h[i % N].id & ~tag_mask) | ((tu_next(&r) & 0xFFull) << 56);
            break;
        case 2: /* a live handle with a generation bit flipped */
            f.id = h[i % N].id ^ (1ull << (20 + tu_below(&r, 36)));
            break;
        case 3: /* the block tag, an index past every tier */
            f.id = (h[0].id & tag_mask) | (0xFFFFFull - tu_below(&r, 64));
            break;
        case 4:
            f = theirs;
            break;
        default:
            f.id = ~0ull - tu_below(&r, 4);
        }
        bool live = false;
        for (int j = 0; j < N; j++)
            live |= f.id == h[j].id;
        if (live || f.id == 0)
            continue;
        if (i % 50 == 0 && i / 50 < 2 * N - 1) /* a release on trust waits in between */
            assert_ok(kvh_block_release(e, h[(i / 50) % N]));
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_release(e, f));
        assert_error_names(f);
    }
    int released[N] = {0};
    for (int i = 0; i < 2000 && i / 50 < 2 * N - 1; i += 50)
        released[(i / 50) % N]++;
    for (int j = 0; j < N; j++) {
        uint32_t want = 2 - (uint32_t)released[j];
        if (want == 0) {
            kvh_block_info bi = {.struct_size = sizeof(bi)};
            assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_info_get(e, h[j], &bi));
            continue;
        }
        assert_int_equal(refs_of(e, h[j]), want);
    }
    assert_int_equal(refs_of(other, theirs), 1);
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_block_release(NULL, h[0]));
    assert_ok(kvh_block_release(e, (kvh_block){0}));
    assert_string_equal(kvh_last_error(), "");
}

/* 300 references through handles, released with every call that reads
 * the block in between; then a release past them, with a sequence
 * holding the block, is INVALID_ARG and leaves the sequence's. */
static void test_many_references_released_between_other_calls(void **state)
{
    (void)state;
    enum { RETAINS = 300 };
    kvh_engine *e = open_mem(8, 8);
    kvh_seq s = tu_seq_new(e, 0);
    int32_t tok[BT];
    tu_iota(tok, BT, 100);
    assert_ok(kvh_seq_append(e, s, tok, BT));
    tu_write_pattern(e, s, L, H * D * 4, 7, 0, BT);
    kvh_block b = tu_seq_block(e, s, 0);
    for (int i = 0; i < RETAINS; i++)
        assert_ok(kvh_block_retain(e, b));
    kvh_block newest;
    assert_ok(kvh_block_alloc(e, 0, &newest));
    for (int i = 0; i < RETAINS; i++) {
        assert_ok(kvh_block_release(e, b));
        uint32_t want = 1 + (uint32_t)(RETAINS - 1 - i);
        switch (i % 5) {
        case 0:
            assert_int_equal(refs_of(e, b), want);
            break;
        case 1: {
            kvh_fence f;
            uint32_t to = (i / 5) % 2 ? KVH_TIER_DEVICE : KVH_TIER_HOST;
            assert_ok(kvh_migrate(e, &b, 1, to, &f));
            assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
            assert_ok(kvh_fence_free(e, f));
            assert_int_equal(tu_binfo(e, b).tier, to);
            break;
        }
        case 2:
            assert_ok(kvh_block_pin(e, b, 1));
            assert_ok(kvh_block_pin(e, b, 0));
            break;
        case 3: {
            kvh_block found[1];
            size_t n = 0;
            assert_ok(kvh_prefix_lookup(e, tok, BT, found, 1, &n));
            assert_int_equal(n, 1);
            assert_int_equal(found[0].id, b.id);
            assert_int_equal(refs_of(e, b), want + 1);
            assert_ok(kvh_block_release(e, found[0]));
            break;
        }
        default:
            assert_true(tu_check_pattern(e, s, L, H * D * 4, 7, 0, BT));
        }
    }
    assert_int_equal(refs_of(e, b), 1);
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_block_release(e, b));
    assert_non_null(strstr(kvh_last_error(), "no reference taken through a block handle"));
    assert_int_equal(refs_of(e, b), 1);
    assert_true(tu_check_pattern(e, s, L, H * D * 4, 7, 0, BT));
    assert_ok(kvh_seq_free(e, s));
    assert_ok(kvh_block_release(e, newest));
}

/* Close right after releases (some on trust), with a disk tier: what was
 * released is gone after a reopen, what was kept is found; nothing leaks. */
static void test_close_with_releases_then_reopen(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("release_reopen", dir, sizeof(dir));
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F32, 4, 4, 2);
    c.disk_path = dir;
    c.disk_bytes = 8u << 20;
    enum { NB = 6 };
    int32_t tok[NB * BT];
    tu_iota(tok, NB * BT, 1000);
    {
        kvh_engine *e = tu_open_cfg(&c);
        kvh_seq s = tu_seq_new(e, 0);
        assert_ok(kvh_seq_append(e, s, tok, NB * BT));
        tu_write_pattern(e, s, L, H * D * 4, 3, 0, NB * BT);
        assert_ok(kvh_seq_persist(e, s));
        kvh_block found[NB];
        size_t n = 0;
        assert_ok(kvh_prefix_lookup(e, tok, NB * BT, found, NB, &n));
        assert_int_equal(n, NB);
        assert_ok(kvh_seq_free(e, s));
        kvh_block loose[5];
        for (int i = 0; i < 5; i++)
            assert_ok(kvh_block_alloc(e, 0, &loose[i]));
        for (int i = 0; i < 4; i++) /* loose[4] stays the newest */
            assert_ok(kvh_block_release(e, loose[i]));
        for (size_t i = 0; i < n; i++)
            assert_ok(kvh_block_release(e, found[i]));
        /* loose[4] and nothing else is referenced; close frees it. */
        assert_ok(tu_close(e));
    }
    {
        kvh_engine *e = tu_open_cfg(&c);
        kvh_block found[NB];
        size_t n = 0;
        assert_ok(kvh_prefix_lookup(e, tok, NB * BT, found, NB, &n));
        assert_int_equal(n, NB);
        for (size_t i = 0; i < n; i++)
            assert_ok(kvh_block_release(e, found[i]));
        assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks + tu_tier(e, KVH_TIER_HOST).used_blocks, 0);
        assert_ok(tu_close(e));
    }
}

/* An oracle: a random run of allocs, retains, releases (good, double,
 * stale, forged) and reads against a model of the references each handle
 * holds. After every call: its status is the model's, every live block's
 * references are the model's, the tiers hold exactly the live blocks, and
 * an alloc fails with NOSPACE exactly when every slot is live (nothing
 * can be dropped: every block is referenced). */
enum { ORACLE_STEPS = 20000, ORACLE_DEV = 5, ORACLE_HOST = 3, ORACLE_HANDLES = 4096 };

typedef struct {
    kvh_block h;
    uint32_t refs; /* 0: freed (its handle is stale) */
} oracle_block;

static void test_random_calls_against_a_model(void **state)
{
    (void)state;
    kvh_engine *e = open_mem(ORACLE_DEV, ORACLE_HOST);
    oracle_block *m = tu_alloc(sizeof(oracle_block) * ORACLE_HANDLES);
    uint32_t n = 0, live = 0;
    tu_rng r = {tu_seed(0x0dac1e)};
    for (int step = 0; step < ORACLE_STEPS; step++) {
        uint64_t op = tu_below(&r, 100);
        oracle_block *b = n ? &m[tu_below(&r, n)] : NULL;
        if (op < 25 || !b) { /* alloc */
            kvh_block h;
            kvh_status st = kvh_block_alloc(e, 0, &h);
            if (live == ORACLE_DEV + ORACLE_HOST) {
                assert_kvh(KVH_ERR_NOSPACE, st);
            } else {
                assert_ok(st);
                if (n == ORACLE_HANDLES) { /* forget the stale ones */
                    uint32_t kept = 0;
                    for (uint32_t i = 0; i < n; i++)
                        if (m[i].refs)
                            m[kept++] = m[i];
                    n = kept;
                }
                m[n++] = (oracle_block){h, 1};
                live++;
            }
        } else if (op < 40) { /* retain */
            kvh_status st = kvh_block_retain(e, b->h);
            assert_kvh(b->refs ? KVH_OK : KVH_ERR_BAD_HANDLE, st);
            if (b->refs)
                b->refs++;
        } else if (op < 80) { /* release, maybe a double or stale one */
            kvh_status st = kvh_block_release(e, b->h);
            assert_kvh(b->refs ? KVH_OK : KVH_ERR_BAD_HANDLE, st);
            if (b->refs && --b->refs == 0)
                live--;
        } else if (op < 85) { /* forged */
            kvh_block f = {b->h.id ^ (1ull << tu_below(&r, 64))};
            bool real = false;
            for (uint32_t i = 0; i < n; i++)
                real |= m[i].refs && m[i].h.id == f.id;
            if (!real && f.id != 0)
                assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_release(e, f));
        } else if (op < 95) { /* block info */
            kvh_block_info bi = {.struct_size = sizeof(bi)};
            kvh_status st = kvh_block_info_get(e, b->h, &bi);
            assert_kvh(b->refs ? KVH_OK : KVH_ERR_BAD_HANDLE, st);
            if (b->refs)
                assert_int_equal(bi.refs, b->refs);
        } else { /* every tier, every live block */
            kvh_tier_info d = tu_tier(e, KVH_TIER_DEVICE), h = tu_tier(e, KVH_TIER_HOST);
            assert_int_equal(d.used_blocks + h.used_blocks, live);
            for (uint32_t i = 0; i < n; i++)
                if (m[i].refs)
                    assert_int_equal(refs_of(e, m[i].h), m[i].refs);
        }
    }
    kvh_stats s = tu_stats(e);
    assert_int_equal(s.blocks_allocated - s.blocks_freed, live);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_released_slot_is_free_for_the_next_alloc, tu_teardown),
        cmocka_unit_test_teardown(test_counters_move_at_once, tu_teardown),
        cmocka_unit_test_teardown(test_stale_handle_after_reuse, tu_teardown),
        cmocka_unit_test_teardown(test_forged_handles_change_nothing, tu_teardown),
        cmocka_unit_test_teardown(test_many_references_released_between_other_calls, tu_teardown),
        cmocka_unit_test_teardown(test_close_with_releases_then_reopen, tu_teardown),
        cmocka_unit_test_teardown(test_random_calls_against_a_model, tu_teardown),
    };
    return cmocka_run_group_tests_name("release_misuse", tests, NULL, NULL);
}
