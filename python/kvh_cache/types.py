"""Plain data types of the Python API: configuration, statistics, tier and
block information, dtypes and tiers."""

from __future__ import annotations

import dataclasses
import enum
import os
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Optional, Union

import numpy as np

from .errors import shown

__all__ = [
    "Tier",
    "DType",
    "Backend",
    "Config",
    "Stats",
    "TierInfo",
    "BlockInfo",
    "Scope",
    "RemoteUpload",
    "numpy_dtype",
    "bf16_to_f32",
    "f32_to_bf16",
]


class Tier(enum.IntEnum):
    """Where a block lives (kvh_tier)."""

    DEVICE = 0
    HOST = 1
    DISK = 2

    @classmethod
    def parse(cls, value: Union["Tier", int, str]) -> "Tier":
        if isinstance(value, str):
            try:
                return cls[value.strip().upper()]
            except KeyError:
                raise ValueError(f"unknown tier {shown(value)}: expected 'device', 'host' or 'disk'") from None
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"tier must be a kvh.Tier, int or str, not {type(value).__name__}")
        try:
            return cls(int(value))
        except ValueError:
            raise ValueError(f"unknown tier {shown(value)}: expected 0 (device), 1 (host) or 2 (disk)") from None


class DType(enum.IntEnum):
    """Element type of K/V (kvh_dtype). BF16 is exposed to NumPy as raw
    ``uint16`` bit patterns (NumPy has no bfloat16); see :func:`bf16_to_f32`."""

    F32 = 0
    F16 = 1
    BF16 = 2

    @classmethod
    def parse(cls, value: Any) -> "DType":
        if isinstance(value, DType):
            return value
        if isinstance(value, str):
            key = value.strip().lower()
            names = {
                "f32": cls.F32,
                "float32": cls.F32,
                "fp32": cls.F32,
                "f16": cls.F16,
                "float16": cls.F16,
                "fp16": cls.F16,
                "half": cls.F16,
                "bf16": cls.BF16,
                "bfloat16": cls.BF16,
            }
            if key in names:
                return names[key]
            raise ValueError(f"unknown dtype {shown(value)}: expected 'f32', 'f16' or 'bf16'")
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            try:
                return cls(int(value))
            except ValueError:
                raise ValueError(f"unknown dtype {shown(value)}: expected 0 (f32), 1 (f16) or 2 (bf16)") from None
        if value is None:  # np.dtype(None) would be float64
            raise TypeError("dtype must be 'f32', 'f16', 'bf16' or a NumPy dtype, not None")
        try:
            npd = np.dtype(value)
        except TypeError:
            raise TypeError(f"dtype must be 'f32', 'f16', 'bf16' or a NumPy dtype, not {shown(value)}") from None
        if npd == np.float32:
            return cls.F32
        if npd == np.float16:
            return cls.F16
        raise ValueError(f"NumPy dtype {npd} has no kvh equivalent (float32, float16; use 'bf16' for bfloat16)")

    @property
    def numpy(self) -> np.dtype:
        return numpy_dtype(self)

    @property
    def short(self) -> str:
        return ("f32", "f16", "bf16")[int(self)]


class Backend(enum.IntEnum):
    AUTO = 0
    CPU = 1
    CUDA = 2

    @classmethod
    def parse(cls, value: Any) -> "Backend":
        if isinstance(value, str):
            try:
                return cls[value.strip().upper()]
            except KeyError:
                raise ValueError(f"unknown backend {shown(value)}: expected 'auto', 'cpu' or 'cuda'") from None
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            return cls(int(value))
        raise TypeError(f"backend must be 'auto', 'cpu' or 'cuda', not {shown(value)}")


_NP = {DType.F32: np.dtype(np.float32), DType.F16: np.dtype(np.float16), DType.BF16: np.dtype(np.uint16)}


def numpy_dtype(dtype: Union[DType, int, str]) -> np.dtype:
    """The NumPy dtype used for arrays of a kvh dtype (bf16 -> uint16 bits)."""
    return _NP[DType.parse(dtype)]


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """Widens raw bfloat16 bit patterns (uint16) to float32."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise TypeError(f"expected uint16 bfloat16 bits, got {bits.dtype}")
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Rounds float32 to bfloat16 (round to nearest even), as uint16 bits."""
    v = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounding = ((v >> 16) & 1) + np.uint32(0x7FFF)
    out = ((v + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(values, dtype=np.float32))
    if nan.any():
        out[nan] = 0x7FC0
    return out


PathLike = Union[str, "os.PathLike[str]"]


@dataclass
class Config:
    """Engine configuration (kvh_config). ``None`` means the library's
    default (from ``kvh_config_init``). Sizes are bytes.

    ``log_level`` None follows ``logging.getLogger("kvh")``'s effective level.
    ``disk_path``/``disk_bytes`` enable the disk tier (both needed: a path
    without a size raises InvalidArgumentError).
    """

    num_layers: Optional[int] = None
    num_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    block_tokens: Optional[int] = None
    dtype: Union[DType, str, int, None] = None
    backend: Union[Backend, str, int, None] = None
    cuda_device: Optional[int] = None
    device_bytes: Optional[int] = None
    host_bytes: Optional[int] = None
    disk_bytes: Optional[int] = None
    disk_path: Optional[PathLike] = None
    model_salt: Optional[int] = None
    numa_node: Optional[int] = None
    migration_threads: Optional[int] = None
    migration_cpu_mask: Optional[int] = None
    lru_k: Optional[int] = None
    promote_min_hits: Optional[int] = None
    log_level: Union[int, str, None] = None
    disk_queue_depth: Optional[int] = None
    disk_reset_on_mismatch: bool = False
    disk_buffered: bool = False
    #: Let the store's group read it (directory 0750, files 0640); by
    #: default only the engine's user can (0700 and 0600).
    disk_share_group: bool = False
    #: Fail the open (CorruptionError) when the disk index is damaged
    #: (default False: it is rebuilt from the slot headers and every block
    #: whose slot verifies is kept).
    disk_strict_index: Optional[bool] = None
    kv_codec: Union["Codec", str, int, None] = None
    vmap: Optional[bool] = None
    eviction_policy: Union["Eviction", str, int, None] = None
    lctru_window: Optional[int] = None
    #: Copy blocks moving between the device and host tiers even where both
    #: are the same memory (default False: on the CPU backend they are one
    #: arena and a move re-accounts the block in place).
    copy_moves: Optional[bool] = None
    #: Back every page of the CPU backend's tiers at open, so no first copy
    #: into a slot waits for a page fault (default False; see kvh.h).
    prefault_memory: Optional[bool] = None
    #: Remote tier (a Redis Cluster shared by several engines): seed nodes
    #: "host:port,host:port"; None: no remote tier. See the README's
    #: "Remote tier".
    remote_addrs: Optional[str] = None
    #: AUTH user (Redis 6 ACL) and password; None: no AUTH.
    remote_user: Optional[str] = None
    remote_password: Optional[str] = None
    #: TLS to the cluster; True is refused (UnsupportedError): this build's
    #: client has no TLS.
    remote_tls: Optional[bool] = None
    remote_tls_ca: Optional[str] = None
    #: Deadline of one remote round in ms (default 50).
    remote_timeout_ms: Optional[int] = None
    #: Seconds a block lives in the store, renewed on hits (default 86400).
    remote_ttl_s: Optional[int] = None
    #: When blocks go up: :class:`RemoteUpload` flags, or their int bits
    #: (default PERSIST).
    remote_upload: Optional[int] = None
    #: ms a failed node is left alone before a probe (default 2000).
    remote_breaker_ms: Optional[int] = None

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        for k, v in d.items():
            if isinstance(v, enum.Enum):
                d[k] = v.name.lower()
            elif isinstance(v, os.PathLike):
                d[k] = os.fspath(v)
        return d


class RemoteUpload(enum.IntFlag):
    """When blocks reach the remote tier (kvh_remote_upload); combine with |."""

    PERSIST = 1  # Sequence.persist uploads the full blocks
    DEMOTE = 2  # a block moved from memory to the disk tier is queued for upload
    WRITE_THROUGH = 4  # a block is queued for upload once published


class Eviction(enum.IntEnum):
    """Victim order of the memory tiers (kvh_eviction)."""

    LRU_K = 0
    LCTRU = 1
    ADAPTIVE = 2  # experimental: LRU-K or plain LRU, chosen by a shadow simulation

    @classmethod
    def parse(cls, value: Any) -> "Eviction":
        if isinstance(value, Eviction):
            return value
        if isinstance(value, str):
            key = value.strip().lower().replace("-", "_")
            names = {
                "lru_k": cls.LRU_K,
                "lruk": cls.LRU_K,
                "lru": cls.LRU_K,
                "lctru": cls.LCTRU,
                "adaptive": cls.ADAPTIVE,
            }
            if key in names:
                return names[key]
            raise ValueError(f"unknown eviction policy {shown(value)}: expected 'lru_k', 'lctru' or 'adaptive'")
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            try:
                return cls(int(value))
            except ValueError:
                raise ValueError(f"unknown eviction policy {shown(value)}: expected 0, 1 or 2") from None
        raise TypeError(f"eviction_policy must be a name or an int, not {type(value).__name__}")


class Codec(enum.IntEnum):
    """Quantised form of KV in the host and disk tiers (kvh_codec); see
    :mod:`kvh_cache.codec` for the utilities and error bounds."""

    NONE = 0
    INT8 = 1
    Q4_G32 = 2
    Q4_G64 = 3

    @classmethod
    def parse(cls, value: Any) -> "Codec":
        if isinstance(value, Codec):
            return value
        if isinstance(value, str):
            key = value.strip().lower().replace("-", "_")
            names = {
                "none": cls.NONE,
                "raw": cls.NONE,
                "int8": cls.INT8,
                "q8": cls.INT8,
                "q4_g32": cls.Q4_G32,
                "q4": cls.Q4_G32,
                "int4": cls.Q4_G32,
                "q4_g64": cls.Q4_G64,
            }
            if key in names:
                return names[key]
            raise ValueError(f"unknown codec {shown(value)}: expected 'none', 'int8', 'q4_g32' or 'q4_g64'")
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            try:
                return cls(int(value))
            except ValueError:
                raise ValueError(f"unknown codec {shown(value)}: expected 0..3") from None
        raise TypeError(f"codec must be a name or an int, not {type(value).__name__}")


@dataclass(frozen=True)
class Stats:
    """Monotonic counters of an engine (kvh_stats). Subtract two snapshots
    for the counts of an interval: ``after - before``."""

    lookups: int = 0
    hits_device: int = 0
    hits_host: int = 0
    hits_disk: int = 0
    prefix_queries: int = 0
    prefix_hit_blocks: int = 0
    prefix_hit_tokens: int = 0
    blocks_device_to_host: int = 0
    blocks_host_to_device: int = 0
    blocks_host_to_disk: int = 0
    blocks_disk_to_host: int = 0
    bytes_device_to_host: int = 0
    bytes_host_to_device: int = 0
    bytes_host_to_disk: int = 0
    bytes_disk_to_host: int = 0
    prefetch_issued: int = 0
    prefetch_useful: int = 0
    prefetch_late: int = 0
    prefetch_wasted: int = 0
    prefetch_skipped: int = 0
    cow_copies: int = 0
    evictions: int = 0
    drops: int = 0
    corrupt_blocks: int = 0
    acquire_stall_ns: int = 0
    blocks_allocated: int = 0
    blocks_freed: int = 0
    #: Device <-> host moves made without a copy (one arena).
    blocks_moved_in_place: int = 0
    #: Of prefix_hit_blocks: found in the host tier, or only on disk (read
    #: back and verified); the rest were in the device tier or came from
    #: the remote tier (remote_hits).
    prefix_hit_blocks_host: int = 0
    prefix_hit_blocks_disk: int = 0
    #: Full blocks persist() made durable (written now or already on disk).
    blocks_persisted: int = 0
    #: Clean copies written to disk while the block stayed in its tier
    #: (persist, background cleaning), and their bytes as stored.
    disk_copies_written: int = 0
    bytes_disk_copies_written: int = 0
    #: Blocks copied into a streaming window by streamed attention, by the
    #: tier they were read from (blocks attended where they lie: none).
    blocks_streamed_host: int = 0
    blocks_streamed_disk: int = 0
    #: Remote tier: blocks a prefix match found there (verified, copied into
    #: a local tier), blocks looked for and not brought (one per block:
    #: absent, after an absent one, late, or without room), values that failed
    #: verification (deleted), blocks uploaded, uploads dropped, commands
    #: past the deadline, nodes the circuit breaker left alone.
    remote_hits: int = 0
    remote_misses: int = 0
    remote_corrupt: int = 0
    remote_uploads: int = 0
    remote_uploads_dropped: int = 0
    remote_timeouts: int = 0
    remote_breaker_opens: int = 0
    #: Clean host copies: kept when a block was promoted from the host tier
    #: into the device tier, used by a demotion that then copied nothing
    #: (not in blocks_device_to_host), and taken back for room. How many
    #: are kept now: TierInfo.clean_copies of the host tier.
    clean_copies_kept: int = 0
    clean_copy_demotions: int = 0
    clean_copies_reclaimed: int = 0
    #: Clean disk copies of unreferenced, idle blocks in memory that a full
    #: disk tier gave back for room (their records deleted: the blocks stay
    #: cached, no longer durable).
    disk_copies_given_back: int = 0
    #: Counters of a newer library that this version of the package does not
    #: name yet (field name -> value).
    extra: Dict[str, int] = field(default_factory=dict, compare=False)

    @property
    def hits(self) -> int:
        return self.hits_device + self.hits_host + self.hits_disk

    @property
    def device_hit_rate(self) -> float:
        """Share of block accesses found in the device tier."""
        return self.hits_device / self.lookups if self.lookups else 0.0

    @property
    def prefetch_accuracy(self) -> float:
        """Prefetched blocks used before eviction, per prefetch issued."""
        return self.prefetch_useful / self.prefetch_issued if self.prefetch_issued else 0.0

    @property
    def bytes_moved(self) -> int:
        return self.bytes_device_to_host + self.bytes_host_to_device + self.bytes_host_to_disk + self.bytes_disk_to_host

    def to_dict(self) -> Dict[str, int]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        d.update(self.extra)
        return d

    def __sub__(self, other: "Stats") -> "Stats":
        if not isinstance(other, Stats):
            return NotImplemented
        kw = {f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self) if f.name != "extra"}
        extra = {k: v - other.extra.get(k, 0) for k, v in self.extra.items()}
        return Stats(**kw, extra=extra)


@dataclass(frozen=True)
class TierInfo:
    """Occupancy of one tier (kvh_tier_info). ``base`` is the address of slot
    0 for memory tiers (a device pointer on CUDA), 0 for disk."""

    tier: Tier
    capacity_blocks: int
    used_blocks: int
    used_bytes: int
    block_bytes: int
    pinned_blocks: int
    base: int
    #: Host tier: slots kept as clean copies of blocks promoted to the device
    #: tier. Not in used_blocks: a block that needs a slot takes one back.
    #: Disk tier: slots copying a block that lives in memory (persisted or
    #: cleaned ahead), counted in used_blocks.
    clean_copies: int = 0

    @property
    def present(self) -> bool:
        return self.capacity_blocks > 0

    @property
    def free_blocks(self) -> int:
        return self.capacity_blocks - self.used_blocks

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_blocks * self.block_bytes


@dataclass(frozen=True)
class Scope:
    """Tenant scope of a sequence or a lookup (kvh.h "Tenant scopes").

    Blocks hash in ``scope``, except the first ``shared_tokens`` tokens
    (whole blocks only), which hash in ``shared_scope``. Blocks of two
    scopes never match each other; scope 0 is the engine's default scope,
    where every sequence starts. A multi-tenant caller gives each tenant
    (or request) its own scope and puts what it chooses to share (a system
    prompt) in ``shared_tokens`` of a shared scope (0: shared with
    everyone)."""

    scope: int = 0
    shared_scope: int = 0
    shared_tokens: int = 0

    @classmethod
    def of(cls, value: "Union[Scope, int, None]") -> "Scope":
        """A Scope from a Scope, a plain scope value, or None (the default)."""
        if value is None:
            return cls()
        if isinstance(value, Scope):
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"scope must be an int or a kvh.Scope, not {type(value).__name__}")
        return cls(scope=value)

    @staticmethod
    def value_of(salt: Union[str, bytes]) -> int:
        """A scope value from a string or bytes salt (vLLM's per-request
        ``cache_salt``, a user id): the first 8 bytes, little endian, of
        BLAKE2b keyed with a fixed domain tag, never 0 (the default scope).
        Equal salts give equal scopes in every process and release."""
        import hashlib

        if isinstance(salt, str):
            data = salt.encode("utf-8")
        elif isinstance(salt, (bytes, bytearray, memoryview)):
            data = bytes(salt)
        else:  # bytes(3) would be three zero bytes, bytes([1, 2]) two bytes
            raise TypeError(f"a scope salt is a str or bytes, not {type(salt).__name__}")
        v = int.from_bytes(hashlib.blake2b(data, digest_size=8, key=b"kvh-scope").digest(), "little")
        return v or 1

    def __post_init__(self) -> None:
        for name in ("scope", "shared_scope", "shared_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"Scope.{name} must be an int, not {type(v).__name__}")
            if not 0 <= v < 1 << 64:
                raise ValueError(f"Scope.{name} must be in [0, 2**64), got {shown(v)}")


@dataclass(frozen=True)
class BlockInfo:
    """State of one block (kvh_block_info)."""

    tier: Tier
    slot: int
    refs: int
    pins: int
    holds: int
    tokens: int
    agent: int
    published: bool
    in_flight: bool
    hash: int
    tolerance: int = 128

    @property
    def shared(self) -> bool:
        """Immutable through this reference: shared (CoW) or in the prefix index."""
        return self.refs > 1 or self.published
