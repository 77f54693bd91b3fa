# kvh: top-level targets. CMake builds; this file installs what is missing
# and runs the suites in order, stopping at the first failure.
#
#   make demo     install deps, build build/, run the demo
#   make build    install deps, build build/
#   make test     the format check (clang-format, ruff, rustfmt), then
#                 build/ + ctest, ASan+UBSan build + ctest, TSan build +
#                 concurrency tests, then pytest, cargo test, the bindings
#                 drift check, a --quick run of every benchmark scenario,
#                 and each fuzz target for CI_FUZZ_SECONDS with a fixed
#                 seed (what CI runs)
#   make stress   long tests (label `stress`) in build/, then each fuzz
#                 target for STRESS_FUZZ_SECONDS
#   make fuzz     build build-fuzz/ (clang, libFuzzer + ASan/UBSan) and run
#                 each fuzz target for FUZZ_SECONDS (see tests/RELIABILITY.md)
#   make bench    the benchmark suite; regenerates benchmarks/RESULTS.md tables
#                 and benchmarks/plots/ (benchmarks/run-bench.sh)
#   make format   apply clang-format, ruff and rustfmt to the tree
#   make clean    remove the build trees
#
# Single suites: test-c, test-asan, test-tsan, test-python, test-wheel, test-vllm, test-rust,
# test-drift, test-bench, test-fuzz. `make bench-vllm` runs `kvh bench vllm`;
# SKIP_VLLM=1 leaves the vLLM suite out (it installs vLLM once per machine
# into ~/.cache/kvh, about 6 GB). Useful overrides: SKIP_DEPS=1 (no root, or offline),
# JOBS=N, CTEST_ARGS='-R prefix', CMAKE_ARGS='-DKVH_WITH_CUDA=OFF'.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := build
# Targets run one after another, in the order listed, even under `make -j`.
.NOTPARALLEL:
# Quieter logs from the make that `cmake --build` starts.
MAKEFLAGS += --no-print-directory

JOBS        ?= 2
PYTHON      ?= python3
CMAKE       ?= cmake
CTEST       ?= ctest
CARGO       ?= $(or $(shell command -v cargo 2>/dev/null),$(wildcard $(HOME)/.cargo/bin/cargo),cargo)

BUILD_DIR   ?= build
ASAN_DIR    ?= build-asan
TSAN_DIR    ?= build-tsan
BUILD_TYPE  ?= RelWithDebInfo
SKIP_DEPS   ?=
CMAKE_ARGS  ?=
# CI builds treat warnings as errors (CI=true is set by the CI runner).
ifeq ($(CI),true)
override CMAKE_ARGS += -DKVH_WERROR=ON
endif
CTEST_ARGS  ?=

# Sanitizer builds: asserts on (Debug) but optimised enough (-O1) to keep the
# suites quick.
SAN_CMAKE_ARGS ?= -DCMAKE_BUILD_TYPE=Debug '-DCMAKE_C_FLAGS_DEBUG=-g -O1' '-DCMAKE_CXX_FLAGS_DEBUG=-g -O1'

ASAN_OPTIONS_VALUE  ?= detect_leaks=1:abort_on_error=1
UBSAN_OPTIONS_VALUE ?= print_stacktrace=1:halt_on_error=1
TSAN_OPTIONS_VALUE  ?= halt_on_error=1:second_deadlock_stack=1
ASAN_ENV := ASAN_OPTIONS=$(ASAN_OPTIONS_VALUE) UBSAN_OPTIONS=$(UBSAN_OPTIONS_VALUE)
TSAN_ENV := TSAN_OPTIONS=$(TSAN_OPTIONS_VALUE)
# Prefix for the TSan test run, e.g. `setarch -R` on a kernel whose ASLR
# layout this TSan runtime rejects ("unexpected memory mapping").
TSAN_WRAP   ?=

CTEST_FLAGS := --output-on-failure --no-tests=error -j$(JOBS)

# libFuzzer targets of fuzz/ (clang from Debian): CI_FUZZ_SECONDS each in
# `make test` (seeded with CI_FUZZ_SEED, so a rerun explores the same
# inputs), FUZZ_SECONDS in `make fuzz`, STRESS_FUZZ_SECONDS in `make stress`.
FUZZ_DIR            ?= build-fuzz
FUZZ_CC             ?= clang
FUZZ_CXX            ?= clang++
FUZZ_SECONDS        ?= 20
CI_FUZZ_SECONDS     ?= 15
# fuzz_api first replays its committed corpus (about 15 s under ASan), so it
# gets longer to explore past it.
CI_FUZZ_API_SECONDS ?= 45
CI_FUZZ_SEED        ?= 1
STRESS_FUZZ_SECONDS ?= 600
HAVE_FUZZ := $(and $(wildcard fuzz/CMakeLists.txt),$(shell command -v $(FUZZ_CC) 2>/dev/null))

# Demo hook: the C demo now. When the Python package (python/kvh_cache) is ready,
# switch to its CLI, e.g.
#   DEMO_PREP ?= $(PYTHON) -m pip install --quiet ./python
#   DEMO_CMD  ?= kvh demo
DEMO_PREP   ?= env KVH_BUILD_DIR=$(abspath $(BUILD_DIR)) $(PYTHON) python/build_cffi.py --quiet
DEMO_CMD    ?= env $(PYTEST_ENV) $(PYTHON) -m kvh_cache demo

# How pytest and cargo find the freshly built library (hooks for python/, rust/).
LIB_ENV     := KVH_BUILD_DIR=$(abspath $(BUILD_DIR)) LD_LIBRARY_PATH=$(abspath $(BUILD_DIR))$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH}
PYTEST_ENV  ?= $(LIB_ENV) PYTHONPATH=$(CURDIR)/python$${PYTHONPATH:+:$$PYTHONPATH}
PYTEST_ARGS ?= -ra
CARGO_ENV   ?= $(LIB_ENV) KVH_LIB_DIR=$(abspath $(BUILD_DIR))
CARGO_ARGS  ?=


# Optional parts join the suite as soon as their files exist.
PY_TESTS  := $(shell find tests/python -type f \( -name 'test_*.py' -o -name '*_test.py' \) 2>/dev/null)
MT_TESTS  := $(wildcard tests/c/test_*_mt.c tests/c/test_concurrency*.c)
HAVE_RUST := $(wildcard rust/Cargo.toml)
HAVE_DRIFT:= $(wildcard bindings/check-drift.sh)

# nvcc lives in /usr/local/cuda/bin, which is not always on PATH.
ifeq ($(shell command -v nvcc 2>/dev/null),)
ifneq ($(wildcard /usr/local/cuda/bin/nvcc),)
export CUDACXX ?= /usr/local/cuda/bin/nvcc
endif
endif

step = @printf '\n==> %s\n' "$(1)"

.PHONY: all deps build demo test test-c test-asan test-tsan test-python test-rust \
        test-drift build-asan build-tsan stress bench test-bench clean help build-fuzz fuzz test-fuzz \
        test-format format test-vllm bench-vllm test-wheel

all: build

help:
	@sed -n '1,/^$$/p' $(firstword $(MAKEFILE_LIST)) | sed 's/^# \{0,1\}//'

# ---- dependencies -----------------------------------------------------------
deps:
ifeq ($(SKIP_DEPS),)
	$(call step,install dependencies)
	PYTHON=$(PYTHON) bash scripts/install-deps.sh
else
	@echo "deps: skipped (SKIP_DEPS=$(SKIP_DEPS))"
endif

# ---- builds -------------------------------------------------------------------
# Configure every time (well under a second once the tree exists) so the
# options below always hold; CMake rebuilds only what changed.
build: deps
	$(call step,build $(BUILD_DIR)/ ($(BUILD_TYPE)))
	$(CMAKE) -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) -DKVH_STRESS=OFF $(CMAKE_ARGS)
	$(CMAKE) --build $(BUILD_DIR) -j$(JOBS)

build-asan: deps
	$(call step,build $(ASAN_DIR)/ (ASan+UBSan))
	$(CMAKE) -S . -B $(ASAN_DIR) -DKVH_SANITIZE=address $(SAN_CMAKE_ARGS) $(CMAKE_ARGS)
	$(CMAKE) --build $(ASAN_DIR) -j$(JOBS)

build-tsan: deps
	$(call step,build $(TSAN_DIR)/ (TSan))
	$(CMAKE) -S . -B $(TSAN_DIR) -DKVH_SANITIZE=thread $(SAN_CMAKE_ARGS) $(CMAKE_ARGS)
	$(CMAKE) --build $(TSAN_DIR) -j$(JOBS)

# ---- demo ----------------------------------------------------------------------
demo: build
	$(call step,demo)
ifneq ($(strip $(DEMO_PREP)),)
	$(DEMO_PREP)
endif
	@command -v $(firstword $(DEMO_CMD)) >/dev/null || \
	  { echo "demo: '$(firstword $(DEMO_CMD))' not found (build examples/, or set DEMO_CMD)" >&2; exit 1; }
	$(DEMO_CMD)

# ---- test suites, in the order `make test` runs them ---------------------------
# The committed fuzz corpora are replayed by ctest in every C suite; the
# last steps smoke-run every benchmark scenario and fuzz each target
# briefly from a fixed seed.
test: test-format test-c test-asan test-tsan test-python test-wheel test-vllm test-rust test-drift test-bench test-fuzz
	@printf '\n==> make test: all suites passed\n'

# One formatter per language (clang-format, ruff, rustfmt); `make format`
# applies them.
test-format: deps
	$(call step,[1/9] format check (clang-format, ruff, rustfmt))
	PYTHON=$(PYTHON) CARGO=$(CARGO) bash scripts/check-format.sh

format: deps
	PYTHON=$(PYTHON) CARGO=$(CARGO) bash scripts/check-format.sh --fix

test-c: build
	$(call step,[2/9] C tests in $(BUILD_DIR)/)
	$(CTEST) --test-dir $(BUILD_DIR) $(CTEST_FLAGS) -LE stress $(CTEST_ARGS)

test-asan: build-asan
	$(call step,[3/9] C tests under ASan+UBSan in $(ASAN_DIR)/)
	env $(ASAN_ENV) $(CTEST) --test-dir $(ASAN_DIR) $(CTEST_FLAGS) -LE stress $(CTEST_ARGS)

ifneq ($(MT_TESTS),)
test-tsan: build-tsan
	$(call step,[4/9] concurrency tests under TSan in $(TSAN_DIR)/)
	env $(TSAN_ENV) $(TSAN_WRAP) $(CTEST) --test-dir $(TSAN_DIR) $(CTEST_FLAGS) -L concurrency -LE stress $(CTEST_ARGS)
else
test-tsan:
	$(call step,[4/9] TSan: skipped: no tests/c/test_*_mt.c or test_concurrency*.c yet)
endif

ifneq ($(PY_TESTS),)
test-python: build
	$(call step,[5/9] pytest tests/python)
	env $(PYTEST_ENV) $(PYTHON) -m pytest $(PYTEST_ARGS) --ignore=tests/python/vllm tests/python
else
test-python:
	$(call step,[5/9] pytest: skipped: no test files in tests/python)
endif

# The release path: sdist and wheel of kvh-cache built as a release would
# (one compile, from the sdist alone), the wheel repaired to a manylinux tag,
# each installed into a fresh venv outside the repository and smoke-tested.
test-wheel: deps
	$(call step,[5/9] kvh-cache sdist and manylinux wheel in fresh venvs (scripts/test-wheel.sh))
	PYTHON=$(PYTHON) bash scripts/test-wheel.sh

# vLLM (CPU build) in a venv cached once per machine, SmolLM2 converted to
# an HF directory (cached), then kvh's vLLM connector under real vLLM runs.
SKIP_VLLM   ?=
VLLM_PREP   := vpy="$$(PYTHON=$(PYTHON) bash scripts/install-vllm.sh)"; model="$$("$$vpy" scripts/convert-model-hf.py)"
ifeq ($(SKIP_VLLM),)
test-vllm: build
	$(call step,[5/9] vLLM connector under vLLM (tests/python/vllm))
	$(VLLM_PREP); env $(PYTEST_ENV) KVH_VLLM_PYTHON="$$vpy" KVH_VLLM_MODEL="$$model" $(PYTHON) -m pytest $(PYTEST_ARGS) tests/python/vllm
else
test-vllm:
	$(call step,[5/9] vLLM connector: skipped (SKIP_VLLM=$(SKIP_VLLM)))
endif

bench-vllm: build
	$(call step,kvh bench vllm)
	$(VLLM_PREP); env $(PYTEST_ENV) KVH_VLLM_PYTHON="$$vpy" KVH_VLLM_MODEL="$$model" $(PYTHON) -m kvh_cache bench vllm

ifneq ($(HAVE_RUST),)
test-rust: build
	$(call step,[6/9] cargo test --offline, clippy, doc and a downstream crate in rust/)
	cd rust && env $(CARGO_ENV) $(CARGO) test --offline $(CARGO_ARGS)
	cd rust && env $(CARGO_ENV) $(CARGO) clippy --offline --all-targets -- -D warnings
	cd rust && env $(CARGO_ENV) RUSTDOCFLAGS='-D warnings' $(CARGO) doc --offline --no-deps --quiet
	CARGO=$(CARGO) bash scripts/test-rust-downstream.sh $(BUILD_DIR)
else
test-rust:
	$(call step,[6/9] cargo: skipped: no rust/Cargo.toml)
endif

ifneq ($(HAVE_DRIFT),)
test-drift: deps
	$(call step,[7/9] bindings drift check)
	bash bindings/check-drift.sh
else
test-drift:
	$(call step,[7/9] bindings drift: skipped: no bindings/check-drift.sh)
endif

# ---- fuzzing ----------------------------------------------------------------------
ifneq ($(HAVE_FUZZ),)
build-fuzz: deps
	$(call step,build $(FUZZ_DIR)/ (libFuzzer targets: $(FUZZ_CC) + ASan/UBSan))
	CC=$(FUZZ_CC) CXX=$(FUZZ_CXX) $(CMAKE) -S . -B $(FUZZ_DIR) -DKVH_FUZZ=ON -DKVH_SANITIZE=address \
	  $(SAN_CMAKE_ARGS) -DKVH_BUILD_TESTS=OFF -DKVH_BUILD_BENCH=OFF -DKVH_WITH_CUDA=OFF
	$(CMAKE) --build $(FUZZ_DIR) -j$(JOBS) --target kvh_fuzzers

fuzz: build-fuzz
	$(call step,fuzz: each target for $(FUZZ_SECONDS) s ($(JOBS) at a time))
	bash fuzz/run-fuzzers.sh $(FUZZ_DIR) $(FUZZ_SECONDS) $(JOBS)

test-fuzz: build-fuzz
	$(call step,[9/9] fuzz: each target for $(CI_FUZZ_SECONDS) s (fuzz_api $(CI_FUZZ_API_SECONDS) s) from seed $(CI_FUZZ_SEED))
	FUZZ_SEED=$(CI_FUZZ_SEED) FUZZ_API_SECONDS=$(CI_FUZZ_API_SECONDS) bash fuzz/run-fuzzers.sh $(FUZZ_DIR) $(CI_FUZZ_SECONDS) $(JOBS)
else
build-fuzz fuzz test-fuzz:
	$(call step,fuzz: skipped: needs $(FUZZ_CC) (libFuzzer) and fuzz/CMakeLists.txt)
endif

# ---- long runs -------------------------------------------------------------------
stress: deps
	$(call step,stress tests in $(BUILD_DIR)/)
	$(CMAKE) -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) -DKVH_STRESS=ON $(CMAKE_ARGS)
	$(CMAKE) --build $(BUILD_DIR) -j$(JOBS)
	$(CTEST) --test-dir $(BUILD_DIR) --output-on-failure --no-tests=ignore -L stress $(CTEST_ARGS)
	$(MAKE) fuzz FUZZ_SECONDS=$(STRESS_FUZZ_SECONDS)

# The whole suite: scenarios, model demo (trade-off table + recorded trace),
# policy evaluation, offload threshold; regenerates benchmarks/plots/ and
# the measured tables of benchmarks/RESULTS.md (benchmarks/run-bench.sh).
bench: build
	$(call step,benchmarks (benchmarks/run-bench.sh $(BUILD_DIR)))
	PYTHON=$(PYTHON) bash benchmarks/run-bench.sh $(BUILD_DIR)

# Smoke run of every kvh-bench scenario with --quick (and the plots), so
# none rots; timings are not checked.
test-bench: build
	$(call step,[8/9] bench smoke: every kvh-bench scenario with --quick)
	PYTHON=$(PYTHON) bash benchmarks/run-bench.sh --quick $(BUILD_DIR)

clean:
	rm -rf $(BUILD_DIR) $(ASAN_DIR) $(TSAN_DIR)
ifneq ($(HAVE_RUST),)
	rm -rf rust/target
endif
