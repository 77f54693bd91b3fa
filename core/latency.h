/* Fixed-bucket latency histograms of an engine (kvh.h "Latency
 * histograms"): acquire stalls and disk block reads and writes. Recording
 * takes no lock (relaxed atomics), so the disk workers record outside the
 * engine lock and acquire records under it at the same cost. */
#ifndef KVH_CORE_LATENCY_H
#define KVH_CORE_LATENCY_H

#include <stdatomic.h>
#include <stdint.h>

#include "kvh/kvh.h"

typedef struct kvhi_latency_hist {
    _Atomic uint64_t counts[KVH_LATENCY_BUCKETS];
    _Atomic uint64_t sum_ns;
} kvhi_latency_hist;

typedef struct kvhi_latency {
    kvhi_latency_hist kinds[KVH_LATENCY_KIND_COUNT];
} kvhi_latency;

struct kvhi_xfer;

/* The bucket of a sample of ns nanoseconds. */
uint32_t kvhi_latency_bucket(uint64_t ns);

void kvhi_latency_record(kvhi_latency *l, kvh_latency_kind kind, uint64_t ns);

/* One sample per transfer of xs[0..n) that succeeded, a disk read or a
 * disk write by its direction, each of ns (the batch's time). */
void kvhi_latency_record_xfers(kvhi_latency *l, const struct kvhi_xfer *xs, uint32_t n, uint64_t ns);

/* A copy of kind's histogram; counts from one moment (see kvh.h). */
void kvhi_latency_read(const kvhi_latency *l, kvh_latency_kind kind, kvh_latency_histogram *out);

#endif
