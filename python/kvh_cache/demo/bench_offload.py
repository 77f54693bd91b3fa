"""Offload threshold: above which context length does restoring a prefix's
KV from the host tier or the disk tier beat recomputing it?

With the real model runner (SmolLM2-135M-Instruct, CPU backend, f32 KV),
for each context length L (a multiple of the block size) the same L tokens
of the document library are:

``recompute``
    prefilled on a fresh sequence: what a system without a KV store does
    for a prefix it has seen before (time to the logits of the next token).
``restore_host`` / ``restore_disk``
    found by ``Runner.prefill_cached`` on a fresh sequence after the
    prefix's blocks were moved to the host tier (or the disk tier): the
    prefix index attaches them, attention brings them to the device tier,
    and the last token is recomputed for its logits. This is the time to
    the same logits.
``kv_host`` / ``kv_disk``
    only the KV part of that: ``match_prefix`` + ``acquire`` of the whole
    prefix (no model work).

``ratio`` = recompute / restore (> 1: restoring wins). The crossover is
the smallest L at which restoring wins, interpolated linearly between the
measured lengths; when restoring already wins at the smallest length, the
lines through the two smallest lengths of each curve, extended down, give
where they would meet (``how: fit``), or ``how: always`` when they do not
meet above 0 tokens. One JSON object per line with ``--json``; a table
otherwise. Timings are medians of ``--reps`` rounds on this machine: the
CPU backend's "device" tier is host memory, so a host restore is a copy in
memory; on a GPU it crosses PCIe.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, IO, List, Optional, Sequence, Tuple

from . import CORPUS_DIR

__all__ = ["main", "run_bench", "crossover", "build_parser"]

DEFAULT_CONTEXTS = (16, 32, 64, 128, 256, 512, 1024)
QUICK_CONTEXTS = (16, 64)


def crossover(
    lengths: Sequence[int], recompute: Sequence[float], restore: Sequence[float]
) -> Tuple[Optional[float], str]:
    """Where restoring starts to win, from measured (L, time) points.

    Returns ``(length, how)``: ``"measured"`` (linear interpolation of
    recompute - restore between the two lengths where it changes sign);
    when restoring already wins at the smallest length, the lines through
    the two smallest lengths of each curve are extended downwards:
    ``"fit"`` (they meet between 0 and the smallest length), ``"always"``
    (they do not meet above 0 tokens: no threshold; length None); or
    ``"never"`` (recomputing wins at every length measured; None)."""
    pts = sorted(zip(lengths, recompute, restore))
    if not pts:
        return None, "never"
    diff = [(L, rc - rs) for L, rc, rs in pts]
    if diff[0][1] > 0:
        if len(pts) < 2 or pts[1][0] == pts[0][0]:
            return None, "always"
        (l0, rc0, rs0), (l1, rc1, rs1) = pts[0], pts[1]
        # Where rc0 + b_rc (L - l0) = rs0 + b_rs (L - l0).
        b_rc, b_rs = (rc1 - rc0) / (l1 - l0), (rs1 - rs0) / (l1 - l0)
        if b_rc <= b_rs:
            return None, "always"
        meet = l0 - (rc0 - rs0) / (b_rc - b_rs)
        return (meet, "fit") if meet > 0 else (None, "always")
    for (l0, d0), (l1, d1) in zip(diff, diff[1:]):
        if d0 <= 0 < d1:
            return l0 + (l1 - l0) * (-d0) / (d1 - d0), "measured"
    return None, "never"


def document_tokens(runner, n: int) -> List[int]:
    """At least n tokens of the document library (the articles, in order)."""
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(CORPUS_DIR.glob("*.txt")))
    toks = runner.encode(text)
    while len(toks) < n:
        toks = toks + toks
    return [int(t) for t in toks[:n]]


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _restore_round(runner, eng, src, toks: List[int], tier: str) -> Tuple[float, float]:
    """(ttft_ms, kv_ms) of restoring toks from tier (src holds the blocks)."""
    src.migrate(tier)
    s = eng.sequence()
    try:

        def kv_only():
            s.match_prefix(toks)
            s.acquire().release()

        kv_ms = _time(kv_only)
    finally:
        s.free()
    src.migrate(tier)
    s = eng.sequence()
    try:
        ttft_ms = _time(lambda: runner.prefill_cached(s, toks))
    finally:
        s.free()
    return ttft_ms, kv_ms


def run_bench(args: argparse.Namespace, log=None) -> List[Dict[str, Any]]:
    from ..model import runner as model_runner

    runner = model_runner.load(args.model)
    bt = runner.block_tokens
    contexts = sorted({max(bt, (c // bt) * bt) for c in args.contexts})
    workdir = Path(tempfile.mkdtemp(prefix="kvh-offload-", dir=args.tmp_dir))
    rows: List[Dict[str, Any]] = []
    try:
        probe = runner.engine(device_bytes=1 << 20, host_bytes=1 << 20)
        block_bytes = probe.block_bytes
        probe.close()
        cap = (2 * max(contexts) // bt + 8) * block_bytes
        eng = runner.engine(device_bytes=cap, host_bytes=cap, disk_bytes=2 * cap, disk_path=str(workdir / "store"))
        # Each length reads its own window of the library, so no prefix of
        # one length is a cached prefix of another (the warm-up included).
        all_toks = document_tokens(runner, bt + sum(contexts))
        # Warm-up: the first forward pass pays one-time costs (BLAS set-up,
        # first touch of the weights) that belong to no length.
        warm = eng.sequence()
        runner.prefill(warm, all_toks[:bt])
        warm.free()
        offset = bt
        series: Dict[str, List[float]] = {
            k: [] for k in ("recompute", "restore_host", "restore_disk", "kv_host", "kv_disk")
        }
        for L in contexts:
            toks = all_toks[offset : offset + L]
            offset += L
            rec: List[float] = []
            src = None
            for r in range(args.recompute_reps):
                s = eng.sequence()
                rec.append(_time(lambda: runner.prefill(s, toks)))
                if src is None:
                    src = s  # keeps the blocks the restores find
                else:
                    s.free()
            got: Dict[str, List[float]] = {k: [] for k in ("restore_host", "restore_disk", "kv_host", "kv_disk")}
            for r in range(args.reps):
                for tier in ("host", "disk"):
                    ttft, kv = _restore_round(runner, eng, src, toks, tier)
                    got["restore_" + tier].append(ttft)
                    got["kv_" + tier].append(kv)
            src.free()
            # Rounded once, so that each ratio is exactly value / baseline as printed.
            med = {
                "recompute": round(statistics.median(rec), 4),
                **{k: round(statistics.median(v), 4) for k, v in got.items()},
            }
            for k, v in med.items():
                series[k].append(v)
            if log:
                log(
                    f"L={L}: recompute {med['recompute']:.1f} ms, restore host {med['restore_host']:.1f} ms, "
                    f"disk {med['restore_disk']:.1f} ms"
                )
            base = {"scenario": "offload", "context": L, "block_bytes": block_bytes, "model": runner.config.name}
            rows.append({**base, "metric": "recompute", "value": med["recompute"], "unit": "ms"})
            for k in ("restore_host", "restore_disk", "kv_host", "kv_disk"):
                rows.append(
                    {
                        **base,
                        "metric": k,
                        "value": med[k],
                        "unit": "ms",
                        "baseline": med["recompute"],
                        "ratio": med["recompute"] / med[k] if med[k] > 0 else None,
                    }
                )
        eng.close()
        for tier in ("host", "disk"):
            for kind in ("restore", "kv"):
                L, how = crossover(contexts, series["recompute"], series[f"{kind}_{tier}"])
                rows.append(
                    {
                        "scenario": "offload",
                        "metric": f"crossover_{kind}_{tier}",
                        "value": None if L is None else round(L, 1),
                        "unit": "tokens",
                        "how": how,
                        "contexts": list(contexts),
                    }
                )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return rows


def _print_table(rows: List[Dict[str, Any]], out: IO[str]) -> None:
    from .._progress import table

    by_l: Dict[int, Dict[str, Any]] = {}
    for r in rows:
        if "context" in r:
            by_l.setdefault(r["context"], {})[r["metric"]] = r
    body = []
    for L in sorted(by_l):
        m = by_l[L]
        body.append(
            [
                str(L),
                f"{m['recompute']['value']:.1f}",
                f"{m['restore_host']['value']:.1f} ({m['restore_host']['ratio']:.2f}x)",
                f"{m['restore_disk']['value']:.1f} ({m['restore_disk']['ratio']:.2f}x)",
                f"{m['kv_host']['value']:.2f}",
                f"{m['kv_disk']['value']:.2f}",
            ]
        )
    out.write(
        table(
            body,
            [
                "context (tokens)",
                "recompute ms",
                "restore host ms (gain)",
                "restore disk ms (gain)",
                "KV host ms",
                "KV disk ms",
            ],
            title="offload threshold",
            align="rrrrrr",
        )
        + "\n"
    )
    for r in rows:
        if r["metric"].startswith("crossover"):
            if r["value"] is not None:
                v = f"{r['value']:.0f} tokens"
            elif r["how"] == "never":
                v = "none: recomputing wins at every length"
            else:
                v = "none: restoring wins at every length"
            out.write(f"{r['metric']}: {v} ({r['how']})\n")


def build_parser(prog: str = "python -m kvh_cache.demo.bench_offload") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--contexts",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=None,
        metavar="L,L,...",
        help=f"context lengths in tokens (default {','.join(map(str, DEFAULT_CONTEXTS))};"
        f" --quick: {','.join(map(str, QUICK_CONTEXTS))})",
    )
    p.add_argument("--reps", type=int, default=None, help="restore rounds per length (default 3; --quick 1)")
    p.add_argument(
        "--recompute-reps", type=int, default=None, help="recompute rounds per length (default 2; --quick 1)"
    )
    p.add_argument("--quick", action="store_true", help="two short contexts, one round (smoke test)")
    p.add_argument("--model", default=None, metavar="GGUF", help="model file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--tmp-dir", default=None, metavar="DIR", help="where the disk tier goes (default: $TMPDIR)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.contexts is None:
        args.contexts = list(QUICK_CONTEXTS if args.quick else DEFAULT_CONTEXTS)
    if args.reps is None:
        args.reps = 1 if args.quick else 3
    if args.recompute_reps is None:
        args.recompute_reps = 1 if args.quick else 2
    if args.reps < 1 or args.recompute_reps < 1 or not args.contexts or min(args.contexts) < 1:
        print("kvh bench offload: --reps, --recompute-reps and contexts must be >= 1", file=sys.stderr)
        return 2
    from ..model.runner import ModelFileError, ModelNotFoundError

    try:
        rows = run_bench(args, log=lambda m: print(m, file=sys.stderr))
    except ModelNotFoundError as e:
        print(f"kvh bench offload: {e}", file=sys.stderr)
        return 3
    except ModelFileError as e:  # a file that is not a usable GGUF: a failure, not a usage error
        print(f"kvh bench offload: --model: {e}", file=sys.stderr)
        return 1
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        _print_table(rows, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
