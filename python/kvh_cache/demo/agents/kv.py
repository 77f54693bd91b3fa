"""The KV backends the forward passes run on (the
:class:`kvh_cache.model.llama.KVBackend` protocol): kvh's, timed, and the seed's
naive synchronous offload."""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Tuple

import numpy as np

from ...types import Tier

__all__ = ["KVBackends", "KVTimes", "SyncOffloadKV", "TimedKV", "sync_offload_kv"]


class KVTimes:
    """Seconds spent in the KV backend: cache management (append, acquire,
    write K/V, release), paged attention, and synchronous offload copies."""

    __slots__ = ("manage", "attend", "offload")

    def __init__(self) -> None:
        self.manage = self.attend = self.offload = 0.0

    def snapshot(self) -> Tuple[float, float, float]:
        return (self.manage, self.attend, self.offload)


class TimedKV:
    """Wraps a KV backend (the :class:`kvh_cache.model.llama.KVBackend` protocol)
    and adds the time of each call to a :class:`KVTimes`."""

    def __init__(self, inner, times: KVTimes, at_end: Optional[Callable[[], None]] = None) -> None:
        self.inner = inner
        self.times = times
        self.at_end = at_end  # called at the end of each forward pass, before the sequence is released

    @property
    def length(self) -> int:
        return self.inner.length

    @property
    def attention_used(self) -> str:
        return getattr(self.inner, "attention_used", "")

    def begin(self, tokens: np.ndarray) -> int:
        t = time.perf_counter()
        try:
            return self.inner.begin(tokens)
        finally:
            self.times.manage += time.perf_counter() - t

    def write(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        t = time.perf_counter()
        try:
            self.inner.write(layer, pos, k, v)
        finally:
            self.times.manage += time.perf_counter() - t

    def attend(self, layer: int, q: np.ndarray, pos: int) -> np.ndarray:
        t = time.perf_counter()
        try:
            return self.inner.attend(layer, q, pos)
        finally:
            self.times.attend += time.perf_counter() - t

    def end(self) -> None:
        if self.at_end is not None:
            self.at_end()
        t = time.perf_counter()
        try:
            self.inner.end()
        finally:
            self.times.manage += time.perf_counter() - t


class SyncOffloadKV:
    """The seed's naive synchronous CPU offload on the same engine API,
    around kvh's backend ``inner`` of ``seq``: the forward pass acquires
    the whole sequence (on an engine with no worker threads the copies into
    the device tier run in the caller, before the step), and after every
    step the whole sequence is copied back to the host tier, waiting for
    it; that copy's time goes to ``times.offload``."""

    def __init__(self, inner, seq, times: KVTimes) -> None:
        self.inner = inner
        self.seq = seq
        self.times = times

    @property
    def length(self) -> int:
        return self.inner.length

    @property
    def attention_used(self) -> str:
        return getattr(self.inner, "attention_used", "")

    def begin(self, tokens: np.ndarray) -> int:
        return self.inner.begin(tokens)

    def write(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        self.inner.write(layer, pos, k, v)

    def attend(self, layer: int, q: np.ndarray, pos: int) -> np.ndarray:
        return self.inner.attend(layer, q, pos)

    def end(self) -> None:
        self.inner.end()
        t = time.perf_counter()
        try:
            self.seq.migrate(Tier.HOST)
        finally:
            self.times.offload += time.perf_counter() - t


def sync_offload_kv(runner, engine, seq, times: KVTimes, at_end: Optional[Callable[[], None]] = None) -> TimedKV:
    """:class:`SyncOffloadKV` of ``seq``, timed."""
    from ...model.kvh_kv import KvhKV

    return TimedKV(SyncOffloadKV(KvhKV(engine, seq, attention=runner.attention), seq, times), times, at_end)


class KVBackends:
    """The KV backend of each forward pass of one configuration: kvh's
    (``runner.kvh_kv``), or with ``sync_offload`` the synchronous offload;
    timed into ``times``, with ``at_end`` called at the end of every
    forward pass."""

    def __init__(
        self, runner, engine, times: KVTimes, sync_offload: bool, at_end: Optional[Callable[[], None]] = None
    ) -> None:
        self.runner = runner
        self.engine = engine
        self.times = times
        self.sync_offload = sync_offload
        self.at_end = at_end

    def for_sequence(self, seq: Any) -> TimedKV:
        if self.sync_offload:
            return sync_offload_kv(self.runner, self.engine, seq, self.times, self.at_end)
        return TimedKV(self.runner.kvh_kv(self.engine, seq), self.times, self.at_end)
