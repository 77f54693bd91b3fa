/* The CPU backend's device tier for views: a memory file (memfd) mapped
 * shared, whose pages views map again with mmap(MAP_FIXED).
 *
 * Backing, best first (KVH_VMAP_BACKING=hugetlb|thp|4k forces one):
 * - hugetlb: MFD_HUGETLB|MFD_HUGE_2MB when HugePages_Free covers the
 *   tier and a slab's piece run is whole 2 MiB pages. A view then maps
 *   2 MiB at a time: one mapping, no per-4 KiB faults. Files of huge
 *   pages cannot be mapped in smaller pieces, so only slab-ordered view
 *   units can be viewed (core/vmap.c).
 * - thp: shmem transparent huge pages (MADV_HUGEPAGE) when
 *   /sys/kernel/mm/transparent_hugepage/shmem_enabled allows them; any
 *   page can still be mapped alone, aligned 2 MiB runs map as one PMD.
 * - 4k: plain shmem pages.
 * Views are populated at map time (MAP_POPULATE) unless
 * KVH_VMAP_POPULATE=0: the first read then takes no fault per page. */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kvh/kvh.h"
#include "core/vmap_cpu_arena.h"

#ifndef MFD_HUGETLB
#define MFD_HUGETLB 0x0004U
#endif
#ifndef MFD_HUGE_2MB
#define MFD_HUGE_2MB (21U << 26)
#endif

#define HUGE_2MB (2ull << 20)

enum backing { BACKING_HUGETLB, BACKING_THP, BACKING_4K };
static const char *const backing_names[] = {"hugetlb", "thp", "4k"};

typedef struct cpu_arena {
    int fd;
    enum backing backing;
    int populate;
    uint8_t *base;
    uint64_t bytes;
    uint64_t unit;
} cpu_arena;

static uint64_t free_huge_2mb_pages(void)
{
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f)
        return 0;
    char line[128];
    unsigned long long free_pages = 0, reserved = 0, size_kb = 0;
    while (fgets(line, sizeof(line), f)) {
        sscanf(line, "HugePages_Free: %llu", &free_pages);
        sscanf(line, "HugePages_Rsvd: %llu", &reserved);
        sscanf(line, "Hugepagesize: %llu kB", &size_kb);
    }
    fclose(f);
    /* Free pages include those other mappings have reserved but not yet
     * touched: those are not ours to take. */
    return size_kb == 2048 && free_pages > reserved ? free_pages - reserved : 0;
}

/* The kernel's shmem THP setting is the bracketed word. */
static int shmem_thp_allowed(void)
{
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/shmem_enabled", "r");
    if (!f)
        return 0;
    char buf[256] = "";
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = 0;
    return strstr(buf, "[always]") || strstr(buf, "[within_size]") || strstr(buf, "[advise]") || strstr(buf, "[force]");
}

int kvhi_vmap_cpu_backing_available(const char *name, const kvhi_slab_layout *l, uint64_t bytes)
{
    if (!strcmp(name, "4k"))
        return 1;
    if (!strcmp(name, "thp"))
        return shmem_thp_allowed();
    if (!strcmp(name, "hugetlb"))
        return (kvhi_slab_pitch(l) % HUGE_2MB) == 0 && bytes % HUGE_2MB == 0 &&
               free_huge_2mb_pages() >= bytes / HUGE_2MB;
    return 0;
}

static int pick_backing(const kvhi_slab_layout *l, uint64_t bytes, const char *want, enum backing *out, char *msg,
                        size_t len)
{
    if (!want || !*want)
        want = secure_getenv("KVH_VMAP_BACKING");
    if (want && *want) {
        for (int b = 0; b < 3; b++)
            if (!strcmp(want, backing_names[b])) {
                if (!kvhi_vmap_cpu_backing_available(want, l, bytes)) {
                    snprintf(msg, len,
                             "vmap backing %s is not available here (hugetlb: HugePages_Free must cover the tier "
                             "and a slab's head run be whole 2 MiB pages; thp: shmem_enabled must allow it)",
                             want);
                    return KVH_ERR_UNSUPPORTED;
                }
                *out = (enum backing)b;
                return 0;
            }
        snprintf(msg, len, "unknown vmap backing \"%s\" (hugetlb, thp, 4k)", want);
        return KVH_ERR_INVALID_ARG;
    }
    *out = kvhi_vmap_cpu_backing_available("hugetlb", l, bytes) ? BACKING_HUGETLB
           : shmem_thp_allowed()                                ? BACKING_THP
                                                                : BACKING_4K;
    return 0;
}

/* The tier's memory file under backing b, mapped: 0, or a status with
 * msg filled. */
static int map_arena(cpu_arena *a, enum backing b, uint64_t bytes, char *msg, size_t len)
{
    a->backing = b;
    a->bytes = bytes;
    a->unit = b == BACKING_HUGETLB ? HUGE_2MB : (uint64_t)sysconf(_SC_PAGESIZE);
    a->fd = memfd_create("kvh-device-tier", MFD_CLOEXEC | (b == BACKING_HUGETLB ? MFD_HUGETLB | MFD_HUGE_2MB : 0));
    if (a->fd < 0) {
        snprintf(msg, len, "memfd_create for the device tier failed: %s", strerror(errno));
        return KVH_ERR_NOMEM;
    }
    if (ftruncate(a->fd, (off_t)bytes) != 0) {
        snprintf(msg, len, "cannot size the device tier file to %llu bytes: %s", (unsigned long long)bytes,
                 strerror(errno));
        close(a->fd);
        return KVH_ERR_NOMEM;
    }
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, a->fd, 0);
    if (p == MAP_FAILED) {
        snprintf(msg, len, "cannot map the device tier file (%s pages): %s", backing_names[b], strerror(errno));
        close(a->fd);
        return KVH_ERR_NOMEM;
    }
#ifdef MADV_HUGEPAGE
    if (b == BACKING_THP)
        madvise(p, bytes, MADV_HUGEPAGE);
#endif
    a->base = p;
    return 0;
}

int kvhi_vmap_cpu_arena_create(void *ctx, const kvhi_slab_layout *layout, uint64_t bytes, const char *backing,
                               void **arena, void **base, uint64_t *map_unit, const char **backing_used, char *msg,
                               size_t len)
{
    (void)ctx;
    enum backing b;
    int rc = pick_backing(layout, bytes, backing, &b, msg, len);
    if (rc != 0)
        return rc;
    cpu_arena *a = calloc(1, sizeof(*a));
    if (!a) {
        snprintf(msg, len, "out of memory");
        return KVH_ERR_NOMEM;
    }
    const char *pop = secure_getenv("KVH_VMAP_POPULATE");
    a->populate = !(pop && !strcmp(pop, "0"));
    const char *env_backing = secure_getenv("KVH_VMAP_BACKING");
    bool chosen = (backing && *backing) || (env_backing && *env_backing);
    rc = map_arena(a, b, bytes, msg, len);
    if (rc != 0 && b == BACKING_HUGETLB && !chosen) {
        /* The free huge pages were counted a moment ago; another process
         * may have taken them since. Picked here, not asked for: the next
         * best backing will do. */
        b = shmem_thp_allowed() ? BACKING_THP : BACKING_4K;
        rc = map_arena(a, b, bytes, msg, len);
    }
    if (rc != 0) {
        free(a);
        return rc;
    }
    *arena = a;
    *base = a->base;
    *map_unit = a->unit;
    *backing_used = backing_names[b];
    return 0;
}

void kvhi_vmap_cpu_arena_destroy(void *ctx, void *arena)
{
    (void)ctx;
    cpu_arena *a = arena;
    if (!a)
        return;
    munmap(a->base, a->bytes);
    close(a->fd);
    free(a);
}

int kvhi_vmap_cpu_reserve(void *ctx, void *arena, uint64_t bytes, void **base, char *msg, size_t len)
{
    (void)ctx;
    cpu_arena *a = arena;
    uint64_t span = bytes + a->unit;
    uint8_t *p = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        snprintf(msg, len, "cannot reserve %llu bytes of address space: %s", (unsigned long long)bytes,
                 strerror(errno));
        return KVH_ERR_NOMEM;
    }
    /* Align to the unit and give back the slack on both sides. */
    uint8_t *al = (uint8_t *)(((uintptr_t)p + a->unit - 1) & ~(uintptr_t)(a->unit - 1));
    if (al > p)
        munmap(p, (size_t)(al - p));
    if (p + span > al + bytes)
        munmap(al + bytes, (size_t)(p + span - (al + bytes)));
    *base = al;
    return 0;
}

void kvhi_vmap_cpu_unreserve(void *ctx, void *arena, void *base, uint64_t bytes)
{
    (void)ctx, (void)arena;
    munmap(base, bytes);
}

int kvhi_vmap_cpu_map(void *ctx, void *arena, void *dst, uint64_t off, uint64_t bytes, char *msg, size_t len)
{
    (void)ctx;
    cpu_arena *a = arena;
    int flags = MAP_SHARED | MAP_FIXED | (a->populate ? MAP_POPULATE : 0);
    void *r = mmap(dst, bytes, PROT_READ, flags, a->fd, (off_t)off);
    if (r == MAP_FAILED) {
        snprintf(msg, len, "mmap of %llu bytes of the device tier: %s", (unsigned long long)bytes, strerror(errno));
        return KVH_ERR_NOMEM;
    }
#ifdef MADV_HUGEPAGE
    if (a->backing == BACKING_THP)
        madvise(dst, bytes, MADV_HUGEPAGE);
#endif
    return 0;
}

int kvhi_vmap_cpu_unmap(void *ctx, void *arena, void *dst, uint64_t bytes, char *msg, size_t len)
{
    (void)ctx, (void)arena;
    /* Zero pages, not a hole: addresses handed out before a truncation
     * (a binding's arrays) read zeros instead of faulting, and see nothing
     * of the slots' next owners. */
    void *r = mmap(dst, bytes, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    if (r == MAP_FAILED) {
        snprintf(msg, len, "unmapping %llu bytes of a view: %s", (unsigned long long)bytes, strerror(errno));
        return KVH_ERR_NOMEM;
    }
    return 0;
}
