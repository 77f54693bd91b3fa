"""Writes a copy of a GGUF file with its quantised matrices re-encoded in
another type (Q8_0 by default), for a second model of the same
architecture when only one GGUF is at hand (``kvh demo --models``).

The file is written with ``gguf.GGUFWriter``: the metadata is written
back with the value types it was read with (the same bytes, in the same
order, for a file whose first key is ``general.architecture``, as every
converter writes it; the test suite compares it byte for byte with a
direct copy), the tensor table gets the new types and offsets, and F32,
F16 and BF16 tensors and those already in the target type are copied as
they are. Re-encoding goes through the float32 weights, so a Q4_1 file
re-encoded as Q8_0 keeps Q4_1's rounding (it is a different file and
type, not a more accurate model)."""

from __future__ import annotations

import os
import tempfile
from typing import Optional

import numpy as np

from .gguf_loader import GGUFFile

__all__ = ["requantize"]


def requantize(src: str, dst: str, qtype: str = "Q8_0", *, progress: Optional[callable] = None) -> str:
    """Writes ``dst`` (atomically: a temporary file renamed at the end) and
    returns it. Matrices of another quantised type become ``qtype``."""
    # A name of its own (mkstemp), not dst + ".tmp", which someone who may
    # write the directory could have made a link to one of this user's files.
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(dst)), prefix=os.path.basename(dst) + ".")
    os.close(fd)
    try:
        _write(src, tmp, qtype, progress)
        os.replace(tmp, dst)
    except BaseException:
        os.unlink(tmp)
        raise
    return dst


def _write(src: str, tmp: str, qtype: str, progress: Optional[callable]) -> None:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
    from gguf import GGUFValueType as V
    from gguf import GGUFWriter, quants

    target = T[qtype]
    blk, tsz = GGML_QUANT_SIZES[target]
    with GGUFFile(src) as g:
        arch = g.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError(f"{src}: no general.architecture in the metadata")
        w = GGUFWriter(tmp, arch)  # writes general.architecture first
        try:
            w.data_alignment = int(g.metadata.get("general.alignment", w.data_alignment))
            for key, value in g.metadata.items():
                if key == "general.architecture":
                    continue
                vtype, sub = g.metadata_types[key]
                if isinstance(value, np.ndarray):
                    value = value.tolist()
                w.add_key_value(key, value, V(vtype), V(sub) if sub is not None else None)
            plan = []  # (tensor info, kept as it is)
            for t in g.tensors.values():
                keep = t.type_name in ("F32", "F16", "BF16", qtype) or len(t.shape) < 2 or t.shape[-1] % blk
                n = t.nbytes if keep else int(np.prod(t.shape)) // blk * tsz
                w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), n, raw_dtype=T(t.type_id) if keep else target)
                plan.append((t, keep))
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            for i, (t, keep) in enumerate(plan):
                data = g.raw(t.name) if keep else quants.quantize(g.tensor(t.name), target)
                w.write_tensor_data(np.ascontiguousarray(data))
                if progress:
                    progress(i + 1, len(plan))
        finally:
            w.close()
