/* Hints, prefetch and fences from other threads, against a hostile
 * caller, from kvh.h's promises alone. kvh_seq_hint, kvh_prefetch,
 * kvh_seq_hint_queued, kvh_hint_advance and the fence calls are
 * "@threads any": hinter threads aim them, with garbage ranges and
 * priorities, at sequences their owners are growing, rewriting,
 * truncating and freeing meanwhile (the handles they read may be stale),
 * and fences travel between threads: one waits on a fence while another
 * frees it. Owners check every KV byte of their sequences against their
 * own copy as they go; every status must be one the header lists, and
 * an owner's own calls never get KVH_ERR_BUSY from the hinters. */
#include <stdatomic.h>

#include "test_util.h"
#include "disk_test_util.h"
#include "mt_util.h"

enum { L = 2, H = 1, D = 4, BT = 4, OWNERS = 2, HINTERS = 2, FENCERS = 2, PER_OWNER = 4, MAXT = 5 * BT };
static const size_t TOKB = H * D * 4;
#define SLOTS (OWNERS * PER_OWNER)

typedef struct shared {
    kvh_engine *e;
    _Atomic uint64_t handle[SLOTS]; /* an owner's sequence, live or freed */
    _Atomic uint64_t mailbox;       /* a fence any thread may wait on */
    _Atomic int stop;
    _Atomic uint64_t hints, hints_taken, prefetches, prefetches_taken, verifies, fence_races;
} shared;

static shared G;

typedef struct owned {
    kvh_seq s;
    int live;
    uint64_t len;
    int32_t tokens[MAXT];
    uint64_t tag[MAXT];
} owned;

/* K and V of tokens [pos, pos + n) of one layer from their tags. */
static void fill(const owned *q, uint32_t layer, uint64_t pos, uint64_t n, uint8_t *k, uint8_t *v)
{
    for (uint64_t i = 0; i < n; i++) {
        tu_pattern(k + i * TOKB, TOKB, q->tag[pos + i], layer, pos + i, 0);
        tu_pattern(v + i * TOKB, TOKB, q->tag[pos + i], layer, pos + i, 1);
    }
}

/* Writes tokens [pos, pos + n) with their tags. KVH_ERR_NOSPACE only
 * from layer 0 (nothing written then). */
static kvh_status write_range(mt_worker *w, const owned *q, uint64_t pos, uint64_t n)
{
    uint8_t k[MAXT * 16], v[MAXT * 16];
    for (uint32_t l = 0; l < L; l++) {
        fill(q, l, pos, n, k, v);
        kvh_status st = kvh_seq_write_kv(w->e, q->s, l, pos, n, k, v);
        if (st == KVH_ERR_NOSPACE && l == 0)
            return st;
        if (st != KVH_OK) {
            mt_report(w, "write_kv layer %u: %s (%s)", l, kvh_status_name(st), kvh_last_error());
            return st;
        }
    }
    return KVH_OK;
}

static void verify(mt_worker *w, const owned *q, const char *when)
{
    uint8_t k[MAXT * 16], v[MAXT * 16], ek[MAXT * 16], ev[MAXT * 16];
    if (!q->live || !q->len)
        return;
    for (uint32_t l = 0; l < L; l++) {
        kvh_status st = kvh_seq_read_kv(w->e, q->s, l, 0, q->len, k, v);
        if (st == KVH_ERR_NOSPACE)
            return; /* every memory slot busy this instant: nothing to compare */
        if (st != KVH_OK) {
            mt_report(w, "%s: read_kv: %s (%s)", when, kvh_status_name(st), kvh_last_error());
            return;
        }
        fill(q, l, 0, q->len, ek, ev);
        if (memcmp(k, ek, q->len * TOKB) != 0 || memcmp(v, ev, q->len * TOKB) != 0) {
            mt_report(w, "%s: layer %u of a %" PRIu64 "-token sequence differs from its copy", when, l, q->len);
            return;
        }
    }
    atomic_fetch_add(&G.verifies, 1);
    int32_t t[MAXT];
    kvh_status st = kvh_seq_tokens(w->e, q->s, 0, q->len, t);
    if (st != KVH_OK || memcmp(t, q->tokens, q->len * sizeof(int32_t)) != 0)
        mt_report(w, "%s: tokens differ (%s)", when, kvh_status_name(st));
}

/* An owner's call: anything but KVH_OK and the statuses it may excuse is
 * reported, KVH_ERR_BUSY included (hinters' calls are @threads any). */
static int owner_ok(mt_worker *w, kvh_status st, const char *what, kvh_status excused)
{
    if (st == KVH_OK)
        return 1;
    if (st != excused)
        mt_report(w, "owner %s: %s (%s)", what, kvh_status_name(st), kvh_last_error());
    return 0;
}

static void owner(mt_worker *w, int me)
{
    owned q[PER_OWNER];
    memset(q, 0, sizeof(q));
    tu_rng r = {tu_seed(0x0e11) + (uint64_t)me};
    uint64_t next_tag = ((uint64_t)me + 1) << 40;
    int32_t next_token = (me + 1) * 10000000;
    while (!atomic_load(&G.stop) && !w->errors) {
        int i = (int)tu_below(&r, PER_OWNER);
        owned *o = &q[i];
        _Atomic uint64_t *pub = &G.handle[me * PER_OWNER + i];
        switch (tu_below(&r, 6)) {
        case 0:
        case 1: { /* create, grow */
            if (!o->live) {
                if (!owner_ok(w, kvh_seq_create(w->e, (uint32_t)me, &o->s), "create", KVH_OK))
                    return;
                o->live = 1;
                o->len = 0;
                atomic_store(pub, o->s.id);
            }
            uint64_t add = 1 + tu_below(&r, 2 * BT);
            if (o->len + add > MAXT)
                break;
            for (uint64_t t = 0; t < add; t++) {
                o->tokens[o->len + t] = next_token++;
                o->tag[o->len + t] = next_tag;
            }
            next_tag++;
            if (!owner_ok(w, kvh_seq_append(w->e, o->s, o->tokens + o->len, add), "append", KVH_ERR_NOSPACE))
                break;
            o->len += add;
            if (write_range(w, o, o->len - add, add) == KVH_ERR_NOSPACE)
                o->len -= add, (void)kvh_seq_truncate(w->e, o->s, o->len); /* never written: cut */
            break;
        }
        case 2: /* rewrite */
            if (o->live && o->len) {
                uint64_t first = tu_below(&r, o->len), n = 1 + tu_below(&r, o->len - first);
                uint64_t old[MAXT];
                memcpy(old, o->tag, sizeof(old));
                for (uint64_t t = first; t < first + n; t++)
                    o->tag[t] = next_tag;
                next_tag++;
                if (write_range(w, o, first, n) != KVH_OK)
                    memcpy(o->tag, old, sizeof(old));
            }
            break;
        case 3: /* truncate */
            if (o->live) {
                uint64_t to = tu_below(&r, o->len + 1);
                if (owner_ok(w, kvh_seq_truncate(w->e, o->s, to), "truncate", KVH_ERR_NOSPACE))
                    o->len = to;
            }
            break;
        case 4: /* free (the handle stays published, stale) */
            if (o->live && tu_below(&r, 3) == 0) {
                verify(w, o, "before free");
                owner_ok(w, kvh_seq_free(w->e, o->s), "free", KVH_OK);
                o->live = 0;
            }
            break;
        default:
            verify(w, o, "check");
        }
    }
    for (int i = 0; i < PER_OWNER; i++) {
        verify(w, &q[i], "at the end");
        if (q[i].live)
            owner_ok(w, kvh_seq_free(w->e, q[i].s), "free", KVH_OK);
    }
}

static int one_of(kvh_status st, kvh_status a, kvh_status b, kvh_status c, kvh_status d)
{
    return st == a || st == b || st == c || st == d;
}

static int32_t garbage_priority(tu_rng *r)
{
    static const int32_t edge[] = {INT32_MIN, INT32_MIN + 1, -1, 0, INT32_MAX};
    return tu_below(r, 2) ? edge[tu_below(r, 5)] : (int32_t)tu_next(r);
}

static void garbage_range(tu_rng *r, uint64_t *first, uint64_t *n)
{
    switch (tu_below(r, 4)) {
    case 0:
        *first = tu_next(r);
        *n = tu_next(r);
        break;
    case 1:
        *first = tu_below(r, 4);
        *n = UINT64_MAX - tu_below(r, 3);
        break;
    default:
        *first = tu_below(r, MAXT);
        *n = tu_below(r, MAXT);
    }
}

/* Takes the mailbox's fence (if any) and frees it: exactly one thread
 * frees each fence, so its free must succeed. */
static void retire_mailbox(mt_worker *w)
{
    uint64_t id = atomic_exchange(&G.mailbox, 0);
    if (!id)
        return;
    kvh_status st = kvh_fence_free(w->e, (kvh_fence){id});
    if (st != KVH_OK)
        mt_report(w, "free of a fence taken from the mailbox: %s", kvh_status_name(st));
}

static void hinter(mt_worker *w, int me)
{
    tu_rng r = {tu_seed(0x417) * 31 + (uint64_t)me};
    while (!atomic_load(&G.stop) && !w->errors) {
        kvh_seq s = {atomic_load(&G.handle[tu_below(&r, SLOTS)])};
        uint64_t first, n;
        garbage_range(&r, &first, &n);
        if (tu_below(&r, 2)) { /* mostly a plausible range */
            first = 0;
            n = tu_below(&r, MAXT / 2);
        }
        kvh_status st;
        switch (tu_below(&r, 5)) {
        case 0:
            st = kvh_seq_hint(w->e, s, first, n, garbage_priority(&r));
            if (!one_of(st, KVH_OK, KVH_ERR_RANGE, KVH_ERR_BAD_HANDLE, KVH_ERR_BAD_HANDLE))
                mt_report(w, "hint: %s", kvh_status_name(st));
            atomic_fetch_add(&G.hints, 1);
            if (st == KVH_OK)
                atomic_fetch_add(&G.hints_taken, 1);
            break;
        case 1: {
            kvh_fence f = {0x5e57};
            int with_fence = (int)tu_below(&r, 2);
            st = kvh_prefetch(w->e, s, first, n, garbage_priority(&r), with_fence ? &f : NULL);
            atomic_fetch_add(&G.prefetches, 1);
            if (st == KVH_OK)
                atomic_fetch_add(&G.prefetches_taken, 1);
            if (!one_of(st, KVH_OK, KVH_ERR_RANGE, KVH_ERR_BAD_HANDLE, KVH_ERR_NOMEM)) {
                mt_report(w, "prefetch: %s (%s)", kvh_status_name(st), kvh_last_error());
                break;
            }
            if (!with_fence)
                break;
            if (st != KVH_OK) {
                if (f.id != 0x5e57)
                    mt_report(w, "prefetch wrote its fence on %s", kvh_status_name(st));
                break;
            }
            if (tu_below(&r, 2)) { /* post it for the fencers */
                uint64_t old = atomic_exchange(&G.mailbox, f.id);
                if (old && kvh_fence_free(w->e, (kvh_fence){old}) != KVH_OK)
                    mt_report(w, "free of a fence taken back from the mailbox failed");
                break;
            }
            static const uint64_t timeouts[] = {0, 1, 1000000, UINT64_MAX};
            st = kvh_fence_wait(w->e, f, timeouts[tu_below(&r, 4)]);
            if (!one_of(st, KVH_OK, KVH_ERR_TIMEOUT, KVH_OK, KVH_OK))
                mt_report(w, "prefetch fence: %s (%s)", kvh_status_name(st), kvh_last_error());
            st = kvh_fence_free(w->e, f);
            if (st != KVH_OK)
                mt_report(w, "fence_free: %s", kvh_status_name(st));
            break;
        }
        case 2: {
            uint64_t place = tu_below(&r, 8) ? tu_below(&r, 6) : tu_next(&r);
            uint32_t kind = (uint32_t)tu_below(&r, 3);
            st = kvh_seq_hint_queued(w->e, s, first, n, place, (kvh_hint_place)kind);
            if (!one_of(st, KVH_OK, KVH_ERR_RANGE, KVH_ERR_BAD_HANDLE, KVH_ERR_INVALID_ARG) ||
                (kind == 2 && st != KVH_ERR_INVALID_ARG))
                mt_report(w, "hint_queued kind %u: %s", kind, kvh_status_name(st));
            break;
        }
        case 3: {
            uint64_t step;
            st = kvh_hint_advance(w->e, tu_below(&r, 3), &step);
            if (st != KVH_OK)
                mt_report(w, "hint_advance: %s", kvh_status_name(st));
            break;
        }
        default:
            retire_mailbox(w);
        }
    }
}

/* Waits on whatever fence the mailbox names while others free it. */
static void fencer(mt_worker *w, int me)
{
    tu_rng r = {tu_seed(0xfe9ce) * 7 + (uint64_t)me};
    while (!atomic_load(&G.stop) && !w->errors) {
        uint64_t id = atomic_load(&G.mailbox);
        if (!id) {
            dt_sleep_ms(0.05);
            continue;
        }
        kvh_fence f = {id};
        kvh_status st;
        if (tu_below(&r, 2)) {
            int32_t done = 7;
            st = kvh_fence_poll(w->e, f, &done);
            if (!one_of(st, KVH_OK, KVH_ERR_BAD_HANDLE, KVH_OK, KVH_OK) || (st == KVH_OK && done != 0 && done != 1))
                mt_report(w, "poll: %s, done %d", kvh_status_name(st), done);
        } else {
            st = kvh_fence_wait(w->e, f, tu_below(&r, 2) ? UINT64_MAX : 1000);
            if (!one_of(st, KVH_OK, KVH_ERR_TIMEOUT, KVH_ERR_BAD_HANDLE, KVH_OK))
                mt_report(w, "wait: %s (%s)", kvh_status_name(st), kvh_last_error());
        }
        if (st == KVH_ERR_BAD_HANDLE)
            atomic_fetch_add(&G.fence_races, 1);
        if (tu_below(&r, 3) == 0)
            retire_mailbox(w);
    }
}

static void *worker(void *arg)
{
    mt_worker *w = arg;
    if (w->t < OWNERS)
        owner(w, w->t);
    else if (w->t < OWNERS + HINTERS)
        hinter(w, w->t - OWNERS);
    else
        fencer(w, w->t - OWNERS - HINTERS);
    return NULL;
}

static void run(void **state, int with_disk)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("hints_mt", dir, sizeof(dir));
    dt_rmrf(dir);
    const dt_geo g = {L, H, D, BT, KVH_DTYPE_F32};
    kvh_config c = dt_cfg(g, dir, 6, with_disk ? 8 : 40, with_disk ? 128 : 0, 2);
    memset(&G, 0, sizeof(G));
    G.e = dt_open_a(&c);
    double seconds = (double)dt_env_long("KVH_HINTS_MT_MS", 1500) / 1000.0;
    mt_worker w[OWNERS + HINTERS + FENCERS];
    mt_run_for(G.e, OWNERS + HINTERS + FENCERS, worker, w, seconds, &G.stop);
    uint64_t last = atomic_exchange(&G.mailbox, 0);
    if (last)
        assert_ok(kvh_fence_free(G.e, (kvh_fence){last}));
    print_message("disk %d: %" PRIu64 " hints (%" PRIu64 " taken), %" PRIu64 " prefetches (%" PRIu64 " taken), %" PRIu64
                  " sequences checked, %" PRIu64 " fences freed under a waiter\n",
                  with_disk, atomic_load(&G.hints), atomic_load(&G.hints_taken), atomic_load(&G.prefetches),
                  atomic_load(&G.prefetches_taken), atomic_load(&G.verifies), atomic_load(&G.fence_races));
    assert_true(atomic_load(&G.prefetches_taken) > 0 && atomic_load(&G.hints_taken) > 0);
    assert_true(atomic_load(&G.verifies) > 0);
    /* Nothing is left held or pinned, and the engine closes cleanly. */
    for (uint32_t t = 0; t < KVH_TIER_COUNT; t++)
        assert_int_equal(dt_tier(G.e, t).pinned_blocks, 0);
    assert_ok(dt_close(G.e));
}

static void test_hints_race_owners_memory(void **state) { run(state, 0); }
static void test_hints_race_owners_disk(void **state) { run(state, 1); }

static int teardown(void **state)
{
    dt_teardown(state);
    return tu_teardown(state);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_hints_race_owners_memory, teardown),
        cmocka_unit_test_teardown(test_hints_race_owners_disk, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
