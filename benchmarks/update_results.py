#!/usr/bin/env python3
"""Regenerates the measured tables of benchmarks/RESULTS.md from a results
directory written by benchmarks/run-bench.sh.

    python3 benchmarks/update_results.py DIR [--results benchmarks/RESULTS.md] [--print]

RESULTS.md keeps its prose; only the text between a pair of markers

    <!-- generated: NAME -->
    ...
    <!-- end generated: NAME -->

is replaced, by the table NAME built from DIR:

  machine    DIR/machine.txt (date, command, CPUs, load)
  trace      DIR/trace.jsonl: each policy's device / memory hit rate as a
             ratio to Belady's MIN, per trace and budget, and inbound copies
  scale      DIR/scale.jsonl: ns per operation vs live blocks; agent threads
  tradeoff   DIR/demo.jsonl: the seed's trade-off table (monolithic vs
             synchronous offload vs kvh) from `kvh demo --json`
  offload    DIR/offload.jsonl: restore vs recompute per context length
  codec-isa  DIR/codec.jsonl: encode/decode as ratios to memcpy per codec,
             dtype and instruction set (`kvh-bench codec --isa all`)
  disk-ceiling DIR/disk.jsonl: kvh against the raw io_uring ceiling and fio,
             medians with their ranges
  NAME       any other DIR/NAME.jsonl: the generic median table of
             summarize.py (alloc, migrate, disk, attention)

A marker whose data is missing is left as it was (and reported). --print
writes the tables to stdout instead of touching RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

HERE = Path(__file__).resolve().parent
Row = Dict[str, Any]
MARK = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end generated: (?P=name) -->)", re.S)


def rows_of(path: Path) -> List[Row]:
    out = []
    if not path.is_file():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def num(x: Optional[float], digits: int = 3) -> str:
    if x is None:
        return ""
    # The cut-off is on the rounded value: 999.7 is "1,000", not "1e+03".
    return f"{x:.{digits}g}" if abs(float(f"{x:.{digits}g}")) < 1000 else f"{x:,.0f}"


def table(head: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines) + "\n"


def trace_table(d: Path) -> Optional[str]:
    rows = rows_of(d / "trace.jsonl")
    if not rows:
        return None
    by: Dict[tuple, Dict[str, Row]] = defaultdict(dict)
    info = {r["trace"]: r for r in rows if r["metric"] == "trace_accesses"}
    for r in rows:
        if "policy" in r:
            by[(r["trace"], r["budget"], r["policy"])][r["metric"]] = r
    policies = [
        "kvh-engine+hints",
        "kvh-engine+queue-position",
        "kvh-engine+queue-request",
        "kvh-engine+queue-on-entry",
        "kvh-engine+prefetch",
        "kvh-engine",
        "lru-k",
        "lru-k-hyst",
        "lru",
        "lctru",
    ]
    traces = sorted({k[0] for k in by}, key=lambda t: (t.startswith("recorded"), t))
    out = []
    for t in traces:
        i = info.get(t, {})
        out.append(
            f"\n**{t}** ({i.get('value', 0):,.0f} accesses, {i.get('blocks', 0):,} blocks, "
            f"{i.get('sequences', 0):,} sequences)\n\n"
        )
        body = []
        for b in sorted({k[1] for k in by if k[0] == t}):
            m = by.get((t, b, "min"), {})
            dev_blocks = m.get("hit_rate_device", {}).get("device_blocks")
            host_blocks = m.get("hit_rate_device", {}).get("host_blocks")
            cells = [
                f"{b}% ({dev_blocks} + {host_blocks})",
                f"{num(m.get('hit_rate_device', {}).get('value'))} / {num(m.get('hit_rate_memory', {}).get('value'))}",
            ]
            for p in policies:
                r = by.get((t, b, p))
                if not r:
                    cells.append("")
                    continue
                dv, mv = r["hit_rate_device"], r["hit_rate_memory"]
                inb = r.get("inbound_per_access", {})
                tr = r.get("transfers_per_access", {})
                cell = (
                    f"{num(dv['value'])} ({num(dv.get('ratio'), 2)}) / {num(mv['value'])} ({num(mv.get('ratio'), 2)})"
                )
                cell += f"; in {num(inb.get('value'), 2)} ({num(inb.get('ratio'), 2)}); all {num(tr.get('value'), 2)}"
                for x in (dv, mv, inb, tr):
                    if x.get("met") is False:
                        cell = f"**{cell}** missed"
                        break
                cells.append(cell)
            body.append(cells)
        out.append(table(["device % (blocks dev + host)", "MIN device / memory"] + policies, body))
    out.append(
        "\nCells: device hit rate (ratio to MIN) / device+host hit rate (ratio to MIN); "
        "`in`: blocks copied toward the device per access (MIN's lower bound / ours); `all`: block "
        "copies per access across both boundaries, both directions. "
        "**bold** = a target of issue 8 missed (hit rates: kvh-engine+hints on the generated traces; copies "
        "per access: every engine row on the adversarial trace). Empty: the trace has no hints.\n"
    )
    return "".join(out)


def scale_table(d: Path) -> Optional[str]:
    rows = rows_of(d / "scale.jsonl")
    if not rows:
        return None
    ops = ["alloc", "lookup", "touch", "prefix_match", "evict", "hint", "set_quota"]
    blocks = sorted({r["blocks"] for r in rows if "blocks" in r})
    body = []
    for n in blocks:
        cells = [f"{n:,}"]
        for op in ops:
            r = next((r for r in rows if r.get("blocks") == n and r["metric"] == op), None)
            if r is None:
                cells.append("")
                continue
            c = f"{num(r['value'])} ({num(r.get('ratio'), 2)})"
            cells.append(f"**{c}**" if r.get("met") is False else c)
        mem = next((r for r in rows if r.get("blocks") == n and r["metric"] == "memory_read"), None)
        cells.append(num(mem["value"]) if mem else "")
        body.append(cells)
    out = table(["live blocks"] + [f"{op} ns" for op in ops] + ["memory read ns"], body)
    out += (
        "\nIn brackets: the logarithmic reference / measured (>= 0.5 is the target of alloc, lookup, "
        "prefix_match and evict, the operations issue 8 names, and of set_quota; touch and hint have none, "
        "see below; **bold** missed). "
        "Memory read: one random dependent read in a buffer the size of the block records (128 bytes "
        "per block).\n\n"
    )
    thr = [r for r in rows if r["metric"] == "agent_ops"]
    cpu = {r["threads"]: r for r in rows if r["metric"] == "agent_ops_per_cpu_s"}
    if thr:
        body = []
        for r in thr:
            c = cpu.get(r["threads"], {})
            body.append(
                [
                    str(r["threads"]),
                    f"{r['value']:.3g}",
                    num(r.get("ratio"), 2),
                    f"{c['value']:.3g}" if c else "",
                    num(c.get("ratio"), 2) if c else "",
                ]
            )
        out += table(["agent threads", "ops/s (wall)", "vs first", "ops per CPU-second", "vs first"], body)
    return out


def tradeoff_table(d: Path) -> Optional[str]:
    rows = rows_of(d / "demo.jsonl")
    if not rows:
        return None

    def get(metric: str, config: str, **kw: Any) -> Optional[Row]:
        for r in rows:
            if r["metric"] == metric and r.get("config") == config and all(r.get(k) == v for k, v in kw.items()):
                return r
        return None

    configs = ["monolithic", "sync-offload", "kvh"]
    body = []

    def line(label: str, fn) -> None:
        body.append([label] + [fn(c) for c in configs])

    def v(metric: str, fmt: str, **kw: Any):
        def f(c: str) -> str:
            r = get(metric, c, **kw)
            return fmt.format(r["value"]) if r else "-"

        return f

    line("max context before refusing (tokens)", v("max_context", "{:,.0f}"))
    line("TTFT, mean over agents (ms)", v("ttft", "{:.0f}"))
    line("ITL p50 (ms/token)", v("itl", "{:.1f}", stat="p50"))

    def frag(c: str) -> str:
        r = get("fragmentation", c, layout="paged")
        if not r:
            return "-"
        s = f"{100 * (r['value'] - 1):.1f}% (paged)"
        u = get("fragmentation", c, layout="contiguous")
        if u:
            s += f"; {100 * (u['value'] - 1):.0f}% if contiguous per sequence"
        return s

    line("fragmentation (allocated / used - 1)", frag)

    def resil(c: str) -> str:
        r = get("restart_prefix_tokens", c)
        if not r:
            return "-"
        s = f"{r['value']:.0f} / {r.get('prompt_tokens', 0)} prompt tokens found after restart"
        if c == "kvh":
            t = get("ttft_returning_from_disk", "kvh")
            if t:
                s += f"; TTFT {t['value']:.0f} ms vs {t['baseline']:.0f} ms recompute"
        return s

    line("restart resilience (returning agent)", resil)
    return table(["dimension (seed 4.2)", "monolithic (all in device)", "synchronous offload", "kvh"], body)


def offload_table(d: Path) -> Optional[str]:
    rows = rows_of(d / "offload.jsonl")
    if not rows:
        return None
    by: Dict[int, Dict[str, Row]] = defaultdict(dict)
    for r in rows:
        if "context" in r:
            by[r["context"]][r["metric"]] = r
    body = []
    for L in sorted(by):
        m = by[L]
        body.append(
            [
                str(L),
                num(m["recompute"]["value"]),
                f"{num(m['restore_host']['value'])} ({num(m['restore_host']['ratio'], 3)}x)",
                f"{num(m['restore_disk']['value'])} ({num(m['restore_disk']['ratio'], 3)}x)",
                num(m["kv_host"]["value"]),
                num(m["kv_disk"]["value"]),
            ]
        )
    out = table(
        [
            "context (tokens)",
            "recompute ms",
            "restore from host ms (gain)",
            "restore from disk ms (gain)",
            "KV only, host ms",
            "KV only, disk ms",
        ],
        body,
    )
    for r in rows:
        if r["metric"].startswith("crossover"):
            val = "none" if r["value"] is None else f"{r['value']:.0f} tokens"
            out += f"\n* `{r['metric']}`: {val} ({r['how']})"
    return out + "\n"


def codec_isa_table(d: Path) -> Optional[str]:
    rows = [r for r in rows_of(d / "codec.jsonl") if "isa" in r]
    if not rows:
        return None
    isas = [i for i in ("scalar", "avx2", "avx512") if any(r["isa"] == i for r in rows)]
    by = {(r["codec"], r["dtype"], r["isa"], r["metric"]): r for r in rows}
    body = []
    for codec in ("int8", "q4_g32", "q4_g64"):
        for dtype in ("f16", "bf16", "f32"):
            cells = [codec, dtype]
            for metric in ("encode", "decode"):
                target = ""
                for isa in isas:
                    r = by.get((codec, dtype, isa, metric))
                    cell = f"{num(r['ratio'], 2)} ({num(r['value'], 3)})" if r else ""
                    if r and "target" in r:
                        target = r["target"]
                        if r.get("met") is False:
                            cell = f"**{cell}** missed"
                    cells.append(cell)
                cells.append(target)
            body.append(cells)
    head = ["codec", "dtype"]
    for metric in ("encode", "decode"):
        head += [f"{metric} {i}" for i in isas] + [f"{metric} target"]
    return (
        table(head, body)
        + "\nCells: ratio to memcpy of the same raw bytes (median of per-round ratios), then GB/s of raw bytes. "
        "avx2 is the code before the AVX-512 codecs (unchanged), avx512 the one chosen at run time here.\n"
    )


def disk_ceiling_table(d: Path) -> Optional[str]:
    rows = [r for r in rows_of(d / "disk.jsonl") if "spread" in r]
    if not rows:
        return None
    body = []
    for r in rows:
        unit = r["unit"]
        fio = f"{num(r['fio'], 3)} {unit}" if "fio" in r else "(no fio)"
        cell = num(r["ratio"], 3)
        if r.get("met") is False:
            cell = f"**{cell}** missed"
        body.append(
            [
                r["metric"],
                f"{r['block_bytes'] >> 10} KiB",
                f"{num(r['value'], 3)} {unit}",
                f"{num(r['baseline'], 3)} {unit}",
                fio,
                cell,
                r.get("target", ""),
                f"{r['spread']} ({r['rounds']} rounds)",
            ]
        )
    return (
        table(["metric", "block", "kvh", "raw", "fio", "ratio", "target", "ranges"], body)
        + "\nMedians over rounds; ratio: median of per-round ratios (latency: raw / kvh). raw: io_uring with "
        "registered file and buffers at the depth kvh reaches; fio: the same file, sizes and depth.\n"
    )


def machine_text(d: Path) -> Optional[str]:
    p = d / "machine.txt"
    if not p.is_file():
        return None
    return "```\n" + p.read_text(encoding="utf-8").rstrip() + "\n```\n"


def generic_table(d: Path, name: str) -> Optional[str]:
    p = d / f"{name}.jsonl"
    if not p.is_file():
        return None
    res = subprocess.run([sys.executable, str(HERE / "summarize.py"), str(p)], capture_output=True, text=True)
    return res.stdout if res.returncode == 0 and res.stdout.strip() else None


BUILDERS = {
    "machine": machine_text,
    "trace": trace_table,
    "scale": scale_table,
    "tradeoff": tradeoff_table,
    "offload": offload_table,
    "codec-isa": codec_isa_table,
    "disk-ceiling": disk_ceiling_table,
}


def build(d: Path, name: str) -> Optional[str]:
    fn = BUILDERS.get(name)
    return fn(d) if fn else generic_table(d, name)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="update_results.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("dir", type=Path, help="results directory of run-bench.sh")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md", help="the file to update")
    ap.add_argument("--print", action="store_true", help="print the tables instead of updating the file")
    args = ap.parse_args(argv)
    if not args.dir.is_dir():
        print(f"update_results.py: {args.dir} is not a directory", file=sys.stderr)
        return 2
    text = args.results.read_text(encoding="utf-8")
    names = [m.group("name") for m in MARK.finditer(text)]
    if args.print:
        for n in names or list(BUILDERS):
            t = build(args.dir, n)
            if t:
                print(f"## {n}\n\n{t}")
        return 0
    kept = []

    def repl(m: re.Match) -> str:
        t = build(args.dir, m.group("name"))
        if t is None:
            kept.append(m.group("name"))
            return m.group(0)
        return m.group(1) + t + m.group(4)

    args.results.write_text(MARK.sub(repl, text), encoding="utf-8")
    print(
        f"update_results.py: {args.results} updated ({len(names) - len(kept)} tables)"
        + (f"; no data for: {', '.join(kept)}" if kept else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
