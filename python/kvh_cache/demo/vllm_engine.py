"""``kvh demo --engine vllm``: the multi-agent demo driven by vLLM, with kvh
as the KV tier beneath it (the ``kvh_cache.vllm`` connector).

Agents share one system prompt, each reads its own document and asks a
question; then every agent returns with a follow-up. vLLM gets a small KV
space, so its own prefix cache has evicted most of a returning agent's
context by the time it returns; kvh (host RAM, then its disk tier) still
holds it. Then vLLM is restarted and the agents return once more: their
prefixes come back from kvh's disk tier. The same prompts run through vLLM
alone (its prefix caching on) for comparison.

Each phase is one vLLM process (``python -m kvh_cache.vllm.run``, the vLLM venv's
python), requests one at a time, greedy. Printed per phase: TTFT and ITL
(medians), prefix tokens reused by where they came from (vLLM's prefix
cache, kvh's memory tiers, kvh's disk tier), tokens recomputed, wall time.
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
from pathlib import Path
from typing import Any, Dict, List

PKG_PARENT = Path(__file__).resolve().parents[2]


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vLLM engine (--engine vllm)")
    g.add_argument(
        "--vllm-python", default=None, help="the vLLM venv's python (default: $KVH_VLLM_PYTHON, else the cache)"
    )
    g.add_argument("--vllm-model", default=None, help="HF model directory (default: $KVH_VLLM_MODEL, else the cache)")
    g.add_argument("--vllm-agents", type=int, default=4, metavar="N", help="agents (default 4)")
    g.add_argument("--vllm-system-tokens", type=int, default=512, metavar="T", help="shared system prompt (512)")
    g.add_argument("--vllm-doc-tokens", type=int, default=768, metavar="T", help="each agent's document (768)")
    g.add_argument("--vllm-max-tokens", type=int, default=16, metavar="T", help="tokens generated per request (16)")
    g.add_argument(
        "--vllm-kv-mib",
        type=int,
        default=48,
        metavar="MiB",
        help="vLLM's own KV space (48 MiB: smaller than the agents' prefixes)",
    )
    g.add_argument("--vllm-no-baseline", action="store_true", help="skip the runs of vLLM alone")
    g.add_argument("--vllm-quick", action="store_true", help="2 agents, short prompts, no baseline (a smoke test)")
    g.add_argument("--vllm-keep", action="store_true", help="keep the work directory (logs, store)")
    g.add_argument("--vllm-json", action="store_true", help="print the results as JSON")


def workload(agents: int, system_tokens: int, doc_tokens: int, seed: int = 7) -> Dict[str, List[List[int]]]:
    """Token-id prompts: first visits, then returns (first visit + a
    follow-up question)."""
    rng = random.Random(seed)
    system = [rng.randrange(1000, 40000) for _ in range(system_tokens)]
    docs = [[rng.randrange(1000, 40000) for _ in range(doc_tokens)] for _ in range(agents)]
    first = [system + d + [rng.randrange(1000, 40000) for _ in range(24)] for d in docs]
    returning = [p + [rng.randrange(1000, 40000) for _ in range(32)] for p in first]
    return {"first": first, "returning": returning}


def _run(py: str, model: str, work: Path, name: str, prompts: List[List[int]], connector: str, extra, args) -> Dict:
    (work / f"{name}.prompts.json").write_text(json.dumps(prompts))
    out = work / f"{name}.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = str(PKG_PARENT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [py, "-m", "kvh_cache.vllm.run", "--model", model, "--prompts", str(work / f"{name}.prompts.json")]
    cmd += ["--out", str(out), "--connector", connector, "--max-tokens", str(args.vllm_max_tokens)]
    cmd += ["--extra", json.dumps(extra), "--prefix-caching", "--one-by-one", "--request-stats"]
    cmd += ["--kv-cache-bytes", str(args.vllm_kv_mib << 20), "--max-model-len", "2048"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    (work / f"{name}.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        sys.stderr.write((p.stdout + p.stderr)[-6000:])
        raise SystemExit(f"kvh demo --engine vllm: the {name} run failed ({p.returncode}); log in {work}/{name}.log")
    return json.loads(out.read_text())


def _row(phase: str, results: List[Dict[str, Any]]) -> Dict:
    kvh_tokens = sum(x.get("kvh_tokens_loaded", 0) for x in results)
    kvh_disk = sum(x.get("kvh_tokens_loaded_disk", 0) for x in results)
    cached = sum(x["num_cached_tokens"] or 0 for x in results)
    prompt = sum(x["prompt_tokens"] for x in results)
    itl = [x["itl_s"] for x in results if x.get("itl_s") is not None]
    return {
        "phase": phase,
        "requests": len(results),
        "prompt_tokens": prompt,
        "ttft_ms": statistics.median(x["ttft_s"] or float("nan") for x in results) * 1e3,
        "itl_ms": statistics.median(itl) * 1e3 if itl else float("nan"),
        "from_vllm_cache": cached - kvh_tokens,
        "from_kvh_memory": kvh_tokens - kvh_disk,
        "from_kvh_disk": kvh_disk,
        "recomputed": prompt - cached,
        "wall_s": sum(x["wall_s"] for x in results),
    }


def render(rows: List[Dict[str, Any]], agents: int) -> str:
    head = (
        f"{'phase':34} {'req':>3} {'TTFT ms':>8} {'ITL ms':>7} {'vLLM $':>7} {'kvh mem':>8} {'kvh disk':>8} "
        f"{'recomp':>7} {'wall s':>7}"
    )
    lines = [f"kvh demo --engine vllm: {agents} agents, vLLM with kvh beneath it (prefix tokens by source)", head]
    for r in rows:
        lines.append(
            f"{r['phase']:34} {r['requests']:3d} {r['ttft_ms']:8.1f} {r['itl_ms']:7.1f} {r['from_vllm_cache']:7d} "
            f"{r['from_kvh_memory']:8d} {r['from_kvh_disk']:8d} {r['recomputed']:7d} {r['wall_s']:7.1f}"
        )
    by = {r["phase"]: r for r in rows}
    a, b = by.get("kvh: agents return after restart"), by.get("vLLM alone: agents return after restart")
    if a and b and b["ttft_ms"]:
        lines.append(f"TTFT of returning agents after a restart, kvh / vLLM alone = {a['ttft_ms'] / b['ttft_ms']:.2f}x")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from ..vllm.bench import default_model, default_python

    # Checked before vLLM starts: a bad value would surface minutes later, from vLLM.
    for name in ("vllm_agents", "vllm_system_tokens", "vllm_doc_tokens", "vllm_max_tokens", "vllm_kv_mib"):
        if getattr(args, name) <= 0:
            print(f"kvh demo --engine vllm: --{name.replace('_', '-')} must be > 0", file=sys.stderr)
            return 2
    py = args.vllm_python or default_python()
    model = args.vllm_model or default_model()
    if not py or not model:
        sys.exit(
            "kvh demo --engine vllm: needs the vLLM venv and the converted model: run scripts/install-vllm.sh and "
            "scripts/convert-model-hf.py, or pass --vllm-python and --vllm-model"
        )
    if args.vllm_quick:
        args.vllm_agents, args.vllm_system_tokens, args.vllm_doc_tokens = 2, 256, 384
        args.vllm_max_tokens, args.vllm_no_baseline = 4, True
    w = workload(args.vllm_agents, args.vllm_system_tokens, args.vllm_doc_tokens)
    n = args.vllm_agents
    work = Path(tempfile.mkdtemp(prefix="kvh-demo-vllm-"))
    try:
        extra = {"disk_path": str(work / "kvh-store"), "disk_bytes": "1G", "host_bytes": "256M"}
        rows = []
        configs = [("kvh", "kvh", extra)] + ([] if args.vllm_no_baseline else [("vLLM alone", "none", {})])
        for label, conn, ex in configs:
            print(f"kvh demo --engine vllm: {label}: first visits and returns ...", file=sys.stderr, flush=True)
            r1 = _run(py, model, work, f"{conn}-1", w["first"] + w["returning"], conn, ex, args)
            res = r1["results"]
            rows.append(_row(f"{label}: agents' first visits", res[:n]))
            rows.append(_row(f"{label}: agents return", res[n:]))
            print(f"kvh demo --engine vllm: {label}: restart, agents return ...", file=sys.stderr, flush=True)
            r2 = _run(py, model, work, f"{conn}-2", w["returning"], conn, ex, args)
            rows.append(_row(f"{label}: agents return after restart", r2["results"]))
        if args.vllm_json:
            print(json.dumps({"agents": n, "rows": rows}, indent=1))
        else:
            print(render(rows, n))
        return 0
    finally:
        if args.vllm_keep:
            print(f"kvh demo --engine vllm: work directory kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
