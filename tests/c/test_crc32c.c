/* core/crc32c.h: every implementation this CPU runs against a bit-at-a-time
 * reference, at lengths around each one's boundaries, at every alignment,
 * continued across calls, and with the copying form. */
#include "test_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/crc32c.h"

/* The definition: reflected polynomial 0x82f63b78, one bit at a time. */
static uint32_t reference(uint32_t crc, const uint8_t *p, size_t n)
{
    crc = ~crc;
    while (n--) {
        crc ^= *p++;
        for (int k = 0; k < 8; k++)
            crc = crc & 1 ? (crc >> 1) ^ 0x82f63b78u : crc >> 1;
    }
    return ~crc;
}

static const int impls[] = {KVHI_CRC32C_TABLE, KVHI_CRC32C_SSE42, KVHI_CRC32C_FOLD256, KVHI_CRC32C_FOLD};

/* Lengths at and around each path's edges: the 8-byte words, the three
 * 4096-byte chains (12288), the fold's threshold and its rounds, and a
 * block of each size kvh writes. */
static const size_t lengths[] = {0,    1,    3,    7,    8,    9,     15,    16,    255,   256,   257,   511,  512,
                                 513,  767,  768,  769,  1023, 1024,  1025,  2047,  2048,  2049,  2303,  2304, 2305,
                                 4095, 4096, 4097, 8191, 8192, 12287, 12288, 12289, 24577, 65536, 65539, 69632};

static uint8_t *random_bytes(size_t n, uint32_t seed)
{
    uint8_t *p = malloc(n);
    assert_non_null(p);
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        p[i] = (uint8_t)(x >> 24);
    }
    return p;
}

static void restore_auto(void) { assert_int_equal(kvhi_crc32c_set_impl(KVHI_CRC32C_AUTO), 0); }

static void test_known_answers(void **state)
{
    (void)state;
    /* The check value of CRC-32C ("123456789"), and RFC 3720's 32 zero
     * bytes and 32 0xff bytes. */
    uint8_t zeros[32] = {0}, ones[32];
    memset(ones, 0xff, sizeof(ones));
    for (size_t i = 0; i < sizeof(impls) / sizeof(impls[0]); i++) {
        if (kvhi_crc32c_set_impl(impls[i]) != 0)
            continue;
        assert_int_equal(kvhi_crc32c(0, "123456789", 9), 0xe3069283u);
        assert_int_equal(kvhi_crc32c(0, zeros, 32), 0x8a9136aau);
        assert_int_equal(kvhi_crc32c(0, ones, 32), 0x62a8ab43u);
        assert_int_equal(kvhi_crc32c(0, NULL, 0), 0);
    }
    restore_auto();
}

static void test_every_impl_matches_the_reference(void **state)
{
    (void)state;
    const size_t max = 69632 + 64;
    uint8_t *buf = random_bytes(max, 7);
    int ran_fold = 0, ran_fold256 = 0;
    for (size_t i = 0; i < sizeof(impls) / sizeof(impls[0]); i++) {
        if (kvhi_crc32c_set_impl(impls[i]) != 0) {
            assert_false(kvhi_crc32c_supported(impls[i]));
            continue;
        }
        assert_int_equal(kvhi_crc32c_impl(), impls[i]);
        ran_fold |= impls[i] == KVHI_CRC32C_FOLD;
        ran_fold256 |= impls[i] == KVHI_CRC32C_FOLD256;
        for (size_t l = 0; l < sizeof(lengths) / sizeof(lengths[0]); l++)
            for (size_t align = 0; align < 64; align += (lengths[l] > 4096 ? 13 : 1)) {
                const uint8_t *p = buf + align;
                size_t n = lengths[l];
                uint32_t seed = (uint32_t)(n * 31 + align); /* a running value, not only 0 */
                assert_int_equal(kvhi_crc32c(seed, p, n), reference(seed, p, n));
            }
    }
    print_message("    512-bit fold %s on this CPU\n", ran_fold ? "tested" : "not run (no AVX-512 VPCLMULQDQ)");
    print_message("    256-bit fold %s on this CPU\n", ran_fold256 ? "tested" : "not run (no AVX2 VPCLMULQDQ)");
    restore_auto();
    free(buf);
}

/* A checksum taken in pieces (a weight file read in chunks) equals the
 * whole one, wherever the pieces end. */
static void test_continued_across_calls(void **state)
{
    (void)state;
    const size_t n = 3 * 65536 + 123;
    uint8_t *buf = random_bytes(n, 11);
    uint32_t whole = reference(0, buf, n);
    for (size_t i = 0; i < sizeof(impls) / sizeof(impls[0]); i++) {
        if (kvhi_crc32c_set_impl(impls[i]) != 0)
            continue;
        uint64_t x = 99 + i;
        for (int round = 0; round < 50; round++) {
            uint32_t crc = 0;
            size_t at = 0;
            while (at < n) {
                x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                size_t take = (size_t)(x % (round % 2 ? 5000 : 70000));
                if (take > n - at)
                    take = n - at;
                crc = kvhi_crc32c(crc, buf + at, take);
                at += take;
            }
            assert_int_equal(crc, whole);
        }
    }
    restore_auto();
    free(buf);
}

static void test_copy_form_copies_exactly_and_checksums(void **state)
{
    (void)state;
    const size_t max = 69632 + 64;
    uint8_t *src = random_bytes(max, 3);
    uint8_t *dst = malloc(max + 128);
    assert_non_null(dst);
    for (size_t i = 0; i < sizeof(impls) / sizeof(impls[0]); i++) {
        if (kvhi_crc32c_set_impl(impls[i]) != 0)
            continue;
        for (size_t l = 0; l < sizeof(lengths) / sizeof(lengths[0]); l++)
            for (size_t align = 0; align < 64; align += 7) {
                size_t n = lengths[l];
                memset(dst, 0xa5, max + 128);
                uint32_t crc = kvhi_crc32c_copy(5, dst + 64 + (align ^ 9) % 64, src + align, n);
                assert_int_equal(crc, reference(5, src + align, n));
                uint8_t *d = dst + 64 + (align ^ 9) % 64;
                assert_memory_equal(d, src + align, n);
                /* Not a byte before or after. */
                for (uint8_t *q = dst; q < d; q++)
                    assert_int_equal(*q, 0xa5);
                for (uint8_t *q = d + n; q < dst + max + 128; q++)
                    assert_int_equal(*q, 0xa5);
            }
    }
    restore_auto();
    free(src);
    free(dst);
}

static void test_an_unknown_impl_is_refused(void **state)
{
    (void)state;
    int before = kvhi_crc32c_impl();
    assert_int_equal(kvhi_crc32c_set_impl(99), -1);
    assert_int_equal(kvhi_crc32c_set_impl(-1), -1);
    assert_int_equal(kvhi_crc32c_impl(), before);
    assert_true(kvhi_crc32c_supported(KVHI_CRC32C_TABLE));
    assert_string_equal(kvhi_crc32c_impl_name(KVHI_CRC32C_FOLD), "avx512");
    assert_string_equal(kvhi_crc32c_impl_name(KVHI_CRC32C_FOLD256), "avx2");
}

/* The implementation a fresh process of this program picks under
 * KVH_CRC32C_IMPL=value (NULL: unset), by name. */
static void impl_under_env(const char *value, char *name, size_t cap)
{
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        dup2(fds[1], 1);
        if (value)
            setenv("KVH_CRC32C_IMPL", value, 1);
        else
            unsetenv("KVH_CRC32C_IMPL");
        execl("/proc/self/exe", "test_crc32c", "--print-impl", (char *)NULL);
        _exit(127);
    }
    close(fds[1]);
    ssize_t got = read(fds[0], name, cap - 1);
    close(fds[0]);
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    assert_true(got > 0);
    name[got] = '\0';
}

static void test_the_environment_picks_one_the_cpu_runs(void **state)
{
    (void)state;
    int best = KVHI_CRC32C_TABLE;
    for (int impl = KVHI_CRC32C_TABLE; impl <= KVHI_CRC32C_FOLD; impl++)
        if (kvhi_crc32c_supported(impl))
            best = impl;
    char name[32];
    impl_under_env(NULL, name, sizeof(name));
    assert_string_equal(name, kvhi_crc32c_impl_name(best));
    impl_under_env("table", name, sizeof(name));
    assert_string_equal(name, "table");
    impl_under_env("sse42", name, sizeof(name));
    assert_string_equal(name, kvhi_crc32c_impl_name(best >= KVHI_CRC32C_SSE42 ? KVHI_CRC32C_SSE42 : best));
    impl_under_env("avx2", name, sizeof(name)); /* only where the CPU has it */
    assert_string_equal(name,
                        kvhi_crc32c_impl_name(kvhi_crc32c_supported(KVHI_CRC32C_FOLD256) ? KVHI_CRC32C_FOLD256 : best));
    impl_under_env("avx512", name, sizeof(name));
    assert_string_equal(name, kvhi_crc32c_impl_name(best));
    impl_under_env("crc64", name, sizeof(name)); /* unknown: ignored */
    assert_string_equal(name, kvhi_crc32c_impl_name(best));
}

int main(int argc, char **argv)
{
    if (argc == 2 && strcmp(argv[1], "--print-impl") == 0) {
        fputs(kvhi_crc32c_impl_name(kvhi_crc32c_impl()), stdout);
        return 0;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_known_answers),
        cmocka_unit_test(test_every_impl_matches_the_reference),
        cmocka_unit_test(test_continued_across_calls),
        cmocka_unit_test(test_copy_form_copies_exactly_and_checksums),
        cmocka_unit_test(test_an_unknown_impl_is_refused),
        cmocka_unit_test(test_the_environment_picks_one_the_cpu_runs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
