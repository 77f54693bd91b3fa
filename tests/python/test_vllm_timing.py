"""kvh_cache.vllm.timing without vLLM: a timed connector records its
hooks, and a run's trace summarises to medians."""

from __future__ import annotations

import json
import types

from kvh_cache.vllm import timing


class _Connector:
    """The hooks of a KV connector, each taking a known time."""

    def __init__(self, meta):
        self._meta = meta
        self.calls = []

    def has_connector_metadata(self):
        return self._meta is not None

    def _get_connector_metadata(self):
        return self._meta

    def start_load_kv(self, forward_context, **kwargs):
        self.calls.append("start")

    def wait_for_layer_load(self, layer_name):
        self.calls.append(layer_name)

    def wait_for_save(self):
        self.calls.append("save")

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 256 - num_computed_tokens, False


def test_timed_connector_traces_load_steps_and_lookups(tmp_path, monkeypatch):
    path = tmp_path / "run.trace"
    monkeypatch.setenv(timing.TRACE_ENV, str(path))
    timed = timing.timed(_Connector)
    assert timed.__name__ == "Timed_Connector" and issubclass(timed, _Connector)
    load = types.SimpleNamespace(block_ids=[4, 5])
    c = timed(types.SimpleNamespace(loads=[load], saves=[]))
    for _ in range(3):
        c.start_load_kv(None)
        c.wait_for_layer_load("l0")
        c.wait_for_layer_load("l1")
        c.wait_for_save()
    assert c.calls[:4] == ["start", "l0", "l1", "save"]  # the hooks still run
    assert c.get_num_new_matched_tokens(None, 128) == (128, False)
    idle = timed(types.SimpleNamespace(loads=[], saves=[]))  # a step that loads nothing is not recorded
    idle.start_load_kv(None)
    idle.wait_for_save()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["side"] for x in lines] == ["worker"] * 3 + ["scheduler"]
    assert lines[0]["loads"] == 2 and lines[0]["step_s"] >= lines[0]["layer_wait_s"] >= 0
    s = timing.summarize(str(path))
    assert s["load_steps"] == 3 and s["lookups"] == 1 and len(s["steps_ms_all"]) == 3
    assert s["step_ms"] is not None and s["lookup_ms"] is not None
    assert timing.summarize(str(tmp_path / "none.trace")) == {}


def test_trace_charges_cpu_and_faults_to_the_threads_that_spent_them(tmp_path, monkeypatch):
    """A step's record says which threads ran (the forward pass's, kvh's,
    the rest), where they may run, and kvh's load stages."""
    import collections
    import os
    import threading

    path = tmp_path / "run.trace"
    monkeypatch.setenv(timing.TRACE_ENV, str(path))
    go, done, leave, tid = threading.Event(), threading.Event(), threading.Event(), []

    def copier():  # stands for a kvh copy thread: touches 32 MiB when told
        tid.append(threading.get_native_id())
        go.wait()
        buf = bytearray(32 << 20)
        buf[::4096] = b"x" * len(buf[::4096])
        done.set()
        leave.wait()  # a thread that ended has no /proc entry left to read

    t = threading.Thread(target=copier)
    t.start()
    while not tid:
        pass
    store = types.SimpleNamespace(
        kvh_tids=list(tid),
        load_log=collections.deque(
            [{"lookup_to_start_s": 0.004, "ready_s": 0.2, "on_disk": 16, "prefetched": 16, "prefetch_done": False}]
        ),  # fmt: skip
        engine=None,  # no latency histograms: left out of the record
    )
    c = timing.timed(_Connector)(types.SimpleNamespace(loads=[types.SimpleNamespace(block_ids=[1] * 16)], saves=[]))
    c._store = store
    c.start_load_kv(None)
    go.set()
    done.wait(10)
    c.wait_for_save()
    leave.set()
    t.join()
    (rec,) = [json.loads(x) for x in path.read_text().splitlines()]
    th = rec["threads"]
    assert th["kvh_minflt"] >= (32 << 20) // (2 << 20)  # at least one fault per huge page
    assert th["kvh_cpu_ms"] > 0 and th["main_minflt"] < th["kvh_minflt"]
    assert rec["placement"]["main_cpus"] == sorted(os.sched_getaffinity(0))
    assert rec["placement"]["kvh_threads"] == 1
    assert rec["kvh_loads"][0]["prefetched"] == 16 and not store.load_log  # taken, not repeated
    s = timing.summarize(str(path))
    assert s["kvh_ready_ms"] == 200.0 and s["kvh_lookup_to_start_ms"] == 4.0 and s["kvh_prefetched"] == 16
    assert s["threads_kvh_minflt"] == th["kvh_minflt"] and s["placement"]["kvh_threads"] == 1
