/* Fences, the job heap and the migration workers (core/migrate.c). */
#ifndef KVH_CORE_MIGRATE_H
#define KVH_CORE_MIGRATE_H

#include <stdbool.h>
#include <stdint.h>
#include <time.h>

#include "core/engine.h"

typedef struct kvhi_fence {
    uint32_t pending;
    uint32_t waiters; /* threads inside kvhi_fence_wait_idx */
    kvh_status status;
    bool user_freed;
    char msg[768]; /* detail of the first failure, from the failing thread (whole) */
    /* An acquire of more blocks than the device tier holds: its NOSPACE
     * names the range, not the blocks the eviction found pinned. */
    uint32_t range_blocks;
    uint64_t device_slots;
} kvhi_fence;

/* What a queued move is for, which decides what a block pinned since it
 * was queued means. */
typedef enum kvhi_job_kind {
    KVHI_JOB_NEED,     /* acquire or a read: the block must arrive (pinned
                          elsewhere: KVH_ERR_BUSY) */
    KVHI_JOB_MOVE,     /* kvh_migrate, context switches: pinned is skipped */
    KVHI_JOB_PREFETCH, /* a hint: anything it cannot do is skipped */
} kvhi_job_kind;

typedef struct kvhi_job {
    uint32_t block;
    uint32_t block_gen;
    uint32_t fence; /* fence handle index, or KVHI_NO_BLOCK */
    uint32_t fence_gen;
    uint8_t target_tier;
    uint8_t kind; /* kvhi_job_kind */
    int32_t priority;
    uint64_t order; /* FIFO among equal priorities */
} kvhi_job;

/* Lock not held: start and stop (joining) the migration workers. */
kvh_status kvhi_workers_start(kvh_engine *e);
void kvhi_workers_stop(kvh_engine *e);
/* Queues b -> tier; fence_idx may be KVHI_NO_BLOCK. Drops the lock when
 * no worker runs (the move is then made inline). */
/* Waits until block b, of generation gen, may start a move to tier: idle
 * (a promotion may also start while a disk copy is written from its slot)
 * and with no offload batch gathering into its slot. False when it was
 * freed meanwhile. Lock held; dropped while waiting. */
bool kvhi_block_wait_movable(kvh_engine *e, uint32_t b, uint32_t gen, uint32_t tier);
/* For a full tier with no victim: while a move of one of its blocks up
 * to memory is queued, as that move frees a slot, either runs it in this
 * thread (no other worker is free to: a lone worker, or one whose fellows
 * all wait so; the move, taken out of the queue, completes its fence) or
 * waits (on e->changed, until deadline, set at the first wait to
 * KVHI_QUEUED_MOVES_WAIT_S from then; zero it before) for a worker to run
 * it. True: try again. False when there is none, the time is up, or this
 * thread is running such a move already: then room is not coming. Lock
 * held; dropped while waiting or moving. */
#define KVHI_QUEUED_MOVES_WAIT_S 5
bool kvhi_wait_queued_moves_out(kvh_engine *e, uint32_t tier, struct timespec *deadline);
/* Whether this thread is one of e's migration workers. */
bool kvhi_is_worker(const kvh_engine *e);
kvh_status kvhi_enqueue(kvh_engine *e, uint32_t b, uint32_t tier, int32_t priority, kvhi_job_kind kind,
                        uint32_t fence_idx);
kvh_status kvhi_fence_new(kvh_engine *e, uint32_t *idx, kvh_fence *handle);
void kvhi_fence_done(kvh_engine *e, uint32_t fence_idx, kvh_status st);
/* n more completions the fence waits for (kvhi_fence_done each). */
void kvhi_fence_expect(kvh_engine *e, uint32_t idx, uint32_t n);
/* Records st as the fence's status unless one failed first. */
void kvhi_fence_record_failure(kvh_engine *e, uint32_t idx, kvh_status st, const char *msg);
/* [out] *done = 1 when complete; the first failure's status then. */
kvh_status kvhi_fence_poll_idx(kvh_engine *e, uint32_t idx, int32_t *done);
/* Waits for the fence (drops the lock while waiting). */
kvh_status kvhi_fence_wait_idx(kvh_engine *e, uint32_t idx, uint64_t timeout_ns);
void kvhi_fence_drop(kvh_engine *e, uint32_t idx);

#endif
