"""kvh_cache.vllm.channel: how long a lookup may take, and who owns a
worker's socket."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvh_cache.vllm import channel


def test_a_call_that_times_out_is_not_sent_again(tmp_path):
    # lookup_timeout_s bounds what a slow worker costs the scheduler: a
    # second try would double it, and ask the slow worker once more.
    calls = []
    release = threading.Event()

    def slow(header, payload):
        calls.append(header["req"])
        if header["req"] == "stuck":
            release.wait(10)
        return {"req": header["req"]}

    path = channel.socket_path("engine-slow", 0, 0, str(tmp_path))
    srv = channel.Server(path, slow)
    try:
        c = channel.Client(path, timeout_s=0.3)
        t0 = time.monotonic()
        with pytest.raises(socket.timeout):
            c.call({"op": "lookup", "req": "stuck"})
        took = time.monotonic() - t0
        time.sleep(0.2)  # time for a second try to reach the worker
        assert calls == ["stuck"] and took < 0.55, (calls, took)
        release.set()
        # The late reply went with the dropped connection: the next call
        # gets its own answer.
        assert c.call({"op": "lookup", "req": "next"}) == {"req": "next"}
        c.close()
    finally:
        release.set()
        srv.close()


def test_a_call_on_a_connection_broken_by_a_worker_restart_is_sent_again(tmp_path):
    path = channel.socket_path("engine-restart", 0, 0, str(tmp_path))
    srv = channel.Server(path, lambda h, p: {"who": "first"})
    c = channel.Client(path, timeout_s=5)
    try:
        assert c.call({"op": "x"}) == {"who": "first"}
        srv.close()
        srv = channel.Server(path, lambda h, p: {"who": "second"})
        c._sock.shutdown(socket.SHUT_RDWR)  # as the first worker's exit breaks it
        assert c.call({"op": "x"}) == {"who": "second"}
    finally:
        c.close()
        srv.close()


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
