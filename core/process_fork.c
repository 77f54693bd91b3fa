/* Counts fork()s in the children they make, so that an engine opened
 * before one can tell it is a copy in a child process (core/process_fork.h). */
#include "core/process_fork.h"

#include <pthread.h>
#include <stdatomic.h>

atomic_uint kvhi_forks_seen;
static pthread_once_t watch_once = PTHREAD_ONCE_INIT;

static void after_fork_in_child(void) { atomic_fetch_add_explicit(&kvhi_forks_seen, 1, memory_order_relaxed); }

static void start_watching(void) { (void)pthread_atfork(NULL, NULL, after_fork_in_child); }

void kvhi_fork_watch(void) { (void)pthread_once(&watch_once, start_watching); }
