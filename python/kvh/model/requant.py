"""Writes a copy of a GGUF file with its quantised matrices re-encoded in
another type (Q8_0 by default), for a second model of the same
architecture when only one GGUF is at hand (``kvh demo --models``).

The metadata section is copied byte for byte; the tensor table is
rewritten with the new types and offsets; F32 tensors and tensors already
in the target type are copied as they are. Re-encoding goes through the
float32 weights, so a Q4_1 file re-encoded as Q8_0 keeps Q4_1's rounding
(it is a different file and type, not a more accurate model)."""

from __future__ import annotations

import os
import struct
from typing import Optional

import numpy as np

from .gguf_loader import GGUFFile

__all__ = ["requantize"]


def requantize(src: str, dst: str, qtype: str = "Q8_0", *, progress: Optional[callable] = None) -> str:
    """Writes ``dst`` (atomically: a temporary file renamed at the end) and
    returns it. Matrices of another quantised type become ``qtype``."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
    from gguf import quants

    target = T[qtype]
    blk, tsz = GGML_QUANT_SIZES[target]
    with GGUFFile(src) as g:
        align = int(g.metadata.get("general.alignment", 32))
        meta_end = g.metadata_end
        plan = []  # (name, numpy shape, type id, payload source)
        for t in g.tensors.values():
            keep = t.type_name in ("F32", "F16", "BF16", qtype) or len(t.shape) < 2 or t.shape[-1] % blk
            plan.append((t, int(t.type_id) if keep else int(target), keep))
        table = bytearray()
        offset = 0
        sizes = []
        for t, tid, keep in plan:
            n = t.nbytes if keep else int(np.prod(t.shape)) // blk * tsz
            name = t.name.encode()
            table += struct.pack("<Q", len(name)) + name + struct.pack("<I", len(t.shape))
            table += struct.pack(f"<{len(t.shape)}Q", *reversed(t.shape))
            table += struct.pack("<IQ", tid, offset)
            sizes.append(n)
            offset += (n + align - 1) // align * align
        tmp = dst + ".tmp"
        with open(tmp, "wb") as f:
            f.write(g.read(0, 24))
            f.write(g.read(24, meta_end))
            f.write(table)
            f.write(b"\0" * (-f.tell() % align))
            for i, ((t, tid, keep), n) in enumerate(zip(plan, sizes)):
                if keep:
                    f.write(g.read(t.offset, t.offset + t.nbytes))
                else:
                    f.write(quants.quantize(g.tensor(t.name), target).tobytes())
                f.write(b"\0" * (-n % align))
                if progress:
                    progress(i + 1, len(plan))
    os.replace(tmp, dst)
    return dst
