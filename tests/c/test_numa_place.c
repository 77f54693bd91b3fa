/* NUMA placement without libnuma's allocating helpers (core/numa_place.c):
 * the sysfs CPU-list parser against well-formed and hostile lists, the
 * node lookup on this machine, the memory binding (read back with
 * get_mempolicy) and its refusals, an engine bound to node 0 whose
 * migration workers move blocks, and those workers' CPU affinity. */
#include <dirent.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "test_util.h"
#include "core/numa_place.h"

static void test_cpulist_parse(void **state)
{
    (void)state;
    cpu_set_t s;
    assert_true(kvhi_cpulist_parse("0-3,8-11\n", &s));
    assert_int_equal(CPU_COUNT(&s), 8);
    assert_true(CPU_ISSET(3, &s) && CPU_ISSET(8, &s) && !CPU_ISSET(4, &s));
    assert_true(kvhi_cpulist_parse("5", &s));
    assert_int_equal(CPU_COUNT(&s), 1);
    assert_true(CPU_ISSET(5, &s));
    assert_true(kvhi_cpulist_parse("0,2,4", &s));
    assert_int_equal(CPU_COUNT(&s), 3);
    /* CPUs past CPU_SETSIZE are left out, without running to the end */
    assert_true(kvhi_cpulist_parse("0-18446744073709551615", &s));
    assert_int_equal(CPU_COUNT(&s), CPU_SETSIZE);
    static const char *const bad[] = {"", "\n", "3-1", "a", "-1", " 1", "1-", "1-x", "1;2", "+1", "1--2", "2,-3"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        if (kvhi_cpulist_parse(bad[i], &s))
            fail_msg("'%s' was taken as a CPU list", bad[i]);
}

static void test_node_cpus_and_binding(void **state)
{
    (void)state;
    cpu_set_t s;
    assert_false(kvhi_numa_node_cpus(1 << 20, &s));
    assert_false(kvhi_numa_node_cpus(-1, &s));
    if (access("/sys/devices/system/node/node0/cpulist", R_OK) != 0)
        skip();
    assert_true(kvhi_numa_node_cpus(0, &s));
    assert_true(CPU_COUNT(&s) > 0);
    long page = sysconf(_SC_PAGESIZE);
    uint8_t *p = mmap(NULL, (size_t)page * 4, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    assert_true(p != MAP_FAILED);
    kvhi_numa_bind(p, (size_t)page * 4, 0);
    /* The range's policy is now "node 0 only" (linux/mempolicy.h: MPOL_BIND
     * is 2, MPOL_F_ADDR 2). */
    int mode = -1;
    unsigned long mask[16] = {0};
    if (syscall(SYS_get_mempolicy, &mode, mask, 16 * 8 * sizeof(unsigned long), p, 2ul) == 0) {
        assert_int_equal(mode, 2);
        assert_int_equal(mask[0] & 1ul, 1ul);
    }
    kvhi_numa_bind(p, (size_t)page * 4, 5000); /* beyond the mask: nothing */
    kvhi_numa_bind(p + 1, 10, 0);              /* unaligned: the kernel refuses, nothing breaks */
    memset(p, 0x5a, (size_t)page * 4);
    assert_int_equal(p[page * 4 - 1], 0x5a);
    munmap(p, (size_t)page * 4);
}

/* Workers bound to node 0 run moves, and the data comes back intact. */
static void test_engine_on_node_zero(void **state)
{
    (void)state;
    kvh_config c = tu_cfg(2, 1, 32, 16, KVH_DTYPE_F32, 8, 8, 2);
    c.numa_node = 0;
    kvh_engine *e = tu_open_cfg(&c);
    kvh_seq s = tu_seq_new(e, 0);
    int32_t t[48];
    tu_iota(t, 48, 1);
    assert_ok(kvh_seq_append(e, s, t, 48));
    float kv[48 * 32];
    for (int i = 0; i < 48 * 32; i++)
        kv[i] = (float)i;
    assert_ok(kvh_seq_write_kv(e, s, 0, 0, 48, kv, kv));
    kvh_fence f;
    assert_ok(kvh_seq_migrate(e, s, 0, 48, KVH_TIER_HOST, &f));
    assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
    assert_ok(kvh_fence_free(e, f));
    assert_int_equal(tu_seq_binfo(e, s, 0).tier, KVH_TIER_HOST);
    float back[48 * 32];
    assert_ok(kvh_seq_read_kv(e, s, 0, 0, 48, back, NULL));
    assert_memory_equal(back, kv, sizeof(kv));
    assert_ok(kvh_seq_free(e, s));
}

/* Whether every thread named kvh-worker may run on exactly the CPUs of
 * want (/proc/self/task/TID/comm names it); *n counts them. */
static bool workers_on(const cpu_set_t *want, int *n)
{
    *n = 0;
    DIR *d = opendir("/proc/self/task");
    assert_non_null(d);
    bool all = true;
    for (struct dirent *de; (de = readdir(d));) {
        if (de->d_name[0] == '.')
            continue;
        char path[300], comm[32] = "";
        snprintf(path, sizeof(path), "/proc/self/task/%s/comm", de->d_name);
        FILE *f = fopen(path, "r");
        if (!f)
            continue;
        bool named = fgets(comm, sizeof(comm), f) && strncmp(comm, "kvh-worker", 10) == 0;
        fclose(f);
        if (!named)
            continue;
        cpu_set_t has;
        CPU_ZERO(&has);
        all = all && sched_getaffinity((pid_t)atoi(de->d_name), sizeof(has), &has) == 0 && CPU_EQUAL(&has, want);
        (*n)++;
    }
    closedir(d);
    return all;
}

/* Workers started by a thread confined to one CPU of node 0 run on all
 * of node 0's CPUs: they set their own affinity, they do not inherit the
 * caller's. Needs a node 0 of two CPUs or more that this process may use. */
static void test_workers_run_on_the_node_cpus(void **state)
{
    (void)state;
    cpu_set_t node, mine, one;
    if (!kvhi_numa_node_cpus(0, &node) || sched_getaffinity(0, sizeof(mine), &mine) != 0)
        skip();
    cpu_set_t usable;
    CPU_AND(&usable, &node, &mine);
    if (CPU_COUNT(&usable) < 2 || !CPU_EQUAL(&usable, &node))
        skip();
    CPU_ZERO(&one);
    for (int cpu = 0; cpu < CPU_SETSIZE; cpu++)
        if (CPU_ISSET(cpu, &node)) {
            CPU_SET(cpu, &one);
            break;
        }
    assert_int_equal(sched_setaffinity(0, sizeof(one), &one), 0);
    kvh_config c = tu_cfg(2, 1, 32, 16, KVH_DTYPE_F32, 8, 8, 2);
    c.numa_node = 0;
    (void)tu_open_cfg(&c); /* closed by the teardown */
    assert_int_equal(sched_setaffinity(0, sizeof(mine), &mine), 0);
    int n = 0;
    bool on_node = false;
    for (int i = 0; i < 5000 && !(on_node = workers_on(&node, &n) && n >= 2); i++)
        usleep(1000);
    if (!on_node)
        fail_msg("%d kvh-worker threads found; not all on node 0's %d CPUs", n, CPU_COUNT(&node));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cpulist_parse),
        cmocka_unit_test(test_node_cpus_and_binding),
        cmocka_unit_test_teardown(test_engine_on_node_zero, tu_teardown),
        cmocka_unit_test_teardown(test_workers_run_on_the_node_cpus, tu_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
