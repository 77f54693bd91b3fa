/* A stand-in for libkvh_cuda.so (test_backend_loader): a backend table of
 * the right ABI whose probe refuses, naming the file it was loaded from,
 * so a test sees which candidate the loader took. */
#include <dlfcn.h>
#include <stdio.h>

#include "core/backend.h"

static int fake_probe(int device, char *msg, size_t msg_len)
{
    Dl_info info;
    const char *where = dladdr((void *)&fake_probe, &info) && info.dli_fname ? info.dli_fname : "?";
    snprintf(msg, msg_len, "fake backend %s: no device %d", where, device);
    return -1;
}

static const kvhi_backend_ops fake_ops = {.abi_version = KVHI_BACKEND_ABI, .name = "cuda", .probe = fake_probe};

__attribute__((visibility("default"))) const kvhi_backend_ops *kvh_backend_cuda_entry(void);

const kvhi_backend_ops *kvh_backend_cuda_entry(void) { return &fake_ops; }
