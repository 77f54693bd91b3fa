/* Differential test: random operations on a small engine against a plain
 * reference model of every sequence (tokens, K/V per layer per token,
 * written flags), with every byte of every live sequence checked
 * periodically and at the end.
 *
 * Cached blocks attached by match_prefix cannot be predicted exactly (what
 * stays cached depends on eviction), so the model keeps, per chained block
 * hash, the digests of every content a block had when it became full and
 * fully written (the only moment a block is published); an attached block
 * must carry one of them. Published blocks are immutable, so a write that
 * leaked into one would show up as an unknown digest.
 *
 * NOSPACE: the sequence must be unchanged (verified right away). In the
 * capacity variant NOSPACE is also checked for legitimacy: with R distinct
 * referenced blocks in a hierarchy of C slots, an operation needing k new
 * blocks at once must succeed when R + k <= C (unreferenced cached blocks
 * can always be dropped).
 *
 * KVH_TEST_SEED overrides the seed; the seed is printed on failure. */
#include "test_util.h"

enum { L = 2, H = 2, D = 4, BT = 4, DEV = 8, HOST = 32, SLOTS = DEV + HOST };
enum { MAXSEQ = 12, MAXLEN = 48, NPROMPT = 4, PLEN = 24, ROWF = H * D };
static const size_t TOKB = ROWF * 4;

typedef struct rseq {
    int live;
    kvh_seq h;
    uint32_t len;
    int prompt; /* prompt its tokens follow, -1 none */
    int32_t tok[MAXLEN];
    uint32_t k[L][MAXLEN][ROWF]; /* f32 as raw bits */
    uint32_t v[L][MAXLEN][ROWF];
    uint8_t w[L][MAXLEN];
    uint32_t complete; /* bit b: block b full and fully written */
} rseq;

/* Set of (chained hash, content digest) seen at completion. */
typedef struct cand_set {
    uint64_t *h, *dg;
    size_t cap, n;
} cand_set;

typedef struct diff {
    kvh_engine *e;
    uint32_t threads;
    int strict_capacity;
    int multi_block_writes; /* write_kv ranges may span blocks */
    uint64_t seed;
    long op;
    tu_rng r;
    rseq s[MAXSEQ];
    cand_set cs;
    int32_t prompts[NPROMPT][PLEN];
    /* counters for the summary */
    long n_ops[16], n_nospace[16], n_match_blocks, n_match_calls, n_checks;
} diff;

static diff *g_d;   /* for failure messages */
static int g_trace; /* KVH_DIFF_TRACE=1: print every operation */
#define TRACE(...)                                                                                                     \
    do {                                                                                                               \
        if (g_trace)                                                                                                   \
            fprintf(stderr, __VA_ARGS__);                                                                              \
    } while (0)

#define DFAIL(...)                                                                                                     \
    do {                                                                                                               \
        print_error("differential (seed 0x%" PRIx64 ", op %ld, threads %u): ", g_d->seed, g_d->op, g_d->threads);      \
        print_error(__VA_ARGS__);                                                                                      \
        print_error("\n    rerun with KVH_TEST_SEED=0x%" PRIx64 "\n", g_d->seed);                                      \
        fail();                                                                                                        \
    } while (0)
#define DCHECK(cond, ...)                                                                                              \
    do {                                                                                                               \
        if (!(cond))                                                                                                   \
            DFAIL(__VA_ARGS__);                                                                                        \
    } while (0)
#define DOK(expr)                                                                                                      \
    do {                                                                                                               \
        kvh_status d_st_ = (expr);                                                                                     \
        DCHECK(d_st_ == KVH_OK, "%s -> %s (%s)", #expr, kvh_status_name(d_st_), kvh_last_error());                     \
    } while (0)

/* ---- candidate set ---- */

static uint64_t mixk(uint64_t h, uint64_t d) { return (h ^ (d * 0x9e3779b97f4a7c15ull)) * 0xff51afd7ed558ccdull; }

static int cand_has(const cand_set *c, uint64_t h, uint64_t dg)
{
    if (!c->cap)
        return 0;
    for (size_t i = mixk(h, dg) & (c->cap - 1);; i = (i + 1) & (c->cap - 1)) {
        if (c->h[i] == 0 && c->dg[i] == 0)
            return 0;
        if (c->h[i] == h && c->dg[i] == dg)
            return 1;
    }
}

static void cand_add(cand_set *c, uint64_t h, uint64_t dg)
{
    if (cand_has(c, h, dg))
        return;
    if ((c->n + 1) * 2 > c->cap) {
        cand_set n = {0};
        n.cap = c->cap ? c->cap * 2 : 1024;
        n.h = calloc(n.cap, 8);
        n.dg = calloc(n.cap, 8);
        assert_non_null(n.h);
        assert_non_null(n.dg);
        for (size_t i = 0; i < c->cap; i++)
            if (c->h[i] || c->dg[i])
                cand_add(&n, c->h[i], c->dg[i]);
        free(c->h);
        free(c->dg);
        *c = n;
    }
    for (size_t i = mixk(h, dg) & (c->cap - 1);; i = (i + 1) & (c->cap - 1))
        if (c->h[i] == 0 && c->dg[i] == 0) {
            c->h[i] = h;
            c->dg[i] = dg;
            c->n++;
            return;
        }
}

static void cand_free(cand_set *c)
{
    free(c->h);
    free(c->dg);
    memset(c, 0, sizeof(*c));
}

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

/* Digest of block b's KV: layer by layer, K rows then V rows. */
static uint64_t digest_ref(const rseq *s, uint32_t b)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (uint32_t l = 0; l < L; l++) {
        h = fnv(h, s->k[l][b * BT], BT * TOKB);
        h = fnv(h, s->v[l][b * BT], BT * TOKB);
    }
    return h;
}

/* Chained hashes of the full blocks of tokens. */
static void chain_hashes(kvh_engine *e, const int32_t *tok, uint32_t n_blocks, uint64_t *out)
{
    uint64_t parent = 0;
    for (uint32_t b = 0; b < n_blocks; b++) {
        DOK(kvh_prefix_hash(e, parent, tok + b * BT, BT, &out[b]));
        parent = out[b];
    }
}

/* ---- the model ---- */

static int block_complete(const rseq *s, uint32_t b)
{
    if ((b + 1) * BT > s->len)
        return 0;
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t t = b * BT; t < (b + 1) * BT; t++)
            if (!s->w[l][t])
                return 0;
    return 1;
}

/* Records the blocks that just became complete (they are published now,
 * unless an equal prefix is cached already). */
static void update_completion(diff *d, rseq *s)
{
    uint32_t mask = 0;
    for (uint32_t b = 0; b < MAXLEN / BT; b++)
        if (block_complete(s, b))
            mask |= 1u << b;
    uint32_t fresh = mask & ~s->complete;
    if (fresh) {
        uint64_t hs[MAXLEN / BT];
        chain_hashes(d->e, s->tok, s->len / BT, hs);
        for (uint32_t b = 0; b < MAXLEN / BT; b++)
            if (fresh >> b & 1)
                cand_add(&d->cs, hs[b], digest_ref(s, b));
    }
    s->complete = mask;
}

/* After a mismatch: does a second read (once migrations settle) agree with
 * the model? Tells a torn read from corrupted stored data. */
static const char *reread_verdict(diff *d, const rseq *s, uint32_t l, uint32_t u)
{
    uint32_t k[ROWF], v[ROWF];
    for (int i = 0; i < 50; i++) {
        struct timespec ts = {0, 2000000};
        nanosleep(&ts, NULL);
        if (kvh_seq_read_kv(d->e, s->h, l, u, 1, k, v) != KVH_OK)
            return "re-read failed";
        if (memcmp(k, s->k[l][u], TOKB) == 0 && memcmp(v, s->v[l][u], TOKB) == 0)
            return "a later read is correct: torn read while a migration moved the data";
    }
    return "later reads still differ: the stored data is wrong";
}

/* Every byte of one sequence against the model. */
static void verify_seq(diff *d, int i)
{
    rseq *s = &d->s[i];
    kvh_engine *e = d->e;
    uint64_t len = 0;
    DOK(kvh_seq_length(e, s->h, &len));
    DCHECK(len == s->len, "seq %d: length %" PRIu64 ", model %u", i, len, s->len);
    int32_t tok[MAXLEN];
    DOK(kvh_seq_tokens(e, s->h, 0, s->len, tok));
    DCHECK(memcmp(tok, s->tok, s->len * sizeof(int32_t)) == 0, "seq %d: tokens differ", i);
    uint32_t k[MAXLEN][ROWF], v[MAXLEN][ROWF];
    for (uint32_t l = 0; l < L; l++) {
        for (uint32_t t = 0; t < s->len;) {
            uint32_t e_ = t;
            while (e_ < s->len && s->w[l][e_] == s->w[l][t])
                e_++;
            if (s->w[l][t]) {
                DOK(kvh_seq_read_kv(e, s->h, l, t, e_ - t, k, v));
                for (uint32_t u = t; u < e_; u++) {
                    int kbad = memcmp(k[u - t], s->k[l][u], TOKB) != 0, vbad = memcmp(v[u - t], s->v[l][u], TOKB) != 0;
                    if (kbad || vbad)
                        DFAIL("seq %d layer %u token %u: %s differs (%s)", i, l, u, kbad ? "K" : "V",
                              reread_verdict(d, s, l, u));
                }
            } else {
                uint32_t u = t + (uint32_t)tu_below(&d->r, e_ - t);
                kvh_status st = kvh_seq_read_kv(e, s->h, l, u, 1, k, v);
                DCHECK(st == KVH_ERR_RANGE, "seq %d layer %u token %u: never written, read gave %s", i, l, u,
                       kvh_status_name(st));
            }
            t = e_;
        }
    }
    kvh_status st = kvh_seq_read_kv(e, s->h, 0, s->len, 1, k, v);
    DCHECK(st == KVH_ERR_RANGE, "seq %d: read past the end gave %s", i, kvh_status_name(st));
}

static void verify_all(diff *d)
{
    d->n_checks++;
    for (int i = 0; i < MAXSEQ; i++)
        if (d->s[i].live)
            verify_seq(d, i);
    if (d->threads == 0) {
        kvh_stats st = tu_stats(d->e);
        uint64_t used = tu_tier(d->e, KVH_TIER_DEVICE).used_blocks + tu_tier(d->e, KVH_TIER_HOST).used_blocks;
        DCHECK(st.blocks_allocated - st.blocks_freed == used,
               "allocated %" PRIu64 " - freed %" PRIu64 " != used slots %" PRIu64, st.blocks_allocated, st.blocks_freed,
               used);
    }
}

/* Distinct blocks referenced by live sequences. */
static uint64_t referenced_blocks(diff *d)
{
    uint64_t ids[MAXSEQ * (MAXLEN / BT)];
    size_t n = 0;
    for (int i = 0; i < MAXSEQ; i++) {
        rseq *s = &d->s[i];
        if (!s->live)
            continue;
        uint32_t nb = (s->len + BT - 1) / BT;
        kvh_block b[MAXLEN / BT];
        DOK(kvh_seq_blocks(d->e, s->h, 0, nb, b));
        for (uint32_t j = 0; j < nb; j++) {
            int dup = 0;
            for (size_t x = 0; x < n && !dup; x++)
                dup = ids[x] == b[j].id;
            if (!dup)
                ids[n++] = b[j].id;
        }
    }
    return n;
}

static uint32_t block_refs(diff *d, rseq *s, uint32_t b)
{
    kvh_block h;
    DOK(kvh_seq_blocks(d->e, s->h, b, 1, &h));
    kvh_block_info bi = {.struct_size = sizeof(bi)};
    DOK(kvh_block_info_get(d->e, h, &bi));
    return bi.refs;
}

/* A NOSPACE needing `need` blocks at once is only legitimate when the
 * referenced blocks leave no room for them. */
static char g_nospace_msg[512];

static void check_nospace_legit(diff *d, const char *what, uint64_t need)
{
    if (!d->strict_capacity)
        return;
    uint64_t r = referenced_blocks(d);
    DCHECK(r + need > SLOTS,
           "%s returned NOSPACE with %" PRIu64 " referenced blocks of %d slots and %" PRIu64
           " needed: unreferenced cached blocks should have made room (last error: %s)",
           what, r, SLOTS, need, g_nospace_msg);
}

static int free_slot(diff *d)
{
    for (int i = 0; i < MAXSEQ; i++)
        if (!d->s[i].live)
            return i;
    return -1;
}

static int pick_live(diff *d)
{
    int idx[MAXSEQ], n = 0;
    for (int i = 0; i < MAXSEQ; i++)
        if (d->s[i].live)
            idx[n++] = i;
    return n ? idx[tu_below(&d->r, (uint64_t)n)] : -1;
}

static int on_prompt(const diff *d, const rseq *s)
{
    return s->prompt >= 0 && s->len < PLEN && memcmp(s->tok, d->prompts[s->prompt], s->len * sizeof(int32_t)) == 0;
}

static void next_tokens(diff *d, rseq *s, int32_t *out, uint32_t n)
{
    for (uint32_t j = 0; j < n; j++) {
        uint32_t pos = s->len + j;
        if (s->prompt >= 0 && pos < PLEN && (j > 0 || on_prompt(d, s)))
            out[j] = d->prompts[s->prompt][pos];
        else
            out[j] = 5000 + (int32_t)tu_below(&d->r, 6);
    }
}

/* ---- operations ---- */

enum {
    OP_CREATE,
    OP_APPEND,
    OP_WRITE,
    OP_FILL,
    OP_READ,
    OP_FORK,
    OP_TRUNC,
    OP_FREE,
    OP_MATCH,
    OP_EVICT,
    OP_ACQUIRE,
    OP_PREFETCH,
    OP_COUNT
};
static const char *op_names[OP_COUNT] = {"create",   "append", "write_kv",     "write_missing", "read_kv", "fork",
                                         "truncate", "free",   "match_prefix", "migrate_host",  "acquire", "prefetch"};
static const int op_weight[OP_COUNT] = {4, 20, 22, 6, 10, 5, 6, 4, 6, 6, 6, 5};

static void op_create(diff *d)
{
    int i = free_slot(d);
    if (i < 0)
        return;
    rseq *s = &d->s[i];
    memset(s, 0, sizeof(*s));
    DOK(kvh_seq_create(d->e, (uint32_t)tu_below(&d->r, 3), &s->h));
    s->live = 1;
    s->prompt = (int)tu_below(&d->r, NPROMPT + 1) - 1;
    TRACE("op %ld: create seq %d (prompt %d)\n", d->op, i, s->prompt);
}

static void op_append(diff *d, int i)
{
    rseq *s = &d->s[i];
    uint32_t n = 1 + (uint32_t)tu_below(&d->r, 9);
    if (s->len + n > MAXLEN)
        n = MAXLEN - s->len;
    if (!n)
        return;
    int32_t t[16];
    next_tokens(d, s, t, n);
    uint32_t room = s->len % BT ? BT - s->len % BT : 0;
    uint64_t need = n > room ? (n - room + BT - 1) / BT : 0;
    int shared_tail = room && block_refs(d, s, s->len / BT) > 1;
    kvh_status st = kvh_seq_append(d->e, s->h, t, n);
    TRACE("op %ld: append seq %d +%u (len %u) -> %s\n", d->op, i, n, s->len, kvh_status_name(st));
    if (st == KVH_ERR_NOSPACE) {
        snprintf(g_nospace_msg, sizeof(g_nospace_msg), "%s", kvh_last_error());
        d->n_nospace[OP_APPEND]++;
        verify_seq(d, i); /* unchanged */
        check_nospace_legit(d, "append", need + (uint64_t)shared_tail);
        return;
    }
    DCHECK(st == KVH_OK, "append: %s (%s)", kvh_status_name(st), kvh_last_error());
    memcpy(s->tok + s->len, t, n * sizeof(int32_t));
    for (uint32_t l = 0; l < L; l++)
        memset(&s->w[l][s->len], 0, n);
    s->len += n;
    update_completion(d, s);
}

/* Writes layer l, tokens [pos, pos+n) with kk/vv; model updated on OK. */
static void do_write(diff *d, int i, uint32_t l, uint32_t pos, uint32_t n, uint32_t (*kk)[ROWF], uint32_t (*vv)[ROWF])
{
    rseq *s = &d->s[i];
    uint32_t b0 = pos / BT, b1 = (pos + n + BT - 1) / BT;
    kvh_status st = kvh_seq_write_kv(d->e, s->h, l, pos, n, kk, vv);
    TRACE("op %ld: write seq %d layer %u %u+%u (len %u) -> %s\n", d->op, i, l, pos, n, s->len, kvh_status_name(st));
    if (st == KVH_ERR_NOSPACE) {
        snprintf(g_nospace_msg, sizeof(g_nospace_msg), "%s", kvh_last_error());
        d->n_nospace[OP_WRITE]++;
        verify_seq(d, i); /* unchanged */
        check_nospace_legit(d, "write_kv", b1 - b0);
        return;
    }
    DCHECK(st == KVH_OK, "write_kv(seq %d, layer %u, %u+%u): %s (%s)", i, l, pos, n, kvh_status_name(st),
           kvh_last_error());
    memcpy(s->k[l][pos], kk, n * TOKB);
    memcpy(s->v[l][pos], vv, n * TOKB);
    memset(&s->w[l][pos], 1, n);
    update_completion(d, s);
}

static void op_write(diff *d, int i)
{
    rseq *s = &d->s[i];
    if (!s->len)
        return;
    uint32_t l = (uint32_t)tu_below(&d->r, L);
    uint32_t pos = (uint32_t)tu_below(&d->r, s->len);
    uint32_t n = 1 + (uint32_t)tu_below(&d->r, s->len - pos < 12 ? s->len - pos : 12);
    if (!d->multi_block_writes && pos % BT + n > BT)
        n = BT - pos % BT;
    uint32_t kk[12][ROWF], vv[12][ROWF];
    tu_fill(&d->r, kk, n * TOKB);
    tu_fill(&d->r, vv, n * TOKB);
    do_write(d, i, l, pos, n, kk, vv);
}

/* Writes every unwritten run (as a model would after prefill). */
static void op_fill(diff *d, int i)
{
    rseq *s = &d->s[i];
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t t = 0; t < s->len;) {
            if (s->w[l][t]) {
                t++;
                continue;
            }
            uint32_t e_ = t;
            while (e_ < s->len && !s->w[l][e_] && e_ - t < 12 && (d->multi_block_writes || e_ == t || e_ % BT))
                e_++;
            uint32_t kk[12][ROWF], vv[12][ROWF];
            tu_fill(&d->r, kk, (e_ - t) * TOKB);
            tu_fill(&d->r, vv, (e_ - t) * TOKB);
            do_write(d, i, l, t, e_ - t, kk, vv);
            if (!s->w[l][t])
                return; /* NOSPACE */
            t = e_;
        }
}

static void op_read(diff *d, int i)
{
    rseq *s = &d->s[i];
    if (!s->len)
        return;
    uint32_t l = (uint32_t)tu_below(&d->r, L);
    uint32_t pos = (uint32_t)tu_below(&d->r, s->len);
    uint32_t n = 1 + (uint32_t)tu_below(&d->r, s->len - pos);
    int all = 1;
    for (uint32_t t = pos; t < pos + n; t++)
        all &= s->w[l][t];
    uint32_t k[MAXLEN][ROWF], v[MAXLEN][ROWF];
    kvh_status st = kvh_seq_read_kv(d->e, s->h, l, pos, n, k, v);
    if (!all) {
        DCHECK(st == KVH_ERR_RANGE, "read of partly unwritten range gave %s", kvh_status_name(st));
        return;
    }
    DCHECK(st == KVH_OK, "read_kv(seq %d, layer %u, %u+%u): %s (%s)", i, l, pos, n, kvh_status_name(st),
           kvh_last_error());
    for (uint32_t u = pos; u < pos + n; u++)
        if (memcmp(k[u - pos], s->k[l][u], TOKB) != 0 || memcmp(v[u - pos], s->v[l][u], TOKB) != 0)
            DFAIL("seq %d layer %u: KV of token %u (read %u+%u) differs (%s)", i, l, u, pos, n,
                  reread_verdict(d, s, l, u));
}

static void op_fork(diff *d, int i)
{
    int j = free_slot(d);
    if (j < 0)
        return;
    rseq *c = &d->s[j];
    *c = d->s[i];
    DOK(kvh_seq_fork(d->e, d->s[i].h, (uint32_t)tu_below(&d->r, 3), &c->h));
    TRACE("op %ld: fork seq %d -> %d (len %u)\n", d->op, i, j, c->len);
}

static void op_trunc(diff *d, int i)
{
    rseq *s = &d->s[i];
    uint32_t n = (uint32_t)tu_below(&d->r, s->len + 1);
    if (tu_below(&d->r, 3) == 0 && s->len)
        n = s->len - 1 - (uint32_t)tu_below(&d->r, s->len < 3 ? s->len : 3);
    /* Cutting into a block that is shared or published copies it first. */
    int shared_tail = 0;
    if (n % BT && n < s->len && (n / BT + 1) * BT > n) {
        kvh_block h;
        DOK(kvh_seq_blocks(d->e, s->h, n / BT, 1, &h));
        kvh_block_info bi = {.struct_size = sizeof(bi)};
        DOK(kvh_block_info_get(d->e, h, &bi));
        shared_tail = bi.refs > 1 || bi.published;
    }
    kvh_status st = kvh_seq_truncate(d->e, s->h, n);
    TRACE("op %ld: truncate seq %d %u -> %u -> %s\n", d->op, i, s->len, n, kvh_status_name(st));
    if (st == KVH_ERR_NOSPACE) {
        snprintf(g_nospace_msg, sizeof(g_nospace_msg), "%s", kvh_last_error());
        d->n_nospace[OP_TRUNC]++;
        verify_seq(d, i);
        check_nospace_legit(d, "truncate", (uint64_t)shared_tail);
        return;
    }
    DCHECK(st == KVH_OK, "truncate(seq %d, %u): %s (%s)", i, n, kvh_status_name(st), kvh_last_error());
    for (uint32_t l = 0; l < L; l++)
        memset(&s->w[l][n], 0, MAXLEN - n);
    memset(&s->tok[n], 0, (MAXLEN - n) * sizeof(int32_t));
    s->len = n;
    update_completion(d, s);
}

static void op_free(diff *d, int i)
{
    DOK(kvh_seq_free(d->e, d->s[i].h));
    TRACE("op %ld: free seq %d\n", d->op, i);
    d->s[i].live = 0;
}

static void op_match(diff *d)
{
    int j = free_slot(d);
    if (j < 0)
        return;
    int p = (int)tu_below(&d->r, NPROMPT);
    int32_t t[PLEN + 8];
    memcpy(t, d->prompts[p], sizeof(d->prompts[p]));
    uint32_t n = PLEN - (uint32_t)tu_below(&d->r, 6);
    uint32_t extra = (uint32_t)tu_below(&d->r, 6);
    for (uint32_t x = 0; x < extra; x++)
        t[n++] = 5000 + (int32_t)tu_below(&d->r, 6);
    rseq *s = &d->s[j];
    memset(s, 0, sizeof(*s));
    DOK(kvh_seq_create(d->e, (uint32_t)tu_below(&d->r, 3), &s->h));
    s->live = 1;
    s->prompt = p;
    size_t m = 12345;
    DOK(kvh_seq_match_prefix(d->e, s->h, t, n, &m));
    TRACE("op %ld: match seq %d prompt %d n %u -> %zu\n", d->op, j, p, n, m);
    d->n_match_calls++;
    DCHECK(m % BT == 0 && m <= n, "match_prefix matched %zu of %u tokens", m, n);
    d->n_match_blocks += (long)(m / BT);
    uint64_t len = 99;
    DOK(kvh_seq_length(d->e, s->h, &len));
    DCHECK(len == m, "after match_prefix of %zu tokens the length is %" PRIu64, m, len);
    if (!m)
        return;
    /* Adopt what the library attached, after checking it is a content
     * that was published under that prefix. */
    memcpy(s->tok, t, m * sizeof(int32_t));
    s->len = (uint32_t)m;
    int32_t got[PLEN + 8];
    DOK(kvh_seq_tokens(d->e, s->h, 0, m, got));
    DCHECK(memcmp(got, t, m * sizeof(int32_t)) == 0, "matched tokens differ");
    for (uint32_t l = 0; l < L; l++) {
        DOK(kvh_seq_read_kv(d->e, s->h, l, 0, m, s->k[l], s->v[l]));
        memset(s->w[l], 1, m);
    }
    uint64_t hs[MAXLEN / BT];
    chain_hashes(d->e, s->tok, (uint32_t)(m / BT), hs);
    for (uint32_t b = 0; b < m / BT; b++)
        DCHECK(cand_has(&d->cs, hs[b], digest_ref(s, b)),
               "match_prefix attached block %u (prompt %d) whose KV was never the content of a completed block "
               "with that prefix",
               b, p);
    update_completion(d, s);
}

static void range_of(diff *d, rseq *s, uint64_t *first, uint64_t *n)
{
    *first = tu_below(&d->r, s->len);
    *n = 1 + tu_below(&d->r, s->len - *first);
}

static void op_evict(diff *d, int i)
{
    rseq *s = &d->s[i];
    if (!s->len)
        return;
    uint64_t first, n;
    range_of(d, s, &first, &n);
    kvh_fence f = {0};
    kvh_status st = kvh_seq_migrate(d->e, s->h, first, n, KVH_TIER_HOST, d->threads ? &f : NULL);
    TRACE("op %ld: migrate seq %d %" PRIu64 "+%" PRIu64 " -> %s\n", d->op, i, first, n, kvh_status_name(st));
    if (st == KVH_OK && d->threads) {
        if (tu_below(&d->r, 2))
            st = kvh_fence_wait(d->e, f, UINT64_MAX);
        DOK(kvh_fence_free(d->e, f));
    }
    if (st == KVH_ERR_NOSPACE)
        d->n_nospace[OP_EVICT]++;
    else
        DCHECK(st == KVH_OK, "migrate to host: %s (%s)", kvh_status_name(st), kvh_last_error());
}

static void op_acquire(diff *d, int i)
{
    rseq *s = &d->s[i];
    if (!s->len)
        return;
    uint64_t first, n;
    range_of(d, s, &first, &n);
    uint64_t nb = (first + n + BT - 1) / BT - first / BT;
    kvh_status st = kvh_seq_acquire(d->e, s->h, first, n, NULL);
    TRACE("op %ld: acquire seq %d %" PRIu64 "+%" PRIu64 " -> %s\n", d->op, i, first, n, kvh_status_name(st));
    if (st == KVH_ERR_NOSPACE) {
        d->n_nospace[OP_ACQUIRE]++;
        if (d->strict_capacity)
            DCHECK(nb > DEV, "acquire of %" PRIu64 " blocks (device holds %d, nothing else held): NOSPACE (%s)", nb,
                   DEV, kvh_last_error());
        for (uint32_t b = (uint32_t)(first / BT); b < (first + n + BT - 1) / BT; b++) {
            kvh_block h;
            DOK(kvh_seq_blocks(d->e, s->h, b, 1, &h));
            kvh_block_info bi = {.struct_size = sizeof(bi)};
            DOK(kvh_block_info_get(d->e, h, &bi));
            DCHECK(bi.holds == 0, "failed acquire left block %u held", b);
        }
        return;
    }
    DCHECK(st == KVH_OK, "acquire: %s (%s)", kvh_status_name(st), kvh_last_error());
    /* Resident and held: the block table of the range's blocks works if
     * the whole sequence was acquired. */
    if (first == 0 && n == s->len) {
        int32_t indptr[2], idx[MAXLEN / BT], lpl[1];
        DOK(kvh_block_table(d->e, &s->h, 1, indptr, idx, MAXLEN / BT, lpl));
        DCHECK(lpl[0] == (int32_t)((s->len - 1) % BT + 1), "last_page_len %d for length %u", lpl[0], s->len);
    }
    if (tu_below(&d->r, 2))
        op_read(d, i);
    DOK(kvh_seq_release(d->e, s->h, first, n));
}

static void op_prefetch(diff *d, int i)
{
    rseq *s = &d->s[i];
    if (!s->len)
        return;
    uint64_t first, n;
    range_of(d, s, &first, &n);
    if (tu_below(&d->r, 2)) {
        DOK(kvh_seq_hint(d->e, s->h, first, n, (int32_t)tu_below(&d->r, 4)));
        TRACE("op %ld: hint seq %d %" PRIu64 "+%" PRIu64 "\n", d->op, i, first, n);
        return;
    }
    DOK(kvh_prefetch(d->e, s->h, first, n, (int32_t)tu_below(&d->r, 4), NULL));
    TRACE("op %ld: prefetch seq %d %" PRIu64 "+%" PRIu64 "\n", d->op, i, first, n);
}

static void init_prompts(diff *d)
{
    /* Prompts 0..2 share a system prompt of 8 tokens; 3 is unrelated. */
    for (int p = 0; p < NPROMPT; p++)
        for (int t = 0; t < PLEN; t++)
            d->prompts[p][t] = (p < 3 && t < 8) ? 100 + t : 1000 * (p + 1) + t;
}

static void open_engine(diff *d)
{
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F32, DEV, HOST, d->threads);
    kvh_status st = kvh_engine_open(&c, &d->e);
    DCHECK(st == KVH_OK, "open: %s", kvh_status_name(st));
    tu_track_engine(d->e);
    memset(d->s, 0, sizeof(d->s));
    cand_free(&d->cs);
}

static void run(diff *d, long ops, long epoch)
{
    g_d = d;
    g_trace = getenv("KVH_DIFF_TRACE") && *getenv("KVH_DIFF_TRACE") == '1';
    d->r.s = d->seed;
    init_prompts(d);
    open_engine(d);
    int total_w = 0;
    for (int o = 0; o < OP_COUNT; o++)
        total_w += op_weight[o];
    for (d->op = 0; d->op < ops; d->op++) {
        if (epoch && d->op && d->op % epoch == 0) {
            /* Start over on a fresh engine (closing one with live sequences). */
            verify_all(d);
            DOK(tu_close(d->e));
            open_engine(d);
        }
        int w = (int)tu_below(&d->r, (uint64_t)total_w), o = 0;
        while (w >= op_weight[o])
            w -= op_weight[o++];
        int i = pick_live(d);
        if (i < 0 && o != OP_MATCH)
            o = OP_CREATE;
        d->n_ops[o]++;
        switch (o) {
        case OP_CREATE:
            op_create(d);
            break;
        case OP_APPEND:
            op_append(d, i);
            break;
        case OP_WRITE:
            op_write(d, i);
            break;
        case OP_FILL:
            op_fill(d, i);
            break;
        case OP_READ:
            op_read(d, i);
            break;
        case OP_FORK:
            op_fork(d, i);
            break;
        case OP_TRUNC:
            op_trunc(d, i);
            break;
        case OP_FREE:
            op_free(d, i);
            break;
        case OP_MATCH:
            op_match(d);
            break;
        case OP_EVICT:
            op_evict(d, i);
            break;
        case OP_ACQUIRE:
            op_acquire(d, i);
            break;
        default:
            op_prefetch(d, i);
        }
        if (d->op % 500 == 499)
            verify_all(d);
    }
    verify_all(d);
    printf("differential: seed 0x%" PRIx64 ", %ld ops, threads %u, %ld full checks, %ld matches attaching %ld "
           "blocks, %zu published contents\n",
           d->seed, ops, d->threads, d->n_checks, d->n_match_calls, d->n_match_blocks, d->cs.n);
    for (int o = 0; o < OP_COUNT; o++)
        if (d->n_nospace[o])
            printf("    %-14s %7ld calls, %6ld NOSPACE\n", op_names[o], d->n_ops[o], d->n_nospace[o]);
    cand_free(&d->cs);
    DOK(tu_close(d->e));
}

static diff *new_diff(uint32_t threads, int strict, int multi, uint64_t seed)
{
    diff *d = tu_alloc(sizeof(diff));
    d->threads = threads;
    d->strict_capacity = strict;
    d->multi_block_writes = multi;
    d->seed = tu_seed(seed);
    return d;
}

/* Content: NOSPACE is accepted but the sequence must be unchanged. Writes
 * stay inside one block here (see the multi-block variant). A fresh
 * engine every 5000 operations keeps the hierarchy from silting up with
 * cached blocks. */
static void test_differential_inline(void **state)
{
    (void)state;
    run(new_diff(0, 0, 0, 0xd1ffull), 300000, 5000);
}

static void test_differential_workers(void **state)
{
    (void)state;
    run(new_diff(2, 0, 0, 0xd1ff2ull), 30000, 5000);
}

/* write_kv ranges spanning blocks: a NOSPACE on the copy of a later block
 * must not leave the earlier blocks written. */
static void test_differential_multiblock_writes(void **state)
{
    (void)state;
    run(new_diff(0, 0, 1, 0x3b10cull), 30000, 5000);
}

/* NOSPACE must also be legitimate. One engine throughout. */
static void test_differential_capacity(void **state)
{
    (void)state;
    run(new_diff(0, 1, 0, 0xcafull), 30000, 0);
}

/* Frees the model's candidate set even when a test failed half way. */
static int diff_teardown(void **state)
{
    if (g_d)
        cand_free(&g_d->cs);
    g_d = NULL;
    return tu_teardown(state);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_differential_inline, diff_teardown),
        cmocka_unit_test_teardown(test_differential_workers, diff_teardown),
        cmocka_unit_test_teardown(test_differential_multiblock_writes, diff_teardown),
        cmocka_unit_test_teardown(test_differential_capacity, diff_teardown),
    };
    return cmocka_run_group_tests_name("differential", tests, NULL, NULL);
}
