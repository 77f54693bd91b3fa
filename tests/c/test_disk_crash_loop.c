/* Disk store: SIGKILL loops over a bounded universe of content, checking
 * that the store neither loses acknowledged blocks nor leaks space.
 *
 * test_disk_crash.c and test_rel_crashloop.c give every cycle new content
 * and start the store over before it fills, so a slot that a kill leaves
 * taken (a half-written spill, a block written twice, a temp file of a
 * compaction cut short) would never be noticed. Here every child draws
 * its sequences from the same UNIVERSE_CHAINS prefix chains of CHAIN_BLOCKS
 * blocks (content a pure function of the chain, disk_test_util.h), often
 * with a partial last block, and the store is never reset. A child persists
 * (kvh_seq_persist, and kvh_blocks_persist with a fence), spills
 * asynchronously with two migration workers, demotes, matches and checks
 * what it matched, frees, and closes + reopens; the parent SIGKILLs it at a
 * random moment: while the store opens, while it runs, or (one cycle in
 * four) right inside kvh_engine_close. After every kill the parent reopens
 * the store and checks:
 *
 *   - the open succeeds, with disk_strict_index set (a store the library
 *     wrote is never refused, nor even in need of a rebuild);
 *   - every chain acknowledged durable (persist returned KVH_OK) is matched
 *     in full, and every chain matched (acknowledged or not) reads back
 *     byte for byte: a block comes back exact or not at all;
 *   - stats.corrupt_blocks stays 0 (a kill loses no written page);
 *   - the disk tier never holds more blocks than the universe has full
 *     blocks (duplicates or unpublished slots taken back would exceed it),
 *     whatever the number of cycles;
 *   - after a clean close the store directory holds only LOCK, index,
 *     journal and its slab files; the slab files keep their size, the
 *     journal is back to its header and the snapshot holds no more records
 *     than the disk holds blocks.
 * Odd cycles check in a child that exits without closing, so the next
 * child recovers a store that was not closed cleanly.
 *
 * KVH_DISK_CRASH_LOOP_CYCLES sets the number of cycles (default 60;
 * test_disk_crash_loop_stress: 1000); KVH_TEST_SEED the seed.
 */
#include "disk_test_util.h"

#ifndef CRASH_LOOP_STRESS
#define CRASH_LOOP_STRESS 0
#endif

static const dt_geo G = {2, 1, 32, 16, KVH_DTYPE_F16}; /* block = 4096 bytes, slot = 8192 */
#define UNIVERSE_CHAINS 48
#define CHAIN_BLOCKS 4
#define UNIVERSE_BLOCKS (UNIVERSE_CHAINS * CHAIN_BLOCKS)
/* Room for the universe, partial blocks and spills in flight: the disk
 * never has to drop a block, so no acknowledged block may go missing. */
#define DISK_SLOTS 320
#define MAX_LIVE 8

static kvh_config loop_cfg(const char *dir) { return dt_cfg(G, dir, 6, 12, DISK_SLOTS, 2); }
static dt_content chain(uint32_t c) { return dt_plain(0xc4a1000 + c); }
static size_t chain_len(void) { return (size_t)CHAIN_BLOCKS * G.bt; }

static struct {
    char dir[512], oracle[600], errlog[600];
    bool acked[UNIVERSE_CHAINS];
    uint64_t slab_bytes; /* total size of the slab files after the first clean close */
} S;

typedef struct child_arg {
    uint64_t seed;
    uint32_t disk_flags;
    bool close_kill; /* say ready right before a close, so the kill lands inside it */
} child_arg;

typedef struct live {
    kvh_seq s;
    uint32_t c;
    size_t len;
} live;

#define CHILD_FAIL(code, ...) DT_CHILD_FAIL(code, __VA_ARGS__)

static kvh_engine *child_open(const kvh_config *c)
{
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(c, &e);
    if (st != KVH_OK)
        CHILD_FAIL(10, "open: %s", kvh_status_name(st));
    return e;
}

/* Records an acknowledgement: written before anything else happens, with
 * one write(2), so it is in the file when the kill comes. */
static void ack(int ofd, uint32_t c) { dt_oracle_write(ofd, "A %u\n", c); }

static void persist_seq(kvh_engine *e, int ofd, live *l)
{
    kvh_status st = kvh_seq_persist(e, l->s);
    if (st == KVH_OK) {
        if (l->len >= chain_len())
            ack(ofd, l->c);
    } else if (st != KVH_ERR_NOSPACE && st != KVH_ERR_BUSY)
        CHILD_FAIL(11, "persist: %s", kvh_status_name(st));
}

static void persist_blocks(kvh_engine *e, int ofd, live *l)
{
    if (l->len < chain_len())
        return;
    kvh_block b[CHAIN_BLOCKS];
    kvh_status st = kvh_seq_blocks(e, l->s, 0, CHAIN_BLOCKS, b);
    if (st != KVH_OK)
        CHILD_FAIL(12, "seq_blocks: %s", kvh_status_name(st));
    kvh_fence f;
    st = kvh_blocks_persist(e, b, CHAIN_BLOCKS, &f);
    if (st == KVH_OK) {
        st = kvh_fence_wait(e, f, UINT64_MAX);
        kvh_fence_free(e, f);
    }
    if (st == KVH_OK)
        ack(ofd, l->c);
    else if (st != KVH_ERR_NOSPACE && st != KVH_ERR_BUSY)
        CHILD_FAIL(13, "blocks_persist: %s", kvh_status_name(st));
}

static void check_match(kvh_engine *e, uint32_t c)
{
    size_t m = 0;
    char msg[256] = "";
    kvh_status st = dt_match_verify(e, G, chain(c), chain_len(), &m, msg, sizeof(msg));
    if (st == KVH_ERR_INTERNAL)
        CHILD_FAIL(14, "chain %u served wrong bytes: %s", c, msg);
    if (st != KVH_OK && st != KVH_ERR_NOSPACE)
        CHILD_FAIL(15, "chain %u: %s", c, msg);
}

static void free_all(kvh_engine *e, live *L, int *nl)
{
    for (int i = 0; i < *nl; i++)
        kvh_seq_free(e, L[i].s);
    *nl = 0;
}

static int loop_child(void *p, int ready_fd)
{
    child_arg *a = p;
    dt_rng r = {a->seed};
    int ofd = open(S.oracle, O_WRONLY | O_APPEND | O_CLOEXEC);
    int efd = open(S.errlog, O_WRONLY | O_APPEND | O_CLOEXEC);
    if (ofd < 0 || efd < 0)
        return 2;
    dup2(efd, 2);
    kvh_config c = loop_cfg(S.dir);
    c.disk_flags = a->disk_flags;
    kvh_engine *e = child_open(&c);
    if (!a->close_kill && write(ready_fd, "r", 1) != 1)
        return 3;
    live L[MAX_LIVE];
    int nl = 0;
    for (uint64_t step = 0;; step++) {
        if (a->close_kill && step == 40) { /* a close with work in flight */
            if (write(ready_fd, "r", 1) != 1)
                return 3;
            free_all(e, L, &nl);
            kvh_status st = kvh_engine_close(e);
            if (st != KVH_OK)
                CHILD_FAIL(21, "close: %s", kvh_status_name(st));
            e = child_open(&c);
        }
        if (nl < MAX_LIVE && (nl == 0 || dt_below(&r, 3) == 0)) {
            live *l = &L[nl];
            l->c = (uint32_t)dt_below(&r, UNIVERSE_CHAINS);
            /* full chain, a partial block beyond it, or a part of it */
            uint64_t k = dt_below(&r, 3);
            l->len = k == 0   ? chain_len()
                     : k == 1 ? chain_len() + 1 + dt_below(&r, G.bt - 1)
                              : 1 + dt_below(&r, chain_len());
            kvh_status st = dt_build(e, G, chain(l->c), l->len, 0, &l->s);
            if (st == KVH_OK)
                nl++;
            else if (st != KVH_ERR_NOSPACE)
                CHILD_FAIL(16, "build: %s", kvh_status_name(st));
            continue;
        }
        live *l = &L[dt_below(&r, (uint64_t)nl)];
        kvh_fence f;
        kvh_status st;
        switch (dt_below(&r, 8)) {
        case 0:
            persist_seq(e, ofd, l);
            break;
        case 1:
            persist_blocks(e, ofd, l);
            break;
        case 2: /* spill everything, partial block included, still in flight */
            if ((st = kvh_seq_migrate(e, l->s, 0, l->len, KVH_TIER_DISK, &f)) != KVH_OK)
                CHILD_FAIL(17, "migrate: %s", kvh_status_name(st));
            kvh_fence_free(e, f);
            break;
        case 3: /* demote to host while the workers may be spilling */
            if ((st = kvh_seq_migrate(e, l->s, 0, l->len, KVH_TIER_HOST, NULL)) != KVH_OK && st != KVH_ERR_NOSPACE)
                CHILD_FAIL(18, "demote: %s", kvh_status_name(st));
            break;
        case 4:
            check_match(e, l->c);
            break;
        case 5: {
            char msg[256] = "";
            st = dt_verify(e, l->s, G, chain(l->c), 0, l->len, msg, sizeof(msg));
            if (st == KVH_ERR_INTERNAL)
                CHILD_FAIL(19, "read back: %s", msg);
            if (st != KVH_OK && st != KVH_ERR_NOSPACE)
                CHILD_FAIL(20, "read back: %s", msg);
            break;
        }
        case 6:
            kvh_seq_free(e, l->s);
            *l = L[--nl];
            break;
        case 7:
            if (dt_below(&r, 6) != 0)
                break;
            /* close + reopen: in a close_kill cycle the kill lands in here */
            if (a->close_kill && write(ready_fd, "r", 1) != 1)
                return 3;
            free_all(e, L, &nl);
            if ((st = kvh_engine_close(e)) != KVH_OK)
                CHILD_FAIL(21, "close: %s", kvh_status_name(st));
            e = child_open(&c);
            break;
        }
    }
}

/* ---- the parent's checks ---- */

static void read_acks(void)
{
    size_t len = 0;
    uint8_t *buf = dt_read_file(S.oracle, &len);
    if (!buf)
        return;
    for (size_t i = 0; i < len;) {
        size_t j = i;
        while (j < len && buf[j] != '\n')
            j++;
        unsigned c;
        if (j < len && sscanf((const char *)buf + i, "A %u", &c) == 1 && c < UNIVERSE_CHAINS)
            S.acked[c] = true;
        i = j + 1;
    }
    free(buf);
}

typedef struct check_result {
    int errors;
    uint64_t acked, matched_blocks, corrupt, disk_used;
    char msg[512];
} check_result;

static kvh_engine *check_store(check_result *r)
{
    memset(r, 0, sizeof(*r));
    kvh_config c = loop_cfg(S.dir);
    /* Strict: a store the library wrote, killed at any moment, must not
     * even need a rebuild (a torn journal tail is cut, not damage). */
    c.disk_strict_index = 1;
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&c, &e);
    if (st != KVH_OK) {
        snprintf(r->msg, sizeof(r->msg), "reopen failed: %s (%s)", kvh_status_name(st), kvh_last_error());
        r->errors++;
        return NULL;
    }
    for (uint32_t ch = 0; ch < UNIVERSE_CHAINS; ch++) {
        size_t m = 0;
        char msg[256] = "";
        st = dt_match_verify(e, G, chain(ch), chain_len(), &m, msg, sizeof(msg));
        r->acked += S.acked[ch];
        r->matched_blocks += m / G.bt;
        if (st != KVH_OK) {
            snprintf(r->msg, sizeof(r->msg), "chain %u: %s", ch, msg);
            r->errors++;
        } else if (S.acked[ch] && m != chain_len()) {
            snprintf(r->msg, sizeof(r->msg), "chain %u was acknowledged durable; matched %zu of %zu tokens", ch, m,
                     chain_len());
            r->errors++;
        }
    }
    r->corrupt = dt_stats(e).corrupt_blocks;
    r->disk_used = dt_tier(e, KVH_TIER_DISK).used_blocks;
    if (r->corrupt != 0) {
        snprintf(r->msg, sizeof(r->msg), "%" PRIu64 " blocks failed verification after a kill", r->corrupt);
        r->errors++;
    }
    if (r->disk_used > UNIVERSE_BLOCKS) {
        snprintf(r->msg, sizeof(r->msg), "disk holds %" PRIu64 " blocks; the universe has %d", r->disk_used,
                 UNIVERSE_BLOCKS);
        r->errors++;
    }
    return e;
}

/* Odd cycles: the check runs here and the process exits without closing. */
static int check_child(void *arg)
{
    check_result *r = arg;
    check_store(r);
    if (r->errors)
        fprintf(stderr, "check (unclean): %s\n", r->msg);
    return r->errors ? 1 : 0;
}

/* After a clean close: only the store's own files, of sizes the format
 * allows. */
static void check_files_after_close(int cycle, uint64_t disk_used)
{
    DIR *d = opendir(S.dir);
    assert_non_null(d);
    struct dirent *de;
    uint64_t slab_bytes = 0, index_bytes = 0, journal_bytes = 0;
    char p[PATH_MAX];
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.' && (!de->d_name[1] || (de->d_name[1] == '.' && !de->d_name[2])))
            continue;
        struct stat st;
        assert_int_equal(stat(dt_path(p, sizeof(p), S.dir, de->d_name), &st), 0);
        if (strncmp(de->d_name, "slab-", 5) == 0)
            slab_bytes += (uint64_t)st.st_size;
        else if (strcmp(de->d_name, "index") == 0)
            index_bytes = (uint64_t)st.st_size;
        else if (strcmp(de->d_name, "journal") == 0)
            journal_bytes = (uint64_t)st.st_size;
        else if (strcmp(de->d_name, "LOCK") != 0)
            fail_msg("cycle %d: stray file %s/%s (%lld bytes) left in the store", cycle, S.dir, de->d_name,
                     (long long)st.st_size);
    }
    closedir(d);
    if (S.slab_bytes == 0)
        S.slab_bytes = slab_bytes;
    if (slab_bytes != S.slab_bytes)
        fail_msg("cycle %d: slab files hold %" PRIu64 " bytes, %" PRIu64 " after the first close", cycle, slab_bytes,
                 S.slab_bytes);
    /* One 4096-byte header page each; the snapshot names at most the blocks
     * the disk held when the store was closed. */
    uint64_t rec = kvhi_index_rec_bytes(G.bt);
    if (journal_bytes > KVHI_DISK_ALIGN)
        fail_msg("cycle %d: journal is %" PRIu64 " bytes after a clean close", cycle, journal_bytes);
    if (index_bytes > kvhi_round_up(KVHI_DISK_ALIGN + disk_used * rec, KVHI_DISK_ALIGN))
        fail_msg("cycle %d: index is %" PRIu64 " bytes for %" PRIu64 " blocks (%" PRIu64 "-byte records)", cycle,
                 index_bytes, disk_used, rec);
}

/* The slots the universe does not use are all still free: one-block
 * chains of new content fill exactly them without dropping a block, and
 * everything is found again. A slot that a kill left neither used nor free
 * would make the last of them evict a block (drops) or fail with
 * KVH_ERR_NOSPACE. */
static dt_content extra_chain(uint32_t c) { return dt_plain(0xe8740000 + c); }

static void fill_free_slots(void)
{
    kvh_config c = loop_cfg(S.dir);
    kvh_engine *e = dt_open_a(&c);
    uint64_t used = dt_tier(e, KVH_TIER_DISK).used_blocks;
    assert_true(used <= UNIVERSE_BLOCKS);
    uint32_t extra = (uint32_t)(DISK_SLOTS - used);
    for (uint32_t i = 0; i < extra; i++) {
        kvh_seq s;
        dt_assert_ok(dt_build(e, G, extra_chain(i), G.bt, 0, &s));
        dt_assert_ok(kvh_seq_persist(e, s));
        dt_assert_ok(kvh_seq_free(e, s));
    }
    kvh_stats st = dt_stats(e);
    if (st.drops != 0)
        fail_msg("filling the %u free slots dropped %" PRIu64 " blocks", extra, st.drops);
    assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, DISK_SLOTS);
    dt_assert_ok(dt_close(dt_untrack(e)));
    e = dt_open_a(&c);
    for (uint32_t i = 0; i < UNIVERSE_CHAINS + extra; i++) {
        size_t m = 0, want = i < UNIVERSE_CHAINS ? chain_len() : G.bt;
        char msg[256] = "";
        dt_content ct = i < UNIVERSE_CHAINS ? chain(i) : extra_chain(i - UNIVERSE_CHAINS);
        if (dt_match_verify(e, G, ct, want, &m, msg, sizeof(msg)) != KVH_OK)
            fail_msg("full store, chain %u: %s", i, msg);
        if ((i >= UNIVERSE_CHAINS || S.acked[i]) && m != want)
            fail_msg("full store, chain %u: %zu of %zu tokens", i, m, want);
    }
    dt_assert_ok(dt_close(dt_untrack(e)));
    printf("full store: %" PRIu64 " blocks of the loop + %u new ones fill the %d slots, nothing dropped\n", used, extra,
           DISK_SLOTS);
}

static void dump_errlog(void) { dt_print_file(S.errlog, "child stderr"); }

static void test_crash_loop_keeps_acks_and_space(void **state)
{
    (void)state;
    int cycles = (int)dt_env_long("KVH_DISK_CRASH_LOOP_CYCLES", CRASH_LOOP_STRESS ? 1000 : 60);
    uint64_t seed = dt_seed(0xc4a5410u);
    dt_rng r = {seed};
    dt_scratch("crash-loop", S.dir, sizeof(S.dir));
    char base[512];
    snprintf(base, sizeof(base), "%s", S.dir);
    snprintf(S.oracle, sizeof(S.oracle), "%s.oracle", base);
    snprintf(S.errlog, sizeof(S.errlog), "%s.stderr", base);
    memset(S.acked, 0, sizeof(S.acked));
    S.slab_bytes = 0;
    assert_int_equal(dt_write_file(S.oracle, "", 0), 0);
    assert_int_equal(dt_write_file(S.errlog, "", 0), 0);

    int kills_open = 0, kills_close = 0, kills_run = 0;
    uint64_t max_used = 0, last_used = 0;
    double t0 = dt_now();
    for (int cycle = 0; cycle < cycles; cycle++) {
        child_arg a = {dt_next(&r), dt_below(&r, 3) == 0 ? KVH_DISK_BUFFERED : 0u, false};
        bool early = dt_below(&r, 10) == 0;
        a.close_kill = !early && dt_below(&r, 4) == 0;
        /* early: 0-30 ms after fork (the open); inside close: 0-8 ms after
         * close began; else 1-60 ms of work */
        uint64_t delay_us = early          ? dt_below(&r, 30000)
                            : a.close_kill ? dt_below(&r, 8000)
                                           : 1000 + dt_below(&r, 59000);
        int ws = 0;
        dt_kill_result kr = dt_kill_child(loop_child, &a, early, 20000, delay_us, &ws);
        char msg[256];
        if (dt_kill_failed(kr, ws, msg, sizeof(msg))) {
            dump_errlog();
            fail_msg("cycle %d (seed 0x%" PRIx64 "): %s", cycle, seed, msg);
        }
        kills_open += early;
        kills_close += a.close_kill;
        kills_run += !early && !a.close_kill;
        read_acks();

        check_result cr;
        if (cycle % 2) {
            int rc = dt_in_child(check_child, &cr);
            if (rc != 0) {
                dump_errlog();
                fail_msg("cycle %d (seed 0x%" PRIx64 "): the unclean check failed (%d), see above", cycle, seed, rc);
            }
            continue;
        }
        kvh_engine *e = check_store(&cr);
        if (e)
            dt_assert_ok(kvh_engine_close(e));
        if (cr.errors) {
            dump_errlog();
            fail_msg("cycle %d (seed 0x%" PRIx64 "): %d errors; last: %s", cycle, seed, cr.errors, cr.msg);
        }
        check_files_after_close(cycle, cr.disk_used);
        max_used = cr.disk_used > max_used ? cr.disk_used : max_used;
        last_used = cr.disk_used;
    }
    int acked = 0;
    for (int c = 0; c < UNIVERSE_CHAINS; c++)
        acked += S.acked[c];
    fill_free_slots();
    printf("crash loop: %d cycles in %.1f s (seed 0x%" PRIx64 "): %d kills in open, %d in close, %d while running; "
           "%d of %d chains acknowledged; disk blocks at most %" PRIu64 ", last %" PRIu64 " (universe %d)\n",
           cycles, dt_now() - t0, seed, kills_open, kills_close, kills_run, acked, UNIVERSE_CHAINS, max_used, last_used,
           UNIVERSE_BLOCKS);
    /* The loop must have exercised something: acknowledgements happened. */
    assert_true(acked > 0);
    dt_rmrf(S.dir);
    unlink(S.oracle);
    unlink(S.errlog);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_crash_loop_keeps_acks_and_space, dt_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
