/* core/isa_overrides.h: an engine warns at open about KVH_ATTN_ISA,
 * KVH_CODEC_ISA and KVH_CRC32C_IMPL values that name nothing or what this
 * CPU does not run, and says nothing about the others. */
#include "test_util.h"

#include <stdlib.h>
#include <string.h>

#include "core/crc32c.h"
#include "kernels/cpu/attn_cpu.h"
#include "kernels/cpu/kv_codec.h"

static char logged[4096];

static void capture(void *user, int32_t level, const char *message)
{
    (void)user;
    if (level == KVH_LOG_WARN && strlen(logged) + strlen(message) + 2 < sizeof(logged)) {
        strcat(logged, message);
        strcat(logged, "\n");
    }
}

/* The warnings an engine opened under var=value logs. */
static const char *warnings_under(const char *var, const char *value)
{
    static const char *vars[] = {"KVH_ATTN_ISA", "KVH_CODEC_ISA", "KVH_CRC32C_IMPL"};
    for (size_t i = 0; i < 3; i++)
        unsetenv(vars[i]);
    if (var)
        setenv(var, value, 1);
    logged[0] = '\0';
    kvh_config c = tu_cfg(1, 1, 8, 4, KVH_DTYPE_F32, 4, 4, 0);
    c.log_fn = capture;
    c.log_level = KVH_LOG_WARN;
    kvh_engine *e = NULL;
    assert_ok(kvh_engine_open(&c, &e));
    assert_ok(kvh_engine_close(e));
    if (var)
        unsetenv(var);
    return logged;
}

static void test_names_that_name_nothing_are_reported(void **state)
{
    (void)state;
    assert_string_equal(warnings_under("KVH_CRC32C_IMPL", "AVX512"),
                        "KVH_CRC32C_IMPL=AVX512 is none of table, sse42, avx2, avx512: ignored\n");
    assert_string_equal(warnings_under("KVH_CODEC_ISA", "sse9"),
                        "KVH_CODEC_ISA=sse9 is none of scalar, avx2, avx512: ignored\n");
    assert_string_equal(warnings_under("KVH_ATTN_ISA", ""),
                        "KVH_ATTN_ISA= is none of reference, generic, avx2, avx512: ignored\n");
}

static void test_good_names_are_quiet_or_say_the_cpu_lacks_them(void **state)
{
    (void)state;
    assert_string_equal(warnings_under(NULL, NULL), "");
    assert_string_equal(warnings_under("KVH_CRC32C_IMPL", "table"), "");
    assert_string_equal(warnings_under("KVH_CODEC_ISA", "scalar"), "");
    assert_string_equal(warnings_under("KVH_ATTN_ISA", "reference"), "");
    assert_string_equal(
        warnings_under("KVH_CRC32C_IMPL", "avx2"),
        kvhi_crc32c_supported(KVHI_CRC32C_FOLD256) ? "" : "KVH_CRC32C_IMPL=avx2: this CPU does not run it: ignored\n");
    assert_string_equal(
        warnings_under("KVH_CRC32C_IMPL", "avx512"),
        kvhi_crc32c_supported(KVHI_CRC32C_FOLD) ? "" : "KVH_CRC32C_IMPL=avx512: this CPU does not run it: ignored\n");
    assert_string_equal(
        warnings_under("KVH_CODEC_ISA", "avx512"),
        kvhi_codec_isa_supported(KVHI_CODEC_AVX512) ? "" : "KVH_CODEC_ISA=avx512: this CPU does not run it: ignored\n");
    assert_string_equal(
        warnings_under("KVH_ATTN_ISA", "avx512"),
        kvhi_attn_cpu_supported(KVHI_ATTN_AVX512) ? "" : "KVH_ATTN_ISA=avx512: this CPU does not run it: ignored\n");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_names_that_name_nothing_are_reported),
        cmocka_unit_test(test_good_names_are_quiet_or_say_the_cpu_lacks_them),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
