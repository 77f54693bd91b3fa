"""kvh beneath vLLM: a KV connector (``KVConnectorBase_V1``) that offloads
vLLM's KV blocks to kvh's host and disk tiers and loads matched prefixes
back into vLLM's paged memory, across requests and restarts.

Select it with::

    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(model=..., kv_transfer_config=KVTransferConfig(**kvh_cache.vllm.transfer_config()))

``import kvh_cache`` never imports this package; importing ``kvh_cache.vllm`` itself
imports neither torch nor vLLM until ``KvhConnector`` is used.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

__all__ = ["KvhConnector", "transfer_config", "query_stats"]

CONNECTOR = "KvhConnector"
MODULE = "kvh_cache.vllm.connector"


def transfer_config(extra: Optional[Dict[str, Any]] = None, **kwargs: Any) -> Dict[str, Any]:
    """Keyword arguments of ``vllm.config.KVTransferConfig`` selecting kvh
    (``kv_role="kv_both"``, failed loads recomputed); ``extra`` becomes
    ``kv_connector_extra_config`` (see :mod:`kvh_cache.vllm.settings`)."""
    cfg: Dict[str, Any] = dict(
        kv_connector=CONNECTOR,
        kv_connector_module_path=MODULE,
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=dict(extra or {}),
    )
    cfg.update(kwargs)
    return cfg


def query_stats(engine_id: str, *, dp_rank: int = 0, tp_rank: int = 0, runtime_dir: Optional[str] = None):
    """Counters of a running worker's connector and kvh engine, asked over
    its lookup channel (same user only)."""
    from .channel import Client, socket_path

    c = Client(socket_path(engine_id, dp_rank, tp_rank, runtime_dir))
    try:
        return c.call({"op": "stats"})
    finally:
        c.close()


def __getattr__(name: str) -> Any:
    if name == "KvhConnector":
        from .connector import KvhConnector

        return KvhConnector
    raise AttributeError(name)
