#include "core/crc32c.h"

#include <pthread.h>
#include <stdlib.h>
#include <stdbool.h>
#include <string.h>

#include "core/crc32c_fold.h"

#define POLY 0x82f63b78u         /* reflected Castagnoli polynomial */
#define POLY_NORMAL 0x11edc6f41u /* the same, x^32 included, highest power first */

static uint32_t table[8][256];
static int have_sse42, have_fold256, have_fold512;
static int best_impl;
static int active_impl; /* KVHI_CRC32C_AUTO until init or a test sets one */

/* Inputs this long and longer go through a fold, which leaves
 * KVHI_CRC32C_FOLD_BYTES to a single crc32 chain (8 bytes in 3 cycles):
 * from two rounds on it does that chain's work at about ten times its
 * speed. */
#define FOLD_MIN (2u * KVHI_CRC32C_FOLD_BYTES)
/* x^(D+31) and x^(D-33) modulo the polynomial, bit-reflected, for a fold
 * distance of D = 8 * KVHI_CRC32C_FOLD_BYTES bits: see fold_constant. */
static uint64_t fold_k[2];

/* Three independent crc32 chains hide the instruction's 3-cycle latency.
 * Chains over neighbouring STRIDE-byte lanes are merged by "shifting" a
 * CRC over STRIDE zero bytes, a linear map applied with 4 byte tables. */
#define STRIDE 4096u
static uint32_t shift_tab[4][256];
static pthread_once_t init_once = PTHREAD_ONCE_INIT;

/* x^e modulo the polynomial, bit-reflected into 32 bits. The carry-less
 * product of a lane's 64-bit half (reflected: its lowest bit the highest
 * power) with such a constant stands for half * x^(e+33), one power for
 * the product's spare top bit and 32 for the constant's place; folding a
 * half forward by D bits needs x^(D+64) for the high powers' half and x^D
 * for the other, hence e = D+31 and D-33. */
static uint64_t fold_constant(unsigned e)
{
    uint64_t r = 1;
    while (e--) {
        r <<= 1;
        if (r >> 32)
            r ^= POLY_NORMAL;
    }
    uint32_t reflected = 0;
    for (int bit = 0; bit < 32; bit++)
        reflected |= (uint32_t)((r >> bit) & 1) << (31 - bit);
    return reflected;
}

/* Whether this CPU runs impl (the flags set, in init). */
static int runs(int impl)
{
    switch (impl) {
    case KVHI_CRC32C_AUTO:
    case KVHI_CRC32C_TABLE:
        return 1;
    case KVHI_CRC32C_SSE42:
        return have_sse42;
    case KVHI_CRC32C_FOLD256:
        return have_fold256;
    case KVHI_CRC32C_FOLD:
        return have_fold512;
    default:
        return 0;
    }
}

static void init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            table[t][i] = (table[t - 1][i] >> 8) ^ table[0][table[t - 1][i] & 0xff];
#if defined(__x86_64__)
    __builtin_cpu_init();
    have_sse42 = __builtin_cpu_supports("sse4.2");
#endif
    have_fold256 = have_sse42 && kvhi_crc32c_fold256_supported();
    have_fold512 = have_sse42 && kvhi_crc32c_fold_supported();
    best_impl = have_fold512   ? KVHI_CRC32C_FOLD
                : have_fold256 ? KVHI_CRC32C_FOLD256
                : have_sse42   ? KVHI_CRC32C_SSE42
                               : KVHI_CRC32C_TABLE;
    const char *env = secure_getenv("KVH_CRC32C_IMPL"); /* A/B runs of one build */
    int named = env ? kvhi_crc32c_impl_by_name(env) : -1;
    if (named > 0 && runs(named))
        best_impl = named;
    int expected = KVHI_CRC32C_AUTO;
    __atomic_compare_exchange_n(&active_impl, &expected, best_impl, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    fold_k[0] = fold_constant(8 * KVHI_CRC32C_FOLD_BYTES + 31);
    fold_k[1] = fold_constant(8 * KVHI_CRC32C_FOLD_BYTES - 33);
    /* shift(c) = state after feeding STRIDE zero bytes from raw state c;
     * linear in c, so tabulate it per byte of c. */
    static const uint8_t zeros[STRIDE];
    uint32_t basis[32];
    for (int bit = 0; bit < 32; bit++) {
        uint32_t c = 1u << bit;
        const uint8_t *p = zeros;
        size_t n = STRIDE;
        while (n--)
            c = (c >> 8) ^ table[0][(c ^ *p++) & 0xff];
        basis[bit] = c;
    }
    for (int k = 0; k < 4; k++)
        for (int v = 0; v < 256; v++) {
            uint32_t r = 0;
            for (int b = 0; b < 8; b++)
                if (v >> b & 1)
                    r ^= basis[8 * k + b];
            shift_tab[k][v] = r;
        }
}

static inline uint32_t shift_stride(uint32_t c)
{
    return shift_tab[0][c & 0xff] ^ shift_tab[1][(c >> 8) & 0xff] ^ shift_tab[2][(c >> 16) & 0xff] ^
           shift_tab[3][c >> 24];
}

/* Slicing-by-8 software fallback. */
static uint32_t crc_sw(uint32_t crc, const uint8_t *p, size_t n)
{
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= crc;
        crc = table[7][w & 0xff] ^ table[6][(w >> 8) & 0xff] ^ table[5][(w >> 16) & 0xff] ^ table[4][(w >> 24) & 0xff] ^
              table[3][(w >> 32) & 0xff] ^ table[2][(w >> 40) & 0xff] ^ table[1][(w >> 48) & 0xff] ^ table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--)
        crc = (crc >> 8) ^ table[0][(crc ^ *p++) & 0xff];
    return crc;
}

#if defined(__x86_64__)
/* The crc32 instruction, three chains at a time over large inputs. */
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const uint8_t *p, size_t n)
{
    while (n >= 3 * STRIDE) {
        uint64_t c0 = crc, c1 = 0, c2 = 0;
        for (size_t i = 0; i < STRIDE; i += 8) {
            uint64_t a, b, c;
            memcpy(&a, p + i, 8);
            memcpy(&b, p + STRIDE + i, 8);
            memcpy(&c, p + 2 * STRIDE + i, 8);
            c0 = __builtin_ia32_crc32di(c0, a);
            c1 = __builtin_ia32_crc32di(c1, b);
            c2 = __builtin_ia32_crc32di(c2, c);
        }
        crc = shift_stride(shift_stride((uint32_t)c0) ^ (uint32_t)c1) ^ (uint32_t)c2;
        p += 3 * STRIDE;
        n -= 3 * STRIDE;
    }
    uint64_t c = crc;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = __builtin_ia32_crc32di(c, w);
        p += 8;
        n -= 8;
    }
    crc = (uint32_t)c;
    while (n--)
        crc = __builtin_ia32_crc32qi(crc, *p++);
    return crc;
}
#endif

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t crc_copy_hw(uint32_t crc, uint8_t *d, const uint8_t *p, size_t n)
{
    while (n >= 3 * STRIDE) {
        uint64_t c0 = crc, c1 = 0, c2 = 0;
        for (size_t i = 0; i < STRIDE; i += 8) {
            uint64_t a, b, c;
            memcpy(&a, p + i, 8);
            memcpy(&b, p + STRIDE + i, 8);
            memcpy(&c, p + 2 * STRIDE + i, 8);
            memcpy(d + i, &a, 8);
            memcpy(d + STRIDE + i, &b, 8);
            memcpy(d + 2 * STRIDE + i, &c, 8);
            c0 = __builtin_ia32_crc32di(c0, a);
            c1 = __builtin_ia32_crc32di(c1, b);
            c2 = __builtin_ia32_crc32di(c2, c);
        }
        crc = shift_stride(shift_stride((uint32_t)c0) ^ (uint32_t)c1) ^ (uint32_t)c2;
        p += 3 * STRIDE;
        d += 3 * STRIDE;
        n -= 3 * STRIDE;
    }
    uint64_t c = crc;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        memcpy(d, &w, 8);
        c = __builtin_ia32_crc32di(c, w);
        p += 8;
        d += 8;
        n -= 8;
    }
    crc = (uint32_t)c;
    while (n--) {
        *d++ = *p;
        crc = __builtin_ia32_crc32qi(crc, *p++);
    }
    return crc;
}
#endif

#if defined(__x86_64__)
/* The fold (512-bit, or 256-bit where wide is false), then the bytes it
 * leaves and the tail by the crc32 instruction from state 0: the running
 * state went in with the input. */
static uint32_t crc_fold(bool wide, uint32_t crc, uint8_t *d, const uint8_t *p, size_t n)
{
    uint8_t residue[KVHI_CRC32C_FOLD_BYTES];
    size_t used =
        wide ? (d ? kvhi_crc32c_fold_copy(crc, d, p, n, fold_k, residue) : kvhi_crc32c_fold(crc, p, n, fold_k, residue))
             : (d ? kvhi_crc32c_fold256_copy(crc, d, p, n, fold_k, residue)
                  : kvhi_crc32c_fold256(crc, p, n, fold_k, residue));
    crc = crc_hw(0, residue, sizeof(residue));
    return d ? crc_copy_hw(crc, d + used, p + used, n - used) : crc_hw(crc, p + used, n - used);
}
#endif

static int impl_now(void)
{
    pthread_once(&init_once, init);
    return __atomic_load_n(&active_impl, __ATOMIC_RELAXED);
}

uint32_t kvhi_crc32c_copy(uint32_t crc, void *dst, const void *src, size_t n)
{
    int impl = impl_now();
#if defined(__x86_64__)
    if (impl >= KVHI_CRC32C_FOLD256 && n >= FOLD_MIN)
        return ~crc_fold(impl == KVHI_CRC32C_FOLD, ~crc, dst, src, n);
    if (impl >= KVHI_CRC32C_SSE42)
        return ~crc_copy_hw(~crc, dst, src, n);
#endif
    (void)impl;
    memcpy(dst, src, n);
    return ~crc_sw(~crc, dst, n);
}

uint32_t kvhi_crc32c(uint32_t crc, const void *data, size_t n)
{
    int impl = impl_now();
#if defined(__x86_64__)
    if (impl >= KVHI_CRC32C_FOLD256 && n >= FOLD_MIN)
        return ~crc_fold(impl == KVHI_CRC32C_FOLD, ~crc, NULL, data, n);
    if (impl >= KVHI_CRC32C_SSE42)
        return ~crc_hw(~crc, data, n);
#endif
    (void)impl;
    return ~crc_sw(~crc, data, n);
}

int kvhi_crc32c_supported(int impl)
{
    pthread_once(&init_once, init);
    return runs(impl);
}

int kvhi_crc32c_set_impl(int impl)
{
    if (!kvhi_crc32c_supported(impl))
        return -1;
    __atomic_store_n(&active_impl, impl == KVHI_CRC32C_AUTO ? best_impl : impl, __ATOMIC_RELAXED);
    return 0;
}

int kvhi_crc32c_impl(void) { return impl_now(); }

const char *kvhi_crc32c_impl_name(int impl)
{
    return impl == KVHI_CRC32C_FOLD      ? "avx512"
           : impl == KVHI_CRC32C_FOLD256 ? "avx2"
           : impl == KVHI_CRC32C_SSE42   ? "sse42"
                                         : "table";
}

int kvhi_crc32c_impl_by_name(const char *name)
{
    for (int impl = KVHI_CRC32C_TABLE; impl <= KVHI_CRC32C_FOLD; impl++)
        if (strcmp(name, kvhi_crc32c_impl_name(impl)) == 0)
            return impl;
    return -1;
}
