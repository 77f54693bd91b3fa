/* hiredis, loaded when the remote tier is first opened
 * (core/remote_hiredis.c), so that libkvh needs no Redis client to load
 * or link, and a program without a remote tier never maps one. The
 * library loaded is the one whose header kvh was built against (the same
 * soname): reply structs differ between hiredis versions. */
#ifndef KVH_CORE_REMOTE_HIREDIS_H
#define KVH_CORE_REMOTE_HIREDIS_H

#include <hiredis/hiredis.h>

typedef struct kvhi_hiredis {
    redisContext *(*connect_timeout)(const char *ip, int port, const struct timeval tv);
    int (*set_timeout)(redisContext *c, const struct timeval tv);
    void (*free_ctx)(redisContext *c);
    int (*append_argv)(redisContext *c, int argc, const char **argv, const size_t *argvlen);
    int (*get_reply)(redisContext *c, void **reply);
    int (*buffer_write)(redisContext *c, int *done);
    void *(*command_argv)(redisContext *c, int argc, const char **argv, const size_t *argvlen);
    void (*free_reply)(void *reply);
    /* A context's replies are read through these, so that the client
     * waits on its socket itself, within a deadline. */
    int (*reader_feed)(redisReader *r, const char *buf, size_t len);
    int (*reader_get_reply)(redisReader *r, void **reply);
} kvhi_hiredis;

/* The loaded library's calls, or NULL with a reason in *why (static text
 * or a dlerror message). Loaded once per process, never unloaded. */
const kvhi_hiredis *kvhi_hiredis_get(const char **why);

#endif
