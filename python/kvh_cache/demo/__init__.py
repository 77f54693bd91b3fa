"""The demos and benchmarks built on kvh (not part of the library's API).

* :mod:`kvh_cache.demo.agents`: ``kvh demo``, agents answering questions with
  SmolLM2 over a document library, their KV in kvh's tiers;
* :mod:`kvh_cache.demo.synthetic`: ``kvh demo --synthetic``, the same tiers
  with synthetic K/V and no model;
* :mod:`kvh_cache.demo.two_models`: ``kvh demo --models``, two models taking
  turns on one device budget;
* :mod:`kvh_cache.demo.bench_retriever`: ``kvh bench retriever``, speculative
  prefetch from a retriever;
* :mod:`kvh_cache.demo.bench_offload`: ``kvh bench offload``, restoring a prefix
  from the host or disk tier versus recomputing it.

The document library they read ships in ``kvh_cache/demo/data/corpus``.
"""

from __future__ import annotations

from pathlib import Path

CORPUS_DIR = Path(__file__).resolve().parent / "data" / "corpus"

__all__ = ["CORPUS_DIR"]
