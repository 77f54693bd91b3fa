/* Views on CUDA (kvh_seq_vmap): a device tier made of physical allocations
 * that views map a second time, with the driver's virtual memory
 * management (VMM) API.
 *
 * Memory: the tier is n chunks of one map unit each (the device's minimum
 * VMM granularity, 2 MiB on current GPUs), one cuMemCreate allocation per
 * chunk: cuMemMap maps a whole allocation only (its offset must be 0), and
 * views map unit by unit, so every unit has to be an allocation of its
 * own. The chunks are mapped once, in order, into one reserved range, read
 * and write: that range is the device tier. A view is another reserved
 * range into which chunks are mapped again (read-only where the driver
 * allows it), so both addresses reach the same memory and nothing is
 * copied.
 *
 * cuMemMap maps only into unmapped addresses and cuMemUnmap removes whole
 * mappings only, so each reservation keeps one flag per unit: a remap
 * unmaps first, an unmap skips units never mapped.
 *
 * Ordering: cuMemUnmap does not wait for kernels still reading the range.
 * The engine never remaps or releases a view while attention queued over
 * it is pending (core/vmap.c); that is what keeps this file free of
 * synchronisation.
 *
 * Driver API: libkvh_cuda does not link libcuda, so the entry points come
 * from the runtime (cudaGetDriverEntryPoint[ByVersion]), once per arena.
 * Every CUresult is checked and reported as "<call>: <text> (<name>)". */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvh/kvh.h"
#include "kernels/cuda/vmap_cuda.h"

namespace
{

struct vmm_api {
    PFN_cuGetErrorName_v6000 error_name;
    PFN_cuGetErrorString_v6000 error_string;
    PFN_cuDeviceGet_v2000 device_get;
    PFN_cuDeviceGetAttribute_v2000 device_attribute;
    PFN_cuMemGetAllocationGranularity_v10020 granularity;
    PFN_cuMemCreate_v10020 create;
    PFN_cuMemRelease_v10020 release;
    PFN_cuMemAddressReserve_v10020 address_reserve;
    PFN_cuMemAddressFree_v10020 address_free;
    PFN_cuMemMap_v10020 map;
    PFN_cuMemUnmap_v10020 unmap;
    PFN_cuMemSetAccess_v10020 set_access;
};

/* These calls have kept their ABI since CUDA 10.2; asking for the 12.0
 * versions works with every driver this runtime can run on. */
const unsigned driver_api_version = 12000;

bool lookup(const char *name, void **fn, char *msg, size_t len)
{
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    *fn = NULL;
#if CUDART_VERSION >= 12050
    cudaError_t err = cudaGetDriverEntryPointByVersion(name, fn, driver_api_version, cudaEnableDefault, &found);
#else
    cudaError_t err = cudaGetDriverEntryPoint(name, fn, cudaEnableDefault, &found);
#endif
    if (err == cudaSuccess && found == cudaDriverEntryPointSuccess && *fn)
        return true;
    if (msg && len)
        snprintf(msg, len, "CUDA driver entry point %s: %s", name,
                 err != cudaSuccess                                 ? cudaGetErrorString(err)
                 : found == cudaDriverEntryPointVersionNotSufficent ? "the driver is too old"
                                                                    : "not found");
    (void)cudaGetLastError();
    return false;
}

int resolve(vmm_api *api, char *msg, size_t len)
{
    const struct {
        const char *name;
        void **slot;
    } table[] = {
        {"cuGetErrorName", (void **)&api->error_name},
        {"cuGetErrorString", (void **)&api->error_string},
        {"cuDeviceGet", (void **)&api->device_get},
        {"cuDeviceGetAttribute", (void **)&api->device_attribute},
        {"cuMemGetAllocationGranularity", (void **)&api->granularity},
        {"cuMemCreate", (void **)&api->create},
        {"cuMemRelease", (void **)&api->release},
        {"cuMemAddressReserve", (void **)&api->address_reserve},
        {"cuMemAddressFree", (void **)&api->address_free},
        {"cuMemMap", (void **)&api->map},
        {"cuMemUnmap", (void **)&api->unmap},
        {"cuMemSetAccess", (void **)&api->set_access},
    };
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++)
        if (!lookup(table[i].name, table[i].slot, msg, len))
            return KVH_ERR_UNSUPPORTED;
    return 0;
}

/* Fills msg with the driver's words for r and returns the kvh status. */
int cu_fail(const vmm_api &api, char *msg, size_t len, const char *what, CUresult r)
{
    const char *name = NULL, *text = NULL;
    if (api.error_name && api.error_name(r, &name) != CUDA_SUCCESS)
        name = NULL;
    if (api.error_string && api.error_string(r, &text) != CUDA_SUCCESS)
        text = NULL;
    if (msg && len)
        snprintf(msg, len, "%s: %s (%s, %d)", what, text ? text : "unknown error", name ? name : "CUresult", (int)r);
    switch (r) {
    case CUDA_ERROR_OUT_OF_MEMORY:
        return KVH_ERR_NOMEM;
    case CUDA_ERROR_NOT_SUPPORTED:
    case CUDA_ERROR_NOT_PERMITTED:
        return KVH_ERR_UNSUPPORTED;
    default:
        return KVH_ERR_INTERNAL;
    }
}

int text_fail(char *msg, size_t len, int status, const char *text)
{
    if (msg && len)
        snprintf(msg, len, "%s", text);
    return status;
}

CUmemAccessDesc access_on(int device, CUmemAccess_flags flags)
{
    CUmemAccessDesc d;
    memset(&d, 0, sizeof(d));
    d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    d.location.id = device;
    d.flags = flags;
    return d;
}

/* A view's address range and which of its units are mapped. */
struct reservation {
    CUdeviceptr base;
    uint64_t bytes;
    uint8_t *mapped; /* one flag per unit */
};

} // namespace

struct kvhc_vmm_arena {
    vmm_api api;
    int device;
    uint64_t unit;
    /* Views are mapped read-only unless the driver refuses that. */
    CUmemAccess_flags view_access;
    CUmemGenericAllocationHandle *chunks;
    size_t n_chunks, n_created, n_pool_mapped;
    CUdeviceptr pool; /* the device tier */
    uint64_t pool_bytes;
    pthread_mutex_t lock; /* guards the reservations */
    reservation *res;     /* sorted by base */
    size_t n_res, cap_res;
};

namespace
{

/* The reservation holding [addr, addr + bytes), or NULL; lock held. */
reservation *find(kvhc_vmm_arena *a, CUdeviceptr addr, uint64_t bytes)
{
    size_t lo = 0, hi = a->n_res;
    while (lo < hi) { /* first reservation with base > addr */
        size_t mid = (lo + hi) / 2;
        if (a->res[mid].base <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == 0)
        return NULL;
    reservation *r = &a->res[lo - 1];
    return addr + bytes <= r->base + r->bytes ? r : NULL;
}

/* Unmaps the mapped units of [first, first + n) of r; lock held. Keeps
 * going after a failure and reports the first. */
int unmap_units(kvhc_vmm_arena *a, reservation *r, uint64_t first, uint64_t n, char *msg, size_t len)
{
    int status = 0;
    for (uint64_t u = first; u < first + n; u++) {
        if (!r->mapped[u])
            continue;
        CUresult cr = a->api.unmap(r->base + u * a->unit, a->unit);
        if (cr == CUDA_SUCCESS)
            r->mapped[u] = 0;
        else if (status == 0)
            status = cu_fail(a->api, msg, len, "cuMemUnmap (view)", cr);
    }
    return status;
}

void free_reservation(kvhc_vmm_arena *a, reservation *r)
{
    (void)unmap_units(a, r, 0, r->bytes / a->unit, NULL, 0);
    (void)a->api.address_free(r->base, r->bytes);
    free(r->mapped);
}

/* Everything the arena holds, in reverse order of making it. */
void teardown(kvhc_vmm_arena *a)
{
    for (size_t i = 0; i < a->n_res; i++)
        free_reservation(a, &a->res[i]);
    for (size_t i = 0; i < a->n_pool_mapped; i++)
        (void)a->api.unmap(a->pool + i * a->unit, a->unit);
    for (size_t i = 0; i < a->n_created; i++)
        (void)a->api.release(a->chunks[i]);
    if (a->pool)
        (void)a->api.address_free(a->pool, a->pool_bytes);
    free(a->chunks);
    free(a->res);
    pthread_mutex_destroy(&a->lock);
    free(a);
}

/* The chunks, reserved range and mappings of a tier of `bytes`. */
int make_pool(kvhc_vmm_arena *a, uint64_t bytes, char *msg, size_t len)
{
    const vmm_api &api = a->api;
    CUdevice dev;
    CUresult r = api.device_get(&dev, a->device);
    if (r != CUDA_SUCCESS)
        return cu_fail(api, msg, len, "cuDeviceGet", r);
    int supported = 0;
    r = api.device_attribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
    if (r != CUDA_SUCCESS)
        return cu_fail(api, msg, len, "cuDeviceGetAttribute (virtual memory management)", r);
    if (!supported) {
        if (msg && len)
            snprintf(msg, len, "CUDA device %d has no virtual memory management (cuMemCreate/cuMemMap)", a->device);
        return KVH_ERR_UNSUPPORTED;
    }
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof(prop));
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = a->device;
    size_t unit = 0;
    r = api.granularity(&unit, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (r != CUDA_SUCCESS)
        return cu_fail(api, msg, len, "cuMemGetAllocationGranularity", r);
    if (unit == 0 || (unit & (unit - 1)) != 0)
        return text_fail(msg, len, KVH_ERR_UNSUPPORTED, "the CUDA VMM granularity is not a power of two");
    a->unit = unit;
    a->n_chunks = (size_t)((bytes + unit - 1) / unit);
    a->pool_bytes = (uint64_t)a->n_chunks * unit;
    a->chunks = (CUmemGenericAllocationHandle *)calloc(a->n_chunks, sizeof(*a->chunks));
    if (!a->chunks)
        return text_fail(msg, len, KVH_ERR_NOMEM, "out of host memory for the device tier's chunk list");
    r = api.address_reserve(&a->pool, a->pool_bytes, unit, 0, 0);
    if (r != CUDA_SUCCESS) {
        a->pool = 0;
        return cu_fail(api, msg, len, "cuMemAddressReserve (device tier)", r);
    }
    for (size_t i = 0; i < a->n_chunks; i++) {
        r = api.create(&a->chunks[i], unit, &prop, 0);
        if (r != CUDA_SUCCESS)
            return cu_fail(api, msg, len, "cuMemCreate (device tier)", r);
        a->n_created++;
        r = api.map(a->pool + i * unit, unit, 0, a->chunks[i], 0);
        if (r != CUDA_SUCCESS)
            return cu_fail(api, msg, len, "cuMemMap (device tier)", r);
        a->n_pool_mapped++;
    }
    CUmemAccessDesc rw = access_on(a->device, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    r = api.set_access(a->pool, a->pool_bytes, &rw, 1);
    if (r != CUDA_SUCCESS)
        return cu_fail(api, msg, len, "cuMemSetAccess (device tier)", r);
    return 0;
}

/* Gives the units mapped at [dst, dst + bytes) the view access. */
int grant_view_access(kvhc_vmm_arena *a, CUdeviceptr dst, uint64_t bytes, char *msg, size_t len)
{
    CUmemAccessDesc d = access_on(a->device, a->view_access);
    CUresult r = a->api.set_access(dst, bytes, &d, 1);
    if ((r == CUDA_ERROR_INVALID_VALUE || r == CUDA_ERROR_NOT_SUPPORTED) &&
        a->view_access == CU_MEM_ACCESS_FLAGS_PROT_READ) {
        /* No read-only device mappings here: views become read-write
         * (the engine never writes through them). */
        a->view_access = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        d = access_on(a->device, a->view_access);
        r = a->api.set_access(dst, bytes, &d, 1);
    }
    return r == CUDA_SUCCESS ? 0 : cu_fail(a->api, msg, len, "cuMemSetAccess (view)", r);
}

bool unit_multiple(const kvhc_vmm_arena *a, uint64_t x) { return (x & (a->unit - 1)) == 0; }

} // namespace

int kvhc_vmm_arena_create(int device, const kvhi_slab_layout *layout, uint64_t bytes, const char *backing,
                          kvhc_vmm_arena **arena, void **base, uint64_t *map_unit, const char **backing_used, char *msg,
                          size_t len)
{
    (void)layout; /* any layout: the tier is whole units, views check fit */
    if (backing && *backing && strcmp(backing, KVHC_VMM_BACKING) != 0) {
        if (msg && len)
            snprintf(msg, len, "vmap backing \"%s\" is not available on CUDA (only %s)", backing, KVHC_VMM_BACKING);
        return KVH_ERR_UNSUPPORTED;
    }
    if (bytes == 0)
        return text_fail(msg, len, KVH_ERR_INVALID_ARG, "a device tier of 0 bytes");
    kvhc_vmm_arena *a = (kvhc_vmm_arena *)calloc(1, sizeof(*a));
    if (!a)
        return text_fail(msg, len, KVH_ERR_NOMEM, "out of host memory");
    pthread_mutex_init(&a->lock, NULL);
    a->device = device;
    a->view_access = CU_MEM_ACCESS_FLAGS_PROT_READ;
    int rc = resolve(&a->api, msg, len);
    if (rc == 0)
        rc = make_pool(a, bytes, msg, len);
    if (rc != 0) {
        teardown(a); /* what was made so far */
        return rc;
    }
    *arena = a;
    *base = (void *)a->pool;
    *map_unit = a->unit;
    *backing_used = KVHC_VMM_BACKING;
    return 0;
}

void kvhc_vmm_arena_destroy(kvhc_vmm_arena *a)
{
    if (a)
        teardown(a);
}

int kvhc_vmm_reserve(kvhc_vmm_arena *a, uint64_t bytes, void **base, char *msg, size_t len)
{
    if (bytes == 0)
        return text_fail(msg, len, KVH_ERR_INVALID_ARG, "a view of 0 bytes");
    uint64_t size = (bytes + a->unit - 1) & ~(a->unit - 1);
    reservation r;
    r.bytes = size;
    r.mapped = (uint8_t *)calloc((size_t)(size / a->unit), 1);
    if (!r.mapped)
        return text_fail(msg, len, KVH_ERR_NOMEM, "out of host memory for a view");
    CUresult cr = a->api.address_reserve(&r.base, size, a->unit, 0, 0);
    if (cr != CUDA_SUCCESS) {
        free(r.mapped);
        return cu_fail(a->api, msg, len, "cuMemAddressReserve (view)", cr);
    }
    pthread_mutex_lock(&a->lock);
    if (a->n_res == a->cap_res) {
        size_t cap = a->cap_res ? a->cap_res * 2 : 16;
        reservation *grown = (reservation *)realloc(a->res, cap * sizeof(*grown));
        if (!grown) {
            pthread_mutex_unlock(&a->lock);
            (void)a->api.address_free(r.base, size);
            free(r.mapped);
            return text_fail(msg, len, KVH_ERR_NOMEM, "out of host memory for a view");
        }
        a->res = grown;
        a->cap_res = cap;
    }
    size_t at = a->n_res;
    while (at > 0 && a->res[at - 1].base > r.base)
        at--;
    memmove(&a->res[at + 1], &a->res[at], (a->n_res - at) * sizeof(*a->res));
    a->res[at] = r;
    a->n_res++;
    pthread_mutex_unlock(&a->lock);
    *base = (void *)r.base;
    return 0;
}

void kvhc_vmm_unreserve(kvhc_vmm_arena *a, void *base, uint64_t bytes)
{
    (void)bytes; /* the reservation knows its (rounded) size */
    pthread_mutex_lock(&a->lock);
    reservation *r = find(a, (CUdeviceptr)base, 0);
    if (r && r->base == (CUdeviceptr)base) {
        free_reservation(a, r);
        size_t at = (size_t)(r - a->res);
        memmove(r, r + 1, (a->n_res - at - 1) * sizeof(*r));
        a->n_res--;
    }
    pthread_mutex_unlock(&a->lock);
}

int kvhc_vmm_map(kvhc_vmm_arena *a, void *dst, uint64_t arena_off, uint64_t bytes, char *msg, size_t len)
{
    CUdeviceptr d = (CUdeviceptr)dst;
    if (bytes == 0)
        return 0;
    if (!unit_multiple(a, d) || !unit_multiple(a, arena_off) || !unit_multiple(a, bytes))
        return text_fail(msg, len, KVH_ERR_INVALID_ARG, "a view mapping is not whole CUDA VMM units");
    if (arena_off > a->pool_bytes || bytes > a->pool_bytes - arena_off)
        return text_fail(msg, len, KVH_ERR_RANGE, "a view mapping reaches past the device tier");
    pthread_mutex_lock(&a->lock);
    reservation *r = find(a, d, bytes);
    int rc = r ? 0 : text_fail(msg, len, KVH_ERR_INVALID_ARG, "a view mapping outside every view's range");
    uint64_t first = r ? (d - r->base) / a->unit : 0, n = bytes / a->unit, chunk0 = arena_off / a->unit;
    if (rc == 0) /* cuMemMap maps only into unmapped addresses */
        rc = unmap_units(a, r, first, n, msg, len);
    for (uint64_t i = 0; i < n && rc == 0; i++) {
        CUresult cr = a->api.map(d + i * a->unit, a->unit, 0, a->chunks[chunk0 + i], 0);
        if (cr != CUDA_SUCCESS)
            rc = cu_fail(a->api, msg, len, "cuMemMap (view)", cr);
        else
            r->mapped[first + i] = 1;
    }
    if (rc == 0)
        rc = grant_view_access(a, d, bytes, msg, len);
    pthread_mutex_unlock(&a->lock);
    return rc;
}

int kvhc_vmm_unmap(kvhc_vmm_arena *a, void *dst, uint64_t bytes, char *msg, size_t len)
{
    CUdeviceptr d = (CUdeviceptr)dst;
    if (bytes == 0)
        return 0;
    if (!unit_multiple(a, d) || !unit_multiple(a, bytes))
        return text_fail(msg, len, KVH_ERR_INVALID_ARG, "a view unmapping is not whole CUDA VMM units");
    pthread_mutex_lock(&a->lock);
    reservation *r = find(a, d, bytes);
    int rc = r ? unmap_units(a, r, (d - r->base) / a->unit, bytes / a->unit, msg, len)
               : text_fail(msg, len, KVH_ERR_INVALID_ARG, "a view unmapping outside every view's range");
    pthread_mutex_unlock(&a->lock);
    return rc;
}
