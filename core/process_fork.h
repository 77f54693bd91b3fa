/* An engine in a child process (core/process_fork.c): fork() copies the
 * engine's memory but not its worker threads, and leaves its locks as the
 * parent's threads held them, so a child can neither use nor close it. */
#ifndef KVH_CORE_PROCESS_FORK_H
#define KVH_CORE_PROCESS_FORK_H

#include <stdatomic.h>
#include <stdint.h>

extern atomic_uint kvhi_forks_seen;
/* How many times this process's lineage forked since the first engine
 * opened (watching starts then). Inline: every call into an engine reads
 * it. */
static inline uint32_t kvhi_fork_generation(void)
{
    return atomic_load_explicit(&kvhi_forks_seen, memory_order_relaxed);
}
/* Starts counting forks (idempotent; engine open calls it). */
void kvhi_fork_watch(void);

#endif
