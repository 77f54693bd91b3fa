"""Lifetime of the handle classes (kvh_cache._handle): each native object is
ended exactly once, whether by a ``with`` block, by ``close()`` (called
twice), or by the garbage collector, and a context (which the engine frees
at close) is never ended by the collector."""

from __future__ import annotations

import collections
import gc
import os
import signal
import sys
import time

import pytest
from kvh_testutil import run_child

import kvh_cache as kvh
from kvh_cache import attention_plan as attention_plan_mod
from kvh_cache import context as context_mod
from kvh_cache import engine as engine_mod
from kvh_cache import vmap as vmap_mod


class CountingLib:
    """Stands in for the CFFI lib in one module, counting calls of names."""

    def __init__(self, real, calls, names):
        self._real, self._calls, self._names = real, calls, names

    def __getattr__(self, name):
        attr = getattr(self._real, name)
        if name not in self._names:
            return attr

        def counted(*args):
            self._calls[name] += 1
            return attr(*args)

        return counted


ENDS = {
    "kvh_engine_close",
    "kvh_seq_free",
    "kvh_fence_free",
    "kvh_block_release",
    "kvh_seq_release",
    "kvh_vmap_release",
    "kvh_attention_plan_destroy",
    "kvh_context_destroy",
}


@pytest.fixture
def calls(monkeypatch):
    counts = collections.Counter()
    for mod in (engine_mod, vmap_mod, attention_plan_mod, context_mod):
        monkeypatch.setattr(mod, "lib", CountingLib(mod.lib, counts, ENDS))
    return counts


def make_engine():
    return kvh.Engine(
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
        block_tokens=16,
        dtype="f32",
        backend="cpu",
        device_bytes=64 * 2 * 2 * 2 * 16 * 64 * 4,
        host_bytes=0,
        vmap=True,
        migration_threads=0,
    )


@pytest.fixture
def eng():
    with make_engine() as e:
        yield e


@pytest.fixture
def seq(eng):
    s = eng.sequence(tokens=range(40))
    yield s
    s.free()


# name -> (factory(engine, sequence), the call that ends it)
HANDLES = {
    "Sequence": (lambda e, s: e.sequence(tokens=range(20)), "kvh_seq_free"),
    "Fence": (lambda e, s: s.prefetch(), "kvh_fence_free"),
    "Block": (lambda e, s: e.block_alloc(), "kvh_block_release"),
    "Hold": (lambda e, s: s.acquire(), "kvh_seq_release"),
    "VMap": (lambda e, s: s.vmap(1), "kvh_vmap_release"),
    "AttentionPlan": (lambda e, s: e.attention_plan(0, [s]), "kvh_attention_plan_destroy"),
    "Context": (lambda e, s: e.context("weights"), "kvh_context_destroy"),
}


@pytest.mark.parametrize("name", sorted(HANDLES))
def test_with_block_ends_once(name, eng, seq, calls):
    factory, end = HANDLES[name]
    with factory(eng, seq) as h:
        assert calls[end] == 0
    assert calls[end] == 1
    h.close()
    del h
    gc.collect()
    assert calls[end] == 1


@pytest.mark.parametrize("name", sorted(HANDLES))
def test_close_ends_once(name, eng, seq, calls):
    factory, end = HANDLES[name]
    h = factory(eng, seq)
    h.close()
    h.close()
    assert calls[end] == 1
    del h
    gc.collect()
    assert calls[end] == 1


@pytest.mark.parametrize("name", sorted(HANDLES))
def test_garbage_collection_ends_once(name, eng, seq, calls):
    factory, end = HANDLES[name]
    h = factory(eng, seq)
    assert isinstance(h, kvh._handle.Closable)
    del h
    gc.collect()
    # A context lives until it is destroyed or the engine closes.
    assert calls[end] == (0 if name == "Context" else 1)


def test_engine_ends_once(calls):
    with make_engine() as e:
        pass
    e.close()
    assert calls["kvh_engine_close"] == 1
    e2 = make_engine()
    e2.close()
    e2.close()
    assert calls["kvh_engine_close"] == 2
    e3 = make_engine()
    del e, e2, e3
    gc.collect()
    assert calls["kvh_engine_close"] == 3


def test_gc_after_engine_close_is_quiet(calls):
    """Handles outliving their engine end nothing and raise nothing."""
    e = make_engine()
    s = e.sequence(tokens=range(20))
    handles = [s, s.prefetch(), e.block_alloc(), s.acquire(), e.context("w")]
    e.close()
    before = dict(calls)
    del handles, s
    gc.collect()
    assert dict(calls) == before


def test_with_refuses_an_ended_handle(eng):
    """``with`` on a freed sequence or a closed engine raises (the classes'
    _check_usable), on a live one it gives the object itself."""
    s = eng.sequence(tokens=range(20))
    with s as same:
        assert same is s
    with pytest.raises(kvh.BadHandleError):
        with s:
            pass
    e = make_engine()
    live = e.sequence(tokens=range(20))
    e.close()
    with pytest.raises(kvh.ClosedError):
        with e:
            pass
    with pytest.raises(kvh.ClosedError):  # a sequence not freed, of a closed engine
        with live:
            pass


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_finalizer_lets_nothing_escape():
    ended = []

    class Failing(kvh._handle.Finalized):
        def _close_at_gc(self):
            ended.append(1)
            raise RuntimeError("nothing may escape a finaliser")

    f = Failing()
    del f
    gc.collect()
    assert ended == [1]


def test_ctrl_c_in_a_finalizer_finishes_the_close_and_is_sent_again():
    # The interpreter drops what a __del__ raises: a Ctrl-C landing in a
    # handle's close at collection was lost (the program ran on) and the
    # close left half done.
    res = run_child(
        """
        import gc, signal, time
        import kvh_cache as kvh

        # Python's own Ctrl-C, also where the test runner ignores SIGINT.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        ended = []

        class Interrupted(kvh._handle.Finalized):
            def _close_at_gc(self):
                ended.append(1)
                if len(ended) == 1:
                    raise KeyboardInterrupt

        try:
            f = Interrupted()
            del f
            gc.collect()
            deadline = time.monotonic() + 10  # sent again a moment later, from a thread
            while time.monotonic() < deadline:
                time.sleep(0.001)
            print("ran on", ended)
        except KeyboardInterrupt:
            print("interrupted", ended)
        """
    )
    assert res.stdout.strip() == "interrupted [1, 1]", res.stdout + res.stderr
    assert "Exception ignored" not in res.stderr, res.stderr


@pytest.mark.parametrize("kind", ["block view", "region view", "vmap"])
def test_a_view_whose_finalizer_never_ran_does_not_keep_the_engine(kind, tmp_path, monkeypatch):
    """A Ctrl-C pending as a finaliser begins is raised before its first
    line: the view's drop was skipped, its count stayed, and the engine's
    close waited for it for good (the store stayed locked). A view whose
    owner is gone counts as dropped, before the close and after it."""
    from kvh_testutil import make_engine as make_disk_engine

    skipped = {"block view": engine_mod._ViewOwner, "region view": context_mod._RegionView, "vmap": vmap_mod.VMap}
    store = str(tmp_path / "store")
    for collected_after_close in (False, True):
        vmap_geometry = {"vmap": True, "head_dim": 64, "device_bytes": 16 << 20} if kind == "vmap" else {}
        e = make_disk_engine(disk_path=store, disk_bytes=4 << 20, **vmap_geometry)
        s = e.sequence(tokens=range(40))
        if kind == "block view":
            view = s.block_view(0, 0)
        elif kind == "region view":
            ctx = e.context("weights")
            ctx.add_region("w", data=b"w" * 4096)
            ctx.switch_to()
            view = ctx.region(0)
        else:
            view = s.vmap(1)
        with monkeypatch.context() as m:
            m.setattr(skipped[kind], "_close_at_gc", lambda self: None)
            if not collected_after_close:
                del view
                gc.collect()
            e.close()
            if collected_after_close:
                assert not e._native.released  # a live view keeps the memory
                del view
                gc.collect()
                engine_mod._close_all_at_exit()  # what the end of the process runs
        assert e._native.released, (kind, collected_after_close)
        make_disk_engine(disk_path=store, disk_bytes=4 << 20, **vmap_geometry).close()  # not BusyError


def test_a_signal_handlers_exception_in_a_finalizer_reaches_the_hook(monkeypatch):
    # SystemExit from a SIGTERM handler, say: the close is finished and
    # the application's sys.unraisablehook sees the exception.
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(type(u.exc_value)))
    ended = []

    class Exiting(kvh._handle.Finalized):
        def _close_at_gc(self):
            ended.append(1)
            if len(ended) == 1:
                raise SystemExit(143)

    f = Exiting()
    del f
    gc.collect()
    assert ended == [1, 1] and seen == [SystemExit]


class _Item:
    pass


def test_weak_bag_holds_the_live_ones_only():
    bag = kvh._handle.WeakBag()
    items = [_Item() for _ in range(100)]
    for it in items:
        bag.add(it)
    del items[::2]  # dead ones are pruned as the bag grows
    for _ in range(100):
        bag.add(_Item())  # each dies at once
    assert sorted(map(id, bag.live())) == sorted(map(id, items))
    bag.discard(items[0])
    bag.discard(_Item())  # not in the bag: nothing happens
    assert len(bag.live()) == 49 and items[0] not in bag.live()


def test_a_weak_bag_called_inside_its_own_call_neither_waits_nor_loses():
    """A signal handler calling into a bag while its thread was inside
    another call of it (Sequence.truncate's views during acquire's new
    hold) waited for that thread, itself, for good."""
    bag = kvh._handle.WeakBag()
    kept, gone, new = _Item(), _Item(), _Item()
    bag.add(kept)
    bag.add(gone)
    assert bag._enter()  # as the interrupted outer call
    try:
        bag.add(new)  # the handler's calls
        bag.discard(gone)
        assert sorted(map(id, bag.live())) == sorted(map(id, [kept, new]))
    finally:
        bag._lock.release()
    assert sorted(map(id, bag.live())) == sorted(map(id, [kept, new]))
    bag.discard(new)
    assert bag.live() == [kept]


def test_a_ctrl_c_while_a_weak_bag_applies_its_queue_leaves_it_usable():
    """A Ctrl-C raised while queued changes were applied left the bag's
    lock taken: another thread's live() then waited for good."""
    import threading

    bag = kvh._handle.WeakBag()
    kept, new = _Item(), _Item()
    bag.add(kept)
    assert bag._enter()
    bag.add(new)  # queued: inside the call above
    bag._lock.release()

    class Interrupting(list):
        def __getitem__(self, i):
            raise KeyboardInterrupt

    queued, bag._queued = bag._queued, Interrupting(bag._queued)
    with pytest.raises(KeyboardInterrupt):
        bag.live()
    bag._queued = queued
    seen = []
    t = threading.Thread(target=lambda: seen.append(bag.live()))
    t.start()
    t.join(5)
    assert not t.is_alive(), "another thread's live() waits for a lock left taken"
    assert sorted(map(id, seen[0])) == sorted(map(id, [kept, new]))


def test_a_signal_handler_truncating_during_acquire_does_not_hang():
    run_child(
        """
        import signal, time
        import numpy as np
        import kvh_cache as kvh

        eng = kvh.Engine(num_layers=1, num_kv_heads=1, head_dim=16, block_tokens=16, dtype="f32",
                         device_bytes=1 << 20, host_bytes=1 << 20)
        seq = eng.sequence()
        seq.append(np.arange(64))
        fired = [0]

        def handler(signum, frame):
            fired[0] += 1
            seq.truncate(64)

        signal.signal(signal.SIGALRM, handler)
        end, n = time.monotonic() + 3, 0
        while time.monotonic() < end:
            before = fired[0]
            signal.setitimer(signal.ITIMER_REAL, 0.0002 + (n % 50) * 0.00002)
            while fired[0] == before:
                seq.acquire(0, 16).release()
                n += 1
        signal.setitimer(signal.ITIMER_REAL, 0)
        assert fired[0] > 100, fired
        assert seq.length == 64
        eng.close()
        """,
        timeout=60,
    )


def test_weak_bag_runs_no_python_code_when_an_item_dies():
    # A Ctrl-C met in such code would be dropped by the interpreter.
    bag = kvh._handle.WeakBag()
    it = _Item()
    bag.add(it)
    called = []
    sys.setprofile(lambda frame, event, arg: called.append(frame.f_code.co_name) if event == "call" else None)
    try:
        del it
    finally:
        sys.setprofile(None)
    assert [c for c in called if c != "<lambda>"] == [] and bag.live() == []


def test_a_finalizers_ctrl_c_under_the_applications_handler_goes_to_the_hook():
    # An application's own SIGINT handler counts presses: sending the
    # signal again would call it a second time for one Ctrl-C. The
    # exception goes to sys.unraisablehook instead, the close finished.
    res = run_child(
        """
        import gc, signal, sys, time
        import kvh_cache as kvh

        calls, seen, ended = [], [], []

        def handler(signum, frame):
            calls.append(signum)
            raise KeyboardInterrupt

        signal.signal(signal.SIGINT, handler)
        sys.unraisablehook = lambda u: seen.append(type(u.exc_value).__name__)

        class Interrupted(kvh._handle.Finalized):
            def _close_at_gc(self):
                ended.append(1)
                if len(ended) == 1:
                    raise KeyboardInterrupt

        f = Interrupted()
        del f
        gc.collect()
        time.sleep(0.2)
        print(len(calls), ended, seen)
        """
    )
    assert res.stdout.strip() == "0 [1, 1] ['KeyboardInterrupt']", res.stdout + res.stderr


def test_engines_open_at_exit_are_closed_through_a_ctrl_c():
    res = run_child(
        """
        import kvh_cache as kvh
        from kvh_cache import engine as engine_mod
        from kvh_testutil import make_engine

        engines = [make_engine() for _ in range(3)]
        real_close = kvh.Engine.close
        interrupted = []

        def close(self):
            if not interrupted:
                interrupted.append(self)
                raise KeyboardInterrupt
            real_close(self)

        kvh.Engine.close = close
        engine_mod._close_all_at_exit()
        print([e.closed for e in engines])
        """
    )
    assert res.stdout.strip() == "[True, True, True]", res.stdout + res.stderr


def test_a_weak_bag_locked_by_another_thread_at_fork_is_free_in_the_child():
    bag = kvh._handle.WeakBag()
    item = _Item()
    bag._lock.acquire()  # as another thread inside add() when the fork came
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                bag.add(item)
                os._exit(0 if bag.live() == [item] else 1)
            finally:
                os._exit(2)
        deadline = time.monotonic() + 10
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        if not done:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        assert done and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, "the child waited on the parent's lock"
    finally:
        bag._lock.release()
