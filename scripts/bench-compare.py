#!/usr/bin/env python3
"""Compares two kvh-bench programs (e.g. a build of main and one of a
change) on one scenario: ROUNDS alternating runs of `kvh-bench SCENARIO
--json --quick` each (the order flips every round, so drift in the
machine's load hits both alike), then per metric the median of each
program's `ratio` (ours / its in-run baseline) and their quotient.

    python3 scripts/bench-compare.py BASE_BENCH NEW_BENCH [--scenario disk] [--rounds 21] [--args "ARGS"]

A quotient near 1 means the change costs nothing measurable there. ARGS
go to every run (e.g. `--args "--dir /work/tmp/bench"` for the disk
scenario: a directory of its own on a real disk).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from collections import defaultdict


def run(bench: str, scenario: str, extra: list) -> dict:
    res = subprocess.run([bench, scenario, "--json", "--quick", *extra], capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"bench-compare: {bench} {scenario} exited with {res.returncode}: {res.stderr[-500:]}")
    ratios = {}
    for line in res.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            if "ratio" in row:
                params = tuple(sorted((k, v) for k, v in row.items() if k not in _NOT_PARAMS))
                ratios[(row["metric"], params)] = row["ratio"]
    return ratios


_NOT_PARAMS = {"scenario", "metric", "value", "unit", "baseline", "ratio", "target", "met", "note"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base")
    ap.add_argument("new")
    ap.add_argument("--scenario", default="disk")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--args", default="", help="arguments for every run, one string")
    args = ap.parse_args()
    base, new = os.path.abspath(args.base), os.path.abspath(args.new)
    got: dict = {"base": defaultdict(list), "new": defaultdict(list)}
    for r in range(args.rounds):
        order = [("base", base), ("new", new)] if r % 2 == 0 else [("new", new), ("base", base)]
        for name, bench in order:
            for key, ratio in run(bench, args.scenario, shlex.split(args.args)).items():
                got[name][key].append(ratio)
    print(f"{'metric':28s} {'params':40s} {'base':>6s} {'new':>6s} {'new/base':>8s}")
    for key in sorted(set(got["base"]) & set(got["new"])):
        b, n = statistics.median(got["base"][key]), statistics.median(got["new"][key])
        params = " ".join(f"{k}={v}" for k, v in key[1])
        print(f"{key[0]:28s} {params[:40]:40s} {b:6.3f} {n:6.3f} {n / b:8.3f}")


if __name__ == "__main__":
    main()
