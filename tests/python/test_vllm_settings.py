"""kvh_cache.vllm.settings: what kv_connector_extra_config and the
environment give, and what they refuse (before any worker starts)."""

from __future__ import annotations

import os

import pytest

from kvh_cache.vllm import settings

TEXT_KEYS = ("hash_secret", "disk_path", "runtime_dir", "remote_addrs", "remote_user", "remote_password")


@pytest.mark.parametrize("key", TEXT_KEYS)
def test_json_null_is_unset_not_the_text_none(key):
    # kv_connector_extra_config comes from JSON (--kv-transfer-config),
    # where a template leaves a setting it does not fill as null.
    default = settings.load({}, environ={})
    assert getattr(settings.load({key: None}, environ={}), key) == getattr(default, key)
    assert getattr(settings.load({"kvh." + key: None}, environ={}), key) == getattr(default, key)


def test_json_null_leaves_the_environment_variable_in_force(tmp_path):
    s = settings.load({"disk_path": None, "tail_min_tokens": None}, environ={"KVH_VLLM_DISK_PATH": str(tmp_path)})
    assert s.disk_path == str(tmp_path) and s.tail_min_tokens == 0
    assert settings.load({"hash_secret": None}, environ={"KVH_VLLM_HASH_SECRET": "s"}).hash_secret == "s"


@pytest.mark.parametrize(
    "key,value",
    [
        ("log_level", "loud"),
        ("remote_timeout_ms", -5),
        ("remote_timeout_ms", "x"),
        ("remote_timeout_ms", 1 << 32),
        ("remote_ttl_s", -1),
        ("remote_ttl_s", 2.7),
        ("remote_ttl_s", "2.7"),
        ("tail_min_tokens", "eight"),
        ("tail_min_tokens", [8]),
        ("lookup_timeout_s", "fast"),
        ("lookup_timeout_s", [1]),
        ("lookup_timeout_s", True),  # float(True) is 1.0
        ("migration_cpus", "0-"),  # a range without its end was CPU 0
        ("migration_cpus", "2-,3"),
        ("disk_path", 5),
        ("disk_path", ["/a", "/b"]),
        ("runtime_dir", True),
        ("remote_addrs", {"host": "a"}),
        ("remote_user", 7),
        ("disk_path", "/a\0b"),
        # past a 64-bit byte count: the worker's engine refused it, and
        # vLLM then ran without kvh instead of failing to start
        ("host_bytes", "99999999T"),
        ("disk_bytes", 1 << 64),
        ("device_bytes", "17179869184G"),
    ],
)
def test_a_value_that_cannot_be_used_is_refused_naming_key_and_value(key, value):
    with pytest.raises(ValueError) as info:
        settings.load({key: value}, environ={})
    assert key in str(info.value) and repr(value) in str(info.value)


@pytest.mark.parametrize(
    "var,value",
    [
        ("KVH_VLLM_TAIL_MIN_TOKENS", "eight"),
        ("KVH_VLLM_LOG_LEVEL", "loud"),
        ("KVH_VLLM_REMOTE_TIMEOUT_MS", "-5"),
        ("KVH_VLLM_REMOTE_TTL_S", "2.7"),
        ("KVH_VLLM_LOOKUP_TIMEOUT", "fast"),
    ],
)
def test_an_environment_value_that_cannot_be_used_names_the_variable(var, value):
    with pytest.raises(ValueError) as info:
        settings.load({}, environ={var: value})
    assert var in str(info.value) and repr(value) in str(info.value)


def test_secrets_stay_out_of_the_messages(monkeypatch):
    def refuse(value):
        raise ValueError("unusable")

    monkeypatch.setitem(settings._KEYS, "remote_password", ("KVH_VLLM_REMOTE_PASSWORD", refuse))
    with pytest.raises(ValueError) as info:
        settings.load({"remote_password": "hunter2"}, environ={})
    assert "hunter2" not in str(info.value) and "remote_password" in str(info.value)


def test_usable_engine_values_are_kept():
    s = settings.load(
        {"log_level": " Info ", "remote_timeout_ms": "80", "remote_ttl_s": 600.0, "tail_min_tokens": "8"}, environ={}
    )
    assert (s.log_level, s.remote_timeout_ms, s.remote_ttl_s, s.tail_min_tokens) == ("info", 80, 600, 8)
    assert settings.load({}, environ={"KVH_VLLM_LOG_LEVEL": "debug"}).log_level == "debug"


def test_paths_are_text_or_path_objects(tmp_path):
    # A number was taken as the text it prints as: disk_path=5 made ./5.
    assert settings.load({"disk_path": tmp_path / "s"}, environ={}).disk_path == str(tmp_path / "s")
    assert settings.load({"disk_path": "~/s"}, environ={}).disk_path == os.path.expanduser("~/s")
    assert settings.load({"disk_path": ""}, environ={}).disk_path == ""


@pytest.mark.parametrize(
    "key, meant",
    [("tail_min_token", "tail_min_tokens"), ("hostbytes", "host_bytes"), ("Disk-Bytes", "disk_bytes")],
)
def test_a_misspelt_key_is_refused_naming_the_key_it_resembles(key, meant):
    # Only unknown "kvh."-prefixed keys were refused; "tail_min_token": 8
    # was dropped without a word, and the setting stayed at its default.
    with pytest.raises(ValueError, match=f"{key!r}; did you mean {meant!r}"):
        settings.load({key: 8})
    with pytest.raises(ValueError, match="did you mean"):
        settings.load({f"kvh.{key}": 8})


def test_another_connectors_key_is_logged_and_ignored(caplog):
    with caplog.at_level("WARNING", logger="kvh.vllm"):
        s = settings.load({"backends": ["UCX"], "host_bytes": "64M"})
    assert s.host_bytes == 64 << 20
    assert "'backends' is not a kvh setting: ignored" in caplog.text


@pytest.mark.parametrize(
    "var, meant",
    [("KVH_VLLM_HOSTBYTES", "KVH_VLLM_HOST_BYTES"), ("KVH_VLLM_LOOKUP_TIMEOUT_S", "KVH_VLLM_LOOKUP_TIMEOUT")],
)
def test_a_misspelt_variable_is_refused_naming_the_one_it_resembles(var, meant):
    # A misspelt variable was ignored without a word and the setting kept
    # its default.
    with pytest.raises(ValueError, match=f"{var}; did you mean {meant}\\?"):
        settings.load({}, environ={var: "64M"})


def test_other_kvh_vllm_variables_are_logged_and_ignored(caplog):
    # Names alike only in the prefix they share are no misspellings.
    env = {
        "KVH_VLLM_SOMETHING_ELSE": "1",
        "KVH_VLLM_REMOTE_PORT": "7000",
        "KVH_VLLM_LOG_FILE": "/tmp/x",
        "KVH_VLLM_PYTHON": "/x/python",
        "KVH_VLLM_HOST_BYTES": "64M",
    }
    with caplog.at_level("WARNING", logger="kvh.vllm"):
        s = settings.load({}, environ=env)
    assert s.host_bytes == 64 << 20
    for name in ("KVH_VLLM_SOMETHING_ELSE", "KVH_VLLM_REMOTE_PORT", "KVH_VLLM_LOG_FILE"):
        assert f"{name} is not a kvh setting: ignored" in caplog.text
    assert "KVH_VLLM_PYTHON" not in caplog.text
