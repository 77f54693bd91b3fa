/* kvh-bench file-system helpers. Apart from bench_util.c (which needs
 * liburing) so that the test programs linking the trace replay can use
 * them too. */
#ifndef KVH_BENCH_FS_H
#define KVH_BENCH_FS_H

#include <stddef.h>
#include <sys/types.h>

/* Removes path and everything below it, never following a link (no
 * shell: a path may hold any character). 0 when it is gone. */
int bench_remove_tree(const char *path);

/* A scratch file or directory (up to four levels deep) to remove if
 * SIGINT, SIGTERM, SIGHUP or SIGPIPE ends the program
 * (bench_scratch_on_signals): its slot, or -1 when none is free.
 * bench_scratch_drop(slot) once it is removed or kept. */
int bench_scratch_add(const char *path);
void bench_scratch_drop(int slot);
/* A child process (fio, a server) to kill first on those signals, with
 * the process group it leads if it leads one: its slot, or -1;
 * bench_child_drop(slot) once it has been waited for. */
int bench_child_add(pid_t pid);
void bench_child_drop(int slot);
/* Installs the handler that stops the children and removes the scratch,
 * then dies of the signal; a signal the caller ignores stays ignored. */
void bench_scratch_on_signals(void);

/* 0 when dir may hold a scratch directory: a directory of the caller's
 * (or root's), not writable by others unless sticky. Else -1 and why. */
int bench_dir_check(const char *dir, char *why, size_t why_len);

/* A new scratch directory of its own under parent (checked as above),
 * named prefix-XXXXXX, in out; removed if a signal ends the program.
 * Returns its scratch slot (>= -1), or with why: BENCH_DIR_UNFIT when
 * parent is not fit for it (missing, not a directory, unsafe, a path too
 * long: the caller's argument is wrong), BENCH_DIR_FAILED when it could
 * not be made there. */
enum { BENCH_DIR_UNFIT = -2, BENCH_DIR_FAILED = -3 };
int bench_scratch_dir_make(const char *parent, const char *prefix, char *out, size_t out_len, char *why,
                           size_t why_len);
/* Removes it and forgets it: 0 when it is gone. */
int bench_scratch_dir_remove(const char *path, int slot);

#endif
