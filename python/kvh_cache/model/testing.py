"""A tiny random Llama GGUF for tests and demos that must not depend on the
98 MB SmolLM2 file: same tensor names, metadata keys, tokenizer tables and
quantisation types as a real llama.cpp conversion (written with
``gguf.GGUFWriter``)."""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import numpy as np

from .tokenizer import bytes_to_unicode

__all__ = ["write_tiny_llama", "TINY_SPECIALS", "tiny_vocab", "tiny_spm_vocab"]

TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_MERGES = ("Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "Ġ s", "o n", "Ġa n", "Ġan d", "Ġ o", "r e")


def tiny_vocab() -> Tuple[List[str], List[int], List[str]]:
    """(tokens, token_types, merges): three control tokens, the 256 byte
    symbols of GPT-2's alphabet (in byte order), then one token per merge."""
    b2u = bytes_to_unicode()
    tokens = list(TINY_SPECIALS) + [b2u[b] for b in range(256)]
    types = [3] * len(TINY_SPECIALS) + [1] * 256
    for m in _MERGES:
        tokens.append(m.replace(" ", ""))
        types.append(1)
    return tokens, types, list(_MERGES)


_SPM_PIECES = (
    "▁t",
    "he",
    "▁the",
    "in",
    "▁a",
    "er",
    "▁s",
    "on",
    "an",
    "nd",
    "▁and",
    "▁c",
    "at",
    "▁cat",
    "▁h",
    "▁hat",
    "▁o",
    "▁on",
    "re",
    "▁m",
    "▁mat",
    "▁th",
    "is",
    "▁is",
    "▁▁",
    "▁▁▁▁",
)


def tiny_spm_vocab() -> Tuple[List[str], List[int], List[float]]:
    """(tokens, token_types, scores) of a small SentencePiece vocabulary:
    <unk>, <s>, </s>, the 256 <0xXX> byte tokens, merged pieces (higher
    score first), then single characters (ASCII printable and ▁)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    pieces = list(_SPM_PIECES) + ["▁"] + [chr(c) for c in range(33, 127)]
    for i, p in enumerate(pieces):
        tokens.append(p)
        types.append(1)
        scores.append(-float(i))
    return tokens, types, scores


def write_tiny_llama(
    path: str,
    *,
    n_layers: int = 2,
    d_model: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    d_ff: int = 128,
    qtype: str = "Q4_1",
    seed: int = 0,
    tied: bool = True,
    context_length: int = 512,
    rope_base: float = 10000.0,
    embd_qtype: str = "Q8_0",
    extra_metadata: Optional[Dict[str, object]] = None,
    tokenizer: str = "bpe",
    rope_freqs: Optional[np.ndarray] = None,
    rope_linear_factor: Optional[float] = None,
) -> str:
    """Writes a random Llama-architecture GGUF with a byte-level BPE
    vocabulary (``tokenizer.ggml.pre = smollm``; ``tokenizer="spm"``: a
    SentencePiece one, model ``llama``) and returns ``path``.
    Matrices are quantised to ``qtype`` (F32, F16, Q8_0, Q4_0, Q4_1, ...),
    the embedding to ``embd_qtype``, norms stay F32."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    rng = np.random.default_rng(seed)
    if tokenizer == "bpe":
        tokens, types, merges = tiny_vocab()
    elif tokenizer == "spm":
        tokens, types, scores = tiny_spm_vocab()
    else:
        raise ValueError(f"tokenizer must be 'bpe' or 'spm', got {tokenizer!r}")
    vocab = len(tokens)
    head_dim = d_model // n_heads
    w = gguf.GGUFWriter(os.fspath(path), "llama")
    w.add_name("kvh tiny llama")
    w.add_block_count(n_layers)
    w.add_context_length(context_length)
    w.add_embedding_length(d_model)
    w.add_feed_forward_length(d_ff)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_rope_freq_base(rope_base)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    if rope_linear_factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope_linear_factor)
    w.add_vocab_size(vocab)
    w.add_file_type(1)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if tokenizer == "bpe":
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_merges(merges)
        w.add_bos_token_id(0)
        w.add_eos_token_id(2)
        w.add_add_bos_token(False)
    else:
        w.add_tokenizer_model("llama")
        w.add_token_scores(scores)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(True)
    for k, v in (extra_metadata or {}).items():
        if isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_int64(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        else:
            w.add_array(k, list(v))  # type: ignore[arg-type]

    def add(name: str, a: np.ndarray, q: str) -> None:
        a = a.astype(np.float32)
        if q == "F32":
            w.add_tensor(name, a)
        elif q == "F16":
            w.add_tensor(name, a.astype(np.float16))
        else:
            qt = T[q]
            w.add_tensor(name, quants.quantize(a, qt), raw_dtype=qt)

    def mat(rows: int, cols: int) -> np.ndarray:
        return rng.standard_normal((rows, cols)).astype(np.float32) / np.sqrt(cols)

    add("token_embd.weight", rng.standard_normal((vocab, d_model)).astype(np.float32), embd_qtype)
    for i in range(n_layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", 1.0 + 0.1 * rng.standard_normal(d_model), "F32")
        add(p + "attn_q.weight", mat(n_heads * head_dim, d_model), qtype)
        add(p + "attn_k.weight", mat(n_kv_heads * head_dim, d_model), qtype)
        add(p + "attn_v.weight", mat(n_kv_heads * head_dim, d_model), qtype)
        add(p + "attn_output.weight", mat(d_model, n_heads * head_dim), qtype)
        add(p + "ffn_norm.weight", 1.0 + 0.1 * rng.standard_normal(d_model), "F32")
        add(p + "ffn_gate.weight", mat(d_ff, d_model), qtype)
        add(p + "ffn_up.weight", mat(d_ff, d_model), qtype)
        add(p + "ffn_down.weight", mat(d_model, d_ff), qtype)
    add("output_norm.weight", np.ones(d_model), "F32")
    if rope_freqs is not None:
        add("rope_freqs.weight", np.asarray(rope_freqs, np.float32), "F32")
    if not tied:
        add("output.weight", mat(vocab, d_model), qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(path)
