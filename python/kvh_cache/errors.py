"""Exceptions: one class per family of `kvh_status` codes.

Every failed C call raises a subclass of :class:`kvh.Error` carrying the
status code (``.status``), its name (``.name``, e.g. ``"KVH_ERR_NOSPACE"``)
and the thread-local detail of ``kvh_last_error()`` (``.message``).
Several classes also derive from the matching builtin, so ordinary
``except ValueError`` / ``except IndexError`` / ``except OSError`` /
``except TimeoutError`` / ``except MemoryError`` / ``except KeyError`` code
keeps working. No name here is a builtin's (``KvhIOError``,
``KvhTimeoutError``, ``KvhKeyError``), so ``from kvh import *`` leaves the
builtins alone.
"""

from __future__ import annotations

import errno as _errno
import os
import re
from typing import Dict, Optional, Type

__all__ = [
    "Error",
    "InvalidArgumentError",
    "KvhKeyError",
    "StructSizeError",
    "BadHandleError",
    "ForeignHandleError",
    "OutOfMemoryError",
    "NoSpaceError",
    "KvhIOError",
    "CorruptionError",
    "BusyError",
    "KvhTimeoutError",
    "UnsupportedError",
    "RangeError",
    "NotResidentError",
    "ClosedError",
    "MismatchError",
    "InternalError",
]
# Also public, by name: STATUS_CODES, error_class, python_hints. __all__
# names the exception classes alone, which the package re-exports.


def shown(value: object, limit: int = 80) -> str:
    """repr(value) for a message, cut to about limit characters: a bad
    argument may be a megabyte string or a large array."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        return f"an int of {value.bit_length()} bits" if isinstance(value, int) else f"a {type(value).__name__}"
    return text if len(text) <= limit else f"{text[: limit - 3]}... ({len(text)} characters)"


# Fixed by the ABI (KVH_STATUS_LIST); checked against the header at import.
STATUS_CODES: Dict[str, int] = {
    "KVH_OK": 0,
    "KVH_ERR_INVALID_ARG": -1,
    "KVH_ERR_BAD_HANDLE": -2,
    "KVH_ERR_NOMEM": -3,
    "KVH_ERR_NOSPACE": -4,
    "KVH_ERR_IO": -5,
    "KVH_ERR_CORRUPT": -6,
    "KVH_ERR_BUSY": -7,
    "KVH_ERR_TIMEOUT": -8,
    "KVH_ERR_UNSUPPORTED": -9,
    "KVH_ERR_RANGE": -10,
    "KVH_ERR_STRUCT_SIZE": -11,
    "KVH_ERR_NOT_RESIDENT": -12,
    "KVH_ERR_CLOSED": -13,
    "KVH_ERR_MISMATCH": -14,
    "KVH_ERR_INTERNAL": -15,
}


class Error(Exception):
    """Base class of every error kvh raises for a failed C call.

    Attributes: ``status`` (the negative ``kvh_status``), ``name`` (its
    ``KVH_ERR_*`` name), ``message`` (detail from ``kvh_last_error()``, or
    the static description when the library gave none).
    """

    status: int = 0
    name: str = "KVH_ERR_UNKNOWN"
    message: str = ""

    def __init__(self, message: str = "", status: Optional[int] = None, name: Optional[str] = None):
        cls = type(self)
        self.status = status if status is not None else cls.default_status()
        self.name = name or _NAME_BY_CODE.get(self.status, "KVH_ERR_UNKNOWN")
        self.message = message
        super().__init__(f"{self.name}: {message}" if message else self.name)

    @classmethod
    def default_status(cls) -> int:
        # A refinement of a family (KvhKeyError) has the status of its family.
        for klass in cls.__mro__:
            if klass in _DEFAULT_STATUS:
                return _DEFAULT_STATUS[klass]
        return -999

    def __reduce__(self):  # picklable (e.g. through concurrent.futures)
        return (_rebuild, (type(self), self.message, self.status, self.name))


def _rebuild(cls, message, status, name):
    return cls(message, status, name)


class InvalidArgumentError(Error, ValueError):
    """KVH_ERR_INVALID_ARG: the library rejected an argument."""


class KvhKeyError(InvalidArgumentError, KeyError):
    """KVH_ERR_INVALID_ARG: an unknown name (e.g. a region's); also a
    ``KeyError``."""

    def __str__(self) -> str:  # KeyError.__str__ would quote the message
        return Exception.__str__(self)


class StructSizeError(InvalidArgumentError):
    """KVH_ERR_STRUCT_SIZE: a params struct size this library does not know."""


class BadHandleError(Error):
    """KVH_ERR_BAD_HANDLE: a stale, freed or forged handle."""


class ForeignHandleError(BadHandleError, ValueError):
    """KVH_ERR_BAD_HANDLE for a handle of another engine, found before any
    C call (the library reports such a handle so, with near certainty);
    also a ValueError, as it was raised before."""

    @classmethod
    def of(cls, what: str) -> "ForeignHandleError":
        return cls(f"the {what} belongs to another engine")


class OutOfMemoryError(Error, MemoryError):
    """KVH_ERR_NOMEM: out of host memory."""


class NoSpaceError(Error):
    """KVH_ERR_NOSPACE: no room in any tier for the request."""


class KvhIOError(Error, OSError):
    """KVH_ERR_IO: an I/O error; ``.errno`` is set when the detail names one."""

    def __init__(self, message: str = "", status: Optional[int] = None, name: Optional[str] = None):
        super().__init__(message, status, name)
        self.errno = parse_errno(message)
        if self.errno is not None:
            self.strerror = os.strerror(self.errno)

    def __str__(self) -> str:  # OSError.__str__ would print "[Errno ...]" from args
        return Exception.__str__(self)


class CorruptionError(Error):
    """KVH_ERR_CORRUPT: stored data failed its checksum."""


class BusyError(Error):
    """KVH_ERR_BUSY: the resource is busy or locked by another user."""


class KvhTimeoutError(Error, TimeoutError):
    """KVH_ERR_TIMEOUT: a deadline passed before the work completed."""

    def __str__(self) -> str:
        return Exception.__str__(self)


class UnsupportedError(Error):
    """KVH_ERR_UNSUPPORTED: not supported by this build or machine."""


class RangeError(Error, IndexError):
    """KVH_ERR_RANGE: a position or range out of bounds."""


class NotResidentError(Error):
    """KVH_ERR_NOT_RESIDENT: a block is not in the needed tier (acquire first)."""


class ClosedError(Error):
    """KVH_ERR_CLOSED: the engine is closed or closing."""


class MismatchError(Error):
    """KVH_ERR_MISMATCH: store geometry, model or version mismatch."""


class InternalError(Error):
    """KVH_ERR_INTERNAL: a bug in kvh."""


_CLASS_BY_CODE: Dict[int, Type[Error]] = {
    -1: InvalidArgumentError,
    -2: BadHandleError,
    -3: OutOfMemoryError,
    -4: NoSpaceError,
    -5: KvhIOError,
    -6: CorruptionError,
    -7: BusyError,
    -8: KvhTimeoutError,
    -9: UnsupportedError,
    -10: RangeError,
    -11: StructSizeError,
    -12: NotResidentError,
    -13: ClosedError,
    -14: MismatchError,
    -15: InternalError,
}
_NAME_BY_CODE = {v: k for k, v in STATUS_CODES.items()}
_DEFAULT_STATUS = {cls: code for code, cls in _CLASS_BY_CODE.items()}


def error_class(status: int) -> Type[Error]:
    """The exception class for a status code (``Error`` for unknown codes)."""
    return _CLASS_BY_CODE.get(status, Error)


# Advice in the library's messages that names what a C caller writes (a
# macro, a kvh_config field, a function), and what a Python caller writes
# instead. tests/python/test_binding.py checks that every such message of
# the C sources is covered.
_PYTHON_HINTS = (
    ("set KVH_DISK_RESET_ON_MISMATCH", "pass disk_reset_on_mismatch=True"),
    ("without kvh_config.vmap", "without vmap=True"),
    ("(kvh_seq_acquire first)", "(Sequence.acquire() first)"),
    ("(kvh_vmap_refresh it)", "(VMap.refresh() it)"),
)


def python_hints(message: str) -> str:
    """A library message with its C spellings of advice replaced by the
    keywords and methods of this binding."""
    for c_spelling, python_spelling in _PYTHON_HINTS:
        if c_spelling in message:
            message = message.replace(c_spelling, python_spelling)
    return message


_RESET_ADVICE = re.compile(
    r"\s*\((?:pass disk_reset_on_mismatch=True|set KVH_DISK_RESET_ON_MISMATCH) to start it empty\)"
)


def without_reset_advice(message: str) -> str:
    """A library message without its advice to open the store with the
    reset flag: a command-line tool that never resets a user's store says
    what to do in its own words (``kvh store verify``, ``--fresh``)."""
    return _RESET_ADVICE.sub("", message)


_ERRNO_PATTERNS = [
    re.compile(r"\berrno\s*[=:]?\s*(\d+)", re.I),
    re.compile(r"\[Errno\s+(\d+)\]"),
    re.compile(r"\b(E[A-Z0-9]{2,})\b"),
]
_STRERROR = {os.strerror(n).lower(): n for n in sorted(_errno.errorcode, reverse=True)}


def parse_errno(message: str) -> Optional[int]:
    """Finds an errno in a message: 'errno 5', 'errno=28', '[Errno 5]', 'EIO',
    or a strerror text such as 'No space left on device'."""
    if not message:
        return None
    for pat in _ERRNO_PATTERNS:
        m = pat.search(message)
        if not m:
            continue
        tok = m.group(1)
        if tok.isdigit():
            return int(tok)
        code = getattr(_errno, tok, None)
        if isinstance(code, int):
            return code
    low = message.lower()
    best = None
    for text, code in _STRERROR.items():
        if text and text in low and (best is None or len(text) > len(best[0])):
            best = (text, code)
    return best[1] if best else None
