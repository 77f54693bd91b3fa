#include "core/huge_alloc.h"

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

void *kvhi_map_anon(size_t bytes)
{
    if (bytes == 0)
        return NULL;
    size_t slack = bytes >= KVHI_HUGE_PAGE_BYTES ? KVHI_HUGE_PAGE_BYTES : 0;
    if (bytes > SIZE_MAX - slack)
        return NULL; /* bytes + slack would wrap to a small mapping */
    uint8_t *raw = mmap(NULL, bytes + slack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED)
        return NULL;
    uint8_t *p = raw;
    if (slack) {
        p = (uint8_t *)(((uintptr_t)raw + KVHI_HUGE_PAGE_BYTES - 1) & ~(uintptr_t)(KVHI_HUGE_PAGE_BYTES - 1));
        if (p > raw)
            munmap(raw, (size_t)(p - raw));
        /* The tail starts at the page after the last byte: munmap takes
         * page-aligned addresses only, and a free unmaps [p, p + bytes)
         * rounded up to whole pages, so anything past that stays mapped
         * for good. */
        size_t page = (size_t)sysconf(_SC_PAGESIZE);
        uint8_t *end = (uint8_t *)(((uintptr_t)p + bytes + page - 1) & ~(uintptr_t)(page - 1));
        if (raw + bytes + slack > end)
            munmap(end, (size_t)(raw + bytes + slack - end));
#ifdef MADV_HUGEPAGE
        madvise(p, bytes, MADV_HUGEPAGE);
#endif
    }
    return p;
}

int kvhi_populate(void *p, size_t bytes)
{
    if (!p || bytes == 0)
        return 0;
#ifdef MADV_POPULATE_WRITE
    if (madvise(p, bytes, MADV_POPULATE_WRITE) == 0)
        return 0;
    if (errno != EINVAL) /* EINVAL: a kernel before 5.14 */
        return -1;
#endif
    /* A write per page faults it in; the range is still all zeros and
     * nobody else uses it yet, so writing a zero changes nothing. */
    volatile uint8_t *b = p;
    for (size_t off = 0; off < bytes; off += 4096)
        b[off] = 0;
    return 0;
}

static uint64_t (*mem_available_hook)(void);
static const char *proc_self_cgroup = "/proc/self/cgroup";
static const char *cgroup_root = "/sys/fs/cgroup";

void kvhi_set_mem_available_hook(uint64_t (*hook)(void)) { mem_available_hook = hook; }

void kvhi_set_cgroup_paths(const char *proc_cgroup, const char *root)
{
    proc_self_cgroup = proc_cgroup ? proc_cgroup : "/proc/self/cgroup";
    cgroup_root = root ? root : "/sys/fs/cgroup";
}

/* The number a cgroup file starts with ("max": none); false when it
 * cannot be read. */
static bool read_cgroup_value(const char *dir, const char *name, uint64_t *out)
{
    char path[4352];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "r");
    if (!f)
        return false;
    char text[32] = "";
    bool ok = fgets(text, sizeof(text), f) != NULL;
    fclose(f);
    unsigned long long v;
    if (ok && strncmp(text, "max", 3) == 0)
        *out = UINT64_MAX;
    else if (ok && sscanf(text, "%llu", &v) == 1)
        *out = v;
    else
        return false;
    return true;
}

/* What this process's memory cgroup and its ancestors still let it
 * charge: the least limit less usage over the levels that have a limit
 * (cgroup v2 memory.max / memory.current; v1 memory.limit_in_bytes /
 * memory.usage_in_bytes, whose "none" is a number near 2^63).
 * UINT64_MAX when no level limits it or nothing can be read. */
static uint64_t cgroup_headroom(void)
{
    FILE *f = fopen(proc_self_cgroup, "r");
    if (!f)
        return UINT64_MAX;
    char line[4096], v1[4096] = "", v2[4096] = "";
    bool have_v1 = false, have_v2 = false;
    while (fgets(line, sizeof(line), f)) {
        line[strcspn(line, "\n")] = '\0';
        char *controllers = strchr(line, ':');
        char *path = controllers ? strchr(controllers + 1, ':') : NULL;
        if (!path)
            continue;
        *path++ = '\0';
        *controllers++ = '\0'; /* line: the hierarchy id */
        if (*controllers == '\0' && strcmp(line, "0") == 0) {
            snprintf(v2, sizeof(v2), "%s", path);
            have_v2 = true;
            continue;
        }
        char *save = NULL; /* engines may open on several threads at once */
        for (char *c = strtok_r(controllers, ",", &save); c; c = strtok_r(NULL, ",", &save))
            if (strcmp(c, "memory") == 0) {
                snprintf(v1, sizeof(v1), "%s", path);
                have_v1 = true;
            }
    }
    fclose(f);
    if (!have_v1 && !have_v2)
        return UINT64_MAX;
    const char *limit_name = have_v1 ? "memory.limit_in_bytes" : "memory.max";
    const char *usage_name = have_v1 ? "memory.usage_in_bytes" : "memory.current";
    char dir[4352];
    size_t base = (size_t)snprintf(dir, sizeof(dir), "%s%s", cgroup_root, have_v1 ? "/memory" : "");
    if (base >= sizeof(dir))
        return UINT64_MAX;
    snprintf(dir + base, sizeof(dir) - base, "%s", have_v1 ? v1 : v2);
    uint64_t least = UINT64_MAX;
    for (;;) {
        size_t len = strlen(dir);
        while (len > base && dir[len - 1] == '/') /* "/": the root itself */
            dir[--len] = '\0';
        uint64_t limit, usage;
        if (read_cgroup_value(dir, limit_name, &limit) && limit < (1ull << 62) &&
            read_cgroup_value(dir, usage_name, &usage)) {
            uint64_t room = limit > usage ? limit - usage : 0;
            if (room < least)
                least = room;
        }
        char *slash = strrchr(dir + base, '/');
        if (len <= base || !slash)
            break;
        *slash = '\0';
    }
    return least;
}

uint64_t kvhi_mem_available(void)
{
    if (mem_available_hook)
        return mem_available_hook();
    uint64_t available = UINT64_MAX;
    FILE *f = fopen("/proc/meminfo", "r");
    if (f) {
        char line[128];
        unsigned long long kb = 0;
        bool found = false;
        while (!found && fgets(line, sizeof(line), f))
            found = sscanf(line, "MemAvailable: %llu kB", &kb) == 1;
        fclose(f);
        if (found)
            available = (uint64_t)kb << 10;
    }
    uint64_t room = cgroup_headroom();
    return room < available ? room : available;
}

void *kvhi_huge_alloc(size_t bytes)
{
    if (bytes == 0)
        return NULL;
    if (bytes >= KVHI_HUGE_PAGE_BYTES)
        return kvhi_map_anon(bytes);
    size_t rounded = (bytes + 63) & ~(size_t)63; /* aligned_alloc wants a multiple */
    void *p = aligned_alloc(64, rounded);
    if (p)
        memset(p, 0, rounded);
    return p;
}

void kvhi_huge_free(void *p, size_t bytes)
{
    if (!p)
        return;
    if (bytes >= KVHI_HUGE_PAGE_BYTES)
        munmap(p, bytes);
    else
        free(p);
}
