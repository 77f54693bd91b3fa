/* Memory for big arrays indexed by block: block records, eviction heaps,
 * long block tables, and the CPU backend's tier arenas.
 *
 * At 10^6..10^7 blocks these arrays span hundreds of MB to GB and are read
 * at random, so with 4 KiB pages nearly every access also misses the TLB
 * and walks page tables that are themselves out of the caches (twice over
 * in a virtual machine). Transparent huge pages need the advice and a
 * 2 MiB-aligned range, which malloc gives neither. */
#ifndef KVH_CORE_HUGE_ALLOC_H
#define KVH_CORE_HUGE_ALLOC_H

#include <stddef.h>
#include <stdint.h>

#define KVHI_HUGE_PAGE_BYTES ((size_t)2 << 20)

/* An anonymous mapping of bytes, lazily backed and zeroed; from 2 MiB up
 * it starts on a 2 MiB boundary and is advised for huge pages. NULL on
 * failure or bytes == 0. Release with munmap(p, bytes). */
void *kvhi_map_anon(size_t bytes);

/* Backs every page of [p, p + bytes) of a fresh kvhi_map_anon mapping
 * now, so that no later first touch stops for a fault (with huge pages,
 * possibly for a compaction). Only before anything else uses the range.
 * Returns 0, or -1 with errno when a page could not be backed. */
int kvhi_populate(void *p, size_t bytes);

/* The memory this process can be given without swapping or an OOM kill,
 * in bytes: MemAvailable of /proc/meminfo, or less where its memory
 * cgroup (or an ancestor) has a limit: that limit less the cgroup's usage
 * (in a container /proc/meminfo describes the host). UINT64_MAX when
 * nothing can be read. Tests may stand in for it with
 * kvhi_set_mem_available_hook, or point the cgroup files elsewhere
 * (kvhi_set_cgroup_paths: /proc/self/cgroup and /sys/fs/cgroup; NULL
 * restores each). */
uint64_t kvhi_mem_available(void);
void kvhi_set_mem_available_hook(uint64_t (*hook)(void));
void kvhi_set_cgroup_paths(const char *proc_self_cgroup, const char *cgroup_root);

/* Zeroed, 64-byte aligned: kvhi_map_anon from 2 MiB up (where a page of
 * slack is negligible), the C heap below. NULL on failure or bytes == 0. */
void *kvhi_huge_alloc(size_t bytes);
/* p from kvhi_huge_alloc(bytes), the same bytes; NULL is ignored. */
void kvhi_huge_free(void *p, size_t bytes);

#endif
