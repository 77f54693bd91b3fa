/* Paged attention, attention plans and virtual-contiguity views against a
 * hostile caller, from kvh.h's promises alone ("Paged attention",
 * "Attention plans", "Virtual contiguity"). Every refused call must return
 * its documented status with a kvh_last_error() message, leave the output
 * buffer, the out-pointer and the engine (lengths, block tiers, slots,
 * references, pins, holds) as they were. Every accepted call must match a
 * plain double-precision softmax attention computed here from the K/V the
 * test wrote (values chosen exact in f16 and bf16, so the only rounding is
 * the kernels' own and the output's). */
#include <float.h>
#include <limits.h>
#include <math.h>

#include "test_util.h"
#include "disk_test_util.h"
#include "kernels/attention_dtype.h"

/* f32, head_dim 64, 16 tokens: one head's K of a block is one 4 KiB page,
 * as views need. */
enum { L = 2, H = 2, D = 64, BT = 16, MAXT = 160, MAXQH = 8 };

/* ---- f16 / bf16 ---- */

static size_t dsize(uint32_t dt) { return dt == KVH_DTYPE_F32 ? 4 : 2; }

static void to_dtype(uint32_t dt, const float *src, void *dst, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (dt == KVH_DTYPE_F32)
            ((float *)dst)[i] = src[i];
        else if (dt == KVH_DTYPE_F16)
            ((uint16_t *)dst)[i] = tu_f32_to_f16(src[i]);
        else
            ((uint16_t *)dst)[i] = tu_f32_to_bf16(src[i]);
    }
}

static float from_dtype(uint32_t dt, const void *src, size_t i)
{
    if (dt == KVH_DTYPE_F32)
        return ((const float *)src)[i];
    if (dt == KVH_DTYPE_F16)
        return tu_f16_to_f32(((const uint16_t *)src)[i]);
    return tu_bf16_to_f32(((const uint16_t *)src)[i]);
}

/* ---- the test's own copy of a sequence's K/V ---- */

typedef struct kv_model {
    uint32_t len;
    float k[L][MAXT][H][D];
    float v[L][MAXT][H][D];
} kv_model;

/* k/64 with |k| <= 128: exact in f32, f16 and bf16. */
static float kv_val(uint64_t stream, uint32_t layer, uint64_t pos, uint32_t h, int kv, uint32_t d)
{
    tu_rng r = {stream * 0x100000001b3ull ^ ((uint64_t)layer << 52) ^ (pos << 20) ^ ((uint64_t)h << 12) ^
                ((uint64_t)kv << 10) ^ d};
    tu_next(&r);
    return (float)((int64_t)tu_below(&r, 257) - 128) / 64.0f;
}

static void model_set(kv_model *m, uint64_t pos, uint64_t stream)
{
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t h = 0; h < H; h++)
            for (uint32_t d = 0; d < D; d++) {
                m->k[l][pos][h][d] = kv_val(stream, l, pos, h, 0, d);
                m->v[l][pos][h][d] = kv_val(stream, l, pos, h, 1, d);
            }
}

static void write_range(kvh_engine *e, uint32_t dtype, kvh_seq s, const kv_model *m, uint32_t pos, uint32_t n)
{
    size_t cnt = (size_t)n * H * D;
    void *kb = tu_alloc(cnt * 4), *vb = tu_alloc(cnt * 4);
    for (uint32_t l = 0; l < L; l++) {
        to_dtype(dtype, &m->k[l][pos][0][0], kb, cnt);
        to_dtype(dtype, &m->v[l][pos][0][0], vb, cnt);
        assert_ok(kvh_seq_write_kv(e, s, l, pos, n, kb, vb));
    }
    tu_free(kb);
    tu_free(vb);
}

/* Appends n tokens to s (and m) with K/V of stream written in every layer. */
static void seq_extend(kvh_engine *e, uint32_t dtype, kvh_seq s, kv_model *m, uint32_t n, uint64_t stream)
{
    assert_true(m->len + n <= MAXT);
    int32_t tok[MAXT];
    for (uint32_t i = 0; i < n; i++)
        tok[i] = (int32_t)((stream * 7919u + m->len + i) & 0x3fffffff);
    assert_ok(kvh_seq_append(e, s, tok, n));
    for (uint32_t i = 0; i < n; i++)
        model_set(m, m->len + i, stream);
    write_range(e, dtype, s, m, m->len, n);
    m->len += n;
}

static kvh_seq seq_make(kvh_engine *e, uint32_t dtype, kv_model **mp, uint32_t n, uint64_t stream)
{
    kv_model *m = tu_alloc(sizeof(*m));
    kvh_seq s = tu_seq_new(e, 0);
    seq_extend(e, dtype, s, m, n, stream);
    *mp = m;
    return s;
}

static kv_model *model_copy(const kv_model *m)
{
    kv_model *c = tu_alloc(sizeof(*c));
    memcpy(c, m, sizeof(*c));
    return c;
}

/* ---- the reference ---- */

/* Softmax attention in double of one query row (qh heads of D) over tokens
 * [0, end) of layer; q head h reads kv head h / (qh / H). */
static void ref_attend(const kv_model *m, uint32_t layer, const float *q, uint32_t qh, double scale, uint32_t end,
                       double *out)
{
    uint32_t group = qh / H;
    double s[MAXT];
    for (uint32_t h = 0; h < qh; h++) {
        uint32_t kh = h / group;
        double mx = -INFINITY, sum = 0;
        for (uint32_t t = 0; t < end; t++) {
            double dot = 0;
            for (uint32_t d = 0; d < D; d++)
                dot += (double)q[h * D + d] * m->k[layer][t][kh][d];
            s[t] = dot * scale;
            if (s[t] > mx)
                mx = s[t];
        }
        for (uint32_t t = 0; t < end; t++) {
            s[t] = exp(s[t] - mx);
            sum += s[t];
        }
        for (uint32_t d = 0; d < D; d++) {
            double acc = 0;
            for (uint32_t t = 0; t < end; t++)
                acc += s[t] * m->v[layer][t][kh][d];
            out[h * D + d] = acc / sum;
        }
    }
}

static double eff_scale(float scale) { return scale == 0.0f ? 1.0 / sqrt((double)D) : (double)scale; }

/* Decode rows (q_lens NULL) or the concatenated prefill chunks of a batch. */
static size_t ref_batch(kv_model *const *ms, const uint32_t *q_lens, size_t n, uint32_t layer, const float *q,
                        uint32_t qh, float scale, double *out)
{
    size_t row = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t ql = q_lens ? q_lens[i] : 1;
        for (uint32_t j = 0; j < ql; j++, row++)
            ref_attend(ms[i], layer, q + row * qh * D, qh, eff_scale(scale), ms[i]->len - ql + j + 1,
                       out + row * qh * D);
    }
    return row;
}

static double tol_of(uint32_t io) { return io == KVH_DTYPE_F32 ? 1e-4 : io == KVH_DTYPE_F16 ? 4e-3 : 3e-2; }

#define assert_out_near(out, io, ref, n) assert_true(out_near_at(__FILE__, __LINE__, out, io, ref, n))
static int out_near_at(const char *file, int line, const void *out, uint32_t io, const double *ref, size_t n)
{
    double tol = tol_of(io);
    for (size_t i = 0; i < n; i++) {
        double got = from_dtype(io, out, i);
        if (!(fabs(got - ref[i]) <= tol)) {
            print_error("%s:%d: output element %zu (row %zu, head-dim %zu) is %.8g, reference %.8g\n", file, line, i,
                        i / D, i % D, got, ref[i]);
            return 0;
        }
    }
    return 1;
}

static void make_q(tu_rng *r, float *q, size_t n)
{
    for (size_t i = 0; i < n; i++)
        q[i] = (float)((int64_t)tu_below(r, 257) - 128) / 256.0f;
}

static kvh_attention_params params(uint32_t qh, float scale, uint32_t io)
{
    kvh_attention_params p;
    assert_ok(kvh_attention_params_init(&p, sizeof(p)));
    p.num_q_heads = qh;
    p.scale = scale;
    p.io_dtype = io;
    p.threads = 2;
    return p;
}

/* ---- "nothing changed" ---- */

typedef struct snap {
    size_t n;
    uint64_t v[1024];
} snap;

static void snap_push(snap *s, uint64_t x)
{
    if (s->n < 1024)
        s->v[s->n++] = x;
}

/* Lengths and every block's tier, slot, references, pins, holds and tokens
 * of the sequences, and the memory tiers' occupancy. */
static void snap_take(kvh_engine *e, const kvh_seq *seqs, size_t ns, snap *s)
{
    s->n = 0;
    for (size_t i = 0; i < ns; i++) {
        uint64_t len = 0;
        kvh_status st = kvh_seq_length(e, seqs[i], &len);
        snap_push(s, (uint64_t)(int64_t)st);
        snap_push(s, len);
        for (uint64_t b = 0; st == KVH_OK && b < (len + BT - 1) / BT; b++) {
            kvh_block blk = {0};
            snap_push(s, (uint64_t)(int64_t)kvh_seq_blocks(e, seqs[i], b, 1, &blk));
            kvh_block_info bi;
            memset(&bi, 0, sizeof(bi));
            bi.struct_size = sizeof(bi);
            snap_push(s, (uint64_t)(int64_t)kvh_block_info_get(e, blk, &bi));
            snap_push(s, blk.id);
            snap_push(s, bi.tier);
            snap_push(s, bi.slot);
            snap_push(s, bi.refs);
            snap_push(s, bi.pins);
            snap_push(s, bi.holds);
            snap_push(s, bi.tokens);
        }
    }
    for (uint32_t t = KVH_TIER_DEVICE; t <= KVH_TIER_HOST; t++) {
        kvh_tier_info ti;
        memset(&ti, 0, sizeof(ti));
        ti.struct_size = sizeof(ti);
        snap_push(s, (uint64_t)(int64_t)kvh_tier_info_get(e, t, &ti));
        snap_push(s, ti.used_blocks);
        snap_push(s, ti.pinned_blocks);
    }
}

enum { SENTINEL = 0x7b };

/* The scene of a misuse: the engine, the sequences whose state must not
 * change, and the output buffer that must keep its sentinel bytes. */
typedef struct scene {
    kvh_engine *e;
    const kvh_seq *seqs;
    size_t ns;
    void *out;
    size_t out_bytes;
    snap before;
} scene;

static void scene_begin(scene *c)
{
    snap_take(c->e, c->seqs, c->ns, &c->before);
    memset(c->out, SENTINEL, c->out_bytes);
}

/* want < 0 accepts want or also_ok (a second acceptable status, or 1 for
 * none). */
static void scene_end_at(const char *file, int line, scene *c, kvh_status want, kvh_status also, kvh_status got,
                         const char *what)
{
    char msg[256];
    snprintf(msg, sizeof(msg), "%s", kvh_last_error());
    if (got != want && got != also) {
        print_error("%s:%d: %s\n    returned %s (%d), expected %s; last error: \"%s\"\n", file, line, what,
                    kvh_status_name(got), (int)got, kvh_status_name(want), msg);
        _fail(file, line);
    }
    if (got != KVH_OK && !msg[0]) {
        print_error("%s:%d: %s failed with %s and an empty kvh_last_error()\n", file, line, what, kvh_status_name(got));
        _fail(file, line);
    }
    for (size_t i = 0; i < c->out_bytes; i++)
        if (((const uint8_t *)c->out)[i] != SENTINEL) {
            print_error("%s:%d: %s (%s) wrote output byte %zu\n", file, line, what, kvh_status_name(got), i);
            _fail(file, line);
        }
    snap after;
    snap_take(c->e, c->seqs, c->ns, &after);
    if (after.n != c->before.n || memcmp(after.v, c->before.v, after.n * sizeof(uint64_t)) != 0) {
        size_t i = 0;
        while (i < after.n && i < c->before.n && after.v[i] == c->before.v[i])
            i++;
        print_error("%s:%d: %s (%s) changed the engine's state (entry %zu: %" PRIu64 " -> %" PRIu64 ")\n", file, line,
                    what, kvh_status_name(got), i, i < c->before.n ? c->before.v[i] : 0, i < after.n ? after.v[i] : 0);
        _fail(file, line);
    }
}

/* A call that must fail with want and change nothing. */
#define MISUSE(c, want, expr)                                                                                          \
    do {                                                                                                               \
        scene_begin(c);                                                                                                \
        kvh_status ms_st_ = (expr);                                                                                    \
        scene_end_at(__FILE__, __LINE__, c, want, 1, ms_st_, #expr);                                                   \
    } while (0)
/* The same, where the header allows either of two statuses. */
#define MISUSE2(c, want, also, expr)                                                                                   \
    do {                                                                                                               \
        scene_begin(c);                                                                                                \
        kvh_status ms_st_ = (expr);                                                                                    \
        scene_end_at(__FILE__, __LINE__, c, want, also, ms_st_, #expr);                                                \
    } while (0)

static kvh_engine *open_plain(uint32_t dtype, uint64_t dev_blocks, uint64_t host_blocks)
{
    return tu_open(L, H, D, BT, dtype, dev_blocks, host_blocks, 1);
}

static kvh_engine *open_vmap(uint64_t dev_blocks, uint64_t host_blocks)
{
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F32, dev_blocks, host_blocks, 1);
    c.vmap = 1;
    return tu_open_cfg(&c);
}

static kvh_block seq_block(kvh_engine *e, kvh_seq s, uint64_t i) { return tu_seq_block(e, s, i); }

static uint32_t block_tier(kvh_engine *e, kvh_seq s, uint64_t i) { return tu_seq_binfo(e, s, i).tier; }

/* ================================================================== */
/* Paged attention                                                    */
/* ================================================================== */

/* kvh_attention_params_init: every size but 8..sizeof in steps of 8 is
 * refused with nothing written; a valid smaller size writes only its own
 * bytes. */
static void test_params_init_struct_sizes(void **state)
{
    (void)state;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_params_init(NULL, sizeof(kvh_attention_params)));
    assert_true(kvh_last_error()[0] != 0);
    const size_t bad[] = {0, 1, 4, 7, 12, 20, 36, 41, sizeof(kvh_attention_params) + 8, 4096, SIZE_MAX};
    uint8_t buf[sizeof(kvh_attention_params) + 64];
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        memset(buf, 0xcd, sizeof(buf));
        kvh_status st = kvh_attention_params_init((kvh_attention_params *)(void *)buf, bad[i]);
        if (st != KVH_ERR_STRUCT_SIZE)
            fail_msg("size %zu: %s", bad[i], kvh_status_name(st));
        assert_true(kvh_last_error()[0] != 0);
        for (size_t j = 0; j < sizeof(buf); j++)
            assert_int_equal(buf[j], 0xcd);
    }
    for (size_t sz = 8; sz <= sizeof(kvh_attention_params); sz += 8) {
        memset(buf, 0xcd, sizeof(buf));
        assert_ok(kvh_attention_params_init((kvh_attention_params *)(void *)buf, sz));
        uint32_t got_size;
        memcpy(&got_size, buf, 4);
        assert_int_equal(got_size, sz);
        for (size_t j = sz; j < sizeof(buf); j++)
            assert_int_equal(buf[j], 0xcd);
    }
    kvh_attention_params p;
    memset(&p, 0xee, sizeof(p));
    assert_ok(kvh_attention_params_init(&p, sizeof(p)));
    assert_int_equal(p.num_q_heads, 0);
    assert_true(p.scale == 0.0f);
    assert_int_equal(p.io_dtype, KVH_DTYPE_F32);
    assert_int_equal(p.stream_chunk_blocks, 0);
    assert_null(p.stream);
}

/* Decode over a batch (lengths across block edges, a fork with its own
 * tail, the same sequence twice) for every engine dtype and io_dtype, with
 * GQA and default, negative and explicit scales. */
static void test_decode_matches_reference_all_dtypes(void **state)
{
    (void)state;
    const uint32_t dtypes[] = {KVH_DTYPE_F32, KVH_DTYPE_F16, KVH_DTYPE_BF16};
    tu_rng r = {tu_seed(0xa77e01)};
    for (int di = 0; di < 3; di++) {
        uint32_t dt = dtypes[di];
        kvh_engine *e = open_plain(dt, 64, 0);
        kv_model *ma, *mb;
        kvh_seq a = seq_make(e, dt, &ma, 37, 1 + di);
        kvh_seq b = seq_make(e, dt, &mb, 1, 11 + di);
        kvh_seq c;
        assert_ok(kvh_seq_fork(e, a, 0, &c));
        kv_model *mc = model_copy(ma);
        seq_extend(e, dt, c, mc, 30, 21 + di); /* copies a's shared last block */
        kvh_seq batch[] = {a, b, c, a};
        kv_model *ms[] = {ma, mb, mc, ma};
        for (int io = 0; io < 3; io++) {
            const uint32_t qhs[] = {0, H, 2 * H, 4 * H};
            const float scales[] = {0.0f, -0.3f, 0.5f, 0.01f};
            for (int k = 0; k < 4; k++) {
                uint32_t qh = qhs[k] ? qhs[k] : H;
                kvh_attention_params p = params(qhs[k], scales[k], dtypes[io]);
                for (uint32_t layer = 0; layer < L; layer++) {
                    float q[4 * MAXQH * D];
                    make_q(&r, q, 4 * (size_t)qh * D);
                    uint8_t qb[4 * MAXQH * D * 4], ob[4 * MAXQH * D * 4];
                    to_dtype(dtypes[io], q, qb, 4 * (size_t)qh * D);
                    memset(ob, 0xff, sizeof(ob));
                    assert_ok(kvh_attention_decode(e, layer, batch, 4, qb, ob, &p));
                    double ref[4 * MAXQH * D];
                    size_t rows = ref_batch(ms, NULL, 4, layer, q, qh, scales[k], ref);
                    assert_out_near(ob, dtypes[io], ref, rows * qh * D);
                    /* nothing written past the batch's rows */
                    for (size_t j = rows * qh * D * dsize(dtypes[io]); j < sizeof(ob); j++)
                        assert_int_equal(ob[j], 0xff);
                }
            }
        }
        /* the fork's copy-on-write left a as it was */
        kvh_attention_params p = params(0, 0, KVH_DTYPE_F32);
        float q[H * D], out[H * D];
        double ref[H * D];
        make_q(&r, q, H * D);
        assert_ok(kvh_attention_decode(e, 1, &a, 1, q, out, &p));
        ref_batch(&ma, NULL, 1, 1, q, H, 0, ref);
        assert_out_near(out, KVH_DTYPE_F32, ref, H * D);
        assert_ok(tu_close(e));
    }
}

/* Chunked causal prefill: chunks of 1, a whole sequence, chunks that
 * start inside a block and cross block edges, with GQA and f16 / bf16 io. */
static void test_prefill_matches_reference(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(0xa77e02)};
    kvh_engine *e = open_plain(KVH_DTYPE_F16, 64, 0);
    kv_model *ma, *mb, *mc;
    kvh_seq a = seq_make(e, KVH_DTYPE_F16, &ma, 50, 3);
    kvh_seq b = seq_make(e, KVH_DTYPE_F16, &mb, 16, 4);
    kvh_seq c = seq_make(e, KVH_DTYPE_F16, &mc, 3, 5);
    kvh_seq batch[] = {a, b, c};
    kv_model *ms[] = {ma, mb, mc};
    const uint32_t qls[][3] = {{1, 1, 1}, {50, 16, 3}, {19, 7, 2}, {33, 1, 3}};
    const uint32_t ios[] = {KVH_DTYPE_F32, KVH_DTYPE_F16, KVH_DTYPE_BF16};
    for (int k = 0; k < 4; k++)
        for (int io = 0; io < 3; io++) {
            uint32_t qh = 2 * H;
            kvh_attention_params p = params(qh, k == 2 ? 0.25f : 0.0f, ios[io]);
            size_t rows = qls[k][0] + qls[k][1] + qls[k][2];
            float *q = tu_alloc(rows * qh * D * sizeof(float));
            make_q(&r, q, rows * qh * D);
            void *qb = tu_alloc(rows * qh * D * 4), *ob = tu_alloc(rows * qh * D * 4 + 64);
            to_dtype(ios[io], q, qb, rows * qh * D);
            memset(ob, 0xff, rows * qh * D * 4 + 64);
            uint32_t layer = (uint32_t)(k & 1);
            assert_ok(kvh_attention_prefill(e, layer, batch, qls[k], 3, qb, ob, &p));
            double *ref = tu_alloc(rows * qh * D * sizeof(double));
            assert_int_equal(ref_batch(ms, qls[k], 3, layer, q, qh, p.scale, ref), rows);
            assert_out_near(ob, ios[io], ref, rows * qh * D);
            for (size_t j = rows * qh * D * dsize(ios[io]); j < rows * qh * D * 4 + 64; j++)
                assert_int_equal(((uint8_t *)ob)[j], 0xff);
            tu_free(q);
            tu_free(qb);
            tu_free(ob);
            tu_free(ref);
        }
}

/* An f32 engine whose CPU kernels are variant isa ("": the default). */
static kvh_engine *open_with_isa(const char *isa)
{
    if (isa[0])
        setenv("KVH_ATTN_ISA", isa, 1);
    else
        unsetenv("KVH_ATTN_ISA");
    kvh_engine *e = open_plain(KVH_DTYPE_F32, 64, 0);
    unsetenv("KVH_ATTN_ISA");
    return e;
}

/* Causal prefill: query row j attends to tokens 0..j only, so an
 * infinite or NaN V in the last token cannot reach the rows before it
 * (0 * inf is NaN: a masked token must not enter the sums at all). Rows
 * 0..n-2 equal, bit for bit, those of the same sequence with that value
 * finite, and the last row is not finite. Every kernel variant this CPU
 * has, rows in one tile and across tiles. */
static void test_prefill_masked_non_finite_values_stay_masked(void **state)
{
    (void)state;
    static const char *const isas[] = {"", "generic", "avx2", "avx512"};
    const float bad[] = {INFINITY, NAN};
    const uint32_t lens[] = {8, 40};
    for (size_t ii = 0; ii < sizeof(isas) / sizeof(isas[0]); ii++)
        for (size_t bi = 0; bi < 2; bi++)
            for (size_t li = 0; li < 2; li++) {
                kvh_engine *e = open_with_isa(isas[ii]);
                uint32_t n = lens[li];
                size_t cell = (size_t)H * D;
                float *k = tu_alloc(n * cell * sizeof(float)), *v = tu_alloc(n * cell * sizeof(float));
                tu_rng r = {tu_seed(0xa77e10 + li)};
                make_q(&r, k, n * cell);
                make_q(&r, v, n * cell);
                kvh_seq s[2];
                for (int w = 0; w < 2; w++) {
                    s[w] = tu_seq_new(e, 0);
                    int32_t *t = tu_alloc(n * sizeof(int32_t));
                    tu_iota(t, n, 1 + 1000 * w);
                    assert_ok(kvh_seq_append(e, s[w], t, n));
                    tu_free(t);
                    if (w == 1)
                        for (size_t d = 0; d < cell; d++)
                            v[(n - 1) * cell + d] = bad[bi];
                    for (uint32_t layer = 0; layer < L; layer++)
                        assert_ok(kvh_seq_write_kv(e, s[w], layer, 0, n, k, v));
                }
                uint32_t qh = 2 * H;
                kvh_attention_params p = params(qh, 0.0f, KVH_DTYPE_F32);
                float *q = tu_alloc(n * qh * D * sizeof(float));
                make_q(&r, q, n * qh * D);
                float *out[2];
                for (int w = 0; w < 2; w++) {
                    out[w] = tu_alloc(n * qh * D * sizeof(float));
                    assert_ok(kvh_attention_prefill(e, 0, &s[w], &n, 1, q, out[w], &p));
                }
                size_t before_last = (size_t)(n - 1) * qh * D;
                for (size_t i = 0; i < before_last; i++)
                    if (memcmp(&out[0][i], &out[1][i], sizeof(float)) != 0)
                        fail_msg("isa '%s', V %f in token %u of %u: row %zu element %zu is %f, not %f", isas[ii],
                                 (double)bad[bi], n - 1, n, i / (qh * D), i % (qh * D), (double)out[1][i],
                                 (double)out[0][i]);
                bool last_finite = true;
                for (size_t i = before_last; i < (size_t)n * qh * D; i++)
                    last_finite = last_finite && isfinite(out[1][i]);
                assert_false(last_finite);
                for (int w = 0; w < 2; w++) {
                    tu_free(out[w]);
                    assert_ok(kvh_seq_free(e, s[w]));
                }
                tu_free(q);
                tu_free(k);
                tu_free(v);
                assert_ok(tu_close(e));
            }
}

/* A NaN score (a NaN in one query head, or in one token's K) makes that
 * head's output NaN, as the reference kernel's, never a silent 0 or an
 * answer without that token; the other heads are unchanged bit for bit.
 * Every kernel variant, a short sequence and one long enough for split
 * chunks. */
static void test_nan_scores_make_the_row_nan(void **state)
{
    (void)state;
    static const char *const isas[] = {"", "reference", "generic", "avx2", "avx512"};
    const uint32_t lens[] = {40, 150};
    for (size_t ii = 0; ii < sizeof(isas) / sizeof(isas[0]); ii++)
        for (size_t li = 0; li < 2; li++)
            for (int in_k = 0; in_k < 2; in_k++) {
                kvh_engine *e = open_with_isa(isas[ii]);
                uint32_t n = lens[li];
                size_t cell = (size_t)H * D;
                float *k = tu_alloc(n * cell * sizeof(float)), *v = tu_alloc(n * cell * sizeof(float));
                tu_rng r = {tu_seed(0xa77e20 + li)};
                make_q(&r, k, n * cell);
                make_q(&r, v, n * cell);
                uint32_t qh = 2 * H;
                float *q = tu_alloc(qh * D * sizeof(float));
                make_q(&r, q, qh * D);
                kvh_attention_params p = params(qh, 0.0f, KVH_DTYPE_F32);
                float *out[2];
                for (int w = 0; w < 2; w++) {
                    kvh_seq s = tu_seq_new(e, 0);
                    int32_t *t = tu_alloc(n * sizeof(int32_t));
                    tu_iota(t, n, 1);
                    assert_ok(kvh_seq_append(e, s, t, n));
                    tu_free(t);
                    if (w == 1 && in_k)
                        k[0] = NAN; /* token 0, KV head 0: query heads 0 and 1 */
                    else if (w == 1)
                        q[0] = NAN; /* query head 0 */
                    assert_ok(kvh_seq_write_kv(e, s, 0, 0, n, k, v));
                    out[w] = tu_alloc(qh * D * sizeof(float));
                    assert_ok(kvh_attention_decode(e, 0, &s, 1, q, out[w], &p));
                    assert_ok(kvh_seq_free(e, s));
                }
                uint32_t nan_heads = in_k ? qh / H : 1;
                for (uint32_t h = 0; h < qh; h++)
                    for (uint32_t d = 0; d < D; d++) {
                        float a = out[0][h * D + d], b = out[1][h * D + d];
                        if (h < nan_heads ? !isnan(b) : memcmp(&a, &b, sizeof(a)) != 0)
                            fail_msg("isa '%s', %u tokens, NaN in %s: head %u element %u is %f (without it %f)",
                                     isas[ii], n, in_k ? "K" : "q", h, d, (double)b, (double)a);
                    }
                for (int w = 0; w < 2; w++)
                    tu_free(out[w]);
                tu_free(q);
                tu_free(k);
                tu_free(v);
                assert_ok(tu_close(e));
            }
}

/* Fields past the caller's struct_size take their defaults, however much
 * garbage lies there. */
static void test_params_past_struct_size_are_ignored(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(0xa77e03)};
    kvh_engine *e = open_plain(KVH_DTYPE_F32, 16, 0);
    kv_model *m;
    kvh_seq s = seq_make(e, KVH_DTYPE_F32, &m, 21, 6);
    float q[2 * H * D], out[2 * H * D];
    double ref[2 * H * D];
    for (size_t sz = 8; sz <= sizeof(kvh_attention_params); sz += 8) {
        kvh_attention_params p;
        memset(&p, 0xff, sizeof(p)); /* NaN scale, io_dtype and stream fields of UINT32_MAX */
        p.struct_size = (uint32_t)sz;
        p.num_q_heads = 2 * H;
        if (sz >= 16) {
            p.scale = 0.2f;
            p.io_dtype = KVH_DTYPE_F32;
        }
        if (sz >= 24) {
            p.threads = 1;
            p.reserved0 = 0;
        }
        if (sz >= 32)
            p.stream = NULL;
        if (sz >= 40)
            p.stream_chunk_blocks = p.stream_window_blocks = 0;
        make_q(&r, q, 2 * H * D);
        assert_ok(kvh_attention_decode(e, 0, &s, 1, q, out, &p));
        ref_batch(&m, NULL, 1, 0, q, 2 * H, sz >= 16 ? 0.2f : 0.0f, ref);
        assert_out_near(out, KVH_DTYPE_F32, ref, 2 * H * D);
    }
}

/* Every documented misuse of kvh_attention_decode / _prefill. */
static void test_decode_and_prefill_misuse_change_nothing(void **state)
{
    (void)state;
    kvh_engine *e = open_plain(KVH_DTYPE_F32, 16, 16);
    kvh_engine *other = open_plain(KVH_DTYPE_F32, 16, 0);
    kv_model *ma, *mh, *mo;
    kvh_seq a = seq_make(e, KVH_DTYPE_F32, &ma, 40, 7);
    kvh_seq on_host = seq_make(e, KVH_DTYPE_F32, &mh, 20, 8);
    assert_ok(kvh_seq_migrate(e, on_host, 0, 20, KVH_TIER_HOST, NULL));
    assert_int_equal(block_tier(e, on_host, 0), KVH_TIER_HOST);
    kvh_seq empty = tu_seq_new(e, 0);
    kvh_seq freed = tu_seq_new(e, 0);
    assert_ok(kvh_seq_free(e, freed));
    kvh_seq foreign = seq_make(other, KVH_DTYPE_F32, &mo, 5, 9);
    kvh_seq as_block = {seq_block(e, a, 0).id};
    kvh_seq forged[] = {{0}, {~a.id}, {a.id ^ (1ull << 63)}, as_block, foreign, freed};

    float q[8 * MAXQH * D];
    memset(q, 0, sizeof(q));
    uint8_t out[8 * MAXQH * D * 4];
    kvh_seq all[] = {a, on_host, empty};
    scene sc = {.e = e, .seqs = all, .ns = 3, .out = out, .out_bytes = sizeof(out)};
    scene *c = &sc;
    kvh_attention_params p = params(0, 0, KVH_DTYPE_F32);

    MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_decode(NULL, 0, &a, 1, q, out, &p));
    MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_decode(e, 0, NULL, 1, q, out, &p));
    MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_decode(e, 0, &a, 1, NULL, out, &p));
    MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_decode(e, 0, &a, 1, q, NULL, &p));
    MISUSE(c, KVH_ERR_RANGE, kvh_attention_decode(e, L, &a, 1, q, out, &p));
    MISUSE(c, KVH_ERR_RANGE, kvh_attention_decode(e, UINT32_MAX, &a, 1, q, out, &p));
    MISUSE(c, KVH_ERR_RANGE, kvh_attention_decode(e, 0, &empty, 1, q, out, &p));
    kvh_seq with_empty[] = {a, a, empty};
    MISUSE(c, KVH_ERR_RANGE, kvh_attention_decode(e, 0, with_empty, 3, q, out, &p));
    for (size_t i = 0; i < sizeof(forged) / sizeof(forged[0]); i++) {
        MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_attention_decode(e, 0, &forged[i], 1, q, out, &p));
        kvh_seq mixed[] = {a, forged[i]};
        MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_attention_decode(e, 1, mixed, 2, q, out, &p));
    }
    MISUSE(c, KVH_ERR_NOT_RESIDENT, kvh_attention_decode(e, 0, &on_host, 1, q, out, &p));
    kvh_seq mixed_res[] = {a, on_host};
    MISUSE(c, KVH_ERR_NOT_RESIDENT, kvh_attention_decode(e, 0, mixed_res, 2, q, out, &p));

    /* params */
    const uint32_t bad_io[] = {3, 4, 0x80000000u, UINT32_MAX};
    for (size_t i = 0; i < 4; i++) {
        kvh_attention_params b = params(0, 0, bad_io[i]);
        MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_decode(e, 0, &a, 1, q, out, &b));
    }
    const float bad_scale[] = {NAN, -NAN, INFINITY, -INFINITY};
    for (size_t i = 0; i < 4; i++) {
        kvh_attention_params b = params(0, bad_scale[i], KVH_DTYPE_F32);
        MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_decode(e, 0, &a, 1, q, out, &b));
    }
    /* not a multiple of num_kv_heads (2), or far above any kernel's limit */
    const uint32_t bad_qh[] = {1, 3, 5, 7, UINT32_MAX, 1u << 20, 1u << 30, 0x80000000u, UINT32_MAX - 1};
    for (size_t i = 0; i < sizeof(bad_qh) / sizeof(bad_qh[0]); i++) {
        kvh_attention_params b = params(bad_qh[i], 0, KVH_DTYPE_F32);
        MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_decode(e, 0, &a, 1, q, out, &b));
        uint32_t one = 1;
        MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_prefill(e, 0, &a, &one, 1, q, out, &b));
    }
    const uint32_t bad_size[] = {0, 4, 12, 20, 41, sizeof(kvh_attention_params) + 8, 1u << 16, UINT32_MAX};
    for (size_t i = 0; i < sizeof(bad_size) / sizeof(bad_size[0]); i++) {
        kvh_attention_params b = params(0, 0, KVH_DTYPE_F32);
        b.struct_size = bad_size[i];
        MISUSE(c, KVH_ERR_STRUCT_SIZE, kvh_attention_decode(e, 0, &a, 1, q, out, &b));
        uint32_t one = 1;
        MISUSE(c, KVH_ERR_STRUCT_SIZE, kvh_attention_prefill(e, 0, &a, &one, 1, q, out, &b));
    }
    {
        kvh_attention_params b = params(0, 0, KVH_DTYPE_F32);
        b.stream_chunk_blocks = 2;
        b.stream_window_blocks = 1; /* smaller than one chunk */
        MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_decode(e, 0, &on_host, 1, q, out, &b));
        b.stream_chunk_blocks = UINT32_MAX;
        b.stream_window_blocks = UINT32_MAX - 1;
        MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_decode(e, 0, &on_host, 1, q, out, &b));
    }

    /* prefill: q_lens */
    uint32_t ql1 = 1;
    MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_prefill(e, 0, &a, NULL, 1, q, out, &p));
    MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_prefill(NULL, 0, &a, &ql1, 1, q, out, &p));
    MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_prefill(e, 0, NULL, &ql1, 1, q, out, &p));
    MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_prefill(e, 0, &a, &ql1, 1, NULL, out, &p));
    MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_prefill(e, 0, &a, &ql1, 1, q, NULL, &p));
    uint32_t too_long = 41;
    MISUSE(c, KVH_ERR_RANGE, kvh_attention_prefill(e, 0, &a, &too_long, 1, q, out, &p));
    uint32_t huge = UINT32_MAX;
    MISUSE(c, KVH_ERR_RANGE, kvh_attention_prefill(e, 0, &a, &huge, 1, q, out, &p));
    uint32_t huge_second[] = {1, UINT32_MAX - 1};
    kvh_seq two_a[] = {a, a};
    MISUSE(c, KVH_ERR_RANGE, kvh_attention_prefill(e, 0, two_a, huge_second, 2, q, out, &p));
    MISUSE(c, KVH_ERR_RANGE, kvh_attention_prefill(e, L, &a, &ql1, 1, q, out, &p));
    MISUSE(c, KVH_ERR_RANGE, kvh_attention_prefill(e, 0, &empty, &ql1, 1, q, out, &p));
    MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_attention_prefill(e, 0, &freed, &ql1, 1, q, out, &p));
    MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_attention_prefill(e, 0, &foreign, &ql1, 1, q, out, &p));
    MISUSE(c, KVH_ERR_NOT_RESIDENT, kvh_attention_prefill(e, 0, &on_host, &ql1, 1, q, out, &p));

    /* An empty batch writes nothing, whatever it returns. */
    MISUSE2(c, KVH_ERR_INVALID_ARG, KVH_OK, kvh_attention_decode(e, 0, &a, 0, q, out, &p));
    uint32_t zero = 0;
    MISUSE2(c, KVH_ERR_INVALID_ARG, KVH_OK, kvh_attention_prefill(e, 0, &a, &zero, 1, q, out, &p));

    /* the valid call still works after all that */
    tu_rng r = {tu_seed(0xa77e04)};
    make_q(&r, q, H * D);
    assert_ok(kvh_attention_decode(e, 1, &a, 1, q, out, NULL));
    double ref[H * D];
    ref_batch(&ma, NULL, 1, 1, q, H, 0, ref);
    assert_out_near(out, KVH_DTYPE_F32, ref, H * D);
    (void)mh;
}

/* Finite extremes are valid parameters: a huge scale is an argmax (ties
 * share), a tiny one a plain mean, threads far above the CPU count is
 * capped. */
static void test_extreme_finite_parameters(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(0xa77e05)};
    kvh_engine *e = open_plain(KVH_DTYPE_F32, 16, 0);
    kv_model *m;
    kvh_seq s = seq_make(e, KVH_DTYPE_F32, &m, 45, 10);
    /* FLT_MAX: scores past the float range, from finite inputs (done in double). */
    const float scales[] = {1e30f, -1e30f, 1e-30f, FLT_MIN, 1e-45f, 1e38f, FLT_MAX, -FLT_MAX};
    float q[H * D], out[H * D];
    double ref[H * D];
    for (size_t i = 0; i < sizeof(scales) / sizeof(scales[0]); i++) {
        kvh_attention_params p = params(0, scales[i], KVH_DTYPE_F32);
        p.threads = UINT32_MAX;
        make_q(&r, q, H * D);
        memset(out, 0, sizeof(out));
        kvh_status st = kvh_attention_decode(e, 0, &s, 1, q, out, &p);
        if (st != KVH_OK)
            fail_msg("scale %g: %s (%s)", (double)scales[i], kvh_status_name(st), kvh_last_error());
        ref_batch(&m, NULL, 1, 0, q, H, scales[i], ref);
        if (!out_near_at(__FILE__, __LINE__, out, KVH_DTYPE_F32, ref, H * D))
            fail_msg("scale %g gives wrong numbers", (double)scales[i]);
    }
}

/* Finite inputs whose scores all leave the float range, upwards or
 * downwards, or whose q . k does before the scale brings it back: the
 * softmax of the exact scores (K {2, 3}, V {10, 20}). */
static void test_scores_past_the_float_range_either_way(void **state)
{
    (void)state;
    enum { D1 = 4 };
    kvh_config c = tu_cfg(1, 1, D1, BT, KVH_DTYPE_F32, 16, 16, 0);
    kvh_engine *e = tu_open_cfg(&c);
    kvh_seq s = tu_seq_new(e, 0);
    int32_t t[2] = {1, 2};
    assert_ok(kvh_seq_append(e, s, t, 2));
    float k[2 * D1] = {0}, v[2 * D1] = {0};
    k[0] = 2, k[D1] = 3, v[0] = 10, v[D1] = 20;
    assert_ok(kvh_seq_write_kv(e, s, 0, 0, 2, k, v));
    const struct {
        float q, scale, k0, k1;
        double want;
    } cases[] = {
        {1, FLT_MAX, 2, 3, 20},
        {1, -FLT_MAX, 2, 3, 10},
        {-1, FLT_MAX, 2, 3, 10},
        {1e20f, 1e-40f, 1e20f, 2e20f, (10 + 20 * M_E) / (1 + M_E)},
        {-1e20f, 1e-40f, 1e20f, 2e20f, (10 * M_E + 20) / (1 + M_E)},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        k[0] = cases[i].k0, k[D1] = cases[i].k1;
        assert_ok(kvh_seq_write_kv(e, s, 0, 0, 2, k, v));
        float q[D1] = {cases[i].q}, out[D1];
        kvh_attention_params p = params(1, cases[i].scale, KVH_DTYPE_F32);
        assert_ok(kvh_attention_decode(e, 0, &s, 1, q, out, &p));
        if (!(fabs(out[0] - cases[i].want) <= 1e-4 * cases[i].want))
            fail_msg("case %zu: %g, the softmax of the exact scores is %g", i, (double)out[0], cases[i].want);
    }
}

/* One f32 sequence of 4 tokens (head_dim 16, one head: every kernel
 * variant takes it) with the given K and V on kernel variant isa, decoded
 * with q and scale, into a separate buffer and in place (out over q): the
 * softmax of the exact scores, though q x scale, a product or the
 * weighted sum of V passes FLT_MAX on the way (finite inputs, finite
 * answer: kvh.h computes such rows again in double). */
enum { PD = 16, PN = 4 };

static void expect_decode_near(const char *isa, const float *k, const float *v, const float *q, float scale,
                               double want, const char *what)
{
    if (isa[0])
        setenv("KVH_ATTN_ISA", isa, 1);
    kvh_config c = tu_cfg(1, 1, PD, BT, KVH_DTYPE_F32, 16, 16, 0);
    kvh_engine *e = tu_open_cfg(&c);
    unsetenv("KVH_ATTN_ISA");
    kvh_seq s = tu_seq_new(e, 0);
    int32_t t[PN] = {1, 2, 3, 4};
    assert_ok(kvh_seq_append(e, s, t, PN));
    assert_ok(kvh_seq_write_kv(e, s, 0, 0, PN, k, v));
    kvh_attention_params p = params(1, scale, KVH_DTYPE_F32);
    for (int in_place = 0; in_place < 2; in_place++) {
        float out[PD];
        memcpy(out, q, sizeof(out));
        assert_ok(kvh_attention_decode(e, 0, &s, 1, in_place ? out : q, out, &p));
        if (!(fabs(out[0] - want) <= 1e-5 * fabs(want)))
            fail_msg("isa '%s', %s%s: %g, the softmax of the exact scores gives %g", isa, what,
                     in_place ? " (in place)" : "", (double)out[0], want);
    }
    assert_ok(tu_close(e));
}

static void test_finite_inputs_past_the_float_range_on_every_kernel(void **state)
{
    (void)state;
    static const char *const isas[] = {"", "reference", "generic", "avx2", "avx512"};
    for (size_t ii = 0; ii < sizeof(isas) / sizeof(isas[0]); ii++) {
        /* Equal scores, V of 2e38 everywhere: the unnormalised sum is 8e38. */
        float k[PN * PD] = {0}, v[PN * PD], q[PD] = {1};
        for (int i = 0; i < PN * PD; i++)
            v[i] = 2e38f;
        expect_decode_near(isas[ii], k, v, q, 1.0f, 2e38, "V sum past FLT_MAX");
        /* q x scale overflows (3e38 x 4), against K of 0 in that element:
         * scores t = 0..3. */
        double num = 0, den = 0;
        for (int t = 0; t < PN; t++) {
            k[t * PD] = 0, k[t * PD + 1] = (float)t / 4;
            v[t * PD] = 10.0f * (float)t;
            num += 10.0 * t * exp(t), den += exp(t);
        }
        float q4[PD] = {3e38f, 1};
        expect_decode_near(isas[ii], k, v, q4, 4.0f, num / den, "q x scale past FLT_MAX");
        /* Two products past FLT_MAX that cancel: scores t / 8. */
        num = den = 0;
        for (int t = 0; t < PN; t++) {
            k[t * PD] = 2, k[t * PD + 1] = -2, k[t * PD + 2] = (float)t / 8;
            num += 10.0 * t * exp(t / 8.0), den += exp(t / 8.0);
        }
        float q3[PD] = {3e38f, 3e38f, 1};
        expect_decode_near(isas[ii], k, v, q3, 1.0f, num / den, "products past FLT_MAX that cancel");
    }
}

/* Chunks each in range whose merge passes it: a long context split across
 * threads (split-K), V of 3e38 at two tokens and equal scores, so that a
 * chunk's normalised output is finite but the merge's weighted sum of
 * chunk outputs (weights up to a chunk's tokens) is not. The row came
 * back inf on two threads, where one gave 2 x 3e38 / n: now it is
 * computed again in double, as a unit's would be. */
static void test_a_merge_past_the_float_range_is_computed_again(void **state)
{
    (void)state;
    enum { MD = 8, MN = 1000 };
    static const char *const isas[] = {"", "generic", "avx2", "avx512"};
    static float k[MN * MD], v[MN * MD];
    memset(v, 0, sizeof(v));
    for (int d = 0; d < MD; d++)
        v[1 * MD + d] = v[(MN - 2) * MD + d] = 3e38f;
    const double want = 2 * 3e38 / MN;
    for (size_t ii = 0; ii < sizeof(isas) / sizeof(isas[0]); ii++) {
        if (isas[ii][0])
            setenv("KVH_ATTN_ISA", isas[ii], 1);
        kvh_config c = tu_cfg(1, 1, MD, BT, KVH_DTYPE_F32, 128, 16, 0);
        kvh_engine *e = tu_open_cfg(&c);
        unsetenv("KVH_ATTN_ISA");
        kvh_seq s = tu_seq_new(e, 0);
        static int32_t t[MN];
        for (int i = 0; i < MN; i++)
            t[i] = i + 1;
        assert_ok(kvh_seq_append(e, s, t, MN));
        assert_ok(kvh_seq_write_kv(e, s, 0, 0, MN, k, v));
        for (uint32_t threads = 0; threads <= 4; threads++) {
            kvh_attention_params p = params(1, 1.0f, KVH_DTYPE_F32);
            p.threads = threads;
            float q[MD] = {1}, out[MD];
            assert_ok(kvh_attention_decode(e, 0, &s, 1, q, out, &p));
            for (int d = 0; d < MD; d++)
                if (!(fabs(out[d] - want) <= 1e-5 * want))
                    fail_msg("isa '%s', %u threads, decode: %g, want %g", isas[ii], threads, (double)out[d], want);
            uint32_t ql = 1;
            assert_ok(kvh_attention_prefill(e, 0, &s, &ql, 1, q, out, &p));
            if (!(fabs(out[0] - want) <= 1e-5 * want))
                fail_msg("isa '%s', %u threads, prefill: %g, want %g", isas[ii], threads, (double)out[0], want);
        }
        assert_ok(tu_close(e));
    }
}

/* The same in a streamed call, whose rows past the float range are NaN
 * (kvh.h): two chunks of one block each, V of 3e38 in both, came back
 * inf. */
static void test_a_streamed_merge_past_the_float_range_is_nan(void **state)
{
    (void)state;
    kvh_config c = tu_cfg(1, 1, 4, 4, KVH_DTYPE_F32, 16, 16, 0);
    c.copy_moves = 1; /* the host tier apart: its blocks are streamed */
    kvh_engine *e = tu_open_cfg(&c);
    kvh_seq s = tu_seq_new(e, 0);
    int32_t t[5] = {1, 2, 3, 4, 5};
    assert_ok(kvh_seq_append(e, s, t, 5));
    float k[5 * 4] = {0}, v[5 * 4] = {0};
    for (int d = 0; d < 4; d++)
        v[1 * 4 + d] = v[4 * 4 + d] = 3e38f;
    assert_ok(kvh_seq_write_kv(e, s, 0, 0, 5, k, v));
    kvh_attention_params p = params(1, 1.0f, KVH_DTYPE_F32);
    float q[4] = {1, 1, 1, 1}, out[4];
    assert_ok(kvh_attention_decode(e, 0, &s, 1, q, out, &p));
    assert_true(fabs(out[0] - 1.2e38) <= 1e-5 * 1.2e38); /* resident: computed again in double */
    assert_ok(kvh_seq_migrate(e, s, 0, 5, KVH_TIER_HOST, NULL));
    p.stream_chunk_blocks = 1;
    p.stream_window_blocks = 2;
    assert_ok(kvh_attention_decode(e, 0, &s, 1, q, out, &p));
    for (int d = 0; d < 4; d++)
        if (!isnan(out[d]))
            fail_msg("streamed row past the float range: %g, kvh.h says NaN", (double)out[d]);
    assert_ok(tu_close(e));
}

/* A prefill of two sequences (3 and 2 query rows, 4 query heads over 2 KV
 * heads, contexts long enough for split chunks, 4 threads) with one
 * (row, head) pushed past the float range: that row is computed again,
 * bit for bit as the double reference kernel computes it, and every other
 * row keeps its bits. */
enum { RP_HK = 2, RP_HQ = 4, RP_D = 16, RP_ROWS = 5 };

static void prefill_two(const char *isa, const float *q, float *out)
{
    static const uint32_t lens[2] = {1100, 900}, ql[2] = {3, 2};
    if (isa[0])
        setenv("KVH_ATTN_ISA", isa, 1);
    kvh_config c = tu_cfg(1, RP_HK, RP_D, BT, KVH_DTYPE_F32, 160, 0, 0);
    kvh_engine *e = tu_open_cfg(&c);
    unsetenv("KVH_ATTN_ISA");
    kvh_seq s[2];
    for (int i = 0; i < 2; i++) {
        s[i] = tu_seq_new(e, 0);
        int32_t *t = tu_alloc(lens[i] * sizeof(int32_t));
        tu_iota(t, lens[i], 1 + 5000 * (uint32_t)i);
        assert_ok(kvh_seq_append(e, s[i], t, lens[i]));
        tu_free(t);
        size_t n = (size_t)lens[i] * RP_HK * RP_D;
        float *k = tu_alloc(n * sizeof(float)), *v = tu_alloc(n * sizeof(float));
        for (size_t x = 0; x < n; x++) {
            k[x] = (float)((x * 31 + (size_t)i) % 19) / 8.0f - 1.0f;
            v[x] = (float)((x * 13 + (size_t)i) % 23) / 8.0f - 1.0f;
        }
        assert_ok(kvh_seq_write_kv(e, s[i], 0, 0, lens[i], k, v));
        tu_free(k);
        tu_free(v);
    }
    kvh_attention_params p = params(RP_HQ, 1.0f, KVH_DTYPE_F32);
    p.threads = 4;
    assert_ok(kvh_attention_prefill(e, 0, s, ql, 2, q, out, &p));
    assert_ok(tu_close(e));
}

static void test_only_rows_past_the_float_range_are_redone(void **state)
{
    (void)state;
    enum { N = RP_ROWS * RP_HQ * RP_D };
    float q[N], before[N], after[N], exact[N];
    for (int x = 0; x < N; x++)
        q[x] = (float)(x % 9) / 4.0f - 1.0f;
    prefill_two("", q, before);
    const int pr = 4, ph = 3; /* sequence 1, its second row; query head 3 */
    float *qp = q + ((size_t)pr * RP_HQ + ph) * RP_D;
    for (int d = 0; d < RP_D; d++)
        qp[d] *= 1e38f; /* scores past FLT_MAX */
    prefill_two("", q, after);
    prefill_two("reference", q, exact);
    for (int r = 0; r < RP_ROWS; r++)
        for (int h = 0; h < RP_HQ; h++) {
            size_t at = ((size_t)r * RP_HQ + h) * RP_D;
            const float *want = r == pr && h == ph ? exact + at : before + at;
            if (memcmp(want, after + at, RP_D * sizeof(float)) != 0)
                fail_msg("row %d head %d: element 0 is %g, not %g (%s)", r, h, (double)after[at], (double)want[0],
                         r == pr && h == ph ? "the double reference" : "as before");
        }
}

/* A streamed call is not redone in double: a row whose scores all pass
 * the float range downwards is NaN (kvh.h), not a row of zeros. */
static void test_streamed_rows_past_the_float_range_are_nan(void **state)
{
    (void)state;
    enum { D1 = 16, N = 40 };
    kvh_config c = tu_cfg(1, 1, D1, BT, KVH_DTYPE_F32, 16, 4, 0);
    kvh_engine *e = tu_open_cfg(&c);
    kvh_seq s = tu_seq_new(e, 0);
    int32_t t[N] = {0};
    assert_ok(kvh_seq_append(e, s, t, N));
    float *k = tu_alloc(N * D1 * sizeof(float)), *v = tu_alloc(N * D1 * sizeof(float));
    for (uint32_t i = 0; i < N; i++)
        for (uint32_t d = 0; d < D1; d++) {
            k[i * D1 + d] = d == 0 ? -1e30f * (1 + (float)i / 64.0f) : 0;
            v[i * D1 + d] = (float)(i + d);
        }
    assert_ok(kvh_seq_write_kv(e, s, 0, 0, N, k, v));
    float q[D1] = {1e30f}, out[D1];
    kvh_attention_params p = params(1, 1.0f, KVH_DTYPE_F32);
    assert_ok(kvh_attention_decode(e, 0, &s, 1, q, out, &p)); /* redone in double: token 0 */
    for (uint32_t d = 0; d < D1; d++)
        assert_true(fabsf(out[d] - (float)d) <= 1e-6f);
    p.stream_chunk_blocks = 1;
    p.stream_window_blocks = 1;
    assert_ok(kvh_attention_decode(e, 0, &s, 1, q, out, &p));
    for (uint32_t d = 0; d < D1; d++)
        if (!isnan(out[d]))
            fail_msg("streamed: element %u is %g, not NaN", d, (double)out[d]);
    tu_free(k);
    tu_free(v);
    assert_ok(tu_close(e));
}

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
/* A caller running with flush-to-zero and denormals-are-zero (a -ffast-math
 * binary, torch.set_flush_denormal) or a directed rounding mode gets the
 * same output, bit for bit, as in the default environment, on every
 * kernel and with the default scale 1/sqrt(head_dim), and keeps its
 * setting: f16 K/V below 6.1e-5 are subnormal and read as zeros under
 * DAZ. */
static void test_callers_fp_environment_changes_nothing(void **state)
{
    (void)state;
    static const char *const isas[] = {"", "reference", "generic", "avx2", "avx512"};
    static const uint32_t dims[] = {16, 17, 20, 96};
    for (size_t ii = 0; ii < sizeof(isas) / sizeof(isas[0]); ii++)
        for (size_t di = 0; di < sizeof(dims) / sizeof(dims[0]); di++) {
            uint32_t d1 = dims[di], n = 24;
            if (isas[ii][0])
                setenv("KVH_ATTN_ISA", isas[ii], 1);
            kvh_config c = tu_cfg(1, 1, d1, BT, KVH_DTYPE_F16, 16, 0, 0);
            kvh_engine *e = tu_open_cfg(&c);
            unsetenv("KVH_ATTN_ISA");
            kvh_seq s = tu_seq_new(e, 0);
            int32_t *t = tu_alloc(n * sizeof(int32_t));
            tu_iota(t, n, 1);
            assert_ok(kvh_seq_append(e, s, t, n));
            uint16_t *k = tu_alloc((size_t)n * d1 * 2), *v = tu_alloc((size_t)n * d1 * 2);
            tu_rng r = {tu_seed(0xa77e30 + di)};
            for (size_t i = 0; i < (size_t)n * d1; i++) {
                k[i] = kvhi_f32_to_f16((float)((double)(tu_next(&r) % 2001) / 1000.0 - 1.0));
                v[i] = (uint16_t)((tu_next(&r) & 0x83ffu) | 1u); /* subnormal, either sign */
            }
            assert_ok(kvh_seq_write_kv(e, s, 0, 0, n, k, v));
            float q[96], out[2][96];
            for (uint32_t d = 0; d < d1; d++)
                q[d] = (float)d / 8.0f - 1.0f;
            kvh_attention_params p = params(1, 0.0f, KVH_DTYPE_F32);
            assert_ok(kvh_attention_decode(e, 0, &s, 1, q, out[0], &p));
            /* FTZ | DAZ, then each directed rounding mode (MXCSR bits 13-14) */
            static const unsigned int envs[] = {0x8040u, 0x4000u, 0x2000u, 0x6000u};
            for (size_t ei = 0; ei < sizeof(envs) / sizeof(envs[0]); ei++) {
                unsigned int csr = _mm_getcsr();
                _mm_setcsr(csr | envs[ei]);
                kvh_status st = kvh_attention_decode(e, 0, &s, 1, q, out[1], &p);
                unsigned int after = _mm_getcsr();
                _mm_setcsr(csr);
                assert_ok(st);
                assert_int_equal(after & 0xe040u, envs[ei]);
                if (memcmp(out[0], out[1], d1 * sizeof(float)) != 0)
                    fail_msg("isa '%s', head_dim %u, MXCSR | %#x: element 0 is %g, not %g", isas[ii], d1, envs[ei],
                             (double)out[1][0], (double)out[0][0]);
            }
            bool any = false;
            for (uint32_t d = 0; d < d1; d++)
                any |= out[0][d] != 0;
            assert_true(any); /* subnormal V are not zeros */
            tu_free(t);
            tu_free(k);
            tu_free(v);
            assert_ok(tu_close(e));
        }
}
#endif

/* out == q: the header does not forbid it (q is only read), and a caller
 * that attends in place must get the same numbers. */
static void test_output_aliasing_the_query(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(0xa77e06)};
    kvh_engine *e = open_plain(KVH_DTYPE_F32, 32, 0);
    kv_model *ma, *mb;
    kvh_seq a = seq_make(e, KVH_DTYPE_F32, &ma, 33, 12);
    kvh_seq b = seq_make(e, KVH_DTYPE_F32, &mb, 17, 13);
    kvh_seq batch[] = {a, b};
    kv_model *ms[] = {ma, mb};
    kvh_attention_params p = params(2 * H, 0, KVH_DTYPE_F32);
    enum { QH = 2 * H };
    float q[2 * QH * D], buf[2 * QH * D];
    double ref[2 * QH * D];
    make_q(&r, q, 2 * QH * D);
    memcpy(buf, q, sizeof(q));
    assert_ok(kvh_attention_decode(e, 0, batch, 2, buf, buf, &p));
    ref_batch(ms, NULL, 2, 0, q, QH, 0, ref);
    assert_out_near(buf, KVH_DTYPE_F32, ref, 2 * QH * D);

    uint32_t ql[] = {9, 17};
    float *pq = tu_alloc(26 * QH * D * sizeof(float)), *pb = tu_alloc(26 * QH * D * sizeof(float));
    double *pref = tu_alloc(26 * QH * D * sizeof(double));
    make_q(&r, pq, 26 * QH * D);
    memcpy(pb, pq, 26 * QH * D * sizeof(float));
    assert_ok(kvh_attention_prefill(e, 1, batch, ql, 2, pb, pb, &p));
    ref_batch(ms, ql, 2, 1, pq, QH, 0, pref);
    assert_out_near(pb, KVH_DTYPE_F32, pref, 26 * QH * D);

    kvh_attention_plan *pl = NULL;
    assert_ok(kvh_attention_plan_create(e, 1, batch, ql, 2, &p, &pl));
    memcpy(pb, pq, 26 * QH * D * sizeof(float));
    assert_ok(kvh_attention_run(e, pl, pb, pb, NULL));
    assert_out_near(pb, KVH_DTYPE_F32, pref, 26 * QH * D);
    assert_ok(kvh_attention_plan_destroy(e, pl));
}

/* Streaming attention over blocks in the host and disk tiers gives the
 * reference numbers and leaves every block where it was; a window that
 * cannot hold a chunk, or cannot fit in the device tier, is refused with
 * nothing changed. */
static void test_streaming_from_host_and_disk(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("attn_hostile_stream", dir, sizeof(dir));
    dt_geo g = {L, H, D, BT, KVH_DTYPE_F32};
    kvh_config cfg = dt_cfg(g, dir, 8, 16, 64, 1);
    cfg.copy_moves = 1; /* host blocks in memory of their own: staged, not attended in place */
    kvh_engine *e = dt_open_a(&cfg);
    tu_rng r = {tu_seed(0xa77e07)};
    kv_model *m;
    kvh_seq s = seq_make(e, KVH_DTYPE_F32, &m, 5 * BT + 3, 14);
    assert_ok(kvh_seq_migrate(e, s, 0, 2 * BT, KVH_TIER_DISK, NULL));
    assert_ok(kvh_seq_migrate(e, s, 2 * BT, 2 * BT, KVH_TIER_HOST, NULL));
    const uint32_t want_tier[] = {KVH_TIER_DISK, KVH_TIER_DISK,   KVH_TIER_HOST,
                                  KVH_TIER_HOST, KVH_TIER_DEVICE, KVH_TIER_DEVICE};
    for (int i = 0; i < 6; i++)
        assert_int_equal(block_tier(e, s, (uint64_t)i), want_tier[i]);

    float q[MAXT * H * D], out[MAXT * H * D];
    double ref[MAXT * H * D];
    kvh_seq all[] = {s};
    scene sc = {.e = e, .seqs = all, .ns = 1, .out = out, .out_bytes = sizeof(out)};
    kvh_attention_params p = params(0, 0, KVH_DTYPE_F32);
    MISUSE(&sc, KVH_ERR_NOT_RESIDENT, kvh_attention_decode(e, 0, &s, 1, q, out, &p));
    p.stream_chunk_blocks = 3;
    p.stream_window_blocks = 2;
    MISUSE(&sc, KVH_ERR_INVALID_ARG, kvh_attention_decode(e, 0, &s, 1, q, out, &p));
    kvh_attention_plan *pl = (kvh_attention_plan *)(uintptr_t)0x5a5a;
    p.stream_chunk_blocks = 1;
    p.stream_window_blocks = 2;
    MISUSE(&sc, KVH_ERR_UNSUPPORTED, kvh_attention_plan_create(e, 0, &s, NULL, 1, &p, &pl));
    assert_ptr_equal(pl, (kvh_attention_plan *)(uintptr_t)0x5a5a);

    kvh_stats before = tu_stats(e);
    const uint32_t chunks[][2] = {{1, 1}, {1, 2}, {2, 2}, {2, 5}, {7, 7}};
    for (int k = 0; k < 5; k++) {
        p.stream_chunk_blocks = chunks[k][0];
        p.stream_window_blocks = chunks[k][1];
        uint32_t layer = (uint32_t)(k & 1);
        make_q(&r, q, H * D);
        assert_ok(kvh_attention_decode(e, layer, &s, 1, q, out, &p));
        ref_batch(&m, NULL, 1, layer, q, H, 0, ref);
        assert_out_near(out, KVH_DTYPE_F32, ref, H * D);
        uint32_t ql = 5 * BT;
        make_q(&r, q, ql * H * D);
        assert_ok(kvh_attention_prefill(e, layer, &s, &ql, 1, q, out, &p));
        ref_batch(&m, &ql, 1, layer, q, H, 0, ref);
        assert_out_near(out, KVH_DTYPE_F32, ref, (size_t)ql * H * D);
        /* nothing promoted; the window may have evicted device blocks */
        for (int i = 0; i < 6; i++) {
            uint32_t t = block_tier(e, s, (uint64_t)i);
            assert_true(i < 4 ? t == want_tier[i] : t != KVH_TIER_DISK);
        }
        assert_int_equal(tu_seq_binfo(e, s, 0).holds, 0);
    }
    kvh_stats after = tu_stats(e);
    assert_true(after.blocks_streamed_disk > before.blocks_streamed_disk);
    assert_true(after.blocks_streamed_host > before.blocks_streamed_host);
}

/* ================================================================== */
/* Attention plans                                                    */
/* ================================================================== */

#define PLAN_SENTINEL ((kvh_attention_plan *)(uintptr_t)0x5151)

static void test_plan_create_misuse_change_nothing(void **state)
{
    (void)state;
    kvh_engine *e = open_plain(KVH_DTYPE_F32, 16, 16);
    kvh_engine *other = open_plain(KVH_DTYPE_F32, 16, 0);
    kv_model *ma, *mh, *mo;
    kvh_seq a = seq_make(e, KVH_DTYPE_F32, &ma, 40, 15);
    kvh_seq on_host = seq_make(e, KVH_DTYPE_F32, &mh, 20, 16);
    assert_ok(kvh_seq_migrate(e, on_host, 0, 20, KVH_TIER_HOST, NULL));
    kvh_seq empty = tu_seq_new(e, 0);
    kvh_seq freed = tu_seq_new(e, 0);
    assert_ok(kvh_seq_free(e, freed));
    kvh_seq foreign = seq_make(other, KVH_DTYPE_F32, &mo, 5, 17);
    kvh_seq all[] = {a, on_host, empty};
    uint8_t dummy;
    scene sc = {.e = e, .seqs = all, .ns = 3, .out = &dummy, .out_bytes = 0};
    scene *c = &sc;
    kvh_attention_plan *pl = PLAN_SENTINEL;
    kvh_attention_params p = params(0, 0, KVH_DTYPE_F32);
    uint32_t zeros[2] = {0, 0}, ql = 5, too_long = 41;
    kvh_seq two[] = {a, a};

    MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_plan_create(NULL, 0, &a, NULL, 1, &p, &pl));
    MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_plan_create(e, 0, &a, NULL, 1, &p, NULL));
    MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_plan_create(e, 0, NULL, NULL, 1, &p, &pl));
    MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_plan_create(e, 0, &a, NULL, 0, &p, &pl));
    MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_plan_create(e, 0, two, zeros, 2, &p, &pl));
    MISUSE(c, KVH_ERR_RANGE, kvh_attention_plan_create(e, L, &a, NULL, 1, &p, &pl));
    MISUSE(c, KVH_ERR_RANGE, kvh_attention_plan_create(e, UINT32_MAX, &a, &ql, 1, &p, &pl));
    MISUSE(c, KVH_ERR_RANGE, kvh_attention_plan_create(e, 0, &a, &too_long, 1, &p, &pl));
    uint32_t huge_one[] = {2, UINT32_MAX - 2};
    MISUSE(c, KVH_ERR_RANGE, kvh_attention_plan_create(e, 0, two, huge_one, 2, &p, &pl));
    MISUSE(c, KVH_ERR_RANGE, kvh_attention_plan_create(e, 0, &empty, NULL, 1, &p, &pl));
    kvh_seq with_empty[] = {a, empty};
    MISUSE(c, KVH_ERR_RANGE, kvh_attention_plan_create(e, 0, with_empty, NULL, 2, &p, &pl));
    MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_attention_plan_create(e, 0, &freed, NULL, 1, &p, &pl));
    MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_attention_plan_create(e, 0, &foreign, NULL, 1, &p, &pl));
    kvh_seq bad_second[] = {a, freed};
    MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_attention_plan_create(e, 0, bad_second, NULL, 2, &p, &pl));
    MISUSE(c, KVH_ERR_NOT_RESIDENT, kvh_attention_plan_create(e, 0, &on_host, NULL, 1, &p, &pl));
    kvh_seq res_second[] = {a, on_host};
    MISUSE(c, KVH_ERR_NOT_RESIDENT, kvh_attention_plan_create(e, 0, res_second, NULL, 2, &p, &pl));
    {
        kvh_attention_params b = params(3, 0, KVH_DTYPE_F32);
        MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_plan_create(e, 0, &a, NULL, 1, &b, &pl));
        b = params(1u << 30, 0, KVH_DTYPE_F32);
        MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_plan_create(e, 0, &a, NULL, 1, &b, &pl));
        b = params(0, NAN, KVH_DTYPE_F32);
        MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_plan_create(e, 0, &a, NULL, 1, &b, &pl));
        b = params(0, 0, 7);
        MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_plan_create(e, 0, &a, NULL, 1, &b, &pl));
        b = params(0, 0, KVH_DTYPE_F32);
        b.struct_size = 44;
        MISUSE(c, KVH_ERR_STRUCT_SIZE, kvh_attention_plan_create(e, 0, &a, NULL, 1, &b, &pl));
        b.struct_size = 0;
        MISUSE(c, KVH_ERR_STRUCT_SIZE, kvh_attention_plan_create(e, 0, &a, NULL, 1, &b, &pl));
        b = params(0, 0, KVH_DTYPE_F32);
        b.stream_chunk_blocks = 1;
        b.stream_window_blocks = 2;
        MISUSE(c, KVH_ERR_UNSUPPORTED, kvh_attention_plan_create(e, 0, &a, NULL, 1, &b, &pl));
    }
    assert_ptr_equal(pl, PLAN_SENTINEL);
    (void)ma;
    (void)mh;
}

/* Decode and prefill plans give the reference numbers, run after run; a
 * later write into a planned token is seen, a later append is not. */
static void test_plan_runs_match_reference(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(0xa77e08)};
    kvh_engine *e = open_plain(KVH_DTYPE_BF16, 32, 0);
    kv_model *ma, *mb;
    kvh_seq a = seq_make(e, KVH_DTYPE_BF16, &ma, 35, 18);
    kvh_seq b = seq_make(e, KVH_DTYPE_BF16, &mb, 16, 19);
    kvh_seq batch[] = {a, b, a};
    kv_model *pm = model_copy(ma); /* what the plans read of a */
    kv_model *ms[] = {pm, mb, pm};
    enum { QH = 4 * H };
    uint32_t ql[] = {20, 16, 1};
    kvh_attention_params p = params(QH, 0.3f, KVH_DTYPE_F16);
    kvh_attention_plan *dec = NULL, *pre = NULL;
    assert_ok(kvh_attention_plan_create(e, 1, batch, NULL, 3, &p, &dec));
    assert_ok(kvh_attention_plan_create(e, 0, batch, ql, 3, &p, &pre));
    assert_non_null(dec);
    assert_non_null(pre);
    assert_true(dec != pre);
    float *q = tu_alloc(37 * QH * D * sizeof(float));
    uint16_t *qb = tu_alloc(37 * QH * D * 2), *ob = tu_alloc(37 * QH * D * 2);
    double *ref = tu_alloc(37 * QH * D * sizeof(double));
    for (int round = 0; round < 3; round++) {
        if (round == 1) {
            /* Writes into planned tokens. The partial last block is a's
             * alone and written in place: seen by later runs. A full block
             * (published) may be replaced by a copy on write: then the
             * plans keep reading the old block. */
            kvh_block last = seq_block(e, a, 2), full = seq_block(e, a, 0);
            ma->v[1][34][1][5] = ma->v[0][34][0][7] = 3.0f;
            ma->k[1][34][1][5] = ma->k[0][34][1][1] = -2.0f;
            ma->v[0][3][0][0] = ma->k[1][3][1][0] = -3.0f;
            write_range(e, KVH_DTYPE_BF16, a, ma, 34, 1);
            write_range(e, KVH_DTYPE_BF16, a, ma, 3, 1);
            assert_int_equal(seq_block(e, a, 2).id, last.id);
            memcpy(pm, ma, sizeof(*pm));
            if (seq_block(e, a, 0).id != full.id)
                for (uint32_t l = 0; l < L; l++)
                    for (uint32_t h = 0; h < H; h++)
                        for (uint32_t d = 0; d < D; d++) {
                            pm->k[l][3][h][d] = kv_val(18, l, 3, h, 0, d);
                            pm->v[l][3][h][d] = kv_val(18, l, 3, h, 1, d);
                        }
        }
        if (round == 2) {
            /* an append is not */
            kv_model *grown = model_copy(ma);
            seq_extend(e, KVH_DTYPE_BF16, a, grown, 20, 20);
            tu_free(grown);
        }
        make_q(&r, q, 3 * QH * D);
        to_dtype(KVH_DTYPE_F16, q, qb, 3 * QH * D);
        assert_ok(kvh_attention_run(e, dec, qb, ob, NULL));
        ref_batch(ms, NULL, 3, 1, q, QH, p.scale, ref);
        assert_out_near(ob, KVH_DTYPE_F16, ref, 3 * QH * D);
        make_q(&r, q, 37 * QH * D);
        to_dtype(KVH_DTYPE_F16, q, qb, 37 * QH * D);
        assert_ok(kvh_attention_run(e, pre, qb, ob, (void *)(uintptr_t)0xdead)); /* stream ignored on the CPU */
        ref_batch(ms, ql, 3, 0, q, QH, p.scale, ref);
        assert_out_near(ob, KVH_DTYPE_F16, ref, 37 * QH * D);
    }
    assert_ok(kvh_attention_plan_destroy(e, dec));
    assert_ok(kvh_attention_plan_destroy(e, pre));
}

/* Run and destroy refuse NULL, destroyed, forged and foreign plans (and
 * other handles passed as plans) without touching the caller's memory or
 * the real plan. */
static void test_plan_stale_forged_and_foreign(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(0xa77e09)};
    kvh_engine *e = open_plain(KVH_DTYPE_F32, 16, 16);
    kvh_engine *other = open_plain(KVH_DTYPE_F32, 16, 0);
    kv_model *m, *mo;
    kvh_seq s = seq_make(e, KVH_DTYPE_F32, &m, 24, 21);
    kvh_seq so = seq_make(other, KVH_DTYPE_F32, &mo, 24, 21);
    kvh_attention_plan *pl = NULL, *dead = NULL, *foreign = NULL;
    assert_ok(kvh_attention_plan_create(e, 0, &s, NULL, 1, NULL, &dead));
    assert_ok(kvh_attention_plan_destroy(e, dead));
    assert_ok(kvh_attention_plan_create(e, 0, &s, NULL, 1, NULL, &pl));
    assert_true(pl != dead); /* no value handed out twice */
    assert_ok(kvh_attention_plan_create(other, 0, &so, NULL, 1, NULL, &foreign));
    float q[H * D], out[H * D];
    kvh_seq all[] = {s};
    scene sc = {.e = e, .seqs = all, .ns = 1, .out = out, .out_bytes = sizeof(out)};
    scene *c = &sc;
    make_q(&r, q, H * D);
    MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_run(e, NULL, q, out, NULL));
    MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_run(e, pl, NULL, out, NULL));
    MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_run(e, pl, q, NULL, NULL));
    MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_run(NULL, pl, q, out, NULL));
    MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_plan_destroy(NULL, pl));
    kvh_attention_plan *bad[] = {
        dead,
        foreign,
        (kvh_attention_plan *)(uintptr_t)1,
        (kvh_attention_plan *)(uintptr_t) ~(uintptr_t)pl,
        (kvh_attention_plan *)((uintptr_t)pl ^ ((uintptr_t)1 << 40)),
        (kvh_attention_plan *)((uintptr_t)pl ^ ((uintptr_t)1 << 63)),
        (kvh_attention_plan *)(uintptr_t)s.id,
        (kvh_attention_plan *)(uintptr_t)seq_block(e, s, 0).id,
        (kvh_attention_plan *)(void *)q, /* a real address */
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_attention_run(e, bad[i], q, out, NULL));
        MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_attention_plan_destroy(e, bad[i]));
    }
    /* a NULL destroy is accepted and changes nothing */
    MISUSE(c, KVH_OK, kvh_attention_plan_destroy(e, NULL));
    double ref[H * D];
    assert_ok(kvh_attention_run(e, pl, q, out, NULL));
    ref_batch(&m, NULL, 1, 0, q, H, 0, ref);
    assert_out_near(out, KVH_DTYPE_F32, ref, H * D);
    assert_ok(kvh_attention_run(other, foreign, q, out, NULL));
    ref_batch(&mo, NULL, 1, 0, q, H, 0, ref);
    assert_out_near(out, KVH_DTYPE_F32, ref, H * D);
    assert_ok(kvh_attention_plan_destroy(e, pl));
    MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_attention_plan_destroy(e, pl));
    MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_attention_run(e, pl, q, out, NULL));
    assert_ok(kvh_attention_plan_destroy(other, foreign));
    /* the plan's holds are gone: every block can leave the device tier */
    assert_ok(kvh_seq_migrate(e, s, 0, 24, KVH_TIER_HOST, NULL));
    assert_int_equal(block_tier(e, s, 0), KVH_TIER_HOST);
    assert_int_equal(block_tier(e, s, 1), KVH_TIER_HOST);
}

/* A plan keeps reading the blocks it was made over: a fork's copy-on-write
 * is not seen by either side's plan, a write into a block the plans hold
 * is, unless it replaced the block by a copy. Truncating and freeing the sequence under a plan leaves its output
 * undefined but must never fault, and the plan is still destroyed cleanly
 * with nothing left held. */
static void test_plan_after_fork_truncate_and_free(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(0xa77e0a)};
    enum { DEV = 8 };
    kvh_engine *e = open_plain(KVH_DTYPE_F32, DEV, 0);
    kv_model *ma;
    kvh_seq a = seq_make(e, KVH_DTYPE_F32, &ma, 40, 22);
    kvh_seq c;
    assert_ok(kvh_seq_fork(e, a, 0, &c));
    kvh_attention_plan *pa = NULL, *pc = NULL;
    assert_ok(kvh_attention_plan_create(e, 0, &a, NULL, 1, NULL, &pa));
    assert_ok(kvh_attention_plan_create(e, 0, &c, NULL, 1, NULL, &pc));
    /* c copies its shared block 0 on write */
    kv_model *mc = model_copy(ma);
    for (uint32_t d = 0; d < D; d++)
        mc->v[0][5][0][d] = mc->v[0][5][1][d] = 2.0f;
    write_range(e, KVH_DTYPE_F32, c, mc, 5, 1);
    assert_true(seq_block(e, a, 0).id != seq_block(e, c, 0).id);
    /* a's block 0 is its own now, but full (published): a write may
     * replace it by a copy, which neither plan sees */
    kv_model *planned = model_copy(ma);
    kvh_block a0 = seq_block(e, a, 0);
    for (uint32_t d = 0; d < D; d++)
        ma->k[0][6][1][d] = 1.5f;
    write_range(e, KVH_DTYPE_F32, a, ma, 6, 1);
    if (seq_block(e, a, 0).id == a0.id)
        memcpy(planned, ma, sizeof(*planned));

    float q[H * D], out[H * D];
    double ref[H * D];
    make_q(&r, q, H * D);
    /* both plans read the blocks they were made over: c's copy is not
     * among them */
    ref_batch(&planned, NULL, 1, 0, q, H, 0, ref);
    assert_ok(kvh_attention_run(e, pa, q, out, NULL));
    assert_out_near(out, KVH_DTYPE_F32, ref, H * D);
    assert_ok(kvh_attention_run(e, pc, q, out, NULL));
    assert_out_near(out, KVH_DTYPE_F32, ref, H * D);
    assert_ok(kvh_attention_decode(e, 0, &c, 1, q, out, NULL)); /* a fresh call sees the copy */
    ref_batch(&mc, NULL, 1, 0, q, H, 0, ref);
    assert_out_near(out, KVH_DTYPE_F32, ref, H * D);

    /* truncate a under its plan, then refill the freed slots with other data */
    assert_ok(kvh_seq_truncate(e, a, 3));
    kv_model *mx;
    kvh_seq x = seq_make(e, KVH_DTYPE_F32, &mx, 3 * BT, 23);
    assert_ok(kvh_attention_run(e, pa, q, out, NULL)); /* output undefined, no fault */
    assert_ok(kvh_seq_free(e, a));
    assert_ok(kvh_seq_free(e, c));
    assert_ok(kvh_seq_free(e, x));
    kvh_seq y = seq_make(e, KVH_DTYPE_F32, &mx, 4 * BT, 24);
    assert_ok(kvh_attention_run(e, pa, q, out, NULL));
    assert_ok(kvh_attention_run(e, pc, q, out, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_attention_decode(e, 0, &a, 1, q, out, NULL));
    assert_ok(kvh_attention_plan_destroy(e, pa));
    assert_ok(kvh_attention_plan_destroy(e, pc));
    assert_ok(kvh_seq_free(e, y));
    /* nothing is left held or pinned: a sequence can fill the whole device
     * tier and be acquired there */
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).pinned_blocks, 0);
    kv_model *mz;
    kvh_seq z = seq_make(e, KVH_DTYPE_F32, &mz, DEV * BT - 5, 25);
    assert_ok(kvh_seq_acquire(e, z, 0, DEV * BT - 5, NULL));
    for (uint64_t i = 0; i < DEV; i++)
        assert_int_equal(block_tier(e, z, i), KVH_TIER_DEVICE);
    make_q(&r, q, H * D);
    assert_ok(kvh_attention_decode(e, 1, &z, 1, q, out, NULL));
    ref_batch(&mz, NULL, 1, 1, q, H, 0, ref);
    assert_out_near(out, KVH_DTYPE_F32, ref, H * D);
    assert_ok(kvh_seq_release(e, z, 0, DEV * BT - 5));
}

/* A plan's blocks stay in the device tier in the same slots until it is
 * destroyed, whatever migration asks. */
static void test_plan_holds_blocks_against_migration(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(0xa77e0b)};
    kvh_engine *e = open_plain(KVH_DTYPE_F32, 8, 16);
    kv_model *m;
    kvh_seq s = seq_make(e, KVH_DTYPE_F32, &m, 3 * BT, 26);
    uint32_t slots[3];
    for (int i = 0; i < 3; i++)
        slots[i] = tu_seq_binfo(e, s, (uint64_t)i).slot;
    kvh_attention_plan *pl = NULL;
    assert_ok(kvh_attention_plan_create(e, 1, &s, NULL, 1, NULL, &pl));
    kvh_status st = kvh_seq_migrate(e, s, 0, 3 * BT, KVH_TIER_HOST, NULL);
    assert_true(st == KVH_OK || st == KVH_ERR_BUSY || st == KVH_ERR_NOSPACE);
    /* crowd the device tier so that eviction looks for victims */
    kv_model *mo;
    kvh_seq crowd = seq_make(e, KVH_DTYPE_F32, &mo, 8 * BT, 27);
    for (int i = 0; i < 3; i++) {
        kvh_block_info bi = tu_seq_binfo(e, s, (uint64_t)i);
        assert_int_equal(bi.tier, KVH_TIER_DEVICE);
        assert_int_equal(bi.slot, slots[i]);
    }
    float q[H * D], out[H * D];
    double ref[H * D];
    make_q(&r, q, H * D);
    assert_ok(kvh_attention_run(e, pl, q, out, NULL));
    ref_batch(&m, NULL, 1, 1, q, H, 0, ref);
    assert_out_near(out, KVH_DTYPE_F32, ref, H * D);
    assert_ok(kvh_attention_plan_destroy(e, pl));
    assert_ok(kvh_seq_migrate(e, s, 0, 3 * BT, KVH_TIER_HOST, NULL));
    for (int i = 0; i < 3; i++)
        assert_int_equal(block_tier(e, s, (uint64_t)i), KVH_TIER_HOST);
    (void)crowd;
}

/* ================================================================== */
/* Virtual contiguity                                                 */
/* ================================================================== */

#define VMAP_SENTINEL ((kvh_vmap *)(uintptr_t)0x7171)

/* The view shows exactly the model's K and V of its layer. */
static void check_view_contents(kvh_engine *e, kvh_vmap *vm, const kv_model *m, uint32_t layer)
{
    kvh_vmap_view v = tu_vmap_view(e, vm);
    assert_int_equal(v.layer, layer);
    assert_int_equal(v.n_tokens, m->len);
    assert_true(v.capacity_tokens >= v.n_tokens);
    assert_int_equal(v.capacity_tokens & (v.capacity_tokens - 1), 0);
    assert_true(v.head_stride >= v.capacity_tokens * D * sizeof(float));
    assert_non_null(v.k);
    assert_non_null(v.v);
    assert_non_null(v.backing);
    assert_true(!strcmp(v.backing, "hugetlb") || !strcmp(v.backing, "thp") || !strcmp(v.backing, "4k"));
    assert_true(v.map_unit >= 4096 && (v.map_unit & (v.map_unit - 1)) == 0);
    for (uint32_t h = 0; h < H; h++)
        for (uint32_t t = 0; t < m->len; t++) {
            const uint8_t *kp = (const uint8_t *)v.k + h * v.head_stride + (size_t)t * D * sizeof(float);
            const uint8_t *vp = (const uint8_t *)v.v + h * v.head_stride + (size_t)t * D * sizeof(float);
            if (memcmp(kp, m->k[layer][t][h], D * sizeof(float)) || memcmp(vp, m->v[layer][t][h], D * sizeof(float)))
                fail_msg("view of layer %u differs at head %u token %u", layer, h, t);
        }
}

static void test_vmap_create_misuse_change_nothing(void **state)
{
    (void)state;
    kvh_engine *e = open_vmap(16, 16);
    kvh_engine *plain = open_plain(KVH_DTYPE_F32, 16, 0);
    kv_model *ma, *mh, *mp;
    kvh_seq a = seq_make(e, KVH_DTYPE_F32, &ma, 40, 28);
    kvh_seq on_host = seq_make(e, KVH_DTYPE_F32, &mh, 20, 29);
    assert_ok(kvh_seq_migrate(e, on_host, 0, 20, KVH_TIER_HOST, NULL));
    kvh_seq freed = tu_seq_new(e, 0);
    assert_ok(kvh_seq_free(e, freed));
    kvh_seq ps = seq_make(plain, KVH_DTYPE_F32, &mp, 20, 30);
    kvh_seq all[] = {a, on_host};
    uint8_t dummy;
    scene sc = {.e = e, .seqs = all, .ns = 2, .out = &dummy, .out_bytes = 0};
    scene *c = &sc;
    kvh_vmap *vm = VMAP_SENTINEL;
    MISUSE(c, KVH_ERR_INVALID_ARG, kvh_seq_vmap(e, a, 0, 0, NULL));
    MISUSE(c, KVH_ERR_INVALID_ARG, kvh_seq_vmap(NULL, a, 0, 0, &vm));
    MISUSE(c, KVH_ERR_RANGE, kvh_seq_vmap(e, a, L, 0, &vm));
    MISUSE(c, KVH_ERR_RANGE, kvh_seq_vmap(e, a, UINT32_MAX, 64, &vm));
    MISUSE(c, KVH_ERR_RANGE, kvh_seq_vmap(e, a, 0, (1ull << 31) + 1, &vm));
    MISUSE(c, KVH_ERR_RANGE, kvh_seq_vmap(e, a, 0, 1ull << 32, &vm));
    MISUSE(c, KVH_ERR_RANGE, kvh_seq_vmap(e, a, 0, UINT64_MAX, &vm));
    MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_seq_vmap(e, freed, 0, 0, &vm));
    MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_seq_vmap(e, (kvh_seq){0}, 0, 0, &vm));
    MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_seq_vmap(e, (kvh_seq){~a.id}, 0, 0, &vm));
    MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_seq_vmap(e, ps, 0, 0, &vm));
    MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_seq_vmap(e, (kvh_seq){seq_block(e, a, 0).id}, 0, 0, &vm));
    MISUSE(c, KVH_ERR_NOT_RESIDENT, kvh_seq_vmap(e, on_host, 0, 0, &vm));
    assert_ptr_equal(vm, VMAP_SENTINEL);
    /* an engine without vmap, and a geometry whose head block is half a page */
    kvh_seq pall[] = {ps};
    scene sp = {.e = plain, .seqs = pall, .ns = 1, .out = &dummy, .out_bytes = 0};
    MISUSE(&sp, KVH_ERR_UNSUPPORTED, kvh_seq_vmap(plain, ps, 0, 0, &vm));
    kvh_config hc = tu_cfg(L, H, 32, BT, KVH_DTYPE_F32, 16, 0, 1);
    hc.vmap = 1;
    kvh_engine *half = tu_open_cfg(&hc);
    kvh_seq hs = tu_seq_new(half, 0);
    int32_t tok[20];
    tu_iota(tok, 20, 1);
    assert_ok(kvh_seq_append(half, hs, tok, 20));
    kvh_seq hall[] = {hs};
    scene sh = {.e = half, .seqs = hall, .ns = 1, .out = &dummy, .out_bytes = 0};
    MISUSE(&sh, KVH_ERR_UNSUPPORTED, kvh_seq_vmap(half, hs, 0, 0, &vm));
    assert_ptr_equal(vm, VMAP_SENTINEL);
    (void)ma;
    (void)mh;
}

/* kvh_vmap_get: NULL pointers, sizes it does not know (nothing written),
 * and smaller sizes (filled up to them only). */
static void test_vmap_get_struct_sizes(void **state)
{
    (void)state;
    kvh_engine *e = open_vmap(16, 0);
    kv_model *m;
    kvh_seq s = seq_make(e, KVH_DTYPE_F32, &m, 20, 31);
    kvh_vmap *vm = NULL;
    assert_ok(kvh_seq_vmap(e, s, 1, 0, &vm));
    assert_non_null(vm);
    check_view_contents(e, vm, m, 1);
    kvh_vmap_view full = tu_vmap_view(e, vm);
    assert_int_equal(full.capacity_tokens, 32); /* 0: the current length, to a power of two */
    uint8_t buf[sizeof(kvh_vmap_view) + 64];
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_vmap_get(e, vm, NULL));
    assert_true(kvh_last_error()[0] != 0);
    memset(buf, 0xcd, sizeof(buf));
    ((kvh_vmap_view *)(void *)buf)->struct_size = sizeof(kvh_vmap_view);
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_vmap_get(e, NULL, (kvh_vmap_view *)(void *)buf));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_vmap_get(NULL, vm, (kvh_vmap_view *)(void *)buf));
    for (size_t j = 4; j < sizeof(buf); j++)
        assert_int_equal(buf[j], 0xcd);
    const uint32_t bad[] = {0, 4, 12, 33, sizeof(kvh_vmap_view) + 8, 4096, UINT32_MAX};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        memset(buf, 0xcd, sizeof(buf));
        memcpy(buf, &bad[i], 4);
        assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_vmap_get(e, vm, (kvh_vmap_view *)(void *)buf));
        assert_true(kvh_last_error()[0] != 0);
        for (size_t j = 4; j < sizeof(buf); j++)
            assert_int_equal(buf[j], 0xcd);
    }
    for (uint32_t sz = 8; sz <= sizeof(kvh_vmap_view); sz += 8) {
        memset(buf, 0xcd, sizeof(buf));
        memcpy(buf, &sz, 4);
        assert_ok(kvh_vmap_get(e, vm, (kvh_vmap_view *)(void *)buf));
        assert_memory_equal(buf + 4, (const uint8_t *)&full + 4, sz - 4);
        for (size_t j = sz; j < sizeof(buf); j++)
            assert_int_equal(buf[j], 0xcd);
    }
    assert_ok(kvh_vmap_release(e, vm));
}

/* Decode and prefill over views give the reference numbers and equal the
 * paged calls bit for bit, for a batch of views of several sequences,
 * layers and forks, the same view twice included. */
static void test_vmap_attention_matches_reference(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(0xa77e0c)};
    kvh_engine *e = open_vmap(64, 0);
    kv_model *ma, *mb;
    kvh_seq a = seq_make(e, KVH_DTYPE_F32, &ma, 50, 32);
    kvh_seq b = seq_make(e, KVH_DTYPE_F32, &mb, 16, 33);
    kvh_seq c;
    assert_ok(kvh_seq_fork(e, a, 0, &c));
    kv_model *mc = model_copy(ma);
    seq_extend(e, KVH_DTYPE_F32, c, mc, 21, 34);
    kvh_seq seqs[] = {a, b, c};
    kv_model *ms[] = {ma, mb, mc};
    for (uint32_t layer = 0; layer < L; layer++) {
        kvh_vmap *v[3];
        for (int i = 0; i < 3; i++) {
            assert_ok(kvh_seq_vmap(e, seqs[i], layer, i == 1 ? 1000 : 0, &v[i]));
            check_view_contents(e, v[i], ms[i], layer);
        }
        assert_int_equal(tu_vmap_view(e, v[1]).capacity_tokens, 1024);
        kvh_vmap *batch[] = {v[0], v[1], v[2], v[0]};
        kvh_seq pseqs[] = {a, b, c, a};
        kv_model *pms[] = {ma, mb, mc, ma};
        const uint32_t ios[] = {KVH_DTYPE_F32, KVH_DTYPE_F16, KVH_DTYPE_BF16};
        for (int io = 0; io < 3; io++) {
            enum { QH = 2 * H };
            kvh_attention_params p = params(QH, io == 1 ? 0.2f : 0.0f, ios[io]);
            uint32_t ql[] = {17, 16, 2, 50};
            size_t rows = 17 + 16 + 2 + 50;
            float *q = tu_alloc(rows * QH * D * sizeof(float));
            void *qb = tu_alloc(rows * QH * D * 4), *o1 = tu_alloc(rows * QH * D * 4),
                 *o2 = tu_alloc(rows * QH * D * 4);
            double *ref = tu_alloc(rows * QH * D * sizeof(double));
            make_q(&r, q, rows * QH * D);
            to_dtype(ios[io], q, qb, rows * QH * D);
            size_t bytes = 4 * QH * D * dsize(ios[io]);
            assert_ok(kvh_attention_decode_vmap(e, batch, 4, qb, o1, &p));
            assert_ok(kvh_attention_decode(e, layer, pseqs, 4, qb, o2, &p));
            ref_batch(pms, NULL, 4, layer, q, QH, p.scale, ref);
            assert_out_near(o1, ios[io], ref, 4 * QH * D);
            assert_memory_equal(o1, o2, bytes);
            bytes = rows * QH * D * dsize(ios[io]);
            assert_ok(kvh_attention_prefill_vmap(e, batch, ql, 4, qb, o1, &p));
            assert_ok(kvh_attention_prefill(e, layer, pseqs, ql, 4, qb, o2, &p));
            ref_batch(pms, ql, 4, layer, q, QH, p.scale, ref);
            assert_out_near(o1, ios[io], ref, rows * QH * D);
            assert_memory_equal(o1, o2, bytes);
            tu_free(q);
            tu_free(qb);
            tu_free(o1);
            tu_free(o2);
            tu_free(ref);
        }
        for (int i = 0; i < 3; i++)
            assert_ok(kvh_vmap_release(e, v[i]));
    }
}

/* A change of the block table (append into a new block, copy-on-write,
 * truncation, freeing) makes the view stale: attention over it is refused
 * with nothing written until a refresh; a refresh changes the generation
 * only when it remapped something; a sequence that outgrew the capacity
 * leaves the view stale and usable; a freed sequence's view still reads
 * the old data. */
static void test_vmap_stale_after_append_cow_truncate_free(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(0xa77e0d)};
    kvh_engine *e = open_vmap(32, 0);
    kv_model *ma;
    kvh_seq a = seq_make(e, KVH_DTYPE_F32, &ma, 2 * BT, 35);
    kvh_vmap *va = NULL;
    assert_ok(kvh_seq_vmap(e, a, 0, 4 * BT, &va));
    float q[H * D], out[H * D];
    double ref[H * D];
    kvh_seq all[] = {a};
    scene sc = {.e = e, .seqs = all, .ns = 1, .out = out, .out_bytes = sizeof(out)};
    scene *c = &sc;
    int32_t changed = -1;

#define VIEW_OK(vm, m)                                                                                                 \
    do {                                                                                                               \
        make_q(&r, q, H *D);                                                                                           \
        assert_ok(kvh_attention_decode_vmap(e, &(vm), 1, q, out, NULL));                                               \
        ref_batch(&(m), NULL, 1, 0, q, H, 0, ref);                                                                     \
        assert_out_near(out, KVH_DTYPE_F32, ref, H *D);                                                                \
    } while (0)

    VIEW_OK(va, ma);
    uint64_t gen = tu_vmap_view(e, va).generation;
    assert_ok(kvh_vmap_refresh(e, va, &changed));
    assert_int_equal(changed, 0);
    assert_int_equal(tu_vmap_view(e, va).generation, gen);

    /* append into a new block */
    seq_extend(e, KVH_DTYPE_F32, a, ma, 5, 35);
    MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_attention_decode_vmap(e, &va, 1, q, out, NULL));
    uint32_t one = 1;
    MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_attention_prefill_vmap(e, &va, &one, 1, q, out, NULL));
    assert_int_equal(tu_vmap_view(e, va).n_tokens, 2 * BT);
    assert_ok(kvh_vmap_refresh(e, va, &changed));
    assert_int_equal(changed, 1);
    assert_true(tu_vmap_view(e, va).generation != gen);
    gen = tu_vmap_view(e, va).generation;
    check_view_contents(e, va, ma, 0);
    VIEW_OK(va, ma);

    /* outgrow the capacity: refused, the view stays as it was and usable
     * once the sequence fits again */
    seq_extend(e, KVH_DTYPE_F32, a, ma, 2 * BT, 35);
    assert_kvh(KVH_ERR_RANGE, kvh_vmap_refresh(e, va, &changed));
    assert_true(kvh_last_error()[0] != 0);
    assert_int_equal(tu_vmap_view(e, va).n_tokens, 2 * BT + 5);
    MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_attention_decode_vmap(e, &va, 1, q, out, NULL));
    assert_ok(kvh_seq_truncate(e, a, 3 * BT + 1));
    ma->len = 3 * BT + 1;
    assert_ok(kvh_vmap_refresh(e, va, NULL));
    check_view_contents(e, va, ma, 0);
    VIEW_OK(va, ma);

    /* truncation */
    assert_ok(kvh_seq_truncate(e, a, BT - 3));
    ma->len = BT - 3;
    MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_attention_decode_vmap(e, &va, 1, q, out, NULL));
    assert_ok(kvh_vmap_refresh(e, va, &changed));
    assert_int_equal(changed, 1);
    check_view_contents(e, va, ma, 0);
    VIEW_OK(va, ma);
    /* truncated to nothing: a view of no tokens is a range error */
    assert_ok(kvh_seq_truncate(e, a, 0));
    assert_ok(kvh_vmap_refresh(e, va, NULL));
    assert_int_equal(tu_vmap_view(e, va).n_tokens, 0);
    MISUSE(c, KVH_ERR_RANGE, kvh_attention_decode_vmap(e, &va, 1, q, out, NULL));
    ma->len = 0;
    seq_extend(e, KVH_DTYPE_F32, a, ma, BT + 1, 36);
    assert_ok(kvh_vmap_refresh(e, va, NULL));
    VIEW_OK(va, ma);

    /* copy-on-write in a fork: the child's view goes stale, the parent's not */
    kvh_seq ch;
    assert_ok(kvh_seq_fork(e, a, 0, &ch));
    kvh_vmap *vc = NULL;
    assert_ok(kvh_seq_vmap(e, ch, 0, 0, &vc));
    kv_model *mc = model_copy(ma);
    for (uint32_t d = 0; d < D; d++)
        mc->k[0][2][0][d] = mc->v[0][2][1][d] = -1.0f;
    write_range(e, KVH_DTYPE_F32, ch, mc, 2, 1);
    kvh_seq both[] = {a, ch};
    sc.seqs = both;
    sc.ns = 2;
    MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_attention_decode_vmap(e, &vc, 1, q, out, NULL));
    kvh_vmap *pair[] = {va, vc};
    MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_attention_decode_vmap(e, pair, 2, q, out, NULL));
    VIEW_OK(va, ma);
    assert_ok(kvh_vmap_refresh(e, vc, &changed));
    assert_int_equal(changed, 1);
    check_view_contents(e, vc, mc, 0);
    VIEW_OK(vc, mc);

    /* freeing: the view is stale for good, but still readable (old data) */
    assert_ok(kvh_seq_free(e, ch));
    sc.seqs = all;
    sc.ns = 1;
    MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_attention_decode_vmap(e, &vc, 1, q, out, NULL));
    MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_vmap_refresh(e, vc, &changed));
    kvh_vmap_view old;
    memset(&old, 0, sizeof(old));
    old.struct_size = sizeof(old);
    assert_ok(kvh_vmap_get(e, vc, &old));
    assert_int_equal(old.n_tokens, mc->len);
    for (uint32_t t = 0; t < old.n_tokens; t++)
        assert_memory_equal((const uint8_t *)old.k + (size_t)t * D * 4, mc->k[0][t][0], D * 4);
    assert_ok(kvh_vmap_release(e, vc));
    assert_ok(kvh_vmap_release(e, va));
#undef VIEW_OK
}

static void test_vmap_attention_misuse_change_nothing(void **state)
{
    (void)state;
    kvh_engine *e = open_vmap(16, 0);
    kv_model *m;
    kvh_seq s = seq_make(e, KVH_DTYPE_F32, &m, 20, 37);
    kvh_seq empty = tu_seq_new(e, 0);
    kvh_vmap *v = NULL, *ve = NULL;
    assert_ok(kvh_seq_vmap(e, s, 0, 0, &v));
    assert_ok(kvh_seq_vmap(e, empty, 1, 64, &ve));
    assert_int_equal(tu_vmap_view(e, ve).n_tokens, 0);
    float q[4 * MAXQH * D];
    memset(q, 0, sizeof(q));
    uint8_t out[4 * MAXQH * D * 4];
    kvh_seq all[] = {s};
    scene sc = {.e = e, .seqs = all, .ns = 1, .out = out, .out_bytes = sizeof(out)};
    scene *c = &sc;
    kvh_attention_params p = params(0, 0, KVH_DTYPE_F32);
    uint32_t ql1 = 1, too_long = 21;
    kvh_vmap *null_entry[] = {v, NULL};

    MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_decode_vmap(NULL, &v, 1, q, out, &p));
    MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_decode_vmap(e, NULL, 1, q, out, &p));
    MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_decode_vmap(e, &v, 1, NULL, out, &p));
    MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_decode_vmap(e, &v, 1, q, NULL, &p));
    MISUSE2(c, KVH_ERR_INVALID_ARG, KVH_ERR_BAD_HANDLE, kvh_attention_decode_vmap(e, null_entry, 2, q, out, &p));
    MISUSE(c, KVH_ERR_RANGE, kvh_attention_decode_vmap(e, &ve, 1, q, out, &p));
    kvh_vmap *with_empty[] = {v, ve};
    MISUSE(c, KVH_ERR_RANGE, kvh_attention_decode_vmap(e, with_empty, 2, q, out, &p));
    MISUSE2(c, KVH_ERR_INVALID_ARG, KVH_OK, kvh_attention_decode_vmap(e, &v, 0, q, out, &p));
    MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_prefill_vmap(e, &v, NULL, 1, q, out, &p));
    MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_prefill_vmap(e, NULL, &ql1, 1, q, out, &p));
    MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_prefill_vmap(e, &v, &ql1, 1, NULL, out, &p));
    MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_prefill_vmap(e, &v, &ql1, 1, q, NULL, &p));
    MISUSE(c, KVH_ERR_RANGE, kvh_attention_prefill_vmap(e, &v, &too_long, 1, q, out, &p));
    uint32_t wrap[] = {UINT32_MAX, 2};
    kvh_vmap *vv[] = {v, v};
    MISUSE(c, KVH_ERR_RANGE, kvh_attention_prefill_vmap(e, vv, wrap, 2, q, out, &p));
    MISUSE(c, KVH_ERR_RANGE, kvh_attention_prefill_vmap(e, &ve, &ql1, 1, q, out, &p));
    /* No query over no tokens: nothing to do, as kvh_attention_prefill of
     * an empty sequence (q and out may be NULL). */
    uint32_t ql0 = 0;
    assert_ok(kvh_attention_prefill_vmap(e, &ve, &ql0, 1, NULL, NULL, &p));
    {
        kvh_attention_params b = params(3, 0, KVH_DTYPE_F32);
        MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_decode_vmap(e, &v, 1, q, out, &b));
        MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_prefill_vmap(e, &v, &ql1, 1, q, out, &b));
        b = params(1u << 30, 0, KVH_DTYPE_F32);
        MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_decode_vmap(e, &v, 1, q, out, &b));
        b = params(0, INFINITY, KVH_DTYPE_F32);
        MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_decode_vmap(e, &v, 1, q, out, &b));
        b = params(0, 0, 3);
        MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_decode_vmap(e, &v, 1, q, out, &b));
        MISUSE(c, KVH_ERR_INVALID_ARG, kvh_attention_prefill_vmap(e, &v, &ql1, 1, q, out, &b));
        b = params(0, 0, KVH_DTYPE_F32);
        b.struct_size = 13;
        MISUSE(c, KVH_ERR_STRUCT_SIZE, kvh_attention_decode_vmap(e, &v, 1, q, out, &b));
        MISUSE(c, KVH_ERR_STRUCT_SIZE, kvh_attention_prefill_vmap(e, &v, &ql1, 1, q, out, &b));
        b.struct_size = sizeof(kvh_attention_params) + 8;
        MISUSE(c, KVH_ERR_STRUCT_SIZE, kvh_attention_decode_vmap(e, &v, 1, q, out, &b));
    }
    assert_ok(kvh_vmap_release(e, v));
    assert_ok(kvh_vmap_release(e, ve));
}

/* Released, forged and foreign views, and plans passed as views (and the
 * other way round), are KVH_ERR_BAD_HANDLE from every call, changing
 * nothing; NULL is accepted by release only. */
static void test_vmap_stale_forged_and_foreign(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(0xa77e0e)};
    kvh_engine *e = open_vmap(16, 0);
    kvh_engine *other = open_vmap(16, 0);
    kv_model *m, *mo;
    kvh_seq s = seq_make(e, KVH_DTYPE_F32, &m, 20, 38);
    kvh_seq so = seq_make(other, KVH_DTYPE_F32, &mo, 20, 38);
    kvh_vmap *dead = NULL, *live = NULL, *foreign = NULL;
    assert_ok(kvh_seq_vmap(e, s, 0, 0, &dead));
    assert_ok(kvh_vmap_release(e, dead));
    assert_ok(kvh_seq_vmap(e, s, 0, 0, &live));
    assert_true(live != dead);
    assert_ok(kvh_seq_vmap(other, so, 0, 0, &foreign));
    kvh_attention_plan *pl = NULL;
    assert_ok(kvh_attention_plan_create(e, 0, &s, NULL, 1, NULL, &pl));
    float q[H * D], out[H * D];
    double ref[H * D];
    kvh_seq all[] = {s};
    scene sc = {.e = e, .seqs = all, .ns = 1, .out = out, .out_bytes = sizeof(out)};
    scene *c = &sc;
    make_q(&r, q, H * D);
    kvh_vmap *bad[] = {
        dead,
        foreign,
        (kvh_vmap *)(void *)pl,
        (kvh_vmap *)(uintptr_t)1,
        (kvh_vmap *)(uintptr_t) ~(uintptr_t)live,
        (kvh_vmap *)((uintptr_t)live ^ ((uintptr_t)1 << 40)),
        (kvh_vmap *)(uintptr_t)s.id,
        (kvh_vmap *)(void *)q,
    };
    uint32_t ql1 = 1;
    int32_t changed = 77;
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_attention_decode_vmap(e, &bad[i], 1, q, out, NULL));
        MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_attention_prefill_vmap(e, &bad[i], &ql1, 1, q, out, NULL));
        kvh_vmap *mixed[] = {live, bad[i]};
        MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_attention_decode_vmap(e, mixed, 2, q, out, NULL));
        MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_vmap_refresh(e, bad[i], &changed));
        assert_int_equal(changed, 77);
        kvh_vmap_view vw;
        memset(&vw, 0xcd, sizeof(vw));
        vw.struct_size = sizeof(vw);
        MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_vmap_get(e, bad[i], &vw));
        for (size_t j = 4; j < sizeof(vw); j++)
            assert_int_equal(((const uint8_t *)&vw)[j], 0xcd);
        MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_vmap_release(e, bad[i]));
    }
    /* a view is not a plan */
    MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_attention_run(e, (const kvh_attention_plan *)(void *)live, q, out, NULL));
    MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_attention_plan_destroy(e, (kvh_attention_plan *)(void *)live));
    MISUSE(c, KVH_ERR_INVALID_ARG, kvh_vmap_refresh(e, NULL, &changed));
    MISUSE(c, KVH_OK, kvh_vmap_release(e, NULL));
    /* the real ones still work */
    assert_ok(kvh_attention_decode_vmap(e, &live, 1, q, out, NULL));
    ref_batch(&m, NULL, 1, 0, q, H, 0, ref);
    assert_out_near(out, KVH_DTYPE_F32, ref, H * D);
    assert_ok(kvh_attention_decode_vmap(other, &foreign, 1, q, out, NULL));
    ref_batch(&mo, NULL, 1, 0, q, H, 0, ref);
    assert_out_near(out, KVH_DTYPE_F32, ref, H * D);
    assert_ok(kvh_attention_run(e, pl, q, out, NULL));
    assert_out_near(out, KVH_DTYPE_F32, ref, H * D); /* m and mo hold the same stream */
    assert_ok(kvh_attention_plan_destroy(e, pl));
    assert_ok(kvh_vmap_release(e, live));
    MISUSE(c, KVH_ERR_BAD_HANDLE, kvh_vmap_release(e, live));
    assert_ok(kvh_vmap_release(other, foreign));
}

/* A prefill chunk of 0 query tokens contributes no rows (paged, planned
 * and over views alike), and one batch of views may mix layers. */
static void test_empty_chunks_and_mixed_layer_views(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(0xa77e11)};
    kvh_engine *e = open_vmap(32, 0);
    kv_model *ma, *mb, *mc;
    kvh_seq a = seq_make(e, KVH_DTYPE_F32, &ma, 30, 45);
    kvh_seq b = seq_make(e, KVH_DTYPE_F32, &mb, 20, 46);
    kvh_seq c = seq_make(e, KVH_DTYPE_F32, &mc, 10, 47);
    kvh_seq batch[] = {a, b, c};
    kv_model *ms[] = {ma, mb, mc};
    uint32_t ql[] = {5, 0, 3};
    float q[8 * H * D], out[9 * H * D];
    double ref[8 * H * D];
    make_q(&r, q, 8 * H * D);
    ref_batch(ms, ql, 3, 1, q, H, 0, ref);
    memset(out, 0x7b, sizeof(out));
    assert_ok(kvh_attention_prefill(e, 1, batch, ql, 3, q, out, NULL));
    assert_out_near(out, KVH_DTYPE_F32, ref, 8 * H * D);
    for (size_t i = 8 * H * D; i < 9 * H * D; i++) /* no ninth row */
        assert_int_equal(((const uint8_t *)out)[i * 4], 0x7b);
    kvh_attention_plan *pl = NULL;
    assert_ok(kvh_attention_plan_create(e, 1, batch, ql, 3, NULL, &pl));
    memset(out, 0, sizeof(out));
    assert_ok(kvh_attention_run(e, pl, q, out, NULL));
    assert_out_near(out, KVH_DTYPE_F32, ref, 8 * H * D);
    assert_ok(kvh_attention_plan_destroy(e, pl));
    kvh_vmap *v[3], *a0 = NULL;
    for (int i = 0; i < 3; i++)
        assert_ok(kvh_seq_vmap(e, batch[i], 1, 0, &v[i]));
    memset(out, 0, sizeof(out));
    assert_ok(kvh_attention_prefill_vmap(e, v, ql, 3, q, out, NULL));
    assert_out_near(out, KVH_DTYPE_F32, ref, 8 * H * D);
    assert_ok(kvh_seq_vmap(e, a, 0, 0, &a0));
    kvh_vmap *mixed[] = {a0, v[0], v[2]};
    memset(out, 0, sizeof(out));
    assert_ok(kvh_attention_decode_vmap(e, mixed, 3, q, out, NULL));
    ref_attend(ma, 0, q, H, eff_scale(0), ma->len, ref);
    ref_attend(ma, 1, q + H * D, H, eff_scale(0), ma->len, ref + H * D);
    ref_attend(mc, 1, q + 2 * H * D, H, eff_scale(0), mc->len, ref + 2 * H * D);
    assert_out_near(out, KVH_DTYPE_F32, ref, 3 * H * D);
    /* No rows at all: q and out may be NULL, in the paged call and over
     * views alike, and a sequence without rows may be empty. */
    uint32_t none[] = {0, 0, 0};
    assert_ok(kvh_attention_prefill(e, 1, batch, none, 3, NULL, NULL, NULL));
    assert_ok(kvh_attention_prefill_vmap(e, v, none, 3, NULL, NULL, NULL));
    kvh_seq empty = tu_seq_new(e, 0);
    uint32_t zero = 0;
    assert_ok(kvh_attention_prefill(e, 1, &empty, &zero, 1, NULL, NULL, NULL));
    assert_int_equal(kvh_attention_prefill_vmap(e, v, ql, 3, NULL, out, NULL), KVH_ERR_INVALID_ARG);
    assert_ok(kvh_seq_free(e, empty));
    for (int i = 0; i < 3; i++)
        assert_ok(kvh_vmap_release(e, v[i]));
    assert_ok(kvh_vmap_release(e, a0));
}

/* A view holds its blocks in the device tier: migration and eviction
 * leave them in their slots, and its numbers stay right. */
static void test_vmap_holds_blocks_against_migration(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(0xa77e0f)};
    kvh_engine *e = open_vmap(6, 16);
    kv_model *m;
    kvh_seq s = seq_make(e, KVH_DTYPE_F32, &m, 3 * BT, 39);
    kvh_vmap *v = NULL;
    assert_ok(kvh_seq_vmap(e, s, 1, 0, &v));
    uint32_t slots[3];
    for (int i = 0; i < 3; i++)
        slots[i] = tu_seq_binfo(e, s, (uint64_t)i).slot;
    kvh_status st = kvh_seq_migrate(e, s, 0, 3 * BT, KVH_TIER_HOST, NULL);
    assert_true(st == KVH_OK || st == KVH_ERR_BUSY || st == KVH_ERR_NOSPACE);
    kv_model *mo;
    kvh_seq crowd = seq_make(e, KVH_DTYPE_F32, &mo, 6 * BT, 40);
    for (int i = 0; i < 3; i++) {
        kvh_block_info bi = tu_seq_binfo(e, s, (uint64_t)i);
        assert_int_equal(bi.tier, KVH_TIER_DEVICE);
        assert_int_equal(bi.slot, slots[i]);
    }
    check_view_contents(e, v, m, 1);
    float q[H * D], out[H * D];
    double ref[H * D];
    make_q(&r, q, H * D);
    assert_ok(kvh_attention_decode_vmap(e, &v, 1, q, out, NULL));
    ref_batch(&m, NULL, 1, 1, q, H, 0, ref);
    assert_out_near(out, KVH_DTYPE_F32, ref, H * D);
    assert_ok(kvh_vmap_release(e, v));
    assert_ok(kvh_seq_migrate(e, s, 0, 3 * BT, KVH_TIER_HOST, NULL));
    for (int i = 0; i < 3; i++)
        assert_int_equal(block_tier(e, s, (uint64_t)i), KVH_TIER_HOST);
    (void)crowd;
}

/* ================================================================== */
/* Promises at the edges                                              */
/* ================================================================== */

/* q_lens whose sum passes 2^32 (each far above its sequence's length):
 * KVH_ERR_RANGE, "when q_lens[i] exceeds the length of sequence i", from
 * the paged calls, plans and views alike (not a count of rows refused). */
static void test_prefill_q_lens_past_2_32_rows_are_range(void **state)
{
    (void)state;
    kvh_engine *e = open_vmap(16, 0);
    kv_model *m;
    kvh_seq a = seq_make(e, KVH_DTYPE_F32, &m, 40, 41);
    kvh_vmap *v = NULL;
    assert_ok(kvh_seq_vmap(e, a, 0, 0, &v));
    float q[H * D] = {0};
    uint8_t out[H * D * 4];
    kvh_seq all[] = {a};
    scene sc = {.e = e, .seqs = all, .ns = 1, .out = out, .out_bytes = sizeof(out)};
    kvh_seq three[] = {a, a, a};
    kvh_vmap *views[] = {v, v, v};
    uint32_t wrap[] = {UINT32_MAX, UINT32_MAX, 2};
    kvh_attention_plan *pl = PLAN_SENTINEL;
    MISUSE(&sc, KVH_ERR_RANGE, kvh_attention_prefill_vmap(e, views, wrap, 3, q, out, NULL));
    MISUSE(&sc, KVH_ERR_RANGE, kvh_attention_prefill(e, 0, three, wrap, 3, q, out, NULL));
    MISUSE(&sc, KVH_ERR_RANGE, kvh_attention_plan_create(e, 0, three, wrap, 3, NULL, &pl));
    assert_ptr_equal(pl, PLAN_SENTINEL);
    /* Each below 2^31 (a length attention takes), the sum past 2^32. */
    uint32_t each[] = {INT32_MAX, INT32_MAX, INT32_MAX};
    MISUSE(&sc, KVH_ERR_RANGE, kvh_attention_prefill_vmap(e, views, each, 3, q, out, NULL));
    MISUSE(&sc, KVH_ERR_RANGE, kvh_attention_prefill(e, 0, three, each, 3, q, out, NULL));
    MISUSE(&sc, KVH_ERR_RANGE, kvh_attention_plan_create(e, 0, three, each, 3, NULL, &pl));
    assert_ptr_equal(pl, PLAN_SENTINEL);
    assert_ok(kvh_vmap_release(e, v));
}

/* A streaming window larger than the whole device tier can never be had:
 * KVH_ERR_NOSPACE before any resident block is evicted to make room. */
static void test_refused_stream_window_evicts_nothing(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("attn_hostile_window", dir, sizeof(dir));
    dt_geo g = {L, H, D, BT, KVH_DTYPE_F32};
    kvh_config cfg = dt_cfg(g, dir, 8, 16, 16, 1);
    kvh_engine *e = dt_open_a(&cfg);
    kv_model *m, *mr;
    kvh_seq s = seq_make(e, KVH_DTYPE_F32, &m, 2 * BT, 42);
    kvh_seq resident = seq_make(e, KVH_DTYPE_F32, &mr, 3 * BT, 43);
    assert_ok(kvh_seq_migrate(e, s, 0, 2 * BT, KVH_TIER_DISK, NULL)); /* needs staging */
    float q[H * D] = {0};
    uint8_t out[H * D * 4];
    kvh_seq all[] = {s, resident};
    scene sc = {.e = e, .seqs = all, .ns = 2, .out = out, .out_bytes = sizeof(out)};
    kvh_attention_params p = params(0, 0, KVH_DTYPE_F32);
    p.stream_chunk_blocks = 1;
    p.stream_window_blocks = 9; /* the device tier has 8 slots */
    MISUSE(&sc, KVH_ERR_NOSPACE, kvh_attention_decode(e, 0, &s, 1, q, out, &p));
    p.stream_window_blocks = UINT32_MAX;
    MISUSE(&sc, KVH_ERR_NOSPACE, kvh_attention_decode(e, 0, &s, 1, q, out, &p));
}

/* kvh_seq_vmap with a capacity_tokens below the sequence's length:
 * KVH_ERR_RANGE ("more tokens than capacity_tokens"), not a view grown to
 * hold the sequence. */
static void test_vmap_capacity_below_length_is_range(void **state)
{
    (void)state;
    kvh_engine *e = open_vmap(16, 0);
    kv_model *m;
    kvh_seq a = seq_make(e, KVH_DTYPE_F32, &m, 40, 44);
    uint8_t dummy;
    kvh_seq all[] = {a};
    scene sc = {.e = e, .seqs = all, .ns = 1, .out = &dummy, .out_bytes = 0};
    const uint64_t caps[] = {1, 16, 32, 39};
    for (size_t i = 0; i < sizeof(caps) / sizeof(caps[0]); i++) {
        kvh_vmap *vm = VMAP_SENTINEL;
        scene_begin(&sc);
        kvh_status st = kvh_seq_vmap(e, a, 0, caps[i], &vm);
        if (st == KVH_OK) {
            kvh_vmap_view v = tu_vmap_view(e, vm);
            assert_ok(kvh_vmap_release(e, vm));
            fail_msg("capacity_tokens %" PRIu64 " for 40 tokens: KVH_OK, a view of capacity %" PRIu64
                     " (expected KVH_ERR_RANGE)",
                     caps[i], v.capacity_tokens);
        }
        scene_end_at(__FILE__, __LINE__, &sc, KVH_ERR_RANGE, 1, st, "kvh_seq_vmap(capacity below the length)");
        assert_ptr_equal(vm, VMAP_SENTINEL);
    }
}

/* "A view holds every block it maps in the device tier ... so its blocks
 * never move while it exists", also a block whose demotion the migration
 * worker starts while kvh_seq_vmap waits for another block's promotion.
 * Mapped and held while in flight, the demotion would complete: the view
 * of the unchanged sequence stale at once (decode over it
 * KVH_ERR_BAD_HANDLE), and the device slot it maps handed to other blocks,
 * whose K/V the view would then show. */
static void test_view_holds_against_a_move_in_flight(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("attn_hostile_view_move", dir, sizeof(dir));
    dt_geo g = {L, H, D, BT, KVH_DTYPE_F32};
    kvh_config cfg = dt_cfg(g, dir, 32, 32, 64, 1);
    cfg.vmap = 1;
    cfg.copy_moves = 1;
    kvh_engine *e = dt_open_a(&cfg);
    tu_rng r = {tu_seed(0xa77e10)};
    int mapped = 0;
    for (int it = 0; it < 300 && mapped < 5; it++) {
        kv_model *m;
        kvh_seq s = seq_make(e, KVH_DTYPE_F32, &m, 8 * BT, 200 + (uint64_t)it);
        assert_ok(kvh_seq_migrate(e, s, BT, 7 * BT, KVH_TIER_DISK, NULL));
        /* queued: blocks 1..7 back up, then block 0 down */
        kvh_fence up, down;
        assert_ok(kvh_seq_migrate(e, s, BT, 7 * BT, KVH_TIER_DEVICE, &up));
        assert_ok(kvh_seq_migrate(e, s, 0, BT, KVH_TIER_HOST, &down));
        kvh_vmap *v = NULL;
        kvh_status st = kvh_seq_vmap(e, s, 0, 0, &v);
        assert_ok(kvh_fence_wait(e, up, UINT64_MAX));
        assert_ok(kvh_fence_wait(e, down, UINT64_MAX));
        assert_ok(kvh_fence_free(e, up));
        assert_ok(kvh_fence_free(e, down));
        if (st == KVH_ERR_NOT_RESIDENT) { /* the view came before the promotions: try again */
            assert_ok(kvh_seq_free(e, s));
            tu_free(m);
            continue;
        }
        assert_ok(st);
        mapped++;
        uint32_t tier0 = block_tier(e, s, 0);
        float q[H * D], out[H * D];
        double ref[H * D];
        make_q(&r, q, H * D);
        kvh_status ds = kvh_attention_decode_vmap(e, &v, 1, q, out, NULL);
        /* other blocks take the free device slots */
        kv_model *mf;
        kvh_seq filler = seq_make(e, KVH_DTYPE_F32, &mf, 8 * BT, 999);
        kvh_vmap_view vw = tu_vmap_view(e, v);
        int differ = 0;
        for (uint32_t t = 0; t < BT; t++)
            differ += memcmp((const uint8_t *)vw.k + (size_t)t * D * 4, m->k[0][t][0], D * 4) != 0;
        if (tier0 != KVH_TIER_DEVICE || ds != KVH_OK || differ)
            fail_msg("iteration %d: a view of an unchanged sequence: its block 0 left the device tier (tier %u), "
                     "decode over it gives %s, and %d of block 0's %d tokens in it are another sequence's",
                     it, tier0, kvh_status_name(ds), differ, BT);
        ref_batch(&m, NULL, 1, 0, q, H, 0, ref);
        assert_out_near(out, KVH_DTYPE_F32, ref, H * D);
        assert_ok(kvh_vmap_release(e, v));
        assert_ok(kvh_seq_free(e, filler));
        assert_ok(kvh_seq_free(e, s));
        tu_free(m);
        tu_free(mf);
    }
    if (!mapped)
        print_message("no view was made while the moves ran: nothing checked\n");
}

static int teardown(void **state)
{
    dt_teardown(state);
    return tu_teardown(state);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_params_init_struct_sizes, teardown),
        cmocka_unit_test_teardown(test_decode_matches_reference_all_dtypes, teardown),
        cmocka_unit_test_teardown(test_prefill_matches_reference, teardown),
        cmocka_unit_test_teardown(test_prefill_masked_non_finite_values_stay_masked, teardown),
        cmocka_unit_test_teardown(test_finite_inputs_past_the_float_range_on_every_kernel, teardown),
        cmocka_unit_test_teardown(test_a_merge_past_the_float_range_is_computed_again, teardown),
        cmocka_unit_test_teardown(test_a_streamed_merge_past_the_float_range_is_nan, teardown),
        cmocka_unit_test_teardown(test_only_rows_past_the_float_range_are_redone, teardown),
        cmocka_unit_test_teardown(test_streamed_rows_past_the_float_range_are_nan, teardown),
#if defined(__x86_64__) || defined(__i386__)
        cmocka_unit_test_teardown(test_callers_fp_environment_changes_nothing, teardown),
#endif
        cmocka_unit_test_teardown(test_nan_scores_make_the_row_nan, teardown),
        cmocka_unit_test_teardown(test_params_past_struct_size_are_ignored, teardown),
        cmocka_unit_test_teardown(test_decode_and_prefill_misuse_change_nothing, teardown),
        cmocka_unit_test_teardown(test_extreme_finite_parameters, teardown),
        cmocka_unit_test_teardown(test_scores_past_the_float_range_either_way, teardown),
        cmocka_unit_test_teardown(test_output_aliasing_the_query, teardown),
        cmocka_unit_test_teardown(test_streaming_from_host_and_disk, teardown),
        cmocka_unit_test_teardown(test_plan_create_misuse_change_nothing, teardown),
        cmocka_unit_test_teardown(test_plan_runs_match_reference, teardown),
        cmocka_unit_test_teardown(test_plan_stale_forged_and_foreign, teardown),
        cmocka_unit_test_teardown(test_plan_after_fork_truncate_and_free, teardown),
        cmocka_unit_test_teardown(test_plan_holds_blocks_against_migration, teardown),
        cmocka_unit_test_teardown(test_vmap_create_misuse_change_nothing, teardown),
        cmocka_unit_test_teardown(test_vmap_get_struct_sizes, teardown),
        cmocka_unit_test_teardown(test_vmap_attention_matches_reference, teardown),
        cmocka_unit_test_teardown(test_vmap_stale_after_append_cow_truncate_free, teardown),
        cmocka_unit_test_teardown(test_vmap_attention_misuse_change_nothing, teardown),
        cmocka_unit_test_teardown(test_vmap_stale_forged_and_foreign, teardown),
        cmocka_unit_test_teardown(test_empty_chunks_and_mixed_layer_views, teardown),
        cmocka_unit_test_teardown(test_vmap_holds_blocks_against_migration, teardown),
        cmocka_unit_test_teardown(test_prefill_q_lens_past_2_32_rows_are_range, teardown),
        cmocka_unit_test_teardown(test_refused_stream_window_evicts_nothing, teardown),
        cmocka_unit_test_teardown(test_vmap_capacity_below_length_is_range, teardown),
        cmocka_unit_test_teardown(test_view_holds_against_a_move_in_flight, teardown),
    };
    return cmocka_run_group_tests_name("attention_hostile", tests, NULL, NULL);
}
