/* The cluster client of a libkvh built without hiredis's headers
 * (libhiredis-dev): every open fails with a message saying so, which the
 * remote tier answers with KVH_ERR_UNSUPPORTED (core/remote_tier.c), so
 * the rest of the library builds and works without a Redis client.
 * CMakeLists.txt compiles this file instead of remote_cluster.c and
 * remote_hiredis.c when the header is missing. */
#include "core/remote_cluster.h"

#include <stdio.h>
#include <stdlib.h>

int kvhi_cluster_open(const kvhi_cluster_opts *opts, kvhi_cluster **out, char *err, size_t err_len)
{
    (void)opts;
    *out = NULL;
    snprintf(err, err_len,
             "this libkvh was built without hiredis's headers (Debian: libhiredis-dev), so it "
             "has no remote tier");
    return KVHI_CLUSTER_NO_CLIENT;
}

/* A client is never opened, so nothing below is reached with one. */
/* Never used: no client opens. */
kvhi_breakers *kvhi_breakers_new(void) { return calloc(1, 1); }

void kvhi_breakers_free(kvhi_breakers *b) { free(b); }

void kvhi_cluster_close(kvhi_cluster *c) { (void)c; }

int32_t kvhi_cluster_seed_answered(const kvhi_cluster *c)
{
    (void)c;
    return -1;
}

uint32_t kvhi_cluster_take_breaker_opens(kvhi_cluster *c)
{
    (void)c;
    return 0;
}

void kvhi_cluster_run(kvhi_cluster *c, kvhi_cluster_cmd *cmds, size_t n, kvhi_cluster_report *rep)
{
    (void)c;
    (void)rep;
    for (size_t i = 0; i < n; i++)
        cmds[i].result = KVHI_CMD_FAILED;
}

uint64_t kvhi_cluster_deadline(const kvhi_cluster *c)
{
    (void)c;
    return 0;
}

void kvhi_cluster_run_strings(kvhi_cluster *c, kvhi_cluster_cmd *cmds, size_t n, kvhi_cluster_report *rep,
                              kvhi_cluster_string_fn on_string, void *user, uint64_t deadline)
{
    (void)on_string;
    (void)user;
    (void)deadline;
    kvhi_cluster_run(c, cmds, n, rep);
}

void kvhi_cluster_time_out(kvhi_cluster_cmd *cmds, size_t n, kvhi_cluster_report *rep)
{
    (void)rep;
    for (size_t i = 0; i < n; i++)
        cmds[i].result = KVHI_CMD_TIMEOUT;
}

int kvhi_cluster_reply(const kvhi_cluster_cmd *cmd, const char **str, size_t *len, long long *integer)
{
    (void)cmd;
    (void)str;
    (void)len;
    (void)integer;
    return KVHI_REPLY_NONE;
}

void kvhi_cluster_cmds_clear(kvhi_cluster *c, kvhi_cluster_cmd *cmds, size_t n)
{
    (void)c;
    (void)cmds;
    (void)n;
}

int kvhi_cluster_scan(kvhi_cluster *c, const char *prefix, kvhi_cluster_key_fn fn, void *user, char *err,
                      size_t err_len)
{
    (void)c;
    (void)prefix;
    (void)fn;
    (void)user;
    snprintf(err, err_len, "no remote tier in this build");
    return -1;
}

void kvhi_cluster_health(kvhi_cluster *c, uint32_t *answering, uint32_t *known)
{
    (void)c;
    *answering = 0;
    *known = 0;
}
