"""Concurrency through the API: prefetch hints from some threads while others
read and write, fences as futures, asyncio, and several threads on one
object (serialised per handle, never a crash)."""

from __future__ import annotations

import _thread
import asyncio
import collections
import contextlib
import concurrent.futures as cf
import ctypes
import gc
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import kvh_cache as kvh
from kvh_cache import engine as engine_mod
from kvh_cache._handle import HandleGate
from kvh_testutil import filled_seq, kv_data

HERE = Path(__file__).resolve().parent


def test_prefetch_threads_while_others_read():
    # Small device tier so hints really move blocks while readers run.
    with kvh.Engine(
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        block_tokens=16,
        dtype="f16",
        backend="cpu",
        device_bytes=24 * 4096,
        host_bytes=256 * 4096,
        migration_threads=2,
    ) as eng:
        data = [filled_seq(eng, 48, seed=i, first_token=1000 * i) for i in range(12)]
        seqs = [s for s, _ in data]
        stop = threading.Event()
        failures = []
        counts = {"reads": 0, "hints": 0}
        lock = threading.Lock()

        def reader(idx):
            rng = random.Random(idx)
            mine = [i for i in range(len(seqs)) if i % 3 == idx]
            try:
                while not stop.is_set():
                    i = rng.choice(mine)
                    layer = rng.randrange(2)
                    with seqs[i].acquire():
                        k, v = seqs[i].read_kv(layer)
                    if not (np.array_equal(k, data[i][1][layer][0]) and np.array_equal(v, data[i][1][layer][1])):
                        failures.append(f"seq {i} layer {layer}: wrong data")
                        return
                    with lock:
                        counts["reads"] += 1
            except Exception as exc:
                failures.append(repr(exc))

        def hinter(idx):
            rng = random.Random(100 + idx)
            try:
                while not stop.is_set():
                    f = eng.prefetch(seqs[rng.randrange(len(seqs))], priority=rng.randrange(10))
                    if rng.random() < 0.3:
                        f.wait(1.0)
                    f.close()
                    with lock:
                        counts["hints"] += 1
            except Exception as exc:
                failures.append(repr(exc))

        def watcher():
            while not stop.is_set():
                st = eng.stats()
                assert st.lookups >= 0
                eng.tiers()
                time.sleep(0.001)

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(3)]
        threads += [threading.Thread(target=hinter, args=(i,)) for i in range(3)]
        threads.append(threading.Thread(target=watcher))
        for t in threads:
            t.start()
        time.sleep(1.5)
        stop.set()
        for t in threads:
            t.join(30)
        assert not failures, failures[:3]
        assert counts["reads"] > 10 and counts["hints"] > 10
        st = eng.stats()
        assert st.prefetch_issued + st.prefetch_skipped > 0
        assert st.blocks_host_to_device + st.blocks_moved_in_place > 0


def test_fence_is_future_like(engine):
    seq, _ = filled_seq(engine, 48)
    with seq:
        seq.migrate("host")
        f = engine.prefetch(seq, range(0, 48), priority=5)
        assert isinstance(f, kvh.Fence)
        assert f.wait(10) and f.done()
        assert f.result() is None and f.exception() is None
        assert "ok" in repr(f)
        called = []
        f.add_done_callback(called.append)  # already done: called now
        assert called == [f]
        f2 = seq.migrate("host", wait=False)
        ev = threading.Event()
        f2.add_done_callback(lambda fut: ev.set())
        assert ev.wait(10)
        # a callback that is not callable is refused at once, done or not
        # (a pending fence only logged the TypeError once it ended)
        for fence in (f, seq.migrate("host", wait=False)):
            with pytest.raises(TypeError, match="callable"):
                fence.add_done_callback(42)
        # concurrent.futures interop: a fence can be waited from an executor
        with cf.ThreadPoolExecutor(2) as ex:
            futs = [ex.submit(engine.prefetch(seq).result, 10) for _ in range(4)]
            assert [x.result() for x in futs] == [None] * 4
        with engine.prefetch(seq) as f3:
            f3.wait()


def test_fence_await(engine):
    seq, _ = filled_seq(engine, 32)

    async def main():
        seq.migrate("host")
        await engine.prefetch(seq)
        await asyncio.gather(*(engine.prefetch(seq) for _ in range(3)))

    with seq:
        asyncio.run(main())


def test_many_threads_own_sequences():
    with kvh.Engine(
        num_layers=1, num_kv_heads=2, head_dim=8, dtype="f32", backend="cpu", device_bytes=16 * 1024, host_bytes=1 << 22
    ) as eng:
        errors = []

        def work(i):
            try:
                with eng.sequence(agent=i) as s:
                    for step in range(20):
                        first = len(s)
                        s.append(np.arange(first, first + 5) + 10000 * i)
                        k, v = kv_data(5, 2, 8, np.float32, seed=i * 1000 + step)
                        s.write_kv(0, first, k, v)
                        rk, rv = s.read_kv(0, first, 5)
                        assert np.array_equal(rk, k) and np.array_equal(rv, v)
                        if step % 5 == 4:
                            with s.fork() as c:
                                c.write_kv(0, first, v, k)
                                assert np.array_equal(s.read_kv(0, first, 5)[0], k)
            except Exception as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[:3]


# ---- several threads on one object ------------------------------------------------


@pytest.mark.parametrize(
    "scenario, rounds",
    [("one_sequence", 5), ("free_while_used", 150), ("close_while_used", 40), ("end_while_used", 10)],
)
def test_threads_on_one_handle_never_crash(scenario, rounds):
    """handle_races.py in a child process, so a segfault fails this test.
    Before calls were serialised per handle, one_sequence, free_while_used
    and end_while_used crashed (or hung) on nearly every run."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent.parent / "python"), env.get("PYTHONPATH")]))
    try:
        res = subprocess.run(
            [sys.executable, str(HERE / "handle_races.py"), scenario, str(rounds)],
            capture_output=True,
            text=True,
            timeout=90,
            env=env,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{scenario}: hung (no exit in {exc.timeout} s)")
    how = f"signal {signal.Signals(-res.returncode).name}" if res.returncode < 0 else f"exit {res.returncode}"
    assert res.returncode == 0, f"{scenario}: {how}\n{res.stdout}\n{res.stderr[-4000:]}"
    assert res.stdout.startswith(f"ok {scenario}"), res.stdout


class OverlapProbe:
    """Stands in for engine.lib: records how many calls of the probed names
    run at once per handle (and overall), holding each open a moment."""

    def __init__(self, real, names):
        self._real, self._names = real, names
        self._lock = threading.Lock()
        self._serial = threading.Lock()  # the real calls themselves never overlap here
        self.running = collections.Counter()
        self.most_per_handle = 0
        self.most_overall = 0

    def __getattr__(self, name):
        attr = getattr(self._real, name)
        if name not in self._names:
            return attr

        def probed(engine, seq, *args):
            with self._lock:
                self.running[seq.id] += 1
                self.most_per_handle = max(self.most_per_handle, self.running[seq.id])
                self.most_overall = max(self.most_overall, sum(self.running.values()))
            try:
                time.sleep(0.0005)
                with self._serial:
                    return attr(engine, seq, *args)
            finally:
                with self._lock:
                    self.running[seq.id] -= 1

        return probed


def test_calls_naming_one_sequence_never_overlap(engine, monkeypatch):
    probe = OverlapProbe(
        engine_mod.lib, {"kvh_seq_append", "kvh_seq_write_kv", "kvh_seq_read_kv", "kvh_seq_truncate", "kvh_seq_tokens"}
    )
    monkeypatch.setattr(engine_mod, "lib", probe)
    k = np.ones((4, engine.num_kv_heads, engine.head_dim), np.float32)

    failures = []

    def work(seq, n):
        for step in range(n):
            try:
                seq.append(range(4))
                seq.write_kv(0, len(seq) - 4, k, k)
                seq.read_kv(0, len(seq) - 4, 4)
                if step % 10 == 9:
                    seq.truncate(4)
                    seq.tokens()
            except kvh.RangeError:  # another thread truncated between len() and the call
                pass
            except Exception as exc:
                failures.append(exc)

    def run(seqs):
        threads = [threading.Thread(target=work, args=(s, 40)) for s in seqs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not failures, failures[:3]

    with engine.sequence() as shared:
        run([shared] * 3)
    assert probe.most_per_handle == 1
    # Different sequences are not serialised against each other.
    with engine.sequence() as a, engine.sequence() as b:
        run([a, b])
    assert probe.most_overall == 2


def _held_exclusively(gate):
    """A thread inside an exclusive call on gate until the returned event
    is set: (thread, leave)."""
    inside = threading.Event()
    leave = threading.Event()

    def holder():
        with gate.exclusive():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    assert inside.wait(10)
    return t, leave


def test_gate_serialises_exclusive_and_admits_shared():
    gate = HandleGate(lambda: kvh.BadHandleError("closed"))
    t, leave = _held_exclusively(gate)
    with gate.shared():  # a @threads any call runs beside it
        pass
    entered = threading.Event()

    def second():
        with gate.exclusive():
            entered.set()

    t2 = threading.Thread(target=second)
    t2.start()
    assert not entered.wait(0.1)  # waits for the holder
    leave.set()
    assert entered.wait(10)
    t.join()
    t2.join()


def test_gate_close_waits_for_calls_in_flight_then_refuses():
    gate = HandleGate(lambda: kvh.BadHandleError("closed"))
    inside = threading.Event()
    leave = threading.Event()
    order = []

    def user():
        with gate.exclusive():
            inside.set()
            leave.wait(10)
            order.append("call done")

    t = threading.Thread(target=user)
    t.start()
    assert inside.wait(10)
    closer = threading.Thread(target=lambda: gate.close(lambda: order.append("freed")))
    closer.start()
    time.sleep(0.05)
    assert order == [] and gate.closed
    with pytest.raises(kvh.BadHandleError):  # closing: no new call gets in
        gate.enter(False)
    leave.set()
    closer.join(10)
    t.join(10)
    assert order == ["call done", "freed"]
    assert gate.close(lambda: order.append("again")) is None and order == ["call done", "freed"]
    with pytest.raises(kvh.BadHandleError):
        gate.enter(True)


def test_gate_reopens_when_the_end_fails_if_asked():
    def busy():
        raise kvh.BusyError("switch running")

    keep = HandleGate(lambda: kvh.BadHandleError("closed"), reopen_if_end_fails=True)
    with pytest.raises(kvh.BusyError):
        keep.close(busy)
    assert not keep.closed
    with keep.exclusive():
        pass
    # Without the flag a refusal (BusyError: nothing was ended) reopens too,
    # and any other failure closes.
    drop = HandleGate(lambda: kvh.BadHandleError("closed"))
    with pytest.raises(kvh.BusyError):
        drop.close(busy)
    assert not drop.closed

    def gone():
        raise kvh.BadHandleError("already freed")

    with pytest.raises(kvh.BadHandleError):
        drop.close(gone)
    assert drop.closed


def test_gate_survives_an_interrupt_inside_its_wake(monkeypatch):
    """Ctrl-C lands where the thread leaving the gate wakes the next one:
    the waiter must still get its turn, not sleep until some later call."""
    gate = HandleGate(lambda: kvh.BadHandleError("closed"))
    inside = threading.Event()
    leave = threading.Event()
    interrupted = []

    def holder():
        try:
            with gate.exclusive():
                inside.set()
                leave.wait(10)
        except KeyboardInterrupt:
            interrupted.append(True)

    t = threading.Thread(target=holder)
    t.start()
    assert inside.wait(10)
    entered = threading.Event()

    def waiter():
        with gate.exclusive():
            entered.set()

    t2 = threading.Thread(target=waiter, daemon=True)  # a failed run leaves it asleep
    t2.start()
    deadline = time.monotonic() + 10
    while not gate._waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gate._waiting == 1  # the waiter sleeps in the gate

    real_wake = HandleGate._wake
    fired = []

    def interrupted_wake(self):
        if not fired and threading.current_thread() is t:
            fired.append(True)
            raise KeyboardInterrupt  # as a signal handler would, before the notify
        real_wake(self)

    monkeypatch.setattr(HandleGate, "_wake", interrupted_wake)
    leave.set()
    t.join(10)
    assert interrupted == [True] and fired == [True]
    assert entered.wait(2), "the waiter slept through its turn"
    t2.join(10)


def test_a_count_left_by_an_interrupted_exit_does_not_shut_others_out():
    """A Ctrl-C raised at the entry of a call's __exit__ skips its leave:
    once that thread is in no call, its counts must not keep another
    thread out of the handle nor its close waiting."""
    for exclusive in (True, False):
        gate = HandleGate(lambda: kvh.BadHandleError("closed"))

        def call_interrupted_at_its_exit():
            gate.enter(exclusive)
            raise KeyboardInterrupt  # before leave, as at the entry of __exit__

        with pytest.raises(KeyboardInterrupt):
            call_interrupted_at_its_exit()
        done = threading.Event()

        def other():
            with gate.exclusive():
                pass
            gate.close(lambda: None)
            done.set()

        t = threading.Thread(target=other, daemon=True)  # a failed run leaves it asleep
        t.start()
        assert done.wait(10), f"another thread waited for good on a count left behind (exclusive={exclusive})"
        assert gate.closed and gate._in_flight == 0


def test_a_close_with_its_own_abandoned_count_still_waits_for_other_calls():
    """The closing thread holds an abandoned count, another thread is in a
    call, and a second closer's waits take the abandoned count back: the
    first close must still wait for the call in flight."""
    gate = HandleGate(lambda: kvh.BadHandleError("closed"))

    def call_interrupted_at_its_exit():
        gate.enter(False)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        call_interrupted_at_its_exit()
    in_call, call_over = threading.Event(), threading.Event()
    ended_during_call = []

    def caller():
        with gate.shared():
            in_call.set()
            time.sleep(0.6)
            ended_during_call.append(bool(ended))
        call_over.set()

    ended = []
    t = threading.Thread(target=caller)
    t.start()
    assert in_call.wait(10)
    second = threading.Thread(target=lambda: (time.sleep(0.1), gate.close(lambda: None)))
    second.start()
    gate.close(lambda: ended.append(True))
    assert call_over.is_set(), "the close ended the handle while a call was in flight"
    t.join(10)
    second.join(10)
    assert ended == [True] and ended_during_call == [False] and gate._in_flight == 0


def test_a_count_of_a_thread_still_in_its_call_is_kept():
    gate = HandleGate(lambda: kvh.BadHandleError("closed"))
    t, leave = _held_exclusively(gate)
    got_in = threading.Event()
    t2 = threading.Thread(target=lambda: (gate.enter(True), got_in.set(), gate.leave(True)), daemon=True)
    t2.start()
    # holder sleeps inside its `with`: its count must stand past the waits
    # that look for counts left behind
    assert not got_in.wait(0.5)
    leave.set()
    t.join(10)
    assert got_in.wait(10)
    t2.join(10)


class StuckWaits:
    """The library as seen when work never completes: kvh_fence_wait and
    kvh_context_wait_layer hold the thread in C (without the GIL, like the
    real calls) for their whole timeout, up to 3 s, then report a timeout;
    kvh_fence_poll says not done. Everything else is the real library.
    release() ends the stuck work: the waits then report it done."""

    def __init__(self, real):
        self._real = real
        self._sleep = ctypes.CDLL(None).usleep
        self._released = False

    def __getattr__(self, name):
        return getattr(self._real, name)

    def release(self):
        self._released = True

    def _hold(self, ns):
        if self._released:
            return self._real.KVH_OK
        self._sleep(min(ns // 1000, 3_000_000))
        return self._real.KVH_ERR_TIMEOUT

    def kvh_fence_wait(self, engine, fence, ns):
        return self._hold(ns)

    def kvh_context_wait_layer(self, engine, ctx, layer, ns):
        return self._hold(ns)

    def kvh_fence_poll(self, engine, fence, done):
        done[0] = 0
        return 0


def _interrupted_after(seconds, wait, stuck):
    """How long wait() ran before the KeyboardInterrupt of a Ctrl-C
    pressed ``seconds`` after it began. Should the interrupt never land,
    the stuck work is released after 10 s, so the test fails instead of
    waiting for good."""
    timer = threading.Timer(seconds, _thread.interrupt_main)
    rescue = threading.Timer(10.0, stuck.release)
    t0 = time.monotonic()
    timer.start()
    rescue.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            wait()
        return time.monotonic() - t0
    finally:
        timer.cancel()
        rescue.cancel()


@pytest.fixture
def ctrl_c_raises():
    """Python's own Ctrl-C handler for the test: a process started in the
    background by a shell (as a CI runner may be) inherits SIGINT ignored,
    and then _thread.interrupt_main() does nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_releasing_a_hold_does_not_wait_for_its_promotion(engine, monkeypatch):
    """A hold taken with wait=False and released (or collected) while its
    promotion was still on its way waited for the promotion first: on a
    stuck disk, for good. The library ends such a hold itself."""
    seq, _ = filled_seq(engine, 32)
    stuck = StuckWaits(engine_mod.lib)
    monkeypatch.setattr(engine_mod, "lib", stuck)
    rescue = threading.Timer(10.0, stuck.release)
    rescue.start()
    try:
        hold = seq.acquire(wait=False)
        t0 = time.monotonic()
        hold.release()
        assert time.monotonic() - t0 < 1.0
    finally:
        rescue.cancel()
    monkeypatch.undo()
    with seq.acquire() as hold:
        assert hold.fence is None
    seq.free()


def test_an_await_given_up_frees_its_thread(engine, monkeypatch):
    """``await fence`` waited in one executor call for as long as the
    work ran: each await given up (asyncio.wait_for's timeout) kept one
    thread of the loop's default executor until the work ended, so other
    executor jobs queued behind it and asyncio.run could not return."""
    seq, _ = filled_seq(engine, 32)
    fence = engine.prefetch(seq)
    stuck = StuckWaits(engine_mod.lib)
    monkeypatch.setattr(engine_mod, "lib", stuck)
    rescue = threading.Timer(10.0, stuck.release)
    rescue.start()
    took = {}

    async def main():
        loop = asyncio.get_running_loop()
        loop.set_default_executor(cf.ThreadPoolExecutor(max_workers=2))
        for _ in range(4):
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(fence, 0.05)
        t0 = time.monotonic()
        await loop.run_in_executor(None, lambda: None)
        took["job"] = time.monotonic() - t0

    t0 = time.monotonic()
    try:
        asyncio.run(main())
    finally:
        rescue.cancel()
    took["run"] = time.monotonic() - t0
    assert took["job"] < 1.0, took
    assert took["run"] < 2.0, took
    stuck.release()

    async def finish():
        await fence

    asyncio.run(finish())  # released: the await returns
    monkeypatch.undo()
    seq.free()


def test_ctrl_c_interrupts_waits_without_a_timeout(engine, monkeypatch, ctrl_c_raises):
    """Fence.wait() / result() and Context.wait_layer() with no timeout
    waited in one C call, where Python cannot raise KeyboardInterrupt: a
    Ctrl-C was held back until the work completed (forever for work that
    never does). They now wait in slices on the main thread."""
    from kvh_cache import context as context_mod

    seq, _ = filled_seq(engine, 32)
    fence = engine.prefetch(seq)
    ctx = engine.context("c")
    ctx.add_region("w", data=np.arange(100, dtype=np.uint8))
    stuck = StuckWaits(engine_mod.lib)
    monkeypatch.setattr(engine_mod, "lib", stuck)
    monkeypatch.setattr(context_mod, "lib", stuck)
    assert _interrupted_after(0.3, fence.wait, stuck) < 2.0
    assert _interrupted_after(0.3, fence.result, stuck) < 2.0
    assert _interrupted_after(0.3, lambda: ctx.wait_layer(0), stuck) < 2.0
    assert not fence.wait(0.25)  # a timeout is still a timeout
    with pytest.raises(kvh.KvhTimeoutError):
        ctx.wait_layer(0, timeout=0.25)
    monkeypatch.undo()
    assert fence.wait(10)  # nothing was lost: the real fence completes
    seq.free()


def test_timeouts_are_seconds_or_none(engine):
    """timeout=inf or 1e300 raised OverflowError, NaN a ValueError from
    int(), a string a TypeError about multiplying a sequence."""
    seq, _ = filled_seq(engine, 32)
    fence = engine.prefetch(seq)
    for bad, error in ((float("nan"), ValueError), ("1", TypeError), (True, TypeError), ([1], TypeError)):
        with pytest.raises(error, match="timeout"):
            fence.wait(bad)
    assert fence.wait(float("inf")) and fence.wait(1e300) and fence.wait(-1)
    assert engine.prefetch(seq).wait(1 << 70)
    seq.free()


def _engine_whose_worker_logs(tmp_path, workers=1):
    """An engine with one migration worker and a store whose blocks fail
    their checksums: each migration of one makes the worker log a warning,
    so a logging handler runs on a kvh thread (where kvh refuses calls
    into the engine with KVH_ERR_BUSY)."""
    from kvh_testutil import make_engine

    store = str(tmp_path / "store")
    with make_engine(disk_path=store, disk_bytes=1 << 20) as eng:
        seq, _ = filled_seq(eng, 64)
        seq.persist()
    slab = tmp_path / "store" / "slab-0000.kvh"
    data = bytearray(slab.read_bytes())
    for off in range(4096 + 100, len(data), 8192):
        data[off] ^= 0x08
    slab.write_bytes(bytes(data))
    eng = make_engine(disk_path=store, disk_bytes=1 << 20, migration_threads=workers)
    return eng, eng.prefix_lookup(np.arange(64))


@contextlib.contextmanager
def _kvh_log_handler(once):
    """Runs once() in a logging handler of "kvh", at its first warning (on
    whichever thread logs it); yields the event set after it ran."""
    fired = threading.Event()

    class Handler(logging.Handler):
        def emit(self, record):
            if not fired.is_set():
                try:
                    once()
                finally:
                    fired.set()

    handler = Handler(level=logging.WARNING)
    logging.getLogger("kvh").addHandler(handler)
    try:
        yield fired
    finally:
        logging.getLogger("kvh").removeHandler(handler)


def _migrate_and_wait(eng, blocks, timeout=None):
    """Migrates each block to the host tier and waits: the corrupt ones fail
    their checksums, which is what makes the worker log. Other errors are
    returned."""
    others = []
    for f in [eng.migrate([b], "host", wait=False) for b in blocks]:
        try:
            f.wait(timeout)
        except kvh.CorruptionError:
            pass
        except kvh.Error as exc:
            others.append(exc)
    return others


@pytest.mark.parametrize("how", ["free", "collect"])
def test_frees_refused_inside_a_worker_log_handler_are_not_lost(tmp_path, how):
    """A free the library refuses (inside the log sink, on its worker) leaves
    the sequence usable and freeable later; sequences the garbage collector
    takes there are freed by the next call that may."""

    eng, blocks = _engine_whose_worker_logs(tmp_path)

    def used():
        return eng.tier_info("device").used_blocks + eng.tier_info("host").used_blocks

    u0 = used()
    victim, _ = filled_seq(eng, 8, first_token=7000)  # one partial block: freed, not cached
    outcome = []

    def once():
        if how == "free":
            try:
                victim.free()
                outcome.append("freed")
            except kvh.BusyError:
                outcome.append("busy")
        else:
            outcome.append(gc.collect())

    with _kvh_log_handler(once) as fired:
        try:
            if how == "collect":
                gc.disable()
                for i in range(4):  # garbage cycles holding sequences
                    s, _ = filled_seq(eng, 8, seed=i, first_token=5000 + 100 * i)
                    box = [s]
                    box.append(box)
                del s, box, victim
                assert used() - u0 == 4  # the garbage cycles only
            assert _migrate_and_wait(eng, blocks) == [] and fired.wait(10)
        finally:
            gc.enable()
    if how == "free":
        assert outcome == ["busy"] and not victim.freed
        victim.free()
        assert victim.freed
        with pytest.raises(kvh.BadHandleError):
            victim.tokens()
    else:
        gc.collect()
    for b in blocks:
        b.release()
    assert used() - u0 == 0
    eng.close()


def test_close_from_a_worker_log_handler_is_refused_at_once(tmp_path):
    """kvh refuses an engine's close from its own log sink; the binding must
    say so at once, not first wait for calls in flight on other threads
    (whose fences the logging worker itself would complete), and must not
    refuse those calls meanwhile."""

    eng, blocks = _engine_whose_worker_logs(tmp_path)
    outcome, errors = [], []

    def once():
        for call in (eng.close, lambda: eng.tier_info("host")):
            try:
                call()
                outcome.append("ok")
            except kvh.BusyError:
                outcome.append("busy")

    with _kvh_log_handler(once) as fired:
        t = threading.Thread(target=lambda: errors.extend(_migrate_and_wait(eng, blocks, 20)))
        t.start()
        t.join(30)
    assert not t.is_alive() and fired.wait(10)
    assert outcome == ["busy", "busy"] and errors == []
    assert not eng.closed
    for b in blocks:
        b.release()
    eng.close()
    assert eng.closed


def test_a_fork_racing_a_new_block_view_never_sees_its_writes():
    """A view taken on one thread while another forks: the fork must not see
    what is written through the view later (the view is read-only once its
    block is shared, or the sequence has moved to a copy)."""
    from kvh_testutil import make_engine

    eng = make_engine(device_bytes=256 * 4096, host_bytes=512 * 4096)
    seq = eng.sequence(tokens=np.arange(8))  # one partial, private block
    zeros = np.zeros((8, 2, 8), np.float32)
    seq.write_kv(0, 0, zeros, zeros)
    stop = threading.Event()

    def writer():
        c = 0.0
        while not stop.is_set():
            try:
                v = seq.block_view(0, 0)
            except kvh.Error:
                continue
            if v.flags.writeable:
                c += 1.0
                v[0, 0, 0, 0] = c
            del v

    t = threading.Thread(target=writer)
    t.start()
    changed = forks = 0
    try:
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            f = seq.fork()
            before = f.read_kv(0, 0, 1)[0].copy()
            time.sleep(0.001)
            changed += not np.array_equal(before, f.read_kv(0, 0, 1)[0])
            f.free()
            forks += 1
    finally:
        stop.set()
        t.join()
    eng.close()
    assert forks > 50 and changed == 0


def test_views_taken_beside_forks_map_their_own_block():
    """Views taken on threads while another forks and writes the child: a
    view mapped the slot of the block the sequence had just left (the
    child's copy of another block showed through it), and a look at the
    block met a stale handle on a live sequence."""
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    eng = kvh.Engine(num_layers=2, num_kv_heads=2, head_dim=8, dtype="f32", block_tokens=4, device_bytes=64 << 10)
    seq = eng.sequence(tokens=np.arange(64))
    kk = np.arange(64 * 2 * 8, dtype=np.float32).reshape(64, 2, 8)
    seq.write_kv(0, 0, kk, -kk)
    stop = time.monotonic() + 3.0
    wrong, errors = [], []

    def viewer(i):
        rng = np.random.default_rng(i)
        while time.monotonic() < stop and not wrong:
            p = int(rng.integers(16))
            try:
                v = seq.block_view(p, 0)
            except kvh.NoSpaceError:
                continue  # views keep blocks the forks' copies need
            except kvh.Error as exc:
                errors.append(repr(exc))
                continue
            if not np.array_equal(v[0], kk[4 * p : 4 * p + 4].transpose(1, 0, 2)):
                wrong.append((p, v[0, 0, :, 0].tolist()))

    def forker():
        while time.monotonic() < stop and not wrong:
            try:
                with seq.fork() as c:
                    c.write_kv(0, 0, kk[:1] + 1, kk[:1])
            except kvh.NoSpaceError:
                pass

    threads = [threading.Thread(target=viewer, args=(i,)) for i in range(3)] + [threading.Thread(target=forker)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old_interval)
    eng.close()
    assert not wrong, wrong[:3]
    assert not errors, errors[:3]


def test_a_close_deferred_by_views_logs_without_its_lock(monkeypatch):
    """Engine.close deferred by a live view logged that at DEBUG while
    holding the engine's view lock; a handler calling into a sequence then
    waited for a block_view in flight, which waited for that lock."""
    eng = kvh.Engine(num_layers=1, num_kv_heads=1, head_dim=4, block_tokens=4, dtype="f32", device_bytes=1 << 16)
    seq = eng.sequence(tokens=np.arange(8))
    seq.write_kv(0, 0, np.ones((8, 1, 4), np.float32), np.ones((8, 1, 4), np.float32))
    live = seq.block_view(1, 0)  # defers the close, which logs it
    clear = engine_mod.Sequence._clear_unwritten_cells

    def slow_clear(self, *args, **kwargs):
        clear(self, *args, **kwargs)
        time.sleep(0.5)  # inside block_view's hold on the sequence, before its view is counted

    monkeypatch.setattr(engine_mod.Sequence, "_clear_unwritten_cells", slow_clear)
    seen = []

    class CallsIn(logging.Handler):
        def emit(self, record):
            if "deferred" in record.getMessage():
                try:
                    seq.tokens()
                except kvh.Error as exc:
                    seen.append(type(exc).__name__)

    logger = logging.getLogger("kvh")
    handler = CallsIn()
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    result = {}
    try:
        viewer = threading.Thread(target=lambda: result.setdefault("view", _try(lambda: seq.block_view(0, 0))))
        viewer.daemon = True
        viewer.start()
        time.sleep(0.2)
        closer = threading.Thread(target=eng.close, daemon=True)
        closer.start()
        viewer.join(10)
        closer.join(10)
        assert not viewer.is_alive() and not closer.is_alive(), "block_view and close wait for each other"
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    del live


def _try(fn):
    try:
        return fn()
    except kvh.Error as exc:
        return exc


def test_holds_and_views_collected_in_a_worker_log_handler_are_released(tmp_path):
    """A hold and a block view whose last references go inside the log
    handler on a kvh worker (where kvh refuses their release): the next
    call that may releases them."""

    eng, blocks = _engine_whose_worker_logs(tmp_path)
    seq, _ = filled_seq(eng, 32, first_token=7000)
    box = {"hold": seq.acquire(0, 16), "view": seq.block_view(1, 0)}
    assert seq.block(0).info().holds == 1 and seq.block(1).info().holds == 1
    with _kvh_log_handler(box.clear) as fired:  # the last references: collected there
        _migrate_and_wait(eng, blocks)
        assert fired.wait(10)
    gc.collect()
    eng.tier_info("host")  # a call that may release them
    assert seq.block(0).info().holds == 0 and seq.block(1).info().holds == 0
    for b in blocks:
        b.release()
    seq.free()
    eng.close()


def test_a_log_handler_on_a_foreign_thread_may_call_the_engine(tmp_path):
    """kvh refuses calls from its log sink only on threads kvh started; a
    thread started outside Python's threading module (``_thread``, other C
    code) is a caller's own, where calls work as usual."""
    import _thread

    eng, blocks = _engine_whose_worker_logs(tmp_path, workers=0)  # logs on the calling thread
    outcome = []

    def once():
        try:
            eng.tier_info("host")
            outcome.append("ok")
        except kvh.BusyError:
            outcome.append("busy")

    def body(done):
        _migrate_and_wait(eng, blocks[:1])
        done.set()

    with _kvh_log_handler(once):
        done = threading.Event()
        _thread.start_new_thread(body, (done,))
        assert done.wait(20)
    assert outcome == ["ok"]
    for b in blocks:
        b.release()
    eng.close()


def test_a_view_collected_in_a_worker_log_handler_does_not_keep_a_closed_engine(tmp_path):
    """The view's release, refused inside the sink, is made by the close:
    the C engine really closes (its store can be opened again)."""
    from kvh_testutil import make_engine

    eng, blocks = _engine_whose_worker_logs(tmp_path)
    seq, _ = filled_seq(eng, 32, first_token=7000)
    box = {"view": seq.block_view(1, 0)}
    with _kvh_log_handler(box.clear) as fired:
        _migrate_and_wait(eng, blocks)
        assert fired.wait(10)
    del blocks, seq
    eng.close()
    assert eng._native.released and eng._native.views == 0
    make_engine(disk_path=str(tmp_path / "store"), disk_bytes=1 << 20).close()  # not BusyError


def test_a_thread_started_from_a_kvh_worker_is_the_callers(tmp_path):
    """A thread made inside a handler on kvh's worker inherits its OS name,
    but it is not kvh's: its own log handler may call its engine."""
    import _thread

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    eng_a, blocks_a = _engine_whose_worker_logs(tmp_path / "a")  # logs on its worker
    eng_b, blocks_b = _engine_whose_worker_logs(tmp_path / "b", workers=0)  # logs on the caller's thread
    outcome, done = [], threading.Event()

    def body():
        _migrate_and_wait(eng_b, blocks_b[:1])
        done.set()

    def once():
        if isinstance(threading.current_thread(), threading._DummyThread):
            _thread.start_new_thread(body, ())

    def on_b():
        if not done.is_set():
            try:
                eng_b.tier_info("host")
                outcome.append("ok")
            except kvh.BusyError:
                outcome.append("busy")

    with _kvh_log_handler(on_b), _kvh_log_handler(once):
        _migrate_and_wait(eng_a, blocks_a)
        assert done.wait(20)
    assert outcome and set(outcome) == {"ok"}
    for b in blocks_a + blocks_b:
        b.release()
    eng_a.close()
    eng_b.close()
