"""The restart of ``kvh demo``: the engine is closed and a new process
(``python -m kvh_cache.demo.agents --returning SPEC``) reopens the store for a
returning agent, whose time to first token with its prefix found on disk
is measured next to recomputing the same prompt."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence as Seq, Set, Tuple

import numpy as np

import kvh_cache as kvh

from .configs import Setup, SetupResult
from .measure import tiers_of
from .workload import FOLLOW_UP, Workload

__all__ = ["RESTART_TIMEOUT_S", "returning_child", "run_returning"]

RESTART_TIMEOUT_S = 300


# ---------------------------------------------------------------------------------
# the new process
# ---------------------------------------------------------------------------------
def returning_child(spec_path: Path) -> int:
    """``python -m kvh_cache.demo.agents --returning SPEC``: reopen the store, time
    to first token of the returning agent (prefix from disk) next to
    recomputing the same prompt in this process; prints one JSON object."""
    import kvh_cache.model

    spec = json.loads(Path(spec_path).read_text())
    runner = kvh_cache.model.load(spec.get("model"))
    tokens = [int(t) for t in spec["tokens"]]
    gen = int(spec.get("gen_tokens", 8))
    agent = int(spec.get("agent", 1))
    stops = set(int(t) for t in runner.tokenizer.stop_ids)
    _warm_up(runner, tokens)
    result: Dict[str, Any] = {"ok": False, "prompt_tokens": len(tokens)}
    logits_disk, out_disk = _from_store(runner, spec["engine"], agent, tokens, gen, stops, result)
    logits_re, out_re = _recomputed(runner, agent, tokens, gen, stops, result)
    result["baseline_matched_tokens"] = _baseline_prefixes(runner, spec.get("baseline_engines", {}), tokens)
    result.update(
        first_token_equal=out_disk[0] == out_re[0],
        tokens_equal=out_disk == out_re,
        continuation_tokens=len(out_disk),
        max_abs_dlogit=float(np.max(np.abs(logits_disk - logits_re))),
        answer_disk=runner.tokenizer.decode(out_disk, skip_special=True).strip(),
        answer_recompute=runner.tokenizer.decode(out_re, skip_special=True).strip(),
        ratio=result["ttft_disk_ms"] / result["ttft_recompute_ms"] if result["ttft_recompute_ms"] else None,
        ok=result["matched_tokens"] > 0 and result["corrupt_blocks"] == 0,
    )
    print(json.dumps(result))
    return 0


def _warm_up(runner, tokens: Seq[int]) -> None:
    """Warms up BLAS and the kernels so that neither measurement pays for it."""
    with runner.engine(device_bytes=8 << 20, host_bytes=0) as weng:
        ws = weng.sequence()
        lg = runner.prefill(ws, tokens[:40])
        runner.decode_step(ws, int(np.argmax(lg)))
        ws.free()


def _greedy(runner, seq, first: int, gen: int, stops: Set[int]) -> List[int]:
    """Up to ``gen`` tokens greedily, ``first`` first, stopping after a
    stop token."""
    out = [first]
    while len(out) < gen and out[-1] not in stops:
        logits = runner.decode_step(seq, out[-1])
        out.append(int(np.argmax(logits)))
    return out


def _from_store(
    runner,
    engine_kwargs: Dict[str, Any],
    agent: int,
    tokens: List[int],
    gen: int,
    stops: Set[int],
    result: Dict[str, Any],
) -> Tuple[np.ndarray, List[int]]:
    """The store, as a new process finds it: the prompt's prefix matched
    there, the rest prefilled; the timings and counters go into
    ``result``. Returns the first logits and the continuation (its first
    token first)."""
    bt = runner.block_tokens
    t0 = time.perf_counter()
    eng = runner.engine(**engine_kwargs)
    result["open_ms"] = 1e3 * (time.perf_counter() - t0)
    try:
        st0 = eng.stats()
        seq = eng.sequence(agent=agent)
        t0 = time.perf_counter()
        matched = seq.match_prefix(tokens)
        if matched >= len(tokens):
            seq.truncate(len(tokens) - 1)
            matched = len(tokens) - 1
        t1 = time.perf_counter()
        tiers = tiers_of(seq, matched // bt)  # not counted
        t2 = time.perf_counter()
        logits = runner.prefill(seq, tokens[matched:])
        first = int(np.argmax(logits))
        t3 = time.perf_counter()
        result.update(
            matched_tokens=matched,
            matched_tiers=tiers,
            ttft_disk_ms=1e3 * ((t1 - t0) + (t3 - t2)),
            match_ms=1e3 * (t1 - t0),
            prefilled_tokens=len(tokens) - matched,
        )
        out = _greedy(runner, seq, first, gen, stops)
        st = (eng.stats() - st0).to_dict()
        result.update(
            hits_disk=st["hits_disk"],
            bytes_disk_to_host=st["bytes_disk_to_host"],
            prefix_hit_tokens=st["prefix_hit_tokens"],
            corrupt_blocks=st["corrupt_blocks"],
        )
        seq.free()
    finally:
        eng.close()
    return logits, out


def _recomputed(
    runner, agent: int, tokens: List[int], gen: int, stops: Set[int], result: Dict[str, Any]
) -> Tuple[np.ndarray, List[int]]:
    """The same prompt recomputed from nothing (an engine without a store);
    its time to first token goes into ``result``."""
    need = -(-(len(tokens) + gen) // runner.block_tokens) + 4
    eng = runner.engine(device_bytes=need * runner.block_bytes, host_bytes=0)
    try:
        seq = eng.sequence(agent=agent)
        t0 = time.perf_counter()
        logits = runner.prefill(seq, tokens)
        first = int(np.argmax(logits))
        t1 = time.perf_counter()
        result["ttft_recompute_ms"] = 1e3 * (t1 - t0)
        out = _greedy(runner, seq, first, gen, stops)
        seq.free()
    finally:
        eng.close()
    return logits, out


def _baseline_prefixes(runner, engines: Dict[str, Dict[str, Any]], tokens: List[int]) -> Dict[str, int]:
    """The baselines' tiers after a restart: nothing survives without a
    disk tier (tokens of the prompt each one finds)."""
    surv = {}
    for name, kw in engines.items():
        with runner.engine(**kw) as beng:
            with beng.sequence() as s:
                surv[name] = s.match_prefix(tokens)
    return surv


# ---------------------------------------------------------------------------------
# the parent: start the new process, read its result
# ---------------------------------------------------------------------------------
def run_returning(
    work: Workload, kvh_res: SetupResult, data_dir: Path, baseline_setups: Dict[str, Setup]
) -> Optional[Dict[str, Any]]:
    ret = kvh_res.returning
    if ret is None:
        return None
    s = kvh_res.setup
    spec = {
        "model": work.runner.path,
        "agent": ret["agent"],
        "tokens": ret["tokens"],
        "gen_tokens": 8,
        "engine": s.engine_kwargs(work.args.buffered_io),
        "baseline_engines": {
            name: {k: v for k, v in b.engine_kwargs(False).items()} for name, b in baseline_setups.items()
        },
    }
    spec["engine"]["disk_reset_on_mismatch"] = False  # the store must be found as it was left
    path = data_dir / "returning-agent.json"
    path.write_text(json.dumps(spec))
    env = dict(os.environ)
    pkg_root = str(Path(kvh.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t0 = time.perf_counter()
    try:
        res = subprocess.run(
            [sys.executable, "-m", "kvh_cache.demo.agents", "--returning", str(path)],
            capture_output=True,
            text=True,
            env=env,
            timeout=RESTART_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"the restart process did not finish in {RESTART_TIMEOUT_S} s"}
    wall = time.perf_counter() - t0
    doc = None
    for line in reversed(res.stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                doc = json.loads(line)
                break
            except ValueError:
                pass
    if res.returncode != 0 or doc is None:
        tail = (res.stderr or res.stdout).strip().splitlines()[-5:]
        return {"ok": False, "error": f"the restart process exited with {res.returncode}: " + " | ".join(tail)}
    doc.update(
        process_seconds=wall,
        agent=ret["agent"],
        question=ret["question"],
        doc=ret["doc"],
        follow_up=FOLLOW_UP,
        conversation_tokens=ret["conversation_tokens"],
        persisted_tokens=ret["persisted_tokens"],
        earlier_answer=ret["answer"],
    )
    return doc
