"""Buffers handed to the Python binding by a hostile caller: arrays of the
wrong dtype, shape or layout, read-only outputs, byte objects and lists
where arrays are expected, numpy scalars and absurd integers, arrays that
alias each other or the cache, and arrays reshaped or resized by another
thread while a call runs. Every misuse must raise a typed exception
(kvh.Error, TypeError or ValueError) whose detail names no C function,
leave stored data and caller buffers untouched, and never crash; odd but
valid buffers must give exactly the right bytes. Cases that could corrupt
memory run in a child process."""

from __future__ import annotations


import numpy as np
import pytest

import kvh_cache as kvh
import kvh_cache.codec as kc
from kvh_cache.pool import Pool
from kvh_testutil import filled_seq, make_engine, raises_typed, reference_attention, run_child, typed_errors

TYPED = typed_errors()
SENTINEL = np.float32(-12345.5)


def assert_intact(seq, data):
    for layer, (k, v) in data.items():
        k2, v2 = seq.read_kv(layer, 0, len(k))
        assert np.array_equal(k2, k) and np.array_equal(v2, v)


def sentinel_like(shape, dtype=np.float32):
    return np.full(shape, SENTINEL, dtype)


@pytest.fixture
def filled(engine):
    seq, data = filled_seq(engine, 40)
    yield seq, data
    seq.free()


class Index:
    """An int-like object whose __index__ returns value (or raises it)."""

    def __init__(self, value):
        self.value = value
        self.calls = 0

    def __index__(self):
        self.calls += 1
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value


# ---- write_kv inputs -------------------------------------------------------------------

_K = np.ones((4, 2, 8), np.float32)

BAD_WRITE_INPUTS = {
    "list": (_K.tolist(), TypeError),
    "bytes": (_K.tobytes(), TypeError),
    "bytearray": (bytearray(_K.tobytes()), TypeError),
    "memoryview": (memoryview(_K), TypeError),
    "none": (None, TypeError),
    "float64": (_K.astype(np.float64), TypeError),
    "float16": (_K.astype(np.float16), TypeError),
    "int32": (_K.astype(np.int32), TypeError),
    "big-endian-f32": (_K.astype(">f4"), TypeError),
    "bool": (_K.astype(bool), TypeError),
    "object": (_K.astype(object), TypeError),
    "2d": (_K.reshape(4, 16), ValueError),
    "4d": (_K.reshape(1, 4, 2, 8), ValueError),
    "0d": (np.array(1.0, np.float32), ValueError),
    "heads-swapped": (np.ones((4, 8, 2), np.float32), ValueError),
    "wrong-head-dim": (np.ones((4, 2, 9), np.float32), ValueError),
    "step-slice": (np.ones((8, 2, 8), np.float32)[::2], ValueError),
    "reversed": (np.ones((4, 2, 8), np.float32)[::-1], ValueError),
    "inner-reversed": (np.ones((4, 2, 8), np.float32)[:, :, ::-1], ValueError),
    "transposed": (np.ones((8, 2, 4), np.float32).transpose(2, 1, 0), ValueError),
    "fortran": (np.asfortranarray(np.ones((4, 2, 8), np.float32)), ValueError),
    "numpy-scalar": (np.float32(1.0), TypeError),
    # its mask would be ignored: the bytes under masked entries written
    "masked": (np.ma.masked_array(_K, mask=np.eye(8, dtype=bool)[None, :2, :].repeat(4, 0)), TypeError),
}


@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("name", sorted(BAD_WRITE_INPUTS))
def test_write_kv_refuses_bad_inputs_and_writes_nothing(filled, name, which):
    seq, data = filled
    bad, error = BAD_WRITE_INPUTS[name]
    good = np.full((4, 2, 8), 3.0, np.float32)
    k, v = (bad, good) if which == "k" else (good, bad)
    raises_typed(lambda: seq.write_kv(0, 4, k, v), error)
    assert len(seq) == 40
    assert_intact(seq, data)


def test_write_kv_refuses_k_and_v_of_different_lengths(filled):
    seq, data = filled
    raises_typed(lambda: seq.write_kv(0, 0, np.ones((4, 2, 8), np.float32), np.ones((3, 2, 8), np.float32)), ValueError)
    raises_typed(lambda: seq.write_kv(0, 0, np.ones((0, 2, 8), np.float32), np.ones((1, 2, 8), np.float32)), ValueError)
    assert_intact(seq, data)


def test_write_kv_with_one_array_as_k_and_v(filled):
    """The same (read-only) array as both inputs is fine: K and V get the
    same values."""
    seq, data = filled
    kv = np.arange(4 * 2 * 8, dtype=np.float32).reshape(4, 2, 8)
    kv.flags.writeable = False
    seq.write_kv(1, 8, kv, kv)
    k, v = seq.read_kv(1, 8, 4)
    assert np.array_equal(k, kv) and np.array_equal(v, kv)
    k, v = seq.read_kv(1, 0, 8)
    assert np.array_equal(k, data[1][0][:8]) and np.array_equal(v, data[1][1][:8])
    k, v = seq.read_kv(1, 12, 28)
    assert np.array_equal(k, data[1][0][12:]) and np.array_equal(v, data[1][1][12:])


def test_write_kv_accepts_contiguous_views_of_bigger_buffers(filled):
    """A C-contiguous slice in the middle of a bigger buffer: exactly its
    elements are written, not its neighbours."""
    seq, _ = filled
    buf = np.full(3 * 64, SENTINEL, np.float32)
    buf[64:128] = np.arange(64, dtype=np.float32)
    k = buf[64:128].reshape(4, 2, 8)
    seq.write_kv(0, 0, k, k)
    got_k, got_v = seq.read_kv(0, 0, 4)
    assert np.array_equal(got_k, k) and np.array_equal(got_v, k)
    assert not (seq.read_kv(0, 4, 36)[0] == SENTINEL).any()


@pytest.mark.parametrize(
    "bad,error",
    [
        (np.float64(0), TypeError),
        (np.bool_(True), TypeError),
        (True, TypeError),
        (0.0, TypeError),
        ("0", TypeError),
        (None, TypeError),
        (-1, ValueError),
        (1 << 64, ValueError),
        (Index(1 << 70), ValueError),
        (Index(-3), ValueError),
        (Index(1.5), TypeError),
        (np.array([0]), TypeError),
    ],
    ids=["f64", "np-bool", "bool", "float", "str", "none", "neg", "2**64", "idx-huge", "idx-neg", "idx-float", "1d"],
)
def test_write_and_read_kv_positions_are_checked(filled, bad, error):
    seq, data = filled
    k = np.ones((2, 2, 8), np.float32)
    raises_typed(lambda: seq.write_kv(bad, 0, k, k), error)
    raises_typed(lambda: seq.write_kv(0, bad, k, k), error)
    raises_typed(lambda: seq.read_kv(bad, 0, 2), error)
    if bad is not None:  # None is a documented default for pos and n
        raises_typed(lambda: seq.read_kv(0, bad, 2), error)
        raises_typed(lambda: seq.read_kv(0, 0, bad), error)
    assert_intact(seq, data)


@pytest.mark.parametrize(
    "make", [np.int8, np.uint64, np.int64, np.array, Index], ids=["i8", "u64", "i64", "0d", "index"]
)
def test_numpy_ints_and_index_objects_are_positions(filled, make):
    seq, data = filled
    k, v = seq.read_kv(make(1), make(3), make(3))
    assert np.array_equal(k, data[1][0][3:6]) and np.array_equal(v, data[1][1][3:6])
    seq.write_kv(make(1), make(3), k[::-1].copy(), v[::-1].copy())
    k2, v2 = seq.read_kv(1, 3, 3)
    assert np.array_equal(k2, k[::-1]) and np.array_equal(v2, v[::-1])


def test_numpy_int_layer_past_num_layers_is_a_range_error(filled):
    seq, data = filled
    for layer in (np.int8(3), np.uint64(2), np.uint64((1 << 32) - 1)):
        raises_typed(lambda: seq.read_kv(layer, 0, 1), kvh.RangeError)
    assert_intact(seq, data)


@pytest.mark.parametrize("exc", [RuntimeError("boom"), ZeroDivisionError()], ids=["runtime", "zerodiv"])
def test_an_index_that_raises_propagates_and_changes_nothing(filled, exc):
    seq, data = filled
    k = np.zeros((2, 2, 8), np.float32)
    with pytest.raises(type(exc)):
        seq.write_kv(0, Index(exc), k, k)
    with pytest.raises(type(exc)):
        seq.read_kv(0, Index(exc), 2)
    assert len(seq) == 40
    assert_intact(seq, data)


@pytest.mark.parametrize(
    "dtype,bad",
    [("f16", np.float32), ("f16", np.uint16), ("bf16", np.float16), ("bf16", np.float32), ("bf16", np.int16)],
)
def test_kv_arrays_must_have_the_engine_dtype(dtype, bad):
    with make_engine(dtype=dtype) as eng:
        seq, data = filled_seq(eng, 20)
        x = np.zeros((4, 2, 8), bad)
        raises_typed(lambda: seq.write_kv(0, 0, x, x), TypeError)
        raises_typed(lambda: seq.read_kv(0, 0, 4, out=(x, x.copy())), TypeError)
        good = np.zeros((4, 2, 8), eng.np_dtype)
        raises_typed(lambda: seq.write_kv(0, 0, good, x), TypeError)
        assert_intact(seq, data)
        k, v = seq.read_kv(0, 2, 4, out=(good, np.empty_like(good)))
        assert k is good and np.array_equal(k, data[0][0][2:6]) and np.array_equal(v, data[0][1][2:6])


# ---- read_kv outputs ---------------------------------------------------------------------


def _bad_out(kind):
    """An output array of kind for 4 tokens of (2, 8) f32, and the memory
    around it to check for writes."""
    if kind == "read-only":
        a = sentinel_like((4, 2, 8))
        a.flags.writeable = False
        return a, a
    if kind == "step-slice":
        big = sentinel_like((8, 2, 8))
        return big[::2], big
    if kind == "reversed":
        big = sentinel_like((4, 2, 8))
        return big[::-1], big
    if kind == "inner-step":
        big = sentinel_like((4, 2, 16))
        return big[:, :, ::2], big
    if kind == "transposed":
        big = sentinel_like((8, 2, 4))
        return big.transpose(2, 1, 0), big
    if kind == "fortran":
        a = np.asfortranarray(sentinel_like((4, 2, 8)))
        return a, a
    if kind == "too-long":
        a = sentinel_like((5, 2, 8))
        return a, a
    if kind == "too-short":
        a = sentinel_like((3, 2, 8))
        return a, a
    if kind == "flat":
        a = sentinel_like((64,))
        return a, a
    if kind == "float64":
        a = np.full((4, 2, 8), SENTINEL, np.float64)
        return a, a
    if kind == "big-endian":
        a = np.full((4, 2, 8), SENTINEL, ">f4")
        return a, a
    if kind == "zero-size":
        a = sentinel_like((0, 2, 8))
        return a, a
    raise AssertionError(kind)


OUT_KINDS = {
    "read-only": ValueError,
    "step-slice": ValueError,
    "reversed": ValueError,
    "inner-step": ValueError,
    "transposed": ValueError,
    "fortran": ValueError,
    "too-long": ValueError,
    "too-short": ValueError,
    "flat": ValueError,
    "float64": TypeError,
    "big-endian": TypeError,
    "zero-size": ValueError,
}


@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("kind", sorted(OUT_KINDS))
def test_read_kv_refuses_bad_outputs_without_touching_them(filled, kind, which):
    seq, data = filled
    bad, memory = _bad_out(kind)
    before = memory.copy()
    good = sentinel_like((4, 2, 8))
    out = (bad, good) if which == 0 else (good, bad)
    raises_typed(lambda: seq.read_kv(0, 4, 4, out=out), OUT_KINDS[kind])
    assert np.array_equal(memory, before, equal_nan=True)
    assert (good == SENTINEL).all()
    assert_intact(seq, data)


@pytest.mark.parametrize(
    "out",
    [
        [np.zeros((4, 2, 8), np.float32)] * 2,
        (np.zeros((4, 2, 8), np.float32),),
        (np.zeros((4, 2, 8), np.float32),) * 3,
        (bytearray(256), bytearray(256)),
        (memoryview(bytearray(256)), memoryview(bytearray(256))),
        (np.zeros((4, 2, 8), np.float32).tolist(), np.zeros((4, 2, 8), np.float32)),
        "kv",
        np.zeros((2, 4, 2, 8), np.float32),
    ],
    ids=["list", "1-tuple", "3-tuple", "bytearrays", "memoryviews", "nested-list", "str", "stacked-array"],
)
def test_read_kv_out_must_be_a_tuple_of_two_arrays(filled, out):
    seq, data = filled
    raises_typed(lambda: seq.read_kv(0, 0, 4, out=out), TypeError)
    assert_intact(seq, data)


def test_read_kv_into_views_of_a_bigger_buffer_fills_exactly_the_view(filled):
    """Contiguous views in the middle of sentinel-filled buffers: the read
    fills the viewed elements and nothing around them."""
    seq, data = filled
    kbig = sentinel_like((12, 2, 8))
    vbig = sentinel_like((12, 2, 8))
    k, v = seq.read_kv(1, 10, 5, out=(kbig[3:8], vbig[6:11]))
    assert k.base is not None and np.shares_memory(k, kbig)
    assert np.array_equal(kbig[3:8], data[1][0][10:15]) and np.array_equal(vbig[6:11], data[1][1][10:15])
    assert (kbig[:3] == SENTINEL).all() and (kbig[8:] == SENTINEL).all()
    assert (vbig[:6] == SENTINEL).all() and (vbig[11:] == SENTINEL).all()


def test_read_kv_zero_tokens_into_zero_size_outputs(filled):
    seq, _ = filled
    k0 = np.empty((0, 2, 8), np.float32)
    k, v = seq.read_kv(0, 5, 0, out=(k0, k0))
    assert k is k0 and v is k0


def test_read_kv_refuses_one_array_as_both_outputs(filled):
    """out=(a, a): V would silently overwrite K, and the returned "k" is V.
    Overlapping outputs must be refused."""
    seq, data = filled
    a = sentinel_like((4, 2, 8))
    raises_typed(lambda: seq.read_kv(0, 0, 4, out=(a, a)), ValueError)
    assert (a == SENTINEL).all()
    big = sentinel_like((6, 2, 8))
    raises_typed(lambda: seq.read_kv(0, 0, 4, out=(big[:4], big[2:])), ValueError)
    assert (big == SENTINEL).all()
    assert_intact(seq, data)


# ---- arrays aliasing the cache itself ---------------------------------------------------


def _partial_block_seq(eng, seed):
    """A sequence of 15 tokens (one partial block: its block view is writable)."""
    seq, data = filled_seq(eng, 15, seed=seed)
    view = seq.block_view(0, 0)
    assert view.flags.writeable
    return seq, data, view


@pytest.mark.parametrize("shift", [1, -1], ids=["forward", "backward"])
def test_read_kv_into_a_block_view_of_the_same_tokens(shift):
    """The writable block view of a one-head engine holds a block's tokens
    contiguously, so it is a valid read_kv output. Reading tokens into the
    view shifted by one token must copy as NumPy would (as if through a
    temporary), not smear the first token over the rest."""
    with make_engine(num_kv_heads=1) as eng:
        seq, data, view = _partial_block_seq(eng, 7)
        k0, v0 = data[0][0][:, 0].copy(), data[0][1][:, 0].copy()
        if shift == 1:
            out = (view[0, 0, 1:15].reshape(14, 1, 8), view[1, 0, 1:15].reshape(14, 1, 8))
            seq.read_kv(0, 0, 14, out=out)
            assert np.array_equal(view[0, 0, 1:15], k0[:14]) and np.array_equal(view[1, 0, 1:15], v0[:14])
        else:
            out = (view[0, 0, 0:14].reshape(14, 1, 8), view[1, 0, 0:14].reshape(14, 1, 8))
            seq.read_kv(0, 1, 14, out=out)
            assert np.array_equal(view[0, 0, 0:14], k0[1:15]) and np.array_equal(view[1, 0, 0:14], v0[1:15])
        del out, view
        seq.free()


@pytest.mark.parametrize("shift", [1, -1], ids=["forward", "backward"])
def test_write_kv_from_a_block_view_of_the_same_tokens(shift):
    """write_kv whose input is the block's own memory shifted by one token
    must store the input as it was when the call began."""
    with make_engine(num_kv_heads=1) as eng:
        seq, data, view = _partial_block_seq(eng, 8)
        k0, v0 = data[0][0].copy(), data[0][1].copy()
        if shift == 1:
            seq.write_kv(0, 1, view[0, 0, 0:14].reshape(14, 1, 8), view[1, 0, 0:14].reshape(14, 1, 8))
            k, v = seq.read_kv(0, 1, 14)
            assert np.array_equal(k, k0[:14]) and np.array_equal(v, v0[:14])
        else:
            seq.write_kv(0, 0, view[0, 0, 1:15].reshape(14, 1, 8), view[1, 0, 1:15].reshape(14, 1, 8))
            k, v = seq.read_kv(0, 0, 14)
            assert np.array_equal(k, k0[1:15]) and np.array_equal(v, v0[1:15])
        del view
        seq.free()


# ---- arrays changed by another thread during a call -------------------------------------

_HOLD_SEQUENCE = """
import threading, time
import numpy as np
import kvh_cache as kvh
import kvh_cache.engine as em
from kvh_testutil import filled_seq, make_engine

eng = make_engine()
seq, data = filled_seq(eng, 40)
real, inside, go = em.lib, threading.Event(), threading.Event()

class Slow:  # a call on seq stays in flight (holding the sequence) until go
    def __getattr__(self, name):
        fn = getattr(real, name)
        if name != "kvh_seq_tokens":
            return fn
        def slow(*args):
            inside.set()
            go.wait()
            return fn(*args)
        return slow

em.lib = Slow()
holder = threading.Thread(target=seq.tokens)
holder.start()
inside.wait()
em.lib = real

def queued():  # another thread's call on seq is waiting for its turn
    deadline = time.monotonic() + 10
    while not seq._gate._queue:
        assert time.monotonic() < deadline, "the second call never queued"
        time.sleep(0.001)
"""


def test_write_kv_array_reshaped_while_waiting_for_the_sequence():
    """write_kv checks k's shape, then waits for another thread's call on
    the same sequence; meanwhile a third party reshapes k in place (same
    size, (4, 2, 8) -> (8, 1, 8)). The call must use the shape it checked
    (or refuse): reading k.shape[0] again after the wait made the library
    copy 8 tokens of (2, 8) from a 4-token buffer, reading past the end of
    both arrays into the neighbouring memory."""
    res = run_child(
        _HOLD_SEQUENCE
        + """
kbuf = np.full(256, 777.0, np.float32)
vbuf = np.full(256, 555.0, np.float32)
k = kbuf[:64].reshape(4, 2, 8)
v = vbuf[:64].reshape(4, 2, 8)
k[...] = 1.0
v[...] = 2.0
errs = []
def writer():
    try:
        seq.write_kv(0, 0, k, v)
    except (kvh.Error, TypeError, ValueError) as exc:
        errs.append(exc)
w = threading.Thread(target=writer)
w.start()
queued()
k.shape = (8, 1, 8)
go.set()
w.join(10)
holder.join(10)
k2, v2 = seq.read_kv(0, 0, 8)
past = bool((k2 == 777.0).any() or (v2 == 555.0).any())
later = bool(np.array_equal(k2[4:], data[0][0][4:8]) and np.array_equal(v2[4:], data[0][1][4:8]))
print("read-past-end" if past else "ok", "later-intact" if later else "later-changed", len(errs))
"""
    )
    assert res.stdout.split()[:2] == ["ok", "later-intact"], res.stdout


def test_array_resized_during_a_call_is_refused_to_the_resizer():
    """While write_kv (queued behind another call) and read_kv hold their
    arrays, a resize from another thread must fail there (the arrays are
    in use), and the calls see the bytes they were given."""
    res = run_child(
        _HOLD_SEQUENCE
        + """
k = np.full((4, 2, 8), 5.0, np.float32)
v = np.full((4, 2, 8), 6.0, np.float32)
errs, resize_errs = [], []
def writer():
    try:
        seq.write_kv(1, 8, k, v)
    except BaseException as exc:
        errs.append(repr(exc))
w = threading.Thread(target=writer)
w.start()
queued()
for a in (k, v):
    try:
        a.resize((1 << 20,), refcheck=True)
    except (ValueError, BufferError) as exc:
        resize_errs.append(type(exc).__name__)
go.set()
w.join(10)
holder.join(10)
assert not errs, errs
assert k.shape == (4, 2, 8) and v.shape == (4, 2, 8)
k2, v2 = seq.read_kv(1, 8, 4)
assert (k2 == 5.0).all() and (v2 == 6.0).all()
print("ok", len(resize_errs))
"""
    )
    assert res.stdout.split() == ["ok", "2"], res.stdout


# ---- tokens --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens",
    [
        np.arange(40, dtype=np.int64)[::2],
        np.arange(20, dtype=np.int32)[::-1],
        np.arange(20, dtype=np.uint8).reshape(4, 5).T.copy(order="F").reshape(-1, order="F"),
        np.asfortranarray(np.arange(20, dtype=np.int16)),
        np.arange(20, dtype=np.int64).reshape(20, 1)[:, 0],
    ],
    ids=["step", "reversed", "uint8", "int16", "column"],
)
def test_odd_token_arrays_append_their_values(engine, tokens):
    ro = tokens.copy()
    ro.flags.writeable = False
    for arr in (tokens, ro):
        with engine.sequence(tokens=arr) as seq:
            assert np.array_equal(seq.tokens(), arr.astype(np.int32))


@pytest.mark.parametrize(
    "tokens,error",
    [
        (np.arange(20).reshape(4, 5), ValueError),
        (np.arange(20).reshape(4, 5).T, ValueError),
        (np.array([1, 2], dtype=np.uint64) + np.uint64(1 << 63), ValueError),
        (np.array([-(1 << 31) - 1]), ValueError),
        (np.array([1.0, 2.0]), TypeError),
        (np.array([1 + 0j]), TypeError),
        (np.zeros(0, np.float32), TypeError),
        (np.array(["1"]), TypeError),
        ([np.float32(1)], TypeError),
        ([Index(1)], TypeError),
        (None, TypeError),
        (b"", TypeError),
        (np.int32(5), ValueError),
        # its mask would be ignored: the masked id appended as it lies
        (np.ma.array([1, 2, 3], mask=[0, 1, 0]), TypeError),
    ],
    ids=[
        "2d",
        "2d-T",
        "u64-huge",
        "below-int32",
        "float",
        "complex",
        "empty-float",
        "str",
        "np-float",
        "index-obj",
        "none",
        "empty-bytes",
        "scalar",
        "masked",
    ],
)
def test_bad_token_arrays_are_refused(filled, tokens, error):
    seq, data = filled
    raises_typed(lambda: seq.append(tokens), error)
    raises_typed(lambda: seq.match_prefix(tokens), error)
    assert len(seq) == 40
    assert_intact(seq, data)


def test_prefix_hash_and_lookup_read_views_by_value(engine):
    base = np.arange(64, dtype=np.int64)
    view = base[::4]  # 16 ids, strided
    assert engine.prefix_hash(view) == engine.prefix_hash(np.ascontiguousarray(view, np.int32))
    assert engine.prefix_hash(view[::-1]) == engine.prefix_hash(list(range(60, -1, -4)))
    assert engine.prefix_lookup(np.zeros(0, np.int32)) == []
    assert engine.prefix_lookup(view[:3]) == []


def test_tokens_read_back_with_numpy_positions(filled):
    seq, _ = filled
    assert np.array_equal(seq.tokens(np.uint64(5), np.int8(3)), np.arange(5, 8, dtype=np.int32))
    raises_typed(lambda: seq.tokens(np.uint64(1 << 63), 1), kvh.RangeError)
    raises_typed(lambda: seq.tokens(0.0, 1), TypeError)


# ---- attention --------------------------------------------------------------------------------


@pytest.fixture
def resident(engine):
    seqs, datas = [], []
    for i in range(3):
        s, d = filled_seq(engine, 20 + 7 * i, seed=i)
        s.acquire()
        seqs.append(s)
        datas.append(d)
    yield seqs, datas
    for s in seqs:
        s.free()


def _q(rows, hq=4, dtype=np.float32, seed=5):
    return np.random.default_rng(seed).standard_normal((rows, hq, 8)).astype(dtype)


def test_attention_decode_refuses_bad_outputs_without_touching_them(engine, resident):
    seqs, _ = resident
    q = _q(3)
    cases = {
        "read-only": (lambda: _ro(sentinel_like((3, 4, 8))), ValueError),
        "fortran": (lambda: np.asfortranarray(sentinel_like((3, 4, 8))), ValueError),
        "reversed": (lambda: sentinel_like((3, 4, 8))[::-1], ValueError),
        "f64": (lambda: np.full((3, 4, 8), SENTINEL, np.float64), ValueError),
        "f16": (lambda: np.full((3, 4, 8), SENTINEL, np.float16), ValueError),
        "rows": (lambda: sentinel_like((2, 4, 8)), ValueError),
        "flat": (lambda: sentinel_like((96,)), ValueError),
        "bytearray": (lambda: bytearray(3 * 4 * 8 * 4), TypeError),
        "list": (lambda: sentinel_like((3, 4, 8)).tolist(), TypeError),
    }
    for name, (make, error) in cases.items():
        out = make()
        before = out.copy() if isinstance(out, np.ndarray) else bytes(out) if isinstance(out, bytearray) else None
        raises_typed(lambda: engine.attention_decode(0, seqs, q, out=out), error)
        if isinstance(out, np.ndarray):
            assert np.array_equal(out, before), name
        elif isinstance(out, bytearray):
            assert bytes(out) == before, name


def _ro(a):
    a.flags.writeable = False
    return a


@pytest.mark.parametrize(
    "q,error",
    [
        (np.zeros((3, 4, 8), np.float64), TypeError),
        (np.zeros((3, 4, 8), ">f4"), TypeError),
        (np.zeros((3, 4, 8), np.int32), TypeError),
        (np.zeros((3, 4, 8), np.uint16), TypeError),
        (np.zeros((3, 3, 8), np.float32), ValueError),
        (np.zeros((3, 0, 8), np.float32), ValueError),
        (np.zeros((3, 4, 9), np.float32), ValueError),
        (np.zeros((2, 4, 8), np.float32), ValueError),
        (np.zeros((3, 32), np.float32), ValueError),
        (np.zeros((6, 4, 8), np.float32)[::2], ValueError),
        (np.asfortranarray(np.zeros((3, 4, 8), np.float32)), ValueError),
        (np.zeros((3, 4, 8), np.float32).tobytes(), TypeError),
        (memoryview(np.zeros((3, 4, 8), np.float32)), TypeError),
        (None, TypeError),
        (np.float32(0), TypeError),
    ],
    ids=[
        "f64",
        "big-endian",
        "int32",
        "u16-no-io",
        "heads-not-multiple",
        "no-heads",
        "dim",
        "rows",
        "2d",
        "step",
        "fortran",
        "bytes",
        "memoryview",
        "none",
        "scalar",
    ],
)
def test_attention_refuses_bad_queries(engine, resident, q, error):
    seqs, _ = resident
    raises_typed(lambda: engine.attention_decode(0, seqs, q), error)
    raises_typed(lambda: engine.attention_prefill(0, seqs, [1, 1, 1], q), error)


def test_attention_io_dtype_must_match_q(engine, resident):
    seqs, _ = resident
    raises_typed(lambda: engine.attention_decode(0, seqs, _q(3), io_dtype="bf16"), TypeError)
    raises_typed(lambda: engine.attention_decode(0, seqs, _q(3, dtype=np.float16), io_dtype="f32"), TypeError)
    raises_typed(
        lambda: engine.attention_decode(0, seqs, _q(3), io_dtype=None, out=_q(3, dtype=np.float16)), ValueError
    )
    raises_typed(lambda: engine.attention_decode(0, seqs, _q(3), io_dtype=True), (TypeError, ValueError))


def test_attention_with_out_aliasing_q_is_exact(engine, resident):
    """out=q (decode and prefill) and a read-only q give the same result as
    a separate output."""
    seqs, datas = resident
    q = _q(3)
    ref = engine.attention_decode(0, seqs, q.copy())
    for i, d in enumerate(datas):
        k, v = d[0]
        np.testing.assert_allclose(ref[i], reference_attention(k, v, q[i]), rtol=1e-4, atol=1e-5)
    same = q.copy()
    assert engine.attention_decode(0, seqs, same, out=same) is same
    assert np.array_equal(same, ref)
    assert np.array_equal(engine.attention_decode(0, seqs, _ro(q.copy())), ref)
    qp = _q(9, seed=6)
    refp = engine.attention_prefill(0, seqs, [2, 3, 4], qp.copy())
    samep = qp.copy()
    engine.attention_prefill(0, seqs, [2, 3, 4], samep, out=samep)
    assert np.array_equal(samep, refp)


@pytest.mark.parametrize("shift", [1, -1])
def test_attention_with_out_overlapping_q_in_part_is_exact(engine, resident, shift):
    """out one row past q (or before it) in the same buffer: a row written
    was queries of the next row still to be read, so decode, plans and
    streamed decode returned other values than with an out of its own."""
    seqs, _ = resident
    for label, call in (
        ("decode", lambda q, out: engine.attention_decode(0, seqs, q, out=out)),
        (
            "streamed",
            lambda q, out: engine.attention_decode(0, seqs, q, out=out, stream_chunk_blocks=1, stream_window_blocks=2),
        ),
        ("plan", lambda q, out: engine.attention_plan(0, seqs, num_q_heads=4).run(q, out=out)),
    ):
        buf = _q(4, seed=11)
        q, out = (buf[:3], buf[1:]) if shift > 0 else (buf[1:], buf[:3])
        ref = call(q.copy(), None)
        got = call(q, out)
        assert np.array_equal(got, ref), label
    qp = _q(9 + 1, seed=12)
    q, out = (qp[:9], qp[1:]) if shift > 0 else (qp[1:], qp[:9])
    refp = engine.attention_prefill(0, seqs, [2, 3, 4], q.copy())
    assert np.array_equal(engine.attention_prefill(0, seqs, [2, 3, 4], q, out=out), refp)


def test_attention_stream_handle_is_checked_on_the_cpu_too(engine, resident):
    # stream=-1, 2**64 and True were cast to a pointer without a word (the
    # CPU backend ignores the stream, a CUDA one would have used it).
    seqs, _ = resident
    q = _q(3)
    for bad, error in ((-1, ValueError), (2**64, ValueError), (True, TypeError), ("0", TypeError)):
        with pytest.raises(error):
            engine.attention_decode(0, seqs, q, stream=bad)
    assert engine.attention_decode(0, seqs, q, stream=0).shape == q.shape


def test_attention_with_np_int_q_lens_and_layer(engine, resident):
    seqs, _ = resident
    qp = _q(6)
    ref = engine.attention_prefill(0, seqs, [1, 2, 3], qp)
    assert np.array_equal(engine.attention_prefill(np.int64(0), seqs, np.array([1, 2, 3], np.uint8), qp), ref)
    for bad, error in ((np.array([1.0, 2.0, 3.0]), TypeError), ([1, 2, True], TypeError), ([1, 2, -3], ValueError)):
        raises_typed(lambda: engine.attention_prefill(0, seqs, bad, qp), error)
    raises_typed(lambda: engine.attention_prefill(0, seqs, [1, 2], qp[:3]), ValueError)
    raises_typed(lambda: engine.attention_prefill(0, seqs, [1, 2, 3, 0], qp), ValueError)


def test_attention_over_a_generator_of_sequences(engine, resident):
    """seqs is read once: a generator must either be attended like the list
    it yields or refused with TypeError, never taken for an empty batch
    (which refuses a q of one row per sequence and accepts a q of none)."""
    seqs, _ = resident
    q = _q(3)
    ref = engine.attention_decode(0, seqs, q)
    try:
        got = engine.attention_decode(0, (s for s in seqs), q)
    except TypeError:
        got = None
    except ValueError as exc:
        raise AssertionError(f"a generator of 3 sequences was read as another batch: {exc}") from None
    if got is not None:
        assert np.array_equal(got, ref)
    try:
        empty = engine.attention_decode(0, (s for s in seqs), q[:0])
    except (TypeError, ValueError):
        return
    raise AssertionError(f"a batch of 3 sequences was attended as {empty.shape[0]} rows, without an error")


def test_attention_plan_run_refuses_bad_buffers(engine, resident):
    seqs, _ = resident
    plan = engine.attention_plan(0, seqs, num_q_heads=4)
    try:
        q = _q(3)
        ref = plan.run(q)
        assert np.array_equal(ref, engine.attention_decode(0, seqs, q))
        same = q.copy()
        assert np.array_equal(plan.run(same, out=same), ref)
        out = sentinel_like((3, 4, 8))
        for bad_q, error in (
            (_q(2), ValueError),
            (_q(3, hq=2), ValueError),
            (_q(3, dtype=np.float16), TypeError),
            (_q(6)[::2], ValueError),
            (q.tobytes(), TypeError),
        ):
            raises_typed(lambda: plan.run(bad_q, out=out), error)
            assert (out == SENTINEL).all()
        raises_typed(lambda: plan.run(q, out=_ro(sentinel_like((3, 4, 8)))), ValueError)
        raises_typed(lambda: plan.run(q, out=sentinel_like((3, 4, 8))[::-1]), ValueError)
    finally:
        plan.destroy()
    raises_typed(lambda: plan.run(q), kvh.BadHandleError)


def test_vmap_attention_refuses_bad_buffers():
    with make_engine(head_dim=64, vmap=True, host_bytes=0, device_bytes=64 * 2 * 2 * 2 * 16 * 64 * 4) as eng:
        seq, _ = filled_seq(eng, 20)
        seq.acquire()
        vm = seq.vmap(0)
        try:
            q = np.random.default_rng(1).standard_normal((1, 2, 64)).astype(np.float32)
            ref = eng.attention_decode(0, [seq], q)
            assert np.array_equal(eng.attention_decode_vmap([vm], q), ref)
            assert vm.k.flags.writeable is False
            for bad, error in (
                (q.astype(np.float64), TypeError),
                (np.zeros((2, 2, 64), np.float32), ValueError),
                (np.zeros((1, 2, 128), np.float32)[:, :, ::2], ValueError),
                (q.tolist(), TypeError),
            ):
                raises_typed(lambda: eng.attention_decode_vmap([vm], bad), error)
            raises_typed(lambda: eng.attention_decode_vmap([seq], q), TypeError)
            raises_typed(lambda: eng.attention_decode_vmap([vm], q, out=_ro(np.zeros_like(q))), ValueError)
            # The view's own read-only K array is not a valid output.
            kview = vm.k
            raises_typed(lambda: eng.attention_decode_vmap([vm], q, out=kview[:1, :2]), ValueError)
        finally:
            vm.release()


# ---- weight regions ---------------------------------------------------------------------------


def test_add_region_copies_odd_buffers_by_their_bytes(engine):
    ctx = engine.context("w")
    f32 = np.arange(12, dtype=np.float32).reshape(3, 4)
    sources = {
        "bytes": b"\x01\x02\x03",
        "bytearray": bytearray(b"\x04\x05"),
        "memoryview-f32": memoryview(f32),
        "transposed": f32.T,
        "reversed": np.arange(10, dtype=np.uint8)[::-1],
        "read-only": _ro(np.arange(7, dtype=np.uint8)),
        "bool": np.array([True, False, True]),
        "strided-memoryview": memoryview(bytes(range(10)))[::2],
    }
    expected = {
        "bytes": b"\x01\x02\x03",
        "bytearray": b"\x04\x05",
        "memoryview-f32": f32.tobytes(),
        "transposed": np.ascontiguousarray(f32.T).tobytes(),
        "reversed": bytes(range(9, -1, -1)),
        "read-only": bytes(range(7)),
        "bool": b"\x01\x00\x01",
        "strided-memoryview": bytes(range(0, 10, 2)),
    }
    idx = {name: ctx.add_region(name, data=data) for name, data in sources.items()}
    sources["bytearray"][0] = 99  # copied in: later changes are not seen
    ctx.switch_to()
    for name, i in idx.items():
        assert ctx.region(i).tobytes() == expected[name], name
    ctx.destroy()


@pytest.mark.parametrize(
    "data,error",
    [
        ([1, 2, 3], TypeError),
        ("abc", TypeError),
        (np.array([object()]), TypeError),
        (np.zeros(0, np.uint8), ValueError),
        (b"", ValueError),
        (12, TypeError),
    ],
    ids=["list", "str", "object", "empty-array", "empty-bytes", "int"],
)
def test_add_region_refuses_non_buffers(engine, data, error):
    ctx = engine.context("w")
    raises_typed(lambda: ctx.add_region("r", data=data), error)
    assert ctx.regions == []
    ctx.destroy()


def test_add_region_size_must_match_and_be_an_int(engine):
    ctx = engine.context("w")
    raises_typed(lambda: ctx.add_region("r", data=b"abc", size=4), ValueError)
    raises_typed(lambda: ctx.add_region("r", data=b"abc", size=3.0), TypeError)
    raises_typed(lambda: ctx.add_region("r", data=b"abc", size=Index(-1)), ValueError)
    assert ctx.add_region("r", data=b"abc", size=np.uint8(3)) == 0
    ctx.destroy()


# ---- codec -------------------------------------------------------------------------------------


def test_codec_encode_reads_odd_layouts_by_value():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 64)).astype(np.float32)
    ref = kc.encode(x, "int8")
    assert np.array_equal(kc.encode(np.asfortranarray(x), "int8"), ref)
    assert np.array_equal(kc.encode(_ro(x.copy()), "int8"), ref)
    big = np.zeros((12, 128), np.float32)
    big[::2, ::2] = x
    assert np.array_equal(kc.encode(big[::2, ::2], "int8"), ref)
    assert np.array_equal(kc.decode(_ro(ref.copy()), "int8", 64), kc.decode(ref, "int8", 64))
    strided = np.zeros((12, ref.shape[1]), np.uint8)
    strided[::2] = ref
    assert np.array_equal(kc.decode(strided[::2], "int8", 64), kc.decode(ref, "int8", 64))


@pytest.mark.parametrize(
    "records",
    [
        lambda r: r.astype(np.float64),
        lambda r: r.astype(np.int64) + 256,
        lambda r: r.astype(np.float32) + 0.5,
    ],
    ids=["float64", "int64-past-255", "fractional"],
)
def test_codec_decode_refuses_records_that_are_not_bytes(records):
    """encode refuses a float64 input; decode used to cast any numeric
    array to uint8 (wrapping 256 to 0, truncating 0.5), decoding garbage."""
    x = np.random.default_rng(3).standard_normal((2, 64)).astype(np.float32)
    enc = kc.encode(x, "int8")
    raises_typed(lambda: kc.decode(records(enc), "int8", 64), TypeError)


def test_codec_decode_of_a_bytes_object():
    """Records held in a bytes object (read from a file) are bytes-like
    uint8 data: decoded, or refused with a message about records, not a
    failed int() parse of the data."""
    x = np.random.default_rng(4).standard_normal((2, 64)).astype(np.float32)
    enc = kc.encode(x, "int8")
    try:
        got = kc.decode(bytes(enc), "int8", 64)
    except (TypeError, ValueError) as exc:
        assert "invalid literal" not in str(exc), str(exc)[:200]
    else:
        assert np.array_equal(got.reshape(enc.shape[0], 64), kc.decode(enc, "int8", 64))


@pytest.mark.parametrize(
    "call",
    [lambda: kc.vector_bytes("int8", None, 64), lambda: kc.decode(np.zeros((1, 68), np.uint8), "int8", 64, None)],
    ids=["vector_bytes", "decode"],
)
def test_codec_dtype_none_is_a_type_error(call):
    """dtype=None was read as NumPy's default float64 ("float64 has no kvh
    equivalent"), a dtype the caller never named."""
    raises_typed(call, TypeError)


def test_codec_round_trip_refuses_a_scalar_like_encode():
    with pytest.raises(ValueError):
        kc.encode(np.float32(1.0), "int8")
    raises_typed(lambda: kc.round_trip(np.float32(1.0), "int8"), ValueError)


def test_codec_head_dim_from_numpy_and_index_objects():
    assert kc.vector_bytes("int8", "f32", np.uint16(64)) == kc.vector_bytes("int8", "f32", 64)
    assert kc.vector_bytes("int8", "f32", Index(64)) == kc.vector_bytes("int8", "f32", 64)
    raises_typed(lambda: kc.vector_bytes("int8", "f32", Index(1 << 33)), ValueError)
    raises_typed(lambda: kc.vector_bytes("int8", "f32", np.bool_(True)), TypeError)
    raises_typed(lambda: kc.decode(np.zeros((1, 68), np.uint8), "int8", np.float32(64)), TypeError)


# ---- external pools ----------------------------------------------------------------------------

PL, PH, PD, PBT, PS = 2, 2, 8, 4, 6


def _pool_engine():
    return kvh.Engine(
        num_layers=PL,
        num_kv_heads=PH,
        head_dim=PD,
        block_tokens=PBT,
        dtype="f16",
        device_bytes=4 << 20,
        host_bytes=4 << 20,
        backend="cpu",
    )


def test_pool_over_padded_arrays_restores_only_the_viewed_elements():
    """Arrays with padding between heads and after head_dim (views of
    bigger sentinel-filled buffers): a restore writes exactly the viewed
    elements of its slot, never the padding or other slots."""
    rng = np.random.default_rng(7)
    fill = np.float16(-7.0)
    bigs = [np.full((PS, PBT, PH + 1, PD + 3), fill, np.float16) for _ in range(2 * PL)]
    for b in bigs:
        b[:, :, :PH, :PD] = rng.random((PS, PBT, PH, PD))
    views = [b[:, :, :PH, :PD] for b in bigs]
    with _pool_engine() as eng:
        pool = Pool.from_arrays(eng, views[:PL], views[PL:])
        batch = pool.offload([(1, 0, np.arange(PBT))])
        assert batch.wait(10) and batch.statuses() == [0]
        before = [b.copy() for b in bigs]
        load = pool.restore(batch.blocks, [4])
        assert load.wait(10) and load.failed() == []
        for b, old in zip(bigs, before):
            assert np.array_equal(b[4, :, :PH, :PD], old[1, :, :PH, :PD])
            changed = b != old
            changed[4, :, :PH, :PD] = False
            assert not changed.any()
            assert (b[:, :, PH:, :] == fill).all() and (b[:, :, :, PD:] == fill).all()
        batch.release()
        pool.unregister()


@pytest.mark.parametrize(
    "make,error",
    [
        (lambda a: a.astype(np.float32), ValueError),
        (lambda a: a[..., ::2], ValueError),
        (lambda a: a[:, :, :, ::-1], ValueError),
        (lambda a: a.reshape(PS, PBT, PH * PD), ValueError),
        (lambda a: a[:, :3], ValueError),
        (lambda a: a.tobytes(), TypeError),
        (lambda a: a.tolist(), TypeError),
        (lambda a: memoryview(a), TypeError),
        (lambda a: None, TypeError),
    ],
    ids=["f32", "strided-dim", "reversed-dim", "3d", "short-tokens", "bytes", "list", "memoryview", "none"],
)
def test_pool_from_arrays_refuses_bad_layouts(make, error):
    arrs = [np.zeros((PS, PBT, PH, PD), np.float16) for _ in range(2 * PL)]
    with _pool_engine() as eng:
        raises_typed(lambda: Pool.from_arrays(eng, [make(a) for a in arrs[:PL]], [make(a) for a in arrs[PL:]]), error)
        # One bad layer among good ones is refused too.
        raises_typed(lambda: Pool.from_arrays(eng, arrs[:PL], [arrs[PL], make(arrs[PL + 1])]), error)


def test_pool_with_zero_slots_is_refused():
    with _pool_engine() as eng:
        empty = [np.zeros((0, PBT, PH, PD), np.float16) for _ in range(PL)]
        raises_typed(lambda: Pool.from_arrays(eng, empty, empty), kvh.InvalidArgumentError)


def test_pool_offload_tokens_of_odd_buffers():
    arrs = [np.random.default_rng(i).random((PS, PBT, PH, PD)).astype(np.float16) for i in range(2 * PL)]
    with _pool_engine() as eng:
        pool = Pool.from_arrays(eng, arrs[:PL], arrs[PL:])
        for tokens, error in (
            (bytes(PBT), TypeError),
            (np.arange(PBT, dtype=np.float32), TypeError),
            (np.arange(2 * PBT)[None, :PBT], ValueError),
            (np.arange(PBT + 1), ValueError),
            (np.zeros(0, np.int32), ValueError),
        ):
            raises_typed(lambda: pool.offload([(0, 0, tokens)]), error)
        assert eng.stats().blocks_allocated == 0
        strided = np.arange(2 * PBT, dtype=np.int64)[::2]
        batch = pool.offload([(0, 0, strided)])
        assert batch.wait(10) and batch.statuses() == [0]
        assert batch.blocks[0].info().hash == eng.prefix_hash(strided)
        # An int32 token array is used in place; the call copies the ids, so
        # reusing the array right after it returns changes nothing.
        reused = np.arange(100, 100 + PBT, dtype=np.int32)
        later = pool.offload([(1, 0, reused)])
        reused[:] = -1
        assert later.wait(10) and later.statuses() == [0]
        assert later.blocks[0].info().hash == eng.prefix_hash(np.arange(100, 100 + PBT))
        later.release()
        batch.release()
        pool.unregister()
