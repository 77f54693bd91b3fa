/* Host names to numeric addresses within a time budget (core/name_resolve.c).
 *
 * getaddrinfo has no timeout: a slow or unreachable DNS server holds the
 * caller for the resolver's own retries (seconds per server), and the
 * remote tier connects with its client lock held. Here the lookup runs
 * on a short-lived thread of its own; the caller waits at most its budget
 * and then goes on, and the thread frees what it used when the lookup
 * ends. */
#ifndef KVH_CORE_NAME_RESOLVE_H
#define KVH_CORE_NAME_RESOLVE_H

#include <stddef.h>
#include <stdint.h>

struct addrinfo;

#define KVHI_RESOLVE_MAX 8       /* addresses kept, in getaddrinfo's order */
#define KVHI_RESOLVE_ADDR_LEN 46 /* INET6_ADDRSTRLEN */

typedef struct kvhi_resolved {
    uint32_t n;
    char addr[KVHI_RESOLVE_MAX][KVHI_RESOLVE_ADDR_LEN];
} kvhi_resolved;

/* The lookup function: getaddrinfo, which tests replace to stand for a
 * slow or failing DNS server. Set it only while no lookup runs. */
typedef int (*kvhi_getaddrinfo_fn)(const char *node, const char *service, const struct addrinfo *hints,
                                   struct addrinfo **res);
extern kvhi_getaddrinfo_fn kvhi_resolver_getaddrinfo;

/* The numeric addresses of host (a numeric address is its own, with no
 * lookup), waiting at most budget_ns. 0: out holds at least one; -1: the
 * name has no address or the lookup failed (err says why); -3: no answer
 * within the budget. */
int kvhi_resolve_numeric(const char *host, uint64_t budget_ns, kvhi_resolved *out, char *err, size_t err_len);

#endif
