/* kvh_config_from_env against a hostile environment, and the static texts
 * (kvh_strerror, kvh_status_name, kvh_version_string, kvh_last_error),
 * from kvh.h alone ("Configuration", "Version and errors"). Empty values
 * and names that are no field's are ignored; negative, overflowing
 * (including values that wrap to a small number in 32 or 64 bits), unit-
 * suffixed counts, malformed sizes, names and booleans, and very long
 * values are refused with KVH_ERR_INVALID_ARG, a message naming the
 * variable, and the config exactly as it was; ranges past the type are
 * left to kvh_engine_open, which refuses them; struct sizes are honoured;
 * the process environment is restored after each test. */
#include <pthread.h>
#include <stdlib.h>

#include "test_util.h"

#define ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

static kvh_config defaults(void)
{
    kvh_config c;
    memset(&c, 0, sizeof(c));
    assert_ok(kvh_config_init(&c, sizeof(c)));
    return c;
}

/* Every variable kvh_config_from_env reads. */
static const char *const FIELDS[] = {
    "NUM_LAYERS",
    "NUM_KV_HEADS",
    "HEAD_DIM",
    "BLOCK_TOKENS",
    "DTYPE",
    "BACKEND",
    "CUDA_DEVICE",
    "DEVICE_BYTES",
    "HOST_BYTES",
    "DISK_BYTES",
    "DISK_PATH",
    "MODEL_SALT",
    "NUMA_NODE",
    "MIGRATION_THREADS",
    "MIGRATION_CPU_MASK",
    "LRU_K",
    "PROMOTE_MIN_HITS",
    "LOG_LEVEL",
    "DISK_QUEUE_DEPTH",
    "DISK_FLAGS",
    "KV_CODEC",
    "VMAP",
    "EVICTION_POLICY",
    "LCTRU_WINDOW",
    "COPY_MOVES",
    "DISK_STRICT_INDEX",
    "REMOTE_ADDRS",
    "REMOTE_USER",
    "REMOTE_PASSWORD",
    "REMOTE_TLS_CA",
    "REMOTE_TLS",
    "REMOTE_TIMEOUT_MS",
    "REMOTE_TTL_S",
    "REMOTE_UPLOAD",
    "REMOTE_BREAKER_MS",
    "PREFAULT_MEMORY",
};

/* A config a bad value must leave exactly as it is: every field away from
 * its default. */
static kvh_config busy_config(void)
{
    kvh_config c = defaults();
    c.num_layers = 3;
    c.num_kv_heads = 5;
    c.head_dim = 96;
    c.block_tokens = 32;
    c.dtype = KVH_DTYPE_BF16;
    c.backend = KVH_BACKEND_CPU;
    c.cuda_device = 2;
    c.device_bytes = 12345;
    c.host_bytes = 67890;
    c.disk_bytes = 4242;
    c.disk_path = "/nonexistent/store";
    c.model_salt = 0x1122334455667788ull;
    c.numa_node = 1;
    c.migration_threads = 7;
    c.migration_cpu_mask = 0xf0f0;
    c.lru_k = 3;
    c.promote_min_hits = 9;
    c.log_level = KVH_LOG_DEBUG;
    c.disk_queue_depth = 17;
    c.disk_flags = KVH_DISK_BUFFERED;
    c.kv_codec = KVH_CODEC_INT8;
    c.vmap = 1;
    c.eviction_policy = KVH_EVICT_LCTRU;
    c.lctru_window = 55;
    c.copy_moves = 1;
    c.disk_strict_index = 1;
    c.remote_addrs = "h:1";
    c.remote_user = "u";
    c.remote_password = "p";
    c.remote_tls_ca = "ca";
    c.remote_tls = 1;
    c.remote_timeout_ms = 11;
    c.remote_ttl_s = 12;
    c.remote_upload = 3;
    c.remote_breaker_ms = 13;
    c.prefault_memory = 1;
    return c;
}

/* var is refused: KVH_ERR_INVALID_ARG, the message names the variable
 * (and the value, when it is short), the config is unchanged, whether the
 * variable comes first, between valid ones, or last. */
static void check_refused(const char *var)
{
    const char *name_end = strchr(var, '=');
    assert_non_null(name_end);
    size_t name_len = (size_t)(name_end - var);
    const char *value = name_end + 1;
    /* Two valid settings of other fields (a repeated name would be the
     * first one's). */
    static const char *const valid[] = {"KVH_PROMOTE_MIN_HITS=4", "KVH_MIGRATION_THREADS=3", "KVH_NUM_LAYERS=2"};
    const char *around[2];
    int na = 0;
    for (size_t i = 0; i < ARRAY_LEN(valid) && na < 2; i++)
        if (strncmp(valid[i], var, name_len + 1) != 0)
            around[na++] = valid[i];
    for (int where = 0; where < 3; where++) {
        const char *env[4] = {NULL};
        int n = 0;
        if (where > 0)
            env[n++] = around[0];
        env[n++] = var;
        if (where < 2)
            env[n++] = around[1];
        kvh_config c = busy_config();
        kvh_config before = c;
        kvh_status st = kvh_config_from_env(&c, sizeof(c), env);
        if (st != KVH_ERR_INVALID_ARG)
            fail_msg("\"%.200s\" (placed %d): %s, expected KVH_ERR_INVALID_ARG", var, where, kvh_status_name(st));
        const char *msg = kvh_last_error();
        assert_non_null(msg);
        char name[128];
        snprintf(name, sizeof(name), "%.*s", (int)name_len, var);
        if (!strstr(msg, name))
            fail_msg("\"%.200s\": the message \"%.300s\" does not name %s", var, msg, name);
        if (strlen(value) <= 40 && strlen(value) > 0 && !strstr(msg, value))
            fail_msg("\"%s\": the message \"%s\" does not show the value", var, msg);
        if (memcmp(&c, &before, sizeof(c)) != 0)
            fail_msg("\"%.200s\" (placed %d) changed the config", var, where);
    }
}

/* var is taken: KVH_OK; returns the config it made from busy_config. */
static kvh_config check_taken(const char *var)
{
    const char *env[] = {var, NULL};
    kvh_config c = busy_config();
    kvh_status st = kvh_config_from_env(&c, sizeof(c), env);
    if (st != KVH_OK)
        fail_msg("\"%.200s\": %s (%s), expected KVH_OK", var, kvh_status_name(st), kvh_last_error());
    assert_int_equal(c.struct_size, sizeof(c));
    return c;
}

/* ---- ignored: empty values, names that are no field's, odd entries ---- */

static void test_empty_and_foreign_entries_change_nothing(void **state)
{
    (void)state;
    char empty[ARRAY_LEN(FIELDS)][64];
    const char *env[ARRAY_LEN(FIELDS) + 1];
    for (size_t i = 0; i < ARRAY_LEN(FIELDS); i++) {
        snprintf(empty[i], sizeof(empty[i]), "KVH_%s=", FIELDS[i]);
        env[i] = empty[i];
    }
    env[ARRAY_LEN(FIELDS)] = NULL;
    kvh_config c = busy_config(), before = c;
    assert_ok(kvh_config_from_env(&c, sizeof(c), env));
    assert_memory_equal(&c, &before, sizeof(c));

    /* Names of no settable field, prefixes and extensions of real ones. */
    static const char *const foreign[] = {
        "KVH_=5",
        "KVH_LOG_FN=0x1234",
        "KVH_LOG_USER=0x1234",
        "KVH_RESERVED0=1",
        "KVH_RESERVED1=1",
        "KVH_RESERVED2=1",
        "KVH_HEAD_DIMS=5",
        "KVH_HEAD_DI=5",
        "KVH_HEAD_DIM_=5",
        "XKVH_HEAD_DIM=5",
        "KVHHEAD_DIM=5",
        " KVH_HEAD_DIM=5",
        "=KVH_HEAD_DIM",
        "=",
        "",
        "PATH=/usr/bin:/bin",
        NULL,
    };
    c = busy_config();
    assert_ok(kvh_config_from_env(&c, sizeof(c), foreign));
    assert_memory_equal(&c, &before, sizeof(c));
    /* The struct's size is the caller's word, not the environment's. */
    static const char *const size_var[] = {"KVH_STRUCT_SIZE=8", NULL};
    c = busy_config();
    kvh_status st = kvh_config_from_env(&c, sizeof(c), size_var);
    assert_true(st == KVH_OK || st == KVH_ERR_INVALID_ARG);
    assert_memory_equal(&c, &before, sizeof(c));
    /* An entry without '=' is no assignment. */
    static const char *const bare[] = {"KVH_HEAD_DIM", "KVH_DTYPE", NULL};
    c = busy_config();
    st = kvh_config_from_env(&c, sizeof(c), bare);
    assert_true(st == KVH_OK || st == KVH_ERR_INVALID_ARG);
    assert_memory_equal(&c, &before, sizeof(c));
    /* An empty environment. */
    static const char *const none[] = {NULL};
    c = busy_config();
    assert_ok(kvh_config_from_env(&c, sizeof(c), none));
    assert_memory_equal(&c, &before, sizeof(c));
}

/* ---- refused: negative, overflowing, suffixed, malformed ---- */

static void test_negative_values(void **state)
{
    (void)state;
    static const char *const refused[] = {
        "KVH_NUM_LAYERS=-1",
        "KVH_HEAD_DIM=-64",
        "KVH_BLOCK_TOKENS=-4294967295", /* wraps to 1 as an unsigned long */
        "KVH_MIGRATION_THREADS=-1",
        "KVH_LRU_K=-2",
        "KVH_LCTRU_WINDOW=-18446744073709551615",
        "KVH_REMOTE_TIMEOUT_MS=-50",
        "KVH_DEVICE_BYTES=-1",
        "KVH_HOST_BYTES=-1K",
        "KVH_DISK_BYTES=-18446744073709551615",
        "KVH_MODEL_SALT=-1",
        "KVH_MODEL_SALT=-0x1",
        "KVH_MIGRATION_CPU_MASK=-1",
        "KVH_DTYPE=-1",
        "KVH_LOG_LEVEL=-1",
        "KVH_DISK_FLAGS=-1",
        "KVH_VMAP=-1",
        "KVH_NUMA_NODE=-2147483649",
        "KVH_CUDA_DEVICE=-9223372036854775808",
        "KVH_NUMA_NODE=- 1",
    };
    for (size_t i = 0; i < ARRAY_LEN(refused); i++)
        check_refused(refused[i]);
    /* Signed fields take negative numbers down to their least value: -1
     * ("none") for the NUMA node, none for a CUDA device. */
    assert_int_equal(check_taken("KVH_NUMA_NODE=-1").numa_node, -1);
    check_refused("KVH_NUMA_NODE=-2");
    check_refused("KVH_CUDA_DEVICE=-7");
    check_refused("KVH_CUDA_DEVICE=-2147483648");
    assert_int_equal(check_taken("KVH_CUDA_DEVICE=0").cuda_device, 0);
}

static void test_overflowing_values(void **state)
{
    (void)state;
    static const char *const refused[] = {
        /* 32-bit counts: one past, and values that truncate to 0 or 1. */
        "KVH_HEAD_DIM=4294967296",
        "KVH_HEAD_DIM=4294967297",
        "KVH_NUM_LAYERS=8589934592",
        "KVH_LRU_K=18446744073709551617", /* wraps to 1 in 64 bits */
        "KVH_MIGRATION_THREADS=18446744073709551616",
        "KVH_LCTRU_WINDOW=36893488147419103232",
        "KVH_PROMOTE_MIN_HITS=99999999999999999999999999999999",
        "KVH_REMOTE_TTL_S=4294967296",
        "KVH_DISK_QUEUE_DEPTH=4294967330",
        /* Signed 32-bit fields: past INT32_MAX, and 2^32 - 1, which is -1
         * as an int32. */
        "KVH_NUMA_NODE=2147483648",
        "KVH_NUMA_NODE=4294967295",
        "KVH_CUDA_DEVICE=4294967295",
        "KVH_CUDA_DEVICE=9223372036854775807",
        /* Numbers for names. */
        "KVH_DTYPE=4294967296",
        "KVH_EVICTION_POLICY=4294967297",
        "KVH_DISK_FLAGS=4294967297",
        "KVH_LOG_LEVEL=18446744073709551616",
        /* 64-bit fields. */
        "KVH_DEVICE_BYTES=18446744073709551616",
        "KVH_DEVICE_BYTES=18446744073709551617",
        "KVH_HOST_BYTES=36893488147419103233",
        "KVH_HOST_BYTES=16384P",
        "KVH_HOST_BYTES=16385P",
        "KVH_HOST_BYTES=17179869184G",
        "KVH_HOST_BYTES=18014398509481984K",
        "KVH_HOST_BYTES=18446744073709551615K",
        "KVH_HOST_BYTES=17179869185G",
        "KVH_DISK_BYTES=16777216T",
        "KVH_MODEL_SALT=18446744073709551616",
        "KVH_MODEL_SALT=0x10000000000000000",
        "KVH_MODEL_SALT=0x1ffffffffffffffff",
        "KVH_MIGRATION_CPU_MASK=0x100000000000000000000",
    };
    for (size_t i = 0; i < ARRAY_LEN(refused); i++)
        check_refused(refused[i]);
    /* The largest values that fit. */
    assert_int_equal(check_taken("KVH_HEAD_DIM=4294967295").head_dim, UINT32_MAX);
    assert_int_equal(check_taken("KVH_NUMA_NODE=2147483647").numa_node, INT32_MAX);
    assert_int_equal(check_taken("KVH_HOST_BYTES=18014398509481983K").host_bytes, UINT64_MAX - 1023);
    assert_int_equal(check_taken("KVH_HOST_BYTES=16383P").host_bytes, 16383ull << 50);
    assert_int_equal(check_taken("KVH_MODEL_SALT=0xFFFFFFFFFFFFFFFF").model_salt, UINT64_MAX);
    assert_int_equal(check_taken("KVH_MODEL_SALT=18446744073709551615").model_salt, UINT64_MAX);
    assert_int_equal(check_taken("KVH_MIGRATION_CPU_MASK=0x8000000000000000").migration_cpu_mask, 1ull << 63);
}

static void test_units_where_none_belong_and_malformed_sizes(void **state)
{
    (void)state;
    static const char *const refused[] = {
        /* Counts are plain decimal. */
        "KVH_HEAD_DIM=64K",
        "KVH_HEAD_DIM=64k",
        "KVH_LRU_K=2k",
        "KVH_MIGRATION_THREADS=1M",
        "KVH_REMOTE_TIMEOUT_MS=50ms",
        "KVH_REMOTE_TTL_S=1d",
        "KVH_REMOTE_BREAKER_MS=2s",
        "KVH_NUMA_NODE=1K",
        "KVH_CUDA_DEVICE=0x1",
        "KVH_BLOCK_TOKENS=1e1",
        "KVH_BLOCK_TOKENS=16.0",
        "KVH_NUM_LAYERS=0b11",
        "KVH_MODEL_SALT=1K",
        "KVH_MIGRATION_CPU_MASK=0xffK",
        "KVH_MIGRATION_CPU_MASK=0x",
        "KVH_MIGRATION_CPU_MASK=0xg",
        "KVH_MODEL_SALT=0x 1",
        /* Sizes: decimal, one suffix, nothing after it. */
        "KVH_HOST_BYTES=0x10",
        "KVH_HOST_BYTES=0x10K",
        "KVH_HOST_BYTES=4KK",
        "KVH_HOST_BYTES=4KiBB",
        "KVH_HOST_BYTES=4iB",
        "KVH_HOST_BYTES=4 K",
        "KVH_HOST_BYTES=4K ",
        "KVH_HOST_BYTES=4E",
        "KVH_HOST_BYTES=4Z",
        "KVH_HOST_BYTES=4e9",
        "KVH_HOST_BYTES=4.0G",
        "KVH_HOST_BYTES=4MB/s",
        "KVH_HOST_BYTES=4GiBps",
        "KVH_HOST_BYTES=K",
        "KVH_HOST_BYTES=KiB",
        "KVH_HOST_BYTES=-",
        "KVH_HOST_BYTES=4G\n",
        "KVH_DEVICE_BYTES=1,024",
        "KVH_DEVICE_BYTES=1_024",
        "KVH_DISK_BYTES=ten",
    };
    for (size_t i = 0; i < ARRAY_LEN(refused); i++)
        check_refused(refused[i]);
    /* Leading zeros are still decimal. */
    assert_int_equal(check_taken("KVH_HEAD_DIM=0064").head_dim, 64);
    assert_int_equal(check_taken("KVH_HOST_BYTES=0004k").host_bytes, 4096);
}

/* model_salt and migration_cpu_mask are "decimal, or hex with 0x": a
 * leading zero is still decimal, never octal ("010" is 10, "08" is 8). */
static void test_leading_zero_is_decimal_not_octal(void **state)
{
    (void)state;
    assert_int_equal(check_taken("KVH_MODEL_SALT=0x10").model_salt, 16);
    assert_int_equal(check_taken("KVH_MODEL_SALT=0").model_salt, 0);
    assert_int_equal(check_taken("KVH_MODEL_SALT=010").model_salt, 10);
    assert_int_equal(check_taken("KVH_MODEL_SALT=0010").model_salt, 10);
    assert_int_equal(check_taken("KVH_MODEL_SALT=09").model_salt, 9);
    assert_int_equal(check_taken("KVH_MIGRATION_CPU_MASK=0777").migration_cpu_mask, 777);
    assert_int_equal(check_taken("KVH_MIGRATION_CPU_MASK=08").migration_cpu_mask, 8);
}

static void test_garbage_names_and_booleans(void **state)
{
    (void)state;
    static const char *const refused[] = {
        "KVH_DTYPE=f16 ",
        "KVH_DTYPE= f16",
        "KVH_DTYPE=f1",
        "KVH_DTYPE=f166",
        "KVH_DTYPE=fp16",
        "KVH_DTYPE=float16",
        "KVH_DTYPE=f16\t",
        "KVH_DTYPE=bf",
        "KVH_BACKEND=cpu,cuda",
        "KVH_BACKEND=cpux",
        "KVH_BACKEND=c",
        "KVH_LOG_LEVEL=warnings",
        "KVH_LOG_LEVEL=err",
        "KVH_KV_CODEC=int8 ",
        "KVH_KV_CODEC=q4_g128",
        "KVH_KV_CODEC=q4",
        "KVH_EVICTION_POLICY=lru",
        "KVH_EVICTION_POLICY=lru-k",
        "KVH_EVICTION_POLICY=lru_k_",
        "KVH_VMAP=y",
        "KVH_VMAP=ye",
        "KVH_VMAP=yes!",
        "KVH_VMAP=of",
        "KVH_VMAP=off ",
        "KVH_VMAP=2",
        "KVH_VMAP=10",
        "KVH_COPY_MOVES=truee",
        "KVH_COPY_MOVES=t",
        "KVH_DISK_STRICT_INDEX=enable",
        "KVH_REMOTE_TLS=maybe",
        "KVH_DISK_FLAGS=buffered,,share_group",
        "KVH_DISK_FLAGS=,buffered",
        "KVH_DISK_FLAGS=buffered share_group",
        "KVH_DISK_FLAGS=buffered;share_group",
        "KVH_DISK_FLAGS=reset",
        "KVH_DISK_FLAGS=,",
        "KVH_DISK_FLAGS=\x01",
        "KVH_DTYPE=\xff\xfe",
    };
    for (size_t i = 0; i < ARRAY_LEN(refused); i++)
        check_refused(refused[i]);
    /* Names in any case. */
    assert_int_equal(check_taken("KVH_DTYPE=F16").dtype, KVH_DTYPE_F16);
    assert_int_equal(check_taken("KVH_BACKEND=CpU").backend, KVH_BACKEND_CPU);
    assert_int_equal(check_taken("KVH_EVICTION_POLICY=LRU_K").eviction_policy, KVH_EVICT_LRU_K);
    assert_int_equal(check_taken("KVH_VMAP=OFF").vmap, 0);
    assert_int_equal(check_taken("KVH_COPY_MOVES=False").copy_moves, 0);
    assert_int_equal(check_taken("KVH_DISK_STRICT_INDEX=NO").disk_strict_index, 0);
    assert_int_equal(check_taken("KVH_REMOTE_TLS=Yes").remote_tls, 1);
    assert_int_equal(check_taken("KVH_DISK_FLAGS=Reset_On_Mismatch,BUFFERED").disk_flags,
                     KVH_DISK_RESET_ON_MISMATCH | KVH_DISK_BUFFERED);
    /* A flags field's refusal lists that field's own names. */
    static const struct {
        const char *var, *names, *foreign;
    } lists[] = {
        {"KVH_REMOTE_UPLOAD=bogus", "persist, demote, write_through", "buffered"},
        {"KVH_DISK_FLAGS=bogus", "reset_on_mismatch, buffered, share_group", "write_through"},
    };
    for (size_t i = 0; i < ARRAY_LEN(lists); i++) {
        check_refused(lists[i].var);
        const char *env[] = {lists[i].var, NULL};
        kvh_config c = busy_config();
        assert_int_equal(kvh_config_from_env(&c, sizeof(c), env), KVH_ERR_INVALID_ARG);
        const char *msg = kvh_last_error();
        if (!strstr(msg, lists[i].names) || strstr(msg, lists[i].foreign))
            fail_msg("\"%s\": the message \"%s\" does not list %s alone", lists[i].var, msg, lists[i].names);
    }
}

/* ---- very long values and environments ---- */

static char *repeat(const char *prefix, char fill, size_t n, const char *suffix)
{
    size_t p = strlen(prefix), s = strlen(suffix);
    char *out = tu_alloc(p + n + s + 1);
    memcpy(out, prefix, p);
    memset(out + p, fill, n);
    memcpy(out + p + n, suffix, s + 1);
    return out;
}

static void test_very_long_values(void **state)
{
    (void)state;
    /* Long numbers: refused, with a message naming the variable. */
    check_refused(repeat("KVH_HEAD_DIM=", '9', 100000, ""));
    check_refused(repeat("KVH_HOST_BYTES=1", '0', 5000, "G"));
    check_refused(repeat("KVH_MODEL_SALT=0x", 'f', 4096, ""));
    check_refused(repeat("KVH_NUMA_NODE=-", '9', 4096, ""));
    check_refused(repeat("KVH_DTYPE=", 'f', 65536, ""));
    check_refused(repeat("KVH_DISK_FLAGS=buffered", ',', 4096, "buffered"));
    check_refused(repeat("KVH_VMAP=", 'y', 10000, "es"));
    /* Many leading zeros are still the number (or refused, never another
     * value). */
    {
        const char *env[] = {repeat("KVH_HEAD_DIM=", '0', 10000, "64"), NULL};
        kvh_config c = busy_config();
        kvh_status st = kvh_config_from_env(&c, sizeof(c), env);
        assert_true(st == KVH_OK || st == KVH_ERR_INVALID_ARG);
        assert_int_equal(c.head_dim, st == KVH_OK ? 64 : 96);
    }
    /* Long text fields are taken as they are, in place. */
    const char *path = repeat("KVH_DISK_PATH=/", 'p', 65536, "/store");
    const char *addrs = repeat("KVH_REMOTE_ADDRS=", 'a', 100000, ":6379");
    const char *env[] = {path, addrs, NULL};
    kvh_config c = busy_config();
    assert_ok(kvh_config_from_env(&c, sizeof(c), env));
    assert_ptr_equal(c.disk_path, path + strlen("KVH_DISK_PATH="));
    assert_ptr_equal(c.remote_addrs, addrs + strlen("KVH_REMOTE_ADDRS="));
    assert_int_equal(strlen(c.disk_path), 65536 + 7);
    /* A very long name is no field's; a large environment with one
     * setting among thousands of others. */
    enum { MANY = 20000 };
    const char **big = tu_alloc(sizeof(char *) * (MANY + 3));
    char *text = tu_alloc((size_t)MANY * 32);
    big[0] = repeat("KVH_", 'X', 200000, "=1");
    for (int i = 1; i <= MANY; i++) {
        char *v = text + (size_t)(i - 1) * 32;
        snprintf(v, 32, "VAR_%d=%d", i, i);
        big[i] = v;
    }
    big[MANY + 1] = "KVH_LRU_K=4";
    big[MANY + 2] = NULL;
    c = busy_config();
    assert_ok(kvh_config_from_env(&c, sizeof(c), big));
    assert_int_equal(c.lru_k, 4);
    kvh_config want = busy_config();
    want.lru_k = 4;
    assert_memory_equal(&c, &want, sizeof(c));
}

/* ---- struct sizes ---- */

static void test_struct_sizes(void **state)
{
    (void)state;
    static const char *const env[] = {"KVH_NUM_LAYERS=5", "KVH_PREFAULT_MEMORY=1", NULL};
    union {
        kvh_config c;
        uint8_t raw[sizeof(kvh_config) + 16];
    } u;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_config_from_env(NULL, sizeof(u.c), env));
    assert_true(kvh_last_error()[0] != '\0');
    const size_t bad[] = {0, 1, 4, 7, 12, sizeof(u.c) - 4, sizeof(u.c) + 8, sizeof(u.c) + 1, SIZE_MAX};
    for (size_t i = 0; i < ARRAY_LEN(bad); i++) {
        memset(&u, 0x5a, sizeof(u));
        u.c.struct_size = sizeof(u.c);
        assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_config_from_env(&u.c, bad[i], env));
        assert_true(kvh_last_error()[0] != '\0');
        for (size_t j = 4; j < sizeof(u); j++)
            if (u.raw[j] != 0x5a)
                fail_msg("size %zu: byte %zu written", bad[i], j);
    }
    /* An older caller: variables of fields past its size are ignored, even
     * malformed ones, and nothing past its size is written. */
    static const char *const late_garbage[] = {"KVH_NUM_LAYERS=5", "KVH_PREFAULT_MEMORY=garbage", "KVH_REMOTE_TTL_S=-1",
                                               "KVH_LCTRU_WINDOW=1K", NULL};
    size_t n = offsetof(kvh_config, lru_k) / 8 * 8;
    memset(&u, 0x5a, sizeof(u));
    assert_ok(kvh_config_init(&u.c, n));
    assert_ok(kvh_config_from_env(&u.c, n, late_garbage));
    assert_int_equal(u.c.num_layers, 5);
    assert_int_equal(u.c.struct_size, n);
    for (size_t j = n; j < sizeof(u); j++)
        if (u.raw[j] != 0x5a)
            fail_msg("size %zu: byte %zu past it written", n, j);
    /* The size argument rules, not the struct_size field: a field that
     * says the full size does not let the call write past the argument. */
    memset(&u, 0x5a, sizeof(u));
    assert_ok(kvh_config_init(&u.c, n));
    u.c.struct_size = sizeof(u.c);
    assert_ok(kvh_config_from_env(&u.c, n, late_garbage));
    assert_int_equal(u.c.struct_size, sizeof(u.c)); /* left as it is */
    for (size_t j = n; j < sizeof(u); j++)
        if (u.raw[j] != 0x5a)
            fail_msg("size %zu with a full struct_size: byte %zu written", n, j);
    /* The smallest size: no field but struct_size, every variable ignored. */
    memset(&u, 0x5a, sizeof(u));
    assert_ok(kvh_config_init(&u.c, 8));
    static const char *const all_bad[] = {"KVH_NUM_LAYERS=x", "KVH_HEAD_DIM=-1", NULL};
    kvh_status st = kvh_config_from_env(&u.c, 8, all_bad);
    /* num_layers lies inside the first 8 bytes. */
    assert_true(offsetof(kvh_config, num_layers) < 8);
    assert_kvh(KVH_ERR_INVALID_ARG, st);
    for (size_t j = 8; j < sizeof(u); j++)
        assert_int_equal(u.raw[j], 0x5a);
}

/* ---- ranges within the type are left to kvh_engine_open ---- */

static kvh_config small_valid(void)
{
    kvh_config c = tu_cfg(1, 1, 16, 4, KVH_DTYPE_F32, 4, 4, 0);
    return c;
}

static void test_open_refuses_what_parsing_let_through(void **state)
{
    (void)state;
    static const char *const vars[] = {
        "KVH_LRU_K=0",    "KVH_LRU_K=5",      "KVH_BLOCK_TOKENS=3", "KVH_BLOCK_TOKENS=512", "KVH_BLOCK_TOKENS=0",
        "KVH_HEAD_DIM=0", "KVH_NUM_LAYERS=0", "KVH_DISK_BYTES=1M",  "KVH_NUM_KV_HEADS=0",
    };
    for (size_t i = 0; i < ARRAY_LEN(vars); i++) {
        const char *env[] = {vars[i], NULL};
        kvh_config c = small_valid();
        assert_ok(kvh_config_from_env(&c, sizeof(c), env));
        kvh_engine *e = NULL;
        kvh_status st = kvh_engine_open(&c, &e);
        if (st != KVH_ERR_INVALID_ARG) {
            if (st == KVH_OK)
                kvh_engine_close(e);
            fail_msg("%s: kvh_engine_open gave %s, expected KVH_ERR_INVALID_ARG", vars[i], kvh_status_name(st));
        }
        assert_null(e);
        assert_true(kvh_last_error()[0] != '\0');
    }
    /* Numbers that no name of an enumerated field stands for are refused
     * while the variable can still be named; kvh_engine_open refuses the
     * same values set in the struct. */
    static const char *const numbers[] = {"KVH_DTYPE=99", "KVH_BACKEND=9", "KVH_EVICTION_POLICY=7", "KVH_KV_CODEC=42",
                                          "KVH_LOG_LEVEL=4"};
    for (size_t i = 0; i < ARRAY_LEN(numbers); i++)
        check_refused(numbers[i]);
    for (int field = 0; field < 4; field++) {
        kvh_config c = small_valid();
        if (field == 0)
            c.dtype = 99;
        else if (field == 1)
            c.backend = 9;
        else if (field == 2)
            c.eviction_policy = 7;
        else
            c.kv_codec = 42;
        kvh_engine *e = NULL;
        assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(&c, &e));
        assert_null(e);
    }
    /* A disk path far longer than any the system takes: an I/O error at
     * open, not a crash. */
    const char *env[] = {repeat("KVH_DISK_PATH=/tmp/", 'd', 8192, ""), "KVH_DISK_BYTES=64M", NULL};
    kvh_config c = small_valid();
    assert_ok(kvh_config_from_env(&c, sizeof(c), env));
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&c, &e);
    if (st == KVH_OK)
        kvh_engine_close(e);
    assert_kvh(KVH_ERR_IO, st);
}

/* ---- the process environment (envp NULL) ---- */

typedef struct saved_var {
    const char *name;
    char *value; /* NULL: was unset */
} saved_var;

static void save_vars(saved_var *s, const char *const *names, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        s[i].name = names[i];
        const char *v = getenv(names[i]);
        s[i].value = v ? strdup(v) : NULL;
    }
}

static void restore_vars(saved_var *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (s[i].value)
            setenv(s[i].name, s[i].value, 1);
        else
            unsetenv(s[i].name);
        free(s[i].value);
        s[i].value = NULL;
    }
}

static void test_process_environment_hostile(void **state)
{
    (void)state;
    static const char *const names[] = {"KVH_HEAD_DIM", "KVH_HOST_BYTES", "KVH_DTYPE", "KVH_LRU_K", "KVH_NUMA_NODE"};
    saved_var saved[ARRAY_LEN(names)];
    save_vars(saved, names, ARRAY_LEN(names));
    for (size_t i = 0; i < ARRAY_LEN(names); i++)
        unsetenv(names[i]);

    kvh_config c = busy_config(), before = c;
    setenv("KVH_HOST_BYTES", "", 1); /* empty: ignored */
    setenv("KVH_HEAD_DIM", "128", 1);
    setenv("KVH_NUMA_NODE", "4294967295", 1);
    kvh_status st = kvh_config_from_env(&c, sizeof(c), NULL);
    const int numa_refused = st == KVH_ERR_INVALID_ARG && strstr(kvh_last_error(), "KVH_NUMA_NODE") != NULL;
    const int unchanged = memcmp(&c, &before, sizeof(c)) == 0;
    setenv("KVH_NUMA_NODE", "-1", 1);
    setenv("KVH_DTYPE", "bf16", 1);
    c = busy_config();
    kvh_status st2 = kvh_config_from_env(&c, sizeof(c), NULL);
    kvh_config got = c;
    restore_vars(saved, ARRAY_LEN(names));

    assert_true(numa_refused);
    assert_true(unchanged);
    assert_ok(st2);
    assert_int_equal(got.head_dim, 128);
    assert_int_equal(got.numa_node, -1);
    assert_int_equal(got.dtype, KVH_DTYPE_BF16);
    assert_int_equal(got.host_bytes, before.host_bytes);
}

/* ---- kvh_strerror, kvh_status_name, kvh_version_string, kvh_last_error ---- */

typedef struct status_entry {
    kvh_status code;
    const char *name, *text;
} status_entry;

#define STATUS_ENTRY_(name, value, text) {value, #name, text},
static const status_entry STATUSES[] = {KVH_STATUS_LIST(STATUS_ENTRY_)};
#undef STATUS_ENTRY_

static void test_status_texts(void **state)
{
    (void)state;
    for (size_t i = 0; i < ARRAY_LEN(STATUSES); i++) {
        const char *name = kvh_status_name(STATUSES[i].code), *text = kvh_strerror(STATUSES[i].code);
        assert_non_null(name);
        assert_non_null(text);
        assert_string_equal(name, STATUSES[i].name);
        assert_string_equal(text, STATUSES[i].text);
        /* Static: the same text again, and unchanged by other calls. */
        assert_ptr_equal(kvh_status_name(STATUSES[i].code), name);
        assert_ptr_equal(kvh_strerror(STATUSES[i].code), text);
    }
    const kvh_status unknown[] = {1,      2,      15, -16, -17, -100, -1000000, INT32_MIN, INT32_MAX, INT32_MIN + 1,
                                  0x7fff, -32768, 100};
    for (size_t i = 0; i < ARRAY_LEN(unknown); i++) {
        const char *name = kvh_status_name(unknown[i]), *text = kvh_strerror(unknown[i]);
        assert_non_null(name);
        assert_non_null(text);
        assert_string_equal(name, "KVH_ERR_UNKNOWN");
        assert_true(text[0] != '\0');
        for (size_t j = 0; j < ARRAY_LEN(STATUSES); j++)
            if (strcmp(text, STATUSES[j].text) == 0)
                fail_msg("unknown status %d described as %s (\"%s\")", unknown[i], STATUSES[j].name, text);
    }
}

static void test_version(void **state)
{
    (void)state;
    const char *v = kvh_version_string();
    assert_non_null(v);
    char want[32];
    snprintf(want, sizeof(want), "%d.%d.%d", KVH_VERSION_MAJOR, KVH_VERSION_MINOR, KVH_VERSION_PATCH);
    assert_string_equal(v, want);
    assert_ptr_equal(kvh_version_string(), v);
    assert_int_equal(kvh_version(), KVH_VERSION_NUMBER);
    assert_int_equal(KVH_VERSION_NUMBER, KVH_VERSION_MAJOR * 10000 + KVH_VERSION_MINOR * 100 + KVH_VERSION_PATCH);
    unsigned maj, min, pat;
    char tail;
    assert_int_equal(sscanf(v, "%u.%u.%u%c", &maj, &min, &pat, &tail), 3);
    assert_int_equal(maj * 10000 + min * 100 + pat, kvh_version());
}

typedef struct thread_probe {
    const char *fresh_error; /* kvh_last_error() before any call */
    char fresh_copy[64];
    const char *name, *text, *version;
    char own_error[256];
} thread_probe;

static void *probe_thread(void *arg)
{
    thread_probe *p = arg;
    p->fresh_error = kvh_last_error();
    if (p->fresh_error)
        snprintf(p->fresh_copy, sizeof(p->fresh_copy), "%s", p->fresh_error);
    p->name = kvh_status_name(KVH_ERR_CORRUPT);
    p->text = kvh_strerror(KVH_ERR_CORRUPT);
    p->version = kvh_version_string();
    kvh_config c;
    if (kvh_config_init(&c, 3) == KVH_ERR_STRUCT_SIZE)
        snprintf(p->own_error, sizeof(p->own_error), "%s", kvh_last_error());
    return NULL;
}

/* kvh_last_error is per thread: "" on a thread that never failed, and a
 * failure on one thread does not change another's. The static texts are
 * the same on every thread. */
static void test_last_error_is_per_thread(void **state)
{
    (void)state;
    static const char *const bad[] = {"KVH_HEAD_DIM=garbage", NULL};
    kvh_config c = defaults();
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_config_from_env(&c, sizeof(c), bad));
    char mine[512];
    snprintf(mine, sizeof(mine), "%s", kvh_last_error());
    assert_true(mine[0] != '\0');
    assert_non_null(strstr(mine, "KVH_HEAD_DIM"));
    thread_probe p;
    memset(&p, 0, sizeof(p));
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, probe_thread, &p), 0);
    assert_int_equal(pthread_join(t, NULL), 0);
    assert_non_null(p.fresh_error);
    assert_string_equal(p.fresh_copy, "");
    assert_true(p.own_error[0] != '\0');
    assert_null(strstr(p.own_error, "KVH_HEAD_DIM"));
    assert_string_equal(kvh_last_error(), mine);
    assert_ptr_equal(p.name, kvh_status_name(KVH_ERR_CORRUPT));
    assert_ptr_equal(p.text, kvh_strerror(KVH_ERR_CORRUPT));
    assert_ptr_equal(p.version, kvh_version_string());
}

static int teardown(void **state) { return tu_teardown(state); }

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_empty_and_foreign_entries_change_nothing, teardown),
        cmocka_unit_test_teardown(test_negative_values, teardown),
        cmocka_unit_test_teardown(test_overflowing_values, teardown),
        cmocka_unit_test_teardown(test_units_where_none_belong_and_malformed_sizes, teardown),
        cmocka_unit_test_teardown(test_leading_zero_is_decimal_not_octal, teardown),
        cmocka_unit_test_teardown(test_garbage_names_and_booleans, teardown),
        cmocka_unit_test_teardown(test_very_long_values, teardown),
        cmocka_unit_test_teardown(test_struct_sizes, teardown),
        cmocka_unit_test_teardown(test_open_refuses_what_parsing_let_through, teardown),
        cmocka_unit_test_teardown(test_process_environment_hostile, teardown),
        cmocka_unit_test_teardown(test_status_texts, teardown),
        cmocka_unit_test_teardown(test_version, teardown),
        cmocka_unit_test_teardown(test_last_error_is_per_thread, teardown),
    };
    return cmocka_run_group_tests_name("config_env_hostile", tests, NULL, NULL);
}
