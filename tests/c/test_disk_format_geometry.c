/* Disk store: a store of another geometry or KV codec is refused or reset
 * as kvh.h documents, also when the files that name its geometry are gone.
 *
 * test_disk_roundtrip.c (test_mismatch_and_reset) and test_codec.c refuse
 * stores whose intact index header names another geometry or codec. Here
 * the headers are zeroed or the index files removed first, so that only
 * the slot headers are left to say which geometry wrote a block (the
 * geometry tag of disk_format.h), and the pairs are the hard ones: the
 * same block size with another dtype (f16 / bf16, raw or int8-encoded),
 * raw against encoded, and the two Q4 group sizes.
 *
 * For each pair (A writes, B opens) and each damage:
 *   - intact files: B's open is KVH_ERR_MISMATCH and leaves the store to A;
 *     with KVH_DISK_RESET_ON_MISMATCH it starts empty (no block used);
 *   - headers zeroed, index removed, both removed: B's open succeeds or is
 *     KVH_ERR_MISMATCH; if it succeeds, B matches none of A's blocks (they
 *     would be decoded as the wrong type); what B then persists B finds
 *     again, and A, opening after B, is refused (KVH_ERR_MISMATCH) or finds
 *     none of B's blocks.
 */
#include "disk_test_util.h"

typedef struct variant {
    const char *name;
    uint32_t dtype, codec;
    uint64_t salt;
} variant;

static const variant V[] = {
    {"f16", KVH_DTYPE_F16, KVH_CODEC_NONE, 0x5eed},         {"bf16", KVH_DTYPE_BF16, KVH_CODEC_NONE, 0x5eed},
    {"f16+int8", KVH_DTYPE_F16, KVH_CODEC_INT8, 0x5eed},    {"bf16+int8", KVH_DTYPE_BF16, KVH_CODEC_INT8, 0x5eed},
    {"f16+q4g32", KVH_DTYPE_F16, KVH_CODEC_Q4_G32, 0x5eed}, {"f16+q4g64", KVH_DTYPE_F16, KVH_CODEC_Q4_G64, 0x5eed},
    {"f16 salt 2", KVH_DTYPE_F16, KVH_CODEC_NONE, 0x5eee},
};

/* (A, B) pairs by index into V */
static const int PAIRS[][2] = {{0, 1}, {1, 0}, {0, 2}, {2, 0}, {2, 3}, {3, 2}, {4, 5}, {5, 4}, {0, 6}};

#define CHAINS 4
#define BLOCKS 2

static kvh_config cfg_of(const variant *v, const char *dir)
{
    dt_geo g = {1, 1, 64, 16, v->dtype};
    kvh_config c = dt_cfg(g, dir, 4, 4, 32, 0);
    c.kv_codec = v->codec;
    c.model_salt = v->salt;
    return c;
}

static dt_geo geo_of(const variant *v) { return (dt_geo){1, 1, 64, 16, v->dtype}; }

/* Builds, persists and frees `CHAINS` chains of streams base + i, and
 * spills them so the disk holds them. */
static void persist_chains(kvh_engine *e, const variant *v, uint64_t base)
{
    for (int i = 0; i < CHAINS; i++) {
        kvh_seq s;
        dt_assert_ok(dt_build(e, geo_of(v), dt_plain(base + (uint64_t)i), BLOCKS * 16, 0, &s));
        dt_assert_ok(kvh_seq_persist(e, s));
        dt_assert_ok(kvh_seq_free(e, s));
    }
}

/* Tokens of chains base + [0, CHAINS) matched by e (a codec makes bytes
 * inexact, so only the match is counted here: a block of another geometry
 * must not be matched at all). */
static size_t matched(kvh_engine *e, uint64_t base)
{
    size_t total = 0;
    for (int i = 0; i < CHAINS; i++) {
        kvh_seq s;
        size_t m = 0;
        dt_assert_ok(dt_match(e, dt_plain(base + (uint64_t)i), BLOCKS * 16, &s, &m));
        kvh_seq_free(e, s);
        total += m;
    }
    return total;
}

enum damage { D_NONE, D_HEADERS_ZEROED, D_INDEX_REMOVED, D_BOTH_REMOVED, D_COUNT };
static const char *const damage_names[D_COUNT] = {"intact", "both headers zeroed", "index removed, journal zeroed",
                                                  "index and journal removed"};

static void zero_header(const char *dir, const char *name)
{
    char p[PATH_MAX];
    int fd = open(dt_path(p, sizeof(p), dir, name), O_WRONLY);
    assert_true(fd >= 0);
    uint8_t z[4096] = {0};
    assert_int_equal(pwrite(fd, z, sizeof(z), 0), (ssize_t)sizeof(z));
    close(fd);
}

static void apply_damage(const char *dir, enum damage d)
{
    char p[PATH_MAX];
    switch (d) {
    case D_NONE:
        break;
    case D_HEADERS_ZEROED:
        zero_header(dir, "index");
        zero_header(dir, "journal");
        break;
    case D_INDEX_REMOVED:
        assert_int_equal(unlink(dt_path(p, sizeof(p), dir, "index")), 0);
        zero_header(dir, "journal");
        break;
    case D_BOTH_REMOVED:
        assert_int_equal(unlink(dt_path(p, sizeof(p), dir, "index")), 0);
        assert_int_equal(unlink(dt_path(p, sizeof(p), dir, "journal")), 0);
        break;
    default:
        break;
    }
}

static void test_other_geometry_never_served(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("geometry", dir, sizeof(dir));
    const uint64_t A_BASE = 0x6e0a00, B_BASE = 0x6e0b00;
    int refused = 0, opened_empty = 0, cases = 0;
    for (size_t pi = 0; pi < sizeof(PAIRS) / sizeof(PAIRS[0]); pi++) {
        const variant *a = &V[PAIRS[pi][0]], *b = &V[PAIRS[pi][1]];
        for (int d = 0; d < D_COUNT; d++) {
            char what[160];
            snprintf(what, sizeof(what), "%s store opened as %s, %s", a->name, b->name, damage_names[d]);
            dt_rmrf(dir);
            kvh_config ca = cfg_of(a, dir), cb = cfg_of(b, dir);
            kvh_engine *e = dt_open_a(&ca);
            persist_chains(e, a, A_BASE);
            /* A itself finds its chains: the control */
            assert_int_equal(matched(e, A_BASE), CHAINS * BLOCKS * 16);
            dt_assert_ok(dt_close(dt_untrack(e)));
            apply_damage(dir, (enum damage)d);

            kvh_engine *x = NULL;
            kvh_status st = kvh_engine_open(&cb, &x);
            if (d == D_NONE) {
                if (st != KVH_ERR_MISMATCH) {
                    kvh_engine_close(x);
                    fail_msg("%s: open returned %s (%s), expected KVH_ERR_MISMATCH", what, kvh_status_name(st),
                             kvh_last_error());
                }
                /* refused without a change: A still finds everything */
                e = dt_open_a(&ca);
                if (matched(e, A_BASE) != CHAINS * BLOCKS * 16)
                    fail_msg("%s: the refused open changed the store", what);
                dt_assert_ok(dt_close(dt_untrack(e)));
                /* reset: B starts empty */
                kvh_config reset = cb;
                reset.disk_flags = KVH_DISK_RESET_ON_MISMATCH;
                x = dt_open_a(&reset);
                if (dt_tier(x, KVH_TIER_DISK).used_blocks != 0 || matched(x, A_BASE) != 0)
                    fail_msg("%s: KVH_DISK_RESET_ON_MISMATCH kept %" PRIu64 " blocks", what,
                             dt_tier(x, KVH_TIER_DISK).used_blocks);
                dt_assert_ok(dt_close(dt_untrack(x)));
                refused++;
                cases++;
                continue;
            }
            if (st == KVH_ERR_MISMATCH) {
                refused++;
                cases++;
                continue;
            }
            if (st != KVH_OK)
                fail_msg("%s: open returned %s (%s)", what, kvh_status_name(st), kvh_last_error());
            dt_track(x);
            size_t m = matched(x, A_BASE);
            if (m != 0)
                fail_msg("%s: %zu tokens of the other geometry's blocks were matched", what, m);
            if (dt_tier(x, KVH_TIER_DISK).used_blocks != 0)
                fail_msg("%s: %" PRIu64 " disk slots of the other geometry are held as blocks", what,
                         dt_tier(x, KVH_TIER_DISK).used_blocks);
            opened_empty++;
            persist_chains(x, b, B_BASE);
            dt_assert_ok(dt_close(dt_untrack(x)));
            /* the store is B's now */
            x = dt_open_a(&cb);
            if (matched(x, B_BASE) != CHAINS * BLOCKS * 16)
                fail_msg("%s: B does not find what it persisted", what);
            dt_assert_ok(dt_close(dt_untrack(x)));
            kvh_engine *y = NULL;
            st = kvh_engine_open(&ca, &y);
            if (st == KVH_OK) {
                dt_track(y);
                if (matched(y, B_BASE) != 0)
                    fail_msg("%s: A, reopening, matched B's blocks", what);
                dt_assert_ok(dt_close(dt_untrack(y)));
            } else if (st != KVH_ERR_MISMATCH)
                fail_msg("%s: A reopening B's store: %s (%s)", what, kvh_status_name(st), kvh_last_error());
            cases++;
        }
    }
    printf("geometry: %d cases: %d refused (KVH_ERR_MISMATCH), %d opened without any block of the other geometry\n",
           cases, refused, opened_empty);
    dt_rmrf(dir);
}

/* A refused open makes no file: an engine whose size adds a slab file
 * to a store of another geometry leaves the directory as it found it,
 * and the store's own engine, opening with that size, makes the file. */
static void test_refused_open_makes_no_slab_file(void **state)
{
    (void)state;
    char dir[512], p0[600], p1[600];
    dt_scratch("geometry-noslab", dir, sizeof(dir));
    dt_path(p0, sizeof(p0), dir, "slab-0000.kvh");
    dt_path(p1, sizeof(p1), dir, "slab-0001.kvh");
    const dt_geo A = {1, 1, 64, 16, KVH_DTYPE_F16}, B = {1, 1, 64, 16, KVH_DTYPE_BF16};
    const uint64_t per_slab = (1ull << 30) / dt_slot_bytes(A); /* slots a slab file holds */
    kvh_config small = dt_cfg(A, dir, 8, 8, 64, 0);
    dt_assert_ok(dt_close(dt_open_a(&small)));
    struct stat before, after;
    assert_int_equal(stat(p0, &before), 0);
    kvh_config other = dt_cfg(B, dir, 8, 8, per_slab + 64, 0);
    kvh_engine *x = NULL;
    assert_int_equal(kvh_engine_open(&other, &x), KVH_ERR_MISMATCH);
    assert_int_equal(stat(p0, &after), 0);
    assert_int_equal(after.st_size, before.st_size);
    if (access(p1, F_OK) == 0)
        fail_msg("the refused open made %s", p1);
    kvh_config grown = dt_cfg(A, dir, 8, 8, per_slab + 64, 0);
    dt_assert_ok(dt_close(dt_open_a(&grown)));
    assert_int_equal(stat(p1, &after), 0);
    assert_int_equal((uint64_t)after.st_size, 64 * dt_slot_bytes(A));
    dt_rmrf(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_other_geometry_never_served, dt_teardown),
        cmocka_unit_test_teardown(test_refused_open_makes_no_slab_file, dt_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
