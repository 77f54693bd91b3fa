"""What the scheduler tells the engine ahead of the agents' requests: the
queue as eviction advice (kvh_seq_hint) and the speculative retriever's
prefetch of the next request's article."""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence as Seq

from ... import errors
from .measure import tiers_of
from .trace import Tracer
from .workload import Request, Workload

__all__ = ["RUNNING_PRIORITY", "QueueHints", "SpeculativePrefetcher"]

# kvh_seq_hint priority of the request being decoded; queued request k gets -k.
RUNNING_PRIORITY = 1 << 30


class QueueHints:
    """The scheduler's queue as eviction advice (kvh_seq_hint: it moves
    nothing). Before request i, the [system][article] sequences that it and
    the next ``depth - 1`` queued requests read, sooner requests at higher
    priorities (request k at -k); before each decode step, the running
    request's whole sequence above everything queued."""

    def __init__(
        self,
        requests: Seq[Request],
        retrieve: Callable[[str], List[int]],
        doc_seqs: Dict[int, Any],
        depth: int,
        tracer: Tracer,
    ) -> None:
        self.requests = requests
        self.retrieve = retrieve
        self.doc_seqs = doc_seqs  # article id -> its [system][article] sequence, as they are cached
        self.depth = depth
        self.tracer = tracer
        self.queued_docs: Dict[str, List[int]] = {}

    def before_request(self, i: int) -> None:
        for k in range(i, min(len(self.requests), i + self.depth)):
            q = self.requests[k].question
            if q not in self.queued_docs:
                self.queued_docs[q] = self.retrieve(q)
            s = self.doc_seqs.get(self.queued_docs[q][0]) if self.queued_docs[q] else None
            if s is not None:
                s.hint(priority=-k)
                self.tracer.hint(s, self.requests[k].agent, -k)

    def before_decode_step(self, seq: Any, agent: int) -> None:
        """The running request reads its whole sequence each step: it ranks
        above everything queued."""
        if not self.depth:
            return
        seq.hint(priority=RUNNING_PRIORITY)
        self.tracer.hint(seq, agent, RUNNING_PRIORITY)


class SpeculativePrefetcher:
    """The speculative retriever: resolves the next queued question to
    articles and hints their blocks toward the device tier, on its own
    thread, while the current request decodes."""

    def __init__(self, work: Workload, eng, doc_seqs: Dict[int, Any], limit: int, tracer: Tracer) -> None:
        from ...retrieval import PrefetchPlanner

        self.work = work
        self.planner = PrefetchPlanner(eng, work.index, doc_seqs, limit=limit)
        self.doc_seqs = doc_seqs
        self.tracer = tracer
        self.q: "queue.Queue[Optional[Request]]" = queue.Queue()
        self.errors: List[str] = []
        self.th = threading.Thread(target=self._loop, name="kvh-demo-speculate", daemon=True)
        self.th.start()

    def submit(self, req: Request) -> None:
        self.q.put(req)

    def _loop(self) -> None:
        while True:
            req = self.q.get()
            if req is None:
                return
            try:
                vec = self.work.embedder.embed(req.question)
                top = self.work.index.search(vec, 1)
                s = self.doc_seqs.get(int(top[0][0])) if top else None
                if s is not None:  # where the article's own blocks are when the hint goes out
                    req.hint_tiers = tiers_of(s, None, self.work.system_full_blocks)
                ids = self.planner.hint(vec)
                req.predicted = [int(i) for i in ids]
                for i in req.predicted:
                    s = self.doc_seqs.get(i)
                    if s is not None:
                        self.tracer.blocks(s, req.agent, "prefetch")
            except errors.ClosedError:
                return
            except errors.Error as exc:
                self.errors.append(f"{type(exc).__name__}: {exc.message}")

    def close(self) -> None:
        self.q.put(None)
        self.th.join()
