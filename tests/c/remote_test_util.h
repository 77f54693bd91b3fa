/* Redis servers for the remote-tier tests and benchmark
 * (tests/c/remote_test_util.c): started on free loopback ports in a
 * scratch directory, as one node or as a Redis Cluster of several, and
 * stopped by rt_stop, by an atexit handler, or by the kernel when the
 * test process dies (PR_SET_PDEATHSIG), so none outlives its test.
 *
 *   rt_available()            redis-server and redis-cli are installed
 *   rt_start(c, n, pw, dir)   n nodes (n > 1: a cluster, slots spread by
 *                             redis-cli --cluster create); pw may be NULL
 *   rt_addrs(c)               "127.0.0.1:p1,127.0.0.1:p2,..."
 *   rt_kill / rt_restart      SIGKILL one node / start it again (its data
 *                             comes back from its append-only file)
 *   rt_cli(c, node, fmt, ...) runs redis-cli against a node (cluster mode,
 *                             following redirects), output into out
 */
#ifndef KVH_TESTS_REMOTE_TEST_UTIL_H
#define KVH_TESTS_REMOTE_TEST_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#define RT_MAX_NODES 6

typedef struct rt_cluster {
    int n;
    int ports[RT_MAX_NODES];
    pid_t pids[RT_MAX_NODES];
    char dir[512];
    char password[64];
    char addrs[256];
} rt_cluster;

bool rt_available(void);
/* 0, or -1 with a message on stderr. dir: scratch directory (created). */
int rt_start(rt_cluster *c, int n, const char *password, const char *dir);
/* rt_start in the tests' scratch directory: $KVH_TEST_TMPDIR/redis (or /tmp/redis). */
int rt_start_scratch(rt_cluster *c, int n, const char *password);
void rt_stop(rt_cluster *c);
const char *rt_addrs(const rt_cluster *c);
void rt_kill(rt_cluster *c, int node);
int rt_restart(rt_cluster *c, int node);
/* Waits until every live node reports cluster_state:ok (or the single
 * node answers PING); 0 or -1 after timeout_ms. */
int rt_wait_ok(rt_cluster *c, int timeout_ms);
/* Runs `redis-cli -c -p <port of node> [-a pw] <args>`; its first line of
 * output (trimmed) into out. Returns the exit status. */
int rt_cli(rt_cluster *c, int node, char *out, size_t out_len, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

#endif
