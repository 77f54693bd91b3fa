/* Scenario `scale`: how costs grow.
 *
 *  (a) Cost per operation as the number of live blocks N grows (--blocks,
 *      default 10^3..10^6; 10^7 with --blocks 1000,...,10000000). One
 *      engine per N (CPU backend, migration_threads 0, 1-token blocks of
 *      32 bytes so that memory is not the cost), holding one sequence of N
 *      blocks in the device tier, then:
 *        alloc        kvh_block_alloc + kvh_block_release, per pair
 *        lookup       kvh_block_info_get of a random live block handle
 *        touch        kvh_seq_read_kv of a random token (block-table
 *                     lookup + LRU-K history; the eviction heap is
 *                     re-keyed lazily, at the next victim choice)
 *        prefix_match kvh_seq_match_prefix of a cached 64-block prompt
 *                     among N cached blocks, per matched block
 *        evict        kvh_seq_acquire + release of a random block of a
 *                     second N-block sequence living in the host tier, with
 *                     the device tier full: each call chooses a victim and
 *                     swaps two 32-byte blocks
 *        hint         kvh_seq_hint of a random block, at a rising priority
 *        set_quota    kvh_agent_set_quota of the sequences' agent, moved
 *                     between two values above its use (after a first
 *                     quota, untimed)
 *      The baseline of each row is a logarithmic reference: the cost at
 *      the smallest N times log2(N) / log2(smallest N); ratio = reference /
 *      cost (1 = exactly logarithmic growth, > 1 flatter). Target: ratio
 *      >= 0.5 (at most twice a logarithmic curve) for the operations issue
 *      8 names: alloc, lookup, prefix match, eviction choice, and for
 *      set_quota. touch and hint have none: each is a fixed number of
 *      dependent memory reads (block table, record, then data or heap
 *      entry), whose latency grows from L1 to DRAM with N whatever the
 *      code; memory_read shows by how much.
 *        memory_read  (no target) one dependent read of a random cache
 *                     line in a buffer the size of N block records (128
 *                     bytes each), on huge pages as the engine's: what one
 *                     cache miss into the block records costs at that N
 *  (b) Throughput as agents grow (--threads, default 1..64): each thread is
 *      an agent with its own 1024-token sequence, looping over: append a
 *      token and write its K/V, read one random token, acquire + release
 *      one random token, truncate back to 1024; a fixed total of --ops
 *      operations split over the threads, timed from a common start.
 *      Reported per wall-clock second (agent_ops) and per CPU-second the
 *      process got (agent_ops_per_cpu_s: on a shared machine more threads
 *      also win a larger share of the CPUs). Baseline: the first thread
 *      count's rate in the same run (ratio = speed-up; the engine
 *      serialises on one lock, so beyond the core count the per-CPU-second
 *      rate shows what contention costs). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "bench_scenarios.h"

#define SCEN "scale"
#define PROMPT_BLOCKS 64u

typedef struct scale_opts {
    bench_list blocks;
    bench_list threads;
    uint64_t ops;
    uint64_t calls;
} scale_opts;

static kvh_status open_engine(uint64_t device_blocks, uint64_t host_blocks, kvh_engine **e)
{
    kvh_config c;
    kvh_config_init(&c, sizeof(c));
    c.backend = KVH_BACKEND_CPU;
    c.num_layers = 1;
    c.num_kv_heads = 1;
    c.head_dim = 8;
    c.block_tokens = 1;
    c.migration_threads = 0;
    uint64_t bb = 2ull * 8 * 2; /* K and V of one token, 8 f16 each */
    c.device_bytes = device_blocks * bb;
    c.host_bytes = host_blocks * bb;
    return kvh_engine_open(&c, e);
}

static int fill(kvh_engine *e, kvh_seq s, uint64_t n, int32_t first_token)
{
    enum { CHUNK = 4096 };
    int32_t *tok = bench_xmalloc(CHUNK * sizeof(*tok));
    for (uint64_t done = 0; done < n;) {
        size_t k = n - done < CHUNK ? (size_t)(n - done) : CHUNK;
        for (size_t i = 0; i < k; i++)
            tok[i] = first_token + (int32_t)(done + i);
        kvh_status st = kvh_seq_append(e, s, tok, k);
        if (st != KVH_OK) {
            free(tok);
            return bench_kvh_fail("kvh_seq_append", st);
        }
        done += k;
    }
    free(tok);
    return 0;
}

/* Writes K/V into every token so blocks are published (prefix index). */
static int write_all(kvh_engine *e, kvh_seq s, uint64_t n)
{
    enum { CHUNK = 4096 };
    uint16_t *kv = bench_xcalloc(CHUNK * 8, sizeof(uint16_t));
    for (uint64_t done = 0; done < n;) {
        size_t k = n - done < CHUNK ? (size_t)(n - done) : CHUNK;
        kvh_status st = kvh_seq_write_kv(e, s, 0, done, k, kv, kv);
        if (st != KVH_OK) {
            free(kv);
            return bench_kvh_fail("kvh_seq_write_kv", st);
        }
        done += k;
    }
    free(kv);
    return 0;
}

#define N_OPS 7

typedef struct scale_point {
    double ns[N_OPS];
    double memory_read_ns;
} scale_point;

/* ns per dependent read of a random 64-byte line (a pointer chase through
 * one random cycle over every line) in an anonymous mapping of `bytes`,
 * 2 MiB-aligned and advised for huge pages; < 0 when out of memory. */
static double memory_read_ns(uint64_t bytes, uint64_t seed)
{
    const uint64_t huge = 2u << 20;
    uint64_t lines = bytes / 64;
    if (lines < 2)
        return -1;
    size_t map_bytes = (size_t)(lines * 64 + huge);
    uint8_t *raw = mmap(NULL, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    uint32_t *order = malloc(sizeof(uint32_t) * lines);
    if (raw == MAP_FAILED || !order) {
        if (raw != MAP_FAILED)
            munmap(raw, map_bytes);
        free(order);
        return -1;
    }
    uint8_t *buf = (uint8_t *)(((uintptr_t)raw + huge - 1) & ~(uintptr_t)(huge - 1));
#ifdef MADV_HUGEPAGE
    madvise(buf, lines * 64, MADV_HUGEPAGE);
#endif
    bench_rng rng;
    bench_rng_seed(&rng, seed);
    for (uint64_t i = 0; i < lines; i++)
        order[i] = (uint32_t)i;
    for (uint64_t i = lines - 1; i > 0; i--) {
        uint64_t j = bench_rng_below(&rng, i + 1);
        uint32_t t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    for (uint64_t i = 0; i < lines; i++)
        *(uint64_t *)(buf + (uint64_t)order[i] * 64) = (uint64_t)order[(i + 1) % lines] * 64;
    free(order);
    const uint64_t reads = 1000000;
    volatile uint64_t sink;
    uint64_t at = 0, t0 = bench_ns();
    for (uint64_t i = 0; i < reads; i++)
        at = *(const uint64_t *)(buf + at);
    double ns = (double)(bench_ns() - t0) / (double)reads;
    sink = at;
    (void)sink;
    munmap(raw, map_bytes);
    return ns;
}

static const char *const op_names[N_OPS] = {"alloc", "lookup", "touch", "prefix_match", "evict", "hint", "set_quota"};

static int measure_n(const bench_ctx *ctx, uint64_t n, uint64_t calls, scale_point *pt)
{
    kvh_engine *e = NULL;
    /* Device: the N-block sequence + room for the alloc pairs; host: the
     * second sequence. */
    BENCH_CHECK(open_engine(n + 8, n + 8, &e));
    kvh_seq s, cold, probe;
    BENCH_CHECK(kvh_seq_create(e, 0, &s));
    int rc = fill(e, s, n, 0) || write_all(e, s, n);
    if (rc)
        goto out;
    bench_rng rng;
    bench_rng_seed(&rng, ctx->seed ^ n);
    kvh_block *handles = bench_xmalloc(4096 * sizeof(*handles));
    for (int i = 0; i < 4096; i++)
        kvh_seq_blocks(e, s, bench_rng_below(&rng, n), 1, &handles[i]);

    /* alloc */
    uint64_t t0 = bench_ns();
    for (uint64_t i = 0; i < calls; i++) {
        kvh_block b;
        kvh_status st = kvh_block_alloc(e, 1, &b);
        if (st == KVH_OK)
            st = kvh_block_release(e, b);
        if (st != KVH_OK) {
            rc = bench_kvh_fail("kvh_block_alloc/release", st);
            goto out_h;
        }
    }
    pt->ns[0] = (double)(bench_ns() - t0) / (double)calls;

    /* lookup */
    kvh_block_info info = {.struct_size = sizeof(info)};
    t0 = bench_ns();
    for (uint64_t i = 0; i < calls; i++)
        if (kvh_block_info_get(e, handles[i & 4095], &info) != KVH_OK) {
            rc = bench_kvh_fail("kvh_block_info_get", KVH_ERR_INTERNAL);
            goto out_h;
        }
    pt->ns[1] = (double)(bench_ns() - t0) / (double)calls;

    /* touch */
    uint16_t k[8], v[8];
    t0 = bench_ns();
    for (uint64_t i = 0; i < calls; i++) {
        kvh_status st = kvh_seq_read_kv(e, s, 0, bench_rng_below(&rng, n), 1, k, v);
        if (st != KVH_OK) {
            rc = bench_kvh_fail("kvh_seq_read_kv", st);
            goto out_h;
        }
    }
    pt->ns[2] = (double)(bench_ns() - t0) / (double)calls;

    /* prefix match: a prompt equal to the first PROMPT_BLOCKS tokens */
    uint64_t pb = n < PROMPT_BLOCKS ? n : PROMPT_BLOCKS;
    int32_t prompt[PROMPT_BLOCKS];
    for (uint64_t i = 0; i < pb; i++)
        prompt[i] = (int32_t)i;
    uint64_t matches = calls / 64 + 1;
    double total = 0;
    for (uint64_t i = 0; i < matches; i++) {
        size_t matched = 0;
        BENCH_CHECK(kvh_seq_create(e, 0, &probe));
        uint64_t a = bench_ns();
        kvh_status st = kvh_seq_match_prefix(e, probe, prompt, pb, &matched);
        total += (double)(bench_ns() - a);
        kvh_seq_free(e, probe);
        if (st != KVH_OK || matched != pb) {
            fprintf(stderr, "kvh-bench scale: prefix match found %zu of %llu tokens\n", matched,
                    (unsigned long long)pb);
            rc = st != KVH_OK ? bench_kvh_fail("kvh_seq_match_prefix", st) : 1;
            goto out_h;
        }
    }
    pt->ns[3] = total / (double)(matches * pb);

    /* evict: a second sequence in the host tier (the device tier is full
     * up to the alloc room, which the first acquires take). */
    BENCH_CHECK(kvh_seq_create(e, 0, &cold));
    rc = fill(e, cold, n, (int32_t)(n + 1));
    if (rc)
        goto out_h;
    for (int i = 0; i < 64; i++) { /* fill the spare device slots first */
        kvh_seq_acquire(e, cold, (uint64_t)i % n, 1, NULL);
        kvh_seq_release(e, cold, (uint64_t)i % n, 1);
    }
    t0 = bench_ns();
    for (uint64_t i = 0; i < calls; i++) {
        uint64_t pos = bench_rng_below(&rng, n);
        kvh_status st = kvh_seq_acquire(e, i & 1 ? cold : s, pos, 1, NULL);
        if (st == KVH_OK)
            st = kvh_seq_release(e, i & 1 ? cold : s, pos, 1);
        if (st != KVH_OK) {
            rc = bench_kvh_fail("kvh_seq_acquire/release", st);
            goto out_h;
        }
    }
    pt->ns[4] = (double)(bench_ns() - t0) / (double)calls;

    /* hint: kvh_seq_hint of one random block, later calls at higher
     * priorities (a scheduler's queue moving on) */
    t0 = bench_ns();
    for (uint64_t i = 0; i < calls; i++) {
        uint64_t pos = bench_rng_below(&rng, n);
        kvh_status st = kvh_seq_hint(e, s, pos, 1, (int32_t)(i & 0x3fffffff));
        if (st != KVH_OK) {
            rc = bench_kvh_fail("kvh_seq_hint", st);
            goto out_h;
        }
    }
    pt->ns[5] = (double)(bench_ns() - t0) / (double)calls;

    /* set_quota: the quota of the sequences' agent moved between two
     * values above what it holds; the first quota (untimed) is the one
     * that indexes the agent's blocks. */
    uint64_t block_bytes = 0;
    kvh_status qst = kvh_engine_block_bytes(e, &block_bytes);
    uint64_t quota = (2 * n + 16) * block_bytes;
    if (qst == KVH_OK)
        qst = kvh_agent_set_quota(e, 0, quota);
    if (qst != KVH_OK) {
        rc = bench_kvh_fail("kvh_agent_set_quota (first)", qst);
        goto out_h;
    }
    t0 = bench_ns();
    for (uint64_t i = 0; i < calls; i++) {
        kvh_status st = kvh_agent_set_quota(e, 0, quota + (i & 1) * block_bytes);
        if (st != KVH_OK) {
            rc = bench_kvh_fail("kvh_agent_set_quota", st);
            goto out_h;
        }
    }
    pt->ns[6] = (double)(bench_ns() - t0) / (double)calls;
    kvh_stats stats = {.struct_size = sizeof(stats)};
    kvh_engine_stats(e, &stats);
    bench_info(ctx, "scale n=%llu: %llu evictions during the run", (unsigned long long)n,
               (unsigned long long)stats.evictions);
out_h:
    free(handles);
out:
    kvh_engine_close(e);
    /* Once the engine is gone, so that the peak memory is not both. */
    if (rc == 0)
        pt->memory_read_ns = memory_read_ns(n * 128, ctx->seed ^ n);
    return rc;
}

/* ---- threads ---- */

#define AGENT_CONTEXT 1024u

typedef struct worker {
    kvh_engine *e;
    uint32_t agent;
    uint64_t ops;
    uint64_t seed;
    pthread_barrier_t *start;
    int rc;
} worker;

/* One agent: a context of AGENT_CONTEXT tokens (set up before the start
 * barrier), then a loop that keeps its length steady, so that every thread
 * count does the same work per operation: append a token and write its
 * K/V, read one random token, acquire + release one random token, drop the
 * last token. */
static void *worker_main(void *arg)
{
    worker *w = arg;
    kvh_seq s;
    uint16_t kv[8] = {0};
    int32_t tok[AGENT_CONTEXT];
    for (uint32_t i = 0; i < AGENT_CONTEXT; i++)
        tok[i] = (int32_t)((w->agent << 20) + i);
    kvh_status st = kvh_seq_create(w->e, w->agent, &s);
    if (st == KVH_OK)
        st = kvh_seq_append(w->e, s, tok, AGENT_CONTEXT);
    for (uint32_t i = 0; st == KVH_OK && i < AGENT_CONTEXT; i++)
        st = kvh_seq_write_kv(w->e, s, 0, i, 1, kv, kv);
    pthread_barrier_wait(w->start);
    if (st != KVH_OK) {
        w->rc = bench_kvh_fail("agent set-up", st);
        return NULL;
    }
    bench_rng rng;
    bench_rng_seed(&rng, w->seed);
    for (uint64_t i = 0; i < w->ops; i++) {
        switch (i & 3) {
        case 0: {
            int32_t t = (int32_t)((w->agent << 20) + AGENT_CONTEXT);
            st = kvh_seq_append(w->e, s, &t, 1);
            if (st == KVH_OK)
                st = kvh_seq_write_kv(w->e, s, 0, AGENT_CONTEXT, 1, kv, kv);
            break;
        }
        case 1:
            st = kvh_seq_read_kv(w->e, s, 0, bench_rng_below(&rng, AGENT_CONTEXT), 1, kv, NULL);
            break;
        case 2: {
            uint64_t pos = bench_rng_below(&rng, AGENT_CONTEXT);
            st = kvh_seq_acquire(w->e, s, pos, 1, NULL);
            if (st == KVH_OK)
                st = kvh_seq_release(w->e, s, pos, 1);
            break;
        }
        default:
            st = kvh_seq_truncate(w->e, s, AGENT_CONTEXT);
        }
        if (st != KVH_OK) {
            w->rc = bench_kvh_fail("agent loop", st);
            break;
        }
    }
    return NULL;
}

static double cpu_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ops_per_s: wall clock; ops_per_cpu_s: per second of CPU time the process
 * got (on a shared machine, more threads also win a larger share of the
 * CPUs, which the wall-clock rate counts as speed-up). */
static int measure_threads(const bench_ctx *ctx, uint64_t threads, uint64_t total_ops, double *ops_per_s,
                           double *ops_per_cpu_s)
{
    kvh_engine *e = NULL;
    /* Every agent's context (1-token blocks) plus its appended token. */
    BENCH_CHECK(open_engine(threads * (AGENT_CONTEXT + 4) + 64, 0, &e));
    worker *w = bench_xcalloc(threads, sizeof(*w));
    pthread_t *tid = bench_xcalloc(threads, sizeof(*tid));
    pthread_barrier_t start;
    int rc = 0;
    pthread_barrier_init(&start, NULL, (unsigned)threads + 1);
    uint64_t per = total_ops / threads;
    for (uint64_t i = 0; i < threads; i++) {
        w[i] = (worker){.e = e, .agent = (uint32_t)i + 1, .ops = per, .seed = ctx->seed * 977 + i, .start = &start};
        if (pthread_create(&tid[i], NULL, worker_main, &w[i]) != 0) {
            fprintf(stderr, "kvh-bench scale: pthread_create failed\n");
            abort(); /* the barrier counts on every thread */
        }
    }
    pthread_barrier_wait(&start);
    uint64_t t0 = bench_ns();
    double c0 = cpu_seconds();
    for (uint64_t i = 0; i < threads; i++) {
        pthread_join(tid[i], NULL);
        rc |= w[i].rc;
    }
    *ops_per_s = (double)(per * threads) / ((double)(bench_ns() - t0) * 1e-9);
    *ops_per_cpu_s = (double)(per * threads) / (cpu_seconds() - c0);
    pthread_barrier_destroy(&start);
    free(w);
    free(tid);
    kvh_engine_close(e);
    return rc;
}

int bench_scale(int argc, char **argv, const bench_ctx *ctx)
{
    scale_opts o = {
        .blocks = ctx->quick ? (bench_list){2, {1000, 10000}} : (bench_list){4, {1000, 10000, 100000, 1000000}},
        .threads = ctx->quick ? (bench_list){2, {1, 4}} : (bench_list){7, {1, 2, 4, 8, 16, 32, 64}},
        .ops = ctx->quick ? 20000 : 400000,
        .calls = ctx->quick ? 20000 : 200000,
    };
    const bench_opt opts[] = {
        {"--blocks", BENCH_OPT_LIST, &o.blocks, "live block counts N (ascending, within 100..20000000)"},
        {"--calls", BENCH_OPT_U64, &o.calls, "calls per operation and N"},
        {"--threads", BENCH_OPT_LIST, &o.threads, "agent thread counts (1..256)"},
        {"--ops", BENCH_OPT_U64, &o.ops, "operations per thread-count point, split over the threads"},
        {NULL, 0, NULL, NULL},
    };
    int prc = bench_parse(argc, argv, opts, SCEN,
                          "Cost per operation (alloc, lookup, touch, prefix match, eviction) as\n"
                          "the live block count grows, against a logarithmic reference; and\n"
                          "throughput of 1..64 agent threads against one thread.");
    if (prc)
        return bench_parse_rc(prc);
    for (size_t i = 0; i < o.blocks.n; i++)
        if (o.blocks.v[i] < 100 || o.blocks.v[i] > 20000000 || (i && o.blocks.v[i] <= o.blocks.v[i - 1])) {
            fprintf(stderr, "kvh-bench scale: --blocks must ascend within 100..20000000\n");
            return 2;
        }
    for (size_t i = 0; i < o.threads.n; i++)
        if (o.threads.v[i] < 1 || o.threads.v[i] > 256) {
            fprintf(stderr, "kvh-bench scale: --threads values are 1..256\n");
            return 2;
        }
    if (o.calls < 64 || o.ops < 4 * 256) {
        fprintf(stderr, "kvh-bench scale: --calls >= 64, --ops >= 1024\n");
        return 2;
    }

    int reps = ctx->reps ? ctx->reps : (ctx->quick ? 1 : 3);
    if (reps > 16)
        reps = 16;
    /* Rounds outside, sizes inside: load that comes and goes on a shared
     * machine hits every size alike instead of one of them. */
    scale_point *runs = bench_xcalloc(o.blocks.n * (size_t)reps, sizeof(*runs));
    for (int r = 0; r < reps; r++)
        for (size_t i = 0; i < o.blocks.n; i++)
            if (measure_n(ctx, o.blocks.v[i], o.calls, &runs[i * (size_t)reps + (size_t)r])) {
                free(runs);
                return 1;
            }
    scale_point first = {.ns = {0}};
    for (size_t i = 0; i < o.blocks.n; i++) {
        uint64_t n = o.blocks.v[i];
        scale_point med;
        for (int op = 0; op < N_OPS; op++) {
            double v[16];
            for (int r = 0; r < reps; r++)
                v[r] = runs[i * (size_t)reps + (size_t)r].ns[op];
            med.ns[op] = bench_median(v, (size_t)reps);
        }
        double mv[16];
        for (int r = 0; r < reps; r++)
            mv[r] = runs[i * (size_t)reps + (size_t)r].memory_read_ns;
        med.memory_read_ns = bench_median(mv, (size_t)reps);
        if (i == 0)
            first = med;
        double log_scale = __builtin_log2((double)n) / __builtin_log2((double)o.blocks.v[0]);
        for (int op = 0; op < N_OPS; op++) {
            bench_row *r = bench_row_new(SCEN, op_names[op], med.ns[op], "ns/op");
            bench_row_int(r, "blocks", (int64_t)n);
            double ref = first.ns[op] * log_scale;
            bench_row_baseline(r, ref, ref / med.ns[op]);
            if (i == 0)
                bench_row_note(r, "reference point");
            else if (op != 2 && op != 5)
                bench_row_target(r, 1, 1, 0.5);
            else
                bench_row_note(r, "no target: a fixed count of memory reads, see memory_read");
            bench_emit(ctx, r);
        }
        if (med.memory_read_ns > 0) {
            bench_row *r = bench_row_new(SCEN, "memory_read", med.memory_read_ns, "ns/read");
            bench_row_int(r, "blocks", (int64_t)n);
            bench_row_int(r, "bytes", (int64_t)(n * 128));
            bench_emit(ctx, r);
        }
    }
    free(runs);

    double one = 0, one_cpu = 0;
    for (size_t i = 0; i < o.threads.n; i++) {
        double v[16], c[16];
        for (int r = 0; r < reps; r++)
            if (measure_threads(ctx, o.threads.v[i], o.ops, &v[r], &c[r]))
                return 1;
        double rate = bench_median(v, (size_t)reps), cpu = bench_median(c, (size_t)reps);
        if (i == 0) {
            one = rate;
            one_cpu = cpu;
        }
        bench_row *r = bench_row_new(SCEN, "agent_ops", rate, "ops/s");
        bench_row_int(r, "threads", (int64_t)o.threads.v[i]);
        bench_row_baseline(r, one, rate / one);
        bench_emit(ctx, r);
        r = bench_row_new(SCEN, "agent_ops_per_cpu_s", cpu, "ops/cpu-s");
        bench_row_int(r, "threads", (int64_t)o.threads.v[i]);
        bench_row_baseline(r, one_cpu, cpu / one_cpu);
        bench_emit(ctx, r);
    }
    return 0;
}
