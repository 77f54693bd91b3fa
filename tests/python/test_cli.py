"""The kvh command line: every command runs, exits 0 (or 3 with a clear
message where a tool is not built) and prints sane output."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import numpy as np

import kvh_cache as kvh
from kvh_cache import _progress, cli, doctor
from kvh_cache.tools import find_tool

REPO = Path(__file__).resolve().parents[2]


def run_kvh(*args, timeout=120, env_extra=None):
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


SMALL_DEMO = [
    "--agents",
    "2",
    "--steps",
    "6",
    "--chunks",
    "8",
    "--device-budget",
    "2MiB",
    "--host-budget",
    "1MiB",
    "--seed",
    "3",
]


@pytest.mark.parametrize(
    "cmd",
    [
        [],
        ["demo"],
        ["stats"],
        ["store"],
        ["store", "info"],
        ["store", "verify"],
        ["store", "remote"],
        ["bench"],
        ["doctor"],
    ],
    ids=lambda c: "-".join(c) or "top",
)
def test_help_everywhere(cmd):
    res = run_kvh(*cmd, "--help")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("usage: kvh")
    assert "--help" in res.stdout
    # plain text: none of the docstrings' reST or Markdown markup
    for markup in ("``", ":func:", ":class:", ":mod:", "**", "`"):
        assert markup not in res.stdout, markup


# `python -m MODULE` entry points; kvh_cache.bench_retriever and kvh_cache.bench_offload
# are the paths the benchmarks had before they moved to kvh_cache.demo.
@pytest.mark.parametrize(
    "module",
    [
        "kvh_cache.demo.agents",
        "kvh_cache.demo.bench_retriever",
        "kvh_cache.demo.bench_offload",
        "kvh_cache.demo.bench_remote",
        "kvh_cache.bench_retriever",
        "kvh_cache.bench_offload",
        "kvh_cache.model",
        "kvh_cache.codec",
    ],
)
def test_module_help(module):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "python") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    res = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120, env=env, cwd=str(REPO)
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("usage: ") and "--help" in res.stdout


@pytest.mark.parametrize(
    "args,rc,text",
    [
        (["kvh_cache.codec", "--head-dim", "-1"], 2, "--head-dim must be"),
        (["kvh_cache.codec", "--head-dim", "96"], 2, "--head-dim must be"),
        (["kvh_cache.codec", "--vectors", "0"], 2, "--vectors must be"),
        (["kvh_cache.model", "info", "--model", "{passwd}"], 1, "not a GGUF file"),
    ],
    ids=lambda a: " ".join(a) if isinstance(a, list) else None,
)
def test_module_bad_input_is_one_line(args, rc, text, tmp_path):
    """A negative or odd --head-dim of the codec report and a --model
    that is not a GGUF file ended in a traceback."""
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_text("root:x:0:0\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "python") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    argv = [a.replace("{passwd}", str(not_gguf)) for a in args]
    res = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == rc and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert text in res.stderr.strip().splitlines()[-1]


def test_version_and_no_command():
    res = run_kvh("--version")
    assert res.returncode == 0 and res.stdout.startswith("kvh ")
    res = run_kvh()
    assert res.returncode == 2 and "COMMAND" in res.stdout


def test_demo_table():
    res = run_kvh("demo", *SMALL_DEMO)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    for word in ("Agents", "Tiers", "Engine", "hit rate", "prefetch issued", "OK:"):
        assert word in out, out
    assert "\r" not in out  # no progress bar when not on a TTY


def test_demo_json(tmp_path):
    res = run_kvh("demo", *SMALL_DEMO, "--json", "--data-dir", str(tmp_path / "store"))
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["ok"] is True
    assert len(doc["agents"]) == 2
    for a in doc["agents"]:
        assert a["kv_ok"] and a["cow_ok"] and a["chunk_reads"] == 6 and a["prefix_matched"] == 128
    assert doc["stats"]["lookups"] > 0 and doc["stats"]["prefix_hit_tokens"] >= 256
    assert set(doc["tiers"]) == {"device", "host", "disk"}
    assert doc["tiers"]["device"]["used_blocks"] <= doc["tiers"]["device"]["capacity_blocks"]
    assert doc["stats"]["evictions"] > 0  # the budget is small: blocks spilled
    if doc["tiers"]["disk"]["capacity_blocks"]:
        assert doc["restart"] is None or doc["restart"]["ok"]
        if doc["restart"] is not None:
            # a second run finds the persisted chunks in the store (and verifies them)
            res = run_kvh("demo", *SMALL_DEMO, "--json", "--data-dir", str(tmp_path / "store"))
            assert res.returncode == 0, res.stdout + res.stderr
            again = json.loads(res.stdout)
            assert again["ok"] and again["derived"]["chunk_tokens_reused"] == 8 * 64


def test_demo_bad_args():
    res = run_kvh("demo", "--agents", "0")
    assert res.returncode == 2
    res = run_kvh("demo", "--device-budget", "lots")
    assert res.returncode == 2 and "size" in res.stderr
    res = run_kvh("demo", "--disk-budget", "0")
    assert res.returncode == 2 and "--disk-budget must be > 0" in res.stderr


@pytest.mark.parametrize(
    "args,word",
    [
        (["demo", "--synthetic", "--hints", "-1"], "--hints"),
        (["demo", "--synthetic", "--fork-every", "-1"], "--fork-every"),
        (["demo", "--synthetic", "--prompt-tokens", "-1"], "--prompt-tokens"),
        (["demo", "--synthetic", "--layers", "0"], "--layers"),
        (["demo", "--synthetic", "--block-tokens", "0"], "--block-tokens"),
        (["demo", "--synthetic", "--intent-noise", "nan"], "--intent-noise"),
        # numpy's or the engine's words, naming no option or a config field
        (["demo", "--synthetic", "--seed", "-1"], "--seed"),
        (["demo", "--synthetic", "--seed", "99999999999999999999999"], "--seed"),
        (["demo", "--synthetic", "--layers", "100000"], "--layers"),
        (["demo", "--synthetic", "--kv-heads", "100000"], "--kv-heads"),
        (["demo", "--synthetic", "--head-dim", "100000"], "--head-dim"),
        (["demo", "--synthetic", "--block-tokens", "3"], "--block-tokens"),
        (["demo", "--synthetic", "--device-budget", "0"], "--device-budget"),
        (["demo", "--model", "{tmp}"], "a directory"),
        (["demo", "--models", "--model", "{tmp}", "--data-dir", "{tmp}/data"], "a directory"),
        # refused before vLLM starts
        (["demo", "--engine", "vllm", "--vllm-kv-mib", "-1"], "--vllm-kv-mib"),
        (["demo", "--engine", "vllm", "--vllm-agents", "0"], "--vllm-agents"),
        (["demo", "--engine", "vllm", "--vllm-doc-tokens", "-5"], "--vllm-doc-tokens"),
        (["demo", "--models", "--model-b", "{tmp}/missing.gguf", "--data-dir", "{tmp}/data"], "--model-b"),
        (["stats", "/tmp", "--layers", "x"], "--layers"),
        (["store", "remote", "bogus"], "ACTION"),
        (["bench", "--reps", "x"], "--reps"),
        (["doctor", "--bogus"], "--bogus"),
    ],
    ids=lambda a: " ".join(a) if isinstance(a, list) else None,
)
def test_bad_flags_are_usage_errors(args, word, tmp_path):
    """Negative --hints/--fork-every ran the demo anyway (as did a NaN
    --intent-noise), --layers 0 failed in the engine with exit 1, and a
    missing --model-b was written there: a 140 MiB model at a mistyped
    path. Bad flags exit 2 with a one-line message naming the flag."""
    res = run_kvh(*(a.replace("{tmp}", str(tmp_path)) for a in args), env_extra={"KVH_CONFIG": ""})
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("kvh") and word in last, res.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_synthetic_demo_puts_the_store_in_data_dir_store(tmp_path):
    # --data-dir's help says DIR/store (the model demo's layout); the
    # synthetic demo wrote the store into DIR itself.
    res = run_kvh("demo", *SMALL_DEMO, "--no-progress", "--data-dir", str(tmp_path / "data"))
    assert res.returncode == 0, res.stderr
    if not (tmp_path / "data" / "store" / "index").exists():
        assert not (tmp_path / "data" / "index").exists()
        pytest.skip("this build has no disk tier")
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["store"]
    res = run_kvh("demo", "--help")
    assert "DIR/store" in res.stdout


def _digest(d: Path, skip=("LOCK",)):
    import hashlib

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.name not in skip}


def test_synthetic_demo_keeps_a_store_of_another_geometry(tmp_path):
    """A store under --data-dir made with another geometry was emptied
    (the library's "starting an empty store" warning, exit 0): refused now,
    naming --fresh and what differs; --fresh starts over."""
    data = tmp_path / "data"
    res = run_kvh("demo", "--synthetic", *SMALL_DEMO, "--no-progress", "--data-dir", str(data))
    assert res.returncode == 0, res.stderr
    store = data / "store"
    if not (store / "index").exists():
        pytest.skip("this build has no disk tier")
    before = _digest(store)
    res = run_kvh("demo", "--synthetic", *SMALL_DEMO, "--no-progress", "--layers", "2", "--data-dir", str(data))
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()
    assert len(last) == 1 and "--fresh" in last[0] and "num_layers" in last[0], res.stderr
    assert "empty store" not in res.stderr
    assert _digest(store) == before
    res = run_kvh(
        "demo", "--synthetic", *SMALL_DEMO, "--no-progress", "--layers", "2", "--fresh", "--data-dir", str(data)
    )
    assert res.returncode == 0, res.stderr
    assert _digest(store) != before


def test_unwritable_path_is_one_line(tmp_path):
    """A --data-dir that cannot be created (a file in its path) ended in a
    NotADirectoryError traceback."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    res = run_kvh("demo", "--models", "--data-dir", str(blocker / "data"))
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.stderr.strip().splitlines() == [f"kvh: Not a directory: {blocker / 'data'}"]


def test_bench_unknown_scenario_is_one_line():
    """kvh-bench's full usage text, once per unknown scenario, then "no
    results": now one line before anything runs."""
    res = run_kvh("bench", "nosuch", "--quick")
    if not _tool_or_unavailable(res, "kvh-bench"):
        return
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip().splitlines() == ["kvh: bench: unknown scenario 'nosuch'; kvh bench --list shows them"]
    res = run_kvh("bench", "offload", "retriever")
    assert res.returncode == 2 and "run alone" in res.stderr


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    data = tmp_path_factory.mktemp("kvh-store") / "data"
    d = data / "store"  # as --data-dir's help says
    res = run_kvh("demo", *SMALL_DEMO, "--json", "--data-dir", str(data))
    assert res.returncode == 0, res.stderr
    if not (d / "index").exists():
        pytest.skip("this build has no disk tier")
    return d


def _tool_or_unavailable(res, tool):
    if find_tool(tool) is None:
        assert res.returncode == 3
        assert f"{tool} not found" in res.stderr
        return False
    return True


def test_store_info_and_verify(store):
    res = run_kvh("store", "info", str(store))
    if _tool_or_unavailable(res, "kvh-store"):
        assert res.returncode == 0, res.stderr
        assert "geometry" in res.stdout and "blocks" in res.stdout
        res = run_kvh("store", "info", str(store), "--json")
        assert json.loads(res.stdout.strip().splitlines()[-1])["blocks"] > 0
        res = run_kvh("store", "verify", str(store))
        assert res.returncode == 0, res.stdout + res.stderr
        assert "0 bad" in res.stdout


def test_store_info_reports_permissions(store, tmp_path):
    res = run_kvh("store", "info", str(store), "--json")
    if not _tool_or_unavailable(res, "kvh-store"):
        return
    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert info["permissions"] == "owner-only" and info["dir_mode"] == "0700", info
    assert info["exposed"] == "" and info["dir_writable_by_others"] is False
    # A copy with the modes an older kvh (or a umask) left: reported, with the fix.
    copy = tmp_path / "old-store"
    copy.mkdir()
    for f in store.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
        (copy / f.name).chmod(0o644)
    copy.chmod(0o755)
    res = run_kvh("store", "info", str(copy), "--json")
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert info["permissions"] == "exposed" and info["dir_mode"] == "0755"
    assert "index 0644" in info["exposed"] and "chmod 700" in res.stderr
    res = run_kvh("store", "info", str(copy))
    assert "permissions   exposed" in res.stdout and "other users can read" in res.stdout
    for f in copy.iterdir():
        f.chmod(0o640)
    copy.chmod(0o750)
    info = json.loads(run_kvh("store", "info", str(copy), "--json").stdout.strip().splitlines()[-1])
    assert info["permissions"] == "group"


def test_doctor_reports_store_permissions(tmp_path):
    d = tmp_path / "store"
    checks = {c.name: c for c in doctor.run_checks(d, 1 << 20, 1 << 20)}
    c = checks["store permissions"]
    assert c.status == doctor.OK and "does not exist" in c.summary
    d.mkdir(mode=0o700)
    (d / "index").write_bytes(b"x")
    (d / "index").chmod(0o600)
    c = doctor.check_store_permissions(d)
    assert c.status == doctor.OK and c.data["permissions"] == "owner-only"
    (d / "index").chmod(0o644)
    c = doctor.check_store_permissions(d)
    assert c.status == doctor.WARN and "index 0644" in c.summary and any("chmod 700" in f for f in c.fix)
    (d / "index").chmod(0o640)
    d.chmod(0o750)
    c = doctor.check_store_permissions(d)
    assert c.status == doctor.INFO and c.data["permissions"] == "group"
    d.chmod(0o777)
    c = doctor.check_store_permissions(d)
    assert c.status == doctor.FAIL and "refuses" in c.summary
    d.chmod(0o700)
    res = run_kvh("doctor", "--json", "--data-dir", str(d))
    assert res.returncode == 0, res.stderr
    names = {c["name"]: c for c in json.loads(res.stdout)["checks"]}
    assert names["store permissions"]["data"]["dir_mode"] == "0700"


def test_doctor_leaves_a_directory_without_a_store_alone(tmp_path):
    # The user's own files in a directory that holds no store were listed as
    # exposed, with chmod advice for them.
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "notes.txt").chmod(0o644)
    tmp_path.chmod(0o755)
    c = doctor.check_store_permissions(tmp_path)
    assert c.status == doctor.OK and "no kvh store" in c.summary and not c.fix, c
    res = run_kvh("doctor", "--json", "--data-dir", "")
    assert res.returncode == 2 and "must not be empty" in res.stderr, (res.returncode, res.stderr)
    res = run_kvh("doctor", "--json", env_extra={"KVH_DATA_DIR": ""})
    assert res.returncode == 0, res.stderr
    names = {c["name"]: c for c in json.loads(res.stdout)["checks"]}
    assert names["store permissions"]["data"]["path"] == "kvh-data", names["store permissions"]


def test_store_missing_dir(tmp_path):
    res = run_kvh("store", "info", str(tmp_path / "nope"))
    assert res.returncode in (1, 3) and res.stderr.strip()


def test_store_with_a_fifo_in_place_of_a_file(store, tmp_path):
    """A FIFO named like a store file must not block the tool."""
    if find_tool("kvh-store") is None:
        pytest.skip("kvh-store not built")
    for name in ("index", "LOCK"):
        copy = tmp_path / f"fifo-{name}"
        copy.mkdir(mode=0o700)
        for f in store.iterdir():
            if f.name != name:
                (copy / f.name).write_bytes(f.read_bytes())
                (copy / f.name).chmod(0o600)
        os.mkfifo(copy / name, 0o600)
        res = run_kvh("store", "verify", str(copy), timeout=30)
        if name == "index":
            assert res.returncode != 0 and f"{copy}/index" in res.stderr, res.stderr
        else:  # no usable LOCK: nothing holds the store, it is checked
            assert res.returncode == 0 and "0 bad" in res.stdout, res.stdout + res.stderr


def test_stats(store):
    res = run_kvh("stats", str(store))
    if find_tool("kvh-store") is None:
        assert res.returncode == 3 and "kvh-store" in res.stderr
        res = run_kvh(
            "stats",
            str(store),
            "--layers",
            "4",
            "--kv-heads",
            "4",
            "--head-dim",
            "64",
            "--block-tokens",
            "16",
            "--dtype",
            "f16",
            "--model-salt",
            str(0x6B7668 + 3),
        )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "disk slots" in res.stdout and "geometry" in res.stdout
    res = run_kvh(
        "stats",
        str(store),
        "--json",
        "--layers",
        "4",
        "--kv-heads",
        "4",
        "--head-dim",
        "64",
        "--block-tokens",
        "16",
        "--dtype",
        "f16",
        "--model-salt",
        str(0x6B7668 + 3),
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["disk"]["used_blocks"] > 0 and doc["stats"]["corrupt_blocks"] == 0


def test_stats_passes_the_engines_warnings_on(store):
    # kvh stats opened its engine at log level "error", so a setting the
    # library ignores with a warning (README) was ignored without a word,
    # with or without -v.
    if find_tool("kvh-store") is None:
        pytest.skip("kvh-store is not built")
    for flags in ([], ["-v"]):
        res = run_kvh(*flags, "stats", str(store), env_extra={"KVH_CRC32C_IMPL": "bogus"})
        assert res.returncode == 0, res.stdout + res.stderr
        assert "KVH_CRC32C_IMPL=bogus" in res.stderr, (flags, res.stderr)
    res = run_kvh("stats", str(store), env_extra={"KVH_CRC32C_IMPL": "bogus", "KVH_LOG_LEVEL": "error"})
    assert "KVH_CRC32C_IMPL" not in res.stderr, res.stderr


def test_demo_says_it_does_not_apply_engine_variables(tmp_path):
    # kvh demo ran with KVH_LRU_K=9 or KVH_CONFIG=/nonexistent set and no
    # word that they were not applied.
    res = run_kvh(
        "demo",
        *SMALL_DEMO,
        "--no-progress",
        env_extra={"KVH_LRU_K": "9", "KVH_CONFIG": str(tmp_path / "missing.toml")},
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "KVH_LRU_K, KVH_CONFIG set: kvh demo runs its own configurations" in res.stderr, res.stderr


def test_stats_not_a_store(tmp_path):
    res = run_kvh("stats", str(tmp_path))
    assert res.returncode == 1 and "not a kvh store" in res.stderr


def test_bench():
    res = run_kvh("bench", "--list")
    if not _tool_or_unavailable(res, "kvh-bench"):
        return
    assert res.returncode == 0
    scenarios = res.stdout.split()
    assert "retriever" in scenarios and "offload" in scenarios and "remote-ttft" in scenarios
    scenarios = [s for s in scenarios if s not in ("retriever", "offload", "remote-ttft")]
    assert scenarios
    res = run_kvh("bench", scenarios[0], "--quick", "--json", timeout=300)
    assert res.returncode == 0, res.stderr
    lines = [json.loads(line) for line in res.stdout.splitlines() if line.strip()]
    assert lines and all({"scenario", "metric", "value", "unit"} <= set(row) for row in lines)
    res = run_kvh("bench", scenarios[0], "--quick", "--", "--reps", "1", timeout=300)
    assert res.returncode == 0, res.stderr
    assert "kvh bench" in res.stdout and "metric" in res.stdout
    res = run_kvh("demo", "--", "--reps", "1")
    assert res.returncode == 2  # extra arguments are for bench only


def test_tool_missing_message(tmp_path):
    res = run_kvh("bench", "--list", env_extra={"KVH_BENCH": str(tmp_path / "missing-bench"), "PATH": "/usr/bin:/bin"})
    # an explicit $KVH_BENCH that does not exist fails in the tool call, not silently
    assert res.returncode != 0


def test_doctor():
    res = run_kvh("doctor", "--data-dir", str(REPO / "build"))
    assert res.returncode == 0, res.stderr
    for name in ("huge pages", "memlock", "sysctl", "O_DIRECT", "free space", "NUMA", "CUDA", "nothing was changed"):
        assert name in res.stdout, res.stdout
    res = run_kvh("doctor", "--json", "--data-dir", "/tmp/kvh-doctor-does-not-exist/x")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    names = {c["name"] for c in doc["checks"]}
    assert {"huge pages", "memlock limit", "sysctl", "O_DIRECT", "free space", "NUMA", "CUDA"} <= names
    assert all(c["status"] in ("ok", "warn", "fail", "info") for c in doc["checks"])
    sysctl = next(c for c in doc["checks"] if c["name"] == "sysctl")
    for line in sysctl["fix"]:
        assert line.startswith(("#", "sudo", "printf"))


def test_doctor_changes_nothing(tmp_path):
    before = {
        p: Path(p).read_text() for p in ("/proc/sys/vm/max_map_count", "/proc/sys/vm/nr_hugepages") if Path(p).exists()
    }
    assert cli.main(["doctor", "--json", "--data-dir", str(tmp_path)]) == 0
    after = {p: Path(p).read_text() for p in before}
    assert before == after
    assert list(tmp_path.iterdir()) == []  # the O_DIRECT probe cleaned up


def test_doctor_advice_keeps_every_sysctl_it_sets(tmp_path, monkeypatch, capsys):
    """Runs the printed advice in order with a directory standing in for
    /etc/sysctl.d: every sysctl the advice sets must be in the files after
    (the sysctl block used to overwrite what the huge pages block wrote)."""
    proc = {
        "/proc/sys/vm/max_map_count": "65530",
        "/proc/sys/vm/swappiness": "60",
        "/proc/sys/vm/dirty_background_ratio": "10",
        "/proc/sys/vm/dirty_ratio": "20",
        "/proc/sys/kernel/io_uring_disabled": "2",
        "/sys/kernel/mm/transparent_hugepage/enabled": "always [madvise] never",
    }
    monkeypatch.setattr(doctor, "_read", proc.get)
    monkeypatch.setattr(
        doctor, "_meminfo", lambda: {"Hugepagesize": 2 << 20, "HugePages_Total": 0, "HugePages_Free": 0}
    )
    for name in ("check_kvh", "check_numa", "check_cuda"):  # slow or machine-bound, and no sysctl advice
        monkeypatch.setattr(doctor, name, lambda name=name: doctor.Check(name, doctor.OK, "not checked here"))
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    args = argparse.Namespace(
        data_dir=data_dir, host_budget=1 << 30, disk_budget=1 << 20, json=False, strict=False, config=None
    )
    assert doctor.main_doctor(args) == 0
    advice = [line.strip() for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]

    wanted = {}
    for line in advice:
        if m := re.fullmatch(r"sudo sysctl -w ([\w.]+)=(\S+)", line):
            wanted[m[1]] = m[2]
        elif m := re.fullmatch(r"echo (\S+) \| sudo tee /proc/sys/(\S+)", line):
            wanted[m[2].replace("/", ".")] = m[1]
    assert set(wanted) == {
        "vm.nr_hugepages",
        "vm.max_map_count",
        "vm.swappiness",
        "vm.dirty_background_ratio",
        "vm.dirty_ratio",
        "kernel.io_uring_disabled",
    }

    etc = tmp_path / "sysctl.d"
    etc.mkdir()
    persisting = [line for line in advice if "/etc/sysctl.d/" in line]
    assert persisting
    for _ in range(2):  # following the advice twice changes nothing
        for line in persisting:
            subprocess.run(
                ["bash", "-c", line.replace("sudo ", "").replace("/etc/sysctl.d/", f"{etc}/")],
                check=True,
                capture_output=True,
            )
        kept = {}
        for conf in sorted(etc.glob("*.conf")):  # as `sysctl --system` reads them: a later line wins
            for line in conf.read_text().splitlines():
                key, eq, value = line.partition("=")
                if eq and not key.lstrip().startswith(("#", ";")):
                    kept[key.strip()] = value.strip()
        assert kept == wanted


class _FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_only_on_tty():
    tty = _FakeTTY()
    with _progress.Progress(10, "work", stream=tty) as bar:
        for _ in range(10):
            bar.update(1)
    assert "work" in tty.getvalue() and "10/10" in tty.getvalue() and tty.getvalue().endswith("\n")
    noted = _FakeTTY()
    with _progress.Progress(None, "count", stream=noted, unit="tok") as bar:
        bar.update(3, "agent 1")
    assert "3tok" in noted.getvalue() and "agent 1" in noted.getvalue()
    plain = io.StringIO()
    with _progress.Progress(10, "work", stream=plain) as bar:
        bar.update(10)
    assert plain.getvalue() == ""


def test_table_and_sizes():
    t = _progress.table([["a", 1, 2.5], ["bb", 1000, 0.25]], ["name", "n", "x"], title="T")
    lines = t.splitlines()
    assert lines[0] == "T" and lines[1].split() == ["name", "n", "x"]
    assert lines[3].startswith("a ") and lines[4].rstrip().endswith("0.25")
    assert _progress.human_bytes(3 << 20) == "3.0 MiB"
    # decimal and binary forms of every unit, terabytes included
    assert _progress.parse_size("1GB") == 10**9 and _progress.parse_size("1GiB") == 1 << 30
    assert _progress.parse_size("1TB") == 10**12 and _progress.parse_size("1TiB") == 1 << 40


@pytest.mark.parametrize(
    "text",
    ["0", "4096", "4096B", "4k", "4K", "4Ki", "4KiB", "4kib", "2M", "2MiB", "1G", "1GiB", "1T", "1TiB", "1P", "1PiB",
     "1pi", "16383P", "1.5G", "1e3", "inf", "nan", " 4G", "4 G", "4G ", "+4", "-1", "1iB", "4X", "G", "", "4GBB",
     "99999P", "16384P", "18446744073709551616"],
)  # fmt: skip
def test_sizes_are_read_as_the_library_reads_them(text):
    """The command line refused 1P and 1PiB, which KVH_HOST_BYTES takes,
    took 1.5G, which it refuses, and called 99999P "not a size": it takes
    what the library takes now (KB, MB, ... stay decimal), and says when a
    size is too large."""
    import argparse

    from kvh_cache import config, errors

    try:
        lib = config.from_env({"KVH_HOST_BYTES": text}).get("host_bytes")
    except errors.Error:
        lib = None
    if lib is None and text.strip() == "":
        lib = None  # an empty variable is unset
    try:
        ours = _progress.parse_size(text)
    except argparse.ArgumentTypeError as exc:
        ours = None
        if text in ("99999P", "16384P", "18446744073709551616"):
            assert "too large" in str(exc), exc
    assert ours == lib, (text, ours, lib)


def test_size_options_take_petabytes():
    res = run_kvh("doctor", "--json", "--disk-budget", "1P", "--data-dir", "/nonexistent-kvh-dir/x")
    assert res.returncode in (0, 1) and "not a size" not in res.stderr, res.stderr
    res = run_kvh("doctor", "--disk-budget", "99999P")
    assert res.returncode == 2 and "too large" in res.stderr.strip().splitlines()[-1], res.stderr
    res = run_kvh("doctor", "--disk-budget", "1.5G")
    assert res.returncode == 2 and "--disk-budget" in res.stderr, res.stderr


def _size_options():
    """(command, option, action) of every kvh option that takes a size."""
    parser = cli.build_parser()

    def walk(p, path):
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, path + [name])
            elif any(o.endswith(("-bytes", "-budget")) for o in action.option_strings):
                yield " ".join(path), action.option_strings[-1], action

    return list(walk(parser, []))


def test_every_size_option_reads_sizes_as_the_variables_do():
    """kvh stats --disk-bytes 64M was refused ("not an integer") while the
    other size options take K, M, G, T and P as KVH_*_BYTES does."""
    options = _size_options()
    assert ("stats", "--disk-bytes") in [(c, o) for c, o, _ in options]
    for command, option, action in options:
        assert action.type("64M") == 64 << 20, (command, option)
        assert action.type("4096") == 4096, (command, option)


@pytest.mark.skipif(find_tool("kvh-store") is None, reason="kvh stats reads the geometry with kvh-store")
def test_stats_opens_a_store_of_large_blocks_at_the_size_it_was_made(tmp_path):
    """kvh stats opened every store with a 1 MiB device tier, which holds
    no block of a vLLM model's store (30 layers x 3 heads x 128 x 128
    tokens, bf16: 5.6 MiB), and refused the size a store was made with
    (64M) for the few KiB its slots round it down by."""
    d = tmp_path / "big"
    with kvh.Engine(
        num_layers=30,
        num_kv_heads=3,
        head_dim=128,
        block_tokens=128,
        dtype="bf16",
        device_bytes=16 << 20,
        host_bytes=32 << 20,
        backend="cpu",
        disk_path=str(d),
        disk_bytes=64 << 20,
    ) as eng:
        with eng.sequence(tokens=range(256)) as s:
            k = np.full((256, 3, 128), 0x3F80, np.uint16)  # bf16 1.0
            for layer in range(30):
                s.write_kv(layer, 0, k, k)
            s.persist()
    res = run_kvh("stats", str(d), "--json", timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(res.stdout)["disk"]["used_blocks"] == 2
    for size in ("64M", "64MiB", str(64 << 20)):
        res = run_kvh("stats", str(d), "--disk-bytes", size, timeout=120)
        assert res.returncode == 0, size + res.stdout + res.stderr
    res = run_kvh("stats", str(d), "--disk-bytes", "32M", timeout=120)
    assert res.returncode == 2 and "never resizes" in res.stderr
