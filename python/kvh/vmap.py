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

import threading
from typing import TYPE_CHECKING, Any, Tuple

import numpy as np

from . import errors
from ._ffi import check, ffi, lib
from ._handle import OwnedHandle

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine, Sequence


class _ArrayOwner:
    """Base object of a view array: keeps the VMap mapped while it lives."""

    def __init__(self, vm: "VMap", addr: int, shape: Tuple[int, ...], strides: Tuple[int, ...]) -> None:
        self._vm = vm
        self.__array_interface__ = {"version": 3, "shape": shape, "typestr": vm._np_dtype.str,
                                    "data": (addr, True), "strides": strides}
        vm._arrays_add()

    def __del__(self) -> None:
        try:
            self._vm._arrays_drop()
        except Exception:
            pass


class VMap(OwnedHandle):
    """One layer of a sequence as contiguous K and V (see the module doc)."""

    def __init__(self, seq: "Sequence", layer: int, capacity_tokens: int = 0) -> None:
        self._engine: Engine = seq.engine
        self._np_dtype = self._engine.np_dtype
        self._lock = threading.Lock()
        self._arrays = 0
        self._released = False
        self._freed = False
        out = ffi.new("kvh_vmap **")
        p = seq._enter()
        try:
            check(lib.kvh_seq_vmap(p, seq._h[0], int(layer), int(capacity_tokens), out))
        finally:
            seq._leave()
        self._ptr = out[0]
        self._engine._native.add_view()  # type: ignore[union-attr]  # close waits for us

    # ---- state ----
    def _view(self):
        if self._released:
            raise errors.BadHandleError("the view was released", lib.KVH_ERR_BAD_HANDLE)
        v = ffi.new("kvh_vmap_view *")
        v.struct_size = ffi.sizeof("kvh_vmap_view")
        with self._engine._call() as p:
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
        v = self._view()
        H, D = self._engine.num_kv_heads, self._engine.head_dim
        es = self._np_dtype.itemsize
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
        if self._released:
            raise errors.BadHandleError("the view was released", lib.KVH_ERR_BAD_HANDLE)
        changed = ffi.new("int32_t *")
        with self._engine._call() as p:
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
            self._free()

    def _free(self) -> None:
        with self._lock:
            if self._freed:
                return
            self._freed = True
        native = self._engine._native
        try:
            if native is not None and not native.released:
                p = native.enter()
                try:
                    lib.kvh_vmap_release(p, self._ptr)
                finally:
                    native.leave()
        except errors.ClosedError:
            pass
        finally:
            if native is not None:
                native.drop_view()

    def release(self) -> None:
        """Unmaps the view (once no array taken from it is alive) and drops
        its holds. Idempotent."""
        with self._lock:
            if self._released:
                return
            self._released = True
            last = self._arrays == 0
        if last:
            self._free()

    close = release


def attention_decode_vmap(engine: "Engine", views, q: np.ndarray, *, out: Any = None, scale: float = 0.0,
                          threads: int = 0) -> np.ndarray:
    """Decode attention over views (``kvh_attention_decode_vmap``): q is
    ``(len(views), num_q_heads, head_dim)``; equals
    :meth:`Engine.attention_decode` on the same sequences bit for bit."""
    views = list(views)
    n = len(views)
    qp, op, out, hq, io = engine._attention_arrays("attention_decode_vmap", q, n, out, None)
    prm = engine._attention_params(hq, scale, io, threads, None)
    arr = ffi.new("kvh_vmap *[]", [vm._ptr for vm in views] or [ffi.NULL])
    for vm in views:
        if vm._released:
            raise errors.BadHandleError("a view was released", lib.KVH_ERR_BAD_HANDLE)
    with engine._call() as p:
        check(lib.kvh_attention_decode_vmap(p, arr, n, qp, op, prm))
    return out


def attention_prefill_vmap(engine: "Engine", views, q_lens, q: np.ndarray, *, out: Any = None,
                           scale: float = 0.0, threads: int = 0) -> np.ndarray:
    """Chunked causal prefill over views (``kvh_attention_prefill_vmap``): q
    is ``(sum(q_lens), num_q_heads, head_dim)``; equals
    :meth:`Engine.attention_prefill` bit for bit."""
    views = list(views)
    lens = [int(x) for x in q_lens]
    if len(lens) != len(views):
        raise ValueError(f"q_lens has {len(lens)} entries, expected one per view ({len(views)})")
    qp, op, out, hq, io = engine._attention_arrays("attention_prefill_vmap", q, sum(lens), out, None)
    prm = engine._attention_params(hq, scale, io, threads, None)
    arr = ffi.new("kvh_vmap *[]", [vm._ptr for vm in views] or [ffi.NULL])
    ql = ffi.new("uint32_t[]", lens or [0])
    for vm in views:
        if vm._released:
            raise errors.BadHandleError("a view was released", lib.KVH_ERR_BAD_HANDLE)
    with engine._call() as p:
        check(lib.kvh_attention_prefill_vmap(p, arr, ql, len(views), qp, op, prm))
    return out


__all__ = ["VMap", "attention_decode_vmap", "attention_prefill_vmap"]
