#include "core/remote_hiredis.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>

#define KVHI_STR2(x) #x
#define KVHI_STR(x) KVHI_STR2(x)
/* libhiredis.so.0.14 for hiredis 0.14 (Debian 12's libhiredis0.14). */
#define KVHI_HIREDIS_LIB "libhiredis.so." KVHI_STR(HIREDIS_SONAME)

static pthread_once_t once = PTHREAD_ONCE_INIT;
static kvhi_hiredis calls;
static const kvhi_hiredis *loaded;
static const char *load_error = "hiredis was not loaded";

static void *sym(void *lib, const char *name, int *missing)
{
    void *p = dlsym(lib, name);
    *missing |= p == NULL;
    return p;
}

static void load(void)
{
    void *lib = dlopen(KVHI_HIREDIS_LIB, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        load_error = "cannot load " KVHI_HIREDIS_LIB " (Debian: libhiredis0.14): the remote tier needs it";
        return;
    }
    int missing = 0;
    /* POSIX lets dlsym's result be stored into a function pointer. */
    *(void **)&calls.connect_timeout = sym(lib, "redisConnectWithTimeout", &missing);
    *(void **)&calls.set_timeout = sym(lib, "redisSetTimeout", &missing);
    *(void **)&calls.free_ctx = sym(lib, "redisFree", &missing);
    *(void **)&calls.append_argv = sym(lib, "redisAppendCommandArgv", &missing);
    *(void **)&calls.get_reply = sym(lib, "redisGetReply", &missing);
    *(void **)&calls.buffer_write = sym(lib, "redisBufferWrite", &missing);
    *(void **)&calls.command_argv = sym(lib, "redisCommandArgv", &missing);
    *(void **)&calls.free_reply = sym(lib, "freeReplyObject", &missing);
    *(void **)&calls.reader_feed = sym(lib, "redisReaderFeed", &missing);
    *(void **)&calls.reader_get_reply = sym(lib, "redisReaderGetReply", &missing);
    if (missing) {
        load_error = KVHI_HIREDIS_LIB " lacks a call the remote tier uses";
        return;
    }
    loaded = &calls;
}

const kvhi_hiredis *kvhi_hiredis_get(const char **why)
{
    pthread_once(&once, load);
    if (!loaded && why)
        *why = load_error;
    return loaded;
}
