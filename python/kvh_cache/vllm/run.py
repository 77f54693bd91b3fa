"""Runs one vLLM engine over a list of prompts and writes what it produced
(token ids, text, timings) and, with kvh beneath it, the connector's and
kvh's counters, as JSON. The tests and `kvh bench vllm` start it with the
vLLM venv's python, one process per "restart" (vLLM spawns its engine core
and workers, so this must run as a script, not be imported by a test).

    python -m kvh_cache.vllm.run --model DIR --prompts prompts.json --out result.json \
        [--connector kvh|example|none] [--extra '{"disk_path": ...}'] \
        [--engine-id ID] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True, help="JSON list of prompts (strings or lists of token ids)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--connector", choices=("kvh", "example", "none"), default="kvh")
    ap.add_argument("--extra", default="{}", help="kv_connector_extra_config as JSON")
    ap.add_argument("--engine-id", default=None)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prefix-caching", action="store_true", help="keep vLLM's own prefix caching on")
    ap.add_argument("--one-by-one", action="store_true", help="generate each prompt alone (timings per prompt)")
    ap.add_argument(
        "--bench",
        action="store_true",
        help="after a warm-up: time prompt 0 to its first token (max_tokens=1), then decode prompt 1 "
        "for --max-tokens tokens",
    )
    ap.add_argument(
        "--disable-hma",
        action="store_true",
        help="turn vLLM's hybrid KV cache manager off, as vLLM does itself for a connector without HMA support",
    )
    ap.add_argument(
        "--request-stats",
        action="store_true",
        help="let vLLM keep per-request timings (TTFT, token timestamps: ttft_s and itl_s in the results)",
    )
    ap.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    ap.add_argument("--max-model-len", type=int, default=4096)
    args = ap.parse_args()

    # vLLM's CPU build reserves one more core per rank for its scheduler
    # whenever a KV connector is configured (meant for NIXL); on a machine
    # with one core per rank to spare that leaves none, the reservation is
    # dropped and the worker's OpenMP team contends with the busy-polling
    # engine core (a 2 to 3x slowdown on 2 cores, any connector). Runs here
    # reserve what plain vLLM does, so that every configuration gets the
    # same cores.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    with open(args.prompts) as f:
        prompts = json.load(f)
    kw = {}
    engine_id = args.engine_id or f"kvh-run-{os.getpid()}"
    extra = json.loads(args.extra)
    # With $KVH_VLLM_TRACE set, both connectors run timed (kvh_cache.vllm.timing).
    traced = bool(os.environ.get("KVH_VLLM_TRACE"))
    if args.connector == "kvh":
        import kvh_cache.vllm

        names = dict(kv_connector="TimedKvhConnector", kv_connector_module_path="kvh_cache.vllm.timing")
        cfg = kvh_cache.vllm.transfer_config(extra, **(names if traced else {}))
        kw["kv_transfer_config"] = KVTransferConfig(engine_id=engine_id, **cfg)
    elif args.connector == "example":
        names = dict(kv_connector="TimedExampleConnector", kv_connector_module_path="kvh_cache.vllm.timing")
        kw["kv_transfer_config"] = KVTransferConfig(
            **(names if traced else dict(kv_connector="ExampleConnector")),
            kv_role="kv_both",
            engine_id=engine_id,
            kv_connector_extra_config=extra,
        )
    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        enforce_eager=True,
        max_model_len=args.max_model_len,
        seed=0,
        gpu_memory_utilization=0.2,
        kv_cache_memory_bytes=args.kv_cache_bytes,
        enable_prefix_caching=args.prefix_caching,
        disable_hybrid_kv_cache_manager=True if args.disable_hma else None,
        disable_log_stats=not args.request_stats,
        **kw,
    )
    init_s = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
    results = []
    if args.bench:
        return bench(args, llm, inputs, init_s, engine_id)
    t0 = time.perf_counter()
    batches = [[x] for x in inputs] if args.one_by_one else [inputs]
    # One at a time, kvh's counters are read after each request: what it
    # loaded for that request, and how much came from its disk tier.
    per_request = args.one_by_one and args.connector == "kvh"
    loaded = _kvh_loaded(engine_id) if per_request else None
    for batch in batches:
        tb = time.perf_counter()
        outs = llm.generate(batch, sp, use_tqdm=False)
        wall = time.perf_counter() - tb
        now = _kvh_loaded(engine_id) if per_request else None
        delta = [b - a for a, b in zip(loaded, now)] if loaded and now else None
        loaded = now
        for o in outs:
            m = o.metrics
            ttft = getattr(m, "first_token_latency", None) if m is not None else None
            n_out = len(o.outputs[0].token_ids)
            first_ts, last_ts = getattr(m, "first_token_ts", 0.0), getattr(m, "last_token_ts", 0.0)
            itl = (last_ts - first_ts) / (n_out - 1) if m is not None and n_out > 1 and last_ts > first_ts else None
            results.append(
                {
                    "prompt_tokens": len(o.prompt_token_ids),
                    "token_ids": list(o.outputs[0].token_ids),
                    "text": o.outputs[0].text,
                    "wall_s": wall,
                    "ttft_s": ttft,
                    "itl_s": itl,
                    "num_cached_tokens": getattr(o, "num_cached_tokens", None),
                }
            )
            if delta is not None:
                results[-1]["kvh_tokens_loaded"], results[-1]["kvh_tokens_loaded_disk"] = delta
    gen_s = time.perf_counter() - t0
    stats = None
    if args.connector == "kvh":
        import kvh_cache.vllm

        try:
            stats = kvh_cache.vllm.query_stats(engine_id)
        except OSError as exc:
            stats = {"error": str(exc)}
    out = {"init_s": init_s, "generate_s": gen_s, "results": results, "stats": stats, "engine_id": engine_id}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    del llm
    return 0


def _kvh_loaded(engine_id: str):
    """(tokens loaded, of them from disk) so far by the kvh connector."""
    import kvh_cache.vllm

    try:
        st = kvh_cache.vllm.query_stats(engine_id)
        return st.get("tokens_loaded", 0), st.get("tokens_loaded_disk", 0)
    except OSError:
        return None


def bench(args, llm, inputs, init_s: float, engine_id: str) -> int:
    """The first half of the prompts are timed to their first token, one at
    a time; the second half are decoded for --max-tokens tokens each."""
    from vllm import SamplingParams

    greedy = dict(temperature=0.0, ignore_eos=True)
    llm.generate(
        [{"prompt_token_ids": list(range(1000, 1040))}], SamplingParams(max_tokens=4, **greedy), use_tqdm=False
    )
    half = len(inputs) // 2
    out = {"init_s": init_s, "ttft_s": [], "first_token": [], "prompt_tokens": [], "decode_s": [], "decode_tok_s": []}
    out["decode_token_ids"] = []
    for p in inputs[:half]:
        t = time.perf_counter()
        r = llm.generate([p], SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
        out["ttft_s"].append(time.perf_counter() - t)
        out["first_token"].append(list(r[0].outputs[0].token_ids))
        out["prompt_tokens"].append(len(r[0].prompt_token_ids))
    for p in inputs[half:]:
        t = time.perf_counter()
        r = llm.generate([p], SamplingParams(max_tokens=args.max_tokens, **greedy), use_tqdm=False)
        dt = time.perf_counter() - t
        ids = list(r[0].outputs[0].token_ids)
        out["decode_s"].append(dt)
        out["decode_tok_s"].append(len(ids) / dt)
        out["decode_token_ids"].append(ids)
    out["stats"] = None
    if args.connector == "kvh":
        import kvh_cache.vllm

        try:
            out["stats"] = kvh_cache.vllm.query_stats(engine_id)
        except OSError as exc:
            out["stats"] = {"error": str(exc)}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
