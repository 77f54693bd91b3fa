/* Content integrity of sequences under threads, with tiers of a handful of
 * blocks so that blocks move between device, host and disk all the time,
 * from kvh.h's promises alone.
 *
 * Oracle: the K/V of a cell is a pure function of the token ids of the
 * prefix ending at its position (and of layer, head, K-or-V, dim). Every
 * sequence that holds the same prefix therefore holds the same bytes,
 * whichever thread wrote them, whichever published block a prefix match or
 * a persist deduplicated to, so any read on any thread is checked without
 * shared state, bit for bit (f32, raw tiers).
 *
 * Concurrency is the documented kind only: calls naming different
 * sequences run in parallel; calls of one sequence from several threads
 * (forks and reads of shared system prompts, their replacement and free)
 * are the checked kind ("a second such call ... gets KVH_ERR_BUSY and
 * changes nothing"); @threads any calls (prefetch, hint, migrate, length,
 * prefix lookup) name other threads' sequences while their owners use
 * them, which must never make the owner's calls fail.
 *
 * Tests: the mix itself then a reopen checking every persisted prefix;
 * the same with copy_moves (every device/host move a real copy); threads
 * racing kvh_engine_close ("Calls racing with close on other threads get
 * KVH_ERR_CLOSED"), then a reopen; and, on one thread, the mix's way of
 * losing a persisted prefix of a live sequence.
 */
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "test_util.h"
#include "uffd_gate.h"
#include "disk_test_util.h"
#include "mt_util.h"

/* f32, 2 layers x 2 heads x 8 dims, 4 tokens a block: 1 KiB blocks. */
enum { L = 2, H = 2, D = 8, BT = 4, MAXT = 40, NROOT = 4, NPRIV = 4, NTHR = 5, ROWF = H * D };
enum { DEV_BLOCKS = 8, HOST_BLOCKS = 8, DISK_SLOTS = 2048, MAX_PERSISTED = 256 };

/* Not a kvh status: the call was not made because close has begun. */
#define ST_HALTED (-1000)
#define BIT(st) (1u << (unsigned)(-(st)))

typedef struct content {
    int32_t tok[MAXT];
    uint32_t len;
    uint32_t wr[L]; /* K/V of tokens [0, wr[l]) of layer l is written */
} content;

static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Hash of the prefix tok[0..p] for every p < n. */
static void chain(const int32_t *tok, uint32_t n, uint64_t *ph)
{
    uint64_t h = 0x243f6a8885a308d3ull;
    for (uint32_t p = 0; p < n; p++)
        ph[p] = h = mix64(h ^ ((uint64_t)(uint32_t)tok[p] * 0x9e3779b97f4a7c15ull) ^ ((uint64_t)p << 48));
}

/* k/256 with |k| <= 32768: exact in f32. */
static float cell(uint64_t ph, uint32_t l, uint32_t h, int kv, uint32_t d)
{
    uint64_t z = mix64(ph ^ ((uint64_t)l << 40) ^ ((uint64_t)h << 32) ^ ((uint64_t)kv << 31) ^ d);
    return (float)((int32_t)(z & 0xffff) - 32768) / 256.0f;
}

static void oracle(const content *c, uint32_t l, uint32_t pos, uint32_t n, float *k, float *v)
{
    uint64_t ph[MAXT];
    chain(c->tok, c->len, ph);
    for (uint32_t t = 0; t < n; t++)
        for (uint32_t h = 0; h < H; h++)
            for (uint32_t d = 0; d < D; d++) {
                k[(t * H + h) * D + d] = cell(ph[pos + t], l, h, 0, d);
                v[(t * H + h) * D + d] = cell(ph[pos + t], l, h, 1, d);
            }
}

/* ---- shared state ---- */

typedef struct persisted {
    content c;
    bool kept; /* its sequence was still alive when the threads stopped */
} persisted;

static struct {
    kvh_engine *e;
    uint64_t seed;
    bool close_mode;                   /* KVH_ERR_CLOSED is expected */
    atomic_int stop;                   /* the time is up */
    atomic_int halt;                   /* close has begun: make no further call */
    atomic_int left[NTHR];             /* the worker returned */
    _Atomic(const char *) doing[NTHR]; /* the call a worker is in */
    content root_c[NROOT];
    _Atomic uint64_t root_h[NROOT];
    _Atomic uint64_t pub[NTHR][NPRIV]; /* private handles, for @threads any calls of others */
    pthread_mutex_t mu;
    persisted pers[MAX_PERSISTED];
    int n_pers;
    atomic_long reads_ok, cells_ok, closed_seen, busy_shared, forks_shared, cow_writes, persists, matched_tokens;
} G = {.mu = PTHREAD_MUTEX_INITIALIZER};

typedef struct wk {
    mt_worker *mw;
    tu_rng r;
    long op;
    const char *opname;
    bool halted;
    kvh_seq s[NPRIV];
    content c[NPRIV];
    bool frozen[NPRIV]; /* persisted: kept alive and unchanged until the end */
} wk;

static wk W[NTHR];

#define CALL(expr)                                                                                                     \
    (w->halted || atomic_load_explicit(&G.halt, memory_order_acquire)                                                  \
         ? ST_HALTED                                                                                                   \
         : (atomic_store_explicit(&G.doing[w->mw->t], #expr, memory_order_relaxed), (expr)))

/* kvh_fence_wait without a limit, but in the close race in slices: there a
 * worker held inside a gather by the test's gate holds every move queued
 * behind it, so a wait begun before close would last until the gate
 * opens; a new slice after close has begun gets KVH_ERR_CLOSED. */
#define FENCE_WAIT(e, f) fence_wait_sliced(w, e, f)
static kvh_status fence_wait_sliced(wk *w, kvh_engine *e, kvh_fence f)
{
    if (!G.close_mode)
        return CALL(kvh_fence_wait(e, f, UINT64_MAX));
    kvh_status st;
    do
        st = CALL(kvh_fence_wait(e, f, 20 * 1000 * 1000));
    while (st == KVH_ERR_TIMEOUT);
    return st;
}

/* Reports an unexpected status; true when the worker must stop (close). */
static bool gone(wk *w, kvh_status st)
{
    if (st == ST_HALTED || (st == KVH_ERR_CLOSED && G.close_mode)) {
        if (st == KVH_ERR_CLOSED)
            atomic_fetch_add(&G.closed_seen, 1);
        w->halted = true;
        return true;
    }
    return false;
}

/* True when st is KVH_OK; reports st when it is not in allowed. */
static bool okay(wk *w, kvh_status st, unsigned allowed, const char *what)
{
    if (st == KVH_OK)
        return true;
    if (gone(w, st))
        return false;
    if (st < -31 || !(allowed & BIT(st)))
        mt_report(w->mw, "seed %#" PRIx64 " thread %d op %ld (%s): %s returned %s: %s", G.seed, w->mw->t, w->op,
                  w->opname, what, kvh_status_name(st), kvh_last_error());
    return false;
}

/* Reads [pos, pos + n) of layer l and compares every element with the
 * oracle. */
static kvh_status check_read(wk *w, kvh_seq s, const content *c, uint32_t l, uint32_t pos, uint32_t n, unsigned allowed)
{
    float k[MAXT * ROWF], v[MAXT * ROWF], ek[MAXT * ROWF], ev[MAXT * ROWF];
    kvh_status st = CALL(kvh_seq_read_kv(w->mw->e, s, l, pos, n, k, v));
    if (!okay(w, st, allowed, "read_kv"))
        return st;
    oracle(c, l, pos, n, ek, ev);
    for (uint32_t i = 0; i < n * ROWF; i++)
        if (memcmp(&k[i], &ek[i], 4) != 0 || memcmp(&v[i], &ev[i], 4) != 0) {
            mt_report(w->mw,
                      "seed %#" PRIx64 " thread %d op %ld (%s): layer %u token %u head %u dim %u of a %u-token "
                      "sequence reads K %g V %g, oracle K %g V %g",
                      G.seed, w->mw->t, w->op, w->opname, l, pos + i / ROWF, (i / D) % H, i % D, c->len, k[i], v[i],
                      ek[i], ev[i]);
            return KVH_ERR_INTERNAL;
        }
    atomic_fetch_add(&G.reads_ok, 1);
    atomic_fetch_add(&G.cells_ok, n * ROWF);
    return KVH_OK;
}

static kvh_status write_range(wk *w, kvh_seq s, const content *c, uint32_t l, uint32_t pos, uint32_t n)
{
    float k[MAXT * ROWF], v[MAXT * ROWF];
    oracle(c, l, pos, n, k, v);
    return CALL(kvh_seq_write_kv(w->mw->e, s, l, pos, n, k, v));
}

/* Writes the unwritten tail of every layer. */
static void fill(wk *w, kvh_seq s, content *c)
{
    for (uint32_t l = 0; l < L; l++) {
        if (c->wr[l] >= c->len)
            continue;
        kvh_status st = write_range(w, s, c, l, c->wr[l], c->len - c->wr[l]);
        if (!okay(w, st, BIT(KVH_ERR_NOSPACE), "write_kv (tail)"))
            return;
        c->wr[l] = c->len;
    }
}

static void rand_tokens(wk *w, int32_t *tok, uint32_t n)
{
    /* Four ids: the threads often build the same prefixes, so published
     * blocks are found and deduplicated across threads. */
    for (uint32_t i = 0; i < n; i++)
        tok[i] = (int32_t)tu_below(&w->r, 4);
}

static kvh_seq pick_foreign(wk *w)
{
    if (tu_below(&w->r, 3) == 0)
        return (kvh_seq){atomic_load(&G.root_h[tu_below(&w->r, NROOT)])};
    return (kvh_seq){atomic_load(&G.pub[tu_below(&w->r, NTHR)][tu_below(&w->r, NPRIV)])};
}

/* ---- operations ---- */

static void op_free(wk *w, int i)
{
    w->opname = "free";
    atomic_store(&G.pub[w->mw->t][i], 0);
    kvh_status st = CALL(kvh_seq_free(w->mw->e, w->s[i]));
    okay(w, st, 0, "seq_free");
    w->s[i] = (kvh_seq){0};
}

/* Fills empty slot i: a fork of a system prompt, a fork of another private
 * sequence, or a new sequence matched against a prompt plus a random tail. */
static void op_create(wk *w, int i)
{
    kvh_engine *e = w->mw->e;
    kvh_status st;
    uint64_t how = tu_below(&w->r, 3);
    int other = (int)tu_below(&w->r, NPRIV);
    if (how == 1 && (other == i || !w->s[other].id))
        how = 0;
    if (how == 0) {
        w->opname = "fork shared prompt";
        int r = (int)tu_below(&w->r, NROOT);
        kvh_seq root = {atomic_load(&G.root_h[r])}, child;
        st = CALL(kvh_seq_fork(e, root, (uint32_t)w->mw->t, &child));
        if (st == KVH_ERR_BUSY || st == KVH_ERR_BAD_HANDLE) {
            atomic_fetch_add(&G.busy_shared, 1); /* another thread is on it, or replaced it */
            return;
        }
        if (!okay(w, st, 0, "seq_fork (shared)"))
            return;
        atomic_fetch_add(&G.forks_shared, 1);
        w->s[i] = child;
        w->c[i] = G.root_c[r];
    } else if (how == 1) {
        w->opname = "fork own";
        kvh_seq child;
        st = CALL(kvh_seq_fork(e, w->s[other], (uint32_t)w->mw->t, &child));
        if (!okay(w, st, 0, "seq_fork (own)"))
            return;
        w->s[i] = child;
        w->c[i] = w->c[other];
    } else {
        w->opname = "match prefix";
        content c = {0};
        const content *rc = &G.root_c[tu_below(&w->r, NROOT)];
        c.len = (uint32_t)tu_below(&w->r, rc->len + 1);
        memcpy(c.tok, rc->tok, c.len * sizeof(int32_t));
        uint32_t tail = (uint32_t)tu_below(&w->r, 13);
        if (c.len + tail > MAXT)
            tail = MAXT - c.len;
        rand_tokens(w, c.tok + c.len, tail);
        c.len += tail;
        kvh_seq s;
        st = CALL(kvh_seq_create(e, (uint32_t)w->mw->t, &s));
        if (!okay(w, st, 0, "seq_create"))
            return;
        size_t matched = 0;
        st = CALL(kvh_seq_match_prefix(e, s, c.tok, c.len, &matched));
        if (!okay(w, st, 0, "seq_match_prefix")) {
            if (!w->halted)
                CALL(kvh_seq_free(e, s));
            return;
        }
        if (matched % BT || matched > c.len) {
            mt_report(w->mw, "seed %#" PRIx64 " thread %d op %ld: match_prefix matched %zu of %u tokens", G.seed,
                      w->mw->t, w->op, matched, c.len);
            return;
        }
        atomic_fetch_add(&G.matched_tokens, (long)matched);
        uint64_t len = 0;
        st = CALL(kvh_seq_length(e, s, &len));
        if (okay(w, st, 0, "seq_length") && len != matched)
            mt_report(w->mw, "thread %d op %ld: matched %zu tokens, length %" PRIu64, w->mw->t, w->op, matched, len);
        c.wr[0] = c.wr[1] = (uint32_t)matched;
        content m = c;
        m.len = (uint32_t)matched;
        /* The attached blocks carry the K/V of whoever published them:
         * the oracle's, since it depends on the prefix alone. */
        for (uint32_t l = 0; l < L && matched; l++)
            if (check_read(w, s, &m, l, 0, (uint32_t)matched, BIT(KVH_ERR_NOSPACE)) == KVH_ERR_INTERNAL)
                break;
        if (w->halted)
            return;
        st = CALL(kvh_seq_append(e, s, c.tok + matched, c.len - matched));
        if (!okay(w, st, BIT(KVH_ERR_NOSPACE), "seq_append (after match)"))
            c.len = (uint32_t)matched;
        w->s[i] = s;
        w->c[i] = c;
        if (!w->halted)
            fill(w, s, &w->c[i]);
    }
    atomic_store(&G.pub[w->mw->t][i], w->s[i].id);
}

static void op_append(wk *w, int i)
{
    w->opname = "append+write";
    content *c = &w->c[i];
    uint32_t n = 1 + (uint32_t)tu_below(&w->r, 6);
    if (c->len + n > MAXT)
        return;
    rand_tokens(w, c->tok + c->len, n);
    kvh_status st = CALL(kvh_seq_append(w->mw->e, w->s[i], c->tok + c->len, n));
    if (!okay(w, st, BIT(KVH_ERR_NOSPACE), "seq_append"))
        return;
    c->len += n;
    fill(w, w->s[i], c);
}

/* Writes the oracle's values again over written cells: a full, fully
 * written or shared block goes to a copy, which must hold the same. */
static void op_rewrite(wk *w, int i)
{
    w->opname = "rewrite";
    content *c = &w->c[i];
    uint32_t l = (uint32_t)tu_below(&w->r, L);
    if (!c->wr[l])
        return;
    uint32_t pos = (uint32_t)tu_below(&w->r, c->wr[l]);
    uint32_t n = 1 + (uint32_t)tu_below(&w->r, c->wr[l] - pos < 8 ? c->wr[l] - pos : 8);
    kvh_status st = write_range(w, w->s[i], c, l, pos, n);
    if (okay(w, st, BIT(KVH_ERR_NOSPACE), "write_kv (rewrite)"))
        atomic_fetch_add(&G.cow_writes, 1);
}

static void op_read(wk *w, int i)
{
    w->opname = "read";
    content *c = &w->c[i];
    uint32_t l = (uint32_t)tu_below(&w->r, L);
    if (c->wr[l]) {
        uint32_t pos = (uint32_t)tu_below(&w->r, c->wr[l]);
        uint32_t n = 1 + (uint32_t)tu_below(&w->r, c->wr[l] - pos);
        check_read(w, w->s[i], c, l, pos, n, BIT(KVH_ERR_NOSPACE));
    }
    if (w->halted)
        return;
    /* One past the end is out of range, whatever is cached. */
    float k[ROWF];
    kvh_status st = CALL(kvh_seq_read_kv(w->mw->e, w->s[i], l, c->len, 1, k, NULL));
    if (!gone(w, st) && st != KVH_ERR_RANGE)
        mt_report(w->mw, "thread %d op %ld: read_kv past the end (%u) returned %s", w->mw->t, w->op, c->len,
                  kvh_status_name(st));
}

static void op_truncate(wk *w, int i)
{
    w->opname = "truncate";
    content *c = &w->c[i];
    uint32_t n = (uint32_t)tu_below(&w->r, c->len + 1);
    kvh_status st = CALL(kvh_seq_truncate(w->mw->e, w->s[i], n));
    if (!okay(w, st, BIT(KVH_ERR_NOSPACE), "seq_truncate"))
        return;
    c->len = n;
    for (uint32_t l = 0; l < L; l++)
        c->wr[l] = c->wr[l] < n ? c->wr[l] : n;
}

/* Holds a range in the device tier as an attention call would, reads it
 * there, releases it. */
static void op_acquire(wk *w, int i)
{
    w->opname = "acquire";
    kvh_engine *e = w->mw->e;
    content *c = &w->c[i];
    uint32_t wr = c->wr[0] < c->wr[1] ? c->wr[0] : c->wr[1];
    if (!wr)
        return;
    uint32_t first = (uint32_t)tu_below(&w->r, wr);
    uint32_t n = 1 + (uint32_t)tu_below(&w->r, wr - first < 2 * BT ? wr - first : 2 * BT);
    kvh_status st;
    bool fenced = tu_below(&w->r, 2);
    if (fenced) {
        kvh_fence f = {0};
        st = CALL(kvh_seq_acquire(e, w->s[i], first, n, &f));
        if (!okay(w, st, 0, "seq_acquire (fence)"))
            return;
        st = FENCE_WAIT(e, f);
        kvh_status fst = st;
        okay(w, st, BIT(KVH_ERR_NOSPACE), "fence_wait (acquire)");
        if (!w->halted)
            okay(w, CALL(kvh_fence_free(e, f)), 0, "fence_free");
        if (w->halted)
            return;
        if (fst == KVH_OK)
            for (uint32_t l = 0; l < L; l++)
                check_read(w, w->s[i], c, l, first, n, 0);
        /* With a fence the holds stay even after a failure. */
        if (!w->halted)
            okay(w, CALL(kvh_seq_release(e, w->s[i], first, n)), 0, "seq_release (fence)");
        return;
    }
    st = CALL(kvh_seq_acquire(e, w->s[i], first, n, NULL));
    if (!okay(w, st, BIT(KVH_ERR_NOSPACE), "seq_acquire"))
        return;
    for (uint32_t l = 0; l < L && !w->halted; l++)
        check_read(w, w->s[i], c, l, first, n, 0);
    if (w->halted)
        return;
    int32_t indptr[2], idx[MAXT / BT + 1], last;
    kvh_seq one = w->s[i];
    /* The whole sequence need not be resident, but a held one-block
     * sequence is: only ask when the hold covers it all. */
    if (first == 0 && n == c->len) {
        st = CALL(kvh_block_table(e, &one, 1, indptr, idx, MAXT / BT + 1, &last));
        okay(w, st, 0, "block_table (held)");
    }
    if (!w->halted)
        okay(w, CALL(kvh_seq_release(e, w->s[i], first, n)), 0, "seq_release");
}

/* @threads any calls on a sequence that another thread may be using,
 * truncating or freeing meanwhile. */
static void op_foreign(wk *w)
{
    kvh_engine *e = w->mw->e;
    kvh_seq s = pick_foreign(w);
    if (!s.id)
        return;
    const unsigned gone_seq = BIT(KVH_ERR_BAD_HANDLE) | BIT(KVH_ERR_RANGE);
    uint64_t len = 0;
    w->opname = "foreign length";
    kvh_status st = CALL(kvh_seq_length(e, s, &len));
    if (!okay(w, st, BIT(KVH_ERR_BAD_HANDLE), "seq_length") || !len)
        return;
    uint64_t first = tu_below(&w->r, len), n = 1 + tu_below(&w->r, len - first);
    kvh_fence f = {0};
    switch (tu_below(&w->r, 4)) {
    case 0:
        w->opname = "foreign hint";
        okay(w, CALL(kvh_seq_hint(e, s, first, n, (int32_t)tu_below(&w->r, 1000))), gone_seq, "seq_hint");
        return;
    case 1:
        w->opname = "foreign prefetch";
        st = CALL(kvh_prefetch(e, s, first, n, (int32_t)tu_below(&w->r, 1000), &f));
        break;
    default:
        w->opname = "foreign migrate";
        st = CALL(kvh_seq_migrate(e, s, first, n, tu_below(&w->r, 2) ? KVH_TIER_DISK : KVH_TIER_HOST, &f));
        break;
    }
    if (!okay(w, st, gone_seq, "prefetch/seq_migrate"))
        return;
    /* Moves may find no room (NOSPACE) or a block held or pinned (BUSY). */
    st = FENCE_WAIT(e, f);
    okay(w, st, BIT(KVH_ERR_NOSPACE) | BIT(KVH_ERR_BUSY), "fence_wait (move)");
    if (!w->halted)
        okay(w, CALL(kvh_fence_free(e, f)), 0, "fence_free");
}

static void op_lookup(wk *w)
{
    w->opname = "prefix lookup";
    const content *rc = &G.root_c[tu_below(&w->r, NROOT)];
    kvh_block out[MAXT / BT];
    size_t nb = 0;
    kvh_status st = CALL(kvh_prefix_lookup(w->mw->e, rc->tok, rc->len, out, MAXT / BT, &nb));
    if (!okay(w, st, 0, "prefix_lookup"))
        return;
    if (nb > rc->len / BT)
        mt_report(w->mw, "thread %d: prefix_lookup of %u tokens gave %zu blocks", w->mw->t, rc->len, nb);
    for (size_t b = 0; b < nb && !w->halted; b++) {
        kvh_block_info bi = {.struct_size = sizeof(bi)};
        st = CALL(kvh_block_info_get(w->mw->e, out[b], &bi));
        if (okay(w, st, 0, "block_info_get") && (bi.tokens != BT || !bi.published))
            mt_report(w->mw, "thread %d: looked-up block %zu has %u tokens, published %u", w->mw->t, b, bi.tokens,
                      bi.published);
        if (!w->halted)
            okay(w, CALL(kvh_block_release(w->mw->e, out[b])), 0, "block_release");
    }
}

/* Reads a shared system prompt that other threads fork, read and replace. */
static void op_read_shared(wk *w)
{
    w->opname = "read shared";
    int r = (int)tu_below(&w->r, NROOT);
    kvh_seq s = {atomic_load(&G.root_h[r])};
    const content *c = &G.root_c[r];
    uint32_t l = (uint32_t)tu_below(&w->r, L), pos = (uint32_t)tu_below(&w->r, c->len);
    uint32_t n = 1 + (uint32_t)tu_below(&w->r, c->len - pos);
    kvh_status st = check_read(w, s, c, l, pos, n, BIT(KVH_ERR_BUSY) | BIT(KVH_ERR_BAD_HANDLE) | BIT(KVH_ERR_NOSPACE));
    if (st == KVH_ERR_BUSY || st == KVH_ERR_BAD_HANDLE)
        atomic_fetch_add(&G.busy_shared, 1);
}

/* Builds a new copy of prompt r (match + fill), publishes it in place of
 * the old one and frees that, retrying while another thread is inside it. */
static void op_replace_shared(wk *w)
{
    w->opname = "replace shared";
    kvh_engine *e = w->mw->e;
    int r = (int)tu_below(&w->r, NROOT);
    content c = G.root_c[r];
    kvh_seq s;
    kvh_status st = CALL(kvh_seq_create(e, 100, &s));
    if (!okay(w, st, 0, "seq_create"))
        return;
    size_t matched = 0;
    st = CALL(kvh_seq_match_prefix(e, s, c.tok, c.len, &matched));
    if (okay(w, st, 0, "match_prefix (prompt)") && matched < c.len / BT * BT) {
        /* The old copy still holds every full block of the prompt, and
         * persisted them: they are cached and must be found. */
        mt_report(w->mw, "seed %#" PRIx64 " thread %d op %ld: prompt %d matched %zu of %u tokens while alive", G.seed,
                  w->mw->t, w->op, r, matched, c.len);
    }
    if (w->halted)
        return;
    st = CALL(kvh_seq_append(e, s, c.tok + matched, c.len - matched));
    bool good = okay(w, st, BIT(KVH_ERR_NOSPACE), "seq_append (prompt)");
    c.wr[0] = c.wr[1] = (uint32_t)matched;
    if (good && !w->halted)
        fill(w, s, &c);
    if (w->halted)
        return;
    if (!good || c.wr[0] < c.len || c.wr[1] < c.len) {
        CALL(kvh_seq_free(e, s));
        return;
    }
    for (uint32_t l = 0; l < L; l++)
        if (check_read(w, s, &c, l, 0, c.len, BIT(KVH_ERR_NOSPACE)) == KVH_ERR_INTERNAL || w->halted)
            return;
    kvh_seq old = {atomic_exchange(&G.root_h[r], s.id)};
    /* Threads that read the old handle before the exchange make one call
     * each on it at most: BUSY ends when they have. */
    double t0 = dt_now();
    long tries = 0;
    for (;; tries++) {
        st = CALL(kvh_seq_free(e, old));
        if (st != KVH_ERR_BUSY)
            break;
        if (dt_now() - t0 > 5.0) {
            mt_report(w->mw,
                      "seed %#" PRIx64
                      " thread %d op %ld: seq_free of a replaced prompt stayed BUSY for %.1f s (%ld tries): %s",
                      G.seed, w->mw->t, w->op, dt_now() - t0, tries, kvh_last_error());
            return;
        }
        sched_yield();
    }
    okay(w, st, 0, "seq_free (replaced prompt)");
}

static void op_persist(wk *w, int i)
{
    w->opname = "persist";
    content *c = &w->c[i];
    if (c->len < BT || c->wr[0] < c->len || c->wr[1] < c->len)
        return;
    kvh_status st;
    for (int tries = 0; tries < 100; tries++) {
        st = CALL(kvh_seq_persist(w->mw->e, w->s[i]));
        if (st != KVH_ERR_BUSY)
            break;
    }
    if (!okay(w, st, BIT(KVH_ERR_BUSY), "seq_persist"))
        return;
    atomic_fetch_add(&G.persists, 1);
    w->frozen[i] = true;
    pthread_mutex_lock(&G.mu);
    if (G.n_pers < MAX_PERSISTED)
        G.pers[G.n_pers++] = (persisted){.c = *c, .kept = true};
    pthread_mutex_unlock(&G.mu);
}

static void step(wk *w)
{
    w->op++;
    int i = (int)tu_below(&w->r, NPRIV);
    uint64_t dice = tu_below(&w->r, 100);
    if (dice < 12) {
        op_foreign(w);
        return;
    }
    if (dice < 17) {
        op_lookup(w);
        return;
    }
    if (dice < 25) {
        op_read_shared(w);
        return;
    }
    if (dice < 26) {
        op_replace_shared(w);
        return;
    }
    if (!w->s[i].id) {
        op_create(w, i);
        return;
    }
    if (dice < 45) {
        op_read(w, i);
        return;
    }
    if (dice < 57) {
        op_acquire(w, i);
        return;
    }
    if (w->frozen[i]) {
        if (dice < 60) {
            /* A fork of a persisted sequence is an ordinary private one. */
            for (int j = 0; j < NPRIV; j++)
                if (!w->s[j].id) {
                    w->opname = "fork persisted";
                    kvh_seq child;
                    kvh_status st = CALL(kvh_seq_fork(w->mw->e, w->s[i], (uint32_t)w->mw->t, &child));
                    if (okay(w, st, 0, "seq_fork (persisted)")) {
                        w->s[j] = child;
                        w->c[j] = w->c[i];
                        atomic_store(&G.pub[w->mw->t][j], child.id);
                    }
                    break;
                }
        }
        return;
    }
    int n_frozen = 0;
    for (int j = 0; j < NPRIV; j++)
        n_frozen += w->frozen[j];
    if (dice < 72)
        op_append(w, i);
    else if (dice < 80)
        op_rewrite(w, i);
    else if (dice < 88)
        op_truncate(w, i);
    else if (dice < 97)
        op_free(w, i);
    else if (n_frozen < 1)
        op_persist(w, i);
}

static void *worker(void *arg)
{
    mt_worker *mw = arg;
    wk *w = &W[mw->t];
    *w = (wk){.mw = mw, .r = {G.seed ^ (0x1000193ull * (uint64_t)(mw->t + 1))}};
    while (!atomic_load(&G.stop) && !w->halted && !mw->errors)
        step(w);
    atomic_store(&G.left[mw->t], 1);
    return NULL;
}

/* ---- setup and checks on the main thread ---- */

static void make_roots(kvh_engine *e)
{
    static const uint32_t lens[NROOT] = {6, 10, 8, 13};
    for (int r = 0; r < NROOT; r++) {
        content *c = &G.root_c[r];
        *c = (content){.len = lens[r]};
        /* Prompts 0 and 1 share their first tokens, 2 and 3 theirs. */
        for (uint32_t p = 0; p < c->len; p++)
            c->tok[p] = (int32_t)((r < 2 ? 100 : 500) + p);
        kvh_seq s = tu_seq_new(e, 100);
        assert_ok(kvh_seq_append(e, s, c->tok, c->len));
        for (uint32_t l = 0; l < L; l++) {
            float k[MAXT * ROWF], v[MAXT * ROWF];
            oracle(c, l, 0, c->len, k, v);
            assert_ok(kvh_seq_write_kv(e, s, l, 0, c->len, k, v));
        }
        c->wr[0] = c->wr[1] = c->len;
        assert_ok(kvh_seq_persist(e, s));
        G.pers[G.n_pers++] = (persisted){.c = *c, .kept = true};
        atomic_store(&G.root_h[r], s.id);
    }
}

static bool read_all(kvh_engine *e, kvh_seq s, const content *c, uint32_t upto, char *msg, size_t len)
{
    for (uint32_t l = 0; l < L; l++) {
        uint32_t n = upto ? upto : c->wr[l];
        if (!n)
            continue;
        float k[MAXT * ROWF], v[MAXT * ROWF], ek[MAXT * ROWF], ev[MAXT * ROWF];
        kvh_status st = kvh_seq_read_kv(e, s, l, 0, n, k, v);
        if (st != KVH_OK) {
            snprintf(msg, len, "read_kv of %u tokens, layer %u: %s: %s", n, l, kvh_status_name(st), kvh_last_error());
            return false;
        }
        oracle(c, l, 0, n, ek, ev);
        if (memcmp(k, ek, n * ROWF * 4) != 0 || memcmp(v, ev, n * ROWF * 4) != 0) {
            snprintf(msg, len, "layer %u of a %u-token sequence differs from the oracle", l, n);
            return false;
        }
    }
    return true;
}

/* After the threads: every live sequence and prompt reads back whole. */
static void check_survivors(kvh_engine *e)
{
    char msg[256];
    for (int t = 0; t < NTHR; t++)
        for (int i = 0; i < NPRIV; i++) {
            wk *w = &W[t];
            if (!w->s[i].id)
                continue;
            uint64_t len = 0;
            assert_ok(kvh_seq_length(e, w->s[i], &len));
            assert_int_equal(len, w->c[i].len);
            if (!read_all(e, w->s[i], &w->c[i], 0, msg, sizeof(msg)))
                fail_msg("seed %#" PRIx64 " thread %d sequence %d: %s", G.seed, t, i, msg);
        }
    for (int r = 0; r < NROOT; r++)
        if (!read_all(e, (kvh_seq){atomic_load(&G.root_h[r])}, &G.root_c[r], 0, msg, sizeof(msg)))
            fail_msg("seed %#" PRIx64 " prompt %d: %s", G.seed, r, msg);
}

/* Reopens the store and matches every persisted prefix: a kept one is
 * found to its last full block, and whatever is found reads right. */
static void check_reopen_n(const kvh_config *cfg, int min_found)
{
    kvh_engine *e = NULL;
    assert_ok(kvh_engine_open(cfg, &e));
    tu_track_engine(e);
    char msg[256];
    int found = 0;
    for (int p = 0; p < G.n_pers; p++) {
        const content *c = &G.pers[p].c;
        uint32_t full = c->len / BT * BT;
        kvh_seq s = tu_seq_new(e, 0);
        size_t matched = 0;
        assert_ok(kvh_seq_match_prefix(e, s, c->tok, full, &matched));
        if (G.pers[p].kept && matched != full)
            fail_msg("seed %#" PRIx64 " persisted prefix %d of %u tokens: the reopened store matched %zu", G.seed, p,
                     full, matched);
        if (matched && !read_all(e, s, c, (uint32_t)matched, msg, sizeof(msg)))
            fail_msg("seed %#" PRIx64 " persisted prefix %d after reopen: %s", G.seed, p, msg);
        found += matched == full;
        assert_ok(kvh_seq_free(e, s));
    }
    assert_true(found >= min_found);
    assert_ok(tu_close(e));
}

static void check_reopen(const kvh_config *cfg) { check_reopen_n(cfg, NROOT); }

static void reset_globals(uint64_t seed)
{
    G.seed = seed;
    G.e = NULL;
    atomic_store(&G.stop, 0);
    atomic_store(&G.halt, 0);
    G.close_mode = false;
    G.n_pers = 0;
    for (int t = 0; t < NTHR; t++) {
        atomic_store(&G.left[t], 0);
        atomic_store(&G.doing[t], "no call");
        for (int i = 0; i < NPRIV; i++)
            atomic_store(&G.pub[t][i], 0);
    }
    atomic_store(&G.reads_ok, 0);
    atomic_store(&G.cells_ok, 0);
    atomic_store(&G.closed_seen, 0);
    atomic_store(&G.busy_shared, 0);
    atomic_store(&G.forks_shared, 0);
    atomic_store(&G.cow_writes, 0);
    atomic_store(&G.persists, 0);
    atomic_store(&G.matched_tokens, 0);
}

static kvh_config make_cfg(const char *dir, uint32_t copy_moves)
{
    kvh_config c = dt_cfg((dt_geo){L, H, D, BT, KVH_DTYPE_F32}, dir, DEV_BLOCKS, HOST_BLOCKS, DISK_SLOTS, 2);
    c.copy_moves = copy_moves;
    return c;
}

static double run_seconds(double def)
{
    const char *s = getenv("KVH_MT_SECONDS");
    return s && *s ? atof(s) : def;
}

static void integrity_run(uint32_t copy_moves, uint64_t seed)
{
    char dir[512];
    dt_scratch(copy_moves ? "seq_integrity_copy" : "seq_integrity", dir, sizeof(dir));
    reset_globals(seed);
    kvh_config cfg = make_cfg(dir, copy_moves);
    kvh_engine *e = tu_open_cfg(&cfg);
    G.e = e;
    make_roots(e);
    mt_worker mw[NTHR];
    mt_run_for(e, NTHR, worker, mw, run_seconds(3.0), &G.stop);
    check_survivors(e);

    kvh_stats st = tu_stats(e);
    print_message("seed %#" PRIx64 ": %ld reads (%ld cells) checked, %ld shared forks, %ld BUSY/stale on shared, %ld "
                  "rewrites, %ld persists, %ld tokens matched; cow %" PRIu64 ", d->h %" PRIu64 " h->disk %" PRIu64
                  " disk->h %" PRIu64 " in place %" PRIu64 ", prefix hits %" PRIu64 "\n",
                  seed, atomic_load(&G.reads_ok), atomic_load(&G.cells_ok), atomic_load(&G.forks_shared),
                  atomic_load(&G.busy_shared), atomic_load(&G.cow_writes), atomic_load(&G.persists),
                  atomic_load(&G.matched_tokens), st.cow_copies, st.blocks_device_to_host, st.blocks_host_to_disk,
                  st.blocks_disk_to_host, st.blocks_moved_in_place, st.prefix_hit_blocks);
    /* The run did what it is for: reads checked, copies on write, blocks
     * through every tier, prefixes found. */
    assert_true(atomic_load(&G.reads_ok) > 100);
    assert_true(st.cow_copies > 0);
    assert_true(st.blocks_host_to_disk > 0 && st.blocks_disk_to_host > 0);
    assert_true(st.prefix_hit_blocks > 0);
    assert_true(atomic_load(&G.forks_shared) > 0);

    assert_ok(tu_close(e));
    check_reopen(&cfg);
    dt_rmrf(dir);
}

static void test_integrity_shared_arena(void **state)
{
    (void)state;
    integrity_run(0, tu_seed(0x51c0ffee));
}

static void test_integrity_copy_moves(void **state)
{
    (void)state;
    integrity_run(1, tu_seed(0x51c0ffee) ^ 0xc0b1);
}

/* A uffd_gate holds kvh_engine_close after it has begun, with black-box
 * means only: close, which stops the workers, cannot free the engine while
 * the gate holds one. So the threads race a close that is under way (their
 * calls must get KVH_ERR_CLOSED), never the free. */
/* Threads run the mix while the main thread closes the engine. A call in
 * flight when close begins completes as usual (close waits for it); one
 * that starts after gets KVH_ERR_CLOSED; nothing else, and every read that
 * returns KVH_OK is right. With the gate, close is held until every thread
 * has seen KVH_ERR_CLOSED and stopped. Without userfaultfd the threads
 * instead check a flag set just before close and make no call once they
 * see it (a window of a few instructions, close must not pass it). */
static void test_close_races_threads(void **state)
{
    (void)state;
    uint64_t seed = tu_seed(0xc105e);
    long closed = 0;
    int gated = 0;
    for (int round = 0; round < 4; round++) {
        char dir[512];
        dt_scratch("seq_integrity_close", dir, sizeof(dir));
        reset_globals(seed + (uint64_t)round);
        G.close_mode = true;
        kvh_config cfg = make_cfg(dir, round & 1);
        kvh_engine *e = NULL;
        assert_ok(kvh_engine_open(&cfg, &e));
        G.e = e;
        make_roots(e);
        mt_worker mw[NTHR];
        pthread_t th[NTHR];
        mt_start(e, NTHR, worker, mw, th);
        tu_rng r = {seed + (uint64_t)round};
        dt_sleep_ms(50 + (double)tu_below(&r, 300));
        uffd_gate g;
        bool gate = uffd_gate_arm(e, &g, (uffd_gate_geometry){L, BT, H, D}, 77000);
        mt_closer c = {.e = e};
        pthread_t ct;
        if (!gate)
            atomic_store_explicit(&G.halt, 1, memory_order_release);
        assert_int_equal(pthread_create(&ct, NULL, mt_close_thread, &c), 0);
        if (gate) {
            gated++;
            /* Every thread ends at its first KVH_ERR_CLOSED (or error). */
            double t0 = dt_now();
            for (int t = 0; t < NTHR; t++)
                while (!atomic_load(&G.left[t]) && dt_now() - t0 < 20.0)
                    dt_sleep_ms(1);
            bool all = true;
            for (int t = 0; t < NTHR; t++)
                all &= atomic_load(&G.left[t]) != 0;
            char stuck[256] = "";
            for (int t = 0; t < NTHR; t++)
                if (!atomic_load(&G.left[t]))
                    snprintf(stuck + strlen(stuck), sizeof(stuck) - strlen(stuck), " thread %d in %s;", t,
                             (const char *)atomic_load(&G.doing[t]));
            if (!all)
                atomic_store_explicit(&G.halt, 1, memory_order_release);
            bool early = atomic_load(&c.done);
            uffd_gate_open(&g);
            pthread_join(ct, NULL);
            mt_join(NTHR, th, mw);
            uffd_gate_free(&g);
            if (early)
                fail_msg("round %d: kvh_engine_close returned while a worker was inside a gather", round);
            if (!all)
                fail_msg("seed %#" PRIx64 " round %d: calls had not returned 20 s into kvh_engine_close:%s", seed,
                         round, stuck);
        } else {
            pthread_join(ct, NULL);
            mt_join(NTHR, th, mw);
        }
        if (c.st != KVH_OK)
            fail_msg("seed %#" PRIx64 " round %d: kvh_engine_close returned %s: %s", G.seed, round,
                     kvh_status_name(c.st), kvh_last_error());
        /* Each thread stops at its first KVH_ERR_CLOSED. */
        if (gate && atomic_load(&G.closed_seen) != NTHR)
            fail_msg("round %d: %ld KVH_ERR_CLOSED for %d threads", round, atomic_load(&G.closed_seen), NTHR);
        closed += atomic_load(&G.closed_seen);
        assert_true(atomic_load(&G.reads_ok) > 0);
        /* The prompts alive at close are found whole; the threads' persisted
         * prefixes must read right as far as they are found (their
         * durability after a rewrite is what the tests above check). */
        for (int p = NROOT; p < G.n_pers; p++)
            G.pers[p].kept = false;
        check_reopen(&cfg);
        dt_rmrf(dir);
    }
    print_message("seed %#" PRIx64 ": %d gated rounds, %ld calls got KVH_ERR_CLOSED\n", seed, gated, closed);
}

/* The oracle's mix reduced to one thread: a sequence rewrites a written
 * full block (which goes to a copy, the published original staying
 * cached, or held by a fork when `forked`), is persisted and stays alive;
 * the fork goes, and other cached blocks then fill the disk.
 * kvh_seq_persist: "a later process that opens the same disk_path finds
 * them with kvh_seq_match_prefix" and "a persisted block is kept there
 * while a sequence or handle references it". */
static void persisted_live_sequence_survives_full_disk(bool forked)
{
    char dir[512];
    dt_scratch(forked ? "seq_integrity_persist_fork" : "seq_integrity_persist", dir, sizeof(dir));
    reset_globals(tu_seed(0x9e75));
    kvh_config cfg = dt_cfg((dt_geo){L, H, D, BT, KVH_DTYPE_F32}, dir, 2, 2, 8, 0);
    kvh_engine *e = tu_open_cfg(&cfg);
    content a = {.len = BT};
    for (uint32_t p = 0; p < BT; p++)
        a.tok[p] = (int32_t)(7000 + p);
    kvh_seq s = tu_seq_new(e, 0), f = {0};
    assert_ok(kvh_seq_append(e, s, a.tok, a.len));
    float k[MAXT * ROWF], v[MAXT * ROWF];
    for (uint32_t l = 0; l < L; l++) {
        oracle(&a, l, 0, a.len, k, v);
        assert_ok(kvh_seq_write_kv(e, s, l, 0, a.len, k, v));
    }
    a.wr[0] = a.wr[1] = a.len;
    if (forked)
        assert_ok(kvh_seq_fork(e, s, 0, &f));
    /* Same values again: the full, written block goes to a copy. */
    oracle(&a, 0, 0, 1, k, v);
    assert_ok(kvh_seq_write_kv(e, s, 0, 0, 1, k, v));
    assert_ok(kvh_seq_persist(e, s));
    if (forked)
        assert_ok(kvh_seq_free(e, f));
    /* The published original, which only the persist still has a reason
     * to keep, goes to disk as caches do. */
    kvh_block orig;
    size_t nb = 0;
    assert_ok(kvh_prefix_lookup(e, a.tok, a.len, &orig, 1, &nb));
    assert_int_equal(nb, 1);
    assert_ok(kvh_migrate(e, &orig, 1, KVH_TIER_DISK, NULL));
    assert_int_equal(tu_binfo(e, orig).tier, KVH_TIER_DISK);
    assert_ok(kvh_block_release(e, orig));
    /* Other prefixes come and go, through the disk. */
    for (int32_t i = 0; i < 24; i++) {
        content o = {.len = BT};
        for (uint32_t p = 0; p < BT; p++)
            o.tok[p] = 9000 + 16 * i + (int32_t)p;
        kvh_seq x = tu_seq_new(e, 0);
        assert_ok(kvh_seq_append(e, x, o.tok, o.len));
        for (uint32_t l = 0; l < L; l++) {
            oracle(&o, l, 0, o.len, k, v);
            assert_ok(kvh_seq_write_kv(e, x, l, 0, o.len, k, v));
        }
        for (int u = 0; u < 4; u++) /* used more than the original */
            assert_ok(kvh_seq_read_kv(e, x, 0, 0, o.len, k, v));
        kvh_seq_migrate(e, x, 0, o.len, KVH_TIER_DISK, NULL);
        assert_ok(kvh_seq_free(e, x));
    }
    char msg[256];
    if (!read_all(e, s, &a, 0, msg, sizeof(msg)))
        fail_msg("the persisted sequence: %s", msg);
    kvh_seq m = tu_seq_new(e, 0);
    size_t live = 0;
    assert_ok(kvh_seq_match_prefix(e, m, a.tok, a.len, &live));
    assert_ok(kvh_seq_free(e, m));
    if (live != a.len)
        fail_msg("persisted, alive sequence: a live match finds %zu of %u tokens", live, a.len);
    assert_ok(tu_close(e));
    G.n_pers = 1;
    G.pers[0] = (persisted){.c = a, .kept = true};
    check_reopen_n(&cfg, 0);
    dt_rmrf(dir);
}

static void test_persisted_live_sequence_survives_full_disk(void **state)
{
    (void)state;
    persisted_live_sequence_survives_full_disk(false);
}

/* The same with the original held by a fork at the persist, which then
 * goes: the persisted sequence alone must keep it. */
static void test_persisted_twin_outlives_its_other_holder(void **state)
{
    (void)state;
    persisted_live_sequence_survives_full_disk(true);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_integrity_shared_arena, tu_teardown),
        cmocka_unit_test_teardown(test_integrity_copy_moves, tu_teardown),
        cmocka_unit_test_teardown(test_close_races_threads, tu_teardown),
        cmocka_unit_test_teardown(test_persisted_live_sequence_survives_full_disk, tu_teardown),
        cmocka_unit_test_teardown(test_persisted_twin_outlives_its_other_holder, tu_teardown),
    };
    if (getenv("KVH_TEST_FILTER"))
        cmocka_set_test_filter(getenv("KVH_TEST_FILTER"));
    return cmocka_run_group_tests_name("seq_integrity_hostile_mt", tests, NULL, NULL);
}
