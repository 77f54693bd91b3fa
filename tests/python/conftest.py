"""pytest setup for the Python front-end.

Finds the development package (python/) and makes sure its CFFI extension is
built against the CMake build of libkvh ($KVH_BUILD_DIR, default build/):
`python/build_cffi.py` compiles it in place when it is missing or older than
the header/cdef (a few seconds; a no-op otherwise).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PYDIR = REPO / "python"
BUILD_DIR = Path(os.environ.get("KVH_BUILD_DIR") or REPO / "build").resolve()

if str(PYDIR) not in sys.path:
    sys.path.insert(0, str(PYDIR))
os.environ.setdefault("KVH_BUILD_DIR", str(BUILD_DIR))


def _ensure_extension() -> None:
    if not (BUILD_DIR / "libkvh.so").exists():
        raise pytest.UsageError(
            f"{BUILD_DIR}/libkvh.so not found: build libkvh first (make build, or cmake -S . -B build && "
            "cmake --build build), or point KVH_BUILD_DIR at a build"
        )
    import build_cffi

    try:
        build_cffi.build_inplace(quiet=True)
    except SystemExit as exc:  # build_cffi reports problems with SystemExit
        raise pytest.UsageError(str(exc)) from None


_ensure_extension()


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long tests, skipped unless asked for (pytest -m slow / KVH_RUN_SLOW=1)")


def pytest_report_header(config):
    import kvh_cache as kvh

    return [f"kvh: libkvh {kvh.LOADED_VERSION_STRING} from {BUILD_DIR}, package {Path(kvh.__file__).parent}"]


@pytest.fixture
def engine():
    import kvh_cache as kvh

    with kvh.Engine(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        block_tokens=16,
        dtype="f32",
        device_bytes=64 * 4096,
        host_bytes=256 * 4096,
        backend="cpu",
    ) as eng:
        yield eng
