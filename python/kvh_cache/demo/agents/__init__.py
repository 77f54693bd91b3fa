"""``kvh demo``: agents answer questions over a small document library with
SmolLM2-135M-Instruct, their KV cache in kvh's tiers.

What one run does (``kvh demo``; ``kvh demo --synthetic`` is the older
demo with synthetic K/V and no model):

* **Shared system prompt.** Every prompt starts with the same system
  prompt. Its KV is computed once; its full blocks are pinned in the device
  tier and every sequence that starts with it references the same blocks
  (one physical copy).
* **Document library.** The plain-text articles shipped in
  ``kvh_cache/demo/data/corpus`` are indexed by the retriever (``kvh_cache.retrieval``:
  Qdrant through ``kvh_cache.retriever`` when present, else NumPy) and their KV is
  computed once, as ``[system prompt][article]`` sequences. The device
  budget is a fraction of the run's KV, so these blocks spill to the host
  tier and to the disk tier (``DATA_DIR/store``). A later run finds them in
  the store instead of recomputing them.
* **Agents.** Each agent asks its questions in turn (round robin). A
  request's prompt is ``[system prompt][retrieved article][question]``; the
  engine's prefix index attaches the cached ``[system prompt][article]``
  blocks (wherever they are) and only the question is prefilled, then the
  answer is decoded greedily. Prefix reuse is exact: blocks are matched by
  a chained hash of the token ids.
* **Speculative prefetch.** While an agent decodes, a background thread
  resolves the next queued question with the retriever and hints the
  article's blocks (``Engine.prefetch``), so they are back in the device
  tier before the next request starts.
* **Queue hints** (``--queue-hints``, default one round of agents). Before
  each request the scheduler tells the engine which cached articles it and
  the next queued requests read, soonest first, and before each decode
  step that the running request reads its whole sequence
  (``Engine.hint``, kvh_seq_hint: advice that moves nothing), so that
  eviction keeps what the queue needs next.
* **Restart.** The engine is closed; a new process reopens the store and
  answers a returning agent's follow-up question, whose prefix (its earlier
  conversation) is found on disk, next to recomputing the same prompt.
* **Baselines** (``--baseline``, default both): the same requests with
  everything in the device tier (*monolithic*; its device tier is sized to
  hold the whole run, and a probe measures what it holds at our device
  budget before refusing) and with the seed's naive *synchronous offload*
  (device + host, no disk, no worker threads, no prefetch: before every
  forward step the sequence is copied into the device tier, after it back
  to the host).

Output: per-agent time to first token and inter-token latency with the
answers, tier occupancy, hit rates, prefetch useful/wasted, bytes moved,
where decode time goes (model vs cache), the restart, and the seed's
trade-off table with a measured number in every cell. ``--json`` prints
JSON lines (``scenario: "demo"``, ``metric``, ``value``, ``unit``,
``baseline``, ``ratio``); a PNG of occupancy and latency over time is
written when matplotlib is installed; ``--record-trace FILE`` writes the
block-access trace for policy replay. Everything goes under ``--data-dir``.
"""

from __future__ import annotations

# The modules, one concern each: ``options`` (the command line), ``loading``
# (the model), ``corpus`` and ``workload`` (the articles, their retrieval,
# the prompts and requests), ``configs`` (kvh and the baselines, their
# tiers), ``session`` (one configuration's run: ``library`` caches the
# library's KV, ``scheduler`` hints the queue and prefetches, ``kv`` times
# the KV backend, ``measure`` and ``trace`` record), ``restart``,
# ``report`` and ``plot``, and ``app``, which runs them in order.

from .app import main, run
from .corpus import HashedEmbedder, load_corpus
from .options import DEFAULTS, add_arguments, fill_defaults
from .workload import AGENT_QUESTIONS, plan_requests

__all__ = [
    "AGENT_QUESTIONS",
    "DEFAULTS",
    "HashedEmbedder",
    "add_arguments",
    "fill_defaults",
    "load_corpus",
    "main",
    "plan_requests",
    "run",
]
