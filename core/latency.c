/* Latency histograms: see core/latency.h. */
#include "core/latency.h"

#include <string.h>

#include "core/move.h"

uint32_t kvhi_latency_bucket(uint64_t ns)
{
    /* Bucket i holds (BUCKET0 << (i-1), BUCKET0 << i]: the bit length of
     * ceil(ns / BUCKET0) - 1 is that i. */
    uint64_t units = ns / KVH_LATENCY_BUCKET0_NS + (ns % KVH_LATENCY_BUCKET0_NS != 0);
    if (units <= 1)
        return 0;
    uint32_t i = 64u - (uint32_t)__builtin_clzll(units - 1);
    return i < KVH_LATENCY_BUCKETS - 1 ? i : KVH_LATENCY_BUCKETS - 1;
}

void kvhi_latency_record(kvhi_latency *l, kvh_latency_kind kind, uint64_t ns)
{
    kvhi_latency_hist *h = &l->kinds[kind];
    atomic_fetch_add_explicit(&h->counts[kvhi_latency_bucket(ns)], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&h->sum_ns, ns, memory_order_relaxed);
}

void kvhi_latency_record_xfers(kvhi_latency *l, const kvhi_xfer *xs, uint32_t n, uint64_t ns)
{
    for (uint32_t i = 0; i < n; i++) {
        if (xs[i].err != 0 || xs[i].in_place)
            continue;
        if (xs[i].dst_tier == KVH_TIER_DISK)
            kvhi_latency_record(l, KVH_LATENCY_DISK_WRITE, ns);
        else if (xs[i].src_tier == KVH_TIER_DISK)
            kvhi_latency_record(l, KVH_LATENCY_DISK_READ, ns);
    }
}

void kvhi_latency_read(const kvhi_latency *l, kvh_latency_kind kind, kvh_latency_histogram *out)
{
    const kvhi_latency_hist *h = &l->kinds[kind];
    memset(out, 0, sizeof(*out));
    out->struct_size = sizeof(*out);
    out->kind = (uint32_t)kind;
    for (uint32_t i = 0; i < KVH_LATENCY_BUCKETS; i++) {
        out->counts[i] = atomic_load_explicit(&h->counts[i], memory_order_relaxed);
        out->count += out->counts[i];
    }
    out->sum_ns = atomic_load_explicit(&h->sum_ns, memory_order_relaxed);
}
