#!/usr/bin/env bash
# GPU checks of kvh for a machine with a CUDA GPU (written for one H200;
# about 3-6 minutes, well under 10):
#
#   1. configure + build with CUDA (Release, the attention targets only);
#   2. test_cuda_attention: the CUDA kernels against the CPU reference,
#      outputs poisoned with NaN, error bounds per io dtype (see the test);
#      the CPU emulation of the same kernels (kvh_attention_emu) as a
#      cross-check of a failure's cause;
#      test_cuda_vmap: views of the device tier on CUDA VMM allocations
#      equal paged attention bit for bit, stay correct after refresh
#      (append, migration, copy-on-write), and map/unmap of a 2 MiB unit
#      timed;
#   3. gpu_bench (benchmarks/gpu/gpu_bench.cu, built here with nvcc against
#      libkvh.so): decode at batch 32 x 8K context timed with CUDA events,
#      GB/s against the measured D2D copy throughput; device<->host
#      migration (kvh_seq_migrate) against cudaMemcpyAsync with pinned
#      memory; decode output identical after a round trip.
#
# Results go to $OUT when set (else $BUILD/gpu-results): run.log with
# everything, test_cuda_attention.log, test_cuda_vmap.log, gpu_bench.txt,
# gpu_bench.jsonl, nvidia-smi.txt, summary.txt. Exit status: 0 when the
# tests and the benchmark's checks pass, 1 otherwise (the other steps
# still run).
#
# Environment: BUILD (default <repo>/build-gpu), JOBS (default nproc),
# CUDA_ARCH for gpu_bench (default: native, else 90), SKIP_BUILD=1 to reuse
# a build.
set -uo pipefail
case ${1:-} in -h | --help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD=${BUILD:-$ROOT/build-gpu}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 4)}
RES=${OUT:-$BUILD/gpu-results}
mkdir -p "$RES"
LOG=$RES/run.log
: >"$LOG"
STATUS=0

log() { echo "[run.sh $(date +%H:%M:%S)] $*" | tee -a "$LOG"; }
step() { # step NAME TIMEOUT CMD...: runs CMD, output to the log and RES/NAME.log
    local name=$1 limit=$2
    shift 2
    log "== $name: $*"
    local t0=$SECONDS rc
    timeout --foreground -k 10 "$limit" "$@" 2>&1 | tee "$RES/$name.log" >>"$LOG"
    rc=${PIPESTATUS[0]}
    log "== $name: exit $rc after $((SECONDS - t0)) s"
    return "$rc"
}

log "repo $ROOT, build $BUILD, results $RES"
{ nvidia-smi || true; nvidia-smi -q -d CLOCK,MEMORY 2>/dev/null | head -60 || true; } >"$RES/nvidia-smi.txt" 2>&1
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
nvcc --version >>"$LOG" 2>&1 || log "nvcc not found"

# ---- 1. build ----
if [[ ${SKIP_BUILD:-0} != 1 ]]; then
    step configure 300 cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DKVH_WITH_CUDA=ON \
        -DKVH_BUILD_TESTS=ON -DKVH_BUILD_BENCH=OFF || STATUS=1
    step build 480 cmake --build "$BUILD" -j "$JOBS" --target kvh kvh_static kvh_cuda test_cuda_attention \
        test_cuda_vmap kvh_attention_emu test_tiers test_context test_weight_spill test_seq test_moves_in_place || STATUS=1
fi
if [[ ! -f $BUILD/libkvh_cuda.so ]]; then
    log "libkvh_cuda.so was not built (no nvcc?): nothing more to do"
    exit 1
fi
export KVH_CUDA_BACKEND=$BUILD/libkvh_cuda.so

# ---- 2. correctness ----
step test_cuda_attention 300 "$BUILD/tests/c/test_cuda_attention"
rc=$?
if [[ $rc == 77 ]]; then
    log "test_cuda_attention SKIPPED: no usable CUDA device (see its log)"
    STATUS=1
elif [[ $rc != 0 ]]; then
    STATUS=1
    # same kernels on the CPU: tells a logic bug from a hardware-only one
    step attention_emu 300 "$BUILD/kernels/cuda/kvh_attention_emu" 12 || true
fi

step test_cuda_vmap 240 "$BUILD/tests/c/test_cuda_vmap"
rc=$?
if [[ $rc == 77 ]]; then
    log "test_cuda_vmap SKIPPED: no usable CUDA device (see its log)"
    STATUS=1
elif [[ $rc != 0 ]]; then
    STATUS=1
fi

# The unified-memory paths, forced on this card: the tier, context and
# spill suites on the CUDA backend with the device tier in managed memory
# the CPU addresses (1: moves are CPU copies) and with both memory tiers
# one managed arena (2: moves re-account blocks in place).
for u in 1 2; do
    suites="test_tiers test_context test_weight_spill test_seq"
    [[ $u == 2 ]] && suites+=" test_moves_in_place"
    for t in $suites; do
        KVH_TEST_BACKEND=cuda KVH_CUDA_UNIFIED=$u step "unified${u}_$t" 120 "$BUILD/tests/c/$t" || STATUS=1
    done
done

# ---- 3. benchmark ----
ARCH=${CUDA_ARCH:-native}
BENCH=$BUILD/gpu_bench
log "building gpu_bench (arch $ARCH)"
if ! nvcc -O2 -std=c++17 -arch="$ARCH" -I"$ROOT/abi/include" "$ROOT/benchmarks/gpu/gpu_bench.cu" \
    -L"$BUILD" -lkvh -Xlinker -rpath="$BUILD" -o "$BENCH" >>"$LOG" 2>&1; then
    ARCH=sm_90
    log "arch native refused; retrying with $ARCH"
    nvcc -O2 -std=c++17 -arch="$ARCH" -I"$ROOT/abi/include" "$ROOT/benchmarks/gpu/gpu_bench.cu" \
        -L"$BUILD" -lkvh -Xlinker -rpath="$BUILD" -o "$BENCH" >>"$LOG" 2>&1 || STATUS=1
fi
if [[ -x $BENCH ]]; then
    export OUT=$RES
    step gpu_bench 300 "$BENCH" || STATUS=1
    cp "$RES/gpu_bench.log" "$RES/gpu_bench.txt" 2>/dev/null || true
fi

# ---- summary ----
{
    echo "kvh GPU run $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
    echo "test_cuda_attention: $(grep -E 'PASSED|FAILED|SKIP' "$RES/test_cuda_attention.log" 2>/dev/null | tr '\n' ' ')"
    grep -E 'worst error' "$RES/test_cuda_attention.log" 2>/dev/null | sed 's/^/  /'
    echo "test_cuda_vmap: $(grep -E '^\[  (PASSED|FAILED) |SKIP' "$RES/test_cuda_vmap.log" 2>/dev/null | tr '\n' ' ')"
    grep -E 'vmap timing|migrated block' "$RES/test_cuda_vmap.log" 2>/dev/null | sed 's/^/  /'
    for u in 1 2; do
        for t in test_tiers test_context test_weight_spill test_seq test_moves_in_place; do
            [[ -f $RES/unified${u}_$t.log ]] || continue
            echo "unified=$u $t: $(grep -E '^\[  (PASSED|FAILED) ' "$RES/unified${u}_$t.log" 2>/dev/null | tr '\n' ' ')"
        done
    done
    echo "gpu_bench:"
    grep -E '^  [a-z_]|round trip|device:' "$RES/gpu_bench.log" 2>/dev/null
    echo "overall: $([[ $STATUS == 0 ]] && echo OK || echo FAILED)"
} >"$RES/summary.txt"
tee -a "$LOG" <"$RES/summary.txt"
exit "$STATUS"
