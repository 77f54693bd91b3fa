/* The disk tier where io_uring is refused, as a seccomp filter or
 * kernel.io_uring_disabled refuses it: a ring that cannot be set up is
 * said in the log at open (lanes are made on first use, and the warning
 * they wrote was never logged), and a ring that is set up but whose
 * io_uring_enter is refused fails no call (the first persist failed with
 * KVH_ERR_IO "Operation not permitted" before the lane left the ring).
 * Each case runs in a child process, the filter installed there. */
#include <errno.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "disk_test_util.h"

static const dt_geo G = {2, 1, 32, 16, KVH_DTYPE_F16};

/* Makes syscall nr fail with err in this process from now on. */
static int refuse_syscall(long nr, int err)
{
    struct sock_filter prog[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (unsigned)nr, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (unsigned)(err & SECCOMP_RET_DATA)),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog fprog = {.len = sizeof(prog) / sizeof(prog[0]), .filter = prog};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
        return -1;
    return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &fprog);
}

/* In the child: persist 6 blocks, close, reopen, match and verify; the
 * log must (or must not) hold the io_uring warning. 0 when all held. */
static int child(const char *dir, long nr, int err, bool warned)
{
    if (refuse_syscall(nr, err) != 0)
        return 20;
    dt_log log;
    dt_log_init(&log);
    kvh_config c = dt_cfg(G, dir, 4, 4, 64, 1);
    dt_log_attach(&c, &log);
    const dt_content a = dt_plain(3);
    const size_t len = 6 * G.bt;
    for (int round = 0; round < 2; round++) {
        kvh_engine *e = NULL;
        kvh_status st = kvh_engine_open(&c, &e);
        if (st != KVH_OK) {
            fprintf(stderr, "open: %s (%s)\n", kvh_status_name(st), kvh_last_error());
            return 21;
        }
        if (round == 0) {
            kvh_seq s;
            st = dt_build(e, G, a, len, 0, &s);
            if (st == KVH_OK)
                st = kvh_seq_persist(e, s);
            if (st != KVH_OK) {
                fprintf(stderr, "persist: %s (%s)\n", kvh_status_name(st), kvh_last_error());
                return 22;
            }
        } else {
            int32_t tok[6 * 16];
            dt_tokens(a, 0, len, tok);
            kvh_seq m;
            size_t matched = 0;
            if (kvh_seq_create(e, 0, &m) != KVH_OK || kvh_seq_match_prefix(e, m, tok, len, &matched) != KVH_OK ||
                matched != len) {
                fprintf(stderr, "reopened: %zu of %zu tokens found\n", matched, len);
                return 23;
            }
            char msg[256] = "";
            if (dt_verify(e, m, G, a, 0, len, msg, sizeof(msg)) != KVH_OK) {
                fprintf(stderr, "reopened: %s\n", msg);
                return 24;
            }
        }
        if (kvh_engine_close(e) != KVH_OK)
            return 25;
    }
    int said = dt_log_count(&log, KVH_LOG_WARN, "io_uring", NULL);
    if (warned ? said == 0 : said != 0) {
        fprintf(stderr, "%d warnings name io_uring, expected %s\n", said, warned ? "some" : "none");
        return 26;
    }
    return 0;
}

static void run_case(const char *name, long nr, int err, bool warned)
{
    char dir[512];
    dt_scratch(name, dir, sizeof(dir));
    dt_rmrf(dir);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0)
        _exit(child(dir, nr, err, warned));
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        fail_msg("%s: the child ended with status 0x%x", name, status);
    dt_rmrf(dir);
}

static void test_setup_refused_is_logged(void **state)
{
    (void)state;
    run_case("no-ring-setup-enosys", __NR_io_uring_setup, ENOSYS, true);
    run_case("no-ring-setup-eperm", __NR_io_uring_setup, EPERM, true);
}

static void test_enter_refused_fails_no_call(void **state)
{
    (void)state;
    run_case("no-ring-enter-eperm", __NR_io_uring_enter, EPERM, false);
    run_case("no-ring-enter-enosys", __NR_io_uring_enter, ENOSYS, false);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_setup_refused_is_logged),
        cmocka_unit_test(test_enter_refused_fails_no_call),
    };
    return cmocka_run_group_tests_name("disk_no_ring", tests, NULL, NULL);
}
