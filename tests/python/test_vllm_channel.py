"""kvh_cache.vllm.channel: how long a lookup may take, and who owns a
worker's socket."""

from __future__ import annotations

import os
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


def test_workers_starting_at_once_take_the_path_once(tmp_path):
    # Two workers given the same engine_id, started together over a socket
    # a dead one left: one serves, the other is refused, never both.
    path = channel.socket_path("engine-race", 0, 0, str(tmp_path))
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)
    dead.close()
    results = {}
    go = threading.Event()

    def start(name):
        go.wait(5)
        try:
            results[name] = channel.Server(path, lambda h, p, n=name: {"who": n})
        except channel.ChannelError as exc:
            results[name] = exc

    threads = [threading.Thread(target=start, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(10)
    servers = {n: r for n, r in results.items() if isinstance(r, channel.Server)}
    try:
        assert len(servers) == 1 and len(results) == 2, results
        (who,) = servers
        assert channel.Client(path, timeout_s=5).call({"op": "x"}) == {"who": who}
    finally:
        for s in servers.values():
            s.close()


def _started_as_the_old_one_closes(path):
    """A server answering {"who": "new"}, started while one answering
    "old" held the path, which then closed."""
    old = channel.Server(path, lambda h, p: {"who": "old"})
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("new", channel.Server(path, lambda h, p: {"who": "new"})))
    t.start()
    time.sleep(0.2)  # the new one waits on the old one's lock file
    old.close()
    t.join(10)
    return got["new"]


def test_a_worker_starting_as_the_old_one_closes_keeps_its_socket(tmp_path):
    # The new worker waits for the old one's close, and that close does
    # not remove the new worker's socket.
    path = channel.socket_path("engine-handover", 0, 0, str(tmp_path))
    new = _started_as_the_old_one_closes(path)
    try:
        assert channel.Client(path, timeout_s=5).call({"op": "x"}) == {"who": "new"}
    finally:
        new.close()


def test_a_closed_worker_leaves_neither_socket_nor_lock_file(tmp_path):
    # One lock file for every engine id ever served would pile up in the
    # runtime directory.
    path = channel.socket_path("engine-tidy", 0, 0, str(tmp_path))
    before = set(os.listdir(os.path.dirname(path)))
    channel.Server(path, lambda h, p: {}).close()
    assert set(os.listdir(os.path.dirname(path))) == before


def _assert_served_only_by(path, who):
    """Another server for path is refused, and a client reaches `who`."""
    with pytest.raises(channel.ChannelError, match="another vLLM instance"):
        channel.Server(path, lambda h, p: {"who": "another"})
    assert channel.Client(path, timeout_s=5).call({"op": "x"}) == {"who": who}


def test_a_worker_that_waited_on_a_removed_lock_file_does_not_share_the_path(tmp_path):
    # The new worker waited on the old lock file, which the old worker's
    # close removed: it must own the path alone, so a third worker with
    # the same engine_id is refused rather than taking a new lock file.
    path = channel.socket_path("engine-relock", 0, 0, str(tmp_path))
    new = _started_as_the_old_one_closes(path)
    try:
        _assert_served_only_by(path, "new")
    finally:
        new.close()


def test_a_forked_child_closing_its_copy_leaves_the_parent_serving(tmp_path):
    # The child's close removed the lock file (a second server then took
    # the live path) and shut the shared listening socket down.
    path = channel.socket_path("engine-fork", 0, 0, str(tmp_path))
    srv = channel.Server(path, lambda h, p: {"who": "parent"})
    try:
        pid = os.fork()
        if pid == 0:
            srv.close()
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        _assert_served_only_by(path, "parent")
    finally:
        srv.close()


def test_a_server_that_fails_to_start_leaves_no_lock_file(tmp_path):
    base = tmp_path / ("d" * 90)  # a socket path too long to bind
    base.mkdir()
    path = channel.socket_path("engine-long", 0, 0, str(base))
    with pytest.raises(OSError):
        channel.Server(path, lambda h, p: {})
    assert not os.path.exists(path + ".lock")


def test_a_busy_worker_is_a_timeout_to_the_caller(tmp_path):
    # A Unix socket whose queue is full refuses a connect at once (EAGAIN):
    # the worker is alive and busy, and the scheduler backs off on timeouts.
    path = channel.socket_path("engine-busy", 0, 0, str(tmp_path))
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(0)  # never accepts
    fill = []
    for _ in range(8):
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.setblocking(False)
        try:
            c.connect(path)
        except BlockingIOError:
            c.close()
            break
        fill.append(c)
    try:
        with pytest.raises(socket.timeout, match="busy"):
            channel.Client(path, timeout_s=0.5).call({"op": "lookup"})
    finally:
        for c in fill:
            c.close()
        srv.close()
