"""`kvh demo --models` on two tiny GGUF models: turns alternate, every
switch succeeds, weights are read from their files and never written,
and the second model file is derived (re-encoded) when not given."""

from __future__ import annotations

import argparse
import io
import json

import numpy as np
import pytest

pytest.importorskip("gguf", reason="kvh_cache.model needs the gguf package (pip install gguf)")

from kvh_cache.demo import two_models  # noqa: E402
from kvh_cache.model.gguf_loader import GGUFFile  # noqa: E402
from kvh_cache.model.requant import requantize  # noqa: E402
from kvh_cache.model.testing import write_tiny_llama  # noqa: E402


def args_for(tmp_path, model, **kw):
    a = argparse.Namespace(
        model=str(model),
        model_b=None,
        data_dir=tmp_path / "data",
        questions=2,
        gen_tokens=3,
        device_budget=None,
        host_budget=None,
        disk_budget=64 << 20,
        json=True,
    )
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def test_requantize_keeps_the_network(tmp_path):
    src = write_tiny_llama(str(tmp_path / "a.gguf"), qtype="Q4_1", seed=3)
    dst = requantize(src, str(tmp_path / "b.gguf"), "Q8_0")
    with GGUFFile(src) as a, GGUFFile(dst) as b:
        assert set(a.metadata) == set(b.metadata)
        assert {t.type_name for t in b.tensors.values()} <= {"Q8_0", "F32"}
        for name in a.tensors:
            np.testing.assert_allclose(b.tensor(name), a.tensor(name), atol=0.05)


def test_two_models_take_turns(tmp_path):
    model = write_tiny_llama(str(tmp_path / "tiny.Q4_1.gguf"), qtype="Q4_1", seed=4)
    out = io.StringIO()
    rc = two_models.run(args_for(tmp_path, model), out)
    assert rc == 0
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    metrics = {r["metric"]: r["value"] for r in rows}
    assert metrics["switches"] == 4
    assert metrics["bytes_device_to_host"] == 0  # clean weights are never written
    assert metrics["bytes_read_source"] > 0
    assert sum(1 for r in rows if r["metric"] == "model_ready_s") == 4
    assert (tmp_path / "data" / "tiny.Q8_0.gguf").exists()


def test_budget_that_holds_one_model(tmp_path):
    """Device budget smaller than both models together: switches drop or
    remap the other model instead of failing."""
    model = write_tiny_llama(str(tmp_path / "m.gguf"), qtype="Q4_1", seed=5, d_model=256, d_ff=512)
    other = requantize(model, str(tmp_path / "m8.gguf"))
    # KV blocks of this geometry: 2 layers x 2 KV heads x 64 dims x 16 tokens x f32 x K,V
    block = 2 * 2 * 2 * 64 * 16 * 4
    # kvh.h: each tensor is a region charged its size in whole 4096-byte
    # pages; a context takes the blocks of its regions' pages together.
    page = 4096
    slots = [
        -(-sum(-(-t.nbytes // page) * page for t in GGUFFile(p).tensors.values()) // block) for p in (model, other)
    ]
    device = (max(slots) + 20) * block  # room for the active agent's whole conversation
    assert device < sum(slots) * block
    out = io.StringIO()
    rc = two_models.run(
        args_for(tmp_path, model, model_b=other, device_budget=device, host_budget=8 * block, questions=2), out
    )
    assert rc == 0
    metrics = {}
    for line in out.getvalue().splitlines():
        r = json.loads(line)
        metrics[r["metric"]] = r["value"]
    assert metrics["switches"] == 4 and metrics["bytes_dropped"] > 0
