"""Speculative retriever: predict the document chunks an agent needs next and
move their KV toward the device tier before the agent asks.

How it fits together::

    documents --chunk--> token ids --kv_fn--> KV in kvh (prefix index: content hash)
                             |                         ^
                             +--embed--> Qdrant point  |  prefetch(priority)
                                          (payload:    |
                                           tokens,     |
                                           block hashes)
    agent context (+ draft continuation) --embed--> Qdrant top-k --> hints

* **Storage.** A chunk's KV is computed once by ``kv_fn(seq, tokens)`` (the
  model runner's prefill, or the deterministic :class:`SyntheticKV`) into a
  kvh sequence. Its full blocks are content-addressed by kvh's prefix index
  (the chained block hash over the token ids and the model salt), so
  ``Sequence.match_prefix(tokens)`` finds them again in any tier, including
  on disk after a restart once :meth:`SpeculativeRetriever.persist` made
  them durable (close does not). The chunk id is that chain hash (continued over
  a partial tail block), so the same tokens always get the same id.
* **Index.** Each chunk's embedding goes into a Qdrant collection, with the
  chunk record in the point payload (id, token ids, token count, doc id,
  position, text, block hashes, model salt, embedder, agents, and the
  caller's ``meta`` under a key of its own). :class:`QdrantChunkIndex` uses
  ``qdrant-client``: embedded local mode (a directory on disk, no server)
  by default, or a Qdrant server / cluster by URL through the same code.
  ``index="numpy"`` is the dependency-free fallback
  (:class:`kvh_cache.retrieval.NumpyChunkIndex`).
* **Prediction.** :meth:`SpeculativeRetriever.prefetch` embeds the agent's
  recent context (the last ``context_chars`` characters, in segments
  weighted toward the most recent; with a draft model configured, its
  projected continuation is one more segment), asks the index for the
  ``top_k`` nearest chunks and issues ``engine.prefetch`` hints for those
  not already resident, the best hit with the highest priority.
  :meth:`~SpeculativeRetriever.prefetch_async` does the same on a
  background thread so the agent's own work overlaps the prediction.
* **Accounting.** Each prediction opens a *window* for its agent that the
  agent's next prediction closes. Chunks the agent acquires (or reports
  with :meth:`~SpeculativeRetriever.note_use`) inside the window are its
  *used* set. precision = |predicted ∩ used| / |predicted|, recall =
  |predicted ∩ used| / |used|, summed over closed windows. kvh's own
  counters (``prefetch_issued/useful/late/wasted/skipped``,
  ``acquire_stall_ns``, hits per tier) are reported as deltas since the
  retriever was created (they are engine-wide).

This module is also the Qdrant plugin of :mod:`kvh_cache.retrieval`: it defines
``KINDS`` and ``open_chunk_index(kind, dim, **options)``.

Environment: ``KVH_QDRANT_URL`` (a server used when neither ``url`` nor
``path`` is given), ``KVH_QDRANT_PATH`` (the embedded store's directory),
``KVH_QDRANT_API_KEY``; ``KVH_EMBEDDER`` (see :func:`kvh_cache.embed.open_embedder`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import numbers
import os
import shutil
import statistics
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait as futures_wait
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence as Seq, Set, Tuple, Union

import numpy as np

from ._handle import Closable, OwnedHandle
from .embed import DEFAULT_DIM, WordTokenizer, open_embedder
from . import errors
from .engine import _U32, _flag, _index, _int, _real, _tokens
from .retrieval import NumpyChunkIndex

__all__ = [
    "KINDS",
    "open_chunk_index",
    "QdrantChunkIndex",
    "SpeculativeRetriever",
    "ChunkRecord",
    "Prediction",
    "PrefetchResult",
    "RetrieverMetrics",
    "SyntheticKV",
    "model_kv_fn",
    "qdrant_available",
    "demo_chunk_index",
    "PAYLOAD_VERSION",
]

log = logging.getLogger("kvh.retriever")

#: Kinds :func:`open_chunk_index` serves besides ``numpy`` (for kvh_cache.retrieval).
KINDS = ("qdrant",)
DEFAULT_COLLECTION = "kvh_chunks"
#: Version of the payload schema of chunk points.
PAYLOAD_VERSION = 1
_PIP_HINT = "pip install qdrant-client (or pip install 'kvh-cache[retriever]')"
_MASK64 = (1 << 64) - 1


# ---------------------------------------------------------------------------------
# Qdrant index
# ---------------------------------------------------------------------------------
def _qdrant():
    """(QdrantClient, models) or ImportError with the pip name."""
    try:
        from qdrant_client import QdrantClient, models
    except ImportError as exc:
        raise ImportError(
            f"the Qdrant chunk index needs qdrant-client ({_PIP_HINT}); "
            f"or choose the NumPy index (index='numpy' / --retriever numpy): {exc}"
        ) from exc
    return QdrantClient, models


def qdrant_available() -> bool:
    """True when ``qdrant-client`` can be imported."""
    try:
        _qdrant()
        return True
    except ImportError:
        return False


def _point_id(cid: Any) -> int:
    if isinstance(cid, bool) or not isinstance(cid, (int, np.integer)):
        raise TypeError(f"chunk ids must be ints (Qdrant point ids are unsigned 64-bit), not {type(cid).__name__}")
    v = int(cid)
    if not 0 <= v <= _MASK64:
        raise ValueError(f"chunk id {v} is not an unsigned 64-bit int")
    return v


class QdrantChunkIndex(OwnedHandle):
    """A chunk index in a Qdrant collection (cosine distance).

    Where it lives, first match wins: ``url`` (a Qdrant server or cluster,
    e.g. ``http://localhost:6333``; ``api_key`` for Qdrant Cloud), ``path``
    (embedded local mode: a directory on disk, no server; reopening the
    same path finds the points again), ``$KVH_QDRANT_URL``,
    ``$KVH_QDRANT_PATH``, else a temporary directory removed on
    :meth:`close`.

    ``collection`` is created when missing; an existing one must have
    vectors of size ``dim`` unless ``recreate=True`` (which empties it).
    The embedded mode locks its directory: a second client on the same
    path (another process) gets RuntimeError.

    Implements :class:`kvh_cache.retrieval.ChunkIndex` (``add``, ``search``,
    ``close``) plus ``has``, ``get``, ``scroll``, ``count`` and ``delete``.
    Thread-safe (one lock around the client).
    """

    name = "qdrant"

    def __init__(
        self,
        dim: int,
        *,
        path: Optional[str] = None,
        url: Optional[str] = None,
        api_key: Optional[str] = None,
        collection: Optional[str] = None,
        recreate: bool = False,
        prefer_grpc: bool = False,
        timeout: Optional[float] = None,
        batch_size: int = 256,
    ) -> None:
        recreate = bool(_flag("recreate", recreate))
        prefer_grpc = bool(_flag("prefer_grpc", prefer_grpc))
        QdrantClient, models = _qdrant()
        self._models = models
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim <= 0:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        self.dim = int(dim)
        self.collection = collection or DEFAULT_COLLECTION
        self.batch_size = max(1, int(batch_size))
        self._lock = threading.RLock()
        self._tmp: Optional[str] = None
        self._client = None
        url = url or (None if path else os.environ.get("KVH_QDRANT_URL") or None)
        if url is None and path is None:
            path = os.environ.get("KVH_QDRANT_PATH") or None
        if url is not None:
            self.mode = "server"
            self.location = url
            api_key = api_key or os.environ.get("KVH_QDRANT_API_KEY") or None
            kw: Dict[str, Any] = {"url": url, "prefer_grpc": prefer_grpc}
            if api_key:
                kw["api_key"] = api_key
            if timeout is not None:
                kw["timeout"] = int(timeout) if float(timeout).is_integer() else timeout
            try:
                # qdrant-client's own version check runs on a thread of its own and only warns; an
                # unreachable server is reported here, clearly, and the versions are compared below
                try:
                    self._client = QdrantClient(**kw, check_compatibility=False)
                except TypeError:  # qdrant-client without check_compatibility
                    self._client = QdrantClient(**kw)
                self._client.get_collections()  # fail now, clearly, when the server is not there
            except Exception as exc:  # noqa: BLE001 - connection errors come in many classes
                self._close_client()
                raise RuntimeError(f"cannot reach the Qdrant server at {url}: {exc}") from exc
            self._check_versions()
        else:
            self.mode = "local"
            if path is None:
                self._tmp = tempfile.mkdtemp(prefix="kvh-qdrant-")
                path = self._tmp
            self.location = os.fspath(path)
            try:
                if not self.location:
                    raise ValueError("the path is empty")
                os.makedirs(self.location, exist_ok=True)  # a file there: FileExistsError, reported below
                self._client = QdrantClient(path=self.location)
            except RuntimeError:
                self._cleanup_tmp()
                raise  # e.g. "Storage folder ... is already accessed by another instance"
            except Exception as exc:  # noqa: BLE001
                self._cleanup_tmp()
                raise RuntimeError(f"cannot open the embedded Qdrant store at {self.location}: {exc}") from exc
        try:
            self._ensure_collection(recreate)
        except BaseException:
            self.close()
            raise

    def _check_versions(self) -> None:
        """Warns (log) when client and server versions are too far apart
        (major differs or minor by more than 1, qdrant-client's rule)."""
        try:
            from importlib.metadata import version

            mine = version("qdrant-client")
            theirs = str(self._client.info().version)
            a = [int(x) for x in mine.split(".")[:2]]
            b = [int(x) for x in theirs.split(".")[:2]]
        except Exception:  # noqa: BLE001 - no version to compare: nothing to say
            return
        if a[0] != b[0] or abs(a[1] - b[1]) > 1:
            log.warning(
                "kvh_cache.retriever: qdrant-client %s may not work with Qdrant server %s at %s",
                mine,
                theirs,
                self.location,
            )

    # ---- lifetime ----
    def _close_client(self) -> None:
        c, self._client = self._client, None
        if c is not None:
            try:
                c.close()
            except Exception:  # noqa: BLE001
                pass

    def _cleanup_tmp(self) -> None:
        t, self._tmp = self._tmp, None
        if t is not None:
            shutil.rmtree(t, ignore_errors=True)

    def close(self) -> None:
        """Closes the client (and removes the temporary store, if any). Idempotent."""
        with self._lock:
            self._close_client()
            self._cleanup_tmp()

    @property
    def closed(self) -> bool:
        return self._client is None

    def __repr__(self) -> str:
        return (
            f"<kvh_cache.retriever.QdrantChunkIndex {self.mode} {self.location!r} collection={self.collection!r} "
            f"dim={self.dim}>"
        )

    def _c(self):
        if self._client is None:
            raise errors.ClosedError("the Qdrant chunk index is closed", errors.STATUS_CODES["KVH_ERR_CLOSED"])
        return self._client

    def _ensure_collection(self, recreate: bool) -> None:
        m = self._models
        c = self._c()
        exists = c.collection_exists(self.collection)
        if exists and recreate:
            c.delete_collection(self.collection)
            exists = False
        if exists:
            params = c.get_collection(self.collection).config.params.vectors
            size = getattr(params, "size", None)
            if size is None and isinstance(params, Mapping):  # named vectors: not ours
                raise RuntimeError(
                    f"Qdrant collection {self.collection!r} uses named vectors; kvh needs a collection "
                    "with one unnamed vector (choose another collection or recreate=True)"
                )
            if int(size) != self.dim:
                raise RuntimeError(
                    f"Qdrant collection {self.collection!r} at {self.location} holds {size}-dim "
                    f"vectors, the embedder makes {self.dim}-dim ones (choose another collection, the "
                    "same embedder, or recreate=True to empty it)"
                )
            return
        c.create_collection(self.collection, vectors_config=m.VectorParams(size=self.dim, distance=m.Distance.COSINE))

    # ---- ChunkIndex ----
    def add(self, ids: Seq[int], vectors: np.ndarray, payloads: Optional[Seq[Mapping[str, Any]]] = None) -> None:
        """Upserts points: ids (unsigned 64-bit ints), vectors (n, dim),
        payloads (JSON-able dicts) or None."""
        ids = [_point_id(i) for i in ids]
        vecs = np.asarray(vectors, np.float32)
        if vecs.ndim != 2 or vecs.shape != (len(ids), self.dim):
            raise ValueError(f"vectors must be shaped ({len(ids)}, {self.dim}), got {vecs.shape}")
        if payloads is not None and len(payloads) != len(ids):
            raise ValueError(f"got {len(payloads)} payloads for {len(ids)} ids")
        if not np.all(np.isfinite(vecs)):
            raise ValueError("vectors must be finite")
        m = self._models
        with self._lock:
            c = self._c()
            for i in range(0, len(ids), self.batch_size):
                j = i + self.batch_size
                batch = m.Batch(
                    ids=ids[i:j],
                    vectors=vecs[i:j].tolist(),
                    payloads=[dict(p) for p in payloads[i:j]] if payloads is not None else None,
                )
                c.upsert(self.collection, points=batch, wait=True)

    def _filter(self, agent: Optional[int]):
        if agent is None:
            return None
        m = self._models
        return m.Filter(
            should=[
                m.FieldCondition(key="agent", match=m.MatchValue(value=int(agent))),
                m.IsEmptyCondition(is_empty=m.PayloadField(key="agent")),
            ]
        )

    def search(self, vector: np.ndarray, limit: int = 4, *, agent: Optional[int] = None) -> List[Tuple[int, float]]:
        """The ``limit`` nearest points as (id, cosine score), best first;
        ``agent`` keeps points whose payload has that agent or none."""
        return [(pid, score) for pid, score, _ in self.search_payloads(vector, limit, agent=agent, with_payload=False)]

    def search_payloads(
        self, vector: np.ndarray, limit: int = 4, *, agent: Optional[int] = None, with_payload: bool = True
    ) -> List[Tuple[int, float, Optional[Dict[str, Any]]]]:
        with_payload = bool(_flag("with_payload", with_payload))
        # Checked as NumpyChunkIndex checks them: the two are interchangeable.
        limit = _index("limit", limit)
        agent = None if agent is None else _index("agent", agent)
        q = np.asarray(vector, np.float32).reshape(-1)
        if q.shape[0] != self.dim:
            raise ValueError(f"query must have {self.dim} elements, got {q.shape[0]}")
        if not np.all(np.isfinite(q)):
            raise ValueError("the query vector must be finite")
        if limit == 0 or not np.any(q):
            return []
        with self._lock:
            c = self._c()
            flt = self._filter(agent)
            if hasattr(c, "query_points"):
                res = c.query_points(
                    self.collection,
                    query=q.tolist(),
                    limit=int(limit),
                    query_filter=flt,
                    with_payload=with_payload,
                    with_vectors=False,
                ).points
            else:  # qdrant-client < 1.10
                res = c.search(
                    self.collection,
                    query_vector=q.tolist(),
                    limit=int(limit),
                    query_filter=flt,
                    with_payload=with_payload,
                )
        return [(int(p.id), float(p.score), p.payload if with_payload else None) for p in res]

    # ---- more than ChunkIndex ----
    def has(self, ids: Iterable[int]) -> Set[int]:
        """Which of ids are in the collection."""
        ids = [_point_id(i) for i in ids]
        if not ids:
            return set()
        with self._lock:
            recs = self._c().retrieve(self.collection, ids=ids, with_payload=False, with_vectors=False)
        return {int(r.id) for r in recs}

    def get(self, ids: Iterable[int]) -> Dict[int, Dict[str, Any]]:
        """Payloads of the ids that exist."""
        ids = [_point_id(i) for i in ids]
        if not ids:
            return {}
        with self._lock:
            recs = self._c().retrieve(self.collection, ids=ids, with_payload=True, with_vectors=False)
        return {int(r.id): dict(r.payload or {}) for r in recs}

    def scroll(self, batch: int = 256) -> Iterator[Tuple[int, Dict[str, Any]]]:
        """Every point as (id, payload)."""
        offset = None
        while True:
            with self._lock:
                recs, offset = self._c().scroll(
                    self.collection, limit=batch, offset=offset, with_payload=True, with_vectors=False
                )
            for r in recs:
                yield int(r.id), dict(r.payload or {})
            if offset is None:
                return

    def count(self) -> int:
        with self._lock:
            return int(self._c().count(self.collection, exact=True).count)

    def __len__(self) -> int:
        return self.count()

    def delete(self, ids: Iterable[int]) -> None:
        ids = [_point_id(i) for i in ids]
        if ids:
            with self._lock:
                self._c().delete(self.collection, points_selector=self._models.PointIdsList(points=ids), wait=True)


def open_chunk_index(kind: str = "auto", dim: int = DEFAULT_DIM, **options: Any):
    """A chunk index (the :mod:`kvh_cache.retrieval` plugin entry point).

    ``kind``: ``"qdrant"`` or ``"auto"`` → :class:`QdrantChunkIndex`
    (options: ``path``, ``url``, ``api_key``, ``collection``, ``recreate``,
    ``prefer_grpc``, ``timeout``); ``"numpy"`` →
    :class:`kvh_cache.retrieval.NumpyChunkIndex`. ImportError (with the pip name)
    when qdrant-client is missing, RuntimeError when the store or server
    cannot be used."""
    k = (kind or "auto").strip().lower()
    if k == "numpy":
        return NumpyChunkIndex(dim)
    if k in ("auto", "qdrant", "qdrant-local", "qdrant-server"):
        opts = {key: v for key, v in options.items() if v is not None}
        return QdrantChunkIndex(dim, **opts)
    raise ValueError(f"unknown chunk index kind {kind!r}: expected 'qdrant', 'numpy' or 'auto'")


def demo_chunk_index(kind: str, dim: int, qdrant_url: Optional[str] = None, *, collection: str = "kvh_demo"):
    """The chunk index of ``kvh demo``: ``kind`` as ``--retriever`` takes it
    (auto | numpy | qdrant). With ``qdrant_url`` the demo talks to that
    server (collection ``kvh_demo``, emptied first) and a failure is an
    error, not a silent fallback to NumPy."""
    from . import retrieval

    if qdrant_url:
        if kind == "numpy":
            raise ValueError("--qdrant-url needs the Qdrant retriever, not --retriever numpy")
        return open_chunk_index("qdrant", dim, url=qdrant_url, collection=collection, recreate=True)
    return retrieval.open_chunk_index(kind, dim=dim)


# ---------------------------------------------------------------------------------
# KV writers
# ---------------------------------------------------------------------------------
class SyntheticKV:
    """A stand-in for a model's prefill: ``kv(seq, tokens)`` appends
    ``tokens`` to ``seq`` and writes K/V for every layer that are a
    deterministic function of (token id, position, layer, head, dim), so
    they can be regenerated and checked (:meth:`expected`, :meth:`check`).
    Writes happen while the new tokens are held in the device tier (like a
    chunked prefill), the whole range at once when it fits, else block by
    block."""

    def __init__(self, engine: Any, seed: int = 0) -> None:
        self.H, self.D, self.L = engine.num_kv_heads, engine.head_dim, engine.num_layers
        self.dtype = engine.dtype
        self.seed = int(seed)
        self._h = np.arange(self.H, dtype=np.int64)[None, :, None]
        self._d = np.arange(self.D, dtype=np.int64)[None, None, :]

    def expected(self, tokens: np.ndarray, first_pos: int, layer: int) -> Tuple[np.ndarray, np.ndarray]:
        from .types import DType, f32_to_bf16

        tok = np.asarray(tokens, np.int64)[:, None, None]
        pos = (first_pos + np.arange(len(tokens), dtype=np.int64))[:, None, None]
        x = (tok * 7919 + pos * 31 + (layer + 1) * 131 + self.seed * 17 + self._h * 67 + self._d) % 509
        k = (x.astype(np.float32) / np.float32(254.5)) - np.float32(1.0)
        v = (((x * 3 + 101) % 509).astype(np.float32) / np.float32(254.5)) - np.float32(1.0)
        if self.dtype == DType.F16:
            return k.astype(np.float16), v.astype(np.float16)
        if self.dtype == DType.BF16:
            return f32_to_bf16(k), f32_to_bf16(v)
        return k, v

    def _write(self, seq: Any, tokens: np.ndarray, pos: int) -> None:
        for layer in range(self.L):
            k, v = self.expected(tokens, pos, layer)
            seq.write_kv(layer, pos, k, v)

    def __call__(self, seq: Any, tokens: Any) -> None:
        from . import errors

        tokens = np.asarray(tokens, np.int32)
        if tokens.size == 0:
            return
        pos0 = len(seq)
        seq.append(tokens)
        try:
            with seq.acquire(pos0, len(tokens)):
                self._write(seq, tokens, pos0)
            return
        except errors.NoSpaceError:
            pass  # the range does not fit the device tier at once: block by block
        bt = seq.engine.block_tokens
        pos = pos0
        end = pos0 + len(tokens)
        while pos < end:
            take = min(bt - pos % bt, end - pos)
            with seq.acquire(pos, take):
                self._write(seq, tokens[pos - pos0 : pos - pos0 + take], pos)
            pos += take

    def check(self, seq: Any, tokens: Any, layer: int = 0, first_pos: int = 0) -> bool:
        """True when the K/V of ``tokens`` at ``first_pos`` of ``seq`` are
        what :meth:`__call__` wrote."""
        tokens = np.asarray(tokens, np.int32)
        k, v = seq.read_kv(layer, first_pos, len(tokens))
        ek, ev = self.expected(tokens, first_pos, layer)
        return bool(np.array_equal(k, ek) and np.array_equal(v, ev))


def model_kv_fn(runner: Any, *, chunk: int = 64) -> Callable[[Any, np.ndarray], None]:
    """``kv_fn`` that prefills the chunk with a :class:`kvh_cache.model.Runner`
    (its K/V computed by the real model; the engine must have the runner's
    geometry: ``runner.engine()`` or ``kvh.Engine(**runner.engine_config())``)."""

    def kv(seq: Any, tokens: np.ndarray) -> None:
        runner.prefill(seq, [int(t) for t in tokens], chunk=chunk)

    return kv


# ---------------------------------------------------------------------------------
# records, predictions, metrics
# ---------------------------------------------------------------------------------
@dataclass
class ChunkRecord:
    """One chunk: its content id (the kvh prefix-hash chain of its tokens),
    token ids, text and origin. ``block_hashes``: kvh prefix hashes of its
    full blocks (0 for a partial tail block). ``agent``: the agent that
    added it first (None: shared); ``agents``: every agent that added it
    privately, the agents whose filtered searches keep it (empty once any
    add was without an agent: shared)."""

    chunk_id: int
    tokens: np.ndarray
    text: str = ""
    doc: Optional[str] = None
    index: Optional[int] = None
    agent: Optional[int] = None
    block_hashes: List[int] = field(default_factory=list)
    meta: Dict[str, Any] = field(default_factory=dict)
    agents: List[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.agent is not None and not self.agents:
            self.agents = [self.agent]

    def __eq__(self, other: object) -> bool:
        # the generated == compared the token arrays with ==, which raised ValueError
        if not isinstance(other, ChunkRecord):
            return NotImplemented
        return all(
            getattr(self, f.name) == getattr(other, f.name) for f in dataclasses.fields(self) if f.name != "tokens"
        ) and bool(np.array_equal(self.tokens, other.tokens))

    @property
    def n_tokens(self) -> int:
        return int(len(self.tokens))

    def payload(self, *, model_salt: int, block_tokens: int, embedder: str) -> Dict[str, Any]:
        # meta stays apart: keys such as "doc" or "agent" must not be overwritten by the record's
        p: Dict[str, Any] = {"meta": dict(self.meta)}
        p.update(
            {
                "kvh": PAYLOAD_VERSION,
                "chunk_id": f"{self.chunk_id:016x}",
                "doc": self.doc,
                "index": self.index,
                "text": self.text,
                "tokens": [int(t) for t in self.tokens],
                "n_tokens": self.n_tokens,
                "block_tokens": int(block_tokens),
                "block_hashes": [f"{h:016x}" for h in self.block_hashes],
                "model_salt": f"{model_salt & _MASK64:016x}",
                "embedder": embedder,
            }
        )
        if self.agents:  # one agent as an int (as before), several as a list (first adder first): filters match either
            p["agent"] = int(self.agents[0]) if len(self.agents) == 1 else [int(a) for a in self.agents]
        else:
            p.pop("agent", None)
        return p

    @classmethod
    def from_payload(cls, chunk_id: int, payload: Mapping[str, Any]) -> "ChunkRecord":
        known = {
            "meta",
            "kvh",
            "chunk_id",
            "doc",
            "index",
            "text",
            "tokens",
            "n_tokens",
            "block_tokens",
            "block_hashes",
            "model_salt",
            "embedder",
            "agent",
        }
        agent = payload.get("agent")
        agents = [int(a) for a in agent] if isinstance(agent, list) else [] if agent is None else [int(agent)]
        meta = payload.get("meta")
        if not isinstance(meta, Mapping):  # payloads written before meta had a key of its own
            meta = {k: v for k, v in payload.items() if k not in known}
        return cls(
            chunk_id=int(chunk_id),
            tokens=np.asarray(payload.get("tokens", []), np.int32),
            text=str(payload.get("text") or ""),
            doc=payload.get("doc"),
            index=payload.get("index"),
            agent=agents[0] if agents else None,
            agents=agents,
            block_hashes=[int(h, 16) for h in payload.get("block_hashes", [])],
            meta=dict(meta),
        )


@dataclass(frozen=True)
class Prediction:
    """A chunk predicted to be needed next (rank 0 = best)."""

    chunk_id: int
    score: float
    rank: int


@dataclass
class PrefetchResult:
    """What one :meth:`SpeculativeRetriever.prefetch` did. ``hinted``:
    chunks for which a prefetch hint was issued; ``resident``: predicted
    chunks already in the device tier (no hint needed); ``fences``: one per
    hint (wait with :meth:`wait`); ``seconds``: time to embed, query and
    hint."""

    agent: Optional[int]
    predictions: List[Prediction]
    hinted: List[int]
    resident: List[int]
    fences: List[Any]
    seconds: float
    _fences_freed: bool = field(default=False, repr=False, compare=False)

    @property
    def chunk_ids(self) -> List[int]:
        return [p.chunk_id for p in self.predictions]

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Waits for the hinted promotions; True when all are done.
        ClosedError after :meth:`close` (freed fences cannot tell)."""
        if self._fences_freed:
            raise errors.ClosedError(
                "the prefetch result is closed: its fences are freed", errors.STATUS_CODES["KVH_ERR_CLOSED"]
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        ok = True
        for f in self.fences:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ok = f.wait(left) and ok
        return ok

    def close(self) -> None:
        """Frees the fences (the promotions go on)."""
        self._fences_freed = True
        for f in self.fences:
            f.close()


@dataclass
class RetrieverMetrics:
    """Prediction quality and prefetch counters (see the module doc)."""

    windows: int = 0
    predicted: int = 0
    used: int = 0
    hits: int = 0
    unwindowed_uses: int = 0
    predictions: int = 0
    chunks_hinted: int = 0
    chunks_resident: int = 0
    predict_seconds_total: float = 0.0
    predict_seconds_p50: float = 0.0
    predict_seconds_p99: float = 0.0
    kvh: Dict[str, int] = field(default_factory=dict)

    @property
    def precision(self) -> float:
        return self.hits / self.predicted if self.predicted else 0.0

    @property
    def recall(self) -> float:
        return self.hits / self.used if self.used else 0.0

    def to_dict(self) -> Dict[str, Any]:
        d = {
            k: getattr(self, k)
            for k in (
                "windows",
                "predicted",
                "used",
                "hits",
                "unwindowed_uses",
                "predictions",
                "chunks_hinted",
                "chunks_resident",
                "predict_seconds_total",
                "predict_seconds_p50",
                "predict_seconds_p99",
            )
        }
        d["precision"] = self.precision
        d["recall"] = self.recall
        d["kvh"] = dict(self.kvh)
        return d


class _Window:
    __slots__ = ("agent", "predicted", "used")

    def __init__(self, agent: Optional[int]) -> None:
        self.agent = agent
        self.predicted: Optional[Set[int]] = None  # None until the (async) prediction is done
        self.used: Set[int] = set()


_KVH_COUNTERS = (
    "prefetch_issued",
    "prefetch_useful",
    "prefetch_late",
    "prefetch_wasted",
    "prefetch_skipped",
    "acquire_stall_ns",
    "lookups",
    "hits_device",
    "hits_host",
    "hits_disk",
    "evictions",
    "blocks_host_to_device",
    "blocks_disk_to_host",
    "bytes_host_to_device",
    "bytes_disk_to_host",
)


# ---------------------------------------------------------------------------------
# the retriever
# ---------------------------------------------------------------------------------
def _agent_arg(agent: Any) -> Optional[int]:
    """An agent argument: None or an unsigned 32-bit int (1.5 or 'z' named a window no agent has)."""
    return None if agent is None else _index("agent", agent, maximum=_U32)


_PRIORITY_MIN, _PRIORITY_MAX = -(1 << 31), (1 << 31) - 1
_RETRIEVER_CLOSED = "the retriever is closed"


def _plain(name: str, value: Any) -> Any:
    """value with NumPy scalars and arrays made Python values, checked to
    be JSON-able: a point payload must be (Qdrant refused np.int64 at the
    upsert)."""

    def conv(v: Any) -> Any:
        if isinstance(v, np.generic):
            return v.item()
        if isinstance(v, np.ndarray):
            return v.tolist()
        if isinstance(v, Mapping):
            return {str(k): conv(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        return v

    out = conv(value)
    try:
        json.dumps(out, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be JSON-able (it goes into the point payload): {exc}") from None
    return out


def _other_text(
    held: ChunkRecord, text: str, doc: Any, same_words: Optional[Callable[[ChunkRecord, str], Any]]
) -> None:
    """A chunk is added again with other text than the one it is held with.
    same_words(held, text) (add_document): True when both are the same words
    (only their form differs: nothing to tell), False when they are other
    words with the same ids (a tokenizer collision: refused), None when the
    held text is not its tokens' words (default or a label: it is kept)."""
    same = same_words(held, text) if same_words is not None else None
    if same:
        return
    if same is not None:
        raise ValueError(
            f"chunk {held.chunk_id:#x} of document {doc!r} has the token ids of a chunk already held with other "
            f"text ({held.text[:60]!r} of {held.doc!r}, now {text[:60]!r}): the tokenizer gives different text "
            "the same ids (for WordTokenizer, a larger vocab_size); nothing of this document was added"
        )
    log.warning(
        "kvh_cache.retriever: chunk %#x is held with text %r; adding it with other text %r keeps the held one",
        held.chunk_id,
        held.text[:60],
        text[:60],
    )


def _same_words(tok: Any, held: ChunkRecord, text: str) -> Optional[bool]:
    """Whether held's text and text (a document's chunk of the same ids) are
    the same words by tok; None when held's text is not its tokens' words
    (the tokens as text, or a label): it cannot show a collision."""
    held_ids = held.tokens.tolist()
    if hasattr(tok, "split") and hasattr(tok, "token"):
        pieces = tok.split(held.text)
        if [int(tok.token(p)) for p in pieces] != held_ids:
            return None
        return pieces == tok.split(text)
    try:
        if [int(t) for t in tok.encode(held.text)] != held_ids:
            return None
    except Exception:  # noqa: BLE001 - a text the tokenizer refuses is not its tokens' words
        return None
    return "".join(held.text.split()) == "".join(text.split())  # decode may space words otherwise


def _share(rec: ChunkRecord, agent: Optional[int]) -> bool:
    """Widens who sees rec for an add of it by ``agent`` (None: everyone).
    True when that changed anything."""
    if not rec.agents or (agent is not None and agent in rec.agents):
        return False
    if agent is None:
        rec.agent, rec.agents = None, []
    else:
        rec.agents = rec.agents + [agent]
    return True


class SpeculativeRetriever(Closable):
    """Chunks in kvh + embeddings in a chunk index + prefetch hints.

    ``engine``: the :class:`kvh.Engine` holding the chunks' KV.
    ``index``: ``"qdrant"`` (default: embedded local mode; ``qdrant_path``
    for a persistent directory, ``qdrant_url`` for a server), ``"numpy"``,
    ``"auto"`` (Qdrant when qdrant-client is installed, else NumPy with a
    warning), or an index object (``add``/``search``/``close``).
    ``embedder``: spec or object (:func:`kvh_cache.embed.open_embedder`).
    ``kv_fn(seq, tokens)``: appends ``tokens`` to ``seq`` and writes their
    K/V (default :class:`SyntheticKV`; :func:`model_kv_fn` for a model).
    ``top_k``: chunks predicted per call. ``context_chars``: how much of
    the end of the context is embedded (0: all of it), in
    ``segment_chars`` segments weighted 1, ``decay``, ``decay``², ...
    from the most recent (0: one segment). ``draft(text) -> str``: optional projected continuation,
    embedded as one more segment of weight ``draft_weight`` (or pass
    ``draft_text`` to :meth:`prefetch`). ``base_priority``: hint
    priority of the best hit (rank r gets ``base_priority - r``; an int32
    of at least ``-2**31 + top_k - 1``, so that every rank is one).
    ``min_score``: predictions scoring below are dropped.
    ``chunk_agent``: kvh agent the chunk sequences are charged to.
    ``filter_agents``: searches keep chunks added with that ``agent`` or
    with none (default: every chunk is shared); a chunk several agents
    add is kept for each of them, and for all once it is added without
    one. ``tokenizer``: for
    :meth:`add_document` (default :class:`kvh_cache.embed.WordTokenizer`).

    The default ``kv_fn`` writes deterministic stand-in values (tests,
    benchmarks, the demo); real K/V come from a model::

        eng = runner.engine(device_bytes=..., disk_path=..., disk_bytes=...)
        with SpeculativeRetriever(eng, kv_fn=model_kv_fn(runner), tokenizer=runner.tokenizer,
                                  qdrant_path="/var/lib/kvh/qdrant") as r:
            r.add_document("manual", text, chunk_tokens=256)
            ...
            r.prefetch_async(agent_context, agent=1)   # after each step
            with r.acquire(chunk_id, agent=1): ...     # when the agent needs it
            r.metrics()                                 # precision, recall, kvh counters
    """

    def __init__(
        self,
        engine: Any,
        *,
        index: Any = "qdrant",
        embedder: Any = "auto",
        kv_fn: Optional[Callable[[Any, np.ndarray], None]] = None,
        tokenizer: Any = None,
        top_k: int = 4,
        context_chars: int = 1536,
        segment_chars: int = 256,
        decay: float = 0.5,
        draft: Optional[Callable[[str], str]] = None,
        draft_weight: float = 1.0,
        base_priority: int = 1000,
        min_score: Optional[float] = None,
        chunk_agent: int = 0,
        qdrant_path: Optional[str] = None,
        qdrant_url: Optional[str] = None,
        collection: Optional[str] = None,
        recreate: bool = False,
        filter_agents: bool = False,
    ) -> None:
        from .engine import Engine

        if not isinstance(engine, Engine):
            raise TypeError(f"engine must be a kvh.Engine, not {type(engine).__name__}")
        recreate = bool(_flag("recreate", recreate))
        filter_agents = bool(_flag("filter_agents", filter_agents))
        top_k = _int("top_k", top_k, 1, _U32)
        # 0 means the whole context / one segment; a negative count has no meaning
        context_chars = _int("context_chars", context_chars, 0, 1 << 63)
        segment_chars = _int("segment_chars", segment_chars, 0, 1 << 63)
        decay = _real("decay", decay, 0.0, 1.0)
        draft_weight = _real("draft_weight", draft_weight)
        # rank r is hinted at base_priority - r: every rank of top_k must stay an int32
        base_priority = _int("base_priority", base_priority, _PRIORITY_MIN, _PRIORITY_MAX)
        if base_priority - (top_k - 1) < _PRIORITY_MIN:
            raise ValueError(
                f"top_k {top_k} with base_priority {base_priority} hints ranks below the int32 minimum: "
                f"top_k must be at most {base_priority - _PRIORITY_MIN + 1} "
                f"(or base_priority at least {_PRIORITY_MIN + top_k - 1})"
            )
        chunk_agent = _index("chunk_agent", chunk_agent, maximum=_U32)
        if min_score is not None:
            min_score = _real("min_score", min_score)
        if draft is not None and not callable(draft):
            raise TypeError("draft must be a callable text -> text")
        if kv_fn is not None and not callable(kv_fn):
            raise TypeError("kv_fn must be a callable (sequence, tokens) -> None")
        if tokenizer is not None and not (
            (hasattr(tokenizer, "encode") and hasattr(tokenizer, "decode"))
            or (hasattr(tokenizer, "split") and hasattr(tokenizer, "token"))
        ):
            raise TypeError("tokenizer must have encode() and decode(), or be a kvh_cache.embed.WordTokenizer")
        self.engine = engine
        self.embedder = open_embedder(embedder)
        if not isinstance(getattr(self.embedder, "name", None), str):
            # stored with every point: load() tells the vectors of other embedders apart by it
            raise TypeError("an embedder object needs a name (str): it is stored with each point")
        self._own_index = isinstance(index, str)
        if isinstance(index, str):
            kind = index.strip().lower()
            if kind == "auto":
                try:
                    index = open_chunk_index(
                        "qdrant",
                        self.embedder.dim,
                        path=qdrant_path,
                        url=qdrant_url,
                        collection=collection,
                        recreate=recreate,
                    )
                except ImportError as exc:
                    log.warning("kvh_cache.retriever: %s; using the NumPy index", exc)
                    index = NumpyChunkIndex(self.embedder.dim)
            else:
                index = open_chunk_index(
                    kind, self.embedder.dim, path=qdrant_path, url=qdrant_url, collection=collection, recreate=recreate
                )
        elif not (hasattr(index, "add") and hasattr(index, "search")):
            raise TypeError("index must be 'qdrant', 'numpy', 'auto' or an object with add() and search()")
        if getattr(index, "dim", self.embedder.dim) != self.embedder.dim:
            raise ValueError(f"index dim {index.dim} != embedder dim {self.embedder.dim}")
        self.index = index
        self.kv_fn = kv_fn if kv_fn is not None else SyntheticKV(engine)
        self.tokenizer = tokenizer if tokenizer is not None else WordTokenizer()
        self.top_k = top_k
        self.context_chars = context_chars
        self.segment_chars = segment_chars
        self.decay = decay
        self.draft = draft
        self.draft_weight = draft_weight
        self.base_priority = base_priority
        self.min_score = min_score
        self.chunk_agent = chunk_agent
        self.filter_agents = filter_agents
        self.model_salt = int(engine.config.model_salt or 0)
        self._lock = threading.RLock()
        self._attach_lock = threading.Lock()
        self._add_lock = threading.RLock()  # adds of one chunk must not race (one record, one payload)
        self._records: Dict[int, ChunkRecord] = {}
        self._seqs: Dict[int, Any] = {}
        self._blocks: Dict[int, List[Any]] = {}
        self._windows: Dict[Optional[int], _Window] = {}
        self._closed: List[_Window] = []
        self._unwindowed = 0
        self._n_predictions = 0
        self._hinted = 0
        self._resident = 0
        self._latencies: List[float] = []
        self._executor: Optional[ThreadPoolExecutor] = None
        self._worker: Optional[int] = None  # ident of the executor's one thread, once it ran
        self._pending: List[Future] = []
        self.reused_tokens = 0
        self.computed_tokens = 0
        self._skipped_ids: Set[int] = set()
        self._stats0 = engine.stats()
        self._is_closed = False

    # ---- lifetime ----
    def close(self) -> None:
        """Cancels the background predictions that have not started (their
        futures are cancelled), waits for the one running, frees the chunk
        sequences (their full blocks stay cached in kvh's prefix index)
        and closes the index when the retriever opened it. Idempotent."""
        with self._lock:  # prefetch_async checks and starts its executor under it
            if self._is_closed:
                return
            self._is_closed = True
            ex, self._executor = self._executor, None
        if ex is not None:
            # queued predictions would only run their embedding to fail with
            # ClosedError. From a future's done callback (the worker itself,
            # no prediction running) there is no thread to wait for.
            ex.shutdown(wait=not self._on_worker(), cancel_futures=True)
            # shutdown cancels without notifying: concurrent.futures.wait (drain) would
            # never count them done. No worker is left to notify them instead.
            with self._lock:
                pending = list(self._pending)
            for f in pending:
                if f.cancelled():
                    try:
                        f.set_running_or_notify_cancel()
                    except RuntimeError:  # notified already
                        pass
        with self._attach_lock, self._lock:  # no chunk is being attached now, nor later
            seqs = list(self._seqs.values())
            self._seqs.clear()
            self._blocks.clear()
        if not self.engine.closed:
            for s in seqs:
                s.free()
        if self._own_index:
            try:
                self.index.close()
            except Exception:  # noqa: BLE001
                pass

    def __repr__(self) -> str:
        return (
            f"<kvh_cache.retriever.SpeculativeRetriever chunks={len(self._records)} "
            f"index={getattr(self.index, 'name', '?')} embedder={self.embedder.name} top_k={self.top_k}>"
        )

    def _check_open(self) -> None:
        if self._is_closed:
            raise errors.ClosedError(_RETRIEVER_CLOSED, errors.STATUS_CODES["KVH_ERR_CLOSED"])

    _check_usable = _check_open  # ``with retriever:`` after close raises ClosedError

    def _check_live(self) -> None:
        """The retriever and its engine are open: a prediction over chunks
        whose KV is gone would name chunks no one can acquire."""
        self._check_open()
        if self.engine.closed:
            raise errors.ClosedError("the engine is closed", errors.STATUS_CODES["KVH_ERR_CLOSED"])

    def __len__(self) -> int:
        return len(self._records)

    @property
    def skipped_points(self) -> int:
        """How many distinct points of the index were left out (by :meth:`load`
        or a search) as not of this model, embedder or payload version, or
        malformed."""
        with self._lock:
            return len(self._skipped_ids)

    @property
    def chunk_ids(self) -> List[int]:
        with self._lock:
            return list(self._records)

    def record(self, chunk_id: int) -> ChunkRecord:
        chunk_id = _index("chunk_id", chunk_id)
        with self._lock:
            rec = self._records.get(chunk_id)
        if rec is None:
            raise KeyError(f"unknown chunk {chunk_id:#x}")
        return rec

    # ---- content ids ----
    def content_id(self, tokens: Any) -> int:
        """The chunk id of ``tokens``: kvh's chained prefix hash of the full
        blocks (the hash kvh stores the last full block under), continued
        over a partial tail block with BLAKE2b (over the block size too: a
        chunk shorter than a block has no full block to tell the engines
        of two block sizes apart). Ids of chunks with a partial tail made
        before the block size was hashed no longer match their tokens, so
        :meth:`load` leaves those points out and an add upserts them anew."""
        tk = _tokens(tokens)
        if tk.size == 0:
            raise ValueError("a chunk needs at least one token (1-D token ids)")
        bt = self.engine.block_tokens
        h = 0
        full = tk.size // bt
        for b in range(full):
            h = self.engine.prefix_hash(tk[b * bt : (b + 1) * bt], h)
        if tk.size % bt:
            d = hashlib.blake2b(digest_size=8, person=b"kvh-chunk-tail")
            d.update(h.to_bytes(8, "little"))
            d.update((self.model_salt & _MASK64).to_bytes(8, "little"))
            d.update(int(bt).to_bytes(8, "little"))
            d.update(tk[full * bt :].tobytes())
            h = int.from_bytes(d.digest(), "little")
        return h

    # ---- adding chunks ----
    def _materialise(self, rec: ChunkRecord) -> Any:
        """The chunk's sequence: attach what kvh has cached (any tier),
        compute the rest with kv_fn."""
        seq = self.engine.sequence(agent=self.chunk_agent)
        try:
            matched = seq.match_prefix(rec.tokens)
            if matched < rec.n_tokens:
                self.kv_fn(seq, rec.tokens[matched:])
            if len(seq) != rec.n_tokens or not np.array_equal(seq.tokens(), rec.tokens):
                raise RuntimeError(
                    f"kv_fn must append exactly the {rec.n_tokens - matched} tokens it is given "
                    f"(the chunk sequence has {len(seq)} tokens, expected {rec.n_tokens})"
                )
            blocks = seq.blocks()
            hashes = [b.info().hash for b in blocks]
        except BaseException:
            seq.free()
            raise
        self.reused_tokens += matched
        self.computed_tokens += rec.n_tokens - matched
        rec.block_hashes = hashes
        return seq, blocks

    def add_chunks(self, items: Iterable[Mapping[str, Any]]) -> List[ChunkRecord]:
        """Adds chunks: each item a mapping with ``tokens`` (token ids) and
        optionally ``text`` (what is embedded; default: the tokens as
        text), ``doc``, ``index``, ``agent``, ``meta`` (doc, index and meta
        go into the point payload: JSON-able, NumPy values are made Python
        ones, anything else is a TypeError). Computes the KV of
        new chunks (reusing whatever kvh has cached under their content
        hash), embeds them in one batch and upserts their points. Returns
        the records in order (an already known chunk returns its existing
        record; given with other text, it keeps its own, with a warning
        logged). All or nothing: when any step fails (kv_fn, the embedder,
        the index, no space), the new chunks of the call are dropped again
        and their sequences freed, so a retry adds them afresh. Adds are
        serialised: concurrent adds of one chunk get the same record."""
        self._check_open()
        with self._add_lock:
            return self._add_chunks(items)

    def _add_chunks(
        self, items: Iterable[Mapping[str, Any]], *, same_words: Optional[Callable[[ChunkRecord, str], Any]] = None
    ) -> List[ChunkRecord]:
        """same_words (add_document): tells a known chunk whose text has other words from one
        whose text only differs in form (see _other_text)."""
        out: List[ChunkRecord] = []
        new: Dict[int, Tuple[ChunkRecord, Any, List[Any]]] = {}
        shared: Dict[int, ChunkRecord] = {}  # known chunks more agents see now: their payload changes
        try:
            parsed = []
            for it in items:
                # Checked like Sequence.append's: floats or ids past int32 were
                # cast, storing the chunk under other tokens.
                tokens = _tokens(it["tokens"])
                cid = self.content_id(tokens)
                agent = _agent_arg(it.get("agent"))
                text = it.get("text")
                if text is None:
                    text = " ".join(map(str, tokens.tolist()))
                elif not isinstance(text, str):  # bytes were embedded as "b'...'"
                    raise TypeError(f"text must be str or None, not {type(text).__name__}")
                try:
                    text.encode("utf-8")  # a lone surrogate failed in the embedder or the payload
                except UnicodeEncodeError as exc:
                    raise ValueError(f"text must be encodable as UTF-8: {exc}") from None
                parsed.append((it, tokens, cid, agent, text))
            # one index round trip for the whole call, not one per new chunk
            present: Optional[Set[int]] = set() if hasattr(self.index, "get") else None
            found = self._known_many([p[2] for p in parsed], present)
            for it, tokens, cid, agent, text in parsed:
                held = new[cid][0] if cid in new else found.get(cid)
                if held is not None and it.get("text") is not None and held.text != text:
                    _other_text(held, text, it.get("doc"), same_words)
                if cid in new:
                    _share(new[cid][0], agent)
                    out.append(new[cid][0])
                    continue
                if held is not None:
                    self.sequence(cid)  # attach a loaded chunk (kept on failure: it is indexed already)
                    wider = shared.get(cid) or dataclasses.replace(held, agents=list(held.agents))
                    if _share(wider, agent):
                        shared[cid] = wider
                    out.append(held)
                    continue
                rec = ChunkRecord(
                    chunk_id=cid,
                    tokens=tokens,
                    text=text,
                    doc=_plain("doc", it.get("doc")),
                    index=_plain("index", it.get("index")),
                    agent=agent,
                    meta=_plain("meta", dict(it.get("meta") or {})),
                )
                with self._attach_lock:
                    self._check_open()
                    seq, blocks = self._materialise(rec)
                new[cid] = (rec, seq, blocks)
                out.append(rec)
            if new or shared:
                self._index_records([rec for rec, _, _ in new.values()] + list(shared.values()), present)
            with self._attach_lock, self._lock:
                self._check_open()  # a close meanwhile freed what it knew of: these are not known yet
                for cid, wider in shared.items():
                    self._records[cid].agent, self._records[cid].agents = wider.agent, wider.agents
                for cid, (rec, seq, blocks) in new.items():
                    self._records[cid] = rec
                    self._seqs[cid] = seq
                    self._blocks[cid] = blocks
        except BaseException as exc:
            for _, seq, _ in new.values():
                if not self.engine.closed:
                    seq.free()
            if self._is_closed and isinstance(exc, Exception) and getattr(exc, "message", None) != _RETRIEVER_CLOSED:
                # a close meanwhile closed the index (or the engine) under this add:
                # that is the cause, not how the index failed on it
                raise errors.ClosedError(_RETRIEVER_CLOSED, errors.STATUS_CODES["KVH_ERR_CLOSED"]) from exc
            raise
        return out

    def add_chunk(
        self,
        tokens: Any,
        text: Optional[str] = None,
        *,
        doc: Optional[str] = None,
        index: Optional[int] = None,
        agent: Optional[int] = None,
        meta: Optional[Mapping[str, Any]] = None,
    ) -> ChunkRecord:
        """One chunk (see :meth:`add_chunks`)."""
        return self.add_chunks(
            [{"tokens": tokens, "text": text, "doc": doc, "index": index, "agent": agent, "meta": meta}]
        )[0]

    def add_document(
        self,
        doc: str,
        text: str,
        *,
        chunk_tokens: int = 256,
        tokenizer: Any = None,
        agent: Optional[int] = None,
        meta: Optional[Mapping[str, Any]] = None,
    ) -> List[ChunkRecord]:
        """Splits ``text`` into chunks of ``chunk_tokens`` tokens (a multiple
        of the engine's block_tokens keeps every block durable and
        findable by content) and adds them. ``tokenizer``: an object with
        ``encode``/``decode`` (a model tokenizer) or a
        :class:`kvh_cache.embed.WordTokenizer` (the default). ValueError,
        adding nothing, when a chunk gets the token ids of a chunk held
        with other words (the tokenizer maps different words to one id):
        returning the held chunk would drop this one silently. A held
        chunk whose text differs only in form (spacing), or whose text is
        not its tokens' words (none given, or a label), is returned."""
        chunk_tokens = _int("chunk_tokens", chunk_tokens, 1, 1 << 63)
        if not isinstance(text, str):
            raise TypeError(f"text must be str, not {type(text).__name__}")
        tok = tokenizer if tokenizer is not None else self.tokenizer
        items: List[Dict[str, Any]] = []
        if hasattr(tok, "split") and hasattr(tok, "token"):
            pieces = tok.split(text)
            for i, start in enumerate(range(0, len(pieces), chunk_tokens)):
                part = pieces[start : start + chunk_tokens]
                items.append(
                    {
                        "tokens": [tok.token(p) for p in part],
                        "text": " ".join(part),
                        "doc": doc,
                        "index": i,
                        "agent": agent,
                        "meta": meta,
                    }
                )
        elif hasattr(tok, "encode") and hasattr(tok, "decode"):
            ids = [int(t) for t in tok.encode(text)]
            for i, start in enumerate(range(0, len(ids), chunk_tokens)):
                part = ids[start : start + chunk_tokens]
                items.append(
                    {"tokens": part, "text": tok.decode(part), "doc": doc, "index": i, "agent": agent, "meta": meta}
                )
        else:
            raise TypeError("tokenizer must have encode() and decode(), or be a kvh_cache.embed.WordTokenizer")
        self._check_open()
        with self._add_lock:
            return self._add_chunks(items, same_words=functools.partial(_same_words, tok))

    def _index_records(self, recs: List[ChunkRecord], present: Optional[Set[int]] = None) -> None:
        """Embeds and upserts recs (a point of the same id that is not a
        record of this model and embedder is replaced). On failure the
        points this call created are deleted again where the index can.
        ``present``: the ids of recs the index held before, when known
        (saves asking it)."""
        ids = [r.chunk_id for r in recs]
        has, delete = getattr(self.index, "has", None), getattr(self.index, "delete", None)
        before = None
        if delete is not None:
            before = present if present is not None else has(ids) if has is not None else None
        try:
            vecs = self.embedder.embed([r.text for r in recs])
            bt = self.engine.block_tokens
            name = self.embedder.name
            payloads = [r.payload(model_salt=self.model_salt, block_tokens=bt, embedder=name) for r in recs]
            self.index.add(ids, vecs, payloads)
        except BaseException:
            if before is not None:
                try:
                    delete([i for i in ids if i not in before])
                except Exception as exc:  # noqa: BLE001 - the first error is the one to report
                    log.debug("kvh_cache.retriever: cannot delete the points of a failed add: %s", exc)
            raise

    def load(self) -> int:
        """Reads the chunk records of this model and embedder (same
        model_salt, block_tokens and embedder name) back from a persistent
        index (e.g. a Qdrant path or server after a restart). Their KV is
        attached lazily, on the first prediction or acquire, from wherever
        kvh has it (disk included) and recomputed with kv_fn where it is
        gone. Points of other versions, models or embedders are left out,
        and so are points whose payload does not parse or whose tokens do
        not hash to their id (counted in :attr:`skipped_points`, logged).
        Returns how many records are known now. Needs an index with
        ``scroll`` (Qdrant)."""
        scroll = getattr(self.index, "scroll", None)
        if scroll is None:
            raise TypeError(f"the {getattr(self.index, 'name', 'given')} index cannot list its points (no scroll)")
        with self._lock:
            bad = 0
            for pid, payload in scroll():
                rec = self._record_from_payload(pid, payload)
                if rec is None:
                    bad += 1
                elif pid not in self._records:
                    self._records[pid] = rec
            if bad:
                log.info("kvh_cache.retriever: load left out %d points of other models/embedders or malformed", bad)
            return len(self._records)

    def _record_from_payload(self, pid: int, payload: Mapping[str, Any]) -> Optional[ChunkRecord]:
        """The record of a point, or None (counted in skipped_points) when
        it is not a chunk of this model and embedder or does not parse."""
        why = self._foreign(payload)
        rec = None
        if why is None:
            try:
                tokens = _tokens(payload["tokens"])  # checked as given: not cast to int32
                rec = ChunkRecord.from_payload(pid, payload)
                rec.tokens = tokens
                if self.content_id(tokens) != pid:
                    why, rec = "tokens that do not hash to its id", None
            except (TypeError, ValueError, OverflowError, AttributeError) as exc:
                why = f"a payload that does not parse ({exc})"
        if rec is None:
            with self._lock:
                self._skipped_ids.add(int(pid))
            log.debug("kvh_cache.retriever: point %#x left out: %s", pid, why)
        return rec

    def _foreign(self, payload: Mapping[str, Any]) -> Optional[str]:
        """Why a point belongs to another version, model or embedder (None: it is ours)."""
        if not isinstance(payload, Mapping) or payload.get("kvh") != PAYLOAD_VERSION or "tokens" not in payload:
            return "another payload version"
        try:
            salt = int(str(payload.get("model_salt", "0")), 16)
            bt = int(payload.get("block_tokens", 0))
        except (TypeError, ValueError):
            return "a payload that does not parse"
        if salt != self.model_salt & _MASK64 or bt != self.engine.block_tokens:
            return "another model salt or block size"
        if payload.get("embedder") != self.embedder.name:
            return f"another embedder ({payload.get('embedder')!r})"
        return None

    def _known(self, cid: int) -> Optional[ChunkRecord]:
        """Record of cid, fetched from the index when not loaded yet."""
        return self._known_many([cid]).get(cid)

    def _known_many(self, cids: Iterable[int], present: Optional[Set[int]] = None) -> Dict[int, ChunkRecord]:
        """Records of those of cids that are known, fetching the ones not
        loaded yet from the index in one request. ``present`` (when the
        index has ``get``) gets the ids the index holds, ours or not."""
        cids = list(cids)
        with self._lock:
            out = {c: self._records[c] for c in cids if c in self._records}
            missing = list(dict.fromkeys(c for c in cids if c not in out))
        if present is not None:
            present.update(out)
        get = getattr(self.index, "get", None)
        if not missing or get is None:
            return out
        payloads = get(missing)
        if present is not None:
            present.update(payloads)
        for cid in missing:
            payload = payloads.get(cid)
            rec = self._record_from_payload(cid, payload) if payload else None
            if rec is not None:
                with self._lock:
                    out[cid] = self._records.setdefault(cid, rec)
        return out

    def sequence(self, chunk_id: int) -> Any:
        """The kvh sequence holding the chunk (attached on first use). It is
        the retriever's own, served to every caller of the chunk: read it
        and acquire from it, but do not write, truncate or free it."""
        self._check_open()
        cid = _index("chunk_id", chunk_id)
        with self._lock:
            seq = self._seqs.get(cid)
            if seq is not None:
                return seq
            rec = self._records.get(cid)
        if rec is None:
            raise KeyError(f"unknown chunk {cid:#x}")
        with self._attach_lock:  # attaching may read from disk: not under the main lock
            self._check_open()  # a close meanwhile would never free what is attached now
            with self._lock:
                seq = self._seqs.get(cid)
            if seq is not None:
                return seq
            seq, blocks = self._materialise(rec)
            with self._lock:
                self._seqs[cid] = seq
                self._blocks[cid] = blocks
            return seq

    def blocks(self, chunk_id: int) -> List[Any]:
        """The chunk's block handles (borrowed from its sequence)."""
        self.sequence(chunk_id)
        with self._lock:
            return list(self._blocks[int(chunk_id)])

    def resident(self, chunk_id: int) -> bool:
        """True when the chunk is attached (added, predicted or acquired
        since the retriever opened) and every block of its sequence is in
        the device tier (and not being copied). A query only: a chunk
        known from :meth:`load` and not attached yet is False, and asking
        attaches nothing and computes nothing. KeyError for an unknown
        chunk."""
        from .types import Tier

        self._check_open()
        self.record(chunk_id)  # KeyError when unknown
        with self._lock:
            blocks = list(self._blocks.get(int(chunk_id), ()))
        if not blocks:
            return False
        for b in blocks:  # stops at the first block that is not (the usual case: the first)
            info = b.info()
            if info.tier != Tier.DEVICE or info.in_flight:
                return False
        return True

    def persist(self) -> int:
        """Makes the full blocks of every attached chunk durable in the disk
        tier (UnsupportedError without one). Returns the chunk count."""
        with self._lock:
            seqs = list(self._seqs.values())
        for s in seqs:
            s.persist()
        return len(seqs)

    # ---- prediction ----
    def query_parts(self, context: str, draft_text: Optional[str] = None) -> Tuple[List[str], List[float]]:
        """What is embedded for ``context`` and with which weights: its last
        ``context_chars`` characters cut into ``segment_chars`` segments
        from the end (the most recent first, weights 1, ``decay``,
        ``decay``², ...), and the projected continuation (``draft_text``,
        else ``draft(context_tail)`` when a draft is set) with weight
        ``draft_weight``."""
        if not isinstance(context, str):
            raise TypeError(f"context must be str, not {type(context).__name__}")
        tail = context[-self.context_chars :] if self.context_chars > 0 else context
        texts: List[str] = []
        weights: List[float] = []
        seg = self.segment_chars if self.segment_chars > 0 else max(1, len(tail))
        end, w = len(tail), 1.0
        while end > 0:
            piece = tail[max(0, end - seg) : end]
            if piece.strip():
                texts.append(piece)
                weights.append(w)
            end -= seg
            w *= self.decay
        cont = draft_text
        if cont is None and self.draft is not None:
            cont = self.draft(tail)
        if cont and str(cont).strip():
            texts.append(str(cont))
            weights.append(self.draft_weight)
        return texts, weights

    def query_vector(self, context: str, draft_text: Optional[str] = None) -> np.ndarray:
        """The (L2-normalised) query vector of ``context`` (see
        :meth:`query_parts`); all zeros for an empty context."""
        texts, weights = self.query_parts(context, draft_text)
        if not texts:
            return np.zeros(self.embedder.dim, np.float32)
        vecs = np.asarray(self.embedder.embed(texts), np.float32)
        v = (np.asarray(weights, np.float32)[:, None] * vecs).sum(axis=0)
        n = float(np.linalg.norm(v))
        return (v / n).astype(np.float32) if n > 0 else v

    def predict(
        self, context: str, *, agent: Optional[int] = None, k: Optional[int] = None, draft_text: Optional[str] = None
    ) -> List[Prediction]:
        """The chunks most likely needed next after ``context``, best first
        (no hints, no accounting)."""
        self._check_live()  # before the embedding, which may be a model call
        agent, k = self._check_query(context, agent, k, draft_text)
        return self._predict(self.query_vector(context, draft_text), agent, k)

    def _check_query(self, context: Any, agent: Any, k: Any, draft_text: Any) -> Tuple[Optional[int], Optional[int]]:
        """(agent, k) checked, before anything is counted or queued."""
        if not isinstance(context, str):
            raise TypeError(f"context must be str, not {type(context).__name__}")
        if draft_text is not None and not isinstance(draft_text, str):
            raise TypeError(f"draft_text must be str or None, not {type(draft_text).__name__}")
        for name, text in (("context", context), ("draft_text", draft_text)):
            try:  # the embedder would fail later, after the window opened
                if text is not None:
                    text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"{name} is not valid text: {exc.reason} at position {exc.start}") from None
        agent = _agent_arg(agent)
        k = None if k is None else _int("k", k, 1, _U32)
        return agent, k

    def _predict(self, vec: np.ndarray, agent: Optional[int], k: Optional[int]) -> List[Prediction]:
        self._check_live()
        k = self.top_k if k is None else _int("k", k, 1, _U32)
        if not np.any(vec):
            return []
        limit = k
        for _ in range(4):  # points of other models or embedders must not crowd ours out of the top k
            hits = self.index.search(vec, limit, agent=agent if self.filter_agents else None)
            out: List[Prediction] = []
            foreign = 0
            for cid, score in hits:
                if self.min_score is not None and score < self.min_score:
                    continue
                if self._known(int(cid)) is None:
                    foreign += 1  # a point that is not a chunk of this model
                    continue
                if len(out) < k:
                    out.append(Prediction(int(cid), float(score), len(out)))
            if len(out) == k or not foreign or len(hits) < limit:
                break
            limit = min(limit * 4, _U32)
        return out

    def _open_window(self, agent: Optional[int]) -> _Window:
        w = _Window(agent)
        with self._lock:
            old = self._windows.get(agent)
            if old is not None:
                self._closed.append(old)
            self._windows[agent] = w
        return w

    def _run_prefetch(
        self, context: str, draft_text: Optional[str], agent: Optional[int], k: Optional[int], window: Optional[_Window]
    ) -> PrefetchResult:
        t0 = time.perf_counter()
        try:
            preds = self._predict(self.query_vector(context, draft_text), agent, k)
        except BaseException:
            if window is not None:
                window.predicted = set()
            raise
        hinted: List[int] = []
        resident: List[int] = []
        fences: List[Any] = []
        for p in preds:
            try:
                seq = self.sequence(p.chunk_id)
                if self.resident(p.chunk_id):
                    resident.append(p.chunk_id)
                    continue
                n = self.record(p.chunk_id).n_tokens
                priority = max(self.base_priority - p.rank, _PRIORITY_MIN)  # a k past top_k may reach the bottom
                fences.append(self.engine.prefetch(seq, 0, n, priority=priority))
                hinted.append(p.chunk_id)
            except Exception as exc:  # noqa: BLE001 - a hint that cannot be issued is not fatal
                from . import errors

                if isinstance(exc, errors.ClosedError):
                    raise
                log.debug("kvh_cache.retriever: no hint for chunk %#x: %s", p.chunk_id, exc)
        dt = time.perf_counter() - t0
        with self._lock:
            if window is not None:
                window.predicted = {p.chunk_id for p in preds}
            self._n_predictions += 1
            self._hinted += len(hinted)
            self._resident += len(resident)
            self._latencies.append(dt)
        return PrefetchResult(agent, preds, hinted, resident, fences, dt)

    def prefetch(
        self, context: str, *, agent: Optional[int] = None, k: Optional[int] = None, draft_text: Optional[str] = None
    ) -> PrefetchResult:
        """Predicts the chunks ``agent`` needs next after ``context`` and
        issues prefetch hints for those not resident (priority
        ``base_priority - rank``). ``draft_text``: a projected continuation
        the caller already has (e.g. from its own draft model), used
        instead of calling ``draft``. Opens the agent's next accounting
        window. Returns at once; the promotions run on kvh's migration
        threads. Arguments are checked before the window opens: a rejected
        call leaves the accounting as it was."""
        self._check_open()
        agent, k = self._check_query(context, agent, k, draft_text)
        window = self._open_window(agent)
        return self._run_prefetch(context, draft_text, agent, k, window)

    def prefetch_async(
        self, context: str, *, agent: Optional[int] = None, k: Optional[int] = None, draft_text: Optional[str] = None
    ) -> "Future[PrefetchResult]":
        """:meth:`prefetch` on a background thread (one, so predictions run
        in order). The accounting window opens now, in the caller's
        thread, so the agent's next acquires count against this prediction
        even if it is still running."""
        self._check_open()
        agent, k = self._check_query(context, agent, k, draft_text)
        window = self._open_window(agent)
        with self._lock:
            self._check_open()  # a close since would not shut an executor made now down
            if self._executor is None:
                # Its one thread says who it is: calls from a done callback
                # (run there) must not wait for the predictions queued behind.
                self._executor = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="kvh-retriever", initializer=self._note_worker
                )
            # the draft runs on the worker too (it may be a model call)
            fut = self._executor.submit(self._run_prefetch, context, draft_text, agent, k, window)
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(fut)
        return fut

    def _note_worker(self) -> None:
        self._worker = threading.get_ident()

    def _on_worker(self) -> bool:
        """Whether this is the background predictions' thread (a future's
        done callback runs there)."""
        return self._worker is not None and threading.get_ident() == self._worker

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Waits for the background predictions submitted so far, at most
        ``timeout`` seconds in all (None or inf: until they are done; 0 or
        less: only looks, as :meth:`PrefetchResult.wait` does). True when
        all are done. NaN is a ValueError, a non-number a TypeError. From a
        future's done callback it does not wait (the predictions still
        queued run after the callback, on its thread); so neither do
        :meth:`metrics` and :meth:`reset_metrics` there."""
        if timeout is not None:
            if isinstance(timeout, (bool, np.bool_)) or not isinstance(timeout, numbers.Real):
                raise TypeError(f"timeout must be a number or None, not {type(timeout).__name__}")
            timeout = float(timeout)
            if math.isnan(timeout):
                raise ValueError("timeout must be a number of seconds or None, not NaN")
            # inf overflows the condition wait; a negative wait is a poll
            timeout = None if math.isinf(timeout) and timeout > 0 else max(0.0, timeout)
        with self._lock:
            # done() counts a cancelled future that wait() would not (never notified)
            pending = [f for f in self._pending if not f.done()]
        if self._on_worker():
            # A future's done callback: the predictions still queued run on
            # this thread after it, so waiting for them would never end.
            return not pending
        done, not_done = futures_wait(pending, timeout)
        for f in done:
            if not f.cancelled() and f.exception() is not None:  # reported by the future's owner
                log.debug("kvh_cache.retriever: background prefetch failed: %s", f.exception())
        return not not_done

    # ---- use ----
    def note_use(self, chunk_ids: Union[int, Iterable[int]], *, agent: Optional[int] = None) -> None:
        """Records that ``agent`` used chunks (for precision / recall)."""
        self._check_open()
        agent = _agent_arg(agent)
        if isinstance(chunk_ids, (int, np.integer)):
            chunk_ids = [chunk_ids]
        if isinstance(chunk_ids, (str, bytes)) or not isinstance(chunk_ids, Iterable):
            raise TypeError(f"chunk_ids must be a chunk id or an iterable of them, not {type(chunk_ids).__name__}")
        ids = [_index("chunk_ids", c) for c in chunk_ids]
        # an id the retriever never stored would count as a use no prediction could hit
        known = self._known_many(ids)
        unknown = [c for c in dict.fromkeys(ids) if c not in known]
        if unknown:
            more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
            raise KeyError(f"unknown chunk {unknown[0]:#x}{more}: nothing was recorded")
        with self._lock:
            w = self._windows.get(agent)
            if w is None:
                self._unwindowed += len(ids)
            else:
                w.used.update(ids)

    def acquire(self, chunk_id: int, *, agent: Optional[int] = None, wait: bool = True) -> Any:
        """Acquires the chunk's tokens (device tier; a :class:`kvh.Hold`,
        release it when done) and records the use."""
        seq = self.sequence(chunk_id)
        self.note_use(chunk_id, agent=agent)
        return seq.acquire(0, self.record(chunk_id).n_tokens, wait=wait)

    # ---- accounting ----
    def end_windows(self) -> None:
        """Closes every open window (end of a run: their uses count)."""
        with self._lock:
            self._closed.extend(self._windows.values())
            self._windows.clear()

    def reset_metrics(self) -> None:
        """Starts counting afresh (windows, latencies, kvh counter base)."""
        self.drain()
        stats0 = self.engine.stats()  # a closed engine raises here, before anything is cleared
        with self._lock:
            self._windows.clear()
            self._closed.clear()
            self._unwindowed = self._n_predictions = self._hinted = self._resident = 0
            self._latencies.clear()
        self._stats0 = stats0

    def metrics(self) -> RetrieverMetrics:
        """Precision / recall over the closed windows (call
        :meth:`end_windows` first to include the open ones) and kvh's
        counters since the retriever was created (or reset); ``kvh`` is
        empty once the engine is closed, the rest is still counted."""
        self.drain()
        with self._lock:
            m = RetrieverMetrics()
            for w in self._closed:
                pred = w.predicted or set()
                m.windows += 1
                m.predicted += len(pred)
                m.used += len(w.used)
                m.hits += len(pred & w.used)
            m.unwindowed_uses = self._unwindowed
            m.predictions = self._n_predictions
            m.chunks_hinted = self._hinted
            m.chunks_resident = self._resident
            lat = sorted(self._latencies)
        if lat:
            m.predict_seconds_total = float(sum(lat))
            m.predict_seconds_p50 = float(statistics.median(lat))
            m.predict_seconds_p99 = float(lat[min(len(lat) - 1, int(round(0.99 * (len(lat) - 1))))])
        try:
            d = (self.engine.stats() - self._stats0).to_dict()
        except errors.ClosedError:
            return m
        m.kvh = {k: int(d.get(k, 0)) for k in _KVH_COUNTERS}
        return m
