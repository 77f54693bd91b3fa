"""kvh_cache.vllm.settings: what kv_connector_extra_config and the
environment give, and what they refuse (before any worker starts)."""

from __future__ import annotations

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
