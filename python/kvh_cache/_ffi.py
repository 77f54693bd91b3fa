"""Loads the compiled CFFI module, checks the library version, and turns
status codes into exceptions. Internal: use the `kvh` package."""

from __future__ import annotations

import _thread
import logging
import threading
from typing import NoReturn

from . import errors


def _older_library(text: str) -> str:
    """What a loader error says when the libkvh found lacks a call or a
    symbol version this binding uses: an older build earlier on the path."""
    if "undefined symbol: kvh_" not in text and "version `KVH_" not in text:
        return ""
    return (
        " The libkvh the dynamic loader found is older than this binding: LD_LIBRARY_PATH, "
        "KVH_BUILD_DIR or the system's library path names an older build; point them at the "
        "libkvh this package was built with, or rebuild it."
    )


try:
    from ._kvh_cffi import ffi, lib  # type: ignore[import-not-found]
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "kvh: the compiled binding kvh_cache._kvh_cffi could not be loaded "
        f"({exc}).{_older_library(str(exc))} Installed package: reinstall it (pip install --force-reinstall "
        "kvh-cache). Development tree: build libkvh (cmake --build build) and run "
        "`python3 python/build_cffi.py` (tests/python/conftest.py does it)."
    ) from exc

# The header the binding was compiled against (values baked in by the C
# compiler) versus the library that the dynamic loader found.
BUILT_VERSION: int = int(lib.KVH_VERSION_NUMBER)
BUILT_VERSION_STRING = f"{lib.KVH_VERSION_MAJOR}.{lib.KVH_VERSION_MINOR}.{lib.KVH_VERSION_PATCH}"
LOADED_VERSION: int = int(lib.kvh_version())
LOADED_VERSION_STRING: str = ffi.string(lib.kvh_version_string()).decode()


def version_compatible(built: int, loaded: int) -> bool:
    """Same major version, and the library is at least as new as the header
    the binding was built from (a newer minor only adds)."""
    return built // 10000 == loaded // 10000 and loaded >= built


if not version_compatible(BUILT_VERSION, LOADED_VERSION):
    raise ImportError(
        f"kvh: the binding was built for libkvh {BUILT_VERSION_STRING} ({BUILT_VERSION}) but the loaded "
        f"library is {LOADED_VERSION_STRING} ({LOADED_VERSION}); rebuild the binding or fix LD_LIBRARY_PATH"
    )

# The status list of the header must agree with the exception table.
for _name, _code in errors.STATUS_CODES.items():
    if int(getattr(lib, _name)) != _code:  # pragma: no cover - ABI drift
        raise ImportError(f"kvh: status {_name} is {getattr(lib, _name)} in the header, {_code} in kvh_cache.errors")

NULL = ffi.NULL
U64_MAX = (1 << 64) - 1

# ---- log sink -----------------------------------------------------------------
logger = logging.getLogger("kvh")

LOG_LEVELS = {
    int(lib.KVH_LOG_ERROR): logging.ERROR,
    int(lib.KVH_LOG_WARN): logging.WARNING,
    int(lib.KVH_LOG_INFO): logging.INFO,
    int(lib.KVH_LOG_DEBUG): logging.DEBUG,
}


# The engine (its log token, the sink's user value) whose log message this
# thread is handling, 0 when none.
_sink = threading.local()


def in_sink_of(token: int) -> bool:
    """Whether this thread is inside the log sink of the engine with this
    token (where kvh refuses that engine's close, and on a kvh thread every
    call into it)."""
    return token != 0 and getattr(_sink, "token", 0) == token


@ffi.def_extern()
def _kvh_py_log(user, level, message):  # pragma: no cover - exercised via C
    # Runs on any kvh thread (cffi takes the GIL); must never raise into C.
    try:
        outer = getattr(_sink, "token", 0)
        _sink.token = int(ffi.cast("uintptr_t", user))
        try:
            text = ffi.string(message).decode("utf-8", "replace") if message != ffi.NULL else ""
            logger.log(LOG_LEVELS.get(int(level), logging.DEBUG), "%s", text)
        finally:
            _sink.token = outer
    except KeyboardInterrupt:
        # Ctrl-C met in a handler cannot go through C. On the main thread
        # (kvh logs on the calling thread) it is raised once the call and
        # its bookkeeping are done (take_pending_interrupt); elsewhere, sent
        # to the main thread as Ctrl-C would have been.
        if threading.current_thread() is threading.main_thread():
            _sink.interrupted = True
        else:
            _thread.interrupt_main()
    except BaseException:
        pass


def take_pending_interrupt() -> bool:
    """Whether a log handler met Ctrl-C on this thread since the last ask."""
    if getattr(_sink, "interrupted", False):
        _sink.interrupted = False
        return True
    return False


def kvh_level_for_logger() -> int:
    """The highest kvh_log_level worth sending, from the logger's level."""
    eff = logger.getEffectiveLevel()
    if eff <= logging.DEBUG:
        return int(lib.KVH_LOG_DEBUG)
    if eff <= logging.INFO:
        return int(lib.KVH_LOG_INFO)
    if eff <= logging.WARNING:
        return int(lib.KVH_LOG_WARN)
    return int(lib.KVH_LOG_ERROR)


# ---- errors ------------------------------------------------------------------------
def last_error() -> str:
    """The detail of this thread's last failed call, its advice in Python terms."""
    return errors.python_hints(ffi.string(lib.kvh_last_error()).decode("utf-8", "replace"))


def status_name(status: int) -> str:
    return ffi.string(lib.kvh_status_name(status)).decode()


def strerror(status: int) -> str:
    return ffi.string(lib.kvh_strerror(status)).decode()


def raise_status(status: int, detail: str | None = None) -> NoReturn:
    """Raises the exception for status; call right after the failing C call
    (kvh_last_error is thread-local and replaced by the next call)."""
    if detail is None:
        detail = last_error()
    cls = errors.error_class(status)
    raise cls(detail or strerror(status), status, status_name(status))


def check(status: int) -> None:
    if status != 0:
        raise_status(status)
