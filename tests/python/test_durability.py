"""Durability of the disk store through the Python API: what ``persist()``
acknowledges survives a SIGKILL of the process, byte for byte, and a store
is free for a new engine once the engine that had it is closed."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import kvh_cache as kvh
from kvh_testutil import filled_seq, kv_data, make_engine

HERE = Path(__file__).resolve().parent
CHAINS = 12
TOKENS = 48  # three 16-token blocks
DISK = dict(disk_bytes=1 << 22)


def chain_tokens(i: int) -> np.ndarray:
    return np.arange(10_000 + 1_000 * i, 10_000 + 1_000 * i + TOKENS)


# The child: persists random chains of the universe forever, printing an
# acknowledgement after each persist returned; the parent kills it.
CHILD = textwrap.dedent(
    """
    import random, sys
    import numpy as np
    from kvh_testutil import make_engine
    from test_durability import CHAINS, DISK, chain_tokens, fill
    store, seed = sys.argv[1], int(sys.argv[2])
    rnd = random.Random(seed)
    eng = make_engine(disk_path=store, migration_threads=2, **DISK)
    print("R", flush=True)
    while True:
        i = rnd.randrange(CHAINS)
        seq = eng.sequence(tokens=chain_tokens(i))
        fill(eng, seq, i)
        if rnd.random() < 0.5:
            seq.migrate("disk", wait=False).close()
        seq.persist()
        sys.stdout.write(f"A {i}\\n")  # one write: PYTHONUNBUFFERED would tear print's pieces
        sys.stdout.flush()
        seq.free()
        if rnd.random() < 0.1:
            eng.close()
            eng = make_engine(disk_path=store, migration_threads=2, **DISK)
    """
)


def fill(eng, seq, i: int) -> None:
    for layer in range(eng.num_layers):
        k, v = kv_data(TOKENS, eng.num_kv_heads, eng.head_dim, eng.np_dtype, seed=i * 100 + layer)
        seq.write_kv(layer, 0, k, v)


def check_store(store: Path, acked: set) -> int:
    """Every acknowledged chain is matched whole; whatever is matched reads
    back exactly. Returns the blocks matched."""
    matched_blocks = 0
    with make_engine(disk_path=str(store), **DISK) as eng:
        for i in range(CHAINS):
            with eng.sequence() as s:
                m = s.match_prefix(chain_tokens(i))
                if i in acked:
                    assert m == TOKENS, f"chain {i} was acknowledged durable; {m} of {TOKENS} tokens matched"
                matched_blocks += m // 16
                for layer in range(eng.num_layers):
                    if m == 0:
                        break
                    k, v = s.read_kv(layer)
                    rk, rv = kv_data(TOKENS, eng.num_kv_heads, eng.head_dim, eng.np_dtype, seed=i * 100 + layer)
                    np.testing.assert_array_equal(k, rk[:m], err_msg=f"chain {i} layer {layer} K")
                    np.testing.assert_array_equal(v, rv[:m], err_msg=f"chain {i} layer {layer} V")
        assert eng.stats().corrupt_blocks == 0
    return matched_blocks


def test_sigkill_keeps_every_acknowledged_persist(tmp_path):
    store = tmp_path / "store"
    try:
        make_engine(disk_path=str(store), **DISK).close()
    except kvh.UnsupportedError:
        pytest.skip("no disk tier in this build")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent.parent / "python"), str(HERE), env.get("PYTHONPATH", "")])
    rnd = random.Random(int(os.environ.get("KVH_TEST_SEED", "0"), 0) or 0xD0AB1E)
    acked = set()
    kills = 0
    for cycle in range(6):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(store), str(rnd.randrange(1 << 30))],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout.readline().strip() == "R", child.stderr.read()
            # let it persist a random number of chains, then kill it at a
            # random moment; every acknowledgement printed before the kill is
            # read, from the pipe, before the store is checked
            lines = [child.stdout.readline() for _ in range(rnd.randrange(0, 6))]
            time.sleep(rnd.random() * 0.05)
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=60)
            assert child.returncode == -signal.SIGKILL, child.stderr.read()
            kills += 1
            for line in lines + child.stdout.read().splitlines():
                words = line.split()
                if len(words) == 2 and words[0] == "A":  # a line the kill cut short acknowledges nothing
                    acked.add(int(words[1]))
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        check_store(store, acked)
    assert kills == 6 and acked


def test_forked_worker_does_not_keep_the_store(tmp_path):
    """A process forked while an engine is open (multiprocessing's default
    on Linux) and that never uses it must not keep the store once the
    engine is closed."""
    store = tmp_path / "store"
    try:
        eng = make_engine(disk_path=str(store), migration_threads=0, **DISK)
    except kvh.UnsupportedError:
        pytest.skip("no disk tier in this build")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker: waits for the parent, exits without cleanup
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    try:
        eng.close()
        make_engine(disk_path=str(store), **DISK).close()  # not BusyError
    finally:
        os.close(w)
        os.waitpid(pid, 0)


def test_strict_refuses_a_store_whose_index_and_journal_are_gone(tmp_path):
    """Strict took a store with neither index nor journal beside full slab
    files for a creation cut short and started it empty, writing a fresh
    index over blocks a default open would have rebuilt: `kvh stats`, which
    opens strict, lost them all that way."""
    store = str(tmp_path / "store")
    with make_engine(disk_path=store, disk_bytes=1 << 20) as eng:
        seq, _ = filled_seq(eng, 48)
        seq.persist()
    os.unlink(os.path.join(store, "index"))
    os.unlink(os.path.join(store, "journal"))
    with pytest.raises(kvh.CorruptionError, match="neither index nor journal"):
        make_engine(disk_path=store, disk_bytes=1 << 20, disk_strict_index=True)
    assert not os.path.exists(os.path.join(store, "index"))
    with make_engine(disk_path=store, disk_bytes=1 << 20) as eng:
        assert len(eng.prefix_lookup(np.arange(48))) == 3


def test_blocks_found_on_disk_are_charged_to_the_agent_that_matches_them(tmp_path):
    """After a reopen, the blocks a prefix match read back were charged to
    agent 0, whoever matched them: an agent under a one-block quota held
    three device blocks, and a real agent 0 was refused for them."""
    bt, layers, heads, dim = 16, 2, 1, 64
    block = layers * 2 * heads * bt * dim * 2

    def engine():
        return kvh.Engine(num_layers=layers, num_kv_heads=heads, head_dim=dim, dtype="f16", block_tokens=bt,
                          device_bytes=8 * block, host_bytes=8 * block, disk_path=str(tmp_path / "store"),
                          disk_bytes=64 * (block + 4096), migration_threads=0)  # fmt: skip

    tokens = np.arange(10, 10 + 3 * bt, dtype=np.int32)
    with engine() as e:
        s = e.sequence(agent=2, tokens=tokens)
        ones = np.ones((3 * bt, heads, dim), np.float16)
        for layer in range(layers):
            s.write_kv(layer, 0, ones, ones)
        s.persist()
    for quota_agents in ((1,), (0, 1)):
        with engine() as e:
            for agent in quota_agents:
                e.set_agent_quota(agent, block)
            c = e.sequence(agent=1)
            assert c.match_prefix(tokens) == 3 * bt
            assert [b.info().agent for b in c.blocks()] == [1, 1, 1]
            with pytest.raises(kvh.NoSpaceError, match="agent 1 is at its device quota"):
                c.acquire(0, 3 * bt)
            with c.acquire(0, bt):  # within its quota
                pass
