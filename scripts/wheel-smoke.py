#!/usr/bin/env python3
"""Smoke test of an installed kvh-cache, run by scripts/test-wheel.sh with
the Python of a fresh venv, from a directory outside the repository:

    python wheel-smoke.py DIR           engine, persist, reopen in a new
                                        process, the CLI's --help, kvh-store
    python wheel-smoke.py DIR --reopen  (the second process)

Exits non-zero with a message on the first failure.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

GEOMETRY = dict(num_layers=2, num_kv_heads=2, head_dim=16, dtype="f32", block_tokens=16)
TOKENS = list(range(1000, 1048))  # three full blocks


def fail(msg: str) -> None:
    sys.exit(f"wheel-smoke: {msg}")


def engine(store: Path):
    import kvh_cache as kvh

    return kvh.Engine(device_bytes=1 << 20, host_bytes=1 << 20, disk_path=str(store), disk_bytes=4 << 20, **GEOMETRY)


def write_and_persist(store: Path) -> None:
    import numpy as np

    with engine(store) as eng, eng.sequence() as seq:
        seq.append(np.array(TOKENS))
        for layer in range(GEOMETRY["num_layers"]):
            kv = np.full((len(TOKENS), 2, 16), layer + 1, np.float32)
            seq.write_kv(layer, 0, kv, -kv)
        seq.persist()


def reopen(store: Path) -> None:
    import numpy as np

    with engine(store) as eng, eng.sequence() as seq:
        matched = seq.match_prefix(np.array(TOKENS))
        if matched != len(TOKENS):
            fail(f"the reopened store matched {matched} of {len(TOKENS)} tokens")
        k, v = seq.read_kv(1)
        if not (np.all(k == 2) and np.all(v == -2)):
            fail("the reopened store returned other values than were written")


def where_is_kvh() -> Path:
    import kvh_cache as kvh

    path = Path(kvh.__file__).resolve().parent
    repo = os.environ.get("KVH_REPO")
    if repo and Path(repo).resolve() in path.parents:
        fail(f"kvh was imported from the repository ({path}), not from the installed package")
    return path


def run(cmd: list[str]) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        fail(f"{' '.join(cmd)} exited with {res.returncode}:\n{res.stdout}{res.stderr}")
    return res.stdout


def subcommands(parser: argparse.ArgumentParser, prefix: tuple = ()) -> Iterator[list[str]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):  # argparse has no public walk
            for name, sub in action.choices.items():
                yield [*prefix, name]
                yield from subcommands(sub, (*prefix, name))


def check_cli(store: Path) -> None:
    from kvh_cache.cli import build_parser

    exe = shutil.which("kvh", path=str(Path(sys.executable).parent))
    if not exe:
        fail("the kvh command was not installed beside this Python")
    run([exe, "--help"])
    commands = list(subcommands(build_parser()))
    if len(commands) < 5:
        fail(f"only {len(commands)} subcommands found: {commands}")
    for cmd in commands:
        out = run([exe, *cmd, "--help"])
        if "usage:" not in out:
            fail(f"kvh {' '.join(cmd)} --help printed no usage")
    info = run([exe, "store", "info", str(store), "--json"])  # the bundled kvh-store
    if '"blocks"' not in info and "blocks" not in info:
        fail(f"kvh store info printed no block count: {info[:200]}")
    print(f"wheel-smoke: kvh --help and {len(commands)} subcommands' --help ok")


def main() -> None:
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return
    if len(sys.argv) < 2:
        fail("usage: wheel-smoke.py DIR [--reopen]")
    store = Path(sys.argv[1]) / "store"
    if sys.argv[2:] == ["--reopen"]:
        reopen(store)
        return
    where = where_is_kvh()
    write_and_persist(store)
    subprocess.run([sys.executable, __file__, sys.argv[1], "--reopen"], check=True)
    print(f"wheel-smoke: kvh at {where}: engine, persist, reopen in a new process ok")
    check_cli(store)


if __name__ == "__main__":
    main()
