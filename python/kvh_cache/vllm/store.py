"""The worker side of the vLLM connector without vLLM: one kvh engine whose
external pool is the inference engine's own KV memory, described by raw
pointers and byte strides (so it can be tested with NumPy arrays and needs
neither torch nor vLLM).

One pool slot is one vLLM block and kvh's ``block_tokens`` is vLLM's block
size: vLLM allocates, matches and frees whole blocks, so a finer kvh block
would only add calls (kvh's block can be any power of two up to 256; vLLM's
CPU block is 128 tokens by default).

A prompt's last, partial block (its "tail": the tokens after its last full
block, less the last token, which vLLM always computes) is kept as one more
block whose tokens are the tail padded with ``TAIL_PAD`` (no real token id
is negative), chained to the last full block. Only the same prompt asks
for that padded block again, and then vLLM computes one token instead of up
to a block of them. Its KV rows past the tail are whatever vLLM's block
held; vLLM never reads them (it writes them as it computes those tokens).
"""

from __future__ import annotations

import collections
import ctypes
import errno
import fcntl
import hashlib
import hmac
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import errors
from .._ffi import ffi, lib, raise_status, status_name
from ..engine import Block, Engine, Fence, _tokens
from ..types import Tier
from ..pool import OffloadBatch, Pool, RestoreBatch, persist_blocks
from .settings import Settings

log = logging.getLogger("kvh.vllm")

SALT_VERSION = "kvh_cache.vllm/1"
STORE_INSTANCES = 8  # store directories per model: vLLM instances that can run it at once
RESTORE_PART_BLOCKS = 4  # a restore is split only into parts of at least this many blocks
TAIL_PAD = -1
# Requests whose ended lookups are kept to tell a late lookup from a new
# one: far more than requests in flight, a few MiB at most.
ENDED_LOOKUPS_KEPT = 65536


class StoreUnavailable(RuntimeError):
    """kvh cannot serve this worker (the message says why); the connector
    then stays out of vLLM's way."""


# What opening an engine raises for a configuration it refuses: kvh's own
# errors, and kvh.Config's checks of a field's type or range.
_ENGINE_REFUSALS = (errors.Error, ValueError, TypeError)


def _open_instance_store(fields: Dict[str, Any], base: str, disk_bytes: int) -> Tuple[Engine, str]:
    """Opens an engine on the first of the model's store directories that
    no other process has open: ``base``, then ``base.1`` and on, one per
    vLLM instance running this model at once (a store has one writer). A
    restarted instance takes the first free one again, which holds this
    model's blocks whichever instance wrote them."""
    for i in range(STORE_INSTANCES):
        path = base if i == 0 else f"{base}.{i}"
        try:
            engine = Engine(**fields, disk_path=path, disk_bytes=disk_bytes)
        except errors.BusyError:
            continue  # another instance has it open
        except errors.MismatchError as exc:
            # The library's advice (the reset flag) is no connector setting.
            raise StoreUnavailable(
                f"kvh: disk tier at {path} unusable: {errors.without_reset_advice(str(exc))}; "
                "move or remove that directory to start it empty, or set disk_path elsewhere"
            ) from None
        except (errors.KvhIOError, errors.NoSpaceError) as exc:
            raise StoreUnavailable(f"kvh: disk tier at {path} unusable: {exc}") from None
        except _ENGINE_REFUSALS as exc:
            raise StoreUnavailable(f"kvh: cannot open an engine for this model: {exc}") from None
        if i:
            log.info("kvh: store %s is open in another process; this instance uses %s", base, path)
        return engine, path
    raise StoreUnavailable(
        f"kvh: the {STORE_INSTANCES} stores of this model ({base} and {base}.1 to .{STORE_INSTANCES - 1}) "
        "are all open in other processes"
    )


def store_dir_name(salt: int, keyed: bool) -> str:
    """The name of a model's store directory under disk_path. A salt keyed
    by hash_secret must stay secret (it makes hashes uncomputable), and a
    directory name is seen by whoever can list disk_path: the name is then
    a one-way digest of the salt. An unkeyed salt is computable from the
    model anyway, and keeps its plain name."""
    if not keyed:
        return f"{salt:016x}"
    digest = hashlib.blake2b(salt.to_bytes(8, "little"), digest_size=8, person=b"kvh-store-dir").hexdigest()
    return "k" + digest


def _rename_noreplace(src: str, dst: str) -> int:
    """rename(2) that never replaces dst (renameat2 RENAME_NOREPLACE): a
    plain rename would silently replace an empty directory another
    instance has just made there. 0, or the errno: EEXIST when dst
    exists, EINVAL or ENOSYS where the file system or the C library
    cannot rename that way."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return errno.ENOSYS
    at_fdcwd, rename_noreplace = -100, 1
    if fn(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), rename_noreplace) == 0:
        return 0
    return ctypes.get_errno()


def _unused_by_any_kvh(path: str) -> Optional[List[int]]:
    """Takes the flocks an open engine holds on a store (its directory,
    and its LOCK file, the only one older kvh versions took) without
    waiting; None when either is held by another process. The caller
    closes the descriptors returned, which lets the locks go."""
    fds: List[int] = []
    try:
        fds.append(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW))
        try:
            fds.append(os.open(os.path.join(path, "LOCK"), os.O_RDONLY | os.O_NOFOLLOW))
        except FileNotFoundError:
            pass
        for fd in fds:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fds
    except OSError:
        for fd in fds:
            os.close(fd)
        return None


def _rename_old_keyed_stores(disk_path: str, salt: int) -> None:
    """Stores of a keyed salt made before their names were digests are
    renamed to digest names, each while no process has it open (the flocks
    an engine holds), so that the salt leaves the listing. Each goes to
    its own instance number if that name is free, else to the first free
    one of the model's (a store opened meanwhile under the new name is
    never replaced); one still in use is tried again at the next start."""
    old_base = os.path.join(disk_path, store_dir_name(salt, False))
    new_base = os.path.join(disk_path, store_dir_name(salt, True))
    names = [new_base if i == 0 else f"{new_base}.{i}" for i in range(STORE_INSTANCES)]
    for i in range(STORE_INSTANCES):
        old = old_base if i == 0 else f"{old_base}.{i}"
        if not os.path.isdir(old) or os.path.islink(old):
            continue
        fds = _unused_by_any_kvh(old)
        if fds is None:
            log.warning("kvh: an older store of this model is in use by another process; it keeps its old name")
            continue
        try:
            for new in [names[i]] + names:
                err = _rename_noreplace(old, new)
                if err == 0:
                    break
                if err in (errno.EEXIST, errno.ENOTEMPTY):
                    continue
                # Not a taken name: no other name would do better.
                log.warning(
                    "kvh: an older store of this model keeps its old name, which shows the keyed salt in the "
                    "directory listing: renaming it without replacing another failed (%s); rename it by hand "
                    "while no engine has it open",
                    os.strerror(err),
                )
                break
            else:
                log.warning("kvh: an older store of this model could not be renamed (no free store name)")
        finally:
            for fd in fds:
                os.close(fd)


def model_salt(identity: Dict[str, Any], secret: Optional[str] = None) -> int:
    """64-bit namespace of the prefix hashes: the model, dtype, block size,
    geometry and tensor-parallel rank, so a block is only ever found by the
    same model laid out the same way. With a secret the salt is an HMAC of
    that identity, which a tenant who knows the model cannot compute, so it
    cannot choose tokens whose hash equals another tenant's block."""
    text = (SALT_VERSION + "|" + "|".join(f"{k}={identity[k]}" for k in sorted(identity))).encode()
    if secret:
        digest = hmac.new(secret.encode(), text, hashlib.sha256).digest()
    else:
        digest = hashlib.sha256(text).digest()
    return int.from_bytes(digest[:8], "little") or 1


@dataclass
class Counters:
    lookups: int = 0
    lookup_hit_tokens: int = 0
    blocks_loaded: int = 0
    tokens_loaded: int = 0
    tokens_loaded_disk: int = 0  # of tokens_loaded: blocks kvh held on its disk tier
    load_errors: int = 0
    blocks_saved: int = 0  # offered to kvh, including blocks it already held
    save_errors: int = 0
    requests_persisted: int = 0
    persist_errors: int = 0
    load_seconds: float = 0.0
    save_seconds: float = 0.0
    prefetches: int = 0  # lookups that started reading blocks from disk
    blocks_prefetched: int = 0  # blocks those reads asked for
    prefetch_errors: int = 0  # prefetches that could not start
    prefetch_capped: int = 0  # blocks left on disk by the per-request cap

    def to_dict(self) -> Dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class _Req:
    scope: int = 0  # tenant scope of its blocks (vLLM's cache_salt), 0: shared
    hashes: List[int] = field(default_factory=list)
    tokens: Optional[np.ndarray] = None  # the full-block prefix saved or loaded so far
    saved: List[Block] = field(default_factory=list)  # its offloaded blocks, persisted when it ends


@dataclass
class _Held:
    """The blocks a request's last lookup found, retained until they are
    loaded or it is known that they will not be."""

    lookup_id: Optional[int]  # the scheduler's number for that lookup
    blocks: List[Block]
    # What they were found for: a load uses them only for the same tokens
    # in the same scope (request ids come from clients, and may repeat).
    scope: int = 0
    keyed: Optional[np.ndarray] = None


@dataclass
class _Save:
    """An offload batch in flight: the (request, block index) of each item."""

    batch: OffloadBatch
    items: List[Tuple[str, int]]
    t0: float


class SplitRestore:
    """One request's restore issued as several batches, so that kvh's
    migration threads read and scatter its blocks in parallel; waited on
    and reported as one batch (statuses in block order)."""

    def __init__(self, parts: List[RestoreBatch]) -> None:
        self.parts = parts

    def wait_layer(self, layer: int) -> None:
        for part in self.parts:
            part.wait_layer(layer)

    def wait(self) -> None:
        for part in self.parts:
            part.wait()

    def statuses(self) -> List[int]:
        return [st for part in self.parts for st in part.statuses()]


@dataclass
class Load:
    """A restore in flight for one request: blocks [first_block, ...) into
    ``slots``; :meth:`KvStore.finish_load` turns it into the failed slots."""

    req_id: str
    scope: int
    tokens: np.ndarray
    first_block: int
    slots: List[int]
    batch: Optional[SplitRestore]
    blocks: List[Block]
    t0: float
    missing_from: int  # index into slots of the first block kvh does not hold
    on_disk: List[bool] = field(default_factory=list)  # per slot: the block was on kvh's disk tier
    tail: int = 0  # tokens of the last slot when it is a prompt's partial tail block, else 0
    t_ready: Optional[float] = None  # when its last layer was seen in place
    t_lookup: Optional[float] = None  # when the lookup that matched it ran (perf_counter)
    prefetched: int = 0  # of its blocks, how many the lookup had started reading from disk
    prefetch_done: bool = False  # those reads had all ended when the restore was issued
    t_issued: float = 0.0  # when the restore was issued


@dataclass
class _Prefetch:
    """Disk blocks a lookup started reading into the host tier."""

    fence: Fence
    blocks: int
    t0: float
    handles: frozenset  # of the blocks that were on disk at the lookup


def task_ids() -> set:
    """Thread ids of this process (empty where /proc is not there)."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


class KvStore:
    """kvh beneath one vLLM worker (one tensor-parallel rank)."""

    def __init__(
        self,
        settings: Settings,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_tokens: int,
        dtype: str,
        identity: Dict[str, Any],
    ) -> None:
        if block_tokens & (block_tokens - 1) or not 1 <= block_tokens <= 256:
            raise StoreUnavailable(
                f"kvh: vLLM's block size {block_tokens} is not a power of two up to 256, which kvh's blocks must be; "
                "run vLLM with --block-size 128 (or 32, 64, 256)"
            )
        self.settings = settings
        self.block_tokens = block_tokens
        layout = dict(layers=num_layers, kv_heads=num_kv_heads, head_dim=head_dim, block=block_tokens, dtype=dtype)
        self.salt = model_salt(dict(identity, **layout), settings.hash_secret)
        row = num_layers * 2 * num_kv_heads * block_tokens * head_dim * {"f32": 4, "f16": 2, "bf16": 2}[dtype]
        try:
            cpu_mask = settings.migration_cpu_mask
        except ValueError as exc:  # Settings made without settings.load, which checks it
            raise StoreUnavailable(f"kvh: {exc}") from None
        fields: Dict[str, Any] = dict(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_tokens=block_tokens,
            dtype=dtype,
            backend="cpu",
            device_bytes=settings.device_bytes or 2 * row,
            host_bytes=max(settings.host_bytes, 2 * row),
            model_salt=self.salt,
            log_level=settings.log_level,
            migration_cpu_mask=cpu_mask,
            prefault_memory=settings.prefault_memory,
            **settings.engine_remote_fields(),
        )
        self.disk_path: Optional[str] = None
        before = task_ids()
        if settings.disk_enabled:
            # One store per salt: another model (or dtype, block size, rank)
            # gets its own directory instead of a mismatch.
            assert settings.disk_path is not None
            try:
                os.makedirs(settings.disk_path, mode=0o700, exist_ok=True)
            except OSError as exc:
                raise StoreUnavailable(
                    f"kvh: disk tier at {settings.disk_path} cannot be created ({exc.strerror}); "
                    "set kv_connector_extra_config disk_path / KVH_VLLM_DISK_PATH to a writable directory, "
                    "or disk_bytes=0 for no disk tier"
                ) from None
            keyed = bool(settings.hash_secret)
            if keyed:
                _rename_old_keyed_stores(settings.disk_path, self.salt)
            self.engine, self.disk_path = _open_instance_store(
                fields, os.path.join(settings.disk_path, store_dir_name(self.salt, keyed)), settings.disk_bytes
            )
        else:
            try:
                self.engine = Engine(**fields)
            except _ENGINE_REFUSALS as exc:
                raise StoreUnavailable(f"kvh: cannot open an engine for this model: {exc}") from None
        # kvh's own threads (its migration workers), for the timing trace.
        self.kvh_tids = sorted(task_ids() - before)
        self.block_bytes = self.engine.block_bytes
        self.num_layers = num_layers
        self.counters = Counters()
        self._pool: Optional[Pool] = None
        self._reqs: Dict[str, _Req] = {}
        self._held: Dict[str, _Held] = {}
        self._prefetches: Dict[str, _Prefetch] = {}
        # Stages of the recent loads, for the timing trace.
        self.load_log: Deque[Dict[str, Any]] = collections.deque(maxlen=64)
        self._looked_up: Dict[str, float] = {}  # req_id -> perf_counter of its last lookup
        # req_id -> the newest of its lookup ids that ended (released, or
        # its request finished). A lookup arriving with that id or an
        # older one ran on after its caller timed out: it holds nothing,
        # or its blocks could stay retained until close. A request id
        # used again gets newer lookup ids, which hold as any do.
        self._ended_lookups: "collections.OrderedDict[str, int]" = collections.OrderedDict()
        self._prefetch = bool(self.disk_path and settings.prefetch)
        # A request may take a quarter of the host tier by prefetching, so
        # that one long prompt cannot push everything else out.
        self.prefetch_cap = max(1, max(settings.host_bytes, 2 * row) // self.block_bytes // 4)
        self._lock = threading.Lock()
        self._saves: List[_Save] = []  # offload batches not yet seen complete
        self._persists: List[Tuple[Fence, int]] = []  # (fence, blocks) of persists in flight
        self._persist_warned = False
        self._persist = bool((self.disk_path or settings.remote_addrs) and settings.persist)
        self.tail_min_tokens = settings.tail_min_tokens
        # Settings the store cannot use as given: said, not changed silently.
        if settings.host_bytes < 2 * row:
            log.warning(
                "kvh: host_bytes %d is less than two blocks of this model (%d bytes): the host tier holds two",
                settings.host_bytes,
                2 * row,
            )
        if settings.tail_min_tokens >= block_tokens:
            log.warning(
                "kvh: tail_min_tokens %d is not below the block size (%d): no partial block is ever kept",
                settings.tail_min_tokens,
                block_tokens,
            )
        self.restore_threads = max(1, int(self.engine.config.migration_threads or 1))

    # ---- the inference engine's memory ----
    def register_pool(
        self,
        k_ptrs: Sequence[int],
        v_ptrs: Sequence[int],
        num_slots: int,
        slot_stride: int,
        token_stride: int,
        head_stride: int,
    ) -> None:
        """Registers the KV memory (one K and one V base pointer per layer,
        strides in bytes). No copy is made; the memory must outlive close()."""
        self._pool = Pool.from_pointers(self.engine, k_ptrs, v_ptrs, num_slots, slot_stride, token_stride, head_stride)
        self.num_slots = num_slots

    # ---- hashes ----
    def _chain(self, req: _Req, tokens: np.ndarray, n_blocks: int) -> List[int]:
        bt = self.block_tokens
        if req.tokens is not None and len(req.hashes):
            k = min(len(req.hashes), n_blocks)
            if not np.array_equal(req.tokens[: k * bt], tokens[: k * bt]):
                req.hashes = []
        h = ffi.new("uint64_t *")
        with self.engine._call() as p:
            for i in range(len(req.hashes), n_blocks):
                parent = req.hashes[i - 1] if i else 0
                blk = tokens[i * bt : (i + 1) * bt]
                st = lib.kvh_prefix_hash_scoped(p, req.scope, parent, ffi.from_buffer("int32_t[]", blk), bt, h)
                if st:
                    raise_status(st)
                req.hashes.append(int(h[0]))
        req.tokens = tokens[: max(len(req.hashes), n_blocks) * bt].copy()
        return req.hashes

    # ---- the partial tail block ----
    def tail_of(self, n_tokens: int) -> int:
        """Tokens of the tail block kept for a prefix of n_tokens (0: none)."""
        r = n_tokens % self.block_tokens
        return r if self.tail_min_tokens and r >= self.tail_min_tokens else 0

    def keyed(self, tokens: np.ndarray) -> np.ndarray:
        """The token blocks kvh files a prefix under: its full blocks, then
        its tail (if kept) padded to a block with TAIL_PAD."""
        bt = self.block_tokens
        full = tokens.size // bt * bt
        r = self.tail_of(tokens.size)
        if not r:
            return tokens[:full]
        pad = np.full(bt - r, TAIL_PAD, dtype=np.int32)
        return np.concatenate([tokens[: full + r], pad])

    # ---- lookups (the scheduler's questions) ----
    def lookup(self, req_id: str, tokens: Sequence[int], scope: int = 0, lookup_id: Optional[int] = None) -> int:
        """Tokens of the longest prefix of tokens kvh holds in ``scope`` (a
        tenant's: blocks of other scopes never match): whole blocks, or all
        of tokens when kvh holds their tail block too. The blocks stay
        retained for req_id until load(), release_lookup(lookup_id), the
        request's next lookup or forget(), so that what was promised cannot
        be evicted before it is loaded."""
        tk = _tokens(tokens)
        keyed = self.keyed(tk)
        blocks = self.engine.prefix_lookup(keyed, scope=scope) if keyed.size else []
        full = tk.size // self.block_tokens
        found = tk.size if len(blocks) > full else len(blocks) * self.block_tokens
        with self._lock:
            ended = self._ended_lookups.get(req_id)
            held = self._held.get(req_id)
            # Lookup ids grow: one older than what ended, or than the hold
            # it would replace, ran on after its caller gave up on it.
            late = lookup_id is not None and (
                (ended is not None and lookup_id <= ended)
                or (held is not None and held.lookup_id is not None and lookup_id < held.lookup_id)
            )
            old = None if late else self._held.pop(req_id, None)
            if not late:
                if blocks:
                    self._held[req_id] = _Held(lookup_id, blocks, scope, keyed)
                self._looked_up[req_id] = time.perf_counter()
            self.counters.lookups += 1
            self.counters.lookup_hit_tokens += found
        # A late lookup holds nothing; a new one replaces what the last held.
        dropped = blocks if late else old.blocks if old else []
        for b in dropped:
            b.release()
        if late:
            return found
        if self._prefetch and blocks:
            self._start_prefetch(req_id, blocks)
        return found

    def _start_prefetch(self, req_id: str, blocks: List[Block]) -> None:
        """Starts reading the matched blocks that are on disk into the host
        tier, so that the restore vLLM asks for next finds them in RAM. The
        reads are kvh's own moves (checksummed as every disk read is: a
        corrupt block is found here and fails its restore later, which vLLM
        recomputes). Nothing waits for them: a restore of a block still
        being read waits for that read, a request that is aborted or never
        scheduled leaves its blocks cached in the host tier (evicted by
        policy like any other). Once per request."""
        with self._lock:
            if req_id in self._prefetches:
                return
        try:
            on_disk = [b for b in blocks if b.info().tier == Tier.DISK]
        except errors.Error:
            return  # a block freed meanwhile: the restore looks it up again
        if not on_disk:
            return
        capped = max(0, len(on_disk) - self.prefetch_cap)
        on_disk = on_disk[: self.prefetch_cap]
        try:
            fence = self.engine.migrate(on_disk, Tier.HOST, wait=False)
        except errors.Error as exc:
            with self._lock:
                self.counters.prefetch_errors += 1
            log.debug("kvh: prefetching %d blocks of request %s failed (%s)", len(on_disk), req_id, exc)
            return
        assert fence is not None
        with self._lock:
            self._prefetches[req_id] = _Prefetch(
                fence, len(on_disk), time.perf_counter(), frozenset(b.handle for b in on_disk)
            )
            self.counters.prefetches += 1
            self.counters.blocks_prefetched += len(on_disk)
            self.counters.prefetch_capped += capped

    def release_lookup(self, req_id: str, lookup_id: Optional[int]) -> int:
        """Ends what lookup ``lookup_id`` of req_id, or an older one, holds,
        once vLLM will not load it (the request was not scheduled, or
        scheduled without it, or it finished); such a lookup arriving
        later holds nothing. What a later lookup of the request holds, or
        what a load took already, is left alone. Returns the blocks
        released."""
        with self._lock:
            if lookup_id is not None:
                self._end_lookup(req_id, lookup_id)
            held = self._held.get(req_id)
            if held is None or not self._ended(held, lookup_id):
                return 0
            del self._held[req_id]
        for b in held.blocks:
            b.release()
        return len(held.blocks)

    def _end_lookup(self, req_id: str, lookup_id: int) -> None:
        """Notes that req_id's lookups up to lookup_id ended (under _lock)."""
        newest = max(lookup_id, self._ended_lookups.pop(req_id, lookup_id))
        self._ended_lookups[req_id] = newest
        while len(self._ended_lookups) > ENDED_LOOKUPS_KEPT:
            self._ended_lookups.popitem(last=False)

    @staticmethod
    def _ended(held: _Held, lookup_id: Optional[int]) -> bool:
        """Whether a hold is that of lookup_id or an older lookup."""
        if held.lookup_id is None or lookup_id is None:
            return held.lookup_id == lookup_id
        return held.lookup_id <= lookup_id

    def _held_matches(self, held: _Held, tokens: np.ndarray, end: int, scope: int) -> bool:
        """Whether what a lookup held was found for these tokens' first
        ``end`` blocks in this scope."""
        if held.scope != scope or held.keyed is None:
            return False
        want = self.keyed(tokens[: end * self.block_tokens])[: end * self.block_tokens]
        have = held.keyed[: want.size]
        return have.size == want.size and bool(np.array_equal(have, want))

    def _drop_prefetch(self, req_id: str) -> Optional[_Prefetch]:
        with self._lock:
            self._looked_up.pop(req_id, None)
            return self._prefetches.pop(req_id, None)

    def forget(self, req_ids, last_lookups: Optional[Dict[str, Optional[int]]] = None) -> None:
        """Drops the state of finished requests; the blocks they saved are
        made durable in the background (``kvh_blocks_persist``: no copy
        here, no temporary sequence; blocks still being gathered are
        waited for by kvh). ``last_lookups``: a request's last lookup id,
        where known: that lookup or an older one arriving later holds
        nothing, while what a newer one holds (a new request under the
        same id) is kept. A request id used again after this is a new
        request."""
        last_lookups = last_lookups or {}
        for rid in req_ids:
            last = last_lookups.get(rid)
            with self._lock:
                if last is not None:
                    self._end_lookup(rid, last)
                held = self._held.get(rid)
                newer = held is not None and last is not None and not self._ended(held, last)
                if held is not None and not newer:
                    del self._held[rid]
                else:
                    held = None
                req = self._reqs.pop(rid, None)
            if not newer:
                self._drop_prefetch(rid)  # its reads end on their own; the blocks stay cached
            for b in held.blocks if held else ():
                b.release()
            if req is None:
                continue
            # Blocks of its offloads still gathering are persisted too:
            # kvh waits for their gathers before writing them.
            with self._lock:
                inflight = [b for sv in self._saves for (r, _), b in zip(sv.items, sv.batch.blocks) if r == rid]
            blocks = req.saved + inflight
            if self._persist and blocks:
                try:
                    fence = persist_blocks(self.engine, blocks, wait=False)
                    with self._lock:
                        self._persists.append((fence, len(blocks)))
                except errors.Error as exc:
                    self._persist_failed(exc)
            for b in req.saved:
                b.release()
        self.poll()

    # ---- transfers ----
    def _req(self, req_id: str, scope: int) -> _Req:
        with self._lock:
            req = self._reqs.get(req_id)
            if req is None or req.scope != scope:
                req = self._reqs[req_id] = _Req(scope=scope)
            return req

    def start_load(
        self, req_id: str, tokens: Sequence[int], first_block: int, slots: Sequence[int], scope: int = 0
    ) -> Load:
        """Starts restoring blocks [first_block, first_block + len(slots)) of
        the prefix (in ``scope``) into vLLM's slots, on kvh's workers, one
        fence per layer (:meth:`wait_layer`). When tokens end inside the
        last of those blocks, that block is the prefix's tail block.
        :meth:`finish_load` gives the slots that could not be loaded."""
        t0 = time.perf_counter()
        bt = self.block_tokens
        end = first_block + len(slots)
        tk = _tokens(tokens)
        tail = self.tail_of(tk.size) if tk.size < end * bt else 0
        with self._lock:
            held = self._held.pop(req_id, None)
            t_lookup = self._looked_up.get(req_id)
        blocks = held.blocks if held else None
        if held is not None and not self._held_matches(held, tk, end, scope):
            for b in held.blocks:
                b.release()  # found for other tokens or another tenant
            blocks = None
        pf = self._drop_prefetch(req_id)
        if blocks is None or len(blocks) < end:
            for b in blocks or ():
                b.release()
            blocks = self.engine.prefix_lookup(self.keyed(tk[: end * bt])[: end * bt], scope=scope)
        n = max(0, min(len(blocks), end) - first_block)
        was_on_disk = pf.handles if pf else frozenset()
        on_disk = [b.handle in was_on_disk or b.info().tier == Tier.DISK for b in blocks[first_block : first_block + n]]
        batch = None
        prefetch_done = pf is not None and pf.fence.done()
        if n and self._pool is not None:
            try:
                batch = self._restore(
                    blocks[first_block : first_block + n], list(slots[:n]), bool(tail) and n == len(slots)
                )
            except errors.Error as exc:
                log.warning("kvh: loading request %s failed (%s); vLLM recomputes it", req_id, exc)
                n = 0
        return Load(
            req_id,
            scope,
            tk,
            first_block,
            list(slots),
            batch,
            blocks,
            t0,
            n,
            on_disk,
            tail=tail,
            t_lookup=t_lookup,
            prefetched=pf.blocks if pf else 0,
            prefetch_done=prefetch_done,
            t_issued=time.perf_counter(),
        )

    def _restore(self, blocks: List[Block], slots: List[int], ends_with_tail: bool = False) -> SplitRestore:
        """Issues the restore as one batch per migration thread (at least
        RESTORE_PART_BLOCKS blocks each): a thread reads, checks and
        scatters its part while the others do theirs. A prompt's tail block
        (the last of blocks when ends_with_tail) is a batch of its own,
        issued first and listed last: the forward pass waits for all of it
        before its first layer (:meth:`wait_tail`), and for the other
        blocks only layer by layer."""
        tail_batch: Optional[RestoreBatch] = None
        batches: List[RestoreBatch] = []
        try:
            if ends_with_tail and len(blocks) > 1:
                tail_batch = self._pool.restore(blocks[-1:], slots[-1:])
                blocks, slots = blocks[:-1], slots[:-1]
            parts = max(1, min(self.restore_threads, len(blocks) // RESTORE_PART_BLOCKS))
            cuts = [len(blocks) * i // parts for i in range(parts + 1)]
            for a, b in zip(cuts, cuts[1:]):
                batches.append(self._pool.restore(blocks[a:b], slots[a:b]))
        except errors.Error:
            for done in batches + ([tail_batch] if tail_batch else []):  # what was issued still runs: let it end
                done.wait()
            raise
        return SplitRestore(batches + ([tail_batch] if tail_batch else []))

    def wait_tail(self, load: Load) -> None:
        """Waits until a load's tail block (if it has one) is in place: the
        rest of the block is vLLM's to write, in the step the load runs, and
        vLLM writes a layer's rows before it waits for that layer's load."""
        if load.tail and load.batch is not None:
            load.batch.parts[-1].wait()  # the tail block's own batch (see _restore)

    def wait_layer(self, load: Load, layer: int) -> None:
        if load.batch is not None:
            load.batch.wait_layer(layer)
        if load.t_ready is None and layer == self.num_layers - 1:
            load.t_ready = time.perf_counter()

    def finish_load(self, load: Load) -> List[int]:
        """Waits for a load; returns the slots that could not be loaded (from
        the first failure on: vLLM recomputes from there)."""
        bad = load.missing_from
        if load.batch is not None:
            load.batch.wait()
            for i, st in enumerate(load.batch.statuses()):
                if st and i < bad:
                    bad = i
                    log.warning(
                        "kvh: loading block %d of request %s failed (%s); vLLM recomputes it",
                        load.first_block + i,
                        load.req_id,
                        status_name(st),
                    )
        for b in load.blocks:
            b.release()
        load.blocks = []
        failed = load.slots[bad:]
        ok = len(load.slots) - len(failed)
        bt = self.block_tokens
        # Tokens of each loaded slot: a tail block holds fewer than a block.
        sizes = [bt] * len(load.slots)
        if load.tail and sizes:
            sizes[-1] = load.tail
        with self._lock:
            c = self.counters
            c.blocks_loaded += ok
            c.tokens_loaded += sum(sizes[:ok])
            c.tokens_loaded_disk += sum(sz for sz, d in zip(sizes[:ok], load.on_disk[:ok]) if d)
            c.load_errors += len(failed)
            c.load_seconds += (load.t_ready or time.perf_counter()) - load.t0
        now = time.perf_counter()
        self.load_log.append(
            {
                "blocks": len(load.slots),
                "failed": len(failed),
                "on_disk": sum(load.on_disk),
                "prefetched": load.prefetched,
                "prefetch_done": load.prefetch_done,
                "lookup_to_start_s": load.t0 - load.t_lookup if load.t_lookup else None,
                "issue_s": load.t_issued - load.t0 if load.t_issued else None,
                "ready_s": (load.t_ready or now) - load.t0,
            }
        )
        full_end = load.first_block + len(load.slots) - (1 if load.tail else 0)
        if ok and not failed and full_end > 0:
            self._chain(self._req(load.req_id, load.scope), load.tokens, full_end)
        return failed

    def load(
        self, req_id: str, tokens: Sequence[int], first_block: int, slots: Sequence[int], scope: int = 0
    ) -> List[int]:
        """:meth:`start_load` and :meth:`finish_load` in one call."""
        return self.finish_load(self.start_load(req_id, tokens, first_block, slots, scope))

    def save_async(self, transfers: Sequence[Tuple[str, Sequence[int], int, Sequence[int], int]]) -> int:
        """Offloads, in batches on kvh's workers, the blocks of each
        (req_id, tokens, first_block, slots, scope): blocks [first_block,
        first_block + len(slots)) computed into vLLM's slots, under their
        chained hashes in scope; when tokens end inside the last of them,
        that block is the prefix's tail block (:meth:`keyed`). Returns the
        blocks queued. The slots must stay as they are until
        :meth:`wait_saves` (vLLM's next forward pass may overwrite a
        finished request's blocks)."""
        bt = self.block_tokens
        items, owners = [], []
        for req_id, tokens, first_block, slots, scope in transfers:
            if not len(slots):
                continue
            tk = _tokens(tokens)
            end = first_block + len(slots)
            tail = tk.size < end * bt
            if tail and (end - 1 != tk.size // bt or not self.tail_of(tk.size)):
                continue
            # The request's chain holds its full blocks only: a tail block
            # is a leaf under the last of them.
            hashes = self._chain(self._req(req_id, scope), tk, end - 1 if tail else end)
            keyed = self.keyed(tk) if tail else tk
            for i, slot in enumerate(slots):
                bi = first_block + i
                items.append((int(slot), hashes[bi - 1] if bi else 0, keyed[bi * bt : (bi + 1) * bt], scope))
                owners.append((req_id, bi))
        if not items or self._pool is None:
            return 0
        t0 = time.perf_counter()
        queued = 0
        for scope, part in self._offload_batches(items, owners):
            try:
                batch = self._pool.offload([p[0] for p in part], scope=scope)
            except errors.Error as exc:
                with self._lock:
                    self.counters.save_errors += len(part)
                log.warning("kvh: offloading %d blocks failed (%s)", len(part), exc)
                continue
            queued += len(part)
            with self._lock:
                self._saves.append(_Save(batch, [p[1] for p in part], t0))
        return queued

    @staticmethod
    def _offload_batches(
        items: List[Tuple[int, int, np.ndarray, int]], owners: List[Tuple[str, int]]
    ) -> List[Tuple[int, List[Tuple[Tuple[int, int, np.ndarray], Tuple[str, int]]]]]:
        """Splits a step's offloads into batches kvh accepts: one scope per
        batch (it hashes all its items in one), each slot at most once (kvh
        refuses the whole batch otherwise). The same block offered twice
        (two requests sharing vLLM's cached prefix) is offloaded once; a
        slot offered under two keys (a prompt's last full block and its
        tail block) goes into a further batch."""
        keys_of_slot: Dict[int, List[Tuple[int, int, bytes]]] = {}
        batches: Dict[Tuple[int, int], List[Tuple[Tuple[int, int, np.ndarray], Tuple[str, int]]]] = {}
        for (slot, parent, tokens, scope), owner in zip(items, owners):
            keys = keys_of_slot.setdefault(slot, [])
            key = (scope, parent, tokens.tobytes())
            if key in keys:
                continue
            # The n-th distinct key of a slot goes into the scope's n-th batch.
            round_ = sum(1 for k in keys if k[0] == scope)
            batches.setdefault((scope, round_), []).append(((slot, parent, tokens), owner))
            keys.append(key)
        return [(scope, batches[(scope, round_)]) for scope, round_ in sorted(batches)]

    def wait_saves(self) -> None:
        """Waits until every queued offload has read its slots (then vLLM
        may reuse them), and files the saved blocks under their requests."""
        with self._lock:
            saves, self._saves = self._saves, []
        for sv in saves:
            sv.batch.wait()
            self._file_save(sv)

    def _file_save(self, sv: _Save) -> None:
        sts = sv.batch.statuses()
        done = sum(1 for st in sts if not st)
        with self._lock:
            for (rid, _), st, blk in zip(sv.items, sts, sv.batch.blocks):
                req = self._reqs.get(rid)
                if st == 0 and req is not None:
                    req.saved.append(blk)
                else:
                    blk.release()
            self.counters.blocks_saved += done
            self.counters.save_errors += len(sts) - done
            self.counters.save_seconds += time.perf_counter() - sv.t0
        if done < len(sts):
            log.warning("kvh: offloading %d of %d blocks failed", len(sts) - done, len(sts))

    def save(self, req_id: str, tokens: Sequence[int], first_block: int, slots: Sequence[int], scope: int = 0) -> int:
        """Offloads blocks [first_block, first_block + len(slots)) of the
        request and waits for it. Returns how many were offloaded; a
        failure (no room) is logged and counted, never raised."""
        before = self.counters.blocks_saved
        self.save_async([(req_id, tokens, first_block, slots, scope)])
        self.wait_saves()
        return self.counters.blocks_saved - before

    # ---- durability ----
    def _persist_failed(self, exc: BaseException) -> None:
        with self._lock:
            self.counters.persist_errors += 1
            warned, self._persist_warned = self._persist_warned, True
        if not warned:
            log.warning(
                "kvh: writing blocks to the disk tier at %s failed (%s); they stay in host RAM only "
                "and a restarted vLLM recomputes them (further failures are counted, not logged)",
                self.disk_path,
                exc,
            )

    def poll(self) -> None:
        """Files the persists that completed (counts them, logs a failure)."""
        with self._lock:
            pending, self._persists = self._persists, []
        keep = []
        for fence, n in pending:
            try:
                if not fence.done():
                    keep.append((fence, n))
                    continue
                fence.result()
                with self._lock:
                    self.counters.requests_persisted += 1
            except errors.Error as exc:
                self._persist_failed(exc)
        with self._lock:
            self._persists[:0] = keep

    def flush(self, timeout_s: float = 60.0) -> None:
        """Waits until queued saves and persists are done."""
        self.wait_saves()
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                fences = [f for f, _ in self._persists]
            if not fences or time.monotonic() > deadline:
                break
            fences[0].wait(max(0.0, deadline - time.monotonic()))
            self.poll()

    # ---- reporting and shutdown ----
    def stats(self) -> Dict[str, Any]:
        self.poll()
        s = self.engine.stats()
        with self._lock:
            out = self.counters.to_dict()
            # Retained for lookups not loaded yet: they cannot be evicted.
            out["held_blocks"] = sum(len(h.blocks) for h in self._held.values())
        out["kvh"] = {k: getattr(s, k) for k in s.__dataclass_fields__ if k != "extra"}
        out["block_tokens"] = self.block_tokens
        out["disk_path"] = self.disk_path
        return out

    def close(self) -> None:
        self.wait_saves()
        with self._lock:
            pending = list(self._reqs)
        self.forget(pending)
        self.flush(120)
        with self._lock:
            held, self._held = self._held, {}
        for h in held.values():
            for b in h.blocks:
                b.release()
        if self._pool is not None:
            self._pool.unregister()
            self._pool = None
        self.engine.close()
