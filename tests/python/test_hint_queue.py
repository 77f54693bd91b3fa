"""Queue hints from Python (Engine.hint_queued, Engine.hint_advance): the
step count, position and request forms, and their argument rules."""

from __future__ import annotations

import numpy as np
import pytest

import kvh_cache as kvh

BT = 16


def engine():
    return kvh.Engine(
        num_layers=1,
        num_kv_heads=1,
        head_dim=8,
        dtype="f32",
        block_tokens=BT,
        backend="cpu",
        device_bytes=1 << 20,
        host_bytes=1 << 20,
    )


def test_steps_and_forms():
    eng = engine()
    seq = eng.sequence()
    seq.append(np.arange(4 * BT))
    assert eng.hint_advance(0) == 0
    eng.hint_queued(seq, position=0)
    seq.hint_queued(0, BT, request=3)
    assert eng.hint_advance() == 1
    assert eng.hint_advance(4) == 5
    seq.hint_queued(request=2)  # already taken: ignored, not an error
    seq.hint_queued(range(0, 2 * BT), position=1)


def test_misuse():
    eng = engine()
    seq = eng.sequence()
    seq.append(np.arange(2 * BT))
    with pytest.raises(ValueError):
        eng.hint_queued(seq)
    with pytest.raises(ValueError):
        eng.hint_queued(seq, position=0, request=0)
    with pytest.raises(ValueError):
        eng.hint_queued(seq, position=-1)
    with pytest.raises(TypeError):
        eng.hint_queued(seq, position=True)
    with pytest.raises(TypeError):
        eng.hint_queued("seq", position=0)
    with pytest.raises(kvh.RangeError):
        eng.hint_queued(seq, position=1 << 24)
    with pytest.raises(kvh.RangeError):
        eng.hint_queued(seq, 2 * BT, 1, position=0)
    with pytest.raises(ValueError):
        eng.hint_advance(-1)
    eng.hint_advance(1)
    with pytest.raises(kvh.RangeError):
        eng.hint_advance((1 << 64) - 1)
    assert eng.hint_advance(0) == 1
    seq.free()
    with pytest.raises(Exception):
        eng.hint_queued(seq, position=0)
