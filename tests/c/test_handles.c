/* core/handles.h: generation-checked handle tables, and every handle type
 * of the engine (attention plans and views included): a freed handle never
 * becomes valid again. */
#include "test_util.h"

#include "core/context.h"
#include "core/engine.h"
#include "core/handles.h"
#include "core/block.h"
#include "white_box_util.h"

static int dummy[1024];

static void test_make_and_split(void **state)
{
    (void)state;
    uint64_t h = kvhi_handle_make(KVHI_TAG_SEQ, 0x12345678u, 0xabcdef);
    assert_int_equal(kvhi_handle_tag(h), KVHI_TAG_SEQ);
    assert_int_equal(kvhi_handle_gen(h), 0x12345678u);
    assert_int_equal(kvhi_handle_index(h), 0xabcdef);
    /* All 32 generation bits fit below the tag. */
    h = kvhi_handle_make(KVHI_TAG_BLOCK, 0xFFFFFFFFu, 7);
    assert_int_equal(kvhi_handle_tag(h), KVHI_TAG_BLOCK);
    assert_int_equal(kvhi_handle_gen(h), 0xFFFFFFFFu);
    assert_int_equal(kvhi_handle_index(h), 7);
    /* An index past 24 bits cannot spill into the generation. */
    h = kvhi_handle_make(KVHI_TAG_FENCE, 9, 0xFF000005u);
    assert_int_equal(kvhi_handle_gen(h), 9);
    assert_int_equal(kvhi_handle_index(h), 5);
    /* Packed with another index width: generation bits past the 56 below
     * the tag are dropped, never into the tag. */
    h = kvhi_handle_pack(KVHI_TAG_POOL, UINT64_MAX, 3, 4);
    assert_int_equal(kvhi_handle_tag(h), KVHI_TAG_POOL);
    assert_int_equal(kvhi_handle_unpack_index(h, 4), 3);
    assert_true((h & KVHI_HANDLE_PAYLOAD_MASK) >> 4 == (1ull << 52) - 1);
    /* Every tag is non-zero, so no handle equals the null handle. */
    assert_true(KVHI_TAG_SEQ && KVHI_TAG_BLOCK && KVHI_TAG_FENCE && KVHI_TAG_POOL && KVHI_TAG_CONTEXT);
}

static void test_gen_next_skips_zero(void **state)
{
    (void)state;
    assert_int_equal(kvhi_gen_next(1), 2);
    assert_int_equal(kvhi_gen_next(0xFFFFFFFEu), 0xFFFFFFFFu);
    assert_int_equal(kvhi_gen_next(0xFFFFFFFFu), 1); /* wraps past 0 */
}

static void test_add_get_remove(void **state)
{
    (void)state;
    kvhi_handle_table t;
    assert_int_equal(kvhi_handles_init(&t, KVHI_TAG_SEQ), 0);
    /* Empty table: nothing resolves, including the null handle. */
    assert_null(kvhi_handles_get(&t, 0, NULL));
    assert_null(kvhi_handles_get(&t, kvhi_handle_make(KVHI_TAG_SEQ, 1, 0), NULL));
    assert_null(kvhi_handles_at(&t, 0));

    uint64_t h[3];
    uint32_t idx[3];
    for (int i = 0; i < 3; i++) {
        assert_int_equal(kvhi_handles_add(&t, &dummy[i], &h[i], &idx[i]), 0);
        assert_int_equal(idx[i], (uint32_t)i); /* lowest index first */
        assert_int_equal(kvhi_handle_tag(h[i]), KVHI_TAG_SEQ);
        assert_true(kvhi_handle_gen(h[i]) != 0);
        assert_int_equal(kvhi_handle_index(h[i]), (uint32_t)i);
    }
    assert_int_equal(t.used, 3);
    for (int i = 0; i < 3; i++) {
        uint32_t got = 999;
        assert_ptr_equal(kvhi_handles_get(&t, h[i], &got), &dummy[i]);
        assert_int_equal(got, idx[i]);
        assert_ptr_equal(kvhi_handles_at(&t, idx[i]), &dummy[i]);
        assert_int_equal(kvhi_handles_handle_of(&t, idx[i]), h[i]);
    }
    /* Index out-param is optional. */
    assert_ptr_equal(kvhi_handles_get(&t, h[1], NULL), &dummy[1]);

    kvhi_handles_remove(&t, idx[1]);
    assert_int_equal(t.used, 2);
    assert_null(kvhi_handles_get(&t, h[1], NULL));
    assert_null(kvhi_handles_at(&t, idx[1]));
    assert_ptr_equal(kvhi_handles_get(&t, h[0], NULL), &dummy[0]);
    assert_ptr_equal(kvhi_handles_get(&t, h[2], NULL), &dummy[2]);
    kvhi_handles_destroy(&t);
    /* A destroyed table resolves nothing and keeps its tag. */
    assert_null(kvhi_handles_get(&t, h[0], NULL));
    assert_int_equal(t.tag, KVHI_TAG_SEQ);
}

static void test_stale_generation_rejected(void **state)
{
    (void)state;
    kvhi_handle_table t;
    kvhi_handles_init(&t, KVHI_TAG_FENCE);
    uint64_t old, fresh;
    uint32_t i_old, i_new;
    assert_int_equal(kvhi_handles_add(&t, &dummy[0], &old, &i_old), 0);
    kvhi_handles_remove(&t, i_old);
    assert_int_equal(kvhi_handles_add(&t, &dummy[1], &fresh, &i_new), 0);
    assert_int_equal(i_new, i_old); /* the index is reused ... */
    assert_true(fresh != old);      /* ... under a new generation */
    assert_null(kvhi_handles_get(&t, old, NULL));
    assert_ptr_equal(kvhi_handles_get(&t, fresh, NULL), &dummy[1]);

    /* Many reuse cycles of one index: only the newest handle resolves. */
    uint64_t prev[64];
    for (int c = 0; c < 64; c++) {
        prev[c] = fresh;
        kvhi_handles_remove(&t, i_new);
        assert_int_equal(kvhi_handles_add(&t, &dummy[2], &fresh, &i_new), 0);
        assert_int_equal(i_new, i_old);
        for (int p = 0; p <= c; p++)
            assert_null(kvhi_handles_get(&t, prev[p], NULL));
        assert_ptr_equal(kvhi_handles_get(&t, fresh, NULL), &dummy[2]);
    }
    /* Any other generation at a live index is rejected. */
    for (uint32_t g = 0; g < 300; g++) {
        uint64_t forged = kvhi_handle_make(KVHI_TAG_FENCE, g, i_new);
        if (forged == fresh)
            continue;
        assert_null(kvhi_handles_get(&t, forged, NULL));
    }
    kvhi_handles_destroy(&t);
}

static void test_wrong_tag_rejected(void **state)
{
    (void)state;
    kvhi_handle_table t;
    kvhi_handles_init(&t, KVHI_TAG_BLOCK);
    uint64_t h;
    uint32_t i;
    assert_int_equal(kvhi_handles_add(&t, &dummy[0], &h, &i), 0);
    for (uint32_t tag = 0; tag < 256; tag++) {
        uint64_t forged = kvhi_handle_make((uint8_t)tag, kvhi_handle_gen(h), kvhi_handle_index(h));
        if (tag == KVHI_TAG_BLOCK)
            assert_ptr_equal(kvhi_handles_get(&t, forged, NULL), &dummy[0]);
        else
            assert_null(kvhi_handles_get(&t, forged, NULL));
    }
    kvhi_handles_destroy(&t);
}

static void test_forged_index_out_of_range(void **state)
{
    (void)state;
    kvhi_handle_table t;
    kvhi_handles_init(&t, KVHI_TAG_POOL);
    uint64_t h;
    uint32_t i;
    assert_int_equal(kvhi_handles_add(&t, &dummy[0], &h, &i), 0);
    uint32_t idxs[] = {t.cap, t.cap + 1, 1000, 65535, 0x7FFFFFFFu, 0xFFFFFFFEu, 0xFFFFFFFFu};
    for (size_t k = 0; k < sizeof(idxs) / sizeof(idxs[0]); k++)
        for (uint32_t g = 0; g < 4; g++)
            assert_null(kvhi_handles_get(&t, kvhi_handle_make(KVHI_TAG_POOL, g, idxs[k]), NULL));
    /* Free slots inside the capacity (never used) do not resolve either. */
    for (uint32_t k = 1; k < t.cap; k++)
        for (uint32_t g = 0; g < 3; g++)
            assert_null(kvhi_handles_get(&t, kvhi_handle_make(KVHI_TAG_POOL, g, k), NULL));
    assert_null(kvhi_handles_at(&t, t.cap));
    assert_null(kvhi_handles_at(&t, 0xFFFFFFFFu));
    kvhi_handles_destroy(&t);
}

static void test_growth_beyond_64(void **state)
{
    (void)state;
    kvhi_handle_table t;
    kvhi_handles_init(&t, KVHI_TAG_SEQ);
    enum { N = 1000 };
    uint64_t *h = tu_alloc(sizeof(uint64_t) * N);
    uint32_t *idx = tu_alloc(sizeof(uint32_t) * N);
    for (uint32_t i = 0; i < N; i++) {
        assert_int_equal(kvhi_handles_add(&t, &dummy[i], &h[i], &idx[i]), 0);
        assert_int_equal(idx[i], i);
    }
    assert_true(t.cap >= N);
    assert_int_equal(t.used, N);
    /* Handles taken before each growth still resolve after it. */
    for (uint32_t i = 0; i < N; i++)
        assert_ptr_equal(kvhi_handles_get(&t, h[i], NULL), &dummy[i]);
    /* Handles are unique. */
    for (uint32_t i = 1; i < N; i++)
        assert_true(h[i] != h[i - 1]);

    /* Remove the odd ones, re-add: indices reused, old handles dead. */
    for (uint32_t i = 1; i < N; i += 2)
        kvhi_handles_remove(&t, idx[i]);
    assert_int_equal(t.used, N / 2);
    for (uint32_t i = 1; i < N; i += 2) {
        uint64_t nh;
        uint32_t ni;
        assert_int_equal(kvhi_handles_add(&t, &dummy[1000], &nh, &ni), 0);
        assert_true(ni < N && (ni % 2) == 1);
        assert_true(kvhi_handle_gen(nh) != kvhi_handle_gen(h[ni]));
    }
    assert_int_equal(t.used, N);
    assert_int_equal(t.cap, 1024); /* no growth needed for the re-adds */
    for (uint32_t i = 1; i < N; i += 2)
        assert_null(kvhi_handles_get(&t, h[i], NULL));
    for (uint32_t i = 0; i < N; i += 2)
        assert_ptr_equal(kvhi_handles_get(&t, h[i], NULL), &dummy[i]);
    kvhi_handles_destroy(&t);
}

/* A random workload against a reference map index -> (ptr, handle). */
static void test_random_against_reference(void **state)
{
    (void)state;
    uint64_t seed = tu_seed(0x4a11d1e5);
    tu_rng r = {seed};
    kvhi_handle_table t;
    kvhi_handles_init(&t, KVHI_TAG_SEQ);
    enum { MAXI = 600 };
    uint64_t *live = tu_alloc(sizeof(uint64_t) * 4096); /* by index, 0 = free */
    uint64_t *dead = tu_alloc(sizeof(uint64_t) * 20000);
    size_t n_dead = 0;
    uint32_t used = 0;
    for (int op = 0; op < 20000; op++) {
        if (used < MAXI && (used == 0 || tu_below(&r, 100) < 55)) {
            uint64_t h;
            uint32_t i;
            assert_int_equal(kvhi_handles_add(&t, &dummy[op % 1024], &h, &i), 0);
            assert_true(i < 4096);
            assert_int_equal(live[i], 0);
            live[i] = h;
            used++;
        } else {
            uint32_t i;
            do
                i = (uint32_t)tu_below(&r, t.cap);
            while (!live[i]);
            kvhi_handles_remove(&t, i);
            if (n_dead < 20000)
                dead[n_dead++] = live[i];
            live[i] = 0;
            used--;
        }
        assert_int_equal(t.used, used);
        if (op % 97 == 0) {
            for (uint32_t i = 0; i < t.cap; i++)
                if (live[i])
                    assert_non_null(kvhi_handles_get(&t, live[i], NULL));
            for (size_t d = 0; d < n_dead; d++) {
                uint32_t i = kvhi_handle_index(dead[d]);
                if (live[i] != dead[d])
                    assert_null(kvhi_handles_get(&t, dead[d], NULL));
            }
        }
    }
    kvhi_handles_destroy(&t);
}

/* A slot whose generation would come back to its first value is retired,
 * so the first handle it gave out is never handed out again. */
static void test_table_slot_retires_at_wrap(void **state)
{
    (void)state;
    /* From 1 the last generations pass UINT32_MAX and skip 0. */
    const uint32_t starts[] = {0x1234567u, 1, 0xFFFFFFFFu};
    for (size_t k = 0; k < sizeof(starts) / sizeof(starts[0]); k++) {
        kvhi_handle_table t;
        kvhi_handles_init(&t, KVHI_TAG_SEQ);
        kvhi_handles_set_gen_start(&t, starts[k]);
        uint64_t first, seen[4];
        uint32_t slot, i;
        assert_int_equal(kvhi_handles_add(&t, &dummy[0], &first, &slot), 0);
        assert_int_equal(kvhi_handle_gen(first), starts[k]);
        kvhi_handles_remove(&t, slot);
        t.gens[slot] = starts[k] - 3; /* skip the 2^32 - 4 uses before */
        int n_seen = 0;
        while (t.retired == 0) {
            assert_true(n_seen < 4);
            assert_int_equal(kvhi_handles_add(&t, &dummy[1], &seen[n_seen], &i), 0);
            assert_int_equal(i, slot);
            assert_true(seen[n_seen] != first);
            kvhi_handles_remove(&t, i);
            n_seen++;
        }
        assert_int_equal(n_seen, starts[k] == 1 ? 2 : 3);
        assert_int_equal(t.used, 0);
        /* The slot stays out: new handles take other slots. */
        for (int n = 0; n < 200; n++) {
            uint64_t h;
            assert_int_equal(kvhi_handles_add(&t, &dummy[2], &h, &i), 0);
            assert_true(i != slot);
        }
        assert_int_equal(t.retired, 1);
        assert_null(kvhi_handles_at(&t, slot));
        assert_null(kvhi_handles_get(&t, first, NULL));
        for (int n = 0; n < n_seen; n++)
            assert_null(kvhi_handles_get(&t, seen[n], NULL));
        kvhi_handles_destroy(&t);
    }
}

/* ---- block records ---- */

enum { L = 1, H = 1, D = 4, BT = 4, TOK = H * D * 4 };

static kvh_engine *small_engine(void) { return tu_open(L, H, D, BT, KVH_DTYPE_F32, 8, 8, 0); }

/* White-box: a block record, moved to three generations short of what its
 * handles can tell apart, retires when it gets there; the engine then has
 * one record less and says so when it runs out. */
static void test_block_record_retires_at_wrap(void **state)
{
    (void)state;
    kvh_engine *e = small_engine(); /* 8 + 8 blocks */
    assert_int_equal(e->block_cap, 16);
    assert_int_equal(e->block_index_bits, 4);
    const unsigned gen_bits = KVHI_HANDLE_TAG_SHIFT - 4;
    kvh_block first, seen[5];
    assert_ok(kvh_block_alloc(e, 0, &first));
    assert_ok(kvh_block_release(e, first));
    wb_settle(e); /* the record is written below without the lock */
    uint32_t rec = kvhi_handle_unpack_index(first.id, e->block_index_bits);
    assert_int_equal(kvhi_handle_pack(KVHI_TAG_BLOCK, e->gen_start, rec, 4), first.id);
    kvh_block_info bi = {.struct_size = sizeof(bi)};
    /* 2^32 uses later the low half is back where it started; the handle
     * carries the bits above it too, so the first handle stays stale. */
    e->blocks[rec].gen = e->gen_start;
    e->blocks[rec].gen_hi = 1;
    kvh_block later;
    assert_ok(kvh_block_alloc(e, 0, &later));
    assert_int_equal(kvhi_handle_unpack_index(later.id, 4), rec);
    assert_int_equal(later.id, first.id | 1ull << (32 + 4));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_info_get(e, first, &bi));
    assert_ok(kvh_block_release(e, later));
    wb_settle(e);
    uint64_t near_wrap = e->gen_start + (1ull << gen_bits) - 3;
    if ((uint32_t)near_wrap == 0) /* the low half is never 0 */
        near_wrap--;
    e->blocks[rec].gen = (uint32_t)near_wrap;
    e->blocks[rec].gen_hi = (uint32_t)(near_wrap >> 32);
    int n_seen = 0;
    while (e->blocks_retired == 0) {
        assert_true(n_seen < 5);
        assert_ok(kvh_block_alloc(e, 0, &seen[n_seen]));
        assert_int_equal(kvhi_handle_unpack_index(seen[n_seen].id, 4), rec);
        assert_int_equal(seen[n_seen].id, kvhi_handle_pack(KVHI_TAG_BLOCK, kvhi_block_gen(&e->blocks[rec]), rec, 4));
        assert_ok(kvh_block_release(e, seen[n_seen]));
        wb_settle(e); /* blocks_retired is read without the lock */
        n_seen++;
    }
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_info_get(e, first, &bi));
    for (int n = 0; n < n_seen; n++)
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_info_get(e, seen[n], &bi));
    /* 15 records are left for 16 tier slots. */
    kvh_block live[16];
    for (int n = 0; n < 15; n++) {
        assert_ok(kvh_block_alloc(e, 0, &live[n]));
        assert_true(kvhi_handle_unpack_index(live[n].id, 4) != rec);
    }
    assert_kvh(KVH_ERR_NOSPACE, kvh_block_alloc(e, 0, &live[15]));
    for (int n = 0; n < 15; n++)
        assert_ok(kvh_block_release(e, live[n]));
    assert_int_equal(e->blocks_retired, 1);
}

/* Block handles give the generation what the index leaves: 56 bits for a
 * single block, 51 for 17. */
static void test_block_handle_widths(void **state)
{
    (void)state;
    const struct {
        uint64_t device, host;
        unsigned index_bits;
    } cases[] = {{1, 0, 0}, {2, 0, 1}, {16, 1, 5}};
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F32, cases[c].device, cases[c].host, 0);
        assert_int_equal(e->block_index_bits, cases[c].index_bits);
        kvh_block b, prev = {0};
        for (int n = 0; n < 100; n++) {
            assert_ok(kvh_block_alloc(e, 0, &b));
            assert_int_equal(kvhi_handle_tag(b.id), KVHI_TAG_BLOCK);
            assert_true(b.id != prev.id);
            assert_true(kvhi_handle_unpack_index(b.id, cases[c].index_bits) < e->block_cap);
            assert_ok(kvh_block_release(e, b));
            kvh_block_info bi = {.struct_size = sizeof(bi)};
            assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_info_get(e, b, &bi));
            prev = b;
        }
        assert_ok(tu_close(e));
    }
}

/* ---- every handle type of the engine, through the public API ---- */

static kvh_seq fence_source; /* a fence is made by migrating 0 blocks of it */
static float pool_memory[2 * 4 * BT * H * D];

static kvh_engine *kinds_engine(void)
{
    kvh_engine *e = small_engine();
    fence_source = tu_seq_new(e, 0);
    return e;
}

static kvh_status seq_create(kvh_engine *e, uint64_t *id) { return kvh_seq_create(e, 0, (kvh_seq *)id); }
static kvh_status seq_destroy(kvh_engine *e, uint64_t id) { return kvh_seq_free(e, (kvh_seq){id}); }
static kvh_status seq_probe(kvh_engine *e, uint64_t id)
{
    uint64_t n;
    return kvh_seq_length(e, (kvh_seq){id}, &n);
}

static kvh_status block_create(kvh_engine *e, uint64_t *id) { return kvh_block_alloc(e, 0, (kvh_block *)id); }
static kvh_status block_destroy(kvh_engine *e, uint64_t id) { return kvh_block_release(e, (kvh_block){id}); }
static kvh_status block_probe(kvh_engine *e, uint64_t id)
{
    kvh_block_info bi = {.struct_size = sizeof(bi)};
    return kvh_block_info_get(e, (kvh_block){id}, &bi);
}

static kvh_status fence_create(kvh_engine *e, uint64_t *id)
{
    return kvh_seq_migrate(e, fence_source, 0, 0, KVH_TIER_HOST, (kvh_fence *)id);
}
static kvh_status fence_destroy(kvh_engine *e, uint64_t id) { return kvh_fence_free(e, (kvh_fence){id}); }
static kvh_status fence_probe(kvh_engine *e, uint64_t id)
{
    int32_t done;
    return kvh_fence_poll(e, (kvh_fence){id}, &done);
}

static kvh_status pool_create(kvh_engine *e, uint64_t *id)
{
    void *k[L] = {pool_memory}, *v[L] = {pool_memory + 4 * BT * H * D};
    kvh_pool_layout layout = {.struct_size = sizeof(layout),
                              .memory = KVH_MEMORY_HOST,
                              .num_slots = 4,
                              .k_base = k,
                              .v_base = v,
                              .slot_stride = BT * TOK,
                              .token_stride = TOK,
                              .head_stride = D * 4};
    return kvh_pool_register(e, &layout, (kvh_pool *)id);
}
static kvh_status pool_destroy(kvh_engine *e, uint64_t id) { return kvh_pool_unregister(e, (kvh_pool){id}); }

static kvh_status context_create(kvh_engine *e, uint64_t *id) { return kvh_context_create(e, NULL, (kvh_context *)id); }
static kvh_status context_destroy(kvh_engine *e, uint64_t id) { return kvh_context_destroy(e, (kvh_context){id}); }
static kvh_status context_probe(kvh_engine *e, uint64_t id)
{
    kvh_context_info info = {.struct_size = sizeof(info)};
    return kvh_context_info_get(e, (kvh_context){id}, &info);
}

/* Plans and views need tokens to attend over, and views a piece of whole
 * pages: 16 tokens of head_dim 64 in f32 (4 KiB). */
enum { VIEW_D = 64, VIEW_BT = 16 };
static kvh_seq attend_source;

static kvh_engine *views_engine(void)
{
    kvh_config c = tu_cfg(L, H, VIEW_D, VIEW_BT, KVH_DTYPE_F32, 8, 8, 0);
    c.vmap = 1;
    kvh_engine *e = tu_open_cfg(&c);
    attend_source = tu_seq_new(e, 0);
    int32_t tok[3] = {1, 2, 3};
    assert_ok(kvh_seq_append(e, attend_source, tok, 3));
    return e;
}

/* The ABI's plan and view pointers carry the handle as their value. */
static kvh_status plan_create(kvh_engine *e, uint64_t *id)
{
    kvh_attention_plan *pl = NULL;
    kvh_status st = kvh_attention_plan_create(e, 0, &attend_source, NULL, 1, NULL, &pl);
    *id = (uint64_t)(uintptr_t)pl;
    return st;
}
static kvh_status plan_destroy(kvh_engine *e, uint64_t id)
{
    return kvh_attention_plan_destroy(e, (kvh_attention_plan *)(uintptr_t)id);
}
static kvh_status plan_probe(kvh_engine *e, uint64_t id)
{
    float q[H * VIEW_D] = {0}, out[H * VIEW_D];
    return kvh_attention_run(e, (kvh_attention_plan *)(uintptr_t)id, q, out, NULL);
}

static kvh_status view_create(kvh_engine *e, uint64_t *id)
{
    kvh_vmap *m = NULL;
    kvh_status st = kvh_seq_vmap(e, attend_source, 0, 0, &m);
    *id = (uint64_t)(uintptr_t)m;
    return st;
}
static kvh_status view_destroy(kvh_engine *e, uint64_t id) { return kvh_vmap_release(e, (kvh_vmap *)(uintptr_t)id); }
static kvh_status view_probe(kvh_engine *e, uint64_t id)
{
    kvh_vmap_view v = {.struct_size = sizeof(v)};
    return kvh_vmap_get(e, (kvh_vmap *)(uintptr_t)id, &v);
}

static kvhi_handle_table *seq_table(kvh_engine *e) { return &e->seqs; }
static kvhi_handle_table *fence_table(kvh_engine *e) { return &e->fences; }
static kvhi_handle_table *pool_table(kvh_engine *e) { return &e->pools; }
static kvhi_handle_table *context_table(kvh_engine *e) { return &e->contexts->table; }
static kvhi_handle_table *plan_table(kvh_engine *e) { return &e->attn_plans; }
static kvhi_handle_table *view_table(kvh_engine *e) { return &e->vmaps; }

typedef struct handle_kind {
    const char *name;
    kvh_status (*create)(kvh_engine *e, uint64_t *id);
    kvh_status (*destroy)(kvh_engine *e, uint64_t id);
    kvh_status (*probe)(kvh_engine *e, uint64_t id); /* any call naming it */
    kvhi_handle_table *(*table)(kvh_engine *e);      /* NULL: block records */
    kvh_engine *(*open)(void);
    /* Create/free cycles of check_freed_handle_stays_bad: 2^24 + 1 where
     * that takes about a second, else what does (plans, views: the table
     * code is the same, and test_engine_table_slots_retire sees its wrap). */
    uint32_t cycles;
} handle_kind;

/* Pools have no call that only reads: a revived pool would be
 * unregistered by the probe, which then returns KVH_OK and fails. */
static const handle_kind kinds[] = {
    {"seq", seq_create, seq_destroy, seq_probe, seq_table, kinds_engine, (1u << 24) + 1},
    {"block", block_create, block_destroy, block_probe, NULL, kinds_engine, (1u << 24) + 1},
    {"fence", fence_create, fence_destroy, fence_probe, fence_table, kinds_engine, (1u << 24) + 1},
    {"pool", pool_create, pool_destroy, pool_destroy, pool_table, kinds_engine, (1u << 24) + 1},
    {"context", context_create, context_destroy, context_probe, context_table, kinds_engine, (1u << 24) + 1},
    {"plan", plan_create, plan_destroy, plan_probe, plan_table, views_engine, (1u << 20) + 1},
    {"view", view_create, view_destroy, view_probe, view_table, views_engine, (1u << 16) + 1},
};
enum { KIND_SEQ, KIND_BLOCK, KIND_FENCE, KIND_POOL, KIND_CONTEXT, KIND_PLAN, KIND_VIEW };

/* Create and free a handle, then create and free k->cycles more (2^24 + 1
 * is one past where 24-bit generations used to hand the first value out
 * again): table handles take the same slot each time, yet no create
 * returns the first value, and it stays KVH_ERR_BAD_HANDLE while a live
 * handle holds its slot. About a second per type. */
static void check_freed_handle_stays_bad(const handle_kind *k)
{
    uint32_t cycles = k->cycles;
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    /* 12 s per type there; the wrap itself is the release build's to see
     * (and the white-box tests'), these runs check the paths' memory. */
    if (cycles > (1u << 16) + 1)
        cycles = (1u << 16) + 1;
#endif
    kvh_engine *e = k->open();
    uint64_t freed, h = 0;
    assert_ok(k->create(e, &freed));
    assert_ok(k->destroy(e, freed));
    for (uint32_t i = 1; i <= cycles; i++) {
        assert_ok(k->create(e, &h));
        if (h == freed) {
            print_error("%s: create %u handed out the freed handle 0x%" PRIx64 " again\n", k->name, i, freed);
            fail();
        }
        if (k->table)
            assert_int_equal(kvhi_handle_index(h), kvhi_handle_index(freed));
        if (i < cycles)
            assert_ok(k->destroy(e, h));
    }
    assert_kvh(KVH_ERR_BAD_HANDLE, k->probe(e, freed));
    assert_kvh(KVH_ERR_BAD_HANDLE, k->destroy(e, freed));
    assert_ok(k->destroy(e, h));
}

static void test_freed_seq_stays_bad(void **state)
{
    (void)state;
    check_freed_handle_stays_bad(&kinds[KIND_SEQ]);
}
static void test_freed_block_stays_bad(void **state)
{
    (void)state;
    check_freed_handle_stays_bad(&kinds[KIND_BLOCK]);
}
static void test_freed_fence_stays_bad(void **state)
{
    (void)state;
    check_freed_handle_stays_bad(&kinds[KIND_FENCE]);
}
static void test_freed_pool_stays_bad(void **state)
{
    (void)state;
    check_freed_handle_stays_bad(&kinds[KIND_POOL]);
}
static void test_freed_context_stays_bad(void **state)
{
    (void)state;
    check_freed_handle_stays_bad(&kinds[KIND_CONTEXT]);
}
static void test_freed_plan_stays_bad(void **state)
{
    (void)state;
    check_freed_handle_stays_bad(&kinds[KIND_PLAN]);
}
static void test_freed_view_stays_bad(void **state)
{
    (void)state;
    check_freed_handle_stays_bad(&kinds[KIND_VIEW]);
}

/* A plan and a view carry their own tags: neither is the other, nor any
 * other handle type. */
static void test_plan_and_view_tags(void **state)
{
    (void)state;
    kvh_engine *e = views_engine();
    uint64_t plan, view;
    assert_ok(plan_create(e, &plan));
    assert_ok(view_create(e, &view));
    assert_int_equal(kvhi_handle_tag(plan), KVHI_TAG_PLAN);
    assert_int_equal(kvhi_handle_tag(view), KVHI_TAG_VMAP);
    const uint8_t others[] = {KVHI_TAG_SEQ, KVHI_TAG_BLOCK, KVHI_TAG_FENCE, KVHI_TAG_POOL, KVHI_TAG_CONTEXT, 0};
    for (size_t i = 0; i < sizeof(others); i++) {
        assert_true(others[i] != KVHI_TAG_PLAN && others[i] != KVHI_TAG_VMAP);
        uint64_t as_other_plan = (plan & KVHI_HANDLE_PAYLOAD_MASK) | (uint64_t)others[i] << KVHI_HANDLE_TAG_SHIFT;
        uint64_t as_other_view = (view & KVHI_HANDLE_PAYLOAD_MASK) | (uint64_t)others[i] << KVHI_HANDLE_TAG_SHIFT;
        assert_kvh(KVH_ERR_BAD_HANDLE, plan_probe(e, as_other_plan));
        assert_kvh(KVH_ERR_BAD_HANDLE, view_probe(e, as_other_view));
    }
    assert_ok(plan_probe(e, plan));
    assert_ok(view_probe(e, view));
    assert_ok(plan_destroy(e, plan));
    assert_ok(view_destroy(e, view));
}

/* White-box: each table type's slot, moved to three generations short of
 * its wrap, retires when it gets there, through the public API. */
static void test_engine_table_slots_retire(void **state)
{
    (void)state;
    for (int kind = 0; kind < (int)(sizeof(kinds) / sizeof(kinds[0])); kind++) {
        const handle_kind *k = &kinds[kind];
        if (!k->table)
            continue;
        kvh_engine *e = k->open();
        uint64_t first, seen[5];
        assert_ok(k->create(e, &first));
        assert_ok(k->destroy(e, first));
        kvhi_handle_table *t = k->table(e);
        uint32_t slot = kvhi_handle_index(first), retired = t->retired;
        uint32_t near_wrap = t->gen_start - 3;
        if (near_wrap == 0) /* never a generation */
            near_wrap--;
        t->gens[slot] = near_wrap;
        int n_seen = 0;
        while (t->retired == retired) {
            assert_true(n_seen < 5);
            assert_ok(k->create(e, &seen[n_seen]));
            assert_int_equal(kvhi_handle_index(seen[n_seen]), slot);
            assert_ok(k->destroy(e, seen[n_seen]));
            n_seen++;
        }
        uint64_t h;
        assert_ok(k->create(e, &h));
        assert_true(kvhi_handle_index(h) != slot);
        assert_kvh(KVH_ERR_BAD_HANDLE, k->probe(e, first));
        for (int n = 0; n < n_seen; n++)
            assert_kvh(KVH_ERR_BAD_HANDLE, k->probe(e, seen[n]));
        assert_ok(k->destroy(e, h));
        assert_ok(tu_close(e));
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_make_and_split, tu_teardown),
        cmocka_unit_test_teardown(test_gen_next_skips_zero, tu_teardown),
        cmocka_unit_test_teardown(test_add_get_remove, tu_teardown),
        cmocka_unit_test_teardown(test_stale_generation_rejected, tu_teardown),
        cmocka_unit_test_teardown(test_wrong_tag_rejected, tu_teardown),
        cmocka_unit_test_teardown(test_forged_index_out_of_range, tu_teardown),
        cmocka_unit_test_teardown(test_growth_beyond_64, tu_teardown),
        cmocka_unit_test_teardown(test_random_against_reference, tu_teardown),
        cmocka_unit_test_teardown(test_table_slot_retires_at_wrap, tu_teardown),
        cmocka_unit_test_teardown(test_block_record_retires_at_wrap, tu_teardown),
        cmocka_unit_test_teardown(test_block_handle_widths, tu_teardown),
        cmocka_unit_test_teardown(test_engine_table_slots_retire, tu_teardown),
        cmocka_unit_test_teardown(test_freed_seq_stays_bad, tu_teardown),
        cmocka_unit_test_teardown(test_freed_block_stays_bad, tu_teardown),
        cmocka_unit_test_teardown(test_freed_fence_stays_bad, tu_teardown),
        cmocka_unit_test_teardown(test_freed_pool_stays_bad, tu_teardown),
        cmocka_unit_test_teardown(test_freed_context_stays_bad, tu_teardown),
        cmocka_unit_test_teardown(test_freed_plan_stays_bad, tu_teardown),
        cmocka_unit_test_teardown(test_freed_view_stays_bad, tu_teardown),
        cmocka_unit_test_teardown(test_plan_and_view_tags, tu_teardown),
    };
    return cmocka_run_group_tests_name("handles", tests, NULL, NULL);
}
