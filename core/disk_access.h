/* Who may read a store: its directory and files belong to the engine's
 * user alone (0700 and 0600 whatever the umask; 0750 and 0640 with
 * KVH_DISK_SHARE_GROUP), a directory other users can write to is refused,
 * and no store file is opened through a symbolic link or as anything but
 * a regular file of this user (one planted in its place could redirect
 * our writes or feed us forged blocks). */
#ifndef KVH_CORE_DISK_ACCESS_H
#define KVH_CORE_DISK_ACCESS_H

#include <stdbool.h>
#include <sys/types.h>

#include "kvh/kvh.h"

typedef struct kvhi_disk kvhi_disk;

/* Modes for the store's directory and files under cfg->disk_flags. */
mode_t kvhi_store_dir_mode(uint32_t disk_flags);
mode_t kvhi_store_file_mode(uint32_t disk_flags);
/* Creates the directory (if missing) and opens it; refuses one owned by
 * another user or writable by group or others, and gives its owner full
 * access (room for LOCK). Fills d->dir_fd; KVH_ERR_IO with the reason. */
kvh_status kvhi_store_open_dir(kvhi_disk *d, const char *path);
/* Once the store is locked: the directory's and LOCK's modes set to the
 * store's whatever the umask (a setgid bit stays). KVH_ERR_IO with the
 * reason. */
kvh_status kvhi_store_set_modes(kvhi_disk *d);
/* openat(d->dir_fd, name, flags) for a store file: never follows a link,
 * only a regular file of this user, created (with O_CREAT) or narrowed to
 * the store's file mode (the owner's read and write bits given back when
 * they were taken away). Returns the fd or -errno (-ELOOP for a link,
 * -EPERM for another user's or a non-regular file, -EMLINK for a file
 * with other hard links). */
int kvhi_store_openat(const kvhi_disk *d, const char *name, int flags);
/* Calls visit(name, ctx) for each entry fd's directory lists from its
 * offset on, until one returns true: 1 then, 0 at the end, -1 when the
 * listing fails. Read with getdents64 into the stack: no allocation,
 * since opendir's buffer, taken while another thread forks, can leave an
 * allocator lock held in the child (ASan's does). */
int kvhi_dir_find(int fd, bool (*visit)(const char *name, void *ctx), void *ctx);
/* What a -errno of kvhi_store_openat means, for a message. */
const char *kvhi_store_file_error(int rc);
/* The same, leaving the mode of a file that exists as it is (LOCK,
 * opened before the store is known to be this engine's). */
int kvhi_store_openat_as_found(const kvhi_disk *d, const char *name, int flags);

#endif
