"""The demos' data directories: a kvh store removed for ``--fresh``, and
nothing else."""

from __future__ import annotations

import fcntl
import os
import re
import stat
import sys
from pathlib import Path
from typing import Optional


def empty_for_fresh(store: Path, prog: str) -> bool:
    """``--fresh``: removes the store at ``store`` if anything is there.
    False, after saying why on stderr, when it is not kvh's to remove."""
    if not (store.exists() or store.is_symlink()):
        return True
    problem = remove_store(store)
    if problem:
        print(f"{prog}: --fresh: {problem}", file=sys.stderr)
        return False
    return True


def remove_store(store: Path) -> Optional[str]:
    """Deletes a kvh store's own files (index, journal, LOCK, slab files)
    and then its directory, if that leaves it empty; anything else in it
    is the user's and stays, and so does the store. None when removed,
    else why not."""
    if store.is_symlink() or not store.is_dir():
        return f"{store} is not a directory; not removed"
    own = {"index", "journal", "LOCK"}
    names = [p.name for p in store.iterdir()]
    foreign = [n for n in names if n not in own and not re.fullmatch(r"slab-\d+\.kvh|(index|journal)\.tmp", n)]
    if foreign or "index" not in names:
        shown = ", ".join(sorted(foreign)[:3]) or "no index file"
        return f"{store} does not hold only a kvh store ({shown}); not removed"
    # Names prove nothing (a user's notes may be called `index`): kvh's
    # magic heads its index and journal, and a store has a LOCK or a slab.
    if not {"LOCK", "slab-0000.kvh"} & set(names):
        return f"{store} has no LOCK or slab-0000.kvh: not a kvh store; not removed"
    for n in ("index", "journal"):
        if n in names and not _starts_with_kvh_magic(store / n):
            return f"{store / n} was not written by kvh: not a kvh store; not removed"
    # An engine or reader holding the store locks its directory (and LOCK):
    # removing its files under it would lose what it persists from then on
    # and let a second engine lock a new LOCK beside it.
    try:
        dir_fd = os.open(store, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        return f"cannot open {store}: {exc.strerror}; not removed"
    try:
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return f"{store} is open in {_holder(store)}; not removed"
        for n in names:
            (store / n).unlink()
    finally:
        os.close(dir_fd)  # the lock goes with it
    store.rmdir()
    return None


def _holder(store: Path) -> str:
    """Who holds the store, as its LOCK file says (a reader writes no pid)."""
    try:
        pid = (store / "LOCK").read_text(errors="replace").strip()
    except OSError:
        pid = ""
    return f"process {pid}" if pid.isdigit() else "another engine or a reader such as kvh-store"


# The first bytes of a kvh index or journal file (core/disk_format.c).
_INDEX_MAGIC = b"KVHIDX\x00\x01"


def _starts_with_kvh_magic(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.pread(fd, len(_INDEX_MAGIC), 0) == _INDEX_MAGIC
    except OSError:
        return False
    finally:
        os.close(fd)
