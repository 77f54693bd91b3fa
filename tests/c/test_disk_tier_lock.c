/* Disk store: one engine at a time, as kvh.h promises ("KVH_ERR_BUSY
 * (another engine has the store open)"), under hostile timing.
 *
 * test_disk_roundtrip.c (test_second_engine_busy) checks one second open,
 * in the same process and in another. Here:
 *
 *   - racing opens: several processes released at the same instant open
 *     the same store, round after round; each engine that opens records
 *     when it held the store, persists a chain and closes. No two holding
 *     intervals may overlap, every other open returns exactly
 *     KVH_ERR_BUSY, and every chain persisted is found afterwards;
 *   - other spellings of the path (trailing slash, "/./", "sub/.."): the
 *     same store, so KVH_ERR_BUSY while it is open;
 *   - a process forked while an engine is open (a worker pool, say) that
 *     never touches the engine: once the engine is closed, no engine has
 *     the store open, so a new open must succeed; also once the process
 *     that opened it was killed, the worker still running; and no child
 *     forked while other threads open and close engines gets a store's
 *     descriptor.
 */
#include <stdatomic.h>
#include <sys/file.h>
#include <sys/mman.h>

#include "disk_test_util.h"

static const dt_geo G = {1, 1, 64, 16, KVH_DTYPE_F16};

static kvh_config lock_cfg(const char *dir) { return dt_cfg(G, dir, 4, 4, 64, 0); }

/* ---- racing opens ---- */

#define RACERS 5
#define RACE_ROUNDS 12

typedef struct race_slot {
    int status;        /* kvh_status of the open */
    double held_from;  /* CLOCK_MONOTONIC seconds, when open returned KVH_OK */
    double held_until; /* ... just before close was called */
    int persisted;     /* 1: its chain was acknowledged durable */
} race_slot;

typedef struct race_arg {
    const char *dir;
    int go_fd; /* read end: one byte releases every racer */
    race_slot *slot;
    uint64_t stream;
} race_arg;

static int racer(void *p)
{
    race_arg *a = p;
    char ch;
    if (read(a->go_fd, &ch, 1) != 1)
        return 2;
    kvh_config c = lock_cfg(a->dir);
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&c, &e);
    a->slot->status = st;
    if (st != KVH_OK)
        return 0;
    a->slot->held_from = dt_now();
    kvh_seq s;
    if (dt_build(e, G, dt_plain(a->stream), 2 * G.bt, 0, &s) == KVH_OK && kvh_seq_persist(e, s) == KVH_OK)
        a->slot->persisted = 1;
    dt_sleep_ms(5); /* hold it a little while the others try */
    a->slot->held_until = dt_now();
    return kvh_engine_close(e) == KVH_OK ? 0 : 3;
}

static void test_racing_opens_one_engine_at_a_time(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("lock-race", dir, sizeof(dir));
    race_slot *slots =
        mmap(NULL, sizeof(race_slot) * RACERS * RACE_ROUNDS, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    assert_true(slots != MAP_FAILED);
    int opened = 0, busy = 0;
    for (int round = 0; round < RACE_ROUNDS; round++) {
        int go[2];
        assert_int_equal(pipe(go), 0);
        pid_t pids[RACERS];
        for (int i = 0; i < RACERS; i++) {
            race_slot *sl = &slots[round * RACERS + i];
            sl->status = 1; /* not yet */
            race_arg a = {dir, go[0], sl, 0x7ace00 + (uint64_t)(round * RACERS + i)};
            pids[i] = dt_fork_child();
            assert_true(pids[i] >= 0);
            if (pids[i] == 0) {
                close(go[1]);
                _exit(racer(&a));
            }
        }
        close(go[0]);
        char bytes[RACERS] = {0};
        assert_int_equal(write(go[1], bytes, RACERS), RACERS);
        close(go[1]);
        for (int i = 0; i < RACERS; i++) {
            int ws = dt_reap(pids[i]);
            if (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0)
                fail_msg("round %d: racer %d ended with status 0x%x", round, i, ws);
        }
        for (int i = 0; i < RACERS; i++) {
            race_slot *a = &slots[round * RACERS + i];
            if (a->status == KVH_OK)
                opened++;
            else if (a->status == KVH_ERR_BUSY)
                busy++;
            else
                fail_msg("round %d: racer %d: open returned %s, expected KVH_OK or KVH_ERR_BUSY", round, i,
                         kvh_status_name((kvh_status)a->status));
            for (int j = 0; a->status == KVH_OK && j < i; j++) {
                race_slot *b = &slots[round * RACERS + j];
                if (b->status == KVH_OK && a->held_from < b->held_until && b->held_from < a->held_until)
                    fail_msg("round %d: racers %d and %d held the store at the same time ([%.6f, %.6f] and "
                             "[%.6f, %.6f])",
                             round, j, i, b->held_from, b->held_until, a->held_from, a->held_until);
            }
        }
    }
    assert_true(opened >= RACE_ROUNDS); /* someone wins every round */
    /* every acknowledged chain is there */
    kvh_config c = lock_cfg(dir);
    kvh_engine *e = dt_open_a(&c);
    int found = 0;
    for (int k = 0; k < RACERS * RACE_ROUNDS; k++) {
        if (!slots[k].persisted)
            continue;
        size_t m = 0;
        char msg[256] = "";
        if (dt_match_verify(e, G, dt_plain(0x7ace00 + (uint64_t)k), 2 * G.bt, &m, msg, sizeof(msg)) != KVH_OK)
            fail_msg("racer %d: %s", k, msg);
        if (m != 2 * G.bt)
            fail_msg("racer %d persisted its chain; %zu of %u tokens found", k, m, 2 * G.bt);
        found++;
    }
    dt_assert_ok(dt_close(dt_untrack(e)));
    printf("racing opens: %d rounds x %d processes: %d opens, %d KVH_ERR_BUSY, %d chains found again\n", RACE_ROUNDS,
           RACERS, opened, busy, found);
    munmap(slots, sizeof(race_slot) * RACERS * RACE_ROUNDS);
    dt_rmrf(dir);
}

/* ---- the same store under another name ---- */

static void test_other_spellings_are_the_same_store(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("lock-names", dir, sizeof(dir));
    kvh_config c = lock_cfg(dir);
    kvh_engine *e = dt_open_a(&c);
    char sub[600];
    snprintf(sub, sizeof(sub), "%s/sub", dir);
    /* a directory inside the store is not what a store looks like, but it
     * makes "dir/sub/.." a spelling of the same directory */
    assert_int_equal(mkdir(sub, 0700), 0);
    char names[3][700];
    snprintf(names[0], sizeof(names[0]), "%s/", dir);
    snprintf(names[1], sizeof(names[1]), "%s/.", dir);
    snprintf(names[2], sizeof(names[2]), "%s/sub/..", dir);
    for (int i = 0; i < 3; i++) {
        kvh_config o = lock_cfg(names[i]);
        kvh_engine *x = NULL;
        kvh_status st = kvh_engine_open(&o, &x);
        if (st != KVH_ERR_BUSY) {
            kvh_engine_close(x);
            fail_msg("\"%s\" while \"%s\" is open: %s (%s), expected KVH_ERR_BUSY", names[i], dir, kvh_status_name(st),
                     kvh_last_error());
        }
    }
    dt_assert_ok(dt_close(dt_untrack(e)));
    rmdir(sub);
    dt_rmrf(dir);
}

/* LOCK deleted under an open engine (a cleaner of old files): the
 * directory's own lock still keeps a second engine out, which was told
 * the store was open in another process, a reader such as kvh-store,
 * while the holder was an engine in this one. */
static void test_a_replaced_lock_file_is_named_as_such(void **state)
{
    (void)state;
    char dir[512], lock[600];
    dt_scratch("lock-deleted", dir, sizeof(dir));
    kvh_config c = lock_cfg(dir);
    kvh_engine *e = dt_open_a(&c);
    snprintf(lock, sizeof(lock), "%s/LOCK", dir);
    assert_int_equal(unlink(lock), 0);
    kvh_engine *x = NULL;
    kvh_status st = kvh_engine_open(&c, &x);
    if (st != KVH_ERR_BUSY) {
        kvh_engine_close(x);
        fail_msg("%s (%s), expected KVH_ERR_BUSY", kvh_status_name(st), kvh_last_error());
    }
    if (!strstr(kvh_last_error(), "LOCK file was replaced") || !strstr(kvh_last_error(), "this process"))
        fail_msg("%s", kvh_last_error());
    dt_assert_ok(dt_close(dt_untrack(e)));
    dt_rmrf(dir);
}

/* An engine closed cleanly leaves no pid in LOCK: while a reader (kvh-store)
 * holds the store later, a refused open named the process that had closed
 * its engine, still running, as the store's holder. */
static void test_a_closed_engine_is_not_named_as_the_holder(void **state)
{
    (void)state;
    char dir[512], lock[600];
    dt_scratch("lock-closed", dir, sizeof(dir));
    kvh_config c = lock_cfg(dir);
    dt_assert_ok(dt_close(dt_open_a(&c)));
    /* A reader's hold: shared, on the directory and LOCK, no pid written. */
    snprintf(lock, sizeof(lock), "%s/LOCK", dir);
    int dir_fd = open(dir, O_RDONLY | O_DIRECTORY), lock_fd = open(lock, O_RDONLY);
    assert_true(dir_fd >= 0 && lock_fd >= 0);
    assert_int_equal(flock(dir_fd, LOCK_SH | LOCK_NB), 0);
    assert_int_equal(flock(lock_fd, LOCK_SH | LOCK_NB), 0);
    kvh_engine *x = NULL;
    kvh_status st = kvh_engine_open(&c, &x);
    if (st != KVH_ERR_BUSY) {
        kvh_engine_close(x);
        fail_msg("%s (%s), expected KVH_ERR_BUSY", kvh_status_name(st), kvh_last_error());
    }
    if (strstr(kvh_last_error(), "open in process") || !strstr(kvh_last_error(), "a reader such as kvh-store"))
        fail_msg("%s", kvh_last_error());
    close(lock_fd), close(dir_fd);
    dt_assert_ok(dt_close(dt_open_a(&c)));
    dt_rmrf(dir);
}

/* ---- a process forked while the engine was open ---- */

static void test_forked_process_does_not_keep_the_store(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("lock-fork", dir, sizeof(dir));
    kvh_config c = lock_cfg(dir); /* no migration threads: fork() is safe */
    kvh_engine *e = dt_open_a(&c);
    int hold[2];
    assert_int_equal(pipe(hold), 0);
    pid_t pid = dt_fork_child();
    assert_true(pid >= 0);
    if (pid == 0) { /* a worker that never uses the engine: waits, exits */
        close(hold[1]);
        char ch;
        ssize_t n = read(hold[0], &ch, 1);
        _exit(n < 0 ? 1 : 0);
    }
    close(hold[0]);
    dt_assert_ok(dt_close(dt_untrack(e)));
    kvh_engine *x = NULL;
    kvh_status st = kvh_engine_open(&c, &x);
    char err[256];
    snprintf(err, sizeof(err), "%s", kvh_last_error());
    if (x)
        kvh_engine_close(x);
    close(hold[1]); /* the worker exits */
    dt_reap(pid);
    if (st != KVH_OK) /* BUSY: the worker's inherited descriptor kept the flock */
        fail_msg("reopen after close, with a forked worker alive: %s (%s)", kvh_status_name(st), err);
    dt_rmrf(dir);
}

/* The same worker outliving its parent, killed with the engine open: no
 * engine has the store open, so another process's open succeeds, and so
 * does the worker's own (kvh.h: a child opens a new engine). While the
 * parent lives, its lock holds: the worker gave up only its copies. */
static char worker_after_parent(int go_fd, const char *dir)
{
    char ch;
    if (read(go_fd, &ch, 1) != 1)
        return 'r';
    kvh_config c = lock_cfg(dir);
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&c, &e);
    if (e)
        kvh_engine_close(e);
    return st == KVH_OK ? 'y' : 'n';
}

static void test_forked_worker_outliving_its_killed_parent(void **state)
{
    (void)state;
    char dir[512];
    dt_scratch("lock-orphan", dir, sizeof(dir));
    /* ready: the parent says the store is open; go: the test lets the
     * worker open it; done: the worker's answer (it is the killed
     * parent's child, not the test's, so no exit status comes back). */
    int ready[2], go[2], done[2];
    assert_int_equal(pipe(ready), 0);
    assert_int_equal(pipe(go), 0);
    assert_int_equal(pipe(done), 0);
    pid_t parent = dt_fork_child();
    assert_true(parent >= 0);
    if (parent == 0) {
        kvh_config c = lock_cfg(dir);
        kvh_engine *e = NULL;
        if (kvh_engine_open(&c, &e) != KVH_OK)
            _exit(1);
        if (fork() == 0) {
            char answer = worker_after_parent(go[0], dir);
            _exit(write(done[1], &answer, 1) == 1 ? 0 : 1);
        }
        if (write(ready[1], "o", 1) != 1)
            _exit(1);
        pause();
        _exit(0);
    }
    close(ready[1]);
    close(go[0]);
    close(done[1]);
    char ch;
    assert_int_equal(read(ready[0], &ch, 1), 1);
    close(ready[0]);
    kvh_config c = lock_cfg(dir);
    kvh_engine *x = NULL;
    kvh_status while_alive = kvh_engine_open(&c, &x);
    if (x)
        kvh_engine_close(x);
    kill(parent, SIGKILL);
    dt_reap(parent);
    /* The worker gives up its copies when it first runs after the fork,
     * which on a loaded machine can come after this: a moment, not for
     * as long as it lives. */
    kvh_status after = KVH_ERR_BUSY;
    char err[256] = "";
    for (int i = 0; i < 500 && after == KVH_ERR_BUSY; i++) {
        if (i)
            dt_sleep_ms(10);
        x = NULL;
        after = kvh_engine_open(&c, &x);
        snprintf(err, sizeof(err), "%s", kvh_last_error());
        if (x)
            kvh_engine_close(x);
    }
    assert_int_equal(write(go[1], "g", 1), 1);
    close(go[1]);
    struct pollfd pfd = {.fd = done[0], .events = POLLIN};
    char answer = '?';
    if (poll(&pfd, 1, 20000) != 1 || read(done[0], &answer, 1) != 1)
        answer = '?';
    close(done[0]);
    assert_int_equal(while_alive, KVH_ERR_BUSY);
    if (after != KVH_OK)
        fail_msg("open after the parent was killed, its forked worker alive: %s (%s)", kvh_status_name(after), err);
    if (answer != 'y')
        fail_msg("the orphaned worker's own open: %s", answer == 'n' ? "refused" : "no answer");
    dt_rmrf(dir);
}

/* Forks while other threads open and close engines: a child that gets a
 * store's directory or LOCK at any moment of an open or a close would hold
 * its flock past its parent. None may. */
#define CHURN_THREADS 4
#define CHURN_FORKS 300

typedef struct churn_arg {
    char dir[512];
    atomic_bool *stop;
} churn_arg;

static void *churn_engines(void *p)
{
    churn_arg *a = p;
    kvh_config c = lock_cfg(a->dir);
    while (!atomic_load(a->stop)) {
        kvh_engine *e = NULL;
        if (kvh_engine_open(&c, &e) == KVH_OK)
            kvh_engine_close(e);
    }
    return NULL;
}

/* In the child: 1 when a descriptor names a store directory under root or
 * a LOCK file (the two that hold the store's flock; slabs and journals
 * hold none). */
static int holds_something_under(const char *root)
{
    DIR *fds = opendir("/proc/self/fd");
    if (!fds)
        return 2;
    int found = 0;
    struct dirent *de;
    size_t n = strlen(root);
    while (!found && (de = readdir(fds)) != NULL) {
        char link[320], target[PATH_MAX];
        snprintf(link, sizeof(link), "/proc/self/fd/%s", de->d_name);
        ssize_t len = readlink(link, target, sizeof(target) - 1);
        if (len > 0) {
            target[len] = '\0';
            const char *rest = target + n;
            found = strncmp(target, root, n) == 0 &&
                    ((rest[0] == '/' && !strchr(rest + 1, '/')) || (len >= 5 && !strcmp(target + len - 5, "/LOCK")));
        }
    }
    closedir(fds);
    return found;
}

static void test_no_fork_inherits_a_store_being_opened_or_closed(void **state)
{
    (void)state;
    char root[512];
    dt_scratch("lock-churn", root, sizeof(root));
    atomic_bool stop = false;
    static churn_arg args[CHURN_THREADS];
    pthread_t threads[CHURN_THREADS];
    for (int i = 0; i < CHURN_THREADS; i++) {
        if (snprintf(args[i].dir, sizeof(args[i].dir), "%.400s/s%d", root, i) >= (int)sizeof(args[i].dir))
            fail_msg("scratch path too long");
        args[i].stop = &stop;
        assert_int_equal(pthread_create(&threads[i], NULL, churn_engines, &args[i]), 0);
    }
    int holders = 0, odd = 0;
    for (int i = 0; i < CHURN_FORKS; i++) {
        pid_t pid = fork();
        if (pid == 0)
            _exit(holds_something_under(root));
        int ws = dt_reap(pid);
        int rc = ws >= 0 && WIFEXITED(ws) ? WEXITSTATUS(ws) : 3;
        holders += rc == 1;
        odd += rc > 1;
    }
    atomic_store(&stop, true);
    for (int i = 0; i < CHURN_THREADS; i++)
        pthread_join(threads[i], NULL);
    if (holders || odd)
        fail_msg("%d of %d children held a store's descriptor (%d could not look)", holders, CHURN_FORKS, odd);
    dt_rmrf(root);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_racing_opens_one_engine_at_a_time, dt_teardown),
        cmocka_unit_test_teardown(test_other_spellings_are_the_same_store, dt_teardown),
        cmocka_unit_test_teardown(test_a_replaced_lock_file_is_named_as_such, dt_teardown),
        cmocka_unit_test_teardown(test_a_closed_engine_is_not_named_as_the_holder, dt_teardown),
        cmocka_unit_test_teardown(test_forked_process_does_not_keep_the_store, dt_teardown),
        cmocka_unit_test_teardown(test_forked_worker_outliving_its_killed_parent, dt_teardown),
        cmocka_unit_test_teardown(test_no_fork_inherits_a_store_being_opened_or_closed, dt_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
