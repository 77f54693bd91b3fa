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

import importlib
from typing import TYPE_CHECKING, Any

from . import errors as _errors
from .errors import *  # noqa: F403 (the exception classes: errors.__all__)

# The public names and the module each lives in. They load on first use
# (PEP 562), so that `kvh --help`, `kvh doctor` and the error classes work
# where the compiled binding is missing or does not match the library: the
# first use of the binding then raises the ImportError that says why.
_LAZY = {
    "BUILT_VERSION": "._ffi",
    "BUILT_VERSION_STRING": "._ffi",
    "LOADED_VERSION": "._ffi",
    "LOADED_VERSION_STRING": "._ffi",
    "ffi": "._ffi",
    "lib": "._ffi",
    "AdmissionInfo": ".context",
    "Context": ".context",
    "ContextInfo": ".context",
    "WeightStats": ".context",
    "Block": ".engine",
    "Engine": ".engine",
    "Fence": ".engine",
    "Hold": ".engine",
    "Sequence": ".engine",
    "VMap": ".vmap",
    "Pool": ".pool",
    "AttentionPlan": ".attention_plan",
    "Backend": ".types",
    "BlockInfo": ".types",
    "Codec": ".types",
    "Config": ".types",
    "Eviction": ".types",
    "DType": ".types",
    "RemoteUpload": ".types",
    "Scope": ".types",
    "Stats": ".types",
    "Tier": ".types",
    "TierInfo": ".types",
    "bf16_to_f32": ".types",
    "f32_to_bf16": ".types",
    "numpy_dtype": ".types",
}

if TYPE_CHECKING:  # what static checkers see: the eager imports
    from ._ffi import BUILT_VERSION, BUILT_VERSION_STRING, LOADED_VERSION, LOADED_VERSION_STRING, ffi, lib  # noqa: F401
    from .attention_plan import AttentionPlan
    from .context import AdmissionInfo, Context, ContextInfo, WeightStats
    from .engine import Block, Engine, Fence, Hold, Sequence
    from .pool import Pool
    from .types import (
        Backend,
        BlockInfo,
        Codec,
        Config,
        DType,
        Eviction,
        RemoteUpload,
        Scope,
        Stats,
        Tier,
        TierInfo,
        bf16_to_f32,
        f32_to_bf16,
        numpy_dtype,
    )
    from .vmap import VMap

    __version__: str


def __getattr__(name: str) -> Any:
    if name == "__version__":
        value: Any = importlib.import_module("._ffi", __name__).LOADED_VERSION_STRING
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    else:
        # A submodule (kvh_cache.engine, .types, ...), as `import kvh_cache`
        # made them attributes before it loaded lazily.
        try:
            value = importlib.import_module("." + name, __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value  # later uses skip this function
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY) | {"__version__"})


def version() -> str:
    """Version of the loaded libkvh ("MAJOR.MINOR.PATCH")."""
    return importlib.import_module("._ffi", __name__).LOADED_VERSION_STRING


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
