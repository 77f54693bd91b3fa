"""The lookup channel between vLLM's scheduler and its workers.

vLLM V1 runs the scheduler (engine core) and the model workers in different
processes, and kvh's prefix index lives in the worker, beside the KV memory
it copies from and into. The scheduler asks each worker "how many tokens of
this prompt does kvh hold?" over a Unix stream socket:

* The socket lives in a directory only its user can enter: created 0700,
  refused when it is a symbolic link, belongs to another user, or group or
  others have any access to it. Every connection's peer is checked with
  ``SO_PEERCRED`` and one of another user is dropped. Nothing listens on
  the network.
* Its name is derived from vLLM's ``engine_id`` and the worker's data- and
  tensor-parallel ranks, so the scheduler finds it without a handshake and
  two vLLM instances on one machine do not meet.
* A message is a little-endian ``(u32 header length, u32 payload length)``
  followed by a JSON header and a raw payload (token ids as int32).

Nothing here imports torch or vLLM.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import socket
import stat
import struct
import threading
import time
from typing import Any, Callable, Dict, Optional, Tuple

log = logging.getLogger("kvh.vllm")

_HDR = struct.Struct("<II")
_MAX_HEADER = 1 << 20
_MAX_PAYLOAD = 1 << 28


class ChannelError(OSError):
    pass


def private_dir(base: Optional[str] = None) -> str:
    """``<base>/kvh-vllm-<uid>``, created 0700 and checked to be ours alone.
    base: ``$XDG_RUNTIME_DIR``, else the system's temporary directory."""
    base = base or os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    uid = os.getuid()
    path = os.path.join(base, f"kvh-vllm-{uid}")
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # whatever the umask: made here, ours to set
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ChannelError(errno.EPERM, f"kvh: {path} is not a directory (a symbolic link?); refusing it")
    if st.st_uid != uid:
        raise ChannelError(errno.EPERM, f"kvh: {path} belongs to uid {st.st_uid}, not {uid}; refusing it")
    if st.st_mode & 0o077:
        raise ChannelError(
            errno.EPERM, f"kvh: {path} has mode {stat.S_IMODE(st.st_mode):o}; only its owner may use it (0700)"
        )
    return path


def socket_path(engine_id: str, dp_rank: int = 0, tp_rank: int = 0, base: Optional[str] = None) -> str:
    tag = hashlib.sha256(str(engine_id).encode()).hexdigest()[:20]
    return os.path.join(private_dir(base), f"{tag}-dp{dp_rank}-tp{tp_rank}.sock")


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def _recv_exact(conn: socket.socket, n: int, deadline: Optional[float] = None) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("timed out")
            conn.settimeout(left)
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def send_msg(conn: socket.socket, header: Dict[str, Any], payload: bytes = b"") -> None:
    h = json.dumps(header, separators=(",", ":")).encode()
    conn.sendall(_HDR.pack(len(h), len(payload)) + h + payload)


def recv_msg(conn: socket.socket, deadline: Optional[float] = None) -> Tuple[Dict[str, Any], bytes]:
    """One message; by ``deadline`` (time.monotonic()) if given, else
    socket.timeout."""
    hl, pl = _HDR.unpack(_recv_exact(conn, _HDR.size, deadline))
    if hl > _MAX_HEADER or pl > _MAX_PAYLOAD:
        raise ChannelError(errno.EPROTO, f"kvh: oversized message ({hl}, {pl} bytes)")
    header = json.loads(_recv_exact(conn, hl, deadline))
    payload = _recv_exact(conn, pl, deadline) if pl else b""
    if not isinstance(header, dict):
        raise ChannelError(errno.EPROTO, "kvh: malformed message")
    return header, payload


def _claim_path(path: str, wait_s: float = 2.0) -> int:
    """An flock on ``path + ".lock"`` held for the server's life: the one
    that holds it owns the socket path, so two workers starting at once,
    or one starting while an old one closes, never both take it, and a
    socket left there without its lock is a dead process's. Waits up to
    wait_s (an old worker closing); raises ChannelError when another live
    worker with the same engine_id and ranks holds it. Returns the lock's
    descriptor. The holder removes the lock file when it closes, so a lock
    taken on a file no longer at its path is let go and taken again."""
    lock_path = path + ".lock"
    deadline = time.monotonic() + wait_s
    while True:
        # Owner-only from its mode (a umask only takes bits away; the umask
        # is the process's, and another thread may be making files meanwhile).
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise ChannelError(
                            errno.EADDRINUSE,
                            f"kvh: a live lookup channel is at {path}: another vLLM instance with this "
                            "engine_id (and these ranks) is running; give each instance its own engine_id",
                        ) from None
                    time.sleep(0.02)
            if _same_file(fd, lock_path):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # its holder closed and removed it meanwhile: take the new one


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _same_file(fd: int, path: str) -> bool:
    try:
        on_path = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (on_path.st_dev, on_path.st_ino)


Handler = Callable[[Dict[str, Any], bytes], Dict[str, Any]]


class Server:
    """Serves ``handler(header, payload) -> reply`` on a Unix socket, one
    thread per connection (the scheduler keeps one open)."""

    def __init__(self, path: str, handler: Handler) -> None:
        self.path = path
        self._handler = handler
        self._closed = threading.Event()
        self._close_lock = threading.Lock()
        # Only the process that claimed the path removes its files: a
        # forked child closing its copy must leave the parent's in place.
        self._owner_pid = os.getpid()
        self._lock_fd = _claim_path(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._bind(path)
            self._sock.listen(16)
        except BaseException:
            self._sock.close()
            _unlink_quietly(path + ".lock")  # still held: no one else's
            os.close(self._lock_fd)
            raise
        self._thread = threading.Thread(target=self._accept_loop, name="kvh-vllm-lookup", daemon=True)
        self._thread.start()

    def _bind(self, path: str) -> None:
        # The path is this server's (_claim_path): a socket there is one a
        # process that died left.
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        # Not through the umask, which is the process's (another thread
        # making a file meanwhile would get it): the private directory
        # keeps others out until the mode is set.
        self._sock.bind(path)
        os.chmod(path, 0o600)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            try:
                uid = _peer_uid(conn)
            except OSError:
                uid = -1
            if uid != os.getuid():
                log.warning("kvh: lookup channel %s: dropped a connection from uid %d", self.path, uid)
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kvh-vllm-lookup-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while not self._closed.is_set():
                try:
                    header, payload = recv_msg(conn)
                except (EOFError, OSError, ValueError):
                    return
                try:
                    reply = self._handler(header, payload)
                except Exception as exc:  # reported to the caller, never kills the worker
                    log.exception("kvh: lookup channel: request %r failed", header.get("op"))
                    reply = {"error": f"{type(exc).__name__}: {exc}"}
                try:
                    send_msg(conn, reply)
                except OSError:
                    return

    def close(self) -> None:
        with self._close_lock:
            if self._closed.is_set():
                return
            self._closed.set()
            owner = os.getpid() == self._owner_pid
            if owner:  # a shutdown would stop the parent's socket too
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._sock.close()
            if owner:
                # Both paths are still this server's: the lock is held until after.
                for leftover in (self.path, self.path + ".lock"):
                    _unlink_quietly(leftover)
            os.close(self._lock_fd)  # a worker waiting on the removed file takes a new one


class Client:
    """One connection to a worker's channel, reopened after a failure.
    A call takes at most ``timeout_s``: one that times out is not sent
    again (its worker is slow, and would be asked twice as long)."""

    def __init__(self, path: str, timeout_s: float = 5.0) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._sock: Optional[socket.socket] = None
        self._lock = threading.Lock()

    def _connect(self, deadline: float) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(max(deadline - time.monotonic(), 1e-3))
        try:
            s.connect(self.path)
        except BlockingIOError:
            # A Unix socket whose queue is full refuses at once: the worker
            # is alive and busy, which is a timeout to the caller.
            s.close()
            raise socket.timeout(f"kvh: worker at {self.path} is busy (its connection queue is full)") from None
        except OSError:
            s.close()
            raise
        return s

    def call(self, header: Dict[str, Any], payload: bytes = b"") -> Dict[str, Any]:
        with self._lock:
            deadline = time.monotonic() + self.timeout_s
            for attempt in (0, 1):
                if self._sock is None:
                    self._sock = self._connect(deadline)
                try:
                    self._sock.settimeout(max(deadline - time.monotonic(), 1e-3))
                    send_msg(self._sock, header, payload)
                    reply, _ = recv_msg(self._sock, deadline)
                    break
                except (EOFError, OSError) as exc:
                    # Its reply may still come: the connection cannot be reused.
                    self._sock.close()
                    self._sock = None
                    # A connection that broke (a worker restarted since it was
                    # opened) is tried once more; a timeout is not.
                    if attempt or isinstance(exc, socket.timeout):
                        raise
            if "error" in reply:
                raise ChannelError(errno.EIO, f"kvh: worker at {self.path}: {reply['error']}")
            return reply

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
