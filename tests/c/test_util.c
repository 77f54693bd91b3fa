/* The functions of test_util.h (see there for what each does), compiled
 * once into the test library (tests/c/CMakeLists.txt). The tracked
 * engines and buffers are this file's: one set per test program. */
#include "test_util.h"

#include <fcntl.h>
#include <math.h>
#include <unistd.h>

/* ---- status assertions ---- */

void tu_check_at(const char *file, int line, kvh_status expected, kvh_status got, const char *what)
{
    if (got == expected)
        return;
    print_error("%s:%d: %s\n    returned %s (%d), expected %s (%d); last error: \"%s\"\n", file, line, what,
                kvh_status_name(got), (int)got, kvh_status_name(expected), (int)expected, kvh_last_error());
    _fail(file, line);
}

/* ---- random numbers ---- */

void tu_fill(tu_rng *r, void *buf, size_t n)
{
    uint8_t *p = buf;
    while (n >= 8) {
        uint64_t v = tu_next(r);
        memcpy(p, &v, 8);
        p += 8;
        n -= 8;
    }
    if (n) {
        uint64_t v = tu_next(r);
        memcpy(p, &v, n);
    }
}

uint64_t tu_seed(uint64_t def)
{
    const char *s = getenv("KVH_TEST_SEED");
    if (s && *s)
        return strtoull(s, NULL, 0);
    return def;
}

double tu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- resources released by the teardown ---- */

static kvh_engine *tu_engines[TU_MAX_TRACKED];
static void *tu_buffers[TU_MAX_TRACKED * 4];

kvh_engine *tu_track_engine(kvh_engine *e)
{
    for (int i = 0; i < TU_MAX_TRACKED; i++)
        if (!tu_engines[i]) {
            tu_engines[i] = e;
            return e;
        }
    return e;
}

kvh_status tu_close(kvh_engine *e)
{
    for (int i = 0; i < TU_MAX_TRACKED; i++)
        if (tu_engines[i] == e)
            tu_engines[i] = NULL;
    return kvh_engine_close(e);
}

void *tu_alloc_at(const char *file, int line, size_t n)
{
    void *p = calloc(1, n ? n : 1);
    if (!p) {
        print_error("%s:%d: tu_alloc(%zu): out of memory\n", file, line, n);
        _fail(file, line);
    }
    for (int i = 0; i < TU_MAX_TRACKED * 4; i++)
        if (!tu_buffers[i]) {
            tu_buffers[i] = p;
            return p;
        }
    print_error("%s:%d: tu_alloc: too many buffers\n", file, line);
    _fail(file, line);
    return p;
}

void tu_free(void *p)
{
    for (int i = 0; i < TU_MAX_TRACKED * 4; i++)
        if (tu_buffers[i] == p)
            tu_buffers[i] = NULL;
    free(p);
}

int tu_teardown(void **state)
{
    (void)state;
    for (int i = 0; i < TU_MAX_TRACKED; i++)
        if (tu_engines[i]) {
            kvh_engine_close(tu_engines[i]);
            tu_engines[i] = NULL;
        }
    for (int i = 0; i < TU_MAX_TRACKED * 4; i++)
        if (tu_buffers[i]) {
            free(tu_buffers[i]);
            tu_buffers[i] = NULL;
        }
    return 0;
}

/* ---- engines ---- */

kvh_config tu_cfg_at(const char *file, int line, uint32_t layers, uint32_t heads, uint32_t dim, uint32_t bt,
                     uint32_t dtype, uint64_t device_blocks, uint64_t host_blocks, uint32_t threads)
{
    kvh_config c;
    tu_check_at(file, line, KVH_OK, kvh_config_init(&c, sizeof(c)), "kvh_config_init");
    c.num_layers = layers;
    c.num_kv_heads = heads;
    c.head_dim = dim;
    c.block_tokens = bt;
    c.dtype = dtype;
    const char *backend = getenv("KVH_TEST_BACKEND");
    c.backend = backend && !strcmp(backend, "cuda") ? KVH_BACKEND_CUDA : KVH_BACKEND_CPU;
    uint64_t bb = tu_block_bytes_of(layers, heads, dim, bt, dtype);
    c.device_bytes = device_blocks * bb;
    c.host_bytes = host_blocks * bb;
    c.migration_threads = threads;
    return c;
}

kvh_engine *tu_open_cfg_at(const char *file, int line, const kvh_config *c)
{
    kvh_engine *e = NULL;
    tu_check_at(file, line, KVH_OK, kvh_engine_open(c, &e), "kvh_engine_open");
    if (!e) {
        print_error("%s:%d: kvh_engine_open returned KVH_OK and no engine\n", file, line);
        _fail(file, line);
    }
    return tu_track_engine(e);
}

kvh_engine *tu_open_at(const char *file, int line, uint32_t layers, uint32_t heads, uint32_t dim, uint32_t bt,
                       uint32_t dtype, uint64_t device_blocks, uint64_t host_blocks, uint32_t threads)
{
    kvh_config c = tu_cfg_at(file, line, layers, heads, dim, bt, dtype, device_blocks, host_blocks, threads);
    return tu_open_cfg_at(file, line, &c);
}

uint64_t tu_block_bytes_at(const char *file, int line, kvh_engine *e)
{
    uint64_t b = 0;
    tu_check_at(file, line, KVH_OK, kvh_engine_block_bytes(e, &b), "kvh_engine_block_bytes");
    return b;
}

kvh_stats tu_stats_at(const char *file, int line, kvh_engine *e)
{
    kvh_stats s;
    memset(&s, 0, sizeof(s));
    s.struct_size = sizeof(s);
    tu_check_at(file, line, KVH_OK, kvh_engine_stats(e, &s), "kvh_engine_stats");
    return s;
}

kvh_tier_info tu_tier_at(const char *file, int line, kvh_engine *e, uint32_t tier)
{
    kvh_tier_info t;
    memset(&t, 0, sizeof(t));
    t.struct_size = sizeof(t);
    tu_check_at(file, line, KVH_OK, kvh_tier_info_get(e, tier, &t), "kvh_tier_info_get");
    return t;
}

kvh_block_info tu_binfo_at(const char *file, int line, kvh_engine *e, kvh_block b)
{
    kvh_block_info i;
    memset(&i, 0, sizeof(i));
    i.struct_size = sizeof(i);
    tu_check_at(file, line, KVH_OK, kvh_block_info_get(e, b, &i), "kvh_block_info_get");
    return i;
}

kvh_block tu_seq_block_at(const char *file, int line, kvh_engine *e, kvh_seq s, uint64_t i)
{
    kvh_block b = {0};
    tu_check_at(file, line, KVH_OK, kvh_seq_blocks(e, s, i, 1, &b), "kvh_seq_blocks");
    return b;
}

kvh_block_info tu_seq_binfo_at(const char *file, int line, kvh_engine *e, kvh_seq s, uint64_t i)
{
    return tu_binfo_at(file, line, e, tu_seq_block_at(file, line, e, s, i));
}

uint64_t tu_seq_len_at(const char *file, int line, kvh_engine *e, kvh_seq s)
{
    uint64_t n = ~0ull;
    tu_check_at(file, line, KVH_OK, kvh_seq_length(e, s, &n), "kvh_seq_length");
    return n;
}

void tu_fence_finish_at(const char *file, int line, kvh_engine *e, kvh_fence f)
{
    tu_check_at(file, line, KVH_OK, kvh_fence_wait(e, f, UINT64_MAX), "kvh_fence_wait");
    tu_check_at(file, line, KVH_OK, kvh_fence_free(e, f), "kvh_fence_free");
}

void tu_seq_migrate_wait_at(const char *file, int line, kvh_engine *e, kvh_seq s, uint64_t first, uint64_t n,
                            uint32_t tier)
{
    kvh_fence f = {0};
    tu_check_at(file, line, KVH_OK, kvh_seq_migrate(e, s, first, n, tier, &f), "kvh_seq_migrate");
    tu_fence_finish_at(file, line, e, f);
}

kvh_seq tu_seq_new_at(const char *file, int line, kvh_engine *e, uint32_t agent)
{
    kvh_seq s = {0};
    tu_check_at(file, line, KVH_OK, kvh_seq_create(e, agent, &s), "kvh_seq_create");
    if (s.id == 0) {
        print_error("%s:%d: kvh_seq_create returned KVH_OK and the null handle\n", file, line);
        _fail(file, line);
    }
    return s;
}

void tu_iota(int32_t *t, size_t n, int32_t base)
{
    for (size_t i = 0; i < n; i++)
        t[i] = base + (int32_t)i;
}

void tu_pattern(void *dst, size_t bytes, uint64_t tag, uint32_t layer, uint64_t pos, int kv)
{
    tu_rng r = {tag * 0x100000001b3ull ^ ((uint64_t)layer << 48) ^ (pos << 8) ^ (uint64_t)kv};
    tu_fill(&r, dst, bytes);
}

void tu_write_pattern_at(const char *file, int line, kvh_engine *e, kvh_seq s, uint32_t layers, size_t tok_bytes,
                         uint64_t tag, uint64_t pos, size_t n)
{
    uint8_t *k = malloc(tok_bytes * (n ? n : 1)), *v = malloc(tok_bytes * (n ? n : 1));
    if (!k || !v) {
        free(k);
        free(v);
        print_error("%s:%d: tu_write_pattern: out of memory\n", file, line);
        _fail(file, line);
    }
    for (uint32_t l = 0; l < layers; l++) {
        for (size_t t = 0; t < n; t++) {
            tu_pattern(k + t * tok_bytes, tok_bytes, tag, l, pos + t, 0);
            tu_pattern(v + t * tok_bytes, tok_bytes, tag, l, pos + t, 1);
        }
        kvh_status st = kvh_seq_write_kv(e, s, l, pos, n, k, v);
        if (st != KVH_OK) {
            free(k);
            free(v);
        }
        tu_check_at(file, line, KVH_OK, st, "kvh_seq_write_kv");
    }
    free(k);
    free(v);
}

int tu_check_pattern(kvh_engine *e, kvh_seq s, uint32_t layers, size_t tok_bytes, uint64_t tag, uint64_t pos, size_t n)
{
    uint8_t *k = malloc(tok_bytes * (n ? n : 1)), *v = malloc(tok_bytes * (n ? n : 1));
    uint8_t *want = malloc(tok_bytes);
    int ok = k && v && want;
    for (uint32_t l = 0; ok && l < layers; l++) {
        kvh_status st = kvh_seq_read_kv(e, s, l, pos, n, k, v);
        if (st != KVH_OK) {
            print_error("read_kv(layer %u, pos %" PRIu64 ", n %zu): %s: %s\n", l, pos, n, kvh_status_name(st),
                        kvh_last_error());
            ok = 0;
            break;
        }
        for (size_t t = 0; ok && t < n; t++)
            for (int kv = 0; kv < 2 && ok; kv++) {
                tu_pattern(want, tok_bytes, tag, l, pos + t, kv);
                if (memcmp((kv ? v : k) + t * tok_bytes, want, tok_bytes) != 0) {
                    print_error("KV mismatch: layer %u token %" PRIu64 " %s (tag %" PRIu64 ")\n", l, pos + t,
                                kv ? "V" : "K", tag);
                    ok = 0;
                }
            }
    }
    free(k);
    free(v);
    free(want);
    return ok;
}

kvh_vmap_view tu_vmap_view_at(const char *file, int line, kvh_engine *e, kvh_vmap *m)
{
    kvh_vmap_view v;
    memset(&v, 0, sizeof(v));
    v.struct_size = sizeof(v);
    tu_check_at(file, line, KVH_OK, kvh_vmap_get(e, m, &v), "kvh_vmap_get");
    return v;
}

/* ---- f16 / bf16, round to nearest even ---- */

uint16_t tu_f32_to_f16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, exp = (x >> 23) & 0xffu, man = x & 0x7fffffu;
    if (exp == 0xff)
        return (uint16_t)(sign | 0x7c00u | (man ? 0x200u : 0));
    int e = (int)exp - 127 + 15;
    if (e >= 31)
        return (uint16_t)(sign | 0x7c00u);
    if (e <= 0) {
        if (e < -10)
            return (uint16_t)sign;
        man |= 0x800000u;
        uint32_t shift = (uint32_t)(14 - e);
        uint32_t h = man >> shift, rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (h & 1)))
            h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((uint32_t)e << 10) | (man >> 13), rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1)))
        h++;
    return (uint16_t)(sign | h);
}

float tu_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, x;
    if (exp == 0) {
        float f = ldexpf((float)man, -24);
        return sign ? -f : f;
    }
    if (exp == 31)
        x = sign | 0x7f800000u | (man << 13);
    else
        x = sign | ((exp - 15 + 127) << 23) | (man << 13);
    float f;
    memcpy(&f, &x, 4);
    return f;
}

uint16_t tu_f32_to_bf16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

float tu_bf16_to_f32(uint16_t b)
{
    uint32_t x = (uint32_t)b << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

long tu_vm_size_kb(void)
{
    char text[4096];
    int fd = open("/proc/self/status", O_RDONLY);
    ssize_t n = fd >= 0 ? read(fd, text, sizeof(text) - 1) : -1;
    if (fd >= 0)
        close(fd);
    assert_true(n > 0);
    text[n] = '\0';
    const char *at = strstr(text, "VmSize:");
    assert_non_null(at);
    return strtol(at + 7, NULL, 10);
}
