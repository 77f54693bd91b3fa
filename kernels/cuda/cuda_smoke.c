/* Smoke test of libkvh_cuda.so through its backend table, the way libkvh
 * uses it: dlopen, entry symbol, probe, then allocations and copies from
 * several threads at once with the data checked. Exits 0 on success, 77
 * (skipped) when probe finds no usable device, 1 on failure.
 *
 *   cmake --build BUILD --target kvh_cuda_smoke && BUILD/kernels/cuda/kvh_cuda_smoke BUILD/libkvh_cuda.so
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/backend.h"

#define THREADS 8
#define CHUNK (4u << 20) /* bytes per thread */
#define ROUNDS 16

static const kvhi_backend_ops *ops;
static void *ctx;
static unsigned char *dev;  /* THREADS * CHUNK * 2: a source and a copy each */
static unsigned char *host; /* THREADS * CHUNK * 2 page-locked */

static int check(int rc, const char *what, const char *msg)
{
    if (rc != 0)
        fprintf(stderr, "FAIL %s: %s\n", what, msg);
    return rc != 0;
}

static void *worker(void *arg)
{
    size_t t = (size_t)arg;
    unsigned char *d_src = dev + t * 2 * CHUNK, *d_dst = d_src + CHUNK;
    unsigned char *h_src = host + t * 2 * CHUNK, *h_dst = h_src + CHUNK;
    char msg[256];
    for (int r = 0; r < ROUNDS; r++) {
        for (size_t i = 0; i < CHUNK; i++)
            h_src[i] = (unsigned char)(i * 31 + t * 7 + r);
        memset(h_dst, 0, CHUNK);
        if (check(ops->copy(ctx, d_src, h_src, CHUNK, KVHI_COPY_HOST_TO_DEVICE, msg, sizeof msg), "H2D", msg) ||
            check(ops->copy(ctx, d_dst, d_src, CHUNK, KVHI_COPY_DEVICE_TO_DEVICE, msg, sizeof msg), "D2D", msg) ||
            check(ops->copy(ctx, h_dst, d_dst, CHUNK, KVHI_COPY_DEVICE_TO_HOST, msg, sizeof msg), "D2H", msg))
            return (void *)1;
        if (memcmp(h_src, h_dst, CHUNK) != 0) {
            fprintf(stderr, "FAIL thread %zu round %d: data differs\n", t, r);
            return (void *)1;
        }
        /* 2-D: gather every other 256-byte row of h_src into d_dst, back. */
        memset(h_dst, 0, CHUNK);
        size_t w = 256, h = CHUNK / 512;
        if (check(ops->copy_2d(ctx, d_dst, w, h_src, 2 * w, w, h, KVHI_COPY_HOST_TO_DEVICE, msg, sizeof msg), "2D H2D",
                  msg) ||
            check(ops->copy_2d(ctx, h_dst, 2 * w, d_dst, w, w, h, KVHI_COPY_DEVICE_TO_HOST, msg, sizeof msg), "2D D2H",
                  msg))
            return (void *)1;
        for (size_t row = 0; row < h; row++)
            if (memcmp(h_dst + row * 2 * w, h_src + row * 2 * w, w) != 0) {
                fprintf(stderr, "FAIL thread %zu round %d: 2-D row %zu differs\n", t, r, row);
                return (void *)1;
            }
    }
    return NULL;
}

int main(int argc, char **argv)
{
    const char *path = argc > 1 ? argv[1] : "libkvh_cuda.so";
    void *dl = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!dl) {
        fprintf(stderr, "FAIL dlopen: %s\n", dlerror());
        return 1;
    }
    kvhi_backend_entry_fn entry = (kvhi_backend_entry_fn)dlsym(dl, KVHI_BACKEND_ENTRY);
    ops = entry ? entry() : NULL;
    if (!ops || ops->abi_version != KVHI_BACKEND_ABI || strcmp(ops->name, "cuda") != 0) {
        fprintf(stderr, "FAIL entry symbol or ABI\n");
        return 1;
    }
    char msg[256] = "";
    if (ops->probe(0, msg, sizeof msg) != 0) {
        printf("SKIP probe: %s\n", msg);
        return msg[0] ? 77 : 1; /* a failed probe must say why */
    }
    if (ops->probe(1 << 20, msg, sizeof msg) == 0 || !msg[0]) {
        fprintf(stderr, "FAIL probe of a missing device succeeded or said nothing\n");
        return 1;
    }
    ctx = ops->context_create(0, msg, sizeof msg);
    if (!ctx)
        return check(-1, "context_create", msg);
    dev = ops->device_alloc(ctx, (size_t)THREADS * 2 * CHUNK);
    host = ops->host_alloc(ctx, (size_t)THREADS * 2 * CHUNK);
    if (!dev || !host) {
        fprintf(stderr, "FAIL device_alloc %p / host_alloc %p\n", (void *)dev, (void *)host);
        return 1;
    }
    int failed = 0;
    pthread_t th[THREADS];
    for (size_t t = 0; t < THREADS; t++)
        pthread_create(&th[t], NULL, worker, (void *)t);
    for (size_t t = 0; t < THREADS; t++) {
        void *ret;
        pthread_join(th[t], &ret);
        failed |= ret != NULL;
    }
    /* Errors come back as -1 with the CUDA message, and do not poison later
     * calls: a pitch below the width is invalid. */
    msg[0] = 0;
    if (ops->copy_2d(ctx, dev, 8, host, 16, 16, 4, KVHI_COPY_HOST_TO_DEVICE, msg, sizeof msg) != -1 || !msg[0]) {
        fprintf(stderr, "FAIL bad pitch was accepted\n");
        failed = 1;
    } else {
        printf("bad pitch -> %s\n", msg);
    }
    failed |= check(ops->copy(ctx, dev, host, 64, KVHI_COPY_HOST_TO_DEVICE, msg, sizeof msg), "copy after error", msg);
    ops->device_free(ctx, dev, (size_t)THREADS * 2 * CHUNK);
    ops->host_free(ctx, host, (size_t)THREADS * 2 * CHUNK);
    ops->context_destroy(ctx);
    dlclose(dl);
    printf("%s\n", failed ? "FAIL" : "OK");
    return failed;
}
