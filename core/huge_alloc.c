#include "core/huge_alloc.h"

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

void *kvhi_map_anon(size_t bytes)
{
    if (bytes == 0)
        return NULL;
    size_t slack = bytes >= KVHI_HUGE_PAGE_BYTES ? KVHI_HUGE_PAGE_BYTES : 0;
    uint8_t *raw = mmap(NULL, bytes + slack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED)
        return NULL;
    uint8_t *p = raw;
    if (slack) {
        p = (uint8_t *)(((uintptr_t)raw + KVHI_HUGE_PAGE_BYTES - 1) & ~(uintptr_t)(KVHI_HUGE_PAGE_BYTES - 1));
        if (p > raw)
            munmap(raw, (size_t)(p - raw));
        size_t tail = (size_t)(raw + bytes + slack - (p + bytes));
        if (tail)
            munmap(p + bytes, tail);
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

void kvhi_set_mem_available_hook(uint64_t (*hook)(void)) { mem_available_hook = hook; }

uint64_t kvhi_mem_available(void)
{
    if (mem_available_hook)
        return mem_available_hook();
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f)
        return UINT64_MAX;
    char line[128];
    unsigned long long kb = 0;
    bool found = false;
    while (!found && fgets(line, sizeof(line), f))
        found = sscanf(line, "MemAvailable: %llu kB", &kb) == 1;
    fclose(f);
    return found ? (uint64_t)kb << 10 : UINT64_MAX;
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
