/* kvh-bench file-system helpers. Apart from bench_util.c (which needs
 * liburing) so that the test programs linking the trace replay can use
 * them too. */
#ifndef KVH_BENCH_FS_H
#define KVH_BENCH_FS_H

/* Removes path and everything below it, never following a link (no
 * shell: a path may hold any character). 0 when it is gone. */
int bench_remove_tree(const char *path);

#endif
