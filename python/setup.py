"""Builds the kvh-cache wheel: libkvh from the C sources (CMake, the
repository's own build), the CFFI extension kvh_cache._kvh_cffi against it, and
everything in one package directory, so an installed kvh needs no
LD_LIBRARY_PATH:

    kvh_cache/_kvh_cffi.*.so   run path $ORIGIN (and nothing of the build machine)
    kvh_cache/libkvh.so.0      the C library
    kvh_cache/libkvh_cuda.so   the CUDA backend, when nvcc was found (loaded by
                         libkvh with dlopen from beside itself)
    kvh_cache/_bin/kvh-store, kvh_cache/_bin/kvh-bench   the C tools

The C sources are looked for in $KVH_SOURCE_DIR, then csrc/ beside this
file (where the sdist carries them: `python -m build --sdist python` copies
them in), then the repository around this directory. So both
`pip install ./python` in a checkout and `pip install kvh_cache-*.tar.gz`
anywhere work. The wheel this makes is tagged linux_x86_64 and links the
system's liburing and libnuma; `auditwheel repair` turns it into a
manylinux wheel that carries them (scripts/test-wheel.sh does).
Environment knobs:

    KVH_SOURCE_DIR   C source tree (default: csrc/, else the parent directory)
    KVH_LIB_DIR      use an already built libkvh from this directory (no CMake)
    KVH_WHEEL_CUDA   auto (default: built when nvcc is found) | 0 | 1
    KVH_CMAKE_ARGS   extra arguments for the CMake configure step
    KVH_BUILD_JOBS   parallel build jobs (default: CPU count)
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import build_cffi  # noqa: E402

ROOT = build_cffi.repo_root()
HEADER = ROOT / "abi" / "include" / "kvh" / "kvh.h"
TOOLS = ("kvh-store", "kvh-bench")


def header_version() -> str:
    if not HEADER.exists():
        raise SystemExit(
            f"kvh: {HEADER} not found. The wheel builds libkvh from the C sources: install the "
            "kvh-cache sdist (it carries them in csrc/), run `pip install ./python` from a checkout "
            "of the kvh repository, or set KVH_SOURCE_DIR to one."
        )
    text = HEADER.read_text()
    parts = [re.search(rf"#define KVH_VERSION_{p}\s+(\d+)", text) for p in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        raise SystemExit(f"kvh: no KVH_VERSION_* macros in {HEADER}")
    return ".".join(m.group(1) for m in parts)  # type: ignore[union-attr]


def run(cmd: list[str], **kw) -> None:
    print("+", " ".join(shlex.quote(c) for c in cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


class BuildExt(build_ext):
    """Builds libkvh with CMake first, then the CFFI extension linked to it."""

    def cmake_dir(self) -> Path:
        tag = f"{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
        return HERE / "build" / f"libkvh-{tag}"

    def build_libkvh(self) -> Path:
        prebuilt = os.environ.get("KVH_LIB_DIR")
        if prebuilt:
            lib_dir = Path(prebuilt).resolve()
            if not (lib_dir / "libkvh.so").exists():
                raise SystemExit(f"kvh: KVH_LIB_DIR={lib_dir} has no libkvh.so")
            return lib_dir
        cmake = shutil.which("cmake")
        if not cmake:
            raise SystemExit("kvh: building the wheel needs cmake (apt-get install cmake) and a C compiler")
        bdir = self.cmake_dir()
        cuda = os.environ.get("KVH_WHEEL_CUDA", "auto").lower()
        env = dict(os.environ)
        if (
            cuda != "0"
            and not shutil.which("nvcc")
            and "CUDACXX" not in env
            and Path("/usr/local/cuda/bin/nvcc").exists()
        ):
            env["CUDACXX"] = "/usr/local/cuda/bin/nvcc"
        args = [
            cmake,
            "-S",
            str(ROOT),
            "-B",
            str(bdir),
            "-DCMAKE_BUILD_TYPE=Release",
            "-DKVH_BUILD_TESTS=OFF",
            f"-DKVH_WITH_CUDA={'OFF' if cuda == '0' else 'ON'}",
        ]
        args += shlex.split(os.environ.get("KVH_CMAKE_ARGS", ""))
        run(args, env=env)
        jobs = os.environ.get("KVH_BUILD_JOBS") or str(os.cpu_count() or 2)
        run([cmake, "--build", str(bdir), "-j", jobs, "--target", "kvh"], env=env)
        cache = (bdir / "CMakeCache.txt").read_text(errors="replace")
        # Optional parts: the C tools and the CUDA backend, where this
        # checkout has them.
        optional = [t for t, d in zip(TOOLS, ("tools", "benchmarks")) if (ROOT / d / "CMakeLists.txt").exists()]
        m = re.search(r"^CMAKE_CUDA_COMPILER:\w+=(.*)$", cache, re.M)
        if cuda != "0" and m and m.group(1).strip() and not m.group(1).strip().endswith("NOTFOUND"):
            optional.append("kvh_cuda")
        for target in optional:
            try:
                run([cmake, "--build", str(bdir), "-j", jobs, "--target", target], env=env)
            except subprocess.CalledProcessError:
                if target == "kvh_cuda" and cuda == "1":
                    raise
                print(
                    f"kvh: warning: optional target {target} failed to build; the wheel goes without it",
                    file=sys.stderr,
                )
        if cuda == "1" and not self.find(bdir, "libkvh_cuda.so"):
            raise SystemExit("kvh: KVH_WHEEL_CUDA=1 but the CUDA backend was not built (no CUDA compiler?)")
        return bdir

    @staticmethod
    def find(bdir: Path, name: str) -> Path | None:
        direct = bdir / name
        if direct.exists():
            return direct
        for p in sorted(bdir.rglob(name)):
            if p.is_file() and "CMakeFiles" not in p.parts:
                return p
        return None

    def build_extensions(self) -> None:
        # Python's own LDSHARED may carry -Wl,-rpath,<its prefix> (pyenv and
        # other --enable-shared builds): a path of the build machine that
        # must not end up in the wheel. The extension's run path is $ORIGIN.
        self.compiler.linker_so = without_rpaths(self.compiler.linker_so)
        super().build_extensions()

    def run(self) -> None:
        lib_dir = self.build_libkvh()
        ffibuilder = build_cffi.make_ffibuilder(ROOT / "abi" / "include", lib_dir, ["$ORIGIN"])
        src = Path(self.build_temp) / "_kvh_cffi.c"
        src.parent.mkdir(parents=True, exist_ok=True)
        ffibuilder.emit_c_code(str(src))
        for ext in self.extensions:
            if ext.name == "kvh_cache._kvh_cffi":
                ext.sources = [str(src)]
                ext.include_dirs = [str(ROOT / "abi" / "include")]
                ext.library_dirs = [str(lib_dir)]
                ext.libraries = ["kvh"]
                ext.extra_link_args = ["-Wl,-rpath,$ORIGIN"]
        super().run()
        dest = Path(self.get_ext_fullpath("kvh_cache._kvh_cffi")).parent
        dest.mkdir(parents=True, exist_ok=True)
        lib = lib_dir / "libkvh.so.0"
        if not lib.exists():
            raise SystemExit(f"kvh: {lib} not found after the build")
        shutil.copyfile(lib.resolve(), dest / "libkvh.so.0")  # the file, not the symlink
        cuda = self.find(lib_dir, "libkvh_cuda.so")
        if cuda:
            shutil.copyfile(cuda.resolve(), dest / "libkvh_cuda.so")
        elif (dest / "libkvh_cuda.so").exists():
            (dest / "libkvh_cuda.so").unlink()
        for tool in TOOLS:
            exe = self.find(lib_dir, tool)
            if exe and os.access(exe, os.X_OK):
                (dest / "_bin").mkdir(exist_ok=True)
                shutil.copyfile(exe, dest / "_bin" / tool)
                os.chmod(dest / "_bin" / tool, 0o755)


def without_rpaths(args: list[str]) -> list[str]:
    """`args` less every run path option (-Wl,-rpath,X / -Wl,-R,X, and the
    -Wl,-rpath -Wl,X pair) that does not start with $ORIGIN."""
    out: list[str] = []
    skip_next = False
    for arg in args:
        if skip_next:
            skip_next = False
            continue
        if arg in ("-Wl,-rpath", "-Wl,-R"):
            skip_next = True
            continue
        if arg.startswith(("-Wl,-rpath,", "-Wl,-rpath=", "-Wl,-R,")):
            paths = [p for p in re.split(r"[,=:]", arg.split("-rpath", 1)[-1].split("-R", 1)[-1]) if p]
            kept = [p for p in paths if p.startswith("$ORIGIN")]
            if kept:
                out.append("-Wl,-rpath," + ":".join(kept))
            continue
        out.append(arg)
    return out


# The parts of the repository that building libkvh and its tools reads
# (CMakeLists.txt skips tests/, examples/ and fuzz/ when they are absent or
# switched off), and the licence files.
SDIST_C_TREES = ("cmake", "abi", "core", "kernels", "tools")
SDIST_C_FILES = ("CMakeLists.txt", "LICENSE", "LICENSE-MIT", "LICENSE-APACHE")
SDIST_SKIP_SUFFIXES = (".pyc", ".o", ".a", ".so")


class SdistWithCSources(sdist):
    """An sdist that builds from itself: the C sources go into csrc/."""

    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        if ROOT == HERE / "csrc":  # an sdist rebuilt from an sdist
            src_root = ROOT
        else:
            src_root = build_cffi.repo_root()
        dest = Path(base_dir) / "csrc"
        dest.mkdir(parents=True, exist_ok=True)
        for name in SDIST_C_FILES:
            shutil.copyfile(src_root / name, dest / name)
        for tree in SDIST_C_TREES:
            copy_sources(src_root / tree, dest / tree)
        bench = src_root / "benchmarks"
        if bench.is_dir():  # kvh-bench: its sources only, not the results or plots
            (dest / "benchmarks").mkdir(exist_ok=True)
            for f in sorted(bench.iterdir()):
                if f.is_file() and (f.suffix in (".c", ".h") or f.name == "CMakeLists.txt"):
                    shutil.copyfile(f, dest / "benchmarks" / f.name)
            # Its remote scenario starts a Redis server with the tests' helper
            # (benchmarks/CMakeLists.txt), the one part of tests/ it needs.
            (dest / "tests" / "c").mkdir(parents=True, exist_ok=True)
            for name in ("remote_test_util.c", "remote_test_util.h"):
                shutil.copyfile(src_root / "tests" / "c" / name, dest / "tests" / "c" / name)


def copy_sources(src: Path, dest: Path) -> None:
    for f in sorted(src.rglob("*")):
        if f.is_file() and f.suffix not in SDIST_SKIP_SUFFIXES and "__pycache__" not in f.parts:
            target = dest / f.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, target)


setup(
    version=header_version(),
    ext_modules=[Extension("kvh_cache._kvh_cffi", sources=[])],
    cmdclass={"build_ext": BuildExt, "sdist": SdistWithCSources},
)
