"""``kvh bench vllm``: kvh beneath vLLM against recomputing and against
vLLM's ExampleConnector, all in one run so that the ratios compare like
with like.

Each configuration is a fresh vLLM process (``python -m kvh_cache.vllm.run
--bench``, the vLLM venv's python): after a warm-up it times a 2,000-token
prompt to its first token, then decodes a short prompt. A "warm" run is the
second process on the same store, i.e. a vLLM restart: the long prompt's
prefix then comes from kvh's disk tier (or the ExampleConnector's files).
vLLM's own prefix caching is off throughout, so a hit can only come from
the connector. A hit in either arm is thus a restart hit: kvh's blocks are
read from its disk tier (O_DIRECT, each block's CRC32C checked), the
ExampleConnector's safetensors files through the page cache (its cold run
wrote them moments before). Both serve whole blocks, so vLLM computes up
to a block of a returning prompt; with --tail-min-tokens kvh also serves
the prompt's tail block and vLLM computes its last token only.

    kvh bench vllm [--python VENV_PYTHON] [--model HF_DIR] [--json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from .settings import default_cache_dir
from .timing import TRACE_ENV
from .timing import summarize as summarize_trace

PKG_PARENT = Path(__file__).resolve().parents[2]


def default_python() -> Optional[str]:
    env = os.environ.get("KVH_VLLM_PYTHON")
    if env:
        return env
    ver = "%d.%d" % sys.version_info[:2]
    p = Path(default_cache_dir()) / f"vllm-0.32.0-py{ver}" / "bin" / "python"
    return str(p) if p.exists() else None


def default_model() -> Optional[str]:
    env = os.environ.get("KVH_VLLM_MODEL")
    if env:
        return env
    p = Path(default_cache_dir()) / "models" / "SmolLM2-135M-Instruct.Q4_1-hf"
    return str(p) if p.exists() else None


def prompts(n_long: int, reps: int, seed: int) -> List[List[int]]:
    """reps distinct long prompts (timed to the first token), then reps
    short ones (decoded)."""
    rng = random.Random(seed)
    longs = [[rng.randrange(1000, 40000) for _ in range(n_long)] for _ in range(reps)]
    shorts = [[rng.randrange(1000, 40000) for _ in range(48)] for _ in range(reps)]
    return longs + shorts


def run_one(
    py: str, model: str, work: Path, name: str, connector: str, extra: Dict[str, Any], decode: int, trace: bool = False
):
    out = work / f"{name}.json"
    env = dict(os.environ)
    if trace:
        env[TRACE_ENV] = str(work / f"{name}.trace")
    env["PYTHONPATH"] = str(PKG_PARENT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [py, "-m", "kvh_cache.vllm.run", "--bench", "--model", model, "--prompts", str(work / "prompts.json")]
    cmd += ["--out", str(out), "--connector", connector, "--max-tokens", str(decode), "--extra", json.dumps(extra)]
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    (work / f"{name}.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        sys.stderr.write((p.stdout + p.stderr)[-6000:])
        raise SystemExit(f"kvh bench vllm: the {name} run failed ({p.returncode}); log in {work}/{name}.log")
    res = json.loads(out.read_text())
    res["process_s"] = time.perf_counter() - t
    if trace:
        res["trace"] = summarize_trace(str(work / f"{name}.trace"))
    return res


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="kvh bench vllm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=None, help="the vLLM venv's python (default: $KVH_VLLM_PYTHON, else the cache)")
    ap.add_argument("--model", default=None, help="HF model directory (default: $KVH_VLLM_MODEL, else the cache)")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3, help="prompts timed per configuration (medians reported)")
    ap.add_argument("--quick", action="store_true", help="a 600-token prompt, 32 decoded tokens")
    ap.add_argument("--no-example", action="store_true", help="leave out vLLM's ExampleConnector")
    ap.add_argument(
        "--agents",
        action="store_true",
        help="instead: agents sharing a system prompt return to their documents, with vLLM's KV space too "
        "small for them all; prefix tokens served by vLLM's prefix caching alone vs with kvh beneath it",
    )
    ap.add_argument(
        "--decode-rounds",
        type=int,
        default=0,
        metavar="N",
        help="instead: decode tokens/s only, N rounds of plain, ExampleConnector and kvh (fresh stores) in "
        "turn, so that the machine's load hits the arms alike; medians over rounds and prompts",
    )
    ap.add_argument(
        "--tail-min-tokens",
        type=int,
        default=None,
        metavar="N",
        help="the kvh arms' tail_min_tokens (default: the connector's, 0: whole blocks only)",
    )
    ap.add_argument(
        "--kvh-extra",
        default=None,
        metavar="JSON",
        help='more settings of the kvh arms, e.g. \'{"migration_cpus": "all"}\'',
    )
    ap.add_argument(
        "--ab-extra",
        default=None,
        metavar="JSON",
        help="also a warm kvh run (kvh_warm_ab, after kvh_warm, on the same store) with these settings added, "
        'e.g. \'{"migration_cpus": "all"}\', for the ratio of the two in one run',
    )
    ap.add_argument(
        "--ab-prefetch",
        nargs="?",
        const="first",
        choices=("first", "last"),
        default=None,
        help="also a warm kvh run with the lookup-time prefetch on (kvh_warm_prefetch, on the same store, "
        "before kvh_warm or, with 'last', after it), for the ratio of the two in one run",
    )
    ap.add_argument(
        "--trace",
        action="store_true",
        help="time the connectors' hooks inside each run (kvh_cache.vllm.timing) and report medians per run",
    )
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, stores)")
    args = ap.parse_args(argv)
    py, model = args.python or default_python(), args.model or default_model()
    if not py or not model:
        sys.exit(
            "kvh bench vllm: needs the vLLM venv and the converted model: run scripts/install-vllm.sh and "
            "scripts/convert-model-hf.py (or `make bench-vllm`), or pass --python and --model"
        )
    if args.agents:
        return agents(args, py, model)
    if args.decode_rounds:
        return decode_rounds(args, py, model)
    n_long, decode = (600, 32) if args.quick else (args.prompt_tokens, args.decode_tokens)
    if args.quick:
        args.reps = 1
    work = Path(tempfile.mkdtemp(prefix="kvh-bench-vllm-"))
    try:
        (work / "prompts.json").write_text(json.dumps(prompts(n_long, args.reps, args.seed)))
        kvh_extra: Dict[str, Any] = {"disk_path": str(work / "kvh-store"), "disk_bytes": "1G", "host_bytes": "512M"}
        if args.tail_min_tokens is not None:
            kvh_extra["tail_min_tokens"] = args.tail_min_tokens
        if args.kvh_extra:
            kvh_extra.update(json.loads(args.kvh_extra))
        ex_extra = {"shared_storage_path": str(work / "example-store")}
        runs = [
            ("plain", "none", {}),
            ("kvh_cold", "kvh", kvh_extra),
            ("kvh_warm", "kvh", kvh_extra),
        ]
        if args.ab_prefetch:
            runs.insert(
                2 if args.ab_prefetch == "first" else 3, ("kvh_warm_prefetch", "kvh", dict(kvh_extra, prefetch=True))
            )
        if args.ab_extra:
            runs.append(("kvh_warm_ab", "kvh", dict(kvh_extra, **json.loads(args.ab_extra))))
        if not args.no_example:
            (work / "example-store").mkdir()
            runs += [("example_cold", "example", ex_extra), ("example_warm", "example", ex_extra)]
        res: Dict[str, Any] = {}
        for name, conn, extra in runs:
            print(f"kvh bench vllm: {name} ...", file=sys.stderr, flush=True)
            res[name] = run_one(py, model, work, name, conn, extra, decode, args.trace)
        summary = summarize(res, n_long, decode)
        if args.json:
            print(json.dumps(summary, indent=1))
        else:
            print_table(summary)
        same = summary["same_output"]
        return 0 if all(same.values()) else 1
    finally:
        if args.keep:
            print(f"kvh bench vllm: work directory kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def decode_rounds(args, py: str, model: str) -> int:
    """Decode only: every prompt short (48 tokens), each configuration a
    fresh vLLM process, the three in turn for --decode-rounds rounds."""
    rng = random.Random(args.seed)
    n = 2 * args.reps
    work = Path(tempfile.mkdtemp(prefix="kvh-bench-vllm-decode-"))
    try:
        (work / "prompts.json").write_text(
            json.dumps([[rng.randrange(1000, 40000) for _ in range(48)] for _ in range(n)])
        )
        tok_s: Dict[str, List[float]] = {"plain": [], "example": [], "kvh": []}
        same = True
        ref = None
        for rnd in range(args.decode_rounds):
            for arm in tok_s:
                store = work / f"{arm}-store-{rnd}"
                extra = {}
                if arm == "kvh":
                    extra = {"disk_path": str(store), "disk_bytes": "1G", "host_bytes": "512M"}
                elif arm == "example":
                    store.mkdir()
                    extra = {"shared_storage_path": str(store)}
                conn = "none" if arm == "plain" else arm
                print(f"kvh bench vllm --decode-rounds: round {rnd + 1}, {arm} ...", file=sys.stderr, flush=True)
                r = run_one(py, model, work, f"{arm}-{rnd}", conn, extra, args.decode_tokens)
                # run.py --bench decodes the second half of the prompts.
                tok_s[arm] += r["decode_tok_s"]
                ids = r["decode_token_ids"]
                ref = ids if ref is None else ref
                same = same and ids == ref
        med = {k: _median(v) for k, v in tok_s.items()}
        out = {
            "rounds": args.decode_rounds,
            "decode_tokens": args.decode_tokens,
            "decode_tok_s": {k: round(v, 2) for k, v in med.items()},
            "decode_tok_s_all": {k: [round(x, 2) for x in v] for k, v in tok_s.items()},
            "ratios": {
                "decode_kvh_vs_plain": med["kvh"] / med["plain"],
                "decode_example_vs_plain": med["example"] / med["plain"],
                "decode_kvh_vs_example": med["kvh"] / med["example"],
            },
            "same_output": same,
        }
        print(json.dumps(out, indent=1))
        return 0 if same else 1
    finally:
        if args.keep:
            print(f"kvh bench vllm: work directory kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def agents(args, py: str, model: str) -> int:
    """Six agents: one 512-token system prompt, a 768-token document each,
    a question; then each returns with a follow-up. vLLM gets 64 MiB of KV
    (about 2,700 tokens here) for 7,900 tokens of prefixes, so its own
    prefix cache has evicted most of a returning agent's context."""
    rng = random.Random(args.seed)
    n_agents = 3 if args.quick else 6
    system = [rng.randrange(1000, 40000) for _ in range(512)]
    docs = [[rng.randrange(1000, 40000) for _ in range(768)] for _ in range(n_agents)]
    first = [system + d + [rng.randrange(1000, 40000) for _ in range(32)] for d in docs]
    returning = [p + [rng.randrange(1000, 40000) for _ in range(24)] for p in first]
    work = Path(tempfile.mkdtemp(prefix="kvh-bench-vllm-agents-"))
    try:
        (work / "prompts.json").write_text(json.dumps(first + returning))
        out: Dict[str, Any] = {"agents": n_agents, "prompt_tokens": sum(len(p) for p in first + returning)}
        for name, conn, extra in (
            ("vllm_prefix_cache", "none", {}),
            ("with_kvh", "kvh", {"disk_path": str(work / "kvh-store"), "disk_bytes": "1G", "host_bytes": "1G"}),
        ):
            print(f"kvh bench vllm --agents: {name} ...", file=sys.stderr, flush=True)
            res_path = work / f"{name}.json"
            env = dict(os.environ)
            env["PYTHONPATH"] = str(PKG_PARENT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
            cmd = [py, "-m", "kvh_cache.vllm.run", "--model", model, "--prompts", str(work / "prompts.json")]
            cmd += ["--out", str(res_path), "--connector", conn, "--max-tokens", "16", "--extra", json.dumps(extra)]
            cmd += ["--prefix-caching", "--one-by-one", "--kv-cache-bytes", str(64 << 20), "--max-model-len", "2048"]
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            (work / f"{name}.log").write_text(p.stdout + p.stderr)
            if p.returncode != 0:
                sys.stderr.write((p.stdout + p.stderr)[-6000:])
                raise SystemExit(f"kvh bench vllm --agents: the {name} run failed; log in {work}/{name}.log")
            r = json.loads(res_path.read_text())
            cached = sum(x["num_cached_tokens"] or 0 for x in r["results"])
            loaded = (r.get("stats") or {}).get("tokens_loaded") or 0
            back = r["results"][n_agents:]
            out[name] = {
                "generate_s": r["generate_s"],
                "returning_s": sum(x["wall_s"] for x in back),
                "prefix_tokens_reused": cached,
                "from_kvh": loaded,
                "from_vllm_prefix_cache": cached - loaded,
            }
        if args.json:
            print(json.dumps(out, indent=1))
        else:
            print(f"kvh bench vllm --agents: {n_agents} agents, {out['prompt_tokens']} prompt tokens in all")
            print(f"{'run':18} {'reused':>7} {'vLLM':>6} {'kvh':>6} {'total s':>8} {'returning s':>12}")
            for k in ("vllm_prefix_cache", "with_kvh"):
                v = out[k]
                print(
                    f"{k:18} {v['prefix_tokens_reused']:7d} {v['from_vllm_prefix_cache']:6d} {v['from_kvh']:6d} "
                    f"{v['generate_s']:8.1f} {v['returning_s']:12.1f}"
                )
        return 0
    finally:
        if args.keep:
            print(f"kvh bench vllm: work directory kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def _median(xs: List[float]) -> float:
    return statistics.median(xs)


def summarize(res: Dict[str, Any], n_long: int, decode: int) -> Dict[str, Any]:
    base = res["plain"]
    out: Dict[str, Any] = {
        "prompt_tokens": base["prompt_tokens"][0],
        "decode_tokens": decode,
        "reps": len(base["ttft_s"]),
        "runs": {
            k: {
                "ttft_ms": _median(v["ttft_s"]) * 1e3,
                "ttft_ms_all": [round(x * 1e3, 1) for x in v["ttft_s"]],
                "decode_tok_s": _median(v["decode_tok_s"]),
                "decode_tok_s_all": [round(x, 2) for x in v["decode_tok_s"]],
                "tokens_loaded": (v.get("stats") or {}).get("tokens_loaded"),
                **({"trace": v["trace"]} if v.get("trace") else {}),
            }
            for k, v in res.items()
        },
        "same_output": {
            k: v["first_token"] == base["first_token"] and v["decode_token_ids"] == base["decode_token_ids"]
            for k, v in res.items()
        },
    }
    runs = out["runs"]
    r: Dict[str, float] = {}
    r["ttft_kvh_hit_vs_recompute"] = runs["kvh_warm"]["ttft_ms"] / runs["plain"]["ttft_ms"]
    r["ttft_kvh_cold_vs_plain"] = runs["kvh_cold"]["ttft_ms"] / runs["plain"]["ttft_ms"]
    r["decode_kvh_vs_plain"] = runs["kvh_cold"]["decode_tok_s"] / runs["plain"]["decode_tok_s"]
    r["decode_kvh_warm_vs_plain"] = runs["kvh_warm"]["decode_tok_s"] / runs["plain"]["decode_tok_s"]
    if "example_warm" in runs:
        r["ttft_example_hit_vs_recompute"] = runs["example_warm"]["ttft_ms"] / runs["plain"]["ttft_ms"]
        r["ttft_kvh_hit_vs_example_hit"] = runs["kvh_warm"]["ttft_ms"] / runs["example_warm"]["ttft_ms"]
        r["decode_kvh_vs_example"] = runs["kvh_cold"]["decode_tok_s"] / runs["example_cold"]["decode_tok_s"]
        r["decode_example_vs_plain"] = runs["example_cold"]["decode_tok_s"] / runs["plain"]["decode_tok_s"]
        if "kvh_warm_prefetch" in runs:
            r["ttft_kvh_prefetch_hit_vs_example_hit"] = (
                runs["kvh_warm_prefetch"]["ttft_ms"] / runs["example_warm"]["ttft_ms"]
            )
    if "kvh_warm_ab" in runs:
        r["ttft_kvh_ab_vs_kvh_warm"] = runs["kvh_warm_ab"]["ttft_ms"] / runs["kvh_warm"]["ttft_ms"]
    if "kvh_warm_prefetch" in runs:
        r["ttft_kvh_prefetch_vs_not"] = runs["kvh_warm_prefetch"]["ttft_ms"] / runs["kvh_warm"]["ttft_ms"]
    out["ratios"] = r
    return out


def print_table(s: Dict[str, Any]) -> None:
    print(
        f"kvh bench vllm: {s['prompt_tokens']}-token returning prompts, {s['decode_tokens']} decoded tokens, "
        f"medians of {s['reps']}"
    )
    print(f"{'run':14} {'TTFT ms':>9} {'decode tok/s':>13} {'loaded':>7} {'same':>5}")
    for k, v in s["runs"].items():
        loaded = "-" if v["tokens_loaded"] is None else str(v["tokens_loaded"])
        print(f"{k:14} {v['ttft_ms']:9.1f} {v['decode_tok_s']:13.2f} {loaded:>7} {str(s['same_output'][k]):>5}")
    for k, v in s["ratios"].items():
        print(f"  {k:32} {v:6.3f}")


if __name__ == "__main__":
    sys.exit(main())
