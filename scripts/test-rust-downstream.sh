#!/usr/bin/env bash
# A new cargo project outside the repository that depends on rust/kvh by
# path, built offline with none of kvh's environment variables set:
#
#   1. default features (`bundled`): kvh-sys builds libkvh from the C sources
#      with cmake and links it statically; `cargo run --example agents` and
#      the built binary run with no environment variable, and the binary
#      needs neither libkvh.so nor liburing.so at run time;
#   2. with BUILD_DIR (a CMake build tree holding libkvh.so) given:
#      `default-features = false` against that libkvh.so through
#      KVH_LIB_DIR at build time only, the rpath written by the project's
#      one-line build script (rust/README.md), run with no environment.
#
#   bash scripts/test-rust-downstream.sh [BUILD_DIR]
#
# KEEP=1 keeps the temporary projects. CARGO names cargo.
set -euo pipefail
case ${1:-} in -h | --help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac

repo=$(cd "$(dirname "$0")/.." && pwd)
cargo=${CARGO:-cargo}
build_dir=${1:-}
work=$(mktemp -d "${TMPDIR:-/tmp}/kvh-downstream.XXXXXX")
if [[ -z ${KEEP:-} ]]; then
  trap 'rm -rf "$work"' EXIT
else
  echo "downstream: keeping $work"
fi

# Nothing of the caller's kvh setup may help.
clean_env=(env -u KVH_LIB_DIR -u KVH_SOURCE_DIR -u KVH_BUILD_DIR -u LD_LIBRARY_PATH
  -u PKG_CONFIG_PATH -u CARGO_TARGET_DIR -u KVH_CUDA_BACKEND -u RUSTFLAGS)

write_project() { # dir, dependency lines, [rpath: add the rpath build.rs]
  local dir=$1
  mkdir -p "$dir/src" "$dir/examples"
  cat >"$dir/Cargo.toml" <<TOML
[package]
name = "kvh-downstream"
version = "0.1.0"
edition = "2021"
publish = false

[dependencies]
$2

[workspace]
TOML
  cp "$repo/rust/kvh/examples/agents.rs" "$dir/examples/agents.rs"
  cat >"$dir/src/main.rs" <<'RS'
//! Opens an engine, appends tokens to a sequence, prints the version.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let engine = kvh::Engine::open(kvh::Config::new().backend(kvh::Backend::Cpu))?;
    let seq = engine.create_sequence(0)?;
    seq.append(&(0..64).collect::<Vec<i32>>())?;
    println!("kvh {} from a downstream crate: {} tokens", kvh::version_string(), seq.len()?);
    Ok(())
}
RS
  if [[ ${3:-} == rpath ]]; then
    # The one line a binary crate adds when it links an installed libkvh.so.
    cat >"$dir/build.rs" <<'RS'
fn main() {
    for dir in std::env::var("DEP_KVH_LIB_DIR").unwrap_or_default().split(':') {
        if !dir.is_empty() {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        }
    }
}
RS
  fi
}

check_run() { # binary
  local needed
  needed=$(readelf -d "$1" | grep NEEDED || true)
  echo "$needed" | sed 's/^ */    /'
  if [[ ${2:-} == static ]] && grep -q 'libkvh\|liburing' <<<"$needed"; then
    echo "downstream: $1 needs libkvh or liburing at run time" >&2
    exit 1
  fi
  (cd "$work" && env -i PATH="$PATH" HOME="${HOME:-/tmp}" "$1")
}

echo "downstream: [1/2] kvh with default features (bundled) in $work/bundled"
write_project "$work/bundled" "kvh = { path = \"$repo/rust/kvh\" }"
start=$(date +%s)
(cd "$work/bundled" && "${clean_env[@]}" "$cargo" build --offline --quiet --bins --examples)
echo "downstream: bundled build (libkvh from source, Release) took $(($(date +%s) - start)) s"
(cd "$work/bundled" && "${clean_env[@]}" "$cargo" run --offline --quiet --example agents) | tail -4
check_run "$work/bundled/target/debug/kvh-downstream" static

if [[ -n $build_dir ]]; then
  lib_dir=$(cd "$build_dir" && pwd)
  echo "downstream: [2/2] kvh without bundled, libkvh.so of $lib_dir"
  write_project "$work/system" \
    "kvh = { path = \"$repo/rust/kvh\", default-features = false }
kvh-sys = { path = \"$repo/rust/kvh-sys\", default-features = false }" \
    rpath
  (cd "$work/system" && "${clean_env[@]}" KVH_LIB_DIR="$lib_dir" "$cargo" build --offline --quiet --bins)
  check_run "$work/system/target/debug/kvh-downstream"
else
  echo "downstream: [2/2] skipped (no BUILD_DIR given)"
fi
echo "downstream: ok"
