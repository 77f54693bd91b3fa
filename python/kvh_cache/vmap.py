"""Virtually contiguous views of a sequence's KV (``kvh_seq_vmap``).

A :class:`VMap` presents one layer of a sequence as NumPy arrays ``k`` and
``v`` shaped ``(num_kv_heads, n_tokens, head_dim)`` that index the engine's
own pages (no copy). Needs ``Config(vmap=1)`` on the CPU backend. The view
holds its blocks in the device tier until released; when the sequence's
block table changes (append into a new block, copy-on-write, truncation) the
view is stale until :meth:`VMap.refresh`. Arrays taken from a view stay valid
until they are garbage-collected even if the view is released first (the
unmapping waits for them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Tuple

import numpy as np

from . import errors
from ._ffi import check, ffi, lib
from ._handle import Finalized, ForkSafeLock, GatedHandle, HandleGate, OwnedHandle, Uncopyable

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine, Sequence


class _ArrayOwner(Finalized, Uncopyable):
    """Base object of a view array: keeps the VMap mapped while it lives."""

    def __init__(self, vm: "VMap", addr: int, shape: Tuple[int, ...], strides: Tuple[int, ...]) -> None:
        self._vm = vm
        self.__array_interface__ = {
            "version": 3,
            "shape": shape,
            "typestr": vm._np_dtype.str,
            "data": (addr, True),
            "strides": strides,
        }
        vm._arrays_add()

    def _close_at_gc(self) -> None:
        self._vm._arrays_drop()


class VMap(GatedHandle, OwnedHandle):
    """One layer of a sequence as contiguous K and V (see the module doc)."""

    def __init__(self, seq: "Sequence", layer: int, capacity_tokens: int = 0) -> None:
        self._gate = HandleGate(lambda: errors.BadHandleError("the view was released", lib.KVH_ERR_BAD_HANDLE))
        self._engine: Engine = seq.engine
        self._seq = seq
        self._np_dtype = self._engine.np_dtype
        self._lock = ForkSafeLock()  # the array count and the unmapping
        self._arrays = 0
        self._released = False  # release() was called
        self._ptr = None  # the kvh_vmap *, until unmapped
        out = ffi.new("kvh_vmap **")
        native = self._engine._native
        native.add_view(self)  # type: ignore[union-attr]  # the engine's close leaves its memory to us
        try:
            with self._engine._call(seq._gate.exclusive()) as p:
                check(lib.kvh_seq_vmap(p, seq._h[0], int(layer), int(capacity_tokens), out))
        except BaseException:
            native.drop_view(self)  # type: ignore[union-attr]
            raise
        self._ptr = out[0]

    # ---- state ----
    def _view(self):
        v = ffi.new("kvh_vmap_view *")
        v.struct_size = ffi.sizeof("kvh_vmap_view")
        with self._call() as p:
            check(lib.kvh_vmap_get(p, self._ptr, v))
        return v

    @property
    def generation(self) -> int:
        return int(self._view().generation)

    @property
    def n_tokens(self) -> int:
        return int(self._view().n_tokens)

    @property
    def capacity_tokens(self) -> int:
        return int(self._view().capacity_tokens)

    @property
    def backing(self) -> str:
        """What the device tier's memory is made of: "hugetlb", "thp", "4k"
        or "cuda-vmm"."""
        v = self._view()
        return ffi.string(v.backing).decode() if v.backing != ffi.NULL else ""

    @property
    def map_unit(self) -> int:
        """Bytes of one of the mappings the view is made of."""
        return int(self._view().map_unit)

    def _array(self, which: str) -> np.ndarray:
        H, D = self._engine.num_kv_heads, self._engine.head_dim
        es = self._np_dtype.itemsize
        v = ffi.new("kvh_vmap_view *")
        v.struct_size = ffi.sizeof("kvh_vmap_view")
        # The array is counted before the gate lets a release through.
        with self._call() as p:
            check(lib.kvh_vmap_get(p, self._ptr, v))
            addr = int(ffi.cast("uintptr_t", v.k if which == "k" else v.v))
            owner = _ArrayOwner(self, addr, (H, int(v.n_tokens), D), (int(v.head_stride), D * es, es))
        return np.asarray(owner)

    @property
    def k(self) -> np.ndarray:
        """K as a read-only array (num_kv_heads, n_tokens, head_dim)."""
        return self._array("k")

    @property
    def v(self) -> np.ndarray:
        """V as a read-only array (num_kv_heads, n_tokens, head_dim)."""
        return self._array("v")

    def refresh(self) -> bool:
        """Remaps what changed in the sequence; True when anything did."""
        changed = ffi.new("int32_t *")
        with self._call(self._seq._gate.exclusive()) as p:
            check(lib.kvh_vmap_refresh(p, self._ptr, changed))
        return bool(changed[0])

    # ---- lifetime ----
    def _arrays_add(self) -> None:
        with self._lock:
            self._arrays += 1

    def _arrays_drop(self) -> None:
        with self._lock:
            self._arrays -= 1
            last = self._arrays == 0 and self._released
        if last:
            self._unmap()

    def _unmap(self) -> None:
        with self._lock:
            ptr, self._ptr = self._ptr, None
        if ptr is None:
            return
        native = self._engine._native
        refused = False
        try:
            if not native.released:  # type: ignore[union-attr]
                p = native.enter()  # type: ignore[union-attr]
                try:
                    st = lib.kvh_vmap_release(p, ptr)
                finally:
                    native.leave()  # type: ignore[union-attr]
                if st == lib.KVH_ERR_BUSY:
                    # Refused inside the engine's log sink on a kvh thread:
                    # still mapped, so the engine's memory stays; the next
                    # call that may unmaps it.
                    refused = True
                    with self._lock:
                        self._ptr = ptr
                    native.defer(self._unmap)  # type: ignore[union-attr]
                    raise errors.BusyError(
                        "a view cannot be released inside the engine's log handler on a kvh thread",
                        lib.KVH_ERR_BUSY,
                    )
        except errors.ClosedError:
            pass  # the engine's close releases it
        finally:
            if not refused:
                native.drop_view(self)  # type: ignore[union-attr]

    def release(self) -> None:
        """Unmaps the view (once no array taken from it is alive) and drops
        its holds. Idempotent."""
        self._gate.close(self._release_native)

    def _release_native(self) -> None:
        with self._lock:
            self._released = True
            last = self._arrays == 0
        if last:
            self._unmap()

    close = release


def _views(views: Any) -> list:
    views = list(views)
    for i, vm in enumerate(views):
        if not isinstance(vm, VMap):
            raise TypeError(f"views[{i}] must be a kvh.VMap, not {type(vm).__name__}")
    return views


def attention_decode_vmap(
    engine: "Engine", views, q: np.ndarray, *, out: Any = None, scale: float = 0.0, threads: int = 0
) -> np.ndarray:
    """Decode attention over views (``kvh_attention_decode_vmap``): q is
    ``(len(views), num_q_heads, head_dim)``; equals
    :meth:`Engine.attention_decode` on the same sequences bit for bit."""
    views = _views(views)
    n = len(views)
    qp, op, out, hq, io = engine._attention_arrays("attention_decode_vmap", q, n, out, None)
    prm = engine._attention_params(hq, scale, io, threads, None)
    # The pointers are read inside the views' gates: a released view has none.
    with engine._call(*(vm._gate.exclusive() for vm in views)) as p:
        arr = ffi.new("kvh_vmap *[]", [vm._ptr for vm in views] or [ffi.NULL])
        check(lib.kvh_attention_decode_vmap(p, arr, n, qp, op, prm))
    return out


def attention_prefill_vmap(
    engine: "Engine", views, q_lens, q: np.ndarray, *, out: Any = None, scale: float = 0.0, threads: int = 0
) -> np.ndarray:
    """Chunked causal prefill over views (``kvh_attention_prefill_vmap``): q
    is ``(sum(q_lens), num_q_heads, head_dim)``; equals
    :meth:`Engine.attention_prefill` bit for bit."""
    from .engine import _q_lens

    views = _views(views)
    lens = _q_lens(q_lens, len(views), "view")
    qp, op, out, hq, io = engine._attention_arrays("attention_prefill_vmap", q, sum(lens), out, None)
    prm = engine._attention_params(hq, scale, io, threads, None)
    ql = ffi.new("uint32_t[]", lens or [0])
    with engine._call(*(vm._gate.exclusive() for vm in views)) as p:
        arr = ffi.new("kvh_vmap *[]", [vm._ptr for vm in views] or [ffi.NULL])
        check(lib.kvh_attention_prefill_vmap(p, arr, ql, len(views), qp, op, prm))
    return out


__all__ = ["VMap", "attention_decode_vmap", "attention_prefill_vmap"]
