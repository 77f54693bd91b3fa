"""The remote tier from Python: kvh.Config's remote_* fields, two engines
sharing a prefix through a Redis server (started here on a free loopback
port, stopped at the end), ``kvh store remote`` (ping, count, verify,
purge) and ``kvh doctor``'s connectivity check. Skipped where redis-server
is not installed (scripts/install-deps.sh installs it)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import kvh_cache as kvh
from kvh_testutil import filled_seq, make_engine

REPO = Path(__file__).resolve().parents[2]
PASSWORD = "py-remote-pw"

pytestmark = pytest.mark.skipif(not shutil.which("redis-server"), reason="redis-server is not installed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("redis")
    port = _free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d), "--save", ""]
        + ["--appendonly", "no", "--requirepass", PASSWORD],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(200):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.1):
                    break
            except OSError:
                time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _remote(addrs, salt, **kw):
    return dict(remote_addrs=addrs, remote_password=PASSWORD, remote_timeout_ms=1000, model_salt=salt, **kw)


def test_two_engines_share_a_prefix(server):
    with make_engine(**_remote(server, 0x51)) as a:
        seq, data = filled_seq(a, 64, seed=3)
        seq.persist()
        assert a.stats().remote_uploads == 4
    with make_engine(**_remote(server, 0x51)) as b:
        s = b.sequence()
        assert s.match_prefix(np.arange(64)) == 64
        for layer, (k, v) in data.items():
            k2, v2 = s.read_kv(layer)
            assert np.array_equal(k, k2) and np.array_equal(v, v2)
        st = b.stats()
        assert st.remote_hits == 4 and st.remote_corrupt == 0
        assert b.config.remote_timeout_ms == 1000


def test_write_through_from_python(server):
    with make_engine(**_remote(server, 0x52, remote_upload=kvh.RemoteUpload.WRITE_THROUGH)) as a:
        assert a.config.remote_upload == kvh.RemoteUpload.WRITE_THROUGH
        assert isinstance(a.config.remote_upload, kvh.RemoteUpload)
        _, data = filled_seq(a, 64, seed=4)  # published blocks go up; no persist
    # a closed: what it queued was sent before close returned
    with make_engine(**_remote(server, 0x52)) as b:
        s = b.sequence()
        assert s.match_prefix(np.arange(64)) == 64
        for layer, (k, v) in data.items():
            k2, v2 = s.read_kv(layer)
            assert np.array_equal(k, k2) and np.array_equal(v, v2)
        assert b.config.remote_upload == kvh.RemoteUpload.PERSIST


def test_open_errors(server):
    with pytest.raises(kvh.Error, match="remote_upload"):
        make_engine(**_remote(server, 1, remote_upload=8))
    with pytest.raises(kvh.KvhIOError, match="AUTH"):
        make_engine(remote_addrs=server, remote_password="wrong")
    with pytest.raises(kvh.Error, match="TLS"):
        make_engine(**_remote(server, 1, remote_tls=True))
    with pytest.raises(kvh.Error):
        make_engine(remote_addrs="nonsense")
    with pytest.raises(ValueError):
        make_engine(remote_addrs="127.0.0.1:1\0")


def _kvh(*args, env_extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "python") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, "-m", "kvh_cache", *args], capture_output=True, text=True, timeout=120, env=env, cwd=str(REPO)
    )


def test_store_remote_and_doctor(server, tmp_path):
    with make_engine(**_remote(server, 0x77)) as a:
        seq, _ = filled_seq(a, 48, seed=5)
        seq.persist()
    env = {
        "KVH_REMOTE_ADDRS": server,
        "KVH_REMOTE_PASSWORD": PASSWORD,
        "KVH_MODEL_SALT": str(0x77),
        "KVH_NUM_LAYERS": "2",
        "KVH_NUM_KV_HEADS": "2",
        "KVH_HEAD_DIM": "8",
        "KVH_DTYPE": "f32",
    }
    res = _kvh("store", "remote", "count", "--json", env_extra=env)
    if res.returncode != 0 and "kvh-store not found" in res.stderr:
        pytest.skip("kvh-store is not built")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["keys"] == 3
    res = _kvh("store", "remote", "verify", "--json", env_extra=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(res.stdout)["bad"] == 0
    # another geometry is another model: none of these keys
    res = _kvh("store", "remote", "count", "--json", env_extra=dict(env, KVH_HEAD_DIM="16"))
    assert json.loads(res.stdout)["keys"] == 0
    res = _kvh("store", "remote", "ping", env_extra=env)
    assert res.returncode == 0 and "1 of 1" in res.stdout, res.stdout + res.stderr
    res = _kvh("doctor", "--json", "--data-dir", str(tmp_path), env_extra=env)
    checks = {c["name"]: c for c in json.loads(res.stdout)["checks"]}
    assert checks["remote tier"]["status"] == "ok", checks["remote tier"]
    assert json.loads(res.stdout)["config"]["remote_password"]["value"] == "(set)"
    res = _kvh("store", "remote", "purge", "--json", env_extra=env)
    assert res.returncode == 0 and json.loads(res.stdout)["deleted"] == 3
    res = _kvh("store", "remote", "count", "--json", env_extra=env)
    assert json.loads(res.stdout)["keys"] == 0
    res = _kvh("doctor", "--json", "--data-dir", str(tmp_path), env_extra=dict(env, KVH_REMOTE_PASSWORD="bad"))
    checks = {c["name"]: c for c in json.loads(res.stdout)["checks"]}
    assert checks["remote tier"]["status"] == "fail"
