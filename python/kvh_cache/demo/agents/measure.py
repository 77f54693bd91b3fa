"""What ``kvh demo`` measures on an engine: blocks by tier, occupancy
over time, decode time and the KV backend's share of it, fragmentation,
the shared system prompt's blocks, and how much KV a configuration holds
before refusing."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ... import errors
from ...types import Tier

__all__ = [
    "DecodeStats",
    "OccupancySampler",
    "fragmentation",
    "occupancy",
    "probe_capacity",
    "system_prompt_blocks",
    "tier_name",
    "tier_table",
    "tiers_of",
]


def tier_name(t: Any) -> str:
    return {0: "device", 1: "host", 2: "disk"}.get(int(t), str(int(t)))


def tiers_of(seq, n_blocks: Optional[int], first_block: int = 0) -> Dict[str, int]:
    """How many of blocks [first_block, first_block + n_blocks) (None: to
    the end) of seq are in each tier."""
    out = {"device": 0, "host": 0, "disk": 0}
    if n_blocks is None or n_blocks:
        for b in seq.blocks(first_block, n_blocks):
            name = tier_name(b.info().tier)
            out[name] = out.get(name, 0) + 1
    return out


def occupancy(eng) -> Tuple[int, int, int]:
    d, h, k = (eng.tier_info(t).used_blocks for t in (Tier.DEVICE, Tier.HOST, Tier.DISK))
    return d, h, k


class OccupancySampler:
    """Tier occupancy over one run: each :meth:`sample` (after every
    forward pass, before its sequence is released) appends (seconds since
    the sampler was made, device, host, disk used blocks) to ``timeline``
    and raises each tier's ``peak``."""

    def __init__(self, eng) -> None:
        self.eng = eng
        self.peak = {"device": 0, "host": 0, "disk": 0}
        self.timeline: List[Tuple[float, int, int, int]] = []
        self.t_origin = time.perf_counter()

    def sample(self) -> None:
        occ = occupancy(self.eng)
        for name, n in zip(("device", "host", "disk"), occ):
            if n > self.peak[name]:
                self.peak[name] = n
        self.timeline.append((time.perf_counter() - self.t_origin,) + occ)  # type: ignore[arg-type]


class DecodeStats:
    """The decode steps of one run: how many, their wall time, and the KV
    backend's part of it (:class:`kvh_cache.demo.agents.kv.KVTimes`: manage,
    attend, offload)."""

    def __init__(self) -> None:
        self.steps = 0
        self.seconds = 0.0
        self.kv = [0.0, 0.0, 0.0]

    def add(self, dt: float, kv_before: Tuple[float, float, float], kv_after: Tuple[float, float, float]) -> None:
        self.seconds += dt
        self.steps += 1
        for j in range(3):
            self.kv[j] += kv_after[j] - kv_before[j]

    def step_ms(self) -> float:
        return 1e3 * self.seconds / max(1, self.steps)

    def kv_ms_per_token(self) -> Dict[str, float]:
        per_step = 1e3 / max(1, self.steps)
        return {"manage": self.kv[0] * per_step, "attend": self.kv[1] * per_step, "offload": self.kv[2] * per_step}


def tier_table(eng) -> Dict[str, Dict[str, int]]:
    """Each tier's capacity, used, pinned blocks and used bytes."""
    out = {}
    for t, info in eng.tiers().items():
        out[t.name.lower()] = {
            "capacity_blocks": info.capacity_blocks,
            "used_blocks": info.used_blocks,
            "pinned_blocks": info.pinned_blocks,
            "used_bytes": info.used_bytes,
        }
    return out


def system_prompt_blocks(owner, full_blocks: int, tokens: int, pinned: bool, block_bytes: int) -> Dict[str, Any]:
    """The shared system prompt's full blocks (of the sequence ``owner``):
    where they are and how many sequences reference the one copy."""
    out: Dict[str, Any] = {"full_blocks": full_blocks, "tokens": tokens, "pinned": bool(pinned)}
    if full_blocks:
        info = owner.block(0).info()
        out.update(
            refs=info.refs,
            tier=tier_name(info.tier),
            pins=info.pins,
            logical_copies=info.refs,
            physical_copies=1,
            bytes_saved=(info.refs - 1) * full_blocks * block_bytes,
        )
    return out


def fragmentation(eng, seqs, token_bytes: int, reserve_tokens: int) -> Dict[str, Any]:
    """Bytes allocated / bytes used over the live sequences' distinct
    blocks (paged: only the last block of a sequence is partly empty), and,
    computed for comparison, what an unpaged allocator that reserves
    ``reserve_tokens`` contiguous tokens per sequence (no sharing) would
    allocate for the same sequences."""
    seen: Dict[int, int] = {}
    logical = 0
    for s in seqs:
        logical += len(s)
        for b in s.blocks():
            if b.handle not in seen:
                seen[b.handle] = b.info().tokens
    bt = eng.block_tokens
    used_tokens = sum(seen.values())
    alloc = len(seen) * bt * token_bytes
    used = used_tokens * token_bytes
    unpaged_alloc = len(seqs) * max(reserve_tokens, 1) * token_bytes
    return {
        "sequences": len(seqs),
        "blocks": len(seen),
        "logical_tokens": logical,
        "physical_tokens": used_tokens,
        "allocated_bytes": alloc,
        "used_bytes": used,
        "ratio": alloc / used if used else float("nan"),
        "wasted_fraction": 1 - used / alloc if alloc else float("nan"),
        "unpaged_reserve_tokens": reserve_tokens,
        "unpaged_allocated_bytes": unpaged_alloc,
        "unpaged_used_bytes": logical * token_bytes,
        "unpaged_ratio": unpaged_alloc / (logical * token_bytes) if logical else float("nan"),
        "unpaged_wasted_fraction": 1 - (logical * token_bytes) / unpaged_alloc if unpaged_alloc else float("nan"),
    }


def probe_capacity(
    runner,
    device: int,
    host: int,
    disk: int = 0,
    disk_dir: Optional[Path] = None,
    buffered: bool = False,
    *,
    stream: bool = False,
) -> Dict[str, Any]:
    """The longest single sequence the configuration decodes: appends
    tokens (with layer 0's K/V) to one sequence until the engine refuses
    (NoSpaceError), then runs one decode step of layer 0 over the longest
    sequence it can attend: all of it when ``stream`` (kvh's attention
    streams from host and disk), else what the device tier holds
    (acquired, as an engine that attends in GPU memory only must)."""
    kw: Dict[str, Any] = dict(device_bytes=device, host_bytes=host)
    if disk_dir is not None:
        kw.update(disk_path=str(disk_dir), disk_bytes=disk, disk_reset_on_mismatch=True, disk_buffered=buffered)
    t0 = time.perf_counter()
    n = 0
    refused = ""
    with runner.engine(**kw) as eng:
        bt = eng.block_tokens
        step = 64 * bt
        H, D = eng.num_kv_heads, eng.head_dim
        zeros = np.zeros((step, H, D), eng.np_dtype)
        with eng.sequence() as seq:
            while step >= bt:
                try:
                    seq.append((np.arange(n, n + step) % 30000 + 100).astype(np.int32))
                    seq.write_kv(0, n, zeros[:step], zeros[:step])
                    n += step
                except errors.NoSpaceError as exc:
                    refused = exc.message
                    if seq.length > n:
                        seq.truncate(n)
                    step //= 2
            tiers = {t.name.lower(): i.capacity_blocks for t, i in eng.tiers().items()}
            q = np.zeros((1, H, D), np.float32)
            device_blocks = eng.tier_info("device").capacity_blocks
            t1 = time.perf_counter()
            if stream:
                # The window takes device-tier slots: with every tier full,
                # the sequence gives up that much room first.
                chunk = max(1, device_blocks // 4)
                decodable = n
                for _ in range(8):
                    try:
                        eng.attention_decode(0, [seq], q, stream_chunk_blocks=chunk, stream_window_blocks=2 * chunk)
                        break
                    except errors.NoSpaceError:
                        decodable = max(bt, decodable - 2 * chunk * bt)
                        seq.truncate(decodable)
                t1 = time.perf_counter()
                eng.attention_decode(0, [seq], q, stream_chunk_blocks=chunk, stream_window_blocks=2 * chunk)
            else:
                decodable = min(n, device_blocks * bt)
                seq.truncate(decodable)
                with seq.acquire():
                    eng.attention_decode(0, [seq], q)
            decode_ms = (time.perf_counter() - t1) * 1e3
    return {
        "tokens": decodable,
        "held_tokens": n,
        "decode_ms": decode_ms,
        "refused": refused,
        "capacity_blocks": tiers,
        "seconds": time.perf_counter() - t0,
    }
