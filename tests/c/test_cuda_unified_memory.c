/* The CUDA backend's unified-memory decision (kernels/cuda/unified_memory.h),
 * which needs no GPU: integrated GPUs and GPUs that use the host's page
 * tables are unified, others are not, and KVH_CUDA_UNIFIED overrides it
 * only when it is exactly "0" or "1". */
#include "test_util.h"
#include "kernels/cuda/unified_memory.h"

static void detection(void **state)
{
    (void)state;
    assert_int_equal(kvhc_memory_is_unified(0, 0, NULL), 0); /* discrete card on x86 */
    assert_int_equal(kvhc_memory_is_unified(1, 0, NULL), 1); /* integrated (Jetson) */
    assert_int_equal(kvhc_memory_is_unified(0, 1, NULL), 1); /* Grace Hopper, ATS */
    assert_int_equal(kvhc_memory_is_unified(1, 1, NULL), 1);
}

static void override(void **state)
{
    (void)state;
    assert_int_equal(kvhc_memory_is_unified(0, 0, "1"), 1);
    assert_int_equal(kvhc_memory_is_unified(1, 1, "0"), 0);
    /* Anything else leaves the detection alone. */
    assert_int_equal(kvhc_memory_is_unified(0, 0, ""), 0);
    assert_int_equal(kvhc_memory_is_unified(0, 0, "yes"), 0);
    assert_int_equal(kvhc_memory_is_unified(0, 1, "10"), 1);
    assert_int_equal(kvhc_memory_is_unified(1, 0, "00"), 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(detection),
        cmocka_unit_test(override),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
