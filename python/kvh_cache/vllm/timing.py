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
from typing import Any, Dict, List, Optional, Tuple

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


def _threads() -> Dict[int, Tuple[int, int, int]]:
    """Per thread of this process: (ns on a CPU, ns runnable but waiting
    for one, minor page faults), from /proc/self/task/*/schedstat and
    stat."""
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for t in tids:
        try:
            with open(f"/proc/self/task/{t}/schedstat") as f:
                run, wait = f.read().split()[:2]
            with open(f"/proc/self/task/{t}/stat") as f:
                minflt = f.read().rsplit(")", 1)[1].split()[7]  # field 10
            out[int(t)] = (int(run), int(wait), int(minflt))
        except (OSError, ValueError):
            continue
    return out


def _thread_deltas(before: Dict[int, Tuple[int, int, int]], main: int, kvh: List[int]) -> Dict[str, float]:
    """CPU and run-queue time (ms) and minor faults of each group of
    threads since ``before``: the thread running the forward pass, kvh's
    copy threads, and the rest (OpenMP's, vLLM's, Python's)."""
    after = _threads()
    groups = {"main": [0, 0, 0], "kvh": [0, 0, 0], "other": [0, 0, 0]}
    kset = set(kvh)
    for tid, now in after.items():
        then = before.get(tid, (0, 0, 0))
        g = groups["main" if tid == main else "kvh" if tid in kset else "other"]
        for i in range(3):
            g[i] += now[i] - then[i]
    out: Dict[str, float] = {}
    for name, (run, wait, faults) in groups.items():
        out[f"{name}_cpu_ms"] = round(run / 1e6, 2)
        out[f"{name}_runq_ms"] = round(wait / 1e6, 2)
        out[f"{name}_minflt"] = faults
    return out


def _placement(main: int, kvh: List[int]) -> Dict[str, Any]:
    """Where the worker's threads may run, and the OpenMP settings."""

    def aff(tid: int) -> Optional[List[int]]:
        try:
            return sorted(os.sched_getaffinity(tid))
        except OSError:
            return None

    env = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "VLLM_CPU_OMP_THREADS_BIND")
    out: Dict[str, Any] = {
        "main_cpus": aff(main),
        "kvh_cpus": sorted({c for t in kvh for c in (aff(t) or [])}),
        "kvh_threads": len(kvh),
        "threads": len(_threads()),
        "env": {k: os.environ.get(k) for k in env},
    }
    try:
        import torch

        out["torch_threads"] = torch.get_num_threads()
    except Exception:
        pass
    return out


def timed(cls: type) -> type:
    """A subclass of connector class ``cls`` whose hooks are timed."""

    class Timed(cls):  # type: ignore[misc, valid-type]
        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            meta = self._get_connector_metadata() if self.has_connector_metadata() else None
            self._step = {"loads": _loaded_tokens(meta), "layer_wait_s": 0.0}
            if self._step["loads"]:
                self._step["_threads"] = _threads()
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
            main = threading.get_native_id()
            store = getattr(self, "_store", None)
            kvh = list(getattr(store, "kvh_tids", []) or [])
            rec = dict(step, side="worker", cls=cls.__name__, step_s=now - t0, wait_for_save_s=now - t)
            rec["threads"] = _thread_deltas(rec.pop("_threads", {}), main, kvh)
            if not getattr(self, "_placed", False):
                self._placed = True
                rec["placement"] = _placement(main, kvh)
            if store is not None:
                log = getattr(store, "load_log", None)
                rec["kvh_loads"] = [log.popleft() for _ in range(len(log))] if log else []
                try:
                    h = store.engine.latency_histogram("disk_read")
                    prev = getattr(self, "_disk_read", (0, 0.0))
                    self._disk_read = (h.count, h.sum_seconds)
                    rec["disk_reads"] = h.count - prev[0]
                    rec["disk_read_ms"] = round((h.sum_seconds - prev[1]) * 1e3, 2)
                except Exception:
                    pass
            _emit(rec)

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
        **_stage_medians(steps),
    }


def _stage_medians(steps: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Medians of the per-step thread times and kvh's load stages."""
    import statistics

    def med(xs):
        xs = [x for x in xs if x is not None]
        return round(statistics.median(xs), 2) if xs else None

    out: Dict[str, Any] = {}
    threads = [r["threads"] for r in steps if r.get("threads")]
    for key in sorted({k for t in threads for k in t}):
        out["threads_" + key] = med([t.get(key) for t in threads])
    loads = [ld for r in steps for ld in r.get("kvh_loads") or []]
    if loads:
        out["kvh_lookup_to_start_ms"] = med([ld["lookup_to_start_s"] * 1e3 for ld in loads if ld["lookup_to_start_s"]])
        out["kvh_ready_ms"] = med([ld["ready_s"] * 1e3 for ld in loads])
        out["kvh_blocks_on_disk"] = med([ld["on_disk"] for ld in loads])
        out["kvh_prefetched"] = med([ld["prefetched"] for ld in loads])
        out["kvh_prefetch_done_at_start"] = sum(1 for ld in loads if ld["prefetch_done"])
        out["kvh_disk_read_ms"] = med([r.get("disk_read_ms") for r in steps])
    placement = [r["placement"] for r in steps if r.get("placement")]
    if placement:
        out["placement"] = placement[0]
    return out
