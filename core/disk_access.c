/* Owner-only store directories and files (core/disk_access.h). */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/disk_access.h"
#include "core/disk_format.h"
#include "core/disk_io.h"
#include "core/engine.h"
#include "core/store_locks.h"

mode_t kvhi_store_dir_mode(uint32_t disk_flags) { return disk_flags & KVH_DISK_SHARE_GROUP ? 0750 : 0700; }

mode_t kvhi_store_file_mode(uint32_t disk_flags) { return disk_flags & KVH_DISK_SHARE_GROUP ? 0640 : 0600; }

/* The name of an index or journal file in dir that another program wrote
 * (not kvh's magic), where no slab or lock says a store lives there; NULL
 * otherwise. Such a directory is refused before anything in it changes
 * (its mode narrowed, a LOCK written, its `index` replaced). */
static const char *foreign_store_file(int dir_fd)
{
    if (faccessat(dir_fd, "LOCK", F_OK, AT_SYMLINK_NOFOLLOW) == 0 ||
        faccessat(dir_fd, "slab-0000.kvh", F_OK, AT_SYMLINK_NOFOLLOW) == 0)
        return NULL;
    static const char *const names[] = {"index", "journal"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        /* Non-blocking: a FIFO in its place would block the open until a
         * writer came (for ever). */
        int fd = openat(dir_fd, names[i], O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
        if (fd < 0)
            continue;
        struct stat st;
        if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
            close(fd);
            return names[i]; /* a FIFO, a directory, a device: no file kvh writes */
        }
        uint8_t first[8];
        ssize_t n = pread(fd, first, sizeof(first), 0);
        close(fd);
        /* Shorter than kvh's magic but not empty is not kvh's either (a
         * store that has one always has its slabs or LOCK, seen above). */
        if (n > 0 && (n < (ssize_t)sizeof(first) || !kvhi_index_magic_is_kvh(first)))
            return names[i];
    }
    return NULL;
}

/* fsync of the directory holding path: a directory just made is on
 * stable storage only once its parent's entry for it is, and every file
 * made durable in it would be lost with it. */
static int sync_parent_dir(const char *path)
{
    size_t n = strlen(path);
    char *parent = malloc(n + 2);
    if (!parent)
        return -ENOMEM;
    memcpy(parent, path, n + 1);
    while (n > 1 && parent[n - 1] == '/')
        parent[--n] = '\0';
    char *slash = strrchr(parent, '/');
    if (!slash)
        strcpy(parent, ".");
    else
        slash[slash == parent ? 1 : 0] = '\0';
    int fd = open(parent, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    int open_errno = errno;
    free(parent);
    if (fd < 0)
        return open_errno == EACCES ? 0 : -open_errno; /* a parent this user may only search: nothing to sync with */
    int inj = kvhi_disk_fault(KVHI_OP_DIRSYNC);
    int rc = inj ? inj : kvhi_disk_sync_fd(fd, false);
    close(fd);
    return rc == -EINVAL ? 0 : rc; /* a file system that syncs no directories */
}

kvh_status kvhi_store_open_dir(kvhi_disk *d, const char *path)
{
    mode_t want = kvhi_store_dir_mode(d->disk_flags);
    bool made = mkdir(path, want) == 0;
    if (!made && errno != EEXIST)
        return kvhi_fail(KVH_ERR_IO, "cannot create %s: %s", path, strerror(errno));
    int synced = made ? sync_parent_dir(path) : 0;
    if (synced != 0) {
        rmdir(path); /* empty, just made: the next open makes it, and syncs, again */
        return kvhi_fail(KVH_ERR_IO, "cannot sync the directory holding %s: %s", path, strerror(-synced));
    }
    /* Not through a link in the last component: one planted there would
     * point the engine at a directory it then narrows, locks and writes
     * its index into. */
    kvhi_store_locks_hold();
    d->dir_fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
    int open_errno = errno;
    kvhi_store_locks_let_go();
    errno = open_errno;
    struct stat lst;
    if (d->dir_fd < 0 && (errno == ELOOP || errno == ENOTDIR) && lstat(path, &lst) == 0 && S_ISLNK(lst.st_mode))
        return kvhi_fail(KVH_ERR_IO, "%s is a symbolic link: give the store's own path", path);
    if (d->dir_fd < 0)
        return kvhi_fail(KVH_ERR_IO, "cannot open %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(d->dir_fd, &st) != 0)
        return kvhi_fail(KVH_ERR_IO, "cannot stat %s: %s", path, strerror(errno));
    if (st.st_uid != geteuid())
        return kvhi_fail(KVH_ERR_IO, "store %s belongs to user %u, not to this process's user %u", path,
                         (unsigned)st.st_uid, (unsigned)geteuid());
    if (st.st_mode & (S_IWGRP | S_IWOTH))
        return kvhi_fail(KVH_ERR_IO,
                         "store %s is writable by other users (mode %04o): another user could replace its "
                         "files; make it %04o",
                         path, (unsigned)(st.st_mode & 07777), (unsigned)want);
    const char *foreign = d->read_only ? NULL : foreign_store_file(d->dir_fd);
    if (foreign)
        return kvhi_fail(KVH_ERR_IO,
                         "%s holds a file named '%s' that kvh did not write, and no store: not a kvh store "
                         "directory (give disk_path a directory of its own)",
                         path, foreign);
    /* The owner's access only, before the store is locked, and only
     * where no engine can hold it (no LOCK yet): LOCK cannot be made in a
     * directory mkdir's umask left at 0500. The exact mode waits for the
     * lock (kvhi_store_set_modes): an open refused because another engine
     * holds the store must not change its modes. */
    bool held_maybe = !made && faccessat(d->dir_fd, "LOCK", F_OK, AT_SYMLINK_NOFOLLOW) == 0;
    if (!held_maybe && (st.st_mode & S_IRWXU) != S_IRWXU && fchmod(d->dir_fd, (st.st_mode & 07777) | S_IRWXU) != 0)
        return kvhi_fail(KVH_ERR_IO, "cannot set %s to mode %04o: %s", path, (unsigned)want, strerror(errno));
    return KVH_OK;
}

kvh_status kvhi_store_set_modes(kvhi_disk *d)
{
    /* Exactly the store's mode: narrow what an older kvh or a umask left
     * readable (the files hold KV that can be inverted back into prompts),
     * and widen what mkdir's umask trimmed (0700 under
     * KVH_DISK_SHARE_GROUP shares nothing). A setgid bit stays: it only
     * picks the group new files get. */
    mode_t want = kvhi_store_dir_mode(d->disk_flags);
    struct stat st;
    if (fstat(d->dir_fd, &st) != 0)
        return kvhi_fail(KVH_ERR_IO, "cannot stat %s: %s", d->path, strerror(errno));
    mode_t keep = st.st_mode & S_ISGID;
    if ((st.st_mode & 07777) != (keep | want) && fchmod(d->dir_fd, keep | want) != 0)
        return kvhi_fail(KVH_ERR_IO, "cannot set %s to mode %04o: %s", d->path, (unsigned)want, strerror(errno));
    mode_t file_want = kvhi_store_file_mode(d->disk_flags);
    if (d->lock_fd >= 0 && fstat(d->lock_fd, &st) == 0 && (st.st_mode & 0777) != file_want &&
        fchmod(d->lock_fd, file_want) != 0)
        return kvhi_fail(KVH_ERR_IO, "cannot set %s/LOCK to mode %04o: %s", d->path, (unsigned)file_want,
                         strerror(errno));
    return KVH_OK;
}

static int store_openat(const kvhi_disk *d, const char *name, int flags, bool set_mode)
{
    mode_t want = kvhi_store_file_mode(d->disk_flags);
    int fd = openat(d->dir_fd, name, flags | O_NOFOLLOW | O_CLOEXEC, want);
    if (fd < 0)
        return -errno;
    struct stat st;
    int rc = 0;
    if (fstat(fd, &st) != 0)
        rc = -errno;
    else if (S_ISDIR(st.st_mode))
        rc = -EISDIR; /* read-only opens take a directory: say what it is */
    else if (!S_ISREG(st.st_mode) || (st.st_uid != geteuid() && !d->read_only))
        rc = -EPERM; /* inspection (read_only) may read another user's store it can open */
    else if (set_mode && (st.st_mode & 0777) != want && !d->read_only && fchmod(fd, want) != 0)
        rc = -errno;
    if (rc != 0) {
        close(fd);
        return rc;
    }
    return fd;
}

int kvhi_store_openat(const kvhi_disk *d, const char *name, int flags) { return store_openat(d, name, flags, true); }

int kvhi_store_openat_as_found(const kvhi_disk *d, const char *name, int flags)
{
    return store_openat(d, name, flags, false);
}
