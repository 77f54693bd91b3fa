"""The ``kvh`` command line.

    kvh demo                agents answer questions with SmolLM2 over a document library, KV in kvh's tiers
                            (--synthetic: the synthetic-KV workload, no model)
    kvh stats DIR           open a disk store with an engine and print its tiers and counters
    kvh store info DIR      geometry, blocks, prefix chains and permissions of a store (kvh-store)
    kvh store verify DIR    re-check every stored block's checksums (kvh-store)
    kvh bench [SCENARIO]    run kvh-bench scenarios and summarise them
    kvh doctor              check the machine (huge pages, memlock, sysctls, O_DIRECT, NUMA, CUDA)

Every command takes --help; the long ones show a progress bar on a TTY and
take --json. Exit status: 0 ok, 1 failed (a check, a verification or the
wrapped tool), 2 usage, 3 not available in this build or machine, 130
interrupted (Ctrl-C), 128+N when kvh was stopped by signal N (SIGTERM,
SIGHUP: what it started is stopped and removed first) or a wrapped tool was
killed by it (as a shell reports it), 141 (SIGPIPE) when the reader of its
output went away (| head).
"""

from __future__ import annotations

import argparse
import codecs
import json
import logging
import os
import re
import select
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, NoReturn, Optional, Sequence, Tuple, Union

from ._cli_signals import SignalUnwind, Stopped

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3


def _err(msg: str) -> None:
    print(f"kvh: {msg}", file=sys.stderr)


def _tool_status(name: str, rc: int) -> int:
    """A wrapped tool's exit status as kvh's own. subprocess reports a death
    by signal N as -N, which sys.exit would turn into 256-N: give 128+N, as a
    shell does, and say so unless the signal was SIGPIPE (a reader that
    stopped early, no news to the user)."""
    if rc >= 0:
        return rc
    if -rc != signal.SIGPIPE:
        _err(f"{name} was killed by {_signal_name(-rc)}")
    return 128 - rc


def _call_tool(name: str, cmd: List[Any], env: Optional[Dict[str, str]] = None) -> int:
    """Runs a wrapped tool with its output passed through, as kvh's own
    status (_tool_status). Its stderr goes through this process, so that a
    tool that fails without a word ($KVH_STORE naming some other program)
    is still reported."""
    with subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE) as proc:
        assert proc.stderr is not None
        fd = proc.stderr.fileno()
        os.set_blocking(fd, False)
        said = False

        def pass_on() -> bool:
            """Passes on what the pipe holds now; False at its end."""
            nonlocal said
            while True:
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    return True
                if not chunk:
                    return False
                said = True
                try:
                    sys.stderr.flush()
                    os.write(sys.stderr.fileno(), chunk)
                except (OSError, ValueError):
                    pass  # our stderr is closed: the tool's words go nowhere, as they would have

        try:
            # Until the pipe ends or the tool exits: a process the tool left
            # behind may hold the pipe open long after.
            while pass_on():
                if proc.poll() is not None:
                    pass_on()
                    break
                select.select([fd], [], [], 0.1)
            rc = proc.wait()
        except BaseException:
            proc.kill()  # as subprocess.call does when interrupted
            raise
    if rc > 0 and not said:
        _err(f"{name} ({cmd[0]}) exited with status {rc} and gave no reason")
    return _tool_status(name, rc)


def _signal_name(number: int) -> str:
    try:
        return f"signal {number} ({signal.Signals(number).name})"
    except ValueError:
        return f"signal {number}"


def _version() -> str:
    try:
        from . import _ffi

        return f"kvh {_ffi.LOADED_VERSION_STRING} (binding built for {_ffi.BUILT_VERSION_STRING})"
    except ImportError as exc:
        return f"kvh (library not loadable: {exc})"


# ---------------------------------------------------------------------------------
# demo
# ---------------------------------------------------------------------------------
# Options of `kvh demo` that only the model demo (demo/agents) reads.
_MODEL_DEMO_ONLY = (
    "questions",
    "docs_per_question",
    "ingest",
    "model",
    "qdrant_url",
    "baseline",
    "no_restart",
    "plot",
    "no_plot",
    "record_trace",
    "returning",
    "queue_hints",
)


def _demo_ignores_engine_settings() -> None:
    """The demo runs configurations of its own (its flags set geometry and
    budgets, its baselines are fixed): engine settings from the environment
    or $KVH_CONFIG would change what it compares, so they are not applied,
    and a user who set some is told so rather than left to believe them in
    effect."""
    from .config import ENV_FILE, ENV_VARS

    names = sorted({var for var in ENV_VARS.values() if os.environ.get(var, "").strip()})
    if os.environ.get(ENV_FILE, "").strip():
        names.append(ENV_FILE)
    if names:
        _err(
            f"{', '.join(names)} set: kvh demo runs its own configurations (set by its flags) and does not "
            "apply engine settings from the environment or a file"
        )


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import synthetic

    if args.engine == "vllm":
        from .demo import vllm_engine

        return vllm_engine.run(args)
    _demo_ignores_engine_settings()

    if args.models:
        from .demo import two_models

        return two_models.run(args)
    if args.synthetic or synthetic.synthetic_requested(args):
        if not args.synthetic:
            _err("options of the synthetic demo given: running `kvh demo --synthetic`")
        # Options only the model demo reads would be ignored without a word.
        given = [f"--{k.replace('_', '-')}" for k in _MODEL_DEMO_ONLY if getattr(args, k, None) not in (None, False)]
        if given:
            _err(f"{', '.join(given)}: an option of the model demo; the synthetic demo does not take it")
            return 2
        synthetic.fill_defaults(args)
        return synthetic.run(args)
    from .demo import agents

    agents.fill_defaults(args)
    return agents.run(args)


# ---------------------------------------------------------------------------------
# store (kvh-store) and stats
# ---------------------------------------------------------------------------------
def _store_tool() -> Optional[str]:
    from .tools import find_tool

    return find_tool("kvh-store")


def _missing_tool(name: str) -> int:
    from .tools import tool_search_path

    env = {"kvh-store": "KVH_STORE", "kvh-bench": "KVH_BENCH"}[name]
    _err(
        f"{name} not found. Build it (cmake --build build --target {name}), install the kvh-cache wheel that "
        f"ships it, put it on PATH, or set ${env}. Searched: "
        + ", ".join(str(p) for p in tool_search_path())
        + ", PATH"
    )
    return EXIT_UNAVAILABLE


def _not_a_directory(p: Path) -> str:
    return f"{p}: not a directory" if p.exists() else f"{p}: no such directory"


def cmd_store(args: argparse.Namespace) -> int:
    tool = _store_tool()
    if not tool:
        return _missing_tool("kvh-store")
    if not Path(args.dir).is_dir():
        _err(_not_a_directory(Path(args.dir)))
        return EXIT_FAIL
    # "--": a directory whose name starts with "-" is not an option.
    cmd = [tool, args.action] + (["--json"] if args.json else []) + ["--", str(args.dir)]
    rc = _call_tool("kvh-store", cmd)
    # kvh-store's 2 means a store it could not read (the arguments were
    # checked here): for kvh that is a failed check, 1.
    return EXIT_FAIL if rc == 2 else rc


def cmd_store_remote(args: argparse.Namespace) -> int:
    """kvh-store remote ACTION, with the model and cluster of the resolved
    configuration (arguments, KVH_* variables, $KVH_CONFIG) in its
    environment."""
    from . import errors
    from .config import ENV_VARS, resolve

    tool = _store_tool()
    if not tool:
        return _missing_tool("kvh-store")
    env = dict(os.environ)
    try:
        cfg = resolve().config
    except errors.Error:
        raise  # a bad KVH_* variable: main reports it as a failure
    except ValueError as exc:  # a bad $KVH_CONFIG file
        _err(str(exc))
        return EXIT_USAGE
    for name, var in ENV_VARS.items():
        v = getattr(cfg, name)
        if v is None or var == "KVH_DISK_FLAGS":
            continue
        if isinstance(v, bool):
            v = int(v)
        elif hasattr(v, "name") and hasattr(v, "value"):
            v = int(v.value)
        env[var] = str(v)
    if not env.get("KVH_REMOTE_ADDRS"):
        _err("no remote tier configured: set KVH_REMOTE_ADDRS (or remote_addrs in $KVH_CONFIG)")
        return EXIT_FAIL
    cmd = [tool, "remote", args.remote_action]
    if args.remote_action == "verify":
        cmd += ["--sample", str(args.sample)]
    if args.json:
        cmd.append("--json")
    return _call_tool("kvh-store", cmd, env)


def _store_info(directory: Path) -> Optional[Dict[str, Any]]:
    tool = _store_tool()  # a bad $KVH_STORE raises BadToolVariable, a RuntimeError
    if not tool:
        return None
    # A store named by bytes that are not UTF-8 is still read (kvh-store
    # writes them as U+FFFD in its JSON; its messages may hold them raw).
    res = subprocess.run(
        [tool, "info", "--json", "--", os.fsencode(directory)], capture_output=True, text=True, errors="replace"
    )
    if res.returncode < 0:
        raise RuntimeError(f"kvh-store info was killed by {_signal_name(-res.returncode)}")
    if res.returncode != 0:
        raise RuntimeError(res.stderr.strip() or f"kvh-store info exited with {res.returncode}")
    for line in res.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError("kvh-store info printed no JSON")


# The store's geometry as the library's mismatch message names it, and the
# option of `kvh stats` that gives it.
_GEOMETRY_OPTIONS = {
    "num_layers": "layers",
    "num_kv_heads": "kv_heads",
    "head_dim": "head_dim",
    "block_tokens": "block_tokens",
    "dtype": "dtype",
    "kv_codec": "kv_codec",
    "model_salt": "model_salt",
}
_CODECS = ("none", "int8", "q4_g32", "q4_g64")


def _mismatch_message(d: Path, exc: Exception, args: argparse.Namespace) -> str:
    """The library's mismatch message worded for `kvh stats`, which opens a
    store read as it is and never resets it: which option to pass."""
    text = str(exc)
    m = re.search(r"was made with a different (\w+)", text)
    field = m.group(1) if m else None
    dest = _GEOMETRY_OPTIONS.get(field or "")
    if dest is None:
        return f"cannot open {d}: {text.split(' (pass ')[0]}; pass the store's geometry (kvh store info {d} shows it)"
    option = "--" + dest.replace("_", "-")
    if getattr(args, dest, None) is not None:
        advice = f"give the store's own {option} or leave it out to read it with kvh-store"
    else:
        advice = f"pass the store's {option} (kvh store info {d} shows it)"
    return f"{d} was made with a different {field}: {advice}"


def _group_shared(d: Path) -> bool:
    """Whether the store is group-shared as kvh makes it (directory 0750,
    setgid or not; files 0640). The library sets those modes when opened
    to share: any other store opened so would be widened to them."""
    if stat.S_IMODE(d.stat().st_mode) & ~stat.S_ISGID != 0o750:
        return False
    modes = [p.lstat().st_mode for p in d.iterdir() if re.fullmatch(r"index|journal|LOCK|slab-\d+\.kvh", p.name)]
    return bool(modes) and all(stat.S_ISREG(m) and stat.S_IMODE(m) == 0o640 for m in modes)


# The engine's slab files hold at most this many bytes of slots each
# (core/disk_io.c); a slot larger than that is a slab of its own.
_SLAB_BYTES_MAX = 1 << 30


def _slot_bytes(info: Dict[str, Any]) -> int:
    """A slot as kvh-store and the engine lay it out: a 4 KiB header and
    the block, 4 KiB aligned."""
    align = 4096
    return align + -(-int(info["block_bytes"]) // align) * align


def _slab_layout(d: Path, slot_bytes: int) -> Tuple[int, Optional[str]]:
    """The bytes of the store's slab files as an engine lays them out
    (slab-0000.kvh on, every one full but the last), which is what an
    engine opened at that size leaves as they are, and what in them no
    engine makes (None: nothing). Files past the last are not the store's
    (an engine opened smaller leaves them, or they were put there): they
    are neither counted, which would have the engine grow the last slab
    to their size, nor read."""
    per = max(1, _SLAB_BYTES_MAX // slot_bytes)
    full = per * slot_bytes
    total = 0
    for i in range(1 << 20):
        try:
            size = os.stat(d / f"slab-{i:04d}.kvh").st_size
        except OSError:
            break
        if size > full:
            return total, f"slab-{i:04d}.kvh holds {size} bytes, more than an engine's slab ({full})"
        total += size
        if size < full:
            break
    return total, None


def _store_damage(d: Path, info: Dict[str, Any]) -> Optional[str]:
    """What kvh-store info's figures say is damaged in the store, if
    anything: index records that fail their checksum, records naming
    slots past the end of the slab files (a truncated or missing slab),
    which an engine would drop, or slab files no engine makes."""
    bad = int(info.get("bad_records") or 0)
    if bad:
        if bad == 1:
            return "one index or journal record (or header) fails its checksum"
        return f"{bad} index or journal records (or headers) fail their checksums"
    slot_bytes = _slot_bytes(info)
    total, odd = _slab_layout(d, slot_bytes)
    if odd:
        return odd
    slots = total // slot_bytes
    indexed = int(info.get("slots") or 0)
    if indexed > slots:
        return f"its index names slot {indexed - 1}, its slab files hold {slots} slots"
    return None


def cmd_stats(args: argparse.Namespace) -> int:
    from . import Engine, Tier, errors
    from ._progress import human_bytes, table

    d = Path(args.dir)
    if not d.is_dir():
        _err(_not_a_directory(d))
        return EXIT_FAIL
    if not (d / "index").exists():
        _err(f"{d} is not a kvh store (no index file)")
        return EXIT_FAIL
    geometry = {k: getattr(args, k) for k in ("layers", "kv_heads", "head_dim", "block_tokens", "dtype", "model_salt")}
    # kvh-store reads the store without changing it: its geometry, and
    # whether it is intact. An engine opening a damaged store repairs it
    # (drops the records it cannot trust and rewrites the index), which a
    # command that only reports must not do, so the store is checked first.
    try:
        info = _store_info(d)
    except (RuntimeError, ValueError) as exc:
        _err(f"cannot read the store with kvh-store (kvh stats checks it before opening it): {exc}")
        return EXIT_FAIL
    if info is None:
        _err(
            "kvh-store (which reads the store's geometry and checks it before kvh stats opens it) was not "
            "found; build kvh-store or install the kvh-cache wheel that ships it"
        )
        return EXIT_UNAVAILABLE
    for ours, theirs in (
        ("layers", "layers"),
        ("kv_heads", "kv_heads"),
        ("head_dim", "head_dim"),
        ("block_tokens", "block_tokens"),
        ("dtype", "dtype"),
        ("model_salt", "model_salt"),
    ):
        if geometry[ours] is None:
            geometry[ours] = info[theirs]
    damage = _store_damage(d, info)
    if damage:
        _err(
            f"{d} is a damaged store ({damage}); kvh stats does not open it, as an engine would repair it: "
            f"run `kvh store verify {d}`"
        )
        return EXIT_FAIL
    # The KV codec is part of the store's geometry too (kvh-store info says
    # which); opening with another is refused as a mismatch.
    codec = args.kv_codec or (info or {}).get("kv_codec", "none")
    # A store's size is its slab files': opening it at another size would
    # grow them (preallocated, possibly filling the disk) or drop blocks.
    slabs = sorted(d.glob("slab-*.kvh"))
    odd = next((p for p in slabs if not p.is_file()), None)
    if odd is not None:
        _err(f"{odd}: not a regular file: a damaged store (run `kvh store verify {d}`)")
        return EXIT_FAIL
    slot_bytes = _slot_bytes(info)
    slab_bytes, _ = _slab_layout(d, slot_bytes)
    if not slab_bytes:
        _err(f"{d} has no slab files: kvh stats would create a store there, not read one")
        return EXIT_FAIL
    # disk_bytes counts whole slots, rounded down: the size a store was
    # made with (64M) names the slab files it holds (a few KiB less).
    if args.disk_bytes is not None and args.disk_bytes // slot_bytes * slot_bytes != slab_bytes:
        _err(
            f"kvh stats reads a store as it is and never resizes it: {d} holds {slab_bytes} bytes of slab files; "
            f"leave --disk-bytes out or give {slab_bytes}"
        )
        return EXIT_USAGE
    disk_bytes = slab_bytes
    raw_block = 2 * (4 if geometry["dtype"] == "f32" else 2)
    for dim in ("layers", "kv_heads", "head_dim", "block_tokens"):
        raw_block *= int(geometry[dim])
    try:
        from .config import load

        # The store fixes geometry and path; the rest follows the
        # configuration rule (environment, $KVH_CONFIG) over these defaults.
        eng = Engine(
            load(
                num_layers=int(geometry["layers"]),
                num_kv_heads=int(geometry["kv_heads"]),
                head_dim=int(geometry["head_dim"]),
                block_tokens=int(geometry["block_tokens"]),
                dtype=str(geometry["dtype"]),
                model_salt=int(geometry["model_salt"]),
                kv_codec=codec,
                disk_path=str(d),
                disk_bytes=disk_bytes,
                # Never reset on a mismatch (whatever the environment or
                # file says), and keep a group-shared store's modes: the
                # library narrows a store opened without the flag.
                disk_reset_on_mismatch=False,
                disk_share_group=_group_shared(d),
                # A damaged index or journal is an error, not rebuilt.
                disk_strict_index=True,
                # The engine's log follows -v / -vv (warnings by default),
                # unless KVH_LOG_LEVEL or the file says otherwise.
                # The memory tiers hold a few blocks whatever their size
                # (a vLLM store's block is several MiB).
                defaults={
                    "backend": "cpu",
                    "device_bytes": max(1 << 20, 2 * raw_block),
                    "host_bytes": max(4 << 20, 4 * raw_block),
                },
            )
        )
    except errors.UnsupportedError as exc:
        _err(f"this build cannot open a disk store: {exc.message}")
        return EXIT_UNAVAILABLE
    except errors.BusyError as exc:
        _err(f"the store is in use by another process: {exc.message}")
        return EXIT_FAIL
    except errors.MismatchError as exc:
        _err(_mismatch_message(d, exc, args))
        return EXIT_FAIL
    except errors.CorruptionError as exc:
        _err(
            f"{d} is a damaged store ({errors.without_reset_advice(exc.message)}); kvh stats does not repair it: "
            f"run `kvh store verify {d}`"
        )
        return EXIT_FAIL
    except errors.InvalidArgumentError as exc:
        if "holds no block slot" not in str(exc):
            _err(f"cannot open {d}: {exc}")
            return EXIT_FAIL
        # disk_bytes is the slab files' size here, not the user's: a truncated slab.
        _err(
            f"{d}: its slab files hold {slab_bytes} bytes, less than one block slot: "
            f"a damaged store (run `kvh store verify {d}`)"
        )
        return EXIT_FAIL
    except errors.Error as exc:
        _err(f"cannot open {d}: {errors.without_reset_advice(str(exc))}")
        return EXIT_FAIL
    except (ValueError, TypeError) as exc:  # a bad $KVH_CONFIG file
        _err(str(exc))
        return EXIT_USAGE
    with eng:
        tiers = eng.tiers()
        st = eng.stats()
    disk = tiers[Tier.DISK]
    result = {
        # Bytes that are not UTF-8 as U+FFFD, as kvh-store writes them: a
        # lone surrogate is not JSON a strict parser takes.
        "path": os.fsencode(d).decode("utf-8", "replace"),
        "store": info,
        "geometry": geometry,
        "block_bytes": eng.block_bytes,
        "kv_codec": codec,
        "disk": {
            "capacity_blocks": disk.capacity_blocks,
            "used_blocks": disk.used_blocks,
            "used_bytes": disk.used_bytes,
            "pinned_blocks": disk.pinned_blocks,
        },
        "stats": st.to_dict(),
    }
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return EXIT_OK
    g = geometry
    rows = [
        ["store", str(d)],
        [
            "geometry",
            f"{g['layers']} layers x {g['kv_heads']} kv heads x {g['head_dim']} dim, "
            f"{g['block_tokens']} tokens/block, {g['dtype']}, kv codec {codec}",
        ],
        ["model salt", f"0x{int(g['model_salt']):016x}"],
        [
            "block bytes",
            human_bytes(eng.block_bytes)
            + (f" ({human_bytes(disk.block_bytes)} stored)" if disk.block_bytes != eng.block_bytes else ""),
        ],
        ["disk slots", f"{disk.capacity_blocks:,} ({disk.used_blocks:,} used, {human_bytes(disk.used_bytes)})"],
        ["cached tokens", f"{disk.used_blocks * int(g['block_tokens']):,}"],
        ["corrupt blocks at open", f"{st.corrupt_blocks}"],
    ]
    if info:
        rows.append(
            [
                "prefix chains",
                f"{info.get('prefix_chains', '?')} (longest {info.get('longest_chain_blocks', '?')} blocks)",
            ]
        )
        if "permissions" in info:
            perm = f"{info['permissions']} (directory {info.get('dir_mode', '?')})"
            if info.get("exposed"):
                perm += f"; readable by others: {info['exposed']}"
            rows.append(["permissions", perm])
    print(table(rows, ["item", "value"], title="kvh store (opened by an engine)", align="ll"))
    return EXIT_OK


# ---------------------------------------------------------------------------------
# bench (kvh-bench)
# ---------------------------------------------------------------------------------
_STOP_GRACE_S = 5.0


def _stop_process_group(proc: "subprocess.Popen[str]") -> None:
    """SIGTERM to the process group of proc, SIGKILL after a grace period,
    then reap proc."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=_STOP_GRACE_S)
            break
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def cmd_bench(args: argparse.Namespace) -> int:
    from ._progress import Progress, table
    from .tools import find_tool

    # The Python scenarios take only the common options they have a use for:
    # one given to a scenario that would ignore it is refused, not dropped.
    unused = {"offload": ("seed", "strict"), "remote-ttft": ("seed",), "vllm": ("strict",)}
    if len(args.scenarios) == 1 and args.scenarios[0] in unused:
        name = args.scenarios[0]
        # --seed 0 is a seed given (0 == False): only None means left out.
        given = [f"--{k}" for k in unused[name] if getattr(args, k) is not None and getattr(args, k) is not False]
        if given:
            what = {"--seed": "no random input", "--strict": "no target"}
            _err(f"bench {name}: {', '.join(given)} not taken by this scenario ({'; '.join(what[g] for g in given)})")
            return EXIT_USAGE
    if list(args.scenarios) == ["retriever"]:
        # The retriever scenario is Python (it drives Qdrant), not kvh-bench.
        from .demo import bench_retriever

        argv = ["--json"] if args.json else []
        argv += ["--quick"] if args.quick else []
        argv += ["--reps", str(args.reps)] if args.reps is not None else []
        argv += ["--seed", str(args.seed)] if args.seed is not None else []
        argv += ["--strict"] if args.strict else []
        # A missed target is a failure (1) for kvh; 3 stays "not available".
        return bench_retriever.main(argv + list(getattr(args, "extra", [])), missed_status=EXIT_FAIL)
    if list(args.scenarios) == ["vllm"]:
        # kvh beneath vLLM: vLLM processes in their own venv, not kvh-bench.
        from .vllm import bench as bench_vllm

        argv = ["--json"] if args.json else []
        argv += ["--quick"] if args.quick else []
        argv += ["--reps", str(args.reps)] if args.reps is not None else []
        argv += ["--seed", str(args.seed)] if args.seed is not None else []
        return bench_vllm.main(argv + list(getattr(args, "extra", [])))
    if list(args.scenarios) == ["offload"]:
        # The offload threshold runs the Python model runner, not kvh-bench.
        from .demo import bench_offload

        argv = ["--json"] if args.json else []
        argv += ["--quick"] if args.quick else []
        argv += ["--reps", str(args.reps)] if args.reps is not None else []
        return bench_offload.main(argv + list(getattr(args, "extra", [])))
    if list(args.scenarios) == ["remote-ttft"]:
        # Node B's time to first token through the remote tier: the model runner.
        from .demo import bench_remote

        argv = ["--json"] if args.json else []
        argv += ["--quick"] if args.quick else []
        argv += ["--reps", str(args.reps)] if args.reps is not None else []
        argv += ["--strict"] if args.strict else []
        return bench_remote.main(argv + list(getattr(args, "extra", [])))

    tool = find_tool("kvh-bench")
    if args.list:
        # kvh-bench's scenarios, then those this command runs in Python.
        rc, names = EXIT_UNAVAILABLE, []
        try:
            if tool:
                res = subprocess.run([tool, "list"], stdout=subprocess.PIPE, text=True)
                rc = _tool_status("kvh-bench", res.returncode)
                names = res.stdout.split()
        except OSError as exc:
            _err(f"cannot run {tool}: {exc}")
        if rc == EXIT_UNAVAILABLE:
            _err("kvh-bench was not run: only the Python scenarios are listed")
        names += ["retriever", "offload", "remote-ttft", "vllm"]
        print(json.dumps(names) if args.json else "\n".join(names))
        return EXIT_OK if rc == 0 else rc
    if not tool:
        return _missing_tool("kvh-bench")
    extra = list(getattr(args, "extra", []))
    scenarios = list(args.scenarios)
    res = subprocess.run([tool, "list"], capture_output=True, text=True)
    if res.returncode != 0:
        _err(f"kvh-bench list failed: {res.stderr.strip()}")
        return EXIT_FAIL
    known = [s.strip() for s in res.stdout.split() if s.strip()]
    if not known:  # KVH_BENCH naming another program: the tool is at fault, not the scenario asked for
        _err(f"{tool} list named no scenario: is it kvh-bench? (KVH_BENCH, or the build's own)")
        return EXIT_FAIL
    if not scenarios or scenarios == ["all"]:
        scenarios = known
    unknown = [s for s in scenarios if s not in known]
    if unknown:
        # kvh-bench would print its whole usage for each; say it once.
        python_only = ("retriever", "offload", "remote-ttft", "vllm")
        alone = [s for s in unknown if s in python_only]
        hint = f" ({', '.join(alone)}: run alone, e.g. kvh bench {alone[0]})" if alone else ""
        _err(f"bench: unknown scenario {', '.join(map(repr, unknown))}{hint}; kvh bench --list shows them")
        return EXIT_USAGE
    common = ["--json"]
    if args.quick:
        common.append("--quick")
    if args.reps is not None:
        common += ["--reps", str(args.reps)]
    if args.seed is not None:
        common += ["--seed", str(args.seed)]
    if args.strict:
        common.append("--strict")
    rows: List[Dict[str, Any]] = []
    rc = EXIT_OK
    with Progress(len(scenarios), "kvh bench", enabled=None if not args.json else False, unit="scenario") as bar:
        for name in scenarios:
            bar.update(0, name)
            bad: List[str] = []
            cmd = [tool, name] + common + extra
            # Its own process group, so that stopping it stops what it
            # started too (fio).
            with subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
            ) as proc:
                try:
                    assert proc.stdout is not None
                    for line in proc.stdout:
                        line = line.strip()
                        if not line:
                            continue
                        try:
                            obj = json.loads(line)
                        except ValueError:
                            obj = None
                        if not isinstance(obj, dict):
                            # A result that cannot be read is a result lost:
                            # kept out of --json's output, and the run fails.
                            bad.append(line)
                            continue
                        if args.json:
                            print(line, flush=True)
                        rows.append(obj)
                        bar.update(0, f"{name}: {obj.get('metric', '')}")
                    err = proc.stderr.read() if proc.stderr else ""
                    code = proc.wait()
                except BaseException:  # Ctrl-C or a closed stdout included: no benchmark left running
                    _stop_process_group(proc)
                    raise
            if code == EXIT_USAGE:
                # A usage error (a bad option after --) is every scenario's: say it once.
                _err(err.strip().splitlines()[-1] if err.strip() else f"kvh-bench {name}: usage error")
                return EXIT_USAGE
            if code == 3 and args.strict:
                # kvh-bench's 3 is a missed target (--strict only); kvh's 3
                # means "not available", and a missed target is a failure.
                rc = EXIT_FAIL if rc == EXIT_OK else rc
                _err(f"kvh-bench {name}: a target was missed (--strict)" + (f":\n{err.strip()}" if err.strip() else ""))
            elif code != 0:
                what = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with {code}"
                rc = (128 - code if code < 0 else code) if rc == EXIT_OK else rc
                _err(f"kvh-bench {name} {what}" + (f":\n{err.strip()}" if err.strip() else ""))
            if bad:
                rc = EXIT_FAIL if rc == EXIT_OK else rc
                shown = bad[0] if len(bad[0]) <= 200 else bad[0][:200] + "..."
                _err(f"kvh-bench {name}: {len(bad)} output line(s) are not JSON objects, the first: {shown}")
            bar.update(1, name)
    if not args.json:
        if rows:
            print(
                table(
                    [
                        [
                            r.get("scenario", ""),
                            r.get("metric", ""),
                            r.get("value"),
                            r.get("unit", ""),
                            r.get("baseline"),
                            r.get("ratio"),
                            ", ".join(
                                f"{k}={v}"
                                for k, v in r.items()
                                if k not in ("scenario", "metric", "value", "unit", "baseline", "ratio")
                            ),
                        ]
                        for r in rows
                    ],
                    ["scenario", "metric", "value", "unit", "baseline", "ratio", "parameters"],
                    title="kvh bench",
                    align="llrlrrl",
                )
            )
        else:
            print("kvh bench: no results")
    return rc


# ---------------------------------------------------------------------------------
# doctor
# ---------------------------------------------------------------------------------
def cmd_doctor(args: argparse.Namespace) -> int:
    from .doctor import main_doctor

    return main_doctor(args)


# ---------------------------------------------------------------------------------
# parser
# ---------------------------------------------------------------------------------
_MARKUP = (
    (re.compile(r":[a-z]+(?::[a-z]+)?:`~?([^`]+)`"), r"\1"),  # :func:`x`
    (re.compile(r"``([^`]+)``"), r"\1"),
    (re.compile(r"`([^`]+)`"), r"\1"),
    (re.compile(r"\*\*([^*]+)\*\*"), r"\1"),
    (re.compile(r"::$", re.M), ":"),
)


def plain_text(text: str) -> str:
    """Help text without the reST markup of the docstrings it comes from."""
    for pattern, repl in _MARKUP:
        text = pattern.sub(repl, text)
    return text


class _Parser(argparse.ArgumentParser):
    """argparse's parser, but --help and --version text that cannot be
    written (a full disk) raises instead of passing for printed: argparse
    drops the error and exits 0."""

    def _print_message(self, message: str, file: Any = None) -> None:
        if message:
            out = file if file is not None else sys.stderr
            out.write(message)
            out.flush()

    def error(self, message: str) -> NoReturn:
        # A usage error exits 2 even where stderr cannot take its text (a
        # full disk): it was reported as stdout's write error, exit 1.
        try:
            self.print_usage(sys.stderr)
            self._print_message(f"{self.prog}: error: {message}\n", sys.stderr)
        except (OSError, ValueError):
            pass
        raise SystemExit(EXIT_USAGE)


def _shown_as_given(exc: UnicodeError) -> Tuple[Union[str, bytes], int]:
    """An encoding error handler for the CLI's output: a path's undecodable
    bytes (surrogate escapes) are written back as they were, as ls does;
    a character the terminal's encoding lacks (an em dash under Latin-1)
    as a backslash escape, instead of a traceback."""
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    part = exc.object[exc.start : exc.end]
    if all(0xDC80 <= ord(c) <= 0xDCFF for c in part):
        return bytes(ord(c) - 0xDC00 for c in part), exc.end
    return codecs.backslashreplace_errors(exc)


codecs.register_error("kvh_shown_as_given", _shown_as_given)


def _output_never_fails_to_encode() -> None:
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "errors", None) == "strict" and hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(errors="kvh_shown_as_given")
            except (OSError, ValueError):
                pass


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (docstrings keep their layout) and every
    help text, in plain text."""

    def _fill_text(self, text, width, indent):
        return super()._fill_text(plain_text(text), width, indent)

    def _expand_help(self, action):
        return plain_text(super()._expand_help(action))


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return value


def _positive_size(text: str) -> int:
    """A size read as the KVH_*_BYTES variables are (64M, 4GiB, 4096), at
    least one byte."""
    from ._progress import parse_size

    value = parse_size(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 byte: {text!r}")
    return value


def _int_in(low: int, high: int, power_of_two: bool = False):
    """An argparse type: an integer in [low, high] (a power of two)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not low <= value <= high or (power_of_two and value & (value - 1)):
            kind = "a power of two" if power_of_two else "an integer"
            raise argparse.ArgumentTypeError(f"must be {kind} in {low}..{high}: {text!r}")
        return value

    return parse


def _salt(text: str) -> int:
    try:
        value = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer (decimal or 0x hex): {text!r}") from None
    if not 0 <= value < 1 << 64:
        raise argparse.ArgumentTypeError(f"must be in 0..2**64-1: {text!r}")
    return value


def _store_dir(text: str) -> str:
    if not text:  # Path("") would be the working directory
        raise argparse.ArgumentTypeError("DIR must not be empty")
    return text


def build_parser() -> argparse.ArgumentParser:
    from . import doctor
    from .demo import agents, synthetic

    p = _Parser(
        prog="kvh", description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1], formatter_class=_Formatter
    )
    p.add_argument("--version", action="version", version=_version())
    p.add_argument("-v", "--verbose", action="count", default=0, help="log kvh messages (-v info, -vv debug)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    sp = sub.add_parser(
        "demo",
        help="agents answering questions with SmolLM2, their KV in kvh's tiers (--synthetic: synthetic KV, no model)",
        description=agents.__doc__,
        formatter_class=_Formatter,
    )
    agents.add_arguments(sp, shared_defaults=False)
    synthetic.add_synthetic_arguments(sp)
    g = sp.add_argument_group("two models (--models)")
    g.add_argument(
        "--models",
        action="store_true",
        help="two agents with two models (SmolLM2 Q4_1 and a Q8_0 copy) take turns under a device "
        "budget that holds one: weights and KV switch as one unit",
    )
    g.add_argument(
        "--model-b",
        default=None,
        metavar="GGUF",
        help="the second agent's model (default: the first re-encoded as Q8_0 under --data-dir)",
    )
    sp.add_argument(
        "--engine",
        choices=("kvh", "vllm"),
        default="kvh",
        help="who runs the model: kvh's own runner (default), or vLLM with kvh beneath it as its KV connector "
        "(the --vllm-* options; needs scripts/install-vllm.sh)",
    )
    from .demo import vllm_engine

    vllm_engine.add_arguments(sp)
    sp.set_defaults(func=cmd_demo)

    sp = sub.add_parser(
        "stats",
        formatter_class=_Formatter,
        help="open a disk store with an engine and print its tiers and counters",
        description="Opens the disk store DIR with an engine (geometry from kvh-store info, or "
        "the flags) and prints the disk tier's occupancy and the engine counters. "
        "The store must not be open in another process. Its index, journal and slab files are checked "
        "with kvh-store first: a store damaged there is refused (exit 1), never repaired. Blocks are not "
        "read: damage inside a block's slot (its header or data) shows when the block is read, as "
        "corrupt_blocks, or in kvh store verify, which reads them all. "
        "A store a crashed process left is recovered as any open recovers it: the records its journal "
        "holds are folded into its index, and its blocks stay as they were.",
    )
    sp.add_argument("dir", metavar="DIR", type=_store_dir, help="the disk tier directory (kvh_config.disk_path)")
    sp.add_argument("--json", action="store_true", help="print JSON")
    for flag, typ in (
        ("--layers", _int_in(1, 4096)),
        ("--kv-heads", _int_in(1, 1024)),
        ("--head-dim", _int_in(1, 1024)),
        ("--block-tokens", _int_in(1, 256, power_of_two=True)),
        ("--model-salt", _salt),
    ):
        sp.add_argument(flag, type=typ, default=None, help="store geometry (default: read with kvh-store)")
    sp.add_argument("--dtype", choices=["f32", "f16", "bf16"], default=None, help="store dtype")
    sp.add_argument(
        "--kv-codec", choices=_CODECS, default=None, help="the store's KV codec (default: read with kvh-store)"
    )
    sp.add_argument(
        "--disk-bytes",
        type=_positive_size,
        default=None,
        help="the store's size (bytes, or with K, M, G, T or P: 64M), checked against its slab files "
        "(it is never resized)",
    )
    sp.set_defaults(func=cmd_stats)

    sp = sub.add_parser(
        "store",
        formatter_class=_Formatter,
        help="inspect a disk store (wraps kvh-store)",
        description="Inspect a kvh disk store with kvh-store, read-only.",
    )
    ssub = sp.add_subparsers(dest="action", metavar="ACTION")
    ssub.required = True
    for action, text in (
        ("info", "geometry, block count, bytes, prefix chains, who can read it (directory and file modes)"),
        (
            "verify",
            "re-read every stored block and check its checksums and the index files (exit 1 if a block or index "
            "record is bad, a block of another geometry, records naming slots past the slab files or in a cycle of "
            "parents included, or if a strict open would refuse the store: a missing journal, a journal cut inside "
            "its header, an index older than its journal or of another store; 1 also when the store cannot be read: "
            "missing, in use or without a readable header, which the message says)",
        ),
    ):
        ap = ssub.add_parser(action, help=text, description=text, formatter_class=_Formatter)
        ap.add_argument("dir", metavar="DIR", type=_store_dir, help="the disk tier directory")
        ap.add_argument(
            "--json",
            action="store_true",
            help="JSON Lines: one object a line (verify: one for each bad block, then the summary, always last)",
        )
        ap.set_defaults(func=cmd_store)
    text = (
        "the remote tier's keys of the configured model (KVH_REMOTE_ADDRS, KVH_MODEL_SALT and the geometry, "
        "from the environment or $KVH_CONFIG)"
    )
    ap = ssub.add_parser("remote", help=text, description=text, formatter_class=_Formatter)
    ap.add_argument(
        "remote_action",
        choices=["ping", "count", "verify", "purge"],
        metavar="ACTION",
        help="ping: nodes that answer; count: keys of the model; verify: check a sample of values "
        "(exit 1 if any is bad); purge: delete every key of the model",
    )
    ap.add_argument("--sample", type=_positive_int, default=64, help="values verify reads (>= 1)")
    ap.add_argument("--json", action="store_true", help="JSON output")
    ap.set_defaults(func=cmd_store_remote)

    sp = sub.add_parser(
        "bench",
        formatter_class=_Formatter,
        help="run kvh-bench scenarios and summarise them",
        description="Runs kvh-bench SCENARIO --json for each scenario (default: all), shows "
        "progress on a TTY and prints a summary table (or the JSON lines with "
        "--json). Arguments after -- go to kvh-bench.",
    )
    sp.add_argument(
        "scenarios",
        nargs="*",
        metavar="SCENARIO",
        help="scenarios (default: all; see --list); `retriever` runs the speculative-prefetch benchmark, "
        "`offload` the offload threshold (restore vs recompute with the model), `vllm` kvh beneath vLLM "
        "(TTFT after a restart, decode speed; needs scripts/install-vllm.sh), `remote-ttft` node B's time to "
        "first token for a prefix node A uploaded to the remote tier vs recomputing it (needs redis-server)",
    )
    sp.add_argument("--list", action="store_true", help="list the scenarios")
    sp.add_argument("--quick", action="store_true", help="smaller sizes, for smoke tests")
    sp.add_argument("--reps", type=_int_in(1, 1000), default=None, help="rounds per measurement (1..1000)")
    sp.add_argument(
        "--seed",
        type=_int_in(0, (1 << 64) - 1),
        default=None,
        help="RNG seed (0..2^64-1; not for offload, remote-ttft)",
    )
    sp.add_argument(
        "--strict", action="store_true", help="fail (exit 1) when a target is missed (not for offload, vllm)"
    )
    sp.add_argument("--json", action="store_true", help="print kvh-bench's JSON lines")
    sp.set_defaults(func=cmd_bench)

    sp = sub.add_parser(
        "doctor",
        help="check huge pages, memlock, sysctls, O_DIRECT, NUMA, CUDA (read-only)",
        description=doctor.__doc__,
        formatter_class=_Formatter,
    )
    doctor.add_arguments(sp)
    sp.set_defaults(func=cmd_doctor)
    return p


def _reader_gone() -> int:
    """Standard output's reader went away (| head): exit quietly, with
    nothing left for the interpreter to flush into the closed pipe, and
    with 128+SIGPIPE, as a wrapped tool's death by SIGPIPE gives (Python
    ignores the signal and sees EPIPE instead)."""
    try:
        sys.stdout = open(os.devnull, "w")
    except OSError:
        pass
    return 128 + signal.SIGPIPE


def _stderr_to_devnull() -> None:
    """Started with fd 2 closed, Python's sys.stderr is None, and print()
    and argparse then write messages to standard output (into --json
    results) or fail: give them /dev/null, as fd 2 too, so that what
    kvh starts cannot write its messages into a file opened there."""
    fd = os.open(os.devnull, os.O_WRONLY)
    if fd != 2:
        os.dup2(fd, 2)
        os.close(fd)
    sys.stderr = open(2, "w", closefd=False)


def main(argv: Optional[Sequence[str]] = None) -> int:
    if sys.stderr is None:
        _stderr_to_devnull()
    unwind = SignalUnwind().install()
    # Ctrl-C while the parser is built (it imports the demos) is as
    # much an interrupt as one while a command runs.
    try:
        rc = _main(argv)
        unwind.raise_pending()
    except KeyboardInterrupt:
        return _ended_by(signal.SIGINT)
    except Stopped as exc:
        return _ended_by(exc.signum)
    except BaseException as exc:
        # A library that catches every exception (pydantic, building its
        # validators while Qdrant's client is imported) hands the signal's
        # on as one of its own, often without a cause: after a signal,
        # the command ends as that signal, with the error it ended on.
        if unwind.raised is None:
            raise
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            return 0  # as a return of 0: the command did its work
        try:
            if not _caused_by_signal(exc):
                _err(_one_line(exc))
        except BaseException:  # a second signal, or a __str__ that fails: the first signal ends it
            pass
        return _ended_by(unwind.raised)
    finally:
        unwind.restore()
    if rc != 0 and unwind.raised is not None:  # such an error, reported as a failure
        return _ended_by(unwind.raised)
    return rc


def _one_line(exc: BaseException) -> str:
    """The first line of what exc says, at most 500 characters: a
    SystemExit's message as it is, any other with its type."""
    if isinstance(exc, SystemExit):
        text = "" if isinstance(exc.code, int) else str(exc.code)
    else:
        try:
            text = str(exc)
        except Exception:
            text = ""
    first = next((line for line in text.splitlines() if line.strip()), "")[:500]
    if isinstance(exc, SystemExit):
        return first or f"exit status {exc.code}"
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _caused_by_signal(exc: BaseException) -> bool:
    seen = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, (KeyboardInterrupt, Stopped)):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _ended_by(signum: int) -> int:
    if signum == signal.SIGINT:
        _err("interrupted")
        return 130
    _err(f"stopped by {_signal_name(signum)}")
    return 128 + signum


def _main(argv: Optional[Sequence[str]]) -> int:
    from .tools import BadToolVariable

    if sys.stdout is None:  # started with fd 1 closed: nowhere to put results
        if sys.stderr is not None:
            _err("standard output is closed")
        return EXIT_FAIL
    _output_never_fails_to_encode()
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: List[str] = []
    command = next((a for a in argv if not a.startswith("-")), None)
    if command == "bench" and "--" in argv:  # everything after -- goes to kvh-bench
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    try:
        args = parser.parse_args(argv)
    except BrokenPipeError:  # a reader that stopped early (| head): no noise
        return _reader_gone()
    except OSError as err:  # --help or --version text that could not be written
        _err(f"write error on standard output: {err.strerror or err}")
        return EXIT_FAIL
    if extra and getattr(args, "command", None) != "bench":
        parser.error("arguments after -- are only for `kvh bench`")
    args.extra = extra
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    if args.verbose:
        logging.basicConfig(
            level=logging.DEBUG if args.verbose > 1 else logging.INFO, format="%(name)s %(levelname)s: %(message)s"
        )
    else:
        logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        return _reader_gone()
    except ImportError as exc:
        text = str(exc)
        _err(text[len("kvh: ") :] if text.startswith("kvh: ") else text)
        return EXIT_UNAVAILABLE
    except OSError as exc:
        # A path that cannot be created, read or written (--data-dir under a
        # file, a full disk): one line, not a traceback.
        _err(f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc))
        return EXIT_FAIL
    except BadToolVariable as exc:
        _err(str(exc))
        return EXIT_FAIL
    except Exception as exc:
        from . import errors

        if isinstance(exc, ValueError) and not isinstance(exc, errors.Error):
            # An argument the parser accepted but the binding rejects (a
            # budget beyond its range): a usage error, not a traceback.
            _err(str(exc))
            return EXIT_USAGE
        if not isinstance(exc, errors.Error):
            raise
        _err(f"{type(exc).__name__}: {exc}")
        return EXIT_UNAVAILABLE if isinstance(exc, errors.UnsupportedError) else EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
