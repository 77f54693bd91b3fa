/* The status lists of kvh.h stay true.
 *
 *   - Every kvh_status prototype of the header names its statuses in its
 *     comment ("KVH_ERR_..." or "No other status"), and every KVH_ERR_
 *     name the header mentions is a real status (the header is read from
 *     the source tree, KVH_HEADER_PATH).
 *   - Each call is driven into the failures its list names that a test can
 *     provoke deterministically, one small function per group of calls,
 *     and the exact status is asserted: NULL engine and out-pointers, stale
 *     handles, bad struct sizes and configs, ranges, full tiers (device,
 *     host and disk budgets of a few blocks), an unwritable disk_path, a
 *     locked, mismatched or damaged store, K/V never written, a flipped
 *     bit on disk, and I/O failures, ENOSPC and a stalled read injected
 *     through the disk fault hook (core/disk_io.h).
 *
 * Not driven here: KVH_ERR_CLOSED (a race with close), KVH_ERR_NOMEM
 * (allocation failures, which test_rel_faults injects), KVH_ERR_INTERNAL
 * (driver failures), KVH_ERR_BUSY from a switch in progress or a persist
 * whose blocks keep moving, and CUDA-only paths.
 */
#include <ctype.h>
#include <math.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "test_util.h"
#include "disk_test_util.h"

#include "core/disk_io.h"

#ifndef KVH_HEADER_PATH
#error "KVH_HEADER_PATH must name abi/include/kvh/kvh.h (tests/c/CMakeLists.txt sets it)"
#endif

/* Memory-only engines: f32, 2 heads of 4, 4 tokens a block (256 bytes). */
enum { L = 1, H = 2, D = 4, BT = 4 };
static const size_t TOK = H * D * sizeof(float);

/* Disk engines: one 4096-byte block a slot's data (slot = 8192 bytes). */
static const dt_geo G = {1, 1, 64, 16, KVH_DTYPE_F16};
#define G_TOK 128u
#define G_SLOT_BYTES 8192u

static kvh_engine *open_small(uint64_t device_blocks, uint64_t host_blocks)
{
    return tu_open(L, H, D, BT, KVH_DTYPE_F32, device_blocks, host_blocks, 0);
}

/* A new sequence of n tokens from base, its K/V written when write. */
static kvh_seq seq_of(kvh_engine *e, size_t n, int32_t base, bool write)
{
    kvh_seq s = tu_seq_new(e, 0);
    int32_t *t = tu_alloc(sizeof(int32_t) * (n ? n : 1));
    tu_iota(t, n, base);
    assert_ok(kvh_seq_append(e, s, t, n));
    tu_free(t);
    if (write)
        tu_write_pattern(e, s, L, TOK, (uint64_t)base, 0, n);
    return s;
}

/* A sequence freed at once: its handle is stale. */
static kvh_seq stale_seq(kvh_engine *e)
{
    kvh_seq s = tu_seq_new(e, 0);
    assert_ok(kvh_seq_free(e, s));
    return s;
}

/* ---- disk fault hook: fails or stalls one kind of operation ---- */

static struct {
    atomic_int op;  /* kvhi_disk_op to act on, -1: none */
    atomic_int err; /* negative errno to return, 0: stall instead */
    atomic_int stalled, released;
} F = {-1, 0, 0, 0};

static int fault_hook(enum kvhi_disk_op op, void *user)
{
    (void)user;
    if ((int)op != atomic_load(&F.op))
        return 0;
    int err = atomic_load(&F.err);
    if (err)
        return err;
    atomic_store(&F.stalled, 1);
    while (!atomic_load(&F.released))
        dt_sleep_ms(1);
    return 0;
}

static void fail_ops(enum kvhi_disk_op op, int err)
{
    atomic_store(&F.err, err);
    atomic_store(&F.op, (int)op);
}

static void stall_ops(enum kvhi_disk_op op)
{
    atomic_store(&F.stalled, 0);
    atomic_store(&F.released, 0);
    atomic_store(&F.err, 0);
    atomic_store(&F.op, (int)op);
}

static void faults_off(void)
{
    atomic_store(&F.op, -1);
    atomic_store(&F.released, 1); /* a stalled worker goes on */
}

static int setup(void **state)
{
    (void)state;
    kvhi_disk_set_fault_hook(fault_hook, NULL);
    return 0;
}

static int teardown(void **state)
{
    faults_off();
    dt_teardown(state);
    return tu_teardown(state);
}

/* A CPU engine with a disk tier of disk_slots slots in a fresh directory. */
static kvh_config disk_cfg(const char *name, char *dir, size_t dir_len, uint64_t disk_slots, uint32_t threads)
{
    dt_scratch(name, dir, dir_len);
    return dt_cfg(G, dir, 8, 8, disk_slots, threads);
}

/* A sequence of one full block of G, K/V written, moved to the disk tier. */
static kvh_seq disk_seq(kvh_engine *e, uint64_t stream)
{
    kvh_seq s;
    assert_ok(dt_build(e, G, dt_plain(stream), G.bt, 0, &s));
    assert_ok(kvh_seq_migrate(e, s, 0, G.bt, KVH_TIER_DISK, NULL));
    assert_int_equal(dt_binfo(e, s, 0).tier, KVH_TIER_DISK);
    return s;
}

/* ------------------------------------------------------------------ */
/* The header                                                          */
/* ------------------------------------------------------------------ */

static char *read_text(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        fail_msg("cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = tu_alloc((size_t)n + 1);
    size_t got = fread(s, 1, (size_t)n, f);
    fclose(f);
    assert_int_equal(got, (size_t)n);
    return s;
}

static bool status_name_known(const char *name, size_t len)
{
    for (kvh_status st = 0; st >= -64; st--) {
        const char *known = kvh_status_name(st);
        if (strlen(known) == len && !strncmp(known, name, len))
            return true;
    }
    return false;
}

/* A host pool of two slots over the caller's K and V bases. */
static kvh_pool_layout two_slot_pool(void **kbase, void **vbase)
{
    kvh_pool_layout lay = {.struct_size = sizeof(lay),
                           .memory = KVH_MEMORY_HOST,
                           .num_slots = 2,
                           .k_base = kbase,
                           .v_base = vbase,
                           .slot_stride = BT * TOK,
                           .token_stride = TOK,
                           .head_stride = D * sizeof(float)};
    return lay;
}

/* A prototype's list is the comment right above it, or above the run of
 * prototypes it belongs to (kvh_block_retain / _release share one). Every
 * prototype's comment also names the threads that may call it ("@threads",
 * the header's conventions). */
static void test_every_call_has_a_status_list(void **state)
{
    (void)state;
    char *h = read_text(KVH_HEADER_PATH);
    const char *comment = NULL, *comment_end = NULL;
    int prototypes = 0, missing = 0;
    for (const char *p = h; *p;) {
        if (p[0] == '/' && p[1] == '*') {
            const char *end = strstr(p + 2, "*/");
            assert_non_null(end);
            comment = p;
            comment_end = end + 2;
            p = comment_end;
            continue;
        }
        if (!strncmp(p, "KVH_API ", 8) && (p == h || p[-1] == '\n')) {
            const char *semi = strchr(p, ';');
            assert_non_null(semi);
            bool threads = false;
            for (const char *c = comment; c && c < comment_end && !threads; c++)
                threads = !strncmp(c, "@threads", 8);
            if (!threads) {
                const char *paren = strchr(p, '(');
                const char *name = paren;
                while (name > p && (isalnum((unsigned char)name[-1]) || name[-1] == '_'))
                    name--;
                print_error("%.*s: no @threads in its comment\n", (int)(paren - name), name);
                missing++;
            }
            if (!strncmp(p + 8, "kvh_status ", 11)) {
                const char *name = p + 19, *paren = strchr(name, '(');
                prototypes++;
                bool listed = false;
                for (const char *c = comment; c && c < comment_end && !listed; c++)
                    listed = !strncmp(c, "KVH_ERR_", 8) || !strncmp(c, "No other status", 15);
                if (!listed) {
                    print_error("%.*s: no status list in its comment\n", (int)(paren - name), name);
                    missing++;
                }
            }
            p = semi + 1;
            continue;
        }
        if (!isspace((unsigned char)*p))
            comment = NULL;
        p++;
    }
    assert_int_equal(missing, 0);
    assert_true(prototypes >= 70); /* the scan saw the header's calls */

    int unknown = 0;
    for (const char *p = strstr(h, "KVH_ERR_"); p; p = strstr(p + 1, "KVH_ERR_")) {
        size_t len = 0;
        while (isupper((unsigned char)p[len]) || p[len] == '_')
            len++;
        if (!status_name_known(p, len)) { /* kvh_status_name's "KVH_ERR_UNKNOWN" counts */
            print_error("the header names %.*s, which is no status\n", (int)len, p);
            unknown++;
        }
    }
    assert_int_equal(unknown, 0);
    tu_free(h);
}

/* ------------------------------------------------------------------ */
/* Configuration and engine                                            */
/* ------------------------------------------------------------------ */

static void test_config_and_engine(void **state)
{
    (void)state;
    kvh_config c;
    kvh_engine *e = NULL;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_config_init(NULL, sizeof(c)));
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_config_init(&c, sizeof(c) - 4));
    static const char *const bad_env[] = {"KVH_HOST_BYTES=lots", NULL};
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_config_from_env(NULL, sizeof(c), NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_config_from_env(&c, sizeof(c), bad_env));
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_config_from_env(&c, sizeof(c) - 4, NULL));

    c = tu_cfg(L, H, D, BT, KVH_DTYPE_F32, 4, 4, 0);
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(NULL, &e));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(&c, NULL));
    kvh_config bad = c;
    bad.struct_size = 12;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_engine_open(&bad, &e));
    bad = c, bad.num_layers = 0;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(&bad, &e));
    bad = c, bad.block_tokens = 3;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(&bad, &e));
    bad = c, bad.dtype = 7;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(&bad, &e));
    bad = c, bad.device_bytes = 16; /* less than one block */
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(&bad, &e));
    bad = c, bad.disk_bytes = 1 << 20; /* no disk_path */
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(&bad, &e));
    bad = c, bad.kv_codec = KVH_CODEC_Q4_G32; /* head_dim 4: no whole group */
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(&bad, &e));
    bad = c, bad.cuda_device = -5; /* as KVH_CUDA_DEVICE=-5 is refused */
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(&bad, &e));
    assert_null(e);
    /* An explicit CUDA backend: UNSUPPORTED where none answers. */
    bad = c, bad.backend = KVH_BACKEND_CUDA;
    kvh_status st = kvh_engine_open(&bad, &e);
    if (st == KVH_OK)
        assert_ok(kvh_engine_close(e));
    else
        assert_kvh(KVH_ERR_UNSUPPORTED, st);

    assert_ok(kvh_engine_close(NULL));
    e = open_small(4, 4);
    uint64_t bytes = 0;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_block_bytes(NULL, &bytes));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_block_bytes(e, NULL));
    kvh_tier_info ti = {.struct_size = sizeof(ti)};
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_tier_info_get(e, KVH_TIER_COUNT, &ti));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_tier_info_get(e, KVH_TIER_HOST, NULL));
    ti.struct_size = 4;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_tier_info_get(e, KVH_TIER_HOST, &ti));
    kvh_stats stats = {.struct_size = 4};
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_engine_stats(e, &stats));
    stats.struct_size = sizeof(stats) + 8;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_engine_stats(e, &stats));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_stats(e, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_agent_set_quota(NULL, 1, 1024));
    assert_ok(kvh_agent_set_quota(e, 1, 1024));
}

/* ------------------------------------------------------------------ */
/* Opening and closing a disk store                                    */
/* ------------------------------------------------------------------ */

static void test_disk_open_and_close(void **state)
{
    (void)state;
    char dir[512], path[600];
    kvh_engine *e = NULL, *second = NULL;

    /* A disk_path under a regular file cannot be created. */
    kvh_config c = disk_cfg("open_io", dir, sizeof(dir), 16, 0);
    dt_path(path, sizeof(path), dir, "file");
    assert_int_equal(dt_write_file(path, "x", 1), 0);
    char under[700];
    snprintf(under, sizeof(under), "%s/store", path);
    c.disk_path = under;
    assert_kvh(KVH_ERR_IO, kvh_engine_open(&c, &e));

    /* disk_bytes that hold no slot */
    c = disk_cfg("open_small", dir, sizeof(dir), 16, 0);
    c.disk_bytes = G_SLOT_BYTES - 1;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(&c, &e));

    /* open twice: the second finds it locked */
    c = disk_cfg("open_twice", dir, sizeof(dir), 16, 0);
    e = dt_open_a(&c);
    assert_kvh(KVH_ERR_BUSY, kvh_engine_open(&c, &second));
    assert_null(second);
    assert_ok(dt_close(e));
    e = NULL;

    /* another model_salt: a mismatch */
    kvh_config other = c;
    other.model_salt ^= 1;
    assert_kvh(KVH_ERR_MISMATCH, kvh_engine_open(&other, &e));

    /* a damaged index header: rebuilt from the slots by default, refused
     * when the index must be intact */
    uint8_t junk[4096];
    memset(junk, 0xA5, sizeof(junk));
    assert_int_equal(dt_write_file(dt_path(path, sizeof(path), dir, "index"), junk, sizeof(junk)), 0);
    kvh_config strict = c;
    strict.disk_strict_index = 1;
    assert_kvh(KVH_ERR_CORRUPT, kvh_engine_open(&strict, &e));
    assert_null(e);
    e = dt_open_a(&c);
    assert_ok(dt_close(e));
    e = NULL;

    /* close: the final index write fails (the engine is freed anyway) */
    c = disk_cfg("close_io", dir, sizeof(dir), 16, 0);
    e = dt_open_a(&c);
    fail_ops(KVHI_OP_FSYNC, -EIO);
    assert_kvh(KVH_ERR_IO, dt_close(e));
    faults_off();
}

/* ------------------------------------------------------------------ */
/* Sequences                                                           */
/* ------------------------------------------------------------------ */

static void test_sequence_calls(void **state)
{
    (void)state;
    kvh_engine *e = open_small(4, 4);
    kvh_seq s = seq_of(e, 6, 100, false), gone = stale_seq(e), out = {0x55};
    uint8_t k[8 * 32] = {0}, v[8 * 32] = {0};
    int32_t toks[8] = {0};
    uint64_t len;
    size_t matched;

    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_create(e, 0, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_free(e, gone));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_fork(e, s, 0, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_fork(e, gone, 0, &out));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_append(e, s, NULL, 1));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_append(e, gone, toks, 1));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_length(e, s, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_length(e, gone, &len));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_tokens(e, s, 4, 3, toks));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_tokens(e, s, 0, 1, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_tokens(e, gone, 0, 1, toks));

    assert_kvh(KVH_ERR_RANGE, kvh_seq_write_kv(e, s, 0, 5, 2, k, v)); /* token 6 not appended */
    assert_kvh(KVH_ERR_RANGE, kvh_seq_write_kv(e, s, L, 0, 1, k, v)); /* layer */
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_write_kv(e, s, 0, 0, 1, k, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_write_kv(e, gone, 0, 0, 1, k, v));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_read_kv(e, s, 0, 0, 1, k, v)); /* never written */
    tu_write_pattern(e, s, L, TOK, 100, 0, 6);
    assert_kvh(KVH_ERR_RANGE, kvh_seq_read_kv(e, s, 0, 4, 3, k, v));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_read_kv(e, s, L, 0, 1, k, v));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_read_kv(e, gone, 0, 0, 1, k, v));

    assert_kvh(KVH_ERR_RANGE, kvh_seq_truncate(e, s, 7));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_truncate(e, gone, 0));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_match_prefix(e, s, toks, 4, &matched)); /* not empty */
    kvh_seq empty = tu_seq_new(e, 0);
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_match_prefix(e, empty, NULL, 4, &matched));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_match_prefix(e, empty, toks, 4, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_match_prefix(e, gone, toks, 4, &matched));

    kvh_fence f = {0x77};
    assert_kvh(KVH_ERR_RANGE, kvh_seq_acquire(e, s, 0, 7, NULL));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_acquire(e, s, 0, 7, &f));
    assert_int_equal(f.id, 0x77);
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_acquire(e, gone, 0, 1, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_release(e, s, 0, 1)); /* not acquired */
    assert_ok(kvh_seq_acquire(e, s, 0, 4, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_release(e, s, 0, 6)); /* block 1 not acquired */
    assert_kvh(KVH_ERR_RANGE, kvh_seq_release(e, s, 0, 7));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_release(e, gone, 0, 1));
    assert_ok(kvh_seq_release(e, s, 0, 4));

    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_pin(e, s, 0, 1, 0)); /* not pinned */
    assert_kvh(KVH_ERR_RANGE, kvh_seq_pin(e, s, 0, 7, 1));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_pin(e, gone, 0, 1, 1));
    kvh_block blocks[3];
    assert_kvh(KVH_ERR_RANGE, kvh_seq_blocks(e, s, 1, 2, blocks));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_blocks(e, s, 0, 1, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_blocks(e, gone, 0, 1, blocks));

    int32_t indptr[3], indices[4], last[2];
    kvh_seq batch[2] = {s, gone};
    assert_kvh(KVH_ERR_RANGE, kvh_block_table(e, &s, 1, indptr, indices, 1, last)); /* 2 blocks */
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_table(e, batch, 2, indptr, indices, 4, last));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_block_table(e, &s, 1, NULL, indices, 4, last));
    assert_ok(kvh_seq_migrate(e, s, 0, 6, KVH_TIER_HOST, NULL));
    assert_kvh(KVH_ERR_NOT_RESIDENT, kvh_block_table(e, &s, 1, indptr, indices, 4, last));
}

/* Tiers with no room left. */
static void test_sequences_out_of_room(void **state)
{
    (void)state;
    int32_t one = 7;
    uint8_t k[4 * 32] = {0}, v[4 * 32] = {0};

    /* Two device blocks, no host tier, both taken by s's 6 tokens. */
    kvh_engine *e = open_small(2, 0);
    kvh_seq s = seq_of(e, 6, 200, true), more = tu_seq_new(e, 0), child;
    assert_kvh(KVH_ERR_NOSPACE, kvh_seq_append(e, more, &one, 1));
    assert_int_equal(tu_seq_len(e, more), 0);
    /* A fork shares both blocks: whatever copies one finds no room. */
    assert_ok(kvh_seq_fork(e, s, 0, &child));
    assert_kvh(KVH_ERR_NOSPACE, kvh_seq_write_kv(e, child, 0, 0, 1, k, v));
    assert_kvh(KVH_ERR_NOSPACE, kvh_seq_truncate(e, child, 5));
    assert_kvh(KVH_ERR_NOSPACE, kvh_seq_append(e, child, &one, 1));
    assert_int_equal(tu_seq_len(e, child), 6);
    kvh_block b;
    assert_kvh(KVH_ERR_NOSPACE, kvh_block_alloc(e, 0, &b));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_block_alloc(e, 0, NULL));

    /* acquire: the device tier's one slot is held by another sequence. */
    e = open_small(1, 2);
    kvh_seq held = seq_of(e, 4, 300, true);
    assert_ok(kvh_seq_acquire(e, held, 0, 4, NULL));
    kvh_seq below = seq_of(e, 4, 400, true); /* lands in the host tier */
    assert_int_equal(tu_seq_binfo(e, below, 0).tier, KVH_TIER_HOST);
    assert_kvh(KVH_ERR_NOSPACE, kvh_seq_acquire(e, below, 0, 4, NULL));
    assert_int_equal(tu_seq_binfo(e, below, 0).holds, 0);
    assert_ok(kvh_seq_release(e, held, 0, 4));

    /* acquire: a block pinned in the host tier may not leave it. */
    assert_ok(kvh_seq_pin(e, below, 0, 4, 1));
    assert_kvh(KVH_ERR_BUSY, kvh_seq_acquire(e, below, 0, 4, NULL));
    assert_int_equal(tu_seq_binfo(e, below, 0).holds, 0);
    assert_ok(kvh_seq_pin(e, below, 0, 4, 0));
}

/* ------------------------------------------------------------------ */
/* Persistence and reads from disk                                     */
/* ------------------------------------------------------------------ */

static void test_persist(void **state)
{
    (void)state;
    char dir[512];
    kvh_engine *e = open_small(4, 4);
    kvh_seq s = seq_of(e, 4, 500, true);
    assert_kvh(KVH_ERR_UNSUPPORTED, kvh_seq_persist(e, s));

    kvh_config c = disk_cfg("persist", dir, sizeof(dir), 16, 0);
    e = dt_open_a(&c);
    kvh_seq unwritten = tu_seq_new(e, 0);
    int32_t toks[16];
    tu_iota(toks, 16, 600);
    assert_ok(kvh_seq_append(e, unwritten, toks, 16));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_persist(e, unwritten));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_persist(e, stale_seq(e)));
    /* a full disk: ENOSPC is not fatal, the next persist works */
    assert_ok(dt_build(e, G, dt_plain(2), G.bt, 0, &s));
    fail_ops(KVHI_OP_WRITE, -ENOSPC);
    assert_kvh(KVH_ERR_NOSPACE, kvh_seq_persist(e, s));
    faults_off();
    assert_ok(kvh_seq_persist(e, s));
    /* a failed fsync is fatal: this persist and every later one */
    kvh_seq t;
    assert_ok(dt_build(e, G, dt_plain(3), G.bt, 0, &t));
    fail_ops(KVHI_OP_FSYNC, -EIO);
    assert_kvh(KVH_ERR_IO, kvh_seq_persist(e, t));
    faults_off();
    assert_kvh(KVH_ERR_IO, kvh_seq_persist(e, t));
}

static void test_disk_reads(void **state)
{
    (void)state;
    char dir[512], slab[600];
    kvh_config c = disk_cfg("reads", dir, sizeof(dir), 16, 0);
    kvh_engine *e = dt_open_a(&c);
    uint8_t k[G_TOK], v[G_TOK];
    memset(k, 1, sizeof(k));
    memset(v, 2, sizeof(v));

    /* a flipped bit in a block's data on disk */
    kvh_seq damaged = disk_seq(e, 10);
    uint64_t off = (uint64_t)dt_binfo(e, damaged, 0).slot * G_SLOT_BYTES + 4096 + 100;
    assert_int_equal(dt_flip_bit(dt_path(slab, sizeof(slab), dir, "slab-0000.kvh"), off, 3), 0);
    assert_kvh(KVH_ERR_CORRUPT, kvh_seq_read_kv(e, damaged, 0, 0, 1, k, v));

    /* reads that fail */
    kvh_seq s = disk_seq(e, 11);
    fail_ops(KVHI_OP_READ, -EIO);
    assert_kvh(KVH_ERR_IO, kvh_seq_read_kv(e, s, 0, 0, 1, k, v));
    assert_kvh(KVH_ERR_IO, kvh_seq_write_kv(e, s, 0, 0, 1, k, v));
    assert_kvh(KVH_ERR_IO, kvh_seq_acquire(e, s, 0, 1, NULL));
    faults_off();
    assert_ok(kvh_seq_read_kv(e, s, 0, 0, 1, k, v));
}

/* ------------------------------------------------------------------ */
/* Blocks, migration and fences                                        */
/* ------------------------------------------------------------------ */

static void test_block_calls(void **state)
{
    (void)state;
    kvh_engine *e = open_small(4, 4);
    kvh_seq s = seq_of(e, 4, 700, true);
    kvh_block b, seq_block = tu_seq_block(e, s, 0), gone;
    assert_ok(kvh_block_alloc(e, 0, &gone));
    assert_ok(kvh_block_release(e, gone));
    assert_ok(kvh_block_alloc(e, 0, &b));

    kvh_block_info bi = {.struct_size = sizeof(bi)};
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_block_info_get(e, b, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_info_get(e, gone, &bi));
    bi.struct_size = 4;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_block_info_get(e, b, &bi));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_retain(e, gone));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_release(e, gone));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_block_release(e, seq_block)); /* the sequence's reference */
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_block_pin(e, b, 0));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_pin(e, gone, 1));
    assert_ok(kvh_block_release(e, b));
}

static void test_migration_and_fences(void **state)
{
    (void)state;
    kvh_engine *e = open_small(4, 1);
    kvh_seq first = seq_of(e, 4, 800, true), second = seq_of(e, 4, 900, true), gone = stale_seq(e);
    kvh_block b = tu_seq_block(e, second, 0), stale_block;
    assert_ok(kvh_block_alloc(e, 0, &stale_block));
    assert_ok(kvh_block_release(e, stale_block));
    kvh_fence f = {0x77};

    assert_kvh(KVH_ERR_INVALID_ARG, kvh_migrate(e, NULL, 1, KVH_TIER_HOST, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_migrate(e, &b, 1, KVH_TIER_DISK, NULL)); /* no disk tier */
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_migrate(e, &b, 1, 9, NULL));
    kvh_block pair[2] = {b, stale_block};
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_migrate(e, pair, 2, KVH_TIER_HOST, &f));
    assert_int_equal(f.id, 0x77);
    assert_kvh(KVH_ERR_RANGE, kvh_seq_migrate(e, first, 0, 5, KVH_TIER_HOST, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_migrate(e, gone, 0, 0, KVH_TIER_HOST, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_migrate(e, first, 0, 4, KVH_TIER_DISK, NULL));

    /* The host tier's one slot is taken by a referenced block: no room. */
    assert_ok(kvh_seq_migrate(e, first, 0, 4, KVH_TIER_HOST, NULL));
    assert_kvh(KVH_ERR_NOSPACE, kvh_migrate(e, &b, 1, KVH_TIER_HOST, NULL));
    assert_kvh(KVH_ERR_NOSPACE, kvh_seq_migrate(e, second, 0, 4, KVH_TIER_HOST, NULL));
    /* ... and through a fence: the work's first error. */
    assert_ok(kvh_seq_migrate(e, second, 0, 4, KVH_TIER_HOST, &f));
    int32_t done = 0;
    assert_kvh(KVH_ERR_NOSPACE, kvh_fence_poll(e, f, &done));
    assert_int_equal(done, 1);
    assert_kvh(KVH_ERR_NOSPACE, kvh_fence_wait(e, f, UINT64_MAX));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_fence_poll(e, f, NULL));
    assert_ok(kvh_fence_free(e, f));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_wait(e, f, 0));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_poll(e, f, &done));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_fence_free(e, f));
    assert_ok(kvh_fence_free(e, (kvh_fence){0}));

    assert_kvh(KVH_ERR_RANGE, kvh_prefetch(e, first, 0, 5, 0, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_prefetch(e, gone, 0, 0, 0, NULL));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_hint(e, first, 5, 0, 0));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_hint(e, gone, 0, 0, 0));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_hint_queued(e, first, 0, 0, 0, (kvh_hint_place)7));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_hint_queued(e, first, 5, 0, 0, KVH_HINT_POSITION));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_hint_queued(e, first, 0, 0, 1u << 24, KVH_HINT_POSITION));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_hint_queued(e, gone, 0, 0, 0, KVH_HINT_POSITION));
    uint64_t step = 0;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_hint_advance(e, 1, NULL));
    assert_ok(kvh_hint_advance(e, 1, &step));
    assert_kvh(KVH_ERR_RANGE, kvh_hint_advance(e, UINT64_MAX, &step));
}

/* A fence whose read is stalled in a migration worker. */
static void test_fence_timeout(void **state)
{
    (void)state;
    char dir[512];
    kvh_config c = disk_cfg("fence_timeout", dir, sizeof(dir), 16, 1);
    kvh_engine *e = dt_open_a(&c);
    kvh_seq s = disk_seq(e, 20);
    stall_ops(KVHI_OP_READ);
    kvh_fence f;
    assert_ok(kvh_seq_acquire(e, s, 0, G.bt, &f));
    for (int i = 0; i < 10000 && !atomic_load(&F.stalled); i++)
        dt_sleep_ms(1);
    assert_true(atomic_load(&F.stalled));
    assert_kvh(KVH_ERR_TIMEOUT, kvh_fence_wait(e, f, 1000000));
    int32_t done = 1;
    assert_ok(kvh_fence_poll(e, f, &done));
    assert_int_equal(done, 0);
    faults_off();
    assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
    assert_ok(kvh_fence_free(e, f));
    assert_ok(kvh_seq_release(e, s, 0, G.bt));
}

/* ------------------------------------------------------------------ */
/* Prefix index and external pools                                     */
/* ------------------------------------------------------------------ */

static void test_prefix_and_pools(void **state)
{
    (void)state;
    kvh_engine *e = open_small(4, 4);
    int32_t toks[BT] = {1, 2, 3, 4};
    uint64_t hash;
    size_t n_blocks;
    kvh_block out[2];
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_prefix_hash(e, 0, toks, BT - 1, &hash));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_prefix_hash(e, 0, toks, BT, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_prefix_lookup(e, NULL, BT, out, 2, &n_blocks));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_prefix_lookup(e, toks, BT, NULL, 2, &n_blocks));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_prefix_lookup(e, toks, BT, out, 2, NULL));

    uint8_t *mem = tu_alloc(2 * 2 * BT * TOK);
    void *kbase[L] = {mem}, *vbase[L] = {mem + 2 * BT * TOK};
    kvh_pool_layout lay = two_slot_pool(kbase, vbase);
    kvh_pool pool, gone;
    kvh_pool_layout bad = lay;
    bad.struct_size = 8;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_pool_register(e, &bad, &pool));
    bad = lay, bad.num_slots = 0;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_register(e, &bad, &pool));
    bad = lay, bad.memory = 7;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_register(e, &bad, &pool));
    bad = lay, bad.token_stride = 4;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_register(e, &bad, &pool));
    bad = lay, bad.memory = KVH_MEMORY_CUDA;
    assert_kvh(KVH_ERR_UNSUPPORTED, kvh_pool_register(e, &bad, &pool));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_register(e, &lay, NULL));
    assert_ok(kvh_pool_register(e, &lay, &gone));
    assert_ok(kvh_pool_unregister(e, gone));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_unregister(e, gone));
    assert_ok(kvh_pool_unregister(e, (kvh_pool){0}));
    assert_ok(kvh_pool_register(e, &lay, &pool));

    kvh_block b, empty;
    assert_kvh(KVH_ERR_RANGE, kvh_pool_offload(e, pool, 2, 0, toks, BT, 0, &b));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload(e, pool, 0, 0, toks, BT - 1, 0, &b));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload(e, pool, 0, 0, toks, BT, 0, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_offload(e, gone, 0, 0, toks, BT, 0, &b));
    assert_ok(kvh_pool_offload(e, pool, 0, 0, toks, BT, 0, &b));
    assert_kvh(KVH_ERR_RANGE, kvh_pool_restore(e, pool, b, 2));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_restore(e, gone, b, 0));
    assert_ok(kvh_block_alloc(e, 0, &empty));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_restore(e, pool, empty, 1)); /* K/V not written */
    assert_ok(kvh_block_release(e, empty));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_restore(e, pool, empty, 1));
    assert_ok(kvh_block_release(e, b));

    /* Both tiers full of referenced blocks: an offload finds no room. */
    e = open_small(1, 1);
    assert_ok(kvh_pool_register(e, &lay, &pool));
    kvh_block held[2];
    assert_ok(kvh_block_alloc(e, 0, &held[0]));
    assert_ok(kvh_block_alloc(e, 0, &held[1]));
    assert_kvh(KVH_ERR_NOSPACE, kvh_pool_offload(e, pool, 1, 0, toks, BT, 0, &b));
}

/* ------------------------------------------------------------------ */
/* Tenant scopes                                                        */
/* ------------------------------------------------------------------ */

static void test_scopes(void **state)
{
    (void)state;
    kvh_engine *e = open_small(4, 4);
    kvh_seq s = seq_of(e, 2, 1, false), empty = tu_seq_new(e, 0), gone = stale_seq(e);
    int32_t toks[BT] = {1, 2, 3, 4};
    uint64_t hash;
    size_t n_blocks;
    kvh_block out[2];
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_set_scope(e, s, 1, 1, 0)); /* not empty */
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_set_scope(e, gone, 1, 1, 0));
    assert_ok(kvh_seq_set_scope(e, empty, 1, 1, 0));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_get_scope(e, gone, &hash, NULL, NULL));
    assert_ok(kvh_seq_get_scope(e, empty, &hash, NULL, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_prefix_hash_scoped(e, 1, 0, toks, BT - 1, &hash));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_prefix_hash_scoped(e, 1, 0, NULL, BT, &hash));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_prefix_hash_scoped(e, 1, 0, toks, BT, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_prefix_lookup_scoped(e, 1, 1, 0, NULL, BT, out, 2, &n_blocks));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_prefix_lookup_scoped(e, 1, 1, 0, toks, BT, NULL, 2, &n_blocks));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_prefix_lookup_scoped(e, 1, 1, 0, toks, BT, out, 2, NULL));

    uint8_t *mem = tu_alloc(2 * 2 * BT * TOK);
    void *kbase[L] = {mem}, *vbase[L] = {mem + 2 * BT * TOK};
    kvh_pool_layout lay = two_slot_pool(kbase, vbase);
    kvh_pool pool, pgone;
    assert_ok(kvh_pool_register(e, &lay, &pgone));
    assert_ok(kvh_pool_unregister(e, pgone));
    assert_ok(kvh_pool_register(e, &lay, &pool));
    kvh_block b;
    assert_kvh(KVH_ERR_RANGE, kvh_pool_offload_scoped(e, pool, 2, 1, 0, toks, BT, 0, &b));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload_scoped(e, pool, 0, 1, 0, toks, BT - 1, 0, &b));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload_scoped(e, pool, 0, 1, 0, NULL, BT, 0, &b));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload_scoped(e, pool, 0, 1, 0, toks, BT, 0, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_offload_scoped(e, pgone, 0, 1, 0, toks, BT, 0, &b));
    assert_ok(kvh_pool_offload_scoped(e, pool, 0, 1, 0, toks, BT, 0, &b));
    assert_ok(kvh_block_release(e, b));

    /* Both tiers full of referenced blocks: an offload finds no room. */
    e = open_small(1, 1);
    assert_ok(kvh_pool_register(e, &lay, &pool));
    kvh_block held[2];
    assert_ok(kvh_block_alloc(e, 0, &held[0]));
    assert_ok(kvh_block_alloc(e, 0, &held[1]));
    assert_kvh(KVH_ERR_NOSPACE, kvh_pool_offload_scoped(e, pool, 1, 3, 0, toks, BT, 0, &b));
}

/* ------------------------------------------------------------------ */
/* Paged attention and plans                                           */
/* ------------------------------------------------------------------ */

static void test_attention(void **state)
{
    (void)state;
    kvh_engine *e = open_small(4, 4);
    kvh_seq s = seq_of(e, 4, 1000, true), empty = tu_seq_new(e, 0), gone = stale_seq(e);
    kvh_seq in_host = seq_of(e, 4, 1100, true);
    assert_ok(kvh_seq_migrate(e, in_host, 0, 4, KVH_TIER_HOST, NULL));
    float q[8 * H * D] = {0}, out[8 * H * D];
    uint32_t ql = 5;
    kvh_attention_params p;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_params_init(NULL, sizeof(p)));
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_attention_params_init(&p, sizeof(p) - 4));
    assert_ok(kvh_attention_params_init(&p, sizeof(p)));

    kvh_attention_params bad = p;
    bad.io_dtype = 9;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_decode(e, 0, &s, 1, q, out, &bad));
    bad = p, bad.scale = NAN;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_decode(e, 0, &s, 1, q, out, &bad));
    bad = p, bad.num_q_heads = H + 1;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_decode(e, 0, &s, 1, q, out, &bad));
    bad = p, bad.struct_size = 12;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_attention_decode(e, 0, &s, 1, q, out, &bad));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_decode(e, 0, &s, 1, NULL, out, NULL));
    assert_kvh(KVH_ERR_RANGE, kvh_attention_decode(e, L, &s, 1, q, out, NULL));
    assert_kvh(KVH_ERR_RANGE, kvh_attention_decode(e, 0, &empty, 1, q, out, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_attention_decode(e, 0, &gone, 1, q, out, NULL));
    assert_kvh(KVH_ERR_NOT_RESIDENT, kvh_attention_decode(e, 0, &in_host, 1, q, out, NULL));
    assert_ok(kvh_attention_decode(e, 0, &s, 1, q, out, NULL));
    assert_kvh(KVH_ERR_RANGE, kvh_attention_prefill(e, 0, &s, &ql, 1, q, out, NULL)); /* 5 > 4 tokens */
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_prefill(e, 0, &s, NULL, 1, q, out, NULL));

    kvh_attention_plan *plan = NULL;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_plan_create(e, 0, &s, NULL, 1, NULL, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_plan_create(e, 0, NULL, NULL, 0, NULL, &plan)); /* no rows */
    assert_kvh(KVH_ERR_RANGE, kvh_attention_plan_create(e, L, &s, NULL, 1, NULL, &plan));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_attention_plan_create(e, 0, &gone, NULL, 1, NULL, &plan));
    assert_kvh(KVH_ERR_NOT_RESIDENT, kvh_attention_plan_create(e, 0, &in_host, NULL, 1, NULL, &plan));
    assert_null(plan);
    assert_ok(kvh_attention_plan_create(e, 0, &s, NULL, 1, NULL, &plan));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_run(e, NULL, q, out, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_run(e, plan, q, NULL, NULL));
    assert_ok(kvh_attention_run(e, plan, q, out, NULL));
    assert_ok(kvh_attention_plan_destroy(e, plan));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_attention_run(e, plan, q, out, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_attention_plan_destroy(e, plan));
    assert_ok(kvh_attention_plan_destroy(e, NULL));
}

/* ------------------------------------------------------------------ */
/* Weight contexts and admission                                       */
/* ------------------------------------------------------------------ */

static kvh_weight_region_params region_of(const void *bytes, const char *path, uint64_t size)
{
    kvh_weight_region_params r;
    assert_ok(kvh_weight_region_params_init(&r, sizeof(r)));
    r.bytes = bytes;
    r.path = path;
    r.size = size;
    return r;
}

static void test_contexts(void **state)
{
    (void)state;
    char dir[512], file[600];
    dt_scratch("contexts", dir, sizeof(dir));
    dt_path(file, sizeof(file), dir, "weights.bin");
    uint8_t bytes[2 * 4096];
    memset(bytes, 0x3C, sizeof(bytes));
    assert_int_equal(dt_write_file(file, bytes, sizeof(bytes)), 0);

    /* kvh.h: a region is charged its size in whole 4096-byte pages. Device
     * tier 16 blocks (4 KiB: one page), host tier 64 (16 KiB: four pages),
     * no disk; an 8 KiB (two-page) weight file */
    kvh_engine *e = open_small(16, 64);
    kvh_context_params cp;
    kvh_context ctx, gone;
    uint32_t region;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_context_params_init(NULL, sizeof(cp)));
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_context_params_init(&cp, sizeof(cp) + 8));
    assert_ok(kvh_context_params_init(&cp, sizeof(cp)));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_context_create(e, NULL, NULL));
    kvh_context_params badp = cp;
    badp.chunk_bytes = 0;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_context_create(e, &badp, &ctx));
    badp = cp, badp.kv_policy = 9;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_context_create(e, &badp, &ctx));
    badp = cp, badp.struct_size = 4;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_context_create(e, &badp, &ctx));
    assert_ok(kvh_context_create(e, NULL, &gone));
    assert_ok(kvh_context_destroy(e, gone));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_destroy(e, gone));
    assert_ok(kvh_context_destroy(e, (kvh_context){0}));
    assert_ok(kvh_context_create(e, NULL, &ctx));

    kvh_weight_region_params rp;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_weight_region_params_init(NULL, sizeof(rp)));
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_weight_region_params_init(&rp, 4));
    rp = region_of(bytes, NULL, 0);
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_context_add_region(e, ctx, &rp, &region));
    rp = region_of(bytes, file, 256);
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_context_add_region(e, ctx, &rp, &region));
    rp = region_of(NULL, NULL, 256);
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_context_add_region(e, ctx, &rp, &region));
    rp = region_of(bytes, NULL, 256);
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_context_add_region(e, ctx, &rp, NULL));
    rp.struct_size = 4;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_context_add_region(e, ctx, &rp, &region));
    rp = region_of(bytes, NULL, 256);
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_add_region(e, gone, &rp, &region));
    char missing[700];
    snprintf(missing, sizeof(missing), "%s/no-such-file", dir);
    rp = region_of(NULL, missing, 256);
    assert_kvh(KVH_ERR_IO, kvh_context_add_region(e, ctx, &rp, &region));
    rp = region_of(NULL, file, sizeof(bytes) + 1); /* longer than the file */
    assert_kvh(KVH_ERR_IO, kvh_context_add_region(e, ctx, &rp, &region));
    uint8_t *big = tu_alloc(5 * 4096); /* more than the whole host tier */
    rp = region_of(big, NULL, 5 * 4096);
    assert_kvh(KVH_ERR_NOSPACE, kvh_context_add_region(e, ctx, &rp, &region));

    kvh_seq s = tu_seq_new(e, 0);
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_attach_seq(e, gone, s));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_attach_seq(e, ctx, stale_seq(e)));
    assert_ok(kvh_context_attach_seq(e, ctx, s));

    /* a region from bytes, resident after a switch; then damaged in place */
    rp = region_of(bytes, NULL, 256);
    assert_ok(kvh_context_add_region(e, ctx, &rp, &region));
    void *data = NULL;
    assert_kvh(KVH_ERR_NOT_RESIDENT, kvh_context_region_data(e, ctx, region, 0, &data, NULL));
    assert_kvh(KVH_ERR_NOT_RESIDENT, kvh_context_wait_layer(e, ctx, 0, 0));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_wait_layer(e, gone, 0, 0));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_context_switch(e, ctx, ctx, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_switch(e, (kvh_context){0}, gone, NULL));
    assert_ok(kvh_context_switch(e, (kvh_context){0}, ctx, NULL));
    assert_kvh(KVH_ERR_RANGE, kvh_context_region_data(e, ctx, region + 1, 0, &data, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_context_region_data(e, ctx, region, 0, NULL, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_region_data(e, gone, region, 0, &data, NULL));
    assert_kvh(KVH_ERR_RANGE, kvh_context_region_pin(e, ctx, region + 1, 1));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_region_pin(e, gone, region, 1));
    assert_ok(kvh_context_region_data(e, ctx, region, 0, &data, NULL));
    uint64_t checked = 0;
    assert_ok(kvh_context_verify(e, ctx, &checked));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_verify(e, gone, &checked));
    ((uint8_t *)data)[17] ^= 0x40; /* memory gone bad under a clean region */
    assert_kvh(KVH_ERR_CORRUPT, kvh_context_verify(e, ctx, &checked));
    ((uint8_t *)data)[17] ^= 0x40;

    kvh_context_info info = {.struct_size = 4};
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_context_info_get(e, ctx, &info));
    info.struct_size = sizeof(info);
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_context_info_get(e, ctx, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_info_get(e, gone, &info));
    kvh_weight_stats ws = {.struct_size = 4};
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_weight_stats_get(e, &ws));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_weight_stats_get(e, NULL));

    /* A context larger than the device tier is refused before a switch
     * starts: none loads it. A switch whose work fails: the call without
     * a fence reports it, and so does kvh_context_wait_layer afterwards. */
    kvh_context too_big, shrunk;
    assert_ok(kvh_context_create(e, NULL, &too_big));
    rp = region_of(NULL, file, sizeof(bytes)); /* two pages: more than the whole device tier */
    assert_ok(kvh_context_add_region(e, too_big, &rp, &region));
    assert_kvh(KVH_ERR_NOSPACE, kvh_context_switch(e, ctx, too_big, NULL));
    assert_kvh(KVH_ERR_NOT_RESIDENT, kvh_context_wait_layer(e, too_big, 0, 0));
    assert_ok(kvh_context_create(e, NULL, &shrunk));
    rp = region_of(NULL, file, 256);
    assert_ok(kvh_context_add_region(e, shrunk, &rp, &region));
    assert_int_equal(truncate(file, 0), 0);
    assert_kvh(KVH_ERR_IO, kvh_context_switch(e, ctx, shrunk, NULL)); /* ctx makes room */
    assert_kvh(KVH_ERR_IO, kvh_context_wait_layer(e, shrunk, 0, 0));
}

static void test_admission(void **state)
{
    (void)state;
    kvh_engine *e = open_small(8, 8);
    uint64_t block = tu_block_bytes(e);
    kvh_admission_params ap;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_admission_params_init(NULL, sizeof(ap)));
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_admission_params_init(&ap, 4));
    assert_ok(kvh_admission_params_init(&ap, sizeof(ap)));
    ap.short_device_bytes = 6 * block;
    ap.long_device_bytes = 6 * block; /* 12 blocks of quota, 8 in the tier */
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_admission_configure(e, &ap));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_admission_configure(e, NULL));
    kvh_admission_params bad = ap;
    bad.struct_size = 4;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_admission_configure(e, &bad));
    ap.long_device_bytes = 2 * block;
    assert_ok(kvh_admission_configure(e, &ap));
    kvh_admission_info ai = {.struct_size = 4};
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_admission_info_get(e, &ai));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_admission_info_get(e, NULL));

    kvh_seq_params sp;
    kvh_seq s;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_params_init(NULL, sizeof(sp)));
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_seq_params_init(&sp, 4));
    assert_ok(kvh_seq_params_init(&sp, sizeof(sp)));
    sp.token_budget = 7 * BT; /* short pool: 6 blocks */
    assert_kvh(KVH_ERR_NOSPACE, kvh_seq_create_ex(e, &sp, &s));
    sp.token_budget = BT;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_create_ex(e, &sp, NULL));
    kvh_seq_params badsp = sp;
    badsp.struct_size = 4;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_seq_create_ex(e, &badsp, &s));
    kvh_context gone;
    assert_ok(kvh_context_create(e, NULL, &gone));
    assert_ok(kvh_context_destroy(e, gone));
    sp.context = gone;
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_create_ex(e, &sp, &s));
}

/* ------------------------------------------------------------------ */
/* Codecs, views and tolerance                                         */
/* ------------------------------------------------------------------ */

static void test_codecs(void **state)
{
    (void)state;
    uint64_t bytes;
    uint8_t src[256], dst[256];
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_codec_vector_bytes(99, KVH_DTYPE_F16, 64, &bytes));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_codec_vector_bytes(KVH_CODEC_INT8, 9, 64, &bytes));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_codec_vector_bytes(KVH_CODEC_INT8, KVH_DTYPE_F16, 0, &bytes));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_codec_vector_bytes(KVH_CODEC_Q4_G32, KVH_DTYPE_F16, 48, &bytes));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_codec_vector_bytes(KVH_CODEC_INT8, KVH_DTYPE_F16, 64, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_codec_encode(KVH_CODEC_Q4_G64, KVH_DTYPE_F16, 32, src, 1, dst));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_codec_encode(KVH_CODEC_INT8, KVH_DTYPE_F16, 64, NULL, 1, dst));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_codec_decode(KVH_CODEC_INT8, KVH_DTYPE_F16, 64, src, 1, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_codec_decode(99, KVH_DTYPE_F16, 64, src, 1, dst));
    assert_ok(kvh_codec_encode(KVH_CODEC_INT8, KVH_DTYPE_F16, 64, NULL, 0, NULL));
}

/* Views need one head's K of a block to be whole pages: f32, 64 x 16. */
enum { VD = 64, VBT = 16 };
static const size_t VTOK = VD * sizeof(float);

static kvh_seq view_seq(kvh_engine *e, size_t n, int32_t base)
{
    kvh_seq s = tu_seq_new(e, 0);
    int32_t *t = tu_alloc(sizeof(int32_t) * n);
    tu_iota(t, n, base);
    assert_ok(kvh_seq_append(e, s, t, n));
    tu_free(t);
    tu_write_pattern(e, s, 1, VTOK, (uint64_t)base, 0, n);
    return s;
}

static void test_views(void **state)
{
    (void)state;
    kvh_vmap *m = NULL;
    kvh_engine *plain = open_small(4, 4);
    kvh_seq ps = seq_of(plain, 4, 1200, true);
    assert_kvh(KVH_ERR_UNSUPPORTED, kvh_seq_vmap(plain, ps, 0, 0, &m));

    /* A host tier for the appends that pass a view's capacity (with 2 MiB
     * units that capacity is 8192 tokens). */
    kvh_config c = tu_cfg(1, 1, VD, VBT, KVH_DTYPE_F32, 8, 600, 0);
    c.vmap = 1;
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&c, &e);
    if (st != KVH_OK) {
        assert_kvh(KVH_ERR_UNSUPPORTED, st);
        skip();
    }
    tu_track_engine(e);
    kvh_seq s = view_seq(e, VBT, 1300), gone = stale_seq(e), empty = tu_seq_new(e, 0);
    kvh_seq in_host = view_seq(e, VBT, 1400);
    assert_ok(kvh_seq_migrate(e, in_host, 0, VBT, KVH_TIER_HOST, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_vmap(e, s, 0, 0, NULL));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_vmap(e, s, 1, 0, &m));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_vmap(e, s, 0, (1ull << 31) + 1, &m));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_vmap(e, gone, 0, 0, &m));
    assert_kvh(KVH_ERR_NOT_RESIDENT, kvh_seq_vmap(e, in_host, 0, 0, &m));
    assert_null(m);

    kvh_vmap *none = NULL;
    assert_ok(kvh_seq_vmap(e, s, 0, 0, &m));
    assert_ok(kvh_seq_vmap(e, empty, 0, 0, &none));
    kvh_vmap_view view = {.struct_size = 4};
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_vmap_get(e, m, &view));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_vmap_get(e, m, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_vmap_refresh(e, NULL, NULL));

    float q[VD] = {0}, out[VD];
    uint32_t ql = VBT + 1;
    kvh_attention_params p;
    assert_ok(kvh_attention_params_init(&p, sizeof(p)));
    p.struct_size = 12;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_attention_decode_vmap(e, &m, 1, q, out, &p));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_decode_vmap(e, NULL, 1, q, out, NULL));
    assert_kvh(KVH_ERR_RANGE, kvh_attention_decode_vmap(e, &none, 1, q, out, NULL)); /* no tokens */
    assert_kvh(KVH_ERR_RANGE, kvh_attention_prefill_vmap(e, &m, &ql, 1, q, out, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_attention_prefill_vmap(e, &m, NULL, 1, q, out, NULL));
    assert_ok(kvh_attention_decode_vmap(e, &m, 1, q, out, NULL));

    /* Appending makes the view stale; past its capacity a refresh fails. */
    view = tu_vmap_view(e, m);
    size_t grow = (size_t)(view.capacity_tokens - VBT + 1);
    int32_t *t = tu_alloc(sizeof(int32_t) * grow);
    tu_iota(t, grow, 5000);
    assert_ok(kvh_seq_append(e, s, t, grow));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_attention_decode_vmap(e, &m, 1, q, out, NULL));
    assert_kvh(KVH_ERR_RANGE, kvh_vmap_refresh(e, m, NULL));
    assert_ok(kvh_seq_free(e, s));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_vmap_refresh(e, m, NULL));
    assert_ok(kvh_vmap_release(e, m));
    kvh_vmap_view released = {.struct_size = sizeof(released)};
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_vmap_get(e, m, &released));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_vmap_release(e, m));
    assert_ok(kvh_vmap_release(e, none));
    assert_ok(kvh_vmap_release(e, NULL));
}

static void test_tolerance(void **state)
{
    (void)state;
    kvh_engine *e = open_small(4, 4);
    kvh_seq s = seq_of(e, 4, 1500, true), gone = stale_seq(e);
    kvh_block b = tu_seq_block(e, s, 0), stale_block;
    assert_ok(kvh_block_alloc(e, 0, &stale_block));
    assert_ok(kvh_block_release(e, stale_block));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_set_tolerance(e, s, 0, 4, KVH_TOLERANCE_MAX + 1));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_set_tolerance(e, s, 2, 3, 10));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_set_tolerance(e, gone, 0, 0, 10));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_block_set_tolerance(e, b, KVH_TOLERANCE_MAX + 1));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_set_tolerance(e, stale_block, 10));
    assert_kvh(KVH_ERR_UNSUPPORTED, kvh_seq_derive_tolerance(e, s, 0, 4, 0)); /* no kv_codec */

    kvh_config c = tu_cfg(1, 1, 32, BT, KVH_DTYPE_F32, 4, 4, 0);
    c.kv_codec = KVH_CODEC_INT8;
    e = tu_open_cfg(&c);
    kvh_seq cs = tu_seq_new(e, 0);
    int32_t t[BT] = {1, 2, 3, 4};
    assert_ok(kvh_seq_append(e, cs, t, BT));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_derive_tolerance(e, cs, 0, BT, -1.0f));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_derive_tolerance(e, cs, 0, BT, INFINITY));
    assert_kvh(KVH_ERR_RANGE, kvh_seq_derive_tolerance(e, cs, 0, BT + 1, 0));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_seq_derive_tolerance(e, stale_seq(e), 0, 0, 0));
    assert_ok(kvh_seq_derive_tolerance(e, cs, 0, BT, 0));
}

static void test_latency_histograms(void **state)
{
    (void)state;
    kvh_engine *e = open_small(4, 4);
    kvh_latency_histogram h = {.struct_size = 4};
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_latency_histogram_get(e, KVH_LATENCY_DISK_READ, &h));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_latency_histogram_get(e, KVH_LATENCY_DISK_READ, NULL));
    h.struct_size = sizeof(h);
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_latency_histogram_get(e, KVH_LATENCY_KIND_COUNT, &h));
    assert_ok(kvh_latency_histogram_get(e, KVH_LATENCY_DISK_READ, &h));
}

/* ------------------------------------------------------------------ */
/* The status common to every call: a NULL engine                      */
/* ------------------------------------------------------------------ */

static void test_null_engine(void **state)
{
    (void)state;
    kvh_seq s = {1};
    kvh_block b = {1};
    kvh_context x = {1};
    kvh_fence f = {1};
    kvh_pool pool = {1};
    kvh_seq out_seq;
    kvh_context out_ctx;
    int32_t toks[BT] = {0}, i32;
    uint32_t u32 = 1;
    uint64_t u64;
    size_t sz;
    void *ptr;
    float q[H * D], out[H * D];
    kvh_weight_region_params rp = region_of(toks, NULL, sizeof(toks));
    kvh_admission_params ap;
    assert_ok(kvh_admission_params_init(&ap, sizeof(ap)));
    kvh_seq_params sp;
    assert_ok(kvh_seq_params_init(&sp, sizeof(sp)));
    kvh_context_info ci = {.struct_size = sizeof(ci)};
    kvh_weight_stats ws = {.struct_size = sizeof(ws)};
    kvh_admission_info ai = {.struct_size = sizeof(ai)};
    kvh_vmap *m = NULL;
    kvh_attention_plan *plan = NULL;
    /* (test_bad_input covers the older sequence, block and pool calls.) */
    const kvh_status got[] = {
        kvh_seq_persist(NULL, s),
        kvh_seq_hint(NULL, s, 0, 0, 0),
        kvh_seq_hint_queued(NULL, s, 0, 0, 0, KVH_HINT_POSITION),
        kvh_hint_advance(NULL, 0, &u64),
        kvh_block_table(NULL, &s, 1, &i32, &i32, 1, &i32),
        kvh_context_create(NULL, NULL, &out_ctx),
        kvh_context_destroy(NULL, x),
        kvh_context_add_region(NULL, x, &rp, &u32),
        kvh_context_attach_seq(NULL, x, s),
        kvh_context_switch(NULL, (kvh_context){0}, x, &f),
        kvh_context_wait_layer(NULL, x, 0, 0),
        kvh_context_region_data(NULL, x, 0, 0, &ptr, &u64),
        kvh_context_region_pin(NULL, x, 0, 1),
        kvh_context_verify(NULL, x, &u64),
        kvh_context_info_get(NULL, x, &ci),
        kvh_weight_stats_get(NULL, &ws),
        kvh_admission_configure(NULL, &ap),
        kvh_seq_create_ex(NULL, &sp, &out_seq),
        kvh_admission_info_get(NULL, &ai),
        kvh_attention_plan_create(NULL, 0, &s, NULL, 1, NULL, &plan),
        kvh_attention_run(NULL, (const kvh_attention_plan *)&u32, q, out, NULL),
        kvh_attention_plan_destroy(NULL, (kvh_attention_plan *)&u32),
        kvh_seq_vmap(NULL, s, 0, 0, &m),
        kvh_vmap_refresh(NULL, (kvh_vmap *)&u32, &i32),
        kvh_vmap_get(NULL, (const kvh_vmap *)&u32, &(kvh_vmap_view){.struct_size = sizeof(kvh_vmap_view)}),
        kvh_vmap_release(NULL, (kvh_vmap *)&u32),
        kvh_attention_decode_vmap(NULL, &m, 1, q, out, NULL),
        kvh_attention_prefill_vmap(NULL, &m, &u32, 1, q, out, NULL),
        kvh_seq_set_tolerance(NULL, s, 0, 0, 0),
        kvh_block_set_tolerance(NULL, b, 0),
        kvh_seq_derive_tolerance(NULL, s, 0, 0, 0),
        kvh_pool_unregister(NULL, pool),
        kvh_prefix_lookup(NULL, toks, BT, &b, 1, &sz),
        kvh_seq_set_scope(NULL, s, 1, 1, 0),
        kvh_seq_get_scope(NULL, s, &u64, NULL, NULL),
        kvh_prefix_hash_scoped(NULL, 1, 0, toks, BT, &u64),
        kvh_prefix_lookup_scoped(NULL, 1, 1, 0, toks, BT, &b, 1, &sz),
        kvh_pool_offload_scoped(NULL, pool, 0, 1, 0, toks, BT, 0, &b),
        kvh_latency_histogram_get(NULL, KVH_LATENCY_ACQUIRE_STALL,
                                  &(kvh_latency_histogram){.struct_size = sizeof(kvh_latency_histogram)}),
    };
    for (size_t i = 0; i < sizeof(got) / sizeof(got[0]); i++)
        if (got[i] != KVH_ERR_INVALID_ARG)
            fail_msg("call %zu of the table returned %s, expected KVH_ERR_INVALID_ARG", i, kvh_status_name(got[i]));
    assert_null(m);
    assert_null(plan);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_call_has_a_status_list),
        cmocka_unit_test_setup_teardown(test_config_and_engine, setup, teardown),
        cmocka_unit_test_setup_teardown(test_disk_open_and_close, setup, teardown),
        cmocka_unit_test_setup_teardown(test_sequence_calls, setup, teardown),
        cmocka_unit_test_setup_teardown(test_sequences_out_of_room, setup, teardown),
        cmocka_unit_test_setup_teardown(test_persist, setup, teardown),
        cmocka_unit_test_setup_teardown(test_disk_reads, setup, teardown),
        cmocka_unit_test_setup_teardown(test_block_calls, setup, teardown),
        cmocka_unit_test_setup_teardown(test_migration_and_fences, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fence_timeout, setup, teardown),
        cmocka_unit_test_setup_teardown(test_prefix_and_pools, setup, teardown),
        cmocka_unit_test_setup_teardown(test_scopes, setup, teardown),
        cmocka_unit_test_setup_teardown(test_attention, setup, teardown),
        cmocka_unit_test_setup_teardown(test_contexts, setup, teardown),
        cmocka_unit_test_setup_teardown(test_admission, setup, teardown),
        cmocka_unit_test(test_codecs),
        cmocka_unit_test_setup_teardown(test_views, setup, teardown),
        cmocka_unit_test_setup_teardown(test_tolerance, setup, teardown),
        cmocka_unit_test_setup_teardown(test_latency_histograms, setup, teardown),
        cmocka_unit_test(test_null_engine),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
