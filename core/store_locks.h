/* The descriptors that hold open stores' locks (core/store_locks.c).
 *
 * A store's lock is an flock on its directory and on its LOCK file, which
 * belongs to the open file, and fork() gives the child that same open
 * file: a child that outlived its parent would hold the store for as long
 * as it ran, though it cannot use the engine it copied. At fork the child
 * closes its copies (leaving the parent's lock as it is). */
#ifndef KVH_CORE_STORE_LOCKS_H
#define KVH_CORE_STORE_LOCKS_H

typedef struct kvhi_store_lock {
    int *dir_fd; /* the disk tier's fields: -1 in a child once closed */
    int *lock_fd;
    struct kvhi_store_lock *prev, *next;
} kvhi_store_lock;

/* Both while the store is locked: add once it is, remove before unlocking. */
void kvhi_store_lock_add(kvhi_store_lock *l, int *dir_fd, int *lock_fd);
void kvhi_store_lock_remove(kvhi_store_lock *l);

#endif
