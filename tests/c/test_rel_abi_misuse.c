/* Reliability battery, item 6: ABI misuse. Always a status code, never a
 * crash (the ASan build runs this too).
 *
 *   - NULL everywhere: every exported call with each pointer argument NULL
 *     in turn (and a NULL engine): a documented error code (or the
 *     documented KVH_OK for the calls that accept NULL), out-parameters
 *     untouched, and the engine still works afterwards;
 *   - 10^6 random handle values (random, right tag with random bits, right
 *     tag and index with a wrong generation, handles of the wrong type) for
 *     every call that takes a handle: KVH_ERR_BAD_HANDLE, nothing changes;
 *   - double free / over-release: a second kvh_seq_free, kvh_fence_free,
 *     kvh_pool_unregister, one release too many, unpin without pin,
 *     release without acquire: an error, and the counters still add up;
 *   - use after close: the engine pointer itself is freed by
 *     kvh_engine_close (like fclose, documented: using it afterwards is
 *     undefined and not tested); what is tested is that sequence, block,
 *     fence and pool handles of a closed engine are rejected
 *     (KVH_ERR_BAD_HANDLE) by a new engine opened on the same store, both
 *     when the new engine has created nothing yet and after it created the
 *     same objects in the same order (calls racing close from other
 *     threads: test_rel_close_race_mt.c);
 *   - wrong struct_size for every versioned struct, every size from 0 to
 *     sizeof + 64: KVH_ERR_STRUCT_SIZE (kvh_stats accepts older, smaller
 *     sizes and must not write past them);
 *   - absurd lengths ((size_t)-1 and neighbours) with a small buffer:
 *     rejected before the buffer is read past its end.
 *
 * 10^6 handle calls in CI and in the stress twin alike (they take about a
 * second); KVH_REL_HANDLE_CALLS overrides.
 */
#include "forged_calls.h"
#include "rel_util.h"

enum { L = 2, H = 2, D = 8, BT = 4 };
static const dt_geo G = {L, H, D, BT, KVH_DTYPE_F32};
#define TOK ((size_t)H * D * 4)

typedef struct fixture {
    kvh_engine *e;
    kvh_seq s, s2;
    kvh_block b;     /* standalone, retained once */
    kvh_block sb[3]; /* blocks of s */
    kvh_fence f;     /* completed, not freed */
    kvh_pool pool;
    void *kbase[L], *vbase[L];
    kvh_pool_layout layout;
    uint8_t pool_mem[2 * L * 4 * BT * TOK];
} fixture;

static fixture X;

static void make_fixture(const char *disk_dir)
{
    memset(&X, 0, sizeof(X));
    kvh_config c = dt_cfg(G, disk_dir, 16, 16, disk_dir ? 64 : 0, 0);
    X.e = dt_open_a(&c);
    dt_assert_ok(dt_build(X.e, G, dt_plain(1), 10, 1, &X.s));
    dt_assert_ok(kvh_seq_create(X.e, 2, &X.s2));
    dt_assert_ok(kvh_seq_blocks(X.e, X.s, 0, 3, X.sb));
    dt_assert_ok(kvh_block_alloc(X.e, 0, &X.b));
    dt_assert_ok(kvh_seq_migrate(X.e, X.s2, 0, 0, KVH_TIER_HOST, &X.f));
    for (int l = 0; l < L; l++) {
        X.kbase[l] = X.pool_mem + (size_t)(2 * l) * 4 * BT * TOK;
        X.vbase[l] = X.pool_mem + (size_t)(2 * l + 1) * 4 * BT * TOK;
    }
    X.layout = (kvh_pool_layout){.struct_size = sizeof(kvh_pool_layout),
                                 .memory = KVH_MEMORY_HOST,
                                 .num_slots = 4,
                                 .k_base = X.kbase,
                                 .v_base = X.vbase,
                                 .slot_stride = BT * TOK,
                                 .token_stride = TOK,
                                 .head_stride = D * 4};
    dt_assert_ok(kvh_pool_register(X.e, &X.layout, &X.pool));
}

/* The engine still does a full round trip and its counters add up. */
static void still_works(kvh_engine *e, uint64_t stream)
{
    kvh_seq s, c;
    dt_assert_ok(dt_build(e, G, dt_plain(stream), 7, 5, &s));
    dt_assert_ok(kvh_seq_fork(e, s, 6, &c));
    dt_assert_ok(kvh_seq_acquire(e, c, 0, 7, NULL));
    char msg[256] = "";
    if (dt_verify(e, c, G, dt_plain(stream), 0, 7, msg, sizeof(msg)) != KVH_OK)
        fail_msg("round trip: %s", msg);
    dt_assert_ok(kvh_seq_release(e, c, 0, 7));
    dt_assert_ok(kvh_seq_free(e, c));
    dt_assert_ok(kvh_seq_free(e, s));
    if (rl_counters_add_up(e, false, msg, sizeof(msg)) && rl_counters_add_up(e, true, msg, sizeof(msg)))
        fail_msg("counters: %s", msg);
}

/* ------------------------------------------------------------------ */
/* NULL everywhere                                                     */
/* ------------------------------------------------------------------ */

static int null_calls;

/* An error code from the list; with want != 0, exactly want. */
#define EXPECT_ERR(want, call)                                                                                         \
    do {                                                                                                               \
        kvh_status st_ = (call);                                                                                       \
        null_calls++;                                                                                                  \
        if (st_ == KVH_OK || !rl_status_known(st_) || ((want) != 0 && st_ != (want)))                                  \
            fail_msg("%s:%d: %s returned %s (%d), expected %s", __FILE__, __LINE__, #call, kvh_status_name(st_),       \
                     (int)st_, (want) ? kvh_status_name(want) : "an error");                                           \
    } while (0)
#define EXPECT_OK(call)                                                                                                \
    do {                                                                                                               \
        null_calls++;                                                                                                  \
        dt_assert_ok(call);                                                                                            \
    } while (0)

static void test_null_everywhere(void **state)
{
    (void)state;
    make_fixture(NULL);
    kvh_engine *e = X.e;
    const kvh_status INV = KVH_ERR_INVALID_ARG;
    /* out-parameters hold a sentinel that must survive every failure */
    const uint64_t SENT = 0x5e5e5e5e5e5e5e5eull;
    kvh_seq os = {SENT};
    kvh_block ob = {SENT};
    kvh_fence of = {SENT};
    kvh_pool op = {SENT};
    uint64_t u64 = SENT;
    size_t sz = SENT;
    int32_t toks[16];
    dt_tokens(dt_plain(1), 0, 16, toks);
    uint8_t k[4 * TOK], v[4 * TOK];
    memset(k, 1, sizeof(k));
    memset(v, 2, sizeof(v));
    kvh_config cfg;
    kvh_config_init(&cfg, sizeof(cfg));
    kvh_engine *oe = (kvh_engine *)(uintptr_t)SENT;

    /* version, errors, config */
    assert_non_null(kvh_strerror(12345));
    assert_non_null(kvh_status_name(-12345));
    assert_non_null(kvh_last_error());
    assert_non_null(kvh_version_string());
    EXPECT_ERR(INV, kvh_config_init(NULL, sizeof(kvh_config)));
    EXPECT_ERR(INV, kvh_attention_params_init(NULL, sizeof(kvh_attention_params)));

    /* engine */
    EXPECT_ERR(INV, kvh_engine_open(NULL, &oe));
    EXPECT_ERR(INV, kvh_engine_open(&cfg, NULL));
    assert_true(oe == (kvh_engine *)(uintptr_t)SENT);
    EXPECT_OK(kvh_engine_close(NULL));
    EXPECT_ERR(INV, kvh_engine_block_bytes(NULL, &u64));
    EXPECT_ERR(INV, kvh_engine_block_bytes(e, NULL));
    assert_null(kvh_engine_backend(NULL));
    kvh_tier_info ti = {.struct_size = sizeof(ti)};
    EXPECT_ERR(INV, kvh_tier_info_get(NULL, 0, &ti));
    EXPECT_ERR(INV, kvh_tier_info_get(e, 0, NULL));
    kvh_stats stt = {.struct_size = sizeof(stt)};
    EXPECT_ERR(INV, kvh_engine_stats(NULL, &stt));
    EXPECT_ERR(INV, kvh_engine_stats(e, NULL));
    EXPECT_ERR(INV, kvh_agent_set_quota(NULL, 1, 100));

    /* sequences: NULL engine, then each NULL pointer */
    EXPECT_ERR(INV, kvh_seq_create(NULL, 0, &os));
    EXPECT_ERR(INV, kvh_seq_create(e, 0, NULL));
    EXPECT_ERR(INV, kvh_seq_free(NULL, X.s2));
    EXPECT_ERR(INV, kvh_seq_fork(NULL, X.s, 0, &os));
    EXPECT_ERR(INV, kvh_seq_fork(e, X.s, 0, NULL));
    EXPECT_ERR(INV, kvh_seq_append(NULL, X.s2, toks, 1));
    EXPECT_ERR(INV, kvh_seq_append(e, X.s2, NULL, 1));
    EXPECT_ERR(INV, kvh_seq_length(NULL, X.s, &u64));
    EXPECT_ERR(INV, kvh_seq_length(e, X.s, NULL));
    EXPECT_ERR(INV, kvh_seq_tokens(NULL, X.s, 0, 1, toks));
    EXPECT_ERR(INV, kvh_seq_tokens(e, X.s, 0, 1, NULL));
    EXPECT_ERR(INV, kvh_seq_write_kv(NULL, X.s, 0, 0, 1, k, v));
    EXPECT_ERR(INV, kvh_seq_write_kv(e, X.s, 0, 0, 1, NULL, v));
    EXPECT_ERR(INV, kvh_seq_write_kv(e, X.s, 0, 0, 1, k, NULL));
    EXPECT_ERR(INV, kvh_seq_read_kv(NULL, X.s, 0, 0, 1, k, v));
    EXPECT_OK(kvh_seq_read_kv(e, X.s, 0, 0, 1, NULL, v)); /* documented: either may be NULL */
    EXPECT_OK(kvh_seq_read_kv(e, X.s, 0, 0, 1, k, NULL));
    EXPECT_ERR(INV, kvh_seq_persist(NULL, X.s));
    EXPECT_ERR(INV, kvh_seq_truncate(NULL, X.s, 0));
    EXPECT_ERR(INV, kvh_seq_match_prefix(NULL, X.s2, toks, 8, &sz));
    EXPECT_ERR(INV, kvh_seq_match_prefix(e, X.s2, NULL, 8, &sz));
    EXPECT_ERR(INV, kvh_seq_match_prefix(e, X.s2, toks, 8, NULL));
    EXPECT_ERR(INV, kvh_seq_acquire(NULL, X.s, 0, 1, &of));
    EXPECT_ERR(INV, kvh_seq_release(NULL, X.s, 0, 1));
    EXPECT_ERR(INV, kvh_seq_pin(NULL, X.s, 0, 1, 1));
    EXPECT_ERR(INV, kvh_seq_blocks(NULL, X.s, 0, 1, &ob));
    EXPECT_ERR(INV, kvh_seq_blocks(e, X.s, 0, 1, NULL));
    int32_t indptr[3], indices[8], lpl[2];
    kvh_seq batch[2] = {X.s, X.s2};
    EXPECT_ERR(INV, kvh_block_table(NULL, batch, 2, indptr, indices, 8, lpl));
    EXPECT_ERR(INV, kvh_block_table(e, NULL, 2, indptr, indices, 8, lpl));
    EXPECT_ERR(INV, kvh_block_table(e, batch, 2, NULL, indices, 8, lpl));
    EXPECT_ERR(INV, kvh_block_table(e, batch, 2, indptr, NULL, 8, lpl));
    EXPECT_ERR(INV, kvh_block_table(e, batch, 2, indptr, indices, 8, NULL));
    EXPECT_ERR(INV, kvh_seq_migrate(NULL, X.s, 0, 1, KVH_TIER_HOST, NULL));
    EXPECT_ERR(INV, kvh_prefetch(NULL, X.s, 0, 1, 0, NULL));

    /* blocks, fences */
    kvh_block_info bi = {.struct_size = sizeof(bi)};
    EXPECT_ERR(INV, kvh_block_info_get(NULL, X.b, &bi));
    EXPECT_ERR(INV, kvh_block_info_get(e, X.b, NULL));
    EXPECT_ERR(INV, kvh_block_alloc(NULL, 0, &ob));
    EXPECT_ERR(INV, kvh_block_alloc(e, 0, NULL));
    EXPECT_ERR(INV, kvh_block_retain(NULL, X.b));
    EXPECT_ERR(INV, kvh_block_release(NULL, X.b));
    EXPECT_ERR(INV, kvh_block_pin(NULL, X.b, 1));
    EXPECT_ERR(INV, kvh_migrate(NULL, &X.b, 1, KVH_TIER_HOST, NULL));
    EXPECT_ERR(INV, kvh_migrate(e, NULL, 1, KVH_TIER_HOST, &of));
    EXPECT_ERR(INV, kvh_fence_wait(NULL, X.f, 0));
    int32_t done = 7;
    EXPECT_ERR(INV, kvh_fence_poll(NULL, X.f, &done));
    EXPECT_ERR(INV, kvh_fence_poll(e, X.f, NULL));
    EXPECT_ERR(INV, kvh_fence_free(NULL, X.f));
    /* the null handle, where documented */
    EXPECT_OK(kvh_seq_free(e, (kvh_seq){0}));
    EXPECT_OK(kvh_block_release(e, (kvh_block){0}));
    EXPECT_OK(kvh_fence_free(e, (kvh_fence){0}));
    EXPECT_OK(kvh_pool_unregister(e, (kvh_pool){0}));

    /* prefix, pools */
    EXPECT_ERR(INV, kvh_prefix_hash(NULL, 0, toks, BT, &u64));
    EXPECT_ERR(INV, kvh_prefix_hash(e, 0, NULL, BT, &u64));
    EXPECT_ERR(INV, kvh_prefix_hash(e, 0, toks, BT, NULL));
    kvh_block outb[4];
    EXPECT_ERR(INV, kvh_prefix_lookup(NULL, toks, 8, outb, 4, &sz));
    EXPECT_ERR(INV, kvh_prefix_lookup(e, NULL, 8, outb, 4, &sz));
    EXPECT_ERR(INV, kvh_prefix_lookup(e, toks, 8, NULL, 4, &sz));
    EXPECT_ERR(INV, kvh_prefix_lookup(e, toks, 8, outb, 4, NULL));
    EXPECT_ERR(INV, kvh_pool_register(NULL, &X.layout, &op));
    EXPECT_ERR(INV, kvh_pool_register(e, NULL, &op));
    EXPECT_ERR(INV, kvh_pool_register(e, &X.layout, NULL));
    kvh_pool_layout bad = X.layout;
    bad.k_base = NULL;
    EXPECT_ERR(INV, kvh_pool_register(e, &bad, &op));
    bad = X.layout;
    bad.v_base = NULL;
    EXPECT_ERR(INV, kvh_pool_register(e, &bad, &op));
    void *kb_null[L] = {NULL, NULL};
    bad = X.layout;
    bad.k_base = kb_null;
    EXPECT_ERR(INV, kvh_pool_register(e, &bad, &op));
    EXPECT_ERR(INV, kvh_pool_unregister(NULL, X.pool));
    EXPECT_ERR(INV, kvh_pool_offload(NULL, X.pool, 0, 0, toks, BT, 0, &ob));
    EXPECT_ERR(INV, kvh_pool_offload(e, X.pool, 0, 0, NULL, BT, 0, &ob));
    EXPECT_ERR(INV, kvh_pool_offload(e, X.pool, 0, 0, toks, BT, 0, NULL));
    EXPECT_ERR(INV, kvh_pool_restore(NULL, X.pool, X.sb[0], 0));

    /* attention: NULL engine, sequences, q, out, q_lens */
    float q[2 * H * D], out[2 * H * D];
    memset(q, 0, sizeof(q));
    kvh_seq one[1] = {X.s};
    uint32_t qlens[1] = {1};
    EXPECT_ERR(INV, kvh_attention_decode(NULL, 0, one, 1, q, out, NULL));
    EXPECT_ERR(INV, kvh_attention_decode(e, 0, NULL, 1, q, out, NULL));
    EXPECT_ERR(INV, kvh_attention_decode(e, 0, one, 1, NULL, out, NULL));
    EXPECT_ERR(INV, kvh_attention_decode(e, 0, one, 1, q, NULL, NULL));
    EXPECT_ERR(INV, kvh_attention_prefill(NULL, 0, one, qlens, 1, q, out, NULL));
    EXPECT_ERR(INV, kvh_attention_prefill(e, 0, NULL, qlens, 1, q, out, NULL));
    EXPECT_ERR(INV, kvh_attention_prefill(e, 0, one, NULL, 1, q, out, NULL));
    EXPECT_ERR(INV, kvh_attention_prefill(e, 0, one, qlens, 1, NULL, out, NULL));
    EXPECT_ERR(INV, kvh_attention_prefill(e, 0, one, qlens, 1, q, NULL, NULL));

    /* out-parameters are written only on success */
    assert_true(os.id == SENT && ob.id == SENT && of.id == SENT && op.id == SENT && u64 == SENT && sz == SENT);
    assert_int_equal(done, 7);
    assert_true(kvh_last_error()[0] != '\0');
    still_works(e, 77);
    print_message("NULL everywhere: %d calls, each a documented status; out-parameters untouched\n", null_calls);
}

/* ------------------------------------------------------------------ */
/* 10^6 random handle values                                           */
/* ------------------------------------------------------------------ */

/* A handle value that names nothing live: random, right tag + random, or
 * right tag and a live index with another generation, or a live handle of
 * another type. */
static uint64_t bad_handle_(dt_rng *r, uint8_t tag, const uint64_t *live, int n_live, const uint64_t *others,
                            int n_others)
{
    switch (dt_below(r, 5)) {
    case 0:
        return dt_next(r) | 1; /* never the null handle */
    case 1:
        return ((uint64_t)tag << 56) | (dt_next(r) & 0x00ffffffffffffffull) | 1;
    case 2: {
        uint64_t h = live[dt_below(r, (uint64_t)n_live)];
        uint64_t gen = (h >> 32) & 0xffffff, ng = (gen + 1 + dt_below(r, 0xfffffe)) & 0xffffff;
        if (ng == gen || ng == 0)
            ng = gen ^ 0x800000;
        return (h & ~(0xffffffull << 32)) | (ng << 32);
    }
    case 3: {
        uint64_t h = live[dt_below(r, (uint64_t)n_live)];
        return h + ((dt_below(r, 64) + 1) << (dt_below(r, 2) ? 0 : 8)); /* another index */
    }
    default: {
        uint64_t h = others[dt_below(r, (uint64_t)n_others)];
        return (h >> 56) == tag ? h ^ (1ull << 40) : h;
    }
    }
}

/* Every live handle of the fixture, of any type. */
static uint64_t all_live[16];
static int n_all_live;

static uint64_t bad_handle(dt_rng *r, uint8_t tag, const uint64_t *live, int n_live, const uint64_t *others,
                           int n_others)
{
    for (;;) {
        uint64_t h = bad_handle_(r, tag, live, n_live, others, n_others);
        bool is_live = h == 0;
        for (int i = 0; i < n_all_live; i++)
            is_live |= (h == all_live[i] && (h >> 56) == tag);
        if (!is_live)
            return h;
    }
}

static void test_random_handles(void **state)
{
    (void)state;
    long calls = dt_env_long("KVH_REL_HANDLE_CALLS", 1000000);
    uint64_t seed = dt_seed(0x4a4d7e5ull);
    dt_rng r = {seed};
    char dir[512];
    dt_scratch("abi-handles", dir, sizeof(dir));
    make_fixture(dir); /* with a disk tier */
    kvh_engine *e = X.e;
    uint64_t seqs[] = {X.s.id, X.s2.id};
    uint64_t blocks[] = {X.b.id, X.sb[0].id, X.sb[1].id, X.sb[2].id};
    uint64_t fences[] = {X.f.id};
    uint64_t pools[] = {X.pool.id};
    uint64_t others[] = {X.s.id, X.s2.id, X.b.id, X.sb[0].id, X.f.id, X.pool.id};
    uint64_t every[] = {X.s.id, X.s2.id, X.b.id, X.sb[0].id, X.sb[1].id, X.sb[2].id, X.f.id, X.pool.id};
    n_all_live = 0;
    for (size_t i = 0; i < sizeof(every) / sizeof(every[0]); i++)
        all_live[n_all_live++] = every[i];
    kvh_stats before = dt_stats(e);
    forged_targets t = {.engine = e,
                        .seq = X.s,
                        .block = X.b,
                        .slot_block = X.sb[0],
                        .pool = X.pool,
                        .heads = H,
                        .head_dim = D,
                        .block_tokens = BT};
    const struct {
        const uint64_t *live;
        int n;
    } live_of[] = {[FORGED_SEQ] = {seqs, 2},
                   [FORGED_BLOCK] = {blocks, 4},
                   [FORGED_FENCE] = {fences, 1},
                   [FORGED_POOL] = {pools, 1}};
    double t0 = dt_now();
    for (long i = 0; i < calls; i++) {
        int fn = (int)(i % forged_call_count());
        forged_kind kind = forged_call_kind(fn);
        uint64_t h = bad_handle(&r, forged_kind_tag(kind), live_of[kind].live, live_of[kind].n, others, 6);
        kvh_status st = forged_call(&t, fn, h, (uint64_t)i);
        if (st != KVH_ERR_BAD_HANDLE)
            fail_msg("call %ld (function %d, seed 0x%" PRIx64 "): %s, expected KVH_ERR_BAD_HANDLE", i, fn, seed,
                     kvh_status_name(st));
    }
    double secs = dt_now() - t0;
    kvh_stats after = dt_stats(e);
    assert_int_equal(after.blocks_allocated, before.blocks_allocated);
    assert_int_equal(after.blocks_freed, before.blocks_freed);
    assert_int_equal(after.lookups, before.lookups);
    kvh_block_info b0 = {.struct_size = sizeof(b0)};
    dt_assert_ok(kvh_block_info_get(e, X.b, &b0));
    assert_int_equal(b0.refs, 1);
    assert_int_equal(b0.pins, 0);
    char msg[256];
    if (dt_verify(e, X.s, G, dt_plain(1), 0, 10, msg, sizeof(msg)) != KVH_OK)
        fail_msg("fixture changed: %s", msg);
    still_works(e, 78);
    print_message("random handles: %ld calls in %.2f s, every one KVH_ERR_BAD_HANDLE, nothing changed\n", calls, secs);
}

/* ------------------------------------------------------------------ */
/* Double free, over-release                                           */
/* ------------------------------------------------------------------ */

static void test_double_free(void **state)
{
    (void)state;
    make_fixture(NULL);
    kvh_engine *e = X.e;
    /* sequences */
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, dt_plain(2), 9, 0, &s));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_free(e, s));
    dt_assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_free(e, s));
    /* fences: freed twice, freed while pending then again */
    dt_assert_ok(kvh_fence_free(e, X.f));
    dt_assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_free(e, X.f));
    dt_assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_wait(e, X.f, 0));
    kvh_fence f;
    dt_assert_ok(kvh_seq_acquire(e, X.s, 0, 10, &f));
    dt_assert_ok(kvh_fence_free(e, f));
    dt_assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_free(e, f));
    dt_assert_ok(kvh_seq_release(e, X.s, 0, 10));
    /* pools */
    dt_assert_ok(kvh_pool_unregister(e, X.pool));
    dt_assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_unregister(e, X.pool));
    /* blocks: one release too many, then a freed one */
    kvh_block b;
    dt_assert_ok(kvh_block_alloc(e, 0, &b));
    dt_assert_ok(kvh_block_retain(e, b));
    dt_assert_ok(kvh_block_release(e, b));
    dt_assert_ok(kvh_block_release(e, b)); /* last reference: freed */
    dt_assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_release(e, b));
    dt_assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_retain(e, b));
    kvh_block_info bi = {.struct_size = sizeof(bi)};
    dt_assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_info_get(e, b, &bi));
    /* unpin without pin, release without acquire, a second release */
    dt_assert_kvh(KVH_ERR_INVALID_ARG, kvh_block_pin(e, X.b, 0));
    dt_assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_pin(e, X.s, 0, 4, 0));
    dt_assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_release(e, X.s, 0, 4));
    dt_assert_ok(kvh_seq_acquire(e, X.s, 0, 4, NULL));
    dt_assert_ok(kvh_seq_release(e, X.s, 0, 4));
    dt_assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_release(e, X.s, 0, 4));
    dt_assert_ok(kvh_seq_pin(e, X.s, 0, 4, 1));
    dt_assert_ok(kvh_seq_pin(e, X.s, 0, 4, 0));
    dt_assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_pin(e, X.s, 0, 4, 0));
    /* everything the fixture owns is still right */
    char msg[256];
    if (dt_verify(e, X.s, G, dt_plain(1), 0, 10, msg, sizeof(msg)) != KVH_OK)
        fail_msg("after the double frees: %s", msg);
    kvh_block_info s0 = {.struct_size = sizeof(s0)};
    dt_assert_ok(kvh_block_info_get(e, X.sb[0], &s0));
    assert_int_equal(s0.refs, 1);
    assert_int_equal(s0.holds, 0);
    assert_int_equal(s0.pins, 0);
    still_works(e, 79);
}

/* One kvh_block_release too many on a block that only a sequence holds:
 * the caller never took that reference. It has to be refused; if it is
 * taken, the sequence keeps naming a freed block that the next allocation
 * reuses, and the sequence then serves another sequence's data. */
static void test_release_of_a_reference_never_taken(void **state)
{
    (void)state;
    make_fixture(NULL);
    kvh_engine *e = X.e;
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, dt_plain(5), 6, 0, &s)); /* a full block and a partial one */
    kvh_block b[2];
    dt_assert_ok(kvh_seq_blocks(e, s, 0, 2, b));
    kvh_status st = kvh_block_release(e, b[1]);
    /* whatever it answered: the sequence must still read back right after
     * another sequence reuses the slot */
    kvh_seq other;
    dt_assert_ok(dt_build(e, G, dt_plain(6), BT, 0, &other));
    char msg[256] = "";
    kvh_status vst = dt_verify(e, s, G, dt_plain(5), 0, 6, msg, sizeof(msg));
    kvh_seq_free(e, other);
    kvh_seq_free(e, s);
    if (st == KVH_OK)
        fail_msg("kvh_block_release of a reference the caller never took (only the sequence holds the block) "
                 "returned KVH_OK; afterwards the sequence %s%s",
                 vst == KVH_OK ? "still reads back fine" : "serves wrong data: ", vst == KVH_OK ? "" : msg);
    if (vst != KVH_OK)
        fail_msg("after a refused over-release, the sequence reads back wrong: %s", msg);
}

/* ------------------------------------------------------------------ */
/* Handles of a closed engine                                          */
/* ------------------------------------------------------------------ */

typedef struct old_handles {
    kvh_seq s, fork;
    kvh_block b, sb;
    kvh_fence f;
    kvh_pool pool;
} old_handles;

/* Makes one of each object, in a fixed order. */
static old_handles make_objects(kvh_engine *e)
{
    old_handles h;
    dt_assert_ok(dt_build(e, G, dt_plain(3), 8, 0, &h.s));
    dt_assert_ok(kvh_seq_persist(e, h.s));
    dt_assert_ok(kvh_seq_fork(e, h.s, 1, &h.fork));
    dt_assert_ok(kvh_block_alloc(e, 0, &h.b));
    dt_assert_ok(kvh_seq_blocks(e, h.s, 0, 1, &h.sb));
    dt_assert_ok(kvh_seq_migrate(e, h.s, 0, 8, KVH_TIER_HOST, &h.f));
    dt_assert_ok(kvh_fence_wait(e, h.f, UINT64_MAX));
    for (int l = 0; l < L; l++) {
        X.kbase[l] = X.pool_mem + (size_t)(2 * l) * 4 * BT * TOK;
        X.vbase[l] = X.pool_mem + (size_t)(2 * l + 1) * 4 * BT * TOK;
    }
    X.layout = (kvh_pool_layout){.struct_size = sizeof(kvh_pool_layout),
                                 .memory = KVH_MEMORY_HOST,
                                 .num_slots = 4,
                                 .k_base = X.kbase,
                                 .v_base = X.vbase,
                                 .slot_stride = BT * TOK,
                                 .token_stride = TOK,
                                 .head_stride = D * 4};
    dt_assert_ok(kvh_pool_register(e, &X.layout, &h.pool));
    return h;
}

/* Every old handle must be rejected by e; returns how many were accepted
 * (and lists them). */
static int old_accepted(kvh_engine *e, const old_handles *h, const char *when)
{
    int bad = 0;
    uint64_t n = 0;
    kvh_block_info bi = {.struct_size = sizeof(bi)};
    int32_t done = 0;
    struct {
        const char *what;
        kvh_status st;
    } r[] = {
        {"sequence (kvh_seq_length)", kvh_seq_length(e, h->s, &n)},
        {"forked sequence (kvh_seq_length)", kvh_seq_length(e, h->fork, &n)},
        {"standalone block (kvh_block_info_get)", kvh_block_info_get(e, h->b, &bi)},
        {"block of a sequence (kvh_block_info_get)", kvh_block_info_get(e, h->sb, &bi)},
        {"fence (kvh_fence_poll)", kvh_fence_poll(e, h->f, &done)},
        {"pool (kvh_pool_restore)", kvh_pool_restore(e, h->pool, h->sb, 0)},
    };
    for (size_t i = 0; i < sizeof(r) / sizeof(r[0]); i++)
        if (r[i].st != KVH_ERR_BAD_HANDLE) {
            print_error("  %s: a %s handle of the closed engine was accepted: %s\n", when, r[i].what,
                        kvh_status_name(r[i].st));
            bad++;
        }
    return bad;
}

static void test_handles_of_a_closed_engine(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("abi-closed", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 16, 16, 64, 0);
    kvh_engine *e = dt_open_a(&c);
    old_handles old = make_objects(e);
    dt_assert_ok(dt_close(e));
    /* the same store, reopened: it recovers the persisted blocks */
    e = dt_open_a(&c);
    int bad = old_accepted(e, &old, "new engine, nothing created yet");
    /* ... and after making the same objects in the same order */
    old_handles now = make_objects(e);
    (void)now;
    bad += old_accepted(e, &old, "new engine, same objects created again");
    dt_assert_ok(dt_close(e));
    if (bad)
        fail_msg("%d handle(s) of a closed engine were accepted by a new engine on the same store: handles are not "
                 "unique across engine instances, so a stale handle silently names another object",
                 bad);
}

/* ------------------------------------------------------------------ */
/* Wrong struct_size                                                   */
/* ------------------------------------------------------------------ */

/* kvh.h, "Params and info structs": the library's size, or a multiple of
 * 8 from 8 up to it. */
static bool size_taken(size_t size, size_t ours) { return size == ours || (size % 8 == 0 && size >= 8 && size < ours); }

static void test_wrong_struct_sizes(void **state)
{
    (void)state;
    make_fixture(NULL);
    kvh_engine *e = X.e;
    int checked = 0;
    union {
        kvh_config c;
        kvh_attention_params a;
        kvh_tier_info t;
        kvh_block_info b;
        kvh_stats s;
        kvh_pool_layout p;
        uint8_t raw[1024];
    } u;
    for (size_t size = 0; size <= sizeof(kvh_stats) + 64; size++) {
        /* *_init: the sizes the policy takes, nothing written past them */
        memset(&u, 0xCC, sizeof(u));
        kvh_status st = kvh_config_init(&u.c, size);
        if (size_taken(size, sizeof(kvh_config))) {
            dt_assert_ok(st);
            for (size_t i = size; i < sizeof(u); i++)
                assert_int_equal(u.raw[i], 0xCC);
        } else {
            dt_assert_kvh(KVH_ERR_STRUCT_SIZE, st);
            for (size_t i = 0; i < sizeof(u); i++)
                assert_int_equal(u.raw[i], 0xCC); /* nothing written */
        }
        st = kvh_attention_params_init(&u.a, size);
        dt_assert_kvh(size_taken(size, sizeof(kvh_attention_params)) ? KVH_OK : KVH_ERR_STRUCT_SIZE, st);
        /* open with a config claiming another size */
        kvh_config c = dt_cfg(G, NULL, 4, 4, 0, 0);
        c.struct_size = (uint32_t)size;
        kvh_engine *oe = NULL;
        /* (a config that ends before the tier budgets would open an engine
         * of the default ones: only sizes past them are opened) */
        if (!size_taken(size, sizeof(kvh_config)) || size >= offsetof(kvh_config, disk_bytes))
            st = kvh_engine_open(&c, &oe);
        if (size_taken(size, sizeof(kvh_config))) {
            if (size >= offsetof(kvh_config, disk_bytes)) {
                dt_assert_ok(st);
                dt_assert_ok(kvh_engine_close(oe));
            }
        } else {
            dt_assert_kvh(KVH_ERR_STRUCT_SIZE, st);
            assert_null(oe);
        }
        /* tier info, block info */
        memset(&u, 0xCC, sizeof(u));
        u.t.struct_size = (uint32_t)size;
        dt_assert_kvh(size_taken(size, sizeof(kvh_tier_info)) ? KVH_OK : KVH_ERR_STRUCT_SIZE,
                      kvh_tier_info_get(e, KVH_TIER_DEVICE, &u.t));
        memset(&u, 0xCC, sizeof(u));
        u.b.struct_size = (uint32_t)size;
        dt_assert_kvh(size_taken(size, sizeof(kvh_block_info)) ? KVH_OK : KVH_ERR_STRUCT_SIZE,
                      kvh_block_info_get(e, X.b, &u.b));
        /* stats: an older, smaller struct is filled up to its size */
        memset(&u, 0xCC, sizeof(u));
        u.s.struct_size = (uint32_t)size;
        st = kvh_engine_stats(e, &u.s);
        if (size_taken(size, sizeof(kvh_stats))) {
            dt_assert_ok(st);
            for (size_t i = size; i < sizeof(u); i++)
                if (u.raw[i] != 0xCC)
                    fail_msg("kvh_engine_stats with struct_size %zu wrote byte %zu", size, i);
        } else
            dt_assert_kvh(KVH_ERR_STRUCT_SIZE, st);
        /* pool layout, attention params passed to a call */
        kvh_pool_layout pl = X.layout;
        pl.struct_size = (uint32_t)size;
        kvh_pool pool = {0};
        st = kvh_pool_register(e, &pl, &pool);
        if (size == sizeof(kvh_pool_layout)) {
            dt_assert_ok(st);
            dt_assert_ok(kvh_pool_unregister(e, pool));
        } else
            dt_assert_kvh(KVH_ERR_STRUCT_SIZE, st);
        kvh_attention_params ap;
        kvh_attention_params_init(&ap, sizeof(ap));
        ap.struct_size = (uint32_t)size;
        float q[H * D], out[H * D];
        memset(q, 0, sizeof(q));
        kvh_seq one[1] = {X.s};
        dt_assert_ok(kvh_seq_acquire(e, X.s, 0, 10, NULL));
        st = kvh_attention_decode(e, 0, one, 1, q, out, &ap);
        dt_assert_ok(kvh_seq_release(e, X.s, 0, 10));
        dt_assert_kvh(size_taken(size, sizeof(kvh_attention_params)) ? KVH_OK : KVH_ERR_STRUCT_SIZE, st);
        checked += 8;
    }
    /* a huge struct_size */
    kvh_config c = dt_cfg(G, NULL, 4, 4, 0, 0);
    c.struct_size = UINT32_MAX;
    kvh_engine *oe = NULL;
    dt_assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_engine_open(&c, &oe));
    dt_assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_config_init(&u.c, SIZE_MAX));
    still_works(e, 80);
    print_message("struct_size: %d calls with sizes 0..%zu, each KVH_ERR_STRUCT_SIZE unless the size is one the "
                  "library knows; nothing written past a smaller kvh_stats\n",
                  checked, sizeof(kvh_stats) + 64);
}

/* ------------------------------------------------------------------ */
/* Absurd lengths                                                      */
/* ------------------------------------------------------------------ */

static void test_absurd_lengths(void **state)
{
    (void)state;
    make_fixture(NULL);
    kvh_engine *e = X.e;
    /* a small buffer and lengths no buffer can have: the call must reject
     * the length before it reads or writes past the buffer (the ASan build
     * would see it) */
    int32_t toks[2 * BT];
    dt_tokens(dt_plain(9), 0, 2 * BT, toks);
    uint8_t k[2 * TOK], v[2 * TOK];
    memset(k, 3, sizeof(k));
    memset(v, 3, sizeof(v));
    kvh_block blk[2];
    int failures = 0;
    size_t lens[] = {SIZE_MAX, SIZE_MAX - 1, SIZE_MAX - BT + 1, SIZE_MAX - BT, (size_t)1 << 63, (size_t)1 << 40};
    for (size_t i = 0; i < sizeof(lens) / sizeof(lens[0]); i++) {
        size_t n = lens[i];
        /* each probe runs in a child: a crash there is a finding, not the
         * end of this test */
        struct {
            const char *name;
            int id;
        } probes[] = {{"kvh_seq_append", 0},  {"kvh_seq_tokens", 1}, {"kvh_seq_write_kv", 2},
                      {"kvh_seq_read_kv", 3}, {"kvh_seq_blocks", 4}, {"kvh_seq_match_prefix", 5}};
        for (size_t p = 0; p < sizeof(probes) / sizeof(probes[0]); p++) {
            pid_t pid = dt_fork_child();
            assert_true(pid >= 0);
            if (pid == 0) {
                kvh_seq s2;
                size_t m = 0;
                kvh_status st = KVH_OK;
                switch (probes[p].id) {
                case 0:
                    st = kvh_seq_append(e, X.s2, toks, n);
                    break;
                case 1:
                    st = kvh_seq_tokens(e, X.s, 0, n, toks);
                    break;
                case 2:
                    st = kvh_seq_write_kv(e, X.s, 0, 0, n, k, v);
                    break;
                case 3:
                    st = kvh_seq_read_kv(e, X.s, 0, 0, n, k, v);
                    break;
                case 4:
                    st = kvh_seq_blocks(e, X.s, 0, n, blk);
                    break;
                default:
                    kvh_seq_create(e, 0, &s2);
                    st = kvh_seq_match_prefix(e, s2, toks, n, &m);
                    break;
                }
                _exit(st == KVH_OK ? 1 : rl_status_known(st) ? 0 : 2);
            }
            int ws = dt_reap(pid);
            assert_true(ws != -1);
            if (!(WIFEXITED(ws) && WEXITSTATUS(ws) == 0)) {
                print_error("  %s(n = %zu): %s\n", probes[p].name, n,
                            WIFSIGNALED(ws)        ? strsignal(WTERMSIG(ws))
                            : WEXITSTATUS(ws) == 1 ? "returned KVH_OK"
                                                   : "returned an undocumented status");
                failures++;
            }
        }
    }
    if (failures)
        fail_msg("%d call(s) with an impossible length crashed or succeeded instead of returning an error", failures);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_null_everywhere, rl_teardown),
        cmocka_unit_test_teardown(test_random_handles, rl_teardown),
        cmocka_unit_test_teardown(test_double_free, rl_teardown),
        cmocka_unit_test_teardown(test_release_of_a_reference_never_taken, rl_teardown),
        cmocka_unit_test_teardown(test_wrong_struct_sizes, rl_teardown),
        cmocka_unit_test_teardown(test_absurd_lengths, rl_teardown),
        cmocka_unit_test_teardown(test_handles_of_a_closed_engine, rl_teardown),
    };
    return cmocka_run_group_tests_name("rel_abi_misuse", tests, NULL, NULL);
}
