/* Helpers of the reliability battery (tests/c/test_rel_*.c). It builds on
 * disk_test_util.h (deterministic content, configs, engine tracking,
 * build / verify / match, scratch directories and files, child processes,
 * the durability oracle: the dt_ helpers) and adds what only the battery
 * needs. The functions live in rel_util.c, in the test library with
 * disk_test_util.c; the wrappers of the C library calls in rel_wrap.c,
 * which only the programs linked with the wrap options compile
 * (tests/c/CMakeLists.txt).
 *
 * Nothing here asserts unless its name ends in _a: the other helpers
 * return a status or a count so that they also run in fork()ed children
 * (which report through their exit code and must never longjmp into
 * cmocka's state).
 *
 *   Sizes: RL_SIZE(ci, stress) is `ci` in the normal build of a test and
 *   `stress` in its _stress.c twin (which defines REL_STRESS 1 and includes
 *   the test's source); dt_env_long(name, def) lets an environment variable
 *   override either.
 *
 *   Fast scratch: rl_fast_scratch gives a directory on a tmpfs, for tests
 *   that sync thousands of times; rl_teardown removes it.
 *
 *   Allocation failures: a test that defines RL_ALLOC_WRAP before including
 *   this header gets the controls of the __wrap_malloc / calloc / realloc /
 *   free / posix_memalign / strdup of rel_wrap.c (link it with
 *   -Wl,--wrap=...; see tests/c/CMakeLists.txt).
 *   rl_alloc_arm(n, persistent, this_thread_only) fails the n-th
 *   allocation (and, persistent, every later one); a chained hash of live
 *   pointers counts what the run leaked, in every build (LeakSanitizer
 *   checks the ASan build as well). The buffers of dt_extend, dt_verify,
 *   dt_match and dt_read_file come from the real allocator (dt_tmalloc)
 *   and never fail.
 *
 *   Short I/O: RL_IO_WRAP adds the controls of rel_wrap.c's __wrap_read /
 *   write / pread / pwrite (and io_uring_queue_init, so that the disk tier
 *   falls back to pread/pwrite while short I/O is armed):
 *   rl_shortio_arm(op, n, persistent) makes the n-th call transfer only
 *   part of what was asked.
 */
#ifndef KVH_REL_UTIL_H
#define KVH_REL_UTIL_H

#include "disk_test_util.h"

#include <stdatomic.h>

#ifndef REL_STRESS
#define REL_STRESS 0
#endif
#define RL_SIZE(ci, stress) (REL_STRESS ? (stress) : (ci))

/* A status this library documents (KVH_OK or a KVH_STATUS_LIST code). */
static inline bool rl_status_known(kvh_status st) { return st <= 0 && st >= KVH_ERR_INTERNAL; }

/* ---- counters ---- */

/* Counters that must add up at any quiet moment. Returns 0 or writes the
 * first broken rule into msg. live = blocks_allocated - blocks_freed. */
int rl_counters_add_up(kvh_engine *e, bool has_disk, char *msg, size_t len);

/* ---- fast scratch directories ---- */

/* Like dt_scratch, but on a tmpfs (/dev/shm, or $KVH_REL_FAST_DIR) when
 * there is one: fsync is free there, which matters for tests that sync
 * thousands of times and whose subject is not the device (kills keep the
 * page cache anyway). O_DIRECT is refused there, so the engine runs
 * buffered. Returns false (and gives an ordinary scratch dir) without one.
 * Remove it with dt_rmrf when done. */
bool rl_fast_scratch(const char *name, char *out, size_t len);

/* Removes what rl_fast_scratch made for process pid. */
void rl_fast_cleanup_pid(long pid);

/* Removes what rl_fast_scratch made for this process. */
void rl_fast_cleanup(void);

/* Closes what a failed test left open and removes its tmpfs scratch. */
int rl_teardown(void **state);

/* ---- memory use ---- */

/* Resident set size of this process, bytes (0 if unknown). */
uint64_t rl_rss_bytes(void);

/* ================================================================== */
/* Allocation failure injection (define RL_ALLOC_WRAP; rel_wrap.c)     */
/* ================================================================== */
#ifdef RL_ALLOC_WRAP

void *__real_malloc(size_t n);
void *__real_calloc(size_t n, size_t size);
void *__real_realloc(void *p, size_t n);
void __real_free(void *p);
int __real_posix_memalign(void **p, size_t align, size_t n);
char *__real_strdup(const char *s);

void *__wrap_malloc(size_t n);
void *__wrap_calloc(size_t n, size_t size);
void *__wrap_realloc(void *p, size_t n);
void __wrap_free(void *p);
int __wrap_posix_memalign(void **p, size_t align, size_t n);
char *__wrap_strdup(const char *s);

/* Live allocations made through the wrappers (and not freed); -1 when
 * there were too many to track. */
long rl_alloc_live(void);
uint64_t rl_alloc_live_bytes(void);

/* Fails allocation number n (1-based, counted from now) and, persistent,
 * every later one; n = 0 only counts. Only allocations on the calling
 * thread count when this_thread_only. */
void rl_alloc_arm(long n, bool persistent, bool this_thread_only);
void rl_alloc_disarm(void);
/* Allocations seen since rl_alloc_arm, and how many of them failed. */
long rl_alloc_count(void);
long rl_alloc_fired(void);

#endif /* RL_ALLOC_WRAP */

/* ================================================================== */
/* Short reads and writes (define RL_IO_WRAP; rel_wrap.c)              */
/* ================================================================== */
#ifdef RL_IO_WRAP

struct io_uring;
ssize_t __real_read(int fd, void *buf, size_t n);
ssize_t __real_write(int fd, const void *buf, size_t n);
ssize_t __real_pread(int fd, void *buf, size_t n, off_t off);
ssize_t __real_pwrite(int fd, const void *buf, size_t n, off_t off);
int __real_io_uring_queue_init(unsigned entries, struct io_uring *ring, unsigned flags);

ssize_t __wrap_read(int fd, void *buf, size_t n);
ssize_t __wrap_write(int fd, const void *buf, size_t n);
ssize_t __wrap_pread(int fd, void *buf, size_t n, off_t off);
ssize_t __wrap_pwrite(int fd, const void *buf, size_t n, off_t off);
int __wrap_io_uring_queue_init(unsigned entries, struct io_uring *ring, unsigned flags);

enum { RL_SIO_READ = 0, RL_SIO_WRITE = 1 };
/* The short-I/O state, read by the tests directly (count, fired) and set
 * through no_uring. */
typedef struct rl_shortio_state {
    atomic_int no_uring; /* io_uring_queue_init fails: lanes use pread/pwrite */
    atomic_int armed;
    int op; /* RL_SIO_READ (read, pread) or RL_SIO_WRITE (write, pwrite) */
    long nth;
    bool persistent;
    atomic_long count, fired;
} rl_shortio_state;
extern rl_shortio_state rl_sio;

/* Makes the nth read or write call of op (and, persistent, every later
 * one) transfer about half of what it was asked. */
void rl_shortio_arm(int op, long nth, bool persistent);
void rl_shortio_disarm(void);

#endif /* RL_IO_WRAP */

#endif
