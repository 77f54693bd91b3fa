"""Kept attention calls (``kvh_attention_plan_*``): plan a batch once, run it
many times. A run only launches kernels, so on the CUDA backend it can be
captured into a CUDA graph and replayed. The plan holds its blocks in the
device tier until :meth:`AttentionPlan.destroy`; it covers the tokens the
sequences had when it was made. Later writes into those tokens are seen
where they are made in place, not where a write goes to a copy (into a
full block that another sequence shares or that was written whole, the
copy-on-write of ``write_kv``); tokens appended later are not seen either:
make a new plan."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Sequence as Seq

from . import errors
from ._ffi import check, ffi, lib
from ._handle import GatedHandle, HandleGate, OwnedHandle
from .types import DType

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine, Sequence


class AttentionPlan(GatedHandle, OwnedHandle):
    """Made by :meth:`kvh.Engine.attention_plan`."""

    def __init__(
        self,
        engine: "Engine",
        layer: int,
        seqs: Seq["Sequence"],
        q_lens: Optional[List[int]],
        num_q_heads: int,
        io: DType,
        scale: float,
        threads: int,
    ) -> None:
        self._gate = HandleGate(lambda: errors.BadHandleError("the plan was destroyed", lib.KVH_ERR_BAD_HANDLE))
        self._engine = engine
        self._ptr = None  # the kvh_attention_plan *, once made
        hs, uses = engine._seq_array(seqs)
        n = len(uses)  # seqs may have been an iterator, now used up
        self._rows = sum(q_lens) if q_lens is not None else n
        self._num_q_heads = num_q_heads
        self._io = io
        prm = engine._attention_params(num_q_heads, scale, io, threads, None)
        ql = ffi.new("uint32_t[]", q_lens or [0]) if q_lens is not None else ffi.NULL
        out = ffi.new("kvh_attention_plan **")
        with engine._call(*uses) as p:
            check(lib.kvh_attention_plan_create(p, int(layer), hs, ql, n, prm, out))
        self._ptr = out[0]

    def run(self, q: Any, *, out: Any = None, stream: Any = None) -> Any:
        """Runs the plan: q shaped ``(rows, num_q_heads, head_dim)`` as at
        creation (decode: one row per sequence). Returns ``out``."""
        if self._gate.closed:
            raise errors.BadHandleError("the plan was destroyed", lib.KVH_ERR_BAD_HANDLE)
        eng = self._engine
        qp, op, out, hq, io = eng._attention_arrays("AttentionPlan.run", q, self._rows, out, self._io)
        if hq != self._num_q_heads:
            raise ValueError(f"q has {hq} heads; the plan was made for {self._num_q_heads}")
        st = ffi.NULL
        if stream is not None:
            st = ffi.cast("void *", eng._attention_params(hq, 0.0, io, 0, stream).stream)
        with self._call_any() as p:
            check(lib.kvh_attention_run(p, self._ptr, qp, op, st))
        return out

    def destroy(self) -> None:
        """Drops the plan's holds and frees it once runs in flight on other
        threads are done. Idempotent."""
        self._gate.close(self._destroy_native)

    def _destroy_native(self) -> None:
        if self._ptr is None:
            return
        try:
            with self._engine._call() as p:
                check(lib.kvh_attention_plan_destroy(p, self._ptr))
        except errors.ClosedError:
            pass  # the engine's close destroyed it

    close = destroy


__all__ = ["AttentionPlan"]
