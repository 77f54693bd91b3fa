/* The remote tier against a live 3-node Redis Cluster started on loopback
 * ports by the test (tests/c/remote_test_util.h): a prefix persisted by
 * one process is matched by another with an empty local store and reads
 * back byte-identical; tampered and forged values are misses and are
 * deleted; a killed node gives misses within the deadline and its keys
 * come back with it; a full server keeps working as a cache; a slot
 * migration (ASK, then MOVED) keeps lookups right; a wrong password, TLS
 * and bad addresses fail the open clearly. Skipped where redis-server is
 * not installed (scripts/install-deps.sh installs it). */
#include "test_util.h"

#include "disk_test_util.h"

#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/engine.h"
#include "core/remote_cluster.h"
#include "core/remote_format.h"
#include "core/remote_tier.h"
#include "remote_test_util.h"

#define LAYERS 2
#define HEADS 2
#define DIM 64
#define BT 16
#define TOK_BYTES (HEADS * DIM * 2)
#define N_BLOCKS 32
#define PASSWORD "kvh-test-pw"

static rt_cluster cluster;
static bool have_cluster;

static int group_setup(void **state)
{
    (void)state;
    if (!rt_available())
        return 0;
    have_cluster = rt_start_scratch(&cluster, 3, PASSWORD) == 0;
    return have_cluster ? 0 : -1;
}

static int group_teardown(void **state)
{
    (void)state;
    if (have_cluster)
        rt_stop(&cluster);
    return 0;
}

#define NEED_CLUSTER()                                                                                                 \
    do {                                                                                                               \
        if (!have_cluster)                                                                                             \
            skip();                                                                                                    \
    } while (0)

static kvh_config remote_cfg(uint64_t salt)
{
    kvh_config c = tu_cfg(LAYERS, HEADS, DIM, BT, KVH_DTYPE_F16, 64, 256, 1);
    c.model_salt = salt;
    c.remote_addrs = rt_addrs(&cluster);
    c.remote_password = PASSWORD;
    /* A round's whole budget (not each read's): generous for a loaded
     * 2-core machine under ASan. */
    c.remote_timeout_ms = 2000;
    c.remote_breaker_ms = 300;
    return c;
}

static void prefix_tokens(int32_t *t, size_t n, int32_t base) { tu_iota(t, n, base); }

/* Engine A: writes N_BLOCKS blocks of tag's pattern at tokens base.. and
 * persists them; 0 when every upload went through. */
static int persist_prefix(const kvh_config *c, int32_t base, uint64_t tag)
{
    kvh_engine *e;
    if (kvh_engine_open(c, &e) != KVH_OK)
        return 2;
    kvh_seq s;
    int32_t tokens[N_BLOCKS * BT];
    prefix_tokens(tokens, N_BLOCKS * BT, base);
    if (kvh_seq_create(e, 0, &s) != KVH_OK || kvh_seq_append(e, s, tokens, N_BLOCKS * BT) != KVH_OK)
        return 3;
    uint8_t k[TOK_BYTES], v[TOK_BYTES];
    for (uint32_t l = 0; l < LAYERS; l++)
        for (size_t t = 0; t < N_BLOCKS * BT; t++) {
            tu_pattern(k, TOK_BYTES, tag, l, t, 0);
            tu_pattern(v, TOK_BYTES, tag, l, t, 1);
            if (kvh_seq_write_kv(e, s, l, t, 1, k, v) != KVH_OK)
                return 4;
        }
    if (kvh_seq_persist(e, s) != KVH_OK)
        return 5;
    kvh_stats st = {.struct_size = sizeof(st)};
    kvh_engine_stats(e, &st);
    kvh_engine_close(e);
    return st.remote_uploads_dropped == 0 && st.remote_uploads > 0 ? 0 : 6;
}

/* Runs persist_prefix in another process: this program again, started
 * with --persist (a fork of a process with engine threads would not do
 * under TSan, and a fresh process is what another node is). */
static void persist_in_child(uint64_t salt, int32_t base, uint64_t tag)
{
    char args[3][32];
    snprintf(args[0], sizeof(args[0]), "%llu", (unsigned long long)salt);
    snprintf(args[1], sizeof(args[1]), "%d", base);
    snprintf(args[2], sizeof(args[2]), "%llu", (unsigned long long)tag);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        execl("/proc/self/exe", "test_remote_tier", "--persist", rt_addrs(&cluster), args[0], args[1], args[2],
              (char *)NULL);
        _exit(127);
    }
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
}

static size_t match(kvh_engine *e, kvh_seq *s, int32_t base)
{
    int32_t tokens[N_BLOCKS * BT];
    prefix_tokens(tokens, N_BLOCKS * BT, base);
    *s = tu_seq_new(e, 0);
    size_t m = 0;
    assert_ok(kvh_seq_match_prefix(e, *s, tokens, N_BLOCKS * BT, &m));
    return m;
}

/* A fresh key space per test and run; KVH_TEST_REMOTE_PID replays the
 * keys of the run with that process id (a failure's salt). */
static uint64_t test_salt(void)
{
    static uint64_t n;
    const char *pid = getenv("KVH_TEST_REMOTE_PID");
    uint64_t p = pid && *pid ? strtoull(pid, NULL, 0) : (uint64_t)getpid();
    return 0x7e57000000000000ull ^ (p << 16) ^ ++n;
}

static void test_shared_across_processes(void **state)
{
    (void)state;
    NEED_CLUSTER();
    uint64_t salt = test_salt();
    persist_in_child(salt, 1000, 77);
    kvh_config c = remote_cfg(salt);
    kvh_engine *e = tu_open_cfg(&c);
    kvh_seq s;
    assert_int_equal(match(e, &s, 1000), N_BLOCKS * BT);
    assert_true(tu_check_pattern(e, s, LAYERS, TOK_BYTES, 77, 0, N_BLOCKS * BT));
    kvh_stats st = tu_stats(e);
    assert_int_equal(st.remote_hits, N_BLOCKS);
    assert_int_equal(st.remote_corrupt, 0);
    assert_int_equal(st.prefix_hit_blocks, N_BLOCKS);
    /* Now local: a second match asks nothing of the store. */
    kvh_seq s2;
    assert_int_equal(match(e, &s2, 1000), N_BLOCKS * BT);
    assert_int_equal(tu_stats(e).remote_hits, N_BLOCKS);
    /* kvh_prefix_lookup (the vLLM connector's lookup) continues in the
     * store too; the blocks it brings are then local for a match. */
    kvh_engine *e4 = tu_open_cfg(&c);
    int32_t tokens[N_BLOCKS * BT];
    prefix_tokens(tokens, N_BLOCKS * BT, 1000);
    kvh_block out[N_BLOCKS];
    size_t nb = 0;
    assert_ok(kvh_prefix_lookup(e4, tokens, N_BLOCKS * BT, out, N_BLOCKS, &nb));
    assert_int_equal(nb, N_BLOCKS);
    assert_int_equal(tu_stats(e4).remote_hits, N_BLOCKS);
    kvh_seq s4;
    assert_int_equal(match(e4, &s4, 1000), N_BLOCKS * BT);
    assert_true(tu_check_pattern(e4, s4, LAYERS, TOK_BYTES, 77, 0, N_BLOCKS * BT));
    assert_int_equal(tu_stats(e4).remote_hits, N_BLOCKS);
    for (size_t i = 0; i < nb; i++)
        assert_ok(kvh_block_release(e4, out[i]));
    /* Another model (salt) sees none of it. */
    kvh_config other = remote_cfg(salt ^ 1);
    kvh_engine *e2 = tu_open_cfg(&other);
    kvh_seq s3;
    assert_int_equal(match(e2, &s3, 1000), 0);
    /* Each block sought and not found is a miss, not each match. */
    assert_int_equal(tu_stats(e2).remote_misses, N_BLOCKS);
}

/* Memory tiers of a few blocks beside a disk tier with room: a match from
 * the store brings the whole prefix, the blocks it attached first going
 * down to disk to make room. It stopped where the memory tiers were full
 * (4 of 32 blocks here), counting the rest as misses. */
static void test_match_past_the_memory_tiers(void **state)
{
    (void)state;
    NEED_CLUSTER();
    uint64_t salt = test_salt();
    persist_in_child(salt, 1000, 88);
    char dir[512];
    dt_scratch("remote-small-memory", dir, sizeof(dir));
    kvh_config c = remote_cfg(salt);
    c.device_bytes = 2 * tu_block_bytes_of(LAYERS, HEADS, DIM, BT, KVH_DTYPE_F16);
    c.host_bytes = c.device_bytes;
    c.disk_path = dir;
    c.disk_bytes = 2 * N_BLOCKS * tu_block_bytes_of(LAYERS, HEADS, DIM, BT, KVH_DTYPE_F16);
    kvh_engine *e = tu_open_cfg(&c);
    kvh_seq s;
    assert_int_equal(match(e, &s, 1000), N_BLOCKS * BT);
    assert_true(tu_check_pattern(e, s, LAYERS, TOK_BYTES, 88, 0, N_BLOCKS * BT));
    kvh_stats st = tu_stats(e);
    assert_int_equal(st.remote_hits, N_BLOCKS);
    assert_int_equal(st.remote_misses, 0);
    assert_true(tu_tier(e, KVH_TIER_DISK).used_blocks >= N_BLOCKS - 4);
}

/* kvh_blocks_persist (the vLLM connector's persist of pool blocks) uploads
 * like kvh_seq_persist, synchronously and through a fence, also on an
 * engine whose only lower tier is the remote one. */
static void test_blocks_persist_uploads(void **state)
{
    (void)state;
    NEED_CLUSTER();
    uint64_t salt = test_salt();
    kvh_config c = remote_cfg(salt);
    kvh_engine *a = tu_open_cfg(&c);
    int32_t tokens[N_BLOCKS * BT];
    prefix_tokens(tokens, N_BLOCKS * BT, 3000);
    kvh_seq s = tu_seq_new(a, 0);
    assert_ok(kvh_seq_append(a, s, tokens, N_BLOCKS * BT));
    tu_write_pattern(a, s, LAYERS, TOK_BYTES, 91, 0, N_BLOCKS * BT);
    kvh_block blocks[N_BLOCKS];
    assert_ok(kvh_seq_blocks(a, s, 0, N_BLOCKS, blocks));
    /* The first half in the call, the second through a fence. */
    assert_ok(kvh_blocks_persist(a, blocks, N_BLOCKS / 2, NULL));
    assert_int_equal(tu_stats(a).remote_uploads, N_BLOCKS / 2);
    kvh_fence f;
    assert_ok(kvh_blocks_persist(a, blocks + N_BLOCKS / 2, N_BLOCKS / 2, &f));
    assert_ok(kvh_fence_wait(a, f, -1));
    assert_ok(kvh_fence_free(a, f));
    kvh_stats st = tu_stats(a);
    assert_int_equal(st.remote_uploads, N_BLOCKS);
    assert_int_equal(st.remote_uploads_dropped, 0);
    /* Persisting again uploads nothing: the store has them all. */
    assert_ok(kvh_blocks_persist(a, blocks, N_BLOCKS, NULL));
    assert_int_equal(tu_stats(a).remote_uploads, N_BLOCKS);
    kvh_engine *b = tu_open_cfg(&c);
    kvh_seq sb;
    assert_int_equal(match(b, &sb, 3000), N_BLOCKS * BT);
    assert_true(tu_check_pattern(b, sb, LAYERS, TOK_BYTES, 91, 0, N_BLOCKS * BT));
    assert_int_equal(tu_stats(b).remote_hits, N_BLOCKS);
}

/* Reads all KV of s (layers x n tokens, K then V) into out. */
static void read_all(kvh_engine *e, kvh_seq s, uint8_t *out)
{
    for (uint32_t l = 0; l < LAYERS; l++) {
        uint8_t *k = out + (size_t)l * 2 * N_BLOCKS * BT * TOK_BYTES;
        assert_ok(kvh_seq_read_kv(e, s, l, 0, N_BLOCKS * BT, k, k + (size_t)N_BLOCKS * BT * TOK_BYTES));
    }
}

/* With a codec the values hold encoded blocks: an engine with a host tier
 * (encoded too) takes them as they are, one with a device tier only (raw)
 * decodes them; both read the same KV. */
static void test_codec_into_either_tier(void **state)
{
    (void)state;
    NEED_CLUSTER();
    uint64_t salt = test_salt();
    kvh_config c = remote_cfg(salt);
    c.kv_codec = KVH_CODEC_INT8;
    kvh_engine *a = tu_open_cfg(&c);
    int32_t tokens[N_BLOCKS * BT];
    prefix_tokens(tokens, N_BLOCKS * BT, 5000);
    kvh_seq s = tu_seq_new(a, 0);
    assert_ok(kvh_seq_append(a, s, tokens, N_BLOCKS * BT));
    tu_write_pattern(a, s, LAYERS, TOK_BYTES, 23, 0, N_BLOCKS * BT);
    assert_ok(kvh_seq_persist(a, s));
    assert_int_equal(tu_stats(a).remote_uploads, N_BLOCKS);
    kvh_engine *with_host = tu_open_cfg(&c);
    kvh_config dev = c;
    dev.host_bytes = 0;
    dev.device_bytes = (N_BLOCKS + 8) * tu_block_bytes(a);
    kvh_engine *device_only = tu_open_cfg(&dev);
    kvh_seq sh, sd;
    assert_int_equal(match(with_host, &sh, 5000), N_BLOCKS * BT);
    assert_int_equal(match(device_only, &sd, 5000), N_BLOCKS * BT);
    size_t bytes = (size_t)LAYERS * 2 * N_BLOCKS * BT * TOK_BYTES;
    uint8_t *kv_h = malloc(bytes), *kv_d = malloc(bytes);
    assert_non_null(kv_h);
    assert_non_null(kv_d);
    read_all(with_host, sh, kv_h);
    read_all(device_only, sd, kv_d);
    assert_memory_equal(kv_h, kv_d, bytes);
    assert_int_equal(tu_stats(with_host).remote_hits, N_BLOCKS);
    assert_int_equal(tu_stats(device_only).remote_hits, N_BLOCKS);
    assert_int_equal(tu_stats(device_only).remote_corrupt, 0);
    free(kv_h);
    free(kv_d);
}

/* Waits (up to 20 s) until e's uploads and drops reach n; true when so. */
static bool uploads_reach(kvh_engine *e, uint64_t n)
{
    for (int i = 0; i < 2000; i++) {
        kvh_stats st = tu_stats(e);
        if (st.remote_uploads + st.remote_uploads_dropped >= n)
            return true;
        dt_sleep_ms(10);
    }
    return false;
}

/* Write-through: every block goes up as it is published, without a
 * persist; another engine finds them all, byte-identical. Blocks it
 * brought from the store are not sent back. */
static void test_write_through(void **state)
{
    (void)state;
    NEED_CLUSTER();
    uint64_t salt = test_salt();
    kvh_config c = remote_cfg(salt);
    c.remote_upload = KVH_REMOTE_UPLOAD_WRITE_THROUGH;
    kvh_engine *a = tu_open_cfg(&c);
    /* Its own client: its rounds never hold up a match's; the engine's
     * threads share several. */
    assert_non_null(a->remote->upload_cluster);
    assert_int_equal(a->remote->n_clients, KVHI_REMOTE_CLIENTS);
    for (uint32_t i = 0; i < a->remote->n_clients; i++)
        assert_ptr_not_equal(a->remote->upload_cluster, a->remote->clients[i]);
    int32_t tokens[N_BLOCKS * BT];
    prefix_tokens(tokens, N_BLOCKS * BT, 7000);
    kvh_seq s = tu_seq_new(a, 0);
    assert_ok(kvh_seq_append(a, s, tokens, N_BLOCKS * BT));
    tu_write_pattern(a, s, LAYERS, TOK_BYTES, 41, 0, N_BLOCKS * BT);
    assert_true(uploads_reach(a, N_BLOCKS));
    kvh_stats st = tu_stats(a);
    assert_int_equal(st.remote_uploads, N_BLOCKS);
    assert_int_equal(st.remote_uploads_dropped, 0);
    kvh_engine *b = tu_open_cfg(&c);
    kvh_seq sb;
    assert_int_equal(match(b, &sb, 7000), N_BLOCKS * BT);
    assert_true(tu_check_pattern(b, sb, LAYERS, TOK_BYTES, 41, 0, N_BLOCKS * BT));
    assert_int_equal(tu_stats(b).remote_hits, N_BLOCKS);
    /* b queued nothing: what it matched came from the store. */
    assert_ok(tu_close(b));
    /* A partial block is never sent; closing sends what is queued. */
    kvh_seq s2 = tu_seq_new(a, 0);
    assert_ok(kvh_seq_append(a, s2, tokens, BT + 3));
    tu_write_pattern(a, s2, LAYERS, TOK_BYTES, 42, 0, BT + 3);
    assert_ok(kvh_seq_free(a, s2));
    assert_ok(tu_close(a));
}

/* A small engine (dev and host blocks, one worker) writing every block
 * through to the cluster, with a deadline longer than any test: no round
 * gives up while the cluster is stopped. */
static kvh_config write_through_cfg(uint64_t dev, uint64_t host)
{
    kvh_config c = tu_cfg(LAYERS, HEADS, DIM, BT, KVH_DTYPE_F16, dev, host, 1);
    c.model_salt = test_salt();
    c.remote_addrs = rt_addrs(&cluster);
    c.remote_password = PASSWORD;
    c.remote_timeout_ms = 5000;
    c.remote_upload = KVH_REMOTE_UPLOAD_WRITE_THROUGH;
    return c;
}

/* Blocks waiting for an upload are unreferenced to the caller: the header
 * promises they leave the device tier before any referenced block, even
 * while the store is slow to take them (every node stopped here, so each
 * of them waits in the queue or in a round for the whole test). */
static void test_blocks_awaiting_upload_leave_first(void **state)
{
    (void)state;
    NEED_CLUSTER();
    enum { DEV = 8, KEPT = 2, CACHED = 4 };
    kvh_config c = write_through_cfg(DEV, 64);
    kvh_engine *e = tu_open_cfg(&c);
    int32_t tokens[(KEPT + CACHED) * BT];
    prefix_tokens(tokens, (KEPT + CACHED) * BT, 91000);
    /* kept: referenced, and the oldest in the device tier. */
    kvh_seq kept = tu_seq_new(e, 0);
    assert_ok(kvh_seq_append(e, kept, tokens, KEPT * BT));
    tu_write_pattern(e, kept, LAYERS, TOK_BYTES, 51, 0, KEPT * BT);
    assert_true(uploads_reach(e, KEPT));
    for (int i = 0; i < cluster.n; i++)
        kill(cluster.pids[i], SIGSTOP);
    /* cached: published (so queued for upload), then let go. */
    kvh_seq cached = tu_seq_new(e, 0);
    assert_ok(kvh_seq_append(e, cached, tokens + KEPT * BT, CACHED * BT));
    tu_write_pattern(e, cached, LAYERS, TOK_BYTES, 52, 0, CACHED * BT);
    kvh_block cb[CACHED];
    assert_ok(kvh_seq_blocks(e, cached, 0, CACHED, cb));
    uint32_t cached_refs[CACHED]; /* checked once the nodes run again */
    for (int i = 0; i < CACHED; i++) {
        kvh_block_info info = {.struct_size = sizeof(info)};
        assert_ok(kvh_block_info_get(e, cb[i], &info));
        cached_refs[i] = info.refs;
    }
    assert_ok(kvh_seq_free(e, cached));
    /* New blocks take the last free slots, then CACHED more. */
    kvh_block fresh[DEV - KEPT];
    for (int i = 0; i < DEV - KEPT; i++)
        assert_ok(kvh_block_alloc(e, 0, &fresh[i]));
    kvh_block kb[KEPT];
    assert_ok(kvh_seq_blocks(e, kept, 0, KEPT, kb));
    uint32_t kept_tier[KEPT];
    for (int i = 0; i < KEPT; i++) {
        kvh_block_info info = {.struct_size = sizeof(info)};
        assert_ok(kvh_block_info_get(e, kb[i], &info));
        kept_tier[i] = info.tier;
    }
    for (int i = 0; i < cluster.n; i++)
        kill(cluster.pids[i], SIGCONT);
    for (int i = 0; i < CACHED; i++) /* a pending upload's references are not the caller's */
        if (cached_refs[i] != 1)
            fail_msg("block %d of one sequence, its upload pending, reports %u refs", i, cached_refs[i]);
    for (int i = 0; i < KEPT; i++)
        if (kept_tier[i] != KVH_TIER_DEVICE)
            fail_msg("referenced block %d left the device tier (to tier %u) before unreferenced ones", i, kept_tier[i]);
    assert_true(tu_check_pattern(e, kept, LAYERS, TOK_BYTES, 51, 0, KEPT * BT));
    for (int i = 0; i < DEV - KEPT; i++)
        assert_ok(kvh_block_release(e, fresh[i]));
    assert_ok(kvh_seq_free(e, kept));
    assert_ok(tu_close(e));
    assert_int_equal(rt_wait_ok(&cluster, 20000), 0);
}

/* A store that stops answering cannot fill the local tiers with blocks
 * waiting to go up: the queue keeps part of the last tier at most, what
 * does not fit is dropped and counted, and allocations go on. */
static void test_stalled_store_leaves_room(void **state)
{
    (void)state;
    NEED_CLUSTER();
    enum { DEV = 8, HOST = 16, SEQS = 4 * (DEV + HOST) };
    kvh_config c = write_through_cfg(DEV, HOST);
    kvh_engine *e = tu_open_cfg(&c);
    for (int i = 0; i < cluster.n; i++)
        kill(cluster.pids[i], SIGSTOP);
    int32_t tokens[BT];
    kvh_status failed = KVH_OK;
    char why[256] = "";
    int at = 0;
    for (; at < SEQS && failed == KVH_OK; at++) {
        prefix_tokens(tokens, BT, 95000 + at * BT);
        kvh_seq s = tu_seq_new(e, 0);
        failed = kvh_seq_append(e, s, tokens, BT);
        snprintf(why, sizeof(why), "%s", kvh_last_error());
        if (failed == KVH_OK)
            tu_write_pattern(e, s, LAYERS, TOK_BYTES, 61, 0, BT);
        assert_ok(kvh_seq_free(e, s));
    }
    kvh_stats st = tu_stats(e);
    for (int i = 0; i < cluster.n; i++)
        kill(cluster.pids[i], SIGCONT);
    if (failed != KVH_OK)
        fail_msg("sequence %d of %d, the store stalled: %s (%s)", at, SEQS, kvh_status_name(failed), why);
    assert_true(st.remote_uploads_dropped > 0);
    assert_ok(tu_close(e));
    assert_int_equal(rt_wait_ok(&cluster, 20000), 0);
}

/* Demotion: blocks go up when they move to the disk tier, read back from
 * their slots (and stay there); none before. */
static void test_demote_uploads(void **state)
{
    (void)state;
    NEED_CLUSTER();
    char dir[512];
    dt_scratch("remote-demote", dir, sizeof(dir));
    uint64_t salt = test_salt();
    kvh_config c = remote_cfg(salt);
    c.remote_upload = KVH_REMOTE_UPLOAD_DEMOTE;
    c.disk_path = dir;
    c.disk_bytes = 4 * N_BLOCKS * tu_block_bytes_of(LAYERS, HEADS, DIM, BT, KVH_DTYPE_F16);
    kvh_engine *a = tu_open_cfg(&c);
    int32_t tokens[N_BLOCKS * BT];
    prefix_tokens(tokens, N_BLOCKS * BT, 9000);
    kvh_seq s = tu_seq_new(a, 0);
    assert_ok(kvh_seq_append(a, s, tokens, N_BLOCKS * BT));
    tu_write_pattern(a, s, LAYERS, TOK_BYTES, 57, 0, N_BLOCKS * BT);
    dt_sleep_ms(50);
    assert_int_equal(tu_stats(a).remote_uploads, 0); /* published, still in memory */
    kvh_fence f;
    assert_ok(kvh_seq_migrate(a, s, 0, N_BLOCKS * BT, KVH_TIER_DISK, &f));
    assert_ok(kvh_fence_wait(a, f, UINT64_MAX));
    assert_ok(kvh_fence_free(a, f));
    assert_true(uploads_reach(a, N_BLOCKS));
    kvh_stats st = tu_stats(a);
    assert_int_equal(st.remote_uploads, N_BLOCKS);
    assert_int_equal(st.remote_uploads_dropped, 0);
    kvh_tier_info ti = {.struct_size = sizeof(ti)};
    assert_ok(kvh_tier_info_get(a, KVH_TIER_DISK, &ti));
    assert_true(ti.used_blocks >= N_BLOCKS); /* uploading left them on disk */
    kvh_config cb = remote_cfg(salt);
    kvh_engine *b = tu_open_cfg(&cb);
    kvh_seq sb;
    assert_int_equal(match(b, &sb, 9000), N_BLOCKS * BT);
    assert_true(tu_check_pattern(b, sb, LAYERS, TOK_BYTES, 57, 0, N_BLOCKS * BT));
    assert_ok(tu_close(b));
    assert_ok(tu_close(a));
}

/* With the cluster unreachable, background uploads are dropped and
 * counted, writes never wait for them, and close does not hang. */
static void test_background_uploads_dropped(void **state)
{
    (void)state;
    NEED_CLUSTER();
    kvh_config c = remote_cfg(test_salt());
    c.remote_addrs = "127.0.0.1:1";
    c.remote_upload = KVH_REMOTE_UPLOAD_WRITE_THROUGH;
    kvh_engine *a = tu_open_cfg(&c);
    int32_t tokens[N_BLOCKS * BT];
    prefix_tokens(tokens, N_BLOCKS * BT, 11000);
    kvh_seq s = tu_seq_new(a, 0);
    assert_ok(kvh_seq_append(a, s, tokens, N_BLOCKS * BT));
    double t0 = dt_now();
    tu_write_pattern(a, s, LAYERS, TOK_BYTES, 5, 0, N_BLOCKS * BT);
    assert_true(uploads_reach(a, N_BLOCKS));
    kvh_stats st = tu_stats(a);
    assert_int_equal(st.remote_uploads, 0);
    assert_int_equal(st.remote_uploads_dropped, N_BLOCKS);
    assert_ok(tu_close(a));
    assert_true(dt_now() - t0 < 10.0);
}

/* The key of block i of the prefix at base under cfg (through an engine's
 * identity, as the tier computes it). */
static void key_of(kvh_engine *e, int32_t base, size_t i, char *key)
{
    int32_t tokens[N_BLOCKS * BT];
    prefix_tokens(tokens, N_BLOCKS * BT, base);
    uint64_t h = 0, parent = 0;
    for (size_t j = 0; j <= i; j++) {
        parent = h;
        assert_ok(kvh_prefix_hash(e, h, tokens + j * BT, BT, &h));
    }
    kvhi_remote_key(key, &e->remote->id, h, parent, tokens + i * BT);
}

static void test_tampered_value_is_deleted(void **state)
{
    (void)state;
    NEED_CLUSTER();
    uint64_t salt = test_salt();
    persist_in_child(salt, 5000, 12);
    kvh_config c = remote_cfg(salt);
    kvh_engine *e = tu_open_cfg(&c);
    char key[KVHI_REMOTE_KEY_BYTES], out[256];
    key_of(e, 5000, 5, key);
    assert_int_equal(rt_cli(&cluster, 0, out, sizeof(out), "SET %s garbage", key), 0);
    assert_string_equal(out, "OK");
    kvh_seq s;
    assert_int_equal(match(e, &s, 5000), 5 * BT);
    assert_true(tu_check_pattern(e, s, LAYERS, TOK_BYTES, 12, 0, 5 * BT));
    kvh_stats st = tu_stats(e);
    assert_int_equal(st.remote_corrupt, 1);
    assert_int_equal(st.remote_hits, 5);
    assert_int_equal(st.remote_misses, N_BLOCKS - 5); /* the tampered one and all after it */
    assert_int_equal(rt_cli(&cluster, 0, out, sizeof(out), "EXISTS %s", key), 0);
    assert_string_equal(out, "0");

    /* A forged value with valid checksums: block 7's value stored under
     * block 6's key (right geometry, wrong hash, parent and tokens). */
    char k6[KVHI_REMOTE_KEY_BYTES], k7[KVHI_REMOTE_KEY_BYTES];
    key_of(e, 5000, 6, k6);
    key_of(e, 5000, 7, k7);
    kvhi_cluster *cl = e->remote->cluster;
    kvhi_cluster_cmd get = {.argc = 2, .argv = {"GET", k7}, .argvlen = {3, strlen(k7)}};
    kvhi_cluster_report rep;
    kvhi_cluster_run(cl, &get, 1, &rep);
    const char *val;
    size_t len;
    assert_int_equal(kvhi_cluster_reply(&get, &val, &len, NULL), KVHI_REPLY_STRING);
    kvhi_cluster_cmd set = {.argc = 3, .argv = {"SET", k6, val}, .argvlen = {3, strlen(k6), len}};
    kvhi_cluster_run(cl, &set, 1, &rep);
    assert_int_equal(kvhi_cluster_reply(&set, NULL, NULL, NULL), KVHI_REPLY_STATUS);
    kvhi_cluster_cmds_clear(cl, &get, 1);
    kvhi_cluster_cmds_clear(cl, &set, 1);
    /* Block 5 comes back from a new persist; 6 is then the forgery. */
    persist_in_child(salt, 5000, 12);
    kvh_engine *e2 = tu_open_cfg(&c);
    kvh_seq s2;
    assert_int_equal(match(e2, &s2, 5000), 6 * BT);
    assert_true(tu_check_pattern(e2, s2, LAYERS, TOK_BYTES, 12, 0, 6 * BT));
    assert_int_equal(tu_stats(e2).remote_corrupt, 1);
    assert_int_equal(rt_cli(&cluster, 0, out, sizeof(out), "EXISTS %s", k6), 0);
    assert_string_equal(out, "0");
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void test_node_killed_and_back(void **state)
{
    (void)state;
    NEED_CLUSTER();
    uint64_t salt = test_salt();
    persist_in_child(salt, 9000, 33);
    kvh_config c = remote_cfg(salt);
    kvh_engine *e = tu_open_cfg(&c);
    rt_kill(&cluster, 1);
    /* Misses within the deadline: a few rounds at most, never a hang. */
    double t0 = now_ms();
    kvh_seq s;
    size_t m = match(e, &s, 9000);
    double took = now_ms() - t0;
    assert_true(m < N_BLOCKS * BT); /* a third of the blocks lived there */
    assert_true(tu_check_pattern(e, s, LAYERS, TOK_BYTES, 33, 0, m));
    assert_true(took < 4.0 * c.remote_timeout_ms);
    kvh_stats st = tu_stats(e);
    assert_int_equal(st.remote_hits + st.remote_misses, N_BLOCKS);
    assert_true(st.remote_breaker_opens >= 1);
    /* Left alone now: the next match costs no connect attempt. */
    t0 = now_ms();
    kvh_seq s2;
    assert_int_equal(match(e, &s2, 9000), m);
    assert_true(now_ms() - t0 < 2.0 * c.remote_timeout_ms);
    /* Back, with its keys (append-only file). */
    assert_int_equal(rt_restart(&cluster, 1), 0);
    assert_int_equal(rt_wait_ok(&cluster, 20000), 0);
    usleep((useconds_t)c.remote_breaker_ms * 1000 + 100000);
    kvh_engine *e2 = tu_open_cfg(&c);
    kvh_seq s3;
    size_t m3 = 0;
    for (int tries = 0; tries < 20 && m3 < N_BLOCKS * BT; tries++) {
        m3 = match(e2, &s3, 9000);
        if (m3 < N_BLOCKS * BT) {
            kvh_seq_free(e2, s3);
            usleep(200000);
        }
    }
    assert_int_equal(m3, N_BLOCKS * BT);
    assert_true(tu_check_pattern(e2, s3, LAYERS, TOK_BYTES, 33, 0, m3));
}

/* A node that stops answering (SIGSTOP: its socket still accepts) makes
 * a round wait only until the deadline; the blocks it holds are misses. */
static void test_slow_node_times_out(void **state)
{
    (void)state;
    NEED_CLUSTER();
    uint64_t salt = test_salt();
    persist_in_child(salt, 60000, 66);
    kvh_config c = remote_cfg(salt);
    kvh_engine *e = tu_open_cfg(&c);
    kill(cluster.pids[2], SIGSTOP);
    double t0 = now_ms();
    kvh_seq s;
    size_t m = match(e, &s, 60000);
    double took = now_ms() - t0;
    kill(cluster.pids[2], SIGCONT);
    assert_true(m < N_BLOCKS * BT);
    assert_true(tu_check_pattern(e, s, LAYERS, TOK_BYTES, 66, 0, m));
    /* An EXISTS round and a GETEX round at most, each within its deadline. */
    assert_true(took < 2.0 * c.remote_timeout_ms + 300);
    kvh_stats st = tu_stats(e);
    assert_true(st.remote_timeouts >= 1);
    assert_true(st.remote_breaker_opens >= 1);
    assert_int_equal(rt_wait_ok(&cluster, 20000), 0);
}

static void test_full_server_is_a_cache(void **state)
{
    (void)state;
    NEED_CLUSTER();
    char out[256];
    for (int i = 0; i < cluster.n; i++) {
        assert_int_equal(rt_cli(&cluster, i, out, sizeof(out), "CONFIG SET maxmemory-policy allkeys-lru"), 0);
        assert_int_equal(rt_cli(&cluster, i, out, sizeof(out), "CONFIG SET maxmemory 3mb"), 0);
        assert_string_equal(out, "OK");
    }
    uint64_t salt = test_salt();
    /* Four prefixes of 32 blocks (over 2 MiB each) into ~9 MiB. */
    for (int p = 0; p < 4; p++)
        persist_in_child(salt, 20000 + 1000 * p, 40 + (uint64_t)p);
    kvh_config c = remote_cfg(salt);
    kvh_engine *e = tu_open_cfg(&c);
    size_t total = 0;
    for (int p = 0; p < 4; p++) {
        kvh_seq s;
        size_t m = match(e, &s, 20000 + 1000 * p);
        assert_true(tu_check_pattern(e, s, LAYERS, TOK_BYTES, 40 + (uint64_t)p, 0, m));
        total += m;
    }
    /* Evicted blocks are misses; what is served is right. */
    assert_true(total < 4 * N_BLOCKS * BT);
    assert_int_equal(tu_stats(e).remote_corrupt, 0);
    for (int i = 0; i < cluster.n; i++)
        assert_int_equal(rt_cli(&cluster, i, out, sizeof(out), "CONFIG SET maxmemory 0"), 0);
}

/* Moves slot of key from its node to the next one: IMPORTING/MIGRATING,
 * MIGRATE of the key, then (when finish) SETSLOT NODE everywhere. */
static void node_id(int node, char *id, size_t len)
{
    assert_int_equal(rt_cli(&cluster, node, id, len, "CLUSTER MYID"), 0);
}

static void test_slot_migration(void **state)
{
    (void)state;
    NEED_CLUSTER();
    uint64_t salt = test_salt();
    persist_in_child(salt, 40000, 55);
    kvh_config c = remote_cfg(salt);
    kvh_engine *e = tu_open_cfg(&c); /* its slot map is now stale-to-be */
    char key[KVHI_REMOTE_KEY_BYTES], out[256], src_id[64], dst_id[64];
    key_of(e, 40000, 0, key);
    unsigned slot = kvhi_cluster_key_slot(key, strlen(key));
    int src = -1;
    for (int i = 0; i < cluster.n && src < 0; i++) {
        /* Only the owner answers without redirecting: ask without -c. */
        char cmd[400];
        snprintf(cmd, sizeof(cmd), "redis-cli -p %d -a %s --no-auth-warning CLUSTER GETKEYSINSLOT %u 1 | grep -q .",
                 cluster.ports[i], PASSWORD, slot);
        if (system(cmd) == 0)
            src = i;
    }
    assert_true(src >= 0);
    int dst = (src + 1) % cluster.n;
    node_id(src, src_id, sizeof(src_id));
    node_id(dst, dst_id, sizeof(dst_id));
    assert_int_equal(rt_cli(&cluster, dst, out, sizeof(out), "CLUSTER SETSLOT %u IMPORTING %s", slot, src_id), 0);
    assert_int_equal(rt_cli(&cluster, src, out, sizeof(out), "CLUSTER SETSLOT %u MIGRATING %s", slot, dst_id), 0);
    char cmd[600];
    snprintf(cmd, sizeof(cmd),
             "redis-cli -p %d -a %s --no-auth-warning MIGRATE 127.0.0.1 %d \"\" 0 5000 AUTH %s KEYS %s | grep -q OK",
             cluster.ports[src], PASSWORD, cluster.ports[dst], PASSWORD, key);
    assert_int_equal(system(cmd), 0);
    /* Mid-migration: the source answers ASK for the key it gave away. */
    kvh_seq s;
    assert_int_equal(match(e, &s, 40000), N_BLOCKS * BT);
    assert_true(tu_check_pattern(e, s, LAYERS, TOK_BYTES, 55, 0, N_BLOCKS * BT));
    /* Finish the migration as Redis documents it: the slot's other keys
     * move too (keys carry no hash tag, so another block of this prefix
     * shares the slot in ~0.2% of runs, other tests' keys more often). A
     * node told that a slot it still holds keys of is another's refuses,
     * and deletes those keys once the new owner's epoch reaches it. */
    for (int tries = 0; tries < 100; tries++) {
        assert_int_equal(rt_cli(&cluster, src, out, sizeof(out), "CLUSTER COUNTKEYSINSLOT %u", slot), 0);
        if (!strcmp(out, "0"))
            break;
        snprintf(cmd, sizeof(cmd),
                 "redis-cli -p %d -a %s --no-auth-warning CLUSTER GETKEYSINSLOT %u 100 | xargs -r redis-cli -p %d -a "
                 "%s --no-auth-warning MIGRATE 127.0.0.1 %d \"\" 0 5000 AUTH %s KEYS | grep -q OK",
                 cluster.ports[src], PASSWORD, slot, cluster.ports[src], PASSWORD, cluster.ports[dst], PASSWORD);
        assert_int_equal(system(cmd), 0);
    }
    assert_string_equal(out, "0");
    /* The new owner first, then the old one, then the rest. redis-cli
     * exits 0 on an error reply: the reply itself is checked. */
    int order[RT_MAX_NODES], n_order = 0;
    order[n_order++] = dst;
    order[n_order++] = src;
    for (int i = 0; i < cluster.n; i++)
        if (i != src && i != dst)
            order[n_order++] = i;
    for (int j = 0; j < n_order; j++) {
        assert_int_equal(rt_cli(&cluster, order[j], out, sizeof(out), "CLUSTER SETSLOT %u NODE %s", slot, dst_id), 0);
        assert_string_equal(out, "OK");
    }
    /* Done: the source answers MOVED; a fresh engine reads through it. */
    kvh_engine *e2 = tu_open_cfg(&c);
    kvh_seq s2;
    assert_int_equal(match(e2, &s2, 40000), N_BLOCKS * BT);
    assert_true(tu_check_pattern(e2, s2, LAYERS, TOK_BYTES, 55, 0, N_BLOCKS * BT));
    /* The engine that opened before the move still maps the slot to the
     * source: it is redirected (MOVED) and learns the new owner. */
    kvhi_cluster_cmd ex = {.argc = 2, .argv = {"EXISTS", key}, .argvlen = {6, strlen(key)}};
    kvhi_cluster_report rep;
    long long n = 0;
    kvhi_cluster_run(e->remote->cluster, &ex, 1, &rep);
    assert_int_equal(kvhi_cluster_reply(&ex, NULL, NULL, &n), KVHI_REPLY_INTEGER);
    assert_int_equal(n, 1);
    assert_int_equal(rep.redirects, 1);
    kvhi_cluster_cmds_clear(e->remote->cluster, &ex, 1);
    kvhi_cluster_run(e->remote->cluster, &ex, 1, &rep);
    assert_int_equal(rep.redirects, 0);
    kvhi_cluster_cmds_clear(e->remote->cluster, &ex, 1);
}

static void test_open_errors(void **state)
{
    (void)state;
    NEED_CLUSTER();
    kvh_config c = remote_cfg(test_salt());
    kvh_engine *e = NULL;
    c.remote_password = "wrong";
    assert_kvh(KVH_ERR_IO, kvh_engine_open(&c, &e));
    assert_non_null(strstr(kvh_last_error(), "AUTH"));
    assert_null(e);
    c.remote_password = NULL;
    assert_kvh(KVH_ERR_IO, kvh_engine_open(&c, &e));
    c = remote_cfg(test_salt());
    c.remote_tls = 1;
    assert_kvh(KVH_ERR_UNSUPPORTED, kvh_engine_open(&c, &e));
    assert_non_null(strstr(kvh_last_error(), "TLS"));
    c = remote_cfg(test_salt());
    c.remote_addrs = "no-port-here";
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(&c, &e));
    c.remote_addrs = "127.0.0.1:99999";
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(&c, &e));
    /* A port is digits alone: no sign, no blank before it. */
    c.remote_addrs = "127.0.0.1:+6379";
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(&c, &e));
    c.remote_addrs = "127.0.0.1: 6379";
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(&c, &e));
    /* The entry is quoted whole, not cut at the blank. */
    assert_non_null(strstr(kvh_last_error(), "'127.0.0.1: 6379'"));
    /* Two addresses need a comma between them; blanks around one are fine. */
    c.remote_addrs = "127.0.0.1:6379 127.0.0.1:6380";
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(&c, &e));
    assert_non_null(strstr(kvh_last_error(), "'127.0.0.1:6379 127.0.0.1:6380'"));
    char spaced[512];
    snprintf(spaced, sizeof(spaced), " \t%s , ", rt_addrs(&cluster));
    c.remote_addrs = spaced;
    assert_kvh(KVH_OK, kvh_engine_open(&c, &e));
    assert_ok(kvh_engine_close(e));
    e = NULL;
    c = remote_cfg(test_salt());
    c.remote_timeout_ms = 0;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(&c, &e));
    c = remote_cfg(test_salt());
    c.remote_upload = 0x80;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_engine_open(&c, &e));
    /* A user the servers will not tell where slots live (no
     * cluster|slots) could reach nothing: refused at open, saying why. */
    char out[256];
    for (int i = 0; i < cluster.n; i++) {
        assert_int_equal(rt_cli(&cluster, i, out, sizeof(out),
                                "ACL SETUSER kvhnoslots on '>pw' '~kvh:*' +get +getex +set +exists +del +ping"),
                         0);
        assert_string_equal(out, "OK");
    }
    c = remote_cfg(test_salt());
    c.remote_user = "kvhnoslots";
    c.remote_password = "pw";
    assert_kvh(KVH_ERR_IO, kvh_engine_open(&c, &e));
    assert_non_null(strstr(kvh_last_error(), "CLUSTER SLOTS"));
    assert_null(e);
    for (int i = 0; i < cluster.n; i++)
        assert_int_equal(rt_cli(&cluster, i, out, sizeof(out), "ACL DELUSER kvhnoslots"), 0);
    /* Nobody listening: not an error at open, misses after. */
    c = remote_cfg(test_salt());
    c.remote_addrs = "127.0.0.1:1";
    e = tu_open_cfg(&c);
    kvh_seq s;
    assert_int_equal(match(e, &s, 1), 0);
    assert_true(tu_stats(e).remote_misses >= 1);
}

/* With only a remote tier, a persist of a sequence whose full blocks'
 * K/V was not all written is refused, as with a disk tier (kvh.h:
 * KVH_ERR_INVALID_ARG), and uploads nothing. */
static void test_persist_refuses_unwritten_kv_without_a_disk(void **state)
{
    (void)state;
    NEED_CLUSTER();
    kvh_config c = remote_cfg(test_salt());
    kvh_engine *e = tu_open_cfg(&c);
    kvh_seq s = tu_seq_new(e, 0);
    int32_t t[4 * BT];
    prefix_tokens(t, 4 * BT, 52000);
    assert_ok(kvh_seq_append(e, s, t, 4 * BT));
    tu_write_pattern(e, s, LAYERS, TOK_BYTES, 91, 0, 2 * BT);
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_seq_persist(e, s));
    assert_non_null(strstr(kvh_last_error(), "never written"));
    assert_int_equal(tu_stats(e).remote_uploads, 0);
    tu_write_pattern(e, s, LAYERS, TOK_BYTES, 91, 2 * BT, 2 * BT);
    assert_ok(kvh_seq_persist(e, s));
    assert_int_equal(tu_stats(e).remote_uploads, 4);
}

/* A key of another type in a chain (a list another client pushed): a
 * miss counted as corrupt and deleted, so the next persist heals the
 * chain (it stopped every match there for good before). */
static void test_key_of_another_type_is_deleted(void **state)
{
    (void)state;
    NEED_CLUSTER();
    uint64_t salt = test_salt();
    persist_in_child(salt, 6000, 13);
    kvh_config c = remote_cfg(salt);
    kvh_engine *e = tu_open_cfg(&c);
    char key[KVHI_REMOTE_KEY_BYTES], out[256];
    key_of(e, 6000, 3, key);
    assert_int_equal(rt_cli(&cluster, 0, out, sizeof(out), "DEL %s", key), 0);
    assert_int_equal(rt_cli(&cluster, 0, out, sizeof(out), "RPUSH %s x", key), 0);
    kvh_seq s;
    assert_int_equal(match(e, &s, 6000), 3 * BT);
    assert_int_equal(tu_stats(e).remote_corrupt, 1);
    assert_int_equal(rt_cli(&cluster, 0, out, sizeof(out), "EXISTS %s", key), 0);
    assert_string_equal(out, "0");
    persist_in_child(salt, 6000, 13);
    kvh_engine *e2 = tu_open_cfg(&c);
    kvh_seq s2;
    assert_int_equal(match(e2, &s2, 6000), N_BLOCKS * BT);
    assert_true(tu_check_pattern(e2, s2, LAYERS, TOK_BYTES, 13, 0, N_BLOCKS * BT));
}

static char last_warning[512];

static void keep_warning(void *user, int32_t level, const char *message)
{
    (void)user;
    if (level == KVH_LOG_WARN && strstr(message, "failed verification"))
        snprintf(last_warning, sizeof(last_warning), "%s", message);
}

/* A user the store refuses DEL: a value that fails verification is a
 * miss, and the log says the delete failed instead of "deleted". */
static void test_refused_delete_is_said(void **state)
{
    (void)state;
    NEED_CLUSTER();
    uint64_t salt = test_salt();
    persist_in_child(salt, 7000, 14);
    char out[256];
    for (int i = 0; i < cluster.n; i++)
        assert_int_equal(rt_cli(&cluster, i, out, sizeof(out),
                                "ACL SETUSER kvhnodel on '>pw' '~kvh:*' +get +getex +set +exists +ping "
                                "'+cluster|slots'"),
                         0);
    kvh_config c = remote_cfg(salt);
    c.remote_user = "kvhnodel";
    c.remote_password = "pw";
    c.log_fn = keep_warning;
    last_warning[0] = '\0';
    kvh_engine *e = tu_open_cfg(&c);
    char key[KVHI_REMOTE_KEY_BYTES];
    key_of(e, 7000, 2, key);
    assert_int_equal(rt_cli(&cluster, 0, out, sizeof(out), "SET %s garbage", key), 0);
    kvh_seq s;
    assert_int_equal(match(e, &s, 7000), 2 * BT);
    assert_int_equal(tu_stats(e).remote_corrupt, 1);
    assert_non_null(strstr(last_warning, "deleting it failed"));
    assert_int_equal(rt_cli(&cluster, 0, out, sizeof(out), "EXISTS %s", key), 0);
    assert_string_equal(out, "1"); /* refused: still there */
    for (int i = 0; i < cluster.n; i++)
        assert_int_equal(rt_cli(&cluster, i, out, sizeof(out), "ACL DELUSER kvhnodel"), 0);
}

static pthread_mutex_t remote_lines_lock = PTHREAD_MUTEX_INITIALIZER;
static char remote_lines[8][512];
static int n_remote_lines;

static void keep_remote_lines(void *user, int32_t level, const char *message)
{
    (void)user;
    (void)level;
    pthread_mutex_lock(&remote_lines_lock);
    if (strstr(message, "remote tier") && n_remote_lines < 8)
        snprintf(remote_lines[n_remote_lines++], sizeof(remote_lines[0]), "%s", message);
    pthread_mutex_unlock(&remote_lines_lock);
}

static bool printable(const char *text)
{
    for (const unsigned char *p = (const unsigned char *)text; *p; p++)
        if (*p < 0x20 || *p > 0x7e)
            return false;
    return true;
}

static int count_keys(void *user, const char *key, size_t len)
{
    (void)key;
    (void)len;
    ++*(size_t *)user;
    return 0;
}

/* A node that stops answering (SIGSTOP) is reported with the reason: the
 * open's log line for the seed whose AUTH timed out, and a scan's error
 * for the node whose connect (AUTH) timed out. */
static void test_timeouts_say_why(void **state)
{
    (void)state;
    NEED_CLUSTER();
    kvh_config c = remote_cfg(test_salt());
    c.remote_timeout_ms = 200;
    c.log_fn = keep_remote_lines;
    n_remote_lines = 0;
    kill(cluster.pids[0], SIGSTOP); /* the first seed */
    tu_open_cfg(&c);
    kvhi_cluster_opts o = {
        .addrs = rt_addrs(&cluster), .password = PASSWORD, .timeout_ms = 200, .breaker_ms = c.remote_breaker_ms};
    kvhi_cluster *cl = NULL;
    char err[256] = "";
    int open_rc = kvhi_cluster_open(&o, &cl, err, sizeof(err));
    size_t keys = 0;
    int scan_rc = open_rc == 0 ? kvhi_cluster_scan(cl, "kvh:", count_keys, &keys, err, sizeof(err)) : 0;
    kvhi_cluster_close(cl);
    kill(cluster.pids[0], SIGCONT);

    char node0[32];
    snprintf(node0, sizeof(node0), ":%d ", cluster.ports[0]);
    pthread_mutex_lock(&remote_lines_lock);
    int found = -1;
    for (int i = 0; i < n_remote_lines; i++) {
        assert_true(printable(remote_lines[i]));
        if (strstr(remote_lines[i], node0))
            found = i;
    }
    assert_true(found >= 0);
    assert_non_null(strstr(remote_lines[found], "timed out after"));
    pthread_mutex_unlock(&remote_lines_lock);
    assert_int_equal(open_rc, 0);
    assert_int_equal(scan_rc, -1);
    assert_true(printable(err));
    snprintf(node0, sizeof(node0), ":%d:", cluster.ports[0]);
    assert_non_null(strstr(err, node0));
    assert_non_null(strstr(err, "timed out after"));
    assert_int_equal(rt_wait_ok(&cluster, 20000), 0);
}

int main(int argc, char **argv)
{
    if (argc == 6 && !strcmp(argv[1], "--persist")) {
        snprintf(cluster.addrs, sizeof(cluster.addrs), "%s", argv[2]);
        kvh_config c = remote_cfg(strtoull(argv[3], NULL, 10));
        return persist_prefix(&c, (int32_t)atoi(argv[4]), strtoull(argv[5], NULL, 10));
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_shared_across_processes, tu_teardown),
        cmocka_unit_test_teardown(test_blocks_persist_uploads, tu_teardown),
        cmocka_unit_test_teardown(test_match_past_the_memory_tiers, tu_teardown),
        cmocka_unit_test_teardown(test_tampered_value_is_deleted, tu_teardown),
        cmocka_unit_test_teardown(test_codec_into_either_tier, tu_teardown),
        cmocka_unit_test_teardown(test_write_through, tu_teardown),
        cmocka_unit_test_teardown(test_blocks_awaiting_upload_leave_first, tu_teardown),
        cmocka_unit_test_teardown(test_stalled_store_leaves_room, tu_teardown),
        cmocka_unit_test_teardown(test_demote_uploads, tu_teardown),
        cmocka_unit_test_teardown(test_background_uploads_dropped, tu_teardown),
        cmocka_unit_test_teardown(test_slot_migration, tu_teardown),
        cmocka_unit_test_teardown(test_node_killed_and_back, tu_teardown),
        cmocka_unit_test_teardown(test_slow_node_times_out, tu_teardown),
        cmocka_unit_test_teardown(test_full_server_is_a_cache, tu_teardown),
        cmocka_unit_test_teardown(test_open_errors, tu_teardown),
        cmocka_unit_test_teardown(test_persist_refuses_unwritten_kv_without_a_disk, tu_teardown),
        cmocka_unit_test_teardown(test_key_of_another_type_is_deleted, tu_teardown),
        cmocka_unit_test_teardown(test_refused_delete_is_said, tu_teardown),
        cmocka_unit_test_teardown(test_timeouts_say_why, tu_teardown),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
