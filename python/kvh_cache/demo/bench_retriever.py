"""Benchmark of the speculative retriever: stall time in ``acquire`` on a
multi-agent trace, with speculative prefetch vs without, vs the seed's
synchronous naive offload.

The workload (deterministic for a seed):

* **Corpus.** ``topics`` topics x ``docs`` documents x ``sections``
  sections; each section is one chunk of ``chunk_tokens`` words of
  topic-coherent synthetic text: shared function words, the topic's
  vocabulary, the document's vocabulary, the section's own key terms,
  and, at its end, a lead-in naming terms of the next section. One token
  per word. The KV of every chunk is computed once (:class:`SyntheticKV`)
  and stored in kvh under its content hash; the device tier holds only
  ``device_chunks`` chunks, the host tier ``host_chunks``, the rest spills
  to a disk tier in a temporary directory.
* **Agents.** ``agents`` agents take turns (one step each, round robin, as
  agents time-sharing one GPU). An agent works on a task (a topic) for 4-8
  steps, then moves to another topic; the topics are shared, so agents
  alternate between topics over one corpus. Each step it needs 1-2
  chunks: mostly the next section of the document it reads, sometimes a
  cross-reference elsewhere in the topic, and with probability
  ``surprise`` a random chunk of any topic that nothing in its context
  announces. It acquires them (that is the stall measured), reads them,
  appends them and its own generated text to its context, then "thinks"
  for ``think_ms`` (a sleep: the GPU generating its next tokens while the
  host is free; 8 ms by default, far shorter than a real agent step of
  tens of tokens at tens of ms each, so the time prefetch has to overlap
  is pessimistic). Its generated text mentions what it will look up next
  (an ``intent`` share of its words are key terms of its next chunks);
  with a draft model configured, the draft's projected continuation does
  so more strongly (``draft_intent``). These shares are the knobs of how
  predictable the agents are; precision and recall are measured, not
  assumed.

Modes, each on a fresh engine with the same corpus, budgets and trace:

``speculative``
    after each step the retriever embeds the agent's recent context (+ the
    draft continuation), queries the index (Qdrant embedded local mode by
    default) for the top-k chunks and issues prefetch hints on a
    background thread; the hints overlap the agents' think time.
``speculative_nodraft``
    the same without the draft continuation.
``no_prefetch``
    the same asynchronous engine; acquire pulls from host/disk on demand.
``naive_sync``
    the seed's synchronous naive offload: an engine with
    ``migration_threads=0`` (every copy, demotions included, runs in the
    caller) and an explicit synchronous ``migrate(device)`` of the chunk
    before each use.

Stall = wall time of the acquire call(s) (plus the synchronous migrate in
``naive_sync``), summed over every chunk access of the trace; kvh's own
``acquire_stall_ns`` is reported beside it. The agents and the retriever's
background thread share one interpreter: the run uses a 0.5 ms thread
switch interval (``--switch-interval-ms``) so that the predictor holding
the GIL does not add up to 5 ms to an agent's acquire. The target: stall
with prefetch <= 25% of stall without it. Precision / recall are the
retriever's (see :mod:`kvh_cache.retriever`); the prefetch counters are kvh's.

    python -m kvh_cache.demo.bench_retriever [--json] [--quick] [--reps N] [--strict] ...

With ``--json``: one JSON object per line (``scenario``, ``metric``,
``value``, ``unit``, the parameters, ``baseline`` + ``ratio`` where a
baseline ran in the same process, ratio oriented so that higher is better:
for stall times it is baseline / value). Exit status: 0 ok, 1 failed (a
kvh call, or K/V that did not verify), 2 usage, 3 a target was missed
(``--strict``) or a dependency (qdrant-client) is missing.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["main", "build_parser", "add_arguments", "run", "run_bench", "make_corpus", "make_trace", "MODES"]

SCENARIO = "retriever"
MODES = ("speculative", "speculative_nodraft", "no_prefetch", "naive_sync")
TARGET_STALL_FRACTION = 0.25

_COMMON = (
    "the of and to in a is that for it as with was on be by this are from or at an which have not has but "
    "were can its also more these than into their other only such two may each when both between over under "
    "most some all new first used after about through during without within where while however then thus "
    "because since although often usually here there we our one they them"
).split()
_TOPICS = (
    "astronomy",
    "cardiology",
    "compilers",
    "volcanology",
    "baroque",
    "maritime",
    "mycology",
    "cryptography",
    "glaciology",
    "typography",
    "beekeeping",
    "metallurgy",
    "linguistics",
    "hydrology",
    "optics",
    "forestry",
)
_ONSETS = (
    "b",
    "c",
    "d",
    "f",
    "g",
    "h",
    "j",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "z",
    "br",
    "cr",
    "dr",
    "fl",
    "gr",
    "kl",
    "pr",
    "st",
    "tr",
    "sh",
    "th",
    "ch",
    "ph",
)
_VOWELS = ("a", "e", "i", "o", "u", "ae", "io", "ou", "ei")
_CODAS = ("", "", "n", "r", "s", "l", "x", "th", "m", "nd", "rk", "st")


# ---------------------------------------------------------------------------------
# corpus and trace
# ---------------------------------------------------------------------------------
@dataclass
class Chunk:
    topic: int
    doc: int
    section: int
    words: List[str]
    keys: List[str]

    @property
    def text(self) -> str:
        return " ".join(self.words)


@dataclass
class Corpus:
    chunks: List[Chunk]
    vocab: Dict[str, int]
    topics: int
    docs: int
    sections: int

    def index(self, topic: int, doc: int, section: int) -> int:
        return (topic * self.docs + doc) * self.sections + section

    def tokens(self, i: int) -> np.ndarray:
        return np.array([self.vocab[w] for w in self.chunks[i].words], np.int32)


class _Words:
    """Unique pseudo-words from syllables (deterministic)."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.seen = set(_COMMON) | set(_TOPICS)

    def make(self, n: int) -> List[str]:
        out = []
        while len(out) < n:
            syl = int(self.rng.integers(2, 4))
            w = "".join(str(self.rng.choice(_ONSETS)) + str(self.rng.choice(_VOWELS)) for _ in range(syl))
            w += str(self.rng.choice(_CODAS))
            if w not in self.seen:
                self.seen.add(w)
                out.append(w)
        return out


def make_corpus(topics: int, docs: int, sections: int, chunk_words: int, seed: int = 1) -> Corpus:
    """The synthetic corpus (see the module doc)."""
    rng = np.random.default_rng([seed, 0xC0])
    gen = _Words(rng)
    topic_vocab = [[_TOPICS[t % len(_TOPICS)]] + gen.make(80) for t in range(topics)]
    doc_vocab = [[gen.make(25) for _ in range(docs)] for _ in range(topics)]
    keys = [[[gen.make(12) for _ in range(sections)] for _ in range(docs)] for _ in range(topics)]
    chunks: List[Chunk] = []
    lead = max(1, int(round(chunk_words * 0.15)))
    for t in range(topics):
        for d in range(docs):
            for s in range(sections):
                own = keys[t][d][s]
                nxt = keys[t][d][s + 1] if s + 1 < sections else None
                words: List[str] = []
                for i in range(chunk_words):
                    r = rng.random()
                    if nxt is not None and i >= chunk_words - lead and r < 0.5:
                        words.append(str(rng.choice(nxt)))
                    elif r < 0.35:
                        words.append(str(rng.choice(_COMMON)))
                    elif r < 0.65:
                        words.append(str(rng.choice(topic_vocab[t])))
                    elif r < 0.75:
                        words.append(str(rng.choice(doc_vocab[t][d])))
                    else:
                        words.append(str(rng.choice(own)))
                chunks.append(Chunk(t, d, s, words, own))
    vocab: Dict[str, int] = {}
    for c in chunks:
        for w in c.words:
            vocab.setdefault(w, 1000 + len(vocab))
    return Corpus(chunks, vocab, topics, docs, sections)


@dataclass
class Step:
    needs: List[int]  # chunk indices acquired at this step
    surprise: List[bool]  # per need: announced by nothing in the context
    generated: str = ""  # the agent's own text after the step (mentions its next needs)
    draft: str = ""  # a draft model's projected continuation after the step


def make_trace(
    corpus: Corpus,
    agents: int,
    steps: int,
    *,
    seed: int = 1,
    surprise: float = 0.05,
    intent: float = 0.25,
    draft_intent: float = 0.5,
    gen_words: int = 48,
    draft_words: int = 24,
) -> List[List[Step]]:
    """Per agent, ``steps`` steps (see the module doc)."""
    T, D, S = corpus.topics, corpus.docs, corpus.sections
    n_chunks = len(corpus.chunks)
    trace: List[List[Step]] = []
    for a in range(agents):
        rng = np.random.default_rng([seed, 0xA6, a])
        topic = (a * max(1, T // max(1, agents))) % T
        doc = int(rng.integers(D))
        sec = 0
        left = int(rng.integers(4, 9))
        steps_a: List[Step] = []
        for _ in range(steps):
            if left == 0:  # a new task: another topic
                topic = (topic + 1 + int(rng.integers(max(1, T - 1)))) % T
                doc, sec, left = int(rng.integers(D)), 0, int(rng.integers(4, 9))
                primary = corpus.index(topic, doc, 0)
                surp = False
            elif rng.random() < surprise:
                primary = int(rng.integers(n_chunks))
                surp = True
            elif rng.random() < 0.65:
                sec += 1
                if sec >= S:
                    doc, sec = (doc + 1) % D, 0
                primary = corpus.index(topic, doc, sec)
                surp = False
            else:
                doc, sec = int(rng.integers(D)), int(rng.integers(S))
                primary = corpus.index(topic, doc, sec)
                surp = False
            needs, surprises = [primary], [surp]
            if rng.random() < 0.35:
                other = corpus.index(topic, int(rng.integers(D)), int(rng.integers(S)))
                if other != primary:
                    needs.append(other)
                    surprises.append(False)
            left -= 1
            steps_a.append(Step(needs, surprises))
        # what the agent writes after step i talks about the needs of step i + 1
        for i, st in enumerate(steps_a):
            nxt = steps_a[i + 1] if i + 1 < len(steps_a) else None
            announced = [] if nxt is None else [c for c, s in zip(nxt.needs, nxt.surprise) if not s]
            cur_topic = corpus.chunks[st.needs[0]].topic
            st.generated = _agent_text(corpus, rng, announced, cur_topic, gen_words, intent)
            st.draft = _agent_text(corpus, rng, announced, cur_topic, draft_words, draft_intent)
        trace.append(steps_a)
    return trace


def _agent_text(
    corpus: Corpus, rng: np.random.Generator, announced: List[int], topic: int, n: int, intent: float
) -> str:
    words = []
    n_intent = int(round(n * intent)) if announced else 0
    for i in range(n_intent):
        c = corpus.chunks[announced[i % len(announced)]]
        words.append(str(rng.choice(c.keys)))
    topic_words = sorted({w for c in corpus.chunks if c.topic == topic for w in c.words} - set(_COMMON))
    for _ in range(n - n_intent):
        words.append(str(rng.choice(_COMMON)) if rng.random() < 0.6 else str(rng.choice(topic_words)))
    rng.shuffle(words)
    return " ".join(words)


# ---------------------------------------------------------------------------------
# one mode
# ---------------------------------------------------------------------------------
@dataclass
class ModeResult:
    mode: str
    stall_s: float = 0.0
    kvh_stall_s: float = 0.0
    accesses: int = 0
    access_p50_ms: float = 0.0
    access_p99_ms: float = 0.0
    trace_s: float = 0.0
    device_hit_rate: float = 0.0
    resident_rate: float = 0.0
    stats: Dict[str, int] = field(default_factory=dict)
    precision: Optional[float] = None
    recall: Optional[float] = None
    predict_p50_ms: Optional[float] = None
    verified: int = 0
    ok: bool = True
    notes: List[str] = field(default_factory=list)


def _engine(args: argparse.Namespace, data_dir: Path, threads: Optional[int]):
    import kvh_cache as kvh

    kw: Dict[str, Any] = dict(
        num_layers=args.layers,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        block_tokens=args.block_tokens,
        dtype=args.dtype,
        backend=args.backend,
        model_salt=0x6B76685245540000 + args.seed,
        log_level="error",
    )
    probe = kvh.Engine(**dict(kw, backend="cpu"), device_bytes=1 << 20, host_bytes=1 << 20)  # block size only
    bb = probe.block_bytes
    probe.close()
    per_chunk = -(-args.chunk_tokens // args.block_tokens)
    kw.update(
        device_bytes=args.device_chunks * per_chunk * bb,
        host_bytes=args.host_chunks * per_chunk * bb,
        disk_path=str(data_dir),
        disk_bytes=max(64 << 20, 4 * args.total_chunks * per_chunk * bb),
        disk_reset_on_mismatch=True,
    )
    if threads is not None:
        kw["migration_threads"] = threads
    return kvh.Engine(**kw)


def run_mode(
    mode: str, args: argparse.Namespace, corpus: Corpus, trace: List[List[Step]], workdir: Path, index: Any = None
) -> ModeResult:
    """Runs the trace in one mode on a fresh engine."""
    from .. import errors
    from ..retriever import SpeculativeRetriever, SyntheticKV
    from ..types import Tier

    res = ModeResult(mode)
    data_dir = workdir / f"store-{mode}"
    shutil.rmtree(data_dir, ignore_errors=True)
    eng = _engine(args, data_dir, 0 if mode == "naive_sync" else args.migration_threads)
    retr: Optional[SpeculativeRetriever] = None
    speculative = mode.startswith("speculative")
    try:
        kv = SyntheticKV(eng, seed=args.seed)
        n = len(corpus.chunks)
        seqs: List[Any] = []
        if speculative:
            retr = SpeculativeRetriever(
                eng,
                index=index,
                embedder=args.embedder_obj,
                kv_fn=kv,
                top_k=args.top_k,
                context_chars=args.context_chars,
            )
            recs = retr.add_chunks(
                [
                    {
                        "tokens": corpus.tokens(i),
                        "text": corpus.chunks[i].text,
                        "doc": f"t{corpus.chunks[i].topic}d{corpus.chunks[i].doc}",
                        "index": corpus.chunks[i].section,
                    }
                    for i in range(n)
                ]
            )
            ids = [r.chunk_id for r in recs]
            seqs = [retr.sequence(c) for c in ids]
        else:
            ids = list(range(n))
            for i in range(n):
                s = eng.sequence()
                kv(s, corpus.tokens(i))
                seqs.append(s)
        lengths = [len(corpus.chunks[i].words) for i in range(n)]
        handles = [s.blocks() for s in seqs]  # borrowed; the chunk sequences never change

        def resident(c: int) -> bool:
            for b in handles[c]:
                info = b.info()
                if info.tier != Tier.DEVICE or info.in_flight:
                    return False
            return True

        n_resident = 0
        time.sleep(args.settle_ms / 1000.0)  # let the fill's write-behind settle (same for every mode)
        contexts = ["" for _ in trace]
        lat: List[float] = []
        before = eng.stats()
        if retr is not None:
            retr.reset_metrics()
        t_start = time.perf_counter()
        steps = len(trace[0]) if trace else 0
        n_access = 0
        for t in range(steps):
            for a, agent_steps in enumerate(trace):
                st = agent_steps[t]
                holds = []
                for c in st.needs:
                    seq = seqs[c]
                    n_resident += resident(c)
                    t0 = time.perf_counter()
                    if mode == "naive_sync":
                        seq.migrate(Tier.DEVICE, 0, lengths[c])
                        h = seq.acquire(0, lengths[c])
                    elif retr is not None:
                        h = retr.acquire(ids[c], agent=a)
                    else:
                        h = seq.acquire(0, lengths[c])
                    dt = time.perf_counter() - t0
                    lat.append(dt)
                    holds.append(h)
                    if args.verify_every and n_access % args.verify_every == 0:
                        layer = n_access % eng.num_layers
                        if kv.check(seq, corpus.tokens(c), layer):
                            res.verified += 1
                        else:
                            res.ok = False
                            res.notes.append(f"{mode}: K/V of chunk {c} did not verify after access {n_access}")
                    n_access += 1
                for h in holds:
                    h.release()
                ctx = contexts[a] + " " + " ".join(corpus.chunks[c].text for c in st.needs) + " " + st.generated
                contexts[a] = ctx[-4 * max(args.context_chars, 1) :]
                if retr is not None and t + 1 < steps:
                    draft = st.draft if mode == "speculative" else None
                    retr.prefetch_async(contexts[a], agent=a, draft_text=draft)
                if args.think_ms > 0:
                    time.sleep(args.think_ms / 1000.0)
        res.trace_s = time.perf_counter() - t_start
        d = eng.stats() - before
        res.stats = d.to_dict()
        res.stall_s = float(sum(lat))
        res.kvh_stall_s = d.acquire_stall_ns / 1e9
        res.accesses = len(lat)
        if lat:
            srt = sorted(lat)
            res.access_p50_ms = 1e3 * statistics.median(srt)
            res.access_p99_ms = 1e3 * srt[min(len(srt) - 1, int(round(0.99 * (len(srt) - 1))))]
        res.device_hit_rate = d.hits_device / d.lookups if d.lookups else 0.0
        res.resident_rate = n_resident / len(lat) if lat else 0.0
        if retr is not None:
            retr.end_windows()
            m = retr.metrics()
            res.precision, res.recall = m.precision, m.recall
            res.predict_p50_ms = 1e3 * m.predict_seconds_p50
            res.stats = (eng.stats() - before).to_dict()  # after the last background hints
    except errors.Error as exc:
        res.ok = False
        res.notes.append(f"{mode}: {type(exc).__name__}: {exc}")
    finally:
        if retr is not None:
            retr.close()
        eng.close()
        shutil.rmtree(data_dir, ignore_errors=True)
    return res


# ---------------------------------------------------------------------------------
# the benchmark
# ---------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    p.add_argument("--quick", action="store_true", help="a small run for CI smoke tests (a few seconds)")
    p.add_argument("--reps", type=int, default=1, help="runs of every mode; the median is reported (default 1)")
    p.add_argument("--seed", type=int, default=1, help="seed of the corpus and the trace (default 1)")
    p.add_argument("--strict", action="store_true", help="exit with status 3 when a target is missed")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--verbose", action="store_true", help="progress on stderr")
    g = p.add_argument_group("workload")
    g.add_argument("--agents", type=int, default=None, help="agents (default 4; --quick 2)")
    g.add_argument("--steps", type=int, default=None, help="steps per agent (default 40; --quick 12)")
    g.add_argument("--topics", type=int, default=None, help="topics (default 8; --quick 4)")
    g.add_argument("--docs", type=int, default=None, help="documents per topic (default 3; --quick 2)")
    g.add_argument("--sections", type=int, default=None, help="sections (chunks) per document (default 4; --quick 3)")
    g.add_argument("--chunk-tokens", type=int, default=128, help="tokens (words) per chunk (default 128)")
    g.add_argument("--think-ms", type=float, default=None, help="agent think time per step, ms (default 8; --quick 2)")
    g.add_argument(
        "--surprise",
        type=float,
        default=0.05,
        help="probability that a needed chunk is announced by nothing (default 0.05)",
    )
    g.add_argument(
        "--intent",
        type=float,
        default=0.25,
        help="share of the agent's own words naming what it needs next (default 0.25)",
    )
    g.add_argument(
        "--draft-intent",
        type=float,
        default=0.5,
        help="the same for the draft model's projected continuation (default 0.5)",
    )
    g = p.add_argument_group("retriever")
    g.add_argument("--top-k", type=int, default=None, help="chunks predicted per step (default 4; --quick 3)")
    g.add_argument("--context-chars", type=int, default=1536, help="context characters embedded (default 1536)")
    g.add_argument("--embedder", default="hash", help="hash | hash:DIM | st:MODEL (default hash)")
    g.add_argument("--index", default="qdrant", choices=["qdrant", "numpy"], help="chunk index (default qdrant)")
    g.add_argument("--qdrant-url", default=None, help="a Qdrant server instead of the embedded local mode")
    g.add_argument("--qdrant-path", default=None, help="embedded Qdrant directory (default: a temporary one)")
    g = p.add_argument_group("engine")
    g.add_argument("--device-chunks", type=int, default=None, help="device tier size in chunks (default 24; --quick 8)")
    g.add_argument("--host-chunks", type=int, default=None, help="host tier size in chunks (default 24; --quick 6)")
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--kv-heads", type=int, default=4)
    g.add_argument("--head-dim", type=int, default=64)
    g.add_argument("--block-tokens", type=int, default=16)
    g.add_argument("--dtype", default="f16", choices=["f32", "f16", "bf16"])
    g.add_argument(
        "--backend",
        default="cpu",
        choices=["cpu", "auto", "cuda"],
        help="device tier: the CPU backend's arena (default) or GPU memory",
    )
    g.add_argument("--migration-threads", type=int, default=2, help="of the asynchronous engines (default 2)")
    g.add_argument("--data-dir", type=Path, default=None, help="where the disk tiers go (default: a temporary dir)")
    g.add_argument("--verify-every", type=int, default=7, help="check the K/V of every Nth access (0: never)")
    g.add_argument("--settle-ms", type=float, default=50.0, help="pause after filling the corpus (default 50)")
    g.add_argument(
        "--switch-interval-ms",
        type=float,
        default=0.5,
        help="Python's thread switch interval during the run (default 0.5; the interpreter's own is 5): "
        "the agents and the retriever's background predictor share one interpreter, and with 5 ms "
        "the predictor holding the GIL would add up to 5 ms to an agent's acquire",
    )


def build_parser(prog: str = "python -m kvh_cache.demo.bench_retriever") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        epilog=__doc__[__doc__.index("Modes,") :] if "Modes," in __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    return p


def _defaults(args: argparse.Namespace) -> None:
    q = args.quick
    for name, full, quick in (
        ("agents", 4, 2),
        ("steps", 40, 12),
        ("topics", 8, 4),
        ("docs", 3, 2),
        ("sections", 4, 3),
        ("think_ms", 8.0, 2.0),
        ("top_k", 4, 3),
        ("device_chunks", 24, 8),
        ("host_chunks", 24, 6),
    ):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    args.total_chunks = args.topics * args.docs * args.sections


def _check(args: argparse.Namespace) -> Optional[str]:
    for name in (
        "agents",
        "steps",
        "topics",
        "docs",
        "sections",
        "chunk_tokens",
        "top_k",
        "device_chunks",
        "host_chunks",
        "reps",
        "layers",
        "kv_heads",
        "head_dim",
        "block_tokens",
    ):
        if getattr(args, name) <= 0:
            return f"--{name.replace('_', '-')} must be > 0"
    for name in ("think_ms", "settle_ms", "switch_interval_ms"):
        # NaN and inf pass the range checks below and broke the run later
        # (an abort in the switching thread, timestamps out of range).
        value = getattr(args, name)
        if value is not None and not math.isfinite(value):
            return f"--{name.replace('_', '-')} must be a finite number of milliseconds, not {value}"
    if (
        args.think_ms < 0
        or args.verify_every < 0
        or args.settle_ms < 0
        or args.migration_threads <= 0
        or args.switch_interval_ms <= 0
    ):
        return (
            "--think-ms, --verify-every and --settle-ms must be >= 0; --migration-threads and --switch-interval-ms > 0"
        )
    for name in ("surprise", "intent", "draft_intent"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            return f"--{name.replace('_', '-')} must be in [0, 1]"
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        return f"--modes: unknown {bad or modes}; choose from {', '.join(MODES)}"
    args.mode_list = modes
    return None


def _median(vals: List[Optional[float]]) -> Optional[float]:
    v = [x for x in vals if x is not None]
    return float(statistics.median(v)) if v else None


def run_bench(args: argparse.Namespace, log=None) -> Tuple[List[Dict[str, Any]], bool, List[str]]:
    """Runs the benchmark for parsed ``args`` (see :func:`build_parser`).
    Returns (rows, ok, notes): rows are the JSON objects of ``--json``."""
    from ..embed import open_embedder
    from ..retriever import open_chunk_index

    _defaults(args)
    err = _check(args)
    if err:
        raise ValueError(err)
    say = log or (lambda msg: None)
    corpus = make_corpus(args.topics, args.docs, args.sections, args.chunk_tokens, args.seed)
    trace = make_trace(
        corpus,
        args.agents,
        args.steps,
        seed=args.seed,
        surprise=args.surprise,
        intent=args.intent,
        draft_intent=args.draft_intent,
    )
    args.embedder_obj = open_embedder(args.embedder)
    tmp = tempfile.mkdtemp(prefix="kvh-bench-retriever-", dir=str(args.data_dir) if args.data_dir else None)
    workdir = Path(tmp)
    index = None
    notes: List[str] = []
    results: Dict[str, List[ModeResult]] = {m: [] for m in args.mode_list}
    try:
        if any(m.startswith("speculative") for m in args.mode_list):
            if args.index == "numpy":
                index = open_chunk_index("numpy", args.embedder_obj.dim)
                index_name = "numpy"
            else:
                opts: Dict[str, Any] = {"collection": "kvh_bench_retriever", "recreate": True}
                if args.qdrant_url:
                    opts["url"] = args.qdrant_url
                else:
                    opts["path"] = args.qdrant_path or str(workdir / "qdrant")
                index = open_chunk_index("qdrant", args.embedder_obj.dim, **opts)
                index_name = f"qdrant-{index.mode}"
        else:
            index_name = "none"
        old_switch = sys.getswitchinterval()
        sys.setswitchinterval(args.switch_interval_ms / 1000.0)
        try:
            _reps(args, corpus, trace, workdir, index, results, notes, say)
        finally:
            sys.setswitchinterval(old_switch)
    finally:
        if index is not None:
            index.close()
        shutil.rmtree(tmp, ignore_errors=True)
    ok = all(r.ok for rs in results.values() for r in rs)
    rows = _rows(args, results, index_name)
    return rows, ok, notes


def _reps(
    args: argparse.Namespace,
    corpus: Corpus,
    trace: List[List[Step]],
    workdir: Path,
    index: Any,
    results: Dict[str, List[ModeResult]],
    notes: List[str],
    say: Any,
) -> None:
    for rep in range(args.reps):
        order = list(args.mode_list)
        if rep % 2:
            order.reverse()  # interleave, so drift does not favour one mode
        for mode in order:
            say(f"rep {rep + 1}/{args.reps}: {mode}")
            r = run_mode(mode, args, corpus, trace, workdir, index)
            results[mode].append(r)
            notes.extend(r.notes)


def _rows(args: argparse.Namespace, results: Dict[str, List["ModeResult"]], index_name: str) -> List[Dict[str, Any]]:
    params = {
        "agents": args.agents,
        "steps": args.steps,
        "chunks": args.total_chunks,
        "chunk_tokens": args.chunk_tokens,
        "think_ms": args.think_ms,
        "top_k": args.top_k,
        "device_chunks": args.device_chunks,
        "host_chunks": args.host_chunks,
        "backend": args.backend,
        "index": index_name,
        "embedder": args.embedder_obj.name,
    }
    med: Dict[str, Dict[str, Any]] = {}
    for mode, rs in results.items():
        if not rs:
            continue
        med[mode] = {
            "stall_ms": 1e3 * _median([r.stall_s for r in rs]),
            "kvh_stall_ms": 1e3 * _median([r.kvh_stall_s for r in rs]),
            "p50": _median([r.access_p50_ms for r in rs]),
            "p99": _median([r.access_p99_ms for r in rs]),
            "trace_s": _median([r.trace_s for r in rs]),
            "hit": _median([r.device_hit_rate for r in rs]),
            "resident": _median([r.resident_rate for r in rs]),
            "precision": _median([r.precision for r in rs]),
            "recall": _median([r.recall for r in rs]),
            "predict_ms": _median([r.predict_p50_ms for r in rs]),
            "accesses": rs[0].accesses,
            "stats": {k: _median([r.stats.get(k, 0) for r in rs]) for k in rs[0].stats},
        }
    rows: List[Dict[str, Any]] = []

    def row(metric: str, value: Optional[float], unit: str, mode: str, **extra: Any) -> Dict[str, Any]:
        r: Dict[str, Any] = {
            "scenario": SCENARIO,
            "metric": metric,
            "value": None if value is None or not math.isfinite(value) else round(value, 6),
            "unit": unit,
            "mode": mode,
        }
        r.update(params)
        r.update(extra)
        rows.append(r)
        return r

    def ratio(base: float, ours: float) -> Optional[float]:
        return round(base / ours, 4) if ours > 0 else None  # no stall at all: no finite ratio

    for mode in MODES:
        if mode not in med:
            continue
        m = med[mode]
        r = row("acquire_stall", m["stall_ms"], "ms", mode, accesses=m["accesses"])
        if mode.startswith("speculative") and "no_prefetch" in med:
            b = med["no_prefetch"]["stall_ms"]
            r.update(
                baseline=round(b, 6),
                baseline_mode="no_prefetch",
                ratio=ratio(b, m["stall_ms"]),
                note="ratio = baseline / value (stall: lower is better)",
            )
            if mode == "speculative":
                r["target"] = f"ratio >= {1 / TARGET_STALL_FRACTION:g}"
                r["met"] = bool(b > 0 and m["stall_ms"] <= TARGET_STALL_FRACTION * b)
        if mode.startswith("speculative") and "naive_sync" in med:
            b = med["naive_sync"]["stall_ms"]
            row(
                "acquire_stall",
                m["stall_ms"],
                "ms",
                mode,
                accesses=m["accesses"],
                baseline=round(b, 6),
                baseline_mode="naive_sync",
                ratio=ratio(b, m["stall_ms"]),
                note="ratio = baseline / value (stall: lower is better)",
            )
        if mode == "no_prefetch" and "naive_sync" in med:
            b = med["naive_sync"]["stall_ms"]
            r.update(
                baseline=round(b, 6),
                baseline_mode="naive_sync",
                ratio=ratio(b, m["stall_ms"]),
                note="ratio = baseline / value (stall: lower is better)",
            )
        if mode.startswith("speculative") and "no_prefetch" in med and med["no_prefetch"]["stall_ms"] > 0:
            frac = m["stall_ms"] / med["no_prefetch"]["stall_ms"]
            fr = row(
                "stall_fraction",
                frac,
                "fraction",
                mode,
                baseline_mode="no_prefetch",
                note="stall with prefetch / stall without it",
            )
            if mode == "speculative":
                fr["target"] = f"value <= {TARGET_STALL_FRACTION:g}"
                fr["met"] = bool(frac <= TARGET_STALL_FRACTION)
        if mode != "naive_sync":
            row(
                "kvh_acquire_stall",
                m["kvh_stall_ms"],
                "ms",
                mode,
                note="kvh_stats.acquire_stall_ns (time acquire waited for copies)",
            )
        row("access_p50", m["p50"], "ms", mode)
        row("access_p99", m["p99"], "ms", mode)
        row(
            "resident_at_access",
            m["resident"],
            "fraction",
            mode,
            note="accesses whose chunk was wholly in the device tier already",
        )
        row("trace_time", m["trace_s"], "s", mode, note="wall time of the trace, think time included")
        if mode.startswith("speculative"):
            row("prefetch_precision", m["precision"], "fraction", mode, note="predicted chunks used next / predicted")
            row("prefetch_recall", m["recall"], "fraction", mode, note="used chunks that had been predicted / used")
            row("predict_latency_p50", m["predict_ms"], "ms", mode, note="embed + index query + hints, per step")
            s = m["stats"]
            for k in ("prefetch_issued", "prefetch_useful", "prefetch_late", "prefetch_wasted", "prefetch_skipped"):
                row(k, s.get(k, 0), "blocks", mode)
    return rows


def _table(rows: List[Dict[str, Any]]) -> str:
    from .._progress import table

    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    body = []
    for r in rows:
        tgt = ""
        if "target" in r:
            tgt = f"{r['target']} ({'met' if r['met'] else 'MISSED'})"
        body.append(
            [
                r["metric"],
                r["mode"],
                f"{fmt(r['value'])} {r['unit']}",
                f"{fmt(r['baseline'])} ({r['baseline_mode']})" if "baseline" in r else "",
                fmt(r.get("ratio")) if "ratio" in r else "",
                tgt,
            ]
        )
    p = rows[0] if rows else {}
    title = (
        f"kvh bench retriever: {p.get('agents')} agents x {p.get('steps')} steps, {p.get('chunks')} chunks of "
        f"{p.get('chunk_tokens')} tokens, device {p.get('device_chunks')} / host {p.get('host_chunks')} chunks "
        f"+ disk, think {p.get('think_ms')} ms, top-{p.get('top_k')}, index {p.get('index')}, "
        f"embedder {p.get('embedder')}"
    )
    return table(body, ["metric", "mode", "value", "baseline", "ratio", "target"], title=title, align="llrrrl")


def run(args: argparse.Namespace, out=None, missed_status: int = 3) -> int:
    """Runs with parsed arguments, prints, returns the exit status
    (``missed_status`` when a target is missed under --strict)."""
    out = out or sys.stdout
    verbose = getattr(args, "verbose", False)
    log = (lambda msg: print(f"kvh bench retriever: {msg}", file=sys.stderr, flush=True)) if verbose else None
    try:
        rows, ok, notes = run_bench(args, log)
    except ValueError as exc:
        print(f"kvh bench retriever: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"kvh bench retriever: {exc}", file=sys.stderr)
        return 3
    except RuntimeError as exc:
        print(f"kvh bench retriever: {exc}", file=sys.stderr)
        return 1
    if args.json:
        for r in rows:
            out.write(json.dumps(r) + "\n")
    else:
        out.write(_table(rows) + "\n")
    out.flush()
    for n in dict.fromkeys(notes):
        print(f"kvh bench retriever: {n}", file=sys.stderr)
    if not ok:
        return 1
    missed = [r for r in rows if "met" in r and not r["met"]]
    if missed and args.strict:
        print(
            "kvh bench retriever: target missed: " + ", ".join(f"{r['metric']} ({r['target']})" for r in missed),
            file=sys.stderr,
        )
        return missed_status
    return 0


def main(argv: Optional[Sequence[str]] = None, out=None, missed_status: int = 3) -> int:
    """``python -m kvh_cache.demo.bench_retriever [args]`` (also ``kvh bench retriever``,
    which passes ``missed_status=1``: for kvh, 3 means "not available")."""
    args = build_parser().parse_args(None if argv is None else list(argv))
    return run(args, out, missed_status)


if __name__ == "__main__":
    sys.exit(main())
