/* kvh_config_from_env: every field from its variable, sizes with
 * suffixes, bad values named in the error and leaving the config as it
 * was, and struct_size (fields past it are neither read nor written). */
#include <stdlib.h>

#include "test_util.h"

static kvh_config defaults(void)
{
    kvh_config c;
    assert_ok(kvh_config_init(&c, sizeof(c)));
    return c;
}

static void test_every_field(void **state)
{
    (void)state;
    static const char *const env[] = {
        "PATH=/bin",
        "KVH_NUM_LAYERS=3",
        "KVH_NUM_KV_HEADS=2",
        "KVH_HEAD_DIM=128",
        "KVH_BLOCK_TOKENS=32",
        "KVH_DTYPE=BF16",
        "KVH_BACKEND=cpu",
        "KVH_CUDA_DEVICE=1",
        "KVH_DEVICE_BYTES=64M",
        "KVH_HOST_BYTES=4G",
        "KVH_DISK_BYTES=2TiB",
        "KVH_DISK_PATH=/tmp/kvh store",
        "KVH_MODEL_SALT=0xdeadbeefcafe",
        "KVH_NUMA_NODE=-1",
        "KVH_MIGRATION_THREADS=0",
        "KVH_MIGRATION_CPU_MASK=0xf0",
        "KVH_LRU_K=3",
        "KVH_PROMOTE_MIN_HITS=4",
        "KVH_LOG_LEVEL=debug",
        "KVH_DISK_QUEUE_DEPTH=64",
        "KVH_DISK_FLAGS=buffered,share_group",
        "KVH_KV_CODEC=q4_g64",
        "KVH_VMAP=yes",
        "KVH_EVICTION_POLICY=lctru",
        "KVH_LCTRU_WINDOW=100",
        "KVH_COPY_MOVES=on",
        "KVH_DISK_STRICT_INDEX=true",
        "KVH_REMOTE_ADDRS=10.0.0.1:7000,10.0.0.2:7000",
        "KVH_REMOTE_USER=kvh",
        "KVH_REMOTE_PASSWORD=s3cret",
        "KVH_REMOTE_TLS_CA=/etc/ca.pem",
        "KVH_REMOTE_TLS=off",
        "KVH_REMOTE_TIMEOUT_MS=75",
        "KVH_REMOTE_TTL_S=3600",
        "KVH_REMOTE_UPLOAD=persist",
        "KVH_REMOTE_BREAKER_MS=500",
        "KVH_PREFAULT_MEMORY=1",
        "KVH_UNRELATED=whatever",
        NULL,
    };
    kvh_config c = defaults();
    assert_ok(kvh_config_from_env(&c, sizeof(c), env));
    assert_int_equal(c.struct_size, sizeof(c));
    assert_int_equal(c.num_layers, 3);
    assert_int_equal(c.num_kv_heads, 2);
    assert_int_equal(c.head_dim, 128);
    assert_int_equal(c.block_tokens, 32);
    assert_int_equal(c.dtype, KVH_DTYPE_BF16);
    assert_int_equal(c.backend, KVH_BACKEND_CPU);
    assert_int_equal(c.cuda_device, 1);
    assert_int_equal(c.device_bytes, 64ull << 20);
    assert_int_equal(c.host_bytes, 4ull << 30);
    assert_int_equal(c.disk_bytes, 2ull << 40);
    assert_string_equal(c.disk_path, "/tmp/kvh store");
    assert_true(c.disk_path == env[11] + strlen("KVH_DISK_PATH="));
    assert_int_equal(c.model_salt, 0xdeadbeefcafeull);
    assert_int_equal(c.numa_node, -1);
    assert_int_equal(c.migration_threads, 0);
    assert_int_equal(c.migration_cpu_mask, 0xf0);
    assert_int_equal(c.lru_k, 3);
    assert_int_equal(c.promote_min_hits, 4);
    assert_int_equal(c.log_level, KVH_LOG_DEBUG);
    assert_int_equal(c.disk_queue_depth, 64);
    assert_int_equal(c.disk_flags, KVH_DISK_BUFFERED | KVH_DISK_SHARE_GROUP);
    assert_int_equal(c.kv_codec, KVH_CODEC_Q4_G64);
    assert_int_equal(c.vmap, 1);
    assert_int_equal(c.eviction_policy, KVH_EVICT_LCTRU);
    assert_int_equal(c.lctru_window, 100);
    assert_int_equal(c.copy_moves, 1);
    assert_int_equal(c.disk_strict_index, 1);
    assert_string_equal(c.remote_addrs, "10.0.0.1:7000,10.0.0.2:7000");
    assert_string_equal(c.remote_user, "kvh");
    assert_string_equal(c.remote_password, "s3cret");
    assert_string_equal(c.remote_tls_ca, "/etc/ca.pem");
    assert_int_equal(c.remote_tls, 0);
    assert_int_equal(c.remote_timeout_ms, 75);
    assert_int_equal(c.remote_ttl_s, 3600);
    assert_int_equal(c.remote_upload, KVH_REMOTE_UPLOAD_PERSIST);
    assert_int_equal(c.remote_breaker_ms, 500);
    assert_int_equal(c.prefault_memory, 1);
}

/* Unset and empty variables keep what the config holds; an empty
 * environment changes nothing. */
static void test_keeps_what_is_unset(void **state)
{
    (void)state;
    static const char *const none[] = {NULL};
    static const char *const empty[] = {"KVH_HOST_BYTES=", NULL};
    kvh_config c = defaults();
    c.host_bytes = 12345;
    c.head_dim = 96;
    kvh_config before = c;
    assert_ok(kvh_config_from_env(&c, sizeof(c), none));
    assert_memory_equal(&c, &before, sizeof(c));
    assert_ok(kvh_config_from_env(&c, sizeof(c), empty));
    assert_memory_equal(&c, &before, sizeof(c));
}

static void check_size(const char *text, uint64_t want)
{
    char var[64];
    snprintf(var, sizeof(var), "KVH_HOST_BYTES=%s", text);
    const char *env[] = {var, NULL};
    kvh_config c = defaults();
    assert_ok(kvh_config_from_env(&c, sizeof(c), env));
    assert_int_equal(c.host_bytes, want);
}

static void test_size_suffixes(void **state)
{
    (void)state;
    check_size("4096", 4096);
    check_size("0", 0);
    check_size("4k", 4096);
    check_size("4K", 4096);
    check_size("4KiB", 4096);
    check_size("4KB", 4096);
    check_size("4Ki", 4096);
    check_size("512M", 512ull << 20);
    check_size("512MiB", 512ull << 20);
    check_size("4G", 4ull << 30);
    check_size("4g", 4ull << 30);
    check_size("3T", 3ull << 40);
    check_size("1P", 1ull << 50);
    check_size("100B", 100);
    check_size("18446744073709551615", UINT64_MAX);
}

static void test_log_level_spellings(void **state)
{
    (void)state;
    static const char *const words[] = {"KVH_LOG_LEVEL=warning", "KVH_LOG_LEVEL=WARN", "KVH_LOG_LEVEL=Warning"};
    for (size_t i = 0; i < sizeof(words) / sizeof(words[0]); i++) {
        const char *env[] = {words[i], NULL};
        kvh_config c = defaults();
        c.log_level = KVH_LOG_DEBUG;
        assert_ok(kvh_config_from_env(&c, sizeof(c), env));
        assert_int_equal(c.log_level, KVH_LOG_WARN);
    }
}

/* A bad value: KVH_ERR_INVALID_ARG, the message names the variable and
 * the value, and the config is as it was (even for the fields of valid
 * variables before it). */
static void check_bad(const char *var)
{
    const char *env[] = {"KVH_NUM_LAYERS=7", var, NULL};
    kvh_config c = defaults();
    kvh_config before = c;
    if (kvh_config_from_env(&c, sizeof(c), env) != KVH_ERR_INVALID_ARG)
        fail_msg("%s was accepted", var);
    assert_memory_equal(&c, &before, sizeof(c));
    char name[64];
    size_t n = strcspn(var, "=");
    snprintf(name, sizeof(name), "%.*s=\"%s\"", (int)n, var, var + n + 1);
    if (!strstr(kvh_last_error(), name))
        fail_msg("\"%s\" does not name %s", kvh_last_error(), name);
}

static void test_bad_values(void **state)
{
    (void)state;
    check_bad("KVH_HOST_BYTES=4X");
    check_bad("KVH_HOST_BYTES=4GG");
    check_bad("KVH_HOST_BYTES=-1");
    check_bad("KVH_HOST_BYTES= 4G");
    check_bad("KVH_HOST_BYTES=1.5G");
    check_bad("KVH_HOST_BYTES=G");
    check_bad("KVH_HOST_BYTES=4BB");
    check_bad("KVH_HOST_BYTES=4iB");
    check_bad("KVH_HOST_BYTES=16384P");
    check_bad("KVH_DEVICE_BYTES=18446744073709551616");
    check_bad("KVH_HEAD_DIM=4294967296");
    check_bad("KVH_HEAD_DIM=0x10");
    check_bad("KVH_HEAD_DIM=64 ");
    check_bad("KVH_NUMA_NODE=2147483648");
    check_bad("KVH_NUMA_NODE=-2147483649");
    check_bad("KVH_NUMA_NODE=--1");
    /* Below what the field takes (the engine refused them later, naming
     * the field rather than the variable). */
    check_bad("KVH_NUMA_NODE=-2");
    check_bad("KVH_NUMA_NODE=-2147483648");
    check_bad("KVH_CUDA_DEVICE=-1");
    /* Bits no name stands for. */
    check_bad("KVH_DISK_FLAGS=8");
    check_bad("KVH_DISK_FLAGS=0xffffffff");
    check_bad("KVH_REMOTE_UPLOAD=0x10");
    check_bad("KVH_DTYPE=f64");
    /* Numbers no name stands for (kvh_engine_open would refuse them
     * without naming the variable). */
    check_bad("KVH_DTYPE=3");
    check_bad("KVH_BACKEND=3");
    check_bad("KVH_LOG_LEVEL=4");
    check_bad("KVH_KV_CODEC=4");
    check_bad("KVH_EVICTION_POLICY=3");
    check_bad("KVH_BACKEND=gpu");
    check_bad("KVH_LOG_LEVEL=loud");
    check_bad("KVH_KV_CODEC=int4");
    check_bad("KVH_EVICTION_POLICY=fifo");
    check_bad("KVH_VMAP=2");
    check_bad("KVH_COPY_MOVES=maybe");
    check_bad("KVH_PREFAULT_MEMORY=2");
    check_bad("KVH_DISK_FLAGS=buffered,fast");
    check_bad("KVH_DISK_FLAGS=buffered,");
    check_bad("KVH_MODEL_SALT=salt");
}

/* A signed field refused on either side says what it takes: its own
 * least value, not the type's. */
static void test_signed_range_in_message(void **state)
{
    (void)state;
    static const char *const numa[] = {"KVH_NUMA_NODE=2147483648", "KVH_NUMA_NODE=-2147483649",
                                       "KVH_NUMA_NODE=-2147483648", "KVH_NUMA_NODE=-2"};
    for (size_t i = 0; i < sizeof(numa) / sizeof(numa[0]); i++) {
        check_bad(numa[i]);
        if (!strstr(kvh_last_error(), "from -1 to 2147483647"))
            fail_msg("%s: \"%s\" does not give -1 as the least value", numa[i], kvh_last_error());
    }
    check_bad("KVH_CUDA_DEVICE=99999999999");
    if (!strstr(kvh_last_error(), "from 0 to 2147483647"))
        fail_msg("\"%s\" does not give 0 as the least value", kvh_last_error());
}

static void test_numbers_for_names(void **state)
{
    (void)state;
    static const char *const env[] = {"KVH_DTYPE=0",       "KVH_LOG_LEVEL=2",  "KVH_DISK_FLAGS=1",
                                      "KVH_KV_CODEC=none", "KVH_NUMA_NODE=-1", NULL};
    kvh_config c = defaults();
    assert_ok(kvh_config_from_env(&c, sizeof(c), env));
    assert_int_equal(c.dtype, KVH_DTYPE_F32);
    assert_int_equal(c.log_level, KVH_LOG_INFO);
    assert_int_equal(c.disk_flags, KVH_DISK_RESET_ON_MISMATCH);
    assert_int_equal(c.kv_codec, KVH_CODEC_NONE);
    assert_int_equal(c.numa_node, -1);
    static const char *const none_flags[] = {"KVH_DISK_FLAGS=none", NULL};
    c.disk_flags = 3;
    assert_ok(kvh_config_from_env(&c, sizeof(c), none_flags));
    assert_int_equal(c.disk_flags, 0);
}

/* A caller of an older kvh.h: fields past its struct_size are not read
 * from the environment and its bytes past it are not written; sizes this
 * library does not know are refused. */
static void test_struct_size(void **state)
{
    (void)state;
    static const char *const env[] = {"KVH_NUM_LAYERS=5", "KVH_LRU_K=3", "KVH_DISK_STRICT_INDEX=1", NULL};
    size_t n = offsetof(kvh_config, lru_k) / 8 * 8;
    union {
        kvh_config s;
        uint8_t raw[sizeof(kvh_config) + 16];
    } u;
    memset(&u, 0xA5, sizeof(u));
    assert_ok(kvh_config_init(&u.s, n));
    assert_ok(kvh_config_from_env(&u.s, n, env));
    assert_int_equal(u.s.struct_size, n);
    assert_int_equal(u.s.num_layers, 5);
    for (size_t i = n; i < sizeof(u); i++)
        assert_int_equal(u.raw[i], 0xA5);

    kvh_config c = defaults();
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_config_from_env(&c, sizeof(c) + 8, env));
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_config_from_env(&c, n + 4, env));
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_config_from_env(&c, 4, env));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_config_from_env(NULL, sizeof(c), env));
}

/* envp NULL reads the process environment; the result opens an engine. */
static void test_process_environment(void **state)
{
    (void)state;
    setenv("KVH_HEAD_DIM", "32", 1);
    setenv("KVH_HOST_BYTES", "1M", 1);
    setenv("KVH_DEVICE_BYTES", "256K", 1);
    setenv("KVH_BACKEND", "cpu", 1);
    kvh_config c = defaults();
    assert_ok(kvh_config_from_env(&c, sizeof(c), NULL));
    unsetenv("KVH_HEAD_DIM");
    unsetenv("KVH_HOST_BYTES");
    unsetenv("KVH_DEVICE_BYTES");
    unsetenv("KVH_BACKEND");
    assert_int_equal(c.head_dim, 32);
    assert_int_equal(c.host_bytes, 1u << 20);
    kvh_engine *e = NULL;
    assert_ok(kvh_engine_open(&c, &e));
    kvh_tier_info ti = {.struct_size = sizeof(ti)};
    assert_ok(kvh_tier_info_get(e, KVH_TIER_HOST, &ti));
    assert_true(ti.capacity_blocks * ti.block_bytes <= 1u << 20);
    assert_true(ti.capacity_blocks > 0);
    assert_ok(kvh_engine_close(e));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_field),         cmocka_unit_test(test_keeps_what_is_unset),
        cmocka_unit_test(test_size_suffixes),       cmocka_unit_test(test_log_level_spellings),
        cmocka_unit_test(test_bad_values),          cmocka_unit_test(test_signed_range_in_message),
        cmocka_unit_test(test_numbers_for_names),   cmocka_unit_test(test_struct_size),
        cmocka_unit_test(test_process_environment),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
