/* Quotas, tolerances and admission pools changed from one thread while
 * others allocate, append, write, read, migrate and hold (kvh.h: every
 * knob is @threads any; kvh_seq_set_tolerance on another thread's
 * sequence is refused with KVH_ERR_BUSY while a call of the owner is
 * inside, never a race). Checked throughout: every status is one the
 * header lists, every read returns what its owner wrote, no tier holds
 * more blocks than its capacity, counters never go back, and a quota
 * still bounds its agent after the churn. A second test moves one quota'd
 * agent's blocks up and down through the migration workers and checks
 * the quota after every call. Runs under TSan (label concurrency). */
#include <limits.h>
#include <sched.h>
#include <stdbool.h>
#include <stdatomic.h>

#include "test_util.h"
#include "mt_util.h"
#include "disk_test_util.h"

enum { L = 2, H = 2, D = 8, BT = 4, TOKB = H * D * 2 };
enum { DEVICE_BLOCKS = 24, HOST_BLOCKS = 160 };
enum { WORKERS = 3, KNOBS = 1, MONITORS = 1, THREADS = WORKERS + KNOBS + MONITORS };
enum { SEQS_PER_WORKER = 3, MAX_BLOCKS_PER_SEQ = 8 };
/* An agent no worker uses, whose quota is only ever set to the same value:
 * checked once the load is over. */
enum { BYSTANDER = 9, BYSTANDER_QUOTA_BLOCKS = 3 };
enum { SHARED_SEQS = WORKERS * SEQS_PER_WORKER, SHARED_BLOCKS = 64 };

static struct {
    kvh_engine *e;
    uint64_t bb;
    atomic_int stop;
    _Atomic uint64_t seqs[SHARED_SEQS];     /* live-ish sequence handles */
    _Atomic uint64_t blocks[SHARED_BLOCKS]; /* block handles seen */
    atomic_ulong knob_calls, busy_seen, worker_ops;
} G;

/* Retries a call on a sequence while another thread's call on it is
 * inside (documented KVH_ERR_BUSY). */
#define RETRY_BUSY(st, call)                                                                                           \
    do {                                                                                                               \
        (st) = (call);                                                                                                 \
        if ((st) != KVH_ERR_BUSY)                                                                                      \
            break;                                                                                                     \
        atomic_fetch_add(&G.busy_seen, 1);                                                                             \
        sched_yield();                                                                                                 \
    } while (1)

static int tier_ok(mt_worker *w, kvh_engine *e, uint32_t tier)
{
    kvh_tier_info ti;
    memset(&ti, 0, sizeof(ti));
    ti.struct_size = sizeof(ti);
    kvh_status st = kvh_tier_info_get(e, tier, &ti);
    if (st != KVH_OK) {
        mt_report(w, "tier_info_get: %s", kvh_status_name(st));
        return 0;
    }
    if (ti.used_blocks > ti.capacity_blocks) {
        mt_report(w, "tier %u holds %" PRIu64 " blocks, capacity %" PRIu64, tier, ti.used_blocks, ti.capacity_blocks);
        return 0;
    }
    if (ti.used_bytes != ti.used_blocks * ti.block_bytes) {
        mt_report(w, "tier %u: used_bytes %" PRIu64 " != %" PRIu64 " blocks x %" PRIu64, tier, ti.used_bytes,
                  ti.used_blocks, ti.block_bytes);
        return 0;
    }
    return 1;
}

/* ---- workers: agents 1..WORKERS ---- */

typedef struct wseq {
    kvh_seq s;
    uint64_t tag, len;
    int slot; /* index in G.seqs */
} wseq;

static kvh_status write_pattern(kvh_engine *e, kvh_seq s, uint64_t tag, uint64_t pos, size_t n)
{
    uint8_t k[MAX_BLOCKS_PER_SEQ * BT * TOKB], v[MAX_BLOCKS_PER_SEQ * BT * TOKB];
    kvh_status st = KVH_OK;
    for (uint32_t l = 0; l < L && st == KVH_OK; l++) {
        for (size_t t = 0; t < n; t++) {
            tu_pattern(k + t * TOKB, TOKB, tag, l, pos + t, 0);
            tu_pattern(v + t * TOKB, TOKB, tag, l, pos + t, 1);
        }
        RETRY_BUSY(st, kvh_seq_write_kv(e, s, l, pos, n, k, v));
    }
    return st;
}

/* 1: data right; 0: a mismatch or unexpected status (reported). */
static int verify(mt_worker *w, kvh_engine *e, const wseq *q, uint64_t pos, size_t n)
{
    uint8_t k[MAX_BLOCKS_PER_SEQ * BT * TOKB], v[MAX_BLOCKS_PER_SEQ * BT * TOKB], want[TOKB];
    for (uint32_t l = 0; l < L; l++) {
        kvh_status st;
        RETRY_BUSY(st, kvh_seq_read_kv(e, q->s, l, pos, n, k, v));
        if (st == KVH_ERR_NOSPACE)
            return 1; /* documented for blocks that no memory tier can take */
        if (st != KVH_OK) {
            mt_report(w, "read_kv: %s (%s)", kvh_status_name(st), kvh_last_error());
            return 0;
        }
        for (size_t t = 0; t < n; t++)
            for (int kv = 0; kv < 2; kv++) {
                tu_pattern(want, TOKB, q->tag, l, pos + t, kv);
                if (memcmp((kv ? v : k) + t * TOKB, want, TOKB) != 0) {
                    mt_report(w, "agent %d: KV of token %" PRIu64 " layer %u differs", w->t, pos + t, l);
                    return 0;
                }
            }
    }
    return 1;
}

static int free_seq(mt_worker *w, kvh_engine *e, wseq *q)
{
    atomic_store(&G.seqs[q->slot], 0);
    kvh_status st;
    RETRY_BUSY(st, kvh_seq_free(e, q->s));
    if (st != KVH_OK) {
        mt_report(w, "seq_free: %s", kvh_status_name(st));
        return 0;
    }
    return 1;
}

static void work(mt_worker *w)
{
    kvh_engine *e = G.e;
    const uint32_t agent = (uint32_t)w->t;
    tu_rng r = {tu_seed(0x9a07a) * 131 + (uint64_t)w->t};
    wseq q[SEQS_PER_WORKER];
    int nq = 0;
    uint64_t next_tag = (uint64_t)w->t << 32;
    while (!atomic_load(&G.stop) && !w->errors) {
        atomic_fetch_add(&G.worker_ops, 1);
        kvh_status st;
        uint64_t op = tu_below(&r, 8);
        if (nq == 0 || (op == 0 && nq < SEQS_PER_WORKER)) {
            /* A new sequence, with a token budget half of the time. */
            kvh_seq s = {0};
            st = KVH_ERR_NOSPACE;
            if (tu_below(&r, 2)) {
                kvh_seq_params p;
                kvh_seq_params_init(&p, sizeof(p));
                p.agent = agent;
                p.token_budget = 1 + tu_below(&r, MAX_BLOCKS_PER_SEQ * BT);
                st = kvh_seq_create_ex(e, &p, &s);
                if (st != KVH_OK && st != KVH_ERR_NOSPACE) {
                    mt_report(w, "seq_create_ex: %s", kvh_status_name(st));
                    break;
                }
            }
            if (st != KVH_OK && (st = kvh_seq_create(e, agent, &s)) != KVH_OK) {
                mt_report(w, "seq_create: %s", kvh_status_name(st));
                break;
            }
            int slot = (w->t - 1) * SEQS_PER_WORKER + nq;
            q[nq] = (wseq){s, next_tag++, 0, slot};
            atomic_store(&G.seqs[slot], s.id);
            nq++;
            continue;
        }
        wseq *c = &q[tu_below(&r, (uint64_t)nq)];
        if (op == 1 || op == 2) {
            /* Append and write up to the size limit; free when full. */
            if (c->len >= MAX_BLOCKS_PER_SEQ * BT) {
                if (!free_seq(w, e, c))
                    break;
                int slot = c->slot;
                *c = q[--nq];
                if (c != &q[nq]) { /* the last one moves into the freed place */
                    atomic_store(&G.seqs[c->slot], 0);
                    c->slot = slot;
                    atomic_store(&G.seqs[slot], c->s.id);
                }
                continue;
            }
            size_t n = 1 + tu_below(&r, MAX_BLOCKS_PER_SEQ * BT - c->len);
            int32_t tok[MAX_BLOCKS_PER_SEQ * BT];
            tu_iota(tok, n, (int32_t)(c->tag * 1000 + c->len));
            RETRY_BUSY(st, kvh_seq_append(e, c->s, tok, n));
            if (st == KVH_ERR_NOSPACE)
                continue;
            if (st != KVH_OK) {
                mt_report(w, "append: %s (%s)", kvh_status_name(st), kvh_last_error());
                break;
            }
            st = write_pattern(e, c->s, c->tag, c->len, n);
            if (st == KVH_ERR_NOSPACE) { /* undo: the tokens have no KV */
                RETRY_BUSY(st, kvh_seq_truncate(e, c->s, c->len));
                if (st != KVH_OK) {
                    mt_report(w, "truncate: %s", kvh_status_name(st));
                    break;
                }
                continue;
            }
            if (st != KVH_OK) {
                mt_report(w, "write_kv: %s (%s)", kvh_status_name(st), kvh_last_error());
                break;
            }
            c->len += n;
            kvh_block b;
            RETRY_BUSY(st, kvh_seq_blocks(e, c->s, (c->len - 1) / BT, 1, &b));
            if (st == KVH_OK)
                atomic_store(&G.blocks[tu_below(&r, SHARED_BLOCKS)], b.id);
        } else if (op == 3 && c->len) {
            uint64_t first = tu_below(&r, c->len);
            if (!verify(w, e, c, first, 1 + tu_below(&r, c->len - first)))
                break;
        } else if (op == 4 && c->len) {
            uint64_t first = tu_below(&r, c->len);
            uint32_t tier = tu_below(&r, 2) ? KVH_TIER_HOST : KVH_TIER_DEVICE;
            st = kvh_seq_migrate(e, c->s, first, 1 + tu_below(&r, c->len - first), tier, NULL);
            if (st != KVH_OK && st != KVH_ERR_NOSPACE) {
                mt_report(w, "seq_migrate: %s (%s)", kvh_status_name(st), kvh_last_error());
                break;
            }
        } else if (op == 5 && c->len) {
            uint64_t first = tu_below(&r, c->len), n = 1 + tu_below(&r, c->len - first < BT ? c->len - first : BT);
            RETRY_BUSY(st, kvh_seq_acquire(e, c->s, first, n, NULL));
            if (st == KVH_OK) {
                RETRY_BUSY(st, kvh_seq_release(e, c->s, first, n));
                if (st != KVH_OK) {
                    mt_report(w, "release: %s", kvh_status_name(st));
                    break;
                }
            } else if (st != KVH_ERR_NOSPACE && st != KVH_ERR_BUSY) {
                mt_report(w, "acquire: %s (%s)", kvh_status_name(st), kvh_last_error());
                break;
            }
        } else if (op == 6) {
            kvh_block b;
            st = kvh_block_alloc(e, agent, &b);
            if (st == KVH_OK) {
                atomic_store(&G.blocks[tu_below(&r, SHARED_BLOCKS)], b.id);
                st = kvh_block_release(e, b);
                if (st != KVH_OK) {
                    mt_report(w, "block_release: %s", kvh_status_name(st));
                    break;
                }
            } else if (st != KVH_ERR_NOSPACE) {
                mt_report(w, "block_alloc: %s", kvh_status_name(st));
                break;
            }
        } else if (op == 7 && c->len) {
            RETRY_BUSY(st, kvh_seq_set_tolerance(e, c->s, 0, c->len, (uint32_t)tu_below(&r, 256)));
            if (st != KVH_OK) {
                mt_report(w, "own set_tolerance: %s", kvh_status_name(st));
                break;
            }
        }
        if (!tier_ok(w, e, KVH_TIER_DEVICE) || !tier_ok(w, e, KVH_TIER_HOST))
            break;
    }
    /* Everything written is still there, then gone. */
    for (int i = 0; i < nq; i++) {
        if (!w->errors && q[i].len)
            verify(w, e, &q[i], 0, q[i].len);
        free_seq(w, e, &q[i]);
    }
}

/* ---- the knob thread ---- */

static void knobs(mt_worker *w)
{
    kvh_engine *e = G.e;
    tu_rng r = {tu_seed(0x9a07a) ^ 0xc0ffee};
    const uint64_t bb = G.bb;
    while (!atomic_load(&G.stop) && !w->errors) {
        atomic_fetch_add(&G.knob_calls, 1);
        kvh_status st;
        switch (tu_below(&r, 6)) {
        case 0: {
            uint32_t agent = 1 + (uint32_t)tu_below(&r, WORKERS);
            if ((st = kvh_agent_set_quota(e, agent, tu_below(&r, 9) * bb + tu_below(&r, 2))) != KVH_OK)
                mt_report(w, "agent_set_quota: %s", kvh_status_name(st));
            break;
        }
        case 1: {
            kvh_admission_params p;
            kvh_admission_params_init(&p, sizeof(p));
            p.short_max_tokens = tu_below(&r, 3 * BT);
            uint64_t s = tu_below(&r, DEVICE_BLOCKS + 1), l = tu_below(&r, DEVICE_BLOCKS + 1);
            p.short_device_bytes = s * bb;
            p.long_device_bytes = l * bb;
            st = kvh_admission_configure(e, &p);
            kvh_status want = s + l > DEVICE_BLOCKS ? KVH_ERR_INVALID_ARG : KVH_OK;
            if (st != want)
                mt_report(w, "admission_configure(%" PRIu64 " + %" PRIu64 " blocks): %s, expected %s", s, l,
                          kvh_status_name(st), kvh_status_name(want));
            break;
        }
        case 2: {
            kvh_block b = {atomic_load(&G.blocks[tu_below(&r, SHARED_BLOCKS)])};
            st = kvh_block_set_tolerance(e, b, (uint32_t)tu_below(&r, 256));
            if (st != KVH_OK && st != KVH_ERR_BAD_HANDLE)
                mt_report(w, "block_set_tolerance: %s", kvh_status_name(st));
            if ((st = kvh_block_set_tolerance(e, b, 256 + (uint32_t)tu_below(&r, 1000))) != KVH_ERR_INVALID_ARG)
                mt_report(w, "block_set_tolerance(>255): %s", kvh_status_name(st));
            break;
        }
        case 3: {
            kvh_seq s = {atomic_load(&G.seqs[tu_below(&r, SHARED_SEQS)])};
            st = kvh_seq_set_tolerance(e, s, 0, 1 + tu_below(&r, BT), (uint32_t)tu_below(&r, 256));
            if (st == KVH_ERR_BUSY)
                atomic_fetch_add(&G.busy_seen, 1);
            else if (st != KVH_OK && st != KVH_ERR_BAD_HANDLE && st != KVH_ERR_RANGE)
                mt_report(w, "seq_set_tolerance: %s", kvh_status_name(st));
            st = kvh_seq_derive_tolerance(e, s, 0, 1, 0.1f);
            if (st != KVH_ERR_UNSUPPORTED && st != KVH_ERR_BAD_HANDLE && st != KVH_ERR_BUSY && st != KVH_ERR_RANGE)
                mt_report(w, "derive_tolerance without a codec: %s", kvh_status_name(st));
            break;
        }
        case 4: {
            kvh_admission_info ai;
            memset(&ai, 0, sizeof(ai));
            ai.struct_size = sizeof(ai);
            if ((st = kvh_admission_info_get(e, &ai)) != KVH_OK)
                mt_report(w, "admission_info_get: %s", kvh_status_name(st));
            else if (ai.short_quota_blocks + ai.long_quota_blocks > DEVICE_BLOCKS)
                mt_report(w, "pool quotas %" PRIu64 " + %" PRIu64 " over the device tier", ai.short_quota_blocks,
                          ai.long_quota_blocks);
            break;
        }
        default: /* the bystander's quota, set again to the same value */
            if ((st = kvh_agent_set_quota(e, BYSTANDER, BYSTANDER_QUOTA_BLOCKS * bb)) != KVH_OK)
                mt_report(w, "agent_set_quota(bystander): %s", kvh_status_name(st));
            break;
        }
    }
}

/* ---- the monitor: counters never go back ---- */

static void monitor(mt_worker *w)
{
    kvh_engine *e = G.e;
    kvh_stats last;
    memset(&last, 0, sizeof(last));
    kvh_admission_info last_ai;
    memset(&last_ai, 0, sizeof(last_ai));
    uint64_t last_hist[KVH_LATENCY_KIND_COUNT] = {0};
    while (!atomic_load(&G.stop) && !w->errors) {
        kvh_stats s;
        memset(&s, 0, sizeof(s));
        s.struct_size = sizeof(s);
        if (kvh_engine_stats(e, &s) != KVH_OK) {
            mt_report(w, "engine_stats failed");
            break;
        }
#define MONO(f)                                                                                                        \
    if (s.f < last.f)                                                                                                  \
        mt_report(w, #f " went back: %" PRIu64 " -> %" PRIu64, last.f, s.f);
        MONO(lookups)
        MONO(hits_device)
        MONO(hits_host)
        MONO(blocks_allocated)
        MONO(blocks_freed)
        MONO(evictions)
        MONO(blocks_device_to_host)
        MONO(blocks_host_to_device)
        MONO(blocks_moved_in_place)
#undef MONO
        last = s;
        kvh_admission_info ai;
        memset(&ai, 0, sizeof(ai));
        ai.struct_size = sizeof(ai);
        if (kvh_admission_info_get(e, &ai) != KVH_OK) {
            mt_report(w, "admission_info_get failed");
            break;
        }
        if (ai.short_admitted < last_ai.short_admitted || ai.long_admitted < last_ai.long_admitted ||
            ai.short_rejected < last_ai.short_rejected || ai.long_rejected < last_ai.long_rejected)
            mt_report(w, "an admission counter went back");
        last_ai = ai;
        for (uint32_t k = 0; k < KVH_LATENCY_KIND_COUNT; k++) {
            kvh_latency_histogram h;
            memset(&h, 0, sizeof(h));
            h.struct_size = sizeof(h);
            if (kvh_latency_histogram_get(e, (kvh_latency_kind)k, &h) != KVH_OK || h.count < last_hist[k])
                mt_report(w, "latency histogram %u failed or went back", k);
            last_hist[k] = h.count;
        }
        if (!tier_ok(w, e, KVH_TIER_DEVICE) || !tier_ok(w, e, KVH_TIER_HOST))
            break;
    }
}

static void *thread_main(void *arg)
{
    mt_worker *w = arg;
    if (w->t == 0)
        knobs(w);
    else if (w->t <= WORKERS)
        work(w);
    else
        monitor(w);
    return NULL;
}

static void test_knobs_turned_under_load(void **state)
{
    (void)state;
    memset(&G, 0, sizeof(G));
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F16, DEVICE_BLOCKS, HOST_BLOCKS, 2);
    c.eviction_policy = KVH_EVICT_LCTRU;
    c.lru_k = 2;
    kvh_engine *e = tu_open_cfg(&c);
    G.e = e;
    G.bb = tu_block_bytes(e);
    assert_ok(kvh_agent_set_quota(e, BYSTANDER, BYSTANDER_QUOTA_BLOCKS * G.bb));
    mt_worker w[THREADS];
    mt_run_for(e, THREADS, thread_main, w, 3.0, &G.stop);
    assert_true(atomic_load(&G.knob_calls) > 100);
    assert_true(atomic_load(&G.worker_ops) > 100);

    /* Quiet now: the counters agree and no tier is over capacity. */
    kvh_stats s = tu_stats(e);
    assert_int_equal(s.lookups, s.hits_device + s.hits_host + s.hits_disk);
    kvh_tier_info dev = tu_tier(e, KVH_TIER_DEVICE), host = tu_tier(e, KVH_TIER_HOST);
    assert_true(dev.used_blocks <= dev.capacity_blocks);
    assert_true(host.used_blocks <= host.capacity_blocks);
    assert_int_equal(dev.pinned_blocks, 0);

    /* The bystander's quota survived the churn of quotas, pools and
     * tolerances around it. */
    kvh_admission_params p;
    assert_ok(kvh_admission_params_init(&p, sizeof(p)));
    assert_ok(kvh_admission_configure(e, &p)); /* control off */
    kvh_seq a = tu_seq_new(e, BYSTANDER);
    int32_t tok[10 * BT];
    tu_iota(tok, 10 * BT, 777000);
    assert_ok(kvh_seq_append(e, a, tok, 10 * BT));
    tu_write_pattern(e, a, L, TOKB, 4242, 0, 10 * BT);
    uint64_t on = 0;
    for (uint64_t i = 0; i < 10; i++)
        on += tu_seq_binfo(e, a, i).tier == KVH_TIER_DEVICE;
    if (on > BYSTANDER_QUOTA_BLOCKS)
        fail_msg("agent %d holds %" PRIu64 " device blocks over its quota of %d", BYSTANDER, on,
                 BYSTANDER_QUOTA_BLOCKS);
    assert_true(tu_check_pattern(e, a, L, TOKB, 4242, 0, 10 * BT));
    assert_ok(kvh_seq_free(e, a));
    assert_ok(tu_close(e));
}

/* ---- a quota against concurrent promotions ---- */

static uint64_t agent_device_blocks(kvh_engine *e, const kvh_seq *s, const uint64_t *len, int n)
{
    uint64_t on = 0;
    for (int j = 0; j < n; j++)
        for (uint64_t i = 0; i < (len[j] + BT - 1) / BT; i++) {
            kvh_block_info bi = tu_seq_binfo(e, s[j], i);
            on += bi.tier == KVH_TIER_DEVICE;
        }
    return on;
}

/* One agent with a quota of 3 device blocks; its ranges are sent down to
 * the host tier and brought back up (kvh_seq_migrate, kvh_seq_acquire)
 * through two migration workers, each call waiting for its moves. After
 * every call the agent must be within its quota: two promotions of its
 * blocks in flight at once must not both pass the quota check, also where
 * each must first evict another agent's block (the device tier full of
 * them), dropping the lock while it moves. */
static void quota_holds_under_concurrent_promotions(bool device_full_of_others)
{
    enum { NS = 3, QUOTA = 3, ROUNDS = 3000, SMALL_HOST = 8, OTHERS = DEVICE_BLOCKS + SMALL_HOST };
    kvh_config c =
        tu_cfg(L, H, D, BT, KVH_DTYPE_F16, DEVICE_BLOCKS, device_full_of_others ? SMALL_HOST : HOST_BLOCKS, 2);
    char dir[PATH_MAX];
    if (device_full_of_others) {
        /* Memory full of another agent's blocks: each room made for a
         * promotion moves one down, to disk in the end, the lock dropped. */
        dt_scratch("quota-evicting", dir, sizeof(dir));
        c.disk_path = dir;
        c.disk_bytes = 256ull << 20;
    }
    kvh_engine *e = tu_open_cfg(&c);
    assert_ok(kvh_agent_set_quota(e, 1, QUOTA * tu_block_bytes(e)));
    kvh_seq others = tu_seq_new(e, 2);
    if (device_full_of_others) {
        int32_t tok[OTHERS * BT];
        tu_iota(tok, OTHERS * BT, 90000);
        assert_ok(kvh_seq_append(e, others, tok, OTHERS * BT));
        tu_write_pattern(e, others, L, TOKB, 99, 0, OTHERS * BT);
    }
    tu_rng r = {tu_seed(0x9a07a)};
    kvh_seq s[NS];
    uint64_t len[NS];
    for (int j = 0; j < NS; j++) {
        s[j] = tu_seq_new(e, 1);
        len[j] = 2 * BT + tu_below(&r, 6 * BT);
        int32_t tok[8 * BT];
        tu_iota(tok, len[j], j * 1000);
        assert_ok(kvh_seq_append(e, s[j], tok, len[j]));
        tu_write_pattern(e, s[j], L, TOKB, (uint64_t)j, 0, len[j]);
    }
    assert_true(agent_device_blocks(e, s, len, NS) <= QUOTA);
    double end = tu_now() + 5.0;
    for (int round = 0; round < ROUNDS && tu_now() < end; round++) {
        int j = (int)tu_below(&r, NS);
        uint64_t first = tu_below(&r, len[j]), n = 1 + tu_below(&r, len[j] - first);
        const char *what;
        kvh_status st;
        if (tu_below(&r, 2)) {
            uint32_t tier = tu_below(&r, 2) ? KVH_TIER_DEVICE : KVH_TIER_HOST;
            what = tier == KVH_TIER_DEVICE ? "migrate up" : "migrate down";
            st = kvh_seq_migrate(e, s[j], first, n, tier, NULL);
        } else {
            what = "acquire";
            n = n > BT ? BT : n;
            st = kvh_seq_acquire(e, s[j], first, n, NULL);
            if (st == KVH_OK)
                assert_ok(kvh_seq_release(e, s[j], first, n));
        }
        if (st != KVH_OK && st != KVH_ERR_NOSPACE)
            fail_msg("%s: %s (%s)", what, kvh_status_name(st), kvh_last_error());
        uint64_t on = agent_device_blocks(e, s, len, NS);
        if (on > QUOTA)
            fail_msg("round %d, after %s of [%" PRIu64 ", +%" PRIu64 "): the agent holds %" PRIu64
                     " device blocks over its quota of %d",
                     round, what, first, n, on, QUOTA);
    }
    for (int j = 0; j < NS; j++)
        assert_true(tu_check_pattern(e, s[j], L, TOKB, (uint64_t)j, 0, len[j]));
    if (device_full_of_others)
        assert_true(tu_check_pattern(e, others, L, TOKB, 99, 0, OTHERS * BT));
    tu_close(e);
}

static void test_agent_quota_holds_under_concurrent_promotions(void **state)
{
    (void)state;
    quota_holds_under_concurrent_promotions(false);
    quota_holds_under_concurrent_promotions(true);
}

/* kvh.h: a quota counts whole blocks (rounded down, at least one), and a
 * lowered quota moves nothing until the agent's next device allocation,
 * which then brings it under the quota at once. */
static void test_quota_rounds_down_and_lowering_waits_for_allocation(void **state)
{
    (void)state;
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F16, DEVICE_BLOCKS, HOST_BLOCKS, 0);
    kvh_engine *e = tu_open_cfg(&c);
    uint64_t bb = tu_block_bytes(e);
    assert_ok(kvh_agent_set_quota(e, 1, 4 * bb + bb / 2));
    kvh_seq s = tu_seq_new(e, 1);
    uint64_t len = 6 * BT;
    int32_t tok[7 * BT];
    tu_iota(tok, 7 * BT, 500);
    assert_ok(kvh_seq_append(e, s, tok, len));
    tu_write_pattern(e, s, L, TOKB, 77, 0, len);
    assert_int_equal(agent_device_blocks(e, &s, &len, 1), 4);

    assert_ok(kvh_agent_set_quota(e, 1, 1));
    assert_int_equal(agent_device_blocks(e, &s, &len, 1), 4);
    assert_ok(kvh_seq_append(e, s, tok + len, BT));
    len += BT;
    tu_write_pattern(e, s, L, TOKB, 77, len - BT, BT);
    assert_int_equal(agent_device_blocks(e, &s, &len, 1), 1);
    assert_int_equal(tu_seq_binfo(e, s, len / BT - 1).tier, KVH_TIER_DEVICE);
    assert_true(tu_check_pattern(e, s, L, TOKB, 77, 0, len));

    /* The same for a promotion of one of its blocks. */
    assert_ok(kvh_agent_set_quota(e, 1, 3 * bb));
    assert_ok(kvh_seq_migrate(e, s, 0, 3 * BT, KVH_TIER_DEVICE, NULL));
    assert_int_equal(agent_device_blocks(e, &s, &len, 1), 3);
    assert_ok(kvh_agent_set_quota(e, 1, bb));
    assert_int_equal(agent_device_blocks(e, &s, &len, 1), 3);
    assert_int_equal(tu_seq_binfo(e, s, 4).tier, KVH_TIER_HOST);
    assert_ok(kvh_seq_migrate(e, s, 4 * BT, BT, KVH_TIER_DEVICE, NULL));
    assert_int_equal(agent_device_blocks(e, &s, &len, 1), 1);
    assert_int_equal(tu_seq_binfo(e, s, 4).tier, KVH_TIER_DEVICE);
    assert_true(tu_check_pattern(e, s, L, TOKB, 77, 0, len));
    assert_ok(kvh_seq_free(e, s));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_knobs_turned_under_load, tu_teardown),
        cmocka_unit_test_teardown(test_agent_quota_holds_under_concurrent_promotions, tu_teardown),
        cmocka_unit_test_teardown(test_quota_rounds_down_and_lowering_waits_for_allocation, tu_teardown),
    };
    return cmocka_run_group_tests_name("quota_hostile_mt", tests, NULL, NULL);
}
