#include "bench_fs.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    (void)flag;
    (void)ftw;
    return remove(path);
}

int bench_remove_tree(const char *path)
{
    struct stat st;
    if (lstat(path, &st) != 0)
        return errno == ENOENT ? 0 : -1;
    return nftw(path, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* Scratch files and directories removed, and child processes stopped,
 * if a signal ends the program (Ctrl-C on a long run, a closed pipe):
 * paths and pids kept in fixed slots, the removal made of system calls
 * that a signal handler may make. */
#define SCRATCH_SLOTS 8
static char scratch_path[SCRATCH_SLOTS][4096];
static volatile sig_atomic_t scratch_live[SCRATCH_SLOTS];
static volatile sig_atomic_t child_pid[SCRATCH_SLOTS];

int bench_scratch_add(const char *path)
{
    for (int i = 0; i < SCRATCH_SLOTS; i++)
        if (!scratch_live[i] && strlen(path) < sizeof(scratch_path[i])) {
            strcpy(scratch_path[i], path);
            scratch_live[i] = 1;
            return i;
        }
    return -1;
}

void bench_scratch_drop(int slot)
{
    if (slot >= 0 && slot < SCRATCH_SLOTS)
        scratch_live[slot] = 0;
}

int bench_child_add(pid_t pid)
{
    for (int i = 0; i < SCRATCH_SLOTS; i++)
        if (!child_pid[i]) {
            child_pid[i] = pid;
            return i;
        }
    return -1;
}

void bench_child_drop(int slot)
{
    if (slot >= 0 && slot < SCRATCH_SLOTS)
        child_pid[slot] = 0;
}

struct dirent64_raw {
    uint64_t ino;
    int64_t off;
    unsigned short reclen;
    unsigned char type;
    char name[];
};

/* Removes name under dir_fd, a file or a tree at most depth levels deep,
 * never following a link. */
static void remove_at(int dir_fd, const char *name, int depth)
{
    if (unlinkat(dir_fd, name, 0) == 0 || errno == ENOENT || depth == 0)
        return;
    int fd = openat(dir_fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return;
    /* Entries removed while listed can make a pass skip some: a few
     * passes, until the directory goes. */
    for (int pass = 0; pass < 4 && unlinkat(dir_fd, name, AT_REMOVEDIR) != 0; pass++) {
        lseek(fd, 0, SEEK_SET);
        char buf[2048] __attribute__((aligned(8)));
        long n;
        while ((n = syscall(SYS_getdents64, fd, buf, sizeof(buf))) > 0)
            for (long at = 0; at < n;) {
                struct dirent64_raw *d = (struct dirent64_raw *)(buf + at);
                if (strcmp(d->name, ".") != 0 && strcmp(d->name, "..") != 0)
                    remove_at(fd, d->name, depth - 1);
                at += d->reclen;
            }
    }
    close(fd);
}

static void remove_scratch_and_die(int sig)
{
    int saved = errno;
    for (int i = 0; i < SCRATCH_SLOTS; i++)
        if (child_pid[i] > 0) {                  /* before its files go: it may hold them open */
            kill(-(pid_t)child_pid[i], SIGKILL); /* its group, where it leads one */
            kill((pid_t)child_pid[i], SIGKILL);
        }
    for (int i = 0; i < SCRATCH_SLOTS; i++)
        if (scratch_live[i])
            remove_at(AT_FDCWD, scratch_path[i], 4);
    errno = saved;
    signal(sig, SIG_DFL);
    raise(sig);
}

void bench_scratch_on_signals(void)
{
    static const int sigs[] = {SIGINT, SIGTERM, SIGHUP, SIGPIPE};
    for (size_t i = 0; i < sizeof(sigs) / sizeof(sigs[0]); i++) {
        struct sigaction sa;
        memset(&sa, 0, sizeof(sa));
        sa.sa_handler = remove_scratch_and_die;
        sigemptyset(&sa.sa_mask);
        for (size_t j = 0; j < sizeof(sigs) / sizeof(sigs[0]); j++)
            sigaddset(&sa.sa_mask, sigs[j]); /* one removal at a time */
        struct sigaction old;
        /* A signal the caller ignored stays ignored (nohup). */
        if (sigaction(sigs[i], NULL, &old) == 0 && old.sa_handler != SIG_IGN)
            sigaction(sigs[i], &sa, NULL);
    }
}

int bench_dir_check(const char *dir, char *why, size_t why_len)
{
    struct stat st;
    if (stat(dir, &st) != 0) {
        snprintf(why, why_len, "%s: %s", dir, strerror(errno));
        return -1;
    }
    if (!S_ISDIR(st.st_mode)) {
        snprintf(why, why_len, "%s: %s", dir, strerror(ENOTDIR));
        return -1;
    }
    /* Another user who owns dir, or may rename what is in it, could put
     * a link where the scratch directory was while it is written. */
    if (st.st_uid != geteuid() && st.st_uid != 0) {
        snprintf(why, why_len, "%s belongs to another user (uid %u)", dir, (unsigned)st.st_uid);
        return -1;
    }
    if ((st.st_mode & (S_IWGRP | S_IWOTH)) && !(st.st_mode & S_ISVTX)) {
        snprintf(why, why_len, "%s is writable by other users and not sticky (chmod +t, or another directory)", dir);
        return -1;
    }
    return 0;
}

int bench_scratch_dir_make(const char *parent, const char *prefix, char *out, size_t out_len, char *why, size_t why_len)
{
    if (bench_dir_check(parent, why, why_len) != 0)
        return BENCH_DIR_UNFIT;
    /* Cut short, the path would name another directory than parent. */
    if (snprintf(out, out_len, "%s/%s-XXXXXX", parent, prefix) >= (int)out_len) {
        snprintf(why, why_len, "%s is too long", parent);
        return BENCH_DIR_UNFIT;
    }
    if (!mkdtemp(out)) {
        snprintf(why, why_len, "cannot make a scratch directory in %s (%s)", parent, strerror(errno));
        return BENCH_DIR_FAILED;
    }
    return bench_scratch_add(out);
}

int bench_scratch_dir_remove(const char *path, int slot)
{
    int rc = bench_remove_tree(path);
    bench_scratch_drop(slot);
    return rc;
}
