"""Hostile use of the Python binding: wrong types, huge lengths, objects used
after they ended, copies, threads and Ctrl-C. Every misuse must raise a
typed exception (kvh.Error, TypeError or ValueError), never crash, hang,
leak a native handle or change stored data. Cases that could kill the
interpreter run in a child process so a crash fails only their test."""

from __future__ import annotations

import copy
import gc
import pickle
import threading
import weakref

import numpy as np
import pytest

import kvh_cache as kvh
import kvh_cache.codec as kc
from kvh_cache.pool import Pool
from kvh_testutil import filled_seq, kv_data, make_engine, run_child

U64_MAX = (1 << 64) - 1
TYPED = (kvh.Error, TypeError, ValueError)


@pytest.fixture
def filled(engine):
    seq, data = filled_seq(engine, 40)
    yield seq, data
    seq.free()


def assert_intact(seq, data):
    for layer, (k, v) in data.items():
        k2, v2 = seq.read_kv(layer, 0, len(k))
        assert np.array_equal(k2, k) and np.array_equal(v2, v)


# ---- arguments ------------------------------------------------------------------


def test_positions_past_u64_reach_c_as_range_errors(filled):
    """Ints up to 2**64-1 pass the Python checks; first + n overflowing
    uint64 must be caught by the library, not wrap to a small range."""
    seq, data = filled
    k, v = data[0][0][:2], data[0][1][:2]
    calls = [
        lambda: seq.read_kv(0, U64_MAX, 2),
        lambda: seq.write_kv(0, U64_MAX, k, v),
        lambda: seq.tokens(U64_MAX, 0),
        lambda: seq.acquire(U64_MAX, 0),
        lambda: seq.acquire(1 << 63, 1 << 63),
        lambda: seq.pin(U64_MAX, 2),
        lambda: seq.migrate("host", U64_MAX, 1),
        lambda: seq.hint(U64_MAX, U64_MAX),
        lambda: seq.prefetch(1, U64_MAX),
        lambda: seq.truncate(U64_MAX),
        lambda: seq.blocks(U64_MAX, 1),
        lambda: seq.block(1 << 63),
        lambda: seq.read_kv(0, 100),  # past the end, n defaulted
    ]
    for call in calls:
        with pytest.raises(kvh.RangeError):
            call()
    with pytest.raises(ValueError, match="n_tokens"):
        seq.truncate(1 << 64)
    assert len(seq) == 40
    assert_intact(seq, data)


def test_huge_counts_never_reach_an_allocation_unchecked(filled):
    """A count past the sequence is refused as the library refuses it, and
    before an array of that size is made: 2**40 tokens raised NumPy's
    MemoryError (4 TiB), 2**62 its ValueError."""
    seq, data = filled
    for n in (41, 1 << 33, 1 << 40, 1 << 62):
        for call in (lambda: seq.tokens(0, n), lambda: seq.read_kv(0, 0, n), lambda: seq.read_kv(1, 39, n - 39)):
            with pytest.raises(kvh.RangeError, match="pass the sequence's 40 tokens"):
                call()
    assert len(seq.tokens(40, 0)) == 0 and len(seq.read_kv(0, 40, 0)[0]) == 0
    assert_intact(seq, data)


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.read_kv(0, range(0, 1 << 64)),
        lambda s: s.read_kv(0, range(1 << 64, (1 << 64) + 1)),
        lambda s: s.acquire(range(0, 1 << 65)),
        lambda s: s.blocks(0, 1 << 62),
    ],
    ids=["range-len-past-ssize_t", "range-start-past-u64", "acquire-range", "blocks-n-past-ssize_t"],
)
def test_huge_spans_raise_documented_errors(filled, call):
    with pytest.raises((kvh.RangeError, ValueError)):
        call(filled[0])


@pytest.mark.parametrize(
    "call,error",
    [
        (lambda e, s: e.hint_queued(s, position=True), TypeError),
        (lambda e, s: e.hint_queued(s, position=-1), ValueError),
        (lambda e, s: e.hint_queued(s, position=0, request=0), ValueError),
        (lambda e, s: e.hint_advance(-1), ValueError),
        (lambda e, s: e.hint_advance(1.0), TypeError),
        (lambda e, s: e.set_agent_quota(1 << 32, 0), ValueError),
        (lambda e, s: e.set_agent_quota(0, "1"), TypeError),
        (lambda e, s: e.admission(short_max_tokens=None), TypeError),
        (lambda e, s: e.prefix_hash(range(15)), ValueError),
        (lambda e, s: e.prefix_hash(range(16), parent=-1), ValueError),
        (lambda e, s: e.prefix_lookup(range(16), scope=-1), ValueError),
        (lambda e, s: e.prefix_lookup(np.zeros((2, 16), np.int32)), ValueError),
        (lambda e, s: e.migrate([s], "host"), TypeError),
        (lambda e, s: e.migrate(s.blocks(), "nowhere"), ValueError),
        (lambda e, s: e.block_table(s), TypeError),
        (lambda e, s: e.block_table([s, "x"]), TypeError),
        (lambda e, s: e.prefetch(s, priority=1 << 40), ValueError),
        (lambda e, s: e.sequence(token_budget=-1), ValueError),
        (lambda e, s: e.sequence(scope="a"), TypeError),
        (lambda e, s: e.context(b"x"), TypeError),
        (lambda e, s: e.context("x\0y"), ValueError),
        (lambda e, s: e.context("x", kv_policy="drop"), ValueError),
        (lambda e, s: e.attention_decode(0, [s], np.zeros((1, 2, 8), np.float32), scale=float("nan")), ValueError),
        (lambda e, s: e.attention_decode(0, [s], np.zeros((1, 2, 8), np.float32), threads=-1), ValueError),
        (lambda e, s: e.attention_decode(0, [s], np.zeros((1, 2, 8), np.float32), stream="x"), TypeError),
        (lambda e, s: e.attention_decode(0, [s], np.zeros((1, 2, 8), np.float32)[:, :, ::-1]), ValueError),
        (lambda e, s: e.attention_decode(0, [s], [[[0.0] * 8] * 2]), TypeError),
        (lambda e, s: e.attention_plan(0, [s], [1, 1]), ValueError),
        (lambda e, s: s.set_tolerance(-1), ValueError),
        (lambda e, s: s.set_scope(1, shared_tokens="x"), TypeError),
        (lambda e, s: s.fork(agent=1 << 32), ValueError),
        (lambda e, s: s.vmap(-1), ValueError),
        (lambda e, s: s.block_view(0, 0, hold="h"), TypeError),
        (lambda e, s: s.block_view(0, 5), kvh.RangeError),
        (lambda e, s: s.read_kv(0, range(5, 3)), ValueError),
        (lambda e, s: s.read_kv(0, range(-1, 3)), ValueError),
        (lambda e, s: s.read_kv(0, 0, 4, out=(np.zeros((4, 2, 8), np.float32), None)), TypeError),
        (lambda e, s: s.append(np.array(5)), ValueError),
        (lambda e, s: s.append([1 << 64]), TypeError),
        (lambda e, s: s.append([1 << 63]), ValueError),
        (lambda e, s: s.append(np.array([True])), TypeError),
        (lambda e, s: s.append(x for x in range(3)), TypeError),
        (lambda e, s: e.prefetch(s).result(float("nan")), ValueError),
    ],
)
def test_wrong_arguments_are_typed_errors(engine, filled, call, error):
    seq, data = filled
    with pytest.raises(error):
        call(engine, seq)
    assert len(seq) == 40
    assert_intact(seq, data)


def test_awkward_but_valid_buffers_keep_exact_bytes(engine):
    """Read-only inputs, unaligned copies and zero-length writes are fine;
    the bytes read back are the bytes written."""
    with engine.sequence(tokens=range(20)) as seq:
        k, v = kv_data(20, 2, 8, np.float32, seed=3)
        ro_k, ro_v = k.copy(), v.copy()
        ro_k.flags.writeable = False
        ro_v.flags.writeable = False
        seq.write_kv(0, 0, ro_k, ro_v)
        raw = np.zeros(k.nbytes + 1, np.uint8)  # an unaligned float32 array
        unaligned = raw[1:].view(np.float32).reshape(k.shape)
        unaligned[...] = k
        assert not unaligned.flags.aligned
        seq.write_kv(1, 0, unaligned, v)
        empty = np.zeros((0, 2, 8), np.float32)
        seq.write_kv(0, 20, empty, empty)
        out_raw = np.zeros(k.nbytes + 1, np.uint8)
        out_k = out_raw[1:].view(np.float32).reshape(k.shape)
        seq.read_kv(1, out=(out_k, np.empty_like(v)))
        assert np.array_equal(out_k, k)
        assert np.array_equal(seq.read_kv(0)[0], k) and np.array_equal(seq.read_kv(0)[1], v)
        assert seq.read_kv(0, 0, 0)[0].shape == (0, 2, 8)
        with pytest.raises(kvh.RangeError):
            seq.write_kv(0, 1000, empty, empty)


@pytest.mark.parametrize("tokens", [bytearray(b"ab"), memoryview(b"ab")], ids=["bytearray", "memoryview"])
def test_byte_buffers_are_not_token_ids(engine, tokens):
    with engine.sequence() as seq:
        with pytest.raises(TypeError):
            seq.append(tokens)
        assert len(seq) == 0


@pytest.mark.parametrize("bad", ["0.5", True])
def test_derive_tolerance_refuses_non_numbers(bad):
    with make_engine(kv_codec="int8", eviction_policy="lctru") as eng:
        seq, _ = filled_seq(eng, 32)
        with pytest.raises(TypeError):
            seq.derive_tolerance(max_rel_error=bad)


def test_fence_timeout_is_checked_once_done(filled, engine):
    fence = engine.prefetch(filled[0])
    assert fence.wait(10)
    with pytest.raises(TypeError):
        fence.wait("1")


def test_codec_refuses_bad_arrays():
    x = np.zeros((2, 64), np.float32)
    for bad in (np.zeros((2, 64), np.float64), np.zeros((2, 64), ">f4"), np.array([object()] * 64)):
        with pytest.raises(TypeError):
            kc.encode(bad, "int8")
    with pytest.raises(TypeError):
        kc.encode(x, True)
    with pytest.raises(ValueError):
        kc.encode(x, 99)
    with pytest.raises(kvh.InvalidArgumentError):
        kc.encode(np.zeros((3, 0), np.float32), "int8")
    with pytest.raises(kvh.InvalidArgumentError):
        kc.encode(np.zeros((2, 40), np.float32), "q4_g32")
    enc = kc.encode(x[:, ::-1], "int8")  # a reversed view is copied, not misread
    assert np.array_equal(kc.decode(enc, "int8", 64), x)
    assert kc.decode(np.zeros((0, 68), np.uint8), "int8", 64).shape == (0, 64)


@pytest.mark.parametrize("bad,error", [("64", TypeError), (64.9, TypeError), (-1, ValueError), (1 << 40, ValueError)])
def test_codec_head_dim_is_a_checked_int(bad, error):
    with pytest.raises(error):
        kc.vector_bytes("int8", "f32", bad)


def test_codec_refuses_a_scalar():
    with pytest.raises(ValueError):
        kc.encode(np.float32(1.0), "int8")


# ---- objects that ended ------------------------------------------------------------


def test_ended_objects_raise_and_end_once(engine, filled):
    seq, data = filled
    child = seq.fork()
    fence = engine.prefetch(child)
    fence.close()
    fence.close()
    with pytest.raises(kvh.BadHandleError):
        fence.done()
    with pytest.raises(kvh.BadHandleError):
        fence.result(1)
    hold = child.acquire(wait=False)
    blk = engine.block_alloc()
    blk.release()
    blk.release()
    with pytest.raises(kvh.BadHandleError):
        blk.info()
    with pytest.raises(kvh.BadHandleError):
        blk.retain()
    with pytest.raises(kvh.BadHandleError):
        engine.migrate([blk], "host")
    child.free()
    child.free()
    hold.release()  # after its sequence is gone: a no-op
    hold.release()
    assert hold.released
    for call in (lambda: child.set_scope(1), lambda: child.scope, lambda: child.vmap(0), lambda: child.hint()):
        with pytest.raises(kvh.BadHandleError):
            call()
    with pytest.raises(kvh.BadHandleError):
        with child:
            pass
    assert_intact(seq, data)


def test_ended_context_raises(engine):
    ctx = engine.context("c")
    ctx.add_region("r", data=np.arange(100, dtype=np.uint8))
    ctx.destroy()
    ctx.destroy()
    for call in (
        lambda: ctx.info(),
        lambda: ctx.switch_to(),
        lambda: ctx.region(0),
        lambda: ctx.add_region("x", data=b"1"),
        lambda: ctx.wait_layer(0, 0.1),
        lambda: engine.sequence(context=ctx),
    ):
        with pytest.raises(kvh.BadHandleError):
            call()


def test_with_refuses_a_destroyed_context(engine):
    ctx = engine.context("c")
    ctx.destroy()
    with pytest.raises(kvh.BadHandleError):
        with ctx:
            pass


def test_pool_misuse_after_unregister_and_close():
    eng = make_engine()
    ks = [np.zeros((4, 16, 2, 8), np.float32) for _ in range(2)]
    vs = [np.zeros((4, 16, 2, 8), np.float32) for _ in range(2)]
    pool = Pool.from_arrays(eng, ks, vs)
    with pytest.raises(TypeError):
        pool.restore(["x"], [0])
    with pytest.raises(TypeError):
        Pool.from_arrays(eng, ["a", "b"], ["c", "d"])
    with pytest.raises(ValueError):
        Pool.from_arrays(eng, [a[..., ::2] for a in ks], [a[..., ::2] for a in vs])
    pool.unregister()
    pool.unregister()
    with pytest.raises(kvh.BadHandleError):
        pool.offload([(0, 0, np.arange(16))])
    eng.close()
    pool.unregister()


def test_pool_is_unregistered_when_collected(engine):
    ks = [np.zeros((4, 16, 2, 8), np.float32) for _ in range(2)]
    vs = [np.zeros((4, 16, 2, 8), np.float32) for _ in range(2)]
    pool = Pool.from_arrays(engine, ks, vs)
    raw = kvh.ffi.new("kvh_pool *")
    raw[0] = pool._h
    ref = weakref.ref(pool)
    del pool
    gc.collect()
    assert ref() is None
    # A registration still alive answers OK; a freed one BadHandleError.
    with pytest.raises(kvh.BadHandleError):
        Pool(engine, raw[0], 4).unregister()


# ---- copies and pickling ---------------------------------------------------------


def test_native_objects_do_not_pickle(engine, filled):
    seq, _ = filled
    objs = [engine, seq, seq.blocks()[0], engine.prefetch(seq), engine.context("p"), seq.acquire()]
    for obj in objs:
        with pytest.raises(TypeError):
            pickle.dumps(obj)
        with pytest.raises(TypeError):
            copy.deepcopy(obj)
    err = pickle.loads(pickle.dumps(kvh.RangeError("detail")))
    assert type(err) is kvh.RangeError and err.status == -10 and err.message == "detail"


@pytest.mark.parametrize("kind", ["block", "vmap", "region"])
def test_owner_of_a_zero_copy_array_cannot_be_copied(kind):
    """A copy of the object behind a view's array would run its finaliser a
    second time: the engine or mapping would go while the array lives."""
    if kind == "block":
        eng = make_engine()
        seq, _ = filled_seq(eng, 32)
        arr = seq.block_view(0, 0)
    elif kind == "vmap":
        eng = make_engine(head_dim=64, vmap=True, host_bytes=0, device_bytes=64 * 2 * 2 * 2 * 16 * 64 * 4)
        seq, _ = filled_seq(eng, 32)
        seq.acquire()
        arr = seq.vmap(0).k
    else:
        eng = make_engine(device_bytes=128 * 4096, host_bytes=256 * 4096)
        ctx = eng.context("a")
        ctx.add_region("r", data=(np.arange(200000) % 251).astype(np.uint8))
        ctx.switch_to()
        arr = ctx.region(0)
    expect = np.array(arr)
    for dup in (copy.copy, copy.deepcopy):
        with pytest.raises(TypeError, match="cannot be copied"):
            dup(arr.base)
    gc.collect()
    assert np.array_equal(arr, expect)
    del arr
    eng.close()


@pytest.mark.parametrize("kind", ["engine", "sequence", "block"])
def test_a_dropped_shallow_copy_leaves_the_original_usable(kind):
    with make_engine() as eng:
        seq, data = filled_seq(eng, 20)
        obj = {"engine": eng, "sequence": seq, "block": eng.block_alloc()}[kind]
        try:
            dup = copy.copy(obj)
        except TypeError:
            return  # refusing the copy is fine too
        del dup
        gc.collect()
        assert_intact(seq, data)
        if kind == "block":
            obj.info()


# ---- zero-copy views -----------------------------------------------------------------


def test_block_view_outlives_engine_and_interpreter_exit():
    """The deferred close runs when the view goes, and at exit with the view
    still alive nothing crashes."""
    res = run_child(
        """
        import numpy as np
        from kvh_testutil import filled_seq, make_engine
        eng = make_engine(migration_threads=2)
        seq, data = filled_seq(eng, 40)
        view = seq.block_view(0, 0)
        other = seq.block_view(1, 1)
        seq.free()
        eng.close()
        assert np.array_equal(view[0], data[0][0][:16].transpose(1, 0, 2))
        assert np.array_equal(other[1], data[1][1][16:32].transpose(1, 0, 2))
        print("ok", flush=True)
        """
    )
    assert res.stdout.strip() == "ok"


def test_vmap_arrays_outlive_release_free_and_close():
    res = run_child(
        """
        import gc
        import numpy as np
        from kvh_testutil import filled_seq, make_engine
        eng = make_engine(head_dim=64, vmap=True, host_bytes=0, device_bytes=64 * 2 * 2 * 2 * 16 * 64 * 4)
        seq, data = filled_seq(eng, 40)
        seq.acquire()
        vm = seq.vmap(0)
        k = vm.k
        vm.release()
        vm.release()
        seq.free()
        eng.close()
        gc.collect()
        assert np.array_equal(k.transpose(1, 0, 2)[:40], data[0][0])
        try:
            vm.k
        except Exception as exc:
            print(type(exc).__name__)
        """
    )
    assert res.stdout.strip() in ("BadHandleError", "ClosedError")


@pytest.mark.parametrize("end", ["ctx.destroy()", "eng.close()"])
def test_region_view_read_after_its_context_ends(end):
    run_child(
        f"""
        import numpy as np
        from kvh_testutil import make_engine
        eng = make_engine(device_bytes=128 * 4096, host_bytes=256 * 4096)
        ctx = eng.context("a")
        data = (np.arange(200000) % 251).astype(np.uint8)
        ctx.add_region("r", data=data)
        ctx.switch_to()
        view = ctx.region(0)
        {end}
        # Either the view still holds the bytes or reading it raises; a
        # signal fails the test.
        assert np.array_equal(view, data)
        """
    )


# ---- threads and interrupts -----------------------------------------------------------


def test_close_while_threads_use_every_kind_of_object():
    """Threads appending, writing, reading, forking, taking views and
    waiting on fences while the main thread closes the engine: each sees
    its calls work or raise ClosedError/BadHandleError."""
    res = run_child(
        """
        import threading, time
        import numpy as np
        import kvh_cache as kvh
        from kvh_testutil import close_while_running, filled_seq, make_engine
        for rnd in range(4):
            eng = make_engine(migration_threads=2)
            seqs = [filled_seq(eng, 40, seed=i)[0] for i in range(3)]
            ctx = eng.context("c")
            ctx.add_region("r", data=np.arange(1000, dtype=np.uint8))
            bad, started = [], threading.Barrier(4)
            def work(s):
                k = np.ones((16, 2, 8), np.float32)
                started.wait()
                try:
                    while True:
                        s.append(range(16))
                        s.write_kv(0, len(s) - 16, k, k)
                        s.write_kv(1, len(s) - 16, k, k)
                        s.read_kv(1)
                        eng.prefetch(s).wait(1)
                        h = s.acquire(wait=False)
                        h.wait(1)
                        view = s.block_view(0, 0)
                        del view
                        h.release()
                        s.migrate("host", wait=False).wait(1)
                        s.fork().free()
                        s.truncate(16)
                        ctx.info()
                        eng.stats()
                except (kvh.ClosedError, kvh.BadHandleError):
                    return
                except BaseException as exc:
                    bad.append(repr(exc))
            threads = [threading.Thread(target=work, args=(s,)) for s in seqs]
            close_while_running(eng, threads, started, 0.1 + 0.05 * rnd)
            assert not bad, bad
        print("ok")
        """,
        timeout=90,
    )
    assert res.stdout.strip() == "ok"


def test_fence_waited_by_threads_while_closed_and_collected(engine, filled):
    seq, data = filled
    errors = []
    for _ in range(10):
        fence = seq.migrate("host", wait=False)

        def waiter(f=fence):
            try:
                f.wait(5)
                f.done()
            except kvh.BadHandleError:
                pass
            except BaseException as exc:
                errors.append(exc)

        ts = [threading.Thread(target=waiter) for _ in range(3)]
        for t in ts:
            t.start()
        fence.close()
        for t in ts:
            t.join(10)
        assert not any(t.is_alive() for t in ts)
        seq.migrate("device")
    assert not errors
    assert_intact(seq, data)


@pytest.mark.parametrize("target", ["eng", "seq"])
def test_ctrl_c_during_close_leaves_a_closable_object(target):
    """Ctrl-C while close() waits for a call in flight on another thread;
    afterwards close() must still end the object, from any thread."""
    res = run_child(
        f"""
        import _thread, signal, threading, time
        import kvh_cache as kvh
        import kvh_cache.engine as em
        from kvh_testutil import filled_seq, make_engine
        # A runner started in the background ignores SIGINT, and so would
        # the interrupt below: raise it as a terminal's Ctrl-C does.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        eng = make_engine()
        seq, _ = filled_seq(eng, 20)
        real, inside, go = em.lib, threading.Event(), threading.Event()

        class Slow:  # kvh_seq_length stays in flight until go is set
            def __getattr__(self, name):
                fn = getattr(real, name)
                if name != "kvh_seq_length":
                    return fn
                def slow(*args):
                    inside.set()
                    go.wait()
                    return fn(*args)
                return slow

        em.lib = Slow()
        user = threading.Thread(target=lambda: len(seq))
        user.start()
        inside.wait()
        em.lib = real
        threading.Timer(0.3, _thread.interrupt_main).start()
        try:
            {target}.close()
            raise SystemExit("close returned with a call in flight")
        except KeyboardInterrupt:
            pass
        go.set()
        user.join()
        closer = threading.Thread(target={target}.close, daemon=True)
        closer.start()
        closer.join(5)
        assert not closer.is_alive(), "close() from another thread hangs"
        if "{target}" == "seq":
            n = kvh.ffi.new("uint64_t *")
            st = real.kvh_seq_length(eng._native.ptr, seq._h[0], n)
            assert st == real.KVH_ERR_BAD_HANDLE, "the C sequence was never freed"
        else:
            assert eng._native.released, "the C engine was never closed"
        print("ok")
        """,
        timeout=30,
    )
    assert res.stdout.strip() == "ok"


def test_a_hold_cut_by_truncate_never_ends_a_later_hold():
    """The library names a hold by its token range: a Hold that outlived a
    truncation used to release, on that range, a hold taken after it."""
    with make_engine() as eng:
        seq = eng.sequence()
        seq.append(range(48))  # three blocks
        gone = seq.acquire(range(16, 48))  # blocks 1-2: given up below
        cut = seq.acquire(range(0, 32))  # blocks 0-1: block 0 is kept
        seq.truncate(16)
        assert gone.released and cut.range == range(0, 16)
        seq.append(range(100, 132))
        later = seq.acquire(range(16, 48))
        assert [seq.block_info(i).holds for i in range(3)] == [1, 1, 1]
        gone.release()
        cut.release()
        assert [seq.block_info(i).holds for i in range(3)] == [0, 1, 1]
        later.release()
        assert [seq.block_info(i).holds for i in range(3)] == [0, 0, 0]


# ---- a process forked with a live engine ----------------------------------------


def _run_forked(fn) -> int:
    """Runs fn in a fork()ed child; its exit status (1 for an exception),
    or fails the test when the child hangs."""
    import os
    import time

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            code = fn() or 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung")


def test_a_forked_child_gets_a_typed_error_and_closes_at_once():
    eng = kvh.Engine(
        num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=4, dtype="f32", backend="cpu",
        device_bytes=4 * 128, host_bytes=64 << 10, copy_moves=True, migration_threads=2,
    )  # fmt: skip
    seq = eng.sequence(tokens=range(64))
    one = np.ones((64, 1, 8), np.float32)
    seq.write_kv(0, 0, one, one)

    def use_then_close() -> int:
        try:
            seq.acquire(0, 64)
            return 2
        except kvh.UnsupportedError as err:
            if "fork" not in str(err):
                return 3
        eng.close()
        return 0

    assert _run_forked(use_then_close) == 0
    # the parent's engine is untouched
    k, v = seq.read_kv(0)
    assert np.all(k == 1.0) and np.all(v == 1.0)
    eng.close()


# Run in an interpreter of their own (pytest's exit hooks stay out of the
# children): fork_and_exit() forks a child that leaves through a normal
# interpreter exit (which closes live engines, atexit) and returns its
# exit code, or "hung" after timeout seconds.
_FORK_EXIT_PRELUDE = """
import os, sys, time
def fork_and_exit(timeout):
    pid = os.fork()
    if pid == 0:
        sys.exit(0)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return "hung"
"""


def _run_fork_script(body: str) -> str:
    """Runs the prelude and body in a new interpreter; its output."""
    import subprocess
    import sys
    import textwrap

    script = _FORK_EXIT_PRELUDE + textwrap.dedent(body)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_forked_child_exits_normally_with_the_engine_open():
    # In the child, the close at exit must return at once.
    out = _run_fork_script(
        """
        import kvh_cache as kvh
        eng = kvh.Engine(num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=4, dtype="f32",
                         backend="cpu", device_bytes=4 * 128, host_bytes=64 << 10, migration_threads=2)
        seq = eng.sequence(tokens=range(64))
        print("child", fork_and_exit(20))
        """
    )
    assert out == "child 0", out


def test_a_child_forked_during_another_threads_call_exits():
    # A thread of the parent is inside a call (its gates count it in
    # flight, their locks may be held) when the main thread forks: the
    # child's exit closes the engine all the same, at once.
    out = _run_fork_script(
        """
        import threading
        import numpy as np
        import kvh_cache as kvh
        eng = kvh.Engine(num_layers=2, num_kv_heads=2, head_dim=32, block_tokens=16, dtype="f32",
                         backend="cpu", device_bytes=16 << 20, host_bytes=0, migration_threads=1)
        seq = eng.sequence(tokens=range(2048))
        kv = np.ones((2048, 2, 32), np.float32)
        for layer in range(2):
            seq.write_kv(layer, 0, kv, kv)
        stop = False
        def reader():
            while not stop:
                seq.read_kv(0)
        t = threading.Thread(target=reader, daemon=True)
        t.start()
        time.sleep(0.1)
        codes = [fork_and_exit(10) for _ in range(6)]
        stop = True
        t.join()
        print(codes)
        """
    )
    assert out == "[0, 0, 0, 0, 0, 0]", out


def test_hold_covers_block_takes_block_indices_only(filled):
    # covers_block(0.0) was True and covers_block(0.5) False, where every
    # other index argument refuses floats and bools.
    seq, _ = filled
    hold = seq.acquire(0, 16)
    try:
        assert hold.covers_block(0) and not hold.covers_block(1)
        for bad, error in ((0.0, TypeError), (0.5, TypeError), (True, TypeError), (None, TypeError), (-1, ValueError)):
            with pytest.raises(error):
                hold.covers_block(bad)
    finally:
        hold.release()
