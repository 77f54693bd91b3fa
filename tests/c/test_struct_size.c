/* The struct_size policy of kvh.h ("Params and info structs"), struct by
 * struct: a shorter size (a multiple of 8) takes defaults past it on
 * input, is filled only up to it on output, and a larger or unaligned
 * size is refused. */
#include "test_util.h"

#include "abi/api_attention.h"
#include "core/engine.h"

/* The struct of an older kvh.h that ends before field f. */
#define SIZE_BEFORE(T, f) (offsetof(T, f) / 8 * 8)

#define PAD 16
#define FILL 0xA5

/* *_init() for a shorter struct writes the defaults up to n, n into
 * struct_size and nothing past n; larger and unaligned sizes are refused. */
#define CHECK_INIT(T, init, n)                                                                                         \
    do {                                                                                                               \
        T full;                                                                                                        \
        assert_ok(init(&full, sizeof(full)));                                                                          \
        union {                                                                                                        \
            T s;                                                                                                       \
            uint8_t raw[sizeof(T) + PAD];                                                                              \
        } u;                                                                                                           \
        memset(&u, FILL, sizeof(u));                                                                                   \
        assert_ok(init(&u.s, (n)));                                                                                    \
        assert_int_equal(u.s.struct_size, (n));                                                                        \
        assert_memory_equal(u.raw + 4, (uint8_t *)&full + 4, (n)-4);                                                   \
        for (size_t i_ = (n); i_ < sizeof(u); i_++)                                                                    \
            assert_int_equal(u.raw[i_], FILL);                                                                         \
        assert_kvh(KVH_ERR_STRUCT_SIZE, init(&u.s, sizeof(T) + 8));                                                    \
        assert_kvh(KVH_ERR_STRUCT_SIZE, init(&u.s, (n) + 4));                                                          \
        assert_kvh(KVH_ERR_STRUCT_SIZE, init(&u.s, 4));                                                                \
    } while (0)

/* An output struct of n bytes: the first n bytes are what the full call
 * gives, struct_size is n, nothing past n is written; a larger size and
 * an unaligned one are refused. `call` uses the name `out`. */
#define CHECK_INFO(T, n, call)                                                                                         \
    do {                                                                                                               \
        union {                                                                                                        \
            T s;                                                                                                       \
            uint8_t raw[sizeof(T) + PAD];                                                                              \
        } full, u;                                                                                                     \
        T *out = &full.s;                                                                                              \
        memset(&full, 0, sizeof(full));                                                                                \
        full.s.struct_size = sizeof(T);                                                                                \
        assert_ok(call);                                                                                               \
        out = &u.s;                                                                                                    \
        memset(&u, FILL, sizeof(u));                                                                                   \
        u.s.struct_size = (uint32_t)(n);                                                                               \
        assert_ok(call);                                                                                               \
        assert_int_equal(u.s.struct_size, (n));                                                                        \
        assert_memory_equal(u.raw + 4, full.raw + 4, (n)-4);                                                           \
        for (size_t i_ = (n); i_ < sizeof(u); i_++)                                                                    \
            assert_int_equal(u.raw[i_], FILL);                                                                         \
        memset(&u, FILL, sizeof(u));                                                                                   \
        u.s.struct_size = sizeof(T) + 8;                                                                               \
        assert_kvh(KVH_ERR_STRUCT_SIZE, call);                                                                         \
        u.s.struct_size = (uint32_t)(n) + 4;                                                                           \
        assert_kvh(KVH_ERR_STRUCT_SIZE, call);                                                                         \
        for (size_t i_ = 4; i_ < sizeof(u); i_++)                                                                      \
            assert_int_equal(u.raw[i_], FILL);                                                                         \
    } while (0)

static void test_config(void **state)
{
    (void)state;
    CHECK_INIT(kvh_config, kvh_config_init, SIZE_BEFORE(kvh_config, lru_k));
    /* An older config: lru_k and what follows are past its size, so a bad
     * lru_k there is never read and the default (2) applies. */
    kvh_config c = tu_cfg(1, 1, 8, 4, KVH_DTYPE_F32, 8, 8, 0);
    c.struct_size = SIZE_BEFORE(kvh_config, lru_k);
    c.lru_k = 99;
    c.log_level = 99;
    kvh_engine *e = tu_open_cfg(&c);
    assert_int_equal(e->cfg.lru_k, 2);
    assert_int_equal(e->cfg.log_level, KVH_LOG_WARN);
    assert_int_equal(e->cfg.migration_threads, 0);
    c.struct_size = sizeof(c) + 8;
    kvh_engine *ne = NULL;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_engine_open(&c, &ne));
    c.struct_size = SIZE_BEFORE(kvh_config, lru_k) + 4;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_engine_open(&c, &ne));
    assert_null(ne);
}

static void test_attention_params(void **state)
{
    (void)state;
    CHECK_INIT(kvh_attention_params, kvh_attention_params_init, SIZE_BEFORE(kvh_attention_params, scale));
    kvh_engine *e = tu_open(1, 2, 8, 4, KVH_DTYPE_F32, 8, 8, 0);
    kvh_attention_params p, pr;
    assert_ok(kvh_attention_params_init(&p, sizeof(p)));
    p.struct_size = SIZE_BEFORE(kvh_attention_params, scale);
    p.num_q_heads = 4;
    p.io_dtype = 99; /* past the size: the default applies */
    uint64_t rows = 0;
    float q[1], out[1];
    assert_ok(kvhi_attn_check_args(e, 0, NULL, NULL, 0, false, q, out, &p, &pr, &rows));
    assert_int_equal(pr.num_q_heads, 4);
    assert_int_equal(pr.io_dtype, KVH_DTYPE_F32);
    p.struct_size = sizeof(p) + 8;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvhi_attn_check_args(e, 0, NULL, NULL, 0, false, q, out, &p, &pr, &rows));
}

static void test_context_and_region_params(void **state)
{
    (void)state;
    CHECK_INIT(kvh_context_params, kvh_context_params_init, SIZE_BEFORE(kvh_context_params, chunk_bytes));
    CHECK_INIT(kvh_weight_region_params, kvh_weight_region_params_init, SIZE_BEFORE(kvh_weight_region_params, size));
    kvh_engine *e = tu_open(1, 1, 8, 4, KVH_DTYPE_F32, 8, 8, 0);
    kvh_context_params cp;
    assert_ok(kvh_context_params_init(&cp, sizeof(cp)));
    cp.struct_size = SIZE_BEFORE(kvh_context_params, chunk_bytes);
    cp.chunk_bytes = 0; /* invalid, but past the size */
    kvh_context ctx;
    assert_ok(kvh_context_create(e, &cp, &ctx));
    CHECK_INFO(kvh_context_info, SIZE_BEFORE(kvh_context_info, bytes_disk), kvh_context_info_get(e, ctx, out));
    CHECK_INFO(kvh_context_info, 8, kvh_context_info_get(e, ctx, out));
    /* A region struct that ends before size: size takes its default, 0. */
    kvh_weight_region_params rp;
    assert_ok(kvh_weight_region_params_init(&rp, sizeof(rp)));
    rp.struct_size = SIZE_BEFORE(kvh_weight_region_params, size);
    rp.size = 256;
    uint32_t region;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_context_add_region(e, ctx, &rp, &region));
    assert_non_null(strstr(kvh_last_error(), "size is 0"));
    rp.struct_size = sizeof(rp) + 8;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_context_add_region(e, ctx, &rp, &region));
    cp.struct_size = sizeof(cp) + 8;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_context_create(e, &cp, &ctx));
    CHECK_INFO(kvh_weight_stats, SIZE_BEFORE(kvh_weight_stats, switches), kvh_weight_stats_get(e, out));
}

static void test_admission_and_seq_params(void **state)
{
    (void)state;
    CHECK_INIT(kvh_admission_params, kvh_admission_params_init, SIZE_BEFORE(kvh_admission_params, short_device_bytes));
    CHECK_INIT(kvh_seq_params, kvh_seq_params_init, SIZE_BEFORE(kvh_seq_params, token_budget));
    kvh_engine *e = tu_open(1, 1, 8, 4, KVH_DTYPE_F32, 8, 8, 0);
    kvh_admission_params ap;
    assert_ok(kvh_admission_params_init(&ap, sizeof(ap)));
    ap.struct_size = SIZE_BEFORE(kvh_admission_params, short_max_tokens);
    ap.short_max_tokens = 7; /* past the size: 4096 applies */
    assert_ok(kvh_admission_configure(e, &ap));
    kvh_admission_info ai = {.struct_size = sizeof(ai)};
    assert_ok(kvh_admission_info_get(e, &ai));
    assert_int_equal(ai.short_max_tokens, 4096);
    ap.struct_size = sizeof(ap) + 8;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_admission_configure(e, &ap));
    CHECK_INFO(kvh_admission_info, SIZE_BEFORE(kvh_admission_info, long_quota_blocks), kvh_admission_info_get(e, out));
    kvh_seq_params sp;
    assert_ok(kvh_seq_params_init(&sp, sizeof(sp)));
    sp.struct_size = SIZE_BEFORE(kvh_seq_params, token_budget);
    sp.agent = 3;
    sp.context.id = 0x1234; /* a forged handle, past the size: never read */
    kvh_seq s;
    assert_ok(kvh_seq_create_ex(e, &sp, &s));
    sp.struct_size = sizeof(sp) + 8;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_seq_create_ex(e, &sp, &s));
}

static void test_engine_infos(void **state)
{
    (void)state;
    kvh_engine *e = tu_open(1, 1, 8, 4, KVH_DTYPE_F32, 8, 8, 0);
    CHECK_INFO(kvh_tier_info, SIZE_BEFORE(kvh_tier_info, used_bytes), kvh_tier_info_get(e, KVH_TIER_HOST, out));
    CHECK_INFO(kvh_tier_info, 8, kvh_tier_info_get(e, KVH_TIER_DEVICE, out));
    CHECK_INFO(kvh_stats, SIZE_BEFORE(kvh_stats, evictions), kvh_engine_stats(e, out));
    kvh_block b;
    assert_ok(kvh_block_alloc(e, 1, &b));
    CHECK_INFO(kvh_block_info, SIZE_BEFORE(kvh_block_info, hash), kvh_block_info_get(e, b, out));
    CHECK_INFO(kvh_block_info, 8, kvh_block_info_get(e, b, out));
}

static void test_pool_layout_needs_every_field(void **state)
{
    (void)state;
    kvh_engine *e = tu_open(1, 1, 8, 4, KVH_DTYPE_F32, 8, 8, 0);
    float k[8 * 4 * 8], v[8 * 4 * 8];
    void *kb[1] = {k}, *vb[1] = {v};
    kvh_pool_layout lay = {.struct_size = sizeof(lay),
                           .memory = KVH_MEMORY_HOST,
                           .num_slots = 8,
                           .k_base = kb,
                           .v_base = vb,
                           .slot_stride = 4 * 8 * sizeof(float),
                           .token_stride = 8 * sizeof(float),
                           .head_stride = 8 * sizeof(float)};
    kvh_pool pool;
    lay.struct_size = SIZE_BEFORE(kvh_pool_layout, head_stride);
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_pool_register(e, &lay, &pool));
    lay.struct_size = sizeof(lay) + 8;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_pool_register(e, &lay, &pool));
    lay.struct_size = sizeof(lay);
    assert_ok(kvh_pool_register(e, &lay, &pool));
    assert_ok(kvh_pool_unregister(e, pool));
}

static void test_vmap_view(void **state)
{
    (void)state;
    kvh_config c = tu_cfg(1, 1, 1024, 4, KVH_DTYPE_F32, 8, 8, 0);
    c.vmap = 1;
    kvh_engine *e = NULL;
    if (kvh_engine_open(&c, &e) != KVH_OK)
        skip();
    tu_track_engine(e);
    kvh_seq s;
    assert_ok(kvh_seq_create(e, 0, &s));
    kvh_vmap *m = NULL;
    kvh_status st = kvh_seq_vmap(e, s, 0, 64, &m);
    if (st == KVH_ERR_UNSUPPORTED)
        skip();
    assert_ok(st);
    CHECK_INFO(kvh_vmap_view, SIZE_BEFORE(kvh_vmap_view, generation), kvh_vmap_get(e, m, out));
    CHECK_INFO(kvh_vmap_view, 8, kvh_vmap_get(e, m, out));
    assert_ok(kvh_vmap_release(e, m));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_config, tu_teardown),
        cmocka_unit_test_teardown(test_attention_params, tu_teardown),
        cmocka_unit_test_teardown(test_context_and_region_params, tu_teardown),
        cmocka_unit_test_teardown(test_admission_and_seq_params, tu_teardown),
        cmocka_unit_test_teardown(test_engine_infos, tu_teardown),
        cmocka_unit_test_teardown(test_pool_layout_needs_every_field, tu_teardown),
        cmocka_unit_test_teardown(test_vmap_view, tu_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
