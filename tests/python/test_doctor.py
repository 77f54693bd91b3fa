"""kvh doctor's checks (kvh_cache.doctor) against a hostile data directory."""

import errno
import json
import os
import tempfile

import pytest

from kvh_cache import doctor


def test_o_direct_probe_writes_only_its_own_file(tmp_path, monkeypatch):
    """Another user of a shared directory swaps the probe's file for a
    symlink between its creation and its write: the victim is untouched."""
    shared = tmp_path / "shared"
    shared.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"ORIGINAL\n")
    real_mkstemp = tempfile.mkstemp
    swapped = []

    def mkstemp_then_swap(*args, **kwargs):
        fd, name = real_mkstemp(*args, **kwargs)
        os.unlink(name)
        os.symlink(victim, name)
        swapped.append(name)
        return fd, name

    monkeypatch.setattr(doctor.tempfile, "mkstemp", mkstemp_then_swap)
    checks = doctor.check_data_dir(shared / "kvh-data", 1 << 20)
    assert swapped, "the probe made no temporary file"
    assert victim.read_bytes() == b"ORIGINAL\n"
    probe = next(c for c in checks if c.name == "O_DIRECT")
    assert probe.status in (doctor.OK, doctor.WARN)
    assert not any(p.name.startswith(".kvh-doctor-") for p in shared.iterdir())


def test_o_direct_probe_result_on_this_directory(tmp_path):
    checks = doctor.check_data_dir(tmp_path / "kvh-data", 1 << 20)
    probe = next(c for c in checks if c.name == "O_DIRECT")
    assert probe.status in (doctor.OK, doctor.WARN)
    assert str(tmp_path) in probe.data["checked_at"]
    assert list(tmp_path.iterdir()) == []


def test_a_failed_check_is_exit_status_1(tmp_path, monkeypatch, capsys):
    """kvh's exit statuses say 1 for a failed check; doctor returned 0
    unless --strict. --strict adds warnings."""
    monkeypatch.setattr(doctor, "run_checks", lambda *a, **k: [doctor.Check("x", doctor.FAIL, "broken")])
    from kvh_cache import cli

    assert cli.main(["doctor", "--data-dir", str(tmp_path)]) == 1
    monkeypatch.setattr(doctor, "run_checks", lambda *a, **k: [doctor.Check("x", doctor.WARN, "meh")])
    assert cli.main(["doctor", "--data-dir", str(tmp_path)]) == 0
    assert cli.main(["doctor", "--strict", "--data-dir", str(tmp_path)]) == 1
    capsys.readouterr()


def test_a_data_dir_under_a_file_fails(tmp_path, capsys):
    """--data-dir /etc/passwd/x exited 0: the store permissions said it
    would be created, and O_DIRECT was blamed (ENOTDIR). A path under a
    non-directory is a failed check naming the file."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    checks = doctor.check_data_dir(blocker / "x", 1 << 20)
    assert [(c.name, c.status) for c in checks] == [("data dir", doctor.FAIL)]
    assert f"{blocker} is not a directory" in checks[0].summary
    perm = doctor.check_store_permissions(blocker / "x")
    assert perm.status != doctor.OK and "will be created" not in perm.summary and "creates it" not in perm.summary
    from kvh_cache import cli

    assert cli.main(["doctor", "--json", "--data-dir", str(blocker / "x")]) == 1
    out = json.loads(capsys.readouterr().out)
    assert not any(c["name"] == "O_DIRECT" for c in out["checks"])
    assert blocker.read_text() == "x"


def test_a_crashed_check_fails_under_its_name(tmp_path, monkeypatch):
    """A check that raised was reported as `<lambda>` (the lambda's
    __name__) and, for an OSError, only as a warning."""

    def boom(*args):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(doctor, "check_hugepages", boom)
    monkeypatch.setattr(doctor, "check_numa", boom)
    checks = doctor.run_checks(tmp_path / "kvh-data", 1 << 20, 1 << 20)
    crashed = [c for c in checks if "Input/output error" in c.summary]
    assert [(c.name, c.status) for c in crashed] == [("huge pages", doctor.FAIL), ("NUMA", doctor.FAIL)]
    assert not any("lambda" in c.name for c in checks)


def test_o_direct_advice_names_a_variable_that_exists(tmp_path, monkeypatch):
    """The advice named KVH_DISK_BUFFERED, which nothing reads; the
    documented setting is KVH_DISK_FLAGS=buffered."""

    def refuse(fd, cmd, arg=0):
        if cmd == doctor.fcntl.F_SETFL:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, cmd, arg)

    real = doctor.fcntl.fcntl
    monkeypatch.setattr(doctor.fcntl, "fcntl", refuse)
    checks = doctor.check_data_dir(tmp_path / "kvh-data", 1 << 20)
    probe = next(c for c in checks if c.name == "O_DIRECT")
    assert probe.status == doctor.WARN
    advice = "\n".join(probe.fix)
    assert "KVH_DISK_FLAGS=buffered" in advice and "KVH_DISK_BUFFERED" not in advice


@pytest.mark.parametrize(
    "env, field",
    [
        ({"KVH_BLOCK_TOKENS": "3"}, "KVH_BLOCK_TOKENS"),
        ({"KVH_LRU_K": "9"}, "KVH_LRU_K"),
        ({"KVH_HEAD_DIM": "0"}, "KVH_HEAD_DIM"),
        ({"KVH_DISK_BYTES": "1G"}, "KVH_DISK_BYTES"),
    ],
    ids=lambda v: " ".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else "",
)
def test_settings_the_engine_refuses_fail(env, field, tmp_path, monkeypatch, capsys):
    """Settings the engine refuses at open passed kvh doctor with exit 0:
    a configuration check opens a tiny engine with them and fails, naming
    the variable."""
    for k in [k for k in os.environ if k.startswith("KVH_") and k not in ("KVH_BUILD_DIR",)]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    from kvh_cache import cli

    assert cli.main(["doctor", "--json", "--data-dir", str(tmp_path / "d")]) == 1
    out = json.loads(capsys.readouterr().out)
    (check,) = [c for c in out["checks"] if c["name"] == "configuration"]
    assert check["status"] == doctor.FAIL and field in check["summary"], check
    assert list(tmp_path.iterdir()) == []
    monkeypatch.delenv(next(iter(env)))
    checks = doctor.run_check(
        "configuration", lambda: doctor.check_config(__import__("kvh_cache.config").config.resolve())
    )
    assert checks[0].status == doctor.OK, checks[0]


BIG_BLOCKS = {  # blocks of 80 MiB: 80 layers x 8 KV heads x 128 x 256 tokens, f16
    "KVH_NUM_LAYERS": "80",
    "KVH_NUM_KV_HEADS": "8",
    "KVH_HEAD_DIM": "128",
    "KVH_BLOCK_TOKENS": "256",
    "KVH_DTYPE": "f16",
}


def test_budgets_beyond_the_machines_memory_are_not_called_accepted(monkeypatch):
    # The probe opens capped budgets, so 16383P passed as "the engine
    # accepts it (... budgets)" where an engine opened with it fails.
    for k in [k for k in os.environ if k.startswith("KVH_") and k not in ("KVH_BUILD_DIR",)]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("KVH_BACKEND", "cpu")
    monkeypatch.setenv("KVH_DEVICE_BYTES", "16383P")
    from kvh_cache.config import resolve

    (check,) = doctor.run_check("configuration", lambda: doctor.check_config(resolve()))
    assert check.status == doctor.WARN and "exceed this machine's memory" in check.summary, check
    monkeypatch.setenv("KVH_DEVICE_BYTES", "64M")
    monkeypatch.setenv("KVH_HOST_BYTES", "16383P")
    (check,) = doctor.run_check("configuration", lambda: doctor.check_config(resolve()))
    assert check.status == doctor.WARN, check
    monkeypatch.setenv("KVH_HOST_BYTES", "64M")
    (check,) = doctor.run_check("configuration", lambda: doctor.check_config(resolve()))
    assert check.status == doctor.OK, check


@pytest.mark.parametrize(
    "budgets, status, word",
    [
        ({"KVH_DEVICE_BYTES": "80G", "KVH_HOST_BYTES": "2G"}, doctor.OK, None),
        ({"KVH_DEVICE_BYTES": "1M", "KVH_HOST_BYTES": "256G"}, doctor.FAIL, "device_bytes 1048576 holds no block"),
    ],
    ids=["fits", "too-small"],
)
def test_configuration_of_blocks_larger_than_the_probe_cap(budgets, status, word, monkeypatch):
    """The configuration check capped the budgets at 64 MiB, so a geometry
    whose block is larger (80 MiB here) failed with "device_bytes 67108864
    holds no block", a number the user never set. The cap is at least a
    few blocks now, and a refusal quotes the user's own budget."""
    for k in [k for k in os.environ if k.startswith("KVH_") and k not in ("KVH_BUILD_DIR",)]:
        monkeypatch.delenv(k)
    for k, v in {**BIG_BLOCKS, **budgets}.items():
        monkeypatch.setenv(k, v)
    from kvh_cache.config import resolve

    (check,) = doctor.run_check("configuration", lambda: doctor.check_config(resolve()))
    assert check.status == status, check
    assert str(64 << 20) not in check.summary, check
    if word:
        assert word in check.summary, check


def _engine_refuses(d) -> bool:
    """Whether an engine refuses d as its store directory (what kvh doctor
    must predict)."""
    import kvh_cache as kvh

    try:
        kvh.Engine(
            num_layers=1,
            num_kv_heads=1,
            head_dim=8,
            block_tokens=8,
            backend="cpu",
            device_bytes=1 << 20,
            host_bytes=1 << 20,
            disk_path=str(d),
            disk_bytes=1 << 20,
            log_level="error",
        ).close()
    except kvh.UnsupportedError:
        pytest.skip("this build has no disk tier")
    except kvh.KvhIOError:
        return True
    return False


@pytest.mark.parametrize("with_store", [False, True], ids=["empty", "store"])
@pytest.mark.parametrize("mode", [0o700, 0o750, 0o755, 0o500, 0o770, 0o720, 0o702, 0o777, 0o1777], ids=oct)
def test_store_directory_fails_exactly_where_the_engine_refuses_it(mode, with_store, tmp_path):
    """A directory group or others can write passed kvh doctor (ok when
    empty, a warning over a store) while the engine refuses to open it."""
    d = tmp_path / "kvh-data"
    d.mkdir()
    if with_store:
        assert not _engine_refuses(d)
    d.chmod(mode)
    check = doctor.check_store_permissions(d)
    refused = _engine_refuses(d)  # after the check: an open narrows the modes it accepts
    assert (check.status == doctor.FAIL) == refused, (oct(mode), check)
    if refused:
        assert "writable by other users" in check.summary and f"chmod go-w {d}" in check.fix, check
        assert not any("narrows the modes itself" in line for line in check.fix), check
    elif not with_store:
        assert check.status == doctor.OK, check


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_store_directory_of_another_user_fails(tmp_path):
    d = tmp_path / "kvh-data"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    check = doctor.check_store_permissions(d)
    assert check.status == doctor.FAIL and "belongs to user 65534" in check.summary, check
    assert _engine_refuses(d)
    os.chown(d, os.geteuid(), os.getegid())
    assert not _engine_refuses(d)
    os.chown(d / "index", 65534, 65534)
    check = doctor.check_store_permissions(d)
    assert check.status == doctor.FAIL and "index belong to another user" in check.summary, check
    assert _engine_refuses(d)


def test_a_symbolic_link_as_the_store_directory_fails(tmp_path):
    (tmp_path / "real").mkdir(mode=0o700)
    for name, target in (("link", tmp_path / "real"), ("dangling", tmp_path / "nowhere")):
        (tmp_path / name).symlink_to(target)
        check = doctor.check_store_permissions(tmp_path / name)
        assert check.status == doctor.FAIL and "symbolic link" in check.summary, check
        assert _engine_refuses(tmp_path / name)


def test_a_link_given_with_a_trailing_slash_fails_as_the_engine_refuses_it(tmp_path, capsys):
    """The engine refuses a store directory named through a symbolic link
    with a trailing "/" or "/." as it does the link itself (the system would
    follow it into a directory the engine then narrows and writes in); the
    doctor says the same, slash or not, dangling or not."""
    from kvh_cache import cli

    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for name in ("link", "dangling"):
        for tail in ("", "/", "//", "/."):
            given = str(tmp_path / name) + tail
            assert _engine_refuses(given), given
            cli.main(["doctor", "--json", "--data-dir", given])
            out = json.loads(capsys.readouterr().out)
            (check,) = [c for c in out["checks"] if c["name"] == "store permissions"]
            assert check["status"] == doctor.FAIL and "symbolic link" in check["summary"], (given, check)


def test_doctor_exits_1_for_a_store_directory_others_can_write(tmp_path, capsys):
    from kvh_cache import cli

    d = tmp_path / "kvh-data"
    d.mkdir()
    d.chmod(0o777)
    assert cli.main(["doctor", "--json", "--data-dir", str(d)]) == 1
    out = json.loads(capsys.readouterr().out)
    (check,) = [c for c in out["checks"] if c["name"] == "store permissions"]
    assert check["status"] == doctor.FAIL, check


def _clear_kvh_environment(monkeypatch):
    for k in [k for k in os.environ if k.startswith("KVH_") and k not in ("KVH_BUILD_DIR",)]:
        monkeypatch.delenv(k)


def test_config_advice_names_where_the_value_was_set(tmp_path, monkeypatch):
    """The advice said `change or unset KVH_LRU_K` for a value the
    configuration file set."""
    from kvh_cache.config import resolve

    _clear_kvh_environment(monkeypatch)
    f = tmp_path / "kvh.toml"
    f.write_text("lru_k = 9\n")
    (check,) = doctor.run_check("configuration", lambda: doctor.check_config(resolve(file=f)))
    assert check.status == doctor.FAIL and check.fix == [f"# change or remove lru_k in {f}"], check
    monkeypatch.setenv("KVH_LRU_K", "9")
    (check,) = doctor.run_check("configuration", lambda: doctor.check_config(resolve(file=f)))
    assert check.status == doctor.FAIL and check.fix == ["# change or unset KVH_LRU_K"], check
    monkeypatch.delenv("KVH_LRU_K")
    f.write_text('disk_bytes = "64M"\n')
    (check,) = doctor.run_check("configuration", lambda: doctor.check_config(resolve(file=f)))
    assert check.fix == [f"# set KVH_DISK_PATH (or disk_path in {f}) too, or remove disk_bytes in {f}"], check


def test_remote_check_waits_for_a_long_remote_timeout(monkeypatch):
    """A node that does not answer costs `kvh-store remote ping` about two
    remote timeouts; the doctor killed it after a fixed 60 s and blamed
    itself for any valid remote_timeout_ms of 30000 or more. Its wait now
    follows the setting, and a ping that outlasts it is the node's FAIL."""
    import subprocess
    import types

    from kvh_cache import tools

    monkeypatch.setattr(tools, "find_tool", lambda name: "/bin/kvh-store-stand-in")
    waits = []

    def run(cmd, **kw):
        waits.append(kw["timeout"])
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])

    monkeypatch.setattr(doctor.subprocess, "run", run)
    config = types.SimpleNamespace(remote_addrs="127.0.0.1:1", remote_timeout_ms=60000)
    check = doctor.check_remote(config)
    assert waits and waits[0] > 2 * 60
    assert check.status == doctor.FAIL
    assert "no answer from kvh-store remote ping" in check.summary
    assert "check itself" not in check.summary
