"""Concurrency through the API: prefetch hints from some threads while others
read and write, fences as futures, asyncio."""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import random
import threading
import time

import numpy as np

import kvh
from kvh_testutil import filled_seq, kv_data


def test_prefetch_threads_while_others_read():
    # Small device tier so hints really move blocks while readers run.
    with kvh.Engine(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=16, dtype="f16", backend="cpu",
                    device_bytes=24 * 4096, host_bytes=256 * 4096, migration_threads=2) as eng:
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
    with kvh.Engine(num_layers=1, num_kv_heads=2, head_dim=8, dtype="f32", backend="cpu",
                    device_bytes=16 * 1024, host_bytes=1 << 22) as eng:
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
