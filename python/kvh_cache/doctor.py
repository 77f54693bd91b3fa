"""``kvh doctor``: checks of what an operator tunes by hand for kvh: huge
pages, the memlock limit for pinned memory, ``vm.max_map_count`` and the
other sysctls, O_DIRECT support and free space on the data directory, who
can read the store in it, io_uring, NUMA layout, the CUDA device and driver,
the effective configuration as the engine judges it (a tiny engine, no disk
or remote tier), and what to change, printed as commands and sysctl lines. It changes
nothing; its O_DIRECT probe writes a temporary file in the data directory
(or its nearest existing parent) and removes it. Exit status 1 when a check
failed (with --strict, also when one warns)."""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import errno
import fcntl
import json
import mmap
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from ._progress import human_bytes, parse_size, table

__all__ = ["Check", "run_checks", "main_doctor", "add_arguments"]

OK, WARN, FAIL, INFO = "ok", "warn", "fail", "info"
SYSCTL_FILE = "/etc/sysctl.d/99-kvh.conf"


def _sysctl_fix(settings: Dict[str, int]) -> List[str]:
    """Advice that sets sysctls now and keeps them across reboots. Every
    check appends only its own keys to the one file, so following all the
    advice in order leaves every setting in place, and a later run's value
    for a key (appended after the earlier one) is the one that counts."""
    lines = " ".join(shlex.quote(f"{k} = {v}") for k, v in settings.items())
    return [f"sudo sysctl -w {k}={v}" for k, v in settings.items()] + [
        f"printf '%s\\n' {lines} | sudo tee -a {SYSCTL_FILE}"
    ]


@dataclass
class Check:
    name: str
    status: str
    summary: str
    fix: List[str] = field(default_factory=list)
    data: Dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> Dict[str, Any]:
        return {"name": self.name, "status": self.status, "summary": self.summary, "fix": self.fix, "data": self.data}


def _data_dir(text: str) -> Path:
    if not text:  # Path("") would be the working directory
        raise argparse.ArgumentTypeError("DIR must not be empty")
    return _as_the_engine_opens(text)


def _as_the_engine_opens(text: str) -> Path:
    """The directory the engine opens for text: it refuses a symbolic link
    as the last component however it is spelt ("link", "link/", "link/."),
    and Path drops those trailing parts alike, so the check below sees the
    link the engine refuses."""
    return Path(text)


def _config_file(text: str) -> Path:
    if not text:  # Path("") would be the working directory
        raise argparse.ArgumentTypeError("must not be empty (leave --config out to use $KVH_CONFIG)")
    return Path(text)


def add_arguments(p) -> None:
    p.add_argument(
        "--data-dir",
        type=_data_dir,
        # An empty variable counts as unset, as for every KVH_* variable.
        default=_as_the_engine_opens(os.environ.get("KVH_DATA_DIR") or "kvh-data"),
        help="the disk tier directory to check (default $KVH_DATA_DIR or ./kvh-data)",
    )
    p.add_argument(
        "--host-budget",
        type=parse_size,
        default=parse_size("1GiB"),
        help="host tier bytes you plan (sizes the huge page and memlock advice; default 1GiB)",
    )
    p.add_argument(
        "--disk-budget", type=parse_size, default=parse_size("16GiB"), help="disk tier bytes you plan (default 16GiB)"
    )
    p.add_argument(
        "--config",
        type=_config_file,
        default=None,
        help="the TOML configuration file whose effect to show (default $KVH_CONFIG)",
    )
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.add_argument("--strict", action="store_true", help="exit 1 when a check warns, too (a failed check always does)")


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _meminfo() -> Dict[str, int]:
    out: Dict[str, int] = {}
    text = _read("/proc/meminfo") or ""
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return out


def check_hugepages(host_budget: int) -> Check:
    mi = _meminfo()
    size = mi.get("Hugepagesize", 2 << 20)
    total, free = mi.get("HugePages_Total", 0), mi.get("HugePages_Free", 0)
    thp = _read("/sys/kernel/mm/transparent_hugepage/enabled") or "unknown"
    thp_mode = thp[thp.find("[") + 1 : thp.find("]")] if "[" in thp else thp
    want = -(-host_budget // size)
    data = {"hugepage_bytes": size, "total": total, "free": free, "thp": thp_mode, "wanted_for_host_budget": want}
    summary = f"{total} x {human_bytes(size)} reserved ({free} free); transparent huge pages: {thp_mode}"
    fix = []
    status = OK
    if free < want:
        status = WARN if thp_mode == "never" else INFO
        fix += [f"# reserve {want} huge pages ({human_bytes(want * size)}) for the host tier:"]
        fix += _sysctl_fix({"vm.nr_hugepages": want})
    if thp_mode == "never":
        status = WARN
        fix += ["echo madvise | sudo tee /sys/kernel/mm/transparent_hugepage/enabled"]
    return Check("huge pages", status, summary, fix, data)


def check_memlock(host_budget: int) -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    inf = resource.RLIM_INFINITY

    def show(v: int) -> str:
        return "unlimited" if v == inf else human_bytes(v)

    data = {"soft": None if soft == inf else soft, "hard": None if hard == inf else hard, "euid": os.geteuid()}
    summary = f"RLIMIT_MEMLOCK soft {show(soft)}, hard {show(hard)}"
    if soft == inf or soft >= host_budget:
        return Check("memlock limit", OK, summary + " (enough to pin the host tier)", [], data)
    if os.geteuid() == 0:
        return Check("memlock limit", INFO, summary + " (root: CAP_IPC_LOCK lifts the limit)", [], data)
    fix = [
        "# pinned (page-locked) host memory for CUDA copies needs a memlock limit >= the host tier:",
        "ulimit -l unlimited            # this shell (needs a hard limit that allows it)",
        "echo '* soft memlock unlimited' | sudo tee -a /etc/security/limits.d/99-kvh.conf",
        "echo '* hard memlock unlimited' | sudo tee -a /etc/security/limits.d/99-kvh.conf",
        "# systemd services: LimitMEMLOCK=infinity; docker: --ulimit memlock=-1:-1",
    ]
    return Check("memlock limit", WARN, summary + f" < host budget {human_bytes(host_budget)}", fix, data)


SEED_SYSCTLS = [
    # name, wanted, comparison ("min" = at least, "max" = at most), why
    ("vm.max_map_count", 1048576, "min", "many mappings for slabs, huge pages and CUDA"),
    ("vm.swappiness", 10, "max", "keep the host tier in RAM"),
    ("vm.dirty_background_ratio", 5, "max", "start writeback early"),
    ("vm.dirty_ratio", 10, "max", "bound dirty page cache (buffered disk tier)"),
]


def check_sysctls() -> Check:
    values: Dict[str, Optional[int]] = {}
    bad = []
    for name, want, cmp, why in SEED_SYSCTLS:
        raw = _read("/proc/sys/" + name.replace(".", "/"))
        v = int(raw.split()[0]) if raw and raw.split()[0].lstrip("-").isdigit() else None
        values[name] = v
        if v is None:
            continue
        if (cmp == "min" and v < want) or (cmp == "max" and v > want):
            bad.append((name, want, v, why))
    summary = ", ".join(f"{k.split('.', 1)[1]}={v}" for k, v in values.items())
    if not bad:
        return Check("sysctl", OK, summary, [], {"values": values})
    fix = [f"# {why} (now {v})" for name, want, v, why in bad]
    fix += _sysctl_fix({name: want for name, want, _, _ in bad})
    status = WARN if any(n == "vm.max_map_count" for n, *_ in bad) else INFO
    return Check("sysctl", status, summary, fix, {"values": values})


def _mount_of(path: Path) -> Dict[str, str]:
    best = {"mount": "/", "fstype": "unknown", "device": "?"}
    text = _read("/proc/self/mounts") or ""
    p = str(path)
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = parts[1].replace("\\040", " ")
        if (p == mnt or p.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best["mount"]):
            best = {"mount": mnt, "fstype": parts[2], "device": parts[0]}
    return best


def _existing(path: Path) -> Path:
    p = path.resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _not_creatable(data_dir: Path) -> Optional[str]:
    """Why data_dir can be neither used nor created, if so: it, or the
    nearest existing path above it, is not a directory."""
    where = _existing(data_dir)
    if where.is_dir():
        return None
    if where == data_dir.resolve():
        return f"{data_dir} is not a directory"
    return f"{data_dir} cannot be created: {where} is not a directory"


def check_data_dir(data_dir: Path, disk_budget: int) -> List[Check]:
    where = _existing(data_dir)
    mnt = _mount_of(where)
    checks = []
    # O_DIRECT: write and read one aligned block in a temporary file.
    o_direct = getattr(os, "O_DIRECT", 0)
    data: Dict[str, Any] = {"path": str(data_dir), "checked_at": str(where), **mnt}
    problem = _not_creatable(data_dir)
    if problem:
        # Nothing to probe: the store could not be made there at all.
        return [
            Check(
                "data dir", FAIL, problem, ["# pass a directory, or a path that can be created: --data-dir DIR"], data
            )
        ]
    if not os.access(where, os.W_OK):
        checks.append(
            Check(
                "O_DIRECT",
                FAIL,
                f"{where} is not writable",
                [f"sudo mkdir -p {data_dir}", f"sudo chown $USER {data_dir}"],
                data,
            )
        )
    elif not o_direct:
        checks.append(Check("O_DIRECT", WARN, "this platform has no O_DIRECT", [], data))
    else:
        fd = -1
        name = None
        try:
            # The write goes through mkstemp's own descriptor: reopening
            # the name would follow whatever another user of a shared
            # directory put there meanwhile (a symlink to any file).
            fd, name = tempfile.mkstemp(prefix=".kvh-doctor-", dir=where)
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | o_direct)
            buf = mmap.mmap(-1, 4096)
            buf.write(b"k" * 4096)
            os.pwrite(fd, buf, 0)
            os.preadv(fd, [buf], 0)
            checks.append(Check("O_DIRECT", OK, f"works on {mnt['fstype']} ({mnt['mount']})", [], data))
        except OSError as exc:
            fix = [
                "# kvh falls back to buffered pread/pwrite (or set disk_buffered=True / KVH_DISK_FLAGS=buffered);",
                "# for direct I/O put the data directory on ext4/xfs on an NVMe drive, e.g.:",
                "kvh demo --data-dir /mnt/nvme/kvh-data",
            ]
            reason = errno.errorcode.get(exc.errno or 0, str(exc.errno))
            checks.append(Check("O_DIRECT", WARN, f"refused on {mnt['fstype']} ({mnt['mount']}): {reason}", fix, data))
        finally:
            if fd >= 0:
                os.close(fd)
            if name:
                try:
                    os.unlink(name)
                except OSError:
                    pass
    try:
        du = shutil.disk_usage(where)
        d2 = dict(data, free=du.free, total=du.total, disk_budget=disk_budget)
        summary = f"{human_bytes(du.free)} free of {human_bytes(du.total)} at {where}"
        if du.free < disk_budget:
            checks.append(
                Check(
                    "free space",
                    WARN,
                    summary + f" < disk budget {human_bytes(disk_budget)}",
                    [f"# free space, or lower disk_bytes to at most {human_bytes(du.free * 0.9)}"],
                    d2,
                )
            )
        else:
            checks.append(Check("free space", OK, summary, [], d2))
    except OSError as exc:
        checks.append(Check("free space", FAIL, f"cannot stat {where}: {exc}", [], data))
    return checks


def _perm_level(mode: int, is_dir: bool) -> str:
    """owner-only, group (what KVH_DISK_SHARE_GROUP makes), or exposed."""
    if not mode & 0o077:
        return "owner-only"
    return "exposed" if mode & (0o027 if is_dir else 0o037) else "group"


# The files an engine opens in a store directory: one of another user
# there makes the open fail.
_STORE_FILE = re.compile(r"LOCK|index|journal|slab-[0-9]+\.kvh")


def _refusals(d: Path, st: os.stat_result) -> Tuple[List[str], List[str]]:
    """Why the engine refuses the existing directory d (as
    kvhi_store_open_dir does: another user's, or one group or others can
    write), and what to run about it."""
    q = shlex.quote(str(d))
    problems: List[str] = []
    fix: List[str] = []
    if st.st_uid != os.geteuid():
        problems.append(f"the directory belongs to user {st.st_uid}, not to this user ({os.geteuid()}): kvh refuses it")
        fix.append(f'sudo chown -R "$(id -u)" {q}   # or give --data-dir a directory of your own')
    mode = st.st_mode & 0o7777
    if mode & 0o022:
        problems.append(f"the directory is writable by other users (mode {mode:04o}): kvh refuses to open it")
        fix.append(f"chmod go-w {q}")
    return problems, fix


def check_store_permissions(data_dir: Path) -> Check:
    """Who can read the store: kvh creates its directory 0700 and its files
    0600 (0750/0640 with KVH_DISK_SHARE_GROUP) whatever the umask, refuses a
    directory of another user or one other users can write to (a failed
    check), and narrows wider modes when it opens a store; an older store
    may still be readable by others."""
    name = "store permissions"
    d = Path(data_dir)
    problem = _not_creatable(d)
    if problem:
        return Check(name, INFO, f"not checked: {problem}", [], {"path": str(d)})
    if d.is_symlink():
        # The engine opens the store directory without following a link.
        return Check(
            name,
            FAIL,
            f"{d} is a symbolic link: kvh refuses it",
            [f"# give the directory's own path: --data-dir {shlex.quote(os.path.realpath(d))}"],
            {"path": str(d)},
        )
    if not d.exists():
        summary = f"{d} does not exist yet: kvh creates it 0700 (files 0600) whatever the umask"
        return Check(name, OK, summary, [], {"path": str(d)})
    try:
        st = d.stat()
    except OSError as exc:
        return Check(name, WARN, f"cannot stat {d}: {exc}", [], {"path": str(d)})
    if not d.is_dir():
        return Check(name, FAIL, f"{d} is not a directory", [], {"path": str(d)})
    mode = st.st_mode & 0o7777
    refused, fix = _refusals(d, st)
    if not any((d / n).exists() for n in ("LOCK", "index", "journal", "slab-0000.kvh")):
        # Another program's directory: its files are not kvh's to judge.
        data = {"path": str(d), "dir_mode": f"{mode:04o}"}
        if refused:
            return Check(name, FAIL, f"{d} holds no kvh store yet; " + "; ".join(refused), fix, data)
        summary = f"{d} holds no kvh store yet: kvh narrows it to 0700 and creates its files 0600 when it opens one"
        return Check(name, OK, summary, [], data)
    levels = [_perm_level(mode, True)]
    exposed = [f"(directory) {mode:04o}"] if levels[0] == "exposed" else []
    files: Dict[str, str] = {}
    foreign = st.st_uid != os.geteuid()
    foreign_files: List[str] = []
    try:
        entries = sorted(os.scandir(d), key=lambda e: e.name)
    except OSError:
        entries = []
    for ent in entries:
        if ent.name.startswith(".") or not ent.is_file(follow_symlinks=False):
            continue
        try:
            fst = ent.stat(follow_symlinks=False)
        except OSError:
            continue
        fmode = fst.st_mode & 0o7777
        files[ent.name] = f"{fmode:04o}"
        lv = _perm_level(fmode, False)
        levels.append(lv)
        foreign |= fst.st_uid != os.geteuid()
        if fst.st_uid != os.geteuid() and _STORE_FILE.fullmatch(ent.name):
            foreign_files.append(ent.name)
        if lv == "exposed":
            exposed.append(f"{ent.name} {fmode:04o}")
    order = ["owner-only", "group", "exposed"]
    level = max(levels, key=order.index)
    data = {
        "path": str(d),
        "permissions": level,
        "dir_mode": f"{mode:04o}",
        "files": files,
        "dir_writable_by_others": bool(mode & 0o022),
        "other_owner": foreign,
    }
    q = shlex.quote(str(d))
    if foreign_files and st.st_uid == os.geteuid():
        refused.append(f"{', '.join(foreign_files)} belong to another user: kvh refuses to open them")
        fix.append(f'sudo chown "$(id -u)" {" ".join(shlex.quote(str(d / n)) for n in foreign_files)}')
    problems = list(refused)
    if level == "exposed":
        problems.append("other users can read cached prompts' KV: " + ", ".join(exposed))
        if not refused:  # a refused open narrows nothing: its fix comes first
            fix += [
                "# kvh narrows the modes itself on its next open; or now:",
                f"chmod 700 {q} && find {q} -maxdepth 1 -type f -exec chmod 600 {{}} +",
            ]
    if refused:
        return Check(name, FAIL, "; ".join(problems), fix, data)
    if problems:
        return Check(name, WARN, "; ".join(problems), fix, data)
    if level == "group":
        return Check(name, INFO, f"group-readable (KVH_DISK_SHARE_GROUP): directory {mode:04o}", [], data)
    return Check(name, OK, f"owner only: directory {mode:04o}, {len(files)} files 0600 or narrower", [], data)


def check_io_uring() -> Check:
    disabled = _read("/proc/sys/kernel/io_uring_disabled")
    data = {"io_uring_disabled": disabled}
    if disabled is None or disabled == "0":
        uring = ctypes.util.find_library("uring")
        return Check(
            "io_uring",
            OK,
            "enabled"
            + ("" if disabled is not None else " (no io_uring_disabled knob)")
            + (f"; liburing {uring}" if uring else ""),
            [],
            data,
        )
    return Check(
        "io_uring",
        WARN,
        f"kernel.io_uring_disabled = {disabled}: the disk tier uses pread/pwrite",
        _sysctl_fix({"kernel.io_uring_disabled": 0}),
        data,
    )


def check_numa() -> Check:
    base = Path("/sys/devices/system/node")
    nodes = sorted((p for p in base.glob("node[0-9]*")), key=lambda p: int(p.name[4:])) if base.exists() else []
    layout = []
    for n in nodes:
        cpus = _read(str(n / "cpulist")) or "?"
        mem = 0
        for line in (_read(str(n / "meminfo")) or "").splitlines():
            if "MemTotal" in line:
                parts = line.split()
                mem = int(parts[-2]) * 1024
        layout.append({"node": int(n.name[4:]), "cpus": cpus, "memory": mem})
    gpus = []
    for dev in Path("/sys/bus/pci/devices").glob("*") if Path("/sys/bus/pci/devices").exists() else []:
        if (_read(str(dev / "vendor")) or "") == "0x10de" and (_read(str(dev / "class")) or "").startswith("0x03"):
            gpus.append({"pci": dev.name, "numa_node": int(_read(str(dev / "numa_node")) or -1)})
    libnuma = ctypes.util.find_library("numa")
    data = {"nodes": layout, "gpus": gpus, "libnuma": libnuma}
    if len(layout) <= 1:
        return Check("NUMA", OK, f"{max(1, len(layout))} node; nothing to bind", [], data)
    summary = "; ".join(f"node {n['node']}: cpus {n['cpus']}, {human_bytes(n['memory'])}" for n in layout)
    fix = []
    for g in gpus:
        if g["numa_node"] >= 0:
            fix.append(
                f"# GPU {g['pci']} is on node {g['numa_node']}: Engine(numa_node={g['numa_node']}) binds "
                "the host tier and the migration workers there"
            )
    if not libnuma:
        fix.append("sudo apt-get install libnuma1   # kvh binds memory with libnuma when present")
    return Check("NUMA", INFO if fix else OK, summary, fix, data)


def check_cuda() -> Check:
    data: Dict[str, Any] = {}
    smi = shutil.which("nvidia-smi")
    gpus = []
    if smi:
        try:
            res = subprocess.run(
                [smi, "--query-gpu=name,driver_version,memory.total,pci.bus_id", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            for line in res.stdout.strip().splitlines():
                parts = [p.strip() for p in line.split(",")]
                if len(parts) >= 3:
                    gpus.append(
                        {
                            "name": parts[0],
                            "driver": parts[1],
                            "memory": parts[2],
                            "pci": parts[3] if len(parts) > 3 else "",
                        }
                    )
        except (OSError, subprocess.SubprocessError):
            pass
    data["gpus"] = gpus
    driver = None
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int(0)
        if cuda.cuDriverGetVersion(ctypes.byref(v)) == 0:
            driver = v.value
        init = cuda.cuInit(0)
        count = ctypes.c_int(0)
        if init == 0 and cuda.cuDeviceGetCount(ctypes.byref(count)) == 0:
            data["cuda_devices"] = count.value
        else:
            data["cuInit"] = init
    except OSError:
        pass
    data["driver_cuda_version"] = f"{driver // 1000}.{driver % 1000 // 10}" if driver else None
    # What kvh itself sees.
    try:
        from . import Engine, errors  # noqa: F401

        try:
            with Engine(backend="cuda", device_bytes=1 << 20, host_bytes=1 << 20, log_level="error") as e:
                data["kvh_backend"] = e.backend
        except errors.Error as exc:
            data["kvh_backend"] = "cpu"
            data["kvh_cuda_error"] = exc.message
    except ImportError as exc:
        data["kvh_backend"] = None
        data["kvh_cuda_error"] = str(exc)
    if data.get("kvh_backend") == "cuda":
        desc = ", ".join(f"{g['name']} ({g['memory']}, driver {g['driver']})" for g in gpus) or "a CUDA device"
        return Check("CUDA", OK, f"kvh uses {desc}", [], data)
    if not gpus and driver is None:
        return Check("CUDA", INFO, "no NVIDIA GPU or driver: kvh runs on the CPU backend", [], data)
    fix = []
    msg = data.get("kvh_cuda_error") or "the CUDA backend did not start"
    if "insufficient" in msg.lower() or "driver" in msg.lower():
        fix.append("# the NVIDIA driver is older than the CUDA runtime kvh was built with: update the driver")
        fix.append("sudo apt-get install --only-upgrade nvidia-driver   # or your distribution's driver package")
    if "not found" in msg.lower():
        fix.append(
            "# libkvh_cuda.so was not built or installed: build with nvcc on PATH "
            "(cmake -DKVH_WITH_CUDA=ON), or set KVH_CUDA_BACKEND=/path/to/libkvh_cuda.so"
        )
    return Check("CUDA", WARN, f"GPU present but kvh falls back to the CPU: {msg}", fix, data)


def check_kvh() -> Check:
    try:
        from . import _ffi
        from .tools import BadToolVariable, find_tool, loaded_library_path
    except ImportError as exc:
        fix = ["pip install --force-reinstall kvh-cache   # or, in a checkout: pip install ./python"]
        return Check("kvh library", FAIL, str(exc), fix)
    lib = loaded_library_path()
    tools: Dict[str, Optional[str]] = {}
    bad_variables: List[str] = []
    for t in ("kvh-store", "kvh-bench"):
        try:
            tools[t] = find_tool(t)
        except BadToolVariable as exc:
            tools[t] = None
            bad_variables.append(str(exc))
    data = {
        "library": str(lib) if lib else None,
        "version": _ffi.LOADED_VERSION_STRING,
        "binding_built_for": _ffi.BUILT_VERSION_STRING,
        "tools": tools,
    }
    missing = [t for t, p in tools.items() if not p]
    summary = f"libkvh {_ffi.LOADED_VERSION_STRING} at {lib or '?'} (binding built for {_ffi.BUILT_VERSION_STRING})"
    if missing:
        summary += f"; not found: {', '.join(missing)}"
    if bad_variables:
        summary += "; " + "; ".join(bad_variables)
        return Check("kvh library", WARN, summary, ["unset the variable or point it at the built tool"], data)
    return Check("kvh library", OK, summary, [], data)


_REMOTE_FIELDS = (
    "remote_addrs",
    "remote_user",
    "remote_password",
    "remote_tls",
    "remote_tls_ca",
    "remote_timeout_ms",
    "model_salt",
)


def check_remote(config) -> Check:
    """Whether the remote tier's nodes answer (kvh-store remote ping), when
    the configuration names one; nothing is contacted otherwise."""
    addrs = getattr(config, "remote_addrs", None) if config is not None else None
    if not addrs:
        return Check("remote tier", INFO, "not configured (no remote_addrs): nothing is contacted")
    from .tools import BadToolVariable, find_tool

    try:
        tool = find_tool("kvh-store")
    except BadToolVariable as exc:
        return Check("remote tier", WARN, f"{addrs}: {exc}, connectivity not checked")
    if not tool:
        return Check("remote tier", WARN, f"{addrs}: kvh-store not found, connectivity not checked")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVH_REMOTE_")}
    for name in _REMOTE_FIELDS:
        v = getattr(config, name, None)
        if v is not None:
            env["KVH_" + name.upper()] = str(int(v) if isinstance(v, bool) else v)
    # A node that does not answer costs the ping about two remote
    # timeouts (connect, then the command): the doctor waits for that.
    timeout_ms = int(getattr(config, "remote_timeout_ms", 0) or 0)
    nodes = max(1, len(str(addrs).split(",")))
    wait_s = 30 + nodes * 3 * timeout_ms / 1000
    try:
        res = subprocess.run(
            [tool, "remote", "ping", "--json"], env=env, capture_output=True, text=True, timeout=wait_s
        )
    except subprocess.TimeoutExpired:
        return Check(
            "remote tier",
            FAIL,
            f"{addrs}: no answer from kvh-store remote ping in {wait_s:.0f} s",
            ["check remote_addrs and that the nodes run"],
            {"addrs": addrs},
        )
    data: Dict[str, Any] = {"addrs": addrs, "tls": "not available in this build (hiredis 0.14)"}
    try:
        data.update(json.loads(res.stdout))
    except ValueError:
        return Check("remote tier", FAIL, f"{addrs}: {res.stderr.strip() or 'no answer'}", [], data)
    auth = "AUTH" if getattr(config, "remote_password", None) else "no AUTH"
    summary = f"{addrs}: {data.get('answering', 0)} of {data.get('nodes', 0)} node(s) answer ({auth}, no TLS)"
    status = OK if res.returncode == 0 else FAIL
    fix = [] if status == OK else ["check remote_addrs, remote_password and that the nodes run"]
    return Check("remote tier", status, summary, fix, data)


# Budgets a validating engine is opened with at most: its geometry and
# settings are the configuration's, its memory a token amount.
_PROBE_BYTES = 64 << 20
# ... but no less than this many blocks of the configuration's geometry.
_PROBE_BLOCKS = 4


def _block_bytes(cfg) -> int:
    """The bytes of one block of cfg's geometry, uncompressed, as the
    engine sizes it (K and V of every layer; a vector's bytes as the
    library gives them); 0 for a geometry the library refuses (the
    engine's open then says why)."""
    from .codec import vector_bytes

    try:
        vector = vector_bytes("none", cfg.dtype, cfg.head_dim)
        return 2 * int(cfg.num_layers) * int(cfg.num_kv_heads) * int(cfg.block_tokens) * vector
    except Exception:  # noqa: BLE001 - any refusal is the engine's to report
        return 0


def _where(resolved, name: str) -> str:
    """Where a field's value came from, as the user set it."""
    source = resolved.sources.get(name, "default")
    if source.startswith("env "):
        return f"{name}, from ${source[4:]}"
    if source.startswith("file "):
        return f"{name}, from {source[5:]}"
    return f"{name} ({source})"


def _setting(resolved, name: str) -> str:
    """Where to change a field, as the user set it: its variable, or its
    key in the configuration file."""
    from .config import ENV_VARS

    source = resolved.sources.get(name, "default")
    if source.startswith("env "):
        return source[4:]
    if source.startswith("file "):
        return f"{name} in {source[5:]}"
    return f"{ENV_VARS[name]} (or {name} in {resolved.file or '$KVH_CONFIG'})"


def _unset(resolved, name: str) -> str:
    verb = "remove" if resolved.sources.get(name, "").startswith("file ") else "unset"
    return f"{verb} {_setting(resolved, name)}"


def check_config(resolved) -> Check:
    """The resolved configuration as the engine judges it: a tiny engine
    is opened with it (no disk tier, which would create the store, and no
    remote tier, which would be contacted; budgets capped), so a setting
    the engine refuses is found here rather than when a server starts."""
    import dataclasses

    from . import errors
    from .config import ENV_VARS
    from .engine import Engine

    name = "configuration"
    cfg = resolved.config
    data: Dict[str, Any] = {}
    if (cfg.disk_bytes is None) != (cfg.disk_path is None):
        have, lack = ("disk_bytes", "disk_path") if cfg.disk_path is None else ("disk_path", "disk_bytes")
        return Check(
            name,
            FAIL,
            f"{_where(resolved, have)} is set without {lack}: the engine refuses a disk tier with only one of them",
            [f"# set {_setting(resolved, lack)} too, or {_unset(resolved, have)}"],
            {"field": have},
        )
    # The budgets are capped, but never below a few blocks of this
    # geometry: a cap under one block would fail a setup that works.
    cap = max(_PROBE_BYTES, _PROBE_BLOCKS * _block_bytes(cfg))
    budgets = {
        k: min(getattr(cfg, k), cap) if getattr(cfg, k) is not None else cap for k in ("device_bytes", "host_bytes")
    }
    probe = dataclasses.replace(cfg, disk_path=None, disk_bytes=None, remote_addrs=None, log_level="error", **budgets)
    try:
        Engine(probe).close()
    except errors.UnsupportedError as exc:
        return Check(name, WARN, f"not checked in full: {exc.message}", [], data)
    except errors.Error as exc:
        field = exc.message.split()[0] if exc.message else ""
        if field in ENV_VARS:
            where = _where(resolved, field)
            message = exc.message
            if field in budgets and budgets[field] != getattr(cfg, field):
                # The engine judged the capped budget, not the user's:
                # its number is doctor's, and is said to be.
                message = (
                    f"{message} (checked at the {budgets[field]} bytes kvh doctor opens it with, "
                    f"of the {getattr(cfg, field)} set)"
                )
            return Check(
                name,
                FAIL,
                f"the engine refuses {where}: {message}",
                [f"# change or {_unset(resolved, field)}"],
                {"field": field},
            )
        return Check(name, FAIL, f"the engine refuses it: {exc.message}", [], data)
    # The probe opened capped budgets: the ones set are judged here
    # against the machine's memory, which the open does not check unless
    # prefault_memory asks it to.
    from .types import Backend

    in_memory = cfg.host_bytes if cfg.host_bytes is not None else 1 << 30  # kvh_config_init's defaults
    if cfg.backend is not None and Backend.parse(cfg.backend) == Backend.CPU:
        # the CPU backend's device tier is host memory too (AUTO may pick
        # a GPU, whose memory is not judged here)
        in_memory += cfg.device_bytes if cfg.device_bytes is not None else 256 << 20
    total = _meminfo().get("MemTotal", 0)
    if total and in_memory > total:
        return Check(
            name,
            WARN,
            f"the engine accepts its geometry and policies, but its memory tiers ({human_bytes(in_memory)}) "
            f"exceed this machine's memory ({human_bytes(total)}): an engine opened with them fails with "
            "KVH_ERR_NOMEM, or is killed as they fill",
            [f"# lower {' / '.join(_setting(resolved, n) for n in ('device_bytes', 'host_bytes'))}"],
            dict(data, memory_tier_bytes=in_memory, memory_total=total),
        )
    return Check(name, OK, "the engine accepts it (geometry, policies; budgets within this machine's memory)", [], data)


def run_checks(
    data_dir: Path, host_budget: int, disk_budget: int, progress: Optional[Callable[[str], None]] = None
) -> List[Check]:
    # Each check under the name it reports, which a check that crashes
    # is reported under too.
    steps: List[Any] = [
        ("kvh library", check_kvh),
        ("huge pages", lambda: check_hugepages(host_budget)),
        ("memlock limit", lambda: check_memlock(host_budget)),
        ("sysctl", check_sysctls),
        ("O_DIRECT", lambda: check_data_dir(data_dir, disk_budget)),
        ("store permissions", lambda: check_store_permissions(data_dir)),
        ("io_uring", check_io_uring),
        ("NUMA", check_numa),
        ("CUDA", check_cuda),
    ]
    out: List[Check] = []
    for name, step in steps:
        out.extend(run_check(name, step))
        if progress:
            progress(out[-1].name)
    return out


def run_check(name: str, step: Callable[[], Any]) -> List[Check]:
    """One check's results; a check that crashes (an OSError included) is
    a failed check under its name: what it was to look at is unknown, and
    it must never take the others down."""
    try:
        res = step()
    except Exception as exc:
        return [Check(name, FAIL, f"the check itself failed: {type(exc).__name__}: {exc}")]
    return res if isinstance(res, list) else [res]


def main_doctor(args) -> int:
    from ._progress import Progress

    from .config import resolve

    try:
        resolved = resolve(file=args.config)
        config_error = None
    except (ValueError, OSError) as exc:
        if args.config:
            # A file named on the command line that cannot be read or
            # parsed is the caller's mistake, not a finding.
            print(f"kvh: --config {args.config}: {exc}", file=sys.stderr)
            return 2
        resolved, config_error = None, str(exc)
    except Exception as exc:  # kvh.Error: a bad KVH_* variable
        resolved, config_error = None, getattr(exc, "message", None) or str(exc)
    with Progress(9, "kvh doctor", enabled=None if not args.json else False, unit="check") as bar:
        checks = run_checks(
            args.data_dir, args.host_budget, args.disk_budget, progress=lambda name: bar.update(1, name)
        )
        checks.extend(run_check("remote tier", lambda: check_remote(resolved.config if resolved else None)))
        if resolved is not None:
            checks.extend(run_check("configuration", lambda: check_config(resolved)))
    if args.json:
        json.dump(
            {
                "checks": [c.to_json() for c in checks],
                "ok": all(c.status in (OK, INFO) for c in checks) and config_error is None,
                "config": (
                    {name: {"value": value, "source": source} for name, value, source in resolved.rows()}
                    if resolved
                    else None
                ),
                "config_error": config_error,
            },
            sys.stdout,
            indent=2,
        )
        sys.stdout.write("\n")
    else:
        marks = {OK: "ok", WARN: "WARN", FAIL: "FAIL", INFO: "info"}
        print(
            table(
                [[c.name, marks[c.status], c.summary] for c in checks],
                ["check", "status", "detail"],
                title="kvh doctor (read-only: nothing was changed)",
                align="lll",
            )
        )
        print()
        if resolved is not None:
            src = f" (file: {resolved.file})" if resolved.file else " (no file: $KVH_CONFIG is unset)"
            print(
                table(
                    list(resolved.rows()),
                    ["field", "value", "from"],
                    title="effective configuration: argument > environment > file > default" + src,
                    align="lll",
                )
            )
        else:
            print(f"configuration: {config_error}")
        fixes = [c for c in checks if c.fix]
        if fixes:
            print("\nWhat to change:")
            for c in fixes:
                print(f"\n[{c.name}]")
                for line in c.fix:
                    print(f"  {line}")
        else:
            print("\nNothing to change.")
    # kvh's exit statuses: 1 when a check failed; --strict, also on a warning.
    failed = any(c.status == FAIL for c in checks) or config_error is not None
    warned = any(c.status == WARN for c in checks)
    return 1 if failed or (args.strict and warned) else 0
