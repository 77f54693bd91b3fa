"""Engine, Sequence, Block, Hold and Fence: the typed Python API over libkvh.

Lifetime rules
--------------
* Every object that owns a C resource frees it deterministically through a
  context manager or an explicit ``close()``/``free()``/``release()``, and
  from ``__del__`` as a fallback. Double frees are no-ops.
* After ``Engine.close()`` every call on the engine or on one of its
  sequences, blocks, holds or fences raises :class:`kvh.ClosedError` (a
  fence already seen complete keeps answering with its outcome, as a
  finished future does: it no longer needs the engine); after
  ``Sequence.free()`` calls on it raise :class:`kvh.BadHandleError`. Nothing
  reaches C with a dangling handle or pointer.
* ``close()`` waits for calls in flight on other threads (e.g. a fence
  wait). While zero-copy block views are alive, the C engine (and so the
  memory the views point into) is kept until the last view is collected.

Threads: the binding releases the GIL during every C call and keeps the C
library's ``@threads`` rules for its user, per object
(:class:`kvh_cache._handle.HandleGate`): calls that C marks ``@threads handle``
on one sequence (or view, context, ...) run one at a time, first come
first served, while ``@threads any`` calls (``Engine.prefetch``,
``Engine.stats``, ``len(seq)``, fence waits) run beside them. Freeing an
object waits for the calls in flight on it; later calls raise
:class:`kvh.BadHandleError` (:class:`kvh.ClosedError` for the engine's).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import numbers
import atexit
import logging
import operator
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence as Seq, Tuple, Union

import numpy as np

from . import errors
from ._ffi import (
    NULL,
    U64_MAX,
    check,
    ffi,
    in_sink_of,
    kvh_level_for_logger,
    last_error,
    lib,
    raise_status,
    status_name,
    take_pending_interrupt,
)
from ._handle import (
    Finalized,
    ForkSafeLock,
    GatedHandle,
    GateUse,
    HandleGate,
    OwnedHandle,
    Uncopyable,
    WeakBag,
    in_lock_order,
)
from .types import (
    Backend,
    BlockInfo,
    Codec,
    Config,
    Eviction,
    DType,
    RemoteUpload,
    Scope,
    Stats,
    Tier,
    TierInfo,
    numpy_dtype,
)

__all__ = ["Engine", "Sequence", "Block", "Hold", "Fence", "TokenSpan"]

log = logging.getLogger("kvh")

TokenSpan = Union[range, int, None]
ArrayLike = Any

_LOG_NAMES = {"error": 0, "warn": 1, "warning": 1, "info": 2, "debug": 3}
_U32 = (1 << 32) - 1


# ---------------------------------------------------------------------------------
# argument checks (before anything reaches C)
# ---------------------------------------------------------------------------------
def _q_lens(q_lens: Any, n: int, per: str) -> List[int]:
    """q_lens as n row counts; reads at most n + 1 entries, so an endless
    iterable is refused, not consumed."""
    lens = [_index(f"q_lens[{i}]", x, maximum=_U32) for i, x in enumerate(itertools.islice(q_lens, n + 1))]
    if len(lens) != n:
        has = f"more than {n}" if len(lens) > n else str(len(lens))
        raise ValueError(f"q_lens has {has} entries, expected one per {per} ({n})")
    return lens


def _index(name: str, value: Any, *, maximum: int = U64_MAX) -> int:
    """A non-negative integer argument; TypeError/ValueError naming it."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, not bool")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, not {type(value).__name__}") from None
    if v < 0:
        raise ValueError(f"{name} must be >= 0, got {errors.shown(v)}")
    if v > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {errors.shown(v)}")
    return v


def _flag(name: str, value: Any) -> int:
    """An on/off field as the C library's 0 or 1: a bool, or the int 0 or
    1 (``vmap=1``); anything else is refused rather than read by its truth
    (``"off"`` would be on)."""
    if isinstance(value, (bool, np.bool_)):
        return 1 if value else 0
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a bool, not {type(value).__name__}") from None
    if v not in (0, 1):
        raise ValueError(f"{name} must be a bool (or 0 or 1), got {errors.shown(v)}")
    return v


def _timeout_ns(name: str, value: Any) -> int:
    """A timeout in seconds as the C library's nanoseconds: None or +inf
    is no limit, a negative one polls; anything but a real number (a
    string, a bool, NaN) is refused rather than misread."""
    if value is None:
        return U64_MAX
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds or None, not {type(value).__name__}")
    secs = float(value)
    if math.isnan(secs):
        raise ValueError(f"{name} must be a number of seconds or None, got nan")
    if secs <= 0:
        return 0
    ns = secs * 1e9
    return U64_MAX if ns >= U64_MAX else int(ns)


# The longest one C wait may hold the main thread: Python runs signal
# handlers (Ctrl-C's KeyboardInterrupt) only between calls.
_WAIT_SLICE_NS = 100_000_000
# The longest an executor thread waits on after its ``await fence`` was
# given up.
_AWAIT_SLICE_NS = 20_000_000


def _interruptible(ns: int, wait_ns: Callable[[int], bool]) -> bool:
    """``wait_ns(ns)`` (True: done, False: timed out), cut into slices on
    the main thread so a Ctrl-C during a long wait is not held back until
    the work is done."""
    if ns <= _WAIT_SLICE_NS or threading.current_thread() is not threading.main_thread():
        return wait_ns(ns)
    deadline = None if ns == U64_MAX else time.monotonic_ns() + ns
    while True:
        step = _WAIT_SLICE_NS
        if deadline is not None:
            left = deadline - time.monotonic_ns()
            if left <= 0:
                return wait_ns(0)
            step = min(step, left)
        if wait_ns(step):
            return True


def _path(name: str, value: Any) -> bytes:
    """A path or text argument as the C library's bytes, without NUL."""
    try:
        raw = os.fsencode(value)
    except TypeError:
        raise TypeError(f"{name} must be a str, bytes or os.PathLike, not {type(value).__name__}") from None
    if b"\0" in raw:
        raise ValueError(f"{name} must not contain NUL bytes")
    return raw


def _real(name: str, value: Any, lo: float = -math.inf, hi: float = math.inf) -> float:
    """A finite real argument in [lo, hi]; TypeError/ValueError naming it."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, not {type(value).__name__}")
    try:
        v = float(value)
    except OverflowError:  # an int past a double
        raise ValueError(f"{name} must be a finite number in [{lo}, {hi}], got {errors.shown(value)}") from None
    if not (math.isfinite(v) and lo <= v <= hi):
        raise ValueError(f"{name} must be a finite number in [{lo}, {hi}], got {v}")
    return v


_FLT_MAX = 3.4028234663852886e38
_FLT_TRUE_MIN = 1.401298464324817e-45


def _c_float(name: str, value: Any, lo: float = -math.inf) -> float:
    """A finite real argument bound for a C float: kvh reads 0 there as "the
    default" and refuses infinity, so a nonzero value that would round to 0
    stays the smallest float of its sign, and one past the float range the
    largest, not infinity. Compared in its own type (an int, a Fraction or a
    long double may lie past a double's range too)."""
    if isinstance(value, (bool, np.bool_, np.timedelta64)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, not {type(value).__name__}")
    if isinstance(value, np.generic) and value.dtype.itemsize <= 8:
        value = value.item()  # exact; comparing a float16 to the float bounds would overflow it
    if isinstance(value, numbers.Rational):
        finite = True
    elif isinstance(value, np.generic):
        finite = bool(np.isfinite(value))
    else:
        try:
            finite = math.isfinite(value)
        except OverflowError:
            finite = True
    if not finite or value < lo:
        raise ValueError(f"{name} must be a finite number in [{lo}, inf], got {errors.shown(value)}")
    if value > _FLT_MAX or value < -_FLT_MAX:
        return _FLT_MAX if value > 0 else -_FLT_MAX
    if value != 0 and -_FLT_TRUE_MIN < value < _FLT_TRUE_MIN:
        return _FLT_TRUE_MIN if value > 0 else -_FLT_TRUE_MIN
    return float(value)


def _int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, not bool")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, not {type(value).__name__}") from None
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {errors.shown(v)}")
    return v


def _tokens(tokens: ArrayLike) -> np.ndarray:
    """Token ids as a contiguous int32 array shaped (n,)."""
    if isinstance(tokens, (str, bytes, bytearray, memoryview)):
        # Bytes would become one token id per byte, silently.
        raise TypeError(
            f"tokens must be a sequence of ints or an integer array shaped (n,), not {type(tokens).__name__}"
        )
    if isinstance(tokens, np.ma.MaskedArray):
        # Its mask would be ignored: masked ids taken as whatever lies under them.
        raise TypeError("tokens is a numpy.ma.MaskedArray, whose mask kvh cannot honour: pass tokens.filled(...)")
    arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
    if arr.dtype.kind not in "iu":
        if arr.size == 0 and not isinstance(tokens, np.ndarray):
            arr = arr.astype(np.int32)
        else:
            raise TypeError(f"tokens must be integers (int32 token ids) shaped (n,), got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, shaped (n,); got shape {arr.shape}")
    if arr.size and arr.dtype != np.int32:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < -(1 << 31) or hi >= (1 << 31):
            raise ValueError(f"token ids must fit in int32; got values in [{lo}, {hi}]")
    return np.ascontiguousarray(arr, dtype=np.int32)


def _ptr(arr: np.ndarray, ctype: str = "char[]"):
    """Pointer to an array's data (no copy); NULL for an empty array."""
    return ffi.from_buffer(ctype, arr) if arr.size else NULL


def _iptr(arr: np.ndarray):
    return _ptr(arr, "int32_t[]")


# ---------------------------------------------------------------------------------
# the native engine pointer, its call accounting and deferred release
# ---------------------------------------------------------------------------------
class _Native:
    """Owns the ``kvh_engine *``. Every call passes through ``gate`` (shared:
    the engine's calls are ``@threads any``), so ``close`` never frees the
    engine under a running call; live zero-copy views defer the C close
    until they are gone."""

    def __init__(self, ptr) -> None:
        self.ptr = ptr
        # A close the library refuses (from the engine's own log sink), or
        # one cut short before the C call, leaves it open.
        self.gate = HandleGate(
            lambda: errors.ClosedError("the engine is closed", lib.KVH_ERR_CLOSED),
            reopen_if_end_fails=lambda: not self.released,
        )
        # Views and release; re-entrant: finalizers may run anywhere.
        self.lock = ForkSafeLock(reentrant=True)
        # The objects that keep the engine's memory, by id, held weakly: one
        # collected without its finaliser's drop_view (a Ctrl-C met as the
        # finaliser began, before any of its code ran) counts as dropped,
        # or the C close would wait for it for good.
        self.view_owners: Dict[int, "weakref.ref[Any]"] = {}
        self.release_deferred = False
        self.released = False
        self.close_status = 0
        # Frees the library refused where a collection ran them (inside the
        # engine's log sink on a kvh thread): made by the next call that may.
        self.deferred: List[Callable[[], Any]] = []
        self.log_token = 0  # the log sink's user value (_ffi.in_sink_of)
        # Pool batches not yet seen complete, whose arrays kvh may still
        # write (kvh_cache.pool: held here, so that they go with the engine).
        self.batches: List[Any] = []

    @property
    def closed(self) -> bool:
        return self.gate.closed

    def enter(self, frame: Any = None):
        """Counts a call made from ``frame`` (by default the caller's)."""
        self.gate.enter(False, frame or sys._getframe(1))
        if self.deferred:
            try:
                self._run_deferred()
            except BaseException:  # Ctrl-C in a deferred release: not entered
                self.gate.leave(False)
                raise
        return self.ptr

    def leave(self) -> None:
        self.gate.leave(False)

    def defer(self, free: Callable[[], Any]) -> None:
        """``free()``, refused here with BusyError, runs again at the next
        call that may make it; the engine's close frees what is left."""
        with self.lock:
            self.deferred.append(free)

    def _run_deferred(self) -> None:
        with self.lock:
            todo, self.deferred = self.deferred, []
        for i, free in enumerate(todo):
            try:
                free()
            except errors.BusyError:  # still inside the sink
                with self.lock:
                    self.deferred.extend(todo[i:])
                return
            except Exception:  # a free that cannot be made: nothing left to do
                pass
            except BaseException:  # Ctrl-C: the rest wait for the next call
                with self.lock:
                    self.deferred.extend(todo[i + 1 :])
                raise

    def close(self) -> int:
        """Waits for calls in flight, then closes the C engine (or leaves
        that to the last view). Returns its status."""
        if in_sink_of(self.log_token):
            # kvh refuses it; waiting for the calls in flight first could
            # wait for this very thread (a worker that completes their fences).
            raise errors.BusyError(
                "an engine cannot be closed from inside its own log handler: close it after the handler returns",
                lib.KVH_ERR_BUSY,
            )
        if self.deferred and not self.gate.closed:
            # Releases a log handler could not make (of views, whose count
            # would otherwise keep the C engine open for good): made now.
            self.enter()
            self.leave()
        return self.gate.close(self._end) or 0

    def refuse_in_own_sink(self) -> None:
        """kvh refuses every call into an engine from its log sink on a kvh
        thread; a gate taken first could wait for that thread itself."""
        if in_sink_of(self.log_token) and self.ptr != NULL and lib.kvh_engine_owns_thread(self.ptr):
            raise errors.BusyError(
                "the engine's log handler, on a thread kvh started, cannot call into the engine (the call "
                "could wait for that thread): call from another thread",
                lib.KVH_ERR_BUSY,
            )

    @property
    def views(self) -> int:
        """Views alive now (their owners not collected)."""
        with self.lock:
            dead = [k for k, ref in self.view_owners.items() if ref() is None]
            for k in dead:
                del self.view_owners[k]
            return len(self.view_owners)

    def _end(self) -> int:
        with self.lock:
            views = self.views
            if views:
                self.release_deferred = True
                with _orphans_lock:
                    _closes_waiting_for_views.add(self)
            else:
                st = self._release()
        if views:
            # Logged with the lock let go: a handler may call into kvh,
            # whose calls can wait for a thread that waits for this lock.
            log.debug("kvh: engine close deferred until %d block view(s) are collected", views)
            return 0
        if st == lib.KVH_ERR_BUSY:  # called from its own log sink: still open
            raise_status(st)
        return st

    def _release(self) -> int:
        if self.released:
            return 0
        # Forgotten before the call: Python raises a Ctrl-C (or a signal
        # handler's exception) right after a C call returns, and the pointer
        # kept past a close that ran would be used again, freed.
        ptr, self.ptr, self.released = self.ptr, NULL, True
        st = lib.kvh_engine_close(ptr)
        if st == lib.KVH_ERR_BUSY:  # refused, and changed nothing: a later close can end it
            self.ptr, self.released = ptr, False
            return st
        self.close_status = st
        with _orphans_lock:
            _closes_waiting_for_views.discard(self)
        return st

    def add_view(self, owner: Any) -> None:
        """Keeps the engine's memory until ``drop_view(owner)`` or the
        owner's collection; ClosedError once that memory is gone."""
        with self.lock:
            if self.released:
                raise errors.ClosedError("the engine is closed", lib.KVH_ERR_CLOSED)
            self.view_owners[id(owner)] = weakref.ref(owner)

    def drop_view(self, owner: Any) -> None:
        with self.lock:
            self.view_owners.pop(id(owner), None)
            self.release_if_unviewed()

    def _any_view_alive(self) -> bool:
        # Stops at the first live owner, forgetting the dead met before
        # it: amortised O(1) a drop, also with many views outstanding.
        with self.lock:
            dead = []
            alive = False
            for k, ref in self.view_owners.items():
                if ref() is not None:
                    alive = True
                    break
                dead.append(k)
            for k in dead:
                del self.view_owners[k]
            return alive

    def release_if_unviewed(self) -> None:
        """Ends a close that waited for views, once none is alive."""
        with self.lock:
            if self.release_deferred and not self._any_view_alive():
                self._release()


_live_engines = WeakBag()
_log_tokens = itertools.count(1)  # each engine's log sink user value


# Engines collected where the library refused their close (inside their
# own log sink on a kvh thread): closed by the next engine opened, or at exit.
_orphans: List["_Native"] = []
_orphans_lock = ForkSafeLock()
# Engines closed while views of their memory lived: the C close waits
# for the last view; at exit, for views whose finalisers never ran.
_closes_waiting_for_views: "set[_Native]" = set()


def _close_orphans() -> None:
    with _orphans_lock:
        todo = _orphans[:]
        _orphans.clear()
    for native in todo:
        try:
            native.close()
        except errors.BusyError:
            with _orphans_lock:
                _orphans.append(native)
        except Exception:
            pass


@atexit.register
def _close_all_at_exit() -> None:  # stop worker threads before interpreter teardown
    # Every engine, also when a Ctrl-C comes meanwhile: the process is
    # ending anyway, and an engine left open loses its index snapshot.
    for eng in _live_engines.live():
        for _ in range(2):
            try:
                eng.close()
                break
            except KeyboardInterrupt:
                continue
            except Exception:
                break
    # Closes that waited for views whose finalisers never ran.
    with _orphans_lock:
        waiting = list(_closes_waiting_for_views)
    for native in waiting:
        try:
            native.release_if_unviewed()
        except Exception:
            pass
    _close_orphans()


_STATS_FIELDS: Optional[Tuple[Tuple[str, ...], Tuple[str, ...]]] = None


def _stats_fields() -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """(fields kvh.Stats names, newer fields it does not) of kvh_stats."""
    global _STATS_FIELDS
    if _STATS_FIELDS is None:
        ours = set(Stats.__dataclass_fields__) - {"extra"}  # type: ignore[attr-defined]
        names = [n for n, _ in ffi.typeof("kvh_stats").fields if n != "struct_size" and not n.startswith("reserved")]
        _STATS_FIELDS = (tuple(n for n in names if n in ours), tuple(n for n in names if n not in ours))
    return _STATS_FIELDS


class _Call:
    """``with engine._call(*uses) as ptr:`` — one C call: through the gates
    of the handles it names (``gate.exclusive()`` / ``gate.shared()``), then
    the engine's."""

    __slots__ = ("native", "uses")

    def __init__(self, native: _Native, uses: Tuple[GateUse, ...]) -> None:
        self.native = native
        self.uses = in_lock_order(uses)

    def __enter__(self):
        self.native.refuse_in_own_sink()
        entered = 0
        frame = sys._getframe(1)  # the call's ``with``: see HandleGate.enter
        try:
            for use in self.uses:
                use.gate.enter(use.exclusive, frame)
                entered += 1
            return self.native.enter(frame)
        except BaseException:
            for use in reversed(self.uses[:entered]):
                use.gate.leave(use.exclusive)
            raise

    def __exit__(self, *exc) -> None:
        self.native.leave()
        for use in reversed(self.uses):
            use.gate.leave(use.exclusive)
        # Ctrl-C met by a log handler during the call: it wins over the
        # call's own error, as it would have outside a handler.
        if take_pending_interrupt() and exc[0] is not KeyboardInterrupt:
            raise KeyboardInterrupt


# ---------------------------------------------------------------------------------
# Engine
# ---------------------------------------------------------------------------------
class Engine(OwnedHandle):
    """One kvh engine (``kvh_engine``): tiers, blocks, sequences, migration.

    ``Engine(config=None, **fields)`` takes a :class:`kvh.Config` and/or its
    fields as keywords (``num_layers=2, head_dim=64, dtype="f32",
    device_bytes=1 << 20, ...``). Use it as a context manager::

        with kvh.Engine(num_layers=2, num_kv_heads=4, head_dim=64, dtype="f32") as eng:
            with eng.sequence() as seq:
                seq.append(range(32))
                seq.write_kv(0, 0, k, v)

    Log messages of the library go to ``logging.getLogger("kvh")``.
    """

    def __init__(self, config: Optional[Config] = None, /, **fields: Any) -> None:
        self._native: Optional[_Native] = None
        # The kvh.Context last switched in, weakly: a Context refers to its
        # engine, and a strong reference back made a cycle that kept an
        # engine dropped by its caller open (threads, store lock) until the
        # cycle collector ran.
        self._current_context_ref: Optional[weakref.ref] = None
        if config is None:
            config = Config(**fields)
        elif not isinstance(config, Config):
            raise TypeError(f"config must be a kvh.Config, not {type(config).__name__}")
        elif fields:
            config = config.replace(**fields)
        c = ffi.new("kvh_config *")
        check(lib.kvh_config_init(c, ffi.sizeof("kvh_config")))
        keep = self._fill_config(c, config)
        token = next(_log_tokens)
        c.log_user = ffi.cast("void *", token)
        out = ffi.new("kvh_engine **")
        try:
            st = lib.kvh_engine_open(c, out)
        finally:
            # Owned even when a Ctrl-C comes right after the call returned
            # (its status then unread): the engine closes with this object.
            if out[0] != NULL:
                try:
                    self._native = _Native(out[0])
                    self._native.log_token = token
                except BaseException:
                    # A Ctrl-C while the owner was being made: nothing owns
                    # the engine yet, and its threads and store lock would
                    # outlive every reference to it.
                    if self._native is None:
                        lib.kvh_engine_close(out[0])
                    raise
        if st != 0:
            raise_status(st)
        del keep
        self._geom = (int(c.num_layers), int(c.num_kv_heads), int(c.head_dim), int(c.block_tokens))
        self._dtype = DType(int(c.dtype))
        self._np_dtype = numpy_dtype(self._dtype)
        bb = ffi.new("uint64_t *")
        check(lib.kvh_engine_block_bytes(out[0], bb))
        self._block_bytes = int(bb[0])
        name = lib.kvh_engine_backend(out[0])
        self._backend = ffi.string(name).decode() if name != NULL else "unknown"
        self._config = self._read_config(c, config)
        _live_engines.add(self)
        if _orphans:
            _close_orphans()

    # ---- configuration ----
    @staticmethod
    def _fill_config(c, cfg: Config) -> list:
        keep: list = []

        def setu(name: str, bits: int = 32) -> None:
            v = getattr(cfg, name)
            if v is not None:
                setattr(c, name, _index(name, v, maximum=(1 << bits) - 1))

        for name in (
            "num_layers",
            "num_kv_heads",
            "head_dim",
            "block_tokens",
            "migration_threads",
            "lru_k",
            "promote_min_hits",
            "disk_queue_depth",
        ):
            setu(name)
        for name in ("device_bytes", "host_bytes", "disk_bytes", "model_salt", "migration_cpu_mask"):
            setu(name, 64)
        if cfg.cuda_device is not None:
            c.cuda_device = _int("cuda_device", cfg.cuda_device, 0, (1 << 31) - 1)
        if cfg.numa_node is not None:
            c.numa_node = _int("numa_node", cfg.numa_node, -1, (1 << 31) - 1)
        if cfg.dtype is not None:
            c.dtype = int(DType.parse(cfg.dtype))
        if cfg.backend is not None:
            c.backend = int(Backend.parse(cfg.backend))
        if cfg.log_level is None:
            c.log_level = kvh_level_for_logger()
        elif isinstance(cfg.log_level, str):
            key = cfg.log_level.strip().lower()
            if key not in _LOG_NAMES:
                raise ValueError(f"log_level must be one of {sorted(_LOG_NAMES)}, got {errors.shown(cfg.log_level)}")
            c.log_level = _LOG_NAMES[key]
        else:
            c.log_level = _int("log_level", cfg.log_level, 0, 3)
        if cfg.disk_path is not None:
            path = _path("disk_path", cfg.disk_path)
            # Without a size the library opens no disk tier, which would only
            # show when persist() fails; the library refuses it too (the same
            # InvalidArgumentError).
            if not c.disk_bytes:
                raise errors.InvalidArgumentError(
                    f"disk_path={os.fspath(cfg.disk_path)!r} needs disk_bytes > 0 (the disk tier's size in bytes); "
                    "pass disk_bytes=..., or leave disk_path unset for no disk tier",
                    lib.KVH_ERR_INVALID_ARG,
                )
            buf = ffi.new("char[]", path)
            keep.append(buf)
            c.disk_path = buf
        flags = 0
        if _flag("disk_reset_on_mismatch", cfg.disk_reset_on_mismatch):
            flags |= int(lib.KVH_DISK_RESET_ON_MISMATCH)
        if _flag("disk_buffered", cfg.disk_buffered):
            flags |= int(lib.KVH_DISK_BUFFERED)
        if _flag("disk_share_group", cfg.disk_share_group):
            flags |= int(lib.KVH_DISK_SHARE_GROUP)
        c.disk_flags = flags
        if cfg.disk_strict_index is not None:
            c.disk_strict_index = _flag("disk_strict_index", cfg.disk_strict_index)
        if cfg.kv_codec is not None:
            c.kv_codec = int(Codec.parse(cfg.kv_codec))
        if cfg.vmap is not None:
            c.vmap = _flag("vmap", cfg.vmap)
        if cfg.eviction_policy is not None:
            c.eviction_policy = int(Eviction.parse(cfg.eviction_policy))
        if cfg.lctru_window is not None:
            c.lctru_window = _index("lctru_window", cfg.lctru_window, maximum=_U32)
        if cfg.copy_moves is not None:
            c.copy_moves = _flag("copy_moves", cfg.copy_moves)
        if cfg.prefault_memory is not None:
            c.prefault_memory = _flag("prefault_memory", cfg.prefault_memory)
        for name in ("remote_addrs", "remote_user", "remote_password", "remote_tls_ca"):
            text = getattr(cfg, name)
            if text is not None:
                buf = ffi.new("char[]", _path(name, text))
                keep.append(buf)
                setattr(c, name, buf)
        for name in ("remote_timeout_ms", "remote_ttl_s", "remote_upload", "remote_breaker_ms"):
            setu(name)
        if cfg.remote_tls is not None:
            c.remote_tls = _flag("remote_tls", cfg.remote_tls)
        c.log_fn = lib._kvh_py_log
        c.log_user = NULL
        return keep

    @staticmethod
    def _read_config(c, given: Config) -> Config:
        return Config(
            num_layers=int(c.num_layers),
            num_kv_heads=int(c.num_kv_heads),
            head_dim=int(c.head_dim),
            block_tokens=int(c.block_tokens),
            dtype=DType(int(c.dtype)),
            backend=Backend(int(c.backend)),
            cuda_device=int(c.cuda_device),
            device_bytes=int(c.device_bytes),
            host_bytes=int(c.host_bytes),
            disk_bytes=int(c.disk_bytes),
            disk_path=given.disk_path,
            model_salt=int(c.model_salt),
            numa_node=int(c.numa_node),
            migration_threads=int(c.migration_threads),
            migration_cpu_mask=int(c.migration_cpu_mask),
            lru_k=int(c.lru_k),
            promote_min_hits=int(c.promote_min_hits),
            log_level=int(c.log_level),
            disk_queue_depth=int(c.disk_queue_depth),
            disk_reset_on_mismatch=given.disk_reset_on_mismatch,
            disk_buffered=given.disk_buffered,
            disk_share_group=given.disk_share_group,
            disk_strict_index=bool(c.disk_strict_index),
            kv_codec=Codec(int(c.kv_codec)),
            vmap=bool(c.vmap),
            eviction_policy=Eviction(int(c.eviction_policy)),
            lctru_window=int(c.lctru_window),
            copy_moves=bool(c.copy_moves),
            prefault_memory=bool(c.prefault_memory),
            remote_addrs=given.remote_addrs,
            remote_user=given.remote_user,
            remote_password=given.remote_password,
            remote_tls=bool(c.remote_tls),
            remote_tls_ca=given.remote_tls_ca,
            remote_timeout_ms=int(c.remote_timeout_ms),
            remote_ttl_s=int(c.remote_ttl_s),
            remote_upload=RemoteUpload(c.remote_upload),
            remote_breaker_ms=int(c.remote_breaker_ms),
        )

    # ---- lifetime ----
    def close(self) -> None:
        """Waits for calls in flight, then closes the C engine (every handle
        of the engine becomes invalid). Idempotent. While block views of
        its memory live (arrays made by :meth:`Sequence.block_view`), the
        C close waits for the last of them to be collected: the engine is
        closed to every call at once, but its memory, its worker threads
        and its disk store (locked against other engines) stay until then.
        Drop the views first to have the store back at once."""
        native = self._native
        if native is None:
            return
        st = native.close()
        _live_engines.discard(self)
        if st != 0:
            raise_status(st)

    @property
    def closed(self) -> bool:
        return self._native is None or self._native.closed

    def _close_at_gc(self) -> None:
        # The native close only: no status to raise, no registry to update.
        if self._native is not None and not self._native.closed:
            try:
                self._native.close()
            except errors.BusyError:
                with _orphans_lock:
                    _orphans.append(self._native)

    def __repr__(self) -> str:
        if self.closed:
            return "<kvh.Engine closed>"
        L, H, D, B = self._geom
        return (
            f"<kvh.Engine backend={self._backend} layers={L} kv_heads={H} head_dim={D} "
            f"block_tokens={B} dtype={self._dtype.short} block_bytes={self._block_bytes}>"
        )

    def _call(self, *uses: GateUse) -> _Call:
        """``with engine._call(*uses) as ptr:`` around one C call; ``uses``
        are the gates of the handles it names (``h._gate.shared()``, ...)."""
        if self._native is None:
            raise errors.ClosedError("the engine is closed", lib.KVH_ERR_CLOSED)
        return _Call(self._native, uses)

    def _check_usable(self) -> None:  # ``with eng:`` on a closed engine raises ClosedError
        with self._call():
            pass

    # ---- properties ----
    @property
    def config(self) -> Config:
        """The effective configuration (library defaults filled in)."""
        return self._config

    @property
    def num_layers(self) -> int:
        return self._geom[0]

    @property
    def num_kv_heads(self) -> int:
        return self._geom[1]

    @property
    def head_dim(self) -> int:
        return self._geom[2]

    @property
    def block_tokens(self) -> int:
        return self._geom[3]

    @property
    def dtype(self) -> DType:
        return self._dtype

    @property
    def np_dtype(self) -> np.dtype:
        """NumPy dtype of K/V arrays: float32, float16, or uint16 for bf16 bits."""
        return self._np_dtype

    @property
    def backend(self) -> str:
        """``"cpu"`` or ``"cuda"``: the backend in use."""
        return self._backend

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    @property
    def layer_bytes(self) -> int:
        """Bytes of K and V of one layer in a block."""
        return self._block_bytes // self.num_layers

    @property
    def kv_shape(self) -> Tuple[int, int]:
        """(num_kv_heads, head_dim): K/V arrays are shaped (n, *kv_shape)."""
        return (self.num_kv_heads, self.head_dim)

    # ---- sequences ----
    def sequence(
        self,
        agent: int = 0,
        tokens: Optional[ArrayLike] = None,
        *,
        token_budget: int = 0,
        context: Any = None,
        scope: Union[Scope, int, None] = None,
    ) -> "Sequence":
        """A new empty sequence owned by ``agent`` (tokens, if given, are appended).
        ``token_budget`` (expected final length) subjects it to admission
        (see :meth:`admission`; NoSpaceError when its pool is full, and
        from an append that would grow it past its budget when the pool
        cannot reserve those blocks too);
        ``context`` attaches it to a :class:`kvh.Context`; ``scope`` (an int
        or a :class:`kvh.Scope`) is its tenant scope (default: the engine's
        default scope 0)."""
        agent = _index("agent", agent, maximum=_U32)
        sc = Scope.of(scope)
        token_budget = _index("token_budget", token_budget)
        h = ffi.new("kvh_seq *")
        if token_budget or context is not None:
            uses: List[GateUse] = []
            sp = ffi.new("kvh_seq_params *")
            check(lib.kvh_seq_params_init(sp, ffi.sizeof("kvh_seq_params")))
            sp.agent = agent
            sp.token_budget = token_budget
            if context is not None:
                from .context import Context

                if not isinstance(context, Context):
                    raise TypeError(f"context must be a kvh.Context, not {type(context).__name__}")
                context._check_engine(self)
                sp.context.id = context.handle
                uses.append(context._gate.shared())
            with self._call(*uses) as p:
                check(lib.kvh_seq_create_ex(p, sp, h))
        else:
            with self._call() as p:
                check(lib.kvh_seq_create(p, agent, h))
        seq = Sequence(self, h, agent)
        try:
            if sc != Scope():
                seq.set_scope(sc)
            if tokens is not None:
                seq.append(tokens)
        except BaseException:
            seq.free()
            raise
        return seq

    # ---- weight contexts and admission (kvh_cache.context) ----
    def context(self, name: str = "", *, kv_policy: str = "keep", chunk_bytes: Optional[int] = None) -> Any:
        """A new :class:`kvh.Context` for one model's weights. ``kv_policy``:
        ``"keep"`` leaves its agents' KV in place on a switch away,
        ``"demote"`` moves it out of the device tier and back with the
        weights. ``chunk_bytes``: checksum and I/O unit (default 2 MiB)."""
        from .context import KV_POLICIES, Context, _name

        name = _name("name", name)
        # Not hashed unless a str: a list would raise "unhashable type".
        if not isinstance(kv_policy, str) or kv_policy not in KV_POLICIES:
            raise ValueError(f"kv_policy must be one of {sorted(KV_POLICIES)}, got {errors.shown(kv_policy)}")
        cp = ffi.new("kvh_context_params *")
        check(lib.kvh_context_params_init(cp, ffi.sizeof("kvh_context_params")))
        cp.kv_policy = KV_POLICIES[kv_policy]
        if chunk_bytes is not None:
            cp.chunk_bytes = _index("chunk_bytes", chunk_bytes)
        nm = ffi.new("char[]", name.encode("utf-8", "surrogateescape")[:63])
        cp.name = nm
        out = ffi.new("kvh_context *")
        with self._call() as p:
            check(lib.kvh_context_create(p, cp, out))
        return Context(self, int(out.id), name)

    @property
    def current_context(self) -> Any:
        """The :class:`kvh.Context` last switched in (None if none, or if
        the program no longer refers to it)."""
        return self._current_context

    @property
    def _current_context(self) -> Any:
        ref = self._current_context_ref
        return ref() if ref is not None else None

    @_current_context.setter
    def _current_context(self, context: Any) -> None:
        self._current_context_ref = weakref.ref(context) if context is not None else None

    def _switch(self, prev: Any, to: Any, wait: bool) -> Optional["Fence"]:
        f = ffi.new("kvh_fence *") if not wait else NULL
        with self._call(*(c._gate.shared() for c in (prev, to) if c is not None)) as p:
            frm = prev._h[0] if prev is not None else ffi.new("kvh_context *")[0]
            dst = to._h[0] if to is not None else ffi.new("kvh_context *")[0]
            check(lib.kvh_context_switch(p, frm, dst, f))
        if to is not None:
            self._current_context = to
        elif prev is self._current_context:
            self._current_context = None
        return None if wait else Fence(self, f)

    def weight_stats(self) -> Any:
        """Weight residency and movement counters (:class:`kvh_cache.context.WeightStats`)."""
        from .context import weight_stats

        return weight_stats(self)

    def latency_histogram(self, kind: Union[str, int]) -> Any:
        """One latency histogram (:class:`kvh_cache.latency.LatencyHistogram`):
        ``"acquire_stall"``, ``"disk_read"`` or ``"disk_write"``."""
        from .latency import latency_histogram

        return latency_histogram(self, kind)

    def latency_histograms(self) -> Dict[str, Any]:
        """Every latency histogram by kind name (:mod:`kvh_cache.latency`)."""
        from .latency import latency_histograms

        return latency_histograms(self)

    def admission(
        self, *, short_max_tokens: int = 4096, short_device_bytes: int = 0, long_device_bytes: int = 0
    ) -> None:
        """Token-budget admission: requests with a budget of at most
        ``short_max_tokens`` draw on the short pool's device quota, others on
        the long pool's. Both quotas 0 turns admission off."""
        ap = ffi.new("kvh_admission_params *")
        check(lib.kvh_admission_params_init(ap, ffi.sizeof("kvh_admission_params")))
        ap.short_max_tokens = _index("short_max_tokens", short_max_tokens)
        ap.short_device_bytes = _index("short_device_bytes", short_device_bytes)
        ap.long_device_bytes = _index("long_device_bytes", long_device_bytes)
        with self._call() as p:
            check(lib.kvh_admission_configure(p, ap))

    def admission_info(self) -> Any:
        from .context import admission_info

        return admission_info(self)

    # ---- statistics and tiers ----
    def stats(self) -> Stats:
        """A snapshot of the engine's monotonic counters."""
        s = ffi.new("kvh_stats *")
        s.struct_size = ffi.sizeof("kvh_stats")
        with self._call() as p:
            check(lib.kvh_engine_stats(p, s))
        kw: Dict[str, int] = {}
        extra: Dict[str, int] = {}
        known, unknown = _stats_fields()
        for name in known:
            kw[name] = getattr(s, name)
        for name in unknown:
            extra[name] = getattr(s, name)
        return Stats(**kw, extra=extra)

    def tier_info(self, tier: Union[Tier, int, str]) -> TierInfo:
        t = Tier.parse(tier)
        info = ffi.new("kvh_tier_info *")
        info.struct_size = ffi.sizeof("kvh_tier_info")
        with self._call() as p:
            check(lib.kvh_tier_info_get(p, int(t), info))
        return TierInfo(
            tier=t,
            capacity_blocks=int(info.capacity_blocks),
            used_blocks=int(info.used_blocks),
            used_bytes=int(info.used_bytes),
            block_bytes=int(info.block_bytes),
            pinned_blocks=int(info.pinned_blocks),
            base=int(ffi.cast("uintptr_t", info.base)),
            clean_copies=int(info.clean_copies),
        )

    def tiers(self) -> Dict[Tier, TierInfo]:
        return {t: self.tier_info(t) for t in Tier}

    def set_agent_quota(self, agent: int, device_bytes: int) -> None:
        """Per-agent device-tier quota in bytes (0 = unlimited).

        Counted in whole blocks (rounded down, at least one). Lowering it
        below what the agent holds moves nothing by itself: the agent's next
        device-tier allocations evict its own blocks until it is under.
        """
        agent = _index("agent", agent, maximum=_U32)
        device_bytes = _index("device_bytes", device_bytes)
        with self._call() as p:
            check(lib.kvh_agent_set_quota(p, agent, device_bytes))

    # ---- migration and prefetch ----
    def prefetch(
        self, seq: "Sequence", first: TokenSpan = None, n: Optional[int] = None, *, priority: int = 0
    ) -> "Fence":
        """Hint: tokens ``first .. first+n`` (or a ``range``; default: all) of
        ``seq`` will be needed soon. Returns a future-like :class:`Fence` that
        completes when the promotions it started are done. Any thread."""
        if not isinstance(seq, Sequence):
            raise TypeError(f"seq must be a kvh.Sequence, not {type(seq).__name__}")
        priority = _int("priority", priority, -(1 << 31), (1 << 31) - 1)
        seq._check_engine(self)
        f = ffi.new("kvh_fence *")
        with self._call(seq._gate.shared()) as p:
            first_, n_ = seq._span(p, first, n)
            check(lib.kvh_prefetch(p, seq._h[0], first_, n_, priority, f))
        return Fence(self, f)

    def hint(self, seq: "Sequence", first: TokenSpan = None, n: Optional[int] = None, *, priority: int = 0) -> None:
        """Advice, moving nothing: tokens ``first .. first+n`` (or a
        ``range``; default: all) of ``seq`` will be read, the higher
        ``priority`` the sooner. Until then their blocks are evicted after
        every unhinted block, lowest priority first. A block keeps its two
        highest priorities; the first access after a hint redeems the
        higher (the rest of that use redeems nothing). A priority is a rank
        among every hinted block, whenever hinted: give a scheduler's
        requests their absolute number in run order (e.g. ``2**31 - 1 - n``
        for the n-th request), not their place in the queue, which goes
        stale as the queue advances (kvh.h ``kvh_seq_hint``); or hint by
        place with :meth:`hint_queued`, which maps places to numbers. Any
        thread."""
        if not isinstance(seq, Sequence):
            raise TypeError(f"seq must be a kvh.Sequence, not {type(seq).__name__}")
        priority = _int("priority", priority, -(1 << 31), (1 << 31) - 1)
        seq._check_engine(self)
        with self._call(seq._gate.shared()) as p:
            first_, n_ = seq._span(p, first, n)
            check(lib.kvh_seq_hint(p, seq._h[0], first_, n_, priority))

    def hint_queued(
        self,
        seq: "Sequence",
        first: TokenSpan = None,
        n: Optional[int] = None,
        *,
        position: Optional[int] = None,
        request: Optional[int] = None,
    ) -> None:
        """Queue hint (experimental): tokens ``first .. first+n`` (or a
        ``range``; default: all) of ``seq`` will be read by the request at
        ``position`` in the scheduler's queue (0: the next one), or by
        request number ``request`` on the step count of
        :meth:`hint_advance`; give exactly one. Hinting by position before
        every step, by number, or once when a request enters the queue
        gives the same eviction order, provided :meth:`hint_advance` is
        called once per request taken; a priority lasts until an access
        made once the step has reached its request redeems it, or the step
        passes its request (earlier reads leave it). A request already taken
        is ignored; one 2**24 or more ahead raises RangeError. Any thread."""
        if not isinstance(seq, Sequence):
            raise TypeError(f"seq must be a kvh.Sequence, not {type(seq).__name__}")
        if (position is None) == (request is None):
            raise ValueError("give exactly one of position and request")
        if position is not None:
            place, kind = _int("position", position, 0, (1 << 64) - 1), lib.KVH_HINT_POSITION
        else:
            place, kind = _int("request", request, 0, (1 << 64) - 1), lib.KVH_HINT_REQUEST
        seq._check_engine(self)
        with self._call(seq._gate.shared()) as p:
            first_, n_ = seq._span(p, first, n)
            check(lib.kvh_seq_hint_queued(p, seq._h[0], first_, n_, place, kind))

    def hint_advance(self, steps: int = 1) -> int:
        """Advances the queue-hint step count by ``steps`` (0: only reads
        it) and returns it: call once per request taken from the queue,
        after it read its blocks. Queue-hint priorities of the requests it
        passes are dropped. Any thread."""
        steps = _int("steps", steps, 0, (1 << 64) - 1)
        out = ffi.new("uint64_t *")
        with self._call() as p:
            check(lib.kvh_hint_advance(p, steps, out))
        return int(out[0])

    def migrate(
        self, blocks: Iterable["Block"], tier: Union[Tier, int, str], *, wait: bool = True
    ) -> Optional["Fence"]:
        """Moves blocks to ``tier`` (pinned ones are skipped). ``wait=False``
        returns a Fence instead of waiting."""
        wait = bool(_flag("wait", wait))
        t = Tier.parse(tier)
        blist = list(blocks)
        for b in blist:
            if not isinstance(b, Block):
                raise TypeError(f"blocks must be kvh.Block objects, not {type(b).__name__}")
            b._check_engine(self)
        arr = ffi.new("kvh_block[]", max(1, len(blist)))
        for i, b in enumerate(blist):
            arr[i].id = b.handle
        f = ffi.new("kvh_fence *") if not wait else NULL
        with self._call(*(b._gate.shared() for b in blist)) as p:
            check(lib.kvh_migrate(p, arr, len(blist), int(t), f))
        return None if wait else Fence(self, f)

    # ---- blocks and the prefix index ----
    def block_alloc(self, agent: int = 0) -> "Block":
        """A standalone empty block with one reference owned by the result."""
        agent = _index("agent", agent, maximum=_U32)
        out = ffi.new("kvh_block *")
        block = None
        try:
            with self._call() as p:
                check(lib.kvh_block_alloc(p, agent, out))
        finally:
            if out.id:  # owned even when a Ctrl-C is raised as the call returns
                block = Block(self, int(out.id), owned=True)
        return block

    def prefix_hash(self, tokens: ArrayLike, parent: int = 0, *, scope: int = 0) -> int:
        """Chained hash of one full block of tokens (n == block_tokens) in
        ``scope`` (a plain scope value; 0, the default scope, is
        ``kvh_prefix_hash``)."""
        tk = _tokens(tokens)
        if tk.size != self.block_tokens:  # as the library says it (KVH_ERR_INVALID_ARG)
            raise errors.InvalidArgumentError(
                f"a block hash covers block_tokens={self.block_tokens} tokens, got {tk.size}",
                lib.KVH_ERR_INVALID_ARG,
                status_name(lib.KVH_ERR_INVALID_ARG),
            )
        parent = _index("parent", parent)
        scope = _index("scope", scope)
        out = ffi.new("uint64_t *")
        with self._call() as p:
            if scope:
                check(lib.kvh_prefix_hash_scoped(p, scope, parent, _iptr(tk), tk.size, out))
            else:
                check(lib.kvh_prefix_hash(p, parent, _iptr(tk), tk.size, out))
        return int(out[0])

    def prefix_lookup(self, tokens: ArrayLike, *, scope: Union[Scope, int, None] = None) -> List["Block"]:
        """Blocks of the longest cached prefix of tokens in ``scope`` (an int
        or a :class:`kvh.Scope`; default: the default scope), each retained
        for the caller (released when the Block is released or collected)."""
        tk = _tokens(tokens)
        sc = Scope.of(scope)
        cap = tk.size // self.block_tokens
        out = ffi.new("kvh_block[]", max(1, cap))
        nb = ffi.new("size_t *")
        blocks: List[Block] = []
        try:
            with self._call() as p:
                check(
                    lib.kvh_prefix_lookup_scoped(
                        p, sc.scope, sc.shared_scope, sc.shared_tokens, _iptr(tk), tk.size, out, cap, nb
                    )
                )
        finally:
            # The references it took are owned even when a Ctrl-C is
            # raised as the call returns (nb stays 0 when it failed).
            blocks = [Block(self, int(out[i].id), owned=True) for i in range(int(nb[0]))]
        return blocks

    def block_table(self, seqs: Seq["Sequence"]) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """FlashInfer-style CSR block table of device-tier slots:
        ``(indptr[n+1], indices[nnz], last_page_len[n])`` as int32 arrays.
        Raises NotResidentError if a block is not in the device tier; only
        acquired blocks are held there (acquire the range first)."""
        if not isinstance(seqs, Sequence):
            seqs = list(seqs)  # read twice below
        hs, uses = self._seq_array(seqs)
        n = len(uses)
        with self._call(*uses) as p:
            cap = sum((s.num_blocks for s in seqs), 0)
            indptr = np.zeros(n + 1, np.int32)
            indices = np.zeros(max(cap, 1), np.int32)
            last = np.zeros(max(n, 1), np.int32)
            check(lib.kvh_block_table(p, hs, n, _iptr(indptr), _iptr(indices), cap, _iptr(last)))
        return indptr, indices[: int(indptr[-1])].copy(), last[:n].copy()

    def _seq_array(self, seqs: Seq["Sequence"]) -> Tuple[Any, List[GateUse]]:
        """The ``kvh_seq[]`` of a batch and the gate uses of a ``@threads
        any`` call naming it."""
        if isinstance(seqs, Sequence):
            raise TypeError("seqs must be a list of kvh.Sequence objects (wrap a single one in a list)")
        seqs = list(seqs)
        arr = ffi.new("kvh_seq[]", max(1, len(seqs)))
        for i, s in enumerate(seqs):
            if not isinstance(s, Sequence):
                raise TypeError(f"seqs[{i}] must be a kvh.Sequence, not {type(s).__name__}")
            s._check_engine(self)
            s._check_alive()
            arr[i].id = s._h.id
        return arr, [s._gate.shared() for s in seqs]

    # ---- paged attention ----
    def _attention_arrays(self, what: str, q: Any, rows: int, out: Any, io_dtype: Union[DType, str, None]):
        H, D = self.num_kv_heads, self.head_dim
        cuda = hasattr(q, "__cuda_array_interface__")
        if cuda:
            if self._backend != "cuda":
                raise TypeError(f"{what}: q is CUDA memory but the engine uses the {self._backend} backend")
            iface = q.__cuda_array_interface__
            shape, typestr = tuple(iface["shape"]), iface["typestr"]
            if iface.get("strides") not in (None,):
                raise ValueError(f"{what}: q must be C-contiguous, shaped ({rows}, num_q_heads, {D})")
            npd = np.dtype(typestr)
        else:
            if self._backend == "cuda":
                raise TypeError(
                    f"{what}: the cuda backend needs q and out in device memory "
                    "(objects with __cuda_array_interface__), not NumPy arrays"
                )
            if not isinstance(q, np.ndarray):
                raise TypeError(
                    f"{what}: q must be a numpy.ndarray shaped ({rows}, num_q_heads, {D}), not {type(q).__name__}"
                )
            shape, npd = q.shape, q.dtype
        if io_dtype is None:
            if npd == np.float32:
                io = DType.F32
            elif npd == np.float16:
                io = DType.F16
            else:
                raise TypeError(
                    f"{what}: q has dtype {npd}; expected float32 or float16 (bf16: uint16 bits with io_dtype='bf16')"
                )
        else:
            io = DType.parse(io_dtype)
            if npd != numpy_dtype(io):
                raise TypeError(f"{what}: q has dtype {npd}, expected {numpy_dtype(io)} for io_dtype={io.short}")
        if len(shape) != 3 or shape[0] != rows or shape[2] != D or shape[1] == 0 or shape[1] % H:
            raise ValueError(
                f"{what}: q has shape {tuple(shape)}, expected ({rows}, num_q_heads, {D}) "
                f"with num_q_heads a multiple of num_kv_heads={H}"
            )
        if not cuda and not q.flags.c_contiguous:
            raise ValueError(f"{what}: q must be C-contiguous, shaped ({rows}, {shape[1]}, {D})")
        if out is None:
            if cuda:
                raise TypeError(f"{what}: pass out= (device memory) on the cuda backend")
            out = np.empty(shape, npd)
        elif cuda:
            oi = getattr(out, "__cuda_array_interface__", None)
            if oi is None or tuple(oi["shape"]) != tuple(shape) or np.dtype(oi["typestr"]) != npd:
                raise ValueError(f"{what}: out must be CUDA memory of dtype {npd} shaped {tuple(shape)}")
        else:
            if not isinstance(out, np.ndarray):
                raise TypeError(f"{what}: out must be a numpy.ndarray shaped {tuple(shape)}")
            if out.dtype != npd or out.shape != tuple(shape):
                raise ValueError(
                    f"{what}: out has dtype {out.dtype} shape {out.shape}, expected {npd} shaped {tuple(shape)}"
                )
            if not out.flags.c_contiguous or not out.flags.writeable:
                raise ValueError(f"{what}: out must be C-contiguous and writeable, shaped {tuple(shape)}")
        if cuda:
            qp = ffi.cast("void *", q.__cuda_array_interface__["data"][0])
            op = ffi.cast("void *", out.__cuda_array_interface__["data"][0])
        else:
            qp, op = _ptr(q), _ptr(out)
        return qp, op, out, int(shape[1]), io

    def _attention_params(
        self,
        num_q_heads: int,
        scale: float,
        io: DType,
        threads: int,
        stream: Any,
        stream_blocks: Tuple[int, int] = (0, 0),
    ):
        prm = ffi.new("kvh_attention_params *")
        with self._call():
            check(lib.kvh_attention_params_init(prm, ffi.sizeof("kvh_attention_params")))
        prm.num_q_heads = num_q_heads
        prm.scale = _c_float("scale", scale)
        prm.io_dtype = int(io)
        prm.threads = _index("threads", threads, maximum=_U32)
        prm.stream_chunk_blocks = _index("stream_chunk_blocks", stream_blocks[0], maximum=_U32)
        prm.stream_window_blocks = _index("stream_window_blocks", stream_blocks[1], maximum=_U32)
        if stream is not None:
            handle = stream if isinstance(stream, int) else getattr(stream, "cuda_stream", None)
            if handle is None:
                handle = getattr(stream, "handle", None)
            if not isinstance(handle, int) or isinstance(handle, bool):
                raise TypeError("stream must be an int (cudaStream_t) or have .cuda_stream / .handle")
            # a pointer: not negative, not past 64 bits (cast, either wrapped)
            prm.stream = ffi.cast("void *", _index("stream", handle))
        return prm

    def attention_decode(
        self,
        layer: int,
        seqs: Seq["Sequence"],
        q: Any,
        *,
        out: Any = None,
        scale: float = 0.0,
        io_dtype: Union[DType, str, None] = None,
        threads: int = 0,
        stream: Any = None,
        stream_chunk_blocks: int = 0,
        stream_window_blocks: int = 0,
    ) -> Any:
        """One decode step of paged attention for a batch (one layer).

        ``q`` is shaped ``(len(seqs), num_q_heads, head_dim)`` (float32 or
        float16; bf16 as uint16 with ``io_dtype="bf16"``); every sequence's
        blocks must be acquired (device tier), unless ``stream_chunk_blocks``
        is set (CPU backend): blocks elsewhere are then read that many at a
        time through a window of ``stream_window_blocks`` device-tier slots
        and stay where they are. Returns ``out`` (allocated when not given).
        On the CUDA backend q/out are device arrays
        (``__cuda_array_interface__``) and ``stream`` a cudaStream_t."""
        layer = _index("layer", layer, maximum=_U32)
        hs, uses = self._seq_array(seqs)
        n = len(uses)  # seqs may have been an iterator, now used up
        qp, op, out, hq, io = self._attention_arrays("attention_decode", q, n, out, io_dtype)
        prm = self._attention_params(hq, scale, io, threads, stream, (stream_chunk_blocks, stream_window_blocks))
        with self._call(*uses) as p:
            check(lib.kvh_attention_decode(p, layer, hs, n, qp, op, prm))
        return out

    def attention_prefill(
        self,
        layer: int,
        seqs: Seq["Sequence"],
        q_lens: Seq[int],
        q: Any,
        *,
        out: Any = None,
        scale: float = 0.0,
        io_dtype: Union[DType, str, None] = None,
        threads: int = 0,
        stream: Any = None,
        stream_chunk_blocks: int = 0,
        stream_window_blocks: int = 0,
    ) -> Any:
        """Chunked causal prefill: sequence i's last ``q_lens[i]`` tokens
        attend causally; q is shaped ``(sum(q_lens), num_q_heads, head_dim)``.
        Streaming as for :meth:`attention_decode`."""
        layer = _index("layer", layer, maximum=_U32)
        hs, uses = self._seq_array(seqs)
        n = len(uses)  # seqs may have been an iterator, now used up
        lens = _q_lens(q_lens, n, "sequence")
        ql = ffi.new("uint32_t[]", lens or [0])
        qp, op, out, hq, io = self._attention_arrays("attention_prefill", q, sum(lens), out, io_dtype)
        prm = self._attention_params(hq, scale, io, threads, stream, (stream_chunk_blocks, stream_window_blocks))
        with self._call(*uses) as p:
            check(lib.kvh_attention_prefill(p, layer, hs, ql, n, qp, op, prm))
        return out

    def attention_plan(
        self,
        layer: int,
        seqs: Seq["Sequence"],
        q_lens: Optional[Seq[int]] = None,
        *,
        num_q_heads: Optional[int] = None,
        io_dtype: Union[DType, str, None] = None,
        scale: float = 0.0,
        threads: int = 0,
    ) -> Any:
        """Plans decode (``q_lens`` None) or chunked prefill of a batch once
        (:class:`kvh.AttentionPlan`); ``plan.run(q)`` then only launches the
        kernels (capturable into a CUDA graph on the cuda backend). Holds the
        batch's blocks in the device tier until ``plan.destroy()``."""
        from .attention_plan import AttentionPlan

        seqs = list(seqs)
        # The library reads one entry per sequence: a shorter list was read
        # past its end (a plan of garbage row counts, or q and out arrays
        # sized for other rows than the kernels use).
        lens = None if q_lens is None else _q_lens(q_lens, len(seqs), "sequence")
        hq = self.num_kv_heads if num_q_heads is None else _index("num_q_heads", num_q_heads, maximum=_U32)
        hq = hq or self.num_kv_heads  # 0 is the library's default, as in attention_decode
        io = DType.F32 if io_dtype is None else DType.parse(io_dtype)
        return AttentionPlan(self, _index("layer", layer, maximum=_U32), seqs, lens, hq, io, scale, threads)

    def attention_decode_vmap(
        self, views: Seq[Any], q: Any, *, out: Any = None, scale: float = 0.0, threads: int = 0
    ) -> Any:
        """Decode attention over virtually contiguous views (:class:`kvh.VMap`,
        from :meth:`Sequence.vmap`): q is ``(len(views), num_q_heads,
        head_dim)``. Equals :meth:`attention_decode` bit for bit; a stale view
        raises :class:`kvh.BadHandleError` (refresh it)."""
        from .vmap import attention_decode_vmap

        return attention_decode_vmap(self, views, q, out=out, scale=scale, threads=threads)

    def attention_prefill_vmap(
        self, views: Seq[Any], q_lens: Seq[int], q: Any, *, out: Any = None, scale: float = 0.0, threads: int = 0
    ) -> Any:
        """Chunked causal prefill over views: view i's last ``q_lens[i]``
        tokens attend; equals :meth:`attention_prefill` bit for bit."""
        from .vmap import attention_prefill_vmap

        return attention_prefill_vmap(self, views, q_lens, q, out=out, scale=scale, threads=threads)


# ---------------------------------------------------------------------------------
# Fence: a future-like completion of asynchronous work
# ---------------------------------------------------------------------------------
class Fence(GatedHandle, OwnedHandle):
    """Completion of asynchronous work (prefetch, migrate, acquire with
    ``wait=False``), shaped like ``concurrent.futures.Future``: ``done()``,
    ``result(timeout)``, ``exception(timeout)``, ``wait(timeout)``,
    ``add_done_callback(fn)``; ``await fence`` works in asyncio. The C fence
    is freed as soon as completion is observed, or on ``close()``/GC (which
    waits for a wait in flight on another thread)."""

    def __init__(self, engine: Engine, fp) -> None:
        self._gate = HandleGate(lambda: errors.BadHandleError("the fence was freed", lib.KVH_ERR_BAD_HANDLE))
        self._engine = engine
        self._fp = fp
        self._lock = ForkSafeLock()
        self._outcome: Optional[Tuple[int, str]] = None  # (status, detail) once done
        self._callbacks: List[Callable[["Fence"], Any]] = []

    @property
    def handle(self) -> int:
        return int(self._fp.id)

    def _finish(self, st: int, detail: str) -> None:
        with self._lock:
            if self._outcome is None:
                self._outcome = (st, detail)
            cbs, self._callbacks = self._callbacks, []
        self._free()
        for cb in cbs:
            try:
                cb(self)
            except Exception:
                log.exception("kvh: exception in a Fence done callback")

    def _free(self) -> None:
        self._gate.close(self._free_native)

    def _free_native(self) -> None:
        try:
            with self._engine._call() as p:
                lib.kvh_fence_free(p, self._fp[0])
        except errors.ClosedError:
            pass

    def done(self) -> bool:
        """True once the work completed (successfully or not)."""
        if self._outcome is not None:
            return True
        d = ffi.new("int32_t *")
        with self._call_any() as p:
            st = lib.kvh_fence_poll(p, self._fp[0], d)
            detail = last_error() if st else ""
        if st != 0 and not d[0]:
            raise_status(st, detail)
        if d[0]:
            self._finish(st, detail)
            return True
        return False

    def _wait(self, timeout: Optional[float]) -> bool:
        ns = _timeout_ns("timeout", timeout)  # checked whether or not the fence is done
        if self._outcome is not None:
            return True
        return _interruptible(ns, self._wait_ns)

    def _wait_ns(self, ns: int) -> bool:
        if self._outcome is not None:
            return True
        try:
            with self._call_any() as p:
                if self._outcome is not None:
                    return True
                st = lib.kvh_fence_wait(p, self._fp[0], ns)
                detail = last_error() if st else ""
        except errors.BadHandleError as exc:  # freed before its completion was seen
            st, detail = exc.status, exc.message
        if st == lib.KVH_ERR_TIMEOUT and ns != U64_MAX:
            # Either our deadline or the work's own timeout: poll to tell.
            try:
                return self.done()
            except errors.KvhTimeoutError:
                return False
            except errors.BadHandleError as exc:  # freed by another thread meanwhile
                st, detail = exc.status, exc.message
        if st == lib.KVH_ERR_BAD_HANDLE and self._outcome is not None:
            return True  # completed and freed by another thread meanwhile
        self._finish(st, detail)
        return True

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Waits up to ``timeout`` seconds (None: no limit). True when done."""
        return self._wait(timeout)

    def exception(self, timeout: Optional[float] = None) -> Optional[errors.Error]:
        if not self._wait(timeout):
            raise errors.KvhTimeoutError(f"fence not complete after {timeout} s", lib.KVH_ERR_TIMEOUT)
        st, detail = self._outcome  # type: ignore[misc]
        if st == 0:
            return None
        return errors.error_class(st)(detail or status_name(st), st, status_name(st))

    def result(self, timeout: Optional[float] = None) -> None:
        """Waits; returns None on success, raises the work's kvh.Error, or
        kvh.KvhTimeoutError (a builtin TimeoutError) when timeout passes."""
        exc = self.exception(timeout)
        if exc is not None:
            raise exc

    def add_done_callback(self, fn: Callable[["Fence"], Any]) -> None:
        """Calls ``fn(fence)`` once done (from a helper thread, or now)."""
        if not callable(fn):
            # found now, not logged from a helper thread once the fence ends
            raise TypeError(f"fn must be callable, not {type(fn).__name__}")
        with self._lock:
            if self._outcome is None:
                self._callbacks.append(fn)
                start = len(self._callbacks) == 1
            else:
                start = None
        if start is None:
            fn(self)
        elif start:
            threading.Thread(target=self._wait_quietly, name="kvh-fence-callback", daemon=True).start()

    def _wait_quietly(self) -> None:
        try:
            self._wait(None)
        except errors.Error as exc:
            self._finish(exc.status, exc.message)

    def __await__(self):
        return self._awaited().__await__()

    async def _awaited(self) -> None:
        # The wait runs on an executor thread in slices, so that an await
        # given up (a cancelled task, asyncio.wait_for's timeout) frees
        # its thread within one slice instead of when the work ends.
        given_up = threading.Event()

        def wait_in_slices() -> None:
            while not given_up.is_set():
                if self._wait_ns(_AWAIT_SLICE_NS):
                    return

        try:
            await asyncio.get_running_loop().run_in_executor(None, wait_in_slices)
        except BaseException:
            given_up.set()
            raise
        self.result(0)

    def close(self) -> None:
        """Frees the C fence (pending work continues)."""
        self._free()

    def _close_at_gc(self) -> None:
        if not self._gate.closed and not self._engine.closed:
            _end_at_gc(self, self._free)

    def __repr__(self) -> str:
        state = (
            "pending" if self._outcome is None else ("ok" if self._outcome[0] == 0 else status_name(self._outcome[0]))
        )
        return f"<kvh.Fence {state}>"


# ---------------------------------------------------------------------------------
# Block
# ---------------------------------------------------------------------------------
def _end_at_gc(obj: Any, end: Callable[[], Any], native: Optional["_Native"] = None) -> None:
    """A collected handle's ``end()``; one the library refuses (a collection
    inside the engine's log sink on a kvh thread) waits for a call that may
    make it, instead of leaking the native object."""
    try:
        end()
    except errors.BusyError:
        (native or obj._engine._native).defer(end)


class Block(GatedHandle, OwnedHandle):
    """A block handle. ``owned`` blocks (from ``Engine.prefix_lookup``,
    ``Engine.block_alloc``, ``Block.retain``) hold one reference, dropped by
    ``release()``, the context manager, or GC; the object is unusable after
    that (BadHandleError). Blocks from ``Sequence.blocks()`` are borrowed
    (the sequence keeps them)."""

    def __init__(self, engine: Engine, handle: int, owned: bool) -> None:
        self._gate = HandleGate(
            lambda: errors.BadHandleError(f"block 0x{handle:x} was released", lib.KVH_ERR_BAD_HANDLE)
        )
        self._engine = engine
        self._id = handle
        self._owned = owned

    @property
    def handle(self) -> int:
        return self._id

    @property
    def owned(self) -> bool:
        return self._owned and not self._gate.closed

    def _check_engine(self, engine: Engine) -> None:
        if self._engine is not engine:
            raise errors.ForeignHandleError.of("block")

    def _h(self):
        h = ffi.new("kvh_block *")
        h.id = self._id
        return h[0]

    def info(self) -> BlockInfo:
        info = ffi.new("kvh_block_info *")
        info.struct_size = ffi.sizeof("kvh_block_info")
        with self._call_any() as p:
            check(lib.kvh_block_info_get(p, self._h(), info))
        tier_v = int(info.tier)
        return BlockInfo(
            tier=Tier(tier_v) if tier_v in (0, 1, 2) else tier_v,  # type: ignore[arg-type]
            slot=int(info.slot),
            refs=int(info.refs),
            pins=int(info.pins),
            holds=int(info.holds),
            tokens=int(info.tokens),
            agent=int(info.agent),
            published=bool(info.published),
            in_flight=bool(info.in_flight),
            hash=int(info.hash),
            tolerance=int(info.tolerance),
        )

    def pin(self, pinned: bool = True) -> None:
        """Pins (or unpins) the block in its current tier. A block pinned on
        disk that a call must read or change in memory (``read_kv``,
        ``write_kv``, a copy on write) is still brought up, its pins with it."""
        with self._call_any() as p:
            check(lib.kvh_block_pin(p, self._h(), _flag("pinned", pinned)))

    def unpin(self) -> None:
        self.pin(False)

    def set_tolerance(self, tolerance: int) -> None:
        """Compression tolerance 0 (intolerant) .. 255 for LCTRU eviction."""
        tolerance = _index("tolerance", tolerance, maximum=_U32)
        with self._call_any() as p:
            check(lib.kvh_block_set_tolerance(p, self._h(), tolerance))

    def retain(self) -> "Block":
        """A new owned reference to the same block."""
        with self._call_any() as p:
            check(lib.kvh_block_retain(p, self._h()))
        return Block(self._engine, self._id, owned=True)

    def release(self) -> None:
        """Drops this object's reference (owned blocks only). Idempotent;
        a no-op once the engine is closed."""
        if self._owned:
            self._engine._native.refuse_in_own_sink()
            self._gate.close(self._release_native)

    def _release_native(self) -> None:
        try:
            with self._engine._call() as p:
                check(lib.kvh_block_release(p, self._h()))
        except errors.ClosedError:
            pass  # the engine's close dropped every reference

    def _unpin_and_release(self) -> None:
        """Unpins the block and drops this object's reference in one native
        call (a view's kept block): a Ctrl-C raised between two calls left
        the pin, and the slot, for good."""
        if self._owned:
            self._engine._native.refuse_in_own_sink()
            self._gate.close(self._unpin_and_release_native)

    def _unpin_and_release_native(self) -> None:
        status = ffi.new("kvh_status *", -1)
        try:
            with self._engine._call() as p:
                lib.kvhpy_block_let_go(p, self._h(), status)
        except errors.ClosedError:
            return  # the engine's close dropped every pin and reference
        check(status[0])

    def close(self) -> None:
        """``release()`` unless the engine is closed (which dropped every
        reference already)."""
        if not self._engine.closed:
            self.release()

    def _close_at_gc(self) -> None:
        _end_at_gc(self, self.close)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Block) and other._engine is self._engine and other._id == self._id

    def __hash__(self) -> int:
        return hash((id(self._engine), self._id))

    def __repr__(self) -> str:
        return f"<kvh.Block 0x{self._id:x}{' owned' if self.owned else ''}>"


# ---------------------------------------------------------------------------------
# Hold: an acquired range
# ---------------------------------------------------------------------------------
class Hold(OwnedHandle):
    """Tokens ``[first, first + n)`` of a sequence held resident in the
    device tier (``Sequence.acquire``). Released by ``release()``, the
    context manager, or GC. With ``wait=False`` the data is resident once
    ``fence`` completes (``hold.wait()``)."""

    def __init__(self, seq: "Sequence", first: int, n: int, fence: Optional[Fence]) -> None:
        # The hold names no handle of its own; its gate makes the release happen once.
        self._gate = HandleGate(lambda: errors.BadHandleError("the hold was released", lib.KVH_ERR_BAD_HANDLE))
        self._seq = seq
        self.first = first
        self.n = n
        self.fence = fence
        seq._holds.add(self)

    def _truncated(self, n_tokens: int) -> None:
        """The sequence was cut to n_tokens, which ended the library's holds
        on the blocks it gave up and kept those on the others. The library
        names a hold by its range: releasing the old one later would end
        another hold taken on that range after the cut."""
        if self.released or self.first + self.n <= n_tokens:
            return
        if self.first < n_tokens:
            self.n = n_tokens - self.first  # the kept blocks' part
        else:
            self._gate.close(lambda: None)  # nothing of it is left to release

    @property
    def range(self) -> range:
        return range(self.first, self.first + self.n)

    @property
    def released(self) -> bool:
        return self._gate.closed

    def wait(self, timeout: Optional[float] = None) -> None:
        """Waits until the held blocks are resident (no-op for wait=True holds)."""
        if self.fence is not None:
            self.fence.result(timeout)

    def covers_block(self, block_index: int) -> bool:
        """Whether the held tokens include any of block ``block_index``."""
        block_index = _index("block_index", block_index)
        bt = self._seq._engine.block_tokens
        if self.released or self.n == 0:
            return False
        return self.first // bt <= block_index <= (self.first + self.n - 1) // bt

    def release(self) -> None:
        """Ends the hold. Idempotent; a no-op once the sequence or engine is gone."""
        self._gate.close(self._release_native)

    def _release_native(self) -> None:
        seq = self._seq
        if seq.freed or seq.engine.closed:
            return
        try:
            if self.fence is not None:
                # The library ends a hold whose promotion is still on its
                # way: a release (or a collection) does not wait for it.
                self.fence.close()
            with seq._call() as p:
                check(lib.kvh_seq_release(p, seq._h[0], self.first, self.n))
        except (errors.ClosedError, errors.BadHandleError):
            pass  # the sequence or the engine is gone, and its holds with it

    close = release

    def _close_at_gc(self) -> None:
        _end_at_gc(self, self.release, self._seq._engine._native)

    def __repr__(self) -> str:
        return f"<kvh.Hold tokens [{self.first}, {self.first + self.n}){' released' if self.released else ''}>"


class _ViewOwner(Finalized, Uncopyable):
    """Base object of a zero-copy block view: exposes the memory through
    ``__array_interface__`` and keeps the hold (and the engine's memory)
    alive for as long as any array derived from it exists."""

    def __init__(
        self,
        engine: Engine,
        hold: Hold,
        private_hold: bool,
        addr: int,
        shape: Tuple[int, ...],
        dtype: np.dtype,
        readonly: bool,
    ) -> None:
        self.engine = engine
        self.hold = hold
        self.private_hold = private_hold
        self.__array_interface__ = {
            "version": 3,
            "shape": shape,
            "typestr": dtype.str,
            "data": (addr, readonly),
            "strides": None,
        }
        self.block: Optional[Block] = None  # the mapped block (borrowed)
        self.layer = 0  # the layer it maps
        self.kept: Optional[Block] = None  # a reference and pin once its sequence let it go
        self._native: Optional[_Native] = None
        engine._native.add_view(self)  # type: ignore[union-attr]
        self._native = engine._native  # counted: the collection drops it

    def make_read_only(self) -> None:
        """Arrays made from the owner from now on are read-only (arrays made
        before keep their flags: see Sequence._detach_views)."""
        iface = dict(self.__array_interface__)
        iface["data"] = (iface["data"][0], True)
        self.__array_interface__ = iface

    def let_block_go(self) -> None:
        """Undoes keep_block. The block stays kept when the library refuses
        (BusyError), so a later call can still give it back."""
        if self.kept is not None:
            self.kept._unpin_and_release()
            self.kept = None

    def keep_block(self) -> None:
        """Takes a reference and a pin on the mapped block before its
        sequence releases it (truncate, free): its slot is then neither
        reused nor moved while the view can read it. One native call takes
        both, and what it took is owned even when a Ctrl-C is raised as it
        returns."""
        if self.kept is not None or self.block is None:
            return
        block = self.block
        retained = ffi.new("int *", 0)
        status = ffi.new("kvh_status *", -1)
        taken = None
        try:
            with block._call_any() as p:
                lib.kvhpy_block_keep(p, block._h(), retained, status)
        finally:
            if retained[0]:
                taken = Block(block._engine, block._id, owned=True)
                if status[0] == lib.KVH_OK:
                    self.kept = taken
        if status[0] == lib.KVH_ERR_BAD_HANDLE and not retained[0]:
            return  # already gone (copied on write, then freed elsewhere)
        try:
            check(status[0])
        finally:
            if taken is not None and self.kept is not taken:
                taken.release()  # the pin failed: the reference goes too

    def _let_go(self) -> None:
        """Ends the view's own hold and the block it kept, then lets the
        engine's memory go."""
        try:
            if self.private_hold:
                self.hold.release()
            if self.kept is not None and not self.engine.closed:
                self.kept._unpin_and_release()
                self.kept = None
        except errors.BusyError:
            raise  # refused here (the engine's log sink): retried later, memory kept meanwhile
        except BaseException:
            self._drop_view()
            raise
        self._drop_view()

    def _drop_view(self) -> None:
        native, self._native = self._native, None
        if native is not None:
            native.drop_view(self)

    def _close_at_gc(self) -> None:
        _end_at_gc(self, self._let_go, self._native)


# ---------------------------------------------------------------------------------
# Sequence
# ---------------------------------------------------------------------------------
class Sequence(GatedHandle, OwnedHandle):
    """A logical token stream with its block table (``kvh_seq``). Create with
    :meth:`Engine.sequence`; free with ``free()``, a ``with`` block, or GC.

    Calls from several threads on one sequence run one at a time (the C
    rule for a sequence handle); ``free()`` waits for the call in flight and
    later calls raise BadHandleError."""

    def __init__(self, engine: Engine, h, agent: int) -> None:
        self._gate = HandleGate(
            lambda: errors.BadHandleError(f"sequence 0x{int(h.id):x} was freed", lib.KVH_ERR_BAD_HANDLE)
        )
        self._engine = engine
        self._h = h
        self._agent = agent
        self._views: List[Tuple["weakref.ref[np.ndarray]", int]] = []
        # every block view's owner (alive while any array derived from it
        # is), with its block index: see _keep_viewed_blocks
        self._view_owners: List[Tuple["weakref.ref[_ViewOwner]", int]] = []
        # the live holds on it (a truncation changes what they name)
        self._holds = WeakBag()

    # ---- lifetime ----
    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def agent(self) -> int:
        return self._agent

    @property
    def handle(self) -> int:
        return int(self._h.id)

    @property
    def freed(self) -> bool:
        return self._gate.closed

    def _check_alive(self) -> None:
        if self._gate.closed:
            raise errors.BadHandleError(f"sequence 0x{int(self._h.id):x} was freed", lib.KVH_ERR_BAD_HANDLE)

    def _check_engine(self, engine: Engine) -> None:
        if self._engine is not engine:
            raise errors.ForeignHandleError.of("sequence")

    def free(self) -> None:
        """Releases the sequence's blocks (cached full blocks stay in the
        prefix index) once calls in flight on other threads are done.
        Idempotent; a no-op once the engine is closed. Blocks that block
        views still map stay, unchanged, until the views are collected."""
        self._engine._native.refuse_in_own_sink()
        self._gate.close(self._free_native)

    def _keep_viewed_blocks(self, first_block: int) -> None:
        """Before the sequence gives up blocks first_block on: each live
        block view of them keeps its block (a reference and a pin), so the
        slot it reads is not reused for other data or moved."""
        live = []
        for ref, index in self._view_owners:
            owner = ref()
            if owner is None:
                continue
            if index >= first_block:
                owner.keep_block()
            live.append((ref, index))
        self._view_owners = live

    def _free_native(self) -> None:
        try:
            with self._engine._call() as p:
                self._keep_viewed_blocks(0)
                check(lib.kvh_seq_free(p, self._h[0]))
        except errors.ClosedError:
            pass  # the engine's close freed it

    close = free

    def _check_usable(self) -> None:
        """``with seq:`` on a freed sequence raises BadHandleError, and on
        one whose engine is closed ClosedError (as every call in it would)."""
        self._check_alive()
        if self._engine.closed:
            raise errors.ClosedError("the engine is closed", lib.KVH_ERR_CLOSED)

    def _close_at_gc(self) -> None:
        _end_at_gc(self, self.free)

    def vmap(self, layer: int, capacity_tokens: int = 0) -> Any:
        """A virtually contiguous view of one layer's K and V
        (:class:`kvh.VMap`); needs ``Config(vmap=1)`` and every block in the
        device tier (acquire first)."""
        from .vmap import VMap

        return VMap(self, _index("layer", layer, maximum=_U32), _index("capacity_tokens", capacity_tokens))

    def __repr__(self) -> str:
        if self.freed:
            return f"<kvh.Sequence 0x{int(self._h.id):x} freed>"
        if self._engine.closed:
            return f"<kvh.Sequence 0x{int(self._h.id):x} (engine closed)>"
        try:
            return f"<kvh.Sequence 0x{int(self._h.id):x} agent={self._agent} tokens={len(self)}>"
        except errors.Error:
            return f"<kvh.Sequence 0x{int(self._h.id):x}>"

    # ---- helpers ----
    def _length(self, p) -> int:
        n = ffi.new("uint64_t *")
        check(lib.kvh_seq_length(p, self._h[0], n))
        return int(n[0])

    def _span(self, p, first: TokenSpan, n: Optional[int]) -> Tuple[int, int]:
        """(first, n) from a range, (first, n) ints, or None = everything."""
        if isinstance(first, range):
            if n is not None:
                raise TypeError("pass either a range or first and n, not both")
            if first.step != 1:
                raise ValueError(f"token range must have step 1, got {first!r}")
            if first.start < 0 or first.stop < first.start:
                raise ValueError(f"token range must be non-negative and non-empty-reversed, got {first!r}")
            # Not len(): a range longer than sys.maxsize has none.
            return _index("first", first.start), _index("n", first.stop - first.start)
        f = 0 if first is None else _index("first", first)
        if n is None:
            length = self._length(p)
            return f, max(0, length - f) if f <= length else 1
        return f, _index("n", n)

    def _span_to_read(self, p, first: TokenSpan, n: Optional[int]) -> Tuple[int, int]:
        """_span of tokens to be copied out: a range past the end is refused
        before an array of its size is made (2**40 tokens would not fit), as
        the library refuses it."""
        f, cnt = self._span(p, first, n)
        length = self._length(p)
        if cnt and f + cnt > length:
            raise errors.RangeError(f"tokens [{f}, {f + cnt}) pass the sequence's {length} tokens", lib.KVH_ERR_RANGE)
        return f, cnt

    def _kv_check(self, name: str, a: Any, n: Optional[int] = None, out: bool = False) -> np.ndarray:
        eng = self._engine
        H, D, dt = eng.num_kv_heads, eng.head_dim, eng.np_dtype
        expected = f"({'n' if n is None else n}, {H}, {D})"
        note = " (bf16 K/V are uint16 bit patterns)" if eng.dtype == DType.BF16 else ""
        if not isinstance(a, np.ndarray):
            raise TypeError(
                f"{name} must be a numpy.ndarray of dtype {dt} shaped {expected}{note}, not {type(a).__name__}"
            )
        if isinstance(a, np.ma.MaskedArray):
            # Its mask would be ignored: masked entries written (or read
            # into) as whatever bytes lie under them.
            raise TypeError(f"{name} is a numpy.ma.MaskedArray, whose mask kvh cannot honour: pass {name}.filled(...)")
        a = a.view(np.ndarray)  # its own shape, as numpy has it
        if a.dtype != dt:
            raise TypeError(f"{name} has dtype {a.dtype}, expected {dt} shaped {expected}{note}")
        if a.ndim != 3 or a.shape[1:] != (H, D) or (n is not None and a.shape[0] != n):
            raise ValueError(f"{name} has shape {a.shape}, expected {expected} (tokens, num_kv_heads, head_dim)")
        if not a.flags.c_contiguous:
            raise ValueError(
                f"{name} must be C-contiguous with shape {expected} (got strides {a.strides}; "
                "use numpy.ascontiguousarray)"
            )
        if out and not a.flags.writeable:
            raise ValueError(f"{name} must be writeable")
        return a

    # ---- tokens ----
    def __len__(self) -> int:
        return self.length

    @property
    def length(self) -> int:
        """Length in tokens."""
        with self._call_any() as p:
            return self._length(p)

    @property
    def num_blocks(self) -> int:
        bt = self._engine.block_tokens
        return (self.length + bt - 1) // bt

    def tokens(self, first: TokenSpan = None, n: Optional[int] = None) -> np.ndarray:
        """Token ids (int32) of a range (default: all)."""
        with self._call() as p:
            f, cnt = self._span_to_read(p, first, n)
            out = np.empty(cnt, np.int32)
            check(lib.kvh_seq_tokens(p, self._h[0], f, cnt, _iptr(out)))
        return out

    def append(self, tokens: ArrayLike) -> None:
        """Appends token ids (allocating blocks; NoSpaceError leaves the
        sequence unchanged)."""
        tk = _tokens(tokens)
        with self._call() as p:
            check(lib.kvh_seq_append(p, self._h[0], _iptr(tk), tk.size))
            self._refresh_views()

    def truncate(self, n_tokens: int) -> None:
        n_tokens = _index("n_tokens", n_tokens)
        with self._call() as p:
            # the block holding the cut may be copied; the ones after it go
            self._keep_viewed_blocks(n_tokens // self._engine.block_tokens)
            detail = ""
            try:
                st = lib.kvh_seq_truncate(p, self._h[0], n_tokens)
                detail = last_error() if st else ""  # before the length call replaces it
            finally:
                # The holds follow the cut the library made, even when a
                # Ctrl-C comes right after the call (its status then unread).
                now = ffi.new("uint64_t *")
                if lib.kvh_seq_length(p, self._h[0], now) == 0 and now[0] <= n_tokens:
                    for hold in self._holds.live():
                        hold._truncated(n_tokens)
            if st:
                raise_status(st, detail)
            self._refresh_views()

    def match_prefix(self, tokens: ArrayLike) -> int:
        """For an empty sequence: attaches the longest cached prefix of
        tokens and returns how many tokens matched (a multiple of
        block_tokens). Append ``tokens[matched:]`` yourself."""
        tk = _tokens(tokens)
        m = ffi.new("size_t *")
        with self._call() as p:
            check(lib.kvh_seq_match_prefix(p, self._h[0], _iptr(tk), tk.size, m))
        return int(m[0])

    def set_scope(
        self, scope: Union[Scope, int, None] = None, *, shared_scope: int = 0, shared_tokens: int = 0
    ) -> None:
        """Sets the tenant scope of an empty sequence (``scope`` an int, with
        ``shared_scope`` and ``shared_tokens``, or a :class:`kvh.Scope`):
        its publishes and :meth:`match_prefix` use it from now on, and
        :meth:`fork` passes it on. InvalidArgumentError when the sequence
        holds tokens (truncate it to 0 first)."""
        if isinstance(scope, Scope):
            if shared_scope or shared_tokens:
                raise TypeError("pass either a kvh.Scope or shared_scope/shared_tokens, not both")
            sc = scope
        else:
            sc = Scope(Scope.of(scope).scope, shared_scope, shared_tokens)
        with self._call() as p:
            check(lib.kvh_seq_set_scope(p, self._h[0], sc.scope, sc.shared_scope, sc.shared_tokens))

    @property
    def scope(self) -> Scope:
        """The tenant scope (:class:`kvh.Scope`) its blocks hash in."""
        out = ffi.new("uint64_t[3]")
        with self._call_any() as p:
            check(lib.kvh_seq_get_scope(p, self._h[0], out, out + 1, out + 2))
        return Scope(int(out[0]), int(out[1]), int(out[2]))

    def fork(self, agent: Optional[int] = None) -> "Sequence":
        """Copy-on-write child sharing every block (agent: default the parent's)."""
        agent = self._agent if agent is None else _index("agent", agent, maximum=_U32)
        h = ffi.new("kvh_seq *")
        child = None
        try:
            with self._call() as p:
                self._detach_views(p)
                check(lib.kvh_seq_fork(p, self._h[0], agent, h))
                self._refresh_views()
        finally:
            # Owned even when a Ctrl-C is raised as the call returns: it
            # is freed with the exception then.
            if h.id:
                child = Sequence(self._engine, h, agent)
        return child

    # ---- K/V ----
    def write_kv(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        """Writes K and V of tokens ``[pos, pos + n)`` of one layer. ``k``/``v``
        are C-contiguous arrays shaped ``(n, num_kv_heads, head_dim)`` of the
        engine's dtype. Shared blocks are copied first (CoW)."""
        layer = _index("layer", layer, maximum=_U32)
        pos = _index("pos", pos)
        # Plain views, checked once: their shapes cannot change under the
        # call (another thread reshaping k in place, a subclass's shape).
        k = self._kv_check("k", k)
        v = self._kv_check("v", v, n=k.shape[0])
        with self._call() as p:
            n = k.shape[0]
            if self._views and n:
                # A full block this write completes is published (shared
                # with later prefix matches): its writable views let go of
                # it first.
                bt = self._engine.block_tokens
                full = self._length(p) // bt
                self._detach_views(p, range(pos // bt, min((pos + n - 1) // bt + 1, full)))
            check(lib.kvh_seq_write_kv(p, self._h[0], layer, pos, n, _ptr(k), _ptr(v)))
            self._refresh_views()

    def read_kv(
        self,
        layer: int,
        pos: TokenSpan = None,
        n: Optional[int] = None,
        *,
        out: Optional[Tuple[np.ndarray, np.ndarray]] = None,
    ) -> Tuple[np.ndarray, np.ndarray]:
        """Copies K and V of tokens ``[pos, pos + n)`` (or a range; default
        all) of one layer into new arrays shaped ``(n, num_kv_heads,
        head_dim)`` (or into ``out=(k, v)``, both arrays). Returns ``(k, v)``."""
        layer = _index("layer", layer, maximum=_U32)
        with self._call() as p:
            f, cnt = self._span_to_read(p, pos, n)
            if out is None:
                shape = (cnt, self._engine.num_kv_heads, self._engine.head_dim)
                k = np.empty(shape, self._engine.np_dtype)
                v = np.empty(shape, self._engine.np_dtype)
            else:
                if not isinstance(out, tuple) or len(out) != 2:
                    raise TypeError("out must be a (k, v) tuple of arrays")
                kv = self._kv_check("out[0]", out[0], n=cnt, out=True)
                vv = self._kv_check("out[1]", out[1], n=cnt, out=True)
                if np.may_share_memory(kv, vv):
                    raise ValueError("out[0] and out[1] overlap: K and V need arrays of their own")
                check(lib.kvh_seq_read_kv(p, self._h[0], layer, f, cnt, _ptr(kv), _ptr(vv)))
                return out[0], out[1]
            check(lib.kvh_seq_read_kv(p, self._h[0], layer, f, cnt, _ptr(k), _ptr(v)))
        return k, v

    # ---- residency ----
    def acquire(self, first: TokenSpan = None, n: Optional[int] = None, *, wait: bool = True) -> Hold:
        """Makes tokens ``[first, first + n)`` (or a range; default all)
        resident in the device tier and holds them there until the returned
        :class:`Hold` is released. ``wait=False`` returns at once; the hold's
        ``fence`` completes when the data is resident."""
        wait = bool(_flag("wait", wait))
        fp = ffi.new("kvh_fence *") if not wait else NULL
        status = ffi.new("kvh_status *", -1)
        hold = None
        try:
            with self._call() as p:
                f, cnt = self._span(p, first, n)
                lib.kvhpy_seq_acquire(p, self._h[0], f, cnt, fp, status)
        finally:
            # Owned even when a Ctrl-C is raised as the call returns (a
            # blocking acquire is where it mostly lands): the Hold then
            # goes with the exception, and its collection releases it.
            if status[0] == 0:
                hold = Hold(self, f, cnt, Fence(self._engine, fp) if not wait else None)
        check(status[0])
        return hold

    def pin(self, first: TokenSpan = None, n: Optional[int] = None) -> None:
        """Pins the blocks of a token range in their current tier (nests). A
        block pinned on disk that a call must read or change in memory
        (``read_kv``, ``write_kv``, a copy on write) is still brought up, its
        pins with it."""
        self._pin(first, n, 1)

    def unpin(self, first: TokenSpan = None, n: Optional[int] = None) -> None:
        self._pin(first, n, 0)

    def set_tolerance(self, tolerance: int, first: TokenSpan = None, n: Optional[int] = None) -> None:
        """Compression tolerance (0 intolerant .. 255) of the blocks of a token
        range, used by ``eviction_policy="lctru"``: among blocks of similar
        recency, tolerant ones leave the device tier (are compressed under a
        kv_codec) first."""
        tol = _index("tolerance", tolerance, maximum=_U32)
        with self._call() as p:
            f, cnt = self._span(p, first, n)
            check(lib.kvh_seq_set_tolerance(p, self._h[0], f, cnt, tol))

    def derive_tolerance(self, first: TokenSpan = None, n: Optional[int] = None, *, max_rel_error: float = 0.0) -> None:
        """Sets the tolerance of the range's device-tier blocks from the
        engine's kv_codec error on them: 255 * max(0, 1 - err / max_rel_error)
        (0 = 0.25). Needs ``kv_codec``."""
        with self._call() as p:
            f, cnt = self._span(p, first, n)
            check(lib.kvh_seq_derive_tolerance(p, self._h[0], f, cnt, _c_float("max_rel_error", max_rel_error, 0.0)))

    def _pin(self, first: TokenSpan, n: Optional[int], pinned: int) -> None:
        with self._call() as p:
            f, cnt = self._span(p, first, n)
            check(lib.kvh_seq_pin(p, self._h[0], f, cnt, pinned))

    def migrate(
        self, tier: Union[Tier, int, str], first: TokenSpan = None, n: Optional[int] = None, *, wait: bool = True
    ) -> Optional[Fence]:
        """Moves the blocks of a token range to a tier."""
        wait = bool(_flag("wait", wait))
        t = Tier.parse(tier)
        fp = ffi.new("kvh_fence *") if not wait else NULL
        with self._call_any() as p:
            f, cnt = self._span(p, first, n)
            check(lib.kvh_seq_migrate(p, self._h[0], f, cnt, int(t), fp))
        return None if wait else Fence(self._engine, fp)

    def prefetch(self, first: TokenSpan = None, n: Optional[int] = None, *, priority: int = 0) -> Fence:
        """Same as ``engine.prefetch(self, ...)``."""
        return self._engine.prefetch(self, first, n, priority=priority)

    def hint(self, first: TokenSpan = None, n: Optional[int] = None, *, priority: int = 0) -> None:
        """Same as ``engine.hint(self, ...)``."""
        self._engine.hint(self, first, n, priority=priority)

    def hint_queued(
        self,
        first: TokenSpan = None,
        n: Optional[int] = None,
        *,
        position: Optional[int] = None,
        request: Optional[int] = None,
    ) -> None:
        """Same as ``engine.hint_queued(self, ...)``."""
        self._engine.hint_queued(self, first, n, position=position, request=request)

    def persist(self) -> None:
        """Makes every full block durable in the disk tier (UnsupportedError
        without a disk tier)."""
        with self._call() as p:
            if self._views:
                # A full block may be published here (its twin gone): its
                # writable views let go of it first.
                self._detach_views(p, range(self._length(p) // self._engine.block_tokens))
            check(lib.kvh_seq_persist(p, self._h[0]))
            self._refresh_views()

    # ---- blocks ----
    def blocks(self, first_block: int = 0, n: Optional[int] = None) -> List[Block]:
        """Borrowed handles of logical blocks ``[first_block, first_block + n)``."""
        first_block = _index("first_block", first_block)
        with self._call() as p:
            bt = self._engine.block_tokens
            total = (self._length(p) + bt - 1) // bt
            if n is None:
                n = max(0, total - first_block)
            n = _index("n", n)
            if n and first_block + n > total:
                # Refused before an array of n handles is made (1 << 62
                # would not fit), as the library refuses it.
                raise errors.RangeError(
                    f"blocks [{first_block}, {first_block + n}) pass the sequence's {total} blocks", lib.KVH_ERR_RANGE
                )
            out = ffi.new("kvh_block[]", max(1, n))
            check(lib.kvh_seq_blocks(p, self._h[0], first_block, n, out))
        return [Block(self._engine, int(out[i].id), owned=False) for i in range(n)]

    def block(self, index: int) -> Block:
        return self.blocks(_index("index", index), 1)[0]

    def block_info(self, index: int) -> BlockInfo:
        return self.block(index).info()

    def block_view(self, index: int, layer: int, *, hold: Optional[Hold] = None) -> np.ndarray:
        """Zero-copy NumPy view of logical block ``index``, one layer, shaped
        ``(2, num_kv_heads, block_tokens, head_dim)`` (K then V; the block's
        layout). Writes through a writable view are the block's memory.

        The view is read-only when the block is shared (forked, CoW),
        published in the prefix index, or full with every cell of every
        layer written (kvh keeps such a block immutable: a write goes to a
        copy, and copies of it kept in other tiers stay valid; taking the
        view then reads each layer once). Blocks move between tiers, so the view
        holds the block's tokens itself (also when ``hold``, a caller's hold
        covering them, is given: that one may end first) until the last array
        derived from it is collected. When the sequence gives the block up
        (``truncate``, ``free``, or a copy on write) the view keeps it,
        pinned and unchanged, until the view is collected; a read-only view
        keeps its block from the start, so while it lives the block counts
        as shared and later views of it are read-only too. A write or an
        append into a shared block moves this sequence to a private copy:
        take a new view after writes, forks or appends (writable views of
        this sequence are made read-only once their block is no longer its
        private memory). Before a ``fork``, a ``persist``
        or a ``write_kv`` into a full block (which may publish it), the sequence
        moves to a copy of each block a writable view maps and the view keeps
        the old one: arrays made from the view earlier keep their NumPy
        write flag, but what they write reaches no sequence and no prefix
        match. Writes through a view do not mark cells as written for
        ``read_kv``: write them with ``write_kv`` first (when nothing of the
        block was, that move marks the first token's cell of the view's
        layer). Cells never written read as zeros in the view (the slot
        may hold what an earlier block left; another live view of the same
        block and layer keeps them as its writes left them). Taking a view
        reads the block's cells to tell which were written: kvh_stats counts
        that as one lookup, or one a cell when some were not. Needs host
        memory (the CPU backend); UnsupportedError on
        CUDA and on a ``vmap`` engine (its device tier is laid out by
        head: read blocks through :meth:`vmap`).
        """
        eng = self._engine
        index = _index("index", index, maximum=_U32)
        layer = _index("layer", layer, maximum=_U32)
        if layer >= eng.num_layers:
            raise errors.RangeError(f"layer {layer} >= num_layers {eng.num_layers}", lib.KVH_ERR_RANGE)
        if eng.backend != "cpu":
            raise errors.UnsupportedError(
                f"block views need host memory; the {eng.backend} backend keeps the device tier in GPU memory",
                lib.KVH_ERR_UNSUPPORTED,
            )
        if eng.config.vmap:  # the view's hold brings the block to the device tier
            raise errors.UnsupportedError(
                "with vmap the device tier is laid out by head, not block by block: read blocks through Sequence.vmap",
                lib.KVH_ERR_UNSUPPORTED,
            )
        bt = eng.block_tokens
        length = self.length
        if index * bt >= length:
            raise errors.RangeError(f"block {index} is past the sequence ({length} tokens)", lib.KVH_ERR_RANGE)
        if hold is not None:
            if not isinstance(hold, Hold) or hold._seq is not self:
                raise TypeError("hold must be a kvh.Hold of this sequence")
            if not hold.covers_block(index):
                raise ValueError(f"hold {hold!r} does not cover block {index}")
            hold.wait()
        # The look at the block, its address and the view's registration
        # happen with the sequence's calls held off: a fork, persist or
        # write on another thread in between moved the sequence to a copy
        # of the block, and the view showed the old block's slot while its
        # hold and handle named the new one.
        with self._gate.exclusive():
            # The view's own hold, also beside a caller's: that one may be
            # released while arrays made from the view live on.
            private = True
            length = self.length  # a truncate may have come since the check above
            if index * bt >= length:
                raise errors.RangeError(f"block {index} is past the sequence ({length} tokens)", lib.KVH_ERR_RANGE)
            hold = self.acquire(index * bt, min(bt, length - index * bt))
            try:
                block = self.block(index)
                info = block.info()
                if info.tier not in (Tier.DEVICE, Tier.HOST) or info.in_flight:
                    raise errors.NotResidentError(f"block {index} is not resident in memory", lib.KVH_ERR_NOT_RESIDENT)
                tinfo = eng.tier_info(info.tier)
                if not tinfo.base:
                    raise errors.NotResidentError(
                        f"tier {info.tier.name.lower()} has no memory", lib.KVH_ERR_NOT_RESIDENT
                    )
                addr = tinfo.base + info.slot * eng.block_bytes + layer * eng.layer_bytes
                complete = not info.shared and self._complete(index, info)
                readonly = info.shared or complete
                shape = (2, eng.num_kv_heads, bt, eng.head_dim)
                if not complete:  # else every cell is written: nothing to clear
                    self._clear_unwritten_cells(index, layer, block, addr, shape, shared=readonly)
                owner = _ViewOwner(eng, hold, private, addr, shape, eng.np_dtype, readonly)
                owner.block = block
                owner.layer = layer
                if readonly:
                    # Its own reference and pin on the shared (or published)
                    # block: the hold follows the sequence's tokens to a
                    # copy (a write, an append, a detaching fork), and the
                    # slot must not be reused while the view can read it.
                    # A writable view's block is private, where a reference
                    # more would make the next write copy it; it is kept
                    # when the sequence leaves it (_detach_views).
                    owner.keep_block()
            except BaseException:
                if private:
                    hold.release()
                raise
            view = np.asarray(owner)
            assert view.base is owner or view.base is not None
            self._view_owners = [(r, i) for r, i in self._view_owners if r() is not None]
            self._view_owners.append((weakref.ref(owner), index))
            if not readonly:
                self._views = [(r, i) for r, i in self._views if r() is not None]
                self._views.append((weakref.ref(view), index))
        return view

    def _complete(self, index: int, info: BlockInfo) -> bool:
        """Whether block ``index`` is full with every cell of every layer
        written: kvh then keeps it immutable (a write goes to a copy, and
        its copies kept in other tiers stay valid), so a view of it must
        not write it in place. One read a layer."""
        eng = self._engine
        bt = eng.block_tokens
        if info.tokens != bt:
            return False
        k = np.empty((bt, eng.num_kv_heads, eng.head_dim), eng.np_dtype)
        v = np.empty_like(k)
        with self._call() as p:
            for layer in range(eng.num_layers):
                if lib.kvh_seq_read_kv(p, self._h[0], layer, index * bt, bt, _ptr(k), _ptr(v)) != lib.KVH_OK:
                    return False
        return True

    def _clear_unwritten_cells(
        self, index: int, layer: int, block: Block, addr: int, shape: Tuple[int, ...], *, shared: bool
    ) -> None:
        """Zeroes the cells of block ``index``, layer ``layer``, that were
        never written: a slot is not cleared when a block takes it, and a
        view would show what an earlier block there held (another
        tenant's KV). Their written state does not change, and nothing a
        caller can read through kvh does either, so a shared block is
        cleared too (it is copied before any in-place write); past the
        sequence's end only a private block is (those cells are its own)."""
        eng = self._engine
        bt, heads, dim = eng.block_tokens, eng.num_kv_heads, eng.head_dim
        first = index * bt
        k = np.empty((bt, heads, dim), eng.np_dtype)
        v = np.empty((bt, heads, dim), eng.np_dtype)
        cells = np.frombuffer(
            ffi.buffer(ffi.cast("char *", addr), int(np.prod(shape)) * eng.np_dtype.itemsize), dtype=eng.np_dtype
        ).reshape(shape)
        with self._call() as p:
            for ref, viewed in self._view_owners:
                other = ref()
                if (
                    viewed == index
                    and other is not None
                    and other.layer == layer
                    and other.block is not None
                    and other.block.handle == block.handle
                ):
                    # Cells written through that view of this very block
                    # but not yet with write_kv read as never written: they
                    # stay. (A view of a block the sequence has left, kept
                    # at the same index, maps another slot.)
                    return
            n = min(bt, self._length(p) - first)
            # One read when every cell is written (the usual case), a
            # read a cell otherwise (each read counts as a lookup).
            whole = lib.kvh_seq_read_kv(p, self._h[0], layer, first, n, _ptr(k), _ptr(v)) == lib.KVH_OK
            for t in range(n if whole else 0, bt):
                if t < n:
                    never = (
                        lib.kvh_seq_read_kv(p, self._h[0], layer, first + t, 1, _ptr(k), _ptr(v)) == lib.KVH_ERR_RANGE
                    )
                else:
                    never = not shared
                if never:
                    cells[:, :, t, :] = 0

    def _detach_views(self, p: Any, blocks: Optional[range] = None) -> None:
        """Before a call that may share or publish blocks (a fork, a write
        completing a full block): each writable view of those blocks keeps
        its block (a reference and a pin) and this sequence moves to a copy
        of it (copy-on-write), so what is written through the view, or
        through any array made from it before, reaches no sequence and no
        prefix match. The view is then read-only (take a new one)."""
        live = []
        for ref, index in self._views:
            view = ref()
            if view is None or not view.flags.writeable:
                continue
            if blocks is not None and index not in blocks:
                live.append((ref, index))
                continue
            owner = view.base
            while owner is not None and not isinstance(owner, _ViewOwner):
                owner = getattr(owner, "base", None)
            view.flags.writeable = False
            if owner is None:
                continue
            owner.make_read_only()
            owner.keep_block()
            if owner.kept is None:
                continue
            try:
                self._cow_block(p, index, owner)
            except errors.Error:
                # No room for the copy: the call goes on as without the
                # view's block kept (the view stays read-only), rather
                # than fail where it needs no room itself.
                owner.let_block_go()
        self._views = live

    def _cow_block(self, p: Any, index: int, owner: "_ViewOwner") -> None:
        """Moves logical block index to a private copy: one cell rewritten
        with its own bytes (a written one where there is one, so no cell
        changes its written state)."""
        eng = self._engine
        bt, H, D = eng.block_tokens, eng.num_kv_heads, eng.head_dim
        first = index * bt
        n = min(bt, self._length(p) - first)
        k = np.empty((1, H, D), eng.np_dtype)
        v = np.empty((1, H, D), eng.np_dtype)
        for layer in range(eng.num_layers):
            for t in range(first, first + n):
                if lib.kvh_seq_read_kv(p, self._h[0], layer, t, 1, _ptr(k), _ptr(v)) == lib.KVH_OK:
                    check(lib.kvh_seq_write_kv(p, self._h[0], layer, t, 1, _ptr(k), _ptr(v)))
                    return
        # Nothing written through the sequence: the first token's cell of
        # the view's layer, from the block's memory, becomes written.
        mem = np.asarray(owner)  # read-only now; the block is kept
        k[0] = mem[0][:, 0, :]
        v[0] = mem[1][:, 0, :]
        check(lib.kvh_seq_write_kv(p, self._h[0], owner.layer, first, 1, _ptr(k), _ptr(v)))

    def _refresh_views(self) -> None:
        """Makes writable views read-only when their block became shared,
        published or replaced (CoW) — the view no longer is this sequence's
        private memory. Called inside the call that changed the sequence."""
        if not self._views:
            return
        live = []
        for ref, index in self._views:
            view = ref()
            if view is None or not view.flags.writeable:
                continue
            keep = False
            same = True  # unknown: a block given up was kept already (_keep_viewed_blocks)
            try:
                info = self.block(index).info()
                owner = view.base
                addr = getattr(owner, "__array_interface__", {}).get("data", (0,))[0]
                tinfo = self._engine.tier_info(info.tier) if info.tier in (Tier.DEVICE, Tier.HOST) else None
                expected = (tinfo.base + info.slot * self._engine.block_bytes) if tinfo else -1
                same = expected >= 0 and 0 <= addr - expected < self._engine.block_bytes
                keep = same and not info.shared
            except errors.Error:
                keep = False
            if keep:
                live.append((ref, index))
            else:
                view.flags.writeable = False
                if isinstance(view.base, _ViewOwner):
                    view.base.make_read_only()
                    if not same:
                        # Replaced (copied on write while another held it):
                        # the old block, which arrays made from the view
                        # still show, is kept until the view goes, so its
                        # slot is never reused under them.
                        view.base.keep_block()
        self._views = live
