"""kvh_cache.latency: the engine's latency histograms from Python (acquire
stalls, disk reads and writes), their argument rules, and their counts
against the operations done."""

from __future__ import annotations

import math

import numpy as np
import pytest

import kvh_cache as kvh
from kvh_cache.latency import BUCKET_BOUNDS_SECONDS, KINDS

BT = 16
BLOCKS = 4


def disk_engine(tmp_path):
    return kvh.Engine(
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        dtype="f32",
        block_tokens=BT,
        backend="cpu",
        device_bytes=1 << 20,
        host_bytes=1 << 20,
        disk_path=str(tmp_path / "store"),
        disk_bytes=8 << 20,
    )


def filled(eng):
    seq = eng.sequence()
    seq.append(np.arange(BLOCKS * BT))
    kv = np.ones((BLOCKS * BT, 2, 16), np.float32)
    for layer in range(2):
        seq.write_kv(layer, 0, kv, kv)
    return seq


def test_a_new_engine_has_empty_histograms(tmp_path):
    with disk_engine(tmp_path) as eng:
        hs = eng.latency_histograms()
        assert set(hs) == set(KINDS)
        for h in hs.values():
            assert h.count == 0 and h.sum_seconds == 0 and len(h.counts) == len(BUCKET_BOUNDS_SECONDS)
            assert math.isnan(h.mean_seconds)
        assert BUCKET_BOUNDS_SECONDS[0] == 1e-6 and BUCKET_BOUNDS_SECONDS[-1] == math.inf


def test_counts_follow_demotion_and_stalled_acquire(tmp_path):
    with disk_engine(tmp_path) as eng:
        seq = filled(eng)
        seq.migrate("disk")
        writes = eng.latency_histogram("disk_write")
        assert writes.count == BLOCKS and writes.sum_seconds > 0
        assert eng.latency_histogram("disk_read").count == 0
        before = eng.stats()
        with seq.acquire():
            pass
        after = eng.stats()
        reads = eng.latency_histogram("disk_read")
        stall = eng.latency_histogram("acquire_stall")
        assert reads.count == after.blocks_disk_to_host - before.blocks_disk_to_host == BLOCKS
        assert stall.count == 1
        assert stall.sum_seconds == pytest.approx((after.acquire_stall_ns - before.acquire_stall_ns) / 1e9)
        cumulative = stall.cumulative()
        assert cumulative[-1] == (math.inf, 1)
        assert all(a[1] <= b[1] for a, b in zip(cumulative, cumulative[1:]))
        with seq.acquire():  # resident now: no stall recorded
            pass
        assert eng.latency_histogram("acquire_stall").count == 1
        seq.free()


def test_bad_kind_and_closed_engine(tmp_path):
    eng = disk_engine(tmp_path)
    with pytest.raises(kvh.InvalidArgumentError, match="disk_read"):
        eng.latency_histogram("disk_reads")
    with pytest.raises(kvh.InvalidArgumentError, match="out of range"):
        eng.latency_histogram(len(KINDS))
    with pytest.raises(kvh.InvalidArgumentError):
        eng.latency_histogram(-1)
    # a float used to be truncated to a kind (1.5 read disk_read)
    for bad in (1.5, np.float32(1), True, None):
        with pytest.raises(TypeError, match="kind"):
            eng.latency_histogram(bad)
    assert eng.latency_histogram(np.int64(1)).kind == "disk_read"
    eng.close()
    with pytest.raises(kvh.ClosedError):
        eng.latency_histogram("disk_read")
