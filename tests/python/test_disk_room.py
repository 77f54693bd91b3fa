"""A disk tier larger than the room its file system has: the slab files
are left sparse (with a warning) instead of taking the file system's last
free bytes, and the store still works. Run in a 64 MiB tmpfs mounted in a
mount namespace of its own (skipped where that cannot be done)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FS_BYTES = 64 << 20

SCRIPT = textwrap.dedent(
    """
    import json, logging, shutil, sys
    import numpy as np
    import kvh_cache as kvh

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    mnt, disk_bytes = sys.argv[1], int(sys.argv[2])
    before = shutil.disk_usage(mnt).free
    cfg = dict(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16, dtype="f16",
               device_bytes=1 << 20, host_bytes=1 << 20, disk_path=mnt + "/store", disk_bytes=disk_bytes)
    with kvh.Engine(**cfg) as eng:
        after_open = shutil.disk_usage(mnt).free
        with eng.sequence() as s:
            tokens = list(range(64))
            s.append(tokens)
            kv = np.random.default_rng(1).standard_normal((64, 2, 64)).astype(np.float16)
            for layer in range(2):
                s.write_kv(layer, 0, kv, kv)
            s.persist()
    with kvh.Engine(**cfg) as eng, eng.sequence() as s:
        matched = s.match_prefix(tokens)
        back = s.read_kv(1, 0, 64)[0]
    print(json.dumps({"before": before, "after_open": after_open, "matched": matched,
                      "intact": bool(np.array_equal(back, kv))}))
    """
)


def _run_in_small_fs(tmp_path: Path, disk_bytes: int) -> subprocess.CompletedProcess:
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("needs unshare and root to mount a small tmpfs in a mount namespace")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = tmp_path / "room.py"
    script.write_text(SCRIPT)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "python") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    shell = 'mount -t tmpfs -o size="$1" kvh-room "$2" || exit 97; shift 2; exec "$@"'
    res = subprocess.run(
        [unshare, "-m", "sh", "-c", shell, "sh", str(FS_BYTES), str(mnt), sys.executable, str(script)]
        + [str(mnt), str(disk_bytes)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    if res.returncode == 97 or "unshare failed" in res.stderr or "Operation not permitted" in res.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()[:200]}")
    return res


def test_a_store_larger_than_the_room_left_is_sparse_and_works(tmp_path):
    # 62 MiB of slabs in a 64 MiB file system: preallocated, they left it
    # 2 MiB (and a disk_bytes larger than the disk took all of it).
    res = _run_in_small_fs(tmp_path, 62 << 20)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["before"] - out["after_open"] < 8 << 20, out
    assert "slab files are sparse" in res.stderr, res.stderr
    assert out["matched"] == 64 and out["intact"], out


def test_a_store_that_fits_is_preallocated(tmp_path):
    res = _run_in_small_fs(tmp_path, 32 << 20)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["before"] - out["after_open"] >= 30 << 20, out
    assert "sparse" not in res.stderr, res.stderr
    assert out["matched"] == 64 and out["intact"], out
