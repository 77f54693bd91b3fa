"""The command-line tools under hostile use: bad flags, bad numbers, bad
paths, bad KVH_* variables, closed or full output, SIGPIPE and Ctrl-C.
Every failure must be one clear line on stderr and a non-zero exit: no
traceback, crash, hang, or half-written store."""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvh_cache import cli
from kvh_cache.tools import find_tool
from kvh_testutil import unusable_model

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 30  # no probe here should come near this; a hang fails the test


def _env(extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "python") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # A CI machine's own configuration must not leak into these probes.
    for k in [k for k in env if k.startswith("KVH_") and k not in ("KVH_BUILD_DIR", "KVH_BENCH", "KVH_STORE")]:
        del env[k]
    env.update(extra or {})
    return env


def run_kvh(*args, env_extra=None, stdin=subprocess.DEVNULL, cwd=None, **kw):
    return subprocess.run(
        [sys.executable, "-m", "kvh_cache", *map(str, args)],
        stdout=kw.pop("stdout", subprocess.PIPE),
        stderr=subprocess.PIPE,
        text=True,
        timeout=TIMEOUT,
        env=_env(env_extra),
        stdin=stdin,
        cwd=str(cwd or REPO),
        **kw,
    )


def _bench_tool():
    tool = find_tool("kvh-bench")
    if tool is None:
        pytest.skip("kvh-bench not built")
    return tool


def run_bench(*args, env_extra=None, **kw):
    return subprocess.run(
        [_bench_tool(), *map(str, args)],
        stdout=kw.pop("stdout", subprocess.PIPE),
        stderr=subprocess.PIPE,
        text=True,
        timeout=TIMEOUT,
        env=_env(env_extra),
        stdin=subprocess.DEVNULL,
        **kw,
    )


def assert_one_line_error(res, rc=None, word=None):
    """Failed with a message, not a traceback or a signal."""
    assert res.returncode > 0, (res.returncode, res.stderr[-2000:])  # < 0: killed by a signal
    if rc is not None:
        assert res.returncode == rc, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert lines, "no message on stderr"
    if word is not None:
        assert word in lines[-1], res.stderr[-2000:]


def _tree_digest(d: Path):
    # LOCK takes the pid of whoever last tried to open the store
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.name != "LOCK"}


def run_in_process(args, capfd):
    """cli.main in this process (no interpreter start-up per case): the exit
    status and stderr. An exception other than SystemExit escapes and fails
    the test, as a traceback would."""
    capfd.readouterr()
    try:
        rc = cli.main([str(a) for a in args])
    except SystemExit as exc:
        rc = exc.code
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(args, rc, out, err)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A small synthetic-demo store (geometry 4 x 4 x 64, 16 tokens/block)."""
    data = tmp_path_factory.mktemp("misuse") / "data"
    d = data / "store"
    res = run_kvh(
        "demo",
        "--synthetic",
        "--agents",
        "1",
        "--steps",
        "2",
        "--chunks",
        "2",
        "--device-budget",
        "2MiB",
        "--host-budget",
        "1MiB",
        "--data-dir",
        data,
    )
    assert res.returncode == 0, res.stderr
    if not (d / "index").exists():
        pytest.skip("this build has no disk tier")
    return d


# ---------------------------------------------------------------------------------
# --help everywhere
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "cmd",
    [["-h"], ["demo", "-h"], ["store", "remote", "-h"], ["stats", "--help"], ["bench", "--help"]],
    ids=" ".join,
)
def test_kvh_help_goes_to_stdout(cmd):
    res = run_kvh(*cmd)
    assert res.returncode == 0 and res.stderr == "" and res.stdout.startswith("usage: kvh"), res.stderr


def test_bench_help_of_every_mode():
    res = run_bench("list")
    assert res.returncode == 0
    modes = res.stdout.split()
    assert "codec" in modes and "checksum" in modes
    for args in (["--help"], ["-h"], ["help"], ["all", "--help"]):
        res = run_bench(*args)
        assert res.returncode == 0 and res.stdout.startswith("usage: kvh-bench") and res.stderr == "", args
    for mode in modes:
        res = run_bench(mode, "--help")
        assert res.returncode == 0, (mode, res.stderr)
        assert res.stdout.startswith(f"usage: kvh-bench {mode}") and "options" in res.stdout, mode
        assert res.stderr == "", (mode, res.stderr)
        # The option table adds each default: a help text that gives it
        # too printed it twice ("(default /tmp) (default /tmp)").
        twice = [line for line in res.stdout.splitlines() if line.count("(default") > 1]
        assert not twice, (mode, twice)


def test_bench_attention_stream_help_names_its_directory():
    # The help said the raw read is measured "in --dir", --dir was refused
    # as an unknown option, and $KVH_BENCH_DIR, which set it, went unnamed.
    res = run_bench("attention", "--stream", "--help")
    assert res.returncode == 0, res.stderr
    options = res.stdout.split("options", 1)[1]
    assert re.search(r"^  --dir S +.*\$KVH_BENCH_DIR", options, re.M), res.stdout


@pytest.mark.parametrize("mode", ["disk", "switch"])
def test_bench_help_has_no_null_default(mode):
    res = run_bench(mode, "--help")
    assert res.returncode == 0
    assert "(null)" not in res.stdout  # printf("%s", NULL) is undefined behaviour


# ---------------------------------------------------------------------------------
# kvh: usage errors
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args,rc,word",
    [
        (["--bogus"], 2, "--bogus"),
        (["nosuch"], 2, "invalid choice"),
        (["stats"], 2, "DIR"),
        (["store", "info"], 2, "DIR"),
        (["store", "remote", "verify", "--sample", "x"], 2, "--sample"),
        (["stats", "{store}", "--dtype", "f64"], 2, "--dtype"),
        (["stats", "{store}", "--model-salt", "zz"], 2, "--model-salt"),
        (["stats", "{store}", "--layers", "-1"], 2, "--layers"),
        (["stats", "{store}", "--disk-bytes", "99999999999999999999999"], 2, "--disk-bytes"),
        (["stats", "{store}", "--disk-bytes", "0"], 2, "--disk-bytes"),
        (["stats", "{store}", "--disk-bytes", "1.5G"], 2, "--disk-bytes"),
        (["doctor", "--host-budget", "-1"], 2, "--host-budget"),
        (["doctor", "--disk-budget", "nan"], 2, "--disk-budget"),
        (["demo", "--synthetic", "--device-budget", "inf"], 2, "--device-budget"),
        (["demo", "--synthetic", "--device-budget=-1MiB"], 2, "--device-budget"),
        (["demo", "--synthetic", "--seed", "nan"], 2, "--seed"),
        (["demo", "--synthetic", "--steps", "0"], 2, "--steps"),
        (["demo", "--synthetic", "--intent-noise", "inf"], 2, "--intent-noise"),
        (["bench", "codec", "--quick", "--reps", "0"], 2, "--reps"),
        # refused before any scenario runs (kvh-bench said it once per scenario)
        (["bench", "--reps", "0"], 2, "argument --reps"),
        (["bench", "--reps", "1001"], 2, "argument --reps"),
        (["bench", "--seed", "-1"], 2, "argument --seed"),
        (["bench", "--seed", str(1 << 64)], 2, "argument --seed"),
        (["bench", "retriever", "--reps", "0"], 2, "argument --reps"),  # was dropped: `if args.reps`
        # NaN and inf passed the range checks: an abort, a traceback, "think nan ms"
        (["bench", "retriever", "--", "--switch-interval-ms", "nan"], 2, "--switch-interval-ms"),
        (["bench", "retriever", "--", "--think-ms", "inf"], 2, "--think-ms"),
        (["bench", "retriever", "--", "--think-ms", "nan"], 2, "--think-ms"),
        (["bench", "retriever", "--", "--settle-ms", "nan"], 2, "--settle-ms"),
        (["bench", "offload", "--reps", "0"], 2, "argument --reps"),
        (["bench", "codec", "--quick", "--", "--vectors", "abc"], 2, "--vectors"),
    ],
    ids=lambda a: " ".join(a) if isinstance(a, list) else None,
)
def test_kvh_bad_input(args, rc, word, store, capfd):
    before = _tree_digest(store)
    res = run_in_process([a.replace("{store}", str(store)) for a in args], capfd)
    assert_one_line_error(res, rc, word)
    assert _tree_digest(store) == before


@pytest.mark.parametrize("cmd", [["demo", "--synthetic", "--host-budget"], ["doctor", "--host-budget"]], ids=" ".join)
def test_size_overflowing_to_inf(cmd):
    # float("1e400") is inf: int(inf) raised OverflowError, which argparse does not catch.
    res = run_kvh(*cmd, "1e400")
    assert_one_line_error(res, 2, "--host-budget")


def test_demo_budget_beyond_u64():
    res = run_kvh("demo", "--synthetic", "--device-budget", "1e30")
    assert_one_line_error(res, 2, "device")


@pytest.mark.parametrize("what", ["missing", "file", "empty", "garbage"])
def test_stats_and_store_on_non_stores(what, tmp_path, capfd):
    p = tmp_path / "x"
    if what == "file":
        p.write_text("")
    elif what in ("empty", "garbage"):
        p.mkdir()
    if what == "garbage":
        (p / "index").write_bytes(os.urandom(4096))
        (p / "LOCK").write_text("junk")
    before = _tree_digest(p) if p.is_dir() else None
    for cmd in (["stats"], ["store", "info"], ["store", "verify"]):
        res = run_in_process([*cmd, p], capfd)
        assert_one_line_error(res)
    if before is not None:
        assert _tree_digest(p) == before  # read-only tools: the garbage is left as it was


def test_stats_other_geometry_leaves_store_alone(store, capfd):
    before = _tree_digest(store)
    res = run_in_process(["stats", store, "--layers", "8"], capfd)
    assert_one_line_error(res, 1, "different num_layers")
    # Neither a smaller size (dropping blocks) nor a larger one (growing the
    # slab files, up to filling the disk): the store is read as it is.
    slab_bytes = sum(p.stat().st_size for p in Path(store).glob("slab-*.kvh"))
    slot = cli._slot_bytes(cli._store_info(Path(store)))
    for size in (1, slab_bytes // 2, slab_bytes - slot, slab_bytes + slot, 1 << 40):
        res = run_in_process(["stats", store, "--disk-bytes", str(size)], capfd)
        assert_one_line_error(res, 2, "never resizes it")
    assert _tree_digest(store) == before
    # disk_bytes counts whole slots, rounded down: a size short of one more
    # slot names the same store
    for size in (slab_bytes, slab_bytes + 4096, slab_bytes + slot - 1):
        res = run_in_process(["stats", store, "--disk-bytes", str(size)], capfd)
        assert res.returncode == 0, res.stderr
    # the size syntax of the KVH_*_BYTES variables, as the README says
    kib = f"{slab_bytes >> 10}K" if slab_bytes % 1024 == 0 else str(slab_bytes)
    res = run_in_process(["stats", store, "--disk-bytes", kib], capfd)
    assert res.returncode == 0, res.stderr
    res = run_in_process(["stats", store, "--disk-bytes", f"{(slab_bytes + slot) >> 10}KiB"], capfd)
    assert_one_line_error(res, 2, "never resizes it")


def test_stats_never_resets_whatever_the_environment_says(store, capfd, monkeypatch):
    """KVH_DISK_FLAGS=reset_on_mismatch (a server's setting) made `kvh
    stats` with another geometry reset the store it was asked to read."""
    before = _tree_digest(store)
    monkeypatch.setenv("KVH_DISK_FLAGS", "reset_on_mismatch")
    res = run_in_process(["stats", store, "--layers", "3"], capfd)
    assert_one_line_error(res, 1, "different num_layers")
    assert _tree_digest(store) == before


def test_stats_keeps_a_group_shared_store_shared(tmp_path, capfd):
    import kvh_cache as kvh

    d = tmp_path / "shared"
    eng = kvh.Engine(
        backend="cpu",
        num_layers=1,
        num_kv_heads=1,
        head_dim=8,
        block_tokens=16,
        dtype="f16",
        device_bytes=1 << 20,
        host_bytes=1 << 20,
        disk_path=str(d),
        disk_bytes=1 << 20,
        disk_share_group=True,
    )
    eng.close()
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [d, *d.iterdir()]}
    assert modes["shared"] & 0o070
    res = run_in_process(["stats", d], capfd)
    assert res.returncode == 0, res.stderr
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in [d, *d.iterdir()]} == modes


@pytest.mark.parametrize("dir_mode", [0o710, 0o711, 0o750], ids=oct)
def test_stats_never_widens_an_owner_only_store(dir_mode, tmp_path, capfd):
    # Any group bit on the directory opened the store group-shared: the
    # library then set the directory to 0750 and its 0600 files to 0640.
    import kvh_cache as kvh

    d = tmp_path / "own"
    kvh.Engine(backend="cpu", num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=16, dtype="f16",
               device_bytes=1 << 20, host_bytes=1 << 20, disk_path=str(d), disk_bytes=1 << 20).close()  # fmt: skip
    d.chmod(dir_mode)
    files = {p.name: stat.S_IMODE(p.stat().st_mode) for p in d.iterdir()}
    assert set(files.values()) == {0o600}, files
    res = run_in_process(["stats", d], capfd)
    assert res.returncode == 0, res.stderr
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in d.iterdir()} == files
    # The library may narrow an owner-only store's directory (to 0700); it never widens it.
    assert stat.S_IMODE(d.stat().st_mode) & ~dir_mode == 0, oct(d.stat().st_mode)


def test_stats_text_of_a_path_that_is_not_utf8_shows_its_bytes(store, tmp_path):
    """Under a UTF-8 locale the text report failed to print the path's
    undecodable byte: nothing on stdout and exit 2 (usage) for a sound
    store. Its bytes are written as given, as ls does."""
    d = tmp_path / os.fsdecode(b"bad\xff") / "store"
    shutil.copytree(store, d)
    for args in (["stats", os.fsencode(d)], ["doctor", "--data-dir", os.fsencode(d.parent)]):
        res = subprocess.run(
            [sys.executable, "-m", "kvh_cache", *args],
            capture_output=True,
            timeout=120,
            env=_env({"LC_ALL": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}),
            stdin=subprocess.DEVNULL,
        )
        assert res.returncode in (0, 1), (args[0], res.returncode, res.stderr)
        assert b"Traceback" not in res.stderr and b"surrogates not allowed" not in res.stderr, res.stderr
        assert b"bad\xff" in res.stdout, res.stdout[:300]


def test_help_in_a_terminal_that_cannot_show_every_character():
    """kvh doctor --help under a Latin-1 locale ended in a traceback (an em
    dash in its text); nothing the CLI prints may fail to encode."""
    for cmd in (["doctor", "--help"], ["-h"], ["demo", "-h"], ["store", "-h"]):
        res = run_kvh(*cmd, env_extra={"PYTHONIOENCODING": "latin-1"})
        assert res.returncode == 0 and "Traceback" not in res.stderr, (cmd, res.stderr[-500:])
    res = run_kvh("doctor", "--help", env_extra={"PYTHONIOENCODING": "ascii"})
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-500:]


def test_a_usage_error_exits_2_when_stderr_is_full():
    """The usage text that could not be written to a full stderr was
    reported as a write error on stdout, with exit 1."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    for args in (["stats"], ["bogus"], ["demo", "--steps", "x"]):
        with open("/dev/full", "w") as full:
            res = subprocess.run(
                [sys.executable, "-m", "kvh_cache", *args], stdout=subprocess.PIPE, stderr=full,
                timeout=TIMEOUT, env=_env(), stdin=subprocess.DEVNULL, cwd=str(REPO),
            )  # fmt: skip
        assert res.returncode == 2, (args, res.returncode)


def test_stats_json_of_a_path_that_is_not_utf8_is_strict_json(store, tmp_path):
    # The path was written as a lone surrogate escape ("bad\\udcff"),
    # which strict JSON parsers reject.
    d = tmp_path / os.fsdecode(b"bad\xff") / "store"
    shutil.copytree(store, d)
    res = subprocess.run(
        [sys.executable, "-m", "kvh_cache", "stats", os.fsencode(d), "--json"],
        capture_output=True,
        timeout=TIMEOUT,
        env=_env(),
        stdin=subprocess.DEVNULL,
    )
    assert res.returncode == 0, res.stderr
    text = res.stdout.decode("utf-8")  # strict
    assert "\\ud" not in text.lower() and "\udcff" not in text, text[:200]
    assert json.loads(text)["path"] == os.fsencode(d).decode("utf-8", "replace")


def test_bench_with_a_tool_that_lists_no_scenario_blames_the_tool():
    """KVH_BENCH naming a program that prints nothing (/bin/true) blamed the
    user's scenario: "unknown scenario 'checksum'", exit 2."""
    res = run_kvh("bench", "checksum", "--quick", env_extra={"KVH_BENCH": "/bin/true"})
    assert_one_line_error(res, 1, "named no scenario")
    assert "unknown scenario" not in res.stderr, res.stderr


def test_demo_data_dir_is_a_file(tmp_path):
    # The disk tier was silently dropped (a note on stdout, exit 0), or the
    # run failed with "the tiers are too small" when it needed the disk.
    blocker = tmp_path / "file"
    blocker.write_text("x")
    res = run_kvh("demo", "--synthetic", "--agents", "1", "--steps", "1", "--chunks", "1", "--data-dir", blocker)
    assert_one_line_error(res, 1, "Not a directory")
    assert blocker.read_text() == "x"


# ---------------------------------------------------------------------------------
# kvh: KVH_* variables and $KVH_CONFIG
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "env,rc,word",
    [
        ({"KVH_HOST_BYTES": "lots"}, 1, "KVH_HOST_BYTES"),
        ({"KVH_NUM_LAYERS": "abc"}, 1, "KVH_NUM_LAYERS"),
        ({"KVH_DTYPE": "f64"}, 1, "KVH_DTYPE"),
        ({"KVH_DISK_FLAGS": "bogus"}, 1, "KVH_DISK_FLAGS"),
        ({"KVH_MIGRATION_THREADS": "100000"}, 1, "migration_threads"),
        ({"KVH_CONFIG": "/nonexistent/kvh.toml"}, 1, "/nonexistent/kvh.toml"),
        ({"KVH_CONFIG": "/"}, 1, "Is a directory"),
        ({"KVH_CONFIG": "{bad}"}, 2, "not valid TOML"),
        ({"KVH_CONFIG": "{unknown}"}, 2, "unknown key"),
        ({"KVH_STORE": "/nonexistent/kvh-store"}, 1, "$KVH_STORE=/nonexistent/kvh-store: not an executable file"),
        ({"KVH_STORE": "/"}, 1, "$KVH_STORE=/: not an executable file"),
        ({"KVH_STORE": "{plain}"}, 1, "not an executable file"),
        ({"KVH_STORE": "/bin/true"}, 1, "printed no JSON"),
    ],
    ids=lambda e: ",".join(f"{k}={v}" for k, v in e.items()) if isinstance(e, dict) else None,
)
def test_stats_bad_environment(env, rc, word, store, tmp_path, capfd, monkeypatch):
    (tmp_path / "bad.toml").write_text("this is = = not toml\n")
    (tmp_path / "unknown.toml").write_text("nosuchkey = 1\n")
    (tmp_path / "plain").write_text("not a program\n")
    places = {"{bad}": "bad.toml", "{unknown}": "unknown.toml", "{plain}": "plain"}
    for key, value in list(env.items()):
        for mark, name in places.items():
            value = value.replace(mark, str(tmp_path / name))
        env[key] = value
    before = _tree_digest(store)
    for k in [k for k in os.environ if k.startswith("KVH_") and k != "KVH_BUILD_DIR"]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    res = run_in_process(["stats", store], capfd)
    assert_one_line_error(res, rc, word)
    assert _tree_digest(store) == before


def test_store_remote_bad_config_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("this is = = not toml\n")
    res = run_kvh("store", "remote", "ping", env_extra={"KVH_CONFIG": str(bad), "KVH_REMOTE_ADDRS": "127.0.0.1:1"})
    assert_one_line_error(res, 2, "not valid TOML")


def test_store_remote_ping_counts_the_nodes_named_when_none_answers():
    res = run_kvh("store", "remote", "ping", env_extra={"KVH_REMOTE_ADDRS": "127.0.0.1:1,127.0.0.1:2"})
    assert res.returncode == 1 and "0 of 2 node(s) answer" in res.stdout, res.stdout + res.stderr


def test_store_remote_bad_variable():
    res = run_kvh("store", "remote", "count", env_extra={"KVH_REMOTE_ADDRS": "garbage"})
    assert_one_line_error(res, word="host:port")
    res = run_kvh("store", "remote", "ping", env_extra={"KVH_HOST_BYTES": "lots", "KVH_REMOTE_ADDRS": "127.0.0.1:1"})
    assert_one_line_error(res, 1, "KVH_HOST_BYTES")


@pytest.mark.parametrize("action", ["count", "verify", "purge"])
@pytest.mark.parametrize(
    "var,value",
    [("KVH_BLOCK_TOKENS", "3"), ("KVH_BLOCK_TOKENS", "512"), ("KVH_NUM_LAYERS", "0"), ("KVH_HEAD_DIM", "1025")],
)
def test_store_remote_geometry_no_engine_opens_with(action, var, value):
    # The geometry names the model's keys: with one an engine refuses,
    # count said "0 key(s)" with exit 0, as of an empty tier. Refused
    # before any connection, naming the variable.
    tool = find_tool("kvh-store")
    if tool is None:
        pytest.skip("kvh-store not built")
    res = subprocess.run(
        [tool, "remote", action],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=_env({"KVH_REMOTE_ADDRS": "127.0.0.1:1", var: value}),
        stdin=subprocess.DEVNULL,
    )
    assert_one_line_error(res, 2, var)
    assert res.stdout == ""


@pytest.mark.parametrize("action", ["count", "verify", "purge"])
def test_store_remote_unreachable(action, capfd, monkeypatch):
    # Nothing listens on port 1: "0 key(s)" with exit 0 reads as an empty, healthy tier.
    if find_tool("kvh-store") is None:
        pytest.skip("kvh-store not built")
    monkeypatch.setenv("KVH_REMOTE_ADDRS", "127.0.0.1:1")
    res = run_in_process(["store", "remote", action], capfd)
    assert_one_line_error(res)


def test_store_remote_negative_sample(capfd, monkeypatch):
    # kvh-store reads "-1" with strtoull: every key instead of a sample.
    monkeypatch.setenv("KVH_REMOTE_ADDRS", "127.0.0.1:1")
    res = run_in_process(["store", "remote", "verify", "--sample", "-1"], capfd)
    assert_one_line_error(res, 2, "--sample")


@pytest.mark.parametrize(
    "args,word", [(["frob", "/tmp"], "unknown action frob"), (["info"], "info needs the store's directory")]
)
def test_store_tool_says_which_argument_is_wrong(args, word):
    # Only the usage text was printed: nothing said what was wrong with the line.
    tool = find_tool("kvh-store")
    if tool is None:
        pytest.skip("kvh-store not built")
    res = subprocess.run([tool, *args], capture_output=True, text=True, timeout=TIMEOUT)
    assert res.returncode == 2 and res.stderr.splitlines()[0].startswith("kvh-store: " + word), res.stderr


def test_bench_list_json_is_json():
    # --json was accepted and the names came out as text lines.
    res = run_kvh("bench", "--list", "--json")
    assert res.returncode in (0, 3), res.stderr
    names = json.loads(res.stdout)
    assert "retriever" in names and (res.returncode == 3 or "alloc" in names), names


# ---------------------------------------------------------------------------------
# kvh: output that cannot be written, SIGPIPE, closed stdin/stdout
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "cmd", [["doctor", "--json"], ["bench", "--list"], ["stats", "{store}", "--json"]], ids=" ".join
)
def test_kvh_full_output(cmd, store):
    with open("/dev/full", "w") as full:
        res = run_kvh(*(a.replace("{store}", str(store)) for a in cmd), stdout=full)
    assert_one_line_error(res, 1, "No space left on device")


def test_store_info_full_output(store):
    with open("/dev/full", "w") as full:
        res = run_kvh("store", "info", store, stdout=full)
    assert_one_line_error(res)


def _stderr_once_stdout_closed(p):
    """Closes p's stdout (a reader that stopped), waits for p, returns its
    stderr."""
    p.stdout.close()
    try:
        err = p.stderr.read().decode(errors="replace")
        p.wait(timeout=TIMEOUT)
    finally:
        p.kill()
    return err


@pytest.mark.parametrize(
    "cmd",
    [["--help"], ["doctor"], ["bench", "--list"], ["stats", "{store}"], ["store", "info", "{store}"]],
    ids=" ".join,
)
def test_kvh_sigpipe(cmd, store):
    # As in `kvh doctor | head -1`: quiet, no "Broken pipe" traceback.
    p = subprocess.Popen(
        [sys.executable, "-m", "kvh_cache", *(a.replace("{store}", str(store)) for a in cmd)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=_env(),
        cwd=str(REPO),
    )
    p.stdout.readline()
    err = _stderr_once_stdout_closed(p)
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert p.returncode >= 0 or p.returncode == -signal.SIGPIPE, p.returncode


@pytest.mark.parametrize(
    "cmd",
    [
        ["--help"],
        ["doctor", "--json"],
        ["bench", "--list"],
        ["stats", "{store}", "--json"],
        ["store", "info", "{store}"],
    ],
    ids=" ".join,
)
def test_kvh_into_a_closed_pipe_exits_128_plus_sigpipe(cmd, store):
    # kvh's own writes exited 1 (EPIPE), a wrapped tool's 141 (SIGPIPE):
    # a reader gone before anything is written makes it certain.
    r, w = os.pipe()
    os.close(r)
    try:
        res = subprocess.run(
            [sys.executable, "-m", "kvh_cache", *(a.replace("{store}", str(store)) for a in cmd)],
            stdout=w,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            timeout=TIMEOUT,
            env=_env(),
            cwd=str(REPO),
        )
    finally:
        os.close(w)
    assert res.returncode == 128 + signal.SIGPIPE and "Traceback" not in res.stderr, (res.returncode, res.stderr)


def test_kvh_closed_stdin(store):
    # Nothing reads stdin: a closed fd 0 changes nothing.
    for cmd in (["stats", str(store), "--json"], ["doctor", "--json"]):
        res = subprocess.run(
            [sys.executable, "-m", "kvh_cache", *cmd],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            env=_env(),
            preexec_fn=lambda: os.close(0),
        )
        assert res.returncode == 0 and json.loads(res.stdout), res.stderr


def test_kvh_closed_stdout():
    res = subprocess.run(
        [sys.executable, "-m", "kvh_cache", "doctor", "--json"],
        stdout=None,
        stderr=subprocess.PIPE,
        text=True,
        timeout=TIMEOUT,
        env=_env(),
        preexec_fn=lambda: os.close(1),
    )
    assert_one_line_error(res, 1)


@pytest.mark.parametrize(
    "args,rc",
    [(["stats", "/nonexistent", "--json"], 1), (["stats"], 2), (["--bogus"], 2), (["bench", "--reps", "0"], 2)],
    ids=lambda a: " ".join(a) if isinstance(a, list) else str(a),
)
def test_kvh_closed_stderr(args, rc):
    # With fd 2 closed, messages went to stdout (into --json output) and
    # usage errors exited 1 (argparse wrote to a None stderr).
    res = subprocess.run(
        [sys.executable, "-m", "kvh_cache", *args],
        stdout=subprocess.PIPE,
        stderr=None,
        text=True,
        timeout=TIMEOUT,
        env=_env(),
        stdin=subprocess.DEVNULL,
        preexec_fn=lambda: os.close(2),
    )
    assert (res.returncode, res.stdout) == (rc, ""), (res.returncode, res.stdout)


# ---------------------------------------------------------------------------------
# kvh: Ctrl-C
# ---------------------------------------------------------------------------------
def _default_sigint():
    # A runner started in the background ignores SIGINT, and its children
    # inherit that: give the command a terminal's Ctrl-C.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(argv, after, **kw):
    p = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        preexec_fn=_default_sigint,
        **kw,
    )
    time.sleep(after)
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    try:
        out, err = p.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        pytest.fail(f"{argv}: still running 10 s after SIGINT")
    return p.returncode, err, time.monotonic() - t0


@pytest.mark.parametrize("where", ["build_parser", "_version"])
def test_ctrl_c_while_the_parser_is_built(where, capfd, monkeypatch):
    # Ctrl-C in the first moments of any kvh command (the parser imports
    # the demos) gave a KeyboardInterrupt traceback, not exit 130.
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, where, interrupted)
    try:
        res = run_in_process(["doctor"], capfd)
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped kvh's main (a traceback)")
    assert res.returncode == 130 and res.stderr == "kvh: interrupted\n" and res.stdout == "", res


def test_demo_sigint_leaves_a_consistent_store(tmp_path):
    d = tmp_path / "store"
    # Long enough (about 25 s here) that the signal always finds it running.
    argv = [sys.executable, "-m", "kvh_cache", "demo", "--synthetic", "--agents", "2", "--steps", "4000"]
    rc, err, took = _interrupt(argv + ["--chunks", "8", "--data-dir", str(tmp_path)], after=2.5, cwd=str(REPO))
    assert rc == 130 and "Traceback" not in err and err.strip().splitlines()[-1] == "kvh: interrupted", err
    assert took < 5
    if find_tool("kvh-store") is not None and d.exists():
        res = run_kvh("store", "verify", d)
        assert res.returncode == 0 and " 0 bad" in res.stdout, res.stdout + res.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_synthetic_demo_stopped_by_sigterm_or_sighup_leaves_no_temporary_store(sig, tmp_path):
    # Without --data-dir the store (hundreds of MiB) and the Qdrant
    # directory go under $TMPDIR; only Ctrl-C removed them.
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    p = subprocess.Popen(
        [sys.executable, "-m", "kvh_cache", "demo", "--synthetic", "--no-progress", "--agents", "2", "--steps", "4000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env({"TMPDIR": str(tmp)}),
        cwd=str(REPO),
        preexec_fn=_default_stop_signals,
    )
    try:
        deadline = time.monotonic() + TIMEOUT
        while not list(tmp.glob("kvh-demo-*/store/index")) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p.poll() is None and list(tmp.glob("kvh-demo-*/store/index")), p.poll()
        time.sleep(1.0)  # into the agents' steps
        p.send_signal(sig)
        out, err = p.communicate(timeout=15)
    finally:
        p.kill()
    assert p.returncode == 128 + sig and "Traceback" not in err, (p.returncode, err)
    assert sorted(x.name for x in tmp.iterdir()) == []


def test_bench_sigint(tmp_path):
    _bench_tool()
    rc, err, took = _interrupt([sys.executable, "-m", "kvh_cache", "bench", "trace", "--quick"], after=1.5)
    assert rc == 130 and "Traceback" not in err and "kvh: interrupted" in err, err
    # The engine replay's disk store goes with the run (it stayed behind).
    rc, err, took = _interrupt([_bench_tool(), "trace", "--quick", "--json", "--disk-dir", str(tmp_path)], after=1.0)
    assert rc == -signal.SIGINT and took < 5, (rc, err)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------
# kvh-bench (C)
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args,word",
    [
        ([], "usage"),
        (["nosuch"], "unknown scenario"),
        (["--bogus"], "unknown scenario"),
        (["codec", "--reps", "0"], "--reps"),
        (["codec", "--reps", "1001"], "--reps"),
        (["codec", "--reps", ""], "--reps"),
        (["codec", "--seed", "abc"], "--seed"),
        (["codec", "--bogus"], "--bogus"),
        (["codec", "--vectors"], "needs a value"),
        (["codec", "--vectors", "0"], "--vectors"),
        (["codec", "--vectors", "-1"], "--vectors"),
        (["codec", "--vectors", "1.5"], "--vectors"),
        (["codec", "--vectors", "99999999999999999999999"], "--vectors"),
        (["codec", "--isa", "sse9"], "--isa"),
        (["all", "--bogus"], "--bogus"),
        (["alloc", "--blocks", "0"], "--blocks"),
        (["alloc", "--block-tokens", "3"], "--block-tokens"),  # not a power of two: a usage error, not a failed run
        (["alloc", "--parts", "nope"], "--parts"),
        (["migrate", "--sizes", ","], "--sizes"),
        (["migrate", "--pool-mb", "0"], "--pool-mb"),
        (["attention", "--contexts", "0"], "contexts"),
        (["attention", "--dim", "0"], "--dim"),
        (["scale", "--threads", "0"], "--threads"),
        (["switch", "--layers", "0"], "--layers"),
        (["switch", "--mode", "sideways"], "--mode"),
        (["vmap", "--contexts", "0"], "contexts"),
        (["remote", "--mib", "0"], "--mib"),
        (["checksum", "--region-mb", "3"], "--region-mb"),
        (["checksum", "--region-mb", "x"], "--region-mb"),
        (["trace", "--agents", "0"], "--agents"),
        (["trace", "--device-pct", "101"], "--device-pct"),
        (["trace", "--trace", "/nonexistent/kvh.trace"], "/nonexistent/kvh.trace"),
        (["trace", "--trace", "/dev/zero"], "not a regular file"),  # endless empty lines
        (["trace", "--trace", "/"], "is a directory"),
        (["trace", "--trace", ""], "--trace is empty"),  # ran with no recorded trace, exit 0
        (["trace", "--replay", "2"], "--replay"),  # any number ran as 1
        (["alloc", "--parts", ""], "--parts"),
        (["alloc", "--parts", ",,,"], "--parts"),
        (["alloc", "--blocks", " -1"], "--blocks"),
        (["alloc", "--blocks", "99999999999"], "--blocks"),
        (["disk", "--dir", ""], "--dir"),
        # values that wrapped or were truncated in the arithmetic after parsing
        (["migrate", "--pool-mb", "17592186044417"], "--pool-mb"),
        (["attention", "--bw-mb", "17592186044417"], "--bw-mb"),
        (["attention", "--threads", "100000"], "--threads"),
        (["vmap", "--threads", "4294967297"], "--threads"),
    ],
    ids=lambda a: " ".join(a) or "none" if isinstance(a, list) else None,
)
def test_bench_bad_options(args, word):
    # the common flags first: "--vectors" with no value must not take one of them
    res = run_bench(args[0], "--quick", "--json", *args[1:]) if args[:1] not in ([], ["--bogus"]) else run_bench(*args)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert res.stdout == "" and word in res.stderr, res.stderr


@pytest.mark.parametrize("table", [False, True], ids=["json", "table"])
@pytest.mark.parametrize(
    "args, word",
    [
        # each value was checked when the run reached it, after the rows of those before it
        (["vmap", "--contexts", "1024,0"], "--contexts"),
        (["migrate", "--sizes", "64K,1000"], "--sizes"),
        (["migrate", "--pool-mb", "8", "--sizes", "64K,8M"], "--pool-mb"),
    ],
    ids=lambda a: " ".join(a) if isinstance(a, list) else None,
)
def test_bench_bad_list_value_is_refused_before_any_row(args, word, table):
    res = run_bench(args[0], "--quick", "--reps", "1", *([] if table else ["--json"]), *args[1:])
    assert_one_line_error(res, 2, word)
    assert res.stdout == "", res.stdout[:2000]


def test_bench_disk_and_stream_leave_their_directory_as_they_found_it(tmp_path):
    """kvh-bench disk --dir truncated and deleted DIR/raw.bin and reset a
    store at DIR/store; attention --stream removed ./stream-store with
    its contents and ./raw-read.bin. Both now work in a scratch directory
    of their own, removed after."""
    for name, data in (("raw.bin", b"mine"), ("raw-read.bin", b"mine"), ("store/notes", b"keep")):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    (tmp_path / "stream-store" / "sub").mkdir(parents=True)
    (tmp_path / "stream-store" / "sub" / "keep.txt").write_bytes(b"keep")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    res = run_bench("disk", "--quick", "--json", "--dir", tmp_path, "--total-mb", "4", "--block-bytes", "65536")
    assert res.returncode in (0, 3), res.stderr[-2000:]
    res = run_bench(
        "attention",
        "--stream",
        "--quick",
        "--json",
        "--times",
        "2",
        "--reps",
        "1",
        env_extra={"KVH_BENCH_DIR": str(tmp_path)},
    )
    assert res.returncode in (0, 3), res.stderr[-2000:]
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert (tmp_path / "raw.bin").read_bytes() == b"mine" and (tmp_path / "raw-read.bin").read_bytes() == b"mine"
    assert (tmp_path / "stream-store" / "sub" / "keep.txt").read_bytes() == b"keep"


def test_bench_trace_budget_past_a_later_trace_is_refused_before_any_row(tmp_path):
    # The host budget was checked trace by trace: one that only the recorded
    # trace (evaluated last, 1 % of its 100,000 blocks on the device) makes
    # wrap came after every generated trace's rows.
    recorded = tmp_path / "wide.trace"
    recorded.write_text("".join(f"0 {block}\n" for block in range(100_000)))
    host_mult = (1 << 32) // 500  # 4 device blocks (the least) x this fits 32 bits, 1,000 x this does not
    res = run_bench(
        "trace",
        "--quick",
        "--json",
        "--replay",
        "0",
        "--agents",
        "1",
        "--turns",
        "1",
        "--device-pct",
        "1",
        "--host-mult",
        host_mult,
        "--trace",
        recorded,
    )
    assert_one_line_error(res, 2, "--host-mult")
    assert res.stdout == "", res.stdout[:2000]


def _two_gib_of_address_space():
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


@pytest.mark.parametrize(
    "args",
    [["codec", "--vectors", "16M"], ["attention", "--bw-mb", "4096"]],  # 4 GiB buffers
    ids=" ".join,
)
def test_bench_out_of_memory_says_so(args):
    # Exit 1 and not a word on stderr.
    res = run_bench(args[0], "--quick", "--json", "--reps", "1", *args[1:], preexec_fn=_two_gib_of_address_space)
    assert_one_line_error(res, 1, "out of memory")
    assert res.stdout == "", res.stdout[:2000]


def test_bench_bad_paths_and_environment(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    # A path that cannot be used is a wrong argument: exit 2, as for usage.
    res = run_bench("disk", "--quick", "--dir", blocker, "--total-mb", "4", "--block-bytes", "64K")
    assert res.returncode == 2 and "Not a directory" in res.stderr, res.stderr
    assert blocker.read_text() == "x"
    res = run_bench("trace", "--quick", "--replay", "0", "--save-traces", blocker)
    assert res.returncode == 2 and "--save-traces" in res.stderr and "Not a directory" in res.stderr, res.stderr
    # A directory "reloaded" in no time: a bogus reload_ms row before the failure.
    res = run_bench("switch", "--quick", "--json", "--model", tmp_path)
    assert res.returncode == 2 and "not a regular file" in res.stderr and res.stdout == "", res.stdout + res.stderr
    res = run_bench("switch", "--quick", "--model", tmp_path / "missing.gguf")
    assert res.returncode == 2 and "missing.gguf" in res.stderr, res.stderr
    res = run_bench("switch", "--quick", "--json", env_extra={"KVH_MODEL": str(tmp_path / "missing.gguf")})
    assert res.returncode == 2 and "missing.gguf" in res.stderr, res.stderr
    res = run_bench("vmap", "--quick", "--json", env_extra={"KVH_VMAP_BACKING": "bogus"})
    assert res.returncode == 1 and "bogus" in res.stderr, res.stderr


def test_bench_usage_error_stops_at_the_first_scenario():
    # Every scenario ran, printed the same error, and then "no results".
    _bench_tool()
    res = run_kvh("bench", "--quick", "--", "--no-such-option")
    assert_one_line_error(res, 2, "--no-such-option")
    assert res.stderr.count("--no-such-option") == 1 and "no results" not in res.stdout, res.stderr


def _children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _stop_kvh_bench_through_kvh(sig, preexec):
    """Starts `kvh bench trace --quick`, waits for its kvh-bench, sends sig
    to kvh alone; returns (kvh's status, its stderr, the kvh-bench pids
    still running)."""
    _bench_tool()
    p = subprocess.Popen(
        [sys.executable, "-m", "kvh_cache", "bench", "trace", "--quick"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        preexec_fn=preexec,
    )
    children = []
    try:
        deadline = time.monotonic() + TIMEOUT
        while not _children(p.pid) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        children = _children(p.pid)
        assert children, "kvh bench started no kvh-bench"
        time.sleep(0.5)
        p.send_signal(sig)
        out, err = p.communicate(timeout=15)
        running = [c for c in children if _running(c)]
    finally:
        p.kill()
        for c in children:  # no benchmark left behind by a failed run
            try:
                os.killpg(c, signal.SIGKILL)
            except OSError:
                pass
    return p.returncode, err, running


def test_bench_sigint_to_kvh_alone_stops_kvh_bench():
    # SIGINT to the kvh process only (kill -INT, a supervisor) left kvh-bench running.
    rc, err, running = _stop_kvh_bench_through_kvh(signal.SIGINT, _default_sigint)
    assert rc == 130 and "Traceback" not in err, (rc, err)
    assert not running, running


def _default_stop_signals():
    # A runner started by nohup ignores SIGHUP, and its children inherit that.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_bench_sigterm_or_sighup_to_kvh_stops_kvh_bench(sig):
    # kvh-bench runs in a process group of its own, stopped only on
    # Ctrl-C: SIGTERM or SIGHUP to kvh left it running, orphaned.
    rc, err, running = _stop_kvh_bench_through_kvh(sig, _default_stop_signals)
    assert not running, (running, rc, err)
    assert rc == 128 + sig and "Traceback" not in err, (rc, err)
    assert err.strip().splitlines()[-1] == f"kvh: stopped by signal {int(sig)} ({sig.name})", err


def test_bench_json_lines():
    res = run_bench("codec", "--quick", "--json", "--reps", "1", "--seed", "7")
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert rows and all({"scenario", "metric", "value", "unit"} <= set(r) for r in rows)
    assert all(r["scenario"] == "codec" for r in rows)
    res = run_kvh("bench", "codec", "--quick", "--json", "--reps", "1")
    assert res.returncode == 0 and [json.loads(line) for line in res.stdout.splitlines()], res.stderr


def test_bench_sigpipe():
    # `kvh-bench codec --json | head -1`: ends (SIGPIPE is its default fate), no hang.
    p = subprocess.Popen(
        [_bench_tool(), "codec", "--quick", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env()
    )
    json.loads(p.stdout.readline())
    p.stdout.close()
    try:
        p.wait(timeout=TIMEOUT)
    finally:
        p.kill()
    p.stderr.close()
    assert p.returncode in (0, -signal.SIGPIPE)


@pytest.mark.parametrize("args", [["list"], ["scale", "--quick", "--json"]], ids=" ".join)
def test_bench_full_output(args):
    # Results written into a full disk were lost with exit 0.
    with open("/dev/full", "w") as full:
        res = run_bench(*args, stdout=full)
    assert res.returncode != 0 and res.stderr.strip()


@pytest.mark.parametrize(
    "args",
    [
        ["disk", "--block-bytes", "0", "--total-mb", "4"],  # bench_disk: (total_mb << 20) / bs
        ["attention", "--blocks", "0"],  # run_block: max_tokens / bt
    ],
    ids=" ".join,
)
def test_bench_zero_block_size(args, tmp_path):
    extra = ["--dir", str(tmp_path)] if args[0] == "disk" else []
    res = run_bench(*args, *extra, "--quick", "--json")
    assert res.returncode == 2, (res.returncode, res.stderr)  # not -SIGFPE
    assert res.stderr.strip()


@pytest.mark.parametrize("flag", ["--total-mb", "--qd", "--context"])
def test_bench_disk_zero_sizes(flag, tmp_path):
    # Exit 1 with a stale errno ("File exists", "Success") or no message at all.
    args = ["--total-mb", "4", "--block-bytes", "64K", "--context", "4096", flag, "0"]
    res = run_bench("disk", "--quick", "--json", "--dir", tmp_path, *args)
    assert res.returncode == 2 and flag in res.stderr, (res.returncode, res.stderr)


def test_bench_suffix_overflow():
    # 17179869184G is 2^64: it wrapped to 0 (all CPUs) and ran.
    res = run_bench("vmap", "--quick", "--json", "--contexts", "1024", "--threads", "17179869184G")
    assert res.returncode == 2 and "--threads" in res.stderr, (res.returncode, res.stderr)


@pytest.mark.parametrize("variable", ["/nonexistent/kvh-store", "{plain}"])
def test_store_info_with_a_bad_kvh_store_variable(variable, store, tmp_path, capfd, monkeypatch):
    (tmp_path / "plain").write_text("not a program\n")
    monkeypatch.setenv("KVH_STORE", variable.replace("{plain}", str(tmp_path / "plain")))
    res = run_in_process(["store", "info", store], capfd)
    assert_one_line_error(res, 1, "$KVH_STORE=")
    assert "not an executable file" in res.stderr


@pytest.mark.parametrize("action", ["info", "verify"])
def test_store_tool_that_fails_without_a_word_is_reported(action, store, capfd, monkeypatch):
    # $KVH_STORE naming some other program that fails silently: kvh exited
    # 1 and printed nothing at all.
    monkeypatch.setenv("KVH_STORE", shutil.which("false") or "/bin/false")
    res = run_in_process(["store", action, store], capfd)
    assert_one_line_error(res, 1, "gave no reason")


def test_store_tool_words_pass_through_alone(store, tmp_path, capfd, monkeypatch):
    # A tool that says why it failed is not talked over.
    tool = _write_script(tmp_path / "tool", "echo 'out line'; echo 'why it failed' >&2; exit 3")
    monkeypatch.setenv("KVH_STORE", str(tool))
    res = run_in_process(["store", "info", store], capfd)
    assert res.returncode == 3, (res.returncode, res.stderr)
    assert res.stdout == "out line\n"
    assert res.stderr == "why it failed\n"


def test_store_tool_done_is_not_waited_past(store, tmp_path, capfd, monkeypatch):
    # A tool that leaves a process holding its stderr: kvh waited for that
    # process (5 s) instead of the tool.
    tool = _write_script(tmp_path / "tool", "(sleep 5) & echo 'why it failed' >&2; exit 4")
    monkeypatch.setenv("KVH_STORE", str(tool))
    start = time.monotonic()
    res = run_in_process(["store", "info", store], capfd)
    assert time.monotonic() - start < 3.0
    assert res.returncode == 4 and res.stderr == "why it failed\n", (res.returncode, res.stderr)


def test_stats_with_a_bad_kvh_store_variable_and_the_whole_geometry(store, capfd, monkeypatch):
    # The flags say all kvh-store would have about the geometry, but kvh
    # stats also checks with it that the store is intact before an engine
    # opens it (an engine repairs a damaged store): without it, nothing
    # is opened, one line says why, and the store is as it was.
    before = _tree_digest(store)
    monkeypatch.setenv("KVH_STORE", "/nonexistent/kvh-store")
    geometry = ["--layers", "4", "--kv-heads", "4", "--head-dim", "64", "--block-tokens", "16", "--dtype", "f16"]
    salt = ["--model-salt", str(0x6B7668 + 1)]  # the synthetic demo's, for --seed 1
    res = run_in_process(["stats", store, *geometry, *salt, "--json"], capfd)
    assert_one_line_error(res, 1, "$KVH_STORE=/nonexistent/kvh-store")
    assert res.stdout == "" and _tree_digest(store) == before
    monkeypatch.delenv("KVH_STORE")
    res = run_in_process(["stats", store, *geometry, *salt, "--json"], capfd)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["disk"]["used_blocks"] > 0


def _write_script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return path


def test_a_tool_killed_by_a_signal_gives_128_plus_the_signal(store, tmp_path):
    # subprocess gives -11 for SIGSEGV, and sys.exit(-11) exited 245.
    segv = _write_script(tmp_path / "segv", "kill -SEGV $$")
    res = run_kvh("store", "info", store, env_extra={"KVH_STORE": str(segv)})
    assert res.returncode == 128 + signal.SIGSEGV, (res.returncode, res.stderr)
    assert "signal 11" in res.stderr and "Traceback" not in res.stderr, res.stderr
    res = run_kvh("store", "verify", store, env_extra={"KVH_STORE": str(segv)})
    assert res.returncode == 128 + signal.SIGSEGV, (res.returncode, res.stderr)
    bench = _write_script(tmp_path / "bench", 'if [ "$1" = list ]; then echo codec; exit 0; fi; kill -SEGV $$')
    res = run_kvh("bench", "codec", "--quick", env_extra={"KVH_BENCH": str(bench)})
    assert res.returncode == 128 + signal.SIGSEGV and "signal 11" in res.stderr, (res.returncode, res.stderr)


def test_store_info_into_a_closed_pipe_exits_128_plus_sigpipe(store):
    # `kvh store info DIR | head -c0` exited 243 (sys.exit(-13)).
    p = subprocess.Popen(
        [sys.executable, "-m", "kvh_cache", "store", "info", str(store)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
        cwd=str(REPO),
    )
    err = _stderr_once_stdout_closed(p)
    assert p.returncode == 128 + signal.SIGPIPE and err == "", (p.returncode, err)


def test_a_file_given_for_a_store_is_named_as_such(tmp_path, capfd):
    f = tmp_path / "afile"
    f.write_text("x")
    for args in (["stats", f], ["store", "info", f]):
        res = run_in_process(args, capfd)
        assert_one_line_error(res, 1, "not a directory")
    res = run_in_process(["stats", tmp_path / "missing"], capfd)
    assert_one_line_error(res, 1, "no such directory")


def test_doctor_with_a_config_file_it_cannot_read(tmp_path, capfd):
    bad = tmp_path / "bad.toml"
    bad.write_text("this is = = not toml")
    for path in (tmp_path / "missing.toml", bad):
        res = run_in_process(["doctor", "--config", path], capfd)
        assert_one_line_error(res, 2, "--config")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_help_and_version_that_cannot_be_written_fail():
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    for args in (["--help"], ["--version"], ["stats", "--help"]):
        with open("/dev/full", "w") as full:
            p = subprocess.run([sys.executable, "-m", "kvh_cache", *args], stdout=full, stderr=subprocess.PIPE,
                               text=True, env=env, timeout=60)  # fmt: skip
        assert p.returncode == 1 and "write error on standard output" in p.stderr, (args, p.returncode, p.stderr)


def test_demo_refuses_an_empty_data_dir_and_huge_agent_counts(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    r = run_kvh("demo", "--synthetic", "--no-progress", "--steps", "1", "--agents", "1", "--data-dir", "", cwd=tmp_path)
    assert r.returncode == 2 and "must not be empty" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    r = run_kvh("demo", "--synthetic", "--no-progress", "--agents", str(10**20), "--data-dir", tmp_path / "d")
    assert r.returncode == 2 and "--agents must be at most" in r.stderr


@pytest.mark.parametrize("prompt_tokens", [0, 8])
def test_demo_with_a_prompt_shorter_than_a_block_passes(tmp_path, prompt_tokens):
    r = run_kvh(
        "demo",
        "--synthetic",
        "--no-progress",
        "--steps",
        "1",
        "--agents",
        "1",
        "--prompt-tokens",
        prompt_tokens,
        "--data-dir",
        tmp_path / "d",
    )
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize(
    "option", [["--record-trace", "t.json"], ["--questions", "3"], ["--no-restart"], ["--queue-hints", "-1"]]
)
def test_the_synthetic_demo_refuses_options_it_would_ignore(tmp_path, option):
    r = run_kvh("demo", "--synthetic", "--no-progress", "--steps", "1", "--data-dir", tmp_path / "d", *option)
    assert r.returncode == 2 and "an option of the model demo" in r.stderr, r.stderr


def test_without_the_compiled_binding_commands_say_why(tmp_path):
    # A package whose CFFI module is missing (a broken install) printed a
    # traceback for every command, `kvh --help` included.
    import kvh_cache

    shutil.copytree(
        Path(kvh_cache.__file__).parent,
        tmp_path / "kvh_cache",
        ignore=shutil.ignore_patterns("_kvh_cffi*", "__pycache__"),
    )
    env = dict(_env(), PYTHONPATH=str(tmp_path))

    def kvh(*args):
        return subprocess.run(
            [sys.executable, "-m", "kvh_cache", *map(str, args)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            env=env,
            cwd=str(tmp_path),
        )

    res = kvh("--help")
    assert res.returncode == 0 and "usage: kvh" in res.stdout, res.stderr[-2000:]
    assert "not loadable" in kvh("--version").stdout
    for args in (["stats", tmp_path / "store"], ["demo", "--synthetic", "--data-dir", tmp_path / "data"]):
        res = kvh(*args)
        assert_one_line_error(res, 3, "kvh_cache._kvh_cffi could not be loaded")
        assert not res.stderr.startswith("kvh: kvh:"), res.stderr
    probe = (
        "import kvh_cache as k\n"
        "assert issubclass(k.NoSpaceError, k.Error)\n"
        "try:\n    k.Engine\nexcept ImportError as e:\n    print('ImportError', e)\n"
    )
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert res.returncode == 0 and res.stdout.startswith("ImportError kvh: the compiled binding"), res.stderr


@pytest.mark.parametrize(
    "args, word",
    [
        # each wrapped to 32 bits and ran: an empty trace, no host tier, no hints
        (["trace", "--agents", "4294967296"], "--agents"),
        (["trace", "--turns", "4294967296"], "--turns"),
        (["trace", "--hint-turns", "4294967296"], "--hint-turns"),
        (["trace", "--replay-skip-kv-write", "4294967296"], "--replay-skip-kv-write"),
        (["trace", "--host-mult", "4611686018427387904"], "--host-mult"),
        # a multiple the smallest budget holds, but not this trace's budget
        (["trace", "--agents", "1", "--turns", "1", "--host-mult", "1073741822"], "--host-mult"),
        # more turns than the trace's 32-bit block and sequence numbers hold
        (["trace", "--agents", "100000", "--turns", "100000"], "--turns"),
        # "num_kv_heads 0", a value never given; q-heads 2^32 ran with as many as kv-heads
        (["attention", "--kv-heads", "4294967296", "--q-heads", "4294967296"], "--kv-heads"),
        (["attention", "--q-heads", "4294967296"], "--q-heads"),
        (["attention", "--total-tokens", "4294967296", "--contexts", "1"], "--total-tokens"),
        (["attention", "--stream", "--kv-heads", "4294967296", "--q-heads", "4294967296"], "--kv-heads"),
        (["attention", "--stream", "--threads", "4294967296"], "--threads"),
        (["attention", "--stream", "--device-blocks", "4294967296"], "--device-blocks"),
        # blocks x block bytes and tokens x 4 bytes wrapped to small allocations
        (["alloc", "--parts", "touch", "--touch-blocks", "36028797018968064"], "--touch-blocks"),
        (["alloc", "--parts", "prefix", "--prompt-tokens", "4611686018427387904"], "--prompt-tokens"),
        (["alloc", "--parts", "prefix", "--matches", "2305843009213693952"], "--matches"),
    ],
    ids=lambda a: " ".join(a) if isinstance(a, list) else None,
)
def test_bench_values_past_what_the_scenario_holds(args, word, tmp_path):
    # Small runs where the value is not refused; the options given last win.
    small = {
        "trace": ["--replay", "0", "--device-pct", "50"],
        "attention": ["--bw-mb", "16", "--blocks", "16", "--contexts", "1024"],
    }.get(args[0], [])
    if args[:2] == ["attention", "--stream"]:
        small = ["--kv-heads", "1", "--q-heads", "1", "--dim", "8"]
    res = run_bench(
        args[0],
        "--quick",
        "--json",
        "--reps",
        "1",
        *small,
        *args[1:],
        env_extra={"KVH_BENCH_DIR": str(tmp_path)},
        cwd=tmp_path,
    )
    assert_one_line_error(res, 2, word)
    assert res.stdout == "", res.stdout[:2000]


def _kvh_files_in_root():
    return {n for n in os.listdir("/") if n.startswith(("kvh-", "raw-read", "stream-store"))}


@pytest.mark.parametrize(
    "args, env, word",
    [
        (["switch", "--mode", "file", "--dir", ""], {}, "--dir"),
        (["trace", "--agents", "1", "--turns", "1", "--device-pct", "50", "--disk-dir", ""], {}, "--disk-dir"),
        (["attention", "--stream", "--kv-heads", "1", "--q-heads", "1", "--dim", "8"], {"KVH_BENCH_DIR": ""}, "empty"),
        (
            ["attention", "--stream", "--kv-heads", "1", "--q-heads", "1", "--dim", "8", "--dir", ""],
            {"KVH_BENCH_DIR": "/nonexistent"},
            "--dir is empty",
        ),
    ],
    ids=["switch --dir", "trace --disk-dir", "attention --stream KVH_BENCH_DIR", "attention --stream --dir"],
)
def test_bench_empty_directory_is_refused(args, env, word, tmp_path):
    # An empty directory made the paths "/kvh-bench-switch.PID.bin",
    # "/kvh-replay-XXXXXX", "/raw-read.bin": files in the root directory.
    before = _kvh_files_in_root()
    res = run_bench(args[0], "--quick", "--json", "--reps", "1", *args[1:], env_extra=env, cwd=tmp_path)
    assert_one_line_error(res, 2, word)
    assert res.stdout == "", res.stdout[:2000]
    assert _kvh_files_in_root() <= before
    assert not list(tmp_path.iterdir())


def _run_small_stream_bench(*extra, **kw):
    """kvh-bench attention --stream at its smallest: one round, one head of 8."""
    stream = ["--stream", "--kv-heads", "1", "--q-heads", "1", "--dim", "8"]
    return run_bench("attention", "--quick", "--json", "--reps", "1", *stream, *extra, **kw)


def test_bench_directory_too_long_for_its_path_is_refused(tmp_path):
    # Cut short to fit a buffer, the path named another directory.
    long_dir = tmp_path / ("d" * 200) / ("d" * 200) / ("d" * 200)
    long_dir.mkdir(parents=True)
    res = run_bench("switch", "--quick", "--json", "--reps", "1", "--mode", "file", "--dir", long_dir, cwd=tmp_path)
    assert_one_line_error(res, 2, "--dir")
    assert res.stdout == "", res.stdout[:2000]
    res = _run_small_stream_bench(env_extra={"KVH_BENCH_DIR": str(long_dir)}, cwd=tmp_path)
    assert_one_line_error(res, 2, "KVH_BENCH_DIR")
    assert res.stdout == "", res.stdout[:2000]
    assert [p.name for p in tmp_path.rglob("*")] == ["d" * 200] * 3


def test_bench_attention_stream_names_the_current_directory(tmp_path):
    """With neither --dir nor $KVH_BENCH_DIR, the stream scenario works in
    the current directory, and a failure to use it blamed --dir, which
    was never given: it names the current directory now."""
    gone = tmp_path / "gone"
    gone.mkdir()
    # preexec_fn runs in the child, after its chdir
    res = _run_small_stream_bench(cwd=gone, preexec_fn=lambda: os.rmdir(os.getcwd()))
    assert_one_line_error(res, 1, "the current directory")
    last = res.stderr.strip().splitlines()[-1]
    assert "--dir" not in last.replace("neither --dir nor", ""), last


def test_bench_strict_missed_target_is_exit_1(tmp_path, monkeypatch, capfd):
    """kvh-bench --strict exits 3 for a missed target, and kvh passed that
    through, though kvh's 3 means "not available": a missed target is a
    failed run, 1. The retriever scenario (Python) did the same."""
    row = '{"scenario": "codec", "metric": "m", "value": 1, "unit": "x", "met": false}'
    bench = _write_script(
        tmp_path / "bench",
        'if [ "$1" = list ]; then echo codec; exit 0; fi\n'
        f"echo '{row}'\n"
        'for a; do if [ "$a" = --strict ]; then echo "kvh-bench: 1 target(s) missed" >&2; exit 3; fi; done',
    )
    res = run_kvh("bench", "codec", "--quick", "--strict", env_extra={"KVH_BENCH": str(bench)})
    assert res.returncode == 1, (res.returncode, res.stderr)
    assert "target was missed" in res.stderr and "Traceback" not in res.stderr, res.stderr
    res = run_kvh("bench", "codec", "--quick", env_extra={"KVH_BENCH": str(bench)})
    assert res.returncode == 0, (res.returncode, res.stderr)

    from kvh_cache.demo import bench_retriever

    missed = {"scenario": "retriever", "metric": "stall", "value": 2, "target": "<= 1", "met": False}
    monkeypatch.setattr(bench_retriever, "run_bench", lambda args, log: ([missed], True, []))
    res = run_in_process(["bench", "retriever", "--quick", "--strict", "--json"], capfd)
    assert res.returncode == 1 and "target missed" in res.stderr, (res.returncode, res.stderr)
    assert bench_retriever.main(["--quick", "--strict", "--json"]) == 3  # the module's own status, as documented


@pytest.mark.parametrize(
    "args, word",
    [
        (["offload", "--quick", "--strict", "--seed", "7"], "--seed, --strict"),
        (["offload", "--seed", "7"], "--seed"),
        (["remote-ttft", "--seed", "7"], "--seed"),
        # 0 is a seed given, not one left out (0 == False)
        (["offload", "--quick", "--seed", "0"], "--seed"),
        (["remote-ttft", "--seed", "0"], "--seed"),
        (["vllm", "--strict"], "--strict"),
    ],
    ids=lambda a: " ".join(a) if isinstance(a, list) else "",
)
def test_bench_python_scenario_refuses_options_it_would_ignore(args, word, monkeypatch, capfd):
    """kvh bench offload took --seed and --strict and never passed them on
    (nor --seed to remote-ttft, nor --strict to vllm): refused now, exit 2,
    before anything runs."""
    from kvh_cache.demo import bench_offload, bench_remote
    from kvh_cache.vllm import bench as bench_vllm

    def ran(argv=None):
        raise AssertionError(f"the scenario ran: {argv}")

    for mod in (bench_offload, bench_remote, bench_vllm):
        monkeypatch.setattr(mod, "main", ran)
    res = run_in_process(["bench", *args], capfd)
    assert_one_line_error(res, 2, word)


def test_bench_remote_ttft_strict(monkeypatch, capfd):
    """--strict reaches the remote-ttft scenario, which fails (1) when its
    target is missed."""
    from kvh_cache.demo import bench_remote

    seen = []
    real = bench_remote.main
    monkeypatch.setattr(bench_remote, "main", lambda argv=None: seen.append(list(argv)) or 0)
    assert run_in_process(["bench", "remote-ttft", "--quick", "--strict"], capfd).returncode == 0
    assert "--strict" in seen[0]
    row = {"prefix_tokens": 256, "value": 9, "baseline": 10, "ratio": 0.9, "target": "ratio <= 0.3", "met": False}
    row["reps"] = 1
    monkeypatch.setattr(bench_remote, "run_bench", lambda args, log: [row])
    assert real(["--quick", "--json"]) == 0
    assert real(["--quick", "--json", "--strict"]) == 1
    assert "target missed" in capfd.readouterr().err


@pytest.mark.parametrize("what", ["truncated", "random", "empty", "/dev/zero", "/dev/null", "fifo"])
def test_demo_model_that_is_not_a_usable_gguf(what, tmp_path):
    """A GGUF cut after its version (or random bytes after the magic) ended
    in a struct.error traceback, and /dev/zero, /dev/null or a FIFO "did
    not exist" (exit 3): one line naming the file, exit 1."""
    pytest.importorskip("gguf")
    pytest.importorskip("regex")
    path = unusable_model(what, tmp_path)
    res = run_kvh("demo", "--model", path, "--data-dir", tmp_path / "data", "--no-progress")
    assert_one_line_error(res, 1, str(path))
    last = res.stderr.strip().splitlines()[-1]
    assert ("not a regular file" if what in ("/dev/zero", "/dev/null", "fifo") else "GGUF") in last, last
    assert "does not exist" not in res.stderr


@pytest.mark.parametrize(
    "args, word",
    [
        (["demo", "--synthetic", "--disk-budget", "1", "--data-dir", "{tmp}/data"], "--disk-budget 1"),
        (["demo", "--synthetic", "--disk-budget", "65536", "--data-dir", "{tmp}/data"], "--disk-budget 65536"),
        (["demo", "--synthetic", "--disk-budget", "1"], "--disk-budget 1"),
        (["doctor", "--config", ""], "--config: must not be empty"),
    ],
    ids=lambda a: " ".join(a) if isinstance(a, list) else "",
)
def test_option_values_the_engine_would_refuse_are_usage_errors(args, word, tmp_path):
    """--disk-budget 1 reached the engine and ended as "InvalidArgumentError:
    KVH_ERR_INVALID_ARG: disk_bytes 1 holds no block slot", exit 1, after
    the store's directory and LOCK were made; kvh doctor --config "" said
    "--config .: Is a directory". Usage errors naming the option now, with
    nothing written."""
    res = run_kvh(*(a.replace("{tmp}", str(tmp_path)) for a in args), cwd=tmp_path)
    assert_one_line_error(res, 2, word)
    assert "InvalidArgumentError" not in res.stderr and "Is a directory" not in res.stderr
    assert list(tmp_path.iterdir()) == []


def _tiny_model(tmp_path_factory):
    pytest.importorskip("gguf")
    from kvh_cache.model.testing import write_tiny_llama

    return write_tiny_llama(str(tmp_path_factory.mktemp("model") / "tiny.Q4_1.gguf"), qtype="Q4_1", seed=4)


@pytest.mark.parametrize("demo", [[], ["--models"]], ids=["model-demo", "models"])
@pytest.mark.parametrize("budget", ["1", "12287"])  # the tiny model's slot: 4 KiB + 8 KiB
def test_demo_disk_budget_below_one_slot_is_a_usage_error(demo, budget, tmp_path, tmp_path_factory):
    """Only the synthetic demo checked --disk-budget against one block slot:
    the model demo and --models reached the engine (InvalidArgumentError,
    exit 1) after making the data directory (and, for --models, writing
    the second model). Exit 2 naming --disk-budget, nothing created."""
    pytest.importorskip("regex")
    model = _tiny_model(tmp_path_factory)
    res = run_kvh("demo", *demo, "--model", model, "--disk-budget", budget, "--no-progress", cwd=tmp_path)
    assert_one_line_error(res, 2, f"--disk-budget {budget}")
    assert "InvalidArgumentError" not in res.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("what", ["truncated", "/dev/null", "fifo"])
@pytest.mark.parametrize(
    "args",
    [
        ["demo", "--models", "--model", "{model}", "--data-dir", "{tmp}/data"],
        ["bench", "offload", "--quick", "--", "--model", "{model}"],
        ["bench", "remote-ttft", "--quick", "--", "--model", "{model}"],
    ],
    ids=["demo-models", "bench-offload", "bench-remote-ttft"],
)
def test_model_that_is_not_a_usable_gguf_fails_with_1(args, what, tmp_path, capfd):
    """Outside kvh demo, a cut GGUF, /dev/null or a FIFO as --model was a
    bare ValueError that kvh reported as a usage error (2): a bad input
    file fails (1), in one line naming it, as kvh demo does."""
    pytest.importorskip("gguf")
    path = unusable_model(what, tmp_path)
    res = run_in_process([a.replace("{model}", str(path)).replace("{tmp}", str(tmp_path)) for a in args], capfd)
    assert_one_line_error(res, 1, str(path))
    assert "--model" in res.stderr.strip().splitlines()[-1]


def test_bench_trace_checks_its_disk_dir_first(tmp_path):
    # A --disk-dir that does not exist was found only once every simulation
    # had run, as "mkdtemp: No such file or directory" with no path named.
    missing = tmp_path / "missing"
    res = run_bench("trace", "--disk-dir", missing, "--quick")
    assert res.returncode == 2 and f"--disk-dir {missing}" in res.stderr and res.stdout == "", (res.stdout, res.stderr)
