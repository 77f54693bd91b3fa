"""Virtually contiguous views from Python: kvh.VMap arrays equal read_kv,
attention over views equals paged attention bit for bit, staleness and
refresh, lifetime of arrays past release."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import kvh_cache as kvh


def make(**kw):
    base = dict(
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
        block_tokens=16,
        dtype="f32",
        backend="cpu",
        device_bytes=64 * 2 * 2 * 2 * 16 * 64 * 4,
        host_bytes=0,
        vmap=True,
    )
    base.update(kw)
    return kvh.Engine(**base)


def fill(seq, n, start=0, seed=0):
    rng = np.random.default_rng(seed)
    eng = seq.engine
    for layer in range(eng.num_layers):
        k = rng.standard_normal((n, eng.num_kv_heads, eng.head_dim)).astype(np.float32)
        v = rng.standard_normal((n, eng.num_kv_heads, eng.head_dim)).astype(np.float32)
        seq.write_kv(layer, start, k, v)


def test_view_arrays_and_attention():
    with make() as eng, eng.sequence() as seq:
        assert eng.config.vmap is True
        seq.append(range(70))
        fill(seq, 70)
        with seq.vmap(1) as vm:
            k, v = seq.read_kv(1)
            assert vm.n_tokens == 70 and vm.capacity_tokens == 128
            assert np.array_equal(vm.k, k.transpose(1, 0, 2))
            assert np.array_equal(vm.v, v.transpose(1, 0, 2))
            q = np.random.default_rng(3).standard_normal((1, 4, 64)).astype(np.float32)
            paged = eng.attention_decode(1, [seq], q)
            viewed = eng.attention_decode_vmap([vm], q)
            assert np.array_equal(paged, viewed)
            pq = np.random.default_rng(4).standard_normal((9, 4, 64)).astype(np.float32)
            assert np.array_equal(eng.attention_prefill(1, [seq], [9], pq), eng.attention_prefill_vmap([vm], [9], pq))


def test_stale_refresh_and_lifetime():
    with make() as eng, eng.sequence() as seq:
        seq.append(range(20))
        fill(seq, 20)
        vm = seq.vmap(0, 64)
        g = vm.generation
        seq.append(range(20, 40))
        fill(seq, 20, start=20, seed=1)
        q = np.zeros((1, 2, 64), np.float32)
        with pytest.raises(kvh.BadHandleError, match=r"stale.*\(VMap\.refresh\(\) it\)"):
            eng.attention_decode_vmap([vm], q)
        assert vm.refresh() is True and vm.generation > g
        assert vm.refresh() is False
        arr = vm.k
        vm.release()
        k, _ = seq.read_kv(0)
        assert np.array_equal(arr, k.transpose(1, 0, 2))  # still mapped while the array lives
        del arr
        gc.collect()
        with pytest.raises(kvh.BadHandleError):
            vm.refresh()


def test_refused_without_vmap():
    with make(vmap=False) as eng, eng.sequence() as seq:
        seq.append(range(4))
        with pytest.raises(kvh.UnsupportedError, match="opened without vmap=True$"):
            seq.vmap(0)


def test_attention_plan_matches_one_shot():
    with make(vmap=False) as eng, eng.sequence() as a, eng.sequence() as b:
        a.append(range(50))
        fill(a, 50)
        b.append(range(9))
        fill(b, 9, seed=4)
        q = np.random.default_rng(2).standard_normal((2, 4, 64)).astype(np.float32)
        with eng.attention_plan(1, [a, b], num_q_heads=4) as plan:
            assert np.array_equal(plan.run(q), eng.attention_decode(1, [a, b], q))
            assert a.blocks()[0].info().holds == 1
            with pytest.raises(ValueError):
                plan.run(q[:1])
        assert a.blocks()[0].info().holds == 0
        pq = np.random.default_rng(3).standard_normal((7, 2, 64)).astype(np.float32)
        with eng.attention_plan(0, [a, b], [5, 2]) as plan:
            assert np.array_equal(plan.run(pq), eng.attention_prefill(0, [a, b], [5, 2], pq))
        with pytest.raises(kvh.InvalidArgumentError):
            eng.attention_plan(0, [])


def test_attention_over_views_checks_its_arguments():
    """A non-view in views raised AttributeError, and q_lens went through
    int(): [1.5] ran a prefill of 1 row, [-1] failed on q's shape."""
    with make() as eng, eng.sequence() as seq:
        seq.append(range(20))
        fill(seq, 20)
        with seq.vmap(0) as vm:
            q = np.ones((1, 2, 64), np.float32)
            with pytest.raises(TypeError, match=r"views\[0\]"):
                eng.attention_decode_vmap([5], q)
            with pytest.raises(TypeError, match=r"q_lens\[0\]"):
                eng.attention_prefill_vmap([vm], [1.5], q)
            with pytest.raises(ValueError, match=r"q_lens\[0\]"):
                eng.attention_prefill_vmap([vm], [-1], q)
            with pytest.raises(ValueError, match=r"q_lens has more than 1 entries"):
                eng.attention_prefill_vmap([vm], range(1 << 62), q)  # refused, not read for ever
            assert eng.attention_prefill_vmap([vm], [1], q).shape == (1, 2, 64)


def test_block_view_of_a_vmap_engine_is_refused():
    # Laid out by head, the device tier holds no block at base + slot *
    # block_bytes: such a view showed (and, writable, wrote) other
    # blocks' heads.
    with make() as eng, eng.sequence() as seq:
        seq.append(range(16))
        fill(seq, 16)
        assert eng.tier_info(kvh.Tier.DEVICE).base == 0
        with pytest.raises(kvh.UnsupportedError, match="through Sequence.vmap$"):
            seq.block_view(0, 0)


@pytest.mark.parametrize("shift", [1, -1])
def test_attention_over_views_with_out_overlapping_q_in_part(shift):
    # Views run one after another: with out one row past q, the first
    # view's output was written over the next view's queries before they
    # were read.
    with make() as eng:
        seqs = [eng.sequence() for _ in range(3)]
        views = []
        for i, s in enumerate(seqs):
            s.append(range(20 + 7 * i))
            fill(s, 20 + 7 * i, seed=i)
            views.append(s.vmap(0))
        buf = np.random.default_rng(11).standard_normal((4, 4, 64)).astype(np.float32)
        q, out = (buf[:3], buf[1:]) if shift > 0 else (buf[1:], buf[:3])
        ref = eng.attention_decode_vmap(views, q.copy())
        assert np.array_equal(eng.attention_decode_vmap(views, q, out=out), ref)
        pbuf = np.random.default_rng(12).standard_normal((10, 4, 64)).astype(np.float32)
        q, out = (pbuf[:9], pbuf[1:]) if shift > 0 else (pbuf[1:], pbuf[:9])
        pref = eng.attention_prefill_vmap(views, [2, 3, 4], q.copy())
        assert np.array_equal(eng.attention_prefill_vmap(views, [2, 3, 4], q, out=out), pref)
        for vm in views:
            vm.release()
        for s in seqs:
            s.free()
