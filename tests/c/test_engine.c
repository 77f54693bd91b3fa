/* Public API: configuration, engine lifetime, tier info, stats, status
 * text, version. */
#include <sched.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "test_util.h"

#include "core/huge_alloc.h"

static void test_version(void **state)
{
    (void)state;
    assert_int_equal(kvh_version(), KVH_VERSION_NUMBER);
    assert_int_equal(KVH_VERSION_NUMBER, KVH_VERSION_MAJOR * 10000 + KVH_VERSION_MINOR * 100 + KVH_VERSION_PATCH);
    char want[64];
    snprintf(want, sizeof(want), "%d.%d.%d", KVH_VERSION_MAJOR, KVH_VERSION_MINOR, KVH_VERSION_PATCH);
    assert_non_null(kvh_version_string());
    assert_string_equal(kvh_version_string(), want);
    assert_ptr_equal(kvh_version_string(), kvh_version_string()); /* static text */
}

#define CHECK_STATUS_TEXT(name, value, text)                                                                           \
    assert_int_equal((int)(name), (value));                                                                            \
    assert_string_equal(kvh_status_name(value), #name);                                                                \
    assert_string_equal(kvh_strerror(value), text);                                                                    \
    n_codes++;

static void test_status_text(void **state)
{
    (void)state;
    int n_codes = 0;
    KVH_STATUS_LIST(CHECK_STATUS_TEXT)
    assert_int_equal(n_codes, 16);
    /* Codes are unique and 0, -1, -2, ... without gaps. */
    for (int c = 0; c > -n_codes; c--)
        assert_string_not_equal(kvh_status_name(c), "KVH_ERR_UNKNOWN");
    kvh_status unknown[] = {1, 2, -16, -17, -100, 1000, INT32_MIN, INT32_MAX};
    for (size_t i = 0; i < sizeof(unknown) / sizeof(unknown[0]); i++) {
        assert_string_equal(kvh_status_name(unknown[i]), "KVH_ERR_UNKNOWN");
        const char *t = kvh_strerror(unknown[i]);
        assert_non_null(t);
        assert_true(t[0] != '\0');
        for (int c = 0; c > -n_codes; c--)
            assert_string_not_equal(t, kvh_strerror(c));
    }
    /* Static text: the same pointer every time. */
    assert_ptr_equal(kvh_strerror(KVH_ERR_IO), kvh_strerror(KVH_ERR_IO));
    assert_ptr_equal(kvh_status_name(KVH_ERR_IO), kvh_status_name(KVH_ERR_IO));
}

static void test_config_init_defaults(void **state)
{
    (void)state;
    kvh_config c;
    memset(&c, 0xAB, sizeof(c));
    assert_ok(kvh_config_init(&c, sizeof(c)));
    assert_int_equal(c.struct_size, sizeof(kvh_config));
    assert_int_equal(c.num_layers, 1);
    assert_int_equal(c.num_kv_heads, 1);
    assert_int_equal(c.head_dim, 64);
    assert_int_equal(c.block_tokens, 16);
    assert_int_equal(c.dtype, KVH_DTYPE_F16);
    assert_int_equal(c.backend, KVH_BACKEND_AUTO);
    assert_int_equal(c.cuda_device, 0);
    assert_int_equal(c.device_bytes, 256ull << 20);
    assert_int_equal(c.host_bytes, 1ull << 30);
    assert_int_equal(c.disk_bytes, 0);
    assert_null(c.disk_path);
    assert_int_equal(c.model_salt, 0);
    assert_int_equal(c.numa_node, -1);
    assert_int_equal(c.migration_threads, 2);
    assert_int_equal(c.migration_cpu_mask, 0);
    assert_int_equal(c.lru_k, 2);
    assert_int_equal(c.promote_min_hits, 1);
    assert_int_equal(c.log_level, KVH_LOG_WARN);
    assert_int_equal(c.reserved0, 0);
    assert_null(c.log_fn);
    assert_null(c.log_user);
    assert_int_equal(c.disk_queue_depth, 32);
    assert_int_equal(c.disk_flags, 0);
}

static void test_config_init_bad_args(void **state)
{
    (void)state;
    kvh_config c;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_config_init(NULL, sizeof(c)));
    assert_true(kvh_last_error()[0] != '\0');
    size_t bad[] = {0, 1, 4, sizeof(c) - 1, sizeof(c) + 1, sizeof(c) + 8, 4096, (size_t)-1};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        memset(&c, 0x5C, sizeof(c));
        assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_config_init(&c, bad[i]));
        assert_true(kvh_last_error()[0] != '\0');
        /* Nothing written on failure. */
        const uint8_t *p = (const uint8_t *)&c;
        for (size_t j = 0; j < sizeof(c); j++)
            assert_int_equal(p[j], 0x5C);
    }
    /* A successful call clears the thread's error detail. */
    assert_ok(kvh_config_init(&c, sizeof(c)));
    assert_string_equal(kvh_last_error(), "");
}

static kvh_config small_cfg(void) { return tu_cfg(2, 2, 8, 4, KVH_DTYPE_F32, 8, 8, 0); }

static void expect_open_invalid(const kvh_config *c, const char *what)
{
    kvh_engine *e = (kvh_engine *)(uintptr_t)0x1234;
    kvh_status st = kvh_engine_open(c, &e);
    if (st != KVH_ERR_INVALID_ARG) {
        print_error("open with %s returned %s, expected KVH_ERR_INVALID_ARG\n", what, kvh_status_name(st));
        if (st == KVH_OK)
            kvh_engine_close(e);
        fail();
    }
    if (kvh_last_error()[0] == '\0') {
        print_error("open with %s: kvh_last_error() is empty\n", what);
        fail();
    }
    assert_ptr_equal(e, (kvh_engine *)(uintptr_t)0x1234); /* out-param untouched */
}

static void test_open_invalid_geometry(void **state)
{
    (void)state;
    kvh_config c;
#define BAD(field, value)                                                                                              \
    do {                                                                                                               \
        c = small_cfg();                                                                                               \
        c.field = value;                                                                                               \
        expect_open_invalid(&c, #field " = " #value);                                                                  \
    } while (0)
    BAD(num_layers, 0);
    BAD(num_layers, 4097);
    BAD(num_kv_heads, 0);
    BAD(num_kv_heads, 1025);
    BAD(head_dim, 0);
    BAD(head_dim, 1025);
    BAD(block_tokens, 0);
    BAD(block_tokens, 3);
    BAD(block_tokens, 24);
    BAD(block_tokens, 512);
    BAD(block_tokens, 0x80000000u);
    BAD(dtype, 3);
    BAD(dtype, 0xFFFFFFFFu);
    BAD(backend, 3);
    BAD(lru_k, 0);
    BAD(lru_k, 5);
    BAD(migration_threads, 65);
    BAD(numa_node, -2);
    BAD(log_level, 4);
    BAD(device_bytes, 0);
    /* A device budget smaller than one block holds no block. */
    c = small_cfg();
    c.device_bytes = tu_block_bytes_of(2, 2, 8, 4, KVH_DTYPE_F32) - 1;
    expect_open_invalid(&c, "device_bytes = block_bytes - 1");
#undef BAD
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(NULL, &(kvh_engine *){NULL}));
    c = small_cfg();
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(&c, NULL));
    /* Wrong struct_size. */
    uint32_t sizes[] = {0, 4, 12, sizeof(kvh_config) - 4, sizeof(kvh_config) + 8};
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        c = small_cfg();
        c.struct_size = sizes[i];
        kvh_engine *e = NULL;
        assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_engine_open(&c, &e));
        assert_null(e);
        assert_true(kvh_last_error()[0] != '\0');
    }
    /* Still fine afterwards. */
    c = small_cfg();
    kvh_engine *e = tu_open_cfg(&c);
    assert_ok(tu_close(e));
}

static void test_open_valid_edges(void **state)
{
    (void)state;
    /* Extremes of each range that are valid. */
    kvh_config c = tu_cfg(1, 1, 1, 1, KVH_DTYPE_F16, 4, 0, 0);
    kvh_engine *e = tu_open_cfg(&c);
    assert_int_equal(tu_block_bytes(e), 2 * 1 * 1 * 1 * 2);
    assert_ok(tu_close(e));
    c = tu_cfg(1, 1, 1024, 256, KVH_DTYPE_BF16, 1, 1, 0);
    c.lru_k = 4;
    c.numa_node = -1;
    c.log_level = KVH_LOG_DEBUG;
    e = tu_open_cfg(&c);
    assert_int_equal(tu_block_bytes(e), 2ull * 1024 * 256 * 2);
    assert_ok(tu_close(e));
    c = tu_cfg(3, 2, 8, 4, KVH_DTYPE_F32, 2, 0, 3);
    c.lru_k = 1;
    e = tu_open_cfg(&c);
    assert_int_equal(tu_block_bytes(e), 2ull * 3 * 2 * 8 * 4 * 4);
    assert_string_equal(kvh_engine_backend(e), "cpu");
    assert_ok(tu_close(e));
}

static void test_open_default_config(void **state)
{
    (void)state;
    kvh_config c;
    assert_ok(kvh_config_init(&c, sizeof(c)));
    kvh_engine *e = tu_open_cfg(&c); /* AUTO: CUDA if a device answers, else CPU */
    const char *b = kvh_engine_backend(e);
    assert_non_null(b);
    assert_true(strcmp(b, "cpu") == 0 || strcmp(b, "cuda") == 0);
    assert_int_equal(tu_block_bytes(e), 2ull * 1 * 1 * 64 * 16 * 2);
    kvh_tier_info d = tu_tier(e, KVH_TIER_DEVICE), h = tu_tier(e, KVH_TIER_HOST), k = tu_tier(e, KVH_TIER_DISK);
    assert_int_equal(d.capacity_blocks, (256ull << 20) / 4096);
    assert_int_equal(h.capacity_blocks, (1ull << 30) / 4096);
    assert_int_equal(k.capacity_blocks, 0);
    assert_ok(tu_close(e));
}

/* Resident bytes of this process (/proc/self/statm). */
static uint64_t resident_bytes(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    assert_non_null(f);
    unsigned long long size = 0, resident = 0;
    assert_int_equal(fscanf(f, "%llu %llu", &size, &resident), 2);
    fclose(f);
    return resident * (uint64_t)sysconf(_SC_PAGESIZE);
}

static uint64_t one_mib_available(void) { return 1u << 20; }

static uint64_t nine_mib_available(void) { return 9u << 20; }
static uint64_t one_gib_available(void) { return 1u << 30; }
static uint64_t twenty_mib_available(void) { return 20u << 20; }

/* prefault_memory counts the block records a tier's blocks need, not
 * only its slots: with 1 KiB blocks, an 8 MiB tier has 8192 blocks whose
 * records, tokens and victim-order entries are about 2 MiB more. Nine
 * MiB available holds the slots but not both, and the refusal names
 * the two sizes; a gigabyte holds them. */
static void test_prefault_memory_counts_block_records(void **state)
{
    (void)state;
    kvh_config c = tu_cfg(1, 1, 16, 16, KVH_DTYPE_F16, 1, 1, 0);
    c.device_bytes = 8ull << 20;
    c.host_bytes = 0;
    c.prefault_memory = 1;
    kvhi_set_mem_available_hook(nine_mib_available);
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&c, &e);
    kvhi_set_mem_available_hook(NULL);
    assert_int_equal(st, KVH_ERR_NOMEM);
    assert_null(e);
    const char *why = kvh_last_error();
    assert_non_null(strstr(why, "block records"));
    assert_non_null(strstr(why, "8388608 bytes")); /* the slots */
    unsigned long long records = 0;
    const char *at = strstr(why, "and the ");
    assert_non_null(at);
    assert_int_equal(sscanf(at, "and the %llu bytes of its block records", &records), 1);
    assert_true(records >= 8192ull * 200 && records < 8192ull * 1024);
    assert_non_null(strstr(why, "9437184 bytes")); /* what is available */

    kvhi_set_mem_available_hook(one_gib_available);
    st = kvh_engine_open(&c, &e);
    kvhi_set_mem_available_hook(NULL);
    assert_ok(st);
    assert_ok(tu_close(e));
}

/* With vmap = 1 prefault_memory leaves the device tier (the memory file
 * views map) alone, as kvh.h says: not backed at open and not checked
 * against the memory available; the host tier still is both. */
static void test_prefault_memory_skips_the_vmap_device_tier(void **state)
{
    (void)state;
    const uint64_t dev = 32ull << 20, host = 16ull << 20;
    kvh_config c = tu_cfg(2, 2, 64, 16, KVH_DTYPE_F16, 1, 1, 0);
    c.device_bytes = dev;
    c.host_bytes = host;
    c.vmap = 1;
    c.prefault_memory = 1;
    uint64_t before = resident_bytes();
    kvh_engine *e = tu_open_cfg(&c);
    uint64_t grew = resident_bytes() - before;
    assert_true(grew >= host / 10 * 9);
    assert_true(grew < host + dev / 4);
    assert_ok(tu_close(e));
    /* 20 MiB available: the host tier and its records fit, the device
     * tier would not, and is not checked. */
    kvhi_set_mem_available_hook(twenty_mib_available);
    kvh_engine *opened = NULL;
    kvh_status st = kvh_engine_open(&c, &opened);
    kvhi_set_mem_available_hook(NULL);
    assert_ok(st);
    assert_ok(tu_close(opened));
}

/* prefault_memory backs the CPU tiers' pages at open (both arenas, and
 * the one arena of in-place moves); without it an open leaves them
 * unbacked, and tiers larger than the memory available are refused.
 * Anything but 0 or 1 is refused. */
static void test_prefault_memory(void **state)
{
    (void)state;
    const uint64_t dev = 32ull << 20, host = 64ull << 20;
    for (uint32_t copies = 0; copies <= 1; copies++)
        for (uint32_t prefault = 0; prefault <= 1; prefault++) {
            kvh_config c = tu_cfg(2, 2, 64, 16, KVH_DTYPE_F16, 1, 1, 0);
            c.device_bytes = dev;
            c.host_bytes = host;
            c.copy_moves = copies;
            c.prefault_memory = prefault;
            uint64_t before = resident_bytes();
            kvh_engine *e = tu_open_cfg(&c);
            uint64_t grew = resident_bytes() - before;
            if (prefault)
                assert_true(grew >= (dev + host) / 10 * 9);
            else
                assert_true(grew < (dev + host) / 4);
            kvh_seq s = tu_seq_new(e, 0);
            int32_t tok[64] = {0};
            assert_ok(kvh_seq_append(e, s, tok, 64));
            assert_ok(tu_close(e));
        }
    /* Tiers larger than the memory available are refused before a page
     * is backed (backing them would wake the OOM killer). */
    uint64_t real = kvhi_mem_available();
    assert_true(real > 0 && real != UINT64_MAX);
    kvhi_set_mem_available_hook(one_mib_available);
    kvh_config big = tu_cfg(2, 2, 64, 16, KVH_DTYPE_F16, 1, 1, 0);
    big.device_bytes = dev;
    big.host_bytes = host;
    big.copy_moves = 1;
    big.prefault_memory = 1;
    uint64_t before = resident_bytes();
    kvh_engine *refused = NULL;
    kvh_status st = kvh_engine_open(&big, &refused);
    kvhi_set_mem_available_hook(NULL);
    assert_int_equal(st, KVH_ERR_NOMEM);
    assert_non_null(strstr(kvh_last_error(), "MemAvailable"));
    assert_null(refused);
    assert_true(resident_bytes() - before < (dev + host) / 4);

    kvh_config c = tu_cfg(2, 2, 64, 16, KVH_DTYPE_F16, 4, 4, 0);
    c.prefault_memory = 2;
    kvh_engine *e = NULL;
    assert_int_equal(kvh_engine_open(&c, &e), KVH_ERR_INVALID_ARG);
    assert_non_null(strstr(kvh_last_error(), "prefault_memory"));
    assert_null(e);
}

/* The default backend, AUTO, that finds no CUDA device runs on the CPU
 * backend: prefault_memory then backs its tiers and refuses tiers larger
 * than the memory available, as with backend CPU named. */
static void test_prefault_memory_auto_backend(void **state)
{
    (void)state;
    kvh_config c;
    assert_ok(kvh_config_init(&c, sizeof(c)));
    c.backend = KVH_BACKEND_AUTO;
    c.device_bytes = 8ull << 20;
    c.host_bytes = 16ull << 20;
    c.copy_moves = 1;
    c.migration_threads = 0;
    kvh_engine *probe = tu_open_cfg(&c);
    int on_cpu = strcmp(kvh_engine_backend(probe), "cpu") == 0;
    assert_ok(tu_close(probe));
    if (!on_cpu)
        skip(); /* AUTO found a CUDA device: its host memory is pinned */
    c.prefault_memory = 1;
    uint64_t before = resident_bytes();
    kvh_engine *e = tu_open_cfg(&c);
    assert_true(resident_bytes() - before >= (c.device_bytes + c.host_bytes) / 10 * 9);
    assert_ok(tu_close(e));

    kvhi_set_mem_available_hook(one_mib_available);
    kvh_engine *refused = NULL;
    kvh_status st = kvh_engine_open(&c, &refused);
    kvhi_set_mem_available_hook(NULL);
    if (st == KVH_OK)
        tu_track_engine(refused);
    assert_int_equal(st, KVH_ERR_NOMEM);
    assert_non_null(strstr(kvh_last_error(), "MemAvailable"));
    assert_null(refused);
}

/* A file of text under dir (made with its parents' directories). */
static void put_file(const char *dir, const char *rel, const char *text)
{
    char path[1024];
    snprintf(path, sizeof(path), "%s/%s", dir, rel);
    for (char *p = path + strlen(dir) + 1; *p; p++)
        if (*p == '/') {
            *p = '\0';
            mkdir(path, 0700);
            *p = '/';
        }
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

/* In a container the memory a process may still use is its cgroup's
 * limit less its usage, whatever /proc/meminfo says of the host: backing
 * more wakes the cgroup's OOM killer. The least headroom of the cgroup
 * and its ancestors counts, under cgroup v2 and v1; no limit, or files
 * that cannot be read, leave MemAvailable alone. prefault_memory refuses
 * tiers larger than it. */
static void test_mem_available_follows_the_cgroup_limit(void **state)
{
    (void)state;
    const char *tmp = getenv("KVH_TEST_TMPDIR");
    char dir[512], proc[600], root[600];
    snprintf(dir, sizeof(dir), "%s/cgroup.%d", tmp ? tmp : "/tmp", (int)getpid());
    mkdir(dir, 0700);
    snprintf(proc, sizeof(proc), "%s/proc_self_cgroup", dir);
    snprintf(root, sizeof(root), "%s/sys", dir);
    uint64_t host = kvhi_mem_available();
    assert_true(host > (64u << 20) && host != UINT64_MAX);

    /* v2: a 48 MiB limit on the parent, 16 MiB of it used; none on the
     * process's own cgroup. */
    put_file(dir, "proc_self_cgroup", "0::/pod/app\n");
    put_file(dir, "sys/pod/memory.max", "50331648\n");
    put_file(dir, "sys/pod/memory.current", "16777216\n");
    put_file(dir, "sys/pod/app/memory.max", "max\n");
    put_file(dir, "sys/pod/app/memory.current", "4096\n");
    kvhi_set_cgroup_paths(proc, root);
    assert_int_equal(kvhi_mem_available(), 32u << 20);
    /* A tighter own limit wins. */
    put_file(dir, "sys/pod/app/memory.max", "8392704\n"); /* 8 MiB + 4 KiB */
    assert_int_equal(kvhi_mem_available(), 8u << 20);
    /* Usage past the limit leaves nothing. */
    put_file(dir, "sys/pod/app/memory.current", "9000000\n");
    assert_int_equal(kvhi_mem_available(), 0);

    /* v1: the memory controller's hierarchy; its "unlimited" is a huge
     * number, not "max". */
    put_file(dir, "proc_self_cgroup", "12:pids:/x\n4:cpu,memory:/job\n0::/\n");
    put_file(dir, "sys/memory/job/memory.limit_in_bytes", "33554432\n");
    put_file(dir, "sys/memory/job/memory.usage_in_bytes", "1048576\n");
    put_file(dir, "sys/memory/memory.limit_in_bytes", "9223372036854771712\n");
    put_file(dir, "sys/memory/memory.usage_in_bytes", "123456789\n");
    assert_int_equal(kvhi_mem_available(), 31u << 20);

    /* Unlimited, or nothing to read: MemAvailable. */
    put_file(dir, "sys/memory/job/memory.limit_in_bytes", "9223372036854771712\n");
    uint64_t unlimited = kvhi_mem_available();
    assert_true(unlimited > (64u << 20) && unlimited != UINT64_MAX);
    put_file(dir, "proc_self_cgroup", "0::/nowhere\n");
    uint64_t unread = kvhi_mem_available();
    assert_true(unread > (64u << 20) && unread != UINT64_MAX);

    /* The open: 24 MiB of tiers, 8 MiB of cgroup headroom. */
    put_file(dir, "proc_self_cgroup", "0::/pod/app\n");
    put_file(dir, "sys/pod/app/memory.current", "4096\n");
    kvh_config c = tu_cfg(2, 2, 64, 16, KVH_DTYPE_F16, 1, 1, 0);
    c.device_bytes = 8ull << 20;
    c.host_bytes = 16ull << 20;
    c.copy_moves = 1;
    c.prefault_memory = 1;
    kvh_engine *refused = NULL;
    kvh_status st = kvh_engine_open(&c, &refused);
    kvhi_set_cgroup_paths(NULL, NULL);
    if (st == KVH_OK)
        tu_track_engine(refused);
    assert_int_equal(st, KVH_ERR_NOMEM);
    assert_non_null(strstr(kvh_last_error(), "cgroup"));
    assert_null(refused);
    kvh_engine *e = tu_open_cfg(&c); /* the real limits let it open */
    assert_ok(tu_close(e));
}

static void test_explicit_cuda(void **state)
{
    (void)state;
    kvh_config c = small_cfg();
    c.backend = KVH_BACKEND_CUDA;
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&c, &e);
    if (st == KVH_OK) { /* a machine with a GPU and the backend installed */
        assert_string_equal(kvh_engine_backend(e), "cuda");
        kvh_engine_close(e);
        return;
    }
    assert_int_equal(st, KVH_ERR_UNSUPPORTED);
    assert_null(e);
    assert_true(kvh_last_error()[0] != '\0');
}

static void test_close_null_and_misc(void **state)
{
    (void)state;
    assert_ok(kvh_engine_close(NULL));
    assert_null(kvh_engine_backend(NULL));
    uint64_t bb = 99;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_block_bytes(NULL, &bb));
    assert_int_equal(bb, 99);
    kvh_engine *e = tu_open(2, 2, 8, 4, KVH_DTYPE_F32, 8, 8, 0);
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_block_bytes(e, NULL));
    assert_int_equal(tu_block_bytes(e), 2ull * 2 * 2 * 8 * 4 * 4);
    assert_string_equal(kvh_engine_backend(e), "cpu");
    assert_ok(tu_close(e));
}

static void test_budgets_round_down(void **state)
{
    (void)state;
    uint64_t bb = tu_block_bytes_of(2, 2, 8, 4, KVH_DTYPE_F32);
    kvh_config c = small_cfg();
    c.device_bytes = 3 * bb + bb / 2;
    c.host_bytes = 5 * bb + bb - 1;
    kvh_engine *e = tu_open_cfg(&c);
    kvh_tier_info d = tu_tier(e, KVH_TIER_DEVICE), h = tu_tier(e, KVH_TIER_HOST);
    assert_int_equal(d.capacity_blocks, 3);
    assert_int_equal(h.capacity_blocks, 5);
    assert_int_equal(d.block_bytes, bb);
    assert_int_equal(d.tier, KVH_TIER_DEVICE);
    assert_int_equal(h.tier, KVH_TIER_HOST);
    assert_non_null(d.base);
    assert_non_null(h.base);
    assert_ok(tu_close(e));
    /* host_bytes below one block: no host tier. */
    c.host_bytes = bb - 1;
    e = tu_open_cfg(&c);
    h = tu_tier(e, KVH_TIER_HOST);
    assert_int_equal(h.capacity_blocks, 0);
    assert_int_equal(h.used_blocks, 0);
    assert_null(h.base);
    assert_ok(tu_close(e));
}

static void test_tier_info_args(void **state)
{
    (void)state;
    kvh_engine *e = tu_open(2, 2, 8, 4, KVH_DTYPE_F32, 8, 8, 0);
    kvh_tier_info t;
    memset(&t, 0x77, sizeof(t));
    t.struct_size = sizeof(t);
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_tier_info_get(e, 3, &t));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_tier_info_get(e, 0xFFFFFFFFu, &t));
    assert_int_equal(t.capacity_blocks, 0x7777777777777777ull); /* untouched */
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_tier_info_get(e, 0, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_tier_info_get(NULL, 0, &t));
    uint32_t bad[] = {0, 4, sizeof(t) - 4, sizeof(t) + 8};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        t.struct_size = bad[i];
        assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_tier_info_get(e, 0, &t));
    }
    kvh_tier_info k = tu_tier(e, KVH_TIER_DISK);
    assert_int_equal(k.struct_size, sizeof(k));
    assert_int_equal(k.tier, KVH_TIER_DISK);
    assert_int_equal(k.capacity_blocks, 0);
    assert_int_equal(k.used_blocks, 0);
    assert_int_equal(k.used_bytes, 0);
    assert_null(k.base);
}

static void check_accounting(kvh_engine *e, uint64_t bb)
{
    uint64_t live = 0;
    for (uint32_t t = 0; t < KVH_TIER_COUNT; t++) {
        kvh_tier_info i = tu_tier(e, t);
        assert_int_equal(i.used_bytes, i.used_blocks * i.block_bytes);
        assert_int_equal(i.block_bytes, bb);
        assert_true(i.used_blocks <= i.capacity_blocks);
        assert_true(i.pinned_blocks <= i.used_blocks);
        live += i.used_blocks;
    }
    kvh_stats s = tu_stats(e);
    assert_int_equal(s.blocks_allocated - s.blocks_freed, live);
}

/* used_bytes == used_blocks * block_bytes through a random workload; and
 * used_blocks equals the blocks alive (allocated - freed). */
static void test_tier_accounting(void **state)
{
    (void)state;
    kvh_engine *e = tu_open(2, 2, 8, 4, KVH_DTYPE_F32, 6, 10, 0);
    uint64_t bb = tu_block_bytes(e);
    tu_rng r = {tu_seed(99)};
    kvh_seq seqs[6] = {{0}};
    int32_t toks[16];
    check_accounting(e, bb);
    for (int op = 0; op < 3000; op++) {
        int i = (int)tu_below(&r, 6);
        if (!seqs[i].id) {
            seqs[i] = tu_seq_new(e, (uint32_t)i);
            continue;
        }
        switch (tu_below(&r, 6)) {
        case 0:
        case 1: {
            size_t n = 1 + tu_below(&r, 16);
            for (size_t j = 0; j < n; j++)
                toks[j] = (int32_t)tu_below(&r, 4);
            kvh_status st = kvh_seq_append(e, seqs[i], toks, n);
            assert_true(st == KVH_OK || st == KVH_ERR_NOSPACE);
            break;
        }
        case 2:
            assert_ok(kvh_seq_truncate(e, seqs[i], tu_below(&r, tu_seq_len(e, seqs[i]) + 1)));
            break;
        case 3: {
            uint64_t n = tu_seq_len(e, seqs[i]);
            if (n) {
                kvh_status st = kvh_seq_migrate(e, seqs[i], 0, n, tu_below(&r, 2), NULL);
                assert_true(st == KVH_OK || st == KVH_ERR_NOSPACE);
            }
            break;
        }
        case 4: {
            kvh_seq child;
            assert_ok(kvh_seq_fork(e, seqs[i], 7, &child));
            assert_ok(kvh_seq_free(e, seqs[i]));
            seqs[i] = child;
            break;
        }
        default:
            assert_ok(kvh_seq_free(e, seqs[i]));
            seqs[i].id = 0;
        }
        check_accounting(e, bb);
    }
    for (int i = 0; i < 6; i++)
        assert_ok(kvh_seq_free(e, seqs[i]));
    check_accounting(e, bb);
}

static void test_stats_struct_size(void **state)
{
    (void)state;
    kvh_engine *e = tu_open(2, 2, 8, 4, KVH_DTYPE_F32, 8, 8, 0);
    kvh_seq s = tu_seq_new(e, 0);
    int32_t t[8];
    tu_iota(t, 8, 1);
    assert_ok(kvh_seq_append(e, s, t, 8));
    tu_write_pattern(e, s, 2, 2 * 8 * 4, 1, 0, 8);
    assert_true(tu_check_pattern(e, s, 2, 2 * 8 * 4, 1, 0, 8));
    kvh_stats full = tu_stats(e);
    assert_int_equal(full.struct_size, sizeof(kvh_stats));
    assert_true(full.lookups > 0 && full.hits_device > 0);
    assert_int_equal(full.blocks_allocated, 2);

    /* An older, smaller struct is filled up to its size and no further. */
    size_t sizes[] = {offsetof(kvh_stats, lookups), offsetof(kvh_stats, hits_host), offsetof(kvh_stats, cow_copies),
                      offsetof(kvh_stats, blocks_freed)};
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        uint8_t buf[sizeof(kvh_stats) + 64];
        memset(buf, 0xEE, sizeof(buf));
        kvh_stats *st = (kvh_stats *)buf;
        st->struct_size = (uint32_t)sizes[i];
        assert_ok(kvh_engine_stats(e, st));
        assert_int_equal(st->struct_size, sizes[i]);
        for (size_t j = sizes[i]; j < sizeof(buf); j++)
            assert_int_equal(buf[j], 0xEE);
        if (sizes[i] > offsetof(kvh_stats, lookups)) {
            assert_int_equal(st->lookups, full.lookups);
            assert_int_equal(st->hits_device, full.hits_device);
        }
    }
    /* Sizes the library cannot know. */
    uint32_t bad[] = {0, 4, sizeof(kvh_stats) + 8, 0xFFFFFFFFu};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        kvh_stats st;
        memset(&st, 0xEE, sizeof(st));
        st.struct_size = bad[i];
        assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_engine_stats(e, &st));
        assert_int_equal(st.lookups, 0xEEEEEEEEEEEEEEEEull);
    }
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_stats(e, NULL));
    kvh_stats st = {.struct_size = sizeof(st)};
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_stats(NULL, &st));
    /* Counters are monotonic. */
    assert_ok(kvh_seq_free(e, s));
    kvh_stats after = tu_stats(e);
    assert_true(after.blocks_freed >= full.blocks_freed);
    assert_true(after.lookups >= full.lookups);
}

/* The device tier's base: slot i at base + i * block_bytes, laid out
 * [layer][K,V][kv_head][token][dim]. */
static void test_tier_base_layout(void **state)
{
    (void)state;
    const uint32_t L = 3, H = 2, D = 4, BT = 4;
    kvh_engine *e = tu_open(L, H, D, BT, KVH_DTYPE_F32, 4, 4, 0);
    uint64_t bb = tu_block_bytes(e);
    kvh_seq s = tu_seq_new(e, 0);
    int32_t t[6];
    tu_iota(t, 6, 10);
    assert_ok(kvh_seq_append(e, s, t, 6));
    size_t tok = H * D * sizeof(float);
    tu_write_pattern(e, s, L, tok, 5, 0, 6);
    kvh_tier_info d = tu_tier(e, KVH_TIER_DEVICE);
    float *kbuf = tu_alloc(tok), *vbuf = tu_alloc(tok);
    for (uint64_t pos = 0; pos < 6; pos++) {
        kvh_block_info bi = tu_seq_binfo(e, s, pos / BT);
        assert_int_equal(bi.tier, KVH_TIER_DEVICE);
        const uint8_t *blk = (const uint8_t *)d.base + (uint64_t)bi.slot * bb;
        for (uint32_t l = 0; l < L; l++) {
            tu_pattern(kbuf, tok, 5, l, pos, 0);
            tu_pattern(vbuf, tok, 5, l, pos, 1);
            for (uint32_t h = 0; h < H; h++)
                for (int kv = 0; kv < 2; kv++) {
                    size_t off = (((size_t)l * 2 + kv) * H + h) * BT * D * 4 + (pos % BT) * D * 4;
                    const float *want = (kv ? vbuf : kbuf) + h * D;
                    assert_memory_equal(blk + off, want, D * 4);
                }
        }
    }
}

typedef struct log_capture {
    int calls;
    int32_t level;
    char msg[256];
} log_capture;

static void log_sink(void *user, int32_t level, const char *message)
{
    log_capture *c = user;
    c->calls++;
    c->level = level;
    snprintf(c->msg, sizeof(c->msg), "%s", message);
}

/* Tiers and arrays whose sizes are not whole pages (80-wide heads) kept
 * up to 2 MiB of address space each after close, so that a process
 * opening engines in a loop met RLIMIT_AS after about 500 opens. */
static void test_open_close_gives_address_space_back(void **state)
{
    (void)state;
    kvh_config c;
    kvh_config_init(&c, sizeof(c));
    c.backend = KVH_BACKEND_CPU;
    c.num_layers = 1;
    c.num_kv_heads = 1;
    c.head_dim = 80;
    c.block_tokens = 16;
    c.device_bytes = 3u << 20;
    c.host_bytes = 5u << 20;
    c.migration_threads = 0;
    long warm = 0;
    for (int i = 0; i < 40; i++) {
        if (i == 8)
            warm = tu_vm_size_kb();
        kvh_engine *e = NULL;
        assert_ok(kvh_engine_open(&c, &e));
        assert_ok(kvh_engine_close(e));
    }
    /* 32 opens each kept 4 MiB before (device and host tiers). */
    assert_true(tu_vm_size_kb() - warm < 8192);
}

static void test_log_sink(void **state)
{
    (void)state;
    /* AUTO without a usable CUDA backend logs (INFO) that it uses the CPU. */
    log_capture cap = {0};
    kvh_config c = small_cfg();
    c.backend = KVH_BACKEND_AUTO;
    c.log_fn = log_sink;
    c.log_user = &cap;
    c.log_level = KVH_LOG_DEBUG;
    kvh_engine *e = tu_open_cfg(&c);
    if (strcmp(kvh_engine_backend(e), "cpu") == 0) {
        assert_true(cap.calls >= 1);
        assert_true(cap.level >= KVH_LOG_ERROR && cap.level <= KVH_LOG_DEBUG);
        assert_true(cap.msg[0] != '\0');
    }
    assert_ok(tu_close(e));
    /* The level filter: WARN drops the INFO message. */
    memset(&cap, 0, sizeof(cap));
    c.log_level = KVH_LOG_WARN;
    e = tu_open_cfg(&c);
    for (int i = 0; i < cap.calls; i++)
        assert_true(cap.level <= KVH_LOG_WARN);
    assert_ok(tu_close(e));
}

/* A small engine's configuration whose warnings go to cap. */
static kvh_config warnings_into(log_capture *cap)
{
    kvh_config c = small_cfg();
    c.log_fn = log_sink;
    c.log_user = cap;
    c.log_level = KVH_LOG_WARN;
    return c;
}

/* A NUMA node the machine lacks was taken and bound nothing, silently. */
static void test_absent_numa_node_is_said(void **state)
{
    (void)state;
    log_capture cap = {0};
    kvh_config c = warnings_into(&cap);
    c.numa_node = 999;
    kvh_engine *e = tu_open_cfg(&c);
    assert_int_equal(cap.calls, 1);
    assert_int_equal(cap.level, KVH_LOG_WARN);
    assert_non_null(strstr(cap.msg, "numa_node 999: this machine has no such node"));
    assert_ok(tu_close(e));
    memset(&cap, 0, sizeof(cap));
    c.numa_node = -1;
    e = tu_open_cfg(&c);
    assert_int_equal(cap.calls, 0);
    assert_ok(tu_close(e));
}

/* A migration_cpu_mask naming only CPUs this process cannot run on (ones
 * the machine lacks) bound nothing, silently. */
static void test_a_cpu_mask_of_absent_cpus_is_said(void **state)
{
    (void)state;
    cpu_set_t allowed;
    assert_int_equal(sched_getaffinity(0, sizeof(allowed), &allowed), 0);
    int absent = 63;
    while (absent >= 0 && CPU_ISSET(absent, &allowed))
        absent--;
    if (absent < 0)
        skip(); /* 64 CPUs, all ours */
    log_capture cap = {0};
    kvh_config c = warnings_into(&cap);
    c.migration_threads = 1;
    c.migration_cpu_mask = 1ull << absent;
    kvh_engine *e = tu_open_cfg(&c);
    assert_int_equal(cap.calls, 1);
    assert_non_null(strstr(cap.msg, "names no CPU this process may run on"));
    assert_ok(tu_close(e));
    /* One CPU of ours in the mask: nothing to say. */
    memset(&cap, 0, sizeof(cap));
    int ours = 0;
    while (!CPU_ISSET(ours, &allowed))
        ours++;
    c.migration_cpu_mask = 1ull << absent | 1ull << ours;
    e = tu_open_cfg(&c);
    assert_int_equal(cap.calls, 0);
    assert_ok(tu_close(e));
}

/* Moves in place put the host tier in the device tier's arena: a host
 * budget too large to allocate was reported as the device tier's, which
 * sent a user who never set device_bytes to the wrong setting. */
static void test_an_arena_too_large_names_both_tiers(void **state)
{
    (void)state;
    kvh_config c = small_cfg();
    c.backend = KVH_BACKEND_CPU;
    c.head_dim = 128, c.block_tokens = 64; /* 256 KiB blocks: their records fit in memory, the arena not */
    c.device_bytes = 1u << 20;
    c.host_bytes = 1ull << 40;
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&c, &e);
    if (st == KVH_OK) { /* overcommit without limit: nothing to report */
        assert_ok(kvh_engine_close(e));
        skip();
    }
    assert_kvh(KVH_ERR_NOMEM, st);
    assert_non_null(strstr(kvh_last_error(), "device and host tiers"));
    assert_non_null(strstr(kvh_last_error(), "host_bytes"));
}

/* Budgets whose block records alone pass the machine's memory (1 KiB
 * blocks, a 1 TiB host tier: 2^30 records): the open mapped and touched
 * the tiers first and took a minute to fail, or met the OOM killer. */
static void test_records_larger_than_memory_are_refused_at_once(void **state)
{
    (void)state;
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages <= 0 || page <= 0 || (uint64_t)pages * (uint64_t)page > (64ull << 30))
        skip(); /* 2^30 records of a few hundred bytes fit a machine this large */
    kvh_config c = small_cfg();
    c.backend = KVH_BACKEND_CPU;
    c.host_bytes = 1ull << 40;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    kvh_engine *e = NULL;
    assert_kvh(KVH_ERR_NOMEM, kvh_engine_open(&c, &e));
    clock_gettime(CLOCK_MONOTONIC, &t1);
    assert_null(e);
    assert_non_null(strstr(kvh_last_error(), "more than this machine's"));
    assert_non_null(strstr(kvh_last_error(), "block_tokens"));
    assert_true(t1.tv_sec - t0.tv_sec < 5);
}

/* Workers that cannot start (the thread limit, RLIMIT_NPROC, counts for a
 * user other than root): the open said "cannot start migration worker 0"
 * and no why. A child process as user nobody, limited to its own one. */
static void test_a_worker_that_cannot_start_says_why(void **state)
{
    (void)state;
    if (geteuid() != 0)
        skip(); /* becoming another user needs root */
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        struct rlimit one = {1, 1};
        if (setgid(65534) != 0 || setuid(65534) != 0 || setrlimit(RLIMIT_NPROC, &one) != 0)
            _exit(10);
        kvh_config c = tu_cfg(1, 1, 8, 4, KVH_DTYPE_F32, 4, 4, 2);
        kvh_engine *e = NULL;
        kvh_status st = kvh_engine_open(&c, &e);
        if (st == KVH_OK)
            _exit(kvh_engine_close(e) == KVH_OK ? 11 : 12); /* the limit did not bite here */
        if (st != KVH_ERR_NOMEM || !strstr(kvh_last_error(), "RLIMIT_NPROC")) {
            fprintf(stderr, "%s: %s\n", kvh_status_name(st), kvh_last_error());
            _exit(13);
        }
        _exit(0);
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    if (WEXITSTATUS(status) == 11)
        skip();
    assert_int_equal(WEXITSTATUS(status), 0);
}

static void test_last_error_thread_local_cleared(void **state)
{
    (void)state;
    kvh_engine *e = tu_open(2, 2, 8, 4, KVH_DTYPE_F32, 8, 8, 0);
    kvh_seq s = tu_seq_new(e, 0);
    assert_kvh(KVH_ERR_RANGE, kvh_seq_truncate(e, s, 5));
    assert_true(kvh_last_error()[0] != '\0');
    uint64_t n;
    assert_ok(kvh_seq_length(e, s, &n));
    assert_string_equal(kvh_last_error(), "");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_version, tu_teardown),
        cmocka_unit_test_teardown(test_a_worker_that_cannot_start_says_why, tu_teardown),
        cmocka_unit_test_teardown(test_absent_numa_node_is_said, tu_teardown),
        cmocka_unit_test_teardown(test_an_arena_too_large_names_both_tiers, tu_teardown),
        cmocka_unit_test_teardown(test_records_larger_than_memory_are_refused_at_once, tu_teardown),
        cmocka_unit_test_teardown(test_a_cpu_mask_of_absent_cpus_is_said, tu_teardown),
        cmocka_unit_test_teardown(test_status_text, tu_teardown),
        cmocka_unit_test_teardown(test_config_init_defaults, tu_teardown),
        cmocka_unit_test_teardown(test_config_init_bad_args, tu_teardown),
        cmocka_unit_test_teardown(test_open_invalid_geometry, tu_teardown),
        cmocka_unit_test_teardown(test_open_valid_edges, tu_teardown),
        cmocka_unit_test_teardown(test_open_default_config, tu_teardown),
        cmocka_unit_test_teardown(test_prefault_memory, tu_teardown),
        cmocka_unit_test_teardown(test_prefault_memory_counts_block_records, tu_teardown),
        cmocka_unit_test_teardown(test_prefault_memory_skips_the_vmap_device_tier, tu_teardown),
        cmocka_unit_test_teardown(test_prefault_memory_auto_backend, tu_teardown),
        cmocka_unit_test_teardown(test_mem_available_follows_the_cgroup_limit, tu_teardown),
        cmocka_unit_test_teardown(test_explicit_cuda, tu_teardown),
        cmocka_unit_test_teardown(test_close_null_and_misc, tu_teardown),
        cmocka_unit_test_teardown(test_budgets_round_down, tu_teardown),
        cmocka_unit_test_teardown(test_tier_info_args, tu_teardown),
        cmocka_unit_test_teardown(test_tier_accounting, tu_teardown),
        cmocka_unit_test_teardown(test_stats_struct_size, tu_teardown),
        cmocka_unit_test_teardown(test_tier_base_layout, tu_teardown),
        cmocka_unit_test_teardown(test_log_sink, tu_teardown),
        cmocka_unit_test(test_open_close_gives_address_space_back),
        cmocka_unit_test_teardown(test_last_error_thread_local_cleared, tu_teardown),
    };
    return cmocka_run_group_tests_name("engine", tests, NULL, NULL);
}
