"""Remote tier: node B's time to first token for a prefix node A computed.

With the real model runner (SmolLM2-135M-Instruct, CPU backend, f32 KV)
and one Redis server started on a free loopback port for the run:

``node A``
    another process: prefills the prefix (``--tokens`` tokens of the
    document library) into an engine whose remote tier is that server and
    persists it (``kvh_seq_persist`` uploads the full blocks).
``remote``
    node B, this process, a fresh engine with an empty local store and the
    same remote tier: ``Runner.prefill_cached`` matches the prefix in the
    store (EXISTS, GETEX, every value verified and copied into the host
    tier) and recomputes only the last token for its logits. The time to
    those logits.
``recompute``
    node B, a fresh engine without a remote tier: the whole prefix
    prefilled. The time to the same logits.

``ratio`` = remote / recompute (target <= 0.3 on loopback). Each round
flushes the server and runs node A again; the two node-B measurements
alternate in order. Medians of ``--reps`` rounds; the model's load time is
outside every timing. One JSON object per line with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from .bench_offload import document_tokens

__all__ = ["main", "build_parser"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Redis:
    """One redis-server on loopback (no persistence), stopped by stop()."""

    def __init__(self, workdir: Path) -> None:
        server = shutil.which("redis-server")
        if not server or not shutil.which("redis-cli"):
            raise RuntimeError("redis-server and redis-cli are needed (scripts/install-deps.sh)")
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [
                server,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(200):
            if self.cli("PING") == "PONG":
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not start")

    def cli(self, *cmd: str) -> str:
        res = subprocess.run(["redis-cli", "-p", str(self.port), *cmd], capture_output=True, text=True)
        return res.stdout.strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _node_a(args: argparse.Namespace) -> int:
    """Prefills the prefix and persists it to the remote tier."""
    from ..model import runner as model_runner

    runner = model_runner.load(args.model)
    toks = document_tokens(runner, args.tokens)
    eng = runner.engine(remote_addrs=f"127.0.0.1:{args.node_a}", remote_timeout_ms=30000)
    try:
        seq = eng.sequence()
        runner.prefill(seq, toks)
        seq.persist()
        uploaded = eng.stats().remote_uploads
    finally:
        eng.close()
    full = len(toks) // runner.block_tokens
    if uploaded != full:
        print(f"node A uploaded {uploaded} of {full} blocks", file=sys.stderr)
        return 1
    return 0


def run_bench(args: argparse.Namespace, log=None) -> List[Dict[str, Any]]:
    import numpy as np

    from ..model import runner as model_runner

    runner = model_runner.load(args.model)
    bt = runner.block_tokens
    n = max(2 * bt, (args.tokens // bt) * bt)
    toks = document_tokens(runner, n)
    workdir = Path(tempfile.mkdtemp(prefix="kvh-bench-remote-", dir=args.tmp_dir))
    redis = _Redis(workdir)
    addrs = f"127.0.0.1:{redis.port}"
    remote_ms: List[float] = []
    recompute_ms: List[float] = []
    reused_tokens = 0
    try:
        # Warm-up: one-time costs (BLAS set-up, first touch of the weights).
        warm = runner.engine()
        runner.prefill(warm.sequence(), toks[: 2 * bt])
        warm.close()
        for rep in range(args.reps):
            redis.cli("FLUSHALL")
            cmd = [sys.executable, "-m", "kvh_cache.demo.bench_remote", "--node-a", str(redis.port), "--tokens", str(n)]
            cmd += ["--model", args.model] if args.model else []
            if subprocess.run(cmd).returncode != 0:
                raise RuntimeError("node A failed")
            order = ("remote", "recompute") if rep % 2 == 0 else ("recompute", "remote")
            logits: Dict[str, Any] = {}
            for what in order:
                eng = (
                    runner.engine(remote_addrs=addrs, remote_timeout_ms=30000) if what == "remote" else runner.engine()
                )
                seq = eng.sequence()
                t0 = time.perf_counter()
                if what == "remote":
                    logits[what], reused = runner.prefill_cached(seq, toks)
                else:
                    logits[what] = runner.prefill(seq, toks)
                ms = (time.perf_counter() - t0) * 1e3
                if what == "remote":
                    remote_ms.append(ms)
                    reused_tokens = reused
                    hits = eng.stats().remote_hits
                    if reused != n - 1 or hits != n // bt:
                        raise RuntimeError(f"node B reused {reused} of {n} tokens ({hits} remote hits)")
                else:
                    recompute_ms.append(ms)
                eng.close()
            if int(np.argmax(logits["remote"])) != int(np.argmax(logits["recompute"])):
                raise RuntimeError("node B's next token differs between the remote prefix and recomputing it")
            if log:
                log(f"round {rep + 1}/{args.reps}: remote {remote_ms[-1]:.0f} ms, recompute {recompute_ms[-1]:.0f} ms")
    finally:
        redis.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    r, c = statistics.median(remote_ms), statistics.median(recompute_ms)
    return [
        {
            "scenario": "remote",
            "metric": "node_b_ttft",
            "prefix_tokens": n,
            "reused_tokens": reused_tokens,
            "value": round(r, 1),
            "unit": "ms",
            "baseline": round(c, 1),
            "ratio": round(r / c, 3),
            "target": "ratio <= 0.3",
            "met": r / c <= 0.3,
            "reps": args.reps,
            "remote_ms": [round(x, 1) for x in remote_ms],
            "recompute_ms": [round(x, 1) for x in recompute_ms],
            "note": "node B, empty local store: prefix from the remote tier (one loopback Redis) + last token, "
            "vs prefilling the whole prefix (SmolLM2-135M, CPU, f32 KV)",
        }
    ]


def build_parser(prog: str = "python -m kvh_cache.demo.bench_remote") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1024, help="prefix tokens (default 1024; --quick 256)")
    p.add_argument("--reps", type=int, default=None, help="rounds (default 3; --quick 1)")
    p.add_argument("--quick", action="store_true", help="a short prefix, one round")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--strict", action="store_true", help="exit 1 when the target is missed")
    p.add_argument("--model", default=None, help="GGUF path (default: SmolLM2-135M-Instruct)")
    p.add_argument("--tmp-dir", default=None, help="where the server's directory goes")
    p.add_argument("--node-a", type=int, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.node_a is not None:
        return _node_a(args)
    if args.quick:
        args.tokens = min(args.tokens, 256)
    if args.reps is None:
        args.reps = 1 if args.quick else 3
    if args.reps < 1 or args.tokens < 1:
        print("bench remote: --reps and --tokens must be >= 1", file=sys.stderr)
        return 2
    from ..model.runner import ModelFileError

    try:
        rows = run_bench(args, log=None if args.json else lambda s: print(s, file=sys.stderr))
    except ModelFileError as exc:  # a file that is not a usable GGUF: a failure, not a usage error
        print(f"bench remote: --model: {exc}", file=sys.stderr)
        return 1
    for row in rows:
        if args.json:
            print(json.dumps(row))
        else:
            print(
                f"node B time to first token, {row['prefix_tokens']}-token prefix: remote {row['value']} ms, "
                f"recompute {row['baseline']} ms, ratio {row['ratio']} ({row['target']}: "
                f"{'met' if row['met'] else 'MISSED'}); medians of {row['reps']}"
            )
    missed = [r for r in rows if "met" in r and not r["met"]]
    if missed and args.strict:
        print("bench remote: target missed: " + ", ".join(str(r["target"]) for r in missed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
