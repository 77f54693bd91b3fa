/* The memory behind views (core/vmap_cpu_arena.c): each backing forced
 * with KVH_VMAP_BACKING (hugetlb, thp, 4k) gives views that equal
 * kvh_seq_read_kv and paged attention bit for bit, before and after a
 * refresh, and kvh_vmap_get names it. A backing the machine does not
 * offer is refused at open with KVH_ERR_UNSUPPORTED.
 *
 *   test_vmap_backing            4k and the default choice
 *   test_vmap_backing NAME       NAME only; exit 77 (skipped) where the
 *                                machine does not offer it */
#include <stdbool.h>
#include <stdlib.h>

#include "test_util.h"
#include "core/vmap_cpu_arena.h"

/* f32, head_dim 64, 16 tokens: one head's K of a block = 4 KiB, so a
 * 2 MiB run of one head is 512 blocks; the tier holds 2 slabs. */
enum { L = 2, H = 2, D = 64, BT = 16, SLOTS = 1024, TOKENS = 600 * BT };

static const char *only; /* argv[1] */

static kvh_config vmap_cfg(void)
{
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F32, SLOTS, 0, 1);
    c.vmap = 1;
    return c;
}

static float val(uint64_t t, uint32_t h, int kv, uint32_t d)
{
    tu_rng r = {(t << 16) ^ ((uint64_t)h << 8) ^ ((uint64_t)kv << 4) ^ d};
    return (float)((int64_t)(tu_next(&r) % 2001) - 1000) / 500.0f;
}

static void append_tokens(kvh_engine *e, kvh_seq s, uint64_t pos, size_t n)
{
    int32_t *tok = tu_alloc(sizeof(int32_t) * n);
    float *k = tu_alloc(sizeof(float) * n * H * D), *v = tu_alloc(sizeof(float) * n * H * D);
    tu_iota(tok, n, (int32_t)pos + 1);
    assert_ok(kvh_seq_append(e, s, tok, n));
    for (size_t t = 0; t < n; t++)
        for (uint32_t h = 0; h < H; h++)
            for (uint32_t d = 0; d < D; d++) {
                k[(t * H + h) * D + d] = val(pos + t, h, 0, d);
                v[(t * H + h) * D + d] = val(pos + t, h, 1, d);
            }
    for (uint32_t l = 0; l < L; l++)
        assert_ok(kvh_seq_write_kv(e, s, l, pos, n, k, v));
    tu_free(tok);
    tu_free(k);
    tu_free(v);
}

/* The view equals kvh_seq_read_kv, and decode over it equals paged. */
static void check(kvh_engine *e, kvh_seq s, kvh_vmap *m, const char *backing)
{
    kvh_vmap_view v = {.struct_size = sizeof(v)};
    assert_ok(kvh_vmap_get(e, m, &v));
    if (backing)
        assert_string_equal(v.backing, backing);
    assert_true(v.map_unit >= 4096);
    uint64_t n = tu_seq_len(e, s);
    assert_int_equal(v.n_tokens, n);
    float *k = tu_alloc(sizeof(float) * n * H * D), *vv = tu_alloc(sizeof(float) * n * H * D);
    assert_ok(kvh_seq_read_kv(e, s, v.layer, 0, n, k, vv));
    for (uint32_t h = 0; h < H; h++)
        for (uint64_t t = 0; t < n; t++) {
            assert_memory_equal((const float *)((const uint8_t *)v.k + h * v.head_stride) + t * D, k + (t * H + h) * D,
                                sizeof(float) * D);
            assert_memory_equal((const float *)((const uint8_t *)v.v + h * v.head_stride) + t * D, vv + (t * H + h) * D,
                                sizeof(float) * D);
        }
    tu_free(k);
    tu_free(vv);
    float q[2 * H * D], a[2 * H * D], b[2 * H * D];
    for (uint32_t i = 0; i < 2 * H * D; i++)
        q[i] = val(7, i, 0, 1);
    kvh_attention_params p;
    assert_ok(kvh_attention_params_init(&p, sizeof(p)));
    p.num_q_heads = 2 * H;
    memset(a, 0xff, sizeof(a));
    memset(b, 0x7f, sizeof(b));
    assert_ok(kvh_attention_decode(e, v.layer, &s, 1, q, a, &p));
    assert_ok(kvh_attention_decode_vmap(e, &m, 1, q, b, &p));
    assert_memory_equal(a, b, sizeof(a));
}

/* Opens an engine on `backing` (NULL: the default choice); false when the
 * machine does not offer it. */
static bool open_on(const char *backing, kvh_engine **e)
{
    if (backing)
        setenv("KVH_VMAP_BACKING", backing, 1);
    else
        unsetenv("KVH_VMAP_BACKING");
    kvh_config c = vmap_cfg();
    kvh_status st = kvh_engine_open(&c, e);
    unsetenv("KVH_VMAP_BACKING");
    if (st == KVH_ERR_UNSUPPORTED)
        return false;
    assert_ok(st);
    return true;
}

static void run_backing(const char *backing)
{
    kvh_engine *e;
    if (!open_on(backing, &e)) {
        assert_non_null(backing);
        assert_string_not_equal(backing, "4k"); /* always offered */
        skip();
    }
    kvh_seq s = tu_seq_new(e, 0);
    append_tokens(e, s, 0, TOKENS - 3);
    kvh_vmap *m;
    assert_ok(kvh_seq_vmap(e, s, 1, TOKENS + 4 * BT, &m));
    check(e, s, m, backing);
    /* into the last block, then two more blocks */
    append_tokens(e, s, TOKENS - 3, 3 + 2 * BT);
    int32_t changed = 0;
    assert_ok(kvh_vmap_refresh(e, m, &changed));
    assert_true(changed);
    check(e, s, m, backing);
    assert_ok(kvh_seq_truncate(e, s, TOKENS / 2 + 5));
    assert_ok(kvh_vmap_refresh(e, m, &changed));
    check(e, s, m, backing);
    assert_ok(kvh_vmap_release(e, m));
    assert_ok(kvh_seq_free(e, s));
    assert_ok(kvh_engine_close(e));
}

static void test_4k(void **state) { run_backing("4k"); }
static void test_default(void **state) { run_backing(NULL); }
static void test_named(void **state) { run_backing(only); }

static void test_unknown_backing_refused(void **state)
{
    setenv("KVH_VMAP_BACKING", "1g", 1);
    kvh_config c = vmap_cfg();
    kvh_engine *e = NULL;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(&c, &e));
    unsetenv("KVH_VMAP_BACKING");
}

int main(int argc, char **argv)
{
    if (argc > 1) {
        only = argv[1];
        kvhi_slab_layout l;
        kvhi_slab_layout_init(&l, (uint64_t)BT * D * 4, 2 * L * H, 2ull << 20, SLOTS);
        if (!kvhi_vmap_cpu_backing_available(only, &l, (uint64_t)SLOTS * l.block_bytes)) {
            printf("vmap backing %s is not offered by this machine: skipped\n", only);
            return 77;
        }
        const struct CMUnitTest named[] = {cmocka_unit_test(test_named)};
        return cmocka_run_group_tests(named, NULL, NULL);
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_4k),
        cmocka_unit_test(test_default),
        cmocka_unit_test(test_unknown_backing_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
