#!/usr/bin/env bash
# Runs every libFuzzer target of a fuzz build for a bounded time.
#
#   fuzz/run-fuzzers.sh BUILD_DIR SECONDS [JOBS] [TARGET...]
#
# Each target fuzz_X starts from fuzz/corpus/fuzz_X (the committed seeds,
# read only) and BUILD_DIR/corpus/fuzz_X (what earlier runs found; new
# inputs go there). Crashes, leaks, timeouts and out-of-memory inputs are
# written to BUILD_DIR/artifacts/ and make the script fail. Up to JOBS
# targets run at once. A summary line per target gives the executions.
# FUZZ_SEED=N seeds libFuzzer's generator (a fixed seed makes CI runs explore
# the same inputs; unset, each run differs). FUZZ_API_SECONDS, when set,
# replaces SECONDS for fuzz_api, whose committed corpus alone takes about
# 15 s to load under ASan before any new input is tried.
set -euo pipefail

build=${1:?build dir}
seconds=${2:?seconds per target}
jobs=${3:-2}
shift $(( $# >= 3 ? 3 : $# ))
src=$(cd "$(dirname "$0")" && pwd)
targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then
  for f in "$src"/fuzz_*.c; do targets+=("$(basename "$f" .c)"); done
fi

mkdir -p "$build/corpus" "$build/artifacts" "$build/logs"
export ASAN_OPTIONS=${FUZZ_ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${FUZZ_UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export LSAN_OPTIONS=${FUZZ_LSAN_OPTIONS:-suppressions=$src/lsan.supp}

run_one() {
  local t=$1
  local bin="$build/fuzz/$t" log="$build/logs/$t.log"
  if [[ ! -x $bin ]]; then
    echo "fuzz: $bin is not built" >&2
    return 1
  fi
  mkdir -p "$build/corpus/$t"
  local rc=0 secs=$seconds
  [[ $t == fuzz_api && -n ${FUZZ_API_SECONDS:-} ]] && secs=$FUZZ_API_SECONDS
  local seed=()
  [[ -n ${FUZZ_SEED:-} ]] && seed=(-seed="$FUZZ_SEED")
  "$bin" "${seed[@]}" -max_total_time="$secs" -timeout=25 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$build/artifacts/$t-" "$build/corpus/$t" "$src/corpus/$t" >"$log" 2>&1 || rc=$?
  local execs
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  local corpus
  corpus=$(find "$build/corpus/$t" -type f | wc -l)
  if [[ $rc -ne 0 ]]; then
    echo "fuzz: $t FAILED after ${execs:-?} executions (exit $rc); log $log:" >&2
    grep -E 'ERROR|SUMMARY|runtime error|fuzz property|Test unit written' "$log" | head -20 >&2 || true
    return 1
  fi
  echo "fuzz: $t: ${execs:-0} executions in ${secs} s, 0 crashes / leaks / timeouts (corpus: $corpus found + $(find "$src/corpus/$t" -type f | wc -l) seeds)"
}

pids=() names=() failed=0
for t in "${targets[@]}"; do
  run_one "$t" &
  pids+=($!) names+=("$t")
  if (( ${#pids[@]} >= jobs )); then
    wait "${pids[0]}" || failed=1
    pids=("${pids[@]:1}") names=("${names[@]:1}")
  fi
done
for p in "${pids[@]}"; do wait "$p" || failed=1; done
exit $failed
