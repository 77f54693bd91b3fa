/* Disk tier: running out of space and failing I/O.
 *
 *   - a small disk_bytes with every block referenced: KVH_ERR_NOSPACE only
 *     once all 8 slots of the hierarchy are used (also with migration
 *     workers and the background cleaner running), the sequence unchanged,
 *     everything in the memory tiers intact, room again after a free;
 *   - a full filesystem (a 1 MiB tmpfs mounted for the test; where mount
 *     is refused, only that sub-case is skipped, with the reason) and ENOSPC
 *     injected through kvhi_disk_set_fault_hook: persist fails with
 *     KVH_ERR_NOSPACE, data in memory stays intact and readable, ENOSPC is
 *     not fatal (once there is room, persist works again), what was
 *     persisted before is found after a reopen;
 *   - an fsync failure (KVHI_OP_FSYNC, on the slab or on the journal) makes
 *     persist fail with KVH_ERR_IO and every later persist fail too: fsync
 *     failure is fatal, never retried and trusted;
 *   - a sweep that fails the n-th write / fsync / rename / directory fsync /
 *     read once, at every n in a range, during persist, spill and close:
 *     a persist that returned KVH_OK is always found after a reopen, and
 *     nothing wrong is ever served;
 *   - a transient read error does not cost a durable block its record;
 *   - the journal removed while open: close writes the index from the
 *     engine's state (every block durable before is kept); the directory
 *     removed: close returns KVH_ERR_IO;
 *   - a new store's directory entry is synced (its failure fails the open
 *     and removes the directory just made);
 *   - after a failed slab fsync close writes no index (KVH_ERR_IO);
 *   - a reset cut short between its new journal and its new index leaves
 *     the new, empty store.
 */
#include "disk_test_util.h"

#include <signal.h>
#include <stdatomic.h>
#include <sys/resource.h>

#include "core/disk_index.h"
#include "core/disk_io.h"
#include "core/engine.h"

static const dt_geo G = {1, 1, 64, 16, KVH_DTYPE_F16}; /* block = 4096 bytes, slot = 8192 */

/* ---- fault hook: fails the nth call (or every call from the nth on, when
 * sticky) of one kind of operation with err ---- */

static struct {
    atomic_int armed;
    int op, nth, err;
    bool sticky;
    atomic_int count, fired;
} H;

static int fault_hook(enum kvhi_disk_op op, void *user)
{
    (void)user;
    if (!atomic_load(&H.armed) || (int)op != H.op)
        return 0;
    int c = atomic_fetch_add(&H.count, 1) + 1;
    if (c == H.nth || (H.sticky && c > H.nth)) {
        atomic_fetch_add(&H.fired, 1);
        return H.err;
    }
    return 0;
}

static void arm(int op, int nth, int err, bool sticky)
{
    atomic_store(&H.armed, 0);
    H.op = op, H.nth = nth, H.err = err, H.sticky = sticky;
    atomic_store(&H.count, 0);
    atomic_store(&H.fired, 0);
    atomic_store(&H.armed, 1);
}

static void disarm(void) { atomic_store(&H.armed, 0); }

static int setup(void **state)
{
    (void)state;
    kvhi_disk_set_fault_hook(fault_hook, NULL);
    return 0;
}

static int teardown(void **state)
{
    disarm();
    dt_teardown(state);
    return 0;
}

static int group_teardown(void **state)
{
    (void)state;
    kvhi_disk_set_fault_hook(NULL, NULL);
    return 0;
}

static void assert_seq_ok(kvh_engine *e, kvh_seq s, dt_content c, size_t n, const char *what)
{
    char msg[256] = "";
    kvh_status st = dt_verify(e, s, G, c, 0, n, msg, sizeof(msg));
    if (st != KVH_OK)
        fail_msg("%s: %s", what, msg);
}

static size_t match_len(kvh_engine *e, dt_content c, size_t n, const char *what)
{
    size_t m = 0;
    char msg[256] = "";
    if (dt_match_verify(e, G, c, n, &m, msg, sizeof(msg)) != KVH_OK)
        fail_msg("%s: %s", what, msg);
    return m;
}

/* ------------------------------------------------------------------ */
/* A small disk_bytes, everything referenced                           */
/* ------------------------------------------------------------------ */

static void test_nospace_small_disk_all_referenced(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("nospace-small", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 2, 2, 4, 2); /* 8 blocks in all */
    /* Moves run in the caller and there is no background cleaner, so the
     * capacity is exact (test_nospace_is_not_spurious covers workers). */
    c.migration_threads = 0;
    kvh_engine *e = dt_open_a(&c);
    dt_content ct = dt_plain(31);
    kvh_seq s;
    dt_assert_ok(kvh_seq_create(e, 0, &s));
    size_t len = 0;
    kvh_status st = KVH_OK;
    for (int i = 0; i < 32 && st == KVH_OK; i++) {
        st = dt_extend(e, s, G, ct, len, G.bt);
        if (st == KVH_OK)
            len += G.bt;
    }
    dt_assert_kvh(KVH_ERR_NOSPACE, st);
    assert_int_equal(len / G.bt, 8); /* every slot of every tier is used */
    /* the failed append left the sequence as it was */
    uint64_t n = 0;
    dt_assert_ok(kvh_seq_length(e, s, &n));
    assert_int_equal(n, len);
    /* a partial append fails the same way, and also changes nothing */
    int32_t tk[3];
    dt_tokens(ct, len, 3, tk);
    dt_assert_kvh(KVH_ERR_NOSPACE, kvh_seq_append(e, s, tk, 3));
    dt_assert_ok(kvh_seq_length(e, s, &n));
    assert_int_equal(n, len);

    /* Every block in a memory tier is intact and readable; a block on
     * disk may not come up while everything is referenced, but it never
     * reads wrong. */
    size_t tb = dt_tok_bytes(G);
    uint8_t *k = malloc(tb * G.bt), *v = malloc(tb * G.bt), *want = malloc(tb);
    int in_memory = 0;
    for (uint64_t b = 0; b < len / G.bt; b++) {
        kvh_block_info bi = dt_binfo(e, s, b);
        st = kvh_seq_read_kv(e, s, 0, b * G.bt, G.bt, k, v);
        if (bi.tier != KVH_TIER_DISK) {
            in_memory++;
            if (st != KVH_OK) {
                free(k), free(v), free(want);
                fail_msg("block %" PRIu64 " in tier %u: read_kv %s (%s)", b, bi.tier, kvh_status_name(st),
                         kvh_last_error());
            }
        } else if (st != KVH_OK && st != KVH_ERR_NOSPACE) {
            free(k), free(v), free(want);
            fail_msg("block %" PRIu64 " on disk: read_kv %s (%s)", b, kvh_status_name(st), kvh_last_error());
        }
        for (uint32_t t = 0; st == KVH_OK && t < G.bt; t++)
            for (int kv = 0; kv < 2; kv++) {
                dt_kv_token(ct, 0, b * G.bt + t, kv, want, tb);
                if (memcmp((kv ? v : k) + t * tb, want, tb) != 0) {
                    free(k), free(v), free(want);
                    fail_msg("block %" PRIu64 " token %u reads wrong", b, t);
                }
            }
    }
    free(k), free(v), free(want);
    assert_true(in_memory >= 2);

    /* Nothing can make a disk copy of the blocks in memory either. */
    st = kvh_seq_persist(e, s);
    if (st != KVH_ERR_NOSPACE && st != KVH_OK)
        fail_msg("persist with a full disk returned %s (%s)", kvh_status_name(st), kvh_last_error());
    /* A second sequence gets no room. */
    kvh_seq s2;
    dt_assert_ok(kvh_seq_create(e, 0, &s2));
    dt_assert_kvh(KVH_ERR_NOSPACE, dt_extend(e, s2, G, dt_plain(32), 0, G.bt));

    /* Releasing the big sequence makes room again (its cached blocks are
     * dropped or stay as clean copies). */
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_extend(e, s2, G, dt_plain(32), 0, 4 * G.bt));
    assert_seq_ok(e, s2, dt_plain(32), 4 * G.bt, "after freeing");
    dt_assert_ok(kvh_seq_persist(e, s2));
    dt_assert_ok(dt_close(e));
    e = dt_open_a(&c);
    assert_int_equal(match_len(e, dt_plain(32), 4 * G.bt, "reopen"), 4 * G.bt);
    dt_assert_ok(dt_close(e));
}

/* With migration workers (and so the background cleaner that writes
 * clean copies of cold host blocks) the same hierarchy must hold the same
 * 8 blocks: KVH_ERR_NOSPACE means no tier has room, not "the blocks that
 * could make room are being written right now". */
static void test_nospace_is_not_spurious(void **state)
{
    (void)state;
    char dir[512];
    int short_runs = 0, retry_ok = 0, min_fit = 99;
    char first[300] = "";
    for (int round = 0; round < 20; round++) {
        dt_scratch("nospace-spurious", dir, sizeof(dir));
        kvh_config c = dt_cfg(G, dir, 2, 2, 4, 2);
        c.migration_threads = 2;
        kvh_engine *e = dt_open_a(&c);
        kvh_seq s;
        dt_assert_ok(kvh_seq_create(e, 0, &s));
        size_t len = 0;
        kvh_status st = KVH_OK;
        while (st == KVH_OK && len < 32 * G.bt)
            if ((st = dt_extend(e, s, G, dt_plain(1), len, G.bt)) == KVH_OK)
                len += G.bt;
        dt_assert_kvh(KVH_ERR_NOSPACE, st);
        int fit = (int)(len / G.bt);
        if (fit < min_fit)
            min_fit = fit;
        if (fit < 8 && short_runs++ == 0)
            snprintf(first, sizeof(first), "round %d: NOSPACE after %d blocks: \"%.200s\"", round, fit, dt_err);
        usleep(20000);
        if (fit < 8 && dt_extend(e, s, G, dt_plain(1), len, G.bt) == KVH_OK)
            retry_ok++;
        dt_assert_ok(dt_close(e));
    }
    if (short_runs)
        fail_msg("2 device + 2 host + 4 disk slots, one referenced sequence, 2 migration threads: %d of 20 runs "
                 "got KVH_ERR_NOSPACE before 8 blocks (as few as %d), and the same append succeeded 20 ms later "
                 "in %d of them; first: %s",
                 short_runs, min_fit, retry_ok, first);
}

/* ------------------------------------------------------------------ */
/* ENOSPC from the filesystem                                          */
/* ------------------------------------------------------------------ */

/* Persists 2-block sequences until persist fails; checks the failure and
 * what it leaves. `free_space` (may be NULL) is called once after the
 * first failure to make room; then a persist must work again unless the
 * store turned fatal (reported). */
static void fill_until_nospace(const char *dir, uint64_t disk_slots, void (*free_space)(void *), void *arg)
{
    kvh_config c = dt_cfg(G, dir, 4, 4, disk_slots, 2);
    c.migration_threads = 0; /* see test_nospace_is_not_spurious */
    kvh_engine *e = dt_open_a(&c);
    int acked = 0;
    kvh_status st = KVH_OK;
    kvh_seq s = {0};
    for (int i = 0; i < 400; i++) {
        dt_assert_ok(dt_build(e, G, dt_plain(9000 + (uint64_t)i), 2 * G.bt, 0, &s));
        st = kvh_seq_persist(e, s);
        if (st != KVH_OK)
            break;
        acked++;
        dt_assert_ok(kvh_seq_free(e, s));
    }
    if (st != KVH_ERR_NOSPACE)
        fail_msg("after %d persists: %s (%s), expected KVH_ERR_NOSPACE", acked, kvh_status_name(st), kvh_last_error());
    print_message("the filesystem filled after %d persisted sequences: %s\n", acked, kvh_last_error());
    /* the sequence whose persist failed is intact in memory */
    assert_seq_ok(e, s, dt_plain(9000 + (uint64_t)acked), 2 * G.bt, "after ENOSPC");
    /* so is an older one, brought back from disk */
    if (acked > 0) {
        kvh_seq o;
        size_t m = 0;
        dt_assert_ok(dt_match(e, dt_plain(9000), 2 * G.bt, &o, &m));
        assert_int_equal(m, 2 * G.bt);
        assert_seq_ok(e, o, dt_plain(9000), 2 * G.bt, "an older persisted sequence");
        dt_assert_ok(kvh_seq_free(e, o));
    }
    if (free_space) {
        free_space(arg);
        st = kvh_seq_persist(e, s);
        if (st != KVH_OK)
            fail_msg("persist after the filesystem got room again: %s (%s); ENOSPC must not make the store "
                     "unusable",
                     kvh_status_name(st), kvh_last_error());
        acked++;
    }
    dt_assert_ok(kvh_seq_free(e, s));
    kvh_status cst = dt_close(e);
    (void)cst; /* the snapshot may not fit */
    e = dt_open_a(&c);
    for (int i = 0; i < acked; i++) {
        char what[64];
        snprintf(what, sizeof(what), "persisted sequence %d after reopen", i);
        assert_int_equal(match_len(e, dt_plain(9000 + (uint64_t)i), 2 * G.bt, what), 2 * G.bt);
    }
    dt_assert_ok(dt_close(e));
}

static char filler_path[600];
static void remove_filler(void *arg)
{
    (void)arg;
    assert_int_equal(unlink(filler_path), 0);
}

static char tmpfs_mnt[512];

static int teardown_tmpfs(void **state)
{
    teardown(state);
    if (tmpfs_mnt[0]) {
        umount(tmpfs_mnt);
        tmpfs_mnt[0] = '\0';
    }
    return 0;
}

static void test_nospace_full_filesystem(void **state)
{
    (void)state;
    dt_scratch_mountpoint("tmpfs-full", tmpfs_mnt, sizeof(tmpfs_mnt));
    if (mount("tmpfs", tmpfs_mnt, "tmpfs", 0, "size=1m") != 0) {
        int err = errno;
        tmpfs_mnt[0] = '\0';
        print_message("SKIP: mount -t tmpfs -o size=1m refused (%s); the full-filesystem case is covered only "
                      "by test_nospace_injected_write_error\n",
                      strerror(err));
        skip();
    }
    char dir[600];
    snprintf(dir, sizeof(dir), "%s/store", tmpfs_mnt);
    mkdir(dir, 0755);
    /* 256 slots (2 MiB) on a 1 MiB filesystem: the slab cannot be
     * preallocated and grows until writes fail with ENOSPC. A filler file
     * takes 256 KiB that is given back after the first failure. */
    snprintf(filler_path, sizeof(filler_path), "%s/filler", tmpfs_mnt);
    uint8_t *junk = calloc(1, 256 << 10);
    assert_int_equal(dt_write_file(filler_path, junk, 256 << 10), 0);
    free(junk);
    fill_until_nospace(dir, 256, remove_filler, NULL);
    umount(tmpfs_mnt);
    tmpfs_mnt[0] = '\0';
}

static void test_nospace_injected_write_error(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("nospace-injected", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 4, 4, 64, 2);
    c.migration_threads = 0; /* no background cleaner: the next write is persist's */
    kvh_engine *e = dt_open_a(&c);
    kvh_seq a, b;
    dt_assert_ok(dt_build(e, G, dt_plain(1), 3 * G.bt, 0, &a));
    dt_assert_ok(kvh_seq_persist(e, a));
    dt_assert_ok(dt_build(e, G, dt_plain(2), 3 * G.bt, 0, &b));
    arm(KVHI_OP_WRITE, 1, -ENOSPC, true);
    dt_assert_kvh(KVH_ERR_NOSPACE, kvh_seq_persist(e, b));
    assert_true(atomic_load(&H.fired) > 0);
    assert_seq_ok(e, b, dt_plain(2), 3 * G.bt, "after the failed persist");
    assert_seq_ok(e, a, dt_plain(1), 3 * G.bt, "the persisted one");
    /* spilling to a disk that refuses writes fails too, leaving data in
     * memory */
    kvh_status st = kvh_seq_migrate(e, b, 0, 3 * G.bt, KVH_TIER_DISK, NULL);
    assert_true(st == KVH_ERR_NOSPACE || st == KVH_ERR_IO);
    assert_seq_ok(e, b, dt_plain(2), 3 * G.bt, "after the failed spill");
    disarm();
    /* ENOSPC is not fatal: with room again, persist works */
    dt_assert_ok(kvh_seq_persist(e, b));
    dt_assert_ok(dt_close(e));
    e = dt_open_a(&c);
    assert_int_equal(match_len(e, dt_plain(1), 3 * G.bt, "a"), 3 * G.bt);
    assert_int_equal(match_len(e, dt_plain(2), 3 * G.bt, "b"), 3 * G.bt);
    dt_assert_ok(dt_close(e));
}

/* The full-filesystem walk again with ENOSPC injected once the store
 * holds 20 sequences, for machines where tmpfs cannot be mounted. */
static void make_room(void *arg)
{
    (void)arg;
    disarm();
}

/* Every write from the 60th on fails with -err: the "filesystem" is full. */
static void fill_with_writes_failing(const char *name, int err)
{
    char dir[512];
    dt_scratch(name, dir, sizeof(dir));
    arm(KVHI_OP_WRITE, 60, err, true);
    fill_until_nospace(dir, 512, make_room, NULL);
    disarm();
}

static void test_nospace_injected_filesystem_full(void **state)
{
    (void)state;
    fill_with_writes_failing("nospace-injected-fs", -ENOSPC);
}

/* The same with the user's disk quota used up (EDQUOT): a full disk too. */
static void test_nospace_injected_quota_full(void **state)
{
    (void)state;
    fill_with_writes_failing("nospace-injected-quota", -EDQUOT);
}

/* ------------------------------------------------------------------ */
/* fsync failure is fatal                                              */
/* ------------------------------------------------------------------ */

static void fsync_fatal(int nth, const char *which)
{
    char dir[512];
    dt_scratch(which, dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 4, 8, 64, 2);
    kvh_engine *e = dt_open_a(&c);
    kvh_seq a, b, d;
    dt_assert_ok(dt_build(e, G, dt_plain(11), 3 * G.bt, 0, &a));
    dt_assert_ok(kvh_seq_persist(e, a));
    dt_assert_ok(dt_build(e, G, dt_plain(12), 3 * G.bt, 0, &b));
    arm(KVHI_OP_FSYNC, nth, -EIO, false); /* one failure only */
    dt_assert_kvh(KVH_ERR_IO, kvh_seq_persist(e, b));
    assert_int_equal(atomic_load(&H.fired), 1);
    disarm();
    /* never retried and trusted: this and every later persist fail */
    dt_assert_kvh(KVH_ERR_IO, kvh_seq_persist(e, b));
    dt_assert_ok(dt_build(e, G, dt_plain(13), 2 * G.bt, 0, &d));
    dt_assert_kvh(KVH_ERR_IO, kvh_seq_persist(e, d));
    dt_assert_kvh(KVH_ERR_IO, kvh_seq_persist(e, a));
    /* memory tiers are unaffected; blocks on disk still read */
    assert_seq_ok(e, b, dt_plain(12), 3 * G.bt, "b");
    assert_seq_ok(e, d, dt_plain(13), 2 * G.bt, "d");
    dt_assert_ok(kvh_seq_migrate(e, a, 0, 3 * G.bt, KVH_TIER_DISK, NULL)); /* clean copies: no write */
    assert_seq_ok(e, a, dt_plain(11), 3 * G.bt, "a");
    /* a spill that needs a write does not succeed either */
    kvh_status st = kvh_seq_migrate(e, d, 0, 2 * G.bt, KVH_TIER_DISK, NULL);
    if (st == KVH_OK) {
        for (int i = 0; i < 2; i++)
            if (dt_binfo(e, d, (uint64_t)i).tier == KVH_TIER_DISK)
                fail_msg("%s: a block was written to disk after a failed fsync", which);
    }
    assert_seq_ok(e, d, dt_plain(13), 2 * G.bt, "d after the refused spill");
    dt_assert_ok(kvh_seq_free(e, a));
    dt_assert_ok(kvh_seq_free(e, b));
    dt_assert_ok(kvh_seq_free(e, d));
    kvh_status cst = dt_close(e);
    (void)cst;
    /* A new engine: what was persisted before the failure is there; what
     * came after may or may not be, but is never wrong. */
    e = dt_open_a(&c);
    assert_int_equal(match_len(e, dt_plain(11), 3 * G.bt, "a after reopen"), 3 * G.bt);
    match_len(e, dt_plain(12), 3 * G.bt, "b after reopen");
    match_len(e, dt_plain(13), 2 * G.bt, "d after reopen");
    /* and the new engine may persist again */
    dt_assert_ok(dt_build(e, G, dt_plain(14), 2 * G.bt, 0, &d));
    dt_assert_ok(kvh_seq_persist(e, d));
    dt_assert_ok(kvh_seq_free(e, d));
    dt_assert_ok(dt_close(e));
}

/* The index turned fatal (another thread's failed sync) between a
 * persist's slab write and its record: the persist said "out of memory
 * recording a block" (KVH_ERR_NOMEM), where kvh.h promises KVH_ERR_IO,
 * and a caller retrying on NOMEM would retry for ever. */
static kvh_engine *fatal_on_write_engine;

static int fatal_on_write(enum kvhi_disk_op op, void *user)
{
    (void)user;
    if (op == KVHI_OP_WRITE && fatal_on_write_engine)
        fatal_on_write_engine->disk->fatal = true; /* the write itself goes through */
    return 0;
}

static void test_index_fatal_during_a_persist_is_an_io_error(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("fatal-mid-persist", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 4, 8, 64, 0);
    kvh_engine *e = dt_open_a(&c);
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, dt_plain(21), 2 * G.bt, 0, &s));
    fatal_on_write_engine = e;
    kvhi_disk_set_fault_hook(fatal_on_write, NULL);
    kvh_status st = kvh_seq_persist(e, s);
    kvhi_disk_set_fault_hook(fault_hook, NULL);
    fatal_on_write_engine = NULL;
    if (st != KVH_ERR_IO)
        fail_msg("%s (%s), expected KVH_ERR_IO", kvh_status_name(st), kvh_last_error());
    assert_non_null(strstr(kvh_last_error(), "takes no more records"));
    dt_assert_ok(kvh_seq_free(e, s));
    (void)dt_close(e);
}

/* Memory full of referenced blocks and the disk tier's file system full
 * (its last write refused for space, slots still free in the pool): a new
 * block's refusal said only "all pinned, held or referenced", naming no
 * full disk. */
static void test_no_room_names_a_full_file_system(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("fs-full-message", dir, sizeof(dir));
    dt_rmrf(dir);
    kvh_config c = dt_cfg(G, dir, 2, 2, 64, 0);
    kvh_engine *e = dt_open_a(&c);
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, dt_plain(4), 4 * G.bt, 0, &s));
    arm(KVHI_OP_WRITE, 1, -ENOSPC, true); /* every write refused for space */
    int32_t t[16];
    dt_tokens(dt_plain(4), 4 * G.bt, G.bt, t);
    kvh_status st = kvh_seq_append(e, s, t, G.bt);
    disarm();
    assert_int_equal(st, KVH_ERR_NOSPACE);
    if (!strstr(kvh_last_error(), "file system is full"))
        fail_msg("the refusal names no full file system: %s", kvh_last_error());
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
    dt_rmrf(dir);
}

/* An open under a hard RLIMIT_NOFILE of `limit` with `busy` more
 * descriptors taken first, in a child process (a hard limit is not raised
 * again): 0 when it opens (refusal NULL) or is refused as INVALID_ARG
 * naming `refusal` with nothing made. */
typedef struct nofile_case {
    const char *store;
    rlim_t limit;
    int busy;
    uint64_t disk_bytes;
    const char *refusal;
} nofile_case;

static int open_under_nofile(void *p)
{
    const nofile_case *nc = p;
    struct rlimit hard = {.rlim_cur = nc->limit, .rlim_max = nc->limit};
    if (setrlimit(RLIMIT_NOFILE, &hard) != 0)
        return 10;
    for (int i = 0; i < nc->busy; i++)
        if (open("/dev/null", O_RDONLY) < 0)
            return 11;
    kvh_config h = dt_cfg(G, nc->store, 4, 8, 64, 0);
    h.disk_bytes = nc->disk_bytes;
    kvh_engine *x = NULL;
    kvh_status st = kvh_engine_open(&h, &x);
    if (!nc->refusal)
        return st != KVH_OK ? 12 : kvh_engine_close(x) != KVH_OK ? 13 : 0;
    if (st != KVH_ERR_INVALID_ARG || !strstr(kvh_last_error(), nc->refusal))
        return 14;
    return access(nc->store, F_OK) == -1 ? 0 : 15; /* nothing made */
}

/* A disk_bytes needing more slab files than the process may open: the
 * open failed midway with "Too many open files" and left every slab it
 * had made (20,000 were seen) in the store. Past the hard limit it is
 * refused first now, with the limit named and nothing made; under it the
 * soft limit is raised to what the slabs need. */
static void test_more_slabs_than_open_files(void **state)
{
    (void)state;
    char dir[512], store[600];
    dt_scratch("too-many-slabs", dir, sizeof(dir));
    snprintf(store, sizeof(store), "%s/store", dir);
    struct rlimit was;
    assert_int_equal(getrlimit(RLIMIT_NOFILE, &was), 0);
    if (was.rlim_max != RLIM_INFINITY && was.rlim_max < 400)
        skip();
    /* Soft 100, hard unchanged: 120 slabs (sparse) open, the soft limit raised. */
    struct rlimit low = {.rlim_cur = 100, .rlim_max = was.rlim_max};
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &low), 0);
    kvh_config c = dt_cfg(G, store, 4, 8, 64, 0);
    c.disk_bytes = 120ull << 30;
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&c, &e);
    char why[512];
    snprintf(why, sizeof(why), "%s", kvh_last_error());
    struct rlimit now;
    assert_int_equal(getrlimit(RLIMIT_NOFILE, &now), 0);
    if (st == KVH_OK)
        assert_int_equal(kvh_engine_close(e), KVH_OK);
    if (st != KVH_OK)
        fail_msg("120 slabs under a soft limit of 100: %s (%s)", kvh_status_name(st), why);
    assert_true(now.rlim_cur >= 120 + 12);
    dt_rmrf(store);
    /* Hard 300: 400 slabs cannot be had; refused before anything is made
     * (the hard limit cannot be raised again: a child process). */
    nofile_case refused = {store, 300, 0, 400ull << 30, "RLIMIT_NOFILE"};
    assert_int_equal(dt_in_child(open_under_nofile, &refused), 0);
    /* The check counts what the process holds, not a fixed 64: a hard
     * limit of 64 takes a one-slab store (it was refused), and 30 slabs
     * beside 80 descriptors in use under 100 are refused up front (they
     * passed, and the open failed midway, "Too many open files"). */
    nofile_case one_slab = {store, 64, 0, 1ull << 30, NULL};
    assert_int_equal(dt_in_child(open_under_nofile, &one_slab), 0);
    dt_rmrf(store);
    nofile_case crowded = {store, 100, 80, 30ull << 30, "descriptors open already"};
    assert_int_equal(dt_in_child(open_under_nofile, &crowded), 0);
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &was), 0);
    dt_rmrf(dir);
}

static void test_fsync_failure_is_fatal(void **state)
{
    (void)state;
    fsync_fatal(1, "fsync-slab");    /* persist syncs the slab first ... */
    fsync_fatal(2, "fsync-journal"); /* ... then the journal */
}

/* ------------------------------------------------------------------ */
/* Fault sweep                                                         */
/* ------------------------------------------------------------------ */

static const char *op_name(int op)
{
    static const char *n[] = {"write", "read", "fsync", "rename", "dirsync"};
    return op >= 0 && op < KVHI_OP_COUNT ? n[op] : "?";
}

static void test_fault_sweep(void **state)
{
    (void)state;
    struct {
        int op, err, max_nth;
    } plan[] = {
        {KVHI_OP_WRITE, -EIO, 12}, {KVHI_OP_WRITE, -ENOSPC, 12}, {KVHI_OP_FSYNC, -EIO, 8},
        {KVHI_OP_RENAME, -EIO, 3}, {KVHI_OP_DIRSYNC, -EIO, 3},   {KVHI_OP_READ, -EIO, 8},
    };
    char dir[512];
    int runs = 0, fired_runs = 0;
    for (size_t p = 0; p < sizeof(plan) / sizeof(plan[0]); p++)
        for (int nth = 1; nth <= plan[p].max_nth; nth++) {
            dt_scratch("sweep", dir, sizeof(dir));
            /* everything fits in memory (the cleaner stays idle; see
             * test_nospace_is_not_spurious): disk traffic is persist,
             * the explicit spills and close */
            kvh_config c = dt_cfg(G, dir, 16, 8, 64, 2);
            kvh_engine *e = dt_open_a(&c);
            dt_content ct[5];
            kvh_seq s[5];
            char what[96];
            snprintf(what, sizeof(what), "%s fails (%s) at call %d", op_name(plan[p].op), strerror(-plan[p].err), nth);
            for (int i = 0; i < 5; i++) {
                ct[i] = dt_plain(700 + (uint64_t)i);
                kvh_status bst = dt_build(e, G, ct[i], 3 * G.bt, 0, &s[i]);
                if (bst != KVH_OK)
                    fail_msg("%s: before arming, building sequence %d: %s (%s)", what, i, kvh_status_name(bst), dt_err);
            }
            dt_assert_ok(kvh_seq_persist(e, s[0]));
            dt_assert_ok(kvh_seq_migrate(e, s[0], 0, 3 * G.bt, KVH_TIER_DISK, NULL));
            arm(plan[p].op, nth, plan[p].err, false);
            kvh_status st1 = kvh_seq_persist(e, s[1]);
            kvh_status st2 = kvh_seq_persist(e, s[2]);
            kvh_seq_migrate(e, s[3], 0, 3 * G.bt, KVH_TIER_DISK, NULL); /* spill, may fail */
            kvh_status st4 = kvh_seq_persist(e, s[4]);
            /* reading back never serves wrong data */
            for (int i = 0; i < 5; i++) {
                char msg[256] = "";
                kvh_status st = dt_verify(e, s[i], G, ct[i], 0, 3 * G.bt, msg, sizeof(msg));
                if (st == KVH_ERR_INTERNAL && strstr(msg, "differs"))
                    fail_msg("%s: sequence %d: %s", what, i, msg);
            }
            for (int i = 0; i < 5; i++)
                kvh_seq_free(e, s[i]);
            kvh_status cst = dt_close(e);
            bool fired = atomic_load(&H.fired) > 0;
            disarm();
            runs++;
            fired_runs += fired;
            /* a new engine without faults */
            e = dt_open_a(&c);
            kvh_status pst[5] = {KVH_OK, st1, st2, -100, st4};
            for (int i = 0; i < 5; i++) {
                size_t m = match_len(e, ct[i], 3 * G.bt, what);
                if (pst[i] == KVH_OK && m != 3 * G.bt)
                    fail_msg("%s: sequence %d was persisted (KVH_OK) but only %zu of %u tokens are found "
                             "(close: %s)",
                             what, i, m, 3 * G.bt, kvh_status_name(cst));
            }
            dt_assert_ok(dt_close(e));
            /* once an fsync failed, no later persist of that engine may
             * claim success */
            if (plan[p].op == KVHI_OP_FSYNC && fired && st1 != KVH_OK)
                assert_true(st2 != KVH_OK && st4 != KVH_OK);
        }
    print_message("%d fault runs, %d with the fault hit\n", runs, fired_runs);
}

/* ------------------------------------------------------------------ */
/* A transient read error                                              */
/* ------------------------------------------------------------------ */

static void test_transient_read_error_keeps_durable_blocks(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("read-error", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 2, 8, 64, 2);
    kvh_engine *e = dt_open_a(&c);
    dt_content ct = dt_plain(55);
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, ct, 4 * G.bt, 0, &s));
    dt_assert_ok(kvh_seq_persist(e, s));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));

    for (int nth = 1; nth <= 4; nth++) {
        /* a read fails once (sticky for a whole match: both the promotion
         * and the verification of some block fail) */
        e = dt_open_a(&c);
        arm(KVHI_OP_READ, nth, -EIO, true);
        size_t m = match_len(e, ct, 4 * G.bt, "match with failing reads");
        disarm();
        (void)m;
        /* the error is gone; the same engine and a new one find it all */
        size_t m2 = match_len(e, ct, 4 * G.bt, "match after the error");
        dt_assert_ok(dt_close(e));
        e = dt_open_a(&c);
        size_t m3 = match_len(e, ct, 4 * G.bt, "match in a new engine");
        dt_assert_ok(dt_close(e));
        if (m3 != 4 * G.bt)
            fail_msg("read errors from call %d on: a new engine finds %zu of %u durable tokens (the failing "
                     "engine found %zu, then %zu): a transient read error deleted durable blocks",
                     nth, m3, 4 * G.bt, m, m2);
    }
}

/* Persists new sequences of `blocks` blocks (contents from tag on) until
 * one fails, which must be NOSPACE with "File too large": 0, or the number
 * of the check that failed (3-6; 6: the limit never bit). */
static int persist_until_the_limit_bites(kvh_engine *e, uint32_t tag, uint32_t blocks, int most)
{
    kvh_status st = KVH_OK;
    for (int i = 0; i < most && st == KVH_OK; i++) {
        kvh_seq s;
        if (dt_build(e, G, dt_plain(tag + (uint32_t)i), blocks * G.bt, 0, &s) != KVH_OK)
            return 3;
        st = kvh_seq_persist(e, s);
        if (st != KVH_OK && (st != KVH_ERR_NOSPACE || !strstr(kvh_last_error(), "File too large"))) {
            fprintf(stderr, "persist %d under the limit: %s: %s\n", i, kvh_status_name(st), kvh_last_error());
            return 4;
        }
        if (kvh_seq_free(e, s) != KVH_OK)
            return 5;
    }
    return st == KVH_OK ? 6 : 0;
}

/* A file size limit (RLIMIT_FSIZE) stops a slab's growth: persist says
 * NOSPACE with "File too large" (not "No space left on device", nor
 * "Invalid argument" where O_DIRECT resumed a short write unaligned),
 * and works again, in the same engine, once the limit is lifted. Run in
 * a child: the limit and SIGXFSZ's disposition are the process's. */
static int persist_under_file_size_limit(void *arg)
{
    uint32_t flags = *(const uint32_t *)arg;
    char dir[512];
    dt_scratch(flags ? "fsize-buffered" : "fsize-direct", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 2, 2, 256, 2);
    c.disk_flags = flags;
    kvh_engine *e = NULL;
    if (kvh_engine_open(&c, &e) != KVH_OK)
        return 1;
    signal(SIGXFSZ, SIG_IGN);                                                     /* else the limit kills the process */
    struct rlimit rl = {.rlim_cur = 300 * 1000 + 123, .rlim_max = RLIM_INFINITY}; /* not 4 KiB-aligned */
    if (setrlimit(RLIMIT_FSIZE, &rl) != 0)
        return 2;
    int rc = persist_until_the_limit_bites(e, 3000, 2, 200);
    if (rc != 0)
        return rc;
    rl.rlim_cur = RLIM_INFINITY;
    if (setrlimit(RLIMIT_FSIZE, &rl) != 0)
        return 7;
    kvh_seq s;
    if (dt_build(e, G, dt_plain(2999), 2 * G.bt, 0, &s) != KVH_OK || kvh_seq_persist(e, s) != KVH_OK)
        return 8;
    return kvh_engine_close(e) == KVH_OK ? 0 : 9;
}

/* The journal meets the limit first (a small disk: every slab write lies
 * below it): its records wait, as on a full disk, and the store takes
 * writes again once the limit is lifted. */
static int journal_under_file_size_limit(void *arg)
{
    (void)arg;
    char dir[512];
    dt_scratch("fsize-journal", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 2, 2, 4, 2);
    c.migration_threads = 0;
    kvh_engine *e = NULL;
    if (kvh_engine_open(&c, &e) != KVH_OK)
        return 1;
    signal(SIGXFSZ, SIG_IGN);
    struct rlimit rl = {.rlim_cur = 96 * 1024, .rlim_max = RLIM_INFINITY}; /* slabs: 4 slots, 32 KiB */
    if (setrlimit(RLIMIT_FSIZE, &rl) != 0)
        return 2;
    int rc = persist_until_the_limit_bites(e, 5000, 1, 3000);
    if (rc != 0)
        return rc;
    kvh_status st = KVH_OK;
    rl.rlim_cur = RLIM_INFINITY;
    if (setrlimit(RLIMIT_FSIZE, &rl) != 0)
        return 7;
    kvh_seq s;
    if (dt_build(e, G, dt_plain(4999), G.bt, 0, &s) != KVH_OK || (st = kvh_seq_persist(e, s)) != KVH_OK) {
        fprintf(stderr, "persist after the limit: %s: %s\n", kvh_status_name(st), kvh_last_error());
        return 8;
    }
    if (kvh_engine_close(e) != KVH_OK)
        return 9;
    if (kvh_engine_open(&c, &e) != KVH_OK)
        return 10;
    size_t m = 0;
    char msg[256];
    if (dt_match_verify(e, G, dt_plain(4999), G.bt, &m, msg, sizeof(msg)) != KVH_OK || m != G.bt)
        return 11;
    return kvh_engine_close(e) == KVH_OK ? 0 : 12;
}

static void test_a_file_size_limit_is_said_as_such(void **state)
{
    (void)state;
    const uint32_t modes[] = {0, KVH_DISK_BUFFERED};
    for (size_t m = 0; m < 2; m++) {
        int rc = dt_in_child(persist_under_file_size_limit, (void *)&modes[m]);
        if (rc != 0)
            fail_msg("%s: check %d failed", modes[m] ? "buffered" : "O_DIRECT", rc);
    }
    int rc = dt_in_child(journal_under_file_size_limit, NULL);
    if (rc != 0)
        fail_msg("journal: check %d failed", rc);
}

/* A persist folds a long journal into a new index (past 4,096 records,
 * twice the blocks on disk). The blocks are durable before the fold:
 * a fold that fails does not fail the persist, which is found after a
 * reopen, and the next fold succeeds. */
static void test_a_failed_fold_does_not_fail_the_persist(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("fold-fails", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 2, 2, 4, 2);
    c.migration_threads = 0;
    dt_log log;
    dt_log_init(&log);
    dt_log_attach(&c, &log);
    kvh_engine *e = dt_open_a(&c);
    /* Only a fold renames (its new index over the old): the first rename
     * fails. Each persist of a new one-block sequence on a disk of 4 slots
     * adds a record and, once the disk is full, deletes one. */
    arm(KVHI_OP_RENAME, 1, -EIO, false);
    int i, folded_at = -1;
    for (i = 0; i < 6000 && atomic_load(&H.count) < 2; i++) {
        kvh_seq s;
        dt_assert_ok(dt_build(e, G, dt_plain(1000 + (uint32_t)i), G.bt, 0, &s));
        kvh_status st = kvh_seq_persist(e, s);
        if (atomic_load(&H.fired) && folded_at < 0)
            folded_at = i;
        if (st != KVH_OK)
            fail_msg("persist %d (%s a fold that failed) returned %s: %s", i, folded_at == i ? "with" : "without",
                     kvh_status_name(st), kvh_last_error());
        dt_assert_ok(kvh_seq_free(e, s));
    }
    disarm();
    if (folded_at < 0 || atomic_load(&H.count) < 2)
        fail_msg("%d persists folded %d times", i, atomic_load(&H.count));
    assert_true(dt_log_count(&log, KVH_LOG_WARN, "could not be folded", NULL) >= 1);
    dt_assert_ok(dt_close(e));
    e = dt_open_a(&c);
    assert_int_equal(match_len(e, dt_plain(1000 + (uint32_t)folded_at), G.bt, "the persist of the failed fold"), G.bt);
    dt_assert_ok(dt_close(e));
}

/* A persist's journal sync runs outside the journal's lock; a fold that
 * replaced the journal meanwhile excuses a failure on the old file (the
 * snapshot holds its records), but not a store directory removed: that
 * persist must not say its blocks are durable. */
static struct {
    pthread_t thread;
    atomic_int armed, fsyncs, held, go;
} J;

static int hold_journal_sync(enum kvhi_disk_op op, void *user)
{
    (void)user;
    if (!atomic_load(&J.armed) || op != KVHI_OP_FSYNC || !pthread_equal(pthread_self(), J.thread))
        return 0;
    if (atomic_fetch_add(&J.fsyncs, 1) == 0)
        return 0; /* the slab's sync; the journal's is held */
    atomic_store(&J.held, 1);
    while (!atomic_load(&J.go))
        dt_sleep_ms(2);
    return 0;
}

static void test_a_fold_during_a_journal_sync_keeps_a_removed_store_failed(void **state)
{
    (void)state;
    char dir[512], cmd[600];
    dt_scratch("fold-rm", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 8, 8, 32, 0);
    kvh_engine *e = dt_open_a(&c);
    dt_persist_call a = {.e = e};
    kvh_seq folder;
    dt_assert_ok(dt_build(e, G, dt_plain(0x501), 2 * G.bt, 0, &a.s));
    dt_assert_ok(dt_build(e, G, dt_plain(0x601), 2 * G.bt, 0, &folder));
    atomic_store(&J.fsyncs, 0);
    atomic_store(&J.held, 0);
    atomic_store(&J.go, 0);
    kvhi_disk_set_fault_hook(hold_journal_sync, NULL);
    atomic_store(&J.armed, 1);
    assert_int_equal(pthread_create(&J.thread, NULL, dt_persist_in_thread, &a), 0);
    while (!atomic_load(&J.held))
        dt_sleep_ms(2);
    /* A long journal, folded by this thread's persist. */
    int32_t tk[16] = {0};
    for (int i = 0; i < 4100; i++)
        assert_int_equal(kvhi_index_append(e->disk, KVHI_REC_DEL, 31, 0x5678 + (uint64_t)i, 0, G.bt, 0, tk), 0);
    uint64_t generation = e->disk->journal_generation;
    dt_assert_ok(kvh_seq_persist(e, folder));
    assert_true(e->disk->journal_generation != generation);
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
    atomic_store(&J.go, 1);
    pthread_join(J.thread, NULL);
    atomic_store(&J.armed, 0);
    kvhi_disk_set_fault_hook(NULL, NULL);
    if (a.st == KVH_OK)
        fail_msg("a persist whose journal sync ran as the store's directory was removed said OK once a fold had "
                 "replaced the journal");
    assert_true(e->disk->fatal);
    kvh_engine_close(dt_untrack(e));
}

/* The journal removed under a running engine: the persists after it
 * fail, and close writes an index from the engine's state, so what was
 * durable before stays durable. With the whole directory removed, close
 * says the index could not be written. */
static void test_close_after_the_journal_was_removed(void **state)
{
    (void)state;
    char dir[512], path[600];
    dt_scratch("journal-removed", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 16, 8, 64, 0);
    kvh_engine *e = dt_open_a(&c);
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, dt_plain(901), 2 * G.bt, 0, &s));
    dt_assert_ok(kvh_seq_persist(e, s));
    assert_int_equal(unlink(dt_path(path, sizeof(path), dir, "journal")), 0);
    dt_assert_ok(dt_build(e, G, dt_plain(902), 2 * G.bt, 0, &s));
    assert_int_equal(kvh_seq_persist(e, s), KVH_ERR_IO);
    dt_assert_ok(dt_close(dt_untrack(e)));
    dt_log log;
    dt_log_init(&log);
    kvh_config logged = c;
    dt_log_attach(&logged, &log);
    e = dt_open_a(&logged);
    size_t m = 0;
    char msg[256] = "";
    if (dt_match_verify(e, G, dt_plain(901), 2 * G.bt, &m, msg, sizeof(msg)) != KVH_OK)
        fail_msg("%s", msg);
    assert_int_equal(m, 2 * G.bt);
    /* found through the index close wrote, not a rebuild from the slots */
    assert_int_equal(dt_log_count(&log, KVH_LOG_WARN, "rebuilt the index", NULL), 0);
    dt_assert_ok(dt_build(e, G, dt_plain(903), 2 * G.bt, 0, &s));
    dt_assert_ok(kvh_seq_persist(e, s));
    dt_rmrf(dir);
    dt_assert_ok(dt_build(e, G, dt_plain(904), 2 * G.bt, 0, &s));
    assert_int_equal(kvh_seq_persist(e, s), KVH_ERR_IO);
    assert_int_equal(kvh_engine_close(dt_untrack(e)), KVH_ERR_IO);
    pthread_mutex_destroy(&log.mu);
}

/* A slab file removed or renamed under a running engine: a persist into
 * it said OK, and the reopen made an empty slab in its place and found
 * none of those blocks. The persist fails now and so does every later
 * one; the reopen names the missing slab. */
static void test_persist_after_a_slab_was_removed_or_renamed(void **state)
{
    (void)state;
    for (int renamed = 0; renamed <= 1; renamed++) {
        char dir[512], path[600], moved[600];
        dt_scratch(renamed ? "slab-renamed" : "slab-removed", dir, sizeof(dir));
        kvh_config c = dt_cfg(G, dir, 16, 8, 64, 0);
        kvh_engine *e = dt_open_a(&c);
        kvh_seq s;
        dt_assert_ok(dt_build(e, G, dt_plain(911), 2 * G.bt, 0, &s));
        dt_assert_ok(kvh_seq_persist(e, s));
        dt_path(path, sizeof(path), dir, "slab-0000.kvh");
        if (renamed)
            assert_int_equal(rename(path, dt_path(moved, sizeof(moved), dir, "slab-moved")), 0);
        else
            assert_int_equal(unlink(path), 0);
        dt_assert_ok(dt_build(e, G, dt_plain(912), 2 * G.bt, 0, &s));
        assert_int_equal(kvh_seq_persist(e, s), KVH_ERR_IO);
        if (!strstr(kvh_last_error(), "slab file"))
            fail_msg("persist after the slab went: %s", kvh_last_error());
        dt_assert_ok(dt_build(e, G, dt_plain(913), 2 * G.bt, 0, &s));
        assert_int_equal(kvh_seq_persist(e, s), KVH_ERR_IO);
        assert_int_equal(kvh_engine_close(dt_untrack(e)), KVH_ERR_IO);
        dt_log log;
        dt_log_init(&log);
        kvh_config logged = c;
        dt_log_attach(&logged, &log);
        e = dt_open_a(&logged);
        assert_int_equal(dt_log_count(&log, KVH_LOG_WARN, "slab-0000.kvh is missing", NULL), 1);
        assert_true(dt_stats(e).corrupt_blocks > 0);
        dt_assert_ok(dt_close(dt_untrack(e)));
        pthread_mutex_destroy(&log.mu);
    }
}

/* A store directory kvh makes is durable only once its parent's entry
 * for it is: that fsync comes first, and its failure fails the open. */
static void test_a_new_store_syncs_the_directory_holding_it(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("new-dir-sync", dir, sizeof(dir));
    dt_rmrf(dir); /* the store makes it */
    kvh_config c = dt_cfg(G, dir, 16, 8, 64, 0);
    arm(KVHI_OP_DIRSYNC, 1, -EIO, false);
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&c, &e);
    dt_track(e);
    char err[256];
    snprintf(err, sizeof(err), "%s", kvh_last_error());
    disarm();
    assert_int_equal(st, KVH_ERR_IO);
    if (!strstr(err, "cannot sync the directory holding"))
        fail_msg("open with the first directory sync failing: %s", err);
    /* Removed again: the next open makes it, and syncs its entry, anew. */
    struct stat st_dir;
    assert_int_equal(stat(dir, &st_dir), -1);
    arm(KVHI_OP_DIRSYNC, 1, -EIO, false);
    e = NULL;
    st = kvh_engine_open(&c, &e);
    dt_track(e);
    disarm();
    assert_int_equal(st, KVH_ERR_IO);
    e = dt_open_a(&c); /* once it can, the store is made */
    dt_assert_ok(dt_close(dt_untrack(e)));
}

/* A slab that failed to sync may have lost what its slots were given:
 * close writes no index naming them (it says so), and the store keeps
 * what was durable before. */
static void test_close_after_a_failed_slab_sync_writes_no_index(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("slab-sync-failed", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 16, 8, 64, 0);
    kvh_engine *e = dt_open_a(&c);
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, dt_plain(911), 2 * G.bt, 0, &s));
    dt_assert_ok(kvh_seq_persist(e, s));
    dt_assert_ok(dt_build(e, G, dt_plain(912), 2 * G.bt, 0, &s));
    arm(KVHI_OP_FSYNC, 1, -EIO, false); /* the slab's, first in a persist */
    assert_int_equal(kvh_seq_persist(e, s), KVH_ERR_IO);
    disarm();
    assert_int_equal(kvh_engine_close(dt_untrack(e)), KVH_ERR_IO);
    e = dt_open_a(&c);
    size_t m = 0;
    char msg[256] = "";
    if (dt_match_verify(e, G, dt_plain(911), 2 * G.bt, &m, msg, sizeof(msg)) != KVH_OK)
        fail_msg("%s", msg);
    assert_int_equal(m, 2 * G.bt);
    assert_int_equal(dt_stats(e).corrupt_blocks, 0);
    dt_assert_ok(dt_close(dt_untrack(e)));
}

/* A reset (KVH_DISK_RESET_ON_MISMATCH over a damaged index) cut short
 * after its new journal, before its new index: the store is the new
 * empty one, never the old index served beside a journal of another
 * store. */
static void test_a_reset_cut_short_serves_nothing_of_the_old_store(void **state)
{
    (void)state;
    char dir[512], path[600];
    dt_scratch("reset-cut", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 16, 8, 64, 0);
    kvh_engine *e = dt_open_a(&c);
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, dt_plain(921), 2 * G.bt, 0, &s));
    dt_assert_ok(kvh_seq_persist(e, s));
    dt_assert_ok(dt_close(dt_untrack(e)));
    assert_int_equal(dt_flip_bit(dt_path(path, sizeof(path), dir, "journal"), 20, 3), 0);
    kvh_config reset = c;
    reset.disk_strict_index = 1;
    reset.disk_flags |= KVH_DISK_RESET_ON_MISMATCH;
    arm(KVHI_OP_RENAME, 2, -EIO, false); /* the new index's, after the new journal's */
    e = NULL;
    kvh_status st = kvh_engine_open(&reset, &e);
    dt_track(e);
    disarm();
    assert_int_equal(st, KVH_ERR_IO);
    kvh_config strict = c;
    strict.disk_strict_index = 1;
    e = dt_open_a(&strict);
    size_t m = 0;
    kvh_seq found;
    dt_assert_ok(dt_match(e, dt_plain(921), 2 * G.bt, &found, &m));
    assert_int_equal(m, 0);
    dt_assert_ok(dt_close(dt_untrack(e)));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_nospace_small_disk_all_referenced, setup, teardown),
        cmocka_unit_test_setup_teardown(test_nospace_is_not_spurious, setup, teardown),
        cmocka_unit_test_setup_teardown(test_nospace_full_filesystem, setup, teardown_tmpfs),
        cmocka_unit_test_setup_teardown(test_nospace_injected_write_error, setup, teardown),
        cmocka_unit_test_setup_teardown(test_nospace_injected_filesystem_full, setup, teardown),
        cmocka_unit_test_setup_teardown(test_nospace_injected_quota_full, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fsync_failure_is_fatal, setup, teardown),
        cmocka_unit_test_setup_teardown(test_index_fatal_during_a_persist_is_an_io_error, setup, teardown),
        cmocka_unit_test_setup_teardown(test_more_slabs_than_open_files, setup, teardown),
        cmocka_unit_test_setup_teardown(test_no_room_names_a_full_file_system, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fault_sweep, setup, teardown),
        cmocka_unit_test_setup_teardown(test_transient_read_error_keeps_durable_blocks, setup, teardown),
        cmocka_unit_test_setup_teardown(test_a_failed_fold_does_not_fail_the_persist, setup, teardown),
        cmocka_unit_test_setup_teardown(test_a_fold_during_a_journal_sync_keeps_a_removed_store_failed, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_a_file_size_limit_is_said_as_such, setup, teardown),
        cmocka_unit_test_setup_teardown(test_close_after_the_journal_was_removed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_persist_after_a_slab_was_removed_or_renamed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_a_new_store_syncs_the_directory_holding_it, setup, teardown),
        cmocka_unit_test_setup_teardown(test_close_after_a_failed_slab_sync_writes_no_index, setup, teardown),
        cmocka_unit_test_setup_teardown(test_a_reset_cut_short_serves_nothing_of_the_old_store, setup, teardown),
    };
    return cmocka_run_group_tests_name("disk_faults", tests, NULL, group_teardown);
}
