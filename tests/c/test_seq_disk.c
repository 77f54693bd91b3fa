/* Sequence edits of blocks that have disk data: truncate, copy-on-write
 * of a partially shared block and re-appending, while the block lives on
 * disk or keeps a clean copy there. Every slot header names its block's
 * hash and tokens, so an edit that changes them must leave the engine's
 * record and the disk in agreement: no read may report KVH_ERR_CORRUPT
 * where nothing on disk was damaged. */
#include "disk_test_util.h"
#include "test_util.h"

static const dt_geo GEO = {2, 2, 8, 4, KVH_DTYPE_F16};

static char msg[256];

#define verify_a(e, s, c, pos, n)                                                                                      \
    do {                                                                                                               \
        msg[0] = 0;                                                                                                    \
        kvh_status vst_ = dt_verify(e, s, GEO, c, pos, n, msg, sizeof(msg));                                           \
        if (vst_ != KVH_OK)                                                                                            \
            fail_msg("%s:%d: verify [%u, +%u): %s (%s)", __FILE__, __LINE__, (unsigned)(pos), (unsigned)(n),           \
                     kvh_status_name(vst_), msg);                                                                      \
    } while (0)

static kvh_engine *open_engine(const char *name, uint64_t dev, uint64_t host, uint32_t threads)
{
    char dir[PATH_MAX];
    dt_scratch(name, dir, sizeof(dir));
    kvh_config c = dt_cfg(GEO, dir, dev, host, 64, threads);
    return dt_open_a(&c);
}

/* The reported case: B duplicates A's two published blocks, goes to disk,
 * then loses half of its second block. */
static void truncate_duplicate_on_disk(uint32_t threads)
{
    kvh_engine *e = open_engine(threads ? "dup_mt" : "dup", 8, 8, threads);
    dt_content c = dt_plain(11);
    kvh_seq a, b;
    dt_assert_ok(dt_build(e, GEO, c, 8, 0, &a));
    dt_assert_ok(dt_build(e, GEO, c, 8, 0, &b));
    tu_seq_migrate_wait(e, b, 0, 8, KVH_TIER_DISK);
    assert_int_equal(dt_binfo(e, b, 1).tier, KVH_TIER_DISK);
    uint64_t corrupt = dt_stats(e).corrupt_blocks;
    dt_assert_ok(kvh_seq_truncate(e, b, 6));
    verify_a(e, b, c, 0, 6);
    /* Regrow past the cut with the same tokens and K/V. */
    dt_assert_ok(dt_extend(e, b, GEO, c, 6, 6));
    verify_a(e, b, c, 0, 12);
    tu_seq_migrate_wait(e, b, 0, 12, KVH_TIER_DISK);
    verify_a(e, b, c, 0, 12);
    assert_int_equal(dt_stats(e).corrupt_blocks, corrupt);
    verify_a(e, a, c, 0, 8);
    dt_assert_ok(kvh_seq_free(e, a));
    dt_assert_ok(kvh_seq_free(e, b));
    dt_assert_ok(dt_close(e));
}

static void test_truncate_block_on_disk(void **state)
{
    (void)state;
    truncate_duplicate_on_disk(0);
    truncate_duplicate_on_disk(2);
}

/* A private block with a clean disk copy (persist, then promoted back):
 * the copy names the old hash and must not be served after a cut. */
static void test_truncate_block_with_clean_copy(void **state)
{
    (void)state;
    kvh_engine *e = open_engine("copy", 8, 8, 1);
    dt_content c = dt_plain(12);
    kvh_seq s;
    dt_assert_ok(dt_build(e, GEO, c, 8, 0, &s));
    dt_assert_ok(kvh_seq_persist(e, s));
    tu_seq_migrate_wait(e, s, 0, 8, KVH_TIER_DISK);
    tu_seq_migrate_wait(e, s, 0, 8, KVH_TIER_HOST);
    dt_assert_ok(kvh_seq_truncate(e, s, 5));
    verify_a(e, s, c, 0, 5);
    /* Other tokens after the cut: the old copy's bytes would be wrong. */
    dt_content d = {12, 5, 99};
    dt_assert_ok(dt_extend(e, s, GEO, d, 5, 3));
    tu_seq_migrate_wait(e, s, 0, 8, KVH_TIER_DISK);
    verify_a(e, s, d, 0, 8);
    assert_int_equal(dt_stats(e).corrupt_blocks, 0);
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
}

/* A fork shares a block that sits on disk; the fork's cut copies it
 * (CoW) and the parent keeps reading its own bytes. */
static void test_truncate_shared_block_on_disk(void **state)
{
    (void)state;
    kvh_engine *e = open_engine("cow", 8, 8, 1);
    dt_content c = dt_plain(13);
    kvh_seq s, f;
    dt_assert_ok(dt_build(e, GEO, c, 10, 0, &s));
    dt_assert_ok(kvh_seq_fork(e, s, 0, &f));
    tu_seq_migrate_wait(e, s, 0, 10, KVH_TIER_DISK);
    dt_assert_ok(kvh_seq_truncate(e, f, 7));
    verify_a(e, f, c, 0, 7);
    verify_a(e, s, c, 0, 10);
    /* And the partial last block: cut it further while it is on disk. */
    tu_seq_migrate_wait(e, s, 0, 10, KVH_TIER_DISK);
    dt_assert_ok(kvh_seq_truncate(e, s, 9));
    verify_a(e, s, c, 0, 9);
    dt_assert_ok(dt_extend(e, s, GEO, c, 9, 3));
    tu_seq_migrate_wait(e, s, 0, 12, KVH_TIER_DISK);
    verify_a(e, s, c, 0, 12);
    assert_int_equal(dt_stats(e).corrupt_blocks, 0);
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(kvh_seq_free(e, f));
    dt_assert_ok(dt_close(e));
}

/* A write whose range spans more blocks than the memory tiers hold in all
 * cannot bring them in together: it goes a block at a time, each block
 * in memory while it is written, and every byte reads back. */
static void test_write_longer_than_memory(void **state)
{
    (void)state;
    for (uint32_t threads = 0; threads <= 2; threads += 2) {
        kvh_engine *e = open_engine("long_write", 1, 1, threads);
        dt_content c = dt_plain(3);
        kvh_seq s;
        dt_assert_ok(dt_build(e, GEO, c, 5 * GEO.bt, 0, &s)); /* 5 blocks, 2 in memory */
        verify_a(e, s, c, 0, 5 * GEO.bt);
        dt_assert_ok(kvh_seq_free(e, s));
        dt_assert_ok(dt_close(e));
    }
}

/* Random appends, truncates, forks and moves on tiers small enough that
 * blocks keep visiting the disk, checked against the content model after
 * every step: no CORRUPT, no wrong byte. */
static void test_random_edits_on_small_tiers(void **state)
{
    (void)state;
    enum { SEQS = 6, STEPS = 1500, MAXLEN = 24 };
    kvh_engine *e = open_engine("random", 6, 6, 2);
    dt_rng r = {dt_seed(7)};
    kvh_seq seq[SEQS] = {{0}};
    dt_content con[SEQS];
    uint64_t len[SEQS] = {0};
    uint64_t next_stream = 100;
    for (int i = 0; i < SEQS; i++) {
        dt_assert_ok(kvh_seq_create(e, 0, &seq[i]));
        con[i] = dt_plain(i % 2 ? 1 : 2); /* pairs of equal content: duplicates */
    }
    for (int step = 0; step < STEPS; step++) {
        int i = (int)dt_below(&r, SEQS);
        kvh_status st = KVH_OK;
        switch (dt_below(&r, 6)) {
        case 0:
        case 1: {
            size_t n = 1 + dt_below(&r, 6);
            if (len[i] + n > MAXLEN)
                break;
            st = dt_extend(e, seq[i], GEO, con[i], len[i], n);
            if (st == KVH_OK)
                len[i] += n;
            break;
        }
        case 2: {
            uint64_t to = dt_below(&r, len[i] + 1);
            st = kvh_seq_truncate(e, seq[i], to);
            if (st == KVH_OK) {
                /* Later tokens may come from a fresh stream (one split
                 * at most: only while [0, to) is all one stream). */
                bool one_stream = con[i].split == 0 || con[i].split >= to;
                if (one_stream && dt_below(&r, 2))
                    con[i] = to ? (dt_content){dt_stream_at(con[i], 0), to, next_stream++} : dt_plain(next_stream++);
                len[i] = to;
            }
            break;
        }
        case 3: {
            int j = (int)dt_below(&r, SEQS);
            if (j == i)
                break;
            kvh_seq child;
            st = kvh_seq_fork(e, seq[i], 0, &child);
            if (st == KVH_OK) {
                dt_assert_ok(kvh_seq_free(e, seq[j]));
                seq[j] = child;
                con[j] = con[i];
                len[j] = len[i];
            }
            break;
        }
        default:
            if (len[i])
                st = kvh_seq_migrate(e, seq[i], 0, len[i], (uint32_t)dt_below(&r, 3), NULL);
            break;
        }
        /* Nothing is held or pinned, and the tiers together hold every
         * block: each step must succeed and read back exactly. */
        if (st != KVH_OK)
            fail_msg("step %d: %s: %s", step, kvh_status_name(st), kvh_last_error());
        msg[0] = 0;
        st = dt_verify(e, seq[i], GEO, con[i], 0, len[i], msg, sizeof(msg));
        if (st != KVH_OK)
            fail_msg("step %d, seq %d, len %u: %s (%s)", step, i, (unsigned)len[i], kvh_status_name(st), msg);
    }
    assert_int_equal(dt_stats(e).corrupt_blocks, 0);
    for (int i = 0; i < SEQS; i++)
        dt_assert_ok(kvh_seq_free(e, seq[i]));
    dt_assert_ok(dt_close(e));
}

/* *a: one full block of c, rewritten after a fork (*f) so that a holds
 * an unpublished copy and the published original is f's. */
static void make_rewritten_copy(kvh_engine *e, dt_content c, kvh_seq *a, kvh_seq *f)
{
    dt_assert_ok(dt_build(e, GEO, c, GEO.bt, 0, a));
    dt_assert_ok(kvh_seq_fork(e, *a, 0, f));
    uint8_t k[64], v[64];
    dt_assert_ok(kvh_seq_read_kv(e, *a, 0, 0, 1, k, v));
    dt_assert_ok(kvh_seq_write_kv(e, *a, 0, 0, 1, k, v)); /* to a copy: the original is f's */
    assert_false(dt_binfo(e, *a, 0).published);
}

/* *a and *f as make_rewritten_copy leaves them, *a persisted: the
 * published original that persist made durable in a's place (a handle
 * of the caller's), checked to be held by f, a and the handle. */
static kvh_block persist_rewritten_copy(kvh_engine *e, dt_content c, kvh_seq *a, kvh_seq *f)
{
    make_rewritten_copy(e, c, a, f);
    dt_assert_ok(kvh_seq_persist(e, *a));
    int32_t tok[4];
    dt_assert_ok(kvh_seq_tokens(e, *a, 0, GEO.bt, tok));
    kvh_block twin;
    size_t nb = 0;
    dt_assert_ok(kvh_prefix_lookup(e, tok, GEO.bt, &twin, 1, &nb));
    assert_int_equal(nb, 1);
    kvh_block_info bi = {.struct_size = sizeof(bi)};
    dt_assert_ok(kvh_block_info_get(e, twin, &bi));
    assert_int_equal(bi.refs, 3); /* f, a's persist, this handle */
    return twin;
}

/* kvh_seq_persist of a sequence whose block is a rewritten copy makes the
 * published original durable, and the sequence keeps it (a reference)
 * while it holds its own block of that prefix: through growth of its
 * block table, until it is truncated below it. */
static void test_persist_keeps_the_published_twin(void **state)
{
    (void)state;
    kvh_engine *e = open_engine("twin", 8, 8, 0);
    dt_content c = dt_plain(31);
    kvh_seq a, f;
    kvh_block twin = persist_rewritten_copy(e, c, &a, &f);
    kvh_block_info bi = {.struct_size = sizeof(bi)};
    dt_assert_ok(dt_extend(e, a, GEO, c, GEO.bt, 15 * GEO.bt)); /* its block table grows */
    dt_assert_ok(kvh_seq_free(e, f));
    dt_assert_ok(kvh_block_info_get(e, twin, &bi));
    assert_int_equal(bi.refs, 2);
    dt_assert_ok(kvh_seq_truncate(e, a, GEO.bt + 1)); /* still holds block 0 */
    dt_assert_ok(kvh_block_info_get(e, twin, &bi));
    assert_int_equal(bi.refs, 2);
    dt_assert_ok(kvh_seq_truncate(e, a, GEO.bt - 1));
    dt_assert_ok(kvh_block_info_get(e, twin, &bi));
    assert_int_equal(bi.refs, 1);
    dt_assert_ok(kvh_block_release(e, twin));
    dt_assert_ok(kvh_seq_free(e, a));
}

/* A fork of a sequence that keeps a published twin keeps it too, while
 * it holds its own block of that prefix: the branch's prefix stays
 * durable once the parent and the twin's other holders are gone. */
static void test_fork_keeps_the_published_twin(void **state)
{
    (void)state;
    kvh_engine *e = open_engine("twin_fork", 8, 8, 0);
    kvh_seq a, f, g;
    kvh_block twin = persist_rewritten_copy(e, dt_plain(33), &a, &f);
    kvh_block_info bi = {.struct_size = sizeof(bi)};
    dt_assert_ok(kvh_seq_fork(e, a, 0, &g));
    dt_assert_ok(kvh_block_info_get(e, twin, &bi));
    assert_int_equal(bi.refs, 4); /* and g's */
    dt_assert_ok(kvh_seq_free(e, f));
    dt_assert_ok(kvh_seq_free(e, a));
    dt_assert_ok(kvh_block_info_get(e, twin, &bi));
    assert_int_equal(bi.refs, 2); /* g's, this handle */
    dt_assert_ok(kvh_seq_truncate(e, g, GEO.bt - 1));
    dt_assert_ok(kvh_block_info_get(e, twin, &bi));
    assert_int_equal(bi.refs, 1);
    dt_assert_ok(kvh_block_release(e, twin));
    dt_assert_ok(kvh_seq_free(e, g));
}

/* The same through kvh_blocks_persist: a block named by its handle whose
 * published twin was made durable in its place keeps the twin while it
 * lives (persisting it again takes no second reference), and lets it go
 * when it is freed. */
static void test_blocks_persist_keeps_the_published_twin(void **state)
{
    (void)state;
    kvh_engine *e = open_engine("twin_blocks", 8, 8, 0);
    kvh_seq a, f;
    make_rewritten_copy(e, dt_plain(32), &a, &f);
    kvh_block own;
    dt_assert_ok(kvh_seq_blocks(e, a, 0, 1, &own));
    dt_assert_ok(kvh_blocks_persist(e, &own, 1, NULL));
    int32_t tok[4];
    dt_assert_ok(kvh_seq_tokens(e, a, 0, GEO.bt, tok));
    kvh_block twin;
    size_t nb = 0;
    dt_assert_ok(kvh_prefix_lookup(e, tok, GEO.bt, &twin, 1, &nb));
    assert_int_equal(nb, 1);
    assert_true(twin.id != own.id);
    kvh_block_info bi = {.struct_size = sizeof(bi)};
    dt_assert_ok(kvh_block_info_get(e, twin, &bi));
    assert_int_equal(bi.refs, 3); /* f, a's block, this handle */
    dt_assert_ok(kvh_blocks_persist(e, &own, 1, NULL));
    dt_assert_ok(kvh_block_info_get(e, twin, &bi));
    assert_int_equal(bi.refs, 3);
    dt_assert_ok(kvh_seq_free(e, f));
    dt_assert_ok(kvh_block_info_get(e, twin, &bi));
    assert_int_equal(bi.refs, 2);
    dt_assert_ok(kvh_seq_free(e, a)); /* a's block goes, and its hold on the twin */
    dt_assert_ok(kvh_block_info_get(e, twin, &bi));
    assert_int_equal(bi.refs, 1);
    dt_assert_ok(kvh_block_release(e, twin));
}

/* Many blocks keeping twins, freed in a shuffled order: each free lets
 * go of its own twin and no other (the table of kept twins grows and
 * shrinks through deletions in any order). */
static void test_many_kept_twins_freed_in_any_order(void **state)
{
    (void)state;
    enum { N = 40 };
    kvh_engine *e = open_engine("twins_many", 2 * N + 8, 8, 0);
    kvh_seq a[N], f[N];
    kvh_block twin[N];
    for (int i = 0; i < N; i++) {
        make_rewritten_copy(e, dt_plain(100 + (uint64_t)i), &a[i], &f[i]);
        kvh_block own;
        dt_assert_ok(kvh_seq_blocks(e, a[i], 0, 1, &own));
        dt_assert_ok(kvh_blocks_persist(e, &own, 1, NULL));
        dt_assert_ok(kvh_seq_free(e, f[i]));
        int32_t tok[4];
        dt_assert_ok(kvh_seq_tokens(e, a[i], 0, GEO.bt, tok));
        size_t nb = 0;
        dt_assert_ok(kvh_prefix_lookup(e, tok, GEO.bt, &twin[i], 1, &nb));
        assert_int_equal(nb, 1);
    }
    int order[N];
    for (int i = 0; i < N; i++)
        order[i] = i;
    dt_rng r = {dt_seed(0x7717)};
    for (int i = N - 1; i > 0; i--) {
        int j = (int)dt_below(&r, (uint64_t)(i + 1)), t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    bool freed[N] = {false};
    for (int n = 0; n < N; n++) {
        dt_assert_ok(kvh_seq_free(e, a[order[n]]));
        freed[order[n]] = true;
        for (int i = 0; i < N; i++) {
            kvh_block_info bi = {.struct_size = sizeof(bi)};
            dt_assert_ok(kvh_block_info_get(e, twin[i], &bi));
            if (bi.refs != (freed[i] ? 1u : 2u))
                fail_msg("after %d frees, twin %d has %u references (freed: %d)", n + 1, i, bi.refs, freed[i]);
        }
    }
    for (int i = 0; i < N; i++)
        dt_assert_ok(kvh_block_release(e, twin[i]));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_truncate_block_on_disk, dt_teardown),
        cmocka_unit_test_teardown(test_persist_keeps_the_published_twin, dt_teardown),
        cmocka_unit_test_teardown(test_fork_keeps_the_published_twin, dt_teardown),
        cmocka_unit_test_teardown(test_blocks_persist_keeps_the_published_twin, dt_teardown),
        cmocka_unit_test_teardown(test_many_kept_twins_freed_in_any_order, dt_teardown),
        cmocka_unit_test_teardown(test_truncate_block_with_clean_copy, dt_teardown),
        cmocka_unit_test_teardown(test_truncate_shared_block_on_disk, dt_teardown),
        cmocka_unit_test_teardown(test_write_longer_than_memory, dt_teardown),
        cmocka_unit_test_teardown(test_random_edits_on_small_tiers, dt_teardown),
    };
    return cmocka_run_group_tests_name("seq_disk", tests, NULL, NULL);
}
