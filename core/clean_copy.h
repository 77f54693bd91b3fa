/* Clean host copies (core/clean_copy.c): a block promoted from the host
 * tier into the device tier keeps its host slot and bytes while it stays
 * unchanged, so its later demotion is a re-accounting (the record points
 * at the kept slot again, the device slot is freed) instead of a copy.
 *
 * Which blocks: immutable ones only (hashed and every KV cell written), the
 * same rule as a clean disk copy (kvhi_block.disk_copy): their bytes change
 * only through calls that drop the copy first (kvh_seq_write_kv and the
 * truncate and append that make a block private, core/seq.c), never
 * through a move. A copy is not kept while the slot it would keep is still
 * read by a holder of the block, nor while a disk copy is written from it.
 *
 * Room: a kept copy occupies its host slot but is a cache, never a block's
 * place: a host tier that needs a slot and has none free takes back the
 * oldest copy (O(1), a list through the slots) before it drops weights or
 * evicts a block. kvh_tier_info counts kept copies as free and says how
 * many there are (clean_copies); kvh_stats counts them kept, used by a
 * demotion and taken back.
 *
 * One arena (moves_in_place): device <-> host moves copy nothing already,
 * so no copy is kept there. All functions run with the engine lock held. */
#ifndef KVH_CORE_CLEAN_COPY_H
#define KVH_CORE_CLEAN_COPY_H

#include <stdbool.h>
#include <stdint.h>

/* Per host slot holding a kept copy: whose it is, and its neighbours in
 * the list (newest first). */
typedef struct kvhi_clean_link {
    uint32_t block, newer, older;
} kvhi_clean_link;

typedef struct kvhi_clean_copies {
    /* Per block record: the host slot of its kept copy, or KVHI_NO_BLOCK.
     * NULL when copies are never kept (no host tier, one arena). */
    uint32_t *slot_of;
    kvhi_clean_link *links;  /* per host slot */
    uint32_t newest, oldest; /* host slots, KVHI_NO_BLOCK when none */
    uint32_t count;
} kvhi_clean_copies;

struct kvh_engine;

/* Sets copies up for the engine's tiers (after block_cap is known).
 * Returns 0, or -1 out of memory. */
int kvhi_clean_init(struct kvh_engine *e);
void kvhi_clean_destroy(struct kvh_engine *e);
/* b has just been promoted out of host slot src_slot (its move committed):
 * keeps that slot as b's clean copy and returns true, or returns false
 * and leaves the slot to the caller. */
bool kvhi_clean_keep(struct kvh_engine *e, uint32_t b, uint32_t src_slot);
/* b's bytes are about to change, or its copy is no longer wanted: frees
 * the kept slot, if any. Cheap when there is none. */
void kvhi_clean_drop_slow(struct kvh_engine *e, uint32_t b);
/* Takes back the oldest kept copy for the host tier: its slot, now the
 * caller's, in *slot. False when none is kept. */
bool kvhi_clean_reclaim(struct kvh_engine *e, uint32_t *slot);
/* Demotes b (idle, in the device tier, with a kept copy) by re-accounting:
 * b moves to its kept host slot; its device slot goes to *src_slot_out
 * when not NULL, else is freed (after b's reads). */
void kvhi_clean_demote(struct kvh_engine *e, uint32_t b, uint32_t *src_slot_out);

#endif
