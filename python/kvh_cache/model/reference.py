"""The contiguous NumPy reference of the KV cache and attention.

:class:`ContiguousKV` keeps each layer's K/V in one growing array and
computes attention with an explicit causal softmax in float64: the oracle
that the kvh-backed path (:class:`kvh_cache.model.llama.KvhKV`) is compared with.

:class:`QuantizedKV` wraps any backend and passes K/V through a round trip
of a block quantisation codec (int8 or 4-bit, absmax per group of 32 values
along head_dim, one float16 scale per group; the Q8_0 / Q4_0 layouts of
ggml) before it is written, so that the effect of storing the cache
quantised can be measured (perplexity on a fixed text).
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np

__all__ = ["ContiguousKV", "QuantizedKV", "causal_attention", "quantize_dequantize"]


def causal_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, pos0: int, scale: Optional[float] = None, *, dtype=np.float64
) -> np.ndarray:
    """Attention of query rows at positions ``pos0 .. pos0+n-1`` over keys
    ``0 .. T-1`` (``T >= pos0 + n``), each row seeing keys up to its own
    position. ``q``: (n, Hq, D); ``k``, ``v``: (T, Hkv, D); GQA maps query
    head ``h`` to kv head ``h // (Hq // Hkv)``. Computed in ``dtype``
    (float64 by default); returns float32 (n, Hq, D)."""
    n, hq, d = q.shape
    t, hkv, _ = k.shape
    g = hq // hkv
    if scale is None:
        scale = 1.0 / np.sqrt(d)
    visible = pos0 + n
    qh = q.astype(dtype, copy=False).reshape(n, hkv, g, d).transpose(1, 2, 0, 3)  # (Hkv, G, n, D)
    kh = k[:visible].astype(dtype, copy=False).transpose(1, 2, 0)  # (Hkv, D, T)
    vh = v[:visible].astype(dtype, copy=False).transpose(1, 0, 2)  # (Hkv, T, D)
    s = (qh @ kh[:, None]) * dtype(scale)  # (Hkv, G, n, T)
    if n > 1:  # a single query row at the last position sees every key
        rows = pos0 + np.arange(n)[:, None]
        cols = np.arange(visible)[None, :]
        s = np.where(cols <= rows, s, -np.inf)
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    o = s @ vh[:, None]  # (Hkv, G, n, D)
    return np.ascontiguousarray(o.transpose(2, 0, 1, 3).reshape(n, hq, d), dtype=np.float32)


class ContiguousKV:
    """Reference KV backend: plain NumPy arrays per layer (capacity doubles
    as needed), float64 causal softmax. Implements the
    :class:`kvh_cache.model.llama.KVBackend` protocol."""

    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int, *, capacity: int = 256, dtype=np.float32
    ) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype = np.dtype(dtype)
        self._cap = max(1, capacity)
        self._k: List[np.ndarray] = [
            np.zeros((self._cap, num_kv_heads, head_dim), self.dtype) for _ in range(num_layers)
        ]
        self._v: List[np.ndarray] = [
            np.zeros((self._cap, num_kv_heads, head_dim), self.dtype) for _ in range(num_layers)
        ]
        self.tokens: List[int] = []
        self.attention_used = "reference"

    @property
    def length(self) -> int:
        return len(self.tokens)

    def _grow(self, need: int) -> None:
        if need <= self._cap:
            return
        cap = self._cap
        while cap < need:
            cap *= 2
        for lst in (self._k, self._v):
            for i, a in enumerate(lst):
                b = np.zeros((cap,) + a.shape[1:], a.dtype)
                b[: self._cap] = a
                lst[i] = b
        self._cap = cap

    def begin(self, tokens: np.ndarray) -> int:
        pos0 = len(self.tokens)
        self._grow(pos0 + len(tokens))
        self.tokens.extend(int(t) for t in tokens)
        return pos0

    def write(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        n = k.shape[0]
        self._k[layer][pos : pos + n] = k
        self._v[layer][pos : pos + n] = v

    def attend(self, layer: int, q: np.ndarray, pos: int) -> np.ndarray:
        t = pos + q.shape[0]
        return causal_attention(q, self._k[layer][:t], self._v[layer][:t], pos)

    def end(self) -> None:
        pass

    def truncate(self, n_tokens: int) -> None:
        del self.tokens[n_tokens:]

    def fork(self) -> "ContiguousKV":
        c = ContiguousKV.__new__(ContiguousKV)
        c.__dict__.update(self.__dict__)
        c._k = [a.copy() for a in self._k]
        c._v = [a.copy() for a in self._v]
        c.tokens = list(self.tokens)
        return c

    def read(self, layer: int):
        t = len(self.tokens)
        return self._k[layer][:t], self._v[layer][:t]


def quantize_dequantize(x: np.ndarray, bits: int, group: int = 32) -> np.ndarray:
    """Round trip of a symmetric absmax block codec along the last axis:
    groups of ``group`` values share one float16 scale ``d = amax / qmax``
    (qmax 127 for 8 bits, 7 for 4 bits: values in [-8, 7] as in Q4_0 with
    its sign-preserving scale), each value stored as ``round(x / d)``."""
    if bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    shape = x.shape
    if shape[-1] % group:
        raise ValueError(f"last axis {shape[-1]} is not a multiple of group {group}")
    xf = x.astype(np.float32, copy=False).reshape(-1, group)
    if bits == 8:
        amax = np.abs(xf).max(axis=1, keepdims=True)
        d = (amax / 127.0).astype(np.float16).astype(np.float32)
        inv = np.where(d > 0, 1.0 / np.where(d > 0, d, 1), 0)
        q = np.clip(np.rint(xf * inv), -127, 127)
    else:  # Q4_0: the value of largest magnitude maps to -8
        idx = np.abs(xf).argmax(axis=1)
        mx = xf[np.arange(xf.shape[0]), idx][:, None]
        d = (mx / -8.0).astype(np.float16).astype(np.float32)
        inv = np.where(d != 0, 1.0 / np.where(d != 0, d, 1), 0)
        q = np.clip(np.rint(xf * inv), -8, 7)
    return (q * d).astype(x.dtype).reshape(shape)


class QuantizedKV:
    """Wraps a KV backend; K and V are quantised and dequantised (int8 or
    4-bit, see :func:`quantize_dequantize`) before they are written, as if
    the whole cache were stored quantised."""

    def __init__(self, inner, bits: int, group: int = 32, *, keys: bool = True, values: bool = True) -> None:
        self.inner, self.bits, self.group, self.keys, self.values = inner, bits, group, keys, values

    @property
    def length(self) -> int:
        return self.inner.length

    @property
    def attention_used(self) -> str:
        return f"{self.inner.attention_used}+q{self.bits}"

    def begin(self, tokens: np.ndarray) -> int:
        return self.inner.begin(tokens)

    def write(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        if self.keys:
            k = quantize_dequantize(k, self.bits, self.group)
        if self.values:
            v = quantize_dequantize(v, self.bits, self.group)
        self.inner.write(layer, pos, k, v)

    def attend(self, layer: int, q: np.ndarray, pos: int) -> np.ndarray:
        return self.inner.attend(layer, q, pos)

    def end(self) -> None:
        self.inner.end()
