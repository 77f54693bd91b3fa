"""The configurations ``kvh demo`` runs the workload on (kvh and the
baselines): their engine options, their tier sizes, and what one run of
each measured."""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..._progress import human_bytes
from .workload import Request, Workload

__all__ = ["Setup", "SetupResult", "choose_setups"]


@dataclasses.dataclass
class Setup:
    name: str  # kvh | monolithic | sync-offload
    device_bytes: int
    host_bytes: int
    disk_bytes: int = 0
    disk_path: Optional[Path] = None
    migration_threads: Optional[int] = None  # None: the library default
    pin_system: bool = False
    prefetch: bool = False
    sync_offload: bool = False

    def engine_kwargs(self, buffered: bool) -> Dict[str, Any]:
        kw: Dict[str, Any] = dict(device_bytes=self.device_bytes, host_bytes=self.host_bytes)
        if self.disk_path is not None:
            kw.update(
                disk_path=str(self.disk_path),
                disk_bytes=self.disk_bytes,
                # A store of another model or geometry under --data-dir is
                # refused, not emptied: --fresh removes it first.
                disk_reset_on_mismatch=False,
                disk_buffered=buffered,
            )
        if self.migration_threads is not None:
            kw["migration_threads"] = self.migration_threads
        return kw


@dataclasses.dataclass
class SetupResult:
    name: str
    setup: Setup
    requests: List[Request]
    tiers_end: Dict[str, Dict[str, int]]
    tiers_peak: Dict[str, int]
    stats_agents: Dict[str, int]  # engine counters over the agents' requests
    stats_total: Dict[str, int]
    ingest: Dict[str, Any]
    kv_ms_per_token: Dict[str, float]  # decode: kv manage / attention / offload per token
    decode_step_ms: float
    fragmentation: Dict[str, Any]
    system_blocks: Dict[str, Any]
    timeline: List[Tuple[float, int, int, int]]  # (t since the engine opened, device, host, disk used blocks)
    persist: Optional[Dict[str, Any]] = None
    returning: Optional[Dict[str, Any]] = None  # the returning agent's conversation (kvh)
    seconds: float = 0.0
    attention: str = ""
    notes: List[str] = dataclasses.field(default_factory=list)
    phase_offset: float = 0.0  # the agents' first request, in seconds since the engine opened

    # ---- summaries ----
    @property
    def ttfts(self) -> List[float]:
        return [r.ttft_s for r in self.requests if r.ttft_s == r.ttft_s]

    @property
    def itls(self) -> List[float]:
        return [x for r in self.requests for x in r.itl_s]

    def ttft_mean_ms(self) -> float:
        return 1e3 * statistics.fmean(self.ttfts) if self.ttfts else float("nan")

    def ttft_p50_ms(self) -> float:
        return 1e3 * statistics.median(self.ttfts) if self.ttfts else float("nan")

    def itl_p50_ms(self) -> float:
        return 1e3 * statistics.median(self.itls) if self.itls else float("nan")

    def itl_mean_ms(self) -> float:
        return 1e3 * statistics.fmean(self.itls) if self.itls else float("nan")

    def itl_p90_ms(self) -> float:
        xs = sorted(self.itls)
        return 1e3 * xs[min(len(xs) - 1, int(0.9 * len(xs)))] if xs else float("nan")


def choose_setups(
    work: Workload, data_dir: Path, baselines: List[str]
) -> Tuple[Setup, Dict[str, Setup], Dict[str, Any]]:
    """The kvh configuration (tiers from the options, or sized from the
    run's KV), the chosen baselines, and the sizing they came from. A
    ValueError says which budget is too small."""
    args = work.args
    kb = work.kv_blocks()
    bb = work.block_bytes
    need = kb["max_request"] + (kb["max_doc"] if args.hints > 0 else 0) + 2
    minimum = kb["max_request"] + 1
    # A prefix found on disk is staged through the host tier by match_prefix,
    # all of it at once (a returning agent's conversation is a request plus
    # its follow-up), so the host tier holds at least that.
    host_min = kb["max_request"] + 4
    dev = args.device_budget if args.device_budget is not None else max(need, -(-kb["total"] // 4)) * bb
    host = args.host_budget if args.host_budget is not None else max(-(-kb["total"] // 4), host_min) * bb
    if dev // bb < minimum:
        raise ValueError(
            f"--device-budget {human_bytes(dev)} holds {dev // bb} blocks of {human_bytes(bb)}; one "
            f"request needs {kb['max_request']} blocks resident at once (its whole sequence, for "
            f"the attention kernel): use at least {human_bytes(minimum * bb)}"
        )
    if host // bb < host_min:
        raise ValueError(
            f"--host-budget {human_bytes(host)} holds {host // bb} blocks; a prefix found on disk is "
            f"read into the host tier all at once, up to {host_min} blocks here: use at least "
            f"{human_bytes(host_min * bb)}"
        )
    ours = Setup(
        "kvh",
        device_bytes=dev,
        host_bytes=host,
        disk_bytes=args.disk_budget,
        disk_path=data_dir / "store",
        pin_system=True,
        prefetch=True,
    )
    everything = (kb["total"] + 4) * bb
    base = {
        "monolithic": Setup("monolithic", device_bytes=max(everything, dev), host_bytes=0),
        "sync-offload": Setup(
            "sync-offload", device_bytes=dev, host_bytes=max(everything, host), migration_threads=0, sync_offload=True
        ),
    }
    sizing = dict(
        kb,
        block_bytes=bb,
        token_bytes=work.token_bytes,
        device_bytes=dev,
        host_bytes=host,
        disk_bytes=args.disk_budget,
        device_fraction=(dev // bb) / kb["total"],
    )
    return ours, {b: base[b] for b in baselines}, sizing
