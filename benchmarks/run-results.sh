#!/usr/bin/env bash
# Runs each kvh-bench scenario RUNS times (default 3) with --json, keeps the
# raw JSON lines under OUT, and prints the medians as Markdown tables (the
# form used in benchmarks/RESULTS.md), preceded by the machine description.
#
#   bash benchmarks/run-results.sh                    # alloc and migrate, 3 runs
#   SCENARIOS=migrate RUNS=5 bash benchmarks/run-results.sh --threads 1
#
# Extra arguments are passed to every kvh-bench call. The machine is shared
# and noisy: the 1-minute load average is printed before each run.
set -euo pipefail
case ${1:-} in -h | --help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BENCH="${BENCH:-$here/../build/benchmarks/kvh-bench}"
RUNS="${RUNS:-3}"
SCENARIOS="${SCENARIOS:-alloc migrate}"
OUT="${OUT:-$here/../build/bench-results}"

[[ -x "$BENCH" ]] || { echo "run-results: $BENCH is not built (cmake --build build)" >&2; exit 1; }
mkdir -p "$OUT"

echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
echo "machine: $(nproc) CPUs, $(lscpu | sed -n 's/^Model name:[[:space:]]*//p'), $(free -g | awk '/^Mem:/ {print $2}') GiB RAM"
echo "kernel: $(uname -r)"
echo "commit: $(git -C "$here/.." rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$here/.." diff --quiet HEAD -- core abi kernels 2>/dev/null || echo ' (+ uncommitted library changes)')"

files=()
for s in $SCENARIOS; do
    for i in $(seq 1 "$RUNS"); do
        f="$OUT/$s.$i.jsonl"
        echo "run $s #$i: load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2
        echo "+ $BENCH $s --json $*" >&2
        "$BENCH" "$s" --json "$@" >"$f"
        files+=("$f")
    done
done
python3 "$here/summarize.py" "${files[@]}"
