#!/usr/bin/env bash
# Checks (default) or applies (--fix) the one formatter of each language:
# clang-format (.clang-format) for C, C++ and CUDA, ruff (ruff.toml) for
# Python lint and format, rustfmt for the Rust crates. Only files git
# tracks are looked at, so build trees and generated corpora never are.
#
# Usage: bash scripts/check-format.sh [--fix]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
fix=0
case "${1:-}" in
--fix) fix=1 ;;
"") ;;
-h | --help)
    sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
    ;;
*)
    echo "check-format: unknown option $1 (try --help)" >&2
    exit 2
    ;;
esac
PYTHON="${PYTHON:-python3}"
CARGO="${CARGO:-cargo}"
status=0

# Generated bindings are left as their generators write them. New files
# not yet added count too (--others --exclude-standard), so a format run
# before the first commit of a file covers it.
mapfile -t c_files < <(git ls-files --cached --others --exclude-standard -- '*.c' '*.h' '*.cpp' '*.cu' '*.cuh' |
    grep -v -e '^rust/' -e '^fuzz/corpus/' -e '^python/kvh_cache/_cdef\.h$')
echo "format: clang-format, ${#c_files[@]} files"
if ((fix)); then
    clang-format -i "${c_files[@]}"
elif ! clang-format --dry-run -Werror "${c_files[@]}"; then
    echo "format: C sources differ from .clang-format (make format)" >&2
    status=1
fi

echo "format: ruff check + ruff format"
if ((fix)); then
    "$PYTHON" -m ruff check --fix --quiet .
    "$PYTHON" -m ruff format --quiet .
else
    "$PYTHON" -m ruff check --quiet . || status=1
    "$PYTHON" -m ruff format --check --quiet . || {
        echo "format: Python sources differ from ruff format (make format)" >&2
        status=1
    }
fi

if [ -f rust/Cargo.toml ] && command -v "$CARGO" >/dev/null 2>&1; then
    echo "format: cargo fmt"
    if ((fix)); then
        (cd rust && "$CARGO" fmt)
    elif ! (cd rust && "$CARGO" fmt --check >/dev/null); then
        echo "format: Rust sources differ from rustfmt (make format)" >&2
        status=1
    fi
fi
exit $status
