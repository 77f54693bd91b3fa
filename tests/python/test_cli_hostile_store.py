"""kvh-store, `kvh store` and `kvh stats` against hostile input and
damaged, locked or crashed stores.

What the help and the README promise, checked from the outside:

* every command and subcommand answers --help with its usage and exit 0;
* a bad argument is one line on stderr and a non-zero exit (kvh: 2 for
  usage, 1 for a failed check or tool, 3 for "not available");
* the store tools are read-only: whatever they are pointed at is left as it
  was, and a damaged block is listed, never passed as good;
* a store held by a live engine is refused with the holder named, a second
  engine is refused rather than let in, and a writer killed with SIGKILL
  leaves a store that verifies and still holds every block that
  ``persist()`` acknowledged.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kvh_cache.tools import find_tool
from kvh_testutil import kv_data, make_engine

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TIMEOUT = 30  # a hang fails the test instead of the run

TOKENS = 48  # three 16-token blocks per chain
CHAINS = 3
DISK = 1 << 22  # 512 slots of 8 KiB (4 KiB header + 4 KiB block)
SLOT_BYTES = 8192
HEADER_BYTES = 4096
GEOMETRY = [
    "--layers",
    "2",
    "--kv-heads",
    "2",
    "--head-dim",
    "8",
    "--block-tokens",
    "16",
    "--dtype",
    "f32",
    "--model-salt",
    "0",
]


def _env(extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "python"), str(HERE), env.get("PYTHONPATH")) if p)
    for k in [k for k in env if k.startswith("KVH_") and k not in ("KVH_BUILD_DIR", "KVH_BENCH", "KVH_STORE")]:
        del env[k]
    env.update(extra or {})
    return env


def _store_tool() -> str:
    tool = find_tool("kvh-store")
    if tool is None:
        pytest.skip("kvh-store not built")
    return tool


def run_store(*args, env_extra=None, cwd=None):
    return subprocess.run(
        [_store_tool(), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=_env(env_extra),
        stdin=subprocess.DEVNULL,
        cwd=str(cwd) if cwd else None,
    )


def run_kvh(*args, env_extra=None, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "kvh_cache", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=_env(env_extra),
        stdin=subprocess.DEVNULL,
        cwd=str(cwd or REPO),
    )


def assert_one_line_error(res, rc=None, word=None):
    """A failure with a message: no traceback, no signal, nothing on stdout."""
    assert res.returncode > 0, (res.returncode, res.stdout[-1000:], res.stderr[-2000:])
    if rc is not None:
        assert res.returncode == rc, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    # argparse puts its usage block before the one line of the error
    while len(lines) > 1 and (lines[0].startswith("usage:") or lines[0][:1].isspace()):
        lines.pop(0)
    assert len(lines) == 1, res.stderr[-2000:]
    if word is not None:
        assert word in lines[0], res.stderr[-2000:]


def digest(d: Path, skip=()):
    out = {}
    for p in sorted(d.iterdir()):
        if p.name in skip:
            continue
        if p.is_file() and not p.is_symlink():
            out[p.name] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[p.name] = os.readlink(p) if p.is_symlink() else "dir"
    return out


def chain_tokens(i: int) -> np.ndarray:
    return np.arange(10_000 + 1_000 * i, 10_000 + 1_000 * i + TOKENS)


def fill(eng, seq, i: int) -> None:
    for layer in range(eng.num_layers):
        k, v = kv_data(TOKENS, eng.num_kv_heads, eng.head_dim, eng.np_dtype, seed=i * 100 + layer)
        seq.write_kv(layer, 0, k, v)


# The writer: persists chain after chain (start, start + 1, ...) and prints an
# acknowledgement after each persist() returned. With "hold" it opens the
# store, says R and waits for stdin to close.
WRITER = textwrap.dedent(
    """
    import sys
    from kvh_testutil import make_engine
    from test_cli_hostile_store import DISK, chain_tokens, fill
    store, mode, start, stop = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    eng = make_engine(disk_path=store, disk_bytes=DISK, migration_threads=2)
    print("R", flush=True)
    if mode == "hold":
        sys.stdin.read()
    else:
        for i in range(start, stop):
            seq = eng.sequence(tokens=chain_tokens(i))
            fill(eng, seq, i)
            if i % 2:
                seq.migrate("disk", wait=False).close()
            seq.persist()
            sys.stdout.write(f"A {i}\\n")  # one write: PYTHONUNBUFFERED would tear print's pieces
            sys.stdout.flush()
            seq.free()
        sys.stdin.read()
    eng.close()
    """
)


def start_writer(store: Path, mode: str, start: int = 0, stop: int = 0):
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, str(store), mode, str(start), str(stop)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=str(HERE),
    )


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A store of CHAINS chains (9 blocks in slots 0..8), written by a
    process that has exited: its LOCK names a pid that is gone."""
    d = tmp_path_factory.mktemp("hostile") / "store"
    try:
        make_engine(disk_path=str(d), disk_bytes=DISK).close()
    except Exception as exc:  # noqa: BLE001 - a build without the disk tier
        pytest.skip(f"no disk tier: {exc}")
    shutil.rmtree(d)
    w = start_writer(d, "write", 0, CHAINS)
    out, err = w.communicate(input="", timeout=TIMEOUT)
    assert w.returncode == 0, err
    assert out.split().count("A") == CHAINS
    return d


@pytest.fixture
def store(pristine, tmp_path):
    d = tmp_path / "store"
    shutil.copytree(pristine, d, symlinks=True)
    return d


def info_json(store: Path):
    res = run_store("info", store, "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def _summary(stdout: str):
    m = re.search(r"^(\d+) blocks checked, (\d+) bad$", stdout, re.M)
    assert m, stdout
    return int(m.group(1)), int(m.group(2))


# ---------------------------------------------------------------------------------
# kvh-store: --help of every subcommand, bad arguments
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args",
    [["--help"], ["-h"], ["info", "--help"], ["verify", "-h"], ["remote", "--help"], ["remote", "ping", "--help"]],
    ids=" ".join,
)
def test_store_tool_help_of_every_subcommand(args):
    res = run_store(*args)
    assert res.returncode == 0, (res.returncode, res.stderr)
    assert res.stdout.startswith("usage: kvh-store") and res.stderr == "", (res.stdout, res.stderr)


def test_verify_help_says_what_fails_it():
    """kvh-store verify exits 1 for index files a strict open refuses (a
    missing journal, a journal cut inside its header, an index older than
    its journal) with 0 bad blocks and records; its usage text and kvh
    store verify's help said it failed only for bad blocks or records."""
    res = run_store("--help")
    text = " ".join(res.stdout.split())
    assert "strict open" in text and "a missing journal" in text, res.stdout
    assert "an index older than its journal" in text and "1 bad blocks or index records found;" not in text
    res = run_kvh("store", "verify", "--help")
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())
    assert "strict open" in text and "a missing journal" in text and "index older than its journal" in text, text
    assert "exit 1 if any is bad" not in text


@pytest.mark.parametrize(
    "args,word",
    [
        ([], "usage"),
        (["bogus", "{store}"], "usage"),
        (["INFO", "{store}"], "usage"),
        (["remote"], "usage"),
        (["remote", "bogus"], "usage"),
        (["remote", "ping", "--bogus"], "--bogus"),
        (["remote", "verify", "--sample"], "needs a value"),
        (["remote", "verify", "--sample", ""], "--sample"),
        (["remote", "verify", "--sample", "0"], "--sample"),
        (["remote", "verify", "--sample", "-1"], "--sample"),
        (["remote", "verify", "--sample", "18446744073709551616"], "--sample"),
        (["remote", "verify", "--sample", "1e99"], "--sample"),
        (["remote", "verify", "--sample", "12abc"], "--sample"),
    ],
    ids=lambda a: " ".join(a) or "none" if isinstance(a, list) else None,
)
def test_store_tool_usage_errors(args, word, store):
    before = digest(store)
    res = run_store(*(a.replace("{store}", str(store)) for a in args), env_extra={"KVH_REMOTE_ADDRS": "127.0.0.1:1"})
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert res.stdout == "" and "Traceback" not in res.stderr and word in res.stderr, res.stderr
    assert digest(store) == before


@pytest.mark.parametrize(
    "args",
    [["info", "{store}", "--bogus"], ["verify", "{store}", "--jsonx"], ["info", "{store}", "--json", "extra"]],
    ids=" ".join,
)
def test_store_tool_rejects_unknown_trailing_arguments(args, store):
    # Only argv[3] is looked at: "--jsonx" prints text and anything after
    # --json is dropped, with exit 0.
    res = run_store(*(a.replace("{store}", str(store)) for a in args))
    assert res.returncode == 2, (res.returncode, res.stdout[-500:])
    assert res.stdout == "" and res.stderr.strip(), res.stderr


@pytest.mark.parametrize("action", ["info", "verify"])
def test_store_tool_takes_options_before_or_after_the_directory(action, store, tmp_path):
    # "kvh-store info --json DIR" said "unknown argument DIR".
    after = run_store(action, store, "--json")
    assert after.returncode == 0, after.stderr
    for args in (["--json", store], ["--json", "--", store]):
        res = run_store(action, *args)
        assert (res.returncode, res.stdout, res.stderr) == (0, after.stdout, ""), (args, res.stderr)
    # After "--", a directory named like an option is a directory.
    dashed = tmp_path / "--json"
    shutil.copytree(store, dashed, symlinks=True)
    res = run_store(action, "--", "--json", cwd=tmp_path)
    assert res.returncode == 0 and not res.stdout.startswith("{"), (res.stdout, res.stderr)
    res = run_store(action, "--json", "--", "--json", cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.startswith("{"), (res.stdout, res.stderr)


def test_store_tool_remote_takes_options_before_the_action():
    # "kvh-store remote --json count" was a usage error (the action had to
    # come first); nothing answers on port 1: exit 1, JSON or not.
    for args in (["--json", "count"], ["--sample", "3", "verify"], ["count", "--json"]):
        res = run_store("remote", *args, env_extra={"KVH_REMOTE_ADDRS": "127.0.0.1:1"})
        assert res.returncode == 1 and "answer" in res.stderr, (args, res.returncode, res.stderr)


@pytest.mark.parametrize(
    "path", ["", "{file}", "{file}/store", "{missing}"], ids=["empty", "file", "under-a-file", "missing"]
)
@pytest.mark.parametrize("action", ["info", "verify"])
def test_store_tool_on_non_directories(action, path, tmp_path):
    f = tmp_path / "plain"
    f.write_bytes(b"not a store")
    p = path.replace("{file}", str(f)).replace("{missing}", str(tmp_path / "missing"))
    res = run_store(action, p)
    assert_one_line_error(res, 2, "kvh-store:")
    assert res.stdout == ""
    assert f.read_bytes() == b"not a store" and sorted(os.listdir(tmp_path)) == ["plain"]


def test_store_tool_json_survives_odd_directory_names(store, tmp_path):
    # The path goes into the JSON as is: a quote or backslash in it makes
    # the line unparsable, and `kvh stats` (which reads it) fails.
    odd = tmp_path / 'my "kv" \\ store'
    store.rename(odd)
    res = run_store("info", odd, "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    assert doc["path"] == str(odd) and doc["blocks"] == CHAINS * 3
    res = run_kvh("stats", odd, "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["disk"]["used_blocks"] == CHAINS * 3


# ---------------------------------------------------------------------------------
# kvh-store: damaged stores are reported, and left as they were
# ---------------------------------------------------------------------------------
def _damage_slab(store: Path, how: str) -> None:
    slab = store / "slab-0000.kvh"
    if how == "data-flip":
        flip(slab, 2 * SLOT_BYTES + HEADER_BYTES + 100)
    elif how == "header-flip":
        flip(slab, 1 * SLOT_BYTES + 100)
    elif how == "cut":
        os.truncate(slab, 2 * SLOT_BYTES + 100)
    elif how == "empty":
        os.truncate(slab, 0)
    elif how == "missing":
        slab.unlink()
    elif how == "directory":
        slab.unlink()
        slab.mkdir()
    elif how == "devzero":
        slab.unlink()
        slab.symlink_to("/dev/zero")
    else:
        raise AssertionError(how)


@pytest.mark.parametrize(
    "how,bad_slots",
    [
        ("data-flip", [2]),
        ("header-flip", [1]),
        ("cut", list(range(2, 9))),
        ("empty", list(range(9))),
        ("missing", list(range(9))),
        ("directory", list(range(9))),
        ("devzero", list(range(9))),
    ],
)
def test_verify_lists_every_damaged_block(how, bad_slots, store):
    _damage_slab(store, how)
    before = digest(store)
    res = run_store("verify", store)
    assert res.returncode == 1, (res.returncode, res.stdout, res.stderr)
    listed = sorted(int(m) for m in re.findall(r"^BAD slot (\d+) ", res.stdout, re.M))
    assert listed == bad_slots, res.stdout
    assert _summary(res.stdout) == (CHAINS * 3, len(bad_slots))
    res = run_store("verify", store, "--json")
    assert res.returncode == 1
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert sorted(r["slot"] for r in rows[:-1] if r.get("ok") is False) == bad_slots
    assert rows[-1] == {"blocks": CHAINS * 3, "bad": len(bad_slots), "bad_records": 0}
    # info still reads the index; neither tool touched a byte
    assert info_json(store)["blocks"] == CHAINS * 3
    assert digest(store) == before
    # kvh store verify passes the verdict on, with kvh-store's reason (it
    # was once called a failure that "gave no reason")
    res = run_kvh("store", "verify", store)
    assert res.returncode == 1 and "BAD slot" in res.stdout, res.stdout + res.stderr
    assert f"{len(bad_slots)} of {CHAINS * 3} block(s) bad" in res.stderr, res.stderr
    assert "gave no reason" not in res.stderr, res.stderr


def test_verify_damaged_block_is_never_served(store):
    # The block verify lists is the one an engine refuses (a miss, counted).
    _damage_slab(store, "data-flip")
    res = run_store("verify", store)
    (bad_hash,) = re.findall(r"^BAD slot 2 hash ([0-9a-f]{16}):", res.stdout, re.M)
    with make_engine(disk_path=str(store), disk_bytes=DISK) as eng:
        matched = []
        for i in range(CHAINS):
            with eng.sequence() as s:
                m = s.match_prefix(chain_tokens(i))
                matched.append(m)
                for layer in range(eng.num_layers):
                    if m == 0:
                        break
                    k, v = s.read_kv(layer)
                    rk, rv = kv_data(TOKENS, eng.num_kv_heads, eng.head_dim, eng.np_dtype, seed=i * 100 + layer)
                    np.testing.assert_array_equal(k, rk[:m])
                    np.testing.assert_array_equal(v, rv[:m])
        assert eng.stats().corrupt_blocks == 1
    # the chain through slot 2 ends where it begins; the other chains are whole
    assert CHAINS * TOKENS - sum(matched) in (16, 32, 48), matched
    assert sorted(matched)[1:] == [TOKENS] * (CHAINS - 1), matched
    assert bad_hash


@pytest.mark.parametrize("how", ["index-records-cut", "index-record-flip", "journal-garbage"])
def test_verify_counts_blocks_and_index_records_apart(how, store):
    # Every slot still verifies (the open rebuilds the index from the slot
    # headers, README "A damaged index or journal costs no block whose slot
    # verifies"), yet the summary said "9 blocks checked, 9 bad" with no
    # block listed: the damaged index records were added to the bad blocks.
    if how == "index-records-cut":
        os.truncate(store / "index", 4096)
    elif how == "index-record-flip":
        flip(store / "index", 4096 + 100)
    else:
        (store / "journal").write_bytes(os.urandom(4096))
    res = run_store("verify", store)
    assert res.returncode == 1, res.stdout + res.stderr  # a damaged index is still a failed verification
    assert re.search(r"^BAD \d+ index records or headers damaged or missing", res.stdout, re.M), res.stdout
    listed = re.findall(r"^BAD slot ", res.stdout, re.M)
    checked, bad = _summary(res.stdout)
    assert checked == CHAINS * 3
    assert bad == len(listed) == 0, res.stdout


def test_verify_accepts_a_torn_journal_tail(store):
    # What a crash mid-append leaves: a partial record at the end.
    with open(store / "journal", "ab") as f:
        f.write(os.urandom(10))
    res = run_store("verify", store)
    assert res.returncode == 0 and _summary(res.stdout) == (CHAINS * 3, 0), res.stdout + res.stderr
    # Said, though: a strict open cuts the journal there, a lenient one
    # rebuilds from the slots, and the two can keep different blocks.
    assert re.search(r"^NOTE the journal ends in a torn or damaged record", res.stdout, re.M), res.stdout
    res = run_store("verify", "--json", store)
    assert res.returncode == 0 and json.loads(res.stdout.splitlines()[-1]).get("torn_tail") is True, res.stdout


def test_verify_of_a_sound_store_notes_nothing(store):
    res = run_store("verify", store)
    assert res.returncode == 0 and "NOTE" not in res.stdout, res.stdout
    res = run_store("verify", "--json", store)
    assert "torn_tail" not in res.stdout, res.stdout


@pytest.mark.parametrize("how", ["empty", "zeroed", "directory", "journal-copy", "other-format"])
def test_unreadable_index_is_refused_then_rebuilt_by_an_engine(how, store):
    idx = store / "index"
    if how == "empty":
        idx.write_bytes(b"")
    elif how == "zeroed":
        idx.write_bytes(bytes(4096) + idx.read_bytes()[4096:])
    elif how == "directory":
        idx.unlink()
        idx.mkdir()
    elif how == "journal-copy":
        idx.write_bytes((store / "journal").read_bytes())
    else:
        idx.write_bytes(b"SQLite format 3\x00" + bytes(4080))
    before = digest(store)
    for action in ("info", "verify"):
        res = run_store(action, store)
        assert "Traceback" not in res.stderr and res.returncode >= 0, res.stderr
        if res.returncode == 2:  # no geometry to go by: refused, one line
            assert_one_line_error(res, 2, str(store))
            assert res.stdout == ""
            if how == "directory":  # said as it is, not "Operation not permitted"
                assert "index: Is a directory" in res.stderr, res.stderr
        elif action == "info":  # a header that reads: the damage is counted
            assert res.returncode == 0 and re.search(r"^bad records   [1-9]", res.stdout, re.M), res.stdout
        else:
            assert res.returncode == 1 and "BAD" in res.stdout, res.stdout
    assert digest(store) == before
    # kvh stats only reports: it refuses the damaged store, which it leaves as it was.
    res = run_kvh("stats", store, *GEOMETRY, "--json")
    assert_one_line_error(res, 1)
    assert digest(store) == before
    if how == "directory":
        return  # nothing to rebuild into
    # An engine open rebuilds the index from the slot headers: every block
    # is back, and verifies.
    with make_engine(disk_path=str(store), disk_bytes=DISK) as eng:
        assert eng.tier_info("disk").used_blocks == CHAINS * 3
    res = run_store("verify", store)
    assert res.returncode == 0 and _summary(res.stdout) == (CHAINS * 3, 0), res.stdout + res.stderr


# ---------------------------------------------------------------------------------
# kvh store / kvh stats: exit codes and paths
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("what", ["empty-dir", "garbage-index", "plain-file", "under-a-file"])
@pytest.mark.parametrize("action", ["info", "verify"])
def test_kvh_store_failure_is_exit_1(action, what, tmp_path):
    # kvh's help: "Exit status: 0 ok, 1 failed (a check, a verification or
    # the wrapped tool), 2 usage". A directory that holds no store is not a
    # usage error, and a missing one already exits 1.
    _store_tool()
    p = tmp_path / "x"
    if what in ("empty-dir", "garbage-index"):
        p.mkdir()
    if what == "garbage-index":
        (p / "index").write_bytes(b"\x00" * 100)
    if what == "plain-file":
        p.write_bytes(b"x")
    if what == "under-a-file":
        p.write_bytes(b"x")
        p = p / "store"
    res = run_kvh("store", action, p)
    assert_one_line_error(res, 1)


def test_kvh_store_on_a_live_store_is_exit_1(pristine, tmp_path):
    d = tmp_path / "store"
    shutil.copytree(pristine, d)
    w = start_writer(d, "hold")
    try:
        assert w.stdout.readline().strip() == "R", w.stderr.read()
        res = run_kvh("store", "verify", d)
        assert_one_line_error(res, 1, str(w.pid))
    finally:
        w.communicate(input="", timeout=TIMEOUT)


@pytest.mark.parametrize("cmd", [["stats"], ["store", "info"], ["store", "verify"]], ids=" ".join)
def test_kvh_empty_dir_argument_is_not_the_current_directory(cmd, store):
    # Path("") is ".": `kvh stats ""` opened the store in the working
    # directory with an engine.
    before = digest(store, skip=("LOCK",))
    res = run_kvh(*cmd, "", cwd=store)
    assert_one_line_error(res, 2)
    assert digest(store, skip=("LOCK",)) == before


def test_kvh_store_dir_after_double_dash(store, tmp_path):
    # The POSIX way to name a path that starts with "-".
    dashed = tmp_path / "-store"
    store.rename(dashed)
    res = run_kvh("store", "info", "--json", "--", "-store", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1])["blocks"] == CHAINS * 3


@pytest.mark.parametrize(
    "flag,value",
    [("--layers", "0"), ("--kv-heads", "0"), ("--head-dim", "0"), ("--block-tokens", "0"), ("--block-tokens", "17")],
)
def test_kvh_stats_out_of_range_geometry_is_usage(flag, value, store):
    # --layers -1 is a usage error (2); --layers 0 was "cannot open" (1).
    res = run_kvh("stats", store, flag, value)
    assert_one_line_error(res, 2, flag)


@pytest.mark.parametrize("value", ["0", "", "1e99", "12abc", "-1", "18446744073709551616"])
def test_kvh_store_remote_bad_sample(value):
    _store_tool()
    res = run_kvh("store", "remote", "verify", "--sample", value, env_extra={"KVH_REMOTE_ADDRS": "127.0.0.1:1"})
    assert_one_line_error(res, 2, "--sample")


# ---------------------------------------------------------------------------------
# locks: a live writer, a reader holding the store
# ---------------------------------------------------------------------------------
def test_live_writer_is_named_and_its_store_left_alone(pristine, tmp_path):
    d = tmp_path / "store"
    shutil.copytree(pristine, d)
    w = start_writer(d, "hold")
    try:
        assert w.stdout.readline().strip() == "R", w.stderr.read()
        assert (d / "LOCK").read_text().strip() == str(w.pid)
        before = digest(d)
        for action in ("info", "verify"):
            res = run_store(action, d)
            assert_one_line_error(res, 2, f"open in process {w.pid}")
            assert res.stdout == ""
        res = run_kvh("stats", d)
        assert_one_line_error(res, 1, str(w.pid))
        res = run_kvh("stats", d, *GEOMETRY)
        assert_one_line_error(res, 1, f"open in process {w.pid}")
        assert digest(d) == before
        assert w.poll() is None
    finally:
        out, err = w.communicate(input="", timeout=TIMEOUT)
    assert w.returncode == 0, err
    res = run_store("verify", d)
    assert res.returncode == 0 and _summary(res.stdout) == (CHAINS * 3, 0), res.stdout + res.stderr


def test_engine_refused_while_a_reader_holds_the_store(store):
    # kvh-store holds LOCK shared while it reads; an engine opened meanwhile
    # must be refused, naming a holder that exists. The writer that made the
    # store closed it, which empties LOCK; one killed instead leaves its pid
    # there, as this one of a process that has exited.
    assert (store / "LOCK").read_text() == ""
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = gone.pid
    (store / "LOCK").write_text(f"{stale}\n")
    fd = os.open(store / "LOCK", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        res = run_kvh("stats", store, *GEOMETRY)
        assert_one_line_error(res, 1, "in use")
        named = [int(p) for p in re.findall(r"process (\d+)", res.stderr)]
        assert stale not in named, f"names process {stale}, which has exited: {res.stderr.strip()}"
        for pid in named:
            os.kill(pid, 0)  # alive, or ProcessLookupError fails the test
    finally:
        os.close(fd)
    res = run_store("verify", store)
    assert res.returncode == 0 and _summary(res.stdout) == (CHAINS * 3, 0), res.stdout + res.stderr


def test_second_engine_refused_while_writer_lives(pristine, tmp_path):
    d = tmp_path / "store"
    shutil.copytree(pristine, d)
    w = start_writer(d, "hold")
    try:
        assert w.stdout.readline().strip() == "R", w.stderr.read()
        w2 = start_writer(d, "hold")
        out, err = w2.communicate(input="", timeout=TIMEOUT)
        assert w2.returncode != 0 and "R" not in out.split()
        assert f"open in process {w.pid}" in err, err
        assert (d / "LOCK").read_text().strip() == str(w.pid)
    finally:
        w.communicate(input="", timeout=TIMEOUT)
    assert w.returncode == 0


# ---------------------------------------------------------------------------------
# SIGKILL of a writer, then the tools
# ---------------------------------------------------------------------------------
def test_sigkill_writer_then_tools_keep_every_acknowledged_block(tmp_path):
    store = tmp_path / "store"
    acked = set()
    for cycle in range(3):
        w = start_writer(store, "write", 100 * cycle, 100 * cycle + 40)
        try:
            assert w.stdout.readline().strip() == "R", w.stderr.read()
            lines = [w.stdout.readline() for _ in range(3 + 2 * cycle)]
            w.send_signal(signal.SIGKILL)
            w.wait(timeout=TIMEOUT)
            assert w.returncode == -signal.SIGKILL
            for line in lines + w.stdout.read().splitlines():
                words = line.split()
                if len(words) == 2 and words[0] == "A":  # a line the kill cut short acknowledges nothing
                    acked.add(int(words[1]))
        finally:
            if w.poll() is None:
                w.kill()
                w.wait()
            w.stdin.close()
            w.stdout.close()
            w.stderr.close()
        # The dead writer's pid is in LOCK; the tools are not held back by it.
        assert (store / "LOCK").read_text().strip() == str(w.pid)
        before = digest(store)
        res = run_store("verify", store)
        assert res.returncode == 0, res.stdout + res.stderr
        checked, bad = _summary(res.stdout)
        assert bad == 0 and checked >= 3 * len(acked), (checked, len(acked))
        info = info_json(store)
        assert info["blocks"] >= 3 * len(acked) and info["bad_records"] == 0, info
        assert digest(store) == before  # read-only, even on a crashed store
    assert len(acked) >= 3 + 5 + 7
    res = run_kvh("stats", store, "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["stats"]["corrupt_blocks"] == 0 and doc["disk"]["used_blocks"] >= 3 * len(acked)
    with make_engine(disk_path=str(store), disk_bytes=DISK) as eng:
        for i in sorted(acked):
            with eng.sequence() as s:
                assert s.match_prefix(chain_tokens(i)) == TOKENS, f"chain {i} was acknowledged"
                k, v = s.read_kv(1)
                rk, rv = kv_data(TOKENS, eng.num_kv_heads, eng.head_dim, eng.np_dtype, seed=i * 100 + 1)
                np.testing.assert_array_equal(k, rk)
                np.testing.assert_array_equal(v, rv)
        assert eng.stats().corrupt_blocks == 0
    res = run_store("verify", store)
    assert res.returncode == 0 and _summary(res.stdout)[1] == 0, res.stdout


def _crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def _forged_store(d: Path, parents) -> None:
    """An index of one record per (hash, parent) pair, with valid checksums
    (they are not keyed): 1 layer, 1 head, head_dim 64, 16-token f16
    blocks, 4 KiB slots (the layout of core/disk_format.c)."""

    def header(kind: int, seq: int, n: int) -> bytes:
        h = bytearray(4096)
        h[0:8] = b"KVHIDX\0\1"
        struct.pack_into("<IIQQQ", h, 8, 1, kind, 42, seq, n)
        struct.pack_into("<IIIII", h, 40, 1, 1, 64, 16, 1)
        struct.pack_into("<QQ", h, 64, 0, 4096)
        struct.pack_into("<I", h, 80, _crc32c(bytes(h[:80])))
        return bytes(h)

    def record(slot: int, h: int, parent: int) -> bytes:
        r = bytearray(48 + 64 + 4)
        struct.pack_into("<IIQQQQI", r, 0, 0x524A564B, 1, 1, slot, h, parent, 16)
        struct.pack_into("<I", r, len(r) - 4, _crc32c(bytes(r[:-4])))
        return bytes(r)

    d.mkdir(mode=0o700)
    recs = b"".join(record(i, h, p) for i, (h, p) in enumerate(parents))
    (d / "index").write_bytes(header(1, 1, len(parents)) + recs)
    (d / "journal").write_bytes(header(2, 2, 0))


@pytest.mark.parametrize("parents", [[(0xAAAA, 0xBBBB), (0xBBBB, 0xAAAA)], [(0xCCCC, 0xCCCC)]])
def test_info_on_forged_parent_cycles_ends(parents, tmp_path):
    # Parents in a cycle (two records naming each other, or one its own):
    # the chain walk stopped one push too late (a write past its stack).
    d = tmp_path / "forged"
    _forged_store(d, parents)
    res = run_store("info", d, "--json")
    assert res.returncode in (0, 1), res.stderr
    if res.returncode == 0:
        info = json.loads(res.stdout.strip().splitlines()[-1])
        assert info["blocks"] == len(parents), info
        # a chain longer than the store had blocks was reported
        assert info["longest_chain_blocks"] == 0, info
    # verify passed such records: no chain of hashes makes a cycle
    res = run_store("verify", d)
    assert res.returncode == 1
    assert re.search(rf"^BAD {len(parents)} index records are in, or descend from, a cycle", res.stdout, re.M), (
        res.stdout
    )


REC_BYTES = 48 + 4 * 16 + 4  # an index record of 16-token blocks (core/disk_format.c)


def _rewrite_header(path: Path, offset: int, fmt: str, *values) -> None:
    """Sets fields of an index or journal header, its checksum made anew."""
    h = bytearray(path.read_bytes())
    struct.pack_into(fmt, h, offset, *values)
    struct.pack_into("<I", h, 80, _crc32c(bytes(h[:80])))
    path.write_bytes(bytes(h))


def test_verify_reports_a_record_naming_a_slot_past_the_slabs(store):
    # A record (valid checksum) naming slot 2^32: the load drops it as past
    # the store's end, and verify said "8 blocks checked, 0 bad", exit 0.
    ix = bytearray((store / "index").read_bytes())
    at = 4096 + 2 * REC_BYTES
    struct.pack_into("<Q", ix, at + 16, 1 << 32)
    struct.pack_into("<I", ix, at + REC_BYTES - 4, _crc32c(bytes(ix[at : at + REC_BYTES - 4])))
    (store / "index").write_bytes(bytes(ix))
    res = run_store("verify", store)
    assert res.returncode == 1, res.stdout + res.stderr
    assert re.search(r"^BAD 1 index records name slots past the store's slab files", res.stdout, re.M), res.stdout
    res = run_store("verify", "--json", store)
    assert json.loads(res.stdout.splitlines()[-1])["records_past_end"] == 1, res.stdout


def test_an_impossible_record_count_is_one_bad_header(store):
    # n_records 2^64 - 1 in a header whose checksum holds: reported as
    # 18446744073709551603 bad records.
    _rewrite_header(store / "index", 32, "<Q", (1 << 64) - 1)
    res = run_store("verify", "--json", store)
    assert res.returncode == 1, res.stdout + res.stderr
    assert json.loads(res.stdout.splitlines()[-1])["bad_records"] == 1, res.stdout
    assert info_json(store)["bad_records"] == 1


def test_slots_of_another_geometry_are_bad_and_never_served(store):
    # Both headers rewritten (checksums valid) from 2 layers x 8 dim to
    # 1 layer x 16 dim, the same block size: every slot's header still
    # carries the geometry that wrote it. verify passed, and an engine of
    # the new geometry served the blocks, their bytes read as another
    # layout.
    for name in ("index", "journal"):
        _rewrite_header(store / name, 40, "<III", 1, 2, 16)
    res = run_store("verify", store)
    assert res.returncode == 1, res.stdout + res.stderr
    assert len(re.findall(r"^BAD slot \d+ .*another geometry", res.stdout, re.M)) == CHAINS * 3, res.stdout
    with make_engine(num_layers=1, head_dim=16, disk_path=str(store), disk_bytes=DISK) as eng:
        with eng.sequence() as s:
            assert s.match_prefix(chain_tokens(0)) == 0
        assert eng.stats().corrupt_blocks >= 1


def test_verify_says_why_it_cannot_read_a_slot(store):
    # A header block size of 2^40 bytes (checksum valid): verify exited 2
    # with no word at all.
    _rewrite_header(store / "index", 72, "<Q", 1 << 40)
    res = run_store("verify", store)
    assert res.returncode == 2
    assert "cannot allocate" in res.stderr and str(1 << 40) in res.stderr, res.stderr


@pytest.mark.parametrize("index_damage", ["journal removed", "torn journal tail"])
def test_verify_counts_damaged_blocks_when_the_index_is_rebuilt(store, index_damage):
    """Where the index must be rebuilt from the slots, a slot that fails its
    check is dropped from the list: verify must still count it bad."""
    flip(store / "slab-0000.kvh", 1 * SLOT_BYTES + 4096 + 2)  # slot 1's data
    if index_damage == "journal removed":
        (store / "journal").unlink()
    else:
        with open(store / "journal", "ab") as f:
            f.write(os.urandom(10))
    res = run_store("verify", store)
    checked, bad = _summary(res.stdout)
    assert res.returncode == 1 and bad >= 1, res.stdout + res.stderr


@pytest.mark.parametrize("journal", ["removed", 100, 2000, 4095], ids=lambda j: f"cut at {j}" if j != "removed" else j)
def test_verify_fails_on_a_journal_a_strict_open_refuses(journal, store, tmp_path):
    """The journal gone beside the index, or cut inside its header page (its
    header still reads): every block verifies, and verify said "9 blocks
    checked, 0 bad" with exit 0, while an engine with disk_strict_index
    refuses the store as damaged."""
    if journal == "removed":
        (store / "journal").unlink()
    else:
        os.truncate(store / "journal", journal)
    what = "the journal file is missing" if journal == "removed" else "the journal is cut inside its header page"
    strict = tmp_path / "strict"
    shutil.copytree(store, strict, symlinks=True)
    import kvh_cache as kvh

    with pytest.raises(kvh.CorruptionError, match=what):
        make_engine(disk_path=str(strict), disk_bytes=DISK, disk_strict_index=True)
    before = digest(store)
    res = run_store("verify", store)
    assert res.returncode == 1, res.stdout + res.stderr
    assert re.search(rf"^BAD {what} \(.*disk_strict_index", res.stdout, re.M), res.stdout
    assert _summary(res.stdout) == (CHAINS * 3, 0), res.stdout
    res = run_store("verify", store, "--json")
    assert res.returncode == 1, res.stdout + res.stderr
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary == {"blocks": CHAINS * 3, "bad": 0, "bad_records": 0, "damage": what}, summary
    assert digest(store) == before


def test_verify_takes_the_geometry_from_the_journal_when_the_index_is_gone(store, tmp_path):
    """With the index removed and the journal beside the slabs, an engine
    rebuilds every block, but verify said "not a kvh store" (exit 2) and
    checked nothing."""
    (store / "index").unlink()
    strict = tmp_path / "strict"
    shutil.copytree(store, strict, symlinks=True)
    import kvh_cache as kvh

    with pytest.raises(kvh.CorruptionError, match="the index file is missing"):
        make_engine(disk_path=str(strict), disk_bytes=DISK, disk_strict_index=True)
    before = digest(store)
    res = run_store("verify", store)
    assert res.returncode == 1, res.stdout + res.stderr
    assert re.search(r"^BAD the index file is missing \(.*disk_strict_index", res.stdout, re.M), res.stdout
    assert _summary(res.stdout) == (CHAINS * 3, 0), res.stdout
    assert info_json(store)["blocks"] == CHAINS * 3
    assert digest(store) == before  # a reader writes no index
    with make_engine(disk_path=str(store), disk_bytes=DISK) as eng:
        assert eng.tier_info("disk").used_blocks == CHAINS * 3


def test_verify_without_index_or_journal_says_why_it_stops(store):
    (store / "index").unlink()
    (store / "journal").unlink()
    res = run_store("verify", store)
    assert_one_line_error(res, 2, str(store))
    assert "geometry" in res.stderr and "rebuilds" in res.stderr, res.stderr


def _int8_store(tmp_path):
    """A store of one persisted chain under the int8 codec."""
    d = tmp_path / "store"
    with make_engine(disk_path=str(d), disk_bytes=DISK, kv_codec="int8") as eng:
        seq = eng.sequence(tokens=chain_tokens(0))
        fill(eng, seq, 0)
        seq.persist()
    return d


def test_info_and_stats_read_a_codec_store(tmp_path):
    d = _int8_store(tmp_path)
    info = info_json(d)
    assert info["kv_codec"] == "int8" and info["dtype"] in ("f32", "f16", "bf16")
    res = run_kvh("stats", d)
    assert res.returncode == 0, res.stdout + res.stderr
    # The codec is part of the geometry, and a block is stored smaller:
    # the text said neither.
    assert "kv codec int8" in res.stdout and "stored)" in res.stdout, res.stdout
    res = run_kvh("stats", d, "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["kv_codec"] == "int8", res.stdout


def test_a_store_named_by_bytes_that_are_not_utf8(tmp_path):
    """kvh-store info --json wrote the name's raw 0xff byte (not JSON) and
    kvh stats failed decoding it: the name is U+FFFD in JSON now, and
    stats reads the store."""
    d = _int8_store(tmp_path)
    odd = Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/st\xffore"))
    os.rename(d, odd)
    info = info_json(odd)
    assert info["kv_codec"] == "int8" and "\ufffd" in json.dumps(info, ensure_ascii=False)
    # (it prints the name as the bytes it is, as ls does)
    res = subprocess.run(
        [sys.executable, "-m", "kvh_cache", "stats", odd],
        capture_output=True,
        timeout=TIMEOUT,
        env=_env(None),
        cwd=REPO,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_stats_of_a_codec_store_without_kvh_store(tmp_path):
    # With kvh-store failing, the codec fell back to "none" and the engine's
    # refusal told a CLI user to "pass disk_reset_on_mismatch=True". kvh
    # stats checks the store with kvh-store before opening it: without it,
    # it opens nothing.
    d = _int8_store(tmp_path)
    before = digest(d)
    failing = {"KVH_STORE": shutil.which("false") or "/bin/false"}
    for codec in ([], ["--kv-codec", "int8"]):
        res = run_kvh("stats", d, *GEOMETRY, *codec, env_extra=failing)
        assert_one_line_error(res, 1, "kvh-store")
        assert "disk_reset_on_mismatch" not in res.stderr
    assert digest(d) == before
    res = run_kvh("stats", d, *GEOMETRY, "--kv-codec", "int8")
    assert res.returncode == 0, res.stdout + res.stderr
    res = run_kvh("stats", d, "--kv-codec", "none")
    assert_one_line_error(res, 1, "--kv-codec")
    res = run_kvh("stats", d, "--kv-codec", "q8_bogus")
    assert_one_line_error(res, 2, "--kv-codec")


def test_stats_geometry_mismatch_names_the_option(store):
    res = run_kvh("stats", store, "--model-salt", "7")
    assert_one_line_error(res, 1, "--model-salt")
    assert "disk_reset_on_mismatch" not in res.stderr


@pytest.mark.parametrize("damage", ["none", "truncated-slab", "bad-record"])
def test_stats_never_rewrites_the_store(damage, store):
    """kvh stats opened a store whose slab was cut short with an engine,
    whose recovery dropped the index records past the slab's end and
    rewrote the index, then reported 0 corrupt blocks and exit 0. It
    refuses a damaged store now, and leaves every file as it was; a sound
    store is read, and only its LOCK (the holder's pid) is written."""
    slab = store / "slab-0000.kvh"
    if damage == "truncated-slab":
        os.truncate(slab, 4 * SLOT_BYTES)  # the 9 blocks are in slots 0..8
    elif damage == "bad-record":
        flip(store / "index", HEADER_BYTES + 20)  # the first record's body
    before = digest(store)
    res = run_kvh("stats", store)
    if damage == "none":
        assert res.returncode == 0, res.stderr
        assert digest(store, skip=("LOCK",)) == {k: v for k, v in before.items() if k != "LOCK"}
        return
    assert_one_line_error(res, 1, "kvh store verify")
    assert "damaged" in res.stderr and res.stdout == ""
    assert digest(store) == before
    res = run_kvh("stats", store, *GEOMETRY, "--json")
    assert_one_line_error(res, 1, "damaged")
    assert digest(store) == before


@pytest.mark.parametrize("stray", ["slab-0001.kvh", "slab-0007.kvh"])
def test_stats_leaves_slab_files_past_the_store_alone(stray, store):
    """A slab file after one that is not full (a copy put there, or one an
    engine opened smaller left behind) was counted into the store's size:
    each kvh stats grew slab-0000.kvh by its size, and reported the slots
    of a store it had just resized."""
    shutil.copy(store / "slab-0000.kvh", store / stray)
    before = digest(store, skip=("LOCK",))
    for _ in range(2):
        res = run_kvh("stats", store, "--json")
        assert res.returncode == 0, res.stderr
        assert digest(store, skip=("LOCK",)) == before
    assert info_json(store)["slots"] == (store / "slab-0000.kvh").stat().st_size // SLOT_BYTES


def test_stats_refuses_a_slab_larger_than_an_engine_makes(store):
    slab = store / "slab-0000.kvh"
    with open(slab, "r+b") as f:
        f.truncate((1 << 30) + SLOT_BYTES)  # sparse: no disk space used
    before = digest(store, skip=("LOCK",))
    res = run_kvh("stats", store)
    assert_one_line_error(res, 1, "slab-0000.kvh holds")
    assert digest(store, skip=("LOCK",)) == before


@pytest.mark.parametrize("damage", ["truncated", "directory"])
def test_stats_on_a_slab_smaller_than_a_slot(damage, store):
    # "disk_bytes 4096 holds no block slot": disk_bytes was never the user's.
    slab = store / "slab-0000.kvh"
    if damage == "truncated":
        os.truncate(slab, HEADER_BYTES)
    else:
        slab.unlink()
        slab.mkdir()
        (slab / "filler").write_bytes(b"x" * SLOT_BYTES)
    before = digest(store, skip=("LOCK",))
    res = run_kvh("stats", store)
    assert_one_line_error(res, 1, "kvh store verify")
    assert "disk_bytes" not in res.stderr
    assert digest(store, skip=("LOCK",)) == before


@pytest.mark.parametrize("forged", ["dtype 7", "codec 4"])
def test_unknown_dtype_or_codec_is_a_damaged_header(forged, store):
    # The index header's dtype field (offset 56) packs the dtype (low 16
    # bits) and the KV codec (above); checksums recomputed. One that no
    # engine has passed verify and printed as "?". The tools take the
    # geometry from the journal's header then, and count the index's as
    # damaged.
    idx = store / "index"
    b = bytearray(idx.read_bytes())
    dtype = struct.unpack_from("<I", b, 56)[0]
    struct.pack_into("<I", b, 56, 7 if forged == "dtype 7" else (dtype & 0xFFFF) | 4 << 16)
    struct.pack_into("<I", b, 80, _crc32c(bytes(b[:80])))
    idx.write_bytes(bytes(b))
    before = digest(store)
    res = run_store("info", store)
    assert res.returncode == 0 and re.search(r"^bad records   1$", res.stdout, re.M), res.stdout + res.stderr
    res = run_store("verify", store)
    assert res.returncode == 1 and re.search(r"^BAD the index header is damaged", res.stdout, re.M), res.stdout
    assert _summary(res.stdout) == (CHAINS * 3, 0), res.stdout
    (store / "journal").unlink()  # no header left to go by
    before = digest(store)
    for action in ("info", "verify"):
        res = run_store(action, store)
        assert_one_line_error(res, 2, "no readable index or journal header")
        assert res.stdout == "", res.stdout
    res = run_kvh("stats", store, *GEOMETRY, "--json")
    assert_one_line_error(res, 1)
    assert digest(store) == before
    # An engine of the store's true geometry rebuilds it from the slot headers.
    with make_engine(disk_path=str(store), disk_bytes=DISK) as eng:
        assert eng.tier_info("disk").used_blocks == CHAINS * 3
    res = run_store("verify", store)
    assert res.returncode == 0 and _summary(res.stdout) == (CHAINS * 3, 0), res.stdout + res.stderr


def test_stats_of_a_store_without_its_journal_gives_cli_advice(store):
    """With its journal removed, kvh stats said "(pass
    disk_reset_on_mismatch=True to start it empty)": advice for the Python
    API, which kvh stats never takes. It points at kvh store verify."""
    (store / "journal").unlink()
    for extra in ([], ["--json"]):
        res = run_kvh("stats", store, *extra)
        assert_one_line_error(res, 1, "kvh store verify")
        assert "disk_reset_on_mismatch" not in res.stderr and "KVH_DISK_RESET_ON_MISMATCH" not in res.stderr


def test_stats_of_a_store_named_with_a_leading_dash(pristine, tmp_path):
    """A store directory whose name starts with "-" is read after --, as a
    directory and not as an option, with and without --json."""
    shutil.copytree(pristine, tmp_path / "-store", symlinks=True)
    res = run_kvh("stats", "--", "-store", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "-store" in res.stdout and "disk slots" in res.stdout
    res = run_kvh("stats", "--json", "--", "-store", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["path"] == "-store" and out["disk"]["used_blocks"] == CHAINS * TOKENS // 16
    res = run_kvh("stats", "--", "-nostore", cwd=tmp_path)
    assert_one_line_error(res, 1, "-nostore")


def test_info_on_a_store_others_may_write_says_an_engine_refuses_it(store):
    # stdout said an engine refuses the store while stderr advised that an
    # engine "narrows it to 0700/0600 on its next open".
    store.chmod(0o777)
    try:
        res = run_store("info", store)
    finally:
        store.chmod(0o700)
    assert res.returncode == 0, res.stderr
    assert "writable by other users: an engine refuses it" in res.stdout
    assert "writable by other users: an engine refuses it" in res.stderr and "narrows" not in res.stderr, res.stderr


def test_verify_of_a_codec_slab_cut_inside_a_slot_padding(tmp_path):
    """An encoded block fills its slot only in part: a slab cut past the
    block's bytes loses nothing and an engine serves the block, but
    verify called it a short read (BAD)."""
    d = _int8_store(tmp_path)
    info = info_json(d)
    slot = 4096 + -(-info["block_bytes"] // 4096) * 4096
    assert info["block_bytes"] % 4096, "the geometry must leave padding in a slot"
    slab = d / "slab-0000.kvh"
    last = info["blocks"] - 1
    os.truncate(slab, last * slot + 4096 + info["block_bytes"])  # the last slot's padding gone
    res = run_store("verify", d)
    assert res.returncode == 0 and _summary(res.stdout) == (info["blocks"], 0), res.stdout + res.stderr
    os.truncate(slab, last * slot + 4096 + info["block_bytes"] - 1)  # one byte of the block gone
    res = run_store("verify", d)
    assert res.returncode == 1 and _summary(res.stdout) == (info["blocks"], 1), res.stdout + res.stderr


def test_info_as_a_user_who_cannot_read_the_store_says_so(pristine):
    """kvh-store info run by another user on a store whose directory it may
    search but whose 0600 files it may not read said the store had no
    readable header and that an engine would rebuild its index: the cause
    is a permission, and nothing is wrong with the store."""
    if os.geteuid() != 0:
        pytest.skip("only root can run the tool as another user here")
    tool = _store_tool()
    if not os.access(tool, os.X_OK) or any(
        not (os.stat(p).st_mode & 0o001) for p in Path(tool).resolve().parents if str(p) != "/"
    ):
        pytest.skip("the build tree is out of another user's reach")
    base = Path(tempfile.mkdtemp(prefix="kvh-store-perm-", dir="/tmp"))
    try:
        os.chmod(base, 0o755)
        d = base / "store"
        shutil.copytree(pristine, d, symlinks=True)
        os.chmod(d, 0o755)  # searchable; its files stay 0600
        res = subprocess.run(
            [tool, "info", str(d)], capture_output=True, text=True, timeout=TIMEOUT, env=_env(),
            stdin=subprocess.DEVNULL, user=65534, group=65534, extra_groups=[],
        )  # fmt: skip
        assert res.returncode == 2, res
        assert "Permission denied" in res.stderr and "rebuilds" not in res.stderr, res.stderr
        assert f"{d}/index" in res.stderr, res.stderr
    finally:
        shutil.rmtree(base, ignore_errors=True)
