"""API round trips against NumPy references, CoW through the API, zero-copy
views, lifetimes, stats and logging."""

from __future__ import annotations

import dataclasses
import gc
import logging
import threading

import numpy as np
import pytest

import kvh_cache as kvh
from kvh_cache._ffi import ffi
from kvh_testutil import filled_seq, kv_data, make_engine


# ---- configuration ---------------------------------------------------------------


def test_engine_config_and_properties():
    with make_engine(num_layers=3, num_kv_heads=4, head_dim=16, block_tokens=32, dtype="f16") as eng:
        assert eng.backend == "cpu"
        assert (eng.num_layers, eng.num_kv_heads, eng.head_dim, eng.block_tokens) == (3, 4, 16, 32)
        assert eng.dtype == kvh.DType.F16 and eng.np_dtype == np.float16
        assert eng.block_bytes == 3 * 2 * 4 * 32 * 16 * 2
        assert eng.layer_bytes * 3 == eng.block_bytes
        cfg = eng.config
        assert isinstance(cfg, kvh.Config) and cfg.lru_k == 2 and cfg.num_layers == 3  # library defaults filled in
        assert "backend=cpu" in repr(eng)
    assert eng.closed and "closed" in repr(eng)


def test_config_object_and_overrides():
    cfg = kvh.Config(num_kv_heads=2, head_dim=8, dtype=np.float32, backend="cpu")
    with kvh.Engine(cfg, block_tokens=8) as eng:
        assert eng.block_tokens == 8 and eng.dtype == kvh.DType.F32
    assert cfg.to_dict()["backend"] == "cpu"


def test_dtype_mapping():
    assert kvh.numpy_dtype("f32") == np.float32
    assert kvh.numpy_dtype("f16") == np.float16
    assert kvh.numpy_dtype("bf16") == np.uint16  # raw bits
    x = np.array([1.0, -2.5, 3.140625, 0.0], np.float32)
    assert np.array_equal(kvh.bf16_to_f32(kvh.f32_to_bf16(x)), x)  # exactly representable


# ---- K/V round trips -------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("geom", [(1, 1, 4, 1), (2, 2, 8, 16), (3, 4, 64, 32)], ids=["tiny", "small", "wide"])
def test_write_read_round_trip(dtype, geom):
    layers, heads, dim, bt = geom
    with make_engine(
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=dim,
        block_tokens=bt,
        dtype=dtype,
        device_bytes=1 << 22,
        host_bytes=1 << 22,
    ) as eng:
        n = 3 * bt + 5  # partial last block
        with eng.sequence(tokens=np.arange(n)) as seq:
            ref = {}
            for layer in range(layers):
                k, v = kv_data(n, heads, dim, eng.np_dtype, seed=layer)
                seq.write_kv(layer, 0, k, v)
                ref[layer] = (k, v)
            for layer in range(layers):
                k, v = seq.read_kv(layer)
                assert k.dtype == eng.np_dtype and k.shape == (n, heads, dim)
                np.testing.assert_array_equal(k, ref[layer][0])
                np.testing.assert_array_equal(v, ref[layer][1])
                # sub-ranges across block boundaries, as (pos, n) and as range()
                a = max(0, bt - 3)
                k2, v2 = seq.read_kv(layer, a, bt + 6)
                np.testing.assert_array_equal(k2, ref[layer][0][a : a + bt + 6])
                np.testing.assert_array_equal(v2, ref[layer][1][a : a + bt + 6])
                k3, _ = seq.read_kv(layer, range(1, n - 1))
                np.testing.assert_array_equal(k3, ref[layer][0][1 : n - 1])


def test_partial_writes_and_out_arrays(engine):
    with engine.sequence(tokens=range(40)) as seq:
        k, v = kv_data(40, 2, 8, np.float32)
        for pos in range(0, 40, 7):  # odd-sized pieces
            m = min(7, 40 - pos)
            seq.write_kv(0, pos, k[pos : pos + m], v[pos : pos + m])
        ok = np.empty_like(k)
        ov = np.empty_like(v)
        rk, rv = seq.read_kv(0, out=(ok, ov))
        assert rk is ok and rv is ov
        np.testing.assert_array_equal(ok, k)
        np.testing.assert_array_equal(ov, v)


def test_tokens_truncate_and_length(engine):
    with engine.sequence() as seq:
        seq.append([5, 6, 7])
        seq.append(np.arange(100, 140, dtype=np.int64))
        assert len(seq) == 43 and seq.num_blocks == 3
        toks = seq.tokens()
        assert toks.dtype == np.int32 and list(toks[:4]) == [5, 6, 7, 100]
        assert list(seq.tokens(range(3, 6))) == [100, 101, 102]
        seq.truncate(20)
        assert len(seq) == 20 and seq.num_blocks == 2
        assert list(seq.tokens()) == [5, 6, 7] + list(range(100, 117))


# ---- copy-on-write ----------------------------------------------------------------


def test_fork_shares_until_write(engine):
    parent, ref = filled_seq(engine, 40, seed=1)
    with parent:
        b_parent = parent.blocks()
        child = parent.fork(agent=7)
        with child:
            assert child.agent == 7 and len(child) == 40
            assert child.blocks() == b_parent  # the same blocks
            assert all(b.info().refs == 2 for b in b_parent)
            before = engine.stats().cow_copies
            # a write into the child's second block copies only that block
            k, v = kv_data(3, 2, 8, np.float32, seed=99)
            child.write_kv(1, 17, k, v)
            assert engine.stats().cow_copies == before + 1
            cb = child.blocks()
            assert cb[0] == b_parent[0] and cb[2] == b_parent[2] and cb[1] != b_parent[1]
            assert b_parent[1].info().refs == 1 and cb[1].info().refs == 1
            # the parent still reads its own data, the child its new data
            pk, pv = parent.read_kv(1)
            np.testing.assert_array_equal(pk, ref[1][0])
            np.testing.assert_array_equal(pv, ref[1][1])
            ck, cv = child.read_kv(1)
            np.testing.assert_array_equal(ck[17:20], k)
            np.testing.assert_array_equal(ck[:17], ref[1][0][:17])
            np.testing.assert_array_equal(ck[20:], ref[1][0][20:])
            # the other layer of the copied block came along
            np.testing.assert_array_equal(child.read_kv(0)[0], ref[0][0])
            # and a parent write after the fork does not reach the child
            parent.write_kv(0, 0, k, v)
            np.testing.assert_array_equal(child.read_kv(0, 0, 3)[0], ref[0][0][:3])
        # freeing the child drops its references
        assert all(b.info().refs == 1 for b in parent.blocks())


def test_append_to_shared_partial_block_copies(engine):
    parent, ref = filled_seq(engine, 20, seed=2)
    with parent, parent.fork() as child:
        child.append([1, 2, 3])
        assert len(child) == 23 and len(parent) == 20
        assert child.blocks()[1] != parent.blocks()[1]
        np.testing.assert_array_equal(child.read_kv(0, 0, 20)[0], ref[0][0])


def test_match_prefix_attaches_cached_blocks(engine):
    toks = np.arange(1000, 1040)
    owner, ref = filled_seq(engine, 40, seed=3, first_token=1000)
    with owner:
        full = owner.blocks()[:2]
        assert all(b.info().published for b in full)  # full + every layer written
        with engine.sequence(agent=2) as s:
            matched = s.match_prefix(toks)
            assert matched == 32 and len(s) == 32
            assert s.blocks() == full
            np.testing.assert_array_equal(s.read_kv(1)[0], ref[1][0][:32])
            st = engine.stats()
            assert st.prefix_queries >= 1 and st.prefix_hit_tokens >= 32
        with pytest.raises(kvh.InvalidArgumentError):
            owner.match_prefix(toks)  # not empty
        # the index agrees with prefix_hash / prefix_lookup
        h0 = engine.prefix_hash(toks[:16])
        h1 = engine.prefix_hash(toks[16:32], parent=h0)
        assert full[0].info().hash == h0 and full[1].info().hash == h1
        found = engine.prefix_lookup(toks)
        assert found == full and all(b.owned for b in found)
        refs = full[0].info().refs
        for b in found:
            b.release()
        assert full[0].info().refs == refs - 1


# ---- residency, pins, migration -----------------------------------------------------


def test_acquire_hold_and_release(engine):
    seq, _ = filled_seq(engine, 40)
    with seq:
        seq.migrate(kvh.Tier.HOST)
        assert all(b.info().tier == kvh.Tier.HOST for b in seq.blocks())
        with seq.acquire(range(0, 20)) as hold:
            assert hold.range == range(0, 20)
            infos = [b.info() for b in seq.blocks()]
            assert [i.holds for i in infos] == [1, 1, 0]
            assert infos[0].tier == kvh.Tier.DEVICE and infos[1].tier == kvh.Tier.DEVICE
        assert [b.info().holds for b in seq.blocks()] == [0, 0, 0]
        hold.release()  # idempotent
        h2 = seq.acquire(wait=False)
        h2.wait(5)
        assert all(b.info().tier == kvh.Tier.DEVICE for b in seq.blocks())
        h2.release()


def test_pin_and_unpin(engine):
    seq, _ = filled_seq(engine, 16)
    with seq:
        seq.pin()
        assert seq.block_info(0).pins == 1
        assert engine.tier_info("device").pinned_blocks >= 1
        seq.unpin()
        assert seq.block_info(0).pins == 0
        with pytest.raises(kvh.InvalidArgumentError):
            seq.unpin()


def test_migrate_fence_and_block_api(engine):
    seq, ref = filled_seq(engine, 32)
    with seq:
        f = seq.migrate("host", wait=False)
        f.result(5)
        assert f.done()
        assert {b.info().tier for b in seq.blocks()} == {kvh.Tier.HOST}
        engine.migrate(seq.blocks(), "device")
        assert {b.info().tier for b in seq.blocks()} == {kvh.Tier.DEVICE}
        np.testing.assert_array_equal(seq.read_kv(0)[0], ref[0][0])
        with engine.block_alloc(agent=3) as b:
            assert b.owned and b.info().agent == 3 and b.info().refs == 1
            b2 = b.retain()
            assert b.info().refs == 2
            b2.release()
        assert engine.stats().blocks_freed >= 1


def test_hint_keeps_blocks_until_used():
    with make_engine(device_bytes=4 * 4096, host_bytes=64 * 4096) as eng:
        kept = eng.sequence(tokens=range(16))  # one block, the oldest
        assert kept.block_info(0).tier == kvh.Tier.DEVICE
        eng.hint(kept, priority=5)
        others = [eng.sequence(tokens=range(100 * i, 100 * i + 16)) for i in range(1, 9)]
        # Eight newer blocks went through four device slots; the hint kept it.
        assert kept.block_info(0).tier == kvh.Tier.DEVICE
        with kept.acquire(0, 16):
            pass  # the access redeems the hint: it is an ordinary block again
        more = []
        for i in range(8):  # newer blocks, each used twice: kept is now the oldest
            more.append(eng.sequence(tokens=range(5000 + 100 * i, 5000 + 100 * i + 16)))
            with more[-1].acquire(0, 16):
                pass
        assert kept.block_info(0).tier == kvh.Tier.HOST
        kept.hint(range(0, 16), priority=-1)  # the Sequence form
        with pytest.raises(kvh.RangeError):
            kept.hint(0, 17)
        with pytest.raises(ValueError):
            eng.hint(kept, priority=1 << 31)
        with pytest.raises(TypeError):
            eng.hint("not a sequence")
        for s in [kept, *others, *more]:
            s.free()


def test_tier_info_and_spill():
    with make_engine(device_bytes=4 * 4096, host_bytes=64 * 4096) as eng:
        tiers = eng.tiers()
        assert tiers[kvh.Tier.DEVICE].capacity_blocks == 4
        assert tiers[kvh.Tier.HOST].capacity_blocks == 64
        assert not tiers[kvh.Tier.DISK].present
        seqs = [filled_seq(eng, 32, seed=i)[0] for i in range(6)]  # 12 blocks > 4 device slots
        t = eng.tiers()
        assert t[kvh.Tier.DEVICE].used_blocks == 4
        assert t[kvh.Tier.HOST].used_blocks >= 8
        assert t[kvh.Tier.DEVICE].used_bytes == 4 * eng.block_bytes
        st = eng.stats()
        # One arena on the CPU backend: the evictions moved blocks in place.
        assert st.evictions >= 8 and st.blocks_moved_in_place >= 8 and st.bytes_device_to_host == 0
        for s in seqs:
            s.free()


def test_clean_host_copy_spares_the_demotion():
    # Two arenas, as a discrete GPU: a block promoted from the host tier keeps
    # its host slot, so going down again copies nothing.
    with make_engine(device_bytes=4 * 4096, host_bytes=8 * 4096, copy_moves=1) as eng:
        seq, data = filled_seq(eng, 32, seed=4)
        seq.migrate("host")
        before = eng.stats()
        seq.acquire().release()
        host = eng.tier_info("host")
        assert host.clean_copies == 2 and host.used_blocks == 0
        seq.migrate("host")
        delta = eng.stats() - before
        assert delta.clean_copies_kept == 2 and delta.clean_copy_demotions == 2
        assert delta.blocks_host_to_device == 2 and delta.blocks_device_to_host == 0
        assert eng.tier_info("host").clean_copies == 0
        k, v = seq.read_kv(1, 0, 32)
        np.testing.assert_array_equal(k, data[1][0])
        np.testing.assert_array_equal(v, data[1][1])
        seq.free()


# ---- stats --------------------------------------------------------------------------


def test_stats_dataclass_covers_the_c_struct(engine):
    names = [n for n, _ in ffi.typeof("kvh_stats").fields if n != "struct_size" and not n.startswith("reserved")]
    fields = [f.name for f in dataclasses.fields(kvh.Stats) if f.name != "extra"]
    assert names == fields, "kvh.Stats is out of date with kvh_stats"
    st = engine.stats()
    assert st.extra == {}
    with engine.sequence(tokens=range(16)) as s:
        s.write_kv(0, 0, *kv_data(16, 2, 8, np.float32))  # filling a block is not a use
        filled = engine.stats() - st
        s.read_kv(0, 0, 16)
        delta = engine.stats() - st
    assert filled.lookups == 0 and delta.lookups >= 1 and delta.blocks_allocated == 1
    assert 0.0 <= delta.device_hit_rate <= 1.0
    assert set(st.to_dict()) == set(names)


# ---- lifetimes ---------------------------------------------------------------------


def test_gc_frees_sequences_and_blocks(engine):
    used0 = engine.tier_info("device").used_blocks
    seq = engine.sequence(tokens=range(40))  # 3 blocks, not full -> not cached
    assert engine.tier_info("device").used_blocks == used0 + 3
    freed0 = engine.stats().blocks_freed
    del seq
    gc.collect()
    assert engine.stats().blocks_freed == freed0 + 3
    b = engine.block_alloc()
    del b
    gc.collect()
    assert engine.stats().blocks_freed == freed0 + 4


def test_engine_gc_closes():
    eng = make_engine()
    seq = eng.sequence(tokens=range(8))
    native = eng._native
    del eng, seq
    gc.collect()
    assert native.closed and native.released


def test_double_free_and_context_managers(engine):
    with engine.sequence() as s:
        pass
    assert s.freed
    s.free()  # no-op
    assert "freed" in repr(s)
    engine.close()
    engine.close()  # idempotent


# ---- zero-copy views --------------------------------------------------------------------


def test_block_view_shares_memory_both_ways(engine):
    seq, ref = filled_seq(engine, 20)
    with seq:
        # block 1 holds tokens 16..19: private and not full, so writable
        view = seq.block_view(1, 1)
        H, bt, D = engine.num_kv_heads, engine.block_tokens, engine.head_dim
        assert view.shape == (2, H, bt, D) and view.dtype == np.float32
        assert view.flags.writeable and not view.flags.owndata
        # layout [K,V][head][token][dim] holds what write_kv wrote
        np.testing.assert_array_equal(view[0][:, :4].transpose(1, 0, 2), ref[1][0][16:20])
        np.testing.assert_array_equal(view[1][:, :4].transpose(1, 0, 2), ref[1][1][16:20])
        # a write through the view is seen by C
        view[0, 1, 2, :] = 42.0
        k, _ = seq.read_kv(1, 18, 1)
        assert np.all(k[0, 1] == 42.0)
        # and a write through C is seen by the view
        nk, nv = kv_data(1, H, D, np.float32, seed=7)
        seq.write_kv(1, 17, nk, nv)
        np.testing.assert_array_equal(view[0][:, 1, :], nk[0])
        np.testing.assert_array_equal(view[1][:, 1, :], nv[0])
        # the view holds its block resident, at the address the tier reports
        info = seq.block_info(1)
        assert info.holds == 1 and not info.shared
        addr = view.__array_interface__["data"][0]
        base = engine.tier_info(info.tier).base
        assert addr == base + info.slot * engine.block_bytes + engine.layer_bytes
        del view
        gc.collect()
        assert seq.block_info(1).holds == 0


def test_a_second_block_view_keeps_what_the_first_wrote(engine):
    # Cells written through a view read as never written until write_kv:
    # a second view of the block (and layer) must not take them for an
    # earlier block's leftovers and clear them.
    seq, ref = filled_seq(engine, 20)
    with seq:
        first = seq.block_view(1, 0)
        first[:, :, 6, :] = 7.0  # token 22: past what was written
        second = seq.block_view(1, 0)
        assert np.all(first[:, :, 6, :] == 7.0) and np.all(second[:, :, 6, :] == 7.0)
        other_layer = seq.block_view(1, 1)  # another layer's memory: cleared as usual
        assert not np.any(other_layer[:, :, 6, :])


def test_block_view_read_only_for_shared_blocks(engine):
    seq, ref = filled_seq(engine, 20)
    with seq:
        w = seq.block_view(1, 0)  # partial private block
        assert w.flags.writeable
        child = seq.fork()
        # forked: the block is shared now, the existing writable view is downgraded
        assert not w.flags.writeable
        r = child.block_view(1, 0)
        assert not r.flags.writeable
        with pytest.raises(ValueError):
            r[0, 0, 0, 0] = 1.0
        full = seq.block_view(0, 0)  # full and published: immutable
        assert not full.flags.writeable and seq.block_info(0).published
        child.free()
        del w, r, full


@pytest.mark.parametrize("codec", [None, "int8"])
def test_block_view_read_only_for_complete_unpublished_blocks(codec):
    # Full with every cell written, the block is immutable to kvh even when
    # another sequence published its prefix first (so it is not published):
    # a promotion keeps its host slot as a copy, and a demotion back went
    # to that copy, losing what a writable view wrote in between.
    L, H, D, bt = 2, 1, 64, 4
    with kvh.Engine(
        num_layers=L,
        num_kv_heads=H,
        head_dim=D,
        block_tokens=bt,
        dtype="f32",
        backend="cpu",
        device_bytes=4 * 2 * L * H * D * bt * 4,
        host_bytes=8 * 2 * L * H * D * bt * 4,
        kv_codec=codec,
    ) as eng:
        one = np.ones((bt, H, D), np.float32)
        x = eng.sequence(0, range(bt))
        y = eng.sequence(0, range(bt))
        for layer in range(L):
            x.write_kv(layer, 0, one, one)
            y.write_kv(layer, 0, one * 2, one * 2)
        assert x.block_info(0).published and not y.block_info(0).published
        y.migrate("host")
        view = y.block_view(0, 0)
        assert not view.flags.writeable
        with pytest.raises(ValueError):
            view[0, 0, 0, :] = 5.0
        del view
        gc.collect()
        y.migrate("host")
        assert np.all(y.read_kv(0, 0, bt)[0] == 2.0)
        # One layer short of complete: still the sequence's to write in place.
        z = eng.sequence(0, range(100, 100 + bt))
        z.write_kv(0, 0, one, one)
        view = z.block_view(0, 0)
        assert view.flags.writeable
        view[0, 0, 0, :] = 5.0
        assert np.all(z.read_kv(0, 0, 1)[0] == 5.0)


def test_block_view_with_explicit_hold(engine):
    seq, _ = filled_seq(engine, 40)
    with seq, seq.acquire() as hold:
        v = seq.block_view(2, 0, hold=hold)
        # the view takes its own hold too: the caller's may end first
        assert seq.block_info(2).holds == 2
        with pytest.raises(ValueError):
            seq.block_view(2, 0, hold=seq.acquire(0, 16))
        del v


def _tiny_engine(**kw):
    H, D, BT = 1, 8, 4
    return kvh.Engine(
        num_layers=1,
        num_kv_heads=H,
        head_dim=D,
        block_tokens=BT,
        dtype="f32",
        backend="cpu",
        device_bytes=kw.pop("device_bytes", 64 << 10),
        host_bytes=1 << 20,
        **kw,
    )


def _three_tokens_of_ones(e):
    """A sequence of 3 tokens (one partial block) whose K and V are 1.0."""
    s = e.sequence(tokens=range(3))
    one = np.ones((3, 1, 8), np.float32)
    s.write_kv(0, 0, one, one)
    return s, one


def test_block_view_slices_never_reach_a_fork():
    # Arrays made from a writable view before a fork keep their flags
    # (NumPy cannot revoke them): the fork moves the parent to a copy of the
    # block first, so what they write reaches neither sequence.
    e = _tiny_engine()
    with e:
        s, one = _three_tokens_of_ones(e)
        view = s.block_view(0, 0)
        part = view[0]
        child = s.fork()
        assert not view.flags.writeable and not np.asarray(view.base).flags.writeable
        part[...] = 42.0  # still writable: NumPy keeps a derived array's flag
        for q in (s, child):
            k, v = q.read_kv(0)
            assert np.all(k == 1.0) and np.all(v == 1.0)
        # the two share the parent's copy: a new view of it is read-only
        view2 = s.block_view(0, 0)
        assert not view2.flags.writeable and s.block_info(0).shared
        del view, part, view2
        gc.collect()


def test_block_view_slices_never_reach_a_published_block():
    e = _tiny_engine()
    with e:
        s, one = _three_tokens_of_ones(e)
        view = s.block_view(0, 0)
        part = view[1]
        s.append([3])
        s.write_kv(0, 3, one[:1], one[:1])  # completes the block: published
        assert s.block_info(0).published and not view.flags.writeable
        part[...] = -7.0
        other = e.sequence()
        assert other.match_prefix(range(4)) == 4
        k, v = other.read_kv(0)
        assert np.all(k == 1.0) and np.all(v == 1.0)
        assert np.all(s.read_kv(0)[1] == 1.0)
        del view, part
        gc.collect()


def test_block_view_fork_with_no_room_for_a_copy_still_forks():
    # A fork needs no room; moving the parent off a viewed block does. With
    # the tiers full the fork goes on as without the view (which turns
    # read-only), and leaves no reference or pin behind.
    block_bytes = 2 * 1 * 4 * 8 * 4
    e = kvh.Engine(
        num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=4, dtype="f32", backend="cpu",
        device_bytes=2 * block_bytes, host_bytes=0, migration_threads=0,
    )  # fmt: skip
    with e:
        s = e.sequence(tokens=range(6))
        one = np.ones((6, 1, 8), np.float32)
        s.write_kv(0, 0, one, one)
        view = s.block_view(1, 0)
        assert view.flags.writeable
        child = s.fork()
        assert not view.flags.writeable
        info = s.block_info(1)
        assert (info.refs, info.pins) == (2, 0)
        child.free()
        del view
        gc.collect()


def test_block_view_slices_keep_a_block_copied_away_from_under_them():
    # The sequence's write copies a block another user holds: arrays made
    # from the view still show the old block, which the view now keeps, so
    # its slot is never handed to another sequence while they live.
    e = _tiny_engine()
    with e:
        s, one = _three_tokens_of_ones(e)
        view = s.block_view(0, 0)
        part = view[0]
        old = s.block_info(0)
        extra = s.block(0).retain()
        two = np.full((3, 1, 8), 2.0, np.float32)
        s.write_kv(0, 0, two, two)  # shared: the sequence moves to a copy
        assert not view.flags.writeable
        extra.release()
        three = np.full((3, 1, 8), 3.0, np.float32)
        others = []
        for i in range(20):
            o = e.sequence(tokens=range(100 + 10 * i, 103 + 10 * i))
            o.write_kv(0, 0, three, three)
            assert (o.block_info(0).tier, o.block_info(0).slot) != (old.tier, old.slot)
            others.append(o)
        part[...] = -5.0
        assert all(np.all(o.read_kv(0)[0] == 3.0) for o in others)
        assert np.all(s.read_kv(0)[0] == 2.0)
        del view, part
        gc.collect()


def test_block_view_outlives_the_callers_hold():
    # The view holds its block itself: the caller's hold may end first,
    # and the block stays where the view maps it.
    e = _tiny_engine(device_bytes=2 * 2 * 8 * 4 * 4, copy_moves=True, migration_threads=0)
    with e:
        a, one = _three_tokens_of_ones(e)
        h = a.acquire()
        view = a.block_view(0, 0, hold=h)
        where = (a.block_info(0).tier, a.block_info(0).slot)
        h.release()
        a.migrate("host")  # best effort: a held block stays
        assert (a.block_info(0).tier, a.block_info(0).slot) == where
        b = e.sequence(tokens=range(3))
        two = np.full((3, 1, 8), 2.0, np.float32)
        b.write_kv(0, 0, two, two)
        view[...] = -1.0
        assert np.all(b.read_kv(0)[0] == 2.0)
        del view
        gc.collect()


def test_block_view_keeps_memory_after_close():
    eng = make_engine()
    seq, ref = filled_seq(eng, 20)
    view = seq.block_view(0, 0)
    eng.close()
    assert eng.closed
    with pytest.raises(kvh.ClosedError):
        seq.read_kv(0)
    # the C engine is kept until the view goes: reading it is safe
    np.testing.assert_array_equal(view[0].transpose(1, 0, 2), ref[0][0][:16])
    native = eng._native
    assert not native.released
    del view
    gc.collect()
    assert native.released


def test_block_view_outlives_truncate_and_free():
    """A view's slot is not handed to other data when its sequence gives
    the block up: the view keeps showing what it showed."""
    eng = make_engine(device_bytes=8 * 4096, host_bytes=8 * 4096)
    with eng:
        seq, ref = filled_seq(eng, 40)  # blocks 0..2, the last partial
        tail = seq.block_view(2, 0)  # the partial block past the cut: freed at once
        head = seq.block_view(0, 1)
        want_tail, want_head = tail.copy(), head.copy()
        seq.truncate(8)
        others = []
        for i in range(6):  # every free slot of both tiers, with other KV
            try:
                o, _ = filled_seq(eng, 16, seed=50 + i, first_token=1000 + 16 * i)
            except kvh.NoSpaceError:
                break
            others.append(o)
        np.testing.assert_array_equal(tail, want_tail)
        seq.free()
        for o in others:
            o.free()
        for i in range(6):
            try:
                filled_seq(eng, 16, seed=80 + i, first_token=2000 + 16 * i)
            except kvh.NoSpaceError:
                break
        np.testing.assert_array_equal(head, want_head)
        np.testing.assert_array_equal(tail, want_tail)
        # the views pin their two blocks until they are collected
        assert eng.tier_info(kvh.Tier.DEVICE).pinned_blocks == 2
        del tail, head
        gc.collect()
        assert eng.tier_info(kvh.Tier.DEVICE).pinned_blocks == 0


def test_block_view_errors(engine):
    with engine.sequence(tokens=range(16)) as seq:
        with pytest.raises(kvh.RangeError):
            seq.block_view(1, 0)
        with pytest.raises(kvh.RangeError):
            seq.block_view(0, engine.num_layers)
        with pytest.raises(TypeError):
            seq.block_view(0, 0, hold="nope")


# ---- persistence ----------------------------------------------------------------------


def test_persist_and_reopen(tmp_path):
    store = tmp_path / "store"
    toks = np.arange(500, 548)
    kw = dict(disk_path=str(store), disk_bytes=1 << 22)
    try:
        eng = make_engine(**kw)
    except kvh.UnsupportedError:
        pytest.skip("no disk tier in this build")
    with eng:
        seq, ref = filled_seq(eng, 48, first_token=500)
        try:
            seq.persist()
        except kvh.UnsupportedError:
            pytest.skip("persist is not implemented in this build")
        seq.free()
    with make_engine(**kw) as eng2:
        assert eng2.tier_info("disk").used_blocks >= 3
        with eng2.sequence() as s:
            assert s.match_prefix(toks) == 48
            for layer in range(2):
                k, v = s.read_kv(layer)
                np.testing.assert_array_equal(k, ref[layer][0])
                np.testing.assert_array_equal(v, ref[layer][1])


def test_a_sequence_as_large_as_every_tier_writes_and_reads_back(tmp_path):
    # 2 device, 2 host and 4 disk slots, and a sequence of 8 blocks: every
    # tier full of its blocks. Writing and reading its K/V needs each block
    # in memory in turn, which a disk block reaches by trading places with
    # a memory block through the host tier's spare slot.
    kw = dict(device_bytes=2 * 4096, host_bytes=2 * 4096, disk_path=str(tmp_path / "store"), disk_bytes=4 * 8192)
    with make_engine(**kw) as eng:
        seq, ref = filled_seq(eng, 128, seed=3)
        for layer in range(2):
            k, v = seq.read_kv(layer)
            np.testing.assert_array_equal(k, ref[layer][0])
            np.testing.assert_array_equal(v, ref[layer][1])
        assert eng.tier_info("device").used_blocks == 2
        assert eng.tier_info("disk").used_blocks == 4
        host = eng.tier_info("host")
        # one block more while a block durable on disk holds the spare
        assert host.capacity_blocks in (2, 3) and host.used_blocks == host.capacity_blocks
        seq.migrate("device", 0, 16)
        assert seq.block_info(0).tier == kvh.Tier.DEVICE
        k, v = seq.read_kv(0)
        np.testing.assert_array_equal(k, ref[0][0])


def test_full_disk_gives_back_clean_copies(tmp_path):
    # Four disk slots (a 4 KiB header and a 4 KiB block each): two hold r's
    # blocks, two the clean copies persist wrote of u's, which stay in memory.
    with make_engine(disk_path=str(tmp_path / "store"), disk_bytes=4 * 8192) as eng:
        r, _ = filled_seq(eng, 32, first_token=0)
        r.migrate("disk")
        u, udata = filled_seq(eng, 32, seed=1, first_token=1000)
        u.persist()
        assert eng.tier_info("disk").used_blocks == 4
        w, _ = filled_seq(eng, 32, seed=2, first_token=2000)
        with pytest.raises(kvh.NoSpaceError):  # u still references its blocks
            w.persist()
        assert eng.stats().disk_copies_given_back == 0
        u.free()  # cached now: their copies are room for a full disk
        before = eng.stats()
        w.persist()
        delta = eng.stats() - before
        assert delta.disk_copies_given_back == 2 and delta.drops == 0
        with eng.sequence() as s:  # u's blocks stayed cached, intact
            assert s.match_prefix(np.arange(1000, 1032)) == 32
            for layer in range(2):
                k, v = s.read_kv(layer)
                np.testing.assert_array_equal(k, udata[layer][0])
                np.testing.assert_array_equal(v, udata[layer][1])
        w.free()
        r.free()


def test_damaged_index_is_rebuilt_unless_strict(tmp_path):
    store = tmp_path / "store"
    kw = dict(disk_path=str(store), disk_bytes=1 << 22)
    try:
        eng = make_engine(**kw)
    except kvh.UnsupportedError:
        pytest.skip("no disk tier in this build")
    with eng:
        seq, _ = filled_seq(eng, 48, first_token=700)
        seq.persist()
        seq.free()
    index = store / "index"
    data = bytearray(index.read_bytes())
    data[20] ^= 0x10  # a bit of the store id, under the header checksum
    index.write_bytes(bytes(data))
    with pytest.raises(kvh.CorruptionError):
        make_engine(disk_strict_index=True, **kw)
    with make_engine(**kw) as eng2:
        assert eng2.config.disk_strict_index is False
        assert eng2.stats().corrupt_blocks == 1
        with eng2.sequence() as s:
            assert s.match_prefix(np.arange(700, 748)) == 48


# ---- logging ------------------------------------------------------------------------------


def test_log_callback_routes_to_logging(caplog):
    caplog.set_level(logging.DEBUG, logger="kvh")
    with kvh.Engine(backend="auto", log_level="debug", device_bytes=1 << 20, host_bytes=1 << 20) as eng:
        backend = eng.backend
    records = [r for r in caplog.records if r.name == "kvh"]
    if backend == "cpu":
        assert any("CPU backend" in r.getMessage() for r in records), records
        assert all(r.levelno in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR) for r in records)


def test_log_level_follows_logger():
    logger = logging.getLogger("kvh")
    old = logger.level
    try:
        logger.setLevel(logging.ERROR)
        with make_engine() as eng:
            assert eng.config.log_level == 0
        logger.setLevel(logging.DEBUG)
        with make_engine() as eng:
            assert eng.config.log_level == 3
    finally:
        logger.setLevel(old)


@pytest.mark.parametrize("threads", [1, 0])
def test_log_handler_cannot_close_the_engine_under_its_sink(tmp_path, threads):
    """A logging handler that closes the engine (or calls it) while kvh
    logs: the close is refused with BusyError and the engine stays open;
    on a kvh worker thread every call into the engine is refused, on the
    caller's own thread the others work."""
    store = tmp_path / "store"
    with make_engine(disk_path=str(store), disk_bytes=1 << 20) as eng:
        seq, _ = filled_seq(eng, 32)
        seq.persist()
    slab = store / "slab-0000.kvh"
    data = bytearray(slab.read_bytes())
    for off in range(4096 + 100, len(data), 8192):  # one byte of every slot's data
        data[off] ^= 0x08
    slab.write_bytes(bytes(data))

    seen = {}
    done = threading.Event()

    class Closer(logging.Handler):
        def emit(self, record):
            if seen:
                return
            seen["main"] = threading.current_thread() is threading.main_thread()
            for name, call in (("close", eng.close), ("stats", eng.stats)):
                try:
                    call()
                    seen[name] = None
                except BaseException as exc:  # noqa: BLE001 - recorded for the asserts
                    seen[name] = type(exc)
            done.set()

    logger = logging.getLogger("kvh")
    handler = Closer(level=logging.WARNING)
    logger.addHandler(handler)
    try:
        eng = make_engine(disk_path=str(store), disk_bytes=1 << 20, migration_threads=threads)
        blocks = eng.prefix_lookup(np.arange(32))
        assert len(blocks) == 2
        with pytest.raises(kvh.errors.CorruptionError):
            eng.migrate(blocks, "host")
        assert done.wait(30)  # a worker's handler may still run
    finally:
        logger.removeHandler(handler)
    assert seen["main"] == (threads == 0)
    assert seen["close"] is kvh.errors.BusyError
    assert seen["stats"] is (kvh.errors.BusyError if threads else None)
    assert not eng.closed
    assert eng.stats().corrupt_blocks >= 1
    for b in blocks:
        b.release()
    eng.close()
    assert eng.closed


@pytest.mark.parametrize("share, dir_mode, file_mode", [(False, 0o700, 0o600), (True, 0o750, 0o640)])
def test_store_is_owner_only_unless_shared(tmp_path, share, dir_mode, file_mode):
    import os
    import stat

    store = tmp_path / "store"
    old = os.umask(0)
    try:
        with kvh.Engine(
            num_layers=1,
            num_kv_heads=1,
            head_dim=8,
            block_tokens=4,
            device_bytes=1 << 20,
            disk_path=str(store),
            disk_bytes=1 << 22,
            disk_share_group=share,
        ) as eng:
            assert eng.config.disk_share_group is share
    finally:
        os.umask(old)
    assert stat.S_IMODE(store.stat().st_mode) == dir_mode
    for name in ("LOCK", "index", "journal"):
        assert stat.S_IMODE((store / name).stat().st_mode) == file_mode, name
    store.chmod(0o777)
    with pytest.raises(kvh.KvhIOError, match="writable by other users"):
        kvh.Engine(
            num_layers=1,
            num_kv_heads=1,
            head_dim=8,
            block_tokens=4,
            device_bytes=1 << 20,
            disk_path=str(store),
            disk_bytes=1 << 22,
        )
