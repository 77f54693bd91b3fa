/* Encoded (kv_codec) host and disk tiers against a hostile caller, from
 * kvh.h's promises alone ("Quantised forms of KV", "KV codecs", moves,
 * persist and reopen). The tiers store blocks in the codec's form, so a
 * block read from an encoded tier must equal kvh_codec_encode +
 * kvh_codec_decode of what was written, bit for bit, and lie within the
 * documented bound of it (checked here in double precision). Moving an
 * encoded block between the host and disk tiers, or persisting and
 * reopening it, must not change it; writes into an encoded block touch
 * only their tokens. Bad codec configurations must be refused with a
 * status, never a crash. */
#define _XOPEN_SOURCE 700 /* nftw */
#include <float.h>
#include <ftw.h>
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <unistd.h>

#include "test_util.h"

static const uint32_t codecs[] = {KVH_CODEC_INT8, KVH_CODEC_Q4_G32, KVH_CODEC_Q4_G64};
static const uint32_t dtypes[] = {KVH_DTYPE_F32, KVH_DTYPE_F16, KVH_DTYPE_BF16};

/* ---- f16 / bf16, round to nearest even ---- */

static double f16_to_d(uint16_t h) { return tu_f16_to_f32(h); } /* exact: f16 is a subset of f32 */

static double bf16_to_d(uint16_t b) { return tu_bf16_to_f32(b); }

static size_t dsize(uint32_t dt) { return dt == KVH_DTYPE_F32 ? 4 : 2; }

static void put_elem(uint32_t dt, void *buf, size_t i, float f)
{
    if (dt == KVH_DTYPE_F32)
        memcpy((uint8_t *)buf + i * 4, &f, 4);
    else {
        uint16_t h = dt == KVH_DTYPE_F16 ? tu_f32_to_f16(f) : tu_f32_to_bf16(f);
        memcpy((uint8_t *)buf + i * 2, &h, 2);
    }
}

static double get_elem(uint32_t dt, const void *buf, size_t i)
{
    if (dt == KVH_DTYPE_F32) {
        float f;
        memcpy(&f, (const uint8_t *)buf + i * 4, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, (const uint8_t *)buf + i * 2, 2);
    return dt == KVH_DTYPE_F16 ? f16_to_d(h) : bf16_to_d(h);
}

/* Half an ulp of the engine dtype at y: the rounding the header allows
 * after the bound ("before the decoded value is rounded to the engine
 * dtype"). */
static double half_ulp(uint32_t dt, double y)
{
    double a = fabs(y);
    if (dt == KVH_DTYPE_F16)
        return fmax(a, ldexp(1, -14)) * ldexp(1, -11);
    if (dt == KVH_DTYPE_BF16)
        return fmax(a, ldexp(1, -126)) * ldexp(1, -8);
    return fmax(a, ldexp(1, -126)) * ldexp(1, -24);
}

static double dtype_max(uint32_t dt)
{
    return dt == KVH_DTYPE_F32 ? FLT_MAX : dt == KVH_DTYPE_F16 ? 65504.0 : bf16_to_d(0x7f7f);
}

static double dtype_min_sub(uint32_t dt)
{
    return dt == KVH_DTYPE_F32 ? ldexp(1, -149) : dt == KVH_DTYPE_F16 ? ldexp(1, -24) : ldexp(1, -133);
}

static float gauss(tu_rng *r)
{
    double u1 = ((double)(tu_next(r) >> 11) + 1.0) / 9007199254740993.0;
    double u2 = (double)(tu_next(r) >> 11) / 9007199254740992.0;
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

/* One vector of d elements of a hostile kind, written into buf (dtype dt)
 * at vector index vi. */
static void hostile_vector(tu_rng *r, uint32_t dt, uint32_t d, unsigned kind, void *buf, size_t vi)
{
    double mx = dtype_max(dt), sub = dtype_min_sub(dt);
    for (uint32_t i = 0; i < d; i++) {
        float f;
        switch (kind % 10) {
        case 0: /* ordinary */
            f = gauss(r) * 2.0f;
            break;
        case 1: /* all equal */
            f = -3.25f;
            break;
        case 2: /* all at the dtype's largest finite value */
            f = (float)mx;
            break;
        case 3: /* one huge outlier among ordinary values */
            f = i == (uint32_t)(vi % d) ? (float)mx : gauss(r);
            break;
        case 4: /* non-finite and signed zeros among ordinary values */
            f = i % 7 == 0 ? NAN : i % 7 == 1 ? INFINITY : i % 7 == 2 ? -INFINITY : i % 7 == 3 ? -0.0f : gauss(r);
            break;
        case 5: /* subnormals of the dtype */
            f = (float)(sub * (double)(int)(tu_below(r, 9) - 4));
            break;
        case 6: /* both extremes: max - min overflows the dtype */
            f = (float)(i % 2 ? mx : -mx);
            break;
        case 7: /* zeros of both signs and one infinity: a zero scale */
            f = i == 3 ? INFINITY : i % 2 ? -0.0f : 0.0f;
            break;
        case 8: /* tiny normal values next to a subnormal */
            f = (float)(ldexp(1, dt == KVH_DTYPE_F16 ? -14 : -126) * (1.0 + (double)tu_below(r, 8) / 8.0));
            if (i == 5)
                f = (float)sub;
            break;
        default: /* all NaN: no finite element at all */
            f = NAN;
            break;
        }
        put_elem(dt, buf, vi * d + i, f);
    }
}

/* Elements per quantisation group. */
static uint32_t group_of(uint32_t codec, uint32_t d)
{
    return codec == KVH_CODEC_INT8 ? d : codec == KVH_CODEC_Q4_G32 ? 32 : 64;
}

/* Checks decoded vectors y against the written x (n vectors of d) by the
 * documented rule: finite elements within the bound; +-inf saturated to
 * the extreme code, NaN the zero code (finite either way). */
static void check_bound(uint32_t codec, uint32_t dt, uint32_t d, const void *x, const void *y, size_t n,
                        const char *what)
{
    uint32_t g = group_of(codec, d);
    for (size_t v = 0; v < n; v++)
        for (uint32_t g0 = 0; g0 < d; g0 += g) {
            double amax = 0, lo = INFINITY, hi = -INFINITY;
            for (uint32_t i = g0; i < g0 + g; i++) {
                double xi = get_elem(dt, x, v * d + i);
                if (!isfinite(xi))
                    continue;
                amax = fmax(amax, fabs(xi));
                lo = fmin(lo, xi);
                hi = fmax(hi, xi);
            }
            if (lo > hi)
                lo = hi = 0;
            double b = (codec == KVH_CODEC_INT8 ? amax / 254.0 : (hi - lo) / 30.0) + ldexp(1, -143);
            for (uint32_t i = g0; i < g0 + g; i++) {
                double xi = get_elem(dt, x, v * d + i), yi = get_elem(dt, y, v * d + i);
                /* where each kind of input may land */
                double want = xi;
                if (isnan(xi))
                    want = codec == KVH_CODEC_INT8 ? 0.0 : lo; /* the zero code */
                else if (isinf(xi))
                    want = codec == KVH_CODEC_INT8 ? copysign(amax, xi) : xi > 0 ? hi : lo;
                double lim = b + half_ulp(dt, yi);
                if (!isfinite(yi) || !(fabs(yi - want) <= lim))
                    fail_msg("%s: codec %u dtype %u vector %zu elem %u: wrote %.9g, read %.9g, "
                             "expected %.9g +- %.3g",
                             what, codec, dt, v, i, xi, yi, want, lim);
            }
        }
}

/* What the encoded tiers must hold: the public codec's round trip. */
static void codec_round_trip(uint32_t codec, uint32_t dt, uint32_t d, const void *x, size_t n, void *y)
{
    uint64_t rec = 0;
    assert_ok(kvh_codec_vector_bytes(codec, dt, d, &rec));
    void *enc = tu_alloc(rec * n);
    assert_ok(kvh_codec_encode(codec, dt, d, x, n, enc));
    assert_ok(kvh_codec_decode(codec, dt, d, enc, n, y));
    tu_free(enc);
}

static void assert_same_bytes(const void *a, const void *b, size_t bytes, const char *what)
{
    if (memcmp(a, b, bytes) != 0) {
        size_t i = 0;
        while (((const uint8_t *)a)[i] == ((const uint8_t *)b)[i])
            i++;
        fail_msg("%s: differ at byte %zu of %zu", what, i, bytes);
    }
}

static const char *tmpdir(void)
{
    const char *t = getenv("KVH_TEST_TMPDIR");
    return t && *t ? t : "/tmp";
}

/* Stores made by this run, removed when it ends. */
static char stores[32][512];
static int n_stores;

static void store_path(char *buf, size_t len, const char *name)
{
    snprintf(buf, len, "%s/codec_tier_hostile_%ld_%s", tmpdir(), (long)getpid(), name);
    for (int i = 0; i < n_stores; i++)
        if (!strcmp(stores[i], buf))
            return;
    if (n_stores < 32)
        snprintf(stores[n_stores++], sizeof(stores[0]), "%s", buf);
}

/* c with kv_codec and a disk store of its own named name (emptied when it
 * holds another geometry). */
static kvh_config codec_store_cfg(char *dir, size_t len, const char *name, kvh_config c, uint32_t codec,
                                  uint64_t disk_bytes)
{
    store_path(dir, len, name);
    c.kv_codec = codec;
    c.disk_path = dir;
    c.disk_bytes = disk_bytes;
    c.disk_flags = KVH_DISK_RESET_ON_MISMATCH;
    return c;
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    remove(path);
    return 0;
}

/* Geometry of the engines below unless a test says otherwise. */
enum { L = 2, H = 2, D = 64, BT = 8 };

typedef struct kvbuf {
    uint32_t dt, layers, heads, dim;
    size_t n;       /* tokens */
    uint8_t *k, *v; /* [layer][token][head][dim] */
} kvbuf;

static kvbuf kv_new(uint32_t dt, uint32_t layers, uint32_t heads, uint32_t dim, size_t n)
{
    kvbuf b = {dt, layers, heads, dim, n, NULL, NULL};
    size_t bytes = (size_t)layers * n * heads * dim * dsize(dt);
    b.k = tu_alloc(bytes);
    b.v = tu_alloc(bytes);
    return b;
}

static size_t kv_layer_bytes(const kvbuf *b) { return b->n * b->heads * b->dim * dsize(b->dt); }
static size_t kv_tok_bytes(const kvbuf *b) { return (size_t)b->heads * b->dim * dsize(b->dt); }

static void kv_fill_hostile(tu_rng *r, kvbuf *b)
{
    size_t per = b->n * b->heads;
    for (uint32_t l = 0; l < b->layers; l++)
        for (size_t vi = 0; vi < per; vi++) {
            hostile_vector(r, b->dt, b->dim, (unsigned)(vi + l * 3), b->k + l * kv_layer_bytes(b), vi);
            hostile_vector(r, b->dt, b->dim, (unsigned)(vi + l * 3 + 5), b->v + l * kv_layer_bytes(b), vi);
        }
}

static void kv_write(kvh_engine *e, kvh_seq s, const kvbuf *b, size_t pos, size_t n)
{
    for (uint32_t l = 0; l < b->layers; l++)
        assert_ok(kvh_seq_write_kv(e, s, l, pos, n, b->k + l * kv_layer_bytes(b) + pos * kv_tok_bytes(b),
                                   b->v + l * kv_layer_bytes(b) + pos * kv_tok_bytes(b)));
}

static void kv_read(kvh_engine *e, kvh_seq s, kvbuf *b, size_t pos, size_t n)
{
    for (uint32_t l = 0; l < b->layers; l++)
        assert_ok(kvh_seq_read_kv(e, s, l, pos, n, b->k + l * kv_layer_bytes(b) + pos * kv_tok_bytes(b),
                                  b->v + l * kv_layer_bytes(b) + pos * kv_tok_bytes(b)));
}

static void kv_round_trip(uint32_t codec, const kvbuf *x, kvbuf *y)
{
    size_t per = x->n * x->heads;
    for (uint32_t l = 0; l < x->layers; l++) {
        codec_round_trip(codec, x->dt, x->dim, x->k + l * kv_layer_bytes(x), per, y->k + l * kv_layer_bytes(y));
        codec_round_trip(codec, x->dt, x->dim, x->v + l * kv_layer_bytes(x), per, y->v + l * kv_layer_bytes(y));
    }
}

static void kv_same(const kvbuf *a, const kvbuf *b, const char *what)
{
    assert_same_bytes(a->k, b->k, a->layers * kv_layer_bytes(a), what);
    assert_same_bytes(a->v, b->v, a->layers * kv_layer_bytes(a), what);
}

static void kv_bound(uint32_t codec, const kvbuf *x, const kvbuf *y, const char *what)
{
    for (uint32_t l = 0; l < x->layers; l++) {
        check_bound(codec, x->dt, x->dim, x->k + l * kv_layer_bytes(x), y->k + l * kv_layer_bytes(y), x->n * x->heads,
                    what);
        check_bound(codec, x->dt, x->dim, x->v + l * kv_layer_bytes(x), y->v + l * kv_layer_bytes(y), x->n * x->heads,
                    what);
    }
}

static void assert_tier(kvh_engine *e, kvh_seq s, uint64_t first_block, uint64_t n_blocks, uint32_t tier)
{
    for (uint64_t i = first_block; i < first_block + n_blocks; i++) {
        kvh_block_info bi = tu_seq_binfo(e, s, i);
        if (bi.tier != tier)
            fail_msg("block %" PRIu64 " is in tier %u, expected %u", i, bi.tier, tier);
    }
}

/* ---- special values through every tier ---- */

/* Every hostile kind of vector, every dtype and codec: device (raw, exact)
 * -> host (the codec's round trip, bit for bit, within the bound) -> disk
 * -> device (unchanged: the disk holds the same records). */
static void test_special_values_through_every_tier(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(0xc0dec1)};
    const size_t n = 2 * BT + 3;
    int32_t tokens[2 * BT + 3];
    tu_iota(tokens, n, 1000);
    for (size_t di = 0; di < 3; di++)
        for (size_t ci = 0; ci < 3; ci++) {
            uint32_t dt = dtypes[di], codec = codecs[ci];
            char dir[512];
            kvh_config c =
                codec_store_cfg(dir, sizeof(dir), "special", tu_cfg(L, H, D, BT, dt, 4, 8, 1), codec, 8ull << 20);
            kvh_engine *e = tu_open_cfg(&c);
            kvbuf x = kv_new(dt, L, H, D, n), want = kv_new(dt, L, H, D, n), got = kv_new(dt, L, H, D, n);
            kv_fill_hostile(&r, &x);
            kv_round_trip(codec, &x, &want);
            kv_bound(codec, &x, &want, "public codec");
            kvh_seq s = tu_seq_new(e, 0);
            assert_ok(kvh_seq_append(e, s, tokens, n));
            kv_write(e, s, &x, 0, n);
            kv_read(e, s, &got, 0, n);
            kv_same(&x, &got, "device tier (raw)");

            assert_ok(kvh_seq_migrate(e, s, 0, n, KVH_TIER_HOST, NULL));
            assert_tier(e, s, 0, 3, KVH_TIER_HOST);
            memset(got.k, 0xa5, L * kv_layer_bytes(&got));
            memset(got.v, 0xa5, L * kv_layer_bytes(&got));
            kv_read(e, s, &got, 0, n);
            kv_same(&want, &got, "host tier vs the codec's round trip");
            kv_bound(codec, &x, &got, "host tier");
            assert_int_equal(tu_seq_binfo(e, s, 0).tier, KVH_TIER_HOST); /* reads do not promote */

            assert_ok(kvh_seq_migrate(e, s, 0, n, KVH_TIER_DISK, NULL));
            assert_tier(e, s, 0, 3, KVH_TIER_DISK);
            assert_ok(kvh_seq_migrate(e, s, 0, n, KVH_TIER_DEVICE, NULL));
            assert_tier(e, s, 0, 3, KVH_TIER_DEVICE);
            memset(got.k, 0x5a, L * kv_layer_bytes(&got));
            memset(got.v, 0x5a, L * kv_layer_bytes(&got));
            kv_read(e, s, &got, 0, n);
            kv_same(&want, &got, "host -> disk -> device");
            assert_ok(kvh_seq_free(e, s));
            assert_ok(tu_close(e));
        }
}

/* ---- odd geometries, every block through every tier, many times ---- */

/* block_tokens 1, head_dim 1 and 3 (int8), many layers, a device tier of
 * one block and a host tier of a few: each token's block is pushed to
 * disk and pulled back over and over. Whatever the number of trips, a
 * read stays within the documented bound of what was written (re-encoding
 * a decoded block must not let the error grow past it), and a block's
 * trips host <-> disk alone change nothing. */
static void test_tiny_geometry_round_trips(void **state)
{
    (void)state;
    static const uint32_t dims[] = {1, 3, 32, 300, 320};
    tu_rng r = {tu_seed(0xc0dec2)};
    for (size_t gi = 0; gi < sizeof(dims) / sizeof(dims[0]); gi++)
        for (size_t di = 0; di < 3; di++) {
            uint32_t dim = dims[gi], dt = dtypes[di], layers = 7, heads = 3;
            /* 300 and 320 elements: more than one 256-element slice */
            uint32_t codec = dim == 32 ? KVH_CODEC_Q4_G32 : dim == 320 ? KVH_CODEC_Q4_G64 : KVH_CODEC_INT8;
            const size_t n = 12;
            char dir[512];
            kvh_config c = codec_store_cfg(dir, sizeof(dir), "tiny", tu_cfg(layers, heads, dim, 1, dt, 1, 4, gi % 2),
                                           codec, 4ull << 20);
            c.eviction_policy = KVH_EVICT_LRU_K;
            /* three encoded blocks in the host tier, whatever their size */
            uint64_t rec = 0;
            assert_ok(kvh_codec_vector_bytes(codec, dt, dim, &rec));
            c.host_bytes = 3 * 2ull * layers * heads * rec;
            kvh_engine *e = tu_open_cfg(&c);
            assert_int_equal(tu_tier(e, KVH_TIER_HOST).capacity_blocks, 3);
            kvbuf x = kv_new(dt, layers, heads, dim, n), got = kv_new(dt, layers, heads, dim, n),
                  first = kv_new(dt, layers, heads, dim, n);
            for (uint32_t l = 0; l < layers; l++)
                for (size_t vi = 0; vi < n * heads; vi++) {
                    unsigned kind = (unsigned)(vi + l);
                    hostile_vector(&r, dt, dim, kind, x.k + l * kv_layer_bytes(&x), vi);
                    hostile_vector(&r, dt, dim, kind + 4, x.v + l * kv_layer_bytes(&x), vi);
                }
            kvh_seq s = tu_seq_new(e, 0);
            int32_t tokens[12];
            tu_iota(tokens, n, 5);
            /* appended and written one token at a time: each new block
             * pushes older ones down */
            for (size_t t = 0; t < n; t++) {
                assert_ok(kvh_seq_append(e, s, tokens + t, 1));
                kv_write(e, s, &x, t, 1);
            }
            kvh_stats st = tu_stats(e);
            /* Some went to disk: moved down, or (with a worker) written
             * ahead as clean copies that their eviction then took. */
            assert_true(st.blocks_host_to_disk + st.disk_copies_written > 0);
            /* every block encoded once (the newest was still raw) */
            assert_ok(kvh_seq_migrate(e, s, 0, n, KVH_TIER_DISK, NULL));
            kv_read(e, s, &first, 0, n);
            kv_bound(codec, &x, &first, "first read");
            for (int round = 0; round < 6; round++) {
                for (size_t t = 0; t < n; t++) {
                    uint64_t p = (t * 5 + (size_t)round) % n;
                    assert_ok(kvh_seq_acquire(e, s, p, 1, NULL));
                    assert_int_equal(tu_seq_binfo(e, s, p).tier, KVH_TIER_DEVICE);
                    assert_ok(kvh_seq_release(e, s, p, 1));
                }
                assert_ok(kvh_seq_migrate(e, s, 0, n, KVH_TIER_DISK, NULL));
                kv_read(e, s, &got, 0, n);
                kv_bound(codec, &x, &got, "after round trips");
            }
            /* host <-> disk only: no re-encoding, nothing changes */
            assert_ok(kvh_seq_migrate(e, s, 0, n, KVH_TIER_DISK, NULL));
            kv_read(e, s, &first, 0, n);
            for (int round = 0; round < 3; round++) {
                assert_ok(kvh_seq_migrate(e, s, 0, 2, KVH_TIER_HOST, NULL));
                assert_ok(kvh_seq_migrate(e, s, 0, n, KVH_TIER_DISK, NULL));
                kv_read(e, s, &got, 0, n);
                kv_same(&first, &got, "host <-> disk");
            }
            assert_ok(kvh_seq_free(e, s));
            assert_ok(tu_close(e));
        }
}

/* ---- partial writes into encoded blocks ---- */

/* A block half written in the device tier, demoted, then written in part
 * while it sits encoded in the host tier: the untouched tokens read back
 * exactly as before the write, the touched ones as the codec's round trip
 * of their new values, tokens never written stay KVH_ERR_RANGE. Another
 * demotion to disk and back keeps every token within the bound of its
 * last written value. */
static void test_partial_write_in_encoded_block(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(0xc0dec3)};
    for (size_t ci = 0; ci < 3; ci++)
        for (size_t di = 0; di < 3; di++) {
            uint32_t codec = codecs[ci], dt = dtypes[di];
            char dir[512];
            kvh_config c =
                codec_store_cfg(dir, sizeof(dir), "partial", tu_cfg(L, H, D, BT, dt, 2, 4, 0), codec, 4ull << 20);
            kvh_engine *e = tu_open_cfg(&c);
            kvbuf x = kv_new(dt, L, H, D, BT), y = kv_new(dt, L, H, D, BT), got = kv_new(dt, L, H, D, BT),
                  before = kv_new(dt, L, H, D, BT), want = kv_new(dt, L, H, D, BT);
            kv_fill_hostile(&r, &x);
            kv_fill_hostile(&r, &y);
            int32_t tokens[BT];
            tu_iota(tokens, BT, 40);
            kvh_seq s = tu_seq_new(e, 0);
            assert_ok(kvh_seq_append(e, s, tokens, BT));
            kv_write(e, s, &x, 0, 6); /* tokens 6 and 7 never written */
            assert_ok(kvh_seq_migrate(e, s, 0, BT, KVH_TIER_HOST, NULL));
            assert_tier(e, s, 0, 1, KVH_TIER_HOST);
            kv_read(e, s, &before, 0, 6);
            /* tokens 2..3 rewritten in the host tier */
            kv_write(e, s, &y, 2, 2);
            assert_tier(e, s, 0, 1, KVH_TIER_HOST);
            kv_read(e, s, &got, 0, 6);
            kv_round_trip(codec, &y, &want);
            for (uint32_t l = 0; l < L; l++) {
                size_t lb = kv_layer_bytes(&x), tb = kv_tok_bytes(&x);
                assert_same_bytes(before.k + l * lb, got.k + l * lb, 2 * tb, "untouched K tokens 0..1");
                assert_same_bytes(before.v + l * lb, got.v + l * lb, 2 * tb, "untouched V tokens 0..1");
                assert_same_bytes(before.k + l * lb + 4 * tb, got.k + l * lb + 4 * tb, 2 * tb,
                                  "untouched K tokens 4..5");
                assert_same_bytes(before.v + l * lb + 4 * tb, got.v + l * lb + 4 * tb, 2 * tb,
                                  "untouched V tokens 4..5");
                assert_same_bytes(want.k + l * lb + 2 * tb, got.k + l * lb + 2 * tb, 2 * tb, "rewritten K tokens");
                assert_same_bytes(want.v + l * lb + 2 * tb, got.v + l * lb + 2 * tb, 2 * tb, "rewritten V tokens");
                assert_kvh(KVH_ERR_RANGE, kvh_seq_read_kv(e, s, l, 5, 2, got.k, got.v));
            }
            /* the last written value of every token */
            kvbuf last = kv_new(dt, L, H, D, 6);
            for (uint32_t l = 0; l < L; l++)
                for (size_t t = 0; t < 6; t++) {
                    const kvbuf *src = t >= 2 && t < 4 ? &y : &x;
                    size_t tb = kv_tok_bytes(&x);
                    memcpy(last.k + l * kv_layer_bytes(&last) + t * tb, src->k + l * kv_layer_bytes(src) + t * tb, tb);
                    memcpy(last.v + l * kv_layer_bytes(&last) + t * tb, src->v + l * kv_layer_bytes(src) + t * tb, tb);
                }
            assert_ok(kvh_seq_migrate(e, s, 0, BT, KVH_TIER_DISK, NULL));
            assert_tier(e, s, 0, 1, KVH_TIER_DISK);
            /* a write into the block on disk: tokens 0..5 unchanged */
            kv_write(e, s, &x, 6, 1);
            kvbuf six = kv_new(dt, L, H, D, BT);
            kv_read(e, s, &six, 0, 7);
            for (uint32_t l = 0; l < L; l++) {
                size_t lb = kv_layer_bytes(&x), tb = kv_tok_bytes(&x);
                assert_same_bytes(got.k + l * lb, six.k + l * lb, 6 * tb, "K after a write into the block on disk");
                assert_same_bytes(got.v + l * lb, six.v + l * lb, 6 * tb, "V after a write into the block on disk");
            }
            assert_ok(kvh_seq_migrate(e, s, 0, BT, KVH_TIER_DISK, NULL));
            assert_ok(kvh_seq_migrate(e, s, 0, BT, KVH_TIER_DEVICE, NULL));
            kvbuf got6 = kv_new(dt, L, H, D, 6);
            kv_read(e, s, &got6, 0, 6);
            kv_bound(codec, &last, &got6, "after disk and back");
            /* the rest written in the device tier, then one more demotion */
            kv_write(e, s, &x, 7, 1);
            assert_ok(kvh_seq_migrate(e, s, 0, BT, KVH_TIER_HOST, NULL));
            kv_read(e, s, &got6, 0, 6);
            kv_bound(codec, &last, &got6, "after a second demotion");
            assert_ok(kvh_seq_free(e, s));
            assert_ok(tu_close(e));
        }
}

/* A full, fully written block in the host tier is immutable: a write into
 * it goes to a copy. The copy's other tokens are the block's decoded
 * values, bit for bit, and the original (cached in the prefix index)
 * still reads as before for a sequence that matches it. */
static void test_write_into_sealed_encoded_block(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(0xc0dec4)};
    for (size_t ci = 0; ci < 3; ci++) {
        uint32_t codec = codecs[ci], dt = KVH_DTYPE_BF16;
        kvh_config c = tu_cfg(L, H, D, BT, dt, 2, 6, 0);
        c.kv_codec = codec;
        kvh_engine *e = tu_open_cfg(&c);
        kvbuf x = kv_new(dt, L, H, D, BT), y = kv_new(dt, L, H, D, BT), before = kv_new(dt, L, H, D, BT),
              got = kv_new(dt, L, H, D, BT), want = kv_new(dt, L, H, D, BT);
        kv_fill_hostile(&r, &x);
        kv_fill_hostile(&r, &y);
        int32_t tokens[BT];
        tu_iota(tokens, BT, 77);
        kvh_seq s = tu_seq_new(e, 0);
        assert_ok(kvh_seq_append(e, s, tokens, BT));
        kv_write(e, s, &x, 0, BT);
        assert_ok(kvh_seq_migrate(e, s, 0, BT, KVH_TIER_HOST, NULL));
        assert_tier(e, s, 0, 1, KVH_TIER_HOST);
        kvh_block orig = tu_seq_block(e, s, 0);
        kv_read(e, s, &before, 0, BT);
        kv_write(e, s, &y, 3, 1);
        kvh_block now = tu_seq_block(e, s, 0);
        assert_true(now.id != orig.id);
        kv_read(e, s, &got, 0, BT);
        kvh_block_info bi = tu_seq_binfo(e, s, 0);
        if (bi.tier == KVH_TIER_DEVICE)
            memcpy(&want, &y, sizeof(want)); /* written raw */
        else
            kv_round_trip(codec, &y, &want);
        size_t lb = kv_layer_bytes(&x), tb = kv_tok_bytes(&x);
        for (uint32_t l = 0; l < L; l++) {
            assert_same_bytes(before.k + l * lb, got.k + l * lb, 3 * tb, "copy K tokens 0..2");
            assert_same_bytes(before.v + l * lb, got.v + l * lb, 3 * tb, "copy V tokens 0..2");
            assert_same_bytes(before.k + l * lb + 4 * tb, got.k + l * lb + 4 * tb, 4 * tb, "copy K tokens 4..7");
            assert_same_bytes(before.v + l * lb + 4 * tb, got.v + l * lb + 4 * tb, 4 * tb, "copy V tokens 4..7");
            assert_same_bytes(want.k + l * lb + 3 * tb, got.k + l * lb + 3 * tb, tb, "copy K token 3");
            assert_same_bytes(want.v + l * lb + 3 * tb, got.v + l * lb + 3 * tb, tb, "copy V token 3");
        }
        /* the original stays published and unchanged */
        kvh_seq m = tu_seq_new(e, 0);
        size_t matched = 0;
        assert_ok(kvh_seq_match_prefix(e, m, tokens, BT, &matched));
        assert_int_equal(matched, BT);
        assert_int_equal(tu_seq_block(e, m, 0).id, orig.id);
        kv_read(e, m, &got, 0, BT);
        kv_same(&before, &got, "published original after the copy");
        assert_ok(kvh_seq_free(e, m));
        assert_ok(kvh_seq_free(e, s));
        assert_ok(tu_close(e));
    }
}

/* ---- forks and prefix sharing of encoded blocks ---- */

/* A parent whose blocks sit encoded in the host tier is forked; the child
 * writes into a shared full block, a shared partial block, and truncates
 * into one. The parent keeps its decoded values bit for bit; the child's
 * copies keep every untouched token bit for bit. A third sequence
 * matching the prefix reads the parent's values, also after the blocks
 * went to disk and back. */
static void test_fork_and_prefix_of_encoded_blocks(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(0xc0dec5)};
    for (size_t ci = 0; ci < 3; ci++) {
        uint32_t codec = codecs[ci], dt = KVH_DTYPE_F16;
        char dir[512];
        kvh_config c = codec_store_cfg(dir, sizeof(dir), "fork", tu_cfg(L, H, D, BT, dt, 3, 4, 1), codec, 8ull << 20);
        kvh_engine *e = tu_open_cfg(&c);
        const size_t n = 2 * BT + 5;
        int32_t tokens[2 * BT + 5];
        tu_iota(tokens, n, 300);
        kvbuf x = kv_new(dt, L, H, D, n), y = kv_new(dt, L, H, D, n), par = kv_new(dt, L, H, D, n),
              got = kv_new(dt, L, H, D, n);
        kv_fill_hostile(&r, &x);
        kv_fill_hostile(&r, &y);
        kvh_seq p = tu_seq_new(e, 0);
        assert_ok(kvh_seq_append(e, p, tokens, n));
        kv_write(e, p, &x, 0, n);
        assert_ok(kvh_seq_migrate(e, p, 0, n, KVH_TIER_HOST, NULL));
        assert_tier(e, p, 0, 3, KVH_TIER_HOST);
        kv_read(e, p, &par, 0, n);
        kvh_seq ch;
        assert_ok(kvh_seq_fork(e, p, 0, &ch));
        /* one token in the full block 1 and one in the partial block 2 */
        kv_write(e, ch, &y, BT + 2, 1);
        kv_write(e, ch, &y, 2 * BT + 1, 1);
        kv_read(e, p, &got, 0, n);
        kv_same(&par, &got, "parent after the child's writes");
        kv_read(e, ch, &got, 0, n);
        size_t lb = kv_layer_bytes(&x), tb = kv_tok_bytes(&x);
        for (uint32_t l = 0; l < L; l++)
            for (size_t t = 0; t < n; t++) {
                if (t == BT + 2 || t == 2 * BT + 1)
                    continue;
                assert_same_bytes(par.k + l * lb + t * tb, got.k + l * lb + t * tb, tb, "child K untouched");
                assert_same_bytes(par.v + l * lb + t * tb, got.v + l * lb + t * tb, tb, "child V untouched");
            }
        /* truncating into the shared partial block of a second child */
        kvh_seq ch2;
        assert_ok(kvh_seq_fork(e, p, 0, &ch2));
        assert_ok(kvh_seq_truncate(e, ch2, 2 * BT + 2));
        int32_t more[3] = {9001, 9002, 9003};
        assert_ok(kvh_seq_append(e, ch2, more, 3));
        /* the re-appended tokens were never written in ch2 */
        assert_kvh(KVH_ERR_RANGE, kvh_seq_read_kv(e, ch2, 0, 2 * BT + 2, 1, got.k, got.v));
        kvbuf two = kv_new(dt, L, H, D, 2 * BT + 2);
        kv_read(e, ch2, &two, 0, 2 * BT + 2);
        for (uint32_t l = 0; l < L; l++) {
            assert_same_bytes(par.k + l * lb, two.k + l * kv_layer_bytes(&two), (2 * BT + 2) * tb, "ch2 K kept");
            assert_same_bytes(par.v + l * lb, two.v + l * kv_layer_bytes(&two), (2 * BT + 2) * tb, "ch2 V kept");
        }
        kv_read(e, p, &got, 0, n);
        kv_same(&par, &got, "parent after the second child's truncate");
        /* prefix sharing: the full blocks, through disk */
        assert_ok(kvh_seq_migrate(e, p, 0, n, KVH_TIER_DISK, NULL));
        kvh_seq m = tu_seq_new(e, 0);
        size_t matched = 0;
        assert_ok(kvh_seq_match_prefix(e, m, tokens, n, &matched));
        assert_int_equal(matched, 2 * BT);
        kvbuf mb = kv_new(dt, L, H, D, 2 * BT);
        kv_read(e, m, &mb, 0, 2 * BT);
        for (uint32_t l = 0; l < L; l++) {
            assert_same_bytes(par.k + l * lb, mb.k + l * kv_layer_bytes(&mb), 2 * BT * tb, "matched K");
            assert_same_bytes(par.v + l * lb, mb.v + l * kv_layer_bytes(&mb), 2 * BT * tb, "matched V");
        }
        assert_ok(kvh_seq_free(e, m));
        assert_ok(kvh_seq_free(e, ch2));
        assert_ok(kvh_seq_free(e, ch));
        assert_ok(kvh_seq_free(e, p));
        assert_ok(tu_close(e));
    }
}

/* ---- persistence ---- */

/* Blocks persisted from the (encoded) host tier and from the (raw) device
 * tier survive close + reopen: a matching sequence reads the codec's round
 * trip of what was written, bit for bit. Reopening with another codec is
 * KVH_ERR_MISMATCH, also with no codec; with KVH_DISK_RESET_ON_MISMATCH the
 * store is emptied. */
static void test_reopen_encoded_store(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(0xc0dec6)};
    for (size_t ci = 0; ci < 3; ci++)
        for (size_t di = 0; di < 3; di++) {
            uint32_t codec = codecs[ci], dt = dtypes[di];
            char dir[512];
            store_path(dir, sizeof(dir), "reopen");
            const size_t n = 4 * BT;
            int32_t ta[4 * BT], tb_[4 * BT];
            tu_iota(ta, n, 10);
            tu_iota(tb_, n, 5000);
            kvh_config c = tu_cfg(L, H, D, BT, dt, 4, 8, 1);
            c.kv_codec = codec;
            c.disk_path = dir;
            c.disk_bytes = 8ull << 20;
            c.disk_flags = KVH_DISK_RESET_ON_MISMATCH;
            kvbuf xa = kv_new(dt, L, H, D, n), xb = kv_new(dt, L, H, D, n), wa = kv_new(dt, L, H, D, n),
                  wb = kv_new(dt, L, H, D, n), got = kv_new(dt, L, H, D, n);
            kv_fill_hostile(&r, &xa);
            kv_fill_hostile(&r, &xb);
            kv_round_trip(codec, &xa, &wa);
            kv_round_trip(codec, &xb, &wb);
            kvh_engine *e = tu_open_cfg(&c);
            kvh_seq a = tu_seq_new(e, 0), b = tu_seq_new(e, 0);
            assert_ok(kvh_seq_append(e, a, ta, n));
            assert_ok(kvh_seq_append(e, b, tb_, n));
            kv_write(e, a, &xa, 0, n);
            kv_write(e, b, &xb, 0, n);
            assert_ok(kvh_seq_migrate(e, a, 0, n, KVH_TIER_HOST, NULL));
            assert_tier(e, a, 0, 4, KVH_TIER_HOST);
            assert_ok(kvh_seq_migrate(e, b, 0, n, KVH_TIER_DEVICE, NULL));
            assert_tier(e, b, 0, 4, KVH_TIER_DEVICE);
            assert_ok(kvh_seq_persist(e, a));
            assert_ok(kvh_seq_persist(e, b));
            kv_read(e, b, &got, 0, n);
            kv_same(&xb, &got, "device copy stays raw after persist");
            assert_ok(kvh_seq_free(e, a));
            assert_ok(kvh_seq_free(e, b));
            assert_ok(tu_close(e));

            c.disk_flags = 0;
            e = tu_open_cfg(&c);
            size_t matched = 0;
            kvh_seq m = tu_seq_new(e, 0);
            assert_ok(kvh_seq_match_prefix(e, m, ta, n, &matched));
            assert_int_equal(matched, n);
            kv_read(e, m, &got, 0, n);
            kv_same(&wa, &got, "reopened, persisted from host");
            kv_bound(codec, &xa, &got, "reopened, persisted from host");
            kvh_seq m2 = tu_seq_new(e, 0);
            assert_ok(kvh_seq_match_prefix(e, m2, tb_, n, &matched));
            assert_int_equal(matched, n);
            kv_read(e, m2, &got, 0, n);
            kv_same(&wb, &got, "reopened, persisted from device");
            kvh_stats st = tu_stats(e);
            assert_int_equal(st.prefix_hit_blocks, 8);
            assert_int_equal(st.prefix_hit_blocks_disk, 8);
            /* copy-on-write of matched blocks sitting on disk: a write
             * into one, and a fork truncated into another */
            assert_ok(kvh_seq_migrate(e, m, 0, n, KVH_TIER_DISK, NULL));
            kvh_seq fk;
            assert_ok(kvh_seq_fork(e, m, 0, &fk));
            kv_write(e, m, &xb, BT + 1, 1);
            assert_ok(kvh_seq_truncate(e, fk, 2 * BT + 3));
            kvbuf after = kv_new(dt, L, H, D, n);
            kv_read(e, m, &after, 0, n);
            size_t lb = kv_layer_bytes(&xa), tbb = kv_tok_bytes(&xa);
            for (uint32_t l = 0; l < L; l++)
                for (size_t t = 0; t < n; t++) {
                    if (t == BT + 1)
                        continue;
                    assert_same_bytes(wa.k + l * lb + t * tbb, after.k + l * lb + t * tbb, tbb, "K beside a CoW write");
                    assert_same_bytes(wa.v + l * lb + t * tbb, after.v + l * lb + t * tbb, tbb, "V beside a CoW write");
                }
            kvbuf cut = kv_new(dt, L, H, D, 2 * BT + 3);
            kv_read(e, fk, &cut, 0, 2 * BT + 3);
            for (uint32_t l = 0; l < L; l++) {
                assert_same_bytes(wa.k + l * lb, cut.k + l * kv_layer_bytes(&cut), (2 * BT + 3) * tbb, "truncated K");
                assert_same_bytes(wa.v + l * lb, cut.v + l * kv_layer_bytes(&cut), (2 * BT + 3) * tbb, "truncated V");
            }
            assert_ok(kvh_seq_free(e, fk));
            assert_ok(kvh_seq_free(e, m));
            assert_ok(kvh_seq_free(e, m2));
            assert_ok(tu_close(e));

            /* another codec, or none: the store is not this geometry */
            kvh_engine *bad = NULL;
            kvh_config o = c;
            o.kv_codec = codecs[(ci + 1) % 3];
            assert_kvh(KVH_ERR_MISMATCH, kvh_engine_open(&o, &bad));
            assert_null(bad);
            o.kv_codec = KVH_CODEC_NONE;
            assert_kvh(KVH_ERR_MISMATCH, kvh_engine_open(&o, &bad));
            assert_null(bad);
            /* the refused opens left the store usable */
            e = tu_open_cfg(&c);
            m = tu_seq_new(e, 0);
            assert_ok(kvh_seq_match_prefix(e, m, ta, n, &matched));
            assert_int_equal(matched, n);
            assert_ok(kvh_seq_free(e, m));
            assert_ok(tu_close(e));
            /* reset on mismatch: emptied, nothing served in the wrong form */
            o.kv_codec = codecs[(ci + 1) % 3];
            o.disk_flags = KVH_DISK_RESET_ON_MISMATCH;
            e = tu_open_cfg(&o);
            m = tu_seq_new(e, 0);
            assert_ok(kvh_seq_match_prefix(e, m, ta, n, &matched));
            assert_int_equal(matched, 0);
            assert_ok(kvh_seq_free(e, m));
            assert_ok(tu_close(e));
        }
}

/* ---- configuration ---- */

/* Codec settings that cannot work are refused at open with
 * KVH_ERR_INVALID_ARG and no engine; the ones that can are taken. */
static void test_bad_codec_configs(void **state)
{
    (void)state;
    kvh_engine *e = NULL;
    static const uint32_t bad_codecs[] = {4, 5, 255, 0x10000u, UINT32_MAX};
    for (size_t i = 0; i < sizeof(bad_codecs) / sizeof(bad_codecs[0]); i++) {
        kvh_config c = tu_cfg(1, 1, 64, 16, KVH_DTYPE_F16, 2, 2, 0);
        c.kv_codec = bad_codecs[i];
        assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(&c, &e));
        assert_null(e);
    }
    /* q4 groups that do not divide head_dim */
    static const struct {
        uint32_t codec, dim;
        kvh_status want;
    } geo[] = {
        {KVH_CODEC_Q4_G32, 1, KVH_ERR_INVALID_ARG},
        {KVH_CODEC_Q4_G32, 16, KVH_ERR_INVALID_ARG},
        {KVH_CODEC_Q4_G32, 33, KVH_ERR_INVALID_ARG},
        {KVH_CODEC_Q4_G32, 48, KVH_ERR_INVALID_ARG},
        {KVH_CODEC_Q4_G64, 32, KVH_ERR_INVALID_ARG},
        {KVH_CODEC_Q4_G64, 96, KVH_ERR_INVALID_ARG},
        {KVH_CODEC_Q4_G32, 96, KVH_OK},
        {KVH_CODEC_Q4_G64, 192, KVH_OK},
        {KVH_CODEC_INT8, 1, KVH_OK},
        {KVH_CODEC_INT8, 7, KVH_OK},
    };
    for (size_t i = 0; i < sizeof(geo) / sizeof(geo[0]); i++) {
        kvh_config c = tu_cfg(1, 1, geo[i].dim, 4, KVH_DTYPE_BF16, 2, 2, 0);
        c.kv_codec = geo[i].codec;
        e = NULL;
        kvh_status st = kvh_engine_open(&c, &e);
        if (st != geo[i].want)
            fail_msg("codec %u head_dim %u: %s, expected %s (%s)", geo[i].codec, geo[i].dim, kvh_status_name(st),
                     kvh_status_name(geo[i].want), kvh_last_error());
        if (st == KVH_OK) {
            tu_track_engine(e);
            uint64_t rec = 0;
            assert_ok(kvh_codec_vector_bytes(geo[i].codec, KVH_DTYPE_BF16, geo[i].dim, &rec));
            kvh_tier_info h = tu_tier(e, KVH_TIER_HOST);
            assert_int_equal(h.block_bytes, rec * 2 * 4);
            assert_ok(tu_close(e));
        } else {
            assert_null(e);
            assert_true(strlen(kvh_last_error()) > 0);
        }
    }
    /* the environment parser takes the documented names only */
    kvh_config c;
    assert_ok(kvh_config_init(&c, sizeof(c)));
    const char *ok_env[] = {"KVH_KV_CODEC=Q4_G64", NULL};
    assert_ok(kvh_config_from_env(&c, sizeof(c), ok_env));
    assert_int_equal(c.kv_codec, KVH_CODEC_Q4_G64);
    const char *bad_env[] = {"KVH_KV_CODEC=int4", NULL};
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_config_from_env(&c, sizeof(c), bad_env));
    assert_int_equal(c.kv_codec, KVH_CODEC_Q4_G64);
    const char *num_env[] = {"KVH_KV_CODEC=9", NULL};
    kvh_status st = kvh_config_from_env(&c, sizeof(c), num_env);
    if (st == KVH_OK) { /* a number "as its number": open must refuse it */
        kvh_config o = tu_cfg(1, 1, 64, 16, KVH_DTYPE_F16, 2, 2, 0);
        o.kv_codec = c.kv_codec;
        assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(&o, &e));
    } else {
        assert_kvh(KVH_ERR_INVALID_ARG, st);
    }
    /* derive_tolerance needs a codec, and a sane max_rel_error */
    kvh_engine *plain = tu_open(1, 1, 64, 16, KVH_DTYPE_F16, 2, 2, 0);
    kvh_seq s = tu_seq_new(plain, 0);
    int32_t t[4] = {1, 2, 3, 4};
    assert_ok(kvh_seq_append(plain, s, t, 4));
    assert_kvh(KVH_ERR_UNSUPPORTED, kvh_seq_derive_tolerance(plain, s, 0, 4, 0.0f));
    kvh_config q = tu_cfg(1, 1, 64, 16, KVH_DTYPE_F16, 2, 2, 0);
    q.kv_codec = KVH_CODEC_INT8;
    kvh_engine *qe = tu_open_cfg(&q);
    kvh_seq qs = tu_seq_new(qe, 0);
    assert_ok(kvh_seq_append(qe, qs, t, 4));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_derive_tolerance(qe, qs, 0, 4, NAN));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_derive_tolerance(qe, qs, 0, 4, INFINITY));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_derive_tolerance(qe, qs, 0, 4, -1.0f));
    assert_ok(tu_close(qe));
    assert_ok(tu_close(plain));
}

/* A disk budget too small for a raw block but large enough for an encoded
 * one: the slots shrink to the encoded size, so the codec engine opens
 * with a disk tier the raw one cannot have, and uses it. */
static void test_disk_budget_sized_for_encoded_slots(void **state)
{
    (void)state;
    /* raw block: 2 * 4 * 4 * 128 * 16 * 4 bytes = 256 KiB; int8 record of
     * 128 f32 elements is 132 bytes, so an encoded block is 66 KiB */
    const uint32_t layers = 4, heads = 4, dim = 128, bt = 16;
    char dir[512];
    store_path(dir, sizeof(dir), "small_disk");
    kvh_config c = tu_cfg(layers, heads, dim, bt, KVH_DTYPE_F32, 1, 1, 0);
    c.disk_path = dir;
    c.disk_bytes = 160ull << 10;
    c.disk_flags = KVH_DISK_RESET_ON_MISMATCH;
    kvh_engine *e = NULL;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(&c, &e));
    assert_null(e);
    c.kv_codec = KVH_CODEC_INT8;
    e = tu_open_cfg(&c);
    kvh_tier_info d = tu_tier(e, KVH_TIER_DISK), h = tu_tier(e, KVH_TIER_HOST);
    assert_true(d.capacity_blocks >= 2);
    assert_true(h.capacity_blocks >= 3);
    /* fill every tier; all of it reads back within the bound */
    size_t n = (size_t)(h.capacity_blocks + d.capacity_blocks) * bt; /* one slot left free */
    int32_t *tok = tu_alloc(n * sizeof(int32_t));
    tu_iota(tok, n, 1);
    kvh_seq s = tu_seq_new(e, 0);
    assert_ok(kvh_seq_append(e, s, tok, n));
    tu_rng r = {tu_seed(0xc0dec7)};
    kvbuf x = kv_new(KVH_DTYPE_F32, layers, heads, dim, n);
    kv_fill_hostile(&r, &x);
    for (size_t b = 0; b < n / bt; b++)
        kv_write(e, s, &x, b * bt, bt);
    assert_int_equal(tu_tier(e, KVH_TIER_DISK).used_blocks, d.capacity_blocks - 1);
    /* read a block at a time (only one fits in the device tier): a block
     * read from the device tier is raw, any other decoded */
    kvbuf one = kv_new(KVH_DTYPE_F32, layers, heads, dim, bt), xb = kv_new(KVH_DTYPE_F32, layers, heads, dim, bt);
    size_t blk = bt * kv_tok_bytes(&x);
    for (size_t b = 0; b < n / bt; b++) {
        uint32_t tier = tu_seq_binfo(e, s, b).tier;
        for (uint32_t l = 0; l < layers; l++) {
            assert_ok(kvh_seq_read_kv(e, s, l, b * bt, bt, one.k + l * kv_layer_bytes(&one),
                                      one.v + l * kv_layer_bytes(&one)));
            memcpy(xb.k + l * kv_layer_bytes(&xb), x.k + l * kv_layer_bytes(&x) + b * blk, blk);
            memcpy(xb.v + l * kv_layer_bytes(&xb), x.v + l * kv_layer_bytes(&x) + b * blk, blk);
        }
        if (tier == KVH_TIER_DEVICE)
            kv_same(&xb, &one, "read from the device tier");
        else
            kv_bound(KVH_CODEC_INT8, &xb, &one, "read from an encoded tier");
    }
    assert_ok(kvh_seq_free(e, s));
    assert_ok(tu_close(e));
}

/* A codec engine on the CPU backend never shares one arena between the
 * device and host tiers ("without vmap, kv_codec or numa_node"): moves
 * are copies through the codec, never in place. */
static void test_codec_tiers_are_not_one_arena(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(0xc0dec8)};
    kvh_config c = tu_cfg(1, 1, 64, 4, KVH_DTYPE_F32, 2, 2, 0);
    c.kv_codec = KVH_CODEC_INT8;
    kvh_engine *e = tu_open_cfg(&c);
    kvh_tier_info dv = tu_tier(e, KVH_TIER_DEVICE), hs = tu_tier(e, KVH_TIER_HOST);
    assert_true(hs.block_bytes < dv.block_bytes);
    kvbuf x = kv_new(KVH_DTYPE_F32, 1, 1, 64, 4), got = kv_new(KVH_DTYPE_F32, 1, 1, 64, 4),
          want = kv_new(KVH_DTYPE_F32, 1, 1, 64, 4);
    kv_fill_hostile(&r, &x);
    kv_round_trip(KVH_CODEC_INT8, &x, &want);
    kvh_seq s = tu_seq_new(e, 0);
    int32_t t[4] = {1, 2, 3, 4};
    assert_ok(kvh_seq_append(e, s, t, 4));
    kv_write(e, s, &x, 0, 4);
    for (int i = 0; i < 4; i++) {
        assert_ok(kvh_seq_migrate(e, s, 0, 4, KVH_TIER_HOST, NULL));
        kv_read(e, s, &got, 0, 4);
        kv_same(&want, &got, "host tier");
        assert_ok(kvh_seq_migrate(e, s, 0, 4, KVH_TIER_DEVICE, NULL));
    }
    kvh_stats st = tu_stats(e);
    assert_int_equal(st.blocks_moved_in_place, 0);
    assert_true(st.blocks_device_to_host + st.clean_copy_demotions >= 4);
    assert_int_equal(st.blocks_host_to_device, 4);
    assert_ok(kvh_seq_free(e, s));
    assert_ok(tu_close(e));
}

/* ---- tolerance derived from the codec ---- */

/* q4 of groups whose elements are all equal is exact (a bound of
 * (max - min) / 30 = 0), so its relative error is 0 and the derived
 * tolerance is KVH_TOLERANCE_MAX; non-finite or all-zero K/V must still
 * give a tolerance in range, never a crash. */
static void test_derived_tolerance_extremes(void **state)
{
    (void)state;
    kvh_config c = tu_cfg(1, 1, 64, 4, KVH_DTYPE_F32, 4, 4, 0);
    c.kv_codec = KVH_CODEC_Q4_G32;
    c.eviction_policy = KVH_EVICT_LCTRU;
    kvh_engine *e = tu_open_cfg(&c);
    kvh_seq s = tu_seq_new(e, 0);
    int32_t t[12];
    tu_iota(t, 12, 1);
    assert_ok(kvh_seq_append(e, s, t, 12));
    float k[4 * 64], v[4 * 64];
    for (int i = 0; i < 4 * 64; i++) {
        k[i] = 2.5f;
        v[i] = -1.0f / 3.0f;
    }
    assert_ok(kvh_seq_write_kv(e, s, 0, 0, 4, k, v));
    for (int i = 0; i < 4 * 64; i++)
        k[i] = v[i] = i % 3 == 0 ? INFINITY : i % 3 == 1 ? NAN : 1.0f;
    assert_ok(kvh_seq_write_kv(e, s, 0, 4, 4, k, v));
    for (int i = 0; i < 4 * 64; i++)
        k[i] = v[i] = i % 2 ? -0.0f : 0.0f;
    assert_ok(kvh_seq_write_kv(e, s, 0, 8, 4, k, v));
    assert_ok(kvh_seq_derive_tolerance(e, s, 0, 12, 0.0f));
    assert_int_equal(tu_seq_binfo(e, s, 0).tolerance, KVH_TOLERANCE_MAX);
    assert_true(tu_seq_binfo(e, s, 1).tolerance <= KVH_TOLERANCE_MAX);
    assert_true(tu_seq_binfo(e, s, 2).tolerance <= KVH_TOLERANCE_MAX);
    /* blocks already encoded keep their tolerance */
    assert_ok(kvh_seq_set_tolerance(e, s, 0, 12, 7));
    assert_ok(kvh_seq_migrate(e, s, 0, 12, KVH_TIER_HOST, NULL));
    assert_ok(kvh_seq_derive_tolerance(e, s, 0, 12, 0.0f));
    for (uint64_t b = 0; b < 3; b++)
        assert_int_equal(tu_seq_binfo(e, s, b).tolerance, 7);
    assert_ok(kvh_seq_free(e, s));
    assert_ok(tu_close(e));
}

/* ---- streamed attention over encoded tiers ---- */

/* Streaming attends blocks in the host and disk tiers where they are
 * ("from host memory through the codec"): the result must be attention
 * over the decoded values, the same as what read_kv returns, and equal to
 * the result after promoting everything to the device tier. */
static void test_streamed_attention_reads_decoded_values(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(0xc0dec9)};
    for (size_t ci = 0; ci < 3; ci++) {
        uint32_t codec = codecs[ci];
        char dir[512];
        store_path(dir, sizeof(dir), "stream");
        const uint32_t sd = 64, sbt = 16;
        kvh_config c = tu_cfg(1, 1, sd, sbt, KVH_DTYPE_F32, 8, 2, 0);
        c.kv_codec = codec;
        c.disk_path = dir;
        c.disk_bytes = 8ull << 20;
        c.disk_flags = KVH_DISK_RESET_ON_MISMATCH;
        kvh_engine *e = tu_open_cfg(&c);
        const size_t n = 6 * sbt;
        int32_t tok[6 * 16];
        tu_iota(tok, n, 1);
        kvh_seq s = tu_seq_new(e, 0);
        assert_ok(kvh_seq_append(e, s, tok, n));
        float *k = tu_alloc(n * sd * 4), *v = tu_alloc(n * sd * 4);
        for (size_t i = 0; i < n * sd; i++) {
            k[i] = gauss(&r);
            v[i] = gauss(&r);
        }
        assert_ok(kvh_seq_write_kv(e, s, 0, 0, n, k, v));
        /* blocks 0..1 to disk, 2..3 to host, 4..5 stay */
        assert_ok(kvh_seq_migrate(e, s, 0, 2 * sbt, KVH_TIER_DISK, NULL));
        assert_ok(kvh_seq_migrate(e, s, 2 * sbt, 2 * sbt, KVH_TIER_HOST, NULL));
        assert_tier(e, s, 0, 2, KVH_TIER_DISK);
        assert_tier(e, s, 2, 2, KVH_TIER_HOST);
        float *rk = tu_alloc(n * sd * 4), *rv = tu_alloc(n * sd * 4);
        assert_ok(kvh_seq_read_kv(e, s, 0, 0, n, rk, rv));
        assert_ok(kvh_seq_migrate(e, s, 0, 2 * sbt, KVH_TIER_DISK, NULL)); /* reads may have moved them */
        float q[64], out[64], out2[64];
        for (uint32_t i = 0; i < sd; i++)
            q[i] = gauss(&r);
        /* reference over the decoded values, in double */
        double sc = 1.0 / sqrt((double)sd), mx = -INFINITY, den = 0, acc[64] = {0};
        double *w = tu_alloc(n * sizeof(double));
        for (size_t t = 0; t < n; t++) {
            double dot = 0;
            for (uint32_t i = 0; i < sd; i++)
                dot += (double)q[i] * rk[t * sd + i];
            w[t] = dot * sc;
            mx = fmax(mx, w[t]);
        }
        for (size_t t = 0; t < n; t++) {
            double p = exp(w[t] - mx);
            den += p;
            for (uint32_t i = 0; i < sd; i++)
                acc[i] += p * rv[t * sd + i];
        }
        kvh_attention_params p;
        assert_ok(kvh_attention_params_init(&p, sizeof(p)));
        p.threads = 1;
        p.stream_chunk_blocks = 1;
        p.stream_window_blocks = 2;
        assert_ok(kvh_attention_decode(e, 0, &s, 1, q, out, &p));
        kvh_stats st = tu_stats(e);
        assert_true(st.blocks_streamed_disk >= 2);
        assert_true(st.blocks_streamed_host >= 1);
        for (uint32_t i = 0; i < sd; i++) {
            double ref = acc[i] / den;
            if (!(fabs(out[i] - ref) <= 1e-4 * (1 + fabs(ref))))
                fail_msg("codec %u streamed out[%u] = %.9g, reference over decoded K/V %.9g", codec, i, out[i], ref);
        }
        /* the same after promoting everything */
        assert_ok(kvh_seq_acquire(e, s, 0, n, NULL));
        assert_ok(kvh_attention_decode(e, 0, &s, 1, q, out2, &p));
        assert_ok(kvh_seq_release(e, s, 0, n));
        for (uint32_t i = 0; i < sd; i++)
            if (!(fabs(out2[i] - out[i]) <= 1e-5 * (1 + fabs(out[i]))))
                fail_msg("codec %u: promoted out[%u] = %.9g, streamed %.9g", codec, i, out2[i], out[i]);
        assert_ok(kvh_seq_free(e, s));
        assert_ok(tu_close(e));
    }
}

/* "the same budget holds more blocks, except for a head_dim so small that
 * a record outgrows the raw vector": an int8 record is a 4-byte scale
 * plus head_dim bytes. Wherever it is no larger than the raw vector the
 * host budget must hold at least as many blocks as without the codec;
 * and whatever the count, the tier works when it exists. */
static void test_encoded_slots_never_hold_fewer_blocks(void **state)
{
    (void)state;
    static const uint32_t dims[] = {1, 2, 3, 4, 8};
    for (size_t di = 0; di < 3; di++)
        for (size_t gi = 0; gi < sizeof(dims) / sizeof(dims[0]); gi++) {
            uint32_t dt = dtypes[di], dim = dims[gi];
            kvh_config c = tu_cfg(2, 2, dim, 4, dt, 2, 4, 0);
            kvh_engine *raw = tu_open_cfg(&c);
            uint64_t raw_cap = tu_tier(raw, KVH_TIER_HOST).capacity_blocks;
            assert_ok(tu_close(raw));
            c.kv_codec = KVH_CODEC_INT8;
            kvh_engine *e = tu_open_cfg(&c);
            kvh_tier_info h = tu_tier(e, KVH_TIER_HOST);
            uint64_t rec = 0;
            assert_ok(kvh_codec_vector_bytes(KVH_CODEC_INT8, dt, dim, &rec));
            uint64_t raw_vector = (uint64_t)dim * (dt == KVH_DTYPE_F32 ? 4 : 2);
            assert_int_equal(rec > raw_vector, dt == KVH_DTYPE_F32 ? dim < 2 : dim < 4); /* kvh.h's exceptions */
            if (rec <= raw_vector && h.capacity_blocks < raw_cap)
                fail_msg("int8, dtype %u, head_dim %u: the host budget holds %" PRIu64 " encoded blocks of %" PRIu64
                         " bytes, %" PRIu64 " raw ones",
                         dt, dim, h.capacity_blocks, h.block_bytes, raw_cap);
            /* whatever the count, the tier is usable when it exists */
            kvh_seq s = tu_seq_new(e, 0);
            int32_t t[4] = {1, 2, 3, 4};
            assert_ok(kvh_seq_append(e, s, t, 4));
            if (h.capacity_blocks > 0)
                assert_ok(kvh_seq_migrate(e, s, 0, 4, KVH_TIER_HOST, NULL));
            else
                assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_migrate(e, s, 0, 4, KVH_TIER_HOST, NULL));
            assert_ok(kvh_seq_free(e, s));
            assert_ok(tu_close(e));
        }
}

/* External pools: a block offloaded from a pool with padded strides,
 * moved into the encoded tiers and restored into another slot, lands as
 * the codec's round trip, bit for bit, and the padding between heads and
 * tokens of the pool is left alone. */
static void test_pool_restore_from_encoded_tiers(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(0xc0deca)};
    for (size_t ci = 0; ci < 3; ci++) {
        uint32_t codec = codecs[ci], dt = KVH_DTYPE_F16;
        char dir[512];
        kvh_config c = codec_store_cfg(dir, sizeof(dir), "pool", tu_cfg(L, H, D, BT, dt, 2, 4, 0), codec, 4ull << 20);
        kvh_engine *e = tu_open_cfg(&c);
        const size_t es = 2, head_stride = (D + 8) * es, token_stride = H * head_stride + 16,
                     slot_stride = BT * token_stride + 64;
        const uint32_t slots = 3;
        uint8_t *kmem[L], *vmem[L];
        void *kb[L], *vb[L];
        for (uint32_t l = 0; l < L; l++) {
            kmem[l] = tu_alloc(slots * slot_stride);
            vmem[l] = tu_alloc(slots * slot_stride);
            memset(kmem[l], 0xee, slots * slot_stride);
            memset(vmem[l], 0xee, slots * slot_stride);
            kb[l] = kmem[l];
            vb[l] = vmem[l];
        }
        kvh_pool_layout lay;
        memset(&lay, 0, sizeof(lay));
        lay.struct_size = sizeof(lay);
        lay.memory = KVH_MEMORY_HOST;
        lay.num_slots = slots;
        lay.k_base = kb;
        lay.v_base = vb;
        lay.slot_stride = slot_stride;
        lay.token_stride = token_stride;
        lay.head_stride = head_stride;
        kvh_pool pool;
        assert_ok(kvh_pool_register(e, &lay, &pool));
        /* slot 0 holds hostile K/V, as [token][head][dim] per layer */
        kvbuf x = kv_new(dt, L, H, D, BT), want = kv_new(dt, L, H, D, BT);
        kv_fill_hostile(&r, &x);
        kv_round_trip(codec, &x, &want);
        size_t row = D * es;
        for (uint32_t l = 0; l < L; l++)
            for (uint32_t t = 0; t < BT; t++)
                for (uint32_t h = 0; h < H; h++) {
                    size_t at = ((size_t)t * H + h) * row + l * kv_layer_bytes(&x);
                    memcpy(kmem[l] + t * token_stride + h * head_stride, x.k + at, row);
                    memcpy(vmem[l] + t * token_stride + h * head_stride, x.v + at, row);
                }
        int32_t tokens[BT];
        tu_iota(tokens, BT, 4242);
        kvh_block blk;
        assert_ok(kvh_pool_offload(e, pool, 0, 0, tokens, BT, 0, &blk));
        for (uint32_t dst_tier = KVH_TIER_HOST; dst_tier <= KVH_TIER_DISK; dst_tier++) {
            assert_ok(kvh_migrate(e, &blk, 1, dst_tier, NULL));
            assert_int_equal(tu_binfo(e, blk).tier, dst_tier);
            uint32_t slot = dst_tier == KVH_TIER_HOST ? 1 : 2;
            assert_ok(kvh_pool_restore(e, pool, blk, slot));
            for (uint32_t l = 0; l < L; l++) {
                const uint8_t *sk = kmem[l] + slot * slot_stride, *sv = vmem[l] + slot * slot_stride;
                for (uint32_t t = 0; t < BT; t++)
                    for (uint32_t h = 0; h < H; h++) {
                        size_t at = ((size_t)t * H + h) * row + l * kv_layer_bytes(&x);
                        assert_same_bytes(want.k + at, sk + t * token_stride + h * head_stride, row, "restored K");
                        assert_same_bytes(want.v + at, sv + t * token_stride + h * head_stride, row, "restored V");
                        /* the padding after each head's row */
                        for (size_t pb = row; pb < head_stride; pb++) {
                            assert_int_equal(sk[t * token_stride + h * head_stride + pb], 0xee);
                            assert_int_equal(sv[t * token_stride + h * head_stride + pb], 0xee);
                        }
                    }
                for (size_t pb = H * head_stride; pb < token_stride; pb++)
                    assert_int_equal(sk[pb], 0xee);
            }
        }
        assert_ok(kvh_block_release(e, blk));
        assert_ok(kvh_pool_unregister(e, pool));
        assert_ok(tu_close(e));
    }
}

/* Settings that interact with a codec: copy_moves and vmap either open
 * and keep every move through the codec, or are refused with a status. */
static void test_codec_with_copy_moves_and_vmap(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(0xc0decb)};
    for (int variant = 0; variant < 2; variant++) {
        /* f32, head_dim 64, 16 tokens: one head's K of a block is a page */
        kvh_config c = tu_cfg(1, 1, 64, 16, KVH_DTYPE_F32, 2, 4, 0);
        c.kv_codec = KVH_CODEC_Q4_G64;
        if (variant == 0)
            c.copy_moves = 1;
        else
            c.vmap = 1;
        kvh_engine *e = NULL;
        kvh_status st = kvh_engine_open(&c, &e);
        if (st != KVH_OK) {
            assert_kvh(KVH_ERR_UNSUPPORTED, st);
            assert_null(e);
            continue;
        }
        tu_track_engine(e);
        kvbuf x = kv_new(KVH_DTYPE_F32, 1, 1, 64, 16), want = kv_new(KVH_DTYPE_F32, 1, 1, 64, 16),
              got = kv_new(KVH_DTYPE_F32, 1, 1, 64, 16);
        kv_fill_hostile(&r, &x);
        kv_round_trip(KVH_CODEC_Q4_G64, &x, &want);
        kvh_seq s = tu_seq_new(e, 0);
        int32_t t[16];
        tu_iota(t, 16, 1);
        assert_ok(kvh_seq_append(e, s, t, 16));
        kv_write(e, s, &x, 0, 16);
        assert_ok(kvh_seq_migrate(e, s, 0, 16, KVH_TIER_HOST, NULL));
        kv_read(e, s, &got, 0, 16);
        kv_same(&want, &got, variant ? "vmap engine, host tier" : "copy_moves engine, host tier");
        assert_ok(kvh_seq_migrate(e, s, 0, 16, KVH_TIER_DEVICE, NULL));
        kv_read(e, s, &got, 0, 16);
        kv_same(&want, &got, variant ? "vmap engine, promoted" : "copy_moves engine, promoted");
        assert_int_equal(tu_stats(e).blocks_moved_in_place, 0);
        assert_ok(kvh_seq_free(e, s));
        assert_ok(tu_close(e));
    }
}

/* A store whose index and journal are gone is rebuilt from the slot
 * headers, "each slot checked in full (data included)": encoded slots
 * must check as what they are, so every persisted block is kept, none is
 * counted corrupt, and a match reads the same values as before. */
static void test_index_rebuild_keeps_encoded_slots(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(0xc0decc)};
    for (size_t ci = 0; ci < 3; ci++) {
        uint32_t codec = codecs[ci], dt = KVH_DTYPE_BF16;
        char dir[512];
        store_path(dir, sizeof(dir), "rebuild");
        const size_t n = 3 * BT;
        int32_t tok[3 * BT];
        tu_iota(tok, n, 60);
        kvh_config c = tu_cfg(L, H, D, BT, dt, 4, 4, 1);
        c.kv_codec = codec;
        c.disk_path = dir;
        c.disk_bytes = 4ull << 20;
        c.disk_flags = KVH_DISK_RESET_ON_MISMATCH;
        kvbuf x = kv_new(dt, L, H, D, n), want = kv_new(dt, L, H, D, n), got = kv_new(dt, L, H, D, n);
        kv_fill_hostile(&r, &x);
        kv_round_trip(codec, &x, &want);
        kvh_engine *e = tu_open_cfg(&c);
        kvh_seq s = tu_seq_new(e, 0);
        assert_ok(kvh_seq_append(e, s, tok, n));
        kv_write(e, s, &x, 0, n);
        assert_ok(kvh_seq_migrate(e, s, 0, BT, KVH_TIER_HOST, NULL));
        assert_ok(kvh_seq_persist(e, s));
        assert_ok(kvh_seq_free(e, s));
        assert_ok(tu_close(e));
        char f[600];
        snprintf(f, sizeof(f), "%s/index", dir);
        assert_int_equal(unlink(f), 0);
        snprintf(f, sizeof(f), "%s/journal", dir);
        assert_int_equal(unlink(f), 0);
        c.disk_flags = 0;
        e = tu_open_cfg(&c);
        kvh_stats st = tu_stats(e);
        assert_int_equal(st.corrupt_blocks, 0);
        s = tu_seq_new(e, 0);
        size_t matched = 0;
        assert_ok(kvh_seq_match_prefix(e, s, tok, n, &matched));
        assert_int_equal(matched, n);
        kv_read(e, s, &got, 0, n);
        kv_same(&want, &got, "rebuilt index");
        assert_ok(kvh_seq_free(e, s));
        assert_ok(tu_close(e));
    }
}

/* No host tier, only a device tier of one block and a disk tier: every
 * move is device <-> disk, encoding on the way down and decoding on the
 * way up, with the same values as through a host tier. */
static void test_device_disk_without_host_tier(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(0xc0decd)};
    for (size_t ci = 0; ci < 3; ci++) {
        uint32_t codec = codecs[ci], dt = KVH_DTYPE_F16;
        char dir[512];
        kvh_config c =
            codec_store_cfg(dir, sizeof(dir), "nohost", tu_cfg(L, H, D, BT, dt, 1, 0, ci % 2), codec, 4ull << 20);
        kvh_engine *e = NULL;
        kvh_status st = kvh_engine_open(&c, &e);
        if (st != KVH_OK) { /* a budget the engine refuses, with a status */
            assert_kvh(KVH_ERR_INVALID_ARG, st);
            assert_null(e);
            continue;
        }
        tu_track_engine(e);
        assert_int_equal(tu_tier(e, KVH_TIER_HOST).capacity_blocks, 0);
        const size_t n = 4 * BT;
        int32_t tok[4 * BT];
        tu_iota(tok, n, 3);
        kvbuf x = kv_new(dt, L, H, D, n), want = kv_new(dt, L, H, D, n);
        kv_fill_hostile(&r, &x);
        kv_round_trip(codec, &x, &want);
        kvh_seq s = tu_seq_new(e, 0);
        for (size_t b = 0; b < 4; b++) {
            assert_ok(kvh_seq_append(e, s, tok + b * BT, BT));
            kv_write(e, s, &x, b * BT, BT);
        }
        assert_ok(kvh_seq_migrate(e, s, 3 * BT, BT, KVH_TIER_DISK, NULL));
        assert_tier(e, s, 0, 4, KVH_TIER_DISK);
        kvbuf one = kv_new(dt, L, H, D, BT);
        size_t blk = BT * kv_tok_bytes(&x);
        for (size_t b = 0; b < 4; b++) {
            for (uint32_t l = 0; l < L; l++) {
                assert_ok(kvh_seq_read_kv(e, s, l, b * BT, BT, one.k + l * kv_layer_bytes(&one),
                                          one.v + l * kv_layer_bytes(&one)));
                assert_same_bytes(want.k + l * kv_layer_bytes(&want) + b * blk, one.k + l * kv_layer_bytes(&one), blk,
                                  "K read from disk without a host tier");
                assert_same_bytes(want.v + l * kv_layer_bytes(&want) + b * blk, one.v + l * kv_layer_bytes(&one), blk,
                                  "V read from disk without a host tier");
            }
        }
        assert_ok(kvh_seq_free(e, s));
        assert_ok(tu_close(e));
    }
}

/* The host tier's memory (kvh_tier_info.base, slot i at base + i *
 * block_bytes) holds a block in the codec's form: one record per vector,
 * in the block's documented order [layer][K,V][kv_head][token]. */
static void test_host_slot_holds_records_in_block_order(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(0xc0dece)};
    for (size_t ci = 0; ci < 3; ci++) {
        uint32_t codec = codecs[ci], dt = KVH_DTYPE_F32;
        kvh_config c = tu_cfg(L, H, D, BT, dt, 2, 4, 0);
        c.kv_codec = codec;
        kvh_engine *e = tu_open_cfg(&c);
        kvbuf x = kv_new(dt, L, H, D, BT);
        kv_fill_hostile(&r, &x);
        int32_t tok[BT];
        tu_iota(tok, BT, 1);
        kvh_seq s = tu_seq_new(e, 0);
        assert_ok(kvh_seq_append(e, s, tok, BT));
        kv_write(e, s, &x, 0, BT);
        assert_ok(kvh_seq_migrate(e, s, 0, BT, KVH_TIER_HOST, NULL));
        kvh_block_info bi = tu_seq_binfo(e, s, 0);
        assert_int_equal(bi.tier, KVH_TIER_HOST);
        kvh_tier_info h = tu_tier(e, KVH_TIER_HOST);
        assert_non_null(h.base);
        assert_int_equal(h.used_bytes, h.used_blocks * h.block_bytes);
        uint64_t rec = 0;
        assert_ok(kvh_codec_vector_bytes(codec, dt, D, &rec));
        assert_int_equal(h.block_bytes, rec * 2 * L * H * BT);
        const uint8_t *slot = (const uint8_t *)h.base + (uint64_t)bi.slot * h.block_bytes;
        uint8_t *want = tu_alloc(rec);
        for (uint32_t l = 0; l < L; l++)
            for (uint32_t kv = 0; kv < 2; kv++)
                for (uint32_t hh = 0; hh < H; hh++)
                    for (uint32_t t = 0; t < BT; t++) {
                        const uint8_t *src = (kv ? x.v : x.k) + l * kv_layer_bytes(&x) + t * kv_tok_bytes(&x) +
                                             (size_t)hh * D * dsize(dt);
                        assert_ok(kvh_codec_encode(codec, dt, D, src, 1, want));
                        uint64_t cell = ((uint64_t)(l * 2 + kv) * H + hh) * BT + t;
                        assert_same_bytes(want, slot + cell * rec, rec, "host slot record");
                    }
        assert_ok(kvh_seq_free(e, s));
        assert_ok(tu_close(e));
    }
}

/* Bytes written to and read from the disk tier: a clean copy counts "their
 * bytes (as stored: encoded under a kv_codec)", the disk tier's
 * block_bytes. A move host -> disk of an encoded block writes exactly those
 * bytes, and a move back reads them, so bytes_host_to_disk and
 * bytes_disk_to_host must count the same size per block, not the raw
 * block size. */
static void test_disk_byte_counters_count_the_stored_form(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(0xc0decf)};
    char dir[512];
    kvh_config c = codec_store_cfg(dir, sizeof(dir), "bytes", tu_cfg(L, H, D, BT, KVH_DTYPE_F16, 4, 4, 0),
                                   KVH_CODEC_INT8, 4ull << 20);
    kvh_engine *e = tu_open_cfg(&c);
    kvh_tier_info dk = tu_tier(e, KVH_TIER_DISK), dv = tu_tier(e, KVH_TIER_DEVICE);
    assert_true(dk.block_bytes < dv.block_bytes);
    const size_t n = 2 * BT;
    int32_t tok[2 * BT];
    tu_iota(tok, n, 1);
    kvbuf x = kv_new(KVH_DTYPE_F16, L, H, D, n);
    kv_fill_hostile(&r, &x);
    kvh_seq s = tu_seq_new(e, 0);
    assert_ok(kvh_seq_append(e, s, tok, BT));
    kv_write(e, s, &x, 0, BT);
    /* block 0: a clean copy from the device tier */
    assert_ok(kvh_seq_persist(e, s));
    /* block 1 (never persisted): moved down and back */
    assert_ok(kvh_seq_append(e, s, tok + BT, BT));
    kv_write(e, s, &x, BT, BT);
    assert_ok(kvh_seq_migrate(e, s, BT, BT, KVH_TIER_HOST, NULL));
    assert_ok(kvh_seq_migrate(e, s, BT, BT, KVH_TIER_DISK, NULL));
    assert_tier(e, s, 1, 1, KVH_TIER_DISK);
    assert_ok(kvh_seq_migrate(e, s, BT, BT, KVH_TIER_HOST, NULL));
    assert_tier(e, s, 1, 1, KVH_TIER_HOST);
    kvh_stats st = tu_stats(e);
    assert_true(st.disk_copies_written >= 1);
    assert_int_equal(st.bytes_disk_copies_written, st.disk_copies_written * dk.block_bytes);
    assert_true(st.blocks_host_to_disk >= 1);
    assert_true(st.blocks_disk_to_host >= 1);
    if (st.bytes_host_to_disk != st.blocks_host_to_disk * dk.block_bytes ||
        st.bytes_disk_to_host != st.blocks_disk_to_host * dk.block_bytes)
        fail_msg("host -> disk: %" PRIu64 " bytes for %" PRIu64 " blocks, disk -> host: %" PRIu64 " bytes for %" PRIu64
                 " blocks; a stored block is %" PRIu64 " bytes (raw %" PRIu64 ")",
                 st.bytes_host_to_disk, st.blocks_host_to_disk, st.bytes_disk_to_host, st.blocks_disk_to_host,
                 dk.block_bytes, dv.block_bytes);
    assert_ok(kvh_seq_free(e, s));
    assert_ok(tu_close(e));
}

/* "A demotion onto a block's clean disk copy writes nothing and is
 * counted in none of the pairs": a persisted (encoded) block moved from
 * the host tier onto its disk copy reads back as before, with no move
 * counted and no byte written. */
static void test_move_onto_clean_disk_copy_writes_nothing(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(0xc0ded0)};
    char dir[512];
    kvh_config c = codec_store_cfg(dir, sizeof(dir), "copymove", tu_cfg(1, 1, 64, 4, KVH_DTYPE_F32, 4, 4, 0),
                                   KVH_CODEC_INT8, 4ull << 20);
    kvh_engine *e = tu_open_cfg(&c);
    kvbuf x = kv_new(KVH_DTYPE_F32, 1, 1, 64, 4), want = kv_new(KVH_DTYPE_F32, 1, 1, 64, 4),
          got = kv_new(KVH_DTYPE_F32, 1, 1, 64, 4);
    kv_fill_hostile(&r, &x);
    kv_round_trip(KVH_CODEC_INT8, &x, &want);
    kvh_seq s = tu_seq_new(e, 0);
    int32_t t[4] = {1, 2, 3, 4};
    assert_ok(kvh_seq_append(e, s, t, 4));
    kv_write(e, s, &x, 0, 4);
    assert_ok(kvh_seq_persist(e, s));
    assert_ok(kvh_seq_migrate(e, s, 0, 4, KVH_TIER_HOST, NULL));
    kvh_stats before = tu_stats(e);
    assert_ok(kvh_seq_migrate(e, s, 0, 4, KVH_TIER_DISK, NULL));
    assert_tier(e, s, 0, 1, KVH_TIER_DISK);
    kvh_stats after = tu_stats(e);
    kv_read(e, s, &got, 0, 4);
    kv_same(&want, &got, "block moved onto its disk copy");
    if (after.blocks_host_to_disk != before.blocks_host_to_disk ||
        after.bytes_host_to_disk != before.bytes_host_to_disk ||
        after.disk_copies_written != before.disk_copies_written)
        fail_msg("a host -> disk move onto a clean disk copy: blocks_host_to_disk %" PRIu64 " -> %" PRIu64
                 ", bytes %" PRIu64 " -> %" PRIu64,
                 before.blocks_host_to_disk, after.blocks_host_to_disk, before.bytes_host_to_disk,
                 after.bytes_host_to_disk);
    assert_ok(kvh_seq_free(e, s));
    assert_ok(tu_close(e));
}

/* Both memory tiers full of referenced blocks and no disk tier: bringing a
 * host block up trades it with a device block (one encoded on the way
 * down, the other decoded on the way up, through one bounce buffer). Both
 * blocks must come out as the codec's round trip of what was written,
 * whichever order the trades happen in. */
static void test_full_hierarchy_swaps_through_the_codec(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(0xc0ded1)};
    for (size_t ci = 0; ci < 3; ci++)
        for (size_t di = 0; di < 3; di++) {
            uint32_t codec = codecs[ci], dt = dtypes[di];
            kvh_config c = tu_cfg(1, 2, 64, 4, dt, 1, 0, 0);
            c.kv_codec = codec;
            uint64_t rec = 0;
            assert_ok(kvh_codec_vector_bytes(codec, dt, 64, &rec));
            c.host_bytes = 2 * (2ull * 2 * 4 * rec); /* two encoded blocks */
            kvh_engine *e = tu_open_cfg(&c);
            assert_int_equal(tu_tier(e, KVH_TIER_HOST).capacity_blocks, 2);
            const size_t n = 12;
            int32_t tok[12];
            tu_iota(tok, n, 11);
            kvbuf x = kv_new(dt, 1, 2, 64, n), want = kv_new(dt, 1, 2, 64, n), one = kv_new(dt, 1, 2, 64, 4);
            kv_fill_hostile(&r, &x);
            kv_round_trip(codec, &x, &want);
            kvh_seq s = tu_seq_new(e, 0);
            for (size_t b = 0; b < 3; b++) {
                assert_ok(kvh_seq_append(e, s, tok + 4 * b, 4));
                kv_write(e, s, &x, 4 * b, 4);
            }
            assert_tier(e, s, 2, 1, KVH_TIER_DEVICE);
            size_t tb = kv_tok_bytes(&x);
            bool was_encoded[3] = {true, true, false};
            /* each block up in turn: every acquire trades two blocks */
            for (int round = 0; round < 2; round++)
                for (uint64_t b = 0; b < 3; b++) {
                    assert_ok(kvh_seq_acquire(e, s, b * 4, 4, NULL));
                    assert_tier(e, s, b, 1, KVH_TIER_DEVICE);
                    assert_ok(kvh_seq_release(e, s, b * 4, 4));
                    for (uint64_t o = 0; o < 3; o++)
                        if (tu_seq_binfo(e, s, o).tier != KVH_TIER_DEVICE)
                            was_encoded[o] = true;
                    for (uint64_t o = 0; o < 3; o++) {
                        assert_ok(kvh_seq_read_kv(e, s, 0, o * 4, 4, one.k, one.v));
                        kvbuf xo = {dt, 1, 2, 64, 4, x.k + o * 4 * tb, x.v + o * 4 * tb};
                        if (was_encoded[o])
                            kv_bound(codec, &xo, &one, "after swaps");
                        else
                            kv_same(&xo, &one, "never left the device tier");
                    }
                }
            assert_true(was_encoded[2]);
            (void)want;
            assert_ok(kvh_seq_free(e, s));
            assert_ok(tu_close(e));
        }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_special_values_through_every_tier, tu_teardown),
        cmocka_unit_test_teardown(test_tiny_geometry_round_trips, tu_teardown),
        cmocka_unit_test_teardown(test_partial_write_in_encoded_block, tu_teardown),
        cmocka_unit_test_teardown(test_write_into_sealed_encoded_block, tu_teardown),
        cmocka_unit_test_teardown(test_fork_and_prefix_of_encoded_blocks, tu_teardown),
        cmocka_unit_test_teardown(test_reopen_encoded_store, tu_teardown),
        cmocka_unit_test_teardown(test_bad_codec_configs, tu_teardown),
        cmocka_unit_test_teardown(test_disk_budget_sized_for_encoded_slots, tu_teardown),
        cmocka_unit_test_teardown(test_codec_tiers_are_not_one_arena, tu_teardown),
        cmocka_unit_test_teardown(test_derived_tolerance_extremes, tu_teardown),
        cmocka_unit_test_teardown(test_streamed_attention_reads_decoded_values, tu_teardown),
        cmocka_unit_test_teardown(test_encoded_slots_never_hold_fewer_blocks, tu_teardown),
        cmocka_unit_test_teardown(test_pool_restore_from_encoded_tiers, tu_teardown),
        cmocka_unit_test_teardown(test_codec_with_copy_moves_and_vmap, tu_teardown),
        cmocka_unit_test_teardown(test_index_rebuild_keeps_encoded_slots, tu_teardown),
        cmocka_unit_test_teardown(test_device_disk_without_host_tier, tu_teardown),
        cmocka_unit_test_teardown(test_host_slot_holds_records_in_block_order, tu_teardown),
        cmocka_unit_test_teardown(test_disk_byte_counters_count_the_stored_form, tu_teardown),
        cmocka_unit_test_teardown(test_move_onto_clean_disk_copy_writes_nothing, tu_teardown),
        cmocka_unit_test_teardown(test_full_hierarchy_swaps_through_the_codec, tu_teardown),
    };
    int failed = cmocka_run_group_tests_name("codec_tier_hostile", tests, NULL, NULL);
    for (int i = 0; i < n_stores; i++)
        nftw(stores[i], rm_entry, 8, FTW_DEPTH | FTW_PHYS);
    return failed;
}
