/* Whether the CUDA backend treats a device as unified memory, and how:
 *
 *   2  one physical memory for CPU and GPU (cudaDevAttrIntegrated): the
 *      device tier lives in managed memory and the host tier in the same
 *      arena, so a block moves between them without a copy;
 *   1  separate memories the CPU and GPU both address coherently
 *      (cudaDevAttrPageableMemoryAccessUsesHostPageTables: Grace Hopper
 *      and other ATS/HMM systems): the device tier lives in managed
 *      memory the CPU reads and writes directly, so moves are plain CPU
 *      copies and weights are re-accounted, but the host tier stays in
 *      host memory, where its capacity is;
 *   0  discrete: device memory, DMA copies.
 *
 * KVH_CUDA_UNIFIED overrides the detection with "0", "1" or "2" (to test
 * those paths on a discrete card). Pure, so it is unit-tested without a
 * GPU. */
#ifndef KVH_KERNELS_CUDA_UNIFIED_MEMORY_H
#define KVH_KERNELS_CUDA_UNIFIED_MEMORY_H

static inline int kvhc_memory_is_unified(int integrated, int pageable_uses_host_page_tables, const char *override)
{
    if (override && override[0] >= '0' && override[0] <= '2' && override[1] == 0)
        return override[0] - '0';
    if (integrated)
        return 2;
    return pageable_uses_host_page_tables ? 1 : 0;
}

#endif
