"""Lifetime and thread rules of the objects that own a native kvh object.

Each such class defines an idempotent ``close()`` (usually an alias of the
name the domain uses: ``free``, ``release``, ``destroy``) and inherits how a
``with`` block and the garbage collector end it from here, so the rules are
written once:

* ``with obj:`` closes on exit, also when the body raised; entering it
  refuses an object the class says is no longer usable (``_check_usable``,
  e.g. a closed engine or a freed sequence).
* garbage collection closes quietly: ``__del__`` never raises, including at
  interpreter shutdown when module globals may already be gone, and on an
  object whose ``__init__`` failed half way. :class:`Finalized` is that
  rule for any object whose collection must end something (the zero-copy
  views' base objects too).

Threads: the C library lets only one thread at a time pass a handle to a
call marked ``@threads handle`` in kvh.h (calls marked ``@threads any`` may
overlap those), and a freed handle must never reach C again. Each object
that owns a handle therefore has a :class:`HandleGate` that every call
passing the handle to C goes through; that one mechanism is what makes two
Python threads on one object serialise (or raise) instead of crashing.
"""

from __future__ import annotations

import collections
import os
import signal
import sys
import threading
import time
import weakref
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple, TypeVar, Union

T = TypeVar("T")
C = TypeVar("C", bound="Closable")

_OPEN, _CLOSING, _CLOSED = 0, 1, 2

# fork()s this process came through. In a child, a gate's lock may be held
# and its calls counted in flight by threads that stayed in the parent: a
# gate made before the fork starts afresh on its first use in the child
# (the calls it then admits get KVH_ERR_UNSUPPORTED from the engine, which
# refuses a child's calls, and a close returns at once) instead of waiting
# for those threads for ever.
_forks = 0


def _count_fork() -> None:
    global _forks
    _forks += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_count_fork)

# A KeyboardInterrupt can land inside _wake (the main thread runs signal
# handlers at any Python call), so a wake-up can be lost: waiters look at
# the gate again after this long, and a lost one costs no more than that.
_RECHECK_S = 0.05


def _on_stack(frame: Any, top: Any) -> bool:
    while top is not None:
        if top is frame:
            return True
        top = top.f_back
    return False


class HandleGate:
    """Admits the C calls that name one native handle.

    * ``exclusive()``: a ``@threads handle`` call; waits until no other
      thread is in one, first come first served (re-entrant within a
      thread).
    * ``shared()``: a ``@threads any`` call; runs beside the others.
    * ``close(end)``: refuses new calls, waits until none is in flight, then
      runs ``end`` (the C free) once. A close racing with it waits for it.

    A call on a closing or closed handle raises ``closed_error()``.
    """

    __slots__ = (
        "_lock",
        "_cond",
        "_waiting",
        "_closed_error",
        "_reopen_if_end_fails",
        "_state",
        "_closer",
        "_owner",
        "_owner_depth",
        "_queue",
        "_in_flight",
        "_shared_by",
        "_entered_in",
        "_forks",
    )

    def __init__(
        self,
        closed_error: Callable[[], BaseException],
        *,
        reopen_if_end_fails: Union[bool, Callable[[], bool]] = False,
    ) -> None:
        # Re-entrant: a finaliser may run on a thread that is inside the gate.
        self._lock = threading.RLock()
        # Made on the first wait: most handles never see two threads, and
        # blocks are made by the thousand.
        self._cond: Optional[threading.Condition] = None
        self._waiting = 0
        self._closed_error = closed_error
        # A failed end left the handle alive (or says whether it did).
        self._reopen_if_end_fails = reopen_if_end_fails
        self._state = _OPEN
        self._closer: Optional[int] = None  # thread running close
        self._owner: Optional[int] = None  # thread in an exclusive call
        self._owner_depth = 0
        # Threads waiting for exclusive use, in arrival order: a thread that
        # leaves and comes straight back must not overtake them.
        self._queue: Deque[object] = collections.deque()
        self._in_flight = 0  # exclusive and shared calls
        # Shared calls in flight per thread (made on the first): a close from
        # inside one (a log handler kvh calls) must not wait for itself.
        self._shared_by: Optional[Dict[int, int]] = None
        # Per thread with calls in flight, the frame its first call was
        # made from (made on the first): see _drop_abandoned.
        self._entered_in: Optional[Dict[int, Any]] = None
        self._forks = _forks

    def _after_fork(self) -> None:
        """First use in a child process: the parent's threads are not here
        to leave or finish a close (one begun there counts as done)."""
        self._lock = threading.RLock()
        self._cond = None
        self._waiting = 0
        self._closer = None
        self._owner = None
        self._owner_depth = 0
        self._queue = collections.deque()
        self._in_flight = 0
        self._shared_by = None
        self._entered_in = None
        if self._state == _CLOSING:
            self._state = _CLOSED
        self._forks = _forks

    @property
    def closed(self) -> bool:
        """True from the moment a close begins."""
        return self._state != _OPEN

    def exclusive(self) -> "GateUse":
        return GateUse(self, True)

    def shared(self) -> "GateUse":
        return GateUse(self, False)

    def enter(self, exclusive: bool, frame: Any = None) -> None:
        """Counts a call made from ``frame`` (by default the caller's: the
        frame whose ``with`` or ``try`` ends the call with ``leave``)."""
        if self._forks != _forks:
            self._after_fork()
        if frame is None:
            frame = sys._getframe(1)
        with self._lock:
            me = threading.get_ident()
            if self._entered_in and me in self._entered_in and not _on_stack(self._entered_in[me], frame):
                self._drop_thread(me)  # its earlier calls are over: counts an interrupt left
            if exclusive:
                if self._owner == me:  # a call nested in this thread's call
                    self._owner_depth += 1
                    self._in_flight += 1
                    return
                if self._state != _OPEN:
                    raise self._closed_error()
                if self._owner is not None or self._queue:
                    self._wait_turn()
                self._owner = me
                self._owner_depth = 1
            else:
                if self._state != _OPEN:
                    raise self._closed_error()
                if self._shared_by is None:
                    self._shared_by = {}
                self._shared_by[me] = self._shared_by.get(me, 0) + 1
            self._in_flight += 1
            if self._entered_in is None:
                self._entered_in = {}
            if me not in self._entered_in:  # this thread's first call in flight
                self._entered_in[me] = frame

    def leave(self, exclusive: bool) -> None:
        if self._forks != _forks:  # entered before the fork: counted no more
            self._after_fork()
            return
        with self._lock:
            self._in_flight -= 1
            if exclusive:
                self._owner_depth -= 1
                if self._owner_depth == 0:
                    self._owner = None
            elif self._shared_by:
                me = threading.get_ident()
                depth = self._shared_by.get(me, 0) - 1
                if depth > 0:
                    self._shared_by[me] = depth
                else:
                    self._shared_by.pop(me, None)
            self._forget_frame(threading.get_ident())
            self._wake()

    def close(self, end: Callable[[], T]) -> Optional[T]:
        """Ends the handle with ``end()`` once no call is in flight; returns
        its result (None when the handle was already closed)."""
        if self._forks != _forks:
            self._after_fork()
        me = threading.get_ident()
        with self._lock:
            if self._state == _CLOSING and self._closer == me:
                return None  # a close nested in this thread's close (e.g. a finaliser)
            while self._state == _CLOSING:
                self._wait()
            if self._state == _CLOSED:
                return None
            self._state = _CLOSING
            self._closer = me
            self._wake()  # threads queued for their turn give up now
            try:
                # A close from inside this thread's own calls cannot wait
                # for them. Counted again each round: another waiter may
                # take back this thread's abandoned ones meanwhile.
                while self._in_flight > self._own_counts(me):
                    self._wait()
            except BaseException:  # Ctrl-C in the wait: not closed, a later close can end it
                self._state = _OPEN
                self._closer = None
                self._wake()
                raise
        try:
            result = end()
        except BaseException as exc:
            # A refusal (KVH_ERR_BUSY: a call from the engine's own log sink)
            # ended nothing: the handle stays usable and a later close ends it.
            # Anything else (Ctrl-C, a signal handler's exception) may have
            # come before or after the native end: the handle says which.
            refused = type(exc).__name__ == "BusyError"
            reopen = self._reopen_if_end_fails
            self._closed(_OPEN if refused or (reopen() if callable(reopen) else reopen) else _CLOSED)
            raise
        self._closed(_CLOSED)
        return result

    # ---- lock held ----
    def _own_counts(self, me: int) -> int:
        own = self._owner_depth if self._owner == me else 0
        if self._shared_by:
            own += self._shared_by.get(me, 0)
        return own

    def _wait_turn(self) -> None:
        turn = object()
        self._queue.append(turn)
        try:
            while self._owner is not None or self._queue[0] is not turn:
                self._wait()
                if self._state != _OPEN:
                    raise self._closed_error()
        finally:
            self._queue.remove(turn)
            self._wake()  # the next in the queue may go

    def _wait(self) -> None:
        if self._cond is None:
            self._cond = threading.Condition(self._lock)
        self._waiting += 1
        try:
            woken = self._cond.wait(_RECHECK_S)
        finally:
            self._waiting -= 1
        if not woken:
            self._drop_abandoned()

    def _drop_abandoned(self) -> None:
        """Takes back the counts of threads whose calls are over: a
        KeyboardInterrupt raised at the entry of a call's ``__exit__`` (the
        main thread runs signal handlers at any Python call) skips its
        ``leave``, and the count left behind would keep other threads out
        of the handle, and its close waiting, for good. A thread is in a
        call while the frame it entered the gate from is on its stack."""
        holders = set(self._shared_by or ())
        if self._owner is not None:
            holders.add(self._owner)
        holders.discard(threading.get_ident())
        if not holders or not self._entered_in:
            return
        frames = sys._current_frames()
        for thread in holders:
            entered_in = self._entered_in.get(thread)
            if entered_in is not None and not _on_stack(entered_in, frames.get(thread)):
                self._drop_thread(thread)

    def _drop_thread(self, thread: int) -> None:
        if self._owner == thread:
            self._in_flight -= self._owner_depth
            self._owner = None
            self._owner_depth = 0
        if self._shared_by and thread in self._shared_by:
            self._in_flight -= self._shared_by.pop(thread)
        if self._entered_in:
            self._entered_in.pop(thread, None)
        self._wake()

    def _forget_frame(self, me: int) -> None:
        if self._entered_in and not self._own_counts(me):
            self._entered_in.pop(me, None)

    def _wake(self) -> None:
        if self._waiting:
            self._cond.notify_all()  # type: ignore[union-attr]

    def _closed(self, state: int) -> None:
        with self._lock:
            self._state = state
            self._closer = None
            self._wake()


class GateUse:
    """``with gate.exclusive():`` / ``with gate.shared():``."""

    __slots__ = ("gate", "exclusive")

    def __init__(self, gate: HandleGate, exclusive: bool) -> None:
        self.gate = gate
        self.exclusive = exclusive

    def __enter__(self) -> None:
        self.gate.enter(self.exclusive, sys._getframe(1))

    def __exit__(self, *exc: Any) -> None:
        self.gate.leave(self.exclusive)


def in_lock_order(uses: Sequence[GateUse]) -> Tuple[GateUse, ...]:
    """The order to enter several gates in: one global order, so two threads
    naming the same handles in different orders cannot deadlock."""
    if len(uses) < 2:
        return tuple(uses)
    return tuple(sorted(uses, key=lambda u: (id(u.gate), not u.exclusive)))


class GatedHandle:
    """Mixin of a class whose ``_gate`` guards its handle of ``_engine``
    (whose ``_call(*uses)`` enters the gates, then the engine)."""

    _gate: HandleGate
    _engine: Any

    def _call(self, *others: GateUse) -> Any:
        """``with self._call() as engine_ptr:`` around a ``@threads handle``
        call naming this handle (and the handles of ``others``)."""
        return self._engine._call(self._gate.exclusive(), *others)

    def _call_any(self, *others: GateUse) -> Any:
        """The same for a ``@threads any`` call."""
        return self._engine._call(self._gate.shared(), *others)


class Closable:
    """``with`` support for an object with an idempotent ``close()``:
    ``with obj:`` first runs ``_check_usable()`` (which raises where the
    object may no longer be used; by default it never does), and closes
    the object on exit."""

    def close(self) -> None:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def _check_usable(self) -> None:
        pass

    def __enter__(self: C) -> C:
        self._check_usable()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Finalized:
    """An object whose collection must end something: ``__del__`` runs
    ``_close_at_gc()`` and lets no exception escape it."""

    def _close_at_gc(self) -> None:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def __del__(self) -> None:
        # The interpreter prints and drops what a finaliser raises: a
        # Ctrl-C or a signal handler's exception met here would be lost and
        # the close left half done. The close is finished first; Ctrl-C is
        # then sent again (under Python's own handler), and anything else
        # goes on to sys.unraisablehook, where the application can act on it.
        stopped: Optional[BaseException] = None
        for _ in range(2):
            try:
                self._close_at_gc()
                break
            except Exception:  # nothing else may escape a finaliser
                break
            except BaseException as exc:
                stopped = stopped or exc
        if isinstance(stopped, KeyboardInterrupt):
            try:
                if interrupt_again() is not None:
                    return
            except Exception:  # at interpreter shutdown, with globals gone
                return
        if stopped is not None:
            raise stopped


class SignalAgain:
    """A signal sent to the main thread again, a moment from now, for one
    whose exception code run by the interpreter itself (a finaliser, a
    weakref or gc callback) met and could not pass on. Sent from a
    thread: set from that code, it would be raised and dropped there
    once more. A real signal (pthread_kill), so that a sleep or a wait
    the main thread is in ends as it would have."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self._lock = threading.Lock()
        self._cancelled = False
        self._sent = False
        threading.Thread(target=self._send, name="kvh-signal-again", daemon=True).start()

    def _send(self) -> None:
        time.sleep(_SEND_AGAIN_AFTER_S)
        with self._lock:
            if self._cancelled:
                return
            self._sent = True
            try:
                signal.pthread_kill(threading.main_thread().ident, self.signum)  # type: ignore[arg-type]
            except (OSError, TypeError):
                pass  # the main thread is gone: the process is ending

    def cancel(self) -> bool:
        """Stops it; False when it was already sent."""
        with self._lock:
            self._cancelled = True
            return not self._sent


def interrupt_again() -> Optional[SignalAgain]:
    """Sends Ctrl-C again where Python's own handler has it raise
    KeyboardInterrupt: that exception, and only it, was lost. Under a
    handler of the application's, a second call would count a second
    Ctrl-C: None then, and the caller passes the exception on to
    sys.unraisablehook instead."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return None
    return SignalAgain(signal.SIGINT)


# Long enough for the code that dropped the exception to return; landing
# in another such place sends it again.
_SEND_AGAIN_AFTER_S = 0.002


class ForkSafeLock:
    """A lock (re-entrant if asked) made anew on its first use in a forked
    child: a copy another thread of the parent held at the fork would stay
    held there for good. Use it with ``with``."""

    __slots__ = ("_lock", "_reentrant", "_forks")

    def __init__(self, reentrant: bool = False) -> None:
        self._reentrant = reentrant
        self._lock: Any = threading.RLock() if reentrant else threading.Lock()
        self._forks = _forks

    def _current(self) -> Any:
        if self._forks != _forks:
            self._lock = threading.RLock() if self._reentrant else threading.Lock()
            self._forks = _forks
        return self._lock

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return bool(self._current().acquire(blocking, timeout))

    def release(self) -> None:
        self._lock.release()

    def held_here(self) -> bool:
        """Whether this thread holds it (a re-entrant lock only)."""
        return bool(self._reentrant and self._current()._is_owned())

    def __enter__(self) -> "ForkSafeLock":
        self._current().acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()


class WeakBag:
    """The live ones of the objects added, held weakly. Unlike a
    weakref.WeakSet it runs no Python code when one of them dies: a
    Ctrl-C met there would be dropped by the interpreter.

    A call made while the same thread is inside another (a signal handler
    run between two of its steps) neither waits for that thread nor
    changes the dict under it: adds and discards are queued and applied
    by the next call, and ``live()`` sees them at once."""

    __slots__ = ("_refs", "_prune_at", "_lock", "_queued")

    def __init__(self) -> None:
        self._refs: Dict[int, "weakref.ref[Any]"] = {}
        self._prune_at = 16
        self._lock = ForkSafeLock(reentrant=True)
        self._queued: List[Tuple[bool, int, "weakref.ref[Any]"]] = []  # (add?, id, ref), in order

    def _enter(self) -> bool:
        """Takes the lock and applies what was queued: True. False, taking
        nothing, inside another call of this bag on the same thread."""
        if self._lock.held_here():
            return False
        self._lock.acquire()
        try:
            self._apply_queued()
        except BaseException:  # a Ctrl-C: the lock is not left taken
            self._lock.release()
            raise
        return True

    def _apply_queued(self) -> None:
        # Each change is applied before it leaves the queue: one cut short
        # by a Ctrl-C is applied again (both kinds can be) by the next call.
        while self._queued:
            add, key, ref = self._queued[0]
            if add:
                self._refs[key] = ref
            else:
                current = self._refs.get(key)
                if current is not None and current() is not None and current() is ref():
                    del self._refs[key]
            self._queued.pop(0)

    def add(self, obj: Any) -> None:
        ref = weakref.ref(obj)
        if not self._enter():
            self._queued.append((True, id(obj), ref))
            return
        try:
            self._refs[id(obj)] = ref  # a dead one's id may be reused
            if len(self._refs) >= self._prune_at:
                self._refs = {k: r for k, r in self._refs.items() if r() is not None}
                self._prune_at = max(16, 2 * len(self._refs))
        finally:
            self._lock.release()

    def discard(self, obj: Any) -> None:
        if not self._enter():
            try:
                self._queued.append((False, id(obj), weakref.ref(obj)))
            except TypeError:
                pass  # no weak reference to it: it was never added
            return
        try:
            ref = self._refs.get(id(obj))
            if ref is not None and ref() is obj:
                del self._refs[id(obj)]
        finally:
            self._lock.release()

    def live(self) -> List[Any]:
        if self._enter():
            try:
                refs = dict(self._refs)
            finally:
                self._lock.release()
        else:
            refs = dict(self._refs)  # one C call: whole even amid the outer call's steps
            for add, key, ref in list(self._queued):
                if add:
                    refs[key] = ref
                elif key in refs and refs[key]() is ref():
                    del refs[key]
        return [obj for obj in (r() for r in refs.values()) if obj is not None]


class Uncopyable:
    """Refuses ``copy.copy`` and ``copy.deepcopy``: a copy would share the
    native handle, and whichever was closed or collected first would end
    it for both."""

    def __copy__(self) -> Any:
        raise TypeError(f"a {type(self).__name__} owns a native handle and cannot be copied")

    def __deepcopy__(self, memo: Any) -> Any:
        raise TypeError(f"a {type(self).__name__} owns a native handle and cannot be copied")

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickled (multiprocessing spawn, a process pool), it would name
        # memory of this process only.
        raise TypeError(
            f"a {type(self).__name__} owns a native handle of this process and cannot be pickled: "
            "open an engine in the other process"
        )


class OwnedHandle(Closable, Finalized, Uncopyable):
    """A :class:`Closable` that the garbage collector also closes.
    Subclasses whose collection must do less than ``close()`` (e.g. skip
    work once the engine is gone) override ``_close_at_gc``."""

    def _close_at_gc(self) -> None:
        self.close()


__all__ = [
    "Closable",
    "Finalized",
    "ForkSafeLock",
    "GateUse",
    "GatedHandle",
    "HandleGate",
    "OwnedHandle",
    "Uncopyable",
    "SignalAgain",
    "WeakBag",
    "in_lock_order",
    "interrupt_again",
]
