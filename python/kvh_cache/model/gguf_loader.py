"""Reads a Llama-family GGUF file: metadata, tokenizer tables, and every
weight dequantised once to float32 NumPy.

The file is memory-mapped and parsed here directly: the header walk of
``gguf.GGUFReader`` builds one NumPy memmap per string of the tokenizer
tables. Opening SmolLM2-135M-Instruct.Q4_1.gguf (49k-token vocabulary;
gguf 0.19, Python 3.11, a shared 2-core x86-64 machine, best of three):
``gguf.GGUFReader`` 3.9 s, this parser 0.05 s. The ``gguf`` package supplies the tensor type enum, the
block sizes, and the dequantiser for every type this module does not decode
itself (Q4_0, Q4_1, Q8_0, F16, BF16 and F32 are decoded here with vectorised
NumPy; the test suite checks them bit for bit against ``gguf.quants``).

Weight layout: GGUF lists dimensions innermost first, so a matrix with
``ne = [n_in, n_out]`` becomes a NumPy array shaped ``(n_out, n_in)`` and a
linear layer is ``x @ W.T``. The Q and K projections of ``llama`` GGUF files
are stored permuted by the converter for llama.cpp's "normal" (interleaved
pairs) RoPE, which is the RoPE :mod:`kvh_cache.model.llama` applies.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import struct
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .._handle import Closable

__all__ = ["GGUFFile", "ModelConfig", "TensorInfo", "load_config", "dequantize", "DEFAULT_MODEL_HINT"]

DEFAULT_MODEL_HINT = "python -m kvh_cache.model fetch"

GGUF_MAGIC = b"GGUF"
# Metadata arrays of arrays: real files nest one level at most; a hostile
# one nested thousands deep would end in RecursionError.
_MAX_ARRAY_DEPTH = 16

# GGUF metadata value types
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(13)
_SCALAR = {
    _UINT8: ("<B", 1),
    _INT8: ("<b", 1),
    _UINT16: ("<H", 2),
    _INT16: ("<h", 2),
    _UINT32: ("<I", 4),
    _INT32: ("<i", 4),
    _FLOAT32: ("<f", 4),
    _BOOL: ("<?", 1),
    _UINT64: ("<Q", 8),
    _INT64: ("<q", 8),
    _FLOAT64: ("<d", 8),
}
_NP_SCALAR = {
    _UINT8: np.uint8,
    _INT8: np.int8,
    _UINT16: np.uint16,
    _INT16: np.int16,
    _UINT32: np.uint32,
    _INT32: np.int32,
    _FLOAT32: np.float32,
    _BOOL: np.bool_,
    _UINT64: np.uint64,
    _INT64: np.int64,
    _FLOAT64: np.float64,
}


def _gguf():
    try:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("kvh_cache.model needs the `gguf` package (pip install 'kvh-cache[model]')") from exc
    return GGMLQuantizationType, GGML_QUANT_SIZES


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: Tuple[int, ...]  # NumPy order (outermost first)
    type_id: int
    type_name: str
    offset: int  # absolute offset in the file
    nbytes: int


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


class GGUFFile(Closable):
    """A parsed GGUF file: ``metadata`` (key → Python value; arrays of
    strings as lists of str, numeric arrays as NumPy arrays) and
    ``tensors`` (name → :class:`TensorInfo`). The file stays mapped until
    :meth:`close`."""

    def __init__(self, path: str) -> None:
        self.path = os.fspath(path)
        # A FIFO would block the open, a device map nothing: regular files only.
        if os.path.exists(self.path) and not os.path.isfile(self.path):
            raise ValueError(f"{self.path}: not a regular file, not a GGUF model")
        with open(self.path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise ValueError(f"{self.path}: an empty file, not a GGUF model")
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._parse()
        except (struct.error, OverflowError, MemoryError, IndexError) as exc:
            # Counts and lengths read from a cut or damaged header run past
            # the end of the file: one message, not the unpacker's.
            self.close()
            raise ValueError(
                f"{self.path}: not a valid or complete GGUF file (its header runs past the end of the "
                f"{_file_size(self.path)}-byte file: truncated or damaged)"
            ) from exc
        except ValueError as exc:
            self.close()
            if str(exc).startswith(self.path):
                raise
            raise ValueError(f"{self.path}: not a valid or complete GGUF file ({exc})") from exc
        except Exception:
            self.close()
            raise

    # ---- parsing ----
    def _parse(self) -> None:
        mm = self._mm
        if mm[:4] != GGUF_MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (magic {bytes(mm[:4])!r})")
        (self.version,) = struct.unpack_from("<I", mm, 4)
        if self.version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {self.version} is not supported (need 2 or 3)")
        n_tensors, n_kv = struct.unpack_from("<QQ", mm, 8)
        off = 24
        meta: Dict[str, Any] = {}
        types: Dict[str, Tuple[int, Optional[int]]] = {}
        for _ in range(n_kv):
            key, off = self._str(off)
            (vtype,) = struct.unpack_from("<I", mm, off)
            off += 4
            types[key] = (vtype, struct.unpack_from("<I", mm, off)[0] if vtype == _ARRAY else None)
            meta[key], off = self._value(vtype, off)
        self.metadata = meta
        #: key -> (GGUF value type, element type of an array or None), for
        #: writing the metadata back as it was (kvh_cache.model.requant).
        self.metadata_types = types
        self.metadata_end = off  # the header and the metadata: file bytes [0, metadata_end)
        qtype, qsizes = _gguf()
        infos: List[Tuple[str, Tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name, off = self._str(off)
            (nd,) = struct.unpack_from("<I", mm, off)
            off += 4
            dims = struct.unpack_from(f"<{nd}Q", mm, off)
            off += 8 * nd
            ttype, toff = struct.unpack_from("<IQ", mm, off)
            off += 12
            infos.append((name, tuple(int(d) for d in dims), int(ttype), int(toff)))
        align = meta.get("general.alignment", 32)
        # An integer power of two, as llama.cpp requires: 0 would divide by
        # zero, a negative one put the data inside the header.
        if isinstance(align, (bool, float, np.floating)) or not isinstance(align, (int, np.integer)):
            raise ValueError(f"{self.path}: general.alignment {align!r} is not an integer")
        align = int(align)
        if align <= 0 or align & (align - 1):
            raise ValueError(f"{self.path}: general.alignment {align} is not a power of two")
        data_start = (off + align - 1) // align * align
        self.data_offset = data_start
        self.tensors: Dict[str, TensorInfo] = {}
        for name, dims, ttype, toff in infos:
            try:
                tname = qtype(ttype).name
                blk, tsz = qsizes[qtype(ttype)]
            except (ValueError, KeyError):
                raise ValueError(f"{self.path}: tensor {name} has unknown ggml type {ttype}") from None
            if name in self.tensors:
                raise ValueError(f"{self.path}: tensor {name} is listed twice")
            n = math.prod(dims)  # Python integers: no 64-bit wrap of a hostile shape
            if dims[0] % blk:
                raise ValueError(f"{self.path}: tensor {name}: row of {dims[0]} is not a multiple of {blk}")
            nbytes = n // blk * tsz
            start = data_start + toff
            if start + nbytes > len(mm):
                raise ValueError(f"{self.path}: tensor {name} runs past the end of the file (truncated?)")
            self.tensors[name] = TensorInfo(name, tuple(reversed(dims)), ttype, tname, start, nbytes)

    def _str(self, off: int) -> Tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._mm, off)
        off += 8
        return self._mm[off : off + n].decode("utf-8", "surrogateescape"), off + n

    def _value(self, vtype: int, off: int, depth: int = 0) -> Tuple[Any, int]:
        mm = self._mm
        if depth > _MAX_ARRAY_DEPTH:
            raise ValueError(f"arrays nested more than {_MAX_ARRAY_DEPTH} deep at offset {off}")
        if vtype in _SCALAR:
            fmt, size = _SCALAR[vtype]
            return struct.unpack_from(fmt, mm, off)[0], off + size
        if vtype == _STRING:
            return self._str(off)
        if vtype == _ARRAY:
            etype, count = struct.unpack_from("<IQ", mm, off)
            off += 12
            if etype in _NP_SCALAR:
                dt = np.dtype(_NP_SCALAR[etype]).newbyteorder("<")
                arr = np.frombuffer(mm, dtype=dt, count=count, offset=off).copy()
                return arr, off + count * dt.itemsize
            if etype == _STRING:
                out = []
                unpack = struct.Struct("<Q").unpack_from
                for _ in range(count):
                    (n,) = unpack(mm, off)
                    off += 8
                    out.append(mm[off : off + n].decode("utf-8", "surrogateescape"))
                    off += n
                return out, off
            items = []
            for _ in range(count):
                v, off = self._value(etype, off, depth + 1)
                items.append(v)
            return items, off
        raise ValueError(f"{self.path}: unknown GGUF value type {vtype} at offset {off}")

    # ---- data ----
    def read(self, start: int, end: int) -> bytes:
        """A copy of the file's bytes [start, end) (e.g. ``read(0,
        data_offset)``: the header, metadata and tensor table)."""
        return bytes(self._mm[start:end])

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes (read-only view of the mapping), shaped
        ``(rows..., row_bytes)`` as ``gguf.quants.dequantize`` expects."""
        t = self.tensors[name]
        qtype, qsizes = _gguf()
        blk, tsz = qsizes[qtype(t.type_id)]
        row_bytes = t.shape[-1] // blk * tsz
        a = np.frombuffer(self._mm, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        return a.reshape(*t.shape[:-1], row_bytes)

    def tensor(self, name: str) -> np.ndarray:
        """The tensor dequantised to a new float32 array of its NumPy shape."""
        t = self.tensors[name]
        return dequantize(self.raw(name), t.type_name).reshape(t.shape)

    def close(self) -> None:
        mm, self._mm = getattr(self, "_mm", None), None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a view is still alive; the GC unmaps it later
                pass


# ---------------------------------------------------------------------------------
# dequantisation
# ---------------------------------------------------------------------------------
def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml nibble order: low nibbles of the 16 bytes are elements 0..15,
    high nibbles elements 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def dequantize(raw: np.ndarray, type_name: str) -> np.ndarray:
    """Bytes of a tensor shaped ``(..., row_bytes)`` → float32 ``(..., row)``.
    Q4_0, Q4_1, Q8_0, F16, BF16, F32 here; anything else through
    ``gguf.quants.dequantize``."""
    lead = raw.shape[:-1]
    flat = raw.reshape(-1)
    if type_name == "F32":
        return flat.view(np.float32).astype(np.float32).reshape(*lead, -1)
    if type_name == "F16":
        return flat.view(np.float16).astype(np.float32).reshape(*lead, -1)
    if type_name == "BF16":
        return (flat.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(*lead, -1)
    if type_name == "Q8_0":
        b = flat.reshape(-1, 34)
        d = _f16(b[:, :2])
        q = b[:, 2:].view(np.int8).astype(np.float32)
        return (q * d).reshape(*lead, -1)
    if type_name == "Q4_0":
        b = flat.reshape(-1, 18)
        d = _f16(b[:, :2])
        q = _nibbles(b[:, 2:]).astype(np.int8) - np.int8(8)
        return (q.astype(np.float32) * d).reshape(*lead, -1)
    if type_name == "Q4_1":
        b = flat.reshape(-1, 20)
        d = _f16(b[:, :2])
        m = _f16(b[:, 2:4])
        q = _nibbles(b[:, 4:]).astype(np.float32)
        return (q * d + m).reshape(*lead, -1)
    qtype, _ = _gguf()
    from gguf import quants

    return np.asarray(quants.dequantize(np.ascontiguousarray(raw), qtype[type_name]), dtype=np.float32)


# ---------------------------------------------------------------------------------
# model configuration from the metadata
# ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str
    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    context_length: int
    rope_base: float
    rope_dim: int
    rope_scale: float  # linear RoPE scaling: positions are multiplied by this (1 / scaling.factor)
    rms_eps: float
    tied_output: bool

    @property
    def n_rep(self) -> int:
        return self.n_heads // self.n_kv_heads


LLAMA_FAMILY = ("llama", "mistral")


def load_config(g: GGUFFile) -> ModelConfig:
    md = g.metadata
    arch = md.get("general.architecture")
    if arch not in LLAMA_FAMILY:
        raise ValueError(f"{g.path}: architecture {arch!r} is not Llama-family (supported: {', '.join(LLAMA_FAMILY)})")

    def key(name: str, default: Any = None) -> Any:
        v = md.get(f"{arch}.{name}", default)
        if v is None:
            raise ValueError(f"{g.path}: metadata key {arch}.{name} is missing")
        return v

    n_heads = int(key("attention.head_count"))
    n_kv = int(key("attention.head_count_kv", n_heads))
    d_model = int(key("embedding_length"))
    head_dim = int(md.get(f"{arch}.attention.key_length", d_model // n_heads))
    vocab = md.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(md.get("tokenizer.ggml.tokens", [])) or g.tensors["token_embd.weight"].shape[0]
    scaling = md.get(f"{arch}.rope.scaling.type")
    rope_scale = 1.0
    if scaling == "linear":
        rope_scale = 1.0 / float(md.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    elif scaling not in (None, "none"):
        raise ValueError(f"{g.path}: RoPE scaling {scaling!r} is not supported by this runner (none, linear)")
    if f"{arch}.expert_count" in md and int(md[f"{arch}.expert_count"]) > 0:
        raise ValueError(f"{g.path}: mixture-of-experts models are not supported by this runner")
    return ModelConfig(
        arch=arch,
        name=str(md.get("general.name", os.path.basename(g.path))),
        n_layers=int(key("block_count")),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        d_ff=int(key("feed_forward_length")),
        vocab_size=int(vocab),
        context_length=int(key("context_length", 2048)),
        rope_base=float(md.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_dim=int(md.get(f"{arch}.rope.dimension_count", head_dim)),
        rope_scale=rope_scale,
        rms_eps=float(md.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tied_output="output.weight" not in g.tensors,
    )
