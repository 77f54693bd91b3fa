"""The retrieval interface the demo (and agents) use to turn "what will this
agent need next" into prefetch hints.

A *chunk index* maps chunk ids (each chunk is a cached kvh sequence, e.g. a
document passage whose KV is in the engine) to embedding vectors and answers
nearest-neighbour queries. :class:`NumpyChunkIndex` is the dependency-free
brute-force implementation. The Qdrant implementation lives in
``kvh_cache/retriever.py`` (when present); :func:`open_chunk_index` picks it up:

``kvh_cache/retriever.py`` must define ``open_chunk_index(kind: str, dim: int,
**options) -> ChunkIndex`` (raising ``ImportError`` / ``RuntimeError`` when
its backend is unavailable) and may define ``KINDS`` (tuple of the kind
names it serves, e.g. ``("qdrant",)``).

:class:`PrefetchPlanner` glues an index to an engine: given a query vector
it prefetches the sequences of the top hits, highest score first.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Dict, List, Mapping, Optional, Protocol, Sequence as Seq, Tuple, runtime_checkable

import numpy as np

__all__ = ["ChunkIndex", "NumpyChunkIndex", "open_chunk_index", "available_kinds", "PrefetchPlanner"]


@runtime_checkable
class ChunkIndex(Protocol):
    """What the demo needs from a vector index."""

    name: str
    dim: int

    def add(self, ids: Seq[int], vectors: np.ndarray, payloads: Optional[Seq[Mapping[str, Any]]] = None) -> None:
        """Adds (or replaces) chunks: ids (n,), vectors (n, dim) float32."""

    def search(self, vector: np.ndarray, limit: int = 4, *, agent: Optional[int] = None) -> List[Tuple[int, float]]:
        """The ``limit`` nearest chunks as (id, score), best first; ``agent``
        restricts to chunks whose payload has that agent, a list holding it,
        or no agent."""

    def close(self) -> None:
        """Releases the index (connections, files)."""


class NumpyChunkIndex:
    """Brute-force cosine similarity over a NumPy matrix (fine for the
    thousands of chunks a demo or a single agent holds)."""

    name = "numpy"

    def __init__(self, dim: int) -> None:
        from .engine import _int

        self.dim = dim = _int("dim", dim, 1, 1 << 31)
        self._ids: List[int] = []
        self._pos: Dict[int, int] = {}
        self._agents: List[Optional[frozenset]] = []
        self._mat = np.zeros((0, dim), np.float32)
        self._closed = False

    def add(self, ids: Seq[int], vectors: np.ndarray, payloads: Optional[Seq[Mapping[str, Any]]] = None) -> None:
        from .engine import _index

        self._check_open()
        keys = [_index("id", cid) for cid in ids]  # unsigned 64-bit, as Qdrant point ids
        vecs = np.asarray(vectors, np.float32)
        if vecs.ndim != 2 or vecs.shape[1] != self.dim or vecs.shape[0] != len(ids):
            raise ValueError(f"vectors must be shaped ({len(ids)}, {self.dim}), got {vecs.shape}")
        if not np.all(np.isfinite(vecs)):
            # A NaN row scored NaN against every query and broke the ranking.
            raise ValueError("vectors must be finite")
        if payloads is not None and len(payloads) != len(ids):
            raise ValueError(f"{len(payloads)} payloads for {len(ids)} ids")
        # Everything that can fail, before anything changes: a failed add
        # leaves the index as it was.
        agents = [_agent_set(p.get("agent")) for p in payloads] if payloads else [None] * len(ids)
        norms = np.linalg.norm(vecs, axis=1, keepdims=True)
        vecs = vecs / np.maximum(norms, 1e-12)
        new_rows = []
        base = len(self._ids)  # rows already in the matrix
        for i, cid in enumerate(keys):
            agent = agents[i]
            if cid in self._pos:  # an upsert: of a stored row, or of one added just now
                at = self._pos[cid]
                if at < base:
                    self._mat[at] = vecs[i]
                else:
                    new_rows[at - base] = vecs[i]
                self._agents[at] = agent
            else:
                self._pos[cid] = len(self._ids)  # the row it gets: after those before it
                new_rows.append(vecs[i])
                self._ids.append(cid)
                self._agents.append(agent)
        if new_rows:
            self._mat = np.vstack([self._mat, np.stack(new_rows)])

    def search(self, vector: np.ndarray, limit: int = 4, *, agent: Optional[int] = None) -> List[Tuple[int, float]]:
        from .engine import _index

        # limit=-1 used to rank all but one point, garbled; 1.5 a NumPy error.
        limit = _index("limit", limit)
        agent = None if agent is None else _index("agent", agent)
        self._check_open()
        q = np.asarray(vector, np.float32).reshape(-1)
        if q.shape[0] != self.dim:
            raise ValueError(f"query must have {self.dim} elements, got {q.shape[0]}")
        if not np.all(np.isfinite(q)):
            raise ValueError("the query vector must be finite")
        if not self._ids or limit == 0 or not np.any(q):  # a zero query is near nothing (as in Qdrant)
            return []
        q = q / max(float(np.linalg.norm(q)), 1e-12)
        scores = self._mat @ q
        if agent is not None:
            mask = np.array([a is None or agent in a for a in self._agents])
            scores = np.where(mask, scores, -np.inf)
        k = min(limit, len(self._ids))
        top = np.argpartition(-scores, k - 1)[:k]
        top = top[np.argsort(-scores[top])]
        return [(self._ids[i], float(scores[i])) for i in top if np.isfinite(scores[i])]

    def _check_open(self) -> None:
        if self._closed:
            from . import errors

            raise errors.ClosedError("the NumPy chunk index is closed", errors.STATUS_CODES["KVH_ERR_CLOSED"])

    def close(self) -> None:
        self._closed = True
        self._mat = np.zeros((0, self.dim), np.float32)
        self._ids.clear()
        self._pos.clear()
        self._agents.clear()

    def __len__(self) -> int:
        return len(self._ids)


def _agent_set(agent: Any) -> Optional[frozenset]:
    """The agents a payload's ``agent`` (an int, a list of them, or None: shared) names."""
    if agent is None:
        return None
    return (
        frozenset(int(a) for a in agent)
        if isinstance(agent, (list, tuple, set, frozenset))
        else frozenset([int(agent)])
    )


def _plugin():
    try:
        return importlib.import_module("kvh_cache.retriever")
    except ImportError:
        return None


def available_kinds() -> List[str]:
    kinds = ["numpy"]
    mod = _plugin()
    if mod is not None:
        kinds += [k for k in getattr(mod, "KINDS", ("qdrant",)) if k not in kinds]
    return kinds


def open_chunk_index(kind: str = "auto", dim: int = 64, **options: Any) -> ChunkIndex:
    """``"numpy"``: :class:`NumpyChunkIndex`. Any other kind goes to
    ``kvh_cache.retriever.open_chunk_index``. ``"auto"`` tries ``kvh_cache.retriever``
    (its default kind) and falls back to NumPy when it is missing or its
    backend is unavailable."""
    if kind == "numpy":
        return NumpyChunkIndex(dim)
    mod = _plugin()
    if mod is None or not hasattr(mod, "open_chunk_index"):
        if kind == "auto":
            return NumpyChunkIndex(dim)
        raise ValueError(
            f"retriever kind {kind!r} needs kvh_cache.retriever, which is not available "
            f"(available: {', '.join(available_kinds())})"
        )
    try:
        return mod.open_chunk_index(kind=kind, dim=dim, **options)
    except (ImportError, RuntimeError, OSError) as exc:
        if kind == "auto":
            # Said: a path given for a store that persists is not one now.
            logging.getLogger("kvh").warning(
                "kvh_cache.retrieval: the Qdrant chunk index could not be opened (%s); using an in-memory "
                "NumPy index instead, which keeps nothing across restarts",
                exc,
            )
            return NumpyChunkIndex(dim)
        raise


class PrefetchPlanner:
    """Turns a query vector into prefetch hints: the sequences of the
    ``limit`` nearest chunks are prefetched, the best hit with the highest
    priority. ``chunks`` maps chunk id -> kvh.Sequence."""

    def __init__(
        self, engine: Any, index: ChunkIndex, chunks: Mapping[int, Any], *, limit: int = 2, base_priority: int = 100
    ) -> None:
        self.engine = engine
        self.index = index
        self.chunks = chunks
        self.limit = limit
        self.base_priority = base_priority
        self.hints = 0

    def hint(self, vector: np.ndarray, *, agent: Optional[int] = None) -> List[int]:
        """Prefetches the predicted chunks; returns their ids, best first."""
        hits = self.index.search(vector, self.limit, agent=agent)
        out = []
        for rank, (cid, _score) in enumerate(hits):
            seq = self.chunks.get(cid)
            if seq is None:
                continue
            fence = self.engine.prefetch(seq, priority=self.base_priority - rank)
            fence.close()  # fire and forget: the promotion goes on
            self.hints += 1
            out.append(cid)
        return out
