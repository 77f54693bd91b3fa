/* Virtual contiguous views under threads, from kvh.h's promises alone.
 *
 * Oracle: every K/V element is a pure function of (writer tag, layer,
 * token, head, K or V, dim), exact in f32; each thread knows which tag
 * wrote each token it reads, so any mixup shows bit for bit.
 *
 * Concurrency is the documented kind: a sequence's @threads handle calls
 * from several threads are the checked kind ("a second such call ... gets
 * KVH_ERR_BUSY and changes nothing"); views are each used by one thread
 * (@threads handle (vmap)); migration, prefetch, lengths and block infos
 * are @threads any. Views are read directly only over blocks no thread
 * writes.
 *
 * Tests: views read and re-made while the owner appends, truncates,
 * refreshes and another thread migrates and prefetches ("a view holds
 * every block it maps in the device tier ... its blocks never move");
 * views of a parent read while other threads fork it and copy on write
 * (the parent's views never go stale); kvh_engine_close racing view,
 * fence and migration calls ("Calls racing with close on other threads
 * get KVH_ERR_CLOSED"; views left open are released by close). */
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "test_util.h"
#include "kv_cells.h"
#include "uffd_gate.h"
#include "disk_test_util.h"
#include "mt_util.h"

/* f32, head_dim 64, 16 tokens: one head's K of a block is one 4 KiB page. */
enum { L = 2, H = 2, D = 64, BT = 16, ROW = H * D, MAXB = 12, MAXT = MAXB * BT };

#define BIT(st) (1u << (unsigned)(-(st)))

/* Writes tag's K/V of [pos, pos + n) in every layer (n <= MAXT). */
static kvh_status put_kv(kvh_engine *e, kvh_seq s, uint32_t tag, uint64_t pos, size_t n)
{
    static _Thread_local float k[MAXT * ROW], v[MAXT * ROW];
    for (uint32_t l = 0; l < L; l++) {
        kv_cells(tag, l, pos, n, H, D, k, v);
        kvh_status st = kvh_seq_write_kv(e, s, l, pos, n, k, v);
        if (st != KVH_OK)
            return st;
    }
    return KVH_OK;
}

static kvh_status append_n(kvh_engine *e, kvh_seq s, uint64_t pos, size_t n)
{
    int32_t tok[MAXT];
    assert_true(n <= MAXT);
    for (size_t i = 0; i < n; i++)
        tok[i] = (int32_t)(pos + i + 1);
    return kvh_seq_append(e, s, tok, n);
}

/* tags[t] wrote token t. Compares [pos, pos + n) of layer l as read by
 * kvh_seq_read_kv; returns the read's status, or KVH_ERR_INTERNAL with
 * msg set on a mismatch. */
static kvh_status read_check(kvh_engine *e, kvh_seq s, const uint32_t *tags, uint32_t l, uint64_t pos, size_t n,
                             char *msg, size_t len)
{
    static _Thread_local float k[MAXT * ROW], v[MAXT * ROW];
    kvh_status st = kvh_seq_read_kv(e, s, l, pos, n, k, v);
    if (st != KVH_OK)
        return st;
    for (size_t t = 0; t < n; t++)
        for (uint32_t h = 0; h < H; h++)
            for (uint32_t d = 0; d < D; d++) {
                float ek = kv_cell(tags[pos + t], l, pos + t, h, 0, d),
                      ev = kv_cell(tags[pos + t], l, pos + t, h, 1, d);
                size_t i = (t * H + h) * D + d;
                if (memcmp(&k[i], &ek, 4) || memcmp(&v[i], &ev, 4)) {
                    snprintf(msg, len, "read_kv layer %u token %" PRIu64 " head %u dim %u: K %g V %g, expected %g %g",
                             l, pos + t, h, d, k[i], v[i], ek, ev);
                    return KVH_ERR_INTERNAL;
                }
            }
    return KVH_OK;
}

/* Tokens [pos, pos + n) of a view read directly; false with msg set on a
 * mismatch. */
static bool view_check(const kvh_vmap_view *w, const uint32_t *tags, uint64_t pos, uint64_t n, char *msg, size_t len)
{
    for (uint32_t h = 0; h < H; h++) {
        const float *vk = (const float *)((const uint8_t *)w->k + h * w->head_stride);
        const float *vv = (const float *)((const uint8_t *)w->v + h * w->head_stride);
        for (uint64_t t = pos; t < pos + n; t++)
            for (uint32_t d = 0; d < D; d++) {
                float ek = kv_cell(tags[t], w->layer, t, h, 0, d), ev = kv_cell(tags[t], w->layer, t, h, 1, d);
                if (memcmp(&vk[t * D + d], &ek, 4) || memcmp(&vv[t * D + d], &ev, 4)) {
                    snprintf(msg, len, "view layer %u token %" PRIu64 " head %u dim %u: K %g V %g, expected %g %g",
                             w->layer, t, h, d, vk[t * D + d], vv[t * D + d], ek, ev);
                    return false;
                }
            }
    }
    return true;
}

static kvh_vmap_view get_view(kvh_engine *e, kvh_vmap *m, kvh_status *st)
{
    kvh_vmap_view w;
    memset(&w, 0, sizeof(w));
    w.struct_size = sizeof(w);
    *st = kvh_vmap_get(e, m, &w);
    return w;
}

static void fill_q(float *q, size_t n, uint32_t salt)
{
    for (size_t i = 0; i < n; i++)
        q[i] = kv_cell(salt, 0, i, 0, 0, 0) / 8.0f;
}

static kvh_engine *open_vmap(uint64_t dev_blocks, uint64_t host_blocks, uint32_t threads)
{
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F32, dev_blocks, host_blocks, threads);
    c.vmap = 1;
    return tu_open_cfg(&c);
}

static atomic_int stop_flag;
static atomic_long n_checks, n_views, n_forks;

/* ================================================================== */
/* Views while the owner grows and shrinks the sequence               */
/* ================================================================== */

enum { BASE = 3 * BT, READERS = 2 };

static struct {
    kvh_seq s;
    kvh_block block0;          /* never copied or truncated: same handle all along */
    kvh_vmap *own;             /* the owner's view (layer 0) */
    kvh_vmap *reader[READERS]; /* one per reader (layer 1), never refreshed */
    uint32_t tags[MAXT];       /* all tag 1: the owner rewrites the same values */
} A;

/* Appends, truncates and refreshes its own view, checking it fully after
 * each refresh; BUSY from the readers' calls is retried. */
static void *owner(mt_worker *w)
{
    kvh_engine *e = w->e;
    tu_rng r = {tu_seed(0x0e0e) + 1};
    float q[H * D], a[H * D], b[H * D];
    fill_q(q, H * D, 2);
    char msg[200];
    uint64_t len = BASE;
    while (!atomic_load(&stop_flag) && !w->errors) {
        kvh_status st;
        uint64_t op = tu_below(&r, 3);
        if (op == 0 && len + BT <= MAXT) {
            size_t n = 1 + tu_below(&r, 2 * BT);
            if (len + n > MAXT)
                n = MAXT - len;
            while ((st = append_n(e, A.s, len, n)) == KVH_ERR_BUSY)
                ;
            if (st == KVH_ERR_NOSPACE)
                continue;
            if (st != KVH_OK) {
                mt_report(w, "append: %s: %s", kvh_status_name(st), kvh_last_error());
                break;
            }
            while ((st = put_kv(e, A.s, 1, len, n)) == KVH_ERR_BUSY)
                ;
            if (st != KVH_OK) {
                mt_report(w, "write_kv: %s: %s", kvh_status_name(st), kvh_last_error());
                break;
            }
            len += n;
        } else if (op == 1 && len > BASE) {
            uint64_t to = BASE + tu_below(&r, len - BASE);
            while ((st = kvh_seq_truncate(e, A.s, to)) == KVH_ERR_BUSY)
                ;
            if (st != KVH_OK) {
                mt_report(w, "truncate: %s: %s", kvh_status_name(st), kvh_last_error());
                break;
            }
            len = to;
        } else {
            int32_t changed = -1;
            while ((st = kvh_vmap_refresh(e, A.own, &changed)) == KVH_ERR_BUSY)
                ;
            if (st == KVH_ERR_NOT_RESIDENT) { /* the migrator demoted a block not yet mapped */
                while ((st = kvh_seq_acquire(e, A.s, 0, len, NULL)) == KVH_ERR_BUSY)
                    ;
                if (st == KVH_ERR_NOSPACE)
                    continue;
                if (st != KVH_OK) {
                    mt_report(w, "acquire: %s: %s", kvh_status_name(st), kvh_last_error());
                    break;
                }
                while ((st = kvh_vmap_refresh(e, A.own, &changed)) == KVH_ERR_BUSY)
                    ;
                kvh_status rs;
                while ((rs = kvh_seq_release(e, A.s, 0, len)) == KVH_ERR_BUSY)
                    ;
                if (rs != KVH_OK) {
                    mt_report(w, "release: %s: %s", kvh_status_name(rs), kvh_last_error());
                    break;
                }
            }
            if (st != KVH_OK) {
                mt_report(w, "refresh: %s: %s", kvh_status_name(st), kvh_last_error());
                break;
            }
            kvh_vmap_view v = get_view(e, A.own, &st);
            if (st != KVH_OK || v.n_tokens != len) {
                mt_report(w, "view after refresh: %s, %" PRIu64 " tokens of %" PRIu64, kvh_status_name(st), v.n_tokens,
                          len);
                break;
            }
            if (!view_check(&v, A.tags, 0, len, msg, sizeof(msg))) {
                mt_report(w, "owner's view: %s", msg);
                break;
            }
            /* Held by the view, the blocks are resident: paged decode
             * works and equals decode over the view. */
            kvh_seq s = A.s;
            while ((st = kvh_attention_decode(e, 0, &s, 1, q, a, NULL)) == KVH_ERR_BUSY)
                ;
            kvh_status sv = kvh_attention_decode_vmap(e, &A.own, 1, q, b, NULL);
            if (st != KVH_OK || sv != KVH_OK) {
                mt_report(w, "decode over a fresh view: paged %s, view %s: %s", kvh_status_name(st),
                          kvh_status_name(sv), kvh_last_error());
                break;
            }
            if (memcmp(a, b, sizeof(a)) != 0) {
                mt_report(w, "decode over the view differs from paged decode");
                break;
            }
            atomic_fetch_add(&n_checks, 1);
        }
    }
    return NULL;
}

/* Reads its own stale view's base, makes and drops new views (BUSY while
 * the owner is inside a call), reads the base through read_kv. */
static void *reader(mt_worker *w)
{
    kvh_engine *e = w->e;
    int i = w->t - 1;
    char msg[200];
    kvh_status st;
    kvh_vmap_view mine = get_view(e, A.reader[i], &st);
    if (st != KVH_OK) {
        mt_report(w, "get: %s", kvh_status_name(st));
        return NULL;
    }
    float q[H * D], out[H * D];
    fill_q(q, H * D, 3);
    while (!atomic_load(&stop_flag) && !w->errors) {
        if (!view_check(&mine, A.tags, 0, BASE, msg, sizeof(msg))) {
            mt_report(w, "reader's stale view: %s", msg);
            break;
        }
        kvh_vmap *m = NULL;
        st = kvh_seq_vmap(e, A.s, (uint32_t)i & 1, 0, &m);
        if (st == KVH_OK) {
            atomic_fetch_add(&n_views, 1);
            kvh_vmap_view v = get_view(e, m, &st);
            if (st != KVH_OK || v.n_tokens < BASE)
                mt_report(w, "new view: %s, %" PRIu64 " tokens", kvh_status_name(st), v.n_tokens);
            else if (!view_check(&v, A.tags, 0, BASE, msg, sizeof(msg)))
                mt_report(w, "new view: %s", msg);
            st = kvh_attention_decode_vmap(e, &m, 1, q, out, NULL);
            if (st != KVH_OK && st != KVH_ERR_BAD_HANDLE) /* stale once the owner changed the blocks */
                mt_report(w, "decode over a new view: %s: %s", kvh_status_name(st), kvh_last_error());
            st = kvh_vmap_release(e, m);
            if (st != KVH_OK)
                mt_report(w, "release of a new view: %s", kvh_status_name(st));
        } else if (st != KVH_ERR_BUSY && st != KVH_ERR_NOT_RESIDENT) {
            mt_report(w, "seq_vmap: %s: %s", kvh_status_name(st), kvh_last_error());
        }
        st = read_check(e, A.s, A.tags, (uint32_t)i & 1, 0, BASE, msg, sizeof(msg));
        if (st == KVH_ERR_INTERNAL)
            mt_report(w, "%s", msg);
        else if (st != KVH_OK && st != KVH_ERR_BUSY)
            mt_report(w, "read_kv: %s: %s", kvh_status_name(st), kvh_last_error());
        atomic_fetch_add(&n_checks, 1);
    }
    return NULL;
}

/* Moves the whole sequence between the three tiers (@threads any),
 * prefetches it, and watches block 0: held by views all along, it never
 * leaves its device slot. */
static void *mover(mt_worker *w)
{
    kvh_engine *e = w->e;
    tu_rng r = {tu_seed(0x0e0e) + 7};
    kvh_block_info bi = {.struct_size = sizeof(bi)};
    kvh_status st = kvh_block_info_get(e, A.block0, &bi);
    if (st != KVH_OK) {
        mt_report(w, "block info: %s", kvh_status_name(st));
        return NULL;
    }
    uint32_t slot0 = bi.slot;
    while (!atomic_load(&stop_flag) && !w->errors) {
        uint64_t len = 0;
        if ((st = kvh_seq_length(e, A.s, &len)) != KVH_OK) {
            mt_report(w, "length: %s", kvh_status_name(st));
            break;
        }
        uint32_t tier = (uint32_t)tu_below(&r, KVH_TIER_COUNT);
        kvh_fence f;
        switch (tu_below(&r, 3)) {
        case 0:
            st = kvh_seq_migrate(e, A.s, 0, len, tier, NULL);
            if (st != KVH_OK && st != KVH_ERR_RANGE && st != KVH_ERR_NOSPACE)
                mt_report(w, "migrate: %s: %s", kvh_status_name(st), kvh_last_error());
            break;
        case 1:
            st = kvh_seq_migrate(e, A.s, 0, len, tier, &f);
            if (st == KVH_OK) {
                st = kvh_fence_wait(e, f, UINT64_MAX);
                if (st != KVH_OK && st != KVH_ERR_NOSPACE)
                    mt_report(w, "migrate fence: %s: %s", kvh_status_name(st), kvh_last_error());
                if ((st = kvh_fence_free(e, f)) != KVH_OK)
                    mt_report(w, "fence free: %s", kvh_status_name(st));
            } else if (st != KVH_ERR_RANGE) {
                mt_report(w, "migrate: %s: %s", kvh_status_name(st), kvh_last_error());
            }
            break;
        default:
            st = kvh_prefetch(e, A.s, 0, len, (int32_t)tu_below(&r, 100), &f);
            if (st == KVH_OK) {
                /* "a promotion that cannot be made is skipped, not an error" */
                if ((st = kvh_fence_wait(e, f, UINT64_MAX)) != KVH_OK)
                    mt_report(w, "prefetch fence: %s: %s", kvh_status_name(st), kvh_last_error());
                if ((st = kvh_fence_free(e, f)) != KVH_OK)
                    mt_report(w, "fence free: %s", kvh_status_name(st));
            } else if (st != KVH_ERR_RANGE) {
                mt_report(w, "prefetch: %s: %s", kvh_status_name(st), kvh_last_error());
            }
        }
        st = kvh_block_info_get(e, A.block0, &bi);
        if (st != KVH_OK || bi.tier != KVH_TIER_DEVICE || bi.slot != slot0 || bi.holds < 1 + READERS)
            mt_report(w, "block 0 under views: %s, tier %u slot %u (was %u), %u holds", kvh_status_name(st), bi.tier,
                      bi.slot, slot0, bi.holds);
    }
    return NULL;
}

static void *grow_role(void *arg)
{
    mt_worker *w = arg;
    if (w->t == 0)
        return owner(w);
    if (w->t <= READERS)
        return reader(w);
    return mover(w);
}

static void test_views_while_the_owner_grows_and_others_migrate(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("vmap_hostile_mt_grow", dir, sizeof(dir));
    dt_geo g = {L, H, D, BT, KVH_DTYPE_F32};
    kvh_config c = dt_cfg(g, dir, 40, 24, 128, 2);
    c.vmap = 1;
    kvh_engine *e = tu_open_cfg(&c);
    A.s = tu_seq_new(e, 0);
    for (int t = 0; t < MAXT; t++)
        A.tags[t] = 1;
    assert_ok(append_n(e, A.s, 0, BASE));
    assert_ok(put_kv(e, A.s, 1, 0, BASE));
    A.block0 = tu_seq_block(e, A.s, 0);
    assert_ok(kvh_seq_vmap(e, A.s, 0, MAXT, &A.own));
    for (int i = 0; i < READERS; i++)
        assert_ok(kvh_seq_vmap(e, A.s, 1, 0, &A.reader[i]));
    atomic_store(&stop_flag, 0);
    atomic_store(&n_checks, 0);
    atomic_store(&n_views, 0);
    mt_worker w[2 + READERS];
    mt_run_for(e, 2 + READERS, grow_role, w, 3.0, &stop_flag);
    print_message("%ld checks, %ld views made by readers\n", atomic_load(&n_checks), atomic_load(&n_views));
    assert_true(atomic_load(&n_checks) > 10);
    assert_true(atomic_load(&n_views) > 0);

    /* Afterwards: everything reads right, and the holds go with the views. */
    uint64_t len = tu_seq_len(e, A.s);
    assert_ok(kvh_seq_acquire(e, A.s, 0, len, NULL));
    assert_ok(kvh_vmap_refresh(e, A.own, NULL));
    assert_ok(kvh_seq_release(e, A.s, 0, len));
    kvh_vmap_view v = tu_vmap_view(e, A.own);
    char msg[200] = "";
    assert_int_equal(v.n_tokens, len);
    if (!view_check(&v, A.tags, 0, len, msg, sizeof(msg)))
        fail_msg("%s", msg);
    for (uint32_t l = 0; l < L; l++) {
        kvh_status st = read_check(e, A.s, A.tags, l, 0, len, msg, sizeof(msg));
        if (st != KVH_OK)
            fail_msg("final read: %s %s", kvh_status_name(st), msg);
    }
    assert_int_equal(tu_binfo(e, A.block0).holds, 1 + READERS);
    for (int i = 0; i < READERS; i++)
        assert_ok(kvh_vmap_release(e, A.reader[i]));
    assert_ok(kvh_vmap_release(e, A.own));
    assert_int_equal(tu_binfo(e, A.block0).holds, 0);
    for (uint64_t b = 0; b < (len + BT - 1) / BT; b++)
        assert_int_equal(tu_seq_binfo(e, A.s, b).holds, 0);
    assert_ok(kvh_seq_free(e, A.s));
}

/* ================================================================== */
/* A parent's views while its forks copy on write                     */
/* ================================================================== */

enum { PLEN = 40, FORKERS = 3 }; /* block 2 partial and shared with every fork */

static struct {
    kvh_seq p;
    kvh_vmap *pv[L];
    uint32_t ptags[MAXT];
    float ref[L][H * D]; /* decode over the parent at the start */
    float q[H * D];
} P;

/* Forks the parent, writes its own tag into the child (into the shared
 * partial block, into a shared full block, past the end), checks the
 * child through a view and read_kv, and frees it, sometimes before its
 * view: the stale view keeps the child's bytes. */
static void *forker(mt_worker *w)
{
    kvh_engine *e = w->e;
    tu_rng r = {tu_seed(0xf0f0) + (uint64_t)w->t};
    uint32_t tags[MAXT];
    char msg[200];
    float out[H * D], ref[H * D];
    while (!atomic_load(&stop_flag) && !w->errors) {
        kvh_seq c;
        kvh_status st = kvh_seq_fork(e, P.p, (uint32_t)w->t, &c);
        if (st == KVH_ERR_BUSY)
            continue;
        if (st != KVH_OK) {
            mt_report(w, "fork: %s: %s", kvh_status_name(st), kvh_last_error());
            break;
        }
        atomic_fetch_add(&n_forks, 1);
        memcpy(tags, P.ptags, sizeof(tags));
        uint32_t tag = 100 + (uint32_t)w->t;
        uint64_t len = PLEN;
        switch (tu_below(&r, 3)) {
        case 0: /* the shared partial block */
            st = put_kv(e, c, tag, 33, 5);
            for (int t = 33; t < 38; t++)
                tags[t] = tag;
            break;
        case 1: /* a full, fully written, shared block */
            st = put_kv(e, c, tag, 3, 2);
            tags[3] = tags[4] = tag;
            break;
        default: /* appended past the end: the shared last block is copied */
            st = append_n(e, c, PLEN, 30);
            if (st == KVH_OK)
                st = put_kv(e, c, tag, PLEN, 30);
            for (int t = PLEN; t < PLEN + 30; t++)
                tags[t] = tag;
            len += 30;
        }
        if (st != KVH_OK && st != KVH_ERR_NOSPACE)
            mt_report(w, "child write: %s: %s", kvh_status_name(st), kvh_last_error());
        kvh_vmap *m = NULL;
        uint32_t l = (uint32_t)tu_below(&r, L);
        if (st == KVH_OK && (st = kvh_seq_vmap(e, c, l, 0, &m)) == KVH_OK) {
            atomic_fetch_add(&n_views, 1);
            kvh_vmap_view v = get_view(e, m, &st);
            if (st != KVH_OK || v.n_tokens != len)
                mt_report(w, "child view: %s, %" PRIu64 " tokens", kvh_status_name(st), v.n_tokens);
            else if (!view_check(&v, tags, 0, len, msg, sizeof(msg)))
                mt_report(w, "child view: %s", msg);
            if ((st = kvh_attention_decode_vmap(e, &m, 1, P.q, out, NULL)) != KVH_OK ||
                (st = kvh_attention_decode(e, l, &c, 1, P.q, ref, NULL)) != KVH_OK)
                mt_report(w, "child decode: %s: %s", kvh_status_name(st), kvh_last_error());
            else if (memcmp(out, ref, sizeof(out)) != 0)
                mt_report(w, "child decode over the view differs from paged decode");
            if (tu_below(&r, 2)) { /* the view outlives the child */
                if ((st = kvh_seq_free(e, c)) != KVH_OK)
                    mt_report(w, "free: %s", kvh_status_name(st));
                c.id = 0;
                if (!view_check(&v, tags, 0, len, msg, sizeof(msg)))
                    mt_report(w, "child view after free: %s", msg);
            }
            if ((st = kvh_vmap_release(e, m)) != KVH_OK)
                mt_report(w, "release: %s", kvh_status_name(st));
        } else if (st != KVH_OK && st != KVH_ERR_NOSPACE && st != KVH_ERR_NOT_RESIDENT) {
            mt_report(w, "child vmap: %s: %s", kvh_status_name(st), kvh_last_error());
        }
        if (c.id) {
            st = read_check(e, c, tags, l, 0, len, msg, sizeof(msg));
            if (st == KVH_ERR_INTERNAL)
                mt_report(w, "child %s", msg);
            else if (st != KVH_OK)
                mt_report(w, "child read: %s: %s", kvh_status_name(st), kvh_last_error());
            if ((st = kvh_seq_free(e, c)) != KVH_OK)
                mt_report(w, "free: %s", kvh_status_name(st));
        }
        atomic_fetch_add(&n_checks, 1);
    }
    return NULL;
}

/* The parent's views are never stale (its block table never changes) and
 * show its bytes; decode over them gives the same numbers as at the start. */
static void *parent_reader(mt_worker *w)
{
    kvh_engine *e = w->e;
    char msg[200];
    float out[H * D];
    kvh_vmap_view v[L];
    for (uint32_t l = 0; l < L; l++) {
        kvh_status st;
        v[l] = get_view(e, P.pv[l], &st);
        if (st != KVH_OK) {
            mt_report(w, "get: %s", kvh_status_name(st));
            return NULL;
        }
    }
    while (!atomic_load(&stop_flag) && !w->errors) {
        for (uint32_t l = 0; l < L; l++) {
            if (!view_check(&v[l], P.ptags, 0, PLEN, msg, sizeof(msg)))
                mt_report(w, "parent view: %s", msg);
            kvh_status st = kvh_attention_decode_vmap(e, &P.pv[l], 1, P.q, out, NULL);
            if (st != KVH_OK)
                mt_report(w, "decode over the parent's view: %s: %s", kvh_status_name(st), kvh_last_error());
            else if (memcmp(out, P.ref[l], sizeof(out)) != 0)
                mt_report(w, "decode over the parent's view of layer %u changed", l);
            st = read_check(e, P.p, P.ptags, l, 0, PLEN, msg, sizeof(msg));
            if (st == KVH_ERR_INTERNAL)
                mt_report(w, "parent %s", msg);
            else if (st != KVH_OK && st != KVH_ERR_BUSY)
                mt_report(w, "parent read: %s: %s", kvh_status_name(st), kvh_last_error());
        }
        atomic_fetch_add(&n_checks, 1);
    }
    return NULL;
}

static void *fork_role(void *arg)
{
    mt_worker *w = arg;
    return w->t < FORKERS ? forker(w) : parent_reader(w);
}

static void test_parent_views_while_forks_copy_on_write(void **state)
{
    (void)state;
    kvh_engine *e = open_vmap(48, 0, 1);
    P.p = tu_seq_new(e, 0);
    for (int t = 0; t < MAXT; t++)
        P.ptags[t] = 5;
    assert_ok(append_n(e, P.p, 0, PLEN));
    assert_ok(put_kv(e, P.p, 5, 0, PLEN));
    fill_q(P.q, H * D, 4);
    for (uint32_t l = 0; l < L; l++) {
        assert_ok(kvh_seq_vmap(e, P.p, l, 0, &P.pv[l]));
        assert_ok(kvh_attention_decode(e, l, &P.p, 1, P.q, P.ref[l], NULL));
    }
    uint64_t gen[L];
    for (uint32_t l = 0; l < L; l++)
        gen[l] = tu_vmap_view(e, P.pv[l]).generation;
    atomic_store(&stop_flag, 0);
    atomic_store(&n_checks, 0);
    atomic_store(&n_views, 0);
    atomic_store(&n_forks, 0);
    mt_worker w[FORKERS + 1];
    mt_run_for(e, FORKERS + 1, fork_role, w, 3.0, &stop_flag);
    print_message("%ld checks, %ld forks, %ld child views\n", atomic_load(&n_checks), atomic_load(&n_forks),
                  atomic_load(&n_views));
    assert_true(atomic_load(&n_checks) > 10);
    assert_true(atomic_load(&n_views) > 0);
    for (uint32_t l = 0; l < L; l++) {
        int32_t changed = -1;
        assert_ok(kvh_vmap_refresh(e, P.pv[l], &changed));
        assert_int_equal(changed, 0);
        assert_int_equal(tu_vmap_view(e, P.pv[l]).generation, gen[l]);
        assert_ok(kvh_vmap_release(e, P.pv[l]));
    }
    for (uint64_t b = 0; b < 3; b++) {
        kvh_block_info bi = tu_seq_binfo(e, P.p, b);
        assert_int_equal(bi.holds, 0);
        assert_int_equal(bi.refs, 1); /* every fork is gone */
    }
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).pinned_blocks, 0);
    assert_ok(kvh_seq_free(e, P.p));
}

/* ================================================================== */
/* Views racing the free of their sequence                            */
/* ================================================================== */

/* Each round a fresh sequence with a view is freed by one thread while
 * others use the view (decode, get, refresh, direct reads), make and drop
 * new views of the sequence, and migrate and prefetch it. The view
 * outlives the sequence: its numbers and bytes stay right until refresh
 * and decode refuse it (KVH_ERR_BAD_HANDLE); calls naming the sequence
 * get KVH_OK, KVH_ERR_BUSY (checked overlap) or, once it is freed,
 * KVH_ERR_BAD_HANDLE. No view value repeats, and no hold is left: the
 * whole device tier can be acquired at the end. */
enum { FR_ROUNDS = 120, FR_THREADS = 4, FR_LEN = 40, FR_DEV = 48, FR_MAXV = 20000 };

static struct {
    pthread_barrier_t bar;
    kvh_seq s;
    kvh_vmap *v;
    uint32_t tags[MAXT];
    float ref[H * D], q[H * D];
    atomic_int freed;
    uintptr_t *seen[FR_THREADS];
    int n_seen[FR_THREADS];
    atomic_long decodes_ok, decodes_refused;
} FR;

static void fr_note(mt_worker *w, kvh_vmap *m)
{
    if (FR.n_seen[w->t] < FR_MAXV)
        FR.seen[w->t][FR.n_seen[w->t]++] = (uintptr_t)m;
}

static void *fr_role(void *arg)
{
    mt_worker *w = arg;
    kvh_engine *e = w->e;
    tu_rng r = {tu_seed(0xf5ee) + (uint64_t)w->t};
    char msg[200];
    for (int round = 0; round < FR_ROUNDS; round++) {
        if (w->t == 0) {
            kvh_status st = kvh_seq_create(e, 0, &FR.s);
            if (st == KVH_OK)
                st = append_n(e, FR.s, 0, FR_LEN);
            for (int t = 0; t < MAXT; t++)
                FR.tags[t] = 300 + (uint32_t)round;
            if (st == KVH_OK)
                st = put_kv(e, FR.s, FR.tags[0], 0, FR_LEN);
            if (st == KVH_OK)
                st = kvh_seq_vmap(e, FR.s, (uint32_t)round & 1, 0, &FR.v);
            if (st == KVH_OK)
                st = kvh_attention_decode(e, (uint32_t)round & 1, &FR.s, 1, FR.q, FR.ref, NULL);
            if (st != KVH_OK)
                mt_report(w, "round %d setup: %s: %s", round, kvh_status_name(st), kvh_last_error());
            else
                fr_note(w, FR.v);
            atomic_store(&FR.freed, 0);
        }
        pthread_barrier_wait(&FR.bar);
        if (w->errors) {
            /* keep the barriers in step; do nothing */
        } else if (w->t == 0) { /* the freer */
            for (uint64_t spin = tu_below(&r, 20000); spin; spin--)
                __asm__ volatile("" ::: "memory");
            kvh_status st;
            while ((st = kvh_seq_free(e, FR.s)) == KVH_ERR_BUSY)
                ;
            if (st != KVH_OK)
                mt_report(w, "free: %s", kvh_status_name(st));
            atomic_store(&FR.freed, 1);
        } else if (w->t == 1) { /* the view's user */
            kvh_status st;
            kvh_vmap_view v0 = get_view(e, FR.v, &st);
            bool last = false;
            float out[H * D];
            while (!w->errors) {
                last = atomic_load(&FR.freed) != 0;
                kvh_vmap_view v = get_view(e, FR.v, &st);
                if (st != KVH_OK || v.n_tokens != FR_LEN || v.k != v0.k || v.generation != v0.generation)
                    mt_report(w, "get: %s, %" PRIu64 " tokens", kvh_status_name(st), v.n_tokens);
                else if (!view_check(&v, FR.tags, 0, FR_LEN, msg, sizeof(msg)))
                    mt_report(w, "view of a sequence being freed: %s", msg);
                st = kvh_attention_decode_vmap(e, &FR.v, 1, FR.q, out, NULL);
                if (st == KVH_OK) {
                    atomic_fetch_add(&FR.decodes_ok, 1);
                    if (memcmp(out, FR.ref, sizeof(out)) != 0)
                        mt_report(w, "decode over the view changed");
                    if (last)
                        mt_report(w, "decode over the view of a freed sequence: KVH_OK");
                } else if (st == KVH_ERR_BAD_HANDLE) {
                    atomic_fetch_add(&FR.decodes_refused, 1);
                } else {
                    mt_report(w, "decode_vmap: %s: %s", kvh_status_name(st), kvh_last_error());
                }
                int32_t changed = -1;
                st = kvh_vmap_refresh(e, FR.v, &changed);
                if (st == KVH_OK && (changed != 0 || last))
                    mt_report(w, "refresh: changed %d%s", changed, last ? " after the free" : "");
                else if (st != KVH_OK && st != KVH_ERR_BUSY && st != KVH_ERR_BAD_HANDLE)
                    mt_report(w, "refresh: %s: %s", kvh_status_name(st), kvh_last_error());
                if (last)
                    break;
            }
            if ((st = kvh_vmap_release(e, FR.v)) != KVH_OK)
                mt_report(w, "release: %s", kvh_status_name(st));
        } else if (w->t == 2) { /* new views of the sequence */
            for (bool last = false; !last && !w->errors;) {
                last = atomic_load(&FR.freed) != 0;
                kvh_vmap *m = NULL;
                kvh_status st = kvh_seq_vmap(e, FR.s, (uint32_t)tu_below(&r, L), 0, &m);
                if (st == KVH_OK) {
                    fr_note(w, m);
                    kvh_vmap_view v = get_view(e, m, &st);
                    if (last)
                        mt_report(w, "seq_vmap of a freed sequence: KVH_OK");
                    else if (st != KVH_OK || !view_check(&v, FR.tags, 0, FR_LEN, msg, sizeof(msg)))
                        mt_report(w, "new view: %s %s", kvh_status_name(st), msg);
                    if ((st = kvh_vmap_release(e, m)) != KVH_OK)
                        mt_report(w, "release: %s", kvh_status_name(st));
                } else if (st != KVH_ERR_BUSY && st != KVH_ERR_BAD_HANDLE) {
                    mt_report(w, "seq_vmap: %s: %s", kvh_status_name(st), kvh_last_error());
                }
            }
        } else { /* @threads any calls on the sequence */
            for (bool last = false; !last && !w->errors;) {
                last = atomic_load(&FR.freed) != 0;
                uint64_t len = 0;
                kvh_status st = kvh_seq_length(e, FR.s, &len);
                if (st == KVH_OK && (len != FR_LEN || last))
                    mt_report(w, "length %" PRIu64 "%s", len, last ? " after the free" : "");
                else if (st != KVH_OK && st != KVH_ERR_BAD_HANDLE)
                    mt_report(w, "length: %s", kvh_status_name(st));
                st = tu_below(&r, 2) ? kvh_seq_migrate(e, FR.s, 0, FR_LEN, (uint32_t)tu_below(&r, 2), NULL)
                                     : kvh_prefetch(e, FR.s, 0, FR_LEN, 3, NULL);
                if (st != KVH_OK && st != KVH_ERR_BAD_HANDLE && st != KVH_ERR_NOSPACE)
                    mt_report(w, "migrate/prefetch: %s: %s", kvh_status_name(st), kvh_last_error());
            }
        }
        pthread_barrier_wait(&FR.bar);
    }
    return NULL;
}

static int cmp_uptr(const void *a, const void *b)
{
    uintptr_t x = *(const uintptr_t *)a, y = *(const uintptr_t *)b;
    return x < y ? -1 : x > y;
}

static void test_views_race_the_free_of_their_sequence(void **state)
{
    (void)state;
    kvh_engine *e = open_vmap(FR_DEV, 24, 2);
    memset(&FR, 0, sizeof(FR));
    fill_q(FR.q, H * D, 6);
    assert_int_equal(pthread_barrier_init(&FR.bar, NULL, FR_THREADS), 0);
    for (int t = 0; t < FR_THREADS; t++)
        FR.seen[t] = tu_alloc(sizeof(uintptr_t) * FR_MAXV);
    mt_worker w[FR_THREADS];
    mt_run(e, FR_THREADS, fr_role, w);
    pthread_barrier_destroy(&FR.bar);
    print_message("decode over a view of a sequence being freed: %ld KVH_OK, %ld refused\n",
                  atomic_load(&FR.decodes_ok), atomic_load(&FR.decodes_refused));
    int n = 0;
    uintptr_t *all = tu_alloc(sizeof(uintptr_t) * FR_MAXV * FR_THREADS);
    for (int t = 0; t < FR_THREADS; t++)
        for (int i = 0; i < FR.n_seen[t]; i++)
            all[n++] = FR.seen[t][i];
    qsort(all, (size_t)n, sizeof(all[0]), cmp_uptr);
    for (int i = 1; i < n; i++)
        if (all[i] == all[i - 1])
            fail_msg("view value %#jx handed out twice", (uintmax_t)all[i]);
    assert_true(n > FR_ROUNDS);
    /* No hold is left behind: one sequence can hold the whole device tier. */
    kvh_seq big = tu_seq_new(e, 0);
    for (int b = 0; b < FR_DEV; b++)
        assert_ok(append_n(e, big, (uint64_t)b * BT, BT));
    assert_ok(kvh_seq_acquire(e, big, 0, FR_DEV * BT, NULL));
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, FR_DEV);
    assert_ok(kvh_seq_release(e, big, 0, FR_DEV * BT));
}

/* ================================================================== */
/* Engines with views opened and closed on several threads at once    */
/* ================================================================== */

/* Each thread opens its own engines, maps views, leaves some of them and
 * a fence open at close, and tries its views on the other threads'
 * engines: every engine's views show its own bytes, foreign views are
 * KVH_ERR_BAD_HANDLE, and closes with views open leak nothing (ASan). */
enum { EN_THREADS = 4, EN_ITERS = 12 };

static _Atomic(uintptr_t) en_view[EN_THREADS];

static void *en_role(void *arg)
{
    mt_worker *w = arg;
    char msg[200];
    uint32_t tags[MAXT];
    for (int it = 0; it < EN_ITERS && !w->errors; it++) {
        uint32_t tag = 500 + (uint32_t)(w->t * 100 + it);
        for (int t = 0; t < MAXT; t++)
            tags[t] = tag;
        kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F32, 16, 8, 1);
        c.vmap = 1;
        kvh_engine *e = NULL;
        kvh_status st = kvh_engine_open(&c, &e);
        if (st != KVH_OK) {
            mt_report(w, "open: %s: %s", kvh_status_name(st), kvh_last_error());
            break;
        }
        kvh_seq s;
        kvh_vmap *m[2] = {NULL, NULL};
        kvh_fence f;
        st = kvh_seq_create(e, 0, &s);
        if (st == KVH_OK)
            st = append_n(e, s, 0, 2 * BT + 3);
        if (st == KVH_OK)
            st = put_kv(e, s, tag, 0, 2 * BT + 3);
        for (uint32_t l = 0; l < L && st == KVH_OK; l++)
            st = kvh_seq_vmap(e, s, l, 0, &m[l]);
        if (st == KVH_OK)
            st = kvh_seq_migrate(e, s, 0, 2 * BT + 3, KVH_TIER_HOST, &f); /* held: nothing moves */
        if (st != KVH_OK) {
            mt_report(w, "setup: %s: %s", kvh_status_name(st), kvh_last_error());
            kvh_engine_close(e);
            break;
        }
        for (uint32_t l = 0; l < L; l++) {
            kvh_vmap_view v = get_view(e, m[l], &st);
            if (st != KVH_OK || v.n_tokens != 2 * BT + 3 || !view_check(&v, tags, 0, 2 * BT + 3, msg, sizeof(msg)))
                mt_report(w, "own view: %s %s", kvh_status_name(st), msg);
        }
        /* Publish one view; try the others' published views here. */
        atomic_store(&en_view[w->t], (uintptr_t)m[0]);
        for (int o = 0; o < EN_THREADS; o++) {
            kvh_vmap *fv = (kvh_vmap *)atomic_load(&en_view[o]);
            if (o == w->t || !fv)
                continue;
            kvh_vmap_view v = {.struct_size = sizeof(v), .layer = 91};
            st = kvh_vmap_get(e, fv, &v);
            if (st != KVH_ERR_BAD_HANDLE || v.layer != 91)
                mt_report(w, "another engine's view: %s", kvh_status_name(st));
            int32_t changed = -1;
            if ((st = kvh_vmap_refresh(e, fv, &changed)) != KVH_ERR_BAD_HANDLE || changed != -1)
                mt_report(w, "refresh of another engine's view: %s", kvh_status_name(st));
            if ((st = kvh_vmap_release(e, fv)) != KVH_ERR_BAD_HANDLE)
                mt_report(w, "release of another engine's view: %s", kvh_status_name(st));
        }
        if (it & 1) {
            if ((st = kvh_fence_wait(e, f, UINT64_MAX)) != KVH_OK)
                mt_report(w, "fence: %s: %s", kvh_status_name(st), kvh_last_error());
            if ((st = kvh_vmap_release(e, m[1])) != KVH_OK)
                mt_report(w, "release: %s", kvh_status_name(st));
        }
        atomic_store(&en_view[w->t], 0);
        if ((st = kvh_engine_close(e)) != KVH_OK) /* views, sequence, fence left open */
            mt_report(w, "close: %s", kvh_status_name(st));
    }
    return NULL;
}

static void test_engines_with_views_on_many_threads(void **state)
{
    (void)state;
    for (int t = 0; t < EN_THREADS; t++)
        atomic_store(&en_view[t], 0);
    mt_worker w[EN_THREADS];
    mt_run(NULL, EN_THREADS, en_role, w);
}

/* ================================================================== */
/* kvh_engine_close racing view, fence and migration calls            */
/* ================================================================== */

enum { CLOSERS = 4 };

static struct {
    kvh_seq s[CLOSERS];
    uint32_t tags[CLOSERS][MAXT];
    atomic_int left[CLOSERS];
    atomic_int closed_seen;
    atomic_long calls_ok;
    atomic_int halt; /* no gate: make no further call */
} C;

/* true when the worker must stop: KVH_ERR_CLOSED (counted), or a status
 * outside `allowed` (reported). */
static bool stop_on(mt_worker *w, kvh_status st, unsigned allowed, const char *what)
{
    if (st == KVH_OK) {
        atomic_fetch_add(&C.calls_ok, 1);
        return false;
    }
    if (st == KVH_ERR_CLOSED) {
        atomic_fetch_add(&C.closed_seen, 1);
        return true;
    }
    if (st < -31 || !(allowed & BIT(st))) {
        mt_report(w, "%s: %s: %s", what, kvh_status_name(st), kvh_last_error());
        return true;
    }
    return false;
}

/* Each thread works on its own sequence and views; every call gets its
 * usual status or KVH_ERR_CLOSED, and the thread stops at the first
 * KVH_ERR_CLOSED. Views are checked through calls only (close unmaps
 * them). */
static void *close_worker(void *arg)
{
    mt_worker *w = arg;
    kvh_engine *e = w->e;
    int i = w->t;
    kvh_seq s = C.s[i];
    tu_rng r = {tu_seed(0xc1c1) + (uint64_t)i};
    kvh_vmap *keep = NULL; /* a view left open for close to release */
    float q[H * D], a[H * D], b[H * D];
    fill_q(q, H * D, 5);
    char msg[200];
    uint64_t len = BASE;
    for (;;) {
        if (atomic_load(&C.halt) || w->errors)
            break;
        kvh_status st;
        kvh_vmap *m = NULL;
        kvh_fence f;
        uint32_t l = (uint32_t)tu_below(&r, L);
        switch (tu_below(&r, 6)) {
        case 0: /* a view, decode over it against paged decode, release */
            st = kvh_seq_vmap(e, s, l, MAXT, &m);
            if (stop_on(w, st, BIT(KVH_ERR_NOT_RESIDENT), "seq_vmap"))
                goto out;
            if (st != KVH_OK)
                break;
            st = kvh_attention_decode_vmap(e, &m, 1, q, b, NULL);
            if (stop_on(w, st, 0, "decode_vmap"))
                goto out;
            st = kvh_attention_decode(e, l, &s, 1, q, a, NULL);
            if (stop_on(w, st, 0, "decode"))
                goto out;
            if (memcmp(a, b, sizeof(a)) != 0) {
                mt_report(w, "decode over a view differs from paged decode");
                goto out;
            }
            if (!keep && tu_below(&r, 4) == 0) {
                keep = m;
                break;
            }
            if (stop_on(w, kvh_vmap_release(e, m), 0, "vmap_release"))
                goto out;
            break;
        case 1: /* grow by a block, or truncate back */
            if (len + BT <= MAXT && tu_below(&r, 2)) {
                st = append_n(e, s, len, BT);
                if (stop_on(w, st, BIT(KVH_ERR_NOSPACE), "append"))
                    goto out;
                if (st != KVH_OK)
                    break;
                len += BT;
                st = put_kv(e, s, C.tags[i][0], len - BT, BT);
                if (stop_on(w, st, 0, "write_kv"))
                    goto out;
            } else if (len > BASE) {
                if (stop_on(w, kvh_seq_truncate(e, s, BASE), 0, "truncate"))
                    goto out;
                len = BASE;
            }
            break;
        case 2: /* the kept view: refresh (its blocks are its own) */
            if (!keep)
                break;
            st = kvh_vmap_refresh(e, keep, NULL);
            if (stop_on(w, st, BIT(KVH_ERR_NOT_RESIDENT), "refresh"))
                goto out;
            break;
        case 3: /* migrate with a fence, waited a little */
            st = kvh_seq_migrate(e, s, 0, len, tu_below(&r, 2) ? KVH_TIER_HOST : KVH_TIER_DEVICE, &f);
            if (stop_on(w, st, 0, "seq_migrate"))
                goto out;
            st = kvh_fence_wait(e, f, 20 * 1000 * 1000);
            if (stop_on(w, st, BIT(KVH_ERR_TIMEOUT) | BIT(KVH_ERR_NOSPACE), "fence_wait")) {
                kvh_fence_free(e, f); /* may be CLOSED too: nothing to check */
                goto out;
            }
            if (stop_on(w, kvh_fence_free(e, f), 0, "fence_free"))
                goto out;
            break;
        case 4:
            st = kvh_prefetch(e, s, 0, len, 1, NULL);
            if (stop_on(w, st, 0, "prefetch"))
                goto out;
            break;
        default:
            st = read_check(e, s, C.tags[i], l, 0, len, msg, sizeof(msg));
            if (st == KVH_ERR_INTERNAL) {
                mt_report(w, "%s", msg);
                goto out;
            }
            if (stop_on(w, st, BIT(KVH_ERR_NOSPACE), "read_kv"))
                goto out;
        }
    }
out:
    atomic_store(&C.left[i], 1);
    return NULL;
}

static void test_close_races_view_and_migration_calls(void **state)
{
    (void)state;
    long closed = 0;
    int gated = 0;
    for (int round = 0; round < 4; round++) {
        kvh_config cfg = tu_cfg(L, H, D, BT, KVH_DTYPE_F32, 40, 24, 2);
        cfg.vmap = 1;
        kvh_engine *e = NULL;
        assert_ok(kvh_engine_open(&cfg, &e));
        memset(&C, 0, sizeof(C));
        for (int i = 0; i < CLOSERS; i++) {
            for (int t = 0; t < MAXT; t++)
                C.tags[i][t] = 20 + (uint32_t)i;
            assert_ok(kvh_seq_create(e, 0, &C.s[i]));
            assert_ok(append_n(e, C.s[i], 0, BASE));
            assert_ok(put_kv(e, C.s[i], C.tags[i][0], 0, BASE));
        }
        mt_worker mw[CLOSERS];
        pthread_t th[CLOSERS];
        mt_start(e, CLOSERS, close_worker, mw, th);
        dt_sleep_ms(30 + 40 * round);
        uffd_gate g;
        bool armed = uffd_gate_arm(e, &g, (uffd_gate_geometry){L, BT, H, D}, 880000);
        if (!armed) { /* no userfaultfd: stop the threads, then close */
            atomic_store(&C.halt, 1);
            mt_join(CLOSERS, th, mw);
        }
        mt_closer c = {.e = e};
        pthread_t ct;
        assert_int_equal(pthread_create(&ct, NULL, mt_close_thread, &c), 0);
        if (armed) {
            gated++;
            double t0 = dt_now();
            bool all = false;
            while (!all && dt_now() - t0 < 20.0) {
                all = true;
                for (int t = 0; t < CLOSERS; t++)
                    all &= atomic_load(&C.left[t]) != 0;
                if (!all)
                    dt_sleep_ms(1);
            }
            if (!all)
                atomic_store(&C.halt, 1);
            bool early = atomic_load(&c.done);
            uffd_gate_open(&g);
            pthread_join(ct, NULL);
            mt_join(CLOSERS, th, mw);
            uffd_gate_free(&g);
            if (early)
                fail_msg("round %d: kvh_engine_close returned while the gate held a migration", round);
            if (!all)
                fail_msg("round %d: calls had not returned KVH_ERR_CLOSED 20 s into kvh_engine_close", round);
            if (atomic_load(&C.closed_seen) != CLOSERS)
                fail_msg("round %d: %d threads saw KVH_ERR_CLOSED, of %d", round, atomic_load(&C.closed_seen), CLOSERS);
        } else {
            pthread_join(ct, NULL);
        }
        if (c.st != KVH_OK)
            fail_msg("round %d: kvh_engine_close returned %s", round, kvh_status_name(c.st));
        assert_true(atomic_load(&C.calls_ok) > 0);
        closed += atomic_load(&C.closed_seen);
    }
    print_message("%d gated rounds, %ld calls got KVH_ERR_CLOSED\n", gated, closed);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_views_while_the_owner_grows_and_others_migrate, tu_teardown),
        cmocka_unit_test_teardown(test_parent_views_while_forks_copy_on_write, tu_teardown),
        cmocka_unit_test_teardown(test_views_race_the_free_of_their_sequence, tu_teardown),
        cmocka_unit_test_teardown(test_engines_with_views_on_many_threads, tu_teardown),
        cmocka_unit_test_teardown(test_close_races_view_and_migration_calls, tu_teardown),
    };
    return cmocka_run_group_tests_name("vmap_hostile_mt", tests, NULL, NULL);
}
