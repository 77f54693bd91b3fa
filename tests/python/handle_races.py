"""Races of two threads on one kvh object, run as a script so that a crash
of the interpreter fails the test that starts it (test_threads.py) instead
of killing pytest:

    python3 handle_races.py SCENARIO [ROUNDS]

Prints ``ok SCENARIO ...`` and exits 0 when every call either worked or
raised the kvh exception its race allows. The engines are small, with
copying tier moves, so that appends and writes evict: the C core then
drops its lock in the middle of a call, which is where two overlapping
calls on one handle used to corrupt the sequence.
"""

from __future__ import annotations

import collections
import random
import sys
import threading
import time

import numpy as np

import kvh_cache as kvh

H, D, BT = 8, 64, 16
BLOCK_BYTES = H * D * BT * 2 * 4  # one f32 layer


def small_engine(**extra) -> kvh.Engine:
    cfg = dict(
        num_layers=1,
        num_kv_heads=H,
        head_dim=D,
        block_tokens=BT,
        dtype="f32",
        backend="cpu",
        device_bytes=4 * BLOCK_BYTES,
        host_bytes=4096 * BLOCK_BYTES,
        migration_threads=1,
        copy_moves=True,
    )
    cfg.update(extra)
    return kvh.Engine(**cfg)


def run_threads(targets) -> None:
    """Runs the callables on their own threads; re-raises the first failure."""
    failures = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as exc:  # reported by the main thread
                failures.append(exc)

        return run

    threads = [threading.Thread(target=wrap(fn)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]


def one_sequence(rounds: int) -> str:
    """Two threads append, write, read and truncate one sequence."""
    kv = np.ones((BT, H, D), np.float32)
    counts = collections.Counter()
    for r in range(rounds):
        with small_engine() as eng, eng.sequence() as seq:

            def worker(i):
                rng = random.Random(r * 10 + i)
                for _ in range(3000):
                    op = rng.random()
                    try:
                        if op < 0.4:
                            seq.append(np.arange(BT) + i)
                        elif op < 0.8:
                            n = len(seq)
                            if n >= BT:
                                seq.write_kv(0, rng.randrange(n // BT) * BT, kv, kv)
                        elif op < 0.9:
                            seq.truncate(len(seq) // 2)
                        else:
                            eng.prefetch(seq).close()
                        counts["calls"] += 1
                    except kvh.RangeError:  # the other thread truncated between len() and the write
                        counts["range"] += 1

            run_threads([lambda: worker(0), lambda: worker(1)])
            assert seq.tokens().size == len(seq)
        # Whole appends from two threads interleave, never mix.
        with small_engine() as eng, eng.sequence() as seq:

            def appender(i):
                for _ in range(200):
                    seq.append(np.full(BT, i, np.int32))

            run_threads([lambda: appender(1), lambda: appender(2)])
            blocks = seq.tokens().reshape(-1, BT)
            assert blocks.shape == (400, BT), blocks.shape
            assert all(len(set(b)) == 1 for b in blocks.tolist())
            assert sorted(np.bincount(blocks[:, 0]).tolist()) == [0, 200, 200]
    return f"calls={counts['calls']} range={counts['range']}"


def _use_until_gone(seq, gone: tuple, counts, stop_when_gone: bool = True) -> None:
    """Calls on seq until one raises an error of ``gone``."""
    kv = np.ones((BT, H, D), np.float32)
    eng = seq.engine
    rng = random.Random(7)
    while True:
        try:
            seq.append(np.arange(BT))
            seq.write_kv(0, len(seq) - BT, kv, kv)
            with seq.acquire(0, BT):
                seq.read_kv(0, 0, BT)
            f = eng.prefetch(seq)
            f.wait(1)
            f.close()
            if rng.random() < 0.1:
                seq.truncate(BT)
            counts["calls"] += 1
        except gone:
            counts["gone"] += 1
            return


def free_while_used(rounds: int) -> str:
    """One thread uses a sequence while another frees it."""
    counts = collections.Counter()
    for r in range(rounds):
        with small_engine() as eng:
            seq = eng.sequence()
            user = threading.Thread(target=_use_until_gone, args=(seq, (kvh.BadHandleError,), counts))
            user.start()
            time.sleep(0.001 * (r % 10))
            seq.free()
            user.join()
            assert seq.freed
    assert counts["gone"] == rounds
    return f"calls={counts['calls']}"


def close_while_used(rounds: int) -> str:
    """Threads use a sequence, a fence and a block while another closes the engine."""
    counts = collections.Counter()
    for r in range(rounds):
        eng = small_engine()
        seq = eng.sequence()
        block = eng.block_alloc()

        def fence_user():
            while True:
                try:
                    f = eng.prefetch(seq)
                    f.done()
                    f.wait(0.01)
                    f.close()
                    block.info()
                    block.pin()
                    block.unpin()
                except kvh.ClosedError:
                    return

        user = threading.Thread(target=_use_until_gone, args=(seq, (kvh.ClosedError,), counts))
        other = threading.Thread(target=fence_user)
        user.start()
        other.start()
        time.sleep(0.001 * (r % 10))
        eng.close()
        user.join()
        other.join()
        seq.free()  # after the close: a no-op, never a crash
    assert counts["gone"] == rounds
    return f"calls={counts['calls']}"


def end_while_used(rounds: int) -> str:
    """For each other handle class: one thread calls it while another ends it."""
    counts = collections.Counter()
    gone = (kvh.BadHandleError,)

    def race(use, end):
        stop = threading.Event()

        def user():
            while not stop.is_set():
                try:
                    use()
                    counts["calls"] += 1
                except gone:
                    counts["gone"] += 1
                    return

        t = threading.Thread(target=user)
        t.start()
        time.sleep(0.0005)
        end()
        stop.set()
        t.join()

    q = np.ones((1, H, D), np.float32)
    for _ in range(rounds):
        with small_engine(device_bytes=64 * BLOCK_BYTES, vmap=True) as eng:
            with eng.sequence(tokens=range(4 * BT)) as seq:
                kv = np.ones((4 * BT, H, D), np.float32)
                seq.write_kv(0, 0, kv, kv)
                with seq.acquire():
                    vm = seq.vmap(0)
                    race(lambda: (vm.n_tokens, vm.refresh(), eng.attention_decode_vmap([vm], q)), vm.release)
                    plan = eng.attention_plan(0, [seq])
                    race(lambda: plan.run(q), plan.destroy)
                block = eng.block_alloc()
                race(lambda: (block.info(), block.pin(), block.unpin()), block.release)
                fence = seq.migrate("host", wait=False)
                race(lambda: (fence.done(), fence.wait(0.001)), fence.close)
                hold = seq.acquire(wait=False)
                race(lambda: seq.read_kv(0, 0, BT), hold.release)
                ctx = eng.context("weights")
                ctx.add_region("w", data=np.zeros(4096, np.uint8))
                race(lambda: (ctx.info(), ctx.verify()), ctx.destroy)
    return f"calls={counts['calls']} gone={counts['gone']}"


SCENARIOS = {f.__name__: f for f in (one_sequence, free_while_used, close_while_used, end_while_used)}

if __name__ == "__main__":
    name = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    print("ok", name, SCENARIOS[name](rounds), flush=True)
