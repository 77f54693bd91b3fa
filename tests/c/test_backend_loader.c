/* The CUDA backend loader (core/backend_loader.c) without a backend: this
 * program links libkvh statically, so the loader looks beside the program
 * (the directory of /proc/self/exe) and through $KVH_CUDA_BACKEND, and its
 * error and log name every path it tried and why each failed. Where a
 * libkvh_cuda.so loads anyway (installed on the loader's path), the tests
 * that need its absence are skipped. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_no_backend_names_every_path, tu_teardown),
        cmocka_unit_test_teardown(test_bad_file_says_why, tu_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
