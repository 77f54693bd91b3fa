#!/usr/bin/env python3
"""CFFI builder of `kvh_cache._kvh_cffi` (out-of-line API mode).

The cdef is `kvh_cache/_cdef.h`, generated from `abi/include/kvh/kvh.h` by
`bindings/gen-cffi.py`. Two users:

* `setup.py` (wheels): `make_ffibuilder(include_dir, lib_dir, rpaths=["$ORIGIN"])`
  and its own build of libkvh; libkvh.so.0 sits beside the extension.
* the development tree: `python3 python/build_cffi.py` compiles the extension
  in place (python/kvh_cache/_kvh_cffi.*.so) against an existing CMake build of
  libkvh (`$KVH_BUILD_DIR`, default `<repo>/build`), with that directory in
  the extension's run path, so `PYTHONPATH=python` is all that is needed.
  It does nothing when the extension is newer than its inputs (`--force`
  rebuilds).
"""
from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGE = HERE / "kvh_cache"
CDEF = PACKAGE / "_cdef.h"

# Declared here, not in the header: the Python side of the log sink, and
# calls whose status must outlive an exception raised as they return.
EXTRA_CDEF = (
    'extern "Python" void _kvh_py_log(void *user, int32_t level, const char *message);\n'
    "void kvhpy_seq_acquire(kvh_engine *engine, kvh_seq seq, uint64_t first, uint64_t n, kvh_fence *fence,\n"
    "                       kvh_status *status);\n"
    "void kvhpy_block_keep(kvh_engine *engine, kvh_block block, int *retained, kvh_status *status);\n"
    "void kvhpy_block_let_go(kvh_engine *engine, kvh_block block, kvh_status *status);\n"
)
# Python runs a signal's handler (Ctrl-C's KeyboardInterrupt) as a call
# returns, before its result is stored: a status returned there is lost,
# and the hold it took with it. Written through a pointer, it is not.
EXTRA_SOURCE = """
static void kvhpy_seq_acquire(kvh_engine *engine, kvh_seq seq, uint64_t first, uint64_t n, kvh_fence *fence,
                              kvh_status *status)
{
    *status = kvh_seq_acquire(engine, seq, first, n, fence);
}

/* A block view's own reference and pin, taken in one call and given back
 * in one: an exception raised between two calls left a pin no one owned
 * (its slot then never reusable). A pin that fails leaves the reference
 * taken (*retained) for the caller to release. */
static void kvhpy_block_keep(kvh_engine *engine, kvh_block block, int *retained, kvh_status *status)
{
    kvh_status st = kvh_block_retain(engine, block);
    *retained = st == KVH_OK;
    if (st == KVH_OK)
        st = kvh_block_pin(engine, block, 1);
    *status = st;
}

static void kvhpy_block_let_go(kvh_engine *engine, kvh_block block, kvh_status *status)
{
    kvh_status unpinned = kvh_block_pin(engine, block, 0);
    if (unpinned == KVH_ERR_BUSY) { /* refused (a call from the log sink): nothing done, retried later */
        *status = unpinned;
        return;
    }
    kvh_status released = kvh_block_release(engine, block);
    *status = unpinned != KVH_OK ? unpinned : released;
}
"""


def repo_root() -> Path:
    """The C source tree: $KVH_SOURCE_DIR, else csrc/ beside this file (in
    an sdist), else the repository around this directory."""
    env = os.environ.get("KVH_SOURCE_DIR")
    if env:
        return Path(env).resolve()
    if (HERE / "csrc" / "CMakeLists.txt").is_file():
        return HERE / "csrc"
    return HERE.parent.resolve()


def default_include_dir() -> Path:
    return repo_root() / "abi" / "include"


def make_ffibuilder(include_dir: Path | str, lib_dir: Path | str, rpaths: list[str] | None = None):
    import cffi

    ffibuilder = cffi.FFI()
    ffibuilder.cdef(CDEF.read_text() + EXTRA_CDEF)
    rpaths = list(rpaths or [])
    ffibuilder.set_source(
        "kvh_cache._kvh_cffi",
        "#include <kvh/kvh.h>\n" + EXTRA_SOURCE,
        include_dirs=[str(include_dir)],
        library_dirs=[str(lib_dir)],
        libraries=["kvh"],
        extra_compile_args=["-O2"],
        extra_link_args=[f"-Wl,-rpath,{r}" for r in rpaths],
    )
    return ffibuilder


def extension_filename() -> str:
    return "_kvh_cffi" + sysconfig.get_config_var("EXT_SUFFIX")


def build_dir() -> Path:
    return Path(os.environ.get("KVH_BUILD_DIR") or repo_root() / "build").resolve()


def inputs() -> list[Path]:
    # libkvh itself is linked dynamically: a rebuilt library needs no new
    # extension unless the header (and so the cdef) changed.
    return [CDEF, Path(__file__).resolve(), default_include_dir() / "kvh" / "kvh.h"]


def up_to_date(target: Path) -> bool:
    if not target.exists():
        return False
    t = target.stat().st_mtime
    return all(not p.exists() or p.stat().st_mtime <= t for p in inputs())


def build_inplace(force: bool = False, quiet: bool = False) -> Path:
    """Compiles kvh_cache/_kvh_cffi*.so in the source tree against $KVH_BUILD_DIR."""
    lib_dir = build_dir()
    if not (lib_dir / "libkvh.so").exists():
        raise SystemExit(
            f"build_cffi: {lib_dir}/libkvh.so not found: build the C library first "
            "(cmake -S . -B build && cmake --build build) or set KVH_BUILD_DIR"
        )
    target = PACKAGE / extension_filename()
    if not force and up_to_date(target):
        if not quiet:
            print(f"build_cffi: {target} is up to date")
        return target
    tmp_root = lib_dir / "python-cffi"
    tmp_root.mkdir(parents=True, exist_ok=True)
    with open(tmp_root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time (parallel test runs)
        if not force and up_to_date(target):
            return target
        return _compile(target, lib_dir, tmp_root, quiet)


def _compile(target: Path, lib_dir: Path, tmp_root: Path, quiet: bool) -> Path:
    ffibuilder = make_ffibuilder(default_include_dir(), lib_dir, ["$ORIGIN", str(lib_dir)])
    with tempfile.TemporaryDirectory(dir=tmp_root) as tmp:
        built = Path(ffibuilder.compile(tmpdir=tmp, verbose=not quiet))
        # Atomic replace: a concurrent importer sees the old or the new file.
        staged = target.with_name(target.name + f".{os.getpid()}.tmp")
        shutil.copy2(built, staged)
        os.replace(staged, target)
    if not quiet:
        print(f"build_cffi: built {target} (libkvh from {lib_dir})")
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build kvh_cache._kvh_cffi in place for the development tree.")
    ap.add_argument("--force", action="store_true", help="rebuild even when up to date")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    build_inplace(force=args.force, quiet=args.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
