"""kvh_cache.config: argument > environment > file > default, the TOML file, the
environment's syntax (the C library's kvh_config_from_env), and kvh doctor
showing where each value came from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvh_cache as kvh
import kvh_cache.config as kc
from kvh_cache.types import DType

REPO = Path(__file__).resolve().parents[2]


def _toml(tmp_path, text):
    p = tmp_path / "kvh.toml"
    p.write_text(text)
    return p


def test_precedence(tmp_path):
    f = _toml(tmp_path, 'head_dim = 32\nhost_bytes = "2M"\nnum_layers = 3\nlru_k = 3\n')
    env = {"KVH_CONFIG": str(f), "KVH_HOST_BYTES": "4M", "KVH_NUM_LAYERS": "5"}
    r = kc.resolve(environ=env, num_layers=7, defaults={"lru_k": 1, "block_tokens": 8})
    c = r.config
    assert c.num_layers == 7 and r.sources["num_layers"] == "argument"
    assert c.host_bytes == 4 << 20 and r.sources["host_bytes"] == "env KVH_HOST_BYTES"
    assert c.head_dim == 32 and r.sources["head_dim"] == f"file {f}"
    assert c.lru_k == 3 and r.sources["lru_k"] == f"file {f}"
    assert c.block_tokens == 8 and r.sources["block_tokens"] == "default"
    assert c.device_bytes is None and "device_bytes" not in r.sources
    assert r.file == f


def test_config_argument_and_file_keyword(tmp_path):
    f = _toml(tmp_path, "head_dim = 32\n")
    r = kc.resolve(kvh.Config(head_dim=16), environ={}, file=f)
    assert r.config.head_dim == 16 and r.sources["head_dim"] == "argument"
    assert kc.load(environ={}, file=f).head_dim == 32
    assert kc.load(environ={}).head_dim is None  # no KVH_CONFIG: no file


def test_environment_syntax():
    env = {
        "KVH_DEVICE_BYTES": "512K",
        "KVH_DTYPE": "f32",
        "KVH_BACKEND": "cpu",
        "KVH_DISK_FLAGS": "buffered,share_group",
        "KVH_VMAP": "off",
        "KVH_NUMA_NODE": "-1",
        "KVH_DISK_PATH": "/tmp/some store",
        "KVH_HOST_BYTES": "",  # empty: unset
    }
    c = kc.load(environ=env)
    assert c.device_bytes == 512 << 10
    assert c.dtype == DType.F32
    assert c.disk_buffered and c.disk_share_group and not c.disk_reset_on_mismatch
    assert c.vmap is False and c.numa_node == -1
    assert c.disk_path == "/tmp/some store"
    assert c.host_bytes is None


def test_bad_variable_is_named():
    with pytest.raises(kvh.InvalidArgumentError, match=r'KVH_HOST_BYTES="4X"'):
        kc.load(environ={"KVH_HOST_BYTES": "4X"})
    with pytest.raises(kvh.InvalidArgumentError, match="KVH_BACKEND"):
        kc.load(environ={"KVH_BACKEND": "gpu"})


@pytest.mark.parametrize("var", ["KVH_DTYPE", "KVH_BACKEND", "KVH_KV_CODEC", "KVH_EVICTION_POLICY", "KVH_LOG_LEVEL"])
def test_a_number_that_is_no_enum_value_is_named(var, tmp_path):
    # Refused while parsing, naming the variable (or the file's key), not
    # later by the engine's open (log_level 9 used to pass `kvh doctor`).
    with pytest.raises(kvh.InvalidArgumentError, match=f'{var}="7": expected one of .*or its number'):
        kc.load(environ={var: "7"})
    key = var[len("KVH_") :].lower()
    with pytest.raises(ValueError, match=f"{key} = 7"):
        kc.load(environ={}, file=_toml(tmp_path, f"{key} = 7\n"))


def test_bad_file(tmp_path):
    with pytest.raises(ValueError, match="unknown key 'hots_bytes'"):
        kc.load(environ={}, file=_toml(tmp_path, "hots_bytes = 1\n"))
    with pytest.raises(ValueError, match="host_bytes"):
        kc.load(environ={}, file=_toml(tmp_path, 'host_bytes = "lots"\n'))
    with pytest.raises(ValueError, match="not valid TOML"):
        kc.load(environ={}, file=_toml(tmp_path, "head_dim = \n"))
    with pytest.raises(TypeError, match="hed_dim"):
        kc.load(environ={}, hed_dim=3)
    # An endless file (/dev/zero) is refused after a bound, not read into
    # all memory; a file that is not UTF-8 is not TOML.
    with pytest.raises(ValueError, match="larger than 1 MiB"):
        kc.load(environ={}, file="/dev/zero")
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b"disk_path = '\xff'\n")
    with pytest.raises(ValueError, match="not UTF-8"):
        kc.load(environ={}, file=bad)


@pytest.mark.parametrize(
    "line, word",
    [
        ("lru_k = true", "lru_k must be an integer"),
        ("migration_threads = -1", "migration_threads = -1"),
        ("head_dim = 1.5", "head_dim must be an integer"),
        ("disk_buffered = 'yes'", "disk_buffered must be true or false"),
        ("disk_path = 7", "disk_path must be a string"),
        ("vmap = 2.0", "vmap must be true, false or a string"),
        ("host_bytes = 36893488147419103232", "host_bytes"),
        ("dtype = 99", "dtype = 99"),
        ("kv_codec = 7", "kv_codec = 7"),
    ],
)
def test_bad_values_in_a_file_are_named(tmp_path, line, word):
    # A value of the wrong type, or a number the library refuses, passed the
    # file and failed later: a TypeError traceback from `kvh stats`.
    f = _toml(tmp_path, line + "\n")
    with pytest.raises(ValueError, match=word) as err:
        kc.load(environ={}, file=f)
    assert str(f) in str(err.value)


def test_file_values_of_every_kind_are_read(tmp_path):
    f = _toml(tmp_path, "lru_k = 3\nvmap = true\ncopy_moves = '1'\ndtype = 1\ndisk_buffered = true\n")
    cfg = kc.load(environ={}, file=f)
    assert (cfg.lru_k, cfg.vmap, cfg.copy_moves, cfg.dtype, cfg.disk_buffered) == (3, True, True, DType.F16, True)


def _empty_store(tmp_path):
    """A store made by an engine and closed with nothing in it."""
    store = tmp_path / "store"
    with kvh.Engine(
        num_layers=1,
        num_kv_heads=1,
        head_dim=8,
        block_tokens=8,
        disk_path=str(store),
        disk_bytes=1 << 20,
        backend="cpu",
    ):
        pass
    return store


def test_stats_with_a_bad_value_in_the_config_file(tmp_path):
    f = _toml(tmp_path, "lru_k = true\n")
    store = _empty_store(tmp_path)
    env = dict(__import__("os").environ, KVH_CONFIG=str(f), PYTHONPATH=str(REPO / "python"))
    res = subprocess.run(
        [sys.executable, "-m", "kvh_cache", "stats", str(store)], capture_output=True, text=True, env=env
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr and "lru_k must be an integer" in res.stderr, (
        res.stderr
    )


def test_opens_an_engine(tmp_path):
    f = _toml(tmp_path, 'device_bytes = "256K"\nhost_bytes = "1M"\nbackend = "cpu"\n')
    cfg = kc.load(environ={"KVH_CONFIG": str(f), "KVH_HEAD_DIM": "32"}, num_layers=2)
    with kvh.Engine(cfg) as eng:
        assert eng.head_dim == 32 and eng.num_layers == 2
        host = eng.tier_info("host")
        assert 0 < host.capacity_blocks * eng.block_bytes <= 1 << 20


def test_every_field_has_a_variable():
    import dataclasses

    assert set(kc.ENV_VARS) == {f.name for f in dataclasses.fields(kvh.Config)}


def test_doctor_shows_sources(tmp_path):
    f = _toml(tmp_path, "head_dim = 96\n")
    import os

    env = dict(os.environ, KVH_CONFIG=str(f), KVH_HOST_BYTES="8G")
    env["PYTHONPATH"] = str(REPO / "python") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    out = subprocess.run(
        [sys.executable, "-m", "kvh_cache", "doctor", "--json", "--data-dir", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    cfg = json.loads(out)["config"]
    assert cfg["head_dim"] == {"value": "96", "source": f"file {f}"}
    assert cfg["host_bytes"] == {"value": str(8 << 30), "source": "env KVH_HOST_BYTES"}
    assert cfg["block_tokens"]["source"] == "default"
    env["KVH_LRU_K"] = "many"
    res = subprocess.run(
        [sys.executable, "-m", "kvh_cache", "doctor", "--data-dir", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert 'KVH_LRU_K="many"' in res.stdout


def test_readme_lists_every_variable():
    import re

    readme = (REPO / "README.md").read_text()
    listed = set(re.findall(r"`(KVH_[A-Z0-9_]+)`", readme))
    missing = set(kc.ENV_VARS.values()) - listed
    # Every variable the C library, the kernels and the Python package read.
    pattern = re.compile(r"""(?:getenv\(|environ\.get\(|environ\[)\s*["'](KVH_[A-Z0-9_]+)""")
    for d in ("core", "kernels", "python/kvh_cache"):
        for path in (REPO / d).rglob("*"):
            if path.suffix in (".c", ".cu", ".h", ".py"):
                missing |= set(pattern.findall(path.read_text(errors="replace"))) - listed
    assert not missing, f"README.md's configuration tables lack {sorted(missing)}"


def test_prefault_memory(tmp_path):
    c = kc.load(environ={"KVH_PREFAULT_MEMORY": "1", "KVH_BACKEND": "cpu"})
    assert c.prefault_memory is True
    with kvh.Engine(c, device_bytes=1 << 20, host_bytes=2 << 20) as eng:
        assert eng.config.prefault_memory is True
    with kvh.Engine(backend="cpu", device_bytes=1 << 20, host_bytes=2 << 20) as eng:
        assert eng.config.prefault_memory is False
    with pytest.raises(kvh.InvalidArgumentError, match="KVH_PREFAULT_MEMORY"):
        kc.load(environ={"KVH_PREFAULT_MEMORY": "sometimes"})


def test_a_value_with_a_nul_is_refused(tmp_path):
    # The C parser read up to the NUL: "4G\0junk" was taken as 4G.
    with pytest.raises(kvh.InvalidArgumentError, match="KVH_HOST_BYTES.*NUL"):
        kc.load(environ={"KVH_HOST_BYTES": "4G\x00junk"})
    with pytest.raises(ValueError, match="host_bytes.*NUL"):
        kc.load(environ={}, file=_toml(tmp_path, 'host_bytes = "4G\\u0000junk"\n'))


def test_the_package_depends_on_tomli_where_tomllib_is_missing():
    """from_file falls back to tomli before Python 3.11, which the package
    did not declare: `kvh doctor` on 3.9 or 3.10 failed to read the file."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11: the package this test asks for
        tomllib = pytest.importorskip("tomli")
    deps = tomllib.loads((REPO / "python" / "pyproject.toml").read_text())["project"]["dependencies"]
    plain = [d.replace(" ", "").replace("'", '"') for d in deps]
    assert any(d.split(";")[0] == "tomli" and d.endswith('python_version<"3.11"') for d in plain), deps


@pytest.fixture
def without_a_toml_reader(monkeypatch):
    # None in sys.modules makes the import fail as a missing module would.
    monkeypatch.setitem(sys.modules, "tomllib", None)
    monkeypatch.setitem(sys.modules, "tomli", None)


def test_a_missing_toml_reader_is_named(tmp_path, without_a_toml_reader, monkeypatch, capsys):
    f = _toml(tmp_path, "head_dim = 32\n")
    with pytest.raises(ModuleNotFoundError, match=r"needs the tomli package .*pip install tomli"):
        kc.from_file(f)
    store = _empty_store(tmp_path)
    from kvh_cache import cli

    monkeypatch.setenv("KVH_CONFIG", str(f))
    assert cli.main(["stats", str(store)]) == 3
    assert "pip install tomli" in capsys.readouterr().err
    assert cli.main(["doctor", "--json", "--data-dir", str(tmp_path / "d")]) == 1
    assert "pip install tomli" in json.loads(capsys.readouterr().out)["config_error"]
