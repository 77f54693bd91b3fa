#!/usr/bin/env bash
# Fails when a binding generated from abi/include/kvh/kvh.h differs from
# the committed one: the header is the single source of both bindings.
set -euo pipefail
case "${1:-}" in
  -h | --help)
    echo "usage: bindings/check-drift.sh"
    echo "Regenerates the Rust bindings and the CFFI cdef from abi/include/kvh/kvh.h and fails (exit 1)"
    echo "when either differs from the committed file (bindings/gen-rust.sh, bindings/gen-cffi.py)."
    exit 0
    ;;
  "") ;;
  *)
    echo "check-drift.sh: unknown argument '$1' (see --help)" >&2
    exit 2
    ;;
esac
cd "$(dirname "$0")/.."
status=0
if [ -f bindings/gen-rust.sh ]; then
  echo "drift: Rust bindings (rust/kvh-sys/src/bindings.rs)"
  bash bindings/gen-rust.sh --check || status=1
fi
if [ -f bindings/gen-cffi.py ]; then
  echo "drift: CFFI cdef (python/kvh_cache/_cdef.h)"
  python3 bindings/gen-cffi.py --check || status=1
fi
exit $status
