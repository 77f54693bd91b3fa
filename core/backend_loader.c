/* Finds and loads libkvh_cuda.so at run time, so libkvh itself never links
 * CUDA and one build runs on machines without a GPU. */
#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/backend.h"

static void *open_beside_self(void)
{
    /* Prefer the backend installed next to this library. */
    Dl_info info;
    if (dladdr((void *)&kvhi_backend_cuda_load, &info) && info.dli_fname) {
        char path[PATH_MAX];
        snprintf(path, sizeof(path), "%s", info.dli_fname);
        char *slash = strrchr(path, '/');
        if (slash) {
            snprintf(slash + 1, sizeof(path) - (size_t)(slash + 1 - path), "libkvh_cuda.so");
            void *dl = dlopen(path, RTLD_NOW | RTLD_LOCAL);
            if (dl)
                return dl;
        }
    }
    return NULL;
}

const kvhi_backend_ops *kvhi_backend_cuda_load(int device, char *msg, size_t msg_len, void **dl_out)
{
    const char *env = getenv("KVH_CUDA_BACKEND");
    void *dl = env && *env ? dlopen(env, RTLD_NOW | RTLD_LOCAL) : NULL;
    if (!dl)
        dl = open_beside_self();
    if (!dl)
        dl = dlopen("libkvh_cuda.so.0", RTLD_NOW | RTLD_LOCAL);
    if (!dl) {
        snprintf(msg, msg_len, "CUDA backend libkvh_cuda.so not found (%s)", dlerror());
        return NULL;
    }
    kvhi_backend_entry_fn entry = (kvhi_backend_entry_fn)dlsym(dl, KVHI_BACKEND_ENTRY);
    const kvhi_backend_ops *ops = entry ? entry() : NULL;
    if (!ops || ops->abi_version != KVHI_BACKEND_ABI) {
        snprintf(msg, msg_len, "CUDA backend has a different backend ABI");
        dlclose(dl);
        return NULL;
    }
    if (ops->probe(device, msg, msg_len) != 0) {
        dlclose(dl);
        return NULL;
    }
    *dl_out = dl;
    return ops;
}

void kvhi_backend_cuda_unload(void *dl)
{
    if (dl)
        dlclose(dl);
}
