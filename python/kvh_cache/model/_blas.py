"""Limits the BLAS thread count around decode steps.

A decode step multiplies one row by each weight matrix (a GEMV); OpenBLAS
splits that over all cores and its threads spin while they wait, which
on a small or busy machine costs several times the work itself (measured
on 2 cores: 55 ms/token single-threaded, 375 ms of CPU per token with the
default threads under load). ``blas_threads(n)`` sets the thread count of
the BLAS library NumPy loaded for the duration of a ``with`` block:
through ``threadpoolctl`` when it is installed, else by calling
``openblas_set_num_threads`` (any of its symbol spellings) in the loaded
OpenBLAS, else not at all.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Iterator, List, Optional, Tuple

__all__ = ["blas_threads"]

_SET = (
    "openblas_set_num_threads",
    "scipy_openblas_set_num_threads64_",
    "scipy_openblas_set_num_threads",
    "openblas_set_num_threads64_",
)
_GET = (
    "openblas_get_num_threads",
    "scipy_openblas_get_num_threads64_",
    "scipy_openblas_get_num_threads",
    "openblas_get_num_threads64_",
)

_lock = threading.Lock()
_libs: Optional[List[Tuple[object, object]]] = None


def _find() -> List[Tuple[object, object]]:
    global _libs
    if _libs is not None:
        return _libs
    found: List[Tuple[object, object]] = []
    try:
        import numpy  # noqa: F401  (loads the BLAS)

        del numpy

        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "openblas" in line.lower() and ".so" in line})
        for p in paths:
            try:
                lib = ctypes.CDLL(p)
            except OSError:
                continue
            for s, g in zip(_SET, _GET):
                fs, fg = getattr(lib, s, None), getattr(lib, g, None)
                if fs is not None and fg is not None:
                    fs.argtypes, fs.restype, fg.restype = [ctypes.c_int], None, ctypes.c_int
                    found.append((fs, fg))
                    break
    except OSError:
        pass
    _libs = found
    return found


@contextlib.contextmanager
def blas_threads(n: Optional[int]) -> Iterator[None]:
    """``with blas_threads(1): ...`` — None leaves the library alone."""
    if n is None:
        yield
        return
    try:
        from threadpoolctl import threadpool_limits  # type: ignore[import-not-found]
    except ImportError:
        threadpool_limits = None
    if threadpool_limits is not None:
        with threadpool_limits(limits=n, user_api="blas"):
            yield
        return
    libs = _find()
    with _lock:
        old = [fg() for _, fg in libs]
        for fs, _ in libs:
            fs(n)
    try:
        yield
    finally:
        with _lock:
            for (fs, _), o in zip(libs, old):
                fs(o)
