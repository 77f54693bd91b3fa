/* Finds and loads libkvh_cuda.so at run time, so libkvh itself never links
 * CUDA and one build runs on machines without a GPU.
 *
 * Candidates, in order: $KVH_CUDA_BACKEND; libkvh_cuda.so beside the
 * libkvh.so that holds this code; libkvh_cuda.so beside the program
 * (the directory of /proc/self/exe, which is where a program linked with
 * the static libkvh.a finds it); libkvh_cuda.so.0 on the dynamic loader's
 * search path. When none loads, the message names every path tried and
 * why each failed. */
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/backend.h"

#define BACKEND_FILE "libkvh_cuda.so"

typedef struct {
    char *buf;
    size_t len, used;
} tried_list;

static void tried_add(tried_list *t, const char *what, const char *path, const char *why)
{
    if (t->used >= t->len)
        return;
    int n = snprintf(t->buf + t->used, t->len - t->used, "%s%s %s (%s)", t->used ? ", " : "", what, path, why);
    if (n > 0)
        t->used += (size_t)n < t->len - t->used ? (size_t)n : t->len - t->used - 1;
}

/* dlopen path; on failure records it in t with a short reason. */
static void *try_open(tried_list *t, const char *what, const char *path)
{
    if (strchr(path, '/') && access(path, F_OK) != 0) {
        tried_add(t, what, path, errno == ENOENT ? "absent" : strerror(errno));
        return NULL;
    }
    void *dl = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!dl) {
        const char *err = dlerror();
        /* dlerror repeats the path first: keep only what follows it. */
        const char *tail = err ? strstr(err, ": ") : NULL;
        tried_add(t, what, path, tail ? tail + 2 : err ? err : "dlopen failed");
    }
    return dl;
}

/* Writes into dir (PATH_MAX bytes) the canonical directory of path;
 * false when it has none. */
static bool dir_of(const char *path, char *dir)
{
    char real[PATH_MAX];
    if (!path || !strchr(path, '/') || !realpath(path, real))
        return false;
    char *slash = strrchr(real, '/');
    if (!slash)
        return false;
    *slash = 0;
    snprintf(dir, PATH_MAX, "%s", slash == real ? "/" : real);
    return true;
}

static void *open_in(tried_list *t, const char *what, const char *dir)
{
    char path[PATH_MAX + sizeof(BACKEND_FILE) + 1];
    snprintf(path, sizeof(path), "%s%s" BACKEND_FILE, dir, strcmp(dir, "/") ? "/" : "");
    return try_open(t, what, path);
}

const kvhi_backend_ops *kvhi_backend_cuda_load(int device, char *msg, size_t msg_len, void **dl_out)
{
    char tried_buf[640] = "";
    tried_list t = {tried_buf, sizeof(tried_buf), 0};
    void *dl = NULL;

    const char *env = secure_getenv("KVH_CUDA_BACKEND");
    if (env && *env)
        dl = try_open(&t, "$KVH_CUDA_BACKEND", env);

    char lib_dir[PATH_MAX], exe_dir[PATH_MAX];
    Dl_info info;
    bool have_lib = dladdr((void *)&kvhi_backend_cuda_load, &info) && dir_of(info.dli_fname, lib_dir);
    bool have_exe = false;
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n > 0) {
        exe[n] = 0;
        have_exe = dir_of(exe, exe_dir);
    }
    /* Linked statically, this code is in the program: one directory. */
    if (have_lib && have_exe && strcmp(lib_dir, exe_dir) == 0)
        have_lib = false;
    if (!dl && have_lib)
        dl = open_in(&t, "beside libkvh:", lib_dir);
    if (!dl && have_exe)
        dl = open_in(&t, "beside the program:", exe_dir);
    if (!dl)
        dl = try_open(&t, "on the loader's search path:", BACKEND_FILE ".0");
    if (!dl) {
        snprintf(msg, msg_len, "CUDA backend " BACKEND_FILE " not found; tried %s", tried_buf);
        return NULL;
    }
    kvhi_backend_entry_fn entry = (kvhi_backend_entry_fn)dlsym(dl, KVHI_BACKEND_ENTRY);
    const kvhi_backend_ops *ops = entry ? entry() : NULL;
    if (!ops || ops->abi_version != KVHI_BACKEND_ABI) {
        Dl_info where;
        const char *name = entry && dladdr((void *)entry, &where) && where.dli_fname ? where.dli_fname : BACKEND_FILE;
        if (!entry)
            snprintf(msg, msg_len, "CUDA backend %s has no " KVHI_BACKEND_ENTRY, name);
        else
            snprintf(msg, msg_len, "CUDA backend %s has a different backend ABI (want %u)", name, KVHI_BACKEND_ABI);
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
