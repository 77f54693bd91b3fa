/* kvh-bench file-system helpers. Apart from bench_util.c (which needs
 * liburing) so that the test programs linking the trace replay can use
 * them too. */
#ifndef KVH_BENCH_FS_H
#define KVH_BENCH_FS_H

/* Removes path and everything below it, never following a link (no
 * shell: a path may hold any character). 0 when it is gone. */
int bench_remove_tree(const char *path);

/* A flat scratch directory to remove if SIGINT, SIGTERM or SIGHUP ends
 * the program (bench_scratch_on_signals): its slot, or -1 when none is
 * free. bench_scratch_drop(slot) once it is removed or kept. */
int bench_scratch_add(const char *path);
void bench_scratch_drop(int slot);
/* Installs the handler that removes the scratch directories, then dies
 * of the signal; a signal the caller ignores stays ignored. */
void bench_scratch_on_signals(void);

#endif
