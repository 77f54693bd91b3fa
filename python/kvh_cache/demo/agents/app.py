"""The run of ``kvh demo``: the model, the workload on kvh and on the
baselines, the restart, the capacity probes, then the report."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import sys
import time
from pathlib import Path
from typing import Any, Dict, IO, List, Optional, Sequence as Seq, Tuple

from ... import errors
from ..._progress import human_bytes
from ..store_files import empty_for_fresh
from .configs import Setup, SetupResult, choose_setups
from .corpus import RetrieverUnavailable, load_corpus
from .loading import BadModelFile, ModelUnavailable, load_runner
from .measure import probe_capacity
from .options import add_arguments, chosen_baselines, fill_defaults, validate
from .plot import write_plot
from .report import json_default, json_rows, render, summarize
from .restart import returning_child, run_returning
from .session import run_setup
from .trace import Tracer
from .workload import Workload

__all__ = ["log", "main", "run"]


def log(msg: str) -> None:
    print(f"kvh demo: {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace, out: Optional[IO[str]] = None) -> int:
    out = out or sys.stdout
    fill_defaults(args)
    if args.returning is not None:
        return returning_child(args.returning)
    problem = validate(args)
    if problem:
        print(f"kvh demo: {problem}", file=sys.stderr)
        return 2
    t_all = time.perf_counter()
    try:
        runner = load_runner(args.model, log)
    except ModelUnavailable as exc:
        print(f"kvh demo: {exc}", file=sys.stderr)
        return 3
    except BadModelFile as exc:
        print(f"kvh demo: --model: {exc}", file=sys.stderr)
        return 1
    load_s = time.perf_counter() - t_all
    # The disk budget must hold one slot of this model's blocks (f32 K and
    # V of every layer): refused before the data directory is touched.
    from ..synthetic import disk_budget_refusal

    refusal = disk_budget_refusal(args.disk_budget, runner.block_bytes, "this model")
    if refusal:
        print(f"kvh demo: {refusal}", file=sys.stderr)
        return 2
    notes: List[str] = []
    data_dir = Path(args.data_dir)
    if args.fresh and not empty_for_fresh(data_dir / "store", "kvh demo"):
        return 1
    from ..synthetic import make_data_dir

    why = make_data_dir(data_dir)
    if why:
        print(f"kvh demo: --data-dir {data_dir}: {why}", file=sys.stderr)
        return 1
    corpus = load_corpus()
    try:
        work = Workload(args, runner, corpus, notes, data_dir)
    except RetrieverUnavailable as exc:
        print(f"kvh demo: {exc}", file=sys.stderr)
        return 3
    try:
        kvh_setup, base_setups, sizing = choose_setups(work, data_dir, chosen_baselines(args))
    except ValueError as exc:
        print(f"kvh demo: {exc}", file=sys.stderr)
        return 2
    tracer = Tracer(args.record_trace)
    try:
        results, restart, probes = measure(work, kvh_setup, base_setups, sizing, data_dir, tracer, notes)
    except errors.MismatchError as exc:
        print(
            f"kvh demo: --data-dir {data_dir}: the store there was made with another model or geometry "
            f"({errors.without_reset_advice(exc.message)}); pass --fresh to empty it and start over, "
            "or use another --data-dir",
            file=sys.stderr,
        )
        return 1
    except errors.NoSpaceError as exc:
        print(
            f"kvh demo: the tiers are too small for this workload ({exc.message}); raise --device-budget / "
            "--host-budget / --disk-budget",
            file=sys.stderr,
        )
        return 1
    finally:
        try:
            work.index.close()
        except Exception:
            pass
    seconds = time.perf_counter() - t_all
    summary = summarize(work, results, restart, probes, sizing, load_s, seconds, tracer, notes)
    report(args, summary, results, restart, data_dir, out)
    return 0 if summary["ok"] else 1


def measure(
    work: Workload,
    kvh_setup: Setup,
    base_setups: Dict[str, Setup],
    sizing: Dict[str, Any],
    data_dir: Path,
    tracer: Tracer,
    notes: List[str],
) -> Tuple[Dict[str, SetupResult], Optional[Dict[str, Any]], Dict[str, Dict[str, Any]]]:
    """The workload on kvh (traced) and on each baseline, the restart and
    the capacity probes: (results by configuration, restart, probes)."""
    args = work.args
    store = data_dir / "store"
    results: Dict[str, SetupResult] = {}
    restart = None
    try:
        log(
            f"kvh: {len(work.plan)} requests from {args.agents} agents over {len(work.corpus)} articles; tiers: "
            f"device {human_bytes(kvh_setup.device_bytes)}, host {human_bytes(kvh_setup.host_bytes)}, "
            f"disk {human_bytes(kvh_setup.disk_bytes)} at {store} (this run's KV: {sizing['total']} blocks, "
            f"{human_bytes(sizing['total'] * work.block_bytes)})"
        )
        res, corpus_kv = run_setup(work, kvh_setup, None, tracer, want_corpus_kv=bool(base_setups))
    finally:
        tracer.close()
    results["kvh"] = res
    for name, setup in base_setups.items():
        log(f"baseline {name}: device {human_bytes(setup.device_bytes)}, host {human_bytes(setup.host_bytes)}")
        results[name], _ = run_setup(work, setup, corpus_kv, tracer)
    corpus_kv = None
    if not args.no_restart and kvh_setup.disk_path is not None:
        log("restart: a new process reopens the store for a returning agent ...")
        restart = run_returning(work, results["kvh"], data_dir, base_setups)
    log("probing how much KV each configuration holds before refusing ...")
    probes = probe_configurations(work.runner, kvh_setup, data_dir, notes)
    return results, restart, probes


def probe_configurations(runner, kvh_setup: Setup, data_dir: Path, notes: List[str]) -> Dict[str, Dict[str, Any]]:
    """The longest sequence each configuration decodes, at kvh's budgets:
    device only, device + host (attending in the device tier), and all
    three tiers with kvh's streamed attention."""
    probes: Dict[str, Dict[str, Any]] = {}
    probes["monolithic"] = probe_capacity(runner, kvh_setup.device_bytes, 0)
    probes["sync-offload"] = probe_capacity(runner, kvh_setup.device_bytes, kvh_setup.host_bytes)
    # A directory of its own: a fixed name could be the user's.
    probe_dir = Path(tempfile.mkdtemp(prefix="probe-store-", dir=data_dir))
    try:
        probes["kvh"] = probe_capacity(
            runner,
            kvh_setup.device_bytes,
            kvh_setup.host_bytes,
            kvh_setup.disk_bytes,
            probe_dir,
            buffered=True,
            stream=True,
        )
    except (errors.UnsupportedError, errors.KvhIOError) as exc:
        notes.append(f"max-context probe of the disk tier failed: {exc}")
    finally:
        shutil.rmtree(probe_dir, ignore_errors=True)
    return probes


def report(
    args: argparse.Namespace,
    summary: Dict[str, Any],
    results: Dict[str, SetupResult],
    restart: Optional[Dict[str, Any]],
    data_dir: Path,
    out: IO[str],
) -> None:
    """The plot, DATA_DIR/demo-result.json, and the JSON rows or the text
    report on ``out``."""
    plot_path = None
    if not args.no_plot:
        plot_path = write_plot(args.plot or data_dir / "demo.png", results, restart)
        if plot_path is None:
            summary["notes"].append("no plot: matplotlib is not installed (pip install 'kvh-cache[plot]')")
    summary["plot"] = str(plot_path) if plot_path else None
    (data_dir / "demo-result.json").write_text(json.dumps(summary, indent=1, default=json_default))
    if args.json:
        for row in json_rows(summary):
            out.write(json.dumps(row, default=json_default) + "\n")
    else:
        out.write(render(summary) + "\n")
    out.flush()


# ---------------------------------------------------------------------------------
# python -m kvh_cache.demo.agents
# ---------------------------------------------------------------------------------
def main(argv: Optional[Seq[str]] = None) -> int:
    from .. import agents

    p = argparse.ArgumentParser(
        prog="python -m kvh_cache.demo.agents",
        description=agents.__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    args = p.parse_args(argv)
    if args.synthetic:
        p.error("--synthetic: use `kvh demo --synthetic`")
    return run(args)
