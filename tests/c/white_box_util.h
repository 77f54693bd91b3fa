/* Helpers of the white-box tests, which reach into the engine's own
 * structures (core/engine.h) under its lock. */
#ifndef KVH_WHITE_BOX_UTIL_H
#define KVH_WHITE_BOX_UTIL_H

#include <stdint.h>

#include "kvh/kvh.h"

/* Takes and releases the engine lock. wb_lock shows the engine as the
 * next call would see it: block releases still in the backlog (core/block.h)
 * are applied. A failed assertion leaves the lock held;
 * wb_release_held_lock (from a test's teardown) lets it go, so that the
 * teardown can close the engine instead of hanging on it. */
void wb_lock(kvh_engine *e);
void wb_unlock(kvh_engine *e);
/* Applies that backlog, for a test that reads the engine without the lock. */
void wb_settle(kvh_engine *e);
void wb_release_held_lock(void);

/* The record index of block handle h, and of logical block i of s. */
uint32_t wb_block_index(kvh_engine *e, kvh_block h);
uint32_t wb_seq_block_index(kvh_engine *e, kvh_seq s, uint64_t i);

#endif
