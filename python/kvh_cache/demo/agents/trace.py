"""``--record-trace``: the block-access trace of the kvh run, for policy
replay."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import IO, Optional

from ... import errors

__all__ = ["Tracer"]


class Tracer:
    """``--record-trace``: one line per block access, tab-separated:
    ``t_s agent seq block_id block_hash tier kind`` (t_s: seconds since the
    run started; block_hash: the chained prefix hash, 0 for a block not yet
    full; tier: where the block was when it was accessed; kind: match,
    prefill, decode, prefetch, ingest, hint). A ``hint`` line (no access:
    the scheduler's queue, through kvh_seq_hint) has an eighth field, the
    hint's priority."""

    def __init__(self, path: Optional[Path]) -> None:
        self.path = path
        self.f: Optional[IO[str]] = None
        self.lines = 0
        self.lock = threading.Lock()
        self.t0 = time.perf_counter()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.f = open(path, "w", encoding="utf-8")
            self.f.write(
                "# kvh block-access trace v1 (kvh demo)\n# t_s\tagent\tseq\tblock_id\tblock_hash\ttier\tkind\n"
            )

    @property
    def enabled(self) -> bool:
        return self.f is not None

    def blocks(self, seq, agent: int, kind: str, first_block: int = 0, n: Optional[int] = None) -> None:
        if self.f is None:
            return
        try:
            blks = seq.blocks(first_block, n)
            infos = [(b.handle, b.info()) for b in blks]
        except errors.Error:
            return
        t = time.perf_counter() - self.t0
        names = {0: "device", 1: "host", 2: "disk"}
        with self.lock:
            for h, info in infos:
                self.f.write(
                    f"{t:.6f}\t{agent}\t{seq.handle:#x}\t{h:#x}\t{info.hash:016x}\t"
                    f"{names.get(int(info.tier), str(int(info.tier)))}\t{kind}\n"
                )
            self.lines += len(infos)

    def hint(self, seq, agent: int, priority: int) -> None:
        if self.f is None:
            return
        try:
            handles = [b.handle for b in seq.blocks()]
        except errors.Error:
            return
        t = time.perf_counter() - self.t0
        with self.lock:
            for h in handles:
                self.f.write(f"{t:.6f}\t{agent}\t{seq.handle:#x}\t{h:#x}\t0\t-\thint\t{priority}\n")
            self.lines += len(handles)

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None
