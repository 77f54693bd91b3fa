/* Many threads doing everything at once, against a shadow of what each
 * sequence must hold: a randomized, multi-threaded test written from
 * kvh.h alone. Each thread owns its sequences (creates, appends, writes
 * K/V derived from (token prefix, layer, position), reads and checks
 * every byte, forks, truncates, frees, matches prefixes of shared token
 * families, acquires, pins, persists) and also makes the calls kvh.h
 * allows from any thread on blocks and sequences others own (migrations,
 * prefix lookups restored into a pool of its own, block handles, hints,
 * stats). Tiers are small so that blocks move all the time; with a disk
 * tier the store is reopened at the end and every persisted prefix read
 * back. Every refusal must be a status the call documents, with a
 * message; counters never go back; after everything is freed the memory
 * tiers are empty and every slot can be allocated again.
 *
 * Each configuration (seed, threads, migration workers, codec, disk,
 * tiny tiers, calls on others' sequences) runs in a child process for a
 * short time (KVH_OPS_FUZZ_SECONDS, default 0.4 s); a run that takes far
 * longer than that is a stall (fences waiting seconds on work nothing
 * runs: a lone worker waiting for a block whose move waits for it). */
#include <kvh/kvh.h>
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <time.h>
#include <sys/wait.h>
#include <unistd.h>

#define L 2
#define H 2
#define BT 4
#define MAXSEQ 3  /* per thread */
#define MAXTOK 20 /* max tokens per seq */
#define NFAM 4
#define FAMLEN 16
#define MAXT 6
#define POOLSLOTS 4
#define MAXSHARED 12

static uint32_t D = 8;
static uint32_t g_codec = 0;
static kvh_engine *E;
static int g_nthreads = 4;
static double g_secs = 2.0;
static int g_disk = 1;
static atomic_ulong g_progress;
static atomic_int g_stop;
static atomic_int g_fail;
static int g_verbose;
static int g_intrude;
static uint64_t g_seed;
static uint64_t g_block_bytes;
static uint32_t g_memcap = 1000;

static pthread_mutex_t g_log_mu = PTHREAD_MUTEX_INITIALIZER;
/* One line to stderr, whole, tagged with the kind and the seed. */
static void say(const char *kind, const char *fmt, va_list ap)
{
    pthread_mutex_lock(&g_log_mu);
    fprintf(stderr, "%s seed=%llu: ", kind, (unsigned long long)g_seed);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    fflush(stderr);
    pthread_mutex_unlock(&g_log_mu);
}
static void failf(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    say("FAIL", fmt, ap);
    va_end(ap);
    atomic_fetch_add(&g_fail, 1);
}
static void notef(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    say("NOTE", fmt, ap);
    va_end(ap);
}

static uint64_t mix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
typedef struct {
    uint64_t s;
} rng_t;
static uint64_t rnd(rng_t *r) { return r->s = mix64(r->s); }
static uint32_t rn(rng_t *r, uint32_t n) { return n ? (uint32_t)(rnd(r) % n) : 0; }

/* expected value of element */
static float val(uint64_t ph, uint32_t layer, uint32_t kind, uint32_t h, uint32_t d, uint32_t ver)
{
    uint64_t x = mix64(ph ^ ((uint64_t)layer << 40) ^ ((uint64_t)kind << 44) ^ ((uint64_t)h << 48) ^
                       ((uint64_t)d << 52) ^ ((uint64_t)ver * 0x1234567ull));
    return (float)((int)(x & 0xFFF) - 2048) / 16.0f;
}
static uint64_t roll(uint64_t prev, int32_t tok)
{
    return mix64(prev ^ ((uint64_t)(uint32_t)tok * 0x9E37ull) ^ 0x5555);
}

static int32_t g_fam[NFAM][FAMLEN];
static uint64_t g_famhash[NFAM][FAMLEN];

/* ---- status checking ---- */
#define S(x) (1u << (-(x)))
static atomic_ulong g_hist[16];
static int check_st(kvh_status st, uint32_t allowed, const char *what, int line)
{
    if (st <= 0 && st >= -15)
        atomic_fetch_add(&g_hist[-st], 1);
    if (g_verbose && st == KVH_ERR_NOSPACE) {
        /* One counter a source line (the file has over 1,000). */
        static _Atomic unsigned long ns[4096];
        if (line >= 0 && line < (int)(sizeof ns / sizeof ns[0]) && (atomic_fetch_add(&ns[line], 1) & 4095) == 0)
            fprintf(stderr, "nospace %s line %d x%lu\n", what, line, (unsigned long)ns[line]);
    }
    if (st == KVH_OK) {
        const char *e = kvh_last_error();
        if (e && *e)
            failf("%s (line %d): success with a stale kvh_last_error: %s", what, line, e);
        return 0;
    }
    if (g_intrude)
        allowed |= S(KVH_ERR_BUSY);
    if (st == KVH_ERR_CLOSED || st > 0 || st < -15 || !(allowed & S(st))) {
        failf("%s (line %d): undocumented status %s (%d): %s", what, line, kvh_status_name(st), st, kvh_last_error());
        return 1;
    }
    const char *e = kvh_last_error();
    if (!e || !*e)
        failf("%s (line %d): status %s with empty kvh_last_error", what, line, kvh_status_name(st));
    return 1;
}
#define CHK(st, allowed, what) check_st((st), (allowed), (what), __LINE__)

/* ---- shadow ---- */
typedef struct {
    int live;
    int priv;
    kvh_seq h;
    uint64_t scope;
    uint32_t len;
    int32_t tok[MAXTOK];
    uint64_t ph[MAXTOK];
    uint8_t written[L][MAXTOK];
    uint8_t ver[L][MAXTOK];
    int32_t plan[MAXTOK];   /* planned token stream */
    int hold_first, hold_n; /* one hold at a time; hold_n 0 = none */
    int pins;               /* pins on block 0 (count) */
    char lg[24][72];
    int nlg;
} sseq;
#define QLOG(q, ...) snprintf((q)->lg[(q)->nlg++ % 24], 72, __VA_ARGS__)
static void dump_seq(sseq *q)
{
    pthread_mutex_lock(&g_log_mu);
    int st = q->nlg > 24 ? q->nlg - 24 : 0;
    fprintf(stderr, "  history of seq %llx (priv %d len %u):\n", (unsigned long long)q->h.id, q->priv, q->len);
    for (int i = st; i < q->nlg; i++)
        fprintf(stderr, "    %s\n", q->lg[i % 24]);
    pthread_mutex_unlock(&g_log_mu);
}

typedef struct {
    int id;
    rng_t r;
    sseq s[MAXSEQ];
    kvh_pool pool;
    float *kb[L], *vb[L];
    kvh_block alloc[4];
    int nalloc;
    kvh_stats last;
    unsigned long ops;
} thr_t;

static thr_t T[MAXT];
/* published seq handles for cross-thread @any calls */
static _Atomic uint64_t g_pub[MAXT * MAXSEQ];
/* shared retained block handles (each entry owns one caller ref) */
static pthread_mutex_t g_sh_mu = PTHREAD_MUTEX_INITIALIZER;
static kvh_block g_sh[MAXSHARED];
static int g_nsh;

#define REGMAX (1 << 20)
static uint64_t *g_reg;
static atomic_ulong g_nreg;
static void reg_block(kvh_block b)
{
    unsigned long i = atomic_fetch_add(&g_nreg, 1);
    if (i < REGMAX)
        g_reg[i] = b.id;
}
static void sh_push(kvh_block b)
{
    reg_block(b);
    pthread_mutex_lock(&g_sh_mu);
    if (g_nsh < MAXSHARED) {
        g_sh[g_nsh++] = b;
        b.id = 0;
    }
    pthread_mutex_unlock(&g_sh_mu);
    if (b.id)
        CHK(kvh_block_release(E, b), 0, "release overflow");
}
static int sh_pop(rng_t *r, kvh_block *b)
{
    int ok = 0;
    pthread_mutex_lock(&g_sh_mu);
    if (g_nsh) {
        int i = rn(r, g_nsh);
        *b = g_sh[i];
        g_sh[i] = g_sh[--g_nsh];
        ok = 1;
    }
    pthread_mutex_unlock(&g_sh_mu);
    return ok;
}
static int sh_peek(rng_t *r, kvh_block *b)
{
    int ok = 0;
    pthread_mutex_lock(&g_sh_mu);
    if (g_nsh) {
        *b = g_sh[rn(r, g_nsh)];
        ok = 1;
    }
    pthread_mutex_unlock(&g_sh_mu);
    return ok;
}

static void recompute(sseq *q)
{
    uint64_t p = 0x77;
    for (uint32_t i = 0; i < q->len; i++) {
        p = roll(p, q->tok[i]);
        q->ph[i] = p;
    }
}

/* compare a vector of D floats */
static int cmp_vec(const float *got, uint64_t ph, uint32_t layer, uint32_t kind, uint32_t h, uint32_t ver, char *why)
{
    float exp[256];
    float mx = 0;
    for (uint32_t d = 0; d < D; d++) {
        exp[d] = val(ph, layer, kind, h, d, ver);
        if (fabsf(exp[d]) > mx)
            mx = fabsf(exp[d]);
    }
    for (uint32_t d = 0; d < D; d++) {
        float tol = 0;
        if (g_codec == KVH_CODEC_INT8)
            tol = mx / 254.0f * 1.0001f + 1e-6f;
        else if (g_codec) {
            /* groups = whole D (D == group) */
            float mn = exp[0], mxx = exp[0];
            for (uint32_t e = 0; e < D; e++) {
                if (exp[e] < mn)
                    mn = exp[e];
                if (exp[e] > mxx)
                    mxx = exp[e];
            }
            tol = (mxx - mn) / 30.0f * 1.0001f + 1e-6f;
        }
        if (!(fabsf(got[d] - exp[d]) <= tol)) {
            sprintf(why, "layer %u kind %u head %u d %u: got %g expected %g (tol %g)", layer, kind, h, d, got[d],
                    exp[d], tol);
            return 1;
        }
    }
    return 0;
}

static void write_range(thr_t *t, sseq *q, uint32_t layer, uint32_t pos, uint32_t n, uint32_t ver)
{
    size_t sz = (size_t)n * H * D;
    float *k = malloc(sz * 4), *v = malloc(sz * 4);
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t h = 0; h < H; h++)
            for (uint32_t d = 0; d < D; d++) {
                k[(i * H + h) * D + d] = val(q->ph[pos + i], layer, 0, h, d, ver);
                v[(i * H + h) * D + d] = val(q->ph[pos + i], layer, 1, h, d, ver);
            }
    kvh_status st = kvh_seq_write_kv(E, q->h, layer, pos, n, k, v);
    QLOG(q, "write l%u [%u,+%u) v%u -> %s", layer, pos, n, ver, kvh_status_name(st));
    if (!CHK(st, S(KVH_ERR_NOSPACE) | S(KVH_ERR_IO) | S(KVH_ERR_CORRUPT) | S(KVH_ERR_NOMEM), "write_kv")) {
        for (uint32_t i = 0; i < n; i++) {
            q->written[layer][pos + i] = 1;
            q->ver[layer][pos + i] = ver;
        }
    } else if (st != KVH_ERR_BUSY && (pos + n - 1) / BT - pos / BT + 1 > g_memcap) {
        /* kvh.h: written a block at a time; blocks before the failure may be written */
        for (uint32_t i = 0; i < n; i++)
            if (!q->written[layer][pos + i])
                q->written[layer][pos + i] = 2;
    }
    (void)t;
    free(k);
    free(v);
}

static void read_check(thr_t *t, sseq *q, uint32_t layer, uint32_t pos, uint32_t n, const char *ctx)
{
    size_t sz = (size_t)n * H * D;
    float *k = malloc(sz * 4), *v = malloc(sz * 4);
    memset(k, 0xCD, sz * 4);
    memset(v, 0xCD, sz * 4);
    int all = 1, unk = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!q->written[layer][pos + i])
            all = 0;
        if (q->written[layer][pos + i] == 2)
            unk = 1;
    }
    kvh_status st = kvh_seq_read_kv(E, q->h, layer, pos, n, k, v);
    if (unk && st == KVH_ERR_RANGE)
        goto out;
    if (unk && st == KVH_OK)
        all = 1;
    if (!all) {
        if (st == KVH_OK) {
            failf("%s: read_kv of never-written cells (seq %llx layer %u pos %u n %u) returned OK", ctx,
                  (unsigned long long)q->h.id, layer, pos, n);
            dump_seq(q);
            kvh_block bl[MAXTOK / BT + 1];
            size_t nb = (q->len + BT - 1) / BT;
            if (kvh_seq_blocks(E, q->h, 0, nb, bl) == KVH_OK)
                for (size_t k2 = 0; k2 < nb; k2++) {
                    kvh_block_info bi;
                    bi.struct_size = sizeof bi;
                    kvh_block_info_get(E, bl[k2], &bi);
                    fprintf(stderr, "   blk %zu %llx tier %u refs %u tokens %u published %u hash %llx\n", k2,
                            (unsigned long long)bl[k2].id, bi.tier, bi.refs, bi.tokens, bi.published,
                            (unsigned long long)bi.hash);
                }
        } else
            CHK(st, S(KVH_ERR_RANGE), "read_kv unwritten");
        goto out;
    }
    if (CHK(st, S(KVH_ERR_NOSPACE) | S(KVH_ERR_IO) | S(KVH_ERR_CORRUPT) | S(KVH_ERR_NOMEM), "read_kv"))
        goto out;
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t h = 0; h < H; h++) {
            char why[256];
            uint32_t ver = q->ver[layer][pos + i];
            if (cmp_vec(k + (i * H + h) * D, q->ph[pos + i], layer, 0, h, ver, why) ||
                cmp_vec(v + (i * H + h) * D, q->ph[pos + i], layer, 1, h, ver, why)) {
                failf("%s: WRONG DATA seq %llx priv %d tok %u (len %u): %s", ctx, (unsigned long long)q->h.id, q->priv,
                      pos + i, q->len, why);
                goto out;
            }
        }
out:
    (void)t;
    free(k);
    free(v);
}

static void release_hold(sseq *q)
{
    if (q->hold_n) {
        kvh_status st;
        while ((st = kvh_seq_release(E, q->h, q->hold_first, q->hold_n)) == KVH_ERR_BUSY && g_intrude)
            ;
        if (st != KVH_OK)
            failf("seq_release of held range: %s %s", kvh_status_name(st), kvh_last_error());
        q->hold_n = 0;
    }
}
static void unpin_all(sseq *q)
{
    while (q->pins) {
        kvh_status st;
        while ((st = kvh_seq_pin(E, q->h, 0, 1, 0)) == KVH_ERR_BUSY && g_intrude)
            ;
        if (st != KVH_OK) {
            failf("unpin: %s %s", kvh_status_name(st), kvh_last_error());
            break;
        }
        q->pins--;
    }
}

static void seq_kill(thr_t *t, int i)
{
    sseq *q = &t->s[i];
    if (rn(&t->r, 2)) {
        release_hold(q);
        unpin_all(q);
    }
    atomic_store(&g_pub[t->id * MAXSEQ + i], 0);
    if (q->len) {
        kvh_block bl[MAXTOK / BT + 1];
        size_t nb = (q->len + BT - 1) / BT;
        if (kvh_seq_blocks(E, q->h, 0, nb, bl) == KVH_OK)
            for (size_t k = 0; k < nb; k++)
                reg_block(bl[k]);
    }
    kvh_status st;
    while ((st = kvh_seq_free(E, q->h)) == KVH_ERR_BUSY && g_intrude)
        ;
    if (st != KVH_OK)
        failf("seq_free: %s %s", kvh_status_name(st), kvh_last_error());
    q->live = 0;
}

static uint64_t g_scope_ctr;
static void seq_new(thr_t *t, int i)
{
    sseq *q = &t->s[i];
    memset(q, 0, sizeof *q);
    kvh_status st = kvh_seq_create(E, rn(&t->r, 3), &q->h);
    if (CHK(st, S(KVH_ERR_NOMEM), "seq_create"))
        return;
    q->live = 1;
    q->priv = rn(&t->r, 3) == 0;
    if (q->priv) {
        q->scope = __atomic_add_fetch(&g_scope_ctr, 1, __ATOMIC_RELAXED) + 1000 * (uint64_t)t->id + (g_seed << 20);
        st = kvh_seq_set_scope(E, q->h, q->scope, 0, 0);
        while (st == KVH_ERR_BUSY && g_intrude)
            st = kvh_seq_set_scope(E, q->h, q->scope, 0, 0);
        if (st != KVH_OK)
            failf("set_scope: %s %s", kvh_status_name(st), kvh_last_error());
        for (int j = 0; j < MAXTOK; j++)
            q->plan[j] = (int32_t)(rnd(&t->r) & 0xFFFF) + 100000;
    } else {
        int f = rn(&t->r, NFAM);
        int div = rn(&t->r, FAMLEN + 1);
        for (int j = 0; j < MAXTOK; j++)
            q->plan[j] = j < div ? g_fam[f][j] : (int32_t)(rnd(&t->r) & 0xFF) + 1000;
        /* match prefix */
        if (rn(&t->r, 3)) {
            size_t m = 123456;
            uint32_t n = rn(&t->r, MAXTOK + 1);
            st = kvh_seq_match_prefix(E, q->h, q->plan, n, &m);
            if (!CHK(st, S(KVH_ERR_NOMEM), "match_prefix")) {
                if (m % BT || m > n) {
                    failf("match_prefix matched %zu of %u", m, n);
                    m = 0;
                }
                uint64_t len = 999;
                kvh_seq_length(E, q->h, &len);
                if (len != m)
                    failf("match_prefix matched %zu but length %llu", m, (unsigned long long)len);
                q->len = m;
                QLOG(q, "match_prefix %u -> %zu", n, m);
                memcpy(q->tok, q->plan, m * 4);
                recompute(q);
                for (uint32_t l = 0; l < L; l++)
                    for (uint32_t p = 0; p < m; p++) {
                        q->written[l][p] = 1;
                        q->ver[l][p] = 0;
                    }
                if (m)
                    read_check(t, q, rn(&t->r, L), 0, m, "after match_prefix");
            }
        }
    }
    atomic_store(&g_pub[t->id * MAXSEQ + i], q->h.id);
}

static void op_fork(thr_t *t, int i)
{
    int j;
    for (j = 0; j < MAXSEQ; j++)
        if (!t->s[j].live)
            break;
    if (j == MAXSEQ)
        return;
    sseq *p = &t->s[i], *c = &t->s[j];
    kvh_seq ch;
    kvh_status st = kvh_seq_fork(E, p->h, rn(&t->r, 3), &ch);
    if (CHK(st, S(KVH_ERR_NOMEM), "fork"))
        return;
    *c = *p;
    QLOG(c, "forked from %llx at len %u", (unsigned long long)p->h.id, p->len);
    QLOG(p, "forked child %llx", (unsigned long long)ch.id);
    c->h = ch;
    c->hold_n = 0;
    c->pins = 0;
    /* child plans differ after its current length for private */
    if (c->priv)
        for (int k = c->len; k < MAXTOK; k++)
            c->plan[k] = (int32_t)(rnd(&t->r) & 0xFFFF) + 100000;
    atomic_store(&g_pub[t->id * MAXSEQ + j], ch.id);
    uint64_t sc = 0;
    kvh_seq_get_scope(E, ch, &sc, NULL, NULL);
    if (sc != p->scope)
        failf("fork child scope %llx != parent %llx", (unsigned long long)sc, (unsigned long long)p->scope);
    if (c->len)
        read_check(t, c, rn(&t->r, L), 0, c->len, "after fork (child)");
}

static int all_full_written(sseq *q)
{
    uint32_t full = q->len / BT * BT;
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t p = 0; p < full; p++)
            if (q->written[l][p] != 1)
                return q->written[l][p] == 2 ? 2 : 0;
    return 1;
}

static void wait_fence(kvh_fence f, uint32_t allowed, const char *what)
{
    kvh_status st = kvh_fence_wait(E, f, 20ull * 1000000000ull);
    if (st == KVH_ERR_TIMEOUT) {
        failf("%s: fence wait TIMEOUT after 20s", what);
        st = kvh_fence_wait(E, f, 60ull * 1000000000ull);
        failf("%s: after 60 s more the fence wait returns %s", what, kvh_status_name(st));
    } else
        CHK(st, allowed, what);
    int32_t done = 0;
    st = kvh_fence_poll(E, f, &done);
    if (st != KVH_ERR_TIMEOUT && !done && st == KVH_OK)
        failf("%s: fence poll not done after wait", what);
    st = kvh_fence_free(E, f);
    if (st != KVH_OK)
        failf("fence_free: %s", kvh_status_name(st));
}

static void check_stats(thr_t *t)
{
    kvh_stats s;
    s.struct_size = sizeof s;
    if (kvh_engine_stats(E, &s) != KVH_OK) {
        failf("stats failed");
        return;
    }
    const uint64_t *a = (const uint64_t *)((char *)&s + 8), *b = (const uint64_t *)((char *)&t->last + 8);
    size_t n = (sizeof s - 8) / 8;
    if (t->last.struct_size)
        for (size_t i = 0; i < n; i++)
            if (a[i] < b[i])
                failf("stats counter #%zu went backwards: %llu -> %llu", i, (unsigned long long)b[i],
                      (unsigned long long)a[i]);
    if (s.lookups != s.hits_device + s.hits_host + s.hits_disk)
        notef("lookups %llu != hits %llu+%llu+%llu", (unsigned long long)s.lookups, (unsigned long long)s.hits_device,
              (unsigned long long)s.hits_host, (unsigned long long)s.hits_disk);
    t->last = s;
    for (uint32_t tier = 0; tier < 3; tier++) {
        kvh_tier_info ti;
        ti.struct_size = sizeof ti;
        if (kvh_tier_info_get(E, tier, &ti) != KVH_OK) {
            failf("tier_info");
            continue;
        }
        if (ti.used_blocks > ti.capacity_blocks || ti.used_bytes != ti.used_blocks * ti.block_bytes)
            failf("tier %u info inconsistent: used %llu cap %llu bytes %llu bb %llu", tier,
                  (unsigned long long)ti.used_blocks, (unsigned long long)ti.capacity_blocks,
                  (unsigned long long)ti.used_bytes, (unsigned long long)ti.block_bytes);
    }
}

/* restore a retained block (of a family prefix: block index bi of family f) into pool and check */
static void check_block_via_pool(thr_t *t, kvh_block b, int f, int bi)
{
    uint32_t slot = rn(&t->r, POOLSLOTS);
    kvh_status st = kvh_pool_restore(E, t->pool, b, slot);
    if (CHK(st, S(KVH_ERR_CORRUPT) | S(KVH_ERR_IO) | S(KVH_ERR_NOSPACE) | S(KVH_ERR_NOMEM), "pool_restore"))
        return;
    for (uint32_t l = 0; l < L; l++)
        for (int tk = 0; tk < BT; tk++)
            for (uint32_t h = 0; h < H; h++) {
                char why[256];
                size_t off = ((size_t)slot * BT * H + tk * H + h) * D;
                uint64_t ph = g_famhash[f][bi * BT + tk];
                if (cmp_vec(t->kb[l] + off, ph, l, 0, h, 0, why) || cmp_vec(t->vb[l] + off, ph, l, 1, h, 0, why)) {
                    failf("prefix_lookup block %d of family %d (block %llx) restored WRONG DATA: %s", bi, f,
                          (unsigned long long)b.id, why);
                    return;
                }
            }
}

static void op_lookup(thr_t *t)
{
    int f = rn(&t->r, NFAM);
    size_t n = rn(&t->r, FAMLEN + 1);
    kvh_block out[FAMLEN / BT];
    size_t nb = 999;
    kvh_status st = kvh_prefix_lookup(E, g_fam[f], n, out, FAMLEN / BT, &nb);
    if (CHK(st, S(KVH_ERR_NOMEM), "prefix_lookup"))
        return;
    if (nb > n / BT) {
        failf("prefix_lookup returned %zu blocks for %zu tokens", nb, n);
        return;
    }
    for (size_t i = 0; i < nb; i++) {
        kvh_block_info bi;
        bi.struct_size = sizeof bi;
        st = kvh_block_info_get(E, out[i], &bi);
        if (st == KVH_OK && bi.tokens != BT)
            failf("looked-up block has %u tokens", bi.tokens);
        if (rn(&t->r, 2))
            check_block_via_pool(t, out[i], f, (int)i);
        if (rn(&t->r, 4) == 0)
            sh_push(out[i]);
        else {
            st = kvh_block_release(E, out[i]);
            if (st != KVH_OK)
                failf("release of looked-up block: %s %s", kvh_status_name(st), kvh_last_error());
        }
    }
}

static void op_cross(thr_t *t)
{
    /* @threads any calls on other threads' sequences */
    uint64_t id = atomic_load(&g_pub[rn(&t->r, g_nthreads * MAXSEQ)]);
    if (!id)
        return;
    kvh_seq s = {id};
    uint64_t len = 0;
    kvh_status st = kvh_seq_length(E, s, &len);
    if (CHK(st, S(KVH_ERR_BAD_HANDLE), "cross seq_length"))
        return;
    if (!len)
        return;
    uint64_t first = rn(&t->r, (uint32_t)len), n = 1 + rn(&t->r, (uint32_t)(len - first));
    switch (rn(&t->r, 5)) {
    case 0: {
        kvh_fence f;
        int usef = rn(&t->r, 2);
        st = kvh_seq_migrate(E, s, first, n, rn(&t->r, g_disk ? 3 : 2), usef ? &f : NULL);
        uint32_t al = S(KVH_ERR_BAD_HANDLE) | S(KVH_ERR_RANGE) | S(KVH_ERR_NOMEM) | S(KVH_ERR_NOSPACE) | S(KVH_ERR_IO) |
                      S(KVH_ERR_CORRUPT);
        if (!CHK(st, al, "cross seq_migrate") && usef)
            wait_fence(f, S(KVH_ERR_NOSPACE) | S(KVH_ERR_IO) | S(KVH_ERR_CORRUPT), "cross seq_migrate fence");
        break;
    }
    case 1:
        st = kvh_seq_hint(E, s, first, n, (int32_t)rnd(&t->r));
        CHK(st, S(KVH_ERR_BAD_HANDLE) | S(KVH_ERR_RANGE), "cross hint");
        break;
    case 2: {
        kvh_fence f;
        int usef = rn(&t->r, 2);
        st = kvh_prefetch(E, s, first, n, (int32_t)rn(&t->r, 100), usef ? &f : NULL);
        if (!CHK(st, S(KVH_ERR_BAD_HANDLE) | S(KVH_ERR_RANGE) | S(KVH_ERR_NOMEM), "cross prefetch") && usef)
            wait_fence(f, 0, "cross prefetch fence");
        break;
    }
    case 3: {
        int32_t indptr[2], idx[MAXTOK], lpl[1];
        st = kvh_block_table(E, &s, 1, indptr, idx, MAXTOK, lpl);
        CHK(st, S(KVH_ERR_BAD_HANDLE) | S(KVH_ERR_RANGE) | S(KVH_ERR_NOT_RESIDENT), "cross block_table");
        break;
    }
    case 4:
        st = kvh_seq_hint_queued(E, s, first, n, rn(&t->r, 8), KVH_HINT_POSITION);
        CHK(st, S(KVH_ERR_BAD_HANDLE) | S(KVH_ERR_RANGE), "cross hint_queued");
        if (rn(&t->r, 4) == 0) {
            uint64_t step;
            CHK(kvh_hint_advance(E, 1, &step), 0, "hint_advance");
        }
        break;
    }
}

static void op_intrude(thr_t *t)
{
    uint64_t id = atomic_load(&g_pub[rn(&t->r, g_nthreads * MAXSEQ)]);
    if (!id)
        return;
    kvh_seq s = {id};
    uint64_t len = 0, sc = 1;
    kvh_status st = kvh_seq_length(E, s, &len);
    if (CHK(st, S(KVH_ERR_BAD_HANDLE), "intrude seq_length") || !len)
        return;
    st = kvh_seq_get_scope(E, s, &sc, NULL, NULL);
    if (CHK(st, S(KVH_ERR_BAD_HANDLE), "intrude get_scope"))
        return;
    int32_t tk[MAXTOK];
    st = kvh_seq_tokens(E, s, 0, len, tk);
    if (CHK(st, S(KVH_ERR_BAD_HANDLE) | S(KVH_ERR_RANGE), "intrude seq_tokens"))
        return;
    if (rn(&t->r, 2)) {
        kvh_block b[MAXTOK / BT + 1];
        st = kvh_seq_blocks(E, s, 0, (len + BT - 1) / BT, b);
        CHK(st, S(KVH_ERR_BAD_HANDLE) | S(KVH_ERR_RANGE), "intrude seq_blocks");
        return;
    }
    uint32_t layer = rn(&t->r, L);
    size_t sz = (size_t)len * H * D;
    float *k = malloc(sz * 4), *v = malloc(sz * 4);
    st = kvh_seq_read_kv(E, s, layer, 0, len, k, v);
    if (!CHK(st,
             S(KVH_ERR_BAD_HANDLE) | S(KVH_ERR_RANGE) | S(KVH_ERR_NOSPACE) | S(KVH_ERR_IO) | S(KVH_ERR_CORRUPT) |
                 S(KVH_ERR_NOMEM),
             "intrude read_kv") &&
        sc == 0) {
        uint64_t ph = 0x77;
        for (uint32_t i = 0; i < len; i++) {
            ph = roll(ph, tk[i]);
            for (uint32_t h = 0; h < H; h++) {
                char why[256];
                if (cmp_vec(k + (i * H + h) * D, ph, layer, 0, h, 0, why) ||
                    cmp_vec(v + (i * H + h) * D, ph, layer, 1, h, 0, why)) {
                    failf("intruder read WRONG DATA seq %llx tok %u/%llu: %s", (unsigned long long)id, i,
                          (unsigned long long)len, why);
                    goto out;
                }
            }
        }
    }
out:
    free(k);
    free(v);
}

static void op_offload(thr_t *t)
{
    int f = rn(&t->r, NFAM), bi = rn(&t->r, FAMLEN / BT);
    uint32_t slot = rn(&t->r, POOLSLOTS);
    uint64_t parent = 0;
    for (int i = 0; i < bi; i++)
        if (kvh_prefix_hash(E, parent, g_fam[f] + i * BT, BT, &parent) != KVH_OK)
            failf("prefix_hash");
    for (uint32_t l = 0; l < L; l++)
        for (int tk = 0; tk < BT; tk++)
            for (uint32_t h = 0; h < H; h++)
                for (uint32_t d = 0; d < D; d++) {
                    size_t off = ((size_t)slot * BT * H + tk * H + h) * D + d;
                    uint64_t ph = g_famhash[f][bi * BT + tk];
                    t->kb[l][off] = val(ph, l, 0, h, d, 0);
                    t->vb[l][off] = val(ph, l, 1, h, d, 0);
                }
    kvh_block b;
    kvh_status st = kvh_pool_offload(E, t->pool, slot, parent, g_fam[f] + bi * BT, BT, rn(&t->r, 3), &b);
    if (CHK(st, S(KVH_ERR_NOSPACE) | S(KVH_ERR_NOMEM) | S(KVH_ERR_IO), "pool_offload"))
        return;
    kvh_block_info info;
    info.struct_size = sizeof info;
    st = kvh_block_info_get(E, b, &info);
    if (st != KVH_OK || info.tokens != BT)
        failf("offloaded block info: %s tokens %u", kvh_status_name(st), info.tokens);
    if (rn(&t->r, 2))
        check_block_via_pool(t, b, f, bi);
    if (rn(&t->r, 2))
        sh_push(b);
    else if ((st = kvh_block_release(E, b)) != KVH_OK)
        failf("release offloaded: %s %s", kvh_status_name(st), kvh_last_error());
}

static void op_blocks_persist(thr_t *t)
{
    kvh_block b;
    if (!sh_pop(&t->r, &b))
        return;
    kvh_fence f;
    int usef = rn(&t->r, 2);
    kvh_status st = kvh_blocks_persist(E, &b, 1, usef ? &f : NULL);
    uint32_t al = S(KVH_ERR_INVALID_ARG) | S(KVH_ERR_NOSPACE) | S(KVH_ERR_IO) | S(KVH_ERR_CORRUPT) | S(KVH_ERR_BUSY) |
                  S(KVH_ERR_NOMEM);
    if (!g_disk) {
        if (st != KVH_ERR_UNSUPPORTED)
            failf("blocks_persist without disk: %s", kvh_status_name(st));
    } else if (!CHK(st, al, "blocks_persist") && usef)
        wait_fence(f, al, "blocks_persist fence");
    sh_push(b);
}

static void op_shared_block(thr_t *t)
{
    kvh_block b;
    switch (rn(&t->r, 4)) {
    case 0:
        if (sh_pop(&t->r, &b)) {
            kvh_status st = kvh_block_release(E, b);
            if (st != KVH_OK)
                failf("release shared block %llx: %s %s", (unsigned long long)b.id, kvh_status_name(st),
                      kvh_last_error());
        }
        break;
    case 1:
        if (sh_peek(&t->r, &b)) {
            kvh_fence f;
            int usef = rn(&t->r, 2);
            kvh_status st = kvh_migrate(E, &b, 1, rn(&t->r, g_disk ? 3 : 2), usef ? &f : NULL);
            uint32_t al =
                S(KVH_ERR_BAD_HANDLE) | S(KVH_ERR_NOMEM) | S(KVH_ERR_NOSPACE) | S(KVH_ERR_IO) | S(KVH_ERR_CORRUPT);
            if (!CHK(st, al, "migrate shared") && usef)
                wait_fence(f, S(KVH_ERR_NOSPACE) | S(KVH_ERR_IO) | S(KVH_ERR_CORRUPT), "migrate shared fence");
        }
        break;
    case 2:
        pthread_mutex_lock(&g_sh_mu);
        if (g_nsh) {
            b = g_sh[rn(&t->r, g_nsh)];
            kvh_block_info bi;
            bi.struct_size = sizeof bi;
            kvh_status st = kvh_block_info_get(E, b, &bi);
            if (st != KVH_OK)
                failf("block_info of retained block: %s %s", kvh_status_name(st), kvh_last_error());
            else if (bi.refs == 0)
                failf("retained block %llx reports refs 0", (unsigned long long)b.id);
        }
        pthread_mutex_unlock(&g_sh_mu);
        break;
    case 3:
        if (sh_pop(&t->r, &b)) {
            /* pin/unpin by handle then put back */
            kvh_status st = kvh_block_pin(E, b, 1);
            if (!CHK(st, S(KVH_ERR_BAD_HANDLE), "block_pin")) {
                st = kvh_block_pin(E, b, 0);
                if (st != KVH_OK)
                    failf("block unpin: %s %s", kvh_status_name(st), kvh_last_error());
            }
            sh_push(b);
        }
        break;
    }
}

static atomic_ulong g_attn_ok[2];
static void op_attn(thr_t *t, sseq *q)
{
    if (!q->len || g_codec)
        return;
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t p = 0; p < q->len; p++)
            if (q->written[l][p] != 1)
                return;
    uint32_t layer = rn(&t->r, L);
    float qv[H * 256], out[H * 256];
    for (uint32_t i = 0; i < H * D; i++)
        qv[i] = (float)((int)rn(&t->r, 64) - 32) / 64.0f;
    kvh_attention_params ap;
    kvh_attention_params_init(&ap, sizeof ap);
    ap.threads = 1;
    int stream = rn(&t->r, 2);
    if (stream) {
        ap.stream_chunk_blocks = 1;
        ap.stream_window_blocks = 1 + rn(&t->r, 2);
    }
    kvh_status st = kvh_attention_decode(E, layer, &q->h, 1, qv, out, &ap);
    if (CHK(st,
            S(KVH_ERR_NOT_RESIDENT) | S(KVH_ERR_NOSPACE) | S(KVH_ERR_CORRUPT) | S(KVH_ERR_IO) | S(KVH_ERR_BUSY) |
                S(KVH_ERR_NOMEM),
            "attention_decode"))
        return;
    atomic_fetch_add(&g_attn_ok[stream], 1);
    for (uint32_t h = 0; h < H; h++) {
        double sc[MAXTOK], mx = -1e30, sum = 0;
        for (uint32_t p = 0; p < q->len; p++) {
            double dot = 0;
            for (uint32_t d = 0; d < D; d++)
                dot += (double)qv[h * D + d] * val(q->ph[p], layer, 0, h, d, q->ver[layer][p]);
            sc[p] = dot / sqrt((double)D);
            if (sc[p] > mx)
                mx = sc[p];
        }
        for (uint32_t p = 0; p < q->len; p++)
            sum += (sc[p] = exp(sc[p] - mx));
        for (uint32_t d = 0; d < D; d++) {
            double o = 0;
            for (uint32_t p = 0; p < q->len; p++)
                o += sc[p] / sum * val(q->ph[p], layer, 1, h, d, q->ver[layer][p]);
            if (!(fabs(o - out[h * D + d]) <= 1e-3 * (1 + fabs(o)))) {
                failf("attention_decode (stream %d) WRONG: seq %llx len %u head %u d %u got %g expected %g", stream,
                      (unsigned long long)q->h.id, q->len, h, d, out[h * D + d], o);
                return;
            }
        }
    }
}

static void one_op(thr_t *t)
{
    int i = rn(&t->r, MAXSEQ);
    sseq *q = &t->s[i];
    uint32_t op = rn(&t->r, 100);
    if (!q->live) {
        if (op < 60)
            seq_new(t, i);
        else if (op < 75)
            op_lookup(t);
        else if (op < 85)
            op_cross(t);
        else
            op_shared_block(t);
        return;
    }
    kvh_status st;
    if (op < 14) { /* append */
        uint32_t n = 1 + rn(&t->r, 2 * BT);
        if (q->len + n > MAXTOK)
            n = MAXTOK - q->len;
        if (!n)
            return;
        st = kvh_seq_append(E, q->h, q->plan + q->len, n);
        QLOG(q, "append %u at %u -> %s", n, q->len, kvh_status_name(st));
        if (!CHK(st, S(KVH_ERR_NOSPACE) | S(KVH_ERR_NOMEM) | S(KVH_ERR_IO) | S(KVH_ERR_CORRUPT), "append")) {
            memcpy(q->tok + q->len, q->plan + q->len, n * 4);
            for (uint32_t l = 0; l < L; l++)
                for (uint32_t p = q->len; p < q->len + n; p++)
                    q->written[l][p] = 0;
            q->len += n;
            recompute(q);
        }
    } else if (op < 32) { /* write */
        if (!q->len)
            return;
        uint32_t pos = rn(&t->r, q->len), n = 1 + rn(&t->r, q->len - pos);
        if (rn(&t->r, 2)) { /* prefer writing unwritten */
            for (pos = 0; pos < q->len && q->written[0][pos]; pos++)
                ;
            if (pos == q->len)
                pos = rn(&t->r, q->len);
            n = 1 + rn(&t->r, q->len - pos);
        }
        uint32_t ver = q->priv ? rn(&t->r, 4) : 0;
        if (q->priv && (pos + n - 1) / BT - pos / BT + 1 > g_memcap)
            n = 1;
        for (uint32_t l = 0; l < L; l++)
            if (rn(&t->r, 4) || l == 0)
                write_range(t, q, l, pos, n, ver);
    } else if (op < 46) { /* read */
        if (!q->len)
            return;
        uint32_t pos = rn(&t->r, q->len), n = 1 + rn(&t->r, q->len - pos);
        read_check(t, q, rn(&t->r, L), pos, n, "read_kv");
    } else if (op < 50) { /* fork */
        op_fork(t, i);
    } else if (op < 54) { /* truncate */
        uint32_t n = rn(&t->r, q->len + 1);
        release_hold(q);
        if (q->pins && n < 1)
            unpin_all(q);
        st = kvh_seq_truncate(E, q->h, n);
        QLOG(q, "truncate %u (from %u) -> %s", n, q->len, kvh_status_name(st));
        if (!CHK(st, S(KVH_ERR_NOSPACE) | S(KVH_ERR_NOMEM) | S(KVH_ERR_IO) | S(KVH_ERR_CORRUPT), "truncate")) {
            q->len = n;
            if (q->priv) /* private: re-plan tail so truncated tokens get new ids */
                for (int k = n; k < MAXTOK; k++)
                    q->plan[k] = (int32_t)(rnd(&t->r) & 0xFFFF) + 100000;
            for (uint32_t l = 0; l < L; l++)
                for (uint32_t p = n; p < MAXTOK; p++)
                    q->written[l][p] = 0;
            if (n == 0 && q->pins)
                failf("pins left with n=0");
        }
    } else if (op < 57) {
        seq_kill(t, i);
    } else if (op < 63) { /* acquire/release */
        if (q->hold_n) {
            release_hold(q);
            return;
        }
        if (!q->len)
            return;
        uint32_t first = rn(&t->r, q->len), n = 1 + rn(&t->r, q->len - first);
        if (n > 2 * BT)
            n = 2 * BT;
        if (rn(&t->r, 2)) {
            kvh_fence f;
            st = kvh_seq_acquire(E, q->h, first, n, &f);
            if (!CHK(st, S(KVH_ERR_RANGE) | S(KVH_ERR_NOMEM), "acquire(fence)")) {
                q->hold_first = first;
                q->hold_n = n;
                wait_fence(f,
                           S(KVH_ERR_NOSPACE) | S(KVH_ERR_BUSY) | S(KVH_ERR_IO) | S(KVH_ERR_CORRUPT) | S(KVH_ERR_NOMEM),
                           "acquire fence");
            }
        } else {
            st = kvh_seq_acquire(E, q->h, first, n, NULL);
            if (!CHK(st, S(KVH_ERR_NOSPACE) | S(KVH_ERR_BUSY) | S(KVH_ERR_IO) | S(KVH_ERR_CORRUPT) | S(KVH_ERR_NOMEM),
                     "acquire")) {
                q->hold_first = first;
                q->hold_n = n;
                /* held: must be in device tier */
                kvh_block b;
                if (kvh_seq_blocks(E, q->h, first / BT, 1, &b) == KVH_OK) {
                    kvh_block_info bi;
                    bi.struct_size = sizeof bi;
                    if (kvh_block_info_get(E, b, &bi) == KVH_OK && (bi.tier != KVH_TIER_DEVICE || bi.holds == 0))
                        failf("acquired block in tier %u holds %u", bi.tier, bi.holds);
                }
                uint32_t l = rn(&t->r, L);
                read_check(t, q, l, first, n, "read while held");
            }
        }
    } else if (op < 68) { /* migrate own */
        if (!q->len)
            return;
        uint32_t first = rn(&t->r, q->len), n = 1 + rn(&t->r, q->len - first);
        kvh_fence f;
        int usef = rn(&t->r, 2);
        st = kvh_seq_migrate(E, q->h, first, n, rn(&t->r, g_disk ? 3 : 2), usef ? &f : NULL);
        uint32_t al = S(KVH_ERR_NOMEM) | S(KVH_ERR_NOSPACE) | S(KVH_ERR_IO) | S(KVH_ERR_CORRUPT);
        if (!CHK(st, al, "seq_migrate") && usef)
            wait_fence(f, S(KVH_ERR_NOSPACE) | S(KVH_ERR_IO) | S(KVH_ERR_CORRUPT), "seq_migrate fence");
    } else if (op < 72) { /* persist */
        int fw = all_full_written(q);
        st = kvh_seq_persist(E, q->h);
        QLOG(q, "persist (fw %d) -> %s", fw, kvh_status_name(st));
        if (!g_disk) {
            if (st != KVH_ERR_UNSUPPORTED && !(g_intrude && st == KVH_ERR_BUSY))
                failf("persist without disk: %s", kvh_status_name(st));
        } else if (fw == 2) {
            CHK(st,
                S(KVH_ERR_INVALID_ARG) | S(KVH_ERR_IO) | S(KVH_ERR_NOSPACE) | S(KVH_ERR_CORRUPT) | S(KVH_ERR_BUSY) |
                    S(KVH_ERR_NOMEM),
                "persist (unknown)");
        } else if (!fw) {
            if (st != KVH_ERR_INVALID_ARG && st != KVH_ERR_BUSY && st != KVH_ERR_NOSPACE) {
                failf("persist with unwritten full block: %s (%s)", kvh_status_name(st), kvh_last_error());
                dump_seq(q);
            }
        } else {
            CHK(st, S(KVH_ERR_IO) | S(KVH_ERR_NOSPACE) | S(KVH_ERR_CORRUPT) | S(KVH_ERR_BUSY) | S(KVH_ERR_NOMEM),
                "persist");
        }
    } else if (op < 76) { /* block handles */
        if (q->len < BT)
            return;
        kvh_block b;
        st = kvh_seq_blocks(E, q->h, rn(&t->r, q->len / BT), 1, &b);
        if (CHK(st, 0, "seq_blocks"))
            return;
        st = kvh_block_retain(E, b);
        if (CHK(st, 0, "retain"))
            return;
        sh_push(b);
    } else if (op < 79) { /* pin */
        if (!q->len)
            return;
        if (q->pins && rn(&t->r, 2)) {
            st = kvh_seq_pin(E, q->h, 0, 1, 0);
            if (st == KVH_ERR_BUSY && g_intrude)
                return;
            if (st != KVH_OK)
                failf("seq unpin: %s %s", kvh_status_name(st), kvh_last_error());
            else
                q->pins--;
        } else if (q->pins < 2) {
            st = kvh_seq_pin(E, q->h, 0, 1, 1);
            if (!CHK(st, 0, "seq_pin"))
                q->pins++;
        }
    } else if (op < 83) {
        op_lookup(t);
    } else if (op < 88) {
        if (g_intrude && rn(&t->r, 2))
            op_intrude(t);
        else
            op_cross(t);
    } else if (op < 92) {
        op_shared_block(t);
    } else if (op < 95) {
        switch (rn(&t->r, 4)) {
        case 0:
            check_stats(t);
            break;
        case 1:
            op_offload(t);
            break;
        case 2:
            op_blocks_persist(t);
            break;
        case 3:
            CHK(kvh_agent_set_quota(E, rn(&t->r, 3), rn(&t->r, 3) ? 0 : g_block_bytes * (1 + rn(&t->r, 4))),
                S(KVH_ERR_NOMEM), "set_quota");
            break;
        }
    } else if (op < 98) { /* standalone blocks */
        if (t->nalloc < 4 && rn(&t->r, 2)) {
            st = kvh_block_alloc(E, rn(&t->r, 3), &t->alloc[t->nalloc]);
            if (!CHK(st, S(KVH_ERR_NOSPACE), "block_alloc"))
                t->nalloc++;
        } else if (t->nalloc) {
            st = kvh_block_release(E, t->alloc[--t->nalloc]);
            if (st != KVH_OK)
                failf("release alloc: %s %s", kvh_status_name(st), kvh_last_error());
        }
    } else { /* tokens */
        if (!q->len)
            return;
        if (rn(&t->r, 2)) {
            op_attn(t, q);
            return;
        }
        int32_t tk[MAXTOK];
        st = kvh_seq_tokens(E, q->h, 0, q->len, tk);
        if (!CHK(st, 0, "seq_tokens") && memcmp(tk, q->tok, q->len * 4))
            failf("seq_tokens mismatch");
    }
}

static void *worker(void *arg)
{
    thr_t *t = arg;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        one_op(t);
        t->ops++;
        atomic_fetch_add(&g_progress, 1);
        if ((t->ops & 15) == 0) {
            clock_gettime(CLOCK_MONOTONIC, &t1);
            if ((t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9 > g_secs)
                break;
        }
        if (atomic_load(&g_fail) > 20)
            break;
    }
    /* final: verify everything then free */
    for (int i = 0; i < MAXSEQ; i++)
        if (t->s[i].live) {
            sseq *q = &t->s[i];
            for (uint32_t l = 0; l < L; l++)
                if (q->len)
                    read_check(t, q, l, 0, q->len, "final read");
            release_hold(q);
            unpin_all(q);
            seq_kill(t, i);
        }
    while (t->nalloc)
        CHK(kvh_block_release(E, t->alloc[--t->nalloc]), 0, "final release alloc");
    return NULL;
}

static void *watchdog(void *arg)
{
    (void)arg;
    unsigned long last = 0;
    int still = 0;
    while (!atomic_load(&g_stop)) {
        sleep(1);
        unsigned long p = atomic_load(&g_progress);
        if (p == last) {
            if (++still >= 60) {
                fprintf(stderr, "DEADLOCK? seed=%llu no progress for 60s\n", (unsigned long long)g_seed);
                char cmd[128];
                snprintf(cmd, sizeof cmd, "gdb -batch -p %d -ex 'thread apply all bt' 2>&1", getpid());
                if (system(cmd)) {
                }
                abort();
            }
        } else
            still = 0;
        last = p;
    }
    return NULL;
}

/* One configuration (in a child process: the globals are its own). */
typedef struct fuzz_run {
    uint64_t seed;
    int threads, workers;
    uint32_t codec;
    int disk, intrude, tiny;
} fuzz_run;

static int run_one(const fuzz_run *fr, double secs, const char *scratch)
{
    g_seed = fr->seed;
    g_nthreads = fr->threads;
    int mig = fr->workers;
    g_codec = fr->codec;
    g_secs = secs;
    g_disk = fr->disk;
    g_verbose = getenv("KVH_OPS_FUZZ_VERBOSE") != NULL;
    g_intrude = fr->intrude;
    g_reg = calloc(REGMAX, 8);
    if (g_codec >= 2)
        D = g_codec == 2 ? 32 : 64;
    rng_t r = {g_seed * 7919 + 13};
    for (int f = 0; f < NFAM; f++) {
        uint64_t p = 0x77;
        for (int j = 0; j < FAMLEN; j++) {
            /* families share first block pairwise to create branching */
            g_fam[f][j] = (j < BT && f % 2) ? g_fam[f - 1][j] : (int32_t)(rnd(&r) & 0xFFF) + 10 + 5000 * f;
            p = roll(p, g_fam[f][j]);
            g_famhash[f][j] = p;
        }
    }
    kvh_config c;
    kvh_config_init(&c, sizeof c);
    c.num_layers = L;
    c.num_kv_heads = H;
    c.head_dim = D;
    c.block_tokens = BT;
    c.dtype = KVH_DTYPE_F32;
    c.backend = KVH_BACKEND_CPU;
    uint64_t bb = (uint64_t)L * 2 * H * BT * D * 4;
    c.device_bytes = bb * (6 + rn(&r, 6));
    c.host_bytes = bb * (6 + rn(&r, 10));
    if (fr->tiny) {
        c.device_bytes = bb * (2 + rn(&r, 3));
        c.host_bytes = bb * (2 + rn(&r, 4));
    }
    char path[600];
    snprintf(path, sizeof path, "%s/s%llu_%d", scratch, (unsigned long long)g_seed, getpid());
    if (g_disk) {
        c.disk_path = path;
        c.disk_bytes = (uint64_t)(256 + rn(&r, 256)) * 1024;
        if (fr->tiny)
            c.disk_bytes = (uint64_t)(40 + rn(&r, 80)) * 1024;
        c.disk_flags = rn(&r, 2) ? KVH_DISK_BUFFERED : 0;
    }
    c.migration_threads = mig;
    c.kv_codec = g_codec;
    c.copy_moves = rn(&r, 2);
    c.eviction_policy = rn(&r, 3);
    c.lru_k = 1 + rn(&r, 2);
    c.model_salt = 42;
    kvh_status st = kvh_engine_open(&c, &E);
    if (st != KVH_OK) {
        fprintf(stderr, "open failed: %s %s\n", kvh_status_name(st), kvh_last_error());
        return 2;
    }
    kvh_engine_block_bytes(E, &g_block_bytes);
    {
        uint32_t mc = 0;
        for (uint32_t tier = 0; tier < 2; tier++) {
            kvh_tier_info ti;
            ti.struct_size = sizeof ti;
            kvh_tier_info_get(E, tier, &ti);
            mc += (uint32_t)ti.capacity_blocks;
        }
        g_memcap = mc;
    }
    if (g_verbose) {
        fprintf(stderr, "copy_moves %u, policy %u, lru_k %u, disk_flags %u\n", c.copy_moves, c.eviction_policy, c.lru_k,
                c.disk_flags);
        for (uint32_t tier = 0; tier < 3; tier++) {
            kvh_tier_info ti;
            ti.struct_size = sizeof ti;
            kvh_tier_info_get(E, tier, &ti);
            fprintf(stderr, "tier %u cap %llu\n", tier, (unsigned long long)ti.capacity_blocks);
        }
    }
    pthread_t wd;
    pthread_create(&wd, NULL, watchdog, NULL);
    pthread_t th[MAXT];
    for (int i = 0; i < g_nthreads; i++) {
        T[i].id = i;
        T[i].r.s = g_seed * 1000003 + i;
        for (int l = 0; l < L; l++) {
            T[i].kb[l] = calloc((size_t)POOLSLOTS * BT * H * D, 4);
            T[i].vb[l] = calloc((size_t)POOLSLOTS * BT * H * D, 4);
        }
        kvh_pool_layout pl;
        memset(&pl, 0, sizeof pl);
        pl.struct_size = sizeof pl;
        pl.memory = KVH_MEMORY_HOST;
        pl.num_slots = POOLSLOTS;
        void *kp[L], *vp[L];
        for (int l = 0; l < L; l++) {
            kp[l] = T[i].kb[l];
            vp[l] = T[i].vb[l];
        }
        pl.k_base = kp;
        pl.v_base = vp;
        pl.slot_stride = (uint64_t)BT * H * D * 4;
        pl.token_stride = (uint64_t)H * D * 4;
        pl.head_stride = (uint64_t)D * 4;
        st = kvh_pool_register(E, &pl, &T[i].pool);
        if (st != KVH_OK) {
            fprintf(stderr, "pool_register: %s %s\n", kvh_status_name(st), kvh_last_error());
            return 2;
        }
    }
    for (int i = 0; i < g_nthreads; i++)
        pthread_create(&th[i], NULL, worker, &T[i]);
    for (int i = 0; i < g_nthreads; i++)
        pthread_join(th[i], NULL);
    /* release shared */
    kvh_block b;
    rng_t rr = {1};
    while (sh_pop(&rr, &b))
        if (kvh_block_release(E, b) != KVH_OK)
            failf("final release shared: %s", kvh_last_error());
    for (int i = 0; i < g_nthreads; i++)
        CHK(kvh_pool_unregister(E, T[i].pool), 0, "pool_unregister");
    for (uint32_t a = 0; a < 3; a++)
        CHK(kvh_agent_set_quota(E, a, 0), 0, "reset quota");
    check_stats(&T[0]);
    /* end state: nothing referenced; pinned 0; memory tiers fully allocatable */
    uint64_t cap_mem = 0;
    for (uint32_t tier = 0; tier < 3; tier++) {
        kvh_tier_info ti;
        ti.struct_size = sizeof ti;
        kvh_tier_info_get(E, tier, &ti);
        if (ti.pinned_blocks)
            failf("end: tier %u pinned_blocks %llu", tier, (unsigned long long)ti.pinned_blocks);
        if (tier < 2)
            cap_mem += ti.capacity_blocks;
        if (g_verbose)
            fprintf(stderr, "end tier %u used %llu cap %llu clean %llu\n", tier, (unsigned long long)ti.used_blocks,
                    (unsigned long long)ti.capacity_blocks, (unsigned long long)ti.clean_copies);
    }
    if (c.copy_moves == 0 && !g_codec) {
        /* one arena: device+host counted separately anyway */
    }
    kvh_block *al = calloc(cap_mem + 8, sizeof *al);
    uint64_t na = 0;
    while (na < cap_mem + 8) {
        st = kvh_block_alloc(E, 0, &al[na]);
        if (st != KVH_OK)
            break;
        na++;
    }
    if (na < cap_mem) {
        fprintf(stderr, "  alloc stopped: %s: %s\n", kvh_status_name(st), kvh_last_error());
        for (uint32_t tier = 0; tier < 3; tier++) {
            kvh_tier_info ti;
            ti.struct_size = sizeof ti;
            kvh_tier_info_get(E, tier, &ti);
            fprintf(stderr, "  at alloc failure: tier %u used %llu cap %llu clean %llu pinned %llu\n", tier,
                    (unsigned long long)ti.used_blocks, (unsigned long long)ti.capacity_blocks,
                    (unsigned long long)ti.clean_copies, (unsigned long long)ti.pinned_blocks);
        }
        kvh_stats S2;
        S2.struct_size = sizeof S2;
        kvh_engine_stats(E, &S2);
        fprintf(stderr, "  allocated %llu freed %llu drops %llu evictions %llu\n",
                (unsigned long long)S2.blocks_allocated, (unsigned long long)S2.blocks_freed,
                (unsigned long long)S2.drops, (unsigned long long)S2.evictions);
        unsigned long nr = atomic_load(&g_nreg);
        if (nr > REGMAX)
            nr = REGMAX;
        int shown = 0;
        for (unsigned long i = 0; i < nr && shown < 20; i++) {
            kvh_block rb = {g_reg[i]};
            kvh_block_info bi;
            bi.struct_size = sizeof bi;
            int own = 0;
            for (uint64_t j = 0; j < na; j++)
                if (al[j].id == rb.id)
                    own = 1;
            if (own)
                continue;
            if (kvh_block_info_get(E, rb, &bi) == KVH_OK && (bi.refs || bi.holds || bi.pins || bi.tier < 2)) {
                int dup = 0;
                for (unsigned long j = 0; j < i; j++)
                    if (g_reg[j] == rb.id)
                        dup = 1;
                if (dup)
                    continue;
                shown++;
                fprintf(
                    stderr,
                    "  live block %llx tier %u slot %u refs %u pins %u holds %u tokens %u published %u in_flight %u hash %llx\n",
                    (unsigned long long)rb.id, bi.tier, bi.slot, bi.refs, bi.pins, bi.holds, bi.tokens, bi.published,
                    bi.in_flight, (unsigned long long)bi.hash);
            }
        }
        failf("end: only %llu of %llu memory-tier blocks allocatable after freeing everything (%s: %s)",
              (unsigned long long)na, (unsigned long long)cap_mem, kvh_status_name(st), kvh_last_error());
    }
    for (uint64_t i = 0; i < na; i++)
        if (kvh_block_release(E, al[i]) != KVH_OK)
            failf("end release");
    for (uint32_t tier = 0; tier < 2; tier++) {
        kvh_tier_info ti;
        ti.struct_size = sizeof ti;
        kvh_tier_info_get(E, tier, &ti);
        if (ti.used_blocks) {
            failf("end: tier %u used_blocks %llu after releasing all (only non-published blocks were in it)", tier,
                  (unsigned long long)ti.used_blocks);
            unsigned long nr = atomic_load(&g_nreg);
            if (nr > REGMAX)
                nr = REGMAX;
            for (unsigned long i = 0; i < nr; i++) {
                kvh_block rb = {g_reg[i]};
                kvh_block_info bi;
                bi.struct_size = sizeof bi;
                if (kvh_block_info_get(E, rb, &bi) == KVH_OK && bi.tier == tier) {
                    int dup = 0;
                    for (unsigned long j = 0; j < i; j++)
                        if (g_reg[j] == rb.id)
                            dup = 1;
                    if (!dup)
                        fprintf(
                            stderr,
                            "  in tier %u: block %llx slot %u refs %u pins %u holds %u tokens %u published %u in_flight %u\n",
                            tier, (unsigned long long)rb.id, bi.slot, bi.refs, bi.pins, bi.holds, bi.tokens,
                            bi.published, bi.in_flight);
                }
            }
            for (uint64_t i = 0; i < na; i++) {
                kvh_block_info bi;
                bi.struct_size = sizeof bi;
                kvh_status s2 = kvh_block_info_get(E, al[i], &bi);
                if (s2 == KVH_OK)
                    fprintf(stderr, "  released alloc %llx still valid: tier %u refs %u\n",
                            (unsigned long long)al[i].id, bi.tier, bi.refs);
            }
        }
    }
    free(al);
    unsigned long ops = 0;
    for (int i = 0; i < g_nthreads; i++)
        ops += T[i].ops;
    st = kvh_engine_close(E);
    if (st != KVH_OK)
        failf("close: %s %s", kvh_status_name(st), kvh_last_error());
    if (g_disk && st == KVH_OK) {
        st = kvh_engine_open(&c, &E);
        if (st != KVH_OK)
            failf("reopen: %s %s", kvh_status_name(st), kvh_last_error());
        else {
            thr_t *t = &T[0];
            for (int f = 0; f < NFAM; f++) {
                sseq *q = &t->s[0];
                memset(q, 0, sizeof *q);
                if (kvh_seq_create(E, 0, &q->h) != KVH_OK) {
                    failf("create after reopen");
                    continue;
                }
                size_t m = 0;
                st = kvh_seq_match_prefix(E, q->h, g_fam[f], FAMLEN, &m);
                if (st != KVH_OK)
                    failf("match after reopen: %s %s", kvh_status_name(st), kvh_last_error());
                q->len = m;
                memcpy(q->tok, g_fam[f], m * 4);
                recompute(q);
                for (uint32_t l = 0; l < L; l++)
                    for (uint32_t p2 = 0; p2 < m; p2++)
                        q->written[l][p2] = 1;
                if (g_verbose)
                    fprintf(stderr, "reopen: family %d matched %zu\n", f, m);
                for (uint32_t l = 0; l < L; l++)
                    if (m)
                        read_check(t, q, l, 0, m, "after reopen");
                kvh_seq_free(E, q->h);
            }
            st = kvh_engine_close(E);
            if (st != KVH_OK)
                failf("close after reopen: %s", kvh_status_name(st));
        }
    }
    atomic_store(&g_stop, 1);
    pthread_join(wd, NULL);
    /* The store's directory goes with the scratch directory (main). */
    int f = atomic_load(&g_fail);
    if (g_verbose)
        fprintf(stderr, "attn ok: plain %lu stream %lu\n", (unsigned long)g_attn_ok[0], (unsigned long)g_attn_ok[1]);
    if (g_verbose)
        for (int i = 0; i < 16; i++)
            if (g_hist[i])
                fprintf(stderr, "  %s: %lu\n", kvh_status_name(-i), (unsigned long)g_hist[i]);
    fprintf(stderr, "seed %llu: %lu ops, %d failures\n", (unsigned long long)g_seed, ops, f);
    return f ? 1 : 0;
}

static const fuzz_run runs[] = {
    /* seed, threads, workers, codec, disk, calls on others', tiny tiers */
    {1, 4, 1, 0, 1, 0, 0},    {2, 3, 0, 0, 1, 1, 0}, {3, 5, 3, 1, 1, 0, 0},   {4, 4, 1, 2, 0, 1, 0},
    {5, 6, 3, 0, 1, 1, 1},    {6, 3, 0, 1, 1, 0, 1}, {439, 5, 1, 0, 1, 0, 1}, {3030, 5, 1, 0, 1, 0, 1},
    {3055, 6, 1, 0, 1, 1, 1}, {7, 4, 3, 2, 1, 0, 1}, {8, 5, 1, 1, 0, 1, 1},   {9, 4, 1, 0, 1, 1, 0},
};

/* Every thread's stack of a running child, to stderr (gdb, where
 * installed; ptrace of one's own child is allowed). */
static void dump_threads(pid_t pid, uint64_t seed, double wall)
{
    fprintf(stderr, "seed %llu still running after %.1f s: its threads:\n", (unsigned long long)seed, wall);
    char cmd[200];
    snprintf(cmd, sizeof cmd, "gdb -batch -iex 'set debuginfod enabled off' -p %d -ex 'thread apply all bt' 1>&2",
             (int)pid);
    if (system(cmd) != 0)
        fprintf(stderr, "(no stacks: gdb failed or is not installed)\n");
}

/* Runs one configuration in a child process; 1 when it failed or stalled. */
static int run_in_child(const fuzz_run *fr, double secs, double stall_slack, const char *scratch)
{
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) {
        perror("fork");
        exit(1);
    }
    if (pid == 0) {
        /* gdb, started by the parent, may attach where ptrace is limited
         * to descendants (Yama). */
        (void)prctl(PR_SET_PTRACER, (unsigned long)getppid(), 0, 0, 0);
        _exit(run_one(fr, secs, scratch));
    }
    int ws = 0;
    double wall = 0;
    bool dumped = false;
    for (;;) {
        pid_t got = waitpid(pid, &ws, WNOHANG);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        wall = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
        if (got == pid)
            break;
        if (got < 0 && errno != EINTR) {
            perror("waitpid");
            ws = -1; /* read below as a failure, never as a clean exit */
            break;
        }
        /* A stall (below) ends by itself after a timed round: what every
         * thread waits on is shown while it still waits. */
        if (!dumped && wall > secs + stall_slack) {
            dumped = true;
            dump_threads(pid, fr->seed, wall);
        }
        usleep(20000);
    }
    bool ok = ws != -1 && WIFEXITED(ws) && WEXITSTATUS(ws) == 0;
    /* A run takes about a second here (its threads, then the final
     * checks and a reopen), a few under a sanitizer; a stall takes
     * five and more (fences waiting out a 5 s round, chained). */
    bool stalled = wall > secs + stall_slack;
    printf("seed %llu, %d threads, %d workers, codec %u, disk %d, others' %d, tiny %d: %s in %.1f s\n",
           (unsigned long long)fr->seed, fr->threads, fr->workers, fr->codec, fr->disk, fr->intrude, fr->tiny,
           !ok       ? "FAILED"
           : stalled ? "STALLED"
                     : "ok",
           wall);
    return !ok || stalled;
}

/* A configuration drawn from a seed, for soaks beyond the fixed set. */
static fuzz_run drawn_run(uint64_t seed)
{
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull;
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 29;
    fuzz_run fr = {.seed = seed,
                   .threads = 3 + (int)(x % 4),
                   .workers = (int)((x >> 8) % 4),
                   .codec = (uint32_t)((x >> 16) % 3),
                   .disk = (int)(x >> 24) & 1,
                   .intrude = (int)(x >> 25) & 1,
                   .tiny = (int)(x >> 26) & 1};
    return fr;
}

/* KVH_OPS_FUZZ_SECONDS: how long each configuration runs (0.4 s).
 * KVH_OPS_FUZZ_RUNS=N: N more configurations drawn from the seeds after
 * KVH_OPS_FUZZ_SEED (default 1000), for soaks; KVH_OPS_FUZZ_ONLY_DRAWN=1
 * skips the fixed set. */
int main(void)
{
    /* An ignored SIGCHLD, inherited from whoever started the test, would
     * reap the children before waitpid could read how they ended. */
    signal(SIGCHLD, SIG_DFL);
    const char *s = getenv("KVH_OPS_FUZZ_SECONDS");
    double secs = s && *s ? atof(s) : 0.4;
    const char *sl = getenv("KVH_OPS_FUZZ_STALL_SECONDS");
    double stall_slack = sl && *sl ? atof(sl) : 4.5;
    const char *base = getenv("KVH_TEST_TMPDIR");
    const char *nr = getenv("KVH_OPS_FUZZ_RUNS"), *sd = getenv("KVH_OPS_FUZZ_SEED");
    const char *only = getenv("KVH_OPS_FUZZ_ONLY_DRAWN");
    uint64_t drawn = nr && *nr ? strtoull(nr, NULL, 10) : 0, first = sd && *sd ? strtoull(sd, NULL, 10) : 1000;
    char scratch[512];
    snprintf(scratch, sizeof(scratch), "%s/kvh-ops-fuzz-XXXXXX", base && *base ? base : "/tmp");
    if (!mkdtemp(scratch)) {
        perror("mkdtemp");
        return 1;
    }
    int failed = 0;
    for (size_t i = 0; !(only && *only == '1') && i < sizeof(runs) / sizeof(runs[0]); i++)
        failed += run_in_child(&runs[i], secs, stall_slack, scratch);
    for (uint64_t i = 0; i < drawn; i++) {
        fuzz_run fr = drawn_run(first + i);
        failed += run_in_child(&fr, secs, stall_slack, scratch);
    }
    char cmd[600];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", scratch);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", scratch);
    return failed ? 1 : 0;
}
