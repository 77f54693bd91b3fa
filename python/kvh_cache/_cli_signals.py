"""How a kvh command unwinds on Ctrl-C, SIGTERM and SIGHUP.

Each signal becomes an exception raised in the main thread, so that what a
command started (kvh-bench's process group, a temporary store) is stopped
and removed on the way out. Python runs a signal's handler wherever the
main thread is, and an exception raised inside a ``__del__`` or a weakref
callback is printed as "Exception ignored" and dropped: the command would
go on as if nothing had been asked. Such a signal is sent again, to be
raised at a point where it unwinds, and one still on its way when the
command's work returns is raised there.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from ._handle import SignalAgain


class Stopped(BaseException):
    """SIGTERM or SIGHUP, raised in the main thread as Ctrl-C is."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _exception_for(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else Stopped(signum)


class SignalUnwind:
    """Installed for one command's run; ``restore()`` puts back what was
    there. A signal ignored by whoever started kvh (nohup) stays ignored,
    and a handler someone else set is left alone."""

    def __init__(self) -> None:
        self._fired: List[int] = []
        self._previous: Dict[int, Any] = {}
        self._previous_hook: Callable[[Any], None] = sys.unraisablehook
        self._installed = False
        self._in_hook = 0
        self._again: Optional[SignalAgain] = None  # a dropped signal on its way back
        # The signal whose exception was last raised: a library that catches
        # everything may hand it on as its own error.
        self.raised: Optional[int] = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._in_hook:  # raised here it would be dropped once more
            self._send_again(signum)
            return
        if self._again is not None:  # this one unwinds: the one on its way is not needed
            self._again.cancel()
            self._again = None
        if signum == signal.SIGINT:
            self.raised = signum
            raise KeyboardInterrupt
        if self._fired:  # once: a second signal would cut the clean-up short
            return
        self._fired.append(signum)
        self.raised = signum
        raise Stopped(signum)

    def _send_again(self, signum: int) -> None:
        if self._again is not None:
            self._again.cancel()
        self._again = SignalAgain(signum)

    def _unraisable(self, unraisable: Any) -> None:
        self._in_hook += 1
        try:
            exc = unraisable.exc_value
            if isinstance(exc, Stopped):
                self._fired.clear()
                self._send_again(exc.signum)
            elif isinstance(exc, KeyboardInterrupt) and signal.getsignal(signal.SIGINT) in (
                self._on_signal,
                signal.default_int_handler,
            ):
                # Under another handler (a host running kvh's main in its
                # own process) a second call would count a second Ctrl-C.
                self._send_again(signal.SIGINT)
            else:
                self._previous_hook(unraisable)
        finally:
            self._in_hook -= 1

    def raise_pending(self) -> None:
        """Raises a dropped signal still on its way: the command's work
        returned before it came back."""
        again = self._again
        if again is None:
            return
        if again.cancel():
            self._again = None
            self.raised = again.signum
            raise _exception_for(again.signum)
        deadline = time.monotonic() + 1.0
        while self._again is again and time.monotonic() < deadline:
            time.sleep(0.001)  # sent: the handler runs at the next check and raises

    def install(self) -> "SignalUnwind":
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) == signal.SIG_DFL:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_signal)
        self._previous_hook = sys.unraisablehook
        sys.unraisablehook = self._unraisable
        self._installed = True
        return self

    def restore(self) -> None:
        if self._again is not None:  # the command is ending through another exception
            self._again.cancel()
            self._again = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._installed:
            sys.unraisablehook = self._previous_hook
            self._installed = False
