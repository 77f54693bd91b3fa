"""kvh: a hierarchical KV-cache manager (Python front-end of libkvh).

    import numpy as np
    import kvh_cache as kvh

    with kvh.Engine(num_layers=2, num_kv_heads=4, head_dim=64, dtype="f32") as eng:
        with eng.sequence() as seq:
            seq.append(np.arange(32))
            k = v = np.zeros((32, 4, 64), np.float32)
            seq.write_kv(0, 0, k, v)
            k2, v2 = seq.read_kv(0)

See ``help(kvh.Engine)`` and ``help(kvh.Sequence)``; the CLI is ``kvh --help``.
"""

from __future__ import annotations

from ._ffi import BUILT_VERSION, BUILT_VERSION_STRING, LOADED_VERSION, LOADED_VERSION_STRING, ffi, lib  # noqa: F401
from .context import AdmissionInfo, Context, ContextInfo, WeightStats
from .engine import Block, Engine, Fence, Hold, Sequence
from . import errors as _errors
from .errors import *  # noqa: F403 (the exception classes: errors.__all__)
from .vmap import VMap
from .pool import Pool
from .attention_plan import AttentionPlan
from .types import (
    Backend,
    BlockInfo,
    Codec,
    Config,
    Eviction,
    DType,
    RemoteUpload,
    Scope,
    Stats,
    Tier,
    TierInfo,
    bf16_to_f32,
    f32_to_bf16,
    numpy_dtype,
)

__version__ = LOADED_VERSION_STRING


def version() -> str:
    """Version of the loaded libkvh ("MAJOR.MINOR.PATCH")."""
    return LOADED_VERSION_STRING


__all__ = [
    "Engine",
    "Sequence",
    "Block",
    "Hold",
    "Fence",
    "VMap",
    "Pool",
    "AttentionPlan",
    "Context",
    "ContextInfo",
    "WeightStats",
    "AdmissionInfo",
    "Config",
    "Codec",
    "Eviction",
    "Stats",
    "TierInfo",
    "BlockInfo",
    "Scope",
    "RemoteUpload",
    "Tier",
    "DType",
    "Backend",
    "numpy_dtype",
    "bf16_to_f32",
    "f32_to_bf16",
    "version",
    "BUILT_VERSION",
    "BUILT_VERSION_STRING",
    "LOADED_VERSION",
    "LOADED_VERSION_STRING",
    *_errors.__all__,
]
