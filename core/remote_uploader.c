/* Background uploads (core/remote_tier.h): blocks demoted to disk
 * (KVH_REMOTE_UPLOAD_DEMOTE) and blocks as they are published
 * (KVH_REMOTE_UPLOAD_WRITE_THROUGH) are queued, with a reference each,
 * where the engine decides so (under its lock, never waiting), and one
 * thread uploads them in rounds (kvhi_remote_upload_blocks: copies, disk
 * reads and the network without the lock). A full queue drops the block
 * and counts it in remote_uploads_dropped; close uploads what is queued. */
#include <stdlib.h>
#include <string.h>

#include "core/block.h"
#include "core/host_spare.h"
#include "core/remote_tier.h"

/* Queued blocks, as bytes of values: a few rounds' worth. */
#define QUEUE_BYTES (4 * KVHI_REMOTE_ROUND_BYTES)
#define QUEUE_MIN 16u
#define QUEUE_MAX 16384u

void kvhi_remote_queue_upload(kvh_engine *e, uint32_t b, uint32_t reason)
{
    kvhi_remote *r = e->remote;
    if (!r || !(r->upload & reason) || !r->queue || r->uploader_stop)
        return;
    kvhi_block *blk = &e->blocks[b];
    if (r->q_len == r->q_cap || r->q_len + r->in_round >= r->hold_max || blk->refs == UINT32_MAX) {
        e->stats.remote_uploads_dropped++;
        if (!r->queue_full) {
            r->queue_full = true;
            kvhi_log_later(e, KVH_LOG_WARN, "remote tier: upload queue full (%zu blocks waiting): uploads dropped",
                           r->q_len + r->in_round);
        }
        return;
    }
    kvhi_remote_upload_ref(e, b);
    r->queue[(r->q_head + r->q_len++) % r->q_cap] = b;
    pthread_cond_signal(&r->q_cv);
}

static void *uploader_main(void *arg)
{
    kvh_engine *e = arg;
    kvhi_thread_started_for(e);
    kvhi_remote *r = e->remote;
    size_t per = (size_t)(KVHI_REMOTE_ROUND_BYTES / kvhi_remote_value_bytes(&r->id));
    per = per ? per : 1;
    if (per > r->q_cap)
        per = r->q_cap;
    uint32_t *batch = malloc(sizeof(uint32_t) * per);
    pthread_mutex_lock(&e->lock);
    for (;;) {
        while (!r->q_len && !r->uploader_stop)
            pthread_cond_wait(&r->q_cv, &e->lock);
        if (!r->q_len)
            break; /* stopping, and nothing is left */
        size_t n = 0;
        while (r->q_len && n < per && batch) {
            batch[n++] = r->queue[r->q_head];
            r->q_head = (r->q_head + 1) % r->q_cap;
            r->q_len--;
        }
        if (!batch) { /* no memory for a batch: what is queued is dropped */
            uint32_t b = r->queue[r->q_head];
            r->q_head = (r->q_head + 1) % r->q_cap;
            r->q_len--;
            e->stats.remote_uploads_dropped++;
            kvhi_remote_upload_unref(e, b);
            continue;
        }
        r->in_round = n;
        kvhi_remote_upload_blocks(e, r->upload_cluster ? r->upload_cluster : r->cluster, batch, n);
        for (size_t k = 0; k < n; k++)
            kvhi_remote_upload_unref(e, batch[k]);
        r->in_round = 0;
        /* Room again once a round has gone and at most half the queue
         * waits (an empty one, where it holds a single block). */
        if (r->queue_full && r->q_len <= r->q_cap / 2) {
            r->queue_full = false;
            kvhi_log_later(e, KVH_LOG_INFO, "remote tier: upload queue has room again");
        }
    }
    pthread_mutex_unlock(&e->lock);
    free(batch);
    return NULL;
}

kvh_status kvhi_remote_uploader_start(kvh_engine *e)
{
    kvhi_remote *r = e->remote;
    if (!r || !(r->upload & (KVH_REMOTE_UPLOAD_DEMOTE | KVH_REMOTE_UPLOAD_WRITE_THROUGH)))
        return KVH_OK;
    uint64_t cap = QUEUE_BYTES / kvhi_remote_value_bytes(&r->id);
    cap = cap < QUEUE_MIN ? QUEUE_MIN : cap > QUEUE_MAX ? QUEUE_MAX : cap;
    /* The blocks an upload references cannot leave the last tier
     * (engine.h, upload_refs_tier_end): the queue and the round taken
     * from it hold half of that tier at most, so that a store that stops
     * answering cannot fill it and make allocations fail; what does not
     * fit is dropped and counted. */
    uint64_t half = kvhi_tier_slots(e, e->upload_refs_tier_end) / 2;
    r->hold_max = half ? (size_t)half : 1;
    if (cap > r->hold_max)
        cap = r->hold_max;
    r->queue = malloc(sizeof(uint32_t) * cap);
    if (!r->queue)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for the remote upload queue");
    r->q_cap = (size_t)cap;
    pthread_cond_init(&r->q_cv, NULL);
    int rc = pthread_create(&r->uploader, NULL, uploader_main, e);
    if (rc != 0) {
        pthread_cond_destroy(&r->q_cv);
        free(r->queue);
        r->queue = NULL;
        return kvhi_fail(KVH_ERR_NOMEM, "cannot start the remote uploader thread: %s", strerror(rc));
    }
    r->uploader_running = true;
    return KVH_OK;
}

void kvhi_remote_uploader_stop(kvh_engine *e)
{
    kvhi_remote *r = e->remote;
    if (!r || !r->uploader_running)
        return;
    pthread_mutex_lock(&e->lock);
    r->uploader_stop = true;
    pthread_cond_broadcast(&r->q_cv);
    pthread_mutex_unlock(&e->lock);
    pthread_join(r->uploader, NULL);
    r->uploader_running = false;
    pthread_cond_destroy(&r->q_cv);
    free(r->queue);
    r->queue = NULL;
}
