/* Status text, thread-local error detail and the log sink. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "core/engine.h"
#include "core/process_fork.h"

/* Room for the paths the CUDA loader tried. */
_Thread_local char kvhi_error_detail[1024];

kvh_status kvhi_fail(kvh_status status, const char *fmt, ...)
{
    /* A detail longer than the buffer loses its middle, not its end: a
     * message names a path first and its cause last, and a path of 4,000
     * characters cut the cause ("File name too long") off. */
    char full[4096];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(full, sizeof(full), fmt, ap);
    va_end(ap);
    size_t cap = sizeof(kvhi_error_detail), len = n < 0 ? 0 : (size_t)n < sizeof(full) ? (size_t)n : sizeof(full) - 1;
    if (len < cap) {
        memcpy(kvhi_error_detail, full, len + 1);
        return status;
    }
    static const char cut[] = " ... ";
    size_t tail = cap / 3, head = cap - 1 - tail - (sizeof(cut) - 1);
    while (head > 0 && ((unsigned char)full[head] & 0xC0) == 0x80)
        head--; /* no UTF-8 sequence cut in two */
    while (tail > 0 && ((unsigned char)full[len - tail] & 0xC0) == 0x80)
        tail--;
    memcpy(kvhi_error_detail, full, head);
    memcpy(kvhi_error_detail + head, cut, sizeof(cut) - 1);
    memcpy(kvhi_error_detail + head + sizeof(cut) - 1, full + len - tail, tail + 1);
    return status;
}

void kvhi_error_keep(kvhi_error_kept *k)
{
    memcpy(k->text, kvhi_error_detail, strnlen(kvhi_error_detail, sizeof(kvhi_error_detail) - 1) + 1);
}

void kvhi_error_put_back(const kvhi_error_kept *k)
{
    memcpy(kvhi_error_detail, k->text, strnlen(k->text, sizeof(k->text) - 1) + 1);
}

/* Where this thread stands for a sink's calls: the engine whose sink it
 * is inside, and the engine it was started for (NULL: a caller's). */
static _Thread_local struct {
    const kvh_engine *sink_of;
    const kvh_engine *started_for;
} here;

void kvhi_thread_started_for(kvh_engine *e)
{
    here.started_for = e;
    /* Named, so that a binding's log handler (and top, gdb) can tell the
     * threads kvh started from its caller's. */
    pthread_setname_np(pthread_self(), "kvh-worker");
}

void kvhi_sink_call(kvh_engine *e, int level, const char *message)
{
    const kvh_engine *outer = here.sink_of;
    /* A sink may call kvh, which clears this thread's error detail: the
     * failed call whose messages are flushed here must keep its own. */
    kvhi_error_kept saved;
    kvhi_error_keep(&saved);
    here.sink_of = e;
    e->cfg.log_fn(e->cfg.log_user, level, message);
    here.sink_of = outer;
    kvhi_error_put_back(&saved);
}

bool kvhi_in_sink_of(const kvh_engine *e) { return here.sink_of == e; }

bool kvhi_thread_is_engines(const kvh_engine *e) { return e && here.started_for == e; }

kvh_status kvhi_enter_refused(kvh_engine *e)
{
    if (e->fork_generation != kvhi_fork_generation())
        return kvhi_fail(KVH_ERR_UNSUPPORTED, "this engine was opened before the process forked: a child process "
                                              "cannot use it (its worker threads and locks stay in the parent); "
                                              "open a new engine in the child");
    if (here.sink_of == e && here.started_for == e)
        return kvhi_fail(KVH_ERR_BUSY, "the engine's log sink, on a thread kvh started, cannot call into the engine "
                                       "(the call could wait for that thread): call from another thread");
    return KVH_OK;
}

const char *kvhi_last_error(void) { return kvhi_error_detail; }

#define KVHI_TEXT_CASE(name, value, text)                                                                              \
    case value:                                                                                                        \
        return text;
#define KVHI_NAME_CASE(name, value, text)                                                                              \
    case value:                                                                                                        \
        return #name;

const char *kvhi_status_text(kvh_status status)
{
    switch (status) {
        KVH_STATUS_LIST(KVHI_TEXT_CASE)
    default:
        return "unknown status code";
    }
}

const char *kvhi_status_name(kvh_status status)
{
    switch (status) {
        KVH_STATUS_LIST(KVHI_NAME_CASE)
    default:
        return "KVH_ERR_UNKNOWN";
    }
}

void kvhi_log_later(kvh_engine *e, int level, const char *fmt, ...)
{
    if (!e->cfg.log_fn || (uint32_t)level > e->cfg.log_level || e->n_pending_log >= 4)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->pending_log[e->n_pending_log], sizeof(e->pending_log[0]), fmt, ap);
    va_end(ap);
    e->pending_log_level[e->n_pending_log++] = level;
}

/* Must be called without the engine lock: the sink is user code. */
void kvhi_log(kvh_engine *e, int level, const char *fmt, ...)
{
    if (!e || !e->cfg.log_fn || (uint32_t)level > e->cfg.log_level)
        return;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    kvhi_sink_call(e, level, msg);
}
