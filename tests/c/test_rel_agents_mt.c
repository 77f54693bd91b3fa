/* Reliability battery, item 7: agents under concurrency (label
 * concurrency: also runs under TSan, where any report fails the test).
 *
 * AGENTS threads (16), each an agent with its own id (some with a device
 * quota), share one engine with 2 migration workers and do for a bounded
 * time: match a shared prompt from the prefix cache and continue it, fork
 * (forks of forks, divergent continuations: copy-on-write), append +
 * write_kv, read back and check every byte, prefetch (fences), acquire +
 * block table + a decode step + release, pin/unpin, evict (migrate to host
 * or disk, sync or async), persist, free. Every status must be one the
 * call may return here (KVH_OK, KVH_ERR_NOSPACE in tiny tiers); every byte
 * read back must be right.
 *
 * At checkpoints the agents drain (free their sequences, wait their
 * fences) and park; then the counters must add up (rl_counters_add_up:
 * bytes = blocks x block size in every tier and every transfer leg, live
 * blocks = allocated - freed matching the slots in use -- exactly without
 * a disk tier --, hits = lookups). Two engines per run: with a disk tier
 * and memory only.
 *
 * CI: 3 s + 2 s (KVH_REL_AGENT_SECONDS scales). The soak
 * (test_rel_soak_stress.c, make stress) runs the same workload for
 * KVH_REL_SOAK_SECONDS (300) and also requires memory to stay flat: heap
 * bytes in use and RSS at each checkpoint, after a warm-up, within a small
 * margin of the warm-up level.
 */
#include "rel_util.h"

#include <malloc.h>

#ifndef REL_SOAK
#define REL_SOAK 0
#endif

static const dt_geo G = {2, 2, 16, 8, KVH_DTYPE_F16}; /* block = 2048 bytes */
#define AGENTS 16
#define MAX_SEQS_PER_AGENT 4
#define MAX_BLOCKS 5 /* per sequence */
#define PROMPT_STREAM 0xabcull
#define PROMPT_LEN (2 * 8 + 3)

/* Content with up to two splits: [0, s1) stream a, [s1, s2) b, then c. */
typedef struct content {
    uint64_t a, b, c;
    uint64_t s1, s2;
} content;

static uint64_t stream_at(const content *t, uint64_t pos) { return pos < t->s1 ? t->a : pos < t->s2 ? t->b : t->c; }
static int32_t token_at(const content *t, uint64_t pos) { return dt_token(dt_plain(stream_at(t, pos)), pos); }
static void kv_at(const content *t, uint32_t layer, uint64_t pos, int kv, uint8_t *out)
{
    dt_kv_token(dt_plain(stream_at(t, pos)), layer, pos, kv, out, dt_tok_bytes(G));
}

static struct {
    kvh_engine *e;
    bool has_disk;
    atomic_int stop, pause, parked;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    char error[512];
    atomic_long ops, nospace, bytes_checked, decodes;
} W = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static void set_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void set_error(const char *fmt, ...)
{
    pthread_mutex_lock(&W.mu);
    if (!W.error[0]) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(W.error, sizeof(W.error), fmt, ap);
        va_end(ap);
    }
    pthread_mutex_unlock(&W.mu);
    atomic_store(&W.stop, 1);
}

typedef struct aseq {
    kvh_seq s;
    content c;
    size_t len;
} aseq;

typedef struct agent {
    int id;
    dt_rng r;
    aseq q[MAX_SEQS_PER_AGENT];
    int n;
    uint64_t next_stream;
} agent;

/* false: stop. */
static bool ok(agent *a, kvh_status st, const char *what)
{
    atomic_fetch_add(&W.ops, 1);
    if (st == KVH_OK)
        return true;
    if (st == KVH_ERR_NOSPACE) {
        atomic_fetch_add(&W.nospace, 1);
        return true;
    }
    /* another agent may have pinned a shared (prompt) block in another
     * tier meanwhile; a migrate skips such a block, an acquire cannot */
    if (st == KVH_ERR_BUSY && !strcmp(what, "acquire"))
        return true;
    set_error("agent %d: %s returned %s: %s", a->id, what, kvh_status_name(st), kvh_last_error());
    return false;
}

static kvh_status extend(kvh_engine *e, aseq *q, size_t to)
{
    size_t n = to - q->len, tb = dt_tok_bytes(G);
    int32_t tk[MAX_BLOCKS * 8];
    uint8_t k[MAX_BLOCKS * 8 * 64], v[MAX_BLOCKS * 8 * 64];
    for (size_t i = 0; i < n; i++)
        tk[i] = token_at(&q->c, q->len + i);
    kvh_status st = kvh_seq_append(e, q->s, tk, n);
    for (uint32_t l = 0; st == KVH_OK && l < G.layers; l++) {
        for (size_t i = 0; i < n; i++) {
            kv_at(&q->c, l, q->len + i, 0, k + i * tb);
            kv_at(&q->c, l, q->len + i, 1, v + i * tb);
        }
        st = kvh_seq_write_kv(e, q->s, l, q->len, n, k, v);
        if (st != KVH_OK) {
            /* tokens appended, K/V not all written: drop the tail */
            kvh_status t = kvh_seq_truncate(e, q->s, q->len);
            if (t != KVH_OK)
                return t;
        }
    }
    if (st == KVH_OK)
        q->len = to;
    return st;
}

/* Reads [pos, pos + n) and compares; KVH_ERR_INTERNAL on a wrong byte. */
static kvh_status check(kvh_engine *e, aseq *q, uint64_t pos, size_t n, char *msg, size_t len)
{
    size_t tb = dt_tok_bytes(G);
    int32_t tk[MAX_BLOCKS * 8];
    uint8_t k[MAX_BLOCKS * 8 * 64], v[MAX_BLOCKS * 8 * 64], want[64];
    kvh_status st = kvh_seq_tokens(e, q->s, pos, n, tk);
    for (size_t i = 0; st == KVH_OK && i < n; i++)
        if (tk[i] != token_at(&q->c, pos + i)) {
            snprintf(msg, len, "token %" PRIu64 " differs", pos + i);
            return KVH_ERR_INTERNAL;
        }
    for (uint32_t l = 0; st == KVH_OK && l < G.layers; l++) {
        st = kvh_seq_read_kv(e, q->s, l, pos, n, k, v);
        for (size_t i = 0; st == KVH_OK && i < n; i++)
            for (int kv = 0; kv < 2; kv++) {
                kv_at(&q->c, l, pos + i, kv, want);
                if (memcmp((kv ? v : k) + i * tb, want, tb) != 0) {
                    snprintf(msg, len, "%s of layer %u token %" PRIu64 " differs", kv ? "V" : "K", l, pos + i);
                    return KVH_ERR_INTERNAL;
                }
            }
    }
    if (st == KVH_OK)
        atomic_fetch_add(&W.bytes_checked, (long)(n * tb * 2 * G.layers));
    return st;
}

static void drop(agent *a, int i)
{
    kvh_seq_free(W.e, a->q[i].s);
    a->q[i] = a->q[--a->n];
}

static void park(agent *a)
{
    while (a->n)
        drop(a, 0);
    pthread_mutex_lock(&W.mu);
    atomic_fetch_add(&W.parked, 1);
    pthread_cond_broadcast(&W.cv);
    while (atomic_load(&W.pause) && !atomic_load(&W.stop))
        pthread_cond_wait(&W.cv, &W.mu);
    atomic_fetch_sub(&W.parked, 1);
    pthread_mutex_unlock(&W.mu);
}

static void *agent_main(void *arg)
{
    agent *a = arg;
    kvh_engine *e = W.e;
    size_t bt = G.bt;
    while (!atomic_load(&W.stop)) {
        if (atomic_load(&W.pause)) {
            park(a);
            continue;
        }
        kvh_status st;
        kvh_fence f = {0};
        char msg[256] = "";
        uint64_t op = dt_below(&a->r, 15);
        if (a->n == 0 || (a->n < MAX_SEQS_PER_AGENT && op == 0)) {
            /* a new sequence: continue the shared prompt, or start fresh */
            aseq *q = &a->q[a->n];
            bool prompt = dt_below(&a->r, 2);
            q->c = (content){PROMPT_STREAM, a->next_stream, a->next_stream, prompt ? PROMPT_LEN : 0, UINT64_MAX};
            if (!prompt)
                q->c.a = a->next_stream;
            a->next_stream++;
            if (!ok(a, kvh_seq_create(e, (uint32_t)a->id, &q->s), "create"))
                break;
            q->len = 0;
            if (prompt) {
                int32_t tk[PROMPT_LEN];
                for (size_t i = 0; i < PROMPT_LEN; i++)
                    tk[i] = token_at(&q->c, i);
                size_t m = 0;
                if (!ok(a, kvh_seq_match_prefix(e, q->s, tk, PROMPT_LEN, &m), "match_prefix"))
                    break;
                q->len = m;
                if (m && (st = check(e, q, 0, m, msg, sizeof(msg))) != KVH_OK) {
                    if (st == KVH_ERR_INTERNAL || !ok(a, st, "read of a matched prompt")) {
                        set_error("agent %d: matched prompt: %s", a->id, msg);
                        break;
                    }
                }
            }
            a->n++;
            size_t to = q->len + 1 + dt_below(&a->r, 2 * bt);
            if (to > MAX_BLOCKS * bt)
                to = MAX_BLOCKS * bt;
            if (to > q->len && !ok(a, extend(e, q, to), "extend"))
                break;
            continue;
        }
        int i = (int)dt_below(&a->r, (uint64_t)a->n);
        aseq *q = &a->q[i];
        uint64_t span = q->len < 2 * bt ? q->len : 2 * bt;
        switch (op) {
        case 1: /* grow */
            if (q->len < MAX_BLOCKS * bt &&
                !ok(a, extend(e, q, q->len + 1 + dt_below(&a->r, MAX_BLOCKS * bt - q->len)), "extend"))
                goto out;
            break;
        case 2: /* fork with a divergent continuation (one more split) */
            if (a->n < MAX_SEQS_PER_AGENT && q->c.s2 == UINT64_MAX && q->len < MAX_BLOCKS * bt) {
                aseq *c = &a->q[a->n];
                c->c = q->c;
                c->c.s2 = q->len;
                c->c.c = a->next_stream++;
                c->len = q->len;
                if (!ok(a, st = kvh_seq_fork(e, q->s, (uint32_t)a->id, &c->s), "fork"))
                    goto out;
                if (st == KVH_OK) {
                    a->n++;
                    if (!ok(a, extend(e, c, c->len + 1 + dt_below(&a->r, MAX_BLOCKS * bt - c->len)), "extend fork"))
                        goto out;
                }
            }
            break;
        case 3:
        case 4: /* read back (part or all) */
            if (q->len) {
                uint64_t p = dt_below(&a->r, q->len);
                st = check(e, q, p, q->len - p, msg, sizeof(msg));
                if (st == KVH_ERR_INTERNAL) {
                    set_error("agent %d: wrong data: %s", a->id, msg);
                    goto out;
                }
                if (!ok(a, st, "read back"))
                    goto out;
            }
            break;
        case 5: /* prefetch */
            if (span) {
                if (!ok(a, kvh_prefetch(e, q->s, 0, span, (int32_t)dt_below(&a->r, 4), &f), "prefetch"))
                    goto out;
                if (!ok(a, kvh_fence_wait(e, f, UINT64_MAX), "prefetch fence") || !ok(a, kvh_fence_free(e, f), "free"))
                    goto out;
            }
            break;
        case 6: /* acquire, block table, a decode step, release */
            if (span) {
                if (!ok(a, st = kvh_seq_acquire(e, q->s, 0, q->len, NULL), "acquire"))
                    goto out;
                if (st != KVH_OK)
                    break;
                int32_t indptr[2], idx[MAX_BLOCKS], lpl[1];
                if (!ok(a, kvh_block_table(e, &q->s, 1, indptr, idx, MAX_BLOCKS, lpl), "block_table"))
                    goto out;
                if (dt_below(&a->r, 4) == 0) {
                    kvh_attention_params ap;
                    kvh_attention_params_init(&ap, sizeof(ap));
                    ap.threads = 1;
                    float qv[2 * 16], out[2 * 16];
                    for (int j = 0; j < 32; j++)
                        qv[j] = (float)(j % 7) * 0.1f;
                    if (!ok(a, kvh_attention_decode(e, 0, &q->s, 1, qv, out, &ap), "decode"))
                        goto out;
                    atomic_fetch_add(&W.decodes, 1);
                }
                if (!ok(a, kvh_seq_release(e, q->s, 0, q->len), "release"))
                    goto out;
            }
            break;
        case 7: /* pin and unpin */
            if (span && (st = kvh_seq_pin(e, q->s, 0, span, 1)) == KVH_OK) {
                if (!ok(a, kvh_seq_pin(e, q->s, 0, span, 0), "unpin"))
                    goto out;
            } else if (span && !ok(a, st, "pin"))
                goto out;
            break;
        case 8:
        case 9: { /* evict: to host or disk, sync or async */
            uint32_t tier = W.has_disk && dt_below(&a->r, 2) ? KVH_TIER_DISK : KVH_TIER_HOST;
            bool async = dt_below(&a->r, 2);
            if (!ok(a, kvh_seq_migrate(e, q->s, 0, q->len, tier, async ? &f : NULL), "migrate"))
                goto out;
            if (async && f.id &&
                (!ok(a, kvh_fence_wait(e, f, UINT64_MAX), "migrate fence") || !ok(a, kvh_fence_free(e, f), "free")))
                goto out;
            break;
        }
        case 10: /* persist */
            if (W.has_disk && !ok(a, kvh_seq_persist(e, q->s), "persist"))
                goto out;
            break;
        case 11: { /* occupancy is always consistent */
            uint64_t bb = 0;
            kvh_engine_block_bytes(e, &bb);
            for (uint32_t t = 0; t < KVH_TIER_COUNT; t++) {
                kvh_tier_info ti = dt_tier(e, t);
                if (ti.used_bytes != ti.used_blocks * bb || ti.used_blocks > ti.capacity_blocks) {
                    set_error("tier %u: used_bytes %" PRIu64 " used_blocks %" PRIu64 " capacity %" PRIu64, t,
                              ti.used_bytes, ti.used_blocks, ti.capacity_blocks);
                    goto out;
                }
            }
            break;
        }
        case 12: /* cut anywhere, blocks on disk or shared included */
            if (q->len) {
                size_t to = dt_below(&a->r, q->len);
                if (!ok(a, st = kvh_seq_truncate(e, q->s, to), "truncate"))
                    goto out;
                if (st == KVH_OK)
                    q->len = to;
            }
            break;
        default:
            drop(a, i);
        }
    }
out:
    while (a->n)
        drop(a, 0);
    /* a parked-for-pause protocol participant even when stopping */
    pthread_mutex_lock(&W.mu);
    atomic_fetch_add(&W.parked, 1);
    pthread_cond_broadcast(&W.cv);
    pthread_mutex_unlock(&W.mu);
    return NULL;
}

/* Parks every agent (sequences freed, fences waited). */
static void pause_all(void)
{
    atomic_store(&W.pause, 1);
    pthread_mutex_lock(&W.mu);
    while (atomic_load(&W.parked) < AGENTS)
        pthread_cond_wait(&W.cv, &W.mu);
    pthread_mutex_unlock(&W.mu);
}

static void resume_all(void)
{
    pthread_mutex_lock(&W.mu);
    atomic_store(&W.pause, 0);
    pthread_cond_broadcast(&W.cv);
    pthread_mutex_unlock(&W.mu);
    /* wait until they left the park (so the next pause counts afresh) */
    for (;;) {
        pthread_mutex_lock(&W.mu);
        int p = atomic_load(&W.parked);
        pthread_mutex_unlock(&W.mu);
        if (p == 0 || atomic_load(&W.stop))
            break;
        dt_sleep_ms(1);
    }
}

typedef struct run_stats {
    int checkpoints;
    uint64_t heap_warm, heap_max, rss_warm, rss_max;
} run_stats;

static uint64_t heap_in_use(void)
{
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
    struct mallinfo2 mi = mallinfo2();
    return mi.uordblks + mi.hblkhd;
#else
    return 0;
#endif
}

static void run_agents(bool disk, double seconds, uint64_t seed, run_stats *rs)
{
    char dir[512];
    rl_fast_scratch(disk ? "agents-disk" : "agents-mem", dir, sizeof(dir));
    kvh_config c = disk ? dt_cfg(G, dir, 16, 32, 1024, 2) : dt_cfg(G, NULL, 24, 112, 0, 2);
    W.e = dt_open_a(&c);
    W.has_disk = disk;
    atomic_store(&W.stop, 0);
    atomic_store(&W.pause, 0);
    atomic_store(&W.parked, 0);
    W.error[0] = '\0';
    /* the shared prompt, cached (and durable with a disk tier) */
    {
        kvh_seq p;
        kvh_status st = dt_build(W.e, G, dt_plain(PROMPT_STREAM), PROMPT_LEN, 99, &p);
        dt_assert_ok(st);
        if (disk)
            dt_assert_ok(kvh_seq_persist(W.e, p));
        dt_assert_ok(kvh_seq_free(W.e, p));
    }
    uint64_t bb = dt_block_bytes(G);
    for (uint32_t id = 0; id < AGENTS; id += 4) /* every 4th agent has a small device quota */
        dt_assert_ok(kvh_agent_set_quota(W.e, id, 6 * bb));
    pthread_t th[AGENTS];
    agent ag[AGENTS];
    dt_rng r = {seed};
    for (int i = 0; i < AGENTS; i++) {
        ag[i] = (agent){.id = i, .r = {dt_next(&r)}, .next_stream = ((uint64_t)(i + 1) << 32) | (disk ? 1u << 31 : 0)};
        assert_int_equal(pthread_create(&th[i], NULL, agent_main, &ag[i]), 0);
    }
    double t0 = dt_now(), interval = REL_SOAK ? 10.0 : seconds / 2.5;
    double next = t0 + interval;
    while (dt_now() - t0 < seconds && !atomic_load(&W.stop)) {
        dt_sleep_ms(20);
        if (dt_now() < next)
            continue;
        next += interval;
        pause_all();
        char msg[256];
        if (!W.error[0] && rl_counters_add_up(W.e, disk, msg, sizeof(msg)))
            set_error("checkpoint %d: %s", rs->checkpoints, msg);
        uint64_t heap = heap_in_use(), rss = rl_rss_bytes();
        if (dt_now() - t0 < seconds * 0.25 || rs->checkpoints == 0) {
            rs->heap_warm = heap > rs->heap_warm ? heap : rs->heap_warm;
            rs->rss_warm = rss > rs->rss_warm ? rss : rs->rss_warm;
        } else {
            rs->heap_max = heap > rs->heap_max ? heap : rs->heap_max;
            rs->rss_max = rss > rs->rss_max ? rss : rs->rss_max;
        }
        if (REL_SOAK)
            print_message("  soak %s t=%.0f s: ops %ld, heap in use %.1f MiB, RSS %.1f MiB\n", disk ? "disk" : "mem",
                          dt_now() - t0, atomic_load(&W.ops), heap / 1048576.0, rss / 1048576.0);
        rs->checkpoints++;
        resume_all();
    }
    atomic_store(&W.stop, 1);
    pthread_mutex_lock(&W.mu);
    pthread_cond_broadcast(&W.cv);
    pthread_mutex_unlock(&W.mu);
    for (int i = 0; i < AGENTS; i++)
        pthread_join(th[i], NULL);
    if (W.error[0])
        fail_msg("%s engine (seed 0x%" PRIx64 "): %s", disk ? "disk" : "memory", seed, W.error);
    char msg[256];
    if (rl_counters_add_up(W.e, disk, msg, sizeof(msg)))
        fail_msg("%s engine at the end: %s", disk ? "disk" : "memory", msg);
    dt_assert_ok(dt_close(W.e));
    dt_rmrf(dir);
}

static void test_agents(void **state)
{
    (void)state;
    double scale = (double)dt_env_long("KVH_REL_AGENT_SECONDS", 0);
    double s_disk = REL_SOAK ? (double)dt_env_long("KVH_REL_SOAK_SECONDS", 300) / 2 : scale > 0 ? scale : 3.0;
    double s_mem = REL_SOAK ? s_disk : scale > 0 ? scale : 2.0;
    uint64_t seed = dt_seed(0xa6e475ull);
    double t0 = dt_now();
    run_stats rd = {0}, rm = {0};
    atomic_store(&W.ops, 0);
    if (s_disk > 0)
        run_agents(true, s_disk, seed, &rd);
    long ops_disk = atomic_load(&W.ops);
    run_agents(false, s_mem, seed + 1, &rm);
    long ops = atomic_load(&W.ops);
    print_message("agents: %d threads x %.1f s (disk tier) + %d x %.1f s (memory only) in %.1f s: %ld calls (%ld "
                  "KVH_ERR_NOSPACE), %ld MiB read back and checked, %ld decode steps; %d checkpoints where the "
                  "counters added up\n",
                  AGENTS, s_disk, AGENTS, s_mem, dt_now() - t0, ops, atomic_load(&W.nospace),
                  atomic_load(&W.bytes_checked) >> 20, atomic_load(&W.decodes), rd.checkpoints + rm.checkpoints);
    (void)ops_disk;
    if (REL_SOAK) {
        run_stats *v[2] = {&rd, &rm};
        for (int i = s_disk > 0 ? 0 : 1; i < 2; i++) {
            /* flat: after the warm-up, within 4 MiB + 10 % of the warm level */
            uint64_t heap_lim = v[i]->heap_warm + v[i]->heap_warm / 10 + (4u << 20);
            uint64_t rss_lim = v[i]->rss_warm + v[i]->rss_warm / 10 + (8u << 20);
            print_message("soak (%s): heap in use %.1f MiB after warm-up, at most %.1f MiB later; RSS %.1f -> at most "
                          "%.1f MiB\n",
                          i ? "memory only" : "disk tier", v[i]->heap_warm / 1048576.0, v[i]->heap_max / 1048576.0,
                          v[i]->rss_warm / 1048576.0, v[i]->rss_max / 1048576.0);
            if (v[i]->heap_max > heap_lim)
                fail_msg("soak: heap in use grew from %" PRIu64 " to %" PRIu64 " bytes", v[i]->heap_warm,
                         v[i]->heap_max);
            if (v[i]->rss_max > rss_lim)
                fail_msg("soak: RSS grew from %" PRIu64 " to %" PRIu64 " bytes", v[i]->rss_warm, v[i]->rss_max);
        }
    }
    rl_fast_cleanup();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_agents, rl_teardown),
    };
    return cmocka_run_group_tests_name(REL_SOAK ? "rel_soak" : "rel_agents", tests, NULL, NULL);
}
