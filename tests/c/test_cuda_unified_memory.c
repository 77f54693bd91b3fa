/* The CUDA backend's unified-memory decision (kernels/cuda/unified_memory.h),
 * which needs no GPU: an integrated GPU shares the host's RAM (2), a GPU
 * that uses the host's page tables addresses it coherently (1), others are
 * discrete (0), and KVH_CUDA_UNIFIED overrides it only when it is exactly
 * "0", "1" or "2". */
#include "test_util.h"
#include "kernels/cuda/unified_memory.h"

static void detection(void **state)
{
    (void)state;
    assert_int_equal(kvhc_memory_is_unified(0, 0, NULL), 0); /* discrete card on x86 */
    assert_int_equal(kvhc_memory_is_unified(1, 0, NULL), 2); /* integrated (Jetson): one RAM */
    assert_int_equal(kvhc_memory_is_unified(0, 1, NULL), 1); /* Grace Hopper, ATS */
    assert_int_equal(kvhc_memory_is_unified(1, 1, NULL), 2);
}

static void override(void **state)
{
    (void)state;
    assert_int_equal(kvhc_memory_is_unified(0, 0, "1"), 1);
    assert_int_equal(kvhc_memory_is_unified(0, 0, "2"), 2);
    assert_int_equal(kvhc_memory_is_unified(1, 1, "0"), 0);
    /* Anything else leaves the detection alone. */
    assert_int_equal(kvhc_memory_is_unified(0, 0, ""), 0);
    assert_int_equal(kvhc_memory_is_unified(0, 0, "yes"), 0);
    assert_int_equal(kvhc_memory_is_unified(0, 1, "10"), 1);
    assert_int_equal(kvhc_memory_is_unified(1, 0, "00"), 2);
    assert_int_equal(kvhc_memory_is_unified(0, 0, "3"), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(detection),
        cmocka_unit_test(override),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
