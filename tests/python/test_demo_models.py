"""`kvh demo --models` on two tiny GGUF models: turns alternate, every
switch succeeds, weights are read from their files and never written,
and the second model file is derived (re-encoded) when not given."""

from __future__ import annotations

import argparse
import io
import json
import os

import numpy as np
import pytest

pytest.importorskip("gguf", reason="kvh_cache.model needs the gguf package (pip install gguf)")

from kvh_cache.demo import two_models  # noqa: E402
from kvh_cache.model.gguf_loader import GGUFFile  # noqa: E402
from kvh_cache.model.requant import requantize  # noqa: E402
from kvh_cache.model.testing import write_tiny_llama  # noqa: E402
from kvh_testutil import unusable_model  # noqa: E402


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


def _digest(d):
    """sha256 of each file of store d but LOCK (its opener's pid)."""
    import hashlib

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.name != "LOCK"}


def test_store_of_another_geometry_is_kept(tmp_path, capsys):
    """DATA_DIR/models-store made with another geometry was emptied (the
    engine's reset, exit 0): refused now, exit 1, naming the mismatch and
    --fresh, the store left as it was; --fresh starts over."""
    model = write_tiny_llama(str(tmp_path / "tiny.Q4_1.gguf"), qtype="Q4_1", seed=4)
    assert two_models.run(args_for(tmp_path, model, questions=1), io.StringIO()) == 0
    store = tmp_path / "data" / "models-store"
    before = _digest(store)
    other = write_tiny_llama(str(tmp_path / "other.Q4_1.gguf"), qtype="Q4_1", seed=4, n_layers=3)
    capsys.readouterr()
    rc = two_models.run(args_for(tmp_path, other, questions=1), io.StringIO())
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1, err
    assert len(err) == 1 and "--fresh" in err[0] and "num_layers" in err[0], err
    assert "disk_reset_on_mismatch" not in err[0]
    assert _digest(store) == before  # every file as it was, its size included
    assert two_models.run(args_for(tmp_path, other, questions=1, fresh=True), io.StringIO()) == 0
    assert _digest(store) != before


@pytest.mark.parametrize("budget", [0, 1, 4096])
def test_disk_budget_below_one_slot_is_a_usage_error(budget, tmp_path, capsys):
    """--disk-budget 1 reached the engine (InvalidArgumentError, exit 1)
    after the data directory, the second model and the store were made:
    exit 2 naming --disk-budget now, nothing created."""
    model = write_tiny_llama(str(tmp_path / "tiny.Q4_1.gguf"), qtype="Q4_1", seed=4)
    rc = two_models.run(args_for(tmp_path, model, disk_budget=budget), io.StringIO())
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and f"--disk-budget {budget}" in err[0], err
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("what", ["truncated", "/dev/null", "fifo"])
def test_damaged_model_fails_with_1(what, tmp_path, capsys):
    """A cut GGUF, /dev/null or a FIFO as --model ended as a bare
    ValueError (a usage error, 2): a file that cannot be used is a failure
    (1), named in one line, with nothing created."""
    path = unusable_model(what, tmp_path)
    rc = two_models.run(args_for(tmp_path, path), io.StringIO())
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and str(path) in err[0] and "--model" in err[0], err
    assert not (tmp_path / "data").exists()


def test_a_non_regular_model_b_is_read_never_written_over(tmp_path, capsys):
    """--model-b naming a FIFO (or a device such as /dev/null) was taken
    for a missing second model and replaced by the re-encoded one, exit 0:
    it is refused, left as it was, with nothing created."""
    import stat

    model = write_tiny_llama(str(tmp_path / "a.gguf"), qtype="Q4_1", seed=3)
    fifo = unusable_model("fifo", tmp_path)
    rc = two_models.run(args_for(tmp_path, model, model_b=str(fifo)), io.StringIO())
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "--model-b" in err[0] and "not a regular file" in err[0], err
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert not (tmp_path / "data").exists()
