"""KV quantisation codecs of libkvh (``kvh_codec_*``) on NumPy arrays.

The same code the engine runs when ``Config(kv_codec=...)`` makes the host
and disk tiers hold quantised blocks. Each vector along the last axis (one
token's K or V in one head) is encoded on its own::

    import numpy as np, kvh_cache.codec as kc
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
from .engine import _U32, _index
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
    head_dim = _index("head_dim", head_dim, maximum=_U32)
    out = ffi.new("uint64_t *")
    check(lib.kvh_codec_vector_bytes(int(Codec.parse(codec)), int(DType.parse(dtype)), head_dim, out))
    return int(out[0])


def encode(x: Any, codec: CodecLike) -> np.ndarray:
    """Encodes every vector along the last axis of x; returns uint8 records
    shaped x.shape[:-1] + (vector_bytes,)."""
    a = _vectors(x)
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
    head_dim = _index("head_dim", head_dim, maximum=_U32)
    c = Codec.parse(codec)
    kd = DType.parse(dtype)
    rec = vector_bytes(c, kd, head_dim)
    r = _records(records, rec)
    if r.ndim < 1 or r.shape[-1] != rec:
        raise ValueError(f"records must end in an axis of {rec} bytes for this codec and head_dim")
    np_dt = {DType.F32: np.float32, DType.F16: np.float16, DType.BF16: np.uint16}[kd]
    out = np.empty(r.shape[:-1] + (head_dim,), np_dt)
    n = r.size // rec
    check(lib.kvh_codec_decode(int(c), int(kd), head_dim, ffi.from_buffer(r), n, ffi.from_buffer(out)))
    return out


def _records(records: Any, rec: int) -> np.ndarray:
    """Encoded records as contiguous uint8, without casting other numbers
    (a float or a value past 255 is not a byte of a record); bytes hold
    one record, or several one after another (then one row each)."""
    if isinstance(records, (bytes, bytearray, memoryview)):
        records = np.frombuffer(records, dtype=np.uint8)
        if records.size > rec and records.size % rec == 0:
            records = records.reshape(-1, rec)
    if isinstance(records, np.generic):
        # One byte is no record: encode returns records along a last axis.
        raise TypeError(
            f"records must be an array with a record axis (as encode returns them) or bytes, "
            f"not a {records.dtype} scalar"
        )
    if not isinstance(records, np.ndarray) or records.dtype != np.uint8:
        dt = getattr(records, "dtype", type(records).__name__)
        raise TypeError(f"records must be uint8 (as encode returns them) or bytes, not {dt}")
    return np.ascontiguousarray(records)


def _vectors(x: Any) -> np.ndarray:
    if np.ndim(x) < 1:  # before the copy, which makes a scalar 1-D
        raise ValueError("x must have at least one axis")
    return np.ascontiguousarray(x)


def round_trip(x: Any, codec: CodecLike) -> np.ndarray:
    """decode(encode(x)): x as the engine returns it after a demotion."""
    a = _vectors(x)
    dt = _dtype_of(a)
    return decode(encode(a, codec), codec, a.shape[-1], dt)


__all__ = ["Codec", "vector_bytes", "encode", "decode", "round_trip"]


def _as_f32(a: np.ndarray, dt: DType) -> np.ndarray:
    """Values as float32: bfloat16 comes as uint16 bits, not integers."""
    return (a.astype(np.uint32) << 16).view(np.float32) if dt == DType.BF16 else a.astype(np.float32)


def error_figures(x: Any, codec: CodecLike) -> dict:
    """Error of one codec on x (vectors along the last axis): relative RMS
    error, worst error as a fraction of the documented bound (decoded to f32,
    so before rounding to x's dtype), and the size of an encoded vector
    against the raw one."""
    a = _vectors(x)
    c = Codec.parse(codec)
    dt = _dtype_of(a)
    d = a.shape[-1]
    # Decoded to f32: the bound is stated before rounding to the dtype.
    # Without a codec a record is the input's own bytes, decoded as such.
    y = decode(encode(a, c), c, d, dt if c == Codec.NONE else np.float32)
    # In double: the subtraction and the bound in f32 rounded by up to half
    # an ulp each, which read as errors past the bound (1.000002).
    xf = _as_f32(a, dt).astype(np.float64)
    yf = _as_f32(y, dt if c == Codec.NONE else DType.F32).astype(np.float64)
    if c == Codec.NONE:
        bound = np.zeros_like(xf)  # stored as it is: no error to bound
    elif c == Codec.INT8:
        bound = np.abs(xf).max(axis=-1, keepdims=True) / 254.0
    else:
        g = 32 if c == Codec.Q4_G32 else 64
        xs = xf.reshape(xf.shape[:-1] + (d // g, g))
        bound = np.repeat((xs.max(-1) - xs.min(-1)) / 30.0, g, axis=-1).reshape(xf.shape)
    bound = bound * (1 + 2.0**-23)  # kvh.h: the rounding of the scale stored as an f32
    err = np.abs(xf - yf)
    past_rounding = err
    if c != Codec.NONE:
        # The bound holds before the decoded value is rounded (to f32 here):
        # that rounding, half an f32 ulp at most, is not the codec's error.
        rounding = np.abs(np.spacing(yf.astype(np.float32))).astype(np.float64) / 2
        past_rounding = np.maximum(err - rounding, 0.0)
    ratio = np.where(bound > 0, past_rounding / np.where(bound > 0, bound, 1), 0)
    return {
        "codec": c.name.lower(),
        "rel_rms_error": float(np.sqrt(np.mean(err**2)) / np.sqrt(np.mean(xf**2))),
        "max_error_over_bound": float(ratio.max()),
        "bytes_per_vector": vector_bytes(c, _dtype_of(a), d),
        "raw_bytes_per_vector": d * a.dtype.itemsize,
    }


def _main() -> None:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m kvh_cache.codec", description="error of the KV codecs on random data")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vectors", type=int, default=100000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.head_dim <= 0 or args.head_dim % 64:
        ap.error("--head-dim must be a positive multiple of 64 (the q4 codecs' group)")
    if args.vectors <= 0:
        ap.error("--vectors must be > 0")
    rng = np.random.default_rng(args.seed)
    data = {
        "gaussian": rng.standard_normal((args.vectors, args.head_dim)),
        # Real K often has a few large channels: a heavier tail per vector.
        "student_t3": rng.standard_t(3, (args.vectors, args.head_dim)),
    }
    for name, x in data.items():
        x16 = x.astype(np.float16)
        for c in ("int8", "q4_g32", "q4_g64"):
            print(json.dumps({"data": name, "dtype": "f16", "head_dim": args.head_dim, **error_figures(x16, c)}))


if __name__ == "__main__":
    _main()
