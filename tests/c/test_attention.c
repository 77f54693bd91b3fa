/* Paged attention on the CPU backend.
 *
 *   - the dtype conversions (exhaustive round trips, ties to even);
 *   - the scalar reference against an independent naive computation in
 *     double over contiguous copies of the K/V the test wrote;
 *   - every fast kernel variant this CPU runs (portable, AVX2, AVX-512,
 *     and AUTO with 1 and several threads) against the reference, over a
 *     seeded sweep of head_dim, block_tokens, KV and io dtypes, GQA
 *     ratios, sequence lengths (multiples of the block size and not),
 *     mixed batches, split-K and chunked prefill; forked sequences that
 *     share blocks;
 *   - bad input, residency and holds.
 *
 * Outputs are poisoned with NaN (all bits set) before every run: a row a
 * kernel forgot stays NaN and fails. Error bounds, fast vs reference, per
 * element with V_max = max |V| of the case:
 *   io f32 : |fast - ref| <= 1e-5 |ref| + 1e-5 V_max
 *   io f16 : |fast - ref| <= 2^-10 |ref| + 1e-5 V_max   (one f16 ulp)
 *   io bf16: |fast - ref| <= 2^-7 |ref| + 1e-5 V_max    (one bf16 ulp)
 * (f32 accumulation against double; the 16-bit outputs are each rounded
 * once, so the two may land one ulp apart.) Reference vs naive double:
 *   io f32 : 1e-6 |naive| + 1e-6 V_max; f16/bf16: half an ulp + 1e-6 V_max.
 * Test values are multiples of 1/64 below 2 in magnitude, exact in every
 * dtype, so the stored K/V equal the test's copies. */
#include <math.h>
#include <pthread.h>

#include "test_util.h"

#include "kernels/attention_dtype.h"
#include "kernels/cpu/attn_cpu.h"
#include "kernels/cpu/attn_vec4.h"

/* ---- conversions ---- */

static void test_f16_roundtrip(void **state)
{
    (void)state;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = kvhi_f16_to_f32((uint16_t)h);
        if (isnan(f)) {
            assert_true(((h >> 10) & 0x1f) == 0x1f && (h & 0x3ff));
            assert_true(isnan(kvhi_f16_to_f32(kvhi_f32_to_f16(f))));
            continue;
        }
        assert_int_equal(kvhi_f32_to_f16(f), h);
    }
    /* values known by heart */
    assert_int_equal(kvhi_f32_to_f16(1.0f), 0x3c00);
    assert_int_equal(kvhi_f32_to_f16(-2.0f), 0xc000);
    assert_int_equal(kvhi_f32_to_f16(65504.0f), 0x7bff);
    assert_int_equal(kvhi_f32_to_f16(65519.0f), 0x7bff);
    assert_int_equal(kvhi_f32_to_f16(65520.0f), 0x7c00); /* tie to even: inf */
    assert_int_equal(kvhi_f32_to_f16(1e9f), 0x7c00);
    assert_int_equal(kvhi_f32_to_f16(0x1p-24f), 0x0001);
    assert_int_equal(kvhi_f32_to_f16(0x1p-25f), 0x0000);        /* tie to even: 0 */
    assert_int_equal(kvhi_f32_to_f16(0x1.8p-24f), 0x0002);      /* tie to even: 2 */
    assert_int_equal(kvhi_f32_to_f16(1.0f + 0x1p-11f), 0x3c00); /* tie to even */
    assert_int_equal(kvhi_f32_to_f16(1.0f + 0x1p-11f + 0x1p-20f), 0x3c01);
    assert_int_equal(kvhi_f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3c02); /* tie to even: up */
}

/* The portable kernel's 4-lane widening and e^x. */
static void test_vec4_layer(void **state)
{
    (void)state;
    for (uint32_t h = 0; h < 65536; h += 4) {
        uint16_t in[4] = {(uint16_t)h, (uint16_t)(h + 1), (uint16_t)(h + 2), (uint16_t)(h + 3)};
        vf a = f16x4(in), b = bf16x4(in);
        for (int i = 0; i < 4; i++) {
            float wa = kvhi_f16_to_f32(in[i]), wb = kvhi_bf16_to_f32(in[i]);
            if (isnan(wa))
                assert_true(isnan(a[i]));
            else
                assert_int_equal(kvhi_f32_bits(a[i]), kvhi_f32_bits(wa));
            assert_int_equal(kvhi_f32_bits(b[i]), kvhi_f32_bits(wb));
        }
    }
    for (int i = -2000; i <= 100; i++) {
        float x = (float)i * 0.0625f;
        vf e = vexp(vset1(x));
        double want = exp((double)x);
        if (x < -87.3365447504f)
            assert_true(e[0] == 0.0f);
        else
            assert_true(fabs(e[0] - want) <= 4e-7 * want);
    }
    assert_true(vexp(vset1(-INFINITY))[0] == 0.0f);
    assert_true(isnan(vexp(vset1(NAN))[0]));
}

/* Independent narrowing: nearest representable value found by search in
 * double, ties to the even encoding. */
static uint16_t f16_slow(float x)
{
    if (isnan(x))
        return 0x7e00;
    double best = INFINITY;
    uint16_t bh = 0;
    uint16_t sign = signbit(x) ? 0x8000 : 0;
    double ax = fabs((double)x);
    if (ax >= 65520.0)
        return sign | 0x7c00;
    for (uint32_t h = 0; h < 0x7c00; h++) {
        double d = fabs((double)kvhi_f16_to_f32((uint16_t)h) - ax);
        if (d < best || (d == best && !(h & 1))) {
            best = d;
            bh = (uint16_t)h;
        }
    }
    return sign | bh;
}

static uint16_t bf16_slow(float x)
{
    if (isnan(x))
        return 0x7fc0;
    uint32_t u = kvhi_f32_bits(x);
    uint32_t lo = u & 0xffff0000u, hi = lo + 0x10000u;
    if ((lo & 0x7f800000u) == 0x7f800000u)
        return (uint16_t)(lo >> 16); /* already inf */
    /* past the largest finite value, the next step up is 2^128 (-> inf) */
    double vh = (hi & 0x7f800000u) == 0x7f800000u ? copysign(0x1p128, (double)x) : (double)kvhi_bits_f32(hi);
    double dl = fabs((double)kvhi_bits_f32(lo) - (double)x), dh = fabs(vh - (double)x);
    if (dl < dh || (dl == dh && !((lo >> 16) & 1)))
        return (uint16_t)(lo >> 16);
    return (uint16_t)(hi >> 16);
}

static void test_narrowing_random(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(7)};
    for (int i = 0; i < 1500; i++) {
        /* exponents around the f16 range, including subnormals and ties */
        uint32_t u = (uint32_t)tu_next(&r);
        int e = 100 + (int)tu_below(&r, 45);
        u = (u & 0x807fffffu) | ((uint32_t)e << 23);
        if (i % 3 == 0)
            u &= 0xffffe000u | 0x1000u; /* many exact ties */
        float x = kvhi_bits_f32(u);
        assert_int_equal(kvhi_f32_to_f16(x), f16_slow(x));
#if defined(__FLT16_MANT_DIG__) && defined(__x86_64__)
        _Float16 c = (_Float16)x;
        uint16_t ch;
        memcpy(&ch, &c, 2);
        assert_int_equal(kvhi_f32_to_f16(x), ch);
#endif
    }
    for (int i = 0; i < 100000; i++) {
        uint32_t u = (uint32_t)tu_next(&r);
        if (i % 4 == 0)
            u = (u & 0xffff0000u) | 0x8000u; /* ties */
        float x = kvhi_bits_f32(u);
        if (isnan(x)) {
            assert_true(isnan(kvhi_bf16_to_f32(kvhi_f32_to_bf16(x))));
            continue;
        }
        assert_int_equal(kvhi_f32_to_bf16(x), bf16_slow(x));
    }
    for (uint32_t h = 0; h < 65536; h++) {
        float f = kvhi_bf16_to_f32((uint16_t)h);
        if (!isnan(f))
            assert_int_equal(kvhi_f32_to_bf16(f), h);
    }
}

/* ---- fixture: an engine, sequences, and the test's own copy of K/V ---- */

#define MAX_SEQS 12

typedef struct fx {
    kvh_engine *e;
    uint32_t layers, Hkv, D, bt, dtype;
    uint32_t n;
    kvh_seq seqs[MAX_SEQS];
    uint32_t len[MAX_SEQS];
    float *k[MAX_SEQS]; /* [layer][t][h][d], exact values */
    float *v[MAX_SEQS];
    float vmax;
} fx;

static float rnd_val(tu_rng *r) { return (float)((int)tu_below(r, 255) - 127) / 64.0f; }

static void fx_open(fx *f, uint32_t layers, uint32_t Hkv, uint32_t D, uint32_t bt, uint32_t dtype,
                    uint64_t device_blocks, uint64_t host_blocks)
{
    memset(f, 0, sizeof(*f));
    f->layers = layers;
    f->Hkv = Hkv;
    f->D = D;
    f->bt = bt;
    f->dtype = dtype;
    f->e = tu_open(layers, Hkv, D, bt, dtype, device_blocks, host_blocks, 1);
}

static void fx_close(fx *f)
{
    for (uint32_t i = 0; i < f->n; i++) {
        tu_free(f->k[i]);
        tu_free(f->v[i]);
    }
    assert_ok(tu_close(f->e));
}

/* Writes K/V of tokens [from, to) of sequence i (all layers) from the
 * test's copy, converted to the engine dtype. */
static void fx_write(fx *f, uint32_t i, uint32_t from, uint32_t to)
{
    uint32_t row = f->Hkv * f->D, eb = tu_dtype_size(f->dtype), n = to - from;
    uint8_t *kb = tu_alloc((size_t)n * row * eb), *vb = tu_alloc((size_t)n * row * eb);
    for (uint32_t l = 0; l < f->layers; l++) {
        const float *ks = f->k[i] + ((size_t)l * f->len[i] + from) * row;
        const float *vs = f->v[i] + ((size_t)l * f->len[i] + from) * row;
        for (size_t x = 0; x < (size_t)n * row; x++) {
            kvhi_store_from_f32(f->dtype, kb, x, ks[x]);
            kvhi_store_from_f32(f->dtype, vb, x, vs[x]);
        }
        assert_ok(kvh_seq_write_kv(f->e, f->seqs[i], l, from, n, kb, vb));
    }
    tu_free(kb);
    tu_free(vb);
}

/* A new sequence of len tokens with random K/V. */
static void fx_add(fx *f, tu_rng *r, uint32_t len)
{
    assert_true(f->n < MAX_SEQS);
    uint32_t i = f->n++;
    f->len[i] = len;
    assert_ok(kvh_seq_create(f->e, 0, &f->seqs[i]));
    int32_t *tok = tu_alloc(sizeof(int32_t) * (len ? len : 1));
    for (uint32_t t = 0; t < len; t++)
        tok[t] = (int32_t)(tu_next(r) & 0x7fffffff);
    assert_ok(kvh_seq_append(f->e, f->seqs[i], tok, len));
    tu_free(tok);
    size_t cnt = (size_t)f->layers * len * f->Hkv * f->D;
    f->k[i] = tu_alloc(sizeof(float) * (cnt ? cnt : 1));
    f->v[i] = tu_alloc(sizeof(float) * (cnt ? cnt : 1));
    for (size_t x = 0; x < cnt; x++) {
        f->k[i][x] = rnd_val(r);
        f->v[i][x] = rnd_val(r);
        if (fabsf(f->v[i][x]) > f->vmax)
            f->vmax = fabsf(f->v[i][x]);
    }
    if (len)
        fx_write(f, i, 0, len);
}

/* Forks sequence src into a new one that shares its blocks, then appends
 * extra tokens to the child (copy-on-write of a shared partial block). */
static void fx_fork(fx *f, tu_rng *r, uint32_t src, uint32_t extra)
{
    assert_true(f->n < MAX_SEQS);
    uint32_t i = f->n++;
    uint32_t len = f->len[src] + extra, row = f->Hkv * f->D;
    assert_ok(kvh_seq_fork(f->e, f->seqs[src], 0, &f->seqs[i]));
    f->len[i] = len;
    size_t cnt = (size_t)f->layers * len * row;
    f->k[i] = tu_alloc(sizeof(float) * cnt);
    f->v[i] = tu_alloc(sizeof(float) * cnt);
    for (uint32_t l = 0; l < f->layers; l++)
        for (uint32_t t = 0; t < len; t++)
            for (uint32_t x = 0; x < row; x++) {
                size_t dst = ((size_t)l * len + t) * row + x;
                if (t < f->len[src]) {
                    size_t s = ((size_t)l * f->len[src] + t) * row + x;
                    f->k[i][dst] = f->k[src][s];
                    f->v[i][dst] = f->v[src][s];
                } else {
                    f->k[i][dst] = rnd_val(r);
                    f->v[i][dst] = rnd_val(r);
                }
            }
    if (extra) {
        int32_t *tok = tu_alloc(sizeof(int32_t) * extra);
        for (uint32_t t = 0; t < extra; t++)
            tok[t] = (int32_t)(tu_next(r) & 0x7fffffff);
        assert_ok(kvh_seq_append(f->e, f->seqs[i], tok, extra));
        tu_free(tok);
        fx_write(f, i, f->len[src], len);
    }
}

/* Random query/out buffers in io dtype, rows x Hq x D. */
static void *rand_q(tu_rng *r, uint32_t io, size_t elems)
{
    uint8_t *q = tu_alloc(elems * tu_dtype_size(io));
    for (size_t x = 0; x < elems; x++)
        kvhi_store_from_f32(io, q, x, rnd_val(r));
    return q;
}

static void poison(void *out, size_t bytes) { memset(out, 0xff, bytes); }

/* Naive attention in double over the test's contiguous copies. */
static void naive(const fx *f, uint32_t layer, uint32_t Hq, float scale, uint32_t io, const uint32_t *q_lens,
                  const void *q, double *res)
{
    uint32_t D = f->D, G = Hq / f->Hkv, row = f->Hkv * D;
    size_t qrow = 0;
    double *w = NULL;
    for (uint32_t i = 0; i < f->n; i++) {
        uint32_t ql = q_lens ? q_lens[i] : 1, L = f->len[i];
        w = realloc(w, sizeof(double) * (L ? L : 1));
        const float *K = f->k[i] + (size_t)layer * L * row, *V = f->v[i] + (size_t)layer * L * row;
        for (uint32_t rr = 0; rr < ql; rr++, qrow++) {
            uint32_t vis = L - ql + rr + 1;
            for (uint32_t qh = 0; qh < Hq; qh++) {
                uint32_t h = qh / G;
                size_t qo = (qrow * Hq + qh) * D;
                double mx = -INFINITY, sum = 0;
                for (uint32_t t = 0; t < vis; t++) {
                    double dot = 0;
                    for (uint32_t d = 0; d < D; d++)
                        dot += (double)kvhi_load_as_f32(io, q, qo + d) * K[((size_t)t * f->Hkv + h) * D + d];
                    w[t] = dot * scale;
                    mx = fmax(mx, w[t]);
                }
                for (uint32_t t = 0; t < vis; t++)
                    sum += (w[t] = exp(w[t] - mx));
                for (uint32_t d = 0; d < D; d++) {
                    double o = 0;
                    for (uint32_t t = 0; t < vis; t++)
                        o += w[t] * V[((size_t)t * f->Hkv + h) * D + d];
                    res[qo + d] = o / sum;
                }
            }
        }
    }
    free(w);
}

static double ulp_of(uint32_t io) { return io == KVH_DTYPE_F32 ? 0x1p-23 : io == KVH_DTYPE_F16 ? 0x1p-10 : 0x1p-7; }

/* Compares out (io dtype) with want (f32 or double via getter); returns
 * the largest error relative to the bound (<= 1 passes). */
static double check_close(const char *what, uint32_t io, const void *out, const void *want, int want_double, size_t n,
                          double rtol, double atol)
{
    double worst = 0;
    for (size_t x = 0; x < n; x++) {
        double a = kvhi_load_as_f32(io, out, x);
        double b = want_double ? ((const double *)want)[x] : kvhi_load_as_f32(io, want, x);
        if (!isfinite(a) || !isfinite(b)) {
            print_error("%s: element %zu is %g (want %g)\n", what, x, a, b);
            fail();
        }
        double bound = rtol * fabs(b) + atol;
        double e = fabs(a - b) / bound;
        if (e > worst)
            worst = e;
        if (e > 1) {
            print_error("%s: element %zu: %.9g vs %.9g (|diff| %.3g > bound %.3g)\n", what, x, a, b, fabs(a - b),
                        bound);
            fail();
        }
    }
    return worst;
}

static kvh_status run(fx *f, int impl, uint32_t layer, const uint32_t *q_lens, const kvh_attention_params *pr,
                      const void *q, void *out, size_t out_bytes)
{
    assert_ok(kvhi_attention_set_impl(f->e, impl));
    poison(out, out_bytes);
    if (q_lens)
        return kvh_attention_prefill(f->e, layer, f->seqs, q_lens, f->n, q, out, pr);
    return kvh_attention_decode(f->e, layer, f->seqs, f->n, q, out, pr);
}

/* Threads the fast variants are planned for (split-K needs several). */
static uint32_t g_split_threads = 8;

static const int fast_impls[] = {KVHI_ATTN_GENERIC, KVHI_ATTN_AVX2, KVHI_ATTN_AVX512, KVHI_ATTN_AUTO};

/* Runs the case with the reference and every fast variant; checks the
 * reference against the naive result when check_naive. */
static void compare_all(fx *f, tu_rng *r, uint32_t layer, uint32_t Hq, uint32_t io, const uint32_t *q_lens,
                        int check_naive, const char *label)
{
    size_t rows = 0;
    for (uint32_t i = 0; i < f->n; i++)
        rows += q_lens ? q_lens[i] : 1;
    size_t elems = rows * Hq * f->D, bytes = elems * tu_dtype_size(io);
    void *q = rand_q(r, io, elems);
    void *ref = tu_alloc(bytes), *out = tu_alloc(bytes);
    kvh_attention_params pr;
    assert_ok(kvh_attention_params_init(&pr, sizeof(pr)));
    pr.num_q_heads = Hq;
    pr.io_dtype = io;
    assert_ok(run(f, KVHI_ATTN_REFERENCE, layer, q_lens, &pr, q, ref, bytes));
    char what[256];
    if (check_naive) {
        double *nv = tu_alloc(sizeof(double) * elems);
        naive(f, layer, Hq, 1.0f / sqrtf((float)f->D), io, q_lens, q, nv);
        double rt = io == KVH_DTYPE_F32 ? 1e-6 : ulp_of(io) / 2 * 1.0001;
        snprintf(what, sizeof(what), "%s reference vs naive", label);
        check_close(what, io, ref, nv, 1, elems, rt, 1e-6 * f->vmax);
        tu_free(nv);
    }
    double rtol = io == KVH_DTYPE_F32 ? 1e-5 : ulp_of(io), atol = 1e-5 * f->vmax;
    for (size_t k = 0; k < sizeof(fast_impls) / sizeof(fast_impls[0]); k++) {
        if (!kvhi_attn_cpu_supported(fast_impls[k]))
            continue;
        uint32_t thread_opts[2] = {1, g_split_threads};
        for (int t = 0; t < (fast_impls[k] == KVHI_ATTN_AUTO ? 2 : 1); t++) {
            pr.threads = fast_impls[k] == KVHI_ATTN_AUTO ? thread_opts[t] : g_split_threads;
            assert_ok(run(f, fast_impls[k], layer, q_lens, &pr, q, out, bytes));
            snprintf(what, sizeof(what), "%s impl %d threads %u", label, fast_impls[k], pr.threads);
            double worst = check_close(what, io, out, ref, 0, elems, rtol, atol);
            if (getenv("KVH_ATTN_VERBOSE"))
                print_message("%s: worst error %.3f of the bound\n", what, worst);
        }
    }
    tu_free(q);
    tu_free(ref);
    tu_free(out);
}

/* ---- the reference against naive double ---- */

static void test_reference_vs_naive(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(11)};
    static const struct {
        uint32_t D, bt, dtype, io, Hkv, G;
    } cases[] = {
        {64, 16, KVH_DTYPE_F32, KVH_DTYPE_F32, 2, 2},
        {128, 32, KVH_DTYPE_F16, KVH_DTYPE_F16, 1, 4},
        {80, 16, KVH_DTYPE_BF16, KVH_DTYPE_BF16, 2, 1},
        {7, 4, KVH_DTYPE_F16, KVH_DTYPE_F32, 1, 3},
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        fx f;
        fx_open(&f, 2, cases[c].Hkv, cases[c].D, cases[c].bt, cases[c].dtype, 256, 0);
        fx_add(&f, &r, 1);
        fx_add(&f, &r, cases[c].bt);
        fx_add(&f, &r, 3 * cases[c].bt + 5);
        fx_add(&f, &r, 700);
        char label[64];
        snprintf(label, sizeof(label), "naive case %zu decode", c);
        compare_all(&f, &r, 1, cases[c].Hkv * cases[c].G, cases[c].io, NULL, 1, label);
        uint32_t ql[4] = {1, cases[c].bt, 7, 40};
        snprintf(label, sizeof(label), "naive case %zu prefill", c);
        compare_all(&f, &r, 1, cases[c].Hkv * cases[c].G, cases[c].io, ql, 1, label);
        fx_close(&f);
    }
}

/* ---- the sweep: fast kernels against the reference ---- */

static void test_sweep(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(12345)};
    static const uint32_t dims[] = {64, 80, 96, 128, 256, 8, 24, 40, 5};
    static const uint32_t bts[] = {16, 32, 16, 32, 1, 4, 64};
    static const uint32_t gqa[] = {1, 2, 4, 8, 3, 40};
    static const uint32_t lens[] = {1, 2, 15, 16, 17, 31, 32, 33, 100, 257, 1000, 2500};
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    int cases = 14; /* sanitizers make the reference runs slow */
#else
    int cases = 36;
#endif
    if (getenv("KVH_ATTN_SWEEP"))
        cases = atoi(getenv("KVH_ATTN_SWEEP"));
    for (int c = 0; c < cases; c++) {
        uint32_t D = dims[c % 9 < 5 ? (uint32_t)(c % 5) : (uint32_t)tu_below(&r, 9)];
        uint32_t bt = bts[tu_below(&r, c % 4 == 3 ? 7 : 4)];
        uint32_t dtype = (uint32_t)tu_below(&r, 3), io = (uint32_t)tu_below(&r, 3);
        uint32_t Hkv = 1 + (uint32_t)tu_below(&r, 2), G = gqa[tu_below(&r, c % 6 == 5 ? 6 : 5)];
        if (D >= 256 && G > 8)
            G = 8;
        fx f;
        fx_open(&f, 2, Hkv, D, bt, dtype, 2048 * 16 / bt + 64, 0);
        uint32_t n = 1 + (uint32_t)tu_below(&r, 4);
        uint32_t ql[MAX_SEQS];
        for (uint32_t i = 0; i < n; i++) {
            uint32_t len = lens[tu_below(&r, 12)];
            if (D * G > 2048 && len > 1000)
                len = 257;
            fx_add(&f, &r, len);
            ql[i] = 1 + (uint32_t)tu_below(&r, len < 24 ? len : 24);
        }
        if (tu_below(&r, 3) == 0) { /* forks sharing blocks */
            fx_fork(&f, &r, 0, (uint32_t)tu_below(&r, 2 * bt + 2));
            ql[f.n - 1] = 1;
        }
        char label[160];
        snprintf(label, sizeof(label), "sweep %d: D %u bt %u kv %u io %u Hkv %u G %u n %u (len0 %u)", c, D, bt, dtype,
                 io, Hkv, G, f.n, f.len[0]);
        compare_all(&f, &r, c & 1, Hkv * G, io, NULL, 0, label);
        strcat(label, " prefill");
        compare_all(&f, &r, c & 1, Hkv * G, io, ql, 0, label);
        fx_close(&f);
    }
}

/* Long context: split-K with many chunks, and a prefill chunk whose rows
 * straddle chunk boundaries. */
static void test_long_context(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(99)};
    fx f;
    fx_open(&f, 1, 2, 128, 16, KVH_DTYPE_F16, 9600 / 16 + 64, 0);
    fx_add(&f, &r, 8200);
    fx_add(&f, &r, 300);
    fx_add(&f, &r, 1000);
    compare_all(&f, &r, 0, 8, KVH_DTYPE_F32, NULL, 1, "long decode");
    /* planned for 1024 threads: 256-token chunks, so the 300 rows of the
     * third sequence (positions 700..999) straddle a chunk boundary */
    g_split_threads = 1024;
    uint32_t ql[3] = {64, 3, 300};
    compare_all(&f, &r, 0, 8, KVH_DTYPE_BF16, ql, 0, "long prefill");
    compare_all(&f, &r, 0, 8, KVH_DTYPE_F32, NULL, 0, "long decode, many chunks");
    g_split_threads = 8;
}

/* Forks: children sharing every block (and a CoW'd tail) in one batch. */
static void test_forks(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(5)};
    fx f;
    fx_open(&f, 2, 2, 64, 16, KVH_DTYPE_BF16, 512, 0);
    fx_add(&f, &r, 75);
    fx_fork(&f, &r, 0, 0);  /* identical */
    fx_fork(&f, &r, 0, 3);  /* CoW of the shared partial block */
    fx_fork(&f, &r, 0, 40); /* crosses into new blocks */
    fx_fork(&f, &r, 2, 1);  /* fork of a fork */
    compare_all(&f, &r, 1, 4, KVH_DTYPE_F16, NULL, 1, "forks decode");
    uint32_t ql[5] = {5, 1, 4, 40, 2};
    compare_all(&f, &r, 0, 4, KVH_DTYPE_F32, ql, 1, "forks prefill");
    /* the parent is unchanged by its children's writes */
    kvh_block_info bi = tu_seq_binfo(f.e, f.seqs[1], 0);
    assert_true(bi.refs >= 2);
    assert_int_equal(bi.holds, 0);
}

/* ---- bad input, residency, holds ---- */

static void test_bad_input(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(3)};
    fx f;
    fx_open(&f, 2, 2, 64, 16, KVH_DTYPE_F16, 64, 64);
    fx_add(&f, &r, 40);
    fx_add(&f, &r, 20);
    float q[2 * 4 * 64] = {0}, out[2 * 4 * 64];
    kvh_attention_params pr;
    assert_ok(kvh_attention_params_init(&pr, sizeof(pr)));
    assert_int_equal(pr.struct_size, sizeof(pr));
    assert_int_equal(pr.io_dtype, KVH_DTYPE_F32);
    assert_int_equal(pr.num_q_heads, 0);
    assert_true(pr.stream == NULL);
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_attention_params_init(&pr, sizeof(pr) - 4));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_params_init(NULL, sizeof(pr)));

    pr.num_q_heads = 4;
    assert_ok(kvh_attention_decode(f.e, 1, f.seqs, 2, q, out, &pr));
    assert_ok(kvh_attention_decode(f.e, 0, f.seqs, 2, q, out, NULL)); /* defaults: Hq = Hkv */
    assert_kvh(KVH_ERR_RANGE, kvh_attention_decode(f.e, 2, f.seqs, 2, q, out, &pr));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_decode(NULL, 0, f.seqs, 2, q, out, &pr));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_decode(f.e, 0, NULL, 2, q, out, &pr));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_decode(f.e, 0, f.seqs, 2, NULL, out, &pr));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_decode(f.e, 0, f.seqs, 2, q, NULL, &pr));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_prefill(f.e, 0, f.seqs, NULL, 2, q, out, &pr));
    assert_ok(kvh_attention_decode(f.e, 0, f.seqs, 0, NULL, NULL, &pr)); /* empty batch */
    pr.num_q_heads = 3;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_decode(f.e, 0, f.seqs, 2, q, out, &pr));
    pr.num_q_heads = 4;
    pr.io_dtype = 7;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_decode(f.e, 0, f.seqs, 2, q, out, &pr));
    pr.io_dtype = KVH_DTYPE_F32;
    pr.scale = NAN;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_decode(f.e, 0, f.seqs, 2, q, out, &pr));
    pr.scale = 0;
    pr.struct_size = sizeof(pr) + 8;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_attention_decode(f.e, 0, f.seqs, 2, q, out, &pr));
    pr.struct_size = 4;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_attention_prefill(f.e, 0, f.seqs, (uint32_t[]){1, 1}, 2, q, out, &pr));
    pr.struct_size = sizeof(pr);

    /* bad handles, empty sequences, prefill longer than the sequence */
    kvh_seq gone;
    assert_ok(kvh_seq_create(f.e, 0, &gone));
    assert_ok(kvh_seq_free(f.e, gone));
    kvh_seq bad[2] = {f.seqs[0], gone};
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_attention_decode(f.e, 0, bad, 2, q, out, &pr));
    kvh_seq empty;
    assert_ok(kvh_seq_create(f.e, 0, &empty));
    kvh_seq with_empty[2] = {f.seqs[0], empty};
    assert_kvh(KVH_ERR_RANGE, kvh_attention_decode(f.e, 0, with_empty, 2, q, out, &pr));
    assert_ok(kvh_attention_prefill(f.e, 0, with_empty, (uint32_t[]){1, 0}, 2, q, out, &pr));
    assert_kvh(KVH_ERR_RANGE, kvh_attention_prefill(f.e, 0, f.seqs, (uint32_t[]){41, 1}, 2, q, out, &pr));
    assert_ok(kvh_seq_free(f.e, empty));

    /* not resident: move sequence 1 to the host tier */
    assert_ok(kvh_seq_migrate(f.e, f.seqs[1], 0, 20, KVH_TIER_HOST, NULL));
    assert_int_equal(tu_seq_binfo(f.e, f.seqs[1], 0).tier, KVH_TIER_HOST);
    assert_kvh(KVH_ERR_NOT_RESIDENT, kvh_attention_decode(f.e, 0, f.seqs, 2, q, out, &pr));
    assert_int_equal(tu_seq_binfo(f.e, f.seqs[0], 0).holds, 0); /* nothing left held */
    assert_int_equal(tu_seq_binfo(f.e, f.seqs[1], 0).holds, 0);
    assert_ok(kvh_seq_acquire(f.e, f.seqs[1], 0, 20, NULL));
    poison(out, sizeof(out));
    assert_ok(kvh_attention_decode(f.e, 0, f.seqs, 2, q, out, &pr));
    for (size_t x = 0; x < sizeof(out) / sizeof(out[0]); x++)
        assert_false(isnan(out[x]));
    assert_int_equal(tu_seq_binfo(f.e, f.seqs[1], 0).holds, 1); /* the acquire's */
    assert_int_equal(tu_seq_binfo(f.e, f.seqs[0], 2).holds, 0);
    assert_ok(kvh_seq_release(f.e, f.seqs[1], 0, 20));
    assert_int_equal(tu_seq_binfo(f.e, f.seqs[1], 0).holds, 0);
}

/* Several threads running attention on one engine at once. */
typedef struct mt_arg {
    fx *f;
    const void *q;
    const float *want;
    size_t elems;
    int ok;
} mt_arg;

static void *mt_main(void *varg)
{
    mt_arg *a = varg;
    float *out = malloc(a->elems * sizeof(float));
    kvh_attention_params pr;
    kvh_attention_params_init(&pr, sizeof(pr));
    pr.num_q_heads = 4;
    a->ok = out != NULL;
    for (int it = 0; it < 20 && a->ok; it++) {
        poison(out, a->elems * sizeof(float));
        pr.threads = 1 + (uint32_t)(it % 3);
        if (kvh_attention_decode(a->f->e, 0, a->f->seqs, a->f->n, a->q, out, &pr) != KVH_OK)
            a->ok = 0;
        for (size_t x = 0; x < a->elems && a->ok; x++)
            if (!(fabsf(out[x] - a->want[x]) <= 1e-5f * fabsf(a->want[x]) + 1e-5f))
                a->ok = 0;
    }
    free(out);
    return NULL;
}

static void test_concurrent_calls(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(8)};
    fx f;
    fx_open(&f, 1, 2, 64, 16, KVH_DTYPE_F16, 256, 0);
    fx_add(&f, &r, 900);
    fx_add(&f, &r, 33);
    size_t elems = 2 * 4 * 64;
    void *q = rand_q(&r, KVH_DTYPE_F32, elems);
    float *want = tu_alloc(elems * sizeof(float));
    kvh_attention_params pr;
    assert_ok(kvh_attention_params_init(&pr, sizeof(pr)));
    pr.num_q_heads = 4;
    pr.threads = 1;
    assert_ok(kvh_attention_decode(f.e, 0, f.seqs, 2, q, want, &pr));
    pthread_t th[4];
    mt_arg a[4];
    for (int i = 0; i < 4; i++) {
        a[i] = (mt_arg){.f = &f, .q = q, .want = want, .elems = elems};
        pthread_create(&th[i], NULL, mt_main, &a[i]);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        assert_true(a[i].ok);
    }
}

/* The plan: split-K appears for long sequences, chunks are whole blocks
 * and cover every token exactly once. */
static void test_plan_split(void **state)
{
    (void)state;
    kvhi_attn_plan p;
    memset(&p, 0, sizeof(p));
    p.num_q_heads = 8;
    p.num_kv_heads = 2;
    p.head_dim = 64;
    p.block_tokens = 16;
    kvhi_attn_plan_opts o = {.max_queries = 16, .target_units = 64, .min_chunk_tokens = 64};
    uint32_t kv[3] = {5000, 17, 1}, ql[3] = {1, 1, 1};
    assert_int_equal(kvhi_attn_plan_build(&p, &o, kv, ql, 3), 0);
    assert_int_equal(p.n_slots, 313 + 2 + 1);
    assert_true(p.seqs[0].n_chunks > 1);
    assert_int_equal(p.seqs[0].chunk_tokens % 16, 0);
    assert_int_equal(p.seqs[1].n_chunks, 1);
    assert_int_equal(p.n_merges, 1);
    uint32_t covered[2] = {0, 0};
    for (uint32_t u = 0; u < p.n_units; u++)
        if (p.units[u].seq == 0) {
            assert_true(p.units[u].k0 < p.units[u].k1);
            covered[p.units[u].kv_head] += p.units[u].k1 - p.units[u].k0;
        }
    assert_int_equal(covered[0], 5000);
    assert_int_equal(covered[1], 5000);
    kvhi_attn_plan_free(&p);
}

static void done_count(void *arg) { (*(int *)arg)++; }

/* Chunks that start inside a block: a contiguous array seen as one block
 * per sequence (what the benchmark's contiguous baseline runs), split into
 * 16-token granules. Kernels run directly on a hand-made plan. */
static void test_unaligned_chunks(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(21)};
    const uint32_t Hkv = 2, D = 64, bt = 1024, Hq = 6;
    const uint64_t bb = 2ull * Hkv * bt * D * 2;
    uint16_t *kv = tu_alloc(2 * bb);
    for (uint64_t x = 0; x < bb; x++) /* two blocks of f16 */
        kv[x] = kvhi_f32_to_f16(rnd_val(&r));
    kvhi_attn_plan p;
    memset(&p, 0, sizeof(p));
    p.num_q_heads = Hq;
    p.num_kv_heads = Hkv;
    p.head_dim = D;
    p.block_tokens = bt;
    p.block_shift = 10;
    p.kv_dtype = KVH_DTYPE_F16;
    p.io_dtype = KVH_DTYPE_F32;
    p.scale = 0.125f;
    p.block_bytes = bb;
    p.kv_base = kv;
    kvhi_attn_plan_opts o = {.max_queries = 8, .target_units = 400, .min_chunk_tokens = 48, .chunk_quantum = 16};
    uint32_t kvl[2] = {1000, 700}, ql[2] = {1, 100};
    assert_int_equal(kvhi_attn_plan_build(&p, &o, kvl, ql, 2), 0);
    p.slots[0] = 0;
    p.slots[1] = 1;
    assert_true(p.seqs[0].n_chunks > 2);
    assert_int_equal(p.seqs[0].chunk_tokens % 16, 0);
    assert_true(p.seqs[0].chunk_tokens % bt != 0);
    size_t elems = 101 * Hq * D;
    float *q = rand_q(&r, KVH_DTYPE_F32, elems), *ref = tu_alloc(elems * 4), *out = tu_alloc(elems * 4);
    poison(ref, elems * 4);
    assert_int_equal(kvhi_attn_reference(&p, q, ref), 0);
    kvhi_attn_cpu *cs = kvhi_attn_cpu_create();
    assert_non_null(cs);
    p.cpu_state = cs;
    p.threads = 3;
    for (size_t k = 0; k < sizeof(fast_impls) / sizeof(fast_impls[0]); k++) {
        if (!kvhi_attn_cpu_supported(fast_impls[k]))
            continue;
        cs->impl = fast_impls[k];
        poison(out, elems * 4);
        int calls = 0;
        char msg[128];
        assert_int_equal(kvhi_attn_cpu_run(NULL, &p, q, out, NULL, done_count, &calls, msg, sizeof(msg)), 0);
        assert_int_equal(calls, 1);
        check_close("unaligned chunks", KVH_DTYPE_F32, out, ref, 0, elems, 1e-5, 2e-5);
    }
    kvhi_attn_cpu_destroy(cs);
    kvhi_attn_plan_free(&p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_f16_roundtrip, tu_teardown),
        cmocka_unit_test_teardown(test_narrowing_random, tu_teardown),
        cmocka_unit_test_teardown(test_vec4_layer, tu_teardown),
        cmocka_unit_test_teardown(test_plan_split, tu_teardown),
        cmocka_unit_test_teardown(test_unaligned_chunks, tu_teardown),
        cmocka_unit_test_teardown(test_reference_vs_naive, tu_teardown),
        cmocka_unit_test_teardown(test_forks, tu_teardown),
        cmocka_unit_test_teardown(test_bad_input, tu_teardown),
        cmocka_unit_test_teardown(test_concurrent_calls, tu_teardown),
        cmocka_unit_test_teardown(test_long_context, tu_teardown),
        cmocka_unit_test_teardown(test_sweep, tu_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
