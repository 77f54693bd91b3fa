"""kvh doctor's checks (kvh_cache.doctor) against a hostile data directory."""

import os
import tempfile

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
