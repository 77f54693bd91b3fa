"""Helpers shared by the Python tests."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

_HERE = Path(__file__).resolve().parent


def make_engine(**kw):
    """A small CPU engine (2 layers, 2 KV heads, head_dim 8, f32, 16-token
    blocks, 64 device and 256 host blocks), with kw overriding."""
    import kvh_cache as kvh

    base = dict(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        block_tokens=16,
        dtype="f32",
        backend="cpu",
        device_bytes=64 * 4096,
        host_bytes=256 * 4096,
    )
    base.update(kw)
    return kvh.Engine(**base)


def kv_data(n: int, heads: int, dim: int, dtype, seed: int = 0):
    """Random K and V shaped (n, heads, dim); dtype uint16 means bf16 bits."""
    import kvh_cache as kvh

    rng = np.random.default_rng(seed)
    k = rng.standard_normal((n, heads, dim)).astype(np.float32)
    v = rng.standard_normal((n, heads, dim)).astype(np.float32)
    if np.dtype(dtype) == np.uint16:
        return kvh.f32_to_bf16(k), kvh.f32_to_bf16(v)
    return k.astype(dtype), v.astype(dtype)


def filled_seq(eng, n_tokens: int, *, seed: int = 0, agent: int = 0, first_token: int = 0):
    """A sequence of n_tokens with K/V written for every layer; returns
    (seq, {layer: (k, v)})."""
    seq = eng.sequence(agent=agent, tokens=np.arange(first_token, first_token + n_tokens))
    data = {}
    for layer in range(eng.num_layers):
        k, v = kv_data(n_tokens, eng.num_kv_heads, eng.head_dim, eng.np_dtype, seed=seed * 100 + layer)
        seq.write_kv(layer, 0, k, v)
        data[layer] = (k, v)
    return seq, data


def reference_attention(k: np.ndarray, v: np.ndarray, q: np.ndarray, scale: float = 0.0) -> np.ndarray:
    """Decode attention of one query (Hq, D) over k, v (n, H, D), GQA."""
    n, H, D = k.shape
    Hq = q.shape[0]
    group = Hq // H
    s = scale or 1.0 / math.sqrt(D)
    out = np.empty((Hq, D), np.float64)
    for h in range(Hq):
        kh = k[:, h // group, :].astype(np.float64)
        vh = v[:, h // group, :].astype(np.float64)
        logits = kh @ q[h].astype(np.float64) * s
        w = np.exp(logits - logits.max())
        out[h] = (w / w.sum()) @ vh
    return out


def run_child(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Runs code in a fresh interpreter with the package and the test helpers
    importable; a signal or a hang fails the calling test with the output."""
    env = dict(os.environ)
    paths = [str(_HERE.parent.parent / "python"), str(_HERE), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    try:
        res = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, env=env
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hung (no exit in {exc.timeout} s): {exc.stdout!r} {exc.stderr!r}")
    if res.returncode < 0:
        pytest.fail(f"killed by {signal.Signals(-res.returncode).name}\n{res.stdout}\n{res.stderr[-3000:]}")
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout}\n{res.stderr[-3000:]}"
    return res


#: What misuse may raise: a kvh error or Python's own argument errors.
def typed_errors():
    import kvh_cache as kvh

    return (kvh.Error, TypeError, ValueError)


#: A C identifier in a message meant for Python callers.
C_NAME = re.compile(r"\bkvh_(?!cache\b)[a-z0-9_]+|\bsize_t\b|\buint(8|16|32|64)_t\b|\bvoid \*")


def raises_typed(call, expected=None):
    """Calls call(), which must raise one of expected (default:
    typed_errors()); returns the exception after checking that its detail
    names no C identifier."""
    import kvh_cache as kvh

    with pytest.raises(expected or typed_errors()) as info:
        call()
    exc = info.value
    detail = exc.message if isinstance(exc, kvh.Error) else str(exc)
    assert not C_NAME.search(detail), f"message names C: {detail!r}"
    return exc


def close_while_running(eng, threads, started, delay: float) -> None:
    """Starts threads, waits until one has set the event started, closes
    eng after delay seconds and joins them all: none may hang."""
    for t in threads:
        t.start()
    started.wait()
    time.sleep(delay)
    eng.close()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads), "a thread hung"


def unusable_model(what: str, tmp_path: Path) -> Path:
    """A --model that cannot be used: "truncated" (a GGUF cut after its
    version), "random" (bytes after the magic), "empty", "fifo", or a path
    such as /dev/null as it is."""
    path = tmp_path / "cut.gguf"
    if what == "truncated":
        path.write_bytes(b"GGUF\x03\x00\x00\x00")
    elif what == "random":
        path.write_bytes(b"GGUF" + bytes((i * 97 + 13) % 256 for i in range(300)))
    elif what == "empty":
        path.write_bytes(b"")
    elif what == "fifo":
        os.mkfifo(path)
    else:
        path = Path(what)
    return path
