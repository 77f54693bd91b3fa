"""Prometheus metrics of an engine (``pip install 'kvh-cache[metrics]'``, which
installs ``prometheus-client``)::

    import kvh_cache as kvh
    import kvh_cache.metrics

    eng = kvh.Engine(...)
    exporter = kvh_cache.metrics.serve(eng, 9464)   # http://127.0.0.1:9464/metrics
    ...
    exporter.close()

Every scrape reads ``kvh_engine_stats`` and ``kvh_tier_info_get`` afresh
(nothing is sampled in between), so the values are the engine's own.

Published, all prefixed ``kvh_``:

* every counter of ``kvh_stats`` as a ``*_total`` counter. Tier hits are
  ``kvh_hits_total{tier}``, moves ``kvh_blocks_moved_total{src,dst}`` and
  ``kvh_moved_bytes_total{src,dst}``; ``acquire_stall_ns`` is
  ``kvh_acquire_stall_seconds_total`` (base unit); byte counts end in
  ``_bytes_total``; the others keep their field name
  (``kvh_evictions_total``, ``kvh_prefetch_useful_total``, ...): the
  counters of the ``kvh_stats`` this package was built with (a newer
  library's further counters are read by a newer package);
* tier gauges ``kvh_tier_capacity_bytes``, ``kvh_tier_used_bytes``,
  ``kvh_tier_capacity_blocks``, ``kvh_tier_used_blocks``,
  ``kvh_tier_pinned_blocks`` (label ``tier``), and ``kvh_block_bytes``;
* ``kvh_engine_up``: 1 while the engine is open, 0 after close (the
  other series are then absent).

An exporter serves until :meth:`Exporter.close` (or the end of the
process), like any server: dropping it does not stop it.

* latency histograms (``kvh_latency_histogram_get``, fixed buckets from
  1 us doubling to 4.19 s, seconds): ``kvh_acquire_stall_duration_seconds``
  (synchronous acquires that waited for blocks not in the device tier),
  ``kvh_disk_read_duration_seconds`` and
  ``kvh_disk_write_duration_seconds`` (one sample per block), each with
  ``_bucket{le}``, ``_sum`` and ``_count``.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Iterator, Optional, Tuple

__all__ = ["EngineCollector", "Exporter", "serve", "METRIC_NAMES", "HISTOGRAM_NAMES"]

_TIERS = ("device", "host", "disk")

# kvh_stats field -> (metric name without kvh_ and _total, labels, scale)
_SPECIAL = {f"hits_{t}": ("hits", {"tier": t}, 1.0) for t in _TIERS}
for _src, _dst in (("device", "host"), ("host", "device"), ("host", "disk"), ("disk", "host")):
    _SPECIAL[f"blocks_{_src}_to_{_dst}"] = ("blocks_moved", {"src": _src, "dst": _dst}, 1.0)
    _SPECIAL[f"bytes_{_src}_to_{_dst}"] = ("moved_bytes", {"src": _src, "dst": _dst}, 1.0)
_SPECIAL["acquire_stall_ns"] = ("acquire_stall_seconds", {}, 1e-9)
_SPECIAL["bytes_disk_copies_written"] = ("disk_copies_written_bytes", {}, 1.0)

_HELP = {
    "hits": "Block accesses found in each tier",
    "blocks_moved": "Blocks moved between tiers",
    "moved_bytes": "Bytes moved between tiers",
    "acquire_stall_seconds": "Time acquires spent waiting for copies",
    "disk_copies_written_bytes": "Bytes of clean copies written to disk",
}


def _counter_of(field: str) -> Tuple[str, dict, float]:
    if field in _SPECIAL:
        return _SPECIAL[field]
    if field.startswith("bytes_"):
        return field[len("bytes_") :] + "_bytes", {}, 1.0
    return field, {}, 1.0


def _stats_fields() -> Tuple[str, ...]:
    import dataclasses

    from .types import Stats

    return tuple(f.name for f in dataclasses.fields(Stats) if f.name != "extra")


#: The names of every series this module publishes (without _total for
#: counters: the name prometheus-client registers).
METRIC_NAMES = tuple(sorted({"kvh_" + _counter_of(f)[0] for f in _stats_fields()}))

#: Latency histogram kind (kvh_cache.latency.KINDS) -> (series name, help).
HISTOGRAM_NAMES = {
    "acquire_stall": ("kvh_acquire_stall_duration_seconds", "Time a synchronous acquire waited for blocks"),
    "disk_read": ("kvh_disk_read_duration_seconds", "Time to read one block from the disk tier"),
    "disk_write": ("kvh_disk_write_duration_seconds", "Time to write one block to the disk tier"),
}


#: Tier gauge (kvh_tier_<key>) -> (help, value of a kvh.TierInfo).
_TIER_GAUGES = {
    "capacity_bytes": ("Bytes the tier can hold", lambda t: t.capacity_blocks * t.block_bytes),
    "used_bytes": ("Bytes of blocks in the tier or in flight to it", lambda t: t.used_bytes),
    "capacity_blocks": ("Block slots of the tier", lambda t: t.capacity_blocks),
    "used_blocks": ("Slots holding a block or in flight", lambda t: t.used_blocks),
    "pinned_blocks": ("Blocks pinned in the tier", lambda t: t.pinned_blocks),
}


class EngineCollector:
    """A prometheus-client collector reading one engine at each scrape.
    It holds the engine weakly: a collected or closed engine reports
    ``kvh_engine_up 0``."""

    def __init__(self, engine: Any) -> None:
        self._engine = weakref.ref(engine)

    def detach(self) -> None:
        """Reads the engine no more: every later scrape says
        ``kvh_engine_up 0`` (a request still in flight when its exporter
        closed)."""
        self._engine = lambda: None

    def describe(self) -> Iterator[Any]:
        """The families without samples, read off no engine: a registry
        then refuses a second engine's collector (the same names twice
        would make an exposition no server accepts)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        yield GaugeMetricFamily("kvh_engine_up", "1 while the engine is open")
        names = []
        for field in _stats_fields():
            name = _counter_of(field)[0]
            if name not in names:
                names.append(name)
        for name in names:
            yield CounterMetricFamily("kvh_" + name, _HELP.get(name, name))
        for key, (text, _) in _TIER_GAUGES.items():
            yield GaugeMetricFamily(f"kvh_tier_{key}", text, labels=["tier"])
        yield GaugeMetricFamily("kvh_block_bytes", "Bytes of one block for the engine's geometry")
        for name, text in HISTOGRAM_NAMES.values():
            yield HistogramMetricFamily(name, text)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from . import errors

        up = GaugeMetricFamily("kvh_engine_up", "1 while the engine is open")
        eng = self._engine()
        try:
            if eng is None or eng.closed:
                raise errors.ClosedError("engine closed")
            stats = eng.stats()
            tiers = eng.tiers()
            block_bytes = eng.block_bytes
            histograms = eng.latency_histograms()
        except errors.ClosedError:
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up

        families: dict = {}

        def add(field: str, value: int) -> None:
            name, labels, scale = _counter_of(field)
            fam = families.get(name)
            if fam is None:
                fam = CounterMetricFamily("kvh_" + name, _HELP.get(name, f"kvh_stats {field}"), labels=sorted(labels))
                families[name] = fam
            fam.add_metric([labels[k] for k in sorted(labels)], value * scale)

        for field in _stats_fields():
            add(field, getattr(stats, field))
        for field, value in sorted(stats.extra.items()):
            add(field, value)
        yield from families.values()

        for key, (text, get) in _TIER_GAUGES.items():
            g = GaugeMetricFamily(f"kvh_tier_{key}", text, labels=["tier"])
            for tier, info in tiers.items():
                g.add_metric([tier.name.lower()], get(info))
            yield g
        b = GaugeMetricFamily("kvh_block_bytes", "Bytes of one block for the engine's geometry")
        b.add_metric([], block_bytes)
        yield b
        yield from _histograms(histograms)


def _histograms(histograms: dict) -> Iterator[Any]:
    from prometheus_client.core import HistogramMetricFamily
    from prometheus_client.utils import floatToGoString

    for kind, (name, text) in HISTOGRAM_NAMES.items():
        h = histograms.get(kind)
        if h is None:
            continue
        buckets = [(floatToGoString(le), n) for le, n in h.cumulative()]
        yield HistogramMetricFamily(name, text, buckets=buckets, sum_value=h.sum_seconds)


class Exporter:
    """A running HTTP endpoint (``/metrics``) from :func:`serve`."""

    def __init__(self, server: Any, thread: Any, registry: Any, collector: Optional[EngineCollector] = None) -> None:
        self._server = server
        self._thread = thread
        self._collector = collector
        self._lock = threading.Lock()
        self.registry = registry

    @property
    def closed(self) -> bool:
        return self._server is None

    @property
    def address(self) -> Tuple[str, int]:
        """(host, port) it listens on (the port chosen when 0 was asked)."""
        server = self._server
        if server is None:
            from . import errors

            raise errors.ClosedError("the metrics exporter is closed")
        host, port = server.server_address[:2]
        return host, port

    @property
    def port(self) -> int:
        return self.address[1]

    @property
    def url(self) -> str:
        host, port = self.address[:2]
        if ":" in host:  # an IPv6 address goes in brackets
            host = f"[{host}]"
        return f"http://{host}:{port}/metrics"

    def close(self) -> None:
        """Stops the server and waits for its thread, and takes the
        engine's collector out of the registry (which can then take
        another engine's). A request already being served reads the
        engine no more. Closing again does nothing."""
        with self._lock:
            server, self._server = self._server, None
            if server is None:
                return
            collector, self._collector = self._collector, None
            if collector is not None:
                collector.detach()
                try:
                    self.registry.unregister(collector)
                except KeyError:  # the caller took it out already
                    pass
            server.shutdown()
            server.server_close()
            self._thread.join()

    def __enter__(self) -> "Exporter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def serve(engine: Any, port: int, addr: str = "127.0.0.1", *, registry: Optional[Any] = None) -> Exporter:
    """Serves the engine's metrics over HTTP at ``addr:port/metrics`` from
    a daemon thread (port 0: any free port, see :attr:`Exporter.port`).
    Loopback by default: pass ``addr="0.0.0.0"`` to be scraped from other
    machines. ``registry``: a ``prometheus_client.CollectorRegistry`` to
    add the engine to (default: a new one of its own); one that already
    has an engine's metrics is refused (ValueError)."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "kvh_cache.metrics needs prometheus-client: pip install 'kvh-cache[metrics]'", name=exc.name
        ) from None
    from .engine import Engine, _int

    if not isinstance(engine, Engine):
        raise TypeError(f"engine must be a kvh_cache.Engine, not {type(engine).__name__}")
    port = _int("port", port, 0, 65535)
    if not isinstance(addr, str):
        raise TypeError(f"addr must be a str, not {type(addr).__name__}")
    reg = registry if registry is not None else CollectorRegistry(auto_describe=False)
    collector = EngineCollector(engine)
    try:
        reg.register(collector)
    except ValueError as exc:  # the names are taken: another engine's, most likely
        raise ValueError(
            f"the registry already has kvh's metric names ({exc}): give each engine a registry and port of its own"
        ) from None
    try:
        server, thread = start_http_server(port, addr=addr, registry=reg)
    except BaseException:
        reg.unregister(collector)  # a caller's registry can take the engine again
        raise
    return Exporter(server, thread, reg, collector)
