"""benchmarks/plot.py and benchmarks/update_results.py: the plots of
`make bench` and the regenerated tables of benchmarks/RESULTS.md."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


plot = _load("plot")
update_results = _load("update_results")


def _rows():
    rows = [
        {
            "scenario": "scale",
            "metric": "touch",
            "value": 100.0 * (i + 1),
            "unit": "ns/op",
            "blocks": n,
            "baseline": 100.0,
            "ratio": 1 / (i + 1),
        }
        for i, n in enumerate((1000, 10000))
    ]
    rows += [
        {
            "scenario": "scale",
            "metric": "agent_ops",
            "value": 1e6,
            "unit": "ops/s",
            "threads": t,
            "baseline": 1e6,
            "ratio": 1.0,
        }
        for t in (1, 2)
    ]
    for b in (5, 10):
        for pol, dev in (("min", 0.5), ("lru", 0.2), ("kvh-engine", 0.3)):
            for m, v in (("hit_rate_device", dev), ("hit_rate_memory", dev + 0.3), ("inbound_per_access", 1 - dev)):
                r = {
                    "scenario": "trace",
                    "metric": m,
                    "value": v,
                    "unit": "fraction",
                    "trace": "agents",
                    "policy": pol,
                    "budget": b,
                    "device_blocks": b * 10,
                    "host_blocks": b * 20,
                }
                if pol != "min":
                    r.update(baseline=0.5, ratio=v / 0.5)
                if pol == "kvh-engine" and m == "hit_rate_device":
                    r.update(target="ratio >= 0.9", met=False)
                rows.append(r)
    rows.append(
        {
            "scenario": "trace",
            "metric": "trace_accesses",
            "value": 1000,
            "unit": "accesses",
            "trace": "agents",
            "blocks": 100,
            "sequences": 7,
        }
    )
    rows += [
        {
            "scenario": "attention",
            "metric": "decode_throughput",
            "value": 4.0,
            "unit": "GB/s",
            "layout": "paged",
            "context": c,
            "baseline": 4.2,
            "ratio": 0.95,
        }
        for c in (1024, 4096)
    ]
    return rows


def _write(tmp_path: Path) -> Path:
    d = tmp_path / "res"
    d.mkdir()
    by = {}
    for r in _rows():
        by.setdefault(r["scenario"], []).append(r)
    for name, rs in by.items():
        (d / f"{name}.jsonl").write_text("not json\n" + "\n".join(json.dumps(r) for r in rs) + "\n")
    return d


def test_load_rows_skips_other_lines(tmp_path):
    d = _write(tmp_path)
    rows = plot.load_rows(sorted(d.glob("*.jsonl")))
    assert len(rows) == len(_rows())


def test_series_takes_the_median_per_x():
    rows = [{"x": 1, "value": v} for v in (1.0, 5.0, 3.0)] + [{"x": 2, "value": 7.0}, {"x": 3}]
    assert plot.series(rows, "x") == ([1.0, 2.0], [3.0, 7.0])


def test_plots_are_written_for_the_data_present(tmp_path):
    pytest.importorskip("matplotlib")
    d = _write(tmp_path)
    out = tmp_path / "plots"
    assert plot.main(["--out", str(out)] + [str(p) for p in sorted(d.glob("*.jsonl"))]) == 0
    names = sorted(p.name for p in out.glob("*.png"))
    # No migrate/disk or offload rows: those plots are not made.
    assert names == ["attention_vs_context.png", "hit_rate_vs_budget.png", "scale.png"]
    assert all((out / n).stat().st_size > 1000 for n in names)


def test_plot_refuses_a_missing_file(tmp_path):
    pytest.importorskip("matplotlib")
    assert plot.main(["--out", str(tmp_path), str(tmp_path / "nope.jsonl")]) == 2


def test_update_results_replaces_only_marked_blocks(tmp_path):
    d = _write(tmp_path)
    results = tmp_path / "RESULTS.md"
    results.write_text(
        "# title\nprose stays\n<!-- generated: trace -->\nOLD-TABLE\n<!-- end generated: trace -->\n"
        "between\n<!-- generated: offload -->\nkept: no data\n<!-- end generated: offload -->\n"
    )
    assert update_results.main([str(d), "--results", str(results)]) == 0
    text = results.read_text()
    assert "prose stays" in text and "between" in text
    assert "OLD-TABLE" not in text
    assert "kept: no data" in text  # no offload.jsonl in d
    assert "**agents** (1,000 accesses, 100 blocks, 7 sequences)" in text
    # kvh-engine's device ratio 0.6 missed its target: flagged.
    assert "**0.3 (0.6) / 0.6 (1.2); in 0.7 (1.4); all ** missed" in text


def test_scripts_have_help():
    for script in ("plot.py", "update_results.py", "summarize.py"):
        res = subprocess.run(
            [sys.executable, str(REPO / "benchmarks" / script), "--help"], capture_output=True, text=True, timeout=60
        )
        assert res.returncode == 0, res.stderr
        assert "usage" in res.stdout.lower()
    res = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "run-bench.sh"), "--help"], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0 and "--quick" in res.stdout
