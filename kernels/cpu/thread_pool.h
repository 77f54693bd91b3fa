/* A small persistent thread pool for the CPU attention kernels: one per
 * engine, made on first use, stopped by engine close. A run hands the same
 * function to `participants` threads (the caller is participant 0) and
 * returns when all of them have returned; the function shares out its
 * work itself (an atomic counter). Runs from several threads at once are
 * serialised by the caller (kvhi_attn_cpu's run lock). */
#ifndef KVH_KERNELS_CPU_THREAD_POOL_H
#define KVH_KERNELS_CPU_THREAD_POOL_H

#include <stdint.h>

typedef struct kvhi_pool kvhi_pool;
typedef void (*kvhi_pool_fn)(void *arg, uint32_t participant);

/* A pool of `workers` threads (besides the caller). NULL on failure. */
kvhi_pool *kvhi_pool_create(uint32_t workers);
/* Stops and joins the workers; NULL accepted. No run may be active. */
void kvhi_pool_destroy(kvhi_pool *pool);
uint32_t kvhi_pool_workers(const kvhi_pool *pool);
/* Calls fn(arg, i) for i in [0, participants) on distinct threads, i = 0
 * on the caller; participants is capped at workers + 1. */
void kvhi_pool_run(kvhi_pool *pool, uint32_t participants, kvhi_pool_fn fn, void *arg);
/* CPUs this process may run on (sched_getaffinity), at least 1. */
uint32_t kvhi_cpu_count(void);

#endif
