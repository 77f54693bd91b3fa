/* Calls on one sequence from two threads while the first is stalled with
 * the engine lock dropped (a disk read held by the fault hook):
 *   - a second @threads-handle call, kvh_seq_free included, is refused
 *     with KVH_ERR_BUSY and changes nothing;
 *   - @threads-any calls (kvh_prefetch, kvh_seq_migrate) stalled half way
 *     survive the owner growing or freeing the sequence meanwhile (no use
 *     of its freed block table; ASan checks this in build-asan/).
 * migration_threads = 0 makes the stalled read run in the calling thread. */
#include <stdatomic.h>

#include "disk_test_util.h"

#include "core/disk_io.h"

static const dt_geo G = {2, 2, 8, 4, KVH_DTYPE_F16};

static struct {
    atomic_int armed;
    atomic_int stalled, released;
} F;

static int stall_reads(enum kvhi_disk_op op, void *user)
{
    (void)user;
    if (op != KVHI_OP_READ || !atomic_load(&F.armed))
        return 0;
    atomic_store(&F.armed, 0); /* one read only */
    atomic_store(&F.stalled, 1);
    while (!atomic_load(&F.released))
        dt_sleep_ms(1);
    return 0;
}

static void arm(void)
{
    atomic_store(&F.stalled, 0);
    atomic_store(&F.released, 0);
    atomic_store(&F.armed, 1);
}

static void wait_stalled(void)
{
    for (int i = 0; i < 20000 && !atomic_load(&F.stalled); i++)
        dt_sleep_ms(1);
    assert_true(atomic_load(&F.stalled));
}

static void release(void) { atomic_store(&F.released, 1); }

static int setup(void **state)
{
    (void)state;
    kvhi_disk_set_fault_hook(stall_reads, NULL);
    return 0;
}

static int teardown(void **state)
{
    release();
    atomic_store(&F.armed, 0);
    return dt_teardown(state);
}

static kvh_engine *open_engine(const char *name)
{
    char dir[PATH_MAX];
    dt_scratch(name, dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 16, 16, 64, 0);
    return dt_open_a(&c);
}

/* A sequence of n tokens of stream, every block moved to disk. */
static kvh_seq on_disk(kvh_engine *e, uint64_t stream, size_t n)
{
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, dt_plain(stream), n, 0, &s));
    dt_assert_ok(kvh_seq_migrate(e, s, 0, n, KVH_TIER_DISK, NULL));
    for (uint64_t i = 0; i < (n + G.bt - 1) / G.bt; i++)
        assert_int_equal(dt_binfo(e, s, i).tier, KVH_TIER_DISK);
    return s;
}

typedef struct call {
    kvh_engine *e;
    kvh_seq s;
    size_t n;
    kvh_status st;
    char msg[256];
} call;

static void *read_all(void *arg)
{
    call *c = arg;
    c->st = dt_verify(c->e, c->s, G, dt_plain(1), 0, c->n, c->msg, sizeof(c->msg));
    return NULL;
}

static void test_second_owner_call_is_busy(void **state)
{
    (void)state;
    kvh_engine *e = open_engine("owner");
    call c = {.e = e, .n = 2 * G.bt};
    c.s = on_disk(e, 1, c.n);
    arm();
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, read_all, &c), 0);
    wait_stalled();
    int32_t tok = 5;
    dt_assert_kvh(KVH_ERR_BUSY, kvh_seq_append(e, c.s, &tok, 1));
    dt_assert_kvh(KVH_ERR_BUSY, kvh_seq_truncate(e, c.s, 0));
    dt_assert_kvh(KVH_ERR_BUSY, kvh_seq_free(e, c.s));
    uint64_t len = 0;
    dt_assert_ok(kvh_seq_length(e, c.s, &len)); /* @threads any */
    assert_int_equal(len, c.n);
    release();
    assert_int_equal(pthread_join(t, NULL), 0);
    if (c.st != KVH_OK)
        fail_msg("the stalled read: %s (%s)", kvh_status_name(c.st), c.msg);
    /* Nothing the refused calls asked for happened; the owner goes on. */
    dt_assert_ok(kvh_seq_length(e, c.s, &len));
    assert_int_equal(len, c.n);
    dt_assert_ok(dt_extend(e, c.s, G, dt_plain(1), c.n, 1));
    char msg[256] = "";
    if (dt_verify(e, c.s, G, dt_plain(1), 0, c.n + 1, msg, sizeof(msg)) != KVH_OK)
        fail_msg("%s", msg);
    dt_assert_ok(kvh_seq_free(e, c.s));
    dt_assert_ok(dt_close(e));
}

static void *prefetch_all(void *arg)
{
    call *c = arg;
    kvh_fence f = {0};
    c->st = kvh_prefetch(c->e, c->s, 0, c->n, 1, &f);
    if (c->st == KVH_OK) {
        c->st = kvh_fence_wait(c->e, f, UINT64_MAX);
        kvh_fence_free(c->e, f);
    }
    return NULL;
}

static void *migrate_all(void *arg)
{
    call *c = arg;
    c->st = kvh_seq_migrate(c->e, c->s, 0, c->n, KVH_TIER_HOST, NULL);
    return NULL;
}

/* The owner frees (or grows) the sequence while another thread's prefetch
 * or migrate of it is stalled half way through its blocks. */
static void any_call_survives(void *(*fn)(void *), bool free_it)
{
    kvh_engine *e = open_engine(free_it ? "any_free" : "any_grow");
    call c = {.e = e, .n = 6 * G.bt};
    c.s = on_disk(e, 1, c.n);
    arm();
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, fn, &c), 0);
    wait_stalled();
    if (free_it) {
        dt_assert_ok(kvh_seq_free(e, c.s));
    } else {
        /* Past the table's capacity of 8 blocks: it is reallocated. */
        dt_assert_ok(dt_extend(e, c.s, G, dt_plain(1), c.n, 20 * G.bt));
    }
    release();
    assert_int_equal(pthread_join(t, NULL), 0);
    dt_assert_ok(c.st);
    if (!free_it) {
        char msg[256] = "";
        if (dt_verify(e, c.s, G, dt_plain(1), 0, c.n + 20 * G.bt, msg, sizeof(msg)) != KVH_OK)
            fail_msg("%s", msg);
        dt_assert_ok(kvh_seq_free(e, c.s));
    }
    dt_assert_ok(dt_close(e));
}

static void test_prefetch_while_freed(void **state)
{
    (void)state;
    any_call_survives(prefetch_all, true);
}

static void test_prefetch_while_grown(void **state)
{
    (void)state;
    any_call_survives(prefetch_all, false);
}

static void test_migrate_while_freed(void **state)
{
    (void)state;
    any_call_survives(migrate_all, true);
}

static void test_migrate_while_grown(void **state)
{
    (void)state;
    any_call_survives(migrate_all, false);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_second_owner_call_is_busy, teardown),
        cmocka_unit_test_teardown(test_prefetch_while_freed, teardown),
        cmocka_unit_test_teardown(test_prefetch_while_grown, teardown),
        cmocka_unit_test_teardown(test_migrate_while_freed, teardown),
        cmocka_unit_test_teardown(test_migrate_while_grown, teardown),
    };
    return cmocka_run_group_tests_name("seq_overlap", tests, setup, NULL);
}
