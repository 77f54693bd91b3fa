/* Disk tier: round trips and recovery.
 *
 *   - every dtype (and a geometry whose block is not a multiple of 4096,
 *     so the slot has padding, and one of 1 token a block) through
 *     device -> host -> disk -> host -> disk -> device, byte for byte, with
 *     O_DIRECT and with KVH_DISK_BUFFERED, then persisted and reopened;
 *   - persisted blocks found byte-identical by a NEW process, after a
 *     clean close (snapshot) and without one (journal replay, twice);
 *   - O_DIRECT is really used where it works, and not with
 *     KVH_DISK_BUFFERED (the slab's open flags, from /proc/self/fdinfo);
 *   - the buffered fallback where the filesystem refuses O_DIRECT (tmpfs
 *     before Linux 6.6; else a ramfs mounted for the test, skipped with the
 *     reason where mount is refused), with its one-line warning through
 *     the log callback;
 *   - geometry / model_salt mismatch and KVH_DISK_RESET_ON_MISMATCH;
 *   - a second engine on the same disk_path gets KVH_ERR_BUSY naming the
 *     first one's pid (same process and another process);
 *   - disk_bytes changed between runs; persist's argument rules.
 */
#include "disk_test_util.h"

#define open_a(c) dt_open_a(c)

static void assert_verified(kvh_engine *e, kvh_seq s, dt_geo g, dt_content c, uint64_t pos, size_t n)
{
    char msg[256] = "";
    kvh_status st = dt_verify(e, s, g, c, pos, n, msg, sizeof(msg));
    if (st != KVH_OK)
        fail_msg("verify [%" PRIu64 ", +%zu): %s: %s", pos, n, kvh_status_name(st), msg);
}

static void assert_tiers(kvh_engine *e, kvh_seq s, uint64_t n_blocks, uint32_t tier)
{
    for (uint64_t i = 0; i < n_blocks; i++) {
        kvh_block_info bi = dt_binfo(e, s, i);
        if (bi.tier != tier)
            fail_msg("block %" PRIu64 " is in tier %u, expected %u", i, bi.tier, tier);
    }
}

/* ------------------------------------------------------------------ */
/* Round trips                                                         */
/* ------------------------------------------------------------------ */

static void roundtrip_one(dt_geo g, uint32_t disk_flags, const char *tag)
{
    char dir[512];
    dt_scratch(tag, dir, sizeof(dir));
    kvh_config c = dt_cfg(g, dir, 4, 4, 64, 2);
    c.disk_flags = disk_flags;
    kvh_engine *e = open_a(&c);
    const uint64_t full = 3;
    const size_t n = full * g.bt + g.bt / 2; /* 3 full blocks and a partial one */
    const uint64_t nb = full + (g.bt / 2 ? 1 : 0);
    dt_content ct = dt_plain(1000 + g.dtype);
    kvh_seq s;
    dt_assert_ok(dt_build(e, g, ct, n, 0, &s));
    assert_tiers(e, s, nb, KVH_TIER_DEVICE);
    assert_verified(e, s, g, ct, 0, n);

    /* device -> host */
    dt_assert_ok(kvh_seq_migrate(e, s, 0, n, KVH_TIER_HOST, NULL));
    assert_tiers(e, s, nb, KVH_TIER_HOST);
    assert_verified(e, s, g, ct, 0, n);

    /* host -> disk (full blocks carry their hash, the partial one not) */
    dt_assert_ok(kvh_seq_migrate(e, s, 0, n, KVH_TIER_DISK, NULL));
    assert_tiers(e, s, nb, KVH_TIER_DISK);

    /* disk -> memory by reading (verified on the way) */
    assert_verified(e, s, g, ct, 0, n);
    for (uint64_t i = 0; i < nb; i++)
        assert_true(dt_binfo(e, s, i).tier != KVH_TIER_DISK);

    /* to disk again, then straight up to the device tier by acquire */
    dt_assert_ok(kvh_seq_migrate(e, s, 0, n, KVH_TIER_DISK, NULL));
    assert_tiers(e, s, nb, KVH_TIER_DISK);
    dt_assert_ok(kvh_seq_acquire(e, s, 0, n, NULL));
    assert_tiers(e, s, nb, KVH_TIER_DEVICE);
    assert_verified(e, s, g, ct, 0, n);
    dt_assert_ok(kvh_seq_release(e, s, 0, n));

    /* persist (only full blocks), then a disk round trip of the persisted
     * blocks (the clean copy is reused) */
    dt_assert_ok(kvh_seq_persist(e, s));
    dt_assert_ok(kvh_seq_migrate(e, s, 0, n, KVH_TIER_DISK, NULL));
    assert_tiers(e, s, nb, KVH_TIER_DISK);
    assert_verified(e, s, g, ct, 0, n);
    assert_int_equal(dt_stats(e).corrupt_blocks, 0);
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));

    /* A new engine on the same store finds the three full blocks. */
    e = open_a(&c);
    size_t m = 0;
    char msg[256] = "";
    kvh_status st = dt_match_verify(e, g, ct, n, &m, msg, sizeof(msg));
    if (st != KVH_OK)
        fail_msg("%s after reopen: %s", tag, msg);
    assert_int_equal(m, full * g.bt);
    assert_int_equal(dt_stats(e).corrupt_blocks, 0);
    dt_assert_ok(dt_close(e));
}

static void test_roundtrip_every_dtype_every_tier(void **state)
{
    (void)state;
    static const uint32_t dtypes[] = {KVH_DTYPE_F32, KVH_DTYPE_F16, KVH_DTYPE_BF16};
    static const char *names[] = {"f32", "f16", "bf16"};
    for (int d = 0; d < 3; d++)
        for (int buffered = 0; buffered < 2; buffered++) {
            char tag[64];
            /* block = 4096 (f16/bf16) or 8192 (f32) bytes: no padding */
            dt_geo g1 = {1, 1, 64, 16, dtypes[d]};
            snprintf(tag, sizeof(tag), "rt-%s-aligned-%s", names[d], buffered ? "buffered" : "direct");
            roundtrip_one(g1, buffered ? KVH_DISK_BUFFERED : 0, tag);
            /* 2 layers x 3 heads x 20 dim x 32 tokens: padded slot data */
            dt_geo g2 = {2, 3, 20, 32, dtypes[d]};
            snprintf(tag, sizeof(tag), "rt-%s-padded-%s", names[d], buffered ? "buffered" : "direct");
            roundtrip_one(g2, buffered ? KVH_DISK_BUFFERED : 0, tag);
            /* one token a block */
            dt_geo g3 = {1, 2, 8, 1, dtypes[d]};
            snprintf(tag, sizeof(tag), "rt-%s-bt1-%s", names[d], buffered ? "buffered" : "direct");
            roundtrip_one(g3, buffered ? KVH_DISK_BUFFERED : 0, tag);
        }
}

/* One block at a time, large blocks: the data is read straight into its
 * slot in several pieces checksummed as they arrive. Every byte must come
 * back, and a bit flipped in the last piece of one block must be caught
 * (that block is a miss, the others are served). */
static void single_block_restores(dt_geo g, const char *tag)
{
    char dir[512];
    dt_scratch(tag, dir, sizeof(dir));
    kvh_config c = dt_cfg(g, dir, 8, 8, 16, 2);
    kvh_engine *e = open_a(&c);
    const size_t n = 4 * (size_t)g.bt;
    dt_content ct = dt_plain(4242);
    kvh_seq s;
    dt_assert_ok(dt_build(e, g, ct, n, 0, &s));
    dt_assert_ok(kvh_seq_migrate(e, s, 0, n, KVH_TIER_DISK, NULL));
    assert_tiers(e, s, 4, KVH_TIER_DISK);
    kvh_block b[4];
    dt_assert_ok(kvh_seq_blocks(e, s, 0, 4, b));
    for (int i = 0; i < 4; i++)
        dt_assert_ok(kvh_migrate(e, &b[i], 1, i % 2 ? KVH_TIER_DEVICE : KVH_TIER_HOST, NULL));
    assert_verified(e, s, g, ct, 0, n);

    dt_assert_ok(kvh_seq_migrate(e, s, 0, n, KVH_TIER_DISK, NULL));
    uint32_t slot = dt_binfo(e, s, 2).slot;
    char path[600];
    uint64_t last_byte = (uint64_t)slot * dt_slot_bytes(g) + 4096 + dt_block_bytes(g) - 1;
    assert_int_equal(dt_flip_bit(dt_path(path, sizeof(path), dir, "slab-0000.kvh"), last_byte, 3), 0);
    for (int i = 0; i < 4; i++) {
        kvh_status st = kvh_migrate(e, &b[i], 1, KVH_TIER_HOST, NULL);
        assert_int_equal(st, i == 2 ? KVH_ERR_CORRUPT : KVH_OK);
    }
    assert_int_equal(dt_stats(e).corrupt_blocks, 1);
    assert_verified(e, s, g, ct, 0, 2 * (size_t)g.bt);
    assert_verified(e, s, g, ct, 3 * (size_t)g.bt, g.bt);
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
}

static void test_single_block_restores_in_pieces(void **state)
{
    (void)state;
    single_block_restores((dt_geo){4, 8, 64, 32, KVH_DTYPE_F16}, "rt-pieces-256k");   /* 256 KiB blocks */
    single_block_restores((dt_geo){8, 8, 128, 32, KVH_DTYPE_F16}, "rt-pieces-1m");    /* 1 MiB blocks */
    single_block_restores((dt_geo){2, 3, 20, 32, KVH_DTYPE_F32}, "rt-pieces-padded"); /* staged path */
}

/* ------------------------------------------------------------------ */
/* Recovery in a new process                                           */
/* ------------------------------------------------------------------ */

#define RC_STREAMS 12
static const dt_geo rc_geo = {2, 2, 32, 16, KVH_DTYPE_BF16}; /* 8192-byte blocks */

static size_t rc_len(int i) { return (size_t)(1 + i % 6) * rc_geo.bt + (size_t)(i % 3) * 5; }
static dt_content rc_content(int i, int gen) { return dt_plain(5000 + (uint64_t)gen * 100 + (uint64_t)i); }

typedef struct rc_arg {
    const char *dir;
    int gen_first, gen_last; /* generations of streams to check / write */
    bool close_engine;
} rc_arg;

/* Builds and persists the streams of generation gen; some are spilled to
 * disk before the persist, some after. Returns 0 or a failure code. */
static int rc_write(kvh_engine *e, int gen)
{
    for (int i = 0; i < RC_STREAMS; i++) {
        kvh_seq s;
        size_t n = rc_len(i);
        if (dt_build(e, rc_geo, rc_content(i, gen), n, 0, &s) != KVH_OK)
            return 10;
        if (i % 3 == 1 && kvh_seq_migrate(e, s, 0, n, KVH_TIER_DISK, NULL) != KVH_OK)
            return 11;
        if (kvh_seq_persist(e, s) != KVH_OK)
            return 12;
        if (i % 3 == 2 && kvh_seq_migrate(e, s, 0, n, KVH_TIER_DISK, NULL) != KVH_OK)
            return 13;
        if (kvh_seq_free(e, s) != KVH_OK)
            return 14;
    }
    return 0;
}

/* Every persisted full block of generations [first, last] is found and
 * byte-identical. Returns 0 or a failure code (printed). */
static int rc_check(kvh_engine *e, int first, int last)
{
    for (int gen = first; gen <= last; gen++)
        for (int i = 0; i < RC_STREAMS; i++) {
            size_t n = rc_len(i), m = 0;
            char msg[256] = "";
            kvh_status st = dt_match_verify(e, rc_geo, rc_content(i, gen), n, &m, msg, sizeof(msg));
            if (st != KVH_OK) {
                fprintf(stderr, "gen %d stream %d: %s\n", gen, i, msg);
                return 20;
            }
            if (m != n / rc_geo.bt * rc_geo.bt) {
                fprintf(stderr, "gen %d stream %d: matched %zu of %zu persisted tokens\n", gen, i, m,
                        n / rc_geo.bt * rc_geo.bt);
                return 21;
            }
        }
    kvh_stats s = dt_stats(e);
    if (s.corrupt_blocks) {
        fprintf(stderr, "corrupt_blocks = %" PRIu64 "\n", s.corrupt_blocks);
        return 22;
    }
    return 0;
}

static kvh_config rc_cfg(const char *dir) { return dt_cfg(rc_geo, dir, 4, 8, 256, 2); }

/* Child: opens the store, checks generations [gen_first, gen_last - 1]
 * (if any), writes generation gen_last (when >= 0), then closes or just
 * _exit()s. */
static int rc_child(void *p)
{
    rc_arg *a = p;
    kvh_config c = rc_cfg(a->dir);
    kvh_engine *e = NULL;
    if (kvh_engine_open(&c, &e) != KVH_OK) {
        fprintf(stderr, "child open: %s\n", kvh_last_error());
        return 30;
    }
    int rc = a->gen_first <= a->gen_last - 1 ? rc_check(e, a->gen_first, a->gen_last - 1) : 0;
    if (rc == 0 && a->gen_last >= 0)
        rc = rc_write(e, a->gen_last);
    if (rc == 0 && a->close_engine && kvh_engine_close(e) != KVH_OK)
        rc = 31;
    return rc; /* without close: the process ends with the engine open */
}

/* Child: only checks generations [gen_first, gen_last]. */
static int rc_check_child(void *p)
{
    rc_arg *a = p;
    kvh_config c = rc_cfg(a->dir);
    kvh_engine *e = NULL;
    if (kvh_engine_open(&c, &e) != KVH_OK) {
        fprintf(stderr, "child open: %s\n", kvh_last_error());
        return 30;
    }
    int rc = rc_check(e, a->gen_first, a->gen_last);
    kvh_engine_close(e);
    return rc;
}

static void test_recovery_new_process_after_close(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("recovery-close", dir, sizeof(dir));
    kvh_config c = rc_cfg(dir);
    kvh_engine *e = open_a(&c);
    assert_int_equal(rc_write(e, 0), 0);
    dt_assert_ok(dt_close(e)); /* snapshot */
    rc_arg a = {dir, 0, 0, true};
    assert_int_equal(dt_in_child(rc_check_child, &a), 0);
    /* and once more after the child's own clean close */
    assert_int_equal(dt_in_child(rc_check_child, &a), 0);
}

static void test_recovery_new_process_without_close(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("recovery-noclose", dir, sizeof(dir));
    /* child 1: fresh store, writes generation 0, ends without close */
    rc_arg a = {dir, 0, 0, false};
    assert_int_equal(dt_in_child(rc_child, &a), 0);
    /* child 2: journal replay finds generation 0; writes generation 1,
     * ends without close again */
    a = (rc_arg){dir, 0, 1, false};
    assert_int_equal(dt_in_child(rc_child, &a), 0);
    /* this process: both generations, from the journal */
    kvh_config c = rc_cfg(dir);
    kvh_engine *e = open_a(&c);
    assert_int_equal(rc_check(e, 0, 1), 0);
    dt_assert_ok(dt_close(e));
    /* and from the snapshot that close wrote */
    a = (rc_arg){dir, 0, 1, true};
    assert_int_equal(dt_in_child(rc_check_child, &a), 0);
}

/* ------------------------------------------------------------------ */
/* O_DIRECT and the buffered fallback                                  */
/* ------------------------------------------------------------------ */

/* Round trip through the disk of an engine on dir; returns whether its
 * slab file is open with O_DIRECT (1) or not (0). */
static int fallback_roundtrip(const char *dir, uint32_t flags, dt_log *log)
{
    dt_geo g = {1, 2, 32, 16, KVH_DTYPE_F16};
    kvh_config c = dt_cfg(g, dir, 2, 2, 32, 2);
    c.disk_flags = flags;
    dt_log_attach(&c, log);
    kvh_engine *e = open_a(&c);
    int direct = dt_slab_direct(dir);
    assert_true(direct >= 0);
    dt_content ct = dt_plain(777);
    size_t n = 5 * g.bt + 3;
    kvh_seq s;
    dt_assert_ok(dt_build(e, g, ct, n, 0, &s));
    dt_assert_ok(kvh_seq_migrate(e, s, 0, n, KVH_TIER_DISK, NULL));
    assert_tiers(e, s, 6, KVH_TIER_DISK);
    assert_verified(e, s, g, ct, 0, n);
    dt_assert_ok(kvh_seq_persist(e, s));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
    e = open_a(&c);
    size_t m = 0;
    char msg[256] = "";
    if (dt_match_verify(e, g, ct, n, &m, msg, sizeof(msg)) != KVH_OK)
        fail_msg("after reopen: %s", msg);
    assert_int_equal(m, 5 * g.bt);
    dt_assert_ok(dt_close(e));
    return direct;
}

static bool odirect_refused(const char *dir)
{
    char p[600];
    snprintf(p, sizeof(p), "%s/.odirect-probe", dir);
    int fd = open(p, O_RDWR | O_CREAT | O_DIRECT | O_CLOEXEC, 0644);
    bool refused = fd < 0 && errno == EINVAL;
    if (fd >= 0)
        close(fd);
    unlink(p);
    return refused;
}

static void test_direct_and_buffered_paths(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("io-direct", dir, sizeof(dir));
    dt_log log;
    dt_log_init(&log);
    int direct = fallback_roundtrip(dir, 0, &log);
    if (!odirect_refused(dir)) {
        /* O_DIRECT works here: it is used, without a fallback warning. */
        assert_int_equal(direct, 1);
        assert_int_equal(dt_log_count(&log, KVH_LOG_WARN, "O_DIRECT", NULL), 0);
    } else
        print_message("note: %s refuses O_DIRECT; the direct path is not exercised here\n", dir);

    dt_scratch("io-buffered", dir, sizeof(dir));
    dt_log_init(&log);
    assert_int_equal(fallback_roundtrip(dir, KVH_DISK_BUFFERED, &log), 0);
    /* Asked for, not a fallback: nothing to warn about. */
    assert_int_equal(dt_log_count(&log, KVH_LOG_WARN, "refuses O_DIRECT", NULL), 0);
}

/* Where the filesystem refuses O_DIRECT the store still works, buffered,
 * and says so once through the log callback. tmpfs refused O_DIRECT
 * before Linux 6.6; where it accepts it, a ramfs mount (which refuses it
 * on every kernel) is used instead. */
static char ramfs_mnt[512];

static int teardown_ramfs(void **state)
{
    dt_teardown(state);
    if (ramfs_mnt[0]) {
        umount(ramfs_mnt);
        ramfs_mnt[0] = '\0';
    }
    return 0;
}

static void test_odirect_refused_falls_back(void **state)
{
    (void)state;
    char dir[600], *mnt = ramfs_mnt;
    mnt[0] = '\0';
    const char *where = NULL;
    if (access("/dev/shm", W_OK) == 0 && odirect_refused("/dev/shm")) {
        snprintf(dir, sizeof(dir), "/dev/shm/kvh-disk-fallback.%ld", (long)getpid());
        dt_rmrf(dir);
        mkdir(dir, 0755);
        where = "tmpfs /dev/shm";
    } else {
        dt_scratch_mountpoint("ramfs", mnt, sizeof(ramfs_mnt));
        if (mount("ramfs", mnt, "ramfs", 0, "") == 0) {
            snprintf(dir, sizeof(dir), "%s/store", mnt);
            mkdir(dir, 0755);
            where = "ramfs";
            if (!odirect_refused(dir)) {
                umount(mnt);
                mnt[0] = '\0';
                where = NULL;
            }
        } else {
            print_message("note: mount -t ramfs refused (%s)\n", strerror(errno));
            mnt[0] = '\0';
        }
    }
    if (!where) {
        print_message("SKIP: no filesystem here refuses O_DIRECT (/dev/shm accepts it, ramfs cannot be "
                      "mounted): the real fallback is not exercised\n");
        skip();
    }
    print_message("O_DIRECT refused on %s: checking the buffered fallback\n", where);
    dt_log log;
    dt_log_init(&log);
    assert_int_equal(fallback_roundtrip(dir, 0, &log), 0); /* buffered */
    /* Two opens, one warning line each. */
    int warned = dt_log_count(&log, KVH_LOG_WARN, "O_DIRECT", "buffered", NULL);
    if (warned != 2) {
        for (int i = 0; i < log.n; i++)
            print_error("log[%d] level %d: %s\n", i, log.level[i], log.line[i]);
        fail_msg("expected one O_DIRECT fallback warning per open (2), got %d", warned);
    }
    dt_rmrf(dir);
    if (mnt[0])
        umount(mnt);
    mnt[0] = '\0';
}

/* ------------------------------------------------------------------ */
/* Mismatch and reset                                                  */
/* ------------------------------------------------------------------ */

static void test_mismatch_and_reset(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("mismatch", dir, sizeof(dir));
    dt_geo g = {2, 2, 32, 16, KVH_DTYPE_F16};
    kvh_config base = dt_cfg(g, dir, 4, 4, 32, 2);
    kvh_engine *e = open_a(&base);
    dt_content ct = dt_plain(4242);
    size_t n = 3 * g.bt;
    kvh_seq s;
    dt_assert_ok(dt_build(e, g, ct, n, 0, &s));
    dt_assert_ok(kvh_seq_persist(e, s));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));

    struct {
        const char *field;
        dt_geo g;
        uint64_t salt;
        uint32_t codec;
    } variants[] = {
        {"num_layers", {3, 2, 32, 16, KVH_DTYPE_F16}, 0x5eed, KVH_CODEC_NONE},
        {"num_kv_heads", {2, 1, 32, 16, KVH_DTYPE_F16}, 0x5eed, KVH_CODEC_NONE},
        {"head_dim", {2, 2, 64, 16, KVH_DTYPE_F16}, 0x5eed, KVH_CODEC_NONE},
        {"block_tokens", {2, 2, 32, 32, KVH_DTYPE_F16}, 0x5eed, KVH_CODEC_NONE},
        {"dtype", {2, 2, 32, 16, KVH_DTYPE_BF16}, 0x5eed, KVH_CODEC_NONE}, /* same size, other type */
        {"model_salt", {2, 2, 32, 16, KVH_DTYPE_F16}, 0x5eee, KVH_CODEC_NONE},
        {"kv_codec", {2, 2, 32, 16, KVH_DTYPE_F16}, 0x5eed, KVH_CODEC_INT8}, /* not "dtype": it did not change */
    };
    /* A refused open grew the slab to its own geometry's size first. */
    char slab_path[600];
    size_t slab_len = 0;
    uint8_t *slab = dt_read_file(dt_path(slab_path, sizeof(slab_path), dir, "slab-0000.kvh"), &slab_len);
    assert_non_null(slab);
    for (size_t i = 0; i < sizeof(variants) / sizeof(variants[0]); i++) {
        kvh_config c = dt_cfg(variants[i].g, dir, 4, 4, 32, 2);
        c.model_salt = variants[i].salt;
        c.kv_codec = variants[i].codec;
        kvh_engine *x = NULL;
        kvh_status st = kvh_engine_open(&c, &x);
        if (st != KVH_ERR_MISMATCH) {
            kvh_engine_close(x);
            fail_msg("%s differs: open returned %s (%s), expected KVH_ERR_MISMATCH", variants[i].field,
                     kvh_status_name(st), kvh_last_error());
        }
        assert_null(x);
        if (!strstr(kvh_last_error(), variants[i].field))
            fail_msg("%s differs: last error does not name it: \"%s\"", variants[i].field, kvh_last_error());
        size_t now_len = 0;
        uint8_t *now = dt_read_file(slab_path, &now_len);
        bool same = now && now_len == slab_len && memcmp(now, slab, slab_len) == 0;
        free(now);
        if (!same)
            fail_msg("%s differs: the refused open changed the slab (%zu bytes, was %zu)", variants[i].field, now_len,
                     slab_len);
    }
    free(slab);

    /* The refused opens left the store alone. */
    e = open_a(&base);
    size_t m = 0;
    char msg[256] = "";
    if (dt_match_verify(e, g, ct, n, &m, msg, sizeof(msg)) != KVH_OK)
        fail_msg("%s", msg);
    assert_int_equal(m, n);
    dt_assert_ok(dt_close(e));

    /* RESET_ON_MISMATCH: another salt starts the store empty (with a
     * warning), and the store now belongs to the new salt. */
    kvh_config other = base;
    other.model_salt = 0xabcdef;
    other.disk_flags = KVH_DISK_RESET_ON_MISMATCH;
    dt_log log;
    dt_log_init(&log);
    dt_log_attach(&other, &log);
    e = open_a(&other);
    assert_true(dt_log_count(&log, KVH_LOG_WARN, "empty", NULL) >= 1);
    kvh_tier_info ti;
    memset(&ti, 0, sizeof(ti));
    ti.struct_size = sizeof(ti);
    dt_assert_ok(kvh_tier_info_get(e, KVH_TIER_DISK, &ti));
    assert_int_equal(ti.used_blocks, 0);
    if (dt_match_verify(e, g, ct, n, &m, msg, sizeof(msg)) != KVH_OK)
        fail_msg("%s", msg);
    assert_int_equal(m, 0);
    dt_content ct2 = dt_plain(4343);
    dt_assert_ok(dt_build(e, g, ct2, n, 0, &s));
    dt_assert_ok(kvh_seq_persist(e, s));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));

    kvh_engine *x = NULL;
    dt_assert_kvh(KVH_ERR_MISMATCH, kvh_engine_open(&base, &x));
    other.disk_flags = 0;
    e = open_a(&other);
    if (dt_match_verify(e, g, ct2, n, &m, msg, sizeof(msg)) != KVH_OK)
        fail_msg("%s", msg);
    assert_int_equal(m, n);
    dt_assert_ok(dt_close(e));

    /* RESET_ON_MISMATCH with a matching store keeps it. */
    other.disk_flags = KVH_DISK_RESET_ON_MISMATCH;
    e = open_a(&other);
    if (dt_match_verify(e, g, ct2, n, &m, msg, sizeof(msg)) != KVH_OK)
        fail_msg("%s", msg);
    assert_int_equal(m, n);
    dt_assert_ok(dt_close(e));
}

/* ------------------------------------------------------------------ */
/* One engine per store                                                */
/* ------------------------------------------------------------------ */

typedef struct busy_arg {
    const char *dir;
    long owner;
} busy_arg;

static int busy_child(void *p)
{
    busy_arg *a = p;
    dt_geo g = {1, 1, 64, 16, KVH_DTYPE_F16};
    kvh_config c = dt_cfg(g, a->dir, 2, 2, 8, 2);
    c.migration_threads = 0;
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&c, &e);
    if (st != KVH_ERR_BUSY) {
        fprintf(stderr, "child: open returned %s, expected KVH_ERR_BUSY\n", kvh_status_name(st));
        kvh_engine_close(e);
        return 40;
    }
    char pid[32];
    snprintf(pid, sizeof(pid), "%ld", a->owner);
    if (!strstr(kvh_last_error(), pid)) {
        fprintf(stderr, "child: last error \"%s\" does not name pid %s\n", kvh_last_error(), pid);
        return 41;
    }
    return 0;
}

static void test_second_engine_busy(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("busy", dir, sizeof(dir));
    dt_geo g = {1, 1, 64, 16, KVH_DTYPE_F16};
    kvh_config c = dt_cfg(g, dir, 2, 2, 8, 2);
    c.migration_threads = 0; /* no threads while fork()ing below */
    kvh_engine *e = open_a(&c);
    char pid[32];
    snprintf(pid, sizeof(pid), "%ld", (long)getpid());

    /* same process, second engine */
    kvh_engine *x = NULL;
    dt_assert_kvh(KVH_ERR_BUSY, kvh_engine_open(&c, &x));
    assert_null(x);
    if (!strstr(kvh_last_error(), pid))
        fail_msg("last error \"%s\" does not name pid %s", kvh_last_error(), pid);

    /* another process */
    busy_arg a = {dir, (long)getpid()};
    assert_int_equal(dt_in_child(busy_child, &a), 0);

    /* LOCK deleted under the owner (a cleaner of old files): a second
     * engine would make and lock a new one, and still gets BUSY. */
    char lock[600];
    snprintf(lock, sizeof(lock), "%s/LOCK", dir);
    assert_int_equal(unlink(lock), 0);
    dt_assert_kvh(KVH_ERR_BUSY, kvh_engine_open(&c, &x));
    assert_null(x);

    /* the failed opens did not disturb the owner */
    dt_content ct = dt_plain(99);
    kvh_seq s;
    dt_assert_ok(dt_build(e, g, ct, 2 * g.bt, 0, &s));
    dt_assert_ok(kvh_seq_persist(e, s));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));

    /* released by close */
    e = open_a(&c);
    size_t m = 0;
    char msg[256] = "";
    if (dt_match_verify(e, g, ct, 2 * g.bt, &m, msg, sizeof(msg)) != KVH_OK)
        fail_msg("%s", msg);
    assert_int_equal(m, 2 * g.bt);
    dt_assert_ok(dt_close(e));
}

/* ------------------------------------------------------------------ */
/* disk_bytes changed between runs                                     */
/* ------------------------------------------------------------------ */

/* disk_bytes is not part of the store's identity: a smaller budget keeps
 * what fits (blocks in slots beyond it are forgotten), a larger one keeps
 * everything; in no case is anything wrong served. */
static void test_resized_store(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("resize", dir, sizeof(dir));
    dt_geo g = {1, 1, 64, 16, KVH_DTYPE_F16};
    kvh_config c = dt_cfg(g, dir, 4, 4, 48, 2);
    kvh_engine *e = open_a(&c);
    for (int i = 0; i < 10; i++) {
        kvh_seq s;
        dt_assert_ok(dt_build(e, g, dt_plain(8000 + (uint64_t)i), 4 * g.bt, 0, &s));
        dt_assert_ok(kvh_seq_persist(e, s));
        dt_assert_ok(kvh_seq_free(e, s));
    }
    dt_assert_ok(dt_close(e));
    uint64_t sizes[] = {64, 12, 48, 200};
    for (size_t k = 0; k < sizeof(sizes) / sizeof(sizes[0]); k++) {
        kvh_config r = dt_cfg(g, dir, 4, 4, sizes[k], 2);
        e = open_a(&r);
        size_t found = 0;
        for (int i = 0; i < 10; i++) {
            size_t m = 0;
            char msg[256] = "";
            if (dt_match_verify(e, g, dt_plain(8000 + (uint64_t)i), 4 * g.bt, &m, msg, sizeof(msg)) != KVH_OK)
                fail_msg("%" PRIu64 " slots: sequence %d: %s", sizes[k], i, msg);
            found += m / g.bt;
        }
        assert_int_equal(dt_stats(e).corrupt_blocks, 0);
        if (k == 0)
            assert_int_equal(found, 40); /* grown: all of it */
        else
            assert_true(found <= sizes[k]);
        dt_assert_ok(dt_close(e));
    }
    /* a budget that holds no slot at all is refused */
    kvh_config tiny = dt_cfg(g, dir, 4, 4, 1, 2);
    tiny.disk_bytes = dt_slot_bytes(g) - 1;
    kvh_engine *x = NULL;
    dt_assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(&tiny, &x));
}

/* ------------------------------------------------------------------ */
/* Persist argument rules                                              */
/* ------------------------------------------------------------------ */

static void test_persist_rules(void **state)
{
    (void)state;
    dt_geo g = {1, 1, 64, 16, KVH_DTYPE_F16};
    /* no disk tier */
    kvh_config c = dt_cfg(g, NULL, 4, 4, 0, 2);
    kvh_engine *e = open_a(&c);
    kvh_seq s;
    dt_assert_ok(dt_build(e, g, dt_plain(1), 2 * g.bt, 0, &s));
    dt_assert_kvh(KVH_ERR_UNSUPPORTED, kvh_seq_persist(e, s));
    dt_assert_ok(dt_close(e));

    char dir[512];
    /* The store's directory removed under the engine: a persist would be
     * durable nowhere a later open looks, so it fails, and so do later
     * ones. */
    dt_scratch("persist-removed", dir, sizeof(dir));
    c = dt_cfg(g, dir, 4, 4, 16, 2);
    e = open_a(&c);
    dt_assert_ok(dt_build(e, g, dt_plain(4), 2 * g.bt, 0, &s));
    dt_assert_ok(kvh_seq_persist(e, s));
    assert_int_equal(dt_rmrf(dir), 0);
    kvh_seq s2;
    dt_assert_ok(dt_build(e, g, dt_plain(5), 2 * g.bt, 0, &s2));
    dt_assert_kvh(KVH_ERR_IO, kvh_seq_persist(e, s2));
    assert_non_null(strstr(kvh_last_error(), "removed"));
    dt_assert_kvh(KVH_ERR_IO, kvh_seq_persist(e, s));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(kvh_seq_free(e, s2));
    kvh_status closed = dt_close(e);
    assert_true(closed == KVH_OK || closed == KVH_ERR_IO);

    dt_scratch("persist-rules", dir, sizeof(dir));
    c = dt_cfg(g, dir, 4, 4, 16, 2);
    e = open_a(&c);
    /* an empty sequence and one with only a partial block: nothing to do */
    dt_assert_ok(kvh_seq_create(e, 0, &s));
    dt_assert_ok(kvh_seq_persist(e, s));
    dt_assert_ok(dt_extend(e, s, g, dt_plain(2), 0, g.bt - 1));
    dt_assert_ok(kvh_seq_persist(e, s));
    dt_assert_ok(kvh_seq_free(e, s));
    /* a full block whose KV was never written cannot be persisted */
    dt_assert_ok(kvh_seq_create(e, 0, &s));
    int32_t tk[16];
    dt_tokens(dt_plain(3), 0, 16, tk);
    dt_assert_ok(kvh_seq_append(e, s, tk, 16));
    kvh_status st = kvh_seq_persist(e, s);
    assert_true(st != KVH_OK);
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
    /* nothing was stored */
    e = open_a(&c);
    kvh_tier_info ti;
    memset(&ti, 0, sizeof(ti));
    ti.struct_size = sizeof(ti);
    dt_assert_ok(kvh_tier_info_get(e, KVH_TIER_DISK, &ti));
    assert_int_equal(ti.used_blocks, 0);
    dt_assert_ok(dt_close(e));
}

/* A persisted sequence that then rewrites one of its persisted blocks
 * (copy-on-write) keeps the persisted prefix while it lives: the original
 * of that block stays, though the disk fills with other persists, and a
 * reopened store finds every persisted token with its persisted bytes.
 * Before, the replaced block was dropped and the blocks after it became
 * unreachable (8 of 16 tokens found). */
static void test_a_rewritten_persisted_block_keeps_the_prefix(void **state)
{
    (void)state;
    dt_geo g = {1, 1, 64, 16, KVH_DTYPE_F16};
    char dir[512];
    dt_scratch("persist-rewrite", dir, sizeof(dir));
    kvh_config c = dt_cfg(g, dir, 4, 4, 16, 0);
    kvh_engine *e = open_a(&c);
    const size_t n = 4 * g.bt;
    kvh_seq s;
    dt_assert_ok(dt_build(e, g, dt_plain(20), n, 0, &s));
    dt_assert_ok(kvh_seq_persist(e, s));
    uint8_t *kv = calloc(2, dt_tok_bytes(g));
    assert_non_null(kv);
    dt_assert_ok(kvh_seq_write_kv(e, s, 0, 2 * g.bt + 1, 1, kv, kv + dt_tok_bytes(g))); /* block 2 copied */
    for (int j = 0; j < 6; j++) { /* other persists fill the disk */
        kvh_seq o;
        dt_assert_ok(dt_build(e, g, dt_plain(30 + (uint64_t)j), n, 0, &o));
        (void)kvh_seq_persist(e, o); /* a full disk may refuse some */
        dt_assert_ok(kvh_seq_free(e, o));
    }
    int32_t tk[64];
    dt_tokens(dt_plain(20), 0, n, tk);
    for (int reopen = 0; reopen < 2; reopen++) {
        kvh_seq m;
        size_t matched = 0;
        dt_assert_ok(kvh_seq_create(e, 0, &m));
        dt_assert_ok(kvh_seq_match_prefix(e, m, tk, n, &matched));
        assert_int_equal(matched, n);
        char msg[256] = "";
        if (dt_verify(e, m, g, dt_plain(20), 0, n, msg, sizeof(msg)) != KVH_OK)
            fail_msg("%s: %s", reopen ? "after reopening" : "live", msg);
        dt_assert_ok(kvh_seq_free(e, m));
        if (!reopen) {
            dt_assert_ok(dt_close(e)); /* s is alive at close */
            e = open_a(&c);
        }
    }
    free(kv);
    dt_assert_ok(dt_close(e));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_roundtrip_every_dtype_every_tier, dt_teardown),
        cmocka_unit_test_teardown(test_single_block_restores_in_pieces, dt_teardown),
        cmocka_unit_test_teardown(test_recovery_new_process_after_close, dt_teardown),
        cmocka_unit_test_teardown(test_recovery_new_process_without_close, dt_teardown),
        cmocka_unit_test_teardown(test_direct_and_buffered_paths, dt_teardown),
        cmocka_unit_test_teardown(test_odirect_refused_falls_back, teardown_ramfs),
        cmocka_unit_test_teardown(test_mismatch_and_reset, dt_teardown),
        cmocka_unit_test_teardown(test_second_engine_busy, dt_teardown),
        cmocka_unit_test_teardown(test_resized_store, dt_teardown),
        cmocka_unit_test_teardown(test_persist_rules, dt_teardown),
        cmocka_unit_test_teardown(test_a_rewritten_persisted_block_keeps_the_prefix, dt_teardown),
    };
    return cmocka_run_group_tests_name("disk_roundtrip", tests, NULL, NULL);
}
