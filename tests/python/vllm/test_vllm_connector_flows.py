"""Flows through both sides of the connector, in the vLLM venv's python,
with vLLM's scheduler and forward pass faked (fake_vllm_engine.py) over a
real kvh store: what is saved after a failed load, steps whose offloads
list one vLLM slot twice, the prompt's tail block against vLLM's write of
the last prompt token, and the store's salt on the CPU backend. Skipped
unless KVH_VLLM_PYTHON names that python."""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
VPY = os.environ.get("KVH_VLLM_PYTHON")

pytestmark = pytest.mark.skipif(not VPY, reason="runs under `make test-vllm` (KVH_VLLM_PYTHON)")

PRELUDE = """
from pathlib import Path
import numpy as np
import fake_vllm_engine as fake
from store_damage import flip_first_block_byte
"""


def run_flow(tmp_path: Path, body: str) -> None:
    env = dict(os.environ)
    paths = [str(REPO / "python"), str(HERE), str(HERE.parent)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    code = PRELUDE + f"root = Path({str(tmp_path)!r})\n" + textwrap.dedent(body) + "\nprint('ok')\n"
    p = subprocess.run([VPY, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout[-3000:] + p.stderr[-3000:]


def test_kv_computed_over_a_failed_load_is_never_saved(tmp_path):
    # A request loads two blocks and computes two more in the same step
    # over them; the load fails (a damaged block on disk) and vLLM computes
    # the request again. Neither the blocks computed over the stale slots
    # nor those of a request sharing them through vLLM's prefix cache may
    # reach kvh, which keeps the first copy of a hash: a later request
    # with that prompt would load wrong KV without any error.
    run_flow(
        tmp_path,
        """
        bs = 32
        shared = list(range(7000, 7000 + 2 * bs))
        prompt = shared + list(range(9000, 9000 + 2 * bs)) + [42]
        other = shared + list(range(5000, 5000 + 2 * bs)) + [43]
        e = fake.Engine(root, block_size=bs, disk=True)
        a = fake.Request("a", shared + [1])
        e.admit(a, [1, 2, 3])
        e.step({"a": a})
        e.finish(a)
        e.store.flush()
        e.close()
        flip_first_block_byte(root)

        e = fake.Engine(root, block_size=bs, disk=True)
        for layer in e.kv.values():
            layer[:] = 3.0  # what the slots' previous owner left
        b, x = fake.Request("b", prompt), fake.Request("x", other)
        assert e.admit(b, [10, 11, 12, 13, 14]) == 2 * bs
        # vLLM's prefix cache gives x b's blocks, being loaded in this step
        e.tables.table["x"] = [10, 11, 15, 16, 17]
        e.scheduler.update_state_after_alloc(x, fake.Blocks([10, 11, 15, 16, 17]), 0)
        x.num_computed_tokens = 2 * bs
        meta, failed = e.step({"b": b, "x": x})
        assert failed == {10, 11}, failed
        assert any(t.req_id == "b" and t.first_block == 2 for t in meta.saves), meta.saves
        # vLLM truncates b at its first failed block; x, sharing it, falls
        # back to what it had computed before the step; both run again.
        b.num_computed_tokens = 0
        x.num_computed_tokens = 2 * bs
        e.step({"b": b, "x": x})
        assert e.wrong_positions(b, b.num_tokens) == []
        assert e.wrong_positions(x, x.num_tokens) == []
        e.finish(b)
        e.finish(x)
        e.store.wait_saves()

        for rid, tokens, ids in (("c", prompt, [20, 21, 22, 23, 24]), ("y", other, [25, 26, 27, 28, 29])):
            r = fake.Request(rid, tokens)
            assert e.admit(r, ids) == 4 * bs, rid
            e.step({rid: r})
            wrong = e.wrong_positions(r, r.num_tokens)
            assert wrong == [], (rid, len(wrong), wrong[:3])
        e.close()
        """,
    )


def test_a_prompt_ending_on_a_block_boundary_saves_its_step(tmp_path):
    # 4 full blocks: its last full block and its tail block are one vLLM
    # slot, saved in the same step as another request's blocks.
    run_flow(
        tmp_path,
        """
        bs = 32
        e = fake.Engine(root, block_size=bs, extra=dict(tail_min_tokens=8))
        a = fake.Request("a", range(100, 100 + 4 * bs))
        o = fake.Request("o", range(50000, 50000 + 2 * bs + 1))
        e.admit(a, [1, 2, 3, 4])
        e.admit(o, [5, 6, 7])
        meta, _ = e.step({"a": a, "o": o})
        assert sorted((t.req_id, t.first_block) for t in meta.saves) == [("a", 0), ("a", 3), ("o", 0)], meta.saves
        e.store.wait_saves()
        s = e.store.stats()
        assert s["save_errors"] == 0 and s["blocks_saved"] == 4 + 1 + 2, s
        assert e.store.lookup("qa", np.asarray(a.all_token_ids[:-1], dtype=np.int32)) == 4 * bs - 1
        assert e.store.lookup("qo", np.asarray(o.all_token_ids[:-1], dtype=np.int32)) == 2 * bs
        e.close()
        """,
    )


def test_requests_sharing_a_prefix_in_one_step_save_it(tmp_path):
    # vLLM's prefix cache gives the second request the first one's blocks
    # in the same schedule(): both save them from block 0 in one step.
    run_flow(
        tmp_path,
        """
        bs = 32
        e = fake.Engine(root, block_size=bs)
        shared = list(range(100, 100 + 2 * bs))
        y, x = fake.Request("y", shared + [1] * 10), fake.Request("x", shared + [2] * 10)
        e.admit(y, [1, 2, 3])
        e.admit(x, [1, 2, 4], local_tokens=2 * bs)
        meta, _ = e.step({"y": y, "x": x})
        assert [(t.req_id, t.block_ids) for t in meta.saves] == [("y", [1, 2]), ("x", [1, 2])], meta.saves
        e.store.wait_saves()
        s = e.store.stats()
        assert s["save_errors"] == 0 and s["blocks_saved"] == 2, s
        assert e.store.lookup("q", np.asarray(shared, dtype=np.int32)) == 2 * bs
        e.close()
        """,
    )


def test_tail_block_is_saved_once_the_last_prompt_token_is_computed(tmp_path):
    # Chunked prefill whose first chunk ends just before the last prompt
    # token: the tail block is saved with that token's row, in the next
    # step, so a restore writes back the row vLLM computes.
    run_flow(
        tmp_path,
        """
        bs = 32
        tokens = list(range(3000, 3000 + 2 * bs + 21))
        n = len(tokens) - 1  # loadable: 2 full blocks and a tail of 20
        e = fake.Engine(root, block_size=bs, extra=dict(tail_min_tokens=8))
        for layer in e.kv.values():
            layer[3] = -7.0  # what the slot's previous owner left
        a = fake.Request("a", tokens)
        e.admit(a, [1, 2, 3])
        meta, _ = e.step({"a": (a, n)})
        assert [t.first_block for t in meta.saves] == [0], meta.saves
        meta, _ = e.step({"a": (a, 1)})
        assert [(t.first_block, len(t.tokens)) for t in meta.saves] == [(2, n)], meta.saves
        e.finish(a)
        e.store.wait_saves()

        b = fake.Request("b", tokens)
        assert e.admit(b, [10, 11, 12]) == n
        e.start_step({"b": 1})
        for name in e.kv:
            e.worker.wait_for_layer_load(name)
        e.end_step()
        want = [layer[n] for layer in fake.expected_kv(tokens, n + 1)]
        assert [float(layer[12, 0, n % bs, 0]) for layer in e.kv.values()] == want
        e.close()
        """,
    )


def test_tail_block_is_restored_before_the_forward_pass_writes_into_it(tmp_path):
    # vLLM's CPU backend writes a layer's new KV (here the last prompt
    # token's row, in the restored tail block) before its attention waits
    # for that layer's load: the restore must not land on top of it.
    run_flow(
        tmp_path,
        """
        bs = 32
        tokens = list(range(3000, 3000 + 2 * bs + 21))
        n = len(tokens) - 1
        e = fake.Engine(root, block_size=bs, extra=dict(tail_min_tokens=8), disk=True)
        a = fake.Request("a", tokens)
        e.admit(a, [1, 2, 3])
        e.step({"a": a})
        e.finish(a)
        e.store.flush()
        e.close()

        fresh = 99.0  # unlike what was saved: the forward pass's own row
        for trial in range(3):
            e = fake.Engine(root, block_size=bs, extra=dict(tail_min_tokens=8), disk=True)
            b = fake.Request(f"b{trial}", tokens)
            assert e.admit(b, [10, 11, 12]) == n
            e.start_step({b.request_id: 1})
            for name, layer in e.kv.items():
                layer[12, :, n % bs, :] = fresh
                e.worker.wait_for_layer_load(name)
            rows = [float(layer[12, 0, n % bs, 0]) for layer in e.kv.values()]
            assert e.end_step() == set()
            assert rows == [fresh] * fake.LAYERS, (trial, rows)
            e.close()
        """,
    )


def test_store_salt_follows_the_cpu_attention_kernel(tmp_path):
    # vLLM's CPU attention packs a block's bytes per kernel family (AMX
    # tiles, vector rows, ...): a store written under one must never be
    # read under another (a disk store or remote tier shared by hosts).
    run_flow(
        tmp_path,
        """
        import torch
        from vllm.v1.attention.backends import cpu_attn

        bs = 32
        e = fake.Engine(root, block_size=bs)
        native = e.store.salt
        e.close()
        real = cpu_attn._get_attn_isa
        salts = {}
        for isa in ("amx", "vec", "neon"):
            cpu_attn._get_attn_isa = lambda *args, isa=isa: isa
            e = fake.Engine(root, block_size=bs)
            salts[isa] = e.store.salt
            e.close()
        cpu_attn._get_attn_isa = real
        assert len(set(salts.values())) == 3, salts
        assert native == salts[real(torch.bfloat16, bs, fake.HEAD_DIM, "auto")]
        """,
    )
