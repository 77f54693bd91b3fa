"""The worker side of the vLLM connector without vLLM: one kvh engine whose
external pool is the inference engine's own KV memory, described by raw
pointers and byte strides (so it can be tested with NumPy arrays and needs
neither torch nor vLLM).

One pool slot is one vLLM block and kvh's ``block_tokens`` is vLLM's block
size: vLLM allocates, matches and frees whole blocks, so a finer kvh block
would only add calls (kvh's block can be any power of two up to 256; vLLM's
CPU block is 128 tokens by default).
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .. import errors
from .._ffi import ffi, lib, raise_status
from ..engine import Block, Engine
from .settings import Settings

log = logging.getLogger("kvh.vllm")

SALT_VERSION = "kvh.vllm/1"


class StoreUnavailable(RuntimeError):
    """kvh cannot serve this worker (the message says why); the connector
    then stays out of vLLM's way."""


def model_salt(identity: Dict[str, Any]) -> int:
    """64-bit namespace of the prefix hashes: the model, dtype, block size,
    geometry and tensor-parallel rank, so a block is only ever found by the
    same model laid out the same way."""
    text = SALT_VERSION + "|" + "|".join(f"{k}={identity[k]}" for k in sorted(identity))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") or 1


@dataclass
class Counters:
    lookups: int = 0
    lookup_hit_tokens: int = 0
    blocks_loaded: int = 0
    tokens_loaded: int = 0
    load_errors: int = 0
    blocks_saved: int = 0
    save_errors: int = 0
    requests_persisted: int = 0
    persist_errors: int = 0
    load_seconds: float = 0.0
    save_seconds: float = 0.0

    def to_dict(self) -> Dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class _Req:
    scope: int = 0  # tenant scope of its blocks (vLLM's cache_salt), 0: shared
    hashes: List[int] = field(default_factory=list)
    tokens: Optional[np.ndarray] = None  # the full-block prefix saved or loaded so far


class KvStore:
    """kvh beneath one vLLM worker (one tensor-parallel rank)."""

    def __init__(
        self,
        settings: Settings,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_tokens: int,
        dtype: str,
        identity: Dict[str, Any],
    ) -> None:
        if block_tokens & (block_tokens - 1) or not 1 <= block_tokens <= 256:
            raise StoreUnavailable(
                f"kvh: vLLM's block size {block_tokens} is not a power of two up to 256, which kvh's blocks must be; "
                "run vLLM with --block-size 128 (or 32, 64, 256)"
            )
        self.settings = settings
        self.block_tokens = block_tokens
        self.salt = model_salt(
            dict(identity, layers=num_layers, kv_heads=num_kv_heads, head_dim=head_dim, block=block_tokens, dtype=dtype)
        )
        row = num_layers * 2 * num_kv_heads * block_tokens * head_dim * {"f32": 4, "f16": 2, "bf16": 2}[dtype]
        fields: Dict[str, Any] = dict(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_tokens=block_tokens,
            dtype=dtype,
            backend="cpu",
            device_bytes=settings.device_bytes or 2 * row,
            host_bytes=max(settings.host_bytes, 2 * row),
            model_salt=self.salt,
            log_level=settings.log_level,
            **settings.engine_remote_fields(),
        )
        self.disk_path: Optional[str] = None
        if settings.disk_enabled:
            # One store per salt: another model (or dtype, block size, rank)
            # gets its own directory instead of a mismatch.
            assert settings.disk_path is not None
            self.disk_path = os.path.join(settings.disk_path, f"{self.salt:016x}")
            try:
                os.makedirs(settings.disk_path, mode=0o700, exist_ok=True)
            except OSError as exc:
                raise StoreUnavailable(
                    f"kvh: disk tier at {settings.disk_path} cannot be created ({exc.strerror}); "
                    "set kv_connector_extra_config disk_path / KVH_VLLM_DISK_PATH to a writable directory, "
                    "or disk_bytes=0 for no disk tier"
                ) from None
            fields.update(disk_path=self.disk_path, disk_bytes=settings.disk_bytes)
        try:
            self.engine = Engine(**fields)
        except (errors.KvhIOError, errors.NoSpaceError, errors.BusyError, errors.MismatchError) as exc:
            raise StoreUnavailable(f"kvh: disk tier at {self.disk_path} unusable: {exc}") from None
        except errors.Error as exc:
            raise StoreUnavailable(f"kvh: cannot open an engine for this model: {exc}") from None
        self.block_bytes = self.engine.block_bytes
        self.counters = Counters()
        self._pool = None
        self._reqs: Dict[str, _Req] = {}
        self._held: Dict[str, List[Block]] = {}
        self._lock = threading.Lock()
        self._persist_q: "queue.Queue[Optional[np.ndarray]]" = queue.Queue()
        self._persist_thread: Optional[threading.Thread] = None
        self._persist_warned = False
        if (self.disk_path or settings.remote_addrs) and settings.persist:
            self._persist_thread = threading.Thread(target=self._persist_loop, name="kvh-vllm-persist", daemon=True)
            self._persist_thread.start()

    # ---- the inference engine's memory ----
    def register_pool(
        self,
        k_ptrs: Sequence[int],
        v_ptrs: Sequence[int],
        num_slots: int,
        slot_stride: int,
        token_stride: int,
        head_stride: int,
    ) -> None:
        """Registers the KV memory (one K and one V base pointer per layer,
        strides in bytes). No copy is made; the memory must outlive close()."""
        kb = ffi.new("void *[]", [ffi.cast("void *", p) for p in k_ptrs])
        vb = ffi.new("void *[]", [ffi.cast("void *", p) for p in v_ptrs])
        lay = ffi.new("kvh_pool_layout *")
        lay.struct_size = ffi.sizeof("kvh_pool_layout")
        lay.memory = lib.KVH_MEMORY_HOST
        lay.num_slots = num_slots
        lay.k_base = kb
        lay.v_base = vb
        lay.slot_stride = slot_stride
        lay.token_stride = token_stride
        lay.head_stride = head_stride
        out = ffi.new("kvh_pool *")
        with self.engine._call() as p:
            st = lib.kvh_pool_register(p, lay, out)
            if st:
                raise_status(st)
        self._pool = out[0]
        self.num_slots = num_slots

    # ---- hashes ----
    def _chain(self, req: _Req, tokens: np.ndarray, n_blocks: int) -> List[int]:
        bt = self.block_tokens
        if req.tokens is not None and len(req.hashes):
            k = min(len(req.hashes), n_blocks)
            if not np.array_equal(req.tokens[: k * bt], tokens[: k * bt]):
                req.hashes = []
        h = ffi.new("uint64_t *")
        with self.engine._call() as p:
            for i in range(len(req.hashes), n_blocks):
                parent = req.hashes[i - 1] if i else 0
                blk = tokens[i * bt : (i + 1) * bt]
                st = lib.kvh_prefix_hash_scoped(p, req.scope, parent, ffi.from_buffer("int32_t[]", blk), bt, h)
                if st:
                    raise_status(st)
                req.hashes.append(int(h[0]))
        req.tokens = tokens[: max(len(req.hashes), n_blocks) * bt].copy()
        return req.hashes

    # ---- lookups (the scheduler's questions) ----
    def lookup(self, req_id: str, tokens: Sequence[int], scope: int = 0) -> int:
        """Tokens of the longest prefix of tokens (whole blocks) kvh holds in
        ``scope`` (a tenant's: blocks of other scopes never match). The
        blocks stay retained for req_id until load() or forget(), so that
        what was promised cannot be evicted before it is loaded."""
        tk = np.ascontiguousarray(tokens, dtype=np.int32)
        n = (tk.size // self.block_tokens) * self.block_tokens
        blocks = self.engine.prefix_lookup(tk[:n], scope=scope) if n else []
        with self._lock:
            old = self._held.pop(req_id, None)
            self._held[req_id] = blocks
            self.counters.lookups += 1
            self.counters.lookup_hit_tokens += len(blocks) * self.block_tokens
        for b in old or ():
            b.release()
        return len(blocks) * self.block_tokens

    def forget(self, req_ids) -> None:
        """Drops the state of finished requests (persisting what they saved)."""
        for rid in req_ids:
            with self._lock:
                held = self._held.pop(rid, None)
                req = self._reqs.pop(rid, None)
            for b in held or ():
                b.release()
            if req is not None and req.tokens is not None and len(req.hashes) and self._persist_thread is not None:
                self._persist_q.put((req.tokens[: len(req.hashes) * self.block_tokens], req.scope))

    # ---- transfers ----
    def _req(self, req_id: str, scope: int) -> _Req:
        with self._lock:
            req = self._reqs.get(req_id)
            if req is None or req.scope != scope:
                req = self._reqs[req_id] = _Req(scope=scope)
            return req

    def load(
        self, req_id: str, tokens: Sequence[int], first_block: int, slots: Sequence[int], scope: int = 0
    ) -> List[int]:
        """Restores blocks [first_block, first_block + len(slots)) of the
        prefix (in ``scope``) into vLLM's slots. Returns the slots that could
        not be loaded (from the first failure on: vLLM recomputes from
        there)."""
        t0 = time.perf_counter()
        bt = self.block_tokens
        end = first_block + len(slots)
        tk = np.ascontiguousarray(tokens, dtype=np.int32)
        with self._lock:
            blocks = self._held.pop(req_id, None)
        if blocks is None or len(blocks) < end:
            for b in blocks or ():
                b.release()
            blocks = self.engine.prefix_lookup(tk[: end * bt], scope=scope)
        failed: List[int] = []
        try:
            with self.engine._call() as p:
                for i, slot in enumerate(slots):
                    bi = first_block + i
                    if failed or bi >= len(blocks):
                        failed.append(slot)
                        continue
                    st = lib.kvh_pool_restore(p, self._pool, blocks[bi]._h(), slot)
                    if st:
                        log.warning(
                            "kvh: loading block %d of request %s failed (%s: %s); vLLM recomputes it",
                            bi,
                            req_id,
                            ffi.string(lib.kvh_status_name(st)).decode(),
                            ffi.string(lib.kvh_last_error()).decode(),
                        )
                        failed.append(slot)
        finally:
            for b in blocks:
                b.release()
        ok = len(slots) - len(failed)
        with self._lock:
            c = self.counters
            c.blocks_loaded += ok
            c.tokens_loaded += ok * bt
            c.load_errors += len(failed)
            c.load_seconds += time.perf_counter() - t0
        req = self._req(req_id, scope)
        if ok and not failed:
            self._chain(req, tk, end)
        return failed

    def save(self, req_id: str, tokens: Sequence[int], first_block: int, slots: Sequence[int], scope: int = 0) -> int:
        """Offloads blocks [first_block, first_block + len(slots)) of the
        request, computed into vLLM's slots, under their chained hashes in
        ``scope``.
        Returns how many were offloaded; a failure (no room) is logged and
        leaves the rest unsaved, never raises."""
        if not slots:
            return 0
        t0 = time.perf_counter()
        bt = self.block_tokens
        tk = np.ascontiguousarray(tokens, dtype=np.int32)
        end = first_block + len(slots)
        req = self._req(req_id, scope)
        hashes = self._chain(req, tk, end)
        out = ffi.new("kvh_block *")
        done = 0
        with self.engine._call() as p:
            for i, slot in enumerate(slots):
                bi = first_block + i
                parent = hashes[bi - 1] if bi else 0
                blk = tk[bi * bt : (bi + 1) * bt]
                st = lib.kvh_pool_offload_scoped(
                    p, self._pool, slot, scope, parent, ffi.from_buffer("int32_t[]", blk), bt, 0, out
                )
                if st:
                    with self._lock:
                        self.counters.save_errors += 1
                    log.warning(
                        "kvh: offloading block %d of request %s failed (%s: %s)",
                        bi,
                        req_id,
                        ffi.string(lib.kvh_status_name(st)).decode(),
                        ffi.string(lib.kvh_last_error()).decode(),
                    )
                    break
                lib.kvh_block_release(p, out[0])
                done += 1
        with self._lock:
            self.counters.blocks_saved += done
            self.counters.save_seconds += time.perf_counter() - t0
        return done

    # ---- durability ----
    def _persist_loop(self) -> None:
        # Durability is background work: on a machine whose cores all run
        # the forward pass, it should take what they leave.
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        while True:
            item = self._persist_q.get()
            if item is None:
                self._persist_q.task_done()
                return
            try:
                self._persist(*item)
            finally:
                self._persist_q.task_done()

    def _persist(self, tokens: np.ndarray, scope: int = 0) -> None:
        try:
            with self.engine.sequence(scope=scope) as seq:
                if seq.match_prefix(tokens):
                    seq.persist()
            with self._lock:
                self.counters.requests_persisted += 1
        except errors.Error as exc:
            with self._lock:
                self.counters.persist_errors += 1
                warned, self._persist_warned = self._persist_warned, True
            if not warned:
                log.warning(
                    "kvh: writing blocks to the disk tier at %s failed (%s); they stay in host RAM only "
                    "and a restarted vLLM recomputes them (further failures are counted, not logged)",
                    self.disk_path,
                    exc,
                )

    def flush(self, timeout_s: float = 60.0) -> None:
        """Waits until queued persists are done."""
        if self._persist_thread is None:
            return
        deadline = time.monotonic() + timeout_s
        while self._persist_q.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    # ---- reporting and shutdown ----
    def stats(self) -> Dict[str, Any]:
        s = self.engine.stats()
        with self._lock:
            out = self.counters.to_dict()
        out["kvh"] = {k: getattr(s, k) for k in s.__dataclass_fields__ if k != "extra"}
        out["block_tokens"] = self.block_tokens
        out["disk_path"] = self.disk_path
        return out

    def close(self) -> None:
        if self._persist_thread is not None:
            with self._lock:
                pending = list(self._reqs)
            self.forget(pending)
            self._persist_q.put(None)
            self._persist_thread.join(timeout=120)
            self._persist_thread = None
        with self._lock:
            held, self._held = self._held, {}
        for blocks in held.values():
            for b in blocks:
                b.release()
        if self._pool is not None:
            with self.engine._call() as p:
                lib.kvh_pool_unregister(p, self._pool)
            self._pool = None
        self.engine.close()
