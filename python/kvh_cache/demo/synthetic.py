"""``kvh demo --synthetic``: a multi-agent workload with synthetic KV through
every tier (no model; ``kvh demo`` itself runs SmolLM2, see
:mod:`kvh_cache.demo.agents`).

What it does:

* a shared system prompt is written once, pinned, and attached by every
  agent through the prefix index (``match_prefix``: no copy, no recompute);
* a corpus of document chunks is cached as sequences; the device budget is
  small, so they spill to the host tier and to the disk tier;
* each agent walks through the chunks it needs; one step ahead, a
  background thread asks the retriever (``kvh_cache.retrieval``: Qdrant through
  ``kvh_cache.retriever`` when present, else NumPy) for the chunks closest to the
  agent's intent and issues prefetch hints for them;
* every read is checked against the data written (deterministic synthetic
  K/V), decode attention runs on the agents' sequences when the build has
  the kernels (checked against NumPy), tool calls fork the agent sequence
  (copy-on-write) and must not disturb the parent;
* with a disk tier the chunks are persisted, the engine is closed and a new
  one reopens the store to find the shared prompt on disk (a restart).

The result is a summary (per-agent table, tier occupancy, hit rates,
prefetch counters, bytes moved) or one JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import math
import queue
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import numpy as np

from .. import errors
from .._progress import Progress, human_bytes, human_rate, parse_dir, parse_size, table
from ..retrieval import PrefetchPlanner, available_kinds, open_chunk_index
from ..types import DType, Tier, f32_to_bf16
from .store_files import empty_for_fresh

if TYPE_CHECKING:  # the binding loads when an engine opens, so `kvh --help` works without it
    from ..engine import Engine, Sequence

# Agents a run may have: each keeps a report, so far fewer than the 2^32 ids.
MAX_AGENTS = 1 << 16
# The engine's model_salt is this plus --seed, a 64-bit value.
SALT_BASE = 0x6B7668
MAX_SEED = (1 << 64) - 1 - SALT_BASE
# The engine's geometry limits, checked here to name the option rather than
# the kvh_config field.
GEOMETRY_LIMITS = {"layers": 4096, "kv_heads": 1024, "head_dim": 1024, "block_tokens": 256}
DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2}

__all__ = ["add_arguments", "run", "DemoResult"]

EMBED_DIM = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--agents", type=int, default=4, help="number of agents (default 4)")
    g.add_argument("--steps", type=int, default=24, help="steps per agent (default 24)")
    g.add_argument("--chunks", type=int, default=32, help="document chunks in the corpus (default 32)")
    g.add_argument("--chunk-tokens", type=int, default=64, help="tokens per chunk (default 64)")
    g.add_argument("--prompt-tokens", type=int, default=128, help="shared system prompt tokens (default 128)")
    g.add_argument("--gen-tokens", type=int, default=8, help="tokens each agent appends per step (default 8)")
    g.add_argument("--fork-every", type=int, default=6, help="a tool-call fork every N steps (default 6; 0: never)")
    g.add_argument("--seed", type=int, default=1, help="RNG seed (default 1)")
    g.add_argument(
        "--retriever",
        default="auto",
        help=f"chunk index: auto (kvh_cache.retriever if present, else numpy) or one of {available_kinds()}",
    )
    g.add_argument("--hints", type=int, default=1, help="chunks prefetched per predicted intent (default 1)")
    g.add_argument(
        "--intent-noise",
        type=float,
        default=0.8,
        help="noise of the agents' intent vectors: higher, worse predictions (default 0.8)",
    )
    g.add_argument("--no-attention", action="store_true", help="skip the decode attention step")
    g = p.add_argument_group("engine")
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--kv-heads", type=int, default=4)
    g.add_argument("--head-dim", type=int, default=64)
    g.add_argument("--block-tokens", type=int, default=16)
    g.add_argument("--dtype", default="f16", choices=["f32", "f16", "bf16"])
    g.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument(
        "--device-budget",
        type=parse_size,
        default=parse_size("6MiB"),
        help="device tier bytes (default 6MiB: small, so blocks spill)",
    )
    g.add_argument("--host-budget", type=parse_size, default=parse_size("4MiB"), help="host tier bytes (default 4MiB)")
    g.add_argument(
        "--disk-budget", type=parse_size, default=parse_size("256MiB"), help="disk tier bytes (default 256MiB)"
    )
    g.add_argument(
        "--data-dir",
        type=parse_dir,
        default=None,
        help="where the disk store goes: DIR/store, as in the model demo (kept; default: a temporary "
        "directory, removed at the end)",
    )
    g.add_argument("--no-disk", action="store_true", help="run without the disk tier")
    g.add_argument("--buffered-io", action="store_true", help="disk tier without O_DIRECT")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--no-progress", action="store_true", help="no progress bar even on a TTY")


# `kvh demo` runs the model demo (kvh_cache.demo.agents); this one is `kvh demo
# --synthetic`. Its own options (below) imply --synthetic; the options both
# demos have are added by kvh_cache.demo.agents with no default, and
# fill_defaults() gives them this demo's defaults.
SYNTHETIC_ONLY: Dict[str, Any] = {
    "steps": 24,
    "chunks": 32,
    "chunk_tokens": 64,
    "prompt_tokens": 128,
    "fork_every": 6,
    "intent_noise": 0.8,
    "no_attention": False,
    "layers": 4,
    "kv_heads": 4,
    "head_dim": 64,
    "block_tokens": 16,
    "dtype": "f16",
    "backend": "auto",
    "no_disk": False,
}
SHARED_DEFAULTS: Dict[str, Any] = {
    "agents": 4,
    "gen_tokens": 8,
    "seed": 1,
    "retriever": "auto",
    "hints": 1,
    "device_budget": 6 << 20,
    "host_budget": 4 << 20,
    "disk_budget": 256 << 20,
    "data_dir": None,
    "buffered_io": False,
    "json": False,
    "no_progress": False,
}


def add_synthetic_arguments(p: argparse.ArgumentParser) -> None:
    """The options only the synthetic demo has, defaulting to None so that
    giving any of them selects it (see :func:`synthetic_requested`)."""
    g = p.add_argument_group("synthetic demo (--synthetic: synthetic K/V, no model; any option here implies it)")
    g.add_argument("--steps", type=int, default=None, help="steps per agent (default 24)")
    g.add_argument("--chunks", type=int, default=None, help="document chunks in the corpus (default 32)")
    g.add_argument("--chunk-tokens", type=int, default=None, help="tokens per chunk (default 64)")
    g.add_argument("--prompt-tokens", type=int, default=None, help="shared system prompt tokens (default 128)")
    g.add_argument("--fork-every", type=int, default=None, help="a tool-call fork every N steps (default 6; 0: never)")
    g.add_argument(
        "--intent-noise",
        type=float,
        default=None,
        help="noise of the agents' intent vectors: higher, worse predictions (default 0.8)",
    )
    g.add_argument("--no-attention", action="store_true", default=None, help="skip the decode attention step")
    g.add_argument("--layers", type=int, default=None, help="default 4")
    g.add_argument("--kv-heads", type=int, default=None, help="default 4")
    g.add_argument("--head-dim", type=int, default=None, help="default 64")
    g.add_argument("--block-tokens", type=int, default=None, help="default 16")
    g.add_argument("--dtype", default=None, choices=["f32", "f16", "bf16"], help="default f16")
    g.add_argument("--backend", default=None, choices=["auto", "cpu", "cuda"], help="default auto")
    g.add_argument("--no-disk", action="store_true", default=None, help="run without the disk tier")


def synthetic_requested(args: argparse.Namespace) -> bool:
    """True when an option only the synthetic demo has was given."""
    return any(getattr(args, k, None) is not None for k in SYNTHETIC_ONLY)


def fill_defaults(args: argparse.Namespace) -> None:
    """Gives unset (None) options this demo's defaults."""
    for k, v in list(SYNTHETIC_ONLY.items()) + list(SHARED_DEFAULTS.items()):
        if getattr(args, k, None) is None:
            setattr(args, k, v)


@dataclass
class AgentReport:
    agent: int
    tokens: int = 0
    prefix_matched: int = 0
    chunk_reads: int = 0
    predicted_hits: int = 0
    forks: int = 0
    cow_ok: bool = True
    kv_ok: bool = True
    attention_max_err: Optional[float] = None
    attention_calls: int = 0


@dataclass
class DemoResult:
    ok: bool
    config: Dict[str, Any]
    agents: List[AgentReport]
    tiers: Dict[str, Dict[str, int]]
    stats: Dict[str, int]
    derived: Dict[str, float]
    notes: List[str] = field(default_factory=list)
    restart: Optional[Dict[str, Any]] = None
    seconds: float = 0.0

    def to_json(self) -> Dict[str, Any]:
        return {
            "ok": self.ok,
            "seconds": round(self.seconds, 3),
            "config": self.config,
            "agents": [a.__dict__ for a in self.agents],
            "tiers": self.tiers,
            "stats": self.stats,
            "derived": self.derived,
            "restart": self.restart,
            "notes": self.notes,
        }


class _KV:
    """Deterministic synthetic K/V: a hash of (seed, kind, id, layer, token
    position, head, dim), so any range written in any pieces can be
    regenerated and checked exactly."""

    def __init__(self, eng: Engine, seed: int) -> None:
        self.H, self.D, self.dtype, self.seed = eng.num_kv_heads, eng.head_dim, eng.dtype, seed

    def make(self, kind: int, ident: int, layer: int, first: int, n: int):
        u = np.uint64
        pos = np.arange(first, first + n, dtype=u)[:, None, None]
        h = np.arange(self.H, dtype=u)[None, :, None]
        d = np.arange(self.D, dtype=u)[None, None, :]
        base = u((((self.seed * 1000003 + kind) * 1000003 + ident) * 1000003 + layer) & ((1 << 64) - 1))
        with np.errstate(over="ignore"):
            x = base ^ (pos * u(0x9E3779B97F4A7C15)) ^ (h * u(0xC2B2AE3D27D4EB4F)) ^ (d * u(0x165667B19E3779F9))
            x ^= x >> u(30)
            x *= u(0xBF58476D1CE4E5B9)
            x ^= x >> u(27)
            x *= u(0x94D049BB133111EB)
            x ^= x >> u(31)
        k = (x >> u(40)).astype(np.float32) * np.float32(4.0 / (1 << 24)) - np.float32(2.0)
        v = ((x >> u(16)) & u(0xFFFFFF)).astype(np.float32) * np.float32(4.0 / (1 << 24)) - np.float32(2.0)
        if self.dtype == DType.F16:
            return k.astype(np.float16), v.astype(np.float16)
        if self.dtype == DType.BF16:
            return f32_to_bf16(k), f32_to_bf16(v)
        return k, v


def _as_f32(a: np.ndarray, dtype: DType) -> np.ndarray:
    if dtype == DType.BF16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def _reference_decode(k: np.ndarray, v: np.ndarray, q: np.ndarray) -> np.ndarray:
    """softmax(q k^T / sqrt(d)) v for one query token, GQA. k, v: (n, H, D);
    q: (Hq, D)."""
    n, H, D = k.shape
    Hq = q.shape[0]
    group = Hq // H
    out = np.empty((Hq, D), np.float32)
    for h in range(Hq):
        kh, vh = k[:, h // group, :], v[:, h // group, :]
        s = kh @ q[h] / math.sqrt(D)
        s = np.exp(s - s.max())
        out[h] = (s / s.sum()) @ vh
    return out


def _fill(seq: Sequence, kv: _KV, kind: int, ident: int, tokens: np.ndarray, layers: int) -> None:
    """Appends tokens block by block and writes their K/V for every layer
    while the new tokens are held in the device tier (like a chunked
    prefill), so fresh blocks are never demoted half written."""
    bt = seq.engine.block_tokens
    tokens = np.asarray(tokens, np.int32)
    pos = 0
    while pos < len(tokens):
        cur = len(seq)
        take = min(bt - cur % bt, len(tokens) - pos)
        seq.append(tokens[pos : pos + take])
        with seq.acquire(cur, take):
            for layer in range(layers):
                k, v = kv.make(kind, ident, layer, cur, take)
                seq.write_kv(layer, cur, k, v)
        pos += take


def _check_range(seq: Sequence, kv: _KV, kind: int, ident: int, first: int, n: int, layer: int) -> bool:
    """Reads [first, first+n) of one layer and compares with what was written."""
    k, v = seq.read_kv(layer, first, n)
    ek, ev = kv.make(kind, ident, layer, first, n)
    return bool(np.array_equal(k, ek) and np.array_equal(v, ev))


class DataDirError(Exception):
    """The --data-dir given cannot hold the disk tier."""


def disk_budget_refusal(budget: int, block_bytes: int, what: str) -> Optional[str]:
    """Why a --disk-budget of budget bytes holds no block of block_bytes
    (the engine would refuse it), or None. A disk slot is a 4 KiB header
    and the block, 4 KiB aligned, as the engine lays it out
    (core/disk_tier.c); what ends the message ("this model", ...)."""
    slot_bytes = 4096 + -(-block_bytes // 4096) * 4096
    if budget >= slot_bytes:
        return None
    return f"--disk-budget {budget}: holds no block slot of {slot_bytes} bytes with {what}"


class BudgetError(Exception):
    """A tier budget the engine refuses (too small for one block): a usage
    error naming the option."""


# The engine's words for a budget, and the option that sets it.
_BUDGET_OPTIONS = {"device_bytes": "--device-budget", "host_bytes": "--host-budget", "disk_bytes": "--disk-budget"}


def _budget_error(exc: "errors.Error") -> Optional[BudgetError]:
    field, _, rest = exc.message.partition(" ")
    option = _BUDGET_OPTIONS.get(field)
    if option is None:
        return None
    value, _, why = rest.partition(" ")
    return BudgetError(f"{option} {value}: {why or exc.message}")


def _mismatch_message(args: argparse.Namespace, store: Path, exc: Exception) -> str:
    """Why the store under --data-dir was not opened: made with another
    geometry (which field, as the library names it), and what to do."""
    text = str(exc)
    field = text.split("was made with a different ", 1)[1].split()[0] if "was made with a different " in text else ""
    what = f"a different {field.rstrip('.,;:()')}" if field else "a different geometry"
    return (
        f"--data-dir {args.data_dir}: the store there ({store}) was made with {what}; "
        "pass --fresh to empty it and start over, or use another --data-dir"
    )


def open_engine(args: argparse.Namespace, data_dir: Optional[Path], notes: List[str]) -> Engine:
    from ..engine import Engine

    base = dict(
        num_layers=args.layers,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        block_tokens=args.block_tokens,
        dtype=args.dtype,
        backend=args.backend,
        device_bytes=args.device_budget,
        host_bytes=args.host_budget,
        model_salt=SALT_BASE + args.seed,
    )
    if data_dir is not None:
        try:
            return Engine(
                **base,
                disk_path=str(data_dir),
                disk_bytes=args.disk_budget,
                disk_buffered=args.buffered_io,
                # The user's own store is never emptied for another
                # geometry: --fresh removes it first (see run()).
                disk_reset_on_mismatch=args.data_dir is None,
            )
        except errors.MismatchError as exc:
            raise DataDirError(_mismatch_message(args, data_dir, exc)) from None
        except errors.InvalidArgumentError as exc:
            bad = _budget_error(exc)
            if bad is None:
                raise
            raise bad from None
        except errors.KvhIOError as exc:
            if args.data_dir is not None:  # the user's own directory: say why it cannot be used
                raise DataDirError(f"--data-dir {args.data_dir}: {exc.message}") from None
            notes.append(f"disk tier unavailable ({exc.message}); running with device + host only")
        except errors.UnsupportedError as exc:
            notes.append(f"disk tier unavailable ({exc.message}); running with device + host only")
    try:
        return Engine(**base)
    except errors.InvalidArgumentError as exc:
        bad = _budget_error(exc)
        if bad is None:
            raise
        raise bad from None


def run(args: argparse.Namespace, out=None) -> int:
    out = out or sys.stdout
    sizes = ("agents", "steps", "chunks", "chunk_tokens", "gen_tokens")
    for name in sizes + ("layers", "kv_heads", "head_dim", "block_tokens"):
        if getattr(args, name) <= 0:
            print(f"kvh demo: --{name.replace('_', '-')} must be > 0", file=sys.stderr)
            return 2
    if args.agents > MAX_AGENTS:  # a report each is kept; ids are 32-bit
        print(f"kvh demo: --agents must be at most {MAX_AGENTS}", file=sys.stderr)
        return 2
    for name, most in GEOMETRY_LIMITS.items():
        if getattr(args, name) > most:
            print(f"kvh demo: --{name.replace('_', '-')} must be at most {most}", file=sys.stderr)
            return 2
    if args.block_tokens & (args.block_tokens - 1):
        print("kvh demo: --block-tokens must be a power of two", file=sys.stderr)
        return 2
    if not 0 <= args.seed <= MAX_SEED:
        print(f"kvh demo: --seed must be in 0..{MAX_SEED}", file=sys.stderr)
        return 2
    block_bytes = 2 * args.layers * args.kv_heads * args.head_dim * args.block_tokens * DTYPE_BYTES[args.dtype]
    if args.device_budget < block_bytes:  # the engine needs room for one block
        print(
            f"kvh demo: --device-budget must hold at least one block ({block_bytes} bytes with this geometry)",
            file=sys.stderr,
        )
        return 2
    for name in ("prompt_tokens", "fork_every", "hints"):
        if getattr(args, name) < 0:
            print(f"kvh demo: --{name.replace('_', '-')} must be >= 0", file=sys.stderr)
            return 2
    if not 0 <= args.intent_noise < float("inf"):  # NaN fails too
        print("kvh demo: --intent-noise must be a finite number >= 0", file=sys.stderr)
        return 2
    if not args.no_disk and args.disk_budget <= 0:  # a disk tier needs a size
        print("kvh demo: --disk-budget must be > 0 (--no-disk runs without the disk tier)", file=sys.stderr)
        return 2
    # Refused before anything is created.
    refusal = disk_budget_refusal(args.disk_budget, block_bytes, "this geometry (--no-disk runs without the disk tier)")
    if not args.no_disk and refusal:
        print(f"kvh demo: {refusal}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    notes: List[str] = []
    tmp: Optional[str] = None
    data_dir: Optional[Path] = None
    if not args.no_disk:
        if args.data_dir is None:
            tmp = tempfile.mkdtemp(prefix="kvh-demo-")
            data_dir = Path(tmp) / "store"
        else:
            problem = make_data_dir(Path(args.data_dir))
            if problem:
                print(f"kvh demo: --data-dir {args.data_dir}: {problem}", file=sys.stderr)
                return 1
            data_dir = Path(args.data_dir) / "store"
            if getattr(args, "fresh", False) and not empty_for_fresh(data_dir, "kvh demo"):
                return 1
    try:
        result = _run(args, data_dir, notes)
    except DataDirError as exc:
        print(f"kvh demo: {exc}", file=sys.stderr)
        return 1
    except BudgetError as exc:
        print(f"kvh demo: {exc}", file=sys.stderr)
        return 2
    except errors.NoSpaceError as exc:
        print(
            f"kvh demo: the tiers are too small for this workload ({exc.message}); "
            "raise --device-budget/--host-budget/--disk-budget",
            file=sys.stderr,
        )
        return 1
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    result.seconds = time.monotonic() - t0
    if args.json:
        json.dump(result.to_json(), out, indent=2)
        out.write("\n")
    else:
        out.write(render(result) + "\n")
    return 0 if result.ok else 1


def make_data_dir(path: Path) -> Optional[str]:
    """Creates the data directory (the store goes in it); why not, if not."""
    if path.exists() and not path.is_dir():
        return "Not a directory"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _run(args: argparse.Namespace, data_dir: Optional[Path], notes: List[str]) -> DemoResult:
    rng = np.random.default_rng(args.seed)
    eng = open_engine(args, data_dir, notes)
    has_disk = eng.tier_info(Tier.DISK).present
    L, bt = eng.num_layers, eng.block_tokens
    kv = _KV(eng, args.seed)
    index = open_chunk_index(args.retriever, dim=EMBED_DIM)
    config = {
        "agents": args.agents,
        "steps": args.steps,
        "chunks": args.chunks,
        "chunk_tokens": args.chunk_tokens,
        "prompt_tokens": args.prompt_tokens,
        "backend": eng.backend,
        "dtype": eng.dtype.short,
        "layers": L,
        "kv_heads": eng.num_kv_heads,
        "head_dim": eng.head_dim,
        "block_tokens": bt,
        "block_bytes": eng.block_bytes,
        "device_budget": args.device_budget,
        "host_budget": args.host_budget,
        "disk_budget": args.disk_budget if has_disk else 0,
        "retriever": getattr(index, "name", type(index).__name__),
        "seed": args.seed,
    }
    reports = [AgentReport(agent=a + 1) for a in range(args.agents)]
    ok = True
    restart = None
    prompt = np.arange(1, args.prompt_tokens + 1, dtype=np.int32)
    total_steps = args.agents * args.steps
    progress = Progress(
        total_steps + args.chunks, "kvh demo", enabled=None if not args.no_progress else False, unit="step"
    )
    prefetch_q: "queue.Queue[Optional[tuple]]" = queue.Queue()
    prefetch_errors: List[str] = []
    chunk_seqs: Dict[int, Sequence] = {}
    agent_seqs: List[Sequence] = []
    try:
        with eng:
            # 1. the shared system prompt, written once and pinned
            owner = eng.sequence(agent=0)
            _fill(owner, kv, 0, 0, prompt, L)
            full = (len(prompt) // bt) * bt
            if full:
                owner.pin(0, full)
            # 2. the corpus: chunks cached as sequences (they spill down the tiers)
            emb = rng.standard_normal((args.chunks, EMBED_DIM)).astype(np.float32)
            store_tokens = 0
            for c in range(args.chunks):
                toks = 1_000_000 + c * args.chunk_tokens + np.arange(args.chunk_tokens, dtype=np.int32)
                s = eng.sequence(agent=0)
                reused = s.match_prefix(toks)  # cached already (e.g. in the store of an earlier run)?
                store_tokens += reused
                _fill(s, kv, 1, c, toks[reused:], L)
                chunk_seqs[c] = s
                progress.update(1, "caching chunks")
            index.add(list(range(args.chunks)), emb, [{"chunk": c} for c in range(args.chunks)])
            planner = PrefetchPlanner(eng, index, chunk_seqs, limit=args.hints)

            # 3. the prefetch thread: intent vector -> retriever -> hints
            predicted: Dict[tuple, List[int]] = {}

            def prefetcher() -> None:
                while True:
                    item = prefetch_q.get()
                    if item is None:
                        return
                    agent, step, vec = item
                    try:
                        predicted[(agent, step)] = planner.hint(vec, agent=None)
                    except errors.ClosedError:
                        return
                    except errors.Error as exc:
                        prefetch_errors.append(f"{type(exc).__name__}: {exc.message}")

            th = threading.Thread(target=prefetcher, name="kvh-demo-prefetch", daemon=True)
            th.start()

            # 4. agents attach the prompt through the prefix index
            for rep in reports:
                s = eng.sequence(agent=rep.agent)
                rep.prefix_matched = s.match_prefix(prompt)
                if rep.prefix_matched < len(prompt):
                    _fill(s, kv, 0, 0, prompt[rep.prefix_matched :], L)
                agent_seqs.append(s)
            # each agent works mostly on its own documents, sometimes elsewhere
            plans = []
            for a in range(args.agents):
                home = rng.choice(args.chunks, size=max(1, min(args.chunks, 6)), replace=False)
                plan = [
                    int(rng.choice(home)) if rng.random() < 0.8 else int(rng.integers(args.chunks))
                    for _ in range(args.steps + 1)
                ]
                plans.append(plan)
            for a in range(args.agents):  # intents for step 0
                noise = rng.standard_normal(EMBED_DIM).astype(np.float32)
                prefetch_q.put((a, 0, emb[plans[a][0]] + args.intent_noise * noise))

            attention = not args.no_attention
            for step in range(args.steps):
                for a, rep in enumerate(reports):
                    seq = agent_seqs[a]
                    # intent for the next step, one step ahead
                    nxt = plans[a][step + 1]
                    prefetch_q.put(
                        (a, step + 1, emb[nxt] + args.intent_noise * rng.standard_normal(EMBED_DIM).astype(np.float32))
                    )
                    # read the chunk it needs now (resident in the device tier while held)
                    need = plans[a][step]
                    cs = chunk_seqs[need]
                    with cs.acquire():
                        layer = step % L
                        if not _check_range(cs, kv, 1, need, 0, args.chunk_tokens, layer):
                            rep.kv_ok = False
                    rep.chunk_reads += 1
                    if need in predicted.get((a, step), []):
                        rep.predicted_hits += 1
                    # generate: append tokens and write their K/V
                    first = len(seq)
                    toks = 2_000_000 + rep.agent * 100_000 + first + np.arange(args.gen_tokens, dtype=np.int32)
                    _fill(seq, kv, 2, rep.agent, toks, L)
                    # decode attention over the whole agent sequence
                    if attention:
                        attention = _attention_step(eng, seq, rep, rng, step == args.steps - 1, kv, notes)
                    # a tool call: fork, write into the shared tail (CoW), drop
                    if args.fork_every and step % args.fork_every == args.fork_every - 1:
                        rep.forks += 1
                        if not _fork_step(seq, kv, rep, L, args.gen_tokens):
                            rep.cow_ok = False
                    progress.update(1, f"agent {rep.agent} step {step + 1}")
            prefetch_q.put(None)
            th.join()
            progress.close()
            # 5. final verification of every agent's own tokens
            for a, rep in enumerate(reports):
                seq = agent_seqs[a]
                rep.tokens = len(seq)
                if not _check_range(seq, kv, 0, 0, 0, len(prompt), L - 1):
                    rep.kv_ok = False
                for step in range(args.steps):
                    first = len(prompt) + step * args.gen_tokens
                    if not _check_range(seq, kv, 2, rep.agent, first, args.gen_tokens, step % L):
                        rep.kv_ok = False
                        break
            # 6. durability: persist the prompt and the chunks
            persisted = 0
            if has_disk:
                for s in [owner] + list(chunk_seqs.values()):
                    try:
                        s.persist()
                        persisted += 1
                    except errors.UnsupportedError as exc:
                        notes.append(f"persist unavailable: {exc.message}")
                        break
            st = eng.stats()
            tiers = {
                t.name.lower(): {
                    "capacity_blocks": i.capacity_blocks,
                    "used_blocks": i.used_blocks,
                    "pinned_blocks": i.pinned_blocks,
                    "used_bytes": i.used_bytes,
                }
                for t, i in eng.tiers().items()
            }
            for s in agent_seqs + list(chunk_seqs.values()) + [owner]:
                s.free()
        # 7. a restart: a new engine finds the prompt in the store
        if has_disk and persisted and data_dir is not None:
            restart = _restart_check(args, data_dir, kv, prompt, notes)
            if restart is not None and not restart["ok"]:
                ok = False
    finally:
        prefetch_q.put(None)
        progress.close()
        eng.close()
        try:
            index.close()
        except Exception:
            pass
    if prefetch_errors:
        notes.append(f"{len(prefetch_errors)} prefetch hint(s) failed, first: {prefetch_errors[0]}")
    ok = ok and all(r.kv_ok and r.cow_ok for r in reports)
    ok = ok and all(r.attention_max_err is None or r.attention_max_err < _atol(eng.dtype) for r in reports)
    sd = st.to_dict()
    derived = {
        "device_hit_rate": st.device_hit_rate,
        "host_hit_rate": st.hits_host / st.lookups if st.lookups else 0.0,
        "disk_hit_rate": st.hits_disk / st.lookups if st.lookups else 0.0,
        "prefetch_accuracy": st.prefetch_accuracy,
        "prefix_tokens_shared": float(sum(r.prefix_matched for r in reports)),
        "predicted_hit_rate": (sum(r.predicted_hits for r in reports) / max(1, sum(r.chunk_reads for r in reports))),
        "bytes_moved": float(st.bytes_moved),
        "acquire_stall_ms": st.acquire_stall_ns / 1e6,
        "chunk_tokens_reused": float(store_tokens),
    }
    return DemoResult(
        ok=ok, config=config, agents=reports, tiers=tiers, stats=sd, derived=derived, notes=notes, restart=restart
    )


def _atol(dtype: DType) -> float:
    return {DType.F32: 1e-3, DType.F16: 2e-2, DType.BF16: 1e-1}[dtype]


def _attention_step(
    eng: Engine, seq: Sequence, rep: AgentReport, rng: np.random.Generator, check: bool, kv: _KV, notes: List[str]
) -> bool:
    """Runs decode attention for one agent; False turns attention off."""
    if eng.backend != "cpu":
        notes.append("decode attention skipped: the demo feeds NumPy arrays (CPU backend only)")
        return False
    layer = rep.attention_calls % eng.num_layers
    q = rng.standard_normal((1, eng.num_kv_heads, eng.head_dim)).astype(np.float32)
    try:
        with seq.acquire():
            out = eng.attention_decode(layer, [seq], q)
            if check:
                k, v = seq.read_kv(layer)
                ref = _reference_decode(_as_f32(k, eng.dtype), _as_f32(v, eng.dtype), q[0])
                rep.attention_max_err = float(np.max(np.abs(out[0] - ref)))
    except errors.UnsupportedError as exc:
        notes.append(f"decode attention skipped: {exc.message}")
        return False
    except errors.NoSpaceError as exc:
        notes.append(f"decode attention skipped (device tier too small to hold a whole agent: {exc.message})")
        return False
    rep.attention_calls += 1
    return True


def _fork_step(seq: Sequence, kv: _KV, rep: AgentReport, layers: int, n: int) -> bool:
    """Fork, write into the child's tail (CoW), check the parent is intact."""
    parent_len = len(seq)
    tail = min(n, parent_len)
    child = seq.fork()
    try:
        child.truncate(parent_len - tail)  # rewrite the last tokens differently
        _fill(child, kv, 3, rep.agent, 3_000_000 + np.arange(tail, dtype=np.int32), layers)
        ok_child = _check_range(child, kv, 3, rep.agent, parent_len - tail, tail, 0)
        ok_parent = _check_range(seq, kv, 2, rep.agent, parent_len - tail, tail, 0)
        return ok_child and ok_parent
    finally:
        child.free()


def _restart_check(
    args: argparse.Namespace, data_dir: Path, kv: _KV, prompt: np.ndarray, notes: List[str]
) -> Optional[Dict[str, Any]]:
    t0 = time.monotonic()
    try:
        eng = open_engine(args, data_dir, [])
    except (errors.Error, DataDirError) as exc:
        notes.append(f"restart check failed to open the store: {exc}")
        return {"ok": False, "error": str(exc)}
    with eng:
        with eng.sequence(agent=99) as s:
            matched = s.match_prefix(prompt)
            # A prompt shorter than one block has no full block to keep.
            whole = len(prompt) // eng.block_tokens * eng.block_tokens
            good = (matched > 0 or whole == 0) and (matched == 0 or _check_range(s, kv, 0, 0, 0, matched, 0))
        st = eng.stats()
    return {
        "ok": bool(good),
        "matched_tokens": matched,
        "prompt_tokens": int(len(prompt)),
        "hits_disk": st.hits_disk,
        "bytes_disk_to_host": st.bytes_disk_to_host,
        "seconds": round(time.monotonic() - t0, 3),
    }


def _pct(x: float) -> str:
    return f"{100.0 * x:.1f}%"


def render(r: DemoResult) -> str:
    c = r.config
    parts = [
        f"kvh demo: {c['agents']} agents x {c['steps']} steps, {c['chunks']} chunks of {c['chunk_tokens']} tokens, "
        f"backend {c['backend']}, {c['dtype']}, block {human_bytes(c['block_bytes'])}, "
        f"retriever {c['retriever']}",
        "",
        table(
            [
                [
                    a.agent,
                    a.tokens,
                    a.prefix_matched,
                    a.chunk_reads,
                    f"{a.predicted_hits}/{a.chunk_reads}",
                    a.forks,
                    "ok" if a.cow_ok else "FAIL",
                    "ok" if a.kv_ok else "FAIL",
                    "-" if a.attention_max_err is None else f"{a.attention_max_err:.2e}",
                ]
                for a in r.agents
            ],
            ["agent", "tokens", "prefix hit", "chunk reads", "predicted", "forks", "CoW", "KV", "attn err"],
            title="Agents",
            align="rrrrrrllr",
        ),
        "",
        table(
            [
                [name, t["capacity_blocks"], t["used_blocks"], t["pinned_blocks"], human_bytes(t["used_bytes"])]
                for name, t in r.tiers.items()
                if t["capacity_blocks"]
            ],
            ["tier", "capacity", "used", "pinned", "bytes"],
            title="Tiers (blocks, at the end)",
            align="lrrrr",
        ),
        "",
    ]
    s, d = r.stats, r.derived
    rows = [
        ["block accesses", f"{s['lookups']:,}"],
        [
            "hit rate device / host / disk",
            f"{_pct(d['device_hit_rate'])} / {_pct(d['host_hit_rate'])} / {_pct(d['disk_hit_rate'])}",
        ],
        [
            "prefix: queries, blocks, tokens",
            f"{s['prefix_queries']:,}, {s['prefix_hit_blocks']:,}, {s['prefix_hit_tokens']:,}",
        ],
        ["chunk tokens reused (cached, e.g. from the store)", f"{int(d['chunk_tokens_reused']):,}"],
        [
            "prefetch issued / useful / late / wasted / skipped",
            f"{s['prefetch_issued']} / {s['prefetch_useful']} / {s['prefetch_late']} / {s['prefetch_wasted']} / "
            f"{s['prefetch_skipped']}",
        ],
        ["retriever predicted the chunk", _pct(d["predicted_hit_rate"])],
        ["evictions, drops, CoW copies", f"{s['evictions']:,}, {s['drops']:,}, {s['cow_copies']:,}"],
        [
            "bytes device->host / host->device",
            f"{human_bytes(s['bytes_device_to_host'])} / {human_bytes(s['bytes_host_to_device'])}",
        ],
        ["device<->host moves without a copy (one arena)", f"{s.get('blocks_moved_in_place', 0):,} blocks"],
        [
            "bytes host->disk / disk->host",
            f"{human_bytes(s['bytes_host_to_disk'])} / {human_bytes(s['bytes_disk_to_host'])}",
        ],
        ["acquire stall", f"{d['acquire_stall_ms']:.1f} ms"],
        ["corrupt blocks", f"{s['corrupt_blocks']}"],
    ]
    parts.append(table(rows, ["counter", "value"], title="Engine", align="ll"))
    if r.restart is not None:
        rs = r.restart
        parts += [
            "",
            "Restart: "
            + (
                f"a new engine matched {rs.get('matched_tokens', 0)}/{rs.get('prompt_tokens', 0)} prompt tokens from "
                f"the disk store ({'verified' if rs.get('ok') else 'FAILED'}, {rs.get('seconds', 0)} s)"
                if "error" not in rs
                else f"FAILED: {rs['error']}"
            ),
        ]
    for n in dict.fromkeys(r.notes):
        parts.append(f"note: {n}")
    moved = (
        r.stats["bytes_device_to_host"]
        + r.stats["bytes_host_to_device"]
        + r.stats["bytes_host_to_disk"]
        + r.stats["bytes_disk_to_host"]
    )
    parts += [
        "",
        f"{'OK' if r.ok else 'FAILED'}: {r.seconds:.2f} s, {human_bytes(moved)} moved between tiers "
        f"({human_rate(moved, r.seconds)})",
    ]
    return "\n".join(parts)
