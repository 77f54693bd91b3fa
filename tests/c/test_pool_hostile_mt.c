/* External pools unregistered while other threads use them (kvh.h:
 * "Unregisters (waits for copies touching it)"; "kvh_pool_unregister waits
 * for the batches running on the pool"). Once unregister returns the
 * caller may unmap the pool's memory: these tests do exactly that, so a
 * copy that still touches it afterwards is a crash. Each race runs in a
 * child process, so that such a crash (or a sanitizer report) fails the
 * test instead of ending the run. Blocks are large (4 MiB) so that a disk
 * read or write holds a copy open long enough for the other thread. */
#include <stdatomic.h>
#include <sys/mman.h>

#include "test_util.h"
#include "disk_test_util.h"

enum { L = 2, H = 8, D = 128, BT = 256, SLOTS = 2, ITERS = 24 };
static const dt_geo G = {L, H, D, BT, KVH_DTYPE_F32};
enum { ROW = D * 4, TOKB = H * ROW, SLOTB = BT * TOKB };

/* Child exit codes. */
enum { RACE_OK = 0, RACE_SETUP = 2, RACE_BAD_STATUS = 3, RACE_NEVER_RACED = 4 };

typedef struct race_pool {
    uint8_t *mem; /* one mapping: [layer][K,V][slot] */
    size_t bytes;
    void *kp[L], *vp[L];
    kvh_pool_layout layout;
} race_pool;

static int race_pool_map(race_pool *p, uint8_t fill)
{
    p->bytes = (size_t)L * 2 * SLOTS * SLOTB;
    p->mem = mmap(NULL, p->bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p->mem == MAP_FAILED)
        return -1;
    for (size_t i = 0; i < p->bytes; i += 4096)
        memset(p->mem + i, (uint8_t)(fill + i / 4096), 4096);
    for (uint32_t l = 0; l < L; l++) {
        p->kp[l] = p->mem + (size_t)(l * 2 + 0) * SLOTS * SLOTB;
        p->vp[l] = p->mem + (size_t)(l * 2 + 1) * SLOTS * SLOTB;
    }
    memset(&p->layout, 0, sizeof(p->layout));
    p->layout.struct_size = sizeof(kvh_pool_layout);
    p->layout.memory = KVH_MEMORY_HOST;
    p->layout.num_slots = SLOTS;
    p->layout.k_base = p->kp;
    p->layout.v_base = p->vp;
    p->layout.slot_stride = SLOTB;
    p->layout.token_stride = TOKB;
    p->layout.head_stride = ROW;
    return 0;
}

/* What the caller may do once unregister has returned. */
static void race_pool_unmap(race_pool *p) { munmap(p->mem, p->bytes); }

static void spin_us(double us)
{
    double end = dt_now() + us / 1e6;
    while (dt_now() < end)
        ;
}

static void race_tokens(int32_t *t, uint32_t tag)
{
    for (uint32_t i = 0; i < BT; i++)
        t[i] = (int32_t)(tag * 1000 + i);
}

static int child_fail(int code, const char *what, kvh_status st)
{
    fprintf(stderr, "%s: %s (%s)\n", what, kvh_status_name(st), kvh_last_error());
    return code;
}

/* ---- a synchronous call racing with unregister ---- */

typedef struct sync_race {
    kvh_engine *e;
    kvh_pool pool;
    kvh_block block;
    uint32_t tag;
    int offload; /* 1: kvh_pool_offload of new tokens; 0: kvh_pool_restore */
    atomic_int started;
    kvh_status st;
    kvh_block out;
} sync_race;

static void *sync_call(void *arg)
{
    sync_race *r = arg;
    int32_t tk[BT];
    race_tokens(tk, r->tag);
    atomic_store(&r->started, 1);
    if (r->offload)
        r->st = kvh_pool_offload(r->e, r->pool, 0, 0, tk, BT, 0, &r->out);
    else
        r->st = kvh_pool_restore(r->e, r->pool, r->block, 1);
    return NULL;
}

static int sync_race_child(void *arg)
{
    int offload = (int)(uintptr_t)arg;
    char dir[PATH_MAX];
    dt_scratch(offload ? "pool_race_offload" : "pool_race_restore", dir, sizeof(dir));
    /* One block of memory in each tier: every offload makes room by
     * writing a block to disk, every restore reads one from it. */
    kvh_config c = dt_cfg(G, dir, 1, 1, 6, 0);
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&c, &e);
    if (st != KVH_OK)
        return child_fail(RACE_SETUP, "open", st);
    race_pool p;
    if (race_pool_map(&p, 1) != 0)
        return RACE_SETUP;
    kvh_pool pool;
    kvh_block b = {0};
    int32_t tk[BT];
    race_tokens(tk, 1);
    if ((st = kvh_pool_register(e, &p.layout, &pool)) != KVH_OK ||
        (st = kvh_pool_offload(e, pool, 0, 0, tk, BT, 0, &b)) != KVH_OK)
        return child_fail(RACE_SETUP, "first offload", st);
    int raced = 0;
    for (uint32_t it = 0; it < ITERS; it++) {
        if (it > 0) {
            if (race_pool_map(&p, (uint8_t)it) != 0)
                return RACE_SETUP;
            if ((st = kvh_pool_register(e, &p.layout, &pool)) != KVH_OK)
                return child_fail(RACE_SETUP, "register", st);
        }
        if (!offload && (st = kvh_migrate(e, &b, 1, KVH_TIER_DISK, NULL)) != KVH_OK)
            return child_fail(RACE_SETUP, "migrate", st);
        sync_race r = {.e = e, .pool = pool, .block = b, .tag = 100 + it, .offload = offload};
        pthread_t th;
        if (pthread_create(&th, NULL, sync_call, &r) != 0)
            return RACE_SETUP;
        while (!atomic_load(&r.started))
            ;
        spin_us(50.0 * (it % 12));
        st = kvh_pool_unregister(e, pool);
        race_pool_unmap(&p); /* the caller's right once unregister returned */
        pthread_join(th, NULL);
        if (st != KVH_OK)
            return child_fail(RACE_BAD_STATUS, "unregister", st);
        if (r.st != KVH_OK && r.st != KVH_ERR_BAD_HANDLE)
            return child_fail(RACE_BAD_STATUS, offload ? "offload" : "restore", r.st);
        raced += r.st == KVH_OK;
        if (offload && r.st == KVH_OK)
            kvh_block_release(e, r.out);
    }
    kvh_block_release(e, b);
    st = kvh_engine_close(e);
    if (st != KVH_OK)
        return child_fail(RACE_BAD_STATUS, "close", st);
    if (!raced) {
        fprintf(stderr, "the call never got the pool before unregister\n");
        return RACE_NEVER_RACED;
    }
    return RACE_OK;
}

static void expect_child_ok(int (*fn)(void *), void *arg)
{
    int rc = dt_in_child(fn, arg);
    if (rc != RACE_OK)
        fail_msg("child ended with %d (%s)", rc,
                 rc >= 128                ? "killed by a signal: pool memory touched after unregister returned"
                 : rc == RACE_BAD_STATUS  ? "a status outside the header's list"
                 : rc == RACE_NEVER_RACED ? "the race was never run"
                                          : "setup failed, or a sanitizer report");
}

static void test_unregister_waits_for_a_restore_reading_disk(void **state)
{
    (void)state;
    expect_child_ok(sync_race_child, (void *)(uintptr_t)0);
}

static void test_unregister_waits_for_an_offload_making_room(void **state)
{
    (void)state;
    expect_child_ok(sync_race_child, (void *)(uintptr_t)1);
}

/* ---- batches on other threads racing with unregister ---- */

typedef struct batch_race {
    kvh_engine *e;
    kvh_pool pool;
    uint32_t t;
    int errors;
    char msg[200];
} batch_race;

static void batch_report(batch_race *r, const char *what, kvh_status st)
{
    if (r->errors++ == 0)
        snprintf(r->msg, sizeof(r->msg), "thread %u: %s: %s", r->t, what, kvh_status_name(st));
}

/* Offloads slot t, restores the block into it again, until the pool is
 * gone; every status must be one the header lists. */
static void *batch_loop(void *arg)
{
    batch_race *r = arg;
    kvh_engine *e = r->e;
    int32_t tk[BT];
    for (uint32_t round = 0;; round++) {
        race_tokens(tk, 1000 * (r->t + 1) + round);
        kvh_pool_xfer x;
        memset(&x, 0, sizeof(x));
        x.struct_size = sizeof(x);
        x.slot = r->t;
        x.tokens = tk;
        kvh_fence f;
        kvh_status st = kvh_pool_offload_batch(e, r->pool, &x, 1, 0, &f);
        if (st == KVH_ERR_BAD_HANDLE)
            return NULL;
        if (st != KVH_OK) {
            batch_report(r, "offload_batch", st);
            return NULL;
        }
        st = kvh_fence_wait(e, f, UINT64_MAX);
        kvh_fence_free(e, f);
        if ((st != KVH_OK && st != KVH_ERR_BAD_HANDLE) || st != x.status)
            batch_report(r, "offload fence / item", st != KVH_OK ? st : x.status);
        kvh_block b = x.block;
        if (x.status == KVH_OK) {
            x.status = 1;
            kvh_fence lf[L];
            st = kvh_pool_restore_batch(e, r->pool, &x, 1, 0, L, lf);
            if (st == KVH_OK) {
                for (uint32_t l = 0; l < L; l++) {
                    kvh_status fs = kvh_fence_wait(e, lf[l], UINT64_MAX);
                    if (fs != KVH_OK && fs != KVH_ERR_BAD_HANDLE)
                        batch_report(r, "restore fence", fs);
                    kvh_fence_free(e, lf[l]);
                }
                if (x.status != KVH_OK && x.status != KVH_ERR_BAD_HANDLE)
                    batch_report(r, "restore item", x.status);
            } else if (st != KVH_ERR_BAD_HANDLE)
                batch_report(r, "restore_batch", st);
        }
        kvh_block_release(e, b);
        if (st == KVH_ERR_BAD_HANDLE)
            return NULL;
    }
}

static int batch_race_child(void *arg)
{
    (void)arg;
    char dir[PATH_MAX];
    dt_scratch("pool_race_batches", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 1, 2, 8, 2);
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&c, &e);
    if (st != KVH_OK)
        return child_fail(RACE_SETUP, "open", st);
    for (uint32_t it = 0; it < 6; it++) {
        race_pool p;
        if (race_pool_map(&p, (uint8_t)it) != 0)
            return RACE_SETUP;
        kvh_pool pool;
        if ((st = kvh_pool_register(e, &p.layout, &pool)) != KVH_OK)
            return child_fail(RACE_SETUP, "register", st);
        batch_race r[SLOTS];
        pthread_t th[SLOTS];
        for (uint32_t t = 0; t < SLOTS; t++) {
            r[t] = (batch_race){.e = e, .pool = pool, .t = t};
            if (pthread_create(&th[t], NULL, batch_loop, &r[t]) != 0)
                return RACE_SETUP;
        }
        dt_sleep_ms(5.0 + 7.0 * it);
        st = kvh_pool_unregister(e, pool);
        race_pool_unmap(&p);
        for (uint32_t t = 0; t < SLOTS; t++)
            pthread_join(th[t], NULL);
        if (st != KVH_OK)
            return child_fail(RACE_BAD_STATUS, "unregister", st);
        for (uint32_t t = 0; t < SLOTS; t++)
            if (r[t].errors) {
                fprintf(stderr, "%s\n", r[t].msg);
                return RACE_BAD_STATUS;
            }
    }
    st = kvh_engine_close(e);
    return st == KVH_OK ? RACE_OK : child_fail(RACE_BAD_STATUS, "close", st);
}

static void test_unregister_while_batches_run_on_other_threads(void **state)
{
    (void)state;
    expect_child_ok(batch_race_child, NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_unregister_waits_for_a_restore_reading_disk),
        cmocka_unit_test(test_unregister_waits_for_an_offload_making_room),
        cmocka_unit_test(test_unregister_while_batches_run_on_other_threads),
    };
    return cmocka_run_group_tests_name("pool_hostile_mt", tests, NULL, NULL);
}
