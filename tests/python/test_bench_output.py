"""kvh-bench's rows and arguments (benchmarks/bench_util.c, bench_main.c,
the scenarios' checks): every JSON row parses and carries its strings
whole, whatever they hold; numbers are decimal; list values of any length
are read whole; a wrong argument is a usage error (exit 2) naming its
flag. And `kvh bench` fails on a row it cannot read instead of dropping
it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvh_cache.tools import find_tool

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 120


def _env(extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "python") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for k in [k for k in env if k.startswith("KVH_") and k not in ("KVH_BUILD_DIR", "KVH_BENCH")]:
        del env[k]
    env.update(extra or {})
    return env


def _bench_tool():
    tool = find_tool("kvh-bench")
    if tool is None:
        pytest.skip("kvh-bench not built")
    return tool


def run_bench(*args, env_extra=None):
    """stdout as bytes: a row must be UTF-8 before it can be JSON."""
    return subprocess.run(
        [_bench_tool(), *[a if isinstance(a, bytes) else str(a) for a in args]],
        capture_output=True,
        timeout=TIMEOUT,
        env=_env(env_extra),
        stdin=subprocess.DEVNULL,
    )


def json_rows(stdout: bytes):
    text = stdout.decode("utf-8")  # strict: a byte that is not UTF-8 fails here
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# The smallest generated traces: the recorded one is what is looked at.
SMALL_TRACE = ["--quick", "--json", "--replay", "0", "--agents", "1", "--turns", "1", "--queues", "2"]
SMALL_TRACE += ["--hint-turns", "0", "--device-pct", "50"]


@pytest.mark.parametrize(
    "name,shown",
    [
        ('quote"and\\backslash.trace', None),
        ("n" * 200 + ".trace", None),
        ("tab\tbell\x07del\x7f.trace", None),
        ("caf\u00e9 \u6f22\u5b57 \U0001f600.trace", None),
        (b"latin1-caf\xe9.trace", "latin1-caf\ufffd.trace"),
        (b"cut-\xe6\xbc.trace", "cut-\ufffd\ufffd.trace"),
        (b"overlong-\xc0\xaf.trace", "overlong-\ufffd\ufffd.trace"),
        (b"surrogate-\xed\xa0\x80.trace", "surrogate-\ufffd\ufffd\ufffd.trace"),
    ],
    ids=["quote-backslash", "long", "controls", "utf8", "latin1", "cut-utf8", "overlong", "surrogate"],
)
def test_recorded_trace_name_is_valid_json(tmp_path, name, shown):
    """A trace file's name goes into every row of it: it was printed
    between quotes as it was, and cut at 52 bytes, so that a quote, a
    backslash, a control character, a byte that is not UTF-8 or a long
    name made a row no JSON parser takes."""
    path = os.path.join(os.fsencode(tmp_path), name if isinstance(name, bytes) else os.fsencode(name))
    with open(path, "w") as f:
        f.write("0 0\n0 1\n0 0\n")
    res = run_bench("trace", *SMALL_TRACE, "--trace", path)
    assert res.returncode in (0, 3), res.stderr[-2000:]
    rows = json_rows(res.stdout)
    recorded = {r["trace"] for r in rows if r["trace"].startswith("recorded:")}
    assert recorded == {"recorded:" + (shown if shown is not None else name)}, recorded


def test_a_long_note_is_kept_whole(tmp_path):
    """A row's note was cut at 159 bytes: single_restore_latency_vs_scattered_raw's
    lost its end."""
    res = run_bench("disk", "--quick", "--json", "--dir", tmp_path, "--total-mb", "4", "--block-bytes", "65536")
    if res.returncode not in (0, 3) and b"O_DIRECT" in res.stderr:
        pytest.skip("no O_DIRECT here")
    assert res.returncode in (0, 3), res.stderr[-2000:]
    notes = [r["note"] for r in json_rows(res.stdout) if r["metric"] == "single_restore_latency_vs_scattered_raw"]
    assert notes and all(
        n.endswith("(ratio = raw/ours; no target: what the destination costs on this machine)") for n in notes
    ), notes


def _budgets(stdout: bytes):
    return sorted({r["budget"] for r in json_rows(stdout) if "budget" in r})


def test_numbers_are_decimal():
    """--device-pct 010 was octal 8, and 08 refused."""
    res = run_bench("trace", *SMALL_TRACE[:-2], "--device-pct", "010,08")
    assert res.returncode in (0, 3), res.stderr[-2000:]
    assert _budgets(res.stdout) == [8, 10]
    for bad in ("0x10", "1e2", " 5", "+5", "-5"):
        res = run_bench("trace", *SMALL_TRACE[:-2], "--device-pct", bad)
        assert res.returncode == 2 and b"--device-pct" in res.stderr, (bad, res.stderr)
    res = run_bench("codec", "--quick", "--json", "--reps", "010", "--seed", "0x10")
    assert res.returncode == 2 and b"bad value '0x10' for --seed" in res.stderr, res.stderr


def test_a_long_list_value_is_read_whole():
    """A list value was cut at 255 bytes without a word: the last number
    read was a prefix of the one given."""
    padded = "0" * 300 + "7"
    res = run_bench("trace", *SMALL_TRACE[:-2], "--device-pct", f"5,{padded}")
    assert res.returncode in (0, 3), res.stderr[-2000:]
    assert _budgets(res.stdout) == [5, 7]
    res = run_bench("trace", *SMALL_TRACE[:-2], "--device-pct", ",".join(["5"] * 17))
    assert res.returncode == 2 and b"at most 16" in res.stderr, res.stderr
    res = run_bench("trace", *SMALL_TRACE[:-2], "--device-pct", "5,,7")
    assert res.returncode == 2 and b"--device-pct" in res.stderr, res.stderr


@pytest.mark.parametrize(
    "args,flag",
    [
        (["alloc", "--blocks", "1"], "--blocks"),
        (["alloc", "--block-tokens", "3"], "--block-tokens"),
        (["alloc", "--pairs", "0"], "--pairs"),
        (["alloc", "--head-dim", "513"], "--head-dim"),
        (["attention", "--dim", "0"], "--dim"),
        (["attention", "--bw-mb", "8"], "--bw-mb"),
        (["attention", "--q-heads", "3", "--kv-heads", "2"], "--q-heads"),
        (["attention", "--stream", "--window-blocks", "100000"], "--window-blocks"),
        (["attention", "--stream", "--dim", "2000"], "--dim"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else v,
)
def test_a_value_out_of_range_names_its_flag(args, flag):
    res = run_bench(*args, "--quick")
    assert res.returncode == 2, res.stderr
    last = res.stderr.decode().strip().splitlines()[-1]
    assert flag in last, last


@pytest.mark.parametrize(
    "args",
    [
        ["trace", "--replay", "0", "--save-traces", "{missing}"],
        ["trace", "--replay", "0", "--save-traces", "{file}"],
        ["trace", "--disk-dir", "{missing}"],
        ["switch", "--dir", "{missing}"],
        ["switch", "--model", "{missing}"],
        ["switch", "--model", "{dir}"],
        ["disk", "--dir", "{missing}", "--total-mb", "4", "--block-bytes", "64K"],
        ["disk", "--dir", "{file}", "--total-mb", "4", "--block-bytes", "64K"],
        ["attention", "--stream", "--dir", "{missing}"],
    ],
    ids=" ".join,
)
def test_a_path_that_cannot_be_used_is_a_usage_error(tmp_path, args):
    """Exit 2 for a wrong argument, as kvh-bench --help says; a missing
    directory was 1 for some flags, 2 for others. Nothing runs first."""
    flag = next(args[i - 1] for i, a in enumerate(args) if a.startswith("{"))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    paths = {"missing": tmp_path / "missing", "file": blocker, "dir": tmp_path}
    args = [a.format(**paths) for a in args]
    res = run_bench(args[0], "--quick", "--json", *args[1:])
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert flag.encode() in res.stderr.strip().splitlines()[-1], res.stderr
    assert res.stdout == b"", res.stdout[:2000]
    assert blocker.read_text() == "x"


def test_help_states_the_exit_status_of_a_usage_error():
    res = run_bench("--help")
    assert res.returncode == 0
    assert b"2 usage" in res.stdout, res.stdout


def _fake_bench(tmp_path: Path, rows: str) -> Path:
    script = tmp_path / "bench"
    script.write_text(f"#!/bin/sh\nif [ \"$1\" = list ]; then echo codec; exit 0; fi\ncat <<'EOF'\n{rows}\nEOF\n")
    script.chmod(0o755)
    return script


def run_kvh_bench(tmp_path, rows, *args):
    return subprocess.run(
        [sys.executable, "-m", "kvh_cache", "bench", "codec", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=_env({"KVH_BENCH": str(_fake_bench(tmp_path, rows))}),
        stdin=subprocess.DEVNULL,
        cwd=str(REPO),
    )


GOOD = '{"scenario": "codec", "metric": "m", "value": 1, "unit": "x"}'


@pytest.mark.parametrize("bad", ['{"scenario": "codec", "metric": "cut', "[1, 2]", "not json"])
@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_kvh_bench_fails_on_a_row_it_cannot_read(tmp_path, bad, as_json):
    """A row kvh could not parse was skipped, and the run exited 0."""
    res = run_kvh_bench(tmp_path, f"{GOOD}\n{bad}\n{GOOD}", *(["--json"] if as_json else []))
    assert res.returncode == 1, (res.returncode, res.stderr)
    assert "not JSON objects" in res.stderr and bad in res.stderr, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    if as_json:
        # What is printed stays one JSON object a line: the good rows.
        assert [json.loads(line) for line in res.stdout.splitlines()] == [json.loads(GOOD)] * 2


def test_kvh_bench_takes_well_formed_rows(tmp_path):
    res = run_kvh_bench(tmp_path, f"{GOOD}\n\n{GOOD}", "--json")
    assert res.returncode == 0, res.stderr
    assert [json.loads(line) for line in res.stdout.splitlines()] == [json.loads(GOOD)] * 2


def test_a_trace_index_far_past_its_accesses_is_refused_up_front(tmp_path):
    """`0 4000000000` made the engine replay append four billion blocks no
    access names, for hours; it is refused before any work, exit 2."""
    path = tmp_path / "sparse.trace"
    path.write_text("0 0\n0 4000000000\n0 0\n")
    res = run_bench("trace", "--quick", "--json", "--trace", str(path))
    assert res.returncode == 2, res.stderr[-2000:]
    assert b"number each sequence's blocks from 0" in res.stderr
    assert res.stdout.strip() == b""
    res = run_bench("trace", *SMALL_TRACE, "--trace", str(path))  # no replay: the simulator takes it
    assert res.returncode in (0, 3), res.stderr[-2000:]
