/* Persistent worker threads for the CPU attention kernels (thread_pool.h).
 *
 * A run bumps a generation number and wakes the workers; each worker whose
 * index is below the run's participant count calls the function, then
 * counts itself done. Workers spin briefly on the generation before they
 * sleep, so back-to-back runs (one per layer) do not pay a futex wake-up
 * each time; the caller spins briefly for the last worker the same way. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>

#include "kernels/cpu/thread_pool.h"
#include "kernels/cpu/fp_env.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

#define SPIN_ROUNDS 2000

struct kvhi_pool {
    pthread_mutex_t lock;
    pthread_cond_t wake; /* generation moved or stop */
    pthread_cond_t done; /* pending reached 0 */
    pthread_t *threads;
    uint32_t n_threads;
    uint32_t participants; /* of the current run; under lock */
    kvhi_pool_fn fn;       /* under lock */
    void *arg;
    uint64_t gen;           /* under lock */
    _Atomic uint64_t gen_a; /* mirror of gen for spinning */
    _Atomic uint32_t pending;
    bool stop;
};

typedef struct worker_arg {
    kvhi_pool *pool;
    uint32_t index; /* participant number, 1.. */
} worker_arg;

static void *worker_main(void *varg)
{
    worker_arg *wa = varg;
    kvhi_pool *p = wa->pool;
    uint32_t index = wa->index;
    free(wa);
    /* The kernels compute in the default floating-point environment,
     * whatever the thread that started the pool had set (kvhi_fp_env). */
    (void)kvhi_fp_default_enter();
    uint64_t seen = 0;
    for (;;) {
        for (int i = 0; i < SPIN_ROUNDS && atomic_load_explicit(&p->gen_a, memory_order_acquire) == seen; i++)
            cpu_relax();
        pthread_mutex_lock(&p->lock);
        while (p->gen == seen && !p->stop)
            pthread_cond_wait(&p->wake, &p->lock);
        if (p->stop) {
            pthread_mutex_unlock(&p->lock);
            return NULL;
        }
        seen = p->gen;
        kvhi_pool_fn fn = p->fn;
        void *arg = p->arg;
        bool mine = index < p->participants;
        pthread_mutex_unlock(&p->lock);
        if (!mine)
            continue;
        fn(arg, index);
        if (atomic_fetch_sub_explicit(&p->pending, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&p->lock);
            pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->lock);
        }
    }
}

uint32_t kvhi_cpu_count(void)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
        int n = CPU_COUNT(&set);
        if (n > 0)
            return (uint32_t)n;
    }
    return 1;
}

kvhi_pool *kvhi_pool_create(uint32_t workers)
{
    kvhi_pool *p = calloc(1, sizeof(*p));
    if (!p)
        return NULL;
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->done, NULL);
    atomic_init(&p->gen_a, 0);
    atomic_init(&p->pending, 0);
    p->threads = calloc(workers ? workers : 1, sizeof(pthread_t));
    if (!p->threads) {
        kvhi_pool_destroy(p);
        return NULL;
    }
    for (uint32_t i = 0; i < workers; i++) {
        worker_arg *wa = malloc(sizeof(*wa));
        if (!wa)
            break;
        wa->pool = p;
        wa->index = i + 1;
        if (pthread_create(&p->threads[i], NULL, worker_main, wa) != 0) {
            free(wa);
            break;
        }
        p->n_threads++;
    }
    return p; /* fewer workers than asked is still a pool */
}

void kvhi_pool_destroy(kvhi_pool *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&p->lock);
    p->stop = true;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
    for (uint32_t i = 0; i < p->n_threads; i++)
        pthread_join(p->threads[i], NULL);
    free(p->threads);
    pthread_cond_destroy(&p->done);
    pthread_cond_destroy(&p->wake);
    pthread_mutex_destroy(&p->lock);
    free(p);
}

uint32_t kvhi_pool_workers(const kvhi_pool *p) { return p ? p->n_threads : 0; }

void kvhi_pool_run(kvhi_pool *p, uint32_t participants, kvhi_pool_fn fn, void *arg)
{
    if (!p || participants > p->n_threads + 1)
        participants = p ? p->n_threads + 1 : 1;
    if (participants <= 1) {
        fn(arg, 0);
        return;
    }
    pthread_mutex_lock(&p->lock);
    p->fn = fn;
    p->arg = arg;
    p->participants = participants;
    atomic_store_explicit(&p->pending, participants - 1, memory_order_relaxed);
    p->gen++;
    atomic_store_explicit(&p->gen_a, p->gen, memory_order_release);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
    fn(arg, 0);
    for (int i = 0; i < SPIN_ROUNDS && atomic_load_explicit(&p->pending, memory_order_acquire) != 0; i++)
        cpu_relax();
    if (atomic_load_explicit(&p->pending, memory_order_acquire) != 0) {
        pthread_mutex_lock(&p->lock);
        while (atomic_load_explicit(&p->pending, memory_order_acquire) != 0)
            pthread_cond_wait(&p->done, &p->lock);
        pthread_mutex_unlock(&p->lock);
    }
}
