"""A hostile caller of the modules around the engine: virtually contiguous
views (kvh.VMap), attention plans, external pools, weight contexts, latency
histograms, the Prometheus exporter, queue hints and fences. Arguments of
the wrong type or range, objects used after they or their engine ended, or
handed to another engine, copies of handles, and ends racing with calls on
other threads. Every misuse must raise a typed exception whose detail names
no C function, never crash, hang or return stale data; what is written must
read back exactly. Cases that could corrupt memory run in a child process."""

from __future__ import annotations

import copy
import dataclasses
import gc
import pickle
import re
import threading
import time
import weakref

import numpy as np
import pytest

import kvh_cache as kvh
from kvh_cache.pool import Pool, persist_blocks
from kvh_testutil import C_NAME, make_engine, raises_typed, reference_attention, run_child, typed_errors

TYPED = typed_errors()

# One view engine: 2 layers, 2 heads, head_dim 64, f32, 16-token blocks, all
# device tier (views need their blocks there).
VMAP = dict(head_dim=64, vmap=True, host_bytes=0, device_bytes=64 * 2 * 2 * 2 * 16 * 64 * 4)


def kv_values(seq_id, layer, first, n, heads, dim):
    """K and V whose every element encodes (seq, layer, token, head, dim),
    exactly representable in float32 for the sizes used here."""
    t = np.arange(first, first + n)[:, None, None]
    h = np.arange(heads)[None, :, None]
    d = np.arange(dim)[None, None, :]
    k = (seq_id * 2_000_000 + layer * 500_000 + t * 1024 + h * dim + d).astype(np.float32)
    return k, -k - 0.5


def written_seq(eng, seq_id, n, first_token=0):
    seq = eng.sequence(tokens=np.arange(first_token, first_token + n))
    for layer in range(eng.num_layers):
        k, v = kv_values(seq_id, layer, 0, n, eng.num_kv_heads, eng.head_dim)
        seq.write_kv(layer, 0, k, v)
    return seq


def holds(seq):
    return [seq.block_info(i).holds for i in range(seq.num_blocks)]


# ---- views (kvh.VMap) --------------------------------------------------------------------

BAD_VIEW_ARGS = [
    (dict(layer="0"), TypeError),
    (dict(layer=1.0), TypeError),
    (dict(layer=True), TypeError),
    (dict(layer=None), TypeError),
    (dict(layer=np.float32(0)), TypeError),
    (dict(layer=-1), ValueError),
    (dict(layer=2), kvh.RangeError),
    (dict(layer=1 << 40), ValueError),
    (dict(capacity_tokens=-1), ValueError),
    (dict(capacity_tokens=64.0), TypeError),
    (dict(capacity_tokens=float("nan")), TypeError),
    (dict(capacity_tokens=5), kvh.RangeError),  # fewer than the sequence's 40 tokens
    (dict(capacity_tokens=1 << 63), kvh.RangeError),
    (dict(capacity_tokens=1 << 64), ValueError),
]


@pytest.mark.parametrize(
    "kw,error", BAD_VIEW_ARGS, ids=[f"{next(iter(k))}={next(iter(k.values()))!r}" for k, _ in BAD_VIEW_ARGS]
)
def test_vmap_arguments_are_refused_and_hold_nothing(kw, error):
    with make_engine(**VMAP) as eng:
        seq = written_seq(eng, 1, 40)
        args = dict(layer=0, capacity_tokens=0)
        args.update(kw)
        raises_typed(lambda: seq.vmap(args["layer"], args["capacity_tokens"]), error)
        # A refused view holds none of the blocks it would have held.
        assert holds(seq) == [0, 0, 0]
        with seq.vmap(np.int64(1), np.uint64(64)) as vm:
            assert vm.capacity_tokens == 64 and vm.n_tokens == 40
        seq.free()


def test_vmap_arrays_read_back_exact_values():
    with make_engine(**VMAP) as eng:
        seqs = [written_seq(eng, i, n, first_token=100 * i) for i, n in ((1, 40), (2, 17), (3, 1))]
        for i, seq in enumerate(seqs, start=1):
            for layer in range(2):
                k, v = kv_values(i, layer, 0, len(seq), 2, 64)
                with seq.vmap(layer) as vm:
                    assert vm.k.shape == (2, len(seq), 64) and vm.k.dtype == np.float32
                    assert np.array_equal(vm.k, k.transpose(1, 0, 2))
                    assert np.array_equal(vm.v, v.transpose(1, 0, 2))
                    assert not vm.k.flags.writeable and not vm.v.flags.writeable
                    with pytest.raises(ValueError):
                        vm.k[0, 0, 0] = 1.0
        # The views changed nothing.
        for i, seq in enumerate(seqs, start=1):
            k, v = kv_values(i, 1, 0, len(seq), 2, 64)
            k2, v2 = seq.read_kv(1)
            assert np.array_equal(k2, k) and np.array_equal(v2, v)
            seq.free()


def test_handles_refuse_copy_deepcopy_and_pickle():
    ks = [np.zeros((2, 16, 2, 64), np.float32) for _ in range(2)]
    with make_engine(**VMAP) as eng:
        seq = written_seq(eng, 1, 20)
        vm = seq.vmap(0)
        plan = eng.attention_plan(0, [seq])
        pool = Pool.from_arrays(eng, ks, [a.copy() for a in ks])
        for obj in (vm, plan, pool):
            for dup in (copy.copy, copy.deepcopy, pickle.dumps):
                raises_typed(lambda: dup(obj), TypeError)
        # The refused copies left every object working.
        assert np.array_equal(vm.k, kv_values(1, 0, 0, 20, 2, 64)[0].transpose(1, 0, 2))
        q = np.ones((1, 2, 64), np.float32)
        assert np.array_equal(plan.run(q), eng.attention_decode(0, [seq], q))
        pool.unregister()
        plan.destroy()
        vm.release()
        assert holds(seq) == [0, 0]


def test_vmap_released_refuses_every_call_and_ends_once():
    with make_engine(**VMAP) as eng:
        seq = written_seq(eng, 1, 40)
        vm = seq.vmap(0)
        assert holds(seq) == [1, 1, 1]
        with vm:
            pass
        with vm:  # exited twice: the second exit is a no-op
            pass
        vm.release()
        vm.close()
        assert holds(seq) == [0, 0, 0]
        q = np.ones((1, 2, 64), np.float32)
        calls = (
            lambda: vm.k,
            lambda: vm.v,
            lambda: vm.n_tokens,
            lambda: vm.generation,
            lambda: vm.capacity_tokens,
            lambda: vm.backing,
            lambda: vm.map_unit,
            lambda: vm.refresh(),
            lambda: eng.attention_decode_vmap([vm], q),
            lambda: eng.attention_prefill_vmap([vm], [1], q),
        )
        for call in calls:
            raises_typed(call, kvh.BadHandleError)
        assert holds(seq) == [0, 0, 0]
        seq.free()


def test_vmap_of_another_engine_is_refused_without_touching_out():
    with make_engine(**VMAP) as a, make_engine(**VMAP) as b:
        sa, sb = written_seq(a, 1, 20), written_seq(b, 2, 20)
        with sa.vmap(0) as va, sb.vmap(0) as vb:
            q = np.ones((1, 2, 64), np.float32)
            out = np.full((1, 2, 64), -7.0, np.float32)
            raises_typed(lambda: b.attention_decode_vmap([va], q, out=out))
            raises_typed(lambda: b.attention_decode_vmap([vb, va], np.ones((2, 2, 64), np.float32)))
            assert (out == -7.0).all()
            assert np.array_equal(b.attention_decode_vmap([vb], q), b.attention_decode(0, [sb], q))


def test_vmap_stale_after_truncate_until_refreshed():
    with make_engine(**VMAP) as eng:
        seq = written_seq(eng, 1, 40)
        vm = seq.vmap(0, 64)
        q = np.ones((1, 2, 64), np.float32)
        seq.truncate(10)
        raises_typed(lambda: eng.attention_decode_vmap([vm], q), kvh.BadHandleError)
        assert vm.refresh() is True
        k, v = kv_values(1, 0, 0, 10, 2, 64)
        assert vm.n_tokens == 10
        assert np.array_equal(vm.k, k.transpose(1, 0, 2)) and np.array_equal(vm.v, v.transpose(1, 0, 2))
        assert np.array_equal(eng.attention_decode_vmap([vm], q), eng.attention_decode(0, [seq], q))
        vm.release()
        seq.free()


def test_vmap_array_taken_before_a_truncate_and_refresh_stays_readable():
    """The module doc: arrays taken from a view stay valid until they are
    collected (the unmapping waits for them). A refresh after a truncation
    must not unmap what an earlier array still reads."""
    res = run_child(
        """
        import numpy as np
        from kvh_testutil import make_engine
        from test_hostile_modules import VMAP, kv_values, written_seq
        eng = make_engine(**VMAP)
        seq = written_seq(eng, 1, 40)
        vm = seq.vmap(0, 64)
        arr = vm.k
        seq.truncate(10)
        vm.refresh()
        k, _ = kv_values(1, 0, 0, 40, 2, 64)
        # The first 10 tokens are still the sequence's; the rest may read
        # anything the old mapping held, but reading it must not crash.
        assert arr.shape == (2, 40, 64)
        assert np.array_equal(arr[:, :10], k[:10].transpose(1, 0, 2))
        float(arr.sum())
        print("ok")
        """
    )
    assert res.stdout.strip() == "ok"


def test_vmap_arrays_outlive_a_garbage_collected_engine():
    res = run_child(
        """
        import gc, weakref
        import numpy as np
        from kvh_testutil import make_engine
        from test_hostile_modules import VMAP, kv_values, written_seq
        eng = make_engine(**VMAP)
        seq = written_seq(eng, 3, 33)
        vm = seq.vmap(1)
        k_arr, v_arr = vm.k, vm.v
        ref = weakref.ref(eng)
        del vm, seq, eng
        gc.collect()
        k, v = kv_values(3, 1, 0, 33, 2, 64)
        assert np.array_equal(k_arr, k.transpose(1, 0, 2)) and np.array_equal(v_arr, v.transpose(1, 0, 2))
        del k_arr, v_arr
        gc.collect()
        print("collected" if ref() is None else "alive")
        """
    )
    assert res.stdout.strip() == "collected"


def test_engine_closed_while_threads_use_views_and_plans():
    """Threads reading views, refreshing them, attending over them and
    running a plan while the main thread closes the engine: each call works
    (with exact data) or raises ClosedError/BadHandleError."""
    res = run_child(
        """
        import threading, time
        import numpy as np
        import kvh_cache as kvh
        from kvh_testutil import close_while_running, make_engine
        from test_hostile_modules import VMAP, kv_values, written_seq
        for rnd in range(3):
            eng = make_engine(**VMAP)
            seqs = [written_seq(eng, i, 20 + 7 * i, first_token=100 * i) for i in range(3)]
            plan = eng.attention_plan(0, seqs)
            bad, kept, started = [], [], threading.Barrier(4)
            def work(i, seq):
                k, v = kv_values(i, 1, 0, len(seq), 2, 64)
                q = np.ones((1, 2, 64), np.float32)
                started.wait()
                try:
                    while True:
                        with seq.vmap(1) as vm:
                            arr = vm.k
                            if not np.array_equal(arr, k.transpose(1, 0, 2)):
                                bad.append(f"view {i} read other data")
                            kept.append(arr)
                            vm.refresh()
                            eng.attention_decode_vmap([vm], q)
                        plan.run(np.ones((3, 2, 64), np.float32))
                        eng.latency_histograms()
                        eng.hint_advance(0)
                except (kvh.ClosedError, kvh.BadHandleError):
                    return
                except BaseException as exc:
                    bad.append(repr(exc))
            threads = [threading.Thread(target=work, args=(i, s)) for i, s in enumerate(seqs)]
            close_while_running(eng, threads, started, 0.05 + 0.05 * rnd)
            assert not bad, bad
            for i, arr in enumerate(kept[-3:]):
                float(arr.sum())  # still mapped
        print("ok")
        """,
        timeout=60,
    )
    assert res.stdout.strip() == "ok"


# ---- attention plans ---------------------------------------------------------------------

BAD_PLAN_ARGS = [
    (dict(layer=2), kvh.RangeError),
    (dict(layer=-1), ValueError),
    (dict(layer=0.0), TypeError),
    (dict(layer="0"), TypeError),
    (dict(num_q_heads=3), kvh.InvalidArgumentError),
    (dict(num_q_heads=-2), ValueError),
    (dict(num_q_heads=2.0), TypeError),
    (dict(num_q_heads=1 << 33), ValueError),
    (dict(scale=float("nan")), ValueError),
    (dict(scale=float("inf")), ValueError),
    (dict(scale="1"), TypeError),
    (dict(scale=None), TypeError),
    (dict(threads=-1), ValueError),
    (dict(threads=1.5), TypeError),
    (dict(io_dtype="f64"), ValueError),
    (dict(io_dtype=7), ValueError),
    (dict(q_lens=[1.0, 1]), TypeError),
    (dict(q_lens=[1]), ValueError),
    (dict(q_lens=[0, 0]), kvh.InvalidArgumentError),
    (dict(q_lens=[41, 1]), kvh.RangeError),
    (dict(q_lens=[-1, 1]), ValueError),
    (dict(q_lens=[1 << 33, 1]), ValueError),
]


@pytest.mark.parametrize(
    "kw,error", BAD_PLAN_ARGS, ids=[f"{next(iter(k))}={next(iter(k.values()))!r}" for k, _ in BAD_PLAN_ARGS]
)
def test_attention_plan_arguments_are_refused_and_hold_nothing(kw, error):
    with make_engine() as eng:
        a, b = written_seq(eng, 1, 40), written_seq(eng, 2, 20, first_token=500)
        args = dict(layer=0)
        args.update(kw)
        raises_typed(lambda: eng.attention_plan(args.pop("layer"), [a, b], **args), error)
        assert holds(a) == [0, 0, 0] and holds(b) == [0, 0]


def test_attention_plan_refuses_sequences_of_another_engine_or_freed():
    with make_engine() as a_eng, make_engine() as b_eng:
        a, b = written_seq(a_eng, 1, 20), written_seq(b_eng, 2, 20)
        raises_typed(lambda: a_eng.attention_plan(0, [a, b]), ValueError)
        raises_typed(lambda: a_eng.attention_plan(0, [b]), ValueError)
        raises_typed(lambda: a_eng.attention_plan(0, a), TypeError)
        raises_typed(lambda: a_eng.attention_plan(0, [a, "b"]), TypeError)
        b.free()
        raises_typed(lambda: b_eng.attention_plan(0, [b]), kvh.BadHandleError)
        assert holds(a) == [0, 0]


def test_attention_plan_sees_writes_in_place_not_copies():
    """The module doc: later writes into a plan's tokens are seen where they
    are made in place (the partial block), not where write_kv copies the
    block (a full block written whole): the plan keeps reading the old."""
    with make_engine() as eng:
        seq = written_seq(eng, 1, 40)  # two full blocks and a partial one
        q = np.random.default_rng(5).standard_normal((1, 2, 8)).astype(np.float32)
        with eng.attention_plan(0, [seq]) as plan:
            k, v = kv_values(1, 0, 0, 40, 2, 8)
            assert np.allclose(plan.run(q)[0], reference_attention(k, v, q[0]), atol=1e-5)
            k2, v2 = kv_values(7, 0, 0, 40, 2, 8)
            k2, v2 = k2 / 1e7, v2 / 1e7  # other values, same tokens
            seq.write_kv(0, 32, k2[32:], v2[32:])  # the partial block, in place
            got = plan.run(q)
            assert np.array_equal(got, eng.attention_decode(0, [seq], q)), "the plan read stale K/V"
            mixed_k, mixed_v = np.concatenate([k[:32], k2[32:]]), np.concatenate([v[:32], v2[32:]])
            assert np.allclose(got[0], reference_attention(mixed_k, mixed_v, q[0]), atol=1e-5)
            seq.write_kv(0, 0, k2[:32], v2[:32])  # full blocks: copies
            assert np.array_equal(plan.run(q), got)
            assert not np.array_equal(eng.attention_decode(0, [seq], q), got)


def test_attention_plan_does_not_see_tokens_appended_later():
    with make_engine() as eng:
        seq = written_seq(eng, 1, 20)
        q = np.random.default_rng(6).standard_normal((1, 4, 8)).astype(np.float32)
        with eng.attention_plan(1, [seq], num_q_heads=4) as plan:
            before = plan.run(q)
            seq.append(range(20, 30))
            k, v = kv_values(9, 1, 20, 10, 2, 8)
            seq.write_kv(1, 20, k, v)
            assert np.array_equal(plan.run(q), before)
            k0, v0 = kv_values(1, 1, 0, 20, 2, 8)
            assert np.allclose(before[0], reference_attention(k0, v0, q[0]), atol=1e-5)


def test_attention_plan_with_zero_q_heads_is_refused_or_runs():
    """A plan the library accepted must run: num_q_heads=0 made a plan that
    every run refused ("made for 0" heads) while it held its blocks."""
    with make_engine() as eng:
        seq = written_seq(eng, 1, 20)
        q = np.ones((1, 2, 8), np.float32)
        try:
            plan = eng.attention_plan(0, [seq], num_q_heads=0)
        except TYPED as exc:
            detail = exc.message if isinstance(exc, kvh.Error) else str(exc)
            assert not C_NAME.search(detail), detail
            assert holds(seq) == [0, 0]
            return
        with plan:
            assert np.array_equal(plan.run(q), eng.attention_decode(0, [seq], q))


def test_attention_plan_outlives_its_sequences_or_refuses():
    """A plan holds its blocks: after its sequence is truncated or freed a
    run gives what it gave before, or raises a typed error; never another
    result or a crash."""
    res = run_child(
        """
        import numpy as np
        import kvh_cache as kvh
        from kvh_testutil import make_engine
        from test_hostile_modules import written_seq
        eng = make_engine()
        a, b = written_seq(eng, 1, 40), written_seq(eng, 2, 24, first_token=300)
        q = np.random.default_rng(2).standard_normal((2, 2, 8)).astype(np.float32)
        plan = eng.attention_plan(1, [a, b])
        ref = plan.run(q)
        a.truncate(5)
        b.free()
        for _ in range(3):
            filler = written_seq(eng, 9, 48, first_token=900)  # reuses freed slots if any
            try:
                got = plan.run(q)
            except (kvh.Error, ValueError) as exc:
                print("refused", type(exc).__name__)
                break
            assert np.array_equal(got, ref), "the plan read other data"
            filler.free()
        plan.destroy()
        plan.destroy()
        try:
            plan.run(q)
        except kvh.BadHandleError:
            print("ok")
        """
    )
    assert res.stdout.strip().endswith("ok")


def test_attention_plan_after_engine_close_and_destroy_races():
    res = run_child(
        """
        import threading
        import numpy as np
        import kvh_cache as kvh
        from kvh_testutil import make_engine
        from test_hostile_modules import written_seq
        eng = make_engine()
        seqs = [written_seq(eng, i, 30, first_token=100 * i) for i in range(2)]
        q = np.ones((2, 2, 8), np.float32)
        for rnd in range(20):
            plan = eng.attention_plan(0, seqs)
            ref, bad = plan.run(q), []
            def run():
                try:
                    for _ in range(50):
                        if not np.array_equal(plan.run(q), ref):
                            bad.append("other result")
                except kvh.BadHandleError:
                    pass
                except BaseException as exc:
                    bad.append(repr(exc))
            ts = [threading.Thread(target=run) for _ in range(2)]
            for t in ts:
                t.start()
            plan.destroy()
            for t in ts:
                t.join(20)
            assert not any(t.is_alive() for t in ts) and not bad, bad
        assert [s.block_info(0).holds for s in seqs] == [0, 0]
        plan = eng.attention_plan(0, seqs)
        eng.close()
        try:
            plan.run(q)
        except kvh.ClosedError:
            pass
        plan.destroy()
        plan.destroy()
        with plan:
            pass
        print("ok")
        """
    )
    assert res.stdout.strip() == "ok"


# ---- external pools ----------------------------------------------------------------------

PL, PH, PD, PBT, PS = 2, 2, 8, 16, 6


def pool_values(slot, layer, heads_first=False):
    """One slot's K and V of one layer, encoding (slot, layer, token, head, dim)."""
    t = np.arange(PBT)[:, None, None]
    h = np.arange(PH)[None, :, None]
    d = np.arange(PD)[None, None, :]
    k = (slot * 100_000 + layer * 10_000 + t * 100 + h * 10 + d).astype(np.float32)
    v = -k - 0.25
    return (k.transpose(1, 0, 2), v.transpose(1, 0, 2)) if heads_first else (k, v)


def pool_engine(**kw):
    return make_engine(num_layers=PL, num_kv_heads=PH, head_dim=PD, block_tokens=PBT, **kw)


def test_pool_round_trip_between_layouts_is_exact():
    """Offload from a dense pool, restore into a padded heads-first one: the
    restored slots hold exactly the offloaded values, and nothing else of
    the destination (other slots, padding) changes."""
    src_k = [np.stack([pool_values(s, layer)[0] for s in range(PS)]) for layer in range(PL)]
    src_v = [np.stack([pool_values(s, layer)[1] for s in range(PS)]) for layer in range(PL)]
    big = [np.full((PS, PH + 1, PBT, PD + 2), -3.0, np.float32) for _ in range(2 * PL)]
    dst = [b[:, :PH, :, :PD] for b in big]
    with pool_engine() as eng:
        src = Pool.from_arrays(eng, src_k, src_v)
        into = Pool.from_arrays(eng, dst[:PL], dst[PL:], heads_first=True)
        items, parent = [], 0
        for i, slot in enumerate((4, 1, 2)):
            tk = np.arange(PBT) + PBT * i
            items.append((np.int64(slot), parent, tk))
            parent = eng.prefix_hash(tk, parent)
        off = src.offload(items)
        assert off.wait(10) and off.statuses() == [0, 0, 0]
        before = [b.copy() for b in big]
        load = into.restore(off.blocks, [np.uint8(0), 5, 3])
        assert load.wait(10) and load.failed() == []
        for layer in range(PL):
            for src_slot, dst_slot in ((4, 0), (1, 5), (2, 3)):
                k, v = pool_values(src_slot, layer, heads_first=True)
                assert np.array_equal(dst[layer][dst_slot], k)
                assert np.array_equal(dst[PL + layer][dst_slot], v)
        for b, old in zip(big, before):
            changed = b != old
            changed[[0, 5, 3], :PH, :, :PD] = False
            assert not changed.any()
        # The source was only read.
        for layer in range(PL):
            assert all(np.array_equal(src_k[layer][s], pool_values(s, layer)[0]) for s in range(PS))
        off.release()
        src.unregister()
        into.unregister()


def test_pool_restore_refuses_released_blocks():
    """kvh.Block: once released the object is unusable (BadHandleError).
    A restore from a released Block must not go ahead on the handle the
    caller gave up."""
    ks = [np.stack([pool_values(s, layer)[0] for s in range(PS)]) for layer in range(PL)]
    vs = [np.stack([pool_values(s, layer)[1] for s in range(PS)]) for layer in range(PL)]
    with pool_engine() as eng:
        pool = Pool.from_arrays(eng, ks, vs)
        off = pool.offload([(0, 0, np.arange(PBT))])
        assert off.wait(10)
        blk = off.blocks[0]
        off.release()
        off.release()
        raises_typed(lambda: blk.info(), kvh.BadHandleError)
        raises_typed(lambda: pool.restore([blk], [1]), kvh.BadHandleError)
        # The refused restore wrote nothing into slot 1.
        assert np.array_equal(ks[0][1], pool_values(1, 0)[0])
        pool.unregister()


def test_persist_refuses_released_blocks(tmp_path):
    ks = [np.stack([pool_values(s, layer)[0] for s in range(PS)]) for layer in range(PL)]
    with pool_engine(disk_path=str(tmp_path / "store"), disk_bytes=8 << 20) as eng:
        pool = Pool.from_arrays(eng, ks, [k.copy() for k in ks])
        off = pool.offload([(0, 0, np.arange(PBT))])
        assert off.wait(10)
        blk = off.blocks[0]
        blk.release()
        raises_typed(lambda: persist_blocks(eng, [blk]), kvh.BadHandleError)
        pool.unregister()


@pytest.mark.parametrize("bad", ["4096", 4096.5, True, None, b"\x00\x10", np.float64(4096)])
def test_pool_from_pointers_refuses_pointers_that_are_not_ints(bad):
    """Base pointers are ints like the strides beside them: a string, float
    or bool is not read as an address (a pool over address 4096 crashes
    the first offload)."""
    with pool_engine() as eng:
        ok = np.zeros((1, PBT, PH, PD), np.float32)
        ptr = ok.ctypes.data
        try:
            pool = Pool.from_pointers(eng, [bad, ptr], [ptr, ptr], 1, ok.strides[0], ok.strides[1], ok.strides[2])
        except (TypeError, ValueError) as exc:
            assert not C_NAME.search(str(exc))
            return
        pool.unregister()
        pytest.fail(f"a base pointer {bad!r} was accepted")


def test_pool_empty_batches_complete_with_no_statuses():
    ks = [np.zeros((PS, PBT, PH, PD), np.float32) for _ in range(2 * PL)]
    with pool_engine() as eng:
        pool = Pool.from_arrays(eng, ks[:PL], ks[PL:])
        off = pool.offload([])
        assert off.wait(10) and off.statuses() == [] and off.blocks == []
        load = pool.restore([], [])
        assert load.wait(10) and load.failed() == []
        raises_typed(lambda: load.wait_layer(PL), ValueError)
        raises_typed(lambda: load.wait_layer(np.float32(0)), TypeError)
        raises_typed(lambda: off.wait(float("nan")), ValueError)
        assert eng.stats().blocks_allocated == 0
        pool.unregister()


def test_pool_objects_after_engine_close():
    ks = [np.stack([pool_values(s, layer)[0] for s in range(PS)]) for layer in range(PL)]
    eng = pool_engine()
    pool = Pool.from_arrays(eng, ks, [k.copy() for k in ks])
    off = pool.offload([(2, 0, np.arange(PBT))])
    assert off.wait(10)
    blk = off.blocks[0]
    eng.close()
    eng.close()
    raises_typed(lambda: pool.offload([(0, 0, np.arange(PBT))]), kvh.ClosedError)
    raises_typed(lambda: pool.restore([blk], [1]), kvh.ClosedError)
    raises_typed(lambda: blk.info(), kvh.ClosedError)
    assert off.statuses() == [0]  # seen complete before the close
    off.release()
    off.release()
    pool.unregister()
    pool.unregister()
    with pytest.raises(kvh.BadHandleError):  # ``with`` refuses an ended object
        with pool:
            pass
    assert all(np.array_equal(ks[0][s], pool_values(s, 0)[0]) for s in range(PS))


def test_pool_engine_closed_while_batches_run():
    res = run_child(
        """
        import threading, time
        import numpy as np
        import kvh_cache as kvh
        from kvh_cache.pool import Pool
        from kvh_testutil import close_while_running, make_engine
        from test_hostile_modules import PBT, PH, PD, PL, PS, pool_values, pool_engine
        for rnd in range(4):
            ks = [np.stack([pool_values(s, layer)[0] for s in range(PS)]) for layer in range(PL)]
            vs = [np.stack([pool_values(s, layer)[1] for s in range(PS)]) for layer in range(PL)]
            # One destination per thread: two restores may not write one slot at once.
            dk = [[np.zeros_like(k) for k in ks] for _ in range(2)]
            dv = [[np.zeros_like(v) for v in vs] for _ in range(2)]
            eng = pool_engine(migration_threads=2)
            src = Pool.from_arrays(eng, ks, vs)
            dst = [Pool.from_arrays(eng, dk[t], dv[t]) for t in range(2)]
            bad, started = [], threading.Barrier(3)
            def work(tag):
                started.wait()
                try:
                    for i in range(10_000):
                        items = [(s, 0, np.arange(PBT) + 1000 * (tag * 100_000 + i) + PBT * s) for s in range(PS)]
                        off = src.offload(items)
                        off.wait(5)
                        load = dst[tag].restore(off.blocks, list(range(PS)))
                        load.wait(5)
                        if not load.failed():
                            for layer in range(PL):
                                if not np.array_equal(dk[tag][layer], ks[layer]):
                                    bad.append("restored other data")
                        off.release()
                except (kvh.ClosedError, kvh.BadHandleError):
                    return
                except BaseException as exc:
                    bad.append(repr(exc))
            threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
            close_while_running(eng, threads, started, 0.05 + 0.03 * rnd)
            assert not bad, bad[:3]
            for layer in range(PL):
                assert all(np.array_equal(ks[layer][s], pool_values(s, layer)[0]) for s in range(PS))
        print("ok")
        """,
        timeout=60,
    )
    assert res.stdout.strip() == "ok"


# ---- weight contexts ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw,error",
    [
        (dict(chunk_bytes=0), kvh.InvalidArgumentError),
        (dict(chunk_bytes=1 << 40), kvh.InvalidArgumentError),
        (dict(chunk_bytes=-1), ValueError),
        (dict(chunk_bytes=True), TypeError),
        (dict(chunk_bytes=4096.0), TypeError),
        (dict(chunk_bytes="4096"), TypeError),
        (dict(kv_policy=None), ValueError),
        (dict(kv_policy="KEEP"), ValueError),
        (dict(kv_policy=1), ValueError),
        (dict(name=b"ctx"), TypeError),
    ],
)
def test_context_creation_arguments(kw, error):
    with make_engine() as eng:
        raises_typed(lambda: eng.context(**kw), error)
        assert eng.weight_stats().switches == 0
        with eng.context("ok", chunk_bytes=np.int64(4096)) as ctx:
            assert ctx.info().regions == 0


def test_context_regions_read_back_their_exact_bytes(tmp_path):
    raw = (np.arange(5000) * 7 % 256).astype(np.uint8)
    path = tmp_path / "w.bin"
    path.write_bytes(raw.tobytes())
    nan_bits = np.array([0x7FC00001, 0x7F800001, 0xFF800000, 0x80000000], np.uint32)  # payload NaNs, -inf, -0
    ro = np.arange(64, dtype=np.uint16)
    ro.flags.writeable = False
    sources = {
        "file": (dict(path=path, offset=123, size=4000), raw[123:4123].tobytes()),
        "nan": (dict(data=nan_bits.view(np.float32)), nan_bits.tobytes()),
        "scalar": (dict(data=np.float64(-1.5)), np.float64(-1.5).tobytes()),
        "0d": (dict(data=np.array(7, np.int16)), np.int16(7).tobytes()),
        "strided": (dict(data=np.arange(30, dtype=np.int32)[::3]), np.arange(30, dtype=np.int32)[::3].tobytes()),
        "readonly": (dict(data=ro), ro.tobytes()),
        "fortran": (dict(data=np.asfortranarray(np.arange(12, dtype=np.int8).reshape(3, 4))), None),
    }
    with make_engine(device_bytes=128 * 4096) as eng:
        ctx = eng.context("w", chunk_bytes=1024)
        idx = {name: ctx.add_region(name, layer=i, **kw) for i, (name, (kw, _)) in enumerate(sources.items())}
        ctx.switch_to()
        for name, (kw, expect) in sources.items():
            got = ctx.region(idx[name]).tobytes()
            if expect is None:  # the array's bytes as NumPy orders them
                expect = np.ascontiguousarray(kw["data"]).tobytes()
            assert got == expect, name
        assert ctx.verify() >= len(sources)
        ctx.destroy()


def test_context_misuse_is_typed(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(bytes(range(256)) * 20)
    with make_engine() as eng:
        ctx = eng.context("c")
        raises_typed(lambda: ctx.add_region("z", path=path, size=0), kvh.InvalidArgumentError)
        raises_typed(lambda: ctx.add_region("z", path=path, size=(1 << 64) - 1), kvh.KvhIOError)
        raises_typed(lambda: ctx.add_region("z", path=path, size=10, offset=(1 << 64) - 1), kvh.KvhIOError)
        raises_typed(lambda: ctx.add_region("z", path=tmp_path, size=10), kvh.KvhIOError)
        raises_typed(lambda: ctx.add_region("z", path=3, size=10), TypeError)
        raises_typed(lambda: ctx.add_region("z", data="text"), TypeError)
        raises_typed(lambda: ctx.add_region("z", data=np.array([1, "a"], dtype=object)), TypeError)
        raises_typed(lambda: ctx.add_region("z", data=np.zeros(0, np.uint8)), ValueError)
        raises_typed(lambda: ctx.add_gguf(path), ValueError)  # not a GGUF file
        assert ctx.regions == [] and ctx.info().regions == 0
        ctx.add_region("r", data=np.arange(100, dtype=np.uint8))
        raises_typed(lambda: ctx.region(0), kvh.NotResidentError)
        ctx.switch_to()
        raises_typed(lambda: ctx.region(1), kvh.RangeError)
        raises_typed(lambda: ctx.region_pointer(1 << 31), kvh.RangeError)
        raises_typed(lambda: ctx.pin(7), kvh.RangeError)
        with pytest.raises(KeyError):
            ctx.region("missing")
        raises_typed(lambda: ctx.wait_layer(0, timeout=np.float32("nan")), ValueError)
        ctx.wait_layer(0, timeout=-1)  # resident: a poll succeeds
        assert np.array_equal(ctx.region("r"), np.arange(100, dtype=np.uint8))


def test_context_of_another_engine_is_refused():
    with make_engine() as a, make_engine() as b:
        ca, cb = a.context("a"), b.context("b")
        cb.add_region("r", data=np.arange(10, dtype=np.uint8))
        seqs_before = cb.info().seqs
        raises_typed(lambda: b.sequence(context=ca), (ValueError, kvh.BadHandleError))
        raises_typed(lambda: cb.switch_to(previous=ca), ValueError)
        raises_typed(lambda: ca.attach(b.sequence()), ValueError)
        assert cb.info().seqs == seqs_before and ca.info().seqs == 0
        assert b.stats().blocks_allocated == 0


def test_context_after_engine_close():
    eng = make_engine()
    ctx = eng.context("c")
    ctx.add_region("r", data=np.arange(50, dtype=np.uint8))
    ctx.switch_to()
    eng.close()
    for call in (
        lambda: ctx.info(),
        lambda: ctx.switch_to(),
        lambda: ctx.unload(),
        lambda: ctx.region(0),
        lambda: ctx.region_pointer(0),
        lambda: ctx.verify(),
        lambda: ctx.wait_layer(0, timeout=0),
        lambda: ctx.add_region("x", data=b"12"),
        lambda: eng.weight_stats(),
        lambda: eng.admission_info(),
    ):
        raises_typed(call, (kvh.ClosedError, kvh.BadHandleError))
    ctx.destroy()
    ctx.destroy()


def test_context_switches_while_engine_closes():
    res = run_child(
        """
        import threading, time
        import numpy as np
        import kvh_cache as kvh
        from kvh_testutil import close_while_running, make_engine
        data = [(np.arange(3000) * (i + 3) % 251).astype(np.uint8) for i in range(2)]
        for rnd in range(4):
            eng = make_engine(device_bytes=8 * 4096, host_bytes=64 * 4096)
            ctxs = [eng.context(f"c{i}") for i in range(2)]
            for c, d in zip(ctxs, data):
                for layer in range(3):
                    c.add_region(f"w{layer}", data=d, layer=layer)
            bad, views, started = [], [], threading.Barrier(3)
            def switcher():
                started.wait()
                try:
                    while True:
                        for i, c in enumerate(ctxs):
                            c.switch_to(wait=False).result(5)
                            view = c.region(1)
                            if not np.array_equal(view, data[i]):
                                bad.append("region read other data")
                            views.append((view, i))
                            del view
                except (kvh.ClosedError, kvh.BadHandleError):
                    return
                except BaseException as exc:
                    bad.append(repr(exc))
            def reader():
                started.wait()
                try:
                    while True:
                        for c in ctxs:
                            c.info()
                        eng.weight_stats()
                except (kvh.ClosedError, kvh.BadHandleError):
                    return
                except BaseException as exc:
                    bad.append(repr(exc))
            threads = [threading.Thread(target=switcher), threading.Thread(target=reader)]
            close_while_running(eng, threads, started, 0.05 + 0.05 * rnd)
            assert not bad, bad[:3]
            for view, i in views[-4:]:
                assert np.array_equal(view, data[i])
            views.clear()
        print("ok")
        """,
        timeout=60,
    )
    assert res.stdout.strip() == "ok"


# ---- latency histograms ------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,error",
    [
        (3, kvh.InvalidArgumentError),
        (1 << 32, kvh.InvalidArgumentError),
        (1 << 64, kvh.InvalidArgumentError),
        (-(1 << 64), kvh.InvalidArgumentError),
        ("", kvh.InvalidArgumentError),
        ("DISK_READ", kvh.InvalidArgumentError),
        (" disk_read", kvh.InvalidArgumentError),
        (b"disk_read", TypeError),
        (float("nan"), TypeError),
        (np.float64(0), TypeError),
        (np.bool_(True), TypeError),
        ([0], TypeError),
    ],
)
def test_latency_kind_edges(kind, error):
    with make_engine() as eng:
        raises_typed(lambda: eng.latency_histogram(kind), error)


def test_latency_histograms_are_consistent_snapshots():
    with make_engine() as eng:
        for kind in (np.uint8(0), np.int64(1), np.uint64(2)):
            h = eng.latency_histogram(kind)
            assert h.kind in ("acquire_stall", "disk_read", "disk_write")
            assert sum(h.counts) == h.count and h.cumulative()[-1][1] == h.count
        h = eng.latency_histogram("disk_read")
        with pytest.raises(dataclasses.FrozenInstanceError):
            h.count = 5
        assert pickle.loads(pickle.dumps(h)) == h
        assert eng.latency_histogram("disk_read") == h


# ---- Prometheus exposition ---------------------------------------------------------------

METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
LABEL_VALUE = r'"(?:[^"\\\n]|\\["\\n])*"'
SAMPLE = re.compile(
    rf"(?P<name>{METRIC_NAME.pattern})(?:\{{(?P<labels>(?:[a-zA-Z_][a-zA-Z0-9_]*={LABEL_VALUE},?)*)\}})? "
    r"(?P<value>[-+]?(?:[0-9.]+(?:[eE][-+]?[0-9]+)?|Inf|NaN))$"
)


def check_exposition(text):
    """Checks Prometheus text format 0.0.4 line by line: HELP and TYPE once
    per family, before its samples, each family's samples together, names
    and label values well formed; returns {(name, labels): value}."""
    seen_type, seen_help, done, current = {}, set(), set(), None
    samples = {}
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            kind, name = line.split(" ")[1:3]
            assert METRIC_NAME.fullmatch(name), line
            if kind == "HELP":
                assert name not in seen_help, f"second HELP line for {name}"
                seen_help.add(name)
            if kind == "TYPE":
                assert name not in seen_type, f"second TYPE line for {name}"
                seen_type[name] = line.split(" ")[3]
                assert seen_type[name] in ("counter", "gauge", "histogram", "summary", "untyped"), line
            if name != current:
                assert name not in done, f"family {name} split in two groups"
                if current is not None:
                    done.add(current)
                current = name
            continue
        assert not line.startswith("#"), line
        m = SAMPLE.fullmatch(line)
        assert m, f"malformed sample line {line!r}"
        name = m.group("name")
        fam = current
        assert fam is not None and name.startswith(fam), f"sample {name} outside its family {fam}"
        if seen_type[fam] == "counter":
            assert name == fam and name.endswith("_total"), line
        elif seen_type[fam] == "histogram":
            assert name in (fam + "_bucket", fam + "_count", fam + "_sum"), line
        else:
            assert name == fam, line
        key = (name, m.group("labels") or "")
        assert key not in samples, f"duplicate sample {key}"
        samples[key] = float(m.group("value").replace("Inf", "inf"))
    return seen_type, samples


def test_metrics_text_is_valid_exposition_format(tmp_path):
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest

    import kvh_cache.metrics as km

    with make_engine(disk_path=str(tmp_path / "store"), disk_bytes=8 << 20) as eng:
        seq = written_seq(eng, 1, 64)
        seq.migrate("disk")
        with seq.acquire():
            pass
        reg = CollectorRegistry(auto_describe=False)
        reg.register(km.EngineCollector(eng))
        types, samples = check_exposition(generate_latest(reg).decode())
        for name in km.METRIC_NAMES:
            assert types.get(name + "_total") == "counter", name
            assert any(k[0] == name + "_total" for k in samples), name
        for name, _ in km.HISTOGRAM_NAMES.values():
            assert types[name] == "histogram"
            buckets = [(k[1], v) for k, v in samples.items() if k[0] == name + "_bucket"]
            les = [float(re.search(r'le="([^"]+)"', lbl).group(1).replace("Inf", "inf")) for lbl, _ in buckets]
            assert les == sorted(les) and les[-1] == float("inf")
            counts = [v for _, v in buckets]
            assert counts == sorted(counts) and counts[-1] == samples[(name + "_count", "")]
            assert samples[(name + "_sum", "")] >= 0
        assert samples[("kvh_disk_read_duration_seconds_count", "")] == 4
        assert all(v == v for v in samples.values()), "a NaN sample"
        assert samples[("kvh_engine_up", "")] == 1
        seq.free()


def test_two_engines_in_one_registry_keep_the_exposition_valid():
    """serve(registry=) adds an engine to a caller's registry. A second
    engine in the same registry must either be refused or leave the text
    valid: two copies of every family (two TYPE lines per name) make a
    Prometheus server reject the whole scrape."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest

    import kvh_cache.metrics as km

    with make_engine() as a, make_engine() as b:
        reg = CollectorRegistry(auto_describe=False)
        with km.serve(a, 0, registry=reg):
            try:
                exporter = km.serve(b, 0, registry=reg)
            except (ValueError, kvh.Error):
                check_exposition(generate_latest(reg).decode())
                return
            with exporter:
                check_exposition(generate_latest(reg).decode())


def test_metrics_of_a_collected_or_closing_engine():
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest

    import kvh_cache.metrics as km

    eng = make_engine()
    reg = CollectorRegistry(auto_describe=False)
    reg.register(km.EngineCollector(eng))
    ref = weakref.ref(eng)
    del eng
    gc.collect()
    assert ref() is None, "the collector kept the engine alive"
    _, samples = check_exposition(generate_latest(reg).decode())
    assert samples == {("kvh_engine_up", ""): 0.0}

    # Scrapes racing with a close from another thread: each one is whole.
    eng = make_engine()
    reg = CollectorRegistry(auto_describe=False)
    reg.register(km.EngineCollector(eng))
    texts, bad = [], []

    def scrape():
        try:
            for _ in range(200):
                texts.append(generate_latest(reg).decode())
        except BaseException as exc:
            bad.append(repr(exc))

    t = threading.Thread(target=scrape)
    t.start()
    while not texts and t.is_alive():
        time.sleep(0.001)
    eng.close()
    t.join(30)
    assert not t.is_alive() and not bad, bad
    ups = []
    for text in texts:
        _, samples = check_exposition(text)
        ups.append(samples[("kvh_engine_up", "")])
        if ups[-1] == 1:
            assert ("kvh_lookups_total", "") in samples
        else:
            assert len(samples) == 1
    assert ups[0] == 1 and ups[-1] == 0 and ups == sorted(ups, reverse=True)


# ---- queue hints and fences --------------------------------------------------------------


def test_hints_take_numpy_ints_and_refuse_the_rest():
    with make_engine() as a, make_engine() as b:
        sa, sb = written_seq(a, 1, 64), written_seq(b, 2, 64)
        assert a.hint_advance(np.uint64(2)) == 2 and a.hint_advance(np.int8(1)) == 3
        a.hint_queued(sa, np.int64(0), np.uint32(16), position=np.uint64(1))
        a.hint_queued(sa, range(16, 48), request=np.int16(7))
        for bad, error in ((np.float64(1), TypeError), (np.bool_(True), TypeError), ("1", TypeError)):
            raises_typed(lambda: a.hint_advance(bad), error)
            raises_typed(lambda: a.hint_queued(sa, position=bad), error)
        raises_typed(lambda: a.hint_queued(sa, range(0, 32, 2), position=0), ValueError)
        raises_typed(lambda: a.hint_queued(sa, range(32, 16), position=0), ValueError)
        raises_typed(lambda: a.hint_queued(sa, 0, 1 << 64, position=0), ValueError)
        raises_typed(lambda: a.hint_queued(sa, 64, 1, request=0), kvh.RangeError)
        for call in (
            lambda: b.hint_queued(sa, position=0),
            lambda: b.hint(sa),
            lambda: b.prefetch(sa),
            lambda: b.hint_queued(sa, request=0),
        ):
            raises_typed(call, ValueError)
        assert a.hint_advance(0) == 3 and b.hint_advance(0) == 0
        sb.free()
        raises_typed(lambda: b.hint_queued(sb, position=0), kvh.BadHandleError)
        b.close()
        raises_typed(lambda: b.hint_advance(0), kvh.ClosedError)
        raises_typed(lambda: b.hint_queued(sb, position=0), (kvh.ClosedError, kvh.BadHandleError))


def test_fences_after_engine_close_and_copies():
    eng = make_engine()
    seq = written_seq(eng, 1, 40)
    pending = seq.migrate("host", wait=False)
    finished = seq.migrate("device", wait=False)
    assert finished.wait(10)
    raises_typed(lambda: copy.copy(pending), TypeError)
    raises_typed(lambda: copy.deepcopy(finished), TypeError)
    eng.close()
    # Seen complete before the close: it keeps its outcome.
    assert finished.done() and finished.result() is None
    for call in (lambda: pending.wait(1), lambda: pending.done(), lambda: pending.result(1)):
        try:
            call()
        except (kvh.ClosedError, kvh.BadHandleError) as exc:
            assert not C_NAME.search(exc.message)
    pending.close()
    pending.close()
    with finished:
        pass
    with finished:
        pass
