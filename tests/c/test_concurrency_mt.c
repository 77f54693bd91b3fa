/* Concurrency: agent threads sharing a system prompt through the prefix
 * index, under a tight device budget, with a prefetcher thread and a stats
 * thread; and reads racing with tier swaps. Built to run clean under TSan.
 *
 * Threads never call cmocka: they record the first failure, the main
 * thread asserts after joining. KVH_TEST_SEED changes the seed;
 * KVH_MT_SECONDS the duration of the agent phase (default 3). */
#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

#include "test_util.h"

/* ---- failure recording ---- */

static pthread_mutex_t g_err_mu = PTHREAD_MUTEX_INITIALIZER;
static atomic_int g_errors;
static char g_err[1024];

#define TFAIL(...)                                                                                                     \
    do {                                                                                                               \
        pthread_mutex_lock(&g_err_mu);                                                                                 \
        if (atomic_fetch_add(&g_errors, 1) == 0)                                                                       \
            snprintf(g_err, sizeof(g_err), __VA_ARGS__);                                                               \
        pthread_mutex_unlock(&g_err_mu);                                                                               \
    } while (0)
#define TCHECK(cond, ...)                                                                                              \
    do {                                                                                                               \
        if (!(cond)) {                                                                                                 \
            TFAIL(__VA_ARGS__);                                                                                        \
            return 0;                                                                                                  \
        }                                                                                                              \
    } while (0)
#define TOK_(expr)                                                                                                     \
    do {                                                                                                               \
        kvh_status t_st_ = (expr);                                                                                     \
        TCHECK(t_st_ == KVH_OK, "%s:%d: %s -> %s (%s)", __FILE__, __LINE__, #expr, kvh_status_name(t_st_),             \
               kvh_last_error());                                                                                      \
    } while (0)

static void assert_no_thread_errors(void)
{
    if (atomic_load(&g_errors)) {
        print_error("%d failure(s) in threads; first: %s\n", atomic_load(&g_errors), g_err);
        fail();
    }
}

static double run_seconds(double def)
{
    const char *s = getenv("KVH_MT_SECONDS");
    return s && *s ? atof(s) : def;
}

/* ---- agents sharing a system prompt ---- */

enum { L = 2, H = 2, D = 8, BT = 4, NAGENTS = 8, SYS = 16, MAXL = 64 };
static const size_t TOKB = H * D * 4;

typedef struct aref {
    kvh_seq h;
    uint32_t len;
    int32_t tok[MAXL];
    uint64_t tag[MAXL]; /* tu_pattern tag of the KV at each position */
    uint8_t w[MAXL];
} aref;

typedef struct board_slot {
    pthread_mutex_t mu;
    kvh_seq h; /* 0 when not published */
} board_slot;

typedef struct shared {
    kvh_engine *e;
    uint64_t seed;
    double deadline;
    kvh_seq root;
    int32_t sys[SYS];
    kvh_block sys_blocks[SYS / BT];
    board_slot board[NAGENTS];
    atomic_int agents_running;
    atomic_long n_ops, n_nospace, n_acquired, n_forks, n_prefetch, n_stats;
} shared;

typedef struct agent_arg {
    shared *sh;
    uint32_t id;
} agent_arg;

static int write_range(kvh_engine *e, aref *r, uint64_t pos, uint32_t n, uint64_t tag)
{
    uint8_t k[8 * 64], v[8 * 64];
    for (uint32_t l = 0; l < L; l++) {
        for (uint32_t t = 0; t < n; t++) {
            tu_pattern(k + t * TOKB, TOKB, tag, l, pos + t, 0);
            tu_pattern(v + t * TOKB, TOKB, tag, l, pos + t, 1);
        }
        TOK_(kvh_seq_write_kv(e, r->h, l, pos, n, k, v));
    }
    for (uint32_t t = 0; t < n; t++) {
        r->tag[pos + t] = tag;
        r->w[pos + t] = 1;
    }
    return 1;
}

static int verify_range(kvh_engine *e, const aref *r, uint64_t pos, uint32_t n, const char *who)
{
    uint8_t k[MAXL * 64], v[MAXL * 64], want[64];
    for (uint32_t l = 0; l < L; l++) {
        TOK_(kvh_seq_read_kv(e, r->h, l, pos, n, k, v));
        for (uint32_t t = 0; t < n; t++)
            for (int kv = 0; kv < 2; kv++) {
                tu_pattern(want, TOKB, r->tag[pos + t], l, pos + t, kv);
                TCHECK(memcmp((kv ? v : k) + t * TOKB, want, TOKB) == 0, "%s: layer %u token %" PRIu64 " %s differs",
                       who, l, pos + t, kv ? "V" : "K");
            }
    }
    return 1;
}

static int verify_all_of(kvh_engine *e, const aref *r, const char *who)
{
    uint64_t len = 0;
    TOK_(kvh_seq_length(e, r->h, &len));
    TCHECK(len == r->len, "%s: length %" PRIu64 " != %u", who, len, r->len);
    int32_t tok[MAXL];
    TOK_(kvh_seq_tokens(e, r->h, 0, r->len, tok));
    TCHECK(memcmp(tok, r->tok, r->len * sizeof(int32_t)) == 0, "%s: tokens differ", who);
    return r->len ? verify_range(e, r, 0, r->len, who) : 1;
}

static int agent_body(shared *sh, uint32_t id, tu_rng *rng, aref *me)
{
    kvh_engine *e = sh->e;
    char who[32];
    snprintf(who, sizeof(who), "agent %u", id);
    uint64_t tag_counter = 1;
    TOK_(kvh_seq_create(e, id, &me->h));
    /* The system prompt is cached: attach it. */
    size_t m = 0;
    TOK_(kvh_seq_match_prefix(e, me->h, sh->sys, SYS, &m));
    TCHECK(m == SYS, "%s: matched %zu of the %d-token system prompt", who, m, SYS);
    kvh_block b0;
    TOK_(kvh_seq_blocks(e, me->h, 0, 1, &b0));
    TCHECK(b0.id == sh->sys_blocks[0].id, "%s: system prompt block not shared", who);
    memcpy(me->tok, sh->sys, sizeof(sh->sys));
    me->len = SYS;
    for (uint32_t t = 0; t < SYS; t++) {
        me->tag[t] = 7;
        me->w[t] = 1;
    }
    if (!verify_all_of(e, me, who))
        return 0;
    pthread_mutex_lock(&sh->board[id].mu);
    sh->board[id].h = me->h;
    pthread_mutex_unlock(&sh->board[id].mu);

    for (long it = 0; tu_now() < sh->deadline; it++) {
        atomic_fetch_add(&sh->n_ops, 1);
        uint32_t r = (uint32_t)tu_below(rng, 100);
        if (r < 28) { /* append + write */
            uint32_t n = 1 + (uint32_t)tu_below(rng, 6);
            if (me->len + n > MAXL)
                continue;
            int32_t t[8];
            for (uint32_t j = 0; j < n; j++)
                t[j] = (int32_t)(id * 100000 + me->len + j);
            kvh_status st = kvh_seq_append(e, me->h, t, n);
            if (st == KVH_ERR_NOSPACE) {
                atomic_fetch_add(&sh->n_nospace, 1);
                continue;
            }
            TOK_(st);
            memcpy(me->tok + me->len, t, n * sizeof(int32_t));
            memset(me->w + me->len, 0, n);
            uint32_t pos = me->len;
            me->len += n;
            if (!write_range(e, me, pos, n, ((uint64_t)id << 40) | tag_counter++))
                return 0;
        } else if (r < 40) { /* overwrite, also inside the shared prompt (CoW) */
            if (!me->len)
                continue;
            uint32_t pos = (uint32_t)tu_below(rng, me->len);
            uint32_t n = 1 + (uint32_t)tu_below(rng, me->len - pos < 6 ? me->len - pos : 6);
            if (!write_range(e, me, pos, n, ((uint64_t)id << 40) | tag_counter++))
                return 0;
        } else if (r < 60) { /* read back */
            if (!me->len)
                continue;
            uint32_t pos = (uint32_t)tu_below(rng, me->len);
            uint32_t n = 1 + (uint32_t)tu_below(rng, me->len - pos);
            if (!verify_range(e, me, pos, n, who))
                return 0;
        } else if (r < 70) { /* fork, diverge, check both, free the child */
            atomic_fetch_add(&sh->n_forks, 1);
            aref *c = malloc(sizeof(aref));
            TCHECK(c != NULL, "malloc");
            *c = *me;
            kvh_status st = kvh_seq_fork(e, me->h, id, &c->h);
            if (st != KVH_OK) {
                free(c);
                TOK_(st);
            }
            int ok = 1;
            if (c->len) {
                uint32_t pos = (uint32_t)tu_below(rng, c->len);
                uint32_t n = 1 + (uint32_t)tu_below(rng, c->len - pos < 6 ? c->len - pos : 6);
                ok = write_range(e, c, pos, n, ((uint64_t)id << 40) | (1ull << 39) | tag_counter++);
            }
            if (ok && c->len + 3 <= MAXL) {
                int32_t t[3] = {-1, -2, -3};
                kvh_status ast = kvh_seq_append(e, c->h, t, 3);
                if (ast == KVH_OK) {
                    memcpy(c->tok + c->len, t, sizeof(t));
                    memset(c->w + c->len, 0, 3);
                    c->len += 3;
                    ok = write_range(e, c, c->len - 3, 3, ((uint64_t)id << 40) | (1ull << 38) | tag_counter++);
                } else if (ast != KVH_ERR_NOSPACE) {
                    TFAIL("%s: child append: %s", who, kvh_status_name(ast));
                    ok = 0;
                }
            }
            ok = ok && verify_all_of(e, c, "fork child") && verify_all_of(e, me, who);
            kvh_status fst = kvh_seq_free(e, c->h);
            free(c);
            if (!ok)
                return 0;
            TOK_(fst);
        } else if (r < 84) { /* acquire a few blocks, use them, release */
            if (!me->len)
                continue;
            uint64_t first = tu_below(rng, me->len);
            uint64_t n = 1 + tu_below(rng, me->len - first < 4 * BT ? me->len - first : 4 * BT);
            kvh_fence f = {0};
            int async = (int)tu_below(rng, 2);
            kvh_status st = kvh_seq_acquire(e, me->h, first, n, async ? &f : NULL);
            if (st == KVH_OK && async) {
                st = kvh_fence_wait(e, f, UINT64_MAX);
                TOK_(kvh_fence_free(e, f));
                if (st != KVH_OK) {
                    TCHECK(st == KVH_ERR_NOSPACE, "%s: acquire fence: %s", who, kvh_status_name(st));
                    TOK_(kvh_seq_release(e, me->h, first, n));
                    atomic_fetch_add(&sh->n_nospace, 1);
                    continue;
                }
            }
            if (st == KVH_ERR_NOSPACE) {
                atomic_fetch_add(&sh->n_nospace, 1);
                continue;
            }
            TOK_(st);
            atomic_fetch_add(&sh->n_acquired, 1);
            /* Held blocks are resident in the device tier. */
            for (uint64_t b = first / BT; b < (first + n + BT - 1) / BT; b++) {
                kvh_block bh;
                TOK_(kvh_seq_blocks(e, me->h, b, 1, &bh));
                kvh_block_info bi = {.struct_size = sizeof(bi)};
                TOK_(kvh_block_info_get(e, bh, &bi));
                TCHECK(bi.tier == KVH_TIER_DEVICE && !bi.in_flight && bi.holds >= 1,
                       "%s: acquired block %" PRIu64 " in tier %u (in flight %u, holds %u)", who, b, bi.tier,
                       bi.in_flight, bi.holds);
            }
            if (first == 0 && n == me->len) {
                int32_t indptr[2], idx[MAXL / BT], lpl[1];
                TOK_(kvh_block_table(e, &me->h, 1, indptr, idx, MAXL / BT, lpl));
            }
            int ok = verify_range(e, me, first, (uint32_t)n, who);
            TOK_(kvh_seq_release(e, me->h, first, n));
            if (!ok)
                return 0;
        } else if (r < 90) { /* truncate */
            uint32_t n = 8 + (uint32_t)tu_below(rng, me->len > 8 ? me->len - 8 + 1 : 1);
            if (n > me->len)
                continue;
            kvh_status st = kvh_seq_truncate(e, me->h, n);
            if (st == KVH_ERR_NOSPACE) {
                atomic_fetch_add(&sh->n_nospace, 1);
                continue;
            }
            TOK_(st);
            memset(me->w + n, 0, MAXL - n);
            me->len = n;
        } else { /* push part of it down to the host tier */
            if (!me->len)
                continue;
            uint64_t first = tu_below(rng, me->len);
            kvh_fence f = {0};
            kvh_status st = kvh_seq_migrate(e, me->h, first, me->len - first, KVH_TIER_HOST, &f);
            if (st == KVH_OK) {
                st = kvh_fence_wait(e, f, UINT64_MAX);
                TOK_(kvh_fence_free(e, f));
            }
            TCHECK(st == KVH_OK || st == KVH_ERR_NOSPACE, "%s: migrate: %s", who, kvh_status_name(st));
        }
        if (it % 16 == 0 && !verify_all_of(e, me, who))
            return 0;
    }
    return verify_all_of(e, me, who);
}

static void *agent_main(void *p)
{
    agent_arg *a = p;
    shared *sh = a->sh;
    tu_rng rng = {sh->seed * 1000003 + a->id};
    aref *me = calloc(1, sizeof(aref));
    if (!me) {
        TFAIL("malloc");
        atomic_fetch_sub(&sh->agents_running, 1);
        return NULL;
    }
    agent_body(sh, a->id, &rng, me);
    /* Take the handle off the board before freeing it. */
    pthread_mutex_lock(&sh->board[a->id].mu);
    sh->board[a->id].h.id = 0;
    pthread_mutex_unlock(&sh->board[a->id].mu);
    if (me->h.id) {
        kvh_status st = kvh_seq_free(sh->e, me->h);
        if (st != KVH_OK)
            TFAIL("agent %u: free: %s", a->id, kvh_status_name(st));
    }
    free(me);
    atomic_fetch_sub(&sh->agents_running, 1);
    return NULL;
}

/* Hints on other agents' sequences, from one thread. */
static void *prefetcher_main(void *p)
{
    shared *sh = p;
    tu_rng rng = {sh->seed ^ 0x9e37};
    while (atomic_load(&sh->agents_running) > 0) {
        uint32_t a = (uint32_t)tu_below(&rng, NAGENTS);
        pthread_mutex_lock(&sh->board[a].mu);
        kvh_seq h = sh->board[a].h;
        if (h.id) {
            uint64_t len = 0;
            kvh_status st = kvh_seq_length(sh->e, h, &len);
            if (st != KVH_OK)
                TFAIL("prefetcher: length of agent %u: %s", a, kvh_status_name(st));
            else if (len) {
                uint64_t first = tu_below(&rng, len);
                kvh_fence f = {0};
                int with_fence = (int)tu_below(&rng, 4) == 0;
                /* Every third call only advises eviction (kvh_seq_hint). */
                int32_t prio = (int32_t)tu_below(&rng, 10);
                if (tu_below(&rng, 3) == 0) {
                    with_fence = 0;
                    st = kvh_seq_hint(sh->e, h, first, len - first, prio);
                } else {
                    st = kvh_prefetch(sh->e, h, first, len - first, prio, with_fence ? &f : NULL);
                }
                /* The owner may truncate meanwhile: RANGE is possible. */
                if (st != KVH_OK && st != KVH_ERR_RANGE)
                    TFAIL("prefetcher: prefetch: %s (%s)", kvh_status_name(st), kvh_last_error());
                if (st == KVH_OK && with_fence) {
                    kvh_status w = kvh_fence_wait(sh->e, f, UINT64_MAX);
                    if (w != KVH_OK)
                        TFAIL("prefetcher: fence: %s", kvh_status_name(w));
                    kvh_fence_free(sh->e, f);
                }
                atomic_fetch_add(&sh->n_prefetch, 1);
            }
        }
        pthread_mutex_unlock(&sh->board[a].mu);
        usleep(50);
    }
    return NULL;
}

/* Counters only go up; occupancy is consistent. */
static void *stats_main(void *p)
{
    shared *sh = p;
    kvh_stats prev;
    memset(&prev, 0, sizeof(prev));
    uint64_t bb = 0;
    kvh_engine_block_bytes(sh->e, &bb);
    while (atomic_load(&sh->agents_running) > 0) {
        kvh_stats s;
        memset(&s, 0, sizeof(s));
        s.struct_size = sizeof(s);
        kvh_status st = kvh_engine_stats(sh->e, &s);
        if (st != KVH_OK) {
            TFAIL("stats: %s", kvh_status_name(st));
            break;
        }
        const uint64_t *a = &s.lookups, *b = &prev.lookups;
        size_t n = (sizeof(s) - offsetof(kvh_stats, lookups)) / sizeof(uint64_t);
        for (size_t i = 0; i < n; i++)
            if (a[i] < b[i])
                TFAIL("stats: counter %zu went down (%" PRIu64 " -> %" PRIu64 ")", i, b[i], a[i]);
        prev = s;
        for (uint32_t t = 0; t < 2; t++) {
            kvh_tier_info ti = {.struct_size = sizeof(ti)};
            if (kvh_tier_info_get(sh->e, t, &ti) != KVH_OK)
                TFAIL("tier_info");
            else if (ti.used_bytes != ti.used_blocks * bb || ti.used_blocks > ti.capacity_blocks)
                TFAIL("tier %u: used %" PRIu64 " blocks / %" PRIu64 " bytes, capacity %" PRIu64, t, ti.used_blocks,
                      ti.used_bytes, ti.capacity_blocks);
        }
        atomic_fetch_add(&sh->n_stats, 1);
        usleep(200);
    }
    return NULL;
}

static void test_agents_share_prompt(void **state)
{
    (void)state;
    shared *sh = tu_alloc(sizeof(shared));
    sh->seed = tu_seed(0xa9e7);
    /* Tight device tier (24 blocks for 8 agents), roomy host tier. */
    sh->e = tu_open(L, H, D, BT, KVH_DTYPE_F32, 24, 1024, 2);
    kvh_engine *e = sh->e;
    tu_iota(sh->sys, SYS, 42);
    sh->root = tu_seq_new(e, 99);
    assert_ok(kvh_seq_append(e, sh->root, sh->sys, SYS));
    tu_write_pattern(e, sh->root, L, TOKB, 7, 0, SYS);
    assert_ok(kvh_seq_blocks(e, sh->root, 0, SYS / BT, sh->sys_blocks));
    for (int i = 0; i < SYS / BT; i++)
        assert_int_equal(tu_binfo(e, sh->sys_blocks[i]).published, 1);
    for (int i = 0; i < NAGENTS; i++)
        pthread_mutex_init(&sh->board[i].mu, NULL);
    double secs = run_seconds(3.0);
    sh->deadline = tu_now() + secs;
    atomic_store(&sh->agents_running, NAGENTS);
    pthread_t agents[NAGENTS], pf, st;
    agent_arg args[NAGENTS];
    for (uint32_t i = 0; i < NAGENTS; i++) {
        args[i] = (agent_arg){sh, i};
        assert_int_equal(pthread_create(&agents[i], NULL, agent_main, &args[i]), 0);
    }
    assert_int_equal(pthread_create(&pf, NULL, prefetcher_main, sh), 0);
    assert_int_equal(pthread_create(&st, NULL, stats_main, sh), 0);
    for (int i = 0; i < NAGENTS; i++)
        pthread_join(agents[i], NULL);
    pthread_join(pf, NULL);
    pthread_join(st, NULL);
    for (int i = 0; i < NAGENTS; i++)
        pthread_mutex_destroy(&sh->board[i].mu);
    printf("agents: %.1f s, %ld operations, %ld acquires, %ld forks, %ld NOSPACE, %ld prefetch hints, "
           "%ld stats reads (seed 0x%" PRIx64 ")\n",
           secs, atomic_load(&sh->n_ops), atomic_load(&sh->n_acquired), atomic_load(&sh->n_forks),
           atomic_load(&sh->n_nospace), atomic_load(&sh->n_prefetch), atomic_load(&sh->n_stats), sh->seed);
    assert_no_thread_errors();
    assert_true(atomic_load(&sh->n_ops) > 0);
    /* The root's prompt is intact, and the books balance once idle. */
    assert_true(tu_check_pattern(e, sh->root, L, TOKB, 7, 0, SYS));
    for (int i = 0; i < SYS / BT; i++) {
        for (int w = 0; w < 10000 && tu_binfo(e, sh->sys_blocks[i]).in_flight; w++)
            usleep(100);
        assert_int_equal(tu_binfo(e, sh->sys_blocks[i]).refs, 1);
    }
    usleep(20000);
    kvh_stats s = tu_stats(e);
    uint64_t used = tu_tier(e, KVH_TIER_DEVICE).used_blocks + tu_tier(e, KVH_TIER_HOST).used_blocks;
    assert_int_equal(s.blocks_allocated - s.blocks_freed, used);
    assert_int_equal(s.bytes_device_to_host, s.blocks_device_to_host * tu_block_bytes(e));
    assert_int_equal(s.bytes_host_to_device, s.blocks_host_to_device * tu_block_bytes(e));
    assert_ok(kvh_seq_free(e, sh->root));
    assert_ok(tu_close(e));
}

/* ---- reads racing with tier swaps ----
 *
 * Both tiers full of referenced blocks: bringing a host block up makes the
 * engine trade it with a device block through a bounce buffer. Meanwhile
 * other threads read those blocks (their own sequences). A read must see
 * the block's bytes, never the other block's, and must not race with the
 * copy. */

enum { SL = 1, SH = 8, SD = 64, SBT = 64 }; /* 256 KiB blocks */
static const size_t STOKB = SH * SD * 4;

typedef struct swap_shared {
    kvh_engine *e;
    kvh_seq a, b;   /* read by the readers */
    kvh_seq fa, fb; /* forks (same blocks) used by the swapper */
    double deadline;
    atomic_long n_acquires, n_reads;
} swap_shared;

static void *swapper_main(void *p)
{
    swap_shared *sh = p;
    tu_rng rng = {77};
    while (tu_now() < sh->deadline) {
        uint64_t blk = tu_below(&rng, 4);
        kvh_seq s = tu_below(&rng, 2) ? sh->fa : sh->fb;
        kvh_status st = kvh_seq_acquire(sh->e, s, blk * SBT, SBT, NULL);
        if (st == KVH_OK) {
            st = kvh_seq_release(sh->e, s, blk * SBT, SBT);
            if (st != KVH_OK)
                TFAIL("release: %s", kvh_status_name(st));
        } else if (st != KVH_ERR_NOSPACE) {
            TFAIL("acquire: %s (%s)", kvh_status_name(st), kvh_last_error());
        }
        atomic_fetch_add(&sh->n_acquires, 1);
    }
    return NULL;
}

typedef struct reader_arg {
    swap_shared *sh;
    kvh_seq s;
    uint64_t tag;
} reader_arg;

/* Readers get the engine lock mostly while a worker has dropped it to copy
 * (the swapper waits on its fence meanwhile): exactly the window that
 * matters. */
static void *reader_main(void *p)
{
    reader_arg *ra = p;
    swap_shared *sh = ra->sh;
    tu_rng rng = {ra->tag};
    uint8_t *k = malloc(SBT * STOKB), *want = malloc(STOKB);
    while (k && want && tu_now() < sh->deadline && !atomic_load(&g_errors)) {
        uint64_t blk = tu_below(&rng, 4);
        kvh_status st = kvh_seq_read_kv(sh->e, ra->s, 0, blk * SBT, SBT, k, NULL);
        if (st != KVH_OK) {
            TFAIL("read: %s", kvh_status_name(st));
            break;
        }
        for (uint32_t t = 0; t < SBT; t += 13) {
            tu_pattern(want, STOKB, ra->tag, 0, blk * SBT + t, 0);
            if (memcmp(k + t * STOKB, want, STOKB) != 0) {
                TFAIL("reader of seq tag %" PRIu64 ": block %" PRIu64 " token %u read bytes of another block "
                      "(read during a tier swap)",
                      ra->tag, blk, t);
                break;
            }
        }
        atomic_fetch_add(&sh->n_reads, 1);
    }
    free(k);
    free(want);
    return NULL;
}

/* Run with device and host as one arena (swaps trade tiers in place) and
 * with copy_moves (swaps copy through a bounce buffer, the lock dropped). */
static uint32_t SWAP_IN_PLACE = 0, SWAP_COPIES = 1;

static void test_reads_during_swaps(void **state)
{
    swap_shared *sh = tu_alloc(sizeof(swap_shared));
    kvh_config c = tu_cfg(SL, SH, SD, SBT, KVH_DTYPE_F32, 4, 4, 2);
    c.copy_moves = *(uint32_t *)*state;
    sh->e = tu_open_cfg(&c);
    kvh_engine *e = sh->e;
    int32_t *t = tu_alloc(4 * SBT * sizeof(int32_t));
    tu_iota(t, 4 * SBT, 1);
    sh->a = tu_seq_new(e, 0);
    assert_ok(kvh_seq_append(e, sh->a, t, 4 * SBT));
    tu_write_pattern(e, sh->a, SL, STOKB, 1, 0, 4 * SBT);
    tu_iota(t, 4 * SBT, 100000);
    sh->b = tu_seq_new(e, 1);
    assert_ok(kvh_seq_append(e, sh->b, t, 4 * SBT));
    tu_write_pattern(e, sh->b, SL, STOKB, 2, 0, 4 * SBT);
    assert_ok(kvh_seq_fork(e, sh->a, 0, &sh->fa));
    assert_ok(kvh_seq_fork(e, sh->b, 1, &sh->fb));
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, 4);
    assert_int_equal(tu_tier(e, KVH_TIER_HOST).used_blocks, 4);
    sh->deadline = tu_now() + run_seconds(3.0) / 2;
    pthread_t sw, ra, rb;
    reader_arg a_arg = {sh, sh->a, 1}, b_arg = {sh, sh->b, 2};
    assert_int_equal(pthread_create(&sw, NULL, swapper_main, sh), 0);
    assert_int_equal(pthread_create(&ra, NULL, reader_main, &a_arg), 0);
    assert_int_equal(pthread_create(&rb, NULL, reader_main, &b_arg), 0);
    pthread_join(sw, NULL);
    pthread_join(ra, NULL);
    pthread_join(rb, NULL);
    kvh_stats s = tu_stats(e);
    printf("swaps: %ld acquires, %ld reads, %" PRIu64 " evictions\n", atomic_load(&sh->n_acquires),
           atomic_load(&sh->n_reads), s.evictions);
    assert_no_thread_errors();
    assert_true(s.evictions > 0);
    assert_true(tu_check_pattern(e, sh->a, SL, STOKB, 1, 0, 4 * SBT));
    assert_true(tu_check_pattern(e, sh->b, SL, STOKB, 2, 0, 4 * SBT));
}

/* ---- a fence freed while another thread waits on it ----
 *
 * kvh_fence_wait and kvh_fence_free are both "@threads any", and a freed
 * handle must give KVH_ERR_BAD_HANDLE, never a crash: the waiter has to
 * come back (OK or BAD_HANDLE) once the work is done. */

typedef struct fence_shared {
    kvh_engine *e;
    kvh_fence f;
    atomic_int returned;
    kvh_status st;
} fence_shared;

static void *fence_waiter(void *p)
{
    fence_shared *fs = p;
    fs->st = kvh_fence_wait(fs->e, fs->f, UINT64_MAX);
    atomic_store(&fs->returned, 1);
    return NULL;
}

static void test_fence_free_while_waiting(void **state)
{
    (void)state;
    fence_shared *fs = calloc(1, sizeof(*fs)); /* not freed if a waiter is stuck */
    assert_non_null(fs);
    /* 16 MiB blocks: each migration takes milliseconds. */
    kvh_config c = tu_cfg(4, 8, 256, 256, KVH_DTYPE_F32, 1, 1, 2);
    assert_ok(kvh_engine_open(&c, &fs->e));
    kvh_seq s;
    assert_ok(kvh_seq_create(fs->e, 0, &s));
    int32_t *t = tu_alloc(256 * sizeof(int32_t));
    assert_ok(kvh_seq_append(fs->e, s, t, 256));
    for (int round = 0; round < 10; round++) {
        assert_ok(kvh_seq_migrate(fs->e, s, 0, 256, round % 2 ? KVH_TIER_DEVICE : KVH_TIER_HOST, &fs->f));
        atomic_store(&fs->returned, 0);
        pthread_t th;
        assert_int_equal(pthread_create(&th, NULL, fence_waiter, fs), 0);
        usleep(300);
        kvh_status st = kvh_fence_free(fs->e, fs->f);
        assert_true(st == KVH_OK || st == KVH_ERR_BAD_HANDLE);
        for (int i = 0; i < 3000 && !atomic_load(&fs->returned); i++)
            usleep(1000);
        if (!atomic_load(&fs->returned)) {
            /* The engine cannot be closed with a call stuck inside it. */
            print_error("round %d: kvh_fence_wait did not return within 3 s after another thread freed its "
                        "fence\n",
                        round);
            pthread_detach(th);
            fail();
        }
        pthread_join(th, NULL);
        assert_true(fs->st == KVH_OK || fs->st == KVH_ERR_BAD_HANDLE);
    }
    assert_ok(kvh_seq_free(fs->e, s));
    assert_ok(kvh_engine_close(fs->e));
    free(fs);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_agents_share_prompt, tu_teardown),
        cmocka_unit_test_prestate_setup_teardown(test_reads_during_swaps, NULL, tu_teardown, &SWAP_IN_PLACE),
        cmocka_unit_test_prestate_setup_teardown(test_reads_during_swaps, NULL, tu_teardown, &SWAP_COPIES),
        cmocka_unit_test_teardown(test_fence_free_while_waiting, tu_teardown), /* keep last */
    };
    return cmocka_run_group_tests_name("concurrency", tests, NULL, NULL);
}
