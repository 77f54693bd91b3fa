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


def test_a_match_vllm_does_not_load_is_let_go(tmp_path):
    # kvh retains the blocks a lookup found until they are loaded. A match
    # vLLM does not load (no room in that step, a load of zero tokens, a
    # preempted request asked again) must be let go in the next step, not
    # kept, unevictable, until the request ends; a later lookup's hold must
    # survive the release of an earlier one.
    run_flow(
        tmp_path,
        """
        import types

        bs = 32
        prompt = list(range(100, 100 + 2 * bs)) + [1]
        prefix = prompt[:-1]
        e = fake.Engine(root, block_size=bs)
        a = fake.Request("a", prompt)
        e.admit(a, [1, 2, 3])
        e.step({"a": a})
        e.finish(a)
        e.store.wait_saves()
        assert e.refs(prefix) == [0, 0]

        def idle_step(finished=()):
            e.start_step({})
            e.end_step(finished=finished)

        # Not scheduled in the step of its lookup (no room for its blocks).
        b = fake.Request("b", prompt)
        assert e.scheduler.get_num_new_matched_tokens(b, 0) == (2 * bs, False)
        assert e.refs(prefix) == [1, 1]
        idle_step()
        assert e.refs(prefix) == [0, 0], "not scheduled"

        # Scheduled with no external tokens (vLLM kept its own, shorter hit).
        c = fake.Request("c", prompt)
        assert e.scheduler.get_num_new_matched_tokens(c, 0) == (2 * bs, False)
        e.tables.table["c"] = [4, 5, 6]
        e.scheduler.update_state_after_alloc(c, fake.Blocks([4, 5, 6]), 0)
        e.step({"c": (c, 5)})
        assert e.refs(prefix) == [0, 0], "scheduled without the match"

        # Asked again before the worker ran the step that lets the first
        # lookup go: the second lookup's hold stays, and its load takes it.
        d = fake.Request("d", prompt)
        e.scheduler.get_num_new_matched_tokens(d, 0)
        meta = e.scheduler.build_connector_meta(types.SimpleNamespace(num_scheduled_tokens={}))
        assert [rid for rid, _ in meta.released_lookups] == ["d"], meta.released_lookups
        assert e.scheduler.get_num_new_matched_tokens(d, 0) == (2 * bs, False)
        e.worker.bind_connector_metadata(meta)
        e.worker.start_load_kv(None)
        e.end_step()
        assert e.refs(prefix) == [1, 1], "a later lookup's hold was let go"
        e.tables.table["d"] = [7, 8, 9]
        e.scheduler.update_state_after_alloc(d, fake.Blocks([7, 8, 9]), 2 * bs)
        d.num_computed_tokens = 2 * bs
        e.step({"d": d})
        assert e.wrong_positions(d, d.num_tokens) == []
        assert e.refs(prefix) == [0, 0], "the load's blocks"

        # Preempted after its load, then asked again and not scheduled.
        d.num_computed_tokens = 0
        assert e.scheduler.get_num_new_matched_tokens(d, 0) == (2 * bs, False)
        idle_step()
        assert e.refs(prefix) == [0, 0], "preempted, asked again"

        # Aborted while waiting: let go when the worker hears it ended.
        f = fake.Request("f", prompt)
        e.scheduler.get_num_new_matched_tokens(f, 0)
        e.scheduler.request_finished(f, [])
        idle_step(finished={"f"})
        assert e.refs(prefix) == [0, 0], "aborted"
        assert e.store.stats()["held_blocks"] == 0
        assert e.wrong_offloads == []
        e.close()
        """,
    )


def test_a_hold_on_saves_ends_only_when_the_failed_block_is_computed_again(tmp_path):
    # A load fails from block 2; vLLM truncates the request there, but it is
    # preempted before computing it again, and when it comes back vLLM's
    # prefix cache still holds its blocks from before, the stale ones
    # included (vLLM keeps them under the "recompute" policy). What it then
    # computes rests on the failed load: being admitted again with more
    # than block 2 kept must not end the hold on its saves, as a fall back
    # of its computed tokens that stops short of block 2 must not.
    run_flow(
        tmp_path,
        """
        bs = 32
        tokens = list(range(2000, 2000 + 8 * bs)) + [5]
        e = fake.Engine(root, block_size=bs)
        a = fake.Request("a", tokens[: 6 * bs] + [1])
        e.admit(a, [1, 2, 3, 4, 5, 6, 7])
        e.step({"a": a})
        e.finish(a)
        e.store.wait_saves()

        ids = list(range(10, 19))
        for layer in e.kv.values():
            layer[ids] = 3.0  # what the slots' previous owner left
        b = fake.Request("b", tokens)
        assert e.admit(b, ids) == 6 * bs
        e.fail_load("b", 2)
        meta, failed = e.step({"b": (b, bs)})  # a chunk: block 6, over the stale slots
        assert failed == set(ids[2:6]), failed
        b.num_computed_tokens = 2 * bs  # vLLM truncates b at the failed block
        b.num_computed_tokens = 0  # ... and preempts it before it runs again

        # Back, with vLLM's cached blocks 0-6 (2-6 stale) as its own hit.
        assert e.admit(b, ids, local_tokens=7 * bs) == 0
        e.step({"b": b})
        e.store.wait_saves()
        assert e.wrong_offloads == [], e.wrong_offloads
        e.close()
        """,
    )


def test_a_request_reading_a_failed_load_it_does_not_save_holds_its_saves(tmp_path):
    # x is handed b's blocks 0-1 by vLLM's prefix cache in the step that
    # loads them, loads its own blocks 2-3 and computes 4-5 over them all.
    # b's load fails: x's blocks 4-5 are computed over stale slots although
    # none of the blocks x saves is a failed one; vLLM sends x back to
    # what it held before the step and both compute again.
    run_flow(
        tmp_path,
        """
        bs = 32
        shared = list(range(7000, 7000 + 2 * bs))
        x_tokens = shared + list(range(5000, 5000 + 4 * bs)) + [43]
        e = fake.Engine(root, block_size=bs)
        a = fake.Request("a", x_tokens[: 4 * bs] + [1])
        e.admit(a, [1, 2, 3, 4, 5])
        e.step({"a": a})
        e.finish(a)
        e.store.wait_saves()

        for layer in e.kv.values():
            layer[:] = 3.0
        b = fake.Request("b", shared + list(range(9000, 9000 + 2 * bs)) + [42])
        x = fake.Request("x", x_tokens)
        assert e.admit(b, [10, 11, 12, 13, 14]) == 2 * bs
        assert e.admit(x, [10, 11, 15, 16, 17, 18, 19], local_tokens=2 * bs) == 2 * bs
        e.fail_load("b", 0)
        meta, failed = e.step({"b": b, "x": x})
        assert failed == {10, 11}, failed
        assert meta.reads_loads == {"x": [10, 11]}, meta.reads_loads
        assert any(t.req_id == "x" and t.first_block == 4 for t in meta.saves), meta.saves
        b.num_computed_tokens = 0
        x.num_computed_tokens = 4 * bs
        e.step({"b": b, "x": x})
        assert e.wrong_positions(x, x.num_tokens) == []
        e.finish(b)
        e.finish(x)
        e.store.wait_saves()
        assert e.wrong_offloads == [], e.wrong_offloads

        y = fake.Request("y", x_tokens)
        assert e.admit(y, [20, 21, 22, 23, 24, 25, 26]) == 6 * bs
        e.step({"y": y})
        wrong = e.wrong_positions(y, y.num_tokens)
        assert wrong == [], (len(wrong), wrong[:3])
        e.close()
        """,
    )


def test_the_forward_pass_waits_for_a_restored_tail_block_alone(tmp_path):
    # vLLM writes the last prompt token's row into the restored tail block
    # before it waits for that layer's load, so the tail block must be in
    # place before the forward pass starts; the prompt's other blocks need
    # only be there layer by layer. The tail block is restored as a batch
    # of its own, issued first, and it alone is waited for up front.
    run_flow(
        tmp_path,
        """
        bs = 32
        tokens = list(range(3000, 3000 + 6 * bs + 21))
        n = len(tokens) - 1
        e = fake.Engine(root, block_size=bs, extra=dict(tail_min_tokens=8))
        a = fake.Request("a", tokens)
        e.admit(a, list(range(1, 8)))
        e.step({"a": a})
        e.finish(a)
        e.store.wait_saves()

        pool, issued = e.store._pool, []
        restore = pool.restore

        def recorded_restore(blocks, slots, **kw):
            issued.append(list(slots))
            return restore(blocks, slots, **kw)

        pool.restore = recorded_restore
        b = fake.Request("b", tokens)
        ids = list(range(10, 17))
        assert e.admit(b, ids) == n
        e.start_step({"b": 1})
        assert issued[0] == [16] and sorted(s for part in issued[1:] for s in part) == ids[:-1], issued
        (load,) = e.worker._inflight
        assert load.batch.parts[-1].done()  # the tail block, before the first layer
        fresh = 99.0
        for name, layer in e.kv.items():
            layer[16, :, n % bs, :] = fresh
            e.worker.wait_for_layer_load(name)
        rows = [float(layer[16, 0, n % bs, 0]) for layer in e.kv.values()]
        assert e.end_step() == set()
        assert rows == [fresh] * fake.LAYERS, rows
        assert e.wrong_positions(b, n) == []
        e.close()
        """,
    )


def test_a_worker_that_times_out_is_not_asked_again_until_a_back_off_ends(tmp_path):
    # lookup_timeout_s bounds one lookup; a stuck worker must not cost it
    # to every request: once a lookup timed out, lookups are misses for a
    # while (said once in the log), then the worker is asked again.
    run_flow(
        tmp_path,
        """
        import logging
        import time

        class Records(logging.Handler):
            def __init__(self):
                super().__init__()
                self.messages = []

            def emit(self, record):
                self.messages.append(record.getMessage())

        records = Records()
        logging.getLogger("vllm.kvh").addHandler(records)
        bs = 32
        prompt = list(range(100, 100 + 2 * bs)) + [1]
        e = fake.Engine(root, block_size=bs, extra=dict(lookup_timeout_s=0.3))
        a = fake.Request("a", prompt)
        e.admit(a, [1, 2, 3])
        e.step({"a": a})
        e.finish(a)
        e.store.wait_saves()
        lookup = e.store.lookup
        e.store.lookup = lambda *args, **kw: (time.sleep(1.0), lookup(*args, **kw))[1]
        took = []
        for i in range(3):
            t0 = time.monotonic()
            assert e.scheduler.get_num_new_matched_tokens(fake.Request(f"slow{i}", prompt), 0) == (0, False)
            took.append(time.monotonic() - t0)
        assert took[0] < 0.6 and max(took[1:]) < 0.05, took
        assert sum("did not answer a lookup" in m for m in records.messages) == 1, records.messages
        time.sleep(1.0)  # the late lookup ends on the worker
        e.store.lookup = lookup
        e.scheduler._lookups_paused_until = 0.0  # the back-off is over
        assert e.scheduler.get_num_new_matched_tokens(fake.Request("b", prompt), 0) == (2 * bs, False)
        assert e.scheduler._lookup_backoff_s == fake.kvh_connector.LOOKUP_BACKOFF_S
        assert sum("did not answer a lookup" in m for m in records.messages) == 1
        e.start_step({})
        e.end_step()
        assert e.store.stats()["held_blocks"] == 0, "the late lookup's hold was let go"
        e.close()
        """,
    )


def test_a_request_id_used_again_keeps_its_state_when_the_old_request_ends(tmp_path):
    # Request ids come from clients. A request "b" ends and a new "b" is
    # admitted, loads and fails its load in the step that tells the worker
    # that the old one ended (get_finished, after the forward pass): the
    # new request's hold on saves computed over the failed load must
    # survive the old one's end, or a later step saves stale KV.
    run_flow(
        tmp_path,
        """
        bs = 32
        tokens = list(range(2000, 2000 + 8 * bs)) + [5]
        e = fake.Engine(root, block_size=bs)
        a = fake.Request("a", tokens[: 6 * bs] + [1])
        e.admit(a, [1, 2, 3, 4, 5, 6, 7])
        e.step({"a": a})
        e.finish(a)
        e.store.wait_saves()

        old = fake.Request("b", list(range(9000, 9000 + bs)) + [2])
        e.admit(old, [20, 21])
        e.step({"b": old})
        e.scheduler.request_finished(old, [20, 21])  # the worker hears of it with the next step

        ids = list(range(10, 19))
        for layer in e.kv.values():
            layer[ids] = 3.0  # what the slots' previous owner left
        b = fake.Request("b", tokens)
        assert e.admit(b, ids) == 6 * bs
        e.fail_load("b", 2)
        e.start_step({"b": bs})
        e.forward(b, b.num_computed_tokens, b.num_computed_tokens + bs)  # block 6, over the stale slots
        failed = e.end_step(finished={"b"})
        assert failed == set(ids[2:6]), failed
        b.num_computed_tokens = 0  # vLLM truncates b at the failed block, then preempts it

        # Back, with vLLM's cached blocks 0-6 (2-6 stale) as its own hit.
        assert e.admit(b, ids, local_tokens=7 * bs) == 0
        e.step({"b": b})
        e.store.wait_saves()
        assert e.wrong_offloads == [], e.wrong_offloads
        e.close()
        """,
    )


def test_a_request_id_used_again_after_one_that_made_no_lookup_keeps_its_hold(tmp_path):
    # The old "x" was shorter than a block and never looked up: its end
    # (told to the worker with the next step) must not let go of what the
    # new "x", looked up meanwhile, holds for its load.
    run_flow(
        tmp_path,
        """
        bs = 32
        prompt = list(range(100, 100 + 2 * bs)) + [1]
        e = fake.Engine(root, block_size=bs)
        a = fake.Request("a", prompt)
        e.admit(a, [1, 2, 3])
        e.step({"a": a})
        e.finish(a)
        e.store.wait_saves()

        old = fake.Request("x", [7, 8, 9])
        e.admit(old, [20])
        e.step({"x": old})
        e.scheduler.request_finished(old, [20])

        new = fake.Request("x", prompt)
        assert e.scheduler.get_num_new_matched_tokens(new, 0) == (2 * bs, False)
        assert e.store.stats()["held_blocks"] == 2
        seen = {}
        start_load = e.store.start_load
        def spy(req_id, *a, **kw):
            seen.setdefault("held_at_load", e.store.stats()["held_blocks"])
            return start_load(req_id, *a, **kw)
        e.store.start_load = spy
        e.tables.table["x"] = [4, 5, 6]
        e.scheduler.update_state_after_alloc(new, fake.Blocks([4, 5, 6]), 2 * bs)
        e.start_step({"x": 1})
        assert seen["held_at_load"] == 2, seen
        e.end_step()
        e.close()
        """,
    )
