#include "bench_fs.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
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

/* Scratch directories removed if a signal ends the program (Ctrl-C on a
 * long run): paths kept in fixed slots, the removal made of system calls
 * that a signal handler may make, one level deep (stores are flat). */
#define SCRATCH_SLOTS 8
static char scratch_path[SCRATCH_SLOTS][4096];
static volatile sig_atomic_t scratch_live[SCRATCH_SLOTS];

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

struct dirent64_raw {
    uint64_t ino;
    int64_t off;
    unsigned short reclen;
    unsigned char type;
    char name[];
};

static void remove_flat_dir(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return;
    char buf[4096] __attribute__((aligned(8)));
    long n;
    while ((n = syscall(SYS_getdents64, fd, buf, sizeof(buf))) > 0)
        for (long at = 0; at < n;) {
            struct dirent64_raw *d = (struct dirent64_raw *)(buf + at);
            if (strcmp(d->name, ".") != 0 && strcmp(d->name, "..") != 0)
                unlinkat(fd, d->name, 0);
            at += d->reclen;
        }
    close(fd);
    rmdir(dir);
}

static void remove_scratch_and_die(int sig)
{
    for (int i = 0; i < SCRATCH_SLOTS; i++)
        if (scratch_live[i])
            remove_flat_dir(scratch_path[i]);
    signal(sig, SIG_DFL);
    raise(sig);
}

void bench_scratch_on_signals(void)
{
    static const int sigs[] = {SIGINT, SIGTERM, SIGHUP};
    for (size_t i = 0; i < sizeof(sigs) / sizeof(sigs[0]); i++) {
        struct sigaction sa;
        memset(&sa, 0, sizeof(sa));
        sa.sa_handler = remove_scratch_and_die;
        sigemptyset(&sa.sa_mask);
        struct sigaction old;
        /* A signal the caller ignored stays ignored (nohup). */
        if (sigaction(sigs[i], NULL, &old) == 0 && old.sa_handler != SIG_IGN)
            sigaction(sigs[i], &sa, NULL);
    }
}
