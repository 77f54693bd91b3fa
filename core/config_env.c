/* kvh_config_from_env: every settable field of kvh_config from a KVH_*
 * variable, each parsed by the kind of its field. */
#include <ctype.h>
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "core/config_names.h"
#include "core/engine.h"

enum kind { K_U32, K_I32, K_U64, K_SIZE, K_ENUM, K_BOOL, K_FLAGS, K_PATH };

typedef struct named {
    const char *name;
    uint32_t value;
} named;

static const named dtypes[] = {{"f32", KVH_DTYPE_F32}, {"f16", KVH_DTYPE_F16}, {"bf16", KVH_DTYPE_BF16}, {NULL, 0}};
static const named backends[] = {
    {"auto", KVH_BACKEND_AUTO}, {"cpu", KVH_BACKEND_CPU}, {"cuda", KVH_BACKEND_CUDA}, {NULL, 0}};
static const named levels[] = {{"error", KVH_LOG_ERROR}, {"warn", KVH_LOG_WARN},   {"warning", KVH_LOG_WARN},
                               {"info", KVH_LOG_INFO},   {"debug", KVH_LOG_DEBUG}, {NULL, 0}};
static const named codecs[] = {{"none", KVH_CODEC_NONE},
                               {"int8", KVH_CODEC_INT8},
                               {"q4_g32", KVH_CODEC_Q4_G32},
                               {"q4_g64", KVH_CODEC_Q4_G64},
                               {NULL, 0}};
static const named evictions[] = {{"lru_k", KVH_EVICT_LRU_K},
                                  {"lruk", KVH_EVICT_LRU_K},
                                  {"lctru", KVH_EVICT_LCTRU},
                                  {"adaptive", KVH_EVICT_ADAPTIVE},
                                  {NULL, 0}};
static const named disk_flags[] = {{"reset_on_mismatch", KVH_DISK_RESET_ON_MISMATCH},
                                   {"buffered", KVH_DISK_BUFFERED},
                                   {"share_group", KVH_DISK_SHARE_GROUP},
                                   {NULL, 0}};
static const named remote_uploads[] = {{"persist", KVH_REMOTE_UPLOAD_PERSIST},
                                       {"demote", KVH_REMOTE_UPLOAD_DEMOTE},
                                       {"write_through", KVH_REMOTE_UPLOAD_WRITE_THROUGH},
                                       {NULL, 0}};

static const char *name_of(const named *names, uint32_t value)
{
    for (const named *n = names; n->name; n++)
        if (n->value == value)
            return n->name;
    return NULL;
}

const char *kvhi_dtype_name(uint32_t dtype) { return name_of(dtypes, dtype); }

const char *kvhi_codec_name(uint32_t codec) { return name_of(codecs, codec); }

typedef struct field {
    const char *name; /* of the kvh_config field */
    const char *var;
    size_t offset;
    size_t size;
    enum kind kind;
    const named *names; /* K_ENUM, K_FLAGS */
    int32_t lowest;     /* K_I32: the least value the field takes */
} field;

#define F(name, var, kind, names) F_FROM(name, var, kind, names, INT32_MIN)
#define F_FROM(name, var, kind, names, lowest)                                                                         \
    {                                                                                                                  \
#name, var, offsetof(kvh_config, name), sizeof(((kvh_config *)0)->name), kind, names, lowest                   \
    }

static const field fields[] = {
    F(num_layers, "KVH_NUM_LAYERS", K_U32, NULL),
    F(num_kv_heads, "KVH_NUM_KV_HEADS", K_U32, NULL),
    F(head_dim, "KVH_HEAD_DIM", K_U32, NULL),
    F(block_tokens, "KVH_BLOCK_TOKENS", K_U32, NULL),
    F(dtype, "KVH_DTYPE", K_ENUM, dtypes),
    F(backend, "KVH_BACKEND", K_ENUM, backends),
    F_FROM(cuda_device, "KVH_CUDA_DEVICE", K_I32, NULL, 0),
    F(device_bytes, "KVH_DEVICE_BYTES", K_SIZE, NULL),
    F(host_bytes, "KVH_HOST_BYTES", K_SIZE, NULL),
    F(disk_bytes, "KVH_DISK_BYTES", K_SIZE, NULL),
    F(disk_path, "KVH_DISK_PATH", K_PATH, NULL),
    F(model_salt, "KVH_MODEL_SALT", K_U64, NULL),
    F_FROM(numa_node, "KVH_NUMA_NODE", K_I32, NULL, -1), /* -1: none */
    F(migration_threads, "KVH_MIGRATION_THREADS", K_U32, NULL),
    F(migration_cpu_mask, "KVH_MIGRATION_CPU_MASK", K_U64, NULL),
    F(lru_k, "KVH_LRU_K", K_U32, NULL),
    F(promote_min_hits, "KVH_PROMOTE_MIN_HITS", K_U32, NULL),
    F(log_level, "KVH_LOG_LEVEL", K_ENUM, levels),
    F(disk_queue_depth, "KVH_DISK_QUEUE_DEPTH", K_U32, NULL),
    F(disk_flags, "KVH_DISK_FLAGS", K_FLAGS, disk_flags),
    F(kv_codec, "KVH_KV_CODEC", K_ENUM, codecs),
    F(vmap, "KVH_VMAP", K_BOOL, NULL),
    F(eviction_policy, "KVH_EVICTION_POLICY", K_ENUM, evictions),
    F(lctru_window, "KVH_LCTRU_WINDOW", K_U32, NULL),
    F(copy_moves, "KVH_COPY_MOVES", K_BOOL, NULL),
    F(prefault_memory, "KVH_PREFAULT_MEMORY", K_BOOL, NULL),
    F(disk_strict_index, "KVH_DISK_STRICT_INDEX", K_BOOL, NULL),
    F(remote_addrs, "KVH_REMOTE_ADDRS", K_PATH, NULL),
    F(remote_user, "KVH_REMOTE_USER", K_PATH, NULL),
    F(remote_password, "KVH_REMOTE_PASSWORD", K_PATH, NULL),
    F(remote_tls_ca, "KVH_REMOTE_TLS_CA", K_PATH, NULL),
    F(remote_tls, "KVH_REMOTE_TLS", K_BOOL, NULL),
    F(remote_timeout_ms, "KVH_REMOTE_TIMEOUT_MS", K_U32, NULL),
    F(remote_ttl_s, "KVH_REMOTE_TTL_S", K_U32, NULL),
    F(remote_upload, "KVH_REMOTE_UPLOAD", K_FLAGS, remote_uploads),
    F(remote_breaker_ms, "KVH_REMOTE_BREAKER_MS", K_U32, NULL),
};

const char *kvhi_config_env_var(const char *name)
{
    for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); i++)
        if (!strcmp(fields[i].name, name))
            return fields[i].var;
    return NULL;
}

static const char *lookup(const char *const *envp, const char *var)
{
    if (!envp)
        return getenv(var);
    size_t n = strlen(var);
    for (; *envp; envp++)
        if (strncmp(*envp, var, n) == 0 && (*envp)[n] == '=')
            return *envp + n + 1;
    return NULL;
}

/* An unsigned number of the whole text (base 10, or 0 for decimal or hex
 * after 0x; a leading zero is never octal): *end is where it stopped. */
static int parse_u64(const char *s, int base, uint64_t *out, const char **end)
{
    if (!isdigit((unsigned char)s[0]))
        return 0;
    if (base == 0)
        base = s[0] == '0' && (s[1] == 'x' || s[1] == 'X') ? 16 : 10;
    errno = 0;
    char *e;
    unsigned long long v = strtoull(s, &e, base);
    if (errno == ERANGE)
        return 0;
    *out = v;
    *end = e;
    return 1;
}

static int parse_size(const char *s, uint64_t *out)
{
    uint64_t v;
    const char *e;
    if (!parse_u64(s, 10, &v, &e))
        return 0;
    static const char units[] = "kmgtp";
    unsigned shift = 0;
    if (*e) {
        const char *u = strchr(units, tolower((unsigned char)*e));
        if (u) {
            shift = 10u * (unsigned)(u - units + 1);
            e++;
            if (*e == 'i' || *e == 'I')
                e++;
        }
        if (*e == 'b' || *e == 'B')
            e++;
    }
    if (*e)
        return 0;
    if (shift && v > (UINT64_MAX >> shift))
        return 0;
    *out = v << shift;
    return 1;
}

static int parse_name(const named *names, const char *s, size_t n, uint32_t *out)
{
    for (; names->name; names++)
        if (strlen(names->name) == n && strncasecmp(names->name, s, n) == 0) {
            *out = names->value;
            return 1;
        }
    return 0;
}

static int parse_bool(const char *s, uint64_t *out)
{
    static const named bools[] = {{"1", 1},  {"0", 0},  {"true", 1}, {"false", 0}, {"yes", 1},
                                  {"no", 0}, {"on", 1}, {"off", 0},  {NULL, 0}};
    uint32_t v;
    if (!parse_name(bools, s, strlen(s), &v))
        return 0;
    *out = v;
    return 1;
}

static int parse_flags(const named *names, const char *s, uint64_t *out)
{
    const char *e;
    if (isdigit((unsigned char)s[0])) {
        uint64_t known = 0; /* a bit no name stands for is refused, as the engine would */
        for (const named *n = names; n->name; n++)
            known |= n->value;
        return parse_u64(s, 0, out, &e) && !*e && (*out & ~known) == 0;
    }
    uint64_t v = 0;
    if (strcasecmp(s, "none") != 0)
        for (const char *p = s;;) {
            size_t n = strcspn(p, ",");
            uint32_t bit;
            if (!parse_name(names, p, n, &bit))
                return 0;
            v |= bit;
            if (!p[n])
                break;
            p += n + 1;
        }
    *out = v;
    return 1;
}

static const char *expected(const field *f)
{
    switch (f->kind) {
    case K_U32:
        return "a decimal count from 0 to 4294967295";
    case K_U64:
        return "an unsigned 64-bit number, decimal or 0x hex";
    case K_SIZE:
        return "a size in bytes, e.g. 4096, 512M or 4G";
    case K_BOOL:
        return "1/0, true/false, yes/no or on/off";
    case K_I32:   /* set_field names the field's own least value */
    case K_FLAGS: /* set_field lists the field's own names */
    case K_ENUM:
    case K_PATH:
        break;
    }
    return "one of its names or numbers";
}

/* The names a field takes, comma-separated, into list[len]. */
static void names_of(const field *f, char *list, size_t len)
{
    size_t used = 0;
    list[0] = 0;
    for (const named *nm = f->names; nm->name && used < len; nm++) {
        int w = snprintf(list + used, len - used, "%s%s", used ? ", " : "", nm->name);
        used += w > 0 ? (size_t)w : 0;
    }
}

static kvh_status set_field(kvh_config *c, const field *f, const char *s)
{
    uint8_t *p = (uint8_t *)c + f->offset;
    uint64_t v = 0;
    const char *e;
    int ok = 0;
    switch (f->kind) {
    case K_U32:
        ok = parse_u64(s, 10, &v, &e) && !*e && v <= UINT32_MAX;
        break;
    case K_I32: {
        const char *d = s[0] == '-' ? s + 1 : s;
        ok = parse_u64(d, 10, &v, &e) && !*e && v <= (d == s ? (uint64_t)INT32_MAX : (uint64_t)INT32_MAX + 1);
        /* Out of range either way names the field's own least value. */
        if (!ok || (d != s && -(int64_t)v < f->lowest))
            return kvhi_fail(KVH_ERR_INVALID_ARG, "%s=\"%s\": expected a decimal integer from %d to 2147483647", f->var,
                             s, (int)f->lowest);
        if (ok) {
            int32_t i = d == s ? (int32_t)v : (int32_t)(-(int64_t)v);
            memcpy(p, &i, sizeof(i));
            return KVH_OK;
        }
        break;
    }
    case K_U64:
        ok = parse_u64(s, 0, &v, &e) && !*e;
        break;
    case K_SIZE:
        ok = parse_size(s, &v);
        break;
    case K_BOOL:
        ok = parse_bool(s, &v);
        break;
    case K_FLAGS:
        ok = parse_flags(f->names, s, &v);
        if (!ok) {
            char list[128];
            names_of(f, list, sizeof(list));
            return kvhi_fail(KVH_ERR_INVALID_ARG,
                             "%s=\"%s\": expected a number of named bits only, or names joined by commas: %s", f->var,
                             s, list);
        }
        break;
    case K_ENUM: {
        uint32_t n;
        if (isdigit((unsigned char)s[0])) {
            /* Only the numbers of its names: any other would pass here
             * and be refused by kvh_engine_open, which cannot name the
             * variable. */
            ok = parse_u64(s, 10, &v, &e) && !*e && v <= UINT32_MAX && name_of(f->names, (uint32_t)v);
        } else if (parse_name(f->names, s, strlen(s), &n)) {
            v = n;
            ok = 1;
        }
        if (!ok) {
            char list[128];
            names_of(f, list, sizeof(list));
            return kvhi_fail(KVH_ERR_INVALID_ARG, "%s=\"%s\": expected one of %s (or its number)", f->var, s, list);
        }
        break;
    }
    case K_PATH: {
        const char *path = s;
        memcpy(p, &path, sizeof(path));
        return KVH_OK;
    }
    }
    if (!ok)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "%s=\"%s\": expected %s", f->var, s, expected(f));
    if (f->size == sizeof(uint32_t)) {
        uint32_t u = (uint32_t)v;
        memcpy(p, &u, sizeof(u));
    } else {
        memcpy(p, &v, sizeof(v));
    }
    return KVH_OK;
}

kvh_status kvhi_config_from_env(kvh_config *c, size_t size, const char *const *envp)
{
    for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); i++) {
        const field *f = &fields[i];
        if (f->offset + f->size > size)
            continue;
        const char *s = lookup(envp, f->var);
        if (!s || !*s)
            continue;
        kvh_status st = set_field(c, f, s);
        if (st != KVH_OK)
            return st;
    }
    return KVH_OK;
}
