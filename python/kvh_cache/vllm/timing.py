"""Where a connector's time goes inside one vLLM run, measured the same way
for kvh's connector and vLLM's ExampleConnector.

``timed(cls)`` subclasses a connector so that its hooks are timed: the
scheduler's lookup (``get_num_new_matched_tokens``), and per worker step
``start_load_kv``, the waits in ``wait_for_layer_load``, the forward pass
(from ``start_load_kv`` until ``wait_for_save``) and ``wait_for_save``.
Each step that loaded something, and each lookup, is appended as one JSON
line to the file named by ``$KVH_VLLM_TRACE`` (vLLM's processes inherit
it). ``kvh bench vllm --trace`` selects the two timed classes below and
summarises the lines per configuration.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Dict

TRACE_ENV = "KVH_VLLM_TRACE"

_write_lock = threading.Lock()


def _emit(record: Dict[str, Any]) -> None:
    path = os.environ.get(TRACE_ENV)
    if not path:
        return
    line = json.dumps(record) + "\n"
    with _write_lock, open(path, "a") as f:
        f.write(line)


def _loaded_tokens(meta: Any) -> int:
    """Tokens the step's metadata asks the worker to load (either connector)."""
    if meta is None:
        return 0
    loads = getattr(meta, "loads", None)
    if loads is not None:  # kvh
        return sum(len(t.block_ids) for t in loads)
    reqs = getattr(meta, "requests", None) or []  # ExampleConnector: tokens, not blocks
    return sum(len(r.slot_mapping) for r in reqs if not r.is_store)


def timed(cls: type) -> type:
    """A subclass of connector class ``cls`` whose hooks are timed."""

    class Timed(cls):  # type: ignore[misc, valid-type]
        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            meta = self._get_connector_metadata() if self.has_connector_metadata() else None
            self._step = {"loads": _loaded_tokens(meta), "layer_wait_s": 0.0}
            t = time.perf_counter()
            super().start_load_kv(forward_context, **kwargs)
            now = time.perf_counter()
            self._step.update(t0=t, start_load_s=now - t)

        def wait_for_layer_load(self, layer_name: str) -> None:
            t = time.perf_counter()
            super().wait_for_layer_load(layer_name)
            step = getattr(self, "_step", None)
            if step is not None:
                step["layer_wait_s"] += time.perf_counter() - t

        def wait_for_save(self) -> None:
            t = time.perf_counter()
            super().wait_for_save()
            step = getattr(self, "_step", None)
            self._step = None
            if step is None or not step["loads"]:
                return
            now = time.perf_counter()
            t0 = step.pop("t0")
            _emit(dict(step, side="worker", cls=cls.__name__, step_s=now - t0, wait_for_save_s=now - t))

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
            t = time.perf_counter()
            out = super().get_num_new_matched_tokens(request, num_computed_tokens)
            _emit({"side": "scheduler", "cls": cls.__name__, "lookup_s": time.perf_counter() - t, "matched": out[0]})
            return out

    Timed.__name__ = Timed.__qualname__ = "Timed" + cls.__name__
    return Timed


def _kvh() -> type:
    from .connector import KvhConnector

    return timed(KvhConnector)


def _example() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

    return timed(ExampleConnector)


def __getattr__(name: str) -> Any:
    # vLLM finds a connector class as an attribute of its module.
    if name == "TimedKvhConnector":
        return _kvh()
    if name == "TimedExampleConnector":
        return _example()
    raise AttributeError(name)


def summarize(path: str) -> Dict[str, Any]:
    """Medians (ms) of the lines of one run's trace file."""
    import statistics

    steps, lookups = [], []
    try:
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                (steps if r["side"] == "worker" else lookups).append(r)
    except FileNotFoundError:
        return {}

    def med(xs):
        return round(statistics.median(xs) * 1e3, 2) if xs else None

    return {
        "load_steps": len(steps),
        "lookups": len(lookups),
        "lookup_ms": med([r["lookup_s"] for r in lookups]),
        "start_load_ms": med([r["start_load_s"] for r in steps]),
        "layer_wait_ms": med([r["layer_wait_s"] for r in steps]),
        "wait_for_save_ms": med([r["wait_for_save_s"] for r in steps]),
        "step_ms": med([r["step_s"] for r in steps]),
        "steps_ms_all": [round(r["step_s"] * 1e3, 1) for r in steps],
    }
