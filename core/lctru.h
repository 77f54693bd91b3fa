/* LCTRU: the victim key under compression tolerance, and the tolerance
 * calls (core/lctru.c). */
#ifndef KVH_CORE_LCTRU_H
#define KVH_CORE_LCTRU_H

#include <stdint.h>

#include "core/block.h"
#include "core/seq.h"

/* The eviction key of b under the engine's policy, from its LRU-K key. */
kvhi_lruk_key kvhi_evict_key(kvh_engine *e, const kvhi_block *blk, kvhi_lruk_key lruk);
/* Tolerances (lctru.c, lock held; tolerance <= KVH_TOLERANCE_MAX,
 * max_rel_error finite and >= 0). */
kvh_status kvhi_seq_set_tolerance(kvh_engine *e, kvhi_seq *s, uint64_t first, uint64_t n, uint32_t tolerance);
kvh_status kvhi_block_set_tolerance(kvh_engine *e, kvh_block block, uint32_t tolerance);
kvh_status kvhi_seq_derive_tolerance(kvh_engine *e, kvhi_seq *s, uint64_t first, uint64_t n, float max_rel_error);

#endif
