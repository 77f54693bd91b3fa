"""Engine configuration from arguments, the environment and a TOML file.

One precedence rule, field by field: an explicit argument, else its
environment variable, else the file, else the library's default::

    import kvh_cache as kvh
    import kvh_cache.config

    cfg = kvh_cache.config.load(head_dim=128)          # a kvh.Config
    with kvh.Engine(cfg) as eng: ...

    resolved = kvh_cache.config.resolve(head_dim=128)  # plus where each value came from
    resolved.sources["host_bytes"]               # e.g. "env KVH_HOST_BYTES"

Environment: ``KVH_`` and the field's name in capitals (``KVH_HOST_BYTES=4G``,
``KVH_DISK_PATH=/data/kvh``, ...), parsed by the C library's
``kvh_config_from_env`` so that every front-end reads them alike (sizes take
the suffixes K, M, G, T, P as powers of 1024; names for enums);
``KVH_DISK_FLAGS`` sets ``disk_reset_on_mismatch``, ``disk_buffered`` and
``disk_share_group`` together. File: ``$KVH_CONFIG`` (or ``file=``), a TOML
table of :class:`kvh.Config` field names; a string value of a numeric field
is read with the environment's syntax (``host_bytes = "4G"``).

Nothing here runs on its own: :class:`kvh.Engine` uses only what it is
given. The CLI applies this rule to the engines it opens.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple, Union

from .errors import shown
from .types import Backend, Codec, Config, DType, Eviction

__all__ = ["ENV_FILE", "ENV_VARS", "Resolved", "resolve", "load", "from_env", "from_file"]

#: The variable naming the TOML file.
ENV_FILE = "KVH_CONFIG"

# Config fields the environment sets through one kvh_config field each.
_C_FIELDS = (
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "block_tokens",
    "dtype",
    "backend",
    "cuda_device",
    "device_bytes",
    "host_bytes",
    "disk_bytes",
    "disk_path",
    "model_salt",
    "numa_node",
    "migration_threads",
    "migration_cpu_mask",
    "lru_k",
    "promote_min_hits",
    "log_level",
    "disk_queue_depth",
    "kv_codec",
    "vmap",
    "eviction_policy",
    "lctru_window",
    "copy_moves",
    "disk_strict_index",
    "remote_addrs",
    "remote_user",
    "remote_password",
    "remote_tls_ca",
    "remote_tls",
    "remote_timeout_ms",
    "remote_ttl_s",
    "remote_upload",
    "remote_breaker_ms",
    "prefault_memory",
)
# Text fields: NULL or a C string.
_STRINGS = ("disk_path", "remote_addrs", "remote_user", "remote_password", "remote_tls_ca")
# Shown as set or not, never as their value (kvh doctor prints the rest).
_SECRETS = ("remote_password",)
_FLAG_FIELDS = ("disk_reset_on_mismatch", "disk_buffered", "disk_share_group")

#: Config field -> the environment variable that sets it.
ENV_VARS: Dict[str, str] = {name: "KVH_" + name.upper() for name in _C_FIELDS}
ENV_VARS.update({name: "KVH_DISK_FLAGS" for name in _FLAG_FIELDS})

_ENUMS = {"dtype": DType, "backend": Backend, "kv_codec": Codec, "eviction_policy": Eviction}
_BOOLS = ("vmap", "copy_moves", "disk_strict_index", "remote_tls", "prefault_memory")


@dataclass(frozen=True)
class Resolved:
    """The configuration a front-end uses and, per field of
    :class:`kvh.Config`, where its value came from: ``"argument"``,
    ``"env NAME"``, ``"file PATH"`` or ``"default"`` (the library's, applied
    when the engine opens)."""

    config: Config
    sources: Dict[str, str]
    file: Optional[Path] = None

    def rows(self):
        """(field, value, source) for every field, for display; a field
        left to the library shows the default of kvh_config_init."""
        defaults = library_defaults()
        for f in dataclasses.fields(Config):
            v = getattr(self.config, f.name)
            if v is None:
                v = defaults.get(f.name)
            if f.name in _SECRETS and v is not None:
                v = "(set)"
            yield f.name, _show(v), self.sources.get(f.name, "default")


def _show(v: Any) -> str:
    if v is None:
        return "(none)"
    if hasattr(v, "name") and hasattr(v, "value"):
        return v.name.lower()
    return os.fspath(v) if isinstance(v, os.PathLike) else str(v)


def library_defaults() -> Dict[str, Any]:
    """The Config fields as kvh_config_init fills them."""
    from ._ffi import check, ffi, lib

    c = ffi.new("kvh_config *")
    check(lib.kvh_config_init(c, ffi.sizeof("kvh_config")))
    return _read_c(c, _C_FIELDS)


def _read_c(c, names) -> Dict[str, Any]:
    from ._ffi import ffi, lib

    out: Dict[str, Any] = {}
    for name in names:
        v = getattr(c, name)
        if name in _STRINGS:
            out[name] = os.fsdecode(ffi.string(v)) if v != ffi.NULL else None
        elif name in _ENUMS:
            try:
                out[name] = _ENUMS[name](int(v))
            except ValueError:
                # kvh_config_from_env takes only the numbers of an enum's
                # names; a field this module knows fewer of is refused
                # here, naming the variable.
                from . import errors

                known = ", ".join(m.name.lower() for m in _ENUMS[name])
                raise errors.InvalidArgumentError(
                    f"{ENV_VARS[name]}={int(v)}: no {name} has that number (one of: {known})",
                    int(lib.KVH_ERR_INVALID_ARG),
                ) from None
        elif name in _BOOLS:
            out[name] = bool(v)
        else:
            out[name] = int(v)
    flags = int(c.disk_flags)
    out["disk_reset_on_mismatch"] = bool(flags & int(lib.KVH_DISK_RESET_ON_MISMATCH))
    out["disk_buffered"] = bool(flags & int(lib.KVH_DISK_BUFFERED))
    out["disk_share_group"] = bool(flags & int(lib.KVH_DISK_SHARE_GROUP))
    return out


def _parse_c(assignments: Mapping[str, str]) -> Dict[str, Any]:
    """Runs kvh_config_from_env on NAME=value pairs and returns the Config
    fields they set. InvalidArgumentError names a bad variable."""
    from ._ffi import check, ffi, lib  # noqa: F401 (lib: the calls)

    if not assignments:
        return {}
    for k, v in assignments.items():
        if "\x00" in str(v):
            # C would read the value up to it: "4G\0junk" taken as 4G.
            from . import errors

            raise errors.InvalidArgumentError(
                f"{k}={str(v)!r}: a value holds no NUL character", int(lib.KVH_ERR_INVALID_ARG)
            )
    strings = [ffi.new("char[]", os.fsencode(f"{k}={v}")) for k, v in assignments.items()]
    envp = ffi.new("char *[]", strings + [ffi.NULL])
    c = ffi.new("kvh_config *")
    check(lib.kvh_config_init(c, ffi.sizeof("kvh_config")))
    check(lib.kvh_config_from_env(c, ffi.sizeof("kvh_config"), envp))
    names = [n for n in _C_FIELDS if ENV_VARS[n] in assignments]
    out = _read_c(c, names)
    if "KVH_DISK_FLAGS" not in assignments:
        for name in _FLAG_FIELDS:
            del out[name]
    return out


def from_env(environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """The Config fields the environment sets (empty variables count as
    unset)."""
    env = os.environ if environ is None else environ
    names = sorted(set(ENV_VARS.values()))
    return _parse_c({n: env[n] for n in names if env.get(n)})


CONFIG_FILE_MAX = 1 << 20  # bytes of a configuration file read at most


def from_file(path: Union[str, os.PathLike]) -> Dict[str, Any]:
    """The Config fields of a TOML file (top-level keys). ValueError names
    the file and key of an unknown field or a bad value."""
    p = Path(path)
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            # kvh-cache depends on it there; an install without it (--no-deps) gets told which
            raise ModuleNotFoundError(
                f"reading {p} needs the tomli package on Python < 3.11: pip install tomli", name="tomli"
            ) from None
    with open(p, "rb") as f:
        # Read at most a bound: a path such as /dev/zero must not fill the
        # memory (a pipe, `--config <(...)`, still works).
        raw = f.read(CONFIG_FILE_MAX + 1)
    if len(raw) > CONFIG_FILE_MAX:
        raise ValueError(f"{p}: larger than {CONFIG_FILE_MAX >> 20} MiB: not a kvh configuration file")
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{p}: not valid TOML: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{p}: not valid TOML: {exc}") from None
    known = {f.name for f in dataclasses.fields(Config)}
    out: Dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            raise ValueError(f"{p}: unknown key {key!r} (expected kvh.Config fields: {', '.join(sorted(known))})")
        out[key] = _file_value(p, key, value)
    return out


def _file_value(p: Path, key: str, value: Any) -> Any:
    """A file's value of one field, checked as the environment's would be:
    the C parser reads numbers and names, so a value out of range is
    refused here, naming the file, and not when an engine opens."""
    from .errors import Error

    if key in _FLAG_FIELDS:
        if not isinstance(value, bool):
            raise ValueError(f"{p}: {key} must be true or false, not {shown(value)}")
        return value
    if key in _STRINGS:
        if not isinstance(value, str):
            raise ValueError(f"{p}: {key} must be a string, not {type(value).__name__}")
        return value
    if key in _BOOLS and isinstance(value, bool):
        return value
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        kind = "true, false or a string" if key in _BOOLS else "an integer or a string"
        raise ValueError(f"{p}: {key} must be {kind}, not {shown(value)}")
    try:
        return _parse_c({ENV_VARS[key]: str(value)})[key]
    except Error as exc:
        raise ValueError(f"{p}: {key} = {shown(value)}: {exc.message}") from None
    except ValueError as exc:  # a number no member of the field's enum has
        raise ValueError(f"{p}: {key} = {shown(value)}: {exc}") from None


def resolve(
    config: Optional[Config] = None,
    /,
    *,
    environ: Optional[Mapping[str, str]] = None,
    file: Union[str, os.PathLike, None] = None,
    defaults: Optional[Mapping[str, Any]] = None,
    **fields: Any,
) -> Resolved:
    """The configuration under the rule argument > environment > file >
    default. Arguments: ``config``'s fields that are not None (or not
    False, for the three disk flags) and ``fields``. ``environ`` defaults
    to ``os.environ``; ``file`` to ``$KVH_CONFIG`` (none when unset).
    ``defaults``: a program's own defaults, under the file (source
    ``"default"``); the library's apply to whatever is still unset."""
    env = os.environ if environ is None else environ
    explicit: Dict[str, Any] = {}
    if config is not None:
        for f in dataclasses.fields(Config):
            v = getattr(config, f.name)
            if v is not None and v is not False:
                explicit[f.name] = v
    unknown = (set(fields) | set(defaults or {})) - {f.name for f in dataclasses.fields(Config)}
    if unknown:
        raise TypeError(f"unknown Config field(s): {', '.join(sorted(unknown))}")
    explicit.update({k: v for k, v in fields.items() if v is not None})

    path = Path(file) if file is not None else (Path(env[ENV_FILE]) if env.get(ENV_FILE) else None)
    layers: Tuple[Tuple[str, Dict[str, Any]], ...] = (
        ("default", dict(defaults or {})),
        (f"file {path}", from_file(path) if path is not None else {}),
        ("env", from_env(env)),
        ("argument", explicit),
    )
    values: Dict[str, Any] = {}
    sources: Dict[str, str] = {}
    for origin, layer in layers:
        for k, v in layer.items():
            values[k] = v
            sources[k] = f"env {ENV_VARS[k]}" if origin == "env" else origin
    return Resolved(Config(**values), sources, path)


def load(config: Optional[Config] = None, /, **kwargs: Any) -> Config:
    """:func:`resolve`'s configuration alone."""
    return resolve(config, **kwargs).config
