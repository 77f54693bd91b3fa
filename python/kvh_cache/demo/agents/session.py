"""One configuration (kvh or a baseline) over the workload: its engine,
the library cached in it, the agents' requests in turn, and what the run
left behind."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ... import errors
from ..._progress import Progress
from .configs import Setup, SetupResult
from .kv import KVBackends, KVTimes, TimedKV
from .library import LibraryCache
from .measure import DecodeStats, OccupancySampler, fragmentation, system_prompt_blocks, tier_table, tiers_of
from .scheduler import QueueHints, SpeculativePrefetcher
from .trace import Tracer
from .workload import Request, Workload

__all__ = ["SetupRun", "run_setup"]


def run_setup(
    work: Workload, setup: Setup, corpus_kv: Optional[Dict[str, Any]], tracer: Tracer, want_corpus_kv: bool = False
) -> Tuple[SetupResult, Optional[Dict[str, Any]]]:
    """Runs the workload on one configuration. ``corpus_kv``: K/V of the
    system prompt and the articles to write instead of computing them (the
    baselines reuse what the kvh run computed); with ``want_corpus_kv`` the
    run returns its own for them."""
    t_setup = time.perf_counter()
    eng = work.runner.engine(**setup.engine_kwargs(work.args.buffered_io))
    if eng.block_bytes != work.block_bytes:
        raise RuntimeError(f"engine block size {eng.block_bytes} != expected {work.block_bytes}")
    run = SetupRun(work, setup, eng, corpus_kv, tracer)
    try:
        res, out_kv = run.execute(want_corpus_kv)
    finally:
        run.close()
    res.seconds = time.perf_counter() - t_setup
    return res, out_kv


class SetupRun:
    """The run of one configuration on its engine ``eng`` (closed by
    :meth:`close`): :meth:`execute` caches the library, serves the
    requests of the plan in order and collects the :class:`SetupResult`.

    Only the kvh configuration writes the block-access trace."""

    def __init__(self, work: Workload, setup: Setup, eng, corpus_kv: Optional[Dict[str, Any]], tracer: Tracer) -> None:
        self.work = work
        self.setup = setup
        self.eng = eng
        self.args = work.args
        self.requests = [
            dataclasses.replace(r, docs=[], itl_s=[], tokens=[], matched_tiers={}, predicted=None, hint_tiers=None)
            for r in work.plan
        ]
        self.times = KVTimes()
        self.occupancy = OccupancySampler(eng)
        self.backends = KVBackends(work.runner, eng, self.times, setup.sync_offload, self.occupancy.sample)
        self.tracer = tracer  # the speculative prefetcher's
        self.block_tracer = tracer if setup.name == "kvh" else Tracer(None)
        self.library = LibraryCache(work, eng, self.backends, self.block_tracer, corpus_kv, setup.sync_offload)
        self.queue_hints = (
            QueueHints(self.requests, work.retrieve, self.library.docs, self.args.queue_hints, self.block_tracer)
            if setup.prefetch
            else None
        )
        self.prefetcher: Optional[SpeculativePrefetcher] = None
        self.decode = DecodeStats()
        self.conversations: Dict[int, Tuple[Any, Request]] = {}  # agent -> its latest sequence and request
        self.notes: List[str] = []
        self.show = not self.args.no_progress and not self.args.json

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.eng.close()

    def execute(self, want_corpus_kv: bool) -> Tuple[SetupResult, Optional[Dict[str, Any]]]:
        args, setup = self.args, self.setup
        # 1. the system prompt, once, pinned (kvh); 2. the library's KV
        self.library.cache(
            self.work.docs_in_run() if args.ingest == "all" else [], setup.name, self.show, setup.pin_system
        )
        stats0 = self.eng.stats()
        if setup.prefetch and args.hints > 0:
            self.prefetcher = SpeculativePrefetcher(self.work, self.eng, self.library.docs, args.hints, self.tracer)
        # 3. the agents
        t_phase = self.serve_requests()
        self._stop_prefetcher()
        t_agents = time.perf_counter() - t_phase
        # 4. what the run left behind
        res = self._result(stats0)
        res.ingest["agents_seconds"] = t_agents
        res.phase_offset = t_phase - self.occupancy.t_origin
        out_kv = self.library.read_kv() if want_corpus_kv else None  # for the baselines
        for s in self._live():
            s.free()
        return res, out_kv

    def _stop_prefetcher(self) -> None:
        if self.prefetcher is None:
            return
        self.prefetcher.close()
        for e in self.prefetcher.errors[:1]:
            self.notes.append(f"{len(self.prefetcher.errors)} prefetch hint(s) failed, first: {e}")
        self.prefetcher = None

    # ---- the agents' requests ----
    def serve_requests(self) -> float:
        """Serves the requests in order; returns when they began
        (``time.perf_counter()``)."""
        total_steps = len(self.requests) * self.args.gen_tokens
        bar = Progress(
            total_steps, f"{self.setup.name}: agents answering", unit="tok", enabled=None if self.show else False
        )
        t_phase = time.perf_counter()
        if self.prefetcher is not None and self.requests:
            self.prefetcher.submit(self.requests[0])  # the queue is known: hint the first request's article now
        for i, req in enumerate(self.requests):
            self.serve(i, req, t_phase, bar)
        bar.close()
        return t_phase

    def serve(self, i: int, req: Request, t_phase: float, bar: Progress) -> None:
        """Request i: retrieval, the prompt's cached prefix attached, the
        rest prefilled (time to first token), then greedy decoding."""
        if self.queue_hints is not None:
            self.queue_hints.before_request(i)
        t_req = time.perf_counter()
        req.t_start = t_req - t_phase
        req.docs = self.work.retrieve(req.question)
        cold = 0
        if req.docs[0] not in self.library.docs:  # lazy ingest: this request computes the article
            c, _ = self.library.add_article(req.docs[0], None, req.agent)
            cold = c
            self.library.ingest["computed_tokens"] += c
        prompt = self.work.prompts.prompt(req.docs, req.question)
        req.prompt_tokens = len(prompt)
        req.cold_doc_tokens = cold
        seq, kvb, tok = self._first_token(req, prompt, t_req, t_phase)
        if self.prefetcher is not None and i + 1 < len(self.requests):
            self.prefetcher.submit(self.requests[i + 1])  # speculate: the next request's article
        out = [tok]
        bar.update(1, f"agent {req.agent}")
        self._decode(seq, kvb, req, out, bar)
        bar.update(self.args.gen_tokens - len(out))
        stops = self.work.stops
        req.stop = "stop" if out[-1] in stops else "length"
        req.tokens = out
        req.answer = self.work.runner.tokenizer.decode(out, skip_special=True).strip()
        req.t_end = time.perf_counter() - t_phase
        self.occupancy.sample()
        old = self.conversations.pop(req.agent, None)
        if old is not None:
            old[0].free()  # the agent's previous conversation: its full blocks stay cached
        self.conversations[req.agent] = (seq, req)

    def _first_token(self, req: Request, prompt: List[int], t_req: float, t_phase: float) -> Tuple[Any, TimedKV, int]:
        """The prompt's sequence with its cached prefix attached and the
        rest prefilled: (sequence, its KV backend, first token). The tier
        bookkeeping between the match and the prefill is not counted in
        the time to first token."""
        bt = self.work.bt
        seq = self.eng.sequence(agent=req.agent)
        matched = seq.match_prefix(prompt)
        if matched >= len(prompt):  # all cached: recompute the last token for its logits
            seq.truncate(len(prompt) - 1)
            matched = len(prompt) - 1
        t_m = time.perf_counter()
        req.matched_tiers = tiers_of(seq, matched // bt)  # bookkeeping, not counted in TTFT
        self.block_tracer.blocks(seq, req.agent, "match", 0, matched // bt)
        self.block_tracer.blocks(seq, req.agent, "prefill")
        t_m2 = time.perf_counter()
        req.matched = matched
        req.prefilled = len(prompt) - matched
        kvb = self.backends.for_sequence(seq)
        logits = self.work.runner.prefill(kvb, prompt[matched:])
        tok = int(np.argmax(logits))
        t_first = time.perf_counter()
        req.ttft_s = (t_first - t_req) - (t_m2 - t_m)
        req.t_first = t_first - t_phase
        return seq, kvb, tok

    def _decode(self, seq, kvb: TimedKV, req: Request, out: List[int], bar: Progress) -> None:
        """Greedy decoding after the first token (in ``out``), up to
        ``--gen-tokens`` tokens or a stop token; each step's latency."""
        runner, stops = self.work.runner, self.work.stops
        tok = out[-1]
        for _ in range(1, self.args.gen_tokens):
            if tok in stops:
                break
            if self.queue_hints is not None:
                self.queue_hints.before_decode_step(seq, req.agent)
            self.block_tracer.blocks(seq, req.agent, "decode")
            before = self.times.snapshot()
            ts = time.perf_counter()
            logits = runner.decode_step(kvb, tok)
            tok = int(np.argmax(logits))
            dt = time.perf_counter() - ts
            req.itl_s.append(dt)
            self.decode.add(dt, before, self.times.snapshot())
            out.append(tok)
            bar.update(1)

    # ---- what the run left behind ----
    def _live(self) -> List[Any]:
        return self.library.sequences() + [s for s, _ in self.conversations.values()]

    def _result(self, stats0) -> SetupResult:
        work, setup, eng = self.work, self.setup, self.eng
        P = work.prompts
        d_stats = (eng.stats() - stats0).to_dict()
        tiers_end = tier_table(eng)
        live = self._live()
        reserve = max(len(P.prompt(r.docs, r.question)) + self.args.gen_tokens for r in self.requests)
        frag = fragmentation(eng, live, work.token_bytes, reserve)
        sysb = system_prompt_blocks(
            self.library.owner, work.system_full_blocks, len(P.system), setup.pin_system, work.block_bytes
        )
        persist = returning = None
        if setup.disk_path is not None:
            persist = self._persist(live)
            if persist is not None:
                returning = self._returning_agent()
        return SetupResult(
            name=setup.name,
            setup=setup,
            requests=self.requests,
            tiers_end=tiers_end,
            tiers_peak=self.occupancy.peak,
            stats_agents=d_stats,
            stats_total=eng.stats().to_dict(),
            ingest=self.library.ingest,
            kv_ms_per_token=self.decode.kv_ms_per_token(),
            decode_step_ms=self.decode.step_ms(),
            fragmentation=frag,
            system_blocks=sysb,
            timeline=self.occupancy.timeline,
            persist=persist,
            returning=returning,
            attention=work.runner.attention,
            notes=self.notes,
        )

    def _persist(self, live: List[Any]) -> Optional[Dict[str, Any]]:
        """Persists every live sequence (for the restart): how many and how
        long, or None (with a note) where the build cannot."""
        t = time.perf_counter()
        n = 0
        try:
            for s in live:
                s.persist()
                n += 1
        except errors.UnsupportedError as exc:
            self.notes.append(f"persist unavailable: {exc.message}")
            return None
        return {"sequences": n, "seconds": time.perf_counter() - t}

    def _returning_agent(self) -> Optional[Dict[str, Any]]:
        """The first agent's conversation, for the restart: it comes back
        with a follow-up question."""
        if not self.conversations:
            return None
        P, stops = self.work.prompts, self.work.stops
        first_agent = min(self.conversations)
        seq, req = self.conversations[first_agent]
        convo = P.prompt(req.docs, req.question) + [t for t in req.tokens if t not in stops]
        return {
            "agent": first_agent,
            "question": req.question,
            "doc": self.work.corpus[req.docs[0]].name,
            "conversation_tokens": len(convo),
            "persisted_tokens": len(seq),
            "tokens": P.follow_up(convo),
            "answer": req.answer,
        }
