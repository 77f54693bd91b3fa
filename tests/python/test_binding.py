"""The binding itself: generated cdef, version check, status codes -> exceptions."""

from __future__ import annotations

import builtins
import errno
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvh_cache as kvh
from kvh_cache import _ffi, errors
from kvh_cache._ffi import ffi, lib

REPO = Path(__file__).resolve().parents[2]


def test_cdef_matches_header():
    res = subprocess.run(
        [sys.executable, str(REPO / "bindings" / "gen-cffi.py"), "--check"], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_cdef_check_detects_drift(tmp_path):
    stale = tmp_path / "_cdef.h"
    cdef = (REPO / "python" / "kvh_cache" / "_cdef.h").read_text()
    stale.write_text(cdef.replace("kvh_seq_persist", "kvh_seq_perish"))
    res = subprocess.run(
        [sys.executable, str(REPO / "bindings" / "gen-cffi.py"), "--check", "--output", str(stale)],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 1
    assert "kvh_seq_perish" in res.stdout and "drifted" in res.stderr


def test_version_check():
    assert kvh.LOADED_VERSION == lib.kvh_version()
    assert kvh.BUILT_VERSION == lib.KVH_VERSION_NUMBER
    assert kvh.version() == f"{lib.KVH_VERSION_MAJOR}.{lib.KVH_VERSION_MINOR}.{lib.KVH_VERSION_PATCH}"
    assert _ffi.version_compatible(100, 100)
    assert _ffi.version_compatible(100, 105)  # newer minor/patch library
    assert not _ffi.version_compatible(105, 100)  # library older than the header
    assert not _ffi.version_compatible(100, 10100)  # other major


def test_status_table_matches_header():
    for name, code in errors.STATUS_CODES.items():
        assert int(getattr(lib, name)) == code
        assert ffi.string(lib.kvh_status_name(code)).decode() == name


FAMILIES = [
    ("KVH_ERR_INVALID_ARG", errors.InvalidArgumentError, ValueError),
    ("KVH_ERR_BAD_HANDLE", errors.BadHandleError, None),
    ("KVH_ERR_NOMEM", errors.OutOfMemoryError, MemoryError),
    ("KVH_ERR_NOSPACE", errors.NoSpaceError, None),
    ("KVH_ERR_IO", errors.KvhIOError, OSError),
    ("KVH_ERR_CORRUPT", errors.CorruptionError, None),
    ("KVH_ERR_BUSY", errors.BusyError, None),
    ("KVH_ERR_TIMEOUT", errors.KvhTimeoutError, TimeoutError),
    ("KVH_ERR_UNSUPPORTED", errors.UnsupportedError, None),
    ("KVH_ERR_RANGE", errors.RangeError, IndexError),
    ("KVH_ERR_STRUCT_SIZE", errors.StructSizeError, ValueError),
    ("KVH_ERR_NOT_RESIDENT", errors.NotResidentError, None),
    ("KVH_ERR_CLOSED", errors.ClosedError, None),
    ("KVH_ERR_MISMATCH", errors.MismatchError, None),
    ("KVH_ERR_INTERNAL", errors.InternalError, None),
]


@pytest.mark.parametrize("name,cls,builtin", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_every_status_maps_to_its_exception(name, cls, builtin):
    code = errors.STATUS_CODES[name]
    with pytest.raises(cls) as info:
        _ffi.raise_status(code, "some detail")
    exc = info.value
    assert isinstance(exc, kvh.Error)
    assert exc.status == code and exc.name == name and exc.message == "some detail"
    assert name in str(exc) and "some detail" in str(exc)
    if builtin is not None:
        assert isinstance(exc, builtin)
    # picklable (futures and multiprocessing carry exceptions across)
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is cls and again.status == code and again.message == "some detail"


def test_unknown_status_is_base_error():
    with pytest.raises(kvh.Error) as info:
        _ffi.raise_status(-999)
    assert type(info.value) is kvh.Error
    assert info.value.name == "KVH_ERR_UNKNOWN"


def test_detail_comes_from_last_error():
    c = ffi.new("kvh_config *")
    with pytest.raises(kvh.StructSizeError) as info:
        _ffi.check(lib.kvh_config_init(c, 3))
    assert "3" in info.value.message  # the library's detail names the size


def test_io_error_errno_parsing():
    cases = {
        "cannot create /x: No space left on device": errno.ENOSPC,
        "pwrite failed (errno 5)": 5,
        "open: [Errno 13] Permission denied": 13,
        "io_uring: EIO on slab": errno.EIO,
        "fsync failed, errno=28": 28,
    }
    for msg, want in cases.items():
        exc = errors.KvhIOError(msg, -5)
        assert exc.errno == want, msg
        assert exc.strerror == os.strerror(want)
    assert errors.KvhIOError("something odd", -5).errno is None


@pytest.mark.parametrize("module", ["kvh_cache", "kvh_cache.errors"])
def test_star_import_leaves_the_builtins_alone(module):
    """``from kvh_cache import *`` used to rebind TimeoutError and IOError."""
    namespace: dict = {}
    exec(f"from {module} import *", namespace)
    shadowed = sorted(
        name
        for name in set(namespace) & set(dir(builtins))
        if not name.startswith("__") and namespace[name] is not getattr(builtins, name)
    )
    assert shadowed == []
    assert {"KvhIOError", "KvhTimeoutError"} <= set(namespace)


def test_io_and_timeout_errors_are_the_builtin_kinds():
    assert issubclass(kvh.KvhIOError, OSError) and issubclass(kvh.KvhIOError, kvh.Error)
    assert issubclass(kvh.KvhTimeoutError, TimeoutError) and issubclass(kvh.KvhTimeoutError, kvh.Error)
    assert not hasattr(kvh, "IOError") and not hasattr(kvh, "TimeoutError")


# ---- each family raised by a real call where the library can produce it ----------


def test_real_invalid_argument():
    with pytest.raises(kvh.InvalidArgumentError):
        kvh.Engine(block_tokens=3)  # not a power of two: the library says no


def test_real_bad_handle(engine):
    forged = kvh.Block(engine, 0x1234_5678_9ABC, owned=False)
    with pytest.raises(kvh.BadHandleError):
        forged.info()


def test_real_nomem():
    with pytest.raises((kvh.OutOfMemoryError, kvh.InvalidArgumentError)):
        kvh.Engine(backend="cpu", device_bytes=1 << 62, host_bytes=1 << 20)


def test_real_nospace():
    with kvh.Engine(
        num_kv_heads=1,
        head_dim=8,
        block_tokens=16,
        dtype="f32",
        backend="cpu",
        device_bytes=2 * 1024,
        host_bytes=2 * 1024,
    ) as eng:
        with eng.sequence() as s:
            with pytest.raises(kvh.NoSpaceError):
                s.append(np.arange(16 * 64))
            assert len(s) == 0  # unchanged


def test_real_io_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises((kvh.KvhIOError, kvh.UnsupportedError)) as info:
        kvh.Engine(backend="cpu", disk_path=str(blocker / "store"), disk_bytes=1 << 24)
    if isinstance(info.value, kvh.KvhIOError):
        assert info.value.errno == errno.ENOTDIR


def test_real_busy_mismatch_and_corrupt(tmp_path):
    store = tmp_path / "store"
    geo = dict(num_kv_heads=1, head_dim=8, dtype="f32", backend="cpu", device_bytes=1 << 16, host_bytes=1 << 16)
    try:
        first = kvh.Engine(**geo, disk_path=str(store), disk_bytes=1 << 22)
    except kvh.UnsupportedError:
        pytest.skip("no disk tier in this build")
    with first:
        with pytest.raises(kvh.BusyError):  # the store is locked by `first`
            kvh.Engine(**geo, disk_path=str(store), disk_bytes=1 << 22)
    with pytest.raises(kvh.MismatchError) as info:
        kvh.Engine(**dict(geo, head_dim=16), disk_path=str(store), disk_bytes=1 << 22)
    # the library's advice, in the keyword a Python caller passes
    assert "(pass disk_reset_on_mismatch=True to start it empty)" in info.value.message
    assert "KVH_DISK" not in str(info.value)
    # a damaged index: rebuilt from the slot headers, or, when strict,
    # corrupt (with the reset flag: emptied and reused)
    index = store / "index"
    data = bytearray(index.read_bytes())
    for i in range(8, min(len(data), 80)):
        data[i] ^= 0xFF
    index.write_bytes(bytes(data))
    with pytest.raises((kvh.CorruptionError, kvh.MismatchError)):
        kvh.Engine(**geo, disk_path=str(store), disk_bytes=1 << 22, disk_strict_index=True)
    with kvh.Engine(
        **geo, disk_path=str(store), disk_bytes=1 << 22, disk_strict_index=True, disk_reset_on_mismatch=True
    ) as eng:
        assert eng.tier_info("disk").present
    index.write_bytes(bytes(data))
    with kvh.Engine(**geo, disk_path=str(store), disk_bytes=1 << 22) as eng:
        assert eng.tier_info("disk").present and eng.stats().corrupt_blocks == 1


def test_real_not_resident_names_the_python_method(engine):
    with engine.sequence(tokens=range(16)) as s:
        s.migrate("host")
        with pytest.raises(kvh.NotResidentError, match=r"not the device tier \(Sequence\.acquire\(\) first\)"):
            engine.attention_decode(0, [s], np.zeros((1, 2, 8), np.float32))


C_SPELLING = re.compile(r"\bKVH_[A-Z0-9_]+\b|\bkvh_[a-z0-9_]+\b")


def c_messages_naming_c_spellings():
    """String literals of the C sources that name a KVH_ macro, a kvh_config
    field or a kvh_ function, but are not one (a getenv name, a symbol)."""
    literal = re.compile(r'"((?:[^"\\\n]|\\.)*)"')
    found = []
    for root in ("core", "abi", "kernels"):
        for path in sorted((REPO / root).rglob("*")):
            if path.suffix not in (".c", ".h", ".cu", ".cuh", ".cpp"):
                continue
            for line in path.read_text(errors="replace").splitlines():
                if line.lstrip().startswith("#include"):
                    continue
                for m in literal.finditer(line):
                    text = m.group(1)
                    # a bare name (a getenv name, a symbol) or "$NAME" (an
                    # environment variable: the same through every binding)
                    if C_SPELLING.search(text) and not re.fullmatch(r"\$?\w+", text):
                        found.append((path.relative_to(REPO), text))
    return found


def test_every_c_hint_reads_in_python_terms():
    """Advice in the library's messages names what a C caller writes;
    through the binding it must name what a Python caller writes. Struct
    sizes are the binding's business, not the caller's."""
    messages = c_messages_naming_c_spellings()
    assert any("KVH_DISK_RESET_ON_MISMATCH" in text for _, text in messages)  # the scan sees them
    left = [
        (str(path), text, errors.python_hints(text))
        for path, text in messages
        if "struct_size" not in text and C_SPELLING.search(errors.python_hints(text))
    ]
    assert left == []


def test_real_unsupported(engine):
    with engine.sequence(tokens=range(16)) as s:
        with pytest.raises(kvh.UnsupportedError):
            s.persist()  # no disk tier configured


def test_real_range(engine):
    with engine.sequence(tokens=range(4)) as s:
        with pytest.raises(kvh.RangeError):
            s.read_kv(0, 0, 4)  # never written
        with pytest.raises(IndexError):
            s.tokens(2, 10)


def test_real_not_resident():
    with kvh.Engine(
        num_kv_heads=1, head_dim=8, dtype="f32", backend="cpu", device_bytes=8 * 1024, host_bytes=64 * 1024
    ) as eng:
        with eng.sequence(tokens=range(32)) as s:
            s.migrate("host")
            with pytest.raises(kvh.NotResidentError):
                eng.block_table([s])
            with s.acquire():
                indptr, indices, last = eng.block_table([s])
                assert list(indptr) == [0, 2] and len(indices) == 2 and list(last) == [16]


def test_real_timeout_from_fence(engine):
    # A completed fence never times out; a zero timeout on finished work is done.
    with engine.sequence(tokens=range(16)) as s:
        f = engine.prefetch(s)
        assert f.wait(timeout=5)
        assert f.result(timeout=0) is None


def test_real_closed():
    eng = kvh.Engine(backend="cpu")
    seq = eng.sequence()
    eng.close()
    with pytest.raises(kvh.ClosedError) as info:
        seq.append([1])
    assert info.value.status == lib.KVH_ERR_CLOSED


def test_the_package_loads_its_names_and_submodules_on_first_use():
    # The package's public names load on first use; its submodules are its
    # attributes after `import kvh_cache` alone, as they were when every
    # name was imported eagerly.
    probe = (
        "import types, kvh_cache as k\n"
        "for m in ('engine', 'types', 'vmap', 'context', 'pool', 'attention_plan', 'errors', 'config'):\n"
        "    assert isinstance(getattr(k, m), types.ModuleType), m\n"
        "assert k.Engine is k.engine.Engine and k.Tier is k.types.Tier\n"
        "assert set(k.__all__) <= set(dir(k))\n"
        "ns = {}\n"
        "exec('from kvh_cache import *', ns)\n"
        "assert all(name in ns for name in k.__all__)\n"
        "try:\n    k.no_such_name\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit('no AttributeError')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2] / "python"))
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stderr


def test_an_older_library_on_the_path_is_named_as_the_cause():
    """Against an older libkvh the import failed with the loader's text and
    advice to reinstall, not saying the library found was the older one."""
    from kvh_cache._ffi import _older_library

    for text in (
        "undefined symbol: kvh_engine_owns_thread, version KVH_0",
        "version `KVH_0_EXPERIMENTAL' not found (required by _kvh_cffi.so)",
    ):
        assert "older than this binding" in _older_library(text) and "LD_LIBRARY_PATH" in _older_library(text)
    assert _older_library("libkvh.so.0: cannot open shared object file") == ""
