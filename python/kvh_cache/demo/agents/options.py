"""The options of ``kvh demo`` (the model demo): the parser, the defaults
the synthetic demo shares, and the checks made before the model loads."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Dict, List, Optional

from ..._progress import parse_dir, parse_size
from .loading import MODEL_NAME

__all__ = ["BASELINES", "DEFAULTS", "add_arguments", "chosen_baselines", "fill_defaults", "parse_budget", "validate"]

BASELINES = ("monolithic", "sync-offload")

# Defaults of the options the synthetic demo shares (cli.py fills them).
DEFAULTS: Dict[str, Any] = {
    "agents": 3,
    "questions": 2,
    "gen_tokens": 32,
    "seed": 1,
    "retriever": "auto",
    "hints": 1,
    "device_budget": None,
    "host_budget": None,
    "disk_budget": 256 << 20,
    "data_dir": Path("kvh-data"),
    "docs_per_question": 1,
    "ingest": "all",
    "baseline": None,
}


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
    g.add_argument(
        "--synthetic", action="store_true", help="run the synthetic demo (no model; see the synthetic options below)"
    )
    g.add_argument("--agents", type=int, default=d["agents"], help=f"number of agents (default {DEFAULTS['agents']})")
    g.add_argument(
        "--questions", type=int, default=d["questions"], help=f"questions per agent (default {DEFAULTS['questions']})"
    )
    g.add_argument(
        "--gen-tokens",
        type=int,
        default=d["gen_tokens"],
        help=f"tokens generated per answer, at most (default {DEFAULTS['gen_tokens']}; synthetic: "
        "tokens appended per step, default 8)",
    )
    g.add_argument(
        "--docs-per-question",
        type=int,
        choices=(1, 2),
        default=d["docs_per_question"],
        help="articles retrieved into each prompt (default 1; with 2 only the first one's KV is reused)",
    )
    g.add_argument(
        "--ingest",
        choices=("all", "lazy"),
        default=d["ingest"],
        help="compute every article's KV up front (all, default) or when first retrieved (lazy)",
    )
    g.add_argument("--seed", type=int, default=d["seed"], help="seed (default 1; the run is greedy and deterministic)")
    g.add_argument(
        "--model",
        default=None,
        metavar="GGUF",
        help=f"a Llama-family GGUF (default: $KVH_MODEL, else {MODEL_NAME}, fetched on first use)",
    )
    g = p.add_argument_group("retrieval")
    g.add_argument(
        "--retriever",
        default=d["retriever"],
        help="chunk index: auto (kvh_cache.retriever when present, else numpy), numpy, or a kind of "
        "kvh_cache.retriever such as qdrant",
    )
    g.add_argument(
        "--qdrant-url",
        default=None,
        metavar="URL",
        help="Qdrant server for the retriever (implies --retriever qdrant unless one is given)",
    )
    g.add_argument(
        "--hints",
        type=int,
        default=d["hints"],
        help=f"articles prefetched per predicted question (default {DEFAULTS['hints']}; 0: no prefetch)",
    )
    g.add_argument(
        "--queue-hints",
        type=int,
        default=None,
        metavar="N",
        help="before each request, tell the engine (kvh_seq_hint) which articles it and the next N-1 "
        "queued requests read, soonest first, so that eviction follows the queue (default: one "
        "round, the number of agents; 0: none)",
    )
    g = p.add_argument_group("tiers")
    g.add_argument(
        "--device-budget",
        type=parse_budget,
        default=d["device_budget"],
        metavar="SIZE",
        help="device tier bytes, e.g. 32MiB (default auto: about a quarter of the run's KV, at least one "
        "request plus one prefetched article; synthetic: 6MiB)",
    )
    g.add_argument(
        "--host-budget",
        type=parse_budget,
        default=d["host_budget"],
        metavar="SIZE",
        help="host tier bytes (default auto: about a quarter of the run's KV; synthetic: 4MiB)",
    )
    g.add_argument(
        "--disk-budget",
        type=parse_budget,
        default=d["disk_budget"],
        metavar="SIZE",
        help="disk tier bytes (default 256MiB)",
    )
    g.add_argument(
        "--data-dir",
        type=parse_dir,
        default=d["data_dir"],
        metavar="DIR",
        help="where everything goes: the store (DIR/store), the plot, the result JSON "
        "(default ./kvh-data; synthetic: a temporary directory)",
    )
    g.add_argument("--fresh", action="store_true", help="empty the store first (otherwise a second run reuses it)")
    g.add_argument("--buffered-io", action="store_true", help="disk tier without O_DIRECT")
    g = p.add_argument_group("baselines and output")
    g.add_argument(
        "--baseline",
        action="append",
        choices=("monolithic", "sync-offload", "all", "none"),
        default=d["baseline"],
        help="baselines run on the same requests (repeatable; default all): monolithic = everything "
        "in the device tier, refusing what does not fit; sync-offload = the naive synchronous "
        "CPU offload",
    )
    g.add_argument("--no-restart", action="store_true", help="skip the restart (returning agent) measurement")
    g.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="PNG",
        help="where the plot goes (default DATA_DIR/demo.png; needs matplotlib)",
    )
    g.add_argument("--no-plot", action="store_true", help="do not write the plot")
    g.add_argument(
        "--record-trace",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the block-access trace of the kvh run (one line per access: time, agent, "
        "sequence, block id, block hash, tier, kind)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print JSON lines (scenario, metric, value, unit, ...); with --synthetic one JSON object",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar even on a TTY")
    p.add_argument("--returning", type=Path, default=None, help=argparse.SUPPRESS)


def fill_defaults(args: argparse.Namespace) -> None:
    for k, v in DEFAULTS.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if getattr(args, "queue_hints", None) is None:
        args.queue_hints = args.agents
    for k, v in (
        ("synthetic", False),
        ("model", None),
        ("qdrant_url", None),
        ("fresh", False),
        ("buffered_io", False),
        ("no_restart", False),
        ("plot", None),
        ("no_plot", False),
        ("record_trace", None),
        ("json", False),
        ("no_progress", False),
        ("returning", None),
    ):
        if not hasattr(args, k):
            setattr(args, k, v)


def chosen_baselines(args: argparse.Namespace) -> List[str]:
    chosen = args.baseline or ["all"]
    if "none" in chosen:
        if len(set(chosen)) > 1:
            raise ValueError("--baseline none cannot be combined with other baselines")
        return []
    if "all" in chosen:
        return list(BASELINES)
    return [b for b in BASELINES if b in chosen]


def validate(args: argparse.Namespace) -> Optional[str]:
    if args.model and Path(args.model).is_dir():
        return f"--model {args.model}: a directory, not a GGUF file"
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
        chosen_baselines(args)
    except ValueError as exc:
        return str(exc)
    return None
