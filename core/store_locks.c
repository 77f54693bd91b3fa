/* Open stores' lock descriptors, given up by forked children
 * (core/store_locks.h). */
#include "core/store_locks.h"

#include <pthread.h>
#include <stddef.h>
#include <unistd.h>

static pthread_mutex_t locks_lock = PTHREAD_MUTEX_INITIALIZER;
static kvhi_store_lock *locks;
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

/* The fork takes the list's lock, so that the child gets it free and the
 * list whole. */
static void locks_take(void) { pthread_mutex_lock(&locks_lock); }
static void locks_let_go(void) { pthread_mutex_unlock(&locks_lock); }

/* close(), not flock(LOCK_UN): the open file is the parent's too, and
 * unlocking it would unlock the parent's store. The child's copy of the
 * engine refuses every call and frees nothing, so the descriptors are not
 * used or closed again there. */
static void locks_give_up_in_child(void)
{
    for (kvhi_store_lock *l = locks; l; l = l->next) {
        if (*l->lock_fd >= 0)
            close(*l->lock_fd);
        if (*l->dir_fd >= 0)
            close(*l->dir_fd);
        *l->lock_fd = *l->dir_fd = -1;
    }
    locks = NULL;
    pthread_mutex_unlock(&locks_lock);
}

static void watch_forks(void) { (void)pthread_atfork(locks_take, locks_let_go, locks_give_up_in_child); }

void kvhi_store_locks_hold(void) { pthread_mutex_lock(&locks_lock); }

void kvhi_store_locks_let_go(void) { pthread_mutex_unlock(&locks_lock); }

void kvhi_store_lock_add(kvhi_store_lock *l, int *dir_fd, int *lock_fd)
{
    (void)pthread_once(&fork_once, watch_forks);
    pthread_mutex_lock(&locks_lock);
    l->dir_fd = dir_fd;
    l->lock_fd = lock_fd;
    l->prev = NULL;
    l->next = locks;
    if (locks)
        locks->prev = l;
    locks = l;
    pthread_mutex_unlock(&locks_lock);
}

void kvhi_store_lock_remove(kvhi_store_lock *l)
{
    if (!l->dir_fd)
        return; /* never added */
    pthread_mutex_lock(&locks_lock);
    if (l->prev)
        l->prev->next = l->next;
    else if (locks == l)
        locks = l->next;
    if (l->next)
        l->next->prev = l->prev;
    l->prev = l->next = NULL;
    l->dir_fd = l->lock_fd = NULL;
    pthread_mutex_unlock(&locks_lock);
}
