"""The document library (``kvh_cache/demo/data/corpus``) and its retrieval: the
articles, a dependency-free embedding, and the chunk index they go into."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence as Seq, Tuple

import numpy as np

from .. import CORPUS_DIR

__all__ = ["EMBED_DIM", "Document", "HashedEmbedder", "RetrieverUnavailable", "load_corpus", "open_index"]

EMBED_DIM = 1024


@dataclasses.dataclass
class Document:
    id: int
    name: str
    title: str
    body: str

    @property
    def text(self) -> str:
        return f"{self.title}\n{self.body}"


def load_corpus(directory: Optional[Path] = None) -> List[Document]:
    """The plain-text articles (``*.txt``: a title line, then the body)."""
    d = Path(directory) if directory is not None else CORPUS_DIR
    docs = []
    for i, p in enumerate(sorted(d.glob("*.txt"))):
        text = p.read_text(encoding="utf-8").strip()
        title, _, body = text.partition("\n")
        docs.append(Document(id=i, name=p.stem, title=title.strip(), body=body.strip()))
    if not docs:
        raise FileNotFoundError(f"no *.txt documents in {d}")
    return docs


_WORD = re.compile(r"[a-z0-9]+")
_STOP = frozenset(
    "a an the of and or to in on at by for from with without is are was were be been being it its this that these "
    "those as into than then so such not no do does did how what why when where which who whom whose can could "
    "would should may might will shall has have had about over under more most less least very one two their there "
    "they them he she his her we you your our me my each other some many much also only just answer sentence "
    "tell".split()
)


def _terms(text: str) -> List[str]:
    out = []
    for w in _WORD.findall(text.lower()):
        if w in _STOP or len(w) < 3:
            continue
        if len(w) > 4 and w.endswith("ies"):
            w = w[:-3] + "y"
        elif len(w) > 3 and w.endswith("s") and not w.endswith("ss"):
            w = w[:-1]
        out.append(w)
    return out


class HashedEmbedder:
    """Bag-of-words TF-IDF vectors hashed into ``dim`` signed buckets: a
    dependency-free embedding that is plenty for short factual articles on
    distinct topics (the retriever only needs the nearest article)."""

    def __init__(self, corpus_texts: Seq[str], dim: int = EMBED_DIM) -> None:
        self.dim = dim
        n = len(corpus_texts)
        df: Dict[str, int] = {}
        for t in corpus_texts:
            for term in set(_terms(t)):
                df[term] = df.get(term, 0) + 1
        self.idf = {t: math.log((1 + n) / (1 + c)) + 1.0 for t, c in df.items()}
        self.idf_unknown = math.log(1 + n) + 1.0

    @staticmethod
    def _bucket(term: str, dim: int) -> Tuple[int, float]:
        h = int.from_bytes(hashlib.blake2b(term.encode(), digest_size=8).digest(), "little")
        return h % dim, (1.0 if (h >> 63) & 1 else -1.0)

    def embed(self, text: str) -> np.ndarray:
        tf: Dict[str, int] = {}
        for term in _terms(text):
            tf[term] = tf.get(term, 0) + 1
        v = np.zeros(self.dim, np.float32)
        for term, c in tf.items():
            i, s = self._bucket(term, self.dim)
            v[i] += s * (1.0 + math.log(c)) * self.idf.get(term, self.idf_unknown)
        nrm = float(np.linalg.norm(v))
        return v / nrm if nrm > 0 else v


class RetrieverUnavailable(RuntimeError):
    pass


def open_index(args: argparse.Namespace, data_dir: Path, notes: List[str]):
    """The chunk index through :func:`kvh_cache.retrieval.open_chunk_index` (the
    Qdrant retriever, ``kvh_cache.retriever``, slots in there): a Qdrant server
    with ``--qdrant-url`` (a failure is an error), else Qdrant's embedded
    mode under ``DATA_DIR/qdrant`` when available, else NumPy (with a
    note)."""
    from ...retrieval import NumpyChunkIndex, open_chunk_index

    kind = args.retriever
    opts: Dict[str, Any] = {"collection": "kvh_demo", "recreate": True}
    if args.qdrant_url:
        if kind == "numpy":
            raise RetrieverUnavailable("--qdrant-url needs the Qdrant retriever, not --retriever numpy")
        opts["url"] = args.qdrant_url
        kind = "qdrant" if kind == "auto" else kind
    elif kind != "numpy":
        opts["path"] = str(data_dir / "qdrant")
    try:
        try:
            return open_chunk_index(kind, dim=EMBED_DIM, **opts)
        except TypeError:  # a retriever that takes none of these options
            return open_chunk_index(kind, dim=EMBED_DIM)
    except Exception as exc:  # noqa: BLE001 - any backend problem
        if kind != "auto":  # asked for by name (or by --qdrant-url): an error, not a silent fallback
            raise RetrieverUnavailable(f"retriever {kind!r} unavailable: {type(exc).__name__}: {exc}") from exc
        notes.append(f"retriever {kind!r} unavailable ({type(exc).__name__}: {exc}); using the NumPy index")
        return NumpyChunkIndex(EMBED_DIM)
