"""Ctrl-C held back across a C call and the Python bookkeeping of its
result. Python raises KeyboardInterrupt at the first bytecode after a C
call returns: between kvh_engine_close and forgetting the pointer, it
would leave a freed engine that Python still takes for open."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator, List, Tuple


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """SIGINT arriving inside the block is delivered (its handler called:
    KeyboardInterrupt by default) once the block has ended. Only the main
    thread receives Python's signals; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: List[Tuple[int, Any]] = []

    def hold(signum: int, frame: Any) -> None:
        caught.append((signum, frame))

    try:
        previous = signal.signal(signal.SIGINT, hold)
    except ValueError:  # not the main interpreter's main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught and callable(previous):
            previous(*caught[0])
