//! Latency histograms of an engine (kvh.h "Latency histograms",
//! experimental): how long synchronous acquires waited for blocks not in
//! the device tier, and how long each disk block read and write took.

use kvh_sys as sys;

use crate::engine::Engine;
use crate::error::{check, Result};

/// What a histogram times (`kvh_latency_kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LatencyKind {
    /// A synchronous acquire that waited for blocks not in the device tier.
    AcquireStall,
    /// One block read from the disk tier.
    DiskRead,
    /// One block written to the disk tier.
    DiskWrite,
}

impl LatencyKind {
    /// Every kind, in the library's order.
    pub const ALL: [LatencyKind; 3] = [
        LatencyKind::AcquireStall,
        LatencyKind::DiskRead,
        LatencyKind::DiskWrite,
    ];

    fn raw(self) -> sys::kvh_latency_kind {
        match self {
            LatencyKind::AcquireStall => sys::KVH_LATENCY_ACQUIRE_STALL,
            LatencyKind::DiskRead => sys::KVH_LATENCY_DISK_READ,
            LatencyKind::DiskWrite => sys::KVH_LATENCY_DISK_WRITE,
        }
    }
}

/// Number of buckets (`KVH_LATENCY_BUCKETS`).
pub const LATENCY_BUCKETS: usize = sys::KVH_LATENCY_BUCKETS as usize;

/// A copy of one histogram.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LatencyHistogram {
    /// What it times.
    pub kind: LatencyKind,
    /// Samples recorded (the sum of `counts`).
    pub count: u64,
    /// Their total time in nanoseconds.
    pub sum_ns: u64,
    /// Samples per bucket (not cumulative); see [`LatencyHistogram::bound_ns`].
    pub counts: [u64; LATENCY_BUCKETS],
}

impl LatencyHistogram {
    /// Upper bound of bucket `i` in nanoseconds (1 us doubling); `None` for
    /// the last bucket, which has none.
    pub fn bound_ns(i: usize) -> Option<u64> {
        (i < LATENCY_BUCKETS - 1).then(|| u64::from(sys::KVH_LATENCY_BUCKET0_NS) << i)
    }
}

impl Engine {
    /// A copy of the latency histogram of `kind` (`kvh_latency_histogram_get`).
    pub fn latency_histogram(&self, kind: LatencyKind) -> Result<LatencyHistogram> {
        let mut h = sys::kvh_latency_histogram {
            struct_size: std::mem::size_of::<sys::kvh_latency_histogram>() as u32,
            ..Default::default()
        };
        // SAFETY: valid engine and out-struct with struct_size set.
        check(unsafe { sys::kvh_latency_histogram_get(self.as_ptr(), kind.raw(), &mut h) })?;
        Ok(LatencyHistogram {
            kind,
            count: h.count,
            sum_ns: h.sum_ns,
            counts: h.counts,
        })
    }
}
