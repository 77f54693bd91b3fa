//! Latency histograms: empty on a new engine, one acquire-stall sample per
//! synchronous acquire that waited, none for one that found its blocks.

mod common;

use kvh::{LatencyHistogram, LatencyKind, Tier, LATENCY_BUCKETS};

#[test]
fn stalled_acquires_are_counted() {
    let e = common::engine(1, 1, 4, 4, 8, 8);
    for kind in LatencyKind::ALL {
        let h = e.latency_histogram(kind).unwrap();
        assert_eq!((h.kind, h.count, h.sum_ns), (kind, 0, 0));
    }
    let s = e.create_sequence(0).unwrap();
    s.append(&(0..16).collect::<Vec<_>>()).unwrap();
    common::fill(&e, &s, 1);
    s.migrate(.., Tier::Host).unwrap().wait(None).unwrap();
    let before = e.stats().unwrap();
    s.acquire(..).unwrap().release().unwrap();
    let after = e.stats().unwrap();
    let stall = e.latency_histogram(LatencyKind::AcquireStall).unwrap();
    assert_eq!(stall.count, 1);
    assert_eq!(stall.counts.iter().sum::<u64>(), 1);
    assert_eq!(
        stall.sum_ns,
        after.acquire_stall_ns - before.acquire_stall_ns
    );
    s.acquire(..).unwrap().release().unwrap(); // resident: no stall
    assert_eq!(
        e.latency_histogram(LatencyKind::AcquireStall)
            .unwrap()
            .count,
        1
    );
    assert_eq!(e.latency_histogram(LatencyKind::DiskRead).unwrap().count, 0); // no disk tier
}

#[test]
fn bucket_bounds_double_from_one_microsecond() {
    assert_eq!(LatencyHistogram::bound_ns(0), Some(1000));
    assert_eq!(LatencyHistogram::bound_ns(1), Some(2000));
    assert_eq!(
        LatencyHistogram::bound_ns(LATENCY_BUCKETS - 2),
        Some(1000 << (LATENCY_BUCKETS - 2))
    );
    assert_eq!(LatencyHistogram::bound_ns(LATENCY_BUCKETS - 1), None);
}
