/* Weight regions in the disk tier: modified and byte-sourced regions go to
 * disk when memory has no room for them, come back byte for byte, give
 * their disk slots back, and are checked against their chunk checksums on
 * the way back (a flipped byte on disk is KVH_ERR_CORRUPT, never served).
 * Without a disk tier, or when the disk write fails, the switch fails and
 * the region stays intact where it was. Run on unified memory and with
 * copies forced (the path of a discrete GPU). */
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test_util.h"
#include "context_test_util.h"
#include "core/context.h"
#include "core/disk_io.h"
#include "core/disk_format.h"

enum { L = 2, H = 2, D = 4, BT = 4 };
enum { FILE_REGION = 3000, BYTES_REGION = 1700, CHUNK = 1024 };

static bool copies_mode[2] = {false, true};
#define COPIES(state) (*(bool *)*(state))

static char tmpdir[512];

static const char *scratch(const char *name, char *buf, size_t len)
{
    const char *d = getenv("KVH_TEST_TMPDIR");
    if (!d || !d[0]) {
        snprintf(tmpdir, sizeof(tmpdir), "/tmp/kvh-spill-tests.%d", (int)getpid());
        mkdir(tmpdir, 0700);
        d = tmpdir;
    }
    snprintf(buf, len, "%s/%s", d, name);
    return buf;
}

static uint64_t slots_of(uint64_t bytes, uint64_t bb) { return (bytes + bb - 1) / bb; }
/* Region bytes a disk slot holds: its whole data area, the block's form
 * rounded up to whole pages. */
static uint64_t disk_piece_of(uint64_t bb) { return (bb + KVHI_DISK_ALIGN - 1) / KVHI_DISK_ALIGN * KVHI_DISK_ALIGN; }

/* kvh.h: each region is charged its size in whole 4096-byte pages, and a
 * context the slots of its regions' pages together in each memory tier. */
enum { PAGE = 4096 };
static uint64_t pages_of(uint64_t bytes) { return (bytes + PAGE - 1) / PAGE * PAGE; }

/* One region read from a file and one registered from bytes. */
typedef struct model {
    kvh_context ctx;
    uint8_t file[FILE_REGION];
    uint8_t bytes[BYTES_REGION];
} model;

static void make_model(kvh_engine *e, model *m, const char *name, uint64_t seed)
{
    char path[600];
    scratch(name, path, sizeof(path));
    tu_rng r = {seed};
    tu_fill(&r, m->file, sizeof(m->file));
    tu_fill(&r, m->bytes, sizeof(m->bytes));
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, m->file, sizeof(m->file)), sizeof(m->file));
    close(fd);
    kvh_context_params cp;
    assert_ok(kvh_context_params_init(&cp, sizeof(cp)));
    cp.chunk_bytes = CHUNK;
    cp.name = name;
    assert_ok(kvh_context_create(e, &cp, &m->ctx));
    kvh_weight_region_params rp;
    uint32_t idx;
    assert_ok(kvh_weight_region_params_init(&rp, sizeof(rp)));
    rp.path = path;
    rp.size = sizeof(m->file);
    assert_ok(kvh_context_add_region(e, m->ctx, &rp, &idx));
    assert_int_equal(idx, 0);
    assert_ok(kvh_weight_region_params_init(&rp, sizeof(rp)));
    rp.bytes = m->bytes;
    rp.size = sizeof(m->bytes);
    assert_ok(kvh_context_add_region(e, m->ctx, &rp, &idx));
    assert_int_equal(idx, 1);
}

/* Region 0 handed out writable and changed: it no longer matches its file. */
static void modify(kvh_engine *e, model *m)
{
    uint8_t *p;
    uint64_t n;
    assert_ok(kvh_context_region_data(e, m->ctx, 0, 1, (void **)&p, &n));
    for (uint64_t i = 0; i < n; i += 5)
        p[i] ^= 0xa5;
    memcpy(m->file, p, n); /* what it must hold from now on */
}

static void check_resident(kvh_engine *e, model *m)
{
    void *p;
    uint64_t n;
    assert_ok(kvh_context_region_data(e, m->ctx, 0, 0, &p, &n));
    assert_int_equal(n, sizeof(m->file));
    assert_memory_equal(p, m->file, n);
    assert_ok(kvh_context_region_data(e, m->ctx, 1, 0, &p, &n));
    assert_int_equal(n, sizeof(m->bytes));
    assert_memory_equal(p, m->bytes, n);
}

static uint64_t disk_bytes_of(kvh_engine *e, kvh_context c) { return ct_context_info(e, c).bytes_disk; }

/* Device: room for one model; host: room for neither model's regions. */
static kvh_engine *open_tight(bool copies, const char *disk_dir)
{
    uint64_t bb = tu_block_bytes_of(L, H, D, BT, KVH_DTYPE_F32);
    uint64_t model_slots = slots_of(pages_of(FILE_REGION) + pages_of(BYTES_REGION), bb);
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F32, model_slots + 1, 2, 0);
    if (disk_dir) {
        mkdir(disk_dir, 0700);
        c.disk_path = disk_dir;
        c.disk_bytes = 1ull << 20;
        c.disk_flags = KVH_DISK_RESET_ON_MISMATCH;
    }
    kvh_engine *e = tu_open_cfg(&c);
    assert_int_equal(kvhi_context_copy_on_unified(e, copies), 0);
    return e;
}

static void modified_and_bytes_regions_round_trip_through_disk(void **state)
{
    bool copies = COPIES(state);
    char dir[600];
    kvh_engine *e = open_tight(copies, scratch(copies ? "disk-rt-c" : "disk-rt-u", dir, sizeof(dir)));
    uint64_t bb = tu_block_bytes_of(L, H, D, BT, KVH_DTYPE_F32);
    model *a = tu_alloc(sizeof(model)), *b = tu_alloc(sizeof(model));
    make_model(e, a, "spill-a.bin", 1);
    make_model(e, b, "spill-b.bin", 2);
    /* The byte-sourced regions found no room in memory: on disk already. */
    assert_int_equal(disk_bytes_of(e, a->ctx), BYTES_REGION);
    assert_int_equal(ct_weight_stats(e).bytes_host_to_disk, 2 * BYTES_REGION);
    kvh_context none = {0};
    assert_ok(kvh_context_switch(e, none, a->ctx, NULL));
    check_resident(e, a);
    assert_int_equal(disk_bytes_of(e, a->ctx), 0);
    modify(e, a);
    for (int round = 0; round < 4; round++) {
        model *out = round % 2 ? b : a, *in = round % 2 ? a : b;
        kvh_weight_stats before = ct_weight_stats(e);
        assert_ok(kvh_context_switch(e, out->ctx, in->ctx, NULL));
        check_resident(e, in);
        kvh_weight_stats after = ct_weight_stats(e);
        /* The modified region and the byte-sourced one went to disk. */
        uint64_t out_dirty = BYTES_REGION + (out == a ? FILE_REGION : 0);
        assert_int_equal(disk_bytes_of(e, out->ctx), out_dirty);
        assert_int_equal(after.bytes_host_to_disk - before.bytes_host_to_disk, out_dirty);
        assert_int_equal(after.bytes_disk, out_dirty);
        uint64_t piece = disk_piece_of(bb);
        assert_int_equal(after.slots_disk,
                         slots_of(BYTES_REGION, piece) + (out == a ? slots_of(FILE_REGION, piece) : 0));
        assert_int_equal(tu_tier(e, KVH_TIER_DISK).used_blocks, after.slots_disk);
        uint64_t in_dirty = BYTES_REGION + (in == a ? FILE_REGION : 0);
        assert_int_equal(after.bytes_disk_to_host - before.bytes_disk_to_host, in_dirty);
        uint64_t checked;
        assert_ok(kvh_context_verify(e, in->ctx, &checked));
        assert_int_equal(checked, (FILE_REGION + CHUNK - 1) / CHUNK + (BYTES_REGION + CHUNK - 1) / CHUNK);
    }
    /* Destroying a context gives its disk slots back. */
    assert_ok(kvh_context_destroy(e, b->ctx));
    assert_ok(kvh_context_switch(e, a->ctx, none, NULL));
    assert_int_equal(ct_weight_stats(e).bytes_disk, FILE_REGION + BYTES_REGION);
    assert_ok(kvh_context_destroy(e, a->ctx));
    assert_int_equal(ct_weight_stats(e).slots_disk, 0);
    assert_int_equal(tu_tier(e, KVH_TIER_DISK).used_blocks, 0);
}

/* Flips one byte in every 4 KiB page of the store's slab files. */
static void damage_slabs(const char *dir)
{
    for (int s = 0;; s++) {
        char path[700];
        snprintf(path, sizeof(path), "%s/slab-%04d.kvh", dir, s);
        int fd = open(path, O_RDWR);
        if (fd < 0) {
            assert_true(s > 0);
            return;
        }
        struct stat sb;
        assert_int_equal(fstat(fd, &sb), 0);
        for (off_t off = 100; off < sb.st_size; off += 4096) {
            uint8_t x;
            assert_int_equal(pread(fd, &x, 1, off), 1);
            x ^= 0x10;
            assert_int_equal(pwrite(fd, &x, 1, off), 1);
        }
        assert_int_equal(fsync(fd), 0);
        close(fd);
    }
}

static void damaged_spill_is_corrupt_not_served(void **state)
{
    bool copies = COPIES(state);
    char dir[600];
    scratch(copies ? "disk-bad-c" : "disk-bad-u", dir, sizeof(dir));
    kvh_engine *e = open_tight(copies, dir);
    model *a = tu_alloc(sizeof(model)), *b = tu_alloc(sizeof(model));
    make_model(e, a, "bad-a.bin", 3);
    make_model(e, b, "bad-b.bin", 4);
    kvh_context none = {0};
    assert_ok(kvh_context_switch(e, none, a->ctx, NULL));
    assert_ok(kvh_context_switch(e, a->ctx, b->ctx, NULL));
    assert_int_equal(disk_bytes_of(e, a->ctx), BYTES_REGION);
    damage_slabs(dir);
    uint64_t failures = ct_weight_stats(e).crc_failures;
    kvh_fence f;
    assert_ok(kvh_context_switch(e, b->ctx, a->ctx, &f));
    assert_kvh(KVH_ERR_CORRUPT, kvh_fence_wait(e, f, UINT64_MAX));
    assert_ok(kvh_fence_free(e, f));
    assert_true(ct_weight_stats(e).crc_failures > failures);
    /* Never served: the damaged region is not resident. */
    void *p;
    assert_kvh(KVH_ERR_NOT_RESIDENT, kvh_context_region_data(e, a->ctx, 1, 0, &p, NULL));
}

/* Without a disk tier a modified region with no room anywhere stops the
 * switch: the error says why and the region is still resident, intact. */
static void no_disk_tier_keeps_region(void **state)
{
    bool copies = COPIES(state);
    uint64_t bb = tu_block_bytes_of(L, H, D, BT, KVH_DTYPE_F32);
    /* The device tier holds both models' byte regions (no disk for them)
     * and one file region. */
    kvh_config c =
        tu_cfg(L, H, D, BT, KVH_DTYPE_F32, slots_of(pages_of(FILE_REGION) + 2 * pages_of(BYTES_REGION), bb) + 1, 0, 0);
    kvh_engine *e = tu_open_cfg(&c);
    assert_int_equal(kvhi_context_copy_on_unified(e, copies), 0);
    model *a = tu_alloc(sizeof(model)), *b = tu_alloc(sizeof(model));
    make_model(e, a, "nd-a.bin", 5);
    make_model(e, b, "nd-b.bin", 6);
    kvh_context none = {0};
    assert_ok(kvh_context_switch(e, none, a->ctx, NULL));
    modify(e, a);
    kvh_fence f;
    assert_ok(kvh_context_switch(e, a->ctx, b->ctx, &f));
    kvh_status st = kvh_fence_wait(e, f, UINT64_MAX);
    assert_kvh(KVH_ERR_NOSPACE, st);
    assert_non_null(strstr(kvh_last_error(), "no room"));
    assert_ok(kvh_fence_free(e, f));
    void *p;
    uint64_t n;
    assert_ok(kvh_context_region_data(e, a->ctx, 0, 0, &p, &n));
    assert_memory_equal(p, a->file, n);
}

static int fail_writes(enum kvhi_disk_op op, void *user)
{
    (void)user;
    return op == KVHI_OP_WRITE ? -EIO : 0;
}

/* A disk write that fails leaves the region where it was, intact. */
static void failed_disk_write_keeps_region(void **state)
{
    bool copies = COPIES(state);
    char dir[600];
    kvh_engine *e = open_tight(copies, scratch(copies ? "disk-eio-c" : "disk-eio-u", dir, sizeof(dir)));
    model *a = tu_alloc(sizeof(model)), *b = tu_alloc(sizeof(model));
    make_model(e, a, "eio-a.bin", 7);
    make_model(e, b, "eio-b.bin", 8);
    kvh_context none = {0};
    assert_ok(kvh_context_switch(e, none, a->ctx, NULL));
    modify(e, a);
    kvhi_disk_set_fault_hook(fail_writes, NULL);
    kvh_fence f;
    assert_ok(kvh_context_switch(e, a->ctx, b->ctx, &f));
    kvh_status st = kvh_fence_wait(e, f, UINT64_MAX);
    kvhi_disk_set_fault_hook(NULL, NULL);
    assert_kvh(KVH_ERR_IO, st);
    assert_ok(kvh_fence_free(e, f));
    void *p;
    uint64_t n;
    assert_ok(kvh_context_region_data(e, a->ctx, 0, 0, &p, &n));
    assert_memory_equal(p, a->file, n);
    /* With the disk healthy again the same switch goes through. */
    assert_ok(kvh_context_switch(e, a->ctx, b->ctx, NULL));
    check_resident(e, b);
    assert_ok(kvh_context_switch(e, b->ctx, a->ctx, NULL));
    check_resident(e, a);
}

#define BOTH(fn)                                                                                                       \
    cmocka_unit_test_prestate_setup_teardown(fn, NULL, tu_teardown, &copies_mode[0]),                                  \
        cmocka_unit_test_prestate_setup_teardown(fn, NULL, tu_teardown, &copies_mode[1])

int main(void)
{
    const struct CMUnitTest tests[] = {
        BOTH(modified_and_bytes_regions_round_trip_through_disk),
        BOTH(damaged_spill_is_corrupt_not_served),
        BOTH(no_disk_tier_keeps_region),
        BOTH(failed_disk_write_keeps_region),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
