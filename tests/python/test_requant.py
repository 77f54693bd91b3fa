"""kvh_cache.model.requant writes through gguf.GGUFWriter exactly the bytes of a
direct copy: the metadata section as it was, a new tensor table, the
tensors copied or re-encoded (the reference below is the hand-written
writer it replaced)."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

pytest.importorskip("gguf", reason="kvh_cache.model needs the gguf package (pip install gguf)")

from kvh_cache.model.gguf_loader import GGUFFile  # noqa: E402
from kvh_cache.model.requant import requantize  # noqa: E402
from kvh_cache.model.testing import write_tiny_llama  # noqa: E402


def reference_requantize(src: str, dst: str, qtype: str) -> None:
    """Header and metadata copied byte for byte, the tensor table written
    by hand, the tensors copied or re-encoded."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
    from gguf import quants

    target = T[qtype]
    blk, tsz = GGML_QUANT_SIZES[target]
    with GGUFFile(src) as g:
        align = int(g.metadata.get("general.alignment", 32))
        plan = []
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
        with open(dst, "wb") as f:
            f.write(g.read(0, g.metadata_end))
            f.write(table)
            f.write(b"\0" * (-f.tell() % align))
            for (t, tid, keep), n in zip(plan, sizes):
                if keep:
                    f.write(g.read(t.offset, t.offset + t.nbytes))
                else:
                    f.write(quants.quantize(g.tensor(t.name), target).tobytes())
                f.write(b"\0" * (-n % align))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_same_bytes_as_a_direct_copy(tmp_path, qtype):
    src = write_tiny_llama(str(tmp_path / "a.gguf"), qtype="Q4_1", seed=3)
    ours = requantize(src, str(tmp_path / "ours.gguf"), qtype)
    reference_requantize(src, str(tmp_path / "ref.gguf"), qtype)
    a = (tmp_path / "ours.gguf").read_bytes()
    b = (tmp_path / "ref.gguf").read_bytes()
    assert len(a) == len(b)
    assert a == b, f"first difference at byte {next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)}"
    assert not os.path.exists(ours + ".tmp")
    with GGUFFile(src) as s, GGUFFile(ours) as o:
        assert s.metadata_types == o.metadata_types
        assert list(s.metadata) == list(o.metadata)


def test_a_link_at_the_old_temporary_name_is_not_written_through(tmp_path):
    """The copy was written at dst + ".tmp" by name: a link planted there
    by someone who may write the directory sent the bytes to the link's
    target, a file of the user's own."""
    src = write_tiny_llama(str(tmp_path / "a.gguf"), qtype="Q4_1", seed=4)
    victim = tmp_path / "victim"
    victim.write_bytes(b"MINE")
    dst = tmp_path / "b.gguf"
    os.symlink(victim, str(dst) + ".tmp")
    requantize(src, str(dst), "Q8_0")
    assert victim.read_bytes() == b"MINE"
    with GGUFFile(str(dst)) as g:
        assert g.tensors


def test_a_copy_stopped_midway_leaves_no_temporary_file(tmp_path):
    src = write_tiny_llama(str(tmp_path / "a.gguf"), qtype="Q4_1", seed=5)

    def stop(done, total):
        raise RuntimeError("stopped")

    with pytest.raises(RuntimeError, match="stopped"):
        requantize(src, str(tmp_path / "b.gguf"), "Q8_0", progress=stop)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf"]
