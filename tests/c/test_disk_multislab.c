/* Disk tier: a store of more than one slab file.
 *
 * Slab files hold at most 1 GiB of slots each (slab-0000.kvh,
 * slab-0001.kvh, ...). Filling a whole slab to reach the boundary would
 * take 1 GiB of writes, so the test builds a small store, then moves its
 * blocks to the slots around the boundary itself (re-encoding the slot
 * headers and index records with the library's own format functions):
 * four blocks at the end of slab 0, four at the start of slab 1. The
 * engine (whose batched reads must split at the file boundary) and
 * `kvh-store verify` must then find all eight, byte-identical; cutting
 * slab 1 loses exactly its four.
 *
 * The store preallocates a 1 GiB slab (fallocate: no data is written), and
 * is deleted at the end.
 */
#include "disk_test_util.h"

#include "core/disk_format.h"

static const dt_geo G = {1, 1, 64, 16, KVH_DTYPE_F16}; /* block = 4096 bytes, slot = 8192 */
#define SLOT 8192ull
#define PER ((1ull << 30) / SLOT) /* slots a slab */
#define NB 8

static void test_blocks_across_the_slab_boundary(void **state)
{
    (void)state;
    char dir[512], p0[600], p1[600], ix[600];
    dt_scratch("multislab", dir, sizeof(dir));
    dt_path(p0, sizeof(p0), dir, "slab-0000.kvh");
    dt_path(p1, sizeof(p1), dir, "slab-0001.kvh");
    dt_path(ix, sizeof(ix), dir, "index");
    kvh_config c = dt_cfg(G, dir, 8, 32, PER + 64, 2); /* two slabs: PER + 64 slots */
    c.migration_threads = 2;
    kvh_engine *e = dt_open_a(&c);
    dt_content ct = dt_plain(4711);
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, ct, NB * G.bt, 0, &s));
    dt_assert_ok(kvh_seq_persist(e, s));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
    struct stat st;
    assert_int_equal(stat(p1, &st), 0);
    assert_int_equal((uint64_t)st.st_size, 64 * SLOT);

    /* Move every block: slot j -> PER - NB/2 + j, i.e. the last NB/2 slots
     * of slab 0 and the first NB/2 of slab 1. */
    size_t ilen = 0;
    uint8_t *index = dt_read_file(ix, &ilen);
    assert_non_null(index);
    size_t rb = kvhi_index_rec_bytes(G.bt), nrec = (ilen - 4096) / rb;
    assert_int_equal(nrec, NB);
    int f0 = open(p0, O_RDWR | O_CLOEXEC), f1 = open(p1, O_RDWR | O_CLOEXEC);
    assert_true(f0 >= 0 && f1 >= 0);
    uint8_t *slot = malloc(SLOT), *zero = calloc(1, SLOT);
    uint64_t moved_to[NB];
    for (size_t i = 0; i < nrec; i++) {
        int32_t tk[16];
        kvhi_index_rec r = {.tokens = tk};
        assert_int_equal(kvhi_index_rec_decode(index + 4096 + i * rb, &r, G.bt), 0);
        assert_true(r.slot < NB);
        uint64_t to = PER - NB / 2 + r.slot;
        moved_to[r.slot] = to;
        assert_int_equal(pread(f0, slot, SLOT, (off_t)(r.slot * SLOT)), (ssize_t)SLOT);
        /* header fields (disk_format.c): 16 store_id, 40 hash, 48 parent,
         * 12 n_tokens, 64 data_crc, 68 tokens */
        kvhi_slot_meta m = {.store_id = dt_get64(slot + 16),
                            .slot = to,
                            .offset = (to % PER) * SLOT,
                            .hash = dt_get64(slot + 40),
                            .parent = dt_get64(slot + 48),
                            .n_tokens = dt_get32(slot + 12),
                            .data_crc = dt_get32(slot + 64),
                            .tokens = tk};
        assert_int_equal(m.hash, r.hash);
        kvhi_slot_header_encode(slot, &m, 4096);
        int fd = to < PER ? f0 : f1;
        assert_int_equal(pwrite(fd, slot, SLOT, (off_t)((to % PER) * SLOT)), (ssize_t)SLOT);
        assert_int_equal(pwrite(f0, zero, SLOT, (off_t)(r.slot * SLOT)), (ssize_t)SLOT);
        r.slot = to;
        kvhi_index_rec_encode(index + 4096 + i * rb, &r, G.bt);
    }
    close(f0);
    close(f1);
    free(slot);
    free(zero);
    assert_int_equal(dt_write_file(ix, index, ilen), 0);
    free(index);

    /* The engine finds all of them, reading both files in one batch. */
    e = dt_open_a(&c);
    size_t m = 0;
    char msg[256] = "";
    if (dt_match_verify(e, G, ct, NB * G.bt, &m, msg, sizeof(msg)) != KVH_OK)
        fail_msg("%s", msg);
    assert_int_equal(m, NB * G.bt);
    assert_int_equal(dt_stats(e).corrupt_blocks, 0);
    /* ... and can write them back there: spill and read again */
    dt_assert_ok(dt_match(e, ct, NB * G.bt, &s, &m));
    dt_assert_ok(kvh_seq_migrate(e, s, 0, NB * G.bt, KVH_TIER_DISK, NULL));
    for (int b = 0; b < NB; b++) {
        kvh_block_info bi = dt_binfo(e, s, (uint64_t)b);
        assert_int_equal(bi.tier, KVH_TIER_DISK);
        assert_int_equal(bi.slot, moved_to[b]); /* back to its clean copy */
    }
    if (dt_verify(e, s, G, ct, 0, NB * G.bt, msg, sizeof(msg)) != KVH_OK)
        fail_msg("after a spill: %s", msg);
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));

    /* kvh-store sees the same */
    char tool[PATH_MAX];
    static char out[8192];
    if (!dt_store_tool(tool, sizeof(tool)))
        fail_msg("kvh-store not found (build the tools, or set KVH_STORE_BIN)");
    int rc = dt_run_tool(tool, "verify", dir, NULL, out, sizeof(out));
    if (rc != 0 || !strstr(out, "8 blocks checked, 0 bad"))
        fail_msg("kvh-store verify exited %d:\n%s", rc, out);

    /* Cut slab 1: its four blocks are lost, slab 0's are not. */
    assert_int_equal(truncate(p1, 0), 0);
    rc = dt_run_tool(tool, "verify", dir, NULL, out, sizeof(out));
    if (rc != 1 || !strstr(out, "4 bad"))
        fail_msg("slab 1 cut: kvh-store verify exited %d:\n%s", rc, out);
    e = dt_open_a(&c);
    if (dt_match_verify(e, G, ct, NB * G.bt, &m, msg, sizeof(msg)) != KVH_OK)
        fail_msg("%s", msg);
    assert_int_equal(m, NB / 2 * G.bt);
    assert_int_equal(dt_stats(e).corrupt_blocks, NB / 2);
    dt_assert_ok(dt_close(e));
    dt_rmrf(dir); /* give the 1 GiB back */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_blocks_across_the_slab_boundary, dt_teardown),
    };
    return cmocka_run_group_tests_name("disk_multislab", tests, NULL, NULL);
}
