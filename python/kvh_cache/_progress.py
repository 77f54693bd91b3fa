"""Terminal helpers for the CLI: a progress bar (tqdm, drawn only on a
TTY), summary tables, human-readable sizes and the size options' parser."""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys
from typing import IO, Any, List, Optional, Sequence

from ._handle import Closable

__all__ = ["Progress", "table", "human_bytes", "human_rate", "parse_size"]


class Progress(Closable):
    """``with Progress(total, "label") as bar: bar.update(1)``. A tqdm bar
    on ``stream`` (stderr), drawn only when it is a TTY (and TERM is not
    "dumb"), or never with enabled=False. ``update(n, note)`` shows note
    after the counts."""

    def __init__(
        self,
        total: Optional[int],
        label: str = "",
        *,
        stream: Optional[IO[str]] = None,
        enabled: Optional[bool] = None,
        unit: str = "it",
    ) -> None:
        self.total = total
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            enabled = _isatty(self.stream) and os.environ.get("TERM") != "dumb"
        self.enabled = enabled
        self.unit = unit
        self.count = 0
        self.note = ""
        self._bar: Any = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, desc=label, unit=unit, file=self.stream, mininterval=0.1, dynamic_ncols=True, leave=True
            )

    def update(self, n: int = 1, note: Optional[str] = None) -> None:
        self.count += n
        if note is not None and note != self.note:
            self.note = note
            if self._bar is not None:
                self._bar.set_postfix_str(note, refresh=False)
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except Exception:
        return False


def table(
    rows: Sequence[Sequence[Any]], headers: Sequence[str], *, title: Optional[str] = None, align: Optional[str] = None
) -> str:
    """A plain-text table. ``align``: one of 'l'/'r' per column (default:
    numbers right, text left)."""
    cells: List[List[str]] = [[_fmt(c) for c in row] for row in rows]
    ncol = len(headers)
    widths = [len(h) for h in headers]
    for row in cells:
        for i, c in enumerate(row[:ncol]):
            widths[i] = max(widths[i], len(c))
    if align is None:
        align = "".join(
            "r" if rows and all(isinstance(r[i], (int, float)) for r in rows if i < len(r)) else "l"
            for i in range(ncol)
        )

    def line(vals: Sequence[str]) -> str:
        out = []
        for i in range(ncol):
            v = vals[i] if i < len(vals) else ""
            out.append(v.rjust(widths[i]) if align[i] == "r" else v.ljust(widths[i]))
        return "  ".join(out).rstrip()

    parts = []
    if title:
        parts.append(title)
    parts.append(line(list(headers)))
    parts.append("  ".join("-" * w for w in widths))
    parts.extend(line(r) for r in cells)
    return "\n".join(parts)


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v != v:
            return "-"
        if abs(v) >= 100:
            return f"{v:,.0f}"
        return f"{v:.3g}" if abs(v) < 1 else f"{v:.2f}"
    if isinstance(v, int):
        return f"{v:,}"
    if v is None:
        return "-"
    return str(v)


def human_bytes(n: float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_rate(nbytes: float, seconds: float) -> str:
    return human_bytes(nbytes / seconds) + "/s" if seconds > 0 else "-"


_SIZE_MAX = (1 << 64) - 1


def parse_dir(text: str) -> pathlib.Path:
    """A directory argument; an empty one would be the working directory
    (Path("") is "."), where a store would be written and its mode narrowed."""
    if not text:
        raise argparse.ArgumentTypeError("DIR must not be empty")
    return pathlib.Path(text)


# What the library's KVH_* parser takes as a size (core/config_env.c): a
# decimal count, then optionally K, M, G, T or P, optionally "i", then
# optionally "B"; case-insensitive. "KiB", "Ki" and "K" are powers of 1024;
# here "KB", "MB", ... are powers of 1000, as they have always been on
# the command line.
_SIZE_RE = re.compile(r"([0-9]+)(?:([kmgtp])(i?))?(b?)", re.IGNORECASE)
_SIZE_UNITS = "kmgtp"


def parse_size(text: str) -> int:
    """'64MiB', '2M', '1GiB', '1P', '4096' -> bytes: a whole number with an
    optional K, M, G, T or P suffix, as the library's KVH_* variables take
    ('1.5G' is refused there and here); 'KB', 'MB', ... are decimal."""
    s = str(text)
    m = _SIZE_RE.fullmatch(s)
    if m is None:
        if s.strip().startswith("-"):
            raise argparse.ArgumentTypeError(f"size must be >= 0: {text!r}")
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} (a whole number of bytes, optionally with K, M, G, T or P: 4MiB, 512K, 1G)"
        )
    num, unit, binary, b = m.groups()
    power = _SIZE_UNITS.index(unit.lower()) + 1 if unit else 0
    base = 1000 if unit and b and not binary else 1024
    size = int(num) * base**power
    if size > _SIZE_MAX:  # the library takes sizes as uint64_t
        raise argparse.ArgumentTypeError(f"size too large: {text!r} (at most {_SIZE_MAX} bytes, 16 EiB)")
    return size
