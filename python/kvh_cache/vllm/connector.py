"""``KvhConnector``: kvh as vLLM's KV tier (``KVConnectorBase_V1``).

Worker side (one per tensor-parallel rank): vLLM's per-layer KV tensors are
registered with kvh as one external pool, no copy (kvh reads and writes
vLLM's blocks in place by slot number, from the tensors' pointers and byte
strides). After each forward pass the blocks that became full are offloaded
into kvh's host tier under the chained hash of their tokens, salted with the
model, dtype, block size and rank; a finished request's blocks are then
made durable on kvh's disk tier in the background. A matched prefix is
restored into the slots vLLM allocated, before the forward pass that needs
it. A block that cannot be restored (checksum, I/O) is reported through
``get_block_ids_with_load_errors`` and vLLM recomputes it; what was
computed over it is not saved, on any tensor-parallel rank (the ranks
share their failed loads in each step that loads).

Scheduler side: ``get_num_new_matched_tokens`` asks each worker over its
lookup channel (a Unix socket in an owner-only directory, see
:mod:`kvh_cache.vllm.channel`) and takes the shortest answer, since every rank
must load the same blocks. The worker keeps the matched blocks retained
until they are loaded, so what it promised is there, and, with
``prefetch`` on, starts reading those of them that are on its disk tier
into its host tier at once. A match vLLM does not load (the request was
not scheduled in that step, or scheduled without it) is let go in the
next step, as it is when the request ends.

A request's ``cache_salt`` (vLLM's per-tenant isolation) becomes its kvh
tenant scope (:meth:`kvh.Scope.value_of`): its blocks are hashed in that
scope, so they are found only by requests with the same salt, in this
process and after a restart; requests without a salt share the default
scope, as in vLLM.
"""

from __future__ import annotations

import itertools
import os
import logging
import platform
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .. import errors
from ..types import Scope
from . import settings as _settings
from .channel import ChannelError, Client, Server, socket_path
from .store import KvStore, StoreUnavailable

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger("vllm.kvh")


def _route_kvh_logs() -> None:
    """kvh's own messages (logger ``kvh``: the library's log sink and
    kvh_cache.vllm) go where vLLM's go, unless the application set them up."""
    ours = logging.getLogger("kvh")
    if not ours.handlers:
        for h in logging.getLogger("vllm").handlers:
            ours.addHandler(h)
        ours.setLevel(logging.INFO)
        ours.propagate = False


_route_kvh_logs()

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


def _scope_of(request: Any) -> int:
    """The kvh tenant scope of a vLLM request: its cache_salt, 0 without."""
    salt = getattr(request, "cache_salt", None)
    return Scope.value_of(salt) if salt else 0


def _store_identity(
    model_config: Any,
    kv_dtype: str,
    cache_dtype: str,
    tp_rank: int,
    tp_size: int,
    dp_rank: int,
    attn_isa: Optional[str] = None,
    cpu_arch: Optional[str] = None,
) -> Dict[str, Any]:
    """What a worker's KV depends on, hashed into its store's salt: vLLM's
    own hash of every setting that changes the computation (quantization,
    RoPE scaling, ...), so a store of another configuration is never read;
    the ranks, so that ranks keep stores of their own; on the CPU backend
    the attention kernel family and the CPU architecture, which decide how
    a block's bytes are packed (a store on a shared disk or remote tier may
    be read on another host)."""
    model_hash = getattr(model_config, "compute_hash", None)
    return {
        "model": model_config.model,
        "revision": getattr(model_config, "revision", None),
        "model_hash": model_hash() if callable(model_hash) else None,
        "kv_dtype": kv_dtype,
        "cache_dtype": cache_dtype,
        "tp_rank": tp_rank,
        "tp_size": tp_size,
        "dp_rank": dp_rank,
        "attn_isa": attn_isa,
        "cpu_arch": cpu_arch,
    }


def _cpu_attn_isa(model_config: Any, block_size: int, head_dim: int, cache_dtype: str) -> str:
    """The kernel family ('amx', 'vec', 'neon', ...) vLLM's CPU attention
    packs KV blocks for, chosen as its metadata builder chooses it."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(model_config.dtype, block_size, head_dim, cache_dtype))
    except Exception as exc:
        # Without it kvh cannot tell one block layout from another.
        raise ValueError(f"cannot tell how vLLM's CPU attention packs KV blocks ({exc!r})") from None


def _keyed_by_tokens(request: Any) -> bool:
    """Whether a request's KV follows from its token ids alone, the only
    key kvh has: not with a LoRA adapter, images or other multimodal
    inputs (their placeholder tokens are the same for any input), or
    prompt embeddings (token ids all 0). Such requests are neither loaded
    nor saved."""
    return (
        getattr(request, "lora_request", None) is None
        and not getattr(request, "mm_features", None)
        and getattr(request, "prompt_embeds", None) is None
    )


@dataclass
class Transfer:
    """Blocks [first_block, first_block + len(block_ids)) of a request,
    ``tokens`` covering at least their end."""

    req_id: str
    tokens: np.ndarray
    first_block: int
    block_ids: List[int]
    scope: int = 0  # tenant scope: the request's cache_salt, 0 without one


@dataclass
class KvhMetadata(KVConnectorMetadata):
    loads: List[Transfer] = field(default_factory=list)
    saves: List[Transfer] = field(default_factory=list)
    # Requests admitted, or whose computed tokens fell back (a failed load,
    # a preemption), since the last step, each with the tokens whose KV it
    # keeps: it computes again from there.
    recomputing: Dict[str, int] = field(default_factory=dict)
    # Requests admitted in this step whose kept KV includes blocks another
    # request loads in this step (vLLM's prefix cache hands a block out as
    # soon as it is allocated): the slots of those blocks.
    reads_loads: Dict[str, List[int]] = field(default_factory=dict)
    # (request, lookup) of lookups whose match vLLM did not load: the
    # worker lets go of the blocks they hold.
    released_lookups: List[Tuple[str, int]] = field(default_factory=list)
    # Requests that ended since the last step, each with its last lookup
    # (None: it had none). The worker drops their state before this
    # step's loads and saves, which may be a new request's under the same
    # id (ids come from clients).
    finished: Dict[str, Optional[int]] = field(default_factory=dict)


@dataclass
class _SchedReq:
    request: "Request"
    saved_blocks: int = 0  # blocks [0, saved_blocks) are in kvh
    tail_done: bool = False  # its prompt's tail block was loaded or queued for saving
    computed_end: int = 0  # tokens whose KV exists after its last scheduled step
    query: Optional[Tuple[int, int]] = None  # (local tokens, kvh tokens) of the last lookup
    last_lookup: Optional[int] = None  # the id of its last lookup


def all_reduce_min(values: List[int], group: Any) -> List[int]:
    """The element-wise minimum of ``values`` over the ranks of ``group``
    (a torch.distributed process group), which every rank calls alike."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [int(x) for x in t.tolist()]


def _tp_group_min(values: List[int]) -> List[int]:
    from vllm.distributed.parallel_state import get_tp_group

    return all_reduce_min(values, get_tp_group().cpu_group)


# A load's first failed block where it failed on no rank.
_NO_FAILURE = 1 << 62

# After a worker's lookup timed out, lookups are misses for this long (s),
# doubled at each further timeout up to LOOKUP_BACKOFF_MAX_S: a stuck
# worker must not cost every request lookup_timeout_s.
LOOKUP_BACKOFF_S = 10.0
LOOKUP_BACKOFF_MAX_S = 300.0


def kv_layout(t: torch.Tensor, head_dim: int, block_size: int) -> Tuple[int, int, int, int, int, int]:
    """(k_ptr, v_ptr, num_blocks, slot_stride, token_stride, head_stride), in
    bytes, of one layer's KV tensor, without copying it.

    * CPU backend: (num_blocks, kv_heads, block_size, 2 * head_dim), read by
      vLLM as (num_blocks, kv_heads, 2 * block_size, head_dim): per head a
      block's K rows for all its tokens, then its V rows.
    * (2, num_blocks, block_size, kv_heads, head_dim) and
      (num_blocks, 2, block_size, kv_heads, head_dim) (the GPU backends' NHD).
    """
    es = t.element_size()
    st = t.stride()
    base = t.data_ptr()
    if t.dim() == 4 and t.shape[2] == block_size and t.shape[3] == 2 * head_dim:
        if st[3] != 1 or st[2] != 2 * head_dim:
            raise ValueError(f"rows of the KV tensor are not contiguous (strides {st})")
        return base, base + block_size * head_dim * es, t.shape[0], st[0] * es, head_dim * es, st[1] * es
    if t.dim() == 5 and t.shape[-1] == head_dim and st[-1] == 1:
        if t.shape[0] == 2 and t.shape[2] == block_size:
            return base, base + st[0] * es, t.shape[1], st[1] * es, st[2] * es, st[3] * es
        if t.shape[1] == 2 and t.shape[2] == block_size:
            return base, base + st[1] * es, t.shape[0], st[0] * es, st[2] * es, st[3] * es
    raise ValueError(f"unknown KV cache layout: shape {tuple(t.shape)}, strides {st}")


class KvhConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._settings = _settings.load(extra)
        self._block_size = int(vllm_config.cache_config.block_size)
        self._engine_id = str(self._kv_transfer_config.engine_id)
        # Which vLLM instance this is: a worker answers lookups of its own
        # scheduler only (another instance given the same engine_id would
        # otherwise be told of blocks its workers never load).
        self._instance = str(getattr(vllm_config, "instance_id", "") or "")
        par = vllm_config.parallel_config
        self._tp_size = int(par.tensor_parallel_size)
        self._dp_rank = int(par.data_parallel_rank)
        self._disabled: Optional[str] = None
        if int(par.pipeline_parallel_size) > 1:
            self._disable("pipeline parallelism is not supported by the kvh connector yet")
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
            # A block kvh cannot load (damaged, or gone from a full disk)
            # then fails its request instead of being computed again.
            logger.warning(
                "kvh: kv_load_failure_policy is %r: a block kvh cannot load fails its request; "
                "kvh_cache.vllm.transfer_config() sets 'recompute'",
                self._kv_transfer_config.kv_load_failure_policy,
            )
        # scheduler side
        self._reqs: Dict[str, _SchedReq] = {}
        self._loads: List[Transfer] = []
        self._admitted: List[str] = []  # allocated since the last step
        self._lookup_ids = itertools.count(1)
        # req_id -> lookup of this step whose blocks some worker holds and
        # no load has taken yet.
        self._unused_lookups: Dict[str, int] = {}
        self._released_lookups: List[Tuple[str, int]] = []
        self._finished: Dict[str, Optional[int]] = {}  # ended since the last step
        self._clients: Optional[List[Client]] = None
        self._channel_warned = False
        self._lookups_paused_until = 0.0  # time.monotonic(): lookups are misses until then
        self._lookup_backoff_s = LOOKUP_BACKOFF_S
        self._timeout_warned = False
        self._secret_warned = False
        # worker side
        self._store: Optional[KvStore] = None
        self._server: Optional[Server] = None
        self._load_errors: set = set()
        self._errors_lock = threading.Lock()
        self._layer_index: Dict[str, int] = {}
        self._inflight: List[Any] = []  # this step's loads (kvh_cache.vllm.store.Load)
        # Loads that failed since the last wait_for_save: (req_id, first failed block, failed slots).
        self._failed_loads: List[Tuple[str, int, List[int]]] = []
        # req_id -> first token whose KV rests on a failed load: its block
        # and those after it are never saved (kvh keeps the first copy of
        # a hash it is given) until the request computes that token again.
        self._unsound_from: Dict[str, int] = {}
        # The minimum over the tensor-parallel ranks, element-wise.
        self._ranks_min = _tp_group_min
        self._ranks_unreachable = False

    def _disable(self, why: str) -> None:
        if self._disabled is None:
            self._disabled = why
            logger.error("%s; kvh connector disabled, vLLM runs without it", why)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that does not happen is a later miss

    # ==================== worker side ====================
    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        if self._disabled:
            return
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        tp_rank = int(get_tensor_model_parallel_rank())
        mc = self._vllm_config.model_config
        head_dim = int(mc.get_head_size())
        names = list(kv_caches)
        tensors = [kv_caches[n] for n in names]
        if not tensors:
            self._disable("kvh: vLLM registered no KV caches")
            return
        t0 = tensors[0]
        dtype = _DTYPES.get(t0.dtype)
        try:
            if dtype is None:
                raise ValueError(f"KV dtype {t0.dtype} (kvh keeps f32, f16 or bf16)")
            if t0.device.type != "cpu":
                raise ValueError(f"KV on {t0.device} (this connector registers host memory only)")
            lays = [kv_layout(t, head_dim, self._block_size) for t in tensors]
            cache_dtype = str(self._vllm_config.cache_config.cache_dtype)
            attn_isa = _cpu_attn_isa(mc, self._block_size, head_dim, cache_dtype)
        except ValueError as exc:
            self._disable(f"kvh: cannot use vLLM's KV memory: {exc}")
            return
        _, _, nb, slot_stride, token_stride, head_stride = lays[0]
        if any(lay[2:] != lays[0][2:] for lay in lays):
            self._disable("kvh: vLLM's layers have different KV layouts")
            return
        num_kv_heads = int(t0.shape[1]) if t0.dim() == 4 else int(t0.shape[3])
        identity = _store_identity(
            mc, str(t0.dtype), cache_dtype, tp_rank, self._tp_size, self._dp_rank, attn_isa, platform.machine()
        )
        logger.info(
            "kvh: %d layers of KV %s, shape %s, strides %s, attention %s; kvh block = one vLLM block of %d tokens",
            len(tensors),
            t0.dtype,
            tuple(t0.shape),
            t0.stride(),
            attn_isa,
            self._block_size,
        )
        try:
            store = KvStore(
                self._settings,
                num_layers=len(tensors),
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                block_tokens=self._block_size,
                dtype=dtype,
                identity=identity,
            )
        except StoreUnavailable as exc:
            self._disable(str(exc))
            return
        try:
            store.register_pool(
                [lay[0] for lay in lays], [lay[1] for lay in lays], nb, slot_stride, token_stride, head_stride
            )
            path = socket_path(self._engine_id, self._dp_rank, tp_rank, self._settings.runtime_dir)
            self._server = Server(path, self._handle)
        except Exception as exc:
            store.close()
            self._disable(f"kvh: cannot start: {exc}")
            return
        self._kv_caches = kv_caches  # kvh holds pointers into them
        self._layer_index = {n: i for i, n in enumerate(names)}
        self._store = store
        logger.info(
            "kvh: store %s (salt %s), host %d MiB, disk %s; lookups on %s",
            store.disk_path or "(no disk tier)",
            "keyed by hash_secret" if self._settings.hash_secret else f"{store.salt:016x}",
            self._settings.host_bytes >> 20,
            f"{self._settings.disk_bytes >> 20} MiB" if store.disk_path else "off",
            path,
        )

    def _handle(self, header: Dict[str, Any], payload: bytes) -> Dict[str, Any]:
        store = self._store
        if store is None:
            return {"tokens": 0}
        op = header.get("op")
        if op == "lookup":
            if not self._own_scheduler(header):
                return {"tokens": 0, "foreign": True}
            tokens = np.frombuffer(payload, dtype=np.int32)
            lookup_id = header.get("lookup")
            if lookup_id is not None and not isinstance(lookup_id, int):
                raise ValueError(f"lookup id must be an integer, got {lookup_id!r}")
            return {"tokens": store.lookup(str(header["req"]), tokens, int(header.get("scope", 0)), lookup_id)}
        if op == "stats":
            return store.stats()
        raise ValueError(f"unknown op {op!r}")

    def _own_scheduler(self, header: Dict[str, Any]) -> bool:
        """Whether a lookup comes from this instance's scheduler: the same
        vLLM instance id, or the scheduler's process is this worker's or
        its parent (vLLM's executors in one process or forked from it)."""
        instance, pid = header.get("instance"), header.get("pid")
        if instance is None and pid is None:
            return True  # a client that names no instance (kvh's own tools)
        if instance and instance == getattr(self, "_instance", ""):
            return True
        return pid in (os.getpid(), os.getppid())

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # Called before the step touches any block: the last step's
        # offloads must have read their slots before a preempted or
        # finished request's blocks are zeroed, copied into or handed to
        # another request (whose forward pass may run before start_load_kv
        # when the step has no synchronous load). They ran meanwhile, so
        # this rarely waits.
        if self._store is not None:
            self._store.wait_saves()

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        if self._store is None:
            return
        # Where a vLLM calls no handle_preemptions: its forward pass starts
        # after this with synchronous loads.
        self._store.wait_saves()
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvhMetadata)
        if meta.finished:
            # Before this step's loads and saves: a request reusing an ended
            # one's id is new, and its state must not be dropped with the
            # old one's (get_finished hears of the old one only after them).
            self._forget(meta.finished)
        for req_id, lookup_id in meta.released_lookups:
            try:
                self._store.release_lookup(req_id, lookup_id)
            except Exception:
                logger.exception("kvh: letting go of the blocks matched for request %s failed", req_id)
        for t in meta.loads:
            try:
                self._inflight.append(self._store.start_load(t.req_id, t.tokens, t.first_block, t.block_ids, t.scope))
            except Exception:
                logger.exception("kvh: loading request %s failed; vLLM recomputes it", t.req_id)
                self._failed_loads.append((t.req_id, t.first_block, list(t.block_ids)))
                with self._errors_lock:
                    self._load_errors.update(t.block_ids)
        # vLLM's CPU backend writes a layer's new KV before its attention
        # waits for that layer's load: the row of the last prompt token,
        # in a restored tail block, must not be overwritten after that.
        for load in self._inflight:
            self._store.wait_tail(load)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # kvh restores layer by layer: attention of a layer waits only for
        # that layer's copies.
        if not self._inflight or self._store is None:
            return
        layer = self._layer_index.get(layer_name)
        for load in self._inflight:
            if layer is None:
                if load.batch is not None:
                    load.batch.wait()
            else:
                self._store.wait_layer(load, layer)

    def _finish_loads(self) -> None:
        loads, self._inflight = self._inflight, []
        for load in loads:
            try:
                failed = self._store.finish_load(load) if self._store is not None else list(load.slots)
            except Exception:
                logger.exception("kvh: loading request %s failed; vLLM recomputes it", load.req_id)
                failed = list(load.slots)
            if failed:
                first_failed = load.first_block + len(load.slots) - len(failed)
                self._failed_loads.append((load.req_id, first_failed, list(failed)))
                with self._errors_lock:
                    self._load_errors.update(failed)

    def _share_failed_loads(self, meta: KvhMetadata) -> None:
        """Under tensor parallelism each rank loads only its own heads, but
        every layer's output is summed over the ranks: what any rank
        computes in a step over another rank's failed load is unsound too.
        Each rank therefore takes, for every request loading in this step,
        the first block any rank failed to load. Every rank runs this for
        the same metadata (with or without a store), so the collective
        never waits on a rank that skipped it; this holds with vLLM's one
        scheduler for all ranks, not with one scheduler per rank
        (``external_launcher``), where a rank out of step waits up to the
        process group's timeout."""
        if int(getattr(self, "_tp_size", 1)) <= 1 or not meta.loads:
            return
        order = list(dict.fromkeys(t.req_id for t in meta.loads))
        first_block = {}
        for t in meta.loads:
            first_block[t.req_id] = min(t.first_block, first_block.get(t.req_id, t.first_block))
        mine = dict.fromkeys(order, _NO_FAILURE)
        if self._store is None:
            mine = dict(first_block)  # it restored nothing
        for req_id, first_failed, _ in self._failed_loads:
            if req_id in mine:
                mine[req_id] = min(mine[req_id], first_failed)
        merged = [first_block[r] for r in order]  # every load failed, for all this rank knows
        if not self._ranks_unreachable:
            try:
                merged = self._ranks_min([mine[r] for r in order])
            except Exception:
                # A process group whose collective failed (a timeout) fails
                # every later one: asked no more, the ranks' saves computed
                # over a load are held from now on.
                logger.exception(
                    "kvh: could not share failed loads with the other tensor-parallel ranks; "
                    "KV computed over a load is no longer saved"
                )
                self._ranks_unreachable = True
        for req_id, first in zip(order, merged):
            if first >= mine[req_id]:
                continue
            slots = [
                slot
                for t in meta.loads
                if t.req_id == req_id
                for j, slot in enumerate(t.block_ids)
                if t.first_block + j >= first
            ]
            self._failed_loads.append((req_id, first, slots))

    def _mark_unsound(self, req_id: str, token: int) -> None:
        self._unsound_from[req_id] = min(token, self._unsound_from.get(req_id, token))

    def _sound_saves(self, meta: KvhMetadata) -> List[Transfer]:
        """This step's saves less the blocks whose KV rests on a failed load:
        a loading request's from its first failed block on; those of a
        request that read a failed slot (vLLM's prefix cache), from the
        first token it computed in that step; and the failed slots
        themselves. A request's hold ends once it computes again from at or
        before its first such token: not when its computed tokens fall back
        to a point past it, nor when it is admitted again with more than
        that kept (vLLM's prefix cache may keep blocks computed over the
        failed load)."""
        bs = self._block_size
        for req_id, kept in meta.recomputing.items():
            first_unsound = self._unsound_from.get(req_id)
            if first_unsound is not None and kept <= first_unsound:
                del self._unsound_from[req_id]
        failures, self._failed_loads = self._failed_loads, []
        failed_slots: Set[int] = set()
        for req_id, first_failed, slots in failures:
            self._mark_unsound(req_id, first_failed * bs)
            failed_slots.update(slots)
        # Index in meta.saves -> the first block of it not saved in this step.
        cuts: Dict[int, int] = {}
        if failed_slots:
            for req_id, slots in meta.reads_loads.items():
                if not failed_slots.isdisjoint(slots):
                    # All it computed in this step attended to a stale slot.
                    self._mark_unsound(req_id, meta.recomputing.get(req_id, 0))
            for i, t in enumerate(meta.saves):
                at = next((j for j, slot in enumerate(t.block_ids) if slot in failed_slots), None)
                if at is not None:
                    cuts[i] = t.first_block + at
                    self._mark_unsound(t.req_id, meta.recomputing.get(t.req_id, cuts[i] * bs))
        if not self._unsound_from:
            return meta.saves
        sound = []
        for i, t in enumerate(meta.saves):
            end = t.first_block + len(t.block_ids)
            cut = cuts.get(i, end)
            first_unsound = self._unsound_from.get(t.req_id)
            if first_unsound is not None:
                cut = min(cut, first_unsound // bs)
            if cut >= end:
                sound.append(t)
            elif cut > t.first_block:
                sound.append(Transfer(t.req_id, t.tokens, t.first_block, t.block_ids[: cut - t.first_block], t.scope))
        return sound

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata", **kwargs: Any
    ) -> None:
        return  # whole blocks, all layers at once, queued in wait_for_save

    def wait_for_save(self) -> None:
        if self._store is not None:
            self._finish_loads()
        if not self.has_connector_metadata():
            return
        if sys.exc_info()[0] is not None:
            # vLLM calls this from a `finally` while the step's exception
            # propagates: the step's KV is not worth saving, and a rank
            # that failed alone must not wait in the exchange below for
            # ranks still inside the forward pass's own collectives.
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvhMetadata)
        self._share_failed_loads(meta)
        if self._store is None:
            return
        saves = self._sound_saves(meta)
        # Queued on kvh's workers; this returns at once (the copies overlap
        # sampling and the next step's scheduling).
        try:
            self._store.save_async([(t.req_id, t.tokens, t.first_block, t.block_ids, t.scope) for t in saves])
        except Exception:
            logger.exception("kvh: offloading failed")

    def _forget(self, last_lookups: Dict[str, Optional[int]]) -> None:
        """Drops the state of ended requests (each with its last lookup id)."""
        if self._store is not None:
            self._store.forget(list(last_lookups), last_lookups)
        for req_id in last_lookups:
            self._unsound_from.pop(req_id, None)

    def get_finished(self, finished_req_ids: set) -> Tuple[Optional[set], Optional[set]]:
        # Those the step's metadata listed were forgotten when it started
        # (start_load_kv does nothing without a store).
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        done = meta.finished if isinstance(meta, KvhMetadata) and self._store is not None else {}
        rest = {req_id: None for req_id in finished_req_ids or () if req_id not in done}
        if rest:
            self._forget(rest)
        return None, None

    def get_block_ids_with_load_errors(self) -> set:
        if self._inflight:
            self._finish_loads()
        with self._errors_lock:
            out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._store is not None:
            store, self._store = self._store, None
            logger.info("kvh: closing; %s", {k: v for k, v in store.stats().items() if k != "kvh"})
            try:
                store.close()
            except errors.Error as exc:
                # A store whose directory went while vLLM ran (its index
                # cannot be written): said, and the rest still closes.
                logger.error("kvh: closing the store failed: %s", exc)
        if self._clients:
            for c in self._clients:
                c.close()
            self._clients = None

    # ==================== scheduler side ====================
    def _lookup(self, req_id: str, tokens: np.ndarray, scope: int, lookup_id: int) -> Tuple[int, bool]:
        """(tokens every rank holds, whether any rank may now hold blocks
        for this lookup)."""
        if time.monotonic() < self._lookups_paused_until:
            return 0, False
        payload = tokens.tobytes()
        try:
            # A runtime directory that cannot be used (mode, owner, a parent
            # missing) is a miss, as on the worker side, never an error out
            # of vLLM's scheduler.
            if self._clients is None:
                self._clients = [
                    Client(
                        socket_path(self._engine_id, self._dp_rank, r, self._settings.runtime_dir),
                        self._settings.lookup_timeout_s,
                    )
                    for r in range(self._tp_size)
                ]
            header = {
                "op": "lookup",
                "req": req_id,
                "scope": scope,
                "lookup": lookup_id,
                "instance": getattr(self, "_instance", ""),
                "pid": os.getpid(),
            }
            replies = [c.call(header, payload) for c in self._clients]
            if any(r.get("foreign") for r in replies):
                if not self._channel_warned:
                    self._channel_warned = True
                    logger.warning(
                        "kvh: the lookup channel of engine_id %r belongs to another vLLM instance; requests are "
                        "computed without kvh (give each instance its own engine_id)",
                        self._engine_id,
                    )
                # A rank of this instance that answered holds what it found.
                return 0, any(not r.get("foreign") and int(r.get("tokens", 0)) > 0 for r in replies)
            found = [int(r["tokens"]) for r in replies]
            self._lookup_backoff_s = LOOKUP_BACKOFF_S
            return min(found), max(found) > 0
        except socket.timeout:
            self._pause_lookups()
            return 0, True  # the worker's lookup may still run and hold blocks
        except (OSError, ChannelError, KeyError, ValueError, OverflowError) as exc:
            if not self._channel_warned:
                self._channel_warned = True
                logger.warning("kvh: lookup channel unavailable (%s); requests are computed without kvh", exc)
            # A rank that answered, or answers after the timeout, may hold blocks.
            return 0, self._clients is not None

    def _pause_lookups(self) -> None:
        """A worker did not answer within lookup_timeout_s: lookups are
        misses for a while, then tried again (a longer while after each
        further timeout)."""
        self._lookups_paused_until = time.monotonic() + self._lookup_backoff_s
        if not self._timeout_warned:
            self._timeout_warned = True
            logger.warning(
                "kvh: a worker did not answer a lookup within lookup_timeout_s=%s s; requests are computed "
                "without kvh for %.0f s, then lookups are tried again (up to %.0f s apart while they time out)",
                self._settings.lookup_timeout_s,
                self._lookup_backoff_s,
                LOOKUP_BACKOFF_MAX_S,
            )
        self._lookup_backoff_s = min(2 * self._lookup_backoff_s, LOOKUP_BACKOFF_MAX_S)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        if self._disabled or not _keyed_by_tokens(request):
            return 0, False
        tokens = request.all_token_ids
        # The last token is always computed (its logits are needed); kvh
        # may hold every token before it (whole blocks and a tail block).
        n = len(tokens) - 1
        if n - n % self._block_size <= num_computed_tokens and n - num_computed_tokens < self._tail_min():
            self._lookup_unused(request.request_id)
            return 0, False
        scope = _scope_of(request)
        if scope and not self._settings.hash_secret and not self._secret_warned:
            self._secret_warned = True
            logger.warning(
                "kvh: requests carry cache_salt but hash_secret is not set: a tenant who knows the model can "
                "choose tokens whose block hash equals a block of a prompt it shares with others (in its scope "
                "or a shared one), so that the blocks after it are served with K/V computed after its own "
                "tokens; set kv_connector_extra_config hash_secret (or KVH_VLLM_HASH_SECRET)"
            )
        lookup_id = next(self._lookup_ids)
        matched, held = self._lookup(request.request_id, np.asarray(tokens[:n], dtype=np.int32), scope, lookup_id)
        # The workers' new lookup replaced what an earlier one held.
        self._unused_lookups.pop(request.request_id, None)
        if held:
            self._unused_lookups[request.request_id] = lookup_id
        st = self._reqs.setdefault(request.request_id, _SchedReq(request))
        st.query = (num_computed_tokens, matched)
        st.last_lookup = lookup_id
        if matched <= num_computed_tokens:
            return 0, False
        return matched - num_computed_tokens, False

    def _lookup_unused(self, req_id: str) -> None:
        """What the request's lookup in this step holds will not be loaded."""
        lookup_id = self._unused_lookups.pop(req_id, None)
        if lookup_id is not None:
            self._released_lookups.append((req_id, lookup_id))

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        st = self._reqs.setdefault(request.request_id, _SchedReq(request))
        st.request = request
        self._admitted.append(request.request_id)
        if num_external_tokens <= 0 or st.query is None:
            self._lookup_unused(request.request_id)
            return
        self._unused_lookups.pop(request.request_id, None)  # the load takes what it holds
        bs = self._block_size
        local = st.query[0]
        end_tok = local + num_external_tokens
        # A load that ends inside a block ends with the prompt's tail block.
        first, end = local // bs, -(-end_tok // bs)
        block_ids = list(blocks.get_block_ids()[0][first:end])
        tokens = np.asarray(request.all_token_ids[:end_tok], dtype=np.int32)
        self._loads.append(Transfer(request.request_id, tokens, first, block_ids, _scope_of(request)))
        st.saved_blocks = max(st.saved_blocks, end_tok // bs)
        st.tail_done = st.tail_done or end_tok % bs != 0

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        # Lookups of this step that vLLM did not schedule are not loaded either.
        released = self._released_lookups + list(self._unused_lookups.items())
        meta = KvhMetadata(loads=self._loads, released_lookups=released, finished=self._finished)
        admitted = set(self._admitted)
        self._loads, self._admitted, self._released_lookups, self._unused_lookups = [], [], [], {}
        self._finished = {}
        if self._disabled:
            return meta
        bs = self._block_size
        for req_id, n_sched in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            r = st.request
            if not _keyed_by_tokens(r):
                continue
            fell_back = r.num_computed_tokens < st.computed_end
            if fell_back or req_id in admitted:
                meta.recomputing[req_id] = r.num_computed_tokens
            if fell_back and r.num_computed_tokens < r.num_prompt_tokens - 1:
                st.tail_done = False  # computed again: kvh may hold none of it (a failed load)
            # Blocks kvh was thought to hold are being computed again: a
            # load of them failed (vLLM truncates the computed tokens at the
            # first failed block), or the request was preempted and kvh no
            # longer had them. They are saved again once recomputed.
            if r.num_computed_tokens < st.saved_blocks * bs:
                st.saved_blocks = r.num_computed_tokens // bs
            # KV of positions [0, computed + scheduled) exists after this
            # step; a block is saved once its tokens are all known.
            end_tok = min(r.num_computed_tokens + n_sched, len(r.all_token_ids))
            st.computed_end = end_tok
            full = end_tok // bs
            tail = self._tail_due(st, end_tok)
            if full <= st.saved_blocks and not tail:
                continue
            assert self._kv_cache_manager is not None
            ids = self._kv_cache_manager.get_block_ids(req_id)[0]
            full = min(full, len(ids))
            if full > st.saved_blocks:
                tokens = np.asarray(r.all_token_ids[: full * bs], dtype=np.int32)
                meta.saves.append(
                    Transfer(req_id, tokens, st.saved_blocks, list(ids[st.saved_blocks : full]), _scope_of(r))
                )
                st.saved_blocks = full
            if tail and tail // bs < len(ids):
                # The prompt's tail block, for the same prompt coming back.
                tokens = np.asarray(r.all_token_ids[:tail], dtype=np.int32)
                meta.saves.append(Transfer(req_id, tokens, tail // bs, [ids[tail // bs]], _scope_of(r)))
                st.tail_done = True
        if meta.loads:
            self._note_reads_of_loads(meta, admitted)
        return meta

    def _note_reads_of_loads(self, meta: KvhMetadata, admitted: Set[str]) -> None:
        """Fills meta.reads_loads: only a request admitted in this step can
        be handed a block another request loads in it."""
        loader = {slot: t.req_id for t in meta.loads for slot in t.block_ids}
        assert self._kv_cache_manager is not None
        for req_id in admitted:
            st = self._reqs.get(req_id)
            if st is None or not _keyed_by_tokens(st.request):
                continue
            kept_blocks = -(-st.request.num_computed_tokens // self._block_size)
            ids = self._kv_cache_manager.get_block_ids(req_id)[0][:kept_blocks]
            read = [slot for slot in ids if loader.get(slot, req_id) != req_id]
            if read:
                meta.reads_loads[req_id] = read

    def _tail_min(self) -> int:
        m = self._settings.tail_min_tokens
        return m if m else self._block_size

    def _tail_due(self, st: _SchedReq, end_tok: int) -> int:
        """Tokens of the prefix whose tail block is to be saved now, else 0.
        It is saved once the last prompt token's KV is in it too (end_tok
        past n): a restore writes the whole block, and that row is what
        vLLM computes in the step the restore runs."""
        if st.tail_done or not self._settings.tail_min_tokens:
            return 0
        n = st.request.num_prompt_tokens - 1  # what a returning prompt can load
        r = n % self._block_size
        if end_tok <= n or r < self._settings.tail_min_tokens:
            return 0
        return n

    def request_finished(self, request: "Request", block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        st = self._reqs.pop(request.request_id, None)
        # The worker lets go of what it holds for the request when it ends.
        self._unused_lookups.pop(request.request_id, None)
        # 0 when it made no lookup (ids start at 1): anything held under its
        # id then is a newer request's, and stays.
        self._finished[request.request_id] = st.last_lookup if st and st.last_lookup is not None else 0
        return False, None
