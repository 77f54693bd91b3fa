/* Shared helpers of the fuzz targets (fuzz/fuzz_*.c).
 *
 * Each target defines LLVMFuzzerTestOneInput. The same sources build two
 * ways: with clang and -fsanitize=fuzzer,address,undefined as libFuzzer
 * targets (-DKVH_FUZZ=ON, `make fuzz`), and with any compiler together with
 * fuzz/replay_main.c as ordinary programs that replay the committed corpus
 * (fuzz/corpus/<target>/) as ctest tests (fuzz_<target>_replay).
 *
 * A property a target checks (beyond "no crash, no sanitizer report") fails
 * through FZ_CHECK, which prints what broke and aborts: libFuzzer saves the
 * input, the replay test fails. */
#ifndef KVH_FUZZ_COMMON_H
#define KVH_FUZZ_COMMON_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvh/kvh.h"

#define FZ_CHECK(cond, ...)                                                                                            \
    do {                                                                                                               \
        if (!(cond)) {                                                                                                 \
            fprintf(stderr, "fuzz property failed at %s:%d: %s: ", __FILE__, __LINE__, #cond);                         \
            fprintf(stderr, __VA_ARGS__);                                                                              \
            fprintf(stderr, "\n");                                                                                     \
            abort();                                                                                                   \
        }                                                                                                              \
    } while (0)

/* A status the library documents. */
#define FZ_KNOWN(st) FZ_CHECK((st) <= 0 && (st) >= KVH_ERR_INTERNAL, "undocumented status %d", (int)(st))

/* Reads the input front to back; past the end everything reads as 0. */
typedef struct fz_in {
    const uint8_t *p;
    size_t n, at;
} fz_in;

static inline uint8_t fz_u8(fz_in *in) { return in->at < in->n ? in->p[in->at++] : 0; }
static inline uint16_t fz_u16(fz_in *in) { return (uint16_t)(fz_u8(in) | (uint16_t)fz_u8(in) << 8); }
static inline uint32_t fz_u32(fz_in *in) { return (uint32_t)fz_u16(in) | (uint32_t)fz_u16(in) << 16; }
static inline uint64_t fz_u64(fz_in *in) { return (uint64_t)fz_u32(in) | (uint64_t)fz_u32(in) << 32; }
static inline bool fz_done(const fz_in *in) { return in->at >= in->n; }
static inline size_t fz_left(const fz_in *in) { return in->at < in->n ? in->n - in->at : 0; }

static inline uint64_t fz_mix(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void fz_clear(const char *dir) __attribute__((unused));
static char fz_dir_path[512];

__attribute__((unused)) static void fz_cleanup(void)
{
    if (fz_dir_path[0]) {
        fz_clear(fz_dir_path);
        rmdir(fz_dir_path);
    }
}

/* A scratch directory of this process: $KVH_FUZZ_DIR, else a tmpfs
 * (/dev/shm), else $KVH_TEST_TMPDIR, else /tmp. Made once; removed at
 * exit. */
static inline const char *fz_dir(const char *name)
{
    char *dir = fz_dir_path;
    static char last[64];
    if (dir[0] && !strcmp(last, name))
        return dir;
    if (!dir[0])
        atexit(fz_cleanup);
    fz_cleanup();
    const char *root = getenv("KVH_FUZZ_DIR");
    if (!root || !*root)
        root = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : getenv("KVH_TEST_TMPDIR");
    if (!root || !*root)
        root = "/tmp";
    snprintf(dir, sizeof(fz_dir_path), "%s/kvh-fuzz-%s.%ld", root, name, (long)getpid());
    snprintf(last, sizeof(last), "%s", name);
    mkdir(dir, 0755);
    return dir;
}

/* Removes every file of dir (not the dir). */
__attribute__((unused)) static void fz_clear(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return;
    struct dirent *de;
    char p[1024];
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.')
            continue;
        snprintf(p, sizeof(p), "%s/%s", dir, de->d_name);
        unlink(p);
    }
    closedir(d);
}

static inline int fz_write(const char *dir, const char *name, const void *data, size_t len)
{
    char p[1024];
    snprintf(p, sizeof(p), "%s/%s", dir, name);
    int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return -errno;
    size_t done = 0;
    while (done < len) {
        ssize_t w = write(fd, (const uint8_t *)data + done, len - done);
        if (w <= 0) {
            close(fd);
            return -EIO;
        }
        done += (size_t)w;
    }
    close(fd);
    return 0;
}

#endif
