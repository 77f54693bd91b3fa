"""Bad input is rejected in Python, before anything reaches C, with messages
naming the expected shape; closed engines and freed sequences raise."""

from __future__ import annotations

import gc
import re
import threading

import numpy as np
import pytest

import kvh_cache as kvh
from kvh_testutil import kv_data


@pytest.fixture
def seq(engine):
    with engine.sequence(tokens=range(20)) as s:
        yield s


SHAPE = re.escape("(n, 2, 8)")


def test_wrong_dtype_is_type_error(seq):
    k, v = kv_data(4, 2, 8, np.float64)
    with pytest.raises(TypeError, match=r"float64.*expected float32 shaped \(n, 2, 8\)"):
        seq.write_kv(0, 0, k, v)
    k32, _ = kv_data(4, 2, 8, np.float32)
    with pytest.raises(TypeError, match="v has dtype float16"):
        seq.write_kv(0, 0, k32, k32.astype(np.float16))
    with pytest.raises(TypeError):
        seq.write_kv(0, 0, k32.astype(">f4"), k32)  # byte-swapped


def test_non_array_is_type_error(seq):
    with pytest.raises(TypeError, match=r"numpy.ndarray of dtype float32 shaped \(n, 2, 8\)"):
        seq.write_kv(0, 0, [[[0.0] * 8] * 2], np.zeros((1, 2, 8), np.float32))


@pytest.mark.parametrize("shape", [(4, 8), (4, 3, 8), (4, 2, 9), (4, 2, 8, 1), (2, 4, 8)])
def test_wrong_shape_is_value_error(seq, shape):
    a = np.zeros(shape, np.float32)
    with pytest.raises(ValueError, match=SHAPE):
        seq.write_kv(0, 0, a, a)


def test_k_v_length_mismatch(seq):
    with pytest.raises(ValueError, match=re.escape("expected (4, 2, 8)")):
        seq.write_kv(0, 0, np.zeros((4, 2, 8), np.float32), np.zeros((5, 2, 8), np.float32))


def test_non_contiguous_is_value_error(seq):
    base = np.zeros((8, 2, 8), np.float32)
    strided = base[::2]
    with pytest.raises(ValueError, match="C-contiguous"):
        seq.write_kv(0, 0, strided, strided)
    fortran = np.asfortranarray(np.zeros((4, 2, 8), np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        seq.write_kv(0, 0, fortran, fortran)
    transposed = np.zeros((2, 4, 8), np.float32).transpose(1, 0, 2)
    with pytest.raises(ValueError, match="C-contiguous"):
        seq.write_kv(0, 0, transposed, transposed)


def test_read_out_arrays_checked(seq):
    k, v = kv_data(20, 2, 8, np.float32)
    seq.write_kv(0, 0, k, v)
    ro = np.zeros((20, 2, 8), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        seq.read_kv(0, out=(ro, np.zeros_like(ro)))
    with pytest.raises(ValueError, match=re.escape("(20, 2, 8)")):
        seq.read_kv(0, out=(np.zeros((19, 2, 8), np.float32), np.zeros((19, 2, 8), np.float32)))
    with pytest.raises(TypeError):
        seq.read_kv(0, out=np.zeros((20, 2, 8), np.float32))


@pytest.mark.parametrize("bad", [-1, 1.5, "0", None, True])
def test_bad_indices(seq, bad):
    k, v = kv_data(1, 2, 8, np.float32)
    with pytest.raises((TypeError, ValueError)):
        seq.write_kv(bad, 0, k, v)
    with pytest.raises((TypeError, ValueError)):
        seq.write_kv(0, bad, k, v)


def test_bad_tokens(engine):
    with engine.sequence() as s:
        with pytest.raises(TypeError, match="integers"):
            s.append(np.array([1.5, 2.0]))
        with pytest.raises(TypeError):
            s.append("abc")
        with pytest.raises(ValueError, match=r"1-D"):
            s.append(np.zeros((2, 2), np.int32))
        with pytest.raises(ValueError, match="int32"):
            s.append([1 << 40])
        s.append([])  # empty is fine
        assert len(s) == 0


def test_bad_ranges(seq):
    with pytest.raises(ValueError, match="step 1"):
        seq.acquire(range(0, 10, 2))
    with pytest.raises(TypeError):
        seq.acquire(range(0, 4), 4)
    with pytest.raises(kvh.RangeError):
        seq.acquire(0, 1000)


def test_bad_config():
    with pytest.raises(TypeError):
        kvh.Engine(no_such_field=1)
    with pytest.raises(ValueError, match="dtype"):
        kvh.Engine(dtype="f8")
    with pytest.raises(ValueError, match="backend"):
        kvh.Engine(backend="tpu")
    with pytest.raises(ValueError, match="head_dim"):
        kvh.Engine(head_dim=-1)
    with pytest.raises(TypeError):
        kvh.Engine("not a config")
    with pytest.raises(ValueError, match="NUL"):
        kvh.Engine(disk_path="a\0b", disk_bytes=1 << 20)


@pytest.mark.parametrize(
    "field",
    [
        "prefault_memory",
        "vmap",
        "copy_moves",
        "disk_strict_index",
        "remote_tls",
        "disk_reset_on_mismatch",
        "disk_buffered",
        "disk_share_group",
    ],
)
def test_bad_on_off_config_is_refused(field):
    """An on/off field given a string, a float or a count other than 0/1
    used to be read by its truth: prefault_memory="off" backed the tiers,
    disk_reset_on_mismatch="false" emptied a store of another geometry."""
    for bad in ("off", "0", "", 0.0, [0]):
        with pytest.raises(TypeError, match=field):
            kvh.Engine(backend="cpu", device_bytes=1 << 20, host_bytes=1 << 20, **{field: bad})
    for bad in (2, -1):
        with pytest.raises(ValueError, match=field):
            kvh.Engine(backend="cpu", device_bytes=1 << 20, host_bytes=1 << 20, **{field: bad})


@pytest.mark.parametrize("field", ["disk_path", "remote_addrs", "remote_user", "remote_password", "remote_tls_ca"])
def test_text_config_is_checked_and_named(field):
    """disk_path=5 (or remote_addrs=5) raised os.fsencode's TypeError, which
    names no argument; a NUL in disk_path was reported as a missing
    disk_bytes first."""
    extra = {"disk_bytes": 1 << 20} if field == "disk_path" else {}
    for bad, error in ((5, TypeError), (["a"], TypeError), ("a\0b", ValueError)):
        with pytest.raises(error, match=field):
            kvh.Engine(backend="cpu", device_bytes=1 << 20, host_bytes=1 << 20, **extra, **{field: bad})
    with pytest.raises(ValueError, match="disk_path"):
        kvh.Engine(backend="cpu", device_bytes=1 << 20, host_bytes=1 << 20, disk_path="a\0b")


def test_on_off_config_takes_bools_and_0_1():
    for value, want in ((False, False), (0, False), (np.bool_(False), False), (True, True), (1, True)):
        with kvh.Engine(backend="cpu", device_bytes=1 << 20, host_bytes=1 << 20, prefault_memory=value) as eng:
            assert eng.config.prefault_memory is want


def test_block_pin_takes_a_bool(engine):
    """Block.pin("no") used to pin: the argument was read by its truth."""
    b = engine.block_alloc()
    for bad in ("no", "", 0.0, None):
        with pytest.raises(TypeError, match="pinned"):
            b.pin(bad)
    with pytest.raises(ValueError, match="pinned"):
        b.pin(2)
    assert b.info().pins == 0
    b.pin(1)
    b.pin(np.bool_(True))
    assert b.info().pins == 2
    b.pin(False)
    b.unpin()
    assert b.info().pins == 0
    b.release()


@pytest.mark.parametrize("size", [{}, {"disk_bytes": None}, {"disk_bytes": 0}], ids=["unset", "None", "0"])
def test_disk_path_without_disk_bytes_is_refused(tmp_path, size):
    """It used to open an engine without a disk tier, found out only when
    persist() raised UnsupportedError."""
    store = tmp_path / "store"
    with pytest.raises(kvh.InvalidArgumentError, match=r"disk_path=.*needs disk_bytes > 0") as info:
        kvh.Engine(backend="cpu", disk_path=str(store), **size)
    assert isinstance(info.value, ValueError) and info.value.status == kvh.lib.KVH_ERR_INVALID_ARG
    with pytest.raises(kvh.InvalidArgumentError, match="disk_bytes"):
        kvh.Engine(kvh.Config(backend="cpu", disk_path=store, **size))
    assert not store.exists()


def test_attention_input_checks(engine):
    with engine.sequence(tokens=range(4)) as s:
        with pytest.raises(ValueError, match=re.escape("(1, num_q_heads, 8)")):
            engine.attention_decode(0, [s], np.zeros((1, 2, 4), np.float32))
        with pytest.raises(ValueError, match="multiple of num_kv_heads=2"):
            engine.attention_decode(0, [s], np.zeros((1, 3, 8), np.float32))
        with pytest.raises(TypeError, match="float32 or float16"):
            engine.attention_decode(0, [s], np.zeros((1, 2, 8), np.float64))
        with pytest.raises(TypeError):
            engine.attention_decode(0, s, np.zeros((1, 2, 8), np.float32))  # not a list
        with pytest.raises(ValueError, match="q_lens"):
            engine.attention_prefill(0, [s], [1, 2], np.zeros((3, 2, 8), np.float32))


def test_cross_engine_objects(engine):
    with kvh.Engine(num_layers=2, num_kv_heads=2, head_dim=8, dtype="f32", backend="cpu") as other:
        with other.sequence(tokens=range(4)) as s:
            with pytest.raises(ValueError, match="another engine"):
                engine.prefetch(s)
            with pytest.raises(ValueError, match="another engine"):
                engine.migrate(s.blocks(), "host")
            # as the library and the other bindings report it
            for call in (lambda: engine.hint(s), lambda: engine.migrate(s.blocks(), "host")):
                with pytest.raises(kvh.BadHandleError) as info:
                    call()
                assert info.value.name == "KVH_ERR_BAD_HANDLE"


def test_failures_carry_the_library_detail(engine):
    """truncate() read the sequence's length after a failure, which
    replaced the library's detail with a generic text; prefix_hash() of a
    wrong token count raised a plain ValueError where the library and
    the other bindings give KVH_ERR_INVALID_ARG."""
    with engine.sequence(tokens=range(3)) as s:
        with pytest.raises(kvh.RangeError, match="truncate to 4 > length 3"):
            s.truncate(4)
    with pytest.raises(kvh.InvalidArgumentError, match="block_tokens") as info:
        engine.prefix_hash(np.arange(engine.block_tokens - 1))
    assert info.value.name == "KVH_ERR_INVALID_ARG"


def test_closed_engine_raises_everywhere():
    eng = kvh.Engine(num_kv_heads=2, head_dim=8, dtype="f32", backend="cpu")
    seq = eng.sequence(tokens=range(20))
    blk = seq.blocks()[0]
    owned = eng.block_alloc()
    hold = seq.acquire()
    fence = eng.prefetch(seq)
    eng.close()
    k = np.zeros((1, 2, 8), np.float32)
    calls = [
        lambda: eng.sequence(),
        lambda: eng.stats(),
        lambda: eng.tier_info("device"),
        lambda: eng.tiers(),
        lambda: eng.prefetch(seq),
        lambda: eng.block_alloc(),
        lambda: eng.prefix_lookup([1]),
        lambda: eng.set_agent_quota(1, 0),
        lambda: eng.block_table([seq]),
        lambda: eng.migrate([blk], "host"),
        lambda: seq.append([1]),
        lambda: seq.write_kv(0, 0, k, k),
        lambda: seq.read_kv(0),
        lambda: len(seq),
        lambda: seq.fork(),
        lambda: seq.acquire(),
        lambda: seq.persist(),
        lambda: seq.match_prefix([1]),
        lambda: seq.tokens(),
        lambda: seq.block_view(0, 0),
        lambda: blk.info(),
        lambda: blk.pin(),
        lambda: owned.retain(),
        lambda: eng.attention_decode(0, [seq], np.zeros((1, 2, 8), np.float32)),
        lambda: eng.__enter__(),
    ]
    for call in calls:
        with pytest.raises(kvh.ClosedError):
            call()
    # releasing / freeing after close is a quiet no-op, never a crash
    # (an owned block's release() and a pool's unregister() used to raise
    # ClosedError there)
    hold.release()
    fence.close()
    seq.free()
    owned.release()
    owned.release()
    assert not owned.owned
    owned = blk = None
    gc.collect()
    assert "closed" in repr(eng)


def test_freed_sequence_raises(engine):
    s = engine.sequence(tokens=range(20))
    child = s.fork()
    s.free()
    k = np.zeros((1, 2, 8), np.float32)
    for call in (
        lambda: s.append([1]),
        lambda: s.read_kv(0),
        lambda: s.write_kv(0, 0, k, k),
        lambda: len(s),
        lambda: s.fork(),
        lambda: s.acquire(),
        lambda: engine.prefetch(s),
        lambda: s.blocks(),
    ):
        with pytest.raises(kvh.BadHandleError):
            call()
    assert len(child) == 20  # the fork is unaffected
    child.free()


def test_stale_block_handle(engine):
    with engine.sequence(tokens=range(4)) as s:
        blk = s.blocks()[0]
    with pytest.raises(kvh.BadHandleError):
        blk.info()  # the block was freed with its sequence


def test_close_waits_for_calls_in_flight():
    eng = kvh.Engine(num_kv_heads=2, head_dim=8, dtype="f32", backend="cpu")
    seq = eng.sequence(tokens=range(64))
    errors = []
    stop = threading.Event()

    def worker():
        while not stop.is_set():
            try:
                eng.prefetch(seq).close()
                len(seq)
                eng.stats()
            except kvh.ClosedError:
                return
            except Exception as exc:  # anything else is a bug
                errors.append(exc)
                return

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    eng.close()
    stop.set()
    for t in threads:
        t.join(10)
    assert not errors


@pytest.mark.parametrize("bad,error", [("no", TypeError), ("", TypeError), (0.0, TypeError), (2, ValueError)])
def test_wait_arguments_take_a_bool(engine, seq, bad, error):
    """wait="no" used to wait and return None where a Fence was expected."""
    blocks = seq.blocks()
    with pytest.raises(error, match="wait"):
        seq.acquire(wait=bad)
    with pytest.raises(error, match="wait"):
        seq.migrate("host", wait=bad)
    with pytest.raises(error, match="wait"):
        engine.migrate(blocks, "host", wait=bad)
    assert all(b.info().tier == kvh.Tier.DEVICE for b in blocks)
    seq.migrate("host", wait=0).result(30)
    assert all(b.info().tier == kvh.Tier.HOST for b in blocks)
    assert engine.migrate(blocks, "device", wait=np.bool_(True)) is None
    seq.acquire(wait=1).release()


def test_a_tier_budget_past_the_block_limit_says_it_was_cut():
    # The message named 16 TiB for device_bytes=2**63 without saying why.
    with pytest.raises(kvh.OutOfMemoryError) as info:
        kvh.Engine(device_bytes=2**63)
    assert "most blocks a tier holds" in str(info.value)


@pytest.mark.parametrize("field", ["dtype", "backend", "eviction_policy", "kv_codec", "log_level"])
def test_a_huge_bad_value_is_cut_in_the_message(field):
    """The message repeated the whole value: a 100,000-character string
    made a 100,000-character error."""
    with pytest.raises(ValueError) as info:
        kvh.Engine(**{field: "x" * 100_000})
    text = str(info.value)
    assert len(text) < 400 and "(100002 characters)" in text, text


def test_an_int_past_the_digit_limit_is_named_not_printed():
    """repr() of an int past Python's 4300-digit limit raises: the message
    was that ValueError, naming neither the argument nor what it takes."""
    with pytest.raises(ValueError, match="int of .* bits.*expected"):
        kvh.Engine(dtype=10**5000)
    # The shared integer checks name the argument and its range too.
    for kw in (dict(block_tokens=10**5000), dict(device_bytes=10**5000), dict(block_tokens=-(10**5000))):
        with pytest.raises(ValueError, match=f"{next(iter(kw))} must .*int of .* bits"):
            kvh.Engine(**kw)
