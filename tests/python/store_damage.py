"""Damage to a kvh_cache.vllm store on disk, shared by the tests of the
store and of the connector (which run it under the vLLM venv's python,
so this module imports nothing beyond the standard library)."""

from __future__ import annotations

from pathlib import Path


def flip_first_block_byte(root: Path) -> None:
    """Flips a byte of the payload of the first block in the slab of the
    store under ``root / "store"`` (its one subdirectory)."""
    (sub,) = [d for d in (Path(root) / "store").iterdir() if d.is_dir()]
    slab = sub / "slab-0000.kvh"
    first = bytearray(slab.read_bytes()[: 1 << 20]).find(b"KVHBLK\x00\x01")
    assert first >= 0
    with open(slab, "r+b") as f:
        f.seek(first + 4096 + 17)
        b = f.read(1)
        f.seek(first + 4096 + 17)
        f.write(bytes([b[0] ^ 1]))
