/* core/huge_alloc.c: mappings for arrays indexed by block. */
#include <sys/mman.h>

#include "test_util.h"

#include "core/huge_alloc.h"

static const size_t sizes[] = {
    KVHI_HUGE_PAGE_BYTES,
    KVHI_HUGE_PAGE_BYTES + 100,
    3 * KVHI_HUGE_PAGE_BYTES + 1,
    5 * KVHI_HUGE_PAGE_BYTES - 1,
    8386560, /* a device tier of 80-wide heads */
    (64u << 20) + 4096 + 8,
    4096,
    100,
};

/* A size that is not whole pages left its mapping's last 2 MiB mapped
 * after the free: the tail trim asked munmap for an address inside a page
 * (EINVAL), so every engine open kept up to 2 MiB of address space per
 * such array until RLIMIT_AS or vm.max_map_count stopped the next. */
static void test_maps_are_given_back_whole(void **state)
{
    (void)state;
    long before = tu_vm_size_kb();
    for (int round = 0; round < 16; round++)
        for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
            uint8_t *p = kvhi_map_anon(sizes[i]);
            assert_non_null(p);
            if (sizes[i] >= KVHI_HUGE_PAGE_BYTES)
                assert_int_equal((uintptr_t)p % KVHI_HUGE_PAGE_BYTES, 0);
            p[0] = 1;
            p[sizes[i] - 1] = 2;
            assert_int_equal(p[0] + p[sizes[i] - 1], 3);
            munmap(p, sizes[i]);
        }
    assert_int_equal(tu_vm_size_kb(), before);
}

static void test_huge_allocs_are_zeroed_and_given_back(void **state)
{
    (void)state;
    long before = tu_vm_size_kb();
    for (int round = 0; round < 16; round++)
        for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
            uint8_t *p = kvhi_huge_alloc(sizes[i]);
            assert_non_null(p);
            assert_int_equal((uintptr_t)p % 64, 0);
            assert_int_equal(p[0] | p[sizes[i] / 2] | p[sizes[i] - 1], 0);
            kvhi_huge_free(p, sizes[i]);
        }
    /* The small ones come from malloc, which may keep its own pages. */
    assert_true(tu_vm_size_kb() - before < 1024);
}

static void test_zero_bytes_map_nothing(void **state)
{
    (void)state;
    assert_null(kvhi_map_anon(0));
    assert_null(kvhi_huge_alloc(0));
    assert_null(kvhi_map_anon(SIZE_MAX - 1)); /* would wrap with its slack */
    kvhi_huge_free(NULL, 1u << 30);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_maps_are_given_back_whole),
        cmocka_unit_test(test_huge_allocs_are_zeroed_and_given_back),
        cmocka_unit_test(test_zero_bytes_map_nothing),
    };
    return cmocka_run_group_tests_name("huge_alloc", tests, NULL, NULL);
}
