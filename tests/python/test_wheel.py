"""The wheel: built from the repository (libkvh compiled from the C
sources by setup.py), installed into a fresh virtual environment, imported
and run from another directory with no LD_LIBRARY_PATH or PYTHONPATH.

Offline: the wheel is built without build isolation (the setuptools, wheel
and cffi already installed) and the venv sees the system site-packages for
numpy and cffi. The CUDA backend is left out (KVH_WHEEL_CUDA=0) to keep the
test quick. Set KVH_SKIP_WHEEL_TEST=1 to skip it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(os.environ.get("KVH_SKIP_WHEEL_TEST") == "1", reason="KVH_SKIP_WHEEL_TEST=1")


def clean_env(**extra):
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "PYTHONPATH",
            "LD_LIBRARY_PATH",
            "KVH_BUILD_DIR",
            "KVH_LIB_DIR",
            "KVH_STORE",
            "KVH_BENCH",
            "PYTHONHOME",
            "VIRTUAL_ENV",
        )
    }
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    env = clean_env(KVH_WHEEL_CUDA="0", PIP_NO_INDEX="1")
    if importlib.util.find_spec("build") is not None:
        cmd = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(REPO / "python")]
    else:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-build-isolation",
            "--no-deps",
            "-w",
            str(out),
            str(REPO / "python"),
        ]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    wheels = list(out.glob("kvh-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_contents(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvh/libkvh.so.0" in names
    assert any(n.startswith("kvh/_kvh_cffi") and n.endswith(".so") for n in names)
    for n in (
        "kvh/__init__.py",
        "kvh/cli.py",
        "kvh/_cdef.h",
        "kvh/py.typed",
        "kvh/demo/__init__.py",
        "kvh/demo/agents/__init__.py",
        "kvh/model/__init__.py",
    ):
        assert n in names
    # the demo's document library (package data)
    assert any(n.startswith("kvh/demo/data/corpus/") and n.endswith(".txt") for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "kvh = kvh.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
    # the extension finds libkvh beside itself
    ext = next(n for n in names if n.startswith("kvh/_kvh_cffi"))
    data = zipfile.ZipFile(wheel).read(ext)
    assert b"$ORIGIN" in data


def test_wheel_in_fresh_venv(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    res = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-index", "--no-deps", "--quiet", str(wheel)],
        capture_output=True,
        text=True,
        env=clean_env(),
    )
    assert res.returncode == 0, res.stdout + res.stderr
    smoke = textwrap.dedent("""
        import os, numpy as np, kvh
        assert os.path.realpath(kvh.__file__).startswith(os.path.realpath(os.environ["VENV"])), kvh.__file__
        with kvh.Engine(num_layers=2, num_kv_heads=2, head_dim=8, dtype="f32", backend="cpu",
                        device_bytes=1 << 16, host_bytes=1 << 20) as eng:
            with eng.sequence(tokens=range(40)) as seq:
                k = np.arange(40 * 16, dtype=np.float32).reshape(40, 2, 8)
                seq.write_kv(1, 0, k, -k)
                rk, rv = seq.read_kv(1)
                assert np.array_equal(rk, k) and np.array_equal(rv, -k)
                with seq.fork() as child:
                    child.write_kv(1, 0, -k[:1], k[:1])
                    assert np.array_equal(seq.read_kv(1, 0, 1)[0], k[:1])
        from kvh.tools import loaded_library_path
        lib = loaded_library_path()
        assert lib is not None and os.path.realpath(str(lib)).startswith(os.path.realpath(os.environ["VENV"])), lib
        print("smoke ok", kvh.version())
    """)
    env = clean_env(VENV=str(venv))
    res = subprocess.run([str(py), "-c", smoke], capture_output=True, text=True, env=env, cwd=str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "smoke ok" in res.stdout
    kvh_cmd = venv / "bin" / "kvh"
    assert kvh_cmd.exists()
    res = subprocess.run([str(kvh_cmd), "--version"], capture_output=True, text=True, env=env, cwd=str(tmp_path))
    assert res.returncode == 0 and res.stdout.startswith("kvh "), res.stderr
    store = tmp_path / "store"
    res = subprocess.run(
        [str(kvh_cmd), "demo", "--agents", "1", "--steps", "3", "--chunks", "4", "--json", "--data-dir", str(store)],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(tmp_path),
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    names = zipfile.ZipFile(wheel).namelist()
    if "kvh/_bin/kvh-store" in names and (store / "index").exists():
        res = subprocess.run(
            [str(kvh_cmd), "store", "verify", str(store)], capture_output=True, text=True, env=env, cwd=str(tmp_path)
        )
        assert res.returncode == 0, res.stdout + res.stderr
