"""SmolLM2 decode from one context much larger than the device tier.

Prefills a ``--context``-token prompt into two engines, one whose device
tier holds everything and one whose device tier holds ``--device-tokens``
(the rest in the host tier, or on disk with ``--disk``), then decodes
``--new`` greedy tokens in each and prints tokens/s, whether the tokens
agree, and the KV bytes each decode step reads by tier.

    python benchmarks/model_long_context.py --context 8192 --device-tokens 512
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import numpy as np


def _tiers(seq) -> dict:
    counts: dict = {}
    for b in seq.blocks():
        t = b.info().tier.name.lower()
        counts[t] = counts.get(t, 0) + 1
    return counts


def _run(runner, ids, new, **engine_kw):
    with runner.engine(**engine_kw) as eng:
        kv = runner.kvh_kv(eng)
        t0 = time.perf_counter()
        logits = runner.prefill(kv, ids, chunk=256)
        t1 = time.perf_counter()
        toks = []
        for i in range(new):
            toks.append(int(np.argmax(logits)))
            if i + 1 < new:
                logits = runner.decode_step(kv, toks[-1])
        t2 = time.perf_counter()
        where = _tiers(kv.seq)
        per_block = eng.block_bytes
        return {
            "prefill_tokens_per_s": len(ids) / (t1 - t0),
            "decode_tokens_per_s": (new - 1) / (t2 - t1) if new > 1 else float("nan"),
            "tokens": toks,
            "attention": kv.attention_used,
            "blocks_by_tier": where,
            "kv_mb_per_step_by_tier": {t: n * per_block / 1e6 for t, n in where.items()},
        }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=8192, help="prompt tokens (default 8192)")
    p.add_argument("--device-tokens", type=int, default=512, help="device tier of the streamed run, in tokens")
    p.add_argument("--new", type=int, default=16, help="greedy tokens decoded (default 16)")
    p.add_argument("--disk", action="store_true", help="keep the context on disk instead of in the host tier")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    # Imported once the arguments are read: --help needs no model package.
    import kvh_cache.model as km
    from kvh_cache.model.texts import PPL_TEXT

    runner = km.load()
    text = PPL_TEXT
    ids = runner.encode(text)
    while len(ids) < a.context:
        ids = ids + runner.encode(" " + text)
    ids = ids[: a.context]
    with runner.engine() as probe:
        bb = probe.block_bytes
    n_blocks = (a.context + a.new) // runner.block_tokens + 2
    full = _run(runner, ids, a.new, device_bytes=(n_blocks + 8) * bb)
    dev_blocks = max(4, a.device_tokens // runner.block_tokens)
    kw = dict(device_bytes=dev_blocks * bb)
    with tempfile.TemporaryDirectory(dir=".") as d:
        if a.disk:
            kw.update(host_bytes=8 * bb, disk_path=d + "/store", disk_bytes=(n_blocks + 64) * (bb + 8192))
        else:
            kw.update(host_bytes=(n_blocks + 8) * bb)
        streamed = _run(runner, ids, a.new, **kw)
    out = {
        "context": a.context,
        "device_tokens": dev_blocks * runner.block_tokens,
        "where": "disk" if a.disk else "host",
        "all_in_device": {k: v for k, v in full.items() if k != "tokens"},
        "streamed": {k: v for k, v in streamed.items() if k != "tokens"},
        "tokens_equal": full["tokens"] == streamed["tokens"],
        "decode_ratio": streamed["decode_tokens_per_s"] / full["decode_tokens_per_s"],
    }
    if a.json:
        print(json.dumps(out))
    else:
        print(json.dumps(out, indent=2))
    return 0 if out["tokens_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
