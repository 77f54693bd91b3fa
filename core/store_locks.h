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

/* Add before either descriptor is opened (both -1), remove once both are
 * closed: a fork between an open and its flock would give the child the
 * open file the flock then locks. */
void kvhi_store_lock_add(kvhi_store_lock *l, int *dir_fd, int *lock_fd);
void kvhi_store_lock_remove(kvhi_store_lock *l);
/* Around each open or close of a listed descriptor and the store of its
 * number in the field: no fork sees one without the other. */
void kvhi_store_locks_hold(void);
void kvhi_store_locks_let_go(void);

#endif
