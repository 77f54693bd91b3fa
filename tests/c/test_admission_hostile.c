/* Admission by token budget, per-agent device quotas and latency
 * histograms against a hostile caller, from kvh.h alone ("Admission by
 * token budget", "Engine: ... quotas", "Latency histograms"): NULL
 * pointers, struct sizes smaller, larger and odd (with garbage past the
 * caller's size), quotas that overflow when added, budgets at the pool
 * boundaries, double frees and stale contexts all get their documented
 * status with a message and leave the counters, tiers and reservations as
 * they were; valid calls have their effect (a quota really bounds an
 * agent's device blocks, reservations follow the sequences, histograms
 * count the disk work done and nothing else). */
#include <float.h>
#include <limits.h>

#include "test_util.h"
#include "disk_test_util.h"

enum { L = 2, H = 2, D = 4, BT = 4 };
enum { TOKB = H * D * 4 }; /* one token of one layer, f32 */

/* A refused call: its status and a message saying why. */
#define assert_fails(expected, expr)                                                                                   \
    do {                                                                                                               \
        assert_kvh(expected, expr);                                                                                    \
        const char *le_ = kvh_last_error();                                                                            \
        if (le_ == NULL || le_[0] == '\0')                                                                             \
            fail_msg("%s: %s with an empty kvh_last_error()", #expr, kvh_status_name(expected));                       \
    } while (0)

static const uint8_t JUNK = 0x5a;

/* ---- what a caller can observe of an engine ---- */

typedef struct observed {
    kvh_stats stats;
    kvh_tier_info tier[2];
    kvh_admission_info adm;
} observed;

static kvh_admission_info ainfo(kvh_engine *e)
{
    kvh_admission_info i;
    memset(&i, 0, sizeof(i));
    i.struct_size = sizeof(i);
    assert_ok(kvh_admission_info_get(e, &i));
    return i;
}

static observed observe(kvh_engine *e)
{
    observed o;
    memset(&o, 0, sizeof(o));
    o.stats = tu_stats(e);
    o.tier[0] = tu_tier(e, KVH_TIER_DEVICE);
    o.tier[1] = tu_tier(e, KVH_TIER_HOST);
    o.adm = ainfo(e);
    return o;
}

static void assert_unchanged(kvh_engine *e, const observed *before)
{
    observed now = observe(e);
    assert_memory_equal(&now.stats, &before->stats, sizeof(now.stats));
    assert_memory_equal(&now.tier, &before->tier, sizeof(now.tier));
    assert_memory_equal(&now.adm, &before->adm, sizeof(now.adm));
}

static kvh_engine *small_engine(uint64_t dev, uint64_t host)
{
    return tu_open(L, H, D, BT, KVH_DTYPE_F32, dev, host, 0);
}

static kvh_admission_params pools(uint64_t short_max, uint64_t short_bytes, uint64_t long_bytes)
{
    kvh_admission_params p;
    assert_ok(kvh_admission_params_init(&p, sizeof(p)));
    p.short_max_tokens = short_max;
    p.short_device_bytes = short_bytes;
    p.long_device_bytes = long_bytes;
    return p;
}

static kvh_status request(kvh_engine *e, uint64_t budget, kvh_seq *out)
{
    kvh_seq_params p;
    assert_ok(kvh_seq_params_init(&p, sizeof(p)));
    p.token_budget = budget;
    return kvh_seq_create_ex(e, &p, out);
}

static uint64_t blocks_of(uint64_t tokens) { return (tokens + BT - 1) / BT; }

/* ---- kvh_admission_params_init ---- */

static void test_admission_params_init_sizes(void **state)
{
    (void)state;
    union {
        kvh_admission_params p;
        uint8_t raw[sizeof(kvh_admission_params) + 16];
    } u;
    assert_fails(KVH_ERR_INVALID_ARG, kvh_admission_params_init(NULL, sizeof(u.p)));
    /* Sizes this library does not know: nothing written. */
    const size_t bad[] = {0, 1, 4, 7, 9, 12, 20, 31, 33, 36, sizeof(u.p) + 8, 64, SIZE_MAX, (size_t)UINT32_MAX + 32};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        memset(&u, JUNK, sizeof(u));
        assert_fails(KVH_ERR_STRUCT_SIZE, kvh_admission_params_init(&u.p, bad[i]));
        for (size_t j = 0; j < sizeof(u); j++)
            if (u.raw[j] != JUNK)
                fail_msg("size %zu: byte %zu written", bad[i], j);
    }
    /* An older caller's size: its fields get their defaults, nothing past
     * them is written. */
    for (size_t n = 8; n <= sizeof(u.p); n += 8) {
        memset(&u, JUNK, sizeof(u));
        assert_ok(kvh_admission_params_init(&u.p, n));
        assert_int_equal(u.p.struct_size, n);
        if (n >= offsetof(kvh_admission_params, short_max_tokens) + 8)
            assert_int_equal(u.p.short_max_tokens, 4096);
        if (n >= offsetof(kvh_admission_params, short_device_bytes) + 8)
            assert_int_equal(u.p.short_device_bytes, 0);
        if (n >= offsetof(kvh_admission_params, long_device_bytes) + 8)
            assert_int_equal(u.p.long_device_bytes, 0);
        for (size_t j = n; j < sizeof(u); j++)
            if (u.raw[j] != JUNK)
                fail_msg("size %zu: byte %zu past it written", n, j);
    }
}

/* ---- kvh_admission_configure ---- */

/* 16 device blocks; pools of 4 (requests up to 32 tokens) and 8 blocks,
 * one short request of 2 blocks admitted. */
static kvh_engine *configured(uint64_t *bb_out, kvh_seq *admitted)
{
    kvh_engine *e = small_engine(16, 16);
    uint64_t bb = tu_block_bytes(e);
    kvh_admission_params p = pools(32, 4 * bb, 8 * bb);
    assert_ok(kvh_admission_configure(e, &p));
    assert_ok(request(e, 2 * BT, admitted));
    *bb_out = bb;
    return e;
}

static void test_configure_refuses_bad_params(void **state)
{
    (void)state;
    uint64_t bb;
    kvh_seq s;
    kvh_engine *e = configured(&bb, &s);
    observed before = observe(e);
    assert_int_equal(before.adm.enabled, 1);
    assert_int_equal(before.adm.short_quota_blocks, 4);
    assert_int_equal(before.adm.short_reserved_blocks, 2);

    kvh_admission_params p = pools(64, 2 * bb, 2 * bb);
    assert_fails(KVH_ERR_INVALID_ARG, kvh_admission_configure(NULL, &p));
    assert_fails(KVH_ERR_INVALID_ARG, kvh_admission_configure(e, NULL));
    assert_unchanged(e, &before);

    /* Wrong sizes, with valid-looking pools past them and garbage after. */
    union {
        kvh_admission_params p;
        uint8_t raw[sizeof(kvh_admission_params) + 16];
    } u;
    const uint32_t bad[] = {0, 4, 7, 12, 20, 33, 36, (uint32_t)sizeof(u.p) + 8, (uint32_t)sizeof(u.p) + 16, UINT32_MAX};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        memset(&u, 0x01, sizeof(u));
        u.p = p;
        u.p.struct_size = bad[i];
        assert_fails(KVH_ERR_STRUCT_SIZE, kvh_admission_configure(e, &u.p));
        assert_unchanged(e, &before);
    }

    /* Quotas that exceed the device tier by a block or more (quotas are
     * whole blocks, rounded down), alone, together, or only when their sum
     * wraps around 2^64. */
    const uint64_t dev = 16 * bb;
    const struct {
        uint64_t s, l;
    } over[] = {
        {dev + bb, 0},
        {0, dev + bb},
        {9 * bb, 8 * bb},
        {dev, bb},
        {dev + bb - 1, bb},
        {UINT64_MAX, 0},
        {0, UINT64_MAX},
        {UINT64_MAX, 1},
        {1, UINT64_MAX},
        {UINT64_MAX, UINT64_MAX},
        {1ull << 63, 1ull << 63},            /* sum wraps to 0 */
        {UINT64_MAX - bb + 1, 2 * bb},       /* sum wraps to bb */
        {(1ull << 63) + 4 * bb, 1ull << 63}, /* sum wraps to 4 blocks */
    };
    for (size_t i = 0; i < sizeof(over) / sizeof(over[0]); i++) {
        kvh_admission_params q = pools(64, over[i].s, over[i].l);
        if (kvh_admission_configure(e, &q) != KVH_ERR_INVALID_ARG)
            fail_msg("quotas %" PRIu64 " + %" PRIu64 " over a %" PRIu64 "-byte device tier: not refused", over[i].s,
                     over[i].l, dev);
        assert_true(kvh_last_error()[0] != '\0');
        assert_unchanged(e, &before);
    }

    /* The pools still work as configured: 2 more short blocks fit, 3 not. */
    kvh_seq t, r = {0};
    assert_kvh(KVH_ERR_NOSPACE, request(e, 3 * BT, &r));
    assert_int_equal(r.id, 0);
    assert_ok(request(e, 2 * BT, &t));
    assert_int_equal(ainfo(e).short_reserved_blocks, 4);
}

/* Quotas that fill the device tier exactly are allowed; sizes are rounded
 * down to whole blocks. */
static void test_configure_boundaries(void **state)
{
    (void)state;
    kvh_engine *e = small_engine(16, 16);
    uint64_t bb = tu_block_bytes(e);
    kvh_admission_params p = pools(32, 8 * bb, 8 * bb);
    assert_ok(kvh_admission_configure(e, &p));
    kvh_admission_info ai = ainfo(e);
    assert_int_equal(ai.enabled, 1);
    assert_int_equal(ai.short_max_tokens, 32);
    assert_int_equal(ai.short_quota_blocks, 8);
    assert_int_equal(ai.long_quota_blocks, 8);
    p = pools(32, 16 * bb, 0);
    assert_ok(kvh_admission_configure(e, &p));
    assert_int_equal(ainfo(e).short_quota_blocks, 16);
    assert_int_equal(ainfo(e).long_quota_blocks, 0);
    /* The long pool has no room at all: every long request is refused. */
    kvh_seq s = {0};
    assert_kvh(KVH_ERR_NOSPACE, request(e, 33, &s));
    assert_int_equal(s.id, 0);
    p = pools(32, 3 * bb + bb - 1, 5 * bb + 1);
    assert_ok(kvh_admission_configure(e, &p));
    assert_int_equal(ainfo(e).short_quota_blocks, 3);
    assert_int_equal(ainfo(e).long_quota_blocks, 5);
    /* Both 0: no admission control, budgets are not looked at. */
    p = pools(32, 0, 0);
    assert_ok(kvh_admission_configure(e, &p));
    assert_int_equal(ainfo(e).enabled, 0);
    kvh_seq big;
    assert_ok(request(e, UINT64_MAX, &big));
}

/* An older caller's struct: the quotas it does not have are 0, so a size
 * that stops before them turns admission control off, whatever lies in
 * the bytes past it. */
static void test_configure_older_sizes_ignore_the_tail(void **state)
{
    (void)state;
    kvh_engine *e = small_engine(16, 16);
    uint64_t bb = tu_block_bytes(e);
    kvh_admission_params p = pools(32, 4 * bb, 4 * bb);
    assert_ok(kvh_admission_configure(e, &p));
    union {
        kvh_admission_params p;
        uint8_t raw[sizeof(kvh_admission_params)];
    } u;
    memset(&u, 0xff, sizeof(u)); /* a huge short_max and huge quotas if read */
    u.p.struct_size = 16;
    u.p.short_max_tokens = 100;
    assert_ok(kvh_admission_configure(e, &u.p));
    kvh_admission_info ai = ainfo(e);
    assert_int_equal(ai.enabled, 0);
    assert_int_equal(ai.short_max_tokens, 100);
    assert_int_equal(ai.short_quota_blocks, 0);
    assert_int_equal(ai.long_quota_blocks, 0);
    /* 24: the long quota is 0, the short one read. */
    memset(&u, 0xff, sizeof(u));
    u.p.struct_size = 24;
    u.p.short_max_tokens = 8;
    u.p.short_device_bytes = 2 * bb;
    assert_ok(kvh_admission_configure(e, &u.p));
    ai = ainfo(e);
    assert_int_equal(ai.enabled, 1);
    assert_int_equal(ai.short_quota_blocks, 2);
    assert_int_equal(ai.long_quota_blocks, 0);
    kvh_seq s;
    assert_ok(request(e, 8, &s));
    assert_kvh(KVH_ERR_NOSPACE, request(e, 9, &s)); /* long pool: no room */
    /* 8: nothing but the size: the defaults, control off. */
    memset(&u, 0xff, sizeof(u));
    u.p.struct_size = 8;
    assert_ok(kvh_admission_configure(e, &u.p));
    ai = ainfo(e);
    assert_int_equal(ai.enabled, 0);
    assert_int_equal(ai.short_max_tokens, 4096);
}

/* ---- kvh_admission_info_get ---- */

static void test_admission_info_get_sizes(void **state)
{
    (void)state;
    uint64_t bb;
    kvh_seq s;
    kvh_engine *e = configured(&bb, &s);
    kvh_admission_info want = ainfo(e);
    observed before = observe(e);
    union {
        kvh_admission_info i;
        uint8_t raw[sizeof(kvh_admission_info) + 16];
    } u;
    assert_fails(KVH_ERR_INVALID_ARG, kvh_admission_info_get(e, NULL));
    memset(&u, JUNK, sizeof(u));
    u.i.struct_size = sizeof(u.i);
    assert_fails(KVH_ERR_INVALID_ARG, kvh_admission_info_get(NULL, &u.i));
    for (size_t j = 4; j < sizeof(u); j++)
        assert_int_equal(u.raw[j], JUNK);
    const uint32_t bad[] = {0, 1, 4, 12, 44, (uint32_t)sizeof(u.i) + 1, (uint32_t)sizeof(u.i) + 8, 4096, UINT32_MAX};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        memset(&u, JUNK, sizeof(u));
        u.i.struct_size = bad[i];
        assert_fails(KVH_ERR_STRUCT_SIZE, kvh_admission_info_get(e, &u.i));
        assert_int_equal(u.i.struct_size, bad[i]);
        for (size_t j = 4; j < sizeof(u); j++)
            if (u.raw[j] != JUNK)
                fail_msg("size %u: byte %zu written", bad[i], j);
    }
    /* Older sizes: filled up to the size, the same values, nothing past. */
    for (uint32_t n = 8; n <= sizeof(u.i); n += 8) {
        memset(&u, JUNK, sizeof(u));
        u.i.struct_size = n;
        assert_ok(kvh_admission_info_get(e, &u.i));
        assert_int_equal(u.i.struct_size, n);
        assert_memory_equal(u.raw + 4, (const uint8_t *)&want + 4, n - 4);
        for (size_t j = n; j < sizeof(u); j++)
            if (u.raw[j] != JUNK)
                fail_msg("size %u: byte %zu past it written", n, j);
    }
    assert_unchanged(e, &before);
}

/* ---- admission at the pool boundaries ---- */

/* 16 device blocks: 4 for requests of up to 32 tokens, 12 for longer. */
static kvh_engine *open_pools(uint64_t *bb_out)
{
    kvh_engine *e = small_engine(16, 16);
    uint64_t bb = tu_block_bytes(e);
    kvh_admission_params p = pools(32, 4 * bb, 12 * bb);
    assert_ok(kvh_admission_configure(e, &p));
    if (bb_out)
        *bb_out = bb;
    return e;
}

static void test_budgets_at_the_boundaries(void **state)
{
    (void)state;
    kvh_engine *e = open_pools(NULL);
    kvh_seq s[4];
    kvh_seq r = {0xdeadull};
    /* 32 tokens is short (8 blocks > 4), 49 long (13 blocks > 12). */
    assert_kvh(KVH_ERR_NOSPACE, request(e, 32, &r));
    assert_kvh(KVH_ERR_NOSPACE, request(e, 49, &r));
    assert_int_equal(r.id, 0xdeadull);
    kvh_admission_info ai = ainfo(e);
    assert_int_equal(ai.short_rejected, 1);
    assert_int_equal(ai.long_rejected, 1);
    assert_int_equal(ai.short_reserved_blocks + ai.long_reserved_blocks, 0);
    /* Budgets fill whole blocks: 13 tokens reserve 4, and the short pool
     * is then full even for one token. */
    assert_ok(request(e, 13, &s[0]));
    assert_int_equal(ainfo(e).short_reserved_blocks, blocks_of(13));
    assert_kvh(KVH_ERR_NOSPACE, request(e, 1, &r));
    /* The long pool to its last block. */
    assert_ok(request(e, 48, &s[1]));
    assert_int_equal(ainfo(e).long_reserved_blocks, 12);
    assert_kvh(KVH_ERR_NOSPACE, request(e, 33, &r));
    assert_int_equal(r.id, 0xdeadull);
    ai = ainfo(e);
    assert_int_equal(ai.short_admitted, 1);
    assert_int_equal(ai.long_admitted, 1);
    assert_int_equal(ai.short_rejected, 2);
    assert_int_equal(ai.long_rejected, 2);
}

/* short_max_tokens 0 sends every budget to the long pool; UINT64_MAX
 * sends every budget to the short one, where huge ones are refused. */
static void test_short_max_extremes(void **state)
{
    (void)state;
    kvh_engine *e = small_engine(16, 16);
    uint64_t bb = tu_block_bytes(e);
    kvh_admission_params p = pools(0, 4 * bb, 8 * bb);
    assert_ok(kvh_admission_configure(e, &p));
    kvh_seq s;
    assert_ok(request(e, 1, &s));
    kvh_admission_info ai = ainfo(e);
    assert_int_equal(ai.long_admitted, 1);
    assert_int_equal(ai.short_admitted, 0);
    assert_int_equal(ai.long_reserved_blocks, 1);
    assert_ok(kvh_seq_free(e, s));
    assert_int_equal(ainfo(e).long_reserved_blocks, 0);
    p = pools(UINT64_MAX, 4 * bb, 8 * bb);
    assert_ok(kvh_admission_configure(e, &p));
    assert_ok(request(e, 16, &s));
    ai = ainfo(e);
    assert_int_equal(ai.short_admitted, 1);
    assert_int_equal(ai.short_reserved_blocks, 4);
    assert_int_equal(ai.long_reserved_blocks, 0);
    assert_ok(kvh_seq_free(e, s));
    for (uint64_t less = 0; less <= BT; less++) {
        kvh_seq r = {0};
        assert_kvh(KVH_ERR_NOSPACE, request(e, UINT64_MAX - less, &r));
        assert_int_equal(r.id, 0);
    }
    ai = ainfo(e);
    assert_int_equal(ai.short_reserved_blocks, 0);
    assert_int_equal(ai.short_rejected, BT + 1);
    assert_int_equal(ai.long_rejected, 0);
}

/* Reservations follow the sequences: a double free or a forged handle
 * releases nothing; a reconfiguration keeps what was admitted; switching
 * control off and on leaves no reservation of a freed sequence. */
static void test_reservations_survive_misuse(void **state)
{
    (void)state;
    uint64_t bb;
    kvh_engine *e = open_pools(&bb);
    kvh_seq a, b, c, d, r;
    assert_ok(request(e, 8, &a));  /* 2 short blocks */
    assert_ok(request(e, 4, &b));  /* 1 short block */
    assert_ok(request(e, 40, &c)); /* 10 long blocks */
    kvh_admission_info ai = ainfo(e);
    assert_int_equal(ai.short_reserved_blocks, 3);
    assert_int_equal(ai.long_reserved_blocks, 10);

    assert_ok(kvh_seq_free(e, a));
    assert_int_equal(ainfo(e).short_reserved_blocks, 1);
    int32_t t[BT];
    tu_iota(t, BT, 1);
    assert_ok(kvh_seq_append(e, b, t, BT));
    kvh_seq block_as_seq = {tu_seq_block(e, b, 0).id};
    observed before = observe(e);
    assert_fails(KVH_ERR_BAD_HANDLE, kvh_seq_free(e, a));
    kvh_seq forged = {a.id ^ 0x5a5a000000000000ull};
    assert_fails(KVH_ERR_BAD_HANDLE, kvh_seq_free(e, forged));
    assert_fails(KVH_ERR_BAD_HANDLE, kvh_seq_free(e, block_as_seq));
    assert_unchanged(e, &before);

    /* Smaller pools: what was admitted stays reserved (the long pool is
     * now over its quota), new requests see the new quotas. */
    kvh_admission_params p = pools(32, 2 * bb, 4 * bb);
    assert_ok(kvh_admission_configure(e, &p));
    ai = ainfo(e);
    assert_int_equal(ai.short_quota_blocks, 2);
    assert_int_equal(ai.long_quota_blocks, 4);
    assert_int_equal(ai.short_reserved_blocks, 1);
    assert_int_equal(ai.long_reserved_blocks, 10);
    assert_kvh(KVH_ERR_NOSPACE, request(e, 33, &r));
    assert_ok(request(e, 4, &d));
    assert_kvh(KVH_ERR_NOSPACE, request(e, 1, &r));
    assert_ok(kvh_seq_free(e, c));
    assert_int_equal(ainfo(e).long_reserved_blocks, 0);

    /* Off, a reserved sequence freed, on again: nothing left of it, and no
     * count wrapped below zero. */
    p = pools(32, 0, 0);
    assert_ok(kvh_admission_configure(e, &p));
    assert_ok(kvh_seq_free(e, b));
    p = pools(32, 4 * bb, 12 * bb);
    assert_ok(kvh_admission_configure(e, &p));
    ai = ainfo(e);
    assert_true(ai.short_reserved_blocks <= 1); /* d, if switching off kept it */
    assert_int_equal(ai.long_reserved_blocks, 0);
    uint64_t short_free = 4 - ai.short_reserved_blocks;
    kvh_seq x, y;
    assert_ok(request(e, short_free * BT, &x));
    assert_ok(request(e, 48, &y));
    assert_ok(kvh_seq_free(e, d));
    assert_ok(kvh_seq_free(e, x));
    assert_ok(kvh_seq_free(e, y));
    ai = ainfo(e);
    assert_int_equal(ai.short_reserved_blocks, 0);
    assert_int_equal(ai.long_reserved_blocks, 0);
}

/* A kvh_seq_create_ex that fails for any other reason reserves and counts
 * nothing; a caller of the first kvh_seq_params (no budget field) is not
 * subject to admission whatever lies past its struct. */
static void test_create_ex_failures_take_no_reservation(void **state)
{
    (void)state;
    kvh_engine *e = open_pools(NULL);
    kvh_seq_params sp;
    assert_ok(kvh_seq_params_init(&sp, sizeof(sp)));
    sp.token_budget = 8;
    kvh_seq out = {0xabcdull};
    observed before = observe(e);
    assert_fails(KVH_ERR_INVALID_ARG, kvh_seq_create_ex(NULL, &sp, &out));
    assert_fails(KVH_ERR_INVALID_ARG, kvh_seq_create_ex(e, NULL, &out));
    assert_fails(KVH_ERR_INVALID_ARG, kvh_seq_create_ex(e, &sp, NULL));
    assert_unchanged(e, &before);
    union {
        kvh_seq_params p;
        uint8_t raw[sizeof(kvh_seq_params) + 16];
    } u;
    const uint32_t bad[] = {0, 4, 12, 20, (uint32_t)sizeof(sp) + 8, UINT32_MAX};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        memset(&u, 0x01, sizeof(u));
        u.p = sp;
        u.p.struct_size = bad[i];
        assert_fails(KVH_ERR_STRUCT_SIZE, kvh_seq_create_ex(e, &u.p, &out));
        assert_unchanged(e, &before);
    }
    /* Contexts: forged, and destroyed. */
    sp.context.id = 0x00c0ffee00000001ull;
    assert_fails(KVH_ERR_BAD_HANDLE, kvh_seq_create_ex(e, &sp, &out));
    assert_unchanged(e, &before);
    kvh_context ctx;
    assert_ok(kvh_context_create(e, NULL, &ctx));
    assert_ok(kvh_context_destroy(e, ctx));
    sp.context = ctx;
    assert_fails(KVH_ERR_BAD_HANDLE, kvh_seq_create_ex(e, &sp, &out));
    assert_unchanged(e, &before);
    /* A budget the pool cannot hold with a dead context: no count may
     * remain of either. */
    sp.token_budget = 1000;
    kvh_status st = kvh_seq_create_ex(e, &sp, &out);
    assert_true(st == KVH_ERR_BAD_HANDLE || st == KVH_ERR_NOSPACE);
    kvh_admission_info ai = ainfo(e);
    assert_int_equal(ai.short_reserved_blocks + ai.long_reserved_blocks, 0);
    assert_int_equal(ai.short_admitted + ai.long_admitted, 0);
    assert_int_equal(out.id, 0xabcdull);

    /* First-version params: struct_size and agent only. */
    memset(&u, 0xff, sizeof(u));
    u.p.struct_size = 8;
    u.p.agent = 7;
    before = observe(e);
    kvh_seq s;
    assert_ok(kvh_seq_create_ex(e, &u.p, &s));
    ai = ainfo(e);
    assert_int_equal(ai.short_admitted + ai.long_admitted, before.adm.short_admitted + before.adm.long_admitted);
    assert_int_equal(ai.short_rejected + ai.long_rejected, before.adm.short_rejected + before.adm.long_rejected);
    int32_t t[BT];
    tu_iota(t, BT, 1);
    assert_ok(kvh_seq_append(e, s, t, BT));
    assert_int_equal(tu_seq_binfo(e, s, 0).agent, 7);
}

/* ---- kvh_agent_set_quota ---- */

static uint64_t device_blocks_of(kvh_engine *e, kvh_seq s, uint32_t agent)
{
    uint64_t n = blocks_of(tu_seq_len(e, s)), on = 0;
    for (uint64_t i = 0; i < n; i++) {
        kvh_block_info bi = tu_seq_binfo(e, s, i);
        assert_int_equal(bi.agent, agent);
        on += bi.tier == KVH_TIER_DEVICE;
    }
    return on;
}

static kvh_seq grow(kvh_engine *e, kvh_seq s, uint64_t tag, uint64_t blocks)
{
    uint64_t at = tu_seq_len(e, s);
    int32_t t[64 * BT];
    assert_true(blocks * BT <= 64 * BT);
    tu_iota(t, blocks * BT, (int32_t)(tag * 100000 + at));
    assert_ok(kvh_seq_append(e, s, t, blocks * BT));
    tu_write_pattern(e, s, L, TOKB, tag, at, blocks * BT);
    return s;
}

static void test_agent_quota_arguments(void **state)
{
    (void)state;
    kvh_engine *e = small_engine(8, 8);
    kvh_seq s = grow(e, tu_seq_new(e, 1), 1, 2);
    observed before = observe(e);
    assert_fails(KVH_ERR_INVALID_ARG, kvh_agent_set_quota(NULL, 1, 1024));
    assert_unchanged(e, &before);
    /* Every agent id and byte count is a quota; setting one moves nothing
     * by itself. */
    assert_ok(kvh_agent_set_quota(e, UINT32_MAX, UINT64_MAX));
    assert_ok(kvh_agent_set_quota(e, 0, UINT64_MAX - 1));
    assert_ok(kvh_agent_set_quota(e, 77, 1));
    assert_ok(kvh_agent_set_quota(e, 77, 0));
    assert_ok(kvh_agent_set_quota(e, 2, UINT64_MAX));
    assert_unchanged(e, &before);
    assert_true(tu_check_pattern(e, s, L, TOKB, 1, 0, 2 * BT));
}

/* A quota bounds the agent's device blocks; other agents keep the rest of
 * the tier; 0 (unlimited) lifts the bound; the data stays right wherever
 * the quota sends it. */
static void test_agent_quota_limits_device_blocks(void **state)
{
    (void)state;
    kvh_engine *e = small_engine(8, 32);
    uint64_t bb = tu_block_bytes(e);
    assert_ok(kvh_agent_set_quota(e, 1, 3 * bb));
    kvh_seq a = grow(e, tu_seq_new(e, 1), 11, 6);
    uint64_t on = device_blocks_of(e, a, 1);
    if (on > 3)
        fail_msg("agent 1 holds %" PRIu64 " device blocks over a quota of 3", on);
    assert_true(on >= 1);
    kvh_seq b = grow(e, tu_seq_new(e, 2), 12, 8 - on);
    assert_int_equal(device_blocks_of(e, b, 2), 8 - on);
    assert_true(tu_tier(e, KVH_TIER_DEVICE).used_blocks <= 8);
    /* More allocations keep agent 1 within its quota. */
    grow(e, a, 11, 4);
    assert_true(device_blocks_of(e, a, 1) <= 3);
    assert_true(tu_check_pattern(e, a, L, TOKB, 11, 0, 10 * BT));
    assert_true(tu_check_pattern(e, b, L, TOKB, 12, 0, tu_seq_len(e, b)));

    /* Unlimited again: free device room goes to agent 1 too. */
    assert_ok(kvh_seq_free(e, b));
    assert_ok(kvh_agent_set_quota(e, 1, 0));
    kvh_seq c = grow(e, tu_seq_new(e, 1), 13, 6);
    assert_true(device_blocks_of(e, a, 1) + device_blocks_of(e, c, 1) > 3);
    assert_true(tu_check_pattern(e, c, L, TOKB, 13, 0, 6 * BT));
}

/* A quota lowered below what the agent holds: as the agent goes on
 * allocating, it evicts its own blocks until it is back within the quota
 * ("an agent over its quota evicts its own blocks first"), instead of
 * trading one of its blocks for each new one and staying over for good. */
static void test_agent_quota_lowered_is_reached(void **state)
{
    (void)state;
    kvh_engine *e = small_engine(8, 32);
    uint64_t bb = tu_block_bytes(e);
    assert_ok(kvh_agent_set_quota(e, 1, 4 * bb));
    kvh_seq a = grow(e, tu_seq_new(e, 1), 11, 4);
    assert_int_equal(device_blocks_of(e, a, 1), 4);
    /* 2.5 blocks: 2 whole blocks. */
    assert_ok(kvh_agent_set_quota(e, 1, 2 * bb + bb / 2));
    grow(e, a, 11, 6);
    uint64_t on = device_blocks_of(e, a, 1);
    assert_true(tu_check_pattern(e, a, L, TOKB, 11, 0, 10 * BT));
    if (on > 2)
        fail_msg("agent 1 holds %" PRIu64 " device blocks, 6 allocations after its quota became 2 blocks", on);
}

/* A quota below one block keeps the agent out of the device tier, not
 * unlimited; blocks from kvh_block_alloc are charged too. */
static void test_agent_quota_below_one_block(void **state)
{
    (void)state;
    kvh_engine *e = small_engine(8, 32);
    uint64_t bb = tu_block_bytes(e);
    assert_ok(kvh_agent_set_quota(e, 5, 1));
    kvh_seq a = grow(e, tu_seq_new(e, 5), 21, 4);
    uint64_t on = device_blocks_of(e, a, 5);
    if (on > 1)
        fail_msg("agent 5 with a 1-byte quota holds %" PRIu64 " device blocks", on);
    assert_true(tu_check_pattern(e, a, L, TOKB, 21, 0, 4 * BT));

    assert_ok(kvh_agent_set_quota(e, 6, bb));
    kvh_block blk[4];
    for (int i = 0; i < 4; i++)
        assert_ok(kvh_block_alloc(e, 6, &blk[i]));
    uint64_t dev = 0;
    for (int i = 0; i < 4; i++) {
        kvh_block_info bi = tu_binfo(e, blk[i]);
        assert_int_equal(bi.agent, 6);
        dev += bi.tier == KVH_TIER_DEVICE;
    }
    if (dev > 1)
        fail_msg("agent 6 with a one-block quota holds %" PRIu64 " standalone device blocks", dev);
    for (int i = 0; i < 4; i++)
        assert_ok(kvh_block_release(e, blk[i]));
}

/* A fork's copies are the child's agent's, and count against its quota,
 * not the parent's. */
static void test_agent_quota_and_fork(void **state)
{
    (void)state;
    kvh_engine *e = small_engine(8, 32);
    uint64_t bb = tu_block_bytes(e);
    kvh_seq p = grow(e, tu_seq_new(e, 1), 31, 3);
    assert_ok(kvh_agent_set_quota(e, 3, bb));
    kvh_seq child;
    assert_ok(kvh_seq_fork(e, p, 3, &child));
    /* Writing every block of the child copies it. */
    tu_write_pattern(e, child, L, TOKB, 32, 0, 3 * BT);
    uint64_t on = 0;
    for (uint64_t i = 0; i < 3; i++) {
        kvh_block_info bi = tu_seq_binfo(e, child, i);
        assert_int_equal(bi.agent, 3);
        on += bi.tier == KVH_TIER_DEVICE;
        assert_true(tu_seq_block(e, child, i).id != tu_seq_block(e, p, i).id);
    }
    if (on > 1)
        fail_msg("agent 3 with a one-block quota holds %" PRIu64 " copied device blocks", on);
    assert_true(tu_check_pattern(e, p, L, TOKB, 31, 0, 3 * BT));
    assert_true(tu_check_pattern(e, child, L, TOKB, 32, 0, 3 * BT));
}

/* ---- kvh_latency_histogram_get ---- */

static const dt_geo G = {L, H, D, BT, KVH_DTYPE_F32};

static kvh_latency_histogram hist(kvh_engine *e, uint32_t kind)
{
    kvh_latency_histogram h;
    memset(&h, 0, sizeof(h));
    h.struct_size = sizeof(h);
    assert_ok(kvh_latency_histogram_get(e, (kvh_latency_kind)kind, &h));
    assert_int_equal(h.kind, kind);
    uint64_t sum = 0;
    for (uint32_t i = 0; i < KVH_LATENCY_BUCKETS; i++)
        sum += h.counts[i];
    assert_int_equal(sum, h.count);
    return h;
}

static void test_latency_histogram_arguments(void **state)
{
    (void)state;
    kvh_engine *e = small_engine(8, 8);
    grow(e, tu_seq_new(e, 0), 41, 2);
    observed before = observe(e);
    union {
        kvh_latency_histogram h;
        uint8_t raw[sizeof(kvh_latency_histogram) + 16];
    } u;
    memset(&u, JUNK, sizeof(u));
    u.h.struct_size = sizeof(u.h);
    assert_fails(KVH_ERR_INVALID_ARG, kvh_latency_histogram_get(NULL, KVH_LATENCY_DISK_READ, &u.h));
    assert_fails(KVH_ERR_INVALID_ARG, kvh_latency_histogram_get(e, KVH_LATENCY_DISK_READ, NULL));
    const int64_t kinds[] = {KVH_LATENCY_KIND_COUNT, KVH_LATENCY_KIND_COUNT + 1, -1, INT32_MIN, INT32_MAX, 255};
    for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++) {
        assert_fails(KVH_ERR_INVALID_ARG, kvh_latency_histogram_get(e, (kvh_latency_kind)kinds[i], &u.h));
        assert_int_equal(u.h.struct_size, sizeof(u.h));
        for (size_t j = 4; j < sizeof(u); j++)
            if (u.raw[j] != JUNK)
                fail_msg("kind %" PRId64 ": byte %zu written", kinds[i], j);
    }
    const uint32_t bad[] = {
        0,        1,         4, 12, 36, (uint32_t)sizeof(u.h) - 4, (uint32_t)sizeof(u.h) + 4, (uint32_t)sizeof(u.h) + 8,
        1u << 20, UINT32_MAX};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        memset(&u, JUNK, sizeof(u));
        u.h.struct_size = bad[i];
        assert_fails(KVH_ERR_STRUCT_SIZE, kvh_latency_histogram_get(e, KVH_LATENCY_ACQUIRE_STALL, &u.h));
        for (size_t j = 4; j < sizeof(u); j++)
            if (u.raw[j] != JUNK)
                fail_msg("size %u: byte %zu written", bad[i], j);
    }
    /* Older sizes: the same values up to the size, nothing past it. */
    kvh_latency_histogram full = hist(e, KVH_LATENCY_DISK_WRITE);
    for (uint32_t n = 8; n <= sizeof(u.h); n += 8) {
        memset(&u, JUNK, sizeof(u));
        u.h.struct_size = n;
        assert_ok(kvh_latency_histogram_get(e, KVH_LATENCY_DISK_WRITE, &u.h));
        assert_int_equal(u.h.struct_size, n);
        assert_memory_equal(u.raw + 4, (const uint8_t *)&full + 4, n - 4);
        for (size_t j = n; j < sizeof(u); j++)
            if (u.raw[j] != JUNK)
                fail_msg("size %u: byte %zu past it written", n, j);
    }
    assert_unchanged(e, &before);
}

static uint64_t hcount(kvh_engine *e, uint32_t kind) { return hist(e, kind).count; }

/* Calls that fail before doing anything add no sample; each block written
 * to or read from disk adds one; an acquire that waits adds one, one that
 * finds its blocks resident none; another engine's histograms stay empty. */
static void test_latency_counts_what_was_done(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("admission_hostile_latency", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 4, 4, 32, 1);
    kvh_engine *e = dt_open_a(&c);
    kvh_engine *other = small_engine(8, 8);
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, dt_plain(5), 4 * BT, 0, &s));
    for (uint32_t k = 0; k < KVH_LATENCY_KIND_COUNT; k++)
        assert_int_equal(hcount(e, k), 0);

    /* Refused calls. */
    kvh_seq stale;
    assert_ok(kvh_seq_create(e, 0, &stale));
    assert_ok(kvh_seq_free(e, stale));
    kvh_block forged = {0x0123456789abcdefull};
    assert_fails(KVH_ERR_BAD_HANDLE, kvh_seq_acquire(e, stale, 0, BT, NULL));
    assert_fails(KVH_ERR_RANGE, kvh_seq_acquire(e, s, 0, 5 * BT, NULL));
    assert_fails(KVH_ERR_RANGE, kvh_seq_acquire(e, s, UINT64_MAX, 2, NULL));
    assert_fails(KVH_ERR_BAD_HANDLE, kvh_migrate(e, &forged, 1, KVH_TIER_DISK, NULL));
    assert_fails(KVH_ERR_INVALID_ARG, kvh_seq_migrate(e, s, 0, BT, 3, NULL));
    assert_fails(KVH_ERR_RANGE, kvh_seq_migrate(e, s, 0, UINT64_MAX, KVH_TIER_DISK, NULL));
    for (uint32_t k = 0; k < KVH_LATENCY_KIND_COUNT; k++)
        assert_int_equal(hcount(e, k), 0);

    /* Down to disk: one write sample per block written there. */
    kvh_stats s0 = tu_stats(e);
    assert_ok(kvh_seq_migrate(e, s, 0, 4 * BT, KVH_TIER_DISK, NULL));
    kvh_stats s1 = tu_stats(e);
    uint64_t written =
        (s1.blocks_host_to_disk - s0.blocks_host_to_disk) + (s1.disk_copies_written - s0.disk_copies_written);
    assert_true(s1.blocks_host_to_disk - s0.blocks_host_to_disk >= 4);
    assert_int_equal(hcount(e, KVH_LATENCY_DISK_WRITE), written);
    assert_true(hist(e, KVH_LATENCY_DISK_WRITE).sum_ns > 0);
    assert_int_equal(hcount(e, KVH_LATENCY_DISK_READ), 0);
    for (uint64_t i = 0; i < 4; i++)
        assert_int_equal(tu_seq_binfo(e, s, i).tier, KVH_TIER_DISK);

    /* Back up by a waiting acquire: a read per block, one stall. */
    assert_ok(kvh_seq_acquire(e, s, 0, 4 * BT, NULL));
    kvh_stats s2 = tu_stats(e);
    assert_int_equal(hcount(e, KVH_LATENCY_DISK_READ), s2.blocks_disk_to_host - s1.blocks_disk_to_host);
    assert_int_equal(hcount(e, KVH_LATENCY_DISK_READ), 4);
    assert_int_equal(hcount(e, KVH_LATENCY_ACQUIRE_STALL), 1);
    assert_int_equal(hist(e, KVH_LATENCY_ACQUIRE_STALL).sum_ns, s2.acquire_stall_ns - s1.acquire_stall_ns);
    /* Resident now: no stall, no read. */
    assert_ok(kvh_seq_acquire(e, s, 0, 4 * BT, NULL));
    assert_int_equal(hcount(e, KVH_LATENCY_ACQUIRE_STALL), 1);
    assert_int_equal(hcount(e, KVH_LATENCY_DISK_READ), 4);
    assert_ok(kvh_seq_release(e, s, 0, 4 * BT));
    assert_ok(kvh_seq_release(e, s, 0, 4 * BT));
    char msg[256] = "";
    if (dt_verify(e, s, G, dt_plain(5), 0, 4 * BT, msg, sizeof(msg)) != KVH_OK)
        fail_msg("data after the round trip: %s", msg);
    for (uint32_t k = 0; k < KVH_LATENCY_KIND_COUNT; k++)
        assert_int_equal(hcount(other, k), 0);
}

static int teardown(void **state)
{
    dt_teardown(state);
    return tu_teardown(state);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_admission_params_init_sizes, teardown),
        cmocka_unit_test_teardown(test_configure_refuses_bad_params, teardown),
        cmocka_unit_test_teardown(test_configure_boundaries, teardown),
        cmocka_unit_test_teardown(test_configure_older_sizes_ignore_the_tail, teardown),
        cmocka_unit_test_teardown(test_admission_info_get_sizes, teardown),
        cmocka_unit_test_teardown(test_budgets_at_the_boundaries, teardown),
        cmocka_unit_test_teardown(test_short_max_extremes, teardown),
        cmocka_unit_test_teardown(test_reservations_survive_misuse, teardown),
        cmocka_unit_test_teardown(test_create_ex_failures_take_no_reservation, teardown),
        cmocka_unit_test_teardown(test_agent_quota_arguments, teardown),
        cmocka_unit_test_teardown(test_agent_quota_limits_device_blocks, teardown),
        cmocka_unit_test_teardown(test_agent_quota_lowered_is_reached, teardown),
        cmocka_unit_test_teardown(test_agent_quota_below_one_block, teardown),
        cmocka_unit_test_teardown(test_agent_quota_and_fork, teardown),
        cmocka_unit_test_teardown(test_latency_histogram_arguments, teardown),
        cmocka_unit_test_teardown(test_latency_counts_what_was_done, teardown),
    };
    return cmocka_run_group_tests_name("admission_hostile", tests, NULL, NULL);
}
