"""Text embeddings for the speculative retriever (``kvh_cache.retriever``).

An *embedder* turns texts into L2-normalised ``float32`` vectors of a fixed
dimension. Anything with ``name``, ``dim`` and ``embed(texts) -> (n, dim)``
works (:class:`Embedder`). Two are provided:

:class:`HashedNgramEmbedder`
    Dependency-free (NumPy only) and deterministic across processes and
    machines: hashed character n-grams (3, 4, 5 by default) and whole words,
    signed feature hashing with sub-linear term weights, L2-normalised.
    Good at lexical overlap (shared terms, names, identifiers), which is
    what "the chunk this agent is about to read" usually has in common with
    its recent context.

:class:`SentenceTransformerEmbedder`
    A ``sentence-transformers`` model when the package (and a model) is
    installed: ``open_embedder("st:/path/to/model")`` or
    ``open_embedder("st:all-MiniLM-L6-v2")`` (a name resolves through the
    sentence-transformers cache; nothing is downloaded when the machine is
    offline, the load fails with a clear error instead).

:func:`open_embedder` parses a spec string (``hash``, ``hash:512``,
``st:MODEL``, ``auto``; ``auto`` honours ``$KVH_EMBEDDER`` and is otherwise
``hash``). :class:`WordTokenizer` is a matching dependency-free tokenizer
(one token id per word) for users without a model tokenizer.
"""

from __future__ import annotations

import os
import re
import zlib
from typing import Any, Iterable, List, Optional, Protocol, Sequence, runtime_checkable

import numpy as np

from .engine import _flag, _index, _int, _real

__all__ = [
    "Embedder",
    "HashedNgramEmbedder",
    "SentenceTransformerEmbedder",
    "CallableEmbedder",
    "WordTokenizer",
    "open_embedder",
    "DEFAULT_DIM",
]

DEFAULT_DIM = 1024

_U64 = np.uint64
_M1 = _U64(0xBF58476D1CE4E5B9)
_M2 = _U64(0x94D049BB133111EB)
_PRIME = _U64(0x100000001B3)  # FNV-64 prime: polynomial rolling hash of the n-gram bytes
_WS = re.compile(r"\s+")
_WORD = re.compile(r"[^\W_]+", re.UNICODE)


@runtime_checkable
class Embedder(Protocol):
    """What the retriever needs from an embedding model."""

    name: str
    dim: int

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """``(len(texts), dim)`` float32, each row L2-normalised (a zero row
        for a text with no features)."""


def _normalise(mat: np.ndarray) -> np.ndarray:
    mat = np.asarray(mat, dtype=np.float32)
    norms = np.linalg.norm(mat, axis=1, keepdims=True)
    return np.divide(mat, norms, out=np.zeros_like(mat), where=norms > 0)


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser (vectorised, wrapping uint64 arithmetic)."""
    h = h ^ (h >> _U64(30))
    h = h * _M1
    h = h ^ (h >> _U64(27))
    h = h * _M2
    return h ^ (h >> _U64(31))


class HashedNgramEmbedder:
    """Signed feature hashing of character n-grams and words.

    ``dim``: vector size (256–1024 is a good range; more dims, fewer
    collisions). ``ngrams``: character n-gram lengths. ``word_weight``:
    weight of whole-word features relative to n-grams (0 disables them).
    ``seed`` changes the hash family (vectors of different seeds are not
    comparable). Text is lower-cased and whitespace-collapsed first.

    Deterministic: the same text gives the same vector in every process
    (no use of Python's salted ``hash``), so vectors stored in a persistent
    index stay valid across restarts.
    """

    def __init__(
        self,
        dim: int = DEFAULT_DIM,
        ngrams: Iterable[int] = (3, 4, 5),
        *,
        word_weight: float = 1.0,
        lowercase: bool = True,
        seed: int = 0,
    ) -> None:
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim <= 0:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        if isinstance(ngrams, (str, bytes)):
            raise TypeError("ngrams must be a collection of ints, not a string")
        grams = tuple(_int("ngrams", n, 1, 1 << 16) for n in ngrams)
        if not grams:
            raise ValueError(f"ngrams must be positive lengths, got {ngrams!r}")
        self.dim = int(dim)
        self.ngrams = grams
        self.word_weight = _real("word_weight", word_weight, 0.0)
        self.lowercase = bool(_flag("lowercase", lowercase))
        self.seed = _int("seed", seed, -(1 << 63), (1 << 64) - 1)
        self.name = f"hash-ngram:{self.dim}:{'-'.join(map(str, grams))}" + (f":s{self.seed}" if self.seed else "")

    def __repr__(self) -> str:
        return (
            f"<kvh_cache.embed.HashedNgramEmbedder dim={self.dim} ngrams={self.ngrams} word_weight={self.word_weight}>"
        )

    def _prep(self, text: str) -> str:
        if not isinstance(text, str):
            raise TypeError(f"texts must be str, not {type(text).__name__}")
        t = _WS.sub(" ", text.replace("\0", " ")).strip()
        return t.lower() if self.lowercase else t

    def embed_one(self, text: str) -> np.ndarray:
        return self.embed([text])[0]

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """All texts in one vectorised pass: the texts are joined with NUL
        separators, n-gram hashes are computed over the whole buffer and
        the windows that cross a separator are dropped."""
        if isinstance(texts, str):
            raise TypeError("embed takes a sequence of texts; wrap a single text in a list")
        prepped = [self._prep(t) for t in texts]
        n_texts = len(prepped)
        if n_texts == 0:
            return np.zeros((0, self.dim), np.float32)
        bufs = [(" " + t + " ").encode("utf-8") for t in prepped]
        data = np.frombuffer(b"\0".join(bufs), dtype=np.uint8)
        owner = np.repeat(np.arange(n_texts, dtype=np.int64), [len(b) + 1 for b in bufs])[: data.size]
        seps = np.concatenate([[0], np.cumsum(data == 0)])  # separators before position i
        wide = data.astype(_U64)
        salt = _U64((self.seed * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)
        hs: List[np.ndarray] = []
        ts: List[np.ndarray] = []
        ws: List[np.ndarray] = []
        with np.errstate(over="ignore"):
            for n in self.ngrams:
                if data.size < n:
                    continue
                win = np.lib.stride_tricks.sliding_window_view(wide, n)
                h = np.full(win.shape[0], _U64(0xCBF29CE484222325) ^ salt ^ _U64(n), dtype=_U64)
                for j in range(n):
                    h = (h ^ win[:, j]) * _PRIME
                ok = seps[n : n + win.shape[0]] == seps[: win.shape[0]]  # no separator inside the window
                hs.append(h[ok])
                ts.append(owner[: win.shape[0]][ok])
                ws.append(np.ones(int(ok.sum())))
            if self.word_weight > 0:
                wh: List[int] = []
                wt: List[int] = []
                for i, t in enumerate(prepped):
                    for w in _WORD.findall(t):
                        wh.append(zlib.crc32(w.encode("utf-8")) | (len(w) << 32))
                        wt.append(i)
                if wh:
                    hs.append(np.asarray(wh, dtype=_U64) ^ _U64(0x5A5A5A5A00000000) ^ salt)
                    ts.append(np.asarray(wt, dtype=np.int64))
                    ws.append(np.full(len(wh), self.word_weight))
            out = np.zeros(n_texts * self.dim, np.float64)
            if hs:
                h = _mix(np.concatenate(hs))
                tid = np.concatenate(ts)
                weights = np.concatenate(ws)
                key = h ^ _mix(tid.astype(_U64) + _U64(1))  # feature of one text
                uniq, first, inv, count = np.unique(key, return_index=True, return_inverse=True, return_counts=True)
                total = np.bincount(inv.reshape(-1), weights=weights, minlength=uniq.size)
                # sub-linear term frequency: a feature seen c times weighs 1 + log(c)
                w = total / count * (1.0 + np.log(count))
                hu = h[first]
                bucket = (hu % _U64(self.dim)).astype(np.int64) + tid[first] * self.dim
                sign = np.where((hu >> _U64(63)) & _U64(1), -1.0, 1.0)
                out = np.bincount(bucket, weights=w * sign, minlength=n_texts * self.dim)
        return _normalise(out.reshape(n_texts, self.dim))


class SentenceTransformerEmbedder:
    """A ``sentence-transformers`` model. ``model``: a local directory or a
    model name already in the sentence-transformers / Hugging Face cache.
    ``device``: e.g. ``"cpu"``, ``"cuda"`` (default: the library's choice).

    Raises ImportError (with the pip name) when ``sentence-transformers`` is
    not installed, RuntimeError when the model cannot be loaded."""

    def __init__(
        self, model: str = "all-MiniLM-L6-v2", *, device: Optional[str] = None, batch_size: int = 32, **kwargs: Any
    ) -> None:
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError as exc:
            raise ImportError(
                f"the sentence-transformers embedder needs the package: pip install sentence-transformers ({exc})"
            ) from exc

        try:
            self._model = SentenceTransformer(model, device=device, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any load failure (offline hub, bad path) is "cannot load"
            raise RuntimeError(f"cannot load sentence-transformers model {model!r}: {exc}") from exc
        getdim = getattr(self._model, "get_sentence_embedding_dimension", None)
        dim = getdim() if getdim else None
        if not dim:
            dim = int(np.asarray(self._model.encode(["dimension probe"])).shape[-1])
        self.dim = int(dim)
        self.model_name = str(model)
        self.batch_size = batch_size
        self.name = f"st:{os.path.basename(str(model).rstrip('/')) or model}"

    def __repr__(self) -> str:
        return f"<kvh_cache.embed.SentenceTransformerEmbedder {self.model_name!r} dim={self.dim}>"

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        if isinstance(texts, str):
            raise TypeError("embed takes a sequence of texts; wrap a single text in a list")
        texts = list(texts)
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        vecs = self._model.encode(
            texts, batch_size=self.batch_size, convert_to_numpy=True, normalize_embeddings=True, show_progress_bar=False
        )
        vecs = np.asarray(vecs, dtype=np.float32).reshape(len(texts), -1)
        if vecs.shape[1] != self.dim:
            raise RuntimeError(f"model returned {vecs.shape[1]}-dim vectors, expected {self.dim}")
        return _normalise(vecs)


class CallableEmbedder:
    """Wraps ``fn(texts) -> array (n, dim)`` (any model) as an embedder;
    rows are L2-normalised."""

    def __init__(self, fn: Any, dim: int, name: str = "callable") -> None:
        if not callable(fn):
            raise TypeError("fn must be callable")
        self._fn = fn
        self.dim = _int("dim", dim, 1, 1 << 31)
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, not {type(name).__name__}")
        self.name = name

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        texts = list(texts)
        vecs = np.asarray(self._fn(texts), dtype=np.float32)
        if vecs.shape != (len(texts), self.dim):
            raise ValueError(f"embedding function returned shape {vecs.shape}, expected ({len(texts)}, {self.dim})")
        if not np.all(np.isfinite(vecs)):
            # A NaN row used to become a zero vector: a text that matches nothing.
            raise ValueError("embedding function returned non-finite values")
        return _normalise(vecs)


def open_embedder(spec: Any = "auto", *, dim: Optional[int] = None) -> Any:
    """An embedder from a spec:

    * an object with ``embed`` and ``dim``: returned as is;
    * ``"hash"`` / ``"hash:DIM"``: :class:`HashedNgramEmbedder` (``dim``
      keyword or DIM, default 1024; both given must agree);
    * ``"st:MODEL"`` / ``"sentence-transformers:MODEL"``:
      :class:`SentenceTransformerEmbedder`;
    * ``"auto"``: ``$KVH_EMBEDDER`` when set, else ``"hash"``.
    """
    if hasattr(spec, "embed") and hasattr(spec, "dim"):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"embedder must be a spec string or an object with embed() and dim, not {type(spec).__name__}")
    s = spec.strip()
    if s == "auto":
        s = os.environ.get("KVH_EMBEDDER", "").strip() or "hash"
    kind, _, arg = s.partition(":")
    kind = kind.lower()
    if kind in ("hash", "hashed", "ngram"):
        if dim is not None:
            dim = _int("dim", dim, 1, 1 << 31)  # dim=0 used to mean the default
        try:
            d = int(arg) if arg else (DEFAULT_DIM if dim is None else dim)
        except ValueError:
            raise ValueError(f"embedder {spec!r}: the dimension after 'hash:' must be an int") from None
        if dim is not None and d != dim:
            raise ValueError(f"embedder {spec!r} makes {d}-dim vectors, but dim={dim} was asked for")
        return HashedNgramEmbedder(d)
    if kind in ("st", "sentence-transformers", "sentence_transformers", "sbert"):
        return SentenceTransformerEmbedder(arg or "all-MiniLM-L6-v2")
    raise ValueError(f"unknown embedder {spec!r}: expected 'hash', 'hash:DIM', 'st:MODEL' or 'auto'")


class WordTokenizer:
    """A dependency-free tokenizer: one token id per word (and per
    punctuation mark), ids from a stable hash (``offset`` + CRC-32 of the
    word modulo ``vocab_size``), so the same text always gives the same
    ids (and so the same kvh prefix hashes). Different words can share an
    id (with the default 2**20 ids, "9989" and "90246" do; a vocab_size
    up to 2**31 - offset makes it rarer): a chunk's id is the hash of its
    token ids, so :meth:`SpeculativeRetriever.add_document` refuses a
    chunk whose ids match a held chunk of other text.

    ``encode(text) -> list[int]``; ``split(text) -> list[str]`` gives the
    pieces the ids stand for (``" ".join`` of a slice of them is the text
    of that slice, whitespace collapsed)."""

    name = "word-hash"
    _PIECE = re.compile(r"\w+|[^\w\s]", re.UNICODE)

    def __init__(self, vocab_size: int = 1 << 20, *, offset: int = 1000) -> None:
        # Token ids are int32: offset + vocab_size - 1 must fit.
        self.vocab_size = _int("vocab_size", vocab_size, 1, (1 << 31) - 1)
        self.offset = _index("offset", offset, maximum=(1 << 31) - self.vocab_size)

    def split(self, text: str) -> List[str]:
        return self._PIECE.findall(text)

    def token(self, piece: str) -> int:
        return self.offset + zlib.crc32(piece.encode("utf-8")) % self.vocab_size

    def encode(self, text: str) -> List[int]:
        return [self.token(p) for p in self.split(text)]
