#include "remote_test_util.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static rt_cluster *live[8];

static void stop_all_at_exit(void)
{
    for (int i = 0; i < 8; i++)
        if (live[i])
            rt_stop(live[i]);
}

bool rt_available(void)
{
    return system("command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1") == 0;
}

static bool port_free(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        return false;
    struct sockaddr_in a = {
        .sin_family = AF_INET, .sin_port = htons((uint16_t)port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    bool ok = bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0;
    close(fd);
    return ok;
}

/* A port whose cluster bus port (+10000) is free too. */
static int pick_port(const rt_cluster *c)
{
    unsigned seed = (unsigned)getpid() ^ (unsigned)time(NULL);
    for (int tries = 0; tries < 1000; tries++) {
        int port = 20000 + (int)(rand_r(&seed) % 20000);
        bool taken = false;
        for (int i = 0; i < c->n; i++)
            taken |= c->ports[i] == port || c->ports[i] + 10000 == port || c->ports[i] == port + 10000;
        if (!taken && port_free(port) && port_free(port + 10000))
            return port;
    }
    return -1;
}

static pid_t spawn_node(rt_cluster *c, int i)
{
    char port[16], conf[600], dir[600];
    snprintf(port, sizeof(port), "%d", c->ports[i]);
    snprintf(dir, sizeof(dir), "%s/node%d", c->dir, i);
    mkdir(dir, 0700);
    snprintf(conf, sizeof(conf), "nodes-%d.conf", c->ports[i]);
    pid_t pid = fork();
    if (pid != 0)
        return pid;
    /* The server dies with the test, however the test ends. */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    int null = open("/dev/null", O_WRONLY);
    if (null >= 0) {
        dup2(null, 1);
        dup2(null, 2);
    }
    const char *argv[40];
    int k = 0;
    argv[k++] = "redis-server";
    argv[k++] = "--port";
    argv[k++] = port;
    argv[k++] = "--bind";
    argv[k++] = "127.0.0.1";
    argv[k++] = "--dir";
    argv[k++] = dir;
    argv[k++] = "--save";
    argv[k++] = "";
    /* Keys survive a kill: the node-restart test expects them back. */
    argv[k++] = "--appendonly";
    argv[k++] = "yes";
    argv[k++] = "--appendfsync";
    argv[k++] = "always";
    argv[k++] = "--protected-mode";
    argv[k++] = "no";
    if (c->n > 1) {
        argv[k++] = "--cluster-enabled";
        argv[k++] = "yes";
        argv[k++] = "--cluster-config-file";
        argv[k++] = conf;
        argv[k++] = "--cluster-node-timeout";
        argv[k++] = "2000";
        /* A node's slots stay served while another is down. */
        argv[k++] = "--cluster-require-full-coverage";
        argv[k++] = "no";
    }
    if (c->password[0]) {
        argv[k++] = "--requirepass";
        argv[k++] = c->password;
        argv[k++] = "--masterauth";
        argv[k++] = c->password;
    }
    argv[k] = NULL;
    execvp("redis-server", (char *const *)argv);
    _exit(127);
}

int rt_cli(rt_cluster *c, int node, char *out, size_t out_len, const char *fmt, ...)
{
    char args[2048], cmd[2600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof(args), fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof(cmd), "redis-cli %s -p %d %s%s%s --no-auth-warning %s 2>&1", c->n > 1 ? "-c" : "",
             c->ports[node], c->password[0] ? "-a '" : "", c->password, c->password[0] ? "'" : "", args);
    FILE *p = popen(cmd, "r");
    if (!p)
        return -1;
    char line[1024] = "";
    if (!fgets(line, sizeof(line), p))
        line[0] = '\0';
    char sink[1024];
    while (fgets(sink, sizeof(sink), p))
        ;
    int rc = pclose(p);
    line[strcspn(line, "\r\n")] = '\0';
    if (out)
        snprintf(out, out_len, "%s", line);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static int wait_ping(rt_cluster *c, int i, int timeout_ms)
{
    for (int t = 0; t < timeout_ms; t += 50) {
        char out[256];
        if (rt_cli(c, i, out, sizeof(out), "PING") == 0 && strcmp(out, "PONG") == 0)
            return 0;
        sleep_ms(50);
    }
    return -1;
}

int rt_wait_ok(rt_cluster *c, int timeout_ms)
{
    for (int t = 0; t < timeout_ms; t += 100) {
        bool all = true;
        for (int i = 0; i < c->n && all; i++) {
            if (c->pids[i] <= 0)
                continue;
            char out[256];
            if (c->n == 1)
                all = rt_cli(c, i, out, sizeof(out), "PING") == 0 && strcmp(out, "PONG") == 0;
            else
                all = rt_cli(c, i, out, sizeof(out), "CLUSTER INFO") == 0 && strcmp(out, "cluster_state:ok") == 0;
        }
        if (all)
            return 0;
        sleep_ms(100);
    }
    return -1;
}

int rt_start(rt_cluster *c, int n, const char *password, const char *dir)
{
    memset(c, 0, sizeof(*c));
    if (n < 1 || n > RT_MAX_NODES)
        return -1;
    snprintf(c->dir, sizeof(c->dir), "%s", dir);
    /* A fresh directory: a node with an earlier run's keys or cluster
     * state would not join a new cluster. */
    char rm[600];
    snprintf(rm, sizeof(rm), "rm -rf '%s'", dir);
    if (strchr(dir, '\'') || system(rm) != 0)
        return -1;
    mkdir(dir, 0700);
    if (password)
        snprintf(c->password, sizeof(c->password), "%s", password);
    static bool hooked;
    if (!hooked) {
        atexit(stop_all_at_exit);
        hooked = true;
    }
    for (int i = 0; i < 8; i++)
        if (!live[i]) {
            live[i] = c;
            break;
        }
    for (int i = 0; i < n; i++) {
        c->n = i;
        c->ports[i] = pick_port(c);
        c->n = i + 1;
        if (c->ports[i] < 0) {
            fprintf(stderr, "rt_start: no free port\n");
            rt_stop(c);
            return -1;
        }
        c->n = n; /* spawn_node looks at it for cluster mode */
        c->pids[i] = spawn_node(c, i);
        c->n = i + 1;
    }
    c->n = n;
    size_t at = 0;
    for (int i = 0; i < n; i++)
        at += (size_t)snprintf(c->addrs + at, sizeof(c->addrs) - at, "%s127.0.0.1:%d", i ? "," : "", c->ports[i]);
    for (int i = 0; i < n; i++)
        if (wait_ping(c, i, 10000) != 0) {
            fprintf(stderr, "rt_start: redis-server on port %d does not answer\n", c->ports[i]);
            rt_stop(c);
            return -1;
        }
    if (n > 1) {
        char nodes[256] = "", out[256];
        size_t k = 0;
        for (int i = 0; i < n; i++)
            k += (size_t)snprintf(nodes + k, sizeof(nodes) - k, " 127.0.0.1:%d", c->ports[i]);
        if (rt_cli(c, 0, out, sizeof(out), "--cluster create%s --cluster-yes", nodes) != 0 ||
            rt_wait_ok(c, 20000) != 0) {
            fprintf(stderr, "rt_start: the cluster did not form (%s)\n", out);
            rt_stop(c);
            return -1;
        }
    }
    return 0;
}

void rt_kill(rt_cluster *c, int node)
{
    if (c->pids[node] > 0) {
        kill(c->pids[node], SIGKILL);
        waitpid(c->pids[node], NULL, 0);
    }
    c->pids[node] = 0;
}

int rt_restart(rt_cluster *c, int node)
{
    rt_kill(c, node);
    c->pids[node] = spawn_node(c, node);
    return wait_ping(c, node, 10000);
}

void rt_stop(rt_cluster *c)
{
    for (int i = 0; i < c->n; i++)
        if (c->pids[i] > 0) {
            kill(c->pids[i], SIGTERM);
            int st;
            for (int t = 0; t < 100 && waitpid(c->pids[i], &st, WNOHANG) == 0; t++)
                sleep_ms(20);
            kill(c->pids[i], SIGKILL);
            waitpid(c->pids[i], NULL, 0);
            c->pids[i] = 0;
        }
    for (int i = 0; i < 8; i++)
        if (live[i] == c)
            live[i] = NULL;
    c->n = 0;
}

const char *rt_addrs(const rt_cluster *c) { return c->addrs; }

int rt_start_scratch(rt_cluster *c, int n, const char *password)
{
    const char *tmp = getenv("KVH_TEST_TMPDIR");
    char dir[512];
    snprintf(dir, sizeof(dir), "%s/redis", tmp ? tmp : "/tmp");
    return rt_start(c, n, password, dir);
}
