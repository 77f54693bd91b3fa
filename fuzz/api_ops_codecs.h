/* fuzz_api ops: the KV codec calls on caller buffers, and the LCTRU
 * tolerance setters.
 *
 * Codec properties (kvh.h, enum kvh_codec and "KV codecs"):
 * kvh_codec_vector_bytes gives the documented record size or refuses the
 * combination; encode then decode of finite values stays within the
 * documented bound (plus the rounding to a 16-bit dtype), and nothing
 * decodes to a non-finite value unless a record was forged. */
#ifndef KVH_FUZZ_API_OPS_CODECS_H
#define KVH_FUZZ_API_OPS_CODECS_H

#include "api_harness.h"

enum { CODEC_D_MAX = 256, CODEC_N_MAX = 4 };

static uint64_t documented_vector_bytes(uint32_t codec, uint32_t dtype, uint32_t d)
{
    uint64_t eb = dtype == KVH_DTYPE_F32 ? 4 : dtype <= KVH_DTYPE_BF16 ? 2 : 0;
    uint32_t g = codec == KVH_CODEC_Q4_G32 ? 32 : codec == KVH_CODEC_Q4_G64 ? 64 : 1;
    if (!eb || !d || codec > KVH_CODEC_Q4_G64 || d % g)
        return 0;
    return codec == KVH_CODEC_NONE ? d * eb : codec == KVH_CODEC_INT8 ? 4 + d : (uint64_t)d / g * 8 + d / 2;
}

static float load_elem(uint32_t dtype, const uint8_t *p, size_t i)
{
    if (dtype == KVH_DTYPE_F32) {
        float f;
        memcpy(&f, p + 4 * i, 4);
        return f;
    }
    uint16_t h = (uint16_t)(p[2 * i] | p[2 * i + 1] << 8);
    if (dtype == KVH_DTYPE_F16)
        return half_to_float(h);
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void op_codec(state *s, fz_in *in)
{
    (void)s;
    static uint8_t src[CODEC_N_MAX * CODEC_D_MAX * 4], rec[CODEC_N_MAX * (CODEC_D_MAX * 4 + 64)],
        dst[CODEC_N_MAX * CODEC_D_MAX * 4];
    uint32_t codec = fz_u8(in) % 5, dtype = fz_u8(in) % 4;
    uint8_t c = fz_u8(in);
    uint32_t d = c < 64 ? c % 4 * 32 : c < 128 ? c % 4 * 64 : c % 130;
    size_t n = fz_u8(in) % (CODEC_N_MAX + 1);
    uint64_t want = documented_vector_bytes(codec, dtype, d), got = SENT;
    bool null_bytes = fz_u8(in) < 8;
    kvh_status st = kvh_codec_vector_bytes(codec, dtype, d, null_bytes ? NULL : &got);
    trace("codec_vector_bytes", st);
    FZ_KNOWN(st);
    if (null_bytes || !want)
        FZ_CHECK(st == KVH_ERR_INVALID_ARG && got == SENT, "vector_bytes(codec %u, dtype %u, head_dim %u): %s", codec,
                 dtype, d, kvh_status_name(st));
    else
        FZ_CHECK(st == KVH_OK && got == want, "vector_bytes(codec %u, dtype %u, head_dim %u) = %llu, documented %llu",
                 codec, dtype, d, (unsigned long long)got, (unsigned long long)want);
    /* Values: mostly finite, of one magnitude per vector; some raw bits. */
    uint8_t kind = fz_u8(in), seed = fz_u8(in);
    uint32_t eb = dtype == KVH_DTYPE_F32 ? 4 : 2;
    for (size_t i = 0; i < n * d && d <= CODEC_D_MAX; i++) {
        uint64_t r = fz_mix(seed * 65536 + i);
        if (kind < 192) {
            /* 160..191: the extremes of f32 and bf16 (subnormal, near FLT_MAX) */
            int e = kind < 160 || dtype == KVH_DTYPE_F16 ? (int)(kind % 16) - 8
                    : kind & 1                           ? 120 + kind % 8
                                                         : -126 - kind % 20;
            float f = (float)((int)(r % 2001) - 1000) / 1000 * ldexpf(1, e);
            if (dtype == KVH_DTYPE_F32)
                memcpy(src + 4 * i, &f, 4);
            else if (dtype == KVH_DTYPE_BF16) {
                uint32_t u;
                memcpy(&u, &f, 4);
                src[2 * i] = (uint8_t)(u >> 16), src[2 * i + 1] = (uint8_t)(u >> 24);
            } else { /* |f| < 256: an f16 of 8 significant bits is exact */
                float a = fabsf(f);
                int exp2;
                frexpf(a, &exp2);
                uint16_t h = 0;
                if (a >= ldexpf(1, -14)) {
                    uint32_t m = (uint32_t)lrintf(ldexpf(a, 8 - exp2)); /* 8 bits, leading one included */
                    if (m == 256)
                        m = 128, exp2++;
                    h = (uint16_t)((uint32_t)(exp2 - 1 + 15) << 10 | (m & 127) << 3);
                }
                if (f < 0)
                    h |= 0x8000;
                src[2 * i] = (uint8_t)h, src[2 * i + 1] = (uint8_t)(h >> 8);
            }
        } else
            memcpy(src + i * eb, &r, eb);
    }
    bool null_src = fz_u8(in) < 8, null_dst = fz_u8(in) < 8;
    st = kvh_codec_encode(codec, dtype, d, null_src ? NULL : src, n, null_dst ? NULL : rec);
    trace("codec_encode", st);
    FZ_KNOWN(st);
    FZ_CHECK((st == KVH_OK) == (want && (n == 0 || (!null_src && !null_dst))), "encode: %s", kvh_status_name(st));
    if (st != KVH_OK || n == 0)
        return;
    bool forged = fz_u8(in) < 16;
    if (forged) { /* decoding a forged record must only not crash */
        size_t at = fz_u8(in) % (n * want);
        rec[at] ^= (uint8_t)(1 + fz_u8(in));
    }
    st = kvh_codec_decode(codec, dtype, d, rec, n, dst);
    trace("codec_decode", st);
    FZ_CHECK(st == KVH_OK, "decode of what was encoded: %s", kvh_status_name(st));
    if (codec == KVH_CODEC_NONE || forged)
        return;
    for (size_t i = 0; i < n * d; i++) /* +-inf saturate, NaN takes the zero code */
        FZ_CHECK(isfinite(load_elem(dtype, dst, i)), "codec %u dtype %u head_dim %u: element %zu (%g) decoded as %g",
                 codec, dtype, d, i, (double)load_elem(dtype, src, i), (double)load_elem(dtype, dst, i));
    if (kind >= 192)
        return;
    float x[CODEC_D_MAX];
    /* one ulp of the returned dtype: relative, or the subnormals' spacing */
    float rounding = dtype == KVH_DTYPE_F32 ? 0 : dtype == KVH_DTYPE_F16 ? 1.0f / 1024 : 1.0f / 128;
    float spacing = dtype == KVH_DTYPE_F32 ? 0 : dtype == KVH_DTYPE_F16 ? 0x1p-24f : 0x1p-133f;
    for (size_t v = 0; v < n; v++) {
        for (uint32_t i = 0; i < d; i++)
            x[i] = load_elem(dtype, src + v * d * eb, i);
        for (uint32_t i = 0; i < d; i++) {
            float y = load_elem(dtype, dst + v * d * eb, i);
            float bound = codec_bound(codec, x, d, i) * (1 + 1e-5f) + (fabsf(x[i]) + fabsf(y)) * 1e-6f +
                          fmaxf(fabsf(y) * rounding, spacing) + 0x1p-143f; /* a subnormal scale's rounding */
            FZ_CHECK(isfinite(y) && fabsf(x[i] - y) <= bound,
                     "codec %u dtype %u head_dim %u: element %u of vector %zu: %g decoded as %g (bound %g)", codec,
                     dtype, d, i, v, (double)x[i], (double)y, (double)bound);
        }
    }
}

/* kvh_seq_set_tolerance, kvh_block_set_tolerance, kvh_seq_derive_tolerance;
 * a tolerance set on a block is what kvh_block_info reports. */
static void op_tolerance(state *s, fz_in *in)
{
    kvh_seq q = {pick(in, s->seqs, NSEQ)};
    kvh_block b = {pick(in, s->blocks, NBLK)};
    uint8_t what = fz_u8(in) % 3;
    uint64_t first = fz_u8(in) % 40, n = fz_u8(in) % 40;
    uint32_t tol = fz_u8(in) < 224 ? fz_u8(in) : 256 + fz_u8(in);
    kvh_status st;
    if (what == 0) {
        st = kvh_seq_set_tolerance(s->e, q, first, n, tol);
        trace("seq_set_tolerance", st);
        FZ_CHECK(st != KVH_OK || tol <= KVH_TOLERANCE_MAX, "tolerance %u accepted", tol);
        kvh_block bl = {SENT};
        if (st == KVH_OK && n && kvh_seq_blocks(s->e, q, first / BT, 1, &bl) == KVH_OK) {
            kvh_block_info bi = {.struct_size = sizeof(bi)};
            FZ_CHECK(kvh_block_info_get(s->e, bl, &bi) == KVH_OK && bi.tolerance == tol,
                     "block of token %llu has tolerance %u, %u was set", (unsigned long long)first, bi.tolerance, tol);
        }
    } else if (what == 1) {
        st = kvh_block_set_tolerance(s->e, b, tol);
        trace("block_set_tolerance", st);
        FZ_CHECK(st != KVH_OK || tol <= KVH_TOLERANCE_MAX, "tolerance %u accepted", tol);
        kvh_block_info bi = {.struct_size = sizeof(bi)};
        if (st == KVH_OK)
            FZ_CHECK(kvh_block_info_get(s->e, b, &bi) == KVH_OK && bi.tolerance == tol,
                     "block has tolerance %u, %u was set", bi.tolerance, tol);
    } else {
        static const float errs[] = {0, 0.25f, 1e-6f, 10, -1, NAN, INFINITY, -0.0f};
        float err = errs[fz_u8(in) % 8];
        st = kvh_seq_derive_tolerance(s->e, q, first, n, err);
        trace("seq_derive_tolerance", st);
        FZ_CHECK(st != KVH_OK || (s->codec && isfinite(err) && err >= 0),
                 "derive_tolerance(max_rel_error %g) "
                 "accepted (codec %u)",
                 (double)err, s->codec);
    }
    FZ_KNOWN(st);
}

#endif
