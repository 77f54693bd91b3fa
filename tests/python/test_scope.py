"""Tenant scopes from Python: ``scope=`` on sequences and lookups."""

from __future__ import annotations

import numpy as np
import pytest

import kvh_cache as kvh
from kvh_testutil import kv_data, make_engine


def written(eng, tokens, scope=None):
    """A sequence of tokens in scope with every layer's K/V written."""
    seq = eng.sequence(tokens=tokens, scope=scope)
    for layer in range(eng.num_layers):
        k, v = kv_data(len(tokens), eng.num_kv_heads, eng.head_dim, eng.np_dtype, seed=layer)
        seq.write_kv(layer, 0, k, v)
    return seq


def matched(eng, tokens, scope=None):
    with eng.sequence(scope=scope) as s:
        return s.match_prefix(tokens)


def test_scope_zero_is_the_default_hash():
    with make_engine() as eng:
        t = np.arange(16)
        assert eng.prefix_hash(t, scope=0) == eng.prefix_hash(t)
        assert eng.prefix_hash(t, scope=3) != eng.prefix_hash(t)
        with eng.sequence(tokens=t) as s:
            assert s.scope == kvh.Scope()
            assert s.blocks()[0].info().hash == eng.prefix_hash(t)


def test_two_scopes_share_nothing():
    with make_engine() as eng:
        t = np.arange(100, 148)
        a = written(eng, t, scope=1)
        assert matched(eng, t, scope=2) == 0
        assert matched(eng, t) == 0
        assert eng.prefix_lookup(t) == []
        assert eng.prefix_lookup(t, scope=2) == []
        assert matched(eng, t, scope=1) == 48
        blocks = eng.prefix_lookup(t, scope=kvh.Scope(1))
        assert len(blocks) == 3
        for b in blocks:
            b.release()
        a.free()


def test_shared_scope_is_shared():
    with make_engine() as eng:
        t = np.arange(200, 264)
        a = written(eng, t, scope=kvh.Scope(1, shared_scope=9, shared_tokens=32))
        assert matched(eng, t, scope=kvh.Scope(2, shared_scope=9, shared_tokens=32)) == 32
        assert matched(eng, t, scope=kvh.Scope(2, shared_scope=9, shared_tokens=40)) == 32
        assert matched(eng, t, scope=2) == 0
        assert len(eng.prefix_lookup(t, scope=9)) == 2
        h0 = eng.prefix_hash(t[:16], scope=9)
        h1 = eng.prefix_hash(t[16:32], h0, scope=9)
        assert a.blocks()[2].info().hash == eng.prefix_hash(t[32:48], h1, scope=1)
        a.free()


def test_fork_inherits_and_misuse_is_typed():
    with make_engine() as eng:
        s = eng.sequence()
        s.set_scope(5, shared_scope=8, shared_tokens=16)
        assert s.scope == kvh.Scope(5, 8, 16)
        s.append(np.arange(20))
        child = s.fork()
        assert child.scope == kvh.Scope(5, 8, 16)
        with pytest.raises(kvh.InvalidArgumentError, match="empty"):
            s.set_scope(6)
        assert s.scope == kvh.Scope(5, 8, 16)
        s.truncate(0)
        s.set_scope(kvh.Scope(6))
        assert s.scope.scope == 6
        with pytest.raises(TypeError):
            s.set_scope(kvh.Scope(6), shared_tokens=16)
        with pytest.raises(ValueError):
            kvh.Scope(-1)
        with pytest.raises(TypeError):
            eng.sequence(scope="tenant")
        with pytest.raises(ValueError):
            eng.prefix_hash(np.arange(16), scope=1 << 64)
        child.free()
        s.free()
        with pytest.raises(kvh.BadHandleError):
            s.set_scope(1)
        with pytest.raises(kvh.BadHandleError):
            _ = s.scope


def test_scopes_after_reopen(tmp_path):
    kw = dict(disk_path=str(tmp_path / "store"), disk_bytes=1 << 22)
    t = np.arange(300, 348)
    with make_engine(**kw) as eng:
        s = written(eng, t, scope=kvh.Scope(11, shared_scope=12, shared_tokens=16))
        s.persist()
        s.free()
    with make_engine(**kw) as eng:
        assert matched(eng, t) == 0
        assert matched(eng, t, scope=11) == 0
        assert matched(eng, t, scope=12) == 16
        assert matched(eng, t, scope=kvh.Scope(11, 12, 16)) == 48


def test_scope_value_of_a_salt():
    a, b = kvh.Scope.value_of("tenant-a"), kvh.Scope.value_of(b"tenant-a")
    assert a == b and a != 0 and 0 < a < 1 << 64
    assert kvh.Scope.value_of("tenant-b") != a
    assert a == 0x00CE35708214AFC6  # a fixed value: stores keep the hashes made with it
    with make_engine() as eng:
        with eng.sequence(scope=kvh.Scope.value_of("tenant-a")) as s:
            assert s.scope == kvh.Scope(a)


def test_scope_value_of_takes_text_or_bytes_only():
    assert kvh.Scope.value_of("user-1") == kvh.Scope.value_of(b"user-1")
    assert kvh.Scope.value_of(bytearray(b"x")) == kvh.Scope.value_of(b"x")
    for bad in (3, [1, 2], True, 1 << 63, None, 1.5):
        with pytest.raises(TypeError, match="str or bytes"):
            kvh.Scope.value_of(bad)


def test_a_block_view_shows_no_other_tenants_leftovers():
    # A slot is not cleared when a block takes it: a view of a block whose
    # cells were never written showed the freed block's KV of another
    # scope, and a fork then made a cell "written" with it.
    dim = 8
    eng = kvh.Engine(num_layers=1, num_kv_heads=1, head_dim=dim, block_tokens=4, dtype="f32", backend="cpu")
    with eng:
        for written_cell in (2, None):
            theirs = eng.sequence(scope=1)
            theirs.append([1, 2, 3, 4])
            k = np.full((4, 1, dim), 1234.5, np.float32)
            theirs.write_kv(0, 0, k, -k)
            theirs.free()
            ours = eng.sequence(scope=2)
            ours.append([7, 8, 9])
            if written_cell is not None:
                ours.write_kv(
                    0, written_cell, np.full((1, 1, dim), 5.0, np.float32), np.full((1, 1, dim), 6.0, np.float32)
                )
            view = ours.block_view(0, 0)
            others = [t for t in range(4) if t != written_cell]
            assert not np.any(view[:, :, others, :]), view[:, 0, :, 0]
            ours.fork().free()  # moves the viewed block to a copy
            if written_cell is None:
                kk, vv = ours.read_kv(0, 0, 1)  # the copy's one cell made written
                assert not np.any(kk) and not np.any(vv)
            else:
                kk, vv = ours.read_kv(0, written_cell, 1)
                assert np.all(kk == 5.0) and np.all(vv == 6.0)
            del view
            ours.free()


def _tiny_device_engine(dim: int, blocks: int) -> kvh.Engine:
    """f32, one layer and head, 4-token blocks, a device tier of `blocks`
    blocks and no host tier: a freed slot is the next one taken."""
    bt = 4
    return kvh.Engine(
        num_layers=1,
        num_kv_heads=1,
        head_dim=dim,
        block_tokens=bt,
        dtype="f32",
        backend="cpu",
        device_bytes=blocks * 2 * bt * dim * 4,
        host_bytes=0,
    )


@pytest.mark.parametrize("moved_by", ["write", "append"])
def test_a_view_keeps_its_slot_after_its_sequence_moves_to_a_copy(moved_by):
    # A read-only view (its block shared with a fork) kept only a hold on
    # its sequence's tokens. A write or an append into the shared block
    # moved the sequence, and the hold, to a copy; once the fork was freed
    # the view's slot went to the next block, another scope's KV included.
    dim = 4
    eng = _tiny_device_engine(dim, blocks=8)
    with eng:
        ours = eng.sequence(tokens=np.arange(6), scope=2)  # block 1 partial: never published
        kk = np.arange(6 * dim, dtype=np.float32).reshape(6, 1, dim)
        ours.write_kv(0, 0, kk, kk)
        child = ours.fork()
        view = ours.block_view(1, 0)  # shared: read-only
        assert not view.flags.writeable
        seen = view.copy()
        if moved_by == "write":
            ours.write_kv(0, 4, -kk[:1], -kk[:1])
        else:
            ours.append([6])
        assert ours.block_info(1).slot != child.block_info(1).slot  # the sequence moved to a copy
        child.free()
        theirs = []
        try:
            for _ in range(8):
                t = eng.sequence(tokens=np.arange(4), scope=1)
                theirs.append(t)
                t.write_kv(0, 0, np.full((4, 1, dim), 99, np.float32), np.full((4, 1, dim), 99, np.float32))
        except kvh.NoSpaceError:
            pass  # the view's block is kept: the tier fills sooner
        assert np.array_equal(view, seen), view[0, 0, :, 0]
        del view
        for t in theirs:
            t.free()


def test_a_new_block_at_a_viewed_index_shows_no_other_tenants_leftovers():
    # A live view of a block the sequence had left (kept across truncate)
    # made a view of the new block at the same index skip clearing its
    # never-written cells: it showed another scope's KV from the slot.
    dim = 4
    eng = _tiny_device_engine(dim, blocks=4)
    with eng:
        ours = eng.sequence(tokens=np.arange(4), scope=2)
        ours.write_kv(0, 0, np.ones((4, 1, dim), np.float32), np.ones((4, 1, dim), np.float32))
        old = ours.block_view(0, 0)
        ours.truncate(0)  # the view keeps the old block
        theirs = eng.sequence(tokens=np.arange(3) + 100, scope=9)  # partial: never published
        theirs.write_kv(0, 0, np.full((3, 1, dim), 999, np.float32), np.full((3, 1, dim), 999, np.float32))
        slot = theirs.block_info(0).slot
        theirs.free()
        ours.append(np.arange(4) + 50)  # a new block 0, nothing written
        assert ours.block_info(0).slot == slot  # the other scope's slot
        new = ours.block_view(0, 0)
        assert not np.any(new), new[:, 0, :, 0]
        assert np.all(old == 1)
        del old, new
