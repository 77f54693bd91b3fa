/* Latency histograms (kvh.h, experimental). */
#include "abi/api_params.h"
#include "core/latency.h"

kvh_status kvh_latency_histogram_get(kvh_engine *e, uint32_t kind, kvh_latency_histogram *histogram)
{
    kvhi_clear_error();
    KVHI_REQUIRE(histogram, "histogram is NULL");
    KVHI_REQUIRE(kind < KVH_LATENCY_KIND_COUNT, "latency kind %u is out of range (0..%u)", (unsigned)kind,
                 KVH_LATENCY_KIND_COUNT - 1u);
    uint32_t size;
    kvh_status st = kvhi_info_size(histogram, KVHI_STRUCT_SIZE_MIN, sizeof(*histogram), "kvh_latency_histogram", &size);
    if (st != KVH_OK)
        return st;
    st = kvhi_api_enter(e); /* only for the engine's checks: the counters need no lock */
    if (st != KVH_OK)
        return st;
    kvh_latency_histogram copy;
    kvhi_latency_read(&e->latency, (kvh_latency_kind)kind, &copy);
    kvhi_api_leave(e, KVH_OK);
    kvhi_write_info(histogram, size, &copy);
    return KVH_OK;
}
