#!/usr/bin/env bash
# Fails when a binding generated from abi/include/kvh/kvh.h differs from
# the committed one: the header is the single source of both bindings.
set -euo pipefail
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
