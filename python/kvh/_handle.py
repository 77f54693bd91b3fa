"""Lifetime protocol of the objects that own a native kvh object.

Each such class defines an idempotent ``close()`` (usually an alias of the
name the domain uses: ``free``, ``release``, ``destroy``) and inherits how a
``with`` block and the garbage collector end it from here, so the rules are
written once:

* ``with obj:`` closes on exit, also when the body raised.
* garbage collection closes quietly: ``__del__`` never raises, including at
  interpreter shutdown when module globals may already be gone, and on an
  object whose ``__init__`` failed half way.
"""
from __future__ import annotations

from typing import Any


class Closable:
    """``with`` support for an object with an idempotent ``close()``."""

    def close(self) -> None:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class OwnedHandle(Closable):
    """A :class:`Closable` that the garbage collector also closes.
    Subclasses whose collection must do less than ``close()`` (e.g. skip
    work once the engine is gone) override ``_close_at_gc``."""

    def _close_at_gc(self) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._close_at_gc()
        except Exception:  # nothing may escape a finaliser
            pass


__all__ = ["Closable", "OwnedHandle"]
