/* Fuzz target: kvh_config_from_env on an environment from the input.
 *
 * Input: one struct_size selector byte, then "NAME=value" strings
 * separated by NUL bytes (at most 32), each NAME taken as is or, when it
 * starts with a byte below 0x20, replaced by the KVH_ variable of that
 * index (so short inputs reach every field).
 *
 * Properties, beyond memory safety and documented status codes:
 *   - KVH_OK or KVH_ERR_INVALID_ARG (KVH_ERR_STRUCT_SIZE only for a size
 *     the struct_size rule refuses);
 *   - on failure the config is unchanged and kvh_last_error names a
 *     KVH_ variable; on success nothing past struct_size is written and
 *     struct_size itself is unchanged;
 *   - applying the same environment twice gives the same config. */
#include "fuzz_common.h"

static const char *const vars[] = {
    "KVH_NUM_LAYERS",
    "KVH_NUM_KV_HEADS",
    "KVH_HEAD_DIM",
    "KVH_BLOCK_TOKENS",
    "KVH_DTYPE",
    "KVH_BACKEND",
    "KVH_CUDA_DEVICE",
    "KVH_DEVICE_BYTES",
    "KVH_HOST_BYTES",
    "KVH_DISK_BYTES",
    "KVH_DISK_PATH",
    "KVH_MODEL_SALT",
    "KVH_NUMA_NODE",
    "KVH_MIGRATION_THREADS",
    "KVH_MIGRATION_CPU_MASK",
    "KVH_LRU_K",
    "KVH_PROMOTE_MIN_HITS",
    "KVH_LOG_LEVEL",
    "KVH_DISK_QUEUE_DEPTH",
    "KVH_DISK_FLAGS",
    "KVH_KV_CODEC",
    "KVH_VMAP",
    "KVH_EVICTION_POLICY",
    "KVH_LCTRU_WINDOW",
    "KVH_COPY_MOVES",
    "KVH_PREFAULT_MEMORY",
    "KVH_DISK_STRICT_INDEX",
    "KVH_REMOTE_ADDRS",
    "KVH_REMOTE_USER",
    "KVH_REMOTE_PASSWORD",
    "KVH_REMOTE_TLS_CA",
    "KVH_REMOTE_TLS",
    "KVH_REMOTE_TIMEOUT_MS",
    "KVH_REMOTE_TTL_S",
    "KVH_REMOTE_UPLOAD",
    "KVH_REMOTE_BREAKER_MS",
};
#define NVARS (sizeof(vars) / sizeof(vars[0]))
#define MAX_VARS 32

/* The libFuzzer entry point (no header declares it). */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0)
        return 0;
    uint8_t sel = data[0];
    size_t full = sizeof(kvh_config);
    size_t struct_size = sel < 0xF0 ? full : (size_t)(sel - 0xF0) * 8 + (sel & 1);
    /* The strings, NUL-terminated copies (the input is not). */
    char *buf = malloc(size * 2 + 64 * MAX_VARS);
    if (!buf)
        return 0;
    const char *envp[MAX_VARS + 1];
    size_t n = 0, at = 1, used = 0;
    while (at < size && n < MAX_VARS) {
        size_t len = strnlen((const char *)data + at, size - at);
        const char *s = (const char *)data + at;
        char *out = buf + used;
        if (len > 0 && (uint8_t)s[0] < 0x20) {
            int w = snprintf(out, 64, "%s=", vars[(uint8_t)s[0] % NVARS]);
            memcpy(out + w, s + 1, len - 1);
            out[w + len - 1] = 0;
            used += (size_t)w + len;
        } else {
            memcpy(out, s, len);
            out[len] = 0;
            used += len + 1;
        }
        envp[n++] = out;
        at += len + 1;
    }
    envp[n] = NULL;

    union {
        kvh_config c;
        uint8_t raw[sizeof(kvh_config) + 16];
    } u, before, again;
    memset(&u, 0xAB, sizeof(u));
    kvh_config_init(&u.c, sizeof(u.c));
    u.c.struct_size = (uint32_t)struct_size;
    before = u;
    kvh_status st = kvh_config_from_env(&u.c, struct_size, envp);
    FZ_KNOWN(st);
    bool size_ok = struct_size == full || (struct_size >= 8 && struct_size <= full && struct_size % 8 == 0);
    if (!size_ok) {
        FZ_CHECK(st == KVH_ERR_STRUCT_SIZE, "struct_size %zu gave %s", struct_size, kvh_status_name(st));
    } else {
        FZ_CHECK(st == KVH_OK || st == KVH_ERR_INVALID_ARG, "from_env returned %s", kvh_status_name(st));
    }
    if (st != KVH_OK) {
        FZ_CHECK(memcmp(&u, &before, sizeof(u)) == 0, "a failed call changed the config");
        if (st == KVH_ERR_INVALID_ARG)
            FZ_CHECK(strstr(kvh_last_error(), "KVH_") != NULL, "message names no variable: %s", kvh_last_error());
    } else {
        FZ_CHECK(u.c.struct_size == struct_size, "struct_size changed");
        for (size_t i = struct_size; i < sizeof(u); i++)
            FZ_CHECK(u.raw[i] == before.raw[i], "byte %zu past struct_size %zu written", i, struct_size);
        again = u;
        FZ_CHECK(kvh_config_from_env(&again.c, struct_size, envp) == KVH_OK, "second application failed");
        FZ_CHECK(memcmp(&again, &u, sizeof(u)) == 0, "a second application changed the config");
    }
    free(buf);
    return 0;
}
