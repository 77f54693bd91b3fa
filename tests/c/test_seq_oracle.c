/* Oracle test of sequences through the public API only: a plain model of
 * every sequence (tokens, and the K/V bytes each position must read back)
 * runs in lockstep with an engine under a seeded random mix of appends,
 * partial and overlapping K/V writes, forks (copy-on-write), truncates,
 * prefix matches, frees, acquire/release, pins, migrations with fences,
 * prefetch and hints, persists, and closes + reopens of the same disk
 * store, on tiers small enough that blocks keep visiting every tier.
 *
 * Prefix matches cannot be predicted exactly (what stays cached depends
 * on eviction), so the model keeps, per exact token prefix, every content
 * a block of that prefix had while it was full and fully written (the only
 * state a block is published in). A block attached by a match must carry
 * one of them; a persisted prefix must come back after a reopen as long
 * as the disk never had to give room back.
 *
 * After every step: every live sequence's length, tokens and every written
 * K/V byte (never-written cells must read KVH_ERR_RANGE), the counters'
 * invariants, and that misuse (stale handles, out-of-range calls, bad
 * struct sizes) returns the documented status and changes nothing.
 *
 * KVH_TEST_SEED=<n> runs only that seed of each variant; KVH_ORACLE_TRACE=1
 * prints every step. */
#include "disk_test_util.h"

#include <math.h>

enum { L = 2, H = 1, BT = 4, MAXSEQ = 8, MAXLEN = 40, NB = MAXLEN / BT, NPROMPT = 3, PLEN = 24, MAXTOKB = 128 };
enum { MAXDEAD = 16, MAXPERSIST = 64 };

typedef struct variant {
    const char *name;
    uint32_t dtype, dim, codec, threads;
    uint64_t dev, host, disk_slots; /* disk_slots 0: no disk tier */
    int seeds, steps;
} variant;

typedef struct mseq {
    int live;
    kvh_seq h;
    uint32_t len;
    int prompt; /* prompt its tokens follow, -1 none */
    int32_t tok[MAXLEN];
    uint8_t k[L][MAXLEN][MAXTOKB], v[L][MAXLEN][MAXTOKB];
    uint8_t w[L][MAXLEN];
    uint32_t pins[NB];
    int held; /* one acquire hold kept across steps: [hold_first, +hold_n) */
    uint64_t hold_first, hold_n;
} mseq;

/* Content a full, fully written block had under an exact token prefix. */
typedef struct cand {
    uint32_t nblk; /* prefix = tok[0, nblk * BT) */
    uint64_t ph;
    int32_t tok[MAXLEN];
    uint8_t *kv; /* [L][2][BT][tokb] */
} cand;

typedef struct persisted {
    uint32_t nfull;
    int32_t tok[MAXLEN];
} persisted;

typedef struct oracle {
    const variant *var;
    kvh_config cfg;
    char dir[PATH_MAX];
    kvh_engine *e;
    uint64_t seed;
    int step;
    const char *opname;
    dt_rng r;
    size_t tokb;
    mseq s[MAXSEQ];
    cand *cs;
    size_t ncs, capcs;
    persisted per[MAXPERSIST];
    int nper;
    kvh_seq dead[MAXDEAD];
    int ndead;
    int32_t prompts[NPROMPT][PLEN];
    kvh_stats prev;
    int disk_gave_back; /* the disk may have dropped a persisted block */
    long n_nospace, n_match_blocks, n_reopen_blocks, n_persist, n_reopens;
} oracle;

static oracle *g_o;

/* What a variant's runs exercised, printed so that a run that stopped
 * reaching the disk or matching anything shows. */
static struct {
    long match_blocks, reopen_blocks, persists, reopens, nospace, cands, cow, to_disk, from_disk, disk_hits;
} g_sum;
static int g_trace;

#define OFAIL(...)                                                                                                     \
    do {                                                                                                               \
        print_error("seq_oracle %s seed %" PRIu64 " step %d (%s): ", g_o->var->name, g_o->seed, g_o->step,             \
                    g_o->opname);                                                                                      \
        print_error(__VA_ARGS__);                                                                                      \
        print_error("\n    last error: \"%s\"; rerun with KVH_TEST_SEED=%" PRIu64 "\n", kvh_last_error(), g_o->seed);  \
        fail();                                                                                                        \
    } while (0)
#define OCHECK(cond, ...)                                                                                              \
    do {                                                                                                               \
        if (!(cond))                                                                                                   \
            OFAIL(__VA_ARGS__);                                                                                        \
    } while (0)
#define OEXPECT(want, expr)                                                                                            \
    do {                                                                                                               \
        kvh_status o_st_ = (expr);                                                                                     \
        OCHECK(o_st_ == (want), "%s -> %s, expected %s", #expr, kvh_status_name(o_st_), kvh_status_name(want));        \
    } while (0)
#define OOK(expr) OEXPECT(KVH_OK, expr)
#define TRACE(...)                                                                                                     \
    do {                                                                                                               \
        if (g_trace)                                                                                                   \
            fprintf(stderr, __VA_ARGS__);                                                                              \
    } while (0)

static uint32_t esize(const oracle *o) { return o->var->dtype == KVH_DTYPE_F32 ? 4 : 2; }

/* ---- K/V values and their comparison ---- */

/* Raw random bytes where the engine must store them exactly (every f16
 * pattern, NaNs included); finite floats where a lossy codec is on. */
static void fill_row(oracle *o, uint8_t *dst)
{
    if (o->var->codec == KVH_CODEC_NONE) {
        for (size_t i = 0; i < o->tokb; i++)
            dst[i] = (uint8_t)dt_next(&o->r);
        return;
    }
    float *f = (float *)dst;
    float scale = (float)(1 + dt_below(&o->r, 1000)) / 10.0f;
    for (size_t i = 0; i < o->tokb / 4; i++)
        f[i] = ((float)(int)dt_below(&o->r, 20001) - 10000.0f) / 10000.0f * scale;
}

/* The codec's per-element error bound for the vector `ref` (one token of
 * one head), with `mult` for a value that may itself have been through
 * the codec once already. */
static int row_close(const oracle *o, const uint8_t *ref, const uint8_t *got, double mult)
{
    if (o->var->codec == KVH_CODEC_NONE)
        return memcmp(ref, got, o->tokb) == 0;
    const float *a = (const float *)ref, *b = (const float *)got;
    uint32_t dim = o->var->dim;
    for (uint32_t h = 0; h < H; h++) {
        uint32_t group = o->var->codec == KVH_CODEC_INT8 ? dim : o->var->codec == KVH_CODEC_Q4_G32 ? 32 : 64;
        for (uint32_t g0 = 0; g0 < dim; g0 += group) {
            double mx = 0, lo = INFINITY, hi = -INFINITY;
            for (uint32_t i = g0; i < g0 + group; i++) {
                double x = a[h * dim + i];
                mx = fmax(mx, fabs(x));
                lo = fmin(lo, x);
                hi = fmax(hi, x);
            }
            double bound = o->var->codec == KVH_CODEC_INT8 ? mx / 254 : (hi - lo) / 30;
            bound = bound * mult * 1.001 + 1e-30;
            for (uint32_t i = g0; i < g0 + group; i++)
                if (!(fabs((double)a[h * dim + i] - (double)b[h * dim + i]) <= bound))
                    return 0;
        }
    }
    return 1;
}

/* ---- candidates ---- */

static uint64_t prefix_hash(const int32_t *tok, uint32_t ntok)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (uint32_t i = 0; i < ntok; i++)
        h = (h ^ (uint32_t)tok[i]) * 0x100000001b3ull;
    return h;
}

static size_t blk_bytes(const oracle *o) { return (size_t)L * 2 * BT * o->tokb; }

static void block_content(const oracle *o, const mseq *s, uint32_t b, uint8_t *out)
{
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t t = 0; t < BT; t++) {
            memcpy(out + ((l * 2 + 0) * BT + t) * o->tokb, s->k[l][b * BT + t], o->tokb);
            memcpy(out + ((l * 2 + 1) * BT + t) * o->tokb, s->v[l][b * BT + t], o->tokb);
        }
}

static int content_close(const oracle *o, const uint8_t *ref, const uint8_t *got, double mult)
{
    for (size_t r = 0; r < (size_t)L * 2 * BT; r++)
        if (!row_close(o, ref + r * o->tokb, got + r * o->tokb, mult))
            return 0;
    return 1;
}

static int cand_find(const oracle *o, const int32_t *tok, uint32_t nblk, const uint8_t *content, double mult)
{
    uint64_t ph = prefix_hash(tok, nblk * BT);
    for (size_t i = 0; i < o->ncs; i++) {
        const cand *c = &o->cs[i];
        if (c->nblk == nblk && c->ph == ph && memcmp(c->tok, tok, nblk * BT * sizeof(int32_t)) == 0 &&
            content_close(o, c->kv, content, mult))
            return 1;
    }
    return 0;
}

static int block_complete(const mseq *s, uint32_t b)
{
    if ((b + 1) * BT > s->len)
        return 0;
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t t = b * BT; t < (b + 1) * BT; t++)
            if (!s->w[l][t])
                return 0;
    return 1;
}

/* Records the content of every full, fully written block of s. */
static void note_complete(oracle *o, const mseq *s)
{
    uint8_t *buf = malloc(blk_bytes(o));
    assert_non_null(buf);
    for (uint32_t b = 0; b < s->len / BT; b++) {
        if (!block_complete(s, b))
            continue;
        block_content(o, s, b, buf);
        if (o->var->codec == KVH_CODEC_NONE ? cand_find(o, s->tok, b + 1, buf, 1) : 0)
            continue;
        if (o->ncs == o->capcs) {
            o->capcs = o->capcs ? o->capcs * 2 : 256;
            o->cs = realloc(o->cs, o->capcs * sizeof(cand));
            assert_non_null(o->cs);
        }
        cand *c = &o->cs[o->ncs++];
        c->nblk = b + 1;
        memset(c->tok, 0, sizeof(c->tok));
        memcpy(c->tok, s->tok, (b + 1) * BT * sizeof(int32_t));
        c->ph = prefix_hash(s->tok, (b + 1) * BT);
        c->kv = malloc(blk_bytes(o));
        assert_non_null(c->kv);
        memcpy(c->kv, buf, blk_bytes(o));
    }
    free(buf);
}

/* ---- checks ---- */

static int holds_or_pins(const oracle *o)
{
    for (int i = 0; i < MAXSEQ; i++) {
        if (!o->s[i].live)
            continue;
        if (o->s[i].held)
            return 1;
        for (int b = 0; b < NB; b++)
            if (o->s[i].pins[b])
                return 1;
    }
    return 0;
}

static void verify_seq(oracle *o, int i)
{
    mseq *s = &o->s[i];
    uint64_t len = 0;
    OOK(kvh_seq_length(o->e, s->h, &len));
    OCHECK(len == s->len, "seq %d: length %" PRIu64 ", model %u", i, len, s->len);
    int32_t tok[MAXLEN + 1];
    OOK(kvh_seq_tokens(o->e, s->h, 0, s->len, tok));
    OCHECK(memcmp(tok, s->tok, s->len * sizeof(int32_t)) == 0, "seq %d: tokens differ", i);
    OEXPECT(KVH_ERR_RANGE, kvh_seq_tokens(o->e, s->h, 0, s->len + 1, tok));
    static uint8_t k[MAXLEN * MAXTOKB], v[MAXLEN * MAXTOKB];
    for (uint32_t l = 0; l < L; l++) {
        for (uint32_t t = 0; t < s->len;) {
            uint32_t e = t;
            while (e < s->len && s->w[l][e] == s->w[l][t])
                e++;
            if (s->w[l][t]) {
                kvh_status st = kvh_seq_read_kv(o->e, s->h, l, t, e - t, k, v);
                if (st == KVH_ERR_NOSPACE && holds_or_pins(o)) {
                    o->n_nospace++;
                    t = e;
                    continue;
                }
                OCHECK(st == KVH_OK, "seq %d: read layer %u [%u, %u): %s", i, l, t, e, kvh_status_name(st));
                for (uint32_t u = t; u < e; u++) {
                    int kb = !row_close(o, s->k[l][u], k + (u - t) * o->tokb, 1);
                    int vb = !row_close(o, s->v[l][u], v + (u - t) * o->tokb, 1);
                    OCHECK(!kb && !vb, "seq %d (len %u) layer %u token %u: %s differs from the model", i, s->len, l, u,
                           kb ? "K" : "V");
                }
            } else {
                for (uint32_t u = t; u < e; u++) {
                    kvh_status st = kvh_seq_read_kv(o->e, s->h, l, u, 1, k, v);
                    OCHECK(st == KVH_ERR_RANGE, "seq %d layer %u token %u never written: read gave %s", i, l, u,
                           kvh_status_name(st));
                }
            }
            t = e;
        }
    }
    OEXPECT(KVH_ERR_RANGE, kvh_seq_read_kv(o->e, s->h, 0, s->len, 1, k, v));
    OEXPECT(KVH_ERR_RANGE, kvh_seq_read_kv(o->e, s->h, L, 0, s->len ? 1 : 0, k, v));
}

static void check_stats(oracle *o)
{
    kvh_stats st = {.struct_size = sizeof(st)};
    OOK(kvh_engine_stats(o->e, &st));
    const uint64_t *a = (const uint64_t *)((const char *)&st + 8), *p = (const uint64_t *)((const char *)&o->prev + 8);
    size_t n = (sizeof(st) - 8) / 8;
    for (size_t i = 0; i < n; i++) {
        OCHECK(a[i] >= p[i], "kvh_stats field %zu went down: %" PRIu64 " -> %" PRIu64, i, p[i], a[i]);
        OCHECK(a[i] < (1ull << 62) || i == offsetof(kvh_stats, acquire_stall_ns) / 8 - 1,
               "kvh_stats field %zu wrapped: %" PRIu64, i, a[i]);
    }
    if (o->var->threads == 0)
        OCHECK(st.lookups == st.hits_device + st.hits_host + st.hits_disk,
               "lookups %" PRIu64 " != hits %" PRIu64 " + %" PRIu64 " + %" PRIu64, st.lookups, st.hits_device,
               st.hits_host, st.hits_disk);
    OCHECK(st.prefix_hit_blocks_host + st.prefix_hit_blocks_disk <= st.prefix_hit_blocks,
           "prefix hits by tier %" PRIu64 " + %" PRIu64 " > %" PRIu64, st.prefix_hit_blocks_host,
           st.prefix_hit_blocks_disk, st.prefix_hit_blocks);
    OCHECK(st.prefix_hit_tokens == st.prefix_hit_blocks * BT, "prefix_hit_tokens %" PRIu64 " != %" PRIu64 " blocks",
           st.prefix_hit_tokens, st.prefix_hit_blocks);
    OCHECK(st.blocks_freed <= st.blocks_allocated, "freed %" PRIu64 " > allocated %" PRIu64, st.blocks_freed,
           st.blocks_allocated);
    OCHECK(st.prefetch_useful + st.prefetch_wasted <= st.prefetch_issued || o->var->threads,
           "prefetch useful %" PRIu64 " + wasted %" PRIu64 " > issued %" PRIu64, st.prefetch_useful, st.prefetch_wasted,
           st.prefetch_issued);
    if (st.disk_copies_given_back)
        o->disk_gave_back = 1;
    o->prev = st;
    for (uint32_t t = 0; t < KVH_TIER_COUNT; t++) {
        kvh_tier_info ti = {.struct_size = sizeof(ti)};
        OOK(kvh_tier_info_get(o->e, t, &ti));
        OCHECK(ti.used_blocks <= ti.capacity_blocks, "tier %u: used %" PRIu64 " > capacity %" PRIu64, t, ti.used_blocks,
               ti.capacity_blocks);
        OCHECK(ti.used_bytes == ti.used_blocks * ti.block_bytes, "tier %u: used_bytes", t);
        OCHECK(ti.pinned_blocks <= ti.used_blocks, "tier %u: pinned %" PRIu64 " > used %" PRIu64, t, ti.pinned_blocks,
               ti.used_blocks);
        if (t == KVH_TIER_DISK && ti.capacity_blocks && ti.used_blocks + 2 >= ti.capacity_blocks)
            o->disk_gave_back = 1;
    }
}

/* Stale handles of freed sequences and of closed engines stay refused. */
static void check_dead(oracle *o)
{
    if (!o->ndead)
        return;
    kvh_seq h = o->dead[dt_below(&o->r, (uint64_t)o->ndead)];
    uint64_t n;
    int32_t t = 1;
    uint8_t k[MAXTOKB] = {0};
    kvh_seq child;
    size_t m;
    switch (dt_below(&o->r, 8)) {
    case 0:
        OEXPECT(KVH_ERR_BAD_HANDLE, kvh_seq_length(o->e, h, &n));
        break;
    case 1:
        OEXPECT(KVH_ERR_BAD_HANDLE, kvh_seq_append(o->e, h, &t, 1));
        break;
    case 2:
        OEXPECT(KVH_ERR_BAD_HANDLE, kvh_seq_free(o->e, h));
        break;
    case 3:
        OEXPECT(KVH_ERR_BAD_HANDLE, kvh_seq_fork(o->e, h, 0, &child));
        break;
    case 4:
        OEXPECT(KVH_ERR_BAD_HANDLE, kvh_seq_write_kv(o->e, h, 0, 0, 1, k, k));
        break;
    case 5:
        OEXPECT(KVH_ERR_BAD_HANDLE, kvh_seq_truncate(o->e, h, 0));
        break;
    case 6:
        OEXPECT(KVH_ERR_BAD_HANDLE, kvh_seq_match_prefix(o->e, h, &t, 1, &m));
        break;
    default:
        OEXPECT(KVH_ERR_BAD_HANDLE, kvh_seq_persist(o->e, h));
        break;
    }
}

static void verify_all(oracle *o)
{
    for (int i = 0; i < MAXSEQ; i++)
        if (o->s[i].live)
            verify_seq(o, i);
    check_stats(o);
    check_dead(o);
}

/* ---- helpers ---- */

static int pick_live(oracle *o)
{
    int idx[MAXSEQ], n = 0;
    for (int i = 0; i < MAXSEQ; i++)
        if (o->s[i].live)
            idx[n++] = i;
    return n ? idx[dt_below(&o->r, (uint64_t)n)] : -1;
}

static int free_slot(oracle *o)
{
    for (int i = 0; i < MAXSEQ; i++)
        if (!o->s[i].live)
            return i;
    return -1;
}

static void add_dead(oracle *o, kvh_seq h)
{
    if (o->ndead < MAXDEAD)
        o->dead[o->ndead++] = h;
    else
        o->dead[dt_below(&o->r, MAXDEAD)] = h;
}

static int32_t rand_token(oracle *o) { return 7 + (int32_t)dt_below(&o->r, 2); }

static void next_tokens(oracle *o, mseq *s, int32_t *out, uint32_t n)
{
    int on = s->prompt >= 0 && s->len <= PLEN && memcmp(s->tok, o->prompts[s->prompt], s->len * sizeof(int32_t)) == 0;
    for (uint32_t j = 0; j < n; j++) {
        uint32_t pos = s->len + j;
        out[j] = on && pos < PLEN ? o->prompts[s->prompt][pos] : rand_token(o);
    }
}

static void wait_fence(oracle *o, kvh_fence f, kvh_status *st)
{
    kvh_status w = kvh_fence_wait(o->e, f, UINT64_MAX);
    int32_t done = 0;
    kvh_status p = kvh_fence_poll(o->e, f, &done);
    OCHECK(done == 1 && p == w, "fence poll after wait: done %d, %s vs %s", done, kvh_status_name(p),
           kvh_status_name(w));
    OOK(kvh_fence_free(o->e, f));
    OEXPECT(KVH_ERR_BAD_HANDLE, kvh_fence_free(o->e, f));
    OEXPECT(KVH_ERR_BAD_HANDLE, kvh_fence_wait(o->e, f, 0));
    *st = w;
}

static void release_hold(oracle *o, mseq *s)
{
    if (!s->held)
        return;
    OOK(kvh_seq_release(o->e, s->h, s->hold_first, s->hold_n));
    s->held = 0;
}

static void drop_pins_from(mseq *s, uint32_t first_block)
{
    for (uint32_t b = first_block; b < NB; b++)
        s->pins[b] = 0;
}

/* ---- operations ---- */

static int op_create(oracle *o)
{
    int i = free_slot(o);
    if (i < 0)
        return -1;
    mseq *s = &o->s[i];
    memset(s, 0, sizeof(*s));
    uint32_t agent = (uint32_t)dt_below(&o->r, 3);
    if (dt_below(&o->r, 2)) {
        OOK(kvh_seq_create(o->e, agent, &s->h));
    } else {
        kvh_seq_params p;
        OOK(kvh_seq_params_init(&p, sizeof(p)));
        p.agent = agent;
        if (dt_below(&o->r, 2))
            p.token_budget = 1 + dt_below(&o->r, MAXLEN);
        OOK(kvh_seq_create_ex(o->e, &p, &s->h));
    }
    s->live = 1;
    s->prompt = (int)dt_below(&o->r, NPROMPT + 1) - 1;
    return i;
}

static void op_append(oracle *o, int i)
{
    mseq *s = &o->s[i];
    uint32_t n = 1 + (uint32_t)dt_below(&o->r, 6);
    if (s->len + n > MAXLEN)
        n = MAXLEN - s->len;
    if (!n)
        return;
    int32_t t[8];
    next_tokens(o, s, t, n);
    kvh_status st = kvh_seq_append(o->e, s->h, t, n);
    if (st == KVH_ERR_NOSPACE) {
        o->n_nospace++;
        return;
    }
    OCHECK(st == KVH_OK, "append %u to seq %d: %s", n, i, kvh_status_name(st));
    memcpy(s->tok + s->len, t, n * sizeof(int32_t));
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t u = s->len; u < s->len + n; u++)
            s->w[l][u] = 0;
    s->len += n;
    note_complete(o, s);
}

static void do_write(oracle *o, int i, uint32_t l, uint32_t pos, uint32_t n)
{
    mseq *s = &o->s[i];
    static uint8_t k[MAXLEN * MAXTOKB], v[MAXLEN * MAXTOKB];
    for (uint32_t u = 0; u < n; u++) {
        fill_row(o, k + u * o->tokb);
        fill_row(o, v + u * o->tokb);
    }
    kvh_status st = kvh_seq_write_kv(o->e, s->h, l, pos, n, k, v);
    TRACE("  write seq %d layer %u [%u, +%u) len %u -> %s\n", i, l, pos, n, s->len, kvh_status_name(st));
    if (pos + n > s->len) {
        OCHECK(st == KVH_ERR_RANGE, "write past the end: %s", kvh_status_name(st));
        return;
    }
    if (st == KVH_ERR_NOSPACE) {
        o->n_nospace++;
        return;
    }
    OCHECK(st == KVH_OK, "write seq %d layer %u [%u, +%u): %s", i, l, pos, n, kvh_status_name(st));
    for (uint32_t u = 0; u < n; u++) {
        memcpy(s->k[l][pos + u], k + u * o->tokb, o->tokb);
        memcpy(s->v[l][pos + u], v + u * o->tokb, o->tokb);
        s->w[l][pos + u] = 1;
    }
    note_complete(o, s);
}

static void op_write(oracle *o, int i)
{
    mseq *s = &o->s[i];
    if (!s->len)
        return;
    uint32_t l = (uint32_t)dt_below(&o->r, L);
    uint32_t pos = (uint32_t)dt_below(&o->r, s->len);
    uint32_t n = 1 + (uint32_t)dt_below(&o->r, dt_below(&o->r, 2) ? BT : 2 * BT + 2);
    if (pos + n > s->len && dt_below(&o->r, 4))
        n = s->len - pos;
    do_write(o, i, l, pos, n);
}

/* Writes every cell never written, so that full blocks get published. */
static void op_fill(oracle *o, int i)
{
    mseq *s = &o->s[i];
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t t = 0; t < s->len;) {
            if (s->w[l][t]) {
                t++;
                continue;
            }
            uint32_t e = t;
            while (e < s->len && !s->w[l][e])
                e++;
            do_write(o, i, l, t, e - t);
            t = e;
        }
}

static void op_fork(oracle *o, int i)
{
    int j = free_slot(o);
    if (j < 0)
        return;
    kvh_seq child;
    OOK(kvh_seq_fork(o->e, o->s[i].h, (uint32_t)dt_below(&o->r, 3), &child));
    o->s[j] = o->s[i];
    o->s[j].h = child;
    o->s[j].held = 0;
    memset(o->s[j].pins, 0, sizeof(o->s[j].pins));
    /* A fork starts without pins: unpinning through it must be refused. */
    if (o->s[i].len && o->s[i].pins[0])
        OEXPECT(KVH_ERR_INVALID_ARG, kvh_seq_pin(o->e, child, 0, 1, 0));
}

static void op_truncate(oracle *o, int i)
{
    mseq *s = &o->s[i];
    uint64_t to;
    switch (dt_below(&o->r, 5)) {
    case 0:
        to = 0;
        break;
    case 1:
        to = s->len / BT * BT;
        break; /* a block edge */
    case 2:
        to = s->len ? dt_below(&o->r, s->len) : 0;
        break; /* anywhere */
    case 3:
        to = s->len + 1 + dt_below(&o->r, 3);
        break; /* past the end */
    default:
        to = s->len > BT ? s->len - 1 - dt_below(&o->r, 2) : 0; /* mid-block */
    }
    release_hold(o, s);
    kvh_status st = kvh_seq_truncate(o->e, s->h, to);
    TRACE("  truncate seq %d %u -> %" PRIu64 ": %s\n", i, s->len, to, kvh_status_name(st));
    if (to > s->len) {
        OCHECK(st == KVH_ERR_RANGE, "truncate past the end: %s", kvh_status_name(st));
        return;
    }
    if (st == KVH_ERR_NOSPACE) {
        o->n_nospace++;
        return;
    }
    OCHECK(st == KVH_OK, "truncate seq %d to %" PRIu64 ": %s", i, to, kvh_status_name(st));
    s->len = (uint32_t)to;
    for (uint32_t l = 0; l < L; l++)
        memset(&s->w[l][to], 0, MAXLEN - to);
    drop_pins_from(s, (uint32_t)((to + BT - 1) / BT));
    if (!to && dt_below(&o->r, 2))
        s->prompt = (int)dt_below(&o->r, NPROMPT + 1) - 1;
}

static void op_free(oracle *o, int i)
{
    mseq *s = &o->s[i];
    if (dt_below(&o->r, 2))
        release_hold(o, s); /* else freed with its hold and pins */
    OOK(kvh_seq_free(o->e, s->h));
    add_dead(o, s->h);
    s->live = 0;
}

/* Matches tokens into an empty sequence and checks every attached block
 * against the candidates; returns the blocks matched. */
static uint32_t do_match(oracle *o, int i, const int32_t *t, uint32_t n)
{
    mseq *s = &o->s[i];
    size_t m = 12345;
    OOK(kvh_seq_match_prefix(o->e, s->h, t, n, &m));
    TRACE("  match seq %d n %u -> %zu\n", i, n, m);
    OCHECK(m % BT == 0 && m <= n, "match_prefix matched %zu of %u tokens", m, n);
    uint64_t len = 0;
    OOK(kvh_seq_length(o->e, s->h, &len));
    OCHECK(len == m, "after matching %zu tokens the length is %" PRIu64, m, len);
    memcpy(s->tok, t, m * sizeof(int32_t));
    s->len = (uint32_t)m;
    static uint8_t k[MAXLEN * MAXTOKB], v[MAXLEN * MAXTOKB];
    for (uint32_t l = 0; l < L && m; l++) {
        kvh_status st = kvh_seq_read_kv(o->e, s->h, l, 0, m, k, v);
        if (st == KVH_ERR_NOSPACE && holds_or_pins(o)) {
            /* Blocks found on disk with memory pinned full: unreadable
             * for now, so not checkable; give them back. */
            OOK(kvh_seq_truncate(o->e, s->h, 0));
            s->len = 0;
            memset(s->w, 0, sizeof(s->w));
            o->n_nospace++;
            return 0;
        }
        OCHECK(st == KVH_OK, "read of %zu matched tokens, layer %u: %s", m, l, kvh_status_name(st));
        for (uint32_t u = 0; u < m; u++) {
            memcpy(s->k[l][u], k + u * o->tokb, o->tokb);
            memcpy(s->v[l][u], v + u * o->tokb, o->tokb);
            s->w[l][u] = 1;
        }
    }
    uint8_t *buf = malloc(blk_bytes(o));
    assert_non_null(buf);
    for (uint32_t b = 0; b < m / BT; b++) {
        block_content(o, s, b, buf);
        OCHECK(cand_find(o, t, b + 1, buf, 2),
               "match_prefix attached block %u whose K/V was never the content of a full block of that prefix", b);
    }
    free(buf);
    o->n_match_blocks += (long)(m / BT);
    return (uint32_t)(m / BT);
}

static void op_match(oracle *o)
{
    int i = -1;
    for (int j = 0; j < MAXSEQ && i < 0; j++)
        if (o->s[j].live && o->s[j].len == 0 && dt_below(&o->r, 2))
            i = j;
    if (i < 0 && (i = op_create(o)) < 0)
        return;
    int32_t t[MAXLEN];
    uint32_t n;
    int src = pick_live(o);
    switch (dt_below(&o->r, 3)) {
    case 0:
        if (src >= 0 && o->s[src].len) {
            n = o->s[src].len;
            memcpy(t, o->s[src].tok, n * sizeof(int32_t));
            break;
        }
        /* fall through */
    case 1: {
        int p = (int)dt_below(&o->r, NPROMPT);
        n = BT + (uint32_t)dt_below(&o->r, PLEN - BT + 1);
        memcpy(t, o->prompts[p], n * sizeof(int32_t));
        o->s[i].prompt = p;
        break;
    }
    default:
        n = 1 + (uint32_t)dt_below(&o->r, 3 * BT);
        for (uint32_t j = 0; j < n; j++)
            t[j] = rand_token(o);
    }
    uint32_t ext = (uint32_t)dt_below(&o->r, 3);
    for (uint32_t j = 0; j < ext && n < MAXLEN; j++)
        t[n++] = rand_token(o);
    do_match(o, i, t, n);
}

static void op_read(oracle *o, int i)
{
    mseq *s = &o->s[i];
    if (!s->len)
        return;
    uint32_t l = (uint32_t)dt_below(&o->r, L);
    uint32_t pos = (uint32_t)dt_below(&o->r, s->len);
    uint32_t n = 1 + (uint32_t)dt_below(&o->r, s->len - pos);
    int all = 1;
    for (uint32_t u = pos; u < pos + n; u++)
        all &= s->w[l][u];
    static uint8_t v[MAXLEN * MAXTOKB];
    kvh_status st = kvh_seq_read_kv(o->e, s->h, l, pos, n, NULL, v); /* K skipped */
    if (!all) {
        OCHECK(st == KVH_ERR_RANGE, "read over unwritten cells: %s", kvh_status_name(st));
        return;
    }
    if (st == KVH_ERR_NOSPACE && holds_or_pins(o))
        return;
    OCHECK(st == KVH_OK, "read: %s", kvh_status_name(st));
    for (uint32_t u = 0; u < n; u++)
        OCHECK(row_close(o, s->v[l][pos + u], v + u * o->tokb, 1), "V-only read token %u differs", pos + u);
}

static void op_acquire(oracle *o, int i)
{
    mseq *s = &o->s[i];
    if (!s->len)
        return;
    if (s->held) {
        /* A release of another range than the hold's is refused. */
        if ((s->hold_first + s->hold_n - 1) / BT < (s->len - 1) / BT)
            OEXPECT(KVH_ERR_INVALID_ARG, kvh_seq_release(o->e, s->h, s->len - 1, 1));
        release_hold(o, s);
        return;
    }
    uint64_t first = dt_below(&o->r, s->len);
    uint64_t n = 1 + dt_below(&o->r, (s->len - first) < 2 * BT ? s->len - first : 2 * BT);
    OEXPECT(KVH_ERR_RANGE, kvh_seq_acquire(o->e, s->h, first, s->len + 1 - first, NULL));
    OEXPECT(KVH_ERR_INVALID_ARG, kvh_seq_release(o->e, s->h, first, n));
    kvh_status st;
    if (dt_below(&o->r, 2)) {
        kvh_fence f = {0};
        st = kvh_seq_acquire(o->e, s->h, first, n, &f);
        if (st == KVH_OK) {
            wait_fence(o, f, &st);
            if (st != KVH_OK) /* the holds stay until released */
                OOK(kvh_seq_release(o->e, s->h, first, n));
        }
    } else {
        st = kvh_seq_acquire(o->e, s->h, first, n, NULL);
    }
    if (st == KVH_ERR_NOSPACE || st == KVH_ERR_BUSY) {
        o->n_nospace++;
        return;
    }
    OCHECK(st == KVH_OK, "acquire seq %d [%" PRIu64 ", +%" PRIu64 "): %s", i, first, n, kvh_status_name(st));
    /* Held blocks are in the device tier. */
    kvh_block b;
    kvh_block_info bi = {.struct_size = sizeof(bi)};
    OOK(kvh_seq_blocks(o->e, s->h, first / BT, 1, &b));
    OOK(kvh_block_info_get(o->e, b, &bi));
    OCHECK(bi.tier == KVH_TIER_DEVICE && bi.holds >= 1, "acquired block in tier %u with %u holds", bi.tier, bi.holds);
    if (dt_below(&o->r, 2)) {
        OOK(kvh_seq_release(o->e, s->h, first, n));
    } else {
        s->held = 1;
        s->hold_first = first;
        s->hold_n = n;
    }
}

static void op_pin(oracle *o, int i)
{
    mseq *s = &o->s[i];
    if (!s->len)
        return;
    uint32_t nb = (s->len + BT - 1) / BT;
    uint32_t b = (uint32_t)dt_below(&o->r, nb);
    uint64_t first = b * BT + dt_below(&o->r, BT), n = 1;
    if (first >= s->len)
        first = s->len - 1;
    int pinned_any = 0;
    for (int j = 0; j < MAXSEQ; j++)
        for (int x = 0; x < NB; x++)
            pinned_any += o->s[j].live && o->s[j].pins[x];
    if (s->pins[b] || pinned_any >= 2) {
        kvh_status st = kvh_seq_pin(o->e, s->h, first, n, 0);
        if (s->pins[b]) {
            OCHECK(st == KVH_OK, "unpin a pinned block: %s", kvh_status_name(st));
            s->pins[b]--;
        } else {
            OCHECK(st == KVH_ERR_INVALID_ARG, "unpin of a block this sequence never pinned: %s", kvh_status_name(st));
        }
        return;
    }
    OEXPECT(KVH_ERR_RANGE, kvh_seq_pin(o->e, s->h, first, s->len + 1 - first, 1));
    OOK(kvh_seq_pin(o->e, s->h, first, n, 1));
    s->pins[b]++;
    kvh_block h;
    kvh_block_info bi = {.struct_size = sizeof(bi)};
    OOK(kvh_seq_blocks(o->e, s->h, b, 1, &h));
    OOK(kvh_block_info_get(o->e, h, &bi));
    OCHECK(bi.pins >= 1, "pinned block reports %u pins", bi.pins);
}

static void op_migrate(oracle *o, int i)
{
    mseq *s = &o->s[i];
    if (!s->len)
        return;
    uint32_t tier = (uint32_t)dt_below(&o->r, o->var->disk_slots ? 3 : 2);
    uint64_t first = dt_below(&o->r, s->len), n = 1 + dt_below(&o->r, s->len - first);
    kvh_status st;
    int use_fence = (int)dt_below(&o->r, 2);
    kvh_fence f = {0};
    if (dt_below(&o->r, 2)) {
        OEXPECT(KVH_ERR_RANGE, kvh_seq_migrate(o->e, s->h, first, s->len + 1 - first, tier, NULL));
        st = kvh_seq_migrate(o->e, s->h, first, n, tier, use_fence ? &f : NULL);
    } else {
        kvh_block b[NB];
        uint64_t b0 = first / BT, b1 = (first + n - 1) / BT;
        OOK(kvh_seq_blocks(o->e, s->h, b0, b1 - b0 + 1, b));
        st = kvh_migrate(o->e, b, b1 - b0 + 1, tier, use_fence ? &f : NULL);
    }
    if (use_fence && st == KVH_OK)
        wait_fence(o, f, &st);
    TRACE("  migrate seq %d [%" PRIu64 ", +%" PRIu64 ") to %u: %s\n", i, first, n, tier, kvh_status_name(st));
    if (st == KVH_ERR_NOSPACE || st == KVH_ERR_BUSY) {
        o->n_nospace++;
        return;
    }
    OCHECK(st == KVH_OK, "migrate seq %d to tier %u: %s", i, tier, kvh_status_name(st));
}

static void op_hint(oracle *o, int i)
{
    mseq *s = &o->s[i];
    if (!s->len)
        return;
    uint64_t first = dt_below(&o->r, s->len), n = 1 + dt_below(&o->r, s->len - first);
    int32_t prio = (int32_t)dt_next(&o->r);
    if (dt_below(&o->r, 2)) {
        OEXPECT(KVH_ERR_RANGE, kvh_seq_hint(o->e, s->h, first, s->len + 1 - first, prio));
        OOK(kvh_seq_hint(o->e, s->h, first, n, prio));
        return;
    }
    OEXPECT(KVH_ERR_RANGE, kvh_prefetch(o->e, s->h, first, s->len + 1 - first, prio, NULL));
    kvh_fence f = {0};
    kvh_status st;
    if (dt_below(&o->r, 2)) {
        OOK(kvh_prefetch(o->e, s->h, first, n, prio, &f));
        wait_fence(o, f, &st);
        OCHECK(st == KVH_OK, "prefetch fence: %s (a promotion that cannot be made is skipped)", kvh_status_name(st));
    } else {
        OOK(kvh_prefetch(o->e, s->h, first, n, prio, NULL));
    }
}

static void op_persist(oracle *o, int i)
{
    mseq *s = &o->s[i];
    kvh_status st = kvh_seq_persist(o->e, s->h);
    TRACE("  persist seq %d len %u: %s\n", i, s->len, kvh_status_name(st));
    if (!o->var->disk_slots) {
        OCHECK(st == KVH_ERR_UNSUPPORTED, "persist without a disk tier: %s", kvh_status_name(st));
        return;
    }
    int unwritten = 0;
    for (uint32_t b = 0; b < s->len / BT; b++)
        unwritten |= !block_complete(s, b);
    if (unwritten) {
        OCHECK(st == KVH_ERR_INVALID_ARG, "persist with a full block never written: %s", kvh_status_name(st));
        return;
    }
    if (st == KVH_ERR_BUSY || st == KVH_ERR_NOSPACE) {
        o->n_nospace++;
        return;
    }
    OCHECK(st == KVH_OK, "persist seq %d: %s", i, kvh_status_name(st));
    o->n_persist++;
    if (s->len / BT == 0 || o->nper == MAXPERSIST)
        return;
    persisted *p = &o->per[o->nper++];
    p->nfull = s->len / BT;
    memcpy(p->tok, s->tok, p->nfull * BT * sizeof(int32_t));
}

/* Misuse that must be refused without changing anything. */
static void op_misuse(oracle *o, int i)
{
    mseq *s = &o->s[i];
    uint8_t k[MAXTOKB] = {0};
    int32_t t = 1;
    size_t m;
    switch (dt_below(&o->r, 9)) {
    case 0:
        OEXPECT(KVH_ERR_INVALID_ARG, kvh_seq_append(o->e, s->h, NULL, 1));
        break;
    case 1:
        if (s->len)
            OEXPECT(KVH_ERR_INVALID_ARG, kvh_seq_write_kv(o->e, s->h, 0, 0, 1, NULL, k));
        break;
    case 2:
        OEXPECT(KVH_ERR_RANGE, kvh_seq_write_kv(o->e, s->h, L, 0, s->len ? 1 : 0, k, k));
        break;
    case 3:
        if (s->len)
            OEXPECT(KVH_ERR_INVALID_ARG, kvh_seq_match_prefix(o->e, s->h, &t, 1, &m));
        break;
    case 4: {
        kvh_stats st;
        memset(&st, 0xa5, sizeof(st));
        st.struct_size = sizeof(st) + 8;
        OEXPECT(KVH_ERR_STRUCT_SIZE, kvh_engine_stats(o->e, &st));
        st.struct_size = 12;
        OEXPECT(KVH_ERR_STRUCT_SIZE, kvh_engine_stats(o->e, &st));
        st.struct_size = 16; /* an older, smaller struct: filled up to it only */
        OOK(kvh_engine_stats(o->e, &st));
        const uint8_t *b = (const uint8_t *)&st;
        for (size_t x = 16; x < sizeof(st); x++)
            OCHECK(b[x] == 0xa5, "kvh_engine_stats wrote byte %zu past a struct_size of 16", x);
        break;
    }
    case 5: {
        kvh_seq_params p;
        kvh_seq h = {0};
        OEXPECT(KVH_ERR_STRUCT_SIZE, kvh_seq_params_init(&p, 4));
        OOK(kvh_seq_params_init(&p, sizeof(p)));
        p.struct_size = 4;
        OEXPECT(KVH_ERR_STRUCT_SIZE, kvh_seq_create_ex(o->e, &p, &h));
        OCHECK(h.id == 0, "create_ex wrote its out-parameter on failure");
        break;
    }
    case 6: {
        /* Another generation of the same slot, and the same value with
         * another type tag (a block's): never a live sequence. */
        kvh_seq forged = {s->h.id ^ (1ull << (44 + dt_below(&o->r, 8)))};
        uint64_t n;
        kvh_status st = kvh_seq_length(o->e, forged, &n);
        OCHECK(st == KVH_ERR_BAD_HANDLE, "forged handle %#" PRIx64 " (live %#" PRIx64 "): %s", forged.id, s->h.id,
               kvh_status_name(st));
        kvh_block blk = {s->h.id};
        kvh_block_info bi = {.struct_size = sizeof(bi)};
        OEXPECT(KVH_ERR_BAD_HANDLE, kvh_block_info_get(o->e, blk, &bi));
        break;
    }
    case 7: {
        kvh_block_info bi = {.struct_size = 3};
        kvh_block b = {0};
        if (s->len) {
            OOK(kvh_seq_blocks(o->e, s->h, 0, 1, &b));
            OEXPECT(KVH_ERR_STRUCT_SIZE, kvh_block_info_get(o->e, b, &bi));
        }
        OEXPECT(KVH_ERR_RANGE, kvh_seq_blocks(o->e, s->h, (s->len + BT - 1) / BT, 1, &b));
        break;
    }
    default:
        OEXPECT(KVH_ERR_RANGE, kvh_seq_read_kv(o->e, s->h, 0, s->len, 1, k, NULL));
        break;
    }
}

/* Closes the engine and opens the same store again: every old handle is
 * refused, and each persisted prefix is matched back with its bytes. */
static void op_reopen(oracle *o)
{
    for (int i = 0; i < MAXSEQ; i++)
        if (o->s[i].live) {
            if (dt_below(&o->r, 2))
                OOK(kvh_seq_free(o->e, o->s[i].h));
            add_dead(o, o->s[i].h);
            o->s[i].live = 0;
        }
    kvh_status st = dt_close(o->e);
    o->e = NULL;
    OCHECK(st == KVH_OK, "close: %s", kvh_status_name(st));
    st = kvh_engine_open(&o->cfg, &o->e);
    OCHECK(st == KVH_OK, "reopen: %s", kvh_status_name(st));
    dt_track(o->e);
    memset(&o->prev, 0, sizeof(o->prev));
    o->n_reopens++;
    int strict = !o->disk_gave_back;
    for (int p = 0; p < o->nper; p++) {
        int i = free_slot(o);
        if (i < 0)
            break;
        memset(&o->s[i], 0, sizeof(o->s[i]));
        OOK(kvh_seq_create(o->e, 0, &o->s[i].h));
        o->s[i].live = 1;
        o->s[i].prompt = -1;
        persisted *pp = &o->per[dt_below(&o->r, (uint64_t)o->nper)];
        uint32_t got = do_match(o, i, pp->tok, pp->nfull * BT);
        o->n_reopen_blocks += got;
        if (strict)
            OCHECK(got >= pp->nfull,
                   "after reopen a persisted prefix of %u blocks matched only %u (the disk never had to give room)",
                   pp->nfull, got);
    }
    /* Persist records stay: their blocks are still on disk. */
}

static void oracle_free(oracle *o)
{
    for (size_t x = 0; x < o->ncs; x++)
        free(o->cs[x].kv);
    free(o->cs);
    free(o);
}

/* Also frees the model a failed run left behind. */
static int oracle_teardown(void **state)
{
    dt_teardown(state);
    if (g_o)
        oracle_free(g_o);
    g_o = NULL;
    return 0;
}

static void run_one(const variant *var, uint64_t seed)
{
    oracle *o = calloc(1, sizeof(*o));
    assert_non_null(o);
    g_o = o;
    o->var = var;
    o->seed = seed;
    o->opname = "open";
    o->r.s = seed * 0x9e3779b97f4a7c15ull + 1;
    o->tokb = (size_t)H * var->dim * esize(o);
    assert_true(o->tokb <= MAXTOKB);
    dt_geo g = {L, H, var->dim, BT, var->dtype};
    dt_scratch(var->name, o->dir, sizeof(o->dir));
    o->cfg = dt_cfg(g, o->dir, var->dev, var->host, var->disk_slots, var->threads);
    o->cfg.kv_codec = var->codec;
    /* Every victim order, and both ways of moving between the memory
     * tiers, see the same sequence semantics. */
    o->cfg.eviction_policy = (uint32_t)dt_below(&o->r, 3);
    o->cfg.copy_moves = (uint32_t)dt_below(&o->r, 2);
    if (var->disk_slots && dt_below(&o->r, 2))
        o->cfg.disk_flags = KVH_DISK_BUFFERED;
    OOK(kvh_engine_open(&o->cfg, &o->e));
    dt_track(o->e);
    for (int p = 0; p < NPROMPT; p++)
        for (int j = 0; j < PLEN; j++)
            o->prompts[p][j] = (int32_t)(100 * (p + 1) + (j < 2 * BT ? j : (j * 7 + p) % 5));
    /* prompts 0 and 1 share nothing; 2 shares tokens with 1 past block 2 */
    static const char *names[] = {"create", "append",  "write", "fill",    "read", "fork",    "truncate", "free",
                                  "match",  "acquire", "pin",   "migrate", "hint", "persist", "misuse",   "reopen"};
    static const int weight[] = {4, 16, 14, 8, 4, 5, 6, 3, 8, 5, 3, 6, 3, 3, 3, 1};
    int wsum = 0;
    for (size_t x = 0; x < sizeof(weight) / sizeof(weight[0]); x++)
        wsum += weight[x];
    for (o->step = 0; o->step < var->steps; o->step++) {
        int w = (int)dt_below(&o->r, (uint64_t)wsum), op = 0;
        while (w >= weight[op])
            w -= weight[op++];
        o->opname = names[op];
        int i = pick_live(o);
        if (i < 0 && op != 0 && op != 8 && op != 15) {
            op = 0;
            o->opname = names[0];
        }
        TRACE("seed %" PRIu64 " step %d: %s seq %d\n", seed, o->step, o->opname, i);
        switch (op) {
        case 0:
            op_create(o);
            break;
        case 1:
            op_append(o, i);
            break;
        case 2:
            op_write(o, i);
            break;
        case 3:
            op_fill(o, i);
            break;
        case 4:
            op_read(o, i);
            break;
        case 5:
            op_fork(o, i);
            break;
        case 6:
            op_truncate(o, i);
            break;
        case 7:
            op_free(o, i);
            break;
        case 8:
            op_match(o);
            break;
        case 9:
            op_acquire(o, i);
            break;
        case 10:
            op_pin(o, i);
            break;
        case 11:
            op_migrate(o, i);
            break;
        case 12:
            op_hint(o, i);
            break;
        case 13:
            op_persist(o, i);
            break;
        case 14:
            op_misuse(o, i);
            break;
        default:
            if (var->disk_slots)
                op_reopen(o);
            break;
        }
        o->opname = "verify";
        verify_all(o);
    }
    o->opname = "teardown";
    g_sum.match_blocks += o->n_match_blocks;
    g_sum.reopen_blocks += o->n_reopen_blocks;
    g_sum.persists += o->n_persist;
    g_sum.reopens += o->n_reopens;
    g_sum.nospace += o->n_nospace;
    g_sum.cands += (long)o->ncs;
    {
        kvh_stats st = {.struct_size = sizeof(st)};
        OOK(kvh_engine_stats(o->e, &st));
        g_sum.cow += (long)st.cow_copies;
        g_sum.to_disk += (long)st.blocks_host_to_disk;
        g_sum.from_disk += (long)st.blocks_disk_to_host;
        g_sum.disk_hits += (long)st.prefix_hit_blocks_disk;
    }
    for (int i = 0; i < MAXSEQ; i++)
        if (o->s[i].live) {
            release_hold(o, &o->s[i]);
            OOK(kvh_seq_free(o->e, o->s[i].h));
        }
    OOK(dt_close(o->e));
    g_o = NULL;
    oracle_free(o);
}

static void run_variant(const variant *var)
{
    g_trace = getenv("KVH_ORACLE_TRACE") && atoi(getenv("KVH_ORACLE_TRACE"));
    const char *one = getenv("KVH_TEST_SEED");
    if (one && *one) {
        run_one(var, strtoull(one, NULL, 0));
        return;
    }
    memset(&g_sum, 0, sizeof(g_sum));
    double t0 = dt_now();
    for (int s = 1; s <= var->seeds; s++)
        run_one(var, (uint64_t)s);
    printf("seq_oracle %s: %d seeds x %d steps: %ld blocks matched (%ld after %ld reopens, %ld from disk), %ld "
           "persists, %ld CoW copies, %ld blocks to disk / %ld back, %ld candidates, %ld NOSPACE/BUSY; %.1f s\n",
           var->name, var->seeds, var->steps, g_sum.match_blocks, g_sum.reopen_blocks, g_sum.reopens, g_sum.disk_hits,
           g_sum.persists, g_sum.cow, g_sum.to_disk, g_sum.from_disk, g_sum.cands, g_sum.nospace, dt_now() - t0);
}

/* write_kv over a block in memory, then one on disk that no memory tier
 * can take (the host tier's block and the device tier's are pinned):
 * KVH_ERR_NOSPACE must leave the range unwritten, the first block too. */
static void test_write_nospace_writes_nothing(void **state)
{
    (void)state;
    dt_geo g = {1, 1, 8, 4, KVH_DTYPE_F16};
    char dir[PATH_MAX];
    dt_scratch("write_nospace", dir, sizeof(dir));
    kvh_config c = dt_cfg(g, dir, 1, 1, 8, 0);
    kvh_engine *e = dt_open_a(&c);
    int32_t t[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    uint16_t k[6 * 8], v[6 * 8];
    for (int i = 0; i < 6 * 8; i++)
        k[i] = v[i] = (uint16_t)(i + 1);
    kvh_seq a, b;
    dt_assert_ok(kvh_seq_create(e, 0, &a));
    dt_assert_ok(kvh_seq_append(e, a, t, 6)); /* block 0 full, block 1 half */
    dt_assert_ok(kvh_seq_write_kv(e, a, 0, 0, 2, k, v));
    dt_assert_ok(kvh_seq_migrate(e, a, 0, 6, KVH_TIER_DISK, NULL));
    dt_assert_ok(kvh_seq_migrate(e, a, 0, 1, KVH_TIER_HOST, NULL));
    dt_assert_ok(kvh_seq_pin(e, a, 0, 1, 1)); /* block 0: host, pinned */
    dt_assert_ok(kvh_seq_create(e, 0, &b));
    dt_assert_ok(kvh_seq_append(e, b, t, 1));
    dt_assert_ok(kvh_seq_pin(e, b, 0, 1, 1)); /* the device slot: pinned */
    dt_assert_kvh(KVH_ERR_NOSPACE, kvh_seq_write_kv(e, a, 0, 2, 4, k, v));
    /* Tokens 2 and 3 (block 0) were never written: still unreadable. */
    dt_assert_kvh(KVH_ERR_RANGE, kvh_seq_read_kv(e, a, 0, 2, 1, k, v));
    dt_assert_ok(kvh_seq_free(e, a));
    dt_assert_ok(kvh_seq_free(e, b));
    dt_assert_ok(dt_close(e));
}

static const variant V_DISK = {"disk", KVH_DTYPE_F16, 8, KVH_CODEC_NONE, 0, 4, 4, 512, 50, 250};
static const variant V_DISK_MT = {"disk_mt", KVH_DTYPE_F16, 8, KVH_CODEC_NONE, 2, 4, 4, 512, 40, 250};
static const variant V_DISK_SMALL = {"disk_small", KVH_DTYPE_F16, 8, KVH_CODEC_NONE, 1, 3, 3, 20, 40, 250};
static const variant V_MEM = {"mem", KVH_DTYPE_BF16, 8, KVH_CODEC_NONE, 0, 6, 6, 0, 50, 250};
static const variant V_INT8 = {"int8", KVH_DTYPE_F32, 16, KVH_CODEC_INT8, 1, 4, 4, 512, 25, 150};
static const variant V_Q4 = {"q4", KVH_DTYPE_F32, 32, KVH_CODEC_Q4_G32, 0, 4, 4, 512, 25, 150};

static void test_oracle_disk(void **state)
{
    (void)state;
    run_variant(&V_DISK);
}

static void test_oracle_disk_workers(void **state)
{
    (void)state;
    run_variant(&V_DISK_MT);
}

/* A disk that fills up and has to give room back. */
static void test_oracle_small_disk(void **state)
{
    (void)state;
    run_variant(&V_DISK_SMALL);
}

static void test_oracle_memory_only(void **state)
{
    (void)state;
    run_variant(&V_MEM);
}

static void test_oracle_codec_int8(void **state)
{
    (void)state;
    run_variant(&V_INT8);
}

static void test_oracle_codec_q4(void **state)
{
    (void)state;
    run_variant(&V_Q4);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_write_nospace_writes_nothing, oracle_teardown),
        cmocka_unit_test_teardown(test_oracle_disk, oracle_teardown),
        cmocka_unit_test_teardown(test_oracle_disk_workers, oracle_teardown),
        cmocka_unit_test_teardown(test_oracle_small_disk, oracle_teardown),
        cmocka_unit_test_teardown(test_oracle_memory_only, oracle_teardown),
        cmocka_unit_test_teardown(test_oracle_codec_int8, oracle_teardown),
        cmocka_unit_test_teardown(test_oracle_codec_q4, oracle_teardown),
    };
    return cmocka_run_group_tests_name("seq_oracle", tests, NULL, NULL);
}
