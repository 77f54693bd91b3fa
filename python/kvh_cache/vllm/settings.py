"""Settings of the vLLM connector: ``kv_connector_extra_config`` keys, each
overridable by an environment variable (the variable wins, so a deployment
can change a setting without editing the command line).

=====================  ========================  ==============================
extra_config key       environment variable      default
=====================  ========================  ==============================
``host_bytes``         ``KVH_VLLM_HOST_BYTES``   1 GiB (host RAM tier)
``disk_path``          ``KVH_VLLM_DISK_PATH``    ``~/.cache/kvh/vllm-store``;
                                                 an empty path turns the disk
                                                 off
``disk_bytes``         ``KVH_VLLM_DISK_BYTES``   8 GiB; 0 turns the disk off
``device_bytes``       ``KVH_VLLM_DEVICE_BYTES`` two blocks (kvh's own device
                                                 tier; vLLM's memory is the hot
                                                 copy)
``runtime_dir``        ``KVH_VLLM_RUNTIME_DIR``  ``$XDG_RUNTIME_DIR`` or /tmp
``persist``            ``KVH_VLLM_PERSIST``      1: finished requests' blocks
                                                 are made durable on disk
``lookup_timeout_s``   ``KVH_VLLM_LOOKUP_TIMEOUT`` 5; after a timeout the
                                                 scheduler's lookups are misses
                                                 for 10 s (doubling up to 300 s
                                                 while they time out)
``log_level``          ``KVH_VLLM_LOG_LEVEL``    warn (kvh's own messages)
``tail_min_tokens``    ``KVH_VLLM_TAIL_MIN_TOKENS`` 0: full blocks only; N: a
                                                 prompt's last, partial block is
                                                 kept too (found again by the
                                                 same prompt only) when it holds
                                                 at least N tokens. vLLM then
                                                 computes one token of the
                                                 prompt, not up to a block: a
                                                 different split of the same
                                                 sums, so greedy outputs may
                                                 part from a full prefill's on a
                                                 near-tie
``migration_cpus``     ``KVH_VLLM_MIGRATION_CPUS`` inherit: kvh's copy threads
                                                 keep the CPUs vLLM pins its
                                                 worker to (its compute cores);
                                                 ``all``: any CPU; else a list
                                                 such as ``1,3`` or ``2-5``
``prefetch``           ``KVH_VLLM_PREFETCH``     0; 1: a lookup that finds
                                                 blocks on kvh's disk starts
                                                 reading them into its host
                                                 tier at once (up to a quarter
                                                 of it per request). vLLM asks
                                                 for the restore 5 to 25 ms
                                                 after its lookup, too soon
                                                 for that to pay: measured
                                                 slower (benchmarks/RESULTS.md)
``prefault_memory``    ``KVH_VLLM_PREFAULT_MEMORY`` 1: kvh's host tier is backed
                                                 at start (host_bytes resident),
                                                 so a restore never waits on a
                                                 first-touch page fault; 0:
                                                 pages come as slots are used
``remote_addrs``       ``KVH_VLLM_REMOTE_ADDRS`` none: no remote tier; else
                                                 ``host:port,...`` of a Redis
                                                 Cluster the instances share
``remote_user``        ``KVH_VLLM_REMOTE_USER``  none (AUTH user)
``remote_password``    ``KVH_VLLM_REMOTE_PASSWORD`` none (AUTH password)
``remote_timeout_ms``  ``KVH_VLLM_REMOTE_TIMEOUT_MS`` the library's (50)
``remote_ttl_s``       ``KVH_VLLM_REMOTE_TTL_S`` the library's (86400)
``hash_secret``        ``KVH_VLLM_HASH_SECRET``  none; a secret string keys
                                                 the prefix hashes (HMAC of the
                                                 model identity), so tenants
                                                 (``cache_salt``) cannot aim
                                                 a block's hash at another
                                                 tenant's (kvh.h "Tenant
                                                 scopes"); the same on every
                                                 instance sharing a store
=====================  ========================  ==============================

A key given as JSON ``null`` is unset: it takes its default (or the
environment variable's value), as if it were left out.

Sizes accept a plain number of bytes or a suffix: ``512M``, ``8G``, ``1T``.
Nothing here imports torch or vLLM.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
from typing import Any, List, Mapping, Optional

_log = logging.getLogger("kvh.vllm")

_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: Any) -> int:
    """Bytes from an int or a string such as ``"512M"`` / ``"8GiB"``."""
    if isinstance(value, bool):
        raise ValueError(f"a size must be a number of bytes, not {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size must be >= 0, got {value}")
        return _fits(value, value)
    s = str(value).strip().lower().replace("_", "")
    for tail in ("ib", "b"):
        if s.endswith(tail) and len(s) > len(tail):
            s = s[: -len(tail)]
            break
    unit = s[-1:] if s[-1:] in _SUFFIX and not s[-1:].isdigit() else ""
    num = s[: -len(unit)] if unit else s
    try:
        n = float(num)
    except ValueError:
        raise ValueError(f"cannot read {value!r} as a size (bytes, or a number with K, M, G or T)") from None
    if not math.isfinite(n) or n < 0:
        raise ValueError(f"a size must be a finite number >= 0, got {value!r}")
    if not unit and not n.is_integer():  # "1.5" bytes would be 1
        raise ValueError(f"a size in bytes must be a whole number, got {value!r}")
    return _fits(int(n * _SUFFIX[unit]), value)


_SIZE_MAX = (1 << 64) - 1


def _fits(n: int, given: Any) -> int:
    """A size kvh can take (a 64-bit byte count), found here rather than by
    the worker, which would then run vLLM without kvh."""
    if n > _SIZE_MAX:
        raise ValueError(f"a size must be at most 2^64 - 1 bytes (16 EiB), got {given!r}")
    return n


def _text(value: Any) -> str:
    """Text as given; a number, list or mapping in the JSON is refused
    rather than read as the text it prints as (``disk_path=5`` is not
    the directory ``./5``)."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise TypeError(f"must be text, not {type(value).__name__}")
    if "\0" in value:
        raise ValueError("must not contain NUL characters")
    return value


def _parse_path(value: Any) -> str:
    s = _text(value)
    return os.path.expanduser(s) if s else ""


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    s = str(value).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"cannot read {value!r} as a boolean")


def _parse_count(value: Any, maximum: Optional[int] = None) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"a count must be a whole number, got {value!r}")
    try:
        n = int(str(value).strip()) if isinstance(value, str) else int(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"a count must be a whole number, got {value!r}") from None
    if n < 0:
        raise ValueError(f"a count must be >= 0, got {value!r}")
    if maximum is not None and n > maximum:
        raise ValueError(f"a count must be <= {maximum}, got {value!r}")
    return n


def _parse_u32(value: Any) -> int:
    """A whole number kvh.Config keeps in 32 bits (the remote tier's)."""
    return _parse_count(value, (1 << 32) - 1)


# kvh.Config's names for its log levels.
LOG_LEVELS = ("error", "warn", "warning", "info", "debug")


def _parse_log_level(value: Any) -> str:
    s = str(value).strip().lower()
    if s not in LOG_LEVELS:
        raise ValueError(f"a log level must be one of {', '.join(LOG_LEVELS)}, got {value!r}")
    return s


def _parse_seconds(value: Any) -> float:
    """A timeout in seconds: finite and above 0 (a socket takes no other)."""
    if isinstance(value, bool):  # float(True) is 1.0: no timeout is meant by it
        raise ValueError(f"a timeout must be a number of seconds, got {value!r}")
    try:
        s = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"a timeout must be a number of seconds, got {value!r}") from None
    if not math.isfinite(s) or s <= 0 or s > 86400:
        raise ValueError(f"a timeout must be a number of seconds in (0, 86400], got {value!r}")
    return s


def _cpu_mask(value: Any) -> int:
    """A CPU bit mask from ``all``, ``inherit`` (0) or a list of CPUs and
    ranges; raises ValueError on anything else."""
    s = str(value).strip().lower()
    if s == "inherit":
        return 0
    if s == "all":
        return (1 << min(os.cpu_count() or 1, 64)) - 1
    mask = 0
    try:
        for part in s.split(","):
            lo, dash, hi = part.strip().partition("-")
            if dash and not hi.strip():  # "0-": a range without its end
                raise ValueError
            for c in range(int(lo), int(hi or lo) + 1):
                if not 0 <= c < 64:
                    raise ValueError
                mask |= 1 << c
    except ValueError:
        raise ValueError(f"migration_cpus: {value!r} is not 'all', 'inherit' or a CPU list such as '1,3' or '2-5'")
    if not mask:
        raise ValueError(f"migration_cpus: {value!r} names no CPU")
    return mask


def _parse_cpus(value: Any) -> str:
    _cpu_mask(value)  # raises on a bad value
    return str(value).strip().lower()


def default_cache_dir() -> str:
    base = os.environ.get("KVH_CACHE_DIR")
    if base:
        return base
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvh")


@dataclasses.dataclass(frozen=True)
class Settings:
    host_bytes: int = 1 << 30
    disk_path: Optional[str] = None
    disk_bytes: int = 8 << 30
    device_bytes: int = 0  # 0: two blocks
    runtime_dir: Optional[str] = None
    persist: bool = True
    lookup_timeout_s: float = 5.0
    log_level: str = "warn"
    tail_min_tokens: int = 0
    migration_cpus: str = "inherit"
    prefetch: bool = False
    prefault_memory: bool = True
    remote_addrs: Optional[str] = None
    remote_user: Optional[str] = None
    remote_password: Optional[str] = dataclasses.field(default=None, repr=False)
    remote_timeout_ms: Optional[int] = None
    remote_ttl_s: Optional[int] = None
    hash_secret: Optional[str] = dataclasses.field(default=None, repr=False)

    def engine_remote_fields(self) -> dict:
        """The kvh.Config fields of the remote tier (empty without one)."""
        if not self.remote_addrs:
            return {}
        names = ("remote_addrs", "remote_user", "remote_password", "remote_timeout_ms", "remote_ttl_s")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    @property
    def migration_cpu_mask(self) -> int:
        """kvh's migration_cpu_mask for migration_cpus (0: inherit)."""
        return _cpu_mask(self.migration_cpus)

    @property
    def disk_enabled(self) -> bool:
        return bool(self.disk_bytes) and bool(self.disk_path)


_KEYS = {
    # key: (environment variable, parser)
    "host_bytes": ("KVH_VLLM_HOST_BYTES", parse_size),
    "disk_path": ("KVH_VLLM_DISK_PATH", _parse_path),
    "disk_bytes": ("KVH_VLLM_DISK_BYTES", parse_size),
    "device_bytes": ("KVH_VLLM_DEVICE_BYTES", parse_size),
    "runtime_dir": ("KVH_VLLM_RUNTIME_DIR", _parse_path),
    "persist": ("KVH_VLLM_PERSIST", _parse_bool),
    "lookup_timeout_s": ("KVH_VLLM_LOOKUP_TIMEOUT", _parse_seconds),
    "log_level": ("KVH_VLLM_LOG_LEVEL", _parse_log_level),
    "tail_min_tokens": ("KVH_VLLM_TAIL_MIN_TOKENS", _parse_count),
    "migration_cpus": ("KVH_VLLM_MIGRATION_CPUS", lambda v: _parse_cpus(v)),
    "prefetch": ("KVH_VLLM_PREFETCH", _parse_bool),
    "prefault_memory": ("KVH_VLLM_PREFAULT_MEMORY", _parse_bool),
    "remote_addrs": ("KVH_VLLM_REMOTE_ADDRS", lambda v: _text(v).strip() or None),
    "remote_user": ("KVH_VLLM_REMOTE_USER", lambda v: _text(v) or None),
    "remote_password": ("KVH_VLLM_REMOTE_PASSWORD", lambda v: _text(v) or None),
    "remote_timeout_ms": ("KVH_VLLM_REMOTE_TIMEOUT_MS", _parse_u32),
    "remote_ttl_s": ("KVH_VLLM_REMOTE_TTL_S", _parse_u32),
    "hash_secret": ("KVH_VLLM_HASH_SECRET", lambda v: _text(v) or None),
}
# Never shown in an error message.
_SECRET_KEYS = ("remote_password", "hash_secret")


def _parse(key: str, value: Any, source: str) -> Any:
    """The key's value, or a ValueError naming where it came from (the
    extra_config key or the environment variable) and what it was."""
    try:
        return _KEYS[key][1](value)
    except (TypeError, ValueError, OverflowError) as exc:
        shown = "(hidden)" if key in _SECRET_KEYS else repr(value)
        raise ValueError(f"kvh: {source}={shown}: {exc}") from None


def _close_keys(key: str) -> List[str]:
    """Known keys that key is likely a misspelling of (letters and digits
    alike, case and separators aside)."""

    def bare(text: str) -> str:
        return "".join(ch for ch in text.lower() if ch.isalnum())

    known = {bare(k): k for k in _KEYS}
    return [known[m] for m in difflib.get_close_matches(bare(key), list(known), n=1, cutoff=0.85)]


# KVH_VLLM_ variables that are not settings: read by ``kvh bench vllm`` and
# the vLLM tests.
_TOOL_VARIABLES = ("KVH_VLLM_PYTHON", "KVH_VLLM_MODEL", "KVH_VLLM_TRACE")


def _check_variable_names(env: Mapping[str, str]) -> None:
    """A ``KVH_VLLM_`` variable that is no setting would otherwise be
    ignored without a word: one close to a setting's variable is refused
    (``KVH_VLLM_HOSTBYTES``), any other is logged as ignored."""
    prefix = "KVH_VLLM_"
    known = [var for var, _ in _KEYS.values()]
    # Compared without the prefix they all share, which would make any two
    # look alike (REMOTE_PORT is no misspelt REMOTE_PASSWORD).
    bare = {var[len(prefix) :]: var for var in known}
    for name in sorted(env):
        if not name.startswith(prefix) or name in known or name in _TOOL_VARIABLES:
            continue
        close = difflib.get_close_matches(name[len(prefix) :], list(bare), n=1, cutoff=0.85)
        if close:
            raise ValueError(f"kvh: unknown environment variable {name}; did you mean {bare[close[0]]}?")
        _log.warning("kvh: environment variable %s is not a kvh setting: ignored", name)


def load(extra: Optional[Mapping[str, Any]] = None, environ: Optional[Mapping[str, str]] = None) -> Settings:
    """Settings from ``kv_connector_extra_config`` (keys may carry a
    ``kvh.`` prefix) and the environment. Unknown ``kvh.`` keys are an
    error, so that a misspelt setting is not silently ignored, and so are
    unknown keys close to a known one (``tail_min_token``,
    ``hostbytes``); other unknown keys, which another connector sharing
    the dict may read, are logged as ignored. A value that cannot be used
    is an error too (a ValueError naming the key or the environment
    variable, and the value), and so is a ``KVH_VLLM_`` variable close to
    a setting's (other unknown ones are logged as ignored): the scheduler and every worker load the
    same settings, so each refuses them before it starts."""
    extra = dict(extra or {})
    env = os.environ if environ is None else environ
    values: dict = {}
    for raw_key, v in extra.items():
        key = raw_key[4:] if raw_key.startswith("kvh.") else raw_key
        if key in _KEYS:
            if v is None:
                continue  # JSON null: unset, not the text "None"
            values[key] = _parse(key, v, f"kv_connector_extra_config {raw_key!r}")
            continue
        close = _close_keys(key)
        if raw_key.startswith("kvh.") or close:
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"kvh: unknown kv_connector_extra_config key {raw_key!r}{hint} (known: {sorted(_KEYS)})")
        _log.warning("kvh: kv_connector_extra_config key %r is not a kvh setting: ignored", raw_key)
    _check_variable_names(env)
    for key, (var, _) in _KEYS.items():
        if var in env:
            values[key] = _parse(key, env[var], var)
    if "disk_path" not in values:
        values["disk_path"] = os.path.join(default_cache_dir(), "vllm-store")
    return Settings(**values)
