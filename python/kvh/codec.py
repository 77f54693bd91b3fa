"""KV quantisation codecs of libkvh (``kvh_codec_*``) on NumPy arrays.

The same code the engine runs when ``Config(kv_codec=...)`` makes the host
and disk tiers hold quantised blocks. Each vector along the last axis (one
token's K or V in one head) is encoded on its own::

    import numpy as np, kvh.codec as kc
    x = np.random.randn(100, 8, 64).astype(np.float32)
    y = kc.round_trip(x, "q4_g32")          # what a demoted block decodes to
    enc = kc.encode(x, "int8")              # uint8 array [100, 8, 64 + 4]

Error bounds per element (before rounding to the array's dtype): int8
``max|x| / 254`` of its vector; q4_g32/q4_g64 ``(max - min) / 30`` of its
group of 32/64 elements.
"""
from __future__ import annotations

from typing import Any, Union

import numpy as np

from ._ffi import check, ffi, lib
from .types import Codec, DType

CodecLike = Union[Codec, str, int]


def _dtype_of(x: np.ndarray) -> DType:
    if x.dtype == np.float32:
        return DType.F32
    if x.dtype == np.float16:
        return DType.F16
    if x.dtype == np.uint16:
        return DType.BF16  # raw bfloat16 bits, as elsewhere in kvh
    raise TypeError(f"expected float32, float16 or uint16 (bfloat16 bits), got {x.dtype}")


def vector_bytes(codec: CodecLike, dtype: Any, head_dim: int) -> int:
    """Bytes of one encoded vector of head_dim elements."""
    out = ffi.new("uint64_t *")
    check(lib.kvh_codec_vector_bytes(int(Codec.parse(codec)), int(DType.parse(dtype)), int(head_dim), out))
    return int(out[0])


def encode(x: Any, codec: CodecLike) -> np.ndarray:
    """Encodes every vector along the last axis of x; returns uint8 records
    shaped x.shape[:-1] + (vector_bytes,)."""
    a = np.ascontiguousarray(x)
    if a.ndim < 1:
        raise ValueError("x must have at least one axis")
    dt = _dtype_of(a)
    c = Codec.parse(codec)
    d = a.shape[-1]
    rec = vector_bytes(c, dt, d)
    n = a.size // d if d else 0
    out = np.empty(a.shape[:-1] + (rec,), np.uint8)
    check(lib.kvh_codec_encode(int(c), int(dt), d, ffi.from_buffer(a), n, ffi.from_buffer(out)))
    return out


def decode(records: Any, codec: CodecLike, head_dim: int, dtype: Any = np.float32) -> np.ndarray:
    """Decodes uint8 records (last axis: one record) into vectors of head_dim
    elements of dtype (NumPy float32/float16, or "bf16" for uint16 bits)."""
    r = np.ascontiguousarray(records, dtype=np.uint8)
    c = Codec.parse(codec)
    kd = DType.parse(dtype)
    rec = vector_bytes(c, kd, head_dim)
    if r.ndim < 1 or r.shape[-1] != rec:
        raise ValueError(f"records must end in an axis of {rec} bytes for this codec and head_dim")
    np_dt = {DType.F32: np.float32, DType.F16: np.float16, DType.BF16: np.uint16}[kd]
    out = np.empty(r.shape[:-1] + (head_dim,), np_dt)
    n = r.size // rec
    check(lib.kvh_codec_decode(int(c), int(kd), int(head_dim), ffi.from_buffer(r), n, ffi.from_buffer(out)))
    return out


def round_trip(x: Any, codec: CodecLike) -> np.ndarray:
    """decode(encode(x)): x as the engine returns it after a demotion."""
    a = np.ascontiguousarray(x)
    dt = _dtype_of(a)
    return decode(encode(a, codec), codec, a.shape[-1], dt)


__all__ = ["Codec", "vector_bytes", "encode", "decode", "round_trip"]
