/* An acquire of blocks whose demotion to disk is still being written is
 * not held up by that write: the demotion is called off (the blocks stay
 * in the device tier, usable at once) and the finished write becomes a
 * clean disk copy, so nothing is read back and the next demotion costs no
 * write.
 *
 * The disk is made to hang (the fault hook blocks every write until the
 * test releases it), so an acquire that waited for the write would never
 * return; a watchdog releases the disk after WATCHDOG_S and the test then
 * fails. */
#include "disk_test_util.h"

#include <stdatomic.h>

#include "core/disk_io.h"

static const dt_geo G = {2, 1, 32, 16, KVH_DTYPE_F16}; /* block = 4096 bytes */
#define WATCHDOG_S 10.0

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stuck, by_watchdog;
    atomic_int writes_waiting;
} D = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static int stuck_writes(enum kvhi_disk_op op, void *user)
{
    (void)user;
    if (op != KVHI_OP_WRITE)
        return 0;
    pthread_mutex_lock(&D.mu);
    atomic_fetch_add(&D.writes_waiting, 1);
    while (D.stuck)
        pthread_cond_wait(&D.cv, &D.mu);
    atomic_fetch_sub(&D.writes_waiting, 1);
    pthread_mutex_unlock(&D.mu);
    return 0;
}

static void disk_hang(void)
{
    pthread_mutex_lock(&D.mu);
    D.stuck = true;
    pthread_mutex_unlock(&D.mu);
}

static void disk_release(bool watchdog)
{
    pthread_mutex_lock(&D.mu);
    if (D.stuck && watchdog)
        D.by_watchdog = true;
    D.stuck = false;
    pthread_cond_broadcast(&D.cv);
    pthread_mutex_unlock(&D.mu);
}

static void *watchdog_main(void *arg)
{
    (void)arg;
    double t0 = dt_now();
    while (dt_now() - t0 < WATCHDOG_S) {
        dt_sleep_ms(10);
        pthread_mutex_lock(&D.mu);
        bool stuck = D.stuck;
        pthread_mutex_unlock(&D.mu);
        if (!stuck)
            return NULL;
    }
    disk_release(true);
    return NULL;
}

/* Runs fn while the disk hangs; fails the test if fn only returned
 * because the watchdog let the disk go. */
static void while_disk_hangs(void (*fn)(void *), void *arg, const char *what)
{
    pthread_t wd;
    disk_hang();
    assert_int_equal(pthread_create(&wd, NULL, watchdog_main, NULL), 0);
    fn(arg);
    pthread_mutex_lock(&D.mu);
    bool late = D.by_watchdog;
    pthread_mutex_unlock(&D.mu);
    disk_release(false);
    pthread_join(wd, NULL);
    if (late)
        fail_msg("%s waited for a disk write that could not finish", what);
}

typedef struct ctx {
    kvh_engine *e;
    kvh_seq s;
    size_t n;
    kvh_fence spill;
} ctx;

static void spill_then_acquire(void *p)
{
    ctx *c = p;
    dt_assert_ok(kvh_seq_migrate(c->e, c->s, 0, c->n, KVH_TIER_DISK, &c->spill));
    /* wait until the worker is inside the write of the spill */
    while (atomic_load(&D.writes_waiting) == 0)
        dt_sleep_ms(1);
    dt_assert_ok(kvh_seq_acquire(c->e, c->s, 0, c->n, NULL));
    /* the blocks are usable in the device tier right away */
    int32_t indptr[2], indices[8], last[1];
    dt_assert_ok(kvh_block_table(c->e, &c->s, 1, indptr, indices, 8, last));
    assert_int_equal(indptr[1] - indptr[0], c->n / G.bt);
}

static void spill_again(void *p)
{
    ctx *c = p;
    /* clean copies exist: demoting again writes nothing */
    dt_assert_ok(kvh_seq_migrate(c->e, c->s, 0, c->n, KVH_TIER_DISK, NULL));
}

static void test_acquire_recalls_a_spill_in_flight(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("recall", dir, sizeof(dir));
    kvh_config cfg = dt_cfg(G, dir, 8, 8, 64, 1);
    kvhi_disk_set_fault_hook(stuck_writes, NULL);
    ctx c = {.e = dt_open_a(&cfg), .n = 4 * G.bt};
    dt_content ct = dt_plain(77);
    dt_assert_ok(dt_build(c.e, G, ct, c.n, 0, &c.s));
    kvh_stats before = dt_stats(c.e);

    while_disk_hangs(spill_then_acquire, &c, "kvh_seq_acquire during a spill");
    dt_assert_ok(kvh_fence_wait(c.e, c.spill, UINT64_MAX));
    dt_assert_ok(kvh_fence_free(c.e, c.spill));
    for (uint64_t i = 0; i < c.n / G.bt; i++) {
        kvh_block b;
        kvh_block_info bi = {.struct_size = sizeof(bi)};
        dt_assert_ok(kvh_seq_blocks(c.e, c.s, i, 1, &b));
        dt_assert_ok(kvh_block_info_get(c.e, b, &bi));
        assert_int_equal(bi.tier, KVH_TIER_DEVICE);
    }
    char msg[256] = "";
    if (dt_verify(c.e, c.s, G, ct, 0, c.n, msg, sizeof(msg)) != KVH_OK)
        fail_msg("after the recall: %s", msg);
    dt_assert_ok(kvh_seq_release(c.e, c.s, 0, c.n));
    kvh_stats after = dt_stats(c.e);
    assert_int_equal(after.bytes_disk_to_host, before.bytes_disk_to_host); /* nothing read back */

    while_disk_hangs(spill_again, &c, "a second spill of recalled blocks");
    if (dt_verify(c.e, c.s, G, ct, 0, c.n, msg, sizeof(msg)) != KVH_OK)
        fail_msg("read from the clean copies: %s", msg);
    assert_int_equal(dt_stats(c.e).corrupt_blocks, 0);
    dt_assert_ok(kvh_seq_free(c.e, c.s));
    dt_assert_ok(dt_close(c.e));
    kvhi_disk_set_fault_hook(NULL, NULL);
    dt_rmrf(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_acquire_recalls_a_spill_in_flight, dt_teardown),
    };
    return cmocka_run_group_tests_name("disk_recall", tests, NULL, NULL);
}
