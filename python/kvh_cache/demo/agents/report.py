"""What ``kvh demo`` reports: the summary of every configuration's run,
the JSON rows (DESIGN.md's benchmark format), and the text report with
the seed's trade-off table."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from ..._progress import human_bytes, table
from .configs import SetupResult
from .loading import MODEL_NAME
from .trace import Tracer
from .workload import Workload

__all__ = ["CONFIGS", "MetricRows", "json_default", "json_rows", "render", "summarize", "tradeoff_table"]

CONFIGS = ("monolithic", "sync-offload", "kvh")


def json_default(o: Any) -> Any:
    """``json.dumps(default=...)`` of the summary: paths, NumPy scalars."""
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _rate(st: Dict[str, int], key: str) -> float:
    return st[key] / st["lookups"] if st.get("lookups") else 0.0


def summarize(
    work: Workload,
    results: Dict[str, SetupResult],
    restart: Optional[Dict[str, Any]],
    probes: Dict[str, Dict[str, Any]],
    sizing: Dict[str, Any],
    load_s: float,
    seconds: float,
    tracer: Tracer,
    notes: List[str],
) -> Dict[str, Any]:
    args = work.args
    k = results["kvh"]
    c = work.runner.config
    configs: Dict[str, Any] = {}
    for name, r in results.items():
        st = r.stats_agents
        configs[name] = {
            "device_bytes": r.setup.device_bytes,
            "host_bytes": r.setup.host_bytes,
            "disk_bytes": r.setup.disk_bytes if r.setup.disk_path else 0,
            "migration_threads": r.setup.migration_threads,
            "prefetch": r.setup.prefetch,
            "pinned_system_prompt": r.setup.pin_system,
            "sync_offload": r.setup.sync_offload,
            "ttft_ms_mean": r.ttft_mean_ms(),
            "ttft_ms_p50": r.ttft_p50_ms(),
            "itl_ms_p50": r.itl_p50_ms(),
            "itl_ms_mean": r.itl_mean_ms(),
            "itl_ms_p90": r.itl_p90_ms(),
            "decode_step_ms": r.decode_step_ms,
            "kv_ms_per_token": r.kv_ms_per_token,
            "tiers_end": r.tiers_end,
            "tiers_peak_blocks": r.tiers_peak,
            "peak_bytes": {t: n * work.block_bytes for t, n in r.tiers_peak.items()},
            "stats_agents": st,
            "stats_total": r.stats_total,
            "hit_rates": {
                "device": _rate(st, "hits_device"),
                "host": _rate(st, "hits_host"),
                "disk": _rate(st, "hits_disk"),
            },
            "fragmentation": r.fragmentation,
            "system_prompt": r.system_blocks,
            "ingest": r.ingest,
            "persist": r.persist,
            "seconds": r.seconds,
            "attention": r.attention,
            "notes": r.notes,
            "requests": [q.to_json(work.corpus) for q in r.requests],
            "max_context_tokens": probes.get(name, {}).get("tokens"),
        }
    # answers identical across configurations (same requests, greedy)?
    same = all(all(a.tokens == b.tokens for a, b in zip(r.requests, k.requests)) for r in results.values())
    # model vs cache: where a decode step's time goes (kvh run)
    kvms = k.kv_ms_per_token
    model_ms = k.decode_step_ms - kvms["manage"] - kvms["attend"] - kvms["offload"]
    ok = True
    for q in k.requests:
        if not q.tokens:
            ok = False
    if restart is not None and not restart.get("ok"):
        ok = False
    all_notes = list(notes) + [n for r in results.values() for n in r.notes]
    if k.ingest.get("reused_tokens"):
        all_notes.append(
            f"the store already held KV of an earlier run ({k.ingest['reused_tokens']:,} library tokens "
            "and earlier conversations were reused; the baselines start empty): use --fresh for a "
            "cold start"
        )
    return {
        "ok": ok,
        "seconds": seconds,
        "model_load_seconds": load_s,
        "model": {
            "name": MODEL_NAME if args.model is None else Path(args.model).name,
            "path": work.runner.path,
            "layers": c.n_layers,
            "kv_heads": c.n_kv_heads,
            "head_dim": c.head_dim,
            "dtype": "f32",
            "block_tokens": work.bt,
            "block_bytes": work.block_bytes,
            "token_bytes": work.token_bytes,
            "attention": k.attention,
        },
        "workload": {
            "agents": args.agents,
            "questions": args.questions,
            "requests": len(work.plan),
            "gen_tokens": args.gen_tokens,
            "docs": len(work.corpus),
            "docs_per_question": args.docs_per_question,
            "ingest": args.ingest,
            "system_prompt_tokens": len(work.prompts.system),
            "doc_tokens": {d.name: len(work.prompts.doc_first[d.id]) for d in work.corpus},
            "retriever": work.index_name,
            "hints": args.hints,
            "queue_hints": args.queue_hints,
            "seed": args.seed,
        },
        "sizing": sizing,
        "data_dir": str(args.data_dir),
        "configs": configs,
        "answers_identical": same,
        "decode_split_ms": {
            "step": k.decode_step_ms,
            "model": model_ms,
            "kv_manage": kvms["manage"],
            "attention": kvms["attend"],
            "offload": kvms["offload"],
        },
        "runner_decode_tokens_per_s": 1e3 / model_ms if model_ms > 0 else None,
        "restart": restart,
        "probes": probes,
        "trace": {"path": str(args.record_trace), "lines": tracer.lines} if args.record_trace else None,
        "notes": all_notes,
    }


class MetricRows:
    """The JSON rows of one summary as :meth:`add` makes them: each with the
    ``common`` parameters, and a baseline and its ratio where given."""

    def __init__(self, common: Dict[str, Any]) -> None:
        self.common = common
        self.rows: List[Dict[str, Any]] = []

    def add(
        self,
        metric: str,
        value: Any,
        unit: str,
        config: Optional[str] = None,
        baseline: Any = None,
        higher_better: bool = False,
        target: Optional[str] = None,
        **extra: Any,
    ) -> None:
        if value is None or value != value:  # not measured in this run (e.g. no prefetch issued)
            return
        r: Dict[str, Any] = {"scenario": "demo", "metric": metric, "value": _round(value), "unit": unit}
        if config:
            r["config"] = config
        r.update(self.common)
        r.update(extra)
        if baseline is not None and value is not None and value == value and baseline == baseline and baseline:
            r["baseline"] = _round(baseline)
            ratio = (value / baseline) if higher_better else (baseline / value if value else None)
            r["ratio"] = _round(ratio)
            if target is not None:
                r["target"] = target
                m = re.match(r"ratio (>=|<=) ([0-9.]+)", target)
                if m and ratio is not None:
                    bound = float(m.group(2))
                    r["met"] = ratio >= bound if m.group(1) == ">=" else ratio <= bound
        self.rows.append(r)


def json_rows(s: Dict[str, Any]) -> List[Dict[str, Any]]:
    """DESIGN.md's benchmark rows: scenario, metric, value, unit, the varying
    parameters, and baseline + ratio (oriented so that higher is better:
    baseline/ours for latencies, ours/baseline for capacities)."""
    cf = s["configs"]
    w = s["workload"]
    common = {
        "agents": w["agents"],
        "requests": w["requests"],
        "gen_tokens": w["gen_tokens"],
        "device_budget": s["sizing"]["device_bytes"],
        "model": s["model"]["name"],
    }
    out = MetricRows(common)
    row = out.add

    mono = cf.get("monolithic")
    for name in CONFIGS:
        c = cf.get(name)
        if c is None:
            continue
        ref = mono if name != "monolithic" else None
        row("ttft", c["ttft_ms_mean"], "ms", name, ref and ref["ttft_ms_mean"])
        row(
            "itl",
            c["itl_ms_p50"],
            "ms",
            name,
            ref and ref["itl_ms_p50"],
            target="ratio >= 0.769" if name == "kvh" else None,
            stat="p50",
            note="ratio = all-in-device / ours; >= 0.769 means ours <= 1.3x" if name == "kvh" else None,
        )
        row("itl_mean", c["itl_ms_mean"], "ms", name, ref and ref["itl_ms_mean"])
        row(
            "decode_step_kv_ms",
            c["kv_ms_per_token"]["manage"] + c["kv_ms_per_token"]["attend"] + c["kv_ms_per_token"]["offload"],
            "ms",
            name,
        )
        if c.get("max_context_tokens") is not None:
            row(
                "max_context",
                c["max_context_tokens"],
                "tokens",
                name,
                s["probes"].get("monolithic", {}).get("tokens") if name != "monolithic" else None,
                higher_better=True,
            )
        f = c["fragmentation"]
        row("fragmentation", f["ratio"], "allocated/used", name, None, layout="paged")
        if name == "monolithic":
            row(
                "fragmentation",
                f["unpaged_ratio"],
                "allocated/used",
                name,
                None,
                layout="contiguous",
                note=f"computed: {f['unpaged_reserve_tokens']} tokens reserved per sequence, no sharing",
            )
        row("peak_device", c["peak_bytes"]["device"], "bytes", name)
        row("peak_host", c["peak_bytes"]["host"], "bytes", name)
        row("peak_disk", c["peak_bytes"]["disk"], "bytes", name)
    sync = cf.get("sync-offload")
    k = cf["kvh"]
    if sync is not None:
        row(
            "itl_vs_sync_offload",
            k["itl_ms_p50"],
            "ms",
            "kvh",
            sync["itl_ms_p50"],
            stat="p50",
            note="baseline = synchronous offload; ratio = sync / ours",
        )
    st = k["stats_agents"]
    for tier in ("device", "host", "disk"):
        row(f"hit_rate_{tier}", k["hit_rates"][tier], "fraction", "kvh")
    for key in (
        "prefetch_issued",
        "prefetch_useful",
        "prefetch_late",
        "prefetch_wasted",
        "prefix_hit_tokens",
        "evictions",
        "lookups",
    ):
        row(key, st[key], "count", "kvh")
    row(
        "prefetch_accuracy",
        st["prefetch_useful"] / st["prefetch_issued"] if st["prefetch_issued"] else None,
        "fraction",
        "kvh",
    )
    for key in ("bytes_device_to_host", "bytes_host_to_device", "bytes_host_to_disk", "bytes_disk_to_host"):
        row(key, st[key], "bytes", "kvh")
    row("acquire_stall", st["acquire_stall_ns"] / 1e6, "ms", "kvh")
    sp = k["system_prompt"]
    if sp.get("refs"):
        row("system_prompt_refs", sp["refs"], "sequences", "kvh", physical_copies=1)
    rs = s.get("restart")
    if rs and "ttft_disk_ms" in rs:
        row(
            "ttft_returning_from_disk",
            rs["ttft_disk_ms"],
            "ms",
            "kvh",
            rs["ttft_recompute_ms"],
            target="ratio >= 5",
            note="baseline = recomputing the prompt; ratio = recompute / disk (>= 5 means <= 0.2x)",
            prompt_tokens=rs["prompt_tokens"],
            matched_tokens=rs["matched_tokens"],
        )
        row("ttft_recompute", rs["ttft_recompute_ms"], "ms", "recompute", prompt_tokens=rs["prompt_tokens"])
        row("restart_prefix_tokens", rs["matched_tokens"], "tokens", "kvh", prompt_tokens=rs["prompt_tokens"])
        for name, n in rs.get("baseline_matched_tokens", {}).items():
            row("restart_prefix_tokens", n, "tokens", name, prompt_tokens=rs["prompt_tokens"])
        row("restart_open_store", rs["open_ms"], "ms", "kvh")
    if s.get("runner_decode_tokens_per_s"):
        row(
            "runner_decode",
            s["runner_decode_tokens_per_s"],
            "tokens/s",
            "model",
            note="decode step minus time in the KV backend (kvh run)",
        )
    d = s["decode_split_ms"]
    for part in ("step", "model", "kv_manage", "attention"):
        row(f"decode_{part}", d[part], "ms", "kvh")
    row("demo_seconds", s["seconds"], "s")
    return [{k2: v for k2, v in r.items() if v is not None} for r in out.rows]


def _round(x: Any) -> Any:
    if isinstance(x, float):
        if x != x:
            return None
        return float(f"{x:.6g}")
    return x


def _f(x: Optional[float], fmt: str = "{:.1f}") -> str:
    if x is None or x != x:
        return "-"
    return fmt.format(x)


def _wrap(text: str, width: int, indent: str) -> List[str]:
    import textwrap

    return textwrap.wrap(text, width=width, initial_indent=indent, subsequent_indent=indent) or [indent]


def render(s: Dict[str, Any]) -> str:
    """The report of a summary, as text."""
    parts: List[str] = []
    _render_setup(s, parts)
    _render_agents(s, parts)
    _render_engine(s, parts)
    _render_restart(s, parts)
    _render_comparison(s, parts)
    return "\n".join(parts)


def _render_setup(s: Dict[str, Any], parts: List[str]) -> None:
    """The model, the workload, the tiers and the library."""
    k = s["configs"]["kvh"]
    m = s["model"]
    w = s["workload"]
    z = s["sizing"]
    bb = m["block_bytes"]
    parts.append(
        f"kvh demo: {w['agents']} agents x {w['questions']} questions over {w['docs']} articles, "
        f"{m['name']} ({m['layers']} layers, {m['kv_heads']} KV heads x {m['head_dim']}, f32 KV: "
        f"{human_bytes(m['token_bytes'])}/token, {human_bytes(bb)}/block of {m['block_tokens']} tokens), "
        f"greedy, up to {w['gen_tokens']} tokens per answer; retriever: {w['retriever']}; "
        f"attention: {m['attention']}"
    )
    parts.append(
        f"tiers (kvh): device {human_bytes(z['device_bytes'])} ({z['device_bytes'] // bb} blocks = "
        f"{100 * z['device_fraction']:.0f}% of this run's {z['total']} blocks of KV, "
        f"{human_bytes(z['total'] * bb)}), host {human_bytes(z['host_bytes'])}, disk "
        f"{human_bytes(z['disk_bytes'])} under {s['data_dir']}/store"
    )
    ing = k["ingest"]
    sp = k["system_prompt"]
    parts.append("")
    parts.append(
        f"Library: system prompt {w['system_prompt_tokens']} tokens; {w['docs']} articles of "
        f"{min(w['doc_tokens'].values())}-{max(w['doc_tokens'].values())} tokens. KV computed "
        f"{ing['computed_tokens']:,} tokens in {ing['seconds']:.1f} s, found in the store "
        f"{ing['reused_tokens']:,} tokens."
    )
    if sp.get("refs"):
        parts.append(
            f"System prompt: {sp['full_blocks']} full blocks pinned in the {sp['tier']} tier, 1 physical "
            f"copy referenced by {sp['refs']} sequences ({human_bytes(sp['bytes_saved'])} not duplicated)."
        )


def _by_tier(t: Optional[Dict[str, int]]) -> str:
    return "-" if not t else f"{t.get('device', 0)}/{t.get('host', 0)}/{t.get('disk', 0)}"


def _render_agents(s: Dict[str, Any], parts: List[str]) -> None:
    """The kvh run's requests and their answers."""
    k = s["configs"]["kvh"]
    rows = []
    for q in k["requests"]:
        pre = "-" if q["predicted"] is None else ("yes" if q["predicted"][:1] == q["docs"][:1] else "no")
        rows.append(
            [
                q["agent"],
                q["turn"] + 1,
                ", ".join(q["docs"]),
                pre,
                _by_tier(q.get("article_tiers_at_hint")),
                f"{q['matched_tokens']} ({_by_tier(q['matched_tiers'])})",
                q["prefilled_tokens"],
                _f(q["ttft_ms"], "{:.0f}"),
                _f(q["itl_ms_mean"]),
                q["generated_tokens"],
            ]
        )
    parts += [
        "",
        table(
            rows,
            [
                "agent",
                "q",
                "article (retrieved)",
                "hinted",
                "article at hint",
                "prefix reused at request",
                "prefilled",
                "TTFT ms",
                "ITL ms",
                "tokens",
            ],
            title="Agents (kvh run): time to first token, inter-token latency; blocks by tier as device/host/disk",
            align="rrllrrrrrr",
        ),
    ]
    parts.append("")
    parts.append("Answers:")
    for q in k["requests"]:
        parts += _wrap(f"agent {q['agent']}: {q['question']}", 110, "  ")
        parts += _wrap("-> " + (q["answer"] or "(empty)"), 110, "     ")
    if not s["answers_identical"]:
        parts.append("note: the baselines' answers differ from kvh's in some requests (float rounding near a tie)")


def _render_engine(s: Dict[str, Any], parts: List[str]) -> None:
    """The kvh run's tiers, engine counters and decode time."""
    k = s["configs"]["kvh"]
    rows = []
    for tier in ("device", "host", "disk"):
        t = k["tiers_end"].get(tier, {})
        if not t.get("capacity_blocks"):
            continue
        rows.append(
            [
                tier,
                t["capacity_blocks"],
                k["tiers_peak_blocks"][tier],
                t["used_blocks"],
                t["pinned_blocks"],
                human_bytes(t["used_bytes"]),
            ]
        )
    parts += [
        "",
        table(
            rows,
            ["tier", "capacity", "peak used", "used at end", "pinned", "bytes at end"],
            title="Tier occupancy (kvh, blocks)",
            align="lrrrrr",
        ),
    ]
    st = k["stats_agents"]
    hr = k["hit_rates"]
    rows = [
        ["block accesses (acquire/read/write)", f"{st['lookups']:,}"],
        [
            "hit rate device / host / disk",
            f"{100 * hr['device']:.1f}% / {100 * hr['host']:.1f}% / {100 * hr['disk']:.1f}%",
        ],
        [
            "prefix reuse: queries, blocks, tokens",
            f"{st['prefix_queries']}, {st['prefix_hit_blocks']}, {st['prefix_hit_tokens']:,}",
        ],
        [
            "prefetch issued / useful / late / wasted / skipped",
            f"{st['prefetch_issued']} / {st['prefetch_useful']} / {st['prefetch_late']} / {st['prefetch_wasted']} / "
            f"{st['prefetch_skipped']}",
        ],
        [
            "retriever predicted the article",
            f"{sum(1 for q in k['requests'] if q['predicted'] and q['predicted'][:1] == q['docs'][:1])}"
            f"/{len(k['requests'])} requests",
        ],
        ["evictions, drops", f"{st['evictions']:,}, {st['drops']:,}"],
        [
            "bytes device->host / host->device",
            f"{human_bytes(st['bytes_device_to_host'])} / {human_bytes(st['bytes_host_to_device'])}",
        ],
        ["device<->host moves without a copy (one arena)", f"{st.get('blocks_moved_in_place', 0):,} blocks"],
        [
            "bytes host->disk / disk->host",
            f"{human_bytes(st['bytes_host_to_disk'])} / {human_bytes(st['bytes_disk_to_host'])}",
        ],
        ["acquire stall (waiting for copies)", f"{st['acquire_stall_ns'] / 1e6:.1f} ms"],
    ]
    if k.get("persist"):
        rows.append(
            [
                "persisted for restart",
                f"{k['persist']['sequences']} sequences in {1e3 * k['persist']['seconds']:.0f} ms",
            ]
        )
    parts += ["", table(rows, ["engine counters during the agents' requests", "value"], align="ll")]
    d = s["decode_split_ms"]
    parts += [
        "",
        "Where a decode step goes (kvh run, mean per token): "
        f"{d['step']:.1f} ms = model {d['model']:.1f} ms (runner alone: "
        f"{_f(s['runner_decode_tokens_per_s'])} tokens/s) + kvh cache ops {d['kv_manage']:.1f} ms (append, "
        f"acquire, write K/V, release) + paged attention {d['attention']:.1f} ms.",
    ]


def _render_restart(s: Dict[str, Any], parts: List[str]) -> None:
    bb = s["model"]["block_bytes"]
    rs = s.get("restart")
    if rs is not None:
        parts.append("")
        if "ttft_disk_ms" in rs:
            parts.append(
                f"Restart: the engine was closed and a new process reopened the store ({rs['open_ms']:.0f} ms). "
                f'Agent {rs["agent"]} returns with a follow-up ("{rs["follow_up"]}"): prompt {rs["prompt_tokens"]} '
                f"tokens, {rs['matched_tokens']} of them found in the store ("
                f"{rs.get('bytes_disk_to_host', 0) // bb} blocks, {human_bytes(rs.get('bytes_disk_to_host', 0))} "
                f"read from disk and checksummed in {rs['match_ms']:.0f} ms), {rs['prefilled_tokens']} prefilled. "
                f"Time to first token "
                f"{rs['ttft_disk_ms']:.0f} ms vs {rs['ttft_recompute_ms']:.0f} ms recomputing it "
                f"({rs['ttft_disk_ms'] / rs['ttft_recompute_ms']:.3f}x). Same first token: "
                f"{'yes' if rs['first_token_equal'] else 'NO'}; same {rs['continuation_tokens']}-token "
                f"continuation: {'yes' if rs['tokens_equal'] else 'no'} (max |dlogit| {rs['max_abs_dlogit']:.1e})."
            )
            parts += _wrap("-> " + (rs["answer_disk"] or "(empty)"), 110, "     ")
        else:
            parts.append(f"Restart: FAILED: {rs.get('error')}")


def _render_comparison(s: Dict[str, Any], parts: List[str]) -> None:
    """The trade-off table, the target ratios, where the outputs went."""
    cf = s["configs"]
    k = cf["kvh"]
    rs = s.get("restart")
    parts += ["", tradeoff_table(s)]
    ratios = []
    mono, sync = cf.get("monolithic"), cf.get("sync-offload")
    if mono:
        r = k["itl_ms_p50"] / mono["itl_ms_p50"]
        ratios.append(f"ITL kvh / all-in-device = {r:.2f}x (target <= 1.3: {'met' if r <= 1.3 else 'MISSED'})")
    if rs and "ttft_disk_ms" in rs:
        r = rs["ttft_disk_ms"] / rs["ttft_recompute_ms"]
        ratios.append(
            f"TTFT returning from disk / recompute = {r:.3f}x (target <= 0.2: {'met' if r <= 0.2 else 'MISSED'})"
        )
    if sync:
        ratios.append(f"ITL sync offload / kvh = {sync['itl_ms_p50'] / k['itl_ms_p50']:.2f}x")
    if ratios:
        parts.append("Ratios: " + "; ".join(ratios) + ".")
    if s.get("plot"):
        parts.append(f"Plot: {s['plot']}")
    if s.get("trace"):
        parts.append(f"Trace: {s['trace']['path']} ({s['trace']['lines']:,} block accesses)")
    for n in dict.fromkeys(s["notes"]):
        parts.append(f"note: {n}")
    parts.append(
        f"{'OK' if s['ok'] else 'FAILED'}: {s['seconds']:.1f} s (model load {s['model_load_seconds']:.1f} s); "
        f"results in {s['data_dir']}/demo-result.json"
    )


# The trade-off table's cells: fn(summary, configuration name, its summary).
def _cell(s: Dict[str, Any], name: str, fn: Callable[[Dict[str, Any], str, Dict[str, Any]], str]) -> str:
    c = s["configs"].get(name)
    if c is None:
        return "not run (--baseline)"
    try:
        return fn(s, name, c)
    except (KeyError, TypeError, ZeroDivisionError):
        return "-"


def _max_context(s: Dict[str, Any], name: str, c: Dict[str, Any]) -> str:
    p = s["probes"].get(name)
    if not p:
        return "-"
    where = {"monolithic": "device only", "sync-offload": "device+host", "kvh": "device+host+disk, streamed"}[name]
    held = p.get("held_tokens", p["tokens"])
    kept = f", {held:,} held" if held != p["tokens"] else ""
    ms = f", {p['decode_ms']:.0f} ms/step" if "decode_ms" in p else ""
    return f"{p['tokens']:,} tok ({where}{kept}{ms})"


def _ttft(s: Dict[str, Any], name: str, c: Dict[str, Any]) -> str:
    return f"{c['ttft_ms_mean']:.0f} ms (p50 {c['ttft_ms_p50']:.0f})"


def _itl(s: Dict[str, Any], name: str, c: Dict[str, Any]) -> str:
    return f"{c['itl_ms_p50']:.1f} ms/tok (mean {c['itl_ms_mean']:.1f})"


def _memory(s: Dict[str, Any], name: str, c: Dict[str, Any]) -> str:
    pk = c["peak_bytes"]
    out = [f"dev {human_bytes(max(pk['device'], 0))}"]
    if c["host_bytes"]:
        out.append(f"host {human_bytes(pk['host'])}")
    if c["disk_bytes"]:
        out.append(f"disk {human_bytes(pk['disk'])}")
    return " + ".join(out)


def _fragmentation(s: Dict[str, Any], name: str, c: Dict[str, Any]) -> str:
    f = c["fragmentation"]
    return f"{100 * f['wasted_fraction']:.1f}% wasted (paged)"


def _resilience(s: Dict[str, Any], name: str, c: Dict[str, Any]) -> str:
    rs = s.get("restart") or {}
    if not rs or "matched_tokens" not in rs:
        return "-"
    if name == "kvh":
        return f"durable: {rs['matched_tokens']}/{rs['prompt_tokens']} tok on disk after restart"
    n = rs.get("baseline_matched_tokens", {}).get(name)
    return "volatile: " + (f"{n}/{rs['prompt_tokens']} tok after restart" if n is not None else "no disk tier")


def tradeoff_table(s: Dict[str, Any]) -> str:
    """The seed's trade-off matrix (4.2) with this run's numbers."""
    cf = s["configs"]
    rs = s.get("restart") or {}
    names = [n for n in CONFIGS]
    heads = {
        "monolithic": "Monolithic (all in device)",
        "sync-offload": "Naive sync offload",
        "kvh": "kvh (hierarchical)",
    }
    bb = s["model"]["block_bytes"]
    rows = [
        ["Max context (longest sequence decoded)"] + [_cell(s, n, _max_context) for n in names],
        ["Time to first token (agents, mean)"] + [_cell(s, n, _ttft) for n in names],
        ["Inter-token latency (p50)"] + [_cell(s, n, _itl) for n in names],
        ["Memory it used (peak blocks x " + human_bytes(bb) + ")"] + [_cell(s, n, _memory) for n in names],
        ["Fragmentation (allocated vs used)"] + [_cell(s, n, _fragmentation) for n in names],
        ["State resilience (returning agent)"] + [_cell(s, n, _resilience) for n in names],
    ]
    mono = cf.get("monolithic")
    if mono:
        f = mono["fragmentation"]
        rows[4][1] += f"; unpaged {100 * f['unpaged_wasted_fraction']:.0f}%*"
    if rs and "ttft_disk_ms" in rs:
        rows[1][3] += f"; returning from disk {rs['ttft_disk_ms']:.0f} vs recompute {rs['ttft_recompute_ms']:.0f} ms"
    text = table(
        rows,
        ["Dimension (seed 4.2)"] + [heads[n] for n in names],
        title="Trade-off matrix (seed section 4.2), measured in this run",
        align="llll",
    )
    foot = []
    if mono:
        reserve = mono["fragmentation"]["unpaged_reserve_tokens"]
        foot.append(
            f"* unpaged: computed for the same sequences with {reserve} "
            "contiguous tokens reserved per sequence (the longest request) and no sharing; the monolithic "
            "run itself uses kvh's paged device tier."
        )
    foot.append(
        "Max context: the longest single sequence each configuration decoded, at kvh's device/host/disk "
        "budgets (the monolithic run itself was given a device tier big enough for the whole run): a probe "
        "appends tokens until the engine refuses, then runs a decode step over what it can attend: the "
        "device tier's share where attention reads only the device tier, everything for kvh, whose "
        "attention streams the blocks on host and disk through a window in the device tier."
    )
    return text + "\n" + "\n".join(foot)
