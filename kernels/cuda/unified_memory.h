/* Whether the CUDA backend treats a device as unified memory: the device
 * tier then lives in managed memory that the CPU addresses directly, and
 * moves between the device and host tiers need no DMA copy.
 *
 * Unified: an integrated GPU (cudaDevAttrIntegrated: the GPU and CPU
 * share one DRAM), or a GPU that walks the host's page tables
 * (cudaDevAttrPageableMemoryAccessUsesHostPageTables: Grace Hopper and
 * other ATS/HMM systems with coherent CPU access). KVH_CUDA_UNIFIED
 * overrides the detection: "0" forces discrete handling, "1" forces
 * managed memory on any GPU (to test that path on a discrete card).
 * Pure, so it is unit-tested without a GPU. */
#ifndef KVH_KERNELS_CUDA_UNIFIED_MEMORY_H
#define KVH_KERNELS_CUDA_UNIFIED_MEMORY_H

static inline int kvhc_memory_is_unified(int integrated, int pageable_uses_host_page_tables, const char *override)
{
    if (override && override[0] == '0' && override[1] == 0)
        return 0;
    if (override && override[0] == '1' && override[1] == 0)
        return 1;
    return integrated != 0 || pageable_uses_host_page_tables != 0;
}

#endif
