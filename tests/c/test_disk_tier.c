/* The disk tier inside the engine (core/disk_tier.c), white-box: the
 * index files are read back with the library's own decoders, and the
 * hooks a move calls (after_move, keep_as_copy, forget), the cleaner and
 * verification in place are called directly, on engines without
 * migration workers.
 *
 *   - persist, journal, snapshot, reopen: persist writes clean copies and
 *     one ADD record each, naming the copy's slot, hash and data CRC (the
 *     partial last block none), into the journal, not the snapshot; a
 *     second persist adds nothing; a clean close moves the records into
 *     the snapshot and empties the journal; a reopen turns them into
 *     unreferenced published blocks on disk at those slots;
 *   - the records follow the blocks: a promotion of a journaled block
 *     keeps its slot as a clean copy and writes nothing, forgetting it
 *     writes a DEL and frees the slot, a spilled mutable block gets no
 *     record, a demoted published one an ADD; a demotion recalled
 *     during its write leaves the block in memory with the written slot
 *     as its clean copy (an unhashed one gives the slot back);
 *   - the cleaner (kvhi_disk_clean_step): nothing while the host tier
 *     has room, then clean copies of the published host blocks (pinned
 *     and unpublished ones skipped); blocks that arrive, or are
 *     published, in the host tier are its leads, and each lead pays its
 *     clock hand for a few records of the table, never a whole sweep;
 *     the evictions that follow write nothing;
 *   - a journal past 4096 records and twice the used slots is folded
 *     into a new snapshot by the next persist;
 *   - verification in place: a damaged block is marked corrupt
 *     (unpublished, counted), good ones are untouched, an unreadable one
 *     is a miss but not counted as damage, and nothing moves.
 * test_disk_roundtrip.c, test_disk_corruption.c and test_stats.c cover
 * the same through the public API. */
#include <stdatomic.h>

#include "disk_test_util.h"

#include "core/block_state.h"
#include "core/disk_index.h"
#include "core/disk_io.h"
#include "core/engine.h"
#include "white_box_util.h"
#include "core/move.h"
#include "core/block.h"
#include "core/disk_tier.h"
#include "core/clean_copy.h"

static const dt_geo G = {2, 1, 32, 16, KVH_DTYPE_F16}; /* block = 4096 bytes */

static struct {
    atomic_int count[KVHI_OP_COUNT];
    atomic_int fail_reads;
} H;

static int hook(enum kvhi_disk_op op, void *user)
{
    (void)user;
    atomic_fetch_add(&H.count[op], 1);
    return op == KVHI_OP_READ && atomic_load(&H.fail_reads) ? -EIO : 0;
}

/* Writes wait here while hold_writes is set (the cleaner's copy, caught
 * in flight). */
static atomic_int hold_writes;

static int holding_hook(enum kvhi_disk_op op, void *user)
{
    (void)user;
    while (op == KVHI_OP_WRITE && atomic_load(&hold_writes))
        usleep(1000);
    return 0;
}

static void hook_on(void)
{
    for (int i = 0; i < KVHI_OP_COUNT; i++)
        atomic_store(&H.count[i], 0);
    atomic_store(&H.fail_reads, 0);
    kvhi_disk_set_fault_hook(hook, NULL);
}

static int teardown(void **state)
{
    wb_release_held_lock();
    kvhi_disk_set_fault_hook(NULL, NULL);
    return dt_teardown(state);
}

/* ---- the index files ---- */

#define MAX_RECS 64
typedef struct recs {
    uint32_t kind; /* of the file: 1 snapshot, 2 journal */
    uint64_t n_header;
    int n;
    kvhi_index_rec r[MAX_RECS];
    int32_t tokens[MAX_RECS][16];
} recs;

/* Decodes `name` of the store in dir: its header and every record (each
 * must pass its checksum). */
static void read_recs(const char *dir, const char *name, recs *out)
{
    char p[PATH_MAX + 16];
    size_t len = 0;
    uint8_t *buf = dt_read_file(dt_path(p, sizeof(p), dir, name), &len);
    assert_non_null(buf);
    assert_true(len >= 4096);
    kvhi_index_header h;
    assert_int_equal(kvhi_index_header_decode(buf, len, &h), 0);
    out->kind = h.kind;
    out->n_header = h.n_records;
    size_t rb = kvhi_index_rec_bytes(G.bt);
    assert_int_equal((len - 4096) % rb, 0);
    out->n = (int)((len - 4096) / rb);
    assert_true(out->n <= MAX_RECS);
    for (int i = 0; i < out->n; i++) {
        out->r[i].tokens = out->tokens[i];
        if (kvhi_index_rec_decode(buf + 4096 + (size_t)i * rb, &out->r[i], G.bt) != 0)
            fail_msg("%s: record %d fails its check", name, i);
    }
    free(buf);
}

/* Index of the record of `kind` naming slot, or -1. */
static int find_rec(const recs *rs, uint32_t kind, uint32_t slot)
{
    int at = -1;
    for (int i = 0; i < rs->n; i++)
        if (rs->r[i].kind == kind && rs->r[i].slot == slot) {
            assert_int_equal(at, -1); /* one such record */
            at = i;
        }
    return at;
}

static uint32_t live_on_disk(kvh_engine *e)
{
    uint32_t n = 0;
    wb_lock(e);
    for (uint32_t b = 0; b < e->block_cap; b++)
        n += (e->blocks[b].flags & KVHI_BF_LIVE) && e->blocks[b].tier == KVH_TIER_DISK;
    wb_unlock(e);
    return n;
}

static void flush(kvh_engine *e) { assert_int_equal(kvhi_index_flush(e->disk), 0); }

static void match_a(kvh_engine *e, dt_content c, size_t n, size_t want)
{
    size_t m = 0;
    char msg[256] = "";
    if (dt_match_verify(e, G, c, n, &m, msg, sizeof(msg)) != KVH_OK)
        fail_msg("%s", msg);
    assert_int_equal(m, want);
}

/* ---- persist, journal, snapshot, reopen ---- */

static void test_persist_journal_snapshot_reopen(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("persist", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 8, 8, 32, 0);
    kvh_engine *e = dt_open_a(&c);
    dt_content ct = dt_plain(1);
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, ct, 3 * G.bt + G.bt / 2, 0, &s)); /* 3 full blocks and a half */
    dt_assert_ok(kvh_seq_persist(e, s));
    uint32_t slot[3], crc[3];
    uint64_t hash[3];
    const uint16_t durable = KVHI_BF_JOURNALED | KVHI_BF_DISK_COPY | KVHI_BF_DISK_HASHED;
    for (int i = 0; i < 4; i++) {
        uint32_t b = wb_seq_block_index(e, s, (uint64_t)i);
        kvhi_block *blk = kvhi_blk(e, b);
        if (i == 3) {
            assert_int_equal(blk->flags & durable, 0); /* the partial block is not persisted */
            continue;
        }
        assert_int_equal(blk->flags & durable, durable);
        assert_int_equal(blk->tier, KVH_TIER_DEVICE); /* copies: the blocks stay */
        slot[i] = blk->disk_copy;
        crc[i] = blk->data_crc;
        hash[i] = blk->hash;
    }
    assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, 3);
    recs j, x;
    read_recs(dir, "journal", &j);
    read_recs(dir, "index", &x);
    assert_int_equal(j.kind, 2);
    assert_int_equal(x.kind, 1);
    assert_int_equal(x.n, 0);
    assert_int_equal(j.n, 3);
    for (int i = 0; i < 3; i++) {
        int k = find_rec(&j, KVHI_REC_ADD, slot[i]);
        assert_true(k >= 0);
        assert_int_equal(j.r[k].hash, hash[i]);
        assert_int_equal(j.r[k].data_crc, crc[i]);
        assert_int_equal(j.r[k].n_tokens, G.bt);
        assert_int_equal(j.r[k].parent, i ? hash[i - 1] : 0);
        assert_int_equal(j.tokens[k][0], dt_token(ct, (uint64_t)i * G.bt));
    }
    /* Persisting again records nothing new. */
    dt_assert_ok(kvh_seq_persist(e, s));
    read_recs(dir, "journal", &j);
    assert_int_equal(j.n, 3);
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));

    /* A clean close: the snapshot holds them, the journal is empty. */
    read_recs(dir, "journal", &j);
    read_recs(dir, "index", &x);
    assert_int_equal(j.n, 0);
    assert_int_equal(x.n, 3);
    assert_int_equal(x.n_header, 3);
    for (int i = 0; i < 3; i++) {
        int k = find_rec(&x, KVHI_REC_ADD, slot[i]);
        assert_true(k >= 0);
        assert_int_equal(x.r[k].hash, hash[i]);
        assert_int_equal(x.r[k].data_crc, crc[i]);
    }

    /* Reopened: cached blocks on disk, at those slots. */
    e = dt_open_a(&c);
    assert_int_equal(live_on_disk(e), 3);
    assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, 3);
    assert_int_equal(dt_stats(e).blocks_allocated, 3);
    wb_lock(e);
    for (int i = 0; i < 3; i++) {
        uint32_t b = kvhi_prefix_find(&e->prefix, hash[i]);
        assert_true(b != KVHI_PREFIX_MISS);
        kvhi_block *blk = kvhi_blk(e, b);
        const uint16_t want = KVHI_BF_LIVE | KVHI_BF_PUBLISHED | KVHI_BF_HASHED | KVHI_BF_KV_COMPLETE |
                              KVHI_BF_JOURNALED | KVHI_BF_DISK_HASHED;
        assert_int_equal(blk->flags, want);
        assert_int_equal(blk->tier, KVH_TIER_DISK);
        assert_int_equal(blk->slot, slot[i]);
        assert_int_equal(blk->data_crc, crc[i]);
        assert_int_equal(blk->refs, 0);
        assert_true(blk->heap_pos != KVHI_HEAP_NONE);
    }
    wb_unlock(e);
    match_a(e, ct, 3 * G.bt + G.bt / 2, 3 * G.bt); /* byte for byte; not the half block */
    dt_assert_ok(dt_close(e));
}

/* A store opened with fewer slots than it was made with: the blocks past
 * them were dropped without a word (a persist's promise broken silently).
 * Now a warning says how many; the same size or a larger one says
 * nothing. */
static void test_opened_smaller_says_what_it_drops(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("shrunk", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 8, 8, 32, 0);
    kvh_engine *e = dt_open_a(&c);
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, dt_plain(3), 20 * G.bt, 0, &s));
    dt_assert_ok(kvh_seq_persist(e, s));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
    recs x;
    read_recs(dir, "index", &x);
    assert_int_equal(x.n, 20);
    int past = 0;
    for (int i = 0; i < x.n; i++)
        past += x.r[i].slot >= 8;
    assert_true(past > 0);
    for (int round = 0; round < 3; round++) {
        uint64_t slots = round == 0 ? 32 : round == 1 ? 64 : 8;
        kvh_config o = dt_cfg(G, dir, 8, 8, slots, 0);
        dt_log log;
        dt_log_init(&log);
        dt_log_attach(&o, &log);
        e = dt_open_a(&o);
        char want[64];
        snprintf(want, sizeof(want), "%d blocks lay in slots past the 8", past);
        assert_int_equal(dt_log_count(&log, KVH_LOG_WARN, "dropped", NULL), round == 2);
        if (round == 2 && dt_log_count(&log, KVH_LOG_WARN, want, dir, NULL) != 1)
            fail_msg("no warning \"%s\": %s", want, log.n ? log.line[0] : "(none)");
        assert_int_equal(live_on_disk(e), round == 2 ? 20 - past : 20);
        dt_assert_ok(dt_close(e));
    }
}

/* ---- records follow the blocks ---- */

static void test_records_follow_the_blocks(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("records", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 8, 8, 32, 0);
    kvh_engine *e = dt_open_a(&c);
    dt_content ct = dt_plain(2);
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, ct, 2 * G.bt, 0, &s));
    dt_assert_ok(kvh_seq_persist(e, s));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
    e = dt_open_a(&c);
    recs j;
    read_recs(dir, "journal", &j);
    assert_int_equal(j.n, 0);

    /* A promotion keeps the disk slot as a clean copy: no record. */
    int32_t tk[2 * 16];
    dt_tokens(ct, 0, 2 * G.bt, tk);
    kvh_block h[2];
    size_t n = 0;
    dt_assert_ok(kvh_prefix_lookup(e, tk, 2 * G.bt, h, 2, &n));
    assert_int_equal(n, 2);
    uint32_t b0 = wb_block_index(e, h[0]);
    kvhi_block *blk = kvhi_blk(e, b0);
    uint32_t slot0 = blk->slot;
    dt_assert_ok(kvh_migrate(e, h, 1, KVH_TIER_HOST, NULL));
    assert_int_equal(blk->tier, KVH_TIER_HOST);
    assert_true(blk->flags & KVHI_BF_DISK_COPY);
    assert_true(blk->flags & KVHI_BF_JOURNALED);
    assert_int_equal(blk->disk_copy, slot0);
    assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, 2);
    flush(e);
    read_recs(dir, "journal", &j);
    assert_int_equal(j.n, 0);
    /* Forgetting it: a DEL for that slot, the slot free. */
    wb_lock(e);
    kvhi_disk_forget(e, b0);
    assert_false(blk->flags & (KVHI_BF_DISK_COPY | KVHI_BF_JOURNALED));
    assert_int_equal(blk->disk_copy, KVHI_NO_BLOCK);
    wb_unlock(e);
    assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, 1);
    flush(e);
    read_recs(dir, "journal", &j);
    assert_int_equal(j.n, 1);
    assert_int_equal(find_rec(&j, KVHI_REC_DEL, slot0), 0);

    /* A mutable (partial) block spilled and read back: no record, and
     * its slot is given back. */
    kvh_seq p;
    dt_content pc = dt_plain(3);
    dt_assert_ok(dt_build(e, G, pc, G.bt / 2, 0, &p));
    dt_assert_ok(kvh_seq_migrate(e, p, 0, G.bt / 2, KVH_TIER_DISK, NULL));
    assert_int_equal(dt_binfo(e, p, 0).tier, KVH_TIER_DISK);
    assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, 2);
    dt_assert_ok(kvh_seq_migrate(e, p, 0, G.bt / 2, KVH_TIER_HOST, NULL));
    assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, 1);
    uint32_t pb = wb_seq_block_index(e, p, 0);
    assert_false(kvhi_blk(e, pb)->flags & (KVHI_BF_DISK_COPY | KVHI_BF_JOURNALED));
    /* A published block demoted (never persisted): an ADD record. */
    kvh_seq q;
    dt_content qc = dt_plain(4);
    dt_assert_ok(dt_build(e, G, qc, G.bt, 0, &q));
    dt_assert_ok(kvh_seq_migrate(e, q, 0, G.bt, KVH_TIER_DISK, NULL));
    uint32_t qb = wb_seq_block_index(e, q, 0);
    assert_true(kvhi_blk(e, qb)->flags & KVHI_BF_JOURNALED);
    flush(e);
    read_recs(dir, "journal", &j);
    assert_int_equal(j.n, 2);
    assert_int_equal(find_rec(&j, KVHI_REC_ADD, kvhi_blk(e, qb)->slot), 1);
    assert_int_equal(j.r[1].hash, kvhi_blk(e, qb)->hash);

    /* Demotions called off during their write (kvhi_block_recall): the
     * block stays; the written slot becomes its clean copy when it is
     * immutable and written with its hash, else it is freed. */
    kvh_seq r;
    dt_content rc = dt_plain(5);
    dt_assert_ok(dt_build(e, G, rc, G.bt + G.bt / 2, 0, &r)); /* a full block and a partial one */
    uint32_t rb[2] = {wb_seq_block_index(e, r, 0), wb_seq_block_index(e, r, 1)};
    kvh_stats a = dt_stats(e);
    uint64_t disk0 = dt_tier(e, KVH_TIER_DISK).used_blocks;
    uint32_t written[2];
    wb_lock(e);
    for (int i = 0; i < 2; i++) {
        kvhi_block *rbk = kvhi_blk(e, rb[i]);
        uint8_t tier = rbk->tier;
        uint32_t s0 = rbk->slot;
        kvhi_xfer x;
        assert_int_equal(kvhi_move_begin(e, rb[i], KVH_TIER_DISK, &x, false), 0);
        assert_int_equal(kvhi_move_state(rbk), KVHI_MS_DEMOTING);
        assert_true(kvhi_block_recall(e, rb[i]));
        assert_int_equal(kvhi_move_state(rbk), KVHI_MS_RECALLED);
        assert_true(kvhi_block_in_device(e, rb[i]) == (tier == KVH_TIER_DEVICE));
        written[i] = x.dst_slot;
        kvhi_unlock_for_copy(e);
        kvhi_xfer_run(e, &x);
        kvhi_relock_after_copy(e);
        assert_int_equal(x.err, 0);
        dt_assert_ok(kvhi_move_end(e, &x, NULL));
        assert_int_equal(rbk->tier, tier);
        assert_int_equal(rbk->slot, s0);
        assert_int_equal(kvhi_move_state(rbk), KVHI_MS_IDLE);
    }
    kvhi_block *full = kvhi_blk(e, rb[0]), *part = kvhi_blk(e, rb[1]);
    assert_true(full->flags & KVHI_BF_DISK_COPY);
    assert_int_equal(full->disk_copy, written[0]);
    assert_true(full->flags & KVHI_BF_JOURNALED);
    assert_false(part->flags & (KVHI_BF_DISK_COPY | KVHI_BF_JOURNALED));
    wb_unlock(e);
    kvh_stats d = dt_stats(e);
    assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, disk0 + 1); /* the partial one's slot came back */
    assert_int_equal(d.disk_copies_written - a.disk_copies_written, 1);
    assert_int_equal(d.bytes_disk_copies_written - a.bytes_disk_copies_written, dt_block_bytes(G));
    assert_int_equal(d.blocks_host_to_disk, a.blocks_host_to_disk); /* not moves */
    flush(e);
    read_recs(dir, "journal", &j);
    assert_int_equal(j.n, 3);
    assert_int_equal(find_rec(&j, KVHI_REC_ADD, written[0]), 2);
    assert_int_equal(find_rec(&j, KVHI_REC_ADD, written[1]), -1);
    dt_assert_verified(e, r, G, rc, 0, G.bt + G.bt / 2);
    dt_assert_ok(kvh_block_release(e, h[0]));
    dt_assert_ok(kvh_block_release(e, h[1]));
    dt_assert_ok(kvh_seq_free(e, p));
    dt_assert_ok(kvh_seq_free(e, q));
    dt_assert_ok(kvh_seq_free(e, r));
    dt_assert_ok(dt_close(e));
    /* What the records say is what a new engine finds: block 1 of the
     * first chain, q's block, r's full block; not block 0 (forgotten). */
    e = dt_open_a(&c);
    assert_int_equal(live_on_disk(e), 3);
    match_a(e, ct, 2 * G.bt, 0);
    match_a(e, qc, G.bt, G.bt);
    match_a(e, rc, G.bt, G.bt);
    dt_assert_ok(dt_close(e));
}

/* ---- the cleaner ---- */

/* The cleaner writing the disk copy of an unreferenced host block makes
 * that block busy, out of the victim order, for the length of the write.
 * A host slot wanted meanwhile must wait for it, not send a referenced
 * block to disk in its place (kvh.h: unreferenced blocks leave first). */
typedef struct clean_run {
    kvh_engine *e;
    kvh_seq s;
    atomic_int done;
    kvh_status st;
} clean_run;

static void *run_clean_step(void *arg)
{
    clean_run *r = arg;
    wb_lock(r->e);
    kvhi_disk_clean_step(r->e);
    wb_unlock(r->e);
    atomic_store(&r->done, 1);
    return NULL;
}

static void *run_demote_last(void *arg)
{
    clean_run *r = arg;
    r->st = kvh_seq_migrate(r->e, r->s, 16 * G.bt, G.bt, KVH_TIER_HOST, NULL);
    atomic_store(&r->done, 1);
    return NULL;
}

static void test_victim_waits_for_cleaned_unreferenced_block(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("victim-wait", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 2, 16, 64, 0);
    kvh_engine *e = dt_open_a(&c);
    kvh_seq s, u;
    /* 17 referenced blocks: two on the device, 15 on the host, each of
     * those given its disk copy now. */
    dt_assert_ok(dt_build(e, G, dt_plain(6), 17 * G.bt, 0, &s));
    wb_lock(e);
    assert_true(kvhi_disk_clean_step(e));
    wb_unlock(e);
    /* One unreferenced published block in the last free host slot, with
     * no disk copy yet. */
    dt_assert_ok(dt_build(e, G, dt_plain(7), G.bt, 0, &u));
    uint32_t ub = wb_seq_block_index(e, u, 0);
    dt_assert_ok(kvh_seq_migrate(e, u, 0, G.bt, KVH_TIER_HOST, NULL));
    dt_assert_ok(kvh_seq_free(e, u));
    uint32_t b[17];
    int s_on_disk = 0;
    for (int i = 0; i < 17; i++)
        b[i] = wb_seq_block_index(e, s, (uint64_t)i);
    wb_lock(e);
    for (int i = 0; i < 17; i++)
        s_on_disk += kvhi_blk(e, b[i])->tier == KVH_TIER_DISK;
    kvhi_block *ublk = kvhi_blk(e, ub);
    assert_int_equal(ublk->tier, KVH_TIER_HOST);
    assert_int_equal(ublk->refs, 0);
    assert_true(ublk->flags & KVHI_BF_PUBLISHED);
    assert_false(ublk->flags & KVHI_BF_DISK_COPY);
    assert_int_equal(kvhi_blk(e, b[16])->tier, KVH_TIER_DEVICE);
    assert_int_equal(e->tiers[KVH_TIER_HOST].slots.free_count, 0);
    wb_unlock(e);

    /* The cleaner starts on the unreferenced block and is held in its write. */
    atomic_store(&hold_writes, 1);
    kvhi_disk_set_fault_hook(holding_hook, NULL);
    clean_run cleaner = {.e = e}, demote = {.e = e, .s = s};
    pthread_t ct, dt;
    assert_int_equal(pthread_create(&ct, NULL, run_clean_step, &cleaner), 0);
    for (int busy = 0; !busy;) {
        wb_lock(e);
        busy = kvhi_move_state(ublk) == KVHI_MS_COPYING && e->copies_in_progress > 0;
        wb_unlock(e);
        if (!busy)
            usleep(1000);
    }
    /* A host slot is wanted while the write is held: the demotion either
     * takes a referenced victim and ends, or waits for the copy. */
    assert_int_equal(pthread_create(&dt, NULL, run_demote_last, &demote), 0);
    uint64_t waits = 0;
    for (int i = 0; i < 10000 && !atomic_load(&demote.done) && !waits; i++) {
        wb_lock(e);
        waits = e->victim_copy_waits;
        wb_unlock(e);
        usleep(1000);
    }
    atomic_store(&hold_writes, 0);
    assert_int_equal(pthread_join(ct, NULL), 0);
    assert_int_equal(pthread_join(dt, NULL), 0);
    kvhi_disk_set_fault_hook(NULL, NULL);
    dt_assert_ok(demote.st);

    wb_lock(e);
    int s_on_disk_after = 0;
    for (int i = 0; i < 17; i++)
        s_on_disk_after += kvhi_blk(e, b[i])->tier == KVH_TIER_DISK;
    assert_int_equal(kvhi_blk(e, b[16])->tier, KVH_TIER_HOST);
    /* The unreferenced block left, with the copy just written; no
     * referenced one did. */
    assert_int_equal(ublk->tier, KVH_TIER_DISK);
    assert_int_equal(s_on_disk_after, s_on_disk);
    assert_null(e->disk_copy_batches);
    wb_unlock(e);
    assert_true(waits > 0);
    dt_assert_verified(e, s, G, dt_plain(6), 0, 17 * G.bt);
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
}

static void test_cleaner(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("cleaner", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 2, 16, 64, 0);
    kvh_engine *e = dt_open_a(&c);
    dt_content ct = dt_plain(6);
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, ct, 4 * G.bt, 0, &s));
    wb_lock(e);
    assert_false(kvhi_disk_clean_step(e)); /* the host tier has room */
    wb_unlock(e);
    assert_int_equal(dt_stats(e).disk_copies_written, 0);
    /* 16 full blocks and a partial one: the device holds the newest two,
     * the host the other 15; then the partial one goes to the host too:
     * no free host slot. Block 0, the oldest, is pinned. */
    dt_assert_ok(dt_extend(e, s, G, ct, 4 * G.bt, 12 * G.bt + G.bt / 2));
    dt_assert_ok(kvh_seq_migrate(e, s, 16 * G.bt, G.bt / 2, KVH_TIER_HOST, NULL));
    kvh_block h0;
    dt_assert_ok(kvh_seq_blocks(e, s, 0, 1, &h0));
    dt_assert_ok(kvh_block_pin(e, h0, 1));
    assert_int_equal(dt_tier(e, KVH_TIER_HOST).used_blocks, 16);
    uint32_t b[17];
    for (int i = 0; i < 17; i++)
        b[i] = wb_seq_block_index(e, s, (uint64_t)i);
    assert_int_equal(kvhi_blk(e, b[15])->tier, KVH_TIER_DEVICE);
    assert_int_equal(kvhi_blk(e, b[16])->tier, KVH_TIER_HOST);
    kvh_stats a = dt_stats(e);
    wb_lock(e);
    assert_true(kvhi_disk_clean_step(e));
    int copies = 0;
    for (int i = 0; i < 17; i++) {
        kvhi_block *blk = kvhi_blk(e, b[i]);
        bool cleaned = (blk->flags & KVHI_BF_DISK_COPY) != 0;
        bool expect = i >= 1 && i <= 14; /* published host blocks, not pinned */
        if (cleaned != expect)
            fail_msg("block %d (tier %u, flags 0x%x): %s a clean copy", i, blk->tier, blk->flags,
                     cleaned ? "got" : "did not get");
        if (cleaned) {
            assert_true(blk->flags & KVHI_BF_JOURNALED);
            assert_true(blk->flags & KVHI_BF_DISK_HASHED);
            assert_int_equal(blk->tier, KVH_TIER_HOST);
            assert_int_equal(kvhi_move_state(blk), KVHI_MS_IDLE);
        }
        copies += cleaned;
    }
    assert_int_equal(copies, 14);
    /* Nothing left to clean. */
    assert_false(kvhi_disk_clean_step(e));
    wb_unlock(e);
    kvh_stats d = dt_stats(e);
    assert_int_equal(d.disk_copies_written - a.disk_copies_written, 14);
    assert_int_equal(d.bytes_disk_copies_written - a.bytes_disk_copies_written, 14 * dt_block_bytes(G));
    assert_int_equal(d.blocks_host_to_disk, a.blocks_host_to_disk);
    assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, 14);
    assert_int_equal(dt_tier(e, KVH_TIER_HOST).used_blocks, 16);
    /* The partial block is completed where it lies: published there, it
     * is a lead, and the next step cleans it ... */
    dt_assert_ok(dt_extend(e, s, G, ct, 16 * G.bt + G.bt / 2, G.bt / 2));
    assert_true(kvhi_blk(e, b[16])->flags & KVHI_BF_PUBLISHED);
    assert_int_equal(kvhi_blk(e, b[16])->tier, KVH_TIER_HOST);
    wb_lock(e);
    assert_true(kvhi_disk_clean_step(e));
    assert_true(kvhi_blk(e, b[16])->flags & KVHI_BF_DISK_COPY);
    assert_false(kvhi_disk_clean_step(e));
    wb_unlock(e);
    /* ... and so is a block that arrives: block 15 comes down (block 1
     * leaving for its copy). */
    dt_assert_ok(kvh_seq_migrate(e, s, 15 * G.bt, G.bt, KVH_TIER_HOST, NULL));
    assert_int_equal(kvhi_blk(e, b[1])->tier, KVH_TIER_DISK);
    wb_lock(e);
    assert_true(kvhi_disk_clean_step(e));
    assert_true(kvhi_blk(e, b[15])->flags & KVHI_BF_DISK_COPY);
    wb_unlock(e);
    d = dt_stats(e);
    assert_int_equal(d.disk_copies_written - a.disk_copies_written, 16);
    assert_int_equal(d.blocks_host_to_disk, a.blocks_host_to_disk);
    assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, 16);
    /* The evictions that follow find their copies: four new blocks (two
     * in free device slots) push two host blocks to disk, and nothing is
     * written. */
    hook_on();
    kvh_seq t;
    dt_assert_ok(dt_build(e, G, dt_plain(7), 4 * G.bt, 0, &t));
    kvh_stats f = dt_stats(e);
    assert_int_equal(atomic_load(&H.count[KVHI_OP_WRITE]), 0);
    assert_int_equal(f.blocks_host_to_disk, d.blocks_host_to_disk);
    assert_int_equal(f.disk_copies_written, d.disk_copies_written);
    assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, 16);
    int on_disk = 0;
    for (int i = 0; i < 17; i++)
        on_disk += kvhi_blk(e, b[i])->tier == KVH_TIER_DISK;
    assert_int_equal(on_disk, 1 + 2);
    assert_int_equal(kvhi_blk(e, b[0])->tier, KVH_TIER_HOST); /* pinned */
    kvhi_disk_set_fault_hook(NULL, NULL);
    dt_assert_verified(e, s, G, ct, 0, 17 * G.bt);
    wb_check_disk_copies(e);
    dt_assert_ok(kvh_block_pin(e, h0, 0));
    dt_assert_ok(kvh_seq_free(e, t));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
}

/* The cleaner's wake-up (block placement in the host tier, core/block.c)
 * counts kept clean host copies as room, as the cleaner itself does: a
 * host tier whose slots hold such copies is not running low. The probe
 * waits on work_ready as a worker would; the engine has none, so the
 * placement runs with one pretended, under the lock, where no job can be
 * queued for it. */
typedef struct wake_probe {
    kvh_engine *e;
    atomic_int waiting;
    bool woken;
} wake_probe;

static void *wait_for_work_ready(void *arg)
{
    wake_probe *p = arg;
    pthread_mutex_lock(&p->e->lock);
    atomic_store(&p->waiting, 1);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 1;
    p->woken = pthread_cond_timedwait(&p->e->work_ready, &p->e->lock, &until) == 0;
    pthread_mutex_unlock(&p->e->lock);
    return NULL;
}

/* Demotes b (in the device tier, with a kept host copy) onto its copy and
 * says whether that woke a worker. */
static bool clean_demote_wakes_worker(kvh_engine *e, uint32_t b)
{
    wake_probe p = {.e = e};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, wait_for_work_ready, &p), 0);
    while (!atomic_load(&p.waiting))
        usleep(100);
    wb_lock(e); /* taken once the probe waits */
    assert_int_equal(kvhi_blk(e, b)->tier, KVH_TIER_DEVICE);
    assert_int_not_equal(e->clean.slot_of[b], KVHI_NO_BLOCK);
    uint32_t workers = e->n_workers;
    e->n_workers = 1;
    kvhi_clean_demote(e, b, NULL);
    e->n_workers = workers;
    assert_int_equal(kvhi_blk(e, b)->tier, KVH_TIER_HOST);
    wb_unlock(e);
    assert_int_equal(pthread_join(t, NULL), 0);
    return p.woken;
}

static void test_cleaner_wakeup_counts_kept_copies(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("cleaner-wakeup", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 4, 8, 32, 0);
    c.copy_moves = 1; /* two arenas: promotions keep host copies */
    kvh_engine *e = dt_open_a(&c);
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, dt_plain(8), 8 * G.bt, 0, &s));
    dt_assert_ok(kvh_seq_migrate(e, s, 0, 8 * G.bt, KVH_TIER_HOST, NULL));
    uint32_t b0 = wb_seq_block_index(e, s, 0);
    /* One copy kept, no free slot: the demotion onto it leaves the host
     * tier with no room at all, and a worker is woken. */
    dt_assert_ok(kvh_seq_acquire(e, s, 0, G.bt, NULL));
    dt_assert_ok(kvh_seq_release(e, s, 0, G.bt));
    assert_int_equal(dt_tier(e, KVH_TIER_HOST).clean_copies, 1);
    wb_lock(e);
    assert_int_equal(e->tiers[KVH_TIER_HOST].slots.free_count, 0);
    wb_unlock(e);
    assert_true(clean_demote_wakes_worker(e, b0));
    /* Four copies kept, no free slot: after the demotion three copies are
     * still room to take back, well above an eighth of the tier. */
    dt_assert_ok(kvh_seq_acquire(e, s, 0, 4 * G.bt, NULL));
    dt_assert_ok(kvh_seq_release(e, s, 0, 4 * G.bt));
    assert_int_equal(dt_tier(e, KVH_TIER_HOST).clean_copies, 4);
    wb_lock(e);
    assert_int_equal(e->tiers[KVH_TIER_HOST].slots.free_count, 0);
    wb_unlock(e);
    assert_false(clean_demote_wakes_worker(e, b0));
    assert_int_equal(dt_tier(e, KVH_TIER_HOST).clean_copies, 3);
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
}

/* A fresh store named name: a 2-block device tier, host and disk as
 * given, no migration workers (the tests call the cleaner themselves). */
static kvh_engine *open_store_with(const char *name, uint64_t host_blocks, uint64_t disk_slots, uint32_t workers)
{
    char dir[PATH_MAX];
    dt_scratch(name, dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 2, host_blocks, disk_slots, workers);
    return dt_open_a(&c);
}

static kvh_engine *open_store(const char *name, uint64_t host_blocks, uint64_t disk_slots)
{
    return open_store_with(name, host_blocks, disk_slots, 0);
}

/* A new sequence *u of one published block, in the host tier without a
 * disk copy (dt_plain(10)); its record. */
static uint32_t uncleaned_host_block(kvh_engine *e, kvh_seq *u)
{
    dt_assert_ok(dt_build(e, G, dt_plain(10), G.bt, 0, u));
    dt_assert_ok(kvh_seq_migrate(e, *u, 0, G.bt, KVH_TIER_HOST, NULL));
    uint32_t ub = wb_seq_block_index(e, *u, 0);
    wb_lock(e);
    const kvhi_block *blk = kvhi_blk(e, ub);
    assert_int_equal(blk->tier, KVH_TIER_HOST);
    assert_true(blk->flags & KVHI_BF_PUBLISHED);
    assert_false(blk->flags & KVHI_BF_DISK_COPY);
    wb_unlock(e);
    return ub;
}

/* The hand's records scanned since h (it wraps at the table's end). */
static uint32_t hand_moved(kvh_engine *e, uint32_t h) { return (e->clean_hand + e->block_cap - h) % e->block_cap; }

/* A block read back into a full host tier, with nothing to clean, costs
 * the cleaner what it pays the hand, not a lead, nor a sweep of the
 * whole table under the lock; and a cleanable block that is no lead
 * (pushed out of the ring) is still found as the hand goes round. */
static void test_cleaner_sweeps_what_arrivals_pay_for(void **state)
{
    (void)state;
    kvh_engine *e = open_store("cleaner-bounded", 16, 1024);
    kvh_seq s;
    /* 40 published blocks, all sent to disk: each promotion back keeps
     * its disk copy, so nothing it brings is cleanable. */
    dt_assert_ok(dt_build(e, G, dt_plain(9), 40 * G.bt, 0, &s));
    dt_assert_ok(kvh_seq_migrate(e, s, 0, 40 * G.bt, KVH_TIER_DISK, NULL));
    dt_assert_ok(kvh_seq_migrate(e, s, 0, 16 * G.bt, KVH_TIER_HOST, NULL));
    wb_lock(e);
    assert_true(e->block_cap > 1000);
    assert_int_equal(e->tiers[KVH_TIER_HOST].slots.free_count, 0);
    while (kvhi_disk_clean_step(e))
        ;
    assert_int_equal(e->clean_leads_len, 0);
    assert_int_equal(e->clean_scan_credit, 0);
    wb_unlock(e);
    for (uint64_t i = 16; i < 40; i++) {
        wb_lock(e);
        uint32_t h = e->clean_hand;
        wb_unlock(e);
        dt_assert_ok(kvh_seq_migrate(e, s, i * G.bt, G.bt, KVH_TIER_HOST, NULL));
        wb_lock(e);
        /* Read back, it keeps its disk copy: no lead (nor a worker woken
         * for one), only the hand's pay. */
        assert_int_equal(e->clean_leads_len, 0);
        assert_int_equal(e->clean_scan_credit, KVHI_CLEAN_SCAN_PER_LEAD);
        assert_false(kvhi_disk_clean_step(e));
        /* The arrival paid for a few records, which the hand scanned. */
        uint32_t moved = hand_moved(e, h);
        if (moved == 0 || moved > KVHI_CLEAN_SCAN_PER_LEAD)
            fail_msg("arrival %llu: the hand scanned %u records (table %u)", (unsigned long long)i, moved,
                     e->block_cap);
        wb_unlock(e);
    }

    /* A published host block with no copy, its lead pushed out by 300
     * others while the tier had room; then arrivals to a full tier: the
     * hand reaches it within a round of the table. */
    uint32_t sb_last = wb_seq_block_index(e, s, 39);
    kvh_seq u;
    uint32_t ub = uncleaned_host_block(e, &u);
    wb_lock(e);
    kvhi_block *ublk = kvhi_blk(e, ub);
    /* s's last block: in the host tier with its disk copy, no candidate. */
    uint32_t other = sb_last;
    assert_int_equal(kvhi_blk(e, other)->tier, KVH_TIER_HOST);
    for (int i = 0; i < 300; i++)
        kvhi_disk_clean_lead(e, other);
    e->clean_scan_credit = 0;
    bool found = false;
    for (uint32_t leads = 0; !found && leads <= e->block_cap / KVHI_CLEAN_SCAN_PER_LEAD + 1; leads++) {
        kvhi_disk_clean_lead(e, other);
        while (kvhi_disk_clean_step(e))
            ;
        found = (ublk->flags & KVHI_BF_DISK_COPY) != 0;
    }
    assert_true(found);
    wb_unlock(e);
    dt_assert_verified(e, s, G, dt_plain(9), 0, 40 * G.bt);
    dt_assert_ok(kvh_seq_free(e, u));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
}

/* A published host block without a disk copy whose lead was lost (to the
 * ring's overflow), and then only promotions from disk on the caller's
 * thread, with a worker: they pay the hand and wake the worker now and
 * then to spend it, so the block is cleaned ahead of its eviction. */
static void test_restores_alone_still_move_the_hand(void **state)
{
    (void)state;
    kvh_engine *e = open_store_with("cleaner-restores-only", 16, 1024, 1);
    kvh_seq s, u;
    dt_assert_ok(dt_build(e, G, dt_plain(9), 200 * G.bt, 0, &s));
    dt_assert_ok(kvh_seq_migrate(e, s, 0, 200 * G.bt, KVH_TIER_DISK, NULL));
    uint32_t ub = uncleaned_host_block(e, &u);
    wb_lock(e);
    kvhi_block *ublk = kvhi_blk(e, ub);
    e->clean_leads_len = 0; /* its lead lost */
    e->clean_scan_credit = 0;
    wb_unlock(e);
    bool cleaned = false;
    for (uint64_t i = 0; i < 200 && !cleaned; i++) {
        dt_assert_ok(kvh_seq_migrate(e, s, i * G.bt, G.bt, KVH_TIER_HOST, NULL));
        usleep(2000); /* the worker's turn */
        wb_lock(e);
        assert_int_equal(ublk->tier, KVH_TIER_HOST); /* still there: cleaned ahead, not at its eviction */
        cleaned = (ublk->flags & KVHI_BF_DISK_COPY) != 0;
        wb_unlock(e);
    }
    assert_true(cleaned);
    dt_assert_verified(e, u, G, dt_plain(10), 0, G.bt);
    dt_assert_ok(kvh_seq_free(e, u));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
}

static atomic_int write_entered;

static int entering_hook(enum kvhi_disk_op op, void *user)
{
    if (op == KVHI_OP_WRITE)
        atomic_store(&write_entered, 1);
    return holding_hook(op, user);
}

static void *run_persist(void *arg)
{
    clean_run *r = arg;
    r->st = kvh_seq_persist(r->e, r->s);
    atomic_store(&r->done, 1);
    return NULL;
}

/* kvh.h: used_blocks - clean_copies of the disk tier are the blocks on
 * disk alone, also while a copy is being written (its slot is taken,
 * outside the engine lock): a persist held in its write does not make
 * the copy look like a block on disk. */
static void test_tier_info_counts_copies_being_written(void **state)
{
    (void)state;
    kvh_engine *e = open_store("copies-writing", 16, 64);
    kvh_seq u;
    (void)uncleaned_host_block(e, &u);
    kvh_tier_info before = dt_tier(e, KVH_TIER_DISK);
    atomic_store(&write_entered, 0);
    atomic_store(&hold_writes, 1);
    kvhi_disk_set_fault_hook(entering_hook, NULL);
    clean_run r = {.e = e, .s = u};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, run_persist, &r), 0);
    for (int i = 0; i < 5000 && !atomic_load(&write_entered); i++)
        usleep(1000);
    assert_true(atomic_load(&write_entered));
    kvh_tier_info mid = dt_tier(e, KVH_TIER_DISK);
    atomic_store(&hold_writes, 0);
    assert_int_equal(pthread_join(t, NULL), 0);
    kvhi_disk_set_fault_hook(NULL, NULL);
    dt_assert_ok(r.st);
    assert_int_equal(mid.used_blocks, before.used_blocks + 1);
    assert_int_equal(mid.used_blocks - mid.clean_copies, before.used_blocks - before.clean_copies);
    kvh_tier_info after = dt_tier(e, KVH_TIER_DISK);
    assert_int_equal(after.used_blocks, before.used_blocks + 1);
    assert_int_equal(after.clean_copies, before.clean_copies + 1);
    dt_assert_ok(kvh_seq_free(e, u));
    dt_assert_ok(dt_close(e));
}

/* Of records b[0..n): how many are in the host tier (*in_host) and have
 * a clean disk copy there (returned). Lock held. */
static int host_copies(kvh_engine *e, const uint32_t *b, int n, int *in_host)
{
    int copies = 0;
    *in_host = 0;
    for (int i = 0; i < n; i++) {
        kvhi_block *blk = kvhi_blk(e, b[i]);
        *in_host += blk->tier == KVH_TIER_HOST;
        copies += blk->tier == KVH_TIER_HOST && (blk->flags & KVHI_BF_DISK_COPY);
    }
    return copies;
}

static atomic_int refuse_writes; /* the errno writes fail with; 0: none */

static int refusing_hook(enum kvhi_disk_op op, void *user)
{
    (void)user;
    return op == KVHI_OP_WRITE ? -atomic_load(&refuse_writes) : 0;
}

/* What the cleaner could not write it keeps: candidates past the disk's
 * free slots wait for room, and blocks whose writes the filesystem
 * refused are tried again after the rest, not forgotten. */
static void test_cleaner_keeps_what_it_could_not_write(void **state)
{
    (void)state;
    kvh_engine *e = open_store("cleaner-keeps", 16, 24);
    /* 20 blocks with no K/V written (never published) fill the disk but
     * for 4 slots; then 16 published blocks fill the host tier. */
    kvh_seq filler, s;
    dt_assert_ok(kvh_seq_create(e, 0, &filler));
    int32_t t[20 * 16]; /* G.bt is 16 */
    for (int i = 0; i < 20 * 16; i++)
        t[i] = 900000 + i;
    dt_assert_ok(kvh_seq_append(e, filler, t, 20 * G.bt));
    dt_assert_ok(kvh_seq_migrate(e, filler, 0, 20 * G.bt, KVH_TIER_DISK, NULL));
    dt_assert_ok(dt_build(e, G, dt_plain(11), 16 * G.bt, 0, &s));
    dt_assert_ok(kvh_seq_migrate(e, s, 0, 16 * G.bt, KVH_TIER_HOST, NULL));
    uint32_t sb[16], ub[16];
    for (int i = 0; i < 16; i++)
        sb[i] = wb_seq_block_index(e, s, (uint64_t)i);
    int in_host = 0;
    wb_lock(e);
    assert_int_equal(e->tiers[KVH_TIER_DISK].slots.free_count, 4);
    while (kvhi_disk_clean_step(e))
        ;
    assert_int_equal(host_copies(e, sb, 16, &in_host), 4);
    assert_true(in_host >= 14);
    wb_unlock(e);
    /* Room comes back: the rest are cleaned, with no new arrival. */
    dt_assert_ok(kvh_seq_free(e, filler));
    wb_lock(e);
    while (kvhi_disk_clean_step(e))
        ;
    assert_int_equal(host_copies(e, sb, 16, &in_host), in_host);
    wb_unlock(e);
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));

    /* The filesystem refuses the cleaner's writes: nothing is written,
     * and once the rest is over the same blocks are written. */
    e = open_store("cleaner-refused", 16, 64);
    kvh_seq u;
    dt_assert_ok(dt_build(e, G, dt_plain(12), 16 * G.bt, 0, &u));
    atomic_store(&refuse_writes, ENOSPC);
    kvhi_disk_set_fault_hook(refusing_hook, NULL);
    dt_assert_ok(kvh_seq_migrate(e, u, 0, 16 * G.bt, KVH_TIER_HOST, NULL));
    for (int i = 0; i < 16; i++)
        ub[i] = wb_seq_block_index(e, u, (uint64_t)i);
    wb_lock(e);
    while (kvhi_disk_clean_step(e))
        ;
    assert_int_equal(host_copies(e, ub, 16, &in_host), 0);
    assert_true(in_host >= 14);
    assert_true(e->disk_full_until != 0);
    atomic_store(&refuse_writes, 0);
    kvhi_disk_set_fault_hook(NULL, NULL);
    assert_true(kvhi_disk_clean_resumes_ns(e) != 0); /* an idle worker comes back for them */
    e->disk_full_until = 0;                          /* the rest is over */
    while (kvhi_disk_clean_step(e))
        ;
    assert_int_equal(host_copies(e, ub, 16, &in_host), in_host);
    wb_unlock(e);
    dt_assert_verified(e, u, G, dt_plain(12), 0, 16 * G.bt);
    dt_assert_ok(kvh_seq_free(e, u));
    dt_assert_ok(dt_close(e));

    /* A write that fails with an I/O error is not retried at once: a
     * worker would loop on it for good. */
    e = open_store("cleaner-eio", 16, 64);
    dt_assert_ok(dt_build(e, G, dt_plain(13), 16 * G.bt, 0, &u));
    atomic_store(&refuse_writes, EIO);
    kvhi_disk_set_fault_hook(refusing_hook, NULL);
    dt_assert_ok(kvh_seq_migrate(e, u, 0, 16 * G.bt, KVH_TIER_HOST, NULL));
    wb_lock(e);
    int steps = 0;
    while (steps < 100 && kvhi_disk_clean_step(e))
        steps++;
    assert_true(steps < 100);
    assert_false(kvhi_disk_clean_step(e));
    wb_unlock(e);
    atomic_store(&refuse_writes, 0);
    kvhi_disk_set_fault_hook(NULL, NULL);
    dt_assert_ok(kvh_seq_free(e, u));
    dt_assert_ok(dt_close(e));
}

/* ---- a long journal ---- */

/* The store in dir as a kill -9 would leave it now: its files are kept,
 * s freed and e closed (which writes its own files), then the kept files
 * are put back. */
static void close_as_killed(kvh_engine *e, kvh_seq s, const char *dir)
{
    dt_saved_store saved;
    assert_int_equal(dt_store_save(dir, &saved), 0);
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
    assert_int_equal(dt_store_restore(dir, &saved), 0);
    dt_store_free(&saved);
}

static void test_long_journal_folds(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("fold", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 8, 8, 32, 0);
    kvh_engine *e = dt_open_a(&c);
    dt_content ct = dt_plain(8);
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, ct, 2 * G.bt, 0, &s));
    dt_assert_ok(kvh_seq_persist(e, s));
    recs x;
    read_recs(dir, "index", &x);
    assert_int_equal(x.n, 0); /* a short journal stays a journal */
    /* 4100 more records (deletions of a slot nobody holds: replay drops
     * them), as a long-running store would have accumulated. */
    int32_t tk[16] = {0};
    for (int i = 0; i < 4100; i++)
        assert_int_equal(kvhi_index_append(e->disk, KVHI_REC_DEL, 31, 0x1234 + (uint64_t)i, 0, G.bt, 0, tk), 0);
    flush(e);
    assert_true(e->disk->journal_records > 4096);
    dt_assert_ok(dt_extend(e, s, G, ct, 2 * G.bt, G.bt));
    dt_assert_ok(kvh_seq_persist(e, s)); /* folds */
    read_recs(dir, "index", &x);
    assert_int_equal(x.n, 3);
    recs j;
    read_recs(dir, "journal", &j);
    assert_int_equal(j.n, 0);
    assert_true(e->disk->journal_records < 16);
    wb_lock(e);
    for (int i = 0; i < 3; i++) {
        uint32_t b = kvhi_prefix_find(&e->prefix, x.r[i].hash);
        assert_true(b != KVHI_PREFIX_MISS);
        assert_int_equal(kvhi_blk(e, b)->disk_copy, x.r[i].slot);
    }
    wb_unlock(e);
    /* Killed now: the folded files alone give everything back. */
    close_as_killed(e, s, dir);
    e = dt_open_a(&c);
    match_a(e, ct, 3 * G.bt, 3 * G.bt);
    dt_assert_ok(dt_close(e));
}

static long file_bytes(const char *dir, const char *name)
{
    char p[PATH_MAX + 16];
    struct stat st;
    return stat(dt_path(p, sizeof(p), dir, name), &st) == 0 ? (long)st.st_size : -1;
}

/* Blocks that only pass through the disk tier (evicted, then dropped
 * from a full disk; no persist) each left an ADD and a DEL record: the
 * journal, folded only by a persist or a close, grew by 232 bytes a
 * block for good, and an open after a crash replayed all of it. */
static void test_journal_stays_bounded_without_persists(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("fold-pass", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 8, 8, 32, 0);
    kvh_engine *e = dt_open_a(&c);
    dt_content kept = dt_plain(0x900);
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, kept, 2 * G.bt, 0, &s));
    dt_assert_ok(kvh_seq_persist(e, s));
    long rec_bytes = e->disk->rec_bytes, most = 0;
    for (int i = 0; i < 12000; i++) {
        kvh_seq t;
        dt_assert_ok(dt_build(e, G, dt_plain(0x1000 + (uint64_t)i), G.bt, 0, &t));
        dt_assert_ok(kvh_seq_free(e, t));
        if (i % 500 == 499) {
            flush(e);
            long j = file_bytes(dir, "journal");
            most = j > most ? j : most;
        }
    }
    /* one fold's worth: 4096 records past the header, and the last cycles' */
    long bound = 4096 + (4096 + 2 * 32 + 1000) * rec_bytes;
    if (most > bound)
        fail_msg("12,000 blocks through the disk tier: the journal reached %ld bytes (bound %ld)", most, bound);
    /* Killed now: the store opens with the persisted prefix. */
    close_as_killed(e, s, dir);
    e = dt_open_a(&c);
    match_a(e, kept, 2 * G.bt, 2 * G.bt);
    dt_assert_ok(dt_close(e));
    print_message("journal at most %ld bytes over 12,000 blocks through the disk tier\n", most);
}

/* A long journal a crash left behind is folded by the open, not carried
 * on to the next one. */
static void test_open_folds_a_long_journal(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("fold-open", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 8, 8, 32, 0);
    kvh_engine *e = dt_open_a(&c);
    dt_content ct = dt_plain(0x901);
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, ct, 2 * G.bt, 0, &s));
    dt_assert_ok(kvh_seq_persist(e, s));
    int32_t tk[16] = {0};
    for (int i = 0; i < 4100; i++)
        assert_int_equal(kvhi_index_append(e->disk, KVHI_REC_DEL, 31, 0x5678 + (uint64_t)i, 0, G.bt, 0, tk), 0);
    flush(e);
    close_as_killed(e, s, dir);
    assert_true(file_bytes(dir, "journal") > 4096 * (long)G.bt);
    e = dt_open_a(&c);
    recs j;
    read_recs(dir, "journal", &j);
    assert_int_equal(j.n, 0);
    match_a(e, ct, 2 * G.bt, 2 * G.bt);
    dt_assert_ok(dt_close(e));
}

/* A store reopened with a smaller disk_bytes kept its slab files at the
 * size it was made with (256 MiB of files at a 1 MiB budget; both 1 GiB
 * slabs of a 2 GiB store at 1 MiB): a clean close now cuts them. */
static void test_a_smaller_store_gives_its_files_back_at_close(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("shrink", dir, sizeof(dir));
    uint64_t slot = dt_slot_bytes(G), per = kvhi_disk_slab_slots(slot);
    kvh_config c = dt_cfg(G, dir, 8, 8, per + 8, 0); /* two slab files */
    kvh_engine *e = dt_open_a(&c);
    dt_content ct = dt_plain(0x902);
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, ct, 2 * G.bt, 0, &s));
    dt_assert_ok(kvh_seq_persist(e, s));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
    assert_true(file_bytes(dir, "slab-0001.kvh") > 0);
    c = dt_cfg(G, dir, 8, 8, 16, 0);
    e = dt_open_a(&c);
    match_a(e, ct, 2 * G.bt, 2 * G.bt); /* its blocks lay in the first 16 slots */
    dt_assert_ok(dt_close(e));
    assert_int_equal(file_bytes(dir, "slab-0000.kvh"), (long)(16 * slot));
    assert_int_equal(file_bytes(dir, "slab-0001.kvh"), -1);
    e = dt_open_a(&c);
    match_a(e, ct, 2 * G.bt, 2 * G.bt);
    dt_assert_ok(dt_close(e));
    /* A slab cut inside its last slot, and a stray slab file past it, are
     * not a store made larger: opened at what the files hold (as kvh
     * stats opens a store), nothing is cut or removed. */
    char path[PATH_MAX + 32];
    assert_int_equal(truncate(dt_path(path, sizeof(path), dir, "slab-0000.kvh"), (off_t)(15 * slot + slot / 2)), 0);
    FILE *stray = fopen(dt_path(path, sizeof(path), dir, "slab-0001.kvh"), "w");
    assert_non_null(stray);
    fclose(stray);
    c.disk_bytes = 15 * slot + slot / 2;
    e = dt_open_a(&c);
    dt_assert_ok(dt_close(e));
    assert_int_equal(file_bytes(dir, "slab-0000.kvh"), (long)(15 * slot + slot / 2));
    assert_int_equal(file_bytes(dir, "slab-0001.kvh"), 0);
}

/* ---- verification in place ---- */

static void test_verify_in_place(void **state)
{
    (void)state;
    char dir[PATH_MAX], slab[PATH_MAX + 32];
    dt_scratch("verify", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 8, 8, 32, 0);
    kvh_engine *e = dt_open_a(&c);
    dt_content ct = dt_plain(9);
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, ct, 3 * G.bt, 0, &s));
    dt_assert_ok(kvh_seq_persist(e, s));
    uint32_t slot1 = kvhi_blk(e, wb_seq_block_index(e, s, 1))->disk_copy;
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
    assert_int_equal(dt_flip_bit(dt_path(slab, sizeof(slab), dir, "slab-0000.kvh"),
                                 (uint64_t)slot1 * dt_slot_bytes(G) + 4096 + 77, 2),
                     0);

    e = dt_open_a(&c);
    int32_t tk[3 * 16];
    dt_tokens(ct, 0, 3 * G.bt, tk);
    kvh_block h[3];
    size_t n = 0;
    dt_assert_ok(kvh_prefix_lookup(e, tk, 3 * G.bt, h, 3, &n));
    assert_int_equal(n, 3);
    uint32_t b[3];
    for (int i = 0; i < 3; i++)
        b[i] = wb_block_index(e, h[i]);
    kvh_stats a = dt_stats(e);
    hook_on();
    wb_lock(e);
    assert_int_equal(kvhi_disk_verify(e, b, 3), 1); /* block 0 only is good */
    for (int i = 0; i < 3; i++) {
        kvhi_block *blk = kvhi_blk(e, b[i]);
        assert_int_equal(blk->tier, KVH_TIER_DISK); /* checked where it lies */
        assert_int_equal(kvhi_move_state(blk), KVHI_MS_IDLE);
        assert_int_equal((blk->flags & KVHI_BF_CORRUPT) != 0, i == 1);
        assert_int_equal((blk->flags & KVHI_BF_PUBLISHED) != 0, i != 1);
    }
    wb_unlock(e);
    assert_true(atomic_load(&H.count[KVHI_OP_READ]) >= 1);
    kvh_stats d = dt_stats(e);
    assert_int_equal(d.corrupt_blocks - a.corrupt_blocks, 1);
    assert_int_equal(d.blocks_disk_to_host, a.blocks_disk_to_host);
    /* An unreadable block: a miss this time, neither damage nor gone: it
     * stays published and unmarked, and is read again next time. */
    atomic_store(&H.fail_reads, 1);
    wb_lock(e);
    assert_int_equal(kvhi_disk_verify(e, &b[2], 1), 0);
    kvhi_block *blk = kvhi_blk(e, b[2]);
    assert_false(blk->flags & KVHI_BF_CORRUPT);
    assert_true(blk->flags & KVHI_BF_PUBLISHED);
    assert_int_equal(kvhi_move_state(blk), KVHI_MS_IDLE);
    wb_unlock(e);
    atomic_store(&H.fail_reads, 0);
    assert_int_equal(dt_stats(e).corrupt_blocks - a.corrupt_blocks, 1);
    wb_lock(e);
    assert_int_equal(kvhi_disk_verify(e, &b[2], 1), 1); /* readable again */
    wb_unlock(e);
    /* Blocks already marked are not read again: blocks 0 and 2 only. */
    int reads = atomic_load(&H.count[KVHI_OP_READ]);
    wb_lock(e);
    assert_int_equal(kvhi_disk_verify(e, b, 3), 1);
    wb_unlock(e);
    int more = atomic_load(&H.count[KVHI_OP_READ]) - reads;
    assert_true(more >= 1 && more <= 2);
    assert_false(kvhi_blk(e, b[0])->flags & KVHI_BF_CORRUPT);
    assert_false(kvhi_blk(e, b[2])->flags & KVHI_BF_CORRUPT);
    assert_int_equal(dt_stats(e).corrupt_blocks - a.corrupt_blocks, 1);
    kvhi_disk_set_fault_hook(NULL, NULL);
    for (int i = 0; i < 3; i++)
        dt_assert_ok(kvh_block_release(e, h[i]));
    dt_assert_ok(dt_close(e));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_persist_journal_snapshot_reopen, teardown),
        cmocka_unit_test_teardown(test_opened_smaller_says_what_it_drops, teardown),
        cmocka_unit_test_teardown(test_records_follow_the_blocks, teardown),
        cmocka_unit_test_teardown(test_cleaner, teardown),
        cmocka_unit_test_teardown(test_victim_waits_for_cleaned_unreferenced_block, teardown),
        cmocka_unit_test_teardown(test_cleaner_wakeup_counts_kept_copies, teardown),
        cmocka_unit_test_teardown(test_cleaner_sweeps_what_arrivals_pay_for, teardown),
        cmocka_unit_test_teardown(test_restores_alone_still_move_the_hand, teardown),
        cmocka_unit_test_teardown(test_tier_info_counts_copies_being_written, teardown),
        cmocka_unit_test_teardown(test_cleaner_keeps_what_it_could_not_write, teardown),
        cmocka_unit_test_teardown(test_long_journal_folds, teardown),
        cmocka_unit_test_teardown(test_journal_stays_bounded_without_persists, teardown),
        cmocka_unit_test_teardown(test_open_folds_a_long_journal, teardown),
        cmocka_unit_test_teardown(test_a_smaller_store_gives_its_files_back_at_close, teardown),
        cmocka_unit_test_teardown(test_verify_in_place, teardown),
    };
    return cmocka_run_group_tests_name("disk_tier", tests, NULL, NULL);
}
