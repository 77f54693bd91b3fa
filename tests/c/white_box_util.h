/* Helpers of the white-box tests, which reach into the engine's own
 * structures (core/engine.h) under its lock. */
#ifndef KVH_WHITE_BOX_UTIL_H
#define KVH_WHITE_BOX_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "kvh/kvh.h"

/* Takes and releases the engine lock. wb_lock shows the engine as the
 * next call would see it: block releases still in the backlog (core/block.h)
 * are applied. A failed assertion leaves the lock held;
 * wb_release_held_lock (from a test's teardown) lets it go, so that the
 * teardown can close the engine instead of hanging on it. */
void wb_lock(kvh_engine *e);
void wb_unlock(kvh_engine *e);
/* wb_lock without applying the backlog: for tests of the backlog itself. */
void wb_lock_as_is(kvh_engine *e);
/* Applies that backlog, for a test that reads the engine without the lock. */
void wb_settle(kvh_engine *e);
void wb_release_held_lock(void);

/* Fails the test unless the engine's list of blocks with disk copies
 * names exactly the blocks whose records say they have one. */
void wb_check_disk_copies(kvh_engine *e);

/* The record index of block handle h, and of logical block i of s. */
uint32_t wb_block_index(kvh_engine *e, kvh_block h);
uint32_t wb_seq_block_index(kvh_engine *e, kvh_seq s, uint64_t i);

/* The calling thread's id, for wb_wait_blocked_on. */
pid_t wb_thread_id(void);
/* Waits (10 s at most, then fails the test) until thread tid sleeps in a
 * futex wait on a word of [obj, obj + size), e.g. in pthread_cond_wait
 * on the condition variable obj: a test orders threads by what they are
 * waiting on instead of by sleeps (/proc/self/task/tid/syscall). */
void wb_wait_blocked_on(pid_t tid, const void *obj, size_t size);

#endif
