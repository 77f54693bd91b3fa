"""Finds the C tools (kvh-store, kvh-bench) that the CLI wraps."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import List, Optional

__all__ = ["BadToolVariable", "find_tool", "tool_search_path", "loaded_library_path"]

_ENV = {"kvh-store": "KVH_STORE", "kvh-bench": "KVH_BENCH"}
_SUBDIRS = ("", "tools", "benchmarks", "bin")


class BadToolVariable(RuntimeError):
    """``$KVH_STORE`` / ``$KVH_BENCH`` names something that cannot be run."""


def loaded_library_path() -> Optional[Path]:
    """Path of the libkvh.so the binding loaded (from /proc/self/maps)."""
    try:
        from . import _ffi  # noqa: F401  (makes sure it is loaded)

        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and "/libkvh.so" in parts[5]:
                    return Path(parts[5].strip())
    except (OSError, ImportError):
        pass
    return None


def tool_search_path() -> List[Path]:
    """Directories searched, in order (PATH is searched last)."""
    dirs: List[Path] = [Path(__file__).resolve().parent / "_bin"]
    build = os.environ.get("KVH_BUILD_DIR")
    if build:
        dirs += [Path(build) / s for s in _SUBDIRS]
    lib = loaded_library_path()
    if lib is not None:
        dirs += [lib.parent / s for s in _SUBDIRS]
    repo_build = Path(__file__).resolve().parent.parent.parent / "build"
    dirs += [repo_build / s for s in _SUBDIRS]
    seen, out = set(), []
    for d in dirs:
        key = str(d)
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


def find_tool(name: str) -> Optional[str]:
    """``$KVH_STORE`` / ``$KVH_BENCH``, then the package's ``_bin/``, the
    build directory (``$KVH_BUILD_DIR``, beside the loaded libkvh, the
    repository's ``build/``), then ``PATH``. Raises :class:`BadToolVariable`
    when the variable is set to something that is not an executable file."""
    env = _ENV.get(name)
    if env and os.environ.get(env):
        given = os.environ[env]
        # A bare name is looked up on PATH, as the shell would.
        path = given if os.sep in given else shutil.which(given)
        if path is None or not os.path.isfile(path) or not os.access(path, os.X_OK):
            raise BadToolVariable(f"${env}={given}: not an executable file")
        return path
    for d in tool_search_path():
        p = d / name
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return shutil.which(name)
