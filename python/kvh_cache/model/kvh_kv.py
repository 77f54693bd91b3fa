"""KV backend over a kvh sequence: K/V of every layer are written into the
sequence's paged blocks (``Sequence.write_kv``) and attention is kvh's
paged attention launch (``Engine.attention_prefill`` / ``attention_decode``).

``attention`` selects how attention is computed:

``"kernel"``
    kvh's attention launch (``kvh_attention_prefill`` / ``_decode``) over
    the paged cache. The sequence is acquired (device tier) for the forward
    pass and released after it.
``"readback"``
    K/V read back from the paged cache with ``Sequence.read_kv`` (from
    whichever tier holds them), attention in NumPy (float64). For libkvh
    builds whose attention entry points answer ``KVH_ERR_UNSUPPORTED``.
``"vmap"``
    attention over virtually contiguous views of each layer
    (``Sequence.vmap`` + ``Engine.attention_decode_vmap`` /
    ``attention_prefill_vmap``: the blocks' pages mapped into one
    contiguous range, no block table). Needs an engine opened with ``vmap=True``
    (``Runner.engine(vmap=True)``). Views are refreshed every step and
    released at the end of each forward pass, like the hold.
``"stream"``
    kvh's attention launch over the paged cache wherever its blocks lie:
    nothing is acquired, and the blocks outside the device tier are read
    chunk by chunk through a window of device-tier slots
    (``stream_chunk_blocks`` / ``stream_window_blocks``; CPU backend). A
    context larger than the device tier is decoded this way.
``"auto"`` (default)
    ``kernel``; a pass whose sequence does not fit in the device tier
    (``NoSpaceError`` from the acquire) is streamed instead, on the CPU
    backend; when the library answers ``UnsupportedError`` the backend
    switches to ``readback`` for the rest of its life and says so in
    :attr:`KvhKV.attention_used`.
"""

from __future__ import annotations

import logging
import numpy as np

from .reference import causal_attention

__all__ = ["KvhKV", "CodecKV", "ATTENTION_MODES", "kernel_attention_available"]

log = logging.getLogger("kvh.model")

ATTENTION_MODES = ("auto", "kernel", "readback", "vmap", "stream")


def _kvh():
    import kvh_cache as kvh

    return kvh


class KvhKV:
    """:class:`kvh_cache.model.llama.KVBackend` over ``seq`` of ``engine``.

    ``threads``: CPU worker threads of the attention launch (0 = all).
    ``stream_chunk_blocks`` / ``stream_window_blocks``: the streaming
    window (0 = a quarter of the device tier per chunk, two chunks)."""

    def __init__(
        self,
        engine,
        seq=None,
        *,
        attention: str = "auto",
        threads: int = 0,
        stream_chunk_blocks: int = 0,
        stream_window_blocks: int = 0,
    ) -> None:
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
        self.engine = engine
        self.seq = seq if seq is not None else engine.sequence()
        self.mode = attention
        self.threads = threads
        self._np_dtype = np.dtype(engine.np_dtype)
        self._hold = None
        self._len = 0
        self.attention_used: str = {
            "auto": "kernel?",
            "kernel": "kernel",
            "readback": "readback",
            "vmap": "vmap",
            "stream": "stream",
        }[attention]
        self._views: dict = {}
        self.vmap_calls = 0
        self.kernel_calls = 0
        self.readback_calls = 0
        self.stream_calls = 0
        self._streaming = attention == "stream"
        self._stream_blocks = self._window(stream_chunk_blocks, stream_window_blocks)

    def _window(self, chunk: int, window: int):
        if chunk <= 0:
            device = self.engine.tier_info("device").capacity_blocks
            chunk = max(1, device // 4)
        if window <= 0:
            window = 2 * chunk
        return chunk, window

    @property
    def length(self) -> int:
        return self.seq.length

    # ---- protocol ----
    def begin(self, tokens: np.ndarray) -> int:
        pos0 = self.seq.length
        self.seq.append(np.asarray(tokens, dtype=np.int32))
        self._len = pos0 + len(tokens)
        self._streaming = self.mode == "stream"
        if self.mode not in ("readback", "stream"):
            # The attention launch needs every block resident in the device
            # tier: promote what was demoted and hold it for this pass.
            kvh = _kvh()
            try:
                self._hold = self.seq.acquire()
            except kvh.NoSpaceError:
                if self.mode != "auto" or self.engine.backend != "cpu":
                    self.seq.truncate(pos0)  # leave the sequence as it was
                    raise
                self._streaming = True  # larger than the device tier: stream this pass
            except BaseException:
                self.seq.truncate(pos0)
                raise
        return pos0

    def write(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        dt = self._np_dtype
        self.seq.write_kv(layer, pos, np.ascontiguousarray(k, dtype=dt), np.ascontiguousarray(v, dtype=dt))

    def attend(self, layer: int, q: np.ndarray, pos: int) -> np.ndarray:
        n = q.shape[0]
        if pos + n != self._len:
            raise ValueError(f"attend: queries end at {pos + n} but the sequence has {self._len} tokens")
        if self.mode != "readback":
            kvh = _kvh()
            qc = np.ascontiguousarray(q, dtype=np.float32)
            if self.mode == "vmap":
                vm = self._view(layer)
                if n == 1:
                    out = self.engine.attention_decode_vmap([vm], qc, threads=self.threads)
                else:
                    out = self.engine.attention_prefill_vmap([vm], [n], qc, threads=self.threads)
                self.vmap_calls += 1
                return out
            if self._streaming:
                chunk, window = self._stream_blocks
                kw = dict(threads=self.threads, stream_chunk_blocks=chunk, stream_window_blocks=window)
                if n == 1:
                    out = self.engine.attention_decode(layer, [self.seq], qc, **kw)
                else:
                    out = self.engine.attention_prefill(layer, [self.seq], [n], qc, **kw)
                self.stream_calls += 1
                self.attention_used = "stream" if self.mode == "stream" else "kernel+stream"
                return out
            try:
                if n == 1:
                    out = self.engine.attention_decode(layer, [self.seq], qc, threads=self.threads)
                else:
                    out = self.engine.attention_prefill(layer, [self.seq], [n], qc, threads=self.threads)
                self.kernel_calls += 1
                self.attention_used = "kernel"
                return out
            except kvh.UnsupportedError as exc:
                if self.mode == "kernel":
                    raise
                log.warning(
                    "kvh_cache.model: libkvh attention is unavailable (%s); using read_kv + NumPy attention", exc
                )
                self.mode = "readback"
                self._release()
        k, v = self.seq.read_kv(layer, 0, self._len)
        self.readback_calls += 1
        self.attention_used = "readback"
        return causal_attention(q, k, v, pos)

    def end(self) -> None:
        self._release()

    def _view(self, layer: int):
        """The layer's view, brought up to date (made on first use, or again
        when the sequence outgrew it)."""
        kvh = _kvh()
        vm = self._views.get(layer)
        if vm is not None:
            try:
                vm.refresh()
                return vm
            except kvh.RangeError:
                vm.release()
        vm = self.seq.vmap(layer, max(2 * self._len, 256))
        self._views[layer] = vm
        return vm

    def _release(self) -> None:
        views, self._views = self._views, {}
        for vm in views.values():
            vm.release()
        h, self._hold = self._hold, None
        if h is not None:
            h.release()

    # ---- conveniences ----
    def fork(self) -> "KvhKV":
        """A backend over a copy-on-write fork of the sequence."""
        chunk, window = self._stream_blocks
        return KvhKV(
            self.engine,
            self.seq.fork(),
            attention=self.mode,
            threads=self.threads,
            stream_chunk_blocks=chunk,
            stream_window_blocks=window,
        )

    def free(self) -> None:
        self._release()
        self.seq.free()


class CodecKV:
    """Wraps a KV backend: K and V go through one of libkvh's KV codecs
    (:mod:`kvh_cache.codec`, the code the engine runs when ``kv_codec`` makes the
    host and disk tiers quantised) before they are written, as if every
    block had been demoted and promoted back. Codecs work per token and
    head, so this equals a real round trip through an encoded tier value
    for value."""

    def __init__(self, inner, codec, *, keys: bool = True, values: bool = True) -> None:
        import kvh_cache as kvh

        self.inner, self.codec, self.keys, self.values = inner, kvh.Codec.parse(codec), keys, values

    @property
    def length(self) -> int:
        return self.inner.length

    @property
    def attention_used(self) -> str:
        return f"{self.inner.attention_used}+{self.codec.name.lower()}"

    def begin(self, tokens: np.ndarray) -> int:
        return self.inner.begin(tokens)

    def write(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        from kvh_cache import codec as kc

        if self.keys:
            k = kc.round_trip(np.ascontiguousarray(k, dtype=np.float32), self.codec)
        if self.values:
            v = kc.round_trip(np.ascontiguousarray(v, dtype=np.float32), self.codec)
        self.inner.write(layer, pos, k, v)

    def attend(self, layer: int, q: np.ndarray, pos: int) -> np.ndarray:
        return self.inner.attend(layer, q, pos)

    def end(self) -> None:
        self.inner.end()


def kernel_attention_available(engine) -> bool:
    """True when the engine's libkvh answers an attention launch (a probe
    on a one-token sequence)."""
    kvh = _kvh()
    H, D = engine.num_kv_heads, engine.head_dim
    seq = engine.sequence(tokens=[0])
    try:
        z = np.zeros((1, H, D), engine.np_dtype)
        seq.write_kv(0, 0, z, z)
        with seq.acquire():
            engine.attention_decode(0, [seq], np.zeros((1, H, D), np.float32))
        return True
    except kvh.UnsupportedError:
        return False
    finally:
        seq.free()
