/* Tenant scopes (kvh.h "Tenant scopes"): the default scope hashes as it
 * always did (fixed values), two scopes with the same tokens share no
 * block through any lookup (match, lookup, pool offload dedupe; also after
 * a reopen from disk), the shared part of a scope is shared, a fork keeps
 * its parent's scope, and misuse gets a clear status. */
#include "test_util.h"
#include "disk_test_util.h"

/* Memory engines: f32, 1 layer, 2 heads of 4, 4 tokens a block. */
enum { L = 1, H = 2, D = 4, BT = 4, SLOTS = 4 };
static const size_t TOK = H * D * sizeof(float);

static kvh_engine *open_mem(void) { return tu_open(L, H, D, BT, KVH_DTYPE_F32, 64, 64, 0); }

/* An empty sequence in (scope, shared_scope, shared_tokens). */
static kvh_seq scoped_seq(kvh_engine *e, uint64_t scope, uint64_t shared_scope, uint64_t shared_tokens)
{
    kvh_seq s = tu_seq_new(e, 0);
    assert_ok(kvh_seq_set_scope(e, s, scope, shared_scope, shared_tokens));
    return s;
}

/* A sequence in scope holding tokens base.. (n of them) with K/V written,
 * so its full blocks are published. */
static kvh_seq publish(kvh_engine *e, uint64_t scope, uint64_t shared_scope, uint64_t shared_tokens, int32_t base,
                       size_t n)
{
    kvh_seq s = scoped_seq(e, scope, shared_scope, shared_tokens);
    int32_t t[64];
    assert_true(n <= 64);
    tu_iota(t, n, base);
    assert_ok(kvh_seq_append(e, s, t, n));
    tu_write_pattern(e, s, L, TOK, (uint64_t)base, 0, n);
    return s;
}

/* Tokens a new sequence in (scope, shared...) matches of base.. (n). */
static size_t match_in(kvh_engine *e, uint64_t scope, uint64_t shared_scope, uint64_t shared_tokens, int32_t base,
                       size_t n)
{
    kvh_seq s = scoped_seq(e, scope, shared_scope, shared_tokens);
    int32_t t[64];
    tu_iota(t, n, base);
    size_t matched = 0;
    assert_ok(kvh_seq_match_prefix(e, s, t, n, &matched));
    assert_int_equal(tu_seq_len(e, s), matched);
    assert_ok(kvh_seq_free(e, s));
    return matched;
}

/* Blocks kvh_prefix_lookup_scoped finds of base.. (n); releases them. */
static size_t lookup_in(kvh_engine *e, uint64_t scope, uint64_t shared_scope, uint64_t shared_tokens, int32_t base,
                        size_t n)
{
    int32_t t[64];
    kvh_block out[16];
    tu_iota(t, n, base);
    size_t nb = 99;
    assert_ok(kvh_prefix_lookup_scoped(e, scope, shared_scope, shared_tokens, t, n, out, 16, &nb));
    for (size_t i = 0; i < nb; i++)
        assert_ok(kvh_block_release(e, out[i]));
    return nb;
}

static size_t lookup_default(kvh_engine *e, int32_t base, size_t n)
{
    int32_t t[64];
    kvh_block out[16];
    tu_iota(t, n, base);
    size_t nb = 99;
    assert_ok(kvh_prefix_lookup(e, t, n, out, 16, &nb));
    for (size_t i = 0; i < nb; i++)
        assert_ok(kvh_block_release(e, out[i]));
    return nb;
}

/* Scope 0 is the hash of every kvh before scopes: the same fixed values
 * (computed by the release before them), through every way to get one. */
static void test_default_scope_hashes_are_unchanged(void **state)
{
    (void)state;
    kvh_config c = tu_cfg(1, 1, 8, 16, KVH_DTYPE_F32, 8, 0, 0);
    c.model_salt = 0x6b76682d73636f70ull;
    kvh_engine *e = tu_open_cfg(&c);
    int32_t t[16];
    tu_iota(t, 16, 1000);
    const uint64_t h1 = 0x0e23b065854d52afull, h2 = 0x5fd5e18e6030ab7cull;
    uint64_t h;
    assert_ok(kvh_prefix_hash(e, 0, t, 16, &h));
    assert_true(h == h1);
    assert_ok(kvh_prefix_hash(e, h1, t, 16, &h));
    assert_true(h == h2);
    assert_ok(kvh_prefix_hash_scoped(e, 0, 0, t, 16, &h));
    assert_true(h == h1);
    assert_ok(kvh_prefix_hash_scoped(e, 0, h1, t, 16, &h));
    assert_true(h == h2);
    /* The salt of scope 7 is model_salt ^ splitmix64-finaliser(7): fixed too,
     * since stores keep these hashes. */
    assert_ok(kvh_prefix_hash_scoped(e, 7, 0, t, 16, &h));
    assert_true(h == 0x20cbeb79dd42877full);
    /* A sequence never given a scope, and one set to (0, 0, 0). */
    for (int set = 0; set < 2; set++) {
        kvh_seq s = tu_seq_new(e, 0);
        if (set)
            assert_ok(kvh_seq_set_scope(e, s, 0, 0, 0));
        int32_t two[32];
        memcpy(two, t, sizeof(t));
        memcpy(two + 16, t, sizeof(t));
        assert_ok(kvh_seq_append(e, s, two, 32));
        assert_true(tu_seq_binfo(e, s, 0).hash == h1);
        assert_true(tu_seq_binfo(e, s, 1).hash == h2);
        uint64_t sc = 9, ss = 9, st = 9;
        assert_ok(kvh_seq_get_scope(e, s, &sc, &ss, &st));
        assert_true(sc == 0 && ss == 0 && st == 0);
        assert_ok(kvh_seq_free(e, s));
    }
    /* With model_salt 0 as well. */
    kvh_config c0 = c;
    c0.model_salt = 0;
    kvh_engine *e0 = tu_open_cfg(&c0);
    assert_ok(kvh_prefix_hash(e0, 0, t, 16, &h));
    assert_true(h == 0xdd6f4ba668527441ull);
}

static void test_two_scopes_share_nothing(void **state)
{
    (void)state;
    kvh_engine *e = open_mem();
    kvh_seq a = publish(e, 1, 1, 0, 100, 3 * BT);
    for (uint64_t i = 0; i < 3; i++)
        assert_int_equal(tu_seq_binfo(e, a, i).published, 1);
    kvh_stats before = tu_stats(e);
    /* Another scope, the default scope, and the adversary's picks. */
    const uint64_t others[] = {2, 0, UINT64_MAX, 1ull << 63, 0x9e3779b97f4a7c15ull};
    for (size_t k = 0; k < sizeof(others) / sizeof(others[0]); k++) {
        assert_int_equal(match_in(e, others[k], others[k], 0, 100, 3 * BT), 0);
        assert_int_equal(lookup_in(e, others[k], others[k], 0, 100, 3 * BT), 0);
        /* A shared part in scope 1 is an explicit choice to share: here the
         * shared scope is another one, so still nothing. */
        assert_int_equal(match_in(e, others[k], others[k] + 1 == 1 ? 3 : others[k] + 1, 2 * BT, 100, 3 * BT), 0);
    }
    assert_int_equal(lookup_default(e, 100, 3 * BT), 0);
    tu_rng r = {tu_seed(0x5c09e)};
    for (int k = 0; k < 256; k++) {
        uint64_t s = tu_next(&r);
        if (s == 1)
            continue;
        assert_int_equal(lookup_in(e, s, s, 0, 100, 3 * BT), 0);
    }
    kvh_stats mid = tu_stats(e);
    assert_int_equal(mid.lookups, before.lookups); /* no block was used */
    /* The same scope finds all of it. */
    assert_int_equal(match_in(e, 1, 1, 0, 100, 3 * BT), 3 * BT);
    assert_int_equal(lookup_in(e, 1, 0, 0, 100, 3 * BT), 3);
    /* The other scope publishes its own copies of the same tokens. */
    kvh_seq b = publish(e, 2, 2, 0, 100, 3 * BT);
    for (uint64_t i = 0; i < 3; i++) {
        kvh_block_info ia = tu_seq_binfo(e, a, i), ib = tu_seq_binfo(e, b, i);
        assert_int_equal(ib.published, 1);
        assert_true(ia.hash != ib.hash);
        assert_true(tu_seq_block(e, a, i).id != tu_seq_block(e, b, i).id);
    }
    assert_int_equal(match_in(e, 2, 2, 0, 100, 3 * BT), 3 * BT);
    assert_true(tu_check_pattern(e, b, L, TOK, 100, 0, 3 * BT));
}

/* The shared part is found by every scope that names the same shared
 * scope, and no further. */
static void test_shared_scope_is_shared(void **state)
{
    (void)state;
    kvh_engine *e = open_mem();
    /* Tenant 1: two blocks of system prompt in shared scope 9, then its own. */
    kvh_seq a = publish(e, 1, 9, 2 * BT, 200, 4 * BT);
    /* Tenant 2 with the same prompt: the shared part, not tenant 1's rest. */
    assert_int_equal(match_in(e, 2, 9, 2 * BT, 200, 4 * BT), 2 * BT);
    /* shared_tokens covers whole blocks only: 2 * BT + 3 is the same. */
    assert_int_equal(match_in(e, 2, 9, 2 * BT + 3, 200, 4 * BT), 2 * BT);
    /* A shorter shared part: only the first block is in scope 9. */
    assert_int_equal(match_in(e, 2, 9, BT, 200, 4 * BT), BT);
    /* Scope 9 itself, and lookups. */
    assert_int_equal(lookup_in(e, 9, 9, 0, 200, 4 * BT), 2);
    assert_int_equal(lookup_in(e, 3, 9, 2 * BT, 200, 4 * BT), 2);
    assert_int_equal(lookup_in(e, 1, 9, 2 * BT, 200, 4 * BT), 4);
    assert_int_equal(lookup_default(e, 200, 4 * BT), 0);
    assert_int_equal(match_in(e, 1, 1, 0, 200, 4 * BT), 0); /* without the shared part */
    /* The chain goes on through the boundary: block 2 (tenant 1's own)
     * has the last shared block as parent and hashes in scope 1. */
    int32_t t[4 * BT];
    tu_iota(t, 4 * BT, 200);
    uint64_t h0, h1, h2;
    assert_ok(kvh_prefix_hash_scoped(e, 9, 0, t, BT, &h0));
    assert_ok(kvh_prefix_hash_scoped(e, 9, h0, t + BT, BT, &h1));
    assert_ok(kvh_prefix_hash_scoped(e, 1, h1, t + 2 * BT, BT, &h2));
    assert_true(tu_seq_binfo(e, a, 0).hash == h0);
    assert_true(tu_seq_binfo(e, a, 1).hash == h1);
    assert_true(tu_seq_binfo(e, a, 2).hash == h2);
    /* Tenant 2 building the same prompt itself: its shared blocks have
     * tenant 1's hashes (the cached ones stay the published copy), its own
     * block is published beside tenant 1's. */
    kvh_seq b = publish(e, 2, 9, 2 * BT, 200, 4 * BT);
    for (uint64_t i = 0; i < 4; i++) {
        kvh_block_info ia = tu_seq_binfo(e, a, i), ib = tu_seq_binfo(e, b, i);
        assert_int_equal(ia.hash == ib.hash, i < 2);
        assert_int_equal(ib.published, i >= 2);
    }
    /* Shared with everyone: shared scope 0 is the default scope. */
    publish(e, 5, 0, BT, 300, 2 * BT);
    assert_int_equal(lookup_default(e, 300, 2 * BT), 1);
    assert_int_equal(match_in(e, 0, 0, 0, 300, 2 * BT), BT);
    assert_int_equal(match_in(e, 6, 0, BT, 300, 2 * BT), BT);
    assert_int_equal(match_in(e, 6, 6, 0, 300, 2 * BT), 0);
}

static void test_fork_inherits_scope(void **state)
{
    (void)state;
    kvh_engine *e = open_mem();
    kvh_seq a = publish(e, 5, 8, BT, 400, BT + 2);
    kvh_seq child;
    assert_ok(kvh_seq_fork(e, a, 3, &child));
    uint64_t sc = 0, ss = 0, st = 0;
    assert_ok(kvh_seq_get_scope(e, child, &sc, &ss, &st));
    assert_true(sc == 5 && ss == 8 && st == BT);
    /* The child's next block continues the chain in scope 5. */
    int32_t t[2 * BT];
    tu_iota(t, 2 * BT, 400);
    assert_ok(kvh_seq_append(e, child, t + BT + 2, BT - 2));
    uint64_t h0, h1;
    assert_ok(kvh_prefix_hash_scoped(e, 8, 0, t, BT, &h0));
    assert_ok(kvh_prefix_hash_scoped(e, 5, h0, t + BT, BT, &h1));
    assert_true(tu_seq_binfo(e, child, 0).hash == h0);
    assert_true(tu_seq_binfo(e, child, 1).hash == h1);
    /* A fork of the default scope stays there. */
    kvh_seq plain = tu_seq_new(e, 0), pc;
    assert_ok(kvh_seq_fork(e, plain, 0, &pc));
    assert_ok(kvh_seq_get_scope(e, pc, &sc, &ss, &st));
    assert_true(sc == 0 && ss == 0 && st == 0);
}

/* ---- external pool: offload dedupes within a scope only ---- */

typedef struct pool_mem {
    kvh_pool_layout layout; /* per layer [SLOTS][bt][heads][dim] */
} pool_mem;

static kvh_pool pool_new(kvh_engine *e, pool_mem *p, uint32_t layers, uint32_t heads, uint32_t dim, uint32_t bt,
                         size_t esize)
{
    size_t slot_bytes = (size_t)bt * heads * dim * esize;
    void **kp = tu_alloc(sizeof(void *) * layers), **vp = tu_alloc(sizeof(void *) * layers);
    for (uint32_t l = 0; l < layers; l++) {
        kp[l] = tu_alloc(SLOTS * slot_bytes);
        vp[l] = tu_alloc(SLOTS * slot_bytes);
        memset(kp[l], 0x11 + (int)l, SLOTS * slot_bytes);
        memset(vp[l], 0x22 + (int)l, SLOTS * slot_bytes);
    }
    memset(&p->layout, 0, sizeof(p->layout));
    p->layout.struct_size = sizeof(kvh_pool_layout);
    p->layout.memory = KVH_MEMORY_HOST;
    p->layout.num_slots = SLOTS;
    p->layout.k_base = kp;
    p->layout.v_base = vp;
    p->layout.slot_stride = slot_bytes;
    p->layout.token_stride = (uint64_t)heads * dim * esize;
    p->layout.head_stride = (uint64_t)dim * esize;
    kvh_pool pool;
    assert_ok(kvh_pool_register(e, &p->layout, &pool));
    return pool;
}

static void test_pool_offload_dedupes_within_a_scope(void **state)
{
    (void)state;
    kvh_engine *e = open_mem();
    pool_mem pm;
    kvh_pool pool = pool_new(e, &pm, L, H, D, BT, sizeof(float));
    int32_t t[2 * BT];
    tu_iota(t, 2 * BT, 500);
    kvh_block b1, b1again, b2, b0, c1, c2;
    assert_ok(kvh_pool_offload_scoped(e, pool, 0, 1, 0, t, BT, 0, &b1));
    uint64_t allocated = tu_stats(e).blocks_allocated;
    assert_ok(kvh_pool_offload_scoped(e, pool, 0, 1, 0, t, BT, 0, &b1again));
    assert_true(b1.id == b1again.id); /* same scope: the cached block */
    assert_int_equal(tu_stats(e).blocks_allocated, allocated);
    assert_ok(kvh_pool_offload_scoped(e, pool, 1, 2, 0, t, BT, 0, &b2));
    assert_ok(kvh_pool_offload(e, pool, 2, 0, t, BT, 0, &b0));
    assert_true(b2.id != b1.id && b0.id != b1.id && b0.id != b2.id);
    assert_int_equal(tu_stats(e).blocks_allocated, allocated + 2);
    uint64_t h1, h2, h0;
    assert_ok(kvh_prefix_hash_scoped(e, 1, 0, t, BT, &h1));
    assert_ok(kvh_prefix_hash_scoped(e, 2, 0, t, BT, &h2));
    assert_ok(kvh_prefix_hash(e, 0, t, BT, &h0));
    assert_true(tu_binfo(e, b1).hash == h1 && tu_binfo(e, b2).hash == h2 && tu_binfo(e, b0).hash == h0);
    /* A forged parent: scope 2 naming scope 1's block as parent is still
     * scope 2's block, not scope 1's next one. */
    assert_ok(kvh_pool_offload_scoped(e, pool, 0, 1, h1, t + BT, BT, 0, &c1));
    assert_ok(kvh_pool_offload_scoped(e, pool, 1, 2, h1, t + BT, BT, 0, &c2));
    assert_true(c1.id != c2.id);
    /* Sequences and lookups of each scope see that scope's blocks. */
    assert_int_equal(match_in(e, 1, 1, 0, 500, 2 * BT), 2 * BT);
    assert_int_equal(match_in(e, 2, 2, 0, 500, 2 * BT), BT); /* its block 1 hangs off h1 */
    assert_int_equal(match_in(e, 3, 3, 0, 500, 2 * BT), 0);
    assert_int_equal(lookup_default(e, 500, 2 * BT), 1);
    kvh_block out[2];
    size_t nb = 0;
    assert_ok(kvh_prefix_lookup_scoped(e, 2, 2, 0, t, 2 * BT, out, 2, &nb));
    assert_int_equal(nb, 1);
    assert_true(out[0].id == b2.id);
    assert_ok(kvh_block_release(e, out[0]));
    const kvh_block all[] = {b1, b1again, b2, b0, c1, c2};
    for (size_t i = 0; i < 6; i++)
        assert_ok(kvh_block_release(e, all[i]));
    assert_ok(kvh_pool_unregister(e, pool));
}

/* ---- after a reopen from disk: the slot header carries the hash ---- */

static const dt_geo G = {1, 2, 8, 4, KVH_DTYPE_F16};

static void test_scopes_survive_a_reopen(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("scope_reopen", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 8, 8, 64, 0);
    dt_content tenant = dt_plain(77);
    int32_t t[3 * 4];
    dt_tokens(tenant, 0, 3 * G.bt, t);
    kvh_engine *e = dt_open_a(&c);
    kvh_seq s;
    assert_ok(kvh_seq_create(e, 0, &s));
    assert_ok(kvh_seq_set_scope(e, s, 11, 12, G.bt));
    dt_assert_ok(dt_extend(e, s, G, tenant, 0, 3 * G.bt));
    assert_ok(kvh_seq_persist(e, s));
    assert_ok(dt_close(e));

    e = dt_open_a(&c);
    assert_int_equal(dt_stats(e).blocks_allocated, 3);
    /* Pool offload of the first block in the tenant's own scope makes a
     * new block; in scope 12, where it was published, it is the recovered
     * one, still on disk. */
    pool_mem pm;
    kvh_pool pool = pool_new(e, &pm, G.layers, G.heads, G.dim, G.bt, 2);
    kvh_block fresh, cached;
    assert_ok(kvh_pool_offload_scoped(e, pool, 0, 11, 0, t, G.bt, 0, &fresh));
    assert_true(tu_binfo(e, fresh).tier != KVH_TIER_DISK);
    assert_int_equal(dt_stats(e).blocks_allocated, 4);
    assert_ok(kvh_pool_offload_scoped(e, pool, 1, 12, 0, t, G.bt, 0, &cached));
    assert_int_equal(tu_binfo(e, cached).tier, KVH_TIER_DISK);
    assert_int_equal(dt_stats(e).blocks_allocated, 4);
    assert_ok(kvh_block_release(e, fresh));
    assert_ok(kvh_block_release(e, cached));
    assert_ok(kvh_pool_unregister(e, pool));
    /* No other scope finds the tenant's own blocks, by any path. */
    const uint64_t others[] = {0, 12, 13, 11};
    for (size_t k = 0; k < 4; k++) {
        /* 12: the shared block; 11 without the shared part: the block
         * offloaded above, not the tenant's chain after it. */
        size_t expect = others[k] == 12 || others[k] == 11 ? 1 : 0;
        kvh_seq q;
        size_t m = 99;
        assert_ok(kvh_seq_create(e, 0, &q));
        assert_ok(kvh_seq_set_scope(e, q, others[k], others[k], 0));
        assert_ok(kvh_seq_match_prefix(e, q, t, 3 * G.bt, &m));
        assert_int_equal(m, expect * G.bt);
        assert_ok(kvh_seq_free(e, q));
        kvh_block out[3];
        size_t nb = 99;
        assert_ok(kvh_prefix_lookup_scoped(e, others[k], others[k], 0, t, 3 * G.bt, out, 3, &nb));
        assert_int_equal(nb, expect);
        for (size_t i = 0; i < nb; i++)
            assert_ok(kvh_block_release(e, out[i]));
    }
    /* The tenant's scope finds everything, and the data is its own. */
    kvh_seq q;
    size_t m = 0;
    assert_ok(kvh_seq_create(e, 0, &q));
    assert_ok(kvh_seq_set_scope(e, q, 11, 12, G.bt));
    assert_ok(kvh_seq_match_prefix(e, q, t, 3 * G.bt, &m));
    assert_int_equal(m, 3 * G.bt);
    char msg[256] = "";
    kvh_status vs = dt_verify(e, q, G, tenant, 0, 3 * G.bt, msg, sizeof(msg));
    if (vs != KVH_OK)
        fail_msg("verify: %s (%s)", kvh_status_name(vs), msg);
    assert_ok(dt_close(e));
}

/* ---- misuse ---- */

static void test_scope_misuse(void **state)
{
    (void)state;
    kvh_engine *e = open_mem();
    int32_t t[2 * BT];
    tu_iota(t, 2 * BT, 600);
    /* Null engine: every call. */
    uint64_t h = 0;
    size_t nb = 0;
    kvh_block b = {0};
    kvh_seq any = {1};
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_set_scope(NULL, any, 1, 1, 0));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_get_scope(NULL, any, &h, NULL, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_prefix_hash_scoped(NULL, 1, 0, t, BT, &h));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_prefix_lookup_scoped(NULL, 1, 1, 0, t, BT, &b, 1, &nb));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload_scoped(NULL, (kvh_pool){1}, 0, 1, 0, t, BT, 0, &b));
    /* A sequence that holds tokens keeps its scope. */
    kvh_seq s = tu_seq_new(e, 0);
    assert_ok(kvh_seq_set_scope(e, s, 4, 4, 0));
    assert_ok(kvh_seq_set_scope(e, s, 5, 6, BT)); /* still empty: may change */
    assert_ok(kvh_seq_append(e, s, t, 1));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_set_scope(e, s, 7, 7, 0));
    assert_true(strstr(kvh_last_error(), "empty") != NULL);
    uint64_t sc = 0, ss = 0, st = 0;
    assert_ok(kvh_seq_get_scope(e, s, &sc, &ss, &st));
    assert_true(sc == 5 && ss == 6 && st == BT);
    assert_ok(kvh_seq_get_scope(e, s, NULL, NULL, NULL));
    /* Truncated to 0 it is empty again. */
    assert_ok(kvh_seq_truncate(e, s, 0));
    assert_ok(kvh_seq_set_scope(e, s, 7, 7, 0));
    /* After a match that attached blocks: not empty. */
    kvh_seq p = publish(e, 7, 7, 0, 600, 2 * BT);
    kvh_seq q = scoped_seq(e, 7, 7, 0);
    size_t m = 0;
    assert_ok(kvh_seq_match_prefix(e, q, t, 2 * BT, &m));
    assert_int_equal(m, 2 * BT);
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_set_scope(e, q, 8, 8, 0));
    /* Stale, forged and wrongly typed handles. */
    kvh_seq gone = tu_seq_new(e, 0);
    assert_ok(kvh_seq_free(e, gone));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_set_scope(e, gone, 1, 1, 0));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_get_scope(e, gone, &sc, &ss, &st));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_set_scope(e, (kvh_seq){0}, 1, 1, 0));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_set_scope(e, (kvh_seq){0x5eedf00dull}, 1, 1, 0));
    kvh_seq as_seq = {tu_seq_block(e, p, 0).id}; /* a block handle as a sequence */
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_set_scope(e, as_seq, 1, 1, 0));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_get_scope(e, as_seq, &sc, NULL, NULL));
    /* Bad arguments of the engine-level calls. */
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_prefix_hash_scoped(e, 1, 0, NULL, BT, &h));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_prefix_hash_scoped(e, 1, 0, t, BT, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_prefix_hash_scoped(e, 1, 0, t, BT - 1, &h));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_prefix_lookup_scoped(e, 1, 1, 0, NULL, BT, &b, 1, &nb));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_prefix_lookup_scoped(e, 1, 1, 0, t, BT, NULL, 1, &nb));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_prefix_lookup_scoped(e, 1, 1, 0, t, BT, &b, 1, NULL));
    assert_ok(kvh_prefix_lookup_scoped(e, 1, 1, 0, NULL, 0, NULL, 0, &nb));
    assert_int_equal(nb, 0);
    /* Extreme shared_tokens: no overflow, every block shared. */
    assert_int_equal(lookup_in(e, 99, 7, UINT64_MAX, 600, 2 * BT), 2);
    pool_mem pm;
    kvh_pool pool = pool_new(e, &pm, L, H, D, BT, sizeof(float));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload_scoped(e, pool, 0, 1, 0, NULL, BT, 0, &b));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload_scoped(e, pool, 0, 1, 0, t, BT, 0, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload_scoped(e, pool, 0, 1, 0, t, BT + 1, 0, &b));
    assert_kvh(KVH_ERR_RANGE, kvh_pool_offload_scoped(e, pool, SLOTS, 1, 0, t, BT, 0, &b));
    assert_ok(kvh_pool_unregister(e, pool));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_offload_scoped(e, pool, 0, 1, 0, t, BT, 0, &b));
    /* The engine is still sound: the scope-7 prefix is intact. */
    assert_int_equal(match_in(e, 7, 7, 0, 600, 2 * BT), 2 * BT);
    assert_true(tu_check_pattern(e, p, L, TOK, 600, 0, 2 * BT));
}

static int teardown(void **state)
{
    dt_teardown(state);
    return tu_teardown(state);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_default_scope_hashes_are_unchanged, teardown),
        cmocka_unit_test_teardown(test_two_scopes_share_nothing, teardown),
        cmocka_unit_test_teardown(test_shared_scope_is_shared, teardown),
        cmocka_unit_test_teardown(test_fork_inherits_scope, teardown),
        cmocka_unit_test_teardown(test_pool_offload_dedupes_within_a_scope, teardown),
        cmocka_unit_test_teardown(test_scopes_survive_a_reopen, teardown),
        cmocka_unit_test_teardown(test_scope_misuse, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
