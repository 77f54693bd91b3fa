"""kvh-bench's scratch files and child processes (benchmarks/bench_fs.c):
a run ended by a signal (Ctrl-C, kill, a closed pipe) removes what it wrote
and stops the fio it started; a directory other users could tamper with is
refused."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kvh_cache.tools import find_tool

REPO = Path(__file__).resolve().parents[2]


def _bench():
    tool = find_tool("kvh-bench")
    if tool is None:
        pytest.skip("kvh-bench not built")
    return tool


def _env(extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVH_") or k == "KVH_BUILD_DIR"}
    env.update(extra)
    return env


def _default_signals():
    # A runner started in the background ignores SIGINT, one started by
    # nohup SIGHUP; the tool keeps a signal its caller ignores, so give it
    # a terminal's dispositions.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)


def _wait_for(pred, what, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = pred()
        if found:
            return found
        time.sleep(0.02)
    pytest.fail(f"{what} never appeared in {timeout} s")


def _fio_pids(path: Path):
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd and cmd[0].endswith(b"fio") and any(str(path).encode() in a for a in cmd):
            pids.append(int(proc.name))
    return pids


def _stop(p, sig):
    p.send_signal(sig)
    try:
        p.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        pytest.fail("still running 10 s after the signal")
    assert p.returncode == -sig, p.returncode


def _start(args, env_extra=None, cwd=None):
    return subprocess.Popen(
        [_bench(), *map(str, args)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=_env(env_extra or {}),
        cwd=cwd,
        preexec_fn=_default_signals,
    )


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGPIPE], ids=lambda s: s.name)
def test_disk_removes_its_scratch_on_a_signal(tmp_path, sig):
    p = _start(["disk", "--quick", "--json", "--dir", tmp_path, "--total-mb", "64", "--block-bytes", "65536"])
    _wait_for(lambda: any(d.name.startswith("kvh-bench-disk-") for d in tmp_path.iterdir()), "the scratch directory")
    _wait_for(lambda: any(tmp_path.glob("kvh-bench-disk-*/raw.bin")), "the raw file")
    _stop(p, sig)
    assert list(tmp_path.iterdir()) == []


def test_disk_stops_fio_on_a_signal(tmp_path):
    if shutil.which("fio") is None:
        pytest.skip("fio is not installed")
    p = _start(["disk", "--quick", "--json", "--dir", tmp_path, "--total-mb", "64", "--block-bytes", "65536"])
    fio = _wait_for(lambda: _fio_pids(tmp_path), "fio on the raw file")
    _stop(p, signal.SIGINT)
    deadline = time.monotonic() + 5
    while _fio_pids(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _fio_pids(tmp_path) == [], f"fio {fio} outlived kvh-bench"
    assert list(tmp_path.iterdir()) == []


def _fio_job_setting_up(path: Path):
    """fio processes on the raw file while fio's job is set up: the job
    exists (a task beside fio's main and helper threads: a thread, or a
    forked process) and the file is not open yet. A forked job waits here
    for its parent's go, in a session of its own."""
    pids = _fio_pids(path)
    tasks = 0
    for pid in pids:
        try:
            if any(os.readlink(fd).endswith("raw.bin") for fd in Path(f"/proc/{pid}/fd").iterdir()):
                return []
            tasks += len(list(Path(f"/proc/{pid}/task").iterdir()))
        except OSError:
            return []
    return pids if tasks >= 3 else []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL], ids=lambda s: s.name)
def test_disk_leaves_no_fio_when_stopped_during_a_fio_job(tmp_path, sig):
    # Killed while fio set up its job, kvh-bench left the job (a forked
    # process in a session of its own) waiting forever under init.
    if shutil.which("fio") is None:
        pytest.skip("fio is not installed")
    p = _start(["disk", "--quick", "--json", "--dir", tmp_path, "--total-mb", "64", "--block-bytes", "65536"])
    try:
        fio = _wait_for(lambda: _fio_job_setting_up(tmp_path), "fio setting up its job", timeout=60)
    finally:
        if p.poll() is None:
            _stop(p, sig)
    deadline = time.monotonic() + 5
    while _fio_pids(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _fio_pids(tmp_path)
    for pid in left:  # not to leave it behind the failure
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert left == [], f"fio {left} (of {fio}) outlived kvh-bench"
    if sig != signal.SIGKILL:  # which no handler sees
        assert list(tmp_path.iterdir()) == []


def test_switch_removes_its_weight_file_on_a_signal(tmp_path):
    p = _start(["switch", "--dir", tmp_path])
    _wait_for(lambda: list(tmp_path.glob("kvh-bench-switch-*")), "the synthetic weight file")
    _stop(p, signal.SIGTERM)
    assert list(tmp_path.iterdir()) == []


def test_attention_stream_removes_its_scratch_on_a_signal(tmp_path):
    p = _start(["attention", "--stream", "--quick"], env_extra={"KVH_BENCH_DIR": str(tmp_path)})
    _wait_for(lambda: list(tmp_path.glob("kvh-bench-stream-*/*")), "the scratch store")
    _stop(p, signal.SIGHUP)
    assert list(tmp_path.iterdir()) == []


def test_attention_stream_puts_its_scratch_in_its_dir_option(tmp_path):
    # --dir was refused as an unknown option; it wins over $KVH_BENCH_DIR.
    given, env_dir = tmp_path / "given", tmp_path / "env"
    given.mkdir()
    env_dir.mkdir()
    p = _start(["attention", "--stream", "--quick", "--dir", given], env_extra={"KVH_BENCH_DIR": str(env_dir)})
    _wait_for(lambda: list(given.glob("kvh-bench-stream-*/*")), "the scratch store under --dir")
    _stop(p, signal.SIGHUP)
    assert list(given.iterdir()) == [] and list(env_dir.iterdir()) == []


@pytest.mark.parametrize("mode,refused", [(0o777, True), (0o1777, False), (0o775, True), (0o755, False)])
def test_a_directory_others_may_tamper_with_is_refused(tmp_path, mode, refused):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    res = subprocess.run(
        [_bench(), "switch", "--quick", "--reps", "1", "--layers", "2", "--mode", "file", "--dir", str(shared)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env({}),
        stdin=subprocess.DEVNULL,
    )
    if refused:
        assert res.returncode == 2 and "writable by other users and not sticky" in res.stderr, res.stderr
    else:
        assert res.returncode in (0, 3), res.stderr[-2000:]
    assert list(shared.iterdir()) == []
