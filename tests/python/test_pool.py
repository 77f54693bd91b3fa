"""kvh.pool: external pools described from NumPy arrays, torch-like
tensors and DLPack producers without copying; batched offload and
restore (per-layer fences, statuses), persist, and misuse."""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest

import kvh_cache as kvh
from kvh_cache.pool import Pool, describe, persist_blocks
from kvh_testutil import make_engine, run_child

L, H, D, BT, S = 2, 2, 8, 4, 8


def _engine(tmp_path=None, **kw):
    fields = dict(
        num_layers=L,
        num_kv_heads=H,
        head_dim=D,
        block_tokens=BT,
        dtype="f16",
        device_bytes=4 << 20,
        host_bytes=4 << 20,
    )
    if tmp_path is not None:
        fields.update(disk_path=str(tmp_path / "store"), disk_bytes=8 << 20)
    fields.update(kw)
    return kvh.Engine(**fields)


def _arrays(seed=1):
    rng = np.random.default_rng(seed)
    ks = [rng.random((S, BT, H, D)).astype(np.float16) for _ in range(L)]
    vs = [rng.random((S, BT, H, D)).astype(np.float16) for _ in range(L)]
    return ks, vs


def _items(eng, slots, tag=0, scope=0):
    parent, items = 0, []
    for i, slot in enumerate(slots):
        tk = np.arange(BT, dtype=np.int32) + 1000 * tag + i * BT
        items.append((slot, parent, tk))
        parent = eng.prefix_hash(tk, parent, scope=scope)
    return items


def _same(ks, vs, a, b):
    return all((ks[layer][a] == ks[layer][b]).all() and (vs[layer][a] == vs[layer][b]).all() for layer in range(L))


class TorchLike:
    """What kvh reads of a torch tensor: data_ptr, stride (elements),
    element_size, shape, device."""

    class _Dev:
        type = "cpu"

    def __init__(self, a: np.ndarray):
        self._a = a
        self.shape = a.shape
        self.device = self._Dev()

    def data_ptr(self):
        return self._a.__array_interface__["data"][0]

    def stride(self):
        return tuple(s // self._a.itemsize for s in self._a.strides)

    def element_size(self):
        return self._a.itemsize


class DLPackOnly:
    def __init__(self, a: np.ndarray):
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


@pytest.mark.parametrize("wrap", [lambda a: a, TorchLike, DLPackOnly], ids=["numpy", "torch-like", "dlpack"])
def test_describe_agrees_with_numpy(wrap):
    a = np.zeros((S, H, BT, D), np.float16)[:, :, ::2]  # strided, not contiguous
    d = describe(wrap(a))
    assert d.ptr == a.__array_interface__["data"][0]
    assert d.shape == a.shape and d.strides == a.strides and d.itemsize == 2 and d.host


def test_describe_refuses_other_objects():
    with pytest.raises(TypeError):
        describe([1, 2, 3])


@pytest.mark.parametrize("wrap", [lambda a: a, TorchLike, DLPackOnly], ids=["numpy", "torch-like", "dlpack"])
@pytest.mark.parametrize("threads", [0, 2])
def test_offload_restore_round_trip(wrap, threads):
    ks, vs = _arrays()
    with _engine(migration_threads=threads) as eng:
        pool = Pool.from_arrays(eng, [wrap(a) for a in ks], [wrap(a) for a in vs])
        batch = pool.offload(_items(eng, [0, 1, 2]))
        assert batch.wait(10)
        assert batch.statuses() == [0, 0, 0]
        assert all(b.info().published for b in batch.blocks)
        for slot in (5, 6, 7):
            for layer in range(L):
                ks[layer][slot] = 0
                vs[layer][slot] = 0
        load = pool.restore(batch.blocks, [5, 6, 7])
        for layer in range(L):
            assert load.wait_layer(layer, 10)
            assert all((ks[layer][i] == ks[layer][5 + i]).all() for i in range(3))
        assert load.wait(10) and load.failed() == []
        assert all(_same(ks, vs, i, 5 + i) for i in range(3))
        batch.release()
        pool.unregister()
        pool.unregister()  # idempotent


def test_restore_some_layers_only():
    ks, vs = _arrays(2)
    with _engine() as eng:
        pool = Pool.from_arrays(eng, ks, vs)
        batch = pool.offload(_items(eng, [0]))
        batch.wait()
        for layer in range(L):
            ks[layer][4] = 0
        pool.restore(batch.blocks, [4], first_layer=1, n_layers=1).wait()
        assert (ks[1][4] == ks[1][0]).all() and not (ks[0][4] == ks[0][0]).all()


def test_heads_first_layout():
    rng = np.random.default_rng(3)
    ks = [rng.random((S, H, BT, D)).astype(np.float16) for _ in range(L)]
    vs = [rng.random((S, H, BT, D)).astype(np.float16) for _ in range(L)]
    with _engine() as eng:
        pool = Pool.from_arrays(eng, ks, vs, heads_first=True)
        b = pool.offload(_items(eng, [1]))
        b.wait()
        pool.restore(b.blocks, [3]).wait()
        assert _same(ks, vs, 1, 3)


def test_misuse_raises_typed_errors_and_changes_nothing():
    ks, vs = _arrays()
    with _engine() as eng:
        pool = Pool.from_arrays(eng, ks, vs)
        before = eng.stats().blocks_allocated
        with pytest.raises(kvh.InvalidArgumentError):
            pool.offload(_items(eng, [1, 1]))  # a slot twice
        with pytest.raises(kvh.RangeError):
            pool.offload(_items(eng, [S]))
        with pytest.raises(ValueError):
            pool.offload([(0, 0, np.arange(BT - 1))])
        with pytest.raises(kvh.InvalidArgumentError):
            pool.offload(_items(eng, list(range(S)) * 2))
        assert eng.stats().blocks_allocated == before
        b = pool.offload(_items(eng, [0]))
        b.wait()
        with pytest.raises(kvh.RangeError):
            pool.restore(b.blocks, [1], first_layer=L, n_layers=1)
        with pytest.raises(kvh.InvalidArgumentError):
            pool.restore(b.blocks, [1], n_layers=0)
        with pytest.raises(ValueError):
            pool.restore(b.blocks, [1, 2])
        with pytest.raises(kvh.UnsupportedError):
            persist_blocks(eng, b.blocks)  # no disk tier
        with pytest.raises(ValueError):
            Pool.from_arrays(eng, ks[:1], vs[:1])
        with pytest.raises(ValueError):
            Pool.from_arrays(eng, [a.astype(np.float32) for a in ks], [a.astype(np.float32) for a in vs])
        b.release()
        pool.unregister()
        with pytest.raises(kvh.BadHandleError):
            pool.offload(_items(eng, [0]))


def test_arguments_are_checked_and_named():
    """Pool arguments went through int() or straight into cffi: slot=1.5
    or "1" was used as slot 1, tokens of floats or past int32 were cast
    (the block stored under the hash of other tokens), a negative value
    raised a bare OverflowError, and wait_layer(first_layer - 1) waited
    for the last layer (a negative list index) and returned True."""
    ks, vs = _arrays()
    with _engine() as eng:
        pool = Pool.from_arrays(eng, ks, vs)
        tk = np.arange(BT)
        bad_numbers = ((1.5, TypeError), ("1", TypeError), (None, TypeError), (-1, ValueError), (1 << 70, ValueError))
        for bad, error in bad_numbers:
            with pytest.raises(error, match="slot"):
                pool.offload([(bad, 0, tk)])
            with pytest.raises(error, match="parent_hash"):
                pool.offload([(0, bad, tk)])
            with pytest.raises(error, match="scope"):
                pool.offload([(0, 0, tk)], scope=bad)
            with pytest.raises(error, match="agent"):
                pool.offload([(0, 0, tk)], agent=bad)
        with pytest.raises(TypeError, match="tokens"):
            pool.offload([(0, 0, tk + 0.5)])
        with pytest.raises(ValueError, match="int32"):
            pool.offload([(0, 0, tk + (1 << 40))])
        with pytest.raises(TypeError, match="items"):
            pool.offload([(0, 0)])
        assert eng.stats().blocks_allocated == 0
        off = pool.offload(_items(eng, [0]))
        off.wait()
        for bad, error in ((1.5, TypeError), ("1", TypeError), (-1, ValueError)):
            with pytest.raises(error, match="slots"):
                pool.restore(off.blocks, [bad])
            with pytest.raises(error, match="first_layer"):
                pool.restore(off.blocks, [1], first_layer=bad)
            with pytest.raises(error, match="n_layers"):
                pool.restore(off.blocks, [1], n_layers=bad)
        batch = pool.restore(off.blocks, [1], first_layer=1, n_layers=1)
        for bad in (0, 2):
            with pytest.raises(ValueError, match="layer"):
                batch.wait_layer(bad)
        assert batch.wait_layer(1) and batch.failed() == []
        with pytest.raises(ValueError, match="2 K and V arrays"):
            Pool.from_arrays(eng, [], [])
        with pytest.raises(ValueError, match="strides"):
            Pool.from_arrays(eng, [a[::-1] for a in ks], [a[::-1] for a in vs])
        with pytest.raises(ValueError, match="num_slots"):
            Pool.from_pointers(eng, [0] * L, [0] * L, -1, 1, 1, 1)
        off.release()
        pool.unregister()


def test_read_only_arrays_make_an_offload_only_pool(tmp_path):
    """A restore into read-only arrays (a memory map opened with mode="r")
    used to kill the interpreter with SIGSEGV on kvh's migration worker."""
    ks, vs = _arrays(5)
    path = tmp_path / "kv.bin"
    layer_bytes = ks[0].nbytes
    with open(path, "wb") as f:
        for a in ks + vs:
            f.write(a.tobytes())
    mapped = [
        np.memmap(path, dtype=np.float16, mode="r", shape=ks[0].shape, offset=i * layer_bytes) for i in range(2 * L)
    ]
    assert not describe(mapped[0]).writable and describe(ks[0]).writable
    with _engine() as eng:
        src = Pool.from_arrays(eng, mapped[:L], mapped[L:])
        assert not src.writable
        off = src.offload(_items(eng, [0, 1]))  # reading them is fine
        off.wait()
        assert off.statuses() == [0, 0]
        with pytest.raises(ValueError, match="read-only"):
            src.restore(off.blocks, [2, 3])
        dst = Pool.from_arrays(eng, ks, vs)
        assert dst.writable
        dst.restore(off.blocks, [4, 5]).wait()
        assert all((ks[layer][4] == mapped[layer][0]).all() for layer in range(L))
        off.release()


def test_unregister_after_the_engine_closed_is_a_no_op():
    """Pool.unregister() (and so ``with pool:``) after the engine's close
    used to raise ClosedError, unlike every other close."""
    ks, vs = _arrays()
    eng = _engine()
    with Pool.from_arrays(eng, ks, vs) as pool:
        off = pool.offload(_items(eng, [0]))
        off.wait()
        eng.close()
        off.release()
    pool.unregister()
    with pytest.raises(kvh.ClosedError):
        pool.offload(_items(eng, [1]))


def test_dropped_batches_are_safe():
    """A batch object dropped before its fence completes: kvh still writes
    its statuses into memory that is kept alive for it."""
    ks, vs = _arrays(4)
    with _engine(migration_threads=1) as eng:
        pool = Pool.from_arrays(eng, ks, vs)
        for tag in range(20):
            pool.offload(_items(eng, [0, 1, 2, 3], tag=tag))
            gc.collect()
        pool.unregister()


@pytest.mark.parametrize("wait", [True, False], ids=["waited", "dropped-unseen"])
def test_an_engine_dropped_after_transfers_is_collected(wait):
    """Batches kept for kvh's writes must not keep their engine (and its
    worker threads) once they have ended, seen or not."""
    import time
    import weakref

    def run():
        ks, vs = _arrays(5)
        eng = _engine(migration_threads=2)
        pool = Pool.from_arrays(eng, ks, vs)
        b = pool.offload(_items(eng, [0, 1]))
        r = pool.restore(b.blocks[:1], [2]) if wait and b.wait() else None
        if r is not None:
            assert r.wait()
        if wait:
            b.release()
        pool.unregister()
        return weakref.ref(eng)

    refs = [run() for _ in range(3)]
    deadline = time.monotonic() + 10
    while any(r() is not None for r in refs) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert all(r() is None for r in refs)


_DROP_ENGINE_SCRIPT = """
import gc, sys
import numpy as np
import kvh_cache as kvh
from kvh_cache.pool import Pool

cfg = dict(num_layers=8, num_kv_heads=8, head_dim=128, block_tokens=16, dtype="f16", backend="cpu",
           device_bytes=256 << 20, host_bytes=64 << 20, disk_bytes=64 << 20, migration_threads=1)
gc.disable()  # a program that allocates little: no collection but the one below
k = [np.ones((256, 16, 8, 128), np.float16) for _ in range(8)]
running = 0
for i in range(4):
    cfg["disk_path"] = f"{sys.argv[1]}/store-{i}"
    e = kvh.Engine(**cfg)
    pool = Pool.from_arrays(e, k, k)
    batch = pool.offload([(s, s, np.arange(16) + i) for s in range(256)])
    running += not batch.fence.done()
    del e, pool, batch
    gc.collect()
    kvh.Engine(**cfg).close()  # BusyError while the dropped engine is still open
print("ok", running)
"""


def test_an_engine_dropped_with_a_batch_running_goes_at_the_next_collection(tmp_path):
    """Batches in flight were held by a module-level table that kept their
    engine: one dropped while its offload ran stayed open, its store
    locked, until a collection after the batch had ended (with automatic
    collection off, for good): the reopen said the store was open in this
    very process."""
    import subprocess
    import sys

    script = tmp_path / "drop_engine.py"
    script.write_text(_DROP_ENGINE_SCRIPT)
    r = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("ok"), (r.returncode, r.stderr[-2000:])
    if r.stdout.split()[1] == "0":
        pytest.skip("every batch ended before its engine was dropped: nothing was in flight")


_DROP_POOL_SCRIPT = """
import gc
import numpy as np
import kvh_cache as kvh
from kvh_cache.pool import Pool

L, H, D, BT, S = 2, 8, 128, 64, 32
def arrays(seed):
    rng = np.random.default_rng(seed)
    return ([rng.random((S, BT, H, D)).astype(np.float16) for _ in range(L)],
            [rng.random((S, BT, H, D)).astype(np.float16) for _ in range(L)])
eng = kvh.Engine(backend="cpu", num_layers=L, num_kv_heads=H, head_dim=D, block_tokens=BT, dtype="f16",
                 device_bytes=64 << 20, host_bytes=64 << 20, migration_threads=1)
ks, vs = arrays(1)
src = Pool.from_arrays(eng, ks, vs)
items, parent = [], 0
for i in range(S):
    tk = np.arange(BT, dtype=np.int32) + i * BT
    items.append((i, parent, tk))
    parent = eng.prefix_hash(tk, parent)
off = src.offload(items)
off.wait()
# The worker has work queued (each restore into pools of its own: two may not write one slot).
busy = [Pool.from_arrays(eng, *arrays(10 + k)).restore(off.blocks, list(range(S))) for k in range(6)]
dk, dv = arrays(2)
dst = Pool.from_arrays(eng, dk, dv)
into_dst = dst.restore(off.blocks, list(range(S)))
gathering = Pool.from_arrays(eng, *arrays(3)).offload(items, scope=1)
del dst, dk, dv
gc.collect()
into_dst.wait()
gathering.wait()
assert not into_dst.failed() and gathering.statuses() == [0] * S
for b in busy:
    b.wait()
print("ok")
"""


def test_batch_keeps_its_pool_memory(tmp_path):
    """A batch in flight keeps the pool's arrays alive: with the Pool object
    and the arrays dropped, a restore used to write into freed memory (with
    every large allocation unmapped on free, the interpreter died of
    SIGSEGV) and an offload to read from it."""
    import os
    import subprocess
    import sys

    script = tmp_path / "drop_pool.py"
    script.write_text(_DROP_POOL_SCRIPT)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")  # freed arrays are unmapped
    for _ in range(2):
        r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])


def test_persist_and_reload_after_reopen(tmp_path):
    ks, vs = _arrays(5)
    items = None
    with _engine(tmp_path) as eng:
        pool = Pool.from_arrays(eng, ks, vs)
        items = _items(eng, [0, 1, 2], scope=9)
        b = pool.offload(items, scope=9)
        fence = persist_blocks(eng, b.blocks, wait=False)  # waits for the gathers itself
        fence.result(30)
        assert eng.stats().blocks_persisted == 3
        b.release()
        pool.unregister()
    with _engine(tmp_path) as eng:
        pool = Pool.from_arrays(eng, ks, vs)
        found = eng.prefix_lookup(np.concatenate([t for _, _, t in items]), scope=9)
        assert len(found) == 3
        assert all(f.info().tier == kvh.Tier.DISK for f in found)
        for layer in range(L):
            ks[layer][5:8] = 0
            vs[layer][5:8] = 0
        load = pool.restore(found, [5, 6, 7])
        load.wait(30)
        assert load.failed() == []
        assert all(_same(ks, vs, i, 5 + i) for i in range(3))
        pool.unregister()


@pytest.mark.parametrize("bad,error", [("no", TypeError), (None, TypeError), (2, ValueError)])
def test_persist_blocks_wait_takes_a_bool(tmp_path, bad, error):
    """wait="no" used to persist in the call and return None, not a Fence."""
    ks, vs = _arrays(5)
    with _engine(tmp_path) as eng:
        pool = Pool.from_arrays(eng, ks, vs)
        b = pool.offload(_items(eng, [0, 1]))
        b.wait()
        with pytest.raises(error, match="wait"):
            persist_blocks(eng, b.blocks, wait=bad)
        assert eng.stats().blocks_persisted == 0
        persist_blocks(eng, b.blocks, wait=0).result(30)
        assert eng.stats().blocks_persisted == 2
        b.release()
        pool.unregister()


@pytest.mark.parametrize("value", ["False", "no", [0], 1, None])
def test_heads_first_must_be_a_bool(value):
    """Read by truth, "False" would be on: the layout transposed silently."""
    ks, vs = _arrays(6)
    with _engine() as eng:
        with pytest.raises(TypeError, match="heads_first must be a bool"):
            Pool.from_arrays(eng, ks, vs, heads_first=value)


class _TorchDType:
    """str() of a torch dtype: "torch.float16"."""

    def __init__(self, name: str):
        self._name = name

    def __str__(self):
        return f"torch.{self._name}"


class TorchLikeTyped(TorchLike):
    """A torch-like tensor that also names its dtype (real tensors do)."""

    def __init__(self, a: np.ndarray, dtype_name=None):
        super().__init__(a)
        self.dtype = _TorchDType(dtype_name or a.dtype.name)


_WRAPS = [lambda a: a, TorchLikeTyped, DLPackOnly]
_WRAP_IDS = ["numpy", "torch-like", "dlpack"]


@pytest.mark.parametrize("wrap", _WRAPS, ids=_WRAP_IDS)
@pytest.mark.parametrize(
    "engine_dtype,wrong",
    [
        ("f16", np.int16),
        ("f16", np.uint16),
        ("f16", np.float32),
        ("bf16", np.float16),
        ("bf16", np.int16),
        ("f32", np.int32),
        ("f32", np.uint32),
    ],
)
def test_from_arrays_refuses_another_dtype(engine_dtype, wrong, wrap):
    """Only the element size used to be checked: int16 arrays were taken as
    f16 K/V, float16 as bf16, int32 as f32."""
    with _engine(dtype=engine_dtype) as eng:
        arrays = [np.zeros((S, BT, H, D), wrong) for _ in range(2 * L)]
        with pytest.raises(TypeError) as info:
            Pool.from_arrays(eng, [wrap(a) for a in arrays[:L]], [wrap(a) for a in arrays[L:]])
        message = str(info.value)
        assert np.dtype(wrong).name in message and engine_dtype in message
        assert isinstance(info.value, ValueError)  # what a wrong element size raised before
        # One layer of the wrong dtype among good ones is refused too.
        good = [np.zeros((S, BT, H, D), eng.np_dtype) for _ in range(2 * L)]
        with pytest.raises(TypeError):
            Pool.from_arrays(eng, good[:L], [wrap(good[L]), wrap(arrays[0])])


@pytest.mark.parametrize(
    "engine_dtype,make",
    [
        ("f32", lambda a: a.astype(np.float32)),
        ("f16", lambda a: a.astype(np.float16)),
        ("bf16", lambda a: a.astype(np.uint16)),  # the binding's bf16 arrays: bit patterns
        ("bf16", lambda a: TorchLikeTyped(a.astype(np.uint16), "bfloat16")),
        ("bf16", lambda a: DLPackOnly(a.astype(np.uint16))),
        ("f16", lambda a: TorchLike(a.astype(np.float16))),  # no dtype given: the element size decides
    ],
    ids=["f32", "f16", "bf16-bits", "bf16-torch", "bf16-dlpack", "f16-untyped"],
)
def test_from_arrays_takes_the_engine_dtype(engine_dtype, make):
    with _engine(dtype=engine_dtype) as eng:
        arrays = [make(np.zeros((S, BT, H, D))) for _ in range(2 * L)]
        pool = Pool.from_arrays(eng, arrays[:L], arrays[L:])
        batch = pool.offload(_items(eng, [0]))
        assert batch.wait(10) and batch.statuses() == [0]
        batch.release()
        pool.unregister()


def test_describe_names_the_element_type():
    a = np.zeros((2, 3), np.int16)
    assert describe(a).dtype == describe(DLPackOnly(a)).dtype == describe(TorchLikeTyped(a)).dtype == "int16"
    assert describe(TorchLike(a)).dtype is None
    assert describe(np.zeros(4, "V2")).dtype is None


def test_a_fence_callback_that_offloads_again_does_not_deadlock():
    # The bookkeeping of batches in flight looked at their fences under
    # its lock, and a fence seen done ran its callbacks there: one that
    # offloaded again waited on that lock in its own thread.
    res = run_child(
        """
        import numpy as np
        import kvh_cache as kvh
        from kvh_cache.pool import Pool

        eng = kvh.Engine(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=16, dtype="f32",
                         backend="cpu", device_bytes=4096 * 1024, host_bytes=4096 * 1024, migration_threads=1)
        ks = [np.zeros((8, 16, 2, 8), np.float32) for _ in range(2)]
        pool = Pool.from_arrays(eng, ks, ks)
        n = [0]
        def items():
            n[0] += 1
            return [(i, 0, np.arange(16, dtype=np.int32) + 16 * i + 1000 * n[0]) for i in range(8)]
        again = []
        def offload_again(fence):
            again.append(1)
            pool.offload(items()).release()
        for _ in range(300):
            b = pool.offload(items())
            b.fence.add_done_callback(offload_again)
            b.release()
        print("done", len(again) > 0)
        """,
        timeout=120,
    )
    assert res.stdout.strip() == "done True", res.stdout + res.stderr


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_batches_refuse_copies_and_pickling(how):
    import copy
    import pickle

    with make_engine() as eng:
        ks = [np.zeros((4, eng.block_tokens, eng.num_kv_heads, eng.head_dim), np.float32) for _ in range(2)]
        pool = Pool.from_arrays(eng, ks, ks)
        batch = pool.offload([(0, 0, np.arange(eng.block_tokens, dtype=np.int32))])
        try:
            act = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": pickle.dumps}[how]
            with pytest.raises(TypeError, match="OffloadBatch"):
                act(batch)
        finally:
            batch.release()
        pool.close()


def test_restore_wait_shares_one_timeout_among_its_layers():
    # Each layer's fence was given the whole timeout again: a batch of 8
    # layers, each finishing just in time, took 8 timeouts.
    from kvh_cache.pool import RestoreBatch

    class StandIn:
        def __init__(self, given):
            self.given = given

        def wait(self, timeout):
            self.given.append(timeout)
            time.sleep(0.01)
            return True

    given = []
    batch = RestoreBatch(None, 0, [StandIn(given) for _ in range(8)], 0, None)
    assert batch.wait(0.2)
    assert all(later < earlier for earlier, later in zip(given, given[1:])), given
    assert given[-1] <= 0.2 - 0.07, given
    given.clear()
    assert batch.wait(None) and given == [None] * 8
    with pytest.raises(ValueError):
        batch.wait(float("nan"))
    with pytest.raises(TypeError):
        batch.wait("1")
