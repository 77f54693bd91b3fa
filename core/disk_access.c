/* Owner-only store directories and files (core/disk_access.h). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "core/disk_access.h"
#include "core/disk_format.h"
#include "core/disk_io.h"
#include "core/engine.h"
#include "core/store_locks.h"

mode_t kvhi_store_dir_mode(uint32_t disk_flags) { return disk_flags & KVH_DISK_SHARE_GROUP ? 0750 : 0700; }

mode_t kvhi_store_file_mode(uint32_t disk_flags) { return disk_flags & KVH_DISK_SHARE_GROUP ? 0640 : 0600; }

int kvhi_dir_find(int fd, bool (*visit)(const char *name, void *ctx), void *ctx)
{
    char buf[4096] __attribute__((aligned(8)));
    for (;;) {
        long got = syscall(SYS_getdents64, fd, buf, sizeof(buf));
        if (got <= 0)
            return got < 0 ? -1 : 0;
        for (long at = 0; at < got;) {
            const struct dirent64 *ent = (const struct dirent64 *)(buf + at);
            if (visit(ent->d_name, ctx))
                return 1;
            at += ent->d_reclen;
        }
    }
}

/* Whether name is not one kvh makes in a store (nor a file system's own
 * lost+found, which a store at a mount's root sits beside). */
static bool not_store_own(const char *name, void *ctx)
{
    (void)ctx;
    static const char *const own[] = {".", "..", "LOCK", "index", "journal", "index.tmp", "journal.tmp", "lost+found"};
    for (size_t i = 0; i < sizeof(own) / sizeof(own[0]); i++)
        if (strcmp(name, own[i]) == 0)
            return false;
    unsigned n = 0;
    int end = 0;
    return !(sscanf(name, "slab-%u.kvh%n", &n, &end) == 1 && name[end] == '\0');
}

/* Whether dir holds an entry that is not a store's own (false too when
 * the listing fails). Read from dir_fd itself (its offset is used for
 * nothing else): no other descriptor of the store's directory for a fork
 * to inherit. */
static bool has_other_entry(int dir_fd)
{
    bool found = lseek(dir_fd, 0, SEEK_SET) == 0 && kvhi_dir_find(dir_fd, not_store_own, NULL) > 0;
    lseek(dir_fd, 0, SEEK_SET);
    return found;
}

/* Whether an index or journal file is another program's (a FIFO, a
 * directory, a device, or bytes other than kvh's magic; an empty file is
 * a store whose creation was cut short). */
static bool index_file_foreign(int dir_fd, const char *name)
{
    /* Non-blocking: a FIFO in its place would block the open until a
     * writer came (for ever). */
    int fd = openat(dir_fd, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return errno != ENOENT;
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return true;
    }
    uint8_t first[8];
    ssize_t n = pread(fd, first, sizeof(first), 0);
    close(fd);
    return n != 0 && !(n == (ssize_t)sizeof(first) && kvhi_index_magic_is_kvh(first));
}

/* Why dir is no place for a store, into why; false when it may be one.
 * Refused before anything in it changes (its mode narrowed, a LOCK
 * written, its `index` replaced): an index or journal another program
 * wrote where no slab says a store lives (a LOCK says nothing: LevelDB
 * and others make one too). */
static bool not_a_store_dir(int dir_fd, char *why, size_t why_len)
{
    if (faccessat(dir_fd, "slab-0000.kvh", F_OK, AT_SYMLINK_NOFOLLOW) == 0)
        return false;
    static const char *const names[] = {"index", "journal"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (index_file_foreign(dir_fd, names[i])) {
            snprintf(why, why_len, "holds a file named '%s' that kvh did not write, and no store", names[i]);
            return true;
        }
    }
    return false;
}

/* path without trailing slashes or "/." components: with them, O_NOFOLLOW
 * does not stop a symbolic link in the last real component ("link/"
 * resolves through it). NULL without memory. */
static char *store_path_trimmed(const char *path)
{
    size_t n = strlen(path);
    char *p = malloc(n + 1);
    if (!p)
        return NULL;
    memcpy(p, path, n + 1);
    for (;;) {
        if (n > 1 && p[n - 1] == '/')
            p[--n] = '\0';
        else if (n > 2 && p[n - 1] == '.' && p[n - 2] == '/')
            p[n -= 2] = '\0';
        else if (n == 2 && p[0] == '/' && p[1] == '.')
            p[n = 1] = '\0';
        else
            return p;
    }
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

static kvh_status open_dir_trimmed(kvhi_disk *d, const char *path);

kvh_status kvhi_store_open_dir(kvhi_disk *d, const char *given)
{
    char *path = store_path_trimmed(given);
    if (!path)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory opening the disk tier");
    kvh_status st = open_dir_trimmed(d, path);
    free(path);
    return st;
}

static kvh_status open_dir_trimmed(kvhi_disk *d, const char *path)
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
    char why[320];
    if (!made && !d->read_only && not_a_store_dir(d->dir_fd, why, sizeof(why)))
        return kvhi_fail(KVH_ERR_IO, "%s %s: not a kvh store directory (give disk_path a directory of its own)", path,
                         why);
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
    /* A directory that holds other files too (a home, a project, a mount's
     * root given as disk_path) keeps its mode: narrowing it would lock
     * other users out of what is not kvh's. kvh's own files still get
     * theirs, and no one else may write to it (checked at open). */
    if (has_other_entry(d->dir_fd))
        want = st.st_mode & 0777;
    if ((st.st_mode & 07777) != (keep | want) && fchmod(d->dir_fd, keep | want) != 0)
        return kvhi_fail(KVH_ERR_IO, "cannot set %s to mode %04o: %s", d->path, (unsigned)want, strerror(errno));
    mode_t file_want = kvhi_store_file_mode(d->disk_flags);
    if (d->lock_fd >= 0 && fstat(d->lock_fd, &st) == 0 && (st.st_mode & 0777) != file_want &&
        fchmod(d->lock_fd, file_want) != 0)
        return kvhi_fail(KVH_ERR_IO, "cannot set %s/LOCK to mode %04o: %s", d->path, (unsigned)file_want,
                         strerror(errno));
    return KVH_OK;
}

static int store_openat_once(const kvhi_disk *d, const char *name, int flags, bool set_mode)
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
    else if (st.st_nlink > 1 && !d->read_only)
        rc = -EMLINK; /* written in place, it would change the file another link names */
    else if (set_mode && (st.st_mode & 0777) != want && !d->read_only && fchmod(fd, want) != 0)
        rc = -errno;
    if (rc != 0) {
        close(fd);
        return rc;
    }
    return fd;
}

static int store_openat(const kvhi_disk *d, const char *name, int flags, bool set_mode)
{
    int fd = store_openat_once(d, name, flags, set_mode);
    if (fd != -EACCES || d->read_only)
        return fd;
    /* The owner's read and write bits taken away (chmod -R a-w): given back
     * as kvh.h says, for a regular file of this user only, and never
     * through a link. */
    struct stat st;
    if (fstatat(d->dir_fd, name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid() ||
        fchmodat(d->dir_fd, name, (st.st_mode & 0777) | S_IRUSR | S_IWUSR, AT_SYMLINK_NOFOLLOW) != 0)
        return fd;
    return store_openat_once(d, name, flags, set_mode);
}

const char *kvhi_store_file_error(int rc)
{
    switch (rc) {
    case -EPERM:
        return "not a regular file of this process's user";
    case -EMLINK:
        return "other hard links lead to it, and kvh writes its files in place";
    case -ELOOP:
        return "a symbolic link stands in its place";
    default:
        return strerror(-rc);
    }
}

int kvhi_store_openat(const kvhi_disk *d, const char *name, int flags) { return store_openat(d, name, flags, true); }

int kvhi_store_openat_as_found(const kvhi_disk *d, const char *name, int flags)
{
    return store_openat(d, name, flags, false);
}
