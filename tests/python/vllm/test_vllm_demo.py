"""``kvh demo --engine vllm`` in its smallest form (--vllm-quick: two agents,
short prompts, no baseline; two vLLM processes): it runs, and its table
shows returning agents served from kvh, from disk after the restart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
VPY = os.environ.get("KVH_VLLM_PYTHON")
MODEL = os.environ.get("KVH_VLLM_MODEL")

pytestmark = pytest.mark.skipif(
    not (VPY and MODEL), reason="vLLM tests run under `make test-vllm` (KVH_VLLM_PYTHON, KVH_VLLM_MODEL)"
)


def test_quick_demo_serves_returning_agents_from_kvh():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "python") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "kvh_cache", "demo", "--engine", "vllm", "--vllm-quick", "--vllm-json"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    rows = {r["phase"]: r for r in json.loads(p.stdout)["rows"]}
    print(json.dumps(rows, indent=1))
    first, back, restart = (
        rows["kvh: agents' first visits"],
        rows["kvh: agents return"],
        rows["kvh: agents return after restart"],
    )
    assert first["requests"] == back["requests"] == restart["requests"] == 2
    # After the restart vLLM's own cache starts empty: the returning
    # agents' prefixes come from kvh's disk tier (only the shared system
    # prompt, loaded by the first of them, is then in vLLM's cache too).
    assert restart["from_kvh_disk"] > restart["from_vllm_cache"]
    assert back["from_kvh_memory"] + back["from_kvh_disk"] + back["from_vllm_cache"] > 0
    for r in rows.values():
        by_source = r["from_vllm_cache"] + r["from_kvh_memory"] + r["from_kvh_disk"] + r["recomputed"]
        assert by_source == r["prompt_tokens"], r
        assert r["ttft_ms"] > 0 and r["itl_ms"] > 0, r


def test_demo_help_names_the_engine_option():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "python") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    p = subprocess.run([sys.executable, "-m", "kvh_cache", "demo", "--help"], env=env, capture_output=True, text=True)
    assert p.returncode == 0 and "--engine" in p.stdout and "--vllm-quick" in p.stdout
