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
