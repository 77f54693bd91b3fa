/* Helpers of the CUDA tests (test_cuda_*.c), which do not link the CUDA
 * runtime: device buffers and copies through a CUDA engine's backend
 * table, and where libkvh_cuda.so is found. Include after test_util.h
 * and core/engine.h. */
#ifndef KVH_TESTS_CUDA_TEST_UTIL_H
#define KVH_TESTS_CUDA_TEST_UTIL_H

#include <limits.h>
#include <unistd.h>

/* Device buffer through the CUDA engine's backend. */
static TU_UNUSED void *dev_alloc(kvh_engine *e, size_t bytes)
{
    void *d = e->backend->device_alloc(e->backend_ctx, bytes);
    assert_non_null(d);
    return d;
}

static TU_UNUSED void h2d(kvh_engine *e, void *dst, const void *src, size_t n)
{
    char msg[256] = "";
    if (e->backend->copy(e->backend_ctx, dst, src, n, KVHI_COPY_HOST_TO_DEVICE, msg, sizeof(msg)) != 0)
        fail_msg("H2D copy: %s", msg);
}

static TU_UNUSED void d2h(kvh_engine *e, void *dst, const void *src, size_t n)
{
    char msg[256] = "";
    if (e->backend->copy(e->backend_ctx, dst, src, n, KVHI_COPY_DEVICE_TO_HOST, msg, sizeof(msg)) != 0)
        fail_msg("D2H copy: %s", msg);
}

static TU_UNUSED void sync_default_stream(kvh_engine *e)
{
    char msg[256] = "";
    if (e->backend->stream_sync(e->backend_ctx, NULL, msg, sizeof(msg)) != 0)
        fail_msg("stream sync: %s", msg);
}

/* Points KVH_CUDA_BACKEND at <build>/libkvh_cuda.so (this program being
 * <build>/tests/c/NAME) unless it is set. */
static TU_UNUSED void set_backend_path(void)
{
    if (getenv("KVH_CUDA_BACKEND"))
        return;
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 32);
    if (n <= 0)
        return;
    exe[n] = 0;
    for (int up = 0; up < 3; up++) {
        char *slash = strrchr(exe, '/');
        if (!slash)
            return;
        *slash = 0;
    }
    strcat(exe, "/libkvh_cuda.so");
    setenv("KVH_CUDA_BACKEND", exe, 0);
}

/* 0 when an engine on the CUDA backend opens with config c (then closed
 * again), else 77, the exit status ctest reads as "skipped", after saying
 * why. */
static TU_UNUSED int cuda_usable_or_skip(const kvh_config *c)
{
    kvh_config cuda = *c;
    cuda.backend = KVH_BACKEND_CUDA;
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&cuda, &e);
    if (st != KVH_OK) {
        printf("SKIP: no usable CUDA backend: %s (%s)\n", kvh_status_name(st), kvh_last_error());
        return 77;
    }
    kvh_engine_close(e);
    return 0;
}

#endif
