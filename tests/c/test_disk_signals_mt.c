/* The disk tier under a storm of signals.
 *
 * A program that embeds kvh gets signals: a profiler's timer, SIGCHLD,
 * Python's SIGINT, a runtime's own. Under a handler installed without
 * SA_RESTART (as Python installs its own) each can end the system call
 * its thread is waiting in with EINTR. Here a thread sends SIGUSR1 to
 * every other thread of the process every 100 us while an engine with
 * O_DIRECT slabs and two migration workers spills sequences to disk,
 * persists them, reads them back from disk, matches them after
 * reopening and closes. Pass: every call returns KVH_OK, every byte read
 * is the one written, no block is counted corrupt, and the signals did
 * land (thousands of them). core/disk_io.c waits on its io_uring through
 * lane_wait_cqe, which resumes an interrupted wait; test_disk_io checks
 * each I/O path with the interruptions injected. */
#include "disk_test_util.h"

#include <dirent.h>
#include <stdatomic.h>
#include <sys/syscall.h>

/* 16 KiB blocks go to and from the slabs straight from memory (gather,
 * scatter, one block in pieces); 1,536-byte ones, not a multiple of a
 * page, through the lane's staging (runs). */
static const dt_geo GEOS[2] = {{2, 2, 64, 16, KVH_DTYPE_F16}, {1, 1, 24, 16, KVH_DTYPE_F16}};
#define SEQS 6
#define SEQ_TOKENS (5 * 16)
#define ROUNDS 20
/* The storm must have landed while the disk was busy: rounds go on past
 * ROUNDS until this many signals were caught (a fast disk finishes the
 * 20 rounds in a fraction of a second), up to MAX_ROUNDS. */
#define MIN_CAUGHT 1000
#define MAX_ROUNDS 2000

static atomic_int storm_on, signals_sent, signals_caught;

static void on_signal(int sig)
{
    (void)sig;
    atomic_fetch_add(&signals_caught, 1);
}

/* Signals every thread of the process but itself, every 100 us. */
static void *storm(void *arg)
{
    (void)arg;
    long self = syscall(SYS_gettid);
    while (atomic_load(&storm_on)) {
        DIR *d = opendir("/proc/self/task");
        if (!d)
            break;
        struct dirent *de;
        while ((de = readdir(d)) != NULL) {
            long tid = atol(de->d_name);
            if (tid > 0 && tid != self && syscall(SYS_tgkill, getpid(), (pid_t)tid, SIGUSR1) == 0)
                atomic_fetch_add(&signals_sent, 1);
        }
        closedir(d);
        dt_sleep_ms(0.1);
    }
    return NULL;
}

static dt_content content(int round, int i) { return dt_plain(0x516e00 + (uint64_t)round * 16 + (uint64_t)i); }

static void check(kvh_status st, const char *what, int round, int i)
{
    if (st != KVH_OK)
        fail_msg("round %d, sequence %d: %s: %s (%s)", round, i, what, kvh_status_name(st), dt_err);
}

static void storm_through(dt_geo G)
{
    struct sigaction sa = {.sa_handler = on_signal}; /* no SA_RESTART */
    sigemptyset(&sa.sa_mask);
    struct sigaction old;
    assert_int_equal(sigaction(SIGUSR1, &sa, &old), 0);
    char dir[512];
    dt_scratch("signals", dir, sizeof(dir));
    atomic_store(&signals_sent, 0);
    atomic_store(&signals_caught, 0);
    kvh_config c = dt_cfg(G, dir, 8, 8, 4 * SEQS * ROUNDS, 2);
    kvh_engine *e = dt_open_a(&c);
    atomic_store(&storm_on, 1);
    pthread_t sender;
    assert_int_equal(pthread_create(&sender, NULL, storm, NULL), 0);
    char msg[256];
    int rounds = 0;
    for (int round = 0; round < ROUNDS || (atomic_load(&signals_caught) <= MIN_CAUGHT && round < MAX_ROUNDS);
         round++, rounds++) {
        kvh_seq s[SEQS];
        for (int i = 0; i < SEQS; i++) {
            check(dt_build(e, G, content(round, i), SEQ_TOKENS, (uint32_t)i, &s[i]), "build", round, i);
            check(dt_keep(kvh_seq_persist(e, s[i])), "persist", round, i);
        }
        for (int i = 0; i < SEQS; i++)
            check(dt_keep(kvh_seq_migrate(e, s[i], 0, SEQ_TOKENS, KVH_TIER_DISK, NULL)), "spill to disk", round, i);
        for (int i = 0; i < SEQS; i++) {
            msg[0] = '\0';
            kvh_status st = dt_verify(e, s[i], G, content(round, i), 0, SEQ_TOKENS, msg, sizeof(msg));
            if (st != KVH_OK)
                fail_msg("round %d, sequence %d: read back from disk: %s: %s", round, i, kvh_status_name(st), msg);
            check(kvh_seq_free(e, s[i]), "free", round, i);
        }
        check(dt_close(e), "close", round, -1);
        e = dt_open_a(&c);
        for (int i = 0; i < SEQS; i++) {
            size_t matched = 0;
            msg[0] = '\0';
            kvh_status st = dt_match_verify(e, G, content(round, i), SEQ_TOKENS, &matched, msg, sizeof(msg));
            if (st != KVH_OK || matched != SEQ_TOKENS)
                fail_msg("round %d, sequence %d after reopening: %s, %zu of %d tokens matched: %s", round, i,
                         kvh_status_name(st), matched, SEQ_TOKENS, msg);
        }
    }
    atomic_store(&storm_on, 0);
    pthread_join(sender, NULL);
    kvh_stats stats = {.struct_size = sizeof(stats)};
    dt_assert_ok(kvh_engine_stats(e, &stats));
    assert_int_equal(stats.corrupt_blocks, 0);
    dt_assert_ok(dt_close(e));
    print_message("%" PRIu64 "-byte blocks: %d signals sent, %d caught, while %d sequences of %d blocks were "
                  "spilled, persisted, read back and matched after a reopen\n",
                  dt_block_bytes(G), atomic_load(&signals_sent), atomic_load(&signals_caught), SEQS * rounds,
                  SEQ_TOKENS / G.bt);
    assert_true(atomic_load(&signals_caught) > MIN_CAUGHT);
    sigaction(SIGUSR1, &old, NULL);
}

static void test_disk_calls_survive_a_signal_storm(void **state)
{
    (void)state;
    for (int g = 0; g < 2; g++)
        storm_through(GEOS[g]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_disk_calls_survive_a_signal_storm, dt_teardown),
    };
    return cmocka_run_group_tests_name("disk_signals", tests, NULL, NULL);
}
