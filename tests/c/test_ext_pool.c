/* External KV pools (vLLM-style paged KV owned by an inference engine):
 * register, offload a slot into kvh, find it by prefix, restore it. */
#include "test_util.h"

enum { L = 2, H = 2, D = 8, BT = 4, SLOTS = 6 };
static const size_t ROW = D * 2;      /* f16 */
static const size_t TOKB = H * D * 2; /* one token, all heads */
static const size_t SLOTB = BT * H * D * 2;

typedef struct pool_mem {
    uint8_t *k[L], *v[L];
    void *kp[L], *vp[L];
    kvh_pool_layout layout;
} pool_mem;

/* vLLM layout: per layer [num_slots][block_tokens][kv_heads][head_dim]. */
static void pool_vllm(pool_mem *p, uint64_t seed)
{
    tu_rng r = {seed};
    memset(&p->layout, 0, sizeof(p->layout));
    for (int l = 0; l < L; l++) {
        p->k[l] = tu_alloc(SLOTS * SLOTB);
        p->v[l] = tu_alloc(SLOTS * SLOTB);
        tu_fill(&r, p->k[l], SLOTS * SLOTB);
        tu_fill(&r, p->v[l], SLOTS * SLOTB);
        p->kp[l] = p->k[l];
        p->vp[l] = p->v[l];
    }
    p->layout.struct_size = sizeof(kvh_pool_layout);
    p->layout.memory = KVH_MEMORY_HOST;
    p->layout.num_slots = SLOTS;
    p->layout.k_base = p->kp;
    p->layout.v_base = p->vp;
    p->layout.slot_stride = SLOTB;
    p->layout.token_stride = TOKB;
    p->layout.head_stride = ROW;
}

/* Element (slot, token, head) of layer l in a pool with this layout. */
static const uint8_t *pool_at(const pool_mem *p, int kv, uint32_t l, uint32_t slot, uint32_t t, uint32_t h)
{
    const uint8_t *base = kv ? p->v[l] : p->k[l];
    return base + slot * p->layout.slot_stride + t * p->layout.token_stride + h * p->layout.head_stride;
}

/* The KV of a pool slot as read_kv returns it ([token][head][dim]). */
static void pool_slot_rows(const pool_mem *p, int kv, uint32_t l, uint32_t slot, uint8_t *out)
{
    for (uint32_t t = 0; t < BT; t++)
        for (uint32_t h = 0; h < H; h++)
            memcpy(out + (t * H + h) * ROW, pool_at(p, kv, l, slot, t, h), ROW);
}

static int slots_equal(const pool_mem *p, uint32_t a, uint32_t b)
{
    uint8_t x[BT * H * D * 2], y[BT * H * D * 2];
    for (uint32_t l = 0; l < L; l++)
        for (int kv = 0; kv < 2; kv++) {
            pool_slot_rows(p, kv, l, a, x);
            pool_slot_rows(p, kv, l, b, y);
            if (memcmp(x, y, sizeof(x)) != 0)
                return 0;
        }
    return 1;
}

/* The sequence's tokens [pos, pos + BT) equal the pool slot's KV. */
static void assert_seq_matches_slot(kvh_engine *e, kvh_seq s, uint64_t pos, const pool_mem *p, uint32_t slot)
{
    uint8_t k[BT * TOKB], v[BT * TOKB], want[BT * TOKB];
    for (uint32_t l = 0; l < L; l++) {
        assert_ok(kvh_seq_read_kv(e, s, l, pos, BT, k, v));
        pool_slot_rows(p, 0, l, slot, want);
        assert_memory_equal(k, want, sizeof(k));
        pool_slot_rows(p, 1, l, slot, want);
        assert_memory_equal(v, want, sizeof(v));
    }
}

static kvh_engine *open_engine(uint64_t dev, uint64_t host)
{
    return tu_open(L, H, D, BT, KVH_DTYPE_F16, dev, host, 0);
}

static void test_offload_lookup_restore(void **state)
{
    (void)state;
    kvh_engine *e = open_engine(8, 8);
    pool_mem *p = tu_alloc(sizeof(pool_mem));
    pool_vllm(p, tu_seed(0xe47));
    kvh_pool pool = {0};
    assert_ok(kvh_pool_register(e, &p->layout, &pool));
    assert_true(pool.id != 0);
    /* The layout's pointer arrays are copied: changing ours has no effect. */
    void *saved = p->kp[0];
    p->kp[0] = NULL;

    int32_t t0[BT] = {11, 12, 13, 14}, t1[BT] = {21, 22, 23, 24};
    uint64_t h0, h1;
    assert_ok(kvh_prefix_hash(e, 0, t0, BT, &h0));
    assert_ok(kvh_prefix_hash(e, h0, t1, BT, &h1));
    kvh_block b0 = {0}, b1 = {0};
    kvh_stats s0 = tu_stats(e);
    assert_ok(kvh_pool_offload(e, pool, 1, 0, t0, BT, 3, &b0));
    assert_ok(kvh_pool_offload(e, pool, 2, h0, t1, BT, 3, &b1));
    p->kp[0] = saved;
    kvh_block_info i0 = tu_binfo(e, b0), i1 = tu_binfo(e, b1);
    assert_int_equal(i0.published, 1);
    assert_int_equal(i0.tokens, BT);
    assert_int_equal(i0.hash, h0);
    assert_int_equal(i0.refs, 1); /* retained for the caller */
    assert_int_equal(i0.agent, 3);
    assert_int_equal(i1.hash, h1);
    assert_int_equal(i1.published, 1);
    assert_int_equal(tu_stats(e).blocks_allocated - s0.blocks_allocated, 2);

    /* Found by tokens. */
    int32_t both[2 * BT];
    memcpy(both, t0, sizeof(t0));
    memcpy(both + BT, t1, sizeof(t1));
    kvh_block found[3] = {{0}};
    size_t n = 0;
    assert_ok(kvh_prefix_lookup(e, both, 2 * BT, found, 3, &n));
    assert_int_equal(n, 2);
    assert_int_equal(found[0].id, b0.id);
    assert_int_equal(found[1].id, b1.id);
    assert_int_equal(tu_binfo(e, b0).refs, 2); /* lookup retains */
    assert_ok(kvh_block_release(e, found[0]));
    assert_ok(kvh_block_release(e, found[1]));
    assert_ok(kvh_prefix_lookup(e, both, 2 * BT, found, 1, &n)); /* cap limits */
    assert_int_equal(n, 1);
    assert_ok(kvh_block_release(e, found[0]));
    assert_ok(kvh_prefix_lookup(e, t1, BT, found, 3, &n)); /* t1 alone: other parent */
    assert_int_equal(n, 0);

    /* A sequence picks them up with match_prefix: the bytes are the pool's. */
    kvh_seq s = tu_seq_new(e, 4);
    size_t m = 0;
    assert_ok(kvh_seq_match_prefix(e, s, both, 2 * BT, &m));
    assert_int_equal(m, 2 * BT);
    assert_int_equal(tu_seq_block(e, s, 0).id, b0.id);
    assert_seq_matches_slot(e, s, 0, p, 1);
    assert_seq_matches_slot(e, s, BT, p, 2);

    /* Offloading the same tokens again returns the same block, no copy:
     * slot 3 holds other data, the block keeps slot 1's. */
    kvh_stats s1 = tu_stats(e);
    kvh_block again = {0};
    assert_ok(kvh_pool_offload(e, pool, 3, 0, t0, BT, 3, &again));
    assert_int_equal(again.id, b0.id);
    assert_int_equal(tu_stats(e).blocks_allocated, s1.blocks_allocated);
    assert_int_equal(tu_binfo(e, b0).refs, 3); /* ours twice + the sequence */
    assert_false(slots_equal(p, 1, 3));
    assert_ok(kvh_pool_restore(e, pool, b0, 4));
    assert_true(slots_equal(p, 1, 4)); /* exact bytes */
    assert_ok(kvh_pool_restore(e, pool, b1, 5));
    assert_true(slots_equal(p, 2, 5));
    assert_seq_matches_slot(e, s, 0, p, 1);

    /* Restore from a block that lives in the device tier. */
    assert_ok(kvh_seq_acquire(e, s, 0, 2 * BT, NULL));
    assert_int_equal(tu_binfo(e, b1).tier, KVH_TIER_DEVICE);
    memset(p->k[0] + 0 * SLOTB, 0, SLOTB);
    assert_ok(kvh_pool_restore(e, pool, b1, 0));
    assert_true(slots_equal(p, 2, 0));
    assert_ok(kvh_seq_release(e, s, 0, 2 * BT));

    /* A block a sequence produced can be restored into the pool too. */
    kvh_seq w = tu_seq_new(e, 4);
    int32_t t2[BT] = {31, 32, 33, 34};
    assert_ok(kvh_seq_append(e, w, t2, BT));
    tu_write_pattern(e, w, L, TOKB, 77, 0, BT);
    kvh_block wb = tu_seq_block(e, w, 0);
    assert_ok(kvh_pool_restore(e, pool, wb, 0));
    uint8_t rows[BT * TOKB], want[TOKB];
    for (uint32_t l = 0; l < L; l++)
        for (int kv = 0; kv < 2; kv++) {
            pool_slot_rows(p, kv, l, 0, rows);
            for (uint32_t t = 0; t < BT; t++) {
                tu_pattern(want, TOKB, 77, l, t, kv);
                assert_memory_equal(rows + t * TOKB, want, TOKB);
            }
        }

    assert_ok(kvh_block_release(e, b0));
    assert_ok(kvh_block_release(e, again));
    assert_ok(kvh_block_release(e, b1));
    assert_int_equal(tu_binfo(e, b0).refs, 1); /* the sequence */
    assert_ok(kvh_seq_free(e, s));
    kvh_block_info ci = tu_binfo(e, b0);
    assert_int_equal(ci.refs, 0); /* cached */
    assert_int_equal(ci.published, 1);
    assert_ok(kvh_pool_unregister(e, pool));
}

static void test_bad_slots_and_args(void **state)
{
    (void)state;
    kvh_engine *e = open_engine(8, 8);
    pool_mem *p = tu_alloc(sizeof(pool_mem));
    pool_vllm(p, 5);
    kvh_pool pool;
    assert_ok(kvh_pool_register(e, &p->layout, &pool));
    int32_t t[BT] = {1, 2, 3, 4};
    kvh_block b = {0x1234};
    assert_kvh(KVH_ERR_RANGE, kvh_pool_offload(e, pool, SLOTS, 0, t, BT, 0, &b));
    assert_kvh(KVH_ERR_RANGE, kvh_pool_offload(e, pool, UINT32_MAX, 0, t, BT, 0, &b));
    assert_int_equal(b.id, 0x1234);
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload(e, pool, 0, 0, t, BT - 1, 0, &b));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload(e, pool, 0, 0, t, BT + 1, 0, &b));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload(e, pool, 0, 0, NULL, BT, 0, &b));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload(e, pool, 0, 0, t, BT, 0, NULL));
    assert_int_equal(b.id, 0x1234);
    assert_int_equal(tu_stats(e).blocks_allocated, 0);
    assert_ok(kvh_pool_offload(e, pool, 0, 0, t, BT, 0, &b));
    assert_kvh(KVH_ERR_RANGE, kvh_pool_restore(e, pool, b, SLOTS));
    assert_kvh(KVH_ERR_RANGE, kvh_pool_restore(e, pool, b, UINT32_MAX));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_restore(e, pool, (kvh_block){0}, 0));
    /* A block whose KV is not fully written cannot be restored. */
    kvh_seq s = tu_seq_new(e, 0);
    assert_ok(kvh_seq_append(e, s, t, BT));
    uint8_t k[TOKB], v[TOKB];
    memset(k, 1, sizeof(k));
    memset(v, 1, sizeof(v));
    assert_ok(kvh_seq_write_kv(e, s, 0, 0, 1, k, v));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_restore(e, pool, tu_seq_block(e, s, 0), 1));
    /* Unregister; the pool handle is dead afterwards. */
    assert_ok(kvh_pool_unregister(e, pool));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_unregister(e, pool));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_offload(e, pool, 0, 0, t, BT, 0, &b));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_restore(e, pool, b, 0));
    assert_ok(kvh_pool_unregister(e, (kvh_pool){0}));
    /* Blocks offloaded before stay usable. */
    assert_int_equal(tu_binfo(e, b).published, 1);
    assert_ok(kvh_block_release(e, b));
}

static void test_register_validation(void **state)
{
    (void)state;
    kvh_engine *e = open_engine(8, 8);
    pool_mem *p = tu_alloc(sizeof(pool_mem));
    pool_vllm(p, 6);
    kvh_pool pool = {0x77};
    kvh_pool_layout lay;
    /* CUDA memory without the CUDA backend. */
    lay = p->layout;
    lay.memory = KVH_MEMORY_CUDA;
    assert_kvh(KVH_ERR_UNSUPPORTED, kvh_pool_register(e, &lay, &pool));
    assert_true(kvh_last_error()[0] != '\0');
    lay = p->layout;
    lay.memory = 2;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_register(e, &lay, &pool));
    lay = p->layout;
    lay.num_slots = 0;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_register(e, &lay, &pool));
    lay = p->layout;
    lay.token_stride = ROW - 1;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_register(e, &lay, &pool));
    lay = p->layout;
    lay.head_stride = 0;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_register(e, &lay, &pool));
    lay = p->layout;
    lay.k_base = NULL;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_register(e, &lay, &pool));
    lay = p->layout;
    lay.v_base = NULL;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_register(e, &lay, &pool));
    void *holes[L] = {p->k[0], NULL};
    lay = p->layout;
    lay.k_base = holes;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_register(e, &lay, &pool));
    /* Strides whose extent from a base pointer wraps around the address
     * range: refused here rather than copying to wrapped addresses
     * (slot_stride 2^63 was taken). 5 slot and 3 token steps of 2^63 wrap;
     * one head step of UINT64_MAX does. */
    const uint64_t far[] = {1ull << 63, UINT64_MAX / 2, UINT64_MAX};
    for (size_t i = 0; i < 3; i++) {
        lay = p->layout;
        lay.slot_stride = far[i];
        assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_register(e, &lay, &pool));
        lay = p->layout;
        lay.token_stride = far[i];
        assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_register(e, &lay, &pool));
    }
    lay = p->layout;
    lay.head_stride = UINT64_MAX;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_register(e, &lay, &pool));
    void *top[L] = {(void *)(UINTPTR_MAX - 64), (void *)(UINTPTR_MAX - 64)};
    lay = p->layout;
    lay.v_base = top;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_register(e, &lay, &pool));
    lay = p->layout;
    lay.num_slots = 1;
    lay.slot_stride = UINT64_MAX; /* one slot: its stride is never used */
    kvh_pool one;
    assert_ok(kvh_pool_register(e, &lay, &one));
    assert_ok(kvh_pool_unregister(e, one));
    lay = p->layout;
    uint32_t sizes[] = {0, 8, sizeof(lay) - 8, sizeof(lay) + 8};
    for (size_t i = 0; i < 4; i++) {
        lay.struct_size = sizes[i];
        assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_pool_register(e, &lay, &pool));
    }
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_register(e, NULL, &pool));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_register(e, &p->layout, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_register(NULL, &p->layout, &pool));
    assert_int_equal(pool.id, 0x77); /* untouched by every failure */
    /* Several pools at once. */
    kvh_pool a, b;
    assert_ok(kvh_pool_register(e, &p->layout, &a));
    assert_ok(kvh_pool_register(e, &p->layout, &b));
    assert_true(a.id != b.id);
    assert_ok(kvh_pool_unregister(e, a));
    assert_ok(kvh_pool_unregister(e, b));
}

/* Other layouts: head-major slots ([slot][head][token][dim]) with padding
 * between slots. */
static void test_head_major_padded_layout(void **state)
{
    (void)state;
    kvh_engine *e = open_engine(8, 8);
    pool_mem *p = tu_alloc(sizeof(pool_mem));
    tu_rng r = {tu_seed(42)};
    const size_t slot_stride = SLOTB + 64;
    for (int l = 0; l < L; l++) {
        p->k[l] = tu_alloc(SLOTS * slot_stride);
        p->v[l] = tu_alloc(SLOTS * slot_stride);
        tu_fill(&r, p->k[l], SLOTS * slot_stride);
        tu_fill(&r, p->v[l], SLOTS * slot_stride);
        p->kp[l] = p->k[l];
        p->vp[l] = p->v[l];
    }
    p->layout = (kvh_pool_layout){.struct_size = sizeof(kvh_pool_layout),
                                  .memory = KVH_MEMORY_HOST,
                                  .num_slots = SLOTS,
                                  .k_base = p->kp,
                                  .v_base = p->vp,
                                  .slot_stride = slot_stride,
                                  .token_stride = ROW,
                                  .head_stride = BT * ROW};
    kvh_pool pool;
    assert_ok(kvh_pool_register(e, &p->layout, &pool));
    int32_t t[BT] = {5, 6, 7, 8};
    kvh_block b;
    assert_ok(kvh_pool_offload(e, pool, 2, 0, t, BT, 0, &b));
    kvh_seq s = tu_seq_new(e, 0);
    size_t m = 0;
    assert_ok(kvh_seq_match_prefix(e, s, t, BT, &m));
    assert_int_equal(m, BT);
    assert_seq_matches_slot(e, s, 0, p, 2);
    /* Restore into slot 4 writes the slot and nothing around it. */
    uint8_t *before = tu_alloc(SLOTS * slot_stride);
    memcpy(before, p->k[1], SLOTS * slot_stride);
    assert_ok(kvh_pool_restore(e, pool, b, 4));
    assert_true(slots_equal(p, 2, 4));
    for (size_t i = 0; i < SLOTS * slot_stride; i++) {
        int in_slot4 = i >= 4 * slot_stride && i < 4 * slot_stride + SLOTB;
        if (!in_slot4)
            assert_int_equal(p->k[1][i], before[i]);
    }
    assert_ok(kvh_block_release(e, b));
    assert_ok(kvh_pool_unregister(e, pool));
}

/* Offload lands below the device tier when there is one; without a host
 * tier it lands in the device tier. */
static void test_offload_tier_choice(void **state)
{
    (void)state;
    kvh_engine *e = open_engine(4, 4);
    pool_mem *p = tu_alloc(sizeof(pool_mem));
    pool_vllm(p, 8);
    kvh_pool pool;
    assert_ok(kvh_pool_register(e, &p->layout, &pool));
    int32_t t[BT] = {1, 2, 3, 4};
    kvh_block b;
    assert_ok(kvh_pool_offload(e, pool, 0, 0, t, BT, 0, &b));
    assert_int_equal(tu_binfo(e, b).tier, KVH_TIER_HOST);
    assert_ok(kvh_block_release(e, b));
    assert_ok(tu_close(e));

    e = open_engine(4, 0);
    assert_ok(kvh_pool_register(e, &p->layout, &pool));
    assert_ok(kvh_pool_offload(e, pool, 0, 0, t, BT, 0, &b));
    assert_int_equal(tu_binfo(e, b).tier, KVH_TIER_DEVICE);
    kvh_seq s = tu_seq_new(e, 0);
    size_t m = 0;
    assert_ok(kvh_seq_match_prefix(e, s, t, BT, &m));
    assert_int_equal(m, BT);
    assert_seq_matches_slot(e, s, 0, p, 0);
    assert_ok(kvh_block_release(e, b));
}

/* With the host tier full of referenced blocks, an offload still has the
 * device tier: "no room in any tier" is not true. */
static void test_offload_host_full_device_free(void **state)
{
    (void)state;
    kvh_engine *e = open_engine(4, 2);
    pool_mem *p = tu_alloc(sizeof(pool_mem));
    pool_vllm(p, 9);
    kvh_pool pool;
    assert_ok(kvh_pool_register(e, &p->layout, &pool));
    kvh_block b[3];
    int32_t t[3][BT] = {{1, 2, 3, 4}, {5, 6, 7, 8}, {9, 10, 11, 12}};
    assert_ok(kvh_pool_offload(e, pool, 0, 0, t[0], BT, 0, &b[0]));
    assert_ok(kvh_pool_offload(e, pool, 1, 0, t[1], BT, 0, &b[1]));
    assert_int_equal(tu_tier(e, KVH_TIER_HOST).used_blocks, 2);
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, 0);
    kvh_status st = kvh_pool_offload(e, pool, 2, 0, t[2], BT, 0, &b[2]);
    if (st != KVH_OK)
        print_error("offload with a full host tier and an empty device tier: %s (%s)\n", kvh_status_name(st),
                    kvh_last_error());
    assert_ok(st);
    assert_int_equal(tu_binfo(e, b[2]).tier, KVH_TIER_DEVICE);
    assert_ok(kvh_pool_restore(e, pool, b[2], 5));
    assert_true(slots_equal(p, 2, 5));
    for (int i = 0; i < 3; i++)
        assert_ok(kvh_block_release(e, b[i]));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_offload_lookup_restore, tu_teardown),
        cmocka_unit_test_teardown(test_bad_slots_and_args, tu_teardown),
        cmocka_unit_test_teardown(test_register_validation, tu_teardown),
        cmocka_unit_test_teardown(test_head_major_padded_layout, tu_teardown),
        cmocka_unit_test_teardown(test_offload_tier_choice, tu_teardown),
        cmocka_unit_test_teardown(test_offload_host_full_device_free, tu_teardown),
    };
    return cmocka_run_group_tests_name("ext_pool", tests, NULL, NULL);
}
