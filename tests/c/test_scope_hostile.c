/* Tenant scopes against a hostile tenant, from kvh.h's promises alone
 * ("Tenant scopes"): two tenants that send the same tokens with different
 * KV each read back their own bytes, in every tier, after persist and a
 * reopen, after forks, truncation and re-scoping, through offload batches
 * mixing scopes and through the remote tier; a miss in one scope on
 * another's blocks reads, moves, counts and refreshes nothing; a block
 * whose hash another tenant forged cannot keep a tenant's prefix out of
 * memory, disk or the remote store nor tell the forger whether it was
 * cached; misuse gets a
 * status. The test_scope.c checks (fixed hash values, the shared part,
 * offload dedupe) are not repeated. */
#include <limits.h>

#include "test_util.h"
#include "disk_test_util.h"
#include "remote_test_util.h"

enum { L = 2, H = 2, D = 8, BT = 4, NB = 3 };
static const dt_geo G = {L, H, D, BT, KVH_DTYPE_F16};
static const size_t TOKB = H * D * 2;

/* Scopes of the tenants, among them the default scope and the extremes. */
static const uint64_t SCOPES[] = {0, 1, 2, UINT64_MAX, 1ull << 63};
enum { N_SCOPES = sizeof(SCOPES) / sizeof(SCOPES[0]) };

/* A sequence of (scope, shared_scope, shared_tokens) holding tokens with
 * the KV pattern of tag written over all of them. */
static kvh_seq tenant(kvh_engine *e, uint64_t scope, uint64_t shared_scope, uint64_t shared_tokens,
                      const int32_t *tokens, size_t n, uint64_t tag)
{
    kvh_seq s = tu_seq_new(e, 0);
    assert_ok(kvh_seq_set_scope(e, s, scope, shared_scope, shared_tokens));
    assert_ok(kvh_seq_append(e, s, tokens, n));
    tu_write_pattern(e, s, L, TOKB, tag, 0, n);
    return s;
}

/* Tokens a new sequence of the scope matches of tokens; the matched part
 * must read back as tag's pattern (the tenant's own bytes). */
static size_t own_match(kvh_engine *e, uint64_t scope, uint64_t shared_scope, uint64_t shared_tokens,
                        const int32_t *tokens, size_t n, uint64_t tag)
{
    kvh_seq s = tu_seq_new(e, 0);
    assert_ok(kvh_seq_set_scope(e, s, scope, shared_scope, shared_tokens));
    size_t m = 99;
    assert_ok(kvh_seq_match_prefix(e, s, tokens, n, &m));
    assert_int_equal(tu_seq_len(e, s), m);
    if (m)
        assert_true(tu_check_pattern(e, s, L, TOKB, tag, 0, m));
    assert_ok(kvh_seq_free(e, s));
    return m;
}

static size_t lookup_count(kvh_engine *e, uint64_t scope, const int32_t *tokens, size_t n)
{
    kvh_block out[8];
    size_t nb = 99;
    assert_ok(kvh_prefix_lookup_scoped(e, scope, scope, 0, tokens, n, out, 8, &nb));
    for (size_t i = 0; i < nb; i++)
        assert_ok(kvh_block_release(e, out[i]));
    return nb;
}

static uint32_t threads_of(void **state) { return (uint32_t)(uintptr_t)*state; }

/* ---- same tokens, different KV: each tenant reads its own ---- */

static void test_same_tokens_each_tenant_reads_its_own(void **state)
{
    char dir[PATH_MAX];
    dt_scratch("scope_own", dir, sizeof(dir));
    /* 4 + 4 memory blocks for 15: most of them live on disk at some point. */
    kvh_config c = dt_cfg(G, dir, 4, 4, 64, threads_of(state));
    kvh_engine *e = dt_open_a(&c);
    int32_t t[NB * BT];
    tu_iota(t, NB * BT, 700);
    kvh_seq s[N_SCOPES];
    for (int k = 0; k < N_SCOPES; k++) {
        s[k] = tenant(e, SCOPES[k], SCOPES[k], 0, t, NB * BT, 11 + (uint64_t)k);
        assert_ok(kvh_seq_persist(e, s[k]));
    }
    for (int k = 0; k < N_SCOPES; k++) {
        assert_true(tu_check_pattern(e, s[k], L, TOKB, 11 + (uint64_t)k, 0, NB * BT));
        for (uint64_t i = 0; i < NB; i++) {
            kvh_block_info a = tu_seq_binfo(e, s[k], i);
            assert_int_equal(a.published, 1);
            for (int j = 0; j < k; j++)
                assert_true(a.hash != tu_seq_binfo(e, s[j], i).hash);
        }
    }
    assert_int_equal(dt_stats(e).blocks_allocated, N_SCOPES * NB);
    for (int k = 0; k < N_SCOPES; k++)
        assert_ok(kvh_seq_free(e, s[k]));
    for (int k = 0; k < N_SCOPES; k++)
        assert_int_equal(own_match(e, SCOPES[k], SCOPES[k], 0, t, NB * BT, 11 + (uint64_t)k), NB * BT);
    assert_ok(dt_close(e));

    /* A restart: every tenant's blocks came back as its own. */
    e = dt_open_a(&c);
    assert_int_equal(dt_stats(e).blocks_allocated, N_SCOPES * NB);
    for (int k = N_SCOPES - 1; k >= 0; k--) {
        assert_int_equal(lookup_count(e, SCOPES[k], t, NB * BT), NB);
        assert_int_equal(own_match(e, SCOPES[k], SCOPES[k], 0, t, NB * BT, 11 + (uint64_t)k), NB * BT);
    }
    assert_int_equal(lookup_count(e, 3, t, NB * BT), 0);
    assert_int_equal(lookup_count(e, UINT64_MAX - 1, t, NB * BT), 0);
    assert_ok(dt_close(e));
}

/* ---- a miss on another tenant's blocks leaves no trace ---- */

static void snapshot_equal(const kvh_stats *a, const kvh_stats *b)
{
    assert_int_equal(a->lookups, b->lookups);
    assert_int_equal(a->hits_device, b->hits_device);
    assert_int_equal(a->hits_host, b->hits_host);
    assert_int_equal(a->hits_disk, b->hits_disk);
    assert_int_equal(a->prefix_hit_blocks, b->prefix_hit_blocks);
    assert_int_equal(a->prefix_hit_blocks_host, b->prefix_hit_blocks_host);
    assert_int_equal(a->prefix_hit_blocks_disk, b->prefix_hit_blocks_disk);
    assert_int_equal(a->prefix_hit_tokens, b->prefix_hit_tokens);
    assert_int_equal(a->blocks_disk_to_host, b->blocks_disk_to_host);
    assert_int_equal(a->blocks_host_to_device, b->blocks_host_to_device);
    assert_int_equal(a->blocks_allocated, b->blocks_allocated);
    assert_int_equal(a->corrupt_blocks, b->corrupt_blocks);
}

static void test_miss_on_disk_blocks_reads_nothing(void **state)
{
    char dir[PATH_MAX];
    dt_scratch("scope_disk_miss", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 4, 4, 64, threads_of(state));
    kvh_engine *e = dt_open_a(&c);
    int32_t t[NB * BT];
    tu_iota(t, NB * BT, 900);
    kvh_seq a = tenant(e, 1, 1, 0, t, NB * BT, 5);
    assert_ok(kvh_seq_persist(e, a));
    assert_ok(dt_close(e));
    e = dt_open_a(&c); /* tenant 1's blocks are on disk only now */
    kvh_stats before = dt_stats(e);
    int queries = 0;
    /* Other scopes, the default scope, a shared part in the default scope
     * covering everything, and the neighbours of the tenant's value. */
    const uint64_t others[] = {0, 2, 1ull ^ (1ull << 63), UINT64_MAX};
    for (size_t k = 0; k < sizeof(others) / sizeof(others[0]); k++) {
        assert_int_equal(own_match(e, others[k], others[k], 0, t, NB * BT, 0), 0);
        assert_int_equal(own_match(e, others[k], 0, UINT64_MAX, t, NB * BT, 0), 0);
        assert_int_equal(lookup_count(e, others[k], t, NB * BT), 0);
        queries += 3;
    }
    kvh_block out[NB];
    size_t nb = 99;
    assert_ok(kvh_prefix_lookup(e, t, NB * BT, out, NB, &nb));
    assert_int_equal(nb, 0);
    queries++;
    kvh_stats after = dt_stats(e);
    snapshot_equal(&before, &after);
    assert_int_equal(after.prefix_queries, before.prefix_queries + (uint64_t)queries);
    assert_int_equal(dt_tier(e, KVH_TIER_DEVICE).used_blocks, 0);
    assert_int_equal(dt_tier(e, KVH_TIER_HOST).used_blocks, 0);
    /* The tenant itself finds all of it, with its bytes. */
    assert_int_equal(own_match(e, 1, 1, 0, t, NB * BT, 5), NB * BT);
    assert_ok(dt_close(e));
}

/* The victim order: a miss from another scope must not refresh the
 * tenant's block (a refresh would show in which block leaves next). A hit
 * in the tenant's own scope does: the control that the check can see it. */
static int victim_is_tenant_block(void **state, uint64_t prober_scope)
{
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F16, 3, 8, threads_of(state));
    c.eviction_policy = KVH_EVICT_LRU_K;
    c.lru_k = 1;
    kvh_engine *e = tu_open_cfg(&c);
    int32_t t[BT], u[2 * BT], v[BT];
    tu_iota(t, BT, 1100);
    tu_iota(u, 2 * BT, 1200);
    tu_iota(v, BT, 1300);
    kvh_seq a = tenant(e, 1, 1, 0, t, BT, 1);
    kvh_seq other = tenant(e, 2, 2, 0, u, 2 * BT, 2);
    assert_int_equal(tu_seq_binfo(e, a, 0).tier, KVH_TIER_DEVICE);
    for (int i = 0; i < 20; i++)
        own_match(e, prober_scope, prober_scope, 0, t, BT, 1);
    kvh_seq next = tenant(e, 2, 2, 0, v, BT, 3); /* needs a device slot */
    int evicted = tu_seq_binfo(e, a, 0).tier != KVH_TIER_DEVICE;
    assert_true(tu_check_pattern(e, a, L, TOKB, 1, 0, BT));
    assert_true(tu_check_pattern(e, other, L, TOKB, 2, 0, 2 * BT));
    assert_true(tu_check_pattern(e, next, L, TOKB, 3, 0, BT));
    tu_close(e);
    return evicted;
}

static void test_miss_does_not_refresh_recency(void **state)
{
    assert_int_equal(victim_is_tenant_block(state, 1), 0); /* control: own hits refresh */
    assert_int_equal(victim_is_tenant_block(state, 2), 1);
    assert_int_equal(victim_is_tenant_block(state, 0), 1);
}

/* ---- a forged hash: another tenant's block with the same 64 bits ----
 *
 * The prefix hash is a public function of (parent, tokens, salt) and
 * invertible step by step, so a tenant can choose tokens whose block hash
 * in its own scope equals the hash another tenant's block has (or will
 * have) in its scope. kvh.h promises that a hit needs hash, parent and
 * tokens to agree, that two scopes share no block, and that no hit of
 * another scope's blocks can be observed. */

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

static uint64_t unxorshift(uint64_t y, unsigned s)
{
    uint64_t x = y;
    for (unsigned i = 0; i < 64 / s + 1; i++)
        x = y ^ (x >> s);
    return x;
}

static uint64_t inverse_odd(uint64_t c)
{
    uint64_t x = c; /* Newton: correct to 3, 6, 12, 24, 48, 96 bits */
    for (int i = 0; i < 5; i++)
        x *= 2 - c * x;
    return x;
}

static uint64_t unmix64(uint64_t x)
{
    x = unxorshift(x, 31);
    x *= inverse_odd(0x94d049bb133111ebull);
    x = unxorshift(x, 27);
    x *= inverse_odd(0xbf58476d1ce4e5b9ull);
    x = unxorshift(x, 30);
    return x;
}

/* Tokens of a first block (parent 0) whose hash in scope_salt's scope is
 * target: the first BT - 2 are given, the last two solved for. */
static void forge_tokens(uint64_t salt, uint64_t target, int32_t *tk)
{
    const uint64_t golden = 0x9e3779b97f4a7c15ull;
    uint64_t h = mix64(0 ^ 0x6b7668u) ^ mix64(salt + golden);
    h = mix64(h + BT);
    for (size_t i = 0; i + 2 < BT; i += 2) {
        uint64_t w = (uint64_t)(uint32_t)tk[i] | ((uint64_t)(uint32_t)tk[i + 1] << 32);
        h = mix64(h ^ w) + golden;
    }
    uint64_t w = unmix64(unmix64(target) - golden) ^ h;
    tk[BT - 2] = (int32_t)(uint32_t)w;
    tk[BT - 1] = (int32_t)(uint32_t)(w >> 32);
}

/* The salt of a scope as kvh.h gives it: model_salt ^ m(scope). */
static uint64_t scope_salt(uint64_t model_salt, uint64_t scope) { return model_salt ^ mix64(scope); }

typedef enum { FORGER_NONE, FORGER_FIRST, FORGER_SECOND } forger_order;

/* What each tenant's later request matches of its own tokens. */
typedef struct forged_view {
    size_t victim_cached; /* before persist */
    size_t victim;        /* after persist (and a reopen) */
    size_t forger;
} forged_view;

/* Victim (scope 1) publishes t; forger (scope 2) publishes tokens forged to
 * the victim's block hash, before or after it (or not at all); both
 * persist, then each asks for its own tokens (after a reopen if asked). */
static forged_view forged_round(void **state, forger_order order, int reopen)
{
    char dir[PATH_MAX];
    dt_scratch("scope_forged", dir, sizeof(dir));
    dt_rmrf(dir);
    kvh_config c = dt_cfg(G, dir, 16, 16, 64, threads_of(state));
    kvh_engine *e = dt_open_a(&c);
    int32_t t[BT], f[BT];
    tu_iota(t, BT, 1400);
    uint64_t hv;
    assert_ok(kvh_prefix_hash_scoped(e, 1, 0, t, BT, &hv));
    tu_iota(f, BT, 1500);
    forge_tokens(scope_salt(c.model_salt, 2), hv, f);
    uint64_t hf;
    assert_ok(kvh_prefix_hash_scoped(e, 2, 0, f, BT, &hf));
    assert_true(hf == hv); /* the forgery holds */
    assert_true(memcmp(f, t, sizeof(t)) != 0);

    kvh_seq victim = {0}, forger = {0};
    if (order == FORGER_FIRST)
        forger = tenant(e, 2, 2, 0, f, BT, 22);
    victim = tenant(e, 1, 1, 0, t, BT, 11);
    if (order == FORGER_SECOND)
        forger = tenant(e, 2, 2, 0, f, BT, 22);
    forged_view v;
    v.victim_cached = own_match(e, 1, 1, 0, t, BT, 11);
    assert_ok(kvh_seq_persist(e, victim));
    if (order != FORGER_NONE)
        assert_ok(kvh_seq_persist(e, forger));
    assert_ok(kvh_seq_free(e, victim));
    if (order != FORGER_NONE)
        assert_ok(kvh_seq_free(e, forger));
    if (reopen) {
        assert_ok(dt_close(e));
        e = dt_open_a(&c);
    }
    v.victim = own_match(e, 1, 1, 0, t, BT, 11);
    /* own_match checks the bytes: never the other tenant's block. */
    v.forger = own_match(e, 2, 2, 0, f, BT, 22);
    assert_ok(dt_close(e));
    return v;
}

static void test_forged_hash_cannot_block_or_probe_a_tenant(void **state)
{
    static const char *const names[] = {"no forger", "forger first", "forger second"};
    int bad = 0;
    for (int reopen = 0; reopen < 2; reopen++) {
        forged_view v[3];
        for (int o = 0; o < 3; o++) {
            v[o] = forged_round(state, (forger_order)o, reopen);
            print_message("%s%s: victim matches %zu then %zu, forger %zu\n", names[o], reopen ? " + reopen" : "",
                          v[o].victim_cached, v[o].victim, v[o].forger);
            /* The victim's prefix is cached for it and durable. */
            bad |= v[o].victim_cached != BT || v[o].victim != BT;
        }
        /* The forger's own block is found whether or not the victim's
         * existed: its hits tell it nothing about another scope. */
        bad |= v[FORGER_NONE].forger != 0 || v[FORGER_FIRST].forger != BT || v[FORGER_SECOND].forger != BT;
    }
    if (bad)
        fail_msg("a block of scope 2 with the hash of a block of scope 1 changed what either scope finds");
}

/* The hash of a first block (parent 0) under salt, as kvh.h defines H:
 * what a tenant computes from a salt it knows or guesses. */
static uint64_t public_hash(uint64_t salt, const int32_t *tk)
{
    const uint64_t golden = 0x9e3779b97f4a7c15ull;
    uint64_t h = mix64(0 ^ 0x6b7668u) ^ mix64(salt + golden);
    h = mix64(h + BT);
    for (size_t i = 0; i + 1 < BT; i += 2) {
        uint64_t w = (uint64_t)(uint32_t)tk[i] | ((uint64_t)(uint32_t)tk[i + 1] << 32);
        h = mix64(h ^ w) + golden;
    }
    h = mix64(h);
    return h ? h : 1;
}

/* kvh.h's remedy: with a secret model_salt, a tenant that knows every
 * scope value, the victim's tokens and H, but not the salt, aims its
 * forgery with a guessed salt; it misses, and neither tenant's prefix is
 * kept out or probed, in memory, on disk and after a reopen. */
static void test_forgery_without_the_secret_salt_changes_nothing(void **state)
{
    static const uint64_t guesses[] = {0, 0x5eed, 1};
    for (size_t g = 0; g < sizeof(guesses) / sizeof(guesses[0]); g++) {
        char dir[PATH_MAX];
        dt_scratch("scope_secret", dir, sizeof(dir));
        dt_rmrf(dir);
        kvh_config c = dt_cfg(G, dir, 16, 16, 64, threads_of(state));
        c.model_salt = 0xc3a5c85c97cb3127ull; /* the secret */
        kvh_engine *e = dt_open_a(&c);
        int32_t t[BT], f[BT];
        tu_iota(t, BT, 1800);
        tu_iota(f, BT, 1900);
        /* The forger's arithmetic is right: with the real salt it would
         * hit (the parked test above shows what that does). */
        uint64_t hv;
        assert_ok(kvh_prefix_hash_scoped(e, 1, 0, t, BT, &hv));
        assert_true(public_hash(scope_salt(c.model_salt, 1), t) == hv);
        uint64_t aim = public_hash(scope_salt(guesses[g], 1), t);
        forge_tokens(scope_salt(guesses[g], 2), aim, f);
        assert_true(public_hash(scope_salt(guesses[g], 2), f) == aim);
        uint64_t hf;
        assert_ok(kvh_prefix_hash_scoped(e, 2, 0, f, BT, &hf));
        assert_true(hf != hv);

        kvh_seq forger = tenant(e, 2, 2, 0, f, BT, 22);
        kvh_seq victim = tenant(e, 1, 1, 0, t, BT, 11);
        assert_int_equal(tu_seq_binfo(e, victim, 0).published, 1);
        assert_int_equal(own_match(e, 1, 1, 0, t, BT, 11), BT);
        assert_ok(kvh_seq_persist(e, forger));
        assert_ok(kvh_seq_persist(e, victim));
        assert_ok(kvh_seq_free(e, forger));
        assert_ok(kvh_seq_free(e, victim));
        assert_ok(dt_close(e));
        e = dt_open_a(&c);
        assert_int_equal(own_match(e, 1, 1, 0, t, BT, 11), BT);
        assert_int_equal(own_match(e, 2, 2, 0, f, BT, 22), BT);
        assert_ok(dt_close(e));
        dt_rmrf(dir);
    }
}

/* The same forgery through the remote tier: the first writer of a key
 * wins, so a key that named the hash alone let the forger's upload keep
 * the victim's out of the store; keys name the whole prefix. */
static rt_cluster cluster;
static int have_cluster = -1;

static int start_cluster(void)
{
    if (have_cluster < 0)
        have_cluster = rt_available() && rt_start_scratch(&cluster, 1, NULL) == 0;
    return have_cluster;
}

static kvh_engine *open_remote(kvh_config *c)
{
    *c = tu_cfg(L, H, D, BT, KVH_DTYPE_F16, 16, 16, 1);
    c->model_salt = 0x7e4a47;
    c->remote_addrs = rt_addrs(&cluster);
    c->remote_timeout_ms = 1000;
    kvh_engine *e;
    kvh_status st = kvh_engine_open(c, &e);
    if (st == KVH_ERR_UNSUPPORTED)
        skip(); /* built without the remote tier */
    assert_ok(st);
    return tu_track_engine(e);
}

static void test_forged_hash_in_the_remote_store(void **state)
{
    (void)state;
    if (!start_cluster())
        skip();
    kvh_config c;
    kvh_engine *e = open_remote(&c);
    int32_t t[BT], f[BT];
    tu_iota(t, BT, 2400);
    uint64_t hv;
    assert_ok(kvh_prefix_hash_scoped(e, 1, 0, t, BT, &hv));
    tu_iota(f, BT, 2500);
    forge_tokens(scope_salt(c.model_salt, 2), hv, f);
    /* The forger's engine uploads first; the victim's engine, another
     * process, never sees the forger's block locally. */
    kvh_seq forger = tenant(e, 2, 2, 0, f, BT, 22);
    assert_ok(kvh_seq_persist(e, forger));
    assert_ok(tu_close(e));
    e = open_remote(&c);
    kvh_seq victim = tenant(e, 1, 1, 0, t, BT, 11);
    assert_int_equal(tu_seq_binfo(e, victim, 0).published, 1);
    assert_ok(kvh_seq_persist(e, victim));
    assert_ok(tu_close(e));
    e = open_remote(&c);
    size_t v = own_match(e, 1, 1, 0, t, BT, 11);
    size_t fo = own_match(e, 2, 2, 0, f, BT, 22);
    kvh_stats st = tu_stats(e);
    print_message("remote: victim matches %zu, forger %zu; remote hits %" PRIu64 ", corrupt %" PRIu64 "\n", v, fo,
                  st.remote_hits, st.remote_corrupt);
    assert_ok(tu_close(e));
    if (v != BT || fo != BT || st.remote_hits != 2 || st.remote_corrupt != 0)
        fail_msg("a forged hash changed what the remote store serves (victim %zu, forger %zu of %u tokens)", v, fo, BT);
}

/* ---- fork, truncate, re-scope ---- */

static void test_fork_truncate_and_rescope(void **state)
{
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F16, 8, 16, threads_of(state));
    int32_t t[2 * BT + 2], other[BT];
    tu_iota(t, 2 * BT + 2, 1600);
    tu_iota(other, BT, 1700);
    kvh_seq a = tenant(e, 1, 1, 0, t, 2 * BT + 2, 1);
    kvh_seq child;
    assert_ok(kvh_seq_fork(e, a, 7, &child));
    /* A fork holds tokens: its scope cannot be changed under them. */
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_set_scope(e, child, 2, 2, 0));
    uint64_t sc = 0;
    assert_ok(kvh_seq_get_scope(e, child, &sc, NULL, NULL));
    assert_true(sc == 1);
    /* The child overwrites a published shared block: a copy, never the
     * cached one tenant 1 matches. */
    tu_write_pattern(e, child, L, TOKB, 9, 0, BT);
    assert_true(tu_check_pattern(e, a, L, TOKB, 1, 0, 2 * BT + 2));
    assert_int_equal(own_match(e, 1, 1, 0, t, 2 * BT, 1), 2 * BT);
    /* Emptied, the child moves to scope 2 and builds the same tokens with
     * its own bytes: its own blocks, not tenant 1's. */
    assert_ok(kvh_seq_truncate(e, child, 0));
    assert_ok(kvh_seq_set_scope(e, child, 2, 2, 0));
    assert_ok(kvh_seq_append(e, child, t, 2 * BT));
    tu_write_pattern(e, child, L, TOKB, 2, 0, 2 * BT);
    for (uint64_t i = 0; i < 2; i++) {
        kvh_block_info ia = tu_seq_binfo(e, a, i), ic = tu_seq_binfo(e, child, i);
        assert_true(ia.hash != ic.hash);
        assert_true(tu_seq_block(e, a, i).id != tu_seq_block(e, child, i).id);
        assert_int_equal(ic.published, 1);
    }
    assert_int_equal(own_match(e, 1, 1, 0, t, 2 * BT, 1), 2 * BT);
    assert_int_equal(own_match(e, 2, 2, 0, t, 2 * BT, 2), 2 * BT);
    /* Tenant 1 cuts into its second block and grows other tokens there:
     * the new block hashes in scope 1 after block 0; the old block 1 stays
     * cached for tenant 1 with its bytes. */
    assert_ok(kvh_seq_truncate(e, a, BT + 1));
    assert_ok(kvh_seq_append(e, a, other + 1, BT - 1));
    tu_write_pattern(e, a, L, TOKB, 3, BT + 1, BT - 1);
    int32_t grown[2 * BT];
    memcpy(grown, t, (BT + 1) * sizeof(int32_t));
    memcpy(grown + BT + 1, other + 1, (BT - 1) * sizeof(int32_t));
    uint64_t h0, h1;
    assert_ok(kvh_prefix_hash_scoped(e, 1, 0, grown, BT, &h0));
    assert_ok(kvh_prefix_hash_scoped(e, 1, h0, grown + BT, BT, &h1));
    assert_true(tu_seq_binfo(e, a, 1).hash == h1);
    assert_int_equal(own_match(e, 1, 1, 0, t, 2 * BT, 1), 2 * BT);
    assert_int_equal(own_match(e, 2, 2, 0, grown, 2 * BT, 2), BT); /* block 0 only: scope 2's */
    assert_int_equal(own_match(e, 3, 3, 0, grown, 2 * BT, 0), 0);
    /* A fork of the re-scoped child stays in scope 2. */
    kvh_seq grandchild;
    assert_ok(kvh_seq_fork(e, child, 0, &grandchild));
    assert_ok(kvh_seq_get_scope(e, grandchild, &sc, NULL, NULL));
    assert_true(sc == 2);
    assert_true(tu_check_pattern(e, grandchild, L, TOKB, 2, 0, 2 * BT));
}

/* ---- an offload batch mixing scopes ---- */

enum { SLOTS = 4 };

typedef struct pool_mem {
    kvh_pool_layout layout; /* per layer [SLOTS][BT][H][D] */
    uint8_t *k[L], *v[L];
} pool_mem;

static const size_t SLOT_BYTES = (size_t)BT * H * D * 2;

static kvh_pool pool_new(kvh_engine *e, pool_mem *p, uint8_t fill)
{
    void **kp = tu_alloc(sizeof(void *) * L), **vp = tu_alloc(sizeof(void *) * L);
    for (uint32_t l = 0; l < L; l++) {
        p->k[l] = kp[l] = tu_alloc(SLOTS * SLOT_BYTES);
        p->v[l] = vp[l] = tu_alloc(SLOTS * SLOT_BYTES);
        for (size_t i = 0; i < SLOTS * SLOT_BYTES; i++) {
            p->k[l][i] = (uint8_t)(fill + i * 7 + l);
            p->v[l][i] = (uint8_t)(fill + i * 13 + l + 1);
        }
    }
    memset(&p->layout, 0, sizeof(p->layout));
    p->layout.struct_size = sizeof(kvh_pool_layout);
    p->layout.memory = KVH_MEMORY_HOST;
    p->layout.num_slots = SLOTS;
    p->layout.k_base = kp;
    p->layout.v_base = vp;
    p->layout.slot_stride = SLOT_BYTES;
    p->layout.token_stride = (uint64_t)H * D * 2;
    p->layout.head_stride = (uint64_t)D * 2;
    kvh_pool pool;
    assert_ok(kvh_pool_register(e, &p->layout, &pool));
    return pool;
}

static int slot_equal(const pool_mem *a, uint32_t sa, const pool_mem *b, uint32_t sb)
{
    for (uint32_t l = 0; l < L; l++)
        if (memcmp(a->k[l] + sa * SLOT_BYTES, b->k[l] + sb * SLOT_BYTES, SLOT_BYTES) != 0 ||
            memcmp(a->v[l] + sa * SLOT_BYTES, b->v[l] + sb * SLOT_BYTES, SLOT_BYTES) != 0)
            return 0;
    return 1;
}

static void test_offload_batch_mixing_scopes(void **state)
{
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F16, 8, 16, threads_of(state));
    pool_mem src, dst;
    kvh_pool ps = pool_new(e, &src, 0x10), pd = pool_new(e, &dst, 0x80);
    int32_t t[BT];
    tu_iota(t, BT, 1800);
    /* The same tokens from four slots of different bytes, in three scopes. */
    const uint64_t scopes[SLOTS] = {1, 2, 0, UINT64_MAX};
    kvh_pool_xfer x[SLOTS];
    memset(x, 0, sizeof(x));
    for (uint32_t i = 0; i < SLOTS; i++) {
        x[i].struct_size = sizeof(kvh_pool_xfer);
        x[i].slot = i;
        x[i].scope = scopes[i];
        x[i].tokens = t;
    }
    kvh_fence f;
    assert_ok(kvh_pool_offload_batch(e, ps, x, SLOTS, 0, &f));
    assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
    assert_ok(kvh_fence_free(e, f));
    for (uint32_t i = 0; i < SLOTS; i++) {
        assert_ok(x[i].status);
        uint64_t h;
        assert_ok(kvh_prefix_hash_scoped(e, scopes[i], 0, t, BT, &h));
        assert_true(tu_binfo(e, x[i].block).hash == h);
        for (uint32_t j = 0; j < i; j++)
            assert_true(x[i].block.id != x[j].block.id);
    }
    /* Each scope's lookup gets its slot's bytes back. */
    for (uint32_t i = 0; i < SLOTS; i++) {
        kvh_block b;
        size_t nb = 0;
        assert_ok(kvh_prefix_lookup_scoped(e, scopes[i], scopes[i], 0, t, BT, &b, 1, &nb));
        assert_int_equal(nb, 1);
        assert_true(b.id == x[i].block.id);
        assert_ok(kvh_pool_restore(e, pd, b, (i + 1) % SLOTS));
        assert_true(slot_equal(&src, i, &dst, (i + 1) % SLOTS));
        assert_ok(kvh_block_release(e, b));
    }
    /* A second batch of the same tokens in scope 2 from other bytes
     * dedupes onto scope 2's block; scope 1 still restores its own. */
    kvh_pool_xfer y = x[1];
    y.slot = 3;
    y.block.id = 0;
    assert_ok(kvh_pool_offload_batch(e, ps, &y, 1, 0, &f));
    assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
    assert_ok(kvh_fence_free(e, f));
    assert_ok(y.status);
    assert_true(y.block.id == x[1].block.id);
    assert_ok(kvh_pool_restore(e, pd, x[0].block, 0));
    assert_true(slot_equal(&src, 0, &dst, 0));
    assert_ok(kvh_block_release(e, y.block));
    for (uint32_t i = 0; i < SLOTS; i++)
        assert_ok(kvh_block_release(e, x[i].block));
    assert_ok(kvh_pool_unregister(e, ps));
    assert_ok(kvh_pool_unregister(e, pd));
}

/* ---- the remote tier: a second engine finds each tenant's own ---- */

static void test_remote_tier_keeps_tenants_apart(void **state)
{
    (void)state;
    if (!start_cluster())
        skip();
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F16, 16, 16, 1);
    c.model_salt = 0x7e4a47;
    c.remote_addrs = rt_addrs(&cluster);
    c.remote_timeout_ms = 1000;
    kvh_engine *e;
    kvh_status st = kvh_engine_open(&c, &e);
    if (st == KVH_ERR_UNSUPPORTED)
        skip(); /* built without the remote tier */
    assert_ok(st);
    tu_track_engine(e);
    int32_t t[NB * BT];
    tu_iota(t, NB * BT, 1900);
    kvh_seq a = tenant(e, 1, 1, 0, t, NB * BT, 31), b = tenant(e, 2, 2, 0, t, NB * BT, 32);
    assert_ok(kvh_seq_persist(e, a));
    assert_ok(kvh_seq_persist(e, b));
    kvh_stats up = tu_stats(e);
    assert_int_equal(up.remote_uploads, 2 * NB);
    assert_ok(tu_close(e));

    /* A fresh engine: nothing local, everything from the store. */
    kvh_engine *e2;
    assert_ok(kvh_engine_open(&c, &e2));
    tu_track_engine(e2);
    const uint64_t strangers[] = {0, 3, UINT64_MAX};
    for (size_t k = 0; k < 3; k++) {
        assert_int_equal(own_match(e2, strangers[k], strangers[k], 0, t, NB * BT, 0), 0);
        assert_int_equal(lookup_count(e2, strangers[k], t, NB * BT), 0);
    }
    kvh_stats s = tu_stats(e2);
    assert_int_equal(s.remote_hits, 0);
    assert_int_equal(s.remote_corrupt, 0);
    assert_int_equal(own_match(e2, 2, 2, 0, t, NB * BT, 32), NB * BT);
    assert_int_equal(own_match(e2, 1, 1, 0, t, NB * BT, 31), NB * BT);
    assert_int_equal(tu_stats(e2).remote_hits, 2 * NB);
    assert_ok(tu_close(e2));

    /* A shared part through the store: tenant 5 publishes a one-block
     * prompt shared in scope 9, then its own two blocks. */
    int32_t u[NB * BT];
    tu_iota(u, NB * BT, 2100);
    kvh_engine *e3;
    assert_ok(kvh_engine_open(&c, &e3));
    tu_track_engine(e3);
    kvh_seq p = tenant(e3, 5, 9, BT, u, NB * BT, 41);
    assert_ok(kvh_seq_persist(e3, p));
    assert_ok(tu_close(e3));
    kvh_engine *e4;
    assert_ok(kvh_engine_open(&c, &e4));
    tu_track_engine(e4);
    assert_int_equal(own_match(e4, 6, 6, 0, u, NB * BT, 0), 0);
    assert_int_equal(own_match(e4, 6, 9, BT, u, NB * BT, 41), BT); /* the shared block only */
    assert_int_equal(own_match(e4, 5, 5, 0, u, NB * BT, 0), 0);    /* without its shared part */
    assert_int_equal(own_match(e4, 5, 9, BT, u, NB * BT, 41), NB * BT);
    assert_int_equal(own_match(e4, 9, 9, 0, u, NB * BT, 41), BT);
    assert_ok(tu_close(e4));
}

/* ---- misuse ---- */

static void test_scope_misuse_keeps_the_engine_sound(void **state)
{
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F16, 8, 16, threads_of(state));
    int32_t t[2 * BT];
    tu_iota(t, 2 * BT, 2000);
    kvh_seq keep = tenant(e, 5, 5, 0, t, 2 * BT, 4);
    /* Truncated to 0 while holding an acquire: empty, so re-scopable; the
     * hold went with the blocks. */
    kvh_seq s = tenant(e, 6, 6, 0, t, 2 * BT, 6);
    assert_ok(kvh_seq_acquire(e, s, 0, 2 * BT, NULL));
    assert_ok(kvh_seq_truncate(e, s, 0));
    assert_ok(kvh_seq_set_scope(e, s, UINT64_MAX, 0, UINT64_MAX));
    uint64_t sc = 0, ss = 1, st = 0;
    assert_ok(kvh_seq_get_scope(e, s, &sc, &ss, &st));
    assert_true(sc == UINT64_MAX && ss == 0 && st == UINT64_MAX);
    assert_kvh(KVH_ERR_RANGE, kvh_seq_release(e, s, 0, 2 * BT));
    /* shared_tokens past any length with the default scope shared: the
     * whole prefix is in scope 0, where nobody published these tokens. */
    size_t m = 99;
    assert_ok(kvh_seq_match_prefix(e, s, t, 2 * BT, &m));
    assert_int_equal(m, 0);
    /* A scope change of a non-empty sequence changes nothing. */
    assert_ok(kvh_seq_append(e, s, t, 1));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_set_scope(e, s, 5, 5, 0));
    assert_ok(kvh_seq_get_scope(e, s, &sc, NULL, NULL));
    assert_true(sc == UINT64_MAX);
    /* Handles of another engine and of a closed one. */
    kvh_engine *e2 = tu_open(L, H, D, BT, KVH_DTYPE_F16, 4, 4, 0);
    kvh_seq foreign = tu_seq_new(e2, 0);
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_set_scope(e, foreign, 1, 1, 0));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_get_scope(e, foreign, &sc, NULL, NULL));
    tu_close(e2);
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_set_scope(e, foreign, 1, 1, 0));
    /* Ranges whose block count overflows nothing: n far past the tokens
     * given is not allowed (n is the token count); cap 0 finds nothing. */
    size_t nb = 99;
    kvh_block out[1];
    assert_ok(kvh_prefix_lookup_scoped(e, 5, 5, 0, t, 2 * BT, out, 0, &nb));
    assert_int_equal(nb, 0);
    assert_ok(kvh_prefix_lookup_scoped(e, 5, 5, 0, t, 2 * BT - 1, out, 1, &nb));
    assert_int_equal(nb, 1);
    assert_ok(kvh_block_release(e, out[0]));
    /* Still sound. */
    assert_true(tu_check_pattern(e, keep, L, TOKB, 4, 0, 2 * BT));
    assert_int_equal(own_match(e, 5, 5, 0, t, 2 * BT, 4), 2 * BT);
}

static int teardown(void **state)
{
    dt_teardown(state);
    return tu_teardown(state);
}

static int group_teardown(void **state)
{
    (void)state;
    if (have_cluster > 0)
        rt_stop(&cluster);
    return 0;
}

#define BOTH(fn)                                                                                                       \
    cmocka_unit_test_prestate_setup_teardown(fn, NULL, teardown, (void *)(uintptr_t)0),                                \
        cmocka_unit_test_prestate_setup_teardown(fn, NULL, teardown, (void *)(uintptr_t)2)

int main(void)
{
    const struct CMUnitTest tests[] = {
        BOTH(test_same_tokens_each_tenant_reads_its_own),
        BOTH(test_miss_on_disk_blocks_reads_nothing),
        BOTH(test_miss_does_not_refresh_recency),
        BOTH(test_forged_hash_cannot_block_or_probe_a_tenant),
        BOTH(test_forgery_without_the_secret_salt_changes_nothing),
        BOTH(test_fork_truncate_and_rescope),
        BOTH(test_offload_batch_mixing_scopes),
        cmocka_unit_test_teardown(test_remote_tier_keeps_tenants_apart, teardown),
        cmocka_unit_test_teardown(test_forged_hash_in_the_remote_store, teardown),
        BOTH(test_scope_misuse_keeps_the_engine_sound),
    };
    return cmocka_run_group_tests(tests, NULL, group_teardown);
}
