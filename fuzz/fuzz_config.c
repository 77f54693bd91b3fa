/* Fuzz target: configuration validation (kvh_config_init, kvh_engine_open,
 * kvh_attention_params_init) with every field from the input.
 *
 * Budgets are kept to at most 4096 blocks a tier (plus a remainder) so that
 * a valid config cannot ask for gigabytes -- the fuzzer's allocation limit
 * would report that as out-of-memory; the question here is validation, not
 * capacity. AUTO and CUDA backends are tried as CPU (no GPU is assumed);
 * values past the enum still reach validation.
 *
 * Properties, beyond memory safety and documented status codes:
 *   - open fails exactly when validation should (independent re-check of
 *     the documented ranges), with KVH_ERR_STRUCT_SIZE for a wrong
 *     struct_size, and *engine is untouched on failure;
 *   - an engine that opens works: block bytes match the geometry, a
 *     sequence round-trips one block of K/V, tier info adds up, log lines
 *     are NUL-terminated, and close succeeds.
 */
#include "fuzz_common.h"

static const char *dir_for_disk;

static void log_fn(void *user, int32_t level, const char *message)
{
    (void)user;
    FZ_CHECK(level >= KVH_LOG_ERROR && level <= KVH_LOG_DEBUG, "log level %d", level);
    FZ_CHECK(message && strnlen(message, 4096) < 4096, "log message not terminated");
}

static uint32_t esize(uint32_t dtype) { return dtype == KVH_DTYPE_F32 ? 4 : 2; }

/* kvh.h's struct_size rule: this library's size, or a multiple of 8 from
 * 8 up to it (a struct of an older header). */
static bool size_accepted(size_t size, size_t full)
{
    return size == full || (size >= 8 && size <= full && size % 8 == 0);
}

/* The libFuzzer entry point (no header declares it). */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz_in in = {data, size, 0};
    uint8_t flags = fz_u8(&in);
    kvh_config c;
    size_t init_size = (flags & 1) ? fz_u16(&in) : sizeof(kvh_config);
    memset(&c, 0xAB, sizeof(c));
    kvh_status st = kvh_config_init(&c, init_size);
    FZ_KNOWN(st);
    FZ_CHECK((st == KVH_OK) == size_accepted(init_size, sizeof(kvh_config)), "config_init(%zu) returned %s", init_size,
             kvh_status_name(st));
    if (st == KVH_OK)
        for (size_t i = init_size; i < sizeof(c); i++)
            FZ_CHECK(((const uint8_t *)&c)[i] == 0xAB, "config_init(%zu) wrote byte %zu past its size", init_size, i);
    if (st != KVH_OK || init_size != sizeof(c))
        kvh_config_init(&c, sizeof(c));
    kvh_attention_params ap;
    size_t ap_size = (flags & 2) ? fz_u16(&in) : sizeof(ap);
    st = kvh_attention_params_init(&ap, ap_size);
    FZ_CHECK((st == KVH_OK) == size_accepted(ap_size, sizeof(ap)), "attention_params_init(%zu) returned %s", ap_size,
             kvh_status_name(st));

    /* geometry: small values mostly, anything sometimes */
    uint8_t g = fz_u8(&in);
    c.num_layers = (g & 1) ? fz_u32(&in) : fz_u8(&in) % 4;
    c.num_kv_heads = (g & 2) ? fz_u32(&in) : fz_u8(&in) % 4;
    c.head_dim = (g & 4) ? fz_u32(&in) : fz_u8(&in);
    c.block_tokens = (g & 8) ? fz_u32(&in) : fz_u8(&in) % 33;
    c.dtype = (g & 16) ? fz_u32(&in) : fz_u8(&in) % 4;
    c.backend = fz_u8(&in) % 5;
    if (c.backend == KVH_BACKEND_AUTO || c.backend == KVH_BACKEND_CUDA)
        c.backend = KVH_BACKEND_CPU;
    c.cuda_device = (int32_t)fz_u32(&in);
    c.lru_k = fz_u8(&in) % 7;
    c.promote_min_hits = fz_u32(&in);
    c.log_level = fz_u8(&in) % 6;
    c.migration_threads = fz_u8(&in) % 10;
    if (c.migration_threads > 4 && c.migration_threads < 9)
        c.migration_threads = 0;
    if (c.migration_threads == 9)
        c.migration_threads = 65 + fz_u8(&in); /* out of range */
    c.migration_cpu_mask = fz_u64(&in);
    c.numa_node = (int32_t)fz_u32(&in) % 4 - 2;
    c.disk_queue_depth = (flags & 4) ? fz_u32(&in) : fz_u8(&in);
    c.disk_flags = (flags & 8) ? fz_u32(&in) : fz_u8(&in) % 4;
    c.model_salt = fz_u64(&in);
    c.reserved0 = fz_u32(&in);
    if (flags & 16) {
        c.log_fn = log_fn;
        c.log_user = NULL;
    }
    /* budgets in whole blocks of this geometry, at most 4096 a tier */
    uint64_t bb = 2ull * c.num_layers * c.num_kv_heads * c.head_dim * c.block_tokens * esize(c.dtype);
    uint64_t unit = bb && bb < (1ull << 40) ? bb : 1;
    c.device_bytes = (fz_u16(&in) % 4097) * unit + fz_u16(&in) % unit;
    c.host_bytes = (fz_u16(&in) % 4097) * unit + fz_u16(&in) % unit;
    bool disk = (flags & 32) && bb && bb <= (1u << 20); /* no multi-gigabyte slab files */
    if (disk) {
        dir_for_disk = fz_dir("config");
        fz_clear(dir_for_disk);
        uint64_t slot = 4096 + (bb + 4095) / 4096 * 4096;
        c.disk_bytes = (fz_u8(&in) % 17) * slot + fz_u16(&in);
        c.disk_path = (flags & 64) ? "" : dir_for_disk;
    } else {
        c.disk_bytes = (flags & 64) ? fz_u16(&in) : 0;
        c.disk_path = NULL;
    }
    c.struct_size = (flags & 128) ? fz_u32(&in) : (uint32_t)sizeof(kvh_config);
    /* kvh.h: this library's size, or a multiple of 8 from 8 up to it (an
     * older header's struct: the fields past it take their defaults). */
    bool size_ok = size_accepted(c.struct_size, sizeof(kvh_config));
    if (size_ok && c.struct_size < offsetof(kvh_config, disk_bytes))
        return 0; /* the default budgets (1.25 GiB) are too large to open here */
    if (size_ok && c.struct_size < sizeof(kvh_config)) {
        kvh_config full;
        kvh_config_init(&full, sizeof(full));
        memcpy(&full, &c, c.struct_size);
        full.struct_size = c.struct_size;
        c = full;
    }

    /* what validation must decide, re-derived from the header */
    bool valid = c.num_layers >= 1 && c.num_layers <= 4096 && c.num_kv_heads >= 1 && c.num_kv_heads <= 1024 &&
                 c.head_dim >= 1 && c.head_dim <= 1024 && c.block_tokens >= 1 && c.block_tokens <= 256 &&
                 (c.block_tokens & (c.block_tokens - 1)) == 0 && c.dtype <= KVH_DTYPE_BF16 &&
                 c.backend <= KVH_BACKEND_CUDA && c.lru_k >= 1 && c.lru_k <= 4 && c.migration_threads <= 64 &&
                 c.numa_node >= -1 && c.log_level <= KVH_LOG_DEBUG && c.disk_queue_depth >= 1 &&
                 c.disk_queue_depth <= 4096 && (c.disk_flags & ~7u) == 0 &&
                 (!c.disk_bytes || (c.disk_path && *c.disk_path)) && (!(c.disk_path && *c.disk_path) || c.disk_bytes);

    kvh_engine *sentinel = (kvh_engine *)(uintptr_t)0x5e5e5e5e, *e = sentinel;
    st = kvh_engine_open(&c, &e);
    FZ_KNOWN(st);
    if (st != KVH_OK) {
        FZ_CHECK(e == sentinel, "engine written on failure (%s)", kvh_status_name(st));
        if (!size_ok)
            FZ_CHECK(st == KVH_ERR_STRUCT_SIZE, "struct_size %u: %s", c.struct_size, kvh_status_name(st));
        else if (!valid)
            FZ_CHECK(st == KVH_ERR_INVALID_ARG, "invalid config: %s", kvh_status_name(st));
        else
            FZ_CHECK(st == KVH_ERR_INVALID_ARG || st == KVH_ERR_NOMEM || st == KVH_ERR_IO || st == KVH_ERR_NOSPACE,
                     "a valid config failed with %s: %s", kvh_status_name(st), kvh_last_error());
        return 0;
    }
    FZ_CHECK(size_ok && valid, "an invalid config opened");
    uint64_t got = 0;
    FZ_CHECK(kvh_engine_block_bytes(e, &got) == KVH_OK && got == bb, "block bytes %llu, expected %llu",
             (unsigned long long)got, (unsigned long long)bb);
    for (uint32_t t = 0; t <= KVH_TIER_COUNT; t++) {
        kvh_tier_info ti = {.struct_size = sizeof(ti)};
        st = kvh_tier_info_get(e, t, &ti);
        FZ_CHECK((st == KVH_OK) == (t < KVH_TIER_COUNT), "tier_info(%u): %s", t, kvh_status_name(st));
        if (st == KVH_OK)
            FZ_CHECK(ti.used_bytes == ti.used_blocks * ti.block_bytes, "tier %u occupancy", t);
    }
    /* one block of K/V round trip, where the block is small enough */
    size_t tok = (size_t)c.num_kv_heads * c.head_dim * esize(c.dtype);
    if (tok * c.block_tokens <= (1u << 20)) {
        kvh_seq s;
        if (kvh_seq_create(e, 0, &s) == KVH_OK) {
            int32_t *tk = malloc(sizeof(int32_t) * c.block_tokens);
            uint8_t *k = malloc(tok * c.block_tokens), *v = malloc(tok * c.block_tokens);
            uint8_t *k2 = malloc(tok * c.block_tokens), *v2 = malloc(tok * c.block_tokens);
            if (tk && k && v && k2 && v2) {
                for (uint32_t i = 0; i < c.block_tokens; i++)
                    tk[i] = (int32_t)i;
                for (size_t i = 0; i < tok * c.block_tokens; i++)
                    k[i] = (uint8_t)fz_mix(i), v[i] = (uint8_t)fz_mix(i + 7);
                st = kvh_seq_append(e, s, tk, c.block_tokens);
                FZ_KNOWN(st);
                if (st == KVH_OK && (st = kvh_seq_write_kv(e, s, 0, 0, c.block_tokens, k, v)) == KVH_OK) {
                    FZ_CHECK(kvh_seq_read_kv(e, s, 0, 0, c.block_tokens, k2, v2) == KVH_OK, "read back");
                    FZ_CHECK(!memcmp(k, k2, tok * c.block_tokens) && !memcmp(v, v2, tok * c.block_tokens),
                             "K/V do not round-trip");
                    if (disk) {
                        st = kvh_seq_persist(e, s);
                        FZ_KNOWN(st);
                    }
                } else
                    FZ_KNOWN(st);
            }
            free(tk), free(k), free(v), free(k2), free(v2);
            kvh_seq_free(e, s);
        }
    }
    st = kvh_engine_close(e);
    FZ_CHECK(st == KVH_OK, "close: %s", kvh_status_name(st));
    return 0;
}
