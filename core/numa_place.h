/* Placement on one NUMA node (kvh_config.numa_node) without libnuma's
 * allocating helpers: numa_run_on_node and numa_tonode_memory allocate
 * bitmasks and exit the process, or dereference NULL, when an allocation
 * fails, and a migration worker has no status to return. The node's CPUs
 * are read from sysfs once at open; workers only set their affinity, and
 * tier memory is bound with the mbind system call. */
#ifndef KVH_CORE_NUMA_PLACE_H
#define KVH_CORE_NUMA_PLACE_H

#include <sched.h>
#include <stdbool.h>
#include <stddef.h>

/* Parses a sysfs CPU list ("0-3,8-11", newline-terminated or not) into
 * cpus; false when it is malformed or names no CPU (CPUs past CPU_SETSIZE
 * are left out). */
bool kvhi_cpulist_parse(const char *list, cpu_set_t *cpus);
/* The CPUs of node (its sysfs cpulist); false when it cannot be read or
 * names none. Allocates nothing. */
bool kvhi_numa_node_cpus(int node, cpu_set_t *cpus);
/* Binds [p, p + bytes) (page-aligned) to node; a refusal leaves the
 * memory where the kernel puts it, as before a binding. */
void kvhi_numa_bind(void *p, size_t bytes, int node);

#endif
