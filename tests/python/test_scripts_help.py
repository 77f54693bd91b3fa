"""Every script of the repository answers --help with its usage and does
nothing else: no install, build or benchmark starts, and no package beyond
the standard library and NumPy is needed to read it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PATTERNS = [
    "scripts/*.sh",
    "scripts/*.py",
    "benchmarks/*.sh",
    "benchmarks/*.py",
    "benchmarks/gpu/*.sh",
    "bindings/*.sh",
    "bindings/*.py",
    ".ci/run",
]
SCRIPTS = sorted({p.relative_to(REPO).as_posix() for pattern in PATTERNS for p in REPO.glob(pattern)})


def test_every_kind_of_script_is_found():
    assert {"scripts/install-deps.sh", "benchmarks/gpu/run.sh", ".ci/run", "scripts/wheel-smoke.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_prints_usage_and_starts_nothing(script, tmp_path):
    path = REPO / script
    interpreter = [sys.executable] if path.suffix == ".py" else ["bash"]
    # No kvh package on the path, and a scratch directory as the current
    # one: what a script would build or write lands there, and is seen.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "KVH_"))}
    env.update(OUT=str(tmp_path / "out"), BUILD=str(tmp_path / "build"))
    start = time.monotonic()
    res = subprocess.run(
        [*interpreter, str(path), "--help"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    elapsed = time.monotonic() - start
    assert res.returncode == 0, (script, res.stderr[-2000:])
    first = next((line.strip() for line in res.stdout.splitlines() if line.strip()), "")
    # The usage is the script's own text (its header), or argparse's.
    # (its header: the comment lines it starts with, or a Python module's
    # docstring; a script that ran its job instead printed a line from its
    # body, as bindings/check-drift.sh did)
    text = path.read_text()
    lines = text.splitlines()
    header = "\n".join(line for line in lines[:60] if line.startswith("#"))
    if path.suffix == ".py":
        header += text[: text.find('"""', text.find('"""') + 3) + 3] if '"""' in text else ""
    assert first.startswith("usage:") or first in header, (script, res.stdout[:500])
    assert elapsed < 20, (script, elapsed)
    assert list(tmp_path.iterdir()) == [], (script, sorted(p.name for p in tmp_path.iterdir()))
