"""A stand-in for the parts of vLLM around ``KvhConnector``, for flows that
need both of its sides without a model: the scheduler role and the worker
role of the real connector, a real kvh store over a torch KV cache in
vLLM's CPU layout, and the real lookup channel; vLLM's requests, block
tables, scheduler output and forward pass are fakes. Imported in the vLLM
venv's python only (it needs torch and vllm).

A fake forward pass writes, for each position, one value over the whole
row of each layer; the value follows from the tokens up to it and, past
the first layer, from the previous layer's KV before it, as attention
would, so KV computed over a slot that holds the wrong content comes out
wrong too. Every block offered to kvh is checked against that computation
from scratch (``wrong_offloads``), and a request's next restore can be made
to fail from a given block on (``fail_load``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import types
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch
import vllm.distributed.parallel_state as parallel_state
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvh_cache.vllm import connector as kvh_connector

parallel_state.get_tensor_model_parallel_rank = lambda: 0

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 32


def vllm_config(block_size: int, extra: Dict, engine_id: str) -> types.SimpleNamespace:
    transfer = types.SimpleNamespace(
        engine_id=engine_id,
        kv_connector_extra_config=extra,
        kv_load_failure_policy="recompute",
        is_kv_producer=True,
    )
    model = types.SimpleNamespace(
        model="fake-model",
        revision=None,
        compute_hash=lambda: "fake-hash",
        get_head_size=lambda: HEAD_DIM,
        dtype=torch.bfloat16,
    )
    return types.SimpleNamespace(
        kv_transfer_config=transfer,
        cache_config=types.SimpleNamespace(block_size=block_size, cache_dtype="auto"),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=1, data_parallel_rank=0, pipeline_parallel_size=1),
        model_config=model,
    )


class Blocks:
    """vLLM's KVCacheBlocks, one KV cache group."""

    def __init__(self, ids: Iterable[int]) -> None:
        self.ids = list(ids)

    def get_block_ids(self):
        return (list(self.ids),)


class BlockTables:
    """The scheduler's KVCacheManager: which vLLM blocks each request owns."""

    def __init__(self) -> None:
        self.table: Dict[str, List[int]] = {}

    def get_block_ids(self, req_id: str):
        return (list(self.table[req_id]),)


class Request:
    """A plain vLLM request: token ids only (no LoRA, images or embeddings)."""

    def __init__(self, req_id: str, tokens: Iterable[int], cache_salt: Optional[str] = None) -> None:
        self.request_id = req_id
        self.all_token_ids = list(tokens)
        self.num_prompt_tokens = len(self.all_token_ids)
        self.num_computed_tokens = 0
        self.cache_salt = cache_salt
        self.lora_request = None
        self.mm_features: list = []
        self.prompt_embeds = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def kv_value(tokens: List[int], pos: int, context: float) -> float:
    """What the fake model computes at pos: a small positive integer (exact
    in bf16) from the tokens up to pos and the context attention saw."""
    return float((hash(tuple(tokens[: pos + 1])) + int(context)) % 251 + 1)


def layer_kv(tokens: List[int], start: int, end: int, below: Optional[List[float]]) -> List[float]:
    """A layer's KV of positions [start, end), given the KV of the layer
    below at positions [0, end) (None for the first layer)."""
    out = []
    context = sum(below[:start]) if below is not None else 0.0
    for pos in range(start, end):
        out.append(kv_value(tokens, pos, context))
        if below is not None:
            context += below[pos]
    return out


def expected_kv(tokens: List[int], upto: int) -> List[List[float]]:
    """Every layer's KV of positions [0, upto), computed from scratch."""
    layers: List[List[float]] = []
    for _ in range(LAYERS):
        layers.append(layer_kv(tokens, 0, upto, layers[-1] if layers else None))
    return layers


class Engine:
    """One scheduler and one worker (tensor-parallel rank 0) of a fake vLLM."""

    def __init__(
        self, root: Path, block_size: int = 32, num_blocks: int = 32, extra: Optional[Dict] = None, disk: bool = False
    ) -> None:
        # Apart from root: a Unix socket's path is short (about 100 bytes).
        self.runtime = tempfile.mkdtemp(prefix="kvh-rt-")
        os.chmod(self.runtime, 0o700)
        settings = dict(
            host_bytes="16M", disk_bytes=0, runtime_dir=self.runtime, lookup_timeout_s=5, prefault_memory=False
        )
        if disk:
            settings.update(disk_path=str(root / "store"), disk_bytes="64M")
        settings.update(extra or {})
        self.block_size = block_size
        config = vllm_config(block_size, settings, os.path.basename(self.runtime))
        self.scheduler = kvh_connector.KvhConnector(config, KVConnectorRole.SCHEDULER, None)
        self.worker = kvh_connector.KvhConnector(config, KVConnectorRole.WORKER, None)
        self.tables = BlockTables()
        self.scheduler._kv_cache_manager = self.tables
        # vLLM's CPU layout: (num_blocks, kv_heads, block_size, 2 * head_dim)
        self.kv = {
            f"layers.{i}.attn": torch.zeros(num_blocks, KV_HEADS, block_size, 2 * HEAD_DIM, dtype=torch.bfloat16)
            for i in range(LAYERS)
        }
        self.worker.register_kv_caches(self.kv)
        assert self.worker._store is not None, self.worker._disabled
        self.store = self.worker._store
        # (request, block) of each block offered to kvh whose KV was not
        # what computing its tokens from scratch gives.
        self.wrong_offloads: List[Tuple[str, int]] = []
        # req_id -> first block of its next load that fails.
        self.failing_loads: Dict[str, int] = {}
        self._wrap_store()

    def _wrap_store(self) -> None:
        store = self.store
        start_load, save_async = store.start_load, store.save_async

        def failing_start_load(req_id, tokens, first_block, slots, scope=0):
            # As an unreadable block does: the blocks before it are restored,
            # it and those after it are reported failed and their slots keep
            # what they held.
            cut = self.failing_loads.pop(req_id, None)
            if cut is None:
                return start_load(req_id, tokens, first_block, slots, scope)
            load = start_load(req_id, tokens, first_block, list(slots)[: max(0, cut - first_block)], scope)
            load.slots = list(slots)
            return load

        def checked_save_async(transfers):
            for req_id, tokens, first_block, slots, _ in transfers:
                self.wrong_offloads += self._wrong_blocks(req_id, list(tokens), first_block, slots)
            return save_async(transfers)

        store.start_load = failing_start_load
        store.save_async = checked_save_async

    def _wrong_blocks(self, req_id: str, tokens: List[int], first_block: int, slots) -> List[Tuple[str, int]]:
        bs = self.block_size
        want = expected_kv(tokens, len(tokens))
        wrong = []
        for i, slot in enumerate(slots):
            rows = range((first_block + i) * bs, min((first_block + i + 1) * bs, len(tokens)))
            layers = zip(self.kv.values(), want)
            if any(float(layer[slot, 0, p % bs, 0]) != w[p] for layer, w in layers for p in rows):
                wrong.append((req_id, first_block + i))
        return wrong

    def fail_load(self, req_id: str, from_block: int) -> None:
        """Makes the request's next load fail from block from_block on."""
        self.failing_loads[req_id] = from_block

    def refs(self, tokens: List[int]) -> List[int]:
        """kvh's references to the blocks it holds of a prefix (those of
        requests' lookups, saves and loads), less this probe's own."""
        blocks = self.store.engine.prefix_lookup(self.store.keyed(np.asarray(tokens, dtype=np.int32)))
        try:
            return [b.info().refs - 1 for b in blocks]
        finally:
            for b in blocks:
                b.release()

    # ---- scheduler ----
    def admit(self, req: Request, block_ids: List[int], local_tokens: int = 0) -> int:
        """Admits a request as vLLM's scheduler does (lookup, allocation,
        update_state_after_alloc); returns the tokens kvh is to load."""
        ext, load_async = self.scheduler.get_num_new_matched_tokens(req, local_tokens)
        assert load_async is False
        ext = ext or 0
        self.tables.table[req.request_id] = list(block_ids)
        self.scheduler.update_state_after_alloc(req, Blocks(block_ids), ext)
        req.num_computed_tokens = local_tokens + ext
        return ext

    # ---- one step ----
    def start_step(self, scheduled: Dict[str, int]) -> kvh_connector.KvhMetadata:
        """Schedules a step and runs the worker up to the forward pass."""
        output = types.SimpleNamespace(num_scheduled_tokens=dict(scheduled), finished_req_ids=set())
        meta = self.scheduler.build_connector_meta(output)
        self.worker.handle_preemptions(meta)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        return meta

    def read(self, req: Request, layer: torch.Tensor, upto: int) -> List[float]:
        ids = self.tables.table[req.request_id]
        bs = self.block_size
        return [float(layer[ids[p // bs], 0, p % bs, 0]) for p in range(upto)]

    def forward(self, req: Request, start: int, end: int) -> None:
        """The forward pass over positions [start, end): per layer, vLLM's
        CPU backend writes the new KV, computed from the layer below (whose
        load was waited for), then its attention waits for this layer's
        load."""
        ids = self.tables.table[req.request_id]
        bs = self.block_size
        below = None
        for name, layer in self.kv.items():
            values = layer_kv(req.all_token_ids, start, end, below)
            for p, value in zip(range(start, end), values):
                layer[ids[p // bs], :, p % bs, :] = value
            self.worker.wait_for_layer_load(name)
            below = self.read(req, layer, end)

    def end_step(self, finished: Iterable[str] = ()) -> set:
        """The worker's end of a step; returns the vLLM blocks whose load failed."""
        self.worker.wait_for_save()
        self.worker.get_finished(set(finished))
        errors = self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        return errors

    def step(self, scheduled: Dict[str, Request]) -> tuple:
        """A whole step computing, for each request, the rest of its tokens
        (or the count given in ``scheduled[req_id] = (req, n)``); returns
        (metadata, failed blocks)."""
        counts = {}
        for rid, item in scheduled.items():
            req, n = item if isinstance(item, tuple) else (item, item.num_tokens - item.num_computed_tokens)
            counts[rid] = (req, n)
        meta = self.start_step({rid: n for rid, (_, n) in counts.items()})
        for req, n in counts.values():
            self.forward(req, req.num_computed_tokens, req.num_computed_tokens + n)
        errors = self.end_step()
        for req, n in counts.values():
            req.num_computed_tokens += n
        return meta, errors

    def finish(self, req: Request) -> None:
        self.scheduler.request_finished(req, self.tables.table[req.request_id])
        self.start_step({})
        self.end_step(finished={req.request_id})

    # ---- checks ----
    def wrong_positions(self, req: Request, upto: int) -> List[int]:
        """Positions [0, upto) of the request whose KV, in any layer, is not
        what computing its tokens from scratch gives."""
        want = expected_kv(req.all_token_ids, upto)
        got = [self.read(req, layer, upto) for layer in self.kv.values()]
        return [p for p in range(upto) if any(g[p] != w[p] for g, w in zip(got, want))]

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()
        shutil.rmtree(self.runtime, ignore_errors=True)
