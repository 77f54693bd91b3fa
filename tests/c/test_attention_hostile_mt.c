/* Attention, plans and views under concurrency, from kvh.h's promises
 * alone. Attention calls are @threads any: they may overlap appends,
 * truncations, copy-on-write rewrites, frees, forks and migrations (to the
 * host and disk tiers) of the very sequences they read. Whatever they
 * return must be a status the header lists for the situation, and every
 * KVH_OK must carry the numbers of a plain double-precision softmax
 * attention over the sequence as it was at some moment of the call (the
 * exact moment when nothing changed it meanwhile). Every sequence of a
 * slot holds one content stream at every position, so any length the
 * sequence had has a reference. No crash, no sanitizer report. */
#include <math.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "test_util.h"
#include "disk_test_util.h"
#include "mt_util.h"

/* f32, head_dim 64, 16 tokens: one head's K of a block is a 4 KiB page. */
enum { L = 2, H = 2, D = 64, BT = 16, QH = 2 * H, MAXT = 128, ROW = QH * D };

static const double TOL = 1e-4;

/* k/64 with |k| <= 128: exact in f32. */
static float kv_val(uint64_t stream, uint32_t layer, uint64_t pos, uint32_t h, int kv, uint32_t d)
{
    tu_rng r = {stream * 0x100000001b3ull ^ ((uint64_t)layer << 52) ^ (pos << 20) ^ ((uint64_t)h << 12) ^
                ((uint64_t)kv << 10) ^ d};
    tu_next(&r);
    return (float)((int64_t)tu_below(&r, 257) - 128) / 64.0f;
}

/* Appends n tokens at pos (unless append is false) and writes their K/V
 * of stream in layers [0, layers). */
static kvh_status put_layers(kvh_engine *e, kvh_seq s, uint64_t stream, uint64_t pos, size_t n, bool append,
                             uint32_t layers)
{
    if (append) {
        int32_t tok[MAXT];
        for (size_t i = 0; i < n; i++)
            tok[i] = (int32_t)((stream * 7919u + pos + i) & 0x3fffffff);
        kvh_status st = kvh_seq_append(e, s, tok, n);
        if (st != KVH_OK)
            return st;
    }
    float *k = malloc(n * H * D * sizeof(float)), *v = malloc(n * H * D * sizeof(float));
    if (!k || !v) {
        free(k);
        free(v);
        return KVH_ERR_NOMEM;
    }
    kvh_status st = KVH_OK;
    for (uint32_t l = 0; l < layers && st == KVH_OK; l++) {
        for (size_t t = 0; t < n; t++)
            for (uint32_t h = 0; h < H; h++)
                for (uint32_t d = 0; d < D; d++) {
                    k[(t * H + h) * D + d] = kv_val(stream, l, pos + t, h, 0, d);
                    v[(t * H + h) * D + d] = kv_val(stream, l, pos + t, h, 1, d);
                }
        st = kvh_seq_write_kv(e, s, l, pos, n, k, v);
    }
    free(k);
    free(v);
    return st;
}

static kvh_status put_stream(kvh_engine *e, kvh_seq s, uint64_t stream, uint64_t pos, size_t n, bool append)
{
    return put_layers(e, s, stream, pos, n, append, L);
}

/* Whether tokens [0, n) of layer l read back as stream (every byte). */
static bool holds_stream(kvh_engine *e, kvh_seq s, uint64_t stream, uint64_t n, char *msg, size_t len)
{
    float *k = malloc(n * H * D * sizeof(float)), *v = malloc(n * H * D * sizeof(float));
    bool ok = k && v;
    for (uint32_t l = 0; l < L && ok; l++) {
        kvh_status st = kvh_seq_read_kv(e, s, l, 0, n, k, v);
        if (st != KVH_OK) {
            snprintf(msg, len, "read_kv: %s: %s", kvh_status_name(st), kvh_last_error());
            ok = false;
            break;
        }
        for (uint64_t t = 0; t < n && ok; t++)
            for (uint32_t h = 0; h < H && ok; h++)
                for (uint32_t d = 0; d < D && ok; d++)
                    if (k[(t * H + h) * D + d] != kv_val(stream, l, t, h, 0, d) ||
                        v[(t * H + h) * D + d] != kv_val(stream, l, t, h, 1, d)) {
                        snprintf(msg, len, "layer %u token %" PRIu64 " head %u dim %u holds wrong K/V", l, t, h, d);
                        ok = false;
                    }
    }
    free(k);
    free(v);
    return ok;
}

/* Decode outputs of query q over the first n tokens of stream in layer,
 * for every n in [1, MAXT]: ref[n * ROW + h * D + d]; q head h reads kv
 * head h / (QH / H). */
static double *ref_prefixes(uint64_t stream, uint32_t layer, const float *q, float scale)
{
    double *ref = tu_alloc((MAXT + 1) * ROW * sizeof(double));
    double s[MAXT];
    for (uint32_t h = 0; h < QH; h++) {
        uint32_t kh = h / (QH / H);
        for (uint32_t t = 0; t < MAXT; t++) {
            double dot = 0;
            for (uint32_t d = 0; d < D; d++)
                dot += (double)q[h * D + d] * kv_val(stream, layer, t, kh, 0, d);
            s[t] = dot * scale;
        }
        for (uint32_t n = 1; n <= MAXT; n++) {
            double mx = -INFINITY, sum = 0, w[MAXT];
            for (uint32_t t = 0; t < n; t++)
                mx = s[t] > mx ? s[t] : mx;
            for (uint32_t t = 0; t < n; t++)
                sum += (w[t] = exp(s[t] - mx));
            for (uint32_t d = 0; d < D; d++) {
                double acc = 0;
                for (uint32_t t = 0; t < n; t++)
                    acc += w[t] * kv_val(stream, layer, t, kh, 1, d);
                ref[(size_t)n * ROW + h * D + d] = acc / sum;
            }
        }
    }
    return ref;
}

/* Largest difference of one output row from the reference of n tokens. */
static double row_err(const double *ref, uint32_t n, const float *row)
{
    double worst = 0;
    for (uint32_t i = 0; i < ROW; i++) {
        double diff = fabs((double)row[i] - ref[(size_t)n * ROW + i]);
        if (!(diff <= worst))
            worst = diff; /* NaN sticks */
    }
    return worst;
}

/* The length n in [lo, hi] for which rows [0, rows) of out are the
 * prefill outputs of a sequence of n tokens whose last `rows` tokens are
 * the queries (each row's query is the same q); 0 when none is. */
static uint32_t match_len(const double *ref, const float *out, uint32_t rows, uint32_t lo, uint32_t hi, double *best)
{
    *best = INFINITY;
    if (lo < rows)
        lo = rows;
    for (uint32_t n = lo; n <= hi && n <= MAXT; n++) {
        double worst = 0;
        for (uint32_t j = 0; j < rows && worst <= TOL; j++) {
            double e = row_err(ref, n - rows + j + 1, out + (size_t)j * ROW);
            worst = e > worst || isnan(e) ? e : worst;
        }
        if (worst < *best)
            *best = worst;
        if (worst <= TOL)
            return n;
    }
    return 0;
}

static kvh_attention_params attn_params(uint32_t chunk, uint32_t window)
{
    kvh_attention_params p;
    kvh_attention_params_init(&p, sizeof(p));
    p.num_q_heads = QH;
    p.threads = 1;
    p.stream_chunk_blocks = chunk;
    p.stream_window_blocks = window;
    return p;
}

static void make_q(tu_rng *r, float *q)
{
    for (size_t i = 0; i < ROW; i++)
        q[i] = (float)((int64_t)tu_below(r, 257) - 128) / 256.0f;
}

static const float SCALE = 0.125f; /* 1/sqrt(64), the default */

/* ================================================================== */
/* Attention on sequences that are grown by forks, truncated,         */
/* rewritten, migrated and freed meanwhile                            */
/* ================================================================== */

enum { NSLOT = 4, OWNERS = 2, READERS = 2 };

/* A slot publishes one sequence at a time, all of whose positions hold
 * the slot's stream. version is odd while its owner changes the sequence
 * (truncation) or replaces it (publish and free): a reader that sees the
 * same even version before and after its call raced with neither. */
typedef struct slot {
    _Atomic uint64_t seq;
    atomic_uint version;
    uint64_t stream;
    uint32_t layer;
    float q[ROW];
    double *ref;
} slot;

static slot S[NSLOT];
static atomic_int stop_flag;
static atomic_long n_ok, n_exact, n_refused, mode_ok[5];

static void publish(kvh_engine *e, slot *k, kvh_seq next, mt_worker *w)
{
    kvh_seq old = {atomic_load(&k->seq)};
    atomic_fetch_add(&k->version, 1);
    atomic_store(&k->seq, next.id);
    kvh_status st = kvh_seq_free(e, old);
    if (st != KVH_OK)
        mt_report(w, "free of a replaced sequence: %s: %s", kvh_status_name(st), kvh_last_error());
    atomic_fetch_add(&k->version, 1);
}

static void *slot_owner(void *arg)
{
    mt_worker *w = arg;
    kvh_engine *e = w->e;
    tu_rng r = {tu_seed(0x0a7e0000) + (uint64_t)w->t};
    while (!atomic_load(&stop_flag)) {
        slot *k = &S[(size_t)w->t + OWNERS * tu_below(&r, NSLOT / OWNERS)];
        kvh_seq cur = {atomic_load(&k->seq)};
        uint64_t len = 0;
        kvh_status st = kvh_seq_length(e, cur, &len);
        if (st != KVH_OK) {
            mt_report(w, "length of a published sequence: %s: %s", kvh_status_name(st), kvh_last_error());
            break;
        }
        uint64_t op = tu_below(&r, 10);
        if (op < 4 && len < MAXT) { /* grow a fork, publish it, free the old one */
            kvh_seq child;
            if ((st = kvh_seq_fork(e, cur, 0, &child)) != KVH_OK) {
                mt_report(w, "fork: %s: %s", kvh_status_name(st), kvh_last_error());
                break;
            }
            uint64_t n = 1 + tu_below(&r, MAXT - len < 24 ? MAXT - len : 24);
            st = put_stream(e, child, k->stream, len, n, true);
            if (st == KVH_OK)
                publish(e, k, child, w);
            else if (st == KVH_ERR_NOSPACE)
                kvh_seq_free(e, child);
            else
                mt_report(w, "grow a fork: %s: %s", kvh_status_name(st), kvh_last_error());
        } else if (op < 6) { /* truncate in place */
            uint64_t to = 1 + tu_below(&r, len);
            atomic_fetch_add(&k->version, 1);
            st = kvh_seq_truncate(e, cur, to);
            atomic_fetch_add(&k->version, 1);
            if (st != KVH_OK && st != KVH_ERR_NOSPACE)
                mt_report(w, "truncate: %s: %s", kvh_status_name(st), kvh_last_error());
        } else if (op == 6) { /* a fresh sequence */
            kvh_seq fresh;
            if ((st = kvh_seq_create(e, 0, &fresh)) != KVH_OK) {
                mt_report(w, "create: %s", kvh_status_name(st));
                break;
            }
            st = put_stream(e, fresh, k->stream, 0, 1 + tu_below(&r, MAXT), true);
            if (st == KVH_OK)
                publish(e, k, fresh, w);
            else if (st == KVH_ERR_NOSPACE)
                kvh_seq_free(e, fresh);
            else
                mt_report(w, "fresh sequence: %s: %s", kvh_status_name(st), kvh_last_error());
        } else if (op >= 9) { /* hold the whole sequence in the device tier for a moment */
            st = kvh_seq_acquire(e, cur, 0, len, NULL);
            if (st == KVH_OK) {
                sched_yield();
                if ((st = kvh_seq_release(e, cur, 0, len)) != KVH_OK)
                    mt_report(w, "release: %s: %s", kvh_status_name(st), kvh_last_error());
            } else if (st != KVH_ERR_NOSPACE) {
                mt_report(w, "acquire: %s: %s", kvh_status_name(st), kvh_last_error());
            }
        }
    }
    return NULL;
}

/* Checks one attention result; mode names the call for messages. */
static void judge(mt_worker *w, slot *k, const char *mode, kvh_status st, bool streaming, bool still, uint64_t len1,
                  const float *out, uint32_t rows)
{
    if (st == KVH_OK) {
        atomic_fetch_add(&n_ok, 1);
        double best;
        uint32_t lo = still ? (uint32_t)len1 : 1, hi = still ? (uint32_t)len1 : MAXT;
        uint32_t n = match_len(k->ref, out, rows, lo, hi, &best);
        if (!n)
            mt_report(w,
                      "%s (%u rows) of slot %d returned KVH_OK with wrong numbers: no length in [%u, %u] matches "
                      "(closest off by %g)%s",
                      mode, rows, (int)(k - S), lo, hi, best, still ? "; the sequence did not change meanwhile" : "");
        else if (still)
            atomic_fetch_add(&n_exact, 1);
        return;
    }
    atomic_fetch_add(&n_refused, 1);
    bool ok = (st == KVH_ERR_BAD_HANDLE && !still) || (st == KVH_ERR_RANGE && !still) ||
              (st == KVH_ERR_NOT_RESIDENT && !streaming) ||
              (streaming && (st == KVH_ERR_NOSPACE || st == KVH_ERR_BUSY));
    if (!ok)
        mt_report(w, "%s of slot %d: %s (%s)%s", mode, (int)(k - S), kvh_status_name(st), kvh_last_error(),
                  still ? "; the sequence did not change meanwhile" : "");
}

static void *reader(void *arg)
{
    mt_worker *w = arg;
    kvh_engine *e = w->e;
    tu_rng r = {tu_seed(0x0a7e1000) + (uint64_t)w->t};
    float *q = malloc(MAXT * ROW * sizeof(float)), *out = malloc(MAXT * ROW * sizeof(float));
    while (q && out && !atomic_load(&stop_flag)) {
        slot *k = &S[tu_below(&r, NSLOT)];
        unsigned v1 = atomic_load(&k->version);
        kvh_seq s = {atomic_load(&k->seq)};
        uint64_t len1 = 0;
        if (kvh_seq_length(e, s, &len1) != KVH_OK)
            continue; /* replaced and freed just now */
        uint64_t mode = tu_below(&r, 5);
        bool streaming = mode == 0 || mode == 2;
        uint32_t chunk = 1 + (uint32_t)tu_below(&r, 2);
        kvh_attention_params p = streaming ? attn_params(chunk, chunk + (uint32_t)tu_below(&r, 3)) : attn_params(0, 0);
        uint32_t rows = 1;
        kvh_status st;
        const char *name;
        if (mode <= 1) {
            name = streaming ? "streamed decode" : "decode";
            st = kvh_attention_decode(e, k->layer, &s, 1, k->q, out, &p);
        } else if (mode == 2) {
            name = "streamed prefill";
            rows = 1 + (uint32_t)tu_below(&r, len1 < 6 ? len1 : 6);
            for (uint32_t j = 0; j < rows; j++)
                memcpy(q + (size_t)j * ROW, k->q, sizeof(k->q));
            st = kvh_attention_prefill(e, k->layer, &s, &rows, 1, q, out, &p);
        } else {
            name = mode == 3 ? "plan run" : "plan run after a pause";
            kvh_attention_plan *pl = NULL;
            st = kvh_attention_plan_create(e, k->layer, &s, NULL, 1, &p, &pl);
            if (st == KVH_OK) {
                if (mode == 4)
                    for (int i = 0; i < 20; i++)
                        sched_yield();
                kvh_status rs = kvh_attention_run(e, pl, k->q, out, NULL);
                kvh_status ds = kvh_attention_plan_destroy(e, pl);
                if (ds != KVH_OK)
                    mt_report(w, "plan destroy: %s: %s", kvh_status_name(ds), kvh_last_error());
                if (rs != KVH_OK) {
                    mt_report(w, "plan run: %s: %s", kvh_status_name(rs), kvh_last_error());
                    continue;
                }
                /* Got through, whatever changed meanwhile: on a loaded
                 * machine the owners change the sequence during nearly
                 * every pause. */
                atomic_fetch_add(&mode_ok[mode], 1);
                /* a truncation or free under the plan leaves its output
                 * undefined: judged only when nothing changed */
                if (atomic_load(&k->version) != v1)
                    continue;
            } else {
                name = "plan create";
            }
        }
        unsigned v2 = atomic_load(&k->version);
        judge(w, k, name, st, streaming, v1 == v2 && !(v1 & 1), len1, out, rows);
        if (st == KVH_OK && mode < 3) /* plan runs were counted above */
            atomic_fetch_add(&mode_ok[mode], 1);
    }
    free(q);
    free(out);
    return NULL;
}

static void *migrator(void *arg)
{
    mt_worker *w = arg;
    kvh_engine *e = w->e;
    tu_rng r = {tu_seed(0x0a7e2000)};
    while (!atomic_load(&stop_flag)) {
        slot *k = &S[tu_below(&r, NSLOT)];
        kvh_seq s = {atomic_load(&k->seq)};
        uint64_t len = 0;
        if (kvh_seq_length(e, s, &len) != KVH_OK || len == 0)
            continue;
        uint64_t first = tu_below(&r, len), n = 1 + tu_below(&r, len - first);
        uint32_t tier = (uint32_t)tu_below(&r, 3);
        kvh_status st;
        if (tu_below(&r, 4) == 0) {
            st = kvh_prefetch(e, s, first, n, (int32_t)tu_below(&r, 100), NULL);
        } else if (tu_below(&r, 2)) {
            kvh_fence f = {0};
            st = kvh_seq_migrate(e, s, first, n, tier, &f);
            if (st == KVH_OK) {
                st = kvh_fence_wait(e, f, UINT64_MAX);
                kvh_fence_free(e, f);
            }
        } else {
            st = kvh_seq_migrate(e, s, first, n, tier, NULL);
        }
        if (st != KVH_OK && st != KVH_ERR_BAD_HANDLE && st != KVH_ERR_RANGE && st != KVH_ERR_NOSPACE)
            mt_report(w, "migrate %" PRIu64 "+%" PRIu64 " to tier %u: %s: %s", first, n, tier, kvh_status_name(st),
                      kvh_last_error());
    }
    return NULL;
}

static void *race_role(void *arg)
{
    mt_worker *w = arg;
    if (w->t < OWNERS)
        return slot_owner(arg);
    if (w->t < OWNERS + READERS)
        return reader(arg);
    return migrator(arg);
}

/* Slots of sequences, then owners, readers and a migrator for seconds. */
static void run_race(const char *name, double seconds)
{
    char dir[512];
    dt_scratch(name, dir, sizeof(dir));
    dt_geo g = {L, H, D, BT, KVH_DTYPE_F32};
    kvh_config cfg = dt_cfg(g, dir, 32, 24, 256, 2);
    cfg.copy_moves = 1; /* host blocks are copies: streaming stages them */
    kvh_engine *e = dt_open_a(&cfg);
    tu_rng r = {tu_seed(0x0a7e3000)};
    for (int i = 0; i < NSLOT; i++) {
        slot *k = &S[i];
        k->stream = 100 + (uint64_t)i;
        k->layer = (uint32_t)i & 1;
        atomic_store(&k->version, 0);
        make_q(&r, k->q);
        k->ref = ref_prefixes(k->stream, k->layer, k->q, SCALE);
        kvh_seq s = tu_seq_new(e, 0);
        assert_ok(put_stream(e, s, k->stream, 0, 8 + tu_below(&r, 40), true));
        atomic_store(&k->seq, s.id);
    }
    atomic_store(&stop_flag, 0);
    atomic_store(&n_ok, 0);
    atomic_store(&n_exact, 0);
    atomic_store(&n_refused, 0);
    for (int i = 0; i < 5; i++)
        atomic_store(&mode_ok[i], 0);
    mt_worker w[OWNERS + READERS + 1];
    mt_run_for(e, OWNERS + READERS + 1, race_role, w, seconds, &stop_flag);
    print_message("%ld calls returned KVH_OK (%ld on an unchanged sequence), %ld were refused\n", atomic_load(&n_ok),
                  atomic_load(&n_exact), atomic_load(&n_refused));
    assert_true(atomic_load(&n_exact) > 0);
    for (int i = 0; i < 5; i++) /* every kind of call got through sometimes */
        if (atomic_load(&mode_ok[i]) == 0)
            fail_msg("no call of kind %d returned KVH_OK", i);
    /* every published sequence still holds its stream, byte for byte */
    for (int i = 0; i < NSLOT; i++) {
        kvh_seq s = {atomic_load(&S[i].seq)};
        char msg[256] = "";
        uint64_t len = tu_seq_len(e, s);
        if (!holds_stream(e, s, S[i].stream, len, msg, sizeof(msg)))
            fail_msg("slot %d: %s", i, msg);
        assert_ok(kvh_seq_free(e, s));
    }
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).pinned_blocks, 0);
}

static void test_attention_races_append_truncate_migrate_free(void **state)
{
    (void)state;
    run_race("attn_hostile_mt_race", 4.0);
}

/* ================================================================== */
/* One plan run by several threads into different outputs, destroyed  */
/* while they run, while its sequences are forked, rewritten and      */
/* migrated                                                            */
/* ================================================================== */

enum { PLAN_LEN = 70, RUNNERS = 3 };

static kvh_attention_plan *_Atomic shared_plan;
static kvh_seq plan_base, plan_child;
static double *plan_ref[2]; /* base's and child's streams: the same here */
static float plan_q[2][ROW];

static void *plan_runner(void *arg)
{
    mt_worker *w = arg;
    kvh_engine *e = w->e;
    float q[2 * ROW], out[2 * ROW];
    memcpy(q, plan_q[0], sizeof(plan_q[0]));
    memcpy(q + ROW, plan_q[1], sizeof(plan_q[1]));
    bool gone = false;
    while (!atomic_load(&stop_flag)) {
        kvh_attention_plan *pl = atomic_load(&shared_plan);
        kvh_attention_plan *own = NULL;
        if (gone) { /* the shared plan is gone: plans of one's own over the
                     * base, which nobody changes */
            kvh_seq both[] = {plan_base, plan_base};
            kvh_attention_params p = attn_params(0, 0);
            kvh_status st = kvh_attention_plan_create(e, 0, both, NULL, 2, &p, &own);
            if (st == KVH_ERR_NOT_RESIDENT)
                continue;
            if (st != KVH_OK) {
                mt_report(w, "plan create: %s: %s", kvh_status_name(st), kvh_last_error());
                break;
            }
            pl = own;
        }
        memset(out, 0xff, sizeof(out));
        kvh_status st = kvh_attention_run(e, pl, q, out, NULL);
        if (own)
            kvh_attention_plan_destroy(e, own);
        if (st == KVH_ERR_BAD_HANDLE && !own) {
            gone = true;
            continue;
        }
        if (st != KVH_OK) {
            mt_report(w, "run: %s: %s", kvh_status_name(st), kvh_last_error());
            break;
        }
        atomic_fetch_add(&n_ok, 1);
        for (int i = 0; i < 2; i++) {
            double err = row_err(plan_ref[i], PLAN_LEN, out + i * ROW); /* q rows differ, the stream is one */
            if (!(err <= TOL)) {
                mt_report(w, "%s plan's row %d is off by %g", own ? "an own" : "the shared", i, err);
                break;
            }
        }
    }
    return NULL;
}

/* The child is rewritten with the same content (copy-on-write of shared
 * and published blocks), grown and cut back to the planned length; both
 * are migrated. The plans keep reading blocks of the same content. */
static void *plan_disturber(void *arg)
{
    mt_worker *w = arg;
    kvh_engine *e = w->e;
    tu_rng r = {tu_seed(0x0a7e4000)};
    while (!atomic_load(&stop_flag)) {
        uint64_t op = tu_below(&r, 4);
        kvh_status st;
        if (op == 0) {
            uint64_t first = tu_below(&r, PLAN_LEN);
            st = put_stream(e, plan_child, 7, first, 1 + tu_below(&r, PLAN_LEN - first), false);
        } else if (op == 1) {
            st = put_stream(e, plan_child, 7, PLAN_LEN, 1 + tu_below(&r, 30), true);
            if (st == KVH_OK)
                st = kvh_seq_truncate(e, plan_child, PLAN_LEN);
        } else {
            kvh_seq s = op == 2 ? plan_base : plan_child;
            st = kvh_seq_migrate(e, s, 0, PLAN_LEN, (uint32_t)tu_below(&r, 3), NULL);
        }
        if (st != KVH_OK && st != KVH_ERR_NOSPACE)
            mt_report(w, "disturb op %" PRIu64 ": %s: %s", op, kvh_status_name(st), kvh_last_error());
    }
    return NULL;
}

static void *plan_destroyer(void *arg)
{
    mt_worker *w = arg;
    struct timespec t = {0, 700 * 1000 * 1000};
    nanosleep(&t, NULL);
    kvh_status st = kvh_attention_plan_destroy(w->e, atomic_load(&shared_plan));
    if (st != KVH_OK)
        mt_report(w, "destroy under runs: %s: %s", kvh_status_name(st), kvh_last_error());
    return NULL;
}

static void *plan_role(void *arg)
{
    mt_worker *w = arg;
    if (w->t < RUNNERS)
        return plan_runner(arg);
    if (w->t == RUNNERS)
        return plan_disturber(arg);
    return plan_destroyer(arg);
}

static void test_shared_plan_runs_while_destroyed_and_disturbed(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("attn_hostile_mt_plan", dir, sizeof(dir));
    dt_geo g = {L, H, D, BT, KVH_DTYPE_F32};
    kvh_config cfg = dt_cfg(g, dir, 24, 24, 128, 2);
    kvh_engine *e = dt_open_a(&cfg);
    tu_rng r = {tu_seed(0x0a7e5000)};
    plan_base = tu_seq_new(e, 0);
    assert_ok(put_stream(e, plan_base, 7, 0, PLAN_LEN, true));
    assert_ok(kvh_seq_fork(e, plan_base, 1, &plan_child));
    for (int i = 0; i < 2; i++) {
        make_q(&r, plan_q[i]);
        plan_ref[i] = ref_prefixes(7, 0, plan_q[i], SCALE);
    }
    kvh_seq both[] = {plan_base, plan_child};
    kvh_attention_params p = attn_params(0, 0);
    kvh_attention_plan *pl = NULL;
    assert_ok(kvh_attention_plan_create(e, 0, both, NULL, 2, &p, &pl));
    atomic_store(&shared_plan, pl);
    atomic_store(&stop_flag, 0);
    atomic_store(&n_ok, 0);
    mt_worker w[RUNNERS + 2];
    mt_run_for(e, RUNNERS + 2, plan_role, w, 2.0, &stop_flag);
    assert_true(atomic_load(&n_ok) > 0);
    float out[ROW];
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_attention_run(e, pl, plan_q[0], out, NULL));
    char msg[256] = "";
    if (!holds_stream(e, plan_base, 7, PLAN_LEN, msg, sizeof(msg)) ||
        !holds_stream(e, plan_child, 7, PLAN_LEN, msg, sizeof(msg)))
        fail_msg("%s", msg);
}

/* ================================================================== */
/* A view per thread over forks of one sequence, grown, truncated and  */
/* rewritten by its thread while another migrates everything           */
/* ================================================================== */

enum { VIEWERS = 3, BASE_LEN = 40 };

typedef struct vmodel {
    uint32_t len;
    float k[MAXT][H][D], v[MAXT][H][D]; /* layer 0 */
} vmodel;

static _Atomic uint64_t view_seq[VIEWERS];
static kvh_vmap *view_vm[VIEWERS];
static kvh_seq view_base;
static float view_q[ROW];
static double *view_ref;

static void vmodel_put(vmodel *m, uint64_t stream, uint64_t pos)
{
    for (uint32_t h = 0; h < H; h++)
        for (uint32_t d = 0; d < D; d++) {
            m->k[pos][h][d] = kv_val(stream, 0, pos, h, 0, d);
            m->v[pos][h][d] = kv_val(stream, 0, pos, h, 1, d);
        }
}

static double vmodel_err(const vmodel *m, const float *q, uint32_t end, const float *row)
{
    double worst = 0, s[MAXT];
    for (uint32_t h = 0; h < QH; h++) {
        uint32_t kh = h / (QH / H);
        double mx = -INFINITY, sum = 0;
        for (uint32_t t = 0; t < end; t++) {
            double dot = 0;
            for (uint32_t d = 0; d < D; d++)
                dot += (double)q[h * D + d] * m->k[t][kh][d];
            s[t] = dot * SCALE;
            mx = s[t] > mx ? s[t] : mx;
        }
        for (uint32_t t = 0; t < end; t++)
            sum += (s[t] = exp(s[t] - mx));
        for (uint32_t d = 0; d < D; d++) {
            double acc = 0;
            for (uint32_t t = 0; t < end; t++)
                acc += s[t] * m->v[t][kh][d];
            double diff = fabs(acc / sum - row[h * D + d]);
            if (!(diff <= worst))
                worst = diff;
        }
    }
    return worst;
}

/* Block handles of s, to tell whether its block table changed. */
static size_t table_of(kvh_engine *e, kvh_seq s, uint64_t len, kvh_block *out)
{
    size_t n = (size_t)((len + BT - 1) / BT);
    if (n && kvh_seq_blocks(e, s, 0, n, out) != KVH_OK)
        return SIZE_MAX;
    return n;
}

static void *viewer(void *arg)
{
    mt_worker *w = arg;
    kvh_engine *e = w->e;
    tu_rng r = {tu_seed(0x0a7e6000) + (uint64_t)w->t};
    uint64_t own = 300 + (uint64_t)w->t;
    vmodel *m = calloc(1, sizeof(*m));
    kvh_seq s = {atomic_load(&view_seq[w->t])};
    kvh_vmap *v = view_vm[w->t];
    kvh_status st;
    if (!m)
        return NULL;
    m->len = BASE_LEN;
    for (uint32_t t = 0; t < BASE_LEN; t++)
        vmodel_put(m, 9, t);
    float q[8 * ROW], out[8 * ROW];
    kvh_block before[MAXT / BT + 1], after[MAXT / BT + 1];
    while (!atomic_load(&stop_flag)) {
        size_t nb = table_of(e, s, m->len, before);
        uint64_t op = tu_below(&r, 3);
        if (op == 0 && m->len < MAXT) {
            uint64_t n = 1 + tu_below(&r, MAXT - m->len < 20 ? MAXT - m->len : 20);
            st = put_stream(e, s, own, m->len, n, true);
            if (st == KVH_ERR_NOSPACE) {
                uint64_t len = 0;
                kvh_seq_length(e, s, &len);
                if (len > m->len) /* appended, K/V not all written: cut back */
                    kvh_seq_truncate(e, s, m->len);
                continue;
            }
            for (uint64_t t = m->len; st == KVH_OK && t < m->len + n; t++)
                vmodel_put(m, own, t);
            if (st == KVH_OK)
                m->len += (uint32_t)n;
        } else if (op == 1 && m->len > 1) {
            uint32_t to = 1 + (uint32_t)tu_below(&r, m->len);
            st = kvh_seq_truncate(e, s, to);
            if (st == KVH_OK)
                m->len = to;
        } else {
            /* rewrite one token with new values (a copy when shared or
             * published) */
            uint64_t pos = tu_below(&r, m->len), stream = own + 1000 * (1 + tu_below(&r, 50));
            st = put_layers(e, s, stream, pos, 1, false, 1); /* the viewed layer only: all or nothing */
            if (st == KVH_OK)
                vmodel_put(m, stream, pos);
        }
        if (st == KVH_ERR_NOSPACE)
            continue;
        if (st != KVH_OK) {
            mt_report(w, "op %" PRIu64 ": %s: %s", op, kvh_status_name(st), kvh_last_error());
            break;
        }
        size_t na = table_of(e, s, m->len, after);
        bool changed = na != nb || memcmp(before, after, na * sizeof(kvh_block)) != 0;
        make_q(&r, q);
        if (changed) {
            st = kvh_attention_decode_vmap(e, &v, 1, q, out, NULL);
            if (st != KVH_ERR_BAD_HANDLE) {
                mt_report(w, "decode over a stale view: %s, expected KVH_ERR_BAD_HANDLE", kvh_status_name(st));
                break;
            }
        }
        /* refresh: the view's new blocks must be in the device tier */
        for (int tries = 0;; tries++) {
            st = kvh_vmap_refresh(e, v, NULL);
            if (st != KVH_ERR_NOT_RESIDENT || tries == 20)
                break;
            if (kvh_seq_acquire(e, s, 0, m->len, NULL) == KVH_OK) {
                st = kvh_vmap_refresh(e, v, NULL);
                kvh_seq_release(e, s, 0, m->len);
                break;
            }
        }
        if (st == KVH_ERR_NOT_RESIDENT || st == KVH_ERR_NOSPACE)
            continue;
        if (st != KVH_OK) {
            mt_report(w, "refresh: %s: %s", kvh_status_name(st), kvh_last_error());
            break;
        }
        kvh_attention_params p = attn_params(0, 0);
        if ((st = kvh_attention_decode_vmap(e, &v, 1, q, out, &p)) != KVH_OK) {
            mt_report(w, "decode over a fresh view: %s: %s", kvh_status_name(st), kvh_last_error());
            break;
        }
        double err = vmodel_err(m, q, m->len, out);
        if (!(err <= TOL)) {
            mt_report(w, "decode over the view of %u tokens is off by %g", m->len, err);
            break;
        }
        uint32_t ql = 1 + (uint32_t)tu_below(&r, m->len < 8 ? m->len : 8);
        for (uint32_t j = 1; j < ql; j++)
            memcpy(q + (size_t)j * ROW, q, ROW * sizeof(float));
        if ((st = kvh_attention_prefill_vmap(e, &v, &ql, 1, q, out, &p)) != KVH_OK) {
            mt_report(w, "prefill over a fresh view: %s: %s", kvh_status_name(st), kvh_last_error());
            break;
        }
        for (uint32_t j = 0; j < ql; j++) {
            err = vmodel_err(m, q, m->len - ql + j + 1, out + (size_t)j * ROW);
            if (!(err <= TOL)) {
                mt_report(w, "prefill row %u of %u over the view is off by %g", j, ql, err);
                break;
            }
        }
        atomic_fetch_add(&n_ok, 1);
    }
    kvh_status rs = kvh_vmap_release(e, v);
    if (rs != KVH_OK)
        mt_report(w, "release: %s", kvh_status_name(rs));
    free(m);
    return NULL;
}

/* Migrates the shared base and the viewers' forks anywhere, and runs
 * streamed attention over the base (whose K/V nobody changes). */
static void *view_migrator(void *arg)
{
    mt_worker *w = arg;
    kvh_engine *e = w->e;
    tu_rng r = {tu_seed(0x0a7e7000)};
    float out[ROW];
    while (!atomic_load(&stop_flag)) {
        uint64_t who = tu_below(&r, VIEWERS + 2);
        kvh_status st;
        if (who == VIEWERS + 1) {
            kvh_attention_params p = attn_params(1, 2);
            st = kvh_attention_decode(e, 0, &view_base, 1, view_q, out, &p);
            if (st == KVH_OK) {
                double err = row_err(view_ref, BASE_LEN, out);
                if (!(err <= TOL))
                    mt_report(w, "streamed decode over the base is off by %g", err);
            } else if (st != KVH_ERR_NOSPACE && st != KVH_ERR_BUSY) {
                mt_report(w, "streamed decode over the base: %s: %s", kvh_status_name(st), kvh_last_error());
            }
            continue;
        }
        kvh_seq s = who == VIEWERS ? view_base : (kvh_seq){atomic_load(&view_seq[who])};
        uint64_t len = 0;
        if (kvh_seq_length(e, s, &len) != KVH_OK || len == 0)
            continue;
        st = kvh_seq_migrate(e, s, 0, len, (uint32_t)tu_below(&r, 3), NULL);
        if (st != KVH_OK && st != KVH_ERR_RANGE && st != KVH_ERR_NOSPACE)
            mt_report(w, "migrate: %s: %s", kvh_status_name(st), kvh_last_error());
    }
    return NULL;
}

static void *view_role(void *arg)
{
    mt_worker *w = arg;
    return w->t < VIEWERS ? viewer(arg) : view_migrator(arg);
}

static void test_views_per_thread_over_forks_while_migrating(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("attn_hostile_mt_view", dir, sizeof(dir));
    dt_geo g = {L, H, D, BT, KVH_DTYPE_F32};
    kvh_config cfg = dt_cfg(g, dir, 40, 32, 256, 2);
    cfg.vmap = 1;
    kvh_engine *e = dt_open_a(&cfg);
    view_base = tu_seq_new(e, 0);
    assert_ok(put_stream(e, view_base, 9, 0, BASE_LEN, true));
    for (int i = 0; i < VIEWERS; i++) {
        kvh_seq c;
        assert_ok(kvh_seq_fork(e, view_base, (uint32_t)i, &c));
        atomic_store(&view_seq[i], c.id);
        assert_ok(kvh_seq_vmap(e, c, 0, MAXT, &view_vm[i]));
    }
    tu_rng r = {tu_seed(0x0a7e8000)};
    make_q(&r, view_q);
    view_ref = ref_prefixes(9, 0, view_q, SCALE);
    atomic_store(&stop_flag, 0);
    atomic_store(&n_ok, 0);
    mt_worker w[VIEWERS + 1];
    mt_run_for(e, VIEWERS + 1, view_role, w, 3.0, &stop_flag);
    assert_true(atomic_load(&n_ok) > 0);
    char msg[256] = "";
    if (!holds_stream(e, view_base, 9, BASE_LEN, msg, sizeof(msg)))
        fail_msg("base: %s", msg);
    for (int i = 0; i < VIEWERS; i++)
        assert_ok(kvh_seq_free(e, (kvh_seq){atomic_load(&view_seq[i])}));
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).pinned_blocks, 0);
}

static int teardown(void **state)
{
    dt_teardown(state);
    return tu_teardown(state);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_attention_races_append_truncate_migrate_free, teardown),
        cmocka_unit_test_teardown(test_shared_plan_runs_while_destroyed_and_disturbed, teardown),
        cmocka_unit_test_teardown(test_views_per_thread_over_forks_while_migrating, teardown),
    };
    return cmocka_run_group_tests_name("attention_hostile_mt", tests, NULL, NULL);
}
