/* Disk store on a filesystem that really fills up.
 *
 * test_rel_faults injects ENOSPC through the fault hook, one call at a
 * time. Here the store lives on a small tmpfs mounted for the test, too
 * small for its slab file: the preallocation is refused, the slab grows on
 * demand (core/disk_io.c), and slab writes, journal appends and the
 * snapshot's temp file all meet a real full disk, in whatever order the
 * engine reaches them. A process persists chains until the disk is full
 * and goes on trying (and closes, or is SIGKILLed); then the tmpfs is
 * grown and the store reopened, with disk_strict_index. Pass: every call
 * returns a documented status; the reopen succeeds; every chain whose
 * persist returned KVH_OK is found whole and exact, nothing else is served
 * wrong, corrupt_blocks is 0; and the store takes new blocks again.
 * With migration workers the closing process must also end in bounded
 * time, use no CPU while it idles on the full disk, and persist again in
 * the same open once the tmpfs has grown.
 *
 * Needs mount(2) (root, or a user namespace); skipped where refused.
 */
#include <sys/statvfs.h>

#include "disk_test_util.h"

static const dt_geo G = {1, 1, 64, 16, KVH_DTYPE_F16}; /* block 4096 bytes, slot 8192 */
#define DISK_SLOTS 64                                  /* 512 KiB of slab */
#define CHAINS 40
#define BLOCKS 2

static char mnt[512];

static int teardown_mount(void **state)
{
    dt_teardown(state);
    if (mnt[0]) {
        umount2(mnt, MNT_DETACH); /* no-op when run_case unmounted it */
        mnt[0] = '\0';
    }
    return 0;
}

static dt_content chain(int i) { return dt_plain(0xf011000 + (uint64_t)i); }

static kvh_config full_cfg(const char *dir, uint32_t threads) { return dt_cfg(G, dir, 2, 2, DISK_SLOTS, threads); }

typedef struct full_arg {
    const char *dir;
    const char *acks;
    bool close_at_end; /* else wait to be killed */
    uint32_t threads;  /* migration workers */
} full_arg;

/* Seconds a child may take before it counts as hung (SIGALRM). */
#define HANG_SECONDS 15
/* Milliseconds the child sits idle on the full disk before closing. */
#define IDLE_CHECK_MS 1000

/* Persists chains one by one, appending "A i" to the acks file after each
 * KVH_OK; every status must be one kvh.h lists for the call. */
static int full_child(void *p, int ready_fd)
{
    full_arg *a = p;
    int afd = open(a->acks, O_WRONLY | O_APPEND | O_CLOEXEC);
    if (afd < 0)
        return 2;
    alarm(HANG_SECONDS);
    kvh_config c = full_cfg(a->dir, a->threads);
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&c, &e);
    if (st != KVH_OK) {
        fprintf(stderr, "child: open on the small filesystem: %s (%s)\n", kvh_status_name(st), kvh_last_error());
        return st == KVH_ERR_NOSPACE ? 0 : 3;
    }
    if (ready_fd >= 0 && write(ready_fd, "r", 1) != 1)
        return 4;
    int failures = 0;
    for (int i = 0; i < CHAINS; i++) {
        kvh_seq s;
        st = dt_build(e, G, chain(i), BLOCKS * G.bt, 0, &s);
        if (st != KVH_OK) {
            if (st != KVH_ERR_NOSPACE && st != KVH_ERR_IO) {
                fprintf(stderr, "child: build %d: %s (%s)\n", i, kvh_status_name(st), kvh_last_error());
                return 5;
            }
            continue;
        }
        st = kvh_seq_persist(e, s);
        if (st == KVH_OK)
            dt_oracle_write(afd, "A %d\n", i);
        else if (st != KVH_ERR_NOSPACE && st != KVH_ERR_IO && st != KVH_ERR_BUSY) {
            fprintf(stderr, "child: persist %d: %s (%s)\n", i, kvh_status_name(st), kvh_last_error());
            return 6;
        } else if (failures++ == 0)
            fprintf(stderr, "first refusal (%u workers), chain %d: %s (%s)\n", a->threads, i, kvh_status_name(st),
                    kvh_last_error());
        kvh_seq_free(e, s);
    }
    if (failures == 0) {
        fprintf(stderr, "child: the filesystem never filled\n");
        return 7;
    }
    if (a->threads) {
        /* Idle on a full disk, the workers must not spin on writes that
         * keep failing: a spinning worker uses most of a CPU even when
         * the machine is loaded; an idle one uses none. */
        struct timespec c0, c1;
        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c0);
        usleep(IDLE_CHECK_MS * 1000);
        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c1);
        double busy_ms = (double)(c1.tv_sec - c0.tv_sec) * 1e3 + (double)(c1.tv_nsec - c0.tv_nsec) / 1e6;
        fprintf(stderr, "%u workers idle on the full disk: %.1f ms of CPU in %d ms\n", a->threads, busy_ms,
                IDLE_CHECK_MS);
        if (busy_ms > IDLE_CHECK_MS / 10) {
            fprintf(stderr, "child: %.0f ms of CPU in %d ms idle on the full disk: the workers spin\n", busy_ms,
                    IDLE_CHECK_MS);
            return 9;
        }
    }
    if (a->threads && a->close_at_end) {
        /* Room again, with the same engine open: the next persist must
         * work (a refused write is not remembered for good). */
        /* Blocks that arrive in the host tier while the disk is full
         * get no clean copy: the workers try, are refused and rest. */
        kvh_seq fresh;
        st = dt_build(e, G, dt_plain(0xc1ea4), BLOCKS * G.bt, 0, &fresh);
        if (st != KVH_OK) {
            fprintf(stderr, "child: build on the full disk: %s (%s)\n", kvh_status_name(st), kvh_last_error());
            return 13;
        }
        usleep(200 * 1000);
        kvh_stats before = dt_stats(e);
        if (mount("tmpfs", mnt, "tmpfs", MS_REMOUNT, "size=8m,mode=0700") != 0)
            return 10;
        /* With no call to wake them, the resting workers must try again
         * when their rest ends and write the clean copies they could not
         * (at most a 1 s rest: 3 s is room to spare). */
        uint64_t written = before.disk_copies_written;
        for (int waited = 0; waited < 3000 && written == before.disk_copies_written; waited += 50) {
            usleep(50 * 1000);
            written = dt_stats(e).disk_copies_written;
        }
        fprintf(stderr, "%u workers, room again: %llu clean copies written with no call\n", a->threads,
                (unsigned long long)(written - before.disk_copies_written));
        if (written == before.disk_copies_written) {
            fprintf(stderr, "child: room again, but the resting workers never wrote a clean copy\n");
            return 12;
        }
        kvh_seq_free(e, fresh);
        kvh_seq s;
        st = dt_build(e, G, chain(CHAINS), BLOCKS * G.bt, 0, &s);
        if (st == KVH_OK)
            st = kvh_seq_persist(e, s);
        if (st != KVH_OK) {
            fprintf(stderr, "child: persist after the filesystem grew: %s (%s)\n", kvh_status_name(st),
                    kvh_last_error());
            return 11;
        }
        dt_oracle_write(afd, "A %d\n", CHAINS);
        kvh_seq_free(e, s);
    }
    if (a->close_at_end) {
        st = kvh_engine_close(e);
        if (st != KVH_OK && st != KVH_ERR_IO && st != KVH_ERR_NOMEM && st != KVH_ERR_NOSPACE) {
            fprintf(stderr, "child: close: %s\n", kvh_status_name(st));
            return 8;
        }
        return 0;
    }
    for (;;)
        pause();
}

/* Returns true when the closing child hung (killed by its watchdog). */
static bool run_case(bool killed, uint32_t threads)
{
    char dir[600], acks[600];
    snprintf(dir, sizeof(dir), "%s/store", mnt);
    snprintf(acks, sizeof(acks), "%s.acks", mnt);
    dt_rmrf(dir);
    assert_int_equal(mount("tmpfs", mnt, "tmpfs", 0, "size=320k,mode=0700"), 0);
    assert_int_equal(mkdir(dir, 0700), 0);
    assert_int_equal(dt_write_file(acks, "", 0), 0);
    full_arg a = {dir, acks, !killed, threads};
    bool hung = false;
    int ws = 0;
    if (killed) {
        dt_kill_result kr = dt_kill_child(full_child, &a, false, 60000, 300000, &ws);
        char msg[256];
        if (dt_kill_failed(kr, ws, msg, sizeof(msg)) && !(WIFEXITED(ws) && WEXITSTATUS(ws) == 0))
            fail_msg("full filesystem, killed: %s", msg);
    } else {
        full_arg *ap = &a;
        pid_t pid = dt_fork_child();
        assert_true(pid >= 0);
        if (pid == 0)
            _exit(full_child(ap, -1));
        ws = dt_reap(pid);
        hung = WIFSIGNALED(ws) && WTERMSIG(ws) == SIGALRM;
        if (!hung && (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0))
            fail_msg("full filesystem, closed: the child ended with status 0x%x", ws);
    }
    /* room again */
    assert_int_equal(mount("tmpfs", mnt, "tmpfs", MS_REMOUNT, "size=8m,mode=0700"), 0);
    size_t len = 0;
    uint8_t *buf = dt_read_file(acks, &len);
    bool acked[CHAINS + 1] = {false}; /* chain CHAINS: persisted after the filesystem grew */
    int n_acked = 0;
    for (size_t i = 0; buf && i < len;) {
        int c;
        if (sscanf((const char *)buf + i, "A %d", &c) == 1 && c >= 0 && c <= CHAINS && !acked[c])
            acked[c] = true, n_acked++;
        while (i < len && buf[i] != '\n')
            i++;
        i++;
    }
    free(buf);
    kvh_config c = full_cfg(dir, 0);
    c.disk_strict_index = 1;
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&c, &e);
    if (st != KVH_OK)
        fail_msg("%s: reopen with room again: %s (%s)", killed ? "killed" : "closed", kvh_status_name(st),
                 kvh_last_error());
    dt_track(e);
    int found = 0;
    for (int i = 0; i <= CHAINS; i++) {
        size_t m = 0;
        char msg[256] = "";
        if (dt_match_verify(e, G, chain(i), BLOCKS * G.bt, &m, msg, sizeof(msg)) != KVH_OK)
            fail_msg("%s: chain %d: %s", killed ? "killed" : "closed", i, msg);
        if (acked[i] && m != BLOCKS * G.bt)
            fail_msg("%s: chain %d was acknowledged durable; %zu of %u tokens found", killed ? "killed" : "closed", i,
                     m, BLOCKS * G.bt);
        found += m == BLOCKS * G.bt;
    }
    assert_int_equal(dt_stats(e).corrupt_blocks, 0);
    /* and it takes new blocks again */
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, dt_plain(0xf0110ff), BLOCKS * G.bt, 0, &s));
    dt_assert_ok(kvh_seq_persist(e, s));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(dt_untrack(e)));
    printf("full filesystem (%s, %u workers): %d chains acknowledged (%d after it grew), %d found again%s\n",
           killed ? "killed" : "closed", threads, n_acked, acked[CHAINS], found, hung ? "; the child hung" : "");
    assert_true(n_acked > 0);
    if (threads && !killed && !acked[CHAINS])
        fail_msg("closed, %u workers: the chain persisted after the filesystem grew is not acknowledged", threads);
    dt_rmrf(dir);
    unlink(acks);
    /* Lazily: the io_uring workers of a child that just died may still
     * hold its files for a moment (a plain umount then fails EBUSY and
     * leaves the mount behind). */
    assert_int_equal(umount2(mnt, MNT_DETACH), 0);
    return hung;
}

static void need_mount(void)
{
    dt_scratch_mountpoint("full-fs", mnt, sizeof(mnt));
    if (mount("tmpfs", mnt, "tmpfs", 0, "size=320k") != 0) {
        print_message("SKIP: mount -t tmpfs refused (%s)\n", strerror(errno));
        mnt[0] = '\0';
        skip();
    }
    umount(mnt);
}

static void test_full_filesystem_keeps_acks(void **state)
{
    (void)state;
    need_mount();
    if (run_case(false, 0))
        fail_msg("an engine without workers hung on a full filesystem");
    run_case(true, 0);
    run_case(true, 2); /* killed 300 ms after its open: wherever the workers are */
}

/* With migration workers, the same closing run must end too: an append
 * that needs room gets KVH_ERR_NOSPACE or KVH_ERR_IO in bounded time, and
 * the workers do not keep retrying writes the disk refuses (full_child
 * measures the process's CPU time while it sits idle on the full disk). */
static void test_full_filesystem_with_workers_ends(void **state)
{
    (void)state;
    need_mount();
    if (run_case(false, 2))
        fail_msg("with 2 workers on a full filesystem the child did not end within %d s (an append waiting for "
                 "host room while the workers retried slab writes that failed with ENOSPC)",
                 HANG_SECONDS);
    run_case(false, 1);
}

/* A store asked for more than the file system has, on ext4: the
 * preallocation fails midway and ext4 keeps what it allocated; that must
 * go back (the slab then grows on demand), or the store holds the whole
 * disk and cannot even write its index, at this open or any later one.
 * Needs mkfs.ext4 and a loop mount (root); skipped where either fails. */
static void test_open_larger_than_ext4_free_space(void **state)
{
    (void)state;
    char dir[512], img[600], cmd[2600], store[600];
    dt_scratch_mountpoint("ext4-full", mnt, sizeof(mnt));
    dt_scratch("ext4-image", dir, sizeof(dir)); /* a directory of its own */
    snprintf(img, sizeof(img), "%s/fs.img", dir);
    snprintf(cmd, sizeof(cmd),
             "truncate -s 64M '%s' && mkfs.ext4 -q -F '%s' >/dev/null 2>&1 && mount -o loop '%s' '%s'", img, img, img,
             mnt);
    if (system(cmd) != 0) {
        print_message("SKIP: no ext4 loop mount here (mkfs.ext4 or mount -o loop refused)\n");
        unlink(img);
        mnt[0] = '\0';
        skip();
    }
    snprintf(store, sizeof(store), "%s/store", mnt);
    struct statvfs before, after;
    assert_int_equal(statvfs(mnt, &before), 0);
    uint64_t free_before = (uint64_t)before.f_bavail * before.f_frsize;
    kvh_config c = dt_cfg(G, store, 4, 4, (64u << 20) / dt_slot_bytes(G), 0); /* 64 MiB of slots */
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&c, &e);
    if (st != KVH_OK && st != KVH_ERR_NOSPACE)
        fail_msg("open of a store larger than the file system: %s (%s)", kvh_status_name(st), kvh_last_error());
    assert_int_equal(statvfs(mnt, &after), 0);
    uint64_t free_after = (uint64_t)after.f_bavail * after.f_frsize;
    if (free_after < free_before / 2)
        fail_msg("the open left %llu of %llu free bytes", (unsigned long long)free_after,
                 (unsigned long long)free_before);
    if (st == KVH_OK) {
        dt_content ct = dt_plain(0xe474);
        kvh_seq s;
        dt_assert_ok(dt_build(e, G, ct, 2 * G.bt, 0, &s));
        dt_assert_ok(kvh_seq_persist(e, s));
        dt_assert_ok(kvh_seq_free(e, s));
        dt_assert_ok(dt_close(e));
    }
    /* A smaller store at the same path opens, and keeps what was persisted. */
    c.disk_bytes = 16u << 20;
    dt_assert_ok(kvh_engine_open(&c, &e));
    if (st == KVH_OK) {
        size_t m = 0;
        char msg[256] = "";
        if (dt_match_verify(e, G, dt_plain(0xe474), 2 * G.bt, &m, msg, sizeof(msg)) != KVH_OK)
            fail_msg("%s", msg);
        assert_int_equal(m, 2 * G.bt);
    }
    dt_assert_ok(dt_close(e));
    umount2(mnt, MNT_DETACH);
    mnt[0] = '\0';
    unlink(img);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_full_filesystem_keeps_acks, teardown_mount),
        cmocka_unit_test_teardown(test_full_filesystem_with_workers_ends, teardown_mount),
        cmocka_unit_test_teardown(test_open_larger_than_ext4_free_space, teardown_mount),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
