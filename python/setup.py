"""Builds the kvh wheel: libkvh from the C sources (CMake, the repository's
own build), the CFFI extension kvh._kvh_cffi against it, and everything in
one package directory, so an installed kvh needs no LD_LIBRARY_PATH:

    kvh/_kvh_cffi.*.so   run path $ORIGIN
    kvh/libkvh.so.0      the C library
    kvh/libkvh_cuda.so   the CUDA backend, when nvcc was found (loaded by
                         libkvh with dlopen from beside itself)
    kvh/_bin/kvh-store, kvh/_bin/kvh-bench   the C tools (statically linked)

Run from the kvh repository: `pip install ./python` or
`python -m build --wheel python`. Environment knobs:

    KVH_SOURCE_DIR   repository root (default: the parent of this directory)
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import build_cffi  # noqa: E402

ROOT = build_cffi.repo_root()
HEADER = ROOT / "abi" / "include" / "kvh" / "kvh.h"
TOOLS = ("kvh-store", "kvh-bench")


def header_version() -> str:
    if not HEADER.exists():
        raise SystemExit(
            f"kvh: {HEADER} not found. The wheel builds libkvh from the C sources of the kvh "
            "repository: run `pip install ./python` from a checkout (or set KVH_SOURCE_DIR)."
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

    def run(self) -> None:
        lib_dir = self.build_libkvh()
        ffibuilder = build_cffi.make_ffibuilder(ROOT / "abi" / "include", lib_dir, ["$ORIGIN"])
        src = Path(self.build_temp) / "_kvh_cffi.c"
        src.parent.mkdir(parents=True, exist_ok=True)
        ffibuilder.emit_c_code(str(src))
        for ext in self.extensions:
            if ext.name == "kvh._kvh_cffi":
                ext.sources = [str(src)]
                ext.include_dirs = [str(ROOT / "abi" / "include")]
                ext.library_dirs = [str(lib_dir)]
                ext.libraries = ["kvh"]
                ext.extra_link_args = ["-Wl,-rpath,$ORIGIN"]
        super().run()
        dest = Path(self.get_ext_fullpath("kvh._kvh_cffi")).parent
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


setup(
    version=header_version(),
    ext_modules=[Extension("kvh._kvh_cffi", sources=[])],
    cmdclass={"build_ext": BuildExt},
)
