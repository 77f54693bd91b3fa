"""Ctrl-C, or a signal handler's exception, right after a C call returns
(where Python raises it): the binding's bookkeeping still matches what the
call did; one met by a log handler is not lost."""

from __future__ import annotations

import gc
import logging
import os
import pickle
import signal
import time

import numpy as np
import pytest

import kvh_cache as kvh
import kvh_cache.engine as em
from kvh_testutil import filled_seq, make_engine


@pytest.fixture
def ctrl_c():
    # A runner started in the background ignores SIGINT: give the test a
    # terminal's Ctrl-C, and put back what was there.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


class _CtrlCDuring:
    """em.lib, with Ctrl-C arriving while the named C call runs (it lands
    right after it returns, the first moment Python can raise it)."""

    def __init__(self, real, name):
        self.real, self.name, self.armed, self.sig = real, name, True, signal.SIGINT

    def __getattr__(self, attr):
        fn = getattr(self.real, attr)
        if attr != self.name or not self.armed:
            return fn

        def call(*args):
            st = fn(*args)
            os.kill(os.getpid(), self.sig)
            time.sleep(0.01)  # delivered to this thread's handler by now
            return st

        return call


@pytest.fixture
def lib_with_ctrl_c(monkeypatch, ctrl_c):
    def arm(name):
        wrapped = _CtrlCDuring(em.lib, name)
        monkeypatch.setattr(em, "lib", wrapped)
        return wrapped

    return arm


def test_ctrl_c_during_close_leaves_the_engine_closed(lib_with_ctrl_c):
    """The engine came back open with its freed pointer: its calls read freed
    memory once 16 more engines had closed, and a second close freed it
    again."""
    eng = make_engine()
    lib_with_ctrl_c("kvh_engine_close")
    with pytest.raises(KeyboardInterrupt):
        eng.close()
    assert eng.closed
    with pytest.raises(kvh.ClosedError):
        eng.stats()
    eng.close()  # a second close does nothing


def test_a_signal_handlers_exception_during_close_leaves_it_closed(monkeypatch):
    """The same through a program's own SIGTERM handler (sys.exit in it, as
    servers do), which no deferral of Ctrl-C alone covers."""

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        eng = make_engine()
        wrapped = _CtrlCDuring(em.lib, "kvh_engine_close")
        wrapped.sig = signal.SIGTERM
        monkeypatch.setattr(em, "lib", wrapped)
        with pytest.raises(SystemExit):
            eng.close()
        assert eng.closed
        with pytest.raises(kvh.ClosedError):
            eng.stats()
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_binding_leaves_signal_handlers_alone(monkeypatch, tmp_path):
    """An embedding program's own SIGINT handler (or SIG_DFL, or one set in
    C, which Python cannot put back) is never swapped, even for a moment."""

    def refuse(*args):
        raise AssertionError(f"signal.signal{args} called")

    monkeypatch.setattr(signal, "signal", refuse)
    eng = make_engine(disk_path=str(tmp_path / "store"), disk_bytes=8 << 20)
    seq = eng.sequence(tokens=range(48))
    seq.truncate(16)
    eng.close()


def test_ctrl_c_during_truncate_still_cuts_the_holds(lib_with_ctrl_c):
    """The holds past the cut stayed as they were: releasing one later ended
    a hold taken after the truncation on the same range."""
    eng = make_engine()
    seq = eng.sequence(tokens=range(48))
    gone = seq.acquire(range(16, 48))
    wrapped = lib_with_ctrl_c("kvh_seq_truncate")
    with pytest.raises(KeyboardInterrupt):
        seq.truncate(16)
    wrapped.armed = False
    assert len(seq) == 16 and gone.released
    seq.append(range(100, 132))
    later = seq.acquire(range(16, 48))
    gone.release()
    assert [seq.block_info(i).holds for i in range(3)] == [0, 1, 1] and not later.released
    later.release()
    eng.close()


@pytest.mark.parametrize("wait", [True, False])
def test_ctrl_c_as_acquire_returns_leaves_no_hold(lib_with_ctrl_c, wait):
    """The hold the call took was never owned (no Hold came back to release
    it): the blocks stayed held for the sequence's life, and a spill moved
    none of them."""
    eng = make_engine()
    seq = eng.sequence(tokens=range(48))
    wrapped = lib_with_ctrl_c("kvhpy_seq_acquire")
    with pytest.raises(KeyboardInterrupt):
        seq.acquire(wait=wait)
    wrapped.armed = False
    gc.collect()
    assert [seq.block_info(i).holds for i in range(3)] == [0, 0, 0]
    with seq.acquire(range(16, 32)):
        assert [seq.block_info(i).holds for i in range(3)] == [0, 1, 0]
    eng.close()


def test_ctrl_c_as_fork_returns_leaves_no_child(lib_with_ctrl_c):
    """The child sequence was never owned: its references kept every shared
    block alive (and copied on write) for the engine's life."""
    eng = make_engine()
    seq = eng.sequence(tokens=range(48))
    wrapped = lib_with_ctrl_c("kvh_seq_fork")
    with pytest.raises(KeyboardInterrupt):
        seq.fork()
    wrapped.armed = False
    gc.collect()
    assert [seq.block_info(i).refs for i in range(3)] == [1, 1, 1]
    eng.close()


def test_ctrl_c_as_block_calls_return_leaves_no_reference(lib_with_ctrl_c):
    """kvh_block_alloc's new block and kvh_prefix_lookup's retained blocks
    were never owned: each call leaked references until the tier was full."""
    eng = make_engine()
    seq, _ = filled_seq(eng, 48)  # written blocks are published: a lookup finds them
    used = eng.tier_info("device").used_blocks
    wrapped = lib_with_ctrl_c("kvh_block_alloc")
    with pytest.raises(KeyboardInterrupt):
        eng.block_alloc()
    wrapped.armed = False
    gc.collect()
    assert eng.tier_info("device").used_blocks == used
    refs = [seq.block_info(i).refs for i in range(3)]
    wrapped = lib_with_ctrl_c("kvh_prefix_lookup_scoped")
    with pytest.raises(KeyboardInterrupt):
        eng.prefix_lookup(np.arange(48))
    wrapped.armed = False
    gc.collect()
    assert [seq.block_info(i).refs for i in range(3)] == refs
    assert len(eng.prefix_lookup(np.arange(48))) == 3  # the lookup found them
    eng.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("call", ["kvhpy_block_keep", "kvhpy_block_let_go"])
def test_ctrl_c_around_a_read_only_view_leaves_no_pin(lib_with_ctrl_c, call):
    """A read-only view takes its own reference and pin on the block, and
    gives both back when collected. The two were separate calls: a Ctrl-C
    after the pin (or between unpin and release) left a pin no one owned,
    and that slot was never usable again."""
    eng = make_engine()
    seq, _ = filled_seq(eng, 48)  # written in full: its views are read-only
    wrapped = lib_with_ctrl_c(call)
    interrupted = False
    try:
        view = seq.block_view(1, 0)
        assert not view.flags.writeable
        del view
        gc.collect()  # a finaliser's Ctrl-C goes to sys.unraisablehook
    except KeyboardInterrupt:
        interrupted = True
    assert interrupted or call != "kvhpy_block_keep"
    wrapped.armed = False
    gc.collect()
    assert eng.tier_info("device").pinned_blocks == 0
    assert [seq.block_info(i).pins for i in range(3)] == [0, 0, 0]
    assert [seq.block_info(i).refs for i in range(3)] == [1, 1, 1]
    eng.close()


def test_a_refused_let_go_keeps_the_views_block_for_a_retry(monkeypatch):
    """A view forgot its kept block before giving it back: when the library
    refused (BusyError), the pin and reference stayed with no one to drop
    them, and the slot was never usable again."""
    eng = make_engine()
    seq, _ = filled_seq(eng, 48)
    view = seq.block_view(1, 0)  # written in full: read-only, the block kept
    owner = view.base
    while not isinstance(owner, em._ViewOwner):
        owner = owner.base
    assert owner.kept is not None
    real = em.Block._unpin_and_release

    def refused(self):
        raise kvh.BusyError("refused", em.lib.KVH_ERR_BUSY)

    monkeypatch.setattr(em.Block, "_unpin_and_release", refused)
    with pytest.raises(kvh.BusyError):
        owner.let_block_go()
    assert owner.kept is not None
    monkeypatch.setattr(em.Block, "_unpin_and_release", real)
    owner.let_block_go()
    assert owner.kept is None
    assert seq.block_info(1).pins == 0
    del view, owner
    gc.collect()
    assert eng.tier_info("device").pinned_blocks == 0
    eng.close()


def test_ctrl_c_during_open_leaves_no_engine_behind(lib_with_ctrl_c, tmp_path):
    """The opened engine was never owned: its store stayed locked for the
    rest of the process (BusyError on every reopen)."""
    store = str(tmp_path / "store")
    lib_with_ctrl_c("kvh_engine_open")
    with pytest.raises(KeyboardInterrupt):
        make_engine(disk_path=store, disk_bytes=8 << 20)
    em.lib.armed = False
    gc.collect()
    make_engine(disk_path=store, disk_bytes=8 << 20).close()


def test_ctrl_c_while_the_engines_owner_is_made_leaves_no_engine_behind(monkeypatch, tmp_path):
    """A Ctrl-C landing inside the owner's constructor (right after open
    returned) dropped the only pointer to the opened engine: its threads
    ran on and its store stayed locked (BusyError on every reopen)."""
    store = str(tmp_path / "store")
    real = em.HandleGate

    def interrupted(*args, **kw):
        monkeypatch.setattr(em, "HandleGate", real)
        raise KeyboardInterrupt

    monkeypatch.setattr(em, "HandleGate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        make_engine(disk_path=store, disk_bytes=8 << 20)
    make_engine(disk_path=store, disk_bytes=8 << 20).close()


def _store_with_corrupt_blocks(tmp_path, n_tokens=64):
    """Each block's bytes flipped on disk: moving one makes kvh log."""
    store = str(tmp_path / "store")
    with make_engine(disk_path=store, disk_bytes=1 << 20) as eng:
        seq, _ = filled_seq(eng, n_tokens)
        seq.persist()
    slab = os.path.join(store, "slab-0000.kvh")
    data = bytearray(open(slab, "rb").read())
    for off in range(4096 + 100, len(data), 8192):
        data[off] ^= 0x08
    open(slab, "wb").write(bytes(data))
    return store


def test_a_log_handlers_ctrl_c_reaches_the_caller(ctrl_c, tmp_path):
    """A KeyboardInterrupt raised in a log handler on the calling thread
    (migration_threads 0: kvh logs there) was dropped without a trace."""
    store = _store_with_corrupt_blocks(tmp_path)
    eng = make_engine(disk_path=store, disk_bytes=1 << 20, migration_threads=0)
    blocks = eng.prefix_lookup(np.arange(64))
    assert blocks
    raised = []

    class Interrupting(logging.Handler):
        def emit(self, record):
            raised.append(record.getMessage())
            raise KeyboardInterrupt

    handler = Interrupting()
    logger = logging.getLogger("kvh")
    logger.addHandler(handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            for b in blocks:
                try:
                    eng.migrate([b], "host")
                except kvh.Error:
                    pass
        assert raised
    finally:
        logger.removeHandler(handler)
    eng.stats()  # nothing pending any more
    eng.close()


def test_pickling_a_handle_says_why_it_cannot(tmp_path):
    eng = make_engine()
    seq = eng.sequence(tokens=np.arange(16))
    for obj in (eng, seq):
        with pytest.raises(TypeError, match="cannot be pickled"):
            pickle.dumps(obj)
    eng.close()
