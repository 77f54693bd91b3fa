"""Latency histograms of an engine (kvh.h "Latency histograms",
experimental): the time synchronous acquires waited for blocks not in the
device tier, and the time of each disk block read and write. Fixed
buckets, recorded by libkvh from the engine's open on::

    h = engine.latency_histogram("disk_read")
    h.count, h.sum_seconds, h.mean_seconds
    h.cumulative()          # [(le_seconds, samples <= le), ..., (inf, count)]
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Dict, List, Tuple, Union

from . import errors
from ._ffi import check, ffi, lib

__all__ = ["KINDS", "BUCKET_BOUNDS_SECONDS", "LatencyHistogram", "latency_histogram", "latency_histograms"]

#: Histogram kinds by name (kvh_latency_kind).
KINDS: Dict[str, int] = {
    "acquire_stall": int(lib.KVH_LATENCY_ACQUIRE_STALL),
    "disk_read": int(lib.KVH_LATENCY_DISK_READ),
    "disk_write": int(lib.KVH_LATENCY_DISK_WRITE),
}

#: Upper bound of each bucket in seconds (1 us doubling to 4.19 s, then inf).
BUCKET_BOUNDS_SECONDS: Tuple[float, ...] = tuple(
    int(lib.KVH_LATENCY_BUCKET0_NS) * (1 << i) / 1e9 for i in range(int(lib.KVH_LATENCY_BUCKETS) - 1)
) + (math.inf,)


@dataclasses.dataclass(frozen=True)
class LatencyHistogram:
    kind: str
    count: int
    sum_seconds: float
    counts: Tuple[int, ...]  # per bucket (not cumulative), bounds in BUCKET_BOUNDS_SECONDS

    @property
    def mean_seconds(self) -> float:
        return self.sum_seconds / self.count if self.count else math.nan

    def cumulative(self) -> List[Tuple[float, int]]:
        """``(le, samples of at most le seconds)`` per bucket, Prometheus's form."""
        out, total = [], 0
        for le, n in zip(BUCKET_BOUNDS_SECONDS, self.counts):
            total += n
            out.append((le, total))
        return out


def _kind(kind: Union[str, int]) -> Tuple[str, int]:
    if isinstance(kind, str):
        if kind not in KINDS:
            raise errors.InvalidArgumentError(f"latency kind {errors.shown(kind)} is not one of {sorted(KINDS)}")
        return kind, KINDS[kind]
    if isinstance(kind, bool) or not isinstance(kind, numbers.Integral):
        raise TypeError(f"kind must be a latency kind name {sorted(KINDS)} or its int, not {type(kind).__name__}")
    value = int(kind)
    if not 0 <= value < 1 << 32:  # the C parameter is a uint32_t; the library checks the rest
        raise errors.InvalidArgumentError(f"latency kind {value} is out of range")
    names = {v: k for k, v in KINDS.items()}
    return names.get(value, str(value)), value


def latency_histogram(engine: Any, kind: Union[str, int]) -> LatencyHistogram:
    name, value = _kind(kind)
    h = ffi.new("kvh_latency_histogram *")
    h.struct_size = ffi.sizeof("kvh_latency_histogram")
    with engine._call() as e:
        check(lib.kvh_latency_histogram_get(e, value, h))
    return LatencyHistogram(name, int(h.count), int(h.sum_ns) / 1e9, tuple(int(c) for c in h.counts))


def latency_histograms(engine: Any) -> Dict[str, LatencyHistogram]:
    return {name: latency_histogram(engine, name) for name in KINDS}
