"""The Llama forward pass in NumPy float32, with a pluggable KV cache.

Every layer computes its Q, K and V for the new tokens, hands K/V to a
:class:`KVBackend` (``write``) and asks it for the attention output of the
queries (``attend``). :class:`kvh_cache.model.reference.ContiguousKV` is the
NumPy oracle; :class:`kvh_cache.model.kvh_kv.KvhKV` stores K/V in a kvh sequence
and runs kvh's paged attention.

Architecture (llama.cpp's ``llama`` graph): token embedding → per layer
[RMSNorm → Q/K/V projections → RoPE (llama.cpp "normal" style: adjacent
pairs; GGUF llama files store Q/K permuted for it) → GQA attention → output
projection → residual → RMSNorm → SwiGLU MLP → residual] → RMSNorm → output
head (tied to the embedding when the file has no ``output.weight``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Set, runtime_checkable

import numpy as np

from .gguf_loader import GGUFFile, ModelConfig, load_config

__all__ = ["KVBackend", "LlamaModel", "LayerWeights", "rms_norm", "rope"]


@runtime_checkable
class KVBackend(Protocol):
    """Where a forward pass keeps K/V and how it attends.

    One forward call over ``n`` new tokens does::

        pos0 = kv.begin(tokens)            # tokens appended; their positions are pos0..pos0+n-1
        for layer in range(L):
            kv.write(layer, pos0, k, v)     # k, v: (n, n_kv_heads, head_dim) float32, post-RoPE K
            out = kv.attend(layer, q, pos0) # q: (n, n_heads, head_dim) → (n, n_heads, head_dim)
        kv.end()

    ``attend`` is causal: query row ``i`` sees tokens ``0 .. pos0 + i``.
    """

    @property
    def length(self) -> int: ...

    def begin(self, tokens: np.ndarray) -> int: ...

    def write(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None: ...

    def attend(self, layer: int, q: np.ndarray, pos: int) -> np.ndarray: ...

    def end(self) -> None: ...


@dataclasses.dataclass
class LayerWeights:
    attn_norm: np.ndarray  # (d,)
    w_qkv: np.ndarray  # (d + 2 * kv_dim, d): Q, K, V projections stacked
    w_o: np.ndarray  # (d, d)
    ffn_norm: np.ndarray  # (d,)
    w_gate_up: np.ndarray  # (2 * d_ff, d): gate then up
    w_down: np.ndarray  # (d, d_ff)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    ms = np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True)
    return (x * (1.0 / np.sqrt(ms + eps)).astype(np.float32)) * w


def rope(
    x: np.ndarray,
    positions: np.ndarray,
    base: float,
    rope_dim: int,
    *,
    scale: float = 1.0,
    freq_factors: Optional[np.ndarray] = None,
) -> np.ndarray:
    """llama.cpp "normal" RoPE on (n, heads, head_dim): adjacent pairs
    ``(x[2i], x[2i+1])`` rotate by ``scale * pos * base**(-2i/rope_dim) /
    freq_factors[i]`` (``rope_freqs.weight`` of Llama 3.1+ files)."""
    half = rope_dim // 2
    inv = base ** (-np.arange(half, dtype=np.float64) * 2.0 / rope_dim)
    if freq_factors is not None:
        inv = inv / freq_factors.astype(np.float64)
    ang = (positions.astype(np.float64) * scale)[:, None] * inv[None, :]  # (n, half)
    cos = np.cos(ang).astype(np.float32)[:, None, :]
    sin = np.sin(ang).astype(np.float32)[:, None, :]
    out = x.copy()
    x0 = x[..., 0:rope_dim:2]
    x1 = x[..., 1:rope_dim:2]
    out[..., 0:rope_dim:2] = x0 * cos - x1 * sin
    out[..., 1:rope_dim:2] = x0 * sin + x1 * cos
    return out


class LlamaModel:
    """Weights (float32, dequantised once) and the forward pass."""

    def __init__(
        self,
        config: ModelConfig,
        tok_embd: np.ndarray,
        layers: List[LayerWeights],
        output_norm: np.ndarray,
        output: np.ndarray,
        *,
        path: Optional[str] = None,
        metadata: Optional[Dict[str, object]] = None,
        identity: int = 0,
    ) -> None:
        self.config = config
        self.tok_embd = tok_embd
        self.layers = layers
        self.output_norm = output_norm
        self.output = output
        self.path = path
        self.metadata = metadata or {}
        self.identity = identity  # 63-bit id of the file (kvh model_salt)
        self.rope_freqs: Optional[np.ndarray] = None  # per-pair RoPE frequency divisors, when the file has them
        self.load_seconds = 0.0

    # ---- loading ----
    @classmethod
    def from_gguf(cls, path: str) -> "LlamaModel":
        t0 = time.perf_counter()
        with GGUFFile(path) as g:
            cfg = load_config(g)
            header = g.read(0, g.data_offset)  # metadata + tensor table
            size = os.path.getsize(path)
            m = cls.from_tensors(cfg, g.tensor, set(g.tensors), path=os.fspath(path), metadata=dict(g.metadata))
        h = hashlib.blake2b(header, digest_size=8, person=b"kvh_cache.model")
        h.update(size.to_bytes(8, "little"))
        m.identity = int.from_bytes(h.digest(), "little") & ((1 << 63) - 1) or 1
        m.load_seconds = time.perf_counter() - t0
        return m

    @classmethod
    def from_tensors(
        cls,
        cfg: ModelConfig,
        tensor: Callable[[str], np.ndarray],
        names: Set[str],
        *,
        path: Optional[str] = None,
        metadata: Optional[Dict[str, object]] = None,
        identity: int = 0,
        before_layer: Optional[Callable[[int], None]] = None,
    ) -> "LlamaModel":
        """Assembles the model from ``tensor(name)`` (float32 in NumPy
        shape). ``before_layer(i)`` runs before block i's tensors are read
        (-1: the embeddings, n_layers: the output head), so a caller whose
        weights arrive layer by layer can wait for each."""
        path = path or "<tensors>"
        step = before_layer or (lambda i: None)

        def get(name: str) -> np.ndarray:
            if name not in names:
                raise ValueError(f"{path}: tensor {name} is missing")
            return tensor(name)

        step(-1)
        tok = get("token_embd.weight")
        layers: List[LayerWeights] = []
        for i in range(cfg.n_layers):
            step(i)
            p = f"blk.{i}."
            wq, wk, wv = get(p + "attn_q.weight"), get(p + "attn_k.weight"), get(p + "attn_v.weight")
            if wq.shape != (cfg.n_heads * cfg.head_dim, cfg.d_model) or wk.shape != (
                cfg.n_kv_heads * cfg.head_dim,
                cfg.d_model,
            ):
                raise ValueError(
                    f"{path}: layer {i} projections have shapes {wq.shape}/{wk.shape}, which do not match the metadata"
                )
            for bias in ("attn_q.bias", "attn_k.bias", "attn_v.bias"):
                if p + bias in names:
                    raise ValueError(f"{path}: biased attention projections ({bias}) are not supported")
            layers.append(
                LayerWeights(
                    attn_norm=get(p + "attn_norm.weight"),
                    w_qkv=np.ascontiguousarray(np.concatenate([wq, wk, wv], axis=0)),
                    w_o=get(p + "attn_output.weight"),
                    ffn_norm=get(p + "ffn_norm.weight"),
                    w_gate_up=np.ascontiguousarray(
                        np.concatenate([get(p + "ffn_gate.weight"), get(p + "ffn_up.weight")], axis=0)
                    ),
                    w_down=get(p + "ffn_down.weight"),
                )
            )
            del wq, wk, wv
        step(cfg.n_layers)
        rope_freqs = get("rope_freqs.weight") if "rope_freqs.weight" in names else None
        if rope_freqs is not None and rope_freqs.shape != (cfg.rope_dim // 2,):
            raise ValueError(f"{path}: rope_freqs.weight has shape {rope_freqs.shape}, expected ({cfg.rope_dim // 2},)")
        out_norm = get("output_norm.weight")
        output = tok if cfg.tied_output else get("output.weight")
        m = cls(
            cfg,
            tok,
            layers,
            out_norm,
            output,
            path=path if path != "<tensors>" else None,
            metadata=metadata,
            identity=identity,
        )
        m.rope_freqs = rope_freqs
        return m

    # ---- forward ----
    def forward(self, tokens: Sequence[int], kv: KVBackend, *, all_logits: bool = False) -> np.ndarray:
        """Runs the new ``tokens`` through the model, appending their K/V to
        ``kv``. Returns the logits of the last token (vocab,), or of every
        token (n, vocab) with ``all_logits``."""
        cfg = self.config
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n = toks.size
        if n == 0:
            raise ValueError("forward needs at least one token")
        if toks.min() < 0 or toks.max() >= self.tok_embd.shape[0]:
            raise ValueError(f"token ids must be in [0, {self.tok_embd.shape[0]})")
        hq, hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qd, kvd = hq * hd, hkv * hd
        x = self.tok_embd[toks].astype(np.float32)
        pos0 = kv.begin(toks)
        try:
            positions = pos0 + np.arange(n)
            for li, lw in enumerate(self.layers):
                h = rms_norm(x, lw.attn_norm, cfg.rms_eps)
                qkv = h @ lw.w_qkv.T
                q = qkv[:, :qd].reshape(n, hq, hd)
                k = qkv[:, qd : qd + kvd].reshape(n, hkv, hd)
                v = np.ascontiguousarray(qkv[:, qd + kvd :].reshape(n, hkv, hd))
                q = rope(q, positions, cfg.rope_base, cfg.rope_dim, scale=cfg.rope_scale, freq_factors=self.rope_freqs)
                k = rope(k, positions, cfg.rope_base, cfg.rope_dim, scale=cfg.rope_scale, freq_factors=self.rope_freqs)
                kv.write(li, pos0, k, v)
                a = kv.attend(li, q, pos0)
                x = x + a.reshape(n, qd) @ lw.w_o.T
                h = rms_norm(x, lw.ffn_norm, cfg.rms_eps)
                gu = h @ lw.w_gate_up.T
                g, u = gu[:, : cfg.d_ff], gu[:, cfg.d_ff :]
                x = x + ((g / (1.0 + np.exp(-g))) * u) @ lw.w_down.T
        finally:
            kv.end()
        if not all_logits:
            x = x[-1:]
        x = rms_norm(x, self.output_norm, cfg.rms_eps)
        logits = x @ self.output.T
        return logits if all_logits else logits[0]

    @property
    def weight_bytes(self) -> int:
        total = self.tok_embd.nbytes + self.output_norm.nbytes
        if self.output is not self.tok_embd:
            total += self.output.nbytes
        for lw in self.layers:
            total += sum(getattr(lw, f.name).nbytes for f in dataclasses.fields(lw))
        return total


ProgressFn = Callable[[int, int], None]
