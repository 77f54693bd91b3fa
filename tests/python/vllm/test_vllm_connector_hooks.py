"""The connector's hooks one by one, in the vLLM venv's python (the module
imports vllm and torch), on a connector object built without vLLM around
it: offloads are waited for before a step touches any block, a runtime
directory that cannot be used is a miss for the scheduler, requests
whose KV does not follow from their token ids alone are neither looked
up nor saved, blocks recomputed after a failed load are saved again, and
a load that failed on one tensor-parallel rank holds back every rank's
saves computed over it. Skipped unless KVH_VLLM_PYTHON names that
python."""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
VPY = os.environ.get("KVH_VLLM_PYTHON")

pytestmark = pytest.mark.skipif(not VPY, reason="runs under `make test-vllm` (KVH_VLLM_PYTHON)")

PRELUDE = """
import types
import numpy as np
from kvh_cache.vllm import connector as c

def bare(**attrs):
    # A connector without vLLM around it: only what the hook reads.
    k = object.__new__(c.KvhConnector)
    for name, value in attrs.items():
        setattr(k, name, value)
    return k
"""


def run_in_vllm(body: str) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "python") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    code = PRELUDE + textwrap.dedent(body) + "\nprint('ok')\n"
    p = subprocess.run([VPY, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout[-3000:] + p.stderr[-3000:]


def test_offloads_are_waited_for_before_the_step_touches_blocks():
    # vLLM calls handle_preemptions before it zeroes, copies or reassigns
    # blocks, and start_load_kv only after the forward pass when the step
    # has no synchronous load: the wait must be in the first.
    run_in_vllm(
        """
        class Store:
            waits = 0
            def wait_saves(self):
                Store.waits += 1
        k = bare(_store=Store())
        k.handle_preemptions(c.KvhMetadata())
        assert Store.waits == 1, Store.waits
        bare(_store=None).handle_preemptions(c.KvhMetadata())
        """
    )


def test_unusable_runtime_directory_is_a_miss(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    run_in_vllm(
        f"""
        settings = types.SimpleNamespace(runtime_dir={str(not_a_dir)!r}, lookup_timeout_s=1.0)
        k = bare(
            _clients=None,
            _engine_id="e",
            _dp_rank=0,
            _tp_size=1,
            _settings=settings,
            _channel_warned=False,
            _lookups_paused_until=0.0,
        )
        assert k._lookup("r1", np.arange(64, dtype=np.int32), 0, 1) == (0, False)
        assert k._lookup("r2", np.arange(64, dtype=np.int32), 0, 2) == (0, False)
        assert k._channel_warned
        """
    )


def test_a_worker_answers_only_its_own_instances_lookups():
    # A second vLLM instance given the same engine_id found the first
    # one's socket (its own worker refused to start): the first worker
    # answered its lookups with hits, and the second decoded 256 tokens
    # of KV that nothing had loaded.
    run_in_vllm(
        """
        import os
        class Store:
            asked = 0
            def lookup(self, req, tokens, scope, lookup_id):
                Store.asked += 1
                return 64
        w = bare(_store=Store(), _instance="1111")
        tokens = np.arange(64, dtype=np.int32).tobytes()
        other = {"op": "lookup", "req": "r", "lookup": 1, "instance": "2222", "pid": 1}
        assert w._handle(other, tokens) == {"tokens": 0, "foreign": True}
        assert Store.asked == 0
        assert w._handle(dict(other, instance="1111"), tokens) == {"tokens": 64}
        assert w._handle(dict(other, pid=os.getppid()), tokens) == {"tokens": 64}
        assert w._handle(dict(other, pid=os.getpid()), tokens) == {"tokens": 64}
        assert Store.asked == 3

        class Foreign:
            def call(self, header, payload):
                assert header["instance"] == "3333" and header["pid"] == os.getpid()
                return {"tokens": 0, "foreign": True}
        k = bare(_clients=[Foreign()], _engine_id="e", _instance="3333", _channel_warned=False,
                 _lookups_paused_until=0.0, _lookup_backoff_s=0.1)
        assert k._lookup("r1", np.arange(64, dtype=np.int32), 0, 1) == (0, False)
        assert k._channel_warned

        class Own:
            def call(self, header, payload):
                return {"tokens": 64}
        # One rank is another instance's, one this instance's: that one
        # holds blocks for the lookup, to be let go of.
        k = bare(_clients=[Foreign(), Own()], _engine_id="e", _instance="3333", _channel_warned=True,
                 _lookups_paused_until=0.0, _lookup_backoff_s=0.1)
        assert k._lookup("r2", np.arange(64, dtype=np.int32), 0, 2) == (0, True)
        """
    )


def test_requests_not_keyed_by_their_tokens_are_not_cached():
    run_in_vllm(
        """
        plain = types.SimpleNamespace(lora_request=None, mm_features=[], prompt_embeds=None)
        assert c._keyed_by_tokens(plain)
        for other in (
            dict(lora_request=object()),
            dict(mm_features=[object()]),
            dict(prompt_embeds=np.zeros((4, 8))),
        ):
            r = types.SimpleNamespace(**dict(vars(plain), **other))
            assert not c._keyed_by_tokens(r), other
            k = bare(_disabled=False)
            assert k.get_num_new_matched_tokens(r, 0) == (0, False)
        """
    )


def test_store_identity_follows_the_configuration():
    # Two configurations vLLM hashes apart (e.g. quantization, RoPE
    # scaling) or two data-parallel ranks never share a store's salt.
    run_in_vllm(
        """
        def mc(h):
            return types.SimpleNamespace(model="m", revision=None, compute_hash=lambda: h)
        base = c._store_identity(mc("a"), "torch.bfloat16", "auto", 0, 1, 0)
        assert base == c._store_identity(mc("a"), "torch.bfloat16", "auto", 0, 1, 0)
        assert base != c._store_identity(mc("b"), "torch.bfloat16", "auto", 0, 1, 0)
        assert base != c._store_identity(mc("a"), "torch.bfloat16", "auto", 0, 1, 1)
        """
    )


def test_blocks_recomputed_after_a_failed_load_are_saved_again():
    # vLLM truncates a request's computed tokens at the first block whose
    # load failed and computes the rest again: kvh no longer holds those
    # blocks (or holds them corrupt), so the recomputed ones are saved.
    run_in_vllm(
        """
        bs = 4
        r = types.SimpleNamespace(
            request_id="r", num_computed_tokens=0, all_token_ids=list(range(40)), num_prompt_tokens=40,
            lora_request=None, mm_features=[], prompt_embeds=None, cache_salt=None,
        )
        manager = types.SimpleNamespace(get_block_ids=lambda req_id: [list(range(100, 110))])
        settings = types.SimpleNamespace(tail_min_tokens=0)
        k = bare(
            _loads=[], _admitted=[], _unused_lookups={}, _released_lookups=[], _finished={}, _disabled=False,
            _block_size=bs, _reqs={}, _kv_cache_manager=manager, _settings=settings,
        )
        k._reqs["r"] = c._SchedReq(r, saved_blocks=8)  # a load of blocks 0-7 was issued
        r.num_computed_tokens = 32
        meta = k.build_connector_meta(types.SimpleNamespace(num_scheduled_tokens={"r": 8}))
        assert [(t.first_block, t.block_ids) for t in meta.saves] == [(8, [108, 109])]
        r.num_computed_tokens = 3 * bs  # the load failed at block 3: 3-9 are computed again
        meta = k.build_connector_meta(types.SimpleNamespace(num_scheduled_tokens={"r": 28}))
        assert [(t.first_block, t.block_ids) for t in meta.saves] == [(3, list(range(103, 110)))]
        r.num_computed_tokens = 40
        meta = k.build_connector_meta(types.SimpleNamespace(num_scheduled_tokens={"r": 1}))
        assert meta.saves == []
        """
    )


def test_a_fall_back_short_of_the_failed_block_keeps_the_hold():
    # After a failed load the worker holds back a request's saves from its
    # first failed block on. Its computed tokens falling back (rejected
    # draft tokens) to a point past that block is no recompute of it: the
    # hold ends only when the request computes again from that block.
    run_in_vllm(
        """
        bs = 4
        tokens = np.arange(64, dtype=np.int32)

        def sound(first, n, **recomputing):
            saves = [c.Transfer("r", tokens, first, list(range(100 + first, 100 + first + n)))]
            meta = c.KvhMetadata(saves=saves, recomputing=recomputing)
            return [(t.first_block, t.block_ids) for t in k._sound_saves(meta)]

        k = bare(_block_size=bs, _failed_loads=[("r", 2, [102, 103])], _unsound_from={})
        assert sound(0, 5) == [(0, [100, 101])]  # the step whose load failed
        assert sound(4, 1, r=4 * bs + 1) == []  # fell back, past block 2
        assert sound(2, 3, r=2 * bs) == [(2, [102, 103, 104])]  # computed again from block 2
        """
    )


def test_a_load_failed_on_another_rank_holds_this_ranks_saves():
    # Tensor parallelism: every rank restores its own heads, and every
    # layer's output is summed over the ranks, so KV this rank computed
    # over another rank's failed load is unsound here too. The step's
    # failures are merged (the first failed block of each load) before
    # any rank decides what it saves.
    run_in_vllm(
        """
        bs = 4
        tokens = np.arange(64, dtype=np.int32)
        T = c.Transfer
        none = c._NO_FAILURE

        def step():
            return c.KvhMetadata(
                loads=[T("r", tokens, 0, [100, 101, 102, 103]), T("q", tokens, 0, [200, 201])],
                saves=[T("r", tokens, 4, [104, 105]), T("q", tokens, 2, [202]), T("s", tokens, 1, [301])],
                recomputing={"s": bs},
                reads_loads={"s": [100, 101, 102]},  # s's prompt shares r's loaded blocks
            )

        sent = []

        def other_rank_failed_r_at_block_2(values):
            sent.append(list(values))
            return [min(v, o) for v, o in zip(values, [2, none])]

        def rank(**attrs):
            base = dict(
                _block_size=bs, _failed_loads=[], _unsound_from={}, _tp_size=2, _store=object(),
                _ranks_unreachable=False,
            )
            base.update(attrs)
            return bare(**base)

        def saved(k):
            meta = step()
            k._share_failed_loads(meta)
            return [(t.req_id, t.first_block, t.block_ids) for t in k._sound_saves(meta)]

        everything = [("r", 4, [104, 105]), ("q", 2, [202]), ("s", 1, [301])]
        # Alone (one rank), or with no rank failing, every save goes.
        assert saved(rank(_tp_size=1, _ranks_min=other_rank_failed_r_at_block_2)) == everything
        assert sent == []
        assert saved(rank(_ranks_min=lambda values: values)) == everything
        # r computed over its failed block 2, s attended to it: only q saves.
        k = rank(_ranks_min=other_rank_failed_r_at_block_2)
        assert saved(k) == [("q", 2, [202])]
        assert sent == [[none, none]]
        assert k._unsound_from == {"r": 2 * bs, "s": bs}
        # This rank's own earlier failure stands.
        sent.clear()
        k = rank(_ranks_min=other_rank_failed_r_at_block_2, _failed_loads=[("r", 1, [101])])
        assert saved(k) == [("q", 2, [202])]
        assert sent == [[1, none]] and k._unsound_from["r"] == bs
        # A rank without a store restored nothing, and says so.
        sent.clear()
        k = rank(_ranks_min=other_rank_failed_r_at_block_2, _store=None)
        k._share_failed_loads(step())
        assert sent == [[0, 0]]
        # The ranks cannot be asked: the step's saves over its loads are held.
        def unreachable(values):
            raise RuntimeError("no process group")

        k = rank(_ranks_min=unreachable)
        assert saved(k) == []
        # Such a group fails every later collective: it is asked no more.
        k._ranks_min = other_rank_failed_r_at_block_2
        sent.clear()
        assert saved(k) == []
        assert sent == []

        # A step that raised: vLLM calls wait_for_save from a `finally`.
        # Neither the exchange (the other ranks may be inside the forward
        # pass's collectives) nor the saves run.
        import contextlib

        class Store:
            saved = []

            def save_async(self, items):
                self.saved.extend(items)

        meta = step()
        k = rank(_ranks_min=other_rank_failed_r_at_block_2, _store=Store(), _inflight=[])
        k.has_connector_metadata = lambda: True
        k._get_connector_metadata = lambda: meta
        sent.clear()

        @contextlib.contextmanager
        def forward_step():
            try:
                yield
            finally:
                k.wait_for_save()

        try:
            with forward_step():
                raise RuntimeError("the forward pass failed")
        except RuntimeError:
            pass
        assert sent == [] and Store.saved == []
        with forward_step():
            pass
        assert sent == [[none, none]] and [item[0] for item in Store.saved] == ["q"]
        """
    )


def test_ranks_share_their_failed_loads_through_a_process_group():
    # The collective itself, over a real two-process gloo group on
    # loopback: each rank gets the element-wise minimum of both.
    run_in_vllm(
        """
        import multiprocessing as mp
        import socket

        import torch.distributed as dist

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        none = c._NO_FAILURE
        mine = {0: [5, none, 7, none], 1: [9, 3, none, none]}

        def rank(r, out):
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2)
            out.put((r, c.all_reduce_min(mine[r], dist.group.WORLD)))
            dist.destroy_process_group()

        ctx = mp.get_context("fork")
        out = ctx.Queue()
        procs = [ctx.Process(target=rank, args=(r, out)) for r in (0, 1)]
        for p in procs:
            p.start()
        got = dict(out.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        assert got == {0: [5, 3, 7, none], 1: [5, 3, 7, none]}
        """
    )


def test_shutdown_closes_everything_when_the_store_cannot_close():
    # A store directory removed while vLLM ran made store.close() raise
    # (its index cannot be written): shutdown stopped there and left its
    # lookup clients open.
    run_in_vllm(
        """
        from kvh_cache import errors

        class Store:
            def stats(self):
                return {}
            def close(self):
                raise errors.KvhIOError("KVH_ERR_IO: cannot write the disk index: No such file or directory")

        class Client:
            closed = 0
            def close(self):
                Client.closed += 1

        k = bare(_server=None, _store=Store(), _clients=[Client(), Client()])
        k.shutdown()
        assert Client.closed == 2 and k._store is None and k._clients is None
        """
    )
