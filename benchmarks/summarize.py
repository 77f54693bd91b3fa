#!/usr/bin/env python3
"""Median of several `kvh-bench SCENARIO --json` runs, as Markdown tables.

    python3 benchmarks/summarize.py run1.jsonl run2.jsonl run3.jsonl

Rows are grouped by scenario, metric and every parameter key; for each
group the median value, median baseline and median ratio over the runs are
printed, with the spread of the ratio (min..max) and whether the target
holds on the median.
"""

import json
import re
import statistics
import sys

FIXED = {"scenario", "metric", "value", "unit", "baseline", "ratio", "target", "met", "note"}


def fmt(x):
    if x is None:
        return ""
    if isinstance(x, float):
        if x != 0 and (abs(x) >= 1e5 or abs(x) < 1e-2):
            return f"{x:.3g}"
        return f"{x:.3g}" if abs(x) < 10 else f"{x:.4g}"
    return str(x)


def target_met(target, value, ratio):
    m = re.match(r"(ratio|value) (>=|<=) ([0-9.eE+-]+)", target or "")
    if not m:
        return None
    x = ratio if m.group(1) == "ratio" else value
    if x is None:
        return None
    bound = float(m.group(3))
    return x >= bound if m.group(2) == ">=" else x <= bound


def main(paths):
    groups = {}  # key -> list of rows
    order = []
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line.startswith("{"):
                    continue
                row = json.loads(line)
                params = tuple((k, row[k]) for k in row if k not in FIXED)
                key = (row["scenario"], row["metric"], params)
                if key not in groups:
                    groups[key] = []
                    order.append(key)
                groups[key].append(row)
    scenario = None
    for key in order:
        rows = groups[key]
        if key[0] != scenario:
            scenario = key[0]
            print(f"\n### {scenario}\n")
            print(
                "| metric | parameters | runs | median value | median baseline | median ratio"
                " | ratio min..max | target |"
            )
            print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        unit = rows[0]["unit"]
        value = statistics.median(r["value"] for r in rows)
        bases = [r["baseline"] for r in rows if r.get("baseline") is not None]
        ratios = [r["ratio"] for r in rows if r.get("ratio") is not None]
        base = statistics.median(bases) if bases else None
        ratio = statistics.median(ratios) if ratios else None
        spread = f"{min(ratios):.3g}..{max(ratios):.3g}" if ratios else ""
        target = rows[0].get("target", "")
        met = target_met(target, value, ratio)
        tcell = "" if met is None else f"{target}: {'met' if met else '**missed**'}"
        params = " ".join(f"{k}={v}" for k, v in key[2])
        print(
            f"| {key[1]} | {params} | {len(rows)} | {fmt(value)} {unit} | "
            f"{fmt(base) + ' ' + unit if base is not None else ''} | {fmt(ratio)} | {spread} | {tcell} |"
        )


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print("usage: summarize.py RUN.jsonl [RUN.jsonl ...]\n")
        print(__doc__.strip())
        sys.exit(0)
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
