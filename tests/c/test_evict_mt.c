/* Making room with one migration worker (core/evict.c, core/migrate.c),
 * white-box: a full disk tier whose blocks have moves queued up to memory
 * frees slots only when a worker runs those moves. When the lone worker
 * itself needs disk room (a persist, a move down to the disk), no other
 * worker is there to run them: it runs them itself, at once, and the work
 * that needed the room completes with the data intact (and durable, for
 * the persist). A pin taken while its block's eviction is in flight
 * waits for it and holds the block where it arrived; one taken while a
 * demotion to disk is in flight calls it back. test_evict.c covers a
 * caller that waits for the worker. */
#include <errno.h>
#include <stdatomic.h>

#include "disk_test_util.h"

#include "core/block.h"
#include "core/disk_io.h"
#include "core/engine.h"
#include "core/migrate.h"
#include "core/pool_batch.h"
#include "white_box_util.h"

static const dt_geo G = {2, 1, 32, 16, KVH_DTYPE_F16};

/* A full disk of four referenced partial blocks p (their slots are freed
 * when they leave) with moves of p[0] and p[1] up to the host tier queued,
 * queued by the test with the lock held so that the lone worker sees
 * them only behind work that needs disk room: a persist of w (pool work
 * runs before queued moves) or a move of w's block 0 down to the disk
 * (queued at a higher priority). No other worker is there to run the
 * moves up: the worker runs them itself, and the work that needs room
 * completes. */
enum lone_worker_work { LONE_PERSIST, LONE_DEMOTION };

static void lone_worker_case(enum lone_worker_work work)
{
    char dir[PATH_MAX];
    dt_scratch(work == LONE_PERSIST ? "lone-worker-persist" : "lone-worker-demotion", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 8, 8, 4, 1);
    kvh_engine *e = dt_open_a(&c);
    kvh_seq p[4], w;
    dt_content pc = dt_plain(60), wc = dt_plain(61);
    for (int i = 0; i < 4; i++) {
        dt_assert_ok(dt_build(e, G, pc, G.bt / 2, 0, &p[i]));
        dt_assert_ok(kvh_seq_migrate(e, p[i], 0, G.bt / 2, KVH_TIER_DISK, NULL));
    }
    assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, 4);
    dt_assert_ok(dt_build(e, G, wc, 2 * G.bt, 0, &w));
    uint32_t wb[2] = {wb_seq_block_index(e, w, 0), wb_seq_block_index(e, w, 1)};
    uint32_t pb[2] = {wb_seq_block_index(e, p[0], 0), wb_seq_block_index(e, p[1], 0)};
    kvh_fence f = {0};
    wb_lock(e);
    for (int i = 0; i < 2; i++)
        dt_assert_ok(kvhi_enqueue(e, pb[i], KVH_TIER_HOST, 0, KVHI_JOB_MOVE, KVHI_NO_BLOCK));
    if (work == LONE_PERSIST) {
        kvhi_pool_work *pw = kvhi_pool_work_new(e, KVHI_PW_PERSIST, 2, 1, &f);
        assert_non_null(pw);
        for (int i = 0; i < 2; i++) {
            pw->items[i].block = wb[i];
            kvhi_block_ref(e, wb[i]);
        }
        kvhi_pool_work_submit(e, pw);
    } else {
        uint32_t fi = 0;
        dt_assert_ok(kvhi_fence_new(e, &fi, &f));
        dt_assert_ok(kvhi_enqueue(e, wb[0], KVH_TIER_DISK, 1, KVHI_JOB_MOVE, fi));
    }
    wb_unlock(e);
    kvh_status st = kvh_fence_wait(e, f, UINT64_MAX);
    if (st != KVH_OK)
        fail_msg("%s by the lone worker with moves queued off the full disk: %s: %s",
                 work == LONE_PERSIST ? "persist" : "demotion", kvh_status_name(st), kvh_last_error());
    dt_assert_ok(kvh_fence_free(e, f));
    wb_lock(e);
    uint64_t run_here = e->queued_moves_run_here, waits = e->queued_move_waits;
    wb_unlock(e);
    assert_true(run_here >= 1);
    assert_int_equal(waits, 0); /* run at once, not waited for */
    assert_int_equal(dt_binfo(e, p[0], 0).tier, KVH_TIER_HOST);
    if (work == LONE_PERSIST) {
        assert_int_equal(dt_binfo(e, p[1], 0).tier, KVH_TIER_HOST);
        assert_int_equal(dt_binfo(e, w, 0).tier, KVH_TIER_DEVICE);
    } else {
        assert_int_equal(dt_binfo(e, w, 0).tier, KVH_TIER_DISK);
    }
    char msg[256] = "";
    for (int i = 0; i < 4; i++) {
        if (dt_verify(e, p[i], G, pc, 0, G.bt / 2, msg, sizeof(msg)) != KVH_OK)
            fail_msg("p[%d]: %s", i, msg);
        dt_assert_ok(kvh_seq_free(e, p[i]));
    }
    if (dt_verify(e, w, G, wc, 0, 2 * G.bt, msg, sizeof(msg)) != KVH_OK)
        fail_msg("w: %s", msg);
    dt_assert_ok(kvh_seq_free(e, w));
    dt_assert_ok(dt_close(e));
    if (work == LONE_PERSIST) { /* w is durable */
        e = dt_open_a(&c);
        size_t m = 0;
        kvh_seq t;
        dt_assert_ok(dt_match(e, wc, 2 * G.bt, &t, &m));
        assert_int_equal(m, 2 * G.bt);
        dt_assert_ok(kvh_seq_free(e, t));
        dt_assert_ok(dt_close(e));
    }
}

static void test_lone_worker_runs_queued_moves_out(void **state)
{
    (void)state;
    lone_worker_case(LONE_PERSIST);
    lone_worker_case(LONE_DEMOTION);
}

static double seconds_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* A caller reading a block up from a nearly full disk, while the lone
 * worker has a queued move of that same block: the worker waits for the
 * block, the caller's move waits for a queued move out of the disk. The
 * caller runs that move itself instead of waiting seconds for a worker
 * that is waiting for it (reads took 5-10 s each). Public API only. */
static void test_a_read_does_not_wait_for_a_worker_waiting_for_it(void **state)
{
    (void)state;
    const dt_geo g = {1, 1, 2, 4, KVH_DTYPE_F32};
    char dir[PATH_MAX];
    dt_scratch("read-vs-worker", dir, sizeof(dir));
    kvh_config c = dt_cfg(g, dir, 1, 2, 6, 1);
    kvh_engine *e = dt_open_a(&c);
    const uint32_t ntok = (1 + 2 + 6 - 1) * g.bt; /* one disk slot left free */
    int32_t tok[64];
    for (uint32_t i = 0; i < ntok; i++)
        tok[i] = (int32_t)i;
    float k[128], v[128];
    for (int i = 0; i < 128; i++)
        k[i] = (float)i, v[i] = (float)-i;
    kvh_seq s;
    dt_assert_ok(kvh_seq_create(e, 0, &s));
    dt_assert_ok(kvh_seq_append(e, s, tok, ntok));
    for (uint32_t t = 0; t < ntok; t += g.bt)
        dt_assert_ok(kvh_seq_write_kv(e, s, 0, t, g.bt, k + 2 * t, v + 2 * t));
    uint64_t r = 5;
    double worst = 0, end = seconds_now() + 2.0;
    int reads = 0;
    while (seconds_now() < end) {
        r = r * 6364136223846793005ull + 1;
        uint64_t first = (r >> 33) % (ntok / g.bt) * g.bt;
        kvh_fence f;
        kvh_status ms = kvh_seq_migrate(e, s, first, 2 * g.bt <= ntok - first ? 2 * g.bt : g.bt,
                                        (r >> 20) % 2 ? KVH_TIER_DEVICE : KVH_TIER_HOST, &f);
        uint64_t pos = (r >> 40) % ntok;
        float rk[2], rv[2];
        double t0 = seconds_now();
        dt_assert_ok(kvh_seq_read_kv(e, s, 0, pos, 1, rk, rv));
        double took = seconds_now() - t0;
        worst = took > worst ? took : worst;
        assert_true(rk[0] == k[2 * pos] && rv[1] == v[2 * pos + 1]);
        reads++;
        if (ms == KVH_OK) { /* a move may find no room: its status is not the point */
            (void)kvh_fence_wait(e, f, UINT64_MAX);
            dt_assert_ok(kvh_fence_free(e, f));
        }
    }
    print_message("%d reads, the slowest %.3f s\n", reads, worst);
    assert_true(reads > 100);
    assert_true(worst < 3.0); /* a wait for the worker lasted 5 s */
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
}

/* Disk writes stall in the fault hook while `stall` is set, saying so;
 * `writes` counts the data writes that reached the hook. */
static struct {
    atomic_int stall, writing, fail_next, writes;
} W;

static int stalling_hook(enum kvhi_disk_op op, void *user)
{
    (void)user;
    if (op == KVHI_OP_WRITE)
        atomic_fetch_add(&W.writes, 1);
    if (op == KVHI_OP_WRITE && atomic_load(&W.stall)) {
        atomic_store(&W.writing, 1);
        while (atomic_load(&W.stall))
            usleep(1000);
    }
    return 0;
}

/* The first disk write while `fail_next` is set stalls like one above,
 * then fails. */
static int failing_hook(enum kvhi_disk_op op, void *user)
{
    (void)user;
    if (op == KVHI_OP_WRITE && atomic_exchange(&W.fail_next, 0)) {
        atomic_store(&W.writing, 1);
        while (atomic_load(&W.stall))
            usleep(1000);
        return -EIO;
    }
    return 0;
}

static void wait_until_writing(void)
{
    for (int i = 0; i < 10000 && !atomic_load(&W.writing); i++)
        usleep(1000);
    assert_true(atomic_load(&W.writing));
}

typedef struct pin_call {
    kvh_engine *e;
    kvh_seq s;
    bool by_handle; /* kvh_block_pin on its first block, not kvh_seq_pin */
    kvh_status st;
    uint32_t tier_at_return;
    atomic_int done;
    atomic_int tid; /* the pinning thread, once it runs */
} pin_call;

static void *pin_thread(void *arg)
{
    pin_call *p = arg;
    atomic_store(&p->tid, wb_thread_id());
    kvh_block h = {0};
    p->st = p->by_handle ? kvh_seq_blocks(p->e, p->s, 0, 1, &h) : KVH_OK;
    if (p->st == KVH_OK)
        p->st = p->by_handle ? kvh_block_pin(p->e, h, 1) : kvh_seq_pin(p->e, p->s, 0, G.bt, 1);
    p->tier_at_return = dt_binfo(p->e, p->s, 0).tier;
    atomic_store(&p->done, 1);
    return NULL;
}

typedef struct build_call {
    kvh_engine *e;
    kvh_seq s;
    kvh_status st;
} build_call;

static void *build_thread(void *arg)
{
    build_call *b = arg;
    b->st = dt_build(b->e, G, dt_plain(72), G.bt, 0, &b->s);
    return NULL;
}

static void *migrate_thread(void *arg)
{
    pin_call *p = arg; /* reused: st is the migration's */
    p->st = kvh_seq_migrate(p->e, p->s, 0, G.bt, KVH_TIER_DISK, NULL);
    return NULL;
}

static void test_a_pin_holds_a_block_where_its_move_leaves_it(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("pin-in-flight", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 2, 2, 16, 0);
    kvh_engine *e = dt_open_a(&c);
    kvh_seq p, x, y;
    /* The host tier full of pinned blocks, the device tier of X and a
     * pinned Y: X is the only victim, and it goes straight to disk. */
    dt_assert_ok(dt_build(e, G, dt_plain(70), 2 * G.bt, 0, &p));
    dt_assert_ok(kvh_seq_migrate(e, p, 0, 2 * G.bt, KVH_TIER_HOST, NULL));
    dt_assert_ok(kvh_seq_pin(e, p, 0, 2 * G.bt, 1));
    dt_assert_ok(dt_build(e, G, dt_plain(71), G.bt, 0, &x));
    dt_assert_ok(dt_build(e, G, dt_plain(73), G.bt, 0, &y));
    dt_assert_ok(kvh_seq_pin(e, y, 0, G.bt, 1));
    kvhi_disk_set_fault_hook(stalling_hook, NULL);

    /* (a) An eviction in flight: the pin waits for it. */
    atomic_store(&W.stall, 1);
    atomic_store(&W.writing, 0);
    build_call z = {.e = e};
    pthread_t tz, tp;
    assert_int_equal(pthread_create(&tz, NULL, build_thread, &z), 0);
    wait_until_writing();
    pin_call pc = {.e = e, .s = x};
    assert_int_equal(pthread_create(&tp, NULL, pin_thread, &pc), 0);
    while (!atomic_load(&pc.tid))
        usleep(1000);
    wb_wait_blocked_on(atomic_load(&pc.tid), &e->changed, sizeof(e->changed));
    assert_false(atomic_load(&pc.done)); /* waiting for the eviction */
    atomic_store(&W.stall, 0);
    pthread_join(tz, NULL);
    pthread_join(tp, NULL);
    dt_assert_ok(z.st);
    dt_assert_ok(pc.st);
    assert_int_equal(pc.tier_at_return, KVH_TIER_DISK);
    kvh_block_info xi = dt_binfo(e, x, 0);
    assert_int_equal(xi.tier, KVH_TIER_DISK);
    assert_int_equal(xi.pins, 1);
    char msg[256] = "";
    if (dt_verify(e, x, G, dt_plain(71), 0, G.bt, msg, sizeof(msg)) != KVH_OK)
        fail_msg("X: %s", msg);
    dt_assert_ok(kvh_seq_pin(e, x, 0, G.bt, 0));
    dt_assert_ok(kvh_seq_free(e, z.s));

    /* (b) A demotion to disk in flight (of Y, which has no disk copy
     * yet): the pin, through a block handle, calls it back, and Y stays
     * in the device tier. */
    dt_assert_ok(kvh_seq_pin(e, y, 0, G.bt, 0));
    assert_int_equal(dt_binfo(e, y, 0).tier, KVH_TIER_DEVICE);
    atomic_store(&W.stall, 1);
    atomic_store(&W.writing, 0);
    pin_call mc = {.e = e, .s = y};
    pthread_t tm;
    assert_int_equal(pthread_create(&tm, NULL, migrate_thread, &mc), 0);
    wait_until_writing();
    pc = (pin_call){.e = e, .s = y, .by_handle = true};
    assert_int_equal(pthread_create(&tp, NULL, pin_thread, &pc), 0);
    for (int i = 0; i < 5000 && !atomic_load(&pc.done); i++)
        usleep(1000);
    assert_true(atomic_load(&pc.done)); /* no wait for the write */
    atomic_store(&W.stall, 0);
    pthread_join(tm, NULL);
    pthread_join(tp, NULL);
    dt_assert_ok(pc.st);
    assert_int_equal(pc.tier_at_return, KVH_TIER_DEVICE);
    assert_int_equal(dt_binfo(e, y, 0).tier, KVH_TIER_DEVICE);
    kvhi_disk_set_fault_hook(NULL, NULL);
    if (dt_verify(e, y, G, dt_plain(73), 0, G.bt, msg, sizeof(msg)) != KVH_OK)
        fail_msg("Y after the recall: %s", msg);
    kvh_block yb = {0};
    dt_assert_ok(kvh_seq_blocks(e, y, 0, 1, &yb));
    dt_assert_ok(kvh_block_pin(e, yb, 0));
    dt_assert_ok(kvh_seq_pin(e, p, 0, 2 * G.bt, 0));
    dt_assert_ok(kvh_seq_free(e, x));
    dt_assert_ok(kvh_seq_free(e, y));
    dt_assert_ok(kvh_seq_free(e, p));
}

/* A release that returned is room for a move the worker runs next, though
 * no call entered the engine in between: a host block's move down to a
 * full disk, queued behind one whose write stalls, finds the slot of a
 * disk block released meanwhile. */
static void test_a_release_is_room_for_the_next_queued_move(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("release-room", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 2, 2, 5, 1);
    kvh_engine *e = dt_open_a(&c);
    kvh_block h[8];
    int host[2], n_host = 0, on_disk = -1;
    for (int i = 0; i < 8; i++)
        dt_assert_ok(kvh_block_alloc(e, 0, &h[i]));
    for (int i = 0; i < 7; i++) { /* not the newest: its release takes the fast path */
        kvh_block_info bi = {.struct_size = sizeof(bi)};
        dt_assert_ok(kvh_block_info_get(e, h[i], &bi));
        if (bi.tier == KVH_TIER_HOST && n_host < 2)
            host[n_host++] = i;
        else if (bi.tier == KVH_TIER_DISK && on_disk < 0)
            on_disk = i;
    }
    assert_int_equal(n_host, 2);
    assert_true(on_disk >= 0);
    assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, 4);

    atomic_store(&W.writes, 0);
    kvhi_disk_set_fault_hook(stalling_hook, NULL);
    atomic_store(&W.stall, 1);
    atomic_store(&W.writing, 0);
    kvh_fence first = {0}, second = {0};
    dt_assert_ok(kvh_migrate(e, &h[host[0]], 1, KVH_TIER_DISK, &first)); /* the last free disk slot */
    wait_until_writing();
    dt_assert_ok(kvh_migrate(e, &h[host[1]], 1, KVH_TIER_DISK, &second));
    dt_assert_ok(kvh_block_release(e, h[on_disk]));
    atomic_store(&W.stall, 0);
    /* No call may enter until the worker has written the second block (one
     * write a move): an entering call would apply the release itself. */
    for (int i = 0; i < 10000 && atomic_load(&W.writes) < 2; i++)
        usleep(1000);
    if (atomic_load(&W.writes) < 2)
        fail_msg("the second move wrote nothing in 10 s: the worker did not see the release");
    dt_assert_ok(kvh_fence_wait(e, first, UINT64_MAX));
    dt_assert_ok(kvh_fence_wait(e, second, UINT64_MAX));
    kvhi_disk_set_fault_hook(NULL, NULL);
    dt_assert_ok(kvh_fence_free(e, first));
    dt_assert_ok(kvh_fence_free(e, second));
    assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, 5);
    for (int i = 0; i < 8; i++)
        if (i != on_disk)
            dt_assert_ok(kvh_block_release(e, h[i]));
    assert_int_equal(dt_tier(e, KVH_TIER_DISK).used_blocks, 0);
    dt_assert_ok(dt_close(e));
}

typedef struct range_call {
    kvh_engine *e;
    kvh_seq s;
    size_t n;
    kvh_status st;
    atomic_int tid; /* the calling thread, once it runs */
} range_call;

static void *prefetch_at_50(void *arg)
{
    range_call *r = arg;
    r->st = kvh_prefetch(r->e, r->s, 0, r->n, 50, NULL);
    return NULL;
}

static void *acquire_thread(void *arg)
{
    range_call *r = arg;
    atomic_store(&r->tid, wb_thread_id());
    r->st = kvh_seq_acquire(r->e, r->s, 0, r->n, NULL);
    return NULL;
}

/* kvh_prefetch moves a block up only into a free device slot or in place
 * of a block of a lower class. Device: V (unhinted) and H (hinted at
 * 100); host full of W and X; Z on disk; a prefetch of Z at 50 may take
 * only V. V's way down needs a host slot, so W or X is written to disk;
 * an acquire holds V while that write stalls, and the write fails. The
 * eviction looks for another victim, and it must not be H. */
static void test_a_prefetch_takes_no_victim_hinted_above_it(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("prefetch-ceiling", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 2, 2, 16, 0);
    c.eviction_policy = KVH_EVICT_LRU_K;
    kvh_engine *e = dt_open_a(&c);
    const size_t n = G.bt - 1; /* partial blocks: no clean disk copies */
    kvh_seq v, h, w, x, z;
    dt_assert_ok(dt_build(e, G, dt_plain(80), n, 0, &w));
    dt_assert_ok(dt_build(e, G, dt_plain(81), n, 0, &z));
    dt_assert_ok(kvh_seq_migrate(e, z, 0, n, KVH_TIER_DISK, NULL));
    dt_assert_ok(dt_build(e, G, dt_plain(84), n, 0, &x));
    dt_assert_ok(kvh_seq_migrate(e, w, 0, n, KVH_TIER_HOST, NULL));
    dt_assert_ok(kvh_seq_migrate(e, x, 0, n, KVH_TIER_HOST, NULL));
    dt_assert_ok(dt_build(e, G, dt_plain(82), n, 0, &v));
    dt_assert_ok(dt_build(e, G, dt_plain(83), n, 0, &h));
    dt_assert_ok(kvh_seq_hint(e, h, 0, n, 100));

    kvhi_disk_set_fault_hook(failing_hook, NULL);
    atomic_store(&W.stall, 1);
    atomic_store(&W.writing, 0);
    atomic_store(&W.fail_next, 1);
    range_call pf = {.e = e, .s = z, .n = n}, acq = {.e = e, .s = v, .n = n};
    pthread_t tp, ta;
    assert_int_equal(pthread_create(&tp, NULL, prefetch_at_50, &pf), 0);
    wait_until_writing();
    assert_int_equal(pthread_create(&ta, NULL, acquire_thread, &acq), 0);
    while (!atomic_load(&acq.tid))
        usleep(1000);
    /* The acquire waits on V's move (it holds V once the move ends). */
    wb_wait_blocked_on(atomic_load(&acq.tid), &e->changed, sizeof(e->changed));
    atomic_store(&W.stall, 0);
    pthread_join(tp, NULL);
    pthread_join(ta, NULL);
    kvhi_disk_set_fault_hook(NULL, NULL);
    dt_assert_ok(pf.st);
    dt_assert_ok(acq.st);
    assert_int_equal(dt_binfo(e, h, 0).tier, KVH_TIER_DEVICE);
    assert_int_equal(dt_binfo(e, v, 0).tier, KVH_TIER_DEVICE);
    assert_int_not_equal(dt_binfo(e, z, 0).tier, KVH_TIER_DEVICE);
    dt_assert_ok(kvh_seq_release(e, v, 0, n));
    const dt_content want[5] = {dt_plain(82), dt_plain(83), dt_plain(80), dt_plain(81), dt_plain(84)};
    const kvh_seq seqs[5] = {v, h, w, z, x};
    for (int i = 0; i < 5; i++) {
        char msg[256] = "";
        if (dt_verify(e, seqs[i], G, want[i], 0, n, msg, sizeof(msg)) != KVH_OK)
            fail_msg("sequence %d: %s", i, msg);
        dt_assert_ok(kvh_seq_free(e, seqs[i]));
    }
    dt_assert_ok(dt_close(e));
}

static int teardown(void **state)
{
    atomic_store(&W.stall, 0);
    atomic_store(&W.fail_next, 0);
    kvhi_disk_set_fault_hook(NULL, NULL);
    wb_release_held_lock();
    return dt_teardown(state);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_lone_worker_runs_queued_moves_out, teardown),
        cmocka_unit_test_teardown(test_a_read_does_not_wait_for_a_worker_waiting_for_it, teardown),
        cmocka_unit_test_teardown(test_a_pin_holds_a_block_where_its_move_leaves_it, teardown),
        cmocka_unit_test_teardown(test_a_release_is_room_for_the_next_queued_move, teardown),
        cmocka_unit_test_teardown(test_a_prefetch_takes_no_victim_hinted_above_it, teardown),
    };
    return cmocka_run_group_tests_name("evict_mt", tests, NULL, NULL);
}
