"""The KV every request reads, cached once per configuration: the shared
system prompt (one sequence that owns its blocks, pinned for kvh) and each
article's ``[system][article]`` sequence."""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence as Seq, Tuple

import numpy as np

from ..._progress import Progress
from .kv import KVBackends
from .trace import Tracer
from .workload import Workload

__all__ = ["LibraryCache", "ProgressFeed", "write_kv_from"]


class ProgressFeed:
    """A ``progress(done, total)`` callback of ``Runner.prefill`` that
    advances ``bar`` (when there is one) by the tokens done since the last
    call."""

    def __init__(self, bar: Optional[Progress]) -> None:
        self.bar = bar
        self.done = 0

    def __call__(self, n: int, total: int) -> None:
        if self.bar is not None:
            self.bar.update(n - self.done)
        self.done = n


def write_kv_from(seq, tokens: Seq[int], first: int, kv: Seq[Tuple[np.ndarray, np.ndarray]]) -> None:
    """Appends tokens and writes their K/V (from another engine's cache:
    one (K, V) pair per layer, from token ``first`` on)."""
    n = len(tokens)
    seq.append(np.asarray(tokens, np.int32))
    with seq.acquire(first, n):
        for layer, (k, v) in enumerate(kv):
            seq.write_kv(layer, first, np.ascontiguousarray(k[:n]), np.ascontiguousarray(v[:n]))


class LibraryCache:
    """The system prompt and the articles of one configuration's engine.

    Each piece is first looked up in the engine's prefix index (a store
    left by an earlier run may hold it); what is missing is computed, or,
    with ``corpus_kv`` (the K/V another configuration computed, see
    :meth:`read_kv`), copied. ``ingest`` counts the tokens computed,
    reused and copied."""

    def __init__(
        self,
        work: Workload,
        eng,
        backends: KVBackends,
        tracer: Tracer,
        corpus_kv: Optional[Dict[str, Any]] = None,
        sync_offload: bool = False,
    ) -> None:
        self.work = work
        self.eng = eng
        self.backends = backends
        self.tracer = tracer
        self.corpus_kv = corpus_kv
        self.sync_offload = sync_offload  # leave every cached sequence in the host tier
        self.owner: Any = None  # the system prompt's sequence
        self.docs: Dict[int, Any] = {}  # article id -> its [system][article] sequence
        self.ingest: Dict[str, Any] = {"computed_tokens": 0, "reused_tokens": 0, "copied_tokens": 0, "seconds": 0.0}

    # ---- the whole library, before the agents ----
    def cache(self, doc_ids: Seq[int], label: str, show: bool, pin_system: bool) -> None:
        """The system prompt (its full blocks pinned with ``pin_system``),
        then the articles ``doc_ids``, with a progress bar when computing."""
        t0 = time.perf_counter()
        P, bt, s_full = self.work.prompts, self.work.bt, self.work.system_full_blocks
        self.owner = self.eng.sequence(agent=0)
        m = self.owner.match_prefix(P.system)
        self.tracer.blocks(self.owner, 0, "match", 0, m // bt)
        total = (len(P.system) - m) + sum(len(P.prefix(d)) - s_full * bt for d in doc_ids)
        bar = (
            Progress(total, f"{label}: caching the library", unit="tok", enabled=None if show else False)
            if self.corpus_kv is None
            else None
        )
        self._fill_system_prompt(m, bar, pin_system)
        for d in doc_ids:
            c, r = self.add_article(d, bar)
            self.ingest["computed_tokens"] += c
            self.ingest["reused_tokens"] += r
            if bar is not None:
                bar.update(0, self.work.corpus[d].name)
        if bar is not None:
            bar.close()
        self.ingest["seconds"] = time.perf_counter() - t0
        self.ingest["docs"] = len(self.docs)

    def _fill_system_prompt(self, matched: int, bar: Optional[Progress], pin: bool) -> None:
        P, bt, s_full = self.work.prompts, self.work.bt, self.work.system_full_blocks
        owner, m = self.owner, matched
        if m < len(P.system):
            if self.corpus_kv is not None:
                write_kv_from(owner, P.system[m:], m, [(k[m:], v[m:]) for k, v in self.corpus_kv["system"]])
                self.ingest["copied_tokens"] += len(P.system) - m
            else:
                self._prefill(owner, P.system[m:], 0, bar)
                self.ingest["computed_tokens"] += len(P.system) - m
        self.ingest["reused_tokens"] += m
        if pin and s_full:
            with owner.acquire(0, s_full * bt):  # pins hold a block in its tier: bring it up first
                owner.pin(0, s_full * bt)
        if self.sync_offload:
            owner.migrate("host")

    # ---- one article ----
    def add_article(self, d: int, bar: Optional[Progress], agent: int = 0) -> Tuple[int, int]:
        """The [system][article] sequence of document d: (computed, reused)
        tokens. ``agent``: whose request needs it (0: the library's
        ingest), for the trace."""
        P, bt, s_full = self.work.prompts, self.work.bt, self.work.system_full_blocks
        prefix = P.prefix(d)
        s = self.eng.sequence(agent=0)
        m = s.match_prefix(prefix)
        self.tracer.blocks(s, agent, "match", 0, m // bt)
        computed = 0
        if m < len(prefix):
            if self.corpus_kv is not None and d in self.corpus_kv["docs"]:
                base = self.corpus_kv["doc_first"]
                assert m >= base, (m, base)
                kv = [(k[m - base :], v[m - base :]) for k, v in self.corpus_kv["docs"][d]]
                write_kv_from(s, prefix[m:], m, kv)
                self.ingest["copied_tokens"] += len(prefix) - m
            else:
                self._prefill(s, prefix[m:], agent, bar)
                computed = len(prefix) - m
        self.docs[d] = s
        if self.sync_offload:
            s.migrate("host")
        return computed, max(0, m - s_full * bt)

    def _prefill(self, seq, tokens: List[int], agent: int, bar: Optional[Progress]) -> np.ndarray:
        self.tracer.blocks(seq, agent, "prefill")
        return self.work.runner.prefill(self.backends.for_sequence(seq), tokens, progress=ProgressFeed(bar))

    # ---- after the agents ----
    def sequences(self) -> List[Any]:
        """The system prompt's sequence, then the articles'."""
        return [self.owner] + list(self.docs.values())

    def read_kv(self) -> Dict[str, Any]:
        """The library's K/V as arrays, for another configuration's
        ``corpus_kv``: the system prompt's, and each article's from the
        end of the system prompt's full blocks (``doc_first``) on."""
        L = self.eng.num_layers
        first = self.work.system_full_blocks * self.work.bt
        out: Dict[str, Any] = {"system": [], "docs": {}, "doc_first": first}
        with self.owner.acquire():
            out["system"] = [self.owner.read_kv(layer) for layer in range(L)]
        for d, s in self.docs.items():
            with s.acquire():
                out["docs"][d] = [s.read_kv(layer, first, len(s) - first) for layer in range(L)]
        return out
