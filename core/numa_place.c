/* NUMA placement through sysfs and the mbind system call (numa_place.h). */
#include "core/numa_place.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

/* linux/mempolicy.h's MPOL_BIND: allocate on these nodes only. */
#define KVHI_MPOL_BIND 2
/* Nodes a mask covers here; a node beyond is not bound. */
#define KVHI_MASK_NODES 1024

bool kvhi_numa_node_cpus(int node, cpu_set_t *cpus)
{
    char path[64], list[4096];
    snprintf(path, sizeof(path), "/sys/devices/system/node/node%d/cpulist", node);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return false;
    ssize_t n = read(fd, list, sizeof(list) - 1);
    close(fd);
    if (n <= 0)
        return false;
    list[n] = '\0';
    return kvhi_cpulist_parse(list, cpus);
}

bool kvhi_cpulist_parse(const char *list, cpu_set_t *cpus)
{
    CPU_ZERO(cpus);
    /* "0-3,8-11\n": ranges and single CPUs, comma-separated */
    for (const char *at = list; *at && *at != '\n';) {
        char *end;
        if (*at < '0' || *at > '9') /* strtoul would take a sign or spaces */
            return false;
        unsigned long lo = strtoul(at, &end, 10), hi = lo;
        if (*end == '-') {
            at = end + 1;
            if (*at < '0' || *at > '9')
                return false;
            hi = strtoul(at, &end, 10);
            if (end == at || hi < lo)
                return false;
        }
        for (unsigned long c = lo; c <= hi && c < CPU_SETSIZE; c++)
            CPU_SET(c, cpus);
        if (*end != ',' && *end != '\n' && *end != '\0')
            return false;
        at = *end == ',' ? end + 1 : end;
    }
    return CPU_COUNT(cpus) > 0;
}

void kvhi_numa_bind(void *p, size_t bytes, int node)
{
    enum { BITS = 8 * sizeof(unsigned long) };
    if (node < 0 || node >= KVHI_MASK_NODES || !p || !bytes)
        return;
    unsigned long mask[KVHI_MASK_NODES / BITS] = {0};
    mask[node / BITS] = 1ul << (node % BITS);
    (void)syscall(SYS_mbind, p, bytes, KVHI_MPOL_BIND, mask, (unsigned long)KVHI_MASK_NODES + 1, 0u);
}
