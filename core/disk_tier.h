/* The disk tier inside the engine (core/disk_tier.c): open and recovery,
 * the journal and clean-copy hooks of a move, verification in place,
 * background cleaning, persist. */
#ifndef KVH_CORE_DISK_TIER_H
#define KVH_CORE_DISK_TIER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/engine.h"
#include "core/move.h"
#include "core/seq.h"

kvh_status kvhi_disk_tier_open(kvh_engine *e, const kvh_config *cfg, const char *path);
kvh_status kvhi_disk_tier_recover(kvh_engine *e);
/* Writes a snapshot of the index (flush) and closes the store. */
kvh_status kvhi_disk_tier_close(kvh_engine *e, bool flush);
/* Bookkeeping after a block reached or left the disk tier (lock held). */
void kvhi_disk_after_move(kvh_engine *e, uint32_t b, const kvhi_xfer *x, bool *keep_src_slot);
/* Forgets b's disk record (DEL record) and clean copy, if any. */
void kvhi_disk_forget(kvh_engine *e, uint32_t b);
/* Makes disk slot `slot` b's clean copy, or takes it away and returns the
 * slot (which the caller keeps or frees); the engine's count of clean
 * disk copies (kvh_tier_info) follows. Lock held. */
void kvhi_disk_copy_set(kvh_engine *e, uint32_t b, uint32_t slot);
uint32_t kvhi_disk_copy_clear(kvh_engine *e, uint32_t b);
/* A recalled demotion finished writing: b stays in memory and the slot it
 * was written to becomes its clean copy when it may be one (immutable,
 * written with its hash), else the slot is freed. */
void kvhi_disk_keep_as_copy(kvh_engine *e, uint32_t b, const kvhi_xfer *x);
/* Makes every full block of s durable (written, journaled, synced).
 * Drops the lock for the writes and the sync. */
kvh_status kvhi_disk_persist(kvh_engine *e, kvhi_seq *s);
/* The same for blocks[0..n) (whose names them in messages). */
/* twins (NULL, or n entries): for each block that a published block of
 * its prefix stood in for, that block, with a reference the caller then
 * owns; KVHI_NO_BLOCK for the others. */
kvh_status kvhi_disk_persist_blocks(kvh_engine *e, const uint32_t *blocks, uint32_t n, const char *whose,
                                    uint32_t *twins);
/* One round of background cleaning (lock held, may drop); true if work
 * was done. It looks at its leads, then lets its clock hand scan as many
 * records as its credit allows: never the whole table for one arrival,
 * which at 10^5 records held the engine lock for a millisecond each time
 * a block reached a full host tier. */
bool kvhi_disk_clean_step(kvh_engine *e);
/* Records the clock hand may scan for each lead, and at most in all. */
#define KVHI_CLEAN_SCAN_PER_LEAD 16u
#define KVHI_CLEAN_SCAN_CREDIT_MAX 4096u
/* Promotions from disk between two wakes of a worker to spend their pay. */
#define KVHI_CLEAN_PAYS_PER_WAKE 16u
/* Block b may have become cleanable (it arrived in the host tier, or
 * was published or unpinned there): a lead for the cleaner when it is in
 * the host tier (lock held). Every arrival pays the hand its records,
 * kvhi_disk_clean_pay alone for a block read back from disk (it keeps
 * its copy there), so that the hand still goes round while only restores
 * come, and is run when a worker next looks. */
static inline void kvhi_disk_clean_pay(kvh_engine *e)
{
    e->clean_scan_credit = e->clean_scan_credit + KVHI_CLEAN_SCAN_PER_LEAD < KVHI_CLEAN_SCAN_CREDIT_MAX
                               ? e->clean_scan_credit + KVHI_CLEAN_SCAN_PER_LEAD
                               : KVHI_CLEAN_SCAN_CREDIT_MAX;
}
static inline void kvhi_disk_clean_lead(kvh_engine *e, uint32_t b)
{
    if (!e->disk || e->blocks[b].tier != KVH_TIER_HOST)
        return;
    uint32_t at = (e->clean_leads_head + e->clean_leads_len) % KVHI_CLEAN_LEADS;
    e->clean_leads[at] = b;
    if (e->clean_leads_len < KVHI_CLEAN_LEADS)
        e->clean_leads_len++;
    else
        e->clean_leads_head = (e->clean_leads_head + 1) % KVHI_CLEAN_LEADS; /* the oldest is the hand's now */
    kvhi_disk_clean_pay(e);
}
/* When cleaning, resting after the filesystem refused a write, has
 * copies to try again (kvhi_now_ns); 0 when it does not rest or has
 * nothing to write. An idle worker sleeps until then, not for good:
 * no call may come to wake it when room comes back. */
uint64_t kvhi_disk_clean_resumes_ns(kvh_engine *e);
/* Records how a write to a disk slot ended (0 or a negative errno): a
 * refusal for space (-ENOSPC) makes background cleaning rest; a write that
 * works ends the rest. */
void kvhi_disk_note_write(kvh_engine *e, int err);
/* Whether the host tier runs low enough (under an eighth free) for the
 * cleaner to write ahead; kept clean copies are room too
 * (core/clean_copy.h). */
static inline bool kvhi_disk_host_runs_low(const kvh_engine *e)
{
    const kvhi_tier *h = &e->tiers[KVH_TIER_HOST];
    return ((uint64_t)h->slots.free_count + e->clean.count) * 8 < h->slots.capacity;
}
/* Whether the disk tier is present with no free slot: referenced blocks
 * then have nowhere to leave memory for (said in NOSPACE reasons). */
static inline bool kvhi_disk_tier_full(const kvh_engine *e)
{
    const kvhi_tier *d = &e->tiers[KVH_TIER_DISK];
    return d->present && d->slots.free_count == 0;
}
/* Whether a disk copy is being written from an unreferenced block of tier
 * (of agent, where agent is not KVHI_NO_BLOCK): such a block is busy only
 * until the copy ends, and is then a better victim than any referenced one. */
bool kvhi_disk_copying_unreferenced(kvh_engine *e, uint32_t tier, uint32_t agent);
/* Gives back the disk slot of one clean disk copy of an unreferenced,
 * idle block that stays in memory (its index record deleted: the block
 * stays cached, no longer durable), for a full disk with no victim left.
 * False when there is none (lock held). */
bool kvhi_disk_give_back_copy(kvh_engine *e);
/* Reads and checks blocks on disk without moving them (drops the lock).
 * A block that fails its checks is marked corrupt (counted, never served
 * again); one whose read fails (I/O error, no memory) is left as it is.
 * Returns how many leading blocks did neither. */
size_t kvhi_disk_verify(kvh_engine *e, const uint32_t *blocks, size_t n);

#endif
