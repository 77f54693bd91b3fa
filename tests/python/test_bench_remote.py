"""kvh_cache.demo.bench_remote: node B's time to first token through the
remote tier, run end to end with a tiny random model and a Redis server on
loopback (structure and correctness only, never timings)."""

from __future__ import annotations

import json
import shutil

import pytest

from kvh_cache.demo import bench_remote
from kvh_cache.model.testing import write_tiny_llama

needs_redis = pytest.mark.skipif(
    not shutil.which("redis-server") or not shutil.which("redis-cli"),
    reason="redis-server is not installed (scripts/install-deps.sh)",
)


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as e:
        bench_remote.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--tokens", "--reps", "--quick", "--json"):
        assert flag in out


def test_bad_arguments():
    assert bench_remote.main(["--reps", "0"]) == 2


@needs_redis
def test_node_b_reuses_node_a_prefix(tmp_path, capsys):
    model = write_tiny_llama(str(tmp_path / "tiny.Q4_1.gguf"), qtype="Q4_1", seed=5)
    rc = bench_remote.main(["--json", "--model", model, "--tokens", "64", "--reps", "2", "--tmp-dir", str(tmp_path)])
    assert rc == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(rows) == 1
    row = rows[0]
    assert {"scenario", "metric", "value", "unit", "baseline", "ratio"} <= set(row)
    # Every full block came from the store; only the last token was recomputed.
    assert row["prefix_tokens"] == 64 and row["reused_tokens"] == 63
    assert len(row["remote_ms"]) == 2 and len(row["recompute_ms"]) == 2
    assert row["value"] > 0 and row["baseline"] > 0
