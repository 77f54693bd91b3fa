/* The CUDA backend loader (core/backend_loader.c) seen from a program
 * linked with libkvh statically: the loader looks through
 * $KVH_CUDA_BACKEND and beside the program (the directory of
 * /proc/self/exe), and without a backend its error and log name every
 * path it tried and why each failed. Where a libkvh_cuda.so loads anyway
 * (installed on the loader's path), the tests that need its absence are
 * skipped. A set-user-ID program ignores $KVH_CUDA_BACKEND.
 * FAKE_BACKEND is fake_cuda_backend.c built as a module: a backend whose
 * probe refuses, naming the file it was loaded from. */
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test_util.h"

static char scratch[PATH_MAX];
static char exe_dir[PATH_MAX];
static char log_text[2048];

static void capture_log(void *user, int32_t level, const char *message)
{
    (void)user;
    (void)level;
    if (strstr(message, "CUDA backend"))
        snprintf(log_text, sizeof(log_text), "%s", message);
}

static void set_paths(void)
{
    const char *tmp = getenv("KVH_TEST_TMPDIR");
    snprintf(scratch, sizeof(scratch), "%s", tmp && *tmp ? tmp : "/tmp");
    ssize_t n = readlink("/proc/self/exe", exe_dir, sizeof(exe_dir) - 1);
    assert_true(n > 0);
    exe_dir[n] = 0;
    char real[PATH_MAX];
    assert_non_null(realpath(exe_dir, real));
    *strrchr(real, '/') = 0;
    snprintf(exe_dir, sizeof(exe_dir), "%s", real);
}

/* Opens with backend b; returns the status and leaves the error text in
 * err. An engine that opens is closed again. */
static kvh_status open_with(uint32_t b, char *err, size_t err_len)
{
    kvh_config c = tu_cfg(1, 1, 16, 16, KVH_DTYPE_F32, 4, 4, 1);
    c.backend = b;
    c.log_fn = capture_log;
    c.log_level = KVH_LOG_INFO;
    log_text[0] = 0;
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&c, &e);
    snprintf(err, err_len, "%s", st == KVH_OK ? "" : kvh_last_error());
    if (st == KVH_OK)
        kvh_engine_close(e);
    return st;
}

static void expect_all_tried(const char *text, const char *env_path, const char *env_why)
{
    char want[PATH_MAX + 64];
    assert_non_null(strstr(text, "libkvh_cuda.so not found; tried"));
    snprintf(want, sizeof(want), "$KVH_CUDA_BACKEND %s (%s)", env_path, env_why);
    if (!strstr(text, want))
        fail_msg("no \"%s\" in \"%s\"", want, text);
    snprintf(want, sizeof(want), "beside the program: %s/libkvh_cuda.so (absent)", exe_dir);
    if (!strstr(text, want))
        fail_msg("no \"%s\" in \"%s\"", want, text);
    if (!strstr(text, "on the loader's search path: libkvh_cuda.so.0 ("))
        fail_msg("no loader search path in \"%s\"", text);
    /* Linked statically, libkvh is the program: no second directory. */
    assert_null(strstr(text, "beside libkvh:"));
}

static void test_no_backend_names_every_path(void **state)
{
    (void)state;
    set_paths();
    char beside[PATH_MAX + 32];
    snprintf(beside, sizeof(beside), "%s/libkvh_cuda.so", exe_dir);
    if (access(beside, F_OK) == 0)
        skip();
    char env_path[PATH_MAX + 32];
    snprintf(env_path, sizeof(env_path), "%s/nowhere/libkvh_cuda.so", scratch);
    setenv("KVH_CUDA_BACKEND", env_path, 1);

    char err[1024];
    kvh_status st = open_with(KVH_BACKEND_CUDA, err, sizeof(err));
    if (st == KVH_OK)
        skip(); /* a backend on the loader's path answered */
    assert_int_equal(st, KVH_ERR_UNSUPPORTED);
    print_message("    %s\n", err);
    assert_non_null(strstr(err, "CUDA backend unavailable"));
    expect_all_tried(err, env_path, "absent");

    /* auto: the CPU backend, and the log says why, with the same list. */
    assert_int_equal(open_with(KVH_BACKEND_AUTO, err, sizeof(err)), KVH_OK);
    assert_non_null(strstr(log_text, "using the CPU backend"));
    expect_all_tried(log_text, env_path, "absent");
    unsetenv("KVH_CUDA_BACKEND");
}

/* A file that is not a shared object: the reason is dlopen's, not "absent". */
static void test_bad_file_says_why(void **state)
{
    (void)state;
    set_paths();
    char env_path[PATH_MAX + 32];
    snprintf(env_path, sizeof(env_path), "%s/libkvh_cuda.so", scratch);
    FILE *f = fopen(env_path, "w");
    assert_non_null(f);
    fputs("not an ELF file\n", f);
    fclose(f);
    setenv("KVH_CUDA_BACKEND", env_path, 1);
    char err[1024];
    kvh_status st = open_with(KVH_BACKEND_CUDA, err, sizeof(err));
    unsetenv("KVH_CUDA_BACKEND");
    unlink(env_path);
    if (st == KVH_OK)
        skip();
    char want[PATH_MAX + 64];
    snprintf(want, sizeof(want), "$KVH_CUDA_BACKEND %s (", env_path);
    const char *at = strstr(err, want);
    if (!at)
        fail_msg("no \"%s\" in \"%s\"", want, err);
    assert_true(strncmp(at + strlen(want), "absent)", 7) != 0);
}

/* $KVH_CUDA_BACKEND names the backend that is loaded. */
static void test_env_backend_is_loaded(void **state)
{
    (void)state;
    setenv("KVH_CUDA_BACKEND", FAKE_BACKEND, 1);
    char err[1024];
    kvh_status st = open_with(KVH_BACKEND_CUDA, err, sizeof(err));
    unsetenv("KVH_CUDA_BACKEND");
    assert_int_equal(st, KVH_ERR_UNSUPPORTED);
    char want[PATH_MAX + 32];
    snprintf(want, sizeof(want), "fake backend %s: no device 0", FAKE_BACKEND);
    if (!strstr(err, want))
        fail_msg("no \"%s\" in \"%s\"", want, err);
}

static void copy_file(const char *from, const char *to, mode_t mode)
{
    int in = open(from, O_RDONLY), out = open(to, O_WRONLY | O_CREAT | O_TRUNC, mode);
    assert_true(in >= 0 && out >= 0);
    char buf[1 << 16];
    ssize_t n;
    while ((n = read(in, buf, sizeof(buf))) > 0)
        assert_int_equal(write(out, buf, (size_t)n), n);
    assert_int_equal(n, 0);
    close(in);
    assert_int_equal(close(out), 0);
}

/* The child of test_backend_beside_program: a copy of this program with
 * libkvh_cuda.so beside it. 0 when that backend was the one loaded. */
static int run_beside(void)
{
    set_paths();
    unsetenv("KVH_CUDA_BACKEND");
    char err[1024];
    kvh_status st = open_with(KVH_BACKEND_CUDA, err, sizeof(err));
    char want[PATH_MAX + 64];
    snprintf(want, sizeof(want), "fake backend %s/libkvh_cuda.so: no device 0", exe_dir);
    if (st != KVH_ERR_UNSUPPORTED || !strstr(err, want)) {
        fprintf(stderr, "beside the program: status %d, \"%s\", wanted \"%s\"\n", (int)st, err, want);
        return 1;
    }
    return 0;
}

/* A program linked statically finds libkvh_cuda.so in its own directory. */
static void test_backend_beside_program(void **state)
{
    (void)state;
    set_paths();
    char dir[PATH_MAX + 16], prog[PATH_MAX + 32], lib[PATH_MAX + 48], self[PATH_MAX];
    snprintf(dir, sizeof(dir), "%s/beside", scratch);
    mkdir(dir, 0700);
    snprintf(prog, sizeof(prog), "%s/prog", dir);
    snprintf(lib, sizeof(lib), "%s/libkvh_cuda.so", dir);
    ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    assert_true(n > 0);
    self[n] = 0;
    copy_file(self, prog, 0700);
    copy_file(FAKE_BACKEND, lib, 0600);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        execl(prog, prog, "--beside", (char *)NULL);
        _exit(127);
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    unlink(prog);
    unlink(lib);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
}

/* The child of test_setuid_program_ignores_the_variable: a set-user-ID
 * copy of this program, started with $KVH_CUDA_BACKEND naming the fake
 * backend. 0 when the variable was ignored. */
static int run_secure(void)
{
    char err[1024];
    kvh_status st = open_with(KVH_BACKEND_CUDA, err, sizeof(err));
    /* KVH_OK: a real backend on the loader's path answered, not the fake. */
    if (strstr(err, "fake backend") || strstr(err, "KVH_CUDA_BACKEND")) {
        fprintf(stderr, "set-user-ID: status %d, \"%s\"\n", (int)st, err);
        return 1;
    }
    return 0;
}

/* A set-user-ID program linked with libkvh loads no code named by its
 * caller's environment (secure_getenv). Needs root, to give the copy
 * another owner; skipped elsewhere, on a nosuid file system and in
 * sanitizer builds. */
static void test_setuid_program_ignores_the_variable(void **state)
{
    (void)state;
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    skip(); /* the sanitizers' runtimes cannot trace a set-user-ID process */
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
    skip(); /* the same under clang */
#endif
#endif
    if (geteuid() != 0)
        skip();
    set_paths();
    char dir[PATH_MAX + 16], prog[PATH_MAX + 32], self[PATH_MAX];
    snprintf(dir, sizeof(dir), "%s/setuid", scratch);
    mkdir(dir, 0755);
    struct statvfs fs;
    if (statvfs(dir, &fs) == 0 && (fs.f_flag & ST_NOSUID))
        skip();
    assert_int_equal(chmod(dir, 0755), 0);
    snprintf(prog, sizeof(prog), "%s/prog", dir);
    ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    assert_true(n > 0);
    self[n] = 0;
    copy_file(self, prog, 0755);
    assert_int_equal(chown(prog, 65534, 65534), 0);
    assert_int_equal(chmod(prog, 04755), 0);
    int pipefd[2];
    assert_int_equal(pipe(pipefd), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(pipefd[0]);
        dup2(pipefd[1], 2);
        setenv("KVH_CUDA_BACKEND", FAKE_BACKEND, 1);
        execl(prog, prog, "--secure", (char *)NULL);
        _exit(127);
    }
    close(pipefd[1]);
    char out[2048] = "";
    size_t got = 0;
    for (ssize_t r; got < sizeof(out) - 1 && (r = read(pipefd[0], out + got, sizeof(out) - 1 - got)) > 0;)
        got += (size_t)r;
    close(pipefd[0]);
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    unlink(prog);
    if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0))
        fail_msg("the set-user-ID copy used $KVH_CUDA_BACKEND: %s", out);
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "--beside") == 0)
        return run_beside();
    if (argc > 1 && strcmp(argv[1], "--secure") == 0)
        return run_secure();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_no_backend_names_every_path, tu_teardown),
        cmocka_unit_test_teardown(test_bad_file_says_why, tu_teardown),
        cmocka_unit_test_teardown(test_env_backend_is_loaded, tu_teardown),
        cmocka_unit_test_teardown(test_backend_beside_program, tu_teardown),
        cmocka_unit_test_teardown(test_setuid_program_ignores_the_variable, tu_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
