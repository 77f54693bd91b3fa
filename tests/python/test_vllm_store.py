"""kvh_cache.vllm without vLLM: settings, the lookup channel, and the worker's
store over a NumPy array laid out as vLLM's CPU KV cache (num_blocks,
kv_heads, block_size, 2 * head_dim: per head a block's K rows, then its V
rows). The connector under a real vLLM is tests/python/vllm/."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvh_cache.vllm import channel, settings
from kvh_cache.vllm.store import KvStore, StoreUnavailable, model_salt
from store_damage import flip_first_block_byte

L, H, B, D, NB = 3, 2, 32, 16, 8
ES = 2  # bf16, kept as uint16: kvh only moves the bytes


def test_import_kvh_and_kvh_vllm_import_neither_torch_nor_vllm():
    code = (
        "import sys, kvh_cache, kvh_cache.vllm, kvh_cache.vllm.store, kvh_cache.vllm.channel\n"
        "import kvh_cache.vllm.settings, kvh_cache.vllm.bench\n"
        "bad = [m for m in ('torch', 'vllm') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    import kvh_cache as kvh

    env = dict(os.environ, PYTHONPATH=str(Path(kvh.__file__).resolve().parents[1]))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_settings_from_extra_config_and_environment(tmp_path):
    s = settings.load({"host_bytes": "512M", "kvh.disk_path": str(tmp_path), "disk_bytes": 1 << 30}, environ={})
    assert s.host_bytes == 512 << 20 and s.disk_path == str(tmp_path) and s.disk_bytes == 1 << 30
    assert s.disk_enabled and s.persist
    s = settings.load({"host_bytes": "512M"}, environ={"KVH_VLLM_HOST_BYTES": "2GiB", "KVH_VLLM_DISK_BYTES": "0"})
    assert s.host_bytes == 2 << 30 and not s.disk_enabled
    assert settings.load({}, environ={"KVH_CACHE_DIR": str(tmp_path)}).disk_path is not None
    with pytest.raises(ValueError, match="unknown"):
        settings.load({"kvh.hots_bytes": 1}, environ={})
    with pytest.raises(ValueError):
        settings.parse_size("lots")
    assert settings.parse_size("1.5k") == 1536 and settings.parse_size(7) == 7
    for bad in ("1.5", "inf", "nan", "-1", "1e400k"):
        with pytest.raises(ValueError):
            settings.parse_size(bad)


def test_tail_and_migration_cpu_settings():
    s = settings.load({}, environ={})
    assert s.tail_min_tokens == 0 and s.migration_cpus == "inherit" and s.migration_cpu_mask == 0
    assert settings.load({"migration_cpus": "all"}, environ={}).migration_cpu_mask & 1
    s = settings.load({"tail_min_tokens": 32, "migration_cpus": "1,3-4"}, environ={"KVH_VLLM_MIGRATION_CPUS": "2"})
    assert s.tail_min_tokens == 32 and s.migration_cpu_mask == 0b100
    assert settings.load({"migration_cpus": "1,3-4"}, environ={}).migration_cpu_mask == 0b11010
    assert settings.load({"migration_cpus": "inherit"}, environ={}).migration_cpu_mask == 0
    for bad in ("x", "3-1", "64", ""):
        with pytest.raises(ValueError, match="migration_cpus"):
            settings.load({"migration_cpus": bad}, environ={})
    with pytest.raises(ValueError, match=">= 0"):
        settings.load({"tail_min_tokens": -1}, environ={})


def test_remote_settings():
    assert settings.load({}, environ={}).engine_remote_fields() == {}
    s = settings.load(
        {"kvh.remote_addrs": "10.0.0.1:7000", "remote_password": "pw", "remote_timeout_ms": "80"},
        environ={"KVH_VLLM_REMOTE_TTL_S": "600"},
    )
    assert s.engine_remote_fields() == {
        "remote_addrs": "10.0.0.1:7000",
        "remote_password": "pw",
        "remote_timeout_ms": 80,
        "remote_ttl_s": 600,
    }
    s = settings.load({"remote_addrs": "a:1"}, environ={"KVH_VLLM_REMOTE_ADDRS": ""})
    assert s.engine_remote_fields() == {}


def test_private_dir_is_owner_only(tmp_path):
    d = channel.private_dir(str(tmp_path))
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    os.chmod(d, 0o755)
    with pytest.raises(channel.ChannelError, match="0700"):
        channel.private_dir(str(tmp_path))
    other = tmp_path / "elsewhere"
    other.mkdir(mode=0o700)
    base2 = tmp_path / "b2"
    base2.mkdir()
    os.symlink(other, base2 / f"kvh-vllm-{os.getuid()}")
    with pytest.raises(channel.ChannelError, match="symbolic link"):
        channel.private_dir(str(base2))


def test_channel_round_trip_and_errors(tmp_path):
    path = channel.socket_path("engine-x", 0, 1, str(tmp_path))
    assert path.endswith("-dp0-tp1.sock") and path != channel.socket_path("engine-y", 0, 1, str(tmp_path))

    def handler(header, payload):
        if header["op"] == "boom":
            raise RuntimeError("no")
        return {"n": len(np.frombuffer(payload, np.int32)), "req": header["req"]}

    srv = channel.Server(path, handler)
    try:
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        assert stat.S_IMODE(os.stat(path).st_mode) & 0o077 == 0
        c = channel.Client(path, timeout_s=5)
        assert c.call({"op": "x", "req": "r1"}, np.arange(5, dtype=np.int32).tobytes()) == {"n": 5, "req": "r1"}
        with pytest.raises(channel.ChannelError, match="RuntimeError"):
            c.call({"op": "boom", "req": "r"})
        assert c.call({"op": "x", "req": "r2"})["n"] == 0  # the connection survives an error
        c.close()
    finally:
        srv.close()
    assert not os.path.exists(path)
    with pytest.raises(OSError):
        channel.Client(path, timeout_s=1).call({"op": "x", "req": "r"})


def test_channel_refuses_oversized_messages(tmp_path):
    path = channel.socket_path("engine-z", 0, 0, str(tmp_path))
    srv = channel.Server(path, lambda h, p: {"ok": 1})
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(path)
        s.sendall(channel._HDR.pack(1 << 30, 0))
        assert s.recv(16) == b""  # dropped, the server lives on
        s.close()
        assert channel.Client(path).call({"op": "x"}) == {"ok": 1}
    finally:
        srv.close()


def _store(tmp_path: Path, **kw) -> KvStore:
    s = settings.Settings(
        hash_secret=kw.pop("hash_secret", None),
        disk_path=str(tmp_path / "store"),
        disk_bytes=kw.pop("disk_bytes", 64 << 20),
        host_bytes=kw.pop("host_bytes", 16 << 20),
        tail_min_tokens=kw.pop("tail_min_tokens", 8),
        prefetch=kw.pop("prefetch", True),
    )
    return KvStore(s, num_layers=L, num_kv_heads=H, head_dim=D, block_tokens=B, dtype="bf16", identity={"m": "t"}, **kw)


def _register(st: KvStore, mem: np.ndarray) -> None:
    base = [mem[layer].ctypes.data for layer in range(L)]
    st.register_pool(base, [b + B * D * ES for b in base], NB, H * B * 2 * D * ES, D * ES, B * 2 * D * ES)


@pytest.fixture
def mem():
    return np.random.default_rng(3).integers(0, 1 << 16, size=(L, NB, H, B, 2 * D), dtype=np.uint16)


def test_host_tier_backed_at_start_unless_turned_off(tmp_path):
    st = _store(tmp_path)
    try:
        assert st.engine.config.prefault_memory is True
    finally:
        st.close()
    st = KvStore(
        settings.Settings(
            disk_path=str(tmp_path / "store2"), disk_bytes=64 << 20, host_bytes=16 << 20, prefault_memory=False
        ),
        num_layers=L,
        num_kv_heads=H,
        head_dim=D,
        block_tokens=B,
        dtype="bf16",
        identity={"m": "t"},
    )
    try:
        assert st.engine.config.prefault_memory is False
    finally:
        st.close()


def test_save_lookup_load_and_restart(tmp_path, mem):
    toks = np.arange(3 * B + 5, dtype=np.int32)
    orig = mem.copy()
    st = _store(tmp_path)
    _register(st, mem)
    assert st.save("a", toks, 0, [5, 2]) == 2
    assert st.save("a", toks, 2, [7]) == 1  # the next block later, chained on the first two
    assert st.lookup("b", toks) == 3 * B
    assert st.lookup("b", toks[: 2 * B + 3]) == 2 * B  # whole blocks only
    assert st.lookup("c", toks + 1) == 0
    mem[:, [1, 3, 4]] = 0
    assert st.lookup("b", toks) == 3 * B
    assert st.load("b", toks, 0, [1, 3, 4]) == []
    np.testing.assert_array_equal(mem[:, [1, 3, 4]], orig[:, [5, 2, 7]])
    # kvh read K and V where vLLM's CPU kernels keep them: viewed as
    # (num_blocks, kv_heads, 2 * block_size, head_dim), K rows then V rows.
    view = orig.reshape(L, NB, H, 2 * B, D)
    with st.engine.sequence() as seq:
        assert seq.match_prefix(toks) == 3 * B
        for layer in range(L):
            k, v = seq.read_kv(layer)
            k, v = np.asarray(k).view(np.uint16), np.asarray(v).view(np.uint16)
            for blk, slot in enumerate([5, 2, 7]):
                for t in (0, 7, B - 1):
                    np.testing.assert_array_equal(k[blk * B + t], view[layer, slot, :, t])
                    np.testing.assert_array_equal(v[blk * B + t], view[layer, slot, :, B + t])
    st.forget(["a", "b", "c"])
    st.flush()
    assert st.stats()["requests_persisted"] >= 1
    st.close()

    st = _store(tmp_path)  # a restarted worker
    _register(st, mem)
    mem[:] = 0
    assert st.lookup("d", toks) == 3 * B
    assert st.load("d", toks, 1, [6, 0]) == []  # blocks 1 and 2 (block 0 held locally)
    np.testing.assert_array_equal(mem[:, [6, 0]], orig[:, [2, 7]])
    s = st.stats()
    assert s["tokens_loaded"] == 2 * B and s["kvh"]["prefix_hit_blocks_disk"] == 3
    st.close()


def test_instances_of_one_model_each_get_a_store_and_a_restart_finds_the_blocks(tmp_path, mem):
    toks = np.arange(2 * B, dtype=np.int32) + 7
    first = _store(tmp_path, disk_bytes=8 << 20)
    second = _store(tmp_path, disk_bytes=8 << 20)  # a second vLLM instance of the model, running at once
    try:
        assert second.disk_path == first.disk_path + ".1"
        _register(first, mem)
        _register(second, mem)
        assert first.save("a", toks, 0, [1, 2]) == 2
        first.flush()
        assert second.lookup("b", toks) == 0  # stores are separate
        assert second.save("c", toks + 1, 0, [3]) == 1
    finally:
        first.close()
        second.close()
    again = _store(tmp_path, disk_bytes=8 << 20)  # a restart takes the first free store again
    try:
        assert again.disk_path == first.disk_path
        assert again.lookup("d", toks) == 2 * B
    finally:
        again.close()


def test_when_every_store_of_the_model_is_open_elsewhere_the_store_is_unavailable(tmp_path):
    from kvh_cache.vllm.store import STORE_INSTANCES

    held = []
    try:
        for i in range(STORE_INSTANCES):
            held.append(_store(tmp_path, disk_bytes=8 << 20, host_bytes=1 << 20))
        assert len({st.disk_path for st in held}) == STORE_INSTANCES
        with pytest.raises(StoreUnavailable, match="all open in other processes"):
            _store(tmp_path, disk_bytes=8 << 20, host_bytes=1 << 20)
    finally:
        for st in held:
            st.close()


def test_flipped_byte_on_disk_is_a_counted_miss(tmp_path, mem):
    toks = np.arange(2 * B, dtype=np.int32) + 100
    st = _store(tmp_path)
    _register(st, mem)
    st.save("a", toks, 0, [0, 1])
    st.forget(["a"])
    st.close()
    flip_first_block_byte(tmp_path)
    st = _store(tmp_path)
    _register(st, mem)
    # The lookup trusts the index; the restore reads the slot and checks it,
    # and the failed slots go back to vLLM to recompute.
    assert st.lookup("b", toks) == 2 * B
    failed = st.load("b", toks, 0, [3, 4])
    assert failed and failed[-1] == 4
    s = st.stats()
    assert s["kvh"]["corrupt_blocks"] >= 1 and s["load_errors"] == len(failed)
    st.close()


def test_load_of_blocks_kvh_no_longer_has_fails_cleanly(tmp_path, mem):
    st = _store(tmp_path)
    _register(st, mem)
    toks = np.arange(2 * B, dtype=np.int32)
    assert st.load("x", toks, 0, [3, 4]) == [3, 4]
    assert st.stats()["load_errors"] == 2
    st.close()


def test_unusable_configurations(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    s = settings.Settings(disk_path=str(blocker / "store"), disk_bytes=64 << 20)
    with pytest.raises(StoreUnavailable, match="cannot be created"):
        KvStore(s, num_layers=L, num_kv_heads=H, head_dim=D, block_tokens=B, dtype="bf16", identity={})
    with pytest.raises(StoreUnavailable, match="power of two"):
        KvStore(settings.Settings(disk_bytes=0), num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=48,
                dtype="f16", identity={})  # fmt: skip


@pytest.mark.parametrize(
    "bad",
    [dict(log_level="loud"), dict(remote_addrs="127.0.0.1:1", remote_timeout_ms=-5), dict(migration_cpus="x")],
)
@pytest.mark.parametrize("disk", [False, True])
def test_settings_the_engine_refuses_make_the_store_unavailable(tmp_path, bad, disk):
    # Settings made without settings.load (which refuses these): the worker
    # reports them as it reports any store it cannot open, and the
    # connector stays out of vLLM's way, instead of an exception out of
    # vLLM's register_kv_caches.
    s = settings.Settings(disk_path=str(tmp_path / "store"), disk_bytes=(64 << 20) if disk else 0, **bad)
    with pytest.raises(StoreUnavailable, match="kvh: "):
        KvStore(s, num_layers=L, num_kv_heads=H, head_dim=D, block_tokens=B, dtype="bf16", identity={})


def test_salt_separates_models_ranks_and_geometry():
    a = model_salt({"model": "m", "tp_rank": 0})
    assert a == model_salt({"tp_rank": 0, "model": "m"})
    assert a != model_salt({"model": "m", "tp_rank": 1}) and a != model_salt({"model": "n", "tp_rank": 0})


def test_hash_secret_keys_the_salt_and_stays_out_of_reprs():
    ident = {"model": "m", "tp_rank": 0}
    public = model_salt(ident)
    keyed = model_salt(ident, "s3cret")
    assert keyed == model_salt(dict(ident), "s3cret")  # every instance with the secret agrees
    assert keyed not in (public, model_salt(ident, "s3cres"), model_salt({"model": "n", "tp_rank": 0}, "s3cret"))
    s = settings.load({"hash_secret": "s3cret", "remote_password": "pw"}, environ={})
    assert s.hash_secret == "s3cret" and "s3cret" not in repr(s) and "pw" not in repr(s)
    assert settings.load({}, environ={"KVH_VLLM_HASH_SECRET": "e"}).hash_secret == "e"
    assert settings.load({}, environ={}).hash_secret is None


def _saved_two_blocks(tmp_path, mem, toks, **kw) -> KvStore:
    """A store (kw as _store) that saved toks' two blocks from vLLM slots 0
    and 1, flushed to disk; still open."""
    st = _store(tmp_path, **kw)
    _register(st, mem)
    assert st.save("a", toks, 0, [0, 1]) == 2
    st.forget(["a"])
    st.flush()
    return st


def test_a_store_keyed_by_a_secret_finds_its_blocks_only_with_it(tmp_path, mem):
    """The secret changes every hash: a restarted worker with the same
    secret finds what was saved, one without it (or with another) finds
    nothing and never reads those bytes."""
    toks = np.arange(2 * B, dtype=np.int32) + 700
    orig = mem.copy()
    _saved_two_blocks(tmp_path, mem, toks, hash_secret="k1").close()
    for secret, found in ((None, 0), ("k2", 0), ("k1", 2 * B)):
        st = _store(tmp_path, hash_secret=secret)
        _register(st, mem)
        assert st.lookup("q", toks) == found, secret
        st.forget(["q"])
        st.close()
    st = _store(tmp_path, hash_secret="k1")
    _register(st, mem)
    assert st.lookup("r", toks) == 2 * B
    assert st.load("r", toks, 0, [4, 5]) == []
    np.testing.assert_array_equal(mem[:, [4, 5]], orig[:, [0, 1]])
    st.close()


def test_a_keyed_salt_is_not_in_the_store_directory_or_the_log(tmp_path, mem, caplog):
    """The store directory is named by a one-way digest of a keyed salt:
    whoever can list disk_path (or read the log) cannot learn the salt."""
    caplog.set_level(logging.DEBUG, logger="kvh_cache")
    st = _store(tmp_path, hash_secret="s3cret")
    try:
        salt = f"{st.salt:016x}"
        names = os.listdir(tmp_path / "store")
        assert names and not any(salt in n for n in names), names
        assert salt not in st.disk_path
        assert all(salt not in r.getMessage() for r in caplog.records)
    finally:
        st.close()
    st = _store(tmp_path)  # unkeyed: the salt is public, the name unchanged
    try:
        assert os.path.basename(st.disk_path) == f"{st.salt:016x}"
    finally:
        st.close()


def test_an_older_keyed_store_is_renamed_with_its_blocks(tmp_path, mem):
    """A keyed store written under the salt's plain name (before names
    were digests) is renamed on the next start, blocks and all, unless
    another process has it open."""
    toks = np.arange(2 * B, dtype=np.int32) + 900
    orig = mem.copy()
    st = _saved_two_blocks(tmp_path, mem, toks, hash_secret="k1")
    salt, new_dir = st.salt, st.disk_path
    st.close()
    old_dir = os.path.join(tmp_path / "store", f"{salt:016x}")
    os.rename(new_dir, old_dir)
    st = _store(tmp_path, hash_secret="k1")
    try:
        assert st.disk_path == new_dir and not os.path.exists(old_dir)
        _register(st, mem)
        assert st.lookup("r", toks) == 2 * B
        assert st.load("r", toks, 0, [4, 5]) == []
        np.testing.assert_array_equal(mem[:, [4, 5]], orig[:, [0, 1]])
    finally:
        st.close()
    # Held open by another process (its directory's flock, or only its
    # LOCK file's, as older kvh versions took): left where it is.
    os.rename(new_dir, old_dir)
    for held in (old_dir, os.path.join(old_dir, "LOCK")):
        holder = os.open(held, os.O_RDONLY)
        fcntl.flock(holder, fcntl.LOCK_EX)
        try:
            st = _store(tmp_path, hash_secret="k1")
            st.close()
            assert os.path.isdir(old_dir), held
        finally:
            os.close(holder)
    # Free again at a later start: renamed to a free store name, though a
    # new store took the first one meanwhile; the salt leaves the listing.
    st = _store(tmp_path, hash_secret="k1")
    st.close()
    names = sorted(os.listdir(tmp_path / "store"))
    assert not any(f"{salt:016x}" in n for n in names), names
    assert names == [os.path.basename(new_dir), os.path.basename(new_dir) + ".1"]


def test_a_file_system_without_exclusive_rename_is_said_as_such(tmp_path, mem, monkeypatch, caplog):
    """Where renameat2(RENAME_NOREPLACE) is refused (EINVAL: some network
    and overlay file systems), the older store stays where it is and the
    warning says why, instead of "no free store name" after trying every
    name."""
    from kvh_cache.vllm import store as store_module

    toks = np.arange(2 * B, dtype=np.int32) + 950
    st = _saved_two_blocks(tmp_path, mem, toks, hash_secret="k1")
    salt, new_dir = st.salt, st.disk_path
    st.close()
    old_dir = os.path.join(tmp_path / "store", f"{salt:016x}")
    os.rename(new_dir, old_dir)
    tried = []

    def refused(src, dst):
        tried.append(dst)
        return errno.EINVAL

    monkeypatch.setattr(store_module, "_rename_noreplace", refused)
    with caplog.at_level(logging.WARNING, logger=store_module.log.name):
        _store(tmp_path, hash_secret="k1").close()
    assert os.path.isdir(old_dir) and len(tried) == 1, tried
    said = " ".join(r.getMessage() for r in caplog.records)
    assert os.strerror(errno.EINVAL) in said and "no free store name" not in said, said


def test_cache_salt_scopes_share_nothing_across_tenants_even_after_a_restart(tmp_path, mem):
    """vLLM's cache_salt becomes the blocks' tenant scope: the same tokens
    saved under one salt are not found under another or without one, in
    the same worker or after a restart; the same salt finds them."""
    import kvh_cache as kvh

    toks = np.arange(2 * B, dtype=np.int32) + 500
    alice, bob = kvh.Scope.value_of("alice"), kvh.Scope.value_of("bob")
    orig = mem.copy()
    st = _store(tmp_path)
    _register(st, mem)
    assert st.save("a", toks, 0, [0, 1], alice) == 2
    assert st.lookup("q1", toks, alice) == 2 * B
    assert st.lookup("q2", toks, bob) == 0
    assert st.lookup("q3", toks) == 0  # the default scope: no salt
    assert st.load("q4", toks, 0, [2, 3], bob) == [2, 3]  # nothing to load for bob
    st.forget(["a", "q1", "q2", "q3", "q4"])
    st.flush()
    st.close()

    st = _store(tmp_path)  # a restarted worker: the scope is in the hash on disk
    _register(st, mem)
    assert st.lookup("r1", toks, bob) == 0
    assert st.lookup("r2", toks) == 0
    assert st.lookup("r3", toks, alice) == 2 * B
    assert st.load("r3", toks, 0, [4, 5], alice) == []
    np.testing.assert_array_equal(mem[:, [4, 5]], orig[:, [0, 1]])
    st.close()


def test_a_repeated_request_id_never_loads_what_another_lookup_held(tmp_path, mem):
    """Request ids come from clients (vLLM takes X-Request-Id): a load
    under an id whose last lookup was another tenant's, or other tokens,
    does not restore the blocks that lookup held."""
    import kvh_cache as kvh

    toks = np.arange(2 * B, dtype=np.int32) + 300
    other = toks + 7
    alice, bob = kvh.Scope.value_of("alice"), kvh.Scope.value_of("bob")
    orig = mem.copy()
    st = _store(tmp_path)
    try:
        _register(st, mem)
        assert st.save("a", toks, 0, [0, 1], alice) == 2
        st.forget(["a"])
        assert st.lookup("same", toks, alice) == 2 * B  # alice's lookup holds her blocks
        assert st.load("same", toks, 0, [2, 3], bob) == [2, 3]  # bob gets none of them
        np.testing.assert_array_equal(mem[:, [2, 3]], orig[:, [2, 3]])
        assert st.lookup("same", toks, alice) == 2 * B
        assert st.load("same", other, 0, [4, 5], alice) == [4, 5]  # other tokens: none either
        np.testing.assert_array_equal(mem[:, [4, 5]], orig[:, [4, 5]])
        assert st.lookup("same", toks, alice) == 2 * B
        assert st.load("same", toks, 0, [6, 7], alice) == []  # her own load still works
        np.testing.assert_array_equal(mem[:, [6, 7]], orig[:, [0, 1]])
        st.forget(["same"])
        assert st.stats()["held_blocks"] == 0
    finally:
        st.close()


def test_tail_block_serves_the_same_prompt_only_and_survives_a_restart(tmp_path, mem):
    """A prompt's partial last block is kept under its padded tokens: the
    same prefix finds all its tokens (byte-identical in vLLM's slots, from
    the host tier and, after a restart, from disk); a prefix that differs
    in the tail, or is longer or shorter, finds the whole blocks only."""
    toks = np.arange(2 * B + 11, dtype=np.int32) + 900  # two blocks and an 11-token tail
    orig = mem.copy()
    st = _store(tmp_path)
    _register(st, mem)
    assert st.save("a", toks[: 2 * B], 0, [0, 1]) == 2
    assert st.lookup("q0", toks) == 2 * B  # no tail saved yet
    assert st.save("a", toks, 2, [2]) == 1  # the tail, chained on block 1
    assert st.lookup("q1", toks) == 2 * B + 11
    other = toks.copy()
    other[-1] += 1
    assert st.lookup("q2", other) == 2 * B
    assert st.lookup("q3", toks[:-1]) == 2 * B
    assert st.lookup("q4", np.concatenate([toks, [7] * (B - 11)]).astype(np.int32)) == 2 * B
    mem[:, [3, 4, 5]] = 0
    assert st.lookup("q5", toks) == 2 * B + 11
    assert st.load("q5", toks, 0, [3, 4, 5]) == []  # from the host tier
    np.testing.assert_array_equal(mem[:, [3, 4, 5]], orig[:, [0, 1, 2]])
    assert st.stats()["tokens_loaded"] == 2 * B + 11
    st.forget(["a", "q0", "q1", "q2", "q3", "q4", "q5"])
    st.flush()
    st.close()

    st = _store(tmp_path)  # a restarted worker: the tail block comes from disk
    _register(st, mem)
    mem[:, [6, 7]] = 0
    assert st.lookup("r", toks) == 2 * B + 11
    assert st.load("r", toks, 1, [6, 7]) == []  # block 1 and the tail (block 0 held locally)
    np.testing.assert_array_equal(mem[:, [6, 7]], orig[:, [1, 2]])
    s = st.stats()
    assert s["tokens_loaded"] == B + 11 and s["tokens_loaded_disk"] == B + 11
    st.close()

    st = _store(tmp_path, tail_min_tokens=0)  # tails off: whole blocks only
    _register(st, mem)
    assert st.lookup("s", toks) == 2 * B
    assert st.save("s", toks, 2, [2]) == 0
    st.close()


def test_a_long_restore_is_split_across_migration_threads_and_stays_exact(tmp_path, mem):
    toks = np.arange(NB * B, dtype=np.int32) + 7000
    orig = mem.copy()
    st = _store(tmp_path)
    _register(st, mem)
    assert st.restore_threads == 2
    assert st.save("a", toks, 0, list(range(NB))) == NB
    st.forget(["a"])
    st.flush()
    st.close()

    st = _store(tmp_path)  # restarted: every block comes from disk
    _register(st, mem)
    mem[:] = 0
    slots = list(reversed(range(NB)))
    assert st.lookup("b", toks) == NB * B
    load = st.start_load("b", toks, 0, slots)
    assert len(load.batch.parts) == 2
    for layer in range(L):
        st.wait_layer(load, layer)
    assert st.finish_load(load) == []
    np.testing.assert_array_equal(mem[:, slots], orig[:, list(range(NB))])
    assert st.stats()["tokens_loaded_disk"] == NB * B
    st.close()


# ---- the lookup-time prefetch ----


def _persisted(tmp_path: Path, mem: np.ndarray, toks: np.ndarray, n: int) -> None:
    """A store whose disk holds n blocks of toks from slots 0..n-1, closed."""
    st = _store(tmp_path)
    _register(st, mem)
    assert st.save("a", toks, 0, list(range(n))) == n
    st.forget(["a"])
    st.flush()
    st.close()


def _tiers(st: KvStore, toks: np.ndarray):
    from kvh_cache.types import Tier

    blocks = st.engine.prefix_lookup(toks)
    try:
        return [Tier(b.info().tier) for b in blocks]
    finally:
        for b in blocks:
            b.release()


def test_lookup_starts_reading_disk_blocks_into_host_and_the_load_stays_exact(tmp_path, mem):
    from kvh_cache.types import Tier

    toks = np.arange(4 * B, dtype=np.int32) + 300
    orig = mem.copy()
    _persisted(tmp_path, mem, toks, 4)
    st = _store(tmp_path)  # restarted: every block on disk
    _register(st, mem)
    assert _tiers(st, toks) == [Tier.DISK] * 4
    assert st.lookup("b", toks) == 4 * B
    pf = st._prefetches["b"]
    assert pf.blocks == 4
    pf.fence.result(10)  # checksummed reads that succeeded
    assert _tiers(st, toks) == [Tier.HOST] * 4
    assert st.lookup("b", toks) == 4 * B  # asked again (vLLM retries): no second prefetch
    s = st.stats()
    assert s["prefetches"] == 1 and s["blocks_prefetched"] == 4 and s["prefetch_capped"] == 0
    mem[:] = 0
    slots = [6, 1, 3, 0]
    assert st.load("b", toks, 0, slots) == []
    np.testing.assert_array_equal(mem[:, slots], orig[:, :4])
    s = st.stats()
    # Counted as disk hits: the blocks were on disk when vLLM asked.
    assert s["tokens_loaded_disk"] == 4 * B and s["load_errors"] == 0
    assert not st._prefetches and not st._looked_up
    (rec,) = list(st.load_log)
    assert rec["prefetched"] == 4 and rec["on_disk"] == 4 and rec["failed"] == 0
    assert rec["lookup_to_start_s"] is not None and rec["lookup_to_start_s"] >= 0
    st.close()


def test_load_issued_while_the_prefetch_still_reads_is_exact(tmp_path, mem):
    """vLLM's restore follows its lookup within a step: the restore of a
    block the prefetch is still reading waits for that read."""
    toks = np.arange(NB * B, dtype=np.int32) + 900
    orig = mem.copy()
    _persisted(tmp_path, mem, toks, NB)
    for _ in range(3):
        st = _store(tmp_path)
        _register(st, mem)
        mem[:] = 0
        assert st.lookup("b", toks) == NB * B
        slots = list(reversed(range(NB)))
        assert st.load("b", toks, 0, slots) == []  # no wait for the prefetch first
        np.testing.assert_array_equal(mem[:, slots], orig[:, list(range(NB))])
        assert st.stats()["tokens_loaded_disk"] == NB * B
        st.close()


def test_prefetch_off_leaves_blocks_on_disk_until_the_load(tmp_path, mem):
    from kvh_cache.types import Tier

    toks = np.arange(2 * B, dtype=np.int32) + 50
    _persisted(tmp_path, mem, toks, 2)
    st = _store(tmp_path, prefetch=False)
    _register(st, mem)
    assert st.lookup("b", toks) == 2 * B
    assert not st._prefetches and _tiers(st, toks) == [Tier.DISK] * 2
    assert st.stats()["prefetches"] == 0
    st.close()
    assert not settings.load({}, environ={}).prefetch  # off unless asked for
    assert settings.load({"prefetch": "1"}, environ={}).prefetch
    assert not settings.load({"prefetch": True}, environ={"KVH_VLLM_PREFETCH": "0"}).prefetch


def test_a_request_aborted_after_its_prefetch_leaks_nothing(tmp_path, mem):
    """Looked up, prefetched, then finished without being scheduled: the
    state goes, the blocks stay cached for the next request with that
    prefix, and close() does not hang on the reads."""
    from kvh_cache.types import Tier

    toks = np.arange(3 * B, dtype=np.int32) + 70
    orig = mem.copy()
    _persisted(tmp_path, mem, toks, 3)
    st = _store(tmp_path)
    _register(st, mem)
    assert st.lookup("gone", toks) == 3 * B
    st.forget(["gone"])
    assert not st._prefetches and not st._held and not st._looked_up
    st.engine.migrate([], Tier.HOST)  # the queue is served in order: the reads ended
    st.flush()
    assert set(_tiers(st, toks)) <= {Tier.HOST, Tier.DISK}
    mem[:] = 0
    assert st.lookup("next", toks) == 3 * B
    assert st.load("next", toks, 0, [4, 5, 6]) == []
    np.testing.assert_array_equal(mem[:, [4, 5, 6]], orig[:, :3])
    # Aborted with its reads still in flight, then the engine closed.
    st.forget(["next"])
    assert st.lookup("again", toks) == 3 * B
    st.close()


def test_a_late_lookup_holds_nothing(tmp_path, mem):
    """A lookup can arrive after its request was forgotten or the lookup
    released (its caller timed out and the worker ran it on): its blocks
    must not stay retained until close."""
    toks = np.arange(2 * B, dtype=np.int32) + 90
    _persisted(tmp_path, mem, toks, 2)
    st = _store(tmp_path)
    _register(st, mem)
    probe = st.engine.prefix_lookup(st.keyed(toks))  # holds a reference of its own
    assert len(probe) == 2

    def refs():
        return [b.info().refs for b in probe]

    base = refs()
    assert st.lookup("r", toks, lookup_id=1) == 2 * B
    assert refs() == [r + 1 for r in base]
    st.forget(["r"], {"r": 2})  # lookup 2 of it never arrived in time
    assert refs() == base
    assert st.lookup("r", toks, lookup_id=2) == 2 * B  # the answer still comes back
    assert "r" not in st._held and "r" not in st._looked_up
    assert refs() == base
    st.release_lookup("q", 7)  # released before it arrived
    assert st.lookup("q", toks, lookup_id=7) == 2 * B and refs() == base
    assert st.lookup("q", toks, lookup_id=9) == 2 * B and refs() == [r + 1 for r in base]
    assert st.lookup("q", toks, lookup_id=8) == 2 * B  # older than the hold it would replace
    assert st._held["q"].lookup_id == 9 and refs() == [r + 1 for r in base]
    st.forget(["q"], {"q": 9})
    assert refs() == base
    for b in probe:
        b.release()
    st.close()


@pytest.mark.parametrize("lookup_ids", [(None, None), (3, 4)])
def test_a_request_id_used_again_after_it_ended_holds_its_lookup_until_the_load(tmp_path, mem, lookup_ids):
    """Request ids come from clients and repeat: a new request under the
    id of one that ended is a new request, whose lookup keeps what it
    promised until the load, whatever is saved meanwhile."""
    ended, new = lookup_ids
    toks = np.arange(2 * B, dtype=np.int32) + 70
    orig = mem.copy()
    st = _store(tmp_path, disk_bytes=0, host_bytes=4 * (L * 2 * H * B * D * ES))
    try:
        _register(st, mem)
        assert st.save("w", toks, 0, [0, 1]) == 2
        st.forget(["w"])
        assert st.lookup("again", toks, lookup_id=ended) == 2 * B  # the request that ended
        if ended is None:
            st.forget(["again"])
        else:
            st.forget(["again"], {"again": ended})
        assert st.lookup("again", toks, lookup_id=new) == 2 * B
        assert st.stats()["held_blocks"] == 2
        for i in range(3):  # other requests' blocks fill the host tier
            other = np.arange(2 * B, dtype=np.int32) + 10000 * (i + 1)
            assert st.save(f"o{i}", other, 0, [2, 3]) == 2
            st.forget([f"o{i}"])
        assert st.load("again", toks, 0, [6, 7]) == []
        np.testing.assert_array_equal(mem[:, [6, 7]], orig[:, [0, 1]])
    finally:
        st.close()


def test_a_request_ending_keeps_the_lookup_of_a_new_request_under_its_id(tmp_path, mem):
    # vLLM may look up a new request reusing an id before the worker hears
    # that the old one ended: that lookup's hold stays.
    toks = np.arange(2 * B, dtype=np.int32) + 50
    st = _store(tmp_path, disk_bytes=0)
    try:
        _register(st, mem)
        assert st.save("x", toks, 0, [0, 1]) == 2
        assert st.lookup("x", toks, lookup_id=5) == 2 * B
        st.forget(["x"], {"x": 4})
        assert st.stats()["held_blocks"] == 2
        assert st.load("x", toks, 0, [2, 3]) == []
    finally:
        st.close()


def test_prefetch_takes_at_most_a_quarter_of_the_host_tier(tmp_path, mem):
    from kvh_cache.types import Tier

    toks = np.arange(NB * B, dtype=np.int32) + 5000
    orig = mem.copy()
    _persisted(tmp_path, mem, toks, NB)
    probe = _store(tmp_path)
    host = 8 * probe.block_bytes
    probe.close()
    st = _store(tmp_path, host_bytes=host)
    _register(st, mem)
    assert st.prefetch_cap == 2
    assert st.lookup("b", toks) == NB * B
    st._prefetches["b"].fence.result(10)
    s = st.stats()
    assert s["blocks_prefetched"] == 2 and s["prefetch_capped"] == NB - 2
    assert _tiers(st, toks) == [Tier.HOST] * 2 + [Tier.DISK] * (NB - 2)  # the prefix's first blocks
    mem[:] = 0
    assert st.load("b", toks, 0, list(range(NB))) == []
    np.testing.assert_array_equal(mem, orig)
    st.close()


def test_a_corrupt_block_found_by_the_prefetch_fails_its_load_and_is_recomputed(tmp_path, mem):
    toks = np.arange(2 * B, dtype=np.int32) + 100
    _persisted(tmp_path, mem, toks, 2)
    flip_first_block_byte(tmp_path)
    st = _store(tmp_path)
    _register(st, mem)
    assert st.lookup("b", toks) == 2 * B  # the index is trusted until the read
    with pytest.raises(Exception):
        st._prefetches["b"].fence.result(10)
    assert st.stats()["kvh"]["corrupt_blocks"] >= 1
    mem_before = mem.copy()
    failed = st.load("b", toks, 0, [3, 4])
    assert failed and failed[-1] == 4  # vLLM recomputes from the first bad block on
    s = st.stats()
    assert s["load_errors"] == len(failed)
    np.testing.assert_array_equal(mem[:, 5:], mem_before[:, 5:])  # nothing written outside the load's slots
    st.close()


def test_timeouts_and_counts_are_checked_not_truncated():
    for bad in ("inf", "nan", "-1", "0", "1e9"):
        with pytest.raises(ValueError, match="timeout"):
            settings.load({}, environ={"KVH_VLLM_LOOKUP_TIMEOUT": bad})
    assert settings.load({}, environ={"KVH_VLLM_LOOKUP_TIMEOUT": "0.5"}).lookup_timeout_s == 0.5
    for bad in (1.7, "1.5", True):
        with pytest.raises(ValueError):
            settings.load({"tail_min_tokens": bad}, environ={})
    assert settings.load({"tail_min_tokens": 3.0}, environ={}).tail_min_tokens == 3


def test_token_ids_must_be_int32_integers(tmp_path):
    st = _store(tmp_path)
    try:
        for bad in ([0.5, 1.5] * 24, [1 << 40] * 48, "abc"):
            with pytest.raises((TypeError, ValueError)):
                st.lookup("r", bad)
    finally:
        st.close()


def test_a_store_of_another_geometry_is_refused_with_advice_the_connector_can_follow(tmp_path, monkeypatch):
    # The refusal passed on the library's advice, "pass
    # disk_reset_on_mismatch=True", which is no connector setting.
    from kvh_cache.vllm import store as store_mod

    monkeypatch.setattr(store_mod, "store_dir_name", lambda salt, keyed: "one-dir")
    _store(tmp_path, disk_bytes=8 << 20, host_bytes=1 << 20).close()
    s = settings.Settings(disk_path=str(tmp_path / "store"), disk_bytes=8 << 20, host_bytes=1 << 20)
    with pytest.raises(StoreUnavailable) as info:
        KvStore(s, num_layers=L, num_kv_heads=H, head_dim=D, block_tokens=2 * B, dtype="bf16", identity={"m": "t"})
    text = str(info.value)
    assert "disk_reset_on_mismatch" not in text and "move or remove that directory" in text, text


def test_settings_the_store_cannot_use_as_given_are_said(tmp_path, caplog):
    # host_bytes under two blocks was raised to two, and a tail_min_tokens
    # of a block or more kept no tail, both without a word.
    with caplog.at_level(logging.WARNING, logger="kvh.vllm"):
        _store(tmp_path, host_bytes=1024, tail_min_tokens=B).close()
    assert "host_bytes 1024 is less than two blocks" in caplog.text
    assert f"tail_min_tokens {B} is not below the block size" in caplog.text
