#!/usr/bin/env python3
"""Turns kvh-bench JSON lines into PNG plots.

    python3 benchmarks/plot.py [--out DIR] FILE.jsonl [FILE.jsonl ...]

Reads every JSON object (one per line; other lines are ignored) of the
files and writes, for each kind of data present:

  throughput_vs_block.png   migrate and disk throughput vs block size, next
                            to their raw baselines (memcpy, raw io_uring
                            O_DIRECT) measured in the same runs
  hit_rate_vs_budget.png    device and memory (device + host) hit rate vs
                            device budget, per policy, with Belady's MIN,
                            one column per trace
  attention_vs_context.png  CPU paged decode GB/s vs context, with the
                            contiguous layout and the memory read bandwidth
  scale.png                 cost per operation vs live blocks (log-log, with
                            the logarithmic reference) and agent throughput
                            vs threads
  offload.png               time to first token: recompute vs restoring the
                            prefix from host / disk, vs context length

Where a scenario ran several times, each point is the median of the runs.
Needs matplotlib; exits 3 with a message when it is missing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

Row = Dict[str, Any]


def load_rows(paths: Iterable[Path]) -> List[Row]:
    rows: List[Row] = []
    for p in paths:
        for line in p.read_text(encoding="utf-8").splitlines():
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(r, dict) and "scenario" in r and "metric" in r:
                rows.append(r)
    return rows


def series(
    rows: Sequence[Row], x: str, field: str = "value", where: Callable[[Row], bool] = lambda r: True
) -> Tuple[List[float], List[float]]:
    """(xs, median of `field` per x) over the rows that pass `where`."""
    acc: Dict[float, List[float]] = defaultdict(list)
    for r in rows:
        if where(r) and r.get(x) is not None and isinstance(r.get(field), (int, float)):
            acc[float(r[x])].append(float(r[field]))
    xs = sorted(acc)
    return xs, [statistics.median(acc[k]) for k in xs]


def pick(rows: Sequence[Row], scenario: str, *metrics: str) -> List[Row]:
    return [r for r in rows if r["scenario"] == scenario and (not metrics or r["metric"] in metrics)]


def plot_throughput(plt, rows: Sequence[Row], out: Path) -> Optional[Path]:
    mig = pick(rows, "migrate", "throughput")
    disk = pick(rows, "disk", "spill_throughput", "restore_throughput", "random_restore_throughput")
    if not mig and not disk:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    for api in sorted({r.get("api") for r in mig}):
        for d in ("d2h", "h2d"):
            xs, ys = series(
                mig,
                "block_bytes",
                where=lambda r: r.get("api") == api and r.get("direction") == d and r.get("threads") == 1,
            )
            if xs:
                ax.plot([x / 1024 for x in xs], ys, marker="o", label=f"{api} {d} (1 worker)")
    xs, ys = series(mig, "block_bytes", "baseline", where=lambda r: r.get("threads") == 1)
    if xs:
        ax.plot([x / 1024 for x in xs], ys, "k--", label="raw memcpy (same slots)")
    ax.set(xscale="log", xlabel="block size (KiB)", ylabel="GB/s", title="device <-> host migration (CPU backend)")
    ax.legend(fontsize=8)
    ax = axes[1]
    for m, label in (
        ("spill_throughput", "spill"),
        ("restore_throughput", "restore"),
        ("random_restore_throughput", "random restore"),
    ):
        xs, ys = series(disk, "block_bytes", where=lambda r: r["metric"] == m)
        if xs:
            (line,) = ax.plot([x / 1024 for x in xs], ys, marker="o", label=f"kvh {label}")
            bx, by = series(disk, "block_bytes", "baseline", where=lambda r: r["metric"] == m)
            ax.plot([x / 1024 for x in bx], by, "--", color=line.get_color(), label=f"raw io_uring {label}")
    ax.set(xscale="log", xlabel="block size (KiB)", ylabel="GB/s", title="host <-> disk tier vs raw O_DIRECT")
    ax.legend(fontsize=8)
    return save(plt, fig, out / "throughput_vs_block.png")


POLICY_STYLE = {
    "min": ("k", "--"),
    "kvh-engine": ("tab:red", "-"),
    "kvh-engine+hints": ("tab:orange", "-"),
    "kvh-engine+prefetch": ("tab:brown", ":"),
    "lru-k+hints": ("tab:olive", "--"),
    "lru-k+prefetch": ("tab:gray", ":"),
    "lru-k": ("tab:blue", "-"),
    "lru-k-hyst": ("tab:cyan", ":"),
    "lru": ("tab:green", "-"),
    "lctru": ("tab:purple", "-"),
}


def plot_hit_rates(plt, rows: Sequence[Row], out: Path) -> Optional[Path]:
    tr = pick(rows, "trace", "hit_rate_device", "hit_rate_memory")
    if not tr:
        return None
    traces = sorted({r["trace"] for r in tr}, key=lambda t: (t.startswith("recorded"), t))
    fig, axes = plt.subplots(2, len(traces), figsize=(4.5 * len(traces), 7.5), squeeze=False)
    for col, name in enumerate(traces):
        for row, metric in enumerate(("hit_rate_device", "hit_rate_memory")):
            ax = axes[row][col]
            policies = sorted({r["policy"] for r in tr if r["trace"] == name}, key=lambda p: (p != "min", p))
            for pol in policies:
                xs, ys = series(
                    tr, "budget", where=lambda r: r["trace"] == name and r["metric"] == metric and r["policy"] == pol
                )
                color, style = POLICY_STYLE.get(pol, (None, "-"))
                ax.plot(xs, ys, marker="o", color=color, linestyle=style, label=pol)
            ax.set(
                xlabel="device budget (% of distinct blocks; host = 2x)",
                ylim=(0, 1),
                ylabel="device hit rate" if row == 0 else "device + host hit rate",
                title=f"{name}: {'device' if row == 0 else 'memory'}",
            )
            ax.grid(alpha=0.3)
            if row == 0 and col == 0:
                ax.legend(fontsize=8)
    return save(plt, fig, out / "hit_rate_vs_budget.png")


def plot_attention(plt, rows: Sequence[Row], out: Path) -> Optional[Path]:
    att = pick(rows, "attention", "decode_throughput")
    if not att:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for layout in sorted({r.get("layout") for r in att if r.get("layout")}):
        xs, ys = series(att, "context", where=lambda r: r.get("layout") == layout)
        if xs:
            ax.plot(xs, ys, marker="o", label=f"{layout} decode")
    xs, ys = series(att, "context", "baseline", where=lambda r: r.get("layout") == "paged")
    if xs:
        ax.plot(xs, ys, "k--", marker=".", label="contiguous (same kernel, baseline)")
    bw = [r["value"] for r in pick(rows, "attention", "read_bandwidth")]
    if bw:
        ax.axhline(statistics.median(bw), color="grey", linestyle=":", label="memory read bandwidth")
    ax.set(xscale="log", xlabel="context (tokens)", ylabel="GB/s of K/V read", title="CPU decode attention")
    ax.legend(fontsize=8)
    return save(plt, fig, out / "attention_vs_context.png")


def plot_scale(plt, rows: Sequence[Row], out: Path) -> Optional[Path]:
    sc = pick(rows, "scale")
    if not sc:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    for op in ("alloc", "lookup", "touch", "prefix_match", "evict"):
        xs, ys = series(sc, "blocks", where=lambda r: r["metric"] == op)
        if xs:
            (line,) = ax.plot(xs, ys, marker="o", label=op)
            bx, by = series(sc, "blocks", "baseline", where=lambda r: r["metric"] == op)
            ax.plot(bx, by, ":", color=line.get_color())
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="live blocks",
        ylabel="ns per operation",
        title="cost vs block count (dotted: logarithmic reference)",
    )
    ax.legend(fontsize=8)
    ax = axes[1]
    for metric, label in (
        ("agent_ops", "per wall-clock second"),
        ("agent_ops_per_cpu_s", "per CPU-second of the process"),
    ):
        xs, ys = series(sc, "threads", where=lambda r: r["metric"] == metric)
        if xs:
            ax.plot(xs, ys, marker="o", label=label)
    ax.set(
        xscale="log", xlabel="agent threads", ylabel="operations", ylim=(0, None), title="agent operations vs threads"
    )
    ax.legend(fontsize=8)
    return save(plt, fig, out / "scale.png")


def plot_offload(plt, rows: Sequence[Row], out: Path) -> Optional[Path]:
    off = pick(rows, "offload")
    if not any(r["metric"] == "recompute" for r in off):
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for m, label in (
        ("recompute", "recompute the prefix (prefill)"),
        ("restore_host", "restore from host"),
        ("restore_disk", "restore from disk"),
        ("kv_host", "KV only, host"),
        ("kv_disk", "KV only, disk"),
    ):
        xs, ys = series(off, "context", where=lambda r: r["metric"] == m)
        if xs:
            ax.plot(xs, ys, marker="o", linestyle="--" if m.startswith("kv") else "-", label=label)
    for r in off:
        if r["metric"] == "crossover_restore_host" and r.get("value"):
            ax.axvline(
                r["value"], color="grey", linestyle=":", label=f"crossover, host ({r['how']}): {r['value']:.0f} tokens"
            )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="context (tokens)",
        ylabel="ms to the next token's logits",
        title="offload threshold: restore vs recompute",
    )
    ax.legend(fontsize=8)
    return save(plt, fig, out / "offload.png")


def save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


PLOTS = (plot_throughput, plot_hit_rates, plot_attention, plot_scale, plot_offload)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="plot.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("files", nargs="+", type=Path, metavar="FILE.jsonl", help="kvh-bench --json output")
    ap.add_argument(
        "--out", type=Path, default=Path("benchmarks/plots"), help="output directory (default benchmarks/plots)"
    )
    args = ap.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot.py: matplotlib is not installed (make deps installs it)", file=sys.stderr)
        return 3
    missing = [p for p in args.files if not p.is_file()]
    if missing:
        print(f"plot.py: no such file: {missing[0]}", file=sys.stderr)
        return 2
    rows = load_rows(args.files)
    args.out.mkdir(parents=True, exist_ok=True)
    written = [p for p in (f(plt, rows, args.out) for f in PLOTS) if p is not None]
    for p in written:
        print(p)
    if not written:
        print("plot.py: nothing to plot in these files", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
