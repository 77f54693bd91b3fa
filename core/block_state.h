/* A block's move state: what a copy of its data is doing right now. It
 * lives in the top bits of kvhi_block.flags (KVHI_BF_MOVE_MASK) and is
 * changed only by kvhi_block_move_event, whose table below is the whole
 * list of legal transitions (checked in debug builds). Lock held.
 *
 *   IDLE ----move begins----> MOVING ----to disk, slot still its own----> DEMOTING
 *    ^  \                       |                                          |
 *    |   copy begins            | move ends                        recall  v
 *    |    v                     v                                       RECALLED
 *    |  COPYING --move begins--> COPYING_MOVING                            |
 *    |    |  ^----move ends--------'  |                                    |
 *    |    | copy ends                 | copy ends: MOVING                  |
 *    '----'---------------------------'-------- move ends (DEMOTING, RECALLED: IDLE)
 *
 * MOVING, DEMOTING, RECALLED and COPYING_MOVING are "in flight": a move
 * owns the block's data and nothing else may move, write or free it
 * (kvhi_block_wait_idle). COPYING (a clean disk copy is written from, or
 * a disk block verified in, a slot that stays valid) lets readers in and
 * a promotion start (COPYING_MOVING). Busy is any state but IDLE: busy
 * blocks are not evicted, freed or written until they settle. */
#ifndef KVH_CORE_BLOCK_STATE_H
#define KVH_CORE_BLOCK_STATE_H

#include <assert.h>
#include <stdbool.h>

#include "core/engine.h"
#include "core/block.h"

enum kvhi_move_state {
    KVHI_MS_IDLE,
    KVHI_MS_MOVING,         /* kvhi_move_begin .. kvhi_move_end */
    KVHI_MS_DEMOTING,       /* moving to disk; an acquire may still call it off */
    KVHI_MS_RECALLED,       /* called off: it stays, its write becomes a clean copy */
    KVHI_MS_COPYING,        /* a disk copy is written or checked from a stable slot */
    KVHI_MS_COPYING_MOVING, /* and a promotion of it runs meanwhile */
    KVHI_MS_COUNT           /* two values of the field are left for new states */
};

enum kvhi_move_event {
    KVHI_EV_MOVE_BEGIN,
    KVHI_EV_MOVE_END,
    KVHI_EV_RECALLABLE, /* the move goes to disk from a slot nobody else is promised */
    KVHI_EV_RECALL,
    KVHI_EV_COPY_BEGIN,
    KVHI_EV_COPY_END,
    KVHI_EV_COUNT
};

_Static_assert(KVHI_MS_COUNT <= (KVHI_BF_MOVE_MASK >> KVHI_BF_MOVE_SHIFT) + 1, "move states fit their field");

static inline enum kvhi_move_state kvhi_move_state(const kvhi_block *b)
{
    return (enum kvhi_move_state)((b->flags & KVHI_BF_MOVE_MASK) >> KVHI_BF_MOVE_SHIFT);
}

/* A move owns the block's data. */
static inline bool kvhi_block_in_flight(const kvhi_block *b)
{
    enum kvhi_move_state s = kvhi_move_state(b);
    return s == KVHI_MS_MOVING || s == KVHI_MS_DEMOTING || s == KVHI_MS_RECALLED || s == KVHI_MS_COPYING_MOVING;
}

/* A disk copy is being written (or a disk block checked) from its slot. */
static inline bool kvhi_block_copying(const kvhi_block *b)
{
    enum kvhi_move_state s = kvhi_move_state(b);
    return s == KVHI_MS_COPYING || s == KVHI_MS_COPYING_MOVING;
}

static inline bool kvhi_block_busy(const kvhi_block *b) { return kvhi_move_state(b) != KVHI_MS_IDLE; }

/* The state after ev, or KVHI_MS_COUNT where ev is not legal in s. */
static inline enum kvhi_move_state kvhi_move_next(enum kvhi_move_state s, enum kvhi_move_event ev)
{
    static const unsigned char next[KVHI_MS_COUNT][KVHI_EV_COUNT] = {
        /*                  MOVE_BEGIN              MOVE_END          RECALLABLE        RECALL            COPY_BEGIN
           COPY_END */
        [KVHI_MS_IDLE] = {KVHI_MS_MOVING, KVHI_MS_COUNT, KVHI_MS_COUNT, KVHI_MS_COUNT, KVHI_MS_COPYING, KVHI_MS_COUNT},
        [KVHI_MS_MOVING] = {KVHI_MS_COUNT, KVHI_MS_IDLE, KVHI_MS_DEMOTING, KVHI_MS_COUNT, KVHI_MS_COUNT, KVHI_MS_COUNT},
        [KVHI_MS_DEMOTING] = {KVHI_MS_COUNT, KVHI_MS_IDLE, KVHI_MS_COUNT, KVHI_MS_RECALLED, KVHI_MS_COUNT,
                              KVHI_MS_COUNT},
        [KVHI_MS_RECALLED] = {KVHI_MS_COUNT, KVHI_MS_IDLE, KVHI_MS_COUNT, KVHI_MS_COUNT, KVHI_MS_COUNT, KVHI_MS_COUNT},
        [KVHI_MS_COPYING] = {KVHI_MS_COPYING_MOVING, KVHI_MS_COUNT, KVHI_MS_COUNT, KVHI_MS_COUNT, KVHI_MS_COUNT,
                             KVHI_MS_IDLE},
        [KVHI_MS_COPYING_MOVING] = {KVHI_MS_COUNT, KVHI_MS_COPYING, KVHI_MS_COUNT, KVHI_MS_COUNT, KVHI_MS_COUNT,
                                    KVHI_MS_MOVING},
    };
    return (enum kvhi_move_state)next[s][ev];
}

/* Applies ev to b's move state. An event the table does not allow is a
 * defect of the caller: asserted in debug builds, ignored otherwise. */
static inline void kvhi_block_move_event(kvhi_block *b, enum kvhi_move_event ev)
{
    enum kvhi_move_state to = kvhi_move_next(kvhi_move_state(b), ev);
    assert(to != KVHI_MS_COUNT && "illegal block move transition");
    if (to == KVHI_MS_COUNT)
        return;
    b->flags = (uint16_t)((b->flags & ~KVHI_BF_MOVE_MASK) | ((unsigned)to << KVHI_BF_MOVE_SHIFT));
}

#endif
