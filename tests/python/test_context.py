"""kvh.Context (weight contexts) and token-budget admission from Python."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import kvh_cache as kvh
from kvh_testutil import run_child


@pytest.fixture
def weights(tmp_path):
    """Two weight files of pseudo-random bytes, 4 layers of 3000 bytes."""
    rng = np.random.default_rng(7)
    files = []
    for i in range(2):
        data = rng.integers(0, 256, 4 * 3000, dtype=np.uint8)
        p = tmp_path / f"w{i}.bin"
        p.write_bytes(data.tobytes())
        files.append((p, data))
    return files


def make_engine(**kw):
    # 2 layers x 2 heads x 8 dim x 16 tokens x f32 x K,V = 4096-byte blocks
    args = dict(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        block_tokens=16,
        dtype="f32",
        device_bytes=8 * 4096,
        host_bytes=64 * 4096,
        backend="cpu",
    )
    args.update(kw)
    return kvh.Engine(**args)


def register(ctx, path):
    for layer in range(4):
        ctx.add_region(f"w{layer}", path=path, offset=layer * 3000, size=3000, layer=layer)


def test_switch_round_trip(weights):
    (pa, da), (pb, db) = weights
    with make_engine() as eng:
        a = eng.context("a", kv_policy="demote", chunk_bytes=1024)
        b = eng.context("b")
        register(a, pa)
        register(b, pb)
        extra = np.arange(500, dtype=np.uint8)
        idx = a.add_region("extra", data=extra)
        assert idx == 4
        seq = eng.sequence(context=a)
        seq.append(range(32))
        k = np.random.default_rng(1).standard_normal((32, 2, 8)).astype(np.float32)
        seq.write_kv(0, 0, k, k)
        a.switch_to()
        assert eng.current_context is a
        for i in range(4):
            assert np.array_equal(a.region(i), da[i * 3000 : (i + 1) * 3000])
        assert np.array_equal(a.region("extra"), extra)
        for _ in range(3):
            fence = b.switch_to(wait=False)
            b.wait_layer(0)
            assert np.array_equal(b.region(0), db[:3000])
            fence.result()
            a.switch_to()
            assert a.verify() >= 5
        k2, _ = seq.read_kv(0)
        assert np.array_equal(k2, k)
        info = a.info()
        assert info.regions == 5 and info.bytes_device == info.weight_bytes and info.seqs == 1
        ws = eng.weight_stats()
        assert ws.switches == 7 and ws.unified_memory
        assert ws.bytes_device_to_host == 0  # clean weights are never written
        assert eng.tier_info("device").used_blocks >= ws.slots_device > 0
        a.unload()
        assert a.info().bytes_device == 0
        with pytest.raises(kvh.NotResidentError):
            a.region(0)
        a.destroy()
        a.destroy()  # idempotent
        with pytest.raises(kvh.BadHandleError):
            a.info()


def test_modified_region_survives(weights):
    (pa, da), (pb, _) = weights
    with make_engine() as eng:
        a, b = eng.context("a"), eng.context("b")
        register(a, pa)
        register(b, pb)
        a.switch_to()
        view = a.region(1, writable=True)
        view[:10] = 42
        b.switch_to()
        a.switch_to()
        got = a.region(1)
        assert (got[:10] == 42).all() and np.array_equal(got[10:], da[3010:6000])


def test_region_view_keeps_its_region_until_collected(weights):
    """A view's region stays in the device tier while the view (or an array
    made from it) lives, and leaves at the first switch after it is gone;
    a view outlives its context's destroy and the engine's close."""
    (pa, da), (pb, db) = weights
    eng = make_engine()
    a, b = eng.context("a"), eng.context("b")
    register(a, pa)
    register(b, pb)
    a.switch_to()
    part = a.region(1)[100:200]  # a derived array keeps the view's base
    b.switch_to()
    assert a.info().bytes_device == 3000  # region 1 only: the others left
    assert np.array_equal(part, da[3100:3200])
    a.switch_to()
    del part
    b.switch_to()
    assert a.info().bytes_device == 0
    a.switch_to()
    a.pin(2)
    view = a.region(2)
    a.pin(2, False)  # the view still pins it
    b.switch_to()
    assert a.info().bytes_device == 3000
    del view
    a.switch_to()
    b.switch_to()
    assert a.info().bytes_device == 0
    a.switch_to()
    view = a.region(3)
    a.destroy()
    eng.close()
    assert np.array_equal(view, da[9000:12000])  # memory kept until collected
    del view


def test_modified_region_spills_to_disk(weights, tmp_path):
    (pa, da), (pb, db) = weights
    # No host tier: a modified region that leaves the device has nowhere
    # to go but the disk tier.
    with make_engine(host_bytes=0, disk_path=str(tmp_path / "store"), disk_bytes=1 << 20) as eng:
        a, b = eng.context("a"), eng.context("b")
        register(a, pa)
        register(b, pb)
        a.switch_to()
        view = a.region(1, writable=True)
        view[:10] = 42
        del view  # a live view would keep the region pinned in the device tier
        b.switch_to()
        assert np.array_equal(b.region(3), db[9000:12000])
        assert a.info().bytes_disk == 3000
        ws = eng.weight_stats()
        assert ws.bytes_disk == 3000 and ws.bytes_host_to_disk == 3000 and ws.slots_disk == 1
        a.switch_to()
        got = a.region(1)
        assert (got[:10] == 42).all() and np.array_equal(got[10:], da[3010:6000])
        ws = eng.weight_stats()
        assert ws.bytes_disk_to_host == 3000 and ws.bytes_disk == 0 and a.info().bytes_disk == 0


def test_errors(weights, tmp_path):
    (pa, _), _ = weights
    with make_engine() as eng:
        a = eng.context("a")
        with pytest.raises(ValueError):
            a.add_region("x", path=pa, data=b"12")
        with pytest.raises(ValueError):
            eng.context(kv_policy="sometimes")
        with pytest.raises(kvh.KvhIOError):
            a.add_region("x", path=tmp_path / "missing.bin", size=10)
        with pytest.raises(kvh.KvhIOError):
            a.add_region("x", path=pa, offset=11990, size=100)
        with pytest.raises(kvh.NoSpaceError):
            a.add_region("big", data=np.zeros(1 << 20, np.uint8))  # larger than the host tier
        register(a, pa)
        with pytest.raises(kvh.NotResidentError):
            a.wait_layer(0, timeout=0)


def test_argument_checks_name_the_argument(weights):
    """Context arguments used to be read with int()/str methods: a float
    layer or index was truncated (layer=1.5 registered layer 1), a string
    one parsed, a negative offset, size or layer raised a bare
    OverflowError, a None name or seq an AttributeError, a NUL in a name
    cut it short in C, and a NaN or infinite timeout a conversion error."""
    (pa, _), _ = weights
    with make_engine() as eng:
        a = eng.context("a")
        for kw, error in (
            (dict(layer=1.5), TypeError),
            (dict(layer="1"), TypeError),
            (dict(layer=-1), ValueError),
            (dict(layer=1 << 32), ValueError),
            (dict(offset=-1), ValueError),
            (dict(offset=2.0), TypeError),
            (dict(size=-3), ValueError),
            (dict(size=1 << 70), ValueError),
        ):
            (name,) = kw
            args = dict(path=pa, size=10)
            args.update(kw)
            with pytest.raises(error, match=name):
                a.add_region("x", **args)
        with pytest.raises(TypeError, match="name"):
            a.add_region(5, data=b"12")
        with pytest.raises(ValueError, match="name"):
            a.add_region("a\0b", data=b"12")
        with pytest.raises(TypeError, match="name"):
            eng.context(None)
        with pytest.raises(ValueError, match="name"):
            eng.context("a\0b")
        with pytest.raises(ValueError, match="kv_policy"):
            eng.context("p", kv_policy=["keep"])  # was "unhashable type: 'list'"
        with pytest.raises(TypeError, match="data"):
            a.add_region("o", data=np.array([object()], dtype=object))  # was NumPy's own message
        assert a.regions == []
        register(a, pa)
        for bad, error in ((-1, ValueError), (1.5, TypeError), ("0", TypeError)):
            with pytest.raises(error, match="index"):
                a.region_pointer(bad)
            with pytest.raises(error, match="index"):
                a.pin(bad)
            with pytest.raises(error, match="layer"):
                a.wait_layer(bad, timeout=0)
        for bad, error in ((float("nan"), ValueError), ("1", TypeError), (True, TypeError)):
            with pytest.raises(error, match="timeout"):
                a.wait_layer(0, timeout=bad)
        with pytest.raises(TypeError, match="seq"):
            a.attach(None)
        with pytest.raises(TypeError, match="previous"):
            a.switch_to("b")
        with make_engine() as other:
            with pytest.raises(ValueError, match="another engine"):
                a.switch_to(other.context("o"))
        a.switch_to()
        a.wait_layer(3, timeout=float("inf"))  # no limit, like None
        a.wait_layer(3, timeout=1 << 70)
        assert a.info().bytes_device == 4 * 3000


def test_changed_file_is_corrupt(weights):
    (pa, da), (pb, _) = weights
    with make_engine(host_bytes=4096) as eng:  # no room to keep clean weights
        a, b = eng.context("a"), eng.context("b")
        register(a, pa)
        register(b, pb)
        a.switch_to()
        b.switch_to()
        raw = bytearray(pa.read_bytes())
        raw[100] ^= 1
        pa.write_bytes(bytes(raw))
        with pytest.raises(kvh.CorruptionError):
            a.switch_to()
        assert eng.weight_stats().crc_failures == 1


def test_admission_pools():
    with make_engine(device_bytes=16 * 4096) as eng:
        eng.admission(short_max_tokens=64, short_device_bytes=4 * 4096, long_device_bytes=8 * 4096)
        shorts = [eng.sequence(token_budget=32) for _ in range(2)]  # 2 blocks each
        with pytest.raises(kvh.NoSpaceError):
            eng.sequence(token_budget=16)
        long_ = eng.sequence(token_budget=128)  # the long pool is separate
        info = eng.admission_info()
        assert info.enabled and info.short_reserved_blocks == 4 and info.long_reserved_blocks == 8
        assert info.short_rejected == 1
        shorts[0].free()
        eng.sequence(token_budget=16)
        long_.free()
        assert eng.admission_info().long_reserved_blocks == 0
        with pytest.raises(kvh.InvalidArgumentError):
            eng.admission(short_device_bytes=16 * 4096, long_device_bytes=4096)


# Read by their truth, "no" or "false" would pin, mark a region written or
# wait: on/off arguments take a bool or 0/1 only, and a refusal names the
# argument and changes nothing.
BAD_FLAGS = [("no", TypeError), ("", TypeError), (0.0, TypeError), (None, TypeError), (2, ValueError), (-1, ValueError)]


@pytest.mark.parametrize("value,error", BAD_FLAGS)
def test_flag_arguments_refuse_non_bools(weights, value, error):
    (pa, _), _ = weights
    with make_engine() as eng:
        a = eng.context("a")
        with pytest.raises(error, match="pinned"):
            a.add_region("x", path=pa, size=3000, pinned=value)
        assert a.regions == []
        register(a, pa)
        with pytest.raises(error, match="pinned"):
            a.pin(0, value)
        a.switch_to()
        with pytest.raises(error, match="writable"):
            a.region_pointer(0, writable=value)
        with pytest.raises(error, match="writable"):
            a.region(0, writable=value)
        with pytest.raises(error, match="wait"):
            a.unload(wait=value)
        assert eng.current_context is a
        with pytest.raises(error, match="wait"):
            eng.context("b").switch_to(wait=value)
        assert eng.current_context is a
        with pytest.raises(TypeError, match="pinned"):
            a.add_gguf(pa, pinned="output.weight")


@pytest.mark.parametrize("on,off", [(True, False), (1, 0), (np.bool_(True), np.bool_(False))])
def test_flag_arguments_take_bools_and_0_1(weights, on, off):
    (pa, da), _ = weights
    with make_engine() as eng:
        a = eng.context("a")
        register(a, pa)
        a.add_region("p", data=np.arange(10, dtype=np.uint8), pinned=on)
        a.pin(0, on)
        a.pin(0, off)
        a.switch_to(wait=on)
        assert not a.region(1, writable=off).flags.writeable
        assert a.region(1, writable=on).flags.writeable
        assert a.region_pointer(0, writable=off)[1] == 3000
        fence = a.unload(wait=off)
        fence.wait()
        assert eng.current_context is None


def test_an_engine_with_a_context_switched_in_closes_when_dropped(weights, tmp_path):
    """The engine referred to the context switched in and the context to
    its engine: an engine its caller dropped stayed open, with its
    threads and its store's lock, until the cycle collector ran."""
    (pa, _), _ = weights
    store = dict(disk_path=str(tmp_path / "store"), disk_bytes=1 << 20, migration_threads=1)
    gc.disable()
    try:
        eng = make_engine(**store)
        ctx = eng.context("a")
        register(ctx, pa)
        ctx.switch_to()
        assert eng.current_context is ctx
        gone = weakref.ref(eng)
        del eng, ctx
        assert gone() is None
        make_engine(**store).close()  # the store's lock was given back
    finally:
        gc.enable()


def test_current_context_is_none_once_the_program_drops_it(weights):
    (pa, _), _ = weights
    with make_engine() as eng:
        ctx = eng.context("a")
        register(ctx, pa)
        ctx.switch_to()
        del ctx
        gc.collect()
        assert eng.current_context is None
        b = eng.context("b")
        b.switch_to()  # from the context the program dropped
        assert eng.current_context is b


def test_unknown_region_name_raises_a_typed_key_error(weights):
    """An unknown region name used to raise a bare KeyError(name)."""
    import pickle

    (pa, _), _ = weights
    with make_engine() as eng:
        a = eng.context("a")
        with pytest.raises(kvh.KvhKeyError, match="no regions"):
            a.region_index("w0")
        register(a, pa)
        a.switch_to()
        for lookup in (a.region_index, a.region):
            with pytest.raises(kvh.KvhKeyError, match="'nope'.*'w0', 'w1', 'w2', 'w3'") as info:
                lookup("nope")
            exc = info.value
            assert isinstance(exc, KeyError) and isinstance(exc, kvh.InvalidArgumentError)
            assert exc.name == "KVH_ERR_INVALID_ARG" and str(exc).startswith("KVH_ERR_INVALID_ARG: context 'a'")
        again = pickle.loads(pickle.dumps(exc))
        assert type(again) is kvh.KvhKeyError and again.message == exc.message
        assert kvh.KvhKeyError("x").status == kvh.InvalidArgumentError("x").status
        assert a.region_index("w2") == 2 and a.region("w1").size == 3000
        many = eng.context("many")
        for i in range(12):
            many.add_region(f"r{i}", data=b"x" * 16)
        with pytest.raises(KeyError, match="'r7' and 4 more"):
            many.region_index("r12")


def test_a_context_of_another_engine_is_refused(weights):
    """Like a sequence or block of another engine: a ValueError before any
    C call (it used to reach C, where its handle is another engine's)."""
    with make_engine() as eng, make_engine() as other:
        eng.context("mine")  # a context of eng whose handle the other's may repeat
        theirs = other.context("theirs")
        with pytest.raises(ValueError, match="another engine"):
            eng.sequence(context=theirs)
        with pytest.raises(ValueError, match="another engine"):
            eng.sequence(context=theirs, token_budget=16)
        with pytest.raises(ValueError, match="another engine"):
            eng.context("a").switch_to(theirs)
        with other.sequence(context=theirs) as seq:
            assert not seq.freed


def test_a_child_forked_while_a_thread_pins_gets_unsupported_not_a_hang():
    # The context's locks, held by another thread at the fork, stayed
    # held in the child: its pin, region and unload waited for ever.
    res = run_child(
        """
        import os, threading, time
        import numpy as np
        import kvh_cache as kvh

        eng = kvh.Engine(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=16, dtype="f32",
                         backend="cpu", device_bytes=1 << 22, host_bytes=1 << 20)
        ctx = eng.context("c")
        idx = ctx.add_region("w", data=np.arange(8192, dtype=np.uint8))
        ctx.switch_to()
        stop = []
        def pin_loop():
            i = 0
            while not stop:
                ctx.pin(idx, i % 2 == 0)
                i += 1
        t = threading.Thread(target=pin_loop, daemon=True)
        t.start()
        time.sleep(0.1)
        outcomes = []
        for _ in range(10):
            pid = os.fork()
            if pid == 0:
                signal_alarm = __import__("signal")
                signal_alarm.alarm(5)  # a hang ends the child with SIGALRM
                try:
                    ctx.pin(idx, True)
                    os._exit(1)
                except kvh.UnsupportedError:
                    os._exit(0)
            outcomes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        stop.append(1)
        t.join()
        print(outcomes)
        """,
        timeout=120,
    )
    assert res.stdout.strip() == str([0] * 10), res.stdout + res.stderr


def test_demote_without_a_host_tier_and_its_warning(tmp_path, caplog):
    """KV of a demoting context went nowhere without a host tier (it now
    goes to disk); what stays is counted once however many attached
    sequences share it (a fork's blocks were counted twice)."""
    eng = kvh.Engine(
        num_layers=1,
        num_kv_heads=1,
        head_dim=16,
        block_tokens=16,
        dtype="f32",
        device_bytes=1 << 20,
        host_bytes=0,
        disk_path=str(tmp_path / "store"),
        disk_bytes=16 << 20,
    )
    with eng:
        a = eng.context("a", kv_policy="demote")
        b = eng.context("b", kv_policy="demote")
        a.switch_to()
        s1 = eng.sequence()
        s1.append(np.arange(40))
        k = np.ones((40, 1, 16), np.float32)
        s1.write_kv(0, 0, k, k)
        s2 = s1.fork()
        a.attach(s1)
        a.attach(s2)
        s1.pin(0, 16)  # block 0, shared with the fork, cannot leave
        with caplog.at_level("WARNING", logger="kvh"):
            b.switch_to(a)
        assert [s1.block_info(i).tier for i in range(3)] == [kvh.Tier.DEVICE, kvh.Tier.DISK, kvh.Tier.DISK]
        said = [r.getMessage() for r in caplog.records if "stay in the device tier" in r.getMessage()]
        assert len(said) == 1 and "1 KV blocks stay" in said[0], said
        s1.unpin(0, 16)


def test_unnamed_contexts_are_told_apart_in_messages():
    with kvh.Engine(num_layers=1, num_kv_heads=1, head_dim=16, block_tokens=16, dtype="f32") as eng:
        x, y = eng.context(""), eng.context("")
        assert repr(x) != repr(y) and "''" not in repr(x), (repr(x), repr(y))
        x.destroy()
        with pytest.raises(kvh.BadHandleError) as info:
            x.info()
        assert "''" not in str(info.value) and "0x" in str(info.value), str(info.value)
