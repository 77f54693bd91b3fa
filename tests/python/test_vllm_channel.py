"""kvh_cache.vllm.channel: how long a lookup may take, and who owns a
worker's socket."""

from __future__ import annotations

import socket

import pytest

from kvh_cache.vllm import channel


def test_a_second_server_does_not_take_a_live_socket(tmp_path):
    # Two vLLM instances given the same engine_id: the second must not
    # take the first one's scheduler's lookups.
    path = channel.socket_path("engine-twice", 0, 0, str(tmp_path))
    first = channel.Server(path, lambda h, p: {"who": "first"})
    try:
        with pytest.raises(channel.ChannelError, match="another vLLM instance with this engine_id") as info:
            channel.Server(path, lambda h, p: {"who": "second"})
        assert path in str(info.value)
        assert channel.Client(path, timeout_s=5).call({"op": "x"}) == {"who": "first"}
    finally:
        first.close()


def test_a_socket_left_by_a_process_that_died_is_replaced(tmp_path):
    path = channel.socket_path("engine-stale", 0, 0, str(tmp_path))
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)  # bound, never listening: as a dead process leaves it
    dead.close()
    srv = channel.Server(path, lambda h, p: {"who": "new"})
    try:
        assert channel.Client(path, timeout_s=5).call({"op": "x"}) == {"who": "new"}
    finally:
        srv.close()
