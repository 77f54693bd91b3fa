"""External KV pools: an inference engine's own KV memory, which kvh reads
(offload) and writes (restore) in place by slot number, in batches that
run on kvh's migration workers.

The memory is described without copying and without importing any array
library: NumPy arrays through ``__array_interface__``, torch-like tensors
through ``data_ptr()``/``stride()``/``element_size()``, anything else
through DLPack (``__dlpack__``). kvh keeps raw pointers: the arrays must
outlive the pool (the :class:`Pool` keeps references to those it was
given).

    pool = kvh.Pool.from_arrays(eng, k_layers, v_layers)   # (slots, tokens, heads, dim) each
    batch = pool.offload([(slot, parent_hash, tokens)], scope=0)
    batch.wait()
    blocks = batch.blocks                                  # retained kvh.Block handles
    load = pool.restore(blocks, slots)                     # one fence per layer
    load.wait_layer(0); load.wait()
"""

from __future__ import annotations

import ctypes
import gc
import time
import weakref
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from . import errors
from ._ffi import U64_MAX, check, ffi, lib, status_name
from ._handle import ForkSafeLock, OwnedHandle, Uncopyable, interrupt_again
from .engine import _U32, Block, Engine, Fence, _flag, _index, _timeout_ns, _tokens
from .types import DType

__all__ = ["ArrayDesc", "describe", "Pool", "PoolDTypeError", "OffloadBatch", "RestoreBatch", "persist_blocks"]


@dataclass(frozen=True)
class ArrayDesc:
    """Where an array's elements are: base pointer, shape, strides in bytes,
    element size, whether the memory is the host's, whether it may be
    written (a read-only NumPy array or memory map may not), and the
    element type in NumPy's spelling (``"float16"``, ``"bfloat16"``,
    ``"int16"``, ...; None where the producer does not say)."""

    ptr: int
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]
    itemsize: int
    host: bool
    writable: bool = True
    dtype: Optional[str] = None


# DLPack's type codes (DLDataTypeCode) by the name they give with the bit width.
_DLPACK_KINDS = {0: "int", 1: "uint", 2: "float", 4: "bfloat", 5: "complex"}
_DLPACK_BOOL = 6

# Element types a pool of each engine dtype takes: bf16 as uint16 bit
# patterns (what the binding uses for bf16 NumPy arrays) or a bfloat16 type
# (torch.bfloat16, ml_dtypes.bfloat16, DLPack's bfloat).
_POOL_DTYPES = {
    DType.F32: frozenset({"float32"}),
    DType.F16: frozenset({"float16"}),
    DType.BF16: frozenset({"uint16", "bfloat16"}),
}


class PoolDTypeError(TypeError, ValueError):
    """Arrays whose element type is not the engine's. A TypeError, like a
    wrong dtype elsewhere in the binding; also a ValueError, which an
    element of the wrong size raised before element types were checked."""


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))),
]


def _dlpack_dtype(code: int, bits: int, lanes: int) -> Optional[str]:
    if lanes != 1:
        return None
    if code == _DLPACK_BOOL:
        return "bool"
    kind = _DLPACK_KINDS.get(code)
    return f"{kind}{bits}" if kind else None


def _element_type(dtype: Any) -> Optional[str]:
    """NumPy's name of a producer's dtype object: a NumPy dtype, or a
    torch-like one whose str() is "torch.float16"."""
    if dtype is None:
        return None
    if isinstance(dtype, (np.dtype, type)):
        try:
            npd = np.dtype(dtype)
        except TypeError:
            return None
        # Raw bytes ("void16") name no element type; extension types such
        # as ml_dtypes.bfloat16 name theirs.
        return None if npd.name.startswith("void") else npd.name
    return str(dtype).rsplit(".", 1)[-1] or None


def _from_dlpack(obj: Any) -> ArrayDesc:
    capsule = obj.__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    rename = ctypes.pythonapi.PyCapsule_SetName
    rename.restype, rename.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
    ptr = get(capsule, b"dltensor")
    m = ctypes.cast(ptr, ctypes.POINTER(_DLManagedTensor)).contents
    t = m.dl_tensor
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    itemsize = t.dtype.bits * t.dtype.lanes // 8
    if t.strides:
        strides = tuple(int(t.strides[i]) * itemsize for i in range(t.ndim))
    else:  # compact row-major
        acc, st = itemsize, []
        for n in reversed(shape):
            st.append(acc)
            acc *= n
        strides = tuple(reversed(st))
    desc = ArrayDesc(
        int(t.data or 0) + int(t.byte_offset),
        shape,
        strides,
        itemsize,
        t.device.device_type in (1, 3),
        dtype=_dlpack_dtype(t.dtype.code, t.dtype.bits, t.dtype.lanes),
    )
    # Consumed: the producer's memory stays alive through obj, which the
    # caller holds; the capsule's own reference is given back now.
    rename(capsule, b"used_dltensor")
    if m.deleter:
        m.deleter(ctypes.cast(ptr, ctypes.POINTER(_DLManagedTensor)))
    return desc


def describe(obj: Any) -> ArrayDesc:
    """The :class:`ArrayDesc` of a NumPy array, a torch-like tensor or any
    DLPack producer, without copying it or importing its library."""
    ai = getattr(obj, "__array_interface__", None)
    if ai is not None:
        shape = tuple(int(n) for n in ai["shape"])
        itemsize = np.dtype(ai["typestr"]).itemsize
        strides = ai.get("strides")
        if strides is None:  # C-contiguous
            acc, st = itemsize, []
            for n in reversed(shape):
                st.append(acc)
                acc *= n
            strides = tuple(reversed(st))
        read_only = bool(ai["data"][1])
        # An ndarray's own dtype names extension types (ml_dtypes.bfloat16)
        # that its typestr shows as raw bytes ("<V2").
        dtype = _element_type(obj.dtype if isinstance(obj, np.ndarray) else np.dtype(ai["typestr"]))
        return ArrayDesc(
            int(ai["data"][0]), shape, tuple(int(s) for s in strides), itemsize, True, not read_only, dtype
        )
    if callable(getattr(obj, "data_ptr", None)) and callable(getattr(obj, "stride", None)):
        itemsize = int(obj.element_size())
        dev = getattr(getattr(obj, "device", None), "type", "cpu")
        return ArrayDesc(
            int(obj.data_ptr()),
            tuple(int(n) for n in obj.shape),
            tuple(int(s) * itemsize for s in obj.stride()),
            itemsize,
            dev == "cpu",
            dtype=_element_type(getattr(obj, "dtype", None)),
        )
    if hasattr(obj, "__dlpack__"):
        return _from_dlpack(obj)
    raise TypeError(f"cannot describe a {type(obj).__name__}: no __array_interface__, data_ptr/stride or __dlpack__")


# Batches whose fences have not been seen complete: kvh writes their items'
# statuses into the xfer arrays, which must live until then even if the
# caller drops the batch object. Their engine's native object holds them,
# not a module-level table: an engine the caller dropped with a batch still
# running is then garbage together with it, and its close, which ends the
# batch, runs before the arrays go (collected objects' finalisers all run
# before any of them is cleared). Held by a table, it stayed open, its
# store locked, until a collection after the batch had ended.
_engines_with_batches: "weakref.WeakSet[Engine]" = weakref.WeakSet()
_inflight_lock = ForkSafeLock()


def _batches(engine: Engine) -> List[Any]:
    return engine._native.batches


def _track(engine: Engine, batch: Any) -> None:
    # The looks run outside the lock: a fence seen done runs its
    # callbacks, which may offload or restore again.
    with _inflight_lock:
        seen = list(_batches(engine))
    settled = {id(b) for b in seen if b._settled()}
    with _inflight_lock:
        live = _batches(engine)
        live[:] = [b for b in live if id(b) not in settled]
        live.append(batch)
        _engines_with_batches.add(engine)


def _untrack(engine: Engine, batch: Any) -> None:
    """A batch seen complete: its arrays are kvh's no more."""
    with _inflight_lock:
        live = _batches(engine)
        live[:] = [b for b in live if b is not batch]
        if not live:
            _engines_with_batches.discard(engine)


def _prune_after_gc(phase: str, info: Any) -> None:
    """Batches that ended unseen are let go when something looks: every
    collection does."""
    if phase != "stop" or not _engines_with_batches or not _inflight_lock.acquire(blocking=False):
        return
    try:
        seen = {engine: list(_batches(engine)) for engine in list(_engines_with_batches)}
    finally:
        _inflight_lock.release()
    try:
        # Outside the lock, as in _track: a fence's callbacks may run here.
        settled = {id(b) for batches in seen.values() for b in batches if _surely_settled(b)}
        if not _inflight_lock.acquire(blocking=False):
            return
        try:
            for engine in seen:
                live = _batches(engine)
                live[:] = [b for b in live if id(b) not in settled]
                if not live:
                    _engines_with_batches.discard(engine)
        finally:
            _inflight_lock.release()
    except KeyboardInterrupt:  # the interpreter would drop it here
        if interrupt_again() is None:
            raise  # to sys.unraisablehook
    except Exception:  # nothing may escape a collector callback
        pass


def _surely_settled(batch: Any) -> bool:
    """Settled, where a refused look (a collection inside a log handler, say)
    counts as not yet: arrays kvh may still write stay."""
    fences = batch.fences if isinstance(batch, RestoreBatch) else [batch.fence]
    try:
        return all(f.done() for f in fences)
    except errors.ClosedError:
        return True  # the engine is closed: its transfers ended with it
    except Exception:
        return False


gc.callbacks.append(_prune_after_gc)


def _xfers(n: int):
    x = ffi.new("kvh_pool_xfer[]", max(1, n))
    for i in range(n):
        x[i].struct_size = ffi.sizeof("kvh_pool_xfer")
    return x


class OffloadBatch(Uncopyable):
    """An offload in flight: :attr:`blocks` (retained kvh.Block handles, one
    per item, usable for persist at once) and :attr:`fence` (complete when
    every gather has ended). :meth:`statuses` after it completes."""

    def __init__(self, engine: Engine, xfers, n: int, fence: Fence, keep: Any) -> None:
        self._engine, self._x, self._n, self.fence, self._keep = engine, xfers, n, fence, keep
        self.blocks: List[Block] = [Block(engine, int(xfers[i].block.id), owned=True) for i in range(n)]

    def done(self) -> bool:
        return self._seen(self.fence.done())

    def _settled(self) -> bool:
        try:
            return self.fence.done()
        except errors.Error:
            return True

    def _seen(self, done: bool) -> bool:
        if done:
            _untrack(self._engine, self)
        return done

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Waits for the gathers; True when done. Item failures do not raise:
        see :meth:`statuses`."""
        return self._seen(self.fence.wait(timeout))

    def statuses(self) -> List[int]:
        """Each item's kvh_status (0 = ok); raises unless the batch is done."""
        if not self.fence.done():
            raise errors.BusyError("the batch is still running", lib.KVH_ERR_BUSY)
        return [int(self._x[i].status) for i in range(self._n)]

    def release(self) -> None:
        """Releases the block handles (the batch keeps what it still needs)."""
        for b in self.blocks:
            b.release()


class RestoreBatch(Uncopyable):
    """A restore in flight: one fence per layer, in order."""

    def __init__(self, xfers, n: int, fences: List[Fence], first_layer: int, keep: Any, engine: Any = None) -> None:
        self._x, self._n, self.fences, self.first_layer, self._keep = xfers, n, fences, first_layer, keep
        self._engine = engine

    def wait_layer(self, layer: int, timeout: Optional[float] = None) -> bool:
        """Waits until ``layer`` (an engine layer index) is in place in every
        item that did not fail."""
        layer = _index("layer", layer)
        last = self.first_layer + len(self.fences)
        if not self.first_layer <= layer < last:
            # An index below first_layer used to wrap to the last fence.
            raise ValueError(f"layer must be in [{self.first_layer}, {last}) (the batch's layers), got {layer}")
        return self.fences[layer - self.first_layer].wait(timeout)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Waits for every layer, ``timeout`` seconds in all (not per layer)."""
        ns = _timeout_ns("timeout", timeout)
        if ns == U64_MAX:
            return self._seen(all(f.wait(None) for f in self.fences))
        deadline = time.monotonic_ns() + ns
        return self._seen(all(f.wait(max(0, deadline - time.monotonic_ns()) / 1e9) for f in self.fences))

    def done(self) -> bool:
        return self._seen(self.fences[-1].done())

    def _seen(self, done: bool) -> bool:
        if done and self._engine is not None:
            _untrack(self._engine, self)
        return done

    def _settled(self) -> bool:
        try:
            return self.fences[-1].done()
        except errors.Error:
            return True

    def statuses(self) -> List[int]:
        """Each item's kvh_status (0 = ok); raises unless the batch is done."""
        if not self.done():
            raise errors.BusyError("the batch is still running", lib.KVH_ERR_BUSY)
        return [int(self._x[i].status) for i in range(self._n)]

    def failed(self) -> List[int]:
        """Indices of the items that failed (after :meth:`wait`)."""
        return [i for i, st in enumerate(self.statuses()) if st]


class Pool(OwnedHandle):
    """KV memory owned by an inference engine, registered with a kvh engine.
    Unregistered by :meth:`unregister`, a ``with`` block, or when collected
    (a batch keeps its pool alive until it ends)."""

    def __init__(self, engine: Engine, handle, num_slots: int, keep: Any = None, *, writable: bool = True) -> None:
        self._engine = engine
        self._lock = ForkSafeLock()  # the handle's swap in unregister
        self._h = handle
        self.num_slots = num_slots
        self._keep = keep
        #: False when some of the arrays are read-only: offload only.
        self.writable = writable

    @classmethod
    def from_pointers(
        cls,
        engine: Engine,
        k_ptrs: Sequence[int],
        v_ptrs: Sequence[int],
        num_slots: int,
        slot_stride: int,
        token_stride: int,
        head_stride: int,
        *,
        keep: Any = None,
        writable: bool = True,
    ) -> "Pool":
        """Registers host memory given as one K and one V base pointer per
        layer and byte strides (slot, token, head); ``keep`` is held to keep
        the memory alive. ``writable=False``: the memory may only be read
        (offload; a restore is refused)."""
        writable = bool(_flag("writable", writable))
        num_slots = _index("num_slots", num_slots, maximum=_U32)
        slot_stride = _index("slot_stride", slot_stride)
        token_stride = _index("token_stride", token_stride)
        head_stride = _index("head_stride", head_stride)
        if len(k_ptrs) != engine.num_layers or len(v_ptrs) != engine.num_layers:
            raise ValueError(f"need {engine.num_layers} K and V pointers, got {len(k_ptrs)} and {len(v_ptrs)}")
        # Addresses as ints only: int() would take "4096", 4096.5 or True.
        kb = ffi.new("void *[]", [ffi.cast("void *", _index(f"k_ptrs[{i}]", p)) for i, p in enumerate(k_ptrs)])
        vb = ffi.new("void *[]", [ffi.cast("void *", _index(f"v_ptrs[{i}]", p)) for i, p in enumerate(v_ptrs)])
        lay = ffi.new("kvh_pool_layout *")
        lay.struct_size = ffi.sizeof("kvh_pool_layout")
        lay.memory = lib.KVH_MEMORY_HOST
        lay.num_slots = num_slots
        lay.k_base, lay.v_base = kb, vb
        lay.slot_stride, lay.token_stride, lay.head_stride = slot_stride, token_stride, head_stride
        out = ffi.new("kvh_pool *")
        with engine._call() as p:
            check(lib.kvh_pool_register(p, lay, out))
        return cls(engine, out[0], num_slots, keep, writable=writable)

    @classmethod
    def from_arrays(cls, engine: Engine, k_layers: Sequence[Any], v_layers: Sequence[Any], *, heads_first=False):
        """Registers per-layer K and V arrays shaped (slots, tokens, heads,
        head_dim), or (slots, heads, tokens, head_dim) with
        ``heads_first=True``; any strides. NumPy arrays, torch tensors or
        DLPack producers (host memory); no copy. Read-only arrays (e.g. a
        memory map opened with mode="r") make an offload-only pool. Elements
        are the engine's dtype: float32, float16, or for bf16 uint16 bit
        patterns or a bfloat16 type; another raises :class:`PoolDTypeError`
        (a TypeError)."""
        ks = [describe(a) for a in k_layers]
        vs = [describe(a) for a in v_layers]
        if len(ks) != engine.num_layers or len(vs) != engine.num_layers:
            raise ValueError(f"need {engine.num_layers} K and V arrays, got {len(ks)} and {len(vs)}")
        d0 = ks[0]
        for d in ks + vs:
            if not d.host:
                raise ValueError("the pool's memory must be host memory here")
            accepted = _POOL_DTYPES[engine.dtype]
            if d.dtype is not None and d.dtype not in accepted:
                raise PoolDTypeError(
                    f"the arrays' dtype is {d.dtype}; the engine's dtype {engine.dtype.short} takes "
                    + " or ".join(sorted(accepted))
                )
            if len(d.shape) != 4 or d.shape != d0.shape or d.strides != d0.strides:
                raise ValueError(f"every layer's K and V must share one 4-d shape and strides, got {d.shape}")
            elems = 2 * engine.num_layers * engine.block_tokens * engine.num_kv_heads * engine.head_dim
            esize = engine.block_bytes // elems
            if d.shape[3] != engine.head_dim or d.itemsize != esize:
                raise ValueError(
                    f"head_dim {d.shape[3]} of {d.itemsize}-byte elements: the engine has {engine.head_dim} of {esize}"
                )
            if d.strides[3] != d.itemsize:
                raise ValueError("head_dim elements must be contiguous")
            if any(st < 0 for st in d.strides):
                raise ValueError(f"the arrays' strides must be positive (no reversed views), got {d.strides}")
        if not isinstance(heads_first, (bool, np.bool_)):
            # Read by truth, "False" or [0] would be on: the layout would be
            # transposed without a word.
            raise TypeError(f"heads_first must be a bool, not {type(heads_first).__name__}")
        tok_ax, head_ax = (2, 1) if heads_first else (1, 2)
        if d0.shape[tok_ax] != engine.block_tokens or d0.shape[head_ax] != engine.num_kv_heads:
            raise ValueError(
                f"shape {d0.shape}: need {engine.block_tokens} tokens and {engine.num_kv_heads} heads per slot"
            )
        return cls.from_pointers(
            engine,
            [d.ptr for d in ks],
            [d.ptr for d in vs],
            d0.shape[0],
            d0.strides[0],
            d0.strides[tok_ax],
            d0.strides[head_ax],
            keep=(list(k_layers), list(v_layers)),
            writable=all(d.writable for d in ks + vs),
        )

    def _handle(self):
        if self._h is None:
            raise errors.BadHandleError("the pool was unregistered", lib.KVH_ERR_BAD_HANDLE)
        return self._h

    def offload(self, items: Sequence[Tuple[int, int, Any]], *, scope: int = 0, agent: int = 0) -> OffloadBatch:
        """Offloads full blocks: items of (slot, parent_hash, tokens), tokens
        block_tokens ids each, hashed in ``scope``. Returns at once."""
        bt = self._engine.block_tokens
        scope = _index("scope", scope)
        agent = _index("agent", agent, maximum=_U32)
        items = list(items)
        n = len(items)
        x = _xfers(n)
        toks = []
        for i, item in enumerate(items):
            if not isinstance(item, (tuple, list)) or len(item) != 3:
                raise TypeError(f"items[{i}] must be a (slot, parent_hash, tokens) tuple")
            slot, parent, tokens = item
            # Token ids are checked like Sequence.append's: a float or an id
            # past int32 used to be cast, offloading the block under the
            # hash of other tokens.
            try:
                tk = _tokens(tokens)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"items[{i}]: {exc}") from None
            if tk.size != bt:
                raise ValueError(f"items[{i}]: tokens must hold block_tokens={bt} ids, got {tk.size}")
            toks.append(tk)
            x[i].slot = _index(f"items[{i}] slot", slot, maximum=_U32)
            x[i].parent_hash = _index(f"items[{i}] parent_hash", parent)
            x[i].scope = scope
            x[i].tokens = ffi.cast("const int32_t *", ffi.from_buffer(tk))
        fp = ffi.new("kvh_fence *")
        with self._engine._call() as p:
            check(lib.kvh_pool_offload_batch(p, self._handle(), x, n, agent, fp))
        # The batch keeps this pool (and so its arrays) alive: a worker
        # gathers from them until the fence completes.
        batch = OffloadBatch(self._engine, x, n, Fence(self._engine, fp), (toks, self))
        _track(self._engine, batch)
        return batch

    def restore(
        self, blocks: Sequence[Block], slots: Sequence[int], *, first_layer: int = 0, n_layers: Optional[int] = None
    ) -> RestoreBatch:
        """Restores blocks into slots (layers [first_layer, first_layer +
        n_layers), default all). Returns at once; one fence per layer."""
        if not self.writable:
            # kvh's workers would write into read-only pages (SIGSEGV).
            raise ValueError("the pool's arrays are read-only: it can offload, not restore")
        blocks, slots = list(blocks), list(slots)
        if len(blocks) != len(slots):
            raise ValueError(f"{len(blocks)} blocks for {len(slots)} slots")
        first_layer = _index("first_layer", first_layer, maximum=_U32)
        if n_layers is None:
            n_layers = max(0, self._engine.num_layers - first_layer)
        n_layers = _index("n_layers", n_layers, maximum=_U32)
        if first_layer + n_layers > self._engine.num_layers:
            raise errors.RangeError(
                f"layers [{first_layer}, {first_layer + n_layers}) pass num_layers={self._engine.num_layers}",
                lib.KVH_ERR_RANGE,
            )
        n = len(blocks)
        x = _xfers(n)
        for i, (b, s) in enumerate(zip(blocks, slots)):
            if not isinstance(b, Block):
                raise TypeError(f"blocks[{i}] must be a kvh.Block, not {type(b).__name__}")
            b._check_engine(self._engine)
            x[i].block.id = b.handle
            x[i].slot = _index(f"slots[{i}]", s, maximum=_U32)
        fences = ffi.new("kvh_fence[]", max(1, n_layers))
        # Through each block's gate: a released Block is BadHandleError,
        # even where its handle still names a live block.
        with self._engine._call(*(b._gate.shared() for b in blocks)) as p:
            check(lib.kvh_pool_restore_batch(p, self._handle(), x, n, first_layer, n_layers, fences))
        fs = []
        for i in range(n_layers):
            fp = ffi.new("kvh_fence *")
            fp[0] = fences[i]
            fs.append(Fence(self._engine, fp))
        # ... and writes into them until the last layer's fence completes.
        batch = RestoreBatch(x, n, fs, first_layer, (blocks, self), self._engine)
        _track(self._engine, batch)
        return batch

    def unregister(self) -> None:
        """Unregisters (waiting for batches running on it). Idempotent; a
        no-op once the engine is closed (its close unregistered the pool)."""
        with self._lock:
            h, self._h = self._h, None
        if h is not None:
            try:
                with self._engine._call() as p:
                    check(lib.kvh_pool_unregister(p, h))
            except errors.ClosedError:
                pass

    close = unregister

    def _check_usable(self) -> None:
        self._handle()

    def _close_at_gc(self) -> None:
        if getattr(self, "_h", None) is not None:  # made: the constructor ran
            self.unregister()


def persist_blocks(engine: Engine, blocks: Sequence[Block], *, wait: bool = True) -> Optional[Fence]:
    """Makes blocks durable on the disk tier (``kvh_blocks_persist``): in
    the call with ``wait=True``, else returns a Fence at once. Blocks of an
    offload still gathering are waited for."""
    wait = bool(_flag("wait", wait))
    n = len(blocks)
    arr = ffi.new("kvh_block[]", max(1, n))
    for i, b in enumerate(blocks):
        if not isinstance(b, Block):
            raise TypeError(f"blocks[{i}] must be a kvh.Block, not {type(b).__name__}")
        b._check_engine(engine)
        arr[i].id = b.handle
    fp = None if wait else ffi.new("kvh_fence *")
    with engine._call(*(b._gate.shared() for b in blocks)) as p:
        check(lib.kvh_blocks_persist(p, arr, n, fp if fp is not None else ffi.NULL))
    return None if fp is None else Fence(engine, fp)


def status_names(statuses: Sequence[int]) -> List[str]:
    """Names of kvh_status values (for messages)."""
    return [status_name(s) for s in statuses]
