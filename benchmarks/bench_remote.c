/* Scenario `remote`: the remote tier against a Redis server started on a
 * free loopback port for the run (tests/c/remote_test_util.c).
 *
 *   put, get   value MB/s of kvh_seq_persist (upload: an EXISTS round, the
 *              copy out, SET NX EX) and of kvh_seq_match_prefix on an
 *              empty engine (EXISTS, GETEX, verification, copy into the
 *              host tier) for --blocks blocks of 64 KiB, 256 KiB and 1 MiB,
 *              against raw hiredis SET and GET of the same number of values
 *              of the same size, pipelined the same way (one round of all
 *              commands) on one connection, in the same run. Target: ratio
 *              >= 0.8.
 *   lookup     a --prefix-token prefix (16-token blocks of 4 KiB): rounds
 *              (computed from the batch sizes) and ms for a full hit and
 *              for a miss at the first block.
 *   reuse      node B's time to the first reusable token of that prefix
 *              (match, then read of the first block's KV), against the time
 *              node A took to write the same KV into its engine (a floor
 *              for recomputing it: no model runs here). Reported only.
 * Medians of --reps rounds (ratios: the median of each round's kvh / raw);
 * each round uses fresh keys (a new model salt). */
#include <stdio.h>
#include <stdlib.h>
#include <errno.h>
#include <string.h>
#include <unistd.h>

#include "bench_fs.h"
#include "bench_scenarios.h"
#include "core/remote_hiredis.h"
#include "remote_test_util.h"

#define SCEN "remote"

static rt_cluster server;
static uint64_t salt_seq;

static kvh_config remote_cfg(uint32_t layers, uint32_t heads, uint32_t dim, uint64_t host_bytes, uint64_t salt)
{
    kvh_config c;
    kvh_config_init(&c, sizeof(c));
    c.num_layers = layers;
    c.num_kv_heads = heads;
    c.head_dim = dim;
    c.block_tokens = 16;
    c.dtype = KVH_DTYPE_F16;
    c.backend = KVH_BACKEND_CPU;
    c.device_bytes = 16ull << 20;
    c.host_bytes = host_bytes;
    c.migration_threads = 1;
    c.model_salt = salt;
    c.remote_addrs = rt_addrs(&server);
    c.remote_timeout_ms = 30000; /* throughput, not deadlines, is measured */
    return c;
}

/* Engine A: a sequence of n blocks with every KV cell written. */
static int fill(kvh_engine *e, kvh_seq *s, uint64_t scope, size_t n_blocks, uint32_t layers, size_t tok_bytes,
                double *write_s)
{
    size_t n = n_blocks * 16;
    int32_t *tokens = bench_xmalloc(sizeof(int32_t) * n);
    uint8_t *kv = bench_xmalloc(tok_bytes * n);
    for (size_t i = 0; i < n; i++)
        tokens[i] = (int32_t)(i * 7 + 3);
    for (size_t i = 0; i < tok_bytes * n; i++)
        kv[i] = (uint8_t)(i * 31 + 1);
    BENCH_CHECK(kvh_seq_create(e, 0, s));
    BENCH_CHECK(kvh_seq_set_scope(e, *s, scope, 0, 0));
    BENCH_CHECK(kvh_seq_append(e, *s, tokens, n));
    double t0 = bench_sec();
    for (uint32_t l = 0; l < layers; l++)
        BENCH_CHECK(kvh_seq_write_kv(e, *s, l, 0, n, kv, kv));
    if (write_s)
        *write_s = bench_sec() - t0;
    free(tokens);
    free(kv);
    return 0;
}

static int match(kvh_engine *e, uint64_t scope, size_t n_blocks, size_t *matched, kvh_seq *out)
{
    size_t n = n_blocks * 16;
    int32_t *tokens = bench_xmalloc(sizeof(int32_t) * n);
    for (size_t i = 0; i < n; i++)
        tokens[i] = (int32_t)(i * 7 + 3);
    BENCH_CHECK(kvh_seq_create(e, 0, out));
    BENCH_CHECK(kvh_seq_set_scope(e, *out, scope, 0, 0));
    BENCH_CHECK(kvh_seq_match_prefix(e, *out, tokens, n, matched));
    free(tokens);
    return 0;
}

/* Raw hiredis: n SETs (or GETs) of value_bytes values, all appended, then
 * all replies read: one round, as the tier sends them, written out every
 * 4 MiB as the tier does (hiredis's output buffer grows by copying).
 * Seconds. */
static double raw_round(const kvhi_hiredis *h, redisContext *c, int set, size_t n, const uint8_t *val,
                        size_t value_bytes, uint64_t tag)
{
    char key[64];
    double t0 = bench_sec();
    size_t unsent = 0;
    for (size_t i = 0; i < n; i++) {
        int len = snprintf(key, sizeof(key), "raw:%016llx:%zu", (unsigned long long)tag, i);
        const char *argv[3] = {set ? "SET" : "GET", key, (const char *)val};
        size_t lens[3] = {3, (size_t)len, value_bytes};
        h->append_argv(c, set ? 3 : 2, argv, lens);
        unsent += 3 + (size_t)len + (set ? value_bytes : 0);
        if (unsent >= (4u << 20)) {
            int done = 0;
            while (!done)
                if (h->buffer_write(c, &done) != REDIS_OK)
                    return -1;
            unsent = 0;
        }
    }
    for (size_t i = 0; i < n; i++) {
        void *r = NULL;
        if (h->get_reply(c, &r) != REDIS_OK || !r)
            return -1;
        h->free_reply(r);
    }
    return bench_sec() - t0;
}

static int throughput(const bench_ctx *ctx, uint32_t layers, size_t n_blocks, int reps)
{
    const uint32_t heads = 8, dim = 128;
    size_t tok_bytes = (size_t)heads * dim * 2;
    uint64_t block = (uint64_t)layers * 2 * 16 * tok_bytes;
    uint64_t value = block + 4096;
    const char *why = NULL;
    const kvhi_hiredis *h = kvhi_hiredis_get(&why);
    if (!h) {
        fprintf(stderr, "kvh-bench remote: %s\n", why);
        return 1;
    }
    struct timeval tv = {30, 0};
    redisContext *rc = h->connect_timeout("127.0.0.1", server.ports[0], tv);
    uint8_t *val = bench_xmalloc(value);
    double *t = bench_xmalloc(sizeof(double) * (size_t)reps * 6);
    if (!rc || rc->err) {
        fprintf(stderr, "kvh-bench remote: cannot connect to redis-server on 127.0.0.1:%d: %s\n", server.ports[0],
                rc ? rc->errstr : "out of memory");
        return 1;
    }
    memset(val, 0x5a, value);
    double *tput = t, *tget = t + reps, *rput = t + 2 * reps, *rget = t + 3 * reps;
    double *qput = t + 4 * reps, *qget = t + 5 * reps; /* each round's kvh / raw */
    /* Long-lived engines, as on a serving node: each round has fresh keys
     * through a tenant scope of its own, and room for two rounds. */
    uint64_t salt = 0xbe00000000000000ull ^ ((uint64_t)getpid() << 20) ^ ++salt_seq;
    kvh_config c = remote_cfg(layers, heads, dim, (2 * n_blocks + 8) * block, salt);
    kvh_engine *a, *b;
    BENCH_CHECK(kvh_engine_open(&c, &a));
    BENCH_CHECK(kvh_engine_open(&c, &b));
    for (int k = -2; k < reps; k++) { /* rounds -2, -1 warm up (and touch both tiers' memory) */
        uint64_t scope = salt_seq * 1000 + (uint64_t)(k + 3);
        kvh_seq s, s2;
        size_t m = 0;
        kvh_stats before = {.struct_size = sizeof(before)}, st = {.struct_size = sizeof(st)};
        kvh_engine_stats(a, &before);
        if (fill(a, &s, scope, n_blocks, layers, tok_bytes, NULL))
            return 1;
        /* kvh and raw back to back, which first alternating by round. */
        bool raw_first = k % 2 != 0;
        double raw_put = raw_first ? raw_round(h, rc, 1, n_blocks, val, value, salt ^ scope) : 0;
        double t0 = bench_sec();
        BENCH_CHECK(kvh_seq_persist(a, s));
        double put_s = bench_sec() - t0;
        if (!raw_first)
            raw_put = raw_round(h, rc, 1, n_blocks, val, value, salt ^ scope);
        kvh_engine_stats(a, &st);
        double raw_get = raw_first ? raw_round(h, rc, 0, n_blocks, val, value, salt ^ scope) : 0;
        t0 = bench_sec();
        if (match(b, scope, n_blocks, &m, &s2))
            return 1;
        double get_s = bench_sec() - t0;
        if (!raw_first)
            raw_get = raw_round(h, rc, 0, n_blocks, val, value, salt ^ scope);
        kvh_seq_free(a, s);
        kvh_seq_free(b, s2);
        if (st.remote_uploads - before.remote_uploads != n_blocks || m != n_blocks * 16) {
            fprintf(stderr, "kvh-bench remote: %llu of %zu blocks uploaded, %zu tokens matched\n",
                    (unsigned long long)(st.remote_uploads - before.remote_uploads), n_blocks, m);
            return 1;
        }
        if (raw_put < 0 || raw_get < 0)
            return 1;
        if (k >= 0) {
            double mb = (double)(n_blocks * value) / 1e6;
            tput[k] = mb / put_s;
            tget[k] = mb / get_s;
            rput[k] = mb / raw_put;
            rget[k] = mb / raw_get;
            qput[k] = raw_put / put_s;
            qget[k] = raw_get / get_s;
        }
        char flush[64];
        rt_cli(&server, 0, flush, sizeof(flush), "FLUSHALL");
    }
    kvh_engine_close(a);
    kvh_engine_close(b);
    for (int dir = 0; dir < 2; dir++) {
        double v = bench_median(dir ? tget : tput, (size_t)reps), base = bench_median(dir ? rget : rput, (size_t)reps);
        bench_row *row = bench_row_new(SCEN, dir ? "get" : "put", v, "MB/s");
        bench_row_int(row, "block_bytes", (int64_t)block);
        bench_row_int(row, "blocks", (int64_t)n_blocks);
        /* The ratio is the median of each round's kvh / raw, which ran
         * back to back: on a shared machine the load moves between rounds
         * more than within one. */
        bench_row_baseline(row, base, bench_median(dir ? qget : qput, (size_t)reps));
        bench_row_target(row, 1, 1, 0.8);
        bench_row_note(row, dir ? "match_prefix on an empty engine (verified, copied in) vs raw pipelined GET"
                                : "persist (EXISTS round + SET NX EX) vs raw pipelined SET");
        bench_emit(ctx, row);
    }
    h->free_ctx(rc);
    free(val);
    free(t);
    return 0;
}

static int lookup(const bench_ctx *ctx, size_t prefix_tokens, int reps)
{
    const uint32_t layers = 1, heads = 1, dim = 64; /* 4 KiB blocks */
    size_t n_blocks = prefix_tokens / 16, tok_bytes = (size_t)heads * dim * 2;
    uint64_t block = (uint64_t)layers * 2 * 16 * tok_bytes;
    double *t = bench_xmalloc(sizeof(double) * (size_t)reps * 4);
    double *hit = t, *miss = t + reps, *reuse = t + 2 * reps, *write = t + 3 * reps;
    for (int k = -1; k < reps; k++) {
        uint64_t salt = 0xb100000000000000ull ^ ((uint64_t)getpid() << 20) ^ ++salt_seq;
        kvh_config c = remote_cfg(layers, heads, dim, (n_blocks + 8) * block, salt);
        kvh_engine *a, *b;
        kvh_seq s, s2, s3;
        size_t m = 0;
        double write_s = 0;
        BENCH_CHECK(kvh_engine_open(&c, &a));
        if (fill(a, &s, 0, n_blocks, layers, tok_bytes, &write_s))
            return 1;
        BENCH_CHECK(kvh_seq_persist(a, s));
        kvh_engine_close(a);
        BENCH_CHECK(kvh_engine_open(&c, &b));
        uint8_t kbuf[2048], vbuf[2048];
        double t0 = bench_sec();
        if (match(b, 0, n_blocks, &m, &s2))
            return 1;
        double hit_s = bench_sec() - t0;
        BENCH_CHECK(kvh_seq_read_kv(b, s2, 0, 0, 16, kbuf, vbuf));
        double reuse_s = bench_sec() - t0;
        kvh_engine_close(b);
        c.model_salt ^= 1; /* nothing stored under it */
        BENCH_CHECK(kvh_engine_open(&c, &b));
        t0 = bench_sec();
        size_t m3 = 0;
        if (match(b, 0, n_blocks, &m3, &s3))
            return 1;
        double miss_s = bench_sec() - t0;
        kvh_engine_close(b);
        if (m != n_blocks * 16 || m3 != 0) {
            fprintf(stderr,
                    "kvh-bench remote: matched %zu of %zu tokens from the remote tier, %zu under another salt\n", m,
                    n_blocks * 16, m3);
            return 1;
        }
        if (k >= 0) {
            hit[k] = hit_s * 1e3;
            miss[k] = miss_s * 1e3;
            reuse[k] = reuse_s * 1e3;
            write[k] = write_s * 1e3;
        }
        char flush[64];
        rt_cli(&server, 0, flush, sizeof(flush), "FLUSHALL");
    }
    uint64_t value = block + 4096, round_bytes = 64ull << 20;
    uint64_t per = round_bytes / value;
    int64_t rounds = 1 + (int64_t)((n_blocks + per - 1) / per);
    bench_row *row = bench_row_new(SCEN, "lookup_hit", bench_median(hit, (size_t)reps), "ms");
    bench_row_int(row, "prefix_tokens", (int64_t)prefix_tokens);
    bench_row_int(row, "rounds", rounds);
    bench_row_note(row, "full hit: one EXISTS round, then GETEX rounds of <= 64 MiB; verified, copied in");
    bench_emit(ctx, row);
    row = bench_row_new(SCEN, "lookup_miss", bench_median(miss, (size_t)reps), "ms");
    bench_row_int(row, "prefix_tokens", (int64_t)prefix_tokens);
    bench_row_int(row, "rounds", 1);
    bench_row_note(row, "nothing stored: the EXISTS round only");
    bench_emit(ctx, row);
    double w = bench_median(write, (size_t)reps), r = bench_median(reuse, (size_t)reps);
    row = bench_row_new(SCEN, "first_reuse", r, "ms");
    bench_row_int(row, "prefix_tokens", (int64_t)prefix_tokens);
    bench_row_baseline(row, w, w / r); /* a time: baseline / ours, so that higher is better */
    bench_row_note(row, "node B: match + first block's KV; baseline: node A writing that KV (not a model's "
                        "prefill: a floor for recomputing); ratio: baseline / ours");
    bench_emit(ctx, row);
    free(t);
    return 0;
}

int bench_remote(int argc, char **argv, const bench_ctx *ctx)
{
    uint64_t mib = ctx->quick ? 4 : 32, prefix = 32768;
    const bench_opt opts[] = {
        {"--mib", BENCH_OPT_U64, &mib, "value MiB moved per round and block size (--quick 4)"},
        {"--prefix-tokens", BENCH_OPT_U64, &prefix, "tokens of the lookup prefix"},
        {NULL, BENCH_OPT_U64, NULL, NULL},
    };
    int prc = bench_parse(argc, argv, opts, SCEN, "kvh-bench remote [--mib N] [--prefix-tokens N]");
    if (prc)
        return bench_parse_rc(prc);
    if (mib < 1 || mib > 1024 || prefix < 16 || prefix > (1u << 20)) {
        fprintf(stderr, "kvh-bench remote: --mib must be in 1..1024, --prefix-tokens in 16..1M\n");
        return 2;
    }
    if (!rt_available()) {
        fprintf(stderr, "kvh-bench remote: redis-server and redis-cli are needed (scripts/install-deps.sh)\n");
        return 1;
    }
    /* A name no other user can have taken first (rt_start makes it anew);
     * the server dies with us. */
    char dir[256], why[300];
    int scratch = bench_scratch_dir_make("/tmp", "kvh-bench-remote", dir, sizeof(dir), why, sizeof(why));
    if (scratch < -1) {
        fprintf(stderr, "kvh-bench remote: %s\n", why);
        return 1;
    }
    if (rt_start(&server, 1, NULL, dir) != 0) {
        fprintf(stderr, "kvh-bench remote: could not start redis-server on loopback (scratch directory %s)\n", dir);
        bench_scratch_dir_remove(dir, scratch);
        return 1;
    }
    /* Room for the values; no persistence: a cache. */
    char out[128];
    rt_cli(&server, 0, out, sizeof(out), "CONFIG SET appendonly no");
    int reps = ctx->reps ? ctx->reps : ctx->quick ? 2 : 7;
    int rc = 0;
    static const uint32_t layers[] = {1, 4, 16}; /* 64 KiB, 256 KiB, 1 MiB blocks */
    for (int i = 0; i < 3 && !rc; i++) {
        size_t n = (size_t)(mib << 20) / ((size_t)layers[i] << 16);
        rc = throughput(ctx, layers[i], n ? n : 1, reps);
    }
    if (!rc)
        rc = lookup(ctx, ctx->quick ? 4096 : (size_t)prefix, reps);
    rt_stop(&server);
    if (bench_scratch_dir_remove(dir, scratch) != 0)
        fprintf(stderr, "kvh-bench remote: could not remove %s\n", dir);
    bench_flush_table(ctx, "Remote tier (one loopback Redis server)");
    return rc;
}
