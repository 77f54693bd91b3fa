"""Weight contexts: a model's weights and its agents' KV as one swappable
unit (``kvh_context``).

    with kvh.Engine(device_bytes=..., host_bytes=...) as eng:
        a = eng.context("smollm2-q8", kv_policy="demote")
        a.add_gguf("/path/model-q8_0.gguf")      # one region per tensor
        b = eng.context("smollm2-f16")
        b.add_gguf("/path/model-f16.gguf")
        a.switch_to()                              # load a
        seq = eng.sequence(context=a, token_budget=512)
        ...
        fence = b.switch_to(wait=False)            # a out, b in, layer by layer
        b.wait_layer(0)                            # early layers are usable
        fence.result()

Weights are charged to the same tier budgets as KV. Regions read from a
file are dropped, never written, when they leave memory, and read (and
checked against their CRC32C) again when they return. Pointers from
:meth:`Context.region_pointer` are valid until the next switch away from the
context; a view from :meth:`Context.region` keeps its region pinned in the
device tier (and its memory, its context's and the engine's alive) until it
is garbage-collected, so drop it before switching away if the region should
leave.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from typing import Any, Dict, List, Optional, Set, Tuple, Union

import numpy as np

from . import errors
from ._ffi import check, ffi, lib
from ._handle import Closable, Finalized, ForkSafeLock, GatedHandle, HandleGate, Uncopyable
from .engine import _flag, _index, _interruptible, _timeout_ns

__all__ = ["Context", "ContextInfo", "WeightStats", "AdmissionInfo", "KV_POLICIES"]

KV_POLICIES = {"keep": 0, "demote": 1}
_U32 = (1 << 32) - 1
_NAMES_SHOWN = 8  # region names an unknown-name error lists
log = logging.getLogger("kvh")


def _name(arg: str, value: Any) -> str:
    """A context or region name: a str without NUL (the C side keeps the
    first 63 bytes)."""
    if not isinstance(value, str):
        raise TypeError(f"{arg} must be a str, not {type(value).__name__}")
    if "\0" in value:
        raise ValueError(f"{arg} must not contain NUL characters")
    return value


_BLK = re.compile(r"^blk\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class ContextInfo:
    regions: int
    weight_bytes: int
    bytes_device: int
    bytes_host: int
    layers_ready: int  # regions resident in load order before the first missing one
    loading: bool
    seqs: int
    bytes_disk: int  # modified or byte-sourced weights spilled to the disk tier


@dataclasses.dataclass(frozen=True)
class WeightStats:
    unified_memory: bool
    bytes_device: int
    bytes_host: int
    slots_device: int
    slots_host: int
    switches: int
    bytes_read_source: int
    bytes_host_to_device: int
    bytes_device_to_host: int
    bytes_dropped: int
    bytes_remapped: int
    chunks_verified: int
    crc_failures: int
    kv_blocks_demoted: int
    kv_blocks_promoted: int
    bytes_disk: int  # gauge: weights in the disk tier (no room in memory)
    slots_disk: int
    bytes_host_to_disk: int
    bytes_disk_to_host: int


@dataclasses.dataclass(frozen=True)
class AdmissionInfo:
    enabled: bool
    short_max_tokens: int
    short_quota_blocks: int
    long_quota_blocks: int
    short_reserved_blocks: int
    long_reserved_blocks: int
    short_admitted: int
    long_admitted: int
    short_rejected: int
    long_rejected: int


def _struct_fields(ctype: str, obj: Any, cls: Any) -> Dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cls):
        v = getattr(obj, f.name)
        out[f.name] = bool(v) if f.type in ("bool", bool) else int(v)
    return out


def _path_bytes(path: Union[str, os.PathLike]) -> bytes:
    p = os.fsencode(path)
    if not p or b"\0" in p:
        raise ValueError("path must be non-empty and must not contain NUL bytes")
    return p


def gguf_layer(name: str, num_blocks: int) -> int:
    """Load order of a GGUF tensor: embeddings first (0), transformer block
    N as N + 1, the output head last."""
    m = _BLK.match(name)
    if m:
        return int(m.group(1)) + 1
    if name.startswith("token_embd") or name.startswith("rope"):
        return 0
    return num_blocks + 1


class _RegionView(Finalized, Uncopyable):
    """Base object of a region view: exposes the region's memory through
    ``__array_interface__`` and, while any array derived from it lives,
    keeps the region pinned and the context and engine from freeing it."""

    def __init__(self, ctx: "Context", index: int, addr: int, size: int, readonly: bool) -> None:
        self.__array_interface__ = {
            "version": 3,
            "shape": (size,),
            "typestr": "|u1",
            "data": (addr, readonly),
            "strides": None,
        }
        native = ctx._engine._native
        native.add_view(self)  # the engine's close leaves its memory to us
        self._native = native
        self._index = index
        self._ctx = ctx  # set last: a view that was never made drops nothing

    def _close_at_gc(self) -> None:
        ctx = getattr(self, "_ctx", None)
        if ctx is None:
            return
        try:
            ctx._view_gone(self._index)
        finally:
            self._native.drop_view(self)


class Context(GatedHandle, Closable, Uncopyable):
    """One ``kvh_context``. Create with :meth:`kvh.Engine.context`; free with
    :meth:`destroy`, a ``with`` block, or when the engine closes."""

    def __init__(self, engine: Any, handle: int, name: str) -> None:
        # Messages name an unnamed context by its handle, as the library's do.
        label = repr(name) if name else f"0x{handle:x}"
        self._label = label
        # A destroy refused (BusyError: a switch runs) leaves the context usable.
        self._gate = HandleGate(
            lambda: errors.BadHandleError(f"context {label} was destroyed", lib.KVH_ERR_BAD_HANDLE),
            reopen_if_end_fails=True,
        )
        self._engine = engine
        self._h = ffi.new("kvh_context *")
        self._h.id = handle
        self._name = name
        self._regions: List[Tuple[str, int, int]] = []  # (name, layer, size)
        # Region views (see region()): live views per region, the regions
        # pinned for views, and those the caller pinned. A view's collection
        # only counts down (it may run inside any call); the pins of regions
        # left without views are taken back before this context's regions
        # next leave (_settle_view_pins), under _pin_lock.
        self._views_lock = ForkSafeLock()
        self._pin_lock = ForkSafeLock(reentrant=True)
        self._view_counts: Dict[int, int] = {}
        self._view_pins: Set[int] = set()
        self._user_pins: Set[int] = set()
        self._destroy_deferred = False

    # ---- identity ----
    @property
    def name(self) -> str:
        return self._name

    @property
    def handle(self) -> int:
        return int(self._h.id)

    @property
    def regions(self) -> List[Tuple[str, int, int]]:
        """(name, layer, size) of each region, by index."""
        return list(self._regions)

    def region_index(self, name: str) -> int:
        """Index of the region registered as ``name`` (the first, if several
        share it); :class:`kvh.KvhKeyError` (a ``KeyError``) when none is."""
        for i, (n, _, _) in enumerate(self._regions):
            if n == name:
                return i
        names = [n for n, _, _ in self._regions]
        if not names:
            known = "it has no regions"
        elif len(names) <= _NAMES_SHOWN:
            known = "its regions: " + ", ".join(map(repr, names))
        else:
            shown = ", ".join(map(repr, names[:_NAMES_SHOWN]))
            known = f"its regions: {shown} and {len(names) - _NAMES_SHOWN} more"
        raise errors.KvhKeyError(
            f"context {self._label} has no region named {name!r} ({known})", lib.KVH_ERR_INVALID_ARG
        )

    @property
    def destroyed(self) -> bool:
        return self._gate.closed

    def _check(self) -> None:
        if self._gate.closed:
            raise errors.BadHandleError(f"context {self._label} was destroyed", lib.KVH_ERR_BAD_HANDLE)

    _check_usable = _check

    def _check_engine(self, engine: Any) -> None:
        if self._engine is not engine:
            raise errors.ForeignHandleError.of("context")

    # ---- registration ----
    def add_region(
        self,
        name: str = "",
        *,
        size: Optional[int] = None,
        layer: int = 0,
        path: Union[str, os.PathLike, None] = None,
        offset: int = 0,
        data: Any = None,
        pinned: bool = False,
    ) -> int:
        """Registers a weight region from a file range (``path``, ``offset``,
        ``size``) or from bytes (``data``: bytes-like or a NumPy array, copied
        in). Returns its index."""
        self._check()
        name = _name("name", name)
        pinned = _flag("pinned", pinned)
        if (path is None) == (data is None):
            raise ValueError("give exactly one source: path= or data=")
        layer = _index("layer", layer, maximum=_U32)
        offset = _index("offset", offset)
        if size is not None:
            size = _index("size", size)
        p = ffi.new("kvh_weight_region_params *")
        check(lib.kvh_weight_region_params_init(p, ffi.sizeof("kvh_weight_region_params")))
        keep: list = []
        nm = ffi.new("char[]", name.encode("utf-8", "surrogateescape")[:63])
        keep.append(nm)
        p.name = nm
        p.layer = layer
        p.pinned = pinned
        if path is not None:
            if size is None:
                raise ValueError("size= is required with path=")
            buf = ffi.new("char[]", _path_bytes(path))
            keep.append(buf)
            p.path = buf
            p.file_offset = offset
            p.size = size
        else:
            if not isinstance(data, np.ndarray):
                try:
                    data = np.asarray(memoryview(data))  # takes strided buffers as they are
                except TypeError:
                    raise TypeError(f"data must be a buffer (bytes, numpy array), not {type(data).__name__}") from None
            if data.dtype.hasobject:  # references, not bytes
                raise TypeError(f"data must hold plain numbers or bytes, not {data.dtype} (Python objects)")
            arr = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
            if size is not None and size != arr.size:
                raise ValueError(f"size={size} does not match the {arr.size} bytes of data")
            if arr.size == 0:
                raise ValueError("data is empty")
            p.bytes = ffi.from_buffer("char[]", arr)
            keep.append(arr)
            p.size = arr.size
        out = ffi.new("uint32_t *")
        with self._call() as e:
            check(lib.kvh_context_add_region(e, self._h[0], p, out))
        self._regions.append((name, layer, int(p.size)))
        if pinned:
            self._user_pins.add(int(out[0]))
        return int(out[0])

    def add_gguf(self, path: Union[str, os.PathLike], *, pinned: Tuple[str, ...] = ()) -> int:
        """Registers every tensor of a GGUF file as a region read from the
        file (nothing is read now), in load order embeddings, block 0, ...,
        output. Tensors named in ``pinned`` are pinned. Returns the count."""
        from .model.gguf_loader import GGUFFile

        if isinstance(pinned, (str, bytes)):
            # A string is a container of its substrings: "output" would pin
            # every tensor whose name is part of it.
            raise TypeError("pinned must be a collection of tensor names, not a string")
        try:
            g = GGUFFile(os.fspath(path))
        except OSError as exc:  # as add_region reports a file it cannot open
            raise errors.KvhIOError(f"{os.fspath(path)}: {exc.strerror or exc}", lib.KVH_ERR_IO) from None
        with g:
            tensors = list(g.tensors.values())
        nblk = 1 + max((int(m.group(1)) for t in tensors if (m := _BLK.match(t.name))), default=-1)
        for t in tensors:
            self.add_region(
                t.name,
                path=path,
                offset=t.offset,
                size=t.nbytes,
                layer=gguf_layer(t.name, nblk),
                pinned=t.name in pinned,
            )
        return len(tensors)

    def attach(self, seq: Any) -> None:
        """Moves seq's KV with this context (under ``kv_policy="demote"``)."""
        self._check()
        from .engine import Sequence

        if not isinstance(seq, Sequence):
            raise TypeError(f"seq must be a kvh.Sequence, not {type(seq).__name__}")
        seq._check_engine(self._engine)
        with self._call(seq._gate.shared()) as e:
            check(lib.kvh_context_attach_seq(e, self._h[0], seq._h[0]))

    # ---- switching ----
    def switch_to(self, previous: Optional["Context"] = None, *, wait: bool = True):
        """Makes this context's weights resident in the device tier, moving
        ``previous`` (default: the engine's current context) out. With
        ``wait=False`` returns a :class:`kvh.Fence` without waiting for
        this switch's own moves; :meth:`wait_layer` tells when early layers
        are usable. A switch already in flight is waited for first, with
        ``wait=False`` too."""
        self._check()
        wait = bool(_flag("wait", wait))
        if previous is not None:
            if not isinstance(previous, Context):
                raise TypeError(f"previous must be a kvh.Context or None, not {type(previous).__name__}")
            previous._check_engine(self._engine)
        prev = self._engine._current_context if previous is None else previous
        if prev is self:
            prev = None
        if prev is not None:
            prev._settle_view_pins()
        return self._engine._switch(prev, self, wait)

    def unload(self, *, wait: bool = True):
        """Moves this context's weights out of the device tier."""
        self._check()
        wait = bool(_flag("wait", wait))
        self._settle_view_pins()
        return self._engine._switch(self, None, wait)

    def wait_layer(self, layer: int, timeout: Optional[float] = None) -> None:
        """Waits until every region with ``layer <= layer`` is resident.
        Raises NotResidentError when no switch loads it, KvhTimeoutError."""
        self._check()
        layer = _index("layer", layer, maximum=_U32)
        ns = _timeout_ns("timeout", timeout)

        def wait_ns(n: int) -> bool:
            with self._call_any() as e:
                st = lib.kvh_context_wait_layer(e, self._h[0], layer, n)
                if st == lib.KVH_ERR_TIMEOUT and n != ns:
                    return False  # one slice of a longer wait
                check(st)
            return True

        if not _interruptible(ns, wait_ns):
            raise errors.KvhTimeoutError(
                f"context {self._label}: layer {layer} not resident after {timeout} s", lib.KVH_ERR_TIMEOUT
            )

    # ---- access ----
    def region_pointer(self, index: int, *, writable: bool = False) -> Tuple[int, int]:
        """(address, size) of a resident region: a device pointer on CUDA.
        ``writable=True`` marks it modified (written back, not dropped).
        Raises NotResidentError, or BusyError while a switch away from
        this context moves its unpinned regions out."""
        self._check()
        writable = _flag("writable", writable)
        index = _index("index", index, maximum=_U32)
        data = ffi.new("void **")
        size = ffi.new("uint64_t *")
        with self._call_any() as e:
            check(lib.kvh_context_region_data(e, self._h[0], index, writable, data, size))
        return int(ffi.cast("uintptr_t", data[0])), int(size[0])

    def region(self, index: Union[int, str], *, writable: bool = False) -> np.ndarray:
        """A uint8 NumPy view of a resident region (CPU backend), no copy.
        Until the view and every array derived from it are collected, the
        region stays pinned in the device tier (a switch away leaves it
        there) and its memory stays mapped, even past :meth:`destroy` or
        the engine's close, which wait for it."""
        self._check()
        writable = _flag("writable", writable)
        if isinstance(index, str):
            index = self.region_index(index)
        index = _index("index", index, maximum=_U32)
        if self._engine.backend != "cpu":
            raise errors.UnsupportedError(
                "region views need the CPU backend; use region_pointer()", lib.KVH_ERR_UNSUPPORTED
            )
        with self._views_lock:
            self._view_counts[index] = self._view_counts.get(index, 0) + 1
        try:
            with self._pin_lock:
                if index not in self._view_pins:
                    if index not in self._user_pins:
                        self._pin_native(index, True)
                    self._view_pins.add(index)
            addr, size = self.region_pointer(index, writable=writable)
            owner = _RegionView(self, index, addr, size, not writable)
        except BaseException:
            self._view_gone(index)
            raise
        return np.asarray(owner)

    def pin(self, index: int, pinned: bool = True) -> None:
        """Pins (or unpins) a region: a pinned region never leaves the
        device tier once there. A region with live views stays pinned until
        they are gone."""
        self._check()
        pinned = _flag("pinned", pinned)
        index = _index("index", index, maximum=_U32)
        with self._pin_lock:
            self._pin_native(index, pinned or index in self._view_pins)
            if pinned:
                self._user_pins.add(index)
            else:
                self._user_pins.discard(index)

    def _pin_native(self, index: int, pinned: bool) -> None:
        with self._call() as e:
            check(lib.kvh_context_region_pin(e, self._h[0], index, 1 if pinned else 0))

    def _view_gone(self, index: int) -> None:
        """A view of region index was collected (or never made). Runs from
        finalisers: it only counts, except for a destroy deferred to the
        last view."""
        with self._views_lock:
            left = self._view_counts.get(index, 0) - 1
            if left > 0:
                self._view_counts[index] = left
            else:
                self._view_counts.pop(index, None)
            destroy_now = self._destroy_deferred and not self._view_counts
            if destroy_now:
                self._destroy_deferred = False
        if destroy_now:
            self._destroy_c()

    def _settle_view_pins(self) -> None:
        """Takes back the pins of regions whose views are all gone (before
        this context's regions leave the device tier)."""
        if not self._view_pins or self._gate.closed:
            return
        with self._pin_lock:
            with self._views_lock:
                idle = [i for i in self._view_pins if i not in self._view_counts]
            for i in idle:
                if i not in self._user_pins:
                    try:
                        self._pin_native(i, False)
                    except (errors.BadHandleError, errors.ClosedError):
                        return
                self._view_pins.discard(i)

    def verify(self) -> int:
        """Re-checks the CRC32C of every resident, unmodified chunk; returns
        how many were checked (CorruptionError on a mismatch)."""
        self._check()
        n = ffi.new("uint64_t *")
        with self._call_any() as e:
            check(lib.kvh_context_verify(e, self._h[0], n))
        return int(n[0])

    def info(self) -> ContextInfo:
        self._check()
        i = ffi.new("kvh_context_info *")
        i.struct_size = ffi.sizeof("kvh_context_info")
        with self._call_any() as e:
            check(lib.kvh_context_info_get(e, self._h[0], i))
        return ContextInfo(**_struct_fields("kvh_context_info", i, ContextInfo))

    # ---- lifetime ----
    def destroy(self) -> None:
        """Frees the context's weight memory once calls in flight on other
        threads are done. Idempotent."""
        self._gate.close(self._destroy_native)

    def _destroy_native(self) -> None:
        with self._views_lock:
            if self._view_counts:  # the last view's collection destroys it
                self._destroy_deferred = True
                if self._engine._current_context is self:
                    self._engine._current_context = None
                return
        try:
            with self._engine._call() as e:
                check(lib.kvh_context_destroy(e, self._h[0]))
        except errors.ClosedError:
            return  # the engine's close freed it
        if self._engine._current_context is self:
            self._engine._current_context = None

    def _destroy_c(self) -> None:
        """The destroy deferred to the last view (from its finaliser)."""
        try:
            with self._engine._call() as e:
                st = lib.kvh_context_destroy(e, self._h[0])
            if st:
                log.debug("kvh: context %s: deferred destroy: status %d; the engine's close frees it", self._label, st)
        except errors.ClosedError:
            pass  # the engine's close freed it

    # Not closed by the garbage collector: the engine frees its contexts
    # when it closes.
    close = destroy

    def __repr__(self) -> str:
        return f"<kvh.Context {self._label} regions={len(self._regions)}{' destroyed' if self.destroyed else ''}>"


def weight_stats(engine: Any) -> WeightStats:
    s = ffi.new("kvh_weight_stats *")
    s.struct_size = ffi.sizeof("kvh_weight_stats")
    with engine._call() as e:
        check(lib.kvh_weight_stats_get(e, s))
    return WeightStats(**_struct_fields("kvh_weight_stats", s, WeightStats))


def admission_info(engine: Any) -> AdmissionInfo:
    i = ffi.new("kvh_admission_info *")
    i.struct_size = ffi.sizeof("kvh_admission_info")
    with engine._call() as e:
        check(lib.kvh_admission_info_get(e, i))
    return AdmissionInfo(**_struct_fields("kvh_admission_info", i, AdmissionInfo))
